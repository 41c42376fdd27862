//! A machine crash (power cut), not a process kill: writes that were not synced are lost.
//! Issue 22, point 8: `possible_duplicate` must still be exact after one. An entry the node put
//! on the wire before the cut is redelivered after the restart with the flag; an entry
//! published after the restart arrives without it.
//!
//! The store under the node is real RocksDB, wrapped: every write goes to a "visible" RocksDB
//! the node reads, and a second RocksDB receives exactly what a power cut would keep: a synced
//! write, together with every unsynced write before it (RocksDB syncs its write-ahead log in
//! order). At the cut, the second database stops receiving writes; the node restarts on it.

mod common;

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tether::client::{AckMode, ClientBuilder, ClientEvent, Interest};
use tether::config::ServerConfig;
use tether::protocol::QueueStatus;
use tether::server::Node;
use tether_storage::{Batch, Offset, QueueId, QueueMeta, RocksStore, StorageError, Store};

use common::{QUIET, entries, take_events};

/// What survives a power cut: the synced prefix of the writes.
struct Survivor {
    /// `None` once the power is cut: later writes are lost.
    store: Option<RocksStore>,
    /// Unsynced writes since the last synced one, in order.
    unsynced: Vec<Batch>,
}

/// Real RocksDB whose synced writes (and everything written before them) also reach a second
/// RocksDB, the disk as a power cut leaves it.
struct PowerCutStore {
    visible: RocksStore,
    survivor: Mutex<Survivor>,
    survivor_path: PathBuf,
}

impl PowerCutStore {
    fn open(dir: &Path) -> Self {
        let survivor_path = dir.join("survivor");
        PowerCutStore {
            visible: RocksStore::open(&dir.join("visible")).unwrap(),
            survivor: Mutex::new(Survivor {
                store: Some(RocksStore::open(&survivor_path).unwrap()),
                unsynced: Vec::new(),
            }),
            survivor_path,
        }
    }

    /// Cuts the power: unsynced writes are lost and nothing written from now on survives.
    /// Returns the path of the database as the disk holds it (closed, ready to reopen).
    fn cut(&self) -> PathBuf {
        let mut s = self.survivor.lock().unwrap();
        s.store = None;
        s.unsynced.clear();
        self.survivor_path.clone()
    }
}

impl Store for PowerCutStore {
    fn write(&self, batch: &Batch, sync: bool) -> Result<(), StorageError> {
        // One lock over both writes: the survivor sees the writes in the visible store's order.
        let mut s = self.survivor.lock().unwrap();
        self.visible.write(batch, sync)?;
        let Survivor { store, unsynced } = &mut *s;
        if let Some(store) = store {
            if sync {
                for b in unsynced.drain(..) {
                    store.write(&b, true)?;
                }
                store.write(batch, true)?;
            } else {
                unsynced.push(batch.clone());
            }
        }
        Ok(())
    }
    fn queue_meta(&self, queue: QueueId) -> Result<Option<QueueMeta>, StorageError> {
        self.visible.queue_meta(queue)
    }
    fn queues(&self) -> Result<Vec<(QueueId, QueueMeta)>, StorageError> {
        self.visible.queues()
    }
    fn read_entries(
        &self,
        queue: QueueId,
        from: Offset,
        to: Offset,
        max_bytes: usize,
        visit: &mut dyn FnMut(Offset, u8, &[u8]),
    ) -> Result<usize, StorageError> {
        self.visible.read_entries(queue, from, to, max_bytes, visit)
    }
    fn region_get(&self, region: &str, key: &str) -> Result<Option<Vec<u8>>, StorageError> {
        self.visible.region_get(region, key)
    }
    fn region_scan(
        &self,
        region: &str,
        after: Option<&str>,
        visit: &mut dyn FnMut(&str, &[u8]) -> std::ops::ControlFlow<()>,
    ) -> Result<(), StorageError> {
        self.visible.region_scan(region, after, visit)
    }
    fn state_get(&self, key: &str) -> Result<Option<Vec<u8>>, StorageError> {
        self.visible.state_get(key)
    }
    fn flush(&self) -> Result<(), StorageError> {
        self.visible.flush()
    }
    fn quiesce(&self) {
        self.visible.quiesce()
    }
}

fn builder(node: &Node) -> ClientBuilder {
    ClientBuilder::new()
        .server(node.addr())
        .ca_file(node.ca_file())
        .ack_interval(Duration::from_millis(20))
}

/// Publishes `keys` on region R, each acknowledged (so synced under the node's sync mode).
async fn publish(node: &Node, keys: std::ops::Range<u32>) {
    let p = builder(node).connect().await.unwrap();
    for i in keys {
        p.region("R")
            .put(format!("k{i}"), b"v".to_vec())
            .await
            .unwrap();
    }
    p.close(false).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn entries_sent_before_a_power_cut_come_back_flagged_possible_duplicate() {
    let dir = tempfile::tempdir().unwrap();
    let config = ServerConfig::ephemeral(dir.path());
    let store = Arc::new(PowerCutStore::open(&dir.path().join("db")));
    let node = Node::start_with_store(config.clone(), store.clone())
        .await
        .unwrap();

    // A durable client that receives 5 events and acks none of them.
    let d = builder(&node)
        .durable("d", 300)
        .ack_mode(AckMode::Manual)
        .connect()
        .await
        .unwrap();
    d.region("R").register(Interest::all_keys()).await.unwrap();
    d.ready_for_events().await.unwrap();
    let mut events = d.events().unwrap();
    publish(&node, 0..3).await;
    let first = take_events(&mut events, 3).await;
    publish(&node, 3..5).await;
    let second = take_events(&mut events, 2).await;
    let sent: Vec<u64> = entries(&first)
        .iter()
        .chain(entries(&second).iter())
        .map(|e| e.offset)
        .collect();
    assert_eq!(sent, vec![1, 2, 3, 4, 5]);

    // The power goes: every entry is on the disk (each publish was synced before it was
    // delivered); what the node wrote after without a sync is not.
    let survivor = store.cut();
    drop(events);
    drop(d);
    node.shutdown().await;
    drop(store);

    let node = Node::start_with_store(config, Arc::new(RocksStore::open(&survivor).unwrap()))
        .await
        .unwrap();
    let d = builder(&node).durable("d", 300).connect().await.unwrap();
    assert_eq!(d.queue_status(), QueueStatus::Resumed);
    assert_eq!(d.pending(), Some(5), "every synced entry survived the cut");
    d.region("R").register(Interest::all_keys()).await.unwrap();
    d.ready_for_events().await.unwrap();
    let mut events = d.events().unwrap();
    let replay = take_events(&mut events, 5).await;
    for e in entries(&replay) {
        assert!(e.replayed, "offset {} is a replay: {replay:?}", e.offset);
        assert!(
            e.possible_duplicate,
            "offset {} was sent before the power cut and comes back without \
             possible_duplicate: {replay:?}",
            e.offset
        );
    }

    // Entries published after the restart were never sent: no flag.
    publish(&node, 5..7).await;
    let live = take_events(&mut events, 2).await;
    let live: Vec<_> = entries(&live)
        .iter()
        .map(|e| (e.offset, e.replayed, e.possible_duplicate))
        .collect();
    assert_eq!(live, vec![(6, false, false), (7, false, false)]);
    assert!(
        tokio::time::timeout(QUIET, events.next())
            .await
            .map_or(true, |e| !matches!(e, Some(ClientEvent::Event(_)))),
        "nothing else arrives"
    );
    drop(events);
    d.close(false).await.unwrap();
    node.shutdown().await;
}
