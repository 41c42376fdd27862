//! Soak run (`make soak`, `make soak-cluster`): many durable clients coming and going against
//! `tether server` processes while publishers run the whole time, with an end-to-end delivery
//! check and the servers' memory over time.
//!
//! The nodes are separate processes (RocksDB in a temp dir, QUIC+TLS on loopback), so their
//! resident memory is theirs alone; every client lives in this process. With
//! `TETHER_SOAK_NODES` > 1 they form a cluster and every durable queue has a copy (redundancy
//! 1); `TETHER_SOAK_NODE_KILLS` kills that many nodes with SIGKILL during the soak, spread over
//! it, one at a time, each started again on its data after a few seconds (clients and
//! publishers fail over as applications do).
//!
//! Publishers put events at a steady, bounded rate over a key space for the whole run; each
//! event's value carries its sequence number, so the run knows which key every event id went to.
//! Durable clients with a key, key-list, regex or all-keys interest connect, consume (acking),
//! close with keepalive or crash, stay away (their queues filling), and come back, as a seeded
//! RNG decides (the seed is printed; `TETHER_SOAK_SEED` replays a run). At most
//! `TETHER_SOAK_CONNECTED_MAX` clients are connected at once.
//!
//! At the end publishers stop, every client comes back and drains to its live marker (a final
//! session that fails before taking events, e.g. refused while its queue is being promoted,
//! connects again, up to `FINAL_ATTEMPTS_MAX` times: `final_session_retries`,
//! `final_sessions_failed`; the queues still holding entries are then printed), and the
//! run checks, per durable client: every event it must receive (key matches its interest,
//! published after its registration was acknowledged) was received at least once (`lost=0`);
//! an event received again always carried `possible_duplicate` (`unflagged_duplicates=0`); the
//! pending count at resume equals the replayed events then delivered; no event outside its
//! interest or (one node) from before its registration; offsets without gaps; flags consistent
//! with the live marker. Memory: each server's resident memory after the warm-up, at the end,
//! its peak, and its slope over the second half of the soak (`server_rss_*`); this process's
//! (`harness_rss_*`). Figures and verdict lines go to stdout; the process exits non-zero on a
//! failed check.
//!
//! Settings (environment): TETHER_SOAK_SECS (300), TETHER_SOAK_CLIENTS (1000),
//! TETHER_SOAK_CONNECTED_MAX (150), TETHER_SOAK_RATE (events/s, 2000), TETHER_SOAK_PUBLISHERS
//! (2), TETHER_SOAK_BATCH (ops per publish request, 50), TETHER_SOAK_VALUE_BYTES (64),
//! TETHER_SOAK_NODES (1), TETHER_SOAK_NODE_KILLS (0), TETHER_SOAK_SYNC (batch),
//! TETHER_SOAK_CONFIG (a TOML file for every node, none), TETHER_SOAK_SEED (random),
//! TETHER_SOAK_KILL_ORDER (the killed nodes in order, e.g. `3,3,1,2`; random by default).

mod common;

use common::rss_kb;
use common::server::{Nodes, primary_queues};
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tether::client::{
    Client, ClientBuilder, ClientError, ClientEvent, DedupState, Event, Interest,
};
use tether::protocol::{ErrorCode, PublishOp, QueueStatus, ResultPolicy};

#[cfg(not(feature = "system-alloc"))]
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

const REGION: &str = "soak";
/// Keys `k0000` .. `k9999`.
const KEYS: u64 = 10_000;
/// Presented by every durable client: nothing may expire during a run.
const DURABLE_TIMEOUT_SECS: u64 = 24 * 3600;
/// Upper bound for one client step (connect, register, ready, close, one event wait).
const STEP: Duration = Duration::from_secs(20);
/// Connection failure timeout of the clients when nodes may die: a dead node is noticed within
/// this.
const CLIENT_FAILURE_TIMEOUT: Duration = Duration::from_secs(3);
/// How long a killed node stays down before it starts again.
const NODE_DOWN: Duration = Duration::from_secs(5);
/// Upper bound for a cluster's forwarding to drain before the final phase.
const FORWARDING_DRAIN: Duration = Duration::from_secs(300);
/// Upper bound for a final drain to the live marker.
const FINAL_DRAIN: Duration = Duration::from_secs(120);
/// Upper bound for sessions to wind down once the soak phase is over.
const WIND_DOWN: Duration = Duration::from_secs(90);
/// How often RSS is sampled.
const RSS_EVERY: Duration = Duration::from_secs(2);
/// Progress line interval.
const PROGRESS_EVERY: Duration = Duration::from_secs(30);
/// Session starts per scheduler tick (20 ms): bounds the connect rate.
const STARTS_PER_TICK: usize = 2;
/// Receipt record: sequence number in the low 31 bits, possible_duplicate in the top bit.
const DUP_BIT: u32 = 1 << 31;

/// One event received: `seq | DUP_BIT`, the queue offset it came at and the session.
#[derive(Clone, Copy)]
struct Receipt {
    seq_dup: u32,
    offset: u32,
    session: u16,
}

/// When the run started (the examples give times relative to it).
static RUN_START: std::sync::OnceLock<Instant> = std::sync::OnceLock::new();

fn run_secs() -> f32 {
    RUN_START.get().map_or(0.0, |t| t.elapsed().as_secs_f32())
}
/// Anomaly examples kept for the report.
const EXAMPLES_MAX: usize = 20;
/// Final sessions of one client that may fail before taking events (a connect refused with
/// `unavailable` while its queue is being promoted, a timeout): like an application, the run
/// connects again, after `FINAL_RETRY_PAUSE`.
const FINAL_ATTEMPTS_MAX: u32 = 5;
const FINAL_RETRY_PAUSE: Duration = Duration::from_secs(2);

fn env_u64(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// xorshift64.
#[derive(Clone)]
struct Rng(u64);

impl Rng {
    fn new(seed: u64) -> Rng {
        Rng(splitmix(seed) | 1)
    }
    fn next(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        self.0 = x;
        x
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }
    fn between(&mut self, lo: u64, hi: u64) -> u64 {
        lo + self.below(hi - lo + 1)
    }
    fn chance(&mut self, percent: u64) -> bool {
        self.below(100) < percent
    }
}

fn splitmix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// The key event `seq` is published to.
fn key_of(seq: u64) -> String {
    format!("k{:04}", splitmix(seq ^ 0x5eed) % KEYS)
}

fn value_of(seq: u64, size: usize) -> Vec<u8> {
    let mut v = format!("{seq:010}").into_bytes();
    v.resize(size.max(10), b'x');
    v
}

fn seq_of(e: &Event) -> Option<u64> {
    let v = e.value.as_ref()?;
    std::str::from_utf8(v.get(..10)?).ok()?.parse().ok()
}

fn mb(kb: u64) -> f64 {
    kb as f64 / 1024.0
}

// ---------------------------------------------------------------------------------------------
// Interests

#[derive(Clone, Debug)]
enum Spec {
    All,
    Key(String),
    Keys(Vec<String>),
    Regex(String),
}

impl Spec {
    fn random(rng: &mut Rng, i: usize, clients: usize) -> Spec {
        // A few all-keys clients (their queues get every event), then a mix that keeps the
        // fan-out bounded: about 12 queue entries per published event at 1,000 clients.
        let all_keys = (clients / 400).max(1);
        if i.is_multiple_of((clients / all_keys).max(1)) {
            return Spec::All;
        }
        let d = |rng: &mut Rng| rng.below(10);
        match rng.below(100) {
            0..=4 => Spec::Regex(format!("k{}.*", d(rng))), // 10 % of keys
            5..=19 => Spec::Regex(format!("k{}{}[0-9]{{2}}", d(rng), d(rng))), // 1 %
            20..=34 => Spec::Regex(format!("k[0-9]{{2}}{}{}", d(rng), d(rng))), // 1 %
            35..=49 => Spec::Regex(format!(
                "k({}{}|{}{})[0-9]5",
                d(rng),
                d(rng),
                d(rng),
                d(rng)
            )), // 0.2 %
            50..=74 => Spec::Key(format!("k{:04}", rng.below(KEYS))),
            _ => Spec::Keys((0..5).map(|_| format!("k{:04}", rng.below(KEYS))).collect()),
        }
    }

    fn interest(&self) -> Interest {
        let i = match self {
            Spec::All => Interest::all_keys(),
            Spec::Key(k) => Interest::key(k.clone()),
            Spec::Keys(ks) => Interest::keys(ks.clone()),
            Spec::Regex(r) => Interest::regex(r.clone()),
        };
        i.policy(ResultPolicy::None)
    }

    fn kind(&self) -> &'static str {
        match self {
            Spec::All => "all",
            Spec::Key(_) => "key",
            Spec::Keys(_) => "keys",
            Spec::Regex(_) => "regex",
        }
    }

    /// Which of the key space this interest wants (checked independently of the server's
    /// matcher: the regex crate with whole-key anchoring).
    fn matcher(&self) -> Vec<bool> {
        let keys = (0..KEYS).map(|i| format!("k{i:04}"));
        match self {
            Spec::All => vec![true; KEYS as usize],
            Spec::Key(k) => keys.map(|x| &x == k).collect(),
            Spec::Keys(ks) => keys.map(|x| ks.contains(&x)).collect(),
            Spec::Regex(r) => {
                let re = regex::Regex::new(&format!("^(?:{r})$")).expect("soak regex");
                keys.map(|x| re.is_match(&x)).collect()
            }
        }
    }
}

