//! Crash safety of the real `tether server` binary under kill -9, per sync mode.
//!
//! Each round: publishers put numbered values (remembering which publishes the server
//! ACKNOWLEDGED) while durable subscribers consume and ack; at a seeded random moment the
//! server is killed with SIGKILL, restarted on the same data directory, and everything
//! reconnects. Checked after every restart and at the end:
//! - no acknowledged publish is lost: its event reaches every durable subscriber whose
//!   (durable, registered-before-any-publish) interest matches, and `get` returns the latest
//!   acknowledged value of every key (or the value of a later publish that was in flight);
//! - acked offsets never go back: a queue's `acked_offset` after a restart is at least the one
//!   after the previous restart, and at least every ack the subscriber made durable (an ack
//!   followed by an acknowledged request on the same connection);
//! - pending counts are exact: `pending` in the welcome == `end_offset - acked_offset` of
//!   `queues()` == the number of entries replayed before the live marker;
//! - no event is delivered twice without `possible_duplicate`, and nothing arrives that was
//!   never published.
//!
//! Short by default (part of `make test`). Environment:
//! - `TETHER_CRASH_ROUNDS` (default 8): kills per sync mode;
//! - `TETHER_CRASH_SEED` (default fixed): seed of the schedule; printed on failure to replay;
//! - `TETHER_CRASH_SYNC` (default `always,batch,none`): the sync modes to run.
//!
//! `make crash-test` runs a long version (`TETHER_CRASH_ROUNDS=50`, a fresh seed).
// The final checks hold the world's locks across awaits on purpose: every worker has
// stopped by then, so nothing else can take them.
#![allow(clippy::await_holding_lock)]

mod common;

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::crash::{
    PUBLISHERS, Rng, check, env_u64, key_of, next_publish, or_stop, subs, value_of,
};
use common::{ServerProc, WAIT};
use tether::client::{Client, ClientEvent};
use tether::protocol::{QueueReport, QueueStatus};
use tokio::sync::watch;

const DEFAULT_SEED: u64 = 0x00c0_ffee_2026_0002;
const REGION: &str = "R";

// ---------------------------------------------------------------------------------------------
// The model: what was published and acknowledged, what each subscriber received
// ---------------------------------------------------------------------------------------------

#[derive(Default)]
struct PubModel {
    /// Acknowledged publishes: n → (key, value), per publisher.
    acked: BTreeMap<(u64, u64), String>,
    /// Publishes whose answer never came (in flight at the kill): may or may not be applied.
    uncertain: BTreeMap<(u64, u64), String>,
    next: [u64; PUBLISHERS as usize],
}

#[derive(Default)]
struct SubModel {
    /// Event id → value of every event ever received.
    ids: HashMap<String, String>,
    /// Values received (each publish op has a unique value).
    values: HashSet<String>,
    /// Acked offset that is durable for sure (an ack followed by an acknowledged request).
    durable_ack_floor: u64,
    /// `acked_offset` after the previous restart.
    acked_after_restart: u64,
    events: u64,
    flagged: u64,
}

struct World {
    seed: u64,
    sync: String,
    pubs: Mutex<PubModel>,
    subs: Vec<Mutex<SubModel>>,
    killed: AtomicBool,
    failures: Mutex<Vec<String>>,
}

impl World {
    fn fail(&self, msg: String) {
        eprintln!("crash_safety FAILURE (sync {}): {msg}", self.sync);
        self.failures.lock().unwrap().push(msg);
    }
}

