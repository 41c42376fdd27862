//! A storage write that fails (as an fsync failure does) stops the node: the failing publish
//! and every later one are refused, nothing unwritten is delivered or acknowledged, the node
//! reports the failure, and a restart on the same RocksDB finds exactly what was committed.
//! The store is real RocksDB in a temp dir, wrapped so a test can make its writes fail or
//! wait, and its region reads fail.
//!
//! Also (issue 22): while the disk holds writes, one connection's publishes in flight and the
//! whole node's publishes waiting for the writer stay within their byte budgets, and every
//! publish is answered once the disk answers; a failed region read refuses the publish that
//! needed it instead of publishing an update as a `create`.

mod common;

use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

use tether::client::{ClientBuilder, Interest};
use tether::config::ServerConfig;
use tether::protocol::{ErrorCode, QueueStatus};
use tether::server::Node;
use tether_storage::{Batch, RocksStore, StorageError, Store};

use common::{WAIT, entries, keys, take_events};

/// RocksDB whose writes fail while `failing` is set, as if fsync had failed, and wait while
/// `held` is (a disk that does not answer); reads of the region store fail while
/// `failing_reads` is set.
struct FaultyStore {
    inner: RocksStore,
    failing: Arc<AtomicBool>,
    failing_reads: Arc<AtomicBool>,
    held: Arc<Held>,
}

/// A switch that makes storage writes wait.
#[derive(Default)]
struct Held {
    on: Mutex<bool>,
    changed: Condvar,
}

impl Held {
    fn hold(&self) {
        *self.on.lock().unwrap() = true;
    }

    fn release(&self) {
        *self.on.lock().unwrap() = false;
        self.changed.notify_all();
    }

    fn wait(&self) {
        let mut on = self.on.lock().unwrap();
        while *on {
            on = self.changed.wait(on).unwrap();
        }
    }
}

impl Store for FaultyStore {
    fn write(&self, batch: &Batch, sync: bool) -> Result<(), StorageError> {
        self.held.wait();
        if self.failing.load(Ordering::SeqCst) {
            return Err(StorageError::Corrupt("injected: fsync failed (EIO)".into()));
        }
        self.inner.write(batch, sync)
    }
    fn region_get(&self, region: &str, key: &str) -> Result<Option<Vec<u8>>, StorageError> {
        if self.failing_reads.load(Ordering::SeqCst) {
            return Err(StorageError::Corrupt("injected: read failed (EIO)".into()));
        }
        self.inner.region_get(region, key)
    }
    store_passthrough!(inner);
}

