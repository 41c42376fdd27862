//! Replay-latency benchmark (`make bench`; `make bench-quick` for a short run).
//!
//! Queues N events of B bytes for a durable client that is away, reconnects it, and measures
//! reconnect → status, ready → first event and ready → live, plus publish throughput. In the
//! same run it measures the machine's own limits on the same data: a RocksDB scan of the same
//! entries and a raw quinn stream transfer of the same bytes; the replay is reported against
//! the slower of the two (the pipeline's bottleneck). Settings: TETHER_BENCH_EVENTS (default
//! 1,000,000), TETHER_BENCH_VALUE_BYTES (default 128), TETHER_BENCH_ROUNDS (default 3: every
//! phase is measured that many times and the median reported).
//!
//! Live latency: a durable client that is live receives events published at a fixed rate
//! (TETHER_BENCH_LIVE_RATE events/s, default 10,000, for TETHER_BENCH_LIVE_SECS, default 5);
//! each value carries its publish time, and the end-to-end latency (publish request → commit →
//! delivery → the application) goes into an HDR histogram: p50/p99/p999, once on an idle node
//! and once while another durable client drains a backlog of all the events.
//! TETHER_BENCH_DRAIN_RATE=N paces the draining client's replay at N events/s (default: not
//! paced). TETHER_BENCH_SYNC sets the node's sync mode (default batch); TETHER_BENCH_DIRECT_IO (set:
//! on) its `direct-io` (the baseline store's too); TETHER_BENCH_SLOW_US=N prints
//! each live event slower than N µs, with its arrival time on the monotonic clock. Beside
//! them, the disk's own floor for a durable event: the latency of a 1 KiB append plus
//! `fdatasync` in the same directory, the node stopped (`baseline_fsync_p50_us`, `_p99_us`).
//!
//! Replays read events in batches, in place (`EventStream::next_batch`);
//! TETHER_BENCH_REPLAY_API=events takes them one by one as owned events (`EventStream::next`).
//!
//! Then the redundancy phase: a three-node cluster in this process, one durable queue with
//! redundancy 1, TETHER_BENCH_CLUSTER_EVENTS events (default a fifth of the events, 0 skips)
//! published through another node with `--ack local` and as many with `--ack replicated`, and
//! the replay of the queue from its primary, compared with the single-node replay.
//!
//! Then, each on fresh nodes (`matrix.rs`, `fanout.rs`, `idle.rs`):
//! - the workload matrix: one durable queue per backlog size (TETHER_BENCH_MATRIX_EVENTS,
//!   default 100000,1000000,10000000) and value size (TETHER_BENCH_MATRIX_BYTES, default
//!   128,1024): reconnect → status, ready → first event, ready → live, resident memory;
//! - publish throughput with fan-out to TETHER_BENCH_FANOUT durable queues (default 1,10,1000;
//!   TETHER_BENCH_FANOUT_EVENTS events, default 100,000, fewer beyond ten queues);
//! - publish throughput with TETHER_BENCH_REGEXES distinct interest regexes (default 1,000; 0
//!   skips) registered in the published region by ten durable queues, none matching (the cost
//!   of matching alone), for each form in TETHER_BENCH_REGEX_SHAPES (default prefix,contains),
//!   against the same queues with no regex (`regexes.rs`; TETHER_BENCH_REGEX_EVENTS events,
//!   default 20,000); then the same publishes again while a second publisher puts as many
//!   into a region of no interest: that one's rate beside the regexes against beside none;
//! - TETHER_BENCH_IDLE_QUEUES idle durable queues (default 100,000) on a server process of
//!   their own: resident memory per queue, live and recovered after kill -9;
//! - memory per connection (`connections.rs`): TETHER_BENCH_CONN_CLIENTS durable clients
//!   (default 1,000) connected and idle on a server process of their own, then
//!   TETHER_BENCH_CONN_STALLED of them (default 100) stalled with a backlog of
//!   TETHER_BENCH_CONN_BACKLOG events of 1 KiB each (default 16,000): the server's resident
//!   bytes per idle and per stalled connection, and the client side's per connection
//!   (TETHER_BENCH_CONN_WINDOW_BYTES sets the node's per-connection windows, here and for the
//!   headline replay, default the node's own).
//! - the command line (`cli.rs`): `tether subscribe` replaying TETHER_BENCH_CLI_EVENTS events
//!   (default: as many as the headline backlog) to /dev/null, and `tether get` end to end, on a
//!   server process of its own.
//!
//! The plots (replay time against backlog size, live latency CDF) go to TETHER_BENCH_OUT
//! (default `bench-out/`). A list setting of 0 skips its phase.

mod cli;
#[path = "../common/mod.rs"]
mod common;
mod connections;
mod fanout;
mod idle;
mod matrix;
mod plot;
mod progress;
mod regexes;

use common::rss_kb;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use tether::client::{Client, ClientBuilder, ClientEvent, Interest, StreamBatch};
use tether::config::ServerConfig;
use tether::protocol::{PublishAck, PublishOp, ResultPolicy};
use tether::server::Node;
use tether::storage::{Batch, Entry, RocksStore, Store};

/// The server is allocation-heavy on its hot paths (one record per event on the client side,
/// frames on the server side); mimalloc roughly halves allocator time there. With the
/// `tether` binary's settings (`main`).
#[cfg(not(feature = "system-alloc"))]
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// Publish operations per request.
const PUBLISH_BATCH_OPS: usize = 1000;
/// Concurrent publish requests in flight.
const PUBLISH_CONCURRENCY: usize = 4;
/// Interval of the resident-memory sampler during the replay, in milliseconds.
const RSS_SAMPLE_MS: u64 = 10;
/// Bytes per write in the raw quinn baseline.
const QUINN_CHUNK_BYTES: usize = 256 * 1024;

