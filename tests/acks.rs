//! Explicit acknowledgement ([`AckMode::Manual`]) and client-owned checkpoints, against a real
//! node (RocksDB in a temp dir, QUIC+TLS on loopback).

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::{TestNode, WAIT};
use tether::client::{
    AckMode, ClientError, ClientEvent, Event, EventStream, Interest, StreamBatch,
};
use tether::protocol::EventOp;

const REGION: &str = "R";

async fn next_entry(events: &mut EventStream) -> Option<Event> {
    loop {
        match tokio::time::timeout(WAIT, events.next()).await {
            Ok(Some(ClientEvent::Event(e))) => return Some(e),
            Ok(Some(ClientEvent::Live { .. })) => {}
            Ok(Some(other)) => panic!("unexpected {other:?}"),
            Ok(None) => return None,
            Err(_) => panic!("no event for {WAIT:?}"),
        }
    }
}

/// Everything that arrives until the stream is quiet for [`common::QUIET`].
async fn entries_until_quiet(events: &mut EventStream) -> Vec<Event> {
    let mut out = Vec::new();
    while let Ok(Some(ev)) = tokio::time::timeout(common::QUIET, events.next()).await {
        if let ClientEvent::Event(e) = ev {
            out.push(e);
        }
    }
    out
}

/// A service processes events concurrently (each takes a few milliseconds, they finish out of
/// order) and acks each when its work is done. It crashes with work in progress: the next
/// process gets everything whose work was not finished, so no event's work is lost.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_processing_with_a_crash_in_the_middle_loses_nothing() {
    const TOTAL: u32 = 200;
    const TAKEN_BEFORE_CRASH: usize = 120;
    const STUCK: usize = 10;
    let n = TestNode::start().await;
    let c = n
        .builder()
        .durable("worker", 300)
        .ack_mode(AckMode::Manual)
        .ack_interval(Duration::from_millis(10))
        .connect()
        .await
        .unwrap();
    c.region(REGION)
        .register(Interest::all_keys())
        .await
        .unwrap();
    let mut events = c.events().unwrap();
    c.ready_for_events().await.unwrap();
    n.put_many(REGION, 0..TOTAL).await;
    let done: Arc<Mutex<BTreeSet<String>>> = Arc::default();
    let mut work = tokio::task::JoinSet::new();
    for i in 0..TAKEN_BEFORE_CRASH {
        let e = next_entry(&mut events).await.expect("event");
        let acker = events.acker().unwrap();
        let done = done.clone();
        // Work of uneven length (later events often finish first); the last STUCK events'
        // work is still running at the crash.
        let ms = if i >= TAKEN_BEFORE_CRASH - STUCK {
            3_600_000
        } else {
            (i as u64 * 7919) % 23
        };
        work.spawn(async move {
            tokio::time::sleep(Duration::from_millis(ms)).await;
            done.lock().unwrap().insert(e.key.clone());
            acker.ack(e.offset).expect("ack of a delivered event");
        });
        if i % 10 == 0 {
            tokio::task::yield_now().await;
        }
    }
    // The short work finishes and its acks go out; then the crash (work in progress lost).
    tokio::time::sleep(Duration::from_millis(200)).await;
    work.abort_all();
    while work.join_next().await.is_some() {}
    c.crash();
    let before = done.lock().unwrap().clone();
    assert_eq!(before.len(), TAKEN_BEFORE_CRASH - STUCK);
    // A new process: no memory of the old one.
    let c = n
        .builder()
        .durable("worker", 300)
        .ack_mode(AckMode::Manual)
        .connect()
        .await
        .unwrap();
    let mut events = c.events().unwrap();
    c.ready_for_events().await.unwrap();
    let again = entries_until_quiet(&mut events).await;
    let mut all = before.clone();
    for e in &again {
        all.insert(e.key.clone());
        events.ack(e.offset).unwrap();
    }
    let expected: BTreeSet<String> = (0..TOTAL).map(|i| format!("key-{i}")).collect();
    assert_eq!(all, expected, "the work of some event was lost");
    // What the crashed process had not finished came again, flagged.
    let redelivered = again.iter().filter(|e| e.possible_duplicate).count();
    assert!(redelivered > 0, "nothing was flagged possible_duplicate");
    c.close(false).await.unwrap();
}