fn builder(node: &Node) -> ClientBuilder {
    ClientBuilder::new()
        .server(node.addr())
        .ca_file(node.ca_file())
        .ack_interval(Duration::from_millis(20))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_storage_write_stops_the_node_and_loses_nothing_committed() {
    let dir = tempfile::tempdir().unwrap();
    let failing = Arc::new(AtomicBool::new(false));
    let store = FaultyStore {
        inner: RocksStore::open(&dir.path().join("db")).unwrap(),
        failing: failing.clone(),
        failing_reads: Arc::default(),
        held: Arc::default(),
    };
    let node = Node::start_with_store(ServerConfig::ephemeral(dir.path()), Arc::new(store))
        .await
        .unwrap();
    let d = builder(&node).durable("d", 300).connect().await.unwrap();
    d.region("R").register(Interest::all_keys()).await.unwrap();
    d.ready_for_events().await.unwrap();
    let mut events = d.events().unwrap();
    let p = builder(&node).connect().await.unwrap();
    for i in 0..10 {
        p.region("R")
            .put(format!("ok-{i}"), b"v".to_vec())
            .await
            .unwrap();
    }
    assert_eq!(keys(&take_events(&mut events, 10).await).len(), 10);

    // The disk fails: the publish is refused, and the node says why.
    failing.store(true, Ordering::SeqCst);
    let err = p
        .region("R")
        .put("lost-0", b"v".to_vec())
        .await
        .expect_err("a publish that was not written is not acknowledged");
    assert!(err.to_string().contains("storage"), "{err}");
    let reason = tokio::time::timeout(WAIT, node.failed())
        .await
        .expect("node reports it");
    assert!(reason.to_string().contains("fsync failed"), "{reason}");

    // Fail-stop: even once the disk answers again, the node takes no more writes.
    failing.store(false, Ordering::SeqCst);
    let again = p.region("R").put("lost-1", b"v".to_vec()).await;
    match again {
        Err(tether::client::ClientError::Server(e)) => {
            assert!(
                matches!(e.code, ErrorCode::Internal | ErrorCode::Shutdown),
                "{e:?}"
            );
            // The refusal names the storage failure and its cause, not a mere shutdown.
            assert!(
                e.message.contains("storage failed") && e.message.contains("fsync failed (EIO)"),
                "{e:?}"
            );
        }
        other => panic!("a poisoned node took a write: {other:?}"),
    }
    // Nothing unwritten was delivered.
    let late = common::drain_quiet(&mut events).await;
    assert!(entries(&late).is_empty(), "{late:?}");
    drop(events);
    drop(d);
    drop(p);
    node.shutdown().await;

    // Restarted on the same RocksDB: exactly the committed events wait.
    let node = Node::start(ServerConfig::ephemeral(dir.path()))
        .await
        .unwrap();
    let d = builder(&node).durable("d", 300).connect().await.unwrap();
    assert_eq!(d.queue_status(), QueueStatus::Resumed);
    d.ready_for_events().await.unwrap();
    let got = common::drain_quiet(&mut d.events().unwrap()).await;
    let ks = keys(&got);
    assert!(ks.iter().all(|k| k.starts_with("ok-")), "{ks:?}");
    assert!(node.get("R", "lost-0").unwrap().is_none());
    assert!(node.get("R", "lost-1").unwrap().is_none());
    assert_eq!(node.get("R", "ok-9").unwrap(), Some(b"v".to_vec()));
    node.shutdown().await;
}

/// Starts a node on RocksDB whose writes can be held (`held`), with no write held yet.
async fn node_with_held_writes(dir: &Path) -> (Node, Arc<Held>) {
    let held = Arc::new(Held::default());
    let store = FaultyStore {
        inner: RocksStore::open(&dir.join("db")).unwrap(),
        failing: Arc::new(AtomicBool::new(false)),
        failing_reads: Arc::default(),
        held: held.clone(),
    };
    let node = Node::start_with_store(ServerConfig::ephemeral(dir), Arc::new(store))
        .await
        .unwrap();
    (node, held)
}

/// Size of each publish's value in the byte-budget tests.
const BUDGET_VALUE_BYTES: usize = 1 << 20;

/// Spawns `count` concurrent 1 MiB publishes on `client` (pipelined on its connection).
fn pipeline(
    client: &Arc<tether::client::Client>,
    name: &str,
    count: usize,
) -> Vec<tokio::task::JoinHandle<Result<(), tether::client::ClientError>>> {
    (0..count)
        .map(|i| {
            let client = client.clone();
            let key = format!("{name}-{i}");
            tokio::spawn(async move {
                client
                    .region("R")
                    .put(key, vec![7u8; BUDGET_VALUE_BYTES])
                    .await
            })
        })
        .collect()
}

/// Connects `clients` publishers, holds the disk's writes, and has each pipeline
/// `per_client` publishes of 1 MiB.
async fn held_publishers(
    node: &Node,
    held: &Held,
    clients: usize,
    per_client: usize,
) -> (
    Vec<Arc<tether::client::Client>>,
    Vec<tokio::task::JoinHandle<Result<(), tether::client::ClientError>>>,
) {
    let mut publishers = Vec::new();
    for _ in 0..clients {
        publishers.push(Arc::new(builder(node).connect().await.unwrap()));
    }
    held.hold();
    let puts = publishers
        .iter()
        .enumerate()
        .flat_map(|(c, client)| pipeline(client, &format!("c{c}"), per_client))
        .collect();
    (publishers, puts)
}

/// Lets the disk answer again, and waits for every publish of `puts` to be answered.
async fn answered_once_released(
    held: &Held,
    puts: Vec<tokio::task::JoinHandle<Result<(), tether::client::ClientError>>>,
) {
    held.release();
    for put in puts {
        put.await
            .unwrap()
            .expect("every publish is answered once the disk answers");
    }
}

/// Polls `figure` for `settle` after it first reaches `at_least`; returns the highest value
/// seen. Panics if it never reaches `at_least`.
async fn highest_after_reaching(figure: impl Fn() -> u64, at_least: u64, settle: Duration) -> u64 {
    let deadline = tokio::time::Instant::now() + WAIT;
    while figure() < at_least {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the figure never reached {at_least}: {}",
            figure()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let until = tokio::time::Instant::now() + settle;
    let mut highest = 0;
    while tokio::time::Instant::now() < until {
        highest = highest.max(figure());
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    highest
}

/// Issue 22 point 3: one client connection's publishes in flight are bounded in bytes, not
/// only in count (`PUBLISHES_IN_FLIGHT_MAX`): while the disk holds its writes, a client
/// pipelining 32 publishes of 1 MiB has about `PUBLISH_BYTES_IN_FLIGHT_PER_CONNECTION_MAX`
/// (16 MiB) of them read, plus at most one; the rest waits in the network. Once the disk
/// answers, every publish is answered and committed, and the counts go back to zero.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connections_publishes_in_flight_are_bounded_in_bytes() {
    use tether::limits::PUBLISH_BYTES_IN_FLIGHT_PER_CONNECTION_MAX as BUDGET;
    const PUBLISHES: usize = 2 * BUDGET / BUDGET_VALUE_BYTES;
    let dir = tempfile::tempdir().unwrap();
    let (node, held) = node_with_held_writes(dir.path()).await;
    let p = Arc::new(builder(&node).connect().await.unwrap());
    held.hold();
    let puts = pipeline(&p, "k", PUBLISHES);
    let highest = highest_after_reaching(
        || node.publish_bytes_in_flight(),
        BUDGET as u64,
        Duration::from_secs(1),
    )
    .await;
    // One publish's bytes: its value, key and region name.
    let one = (BUDGET_VALUE_BYTES + 16) as u64;
    assert!(
        highest <= BUDGET as u64 + one,
        "one connection had {highest} bytes of publishes in flight (budget {BUDGET} plus one)"
    );
    answered_once_released(&held, puts).await;
    for i in [0, PUBLISHES - 1] {
        let got = p.region("R").get(format!("k-{i}")).await.unwrap();
        assert_eq!(got.map(|v| v.len()), Some(BUDGET_VALUE_BYTES));
    }
    assert_eq!(node.publish_bytes_in_flight(), 0);
    assert_eq!(node.writer_queue_bytes(), 0);
    node.shutdown().await;
}

/// Issue 22 point 3, node-wide: publishes waiting for the storage writer are bounded in bytes
/// (`WRITER_QUEUE_BYTES_MAX`, 64 MiB), whatever the number of connections: six clients, each
/// within its own budget, would together put about 100 MiB in the writer's queue.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_writers_queue_is_bounded_in_bytes() {
    use tether::limits::{
        PUBLISH_BYTES_IN_FLIGHT_PER_CONNECTION_MAX as BUDGET, WRITER_QUEUE_BYTES_MAX,
    };
    const CLIENTS: usize = WRITER_QUEUE_BYTES_MAX / BUDGET + 2;
    const PER_CLIENT: usize = BUDGET / BUDGET_VALUE_BYTES + 1;
    let dir = tempfile::tempdir().unwrap();
    let (node, held) = node_with_held_writes(dir.path()).await;
    let (_publishers, puts) = held_publishers(&node, &held, CLIENTS, PER_CLIENT).await;
    let highest = highest_after_reaching(
        || node.writer_queue_bytes(),
        (WRITER_QUEUE_BYTES_MAX - 2 * BUDGET_VALUE_BYTES) as u64,
        Duration::from_secs(1),
    )
    .await;
    assert!(
        highest <= WRITER_QUEUE_BYTES_MAX as u64,
        "{highest} bytes of publishes waited for the writer (at most {WRITER_QUEUE_BYTES_MAX})"
    );
    answered_once_released(&held, puts).await;
    assert_eq!(node.publish_bytes_in_flight(), 0);
    assert_eq!(node.writer_queue_bytes(), 0);
    node.shutdown().await;
}

/// Issue 22 point 12: a publish counts in the writer's queue with what it adds to every queue
/// it matches (an event is stored once per queue), not only with its own bytes. Eight
/// durable queues take every 1 MiB publish, so each one writes about 9 MiB: while the disk
/// holds its writes, at most `WRITER_QUEUE_BYTES_MAX / 9 MiB` publishes wait for the writer
/// (counted by requests, apart from the byte count), where the operations' bytes alone would
/// let all 24 of them in. Once the disk answers, every publish is answered and every queue
/// holds them all.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_publish_counts_in_the_writers_queue_with_its_fan_out() {
    use tether::limits::WRITER_QUEUE_BYTES_MAX;
    const QUEUES: usize = 8;
    const CLIENTS: usize = 2;
    const PER_CLIENT: usize = 12;
    let dir = tempfile::tempdir().unwrap();
    let (node, held) = node_with_held_writes(dir.path()).await;
    let mut queues = Vec::new();
    for q in 0..QUEUES {
        let d = builder(&node)
            .durable(format!("fan-{q}"), 300)
            .connect()
            .await
            .unwrap();
        d.region("R").register(Interest::all_keys()).await.unwrap();
        queues.push(d);
    }
    let (clients, puts) = held_publishers(&node, &held, CLIENTS, PER_CLIENT).await;
    // What one publish writes: its value to the region and to each queue.
    let one = ((QUEUES + 1) * BUDGET_VALUE_BYTES) as u64;
    let room = WRITER_QUEUE_BYTES_MAX as u64 / one;
    let highest = highest_after_reaching(
        || node.writer_queue_requests() as u64,
        room - 1,
        Duration::from_secs(1),
    )
    .await;
    assert!(
        highest <= room,
        "{highest} publishes of {one} bytes each waited for the writer (room for {room})"
    );
    let bytes = node.writer_queue_bytes();
    assert!(
        bytes <= WRITER_QUEUE_BYTES_MAX as u64,
        "{bytes} bytes waited for the writer (at most {WRITER_QUEUE_BYTES_MAX})"
    );
    answered_once_released(&held, puts).await;
    assert_eq!(node.writer_queue_bytes(), 0);
    assert_eq!(node.writer_queue_requests(), 0);
    let reports = clients[0].queues().await.unwrap();
    let fanned: Vec<u64> = reports
        .iter()
        .filter(|r| {
            r.durable_id
                .as_deref()
                .is_some_and(|id| id.starts_with("fan-"))
        })
        .map(|r| r.pending)
        .collect();
    assert_eq!(
        fanned,
        [(CLIENTS * PER_CLIENT) as u64; QUEUES],
        "{reports:?}"
    );
    drop(queues);
    node.shutdown().await;
}