fn env_u64(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn value_of(size: usize, i: u64) -> Vec<u8> {
    let head = format!("{i:012}");
    (0..size)
        .map(|j| {
            head.as_bytes()
                .get(j)
                .copied()
                .unwrap_or(b'a' + (j % 26) as u8)
        })
        .collect()
}

struct Row {
    name: String,
    ms: f64,
    events_per_s: f64,
    mb_per_s: f64,
}

fn row(name: impl Into<String>, d: Duration, events: u64, bytes: u64) -> Row {
    let s = d.as_secs_f64().max(1e-9);
    Row {
        name: name.into(),
        ms: s * 1e3,
        events_per_s: events as f64 / s,
        mb_per_s: bytes as f64 / s / 1e6,
    }
}

fn main() {
    // The allocator as the `tether` binary sets it (before any thread starts), so the nodes
    // in this process run as a server process does.
    tether::heap::tune_process();
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("the benchmark's runtime")
        .block_on(run());
}

async fn run() {
    tether::transport::tls::install_crypto_provider();
    let n = env_u64("TETHER_BENCH_EVENTS", 1_000_000);
    let size = env_u64("TETHER_BENCH_VALUE_BYTES", 128) as usize;
    println!(
        "# tether replay benchmark: {n} events of {size} B, {} cores",
        std::thread::available_parallelism()
            .map(|p| p.get())
            .unwrap_or(1)
    );
    let direct_io = std::env::var_os("TETHER_BENCH_DIRECT_IO").is_some();
    if direct_io {
        println!("# direct-io on: flushes and compactions bypass the page cache");
    }
    let dir = tempfile::tempdir().unwrap();
    let mut config = ServerConfig::ephemeral(dir.path().join("node"));
    // The node's per-connection windows, when measuring their effect (default: the node's).
    let window = std::env::var("TETHER_BENCH_CONN_WINDOW_BYTES")
        .ok()
        .and_then(|v| v.parse::<u64>().ok());
    if let Some(w) = window {
        config.limits.connection_receive_window_bytes = w;
        config.limits.connection_send_window_bytes = w;
    }
    if let Ok(mode) = std::env::var("TETHER_BENCH_SYNC") {
        config.sync = mode
            .parse()
            .expect("TETHER_BENCH_SYNC: always, batch or none");
    }
    config.direct_io = direct_io;
    let node = Node::start(config).await.unwrap();
    let builder = ClientBuilder::new()
        .server(node.addr())
        .ca_file(node.ca_file());

    // One durable client per measured round registers, then goes away: each round replays a
    // queue of its own (with acks flowing, as in production).
    let rounds = env_u64("TETHER_BENCH_ROUNDS", 3).max(1);
    for round in 0..rounds {
        park_durable(builder.clone().durable(format!("bench-{round}"), 3600)).await;
    }
    // Drained while live latency is measured.
    park_durable(builder.clone().durable("bench-drain", 3600)).await;

    // Publish throughput (over the network, acknowledged after group commit).
    let publisher = Arc::new(builder.clone().connect().await.unwrap());
    mark_phase("publish", "start");
    let publish = publish_all(&publisher, 0..n, size, PublishAck::Local).await;
    mark_phase("publish", "end");
    assert!(
        node.queues().iter().all(|q| q.pending == n),
        "every event queued"
    );
    let fanout = rounds + 1;

    // Replay, one queue per round (the machine is noisy); medians are reported. The process's
    // resident memory (server and clients together) is sampled meanwhile.
    let sampler = RssSampler::start();
    let (mut statuses, mut firsts, mut lives) = (Vec::new(), Vec::new(), Vec::new());
    let mut bytes = 0u64;
    mark_phase("replay", "start");
    for round in 0..rounds {
        let r = replay(&builder, &format!("bench-{round}"), n).await;
        assert_eq!(r.count, n, "every event replayed");
        statuses.push(r.status);
        firsts.push(r.first);
        lives.push(r.live);
        bytes = r.bytes;
    }
    mark_phase("replay", "end");
    let (rss_before, rss_peak) = sampler.stop();
    // Live end-to-end latency at a fixed publish rate, idle and while a backlog drains.
    let live_secs = env_u64("TETHER_BENCH_LIVE_SECS", 5);
    let live_rate = env_u64("TETHER_BENCH_LIVE_RATE", 10_000);
    mark_phase("live-idle", "start");
    let idle_latency = live_latency(&builder, live_secs, live_rate, size, None).await;
    mark_phase("live-idle", "end");
    mark_phase("live-draining", "start");
    let draining = live_latency(&builder, live_secs, live_rate, size, Some(n)).await;
    mark_phase("live-draining", "end");
    node.shutdown().await;
    let status = median(&mut statuses);
    let first = median(&mut firsts);
    let live = median(&mut lives);
    // Baseline 0: the disk's own commit latency, the floor of a durable live event's.
    let fsync = fsync_latency(dir.path());

    // Baseline 1: RocksDB scan of the same entries (same record sizes), same read path.
    let record_len = {
        let rec = tether::protocol::EventRecord {
            id: tether::protocol::EventId {
                node: "n00000000".into(),
                session: 3,
                seq: 1,
            },
            region: "bench".into(),
            key: "key-1234".into(),
            op: tether::protocol::EventOp::Update,
            value: Some(value_of(size, 0)),
        };
        tether::transport::codec::encode_body_packed(&rec)
            .unwrap()
            .len()
    };
    // Tuned as the node is: the limit reads the bytes from where the node's replay finds them.
    let tuning = tether::storage::StoreTuning {
        direct_io_for_flush_and_compaction: direct_io,
    };
    let store = RocksStore::open_tuned(&dir.path().join("baseline"), tuning).unwrap();
    let body: Arc<[u8]> = vec![7u8; record_len].into();
    let mut batch = Batch::new();
    for i in 1..=n {
        batch.append(
            1,
            i,
            Entry {
                flags: 0,
                body: body.clone(),
            },
        );
        if batch.len() >= 10_000 {
            store.write(&batch, false).unwrap();
            batch = Batch::new();
        }
    }
    store.write(&batch, false).unwrap();
    store.flush().unwrap();
    let t = Instant::now();
    let mut from = 1;
    let mut scanned = 0u64;
    let mut scanned_bytes = 0u64;
    while from <= n {
        let mut last = from;
        store
            .read_entries(
                1,
                from,
                n,
                tether::limits::DELIVERY_FRAME_BODY_BYTES_MAX,
                &mut |o, _, b| {
                    scanned += 1;
                    scanned_bytes += b.len() as u64;
                    last = o;
                },
            )
            .unwrap();
        from = last + 1;
    }
    let scan = t.elapsed();
    assert_eq!(scanned, n);

    // Baseline 2: raw quinn transfer of the same bytes (records plus ~12 B framing each).
    let wire_bytes = n * (record_len as u64 + 12);
    let mut transfers = Vec::new();
    for _ in 0..rounds {
        transfers.push(quinn_transfer(dir.path(), wire_bytes).await);
    }
    let transfer = median(&mut transfers);

    // Redundancy 1: a three-node cluster in this process.
    let cn = env_u64("TETHER_BENCH_CLUSTER_EVENTS", n / 5);
    let cluster = if cn > 0 {
        Some(cluster_phase(dir.path(), cn, size).await)
    } else {
        None
    };

    // The workload matrix, fan-out and idle queues, each on fresh nodes.
    let matrix_events = env_list("TETHER_BENCH_MATRIX_EVENTS", "100000,1000000,10000000");
    let matrix_bytes = env_list("TETHER_BENCH_MATRIX_BYTES", "128,1024");
    let mut cells = Vec::new();
    for &bytes in &matrix_bytes {
        for &events in &matrix_events {
            cells.push(matrix::cell(dir.path(), events, bytes as usize).await);
        }
    }
    let fanout_events = env_u64("TETHER_BENCH_FANOUT_EVENTS", 100_000);
    let mut fanouts = Vec::new();
    for queues in env_list("TETHER_BENCH_FANOUT", "1,10,1000") {
        // Up to ten queues the same events; beyond, as many queue entries as ten queues take
        // (at least one publish request).
        let events = (fanout_events * 10 / queues.max(1))
            .clamp(PUBLISH_BATCH_OPS as u64, fanout_events.max(1));
        fanouts.push(fanout::run(dir.path(), queues, events, size).await);
    }
    let regex_count = env_u64("TETHER_BENCH_REGEXES", 1_000);
    let regex_events = env_u64("TETHER_BENCH_REGEX_EVENTS", 20_000).max(1);
    let mut regex_runs = Vec::new();
    if regex_count > 0 {
        let shapes =
            std::env::var("TETHER_BENCH_REGEX_SHAPES").unwrap_or_else(|_| "prefix,contains".into());
        let shapes: Vec<regexes::Shape> = shapes
            .split(',')
            .map(|s| {
                regexes::Shape::parse(s.trim())
                    .unwrap_or_else(|| panic!("TETHER_BENCH_REGEX_SHAPES: unknown form {s:?}"))
            })
            .collect();
        if let Some(&first) = shapes.first() {
            regex_runs.push(regexes::run(dir.path(), first, 0, regex_events, size).await);
        }
        for shape in shapes {
            regex_runs.push(regexes::run(dir.path(), shape, regex_count, regex_events, size).await);
        }
    }
    let conn_clients = env_u64("TETHER_BENCH_CONN_CLIENTS", 1_000) as usize;
    let conns = if conn_clients > 0 {
        let stalled = env_u64("TETHER_BENCH_CONN_STALLED", 100) as usize;
        let backlog = env_u64("TETHER_BENCH_CONN_BACKLOG", 16_000);
        Some(connections::run(dir.path(), conn_clients, stalled, backlog, window).await)
    } else {
        None
    };
    let cli_events = env_u64("TETHER_BENCH_CLI_EVENTS", n);
    let cli_figures = if cli_events > 0 {
        Some(cli::cli_phase(Path::new(env!("CARGO_BIN_EXE_tether")), cli_events, size).await)
    } else {
        None
    };
    let idle_queues = env_u64("TETHER_BENCH_IDLE_QUEUES", 100_000);
    let idle = if idle_queues > 0 {
        let warm = env_u64("TETHER_BENCH_IDLE_WARM", idle::WARM_QUEUES_DEFAULT).max(1);
        Some(idle::run(dir.path(), idle_queues, warm).await)
    } else {
        None
    };

    let rows = [
        row(
            format!("publish (fan-out to {fanout} queues)"),
            publish,
            n,
            n * size as u64,
        ),
        row("reconnect -> status", status, 0, 0),
        row("ready -> first event", first, 0, 0),
        row("ready -> live (replay)", live, n, bytes),
        row("baseline: rocksdb scan", scan, n, scanned_bytes),
        row("baseline: quinn transfer", transfer, n, wire_bytes),
    ];
    let cluster_rows: Vec<Row> = cluster
        .iter()
        .flat_map(|c| {
            [
                row("r1: publish --ack local", c.publish_local, c.events, 0),
                row(
                    "r1: publish --ack replicated",
                    c.publish_replicated,
                    c.events,
                    0,
                ),
                row("r1: reconnect -> status", c.status, 0, 0),
                row("r1: ready -> live (replay)", c.replay, 2 * c.events, 0),
            ]
        })
        .collect();
    println!(
        "{:<34} {:>10} {:>14} {:>10}",
        "phase", "ms", "events/s", "MB/s"
    );
    for r in rows.iter().chain(&cluster_rows) {
        println!(
            "{:<34} {:>10.2} {:>14.0} {:>10.1}",
            r.name, r.ms, r.events_per_s, r.mb_per_s
        );
    }
    println!();
    println!(
        "{:<34} {:>10} {:>10} {:>10} {:>10} {:>10}",
        "live latency (us)", "events", "p50", "p99", "p999", "max"
    );
    for (name, h) in [
        ("idle node", &idle_latency),
        ("while a backlog drains", &draining),
    ] {
        println!(
            "{:<34} {:>10} {:>10} {:>10} {:>10} {:>10}",
            name,
            h.len(),
            h.value_at_quantile(0.5),
            h.value_at_quantile(0.99),
            h.value_at_quantile(0.999),
            h.max()
        );
    }
    println!("# live events published at {live_rate}/s for {live_secs} s per measurement");
    if !cells.is_empty() {
        println!();
        println!(
            "{:<22} {:>10} {:>11} {:>11} {:>12} {:>12} {:>11} {:>11}",
            "backlog (one queue)",
            "fill ev/s",
            "status ms",
            "first ms",
            "live ms",
            "replay ev/s",
            "rss MB",
            "peak MB"
        );
        for c in &cells {
            println!(
                "{:<22} {:>10.0} {:>11.2} {:>11.2} {:>12.1} {:>12.0} {:>11.0} {:>11.0}",
                format!("{} x {} B", c.label(), c.value_bytes),
                c.events as f64 / c.fill.as_secs_f64(),
                c.status.as_secs_f64() * 1e3,
                c.first.as_secs_f64() * 1e3,
                c.live.as_secs_f64() * 1e3,
                c.events_per_s(),
                c.rss_before_kb as f64 / 1024.0,
                c.rss_peak_kb as f64 / 1024.0,
            );
        }
        println!("# rss: the whole process (node and client) before the replay, and its peak");
    }
    if !regex_runs.is_empty() {
        println!();
        println!(
            "{:<30} {:>10} {:>14} {:>14}",
            "publish with interest regexes", "events", "events/s", "register ms"
        );
        for r in &regex_runs {
            println!(
                "{:<30} {:>10} {:>14.0} {:>14.0}",
                format!("{} regexes ({})", r.regexes, r.shape.label()),
                r.events,
                r.events_per_s(),
                r.register.as_secs_f64() * 1e3
            );
        }
    }
    if !fanouts.is_empty() {
        println!();
        println!(
            "{:<22} {:>10} {:>14} {:>16}",
            "publish fan-out", "events", "events/s", "queue entries/s"
        );
        for f in &fanouts {
            println!(
                "{:<22} {:>10} {:>14.0} {:>16.0}",
                format!("{} durable queues", f.queues),
                f.events,
                f.events_per_s(),
                f.entries_per_s()
            );
        }
    }
    if let Some(i) = &idle {
        println!();
        println!(
            "idle durable queues: {} created in {:.1} s; server RSS {:.0} MB empty, {:.0} MB \
             restarted with {} queues, {:.0} MB after {} more, {:.0} MB with {} more: {:.0} B \
             per queue; restarted (kill -9) in {:.2} s: {:.0} MB, {:.0} B per recovered queue; \
             restarted again: {:.0} MB, {:.0} B per queue",
            i.queues,
            i.create.as_secs_f64(),
            i.rss_empty_kb as f64 / 1024.0,
            i.rss_recovered_warm_kb as f64 / 1024.0,
            i.warm,
            i.rss_live_warm_kb as f64 / 1024.0,
            i.warm,
            i.rss_live_full_kb as f64 / 1024.0,
            i.queues,
            i.bytes_per_queue(),
            i.restart.as_secs_f64(),
            i.rss_recovered_full_kb as f64 / 1024.0,
            i.recovered_bytes_per_queue(),
            i.rss_recovered_again_kb as f64 / 1024.0,
            i.recovered_again_bytes_per_queue(),
        );
    }
    let plots = write_plots(
        &cells,
        &[
            ("idle node", &idle_latency),
            ("while a backlog drains", &draining),
        ],
    );
    let limit = scan.max(transfer);
    let replay_rate = n as f64 / live.as_secs_f64();
    println!("replay_events_per_s={replay_rate:.0}");
    if n == 1_000_000 && size == 128 {
        println!("replay_1m_128b_events_per_s={replay_rate:.0}");
    }
    println!("live_p50_us={}", idle_latency.value_at_quantile(0.5));
    println!("live_p99_us={}", idle_latency.value_at_quantile(0.99));
    println!("live_p999_us={}", idle_latency.value_at_quantile(0.999));
    println!("live_draining_p99_us={}", draining.value_at_quantile(0.99));
    println!("baseline_fsync_p50_us={}", fsync.value_at_quantile(0.5));
    println!("baseline_fsync_p99_us={}", fsync.value_at_quantile(0.99));
    println!(
        "publish_events_per_s={:.0}",
        n as f64 / publish.as_secs_f64()
    );
    println!("status_ms={:.3}", status.as_secs_f64() * 1e3);
    println!("first_event_ms={:.3}", first.as_secs_f64() * 1e3);
    println!("ready_to_live_ms={:.1}", live.as_secs_f64() * 1e3);
    println!("baseline_scan_ms={:.1}", scan.as_secs_f64() * 1e3);
    println!("baseline_quinn_ms={:.1}", transfer.as_secs_f64() * 1e3);
    println!(
        "replay_vs_scan_ratio={:.2}",
        live.as_secs_f64() / scan.as_secs_f64()
    );
    println!(
        "replay_vs_quinn_ratio={:.2}",
        live.as_secs_f64() / transfer.as_secs_f64()
    );
    // The strict limit: the slower of the two stages, as if they ran on cores of their own.
    println!(
        "replay_vs_limit_ratio={:.2}",
        live.as_secs_f64() / limit.as_secs_f64()
    );
    // On this machine the stages share its cores: reading and sending the same bytes once.
    println!(
        "replay_vs_scan_plus_transfer_ratio={:.2}",
        live.as_secs_f64() / (scan + transfer).as_secs_f64()
    );
    println!("rss_before_replay_mb={:.0}", rss_before as f64 / 1024.0);
    println!("replay_peak_rss_mb={:.0}", rss_peak as f64 / 1024.0);
    match &cluster {
        Some(c) => {
            let r1 = 2.0 * c.events as f64 / c.replay.as_secs_f64();
            println!("replay_r1_events_per_s={r1:.0}");
            println!("replay_r1_vs_r0_ratio={:.2}", r1 / replay_rate);
            let local = c.events as f64 / c.publish_local.as_secs_f64();
            let replicated = c.events as f64 / c.publish_replicated.as_secs_f64();
            println!("publish_r1_local_events_per_s={local:.0}");
            println!("publish_r1_replicated_events_per_s={replicated:.0}");
            println!(
                "publish_replicated_vs_local_ratio={:.2}",
                replicated / local
            );
        }
        None => println!("# redundancy phase skipped (TETHER_BENCH_CLUSTER_EVENTS=0)"),
    }
    for c in &cells {
        let name = format!("{}_{}b", c.label(), c.value_bytes);
        println!("matrix_{name}_replay_events_per_s={:.0}", c.events_per_s());
        println!(
            "matrix_{name}_status_ms={:.3}",
            c.status.as_secs_f64() * 1e3
        );
        println!(
            "matrix_{name}_first_event_ms={:.3}",
            c.first.as_secs_f64() * 1e3
        );
        println!(
            "matrix_{name}_replay_rss_growth_mb={:.0}",
            c.rss_peak_kb.saturating_sub(c.rss_before_kb) as f64 / 1024.0
        );
        if c.value_bytes == 128 {
            println!(
                "status_ms_{}_pending={:.3}",
                c.label(),
                c.status.as_secs_f64() * 1e3
            );
        }
    }
    if let Some(worst) = cells.iter().map(|c| c.first).max() {
        println!(
            "first_event_ms_max_over_backlogs={:.3}",
            worst.as_secs_f64() * 1e3
        );
    }
    // Memory flat in the backlog size: the replay's resident-memory growth at the largest
    // backlog against the smallest, per value size.
    for &bytes in &matrix_bytes {
        let of: Vec<&matrix::Cell> = cells
            .iter()
            .filter(|c| c.value_bytes == bytes as usize)
            .collect();
        if let (Some(lo), Some(hi)) = (of.first(), of.last())
            && of.len() > 1
        {
            let growth = |c: &matrix::Cell| c.rss_peak_kb.saturating_sub(c.rss_before_kb).max(1024);
            println!(
                "replay_rss_growth_{}_vs_{}_{bytes}b_ratio={:.2}",
                hi.label(),
                lo.label(),
                growth(hi) as f64 / growth(lo) as f64
            );
        }
    }
    if let Some((none, rest)) = regex_runs.split_first() {
        println!(
            "publish_regexes_none_events_per_s={:.0}",
            none.events_per_s()
        );
        for r in rest {
            println!(
                "publish_regexes_{}_{}_events_per_s={:.0}",
                r.regexes,
                r.shape.label(),
                r.events_per_s()
            );
            println!(
                "publish_regexes_{}_{}_vs_none={:.3}",
                r.regexes,
                r.shape.label(),
                r.events_per_s() / none.events_per_s()
            );
            println!(
                "regex_register_{}_{}_ms={:.0}",
                r.regexes,
                r.shape.label(),
                r.register.as_secs_f64() * 1e3
            );
            println!(
                "publish_beside_regexes_{}_{}_vs_none={:.3}",
                r.regexes,
                r.shape.label(),
                r.beside_events_per_s() / none.beside_events_per_s()
            );
        }
    }
    for f in &fanouts {
        println!(
            "publish_fanout_{}_events_per_s={:.0}",
            f.queues,
            f.events_per_s()
        );
        println!(
            "publish_fanout_{}_queue_entries_per_s={:.0}",
            f.queues,
            f.entries_per_s()
        );
    }
    if let Some(i) = &idle {
        println!("idle_queues={}", i.queues);
        println!("idle_queue_bytes={:.0}", i.bytes_per_queue());
        println!(
            "idle_queue_recovered_bytes={:.0}",
            i.recovered_bytes_per_queue()
        );
        println!(
            "idle_queue_restarted_again_bytes={:.0}",
            i.recovered_again_bytes_per_queue()
        );
        println!(
            "idle_queues_restart_ms={:.0}",
            i.restart.as_secs_f64() * 1e3
        );
    }
    if let Some(c) = &cli_figures {
        c.print_lines();
    }
    if let Some(c) = &conns {
        println!("connected_clients={}", c.clients);
        println!(
            "connect_ms_per_client={:.2}",
            c.connect.as_secs_f64() * 1e3 / c.clients.max(1) as f64
        );
        println!(
            "server_bytes_per_idle_connection={:.0}",
            c.idle_bytes_per_client()
        );
        println!(
            "server_bytes_per_stalled_connection={:.0} (stalled={} backlog={} x 1 KiB, windows {})",
            c.stalled_bytes_per_client(),
            c.stalled,
            c.backlog,
            std::env::var("TETHER_BENCH_CONN_WINDOW_BYTES").unwrap_or_else(|_| "default".into())
        );
        println!(
            "server_rss_mb warm={:.1} idle={:.1} published={:.1} stalled={:.1} closed={:.1}",
            c.rss_warm_kb as f64 / 1024.0,
            c.rss_idle_kb as f64 / 1024.0,
            c.rss_published_kb as f64 / 1024.0,
            c.rss_stalled_kb as f64 / 1024.0,
            c.rss_closed_kb as f64 / 1024.0
        );
        println!(
            "client_side_bytes_per_connection={:.0}",
            c.client_side_bytes_per_client()
        );
    }
    for (name, path) in plots {
        println!("plot_{name}={}", path.display());
    }
}

/// A comma-separated list of numbers from the environment ("" or "0" for none).
fn env_list(name: &str, default: &str) -> Vec<u64> {
    std::env::var(name)
        .unwrap_or_else(|_| default.to_string())
        .split(',')
        .filter_map(|v| v.trim().replace('_', "").parse().ok())
        .filter(|&v| v > 0)
        .collect()
}

/// Writes the plots into TETHER_BENCH_OUT (default `bench-out`): replay time against backlog
/// size (from the matrix) and the live latency CDF. Returns (name, path) of each one written.
fn write_plots(
    cells: &[matrix::Cell],
    latencies: &[(&str, &hdrhistogram::Histogram<u64>)],
) -> Vec<(&'static str, std::path::PathBuf)> {
    let out = std::path::PathBuf::from(
        std::env::var("TETHER_BENCH_OUT").unwrap_or_else(|_| "bench-out".into()),
    );
    if let Err(e) = std::fs::create_dir_all(&out) {
        println!("# plots skipped: cannot create {}: {e}", out.display());
        return Vec::new();
    }
    let mut written = Vec::new();
    let mut sizes: Vec<usize> = cells.iter().map(|c| c.value_bytes).collect();
    sizes.dedup();
    let series: Vec<plot::Series> = sizes
        .iter()
        .map(|&b| plot::Series {
            label: format!("{b} B values"),
            points: cells
                .iter()
                .filter(|c| c.value_bytes == b)
                .map(|c| (c.events as f64, c.live.as_secs_f64()))
                .collect(),
        })
        .collect();
    if !series.is_empty() {
        let path = out.join("replay-vs-backlog.svg");
        match plot::replay_vs_backlog(&path, &series) {
            Ok(()) => written.push(("replay_vs_backlog", path)),
            Err(e) => println!("# plot {} failed: {e}", path.display()),
        }
    }
    let series: Vec<plot::Series> = latencies
        .iter()
        .filter(|(_, h)| !h.is_empty())
        .map(|(name, h)| plot::Series {
            label: name.to_string(),
            points: plot::cdf_points(h),
        })
        .collect();
    if !series.is_empty() {
        let path = out.join("live-latency-cdf.svg");
        match plot::latency_cdf(&path, &series) {
            Ok(()) => written.push(("live_latency_cdf", path)),
            Err(e) => println!("# plot {} failed: {e}", path.display()),
        }
    }
    written
}

/// Publishes puts `range` (requests of [`PUBLISH_BATCH_OPS`], [`PUBLISH_CONCURRENCY`] in
/// flight) and returns the time until the last acknowledgement.
async fn publish_all(
    publisher: &Arc<Client>,
    range: std::ops::Range<u64>,
    size: usize,
    ack: PublishAck,
) -> Duration {
    publish_all_in("bench", publisher, range, size, ack).await
}

/// [`publish_all`] into `region`.
async fn publish_all_in(
    region: &str,
    publisher: &Arc<Client>,
    range: std::ops::Range<u64>,
    size: usize,
    ack: PublishAck,
) -> Duration {
    let t = Instant::now();
    let mut next = range.start;
    let mut inflight = tokio::task::JoinSet::new();
    while next < range.end || !inflight.is_empty() {
        while next < range.end && inflight.len() < PUBLISH_CONCURRENCY {
            let end = (next + PUBLISH_BATCH_OPS as u64).min(range.end);
            let ops = bench_puts_in(region, next..end, size);
            let p = publisher.clone();
            inflight.spawn(async move { p.publish_with(ops, ack).await.unwrap() });
            next = end;
        }
        inflight.join_next().await.unwrap().unwrap();
    }
    t.elapsed()
}

/// Puts of events `range` (values of `size` B) into the bench region, over 10,000 keys.
fn bench_puts(range: std::ops::Range<u64>, size: usize) -> Vec<PublishOp> {
    bench_puts_in("bench", range, size)
}

/// [`bench_puts`] into `region`.
fn bench_puts_in(region: &str, range: std::ops::Range<u64>, size: usize) -> Vec<PublishOp> {
    range
        .map(|i| PublishOp::Put {
            region: region.into(),
            key: format!("key-{}", i % 10_000),
            value: value_of(size, i),
        })
        .collect()
}

/// Live end-to-end latency in microseconds: a live durable client receives `rate` events/s of
/// `size` B for `secs` s, each stamped with its publish time. With `drain = Some(n)`, the
/// parked queue "bench-drain" (n events pending) is replayed by another client meanwhile.
async fn live_latency(
    builder: &ClientBuilder,
    secs: u64,
    rate: u64,
    size: usize,
    drain: Option<u64>,
) -> hdrhistogram::Histogram<u64> {
    /// Publishes per second (each carries rate / LIVE_TICKS_PER_S events).
    const LIVE_TICKS_PER_S: u64 = 1_000;
    let id = if drain.is_some() { "live-2" } else { "live-1" };
    let c = builder.clone().durable(id, 3600).connect().await.unwrap();
    c.region("live")
        .register(Interest::all_keys().policy(ResultPolicy::None))
        .await
        .unwrap();
    let mut events = c.events().unwrap();
    c.ready_for_events().await.unwrap();
    assert!(matches!(
        events.next().await,
        Some(ClientEvent::Live { .. })
    ));
    // The draining client stands for another application: by default it runs on a runtime
    // of its own (its own threads, as another process would), so that its decoding does not
    // queue on this runtime's workers ahead of the live client's; TETHER_BENCH_DRAIN_RUNTIME=
    // shared runs it on this one (the setting of the runs before 2026-12-04).
    let own_runtime = std::env::var("TETHER_BENCH_DRAIN_RUNTIME").as_deref() != Ok("shared");
    // TETHER_BENCH_DRAIN_RATE=N: the draining client asks for its replay at N events/s.
    let drain_rate = env_u64("TETHER_BENCH_DRAIN_RATE", 0);
    let drainer = drain.map(|n| {
        let b = builder.clone().replay_rate(drain_rate);
        let drain = async move {
            let r = replay(&b, "bench-drain", n).await;
            assert_eq!(r.count, n, "the backlog drained");
        };
        if own_runtime {
            let thread = std::thread::spawn(move || {
                tokio::runtime::Builder::new_multi_thread()
                    .worker_threads(2)
                    .enable_all()
                    .build()
                    .expect("the draining client's runtime")
                    .block_on(drain)
            });
            tokio::task::spawn_blocking(move || thread.join().expect("the drain ran"))
        } else {
            tokio::spawn(drain)
        }
    });
    let phase = if drain.is_some() {
        "live-draining"
    } else {
        "live-idle"
    };
    // Where the publishing starts (the marks of `main` also cover the setup before it).
    mark_phase(phase, "publishing");
    let origin = Instant::now();
    let per_tick = (rate / LIVE_TICKS_PER_S).max(1);
    let ticks = secs * LIVE_TICKS_PER_S;
    let publisher = Arc::new(builder.clone().connect().await.unwrap());
    let publishing = tokio::spawn(async move {
        let mut interval =
            tokio::time::interval(Duration::from_micros(1_000_000 / LIVE_TICKS_PER_S));
        interval.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut sent = tokio::task::JoinSet::new();
        for t in 0..ticks {
            interval.tick().await;
            let ops: Vec<PublishOp> = (0..per_tick)
                .map(|i| {
                    let mut value = (origin.elapsed().as_nanos() as u64).to_be_bytes().to_vec();
                    value.resize(size.max(8), b'v');
                    PublishOp::Put {
                        region: "live".into(),
                        key: format!("k-{}", (t * per_tick + i) % 1_000),
                        value,
                    }
                })
                .collect();
            let p = publisher.clone();
            sent.spawn(async move { p.publish(ops).await.unwrap() });
        }
        sent.join_all().await;
        ticks * per_tick
    });
    let mut hist = hdrhistogram::Histogram::<u64>::new(3).unwrap();
    // Events slower than this go to stderr with the time they arrived, to be matched with
    // the phase marks and a profile's samples.
    let slow_us = std::env::var("TETHER_BENCH_SLOW_US")
        .ok()
        .and_then(|v| v.parse::<u64>().ok());
    let mut got = 0u64;
    let expect = ticks * per_tick;
    while got < expect {
        match events.next().await.expect("stream open") {
            ClientEvent::Event(e) => {
                let v = e.value.expect("values");
                let stamp = u64::from_be_bytes(v[..8].try_into().unwrap());
                let now = origin.elapsed().as_nanos() as u64;
                hist.record(now.saturating_sub(stamp) / 1_000).unwrap();
                let micros = now.saturating_sub(stamp) / 1_000;
                if slow_us.is_some_and(|limit| micros > limit) {
                    eprintln!("# slow {phase} {micros} {}", monotonic_now());
                }
                got += 1;
            }
            ClientEvent::Live { .. } => {}
            other => panic!("a session's stream yielded {other:?}"),
        }
    }
    assert_eq!(publishing.await.unwrap(), expect);
    events.commit();
    c.close(false).await.unwrap();
    if let Some(d) = drainer {
        d.await.unwrap();
    }
    hist
}

/// Appends made durable one at a time for the fsync baseline.
const FSYNC_BASELINE_WRITES: usize = 2_000;
/// Bytes of each of those appends (a small group commit's write).
const FSYNC_BASELINE_WRITE_BYTES: usize = 1_024;

/// Latency of appending to a file in `dir` and syncing its data (`fdatasync`), in
/// microseconds: what the write-ahead log's commit costs on this disk at least, with
/// nothing else running (a live event under `sync = batch` waits for one or two of them).
fn fsync_latency(dir: &Path) -> hdrhistogram::Histogram<u64> {
    use std::io::Write;
    let path = dir.join("fsync-baseline");
    let mut file = std::fs::File::create(&path).unwrap();
    let block = vec![b'f'; FSYNC_BASELINE_WRITE_BYTES];
    let mut hist = hdrhistogram::Histogram::<u64>::new(3).unwrap();
    for _ in 0..FSYNC_BASELINE_WRITES {
        let t = Instant::now();
        file.write_all(&block).unwrap();
        file.sync_data().unwrap();
        hist.record(t.elapsed().as_micros() as u64).unwrap();
    }
    drop(file);
    let _ = std::fs::remove_file(path);
    hist
}

/// Connects a durable client with all-keys interest in the bench region, then leaves it away.
async fn park_durable(builder: ClientBuilder) {
    let c = builder.connect().await.unwrap();
    c.region("bench")
        .register(Interest::all_keys().policy(ResultPolicy::None))
        .await
        .unwrap();
    c.ready_for_events().await.unwrap();
    c.close(true).await.unwrap();
}

/// One replay of a durable queue.
struct Replay {
    /// Reconnect → the welcome with the queue's status and pending count.
    status: Duration,
    /// Ready → the first event.
    first: Duration,
    /// Ready → the live marker after the last replayed event.
    live: Duration,
    /// Events replayed.
    count: u64,
    /// Bytes of values replayed.
    bytes: u64,
}

/// Whether replays take owned events one by one (`EventStream::next`, with
/// TETHER_BENCH_REPLAY_API=events) instead of the default: batches read in place
/// (`EventStream::next_batch`), as an application that wants the replay's speed does.
fn replay_api_events() -> bool {
    std::env::var("TETHER_BENCH_REPLAY_API").as_deref() == Ok("events")
}

/// Events between two updates of the replay's progress bar.
const REPLAY_PROGRESS_EVENTS: u64 = 16_384;

/// Reconnects durable client `id` to `builder`'s server, expecting `expect` pending events,
/// replays its queue with acks flowing, and closes it for good.
async fn replay(builder: &ClientBuilder, id: &str, expect: u64) -> Replay {
    let t = Instant::now();
    let c = builder.clone().durable(id, 3600).connect().await.unwrap();
    let status = t.elapsed();
    assert_eq!(c.pending(), Some(expect));
    let bar = progress::bar(expect, &format!("replay {id}"));
    let mut events = c.events().unwrap();
    let t = Instant::now();
    c.ready_for_events().await.unwrap();
    let (mut first, mut count, mut bytes) = (None, 0u64, 0u64);
    if replay_api_events() {
        while let ClientEvent::Event(e) = events.next().await.expect("stream open") {
            if first.is_none() {
                first = Some(t.elapsed());
            }
            count += 1;
            bytes += e.value.as_ref().map_or(0, |v| v.len() as u64);
            if count.is_multiple_of(REPLAY_PROGRESS_EVENTS) {
                bar.set_position(count);
            }
        }
    } else {
        let mut shown = 0u64;
        while let StreamBatch::Events(batch) = events.next_batch().await.expect("stream open") {
            if first.is_none() {
                first = Some(t.elapsed());
            }
            for e in batch.iter() {
                count += 1;
                bytes += e.value.map_or(0, |v| v.len() as u64);
            }
            if count - shown >= REPLAY_PROGRESS_EVENTS {
                bar.set_position(count);
                shown = count;
            }
        }
    }
    let live = t.elapsed();
    bar.finish_and_clear();
    events.commit();
    c.close(true).await.unwrap();
    Replay {
        status,
        first: first.unwrap_or(live),
        live,
        count,
        bytes,
    }
}

/// Samples the process's resident memory every [`RSS_SAMPLE_MS`] on a thread of its own (so
/// a busy runtime does not skip samples) until stopped.
struct RssSampler {
    before_kb: u64,
    peak_kb: Arc<AtomicU64>,
    stop: Arc<AtomicBool>,
    thread: std::thread::JoinHandle<()>,
}

impl RssSampler {
    fn start() -> RssSampler {
        let before_kb = rss_kb();
        let peak_kb = Arc::new(AtomicU64::new(before_kb));
        let stop = Arc::new(AtomicBool::new(false));
        let (peak, done) = (peak_kb.clone(), stop.clone());
        let thread = std::thread::spawn(move || {
            while !done.load(Ordering::Relaxed) {
                peak.fetch_max(rss_kb(), Ordering::Relaxed);
                std::thread::sleep(Duration::from_millis(RSS_SAMPLE_MS));
            }
        });
        RssSampler {
            before_kb,
            peak_kb,
            stop,
            thread,
        }
    }

    /// (resident KiB at the start, peak resident KiB).
    fn stop(self) -> (u64, u64) {
        self.stop.store(true, Ordering::Relaxed);
        self.thread.join().unwrap();
        let peak = self.peak_kb.load(Ordering::Relaxed).max(rss_kb());
        (self.before_kb, peak)
    }
}

/// Figures of the redundancy phase.
struct ClusterFigures {
    events: u64,
    publish_local: Duration,
    publish_replicated: Duration,
    status: Duration,
    replay: Duration,
}

/// Three in-process nodes sharing a dev CA on loopback; a durable queue with redundancy 1 on
/// node 0; events published through node 1 with each acknowledgement mode; then the replay.
async fn cluster_phase(dir: &Path, n: u64, size: usize) -> ClusterFigures {
    use tether::transport::tls;
    let dirs: Vec<std::path::PathBuf> = (0..3).map(|i| dir.join(format!("c{i}"))).collect();
    let first = tls::ensure_dev_certs(&dirs[0].join("tls")).unwrap();
    for d in &dirs[1..] {
        let t = d.join("tls");
        std::fs::create_dir_all(&t).unwrap();
        std::fs::copy(&first.ca, t.join(tls::CA_CERT_FILE)).unwrap();
        std::fs::copy(
            first.ca.with_file_name(tls::CA_KEY_FILE),
            t.join(tls::CA_KEY_FILE),
        )
        .unwrap();
    }
    let socks: Vec<std::net::UdpSocket> = (0..3)
        .map(|_| std::net::UdpSocket::bind("127.0.0.1:0").unwrap())
        .collect();
    let ports: Vec<u16> = socks
        .iter()
        .map(|s| s.local_addr().unwrap().port())
        .collect();
    drop(socks);
    let peers: Vec<(String, String)> = (0..3)
        .map(|i| (format!("n{}", i + 1), format!("127.0.0.1:{}", ports[i])))
        .collect();
    let mut nodes = Vec::new();
    for i in 0..3 {
        let mut c = ServerConfig::ephemeral(&dirs[i]);
        c.listen = format!("127.0.0.1:{}", ports[i]).parse().unwrap();
        c.node_id = Some(format!("n{}", i + 1));
        c.peers = peers.clone();
        nodes.push(Node::start(c).await.unwrap());
    }
    let to = |i: usize| {
        ClientBuilder::new()
            .server(nodes[i].addr())
            .ca_file(nodes[i].ca_file())
    };
    park_durable(to(0).durable("bench-r1", 3600).redundancy(1)).await;
    let publisher = Arc::new(to(1).connect().await.unwrap());
    let publish_local = publish_all(&publisher, 0..n, size, PublishAck::Local).await;
    // The replicated phase starts from a cluster that has caught up: the local publishes'
    // forwarding (which goes on after their answers) is not charged to it. How long that
    // takes is a figure of its own.
    let t = Instant::now();
    while !nodes[0].queues().iter().any(|q| {
        q.pending == n && q.copies.iter().all(|c| c.lag_entries == 0) && !q.copies.is_empty()
    }) {
        assert!(
            t.elapsed() < Duration::from_secs(600),
            "the local publishes did not reach the queue and its copy"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    println!("cluster_local_catchup_ms={}", t.elapsed().as_millis());
    mark_phase("publish-replicated", "start");
    let publish_replicated = publish_all(&publisher, n..2 * n, size, PublishAck::Replicated).await;
    mark_phase("publish-replicated", "end");
    // Every event forwarded, queued and copied before the replay.
    let deadline = Instant::now() + Duration::from_secs(600);
    while !nodes[0].queues().iter().any(|q| {
        q.pending == 2 * n && q.copies.iter().all(|c| c.lag_entries == 0) && !q.copies.is_empty()
    }) {
        assert!(
            Instant::now() < deadline,
            "the queue and its copy did not fill up"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let r = replay(&to(0), "bench-r1", 2 * n).await;
    assert_eq!(r.count, 2 * n, "every event replayed");
    drop(publisher);
    for node in nodes {
        node.shutdown().await;
    }
    ClusterFigures {
        events: n,
        publish_local,
        publish_replicated,
        status: r.status,
        replay: r.live,
    }
}

/// With `TETHER_BENCH_MARK_PHASES` set, a phase's start or end goes to stderr as
/// `# phase NAME start|end SECONDS` on the monotonic clock (`scripts/profile.sh` cuts perf's
/// samples, recorded on the same clock, by these lines).
fn mark_phase(name: &str, edge: &str) {
    if std::env::var_os("TETHER_BENCH_MARK_PHASES").is_none() {
        return;
    }
    eprintln!("# phase {name} {edge} {}", monotonic_now());
}

/// The monotonic clock (perf's) as `SECONDS.MICROS`.
fn monotonic_now() -> String {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes the timespec it is given, which lives on this stack.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    format!("{}.{:06}", ts.tv_sec, ts.tv_nsec / 1_000)
}

fn median(v: &mut [Duration]) -> Duration {
    v.sort();
    v[v.len() / 2]
}

/// Sends `total` bytes over one unidirectional QUIC stream on loopback, with Tether's TLS and
/// transport settings, and returns the time until the receiver has read them all.
async fn quinn_transfer(dir: &std::path::Path, total: u64) -> Duration {
    use tether::transport::{endpoint, tls};
    let files = tls::ensure_dev_certs(&dir.join("quinn-tls")).unwrap();
    let server = endpoint::server_endpoint(
        "127.0.0.1:0".parse().unwrap(),
        tls::server_config(&files).unwrap(),
    )
    .unwrap();
    let addr = server.local_addr().unwrap();
    let client = endpoint::client_endpoint(tls::client_config(&files.ca).unwrap(), addr).unwrap();
    let sender = tokio::spawn(async move {
        let conn = server.accept().await.unwrap().await.unwrap();
        let mut send = conn.open_uni().await.unwrap();
        let chunk = bytes::Bytes::from(vec![1u8; QUINN_CHUNK_BYTES]);
        let mut left = total;
        while left > 0 {
            let k = left.min(QUINN_CHUNK_BYTES as u64) as usize;
            send.write_chunk(chunk.slice(..k)).await.unwrap();
            left -= k as u64;
        }
        send.finish().unwrap();
        conn.closed().await;
    });
    let conn = client
        .connect(addr, tls::SERVER_NAME)
        .unwrap()
        .await
        .unwrap();
    let t = Instant::now();
    let mut recv = conn.accept_uni().await.unwrap();
    let mut got = 0u64;
    while let Some(c) = recv.read_chunk(usize::MAX, true).await.unwrap() {
        got += c.bytes.len() as u64;
    }
    let d = t.elapsed();
    assert_eq!(got, total);
    conn.close(0u32.into(), b"done");
    let _ = sender.await;
    d
}