/// A service keeps its checkpoint (the cumulative acked offset) in its own database, in the
/// same transaction as the work. Restarted, it presents the checkpoint and gets no event it
/// already applied, though the server never heard its acks.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_client_with_its_checkpoint_gets_no_event_twice() {
    const TOTAL: u32 = 100;
    const APPLIED_BEFORE_CRASH: u32 = 60;
    let n = TestNode::start().await;
    // The application's database: applied keys and the checkpoint, written together.
    let mut applied: BTreeMap<String, u64> = BTreeMap::new();
    let mut checkpoint = 0u64;
    let c = n
        .builder()
        .durable("ledger", 300)
        .ack_mode(AckMode::Manual)
        .ack_interval(Duration::from_secs(3_600)) // the server hears no ack before the crash
        .connect()
        .await
        .unwrap();
    c.region(REGION)
        .register(Interest::all_keys())
        .await
        .unwrap();
    let mut events = c.events().unwrap();
    c.ready_for_events().await.unwrap();
    n.put_many(REGION, 0..TOTAL).await;
    for _ in 0..APPLIED_BEFORE_CRASH {
        let e = next_entry(&mut events).await.expect("event");
        let through = events.ack(e.offset).unwrap();
        applied.insert(e.key.clone(), e.offset);
        checkpoint = through;
    }
    c.crash();
    assert_eq!(checkpoint, u64::from(APPLIED_BEFORE_CRASH));
    let c = n
        .builder()
        .durable("ledger", 300)
        .ack_mode(AckMode::Manual)
        .checkpoint(checkpoint)
        .connect()
        .await
        .unwrap();
    assert_eq!(
        c.pending(),
        Some(u64::from(TOTAL)),
        "the server kept everything"
    );
    let mut events = c.events().unwrap();
    c.ready_for_events().await.unwrap();
    for e in entries_until_quiet(&mut events).await {
        assert!(e.offset > checkpoint, "applied before: {e:?}");
        assert!(
            applied.insert(e.key.clone(), e.offset).is_none(),
            "shown twice: {e:?}"
        );
        events.ack(e.offset).unwrap();
    }
    assert_eq!(applied.len() as u32, TOTAL);
    c.close(true).await.unwrap();
    // The acks, the checkpoint's included, reached the server: nothing waits.
    let q = n.queue("ledger").expect("kept");
    assert_eq!(q.pending, 0, "{q:?}");
}

/// The next events as a batch read in place (a live marker or other item fails the test).
async fn next_events(events: &mut EventStream) -> tether::client::EventBatch {
    match tokio::time::timeout(WAIT, events.next_batch()).await {
        Ok(Some(StreamBatch::Events(b))) => b,
        other => panic!("expected events, got {other:?}"),
    }
}

