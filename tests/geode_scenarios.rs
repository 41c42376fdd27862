//! Geode's durable-client scenarios (reference: geode-semantics.md section 3, groups A to E),
//! one test per scenario id, on one real node: RocksDB in a temp dir, QUIC+TLS on loopback.
//! Where Tether differs on purpose (exact pending counts, replayed and possible-duplicate
//! flags, persistence) the test asserts Tether's behaviour.

mod common;

use std::time::Duration;

use common::*;
use tether::client::{ClientError, ClientEvent, Event, Interest, Listener};
use tether::protocol::{ErrorCode, EventOp, InterestSpec, QueueStatus, ResultPolicy};

// ---------------------------------------------------------------- A. Identity and connection

#[tokio::test]
async fn a1_durable_client_registers() {
    let n = TestNode::start().await;
    let c = n.durable("X", 300).await;
    assert_eq!(c.queue_status(), QueueStatus::New);
    c.ready_for_events().await.unwrap();
    let qs = n.node().queues();
    assert_eq!(qs.len(), 1);
    assert_eq!(qs[0].durable_id.as_deref(), Some("X"));
    assert_eq!(qs[0].timeout_secs, 300);
    assert_eq!(qs[0].state, "ready");
}

#[tokio::test]
async fn a2_two_durable_clients() {
    let n = TestNode::start().await;
    let _x = n.durable("X", 300).await;
    let _x2 = n.durable("X2", 300).await;
    let mut ids: Vec<String> = n
        .node()
        .queues()
        .into_iter()
        .filter_map(|q| q.durable_id)
        .collect();
    ids.sort();
    assert_eq!(ids, ["X", "X2"]);
    assert!(n.node().queues().iter().all(|q| q.timeout_secs == 300));
}

/// Geode gives one process two proxies for one id through two pools; in Tether a durable id
/// has one session, so a process that wants two queues uses two ids. Closing both without
/// keepalive leaves no queue.
#[tokio::test]
async fn a3_one_process_two_queues() {
    let n = TestNode::start().await;
    let a = n.durable("X_pool1", 300).await;
    let b = n.durable("X_pool2", 300).await;
    a.ready_for_events().await.unwrap();
    b.ready_for_events().await.unwrap();
    assert_eq!(n.node().queues().len(), 2);
    a.close(false).await.unwrap();
    b.close(false).await.unwrap();
    assert!(n.node().queues().is_empty());
}

#[tokio::test]
async fn a5_duplicate_live_durable_id_is_refused() {
    let n = TestNode::start().await;
    let first = n.durable("X", 300).await;
    first
        .region("R")
        .register(Interest::all_keys())
        .await
        .unwrap();
    first.ready_for_events().await.unwrap();
    let mut events = first.events().unwrap();
    until_live(&mut events, "R").await;
    let err = n
        .builder()
        .durable("X", 300)
        .connect()
        .await
        .err()
        .expect("second connection is refused");
    match err {
        ClientError::Server(e) => {
            assert_eq!(e.code, ErrorCode::DuplicateDurableId);
            assert!(e.message.contains("already connected"), "{}", e.message);
        }
        other => panic!("unexpected error {other:?}"),
    }
    // The first session is untouched.
    n.put("R", "k", "v").await;
    let got = take_events(&mut events, 1).await;
    assert_eq!(keys(&got), ["k"]);
}

/// A paused (away) durable id is taken over as a reconnect, not refused.
#[tokio::test]
async fn a5_paused_durable_id_resumes() {
    let n = TestNode::start().await;
    let first = n.durable("X", 300).await;
    first.close(true).await.unwrap();
    let second = n.durable("X", 300).await;
    assert_eq!(second.queue_status(), QueueStatus::Resumed);
}

/// A durable client that closes promptly (keepalive, not waiting for the connection to drain)
/// and reconnects at once resumes its queue: the server ends the session before it answers
/// the close, so the new connection is never refused as a duplicate. The events published
/// while it was away are replayed, none lost, each round.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a5_prompt_keepalive_close_then_reconnect_at_once_resumes() {
    const ROUNDS: u32 = 5;
    let n = TestNode::start().await;
    let first = n.durable("X", 300).await;
    first
        .region("R")
        .register(Interest::all_keys().durable(true))
        .await
        .unwrap();
    first.ready_for_events().await.unwrap();
    first.close_promptly(true).await.unwrap();
    for round in 0..ROUNDS {
        n.put("R", &format!("k{round}"), "v").await;
        let c = n.durable("X", 300).await;
        assert_eq!(c.queue_status(), QueueStatus::Resumed, "round {round}");
        assert_eq!(c.pending(), Some(1), "round {round}");
        let mut events = c.events().unwrap();
        c.ready_for_events().await.unwrap();
        let got = until_live(&mut events, "R").await;
        assert_eq!(keys(&got), vec![format!("k{round}")], "round {round}");
        c.ack_now().await.unwrap();
        c.close_promptly(true).await.unwrap();
    }
}

