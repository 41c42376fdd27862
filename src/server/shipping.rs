//! The primary side of queue replication: one task per queue with secondaries drives its
//! sans-IO [`Shipper`], reads the entries the shipper names from storage and sends them to each
//! secondary through one ordered sender per peer.
//!
//! The shipper's `replicated_end` caps delivery (the core's [`deliver_cap`]), so a client only
//! ever receives entries that every secondary holds durably. Delivery also needs the primary
//! **lease**: every secondary acknowledged a message sent less than [`LEASE_MS`] ago. A secondary
//! that is promoted stops acknowledging the old epoch at once, and the new primary waits
//! [`LEASE_MS`] before it delivers, so a deposed primary cut off from its peers stops delivering
//! before the new one starts: at most one primary delivers.
//!
//! - Each ordered sender holds what the shipper polled as headers and reads the entries they
//!   name from storage just before the call; a message polled before its pipeline restarted is
//!   dropped unsent (`Shipper::pipeline`), as the shipper sends again what is still needed.
//! - A primary that holds no lease and reaches no majority sends the queue's client away, to a
//!   copy on the majority's side (`control::reconcile::step_aside`; a hello is refused the same
//!   way in `placement.rs`).
//! - A secondary answering below what it acknowledged in the epoch is no longer counted
//!   (`Shipper::regressed_peers`) and the primary takes it out of the replica set, so it rejoins
//!   as syncing.
//! - Shipping follows placements in epoch order: a placement read before an await (a
//!   connection's) never undoes a newer one (`Shipping::set_secondaries`, and `ensure_shipping`
//!   in `failover.rs`), so a secondary the metadata counts in sync is never dropped and re-added
//!   from nothing by the primary alone, and delivery never runs uncapped on a stale empty
//!   replica set.
//! - A change of durable interest is acknowledged to the client only once every copy committed
//!   it (the shipper's `on_metadata_change` forces a message; acks carry the info version).
//!   Every change of a queue's info bumps the core's `info_generation` (in `persist_info`),
//!   which the ship loop turns into a new info version: a copy gets the info until it
//!   acknowledged the latest version, never an older info under a newer version.
//! - A newer primary known here before the metadata (it shipped to this node at a higher epoch,
//!   a copy fenced this node with one, or this node handed the queue to it) is noted as the
//!   queue's rival (`Shipping::rival`): this node's queue is deposed and its clients sent there
//!   (`control::reconcile::superseded_by_rival`, `placed_here_step`).
//! - The ship loop notes each queue's watermark points (`control::watermark`) and sends them
//!   with the messages.
//!
//! [`deliver_cap`]: crate::core::Queue::deliver_cap

use crate::bug::LockExt;
use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock, Weak};
use std::time::{Duration, Instant};

use tether_storage::{QueueId, Store};
use tether_transport::ErrorCode;
use tether_transport::codec::encode_body;
use tokio::sync::{Notify, mpsc};

use super::Shared;
use crate::cluster::Cluster;
use crate::cluster::meta::{NodeId, Placement};
use crate::cluster::network::{
    PeerRequest, PeerResponse, ReplicateHeader, ReplicateMsg, ShippedEntry,
};
use crate::control::lease::Lease;
use crate::control::reconcile;
use crate::control::watermark::Coverage;
use crate::metrics as m;
use crate::replication::{Epoch, Reply, Shipper, ToSecondary, Transmit};

pub use crate::control::lease::LEASE_MS;
/// Why a primary cut off from most of the cluster sends its client away, or refuses it (see
/// [`reconcile::step_aside`]).
pub(crate) const CUT_OFF_REASON: &str =
    "this node is cut off from most of the cluster: the queue fails over to a copy; reconnect";

/// Longest sleep of a shipping task between looks at its queue, in milliseconds.
pub const SHIP_IDLE_MS: u64 = 100;
/// Timeout of one replication RPC, in milliseconds.
pub const REPLICATE_TIMEOUT_MS: u64 = 5_000;
/// Pause after a failed replication RPC before the next one to that peer, in milliseconds.
pub const REPLICATE_RETRY_MS: u64 = 200;
/// Most entry bytes read for one append batch (the batch is cut short beyond it).
pub const REPLICATE_BATCH_BYTES_MAX: usize = 4 << 20;
// A batch and the queue's info (its interest at most INTEREST_BYTES_PER_QUEUE_MAX, with room
// for encoding) fit one peer message.
const _: () = assert!(
    REPLICATE_BATCH_BYTES_MAX + 2 * crate::limits::INTEREST_BYTES_PER_QUEUE_MAX
        <= crate::cluster::network::PEER_MESSAGE_BYTES_MAX
);
/// Most entry bytes in one message of a snapshot (a larger snapshot is sent in several).
pub const REPLICATE_SNAPSHOT_CHUNK_BYTES_MAX: usize = 4 << 20;
/// Most entry bytes of a whole snapshot (it is read at once on the primary and staged in memory
/// on the secondary until its last message); a larger queue cannot seed a new secondary.
pub const REPLICATE_SNAPSHOT_BYTES_MAX: usize = 512 << 20;

