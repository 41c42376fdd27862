//! Keeps the release packaging (`make dist`, `dist/`) true to the code: the example
//! configuration loads and documents the defaults, the systemd unit only passes flags the
//! server accepts, LICENSE is the license Cargo.toml names, and the install guide's links
//! resolve in the repository and in the tarball.

use std::path::{Path, PathBuf};
use std::process::Command;

use tether::config::{
    FileConfig, Limits, LogFormat, METRICS_TOP_QUEUES_DEFAULT, NODE_FAILURE_MS_DEFAULT,
    SERVER_LOG_FILTER_DEFAULT, ServerConfig,
};

/// The package's directory as cargo names it when it runs this test. The path compiled in
/// (`env!`) may be another checkout's: a target directory shared between checkouts reuses a
/// test binary whose sources did not change.
fn root() -> PathBuf {
    std::env::var_os("CARGO_MANIFEST_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")))
}

fn read(rel: &str) -> String {
    let p = root().join(rel);
    std::fs::read_to_string(&p).unwrap_or_else(|e| panic!("cannot read {}: {e}", p.display()))
}

/// A commented-out setting or table header of the example: `# key = value`, `# [table]`.
fn commented_setting(line: &str) -> Option<&str> {
    let rest = line.strip_prefix("# ")?;
    let key_end =
        rest.find(|c: char| !(c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-'))?;
    let is_setting = key_end > 0 && rest[key_end..].starts_with(" = ");
    let header = rest.split('#').next().unwrap_or("").trim_end();
    let is_table = header.starts_with('[') && header.ends_with(']') && !header.contains(' ');
    (is_setting || is_table).then_some(rest)
}

#[test]
fn example_config_loads_as_shipped() {
    let path = root().join("dist/tether.toml.example");
    let file = FileConfig::load(&path).expect("dist/tether.toml.example loads");
    let limits = file.limits.expect("the example has a [limits] table");
    limits.validate().expect("the example's limits validate");
    assert_eq!(
        limits,
        Limits::default(),
        "[limits] as shipped is the defaults"
    );
    assert_eq!(file.data_dir.as_deref(), Some(Path::new("/var/lib/tether")));
    tether::config::parse_addr("listen", file.listen.as_deref().expect("listen")).unwrap();
    tether::config::parse_metrics(file.metrics.as_deref().expect("metrics")).unwrap();
    // Shipped open: auth, tls and cluster are left for the operator to configure.
    assert!(file.auth.is_none() && file.tls.is_none() && file.cluster.is_none());
}

#[test]
fn example_config_commented_settings_are_accepted_and_defaults_are_true() {
    let text = read("dist/tether.toml.example");
    let uncommented: String = text
        .lines()
        .map(|l| commented_setting(l).unwrap_or(l))
        .collect::<Vec<_>>()
        .join("\n");
    let file: FileConfig = toml::from_str(&uncommented).unwrap_or_else(|e| {
        panic!("the example with every setting uncommented does not parse: {e}\n{uncommented}")
    });
    // The values shown are the defaults.
    assert_eq!(file.metrics_top_queues, Some(METRICS_TOP_QUEUES_DEFAULT));
    assert_eq!(file.log_format, Some(LogFormat::Text));
    assert_eq!(file.log_level.as_deref(), Some(SERVER_LOG_FILTER_DEFAULT));
    assert_eq!(file.direct_io, Some(ServerConfig::default().direct_io));
    let limits = file.limits.expect("[limits]");
    assert_eq!(
        limits,
        Limits::default(),
        "[limits] comments show the defaults"
    );
    let cluster = file.cluster.expect("[cluster]");
    assert_eq!(cluster.node_failure_ms, Some(NODE_FAILURE_MS_DEFAULT));
    assert_eq!(cluster.rebalance, Some(true));
    for p in &cluster.peers {
        tether::config::parse_peer(p).unwrap_or_else(|e| panic!("peer {p}: {e}"));
    }
    tether::config::validate_node_id(file.node_id.as_deref().expect("node-id")).unwrap();
    for name in file.advertise.expect("advertise") {
        tether::config::validate_advertise(&name).unwrap();
    }
    let auth = file.auth.expect("[auth]");
    assert!(!auth.tokens.is_empty() && !auth.acl.is_empty());
    tether::auth::Authorizer::new(&auth).expect("the example [auth] table is valid");
    assert!(file.tls.is_some());
}

#[test]
fn service_unit_passes_only_flags_the_server_accepts() {
    let unit = read("dist/tether.service");
    let exec: Vec<&str> = unit
        .lines()
        .find_map(|l| l.strip_prefix("ExecStart="))
        .expect("ExecStart=")
        .split_whitespace()
        .collect();
    assert_eq!(exec[..2], ["/usr/local/bin/tether", "server"]);
    let help = Command::new(env!("CARGO_BIN_EXE_tether"))
        .args(["server", "--help"])
        .output()
        .expect("run tether server --help");
    assert!(help.status.success());
    let help = String::from_utf8(help.stdout).unwrap();
    let flags: Vec<&str> = exec
        .iter()
        .copied()
        .filter(|a| a.starts_with("--"))
        .collect();
    assert!(!flags.is_empty());
    for flag in flags {
        let name = flag.split('=').next().unwrap();
        assert!(
            help.contains(&format!("{name} ")) || help.contains(&format!("{name}\n")),
            "ExecStart passes {name}, which `tether server --help` does not list:\n{help}"
        );
    }
    let value = |flag: &str| {
        let i = exec
            .iter()
            .position(|a| *a == flag)
            .unwrap_or_else(|| panic!("{flag}"));
        exec[i + 1]
    };
    // The data directory is the one systemd creates for the service user.
    assert_eq!(value("--data-dir"), "/var/lib/tether");
    for line in ["User=tether", "StateDirectory=tether", "Restart=on-failure"] {
        assert!(unit.lines().any(|l| l == line), "the unit lacks {line}");
    }
    // The install guide puts the configuration where the unit reads it.
    let config = value("--config");
    assert!(
        read("dist/INSTALL.md").contains(config),
        "INSTALL.md never names {config}"
    );
}

#[test]
fn license_is_the_one_cargo_toml_names() {
    let license = read("LICENSE");
    let mut lines = license.lines().map(str::trim).filter(|l| !l.is_empty());
    assert_eq!(lines.next(), Some("Apache License"));
    assert_eq!(lines.next(), Some("Version 2.0, January 2004"));
    assert!(license.contains("TERMS AND CONDITIONS FOR USE, REPRODUCTION, AND DISTRIBUTION"));
    assert!(license.contains("END OF TERMS AND CONDITIONS"));
    assert!(license.contains("APPENDIX: How to apply the Apache License to your work."));
    let cargo = read("Cargo.toml");
    assert!(
        cargo
            .lines()
            .any(|l| l.trim() == "license = \"Apache-2.0\""),
        "Cargo.toml's license is not Apache-2.0"
    );
}

#[test]
fn changelog_names_the_version() {
    let cargo = read("Cargo.toml");
    let version = cargo
        .lines()
        .skip_while(|l| l.trim() != "[workspace.package]")
        .find_map(|l| l.trim().strip_prefix("version = "))
        .expect("[workspace.package] version")
        .trim_matches('"');
    let changelog = read("CHANGELOG.md");
    assert!(changelog.starts_with("# Changelog"));
    assert!(
        changelog.contains(version),
        "CHANGELOG.md never names {version}"
    );
}

/// GitHub's anchor of a heading.
fn slug(heading: &str) -> String {
    heading
        .trim()
        .to_lowercase()
        .chars()
        .filter(|c| c.is_alphanumeric() || matches!(c, ' ' | '-' | '_'))
        .map(|c| if c == ' ' { '-' } else { c })
        .collect()
}

/// The `](target)` links of a Markdown text.
fn links(text: &str) -> Vec<&str> {
    text.match_indices("](")
        .filter_map(|(i, _)| {
            let rest = &text[i + 2..];
            rest.find(')').map(|end| &rest[..end])
        })
        .collect()
}

#[test]
fn install_guide_links_resolve_in_the_repository_and_the_tarball() {
    let guide = read("dist/INSTALL.md");
    let links = links(&guide);
    assert!(links.iter().any(|l| l.starts_with("../docs/operations.md")));
    // What `make dist` ships at the tarball's root besides bin/ and docs/*.md; the Makefile
    // strips `../` from the guide's links, so `../X` must be shipped as X and a link to a
    // file of dist/ must be shipped next to the guide.
    let shipped_root = ["README.md", "LICENSE", "CHANGELOG.md"];
    let shipped_dist = ["tether.toml.example", "tether.service", "INSTALL.md"];
    let makefile = read("Makefile");
    for f in shipped_root.iter().chain(&shipped_dist).chain(&["docs/"]) {
        assert!(
            makefile.contains(f),
            "the Makefile's dist target does not ship {f}"
        );
    }
    for link in links {
        if link.starts_with("http://") || link.starts_with("https://") || link.starts_with('#') {
            continue;
        }
        let (file, anchor) = link.split_once('#').unwrap_or((link, ""));
        let target = root().join("dist").join(file);
        assert!(target.is_file(), "INSTALL.md links to {link}: no such file");
        let in_tarball = match file.strip_prefix("../") {
            Some(up) => {
                shipped_root.contains(&up)
                    || up
                        .strip_prefix("docs/")
                        .is_some_and(|d| !d.contains('/') && d.ends_with(".md"))
            }
            None => shipped_dist.contains(&file),
        };
        assert!(
            in_tarball,
            "INSTALL.md links to {link}, which `make dist` does not ship"
        );
        if !anchor.is_empty() {
            let text = std::fs::read_to_string(&target).unwrap();
            let found = text
                .lines()
                .filter_map(|l| l.strip_prefix('#'))
                .any(|h| slug(h.trim_start_matches('#')) == anchor);
            assert!(found, "INSTALL.md links to {link}: no such heading");
        }
    }
}