#[tokio::test]
async fn a6_durable_flag_on_non_durable_client_is_refused() {
    let n = TestNode::start().await;
    let c = n.plain().await;
    let err = c
        .region("R")
        .register(Interest::all_keys().durable(true))
        .await
        .unwrap_err();
    match err {
        ClientError::Server(e) => {
            assert_eq!(e.code, ErrorCode::InvalidArgument);
            assert!(
                e.message.contains("only for durable clients"),
                "{}",
                e.message
            );
        }
        other => panic!("unexpected error {other:?}"),
    }
    // The client is still usable.
    c.region("R").register(Interest::all_keys()).await.unwrap();
}

#[tokio::test]
async fn a7_ready_is_never_implicit() {
    let n = TestNode::start().await;
    let c = n.durable("X", 300).await;
    c.region("R").register(Interest::all_keys()).await.unwrap();
    let mut events = c.events().unwrap();
    n.put_many("R", 0..3).await;
    assert!(
        drain_quiet(&mut events).await.is_empty(),
        "nothing is delivered before ready"
    );
    let q = n.queue("X").unwrap();
    assert_eq!((q.state.as_str(), q.pending), ("connected", 3));
    c.ready_for_events().await.unwrap();
    let got = until_live(&mut events, "R").await;
    assert_eq!(keys(&got), ["key-0", "key-1", "key-2"]);
}

#[tokio::test]
async fn a8_no_server_at_startup() {
    // Find a free UDP port, then try to connect with no server there.
    let port = std::net::UdpSocket::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let addr: std::net::SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let ca = tether::transport::tls::ensure_dev_certs(&dir.path().join("tls"))
        .unwrap()
        .ca;
    let builder = tether::client::ClientBuilder::new()
        .server(addr)
        .ca_file(&ca)
        .durable("X", 300);
    let err = builder.clone().connect().await.err().expect("no server");
    assert!(matches!(err, ClientError::Connect(_)), "{err:?}");
    // A server starting on that port later serves the same call.
    let mut cfg = tether::config::ServerConfig::ephemeral(dir.path());
    cfg.listen = addr;
    let node = tether::server::Node::start(cfg).await.unwrap();
    let c = builder
        .connect()
        .await
        .expect("connects once the server is up");
    assert_eq!(c.queue_status(), QueueStatus::New);
    drop(c);
    node.shutdown().await;
}

#[tokio::test]
async fn a9_reconnect_cycle_keeps_the_queue() {
    let n = TestNode::start().await;
    for round in 0..3 {
        let c = n.durable("X", 300).await;
        assert_eq!(
            c.queue_status(),
            if round == 0 {
                QueueStatus::New
            } else {
                QueueStatus::Resumed
            }
        );
        c.ready_for_events().await.unwrap();
        c.close(true).await.unwrap();
        assert_eq!(n.queue("X").unwrap().state, "away");
    }
}

// ------------------------------------------------- B. Keepalive, pause, reconnect, replay

#[tokio::test]
async fn b1_keepalive_keeps_the_queue_even_with_no_interest() {
    let n = TestNode::start().await;
    let c = n.durable("X", 600).await;
    c.close(true).await.unwrap();
    let q = n.queue("X").expect("queue kept");
    assert_eq!((q.state.as_str(), q.timeout_secs), ("away", 600));
    let c = n.durable("X", 600).await;
    assert_eq!(
        (c.queue_status(), c.pending()),
        (QueueStatus::Resumed, Some(0))
    );
}

#[tokio::test]
async fn b2_events_queued_while_away_are_replayed_without_reregistering() {
    let n = TestNode::start().await;
    let c = n.durable("X", 600).await;
    c.region("R")
        .register(Interest::regex(".*").policy(ResultPolicy::None))
        .await
        .unwrap();
    c.ready_for_events().await.unwrap();
    let mut ev = c.events().unwrap();
    until_live(&mut ev, "R").await;
    n.put("R", "0", "a").await;
    take_events(&mut ev, 1).await;
    ev.commit();
    c.ack_now().await.unwrap();
    eventually("the delivered event is acked", || {
        n.queue("X").unwrap().pending == 0
    })
    .await;
    c.close(true).await.unwrap();
    n.put("R", "1", "b").await;
    assert_eq!(n.queue("X").unwrap().pending, 1, "exactly one event waits");
    // Reconnect with the default timeout, without registering interest.
    let c = n.builder().durable_id("X").connect().await.unwrap();
    assert_eq!(
        (c.queue_status(), c.pending()),
        (QueueStatus::Resumed, Some(1))
    );
    assert_eq!(
        n.queue("X").unwrap().timeout_secs,
        300,
        "the latest timeout wins"
    );
    c.ready_for_events().await.unwrap();
    let got = until_live(&mut c.events().unwrap(), "R").await;
    let e = entries(&got);
    assert_eq!(e.len(), 1);
    assert_eq!(
        (e[0].key.as_str(), e[0].op, e[0].replayed),
        ("1", EventOp::Create, true)
    );
}

