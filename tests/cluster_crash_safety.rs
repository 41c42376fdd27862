//! Crash safety of a three-node cluster of real `tether server` processes (QUIC with mutual
//! TLS, RocksDB) under kill -9 at seeded random moments, per sync mode.
//!
//! Durable subscribers with redundancy 1 (primaries spread over the nodes) consume and ack
//! while publishers put numbered values through random nodes, some with `--ack replicated`.
//! Each round kills a random node with SIGKILL (a primary, a secondary, the metadata leader or a
//! publisher's node: whatever the seed picks) in the middle of that load, keeps the load going
//! while the cluster fails over (clients fail over as applications do: the subscriber with its
//! `DedupState`, the publisher to another node), restarts the node (one round in three kills a
//! second node soon after, before the cluster has settled), then quiesces and checks:
//! - every queue has exactly one primary, and `pending == end_offset - acked_offset` there;
//! - acked offsets never go back: a queue's `acked_offset` is at least the one of the previous
//!   check and at least every ack made durable by a clean close (`close(keepalive)` answers once
//!   the queue's copies hold the ack);
//! - pending counts are exact: a subscriber resuming gets `pending` == the primary's report ==
//!   the entries replayed before the live marker, offsets without gaps;
//! - no event is delivered twice without `possible_duplicate` (a subscriber sometimes restarts
//!   with a fresh `DedupState`, as a new process would, and sees the redeliveries), nothing
//!   arrives that was never published or that its interest does not match.
//!
//! At the end every acknowledged publish must have reached every subscriber whose durable
//! interest (registered before any publish) matches it.
//!
//! Environment: `TETHER_CLUSTER_CRASH_ROUNDS` (default 3) kills per sync mode,
//! `TETHER_CRASH_SEED` (default fixed; printed on failure), `TETHER_CRASH_SYNC` (default
//! `always,batch`). `make crash-test` runs a long version with a fresh seed.
// The checks hold the world's locks across awaits on purpose: no worker runs by then.
#![allow(clippy::await_holding_lock)]

mod common;

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tether::client::{Client, ClientBuilder, ClientEvent, DedupState, Event, EventStream};
use tether::protocol::{PublishAck, QueueReport, QueueStatus};
use tokio::sync::watch;

use common::cluster::ProcCluster;
use common::crash::{
    PUBLISHERS, Rng, check, env_u64, key_of, next_publish, or_stop, parse_value, subs, value_of,
};

const DEFAULT_SEED: u64 = 0x00c1_05e7_2026_1201;
const NODES: usize = 3;
const REGION: &str = "R";
/// Upper bound for the cluster to settle (a failover, a restart, a reconnect).
const SETTLE: Duration = Duration::from_secs(60);
/// Connection failure timeout of every client: a killed node is noticed within this.
const FAILURE_TIMEOUT: Duration = Duration::from_secs(3);

#[derive(Default)]
struct PubModel {
    /// Acknowledged publishes.
    acked: BTreeMap<(u64, u64), String>,
    /// Publishes whose answer never came or was an error: may or may not be applied.
    uncertain: BTreeMap<(u64, u64), String>,
    next: [u64; PUBLISHERS as usize],
    /// Replicated-ack publishes refused with `unavailable` (a copy's node died meanwhile).
    replicated_unavailable: u64,
}

#[derive(Default)]
struct SubModel {
    /// Event id → value of every event received.
    ids: HashMap<String, String>,
    /// Values received.
    values: HashSet<String>,
    /// The highest offset acknowledged by a clean close (`close(keepalive)` answered).
    durable_ack_floor: u64,
    /// `acked_offset` of the primary at the previous check.
    acked_at_check: u64,
    events: u64,
    flagged: u64,
    sessions: u64,
    failovers: u64,
    fresh_processes: u64,
}

struct World {
    seed: u64,
    sync: String,
    ca: std::path::PathBuf,
    addrs: Vec<std::net::SocketAddr>,
    /// Which nodes are running (clients only dial those).
    running: Mutex<[bool; NODES]>,
    /// Bumped at each kill of node i: a publish that saw its node's generation change may fail.
    generation: [AtomicU64; NODES],
    pubs: Mutex<PubModel>,
    subs: Vec<Mutex<SubModel>>,
    failures: Mutex<Vec<String>>,
}

impl World {
    fn fail(&self, msg: String) {
        eprintln!("cluster_crash_safety FAILURE (sync {}): {msg}", self.sync);
        self.failures.lock().unwrap().push(msg);
    }

