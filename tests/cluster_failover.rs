//! Queue copies and failover in a cluster of three real `tether server` processes (QUIC with
//! mutual TLS, RocksDB), the primary killed with SIGKILL: Geode's group G with Tether's
//! stronger outcomes. With redundancy 1 a durable queue survives the death of its primary
//! whether its client is away (G2: Geode loses the queue) or online (G1/G4: the client fails
//! over, nothing is lost, redelivered events are flagged, the live marker is not repeated).

mod common;

use std::collections::HashSet;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use tether::client::{
    Client, ClientBuilder, ClientEvent, DedupState, Event, EventStream, Interest,
};
use tether::control::reconcile::rendezvous_key;
use tether::protocol::{PublishAck, PublishOp, QueueReport, QueueStatus};

use common::cluster::ProcCluster;

/// Operations per publish request.
const OPS_PER_PUBLISH: u32 = 50;
/// How long a failover may take before a test gives up.
const FAILOVER_WAIT: Duration = Duration::from_secs(60);

/// Publishes puts `k-{from..to}` of region R (value = the number) through `builder`, each
/// request acknowledged before the next; returns how many were acknowledged.
async fn publish(builder: ClientBuilder, from: u32, to: u32, progress: Arc<AtomicU32>) -> u32 {
    common::cluster::publish_numbered(builder, from, to, OPS_PER_PUBLISH, &progress).await
}

/// The reports of node `i` (through a plain admin connection).
async fn queues(p: &ProcCluster, i: usize) -> Vec<QueueReport> {
    let c = p.get(i).builder().connect().await.expect("admin connects");
    let q = c.queues().await.expect("queues");
    c.close(false).await.ok();
    q
}

async fn report(p: &ProcCluster, i: usize, id: &str, role: &str) -> Option<QueueReport> {
    queues(p, i)
        .await
        .into_iter()
        .find(|q| q.durable_id.as_deref() == Some(id) && q.role == role)
}

