//! [`WalReaper`]: deletes the write-ahead log files RocksDB no longer needs a little at a
//! time, so the writes of that moment do not wait behind the file system.
//!
//! RocksDB deletes a log file as soon as every column family with data in it has been
//! flushed. A rarely written column family (`marks`) holds the logs back until their total
//! reaches [`crate::rocks::WAL_BYTES_MAX`]; then one flush releases about 240 MB of them and
//! RocksDB unlinks them all at once. Freeing that many blocks in one journal commit (with
//! the `discard` mount option, which cloud images often set, it also trims them) makes the
//! next fsyncs of the live log wait: in the replay benchmark a burst of 400 to 700 live
//! events took 5 to 16 ms, setting the idle p99.
//!
//! The store therefore has RocksDB *archive* obsolete logs (a rename into `archive/`, with
//! a time-to-live of [`WAL_ARCHIVE_TTL_SECS`] as RocksDB's own safety net), and this thread
//! shrinks each archived file by [`WAL_DELETE_CHUNK_BYTES`] per step at
//! [`WAL_DELETE_BYTES_PER_SEC`] before unlinking it, oldest first. Past
//! [`WAL_ARCHIVE_BACKLOG_BYTES_MAX`] of archived logs it stops pacing itself, so a writer
//! faster than the pace cannot fill the disk.
//!
//! The reaper owns no state but the directory: a file it could not delete (an I/O error) is
//! tried again on its next pass, and archived files left by a stopped process are deleted
//! when the store is opened again.

use std::path::{Path, PathBuf};
use std::sync::mpsc::{self, RecvTimeoutError};
use std::thread::JoinHandle;
use std::time::Duration;

/// Bytes the reaper frees in one step (one `ftruncate`), so one journal commit frees at
/// most this much.
pub const WAL_DELETE_CHUNK_BYTES: u64 = 1 << 20;
/// The reaper's pace while the archive is below [`WAL_ARCHIVE_BACKLOG_BYTES_MAX`], in bytes
/// per second (well above the log rate of a node publishing a million 128-byte events in
/// five seconds, about 60 MB/s).
pub const WAL_DELETE_BYTES_PER_SEC: u64 = 128 << 20;
/// Archived log bytes beyond which the reaper deletes without pausing, in bytes.
pub const WAL_ARCHIVE_BACKLOG_BYTES_MAX: u64 = 1 << 30;
/// How often the reaper looks for newly archived files when it has nothing to do, in
/// milliseconds.
pub const WAL_ARCHIVE_POLL_MS: u64 = 100;
/// RocksDB's own time-to-live for archived logs, in seconds: it deletes older ones at once
/// (checked every half of it). Only reached if the reaper cannot keep up or fails.
pub const WAL_ARCHIVE_TTL_SECS: u64 = 3600;

/// The reaper logs a failure to delete at most once per this many seconds (it retries
/// every [`WAL_ARCHIVE_POLL_MS`]).
pub const WAL_REAPER_WARN_INTERVAL_SECS: u64 = 60;

/// The sub-directory of a RocksDB WAL directory that archived logs are moved into.
pub const WAL_ARCHIVE_DIR: &str = "archive";

/// A thread deleting archived log files at a bounded pace; stopped and joined on drop.
pub struct WalReaper {
    stop: Option<mpsc::Sender<()>>,
    thread: Option<JoinHandle<()>>,
}

impl WalReaper {
    /// Starts reaping `archive` (a RocksDB WAL directory's `archive/`, which need not exist
    /// yet).
    pub fn spawn(archive: PathBuf) -> std::io::Result<Self> {
        let (stop, stopped) = mpsc::channel();
        let thread = std::thread::Builder::new()
            .name("tether-wal-reaper".into())
            .spawn(move || run(&archive, &stopped))?;
        Ok(WalReaper {
            stop: Some(stop),
            thread: Some(thread),
        })
    }
}