/// Records one received event for subscriber `i`; checks duplicates and provenance.
fn record_event(world: &World, i: usize, ev: &tether::client::Event, session_offsets: &mut u64) {
    let value = ev
        .value
        .as_ref()
        .map(|v| String::from_utf8_lossy(v).into_owned())
        .unwrap_or_default();
    let id = ev.event_id.to_string();
    check!(
        world,
        ev.offset > *session_offsets,
        "{}: offset {} after {} in one session",
        subs()[i].id,
        ev.offset,
        session_offsets
    );
    *session_offsets = ev.offset;
    {
        let pubs = world.pubs.lock().unwrap();
        let issued = value
            .strip_prefix('p')
            .and_then(|r| r.split_once(':'))
            .and_then(|(p, n)| Some((p.parse::<u64>().ok()?, n.parse::<u64>().ok()?)))
            // Acknowledged, in flight at a kill, or in flight now.
            .is_some_and(|(p, n)| {
                p < PUBLISHERS && n < pubs.next[p as usize] && key_of(p, n) == ev.key
            });
        check!(
            world,
            issued,
            "{}: event {id} {}={value:?} was never published",
            subs()[i].id,
            ev.key
        );
    }
    check!(
        world,
        (subs()[i].matches)(&ev.key),
        "{}: event for {} does not match its interest",
        subs()[i].id,
        ev.key
    );
    let mut m = world.subs[i].lock().unwrap();
    m.events += 1;
    if ev.possible_duplicate {
        m.flagged += 1;
    }
    if let Some(prev) = m.ids.get(&id) {
        check!(
            world,
            prev == &value,
            "{}: event id {id} carried {prev:?} and then {value:?}",
            subs()[i].id
        );
        check!(
            world,
            ev.possible_duplicate,
            "{}: event {id} ({}={value}, offset {}) delivered twice without possible_duplicate",
            subs()[i].id,
            ev.key,
            ev.offset
        );
    }
    m.ids.insert(id, value.clone());
    m.values.insert(value);
}

// ---------------------------------------------------------------------------------------------
// Phases
// ---------------------------------------------------------------------------------------------

async fn report_of(admin: &Client, id: &str) -> Option<QueueReport> {
    admin
        .queues()
        .await
        .expect("queues")
        .into_iter()
        .find(|q| q.durable_id.as_deref() == Some(id))
}

/// After a restart: checks a subscriber's queue report, and (if `connect`) resumes it, checks
/// the welcome's pending count and the replay, and returns the live client and its stream.
async fn resume_sub(
    world: &World,
    server: &ServerProc,
    admin: &Client,
    i: usize,
    connect: bool,
) -> Option<(Client, tether::client::EventStream)> {
    let spec = &subs()[i];
    let r = report_of(admin, spec.id).await;
    let Some(r) = r else {
        world.fail(format!("{}: durable queue lost after restart", spec.id));
        return None;
    };
    {
        let mut m = world.subs[i].lock().unwrap();
        check!(
            world,
            r.state == "away",
            "{}: state after restart {}",
            spec.id,
            r.state
        );
        check!(
            world,
            r.pending == r.end_offset - r.acked_offset,
            "{}: pending {} != end {} - acked {}",
            spec.id,
            r.pending,
            r.end_offset,
            r.acked_offset
        );
        check!(
            world,
            r.acked_offset >= m.acked_after_restart,
            "{}: acked offset went back from {} to {} across a restart",
            spec.id,
            m.acked_after_restart,
            r.acked_offset
        );
        check!(
            world,
            r.acked_offset >= m.durable_ack_floor,
            "{}: acked offset {} is below the durably acked {}",
            spec.id,
            r.acked_offset,
            m.durable_ack_floor
        );
        check!(
            world,
            r.interests.iter().all(|x| x.durable) && !r.interests.is_empty(),
            "{}: durable interest after restart: {:?}",
            spec.id,
            r.interests
        );
        m.acked_after_restart = r.acked_offset;
    }
    if !connect {
        return None;
    }
    let c = server
        .builder()
        .durable(spec.id, 3600)
        .ack_interval(Duration::from_millis(20))
        .connect()
        .await
        .unwrap_or_else(|e| panic!("{} reconnects: {e}", spec.id));
    check!(
        world,
        c.queue_status() == QueueStatus::Resumed && c.pending() == Some(r.pending),
        "{}: welcome {:?} pending {:?}, queues() said pending {}",
        spec.id,
        c.queue_status(),
        c.pending(),
        r.pending
    );
    let replay_end = c.ready_for_events().await.expect("ready");
    check!(
        world,
        replay_end == r.end_offset,
        "{}: replay_end {replay_end} != end_offset {}",
        spec.id,
        r.end_offset
    );
    let mut ev = c.events().expect("events");
    let mut replayed = 0u64;
    let mut last = r.acked_offset;
    let mut flags_prefix = true;
    let mut seen_unflagged = false;
    loop {
        let e = tokio::time::timeout(WAIT, ev.next())
            .await
            .unwrap_or_else(|_| panic!("{}: no live marker after {replayed} events", spec.id))
            .unwrap_or_else(|| panic!("{}: stream ended during the replay", spec.id));
        match e {
            other @ (ClientEvent::Disconnected { .. } | ClientEvent::Reconnected { .. }) => {
                panic!("a session's stream yielded {other:?}")
            }
            ClientEvent::Live { regions } => {
                check!(
                    world,
                    regions == [REGION],
                    "{}: live marker {regions:?}",
                    spec.id
                );
                break;
            }
            ClientEvent::Event(e) => {
                check!(
                    world,
                    e.offset == last + 1 && e.replayed,
                    "{}: replayed offset {} (replayed {}) after {last}",
                    spec.id,
                    e.offset,
                    e.replayed
                );
                if e.possible_duplicate && seen_unflagged {
                    flags_prefix = false;
                }
                seen_unflagged |= !e.possible_duplicate;
                record_event(world, i, &e, &mut last.clone());
                last = e.offset;
                replayed += 1;
            }
        }
    }
    check!(
        world,
        replayed == r.pending,
        "{}: replayed {replayed} entries, pending was {}",
        spec.id,
        r.pending
    );
    check!(
        world,
        flags_prefix,
        "{}: possible_duplicate flags are not a prefix of the replay",
        spec.id
    );
    Some((c, ev))
}

