//! Server memory per connected client: a `tether server` process of its own (the figure is the
//! server's alone), `clients` durable clients connected and held open, idle; then `stalled` of
//! them each get a backlog of `backlog` events of 1 KiB, say ready, take one event and read
//! nothing more (the client library's buffer, its QUIC receive window and the server's send
//! window fill; the server holds at most its send window for each); then all gone. The figures are slopes past a warm-up set of connections, so the
//! server's fixed memory is left out; the bench process's own resident memory per client is
//! reported too (what a process embedding many clients pays).

use std::time::{Duration, Instant};

use tether::client::{Client, ClientEvent, Interest};
use tether::protocol::PublishOp;

use crate::common::rss_kb;
use crate::common::server::ServerProcess as Server;

/// Connections made before the baseline is taken (allocator pools, connection machinery warm).
const WARM_CONNECTIONS: usize = 50;
/// Wait for the server to settle before its memory is read, in milliseconds.
const SETTLE_MS: u64 = 1_500;
/// Value size of the backlog events, in bytes.
const VALUE_BYTES: usize = 1024;

pub struct Connections {
    pub clients: usize,
    pub stalled: usize,
    pub backlog: u64,
    /// Server resident memory with the warm-up connections only, in KiB.
    pub rss_warm_kb: u64,
    /// With every client connected and idle.
    pub rss_idle_kb: u64,
    /// After the stalled clients' backlogs were published (storage's write buffers grew), before
    /// any of them said ready.
    pub rss_published_kb: u64,
    /// With `stalled` clients' delivery streams full (each read one event and stalled).
    pub rss_stalled_kb: u64,
    /// After every client closed.
    pub rss_closed_kb: u64,
    /// The bench process (the clients' side): before and with every client connected.
    pub client_rss_before_kb: u64,
    pub client_rss_idle_kb: u64,
    pub connect: Duration,
}

impl Connections {
    fn per_client(&self, from: u64, to: u64) -> f64 {
        to.saturating_sub(from) as f64 * 1024.0 / self.clients as f64
    }
    /// Server bytes per idle connected durable client.
    pub fn idle_bytes_per_client(&self) -> f64 {
        self.per_client(self.rss_warm_kb, self.rss_idle_kb)
    }
    /// Server bytes each stalled client adds (its delivery behind a full send window) over an
    /// idle one (measured from after the backlogs were published).
    pub fn stalled_bytes_per_client(&self) -> f64 {
        self.rss_stalled_kb.saturating_sub(self.rss_published_kb) as f64 * 1024.0
            / self.stalled.max(1) as f64
    }
    /// Bench-process bytes per connected client (client library side).
    pub fn client_side_bytes_per_client(&self) -> f64 {
        self.per_client(self.client_rss_before_kb, self.client_rss_idle_kb)
    }
}

async fn connect(server: &Server, id: String, region: &str) -> Client {
    let c = server
        .builder
        .clone()
        .durable(id, 3600)
        .connect()
        .await
        .expect("durable client connects");
    c.region(region)
        .register(Interest::all_keys())
        .await
        .expect("register");
    c
}

async fn settle() {
    tokio::time::sleep(Duration::from_millis(SETTLE_MS)).await;
}

/// `window_bytes`: the node's per-connection receive and send windows (`[limits]`), when not
/// its defaults.
pub async fn run(
    dir: &std::path::Path,
    clients: usize,
    stalled: usize,
    backlog: u64,
    window_bytes: Option<u64>,
) -> Connections {
    let stalled = stalled.min(clients);
    let data = dir.join("connections");
    let config = dir.join("connections.toml");
    let mut args = vec!["--sync", "none"];
    if let Some(w) = window_bytes {
        std::fs::write(
            &config,
            format!(
                "[limits]\nconnection-receive-window-bytes = {w}\nconnection-send-window-bytes = {w}\n"
            ),
        )
        .expect("write config");
        args.extend(["--config", config.to_str().expect("utf-8 temp path")]);
    }
    let server = Server::start(&data, &args);
    let mut warm = Vec::new();
    for i in 0..WARM_CONNECTIONS {
        warm.push(connect(&server, format!("warm-{i}"), "idle").await);
    }
    settle().await;
    let rss_warm_kb = server.rss_kb();
    let client_rss_before_kb = rss_kb();
    let bar = crate::progress::bar(clients as u64, "connected clients");
    let t = Instant::now();
    let mut held = Vec::with_capacity(clients);
    for i in 0..clients {
        let region = if i < stalled { "stall" } else { "idle" };
        held.push(connect(&server, format!("conn-{i}"), region).await);
        bar.inc(1);
    }
    bar.finish_and_clear();
    let connect_time = t.elapsed();
    settle().await;
    let rss_idle_kb = server.rss_kb();
    let client_rss_idle_kb = rss_kb();

    // The stalled clients' queues get `backlog` events; each says ready, takes one event and
    // then reads nothing more: the server fills its send window and stops there.
    let publisher = server.builder.clone().connect().await.expect("publisher");
    let mut next = 0u64;
    while next < backlog {
        let n = (backlog - next).min(100);
        let ops = (next..next + n)
            .map(|i| PublishOp::Put {
                region: "stall".into(),
                key: format!("k{i}"),
                value: vec![b'v'; VALUE_BYTES],
            })
            .collect();
        publisher.publish(ops).await.expect("publish");
        next += n;
    }
    settle().await;
    let rss_published_kb = server.rss_kb();
    let mut streams = Vec::with_capacity(clients);
    for c in &held[..stalled] {
        c.ready_for_events().await.expect("ready");
        let mut ev = c.events().expect("events");
        match tokio::time::timeout(Duration::from_secs(30), ev.next()).await {
            Ok(Some(ClientEvent::Event(_))) => {}
            other => panic!("no first event: {other:?}"),
        }
        streams.push(ev);
    }
    settle().await;
    let rss_stalled_kb = server.rss_kb();
    drop(streams);
    for c in held.into_iter().chain(warm) {
        c.crash();
    }
    let _ = publisher.close(false).await;
    settle().await;
    settle().await;
    let rss_closed_kb = server.rss_kb();
    drop(server);
    let _ = std::fs::remove_dir_all(&data);
    Connections {
        clients,
        stalled,
        backlog,
        rss_warm_kb,
        rss_idle_kb,
        rss_published_kb,
        rss_stalled_kb,
        rss_closed_kb,
        client_rss_before_kb,
        client_rss_idle_kb,
        connect: connect_time,
    }
}
