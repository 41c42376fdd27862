//! `tether server`'s configuration from flags, `TETHER_*` variables and the TOML file
//! (`--print-config`), its logs, and the command line's usage errors, help and completions:
//! the real binary, each test in its own temp dir, servers on port 0.

use std::io::{BufRead, BufReader, Read};
use std::path::Path;
use std::process::{Child, Command, Output, Stdio};
use std::sync::mpsc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use serde_json::Value;

/// Upper bound for anything a test waits on.
const WAIT: Duration = Duration::from_secs(20);

/// `tether ARGS` with `env` set and no inherited `TETHER_*`, `RUST_LOG` or `NO_COLOR`.
fn command(args: &[&str], env: &[(&str, &str)]) -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_tether"));
    c.args(args).stdin(Stdio::null());
    for (k, _) in std::env::vars_os() {
        if k.to_string_lossy().starts_with("TETHER_") {
            c.env_remove(k);
        }
    }
    c.env_remove("RUST_LOG").env_remove("NO_COLOR");
    for (k, v) in env {
        c.env(k, v);
    }
    c
}

/// Runs a command that exits by itself.
fn run(args: &[&str], env: &[(&str, &str)]) -> Output {
    command(args, env).output().expect("run tether")
}

fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// Exit status 0; stdout.
fn ok(args: &[&str], env: &[(&str, &str)]) -> String {
    let o = run(args, env);
    assert!(
        o.status.success(),
        "tether {args:?} failed ({}): {}",
        o.status,
        stderr(&o)
    );
    stdout(&o)
}

/// Exit status 2 (a usage error), nothing on stdout; stderr, whose first line is the error.
fn usage_error(args: &[&str], env: &[(&str, &str)]) -> String {
    let o = run(args, env);
    let err = stderr(&o);
    assert_eq!(o.status.code(), Some(2), "tether {args:?} {env:?}: {err}");
    assert!(
        o.stdout.is_empty(),
        "tether {args:?}: stdout {}",
        stdout(&o)
    );
    assert!(err.starts_with("error: "), "tether {args:?}: {err}");
    assert!(err.contains("--help"), "points to --help: {err}");
    err
}

/// `tether server --print-config` parsed as TOML.
fn print_config(args: &[&str], env: &[(&str, &str)]) -> (String, toml::Table) {
    let mut all = vec!["server", "--print-config"];
    all.extend_from_slice(args);
    let text = ok(&all, env);
    let table = toml::from_str(&text).unwrap_or_else(|e| panic!("not TOML: {e}\n{text}"));
    (text, table)
}

fn get<'a>(t: &'a toml::Table, path: &str) -> &'a toml::Value {
    let mut parts = path.split('.');
    let mut v = t
        .get(parts.next().unwrap())
        .unwrap_or_else(|| panic!("{path} missing"));
    for p in parts {
        v = v.get(p).unwrap_or_else(|| panic!("{path} missing"));
    }
    v
}

fn s(path: &Path) -> String {
    path.display().to_string()
}

