//! Durable queues in a cluster of three real nodes: a queue is placed (through the metadata
//! consensus) on the node its client first reaches; a client that comes back through another
//! node is redirected there and resumes with the exact pending count; a queue that expires or
//! is dropped frees its id cluster-wide.

mod common;

use std::time::Duration;

use tether::client::{ClientBuilder, Interest};
use tether::protocol::QueueStatus;
use tether::server::Node;

use common::cluster::TestCluster;
use common::{entries, eventually, take_events};

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
