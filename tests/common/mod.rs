//! Shared test harness: real nodes (RocksDB in a temp dir, QUIC+TLS on loopback port 0) and
//! helpers to drive clients.
#![allow(dead_code)]

use std::time::Duration;

pub mod cluster;
pub mod crash;
pub mod ports;

use tether::auth::AuthConfig;
use tether::client::{Client, ClientBuilder, ClientEvent, Event, EventStream, Interest};
use tether::config::{Limits, ServerConfig};
use tether::server::Node;

/// Connects `builder`'s durable client, registers all-keys interest in `region`, says ready and
/// goes away (the queue kept): its queue then gathers what is published.
pub async fn park(builder: ClientBuilder, region: &str) {
    let c = builder.connect().await.unwrap();
    c.region(region)
        .register(Interest::all_keys())
        .await
        .unwrap();
    c.ready_for_events().await.unwrap();
    c.close(true).await.unwrap();
}

/// Upper bound for anything a test waits on; a hang fails the test instead of stalling CI.
pub const WAIT: Duration = Duration::from_secs(20);
/// How long a test watches to assert that nothing arrives.
pub const QUIET: Duration = Duration::from_millis(400);

fn config(dir: &std::path::Path, limits: &Limits, auth: &Option<AuthConfig>) -> ServerConfig {
    let mut c = ServerConfig::ephemeral(dir);
    c.limits = limits.clone();
    c.auth = auth.clone();
    c
}

pub struct TestNode {
    pub node: Option<Node>,
    pub dir: tempfile::TempDir,
    pub limits: Limits,
    pub auth: Option<AuthConfig>,
}

impl TestNode {
    pub async fn start() -> TestNode {
        Self::start_with(Limits::default()).await
    }

    /// A node with these operator limits.
    pub async fn start_with(limits: Limits) -> TestNode {
        Self::start_full(limits, None).await
    }

    /// A node that authenticates clients with this `[auth]` configuration.
    pub async fn start_auth(auth: AuthConfig) -> TestNode {
        Self::start_full(Limits::default(), Some(auth)).await
    }

    async fn start_full(limits: Limits, auth: Option<AuthConfig>) -> TestNode {
        let dir = tempfile::tempdir().expect("tempdir");
        let node = Node::start(config(dir.path(), &limits, &auth))
            .await
            .expect("node starts");
        TestNode {
            node: Some(node),
            dir,
            limits,
            auth,
        }
    }

    pub fn node(&self) -> &Node {
        self.node.as_ref().expect("running")
    }

    /// Stops the node cleanly and starts it again on the same data directory (new port).
    pub async fn restart(&mut self) {
        self.node.take().expect("running").shutdown().await;
        let node = Node::start(config(self.dir.path(), &self.limits, &self.auth))
            .await
            .expect("node restarts");
        self.node = Some(node);
    }

    pub fn builder(&self) -> ClientBuilder {
        ClientBuilder::new()
            .server(self.node().addr())
            .ca_file(self.node().ca_file())
    }

    pub async fn durable(&self, id: &str, timeout_secs: u64) -> Client {
        self.builder()
            .durable(id, timeout_secs)
            .connect()
            .await
            .expect("durable client connects")
    }

    pub async fn plain(&self) -> Client {
        self.builder().connect().await.expect("client connects")
    }

    pub async fn put(&self, region: &str, key: &str, value: &str) {
        let p = self.node().publisher().await.expect("publisher");
        p.put(region, key, value.as_bytes().to_vec())
            .await
            .expect("put");
    }

    /// Puts `key-{i}` = `v-{i}` for i in range.
    pub async fn put_many(&self, region: &str, range: std::ops::Range<u32>) {
        let p = self.node().publisher().await.expect("publisher");
        for i in range {
            p.put(region, &format!("key-{i}"), format!("v-{i}").into_bytes())
                .await
                .expect("put");
        }
    }

    pub fn queue(&self, durable_id: &str) -> Option<tether::protocol::QueueReport> {
        self.node()
            .queues()
            .into_iter()
            .find(|q| q.durable_id.as_deref() == Some(durable_id))
    }
}

/// Reads until `n` entry events arrived (live markers are kept too). Fails after [`WAIT`].
pub async fn take_events(stream: &mut EventStream, n: usize) -> Vec<ClientEvent> {
    let mut out = Vec::new();
    let mut events = 0;
    while events < n {
        let ev = tokio::time::timeout(WAIT, stream.next())
            .await
            .unwrap_or_else(|_| panic!("timed out after {events} of {n} events: {out:?}"))
            .unwrap_or_else(|| panic!("stream ended after {events} of {n} events: {out:?}"));
        if matches!(ev, ClientEvent::Event(_)) {
            events += 1;
        }
        out.push(ev);
    }
    out
}

/// Reads until the live marker of `region` arrived; returns everything before and including it.
pub async fn until_live(stream: &mut EventStream, region: &str) -> Vec<ClientEvent> {
    let mut out = Vec::new();
    loop {
        let ev = tokio::time::timeout(WAIT, stream.next())
            .await
            .unwrap_or_else(|_| panic!("no live marker for {region}; got {out:?}"))
            .unwrap_or_else(|| panic!("stream ended before live; got {out:?}"));
        let done =
            matches!(&ev, ClientEvent::Live { regions } if regions.iter().any(|r| r == region));
        out.push(ev);
        if done {
            return out;
        }
    }
}