#[test]
fn print_config_takes_flag_over_env_over_file_over_default() {
    let tmp = tempfile::tempdir().unwrap();
    let data = tmp.path().join("data-from-file");
    let cfg = tmp.path().join("tether.toml");
    std::fs::write(
        &cfg,
        format!(
            r#"data-dir = {:?}
listen = "127.0.0.1:7501"
metrics = "off"
sync = "none"
metrics-top-queues = 7
log-format = "json"
[limits]
idle-timeout-ms = 40000
queue-full-policy = "block"
[cluster]
node-failure-ms = 4000
rebalance = false
peers = ["n1=127.0.0.1:7401"]
"#,
            s(&data)
        ),
    )
    .unwrap();
    let cfg_s = s(&cfg);
    let (text, t) = print_config(
        &["--sync", "always", "--node-failure-ms", "5000"],
        &[
            ("TETHER_CONFIG", &cfg_s),
            // variable over file
            ("TETHER_LISTEN", "127.0.0.1:7502"),
            ("TETHER_IDLE_TIMEOUT_MS", "45000"),
            ("TETHER_REBALANCE", "true"),
            // flag over variable over file
            ("TETHER_SYNC", "batch"),
            ("TETHER_NODE_FAILURE_MS", "6000"),
            // variable over default
            ("TETHER_QUEUE_ENTRIES_MAX", "1234"),
            ("TETHER_PEERS", "n1=127.0.0.1:7401,n2=127.0.0.1:7402"),
            ("TETHER_NODE_ID", "n1"),
        ],
    );
    let want: &[(&str, toml::Value)] = &[
        ("sync", "always".into()),                             // flag > env > file
        ("cluster.node-failure-ms", 5000.into()),              // flag > env > file
        ("listen", "127.0.0.1:7502".into()),                   // env > file
        ("limits.idle-timeout-ms", 45000.into()),              // env > file
        ("cluster.rebalance", true.into()),                    // env > file
        ("limits.queue-entries-max", 1234.into()),             // env > default
        ("node-id", "n1".into()),                              // env
        ("data-dir", s(&data).into()),                         // file > default
        ("metrics", "off".into()),                             // file > default
        ("metrics-top-queues", 7.into()),                      // file > default
        ("log-format", "json".into()),                         // file > default
        ("limits.queue-full-policy", "block".into()),          // file > default
        ("limits.queue-bytes-max", 17179869184i64.into()),     // default
        ("log-level", "warn,tether=info,openraft=off".into()), // default
    ];
    for (path, v) in want {
        assert_eq!(get(&t, path), v, "{path} in\n{text}");
    }
    assert_eq!(
        get(&t, "cluster.peers"),
        &toml::Value::Array(vec!["n1=127.0.0.1:7401".into(), "n2=127.0.0.1:7402".into()]),
        "env replaces the file's peers:\n{text}"
    );
    // Nothing was started or created.
    assert!(!data.exists(), "--print-config created the data dir");

    // The defaults alone: no file, no variable.
    let (text, t) = print_config(&["--data-dir", &s(&tmp.path().join("d"))], &[]);
    assert_eq!(get(&t, "listen").as_str(), Some("127.0.0.1:7400"), "{text}");
    assert_eq!(get(&t, "metrics").as_str(), Some("127.0.0.1:9400"));
    assert_eq!(get(&t, "sync").as_str(), Some("batch"));
    assert_eq!(get(&t, "metrics-top-queues").as_integer(), Some(20));
    assert_eq!(get(&t, "cluster.rebalance").as_bool(), Some(true));
    assert!(t.get("node-id").is_none(), "{text}");
    assert!(!tmp.path().join("d").exists());
}

#[test]
fn print_config_output_read_back_prints_the_same() {
    let tmp = tempfile::tempdir().unwrap();
    let cfg = tmp.path().join("in.toml");
    std::fs::write(
        &cfg,
        r#"sync = "none"
advertise = ["tether-1.example.com"]
[tls]
cert = "/etc/tether/server.pem"
key = "/etc/tether/server.key"
ca = "/etc/tether/ca.pem"
[auth]
admins = ["ops"]
[[auth.acl]]
principal = "*"
publish = ["pub-*"]
subscribe = ["*"]
"#,
    )
    .unwrap();
    let data = s(&tmp.path().join("data"));
    let cfg_s = s(&cfg);
    let (first, _) = print_config(
        &[
            "--config",
            &cfg_s,
            "--data-dir",
            &data,
            "--listen",
            "127.0.0.1:0",
            "--metrics",
            "off",
            "--queue-full-policy",
            "drop-queue",
            "--log-level",
            "info",
        ],
        &[
            ("TETHER_METRICS_TOP_QUEUES", "0"),
            ("TETHER_ADVERTISE", "a.example.com,b.example.com"),
            ("TETHER_TLS_CA", "/etc/tether/other-ca.pem"),
        ],
    );
    assert!(first.contains("other-ca.pem"), "{first}");
    assert!(first.contains("b.example.com"), "{first}");
    let saved = tmp.path().join("saved.toml");
    std::fs::write(&saved, &first).unwrap();
    let (second, _) = print_config(&["--config", &s(&saved)], &[]);
    assert_eq!(first, second, "the printed configuration, read back");
    assert!(!tmp.path().join("data").exists());
}