const _: () = assert!(SHIP_IDLE_MS < LEASE_MS);

/// Milliseconds on a monotonic clock, for the shippers.
fn mono_ms() -> u64 {
    static START: OnceLock<Instant> = OnceLock::new();
    START.get_or_init(Instant::now).elapsed().as_millis() as u64
}

/// One queue's shipping state.
pub(crate) struct ShipQueue {
    /// What the queue's log holds of the publishes this node applied (see `control/watermark.rs`).
    coverage: Mutex<Coverage>,
    pub(crate) durable_id: String,
    pub(crate) qid: QueueId,
    shipper: Mutex<Shipper>,
    secondaries: Mutex<Vec<NodeId>>,
    /// The epoch of the placement these secondaries come from (sent with every message).
    placement_epoch: std::sync::atomic::AtomicU64,
    /// The primary's lease (`control::lease`), in milliseconds since `origin`.
    lease: Mutex<Lease>,
    /// The node's start: the zero of the lease's times.
    origin: Instant,
    senders: Mutex<HashMap<NodeId, mpsc::UnboundedSender<Outgoing>>>,
    wake: Notify,
    stopped: std::sync::atomic::AtomicBool,
    /// The shipper's `replicated_end`, for publishers waiting on `--ack replicated`.
    replicated: tokio::sync::watch::Sender<u64>,
    /// Bumped after every change of the queue's info (by the ship loop when the core's
    /// `info_generation` moves) and whenever a waiter needs the copies to confirm the queue's
    /// current state ([`Shipping::info_changed`]). A copy gets the info with every message until
    /// it acknowledges one carrying the current version; then messages go without it.
    info_version: std::sync::atomic::AtomicU64,
    /// Per secondary: the highest `info_version` carried by a message it acknowledged.
    info_acked: tokio::sync::watch::Sender<HashMap<NodeId, u64>>,
}

/// A message for one peer, queued until its peer sender gets to it. Entries are read from
/// storage only then: what waits in the queue is a header, so a slow peer costs no memory per
/// batch waiting for it.
struct Outgoing {
    /// When the shipper polled it.
    sent_at: Instant,
    /// The shipper's pipeline generation for the peer then: a restart since supersedes it.
    pipeline: u64,
    /// The info version it carries, and the info itself.
    info_version: u64,
    info: Arc<[u8]>,
    message: ToSecondary,
}

impl ShipQueue {
    fn shipper(&self) -> std::sync::MutexGuard<'_, Shipper> {
        self.shipper.lock_or_stop()
    }

    fn coverage(&self) -> std::sync::MutexGuard<'_, Coverage> {
        self.coverage.lock_or_stop()
    }

    fn stop(&self) {
        self.stopped
            .store(true, std::sync::atomic::Ordering::Release);
        self.wake.notify_one();
        // Waiting publishers and registrations stop waiting: the queue moved or ended.
        self.replicated.send_replace(u64::MAX);
        self.info_acked.send_modify(|_| {});
    }

    /// Whether every current secondary acknowledged a message carrying info `version`.
    fn info_held(&self, acked: &HashMap<NodeId, u64>, version: u64) -> bool {
        self.secondaries
            .lock_or_stop()
            .iter()
            .all(|s| acked.get(s).is_some_and(|&v| v >= version))
    }

    fn is_stopped(&self) -> bool {
        self.stopped.load(std::sync::atomic::Ordering::Acquire)
    }

    /// Whether the primary holds its lease at `now` ([`Lease::held`]).
    pub(crate) fn lease_held(&self, now: Instant) -> bool {
        let lease = self.lease.lock_or_stop();
        let secondaries = self.secondaries.lock_or_stop();
        lease.held(self.ms(now), secondaries.iter().copied())
    }

    /// `t` in the lease's milliseconds.
    fn ms(&self, t: Instant) -> u64 {
        t.saturating_duration_since(self.origin).as_millis() as u64
    }

    /// Whether `peer` holds everything any primary of this queue may have exposed.
    pub(crate) fn in_sync(&self, peer: NodeId) -> bool {
        self.shipper().peer_in_sync(peer)
    }

    /// Secondaries that lost entries they had acknowledged (see [`Shipper::regressed_peers`]).
    pub(crate) fn regressed(&self) -> Vec<NodeId> {
        self.shipper().regressed_peers().collect()
    }

    /// Replication lag of each secondary, in entries.
    pub(crate) fn lags(&self) -> Vec<(NodeId, u64)> {
        let s = self.shipper();
        s.secondaries()
            .map(|p| (p, s.peer_lag(p).unwrap_or(0)))
            .collect()
    }
}