#[tokio::test]
async fn b3_two_durable_clients_queue_independently() {
    let n = TestNode::start().await;
    for id in ["X", "X2"] {
        let c = n.durable(id, 60).await;
        c.region("R")
            .register(Interest::regex(".*").policy(ResultPolicy::None))
            .await
            .unwrap();
        c.ready_for_events().await.unwrap();
        c.close(true).await.unwrap();
    }
    n.put_many("R", 0..10).await;
    for id in ["X", "X2"] {
        assert_eq!(n.queue(id).unwrap().pending, 10);
    }
    for id in ["X", "X2"] {
        let c = n.durable(id, 60).await;
        assert_eq!(c.pending(), Some(10));
        c.ready_for_events().await.unwrap();
        let got = until_live(&mut c.events().unwrap(), "R").await;
        assert_eq!(entries(&got).len(), 10);
        assert!(entries(&got).iter().all(|e| e.replayed));
    }
}

#[tokio::test]
async fn b4_close_without_keepalive_drops_everything() {
    let n = TestNode::start().await;
    let c = n.durable("X", 600).await;
    c.region("R").register(Interest::all_keys()).await.unwrap();
    c.ready_for_events().await.unwrap();
    c.close(false).await.unwrap();
    assert!(n.queue("X").is_none());
    n.put_many("R", 0..4).await;
    let c = n.durable("X", 600).await;
    assert_eq!(
        c.queue_status(),
        QueueStatus::New,
        "drop is not expiry: the id is simply new"
    );
    c.region("R")
        .register(Interest::all_keys().policy(ResultPolicy::None))
        .await
        .unwrap();
    c.ready_for_events().await.unwrap();
    let mut ev = c.events().unwrap();
    let got = until_live(&mut ev, "R").await;
    assert!(entries(&got).is_empty(), "no replay after close(drop)");
}

#[tokio::test]
async fn b5_crash_keeps_the_queue() {
    let n = TestNode::start().await;
    let c = n.durable("X", 600).await;
    c.region("R").register(Interest::all_keys()).await.unwrap();
    c.ready_for_events().await.unwrap();
    c.crash();
    eventually("the server notices the crash", || {
        n.queue("X").is_some_and(|q| q.state == "away")
    })
    .await;
    n.put_many("R", 0..4).await;
    let c = n.durable("X", 600).await;
    assert_eq!(
        (c.queue_status(), c.pending()),
        (QueueStatus::Resumed, Some(4))
    );
    assert_eq!(n.queue("X").unwrap().timeout_secs, 600);
    c.ready_for_events().await.unwrap();
    let got = until_live(&mut c.events().unwrap(), "R").await;
    assert_eq!(keys(&got), ["key-0", "key-1", "key-2", "key-3"]);
}

#[tokio::test]
async fn b6_unacked_events_are_redelivered() {
    let n = TestNode::start().await;
    let c = n
        .builder()
        .durable("X", 300)
        .ack_interval(Duration::from_secs(3600))
        .connect()
        .await
        .unwrap();
    c.region("R").register(Interest::all_keys()).await.unwrap();
    c.ready_for_events().await.unwrap();
    let mut ev = c.events().unwrap();
    until_live(&mut ev, "R").await;
    n.put("R", "D-Key-1", "1").await;
    let first = take_events(&mut ev, 1).await;
    assert!(!entries(&first)[0].possible_duplicate);
    // The event was received but never processed (the stream was not asked again): no ack.
    drop(ev);
    c.close(true).await.unwrap();
    let c = n.durable("X", 300).await;
    assert_eq!(c.pending(), Some(1));
    c.ready_for_events().await.unwrap();
    let got = until_live(&mut c.events().unwrap(), "R").await;
    let e = entries(&got);
    assert_eq!(e.len(), 1);
    assert_eq!(e[0].key, "D-Key-1");
    assert!(e[0].possible_duplicate && e[0].replayed);
    assert_eq!(
        e[0].event_id,
        entries(&first)[0].event_id,
        "same event id on redelivery"
    );
}

/// The client library drops a redelivered event it already processed in this process.
#[tokio::test]
async fn b6_redelivered_duplicates_are_dropped_by_the_library() {
    let n = TestNode::start().await;
    let c = n
        .builder()
        .durable("X", 300)
        .ack_interval(Duration::from_secs(3600))
        .connect()
        .await
        .unwrap();
    let dedup = c.dedup_state();
    c.region("R").register(Interest::all_keys()).await.unwrap();
    c.ready_for_events().await.unwrap();
    let mut ev = c.events().unwrap();
    until_live(&mut ev, "R").await;
    n.put_many("R", 0..2).await;
    take_events(&mut ev, 2).await;
    ev.commit(); // processed, but the ack never leaves
    c.crash();
    eventually("away", || n.queue("X").is_some_and(|q| q.state == "away")).await;
    n.put("R", "new", "x").await;
    let c = n
        .builder()
        .durable("X", 300)
        .dedup_state(dedup)
        .connect()
        .await
        .unwrap();
    assert_eq!(c.pending(), Some(3));
    c.ready_for_events().await.unwrap();
    let mut ev = c.events().unwrap();
    let got = until_live(&mut ev, "R").await;
    assert_eq!(
        keys(&got),
        ["new"],
        "already-processed duplicates are not shown again"
    );
    ev.commit();
    c.close(true).await.unwrap();
    assert_eq!(
        n.queue("X").unwrap().pending,
        0,
        "dropped duplicates are acked too"
    );
}

