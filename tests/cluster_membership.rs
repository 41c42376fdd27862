//! Changing a cluster's members while it serves: `tether cluster remove-node` takes a member
//! out of the group for good. A member that is down for good stops costing the others their
//! publish log (they keep nothing more for it, and publishing resumes); a member still holding
//! queues is refused until it has handed them away; the metadata forgets a removed member's
//! copies, and their primaries place new ones. Real nodes over QUIC with RocksDB in temp dirs.

mod common;

use std::time::Duration;

use tether::client::{ClientBuilder, Interest};
use tether::protocol::{ErrorCode, QueueStatus};
use tether::server::Node;

use common::cluster::TestCluster;
use common::{entries, eventually, until_live};

fn builder(node: &Node) -> ClientBuilder {
    ClientBuilder::new()
        .server(node.addr())
        .ca_file(node.ca_file())
        .ack_interval(Duration::from_millis(50))
}

/// A durable id that, placed on `primary`, gets its one copy on `copy` rather than on the
/// third member `other` (copies go to the members with the highest rendezvous hash of
/// (id, member name)).
fn id_copied_on(prefix: &str, copy: &str, other: &str) -> String {
    let hash = |id: &str, name: &str| tether::cluster::meta::fnv1a(&format!("{id}\u{0}{name}"));
    (0..)
        .map(|k| format!("{prefix}{k}"))
        .find(|id| hash(id, copy) > hash(id, other))
        .unwrap()
}

fn member_names(node: &Node) -> Vec<String> {
    let members = node.cluster().unwrap().members();
    let mut names: Vec<String> = members.nodes.values().map(|n| n.name.clone()).collect();
    names.sort();
    names
}

/// A member down for good fills the other members' publish logs (they keep every publish for
/// it) until they refuse publishes; removing it releases what was kept for it, publishing
/// resumes without it, its copies are dropped and placed again on a live member, and the
/// queue whose copy it held loses nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn removing_a_member_that_is_gone_releases_its_publish_log_and_its_copies() {
    const LIMIT: u64 = 64 * 1024;
    let limits = tether::config::Limits {
        publish_log_bytes_max: LIMIT,
        ..Default::default()
    };
    let mut c = TestCluster::start_with(3, limits).await;
    c.leader().await;
    // A queue on n2 whose copy is on n1, its client away.
    let id = id_copied_on("q", "n1", "n3");
    let d = builder(c.node(1))
        .durable(id.clone(), 300)
        .redundancy(1)
        .connect()
        .await
        .unwrap();
    assert_eq!(d.server_addr(), c.node(1).addr());
    d.region("R").register(Interest::all_keys()).await.unwrap();
    d.close(true).await.unwrap();
    let n1 = tether::cluster::meta::raft_id("n1");
    let cluster = c.node(1).cluster().unwrap().clone();
    eventually("the copy on n1 is in sync", || {
        cluster
            .placement(&id)
            .is_some_and(|p| p.secondaries == vec![n1] && p.syncing.is_empty())
    })
    .await;

    // n1 goes away for good: n2 keeps its publishes for it until its log is full.
    c.nodes[0].take().unwrap().shutdown().await;
    let p = c.node(1).publisher().await.expect("publisher");
    let mut accepted = 0u32;
    let refusal = loop {
        match p.put("R", &format!("k-{accepted:04}"), vec![7; 1024]).await {
            Ok(_) => accepted += 1,
            Err(e) => break e,
        }
        assert!(accepted < 1_000, "the publish log limit never applied");
    };
    assert_eq!(refusal.code, ErrorCode::Unavailable, "{refusal:?}");
    assert!(
        refusal.message.contains("publish log is full") && refusal.message.contains("n1"),
        "{}",
        refusal.message
    );

    // Removed through n3: n1 holds no primary (its only copy is dropped with it).
    let admin = builder(c.node(2)).connect().await.unwrap();
    let members = admin.remove_node("n1").await.unwrap();
    assert_eq!(members, ["n2", "n3"]);
    for i in [1, 2] {
        eventually("the members leave n1 out", || {
            member_names(c.node(i)) == ["n2", "n3"]
        })
        .await;
    }
    // Publishing on n2 resumes without n1 coming back.
    let deadline = tokio::time::Instant::now() + common::WAIT;
    loop {
        match p.put("R", &format!("k-{accepted:04}"), vec![7; 1024]).await {
            Ok(_) => break,
            Err(e) if tokio::time::Instant::now() < deadline => {
                assert_eq!(e.code, ErrorCode::Unavailable, "{e:?}");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            Err(e) => panic!("publishing did not resume after the removal: {e:?}"),
        }
    }
    accepted += 1;
    // Far more than the log held for n1: nothing is kept for it any more.
    for _ in 0..200 {
        p.put("R", &format!("k-{accepted:04}"), vec![7; 1024])
            .await
            .unwrap();
        accepted += 1;
    }
    // The queue's copy went with n1; its primary placed a new one on n3, in sync.
    let n3 = tether::cluster::meta::raft_id("n3");
    eventually("a new copy on n3, in sync", || {
        cluster
            .placement(&id)
            .is_some_and(|p| p.secondaries == vec![n3] && p.syncing.is_empty())
    })
    .await;
    assert!(cluster.read(|s| s.draining.is_empty()), "n1 forgotten");

    // The away client loses nothing.
    let d = builder(c.node(2))
        .durable(id.clone(), 300)
        .redundancy(1)
        .connect()
        .await
        .unwrap();
    assert_eq!(d.server_addr(), c.node(1).addr());
    assert_eq!(
        (d.queue_status(), d.pending()),
        (QueueStatus::Resumed, Some(u64::from(accepted)))
    );
    d.ready_for_events().await.unwrap();
    let got = until_live(&mut d.events().unwrap(), "R").await;
    let got: Vec<String> = entries(&got).iter().map(|e| e.key.clone()).collect();
    let want: Vec<String> = (0..accepted).map(|i| format!("k-{i:04}")).collect();
    assert_eq!(got, want);
    d.close(false).await.unwrap();

    // Removing it again, or any name that is not a member, is refused.
    let e = admin.remove_node("n1").await.unwrap_err();
    assert!(e.to_string().contains("not a member"), "{e}");
    admin.close(false).await.unwrap();
    c.shutdown().await;
}