/// The queues this node ships, by durable id and by queue id.
#[derive(Default)]
pub(crate) struct Shipping {
    by_id: Mutex<HashMap<String, Arc<ShipQueue>>>,
    by_qid: Mutex<HashMap<QueueId, Arc<ShipQueue>>>,
    /// Newer primaries seen for queues of this node's core, by durable id (see
    /// [`reconcile::superseded_by_rival`](crate::control::reconcile::superseded_by_rival)).
    rivals: Mutex<HashMap<String, Rival>>,
}

/// Another node seen being primary of a queue this node holds: it shipped to this node as its
/// copy (`node` known), or a copy answered this node's shipping with its epoch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Rival {
    pub(crate) node: Option<NodeId>,
    pub(crate) epoch: u64,
}

impl Shipping {
    fn ids(&self) -> std::sync::MutexGuard<'_, HashMap<String, Arc<ShipQueue>>> {
        self.by_id.lock_or_stop()
    }

    fn qids(&self) -> std::sync::MutexGuard<'_, HashMap<QueueId, Arc<ShipQueue>>> {
        self.by_qid.lock_or_stop()
    }

    pub(crate) fn get(&self, id: &str) -> Option<Arc<ShipQueue>> {
        self.ids().get(id).cloned()
    }

    /// The queues this node ships to copies.
    pub(crate) fn shipped(&self) -> Vec<QueueId> {
        self.qids().keys().copied().collect()
    }

    /// Wakes the shipping task of a queue that grew.
    pub(crate) fn wake(&self, qid: QueueId) {
        if let Some(sq) = self.qids().get(&qid) {
            sq.wake.notify_one();
        }
    }

    /// Another node shipped to us as primary of `epoch`, for a queue we ship: the reply for it
    /// (`Some(None)`: nothing to answer; we may be fenced now). `None`: we do not ship it.
    pub(crate) fn on_rival(&self, id: &str, epoch: Epoch) -> Option<Option<Reply>> {
        let sq = self.get(id)?;
        let reply = sq.shipper().on_rival_primary(epoch);
        sq.wake.notify_one();
        Some(reply)
    }

    /// Waits until queue `qid` holds stored offset `off` on every copy (at once if it is not
    /// shipped). False if `deadline` passes first.
    pub(crate) async fn wait_replicated(
        &self,
        qid: QueueId,
        off: u64,
        deadline: tokio::time::Instant,
    ) -> bool {
        let Some(sq) = self.qids().get(&qid).cloned() else {
            return true;
        };
        sq.wake.notify_one();
        let mut rx = sq.replicated.subscribe();
        drop(sq);
        // Stored offset `off` is replication offset `off - 1`: held once the end passes it.
        tokio::time::timeout_at(deadline, rx.wait_for(|&end| end >= off))
            .await
            .is_ok_and(|r| r.is_ok())
    }

    /// Queue `qid`'s interest changed (already applied to the core): once every copy holds the
    /// change, `wait_info` returns. None if the queue is not shipped (nothing to wait for).
    pub(crate) fn info_changed(&self, qid: QueueId) -> Option<(Arc<ShipQueue>, u64)> {
        let sq = self.qids().get(&qid).cloned()?;
        let version = sq
            .info_version
            .fetch_add(1, std::sync::atomic::Ordering::AcqRel)
            + 1;
        sq.wake.notify_one();
        Some((sq, version))
    }

    /// Waits until every copy of `sq` holds queue info `version` (or the queue stops being
    /// shipped here). False if `deadline` passes first.
    pub(crate) async fn wait_info(
        sq: Arc<ShipQueue>,
        version: u64,
        deadline: tokio::time::Instant,
    ) -> bool {
        let mut rx = sq.info_acked.subscribe();
        tokio::time::timeout_at(
            deadline,
            rx.wait_for(|acked| sq.is_stopped() || sq.info_held(acked, version)),
        )
        .await
        .is_ok_and(|r| r.is_ok())
    }

    /// Notes that `node` (if known) is primary of queue `id` at `epoch`; the highest epoch wins.
    pub(crate) fn note_rival(&self, id: &str, node: Option<NodeId>, epoch: u64) {
        let mut rivals = self.rivals.lock_or_stop();
        let r = rivals
            .entry(id.to_string())
            .or_insert(Rival { node, epoch });
        if epoch > r.epoch || (epoch == r.epoch && r.node.is_none()) {
            *r = Rival { node, epoch };
        }
    }

    /// The newer primary seen for queue `id`, if any.
    pub(crate) fn rival(&self, id: &str) -> Option<Rival> {
        self.rivals.lock_or_stop().get(id).copied()
    }

    /// Forgets the rivals `keep` says no longer matter (the metadata here decides again).
    pub(crate) fn retain_rivals(&self, mut keep: impl FnMut(&str, &Rival) -> bool) {
        self.rivals.lock_or_stop().retain(|id, r| keep(id, r));
    }

    /// Stops shipping a queue (deposed, dropped or expired here).
    pub(crate) fn stop(&self, id: &str) {
        if let Some(sq) = self.ids().remove(id) {
            self.qids().remove(&sq.qid);
            sq.stop();
        }
    }

    /// Every shipped queue.
    pub(crate) fn all(&self) -> Vec<Arc<ShipQueue>> {
        self.ids().values().cloned().collect()
    }

    /// Updates the secondaries of a shipped queue from its placement at `placement_epoch`; false
    /// if it is not shipped here.
    pub(crate) fn set_secondaries(
        &self,
        id: &str,
        secondaries: &[NodeId],
        placement_epoch: u64,
    ) -> bool {
        let Some(sq) = self.get(id) else {
            return false;
        };
        let mut current = sq.secondaries.lock_or_stop();
        // Placements read before an await may arrive after a newer one: never go back. (A
        // secondary dropped and re-added by a stale set would start again from nothing while the
        // metadata still counts it in sync, and the set without it would deliver everything.)
        let known = sq
            .placement_epoch
            .load(std::sync::atomic::Ordering::Acquire);
        if placement_epoch < known {
            return true;
        }
        sq.placement_epoch
            .store(placement_epoch, std::sync::atomic::Ordering::Release);
        if *current != secondaries {
            *current = secondaries.to_vec();
            drop(current);
            sq.shipper().set_secondaries(secondaries, mono_ms());
            sq.wake.notify_one();
            // Registrations wait for the copies of the current set only, and a secondary added
            // again later gets the info again (it may have dropped its copy meanwhile).
            sq.info_acked
                .send_modify(|m| m.retain(|p, _| secondaries.contains(p)));
        }
        true
    }

    /// Starts shipping queue `qid` (durable id `id`) with `shipper`, to the secondaries of
    /// `placement`.
    pub(crate) fn start(
        &self,
        shared: &Arc<Shared>,
        (id, qid): (&str, QueueId),
        shipper: Shipper,
        placement: &Placement,
        lease: Lease,
    ) {
        let Some(cluster) = shared.member.cluster.get().cloned() else {
            return; // Only clustered nodes ship.
        };
        let sq = Arc::new(ShipQueue::new(
            id,
            qid,
            shipper,
            (&placement.secondaries, placement.epoch),
            lease,
            shared.clock.started(),
        ));
        if self.insert(sq.clone()) {
            tokio::spawn(ship_loop(Arc::downgrade(shared), cluster, sq));
        }
    }

    /// Makes `sq` the shipping state of its queue, replacing (and stopping) the one there,
    /// unless that one was started from a newer placement meanwhile. Returns whether `sq` is in.
    fn insert(&self, sq: Arc<ShipQueue>) -> bool {
        let epoch = |q: &ShipQueue| q.placement_epoch.load(std::sync::atomic::Ordering::Acquire);
        {
            let mut ids = self.ids();
            if ids
                .get(&sq.durable_id)
                .is_some_and(|old| epoch(old) > epoch(&sq))
            {
                return false;
            }
            if let Some(old) = ids.insert(sq.durable_id.clone(), sq.clone()) {
                self.qids().remove(&old.qid);
                old.stop();
            }
        }
        self.qids().insert(sq.qid, sq);
        true
    }
}

