//! A storage write that fails (as an fsync failure does) stops the node: the failing publish
//! and every later one are refused, nothing unwritten is delivered or acknowledged, the node
//! reports the failure, and a restart on the same RocksDB finds exactly what was committed.
//! The store is real RocksDB in a temp dir, wrapped so a test can make its writes fail.

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use tether::client::{ClientBuilder, Interest};
use tether::config::ServerConfig;
use tether::protocol::{ErrorCode, QueueStatus};
use tether::server::Node;
use tether_storage::{Batch, Offset, QueueId, QueueMeta, RocksStore, StorageError, Store};

use common::{WAIT, entries, keys, take_events};

/// RocksDB whose writes fail while `failing` is set, as if fsync had failed.
struct FaultyStore {
    inner: RocksStore,
    failing: Arc<AtomicBool>,
}

impl Store for FaultyStore {
    fn write(&self, batch: &Batch, sync: bool) -> Result<(), StorageError> {
        if self.failing.load(Ordering::SeqCst) {
            return Err(StorageError::Corrupt("injected: fsync failed (EIO)".into()));
        }
        self.inner.write(batch, sync)
    }
    fn queue_meta(&self, queue: QueueId) -> Result<Option<QueueMeta>, StorageError> {
        self.inner.queue_meta(queue)
    }
    fn queues(&self) -> Result<Vec<(QueueId, QueueMeta)>, StorageError> {
        self.inner.queues()
    }
    fn read_entries(
        &self,
        queue: QueueId,
        from: Offset,
        to: Offset,
        max_bytes: usize,
        visit: &mut dyn FnMut(Offset, u8, &[u8]),
    ) -> Result<usize, StorageError> {
        self.inner.read_entries(queue, from, to, max_bytes, visit)
    }
    fn region_get(&self, region: &str, key: &str) -> Result<Option<Vec<u8>>, StorageError> {
        self.inner.region_get(region, key)
    }
    fn region_scan(
        &self,
        region: &str,
        after: Option<&str>,
        visit: &mut dyn FnMut(&str, &[u8]) -> std::ops::ControlFlow<()>,
    ) -> Result<(), StorageError> {
        self.inner.region_scan(region, after, visit)
    }
    fn state_get(&self, key: &str) -> Result<Option<Vec<u8>>, StorageError> {
        self.inner.state_get(key)
    }
    fn flush(&self) -> Result<(), StorageError> {
        self.inner.flush()
    }
    fn quiesce(&self) {
        self.inner.quiesce()
    }
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
    assert!(reason.contains("fsync failed"), "{reason}");

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