/// Consumes live events until the stream ends (the kill); sometimes slowly; now and then
/// makes its acks durable (commit + ack + a request on the same connection).
async fn consume(
    world: Arc<World>,
    i: usize,
    client: Client,
    mut ev: tether::client::EventStream,
    mut rng: Rng,
    mut stop: watch::Receiver<bool>,
) {
    let mut last = 0u64;
    let mut n = 0u64;
    let slow = rng.below(3) == 0;
    while let Some(Some(e)) = or_stop(&mut stop, ev.next()).await {
        let ClientEvent::Event(e) = e else { continue };
        record_event(&world, i, &e, &mut last);
        n += 1;
        if slow && rng.below(4) == 0 {
            tokio::time::sleep(Duration::from_millis(rng.below(5))).await;
        }
        if rng.below(16) == 0 {
            ev.commit();
            let done = e.offset;
            let made_durable = async {
                client.ack_now().await.is_ok()
                    && client
                        .region("sync")
                        .put(format!("{}-{n}", subs()[i].id), b"x".to_vec())
                        .await
                        .is_ok()
            };
            if or_stop(&mut stop, made_durable).await == Some(true) {
                let mut m = world.subs[i].lock().unwrap();
                m.durable_ack_floor = m.durable_ack_floor.max(done);
            }
        }
    }
    // The server is gone: drop the connection without waiting for the idle timeout.
    drop(ev);
    client.crash();
}

/// Publishes numbered values until the connection fails (the kill).
async fn publish_loop(
    world: Arc<World>,
    p: u64,
    client: Client,
    mut rng: Rng,
    mut stop: watch::Receiver<bool>,
) {
    loop {
        let (ops, ns) = next_publish(&mut world.pubs.lock().unwrap().next, p, &mut rng, REGION);
        let ops_n = ns.len() as u64;
        let res = or_stop(&mut stop, client.publish(ops)).await;
        let go_on = {
            let mut m = world.pubs.lock().unwrap();
            match res {
                Some(Ok(count)) => {
                    check!(world, count == ops_n, "publish answered count {count}");
                    for n in ns {
                        m.acked.insert((p, n), key_of(p, n));
                    }
                    true
                }
                other => {
                    for n in ns {
                        m.uncertain.insert((p, n), key_of(p, n));
                    }
                    if let Some(Err(e)) = other
                        && !world.killed.load(Ordering::SeqCst)
                    {
                        world.fail(format!(
                            "publisher {p}: publish failed before the kill: {e}"
                        ));
                    }
                    false
                }
            }
        };
        if !go_on {
            client.crash();
            return;
        }
        if rng.below(4) == 0 {
            tokio::time::sleep(Duration::from_millis(rng.below(4))).await;
        }
    }
}