/// Everything that arrives within [`QUIET`].
pub async fn drain_quiet(stream: &mut EventStream) -> Vec<ClientEvent> {
    let mut out = Vec::new();
    while let Ok(Some(ev)) = tokio::time::timeout(QUIET, stream.next()).await {
        out.push(ev);
    }
    out
}

pub fn entries(evs: &[ClientEvent]) -> Vec<&Event> {
    evs.iter()
        .filter_map(|e| {
            if let ClientEvent::Event(e) = e {
                Some(e)
            } else {
                None
            }
        })
        .collect()
}

/// The regions announced by the live markers among `evs`.
pub fn lives(evs: &[ClientEvent]) -> Vec<&str> {
    evs.iter()
        .filter_map(|e| {
            if let ClientEvent::Live { regions } = e {
                Some(regions)
            } else {
                None
            }
        })
        .flatten()
        .map(String::as_str)
        .collect()
}

pub fn keys(evs: &[ClientEvent]) -> Vec<String> {
    entries(evs).iter().map(|e| e.key.clone()).collect()
}

pub fn value(e: &Event) -> Option<String> {
    e.value
        .as_ref()
        .map(|v| String::from_utf8(v.clone()).expect("utf-8"))
}

/// Polls `f` until it returns true or [`WAIT`] passes.
pub async fn eventually(what: &str, mut f: impl FnMut() -> bool) {
    let start = std::time::Instant::now();
    while !f() {
        assert!(start.elapsed() < WAIT, "timed out waiting for: {what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A real `tether server` process on loopback port 0 with its data in `dir` (killed on drop).
/// Its log goes to a file of its own, printed (the last [`LOG_TAIL_LINES`] lines) when the
/// test fails, so a failing test shows its own nodes' logs rather than every test's interleaved.
pub struct ServerProc {
    pub child: std::process::Child,
    /// The server's standard error (its log).
    pub log: tempfile::NamedTempFile,
    pub addr: std::net::SocketAddr,
    pub ca: std::path::PathBuf,
    /// The HTTP address of `/metrics` and the admin API, when `extra` asked for one.
    pub metrics: Option<std::net::SocketAddr>,
}

impl ServerProc {
    /// Starts the binary with `extra` flags and waits for its `listening` line.
    pub fn start(dir: &std::path::Path, extra: &[&str]) -> ServerProc {
        use std::io::{BufRead, BufReader};
        use std::process::{Command, Stdio};
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_tether"));
        cmd.arg("server");
        if !extra.contains(&"--metrics") {
            cmd.args(["--metrics", "off"]);
        }
        if !extra.contains(&"--listen") {
            cmd.args(["--listen", "127.0.0.1:0"]);
        }
        let log = tempfile::NamedTempFile::new().expect("log file");
        let mut child = cmd
            .args(extra)
            .arg("--data-dir")
            .arg(dir)
            .stdout(Stdio::piped())
            .stderr(log.reopen().expect("log file"))
            .spawn()
            .expect("spawn tether server");
        let mut line = String::new();
        BufReader::new(child.stdout.take().unwrap())
            .read_line(&mut line)
            .expect("listening line");
        let v: serde_json::Value = serde_json::from_str(&line)
            .unwrap_or_else(|e| panic!("bad listening line {line:?}: {e}"));
        assert_eq!(v["type"], "listening");
        ServerProc {
            child,
            log,
            addr: v["addr"].as_str().unwrap().parse().unwrap(),
            ca: std::path::PathBuf::from(v["ca"].as_str().unwrap()),
            metrics: v["metrics"].as_str().and_then(|m| m.parse().ok()),
        }
    }

    pub fn builder(&self) -> ClientBuilder {
        ClientBuilder::new().server(self.addr).ca_file(&self.ca)
    }

    /// SIGKILL: no shutdown path runs.
    pub fn kill9(mut self) {
        self.child.kill().expect("SIGKILL");
        self.child.wait().expect("reap");
    }

    /// Prints the end of this server's log to standard error, headed by its address.
    pub fn print_log_tail(&self) {
        let text = std::fs::read_to_string(self.log.path()).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        let from = lines.len().saturating_sub(LOG_TAIL_LINES);
        eprintln!(
            "---- log of the server at {} (last {} of {} lines) ----",
            self.addr,
            lines.len() - from,
            lines.len()
        );
        for line in &lines[from..] {
            eprintln!("{line}");
        }
    }

    /// SIGTERM, and waits for the clean exit (status 0).
    pub fn sigterm(mut self) {
        let st = std::process::Command::new("kill")
            .arg("-TERM")
            .arg(self.child.id().to_string())
            .status()
            .expect("kill");
        assert!(st.success());
        let st = self.child.wait().expect("reap");
        assert!(st.success(), "server exit after SIGTERM: {st}");
    }
}

/// How much of a server's log a failing test prints.
pub const LOG_TAIL_LINES: usize = 400;

impl Drop for ServerProc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        if std::thread::panicking() {
            self.print_log_tail();
        }
    }
}

/// The body of a plain HTTP/1.1 GET of `path` at `addr` (the metrics and admin address),
/// headers included; empty if the node does not answer.
pub fn http_get(addr: &str, path: &str) -> String {
    use std::io::{Read, Write};
    let Ok(mut s) = std::net::TcpStream::connect(addr) else {
        return String::new();
    };
    s.set_read_timeout(Some(std::time::Duration::from_secs(5)))
        .unwrap();
    if write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n"
    )
    .is_err()
    {
        return String::new();
    }
    let mut buf = Vec::new();
    let _ = s.read_to_end(&mut buf);
    String::from_utf8_lossy(&buf).into_owned()
}

