//! The node's sans-IO core: queues, sessions, interest and the durable life cycle.
//!
//! [`NodeCore`] takes inputs (a connection's hello, a registration, a publish, an ack, a
//! disconnect, the time) and returns plain outputs: storage [`Batch`]es for the driver to
//! commit, statuses and errors for the client, and [`Step`]s for a session's delivery. It never
//! performs I/O and never reads a clock, so tests drive it deterministically
//! (`tests/core_state_machine.rs`). The tokio/quinn/RocksDB driver lives in `crate::server`.
//!
//! Offsets: a queue's entries have offsets `1..`; `acked` is the highest acknowledged offset,
//! `end` the highest assigned one, `visible_end` the highest committed one (delivery reads only
//! committed entries), so `acked <= visible_end <= end` and `pending = end - acked` in O(1).
//! `acked_stored` is the highest acknowledged offset committed to the store: the most a copy is
//! told (a copy never holds an ack its primary could lose in a crash). Offsets are assigned,
//! and their batches submitted to the writer, under the core lock, so commit order is offset
//! order (`server/writer.rs`). An ack moves `acked` and deletes the entries up to it in one
//! atomic batch (one DeleteRange); an ack beyond what the session was sent is a protocol
//! violation. Storage never stores `end`: recovery derives it with one reverse seek per queue,
//! so a restart reads the queue metadata and one seek per queue, never the logs.
//!
//! The delivered mark: `delivered` is the highest offset put on the wire (the bound of the
//! next session's `possible_duplicate` flags); `delivered_stored` the mark in storage, reserved
//! ahead of it by [`DELIVERED_MARK_RESERVE_ENTRIES`] and made durable (synced) before a frame
//! past it is sent. So a power cut, which loses unsynced writes, never leaves a stored mark
//! below an entry a client may have seen; a restart clamps the mark to the queue's end, so
//! only entries that existed at the cut can be flagged. A session that ends brings the stored
//! mark back to `delivered`, so an entry queued while its client was away is not flagged either.
//! After any crash, a process kill or a power cut, every redelivered entry at or below the
//! stored mark is flagged `possible_duplicate` (`tests/power_cut.rs`).
//!
//! What the client saw: a client resuming its queue in the same process sends the newest entry
//! it received (`DurableHello::seen`). Before the welcome the node raises the session's
//! `possible_duplicate` bound to it (`NodeCore::client_seen`), or, if the queue ends below it or
//! holds another event id at its offset, flags every entry and answers `diverged`, so the
//! client stops filtering by offset (the read is `check_client_seen` in `server/conn.rs`).
//!
//! Ids: publisher session numbers are persisted before use, and skip
//! `SESSION_IDS_SKIPPED_AT_RESTART` at each restart, so event ids `(node, session, seq)` never
//! repeat, even after a power cut under `--sync none`; a new data directory starts them from
//! the wall clock (`new_session_ids_start`), past the ids of one its node lost.
//!
//! The durable life cycle:
//! - one attached session per durable id (`NodeCore::connect_as`, which also enforces the id's
//!   owner); the driver probes an attached session before a second connection takes it over
//!   (`server/conn.rs`);
//! - a crash, a lost connection, a server shutdown and `close(keepalive)` keep a durable queue
//!   and its durable interest; non-durable interest ends with the session (the entries it
//!   queued stay);
//! - `close(drop)` and expiry drop the queue; only expiry makes the next connection see
//!   `expired`, once (the set of expired ids is persisted and bounded);
//! - the timeout presented at the latest connection is the one that counts; an away queue's
//!   `away_since` is persisted, so a restart extends no timeout (a queue attached at the crash
//!   counts as away from the restart). Every time the core keeps is a reading of the node's
//!   clock passed in by the driver (`server/clock.rs`).

pub mod bytes;
pub mod cursor;
pub mod error;
pub mod pace;

use std::collections::{BTreeMap, BTreeSet, HashMap, VecDeque};
use std::sync::Arc;

use serde::{Deserialize, Serialize};
use tether_storage::{Batch, Entry, Offset, QueueId, QueueMeta, StorageError};
use tether_transport::codec::{decode_body, encode_body, encode_body_packed};

pub use cursor::{Cursor, FlagBounds, Step};
pub use error::{AdoptError, Record, RecoveryError};

use self::bytes::{QueueBytes, event_bytes_max};
use crate::config::{Limits, QueueFullPolicy};
use crate::interest::{
    InterestIndex, Interests, Prematch, RegexMatcher, Registration, Selector, validate_key,
};
use crate::limits::*;
use crate::protocol::*;
use crate::replication::{EpochStart, LogState, ReplicaState};

/// Identifies a connection (and a publisher: event ids carry it). Persisted before use.
pub type SessionId = u64;

/// The queue id of a session that has no queue (queue ids start at 1).
pub const NO_QUEUE: QueueId = 0;

/// State keys of the node in the storage `state` map.
pub const STATE_NEXT_QUEUE_ID: &str = "node/next-queue-id";
pub const STATE_NEXT_SESSION_ID: &str = "node/next-session-id";
pub const STATE_EXPIRED_IDS: &str = "node/expired-ids";

/// Region store values carry a tag byte: `REGION_TAG_VALUE` + value, or `REGION_TAG_INVALID`
/// for a key whose value was invalidated (the key exists, its value is null).
pub const REGION_TAG_INVALID: u8 = 0;
pub const REGION_TAG_VALUE: u8 = 1;

/// The value of a region store record, None for an invalidated key.
pub fn decode_region_value(stored: &[u8]) -> Option<&[u8]> {
    match stored.split_first() {
        Some((&REGION_TAG_VALUE, v)) => Some(v),
        _ => None,
    }
}

/// Encodes a value (None: invalidated) for the region store.
pub fn encode_region_value(value: Option<&[u8]>) -> Vec<u8> {
    match value {
        Some(v) => {
            let mut out = Vec::with_capacity(v.len() + 1);
            out.push(REGION_TAG_VALUE);
            out.extend_from_slice(v);
            out
        }
        None => vec![REGION_TAG_INVALID],
    }
}

/// The queue metadata blob the core owns (stored as `QueueMeta::info`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct QueueInfo {
    pub durable_id: Option<String>,
    pub timeout_secs: u64,
    /// Wall-clock time (ms since the epoch) the client went away; None while connected.
    pub away_since_ms: Option<u64>,
    /// Durable registrations only: non-durable interest ends with the session.
    pub interests: Vec<(String, Selector, Registration)>,
    /// The principal that created the queue (when the node authenticates clients): no other
    /// principal may attach to it.
    #[serde(default)]
    pub owner: Option<String>,
    /// Epoch runs of the entries appended before this node became the queue's primary (a
    /// promoted copy's log), for log matching with the secondaries. Empty for a queue created
    /// here.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub prior_runs: Vec<EpochStart>,
    /// The log end (replication offset) when this node became primary: entries from here on
    /// were appended under the queue's epoch.
    #[serde(default)]
    pub promoted_at: Offset,
    /// Set on a secondary's copy of a queue (cluster): its replication state. A copy is not a
    /// queue of this node's core; it becomes one when this node is promoted to primary.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub copy: Option<ReplicaState>,
    /// Set on a copy: its replicated watermark as last stored (per origin node, the
    /// publish-log offset through which it holds every matching publish). On a queue promoted
    /// here: the watermark its copy had (`Queue::held_through`). Never shipped.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub copy_through: BTreeMap<String, u64>,
    /// Set on a copy: per publisher, the highest event sequence ever written to it, as last
    /// stored (a restarted node still knows the events its copy held and its client acknowledged,
    /// so a promotion does not append them again). On a queue promoted here: the same, for
    /// the queue (`Queue::seen`). Never shipped.
    #[serde(default, skip_serializing_if = "HashMap::is_empty")]
    pub copy_seen: SeenEvents,
    /// Which queue of its durable id this is (see [`Queue::incarnation`]); 0 for a queue
    /// created before incarnations were recorded. Shipped: a copy of another queue of the same
    /// id is replaced, not continued (`control::reconcile::copy_of_another_queue`).
    #[serde(default)]
    pub incarnation: u64,
}

/// Where a queue's client is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum QueueState {
    /// A session is attached (ready or not).
    Attached(SessionId),
    /// The durable client is away since this wall-clock time (ms).
    Away { since_ms: u64 },
}

/// One subscription queue.
#[derive(Debug)]
pub struct Queue {
    pub id: QueueId,
    pub durable_id: Option<String>,
    pub owner: Option<String>,
    pub timeout_secs: u64,
    pub acked: Offset,
    /// The highest `acked` committed to the store (see the module docs).
    pub acked_stored: Offset,
    pub end: Offset,
    pub visible_end: Offset,
    pub delivered: Offset,
    /// The delivered mark in storage: at least `delivered` (see the module docs).
    pub delivered_stored: Offset,
    pub epoch: u64,
    pub interests: Interests,
    pub state: QueueState,
    /// Enqueue-time checkpoints `(offset, wall ms)`: entries from `offset` on were enqueued at or
    /// after that time. The first one dates the oldest unacknowledged entry (to within
    /// `ENQUEUE_CHECKPOINT_INTERVAL_MS`).
    pub checkpoints: VecDeque<(Offset, u64)>,
    /// Delivery stops at this offset (cluster: what every secondary holds, while this node holds
    /// its primary lease). None: no cap (single node, or no copies).
    pub deliver_cap: Option<Offset>,
    /// See [`QueueInfo::prior_runs`].
    pub prior_runs: Vec<EpochStart>,
    /// See [`QueueInfo::promoted_at`].
    pub promoted_at: Offset,
    /// Tells this queue from every other queue its durable id had or will have (one closed
    /// or expired, then the id placed again): a hash of the node that created it, its queue
    /// id there and that node's start time, never 0; kept through promotions and handovers.
    /// Offsets and epochs alone cannot tell them apart: a new queue placed on the same
    /// member, at the same placement epoch, starts again at offset 0.
    pub incarnation: u64,
    /// Bytes of the entries waiting, for the byte limit.
    pub bytes: QueueBytes,
    /// On a queue promoted here (cluster failover): per publisher, the highest event sequence
    /// the queue holds, so a forwarded event the failed primary had already appended (and
    /// shipped) is not appended twice. None elsewhere.
    pub seen: Option<Box<SeenEvents>>,
    /// On a queue promoted here: per origin node, the publish-log offset through which the
    /// copy was known to hold every matching publish (its replicated watermark). None elsewhere.
    pub held_through: Option<Box<BTreeMap<String, u64>>>,
    /// Being handed over to another node (cluster rebalancing, see
    /// [`NodeCore::begin_handover`]): no client attaches meanwhile. Not stored: a restart ends
    /// the attempt, and the metadata then says whether the queue moved.
    pub moving: bool,
    /// Counts the changes of what [`Queue::info_for_copies`] returns (each one is stored through
    /// `persist_info`, which bumps it): a shipper sends the info to the copies again only
    /// after it changed. Not stored.
    pub info_generation: u64,
    /// Enqueue, delivery and ack rates, sampled by the node's tick ([`NodeCore::sample_rates`]).
    pub rates: crate::admin::QueueRates,
}

/// Per publisher (origin node, then session), the highest event sequence held.
pub type SeenEvents = HashMap<String, HashMap<u64, u64>>;

/// A publish as applied here (forwarded by a peer, or this node's own): kept on every
/// clustered node until no copy held there, now or later, may lack it, so a promotion can
/// append what the failed primary had not shipped yet (`server/failover.rs`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct RecentForward {
    pub origin: EventOrigin,
    /// Each operation with the event kind it produced when it was applied here.
    pub ops: Vec<(PublishOp, EventOp)>,
}

/// Spacing of a queue's enqueue-time checkpoints, in milliseconds.
pub const ENQUEUE_CHECKPOINT_INTERVAL_MS: u64 = 1_000;
/// Checkpoints kept per queue; beyond it the oldest-unacked age is over-estimated, never under.
pub const ENQUEUE_CHECKPOINTS_PER_QUEUE_MAX: usize = 256;

impl Queue {
    fn note_append(&mut self, now_ms: u64) {
        let due = self
            .checkpoints
            .back()
            .is_none_or(|&(_, t)| now_ms >= t.saturating_add(ENQUEUE_CHECKPOINT_INTERVAL_MS));
        if due && self.checkpoints.len() < ENQUEUE_CHECKPOINTS_PER_QUEUE_MAX {
            self.checkpoints.push_back((self.end, now_ms));
        }
    }