/// Waits until `f` holds, polling.
async fn wait_for<T, F: std::future::Future<Output = Option<T>>>(
    what: &str,
    mut f: impl FnMut() -> F,
) -> T {
    let start = std::time::Instant::now();
    loop {
        if let Some(v) = f().await {
            return v;
        }
        assert!(
            start.elapsed() < FAILOVER_WAIT,
            "timed out waiting for: {what}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// The number a test publisher put in an event's value.
fn value(e: &Event) -> u32 {
    std::str::from_utf8(e.value.as_deref().expect("values"))
        .unwrap()
        .parse()
        .unwrap()
}

/// The next `n` events of `ev` (live markers skipped); panics if the stream ends or stalls.
async fn receive(ev: &mut EventStream, n: usize) -> Vec<Event> {
    let mut out = Vec::with_capacity(n);
    while out.len() < n {
        match tokio::time::timeout(FAILOVER_WAIT, ev.next()).await {
            Ok(Some(ClientEvent::Event(e))) => out.push(e),
            Ok(Some(ClientEvent::Live { .. })) => {}
            other => panic!("the stream ended or stalled: {other:?}"),
        }
    }
    out
}

/// Connects durable client "d" through the running nodes among `via` until the session it gets
/// passes `ok` (a session that does not is closed with keepalive and tried again).
async fn reconnect_until(
    p: &ProcCluster,
    via: &[usize],
    what: &str,
    ok: impl Fn(&Client) -> bool,
) -> Client {
    wait_for(what, || async {
        let c = p.builder(via).durable("d", 600).connect().await.ok()?;
        if ok(&c) {
            return Some(c);
        }
        c.close(true).await.ok();
        None
    })
    .await
}

/// A durable client `id` with redundancy 1 and interest in all keys of R, placed on node 0.
async fn durable_on_n1(p: &ProcCluster, id: &str) -> Client {
    durable_on(p, 0, id).await
}

/// A durable client `id` with redundancy 1 and interest in all keys of R, placed on node `i`.
async fn durable_on(p: &ProcCluster, i: usize, id: &str) -> Client {
    let c = p
        .get(i)
        .builder()
        .durable(id, 600)
        .redundancy(1)
        .failure_timeout(Duration::from_secs(3))
        .ack_interval(Duration::from_millis(20))
        .connect()
        .await
        .expect("durable client connects");
    assert_eq!(c.node_id(), format!("n{}", i + 1));
    c.region("R").register(Interest::all_keys()).await.unwrap();
    c
}

/// Durable client "d" connects again with `dedup` after losing its primary (client-managed
/// failover: the library goes to the queue's copies first), through node `via` otherwise.
async fn fail_over(p: &ProcCluster, via: usize, dedup: &DedupState) -> Client {
    wait_for("the client's failover", || async {
        p.builder(&[via])
            .durable("d", 600)
            .failure_timeout(Duration::from_secs(2))
            .ack_interval(Duration::from_millis(20))
            .dedup_state(dedup.clone())
            .connect()
            .await
            .map_err(|e| eprintln!("failover attempt: {e}"))
            .ok()
    })
    .await
}

/// The node (index) holding the copy of `id`, from the primary's report once it is in sync.
async fn in_sync_secondary(p: &ProcCluster, primary: usize, id: &str, end: u64) -> usize {
    let r = wait_for("the copy to catch up", || async {
        report(p, primary, id, "primary")
            .await
            .filter(|r| r.end_offset == end && r.copies.len() == 1 && r.copies[0].lag_entries == 0)
    })
    .await;
    p.index(&r.copies[0].node)
}

/// Three nodes whose links go through UDP relays: `cut_of(i, j)` is the flag that cuts the
/// link from node `i` to node `j` (None: a direct link). Clients reach every node directly.
async fn routed_cluster(
    cut_of: impl Fn(usize, usize) -> Option<Arc<std::sync::atomic::AtomicBool>>,
) -> ProcCluster {
    routed_cluster_with(false, cut_of).await
}

/// [`routed_cluster`], its nodes serving `/metrics` when `observed` (to learn the leader).
async fn routed_cluster_with(
    observed: bool,
    cut_of: impl Fn(usize, usize) -> Option<Arc<std::sync::atomic::AtomicBool>>,
) -> ProcCluster {
    let ports = common::cluster::free_ports(3);
    let mut routes = vec![vec![None; 3]; 3];
    for (i, row) in routes.iter_mut().enumerate() {
        for (j, route) in row.iter_mut().enumerate() {
            if i == j {
                continue;
            }
            if let Some(cut) = cut_of(i, j) {
                let target: std::net::SocketAddr =
                    format!("127.0.0.1:{}", ports[j]).parse().unwrap();
                *route = Some(common::relay_with(target, cut).await);
            }
        }
    }
    match observed {
        true => ProcCluster::start_routed_observed(ports, routes),
        false => ProcCluster::start_routed(ports, routes),
    }
}

/// One cut flag per pair of the three nodes, shared by the relays of both directions.
#[derive(Clone)]
struct PairCuts(Vec<Arc<std::sync::atomic::AtomicBool>>);

impl PairCuts {
    fn new() -> PairCuts {
        PairCuts((0..3).map(|_| Arc::default()).collect())
    }

    /// The flag of the link between nodes `i` and `j` (i ≠ j): (0,1), (0,2), (1,2) in order.
    fn flag(&self, i: usize, j: usize) -> &Arc<std::sync::atomic::AtomicBool> {
        &self.0[i + j - 1]
    }

    fn set(&self, i: usize, j: usize, cut: bool) {
        self.flag(i, j).store(cut, Ordering::SeqCst);
    }

    fn heal_all(&self) {
        for f in &self.0 {
            f.store(false, Ordering::SeqCst);
        }
    }
}

/// Three nodes whose every link can be cut ([`PairCuts`]), serving `/metrics` when
/// `observed`.
async fn pair_routed_cluster(observed: bool) -> (ProcCluster, PairCuts) {
    let cuts = PairCuts::new();
    let p = routed_cluster_with(observed, |i, j| Some(cuts.flag(i, j).clone())).await;
    (p, cuts)
}

/// A reconnecting subscription of durable client "d" (redundancy 1, interest in all keys of
/// R) knowing every node, first placed on the first that answers (n1), noticing a lost
/// connection after `failure_timeout` and waiting at most `delay_max` between attempts.
async fn subscribe_d(
    p: &ProcCluster,
    failure_timeout: Duration,
    delay_max: Duration,
) -> tether::client::Subscription {
    let policy = tether::client::ReconnectPolicy {
        delay_initial: Duration::from_millis(100),
        delay_max,
        ..Default::default()
    };
    p.builder(&[0, 1, 2])
        .durable("d", 600)
        .redundancy(1)
        .failure_timeout(failure_timeout)
        .ack_interval(Duration::from_millis(20))
        .reconnect(policy)
        .subscribe([("R".to_string(), Interest::all_keys())])
        .await
        .expect("the subscription starts")
}

/// Notes the value of `e` in `seen`; an event received again must be flagged.
fn note_event(seen: &mut HashSet<u32>, e: &Event) {
    let v = value(e);
    assert!(
        seen.insert(v) || e.possible_duplicate,
        "event {v} received twice without the possible-duplicate flag"
    );
}

/// Notes an event received after a cut (`next`, read within the test's wait) in `seen`;
/// returns what is neither an event nor a live marker, and panics if the stream ended or
/// stalled with fewer than `total` events seen.
fn note_after_cut(
    next: Result<Option<ClientEvent>, tokio::time::error::Elapsed>,
    seen: &mut HashSet<u32>,
    total: u32,
    cut_at: std::time::Instant,
) -> Option<ClientEvent> {
    match next {
        Ok(Some(ClientEvent::Event(e))) => note_event(seen, &e),
        Ok(Some(ClientEvent::Live { .. })) => {}
        Ok(Some(other)) => return Some(other),
        end => panic!(
            "{} of {total} events {:?} after the cut: {end:?}",
            seen.len(),
            cut_at.elapsed()
        ),
    }
    None
}

/// G1 (copies exist and follow the primary): a queue with redundancy 1 has a copy on another
/// node holding every entry, its interest and its acked offset; both report it. G11: the
/// client's acks remove the entries from the copy too (nothing pending there). G6/G9: a
/// reconnect through a node that holds nothing lands on the same primary and copy.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn g1_copy_holds_the_queue_and_reports_lag() {
    let p = ProcCluster::start(3);
    let d = durable_on_n1(&p, "d").await;
    d.ready_for_events().await.unwrap();
    let mut ev = d.events().unwrap();
    let progress = Arc::new(AtomicU32::new(0));
    assert_eq!(publish(p.get(1).builder(), 0, 1_000, progress).await, 1_000);
    receive(&mut ev, 1_000).await;
    ev.commit();
    drop(ev);
    d.ack_now().await.unwrap();
    d.close(true).await.unwrap();
    let secondary = in_sync_secondary(&p, 0, "d", 1_000).await;
    assert_ne!(secondary, 0);
    let copy = wait_for("the copy to learn the ack", || async {
        report(&p, secondary, "d", "secondary")
            .await
            .filter(|c| c.acked_offset == 1_000 && c.state == "away")
    })
    .await;
    assert_eq!((copy.pending, copy.end_offset), (0, 1_000));
    assert_eq!(copy.primary.as_deref(), Some("n1"));
    assert_eq!(copy.interests.len(), 1, "the durable interest is copied");
    // The third node holds nothing of it.
    let third = (0..3).find(|&i| i != 0 && i != secondary).unwrap();
    assert!(
        queues(&p, third)
            .await
            .iter()
            .all(|q| q.durable_id.as_deref() != Some("d"))
    );
    // G6/G9: coming back through the node that holds nothing, the client is redirected to the
    // same primary, and the queue keeps its servers.
    let d = reconnect_until(&p, &[third], "a reconnect", |_| true).await;
    assert_eq!(
        (d.node_id(), d.queue_status()),
        ("n1", QueueStatus::Resumed)
    );
    let servers: Vec<(String, bool)> = d
        .queue_servers()
        .iter()
        .map(|s| (s.node_id.clone(), s.primary))
        .collect();
    assert_eq!(
        servers,
        [
            ("n1".to_string(), true),
            (format!("n{}", secondary + 1), false)
        ]
    );
    d.close(true).await.unwrap();
}

/// G2, stronger than Geode: the client is away when its primary is killed; the copy becomes
/// primary, keeps queueing (also the events published while the failure was being detected),
/// and the client, coming back through another node, finds its queue `resumed` with the exact
/// pending count and every event once, in order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn g2_away_queue_survives_kill_9_of_its_primary() {
    const BEFORE: u32 = 3_000;
    const TOTAL: u32 = 8_000;
    let mut p = ProcCluster::start(3);
    let d = durable_on_n1(&p, "d").await;
    d.ready_for_events().await.unwrap();
    d.close(true).await.unwrap();
    let progress = Arc::new(AtomicU32::new(0));
    assert_eq!(
        publish(p.get(1).builder(), 0, BEFORE, progress.clone()).await,
        BEFORE
    );
    let secondary = in_sync_secondary(&p, 0, "d", u64::from(BEFORE)).await;
    // Keep publishing through a node that stays up while n1 dies.
    let via = if secondary == 1 { 2 } else { 1 };
    let publisher = tokio::spawn(publish(
        p.get(via).builder(),
        BEFORE,
        TOTAL,
        progress.clone(),
    ));
    while progress.load(Ordering::SeqCst) < BEFORE + 500 {
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    p.kill9(0);
    assert_eq!(publisher.await.unwrap(), TOTAL);
    let promoted = wait_for("the copy to be promoted", || async {
        report(&p, secondary, "d", "primary").await
    })
    .await;
    assert!(promoted.pending >= u64::from(BEFORE));
    // Back through the other surviving node: it redirects to the new primary.
    let other = (1..3).find(|&i| i != secondary).unwrap();
    let d = reconnect_until(&p, &[other], "the queue to be pending in full", |c| {
        c.pending() == Some(u64::from(TOTAL))
    })
    .await;
    assert_eq!(d.queue_status(), QueueStatus::Resumed);
    assert_eq!(d.node_id(), format!("n{}", secondary + 1));
    d.ready_for_events().await.unwrap();
    let mut ev = d.events().unwrap();
    let mut values = Vec::new();
    let mut lives = 0;
    while lives == 0 {
        match tokio::time::timeout(FAILOVER_WAIT, ev.next()).await {
            Ok(Some(ClientEvent::Event(e))) => values.push(value(&e)),
            Ok(Some(ClientEvent::Live { .. })) => lives += 1,
            other => panic!("stream ended before live: {other:?}"),
        }
    }
    let expected: Vec<u32> = (0..TOTAL).collect();
    assert_eq!(values.len(), expected.len(), "every event once");
    assert_eq!(values, expected, "in publisher order");
}

/// G1/G4 with a kill -9 during the stream: the online client's primary dies; the client
/// reconnects through the other nodes (same process, same duplicate state), resumes on the
/// promoted copy from its acked offset, gets the unacked events again flagged
/// `possible_duplicate` (dropped by the library when already processed), loses nothing, and
/// sees the live marker once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn g4_online_client_fails_over_on_kill_9_of_its_primary() {
    let total: u32 = std::env::var("TETHER_FAILOVER_EVENTS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(100_000);
    let mut p = ProcCluster::start(3);
    let d = durable_on_n1(&p, "d").await;
    d.ready_for_events().await.unwrap();
    let dedup: DedupState = d.dedup_state();
    let progress = Arc::new(AtomicU32::new(0));
    let publisher = tokio::spawn(publish(p.get(1).builder(), 0, total, progress.clone()));
    let mut fresh: Vec<u32> = Vec::new();
    let mut seen: HashSet<u32> = HashSet::new();
    let mut flagged = 0u64;
    let mut lives = 0;
    let mut killed = false;
    let mut client = Some(d);
    let mut reconnects = 0;
    let mut last_offset = 0;
    while fresh.len() < total as usize {
        let c = match client.take() {
            Some(c) => c,
            None => {
                reconnects += 1;
                assert!(reconnects < 20, "too many reconnects");
                let c = wait_for("a reconnect to the new primary", || async {
                    p.builder(&[1, 2])
                        .durable("d", 600)
                        .failure_timeout(Duration::from_secs(3))
                        .ack_interval(Duration::from_millis(20))
                        .dedup_state(dedup.clone())
                        .connect()
                        .await
                        .ok()
                })
                .await;
                assert_eq!(c.queue_status(), QueueStatus::Resumed, "the queue survived");
                eprintln!(
                    "reconnected to {} with {:?} pending",
                    c.node_id(),
                    c.pending()
                );
                c.ready_for_events().await.unwrap();
                c
            }
        };
        let mut ev = c.events().unwrap();
        loop {
            if !killed && fresh.len() as u32 >= total / 3 {
                p.kill9(0);
                killed = true;
                eprintln!(
                    "killed n1 at {} fresh events, {} published, last offset {last_offset}",
                    fresh.len(),
                    progress.load(Ordering::SeqCst)
                );
            }
            let next = tokio::time::timeout(FAILOVER_WAIT, ev.next()).await;
            match next {
                Ok(Some(ClientEvent::Event(e))) => {
                    let v = value(&e);
                    last_offset = e.offset;
                    if seen.contains(&v) {
                        assert!(e.possible_duplicate, "an unflagged duplicate: {v}");
                        flagged += 1;
                    } else {
                        seen.insert(v);
                        fresh.push(v);
                    }
                    ev.commit();
                    if fresh.len() == total as usize {
                        break;
                    }
                }
                Ok(Some(ClientEvent::Live { .. })) => lives += 1,
                Ok(Some(other)) => panic!("a session's stream yielded {other:?}"),
                Ok(None) => {
                    eprintln!(
                        "stream ended after {} fresh events, last offset {last_offset}",
                        fresh.len()
                    );
                    break; // The connection died: fail over.
                }
                Err(_) => panic!("no event for {FAILOVER_WAIT:?}"),
            }
        }
        drop(ev);
        if fresh.len() == total as usize {
            c.close(true).await.ok();
        }
    }
    assert!(killed, "the primary was killed during the stream");
    assert_eq!(publisher.await.unwrap(), total);
    assert_eq!(lives, 1, "the live marker is seen once");
    let disorder = fresh.windows(2).position(|w| w[1] < w[0]);
    assert_eq!(disorder, None, "events of one publisher stay in order");
    eprintln!("failover: {reconnects} reconnect(s), {flagged} flagged redeliveries shown");
}

/// `--ack replicated`: once the publish is acknowledged, the copy of the matching queue holds
/// it (its report shows it at once); `--ack local` returns after the local commit.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replicated_ack_returns_once_the_copy_holds_the_events() {
    let p = ProcCluster::start(3);
    let d = durable_on_n1(&p, "d").await;
    d.ready_for_events().await.unwrap();
    d.close(true).await.unwrap();
    let secondary = in_sync_secondary(&p, 0, "d", 0).await;
    let publisher = p
        .get(2)
        .builder()
        .publish_ack(tether::protocol::PublishAck::Replicated)
        .connect()
        .await
        .unwrap();
    for round in 1..=5u64 {
        let ops = (0..100)
            .map(|i| PublishOp::Put {
                region: "R".into(),
                key: format!("k-{round}-{i}"),
                value: b"v".to_vec(),
            })
            .collect();
        assert_eq!(publisher.publish(ops).await.unwrap(), 100);
        let copy = report(&p, secondary, "d", "secondary")
            .await
            .expect("the copy exists");
        assert!(
            copy.end_offset >= round * 100,
            "acknowledged as replicated, but the copy ends at {} after round {round}",
            copy.end_offset
        );
    }
}

/// G7 and rejoin: with redundancy 2 on three nodes, the primary is killed and restarted; the
/// promoted copy serves the queue meanwhile, and the restarted node rejoins as a secondary,
/// receives the queue (snapshot and tail) and catches up; then the queue survives the death
/// of the new primary too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn g7_killed_primary_rejoins_as_a_secondary_and_catches_up() {
    let mut p = ProcCluster::start(3);
    let c = p
        .get(0)
        .builder()
        .durable("d", 600)
        .redundancy(2)
        .connect()
        .await
        .unwrap();
    c.region("R").register(Interest::all_keys()).await.unwrap();
    c.ready_for_events().await.unwrap();
    c.close(true).await.unwrap();
    let progress = Arc::new(AtomicU32::new(0));
    assert_eq!(
        publish(p.get(1).builder(), 0, 2_000, progress.clone()).await,
        2_000
    );
    wait_for("both copies in sync", || async {
        report(&p, 0, "d", "primary")
            .await
            .filter(|r| r.copies.len() == 2 && r.copies.iter().all(|c| c.lag_entries == 0))
    })
    .await;
    p.kill9(0);
    let (primary, _) = wait_for("a copy promoted", || async {
        for i in 1..3 {
            if let Some(r) = report(&p, i, "d", "primary").await {
                return Some((i, r));
            }
        }
        None
    })
    .await;
    assert_eq!(
        publish(p.get(1).builder(), 2_000, 3_000, progress.clone()).await,
        3_000
    );
    p.restart(0);
    let r = wait_for("the restarted node to catch up as a secondary", || async {
        report(&p, primary, "d", "primary").await.filter(|r| {
            r.end_offset == 3_000
                && r.copies.len() == 2
                && r.copies.iter().all(|c| c.lag_entries == 0)
                && r.copies.iter().any(|c| c.node == "n1")
        })
    })
    .await;
    assert_eq!(r.pending, 3_000);
    let bytes = r
        .pending_bytes
        .expect("a primary reports its pending bytes");
    let copy = report(&p, 0, "d", "secondary")
        .await
        .expect("n1 holds a copy");
    assert_eq!((copy.end_offset, copy.pending), (3_000, 3_000));
    // The queue survives its second primary's death as well.
    p.kill9(primary);
    let survivors: Vec<usize> = (0..3).filter(|&i| i != primary).collect();
    let d = reconnect_until(&p, &survivors, "the queue to come back", |c| {
        c.pending() == Some(3_000)
    })
    .await;
    assert_eq!(d.queue_status(), QueueStatus::Resumed);
    // The promoted copy counted the same bytes as the primary it replaces (its byte limit
    // holds across the failover).
    let mut promoted = None;
    for &i in &survivors {
        promoted = promoted.or(report(&p, i, "d", "primary").await);
    }
    let promoted = promoted.expect("a survivor holds the queue");
    assert_eq!(promoted.pending_bytes, Some(bytes));
}

