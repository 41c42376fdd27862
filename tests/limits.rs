//! Operator limits on a real node: queue-full policies (reject, block, drop-queue), the
//! in-flight window, connections per node, and the handshake timeout.

mod common;

use std::time::Duration;

use common::*;
use tether::client::{ClientError, Interest};
use tether::config::{Limits, QueueFullPolicy};
use tether::protocol::{ErrorCode, QueueStatus};

fn limits(queue_entries_max: u64, policy: QueueFullPolicy) -> Limits {
    Limits {
        queue_entries_max,
        queue_full_policy: policy,
        ..Limits::default()
    }
}

async fn away_subscriber(n: &TestNode, id: &str, region: &str) {
    let c = n.durable(id, 600).await;
    c.region(region)
        .register(Interest::all_keys())
        .await
        .unwrap();
    c.close(true).await.unwrap();
}

/// Durable client `id` (600 s timeout) that acks only when told to (`ack_now`).
async fn manual_acks(n: &TestNode, id: &str) -> tether::client::Client {
    n.builder()
        .durable(id, 600)
        .ack_interval(Duration::from_secs(3600))
        .connect()
        .await
        .unwrap()
}

fn queue_full(err: tether::protocol::WireError) -> String {
    assert_eq!(err.code, ErrorCode::QueueFull, "{err:?}");
    err.message
}

#[tokio::test]
async fn queue_full_reject_refuses_the_publish_and_changes_nothing() {
    let n = TestNode::start_with(limits(3, QueueFullPolicy::Reject)).await;
    away_subscriber(&n, "X", "R").await;
    away_subscriber(&n, "Y", "S").await;
    let p = n.node().publisher().await.unwrap();
    for i in 0..3 {
        p.put("R", &format!("k{i}"), b"v".to_vec()).await.unwrap();
    }
    let msg = queue_full(p.put("R", "k3", b"v".to_vec()).await.unwrap_err());
    assert!(msg.contains("queue of X is full (3 entries)"), "{msg}");
    assert_eq!(
        n.node().get("R", "k3").unwrap(),
        None,
        "a refused publish changes nothing"
    );
    assert_eq!(n.queue("X").unwrap().pending, 3);
    // Other queues are not held back.
    p.put("S", "k", b"v".to_vec()).await.unwrap();
    assert_eq!(n.queue("Y").unwrap().pending, 1);
    // Once X drains, publishing to R works again, and nothing was lost in between.
    let x = n.durable("X", 600).await;
    x.ready_for_events().await.unwrap();
    let mut ev = x.events().unwrap();
    assert_eq!(keys(&until_live(&mut ev, "R").await), ["k0", "k1", "k2"]);
    ev.commit();
    x.ack_now().await.unwrap();
    eventually("X acked", || n.queue("X").unwrap().pending == 0).await;
    p.put("R", "k3", b"v".to_vec()).await.unwrap();
    assert_eq!(keys(&take_events(&mut ev, 1).await), ["k3"]);
}

#[tokio::test]
async fn queue_full_block_waits_for_acks_then_gives_up() {
    let mut l = limits(3, QueueFullPolicy::Block);
    l.queue_full_block_ms = 10_000;
    let n = TestNode::start_with(l).await;
    let x = manual_acks(&n, "X").await;
    x.region("R").register(Interest::all_keys()).await.unwrap();
    x.ready_for_events().await.unwrap();
    let mut ev = x.events().unwrap();
    until_live(&mut ev, "R").await;
    n.put_many("R", 0..3).await;
    let p = n.node().publisher().await.unwrap();
    let blocked = tokio::spawn(async move { p.put("R", "k-blocked", b"v".to_vec()).await });
    tokio::time::sleep(QUIET).await;
    assert!(
        !blocked.is_finished(),
        "the publish waits while the queue is full"
    );
    take_events(&mut ev, 3).await;
    ev.commit();
    x.ack_now().await.unwrap();
    tokio::time::timeout(WAIT, blocked)
        .await
        .unwrap()
        .unwrap()
        .expect("published once space was freed");
    assert_eq!(keys(&take_events(&mut ev, 1).await), ["k-blocked"]);

    // Nobody acks: the publish is refused after the block timeout.
    let mut l = limits(1, QueueFullPolicy::Block);
    l.queue_full_block_ms = 300;
    let n = TestNode::start_with(l).await;
    away_subscriber(&n, "Z", "R").await;
    n.put("R", "a", "v").await;
    let p = n.node().publisher().await.unwrap();
    let msg = queue_full(p.put("R", "b", b"v".to_vec()).await.unwrap_err());
    assert!(msg.contains("waited 300 ms"), "{msg}");
    assert_eq!(n.queue("Z").unwrap().pending, 1);
}