/// Clients built from clones of one builder keep their own duplicate suppression: another
/// durable id's processed offsets never hide this one's redelivered events.
#[tokio::test]
async fn b6_builder_clones_do_not_share_duplicate_state() {
    let n = TestNode::start().await;
    let b = n.builder().ack_interval(Duration::from_secs(3600));
    let x = b.clone().durable("X", 300).connect().await.unwrap();
    x.region("R").register(Interest::all_keys()).await.unwrap();
    x.ready_for_events().await.unwrap();
    let mut xev = x.events().unwrap();
    until_live(&mut xev, "R").await;
    let y = b.clone().durable("Y", 300).connect().await.unwrap();
    y.region("R").register(Interest::all_keys()).await.unwrap();
    y.ready_for_events().await.unwrap();
    let mut yev = y.events().unwrap();
    until_live(&mut yev, "R").await;
    n.put_many("R", 0..5).await;
    take_events(&mut xev, 5).await; // delivered to X, not processed
    drop(xev);
    x.crash();
    eventually("X away", || n.queue("X").is_some_and(|q| q.state == "away")).await;
    take_events(&mut yev, 5).await;
    let x = b.clone().durable("X", 300).connect().await.unwrap();
    // Y goes on processing while X is back.
    n.put("R", "more", "v").await;
    take_events(&mut yev, 1).await;
    yev.commit();
    x.ready_for_events().await.unwrap();
    let got = until_live(&mut x.events().unwrap(), "R").await;
    let e = entries(&got);
    assert_eq!(
        e.len(),
        6,
        "X's five redelivered events and the new one: {got:?}"
    );
    assert!(e[..5].iter().all(|e| e.possible_duplicate));
}

#[tokio::test]
async fn b7_reconnect_after_closing_from_the_live_callback() {
    struct CloseOnLive(bool);
    impl Listener for CloseOnLive {
        fn after_region_live(&mut self, _r: &str) {
            self.0 = true;
        }
    }
    let n = TestNode::start().await;
    let c = n.durable("X", 60).await;
    c.region("R").register(Interest::all_keys()).await.unwrap();
    n.put_many("R", 0..100).await;
    c.ready_for_events().await.unwrap();
    let mut ev = c.events().unwrap();
    // Close as soon as the marker arrives.
    let mut l = CloseOnLive(false);
    while !l.0 {
        match tokio::time::timeout(WAIT, ev.next())
            .await
            .unwrap()
            .unwrap()
        {
            ClientEvent::Live { regions } => regions.iter().for_each(|r| l.after_region_live(r)),
            ClientEvent::Event(_) => {}
            other => panic!("a session's stream yielded {other:?}"),
        }
    }
    c.close(true).await.unwrap();
    n.put("R", "LAST_KEY", "last").await;
    let c = n.durable("X", 60).await;
    c.region("R").register(Interest::all_keys()).await.unwrap();
    c.ready_for_events().await.unwrap();
    let got = until_live(&mut c.events().unwrap(), "R").await;
    let last = entries(&got)
        .into_iter()
        .find(|e| e.key == "LAST_KEY")
        .expect("LAST_KEY replayed");
    assert_eq!(last.op, EventOp::Create);
}

#[tokio::test]
async fn b8_initial_image_is_not_replayed() {
    let n = TestNode::start().await;
    n.put("R", "0", "zero").await;
    let c = n.durable("X", 600).await;
    let image = c.region("R").register(Interest::key("0")).await.unwrap();
    assert_eq!(image.len(), 1);
    assert_eq!(image[0].value.as_deref(), Some(&b"zero"[..]));
    c.ready_for_events().await.unwrap();
    let mut ev = c.events().unwrap();
    let got = until_live(&mut ev, "R").await;
    assert!(
        entries(&got).is_empty(),
        "the initial image never fires events"
    );
    c.close(true).await.unwrap();
    let c = n.durable("X", 600).await;
    assert_eq!(c.pending(), Some(0));
    c.ready_for_events().await.unwrap();
    let got = until_live(&mut c.events().unwrap(), "R").await;
    assert!(entries(&got).is_empty(), "nothing is replayed");
}

