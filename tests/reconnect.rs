//! Automatic reconnection ([`Subscription`]) against a real `tether server` process that is
//! stopped (SIGTERM) or killed (SIGKILL) under live clients and started again on the same port
//! and data directory after 1 s or 10 s (redundancy 0: the queue lives on that one node).
//!
//! What must hold: nothing the server acknowledged is lost, nothing the application processed
//! is shown again, events redelivered are flagged, the application's stream never ends, and a
//! non-durable client gets its interest back.

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use common::ServerProc;
use tether::client::{
    AckMode, ClientBuilder, ClientEvent, Event, Interest, StreamBatch, Subscription,
};
use tether::protocol::QueueStatus;

/// Bound on waiting for one event across an outage (detection, down time, backoff).
const OUTAGE_WAIT: Duration = Duration::from_secs(60);
/// How long the server may stay silent before a client counts its connection lost.
const FAILURE_TIMEOUT: Duration = Duration::from_millis(1_500);
const REGION: &str = "R";
/// Events published before the outage, and how many of them are acked before it (the rest
/// are processed but not acked: the queue keeps them).
const BEFORE: u32 = 50;
const TAKEN_BEFORE: u32 = 20;
/// Events published after the server is back.
const AFTER: u32 = 10;

#[derive(Clone, Copy, Debug)]
enum Stop {
    Term,
    Kill,
}

struct Server {
    proc: Option<ServerProc>,
    dir: tempfile::TempDir,
    listen: String,
}

impl Server {
    fn start() -> Server {
        let dir = tempfile::tempdir().unwrap();
        let port = common::ports::free_ports(1)[0];
        let listen = format!("127.0.0.1:{port}");
        let proc = ServerProc::start(dir.path(), &["--listen", &listen]);
        Server {
            proc: Some(proc),
            dir,
            listen,
        }
    }

    fn builder(&self) -> ClientBuilder {
        let p = self.proc.as_ref().expect("running");
        ClientBuilder::new()
            .server(p.addr)
            .ca_file(&p.ca)
            .failure_timeout(FAILURE_TIMEOUT)
            .ack_interval(Duration::from_millis(20))
    }

    fn stop(&mut self, how: Stop) {
        let p = self.proc.take().expect("running");
        match how {
            Stop::Term => p.sigterm(),
            Stop::Kill => p.kill9(),
        }
    }

    fn restart(&mut self) {
        assert!(self.proc.is_none());
        self.proc = Some(ServerProc::start(
            self.dir.path(),
            &["--listen", &self.listen],
        ));
    }

    async fn put_range(&self, keys: std::ops::Range<u32>) {
        let c = self.builder().connect().await.expect("publisher connects");
        for i in keys {
            c.region(REGION)
                .put(format!("k-{i}"), format!("v-{i}"))
                .await
                .expect("put");
        }
        c.close(false).await.expect("publisher closes");
    }
}

/// The next event of `sub` within `wait`; a stream end fails the test.
async fn next(sub: &mut Subscription, wait: Duration) -> ClientEvent {
    tokio::time::timeout(wait, sub.next())
        .await
        .unwrap_or_else(|_| panic!("nothing for {wait:?}"))
        .unwrap_or_else(|| panic!("the subscription ended: {:?}", sub.ended()))
}

async fn next_entry(sub: &mut Subscription, wait: Duration) -> Event {
    loop {
        match next(sub, wait).await {
            ClientEvent::Event(e) => return e,
            ClientEvent::Live { .. } => {}
            other => panic!("expected an event, got {other:?}"),
        }
    }
}