#[test]
fn print_config_does_not_print_token_hashes() {
    let tmp = tempfile::tempdir().unwrap();
    let hash = "a".repeat(64);
    let cfg = tmp.path().join("auth.toml");
    std::fs::write(
        &cfg,
        format!(
            "[auth]\nadmins = [\"alice\"]\n[[auth.tokens]]\nprincipal = \"alice\"\nsha256 = \"{hash}\"\n"
        ),
    )
    .unwrap();
    let (text, t) = print_config(&["--config", &s(&cfg)], &[]);
    assert!(!text.contains(&hash), "{text}");
    assert!(text.contains("tokens: 1"), "{text}");
    assert!(get(&t, "auth.admins").as_array().is_some(), "{text}");
}

#[test]
fn a_bad_variable_is_a_usage_error_naming_it() {
    let tmp = tempfile::tempdir().unwrap();
    let data = s(&tmp.path().join("data"));
    for (var, value) in [
        ("TETHER_IDLE_TIMEOUT_MS", "abc"),
        ("TETHER_IDLE_TIMEOUT_MS", "10"),
        ("TETHER_SYNC", "sometimes"),
        ("TETHER_LISTEN", "nowhere"),
        ("TETHER_METRICS", "nope"),
        ("TETHER_NODE_ID", "bad id!"),
        ("TETHER_REBALANCE", "perhaps"),
        ("TETHER_METRICS_TOP_QUEUES", "100000"),
        ("TETHER_LOG_FORMAT", "xml"),
        ("TETHER_LOG_LEVEL", "tether=loud"),
        ("TETHER_PEERS", "n1=127.0.0.1:7401,n2"),
        ("TETHER_QUEUE_FULL_POLICY", "wait"),
    ] {
        // --print-config: a value let through would print, not start a server.
        let err = usage_error(
            &["server", "--print-config", "--data-dir", &data],
            &[(var, value)],
        );
        let first = err.lines().next().unwrap();
        assert!(first.contains(var), "{var}={value}: {err}");
        assert!(first.contains(value), "{var}={value}: {err}");
    }
    // A flag wins over a bad variable: its value is never used.
    let (_, t) = print_config(
        &["--idle-timeout-ms", "9000"],
        &[("TETHER_IDLE_TIMEOUT_MS", "abc")],
    );
    assert_eq!(get(&t, "limits.idle-timeout-ms").as_integer(), Some(9000));
    // An empty variable counts as unset.
    let (_, t) = print_config(&[], &[("TETHER_LISTEN", "")]);
    assert_eq!(get(&t, "listen").as_str(), Some("127.0.0.1:7400"));
    assert!(!tmp.path().join("data").exists());
}

#[test]
fn bad_values_list_possible_values_and_misspelt_flags_get_a_suggestion() {
    let err = usage_error(&["subscribe", "--region", "R", "--policy", "foo"], &[]);
    assert!(err.lines().next().unwrap().contains("foo"), "{err}");
    for v in ["keys-values", "keys", "none"] {
        assert!(err.contains(v), "{v}: {err}");
    }
    let err = usage_error(&["subscribe", "--region", "R", "--durabl-id", "d"], &[]);
    assert!(
        err.contains("tip: a similar argument exists: '--durable-id'"),
        "{err}"
    );
    let err = usage_error(&["server", "--sync", "sometimes"], &[]);
    assert!(err.contains("always") && err.contains("batch"), "{err}");
    let err = usage_error(&["put", "--region", "R", "--key", "k", "--ack", "x"], &[]);
    assert!(err.contains("replicated"), "{err}");
}