#[tokio::test]
async fn b9_replayed_events_invoke_listeners() {
    #[derive(Default)]
    struct Count {
        creates: Vec<(String, bool)>,
        updates: usize,
        destroys: usize,
        live: Vec<String>,
    }
    impl Listener for Count {
        fn after_create(&mut self, e: &Event) {
            self.creates.push((e.key.clone(), e.replayed));
        }
        fn after_update(&mut self, _e: &Event) {
            self.updates += 1;
        }
        fn after_destroy(&mut self, _e: &Event) {
            self.destroys += 1;
        }
        fn after_region_live(&mut self, r: &str) {
            self.live.push(r.to_string());
        }
    }
    let n = TestNode::start().await;
    let c = n.durable("X", 600).await;
    c.region("R").register(Interest::all_keys()).await.unwrap();
    c.close(true).await.unwrap();
    let p = n.node().publisher().await.unwrap();
    p.put("R", "K3", b"PingPong3".to_vec()).await.unwrap();
    p.put("R", "K3", b"PingPong3b".to_vec()).await.unwrap();
    p.destroy("R", "K3").await.unwrap();
    let c = n.durable("X", 600).await;
    c.ready_for_events().await.unwrap();
    let stream = c.events().unwrap();
    let mut l = Count::default();
    let run = tokio::spawn(async move {
        stream.run_listener(&mut l).await;
        l
    });
    tokio::time::sleep(QUIET).await;
    c.close(true).await.unwrap();
    let l = tokio::time::timeout(WAIT, run).await.unwrap().unwrap();
    assert_eq!(l.creates, [("K3".to_string(), true)]);
    assert_eq!((l.updates, l.destroys), (1, 1));
    assert_eq!(l.live, ["R"]);
}

// --------------------------------------------------------------- C. Timeout and expiry

#[tokio::test]
async fn c1_expiry_removes_the_queue() {
    let n = TestNode::start().await;
    let c = n.durable("X", 1).await;
    c.close(true).await.unwrap();
    assert!(n.queue("X").is_some());
    eventually("the queue expires", || n.queue("X").is_none()).await;
    let c = n.durable("X", 300).await;
    assert_eq!(c.queue_status(), QueueStatus::Expired);
}

#[tokio::test]
async fn c2_expired_queue_means_no_replay() {
    let n = TestNode::start().await;
    let c = n
        .builder()
        .durable("X", 1)
        .ack_interval(Duration::from_millis(50))
        .connect()
        .await
        .unwrap();
    c.region("R").register(Interest::all_keys()).await.unwrap();
    c.ready_for_events().await.unwrap();
    c.close(true).await.unwrap();
    n.put_many("R", 0..10).await;
    eventually("the queue expires", || n.queue("X").is_none()).await;
    let c = n.durable("X", 300).await;
    assert_eq!(
        (c.queue_status(), c.pending()),
        (QueueStatus::Expired, None)
    );
    c.region("R")
        .register(Interest::all_keys().policy(ResultPolicy::None))
        .await
        .unwrap();
    c.ready_for_events().await.unwrap();
    let got = until_live(&mut c.events().unwrap(), "R").await;
    assert!(entries(&got).is_empty());
    // `expired` is reported once: the next connection finds the new queue.
    c.close(true).await.unwrap();
    assert_eq!(
        n.durable("X", 300).await.queue_status(),
        QueueStatus::Resumed
    );
}

#[tokio::test]
async fn c4_expiry_removes_durable_interest() {
    let n = TestNode::start().await;
    for id in ["A", "B", "C"] {
        let c = n.durable(id, 1).await;
        c.region("R").register(Interest::regex(".*")).await.unwrap();
        c.close(true).await.unwrap();
    }
    assert_eq!(n.node().queues().len(), 3);
    eventually("all three expire", || n.node().queues().is_empty()).await;
    n.put("R", "k", "v").await;
    assert!(
        n.node().queues().is_empty(),
        "no interest is left to create or fill a queue"
    );
}

#[tokio::test]
async fn c5_events_after_the_timeout_are_not_delivered() {
    let n = TestNode::start().await;
    let c = n.durable("X", 1).await;
    c.region("R")
        .register(Interest::regex("D-.*"))
        .await
        .unwrap();
    c.crash();
    n.put("R", "D-1", "2").await;
    eventually("the queue expires", || n.queue("X").is_none()).await;
    let c = n.durable("X", 300).await;
    assert_eq!(c.queue_status(), QueueStatus::Expired);
    c.region("R")
        .register(Interest::regex("D-.*").policy(ResultPolicy::None))
        .await
        .unwrap();
    c.ready_for_events().await.unwrap();
    let got = until_live(&mut c.events().unwrap(), "R").await;
    assert!(entries(&got).is_empty());
}

/// Geode counts reconnections and drops; Tether's observable outcome per cycle is the status.
#[tokio::test]
async fn c6_status_across_cycles() {
    let n = TestNode::start().await;
    let statuses_before_put = {
        let mut v = Vec::new();
        let c = n.durable("X", 600).await;
        v.push(c.queue_status());
        c.close(true).await.unwrap();
        let c = n.durable("X", 1).await; // reconnect 1, presenting timeout 1
        v.push(c.queue_status());
        c.close(true).await.unwrap();
        eventually("drop 1", || n.queue("X").is_none()).await;
        let c = n.durable("X", 1).await;
        v.push(c.queue_status());
        c.close(true).await.unwrap();
        eventually("drop 2", || n.queue("X").is_none()).await;
        v
    };
    assert_eq!(
        statuses_before_put,
        [QueueStatus::New, QueueStatus::Resumed, QueueStatus::Expired]
    );
    let c = n.durable("X", 600).await;
    assert_eq!(c.queue_status(), QueueStatus::Expired);
    c.region("R").register(Interest::key("Key1")).await.unwrap();
    c.close(true).await.unwrap();
    n.put("R", "Key1", "v").await; // enqueued while away
    let c = n.durable("X", 600).await;
    assert_eq!(
        (c.queue_status(), c.pending()),
        (QueueStatus::Resumed, Some(1))
    );
}

