//! Progress bars for the long phases (on stderr; indicatif hides them when stderr is not a
//! terminal, so logs and pipes get only the tables).

use indicatif::{ProgressBar, ProgressStyle};

/// A bar of `len` steps named `what`.
pub fn bar(len: u64, what: &str) -> ProgressBar {
    let bar = ProgressBar::new(len);
    bar.set_style(
        ProgressStyle::with_template(
            "{msg:<34} [{bar:30}] {human_pos}/{human_len} {per_sec:>12} eta {eta}",
        )
        .expect("valid template")
        .progress_chars("=> "),
    );
    bar.set_message(what.to_string());
    bar
}