#[test]
fn every_flag_has_help() {
    let top = ok(&["--help"], &[]);
    let subcommands: Vec<String> = top
        .lines()
        .skip_while(|l| !l.starts_with("Commands:"))
        .skip(1)
        .take_while(|l| l.starts_with("  "))
        .filter_map(|l| l.split_whitespace().next().map(str::to_string))
        .filter(|c| c != "help")
        .collect();
    assert!(subcommands.len() >= 12, "{top}");
    for sub in &subcommands {
        // Short help: `  --flag <VALUE>  Help text`, or the text on the next line (deeper).
        let help = ok(&[sub, "-h"], &[]);
        let lines: Vec<&str> = help.lines().collect();
        for (i, line) in lines.iter().enumerate() {
            let t = line.trim_start();
            if !(t.starts_with("--") || t.starts_with("-h")) {
                continue;
            }
            let (flag, text) = t.split_once("  ").unwrap_or((t, ""));
            let next = lines.get(i + 1).copied().unwrap_or("");
            let next_is_help = next.len() - next.trim_start().len() > line.len() - t.len()
                && !next.trim().is_empty()
                && !next.trim_start().starts_with('-');
            assert!(
                !text.trim().is_empty() || next_is_help,
                "tether {sub}: {flag} has no help:\n{help}"
            );
        }
    }
    // Defaults and possible values are shown.
    let help = ok(&["subscribe", "--help"], &[]);
    assert!(help.contains("[default: 300]"), "{help}");
    assert!(help.contains("keys-values"), "{help}");
    let help = ok(&["server", "--help"], &[]);
    for want in [
        "[default: 127.0.0.1:7400]",
        "[env: TETHER_IDLE_TIMEOUT_MS=]",
        "[env: TETHER_METRICS_TOP_QUEUES=]",
        "drop-queue",
    ] {
        assert!(help.contains(want), "{want}: {help}");
    }
}

#[test]
fn completions_print_a_script() {
    let bash = ok(&["completions", "bash"], &[]);
    assert!(bash.contains("_tether"), "{bash}");
    assert!(bash.contains("--durable-id"), "{bash}");
    for shell in ["zsh", "fish"] {
        assert!(
            ok(&["completions", shell], &[]).contains("tether"),
            "{shell}"
        );
    }
    usage_error(&["completions", "tcsh"], &[]);
}

#[test]
fn put_checks_its_arguments_before_connecting() {
    // A port with nothing behind it: a connection attempt would wait for the connect timeout
    // and fail with a connection error.
    let hole = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
    let addr = hole.local_addr().unwrap().to_string();
    let tmp = tempfile::tempdir().unwrap();
    let ca = tmp.path().join("ca.pem");
    std::fs::write(&ca, "not used").unwrap();
    let ca = s(&ca);
    let base = ["put", "--server", &addr, "--ca", &ca, "--region", "R"];
    for (extra, want) in [
        (&["--key", "k"][..], "--value"),
        (&[][..], "--count"),
        (
            &["--key", "k", "--value", "v", "--ack", "always"][..],
            "always",
        ),
        (&["--count", "3", "--keys", "0"][..], "--keys"),
        (
            &["--key", "k", "--value", "v", "--count", "2"][..],
            "--count",
        ),
        (&["--value", "v"][..], "--key"),
        (&["--count", "x"][..], "x"),
    ] {
        let mut args = base.to_vec();
        args.extend_from_slice(extra);
        let err = usage_error(&args, &[]);
        let first = err.lines().next().unwrap();
        assert!(err.contains(want), "{extra:?}: {err}");
        for connect_error in ["cannot reach", "timed out", "connect"] {
            assert!(!first.contains(connect_error), "{extra:?}: {err}");
        }
    }
    // The server list's form too.
    let err = usage_error(
        &[
            "put",
            "--server",
            "127.0.0.1",
            "--region",
            "R",
            "--count",
            "1",
        ],
        &[],
    );
    assert!(err.contains("HOST:PORT"), "{err}");
}