/// Every acknowledged publish reached every matching subscriber; `get` gives the latest.
async fn check_complete(world: &World, server: &ServerProc) {
    let pubs = world.pubs.lock().unwrap();
    for (i, spec) in subs().iter().enumerate() {
        let m = world.subs[i].lock().unwrap();
        let missing: Vec<String> = pubs
            .acked
            .iter()
            .filter(|(_, k)| (spec.matches)(k))
            .map(|(&(p, n), _)| value_of(p, n))
            .filter(|v| !m.values.contains(v))
            .collect();
        check!(
            world,
            missing.is_empty(),
            "{}: {} acknowledged publishes never delivered, e.g. {:?}",
            spec.id,
            missing.len(),
            &missing[..missing.len().min(5)]
        );
    }
    // Expected latest values: per key, the acked publish with the highest n, or any later
    // uncertain one (same publisher: publishes are sequential).
    let mut latest: BTreeMap<String, (u64, u64)> = BTreeMap::new();
    for (&(p, n), k) in &pubs.acked {
        let e = latest.entry(k.clone()).or_insert((p, n));
        if n > e.1 {
            *e = (p, n);
        }
    }
    let mut allowed: BTreeMap<String, HashSet<Option<String>>> = BTreeMap::new();
    for (k, &(p, n)) in &latest {
        allowed
            .entry(k.clone())
            .or_default()
            .insert(Some(value_of(p, n)));
    }
    for (&(p, n), k) in &pubs.uncertain {
        match latest.get(k) {
            // Never acknowledged: absent is fine too.
            None => {
                let e = allowed.entry(k.clone()).or_default();
                e.insert(None);
                e.insert(Some(value_of(p, n)));
            }
            Some(&(_, ln)) if n > ln => {
                allowed
                    .entry(k.clone())
                    .or_default()
                    .insert(Some(value_of(p, n)));
            }
            Some(_) => {}
        }
    }
    drop(pubs);
    let c = server.builder().connect().await.expect("getter connects");
    for (k, ok) in allowed {
        let got = c.region(REGION).get(&k).await.expect("get");
        let got = got.map(|v| String::from_utf8_lossy(&v).into_owned());
        check!(
            world,
            ok.contains(&got),
            "get {k} = {got:?}, expected one of {ok:?}"
        );
    }
    let _ = c.close(false).await;
}