/// A partition, made by UDP relays on every link between the primary (n1) and its peers that
/// drop every datagram while cut (clients still reach n1): the cut-off primary stops delivering
/// once its lease runs out, before the promoted copy delivers anything (at most one primary
/// delivers at a time); after healing, the old primary steps down, and no acknowledged event is
/// lost.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn partitioned_primary_stops_delivering_before_the_new_one_starts() {
    use std::sync::atomic::AtomicBool;
    const BEFORE: u32 = 20_000;
    const TOTAL: u32 = 23_000;
    let cut = Arc::new(AtomicBool::new(false));
    // Every link between n1 and its peers.
    let p = routed_cluster(|i, j| (i == 0 || j == 0).then(|| cut.clone())).await;
    // Client A on n1, registered but not ready: a backlog waits on n1 and on its copy.
    let a = durable_on_n1(&p, "d").await;
    let progress = Arc::new(AtomicU32::new(0));
    assert_eq!(
        publish(p.get(1).builder(), 0, BEFORE, progress.clone()).await,
        BEFORE
    );
    let secondary = in_sync_secondary(&p, 0, "d", u64::from(BEFORE)).await;
    cut.store(true, Ordering::SeqCst);
    let cut_at = std::time::Instant::now();
    // A now asks for its events: n1 delivers at most until its lease runs out.
    a.ready_for_events().await.unwrap();
    let mut a_events = a.events().unwrap();
    let a_last = Arc::new(std::sync::Mutex::new(None::<std::time::Instant>));
    let a_reader = tokio::spawn({
        let a_last = a_last.clone();
        async move {
            let mut n = 0u32;
            while let Some(ev) = a_events.next().await {
                if let ClientEvent::Event(_) = ev {
                    n += 1;
                    *a_last.lock().unwrap() = Some(std::time::Instant::now());
                }
            }
            n
        }
    });
    // More publishes through a node on the majority side, during the partition.
    let via = if secondary == 1 { 2 } else { 1 };
    assert_eq!(
        publish(p.get(via).builder(), BEFORE, TOTAL, progress.clone()).await,
        TOTAL
    );
    // Client B reaches the promoted copy through the majority side.
    let b = reconnect_until(
        &p,
        &[secondary],
        "the promoted copy to take client B",
        |c| c.node_id() == format!("n{}", secondary + 1),
    )
    .await;
    b.ready_for_events().await.unwrap();
    let mut b_events = b.events().unwrap();
    let mut b_first = None;
    let mut b_values = HashSet::new();
    while b_values.len() < TOTAL as usize {
        match tokio::time::timeout(FAILOVER_WAIT, b_events.next()).await {
            Ok(Some(ClientEvent::Event(e))) => {
                b_first.get_or_insert_with(std::time::Instant::now);
                let v = value(&e);
                b_values.insert(v);
            }
            Ok(Some(_)) => {}
            other => panic!("B's stream ended: {other:?}"),
        }
    }
    b_events.commit();
    let b_first = b_first.expect("B received events");
    if let Some(a_last) = *a_last.lock().unwrap() {
        assert!(
            a_last < b_first,
            "the old primary delivered {:?} after the new one started",
            a_last - b_first
        );
        assert!(
            a_last.duration_since(cut_at) < Duration::from_millis(3_000),
            "the cut-off primary kept delivering {:?} after the cut",
            a_last.duration_since(cut_at)
        );
    }
    // Heal: the old primary learns it was deposed and sends A away.
    cut.store(false, Ordering::SeqCst);
    let a_got = tokio::time::timeout(FAILOVER_WAIT, a_reader)
        .await
        .expect("the old primary closes A's session after healing")
        .unwrap();
    eprintln!("A received {a_got} events from the cut-off primary");
    drop(a);
    drop(b_events);
    // Seen once in about ten runs: B's connection already closed without a reason by the time
    // it closes (not investigated yet); what B received is checked below either way.
    if let Err(e) = b.close(true).await {
        eprintln!("B's close failed: {e}");
    }
    // Nothing acknowledged is lost.
    let missing: Vec<u32> = (0..TOTAL)
        .filter(|v| !b_values.contains(v))
        .take(10)
        .collect();
    assert!(missing.is_empty(), "lost: {missing:?}");
}