/// A `tether server` process: its `listening` line, stderr collected until it exits.
struct Server {
    child: Child,
    listening: Value,
    stderr: Option<JoinHandle<String>>,
}

fn start_server(dir: &Path, extra: &[&str], env: &[(&str, &str)]) -> Server {
    let data = s(dir);
    let mut args = vec![
        "server",
        "--listen",
        "127.0.0.1:0",
        "--metrics",
        "off",
        "--data-dir",
        &data,
    ];
    args.extend_from_slice(extra);
    let mut child = command(&args, env)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn tether server");
    let mut err = child.stderr.take().unwrap();
    let stderr = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = err.read_to_string(&mut s);
        s
    });
    let out = child.stdout.take().unwrap();
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(out).lines().map_while(Result::ok) {
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    let line = match rx.recv_timeout(WAIT) {
        Ok(l) => l,
        Err(e) => {
            let _ = child.kill();
            let _ = child.wait();
            panic!(
                "no listening line ({e}); stderr: {}",
                stderr.join().unwrap_or_default()
            );
        }
    };
    let listening: Value = serde_json::from_str(&line).expect("listening JSON");
    assert_eq!(listening["type"], "listening", "{line}");
    Server {
        child,
        listening,
        stderr: Some(stderr),
    }
}

impl Server {
    fn addr(&self) -> String {
        self.listening["addr"].as_str().unwrap().to_string()
    }

    fn ca(&self) -> String {
        self.listening["ca"].as_str().unwrap().to_string()
    }