/// A member that is still the primary of a queue is refused removal (and is draining from
/// then on); once its queues moved, it is removed, and its away client resumes on the new
/// primary with everything.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_member_is_removed_only_once_it_is_the_primary_of_nothing() {
    // Rebalancing off: only the drain moves queues.
    let mut c = TestCluster::start_tweaked(3, |cfg| cfg.rebalance = false).await;
    c.leader().await;
    let d = builder(c.node(2))
        .durable("away", 300)
        .redundancy(1)
        .connect()
        .await
        .unwrap();
    assert_eq!(d.server_addr(), c.node(2).addr());
    d.region("R").register(Interest::all_keys()).await.unwrap();
    d.close(true).await.unwrap();
    let p = c.node(0).publisher().await.unwrap();
    for i in 0..5 {
        p.put("R", &format!("a{i}"), b"v".to_vec()).await.unwrap();
    }

    let admin = builder(c.node(0)).connect().await.unwrap();
    let e = admin.remove_node("n3").await.unwrap_err();
    let tether::client::ClientError::Server(w) = &e else {
        panic!("{e:?}")
    };
    assert_eq!(w.code, ErrorCode::Refused, "{w:?}");
    assert!(w.message.contains("still the primary of 1 queues"), "{w:?}");
    assert_eq!(member_names(c.node(0)), ["n1", "n2", "n3"]);
    // The refused removal left n3 draining: its queue moves away.
    let started = std::time::Instant::now();
    loop {
        let r = admin.drain("n3", None).await.unwrap();
        assert!(r.draining);
        if r.primaries == 0 && r.copies == 0 {
            break;
        }
        assert!(started.elapsed() < common::WAIT, "not drained: {r:?}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    for i in 5..10 {
        p.put("R", &format!("a{i}"), b"v".to_vec()).await.unwrap();
    }
    assert_eq!(admin.remove_node("n3").await.unwrap(), ["n1", "n2"]);
    for i in [0, 1] {
        eventually("the members leave n3 out", || {
            member_names(c.node(i)) == ["n1", "n2"]
        })
        .await;
    }
    c.nodes[2].take().unwrap().shutdown().await;
    for i in 10..15 {
        p.put("R", &format!("a{i}"), b"v".to_vec()).await.unwrap();
    }
    // The metadata group goes on with two members (it elects a leader among them).
    let d = builder(c.node(0))
        .durable("new", 300)
        .connect()
        .await
        .unwrap();
    assert_eq!(d.queue_status(), QueueStatus::New);
    d.close(false).await.unwrap();
    let d = builder(c.node(0))
        .durable("away", 300)
        .redundancy(1)
        .connect()
        .await
        .unwrap();
    assert_eq!(
        (d.queue_status(), d.pending()),
        (QueueStatus::Resumed, Some(15))
    );
    d.ready_for_events().await.unwrap();
    let got = until_live(&mut d.events().unwrap(), "R").await;
    let got: Vec<String> = entries(&got).iter().map(|e| e.key.clone()).collect();
    let want: Vec<String> = (0..15).map(|i| format!("a{i}")).collect();
    assert_eq!(got, want);
    d.close(false).await.unwrap();
    admin.close(false).await.unwrap();
    c.shutdown().await;
}