/// A client on the wrong side of a partition (issue 25, point 7): UDP relays cut the primary
/// (n1) from its peers but not from its client. The cut-off primary, without a lease and
/// reaching no majority, sends the client away; the client's reconnecting subscription fails
/// over to the copy on the majority side, which takes over, and delivers there. The client is
/// attached to the new primary within 5 s of the cut (before, it stayed on the silent old
/// primary for the whole partition); nothing acknowledged is lost, and an event received twice
/// is flagged.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_of_a_cut_off_primary_moves_to_the_new_primary_within_5_s() {
    use std::sync::atomic::AtomicBool;
    const BEFORE: u32 = 2_000;
    const TOTAL: u32 = 3_000;
    const MOVED_WITHIN: Duration = Duration::from_secs(5);
    let cut = Arc::new(AtomicBool::new(false));
    // Every link between n1 and its peers.
    let p = routed_cluster(|i, j| (i == 0 || j == 0).then(|| cut.clone())).await;
    let mut sub = subscribe_d(&p, Duration::from_secs(10), Duration::from_millis(500)).await;
    assert_eq!(sub.client().unwrap().node_id(), "n1");
    let progress = Arc::new(AtomicU32::new(0));
    assert_eq!(
        publish(p.get(1).builder(), 0, BEFORE, progress.clone()).await,
        BEFORE
    );
    let mut seen: HashSet<u32> = HashSet::new();
    while seen.len() < BEFORE as usize {
        match tokio::time::timeout(FAILOVER_WAIT, sub.next()).await {
            Ok(Some(ClientEvent::Event(e))) => note_event(&mut seen, &e),
            Ok(Some(ClientEvent::Live { .. })) => {}
            other => panic!("before the cut: {other:?}"),
        }
    }
    let secondary = in_sync_secondary(&p, 0, "d", u64::from(BEFORE)).await;
    cut.store(true, Ordering::SeqCst);
    let cut_at = std::time::Instant::now();
    // Publishes during the partition, through the majority's other node.
    let via = if secondary == 1 { 2 } else { 1 };
    let publisher = tokio::spawn(publish(
        p.get(via).builder(),
        BEFORE,
        TOTAL,
        progress.clone(),
    ));
    let mut moved_after = None;
    while seen.len() < TOTAL as usize {
        match tokio::time::timeout(FAILOVER_WAIT, sub.next()).await {
            Ok(Some(ClientEvent::Event(e))) => note_event(&mut seen, &e),
            Ok(Some(ClientEvent::Reconnected { .. })) => {
                let node = sub.client().unwrap().node_id().to_string();
                eprintln!("reconnected to {node} {:?} after the cut", cut_at.elapsed());
                if node == format!("n{}", secondary + 1) {
                    moved_after.get_or_insert(cut_at.elapsed());
                }
            }
            Ok(Some(ClientEvent::Disconnected { error })) => {
                eprintln!("disconnected {:?} after the cut: {error}", cut_at.elapsed())
            }
            Ok(Some(ClientEvent::Live { .. })) => {}
            other => panic!("after the cut ({} of {TOTAL} seen): {other:?}", seen.len()),
        }
    }
    let moved_after = moved_after.expect("the client moved to the promoted copy");
    eprintln!(
        "moved after {moved_after:?}; every event received {:?} after the cut",
        cut_at.elapsed()
    );
    assert!(
        moved_after < MOVED_WITHIN,
        "the client reached the new primary only {moved_after:?} after the cut"
    );
    assert_eq!(publisher.await.unwrap(), TOTAL);
    cut.store(false, Ordering::SeqCst);
    sub.close(true).await.ok();
}

/// A link cut between a primary and its copy only (issue 25, point 7): both still reach the
/// third member, so the metadata leader may see both alive and declare nobody failed. The
/// primary, which reaches a majority, takes the copy it cannot reach out of the replica set and
/// delivers again (a new copy is then made on the third member); the client, online
/// throughout, gets every event, and nothing is lost.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_primary_cut_from_its_copy_only_delivers_again() {
    const BEFORE: u32 = 1_000;
    const TOTAL: u32 = 2_000;
    /// Far longer than twice the failure time plus the lease: the queue must not wait for the
    /// link to heal.
    const RESUMED_WITHIN: Duration = Duration::from_secs(30);
    let (p, cuts) = pair_routed_cluster(false).await;
    // The queue's primary is PRIMARY.
    const PRIMARY: usize = 1;
    let a = durable_on(&p, PRIMARY, "d").await;
    a.ready_for_events().await.unwrap();
    let mut events = a.events().unwrap();
    let progress = Arc::new(AtomicU32::new(0));
    assert_eq!(
        publish(p.get(PRIMARY).builder(), 0, BEFORE, progress.clone()).await,
        BEFORE
    );
    let mut seen: HashSet<u32> = HashSet::new();
    for e in receive(&mut events, BEFORE as usize).await {
        seen.insert(value(&e));
    }
    let secondary = in_sync_secondary(&p, PRIMARY, "d", u64::from(BEFORE)).await;
    eprintln!("primary n{}, copy on n{}", PRIMARY + 1, secondary + 1);
    cuts.set(PRIMARY, secondary, true);
    let cut_at = std::time::Instant::now();
    let third = 3 - secondary - PRIMARY;
    assert_eq!(
        publish(p.get(third).builder(), BEFORE, TOTAL, progress.clone()).await,
        TOTAL
    );
    while seen.len() < TOTAL as usize {
        let left = RESUMED_WITHIN.saturating_sub(cut_at.elapsed());
        let next = tokio::time::timeout(left, events.next()).await;
        if let Some(other) = note_after_cut(next, &mut seen, TOTAL, cut_at) {
            panic!("after the cut: {other:?}");
        }
    }
    eprintln!("every event received {:?} after the cut", cut_at.elapsed());
    cuts.heal_all();
    events.commit();
    a.close(true).await.ok();
}

/// A primary cut from the metadata leader only (issue 25, point 7): it still reaches its copy on
/// the third member. The leader declares it failed and promotes the copy; the old primary
/// cannot apply that (it hears no leader) but learns it from the new primary, which ships to it
/// as its new copy: it gives its queue up, takes the copy, and the new primary delivers again.
/// The client, moved to the new primary, gets every event, a repeated one flagged. (Before, the
/// old primary kept its stale queue, never held the copy, and the new primary neither
/// delivered nor completed a registration for the whole cut.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_primary_cut_from_the_leader_only_hands_over_to_its_copy() {
    const BEFORE: u32 = 1_000;
    const TOTAL: u32 = 2_000;
    /// Well above the failure time, the lease and a client's reconnect: the queue must not
    /// wait for the link to heal.
    const RESUMED_WITHIN: Duration = Duration::from_secs(30);
    let (p, cuts) = pair_routed_cluster(true).await;
    let leader = p.leader().await;
    let primary = (leader + 1) % 3;
    let third = 3 - leader - primary;
    // An id whose copy goes to the third member, and whose new primary there chooses the old
    // one as its new copy: copies go to the members with the highest rendezvous hash of (id,
    // member name) (`choose_secondaries`).
    let hash = |id: &str, i: usize| rendezvous_key(id, &format!("n{}", i + 1));
    let id = (0..)
        .map(|k| format!("d{k}"))
        .find(|id| hash(id, third) > hash(id, leader) && hash(id, primary) > hash(id, leader))
        .unwrap();
    let policy = tether::client::ReconnectPolicy {
        delay_initial: Duration::from_millis(100),
        delay_max: Duration::from_millis(500),
        ..Default::default()
    };
    let mut sub = p
        .builder(&[primary, third, leader])
        .durable(&id, 600)
        .redundancy(1)
        .failure_timeout(Duration::from_secs(3))
        .ack_interval(Duration::from_millis(20))
        .reconnect(policy)
        .subscribe([("R".to_string(), Interest::all_keys())])
        .await
        .expect("the subscription starts");
    assert_eq!(sub.client().unwrap().node_id(), format!("n{}", primary + 1));
    let progress = Arc::new(AtomicU32::new(0));
    assert_eq!(
        publish(p.get(third).builder(), 0, BEFORE, progress.clone()).await,
        BEFORE
    );
    let mut seen: HashSet<u32> = HashSet::new();
    while seen.len() < BEFORE as usize {
        match tokio::time::timeout(FAILOVER_WAIT, sub.next()).await {
            Ok(Some(ClientEvent::Event(e))) => note_event(&mut seen, &e),
            Ok(Some(ClientEvent::Live { .. })) => {}
            other => panic!("before the cut: {other:?}"),
        }
    }
    assert_eq!(
        in_sync_secondary(&p, primary, &id, u64::from(BEFORE)).await,
        third
    );
    eprintln!(
        "leader n{}, primary n{}, copy on n{}",
        leader + 1,
        primary + 1,
        third + 1
    );
    cuts.set(leader, primary, true);
    let cut_at = std::time::Instant::now();
    // The rest is published once the leader has declared the old primary failed
    // (`node-failure-ms`, 2.5 s) and the new primary's lease wait is over (1.5 s): only the new
    // primary can deliver it.
    tokio::time::sleep(Duration::from_secs(6)).await;
    let publisher = tokio::spawn(publish(
        p.get(third).builder(),
        BEFORE,
        TOTAL,
        progress.clone(),
    ));
    while seen.len() < TOTAL as usize {
        let left = RESUMED_WITHIN.saturating_sub(cut_at.elapsed());
        let next = tokio::time::timeout(left, sub.next()).await;
        match note_after_cut(next, &mut seen, TOTAL, cut_at) {
            None => {}
            Some(ClientEvent::Reconnected { .. }) => eprintln!(
                "reconnected to {} {:?} after the cut",
                sub.client().unwrap().node_id(),
                cut_at.elapsed()
            ),
            Some(ClientEvent::Disconnected { error }) => {
                eprintln!("disconnected {:?} after the cut: {error}", cut_at.elapsed())
            }
            Some(other) => panic!("after the cut: {other:?}"),
        }
    }
    eprintln!("every event received {:?} after the cut", cut_at.elapsed());
    assert_eq!(publisher.await.unwrap(), TOTAL);
    // The new primary completes a registration (it waits for every copy to hold it).
    let client = sub.client().unwrap();
    assert_eq!(client.node_id(), format!("n{}", third + 1));
    tokio::time::timeout(
        RESUMED_WITHIN,
        client.region("S").register(Interest::all_keys()),
    )
    .await
    .expect("a registration completes on the new primary during the cut")
    .unwrap();
    cuts.heal_all();
    sub.close(true).await.ok();
}