// ------------------------------------------------------------------ D. Pending event count

#[tokio::test]
async fn d1_non_durable_client_has_no_pending_count() {
    let n = TestNode::start().await;
    let c = n.plain().await;
    assert_eq!((c.queue_status(), c.pending()), (QueueStatus::None, None));
}

#[tokio::test]
async fn d2_first_connect_is_new_then_the_count_is_exact() {
    let n = TestNode::start().await;
    let c = n.durable("X", 300).await;
    assert_eq!((c.queue_status(), c.pending()), (QueueStatus::New, None));
    c.region("R").register(Interest::all_keys()).await.unwrap();
    c.ready_for_events().await.unwrap();
    c.close(true).await.unwrap();
    n.put_many("R", 0..10).await;
    let c = n.durable("X", 300).await;
    assert_eq!(
        (c.queue_status(), c.pending()),
        (QueueStatus::Resumed, Some(10)),
        "exact, no marker counted"
    );
}

/// Geode answers -2 (no queue) after the primary restarts while the client is away; Tether
/// keeps the queue on disk: `resumed` with the exact count, and the events replay.
#[tokio::test]
async fn d3_server_restart_keeps_the_queue_and_the_exact_count() {
    let mut n = TestNode::start().await;
    let c = n.durable("X", 300).await;
    c.region("R").register(Interest::all_keys()).await.unwrap();
    c.ready_for_events().await.unwrap();
    c.close(true).await.unwrap();
    n.put_many("R", 0..10).await;
    n.restart().await;
    let c = n.durable("X", 300).await;
    assert_eq!(
        (c.queue_status(), c.pending()),
        (QueueStatus::Resumed, Some(10))
    );
    c.ready_for_events().await.unwrap();
    let got = until_live(&mut c.events().unwrap(), "R").await;
    assert_eq!(
        keys(&got),
        (0..10).map(|i| format!("key-{i}")).collect::<Vec<_>>()
    );
}

#[tokio::test]
async fn d4_acked_events_leave_the_queue_without_more_traffic() {
    let n = TestNode::start().await;
    let c = n
        .builder()
        .durable("X", 300)
        .ack_interval(Duration::from_millis(50))
        .connect()
        .await
        .unwrap();
    c.region("R").register(Interest::all_keys()).await.unwrap();
    c.ready_for_events().await.unwrap();
    let mut ev = c.events().unwrap();
    until_live(&mut ev, "R").await;
    n.put_many("R", 0..10).await;
    for _ in 0..10 {
        take_events(&mut ev, 1).await;
        tokio::time::sleep(Duration::from_millis(20)).await; // a slow listener
    }
    ev.commit();
    eventually("pending drops to 0", || n.queue("X").unwrap().pending == 0).await;
    let q = n.queue("X").unwrap();
    assert_eq!((q.acked_offset, q.end_offset), (10, 10));
}

#[tokio::test]
async fn d5_count_matches_after_reconnect() {
    let n = TestNode::start().await;
    let c = n.durable("X", 300).await;
    c.region("R").register(Interest::all_keys()).await.unwrap();
    c.ready_for_events().await.unwrap();
    let mut ev = c.events().unwrap();
    until_live(&mut ev, "R").await;
    n.put_many("R", 0..10).await;
    take_events(&mut ev, 10).await;
    ev.commit();
    c.close(true).await.unwrap();
    n.put_many("R", 10..20).await;
    let c = n.durable("X", 300).await;
    assert_eq!(c.pending(), Some(10));
    assert_eq!(n.queue("X").unwrap().pending, 10);
    c.ready_for_events().await.unwrap();
    let got = until_live(&mut c.events().unwrap(), "R").await;
    let e = entries(&got);
    assert_eq!(e.len(), 10);
    assert!(
        e.iter()
            .all(|e| e.op == EventOp::Create && e.replayed && !e.possible_duplicate)
    );
}

// ------------------------------------------------------- E. Durable vs non-durable interest

/// K1, K2 non-durable; K3, K4 durable (policy none).
async fn e_setup(n: &TestNode) {
    let c = n.durable("X", 600).await;
    let r = c.region("R");
    for k in ["K1", "K2"] {
        r.register(Interest::key(k).durable(false).policy(ResultPolicy::None))
            .await
            .unwrap();
    }
    for k in ["K3", "K4"] {
        r.register(Interest::key(k).durable(true).policy(ResultPolicy::None))
            .await
            .unwrap();
    }
    c.ready_for_events().await.unwrap();
    let mut ev = c.events().unwrap();
    until_live(&mut ev, "R").await;
    let p = n.node().publisher().await.unwrap();
    for i in 1..=4 {
        p.put("R", &format!("K{i}"), format!("Value{i}").into_bytes())
            .await
            .unwrap();
    }
    assert_eq!(
        keys(&take_events(&mut ev, 4).await),
        ["K1", "K2", "K3", "K4"]
    );
    ev.commit();
    c.close(true).await.unwrap();
    for i in 1..=4 {
        p.put("R", &format!("K{i}"), format!("PingPong{i}").into_bytes())
            .await
            .unwrap();
    }
}

