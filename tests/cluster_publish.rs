//! Publish forwarding across a cluster of three real nodes (QUIC with mutual TLS, RocksDB):
//! an event published on any node reaches the queues of every other node, the events of one
//! publisher stay in order, and publishes made while a node is down reach it when it returns
//! (each origin keeps them in its durable publish log until every peer applied them).

mod common;

use std::time::Duration;

use tether::client::{ClientBuilder, ClientEvent, EventStream, Interest};
use tether::protocol::QueueStatus;
use tether::server::Node;

use common::cluster::{TestCluster, share_ca};
use common::{entries, take_events, value};

fn builder(node: &Node) -> ClientBuilder {
    ClientBuilder::new()
        .server(node.addr())
        .ca_file(node.ca_file())
        .ack_interval(Duration::from_millis(50))
}

/// A client of `node` with all-keys interest in region R, ready, and its events: durable
/// (`id`, 300 s) when `id` is given.
async fn subscribed(node: &Node, id: Option<&str>) -> (tether::client::Client, EventStream) {
    let b = builder(node);
    let b = match id {
        Some(id) => b.durable(id, 300),
        None => b,
    };
    let client = b.connect().await.unwrap();
    client
        .region("R")
        .register(Interest::all_keys())
        .await
        .unwrap();
    client.ready_for_events().await.unwrap();
    let events = client.events().unwrap();
    (client, events)
}

/// Puts `{prefix}-{i}` = `i` for i in range, through node `node`'s embedded publisher.
async fn put_range(node: &Node, region: &str, prefix: &str, range: std::ops::Range<u32>) {
    let p = node.publisher().await.expect("publisher");
    for i in range {
        p.put(region, &format!("{prefix}-{i}"), i.to_string().into_bytes())
            .await
            .expect("put");
    }
}