    /// SIGTERM; exit status 0; everything it wrote on stderr.
    fn stop(mut self) -> String {
        let st = Command::new("kill")
            .arg("-TERM")
            .arg(self.child.id().to_string())
            .status()
            .expect("kill");
        assert!(st.success());
        let start = Instant::now();
        let status = loop {
            if let Some(st) = self.child.try_wait().unwrap() {
                break st;
            }
            assert!(start.elapsed() < WAIT, "server did not exit after SIGTERM");
            std::thread::sleep(Duration::from_millis(20));
        };
        let err = self.stderr.take().unwrap().join().unwrap_or_default();
        assert!(
            status.success(),
            "exit after SIGTERM: {status}; stderr: {err}"
        );
        err
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[test]
fn server_logs_to_a_pipe_carry_no_escape_codes() {
    let tmp = tempfile::tempdir().unwrap();
    let server = start_server(tmp.path(), &[], &[]);
    std::thread::sleep(Duration::from_millis(300));
    let err = server.stop();
    // A fresh data dir: the dev CA is generated and logged (tether's life-cycle, at info).
    assert!(err.contains(" INFO "), "{err}");
    assert!(err.contains("generated dev CA"), "{err}");
    assert!(!err.contains('\x1b'), "escape codes in {err:?}");
    for bad in [" WARN ", " ERROR "] {
        assert!(!err.contains(bad), "{err}");
    }
}

#[test]
fn server_log_format_json_gives_json_lines() {
    let tmp = tempfile::tempdir().unwrap();
    for (extra, env) in [
        (&["--log-format", "json"][..], &[][..]),
        (&[][..], &[("TETHER_LOG_FORMAT", "json")][..]),
    ] {
        let dir = tmp.path().join(format!("d{}", extra.len()));
        let server = start_server(&dir, extra, env);
        std::thread::sleep(Duration::from_millis(300));
        let err = server.stop();
        let lines: Vec<&str> = err.lines().collect();
        assert!(!lines.is_empty(), "no log line");
        for line in lines {
            let v: Value =
                serde_json::from_str(line).unwrap_or_else(|e| panic!("not JSON {line:?}: {e}"));
            assert!(v["timestamp"].is_string(), "{line}");
            assert!(v["level"].is_string(), "{line}");
            assert!(v["target"].is_string(), "{line}");
            assert!(v["fields"]["message"].is_string(), "{line}");
        }
        assert!(!err.contains('\x1b'), "{err:?}");
    }
}

#[test]
fn server_log_level_and_rust_log() {
    let tmp = tempfile::tempdir().unwrap();
    // --log-level error: the info life-cycle lines are gone.
    let server = start_server(&tmp.path().join("a"), &["--log-level", "error"], &[]);
    let err = server.stop();
    assert!(!err.contains("INFO"), "{err}");
    // RUST_LOG wins over --log-level.
    let server = start_server(
        &tmp.path().join("b"),
        &["--log-level", "error"],
        &[("RUST_LOG", "tether=info")],
    );
    let err = server.stop();
    assert!(err.contains("generated dev CA"), "{err}");
}

/// Runs a client command against `server` to completion.
fn client(server: &Server, sub: &str, args: &[&str]) -> Output {
    let (addr, ca) = (server.addr(), server.ca());
    let mut all = vec![sub, "--server", &addr, "--ca", &ca];
    all.extend_from_slice(args);
    run(&all, &[])
}

fn queue_states(server: &Server) -> Vec<Value> {
    let out = client(server, "queues", &[]);
    assert!(out.status.success(), "{}", stderr(&out));
    stdout(&out)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

#[test]
fn a_subscriber_failing_after_connecting_closes_its_connection() {
    let tmp = tempfile::tempdir().unwrap();
    let server = start_server(tmp.path(), &[], &[]);
    // The server refuses the interest (an invalid regex) after the connection is made: the
    // subscriber exits 1 with one error line and closes, leaving its durable queue away at
    // once (not connected until the server's idle timeout, 30 s).
    let out = client(
        &server,
        "subscribe",
        &["--region", "R", "--durable-id", "d1", "--regex", "("],
    );
    assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
    assert_eq!(stderr(&out).lines().count(), 1, "{}", stderr(&out));
    let queues = queue_states(&server);
    let q = queues
        .iter()
        .find(|q| q["durable_id"] == "d1")
        .unwrap_or_else(|| panic!("{queues:?}"));
    assert_eq!(q["state"], "away", "{queues:?}");
    // A non-durable one leaves nothing behind.
    let out = client(&server, "subscribe", &["--region", "R", "--regex", "("]);
    assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
    let queues = queue_states(&server);
    assert!(
        queues.iter().all(|q| !q["durable_id"].is_null()),
        "{queues:?}"
    );
    server.stop();
}

#[test]
fn usage_errors_write_no_colour_to_a_pipe() {
    let o = run(&["subscribe", "--region", "R", "--durabl-id", "d"], &[]);
    assert_eq!(o.status.code(), Some(2));
    assert!(!stderr(&o).contains('\x1b'), "{:?}", stderr(&o));
}

/// `TETHER_DIRECT_IO=true` reaches RocksDB (its info log records the option), the node
/// serves with it, and the data written stays readable by a node started without it.
#[test]
fn direct_io_from_the_environment_reaches_rocksdb_and_the_data_outlives_it() {
    let tmp = tempfile::tempdir().unwrap();
    let direct_io_line = |want: &str| {
        let log = std::fs::read_to_string(tmp.path().join("db").join("LOG")).unwrap();
        let line = log
            .lines()
            .find(|l| l.contains("Options.use_direct_io_for_flush_and_compaction:"))
            .unwrap_or_else(|| panic!("no direct I/O line in RocksDB's LOG:\n{log}"))
            .to_string();
        assert!(line.trim_end().ends_with(want), "{line}");
    };
    let server = start_server(tmp.path(), &[], &[("TETHER_DIRECT_IO", "true")]);
    direct_io_line(": 1");
    let out = client(
        &server,
        "put",
        &["--region", "R", "--key", "k", "--value", "v1"],
    );
    assert!(out.status.success(), "{}", stderr(&out));
    server.stop();

    let server = start_server(tmp.path(), &[], &[]);
    direct_io_line(": 0");
    let out = client(&server, "get", &["--region", "R", "--key", "k"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let v: Value = serde_json::from_str(stdout(&out).trim()).unwrap();
    assert_eq!(v["value"], "v1", "{}", stdout(&out));
    server.stop();
}