fn key_index(key: &str) -> Option<usize> {
    let n: usize = key.strip_prefix('k')?.parse().ok()?;
    (n < KEYS as usize).then_some(n)
}

// ---------------------------------------------------------------------------------------------
// Publishers

/// Sequence numbers handed out and the publish requests in flight, under one lock so that a
/// registration can take a consistent snapshot.
struct PubState {
    next_seq: u64,
    inflight: Vec<Option<(u64, u64)>>,
}

struct Pubs {
    state: Mutex<PubState>,
    /// Ranges whose publish failed (not expected anywhere).
    failed: Mutex<Vec<(u64, u64)>>,
    published: AtomicU64,
    errors: AtomicU64,
    requests: AtomicU64,
    stop: AtomicBool,
}

/// What a registration saw of the publishers: events below `lo` that were not in flight had
/// been acknowledged before the register request went out (must never arrive); events at or
/// above `hi` were sent after the registration was acknowledged (must arrive if they match);
/// the rest may or may not arrive.
#[derive(Clone, Debug)]
struct RegWindow {
    lo: u64,
    inflight: Vec<(u64, u64)>,
    hi: u64,
}

impl RegWindow {
    fn forbidden(&self, seq: u64) -> bool {
        seq < self.lo && !self.inflight.iter().any(|&(a, b)| seq >= a && seq < b)
    }
}

impl Pubs {
    fn snapshot(&self) -> (u64, Vec<(u64, u64)>) {
        let s = self.state.lock().unwrap();
        (s.next_seq, s.inflight.iter().flatten().copied().collect())
    }
    fn next_seq(&self) -> u64 {
        self.state.lock().unwrap().next_seq
    }
}

