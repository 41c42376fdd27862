//! kill -9 in a cluster of three real `tether server` processes (QUIC with mutual TLS,
//! RocksDB): acknowledged publishes survive the death of the node they were published on
//! (its publish log forwards them after restart) and of the node whose queue receives them
//! (it applies each forwarded publish once), in publisher order.

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use tether::client::{ClientEvent, Interest};
use tether::protocol::QueueStatus;

use common::cluster::ProcCluster;
use common::{ServerProc, take_events};

/// Events published in the test.
const EVENTS: u32 = 10_000;
/// Operations per publish request.
const OPS_PER_PUBLISH: u32 = 20;

/// Publishes puts `k-{from..to}` through `server`, each request acknowledged before the next;
/// returns how many were acknowledged before an error.
async fn publish(server: &ServerProc, from: u32, to: u32, progress: &AtomicU32) -> u32 {
    common::cluster::publish_numbered(server.builder(), from, to, OPS_PER_PUBLISH, progress).await
}

/// Receives until key `k-{last}` arrived; returns the values not flagged as possible
/// duplicates, in arrival order (duplicates must be flagged and already seen).
async fn receive_through(server: &ServerProc, last: u32) -> Vec<u32> {
    let d = server
        .builder()
        .durable("d", 300)
        .ack_interval(Duration::from_millis(20))
        .connect()
        .await
        .expect("subscriber connects");
    assert_eq!(d.queue_status(), QueueStatus::Resumed);
    d.ready_for_events().await.unwrap();
    let mut s = d.events().unwrap();
    let mut fresh = Vec::new();
    let target = format!("k-{last}");
    loop {
        let mut done = false;
        for ev in take_events(&mut s, 1).await {
            let ClientEvent::Event(e) = ev else { continue };
            let v: u32 = String::from_utf8(e.value.clone().unwrap())
                .unwrap()
                .parse()
                .unwrap();
            if e.possible_duplicate {
                assert!(fresh.contains(&v), "an unseen event flagged duplicate: {v}");
            } else {
                fresh.push(v);
            }
            done |= e.key == target;
        }
        if done {
            break;
        }
    }
    drop(s);
    d.close(true).await.unwrap();
    fresh
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn acknowledged_publishes_survive_kill_9_of_origin_and_receiver() {
    let mut p = ProcCluster::start(3);
    // The durable subscriber's queue lives on n1.
    let d = p
        .get(0)
        .builder()
        .durable("d", 300)
        .connect()
        .await
        .unwrap();
    d.region("R").register(Interest::all_keys()).await.unwrap();
    d.ready_for_events().await.unwrap();
    d.close(true).await.unwrap();

    // 1. Publish on n2, kill -9 n2 right after the last acknowledgement (forwarding to n1 is
    //    typically still under way), restart it: its publish log forwards the rest.
    let half = EVENTS / 2;
    let progress = Arc::new(AtomicU32::new(0));
    assert_eq!(publish(p.get(1), 0, half, &progress).await, half);
    p.procs[1].take().unwrap().kill9();
    p.procs[1] = Some(p.spawn(1));

    // 2. Publish on n3 while n1 (the receiver) is killed midway and restarted.
    let publisher = tokio::spawn({
        let s = p.procs[2].take().unwrap();
        let progress = progress.clone();
        async move {
            let n = publish(&s, half, EVENTS, &progress).await;
            (s, n)
        }
    });
    while progress.load(Ordering::SeqCst) < half + EVENTS / 10 {
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    p.procs[0].take().unwrap().kill9();
    let at_kill = progress.load(Ordering::SeqCst);
    p.procs[0] = Some(p.spawn(0));
    let (s, n) = publisher.await.unwrap();
    p.procs[2] = Some(s);
    assert_eq!(n, EVENTS, "publishing on n3 is not affected by n1's death");
    assert!(
        at_kill < EVENTS,
        "n1 was killed while n3 was still publishing"
    );

    // Every acknowledged publish arrives once (flagged redeliveries aside), in publisher order.
    let got = receive_through(p.get(0), EVENTS - 1).await;
    let seen: std::collections::HashSet<u32> = got.iter().copied().collect();
    let missing: Vec<u32> = (0..EVENTS).filter(|v| !seen.contains(v)).take(20).collect();
    // Each publisher's events in its order (n2 published below `half`, n3 from it on); the
    // two publishers' events may interleave (n2's tail waits for its restart).
    let from_n2: Vec<u32> = got.iter().copied().filter(|&v| v < half).collect();
    let from_n3: Vec<u32> = got.iter().copied().filter(|&v| v >= half).collect();
    let disorder = from_n2
        .windows(2)
        .position(|w| w[1] != w[0] + 1)
        .or_else(|| from_n3.windows(2).position(|w| w[1] != w[0] + 1));
    assert!(
        missing.is_empty() && got.len() == EVENTS as usize && disorder.is_none(),
        "{} received, {} distinct; first missing {missing:?}; first break in order at {:?}: {:?}",
        got.len(),
        seen.len(),
        disorder,
        disorder.map(|i| (from_n2.get(i..i + 2), from_n3.get(i..i + 2))),
    );
}