    fn note_ack(&mut self) {
        if self.acked >= self.end {
            self.checkpoints.clear();
            return;
        }
        while self.checkpoints.len() >= 2 && self.checkpoints[1].0 <= self.acked + 1 {
            self.checkpoints.pop_front();
        }
    }

    /// Age of the oldest unacknowledged entry, if any.
    pub fn oldest_unacked_age_ms(&self, now_ms: u64) -> Option<u64> {
        if self.pending() == 0 {
            return None;
        }
        self.checkpoints
            .front()
            .map(|&(_, t)| now_ms.saturating_sub(t))
    }

    pub fn pending(&self) -> u64 {
        self.end - self.acked
    }

    /// Every registration, as reports show it.
    fn interest_infos(&self) -> Vec<crate::protocol::InterestInfo> {
        self.interests
            .iter()
            .map(|((r, sel), reg)| sel.info(r, reg.durable))
            .collect()
    }

    /// Bytes of the entries waiting (see [`QueueBytes::pending`]).
    pub fn pending_bytes(&self) -> u64 {
        self.bytes.pending()
    }

    /// Whether this (promoted) queue already holds event `seq` of publisher `(node, session)`,
    /// published at offset `offset` of the origin's publish log.
    fn holds(&self, node: &str, session: u64, seq: u64, offset: u64) -> bool {
        self.held_through
            .as_ref()
            .is_some_and(|t| through_holds(t, node, offset))
            || self
                .seen
                .as_ref()
                .is_some_and(|seen| seen_holds(seen, node, session, seq))
    }

    /// Appends the encoded event `body` (with id `id`) at the next offset; returns the offset.
    /// `mark_interval`: see [`bytes::mark_interval_bytes`].
    fn append_event(
        &mut self,
        body: &Arc<[u8]>,
        id: &EventId,
        wants_values: bool,
        (now_ms, mark_interval): (u64, u64),
        batch: &mut Batch,
    ) -> Offset {
        self.end += 1;
        self.note_append(now_ms);
        if let Some((offset, bytes)) = self
            .bytes
            .append(self.end, body.len() as u64, mark_interval)
        {
            batch.put_byte_mark(self.id, offset, bytes);
        }
        let flags = if wants_values { 0 } else { FLAG_NO_VALUE };
        batch.append(
            self.id,
            self.end,
            Entry {
                flags,
                body: body.clone(),
            },
        );
        if let Some(seen) = &mut self.seen {
            note_seen(seen, id);
        }
        self.end
    }

    /// The queue's info as stored with its metadata.
    pub fn info(&self) -> QueueInfo {
        let mut info = self.info_for_copies();
        // A promoted queue's: stored so that a restart still tells the events it held from
        // new ones (a publish it held may be forwarded here only after the restart).
        info.copy_through = self.held_through.as_deref().cloned().unwrap_or_default();
        if let Some(seen) = &self.seen {
            // Bounded as a copy's is (the queue's own grows with each publisher session).
            info.copy_seen = (**seen).clone();
            bound_seen(&mut info.copy_seen);
        }
        info
    }

    /// The queue's info as shipped to its copies: without what this (promoted) queue held,
    /// each copy keeps its own.
    pub fn info_for_copies(&self) -> QueueInfo {
        QueueInfo {
            durable_id: self.durable_id.clone(),
            timeout_secs: self.timeout_secs,
            away_since_ms: match self.state {
                QueueState::Away { since_ms } => Some(since_ms),
                QueueState::Attached(_) => None,
            },
            interests: self
                .interests
                .iter()
                .filter(|(_, r)| r.durable)
                .map(|((region, sel), r)| (region.clone(), sel.clone(), *r))
                .collect(),
            owner: self.owner.clone(),
            prior_runs: self.prior_runs.clone(),
            promoted_at: self.promoted_at,
            copy: None,
            copy_through: BTreeMap::new(),
            copy_seen: HashMap::new(),
            incarnation: self.incarnation,
        }
    }

    /// The queue log's shape for replication: offsets `[acked, end)` (replication offset `o` is
    /// the queue's entry `o + 1`) and the epoch of every entry.
    pub fn log_state(&self) -> Result<LogState, RecoveryError> {
        let mut runs = self.prior_runs.clone();
        if self.end > self.promoted_at {
            runs.push(EpochStart {
                epoch: self.epoch,
                first: self.promoted_at,
            });
        }
        LogState::new(self.acked, self.end, runs).map_err(|error| RecoveryError::InvalidLog {
            queue: self.id,
            error,
        })
    }

    fn persist_info(&mut self, batch: &mut Batch) {
        self.info_generation += 1;
        let bytes = encode_body(&self.info()).expect("queue info always encodes");
        batch.put_queue_info(self.id, self.epoch, bytes);
    }

    fn regions(&self) -> Vec<&str> {
        let mut v: Vec<&str> = self.interests.keys().map(|(r, _)| r.as_str()).collect();
        v.dedup();
        v
    }
}

/// One connection.
#[derive(Debug)]
pub struct Session {
    pub id: SessionId,
    pub queue: QueueId,
    pub durable: bool,
    /// Sequence of the next event this session publishes.
    pub next_seq: u64,
    /// Set once the client is ready (immediately for non-durable clients).
    pub cursor: Option<Cursor>,
    /// Highest offset written to the wire in this session.
    pub sent: Offset,
    /// The replay rate the client asked for, in events per second (0: unlimited).
    pub replay_events_per_s: u64,
    /// The authenticated principal of a non-durable client (a durable client's is its queue's
    /// owner): the owner of the queue its first interest creates.
    pub principal: Option<String>,
}

impl Session {
    fn new(id: SessionId, queue: QueueId, durable: bool, cursor: Option<Cursor>) -> Self {
        Session {
            id,
            queue,
            durable,
            next_seq: 1,
            cursor,
            sent: 0,
            replay_events_per_s: 0,
            principal: None,
        }
    }
}

/// Result of a successful connect.
#[derive(Debug)]
pub struct Connected {
    pub session: SessionId,
    pub status: QueueStatus,
    pub pending: Option<u64>,
    pub batch: Batch,
}

/// What a resumed queue made of the newest entry its client says it saw
/// ([`NodeCore::client_seen`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SeenVerdict {
    /// The queue holds it, and already flags every entry up to it.
    Consistent,
    /// The queue holds it, but its delivered mark was below it (lost): entries up to it are
    /// flagged `possible_duplicate` now.
    FlagsRaised,
    /// The queue ends below it, or holds another event at its offset: entries the client saw
    /// are lost here and offsets no longer name the same events. Every entry is flagged.
    Diverged,
}

/// Why a connect was not accepted.
#[derive(Debug, PartialEq)]
pub enum ConnectError {
    /// The durable id is attached to this live session; probe it before refusing.
    Attached(SessionId),
    Invalid(WireError),
}

/// A remembered expired durable id, as stored: a plain id (as before owners were kept, and
/// for queues no principal owned), or the id with its owner.
#[derive(Serialize, Deserialize)]
#[serde(untagged)]
enum ExpiredId {
    Id(String),
    Owned { id: String, owner: String },
}

/// The refusal of a durable id that another principal owns.
pub(crate) fn not_yours(id: &str) -> WireError {
    WireError::new(
        ErrorCode::Forbidden,
        format!("durable id {id:?} belongs to another principal"),
    )
}

/// Why [`NodeCore::publish_within`] planned no publish. Nothing took effect either way.
#[derive(Debug)]
pub enum PublishRefused {
    /// Refused, with the error for the client.
    Error(WireError),
    /// The caller could not make room for the bytes the publish would add to its queues;
    /// retry once it can hold `fanout_bytes`.
    NoRoom { fanout_bytes: u64 },
}

impl From<WireError> for PublishRefused {
    fn from(e: WireError) -> Self {
        PublishRefused::Error(e)
    }
}

/// A publish turned into storage writes.
#[derive(Debug, Default)]
pub struct PublishPlan {
    pub batch: Batch,
    /// Last offset appended per queue, to mark visible once committed.
    pub appended: Vec<(QueueId, Offset)>,
    pub count: u64,
    /// Queue entries appended (fan-out included).
    pub enqueued: u64,
    /// Write sequence of this plan, for [`NodeCore::committed`].
    pub seq: u64,
    /// Queues dropped because they were full (`drop-queue` policy).
    pub dropped_queues: u64,
    /// Sessions attached to dropped queues: the driver disconnects them.
    pub dropped_sessions: Vec<SessionId>,
    /// Event id of the first operation (the others follow with consecutive `seq`).
    pub first_id: Option<EventId>,
    /// The event kind each operation produced, in order.
    pub event_ops: Vec<EventOp>,
    /// Operations whose key was matched against its region's regexes under the core lock:
    /// no [`Prematch`] was given for it, or the region's matcher had changed since (the
    /// caller's matchers are out of date; see [`NodeCore::regex_matcher`]).
    pub regexes_matched_here: u64,
}

/// The event ids of a publish made on another cluster node: operation `i` gets
/// `(node, session, first_seq + i)`, the ids the origin assigned, so an event keeps one id on
/// every node.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct EventOrigin {
    pub node: String,
    pub session: u64,
    pub first_seq: u64,
    /// Offset of the publish in the origin node's publish log.
    pub offset: u64,
}

/// Whether watermark `through` covers offset `offset` of origin `node`'s publish log.
fn through_holds(through: &BTreeMap<String, u64>, node: &str, offset: u64) -> bool {
    through.get(node).is_some_and(|&x| x >= offset)
}

/// The first publisher session id of a data directory created at wall time `now_ms` (see
/// [`SESSION_IDS_START_SHIFT_BITS`]).
pub fn new_session_ids_start(now_ms: u64) -> u64 {
    (now_ms.saturating_sub(IDS_EPOCH_MS) << SESSION_IDS_START_SHIFT_BITS) + 1
}

/// Whether `seen` holds event `seq` of publisher `(node, session)` (or a later one of it).
fn seen_holds(seen: &SeenEvents, node: &str, session: u64, seq: u64) -> bool {
    seen.get(node)
        .and_then(|s| s.get(&session))
        .is_some_and(|&max| max >= seq)
}

/// An event a promoted queue lacks, encoded for [`NodeCore::reapply_forwarded`].
pub struct ReapplyEvent {
    id: EventId,
    body: Arc<[u8]>,
    wants_values: bool,
}

/// The events of `forwards` (kept publishes, oldest first) that a queue registered for
/// `interests` wants and does not hold by `seen` and `held_through` (see
/// [`NodeCore::reapply_forwarded`]), encoded. Pure and possibly long (every kept publish is
/// matched): a promotion runs it off the core lock.
pub fn events_to_reapply(
    interests: &[(String, Selector, Registration)],
    seen: &SeenEvents,
    held_through: &BTreeMap<String, u64>,
    forwards: &[Arc<RecentForward>],
) -> Vec<ReapplyEvent> {
    // The queue's interest alone, matched exactly as the node's index matches it.
    const ME: QueueId = 0;
    let mut index = InterestIndex::default();
    for (region, selector, reg) in interests {
        index.insert(region, selector, ME, reg.receive_values);
    }
    let mut out = Vec::new();
    let mut scratch = BTreeMap::new();
    for f in forwards {
        let o = &f.origin;
        if through_holds(held_through, &o.node, o.offset) {
            continue;
        }
        for (i, (op, event_op)) in f.ops.iter().enumerate() {
            let seq = o.first_seq + i as u64;
            let (region, key) = op_target(op);
            index.matches(region, key, &mut scratch);
            let Some(&wants_values) = scratch.get(&ME) else {
                continue;
            };
            if seen_holds(seen, &o.node, o.session, seq) {
                continue;
            }
            let id = EventId {
                node: o.node.clone(),
                session: o.session,
                seq,
            };
            let value = match op {
                PublishOp::Put { value, .. } => Some(value),
                _ => None,
            };
            let (record, body) = encode_event(id, region, key, *event_op, value);
            out.push(ReapplyEvent {
                id: record.id,
                body,
                wants_values,
            });
        }
    }
    out
}

/// Most publisher sessions a copy's [`SeenEvents`] keeps (it is stored with every write of the
/// copy); beyond, it is cut to three quarters, keeping the highest session ids: an old
/// session's events are long past the copy's watermark.
pub const SEEN_SESSIONS_MAX: usize = 1024;