/// Connects a publisher, retrying while its nodes are down (a node kill).
async fn connect_publisher(p: usize, builder: &ClientBuilder, pubs: &Pubs) -> Option<Client> {
    while !pubs.stop.load(Ordering::Acquire) {
        match tokio::time::timeout(STEP, builder.clone().connect()).await {
            Ok(Ok(c)) => return Some(c),
            other => {
                let why = match other {
                    Ok(Err(e)) => e.to_string(),
                    _ => "timed out".into(),
                };
                eprintln!("publisher {p}: connect failed: {why}");
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        }
    }
    None
}

async fn publisher(
    p: usize,
    builder: ClientBuilder,
    pubs: Arc<Pubs>,
    every: Duration,
    batch: u64,
    size: usize,
) {
    let mut tick = tokio::time::interval(every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let Some(mut client) = connect_publisher(p, &builder, &pubs).await else {
        return;
    };
    while !pubs.stop.load(Ordering::Acquire) {
        tick.tick().await;
        let (a, b) = {
            let mut s = pubs.state.lock().unwrap();
            let a = s.next_seq;
            s.next_seq += batch;
            s.inflight[p] = Some((a, a + batch));
            (a, a + batch)
        };
        let ops: Vec<PublishOp> = (a..b)
            .map(|seq| PublishOp::Put {
                region: REGION.into(),
                key: key_of(seq),
                value: value_of(seq, size),
            })
            .collect();
        pubs.requests.fetch_add(1, Ordering::Relaxed);
        let ok = match tokio::time::timeout(STEP, client.publish(ops)).await {
            Ok(Ok(n)) if n == batch => true,
            Ok(Ok(n)) => {
                eprintln!("publisher {p}: published {n} of {batch}");
                false
            }
            Ok(Err(e)) => {
                eprintln!("publisher {p}: publish failed: {e}");
                false
            }
            Err(_) => {
                eprintln!("publisher {p}: publish timed out");
                false
            }
        };
        if ok {
            pubs.published.fetch_add(batch, Ordering::Relaxed);
        } else {
            // Possibly applied, possibly not: not expected anywhere.
            pubs.errors.fetch_add(1, Ordering::Relaxed);
            pubs.failed.lock().unwrap().push((a, b));
        }
        pubs.state.lock().unwrap().inflight[p] = None;
        if !ok {
            // Its node may be gone (a node kill): publish through another one.
            client.crash();
            match connect_publisher(p, &builder, &pubs).await {
                Some(c) => client = c,
                None => return,
            }
        }
    }
    let _ = tokio::time::timeout(STEP, client.close(false)).await;
}

// ---------------------------------------------------------------------------------------------
// Durable clients

struct Cl {
    idx: usize,
    id: String,
    spec: Spec,
    matcher: Vec<bool>,
    reg: Option<RegWindow>,
    /// Every receipt, in arrival order.
    received: Vec<Receipt>,
    /// Per session that connected (by `sessions - 1`): the node that served it and when it
    /// connected (seconds into the run), for the examples of an unflagged duplicate.
    session_log: Vec<(String, f32)>,
    /// Highest queue offset received so far, and the session (1-based) that received it.
    max_offset: u64,
    max_offset_session: u64,
    sessions: u64,
    ever_connected: bool,
    away_until: Instant,
    /// The latest session got as far as taking events (connect, register and ready worked).
    reached_stream: bool,
}

impl Cl {
    /// The node that served session `session` (1-based) and when it connected; empty if unknown.
    fn served(&self, session: u64) -> (String, f32) {
        self.session_log
            .get((session as usize).wrapping_sub(1))
            .cloned()
            .unwrap_or_default()
    }
}

#[derive(Default)]
struct Stats {
    connects: AtomicU64,
    resumes: AtomicU64,
    closes: AtomicU64,
    crashes: AtomicU64,
    crashes_mid_replay: AtomicU64,
    connect_errors: AtomicU64,
    refused_duplicate_id: AtomicU64,
    step_errors: AtomicU64,
    stream_ended: AtomicU64,
    delivered: AtomicU64,
    redelivered: AtomicU64,
    replayed: AtomicU64,
    lives: AtomicU64,
    // Anomalies.
    queue_lost: AtomicU64,
    wrong_key: AtomicU64,
    outside_interest: AtomicU64,
    before_registration: AtomicU64,
    /// Cluster: events acknowledged on another node before the registration that still
    /// reached the queue (forwarding between nodes is asynchronous: the publish had not been
    /// applied on the queue's node yet). Reported, not a failure.
    forwarded_before_registration: AtomicU64,
    /// Several nodes: see `forwarded_before_registration`.
    clustered: bool,
    no_registration: AtomicU64,
    undecodable: AtomicU64,
    offset_gaps: AtomicU64,
    offset_unflagged_redelivery: AtomicU64,
    flag_violations: AtomicU64,
    pending_mismatch: AtomicU64,
    replay_end_mismatch: AtomicU64,
    final_not_live: AtomicU64,
    status_ms: Mutex<Vec<f64>>,
    final_status_ms: Mutex<Vec<f64>>,
    examples: Mutex<Vec<String>>,
}

impl Stats {
    /// Keeps the first [`EXAMPLES_MAX`] examples of each kind (the message after the client
    /// id, without its numbers), so the frequent kinds do not crowd out a rare one.
    fn example(&self, s: String) {
        fn kind(s: &str) -> String {
            let text = s.split_once(": ").map_or(s, |(_, t)| t);
            text.chars().filter(|c| !c.is_ascii_digit()).collect()
        }
        let k = kind(&s);
        let mut e = self.examples.lock().unwrap();
        if e.iter().filter(|x| kind(x) == k).count() < EXAMPLES_MAX {
            e.push(s);
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq)]
enum End {
    Close,
    Crash,
}

#[derive(Clone, Copy)]
struct Plan {
    consume_for: Duration,
    end: End,
    /// Crash right after taking this many events (mid-replay when a backlog waits).
    crash_after: Option<u64>,
    /// Final phase: drain to the live marker, exact pending check, close.
    last: bool,
}

fn inc(a: &AtomicU64) {
    a.fetch_add(1, Ordering::Relaxed);
}

/// One session of one durable client. Returns the client's state (always, whatever happened).
async fn session(
    mut cl: Cl,
    builder: ClientBuilder,
    pubs: Arc<Pubs>,
    stats: Arc<Stats>,
    plan: Plan,
    stop: Arc<AtomicBool>,
) -> Cl {
    cl.sessions += 1;
    cl.reached_stream = false;
    let t0 = Instant::now();
    let client = match tokio::time::timeout(
        STEP,
        // A fresh duplicate-suppression state per session: the run sees every delivery as the
        // server flags it (a cloned builder would otherwise share one state across clients).
        builder
            .dedup_state(DedupState::default())
            .durable(cl.id.clone(), DURABLE_TIMEOUT_SECS)
            .connect(),
    )
    .await
    {
        Ok(Ok(c)) => c,
        Ok(Err(ClientError::Server(e))) if e.code == ErrorCode::DuplicateDurableId => {
            inc(&stats.refused_duplicate_id);
            stats.example(format!(
                "{}: refused duplicate-durable-id: {}",
                cl.id, e.message
            ));
            return cl;
        }
        Ok(Err(e)) => {
            inc(&stats.connect_errors);
            stats.example(format!("{}: connect failed: {e}", cl.id));
            return cl;
        }
        Err(_) => {
            inc(&stats.connect_errors);
            stats.example(format!("{}: connect timed out", cl.id));
            return cl;
        }
    };
    let status_ms = t0.elapsed().as_secs_f64() * 1e3;
    inc(&stats.connects);
    cl.session_log
        .resize(cl.sessions as usize, (String::new(), 0.0));
    cl.session_log[cl.sessions as usize - 1] = (client.node_id().to_string(), run_secs());
    let status = client.queue_status();
    match status {
        QueueStatus::Resumed => {
            inc(&stats.resumes);
            if plan.last {
                stats.final_status_ms.lock().unwrap().push(status_ms);
            } else {
                stats.status_ms.lock().unwrap().push(status_ms);
            }
        }
        QueueStatus::New if !cl.ever_connected => {}
        other => {
            inc(&stats.queue_lost);
            stats.example(format!(
                "{}: queue status {other:?} on session {} (registered: {})",
                cl.id,
                cl.sessions,
                cl.reg.is_some()
            ));
        }
    }
    cl.ever_connected = true;
    let pending = client.pending().unwrap_or(0);

    if cl.reg.is_none() {
        let (lo, inflight) = pubs.snapshot();
        match tokio::time::timeout(STEP, client.region(REGION).register(cl.spec.interest())).await {
            Ok(Ok(_)) => {
                cl.reg = Some(RegWindow {
                    lo,
                    inflight,
                    hi: pubs.next_seq(),
                });
            }
            other => {
                inc(&stats.step_errors);
                stats.example(format!("{}: register failed: {other:?}", cl.id));
                client.crash();
                return cl;
            }
        }
    }

    let mut events = client.events().expect("stream once");
    let replay_end = match tokio::time::timeout(STEP, client.ready_for_events()).await {
        Ok(Ok(r)) => r,
        other => {
            inc(&stats.step_errors);
            stats.example(format!("{}: ready failed: {other:?}", cl.id));
            client.crash();
            return cl;
        }
    };

    cl.reached_stream = true;
    let start = Instant::now();
    let deadline = start
        + if plan.last {
            FINAL_DRAIN
        } else {
            plan.consume_for
        };
    let mut live = false;
    let mut replayed = 0u64;
    let mut last_replayed_offset = 0u64;
    let mut prev_offset: Option<u64> = None;
    let mut ended = false;
    let mut taken = 0u64;
    let mut crash_now = false;
    loop {
        if plan.last && live {
            break;
        }
        if plan.crash_after.is_some_and(|k| taken >= k) {
            crash_now = true;
            break;
        }
        let now = Instant::now();
        if now >= deadline || (!plan.last && stop.load(Ordering::Relaxed)) {
            break;
        }
        // Short waits so the stop flag is seen; STEP bounds a silent connection only through
        // the session deadline (live sessions may legitimately see no event for a while).
        let wait = (deadline - now).min(Duration::from_millis(250));
        let ev = match tokio::time::timeout(wait, events.next()).await {
            Err(_) => continue,
            Ok(None) => {
                ended = true;
                inc(&stats.stream_ended);
                stats.example(format!(
                    "{}: event stream ended unexpectedly (session {}, live {live})",
                    cl.id, cl.sessions
                ));
                break;
            }
            Ok(Some(ev)) => ev,
        };
        match ev {
            other @ (ClientEvent::Disconnected { .. } | ClientEvent::Reconnected { .. }) => {
                panic!("a session's stream yielded {other:?}")
            }
            ClientEvent::Live { regions } => {
                if live || !regions.iter().any(|r| r == REGION) {
                    inc(&stats.flag_violations);
                    stats.example(format!("{}: unexpected live marker {regions:?}", cl.id));
                }
                live = true;
                inc(&stats.lives);
                // Everything queued at the welcome (pending) plus what arrived before ready
                // was replayed; with publishers stopped the two are equal.
                let ok = if plan.last {
                    replayed == pending
                } else {
                    replayed >= pending
                };
                if !ok {
                    inc(&stats.pending_mismatch);
                    stats.example(format!(
                        "{}: pending {pending} at resume, {replayed} replayed before live (final: {})",
                        cl.id, plan.last
                    ));
                }
                if replayed > 0 && last_replayed_offset != replay_end {
                    inc(&stats.replay_end_mismatch);
                    stats.example(format!(
                        "{}: replay ended at offset {last_replayed_offset}, ready said {replay_end}",
                        cl.id
                    ));
                }
            }
            ClientEvent::Event(e) => {
                taken += 1;
                inc(&stats.delivered);
                if e.possible_duplicate {
                    inc(&stats.redelivered);
                }
                if e.replayed {
                    inc(&stats.replayed);
                    replayed += 1;
                    last_replayed_offset = e.offset;
                }
                if e.replayed == live {
                    inc(&stats.flag_violations);
                    stats.example(format!(
                        "{}: offset {} replayed={} but live marker seen={live}",
                        cl.id, e.offset, e.replayed
                    ));
                }
                // Offsets: contiguous within a session, no gap after what was seen before,
                // anything seen before flagged.
                match prev_offset {
                    Some(p) if e.offset != p + 1 => {
                        inc(&stats.offset_gaps);
                        stats.example(format!(
                            "{}: offset {} after {p} in one session",
                            cl.id, e.offset
                        ));
                    }
                    None if e.offset > cl.max_offset + 1 => {
                        inc(&stats.offset_gaps);
                        stats.example(format!(
                            "{}: session starts at offset {}, highest seen before {}",
                            cl.id, e.offset, cl.max_offset
                        ));
                    }
                    _ => {}
                }
                if e.offset <= cl.max_offset && !e.possible_duplicate {
                    inc(&stats.offset_unflagged_redelivery);
                    let served = |session: u64| {
                        let (node, at) = cl.served(session);
                        format!("session {session} ({node}, connected at {at:.0} s)")
                    };
                    stats.example(format!(
                        "{}: offset {} again without possible_duplicate in {}; highest seen {} in {}",
                        cl.id,
                        e.offset,
                        served(cl.sessions),
                        cl.max_offset,
                        served(cl.max_offset_session)
                    ));
                }
                prev_offset = Some(e.offset);
                if e.offset > cl.max_offset {
                    cl.max_offset = e.offset;
                    cl.max_offset_session = cl.sessions;
                }
                let Some(seq) = seq_of(&e) else {
                    inc(&stats.undecodable);
                    stats.example(format!(
                        "{}: undecodable value at offset {}",
                        cl.id, e.offset
                    ));
                    continue;
                };
                if e.key != key_of(seq) {
                    inc(&stats.wrong_key);
                    stats.example(format!("{}: event {seq} with key {}", cl.id, e.key));
                }
                if !key_index(&e.key).is_some_and(|k| cl.matcher[k]) {
                    inc(&stats.outside_interest);
                    stats.example(format!(
                        "{}: key {} outside interest {:?}",
                        cl.id, e.key, cl.spec
                    ));
                }
                match &cl.reg {
                    Some(w) if w.forbidden(seq) && stats.clustered => {
                        inc(&stats.forwarded_before_registration);
                    }
                    Some(w) if w.forbidden(seq) => {
                        inc(&stats.before_registration);
                        stats.example(format!(
                            "{}: event {seq} acknowledged before registration ({w:?})",
                            cl.id
                        ));
                    }
                    Some(_) => {}
                    None => inc(&stats.no_registration),
                }
                cl.received.push(Receipt {
                    seq_dup: seq as u32 | if e.possible_duplicate { DUP_BIT } else { 0 },
                    offset: e.offset as u32,
                    session: cl.sessions as u16,
                });
            }
        }
    }
    if plan.last && !live {
        inc(&stats.final_not_live);
        stats.example(format!(
            "{}: final drain did not reach the live marker ({replayed} replayed, pending {pending})",
            cl.id
        ));
    }
    if !ended && (plan.end == End::Crash || crash_now) && !plan.last {
        inc(&stats.crashes);
        if !live {
            inc(&stats.crashes_mid_replay);
        }
        client.crash();
    } else {
        // The application finished the last event it took.
        events.commit();
        match tokio::time::timeout(STEP, client.close(true)).await {
            Ok(Ok(())) => inc(&stats.closes),
            other if !ended => {
                inc(&stats.step_errors);
                stats.example(format!("{}: close failed: {other:?}", cl.id));
            }
            _ => {}
        }
    }
    drop(events);
    cl
}

// ---------------------------------------------------------------------------------------------
// Verdicts

#[derive(Default)]
struct Verdict {
    expected: u64,
    lost: u64,
    unflagged_duplicates: u64,
    duplicates_flagged: u64,
    optional_received: u64,
}

fn verify(
    cl: &Cl,
    total_seq: u64,
    failed: &[(u64, u64)],
    v: &mut Verdict,
    examples: &mut Vec<String>,
) {
    let Some(w) = &cl.reg else {
        examples.push(format!("{}: never registered", cl.id));
        return;
    };
    let mut recs = cl.received.clone();
    // Stable: arrival order kept among receipts of one event.
    recs.sort_by_key(|r| r.seq_dup & !DUP_BIT);
    let mut got = vec![false; 0];
    got.resize((total_seq - w.hi.min(total_seq)) as usize, false);
    let where_ = |r: &Receipt| {
        let (node, at) = cl.served(u64::from(r.session));
        format!(
            "offset {} session {} ({node}, connected at {at:.0} s{})",
            r.offset,
            r.session,
            if r.seq_dup & DUP_BIT != 0 {
                ", flagged"
            } else {
                ""
            }
        )
    };
    let mut i = 0;
    while i < recs.len() {
        let seq = (recs[i].seq_dup & !DUP_BIT) as u64;
        let mut j = i + 1;
        while j < recs.len() && (recs[j].seq_dup & !DUP_BIT) as u64 == seq {
            if recs[j].seq_dup & DUP_BIT == 0 {
                v.unflagged_duplicates += 1;
                if examples.len() < EXAMPLES_MAX {
                    examples.push(format!(
                        "{}: event {seq} ({}) received again without possible_duplicate: first at {}, again at {}",
                        cl.id,
                        key_of(seq),
                        where_(&recs[i]),
                        where_(&recs[j]),
                    ));
                }
            } else {
                v.duplicates_flagged += 1;
            }
            j += 1;
        }
        if seq >= w.hi && seq < total_seq {
            got[(seq - w.hi) as usize] = true;
        } else {
            v.optional_received += 1;
        }
        i = j;
    }
    for seq in w.hi..total_seq {
        if !cl.matcher[key_index(&key_of(seq)).expect("key")] {
            continue;
        }
        if failed.iter().any(|&(a, b)| seq >= a && seq < b) {
            continue;
        }
        v.expected += 1;
        if !got[(seq - w.hi) as usize] {
            v.lost += 1;
            if examples.len() < EXAMPLES_MAX {
                examples.push(format!(
                    "{} ({:?}): event {seq} key {} lost (registered at {})",
                    cl.id,
                    cl.spec,
                    key_of(seq),
                    w.hi
                ));
            }
        }
    }
}

fn percentile(v: &mut [f64], p: f64) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    let i = ((v.len() as f64 - 1.0) * p).round() as usize;
    v[i.min(v.len() - 1)]
}

// ---------------------------------------------------------------------------------------------

/// Resident memory samples: of this process (the clients and the run's tracking) and of each
/// server process.
#[derive(Default)]
struct Rss {
    start_kb: u64,
    warm_kb: Option<(f64, u64)>,
    at_60s_kb: Option<u64>,
    max_kb: u64,
    samples: Vec<(f64, u64)>,
    /// Per node: (time, KiB) while it runs.
    nodes: Vec<Vec<(f64, u64)>>,
    /// Per node: when it last started.
    started_at: Vec<f64>,
    /// Per node: KiB at the end of the warm-up.
    nodes_warm_kb: Vec<u64>,
    /// Per node, at each RSS sample: (time, KiB, open client connections).
    loads: Vec<Vec<(f64, u64, f64)>>,
}

/// Least-squares fit of a node's memory as a base, a cost per open client connection and a
/// drift over time: `kb = base + per_connection * connections + drift * t`. Returns (base MB,
/// KiB per connection, drift in MB per minute); the drift is the growth the connections do not
/// explain (a leak or a cache that keeps growing), what "flat" is judged on.
fn fit_rss(samples: &[(f64, u64, f64)]) -> Option<(f64, f64, f64)> {
    if samples.len() < 4 {
        return None;
    }
    // Normal equations of y = a + b x + c t, centred (a drops out).
    let n = samples.len() as f64;
    let (mt, mx, my) = samples.iter().fold((0.0, 0.0, 0.0), |(t, x, y), s| {
        (t + s.0 / n, x + s.2 / n, y + s.1 as f64 / n)
    });
    let (mut sxx, mut stt, mut sxt, mut sxy, mut sty) = (0.0, 0.0, 0.0, 0.0, 0.0);
    for &(t, kb, x) in samples {
        let (dt, dx, dy) = (t - mt, x - mx, kb as f64 - my);
        sxx += dx * dx;
        stt += dt * dt;
        sxt += dx * dt;
        sxy += dx * dy;
        sty += dt * dy;
    }
    let det = sxx * stt - sxt * sxt;
    let (b, c) = if det.abs() > 1e-9 * (sxx * stt).max(1e-9) {
        ((sxy * stt - sty * sxt) / det, (sty * sxx - sxy * sxt) / det)
    } else if stt > 0.0 {
        // Connections did not vary apart from time: the drift alone.
        (0.0, sty / stt)
    } else {
        return None;
    };
    let a = my - b * mx - c * mt;
    Some((a / 1024.0, b, c * 60.0 / 1024.0))
}

/// Least-squares slope of `samples` (seconds, KiB) in MB per minute.
fn slope_mb_per_min(samples: &[(f64, u64)]) -> Option<f64> {
    if samples.len() < 3 {
        return None;
    }
    let n = samples.len() as f64;
    let mt = samples.iter().map(|s| s.0).sum::<f64>() / n;
    let mk = samples.iter().map(|s| s.1 as f64).sum::<f64>() / n;
    let cov: f64 = samples.iter().map(|s| (s.0 - mt) * (s.1 as f64 - mk)).sum();
    let var: f64 = samples.iter().map(|s| (s.0 - mt).powi(2)).sum();
    (var > 0.0).then(|| cov / var * 60.0 / 1024.0)
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    tether::transport::tls::install_crypto_provider();
    let secs = env_u64("TETHER_SOAK_SECS", 300);
    let n_clients = env_u64("TETHER_SOAK_CLIENTS", 1000).max(1) as usize;
    let connected_max = env_u64("TETHER_SOAK_CONNECTED_MAX", 150).max(1) as usize;
    let rate = env_u64("TETHER_SOAK_RATE", 2000).max(1);
    let n_pubs = env_u64("TETHER_SOAK_PUBLISHERS", 2).max(1) as usize;
    let batch = env_u64("TETHER_SOAK_BATCH", 50).max(1);
    let value_bytes = env_u64("TETHER_SOAK_VALUE_BYTES", 64) as usize;
    let n_nodes = env_u64("TETHER_SOAK_NODES", 1).clamp(1, 5) as usize;
    let node_kills = env_u64("TETHER_SOAK_NODE_KILLS", 0);
    let sync = std::env::var("TETHER_SOAK_SYNC").unwrap_or_else(|_| "batch".into());
    let seed = std::env::var("TETHER_SOAK_SEED")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_nanos() as u64)
                .unwrap_or(1)
                ^ std::process::id() as u64
        });
    println!(
        "# tether soak: {secs} s, {n_clients} durable clients (at most {connected_max} connected), \
         {rate} events/s from {n_pubs} publishers in requests of {batch}, values of {value_bytes} B, \
         {n_nodes} node(s) (sync {sync}{}), {node_kills} node kill(s), {} cores",
        if n_nodes > 1 { ", redundancy 1" } else { "" },
        std::thread::available_parallelism()
            .map(|p| p.get())
            .unwrap_or(1)
    );
    println!("seed={seed}  (replay with TETHER_SOAK_SEED={seed})");
    let mut rng = Rng::new(seed);

    let dir = tempfile::tempdir().expect("tempdir");
    // TETHER_SOAK_CONFIG: a TOML file every node starts with (`--config`), e.g. other limits.
    let config = std::env::var("TETHER_SOAK_CONFIG").ok();
    let mut server_args = vec!["--sync", sync.as_str()];
    if let Some(c) = &config {
        server_args.extend(["--config", c.as_str()]);
    }
    let nodes = Nodes::start(dir.path(), n_nodes, &server_args);
    let admins = nodes.admin_builders();
    // Durable client i starts at node i mod n (new queues are placed across the cluster); with
    // several nodes every queue has a copy, and a lost connection is noticed within seconds.
    let builders: Vec<ClientBuilder> = (0..n_nodes)
        .map(|k| {
            let b = nodes.builder(k);
            if n_nodes > 1 || node_kills > 0 {
                b.redundancy(u8::from(n_nodes > 1))
                    .failure_timeout(CLIENT_FAILURE_TIMEOUT)
            } else {
                b
            }
        })
        .collect();
    let nodes = Arc::new(Mutex::new(nodes));
    let t_start = Instant::now();
    let _ = RUN_START.set(t_start);

    // RSS sampler: this process and every server process.
    let rss = Arc::new(Mutex::new(Rss {
        start_kb: rss_kb(),
        nodes: vec![Vec::new(); n_nodes],
        loads: vec![Vec::new(); n_nodes],
        started_at: vec![0.0; n_nodes],
        ..Default::default()
    }));
    let rss_stop = Arc::new(AtomicBool::new(false));
    let sampler = {
        let rss = rss.clone();
        let stop = rss_stop.clone();
        let nodes = nodes.clone();
        tokio::spawn(async move {
            while !stop.load(Ordering::Relaxed) {
                let kb = rss_kb();
                // Each node's memory with its open client connections, for the fit at the end.
                // Blocking reads and an HTTP scrape per node: off the clients' runtime.
                let scrape = nodes.clone();
                let Ok((servers, conns)) = tokio::task::spawn_blocking(move || {
                    let n = scrape.lock().unwrap();
                    (n.rss_kb(), n.metrics("tether_connections"))
                })
                .await
                else {
                    break;
                };
                let t = t_start.elapsed().as_secs_f64();
                {
                    let mut r = rss.lock().unwrap();
                    r.max_kb = r.max_kb.max(kb);
                    if t >= 60.0 && r.at_60s_kb.is_none() {
                        r.at_60s_kb = Some(kb);
                    }
                    r.samples.push((t, kb));
                    for (i, &k) in servers.iter().enumerate() {
                        if k > 0 {
                            r.nodes[i].push((t, k));
                        }
                    }
                    for (i, samples) in conns {
                        let c = samples.iter().find(|(n, _)| n == "tether_connections");
                        if let (Some(&k), Some((_, c))) = (servers.get(i).filter(|&&k| k > 0), c) {
                            r.loads[i].push((t, k, *c));
                        }
                    }
                }
                tokio::time::sleep(RSS_EVERY).await;
            }
        })
    };

    // Publishers.
    let pubs = Arc::new(Pubs {
        state: Mutex::new(PubState {
            next_seq: 0,
            inflight: vec![None; n_pubs],
        }),
        failed: Mutex::new(Vec::new()),
        published: AtomicU64::new(0),
        errors: AtomicU64::new(0),
        requests: AtomicU64::new(0),
        stop: AtomicBool::new(false),
    });
    let every = Duration::from_secs_f64(batch as f64 * n_pubs as f64 / rate as f64);
    let mut pub_tasks = Vec::new();
    for p in 0..n_pubs {
        let b = builders[p % n_nodes]
            .clone()
            .name(format!("soak-publisher-{p}"));
        pub_tasks.push(tokio::spawn(publisher(
            p,
            b,
            pubs.clone(),
            every,
            batch,
            value_bytes,
        )));
    }
    // Node kills, evenly spread over the soak after the first minute, each node down for
    // NODE_DOWN (then started again on its data and port).
    let mut kill_at: std::collections::VecDeque<Instant> = (1..=node_kills)
        .map(|k| {
            // Between the first minute and the last 30 s.
            let span = secs.saturating_sub(90).max(1) as f64;
            t_start + Duration::from_secs_f64(60.0 + span * k as f64 / node_kills as f64)
        })
        .collect();
    let mut restarts: Vec<tokio::task::JoinHandle<()>> = Vec::new();
    let mut kills_done = Vec::new();
    // The victims, in order (1-based node numbers), to replay a run whose kills fell otherwise
    // (the RNG that picks them also drives the clients, so a seed alone does not fix them).
    let kill_order: Vec<usize> = match std::env::var("TETHER_SOAK_KILL_ORDER") {
        Ok(v) => v
            .split(',')
            .map(|n| match n.trim().parse::<usize>() {
                Ok(n) if (1..=n_nodes).contains(&n) => n - 1,
                _ => panic!("TETHER_SOAK_KILL_ORDER: {n:?} is not a node number 1..={n_nodes}"),
            })
            .collect(),
        Err(_) => Vec::new(),
    };

    // Durable clients.
    let mut slots: Vec<Option<Cl>> = (0..n_clients)
        .map(|i| {
            let spec = Spec::random(&mut rng, i, n_clients);
            Some(Cl {
                idx: i,
                id: format!("soak-{i:04}"),
                matcher: spec.matcher(),
                spec,
                reg: None,
                received: Vec::new(),
                session_log: Vec::new(),
                max_offset: 0,
                max_offset_session: 0,
                sessions: 0,
                ever_connected: false,
                away_until: t_start,
                reached_stream: false,
            })
        })
        .collect();
    let mut mix: HashMap<&'static str, usize> = HashMap::new();
    for c in slots.iter().flatten() {
        *mix.entry(c.spec.kind()).or_default() += 1;
    }
    let mut mix: Vec<_> = mix.into_iter().collect();
    mix.sort();
    println!("interests: {mix:?}");

    let stats = Arc::new(Stats {
        clustered: n_nodes > 1,
        ..Default::default()
    });
    let stop = Arc::new(AtomicBool::new(false));
    let mut active: tokio::task::JoinSet<Cl> = tokio::task::JoinSet::new();
    let mut never: std::collections::VecDeque<usize> = (0..n_clients).collect();
    let mut registered_all = false;
    let soak_end = t_start + Duration::from_secs(secs);
    let mut next_progress = t_start + PROGRESS_EVERY;
    let mut tick = tokio::time::interval(Duration::from_millis(20));
    let mut panics = 0u64;
    while Instant::now() < soak_end {
        tick.tick().await;
        while let Some(r) = active.try_join_next() {
            match r {
                Ok(mut cl) => {
                    // Away for a while: mostly short, sometimes long.
                    let away = if rng.chance(70) {
                        rng.between(1_000, 20_000)
                    } else {
                        rng.between(20_000, 90_000)
                    };
                    cl.away_until = Instant::now() + Duration::from_millis(away);
                    let i = cl.idx;
                    slots[i] = Some(cl);
                }
                Err(e) => {
                    panics += 1;
                    eprintln!("session task failed: {e}");
                }
            }
        }
        if !registered_all && never.is_empty() && slots.iter().flatten().all(|c| c.reg.is_some()) {
            registered_all = true;
            let kb = rss_kb();
            let t = t_start.elapsed().as_secs_f64();
            let servers = nodes.lock().unwrap().rss_kb();
            {
                let mut r = rss.lock().unwrap();
                r.warm_kb = Some((t, kb));
                r.nodes_warm_kb = servers;
            }
            println!(
                "warm-up done at {t:.1} s: every client registered, rss={:.1} MB",
                mb(kb)
            );
        }
        restarts.retain(|r| !r.is_finished());
        // One node down at a time: a kill waits for the previous node's restart.
        if restarts.is_empty() && kill_at.front().is_some_and(|&t| Instant::now() >= t) {
            kill_at.pop_front();
            let victim = match kill_order.get(kills_done.len()) {
                Some(&n) => n,
                None => rng.below(n_nodes as u64) as usize,
            };
            let t = t_start.elapsed().as_secs_f64();
            println!(
                "t={t:>4.0}s kill -9 n{} (down for {NODE_DOWN:?})",
                victim + 1
            );
            nodes.lock().unwrap().kill9(victim);
            kills_done.push(format!("n{}@{t:.0}s", victim + 1));
            let (nodes, rss) = (nodes.clone(), rss.clone());
            restarts.push(tokio::spawn(async move {
                tokio::time::sleep(NODE_DOWN).await;
                let n2 = nodes.clone();
                tokio::task::spawn_blocking(move || n2.lock().unwrap().restart(victim))
                    .await
                    .expect("restart");
                rss.lock().unwrap().started_at[victim] = t_start.elapsed().as_secs_f64();
            }));
        }
        let now = Instant::now();
        let mut starts = 0;
        let mut tries = 0;
        while active.len() < connected_max && starts < STARTS_PER_TICK && tries < 50 {
            tries += 1;
            // First connections first (each registers), then random returns.
            let i = match never.front() {
                Some(&i) => {
                    never.pop_front();
                    i
                }
                None => rng.below(n_clients as u64) as usize,
            };
            let Some(cl) = slots[i].take_if(|c| c.away_until <= now) else {
                continue;
            };
            let plan = Plan {
                consume_for: Duration::from_millis(if rng.chance(20) {
                    rng.between(50, 1_000) // often ends mid-replay
                } else {
                    rng.between(1_000, 15_000)
                }),
                end: if rng.chance(35) {
                    End::Crash
                } else {
                    End::Close
                },
                crash_after: rng.chance(15).then(|| rng.between(1, 2_000)),
                last: false,
            };
            let b = builders[i % n_nodes].clone();
            active.spawn(session(
                cl,
                b,
                pubs.clone(),
                stats.clone(),
                plan,
                stop.clone(),
            ));
            starts += 1;
        }
        if now >= next_progress {
            next_progress += PROGRESS_EVERY;
            // Open client connections and pending entries per node (memory follows them).
            let per_node = nodes.lock().unwrap().metrics("tether_");
            let load: Vec<String> = per_node
                .into_iter()
                .map(|(i, samples)| {
                    let get =
                        |name: &str| samples.iter().find(|(n, _)| n == name).map_or(0.0, |s| s.1);
                    format!(
                        "n{}: connections={} pending={} kept_publish_ops={} kept_held={:.0} MB",
                        i + 1,
                        get("tether_connections"),
                        get("tether_pending_events"),
                        get("tether_failover_recent_publish_ops"),
                        get("tether_failover_recent_publish_held_bytes") / 1048576.0
                    )
                })
                .collect();
            println!("    {}", load.join(", "));
            // What the storage engine and the heaps say the node holds.
            for (i, samples) in nodes.lock().unwrap().metrics("tether_") {
                let mb = |k: &str| {
                    samples
                        .iter()
                        .find(|(n, _)| n.contains(k))
                        .map_or(0.0, |s| s.1 / 1048576.0)
                };
                println!(
                    "    n{}: heap rust={:.0} MB native={:.0} MB native_retained={:.0} MB, storage memtables={:.0} MB table_readers={:.0} MB block_cache={:.0} MB l0_files={}",
                    i + 1,
                    mb("tether_heap_live_bytes{allocator=\"rust\"}"),
                    mb("tether_heap_live_bytes{allocator=\"native\"}"),
                    mb("tether_heap_retained_bytes{allocator=\"native\"}"),
                    mb("\"memtables\""),
                    mb("\"table_readers\""),
                    mb("\"block_cache\""),
                    samples
                        .iter()
                        .find(|(n, _)| n.starts_with("tether_storage_l0_files"))
                        .map_or(0.0, |s| s.1)
                );
            }
            println!(
                "t={:>4.0}s connected={:>3} published={} delivered={} connects={} closes={} crashes={} server rss={} MB, harness rss={:.1} MB",
                t_start.elapsed().as_secs_f64(),
                active.len(),
                pubs.published.load(Ordering::Relaxed),
                stats.delivered.load(Ordering::Relaxed),
                stats.connects.load(Ordering::Relaxed),
                stats.closes.load(Ordering::Relaxed),
                stats.crashes.load(Ordering::Relaxed),
                nodes
                    .lock()
                    .unwrap()
                    .rss_kb()
                    .iter()
                    .map(|&k| format!("{:.0}", mb(k)))
                    .collect::<Vec<_>>()
                    .join("/"),
                mb(rss_kb())
            );
        }
    }
    let soak_secs = t_start.elapsed().as_secs_f64();

    // Stop publishing; wait for the last requests.
    pubs.stop.store(true, Ordering::Release);
    for t in pub_tasks {
        if tokio::time::timeout(STEP * 2, t).await.is_err() {
            eprintln!("a publisher did not stop in time");
        }
    }
    let total_seq = pubs.next_seq();
    let published = pubs.published.load(Ordering::Relaxed);
    let publish_rate = published as f64 / soak_secs;
    // Wind down the sessions still running.
    stop.store(true, Ordering::Release);
    let mut stuck = 0u64;
    let wind_down = tokio::time::Instant::now() + WIND_DOWN;
    while !active.is_empty() {
        match tokio::time::timeout_at(wind_down, active.join_next()).await {
            Ok(Some(Ok(cl))) => {
                let i = cl.idx;
                slots[i] = Some(cl);
            }
            Ok(Some(Err(e))) => {
                panics += 1;
                eprintln!("session task failed: {e}");
            }
            Ok(None) => break,
            Err(_) => {
                stuck = active.len() as u64;
                eprintln!("{stuck} sessions did not wind down in time");
                active.abort_all();
                break;
            }
        }
    }
    // Every killed node is back before the final phase (its restart may still be under way).
    for r in restarts {
        let _ = r.await;
    }
    // A cluster forwards publishes between nodes asynchronously (a restarted node sends its
    // publish log's backlog): the final phase starts once every node's forwarding lag is 0, so
    // that its exact checks see every queue complete.
    let forwarded_secs = if n_nodes > 1 {
        let t = Instant::now();
        loop {
            let lags: Vec<f64> = nodes
                .lock()
                .unwrap()
                .metrics("tether_forward_lag_entries")
                .into_iter()
                .flat_map(|(_, samples)| samples.into_iter().map(|s| s.1))
                .collect();
            if !lags.is_empty() && lags.iter().all(|&l| l == 0.0) {
                break;
            }
            if t.elapsed() > FORWARDING_DRAIN {
                eprintln!("forwarding did not drain in {FORWARDING_DRAIN:?}: lags {lags:?}");
                break;
            }
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
        t.elapsed().as_secs_f64()
    } else {
        0.0
    };
    let soak_kb = rss_kb();
    let soak_server_kb = nodes.lock().unwrap().rss_kb();
    let queues = primary_queues(&admins).await;
    let pending_before_final: u64 = queues.iter().map(|q| q.pending).sum();
    let away_before_final = queues.iter().filter(|q| q.state == "away").count();
    println!(
        "soak phase over at {soak_secs:.1} s: {} queues ({away_before_final} away), {pending_before_final} entries pending, rss={:.1} MB",
        queues.len(),
        mb(soak_kb)
    );

    // Final phase: every client comes back and drains to its live marker.
    let t_final = Instant::now();
    let mut order: Vec<usize> = (0..n_clients).filter(|&i| slots[i].is_some()).collect();
    let missing = n_clients - order.len();
    order.reverse();
    let mut final_active: tokio::task::JoinSet<Cl> = tokio::task::JoinSet::new();
    let final_deadline =
        tokio::time::Instant::now() + Duration::from_secs(600).max(FINAL_DRAIN * 2);
    let final_plan = Plan {
        consume_for: FINAL_DRAIN,
        end: End::Close,
        crash_after: None,
        last: true,
    };
    let mut final_attempts = vec![0u32; n_clients];
    let (mut final_retries, mut final_unreached) = (0u64, 0u64);
    loop {
        while final_active.len() < connected_max {
            let Some(i) = order.pop() else { break };
            let cl = slots[i].take().expect("present");
            final_attempts[i] += 1;
            final_active.spawn(session(
                cl,
                builders[i % n_nodes].clone(),
                pubs.clone(),
                stats.clone(),
                final_plan,
                Arc::new(AtomicBool::new(false)),
            ));
        }
        match tokio::time::timeout_at(final_deadline, final_active.join_next()).await {
            Ok(Some(Ok(cl))) => {
                let i = cl.idx;
                if cl.reached_stream {
                    slots[i] = Some(cl);
                } else if final_attempts[i] < FINAL_ATTEMPTS_MAX {
                    final_retries += 1;
                    final_attempts[i] += 1;
                    let (b, p, st) = (builders[i % n_nodes].clone(), pubs.clone(), stats.clone());
                    final_active.spawn(async move {
                        tokio::time::sleep(FINAL_RETRY_PAUSE).await;
                        session(cl, b, p, st, final_plan, Arc::new(AtomicBool::new(false))).await
                    });
                } else {
                    final_unreached += 1;
                    slots[i] = Some(cl);
                }
            }
            Ok(Some(Err(e))) => {
                panics += 1;
                eprintln!("final session failed: {e}");
            }
            Ok(None) => break,
            Err(_) => {
                stuck += final_active.len() as u64;
                eprintln!("final phase did not finish in time");
                final_active.abort_all();
                break;
            }
        }
    }
    let final_secs = t_final.elapsed().as_secs_f64();
    let queues = primary_queues(&admins).await;
    let pending_after: u64 = queues.iter().map(|q| q.pending).sum();
    if pending_after > 0 {
        // Where the undelivered entries sit: every node's view of those queues.
        let stuck_ids: std::collections::HashSet<String> = queues
            .iter()
            .filter(|q| q.pending > 0)
            .filter_map(|q| q.durable_id.clone())
            .collect();
        let mut shown = 0;
        for (n, b) in admins.iter().enumerate() {
            let Ok(c) = b.clone().connect().await else {
                continue;
            };
            for q in c.queues().await.unwrap_or_default() {
                if shown < EXAMPLES_MAX * 3
                    && q.durable_id
                        .as_ref()
                        .is_some_and(|id| stuck_ids.contains(id))
                {
                    shown += 1;
                    eprintln!(
                        "after the final phase, n{}: {:?} {} state {} pending {} acked {} end {} copies {:?} primary {:?}",
                        n + 1,
                        q.durable_id,
                        q.role,
                        q.state,
                        q.pending,
                        q.acked_offset,
                        q.end_offset,
                        q.copies,
                        q.primary
                    );
                }
            }
            let _ = c.close(false).await;
        }
    }
    let final_kb = rss_kb();

    // Verdicts.
    let failed = pubs.failed.lock().unwrap().clone();
    let mut v = Verdict::default();
    let mut examples = Vec::new();
    let mut never_registered = 0;
    for cl in slots.iter().flatten() {
        if cl.reg.is_none() {
            never_registered += 1;
        }
        verify(cl, total_seq, &failed, &mut v, &mut examples);
    }
    let lost_clients = missing as u64 + stuck;
    rss_stop.store(true, Ordering::Relaxed);
    let _ = sampler.await;
    let tracker_bytes: usize = slots
        .iter()
        .flatten()
        .map(|c| c.received.capacity() * std::mem::size_of::<Receipt>() + c.matcher.capacity())
        .sum();
    let final_server_kb = nodes.lock().unwrap().rss_kb();
    match Arc::try_unwrap(nodes) {
        Ok(n) => n.into_inner().unwrap().stop(),
        Err(_) => eprintln!("the nodes are still shared; they are killed at exit"),
    }

    // Report.
    let s = &*stats;
    let g = |a: &AtomicU64| a.load(Ordering::Relaxed);
    let r = rss.lock().unwrap();
    let mut st = s.status_ms.lock().unwrap().clone();
    let mut fst = s.final_status_ms.lock().unwrap().clone();
    println!();
    println!("== figures");
    println!("soak_secs={soak_secs:.1}");
    println!("final_phase_secs={final_secs:.1}");
    println!("forwarding_drain_secs={forwarded_secs:.1}");
    println!("events_published={published}");
    println!("publish_events_per_s={publish_rate:.0}");
    println!("publish_requests={}", g(&pubs.requests));
    println!("publish_errors={}", g(&pubs.errors));
    println!("events_delivered={}", g(&s.delivered));
    println!("events_replayed={}", g(&s.replayed));
    println!("redeliveries={}", g(&s.redelivered));
    println!("redeliveries_after_first={}", v.duplicates_flagged);
    println!("expected_receipts={}", v.expected);
    println!("optional_receipts={}", v.optional_received);
    println!("connects={}", g(&s.connects));
    println!("resumes={}", g(&s.resumes));
    println!("closes={}", g(&s.closes));
    println!("crashes={}", g(&s.crashes));
    println!("crashes_mid_replay={}", g(&s.crashes_mid_replay));
    println!("live_markers={}", g(&s.lives));
    println!("connect_errors={}", g(&s.connect_errors));
    println!("final_session_retries={final_retries}");
    println!(
        "refused_duplicate_durable_id={}",
        g(&s.refused_duplicate_id)
    );
    println!("step_errors={}", g(&s.step_errors));
    println!("streams_ended_unexpectedly={}", g(&s.stream_ended));
    println!(
        "forwarded_before_registration={}",
        g(&s.forwarded_before_registration)
    );
    println!("pending_before_final={pending_before_final}");
    println!("pending_after_final={pending_after}");
    println!(
        "reconnect_to_status_ms_p50={:.2} p99={:.2} n={}",
        percentile(&mut st, 0.5),
        percentile(&mut st, 0.99),
        st.len()
    );
    println!(
        "final_reconnect_to_status_ms_p50={:.2} p99={:.2} n={}",
        percentile(&mut fst, 0.5),
        percentile(&mut fst, 0.99),
        fst.len()
    );
    // The servers' own memory (separate processes): after the warm-up, at the end of the soak
    // phase, the peak, and the slope over the second half of the soak (samples since a killed
    // node's restart only).
    let half = soak_secs / 2.0;
    let mut worst_slope: Option<f64> = None;
    for (i, samples) in r.nodes.iter().enumerate() {
        let from = half.max(r.started_at[i] + 30.0);
        let tail: Vec<(f64, u64)> = samples
            .iter()
            .copied()
            .filter(|&(t, _)| t >= from && t <= soak_secs)
            .collect();
        let slope = slope_mb_per_min(&tail);
        if let Some(sl) = slope {
            worst_slope = Some(worst_slope.map_or(sl, |w: f64| w.max(sl)));
        }
        let peak = samples.iter().map(|s| s.1).max().unwrap_or(0);
        println!(
            "server_rss_mb node=n{} after_warmup={:.1} end_of_soak={:.1} peak={:.1} final={:.1} second_half_slope_mb_per_min={}",
            i + 1,
            mb(r.nodes_warm_kb.get(i).copied().unwrap_or(0)),
            mb(soak_server_kb[i]),
            mb(peak),
            mb(final_server_kb[i]),
            slope.map_or("n/a".into(), |v| format!("{v:.2}"))
        );
        let series: Vec<String> = samples
            .iter()
            .filter(|(t, _)| (*t as u64) % 30 < 2)
            .map(|(t, kb)| format!("{:.0}s:{:.0}", t, mb(*kb)))
            .collect();
        println!("server_rss_series_mb node=n{}: {}", i + 1, series.join(" "));
    }
    println!(
        "server_rss_second_half_slope_mb_per_min={}",
        worst_slope.map_or("n/a".into(), |v| format!("{v:.2}"))
    );
    // Memory against the connections a node holds (after failovers most clients are on one or
    // two nodes): base, cost per connection and the drift they leave unexplained, from the
    // RSS samples since the node's last start (the first 30 s left out).
    let mut worst_drift: Option<f64> = None;
    for (i, loads) in r.loads.iter().enumerate() {
        let tail: Vec<(f64, u64, f64)> = loads
            .iter()
            .copied()
            .filter(|&(t, _, _)| t >= r.started_at[i] + 30.0 && t <= soak_secs)
            .collect();
        match fit_rss(&tail) {
            Some((base, per_conn, drift)) => {
                worst_drift = Some(worst_drift.map_or(drift, |w: f64| w.max(drift)));
                println!(
                    "server_rss_fit node=n{} samples={} base_mb={base:.1} per_connection_kb={per_conn:.0} drift_mb_per_min={drift:.2}",
                    i + 1,
                    tail.len()
                );
            }
            None => println!(
                "server_rss_fit node=n{} samples={} (too few to fit)",
                i + 1,
                tail.len()
            ),
        }
    }
    println!(
        "server_rss_drift_mb_per_min={}",
        worst_drift.map_or("n/a".into(), |v| format!("{v:.2}"))
    );
    println!("node_kills={} {}", kills_done.len(), kills_done.join(" "));
    // This process: the clients (each with its own QUIC endpoint) and the run's tracking.
    println!("harness_rss_start_mb={:.1}", mb(r.start_kb));
    match r.warm_kb {
        Some((t, kb)) => println!("harness_rss_after_warmup_mb={:.1} (at {t:.1} s)", mb(kb)),
        None => println!("harness_rss_after_warmup_mb=n/a"),
    }
    println!("harness_rss_end_of_soak_mb={:.1}", mb(soak_kb));
    println!("harness_rss_max_mb={:.1}", mb(r.max_kb.max(final_kb)));
    println!("harness_rss_final_mb={:.1}", mb(final_kb));
    println!(
        "harness_tracking_mb={:.1}",
        tracker_bytes as f64 / 1048576.0
    );
    println!();
    println!("== checks");
    let checks = [
        ("lost", v.lost),
        ("unflagged_duplicates", v.unflagged_duplicates),
        ("pending_mismatch", g(&s.pending_mismatch)),
        ("replay_end_mismatch", g(&s.replay_end_mismatch)),
        ("queue_lost", g(&s.queue_lost)),
        ("outside_interest", g(&s.outside_interest)),
        ("before_registration", g(&s.before_registration)),
        ("wrong_key", g(&s.wrong_key)),
        ("undecodable", g(&s.undecodable)),
        ("offset_gaps", g(&s.offset_gaps)),
        (
            "offset_unflagged_redelivery",
            g(&s.offset_unflagged_redelivery),
        ),
        ("flag_violations", g(&s.flag_violations)),
        ("final_not_live", g(&s.final_not_live)),
        ("final_sessions_failed", final_unreached),
        ("never_registered", never_registered),
        ("clients_unaccounted", lost_clients),
        ("task_panics", panics),
        ("pending_after_final", pending_after),
    ];
    let mut ok = true;
    for (name, n) in checks {
        println!("{name}={n}");
        ok &= n == 0;
    }
    let mut all_examples = s.examples.lock().unwrap().clone();
    all_examples.extend(examples);
    if !all_examples.is_empty() {
        println!();
        println!("== examples (first {EXAMPLES_MAX} of each kind)");
        for e in &all_examples {
            println!("  {e}");
        }
    }
    println!();
    println!("verdict={}", if ok { "PASS" } else { "FAIL" });
    if !ok {
        std::process::exit(1);
    }
}