/// Flapping links (issue 25, point 7): for 40 s, one link between two members at a time is
/// cut for 1–4 s and healed for 0.5–2 s (seeded; `TETHER_FLAP_SEED` replays a run), so every
/// member always reaches a majority. A durable client with a reconnecting subscription is
/// never without a session for longer than one failure-detection period plus the lease (and
/// the subscription's longest reconnect wait); publishes go on through one member all along,
/// and the client gets every acknowledged event, a repeated one flagged.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn flapping_links_never_leave_a_client_without_a_session_for_long() {
    const FLAP_FOR: Duration = Duration::from_secs(40);
    /// The subscription's longest wait between reconnect attempts.
    const RECONNECT_DELAY_MAX: Duration = Duration::from_millis(500);
    /// `node-failure-ms` (default) plus the lease (`LEASE_MS`, 1.5 s) plus one reconnect wait.
    const OUTAGE_MAX: Duration = Duration::from_millis(
        tether::config::NODE_FAILURE_MS_DEFAULT + 1_500 + RECONNECT_DELAY_MAX.as_millis() as u64,
    );
    let seed: u64 = std::env::var("TETHER_FLAP_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap()
                .as_nanos() as u64
                | 1
        });
    eprintln!("TETHER_FLAP_SEED={seed}");
    let (p, cuts) = pair_routed_cluster(false).await;
    let flags = cuts.0.clone();
    let mut sub = subscribe_d(&p, Duration::from_secs(3), RECONNECT_DELAY_MAX).await;
    // Publishes through n3 all along: 20 every 50 ms, about as long as the flapping.
    const PER_PUBLISH: u32 = 20;
    const TOTAL: u32 = 16_000;
    let publisher = tokio::spawn({
        let builder = p.get(2).builder();
        async move {
            let c = builder.connect().await.expect("publisher connects");
            for from in (0..TOTAL).step_by(PER_PUBLISH as usize) {
                let ops = common::cluster::numbered_puts(from..from + PER_PUBLISH);
                c.publish(ops).await.expect("a publish through n3");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            c.close(false).await.ok();
        }
    });
    let flapper = tokio::spawn({
        let flags = flags.clone();
        async move {
            let mut x = seed;
            let mut next = move |n: u64| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                x % n
            };
            let start = std::time::Instant::now();
            let mut cuts = 0;
            while start.elapsed() < FLAP_FOR {
                let k = next(3) as usize;
                flags[k].store(true, Ordering::SeqCst);
                cuts += 1;
                tokio::time::sleep(Duration::from_millis(1_000 + next(3_000))).await;
                flags[k].store(false, Ordering::SeqCst);
                tokio::time::sleep(Duration::from_millis(500 + next(1_500))).await;
            }
            cuts
        }
    });
    let mut seen: HashSet<u32> = HashSet::new();
    let mut lost_at: Option<std::time::Instant> = None;
    let mut outage_max = Duration::ZERO;
    let mut disconnects = 0;
    // The longest wait for an event (reported: publishes come every 50 ms).
    let (mut last_event, mut silence_max) = (std::time::Instant::now(), Duration::ZERO);
    while seen.len() < TOTAL as usize {
        match tokio::time::timeout(FAILOVER_WAIT, sub.next()).await {
            Ok(Some(ClientEvent::Event(e))) => {
                note_event(&mut seen, &e);
                silence_max = silence_max.max(last_event.elapsed());
                last_event = std::time::Instant::now();
            }
            Ok(Some(ClientEvent::Disconnected { error })) => {
                disconnects += 1;
                eprintln!("disconnected: {error}");
                lost_at = Some(std::time::Instant::now());
            }
            Ok(Some(ClientEvent::Reconnected { .. })) => {
                let node = sub.client().map(|c| c.node_id().to_string());
                let outage = lost_at.take().map(|t| t.elapsed()).unwrap_or_default();
                eprintln!("reconnected to {node:?} after {outage:?}");
                outage_max = outage_max.max(outage);
            }
            Ok(Some(ClientEvent::Live { .. })) => {}
            other => panic!("{} of {TOTAL} seen (seed {seed}): {other:?}", seen.len()),
        }
    }
    publisher.await.unwrap();
    let cuts_made = flapper.await.unwrap();
    eprintln!(
        "{cuts_made} cuts, {disconnects} disconnects, longest without a session {outage_max:?}, \
         longest wait for an event {silence_max:?}"
    );
    assert!(
        outage_max <= OUTAGE_MAX,
        "the client was without a session for {outage_max:?} (seed {seed})"
    );
    sub.close(true).await.ok();
}

/// kill -9 of the secondary while the client is online: the primary stops waiting for it once
/// it is declared failed, delivery goes on, redundancy is repaired on the third node, and
/// nothing is lost or delivered twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn secondary_kill_9_neither_stops_nor_loses_the_stream() {
    const TOTAL: u32 = 10_000;
    let mut p = ProcCluster::start(3);
    let d = durable_on_n1(&p, "d").await;
    d.ready_for_events().await.unwrap();
    let secondary = in_sync_secondary(&p, 0, "d", 0).await;
    let via = (1..3).find(|&i| i != secondary).unwrap();
    let progress = Arc::new(AtomicU32::new(0));
    let publisher = tokio::spawn(publish(p.get(via).builder(), 0, TOTAL, progress.clone()));
    let mut ev = d.events().unwrap();
    let mut values = Vec::new();
    while values.len() < TOTAL as usize {
        if values.len() == TOTAL as usize / 4 && p.procs[secondary].is_some() {
            p.kill9(secondary);
        }
        match tokio::time::timeout(FAILOVER_WAIT, ev.next()).await {
            Ok(Some(ClientEvent::Event(e))) => {
                assert!(!e.possible_duplicate, "no redelivery without a failover");
                values.push(value(&e));
                ev.commit();
            }
            Ok(Some(ClientEvent::Live { .. })) => {}
            other => panic!("the stream stopped: {other:?}"),
        }
    }
    assert_eq!(publisher.await.unwrap(), TOTAL);
    assert!(
        p.procs[secondary].is_none(),
        "the secondary was killed mid-stream"
    );
    assert_eq!(
        values,
        (0..TOTAL).collect::<Vec<_>>(),
        "every event once, in order"
    );
    // Redundancy is back, on the third node.
    let third = (1..3).find(|&i| i != secondary).unwrap();
    let r = wait_for("redundancy repaired", || async {
        report(&p, 0, "d", "primary").await.filter(|r| {
            r.copies.len() == 1
                && r.copies[0].node == format!("n{}", third + 1)
                && r.copies[0].lag_entries == 0
        })
    })
    .await;
    assert_eq!(r.end_offset, u64::from(TOTAL));
}