async fn put_updated(n: &TestNode) {
    let p = n.node().publisher().await.unwrap();
    for i in 1..=4 {
        p.put(
            "R",
            &format!("K{i}"),
            format!("PingPong_updated_{i}").into_bytes(),
        )
        .await
        .unwrap();
    }
}

/// Last value per key seen by the client.
fn last_values(evs: &[ClientEvent]) -> std::collections::BTreeMap<String, Option<String>> {
    entries(evs)
        .into_iter()
        .map(|e| (e.key.clone(), value(e)))
        .collect()
}

#[tokio::test]
async fn e1_non_durable_interest_is_lost_while_away() {
    let n = TestNode::start().await;
    e_setup(&n).await;
    assert_eq!(
        n.queue("X").unwrap().pending,
        2,
        "only durable keys queued while away"
    );
    let c = n.durable("X", 600).await;
    c.ready_for_events().await.unwrap();
    let mut ev = c.events().unwrap();
    let mut seen = until_live(&mut ev, "R").await;
    c.region("R")
        .register(
            Interest::key("K1")
                .durable(false)
                .policy(ResultPolicy::None),
        )
        .await
        .unwrap();
    put_updated(&n).await;
    seen.extend(take_events(&mut ev, 3).await);
    let last = last_values(&seen);
    assert_eq!(last.get("K1"), Some(&Some("PingPong_updated_1".into())));
    assert_eq!(last.get("K2"), None);
    assert_eq!(last.get("K3"), Some(&Some("PingPong_updated_3".into())));
    assert_eq!(last.get("K4"), Some(&Some("PingPong_updated_4".into())));
}

#[tokio::test]
async fn e2_reregister_then_unregister() {
    let n = TestNode::start().await;
    e_setup(&n).await;
    let c = n.durable("X", 600).await;
    let r = c.region("R");
    for k in ["K3", "K4"] {
        r.register(Interest::key(k).durable(true).policy(ResultPolicy::None))
            .await
            .unwrap();
    }
    for k in ["K1", "K2"] {
        r.register(Interest::key(k).durable(false).policy(ResultPolicy::None))
            .await
            .unwrap();
    }
    c.ready_for_events().await.unwrap();
    let mut ev = c.events().unwrap();
    let mut seen = until_live(&mut ev, "R").await;
    assert!(r.unregister(InterestSpec::Key("K1".into())).await.unwrap());
    assert!(r.unregister(InterestSpec::Key("K3".into())).await.unwrap());
    put_updated(&n).await;
    seen.extend(take_events(&mut ev, 2).await);
    seen.extend(drain_quiet(&mut ev).await);
    let last = last_values(&seen);
    assert_eq!(last.get("K2"), Some(&Some("PingPong_updated_2".into())));
    assert_eq!(last.get("K4"), Some(&Some("PingPong_updated_4".into())));
    assert_eq!(last.get("K1"), None);
    assert_eq!(
        last.get("K3"),
        Some(&Some("PingPong3".into())),
        "the replayed offline value, no update after unregister"
    );
}

#[tokio::test]
async fn e5_mixed_regex_and_list_interest() {
    let n = TestNode::start().await;
    let keys_all = ["Key-1", "D-Key-1", "L-Key", "LD-Key"];
    let c = n.durable("X", 600).await;
    let r = c.region("R");
    r.register(Interest::regex("Key-.*").durable(false))
        .await
        .unwrap();
    r.register(Interest::regex("D-Key-.*").durable(true))
        .await
        .unwrap();
    r.register(Interest::keys(["L-Key"]).durable(false))
        .await
        .unwrap();
    r.register(Interest::keys(["LD-Key"]).durable(true))
        .await
        .unwrap();
    c.ready_for_events().await.unwrap();
    let mut ev = c.events().unwrap();
    until_live(&mut ev, "R").await;
    let p = n.node().publisher().await.unwrap();
    for k in keys_all {
        p.put("R", k, b"1".to_vec()).await.unwrap();
    }
    for k in keys_all {
        p.destroy("R", k).await.unwrap();
    }
    let mut seen = take_events(&mut ev, 8).await;
    ev.commit();
    c.close(true).await.unwrap();
    for k in keys_all {
        p.put("R", k, b"2".to_vec()).await.unwrap();
    }
    for k in keys_all {
        p.destroy("R", k).await.unwrap();
    }
    // Native helper order: ready first, then re-register.
    let c = n.durable("X", 600).await;
    assert_eq!(
        c.pending(),
        Some(4),
        "only the durable keys' 2 creates and 2 destroys were queued"
    );
    c.ready_for_events().await.unwrap();
    let r = c.region("R");
    r.register(Interest::regex("Key-.*").durable(false))
        .await
        .unwrap();
    r.register(Interest::keys(["L-Key"]).durable(false))
        .await
        .unwrap();
    seen.extend(until_live(&mut c.events().unwrap(), "R").await);
    assert_eq!(entries(&seen).len(), 12);
    let creates: Vec<(String, String)> = entries(&seen)
        .into_iter()
        .filter(|e| e.op == EventOp::Create)
        .map(|e| (e.key.clone(), value(e).unwrap()))
        .collect();
    let last_create = |k: &str| {
        creates
            .iter()
            .rev()
            .find(|(key, _)| key == k)
            .map(|(_, v)| v.clone())
            .unwrap()
    };
    assert_eq!(last_create("D-Key-1"), "2");
    assert_eq!(last_create("LD-Key"), "2");
    assert_eq!(last_create("Key-1"), "1");
    assert_eq!(last_create("L-Key"), "1");
}

