//! Durable queues in a cluster of three real nodes: a queue is placed (through the metadata
//! consensus) on the node its client first reaches; a client that comes back through another
//! node is redirected there and resumes with the exact pending count; a queue that expires or
//! is dropped frees its id cluster-wide, and one dropped and opened again at once keeps its new
//! placement; queues placed on one node spread over the others once
//! their clients are away (rebalancing), losing nothing and flagging only what was sent, and
//! stay where they are with rebalancing turned off.

mod common;

use std::time::Duration;

use tether::client::{ClientBuilder, Interest};
use tether::cluster::meta::{MetaCommand, MetaResponse};
use tether::protocol::QueueStatus;
use tether::server::Node;

use common::cluster::TestCluster;
use common::{entries, eventually, take_events, until_live};

/// A durable client of `id` (redundancy 1) through `node`.
async fn durable(node: &Node, id: &str) -> tether::client::Client {
    durable_builder(node, id).connect().await.unwrap()
}

fn durable_builder(node: &Node, id: &str) -> ClientBuilder {
    builder(node).durable(id.to_string(), 300).redundancy(1)
}

fn builder(node: &Node) -> ClientBuilder {
    ClientBuilder::new()
        .server(node.addr())
        .ca_file(node.ca_file())
        .ack_interval(Duration::from_millis(50))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_coming_back_through_another_node_is_redirected_to_its_queue() {
    let c = TestCluster::start(3).await;
    c.leader().await;
    let d = builder(c.node(0))
        .durable("d1", 300)
        .connect()
        .await
        .unwrap();
    assert_eq!(d.queue_status(), QueueStatus::New);
    d.region("R").register(Interest::all_keys()).await.unwrap();
    d.ready_for_events().await.unwrap();
    d.close(true).await.unwrap();

    // Published on the third node while the client is away.
    let p = c.node(2).publisher().await.unwrap();
    for i in 0..5 {
        p.put("R", &format!("k{i}"), b"v".to_vec()).await.unwrap();
    }
    // The queue on node 0 holds them (forwarded), and only node 0 holds it.
    eventually("forwarded events queued", || {
        c.node(0)
            .queues()
            .iter()
            .any(|q| q.durable_id.as_deref() == Some("d1") && q.pending == 5)
    })
    .await;

    let d = builder(c.node(1))
        .durable("d1", 300)
        .connect()
        .await
        .unwrap();
    assert_eq!(
        d.server_addr(),
        c.node(0).addr(),
        "redirected to the queue's node"
    );
    assert_eq!(d.node_id(), "n1");
    assert_eq!(
        (d.queue_status(), d.pending()),
        (QueueStatus::Resumed, Some(5))
    );
    d.ready_for_events().await.unwrap();
    let got = take_events(&mut d.events().unwrap(), 5).await;
    let keys: Vec<&str> = entries(&got).iter().map(|e| e.key.as_str()).collect();
    assert_eq!(keys, ["k0", "k1", "k2", "k3", "k4"]);
    assert!(entries(&got).iter().all(|e| e.replayed));
    assert!(
        c.node(1)
            .queues()
            .iter()
            .all(|q| q.durable_id.as_deref() != Some("d1"))
    );
    d.close(false).await.unwrap();
    c.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn expiry_and_drop_free_the_id_cluster_wide() {
    let c = TestCluster::start(3).await;
    c.leader().await;
    let meta = |i: usize| c.node(i).cluster().unwrap().clone();

    // Expiry on its node removes the placement everywhere; the next connection, through any
    // node, learns `expired` once and starts a new queue where it landed.
    let d = builder(c.node(0)).durable("x", 1).connect().await.unwrap();
    d.close(true).await.unwrap();
    let m1 = meta(1);
    eventually("placement removed after expiry", || {
        m1.placement("x").is_none()
    })
    .await;
    let d = builder(c.node(1))
        .durable("x", 300)
        .connect()
        .await
        .unwrap();
    assert_eq!(d.queue_status(), QueueStatus::Expired);
    assert_eq!(d.server_addr(), c.node(1).addr());
    d.close(true).await.unwrap();
    let d = builder(c.node(2))
        .durable("x", 300)
        .connect()
        .await
        .unwrap();
    assert_eq!(
        (d.queue_status(), d.server_addr()),
        (QueueStatus::Resumed, c.node(1).addr())
    );

    // Closing with drop frees the id too.
    d.close(false).await.unwrap();
    let m2 = meta(2);
    eventually("placement removed after drop", || {
        m2.placement("x").is_none()
    })
    .await;
    let d = builder(c.node(2))
        .durable("x", 300)
        .connect()
        .await
        .unwrap();
    assert_eq!(
        (d.queue_status(), d.server_addr()),
        (QueueStatus::New, c.node(2).addr())
    );
    d.close(false).await.unwrap();
    c.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn away_queues_placed_on_one_node_are_handed_over_to_the_others() {
    const QUEUES: usize = 12;
    const STALE_RETRIES_MAX: usize = 5;
    // Only the giver rebalances: the takers need no rebalancing of their own (a node with
    // `rebalance = false` still takes what others hand it, docs/cluster.md).
    let c = TestCluster::start_tweaked(3, |cfg| {
        cfg.rebalance = cfg.node_id.as_deref() == Some("n1")
    })
    .await;
    c.leader().await;
    let ids: Vec<String> = (0..QUEUES).map(|i| format!("r{i}")).collect();
    // Every client reaches node 0 first: every queue is placed there, with a copy elsewhere.
    let mut clients = Vec::new();
    for id in &ids {
        let d = builder(c.node(0))
            .durable(id.clone(), 300)
            .redundancy(1)
            .ack_interval(Duration::from_secs(3_600))
            .connect()
            .await
            .unwrap();
        assert_eq!(d.queue_status(), QueueStatus::New);
        d.region("R").register(Interest::all_keys()).await.unwrap();
        d.ready_for_events().await.unwrap();
        let mut events = d.events().unwrap();
        until_live(&mut events, "R").await;
        clients.push((d, events));
    }
    let p = c.node(0).publisher().await.unwrap();
    for k in ["a0", "a1", "a2"] {
        p.put("R", k, b"v".to_vec()).await.unwrap();
    }
    // Sent; acknowledged by every other client just before it vanishes, never by the rest
    // (the ack interval is an hour, and a crash flushes nothing).
    for (i, (d, mut events)) in clients.into_iter().enumerate() {
        take_events(&mut events, 3).await;
        if i % 2 == 0 {
            events.commit();
            d.ack_now().await.unwrap();
            // An ack has no reply: wait until the primary took it.
            let id = ids[i].as_str();
            eventually("the ack is taken", || {
                c.node(0)
                    .queues()
                    .iter()
                    .any(|q| q.durable_id.as_deref() == Some(id) && q.pending == 0)
            })
            .await;
        }
        d.crash();
    }
    for k in ["b0", "b1", "b2"] {
        p.put("R", k, b"v".to_vec()).await.unwrap();
    }
    let cluster = c.node(0).cluster().unwrap().clone();
    // Every queue's copy moves to the third node first (as a repair after a failure would):
    // the placements' epochs move on from those the queues were made at.
    // The giver may be rebalancing already (its clients are away): a placement it moved
    // between our read and our write answers `Stale` with the current one, which we retry.
    for id in &ids {
        let mut p = cluster.placement(id).unwrap();
        let mut stale = 0;
        loop {
            let other = (0..3)
                .map(|i| c.node(i).cluster().unwrap().id())
                .find(|n| *n != p.primary && !p.secondaries.contains(n))
                .unwrap();
            let r = cluster
                .write(MetaCommand::SetSecondaries {
                    id: id.clone(),
                    expected_epoch: p.epoch,
                    secondaries: vec![other],
                })
                .await
                .unwrap();
            match r {
                MetaResponse::Placed(_) => break,
                MetaResponse::Stale(Some(current)) if stale < STALE_RETRIES_MAX => {
                    eprintln!("{id}: placement moved under the write ({current:?}); again");
                    stale += 1;
                    p = current;
                }
                r => panic!("{id}: {r:?} after {stale} stale answers"),
            }
        }
    }
    let primaries = |i: usize| {
        let me = c.node(i).cluster().unwrap().id();
        ids.iter()
            .filter(|id| cluster.placement(id).is_some_and(|p| p.primary == me))
            .count()
    };
    eventually("the queues spread over the three nodes", || {
        (0..3).all(|i| primaries(i) >= 2)
    })
    .await;
    // Each moved queue has its copy back (synced): redundancy is kept through the move.
    eventually("every queue has a synced copy again", || {
        ids.iter().all(|id| {
            cluster
                .placement(id)
                .is_some_and(|p| p.secondaries.len() == 1 && p.syncing.is_empty())
        })
    })
    .await;
    let counts: Vec<usize> = (0..3).map(primaries).collect();
    assert_eq!(counts.iter().sum::<usize>(), QUEUES, "{counts:?}");

    let mut redirected = 0;
    for (i, id) in ids.iter().enumerate() {
        let acked = i % 2 == 0;
        let d = builder(c.node(0))
            .durable(id.clone(), 300)
            .redundancy(1)
            .connect()
            .await
            .unwrap();
        if d.server_addr() != c.node(0).addr() {
            redirected += 1;
        }
        // Attached, the queue no longer moves: its client is on its primary. (Rebalancing may
        // still have been moving queues off node 0 when the counts were taken.)
        let primary = cluster.placement(id).expect("placed").primary;
        assert_eq!(d.server_addr(), c.node(c.index_of(primary)).addr(), "{id}");
        // The acks reached the node that took the queue over.
        assert_eq!(
            (d.queue_status(), d.pending()),
            (QueueStatus::Resumed, Some(if acked { 3 } else { 6 })),
            "{id}"
        );
        d.ready_for_events().await.unwrap();
        let got = until_live(&mut d.events().unwrap(), "R").await;
        let got: Vec<(&str, bool, bool)> = entries(&got)
            .iter()
            .map(|e| (e.key.as_str(), e.replayed, e.possible_duplicate))
            .collect();
        // Where the queue stayed, what was sent is flagged and what was queued while the client
        // was away is not; a node that took the queue over flags everything it holds, as after
        // a failover (see `server/rebalance.rs`).
        let moved = d.server_addr() != c.node(0).addr();
        let sent = [("a0", true, true), ("a1", true, true), ("a2", true, true)];
        let queued = [
            ("b0", true, moved),
            ("b1", true, moved),
            ("b2", true, moved),
        ];
        let want: Vec<_> = if acked {
            queued.to_vec()
        } else {
            sent.iter().chain(&queued).copied().collect()
        };
        assert_eq!(got, want, "{id}");
        d.close(false).await.unwrap();
    }
    assert!(redirected >= QUEUES - counts[0], "{redirected} {counts:?}");
    c.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_rebalancing_off_queues_stay_where_they_were_placed() {
    const QUEUES: usize = 12;
    let c = TestCluster::start_tweaked(3, |cfg| cfg.rebalance = false).await;
    c.leader().await;
    let ids: Vec<String> = (0..QUEUES).map(|i| format!("s{i}")).collect();
    // As in the test above: every queue is placed on node 0 and its client goes away, so a
    // rebalancing node would hand most of them to the others within a round or two.
    for id in &ids {
        let d = durable(c.node(0), id).await;
        d.region("R").register(Interest::all_keys()).await.unwrap();
        d.ready_for_events().await.unwrap();
        until_live(&mut d.events().unwrap(), "R").await;
        d.crash();
    }
    let cluster = c.node(0).cluster().unwrap().clone();
    let n0 = cluster.id();
    // Everything a move needs is there: each queue is away with a synced copy on another node.
    eventually("every queue is away with a synced copy", || {
        let away = c
            .node(0)
            .queues()
            .iter()
            .filter(|q| q.role == "primary" && q.state == "away")
            .count();
        away == QUEUES
            && ids.iter().all(|id| {
                cluster.placement(id).is_some_and(|p| {
                    p.primary == n0 && p.secondaries.len() == 1 && p.syncing.is_empty()
                })
            })
    })
    .await;
    // Rounds would have run several times over by now.
    tokio::time::sleep(Duration::from_millis(
        5 * tether::server::REBALANCE_INTERVAL_MS,
    ))
    .await;
    for i in 0..3 {
        let here = c.node(i).cluster().unwrap();
        for id in &ids {
            assert_eq!(here.placement(id).unwrap().primary, n0, "{id} on node {i}");
        }
    }
    // And each client finds its queue where it left it.
    for id in &ids {
        let d = durable(c.node(0), id).await;
        assert_eq!(d.server_addr(), c.node(0).addr(), "{id}");
        assert_eq!(d.queue_status(), QueueStatus::Resumed, "{id}");
        d.close(false).await.unwrap();
    }
    c.shutdown().await;
}

/// A builder trying the cluster's nodes in the order `first`, then the others.
fn builder_from(c: &TestCluster, first: usize) -> ClientBuilder {
    let order = std::iter::once(first).chain((0..3).filter(move |&i| i != first));
    ClientBuilder::new()
        .servers(order.map(|i| c.node(i).addr()))
        .ca_file(c.node(0).ca_file())
        .ack_interval(Duration::from_millis(50))
}

/// The keys of puts of region R `{prefix}{0..n}`.
fn keys(prefix: &str, n: usize) -> Vec<String> {
    (0..n).map(|i| format!("{prefix}{i}")).collect()
}

/// `tether cluster drain` (issue 25 #3, first step): a drained member hands every queue it is
/// primary of (its clients connected or away; one queue without copies) and every copy it
/// holds to the other members. Connected clients move to the new primaries; an away client
/// comes back through the drained node to its queue's new primary; nothing is lost, and an
/// event shown twice is flagged. The drained node places no new queue; undrained, it does.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_drained_member_hands_its_queues_and_copies_away_losing_nothing() {
    const CONNECTED: usize = 3;
    const EVENTS: usize = 3;
    // Rebalancing off: only the drain moves queues.
    let c = TestCluster::start_tweaked(3, |cfg| cfg.rebalance = false).await;
    c.leader().await;
    let n1 = c.node(0).addr();
    let policy = tether::client::ReconnectPolicy {
        delay_initial: Duration::from_millis(100),
        delay_max: Duration::from_millis(500),
        ..Default::default()
    };
    // Queues placed on n1 whose clients stay connected (reconnecting subscriptions)...
    let mut subs = Vec::new();
    for id in keys("c", CONNECTED) {
        let sub = builder_from(&c, 0)
            .durable(id, 300)
            .redundancy(1)
            .reconnect(policy.clone())
            .subscribe([("R".to_string(), Interest::all_keys())])
            .await
            .unwrap();
        assert_eq!(sub.client().unwrap().server_addr(), n1);
        subs.push(sub);
    }
    // ...queues placed on n1 whose clients are away (one without copies)...
    let mut away = vec![
        ("a0".to_string(), 1),
        ("a1".to_string(), 1),
        ("z0".to_string(), 0),
    ];
    // ...and queues placed on n2 with their copy on n1 (copies go to the members with the
    // highest rendezvous hash of (id, member name)).
    let hash = tether::control::reconcile::rendezvous_key;
    let copied_on_n1: Vec<String> = (0..)
        .map(|k| format!("k{k}"))
        .filter(|id| hash(id, "n1") > hash(id, "n3"))
        .take(2)
        .collect();
    for (id, redundancy) in &away {
        let d = builder_from(&c, 0)
            .durable(id.clone(), 300)
            .redundancy(*redundancy)
            .connect()
            .await
            .unwrap();
        assert_eq!(d.server_addr(), n1);
        d.region("R").register(Interest::all_keys()).await.unwrap();
        d.close(true).await.unwrap();
    }
    let cluster = c.node(0).cluster().unwrap().clone();
    let me = cluster.id();
    for id in &copied_on_n1 {
        let d = builder_from(&c, 1)
            .durable(id.clone(), 300)
            .redundancy(1)
            .connect()
            .await
            .unwrap();
        d.region("R").register(Interest::all_keys()).await.unwrap();
        d.close(true).await.unwrap();
        let p = cluster.placement(id).unwrap();
        assert_eq!(p.secondaries, vec![me], "{id}");
    }
    away.extend(copied_on_n1.iter().map(|id| (id.clone(), 1)));
    // The connected clients read all along, as an application does (a subscription reconnects
    // as it is read), until they saw every event; one shown twice must be flagged.
    let readers: Vec<_> = subs
        .into_iter()
        .map(|mut sub| {
            let all: Vec<String> = ["x", "y", "w"]
                .iter()
                .flat_map(|p| keys(p, EVENTS))
                .collect();
            tokio::spawn(async move {
                let mut seen = std::collections::HashSet::new();
                let mut reconnects = 0;
                while !all.iter().all(|k| seen.contains(k)) {
                    match sub.next().await {
                        Some(tether::client::ClientEvent::Event(e)) => assert!(
                            seen.insert(e.key.clone()) || e.possible_duplicate,
                            "{} shown twice without the flag",
                            e.key
                        ),
                        Some(tether::client::ClientEvent::Reconnected { .. }) => reconnects += 1,
                        Some(_) => {}
                        None => panic!("the subscription ended"),
                    }
                }
                (sub, reconnects)
            })
        })
        .collect();

    let publisher = c.node(1).publisher().await.unwrap();
    for k in keys("x", EVENTS) {
        publisher.put("R", &k, b"v".to_vec()).await.unwrap();
    }
    let admin = builder(c.node(1)).connect().await.unwrap();
    let report = admin.drain("n1", Some(true)).await.unwrap();
    assert!(report.draining, "{report:?}");
    assert!(report.primaries >= 6 && report.copies >= 2, "{report:?}");
    for k in keys("y", EVENTS) {
        publisher.put("R", &k, b"v".to_vec()).await.unwrap();
    }
    let started = std::time::Instant::now();
    loop {
        let r = admin.drain("n1", None).await.unwrap();
        if r.primaries == 0 && r.copies == 0 {
            assert!(r.draining);
            break;
        }
        assert!(
            started.elapsed() < Duration::from_secs(60),
            "not drained: {r:?}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    eprintln!("drained in {:?}", started.elapsed());
    // Delivered by the new primaries only.
    for k in keys("w", EVENTS) {
        publisher.put("R", &k, b"v".to_vec()).await.unwrap();
    }

    let all: Vec<String> = ["x", "y", "w"]
        .iter()
        .flat_map(|p| keys(p, EVENTS))
        .collect();
    for reader in readers {
        let (sub, reconnects) = tokio::time::timeout(Duration::from_secs(30), reader)
            .await
            .expect("every connected client gets every event")
            .unwrap();
        assert_ne!(sub.client().unwrap().server_addr(), n1);
        assert!(reconnects >= 1);
        sub.close(false).await.unwrap();
    }
    for (id, _) in &away {
        let d = builder_from(&c, 0)
            .durable(id.clone(), 300)
            .redundancy(1)
            .connect()
            .await
            .unwrap();
        assert_ne!(d.server_addr(), n1, "{id}");
        assert_eq!(
            (d.queue_status(), d.pending()),
            (QueueStatus::Resumed, Some(all.len() as u64)),
            "{id}"
        );
        d.ready_for_events().await.unwrap();
        let got = until_live(&mut d.events().unwrap(), "R").await;
        let got: Vec<&str> = entries(&got).iter().map(|e| e.key.as_str()).collect();
        assert_eq!(got, all, "{id}");
        d.close(false).await.unwrap();
    }
    // A new queue is not placed on the drained member...
    let d = builder_from(&c, 0)
        .durable("new0", 300)
        .connect()
        .await
        .unwrap();
    assert_eq!(d.queue_status(), QueueStatus::New);
    assert_ne!(d.server_addr(), n1);
    d.close(false).await.unwrap();
    // ...until it is undrained.
    let report = admin.drain("n1", Some(false)).await.unwrap();
    assert!(!report.draining);
    eventually("n1 applies the undrain", || {
        cluster.read(|s| s.draining.is_empty())
    })
    .await;
    let d = builder_from(&c, 0)
        .durable("new1", 300)
        .connect()
        .await
        .unwrap();
    assert_eq!(d.server_addr(), n1);
    d.close(false).await.unwrap();
    admin.close(false).await.unwrap();
    c.shutdown().await;
}

/// Connects durable client `id` (redundancy 1) through `node`, retrying while the node
/// answers `unavailable` (a queue of the id just ended there and the removal of its placement
/// is not settled yet: `placement::Releasing`).
async fn durable_when_available(node: &Node, id: &str) -> tether::client::Client {
    let deadline = tokio::time::Instant::now() + common::WAIT;
    loop {
        match durable_builder(node, id).connect().await {
            Ok(d) => return d,
            Err(tether::client::ClientError::Server(e))
                if e.code == tether::protocol::ErrorCode::Unavailable
                    && tokio::time::Instant::now() < deadline =>
            {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            Err(e) => panic!("durable client {id} could not connect: {e:?}"),
        }
    }
}

/// A queue dropped by its client (`close(false)`) and opened again at once, on the same node,
/// again and again: the removal of the old placement commits in the background
/// (`placement::forget`) and the node refuses a new queue of the id until it has settled
/// (`unavailable`, retried here). Each new queue is checked through another node: its client,
/// away, comes back there and is redirected to it, resumed with exactly what was published
/// meanwhile. On loopback the removal commits before the new hello arrives: this test passes
/// with that refusal turned off too (tried, 4 runs), so it covers the drop-and-reopen path end
/// to end but not the late commit the refusal guards against (the cluster simulation's
/// `releasing` does).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_queue_dropped_and_opened_again_at_once_keeps_its_new_placement() {
    let c = TestCluster::start(3).await;
    c.leader().await;
    let p = c.node(2).publisher().await.unwrap();
    const ROUNDS: usize = 8;
    let mut d = durable(c.node(0), "again").await;
    for round in 0..ROUNDS {
        assert_eq!(d.queue_status(), QueueStatus::New, "round {round}");
        assert_eq!(d.server_addr(), c.node(0).addr(), "round {round}");
        d.region("R").register(Interest::all_keys()).await.unwrap();
        d.ready_for_events().await.unwrap();
        until_live(&mut d.events().unwrap(), "R").await;
        d.close(true).await.unwrap();
        // Away: published through another node, forwarded to the queue's.
        for i in 0..3 {
            p.put("R", &format!("r{round}-k{i}"), b"v".to_vec())
                .await
                .unwrap();
        }
        eventually("the away queue holds the forwarded events", || {
            c.node(0)
                .queues()
                .iter()
                .any(|q| q.durable_id.as_deref() == Some("again") && q.pending == 3)
        })
        .await;
        // Back through node 1: redirected to node 0, the queue there with its three events
        // (and no other round's).
        let back = durable(c.node(1), "again").await;
        assert_eq!(
            (back.queue_status(), back.server_addr()),
            (QueueStatus::Resumed, c.node(0).addr()),
            "round {round}: the new queue's placement was lost"
        );
        back.ready_for_events().await.unwrap();
        let got = take_events(&mut back.events().unwrap(), 3).await;
        let keys: Vec<String> = entries(&got).iter().map(|e| e.key.clone()).collect();
        let want: Vec<String> = (0..3).map(|i| format!("r{round}-k{i}")).collect();
        assert_eq!(keys, want, "round {round}");
        assert!(entries(&got).iter().all(|e| e.replayed), "round {round}");
        // Dropped, and opened again at once where it was.
        back.close(false).await.unwrap();
        d = durable_when_available(c.node(0), "again").await;
    }
    d.close(false).await.unwrap();
    c.shutdown().await;
}