#[tokio::test]
async fn queue_full_drop_queue_drops_it_and_the_client_sees_expired() {
    let n = TestNode::start_with(limits(2, QueueFullPolicy::DropQueue)).await;
    away_subscriber(&n, "X", "R").await;
    // Y is connected (not ready): its connection is closed when its queue is dropped.
    let y = n.durable("Y", 600).await;
    y.region("R").register(Interest::all_keys()).await.unwrap();
    n.put_many("R", 0..3).await; // the third put overflows both queues; it is published
    assert_eq!(
        n.node().get("R", "key-2").unwrap().as_deref(),
        Some(&b"v-2"[..])
    );
    assert!(
        n.queue("X").is_none() && n.queue("Y").is_none(),
        "both full queues were dropped"
    );
    match y.queues().await {
        Err(ClientError::Server(e)) => assert_eq!(e.code, ErrorCode::QueueFull, "{e:?}"),
        other => panic!("Y should have been disconnected with queue-full: {other:?}"),
    }
    let x = n.durable("X", 600).await;
    assert_eq!(x.queue_status(), QueueStatus::Expired);
    eventually("Y's old session is gone", || n.queue("Y").is_none()).await;
    let y = n.durable("Y", 600).await;
    assert_eq!(y.queue_status(), QueueStatus::Expired);
}

#[tokio::test]
async fn inflight_window_bounds_unacknowledged_delivery() {
    let n = TestNode::start_with(Limits {
        inflight_events_max: 5,
        ..Limits::default()
    })
    .await;
    let c = manual_acks(&n, "X").await;
    c.region("R").register(Interest::all_keys()).await.unwrap();
    c.close(true).await.unwrap();
    n.put_many("R", 0..20).await;
    let c = manual_acks(&n, "X").await;
    c.ready_for_events().await.unwrap();
    let mut ev = c.events().unwrap();
    let first = take_events(&mut ev, 5).await;
    assert_eq!(entries(&first).last().unwrap().offset, 5);
    let extra = drain_quiet(&mut ev).await;
    assert!(
        extra.is_empty(),
        "nothing beyond the window before an ack: {extra:?}"
    );
    ev.commit();
    c.ack_now().await.unwrap();
    let next = take_events(&mut ev, 5).await;
    assert_eq!(entries(&next).first().unwrap().offset, 6);
    assert_eq!(entries(&next).last().unwrap().offset, 10);
}

