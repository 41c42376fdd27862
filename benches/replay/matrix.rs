//! The workload matrix: for each backlog size and value size, a fresh node holds one durable
//! queue of that many events; its client reconnects (reconnect → status, several times, the
//! median kept), then replays it (ready → first event, ready → live) while the process's
//! resident memory is sampled. The backlog is filled through the embedded publisher (the
//! host-process path, no network): filling is not what is measured here.

use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tether::client::ClientBuilder;
use tether::config::ServerConfig;
use tether::server::Node;

use crate::{RssSampler, bench_puts, median, park_durable, replay};

/// Operations per embedded publish while filling.
const FILL_BATCH_OPS: u64 = 1000;
/// Embedded publishes in flight while filling.
const FILL_CONCURRENCY: usize = 4;
/// Reconnects per cell for reconnect → status (the median is kept).
const STATUS_PROBES: usize = 5;

/// One cell's figures.
pub struct Cell {
    pub events: u64,
    pub value_bytes: usize,
    pub fill: Duration,
    pub status: Duration,
    pub first: Duration,
    pub live: Duration,
    pub rss_before_kb: u64,
    pub rss_peak_kb: u64,
}

impl Cell {
    pub fn events_per_s(&self) -> f64 {
        self.events as f64 / self.live.as_secs_f64()
    }

    /// "100k", "1m", "10m".
    pub fn label(&self) -> String {
        label(self.events)
    }
}

pub fn label(n: u64) -> String {
    match n {
        n if n >= 1_000_000 && n.is_multiple_of(1_000_000) => format!("{}m", n / 1_000_000),
        n if n >= 1_000 && n.is_multiple_of(1_000) => format!("{}k", n / 1_000),
        n => n.to_string(),
    }
}

/// Runs one cell in `dir` (removed afterwards).
pub async fn cell(dir: &Path, events: u64, value_bytes: usize) -> Cell {
    let data = dir.join(format!("matrix-{events}-{value_bytes}"));
    let node = Node::start(ServerConfig::ephemeral(&data)).await.unwrap();
    let builder = ClientBuilder::new()
        .server(node.addr())
        .ca_file(node.ca_file());
    park_durable(builder.clone().durable("matrix", 3600)).await;

    let bar = crate::progress::bar(events, &format!("fill {} x {value_bytes} B", label(events)));
    let publisher = Arc::new(node.publisher().await.unwrap());
    let t = Instant::now();
    let mut next = 0u64;
    let mut inflight = tokio::task::JoinSet::new();
    while next < events || !inflight.is_empty() {
        while next < events && inflight.len() < FILL_CONCURRENCY {
            let end = (next + FILL_BATCH_OPS).min(events);
            let ops = bench_puts(next..end, value_bytes);
            let p = publisher.clone();
            inflight.spawn(async move { p.publish(&ops).await.unwrap() });
            next = end;
        }
        let done = inflight.join_next().await.unwrap().unwrap();
        bar.inc(done);
    }
    let fill = t.elapsed();
    bar.finish_and_clear();
    drop(publisher);
    assert!(
        node.queues().iter().all(|q| q.pending == events),
        "every event queued"
    );

    let mut statuses = Vec::new();
    for _ in 0..STATUS_PROBES {
        let t = Instant::now();
        let c = builder
            .clone()
            .durable("matrix", 3600)
            .connect()
            .await
            .unwrap();
        statuses.push(t.elapsed());
        assert_eq!(c.pending(), Some(events), "the welcome counts the backlog");
        c.close(true).await.unwrap();
    }

    let sampler = RssSampler::start();
    let r = replay(&builder, "matrix", events).await;
    let (rss_before_kb, rss_peak_kb) = sampler.stop();
    assert_eq!(r.count, events, "every event replayed");
    node.shutdown().await;
    let _ = std::fs::remove_dir_all(&data);
    Cell {
        events,
        value_bytes,
        fill,
        status: median(&mut statuses),
        first: r.first,
        live: r.live,
        rss_before_kb,
        rss_peak_kb,
    }
}