/// Batches read in place (`EventStream::next_batch`) carry what `next` yields, mixed with it
/// in any order, and count as processed the same way: a backlog replayed over many delivery
/// frames, taken partly event by event and partly in batches, then closed; the reconnected
/// client gets exactly the rest (manual acks, batches acked at once).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn batches_read_in_place_carry_and_ack_what_events_do() {
    const TOTAL: u32 = 3_000;
    const TAKE_AT_LEAST: u64 = 2_000;
    let n = TestNode::start().await;
    common::park(n.builder().durable("batches", 300), REGION).await;
    n.put_many(REGION, 0..TOTAL).await;

    let c = n.builder().durable("batches", 300).connect().await.unwrap();
    assert_eq!(c.pending(), Some(u64::from(TOTAL)));
    let mut events = c.events().unwrap();
    c.ready_for_events().await.unwrap();
    // (offset, key, value) of each event taken, in the order taken.
    let mut taken: Vec<(u64, String, Vec<u8>)> = Vec::new();
    let mut batches = 0;
    while (taken.len() as u64) < TAKE_AT_LEAST {
        // A few events one by one (the rest of their batch comes next, from `next_batch`).
        for _ in 0..3 {
            let e = next_entry(&mut events).await.expect("event");
            assert!(e.replayed && !e.possible_duplicate, "{e:?}");
            taken.push((e.offset, e.key, e.value.expect("a value")));
        }
        let b = next_events(&mut events).await;
        assert!(!b.is_empty());
        assert_eq!(b.len(), b.iter().len());
        for v in b.iter() {
            assert!(v.replayed && !v.possible_duplicate, "{v:?}");
            assert_eq!(v.op, EventOp::Create);
            assert_eq!(v.region, REGION);
            assert_eq!(v.to_event().key, v.key);
            taken.push((
                v.offset,
                v.key.to_owned(),
                v.value.expect("a value").to_vec(),
            ));
        }
        assert_eq!(b.last_offset(), taken.last().map(|t| t.0));
        batches += 1;
    }
    assert!(batches > 1, "the backlog came in several batches");
    for (i, (offset, key, value)) in taken.iter().enumerate() {
        assert_eq!(
            *offset,
            taken[0].0 + i as u64,
            "offsets in order, none skipped"
        );
        assert_eq!(key, &format!("key-{i}"));
        assert_eq!(value, format!("v-{i}").as_bytes());
    }
    events.commit();
    c.close(true).await.unwrap();
    let done = taken.len() as u64;
    assert_eq!(
        n.queue("batches").expect("kept").pending,
        u64::from(TOTAL) - done
    );

    // The rest, in batches, acked by hand.
    let c = n
        .builder()
        .durable("batches", 300)
        .ack_mode(AckMode::Manual)
        .connect()
        .await
        .unwrap();
    assert_eq!(c.pending(), Some(u64::from(TOTAL) - done));
    let mut events = c.events().unwrap();
    c.ready_for_events().await.unwrap();
    let acker = events.acker().unwrap();
    let mut next_key = done;
    while next_key < u64::from(TOTAL) {
        let b = next_events(&mut events).await;
        for v in b.iter() {
            assert_eq!(
                v.key,
                format!("key-{next_key}"),
                "the rest, from where it stopped"
            );
            next_key += 1;
        }
        let offsets: Vec<u64> = b.offsets().collect();
        assert_eq!(acker.ack_many(&offsets).unwrap(), b.last_offset().unwrap());
    }
    match tokio::time::timeout(WAIT, events.next_batch()).await {
        Ok(Some(StreamBatch::Other(ClientEvent::Live { .. }))) => {}
        other => panic!("expected the live marker, got {other:?}"),
    }
    c.close(true).await.unwrap();
    assert_eq!(n.queue("batches").expect("kept").pending, 0);
}

/// Bad input: each gets one clear error and changes nothing the server holds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_acks_and_checkpoints_get_clear_errors() {
    let n = TestNode::start().await;
    let c = n
        .builder()
        .durable("careful", 300)
        .ack_mode(AckMode::Manual)
        .connect()
        .await
        .unwrap();
    c.region(REGION)
        .register(Interest::all_keys())
        .await
        .unwrap();
    let mut events = c.events().unwrap();
    c.ready_for_events().await.unwrap();
    n.put_many(REGION, 0..3).await;
    let first = next_entry(&mut events).await.unwrap();
    // An offset never delivered (not yet, or never): refused, naming it.
    let err = events.ack(first.offset + 1).unwrap_err().to_string();
    assert!(
        err.contains(&format!("offset {}", first.offset + 1)),
        "{err}"
    );
    let err = events.ack(999).unwrap_err().to_string();
    assert!(err.contains("never delivered"), "{err}");
    // Out of order is fine: held until the gap closes.
    let second = next_entry(&mut events).await.unwrap();
    assert_eq!(events.ack(second.offset).unwrap(), 0);
    assert_eq!(events.ack(first.offset).unwrap(), second.offset);
    c.close(true).await.unwrap();
    assert_eq!(n.queue("careful").unwrap().pending, 1);
    // Acks in the automatic mode: refused.
    let c = n.durable("careful", 300).await;
    let mut events = c.events().unwrap();
    c.ready_for_events().await.unwrap();
    let e = next_entry(&mut events).await.unwrap();
    let err = events.ack(e.offset).unwrap_err();
    assert!(matches!(err, ClientError::Usage(_)), "{err}");
    c.close(true).await.unwrap();
    // A checkpoint beyond the queue's end: refused at ready, naming both offsets.
    let c = n
        .builder()
        .durable("careful", 300)
        .checkpoint(1_000)
        .connect()
        .await
        .unwrap();
    let err = c.ready_for_events().await.unwrap_err().to_string();
    assert!(
        err.contains("checkpoint 1000") && err.contains("end"),
        "{err}"
    );
    c.close(true).await.unwrap();
    assert_eq!(
        n.queue("careful").unwrap().end_offset,
        3,
        "the queue is untouched"
    );
}
