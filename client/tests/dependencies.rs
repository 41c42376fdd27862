//! The client crate is what an application depends on to subscribe or publish: it must never
//! pull in the server's storage (RocksDB, whose C++ build takes most of a clean build) or its
//! consensus (openraft). Read from `cargo tree` of this package.

use std::process::Command;

/// Packages that belong to the server and must not be in the client's dependency tree.
const SERVER_ONLY: [&str; 5] = [
    "tether",
    "tether-storage",
    "rocksdb",
    "librocksdb-sys",
    "openraft",
];

#[test]
fn the_client_never_depends_on_the_server_parts() {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let out = Command::new(cargo)
        .args([
            "tree",
            "--offline",
            "-p",
            "tether-client",
            "-e",
            "normal,build",
            "--prefix",
            "none",
        ])
        // As cargo names it now: the path compiled in may be another checkout's (a target
        // directory shared between checkouts reuses an unchanged test binary).
        .current_dir(
            std::env::var_os("CARGO_MANIFEST_DIR")
                .unwrap_or_else(|| env!("CARGO_MANIFEST_DIR").into()),
        )
        .output()
        .expect("cargo tree runs");
    assert!(
        out.status.success(),
        "cargo tree failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let tree = String::from_utf8_lossy(&out.stdout);
    let packages: Vec<&str> = tree
        .lines()
        .filter_map(|l| l.split_whitespace().next())
        .collect();
    assert!(
        packages.contains(&"quinn") && packages.contains(&"tether-transport"),
        "not the client's tree: {tree}"
    );
    for p in SERVER_ONLY {
        assert!(!packages.contains(&p), "the client depends on {p}:\n{tree}");
    }
}