impl ShipQueue {
    fn new(
        id: &str,
        qid: QueueId,
        mut shipper: Shipper,
        (secondaries, placement_epoch): (&[NodeId], u64),
        lease: Lease,
        origin: Instant,
    ) -> Self {
        shipper.set_secondaries(secondaries, mono_ms());
        ShipQueue {
            coverage: Mutex::default(),
            durable_id: id.to_string(),
            qid,
            shipper: Mutex::new(shipper),
            secondaries: Mutex::new(secondaries.to_vec()),
            placement_epoch: placement_epoch.into(),
            lease: Mutex::new(lease),
            origin,
            senders: Mutex::new(HashMap::new()),
            wake: Notify::new(),
            stopped: Default::default(),
            replicated: tokio::sync::watch::channel(0).0,
            info_version: Default::default(),
            info_acked: tokio::sync::watch::channel(HashMap::new()).0,
        }
    }
}

/// Drives one queue's shipper until the queue stops being shipped here.
async fn ship_loop(weak: Weak<Shared>, cluster: Arc<Cluster>, sq: Arc<ShipQueue>) {
    let mut info_noted = 0;
    // The core's info generation last turned into an info version, and the info encoded.
    let mut generation_noted = None;
    let mut info_cache: Option<(u64, Arc<[u8]>)> = None;
    let unchanged: Arc<[u8]> = Arc::from(Vec::new());
    loop {
        if sq.is_stopped() {
            return;
        }
        let Some(shared) = weak.upgrade() else {
            return;
        };
        // Read before the queue's end: its log up to there holds what this counts as applied.
        let applied = shared.applied_through();
        let seen = shared
            .core()
            .queue(sq.qid)
            .map(|q| (q.visible_end, q.acked_stored, q.info_generation));
        let Some((visible_end, acked, info_generation)) = seen else {
            shared.member.shipping.stop(&sq.durable_id);
            return;
        };
        sq.coverage().note(applied, visible_end);
        let now = mono_ms();
        if generation_noted != Some(info_generation) {
            // The info changed (interest, timeout, away time...): every copy must get it.
            sq.info_version
                .fetch_add(1, std::sync::atomic::Ordering::AcqRel);
            generation_noted = Some(info_generation);
        }
        // Read before the info (below): the info sent is at least this version.
        let info_version = sq.info_version.load(std::sync::atomic::Ordering::Acquire);
        let (transmits, replicated_end, fenced, timeout) = {
            let mut s = sq.shipper();
            if info_version > info_noted {
                s.on_metadata_change();
                info_noted = info_version;
            }
            if visible_end > s.log().end() {
                s.on_local_append(visible_end);
            }
            s.on_client_ack(acked);
            let trim_to = s.acked().min(acked);
            if trim_to > s.log().start() {
                s.on_local_trim(trim_to);
            }
            s.on_tick(now);
            let mut out = Vec::new();
            while let Some(t) = s.poll_transmit(now) {
                let pipeline = s.pipeline(t.to).unwrap_or(0);
                out.push((t, pipeline));
            }
            (out, s.replicated_end(), s.fenced(), s.poll_timeout())
        };
        if let Some(epoch) = fenced {
            tracing::warn!(durable_id = %sq.durable_id, epoch, "deposed: a newer primary exists");
            // The reconciler gives the queue up even before the metadata here says so.
            shared
                .member
                .shipping
                .note_rival(&sq.durable_id, None, epoch);
            let session = {
                let mut core = shared.core();
                core.set_deliver_cap(sq.qid, Some(0));
                core.attached_session(sq.qid)
            };
            if let Some(s) = session {
                shared.disconnect_session(
                    s,
                    ErrorCode::Unavailable,
                    "this queue moved to another node; reconnect",
                );
            }
            shared.member.shipping.stop(&sq.durable_id);
            return;
        }
        sq.coverage().prune(replicated_end);
        sq.replicated.send_if_modified(|r| {
            let moved = replicated_end > *r;
            *r = (*r).max(replicated_end);
            moved
        });
        let lease_held = sq.lease_held(Instant::now());
        let cap = if lease_held { replicated_end } else { 0 };
        let (wake, attached) = {
            let mut core = shared.core();
            let wake = core.set_deliver_cap(sq.qid, Some(cap));
            let attached = match lease_held {
                true => None,
                false => core.attached_session(sq.qid),
            };
            (wake, attached)
        };
        if let Some(s) = wake {
            shared.wake(s);
        }
        if let Some(s) = attached
            && reconcile::step_aside(
                true,
                false,
                shared.member.liveness.majority_reachable(&cluster),
            )
        {
            metrics::counter!(m::REPLICATION_STEPPED_ASIDE).increment(1);
            tracing::warn!(
                durable_id = %sq.durable_id,
                "cut off from most of the cluster without a lease: the client is sent to a copy"
            );
            shared.disconnect_session(s, ErrorCode::Unavailable, CUT_OFF_REASON);
        }
        // The queue info (durable interest, timeout, away time: up to
        // INTEREST_BYTES_PER_QUEUE_MAX) goes to a copy until it acknowledged this version.
        if !transmits.is_empty() {
            let held = sq.info_acked.borrow().clone();
            let behind = |peer: NodeId| held.get(&peer).is_none_or(|&v| v < info_version);
            let info = match transmits.iter().any(|(t, _)| behind(t.to)) {
                true => encoded_info(&shared, sq.qid, &mut info_cache),
                false => Some(unchanged.clone()),
            };
            if let Some(info) = info {
                for (t, pipeline) in transmits {
                    let info = if behind(t.to) { &info } else { &unchanged };
                    queue_for_peer(&weak, &cluster, &sq, t, pipeline, info, info_version);
                }
            }
        }
        drop(shared);
        let sleep_ms = timeout
            .map(|t| t.saturating_sub(now))
            .unwrap_or(SHIP_IDLE_MS)
            .clamp(1, SHIP_IDLE_MS);
        tokio::select! {
            _ = sq.wake.notified() => {}
            _ = tokio::time::sleep(Duration::from_millis(sleep_ms)) => {}
        }
    }
}

