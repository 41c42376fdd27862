//! Layering rules: which part of the code may name which crate or module.
//!
//! The decisions (core, replication, cluster control) are plain state machines driven by the
//! server; the client library stands without the server's storage. These rules are checked on
//! the source text, comments left out, so a rule broken by a new `use` fails here with the file
//! and line rather than in a review. Modules must not import each other in a cycle, at the top
//! level of `src/` nor among the server's drivers.

use std::path::{Path, PathBuf};

/// A part of the tree and the names its code must not use.
struct Rule {
    /// Directory or file, from the repository root.
    path: &'static str,
    /// Lists of names, all forbidden.
    forbidden: &'static [&'static [&'static str]],
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
            IO_AND_DRIVERS,
            &[
                "tether_storage",
                "tether_transport",
                "tracing",
                "Mutex",
                "RwLock",
                "HashMap",
                "HashSet",
            ],
        ],
        why: "the cluster's decisions take time and observations as inputs, hold only ordered \
              maps (deterministic order), and leave execution and logging to server/",
    },
    Rule {
        path: "src/replication",
        forbidden: &[IO_AND_DRIVERS],
        why: "shipper and replica are sans-IO state machines",
    },
    Rule {
        path: "src/core",
        forbidden: &[IO_AND_DRIVERS, &["crate::cluster"]],
        why: "the node's core is a sans-IO state machine; time is passed in",
    },
    Rule {
        path: "src/interest.rs",
        forbidden: &[IO_AND_DRIVERS],
        why: "the interest index is sans-IO",
    },
    Rule {
        path: "storage/src",
        forbidden: &[&[
            "tokio",
            "quinn",
            "tether_transport",
            "tether_client",
            "tether::",
        ]],
        why: "the storage crate knows nothing of the network or the node",
    },
    Rule {
        path: "client/src",
        forbidden: &[&["rocksdb", "tether_storage", "tether::"]],
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
            for name in rule.forbidden.iter().copied().flatten() {
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

/// The modules a file's code names: `crate::name` (top level) or, with `siblings`, `super::name`.
fn named_modules(code: &str, prefix: &str, out: &mut std::collections::BTreeSet<String>) {
    for (i, _) in code.match_indices(prefix) {
        let before = code[..i].chars().next_back();
        if before.is_some_and(|c| c.is_alphanumeric() || c == '_' || c == ':') {
            continue;
        }
        let name: String = code[i + prefix.len()..]
            .chars()
            .take_while(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || *c == '_')
            .collect();
        if !name.is_empty() {
            out.insert(name);
        }
    }
}

/// The module graph of the directory `dir` (each `.rs` file or subdirectory is a module; a
/// module's files are read whole): module -> the modules of the same graph it names through
/// `prefix`.
fn module_graph(
    dir: &str,
    prefix: &str,
) -> std::collections::BTreeMap<String, std::collections::BTreeSet<String>> {
    let base = root().join(dir);
    let mut modules = std::collections::BTreeMap::new();
    for entry in std::fs::read_dir(&base).unwrap() {
        let path = entry.unwrap().path();
        let name = path.file_stem().unwrap().to_string_lossy().to_string();
        if matches!(name.as_str(), "mod" | "lib" | "main") {
            continue;
        }
        if path.is_file() && path.extension().is_none_or(|e| e != "rs") {
            continue;
        }
        let mut files = Vec::new();
        rust_files(&path, &mut files);
        let mut names = std::collections::BTreeSet::new();
        for f in files {
            let text = std::fs::read_to_string(&f).unwrap();
            for line in text.lines() {
                named_modules(&code_of(line), prefix, &mut names);
            }
        }
        modules.insert(name, names);
    }
    let known: std::collections::BTreeSet<String> = modules.keys().cloned().collect();
    for (name, names) in modules.iter_mut() {
        names.retain(|n| known.contains(n) && n != name);
    }
    modules
}

/// A cycle of `graph`, if there is one (depth-first search), as the modules along it.
fn find_cycle(
    graph: &std::collections::BTreeMap<String, std::collections::BTreeSet<String>>,
) -> Option<Vec<String>> {
    fn visit(
        graph: &std::collections::BTreeMap<String, std::collections::BTreeSet<String>>,
        node: &str,
        path: &mut Vec<String>,
        done: &mut std::collections::BTreeSet<String>,
    ) -> Option<Vec<String>> {
        if let Some(at) = path.iter().position(|n| n == node) {
            let mut cycle = path[at..].to_vec();
            cycle.push(node.to_string());
            return Some(cycle);
        }
        if done.contains(node) {
            return None;
        }
        path.push(node.to_string());
        for next in graph.get(node).into_iter().flatten() {
            if let Some(c) = visit(graph, next, path, done) {
                return Some(c);
            }
        }
        path.pop();
        done.insert(node.to_string());
        None
    }
    let mut done = std::collections::BTreeSet::new();
    graph
        .keys()
        .find_map(|n| visit(graph, n, &mut Vec::new(), &mut done))
}

#[test]
fn modules_do_not_import_each_other_in_a_cycle() {
    for (dir, prefix) in [("src", "crate::"), ("src/server", "super::")] {
        let graph = module_graph(dir, prefix);
        assert!(graph.len() > 5, "{dir}: too few modules found: {graph:?}");
        if let Some(cycle) = find_cycle(&graph) {
            panic!("{dir}: modules import each other: {}", cycle.join(" -> "));
        }
    }
}

#[test]
fn the_cycle_finder_finds_cycles() {
    let g = |edges: &[(&str, &str)]| {
        let mut m: std::collections::BTreeMap<String, std::collections::BTreeSet<String>> =
            Default::default();
        for (a, b) in edges {
            m.entry(a.to_string()).or_default().insert(b.to_string());
            m.entry(b.to_string()).or_default();
        }
        m
    };
    assert_eq!(find_cycle(&g(&[("a", "b"), ("b", "c"), ("a", "c")])), None);
    assert_eq!(
        find_cycle(&g(&[("a", "b"), ("b", "c"), ("c", "a")])),
        Some(vec!["a".into(), "b".into(), "c".into(), "a".into()])
    );
    let mut names = std::collections::BTreeSet::new();
    named_modules(
        "use crate::core::X; crate::limits::Y; mycrate::z; super::super::w",
        "crate::",
        &mut names,
    );
    assert_eq!(
        names.into_iter().collect::<Vec<_>>(),
        vec!["core", "limits"]
    );
}

/// The error types of `Result<…>`s written in `code` that are `String`: errors are typed
/// enums, so a caller can tell one failure from another.
fn string_errors(code: &str) -> usize {
    let mut count = 0;
    for (start, _) in code.match_indices("Result<") {
        let args = &code[start + "Result<".len()..];
        let (mut depth, mut last_comma, mut end) = (0i32, None, None);
        for (i, c) in args.char_indices() {
            match c {
                '<' | '(' | '[' => depth += 1,
                '>' if depth == 0 => {
                    end = Some(i);
                    break;
                }
                '>' | ')' | ']' => depth -= 1,
                ',' if depth == 0 => last_comma = Some(i),
                _ => {}
            }
        }
        if let (Some(comma), Some(end)) = (last_comma, end)
            && args[comma + 1..end].trim() == "String"
        {
            count += 1;
        }
    }
    count
}

#[test]
fn errors_are_typed_not_strings() {
    let mut found = Vec::new();
    for path in ["src", "storage/src", "transport/src", "client/src"] {
        let mut files = Vec::new();
        rust_files(&root().join(path), &mut files);
        for file in files {
            let text = std::fs::read_to_string(&file).unwrap();
            // Unit tests (at the end of a file) may use what they like.
            for (n, line) in text.lines().enumerate() {
                if line.trim_start().starts_with("#[cfg(test)]") {
                    break;
                }
                if string_errors(&code_of(line)) > 0 {
                    let rel = file.strip_prefix(root()).unwrap_or(&file);
                    found.push(format!("{}:{}: {}", rel.display(), n + 1, line.trim()));
                }
            }
        }
    }
    assert!(
        found.is_empty(),
        "a Result with a String error (use a typed error enum, thiserror):\n  {}",
        found.join("\n  ")
    );
}

#[test]
fn the_string_error_checker_reads_the_error_type_only() {
    assert_eq!(string_errors("fn f() -> Result<(), String> {"), 1);
    assert_eq!(string_errors(") -> Result<(Vec<u8>, usize), String> {"), 1);
    assert_eq!(string_errors("fn f() -> Result<String, ConfigError> {"), 0);
    assert_eq!(
        string_errors("fn f() -> Result<Vec<(u64, Option<String>)>, E> {"),
        0
    );
    assert_eq!(
        string_errors("type T = oneshot::Receiver<Result<(), String>>;"),
        1
    );
    assert_eq!(string_errors("let r: Result<u8, Box<String>> = x;"), 0);
}