/// G8: the client reconnects while its queue has a backlog and does not say ready; then its
/// primary dies. On the promoted copy it resumes with the exact pending count, and ready
/// delivers the whole backlog in order (G6/G9 as well: it reached the queue through a node that
/// does not hold it, and the placement kept its primary until the failure).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn g8_reconnected_not_ready_then_primary_dies() {
    const TOTAL: u32 = 2_000;
    let mut p = ProcCluster::start(3);
    let d = durable_on_n1(&p, "d").await;
    d.ready_for_events().await.unwrap();
    d.close(true).await.unwrap();
    let progress = Arc::new(AtomicU32::new(0));
    assert_eq!(publish(p.get(1).builder(), 0, TOTAL, progress).await, TOTAL);
    let secondary = in_sync_secondary(&p, 0, "d", u64::from(TOTAL)).await;
    // Reconnect through the node that holds nothing (redirected to n1), without ready.
    let other = (1..3).find(|&i| i != secondary).unwrap();
    let d = p
        .builder(&[other])
        .durable("d", 600)
        .failure_timeout(Duration::from_secs(3))
        .connect()
        .await
        .unwrap();
    assert_eq!((d.node_id(), d.pending()), ("n1", Some(u64::from(TOTAL))));
    p.kill9(0);
    drop(d);
    let d = reconnect_until(&p, &[other, secondary], "the promoted copy", |c| {
        c.node_id() == format!("n{}", secondary + 1)
    })
    .await;
    assert_eq!(d.queue_status(), QueueStatus::Resumed);
    assert_eq!(d.pending(), Some(u64::from(TOTAL)));
    d.ready_for_events().await.unwrap();
    let mut ev = d.events().unwrap();
    let mut values = Vec::new();
    loop {
        match tokio::time::timeout(FAILOVER_WAIT, ev.next()).await {
            Ok(Some(ClientEvent::Event(e))) => {
                assert!(e.replayed, "queued before ready");
                values.push(value(&e));
            }
            Ok(Some(ClientEvent::Live { .. })) => break,
            other => panic!("stream ended: {other:?}"),
        }
    }
    assert_eq!(values, (0..TOTAL).collect::<Vec<_>>());
}

/// A new copy of a queue bigger than one peer message (about 10 MB pending) gets its snapshot
/// in several messages: after the secondary dies, redundancy is repaired on the third node,
/// which ends up holding the whole queue.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn large_snapshot_is_sent_in_several_messages() {
    const BIG: u32 = 30_000;
    let mut p = ProcCluster::start(3);
    let d = durable_on_n1(&p, "d").await;
    d.ready_for_events().await.unwrap();
    let mut ev = d.events().unwrap();
    // A few events received and acked first: the primary trims them, so a new copy cannot be
    // fed by appends from offset 0 and needs a snapshot.
    let progress = Arc::new(AtomicU32::new(0));
    assert_eq!(publish(p.get(1).builder(), 0, 100, progress).await, 100);
    receive(&mut ev, 100).await;
    ev.commit();
    drop(ev);
    d.ack_now().await.unwrap();
    d.close(true).await.unwrap();
    let publisher = p.get(1).builder().connect().await.unwrap();
    for chunk in (0..BIG).collect::<Vec<_>>().chunks(500) {
        let ops = chunk
            .iter()
            .map(|i| PublishOp::Put {
                region: "R".into(),
                key: format!("big-{i}"),
                value: vec![b'x'; 300],
            })
            .collect();
        publisher.publish(ops).await.unwrap();
    }
    let end = u64::from(100 + BIG);
    let secondary = in_sync_secondary(&p, 0, "d", end).await;
    p.kill9(secondary);
    let third = (1..3).find(|&i| i != secondary).unwrap();
    wait_for("a new copy on the third node, in sync", || async {
        report(&p, 0, "d", "primary").await.filter(|r| {
            r.copies.len() == 1
                && r.copies[0].node == format!("n{}", third + 1)
                && r.copies[0].lag_entries == 0
        })
    })
    .await;
    let copy = report(&p, third, "d", "secondary")
        .await
        .expect("the third node holds a copy");
    assert_eq!(
        (copy.acked_offset, copy.end_offset, copy.pending),
        (100, end, u64::from(BIG))
    );
}

/// Client-managed failover (Geode's model): the cluster's failure detector is set to an hour,
/// so only the client can move the queue. The online client loses its primary (kill -9),
/// goes to the copy named in its welcome (its own server list names only the third node),
/// the copy finds the primary dead too and promotes itself through the metadata; the client
/// resumes from its acked offset, loses nothing, sees the live marker once, and the new
/// primary restores redundancy on the third node.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_promotes_a_copy_when_its_primary_dies() {
    const BEFORE: u32 = 1_000;
    const TOTAL: u32 = 4_000;
    let mut p = ProcCluster::start_with_config(3, "[cluster]\nnode-failure-ms = 3600000\n");
    let d = p
        .get(0)
        .builder()
        .durable("d", 600)
        .redundancy(1)
        .failure_timeout(Duration::from_secs(2))
        .ack_interval(Duration::from_millis(20))
        .connect()
        .await
        .expect("durable client connects");
    d.region("R").register(Interest::all_keys()).await.unwrap();
    d.ready_for_events().await.unwrap();
    let servers = d.queue_servers().to_vec();
    assert_eq!(servers.len(), 2, "the primary and one copy: {servers:?}");
    assert!(servers[0].primary && servers[0].node_id == "n1" && !servers[1].primary);
    let secondary = p.index(&servers[1].node_id);
    let third = (1..3).find(|&i| i != secondary).unwrap();
    let dedup = d.dedup_state();
    let progress = Arc::new(AtomicU32::new(0));
    let publisher = tokio::spawn(publish(p.get(third).builder(), 0, TOTAL, progress.clone()));
    let mut seen: HashSet<u32> = HashSet::new();
    let mut fresh: Vec<u32> = Vec::new();
    let mut lives = 0;
    let mut client = Some(d);
    let mut killed = false;
    let mut reconnects = 0;
    while fresh.len() < TOTAL as usize {
        let c = match client.take() {
            Some(c) => c,
            None => {
                reconnects += 1;
                assert!(reconnects < 20, "too many reconnects");
                let c = fail_over(&p, third, &dedup).await;
                assert_eq!(c.queue_status(), QueueStatus::Resumed, "the queue survived");
                assert_eq!(
                    c.node_id(),
                    format!("n{}", secondary + 1),
                    "served by the copy"
                );
                c.ready_for_events().await.unwrap();
                c
            }
        };
        let mut ev = c.events().unwrap();
        loop {
            if !killed && fresh.len() as u32 >= BEFORE {
                p.kill9(0);
                killed = true;
            }
            match tokio::time::timeout(FAILOVER_WAIT, ev.next()).await {
                Ok(Some(ClientEvent::Event(e))) => {
                    let v = value(&e);
                    if !seen.insert(v) {
                        assert!(e.possible_duplicate, "an unflagged duplicate: {v}");
                    } else {
                        fresh.push(v);
                    }
                    ev.commit();
                    if fresh.len() == TOTAL as usize {
                        break;
                    }
                }
                Ok(Some(ClientEvent::Live { .. })) => lives += 1,
                Ok(Some(other)) => panic!("a session's stream yielded {other:?}"),
                Ok(None) => break, // The connection died: fail over.
                Err(_) => panic!("no event for {FAILOVER_WAIT:?}"),
            }
        }
        drop(ev);
        if fresh.len() == TOTAL as usize {
            client = Some(c);
        }
    }
    assert!(killed && reconnects >= 1, "the client failed over");
    assert_eq!(publisher.await.unwrap(), TOTAL);
    assert_eq!(lives, 1, "the live marker is seen once");
    let sorted: Vec<u32> = (0..TOTAL).collect();
    assert_eq!(fresh, sorted, "every event once, in publisher order");
    // The promoted copy restores redundancy on the third node.
    let r = wait_for("redundancy to be restored", || async {
        report(&p, secondary, "d", "primary")
            .await
            .filter(|r| r.copies.len() == 1 && r.copies[0].lag_entries == 0)
    })
    .await;
    assert_eq!(r.copies[0].node, format!("n{}", third + 1));
    client.take().unwrap().close(true).await.ok();
}

/// The publishes a frozen primary never shipped are appended by a promotion however late it
/// comes, also after the copy's node restarted: that node keeps them, durably, until the copy
/// holds them (its watermark), not for a fixed time. The primary is stopped (SIGSTOP) with the
/// client online; events are published through the third node, then again after longer than
/// the 30 s an earlier version kept them for; the copy's node is killed (-9) and restarted;
/// only then does the client fail over to the copy (the failure detector is off).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_late_promotion_appends_what_the_frozen_primary_never_shipped() {
    const HALF: u32 = 200;
    /// Longer than the old fixed window (`RECENT_FORWARDS_MS`, 30 s).
    const LATE: Duration = Duration::from_secs(32);
    let mut p = ProcCluster::start_with_config(3, "[cluster]\nnode-failure-ms = 3600000\n");
    let d = durable_on_n1(&p, "d").await;
    d.ready_for_events().await.unwrap();
    let servers = d.queue_servers().to_vec();
    let secondary = p.index(&servers[1].node_id);
    let third = (1..3).find(|&i| i != secondary).unwrap();
    let dedup = d.dedup_state();
    let mut ev = d.events().unwrap();
    let pid = p.get(0).child.id().to_string();
    let signal = |sig: &str| {
        let ok = std::process::Command::new("kill")
            .args([sig, &pid])
            .status()
            .expect("kill runs")
            .success();
        assert!(ok, "kill {sig} {pid}");
    };
    signal("-STOP");
    let progress = Arc::new(AtomicU32::new(0));
    assert_eq!(
        publish(p.get(third).builder(), 0, HALF, progress.clone()).await,
        HALF
    );
    tokio::time::sleep(LATE).await;
    // Acknowledged once every live member applied them (the frozen one is not waited for): the
    // copy's node then has all of them, and restarts.
    let replicated = p.get(third).builder().publish_ack(PublishAck::Replicated);
    assert_eq!(
        publish(replicated, HALF, 2 * HALF, progress.clone()).await,
        2 * HALF
    );
    p.kill9(secondary);
    p.restart(secondary);
    // The client's connection to the frozen primary times out; it fails over to the copy.
    loop {
        match tokio::time::timeout(FAILOVER_WAIT, ev.next()).await {
            Ok(Some(ClientEvent::Event(e))) => panic!("an event from the frozen primary: {e:?}"),
            Ok(Some(_)) => {}
            Ok(None) => break,
            Err(_) => panic!("the connection to the frozen primary did not end"),
        }
    }
    drop(ev);
    drop(d);
    let c = fail_over(&p, third, &dedup).await;
    assert_eq!(
        c.node_id(),
        format!("n{}", secondary + 1),
        "served by the copy"
    );
    assert_eq!(c.queue_status(), QueueStatus::Resumed);
    assert_eq!(c.pending(), Some(u64::from(2 * HALF)), "every event waits");
    c.ready_for_events().await.unwrap();
    let mut ev = c.events().unwrap();
    let got = receive(&mut ev, (2 * HALF) as usize).await;
    let mut values: Vec<u32> = got.iter().map(value).collect();
    values.sort_unstable();
    assert_eq!(values, (0..2 * HALF).collect::<Vec<_>>(), "each event once");
    ev.commit();
    drop(ev);
    signal("-CONT");
    c.close(true).await.ok();
}