/// The queue's info as its copies get it, encoded once per change of the queue (`cache`
/// holds the core's info generation it was read at). None if the queue is gone.
fn encoded_info(
    shared: &Shared,
    qid: QueueId,
    cache: &mut Option<(u64, Arc<[u8]>)>,
) -> Option<Arc<[u8]>> {
    let (generation, info) = {
        let core = shared.core();
        let q = core.queue(qid)?;
        if let Some((g, bytes)) = cache.as_ref()
            && *g == q.info_generation
        {
            return Some(bytes.clone());
        }
        (q.info_generation, q.info_for_copies())
    };
    let bytes: Arc<[u8]> = encode_body(&info)
        .expect("queue info always encodes")
        .into();
    *cache = Some((generation, bytes.clone()));
    Some(bytes)
}

/// Queues a transmit on the peer's ordered sender (started on the first one).
fn queue_for_peer(
    weak: &Weak<Shared>,
    cluster: &Arc<Cluster>,
    sq: &Arc<ShipQueue>,
    t: Transmit<ToSecondary>,
    pipeline: u64,
    info: &Arc<[u8]>,
    info_version: u64,
) {
    let mut senders = sq.senders.lock_or_stop();
    let tx = senders.entry(t.to).or_insert_with(|| {
        let (tx, rx) = mpsc::unbounded_channel();
        tokio::spawn(peer_sender(
            weak.clone(),
            cluster.clone(),
            Arc::downgrade(sq),
            t.to,
            rx,
        ));
        tx
    });
    let _ = tx.send(Outgoing {
        sent_at: Instant::now(),
        pipeline,
        info_version,
        info: info.clone(),
        message: t.message,
    });
}