/// Issue 22 (low): a failed read of the region store while a publish is planned refuses the
/// publish with the error, instead of counting the key as absent (which would have published
/// an update as a `create`). Nothing of the refused publish is applied; once reads work again
/// the next put of the key is an `update`. The key is in the store before the node starts: a
/// key the node wrote itself is known to its core and not read again (`KNOWN_REGION_KEYS_BYTES_MAX`),
/// which a put of `mine` while reads fail shows.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_region_read_refuses_the_publish() {
    use tether::protocol::EventOp;
    let dir = tempfile::tempdir().unwrap();
    let failing_reads = Arc::new(AtomicBool::new(false));
    let inner = RocksStore::open(&dir.path().join("db")).unwrap();
    let mut before = Batch::new();
    before.region_put("R", "k", tether::core::encode_region_value(Some(b"v1")));
    inner.write(&before, true).unwrap();
    let store = FaultyStore {
        inner,
        failing: Arc::new(AtomicBool::new(false)),
        failing_reads: failing_reads.clone(),
        held: Arc::default(),
    };
    let node = Node::start_with_store(ServerConfig::ephemeral(dir.path()), Arc::new(store))
        .await
        .unwrap();
    let d = builder(&node).connect().await.unwrap();
    d.region("R").register(Interest::all_keys()).await.unwrap();
    d.ready_for_events().await.unwrap();
    let mut events = d.events().unwrap();
    let p = builder(&node).connect().await.unwrap();
    assert_eq!(p.region("R").get("k").await.unwrap(), Some(b"v1".to_vec()));
    p.region("R").put("mine", b"m1".to_vec()).await.unwrap();
    failing_reads.store(true, Ordering::SeqCst);
    p.region("R")
        .put("mine", b"m2".to_vec())
        .await
        .expect("a key this node wrote is not read again");
    let refused = p
        .region("R")
        .put("k", b"v2".to_vec())
        .await
        .expect_err("a publish whose key could not be read is refused");
    match &refused {
        tether::client::ClientError::Server(e) => {
            assert_eq!(e.code, ErrorCode::Internal, "{e:?}");
            assert!(e.message.contains("reading key"), "{e:?}");
        }
        other => panic!("refused without a server error: {other:?}"),
    }
    failing_reads.store(false, Ordering::SeqCst);
    p.region("R").put("k", b"v3".to_vec()).await.unwrap();
    let taken = take_events(&mut events, 3).await;
    let got = entries(&taken);
    let seen: Vec<(&str, EventOp, Option<Vec<u8>>)> = got
        .iter()
        .map(|e| (e.key.as_str(), e.op, e.value.clone()))
        .collect();
    assert_eq!(
        seen,
        [
            ("mine", EventOp::Create, Some(b"m1".to_vec())),
            ("mine", EventOp::Update, Some(b"m2".to_vec())),
            ("k", EventOp::Update, Some(b"v3".to_vec()))
        ]
    );
    assert_eq!(p.region("R").get("k").await.unwrap(), Some(b"v3".to_vec()));
    node.shutdown().await;
}