async fn survives(stop: Stop, down: Duration) {
    let mut server = Server::start();
    // Acks only when the test says (the interval is an hour): what the server keeps for the
    // queue at the reconnect is then known exactly.
    let mut durable = server
        .builder()
        .durable("reconnecting", 300)
        .ack_interval(Duration::from_secs(3_600))
        .subscribe([(REGION.to_string(), Interest::all_keys())])
        .await
        .expect("durable subscription");
    let mut plain = server
        .builder()
        .subscribe([(REGION.to_string(), Interest::key("plain"))])
        .await
        .expect("non-durable subscription");
    // Before: the application processes TAKEN_BEFORE events and they are acked; the rest
    // reach the client and are processed, but not acked, before the server goes.
    server.put_range(0..BEFORE).await;
    let mut shown: BTreeMap<String, Event> = BTreeMap::new();
    for _ in 0..TAKEN_BEFORE {
        let e = next_entry(&mut durable, common::WAIT).await;
        assert!(!e.replayed && !e.possible_duplicate, "{e:?}");
        assert!(shown.insert(e.key.clone(), e).is_none());
    }
    durable.commit();
    durable
        .client()
        .expect("connected")
        .ack_now()
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await; // the rest arrive, the ack commits
    server.stop(stop);
    let started = Instant::now();
    loop {
        match next(&mut durable, OUTAGE_WAIT).await {
            ClientEvent::Event(e) => {
                assert!(!e.replayed && !e.possible_duplicate, "{e:?}");
                assert!(shown.insert(e.key.clone(), e).is_none());
            }
            ClientEvent::Disconnected { error } => {
                eprintln!("{stop:?}: loss seen after {:?}: {error}", started.elapsed());
                break;
            }
            other => panic!("expected events, then the loss, got {other:?}"),
        }
    }
    assert_eq!(
        shown.len() as u32,
        BEFORE,
        "every event received before the loss is shown"
    );
    // The non-durable client was live at once (its marker came at registration).
    match next(&mut plain, OUTAGE_WAIT).await {
        ClientEvent::Live { regions } => assert_eq!(regions, [REGION]),
        other => panic!("expected the live marker, got {other:?}"),
    }
    match next(&mut plain, OUTAGE_WAIT).await {
        ClientEvent::Disconnected { .. } => {}
        other => panic!("expected the loss to be reported, got {other:?}"),
    }
    tokio::time::sleep(down).await;
    server.restart();
    let back = Instant::now();
    match next(&mut durable, OUTAGE_WAIT).await {
        ClientEvent::Reconnected { queue, pending } => {
            eprintln!(
                "{stop:?}, down {down:?}: reconnected {:?} after the server was back",
                back.elapsed()
            );
            // The queue kept everything not acked: it is redelivered (flagged), and dropped by
            // the subscription's duplicate suppression, since the application processed it.
            assert_eq!(queue, QueueStatus::Resumed);
            assert_eq!(pending, Some(u64::from(BEFORE - TAKEN_BEFORE)));
        }
        other => panic!("expected a reconnect, got {other:?}"),
    }
    match next(&mut plain, OUTAGE_WAIT).await {
        ClientEvent::Reconnected { queue, pending } => {
            assert_eq!((queue, pending), (QueueStatus::None, None));
        }
        other => panic!("expected a reconnect, got {other:?}"),
    }
    // After: live events, none shown twice, and the non-durable interest is back.
    let published = Instant::now();
    server.put_range(BEFORE..BEFORE + AFTER).await;
    for i in BEFORE..BEFORE + AFTER {
        let e = next_entry(&mut durable, common::WAIT).await;
        if i == BEFORE {
            eprintln!(
                "{stop:?}, down {down:?}: first event {:?} after the server was back ({:?} after its publish)",
                back.elapsed(),
                published.elapsed()
            );
        }
        assert_eq!(e.key, format!("k-{i}"), "{e:?}");
        assert!(!e.replayed && !e.possible_duplicate, "{e:?}");
        assert!(shown.insert(e.key.clone(), e).is_none());
    }
    let c = server.builder().connect().await.unwrap();
    c.region(REGION).put("plain", "back").await.unwrap();
    c.close(false).await.unwrap();
    let e = next_entry(&mut plain, common::WAIT).await;
    assert_eq!(
        (e.key.as_str(), e.value.as_deref()),
        ("plain", Some(&b"back"[..]))
    );
    let e = next_entry(&mut durable, common::WAIT).await; // all keys: this one too
    assert!(shown.insert(e.key.clone(), e).is_none());
    assert_eq!(shown.len() as u32, BEFORE + AFTER + 1);
    assert_eq!((durable.reconnects(), plain.reconnects()), (1, 1));
    // Nothing more: no second live marker, no duplicate.
    if let Ok(Some(ev)) = tokio::time::timeout(common::QUIET, durable.next()).await {
        panic!("unexpected {ev:?}");
    }
    durable.close(false).await.expect("close");
    plain.close(false).await.expect("close");
}