/// A UDP relay in front of `server` for one client (the first address that sends to it); while
/// `cut` is set it drops every datagram both ways, like a network cut.
pub async fn relay(
    server: std::net::SocketAddr,
) -> (
    std::net::SocketAddr,
    std::sync::Arc<std::sync::atomic::AtomicBool>,
) {
    let cut = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let addr = relay_with(server, cut.clone()).await;
    (addr, cut)
}

/// [`relay`] controlled by a `cut` flag the caller may share between relays.
pub async fn relay_with(
    server: std::net::SocketAddr,
    cut: std::sync::Arc<std::sync::atomic::AtomicBool>,
) -> std::net::SocketAddr {
    use std::sync::atomic::Ordering;
    let front = std::sync::Arc::new(tokio::net::UdpSocket::bind("127.0.0.1:0").await.unwrap());
    let back = std::sync::Arc::new(tokio::net::UdpSocket::bind("127.0.0.1:0").await.unwrap());
    back.connect(server).await.unwrap();
    let addr = front.local_addr().unwrap();
    let client = std::sync::Arc::new(std::sync::Mutex::new(None));
    let (f, b, c, k) = (front.clone(), back.clone(), client.clone(), cut.clone());
    // A receive error (an ICMP "port unreachable" reported for an earlier send, while the
    // server is not up yet) does not end the relay.
    tokio::spawn(async move {
        let mut buf = vec![0u8; 65536];
        loop {
            let Ok((n, from)) = f.recv_from(&mut buf).await else {
                continue;
            };
            *c.lock().unwrap() = Some(from);
            if !k.load(Ordering::Relaxed) {
                let _ = b.send(&buf[..n]).await;
            }
        }
    });
    tokio::spawn(async move {
        let mut buf = vec![0u8; 65536];
        loop {
            let Ok(n) = back.recv(&mut buf).await else {
                continue;
            };
            let to = *client.lock().unwrap();
            if let (Some(to), false) = (to, cut.load(Ordering::Relaxed)) {
                let _ = front.send_to(&buf[..n], to).await;
            }
        }
    });
    addr
}

/// Inside `impl Store for Wrapper`: every method but `write` and `region_get` (which a
/// fault-injecting wrapper changes) passes through to the wrapped store in field `$inner`;
/// `store_passthrough!(@but_state $inner)` leaves out `state_get` too.
#[macro_export]
macro_rules! store_passthrough {
    ($inner:ident) => {
        store_passthrough!(@but_state $inner);
        fn state_get(&self, key: &str) -> Result<Option<Vec<u8>>, tether_storage::StorageError> {
            self.$inner.state_get(key)
        }
    };
    (@but_state $inner:ident) => {
        fn queue_meta(
            &self,
            queue: tether_storage::QueueId,
        ) -> Result<Option<tether_storage::QueueMeta>, tether_storage::StorageError> {
            self.$inner.queue_meta(queue)
        }
        fn queues(
            &self,
        ) -> Result<
            Vec<(tether_storage::QueueId, tether_storage::QueueMeta)>,
            tether_storage::StorageError,
        > {
            self.$inner.queues()
        }
        fn read_entries(
            &self,
            queue: tether_storage::QueueId,
            from: tether_storage::Offset,
            to: tether_storage::Offset,
            max_bytes: usize,
            visit: &mut dyn FnMut(tether_storage::Offset, u8, &[u8]),
        ) -> Result<usize, tether_storage::StorageError> {
            self.$inner.read_entries(queue, from, to, max_bytes, visit)
        }
        fn region_scan(
            &self,
            region: &str,
            after: Option<&str>,
            visit: &mut dyn FnMut(&str, &[u8]) -> std::ops::ControlFlow<()>,
        ) -> Result<(), tether_storage::StorageError> {
            self.$inner.region_scan(region, after, visit)
        }
        fn regions_scan(
            &self,
            after: Option<(&str, &str)>,
            visit: &mut tether_storage::RegionVisitor<'_>,
        ) -> Result<(), tether_storage::StorageError> {
            self.$inner.regions_scan(after, visit)
        }
        fn flush(&self) -> Result<(), tether_storage::StorageError> {
            self.$inner.flush()
        }
        fn quiesce(&self) {
            self.$inner.quiesce()
        }
    };
}