/// RocksDB whose node-state records cannot be read (a disk answering EIO to those reads).
struct UnreadableState {
    inner: RocksStore,
}

impl Store for UnreadableState {
    fn write(&self, batch: &Batch, sync: bool) -> Result<(), StorageError> {
        self.inner.write(batch, sync)
    }
    fn region_get(&self, region: &str, key: &str) -> Result<Option<Vec<u8>>, StorageError> {
        self.inner.region_get(region, key)
    }
    fn state_get(&self, _key: &str) -> Result<Option<Vec<u8>>, StorageError> {
        Err(StorageError::Corrupt("injected: read failed (EIO)".into()))
    }
    store_passthrough!(@but_state inner);
}

/// A node that cannot read its state records (the next session id among them) does not start:
/// taking them as absent would number sessions from 1 again, and event ids would repeat.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_that_cannot_read_its_state_records_refuses_to_start() {
    let dir = tempfile::tempdir().unwrap();
    let config = ServerConfig::ephemeral(dir.path());
    {
        let node = Node::start(config.clone()).await.unwrap();
        let p = builder(&node).connect().await.unwrap();
        p.region("R").put("k", b"v".to_vec()).await.unwrap();
        p.close(false).await.unwrap();
        node.shutdown().await;
    }
    let store = UnreadableState {
        inner: RocksStore::open(&dir.path().join("db")).unwrap(),
    };
    let refused = Node::start_with_store(config, Arc::new(store)).await;
    let err = match refused {
        Ok(node) => {
            node.shutdown().await;
            panic!("a node started on state records it could not read");
        }
        Err(e) => e.to_string(),
    };
    assert!(err.contains("read failed (EIO)"), "{err}");
}
