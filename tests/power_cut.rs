//! A machine crash (power cut), not a process kill: writes that were not synced are lost.
//! Issue 22, point 8: `possible_duplicate` must still be exact after one. An entry the node put
//! on the wire before the cut is redelivered after the restart with the flag; an entry
//! published after the restart arrives without it.
//!
//! The store under the node is real RocksDB, wrapped: every write goes to a "visible" RocksDB
//! the node reads, and a second RocksDB receives exactly what a power cut would keep: a synced
//! write, together with every unsynced write before it (RocksDB syncs its write-ahead log in
//! order). At the cut, the second database stops receiving writes; the node restarts on it.
//!
//! Point 9 (defence in depth): a client resuming its queue in the same process tells the node
//! the newest entry it saw. Under `--sync none` a power cut can take entries a client saw; the
//! node must not let new events take their offsets unnoticed (the client would drop them as
//! processed), and a lost delivered mark is made up for by the client's word.

mod common;

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tether::client::{
    AckMode, Client, ClientBuilder, ClientEvent, DedupState, EventStream, Interest,
};
use tether::config::{ServerConfig, SyncMode};
use tether::protocol::QueueStatus;
use tether::server::Node;
use tether_storage::{Batch, RocksStore, StorageError, Store};

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

    /// The operating system writes its dirty pages back (as it does every few seconds under
    /// `--sync none`): everything written so far survives a later cut.
    fn writeback(&self) {
        let mut s = self.survivor.lock().unwrap();
        let Survivor { store, unsynced } = &mut *s;
        let store = store.as_ref().expect("before the cut");
        for b in unsynced.drain(..) {
            store.write(&b, true).unwrap();
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
    fn region_get(&self, region: &str, key: &str) -> Result<Option<Vec<u8>>, StorageError> {
        self.visible.region_get(region, key)
    }
    store_passthrough!(visible);
}

fn builder(node: &Node) -> ClientBuilder {
    ClientBuilder::new()
        .server(node.addr())
        .ca_file(node.ca_file())
        .ack_interval(Duration::from_millis(20))
}

/// A node on a store whose power can be cut.
struct Machine {
    config: ServerConfig,
    store: Arc<PowerCutStore>,
    node: Node,
}

impl Machine {
    async fn start(dir: &Path, sync: SyncMode) -> Machine {
        let mut config = ServerConfig::ephemeral(dir);
        config.sync = sync;
        let store = Arc::new(PowerCutStore::open(&dir.join("db")));
        let node = Node::start_with_store(config.clone(), store.clone())
            .await
            .unwrap();
        Machine {
            config,
            store,
            node,
        }
    }

    /// Cuts the power, then starts the node again on what the disk kept.
    async fn cut_and_restart(self) -> Node {
        let survivor = self.store.cut();
        self.node.shutdown().await;
        drop(self.store);
        let store = Arc::new(RocksStore::open(&survivor).unwrap());
        Node::start_with_store(self.config, store).await.unwrap()
    }
}

/// Durable client "d" with interest in all of region R; `state` shared across its sessions.
/// It acks nothing (its acks would race the power cut).
async fn subscriber(node: &Node, state: &DedupState, mode: AckMode) -> Client {
    let d = builder(node)
        .durable("d", 300)
        .dedup_state(state.clone())
        .ack_mode(mode)
        .ack_interval(Duration::from_secs(3600))
        .connect()
        .await
        .unwrap();
    d.region("R").register(Interest::all_keys()).await.unwrap();
    d
}

/// "d" again, with `state`, after the restart: its queue was resumed with `pending` entries.
async fn resume(node: &Node, state: &DedupState, pending: u64) -> Client {
    resume_from(builder(node), state, pending).await
}

async fn resume_from(builder: ClientBuilder, state: &DedupState, pending: u64) -> Client {
    let d = builder
        .durable("d", 300)
        .dedup_state(state.clone())
        .connect()
        .await
        .unwrap();
    assert_eq!(
        (d.queue_status(), d.pending()),
        (QueueStatus::Resumed, Some(pending))
    );
    d
}

/// Publishes `keys` on region R, each acknowledged (so synced under the node's sync mode).
async fn publish(node: &Node, keys: std::ops::Range<u32>) {
    publish_named(node, "k", keys).await;
}

async fn publish_named(node: &Node, prefix: &str, keys: std::ops::Range<u32>) {
    let p = builder(node).connect().await.unwrap();
    for i in keys {
        p.region("R")
            .put(format!("{prefix}{i}"), b"v".to_vec())
            .await
            .unwrap();
    }
    p.close(false).await.unwrap();
}

/// `(key, offset, replayed, possible_duplicate)` of the entries among `evs`.
fn seen(evs: &[ClientEvent]) -> Vec<(String, u64, bool, bool)> {
    entries(evs)
        .iter()
        .map(|e| (e.key.clone(), e.offset, e.replayed, e.possible_duplicate))
        .collect()
}

async fn finish(events: EventStream, d: Client, node: Node) {
    drop(events);
    d.close(false).await.unwrap();
    node.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn entries_sent_before_a_power_cut_come_back_flagged_possible_duplicate() {
    let dir = tempfile::tempdir().unwrap();
    let m = Machine::start(dir.path(), SyncMode::Batch).await;
    let state = DedupState::default();

    // A durable client that receives 5 events and acks none of them.
    let d = subscriber(&m.node, &state, AckMode::Manual).await;
    d.ready_for_events().await.unwrap();
    let mut events = d.events().unwrap();
    publish(&m.node, 0..3).await;
    let first = take_events(&mut events, 3).await;
    publish(&m.node, 3..5).await;
    let second = take_events(&mut events, 2).await;
    let sent: Vec<u64> = entries(&first)
        .iter()
        .chain(entries(&second).iter())
        .map(|e| e.offset)
        .collect();
    assert_eq!(sent, vec![1, 2, 3, 4, 5]);

    // The power goes: every entry is on the disk (each publish was synced before it was
    // delivered); what the node wrote after without a sync is not.
    drop(events);
    drop(d);
    let node = m.cut_and_restart().await;
    // A new process: nothing processed, nothing seen.
    let d = resume(&node, &DedupState::default(), 5).await;
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
    finish(events, d, node).await;
}

/// A node under `--sync none` whose durable client "d" (sharing `state` across its sessions)
/// received k0..k5 at offsets 1..6 and processed them all, then a power cut that keeps only
/// k0..k2 (the OS wrote them back; the rest was in its cache). Returns the restarted node.
async fn a_cut_takes_entries_the_client_saw(dir: &Path, state: &DedupState) -> Node {
    let m = Machine::start(dir, SyncMode::None).await;
    let d = subscriber(&m.node, state, AckMode::Auto).await;
    d.ready_for_events().await.unwrap();
    let mut events = d.events().unwrap();
    publish(&m.node, 0..3).await;
    take_events(&mut events, 3).await;
    m.store.writeback();
    publish(&m.node, 3..6).await;
    let got = take_events(&mut events, 3).await;
    assert_eq!(entries(&got).last().map(|e| e.offset), Some(6));
    events.commit();
    drop(events);
    d.crash();
    m.cut_and_restart().await
}

/// The queue comes back ending at offset 3; the client saw offset 6. New events then take
/// offsets 4.. again: the client must show them, not drop them as processed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_queue_ending_below_what_its_client_saw_says_so() {
    let dir = tempfile::tempdir().unwrap();
    let state = DedupState::default();
    let node = a_cut_takes_entries_the_client_saw(dir.path(), &state).await;
    let d = resume(&node, &state, 3).await;
    assert!(
        d.diverged(),
        "the welcome says the queue lost what the client saw"
    );
    assert_eq!(node.client_seen_counts(), (0, 1));
    d.ready_for_events().await.unwrap();
    let mut events = d.events().unwrap();
    let replay = take_events(&mut events, 3).await;
    let t = true;
    assert_eq!(
        seen(&replay),
        [
            ("k0".into(), 1, t, t),
            ("k1".into(), 2, t, t),
            ("k2".into(), 3, t, t)
        ],
        "shown again (offsets no longer filter), every one flagged"
    );
    publish_named(&node, "new", 0..3).await;
    let live = take_events(&mut events, 3).await;
    let f = false;
    assert_eq!(
        seen(&live),
        [
            ("new0".into(), 4, f, f),
            ("new1".into(), 5, f, f),
            ("new2".into(), 6, f, f)
        ],
        "new events at offsets the client saw before are shown"
    );
    finish(events, d, node).await;
}

/// New events fill the queue up to the offset the client saw before it resumes: the offset is
/// there, the event is another. The event id the client sends tells them apart. (This failed
/// while a restart reused session ids whose write the cut lost: the new events then had the
/// very ids of the lost ones.) The application's own checkpoint (offset 6, all it processed)
/// names other events now: it is not applied.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_queue_holding_another_event_at_the_offset_its_client_saw_says_so() {
    let dir = tempfile::tempdir().unwrap();
    let state = DedupState::default();
    let node = a_cut_takes_entries_the_client_saw(dir.path(), &state).await;
    publish_named(&node, "new", 0..3).await;
    let d = resume_from(builder(&node).checkpoint(6), &state, 6).await;
    assert!(d.diverged());
    assert_eq!(node.client_seen_counts(), (0, 1));
    d.ready_for_events().await.unwrap();
    let mut events = d.events().unwrap();
    let replay = take_events(&mut events, 6).await;
    let keys: Vec<_> = seen(&replay).into_iter().map(|(k, ..)| k).collect();
    assert_eq!(keys, ["k0", "k1", "k2", "new0", "new1", "new2"]);
    assert!(
        entries(&replay)
            .iter()
            .all(|e| e.replayed && e.possible_duplicate),
        "{replay:?}"
    );
    finish(events, d, node).await;
}