    fn running_nodes(&self) -> Vec<usize> {
        let r = self.running.lock().unwrap();
        (0..NODES).filter(|&i| r[i]).collect()
    }

    /// A builder dialing the running nodes, starting at `first` (if running).
    fn builder(&self, first: usize) -> ClientBuilder {
        let mut nodes = self.running_nodes();
        if let Some(pos) = nodes.iter().position(|&i| i == first) {
            nodes.rotate_left(pos);
        }
        ClientBuilder::new()
            .servers(nodes.into_iter().map(|i| self.addrs[i]))
            .ca_file(&self.ca)
            .failure_timeout(FAILURE_TIMEOUT)
    }
}

/// Records one received event for subscriber `i`; checks duplicates and provenance.
fn record_event(world: &World, i: usize, ev: &Event, last_offset: &mut u64) {
    let spec = &subs()[i];
    let value = ev
        .value
        .as_ref()
        .map(|v| String::from_utf8_lossy(v).into_owned())
        .unwrap_or_default();
    let id = ev.event_id.to_string();
    check!(
        world,
        ev.offset > *last_offset,
        "{}: offset {} after {} in one session",
        spec.id,
        ev.offset,
        last_offset
    );
    *last_offset = ev.offset;
    {
        let pubs = world.pubs.lock().unwrap();
        let issued = parse_value(&value).is_some_and(|(p, n)| {
            p < PUBLISHERS && n < pubs.next[p as usize] && key_of(p, n) == ev.key
        });
        check!(
            world,
            issued,
            "{}: event {id} {}={value:?} was never published",
            spec.id,
            ev.key
        );
    }
    check!(
        world,
        (spec.matches)(&ev.key),
        "{}: event for {} does not match its interest",
        spec.id,
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
            spec.id
        );
        check!(
            world,
            ev.possible_duplicate,
            "{}: event {id} ({}={value}, offset {}) delivered twice without possible_duplicate",
            spec.id,
            ev.key,
            ev.offset
        );
    } else if m.values.contains(&value) {
        world.fail(format!(
            "{}: value {value} arrived again under another event id {id} (offset {})",
            spec.id, ev.offset
        ));
    }
    m.ids.insert(id, value.clone());
    m.values.insert(value);
}

// ---------------------------------------------------------------------------------------------
// Publishers
// ---------------------------------------------------------------------------------------------

