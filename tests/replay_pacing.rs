//! A replay paced at the rate its client asked for (`ClientBuilder::replay_rate`,
//! `Client::set_replay_rate`), against a real node (RocksDB in a temp dir, QUIC+TLS on
//! loopback). Pacing is checked only as a lower bound on the replay's duration, which a slow
//! machine can only lengthen.

mod common;

use std::time::{Duration, Instant};

use common::{TestNode, WAIT};
use tether::client::{ClientEvent, Event, EventStream, Interest};

const REGION: &str = "R";

/// The replayed events until the live marker; panics on anything else.
async fn replay_until_live(events: &mut EventStream) -> Vec<Event> {
    let mut got = Vec::new();
    loop {
        match tokio::time::timeout(WAIT, events.next()).await {
            Ok(Some(ClientEvent::Event(e))) => {
                assert!(e.replayed, "{e:?} before the live marker is replayed");
                got.push(e);
            }
            Ok(Some(ClientEvent::Live { .. })) => return got,
            Ok(other) => panic!("unexpected {other:?}"),
            Err(_) => panic!("no event for {WAIT:?} after {} replayed", got.len()),
        }
    }
}

/// A queue of 600 events replayed at 1,000 events/s: all of them, in order, flagged replayed,
/// taking at least the rate's time beyond the first burst (100 events); live events after the
/// marker are delivered unflagged.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_paced_replay_keeps_its_rate_and_loses_nothing() {
    const EVENTS: u32 = 600;
    const RATE: u64 = 1_000;
    let n = TestNode::start().await;
    common::park(n.builder().durable("paced", 300), REGION).await;
    n.put_many(REGION, 0..EVENTS).await;
    let c = n
        .builder()
        .durable("paced", 300)
        .replay_rate(RATE)
        .connect()
        .await
        .unwrap();
    assert_eq!(c.pending(), Some(u64::from(EVENTS)));
    let mut events = c.events().unwrap();
    let started = Instant::now();
    c.ready_for_events().await.unwrap();
    let got = replay_until_live(&mut events).await;
    let took = started.elapsed();
    let offsets: Vec<u64> = got.iter().map(|e| e.offset).collect();
    assert_eq!(offsets, (1..=u64::from(EVENTS)).collect::<Vec<_>>());
    // The first burst (100 ms of the rate) goes at once; the other 500 events take 500 ms.
    assert!(
        took >= Duration::from_millis(450),
        "600 events at 1,000/s took only {took:?}"
    );
    n.put_many(REGION, 1000..1010).await;
    for i in 1000..1010 {
        match tokio::time::timeout(WAIT, events.next()).await {
            Ok(Some(ClientEvent::Event(e))) => {
                assert_eq!(e.key, format!("key-{i}"));
                assert!(!e.replayed && !e.possible_duplicate, "{e:?}");
            }
            other => panic!("expected live event {i}, got {other:?}"),
        }
    }
    events.commit();
    c.close(false).await.unwrap();
}

/// A replay paced at 1 event/s (200 s for 200 events) speeds up at once when the client lifts
/// the limit mid-replay: the rest arrives well within the test's wait.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lifting_the_rate_mid_replay_applies_at_once() {
    const EVENTS: u32 = 200;
    let n = TestNode::start().await;
    common::park(n.builder().durable("slow", 300), REGION).await;
    n.put_many(REGION, 0..EVENTS).await;
    let c = n
        .builder()
        .durable("slow", 300)
        .replay_rate(1)
        .connect()
        .await
        .unwrap();
    let mut events = c.events().unwrap();
    c.ready_for_events().await.unwrap();
    match tokio::time::timeout(WAIT, events.next()).await {
        Ok(Some(ClientEvent::Event(e))) => assert_eq!(e.offset, 1),
        other => panic!("expected the first event, got {other:?}"),
    }
    c.set_replay_rate(0).await.unwrap();
    let rest = replay_until_live(&mut events).await;
    let offsets: Vec<u64> = rest.iter().map(|e| e.offset).collect();
    assert_eq!(offsets, (2..=u64::from(EVENTS)).collect::<Vec<_>>());
    events.commit();
    c.close(false).await.unwrap();
}

/// Live events are never paced: a session paced at 1 event/s with nothing to replay receives
/// 100 live events well within the test's wait (paced, they would take 100 s).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn live_events_are_never_paced() {
    const EVENTS: u32 = 100;
    let n = TestNode::start().await;
    let c = n
        .builder()
        .durable("live", 300)
        .replay_rate(1)
        .connect()
        .await
        .unwrap();
    c.region(REGION)
        .register(Interest::all_keys())
        .await
        .unwrap();
    let mut events = c.events().unwrap();
    c.ready_for_events().await.unwrap();
    assert!(replay_until_live(&mut events).await.is_empty());
    n.put_many(REGION, 0..EVENTS).await;
    for i in 0..EVENTS {
        match tokio::time::timeout(WAIT, events.next()).await {
            Ok(Some(ClientEvent::Event(e))) => {
                assert_eq!(e.key, format!("key-{i}"));
                assert!(!e.replayed, "{e:?}");
            }
            other => panic!("expected live event {i}, got {other:?}"),
        }
    }
    events.commit();
    c.close(false).await.unwrap();
}