/// The entries survive a cut, their delivered mark does not (`--sync none`): the client's word
/// flags what it saw.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_delivered_mark_is_made_up_for_by_what_the_client_saw() {
    let dir = tempfile::tempdir().unwrap();
    let m = Machine::start(dir.path(), SyncMode::None).await;
    let state = DedupState::default();
    let d = subscriber(&m.node, &state, AckMode::Auto).await;
    publish(&m.node, 0..3).await;
    // Queued, and on the disk; then sent (the mark stays in the OS cache).
    m.store.writeback();
    d.ready_for_events().await.unwrap();
    let mut events = d.events().unwrap();
    // k0 and k1 processed (the next one was asked for), k2 shown and not processed.
    take_events(&mut events, 3).await;
    drop(events);
    d.crash();
    let node = m.cut_and_restart().await;
    let d = resume(&node, &state, 3).await;
    assert!(!d.diverged());
    assert_eq!(node.client_seen_counts(), (1, 0));
    d.ready_for_events().await.unwrap();
    let mut events = d.events().unwrap();
    let replay = take_events(&mut events, 1).await;
    assert_eq!(
        seen(&replay),
        [("k2".into(), 3, true, true)],
        "k0 and k1 were processed (not shown again); k2 was seen: flagged"
    );
    finish(events, d, node).await;
}