/// Reads what a transmit names and builds its messages (a snapshot over several), or `None`
/// when its entries cannot be read (the peer's pipeline is restarted then).
fn build_messages(
    shared: &Shared,
    cluster: &Cluster,
    sq: &ShipQueue,
    peer: NodeId,
    message: ToSecondary,
    info: &[u8],
) -> Option<Vec<ReplicateMsg>> {
    let (header, entries, chunks) = match message {
        ToSecondary::Append(mut h) => {
            let n = h.last - h.first;
            let (entries, _) = match read(
                &*shared.store,
                sq.qid,
                h.first,
                n,
                REPLICATE_BATCH_BYTES_MAX,
            ) {
                Ok(r) => r,
                Err(e) => {
                    tracing::warn!(durable_id = %sq.durable_id, error = %e, "reading entries to ship");
                    sq.shipper().on_peer_lost(peer);
                    return None;
                }
            };
            if (entries.len() as u64) < n {
                // Cut short by size, or trimmed meanwhile (then the shipper moves on).
                if entries.is_empty() {
                    sq.shipper().on_peer_lost(peer);
                    return None;
                }
                h.last = h.first + entries.len() as u64;
            }
            (ReplicateHeader::Append(h), entries, Vec::new())
        }
        ToSecondary::Snapshot(h) => {
            let (entries, _) = match read(
                &*shared.store,
                sq.qid,
                h.log.start(),
                h.log.len(),
                REPLICATE_SNAPSHOT_BYTES_MAX,
            ) {
                Ok(r) => r,
                Err(e) => {
                    tracing::warn!(durable_id = %sq.durable_id, error = %e, "reading a snapshot");
                    sq.shipper().on_peer_lost(peer);
                    return None;
                }
            };
            if entries.len() as u64 != h.log.len() {
                // Over the size limit, or entries of the log not (or no longer) in storage.
                tracing::warn!(
                    durable_id = %sq.durable_id,
                    start = h.log.start(),
                    entries = h.log.len(),
                    read = entries.len(),
                    "cannot read the queue for a snapshot; the new secondary waits"
                );
                sq.shipper().on_peer_lost(peer);
                return None;
            }
            metrics::counter!(m::REPLICATION_SNAPSHOTS_SENT).increment(1);
            // Messages of at most REPLICATE_SNAPSHOT_CHUNK_BYTES_MAX entry bytes, in order.
            let mut chunks: Vec<Vec<ShippedEntry>> = vec![Vec::new()];
            let mut bytes = 0usize;
            for e in entries {
                if bytes + e.body.len() > REPLICATE_SNAPSHOT_CHUNK_BYTES_MAX
                    && !chunks.last().expect("one chunk").is_empty()
                {
                    chunks.push(Vec::new());
                    bytes = 0;
                }
                bytes += e.body.len();
                chunks.last_mut().expect("one chunk").push(e);
            }
            let last = chunks.pop().expect("one chunk");
            (ReplicateHeader::Snapshot(h), last, chunks)
        }
    };
    let log_end = match &header {
        ReplicateHeader::Append(h) => h.last,
        ReplicateHeader::Snapshot(h) => h.log.end(),
    };
    let (through_end, through) = sq.coverage().for_end(log_end).cloned().unwrap_or_default();
    let placement_epoch = sq
        .placement_epoch
        .load(std::sync::atomic::Ordering::Acquire);
    let message = |entries: Vec<ShippedEntry>, more: bool| ReplicateMsg {
        from: cluster.id(),
        durable_id: sq.durable_id.clone(),
        header: header.clone(),
        sent_ms: shared.clock.now_ms(),
        info: info.to_vec(),
        entries,
        more,
        through: through.clone(),
        through_end,
        placement_epoch,
    };
    let mut msgs: Vec<ReplicateMsg> = chunks.into_iter().map(|c| message(c, true)).collect();
    msgs.push(message(entries, false));
    Some(msgs)
}