async fn run(sync: &str) {
    let rounds = env_u64("TETHER_CRASH_ROUNDS").unwrap_or(8);
    let seed = env_u64("TETHER_CRASH_SEED").unwrap_or(DEFAULT_SEED);
    let mut rng = Rng::new(
        seed ^ sync
            .bytes()
            .fold(0u64, |h, b| h.wrapping_mul(31).wrapping_add(b as u64)),
    );
    let world = Arc::new(World {
        seed,
        sync: sync.to_string(),
        pubs: Mutex::new(PubModel::default()),
        subs: subs()
            .iter()
            .map(|_| Mutex::new(SubModel::default()))
            .collect(),
        killed: AtomicBool::new(false),
        failures: Mutex::new(Vec::new()),
    });
    let started = Instant::now();
    let dir = tempfile::tempdir().unwrap();
    let mut server = ServerProc::start(dir.path(), &["--sync", sync]);
    // Round 0 set-up: durable interest registered before any publish.
    let mut live: Vec<Option<(Client, tether::client::EventStream)>> = Vec::new();
    for spec in subs() {
        let c = server
            .builder()
            .durable(spec.id, 3600)
            .ack_interval(Duration::from_millis(20))
            .connect()
            .await
            .expect("subscriber connects");
        assert_eq!(c.queue_status(), QueueStatus::New);
        c.region(REGION)
            .register((spec.interest)())
            .await
            .expect("register");
        c.ready_for_events().await.expect("ready");
        let mut ev = c.events().unwrap();
        common::until_live(&mut ev, REGION).await;
        live.push(Some((c, ev)));
    }
    for round in 0..rounds {
        world.killed.store(false, Ordering::SeqCst);
        let (stop_tx, stop_rx) = watch::channel(false);
        let mut tasks = Vec::new();
        for (i, l) in live.iter_mut().enumerate() {
            if let Some((c, ev)) = l.take() {
                let r = Rng::new(rng.next());
                tasks.push(tokio::spawn(consume(
                    world.clone(),
                    i,
                    c,
                    ev,
                    r,
                    stop_rx.clone(),
                )));
            }
        }
        for p in 0..PUBLISHERS {
            let c = server
                .builder()
                .connect()
                .await
                .expect("publisher connects");
            let r = Rng::new(rng.next());
            tasks.push(tokio::spawn(publish_loop(
                world.clone(),
                p,
                c,
                r,
                stop_rx.clone(),
            )));
        }
        let delay = 30 + rng.below(400);
        tokio::time::sleep(Duration::from_millis(delay)).await;
        world.killed.store(true, Ordering::SeqCst);
        server.kill9();
        let _ = stop_tx.send(true);
        for t in tasks {
            tokio::time::timeout(WAIT, t)
                .await
                .expect("client tasks end after the kill")
                .expect("client task");
        }
        server = ServerProc::start(dir.path(), &["--sync", sync]);
        let admin = server.builder().connect().await.expect("admin connects");
        let mut next_live = Vec::new();
        for i in 0..subs().len() {
            // Most subscribers come back; some stay away for a round (their queue grows).
            let connect = round + 1 == rounds || rng.below(4) != 0;
            next_live.push(resume_sub(&world, &server, &admin, i, connect).await);
        }
        live = next_live;
        let _ = admin.close(false).await;
        let failures = world.failures.lock().unwrap().len();
        assert!(
            failures == 0,
            "sync {sync}: round {round} (kill after {delay} ms) failed; replay with \
             TETHER_CRASH_SEED={seed:#x} TETHER_CRASH_ROUNDS={rounds}:\n{}",
            world.failures.lock().unwrap().join("\n")
        );
    }
    // Everyone is resumed and replayed after the last restart: check completeness and values.
    check_complete(&world, &server).await;
    let pubs = world.pubs.lock().unwrap();
    let summary = format!(
        "sync {sync} seed {seed:#x}: {rounds} kills in {:.1}s, {} acked publishes, {} in flight \
         at kills; events per subscriber {:?} (flagged possible_duplicate {:?}, durably acked \
         {:?})",
        started.elapsed().as_secs_f64(),
        pubs.acked.len(),
        pubs.uncertain.len(),
        world
            .subs
            .iter()
            .map(|m| m.lock().unwrap().events)
            .collect::<Vec<_>>(),
        world
            .subs
            .iter()
            .map(|m| m.lock().unwrap().flagged)
            .collect::<Vec<_>>(),
        world
            .subs
            .iter()
            .map(|m| m.lock().unwrap().durable_ack_floor)
            .collect::<Vec<_>>(),
    );
    drop(pubs);
    eprintln!("{summary}");
    let failures = world.failures.lock().unwrap();
    assert!(
        failures.is_empty(),
        "{summary}\nreplay with TETHER_CRASH_SEED={:#x} TETHER_CRASH_ROUNDS={rounds}:\n{}",
        world.seed,
        failures.join("\n")
    );
    assert!(
        !world.pubs.lock().unwrap().acked.is_empty(),
        "no publish was acknowledged: the test proved nothing"
    );
    for (c, _) in live.into_iter().flatten() {
        let _ = c.close(true).await;
    }
}

fn enabled(sync: &str) -> bool {
    match std::env::var("TETHER_CRASH_SYNC") {
        Ok(v) => v.split(',').any(|s| s.trim() == sync),
        Err(_) => true,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill9_loses_no_acknowledged_publish_sync_always() {
    if enabled("always") {
        run("always").await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill9_loses_no_acknowledged_publish_sync_batch() {
    if enabled("batch") {
        run("batch").await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill9_loses_no_acknowledged_publish_sync_none() {
    if enabled("none") {
        run("none").await;
    }
}