/// `Subscription::next_batch` across a killed and restarted server: the events in batches
/// read in place, the loss and the reconnection as the batches' other items, and nothing the
/// application processed shown twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn batches_across_a_restart_show_everything_once() {
    let mut server = Server::start();
    let mut sub = server
        .builder()
        .durable("batched", 300)
        .subscribe([(REGION.to_string(), Interest::all_keys())])
        .await
        .expect("durable subscription");
    let mut keys: Vec<String> = Vec::new();
    let (mut lost, mut back) = (false, false);
    let take = async |sub: &mut Subscription, keys: &mut Vec<String>| match tokio::time::timeout(
        OUTAGE_WAIT,
        sub.next_batch(),
    )
    .await
    .expect("an item")
    .expect("the subscription goes on")
    {
        StreamBatch::Events(b) => {
            for v in b.iter() {
                assert!(!v.possible_duplicate, "{v:?}");
                keys.push(v.key.to_owned());
            }
            None
        }
        StreamBatch::Other(ClientEvent::Live { .. }) => None,
        StreamBatch::Other(other) => Some(other),
    };
    server.put_range(0..BEFORE).await;
    while keys.len() < BEFORE as usize {
        assert!(take(&mut sub, &mut keys).await.is_none());
    }
    sub.commit();
    sub.client().expect("connected").ack_now().await.unwrap();
    server.stop(Stop::Kill);
    while !lost {
        match take(&mut sub, &mut keys).await {
            Some(ClientEvent::Disconnected { .. }) => lost = true,
            None => {}
            Some(other) => panic!("expected the loss, got {other:?}"),
        }
    }
    server.restart();
    while !back {
        match take(&mut sub, &mut keys).await {
            Some(ClientEvent::Reconnected { queue, .. }) => {
                assert_eq!(queue, QueueStatus::Resumed);
                back = true;
            }
            None => {}
            Some(other) => panic!("expected the reconnection, got {other:?}"),
        }
    }
    server.put_range(BEFORE..BEFORE + AFTER).await;
    while keys.len() < (BEFORE + AFTER) as usize {
        assert!(take(&mut sub, &mut keys).await.is_none());
    }
    let expected: Vec<String> = (0..BEFORE + AFTER).map(|i| format!("k-{i}")).collect();
    assert_eq!(keys, expected, "every event once, in order");
    sub.close(false).await.expect("close");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_restart_after_1s_loses_nothing() {
    survives(Stop::Term, Duration::from_secs(1)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_restart_after_10s_loses_nothing() {
    survives(Stop::Term, Duration::from_secs(10)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigkill_restart_after_1s_loses_nothing() {
    survives(Stop::Kill, Duration::from_secs(1)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigkill_restart_after_10s_loses_nothing() {
    survives(Stop::Kill, Duration::from_secs(10)).await;
}

/// Reconnecting stops for good when the server refuses the client for a reason a retry
/// cannot fix, and when the policy's time limit passes: the stream ends and says why.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_subscription_gives_up_after_its_time_limit() {
    let mut server = Server::start();
    let mut sub = server
        .builder()
        .durable("gives-up", 300)
        .reconnect(tether::client::ReconnectPolicy {
            give_up_after: Some(Duration::from_secs(2)),
            ..Default::default()
        })
        .subscribe([(REGION.to_string(), Interest::all_keys())])
        .await
        .unwrap();
    server.stop(Stop::Term);
    loop {
        match next(&mut sub, OUTAGE_WAIT).await {
            ClientEvent::Live { .. } => {}
            ClientEvent::Disconnected { .. } => break,
            other => panic!("expected the loss to be reported, got {other:?}"),
        }
    }
    let end = tokio::time::timeout(OUTAGE_WAIT, sub.next()).await.unwrap();
    assert!(end.is_none(), "{end:?}");
    let why = sub.ended().expect("says why").to_string();
    assert!(why.contains("gave up reconnecting"), "{why}");
    assert!(sub.close(true).await.is_err());
}

/// Manual acks across a restart: events the application still works on are not shown again
/// when the queue redelivers them, and their acks, made after the reconnect, count.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn manual_acks_held_across_a_restart_count_and_work_in_progress_is_not_shown_twice() {
    let mut server = Server::start();
    let mut sub = server
        .builder()
        .durable("manual", 300)
        .ack_mode(AckMode::Manual)
        .subscribe([(REGION.to_string(), Interest::all_keys())])
        .await
        .unwrap();
    server.put_range(0..BEFORE).await;
    let mut shown = BTreeSet::new();
    let mut in_progress = Vec::new();
    for i in 0..BEFORE {
        let e = next_entry(&mut sub, common::WAIT).await;
        assert!(shown.insert(e.key.clone()), "{e:?}");
        // Every other event's work is still running (offsets 2, 4, ...): the acked prefix
        // stops at offset 1.
        if i % 2 == 0 {
            assert_eq!(sub.ack(e.offset).unwrap(), 1);
        } else {
            in_progress.push(e.offset);
        }
    }
    tokio::time::sleep(Duration::from_millis(300)).await; // the ack of offset 1 goes out
    server.stop(Stop::Term);
    assert!(matches!(
        next(&mut sub, OUTAGE_WAIT).await,
        ClientEvent::Disconnected { .. }
    ));
    tokio::time::sleep(Duration::from_secs(1)).await;
    server.restart();
    match next(&mut sub, OUTAGE_WAIT).await {
        ClientEvent::Reconnected { queue, pending } => {
            assert_eq!(
                (queue, pending),
                (QueueStatus::Resumed, Some(u64::from(BEFORE) - 1))
            );
        }
        other => panic!("expected a reconnect, got {other:?}"),
    }
    // The work finishes now, after the reconnect.
    let mut through = 0;
    for o in in_progress {
        through = sub.ack(o).unwrap();
    }
    assert_eq!(through, u64::from(BEFORE));
    server.put_range(BEFORE..BEFORE + AFTER).await;
    for i in BEFORE..BEFORE + AFTER {
        let e = next_entry(&mut sub, common::WAIT).await;
        assert_eq!(e.key, format!("k-{i}"), "a redelivery was shown: {e:?}");
        assert!(shown.insert(e.key.clone()));
        sub.ack(e.offset).unwrap();
    }
    if let Ok(Some(ev)) = tokio::time::timeout(common::QUIET, sub.next()).await {
        panic!("unexpected {ev:?}");
    }
    sub.close(true).await.unwrap();
    // Every ack reached the server: the queue is empty.
    let admin = server.builder().connect().await.unwrap();
    let q = admin
        .queues()
        .await
        .unwrap()
        .into_iter()
        .find(|q| q.durable_id.as_deref() == Some("manual"))
        .expect("kept");
    assert_eq!((q.pending, q.acked_offset), (0, u64::from(BEFORE + AFTER)));
    admin.close(false).await.unwrap();
}
