//! Layering rules: which part of the code may name which crate or module.
//!
//! The decisions (core, replication, cluster control) are plain state machines driven by the
//! server; the client library stands without the server's storage. These rules are checked on
//! the source text, comments left out, so a rule broken by a new `use` fails here with the file
//! and line rather than in a review.

use std::path::{Path, PathBuf};

/// A part of the tree and the names its code must not use.
struct Rule {
    /// Directory or file, from the repository root.
    path: &'static str,
    forbidden: &'static [&'static str],
    why: &'static str,
}

/// Names that mean I/O, a clock, threads or the server's drivers.
const IO_AND_DRIVERS: &[&str] = &[
    "tokio",
    "quinn",
    "rocksdb",
    "crate::server",
    "Instant",
    "SystemTime",
    "std::thread",
    "std::fs",
    "std::net",
];

const RULES: &[Rule] = &[
    Rule {
        path: "src/control",
        forbidden: &[
            "tokio",
            "quinn",
            "rocksdb",
            "crate::server",
            "Instant",
            "SystemTime",
            "std::thread",
            "std::fs",
            "std::net",
            "tether_storage",
            "tether_transport",
            "tracing",
            "Mutex",
            "RwLock",
            "HashMap",
            "HashSet",
        ],
        why: "the cluster's decisions take time and observations as inputs, hold only ordered \
              maps (deterministic order), and leave execution and logging to server/",
    },
    Rule {
        path: "src/replication",
        forbidden: IO_AND_DRIVERS,
        why: "shipper and replica are sans-IO state machines",
    },
    Rule {
        path: "src/core",
        forbidden: &[
            "tokio",
            "quinn",
            "rocksdb",
            "crate::server",
            "crate::cluster",
            "Instant",
            "SystemTime",
            "std::thread",
            "std::fs",
            "std::net",
        ],
        why: "the node's core is a sans-IO state machine; time is passed in",
    },
    Rule {
        path: "src/interest.rs",
        forbidden: IO_AND_DRIVERS,
        why: "the interest index is sans-IO",
    },
    Rule {
        path: "storage/src",
        forbidden: &[
            "tokio",
            "quinn",
            "tether_transport",
            "tether_client",
            "tether::",
        ],
        why: "the storage crate knows nothing of the network or the node",
    },
    Rule {
        path: "client/src",
        forbidden: &["rocksdb", "tether_storage", "tether::"],
        why: "an application links the client without the server's storage",
    },
];

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn rust_files(path: &Path, out: &mut Vec<PathBuf>) {
    if path.is_file() {
        if path.extension().is_some_and(|e| e == "rs") {
            out.push(path.to_path_buf());
        }
        return;
    }
    let mut entries: Vec<PathBuf> = std::fs::read_dir(path)
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
        .map(|e| e.unwrap().path())
        .collect();
    entries.sort();
    for e in entries {
        rust_files(&e, out);
    }
}

/// The code of a line: without its `//` comment and the contents of string literals (a
/// string may hold `//`).
fn code_of(line: &str) -> String {
    let mut out = String::new();
    let mut chars = line.chars().peekable();
    let mut in_str = false;
    while let Some(c) = chars.next() {
        if in_str {
            match c {
                '\\' => {
                    chars.next();
                }
                '"' => {
                    in_str = false;
                    out.push('"');
                }
                _ => {}
            }
            continue;
        }
        match c {
            '"' => {
                in_str = true;
                out.push('"');
            }
            '/' if chars.peek() == Some(&'/') => break,
            _ => out.push(c),
        }
    }
    out
}

/// Whether `code` names `name` as a whole path segment (`Instant` but not `Instants`).
fn names(code: &str, name: &str) -> bool {
    let ident = |c: char| c.is_alphanumeric() || c == '_';
    code.match_indices(name).any(|(i, _)| {
        let before = code[..i].chars().next_back();
        let after = code[i + name.len()..].chars().next();
        !before.is_some_and(ident) && !after.is_some_and(|c| ident(c) && !name.ends_with(':'))
    })
}

/// The violations of `rule`: `file:line: name: the line`.
fn violations(rule: &Rule) -> Vec<String> {
    let mut files = Vec::new();
    rust_files(&root().join(rule.path), &mut files);
    assert!(!files.is_empty(), "{}: no Rust files found", rule.path);
    let mut found = Vec::new();
    for file in files {
        let text = std::fs::read_to_string(&file).unwrap();
        for (n, line) in text.lines().enumerate() {
            let code = code_of(line);
            for name in rule.forbidden {
                if names(&code, name) {
                    let rel = file.strip_prefix(root()).unwrap_or(&file);
                    found.push(format!(
                        "{}:{}: {name}: {}",
                        rel.display(),
                        n + 1,
                        line.trim()
                    ));
                }
            }
        }
    }
    found
}

#[test]
fn every_part_uses_only_what_its_layer_may() {
    let mut report = String::new();
    for rule in RULES {
        let v = violations(rule);
        if !v.is_empty() {
            report += &format!("{} ({}):\n  {}\n", rule.path, rule.why, v.join("\n  "));
        }
    }
    assert!(report.is_empty(), "layering rules broken:\n{report}");
}

#[test]
fn the_checker_sees_code_and_not_comments_or_strings() {
    assert!(names(&code_of("use tokio::sync::Mutex;"), "tokio"));
    assert!(names(&code_of("let t = Instant::now();"), "Instant"));
    assert!(names(
        &code_of("use crate::server::Shared;"),
        "crate::server"
    ));
    assert!(!names(&code_of("// tokio drives this"), "tokio"));
    assert!(!names(
        &code_of("/// the `Instant` of the start"),
        "Instant"
    ));
    assert!(!names(&code_of(r#"let s = "tokio // quinn";"#), "tokio"));
    assert!(!names(&code_of(r#"let s = "\"tokio\"";"#), "tokio"));
    assert!(!names(
        &code_of("let instants = 3; let tokio_like = 1;"),
        "tokio"
    ));
    assert!(!names(&code_of("struct Instants;"), "Instant"));
    assert!(names(&code_of("x.map(tokio::spawn)"), "tokio"));
    assert!(!names(&code_of("mytether::x"), "tether::"));
    assert!(names(&code_of("use tether::core;"), "tether::"));
}