/// Cuts `seen` per [`SEEN_SESSIONS_MAX`].
pub fn bound_seen(seen: &mut SeenEvents) {
    let total: usize = seen.values().map(HashMap::len).sum();
    if total <= SEEN_SESSIONS_MAX {
        return;
    }
    let mut sessions: Vec<u64> = seen.values().flat_map(|s| s.keys().copied()).collect();
    sessions.sort_unstable_by(|a, b| b.cmp(a));
    let lowest_kept = sessions[SEEN_SESSIONS_MAX * 3 / 4 - 1];
    for s in seen.values_mut() {
        s.retain(|&session, _| session >= lowest_kept);
    }
    seen.retain(|_, s| !s.is_empty());
}

/// Records event `id` in a per-publisher high-water map (see [`Queue::seen`]).
pub fn note_seen(seen: &mut SeenEvents, id: &EventId) {
    let sessions = match seen.get_mut(id.node.as_str()) {
        Some(s) => s,
        None => seen.entry(id.node.clone()).or_default(),
    };
    let max = sessions.entry(id.session).or_insert(0);
    *max = (*max).max(id.seq);
}

/// The stored form of an event: its record, packed. Creates and updates carry the value.
fn encode_event(
    id: EventId,
    region: &str,
    key: &str,
    op: EventOp,
    value: Option<&Vec<u8>>,
) -> (EventRecord, Arc<[u8]>) {
    let record = EventRecord {
        id,
        region: region.to_string(),
        key: key.to_string(),
        op,
        value: match op {
            EventOp::Create | EventOp::Update => value.cloned(),
            _ => None,
        },
    };
    let body = encode_body_packed(&record).expect("records encode").into();
    (record, body)
}

/// Stored queues split by [`NodeCore::split_copies`]: this node's queues, and the copies it
/// holds for other primaries with their decoded info.
pub type SplitQueues = (
    Vec<(QueueId, QueueMeta)>,
    Vec<(QueueId, QueueMeta, QueueInfo)>,
);

/// What [`NodeCore::disconnect`] did.
#[derive(Debug, Default)]
pub struct Disconnected {
    pub batch: Batch,
    pub queue_dropped: bool,
}

/// Counters the driver exports as metrics.
#[derive(Debug, Default, Clone, Copy)]
pub struct QueueCounts {
    pub attached: u64,
    pub ready: u64,
    pub away: u64,
    pub pending_total: u64,
    pub pending_bytes_total: u64,
    pub oldest_unacked_age_ms: u64,
}

/// The session and its queue, borrowed from the core's maps separately so the index stays free.
fn session_queue<'a>(
    sessions: &'a mut HashMap<SessionId, Session>,
    queues: &'a mut HashMap<QueueId, Box<Queue>>,
    session: SessionId,
) -> Result<(&'a mut Session, &'a mut Queue), WireError> {
    let s = sessions
        .get_mut(&session)
        .ok_or_else(|| WireError::new(ErrorCode::NotFound, "no such session"))?;
    let q = queues.get_mut(&s.queue).ok_or_else(|| {
        WireError::new(
            ErrorCode::NotFound,
            "this session has no subscription queue",
        )
    })?;
    Ok((s, q))
}

/// What a region key counts against [`KNOWN_REGION_KEYS_BYTES_MAX`] in the core's overlay.
fn known_key_bytes(region: &str, key: &str) -> usize {
    region.len() + key.len() + KNOWN_REGION_KEY_OVERHEAD_BYTES
}

/// Records in the overlay that a plan wrote `target` (`(exists after, plan seq)`), counting a
/// key new to it.
fn overlay_put(
    overlay: &mut HashMap<(String, String), (bool, u64)>,
    bytes: &mut usize,
    target: (String, String),
    written: (bool, u64),
) {
    let added = known_key_bytes(&target.0, &target.1);
    if overlay.insert(target, written).is_none() {
        *bytes += added;
    }
}

/// The region and key an operation targets.
pub fn op_target(op: &PublishOp) -> (&str, &str) {
    match op {
        PublishOp::Put { region, key, .. }
        | PublishOp::Destroy { region, key }
        | PublishOp::Invalidate { region, key } => (region, key),
    }
}

/// The stored info of queue `id`.
fn decode_queue_info(id: QueueId, meta: &QueueMeta) -> Result<QueueInfo, RecoveryError> {
    decode_body(&meta.info).map_err(|error| RecoveryError::Decode {
        record: Record::QueueInfo(id),
        error,
    })
}

fn invalid(msg: impl Into<String>) -> WireError {
    WireError::new(ErrorCode::InvalidArgument, msg)
}

/// What one registration counts for against [`INTEREST_BYTES_PER_QUEUE_MAX`].
fn interest_bytes(region: &str, sel: &Selector) -> usize {
    let text = match sel {
        Selector::Key(k) => k.len(),
        Selector::Regex(r) => r.len(),
        Selector::All => 0,
    };
    region.len() + text + INTEREST_OVERHEAD_BYTES
}

/// Validates the durable part of a hello against its limits: checked before anything is done
/// for it (on a cluster, before the id is placed through consensus).
pub fn validate_durable_hello(hello: &DurableHello) -> Result<(), WireError> {
    if hello.id.is_empty() || hello.id.len() > DURABLE_ID_BYTES_MAX {
        return Err(invalid(format!(
            "durable id must be 1 to {DURABLE_ID_BYTES_MAX} bytes"
        )));
    }
    if hello.timeout_secs > DURABLE_TIMEOUT_SECS_MAX {
        return Err(invalid(format!(
            "durable timeout {} s exceeds the limit of {DURABLE_TIMEOUT_SECS_MAX} s",
            hello.timeout_secs
        )));
    }
    if let Some(node) = &hello.failed_primary {
        crate::config::validate_node_id(node)
            .map_err(|e| invalid(format!("failed primary: {e}")))?;
    }
    Ok(())
}

/// Validates a region name against its limits.
pub fn validate_region(region: &str) -> Result<(), WireError> {
    if region.is_empty() {
        return Err(invalid("region name is empty"));
    }
    if region.len() > REGION_NAME_BYTES_MAX {
        return Err(invalid(format!(
            "region name of {} bytes exceeds the limit of {REGION_NAME_BYTES_MAX} bytes",
            region.len()
        )));
    }
    Ok(())
}

/// The node's state machine. See the module docs.
pub struct NodeCore {
    node_id: String,
    /// Boxed: an idle queue then costs its own size plus a pointer in the table, not the table's
    /// whole slot size times its spare capacity.
    queues: HashMap<QueueId, Box<Queue>>,
    durable: HashMap<String, QueueId>,
    sessions: HashMap<SessionId, Session>,
    index: InterestIndex,
    next_queue_id: QueueId,
    next_session_id: SessionId,
    /// Durable ids whose queue expired (or was dropped for being full), oldest first, at most
    /// `EXPIRED_IDS_REMEMBERED_MAX`: the next connection with the id learns `expired`, and only
    /// the principal that owned the queue (when one did) may take the id again meanwhile.
    expired: VecDeque<String>,
    expired_owner: HashMap<String, Option<String>>,
    /// Region keys written by this core's plans: (exists after the write, the plan's seq).
    /// Those of plans not committed yet (seq above `committed_seq`) are what the store does
    /// not show yet; the committed ones save a read of the store under the lock (a publish
    /// asks whether each key exists: create or update), at most
    /// [`KNOWN_REGION_KEYS_BYTES_MAX`] (`overlay_bytes`, by [`known_key_bytes`]).
    /// Every write of the regions goes through a plan of this core (a join's copy of another
    /// member's regions, made before the node serves, forgets them:
    /// [`NodeCore::forget_region_keys`]).
    overlay: HashMap<(String, String), (bool, u64)>,
    /// What the overlay's keys count against [`KNOWN_REGION_KEYS_BYTES_MAX`].
    overlay_bytes: usize,
    /// The seq of the last plan committed (plans commit in seq order).
    committed_seq: u64,
    write_seq: u64,
    scratch: BTreeMap<QueueId, bool>,
    /// Pass-1 matches of a publish: (op index, queue, wants values).
    match_scratch: Vec<(usize, QueueId, bool)>,
    limits: Limits,
    /// When this core was recovered (wall ms; 0 for a new core): with the node id and queue
    /// id, what makes each queue's [`Queue::incarnation`] unique, even after a node lost its
    /// data directory and allocates queue ids from 1 again.
    started_ms: u64,
}

impl NodeCore {
    /// A core with no state (a new data directory).
    pub fn new(node_id: impl Into<String>) -> Self {
        NodeCore {
            node_id: node_id.into(),
            queues: HashMap::new(),
            durable: HashMap::new(),
            sessions: HashMap::new(),
            index: InterestIndex::default(),
            next_queue_id: 1,
            next_session_id: 1,
            expired: VecDeque::new(),
            expired_owner: HashMap::new(),
            overlay: HashMap::new(),
            overlay_bytes: 0,
            committed_seq: 0,
            write_seq: 0,
            scratch: BTreeMap::new(),
            match_scratch: Vec::new(),
            limits: Limits::default(),
            started_ms: 0,
        }
    }