/// The values of the events with keys starting with `prefix`, in arrival order.
fn values_of(evs: &[ClientEvent], prefix: &str) -> Vec<u32> {
    entries(evs)
        .into_iter()
        .filter(|e| e.key.starts_with(prefix))
        .map(|e| value(e).expect("a value").parse().expect("a number"))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn events_published_anywhere_reach_every_node_in_publisher_order() {
    let c = TestCluster::start(3).await;
    c.leader().await;
    // A durable subscriber on node 0, a non-durable one on node 2.
    let (d, mut ds) = subscribed(c.node(0), Some("sub")).await;
    let (nd, mut nds) = subscribed(c.node(2), None).await;

    // Two publishers on two other nodes, concurrently.
    let (n1, n2) = (c.node(1), c.node(2));
    tokio::join!(
        put_range(n1, "R", "b", 0..300),
        put_range(n2, "R", "c", 0..300)
    );

    let mut ids = Vec::new();
    for stream in [&mut ds, &mut nds] {
        let got = take_events(stream, 600).await;
        // An event keeps the id its origin gave it, on every node.
        for e in entries(&got) {
            let origin = if e.key.starts_with("b-") { "n2" } else { "n3" };
            assert_eq!(e.event_id.node, origin, "{e:?}");
        }
        let mut these: Vec<_> = entries(&got)
            .iter()
            .map(|e| (e.event_id.node.clone(), e.event_id.session, e.event_id.seq))
            .collect();
        these.sort();
        ids.push(these);
        let (b, cc) = (values_of(&got, "b-"), values_of(&got, "c-"));
        assert_eq!(
            b,
            (0..300).collect::<Vec<_>>(),
            "publisher on node 1 in order"
        );
        assert_eq!(
            cc,
            (0..300).collect::<Vec<_>>(),
            "publisher on node 2 in order"
        );
    }
    assert_eq!(ids[0], ids[1], "both nodes saw the same event ids");
    // Region data is on every node too.
    assert_eq!(c.node(0).get("R", "b-299").unwrap(), Some(b"299".to_vec()));
    drop(ds);
    drop(nds);
    d.close(true).await.unwrap();
    nd.close(false).await.unwrap();
    c.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn publishes_made_while_a_node_is_down_reach_it_when_it_returns() {
    let mut c = TestCluster::start(3).await;
    c.leader().await;
    let (d, mut s) = subscribed(c.node(0), Some("away")).await;
    put_range(c.node(1), "R", "k", 0..10).await;
    assert_eq!(
        values_of(&take_events(&mut s, 10).await, "k-"),
        (0..10).collect::<Vec<_>>()
    );
    drop(s);
    d.close(true).await.unwrap();

    // Node 0 (holding the durable queue) goes down; node 1 keeps publishing.
    c.nodes[0].take().unwrap().shutdown().await;
    put_range(c.node(1), "R", "k", 10..210).await;
    let node = c.boot(0).await;
    c.nodes[0] = Some(node);

    let d = builder(c.node(0))
        .durable("away", 300)
        .connect()
        .await
        .unwrap();
    assert_eq!(d.queue_status(), QueueStatus::Resumed);
    d.ready_for_events().await.unwrap();
    // Everything published while the node was down arrives, in order; the only other
    // events are redeliveries of unacknowledged ones, flagged as such.
    let mut s = d.events().unwrap();
    let mut got = Vec::new();
    while !entries(&got).iter().any(|e| e.key == "k-209") {
        got.extend(take_events(&mut s, 1).await);
    }
    let (dups, fresh): (Vec<_>, Vec<_>) = got
        .into_iter()
        .partition(|e| matches!(e, ClientEvent::Event(ev) if ev.possible_duplicate));
    assert!(values_of(&dups, "k-").iter().all(|v| *v < 10), "{dups:?}");
    assert_eq!(values_of(&fresh, "k-"), (10..210).collect::<Vec<_>>());
    d.close(false).await.unwrap();
    c.shutdown().await;
}

/// The publish log is bounded: while a peer is down, a node keeps its publishes for it up to
/// `publish-log-bytes-max`, then refuses new ones with `unavailable` (naming the peer) rather
/// than accept a publish it could not keep; when the peer returns it gets every accepted
/// publish and publishing resumes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn publish_log_limit_refuses_publishes_while_a_peer_is_away_and_loses_none() {
    const LIMIT: u64 = 64 * 1024;
    let limits = tether::config::Limits {
        publish_log_bytes_max: LIMIT,
        ..Default::default()
    };
    let mut c = TestCluster::start_with(3, limits).await;
    c.leader().await;
    c.nodes[0].take().unwrap().shutdown().await;
    let p = c.node(1).publisher().await.expect("publisher");
    let mut accepted = 0u32;
    let refusal = loop {
        match p.put("R", &format!("k-{accepted}"), vec![7; 1024]).await {
            Ok(_) => accepted += 1,
            Err(e) => break e,
        }
        assert!(accepted < 1_000, "the publish log limit never applied");
    };
    assert_eq!(
        refusal.code,
        tether::protocol::ErrorCode::Unavailable,
        "{refusal:?}"
    );
    assert!(
        refusal.message.contains("publish log is full") && refusal.message.contains("n1"),
        "{}",
        refusal.message
    );
    // About the limit's worth was kept (1 KiB values), not more.
    assert!((50..=70).contains(&accepted), "{accepted} publishes kept");
    // The refused publish changed nothing, on this node or its live peer.
    assert_eq!(c.node(1).get("R", &format!("k-{accepted}")).unwrap(), None);

    // The peer returns: it receives every accepted publish, and publishing resumes.
    let node = c.boot(0).await;
    c.nodes[0] = Some(node);
    let last = format!("k-{}", accepted - 1);
    common::eventually("the returning peer applies the kept publishes", || {
        c.node(0).get("R", &last).unwrap().is_some()
    })
    .await;
    for i in 0..accepted {
        assert_eq!(
            c.node(0).get("R", &format!("k-{i}")).unwrap(),
            Some(vec![7; 1024]),
            "k-{i} on the returning peer"
        );
    }
    let deadline = tokio::time::Instant::now() + common::WAIT;
    loop {
        match p.put("R", "after", b"x".to_vec()).await {
            Ok(_) => break,
            Err(e) if tokio::time::Instant::now() < deadline => {
                assert_eq!(e.code, tether::protocol::ErrorCode::Unavailable, "{e:?}");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            Err(e) => panic!("publishing did not resume: {e:?}"),
        }
    }
    c.shutdown().await;
}

/// A member that lost its data directory and comes back under its name starts a new publish
/// log: its peers take it from its start. Before, its new log counted from 1 again and every
/// peer, having applied the old one further, skipped its first publishes as applied: they were
/// acknowledged (`--ack local`) and never reached the queues of the other nodes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_member_that_lost_its_data_directory_forwards_its_new_publishes() {
    let mut c = TestCluster::start(3).await;
    c.leader().await;
    let (d, mut s) = subscribed(c.node(1), Some("sub")).await;
    put_range(c.node(0), "R", "a", 0..20).await;
    let before = take_events(&mut s, 20).await;
    assert_eq!(values_of(&before, "a-"), (0..20).collect::<Vec<_>>());

    // Node 0 stops and loses its data directory (its certificate authority aside: the
    // cluster's, which it signs its own certificate with), then starts again under its name.
    c.nodes[0].take().unwrap().shutdown().await;
    let dir = c.dirs[0].path().to_path_buf();
    let ca = tempfile::tempdir().unwrap();
    share_ca(&dir, ca.path());
    std::fs::remove_dir_all(&dir).unwrap();
    std::fs::create_dir_all(&dir).unwrap();
    share_ca(ca.path(), &dir);
    let node = c.boot(0).await;
    c.nodes[0] = Some(node);

    put_range(c.node(0), "R", "b", 0..10).await;
    let got = take_events(&mut s, 10).await;
    assert_eq!(
        values_of(&got, "b-"),
        (0..10).collect::<Vec<_>>(),
        "{got:?}"
    );
    for e in entries(&got) {
        assert_eq!(e.event_id.node, "n1", "{e:?}");
    }
    // Its new publisher sessions are not its old ones: no event id repeats.
    let sessions = |evs: &[ClientEvent]| -> std::collections::BTreeSet<u64> {
        entries(evs).iter().map(|e| e.event_id.session).collect()
    };
    assert!(
        sessions(&before).is_disjoint(&sessions(&got)),
        "session ids reused after the lost data directory: {:?} then {:?}",
        sessions(&before),
        sessions(&got)
    );
    // The region copies of the other nodes have them too.
    for i in [1, 2] {
        common::eventually("the other nodes' regions hold the new publishes", || {
            c.node(i).get("R", "b-9").unwrap() == Some(b"9".to_vec())
        })
        .await;
    }
    drop(s);
    d.close(true).await.unwrap();
    c.shutdown().await;
}