#[tokio::test]
async fn e6_interest_survives_reconnect_and_unregister_removes_it() {
    let n = TestNode::start().await;
    for id in ["C1", "C2"] {
        let c = n.durable(id, 600).await;
        c.region("R")
            .register(Interest::regex("D-Key-.*").durable(true))
            .await
            .unwrap();
        c.region("R")
            .register(Interest::regex("Key-.*").durable(false))
            .await
            .unwrap();
        c.close(true).await.unwrap();
    }
    n.put("R", "D-Key-1", "1").await;
    n.put("R", "Key-1", "1").await;
    let c1 = n.durable("C1", 600).await;
    let c2 = n.durable("C2", 600).await;
    assert!(
        c2.region("R")
            .unregister(InterestSpec::Regex("D-Key-.*".into()))
            .await
            .unwrap()
    );
    c1.ready_for_events().await.unwrap();
    c2.ready_for_events().await.unwrap();
    let mut e1 = c1.events().unwrap();
    let mut e2 = c2.events().unwrap();
    let mut s1 = until_live(&mut e1, "R").await;
    // C2 has no interest left, so no region to announce; its replay holds the queued event.
    let mut s2 = take_events(&mut e2, 1).await;
    n.put("R", "D-Key-1", "2").await;
    n.put("R", "Key-1", "2").await;
    s1.extend(take_events(&mut e1, 1).await);
    s1.extend(drain_quiet(&mut e1).await);
    s2.extend(drain_quiet(&mut e2).await);
    assert_eq!(
        entries(&s1).len(),
        2,
        "C1: the queued durable event and the round-2 durable update"
    );
    assert_eq!(value(entries(&s1)[1]), Some("2".into()));
    assert_eq!(
        entries(&s2).len(),
        1,
        "C2: the queued event only, nothing from round 2"
    );
}

#[tokio::test]
async fn e7_all_keys_without_values_delivers_invalidates() {
    let n = TestNode::start().await;
    let c = n.durable("X", 600).await;
    c.region("R")
        .register(
            Interest::all_keys()
                .policy(ResultPolicy::None)
                .receive_values(false),
        )
        .await
        .unwrap();
    c.region("S")
        .register(Interest::keys(["k1", "k2"]).policy(ResultPolicy::Keys))
        .await
        .unwrap();
    c.ready_for_events().await.unwrap();
    let mut ev = c.events().unwrap();
    let mut live = lives(&until_live(&mut ev, "R").await).len();
    if live < 2 {
        live += lives(&until_live(&mut ev, "S").await).len();
    }
    assert_eq!(live, 2, "one marker per region");
    for k in ["a", "b", "c"] {
        n.put("R", k, "v").await;
    }
    n.put("S", "k1", "v").await;
    n.put("S", "other", "v").await;
    n.put("S", "k2", "v").await;
    let got = take_events(&mut ev, 5).await;
    let e = entries(&got);
    assert!(
        e[..3]
            .iter()
            .all(|e| e.op == EventOp::Invalidate && e.value.is_none() && e.region == "R")
    );
    assert_eq!(keys(&got)[3..], ["k1", "k2"]);
    assert!(
        e[3..]
            .iter()
            .all(|e| e.op == EventOp::Create && e.value.is_some())
    );
    assert!(drain_quiet(&mut ev).await.is_empty());
}

#[tokio::test]
async fn e8_non_durable_registration_after_ready_gets_an_image_not_events() {
    let n = TestNode::start().await;
    n.put("R", "1", "ONE").await;
    let c = n.durable("X", 600).await;
    c.ready_for_events().await.unwrap();
    let mut ev = c.events().unwrap();
    let image = c
        .region("R")
        .register(Interest::all_keys().durable(false))
        .await
        .unwrap();
    assert_eq!(image.len(), 1);
    assert_eq!(
        (image[0].key.as_str(), image[0].value.as_deref()),
        ("1", Some(&b"ONE"[..]))
    );
    let got = until_live(&mut ev, "R").await;
    assert!(
        entries(&got).is_empty(),
        "the image fires no listener event"
    );
    n.put("R", "2", "TWO").await;
    let got = take_events(&mut ev, 1).await;
    let e = entries(&got)[0];
    assert_eq!(
        (e.key.as_str(), e.op, value(e).as_deref(), e.replayed),
        ("2", EventOp::Create, Some("TWO"), false)
    );
}
