//! Memory of idle durable queues: a `tether server` process of its own (so the figure is the
//! server's alone, not the clients'), `queues` durable clients that register all-keys interest
//! and go away; the server's resident memory before and after, per queue (the slope past a
//! warm-up, so the server's fixed memory and its connection machinery are left out). Then the
//! server is killed (-9) and started again on its data: the memory of the same queues
//! recovered from disk (the slope between a restart with the warm-up queues and one with all),
//! and one of them resumes.

use std::path::Path;
use std::time::{Duration, Instant};

use tether::client::ClientBuilder;
use tether::protocol::QueueStatus;

use crate::common::server::ServerProcess;
use crate::park_durable;

/// Durable clients connecting at once while the queues are created.
const CREATE_CONCURRENCY: usize = 32;
/// Default of the queues created before each baseline is taken (allocator pools, connection
/// machinery warm): TETHER_BENCH_IDLE_WARM.
pub const WARM_QUEUES_DEFAULT: u64 = 1_000;
/// Wait for closed connections to be freed before memory is read, in milliseconds.
const SETTLE_MS: u64 = 1_000;

pub struct Idle {
    pub queues: u64,
    /// Queues created before each baseline.
    pub warm: u64,
    pub create: Duration,
    /// A fresh server with no queue.
    pub rss_empty_kb: u64,
    /// Restarted with `warm` queues recovered from disk.
    pub rss_recovered_warm_kb: u64,
    /// That server after `warm` more queues were created through it.
    pub rss_live_warm_kb: u64,
    /// After `queues` more.
    pub rss_live_full_kb: u64,
    pub restart: Duration,
    /// Restarted with all of them recovered from disk.
    pub rss_recovered_full_kb: u64,
    /// Restarted once more (the write-ahead log replayed at the first restart is flushed: this
    /// start reads only table files).
    pub rss_recovered_again_kb: u64,
}

impl Idle {
    /// Resident bytes each idle queue adds to the server that created them (the slope between
    /// the warm server and the full one).
    pub fn bytes_per_queue(&self) -> f64 {
        (self.rss_live_full_kb.saturating_sub(self.rss_live_warm_kb)) as f64 * 1024.0
            / self.queues as f64
    }
    /// Resident bytes each idle queue adds to a server that recovered them from disk (between
    /// the restart with the warm-up queues and the restart with all).
    pub fn recovered_bytes_per_queue(&self) -> f64 {
        (self
            .rss_recovered_full_kb
            .saturating_sub(self.rss_recovered_warm_kb)) as f64
            * 1024.0
            / (self.queues + self.warm) as f64
    }
    /// The same after the second restart.
    pub fn recovered_again_bytes_per_queue(&self) -> f64 {
        (self
            .rss_recovered_again_kb
            .saturating_sub(self.rss_recovered_warm_kb)) as f64
            * 1024.0
            / (self.queues + self.warm) as f64
    }
}

/// A server process of its own for these queues. Memory does not depend on the sync mode;
/// creating the queues is faster without fsync.
fn start_server(data: &Path) -> ServerProcess {
    ServerProcess::start(data, &["--sync", "none"])
}

async fn create(builder: &ClientBuilder, range: std::ops::Range<u64>, what: &str) -> Duration {
    let bar = crate::progress::bar(range.end - range.start, what);
    let t = Instant::now();
    let mut creating = tokio::task::JoinSet::new();
    for q in range {
        if creating.len() >= CREATE_CONCURRENCY {
            creating.join_next().await.unwrap().unwrap();
            bar.inc(1);
        }
        creating.spawn(park_durable(
            builder.clone().durable(format!("idle-{q}"), 3600),
        ));
    }
    while creating.join_next().await.is_some() {
        bar.inc(1);
    }
    bar.finish_and_clear();
    t.elapsed()
}

async fn settle() {
    tokio::time::sleep(Duration::from_millis(SETTLE_MS)).await;
}

pub async fn run(dir: &Path, queues: u64, warm: u64) -> Idle {
    let data = dir.join("idle");
    let server = start_server(&data);
    settle().await;
    let rss_empty_kb = server.rss_kb();
    create(&server.builder, 0..warm, "idle queues (warm-up)").await;
    drop(server); // kill -9
    let server = start_server(&data);
    settle().await;
    let rss_recovered_warm_kb = server.rss_kb();
    let warm_end = 2 * warm;
    create(&server.builder, warm..warm_end, "idle queues (warm-up)").await;
    settle().await;
    let rss_live_warm_kb = server.rss_kb();
    let create_time = create(
        &server.builder,
        warm_end..warm_end + queues,
        "idle durable queues",
    )
    .await;
    settle().await;
    let rss_live_full_kb = server.rss_kb();
    drop(server);

    let t = Instant::now();
    let server = start_server(&data);
    let restart = t.elapsed();
    settle().await;
    let rss_recovered_full_kb = server.rss_kb();
    drop(server);
    let server = start_server(&data);
    settle().await;
    let rss_recovered_again_kb = server.rss_kb();
    let c = server
        .builder
        .clone()
        .durable(format!("idle-{}", warm_end + queues / 2), 3600)
        .connect()
        .await
        .unwrap();
    assert_eq!(c.queue_status(), QueueStatus::Resumed, "the queue survived");
    assert_eq!(c.pending(), Some(0));
    c.close(true).await.unwrap();
    drop(server);
    let _ = std::fs::remove_dir_all(&data);
    Idle {
        queues,
        warm,
        create: create_time,
        rss_empty_kb,
        rss_recovered_warm_kb,
        rss_live_warm_kb,
        rss_live_full_kb,
        restart,
        rss_recovered_full_kb,
        rss_recovered_again_kb,
    }
}