/// Publishes numbered values through a random running node until stopped; moves to another
/// node when its connection fails.
async fn publisher(world: Arc<World>, p: u64, mut rng: Rng, mut stop: watch::Receiver<bool>) {
    'connect: while !*stop.borrow() {
        let nodes = world.running_nodes();
        let node = nodes[rng.below(nodes.len() as u64) as usize];
        // A kill of this node from now on explains a failed publish.
        let generation = world.generation[node].load(Ordering::SeqCst);
        let ack = if rng.below(3) == 0 {
            PublishAck::Replicated
        } else {
            PublishAck::Local
        };
        let Some(Ok(client)) = or_stop(
            &mut stop,
            ClientBuilder::new()
                .server(world.addrs[node])
                .ca_file(&world.ca)
                .failure_timeout(FAILURE_TIMEOUT)
                .publish_ack(ack)
                .connect(),
        )
        .await
        else {
            tokio::time::sleep(Duration::from_millis(50)).await;
            continue;
        };
        loop {
            let (ops, ns) = next_publish(&mut world.pubs.lock().unwrap().next, p, &mut rng, REGION);
            let ops_n = ns.len() as u64;
            let res = or_stop(&mut stop, client.publish(ops)).await;
            let failed = {
                let mut m = world.pubs.lock().unwrap();
                let ok = matches!(res, Some(Ok(_)));
                for n in ns {
                    let target = if ok { &mut m.acked } else { &mut m.uncertain };
                    target.insert((p, n), key_of(p, n));
                }
                !ok
            };
            let killed = world.generation[node].load(Ordering::SeqCst) != generation;
            match res {
                Some(Ok(count)) => {
                    check!(world, count == ops_n, "publish answered count {count}");
                }
                None => {}
                Some(Err(_)) if killed => {}
                Some(Err(e))
                    if ack == PublishAck::Replicated && e.to_string().contains("unavailable") =>
                {
                    // A copy's node died meanwhile: the publish is committed and still reaches
                    // every queue, but "every copy holds it" could not be answered in time.
                    world.pubs.lock().unwrap().replicated_unavailable += 1;
                }
                Some(Err(e)) => world.fail(format!(
                    "publisher {p}: publish ({ack:?} ack) on n{} (not killed) failed: {e}",
                    node + 1
                )),
            }
            if failed {
                client.crash();
                continue 'connect;
            }
            if rng.below(4) == 0 {
                tokio::time::sleep(Duration::from_millis(rng.below(4))).await;
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Subscribers
// ---------------------------------------------------------------------------------------------

/// Connects subscriber `i` through the running nodes (retrying while the cluster fails over).
async fn connect_sub(world: &World, i: usize, dedup: &DedupState) -> Client {
    let spec = &subs()[i];
    let start = Instant::now();
    loop {
        let res = world
            .builder(spec.home)
            .durable(spec.id, 3600)
            .redundancy(1)
            .ack_interval(Duration::from_millis(20))
            .dedup_state(dedup.clone())
            .connect()
            .await;
        match res {
            Ok(c) => return c,
            Err(e) => {
                assert!(
                    start.elapsed() < SETTLE,
                    "{} cannot reconnect for {SETTLE:?}: {e}",
                    spec.id
                );
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    }
}

/// How a subscriber's session ended.
enum Ended {
    /// The round stopped: the session was closed with keepalive (acks durable) or crashed.
    Stopped,
    /// The connection failed (its node was killed): fail over.
    Lost,
}

/// One session of subscriber `i`: ready, replay, live events, acks; ends on stop, on a lost
/// connection, or (by the seed) with a close or a crash in the middle of the load.
async fn sub_session(
    world: &World,
    i: usize,
    client: Client,
    rng: &mut Rng,
    stop: &mut watch::Receiver<bool>,
) -> (Ended, bool) {
    let spec = &subs()[i];
    check!(
        world,
        client.queue_status() == QueueStatus::Resumed,
        "{}: the queue did not survive: {:?} on {}",
        spec.id,
        client.queue_status(),
        client.node_id()
    );
    let Some(Ok(_replay_end)) = or_stop(stop, client.ready_for_events()).await else {
        client.crash();
        return (
            if *stop.borrow() {
                Ended::Stopped
            } else {
                Ended::Lost
            },
            false,
        );
    };
    let mut ev = client.events().expect("events");
    let mut last = 0u64;
    let mut committed = 0u64;
    // Leave this session on its own after this many events (a close or a crash), or never.
    let leave_after = (rng.below(3) == 0).then(|| rng.between(1, 300));
    let mut n = 0u64;
    loop {
        let next = or_stop(stop, ev.next()).await;
        match next {
            None => break,
            Some(None) => {
                drop(ev);
                client.crash();
                return (Ended::Lost, false);
            }
            Some(Some(ClientEvent::Live { .. })) => {}
            Some(Some(
                other @ (ClientEvent::Disconnected { .. } | ClientEvent::Reconnected { .. }),
            )) => {
                panic!("a session's stream yielded {other:?}")
            }
            Some(Some(ClientEvent::Event(e))) => {
                record_event(world, i, &e, &mut last);
                n += 1;
                if rng.below(8) == 0 {
                    ev.commit();
                    committed = e.offset;
                }
                if leave_after.is_some_and(|l| n >= l) {
                    break;
                }
            }
        }
    }
    // Leaving: a clean close makes the acks durable on the queue and its copies; a crash
    // (a fresh process next, without the dedup state) leaves them to chance.
    if rng.below(2) == 0 {
        ev.commit();
        let offset = last.max(committed);
        drop(ev);
        match client.close(true).await {
            Ok(()) => {
                let mut m = world.subs[i].lock().unwrap();
                m.durable_ack_floor = m.durable_ack_floor.max(offset);
            }
            Err(e) => eprintln!("{}: close failed (its node died?): {e}", spec.id),
        }
        (Ended::Stopped, false)
    } else {
        drop(ev);
        client.crash();
        (Ended::Stopped, true)
    }
}

/// Subscriber `i` for one round: sessions one after another (failing over when a node dies)
/// until stopped. Returns the dedup state to continue with.
async fn subscriber(
    world: Arc<World>,
    i: usize,
    mut dedup: DedupState,
    mut rng: Rng,
    mut stop: watch::Receiver<bool>,
) -> DedupState {
    while !*stop.borrow() {
        let Some(client) = or_stop(&mut stop, connect_sub(&world, i, &dedup)).await else {
            break;
        };
        world.subs[i].lock().unwrap().sessions += 1;
        let (ended, fresh) = sub_session(&world, i, client, &mut rng, &mut stop).await;
        match ended {
            Ended::Lost => world.subs[i].lock().unwrap().failovers += 1,
            Ended::Stopped if fresh => {
                // A new process: no memory of what it processed.
                dedup = DedupState::default();
                world.subs[i].lock().unwrap().fresh_processes += 1;
            }
            Ended::Stopped => {}
        }
        if !*stop.borrow() {
            tokio::time::sleep(Duration::from_millis(rng.below(300))).await;
        }
    }
    dedup
}

// ---------------------------------------------------------------------------------------------
// Checks
// ---------------------------------------------------------------------------------------------

/// Every running node's reports.
async fn all_reports(world: &World) -> Vec<(usize, QueueReport)> {
    let mut out = Vec::new();
    for node in world.running_nodes() {
        let c = match ClientBuilder::new()
            .server(world.addrs[node])
            .ca_file(&world.ca)
            .connect()
            .await
        {
            Ok(c) => c,
            Err(_) => continue,
        };
        if let Ok(qs) = c.queues().await {
            out.extend(qs.into_iter().map(|q| (node, q)));
        }
        let _ = c.close(false).await;
    }
    out
}

/// Waits until the cluster is quiet: each subscriber's queue has exactly one primary, its
/// copy is in sync with it (lag 0, the same acked offset), and nothing moves for a while (the
/// restarted node's publish log has been forwarded). Returns the primaries' reports.
async fn settled(world: &World) -> Vec<(usize, QueueReport)> {
    let start = Instant::now();
    let mut previous: Option<Vec<(u64, u64)>> = None;
    loop {
        let reports = all_reports(world).await;
        let mut primaries = Vec::new();
        let mut ok = true;
        for spec in subs() {
            let p: Vec<&(usize, QueueReport)> = reports
                .iter()
                .filter(|(_, q)| q.durable_id.as_deref() == Some(spec.id) && q.role == "primary")
                .collect();
            let copy_in_sync = p.first().is_some_and(|(_, q)| {
                q.copies.len() == 1
                    && q.copies[0].lag_entries == 0
                    && reports.iter().any(|(_, c)| {
                        c.durable_id.as_deref() == Some(spec.id)
                            && c.role == "secondary"
                            && c.acked_offset == q.acked_offset
                            && c.end_offset == q.end_offset
                    })
            });
            if p.len() != 1 || !copy_in_sync {
                ok = false;
            } else {
                primaries.push(p[0].clone());
            }
        }
        let now: Vec<(u64, u64)> = primaries
            .iter()
            .map(|(_, q)| (q.end_offset, q.acked_offset))
            .collect();
        if ok && previous.as_ref() == Some(&now) {
            return primaries;
        }
        previous = ok.then_some(now);
        if start.elapsed() > SETTLE {
            let view: Vec<String> = reports
                .iter()
                .map(|(n, q)| {
                    format!(
                        "n{}: {:?} {} end {} acked {} copies {:?}",
                        n + 1,
                        q.durable_id,
                        q.role,
                        q.end_offset,
                        q.acked_offset,
                        q.copies
                    )
                })
                .collect();
            panic!(
                "the cluster did not settle in {SETTLE:?} (seed {:#x}):\n{}",
                world.seed,
                view.join("\n")
            );
        }
        tokio::time::sleep(Duration::from_millis(400)).await;
    }
}

/// At a quiet moment: the primary's counts, acked offsets never going back, and (resuming the
/// subscriber as a new process, so that the library suppresses nothing) the exact pending
/// count and replay. Returns the resumed session and its dedup state.
async fn check_queue(
    world: &World,
    i: usize,
    node: usize,
    r: &QueueReport,
) -> (Client, EventStream, DedupState) {
    let spec = &subs()[i];
    {
        let mut m = world.subs[i].lock().unwrap();
        check!(
            world,
            r.state == "away",
            "{}: state {} on n{} with every client stopped",
            spec.id,
            r.state,
            node + 1
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
            r.acked_offset >= m.acked_at_check,
            "{}: acked offset went back from {} to {} (primary now n{})",
            spec.id,
            m.acked_at_check,
            r.acked_offset,
            node + 1
        );
        check!(
            world,
            r.acked_offset >= m.durable_ack_floor,
            "{}: acked offset {} is below {} acknowledged by a clean close (primary now n{})",
            spec.id,
            r.acked_offset,
            m.durable_ack_floor,
            node + 1
        );
        check!(
            world,
            !r.interests.is_empty() && r.interests.iter().all(|x| x.durable),
            "{}: durable interest {:?}",
            spec.id,
            r.interests
        );
        m.acked_at_check = r.acked_offset;
    }
    let dedup = DedupState::default();
    let c = connect_sub(world, i, &dedup).await;
    check!(
        world,
        c.queue_status() == QueueStatus::Resumed && c.pending() == Some(r.pending),
        "{}: welcome {:?} pending {:?} on {}, the primary n{} reported pending {}",
        spec.id,
        c.queue_status(),
        c.pending(),
        c.node_id(),
        node + 1,
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
    let mut prev_id = String::new();
    loop {
        let e = tokio::time::timeout(SETTLE, ev.next())
            .await
            .unwrap_or_else(|_| panic!("{}: no live marker after {replayed} events", spec.id))
            .unwrap_or_else(|| panic!("{}: stream ended during the replay", spec.id));
        match e {
            ClientEvent::Live { .. } => break,
            other @ (ClientEvent::Disconnected { .. } | ClientEvent::Reconnected { .. }) => {
                panic!("a session's stream yielded {other:?}")
            }
            ClientEvent::Event(e) => {
                check!(
                    world,
                    e.offset == last + 1 && e.replayed,
                    "{}: replayed offset {} (replayed {}, event {} {}) after {last} (event {})",
                    spec.id,
                    e.offset,
                    e.replayed,
                    e.event_id,
                    e.key,
                    prev_id
                );
                prev_id = e.event_id.to_string();
                let mut l = last;
                record_event(world, i, &e, &mut l);
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
    (c, ev, dedup)
}

/// Every acknowledged publish reached every subscriber whose interest matches it.
fn check_complete(world: &World) {
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
}

// ---------------------------------------------------------------------------------------------
// The run
// ---------------------------------------------------------------------------------------------

async fn run(sync: &str) {
    let rounds = env_u64("TETHER_CLUSTER_CRASH_ROUNDS").unwrap_or(3);
    let seed = env_u64("TETHER_CRASH_SEED").unwrap_or(DEFAULT_SEED);
    let mut rng = Rng::new(
        seed ^ 0x005e_edc1_u64
            ^ sync
                .bytes()
                .fold(0u64, |h, b| h.wrapping_mul(31).wrapping_add(b as u64)),
    );
    let started = Instant::now();
    let mut cluster = ProcCluster::start_with_config(NODES, &format!("sync = \"{sync}\"\n"));
    let world = Arc::new(World {
        seed,
        sync: sync.to_string(),
        ca: cluster.get(0).ca.clone(),
        addrs: (0..NODES).map(|i| cluster.addr(i)).collect(),
        running: Mutex::new([true; NODES]),
        generation: Default::default(),
        pubs: Mutex::new(PubModel::default()),
        subs: subs()
            .iter()
            .map(|_| Mutex::new(SubModel::default()))
            .collect(),
        failures: Mutex::new(Vec::new()),
    });
    // Durable interest registered before any publish, each queue first placed on its home.
    let mut dedups = Vec::new();
    for spec in subs() {
        let start = Instant::now();
        let c = loop {
            match ClientBuilder::new()
                .server(world.addrs[spec.home])
                .ca_file(&world.ca)
                .durable(spec.id, 3600)
                .redundancy(1)
                .connect()
                .await
            {
                Ok(c) => break c,
                // No metadata leader yet.
                Err(e) if start.elapsed() < SETTLE => {
                    let _ = e;
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
                Err(e) => panic!("{} connects: {e}", spec.id),
            }
        };
        assert_eq!(c.queue_status(), QueueStatus::New);
        assert_eq!(c.node_id(), format!("n{}", spec.home + 1));
        c.region(REGION)
            .register((spec.interest)())
            .await
            .expect("register");
        c.ready_for_events().await.expect("ready");
        let mut ev = c.events().unwrap();
        common::until_live(&mut ev, REGION).await;
        drop(ev);
        c.close(true).await.expect("close");
        dedups.push(DedupState::default());
    }
    let mut kills = Vec::new();
    for round in 0..rounds {
        let (stop_tx, stop_rx) = watch::channel(false);
        let mut sub_tasks = Vec::new();
        for (i, d) in dedups.drain(..).enumerate() {
            sub_tasks.push(tokio::spawn(subscriber(
                world.clone(),
                i,
                d,
                Rng::new(rng.next()),
                stop_rx.clone(),
            )));
        }
        let mut pub_tasks = Vec::new();
        for p in 0..PUBLISHERS {
            pub_tasks.push(tokio::spawn(publisher(
                world.clone(),
                p,
                Rng::new(rng.next()),
                stop_rx.clone(),
            )));
        }
        // Load, then the kill at a random moment. The load goes on while the cluster fails
        // over, for a random while, then the node comes back (on its data directory and
        // port). One round in three kills a second node soon after, before the cluster has
        // settled (a copy may still be syncing, the new primary may be the victim).
        let kills_this_round = if rng.below(3) == 0 { 2 } else { 1 };
        for _ in 0..kills_this_round {
            tokio::time::sleep(Duration::from_millis(rng.between(300, 1_500))).await;
            let victim = rng.below(NODES as u64) as usize;
            world.running.lock().unwrap()[victim] = false;
            world.generation[victim].fetch_add(1, Ordering::SeqCst);
            cluster.kill9(victim);
            let away_ms = rng.between(200, 5_000);
            tokio::time::sleep(Duration::from_millis(away_ms)).await;
            cluster.restart(victim);
            world.running.lock().unwrap()[victim] = true;
            kills.push(format!("round {round}: n{} for {away_ms} ms", victim + 1));
        }
        tokio::time::sleep(Duration::from_millis(rng.between(300, 1_500))).await;
        // Quiesce: clients stop (subscribers close with keepalive or crash).
        let _ = stop_tx.send(true);
        for t in pub_tasks {
            tokio::time::timeout(SETTLE, t)
                .await
                .expect("publishers stop")
                .expect("publisher task");
        }
        for t in sub_tasks {
            // The subscriber's own dedup state is dropped: the check resumes as a new process.
            tokio::time::timeout(SETTLE, t)
                .await
                .expect("subscribers stop")
                .expect("subscriber task");
        }
        let primaries = settled(&world).await;
        let last = round + 1 == rounds;
        for (i, (node, r)) in primaries.iter().enumerate() {
            let (c, ev, dedup) = check_queue(&world, i, *node, r).await;
            drop(ev);
            // Everything replayed was processed: the clean close makes the acks durable.
            c.close(true).await.expect("close after the check");
            let mut m = world.subs[i].lock().unwrap();
            m.durable_ack_floor = m.durable_ack_floor.max(r.end_offset);
            dedups.push(dedup);
        }
        if last {
            check_complete(&world);
        }
        let failures = world.failures.lock().unwrap();
        assert!(
            failures.is_empty(),
            "sync {sync}: round {round} (kills {kills:?}) failed; replay with \
             TETHER_CRASH_SEED={seed:#x} TETHER_CLUSTER_CRASH_ROUNDS={rounds}:\n{}",
            failures.join("\n")
        );
    }
    let pubs = world.pubs.lock().unwrap();
    let per_sub = |f: fn(&SubModel) -> u64| -> Vec<u64> {
        world.subs.iter().map(|m| f(&m.lock().unwrap())).collect()
    };
    eprintln!(
        "cluster sync {sync} seed {seed:#x}: {rounds} rounds, {} kills {kills:?} in {:.1}s; {} acked \
         publishes, {} uncertain, {} replicated acks refused as unavailable; per subscriber \
         events {:?}, flagged {:?}, sessions {:?}, failovers {:?}, fresh processes {:?}",
        kills.len(),
        started.elapsed().as_secs_f64(),
        pubs.acked.len(),
        pubs.uncertain.len(),
        pubs.replicated_unavailable,
        per_sub(|m| m.events),
        per_sub(|m| m.flagged),
        per_sub(|m| m.sessions),
        per_sub(|m| m.failovers),
        per_sub(|m| m.fresh_processes),
    );
    assert!(
        !pubs.acked.is_empty(),
        "no publish was acknowledged: the test proved nothing"
    );
}

fn enabled(sync: &str) -> bool {
    match std::env::var("TETHER_CRASH_SYNC") {
        Ok(v) => v.split(',').any(|s| s.trim() == sync),
        Err(_) => sync != "none",
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_kill9_loses_no_acknowledged_publish_sync_always() {
    if enabled("always") {
        run("always").await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_kill9_loses_no_acknowledged_publish_sync_batch() {
    if enabled("batch") {
        run("batch").await;
    }
}