#[tokio::test]
async fn connections_max_refuses_extra_connections() {
    let n = TestNode::start_with(Limits {
        connections_max: 2,
        ..Limits::default()
    })
    .await;
    let a = n.plain().await;
    let _b = n.plain().await;
    let err = n
        .builder()
        .connect()
        .await
        .err()
        .expect("a third connection is refused");
    assert!(matches!(err, ClientError::Connect(_)), "{err:?}");
    a.close(false).await.unwrap();
    let mut connected = None;
    for _ in 0..50 {
        if let Ok(c) = n.builder().connect().await {
            connected = Some(c);
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(connected.is_some(), "a slot frees up when a client leaves");
}

#[tokio::test]
async fn handshake_timeout_closes_silent_connections() {
    let n = TestNode::start_with(Limits {
        handshake_timeout_ms: 300,
        ..Limits::default()
    })
    .await;
    let cfg = tether::transport::tls::client_config(n.node().ca_file()).unwrap();
    let endpoint = tether::transport::endpoint::client_endpoint(cfg, n.node().addr()).unwrap();
    let conn = endpoint
        .connect(n.node().addr(), tether::transport::tls::SERVER_NAME)
        .unwrap()
        .await
        .unwrap();
    let (mut send, _recv) = conn.open_bi().await.unwrap();
    send.write_all(&[]).await.unwrap();
    // An empty write opens nothing on the wire; one byte of a header does.
    send.write_all(&[0]).await.unwrap();
    let reason = tokio::time::timeout(WAIT, conn.closed())
        .await
        .expect("closed by the server");
    match reason {
        quinn::ConnectionError::ApplicationClosed(c) => {
            assert_eq!(c.error_code, ErrorCode::HandshakeTimeout.varint(), "{c:?}")
        }
        other => panic!("expected handshake-timeout, got {other:?}"),
    }
    // Everyone else is served.
    n.plain().await.close(false).await.unwrap();
}

#[tokio::test]
async fn idle_timeout_closes_silent_connections_as_crashes() {
    let n = TestNode::start_with(Limits {
        idle_timeout_ms: 6_000,
        ..Limits::default()
    })
    .await;
    let (addr, cut) = common::relay(n.node().addr()).await;
    let c = tether::client::ClientBuilder::new()
        .server(addr)
        .ca_file(n.node().ca_file())
        .durable("silent", 600)
        .connect()
        .await
        .unwrap();
    eventually("attached", || {
        n.queue("silent").is_some_and(|q| q.state == "connected")
    })
    .await;
    // The network goes silent: nothing tells the server, only its idle timeout does.
    cut.store(true, std::sync::atomic::Ordering::Relaxed);
    let started = std::time::Instant::now();
    eventually(
        "the server drops the silent connection and keeps the queue",
        || n.queue("silent").is_some_and(|q| q.state == "away"),
    )
    .await;
    assert!(
        started.elapsed() >= Duration::from_secs(3),
        "not before the idle timeout"
    );
    drop(c);
}

/// The byte limit: a queue holding `queue-bytes-max` bytes of stored events refuses more
/// (reject policy), the count survives a restart exactly, and a partial ack makes room.
#[tokio::test]
async fn queue_bytes_limit_refuses_past_it_survives_restart_and_partial_acks() {
    const LIMIT: u64 = 64 * 1024;
    const VALUE: usize = 1024;
    let mut n = TestNode::start_with(Limits {
        queue_bytes_max: LIMIT,
        ..Limits::default()
    })
    .await;
    away_subscriber(&n, "X", "R").await;
    away_subscriber(&n, "Y", "S").await;
    let p = n.node().publisher().await.unwrap();
    let mut published = 0u32;
    let refusal = loop {
        match p
            .put("R", &format!("k{published:03}"), vec![7; VALUE])
            .await
        {
            Ok(_) => published += 1,
            Err(e) => break queue_full(e),
        }
        assert!(published < 1000, "the byte limit never applied");
    };
    assert!(
        refusal.contains("queue of X is full (65536 bytes)"),
        "{refusal}"
    );
    let x = n.queue("X").unwrap();
    let bytes = x
        .pending_bytes
        .expect("a primary reports its pending bytes");
    // Each event stores its value plus a little encoding (event id, region, key).
    assert!(
        bytes >= u64::from(published) * VALUE as u64,
        "{bytes} for {published}"
    );
    assert!(bytes <= LIMIT, "{bytes} over the limit");
    // The last refused publish was the one that did not fit (within one event and one mark).
    assert!(
        bytes + 2 * (VALUE as u64 + 64) + 4096 > LIMIT,
        "refused too early: {bytes}"
    );
    assert_eq!(x.pending, u64::from(published));
    // Other queues are not held back, and a refused publish changed nothing.
    p.put("S", "k", vec![1; VALUE]).await.unwrap();
    assert_eq!(
        n.node().get("R", &format!("k{published:03}")).unwrap(),
        None
    );

    // A restart rebuilds the same count (from the stored byte marks plus short reads).
    drop(p);
    n.restart().await;
    assert_eq!(n.queue("X").unwrap().pending_bytes, Some(bytes));
    let p = n.node().publisher().await.unwrap();
    let again = queue_full(
        p.put("R", "after-restart", vec![7; VALUE])
            .await
            .unwrap_err(),
    );
    assert!(again.contains("65536 bytes"), "{again}");

    // Acking half of the backlog makes room for about half again.
    let x = manual_acks(&n, "X").await;
    x.ready_for_events().await.unwrap();
    let mut ev = x.events().unwrap();
    let half = published as usize / 2;
    take_events(&mut ev, half).await;
    ev.commit();
    x.ack_now().await.unwrap();
    eventually("half acked", || {
        n.queue("X").unwrap().pending == u64::from(published) - half as u64
    })
    .await;
    let left = n.queue("X").unwrap().pending_bytes.unwrap();
    let exact_left = bytes - bytes * half as u64 / u64::from(published);
    assert!(left < bytes, "an ack frees bytes: {left} of {bytes}");
    assert!(
        left <= exact_left + 4096 + 2 * (VALUE as u64 + 64),
        "over-count beyond one mark interval: {left}, about {exact_left} waiting"
    );
    for i in 0..half as u32 / 2 {
        p.put("R", &format!("more{i}"), vec![7; VALUE])
            .await
            .unwrap();
    }
}

/// The per-connection windows (`connection-receive-window-bytes`, `connection-send-window-bytes`)
/// at their lowest (64 KiB): flow control holds every connection to them, and everything still
/// flows through in order: a publish of a value sixteen times the receive window, and a replay
/// of about 4 MB to a durable client through the small send window.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn smallest_connection_windows_still_carry_large_values_and_replays() {
    let lowest = tether::transport::tls::CONNECTION_WINDOW_BYTES_LOWEST;
    let n = TestNode::start_with(Limits {
        connection_receive_window_bytes: lowest,
        connection_send_window_bytes: lowest,
        ..Limits::default()
    })
    .await;
    away_subscriber(&n, "X", "R").await;
    let p = n.plain().await;
    let big = vec![b'b'; 1024 * 1024];
    p.region("R").put("big", big.clone()).await.unwrap();
    let values: Vec<Vec<u8>> = (0..3_000u32)
        .map(|i| format!("{i:06}").repeat(170).into_bytes())
        .collect();
    for chunk in values.chunks(100).enumerate() {
        let ops = chunk
            .1
            .iter()
            .enumerate()
            .map(|(j, v)| tether::protocol::PublishOp::Put {
                region: "R".into(),
                key: format!("k{}", chunk.0 * 100 + j),
                value: v.clone(),
            })
            .collect();
        p.publish(ops).await.unwrap();
    }
    assert_eq!(n.node().get("R", "big").unwrap(), Some(big.clone()));
    let x = n.durable("X", 600).await;
    assert_eq!(x.pending(), Some(3_001));
    x.ready_for_events().await.unwrap();
    let mut ev = x.events().unwrap();
    let got = until_live(&mut ev, "R").await;
    let got = entries(&got);
    assert_eq!(got.len(), 3_001, "the whole replay arrived");
    assert_eq!(got[0].value.as_deref(), Some(&big[..]));
    for (i, e) in got[1..].iter().enumerate() {
        assert_eq!(e.key, format!("k{i}"));
        assert_eq!(e.value.as_deref(), Some(&values[i][..]), "value of k{i}");
        assert!(e.replayed);
    }
}

/// Issue 22 point 4: a publish to a region with interest regexes matches its keys before it
/// takes the core lock, with the region's matcher learnt from an earlier publish. Only the
/// first publish after the regexes change is matched under the lock; every event still
/// reaches the queues its key matches.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn publishes_match_regexes_outside_the_core_lock() {
    let n = TestNode::start().await;
    let d = n.durable("regexes", 60).await;
    d.region("R")
        .register(Interest::regex("k-[0-9]+"))
        .await
        .unwrap();
    d.ready_for_events().await.unwrap();
    let mut events = d.events().unwrap();
    let p = n.builder().connect().await.unwrap();
    let r = p.region("R");
    let put = |key: &'static str| r.put(key, b"v".to_vec());
    for key in ["k-1", "x-1", "k-2", "k-3"] {
        put(key).await.unwrap();
    }
    assert_eq!(
        n.node().regex_matches_under_lock(),
        1,
        "the first publish only"
    );
    // A new regex: the matcher learnt is out of date, once.
    d.region("R")
        .register(Interest::regex("x-[0-9]+"))
        .await
        .unwrap();
    for key in ["x-2", "k-4", "x-3"] {
        put(key).await.unwrap();
    }
    assert_eq!(n.node().regex_matches_under_lock(), 2);
    let got = keys(&take_events(&mut events, 6).await);
    assert_eq!(got, ["k-1", "k-2", "k-3", "x-2", "k-4", "x-3"]);
}