    /// Rebuilds the core from storage after a restart (or a kill -9): every durable queue comes
    /// back away (a session attached at the crash is treated as a crash: keepalive), with its
    /// durable interest; non-durable queues are dropped in the returned batch. `state` reads a
    /// node-state key; `entry_bytes(queue, from, to)` the bytes of stored entries `from..=to`
    /// (a few short reads per queue with a backlog, see [`QueueBytes::recover`]).
    pub fn recover(
        node_id: impl Into<String>,
        now_ms: u64,
        queues: Vec<(QueueId, QueueMeta)>,
        state: impl Fn(&str) -> Result<Option<Vec<u8>>, StorageError>,
        mut entry_bytes: impl FnMut(QueueId, Offset, Offset) -> Result<u64, StorageError>,
    ) -> Result<(Self, Batch), RecoveryError> {
        let mut core = NodeCore::new(node_id);
        core.started_ms = now_ms;
        let read_u64 = |key: &'static str| -> Result<Option<u64>, RecoveryError> {
            match state(key)? {
                None => Ok(None),
                Some(b) => Ok(Some(u64::from_be_bytes(
                    b.as_slice()
                        .try_into()
                        .map_err(|_| RecoveryError::StateRecord { key })?,
                ))),
            }
        };
        core.next_queue_id = read_u64(STATE_NEXT_QUEUE_ID)?.unwrap_or(1);
        // Skipped ahead: a session id allocated before a power cut whose write was lost
        // (`--sync none`) is never allocated again, so event ids stay unique.
        // A new data directory starts from the wall clock: its node may have had another one
        // before (lost with its disk), whose ids its peers still hold.
        core.next_session_id = read_u64(STATE_NEXT_SESSION_ID)?.map_or_else(
            || new_session_ids_start(now_ms),
            |n| n.saturating_add(SESSION_IDS_SKIPPED_AT_RESTART),
        );
        if let Some(bytes) = state(STATE_EXPIRED_IDS)? {
            let ids: Vec<ExpiredId> =
                decode_body(&bytes).map_err(|error| RecoveryError::Decode {
                    record: Record::ExpiredIds,
                    error,
                })?;
            for record in ids {
                match record {
                    ExpiredId::Id(id) => core.remember_expired(id, None),
                    ExpiredId::Owned { id, owner } => core.remember_expired(id, Some(owner)),
                }
            }
        }
        let mut batch = Batch::new();
        for (id, meta) in queues {
            let info = decode_queue_info(id, &meta)?;
            if info.durable_id.is_none() {
                batch.drop_queue(id);
                continue;
            }
            let bytes =
                QueueBytes::recover(meta.acked, meta.end, &meta.byte_marks, &mut |from, to| {
                    entry_bytes(id, from, to)
                })
                .map_err(|error| RecoveryError::ByteCount { queue: id, error })?;
            core.restore_queue(id, &meta, info, bytes, now_ms, &mut batch);
        }
        Ok((core, batch))
    }

    /// Splits stored queues into this node's queues and the copies it holds for other
    /// primaries (cluster secondaries), decoding the copies' info.
    pub fn split_copies(queues: Vec<(QueueId, QueueMeta)>) -> Result<SplitQueues, RecoveryError> {
        let mut own = Vec::new();
        let mut copies = Vec::new();
        for (id, meta) in queues {
            let info = decode_queue_info(id, &meta)?;
            if info.copy.is_some() {
                copies.push((id, meta, info));
            } else {
                own.push((id, meta));
            }
        }
        Ok((own, copies))
    }

    /// Brings a stored durable queue back as an away queue with its durable interest.
    fn restore_queue(
        &mut self,
        id: QueueId,
        meta: &QueueMeta,
        info: QueueInfo,
        bytes: QueueBytes,
        now_ms: u64,
        batch: &mut Batch,
    ) {
        let durable_id = info.durable_id.clone().expect("checked by the caller");
        let since_ms = info.away_since_ms.unwrap_or(now_ms);
        let mut queue = Queue {
            id,
            durable_id: Some(durable_id.clone()),
            owner: info.owner.clone(),
            timeout_secs: info.timeout_secs,
            acked: meta.acked,
            acked_stored: meta.acked,
            end: meta.end,
            visible_end: meta.end,
            // A mark reserved ahead can pass the end: entries appended from now on were never
            // sent.
            delivered: meta.delivered.max(meta.acked).min(meta.end.max(meta.acked)),
            delivered_stored: meta.delivered.max(meta.acked),
            epoch: meta.epoch,
            interests: Interests::new(),
            state: QueueState::Away { since_ms },
            // Enqueue times are not stored: ages count from the restart.
            checkpoints: if meta.end > meta.acked {
                VecDeque::from([(meta.acked + 1, now_ms)])
            } else {
                VecDeque::new()
            },
            deliver_cap: None,
            prior_runs: info.prior_runs.clone(),
            promoted_at: info.promoted_at,
            incarnation: info.incarnation,
            bytes,
            // A promoted queue's, as stored (see `Queue::info`).
            seen: (!info.copy_seen.is_empty()).then(|| Box::new(info.copy_seen)),
            held_through: (!info.copy_through.is_empty()).then(|| Box::new(info.copy_through)),
            moving: false,
            info_generation: 0,
            rates: Default::default(),
        };
        for (region, sel, reg) in info.interests {
            let owner = queue.owner.as_deref();
            self.index
                .insert_owned(&region, &sel, id, reg.receive_values, owner, None);
            queue.interests.insert((region, sel), reg);
        }
        if info.away_since_ms.is_none() {
            queue.persist_info(batch);
        }
        self.next_queue_id = self.next_queue_id.max(id + 1);
        self.durable.insert(durable_id, id);
        self.queues.insert(id, Box::new(queue));
    }

    /// Promotion: the copy `id` of a queue (`info.copy` holds its replication state, `bytes`
    /// its byte count) becomes this node's queue, primary at `epoch`, away (its client was
    /// connected to the failed primary, or away already). Every entry it holds counts as
    /// possibly delivered: the old primary may have sent any of them. Returns the batch that
    /// makes it durable; fails if the durable id already has a queue here.
    pub fn adopt_copy(
        &mut self,
        id: QueueId,
        mut info: QueueInfo,
        bytes: QueueBytes,
        epoch: u64,
        now_ms: u64,
    ) -> Result<Batch, AdoptError> {
        let Some(copy) = info.copy.take() else {
            return Err(AdoptError::NotACopy { queue: id });
        };
        let durable_id = info
            .durable_id
            .clone()
            .ok_or(AdoptError::NoDurableId { queue: id })?;
        if self.durable.contains_key(&durable_id) {
            return Err(AdoptError::DurableIdTaken { durable_id });
        }
        info.prior_runs = copy.log.epochs().to_vec();
        info.promoted_at = copy.log.end();
        info.away_since_ms = Some(info.away_since_ms.unwrap_or(now_ms));
        let meta = QueueMeta {
            acked: copy.acked,
            delivered: copy.log.end(),
            epoch,
            info: Vec::new(),
            end: copy.log.end(),
            byte_marks: Vec::new(),
        };
        let mut batch = Batch::new();
        self.restore_queue(id, &meta, info, bytes, now_ms, &mut batch);
        let q = self.queues.get_mut(&id).expect("restored above");
        q.persist_info(&mut batch);
        batch.set_acked(id, meta.acked);
        batch.set_delivered(id, meta.delivered);
        Ok(batch)
    }

    /// Right after [`adopt_copy`](Self::adopt_copy): appends to the promoted queue `qid` the
    /// events the failed primary had not shipped, `events` from [`events_to_reapply`] over the
    /// publishes kept here. `seen` holds, per publisher, the highest sequence the copy ever held
    /// (see [`Queue::seen`]) and `held_through` its watermark; both stay with the queue to tell
    /// publishes it holds from new ones. Everything now in the queue counts as possibly
    /// delivered (also when a live primary handed the queue over: a forwarded event appended
    /// since may repeat one the queue held and its client acknowledged, which the copy knows
    /// only by publisher sequence, for a bounded number of publishers, or by a watermark a
    /// snapshot made it forget). Returns the batch and the new end
    /// (visible once the batch is committed, through [`committed`](Self::committed)).
    pub fn reapply_forwarded(
        &mut self,
        qid: QueueId,
        now_ms: u64,
        seen: SeenEvents,
        held_through: BTreeMap<String, u64>,
        events: Vec<ReapplyEvent>,
    ) -> Option<(Batch, Offset)> {
        let interval = bytes::mark_interval_bytes(self.limits.queue_bytes_max);
        let q = self.queues.get_mut(&qid)?;
        q.seen = Some(Box::new(seen));
        q.held_through = Some(Box::new(held_through));
        let mut batch = Batch::new();
        for e in events {
            q.append_event(
                &e.body,
                &e.id,
                e.wants_values,
                (now_ms, interval),
                &mut batch,
            );
        }
        q.delivered = q.end;
        q.delivered_stored = q.delivered_stored.max(q.end);
        batch.set_delivered(qid, q.delivered_stored);
        if let Some(seen) = &mut q.seen {
            bound_seen(seen);
        }
        q.persist_info(&mut batch);
        Some((batch, q.end))
    }

    /// A queue id for a copy this node starts holding (persisted with the returned batch).
    pub fn alloc_copy_id(&mut self) -> (QueueId, Batch) {
        let mut batch = Batch::new();
        let id = self.alloc_queue(&mut batch);
        (id, batch)
    }

    /// Cluster: this node no longer holds durable id `id`'s queue (another node was promoted).
    /// Drops it without recording an expiry; returns the batch and the attached session, which
    /// the driver disconnects.
    pub fn depose(&mut self, id: &str) -> (Batch, Option<SessionId>) {
        let mut batch = Batch::new();
        let Some(&qid) = self.durable.get(id) else {
            return (batch, None);
        };
        let session = self.attached_session(qid);
        if let Some(s) = session {
            self.sessions.remove(&s);
        }
        self.drop_queue(qid, &mut batch);
        (batch, session)
    }

    /// Cluster rebalancing: durable id `id`'s queue, away, is about to be handed over to another
    /// node; until [`end_handover`](Self::end_handover) (or its deposition) no client attaches
    /// and no admin closes it. False if there is no such queue, its client is attached, it is
    /// moving already, or its client's last ack is not stored yet: copies are shipped the
    /// stored ack, and the taker must hold every ack the client made (it would send those
    /// events again). A later round finds it stored.
    pub fn begin_handover(&mut self, id: &str) -> bool {
        let Some(q) = self.durable.get(id).and_then(|q| self.queues.get_mut(q)) else {
            return false;
        };
        if q.moving || !matches!(q.state, QueueState::Away { .. }) || q.acked_stored < q.acked {
            return false;
        }
        q.moving = true;
        true
    }

    /// The handover of `id` did not happen: clients may attach again.
    pub fn end_handover(&mut self, id: &str) {
        if let Some(q) = self.durable.get(id).and_then(|q| self.queues.get_mut(q)) {
            q.moving = false;
        }
    }

    /// Caps delivery of every queue at what is acknowledged (a clustered node at start, until
    /// it knows which queues have copies).
    pub fn cap_all_queues(&mut self) {
        for q in self.queues.values_mut() {
            q.deliver_cap = Some(q.acked);
        }
    }

    /// Every durable queue here: (durable id, primary epoch).
    pub fn durable_epochs(&self) -> Vec<(String, u64)> {
        self.durable
            .iter()
            .filter_map(|(id, q)| self.queues.get(q).map(|q| (id.clone(), q.epoch)))
            .collect()
    }

    /// The queue of durable id `id`, if it lives here.
    pub fn durable_queue(&self, id: &str) -> Option<&Queue> {
        self.durable
            .get(id)
            .and_then(|q| self.queues.get(q))
            .map(|q| &**q)
    }

    /// Sets the primary epoch of a queue just placed by the cluster (persisted in the batch).
    pub fn set_queue_epoch(&mut self, queue: QueueId, epoch: u64) -> Batch {
        let mut batch = Batch::new();
        if let Some(q) = self.queues.get_mut(&queue)
            && q.epoch != epoch
        {
            q.epoch = epoch;
            q.persist_info(&mut batch);
        }
        batch
    }

    /// Caps delivery of a queue (see [`Queue::deliver_cap`]). Returns the attached session when
    /// the cap rose, for the driver to wake.
    pub fn set_deliver_cap(&mut self, queue: QueueId, cap: Option<Offset>) -> Option<SessionId> {
        let q = self.queues.get_mut(&queue)?;
        let rose = match (q.deliver_cap, cap) {
            (Some(old), Some(new)) => new > old,
            (Some(_), None) => true,
            _ => false,
        };
        q.deliver_cap = cap;
        if rose {
            self.attached_session(queue)
        } else {
            None
        }
    }

    pub fn node_id(&self) -> &str {
        &self.node_id
    }

    /// Applies operator limits (`[limits]`); the defaults come from `crate::limits`.
    pub fn with_limits(mut self, limits: Limits) -> Self {
        self.limits = limits;
        self
    }

    pub fn limits(&self) -> &Limits {
        &self.limits
    }

    /// Records that durable id `id` expired on another node of the cluster (so its next
    /// connection here reports `expired` once), unless a queue with that id lives here.
    pub fn note_expired_elsewhere(&mut self, id: &str, owner: Option<&str>) -> Batch {
        let mut batch = Batch::new();
        if !self.durable.contains_key(id) {
            self.remember_expired(id.to_string(), owner.map(str::to_string));
            self.persist_expired(&mut batch);
        }
        batch
    }

    /// The owner of expired id `id`, if it is remembered and had one.
    pub fn expired_owner(&self, id: &str) -> Option<&str> {
        self.expired_owner.get(id)?.as_deref()
    }

    fn remember_expired(&mut self, id: String, owner: Option<String>) {
        match self.expired_owner.get_mut(&id) {
            Some(known) => {
                if owner.is_some() {
                    *known = owner;
                }
            }
            None => {
                self.expired_owner.insert(id.clone(), owner);
                self.expired.push_back(id);
                while self.expired.len() > EXPIRED_IDS_REMEMBERED_MAX {
                    if let Some(old) = self.expired.pop_front() {
                        self.expired_owner.remove(&old);
                    }
                }
            }
        }
    }

    fn persist_expired(&self, batch: &mut Batch) {
        let ids: Vec<ExpiredId> = self
            .expired
            .iter()
            .map(|id| match &self.expired_owner[id] {
                Some(owner) => ExpiredId::Owned {
                    id: id.clone(),
                    owner: owner.clone(),
                },
                None => ExpiredId::Id(id.clone()),
            })
            .collect();
        batch.state_put(STATE_EXPIRED_IDS, encode_body(&ids).expect("ids encode"));
    }

    fn alloc_session(&mut self, batch: &mut Batch) -> SessionId {
        let id = self.next_session_id;
        self.next_session_id += 1;
        batch.state_put(
            STATE_NEXT_SESSION_ID,
            self.next_session_id.to_be_bytes().to_vec(),
        );
        id
    }

    fn alloc_queue(&mut self, batch: &mut Batch) -> QueueId {
        let id = self.next_queue_id;
        self.next_queue_id += 1;
        batch.state_put(
            STATE_NEXT_QUEUE_ID,
            self.next_queue_id.to_be_bytes().to_vec(),
        );
        id
    }

    /// A new connection presents its hello. Durable: resumes the away queue of that id, or
    /// creates one (`new`, or `expired` once if the id's queue timed out). Non-durable: a
    /// queue for this session only.
    pub fn connect(&mut self, durable: Option<&DurableHello>) -> Result<Connected, ConnectError> {
        self.connect_as(durable, None)
    }

    /// [`connect`](Self::connect) for an authenticated `principal`: a durable id whose queue
    /// another principal created is refused with `forbidden`; a new queue belongs to
    /// `principal`.
    pub fn connect_as(
        &mut self,
        durable: Option<&DurableHello>,
        principal: Option<&str>,
    ) -> Result<Connected, ConnectError> {
        let mut batch = Batch::new();
        let Some(hello) = durable else {
            // A non-durable client gets its queue with its first interest (publishers and admin
            // connections never hold one).
            let session = self.alloc_session(&mut batch);
            // A non-durable client has nothing to replay: it is ready from the start.
            let cursor = Some(Cursor::new(0, 0, 0));
            let mut s = Session::new(session, NO_QUEUE, false, cursor);
            s.principal = principal.map(str::to_string);
            self.sessions.insert(session, s);
            return Ok(Connected {
                session,
                status: QueueStatus::None,
                pending: None,
                batch,
            });
        };
        validate_durable_hello(hello).map_err(ConnectError::Invalid)?;
        if let Some(&qid) = self.durable.get(&hello.id) {
            let q = self
                .queues
                .get_mut(&qid)
                .expect("durable map points at a queue");
            if q.owner
                .as_deref()
                .is_some_and(|owner| Some(owner) != principal)
            {
                return Err(ConnectError::Invalid(not_yours(&hello.id)));
            }
            if let QueueState::Attached(holder) = q.state {
                return Err(ConnectError::Attached(holder));
            }
            if q.moving {
                return Err(ConnectError::Invalid(WireError::new(
                    ErrorCode::Unavailable,
                    format!(
                        "durable queue {:?} is moving to another node; retry",
                        hello.id
                    ),
                )));
            }
            let session = self.alloc_session(&mut batch);
            let q = self.queues.get_mut(&qid).expect("queue");
            if q.owner.is_none() && principal.is_some() {
                // Created while the node was open: the first principal to resume it owns it.
                q.owner = principal.map(str::to_string);
                if let Some(owner) = principal {
                    self.index.owner_gained(owner, q.interests.keys());
                }
            }
            q.timeout_secs = hello.timeout_secs; // the latest presented timeout wins
            q.state = QueueState::Attached(session);
            q.persist_info(&mut batch);
            let pending = q.pending();
            self.sessions
                .insert(session, Session::new(session, qid, true, None));
            return Ok(Connected {
                session,
                status: QueueStatus::Resumed,
                pending: Some(pending),
                batch,
            });
        }
        if let Some(Some(owner)) = self.expired_owner.get(&hello.id)
            && Some(owner.as_str()) != principal
        {
            // Nor may another principal learn that it expired.
            return Err(ConnectError::Invalid(not_yours(&hello.id)));
        }
        let status = if self.expired_owner.remove(&hello.id).is_some() {
            self.expired.retain(|id| id != &hello.id);
            self.persist_expired(&mut batch);
            QueueStatus::Expired
        } else {
            QueueStatus::New
        };
        let session = self.alloc_session(&mut batch);
        let qid = self.create_queue(
            Some(hello.id.clone()),
            principal,
            hello.timeout_secs,
            session,
            &mut batch,
        );
        self.durable.insert(hello.id.clone(), qid);
        self.sessions
            .insert(session, Session::new(session, qid, true, None));
        Ok(Connected {
            session,
            status,
            pending: None,
            batch,
        })
    }

    fn create_queue(
        &mut self,
        durable_id: Option<String>,
        owner: Option<&str>,
        timeout_secs: u64,
        session: SessionId,
        batch: &mut Batch,
    ) -> QueueId {
        let id = self.alloc_queue(batch);
        let incarnation = {
            use std::hash::{Hash, Hasher};
            let mut h = std::hash::DefaultHasher::new();
            (&self.node_id, self.started_ms, id).hash(&mut h);
            h.finish().max(1)
        };
        let mut q = Queue {
            id,
            durable_id,
            owner: owner.map(str::to_string),
            timeout_secs,
            acked: 0,
            acked_stored: 0,
            end: 0,
            visible_end: 0,
            delivered: 0,
            delivered_stored: 0,
            epoch: 1,
            interests: Interests::new(),
            state: QueueState::Attached(session),
            checkpoints: VecDeque::new(),
            deliver_cap: None,
            prior_runs: Vec::new(),
            promoted_at: 0,
            incarnation,
            bytes: QueueBytes::default(),
            seen: None,
            held_through: None,
            moving: false,
            info_generation: 0,
            rates: Default::default(),
        };
        q.persist_info(batch);
        self.queues.insert(id, Box::new(q));
        id
    }

    /// A session that only publishes (the embedding API): no queue.
    pub fn publisher_session(&mut self) -> (SessionId, Batch) {
        let mut batch = Batch::new();
        let id = self.alloc_session(&mut batch);
        self.sessions
            .insert(id, Session::new(id, NO_QUEUE, false, None));
        (id, batch)
    }

    pub fn session(&self, id: SessionId) -> Option<&Session> {
        self.sessions.get(&id)
    }

    /// Whether this node holds no queue at all (durable or not).
    pub fn holds_no_queue(&self) -> bool {
        self.queues.is_empty()
    }

    pub fn queue(&self, id: QueueId) -> Option<&Queue> {
        self.queues.get(&id).map(|q| &**q)
    }

    /// The matcher of `region`'s interest regexes (none when it has none), for matching
    /// publish keys outside the core lock ([`Prematch`], [`NodeCore::publish_within`]).
    pub fn regex_matcher(&self, region: &str) -> Option<Arc<RegexMatcher>> {
        self.index.regex_matcher(region)
    }

    /// Registers interest. Returns the normalised selectors (for the initial image) and the
    /// metadata write when durable interest changed. Idempotent.
    pub fn register(
        &mut self,
        session: SessionId,
        region: &str,
        spec: &InterestSpec,
        durable: bool,
        receive_values: bool,
    ) -> Result<(Vec<Selector>, Batch), WireError> {
        validate_region(region)?;
        let (selectors, mut compiled) = Selector::from_spec_compiled(spec)?;
        let (is_durable, qid) = match self.sessions.get(&session) {
            Some(s) => (s.durable, s.queue),
            None => return Err(WireError::new(ErrorCode::NotFound, "no such session")),
        };
        if durable && !is_durable {
            return Err(WireError::new(
                ErrorCode::InvalidArgument,
                "durable interest is only for durable clients (connect with a durable id)",
            ));
        }
        let mut batch = Batch::new();
        if qid == NO_QUEUE {
            let principal = self.sessions[&session].principal.clone();
            let q = self.create_queue(None, principal.as_deref(), 0, session, &mut batch);
            self.sessions
                .get_mut(&session)
                .expect("checked above")
                .queue = q;
        }
        let (s, q) = session_queue(&mut self.sessions, &mut self.queues, session)?;
        // The selectors not registered yet: what counts against the queue's limits.
        let fresh: Vec<&Selector> = selectors
            .iter()
            .filter(|sel| {
                !q.interests
                    .contains_key(&(region.to_string(), (*sel).clone()))
            })
            .collect();
        let new = fresh.len();
        if q.interests.len() + new > INTERESTS_PER_QUEUE_MAX {
            return Err(WireError::new(
                ErrorCode::LimitExceeded,
                format!(
                    "a queue may hold at most {INTERESTS_PER_QUEUE_MAX} interest registrations"
                ),
            ));
        }
        let held: usize = q
            .interests
            .keys()
            .map(|(r, sel)| interest_bytes(r, sel))
            .sum();
        let added: usize = fresh.iter().map(|sel| interest_bytes(region, sel)).sum();
        if held + added > INTEREST_BYTES_PER_QUEUE_MAX {
            return Err(WireError::new(
                ErrorCode::LimitExceeded,
                format!(
                    "a queue may hold at most {INTEREST_BYTES_PER_QUEUE_MAX} bytes of interest ({held} held, {added} more asked)"
                ),
            ));
        }
        let new_regexes = fresh
            .iter()
            .filter(|sel| matches!(sel, Selector::Regex(src) if !self.index.has_regex(region, src)))
            .count();
        let regexes = self.index.regex_count(region);
        if new_regexes > 0 && regexes + new_regexes > REGEXES_PER_REGION_MAX {
            return Err(WireError::new(
                ErrorCode::LimitExceeded,
                format!(
                    "region {region:?} holds {regexes} distinct interest regexes, the most a region may hold ({REGEXES_PER_REGION_MAX}): register one of those, or keys"
                ),
            ));
        }
        if let Some(owner) = &q.owner {
            let fresh_regexes = fresh.iter().filter_map(|sel| match sel {
                Selector::Regex(src) => Some(src.as_str()),
                _ => None,
            });
            self.index
                .regex_room(owner, region, fresh_regexes)
                .map_err(WireError::from)?;
        }
        let mut durable_changed = false;
        let reg = Registration {
            durable,
            receive_values,
        };
        for sel in &selectors {
            let old = q.interests.insert((region.to_string(), sel.clone()), reg);
            durable_changed |= (durable || old.is_some_and(|o| o.durable)) && old != Some(reg);
            let owner = q.owner.as_deref();
            self.index
                .insert_owned(region, sel, q.id, receive_values, owner, compiled.take());
        }
        if let Some(c) = s.cursor.as_mut() {
            c.live_check = true;
        }
        if durable_changed {
            q.persist_info(&mut batch);
        }
        Ok((selectors, batch))
    }

    /// Removes interest; `Ok(false)` when nothing was registered.
    pub fn unregister(
        &mut self,
        session: SessionId,
        region: &str,
        spec: &InterestSpec,
    ) -> Result<(bool, Batch), WireError> {
        validate_region(region)?;
        let selectors = Selector::from_spec(spec).map_err(WireError::from)?;
        if self
            .sessions
            .get(&session)
            .is_some_and(|s| s.queue == NO_QUEUE)
        {
            return Ok((false, Batch::new()));
        }
        let (_, q) = session_queue(&mut self.sessions, &mut self.queues, session)?;
        let mut removed = false;
        let mut durable_changed = false;
        for sel in &selectors {
            if let Some(reg) = q.interests.remove(&(region.to_string(), sel.clone())) {
                removed = true;
                durable_changed |= reg.durable;
                self.index
                    .remove_owned(region, sel, q.id, q.owner.as_deref());
            }
        }
        let mut batch = Batch::new();
        if durable_changed {
            q.persist_info(&mut batch);
        }
        Ok((removed, batch))
    }

    /// The client is ready: everything queued so far is replayed, then the live marker.
    pub fn ready(&mut self, session: SessionId) -> Result<Offset, WireError> {
        if let Some(c) = self.sessions.get(&session).and_then(|s| s.cursor.as_ref()) {
            return Ok(c.replay_end); // ready twice, or a non-durable client: harmless
        }
        let (s, q) = session_queue(&mut self.sessions, &mut self.queues, session)?;
        if let Some(c) = &s.cursor {
            return Ok(c.replay_end); // ready twice is harmless
        }
        let cursor = Cursor::new(q.acked, q.end, q.delivered);
        let end = q.end;
        s.cursor = Some(cursor);
        Ok(end)
    }

    /// Turns publish operations into events, appends them to every matching queue and updates
    /// the region store. `exists(region, key)` reads the committed region store (an error, such
    /// as a failed read, refuses the publish with it); keys written by uncommitted plans are
    /// tracked here. Every op is validated, every key's existence read and every full queue
    /// found before anything takes effect, so a refused publish changes nothing.
    pub fn publish(
        &mut self,
        now_ms: u64,
        session: SessionId,
        ops: &[PublishOp],
        exists: &mut dyn FnMut(&str, &str) -> Result<bool, WireError>,
    ) -> Result<PublishPlan, WireError> {
        self.publish_from(now_ms, session, ops, None, exists)
    }

    /// [`NodeCore::publish`] of operations first published on another node: the events keep
    /// the ids `origin` gives them.
    pub fn publish_from(
        &mut self,
        now_ms: u64,
        session: SessionId,
        ops: &[PublishOp],
        origin: Option<&EventOrigin>,
        exists: &mut dyn FnMut(&str, &str) -> Result<bool, WireError>,
    ) -> Result<PublishPlan, WireError> {
        self.publish_within(now_ms, session, ops, origin, &[], exists, &mut |_| true)
            .map_err(|refused| match refused {
                PublishRefused::Error(e) => e,
                PublishRefused::NoRoom { .. } => unreachable!("room is always made"),
            })
    }

    /// [`NodeCore::publish_from`] that first asks `room(bytes)` whether the caller can hold
    /// the bytes the publish would add to its queues (an upper bound, counted once per
    /// matching queue: the write's fan-out). `false` refuses it with
    /// [`PublishRefused::NoRoom`] before anything takes effect; a publish that would add more
    /// than [`PUBLISH_FANOUT_BYTES_MAX`] is refused with `limit-exceeded` without asking.
    /// `pre[i]`, when given, holds op i's regex matches found outside the core lock
    /// ([`Prematch`]); the plan counts the ops whose regexes were matched here instead
    /// ([`PublishPlan::regexes_matched_here`]).
    #[allow(clippy::too_many_arguments)]
    pub fn publish_within(
        &mut self,
        now_ms: u64,
        session: SessionId,
        ops: &[PublishOp],
        origin: Option<&EventOrigin>,
        pre: &[Option<Prematch>],
        exists: &mut dyn FnMut(&str, &str) -> Result<bool, WireError>,
        room: &mut dyn FnMut(u64) -> bool,
    ) -> Result<PublishPlan, PublishRefused> {
        if ops.len() > PUBLISH_OPS_PER_REQUEST_MAX {
            return Err(WireError::new(
                ErrorCode::LimitExceeded,
                format!("a publish may carry at most {PUBLISH_OPS_PER_REQUEST_MAX} operations"),
            )
            .into());
        }
        for op in ops {
            if let PublishOp::Put { value, .. } = op
                && value.len() > VALUE_BYTES_MAX
            {
                return Err(WireError::new(
                    ErrorCode::LimitExceeded,
                    format!(
                        "value of {} bytes exceeds the limit of {VALUE_BYTES_MAX} bytes",
                        value.len()
                    ),
                )
                .into());
            }
            let (region, key) = op_target(op);
            validate_region(region)?;
            validate_key(key).map_err(WireError::from)?;
        }
        if !self.sessions.contains_key(&session) {
            return Err(WireError::new(ErrorCode::NotFound, "no such session").into());
        }
        // Room for this publish's keys; forgotten before they are looked up (pass 2 reads
        // what pass 0 found in the overlay).
        let keys_bytes: usize = ops
            .iter()
            .map(|op| {
                let (region, key) = op_target(op);
                known_key_bytes(region, key)
            })
            .sum();
        if self.overlay_bytes + keys_bytes > KNOWN_REGION_KEYS_BYTES_MAX {
            self.forget_region_keys();
        }
        // Each op's (region, key), and whether the key exists in the committed region store
        // (None: in the overlay, written by a plan of this core), read before anything takes
        // effect. Pass 2 takes the keys from here.
        let mut targets = Vec::with_capacity(ops.len());
        for op in ops {
            let (region, key) = op_target(op);
            let target = (region.to_string(), key.to_string());
            let existed = if self.overlay.contains_key(&target) {
                None
            } else {
                Some(exists(region, key)?)
            };
            targets.push((target, existed));
        }
        // Pass 1: match every op, and count the entries each queue would receive.
        let mut scratch = std::mem::take(&mut self.scratch);
        let mut matches = std::mem::take(&mut self.match_scratch);
        matches.clear();
        // Per queue: entries and (an upper bound of) bytes the publish would add.
        let mut growth: BTreeMap<QueueId, (u64, u64)> = BTreeMap::new();
        let mut regexes_matched_here = 0;
        let node = origin.map_or(self.node_id.as_str(), |o| o.node.as_str());
        for (i, op) in ops.iter().enumerate() {
            let (region, key) = op_target(op);
            let value_bytes = match op {
                PublishOp::Put { value, .. } => value.len(),
                _ => 0,
            };
            let op_bytes = event_bytes_max(node, region, key, value_bytes);
            let pre = pre.get(i).and_then(Option::as_ref);
            if self.index.matches_with(region, key, pre, &mut scratch) {
                regexes_matched_here += 1;
            }
            for (&q, &values) in scratch.iter() {
                if let Some(o) = origin
                    && self.queues.get(&q).is_some_and(|q| {
                        q.holds(&o.node, o.session, o.first_seq + i as u64, o.offset)
                    })
                {
                    continue; // Appended by a failed primary before this node took over.
                }
                matches.push((i, q, values));
                let g = growth.entry(q).or_default();
                g.0 += 1;
                g.1 += op_bytes;
            }
        }
        self.scratch = scratch;
        let fanout_bytes: u64 = growth.values().map(|&(_, b)| b).sum();
        if fanout_bytes > PUBLISH_FANOUT_BYTES_MAX as u64 {
            self.match_scratch = matches;
            return Err(WireError::new(
                ErrorCode::LimitExceeded,
                format!(
                    "this publish would add up to {fanout_bytes} bytes to its {} queues, more than one publish may write ({PUBLISH_FANOUT_BYTES_MAX}); nothing was published: publish fewer or smaller operations at a time",
                    growth.len()
                ),
            )
            .into());
        }
        if !room(fanout_bytes) {
            self.match_scratch = matches;
            return Err(PublishRefused::NoRoom { fanout_bytes });
        }
        let (max, max_bytes) = (self.limits.queue_entries_max, self.limits.queue_bytes_max);
        let full: Vec<QueueId> = growth
            .iter()
            .filter(|(q, (n, b))| {
                self.queues.get(q).is_some_and(|q| {
                    q.pending() + n > max || q.pending_bytes().saturating_add(*b) > max_bytes
                })
            })
            .map(|(q, _)| *q)
            .collect();
        let mut plan = PublishPlan {
            regexes_matched_here,
            ..PublishPlan::default()
        };
        if let Some(&first) = full.first() {
            if self.limits.queue_full_policy != QueueFullPolicy::DropQueue {
                self.match_scratch = matches;
                let q = &self.queues[&first];
                let who = q.durable_id.as_deref().unwrap_or("a non-durable client");
                let limit = if q.pending() + growth[&first].0 > max {
                    format!("{max} entries")
                } else {
                    format!("{max_bytes} bytes")
                };
                return Err(WireError::new(
                    ErrorCode::QueueFull,
                    format!("the queue of {who} is full ({limit}); nothing was published"),
                )
                .into());
            }
            for qid in full {
                if let Some(s) = self.attached_session(qid) {
                    plan.dropped_sessions.push(s);
                }
                let q = &self.queues[&qid];
                if let Some(id) = q.durable_id.clone() {
                    let owner = q.owner.clone();
                    self.remember_expired(id, owner);
                }
                self.drop_queue(qid, &mut plan.batch);
                plan.dropped_queues += 1;
            }
            self.persist_expired(&mut plan.batch);
        }
        // Pass 2: events, region store, appends.
        let interval = bytes::mark_interval_bytes(max_bytes);
        self.write_seq += 1;
        let seq = self.write_seq;
        plan.seq = seq;
        let mut last: BTreeMap<QueueId, Offset> = BTreeMap::new();
        let mut m = 0;
        for (i, op) in ops.iter().enumerate() {
            let (region, key, kind, value) = match op {
                PublishOp::Put { region, key, value } => (region, key, None, Some(value)),
                PublishOp::Destroy { region, key } => (region, key, Some(EventOp::Destroy), None),
                PublishOp::Invalidate { region, key } => {
                    (region, key, Some(EventOp::Invalidate), None)
                }
            };
            let (ok, existed_before) = std::mem::take(&mut targets[i]);
            let existed = match self.overlay.get(&ok) {
                Some(&(e, _)) => e,
                None => existed_before.unwrap_or(false),
            };
            let event_op = match kind {
                None if existed => EventOp::Update,
                None => EventOp::Create,
                Some(k) => k,
            };
            match event_op {
                EventOp::Create | EventOp::Update => {
                    plan.batch.region_put(
                        region,
                        key,
                        encode_region_value(value.map(Vec::as_slice)),
                    );
                    overlay_put(&mut self.overlay, &mut self.overlay_bytes, ok, (true, seq));
                }
                EventOp::Destroy => {
                    plan.batch.region_delete(region, key);
                    overlay_put(&mut self.overlay, &mut self.overlay_bytes, ok, (false, seq));
                }
                EventOp::Invalidate => {
                    // An existing key stays, its value gone until the next put; an absent key
                    // stays absent (the event is still published, like a destroy of one).
                    if existed {
                        plan.batch
                            .region_put(region, key, encode_region_value(None));
                    }
                    overlay_put(
                        &mut self.overlay,
                        &mut self.overlay_bytes,
                        ok,
                        (existed, seq),
                    );
                }
            }
            let id = match origin {
                Some(o) => EventId {
                    node: o.node.clone(),
                    session: o.session,
                    seq: o.first_seq + i as u64,
                },
                None => {
                    let s = self.sessions.get_mut(&session).expect("checked above");
                    let id = EventId {
                        node: self.node_id.clone(),
                        session,
                        seq: s.next_seq,
                    };
                    s.next_seq += 1;
                    id
                }
            };
            if plan.first_id.is_none() {
                plan.first_id = Some(id.clone());
            }
            plan.event_ops.push(event_op);
            let (record, body) = encode_event(id, region, key, event_op, value);
            while m < matches.len() && matches[m].0 == i {
                let (_, qid, wants_values) = matches[m];
                m += 1;
                // A queue dropped above (drop-queue policy) is gone.
                let Some(q) = self.queues.get_mut(&qid) else {
                    continue;
                };
                let off = q.append_event(
                    &body,
                    &record.id,
                    wants_values,
                    (now_ms, interval),
                    &mut plan.batch,
                );
                last.insert(qid, off);
                plan.enqueued += 1;
            }
            plan.count += 1;
        }
        self.match_scratch = matches;
        plan.appended = last.into_iter().collect();
        Ok(plan)
    }

    /// A plan's batch is committed: its entries become visible to delivery.
    pub fn committed(&mut self, seq: u64, appended: &[(QueueId, Offset)]) {
        for &(qid, off) in appended {
            if let Some(q) = self.queues.get_mut(&qid) {
                q.visible_end = q.visible_end.max(off);
            }
        }
        self.committed_seq = self.committed_seq.max(seq);
    }

    /// Forgets which region keys exist but for those written by plans not committed yet (the
    /// regions were written outside this core's plans: a join's copy of another member's
    /// regions).
    pub fn forget_region_keys(&mut self) {
        let committed = self.committed_seq;
        self.overlay.retain(|_, (_, s)| *s > committed);
        self.overlay_bytes = self
            .overlay
            .keys()
            .map(|(r, k)| known_key_bytes(r, k))
            .sum();
    }

    /// An ack batch of `queue` (from [`ack`](Self::ack)) through `offset` is committed.
    pub fn ack_stored(&mut self, queue: QueueId, offset: Offset) {
        if let Some(q) = self.queues.get_mut(&queue) {
            q.acked_stored = q.acked_stored.max(offset.min(q.acked));
        }
    }

    /// The session attached to a queue, if any.
    pub fn attached_session(&self, queue: QueueId) -> Option<SessionId> {
        match self.queues.get(&queue)?.state {
            QueueState::Attached(s) => Some(s),
            QueueState::Away { .. } => None,
        }
    }

    /// Next delivery step of a session (Idle before ready or for publisher sessions).
    pub fn delivery_step(&mut self, session: SessionId) -> Step {
        let Some(s) = self.sessions.get_mut(&session) else {
            return Step::Idle;
        };
        let Some(q) = self.queues.get(&s.queue) else {
            return Step::Idle;
        };
        let Some(c) = s.cursor.as_mut() else {
            return Step::Idle;
        };
        c.step(
            q.deliver_cap
                .map_or(q.visible_end, |cap| cap.min(q.visible_end)),
            q.acked,
            self.limits.inflight_events_max,
            || q.regions(),
        )
    }

    /// Sets the rate at which this session's replay is sent, in events per second (0:
    /// unlimited); live events are never paced.
    pub fn set_replay_rate(
        &mut self,
        session: SessionId,
        events_per_s: u64,
    ) -> Result<(), WireError> {
        let s = self
            .sessions
            .get_mut(&session)
            .ok_or_else(|| WireError::new(ErrorCode::NotFound, "no such session"))?;
        s.replay_events_per_s = events_per_s;
        Ok(())
    }

    /// The replay rate of a session (0: unlimited).
    pub fn replay_rate(&self, session: SessionId) -> u64 {
        self.sessions
            .get(&session)
            .map_or(0, |s| s.replay_events_per_s)
    }

    /// The wire-flag bounds of a ready session.
    pub fn flag_bounds(&self, session: SessionId) -> Option<FlagBounds> {
        self.sessions
            .get(&session)
            .and_then(|s| s.cursor.as_ref())
            .map(Cursor::bounds)
    }

    /// Where a just resumed session's queue stands: `(queue, acked, visible end)`, to read the
    /// entry its client says it saw (see [`client_seen`](Self::client_seen)).
    pub fn resumed_queue(&self, session: SessionId) -> Option<(QueueId, Offset, Offset)> {
        let s = self.sessions.get(&session)?;
        let q = self.queues.get(&s.queue)?;
        Some((q.id, q.acked, q.visible_end))
    }

    /// The client of a resumed (not yet ready) session saw the queue's entry at `offset`
    /// (defence in depth against a queue that lost entries, issue 22 point 9). `same_event`:
    /// whether the entry stored at `offset` carries the event id the client saw (None: not
    /// checked). Raises the session's `possible_duplicate` bound to cover what the client saw,
    /// or every entry when the queue diverged; returns the verdict and the write of the raised
    /// delivered mark.
    pub fn client_seen(
        &mut self,
        session: SessionId,
        offset: Offset,
        same_event: Option<bool>,
    ) -> Option<(SeenVerdict, Option<Batch>)> {
        let s = self.sessions.get(&session)?;
        if s.cursor.is_some() {
            return None; // ready already: its flags are fixed
        }
        let q = self.queues.get_mut(&s.queue)?;
        let (verdict, bound) = if offset > q.end || same_event == Some(false) {
            (SeenVerdict::Diverged, q.end)
        } else if offset > q.delivered {
            (SeenVerdict::FlagsRaised, offset)
        } else {
            (SeenVerdict::Consistent, offset)
        };
        q.delivered = q.delivered.max(bound);
        let batch = (q.delivered > q.delivered_stored).then(|| {
            q.delivered_stored = q.delivered;
            let mut b = Batch::new();
            b.set_delivered(q.id, q.delivered);
            b
        });
        Some((verdict, batch))
    }

    /// Offsets up to `last` are about to be written to the wire. Returns the write that moves
    /// the queue's stored delivered mark past them, when the mark reserved earlier does not
    /// cover them: it must be durable (synced) before the bytes reach the wire, so a node
    /// restarted after a crash or a power cut still flags them `possible_duplicate`. The mark
    /// is reserved [`DELIVERED_MARK_RESERVE_ENTRIES`] past the queue's end, so one synced write
    /// covers a whole replay and many live frames.
    pub fn will_send(&mut self, session: SessionId, last: Offset) -> Option<Batch> {
        let s = self.sessions.get_mut(&session)?;
        let c = s.cursor.as_mut()?;
        c.sent(last);
        s.sent = s.sent.max(last);
        let q = self.queues.get_mut(&s.queue)?;
        q.delivered = q.delivered.max(last);
        if last <= q.delivered_stored {
            return None;
        }
        q.delivered_stored = last
            .max(q.end)
            .saturating_add(DELIVERED_MARK_RESERVE_ENTRIES);
        let mut b = Batch::new();
        b.set_delivered(q.id, q.delivered_stored);
        Some(b)
    }

    /// A cumulative ack. Acks beyond what this session was sent are a protocol violation.
    pub fn ack(&mut self, session: SessionId, offset: Offset) -> Result<Option<Batch>, WireError> {
        let sent = self.sessions.get(&session).map_or(0, |s| s.sent);
        if offset > sent {
            return Err(WireError::new(
                ErrorCode::ProtocolViolation,
                format!("ack of offset {offset} beyond the last delivered offset {sent}"),
            ));
        }
        if offset == 0 {
            return Ok(None);
        }
        let (_, q) = session_queue(&mut self.sessions, &mut self.queues, session)?;
        if offset <= q.acked {
            return Ok(None);
        }
        q.acked = offset;
        q.note_ack();
        q.bytes.ack(offset, offset >= q.end);
        let mut b = Batch::new();
        b.set_acked(q.id, offset);
        Ok(Some(b))
    }

    /// The session ended. `keepalive` is false only for an explicit close(drop); a crash or a
    /// lost connection keeps a durable queue. Non-durable queues always go.
    pub fn disconnect(&mut self, now_ms: u64, session: SessionId, keepalive: bool) -> Disconnected {
        let mut out = Disconnected::default();
        let Some(s) = self.sessions.remove(&session) else {
            return out;
        };
        let Some(q) = self.queues.get_mut(&s.queue) else {
            return out;
        };
        if q.state != QueueState::Attached(session) {
            return out;
        }
        if q.durable_id.is_none() || !keepalive {
            let qid = q.id;
            self.drop_queue(qid, &mut out.batch);
            out.queue_dropped = true;
            return out;
        }
        let gone: Vec<(String, Selector)> = q
            .interests
            .iter()
            .filter(|(_, r)| !r.durable)
            .map(|(k, _)| k.clone())
            .collect();
        for k in gone {
            q.interests.remove(&k);
            self.index
                .remove_owned(&k.0, &k.1, q.id, q.owner.as_deref());
        }
        q.state = QueueState::Away { since_ms: now_ms };
        q.persist_info(&mut out.batch);
        // Nothing more goes out: the mark reserved ahead comes back to what was sent, so
        // entries queued while the client is away are not flagged after a restart (unless a
        // power cut loses this write: then the reservation stands, which is conservative).
        if q.delivered_stored > q.delivered {
            q.delivered_stored = q.delivered;
            out.batch.set_delivered(q.id, q.delivered);
        }
        out
    }

    fn drop_queue(&mut self, qid: QueueId, batch: &mut Batch) {
        if let Some(q) = self.queues.remove(&qid) {
            for (region, sel) in q.interests.keys() {
                self.index
                    .remove_owned(region, sel, qid, q.owner.as_deref());
            }
            if let Some(id) = &q.durable_id {
                self.durable.remove(id);
            }
            batch.drop_queue(qid);
        }
    }

    /// Admin: destroys an away durable client's queue and interest.
    pub fn close_durable(&mut self, durable_id: &str) -> Result<Batch, WireError> {
        let &qid = self.durable.get(durable_id).ok_or_else(|| {
            WireError::new(
                ErrorCode::NotFound,
                format!("no durable client {durable_id:?}"),
            )
        })?;
        if let QueueState::Attached(_) = self.queues[&qid].state {
            return Err(WireError::new(
                ErrorCode::Refused,
                format!("durable client {durable_id:?} is connected; it must disconnect first"),
            ));
        }
        if self.queues[&qid].moving {
            return Err(WireError::new(
                ErrorCode::Unavailable,
                format!("durable client {durable_id:?} is moving to another node; retry there"),
            ));
        }
        let mut batch = Batch::new();
        self.drop_queue(qid, &mut batch);
        Ok(batch)
    }

    /// Expires away queues whose timeout has passed. Returns the batch and the expired ids.
    pub fn tick(&mut self, now_ms: u64) -> (Batch, Vec<String>) {
        let mut batch = Batch::new();
        let due: Vec<QueueId> = self
            .queues
            .values()
            .filter(|q| match q.state {
                QueueState::Away { since_ms } => {
                    now_ms >= since_ms.saturating_add(q.timeout_secs.saturating_mul(1000))
                }
                QueueState::Attached(_) => false,
            })
            .map(|q| q.id)
            .collect();
        let mut ids = Vec::new();
        for qid in due {
            let q = &self.queues[&qid];
            let id = q.durable_id.clone().expect("away queues are durable");
            let owner = q.owner.clone();
            self.drop_queue(qid, &mut batch);
            self.remember_expired(id.clone(), owner);
            ids.push(id);
        }
        if !ids.is_empty() {
            self.persist_expired(&mut batch);
        }
        (batch, ids)
    }

    /// `ready`, `connected` or `away`.
    fn state_name(&self, q: &Queue) -> &'static str {
        match q.state {
            QueueState::Away { .. } => "away",
            QueueState::Attached(s)
                if self.sessions.get(&s).is_some_and(|s| s.cursor.is_some()) =>
            {
                "ready"
            }
            QueueState::Attached(_) => "connected",
        }
    }

    /// Reports of every queue, ordered by queue id.
    pub fn queue_reports(&self) -> Vec<QueueReport> {
        let mut qs: Vec<&Queue> = self.queues.values().map(|q| &**q).collect();
        qs.sort_by_key(|q| q.id);
        qs.into_iter()
            .map(|q| QueueReport {
                durable_id: q.durable_id.clone(),
                state: self.state_name(q).to_string(),
                pending: q.pending(),
                pending_bytes: Some(q.pending_bytes()),
                acked_offset: q.acked,
                end_offset: q.end,
                timeout_secs: q.timeout_secs,
                role: "primary".to_string(),
                interests: q.interest_infos(),
                copies: Vec::new(),
                primary: None,
                ..Default::default()
            })
            .collect()
    }

    /// The admin view of every queue (primaries: this node's core holds no copies), in no
    /// particular order; `node` names this node in them.
    pub fn queue_views(&self, node: &str, now_ms: u64) -> Vec<crate::admin::QueueView> {
        self.queues
            .values()
            .map(|q| self.queue_view(q, node, now_ms))
            .collect()
    }

    /// What `/metrics` needs of the queues, without a view of each: the views of the `top`
    /// durable queues with the most pending events, and the sizes of all.
    pub fn lag_summary(
        &self,
        node: &str,
        top: usize,
        now_ms: u64,
    ) -> (Vec<crate::admin::QueueView>, crate::admin::QueueSizes) {
        let mut sizes = crate::admin::QueueSizes::default();
        let mut durable: Vec<(u64, &str, &Queue)> = Vec::new();
        for q in self.queues.values() {
            sizes.add(q.pending());
            if let Some(id) = &q.durable_id {
                durable.push((q.pending(), id, q));
            }
        }
        let order = |a: &(u64, &str, &Queue), b: &(u64, &str, &Queue)| {
            b.0.cmp(&a.0).then_with(|| a.1.cmp(b.1))
        };
        if top < durable.len() {
            if top > 0 {
                durable.select_nth_unstable_by(top, order);
            }
            durable.truncate(top);
        }
        durable.sort_by(order);
        let views = durable
            .into_iter()
            .map(|(_, _, q)| self.queue_view(q, node, now_ms))
            .collect();
        (views, sizes)
    }

    fn queue_view(&self, q: &Queue, node: &str, now_ms: u64) -> crate::admin::QueueView {
        let away_since_ms = match q.state {
            QueueState::Away { since_ms } => Some(since_ms),
            QueueState::Attached(_) => None,
        };
        let pending = q.pending();
        crate::admin::QueueView {
            id: q
                .durable_id
                .clone()
                .unwrap_or_else(|| format!("{node}:{}", q.id)),
            durable_id: q.durable_id.clone(),
            node: node.to_string(),
            role: "primary".into(),
            primary: Some(node.to_string()),
            state: self.state_name(q).into(),
            pending_events: pending,
            pending_bytes: Some(q.pending_bytes()),
            oldest_pending_age_ms: q.oldest_unacked_age_ms(now_ms),
            away_since_ms,
            expires_at_ms: away_since_ms
                .map(|s| s.saturating_add(q.timeout_secs.saturating_mul(1_000))),
            timeout_secs: q.timeout_secs,
            acked_offset: q.acked,
            end_offset: q.end,
            enqueue_rate: q.rates.enqueue_per_sec,
            delivery_rate: q.rates.delivery_per_sec,
            ack_rate: q.rates.ack_per_sec,
            drain_eta_secs: crate::admin::drain_eta_secs(
                pending,
                q.rates.ack_per_sec,
                q.rates.enqueue_per_sec,
            ),
            interests: q.interest_infos(),
            copies: Vec::new(),
        }
    }

    /// Samples every queue's rates (each at most once per
    /// [`crate::admin::RATE_SAMPLE_INTERVAL_MS`]).
    pub fn sample_rates(&mut self, now_ms: u64) {
        for q in self.queues.values_mut() {
            q.rates.sample(now_ms, q.end, q.delivered, q.acked);
        }
    }

    /// Queue counts for metrics.
    pub fn counts(&self, now_ms: u64) -> QueueCounts {
        let mut c = QueueCounts::default();
        for q in self.queues.values() {
            c.pending_total += q.pending();
            c.pending_bytes_total += q.pending_bytes();
            c.oldest_unacked_age_ms = c
                .oldest_unacked_age_ms
                .max(q.oldest_unacked_age_ms(now_ms).unwrap_or(0));
            match q.state {
                QueueState::Away { .. } => c.away += 1,
                QueueState::Attached(s) => {
                    if self.sessions.get(&s).is_some_and(|s| s.cursor.is_some()) {
                        c.ready += 1
                    } else {
                        c.attached += 1
                    }
                }
            }
        }
        c
    }

    /// Durable ids currently known (attached or away).
    pub fn durable_ids(&self) -> BTreeSet<String> {
        self.durable.keys().cloned().collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A node that lost its data directory and starts a new one under its name gives its
    /// publishers session ids past every one its old directory gave, restarts included: its
    /// new events never carry the ids of old ones (which a promoted copy would take for
    /// events it holds).
    #[test]
    fn a_new_data_directory_allocates_session_ids_past_a_lost_one() {
        use std::collections::HashMap;
        let state = |s: &HashMap<String, Vec<u8>>, k: &str| s.get(k).cloned();
        let created = IDS_EPOCH_MS + 86_400_000;
        let mut stored: HashMap<String, Vec<u8>> = HashMap::new();
        let mut highest = 0;
        // The old directory: three restarts a minute apart, a thousand sessions each.
        for restart in 0..3u64 {
            let (mut core, _) = NodeCore::recover(
                "n1",
                created + restart * 60_000,
                Vec::new(),
                |k| Ok(state(&stored, k)),
                |_, _, _| Ok(0),
            )
            .unwrap();
            for _ in 0..1_000 {
                let (id, batch) = core.publisher_session();
                assert!(id > highest, "ids only grow: {id} after {highest}");
                highest = id;
                for op in batch.ops() {
                    if let tether_storage::Op::StatePut { key, value } = op {
                        stored.insert(key.clone(), value.clone());
                    }
                }
            }
        }
        // Lost; a new directory five minutes after the old one was created.
        let (mut core, _) = NodeCore::recover(
            "n1",
            created + 300_000,
            Vec::new(),
            |_| Ok(None),
            |_, _, _| Ok(0),
        )
        .unwrap();
        let (id, _) = core.publisher_session();
        assert!(id > highest, "{id} > {highest}");
        assert!(id < 1 << 53);
        // A clock before the epoch (or a test's small times) starts at 1.
        assert_eq!(new_session_ids_start(10), 1);
    }

    /// A key this core wrote is known, committed or not: a publish to it does not read the
    /// store (a point read under the core lock) and still tells a create from an update.
    /// Past `KNOWN_REGION_KEYS_BYTES_MAX` the committed ones are forgotten (read again), those
    /// of plans not committed yet kept (the store does not show them: reading would take an
    /// update for a create); a join's copy of the regions forgets them the same way.
    #[test]
    fn keys_written_here_are_known_without_reading_the_store() {
        use std::collections::HashSet;
        let mut core = NodeCore::new("n1");
        let (p, _) = core.publisher_session();
        let put = |k: &str| PublishOp::Put {
            region: "R".into(),
            key: k.into(),
            value: b"v".to_vec(),
        };
        let destroy = |k: &str| PublishOp::Destroy {
            region: "R".into(),
            key: k.into(),
        };
        // The committed store, and the keys read from it.
        let mut stored: HashSet<String> = HashSet::new();
        let mut reads: Vec<String> = Vec::new();
        let publish = |core: &mut NodeCore,
                       stored: &HashSet<String>,
                       reads: &mut Vec<String>,
                       ops: &[PublishOp]| {
            core.publish(0, p, ops, &mut |_, k| {
                reads.push(k.to_string());
                Ok(stored.contains(k))
            })
            .unwrap()
        };
        let a1 = publish(&mut core, &stored, &mut reads, &[put("a")]);
        assert_eq!(
            (a1.event_ops.clone(), reads.clone()),
            (vec![EventOp::Create], vec!["a".into()])
        );
        let a2 = publish(&mut core, &stored, &mut reads, &[put("a")]);
        assert_eq!(
            a2.event_ops,
            [EventOp::Update],
            "written by a plan not committed"
        );
        core.committed(a1.seq, &[]);
        core.committed(a2.seq, &[]);
        stored.insert("a".into());
        let d = publish(&mut core, &stored, &mut reads, &[destroy("a")]);
        assert_eq!(d.event_ops, [EventOp::Destroy]);
        core.committed(d.seq, &[]);
        stored.remove("a");
        let a3 = publish(&mut core, &stored, &mut reads, &[put("a")]);
        assert_eq!(
            a3.event_ops,
            [EventOp::Create],
            "destroyed, then created again"
        );
        assert_eq!(reads, ["a"], "read once, when first written");
        core.committed(a3.seq, &[]);
        stored.insert("a".into());
        // A copy of another member's regions (a join): the keys are read again.
        core.forget_region_keys();
        let a4 = publish(&mut core, &stored, &mut reads, &[put("a")]);
        assert_eq!(a4.event_ops, [EventOp::Update]);
        assert_eq!(reads, ["a", "a"]);
        core.committed(a4.seq, &[]);
        // More keys than are remembered, committed, then one (`u`) whose plan is not
        // committed yet (plans commit in seq order: the writer commits in the order they
        // were submitted, under the lock).
        reads.clear();
        let per = PUBLISH_OPS_PER_REQUEST_MAX;
        let small = known_key_bytes("R", "a");
        let fill = (KNOWN_REGION_KEYS_BYTES_MAX - 2 * small) / known_key_bytes("R", "k0000000");
        for first in (0..fill).step_by(per) {
            let keys: Vec<String> = (first..fill.min(first + per))
                .map(|i| format!("k{i:07}"))
                .collect();
            let ops: Vec<PublishOp> = keys.iter().map(|k| put(k)).collect();
            let plan = publish(&mut core, &stored, &mut reads, &ops);
            core.committed(plan.seq, &[]);
            stored.extend(keys);
        }
        assert_eq!(reads.len(), fill, "new keys");
        let u = publish(&mut core, &stored, &mut reads, &[put("u")]);
        assert_eq!(core.overlay.len(), fill + 2, "a, k…, u: all remembered");
        reads.clear();
        let last = publish(&mut core, &stored, &mut reads, &[put("a"), put("u")]);
        assert_eq!(last.event_ops, [EventOp::Update, EventOp::Update]);
        assert_eq!(
            reads,
            ["a"],
            "forgotten as the keys ran over, unlike the uncommitted one"
        );
        assert_eq!(core.overlay.len(), 2);
        core.committed(u.seq, &[]);
        core.committed(last.seq, &[]);
    }

    fn put(key: &str) -> (PublishOp, EventOp) {
        let op = PublishOp::Put {
            region: "R".into(),
            key: key.into(),
            value: b"v".to_vec(),
        };
        (op, EventOp::Create)
    }

    fn forward(
        node: &str,
        session: u64,
        first_seq: u64,
        offset: u64,
        keys: &[&str],
    ) -> Arc<RecentForward> {
        Arc::new(RecentForward {
            origin: EventOrigin {
                node: node.into(),
                session,
                first_seq,
                offset,
            },
            ops: keys.iter().map(|k| put(k)).collect(),
        })
    }

    fn reg(receive_values: bool) -> Registration {
        Registration {
            durable: true,
            receive_values,
        }
    }

    #[test]
    fn a_queue_being_handed_over_takes_no_client_until_the_handover_ends() {
        let mut core = NodeCore::new("n1");
        let hello = DurableHello {
            redirect_epoch: None,
            id: "d".into(),
            timeout_secs: 60,
            redundancy: 1,
            failed_primary: None,
            seen: None,
        };
        let c = core.connect(Some(&hello)).unwrap();
        // Attached: not handed over.
        assert!(!core.begin_handover("d"));
        core.disconnect(5, c.session, true);
        assert!(!core.begin_handover("nobody"));
        assert!(core.begin_handover("d"));
        assert!(!core.begin_handover("d"), "moving once");
        match core.connect(Some(&hello)) {
            Err(ConnectError::Invalid(e)) => assert_eq!(e.code, ErrorCode::Unavailable),
            _ => panic!("a client attached to a moving queue"),
        }
        assert_eq!(
            core.close_durable("d").unwrap_err().code,
            ErrorCode::Unavailable
        );
        core.end_handover("d");
        let c = core.connect(Some(&hello)).unwrap();
        assert_eq!(c.status, QueueStatus::Resumed);
    }

    #[test]
    fn seen_is_cut_to_the_latest_sessions() {
        let mut seen = SeenEvents::new();
        for session in 1..=SEEN_SESSIONS_MAX as u64 {
            let node = if session % 2 == 0 { "a" } else { "b" };
            let id = EventId {
                node: node.into(),
                session,
                seq: 7,
            };
            note_seen(&mut seen, &id);
        }
        bound_seen(&mut seen);
        assert_eq!(
            seen.values().map(HashMap::len).sum::<usize>(),
            SEEN_SESSIONS_MAX
        );
        let id = EventId {
            node: "a".into(),
            session: SEEN_SESSIONS_MAX as u64 + 2,
            seq: 1,
        };
        note_seen(&mut seen, &id);
        bound_seen(&mut seen);
        let kept: Vec<u64> = seen.values().flat_map(|s| s.keys().copied()).collect();
        assert_eq!(kept.len(), SEEN_SESSIONS_MAX * 3 / 4);
        // The newest 3/4 stay: the new session and the highest of the first ones.
        let oldest_kept = SEEN_SESSIONS_MAX as u64 - (SEEN_SESSIONS_MAX * 3 / 4 - 2) as u64;
        assert_eq!(kept.iter().min(), Some(&oldest_kept));
        assert!(seen_holds(&seen, "a", SEEN_SESSIONS_MAX as u64 + 2, 1));
    }

    #[test]
    fn a_promoted_queue_still_knows_what_it_held_after_a_restart() {
        // A queue promoted here, as stored: the events its copy held (by publisher sequence
        // and by watermark).
        let info = QueueInfo {
            durable_id: Some("d".into()),
            timeout_secs: 60,
            away_since_ms: Some(1),
            interests: vec![("R".into(), Selector::All, reg(true))],
            owner: None,
            prior_runs: Vec::new(),
            promoted_at: 0,
            copy: None,
            copy_through: BTreeMap::from([("a".to_string(), 9)]),
            copy_seen: HashMap::from([("b".to_string(), HashMap::from([(7, 4)]))]),
            incarnation: 17,
        };
        let meta = QueueMeta {
            info: encode_body(&info).unwrap(),
            ..QueueMeta::default()
        };
        let (core, _) =
            NodeCore::recover("n1", 10, vec![(5, meta)], |_| Ok(None), |_, _, _| Ok(0)).unwrap();
        let q = core.queue(5).expect("restored");
        assert!(q.holds("a", 1, 1, 9), "covered by the stored watermark");
        assert!(!q.holds("a", 1, 1, 10));
        assert!(q.holds("b", 7, 4, 1), "held by the stored sequence");
        assert!(!q.holds("b", 7, 5, 1));
        assert!(!q.holds("b", 8, 1, 1));
        // Stored again with the queue's info, never shipped to its copies.
        assert_eq!(q.info().copy_through, info.copy_through);
        assert_eq!(q.info().copy_seen, info.copy_seen);
        assert!(q.info_for_copies().copy_through.is_empty());
        assert!(q.info_for_copies().copy_seen.is_empty());
        // A queue created here holds nothing of the kind.
        let plain = QueueInfo {
            copy_through: BTreeMap::new(),
            copy_seen: HashMap::new(),
            ..info
        };
        let meta = QueueMeta {
            info: encode_body(&plain).unwrap(),
            ..QueueMeta::default()
        };
        let (core, _) =
            NodeCore::recover("n1", 10, vec![(5, meta)], |_| Ok(None), |_, _, _| Ok(0)).unwrap();
        let q = core.queue(5).unwrap();
        assert!(q.seen.is_none() && q.held_through.is_none());
    }

    #[test]
    fn reapplied_events_are_the_matching_ones_not_held() {
        let interests = vec![
            ("R".to_string(), Selector::Key("k1".into()), reg(true)),
            ("R".to_string(), Selector::Regex("k[23]".into()), reg(false)),
            ("S".to_string(), Selector::All, reg(true)),
        ];
        let forwards = vec![
            // Covered by the watermark of origin "a".
            forward("a", 1, 1, 5, &["k1"]),
            // k1 wants values, k2 and k3 (regex) do not, k4 matches nothing.
            forward("a", 1, 2, 6, &["k1", "k2", "k3", "k4"]),
            // Session 7 of "b" was seen up to sequence 2.
            forward("b", 7, 1, 1, &["k1", "k2", "k3"]),
        ];
        let seen: SeenEvents = HashMap::from([("b".to_string(), HashMap::from([(7, 2)]))]);
        let through = BTreeMap::from([("a".to_string(), 5)]);
        let got: Vec<(String, u64, bool)> =
            events_to_reapply(&interests, &seen, &through, &forwards)
                .into_iter()
                .map(|e| (e.id.node, e.id.seq, e.wants_values))
                .collect();
        assert_eq!(
            got,
            vec![
                ("a".to_string(), 2, true),
                ("a".to_string(), 3, false),
                ("a".to_string(), 4, false),
                ("b".to_string(), 3, false),
            ]
        );
    }
}
