//! The `tether` binary against its public contract (`cli-contract.md`): every command, flag and
//! JSON field, driven as a script would drive it — real processes, stdout read line by line
//! through pipes while they run, stderr checked for the one `error:` line on failure.

use std::collections::BTreeSet;
use std::io::{BufRead, BufReader, Read};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use serde_json::Value;

mod common;

use common::http_get;

/// Upper bound for anything a test waits on.
const WAIT: Duration = Duration::from_secs(20);

/// A running `tether` process: stdout lines arrive on a channel, stderr is collected.
struct Proc {
    child: Child,
    lines: Receiver<String>,
    stderr: Option<JoinHandle<String>>,
    what: String,
}

/// A finished process.
struct Out {
    status: ExitStatus,
    lines: Vec<String>,
    stderr: String,
    what: String,
}

impl Out {
    fn json(&self) -> Vec<Value> {
        self.lines.iter().map(|l| parse(l)).collect()
    }

    /// Exit 0 and stdout as JSON lines.
    fn ok(self) -> Vec<Value> {
        assert!(
            self.status.success(),
            "`tether {}` failed ({}): stdout {:?} stderr {:?}",
            self.what,
            self.status,
            self.lines,
            self.stderr
        );
        self.json()
    }

    /// Non-zero exit, exactly one stderr line starting with `error:` (the first), no panic
    /// text. A usage error (exit status 2) may follow it with the parser's explanation (a tip,
    /// the usage, a pointer to --help); other failures print that one line only.
    fn failed(self) -> String {
        assert!(
            !self.status.success(),
            "`tether {}` should fail; stdout {:?}",
            self.what,
            self.lines
        );
        let lines: Vec<&str> = self.stderr.lines().collect();
        let usage = self.status.code() == Some(2);
        assert!(
            !lines.is_empty() && (usage || lines.len() == 1),
            "`tether {}` ({}): stderr should be one line: {:?}",
            self.what,
            self.status,
            self.stderr
        );
        assert_eq!(
            lines.iter().filter(|l| l.starts_with("error:")).count(),
            1,
            "`tether {}`: one error line: {:?}",
            self.what,
            self.stderr
        );
        if usage && lines.len() > 1 {
            assert!(
                self.stderr.contains("--help"),
                "`tether {}`: a usage error points to --help: {:?}",
                self.what,
                self.stderr
            );
        }
        assert!(
            lines[0].starts_with("error:") && lines[0].len() > "error: ".len(),
            "`tether {}`: {:?}",
            self.what,
            lines[0]
        );
        for bad in ["panicked", "backtrace", "RUST_BACKTRACE", "stack backtrace"] {
            assert!(
                !self.stderr.contains(bad),
                "{}: {:?}",
                self.what,
                self.stderr
            );
        }
        lines[0].to_string()
    }
}

fn parse(line: &str) -> Value {
    let v: Value = serde_json::from_str(line).unwrap_or_else(|e| panic!("not JSON {line:?}: {e}"));
    assert!(v.is_object(), "not an object: {line}");
    v
}

fn tether(args: &[String]) -> Proc {
    let mut child = Command::new(env!("CARGO_BIN_EXE_tether"))
        .args(args)
        .env_remove("RUST_LOG")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn tether");
    let out = child.stdout.take().unwrap();
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(out).lines() {
            let Ok(line) = line else { break };
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    let mut err = child.stderr.take().unwrap();
    let stderr = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = err.read_to_string(&mut s);
        s
    });
    Proc {
        child,
        lines: rx,
        stderr: Some(stderr),
        what: args.join(" "),
    }
}

fn strings(args: &[&str]) -> Vec<String> {
    args.iter().map(|s| s.to_string()).collect()
}

/// Runs a command to completion (bounded).
fn run(args: &[&str]) -> Out {
    tether(&strings(args)).finish()
}

impl Proc {
    /// The next stdout line, None at end of output; panics after [`WAIT`].
    fn next_line(&self) -> Option<String> {
        match self.lines.recv_timeout(WAIT) {
            Ok(l) => Some(l),
            Err(RecvTimeoutError::Disconnected) => None,
            Err(RecvTimeoutError::Timeout) => {
                panic!("`tether {}`: no line within {WAIT:?}", self.what)
            }
        }
    }

    /// The next stdout line as JSON.
    fn line(&self) -> Value {
        let l = self
            .next_line()
            .unwrap_or_else(|| panic!("`tether {}`: stdout ended", self.what));
        parse(&l)
    }

    /// The next line, which must have this type.
    fn expect(&self, ty: &str) -> Value {
        let v = self.line();
        assert_eq!(v["type"], ty, "`tether {}`: {v}", self.what);
        v
    }

    /// Nothing printed within `d` (the process may still be running).
    fn quiet_for(&self, d: Duration) {
        if let Ok(l) = self.lines.recv_timeout(d) {
            panic!("`tether {}`: unexpected line {l}", self.what)
        }
    }

    fn pid(&self) -> String {
        self.child.id().to_string()
    }

    fn sigterm(&self) {
        let st = Command::new("kill")
            .arg("-TERM")
            .arg(self.pid())
            .status()
            .expect("kill");
        assert!(st.success());
    }