/// Reads `count` entries from replication offset `first` (stored at `first + 1`), stopping at
/// the first one missing (fewer, or none when `first` itself was trimmed meanwhile).
fn read(
    store: &dyn Store,
    qid: QueueId,
    first: u64,
    count: u64,
    max_bytes: usize,
) -> Result<(Vec<ShippedEntry>, usize), tether_storage::StorageError> {
    let mut out = Vec::with_capacity(count.min(4096) as usize);
    let mut bytes = 0usize;
    if count == 0 {
        return Ok((out, 0));
    }
    store.read_entries(
        qid,
        first + 1,
        first + count,
        max_bytes,
        &mut |offset, flags, body| {
            // Only the contiguous run from `first`: entries trimmed (acked by the client)
            // since the shipper named them must not shift the rest onto their offsets.
            if offset != first + 1 + out.len() as u64 {
                return;
            }
            bytes += body.len();
            out.push(ShippedEntry {
                flags,
                body: body.to_vec(),
            });
        },
    )?;
    Ok((out, bytes))
}

/// Sends one peer's messages of one queue in order, feeding the replies to the shipper.
async fn peer_sender(
    shared: Weak<Shared>,
    cluster: Arc<Cluster>,
    sq: Weak<ShipQueue>,
    peer: NodeId,
    mut rx: mpsc::UnboundedReceiver<Outgoing>,
) {
    let timeout = Duration::from_millis(REPLICATE_TIMEOUT_MS);
    'queued: while let Some(out) = rx.recv().await {
        let msgs = {
            let (Some(shared), Some(sq)) = (shared.upgrade(), sq.upgrade()) else {
                return;
            };
            if sq.is_stopped() {
                return;
            }
            // Polled before a restart of the pipeline (a timeout while it waited here, a lost
            // connection): the shipper sends again what is still needed; skip it unread.
            if sq.shipper().pipeline(peer) != Some(out.pipeline) {
                metrics::counter!(m::REPLICATION_SUPERSEDED).increment(1);
                continue;
            }
            match build_messages(&shared, &cluster, &sq, peer, out.message, &out.info) {
                Some(msgs) => msgs,
                None => continue,
            }
        };
        let (sent_at, info_version) = (out.sent_at, out.info_version);
        for msg in msgs {
            let result = cluster
                .call(peer, PeerRequest::Replicate(msg), timeout)
                .await;
            let Some(sq) = sq.upgrade() else {
                return;
            };
            if sq.is_stopped() {
                return;
            }
            if !on_result(&sq, peer, sent_at, info_version, result) {
                // What is queued was built for the lost pipeline: drop it, the shipper resends.
                while rx.try_recv().is_ok() {}
                tokio::time::sleep(Duration::from_millis(REPLICATE_RETRY_MS)).await;
                sq.wake.notify_one();
                continue 'queued;
            }
            sq.wake.notify_one();
        }
    }
}

/// Feeds one replication reply to the shipper; false when the peer's pipeline was lost (the
/// call failed or was refused).
fn on_result(
    sq: &ShipQueue,
    peer: NodeId,
    sent_at: Instant,
    info_version: u64,
    result: Result<PeerResponse, crate::cluster::network::PeerError>,
) -> bool {
    match result {
        Ok(PeerResponse::Replicated(Some(reply))) => {
            tracing::trace!(peer = peer.0, durable_id = %sq.durable_id, ?reply, "replication reply");
            let mut s = sq.shipper();
            let epoch = s.epoch();
            s.on_reply(peer, reply, mono_ms());
            drop(s);
            if matches!(reply, Reply::Ack { epoch: e, .. } if e == epoch) {
                sq.lease.lock_or_stop().acked(peer, sq.ms(sent_at));
                // The copy stored the info this message carried before acknowledging it.
                sq.info_acked.send_if_modified(|m| {
                    let v = m.entry(peer).or_insert(0);
                    let moved = info_version > *v;
                    *v = (*v).max(info_version);
                    moved
                });
            }
        }
        Ok(PeerResponse::Replicated(None)) => {
            tracing::debug!(peer = peer.0, durable_id = %sq.durable_id, "replication message ignored");
        }
        Ok(PeerResponse::QueueInfoNeeded) => {
            // A copy started anew (or lost) since it acknowledged the info: send it again.
            tracing::debug!(peer = peer.0, durable_id = %sq.durable_id, "the copy asks for the queue info");
            sq.info_acked.send_modify(|m| {
                m.remove(&peer);
            });
            sq.shipper().on_peer_lost(peer);
            return false;
        }
        other => {
            match &other {
                Err(e) => tracing::debug!(peer = peer.0, error = %e, "replication rpc failed"),
                Ok(PeerResponse::BadRequest(e)) => {
                    tracing::warn!(peer = peer.0, error = %e, "replication message refused")
                }
                Ok(_) => {
                    tracing::warn!(peer = peer.0, "unexpected answer to a replication message")
                }
            }
            sq.shipper().on_peer_lost(peer);
            return false;
        }
    }
    true
}