/// An acknowledged registration survives a failover: when `register` returns, the copy already
/// holds the new durable interest (no entries are being shipped that could carry it), and
/// after the primary is killed at once the promoted copy queues events for it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn registered_interest_is_on_the_copy_when_register_returns() {
    let mut p = ProcCluster::start(3);
    let d = durable_on_n1(&p, "d").await;
    d.ready_for_events().await.unwrap();
    let secondary = p.index(&d.queue_servers()[1].node_id);
    let third = (1..3).find(|&i| i != secondary).unwrap();
    // Let the copy settle, so only the registration below can change its interest.
    let _ = in_sync_secondary(&p, 0, "d", 0).await;
    d.region("A").register(Interest::all_keys()).await.unwrap();
    let copy = report(&p, secondary, "d", "secondary")
        .await
        .expect("the copy reports");
    assert!(
        copy.interests.iter().any(|i| i.region == "A" && i.durable),
        "the copy holds the new interest: {:?}",
        copy.interests
    );
    p.kill9(0);
    d.crash();
    let publisher = p.get(third).builder().connect().await.unwrap();
    publisher
        .publish(vec![PublishOp::Put {
            region: "A".into(),
            key: "k".into(),
            value: b"after".to_vec(),
        }])
        .await
        .unwrap();
    let d = reconnect_until(&p, &[third], "the queue to hold the event", |c| {
        c.pending() == Some(1)
    })
    .await;
    assert_eq!(d.node_id(), format!("n{}", secondary + 1));
    d.ready_for_events().await.unwrap();
    let mut ev = d.events().unwrap();
    match tokio::time::timeout(FAILOVER_WAIT, ev.next()).await {
        Ok(Some(ClientEvent::Event(e))) => {
            assert_eq!((e.region.as_str(), e.key.as_str()), ("A", "k"));
            assert_eq!(e.value.as_deref(), Some(&b"after"[..]));
        }
        other => panic!("expected the event of region A, got {other:?}"),
    }
}

/// G10 in a cluster, with redundancy 0: the online client's node is killed and restarted on
/// its port. The queue has no copy, so it stays placed on that node (nothing else holds it);
/// after the restart it is back with the same id and timeout, the events published through
/// another node meanwhile (kept in that node's publish log) are pending, and later publishes
/// reach the client too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn g10_queue_without_copies_comes_back_with_its_node() {
    let mut p = ProcCluster::start(3);
    let d = p
        .get(0)
        .builder()
        .durable("d", 600)
        .failure_timeout(Duration::from_secs(2))
        .connect()
        .await
        .expect("durable client connects");
    d.region("R").register(Interest::all_keys()).await.unwrap();
    d.ready_for_events().await.unwrap();
    assert_eq!(d.queue_servers().len(), 1, "no copies");
    p.kill9(0);
    d.crash();
    let progress = Arc::new(AtomicU32::new(0));
    assert_eq!(
        publish(p.get(1).builder(), 0, 10, progress.clone()).await,
        10
    );
    p.restart(0);
    let r = wait_for("the queue back on its node", || async {
        report(&p, 0, "d", "primary")
            .await
            .filter(|r| r.pending == 10)
    })
    .await;
    assert_eq!(r.timeout_secs, 600);
    let d = reconnect_until(&p, &[2], "the queue resumed on n1", |c| {
        c.pending() == Some(10)
    })
    .await;
    assert_eq!(
        (d.node_id(), d.queue_status()),
        ("n1", QueueStatus::Resumed)
    );
    d.ready_for_events().await.unwrap();
    assert_eq!(publish(p.get(2).builder(), 10, 20, progress).await, 20);
    let mut ev = d.events().unwrap();
    let values: Vec<u32> = receive(&mut ev, 20).await.iter().map(value).collect();
    assert_eq!(
        values,
        (0..20).collect::<Vec<_>>(),
        "every event once, in order"
    );
}

/// The durable timeout still expires a queue once, cluster-wide, after a failover: the client
/// is away when its primary is killed; the promoted copy expires the queue when the away time
/// (which travels with the copy) passes the timeout. The killed node, restarted with the old
/// queue still on its disk, does not bring it back: the next client, even through that node,
/// learns `expired` once and then starts a new queue.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn away_queue_expires_once_cluster_wide_after_a_failover() {
    let mut p = ProcCluster::start(3);
    let d = p
        .get(0)
        .builder()
        .durable("d", 5)
        .redundancy(1)
        .connect()
        .await
        .expect("durable client connects");
    d.region("R").register(Interest::all_keys()).await.unwrap();
    d.ready_for_events().await.unwrap();
    away_with_100_then_kill_primary(&mut p, d).await;
    wait_for("the promoted queue to expire", || async {
        let mut held = false;
        for i in 1..3 {
            held |= queues(&p, i)
                .await
                .iter()
                .any(|q| q.durable_id.as_deref() == Some("d"));
        }
        (!held).then_some(())
    })
    .await;
    p.restart(0);
    let statuses = async |via: usize| {
        let c = p
            .builder(&[via])
            .durable("d", 60)
            .connect()
            .await
            .expect("connects");
        let s = c.queue_status();
        c.close(false).await.ok();
        s
    };
    assert_eq!(statuses(0).await, QueueStatus::Expired, "told once");
    assert_eq!(statuses(0).await, QueueStatus::New, "then a new queue");
    assert!(
        queues(&p, 0)
            .await
            .iter()
            .all(|q| q.durable_id.as_deref() != Some("d") || q.pending == 0),
        "the old entries did not come back"
    );
}

/// Sends client `d` (queue "d" on node 0, with a copy) away, publishes 100 events through the
/// copy's node, waits until the copy holds them, and kills node 0. Returns the copy's node.
async fn away_with_100_then_kill_primary(p: &mut ProcCluster, d: Client) -> usize {
    d.close(true).await.unwrap();
    let copy = wait_for("the copy to be reported", || async {
        report(p, 0, "d", "primary")
            .await
            .and_then(|r| r.copies.first().map(|c| c.node.clone()))
    })
    .await;
    let secondary = p.index(&copy);
    let progress = Arc::new(AtomicU32::new(0));
    assert_eq!(
        publish(p.get(secondary).builder(), 0, 100, progress).await,
        100
    );
    in_sync_secondary(p, 0, "d", 100).await;
    p.kill9(0);
    secondary
}

/// A killed primary that restarts after its queue moved, and then ended on the new primary
/// (the client came back and closed it for good), does not bring the old queue back from its
/// disk: the id's next client, even through that node, starts a new queue.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ended_queue_does_not_come_back_on_its_restarted_old_primary() {
    let mut p = ProcCluster::start(3);
    let d = durable_on_n1(&p, "d").await;
    d.ready_for_events().await.unwrap();
    let secondary = away_with_100_then_kill_primary(&mut p, d).await;
    let d = reconnect_until(&p, &[secondary], "the queue on the promoted copy", |c| {
        c.pending() == Some(100)
    })
    .await;
    d.close(false).await.unwrap();
    p.restart(0);
    let c = p
        .builder(&[0])
        .durable("d", 600)
        .connect()
        .await
        .expect("connects");
    assert_eq!(
        c.queue_status(),
        QueueStatus::New,
        "the ended queue stays ended"
    );
    assert_eq!(c.pending(), None);
    c.close(false).await.ok();
}