    fn wait(&mut self) -> ExitStatus {
        let start = Instant::now();
        loop {
            if let Some(st) = self.child.try_wait().expect("try_wait") {
                return st;
            }
            assert!(
                start.elapsed() < WAIT,
                "`tether {}` did not exit within {WAIT:?}",
                self.what
            );
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// Waits for exit; the remaining stdout lines and all of stderr.
    fn finish(mut self) -> Out {
        let status = self.wait();
        let mut lines = Vec::new();
        while let Some(l) = self.next_line() {
            lines.push(l);
        }
        let stderr = self.stderr.take().unwrap().join().unwrap_or_default();
        Out {
            status,
            lines,
            stderr,
            what: self.what.clone(),
        }
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn fields(v: &Value) -> BTreeSet<String> {
    v.as_object()
        .unwrap_or_else(|| panic!("not an object: {v}"))
        .keys()
        .cloned()
        .collect()
}

fn assert_fields(v: &Value, want: &[&str]) {
    let want: BTreeSet<String> = want.iter().map(|s| s.to_string()).collect();
    assert_eq!(fields(v), want, "field set of {v}");
}

/// A `tether server` process on port 0 in its own temp dir.
struct Server {
    proc: Proc,
    listening: Value,
    addr: String,
    ca: String,
    dir: PathBuf,
    _tmp: Option<tempfile::TempDir>,
}

fn start_server(extra: &[&str]) -> Server {
    let tmp = tempfile::tempdir().unwrap();
    let mut s = start_server_in(tmp.path(), extra);
    s._tmp = Some(tmp);
    s
}

fn start_server_in(dir: &Path, extra: &[&str]) -> Server {
    let mut args = strings(&["server", "--listen", "127.0.0.1:0", "--data-dir"]);
    args.push(dir.display().to_string());
    if !extra.contains(&"--metrics") {
        args.extend(strings(&["--metrics", "off"]));
    }
    args.extend(strings(extra));
    server_with_args(args, dir)
}

fn server_with_args(args: Vec<String>, dir: &Path) -> Server {
    let proc = tether(&args);
    let listening = proc.expect("listening");
    Server {
        addr: listening["addr"].as_str().expect("addr").to_string(),
        ca: listening["ca"].as_str().expect("ca").to_string(),
        listening,
        proc,
        dir: dir.to_path_buf(),
        _tmp: None,
    }
}

impl Server {
    fn args(&self, sub: &str, args: &[&str]) -> Vec<String> {
        let mut v = strings(&[sub, "--server", &self.addr, "--ca", &self.ca]);
        v.extend(strings(args));
        v
    }

    /// Runs a client command to completion.
    fn run(&self, sub: &str, args: &[&str]) -> Out {
        tether(&self.args(sub, args)).finish()
    }

    /// Runs a client command that must succeed; its JSON lines.
    fn ok(&self, sub: &str, args: &[&str]) -> Vec<Value> {
        self.run(sub, args).ok()
    }

    fn spawn(&self, sub: &str, args: &[&str]) -> Proc {
        tether(&self.args(sub, args))
    }

    fn put(&self, region: &str, key: &str, value: &str) {
        let out = self.ok("put", &["--region", region, "--key", key, "--value", value]);
        assert_eq!(out, [serde_json::json!({"type":"published","count":1})]);
    }

    fn get(&self, region: &str, key: &str) -> Value {
        let out = self.ok("get", &["--region", region, "--key", key]);
        assert_eq!(out.len(), 1, "{out:?}");
        let v = &out[0];
        assert_fields(v, &["type", "region", "key", "value"]);
        assert_eq!(v["type"], "value");
        assert_eq!(v["region"], region);
        assert_eq!(v["key"], key);
        v["value"].clone()
    }

    fn queues(&self) -> Vec<Value> {
        let out = self.ok("queues", &[]);
        for q in &out {
            assert_queue_fields(q);
        }
        out
    }

    fn queue(&self, id: &str) -> Option<Value> {
        self.queues().into_iter().find(|q| q["durable_id"] == id)
    }

    /// SIGTERM, then exit status 0.
    fn stop(mut self) {
        self.proc.sigterm();
        let st = self.proc.wait();
        if !st.success() {
            let stderr = self.proc.stderr.take().unwrap().join().unwrap_or_default();
            panic!("server exit after SIGTERM: {st}; stderr: {stderr}");
        }
    }
}

fn assert_queue_fields(q: &Value) {
    // The contract's fields, plus `pending_bytes` (added: a primary's bytes waiting).
    let mut want = vec![
        "type",
        "durable_id",
        "state",
        "pending",
        "acked_offset",
        "end_offset",
        "timeout_secs",
        "role",
        "interests",
    ];
    if q["role"] == "primary" {
        want.push("pending_bytes");
        assert!(q["pending_bytes"].is_u64(), "{q}");
    }
    // Added with the lag per queue: where it is and how far behind (null when not known).
    want.extend([
        "id",
        "node",
        "oldest_pending_age_ms",
        "away_since_ms",
        "expires_at_ms",
        "enqueue_per_min",
        "delivery_per_min",
        "ack_per_min",
        "drain_eta_secs",
    ]);
    assert!(q["id"].is_string() && q["node"].is_string(), "{q}");
    // Cluster additions, when present.
    for f in ["copies", "primary"] {
        if q.get(f).is_some() {
            want.push(f);
        }
    }
    assert_fields(q, &want);
    assert_eq!(q["type"], "queue");
    assert!(
        q["durable_id"].is_string() || q["durable_id"].is_null(),
        "{q}"
    );
    let state = q["state"].as_str().unwrap();
    assert!(["connected", "ready", "away"].contains(&state), "{q}");
    for f in ["pending", "acked_offset", "end_offset", "timeout_secs"] {
        assert!(q[f].is_u64(), "{f} in {q}");
    }
    assert!(q["role"].is_string(), "{q}");
    for i in q["interests"].as_array().expect("interests array") {
        assert_fields(i, &["region", "kind", "spec", "durable"]);
        assert!(
            ["key", "regex", "all"].contains(&i["kind"].as_str().unwrap()),
            "{i}"
        );
        assert!(i["durable"].is_boolean(), "{i}");
    }
}

fn assert_connected(
    v: &Value,
    durable_id: Option<&str>,
    queue: &str,
    pending: Option<u64>,
    server: &Server,
) {
    assert_fields(v, &["type", "durable_id", "queue", "pending", "primary"]);
    assert_eq!(v["type"], "connected");
    assert_eq!(v["durable_id"], serde_json::json!(durable_id), "{v}");
    assert_eq!(v["queue"], queue, "{v}");
    assert_eq!(v["pending"], serde_json::json!(pending), "{v}");
    assert_eq!(v["primary"], server.addr.as_str(), "{v}");
}

fn assert_event(v: &Value, region: &str, key: &str, op: &str, value: Option<&str>) {
    assert_fields(
        v,
        &[
            "type",
            "region",
            "key",
            "op",
            "value",
            "offset",
            "event_id",
            "replayed",
            "possible_duplicate",
        ],
    );
    assert_eq!(v["type"], "event", "{v}");
    assert_eq!(v["region"], region, "{v}");
    assert_eq!(v["key"], key, "{v}");
    assert_eq!(v["op"], op, "{v}");
    assert_eq!(v["value"], serde_json::json!(value), "{v}");
    assert!(v["offset"].is_u64(), "{v}");
    assert!(!v["event_id"].as_str().expect("event_id").is_empty(), "{v}");
    assert!(
        v["replayed"].is_boolean() && v["possible_duplicate"].is_boolean(),
        "{v}"
    );
}

fn assert_live(v: &Value, region: &str) {
    assert_eq!(*v, serde_json::json!({"type":"live","region":region}));
}

fn assert_closed(v: &Value, keepalive: bool) {
    assert_eq!(
        *v,
        serde_json::json!({"type":"closed","keepalive":keepalive})
    );
}

/// Polls `f` until true or [`WAIT`] passes.
fn eventually(what: &str, mut f: impl FnMut() -> bool) {
    let start = Instant::now();
    while !f() {
        assert!(start.elapsed() < WAIT, "timed out waiting for: {what}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

// ---------------------------------------------------------------------------------------------
// tether server

#[test]
fn server_listening_line_node_id_kept_and_sigterm_exits_zero() {
    let tmp = tempfile::tempdir().unwrap();
    let s = start_server_in(tmp.path(), &[]);
    let l = s.listening.clone();
    assert_fields(&l, &["type", "node_id", "addr", "metrics", "ca"]);
    assert_eq!(l["type"], "listening");
    let node_id = l["node_id"].as_str().expect("node_id").to_string();
    assert!(!node_id.is_empty());
    let addr: std::net::SocketAddr = s.addr.parse().expect("addr is IP:PORT");
    assert_ne!(addr.port(), 0, "the real port, not 0");
    assert!(addr.ip().is_loopback());
    assert!(l["metrics"].is_null(), "--metrics off: {l}");
    let ca = PathBuf::from(&s.ca);
    assert!(ca.is_file(), "ca {ca:?} exists");
    assert!(
        ca.starts_with(tmp.path().join("tls")),
        "dev CA generated into <data-dir>/tls/: {ca:?}"
    );
    let ca_pem = std::fs::read(&ca).unwrap();
    // The server answers clients with that CA.
    s.put("R", "k", "v");
    s.stop();

    // Restart on the same data dir: node id generated once and kept, the CA reused.
    let s = start_server_in(tmp.path(), &[]);
    assert_eq!(s.listening["node_id"], node_id.as_str());
    assert_eq!(std::fs::read(&s.ca).unwrap(), ca_pem, "CA reused");
    assert_eq!(s.get("R", "k"), "v", "data flushed on SIGTERM and kept");
    s.stop();

    // --node-id is kept as given.
    let s = start_server(&["--node-id", "node-7"]);
    assert_eq!(s.listening["node_id"], "node-7");
    s.stop();
}

#[test]
fn server_metrics_endpoint_serves_prometheus_text() {
    let s = start_server(&["--metrics", "127.0.0.1:0"]);
    let m = s.listening["metrics"]
        .as_str()
        .expect("metrics address")
        .to_string();
    let maddr: std::net::SocketAddr = m.parse().expect("metrics is IP:PORT");
    assert_ne!(maddr.port(), 0, "the real metrics port");
    // Some traffic.
    s.put("R", "a", "1");
    assert_eq!(s.get("R", "a"), "1");
    let sub = s.spawn(
        "subscribe",
        &["--region", "R", "--all-keys", "--exit-on-live"],
    );
    assert!(sub.finish().status.success());
    let resp = http_get(&m, "/metrics");
    let (head, body) = resp
        .split_once("\r\n\r\n")
        .unwrap_or_else(|| panic!("{resp:?}"));
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    assert!(body.contains("tether_"), "no tether_ metric in {body}");
    // Prometheus exposition: metric lines are `name{labels} value` or `name value`.
    let metric = body
        .lines()
        .find(|l| l.starts_with("tether_"))
        .expect("a tether_ sample line");
    let value = metric.rsplit(' ').next().unwrap();
    assert!(value.parse::<f64>().is_ok(), "sample line {metric:?}");
    // A durable queue that fills while away, then replays (acked on exit).
    let sub = s.spawn(
        "subscribe",
        &[
            "--region",
            "R",
            "--all-keys",
            "--durable-id",
            "m1",
            "--exit-on-live",
        ],
    );
    assert!(sub.finish().status.success());
    s.put("R", "b", "2");
    let sub = s.spawn(
        "subscribe",
        &[
            "--region",
            "R",
            "--durable-id",
            "m1",
            "--exit-on-live",
            "--replay-rate",
            "1000",
        ],
    );
    assert!(sub.finish().status.success());
    // The brief's metrics are there, and every exported name is documented.
    let names = metric_names(&http_get(&m, "/metrics"));
    for want in [
        "tether_events_published_total",
        "tether_events_enqueued_total",
        "tether_events_delivered_total",
        "tether_events_replayed_total",
        "tether_events_acked_total",
        "tether_queues",
        "tether_pending_events",
        "tether_pending_bytes",
        "tether_oldest_unacked_age_seconds",
        "tether_connections",
        "tether_replay_duration_seconds",
        "tether_storage_write_batch_ops",
        "tether_storage_fsync_seconds",
    ] {
        assert!(names.contains(want), "{want} not exported: {names:?}");
    }
    // docs/operations.md lists the metrics and points to docs/admin.md for the per-queue series.
    let docs = concat!(
        include_str!("../docs/operations.md"),
        include_str!("../docs/cluster.md"),
        include_str!("../docs/admin.md")
    );
    for name in &names {
        assert!(
            docs.contains(&format!("`{name}")),
            "{name} is exported but not documented in docs/operations.md, docs/cluster.md or docs/admin.md"
        );
    }
    s.stop();
}

/// The metric names of a Prometheus text exposition (histogram series folded into their name).
fn metric_names(exposition: &str) -> std::collections::BTreeSet<String> {
    let body = exposition
        .split_once("\r\n\r\n")
        .map_or(exposition, |(_, b)| b);
    body.lines()
        .filter(|l| l.starts_with("tether_"))
        .map(|l| {
            let name = l.split(['{', ' ']).next().unwrap_or(l);
            ["_bucket", "_sum", "_count"]
                .iter()
                .find_map(|s| name.strip_suffix(s))
                .unwrap_or(name)
                .to_string()
        })
        .collect()
}

#[test]
fn server_config_file_and_flags_win() {
    let tmp = tempfile::tempdir().unwrap();
    let file_dir = tmp.path().join("from-file");
    let flag_dir = tmp.path().join("from-flag");
    let cfg = tmp.path().join("tether.toml");
    std::fs::write(
        &cfg,
        format!(
            "data-dir = {:?}\nlisten = \"127.0.0.1:0\"\nmetrics = \"off\"\nnode-id = \"file-node\"\nsync = \"none\"\n",
            file_dir.display().to_string()
        ),
    )
    .unwrap();
    let cfg_s = cfg.display().to_string();

    // The file alone.
    let s = server_with_args(strings(&["server", "--config", &cfg_s]), &file_dir);
    assert_eq!(s.listening["node_id"], "file-node");
    assert!(s.listening["metrics"].is_null());
    assert!(PathBuf::from(&s.ca).starts_with(&file_dir), "{}", s.ca);
    assert!(file_dir.is_dir(), "data dir created from the file setting");
    s.put("R", "k", "v");
    s.stop();

    // Flags win over the file.
    let flag_dir_s = flag_dir.display().to_string();
    let s = server_with_args(
        strings(&[
            "server",
            "--config",
            &cfg_s,
            "--data-dir",
            &flag_dir_s,
            "--node-id",
            "flag-node",
            "--metrics",
            "127.0.0.1:0",
            "--sync",
            "always",
        ]),
        &flag_dir,
    );
    assert_eq!(s.listening["node_id"], "flag-node");
    assert!(s.listening["metrics"].is_string(), "{}", s.listening);
    assert!(PathBuf::from(&s.ca).starts_with(&flag_dir), "{}", s.ca);
    assert_eq!(s.get("R", "k"), Value::Null, "a different data dir");
    s.stop();

    // A broken config file is a user error.
    let bad = tmp.path().join("bad.toml");
    std::fs::write(&bad, "lisen = \"127.0.0.1:0\"\n").unwrap();
    run(&["server", "--config", &bad.display().to_string()]).failed();
    run(&[
        "server",
        "--config",
        &tmp.path().join("missing.toml").display().to_string(),
    ])
    .failed();
}

#[test]
fn server_sync_modes() {
    for mode in ["always", "batch", "none"] {
        let s = start_server(&["--sync", mode]);
        s.put("R", "k", mode);
        assert_eq!(s.get("R", "k"), mode);
        assert!(s.dir.exists());
        s.stop();
    }
    let tmp = tempfile::tempdir().unwrap();
    let d = tmp.path().display().to_string();
    let err = run(&[
        "server",
        "--listen",
        "127.0.0.1:0",
        "--metrics",
        "off",
        "--data-dir",
        &d,
        "--sync",
        "bogus",
    ])
    .failed();
    assert!(err.contains("bogus"), "{err}");
    // Other bad server settings.
    run(&[
        "server",
        "--listen",
        "nowhere",
        "--metrics",
        "off",
        "--data-dir",
        &d,
    ])
    .failed();
    run(&[
        "server",
        "--listen",
        "127.0.0.1:0",
        "--metrics",
        "nope",
        "--data-dir",
        &d,
    ])
    .failed();
    run(&[
        "server",
        "--listen",
        "127.0.0.1:0",
        "--metrics",
        "off",
        "--data-dir",
        &d,
        "--node-id",
        "bad id!",
    ])
    .failed();
}

// ---------------------------------------------------------------------------------------------
// put / get / destroy

#[test]
fn put_get_destroy_single_keys() {
    let s = start_server(&[]);
    assert_eq!(s.get("R", "k"), Value::Null, "absent key");
    s.put("R", "k", "hello");
    assert_eq!(s.get("R", "k"), "hello");
    s.put("R", "k", "héllo wörld ✓");
    assert_eq!(s.get("R", "k"), "héllo wörld ✓", "UTF-8 text round trip");
    assert_eq!(s.get("Other", "k"), Value::Null, "regions are separate");
    s.put("R", "empty", "");
    assert_eq!(s.get("R", "empty"), "", "empty value is not absent");
    let out = s.ok("destroy", &["--region", "R", "--key", "k"]);
    assert_eq!(out, [serde_json::json!({"type":"published","count":1})]);
    assert_eq!(s.get("R", "k"), Value::Null);
    s.stop();
}

#[test]
fn put_count_key_prefix_keys_and_size() {
    let s = start_server(&[]);
    // A subscriber sees the puts in order, with create/update ops.
    let sub = s.spawn(
        "subscribe",
        &["--region", "R", "--regex", "p-.*", "--max-events", "5"],
    );
    assert_connected(&sub.line(), None, "none", None, &s);
    assert_live(&sub.line(), "R");
    let out = s.ok(
        "put",
        &[
            "--region",
            "R",
            "--count",
            "5",
            "--key-prefix",
            "p-",
            "--keys",
            "2",
        ],
    );
    assert_eq!(out, [serde_json::json!({"type":"published","count":5})]);
    let want = [
        ("p-0", "create", "value-0"),
        ("p-1", "create", "value-1"),
        ("p-0", "update", "value-2"),
        ("p-1", "update", "value-3"),
        ("p-0", "update", "value-4"),
    ];
    let mut last_offset = None;
    for (key, op, value) in want {
        let e = sub.line();
        assert_event(&e, "R", key, op, Some(value));
        assert_eq!(e["replayed"], false);
        assert_eq!(e["possible_duplicate"], false);
        let off = e["offset"].as_u64().unwrap();
        if let Some(prev) = last_offset {
            assert!(off > prev, "offsets increase: {e}");
        }
        last_offset = Some(off);
    }
    assert_closed(&sub.line(), false);
    let rest = sub.finish();
    assert!(
        rest.status.success() && rest.lines.is_empty(),
        "{:?}",
        rest.lines
    );
    assert_eq!(s.get("R", "p-0"), "value-4");
    assert_eq!(s.get("R", "p-1"), "value-3");
    assert_eq!(s.get("R", "p-2"), Value::Null, "only --keys distinct keys");

    // Defaults: prefix `key-`, M = N.
    let out = s.ok("put", &["--region", "D", "--count", "3"]);
    assert_eq!(out, [serde_json::json!({"type":"published","count":3})]);
    for i in 0..3 {
        assert_eq!(
            s.get("D", &format!("key-{i}")),
            format!("value-{i}").as_str()
        );
    }
    assert_eq!(s.get("D", "key-3"), Value::Null);

    // --size B: B bytes of printable ASCII.
    for size in [1usize, 7, 100, 5000] {
        let region = format!("S{size}");
        let out = s.ok(
            "put",
            &[
                "--region",
                &region,
                "--count",
                "2",
                "--size",
                &size.to_string(),
            ],
        );
        assert_eq!(out, [serde_json::json!({"type":"published","count":2})]);
        for i in 0..2 {
            let v = s.get(&region, &format!("key-{i}"));
            let v = v.as_str().expect("a value");
            assert_eq!(v.len(), size, "--size {size}: {v:?}");
            assert!(
                v.bytes().all(|b| (0x20..0x7f).contains(&b)),
                "printable: {v:?}"
            );
        }
    }

    // More than one request's worth of puts.
    let out = s.ok("put", &["--region", "B", "--count", "2500", "--keys", "10"]);
    assert_eq!(out, [serde_json::json!({"type":"published","count":2500})]);
    assert_eq!(s.get("B", "key-9"), "value-2499");
    assert_eq!(s.get("B", "key-0"), "value-2490");
    s.stop();
}

// ---------------------------------------------------------------------------------------------
// subscribe

#[test]
fn subscribe_non_durable_initial_image_policies() {
    let s = start_server(&[]);
    s.put("R", "a", "1");
    s.put("R", "b", "2");
    s.put("R", "c", "3");

    let check = |args: &[&str], want: &[(&str, Option<&str>)]| {
        let mut full = vec!["--region", "R", "--exit-on-live"];
        full.extend_from_slice(args);
        let out = s.ok("subscribe", &full);
        assert_connected(&out[0], None, "none", None, &s);
        let n = want.len();
        assert_eq!(out.len(), n + 3, "{args:?}: {out:?}");
        let mut initial: Vec<(String, Value)> = out[1..=n]
            .iter()
            .map(|v| {
                assert_fields(v, &["type", "region", "key", "value"]);
                assert_eq!(v["type"], "initial", "{v}");
                assert_eq!(v["region"], "R");
                (v["key"].as_str().unwrap().to_string(), v["value"].clone())
            })
            .collect();
        initial.sort_by(|a, b| a.0.cmp(&b.0));
        let want: Vec<(String, Value)> = want
            .iter()
            .map(|(k, v)| (k.to_string(), serde_json::json!(v)))
            .collect();
        assert_eq!(initial, want, "{args:?}");
        assert_live(&out[n + 1], "R");
        assert_closed(&out[n + 2], false);
    };
    check(
        &["--key", "a", "--key", "c", "--key", "zz"],
        &[("a", Some("1")), ("c", Some("3"))],
    );
    check(
        &["--all-keys", "--policy", "keys-values"],
        &[("a", Some("1")), ("b", Some("2")), ("c", Some("3"))],
    );
    check(&["--regex", "[ab]"], &[("a", Some("1")), ("b", Some("2"))]);
    check(
        &["--all-keys", "--policy", "keys"],
        &[("a", None), ("b", None), ("c", None)],
    );
    check(&["--all-keys", "--policy", "none"], &[]);
    s.stop();
}

#[test]
fn subscribe_live_events_ops_no_values_and_exit_modes() {
    let s = start_server(&[]);
    s.put("R", "x", "old");
    // Values sent.
    let sub = s.spawn(
        "subscribe",
        &[
            "--region",
            "R",
            "--key",
            "x",
            "--policy",
            "none",
            "--max-events",
            "3",
        ],
    );
    // --no-values: invalidate events.
    let inv = s.spawn(
        "subscribe",
        &[
            "--region",
            "R",
            "--key",
            "x",
            "--no-values",
            "--policy",
            "none",
            "--max-events",
            "3",
        ],
    );
    for p in [&sub, &inv] {
        assert_connected(&p.line(), None, "none", None, &s);
        assert_live(&p.line(), "R");
    }
    s.put("R", "x", "new");
    s.put("R", "other", "ignored");
    s.ok("destroy", &["--region", "R", "--key", "x"]);
    s.put("R", "x", "again");
    let want = [
        ("update", Some("new")),
        ("destroy", None),
        ("create", Some("again")),
    ];
    for (op, value) in want {
        let e = sub.line();
        assert_event(&e, "R", "x", op, value);
        assert_eq!(
            (e["replayed"].as_bool(), e["possible_duplicate"].as_bool()),
            (Some(false), Some(false))
        );
    }
    for (op, _) in want {
        let want_op = if op == "destroy" {
            "destroy"
        } else {
            "invalidate"
        };
        assert_event(&inv.line(), "R", "x", want_op, None);
    }
    for p in [sub, inv] {
        assert_closed(&p.line(), false);
        let out = p.finish();
        assert!(
            out.status.success() && out.lines.is_empty(),
            "{:?}",
            out.lines
        );
    }

    // --idle-exit-ms: exits after that long without an event, closing cleanly.
    let start = Instant::now();
    let out = s.ok(
        "subscribe",
        &[
            "--region",
            "R",
            "--all-keys",
            "--policy",
            "none",
            "--idle-exit-ms",
            "300",
        ],
    );
    assert!(start.elapsed() >= Duration::from_millis(300));
    assert_eq!(out.len(), 3, "{out:?}");
    assert_live(&out[1], "R");
    assert_closed(&out[2], false);

    // SIGTERM on a subscriber: a clean close.
    let sub = s.spawn(
        "subscribe",
        &["--region", "R", "--all-keys", "--policy", "none"],
    );
    sub.expect("connected");
    assert_live(&sub.line(), "R");
    sub.quiet_for(Duration::from_millis(100));
    sub.sigterm();
    let out = sub.finish();
    assert!(out.status.success(), "{}", out.stderr);
    assert_eq!(
        out.json(),
        [serde_json::json!({"type":"closed","keepalive":false})]
    );
    s.stop();
}

#[test]
fn subscribe_durable_replay_pending_and_live_once() {
    let s = start_server(&[]);
    // First run: a new queue with a durable regex interest.
    let out = s.ok(
        "subscribe",
        &[
            "--region",
            "R",
            "--durable-id",
            "d1",
            "--regex",
            "k.*",
            "--exit-on-live",
        ],
    );
    assert_eq!(out.len(), 3, "{out:?}");
    assert_connected(&out[0], Some("d1"), "new", None, &s);
    assert_live(&out[1], "R");
    assert_closed(&out[2], true);

    // Away: events queue up.
    s.ok(
        "put",
        &["--region", "R", "--count", "4", "--key-prefix", "k"],
    );
    s.put("R", "other", "not matched");
    let q = s.queue("d1").expect("d1 listed");
    assert_eq!(q["state"], "away");
    assert_eq!(q["pending"], 4);
    // Four stored events: at least their values, keys and region, at most 64 bytes more each.
    let bytes = q["pending_bytes"]
        .as_u64()
        .expect("a primary reports pending_bytes");
    assert!((4 * 3..=4 * 200).contains(&bytes), "{q}");
    assert_eq!(q["timeout_secs"], 300);
    assert_eq!(
        q["interests"],
        serde_json::json!([{"region":"R","kind":"regex","spec":"k.*","durable":true}])
    );
    assert_eq!(
        q["end_offset"].as_u64().unwrap() - q["acked_offset"].as_u64().unwrap(),
        4,
        "{q}"
    );

    // Second run, registering no interest: resumed, pending exact, replayed events, live once.
    let sub = s.spawn(
        "subscribe",
        &["--region", "R", "--durable-id", "d1", "--max-events", "6"],
    );
    assert_connected(&sub.line(), Some("d1"), "resumed", Some(4), &s);
    let mut ids = BTreeSet::new();
    let mut offsets = Vec::new();
    for i in 0..4 {
        let e = sub.line();
        let (k, v) = (format!("k{i}"), format!("value-{i}"));
        assert_event(&e, "R", &k, "create", Some(&v));
        assert_eq!(e["replayed"], true, "{e}");
        assert_eq!(e["possible_duplicate"], false, "{e}");
        assert!(
            ids.insert(e["event_id"].as_str().unwrap().to_string()),
            "unique ids"
        );
        offsets.push(e["offset"].as_u64().unwrap());
    }
    assert!(offsets.windows(2).all(|w| w[0] < w[1]), "{offsets:?}");
    assert_live(&sub.line(), "R");
    // Live events after the live line: not replayed; live printed once only.
    eventually("d1 ready", || {
        s.queue("d1").is_some_and(|q| q["state"] == "ready")
    });
    s.put("R", "k9", "live-1");
    s.put("R", "k0", "live-2");
    let e = sub.line();
    assert_event(&e, "R", "k9", "create", Some("live-1"));
    assert_eq!(e["replayed"], false);
    let e = sub.line();
    assert_event(&e, "R", "k0", "update", Some("live-2"));
    assert_eq!(e["replayed"], false);
    assert_closed(&sub.line(), true);
    let out = sub.finish();
    assert!(
        out.status.success() && out.lines.is_empty(),
        "{:?}",
        out.lines
    );

    // Everything printed was acknowledged on the clean exit.
    let q = s.queue("d1").expect("d1 kept");
    assert_eq!(
        (q["state"].as_str(), q["pending"].as_u64()),
        (Some("away"), Some(0)),
        "{q}"
    );
    assert_eq!(q["acked_offset"], q["end_offset"], "{q}");
    let out = s.ok(
        "subscribe",
        &["--region", "R", "--durable-id", "d1", "--exit-on-live"],
    );
    assert_eq!(out.len(), 3, "{out:?}");
    assert_connected(&out[0], Some("d1"), "resumed", Some(0), &s);
    assert_live(&out[1], "R");
    assert_closed(&out[2], true);

    // --max-events stops mid-replay; the rest is still pending next time.
    s.ok(
        "put",
        &["--region", "R", "--count", "3", "--key-prefix", "k"],
    );
    let out = s.ok(
        "subscribe",
        &["--region", "R", "--durable-id", "d1", "--max-events", "1"],
    );
    assert_eq!(out.len(), 3, "{out:?}");
    assert_connected(&out[0], Some("d1"), "resumed", Some(3), &s);
    assert_event(&out[1], "R", "k0", "update", Some("value-0"));
    assert_closed(&out[2], true);
    let out = s.ok(
        "subscribe",
        &["--region", "R", "--durable-id", "d1", "--exit-on-live"],
    );
    assert_connected(&out[0], Some("d1"), "resumed", Some(2), &s);
    assert_eq!(out.len(), 5, "{out:?}");
    assert_event(&out[1], "R", "k1", "update", Some("value-1"));
    assert_event(&out[2], "R", "k2", "update", Some("value-2"));
    assert_live(&out[3], "R");
    s.stop();
}

#[test]
fn subscribe_ready_delay_and_no_ready_queue_events() {
    let s = start_server(&[]);
    // --no-ready: status printed, interest registered, nothing delivered; state `connected`.
    let nr = s.spawn(
        "subscribe",
        &[
            "--region",
            "R",
            "--durable-id",
            "nr",
            "--key",
            "a",
            "--no-ready",
            "--idle-exit-ms",
            "60000",
        ],
    );
    assert_connected(&nr.line(), Some("nr"), "new", None, &s);
    eventually("nr registered", || {
        s.queue("nr")
            .is_some_and(|q| q["interests"].as_array().is_some_and(|i| !i.is_empty()))
    });
    let q = s.queue("nr").unwrap();
    assert_eq!(q["state"], "connected", "{q}");
    s.put("R", "a", "queued");
    nr.quiet_for(Duration::from_millis(300));
    assert_eq!(s.queue("nr").unwrap()["pending"], 1);
    nr.sigterm();
    let out = nr.finish();
    assert!(out.status.success(), "{}", out.stderr);
    assert_eq!(
        out.json(),
        [serde_json::json!({"type":"closed","keepalive":true})]
    );

    // --ready-delay-ms: an event put between registering and ready is replayed, before live.
    let rd = s.spawn(
        "subscribe",
        &[
            "--region",
            "R",
            "--durable-id",
            "rd",
            "--key",
            "a",
            "--policy",
            "none",
            "--ready-delay-ms",
            "2500",
            "--exit-on-live",
        ],
    );
    assert_connected(&rd.line(), Some("rd"), "new", None, &s);
    eventually("rd registered", || {
        s.queue("rd")
            .is_some_and(|q| q["interests"].as_array().is_some_and(|i| !i.is_empty()))
    });
    assert_eq!(s.queue("rd").unwrap()["state"], "connected");
    s.put("R", "a", "during-delay");
    let e = rd.line();
    assert_event(&e, "R", "a", "update", Some("during-delay"));
    assert_eq!(e["replayed"], true, "{e}");
    assert_live(&rd.line(), "R");
    assert_closed(&rd.line(), true);

    // nr's queued event is replayed on its next run.
    let out = s.ok(
        "subscribe",
        &["--region", "R", "--durable-id", "nr", "--exit-on-live"],
    );
    assert_connected(&out[0], Some("nr"), "resumed", Some(2), &s);
    assert_event(&out[1], "R", "a", "create", Some("queued"));
    assert_event(&out[2], "R", "a", "update", Some("during-delay"));
    assert!(out[1]["replayed"] == true && out[2]["replayed"] == true);
    assert_live(&out[3], "R");
    s.stop();
}

#[test]
fn subscribe_crash_leaves_unacked_events_flagged_possible_duplicate() {
    let s = start_server(&[]);
    s.ok(
        "subscribe",
        &[
            "--region",
            "R",
            "--durable-id",
            "c",
            "--all-keys",
            "--exit-on-live",
        ],
    );
    s.ok("put", &["--region", "R", "--count", "3"]);
    // Prints two events and vanishes without acking them.
    let out = s.ok(
        "subscribe",
        &[
            "--region",
            "R",
            "--durable-id",
            "c",
            "--max-events",
            "2",
            "--crash",
            "--ack-interval-ms",
            "600000",
        ],
    );
    assert_eq!(out.len(), 3, "no closed line with --crash: {out:?}");
    assert_connected(&out[0], Some("c"), "resumed", Some(3), &s);
    let first_ids: Vec<Value> = out[1..].iter().map(|e| e["event_id"].clone()).collect();
    for (i, e) in out[1..].iter().enumerate() {
        assert_event(
            e,
            "R",
            &format!("key-{i}"),
            "create",
            Some(&format!("value-{i}")),
        );
        assert_eq!(e["possible_duplicate"], false);
    }
    // The crashed session never closed: the next run takes the queue over after the server's
    // liveness probe of the dead connection.
    let out = s.ok(
        "subscribe",
        &["--region", "R", "--durable-id", "c", "--exit-on-live"],
    );
    assert_eq!(out.len(), 6, "{out:?}");
    assert_connected(&out[0], Some("c"), "resumed", Some(3), &s);
    for i in 0..3 {
        let e = &out[1 + i];
        assert_event(
            e,
            "R",
            &format!("key-{i}"),
            "create",
            Some(&format!("value-{i}")),
        );
        assert_eq!(e["replayed"], true);
        // The two printed events were delivered; the third may have been in flight too.
        if i < 2 {
            assert_eq!(e["possible_duplicate"], true, "{e}");
            assert_eq!(e["event_id"], first_ids[i], "a redelivery keeps its id");
        }
    }
    assert_live(&out[4], "R");
    assert_closed(&out[5], true);
    s.stop();
}

#[test]
fn subscribe_sigkill_then_immediate_restart_resumes() {
    let s = start_server(&[]);
    let mut sub = s.spawn(
        "subscribe",
        &[
            "--region",
            "R",
            "--durable-id",
            "k",
            "--all-keys",
            "--ack-interval-ms",
            "20",
        ],
    );
    assert_connected(&sub.line(), Some("k"), "new", None, &s);
    assert_live(&sub.line(), "R");
    s.put("R", "a", "1");
    assert_event(&sub.line(), "R", "a", "create", Some("1"));
    std::thread::sleep(Duration::from_millis(200)); // the ack goes out
    sub.child.kill().unwrap();
    sub.wait();
    s.put("R", "b", "2");
    let start = Instant::now();
    let out = s.ok(
        "subscribe",
        &["--region", "R", "--durable-id", "k", "--exit-on-live"],
    );
    assert!(
        start.elapsed() < Duration::from_secs(10),
        "{:?}",
        start.elapsed()
    );
    assert_connected(&out[0], Some("k"), "resumed", Some(1), &s);
    assert_event(&out[1], "R", "b", "create", Some("2"));
    assert_eq!(out[1]["replayed"], true);
    assert_live(&out[2], "R");
    assert_closed(&out[3], true);
    s.stop();
}

#[test]
fn subscribe_reconnect_resumes_across_a_server_restart() {
    // The server stops (SIGTERM) under a `--reconnect` subscriber and starts again on the same
    // port and data directory: the subscriber says so, resumes its queue, and keeps printing.
    let tmp = tempfile::tempdir().unwrap();
    let listen = format!("127.0.0.1:{}", common::ports::free_ports(1)[0]);
    let mut args = strings(&[
        "server",
        "--metrics",
        "off",
        "--listen",
        &listen,
        "--data-dir",
    ]);
    args.push(tmp.path().display().to_string());
    let s = server_with_args(args.clone(), tmp.path());
    let mut sub = s.spawn(
        "subscribe",
        &[
            "--region",
            "R",
            "--durable-id",
            "rc",
            "--all-keys",
            "--reconnect",
            "--ack-interval-ms",
            "20",
        ],
    );
    assert_connected(&sub.line(), Some("rc"), "new", None, &s);
    assert_live(&sub.line(), "R");
    s.put("R", "a", "1");
    assert_event(&sub.line(), "R", "a", "create", Some("1"));
    std::thread::sleep(Duration::from_millis(200)); // the ack goes out
    s.stop();
    let lost = sub.expect("disconnected");
    assert_fields(&lost, &["type", "error"]);
    std::thread::sleep(Duration::from_secs(1));
    let s = server_with_args(args, tmp.path());
    let back = sub.expect("reconnected");
    assert_fields(&back, &["type", "queue", "pending"]);
    assert_eq!(
        (&back["queue"], &back["pending"]),
        (&"resumed".into(), &0.into())
    );
    s.put("R", "b", "2");
    // No second live line: the session goes on.
    let ev = sub.line();
    assert_event(&ev, "R", "b", "create", Some("2"));
    assert_eq!(ev["replayed"], false);
    sub.sigterm();
    assert_closed(&sub.line(), true);
    assert!(sub.wait().success());
    assert_eq!(s.queue("rc").expect("kept")["pending"], 0);
    s.stop();
}

#[test]
fn second_live_subscriber_refused_and_close_durable() {
    let s = start_server(&[]);
    let sub = s.spawn(
        "subscribe",
        &["--region", "R", "--durable-id", "dup-id", "--key", "a"],
    );
    assert_connected(&sub.line(), Some("dup-id"), "new", None, &s);
    assert_live(&sub.line(), "R");

    let err = s
        .run(
            "subscribe",
            &["--region", "R", "--durable-id", "dup-id", "--key", "a"],
        )
        .failed();
    assert!(err.contains("dup-id"), "{err}");
    // The first one is untouched.
    s.put("R", "a", "still here");
    assert_event(&sub.line(), "R", "a", "create", Some("still here"));

    // close-durable refused while connected.
    let err = s.run("close-durable", &["dup-id"]).failed();
    assert!(err.contains("dup-id"), "{err}");
    assert!(s.queue("dup-id").is_some());

    sub.sigterm();
    let out = sub.finish();
    assert!(out.status.success(), "{}", out.stderr);
    assert_eq!(
        out.json(),
        [serde_json::json!({"type":"closed","keepalive":true})]
    );

    let out = s.ok("close-durable", &["dup-id"]);
    assert_eq!(
        out,
        [serde_json::json!({"type":"closed-durable","durable_id":"dup-id"})]
    );
    assert!(s.queue("dup-id").is_none(), "queue destroyed");
    // Interest destroyed too: a new run gets a new queue with nothing pending.
    s.put("R", "a", "after");
    let out = s.ok(
        "subscribe",
        &["--region", "R", "--durable-id", "dup-id", "--exit-on-live"],
    );
    assert_connected(&out[0], Some("dup-id"), "new", None, &s);

    // Unknown id.
    let err = s.run("close-durable", &["no-such-id"]).failed();
    assert!(err.contains("no-such-id"), "{err}");
    s.stop();
}

#[test]
fn subscribe_close_drop_and_expired() {
    let s = start_server(&[]);
    let out = s.ok(
        "subscribe",
        &[
            "--region",
            "R",
            "--durable-id",
            "dr",
            "--all-keys",
            "--close",
            "drop",
            "--exit-on-live",
        ],
    );
    assert_connected(&out[0], Some("dr"), "new", None, &s);
    assert_closed(out.last().unwrap(), false);
    assert!(s.queue("dr").is_none(), "dropped");
    let out = s.ok(
        "subscribe",
        &[
            "--region",
            "R",
            "--durable-id",
            "dr",
            "--exit-on-live",
            "--close",
            "keepalive",
        ],
    );
    assert_connected(&out[0], Some("dr"), "new", None, &s);
    assert_closed(out.last().unwrap(), true);

    // No interest at all: nothing to replay, live for --region at once.
    let out = s.ok("subscribe", &["--region", "R", "--exit-on-live"]);
    assert_eq!(out.len(), 3, "{out:?}");
    assert_connected(&out[0], None, "none", None, &s);
    assert_live(&out[1], "R");
    assert_closed(&out[2], false);
    let out = s.ok(
        "subscribe",
        &["--region", "R", "--durable-id", "empty", "--exit-on-live"],
    );
    assert_eq!(out.len(), 3, "{out:?}");
    assert_connected(&out[0], Some("empty"), "new", None, &s);
    assert_live(&out[1], "R");
    assert_closed(&out[2], true);

    // A non-durable subscriber with --close keepalive/drop still exits cleanly.
    let out = s.ok(
        "subscribe",
        &[
            "--region",
            "R",
            "--all-keys",
            "--exit-on-live",
            "--close",
            "drop",
        ],
    );
    assert_closed(out.last().unwrap(), false);

    // --timeout 1: the queue expires while away; the next run sees `expired` once.
    let out = s.ok(
        "subscribe",
        &[
            "--region",
            "R",
            "--durable-id",
            "ex",
            "--timeout",
            "1",
            "--all-keys",
            "--exit-on-live",
        ],
    );
    assert_connected(&out[0], Some("ex"), "new", None, &s);
    assert_eq!(s.queue("ex").unwrap()["timeout_secs"], 1);
    eventually("ex expired", || s.queue("ex").is_none());
    let out = s.ok(
        "subscribe",
        &["--region", "R", "--durable-id", "ex", "--exit-on-live"],
    );
    assert_connected(&out[0], Some("ex"), "expired", None, &s);
    let out = s.ok(
        "subscribe",
        &["--region", "R", "--durable-id", "ex", "--exit-on-live"],
    );
    assert_connected(&out[0], Some("ex"), "resumed", Some(0), &s);
    s.stop();
}

// ---------------------------------------------------------------------------------------------
// queues

#[test]
fn queues_pages_filters_and_prints_a_table() {
    let s = start_server(&[]);
    // Three away durable queues with 3, 2 and 1 events pending.
    for (id, key) in [("qa", "k"), ("qb", "k"), ("qc", "k")] {
        s.ok(
            "subscribe",
            &[
                "--region",
                "R",
                "--durable-id",
                id,
                "--key",
                key,
                "--exit-on-live",
            ],
        );
    }
    s.ok(
        "subscribe",
        &[
            "--region",
            "S",
            "--durable-id",
            "qa",
            "--all-keys",
            "--exit-on-live",
        ],
    );
    s.ok(
        "subscribe",
        &[
            "--region",
            "T",
            "--durable-id",
            "qb",
            "--all-keys",
            "--exit-on-live",
        ],
    );
    s.put("R", "k", "1");
    s.put("S", "x", "1");
    s.put("T", "y", "1");
    s.put("S", "z", "1");
    let ids = |lines: &[Value]| -> Vec<String> {
        lines
            .iter()
            .filter(|l| l["type"] == "queue" && l["durable_id"].is_string())
            .map(|l| l["id"].as_str().unwrap().to_string())
            .collect()
    };
    let all = s.ok("queues", &["--state", "away"]);
    assert_eq!(ids(&all), ["qa", "qb", "qc"], "most pending first");
    let qa = &all[0];
    assert_queue_fields(qa);
    assert_eq!(qa["pending"], 3);
    assert_eq!(
        qa["expires_at_ms"].as_u64(),
        qa["away_since_ms"].as_u64().map(|t| t + 300_000)
    );
    assert!(qa["oldest_pending_age_ms"].is_u64(), "{qa}");
    // One page, then the next from its token.
    let first = s.ok("queues", &["--state", "away", "--limit", "2"]);
    assert_eq!(ids(&first), ["qa", "qb"]);
    let page = first.last().unwrap();
    assert_fields(page, &["type", "next", "total", "unreachable"]);
    assert_eq!(
        (page["type"].as_str(), page["total"].as_u64()),
        (Some("page"), Some(3))
    );
    let next = page["next"].as_str().unwrap();
    let rest = s.ok(
        "queues",
        &["--state", "away", "--limit", "2", "--after", next],
    );
    assert_eq!(ids(&rest), ["qc"]);
    assert_eq!(rest.last().unwrap()["next"], Value::Null);
    // Filters and sorts.
    assert_eq!(ids(&s.ok("queues", &["--id", "qb"])), ["qb"]);
    assert_eq!(ids(&s.ok("queues", &["--region", "T"])), ["qb"]);
    assert_eq!(
        ids(&s.ok(
            "queues",
            &["--state", "away", "--sort", "id", "--order", "desc"]
        )),
        ["qc", "qb", "qa"]
    );
    // For people: a table with a header.
    let out = s.run("queues", &["--state", "away", "--format", "table"]);
    assert!(out.status.success(), "{}", out.stderr);
    let lines = &out.lines;
    assert!(
        lines[0].starts_with("ID") && lines[0].contains("PENDING"),
        "{lines:?}"
    );
    assert_eq!(lines.len(), 4, "{lines:?}");
    assert!(
        lines[1].starts_with("qa ") && lines[1].contains(" away "),
        "{lines:?}"
    );
    // Bad input: argument errors before connecting, a bad token from the server.
    let bad = s.run("queues", &["--limit", "0"]);
    assert_eq!(bad.status.code(), Some(2), "{}", bad.stderr);
    let bad = s.run("queues", &["--sort", "size"]);
    assert_eq!(bad.status.code(), Some(2), "{}", bad.stderr);
    let bad = s.run("queues", &["--after", "garbage"]);
    assert_eq!(bad.status.code(), Some(1));
    assert!(bad.stderr.contains("paging token"), "{}", bad.stderr);
    s.stop();
}

#[test]
fn queues_lists_every_queue_with_exact_fields() {
    let s = start_server(&[]);
    // (The `tether queues` connection itself holds a non-durable queue with no interest.)
    let listed = |qs: Vec<Value>| -> Vec<Value> {
        qs.into_iter()
            .filter(|q| !(q["durable_id"].is_null() && q["interests"] == serde_json::json!([])))
            .collect()
    };
    assert!(listed(s.queues()).is_empty());
    // Away, with key, regex and all interests, one of them non-durable (dropped when away).
    let out = s.ok(
        "subscribe",
        &[
            "--region",
            "R",
            "--durable-id",
            "aw",
            "--timeout",
            "77",
            "--key",
            "k1",
            "--regex",
            "r.*",
            "--exit-on-live",
        ],
    );
    assert_connected(&out[0], Some("aw"), "new", None, &s);
    let out = s.ok(
        "subscribe",
        &[
            "--region",
            "S",
            "--durable-id",
            "aw",
            "--timeout",
            "77",
            "--all-keys",
            "--exit-on-live",
        ],
    );
    assert_connected(&out[0], Some("aw"), "resumed", Some(0), &s);
    // Ready and connected, with a non-durable interest.
    let ready = s.spawn(
        "subscribe",
        &[
            "--region",
            "R",
            "--durable-id",
            "rd",
            "--key",
            "k1",
            "--non-durable",
        ],
    );
    ready.expect("connected");
    assert_live(&ready.line(), "R");
    let conn = s.spawn(
        "subscribe",
        &[
            "--region",
            "R",
            "--durable-id",
            "cn",
            "--regex",
            "x+",
            "--no-ready",
            "--timeout",
            "42",
        ],
    );
    conn.expect("connected");
    // A non-durable client.
    let plain = s.spawn("subscribe", &["--region", "R", "--key", "p"]);
    plain.expect("connected");
    assert_live(&plain.line(), "R");
    eventually("cn registered", || {
        s.queue("cn")
            .is_some_and(|q| !q["interests"].as_array().unwrap().is_empty())
    });
    s.put("R", "k1", "v");
    s.put("R", "rx", "v");
    s.put("R", "xx", "v");
    s.put("S", "any", "v");
    assert_event(&ready.line(), "R", "k1", "create", Some("v"));

    let qs = listed(s.queues());
    assert_eq!(qs.len(), 4, "{qs:?}");
    let aw = qs.iter().find(|q| q["durable_id"] == "aw").unwrap();
    assert_eq!(aw["state"], "away");
    assert_eq!(aw["timeout_secs"], 77);
    assert_eq!(aw["pending"], 3, "{aw}");
    assert_eq!(aw["role"], "primary");
    let mut ints: Vec<Value> = aw["interests"].as_array().unwrap().clone();
    ints.sort_by_key(|i| i.to_string());
    let mut want = vec![
        serde_json::json!({"region":"R","kind":"key","spec":"k1","durable":true}),
        serde_json::json!({"region":"R","kind":"regex","spec":"r.*","durable":true}),
    ];
    let all = ints
        .iter()
        .find(|i| i["kind"] == "all")
        .expect("all-keys interest")
        .clone();
    assert_eq!(
        (all["region"].as_str(), all["durable"].as_bool()),
        (Some("S"), Some(true))
    );
    want.push(all);
    want.sort_by_key(|i| i.to_string());
    assert_eq!(ints, want);

    let rd = qs.iter().find(|q| q["durable_id"] == "rd").unwrap();
    assert_eq!(rd["state"], "ready");
    assert_eq!(rd["timeout_secs"], 300);
    assert_eq!(
        rd["interests"],
        serde_json::json!([{"region":"R","kind":"key","spec":"k1","durable":false}])
    );
    let cn = qs.iter().find(|q| q["durable_id"] == "cn").unwrap();
    assert_eq!(cn["state"], "connected");
    assert_eq!(cn["timeout_secs"], 42);
    assert_eq!(cn["pending"], 1, "{cn}");
    assert_eq!(
        cn["interests"],
        serde_json::json!([{"region":"R","kind":"regex","spec":"x+","durable":true}])
    );
    let p = qs
        .iter()
        .find(|q| q["durable_id"].is_null())
        .expect("non-durable queue");
    assert_eq!(
        p["interests"],
        serde_json::json!([{"region":"R","kind":"key","spec":"p","durable":false}])
    );
    for q in &qs {
        assert_eq!(q["role"], "primary");
        assert!(
            q["acked_offset"].as_u64() <= q["end_offset"].as_u64(),
            "{q}"
        );
    }

    // rd's non-durable interest goes with the session; the queue stays.
    ready.sigterm();
    assert!(ready.finish().status.success());
    eventually("rd away", || {
        s.queue("rd").is_some_and(|q| q["state"] == "away")
    });
    assert_eq!(s.queue("rd").unwrap()["interests"], serde_json::json!([]));
    // Its kept queue has no interest left: a resumed run with nothing pending goes live at once.
    let out = s.ok(
        "subscribe",
        &["--region", "R", "--durable-id", "rd", "--exit-on-live"],
    );
    assert_eq!(out.len(), 3, "{out:?}");
    assert_connected(&out[0], Some("rd"), "resumed", Some(0), &s);
    assert_live(&out[1], "R");
    assert_closed(&out[2], true);
    drop(conn);
    drop(plain);
    s.stop();
}

// ---------------------------------------------------------------------------------------------
// user errors

#[test]
fn bad_arguments_give_one_error_line() {
    let s = start_server(&[]);
    let tmp = tempfile::tempdir().unwrap();
    let missing_ca = tmp.path().join("nope.pem").display().to_string();
    let (addr, ca) = (s.addr.as_str(), s.ca.as_str());
    let cases: Vec<Vec<&str>> = vec![
        vec![
            "put",
            "--server",
            addr,
            "--ca",
            ca,
            "--region",
            "R",
            "--key",
            "k",
            "--value",
            "v",
            "--bogus-flag",
        ],
        vec!["frobnicate"],
        vec![
            "server",
            "--listen",
            "127.0.0.1:0",
            "--advertise",
            "not a host!",
        ],
        vec![
            "subscribe",
            "--server",
            addr,
            "--ca",
            ca,
            "--region",
            "R",
            "--reconnect",
            "--no-ready",
        ],
        vec![
            "subscribe",
            "--server",
            addr,
            "--ca",
            ca,
            "--region",
            "R",
            "--failure-timeout-ms",
            "5",
        ],
        vec!["get", "--server", addr, "--ca", ca, "--key", "k"],
        vec![
            "put", "--server", addr, "--ca", ca, "--key", "k", "--value", "v",
        ],
        vec!["subscribe", "--server", addr, "--ca", ca, "--all-keys"],
        vec![
            "subscribe",
            "--server",
            addr,
            "--ca",
            ca,
            "--region",
            "R",
            "--all-keys",
            "--durable-id",
            "d",
            "--redundancy",
            "3",
        ],
        vec![
            "put",
            "--server",
            addr,
            "--ca",
            ca,
            "--region",
            "R",
            "--key",
            "k",
            "--value",
            "v",
            "--ack",
            "sometimes",
        ],
        vec![
            "get",
            "--server",
            "not an address",
            "--ca",
            ca,
            "--region",
            "R",
            "--key",
            "k",
        ],
        vec![
            "get",
            "--server",
            "127.0.0.1",
            "--ca",
            ca,
            "--region",
            "R",
            "--key",
            "k",
        ],
        vec!["queues", "--server", "", "--ca", ca],
        vec![
            "get",
            "--server",
            addr,
            "--ca",
            &missing_ca,
            "--region",
            "R",
            "--key",
            "k",
        ],
        vec![
            "subscribe",
            "--server",
            addr,
            "--ca",
            ca,
            "--region",
            "R",
            "--all-keys",
            "--policy",
            "bogus",
        ],
        vec![
            "subscribe",
            "--server",
            addr,
            "--ca",
            ca,
            "--region",
            "R",
            "--all-keys",
            "--close",
            "bogus",
        ],
        vec![
            "subscribe",
            "--server",
            addr,
            "--ca",
            ca,
            "--region",
            "R",
            "--timeout",
            "soon",
        ],
        vec!["put", "--server", addr, "--ca", ca, "--region", "R"],
        vec![
            "put", "--server", addr, "--ca", ca, "--region", "R", "--key", "k",
        ],
        vec![
            "put", "--server", addr, "--ca", ca, "--region", "R", "--key", "k", "--value", "v",
            "--count", "3",
        ],
        vec!["close-durable", "--server", addr, "--ca", ca],
        vec!["server", "--listen", "127.0.0.1:0", "--sync"],
        vec!["cluster", "drain", "--server", addr, "--ca", ca],
        vec![
            "cluster", "drain", "n1", "--undo", "--wait", "5", "--server", addr,
        ],
        vec!["cluster", "drain", "bad id!", "--server", addr, "--ca", ca],
        vec!["cluster", "remove-node", "--server", addr, "--ca", ca],
        vec![
            "cluster",
            "remove-node",
            "bad id!",
            "--server",
            addr,
            "--ca",
            ca,
        ],
        vec!["cluster", "add-node", "n4", "--server", addr, "--ca", ca],
        vec![
            "cluster",
            "add-node",
            "bad id!",
            "127.0.0.1:7400",
            "--server",
            addr,
            "--ca",
            ca,
        ],
        vec![
            "cluster",
            "add-node",
            "n4",
            "127.0.0.1:0",
            "--server",
            addr,
            "--ca",
            ca,
        ],
        vec![
            "cluster", "add-node", "n4", "no-port", "--server", addr, "--ca", ca,
        ],
        vec!["cluster", "frobnicate"],
    ];
    let procs: Vec<(String, Proc)> = cases
        .iter()
        .map(|c| (c.join(" "), tether(&strings(c))))
        .collect();
    for (what, p) in procs {
        let out = p.finish();
        assert!(out.lines.is_empty(), "{what}: stdout {:?}", out.lines);
        // Every case but the missing CA file is an argument error: exit status 2.
        if !what.contains("nope.pem") {
            assert_eq!(out.status.code(), Some(2), "{what}: {:?}", out.stderr);
        }
        let err = out.failed();
        if what.contains("--policy bogus") || what.contains("--close bogus") {
            assert!(err.contains("bogus"), "{what}: {err}");
        }
        if what.contains("nope.pem") {
            assert!(err.contains("nope.pem"), "{what}: {err}");
        }
    }
    // A valid request a single node cannot serve: exit status 1, the reason.
    let out = run(&["cluster", "drain", "n1", "--server", addr, "--ca", ca]);
    assert_eq!(out.status.code(), Some(1), "{:?}", out.stderr);
    let err = out.failed();
    assert!(err.contains("not a cluster member"), "{err}");
    let out = run(&["cluster", "remove-node", "n1", "--server", addr, "--ca", ca]);
    assert_eq!(out.status.code(), Some(1), "{:?}", out.stderr);
    let err = out.failed();
    assert!(err.contains("not a cluster member"), "{err}");
    let out = run(&[
        "cluster",
        "add-node",
        "n4",
        "127.0.0.1:7400",
        "--server",
        addr,
        "--ca",
        ca,
    ]);
    assert_eq!(out.status.code(), Some(1), "{:?}", out.stderr);
    let err = out.failed();
    assert!(err.contains("not a cluster member"), "{err}");
    s.stop();
}

#[test]
fn dev_ca_creates_a_reusable_ca_without_a_server() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path().to_str().unwrap();
    let out = run(&["dev-ca", "--data-dir", d]);
    assert!(out.status.success(), "{}", out.stderr);
    let v = out.json();
    assert_eq!(v.len(), 1);
    assert_eq!(v[0]["type"], "dev-ca");
    let ca = v[0]["ca"].as_str().unwrap().to_string();
    assert!(ca.ends_with("tls/ca.pem"), "{ca}");
    let pem = std::fs::read(&ca).unwrap();
    // A second run keeps the CA (nodes that copied it stay one cluster).
    let again = run(&["dev-ca", "--data-dir", d]);
    assert_eq!(again.json()[0]["ca"], ca.as_str());
    assert_eq!(std::fs::read(&ca).unwrap(), pem);
    assert!(dir.path().join("tls/ca.key").exists());
}

/// On a cluster: `subscribe --redundancy 1` gets the queue a copy, `put --ack replicated`
/// returns once the copy holds the event, and `queues` shows the primary with its copy
/// (`copies`, `lag_entries`) and, on the copy's node, the copy (`role` secondary, `primary`).
#[test]
fn cluster_redundancy_replicated_ack_and_queue_copies() {
    let p = common::cluster::ProcCluster::start(3);
    let addr = |i: usize| p.get(i).addr.to_string();
    let ca = p.get(0).ca.display().to_string();
    let (n1, n2) = (addr(0), addr(1));
    // Durable client "d" through n1, until live, then away.
    let subscribe_d = |extra: &[&str]| {
        let mut args = vec![
            "subscribe",
            "--server",
            &n1,
            "--ca",
            &ca,
            "--region",
            "R",
            "--all-keys",
            "--durable-id",
            "d",
            "--exit-on-live",
            "--close",
            "keepalive",
        ];
        args.extend_from_slice(extra);
        run(&args).ok()
    };
    let lines = subscribe_d(&["--redundancy", "1"]);
    assert_eq!(lines[0]["queue"], "new");
    let lines = run(&[
        "put",
        "--server",
        &n2,
        "--ca",
        &ca,
        "--region",
        "R",
        "--key",
        "k",
        "--value",
        "v",
        "--ack",
        "replicated",
    ])
    .ok();
    assert_eq!(
        lines,
        vec![serde_json::json!({"type":"published","count":1})]
    );
    let queue_on = |server: &str| -> Vec<Value> {
        run(&["queues", "--server", server, "--ca", &ca])
            .ok()
            .into_iter()
            .filter(|q| q["durable_id"] == "d")
            .collect()
    };
    let primary = queue_on(&n1);
    assert_eq!(primary.len(), 1);
    // --cluster: every member's queues through one node, the copy included.
    let everywhere: Vec<Value> = run(&["queues", "--server", &n1, "--ca", &ca, "--cluster"])
        .ok()
        .into_iter()
        .filter(|q| q["durable_id"] == "d")
        .collect();
    let mut roles: Vec<&str> = everywhere
        .iter()
        .map(|q| q["role"].as_str().unwrap())
        .collect();
    roles.sort();
    assert_eq!(roles, ["primary", "secondary"]);
    assert_eq!(
        (&primary[0]["role"], &primary[0]["pending"]),
        (&Value::from("primary"), &Value::from(1))
    );
    let copies = primary[0]["copies"].as_array().expect("copies listed");
    assert_eq!(copies.len(), 1);
    assert_eq!(
        fields(&copies[0]),
        ["lag_entries", "node"].map(String::from).into()
    );
    assert_eq!(copies[0]["lag_entries"], 0, "acknowledged as replicated");
    let node = copies[0]["node"].as_str().unwrap();
    let copy_node = addr(node.trim_start_matches('n').parse::<usize>().unwrap() - 1);
    let copy = queue_on(&copy_node);
    assert_eq!(copy.len(), 1);
    assert_eq!(
        (
            &copy[0]["role"],
            &copy[0]["primary"],
            &copy[0]["pending"],
            &copy[0]["state"]
        ),
        (
            &Value::from("secondary"),
            &Value::from("n1"),
            &Value::from(1),
            &Value::from("away")
        )
    );

    // `cluster drain`: n1 hands its queue (and any copy) to the others; --wait prints each
    // change until it holds nothing.
    let drain = |extra: &[&str]| {
        let mut args = vec!["cluster", "drain", "n1", "--server", &n2, "--ca", &ca];
        args.extend_from_slice(extra);
        run(&args)
    };
    // A wait that ends before the drain does: exit 1, naming what is left.
    let err = drain(&["--wait", "0"]).failed();
    assert!(err.contains("n1 still holds 1 primaries"), "{err}");
    let lines = drain(&["--wait", "60"]).ok();
    for l in &lines {
        assert_fields(l, &["type", "node_id", "draining", "primaries", "copies"]);
        assert_eq!(
            (&l["type"], &l["node_id"], &l["draining"]),
            (
                &Value::from("drain"),
                &Value::from("n1"),
                &Value::from(true)
            )
        );
    }
    assert_eq!(lines[0]["primaries"], 1, "{lines:?}");
    let last = lines.last().unwrap();
    assert_eq!(
        (&last["primaries"], &last["copies"]),
        (&Value::from(0), &Value::from(0))
    );
    let status = drain(&["--status"]).ok();
    assert_eq!(status, vec![last.clone()]);
    // The queue resumes on its new primary, its event there.
    let lines = subscribe_d(&[]);
    assert_eq!(
        (&lines[0]["queue"], &lines[0]["pending"]),
        (&Value::from("resumed"), &Value::from(1))
    );
    assert_ne!(lines[0]["primary"], n1.as_str(), "{lines:?}");
    let undone = drain(&["--undo"]).ok();
    assert_eq!(undone[0]["draining"], false);
    let err = run(&["cluster", "drain", "n9", "--server", &n2, "--ca", &ca]).failed();
    assert!(err.contains("not a member"), "{err}");

    // `cluster remove-node`: n1, primary of nothing now, leaves the cluster; the answer names
    // the members left.
    let lines = run(&["cluster", "remove-node", "n1", "--server", &n2, "--ca", &ca]).ok();
    assert_eq!(lines.len(), 1, "{lines:?}");
    assert_fields(&lines[0], &["type", "node_id", "members"]);
    assert_eq!(lines[0]["type"], "node-removed");
    assert_eq!(lines[0]["node_id"], "n1");
    assert_eq!(lines[0]["members"], serde_json::json!(["n2", "n3"]));
    let err = run(&["cluster", "remove-node", "n1", "--server", &n2, "--ca", &ca]).failed();
    assert!(err.contains("not a member"), "{err}");

    // `cluster add-node` of a member answers as its addition did: the members, it among them
    // (adding a new node: `tests/cluster_membership.rs`).
    let n3 = addr(2);
    let lines = run(&[
        "cluster", "add-node", "n3", &n3, "--server", &n2, "--ca", &ca,
    ])
    .ok();
    assert_eq!(lines.len(), 1, "{lines:?}");
    assert_fields(&lines[0], &["type", "node_id", "members"]);
    assert_eq!(lines[0]["type"], "node-added");
    assert_eq!(lines[0]["node_id"], "n3");
    assert_eq!(lines[0]["members"], serde_json::json!(["n2", "n3"]));
}

/// `tether server --queue-bytes-max N` applies the byte limit (the refusal names it), and the
/// node exports the bytes waiting as `tether_pending_bytes`.
#[test]
fn server_queue_bytes_max_refuses_past_it_and_exports_pending_bytes() {
    let s = start_server(&["--queue-bytes-max", "4096", "--metrics", "127.0.0.1:0"]);
    let out = s.ok(
        "subscribe",
        &[
            "--region",
            "R",
            "--durable-id",
            "d1",
            "--all-keys",
            "--exit-on-live",
        ],
    );
    assert_closed(out.last().expect("lines"), true);
    let big = "x".repeat(3000);
    s.put("R", "a", &big);
    let msg = s
        .run("put", &["--region", "R", "--key", "b", "--value", &big])
        .failed();
    assert!(msg.contains("queue of d1 is full (4096 bytes)"), "{msg}");
    let bytes = s.queue("d1").expect("d1 listed")["pending_bytes"]
        .as_u64()
        .expect("pending_bytes");
    assert!((3000..=4096).contains(&bytes), "{bytes}");
    let m = s.listening["metrics"]
        .as_str()
        .expect("metrics")
        .to_string();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    loop {
        let resp = http_get(&m, "/metrics");
        if resp.contains(&format!("tether_pending_bytes {bytes}")) {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "no tether_pending_bytes {bytes}: {resp}"
        );
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
    s.stop();
}