impl Drop for WalReaper {
    fn drop(&mut self) {
        drop(self.stop.take());
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// Pause after freeing `bytes` while paced.
fn pause_for(bytes: u64) -> Duration {
    Duration::from_micros(bytes.saturating_mul(1_000_000) / WAL_DELETE_BYTES_PER_SEC)
}

/// The reaper's loop: one pass over the archive, then wait for the next poll. Returns when
/// the store drops its sender.
fn run(archive: &Path, stopped: &mpsc::Receiver<()>) {
    // Sleeps `d`; false once the store has asked the reaper to stop.
    let wait = |d: Duration| {
        matches!(
            stopped.recv_timeout(d),
            Ok(()) | Err(RecvTimeoutError::Timeout)
        )
    };
    // When a failure was last logged: a file that cannot be deleted fails on every pass.
    let mut warned: Option<std::time::Instant> = None;
    loop {
        let mut files = log_files(archive);
        let mut backlog: u64 = files.iter().map(|(_, len)| len).sum();
        files.sort();
        for (path, len) in files {
            match shrink_and_remove(&path, len, &mut backlog, &wait) {
                Ok(true) => {}
                Ok(false) => return,
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => {
                    let quiet = Duration::from_secs(WAL_REAPER_WARN_INTERVAL_SECS);
                    if warned.is_none_or(|at| at.elapsed() >= quiet) {
                        warned = Some(std::time::Instant::now());
                        tracing::warn!(path = %path.display(), error = %e, "could not delete an archived write-ahead log; retrying on every pass (this warning at most once a minute)");
                    }
                }
            }
        }
        if !wait(Duration::from_millis(WAL_ARCHIVE_POLL_MS)) {
            return;
        }
    }
}

/// The log files (`*.log`) in `dir` (the archive, or the WAL directory itself) with their
/// lengths; empty if the directory does not exist (yet).
pub(crate) fn log_files(dir: &Path) -> Vec<(PathBuf, u64)> {
    let Ok(dir) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    dir.filter_map(Result::ok)
        .filter(|e| e.path().extension().is_some_and(|x| x == "log"))
        .filter_map(|e| Some((e.path(), e.metadata().ok()?.len())))
        .collect()
}

/// Truncates `path` by [`WAL_DELETE_CHUNK_BYTES`] at a time (paced while `backlog` is below
/// [`WAL_ARCHIVE_BACKLOG_BYTES_MAX`]), then removes it. `Ok(false)`: asked to stop first.
fn shrink_and_remove(
    path: &Path,
    len: u64,
    backlog: &mut u64,
    wait: &impl Fn(Duration) -> bool,
) -> std::io::Result<bool> {
    let file = std::fs::OpenOptions::new().write(true).open(path)?;
    let mut left = len;
    while left > 0 {
        let step = left.min(WAL_DELETE_CHUNK_BYTES);
        left -= step;
        file.set_len(left)?;
        *backlog = backlog.saturating_sub(step);
        // Unpaced past the backlog limit, but still told to stop between steps.
        let pause = if *backlog < WAL_ARCHIVE_BACKLOG_BYTES_MAX {
            pause_for(step)
        } else {
            Duration::ZERO
        };
        if !wait(pause) {
            return Ok(false);
        }
    }
    drop(file);
    std::fs::remove_file(path)?;
    Ok(true)
}

/// Waits (up to a generous deadline, polling) until `archive` holds no log file; what is
/// left then.
#[cfg(test)]
pub(crate) fn wait_until_empty(archive: &Path) -> Vec<(PathBuf, u64)> {
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    loop {
        let left = log_files(archive);
        if left.is_empty() || std::time::Instant::now() > deadline {
            return left;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn archived_logs_are_deleted_and_other_files_left_alone() {
        let dir = tempfile::tempdir().unwrap();
        let archive = dir.path().join(WAL_ARCHIVE_DIR);
        // The directory appears after the reaper has started, as RocksDB creates it lazily.
        let reaper = WalReaper::spawn(archive.clone()).unwrap();
        std::fs::create_dir(&archive).unwrap();
        for (name, len) in [
            ("000007.log", 3 * WAL_DELETE_CHUNK_BYTES + 5),
            ("000009.log", 0),
        ] {
            std::fs::write(archive.join(name), vec![7u8; len as usize]).unwrap();
        }
        std::fs::write(archive.join("notes.txt"), b"keep").unwrap();
        assert_eq!(wait_until_empty(&archive), Vec::new());
        assert_eq!(std::fs::read(archive.join("notes.txt")).unwrap(), b"keep");
        drop(reaper);
    }

    #[test]
    fn a_stopped_reaper_returns_promptly_and_leaves_what_it_did_not_finish() {
        let dir = tempfile::tempdir().unwrap();
        let archive = dir.path().join(WAL_ARCHIVE_DIR);
        std::fs::create_dir(&archive).unwrap();
        // Large enough that the paced reaper is still at it when told to stop (64 MB takes
        // half a second at the pace).
        let len = 64 * WAL_DELETE_CHUNK_BYTES;
        let file = std::fs::File::create(archive.join("000011.log")).unwrap();
        file.set_len(len).unwrap();
        drop(file);
        let reaper = WalReaper::spawn(archive.clone()).unwrap();
        std::thread::sleep(Duration::from_millis(50));
        drop(reaper);
        // Stopped mid-file: what it had not shrunk yet stays, whole chunks only, and nothing
        // changes any more.
        let left = log_files(&archive);
        assert_eq!(left.len(), 1, "{left:?}");
        let (_, l) = left[0];
        assert!(l < len, "the reaper had started shrinking: {l}");
        assert_eq!(l % WAL_DELETE_CHUNK_BYTES, 0);
        std::thread::sleep(Duration::from_millis(100));
        assert_eq!(log_files(&archive), left);
        // A new reaper (the store opened again) finishes the job.
        let _again = WalReaper::spawn(archive.clone()).unwrap();
        assert_eq!(wait_until_empty(&archive), Vec::new());
    }

    #[test]
    fn the_pace_is_the_named_rate() {
        assert_eq!(pause_for(WAL_DELETE_BYTES_PER_SEC), Duration::from_secs(1));
        assert_eq!(pause_for(0), Duration::ZERO);
    }
}