/// Whether every running node answers and, for each durable id of `ids`, a running node is its
/// primary with one copy holding every entry (the copy's lag 0).
async fn every_queue_copied(p: &ProcCluster, ids: &[&str]) -> bool {
    let mut copied = HashSet::new();
    for i in 0..p.procs.len() {
        if p.procs[i].is_none() {
            continue;
        }
        let Ok(c) = p.get(i).builder().connect().await else {
            return false;
        };
        let Ok(qs) = c.queues().await else {
            return false;
        };
        c.close(false).await.ok();
        for q in qs {
            if q.role == "primary" && q.copies.len() == 1 && q.copies[0].lag_entries == 0 {
                copied.extend(q.durable_id);
            }
        }
    }
    ids.iter().all(|id| copied.contains(*id))
}

/// Issue 25 point 4, a rolling restart: every node of a three-node cluster is stopped
/// (SIGTERM) and started again in turn, the next one only once every queue has an in-sync copy
/// again (the documented procedure, docs/operations.md), while a `Publisher` publishes all
/// along (about 3,000 events/s; a stopping node answers `going-away` to what it did not apply, and
/// the publisher moves to another node) and two durable clients with redundancy 1 consume:
/// "online" through a reconnecting subscription all along, "away" away for the whole restart
/// and back at the end. No publish fails; both clients get every event, and an event shown
/// again is flagged. The subscription's longest time without a session is printed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rolling_restart_under_load_loses_nothing() {
    rolling_restart(false).await
}

/// The rolling restart of the test above, each node drained first (`tether cluster drain`,
/// issue 25 points 3 and 4): its queues and copies move to the others before it stops, and it
/// is undrained once it serves again. The same checks: no publish fails, both clients get every
/// event, and an event shown again is flagged.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rolling_restart_with_drains_under_load_loses_nothing() {
    rolling_restart(true).await
}

/// Asks `via` to drain `node` (or undrain it), and with `drain` waits until it holds no
/// queue and no copy.
async fn set_drain(p: &ProcCluster, via: usize, node: usize, drain: bool) {
    let name = format!("n{}", node + 1);
    let admin = p.get(via).builder().connect().await.unwrap();
    let report = admin.drain(&name, Some(drain)).await.unwrap();
    eprintln!("{report:?}");
    if drain {
        let start = std::time::Instant::now();
        let mut r = report;
        while r.primaries + r.copies > 0 {
            assert!(start.elapsed() < FAILOVER_WAIT, "{name} not drained: {r:?}");
            tokio::time::sleep(Duration::from_millis(100)).await;
            r = admin.drain(&name, None).await.unwrap();
        }
        eprintln!("{name} drained in {:?}", start.elapsed());
    }
    admin.close(false).await.ok();
}

async fn rolling_restart(drain: bool) {
    use std::sync::atomic::AtomicBool;
    const PER_PUBLISH: u32 = 20;
    let mut p = ProcCluster::start(3);
    let all: Vec<std::net::SocketAddr> = (0..3).map(|i| p.addr(i)).collect();
    let ca = p.get(0).ca.clone();
    let builder = move || ClientBuilder::new().servers(all.clone()).ca_file(&ca);
    // "away": its queue on n1 with a copy, then away for the whole restart.
    let away = durable_on(&p, 0, "away").await;
    away.ready_for_events().await.unwrap();
    away.close(true).await.unwrap();
    let mut online = subscribe_d(&p, Duration::from_secs(3), Duration::from_millis(500)).await;
    // The publisher: numbered puts of 20 every 5 ms (about 3,000 events/s here, below what
    // the cluster sustains), until told to stop. Not one fails:
    // a stopping node answers `going-away` to what it did not apply, and the publisher sends
    // it through another node.
    let stop = Arc::new(AtomicBool::new(false));
    let publisher = tokio::spawn({
        let (stop, builder) = (stop.clone(), builder.clone());
        async move {
            let publisher = builder().publisher().await.expect("publisher connects");
            let mut next = 0u32;
            while !stop.load(Ordering::SeqCst) {
                let ops = common::cluster::numbered_puts(next..next + PER_PUBLISH);
                publisher
                    .publish(ops)
                    .await
                    .unwrap_or_else(|e| panic!("the publish of {next}.. failed: {e}"));
                next += PER_PUBLISH;
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            let moves = publisher.moves();
            publisher.close().await.ok();
            (next, moves)
        }
    });
    // The online client's consumer, until it has every event up to `target` (set once the
    // publisher is done).
    let target = Arc::new(AtomicU32::new(u32::MAX));
    let consumer = tokio::spawn({
        let target = target.clone();
        async move {
            let mut seen: HashSet<u32> = HashSet::new();
            let mut lost_at: Option<std::time::Instant> = None;
            let (mut outage_max, mut disconnects) = (Duration::ZERO, 0);
            let mut last_progress = std::time::Instant::now();
            loop {
                let t = target.load(Ordering::SeqCst);
                if t != u32::MAX && (0..t).all(|v| seen.contains(&v)) {
                    return (online, disconnects, outage_max);
                }
                assert!(
                    last_progress.elapsed() < FAILOVER_WAIT,
                    "online: stalled at {} events (target {t})",
                    seen.len()
                );
                match tokio::time::timeout(Duration::from_millis(200), online.next()).await {
                    Ok(Some(ClientEvent::Event(e))) => {
                        last_progress = std::time::Instant::now();
                        let v = value(&e);
                        assert!(
                            seen.insert(v) || e.possible_duplicate,
                            "online: event {v} shown twice without the flag"
                        );
                    }
                    Ok(Some(ClientEvent::Disconnected { error })) => {
                        disconnects += 1;
                        eprintln!("online: disconnected: {error}");
                        lost_at = Some(std::time::Instant::now());
                    }
                    Ok(Some(ClientEvent::Reconnected { queue, .. })) => {
                        assert_eq!(queue, QueueStatus::Resumed, "the queue survived");
                        let outage = lost_at.take().map(|t| t.elapsed()).unwrap_or_default();
                        eprintln!("online: reconnected after {outage:?}");
                        outage_max = outage_max.max(outage);
                    }
                    Ok(Some(ClientEvent::Live { .. })) | Err(_) => {}
                    Ok(None) => panic!("online: the subscription ended"),
                }
            }
        }
    });
    // The restart, one node at a time.
    wait_for_copies(&p, "both queues copied before the restart".into()).await;
    for i in 0..3 {
        tokio::time::sleep(Duration::from_secs(1)).await;
        let other = (i + 1) % 3;
        if drain {
            set_drain(&p, other, i, true).await;
        }
        let start = std::time::Instant::now();
        let node = p.procs[i].take().expect("running");
        tokio::task::block_in_place(|| node.sigterm());
        let took = start.elapsed();
        eprintln!("n{} stopped in {took:?}", i + 1);
        // Nothing held the node past its drain: shutdown did not wait out its last resort.
        assert!(
            took < Duration::from_secs(tether::server::SHUTDOWN_DRAIN_SECS),
            "n{} took {took:?} to stop",
            i + 1
        );
        p.restart(i);
        if drain {
            wait_for(&format!("n{} serves again", i + 1), || async {
                let c = p.get(i).builder().connect().await.ok()?;
                c.close(false).await.ok();
                Some(())
            })
            .await;
            set_drain(&p, other, i, false).await;
        }
        wait_for_copies(&p, format!("both queues copied after n{} came back", i + 1)).await;
        eprintln!(
            "n{} back, queues copied, {:?} after its stop",
            i + 1,
            start.elapsed()
        );
    }
    tokio::time::sleep(Duration::from_secs(1)).await;
    stop.store(true, Ordering::SeqCst);
    let (published, moves) = publisher.await.unwrap();
    eprintln!("{published} events published, the publisher moved {moves} times");
    // The online client gets every acknowledged event.
    target.store(published, Ordering::SeqCst);
    let (online, disconnects, outage_max) = consumer.await.unwrap();
    eprintln!("online: {disconnects} disconnects, longest without a session {outage_max:?}");
    online.close(true).await.ok();
    // The away client comes back: the whole run waits for it, replayed.
    let back = builder()
        .durable("away", 600)
        .failure_timeout(Duration::from_secs(3))
        .connect()
        .await
        .expect("the away client comes back");
    assert_eq!(
        back.queue_status(),
        QueueStatus::Resumed,
        "its queue survived"
    );
    back.ready_for_events().await.unwrap();
    let mut ev = back.events().unwrap();
    let mut got: HashSet<u32> = HashSet::new();
    while (0..published).any(|v| !got.contains(&v)) {
        match tokio::time::timeout(FAILOVER_WAIT, ev.next()).await {
            Ok(Some(ClientEvent::Event(e))) => {
                let v = value(&e);
                assert!(
                    got.insert(v) || e.possible_duplicate,
                    "away: event {v} shown twice without the flag"
                );
            }
            Ok(Some(ClientEvent::Live { .. })) => {}
            other => panic!("away: {} of {published} events: {other:?}", got.len()),
        }
    }
    ev.commit();
    drop(ev);
    back.close(false).await.ok();
}

/// Waits until [`every_queue_copied`] holds for "d" and "away".
async fn wait_for_copies(p: &ProcCluster, what: String) {
    wait_for(&what, || async {
        every_queue_copied(p, &["d", "away"]).await.then_some(())
    })
    .await
}
