//! The command line's own speed, on a `tether server` process of its own: `tether subscribe`
//! replaying a durable queue of `events` events of `value_bytes` B to /dev/null (the JSON lines
//! written as fast as the subscriber can), and the end-to-end time of `tether get` (process
//! start, connect, the request, the close, exit), the median of [`GET_RUNS`] runs.

use std::path::Path;
use std::process::Stdio;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tether::protocol::{PublishAck, QueueStatus};

use crate::common::server::ServerProcess;
use crate::{median, park_durable, publish_all};

/// Timed runs of `tether get` (after one untimed run: the binary and its libraries in the page
/// cache).
pub const GET_RUNS: usize = 20;
/// The durable id of the replayed queue.
const DURABLE_ID: &str = "cli-bench";

pub struct CliFigures {
    /// `tether subscribe --exit-on-live`, from the process's start to its exit.
    pub subscribe: Duration,
    pub subscribe_events_per_s: f64,
    /// Median of the `tether get` runs, start to exit, in milliseconds.
    pub get_ms_median: f64,
    pub get_ms_min: f64,
    pub get_ms_max: f64,
}

impl CliFigures {
    pub fn print_lines(&self) {
        println!(
            "cli_subscribe_events_per_s={:.0}",
            self.subscribe_events_per_s
        );
        println!("cli_subscribe_ms={:.1}", self.subscribe.as_secs_f64() * 1e3);
        println!("cli_get_ms={:.2}", self.get_ms_median);
        println!("cli_get_ms_min={:.2}", self.get_ms_min);
        println!("cli_get_ms_max={:.2}", self.get_ms_max);
    }
}

/// Runs `bin` (the `tether` binary) with `args` against `server`, standard output to
/// /dev/null; the time from spawn to exit. Panics unless it exits 0.
async fn timed(bin: &Path, server: &ServerProcess, args: &[&str]) -> Duration {
    let addr = server.addr.to_string();
    let t = Instant::now();
    let status = tokio::process::Command::new(bin)
        .args(args)
        .arg("--server")
        .arg(&addr)
        .arg("--ca")
        .arg(&server.ca)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::inherit())
        .status()
        .await
        .expect("spawn tether");
    let elapsed = t.elapsed();
    assert!(status.success(), "tether {args:?}: {status}");
    elapsed
}

pub async fn cli_phase(bin: &Path, events: u64, value_bytes: usize) -> CliFigures {
    let dir = tempfile::tempdir().expect("temporary directory");
    let server = ServerProcess::start(&dir.path().join("cli"), &[]);
    // The durable queue (all keys of the bench region), away; then its backlog.
    park_durable(server.builder.clone().durable(DURABLE_ID, 3600)).await;
    let publisher = Arc::new(server.builder.clone().connect().await.unwrap());
    publish_all(&publisher, 0..events, value_bytes, PublishAck::Local).await;
    // A key `tether get` reads.
    let key = "key-0";
    Arc::into_inner(publisher)
        .expect("the publisher's tasks are done")
        .close(false)
        .await
        .unwrap();

    let subscribe = timed(
        bin,
        &server,
        &[
            "subscribe",
            "--region",
            "bench",
            "--durable-id",
            DURABLE_ID,
            "--exit-on-live",
        ],
    )
    .await;
    // Everything was replayed and acknowledged.
    let c = server
        .builder
        .clone()
        .durable(DURABLE_ID, 3600)
        .connect()
        .await
        .unwrap();
    assert_eq!(c.queue_status(), QueueStatus::Resumed);
    assert_eq!(c.pending(), Some(0), "the subscriber acked every event");
    c.close(true).await.unwrap();

    let get = ["get", "--region", "bench", "--key", key];
    timed(bin, &server, &get).await;
    let mut runs = Vec::with_capacity(GET_RUNS);
    for _ in 0..GET_RUNS {
        runs.push(timed(bin, &server, &get).await);
    }
    server.stop();
    let ms = |d: Duration| d.as_secs_f64() * 1e3;
    // Sorts the runs too.
    let get_ms_median = ms(median(&mut runs));
    CliFigures {
        subscribe,
        subscribe_events_per_s: events as f64 / subscribe.as_secs_f64(),
        get_ms_median,
        get_ms_min: ms(runs[0]),
        get_ms_max: ms(runs[GET_RUNS - 1]),
    }
}