/// Another node holds `id` at a higher epoch (`by`: that node, if known, and the epoch): drop
/// this node's queue and send its client on.
pub(crate) async fn depose(shared: &Arc<Shared>, id: &str, by: (Option<NodeId>, u64)) {
    shared.member.shipping.stop(id);
    let result = shared
        .apply(|core| {
            let (batch, session) = core.depose(id);
            Ok((session, batch))
        })
        .await;
    tracing::warn!(durable_id = %id, new_primary = ?by.0, epoch = by.1, "queue deposed here");
    if let Ok(Some(session)) = result {
        shared.disconnect_session(
            session,
            ErrorCode::Unavailable,
            "this queue moved to another node; reconnect",
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tether_storage::{Batch, Entry, MemStore};

    #[test]
    fn a_placement_older_than_the_one_in_force_changes_nothing() {
        use crate::replication::{EpochStart, LogState, ShipperConfig};
        let shipping = Shipping::default();
        let log = LogState::new(0, 5, vec![EpochStart { epoch: 3, first: 0 }]).unwrap();
        let shipper = || Shipper::new(3, log.clone(), 0, ShipperConfig::default());
        let secondaries = |sq: &ShipQueue| sq.shipper().secondaries().collect::<Vec<_>>();
        let sq = Arc::new(ShipQueue::new(
            "q",
            7,
            shipper(),
            (&[NodeId(2)], 40),
            Lease::at_start(0, 0),
            Instant::now(),
        ));
        assert!(shipping.insert(sq.clone()));
        // The repair at 50 replaced node 2 by node 3; a connection then applies the placement
        // it read at 40, before an await: ignored.
        assert!(shipping.set_secondaries("q", &[NodeId(3)], 50));
        assert!(shipping.set_secondaries("q", &[NodeId(2)], 40));
        assert_eq!(secondaries(&sq), vec![NodeId(3)]);
        assert!(shipping.set_secondaries("q", &[NodeId(3), NodeId(2)], 60));
        assert_eq!(secondaries(&sq), vec![NodeId(2), NodeId(3)]);
        // Starting again from an older placement does not replace the running state...
        let stale = Arc::new(ShipQueue::new(
            "q",
            7,
            shipper(),
            (&[NodeId(2)], 45),
            Lease::at_start(0, 0),
            Instant::now(),
        ));
        assert!(!shipping.insert(stale.clone()));
        assert!(Arc::ptr_eq(&shipping.get("q").unwrap(), &sq));
        assert!(!stale.is_stopped() && !sq.is_stopped());
        // ...a newer one does, and stops it.
        let newer = Arc::new(ShipQueue::new(
            "q",
            7,
            shipper(),
            (&[NodeId(3)], 70),
            Lease::at_start(0, 0),
            Instant::now(),
        ));
        assert!(shipping.insert(newer.clone()));
        assert!(sq.is_stopped());
        assert!(Arc::ptr_eq(
            &shipping.qids().get(&7).unwrap().clone(),
            &newer
        ));
        assert!(
            !shipping.set_secondaries("other", &[NodeId(2)], 1),
            "not shipped here"
        );
    }

    #[test]
    fn a_ship_read_takes_only_the_contiguous_run_from_the_offset_named() {
        // Replication offsets 2, 3 and 4 (stored at 3, 4, 5): 0 and 1 were acked and trimmed.
        let store = MemStore::new();
        let mut b = Batch::new();
        for stored in 3..=5u64 {
            b.append(7, stored, Entry::new(0, format!("e{stored}").as_bytes()));
        }
        store.write(&b, false).unwrap();
        let bodies = |first, count| {
            let (entries, bytes) = read(&store, 7, first, count, usize::MAX).unwrap();
            let bodies: Vec<String> = entries
                .into_iter()
                .map(|e| String::from_utf8(e.body).unwrap())
                .collect();
            (bodies, bytes)
        };
        // The batch named 0..5: its head is gone, so nothing (not 2..4 shifted onto 0..2).
        assert_eq!(bodies(0, 5), (Vec::<String>::new(), 0));
        assert_eq!(
            bodies(2, 3),
            (vec!["e3".into(), "e4".into(), "e5".into()], 6)
        );
        assert_eq!(bodies(3, 5), (vec!["e4".into(), "e5".into()], 4));
        assert_eq!(bodies(2, 0), (Vec::<String>::new(), 0));
    }
}
