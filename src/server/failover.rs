//! Keeping each node's queues and copies in line with cluster metadata, and detecting failed
//! members.
//!
//! - The **detector** pings every member; the metadata leader proposes
//!   [`MetaCommand::NodeFailed`] for a member silent for `node-failure-ms` (default
//!   [`NODE_FAILURE_MS_DEFAULT`]), which promotes the first secondary of every queue the member
//!   was primary of and drops it from replica sets.
//! - **Client-managed failover** (Geode's model) is faster for an online client: a client that
//!   lost its primary connects to a secondary naming the lost node; the secondary pings it and,
//!   if it does not answer either, promotes itself through the metadata ([`client_failover`]).
//! - The **reconciler** looks at the applied metadata every [`RECONCILE_MS`]: a queue this node
//!   is primary of is shipped to its secondaries; a queue another node now holds at a higher
//!   epoch is deposed here (its client is disconnected and reconnects to the new primary); a
//!   copy this node was promoted for becomes a queue of the core; a copy this node no longer
//!   holds is dropped.
//!
//! Promotion is safe because delivery on the old primary was capped at what every secondary
//! held, and the lease (`shipping.rs`) keeps the two primaries from delivering at once.
//!
//! - Only a secondary that is not `syncing` (it holds everything the queue may have exposed)
//!   is promoted, by the leader's failure detector or at a client's request. Any RPC answer
//!   counts as a sign of life for the detector, not only pings.
//! - A node serves a queue it was promoted for only after its copy became a queue of the core
//!   (`adopt_promoted_copy` before the session attaches), so a client never finds a new, empty
//!   queue in place of its copy.
//!
//! Kept publishes (`RecentForwards`): a node keeps each publish it applied (forwarded or its
//! own), durably (the recent-publish log, a reserved queue written in the batch that applies
//! the publish), until every member applied it (the origin's floor, sent with its forwarded
//! publishes: a copy placed here later starts from a primary that holds it) and every copy it
//! holds has a watermark past the publish's origin offset: the copy acknowledged its log up to
//! an end that its primary read after counting the publish as applied (`control/watermark.rs`).
//! No time limit: a bound in operations (`RECENT_FORWARD_OPS_MAX`), counted when hit.
//! - A promotion appends the kept publishes matching the queue that it does not hold (past the
//!   copy's watermark; per publisher, by highest event sequence held), and the promoted queue
//!   skips forwarded events it already holds: a publish in flight when the primary died is
//!   neither lost nor appended twice, however long the promotion takes.
//! - Matching the kept publishes against the queue's interest runs on a blocking thread off the
//!   core lock (they can be hundreds of thousands); what was kept since is matched under the
//!   lock, where the queue joins the index, so nothing falls between.
//! - In memory a node holds an index of the kept publishes (origin, offsets: tens of bytes
//!   each) and the operations of the newest (`RECENT_FORWARD_HELD_BYTES_MAX`, and those not
//!   committed yet); a promotion reads the older ones back from the log in bounded chunks
//!   (`load_kept`).

use crate::bug::LockExt;
use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

use tether_storage::{Batch, Entry, QueueId, Store};
use tether_transport::ErrorCode;

use super::Shared;
use crate::cluster::Cluster;
use crate::cluster::meta::{MetaCommand, MetaResponse, NodeId, Placement};
use crate::cluster::network::{PeerRequest, PeerResponse};
use crate::control::lease::Lease;
use crate::control::liveness::{FailureDetector, PING_INTERVAL_MS, PING_TIMEOUT_MS};
use crate::control::reconcile::{self, CopyStep, OwnQueueStep, SpreadRound};
use crate::control::round::{self, RepairKind, RepairWrite};
use crate::control::watermark::{self, Through};
use crate::core::{RecentForward, Record, RecoveryError};
use crate::metrics as m;
use crate::protocol::{EventId, EventRecord, WireError};
use crate::replication::{Shipper, ShipperConfig};
use tether_transport::codec::CodecError;

/// Interval of the reconciler, in milliseconds.
pub const RECONCILE_MS: u64 = 100;
/// Most publish operations kept for promotions. Beyond it the oldest go first, counted in
/// `tether_failover_recent_publish_ops_dropped_total`: a copy whose primary is that far behind
/// may then miss them in a failover. At two thousand operations a second, over four minutes of
/// replication lag.
pub const RECENT_FORWARD_OPS_MAX: usize = 500_000;

/// Queue id of the recent-publish log in the node's store (see [`RecentForwards`]; never
/// allocated to a subscription queue, those count up from 1).
pub const RECENT_LOG_QUEUE: QueueId = u64::MAX - 1;
/// Info blob that marks the recent-publish log's metadata.
pub const RECENT_LOG_INFO: &[u8] = b"tether-recent-publishes";

/// Publishes applied on this node lately (forwarded by peers or made here), oldest first, with
/// the event kinds they produced, kept while a copy held here may lack them: the copy's primary
/// may fail before it ships them, and a promotion of the copy appends them then.
///
/// A publish is forgotten once every copy held here is known to hold it: each copy's
/// replicated watermark (per origin node, the publish-log offset its primary applied and
/// replicated to every copy, see `control/watermark.rs`) has passed the publish's origin offset;
/// and once every member has applied it (the origin's floor, carried with its forwarded
/// publishes): a copy this node gets later starts from a primary that holds it. Until then
/// every publish is kept, with copies held here or not: a node that held no copy when a
/// publish arrived may get one (a repair) whose primary has not applied it yet and fails.
///
/// Kept durably: each publish is also an entry of a reserved queue of the store
/// ([`RECENT_LOG_QUEUE`]), written in the batch that applies it and trimmed (acked) as it is
/// forgotten, so a restart of this node loses none of them (the peers do not send again
/// what this node applied before it stopped). In memory an index of them is kept ([`Kept`],
/// about fifty bytes a publish whatever its size) with the operations of the newest, up to
/// [`RECENT_FORWARD_HELD_BYTES_MAX`] and always those whose batch is not committed yet
/// ([`RecentForwards::committed`]); a promotion reads the others back from the log
/// ([`load_kept`]).
#[derive(Default)]
pub(crate) struct RecentForwards {
    /// Oldest first, by offset in the recent-publish log.
    entries: std::collections::VecDeque<Kept>,
    ops: usize,
    /// Origin node names, each allocated once.
    nodes: Vec<Arc<str>>,
    /// Per copy (durable id): its latest replicated watermark.
    copies: HashMap<String, Through>,
    /// Per origin node: every member has applied its publishes up to this offset.
    floors: Through,
    /// Last offset assigned in the recent-publish log, and the last one trimmed.
    log_end: u64,
    log_acked: u64,
    /// Estimated bytes of the publishes held in memory ([`Kept::body`]), and the log offset
    /// before which none committed is.
    held_bytes: usize,
    held_from: u64,
}

/// A kept publish: where it came from and where it is in the recent-publish log.
pub(crate) struct Kept {
    /// Offset in the recent-publish log.
    at: u64,
    /// Origin node and the publish's offset in the origin's publish log.
    node: Arc<str>,
    offset: u64,
    ops: usize,
    /// The publish while it is among the newest [`RECENT_FORWARD_HELD_BYTES_MAX`] bytes kept,
    /// and in any case until its batch is committed (the log cannot be read back before).
    body: Option<Arc<RecentForward>>,
    /// Estimated bytes of `body`.
    bytes: usize,
    committed: bool,
}

/// Most bytes of kept publishes held in memory (estimated), newest first; older ones are read
/// back from the recent-publish log by a promotion. Holding the newest spares a promotion
/// after a short lag (the common failover) the reads.
pub const RECENT_FORWARD_HELD_BYTES_MAX: usize = 32 << 20;

/// Estimated memory of one kept operation beyond its region, key and value bytes.
const KEPT_OP_OVERHEAD_BYTES: usize = 96;

/// Estimated memory of a publish's operations.
fn held_size(f: &RecentForward) -> usize {
    use crate::protocol::PublishOp;
    f.ops
        .iter()
        .map(|(op, _)| {
            KEPT_OP_OVERHEAD_BYTES
                + match op {
                    PublishOp::Put { region, key, value } => region.len() + key.len() + value.len(),
                    PublishOp::Destroy { region, key } | PublishOp::Invalidate { region, key } => {
                        region.len() + key.len()
                    }
                }
        })
        .sum()
}

/// A kept publish a promotion may need: in memory (among the newest, or not committed yet
/// when the snapshot was taken) or at an offset of the recent-publish log.
#[derive(Clone, Debug)]
pub(crate) enum KeptPublish {
    Held(Arc<RecentForward>),
    Logged(u64),
}

/// Most bytes of kept publishes read back from the log at once by a promotion ([`load_kept`]).
pub const KEPT_READ_CHUNK_BYTES: usize = 4 << 20;

/// The publishes of `kept` (oldest first), in order, those in the log read back from `store`
/// in chunks of about [`KEPT_READ_CHUNK_BYTES`]; `visit` gets each chunk. A logged publish no
/// longer in the log was forgotten over [`RECENT_FORWARD_OPS_MAX`] (counted when it was):
/// skipped.
pub(crate) fn load_kept(
    store: &dyn Store,
    kept: &[KeptPublish],
    visit: &mut dyn FnMut(&[Arc<RecentForward>]),
) -> Result<(), RecoveryError> {
    let mut i = 0;
    while i < kept.len() {
        let mut chunk = Vec::new();
        while let Some(KeptPublish::Held(f)) = kept.get(i) {
            chunk.push(f.clone());
            i += 1;
        }
        if !chunk.is_empty() {
            visit(&chunk);
        }
        // The run of logged ones that follows, read in ranges up to the byte budget.
        let mut wanted = Vec::new();
        while let Some(&KeptPublish::Logged(at)) = kept.get(i) {
            wanted.push(at);
            i += 1;
        }
        let mut w = 0;
        while w < wanted.len() {
            let (from, to) = (wanted[w], wanted[wanted.len() - 1]);
            let mut chunk = Vec::new();
            let mut last = None;
            let mut bad = None;
            store.read_entries(
                RECENT_LOG_QUEUE,
                from,
                to,
                KEPT_READ_CHUNK_BYTES,
                &mut |at, _, body| {
                    last = Some(at);
                    // The log holds others between them (publishes the copy holds by its
                    // watermark), and may lack some (forgotten): only those asked for.
                    while wanted.get(w).is_some_and(|&x| x < at) {
                        w += 1;
                    }
                    if wanted.get(w) == Some(&at) {
                        match tether_transport::codec::decode_body::<RecentForward>(body) {
                            Ok(f) => chunk.push(Arc::new(f)),
                            Err(error) => bad = Some(recent_publish_error(at, error)),
                        }
                        w += 1;
                    }
                },
            )?;
            if let Some(e) = bad {
                return Err(e);
            }
            match last {
                None => w = wanted.len(), // none of the rest is in the log
                Some(last) => {
                    while wanted.get(w).is_some_and(|&x| x <= last) {
                        w += 1;
                    }
                }
            }
            if !chunk.is_empty() {
                visit(&chunk);
            }
        }
    }
    Ok(())
}

/// A recent-publish log entry at `at` that did not decode.
fn recent_publish_error(at: u64, error: CodecError) -> RecoveryError {
    RecoveryError::Decode {
        record: Record::RecentPublish(at),
        error,
    }
}

impl RecentForwards {
    /// Loads the recent-publish log (creating its metadata on first start).
    pub(crate) fn recover(store: &dyn Store) -> Result<Self, RecoveryError> {
        let mut r = RecentForwards::default();
        match store.queue_meta(RECENT_LOG_QUEUE)? {
            None => {
                let mut b = Batch::new();
                b.put_queue_info(RECENT_LOG_QUEUE, 0, RECENT_LOG_INFO.to_vec());
                store.write(&b, true)?;
            }
            Some(meta) => {
                r.log_end = meta.end;
                r.log_acked = meta.acked;
                let mut bad = None;
                store
                    .read_entries(
                        RECENT_LOG_QUEUE,
                        meta.acked + 1,
                        meta.end,
                        usize::MAX,
                        &mut |offset, _, body| match tether_transport::codec::decode_body::<
                            RecentForward,
                        >(body)
                        {
                            Ok(f) => {
                                let node = r.node(&f.origin.node);
                                r.ops += f.ops.len();
                                r.entries.push_back(Kept {
                                    at: offset,
                                    node,
                                    offset: f.origin.offset,
                                    ops: f.ops.len(),
                                    body: None,
                                    bytes: 0,
                                    committed: true,
                                });
                            }
                            Err(error) => bad = Some(recent_publish_error(offset, error)),
                        },
                    )?;
                if let Some(e) = bad {
                    return Err(e);
                }
            }
        }
        Ok(r)
    }

    /// The origin node `name`, allocated once.
    fn node(&mut self, name: &str) -> Arc<str> {
        if let Some(n) = self.nodes.iter().find(|n| &***n == name) {
            return n.clone();
        }
        let n: Arc<str> = name.into();
        self.nodes.push(n.clone());
        n
    }

    /// Keeps a publish whose first event is `first` (the others follow in sequence), at offset
    /// `offset` of its origin's publish log; its log entry goes into `batch` (the batch that
    /// applies the publish). Returns the entry's offset in the recent-publish log, for
    /// [`RecentForwards::committed`] once the batch is.
    pub(crate) fn record(
        &mut self,
        batch: &mut Batch,
        first: &EventId,
        offset: u64,
        ops: &[crate::protocol::PublishOp],
        kinds: &[crate::protocol::EventOp],
    ) -> u64 {
        let f = RecentForward {
            origin: crate::core::EventOrigin {
                node: first.node.clone(),
                session: first.session,
                first_seq: first.seq,
                offset,
            },
            ops: ops.iter().cloned().zip(kinds.iter().copied()).collect(),
        };
        let body = tether_transport::codec::encode_body(&f).expect("a publish always encodes");
        self.log_end += 1;
        batch.append(RECENT_LOG_QUEUE, self.log_end, Entry::new(0, body));
        self.ops += f.ops.len();
        let node = self.node(&f.origin.node);
        self.entries.push_back(Kept {
            at: self.log_end,
            node,
            offset,
            ops: f.ops.len(),
            bytes: held_size(&f),
            body: Some(Arc::new(f)),
            committed: false,
        });
        self.held_bytes += self.entries.back().map_or(0, |k| k.bytes);
        let mut dropped = 0;
        while self.ops > RECENT_FORWARD_OPS_MAX {
            let Some(k) = self.entries.pop_front() else {
                break;
            };
            self.ops -= k.ops;
            self.log_acked = k.at;
            dropped += k.ops;
            if k.body.is_some() {
                self.held_bytes -= k.bytes;
            }
        }
        if dropped > 0 {
            batch.set_acked(RECENT_LOG_QUEUE, self.log_acked);
            metrics::counter!(m::RECENT_PUBLISH_OPS_DROPPED).increment(dropped as u64);
            tracing::warn!(
                dropped,
                "recent publishes forgotten before every member applied them and every copy here held them: a member is down or copies lag"
            );
        }
        self.log_end
    }

    /// The batch that wrote the recent-publish log's entry `at` is committed: the publish may
    /// be read back from the log from now on, and the oldest committed ones leave memory
    /// while more than [`RECENT_FORWARD_HELD_BYTES_MAX`] is held.
    pub(crate) fn committed(&mut self, at: u64) {
        let i = self.entries.partition_point(|k| k.at < at);
        if let Some(k) = self.entries.get_mut(i).filter(|k| k.at == at) {
            k.committed = true;
        }
        if self.held_bytes <= RECENT_FORWARD_HELD_BYTES_MAX {
            return;
        }
        // Oldest first, up to the first one not committed yet (batches commit in order).
        let mut i = self.entries.partition_point(|k| k.at < self.held_from);
        while self.held_bytes > RECENT_FORWARD_HELD_BYTES_MAX {
            let Some(k) = self.entries.get_mut(i).filter(|k| k.committed) else {
                break;
            };
            if k.body.take().is_some() {
                self.held_bytes -= k.bytes;
            }
            i += 1;
            self.held_from = k.at + 1;
        }
    }

    /// Copy `id` received replicated watermark `through` from its primary.
    pub(crate) fn copy_through(&mut self, id: &str, through: &Through) {
        if through.is_empty() {
            return;
        }
        match self.copies.get_mut(id) {
            Some(t) => watermark::merge(t, through),
            None => {
                self.copies.insert(id.to_string(), through.clone());
            }
        }
    }

    /// Every member has applied `origin`'s publishes up to `floor`.
    pub(crate) fn origin_floor(&mut self, origin: &str, floor: u64) {
        if floor == 0 {
            return;
        }
        match self.floors.get_mut(origin) {
            Some(f) => *f = (*f).max(floor),
            None => {
                self.floors.insert(origin.to_string(), floor);
            }
        }
    }

    /// Copy `id`'s replicated watermark (empty if none received).
    pub(crate) fn through_of(&self, id: &str) -> Through {
        self.copies.get(id).cloned().unwrap_or_default()
    }

    /// Copy `id` is no longer held here (promoted or dropped), or its log was cut back (its
    /// watermark no longer holds: it is learnt again).
    pub(crate) fn copy_gone(&mut self, id: &str) {
        self.copies.remove(id);
    }

    /// Forgets the oldest publishes every member applied and every copy in `held` (the copies
    /// held here) holds; the batch that trims them from the log, if any. The forgotten
    /// publishes go to `forgotten`, to be freed by the caller once it released the lock.
    pub(crate) fn trim(
        &mut self,
        held: &[String],
        forgotten: &mut Vec<Arc<RecentForward>>,
    ) -> Option<Batch> {
        let held_set: HashSet<&str> = held.iter().map(String::as_str).collect();
        self.copies.retain(|id, _| held_set.contains(id.as_str()));
        let covered = |k: &Kept| {
            let everywhere = self.floors.get(&*k.node).is_some_and(|&x| x >= k.offset);
            everywhere
                && held.iter().all(|id| {
                    self.copies
                        .get(id)
                        .and_then(|t| t.get(&*k.node))
                        .is_some_and(|&x| x >= k.offset)
                })
        };
        let mut n = 0;
        while n < self.entries.len() && covered(&self.entries[n]) {
            n += 1;
        }
        for k in self.entries.drain(..n) {
            self.ops -= k.ops;
            self.log_acked = k.at;
            if let Some(f) = k.body {
                self.held_bytes -= k.bytes;
                forgotten.push(f);
            }
        }
        metrics::gauge!(m::RECENT_PUBLISH_OPS).set(self.ops as f64);
        metrics::gauge!(m::RECENT_PUBLISH_HELD_BYTES).set(self.held_bytes as f64);
        if n == 0 {
            return None;
        }
        let mut b = Batch::new();
        b.set_acked(RECENT_LOG_QUEUE, self.log_acked);
        Some(b)
    }

    /// The publishes copy `id` may lack (those its watermark has not passed) kept after offset
    /// `after` of the recent-publish log, and the log's last offset (the `after` of a later
    /// call that takes only what came since). Cheap under the lock: shares the publishes still
    /// in memory and names the others, for [`load_kept`].
    pub(crate) fn snapshot_for(&self, id: &str, after: u64) -> (Vec<KeptPublish>, u64) {
        let through = self.copies.get(id);
        let first = self.entries.partition_point(|k| k.at <= after);
        let publishes = self
            .entries
            .range(first..)
            .filter(|k| {
                through
                    .and_then(|t| t.get(&*k.node))
                    .is_none_or(|&x| x < k.offset)
            })
            .map(|k| match &k.body {
                Some(f) => KeptPublish::Held(f.clone()),
                None => KeptPublish::Logged(k.at),
            })
            .collect();
        (publishes, self.log_end)
    }

    #[cfg(test)]
    fn len(&self) -> usize {
        self.entries.len()
    }
}

/// Interval of forgetting the recent publishes every member applied and every copy here holds,
/// in milliseconds.
pub const RECENT_TRIM_MS: u64 = 200;

/// Trims the recent publishes (clustered nodes), until the node stops.
pub(crate) async fn recent_trim_loop(weak: Weak<Shared>) {
    let mut interval = tokio::time::interval(Duration::from_millis(RECENT_TRIM_MS));
    interval.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        interval.tick().await;
        let Some(shared) = weak.upgrade() else {
            return;
        };
        let held = shared.member.copies.ids();
        let mut forgotten = Vec::new();
        let trimmed = {
            let mut recent = shared.recent_forwards();
            if let Some(f) = &shared.member.forwarding {
                recent.origin_floor(&shared.node_id, f.all_applied());
            }
            recent.trim(&held, &mut forgotten)
        };
        drop(forgotten);
        if let Some(b) = trimmed {
            let _ = shared.writer.submit(b, None).await;
        }
    }
}

/// The node's [`FailureDetector`], on a monotonic clock counted from the node's start.
pub(crate) struct Liveness {
    origin: Instant,
    detector: Mutex<FailureDetector>,
}

impl Liveness {
    /// Nobody seen yet; `failure` is the node's `node-failure-ms`.
    pub(crate) fn new(failure: Duration) -> Self {
        Self {
            origin: Instant::now(),
            detector: Mutex::new(FailureDetector::empty(failure.as_millis() as u64)),
        }
    }

    /// Milliseconds from the node's start to `at` (0 before it).
    fn ms(&self, at: Instant) -> u64 {
        at.saturating_duration_since(self.origin).as_millis() as u64
    }

    fn detector(&self) -> std::sync::MutexGuard<'_, FailureDetector> {
        self.detector.lock_or_stop()
    }

    /// Whether `node` answered within [`MEMBER_LIVE_MS`](crate::control::liveness::MEMBER_LIVE_MS).
    /// The detector counts every member as seen when it starts, so members get that time once
    /// before they count as down.
    pub(crate) fn is_live(&self, node: NodeId) -> bool {
        let now = self.ms(Instant::now());
        self.detector().is_live(node, now)
    }

    /// Whether this node has not reached `node` for a while (see
    /// [`FailureDetector::unreachable`]).
    pub(crate) fn unreachable(&self, node: NodeId) -> bool {
        let now = self.ms(Instant::now());
        self.detector().unreachable(node, now)
    }

    /// Whether this node reaches a majority of the cluster's voters (see
    /// [`FailureDetector::majority_reachable`]): a learner, a member still being added, does
    /// not count, as it does not in the metadata group.
    pub(crate) fn majority_reachable(&self, cluster: &Cluster) -> bool {
        let members = cluster.members();
        let now = self.ms(Instant::now());
        self.detector()
            .majority_reachable(cluster.id(), members.voters.iter().copied(), now)
    }
}

/// Pings every member and, on the leader, declares silent members failed.
pub(crate) async fn detect_loop(weak: Weak<Shared>, cluster: Arc<Cluster>) {
    let me = cluster.id();
    let mut others: Vec<NodeId> = Vec::new();
    let mut interval = tokio::time::interval(Duration::from_millis(PING_INTERVAL_MS));
    interval.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        // A joining node watches no one until it has joined (its peers refuse it until they
        // know it as a member): then every member is new to it.
        if weak.upgrade().is_none_or(|s| !*s.member.joined.borrow()) {
            if weak.strong_count() == 0 {
                return;
            }
            interval.tick().await;
            continue;
        }
        // The members as they are now: a member new to this loop is watched from now on (as
        // if it had just answered), a removed one no more.
        let now_members: Vec<NodeId> = cluster
            .members()
            .nodes
            .keys()
            .copied()
            .filter(|&n| n != me)
            .collect();
        let new: Vec<NodeId> = now_members
            .iter()
            .copied()
            .filter(|n| !others.contains(n))
            .collect();
        others = now_members;
        {
            let Some(shared) = weak.upgrade() else {
                return;
            };
            let l = &shared.member.liveness;
            let start = l.ms(Instant::now());
            l.detector().start(new, start);
        }
        interval.tick().await;
        let pings = others.iter().map(|&n| {
            let cluster = cluster.clone();
            async move {
                let r = cluster
                    .call(n, PeerRequest::Ping, Duration::from_millis(PING_TIMEOUT_MS))
                    .await;
                (n, matches!(r, Ok(PeerResponse::Pong)))
            }
        });
        let mut set = tokio::task::JoinSet::new();
        for ping in pings {
            set.spawn(ping);
        }
        let results = set.join_all().await;
        let Some(shared) = weak.upgrade() else {
            return;
        };
        let l = &shared.member.liveness;
        let now = l.ms(Instant::now());
        // A copy (a few members), so the metadata is read outside the detector's lock.
        let detector = {
            let mut d = l.detector();
            for (n, ok) in results {
                if ok {
                    d.answered_ping(n, now);
                }
            }
            for &n in &others {
                if let Some(t) = cluster.last_answer(n) {
                    d.answered(n, l.ms(t));
                }
            }
            d.clone()
        };
        let leader = cluster.leader() == Some(me);
        let involved = |n| {
            cluster.read(|s| {
                s.queues
                    .values()
                    .any(|p| p.primary == n || p.secondaries.contains(&n))
            })
        };
        let to_declare = detector.to_declare(&others, now, leader, involved);
        for n in to_declare {
            match cluster.write(MetaCommand::NodeFailed { node: n }).await {
                Ok(r) => {
                    tracing::warn!(node = n.0, result = ?r, "member declared failed");
                    l.detector().declared(n);
                }
                Err(e) => {
                    tracing::warn!(node = n.0, error = %e, "could not declare a member failed")
                }
            }
        }
    }
}

/// Pause between read-barrier attempts while no leader answers, in milliseconds.
pub const CATCH_UP_RETRY_MS: u64 = 200;
/// Longest wait of a durable hello for the node's metadata to catch up, in milliseconds.
pub const CATCH_UP_WAIT_MS: u64 = 10_000;

/// Commits a [`MetaCommand::Barrier`] once after the node starts: once it is applied here, the
/// local metadata holds every decision made while the node was down (a queue that moved or
/// ended), and durable clients are served.
pub(crate) async fn catch_up(weak: Weak<Shared>, cluster: Arc<Cluster>) {
    loop {
        // Applied here, not only on the leader: the local metadata must hold what came before.
        match cluster.barrier().await {
            Ok(()) => {
                if let Some(shared) = weak.upgrade() {
                    shared.member.meta_caught_up.send_replace(true);
                    tracing::info!(applied = cluster.applied_index(), "metadata caught up");
                }
                return;
            }
            Err(e) => tracing::debug!(error = %e, "metadata read barrier failed; retrying"),
        }
        if weak.strong_count() == 0 {
            return;
        }
        tokio::time::sleep(Duration::from_millis(CATCH_UP_RETRY_MS)).await;
    }
}

/// Waits until this node's metadata caught up after its start (see [`catch_up`]).
pub(crate) async fn metadata_caught_up(shared: &Shared) -> Result<(), WireError> {
    let mut rx = shared.member.meta_caught_up.subscribe();
    let wait = Duration::from_millis(CATCH_UP_WAIT_MS);
    match tokio::time::timeout(wait, rx.wait_for(|&c| c)).await {
        Ok(Ok(_)) => Ok(()),
        _ => Err(WireError::new(
            ErrorCode::Unavailable,
            "this node's cluster metadata is still catching up; retry",
        )),
    }
}

/// Follows the metadata every [`RECONCILE_MS`].
pub(crate) async fn reconcile_loop(weak: Weak<Shared>, cluster: Arc<Cluster>) {
    let mut interval = tokio::time::interval(Duration::from_millis(RECONCILE_MS));
    interval.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        interval.tick().await;
        let Some(shared) = weak.upgrade() else {
            return;
        };
        reconcile(&shared, &cluster).await;
    }
}

/// Promotions run at once by the reconciler (each matches the kept publishes on a blocking
/// thread and waits for a commit; one after the other, hundreds take tens of seconds after a
/// member fails, while their clients are told `unavailable`).
pub const PROMOTIONS_AT_ONCE: usize = 4;
/// Redundancy repairs (metadata writes) run at once by the reconciler.
pub const REPAIRS_AT_ONCE: usize = 8;

/// Runs `jobs` as tasks, at most `at_once` at a time, and waits for all of them.
async fn run_bounded<F>(jobs: impl IntoIterator<Item = F>, at_once: usize)
where
    F: std::future::Future<Output = ()> + Send + 'static,
{
    let mut set = tokio::task::JoinSet::new();
    for job in jobs {
        while set.len() >= at_once {
            set.join_next().await;
        }
        set.spawn(job);
    }
    while set.join_next().await.is_some() {}
}

/// One round of the reconciler: each step decided by [`reconcile`](crate::control::reconcile)
/// on what is read at that moment, then carried out here.
async fn reconcile(shared: &Arc<Shared>, cluster: &Arc<Cluster>) {
    let me = cluster.id();
    // Promotions first: their clients wait for them.
    let promotions = shared.member.copies.ids().into_iter().filter_map(|id| {
        let p = cluster.placement(&id).filter(|p| p.primary == me)?;
        let (shared, cell) = (shared.clone(), shared.member.copies.get(&id)?);
        Some(async move {
            let mut copy = cell.lock().await;
            if !copy.gone && reconcile::promotes(&p, me, copy.replica.epoch()) {
                promote(&shared, &id, &mut copy, &p).await;
            }
        })
    });
    run_bounded(promotions.collect::<Vec<_>>(), PROMOTIONS_AT_ONCE).await;
    let own: Vec<(String, u64)> = shared.core().durable_epochs();
    let members = cluster.members();
    let named: Vec<(NodeId, &str)> = members
        .nodes
        .iter()
        .map(|(&n, node)| (n, node.name.as_str()))
        .collect();
    let (spread, draining) = cluster.read(|s| {
        let spread = SpreadRound::read(s, named.iter().copied(), me);
        (spread, s.draining.clone())
    });
    let majority_reachable = shared.member.liveness.majority_reachable(cluster);
    let mut repairs = Vec::new();
    for (id, epoch) in own {
        let placement = cluster.placement(&id);
        let applied = cluster.applied_index();
        let rival = shared.member.shipping.rival(&id);
        let rival_epoch = rival.map_or(0, |r| r.epoch);
        match reconcile::own_queue_step(placement.as_ref(), me, epoch, applied, rival_epoch) {
            OwnQueueStep::Primary => {
                let p = placement.expect("a primary's queue is placed");
                ensure_shipping(shared, &id, &p);
                let members = round::MembersSeen {
                    me,
                    named: &named,
                    draining: &draining,
                    live: &|n| shared.member.liveness.is_live(n),
                    unreachable: &|n| shared.member.liveness.unreachable(n),
                    majority_reachable,
                };
                if let Some(w) = repair(shared, &id, &p, &members, &spread) {
                    let cluster = cluster.clone();
                    repairs.push(async move { write_repair(&cluster, &id, w).await });
                }
            }
            OwnQueueStep::Deposed => {
                let by = match &placement {
                    Some(p) if p.epoch >= rival_epoch => (Some(p.primary), p.epoch),
                    _ => (rival.and_then(|r| r.node), rival_epoch),
                };
                super::shipping::depose(shared, &id, by).await
            }
            OwnQueueStep::Wait => {}
            OwnQueueStep::Ended if drop_unplaced(shared, cluster, &id).await => {}
            OwnQueueStep::Ended | OwnQueueStep::Unreplicated => {
                // No copies: everything committed is delivered.
                let mut core = shared.core();
                let qid = core.durable_queue(&id).map(|q| q.id);
                if let Some(s) = qid.and_then(|q| core.set_deliver_cap(q, None)) {
                    drop(core);
                    shared.wake(s);
                }
            }
        }
    }
    run_bounded(repairs, REPAIRS_AT_ONCE).await;
    let applied = cluster.applied_index();
    // A rival matters until the metadata here reaches its epoch, and while this node may still
    // hold the queue (or be asked for it by a client).
    shared.member.shipping.retain_rivals(|id, r| {
        reconcile::superseded_by_rival(cluster.placement(id).as_ref(), 0, applied, r.epoch)
    });
    let caught_up = *shared.member.meta_caught_up.borrow();
    for id in shared.member.copies.ids() {
        let Some(cell) = shared.member.copies.get(&id) else {
            continue;
        };
        let mut copy = cell.lock().await;
        if copy.gone {
            continue;
        }
        let placement = cluster.placement(&id);
        let (epoch, placed_at) = (copy.replica.epoch(), copy.placed_at);
        let step =
            reconcile::copy_step(placement.as_ref(), me, epoch, placed_at, applied, caught_up);
        if step != CopyStep::Drop {
            continue; // Kept, or promoted by the next round.
        }
        // Not ours any more (expired, released, or another replica set): drop it.
        if super::copies::drop_copy(shared, &id, &mut copy).await {
            tracing::info!(durable_id = %id, "dropped a copy this node no longer holds");
        }
    }
}

/// Drops this node's queue of `id` if the cluster placed it (epoch above 0) and the metadata,
/// applied past that placement, no longer places it: the queue moved while this node was down
/// and then expired or was released on its new primary. Without this, a killed primary that
/// restarts would bring an ended queue back to life. The id's next client here learns
/// `expired` if it expired. Returns whether the queue was dropped.
pub(crate) async fn drop_unplaced(shared: &Arc<Shared>, cluster: &Cluster, id: &str) -> bool {
    let Some(epoch) = shared.core().durable_queue(id).map(|q| q.epoch) else {
        return false;
    };
    let step = reconcile::own_queue_step(
        cluster.placement(id).as_ref(),
        cluster.id(),
        epoch,
        cluster.applied_index(),
        0,
    );
    if step != OwnQueueStep::Ended {
        return false;
    }
    shared.member.shipping.stop(id);
    let (expired, owner) = cluster.read(|s| {
        (
            s.expired.iter().any(|e| e == id),
            s.expired_owners.get(id).cloned(),
        )
    });
    let dropped = shared
        .apply(|core| {
            let (mut batch, session) = core.depose(id);
            if expired {
                batch.extend(core.note_expired_elsewhere(id, owner.as_deref()));
            }
            Ok((session, batch))
        })
        .await;
    match dropped {
        Ok(session) => {
            tracing::warn!(durable_id = %id, expired, "dropped a queue that ended on another node");
            if let Some(s) = session {
                shared.disconnect_session(
                    s,
                    ErrorCode::Unavailable,
                    "this queue ended on another node; reconnect",
                );
            }
            true
        }
        Err(e) => {
            tracing::error!(durable_id = %id, error = %e.message, "dropping an ended queue failed");
            false
        }
    }
}

/// Makes sure a queue this node is primary of ships to its current secondaries (and is capped
/// accordingly); a queue without secondaries delivers everything committed.
pub(crate) fn ensure_shipping(shared: &Arc<Shared>, id: &str, p: &Placement) {
    // `p` may have been read before an await (a connection's placement): a newer one wins, and
    // one that no longer makes this node primary leaves the queue to the reconciler (depose).
    let fresh = shared.member.cluster.get().and_then(|c| {
        c.placement(id)
            .filter(|f| f.epoch > p.epoch)
            .map(|f| (f, c.id()))
    });
    let p = match &fresh {
        Some((f, me)) if f.primary == *me => f,
        Some(_) => {
            // Nothing more is delivered here until the reconciler deposes the queue.
            let mut core = shared.core();
            if let Some((qid, acked)) = core.durable_queue(id).map(|q| (q.id, q.acked_stored)) {
                core.set_deliver_cap(qid, Some(acked));
            }
            return;
        }
        None => p,
    };
    if shared
        .member
        .shipping
        .set_secondaries(id, &p.secondaries, p.epoch)
    {
        return;
    }
    let (qid, shipper) = {
        let mut core = shared.core();
        let Some(q) = core.durable_queue(id) else {
            return;
        };
        let (qid, epoch, acked) = (q.id, q.epoch, q.acked_stored);
        if p.secondaries.is_empty() {
            if let Some(s) = core.set_deliver_cap(qid, None) {
                drop(core);
                shared.wake(s);
            }
            return;
        }
        let log = match q.log_state() {
            Ok(l) => l,
            Err(e) => {
                tracing::error!(durable_id = %id, error = %e, "cannot ship queue");
                return;
            }
        };
        if epoch == 0 || log.last_epoch().is_some_and(|e| e > epoch) {
            tracing::error!(durable_id = %id, epoch, "queue epoch below its entries'");
            return;
        }
        // Nothing beyond what is acknowledged until the secondaries confirm.
        core.set_deliver_cap(qid, Some(acked));
        (
            qid,
            Shipper::new(epoch, log, acked, ShipperConfig::default()),
        )
    };
    shared.member.shipping.start(
        shared,
        (id, qid),
        shipper,
        p,
        match shared.held_at_start.contains(id) {
            // Promoted in this node's previous life, maybe less than the lease ago.
            true => Lease::at_start(shared.clock.since_start_ms(), 0),
            // Placed here in this life: no other primary had it.
            false => Lease::placed(shared.clock.since_start_ms()),
        },
    );
}

/// The repair of `id`, placed as `p` with this node primary ([`round::repair`]), from what
/// its shipping reports of the copies; see [`reconcile::repair_step`] for the order of steps.
fn repair(
    shared: &Shared,
    id: &str,
    p: &Placement,
    members: &round::MembersSeen<'_>,
    spread: &SpreadRound,
) -> Option<RepairWrite> {
    let shipped = shared.member.shipping.get(id);
    let regressed = shipped
        .as_ref()
        .map(|sq| sq.regressed())
        .unwrap_or_default();
    let in_sync = |n| shipped.as_ref().is_some_and(|sq| sq.in_sync(n));
    let seen = round::ShippedSeen {
        regressed: &regressed,
        in_sync: &in_sync,
    };
    round::repair(id, p, members, &seen, spread)
}

/// Commits a repair's metadata write for `id` (a compare-and-set on the placement's epoch:
/// a placement changed meanwhile leaves it without effect), counted and logged by its kind.
async fn write_repair(cluster: &Cluster, id: &str, w: RepairWrite) {
    let RepairWrite { kind, nodes, cmd } = w;
    let taken_out = match kind {
        RepairKind::Regressed => Some((
            m::REPLICATION_COPIES_REGRESSED,
            "a secondary lost entries it had acknowledged",
        )),
        RepairKind::Unreachable => Some((
            m::REPLICATION_COPIES_UNREACHABLE,
            "this node cannot reach a secondary",
        )),
        RepairKind::Draining => Some((m::DRAIN_COPIES_MOVED, "a secondary's member is draining")),
        RepairKind::Surplus => Some((
            m::SPREAD_COPIES_MOVED,
            "a secondary moved to a member holding fewer copies",
        )),
        RepairKind::Synced | RepairKind::Added | RepairKind::Spread => None,
    };
    let result = cluster.write(cmd).await;
    match (taken_out, result) {
        (Some((counter, what)), Ok(MetaResponse::Placed(_))) => {
            metrics::counter!(counter).increment(1);
            tracing::warn!(durable_id = %id, ?nodes, "{what}: taken out of the replica set")
        }
        (Some((_, what)), Ok(r)) => tracing::debug!(
            durable_id = %id,
            ?nodes,
            result = ?r,
            "{what}: the metadata changed before it was taken out"
        ),
        (Some((_, what)), Err(e)) => tracing::warn!(
            durable_id = %id,
            ?nodes,
            error = %e,
            "{what}: could not take it out of the replica set"
        ),
        (None, Ok(r)) if kind != RepairKind::Synced => {
            let why = match kind {
                RepairKind::Spread => "spreading copies: a copy added on a member holding fewer",
                _ => "repairing redundancy",
            };
            tracing::info!(durable_id = %id, added = ?nodes, result = ?r, "{why}")
        }
        (None, Ok(_)) => {}
        (None, Err(e)) => {
            tracing::debug!(durable_id = %id, ?kind, error = %e, "repair not written")
        }
    }
}

/// Up to `count` live members for copies of `id`, none of them in `exclude` or draining
/// ([`reconcile::choose_secondaries`]).
pub(crate) fn choose_secondaries(
    shared: &Shared,
    cluster: &Cluster,
    id: &str,
    count: u8,
    exclude: &[NodeId],
) -> Vec<NodeId> {
    let members = cluster.members();
    let draining = cluster.read(|s| s.draining.clone());
    let named = members
        .nodes
        .iter()
        .map(|(&n, node)| (n, node.name.as_str()));
    reconcile::choose_secondaries(named, id, count, exclude, &draining, |n| {
        shared.member.liveness.is_live(n)
    })
}

/// Client-managed failover: a client lost `id`'s primary and asks this node, an in-sync
/// secondary (checked by the caller), to take over. If the primary does not answer a ping from
/// here either, this node promotes itself through the metadata (compare-and-set on the epoch
/// the caller read). Returns the placement to serve from (None: the primary answers, so the
/// client is redirected to it; a client's own network trouble never deposes a live primary).
pub(crate) async fn client_failover(
    cluster: &Cluster,
    id: &str,
    p: &Placement,
) -> Result<Option<Placement>, WireError> {
    let ping = cluster
        .call(
            p.primary,
            PeerRequest::Ping,
            Duration::from_millis(PING_TIMEOUT_MS),
        )
        .await;
    if matches!(ping, Ok(PeerResponse::Pong)) {
        tracing::info!(durable_id = %id, "client reports its primary lost, but it answers here");
        return Ok(None);
    }
    let cmd = MetaCommand::Promote {
        id: id.to_string(),
        expected_epoch: p.epoch,
        new_primary: cluster.id(),
    };
    match cluster.write(cmd).await {
        Ok(MetaResponse::Placed(p) | MetaResponse::Stale(Some(p))) => {
            if p.primary == cluster.id() {
                metrics::counter!(m::CLIENT_FAILOVERS).increment(1);
                tracing::warn!(durable_id = %id, epoch = p.epoch, "promoted at a client's request");
            }
            Ok(Some(p))
        }
        Ok(other) => Err(WireError::new(
            ErrorCode::Unavailable,
            format!("failover of {id:?}: the metadata answered {other:?}; retry"),
        )),
        Err(e) => Err(WireError::new(
            ErrorCode::Unavailable,
            format!("cluster metadata unavailable, retry: {e}"),
        )),
    }
}

/// This node is `id`'s primary under `p`: if it still holds the queue as a copy (promoted
/// since the reconciler last ran), the copy becomes a queue of the core now.
pub(crate) async fn adopt_promoted_copy(
    shared: &Arc<Shared>,
    id: &str,
    p: &Placement,
) -> Result<(), WireError> {
    let Some(cell) = shared.member.copies.get(id) else {
        return Ok(());
    };
    let mut copy = cell.lock().await;
    // (The caller checked that `p` makes this node primary.)
    if !copy.gone && reconcile::promotes(p, p.primary, copy.replica.epoch()) {
        promote(shared, id, &mut copy, p).await;
    }
    if copy.gone {
        Ok(())
    } else {
        Err(WireError::new(
            ErrorCode::Unavailable,
            format!("the copy of {id:?} is being promoted here; retry"),
        ))
    }
}

/// This node was promoted for the copy `copy` of `id`: it becomes a queue of the core, primary
/// at the placement's epoch, shipped to the remaining secondaries once the old lease is over.
async fn promote(shared: &Arc<Shared>, id: &str, copy: &mut super::copies::Copy, p: &Placement) {
    if copy.replica.has_pending_writes() {
        return; // Writes complete under the copy's lock: cannot happen; try again later.
    }
    let state = copy.replica.state().clone();
    let mut info = copy.info.clone();
    info.copy = Some(state);
    // The copy's watermark (the stored one is loaded into `recent` at start).
    let held_through = shared.recent_forwards().through_of(id);
    let qid = copy.qid;
    let bytes = copy.bytes.clone();
    let epoch = p.epoch;
    let held = match held_ids(shared, qid, copy.replica.acked(), copy.replica.log().end()) {
        Ok(ids) => {
            let mut seen = copy.seen.clone();
            for id in &ids {
                crate::core::note_seen(&mut seen, id);
            }
            seen
        }
        Err(e) => {
            tracing::error!(durable_id = %id, error = %e, "promotion: reading the copy failed");
            return;
        }
    };
    // Reading and matching every kept publish against the queue's interest takes long with
    // many kept: done on a blocking thread, outside the core lock, twice (the second round
    // takes what was kept during the first). What is kept after that is matched under the
    // lock, where the queue joins the index (later publishes reach it there).
    let interests = info.interests.clone();
    let mut events = Vec::new();
    let mut upto = 0;
    for _ in 0..2 {
        let (kept, end) = shared.recent_forwards().snapshot_for(id, upto);
        upto = end;
        let store = shared.store.clone();
        let (interests, held, through) = (interests.clone(), held.clone(), held_through.clone());
        let round = tokio::task::spawn_blocking(move || {
            let mut events = Vec::new();
            load_kept(&*store, &kept, &mut |chunk| {
                events.extend(crate::core::events_to_reapply(
                    &interests, &held, &through, chunk,
                ));
            })
            .map(|()| events)
        })
        .await;
        match round {
            Ok(Ok(round)) => events.extend(round),
            Ok(Err(e)) => {
                tracing::error!(durable_id = %id, error = %e, "promotion: reading the kept publishes failed");
                return;
            }
            Err(_) => {
                tracing::error!(durable_id = %id, "promotion: matching the kept publishes failed");
                return;
            }
        }
    }
    let adopted = shared
        .apply(|core| {
            let now = shared.clock.now_ms();
            let (late, _) = shared.recent_forwards().snapshot_for(id, upto);
            load_kept(&*shared.store, &late, &mut |chunk| {
                events.extend(crate::core::events_to_reapply(
                    &interests,
                    &held,
                    &held_through,
                    chunk,
                ));
            })
            .map_err(super::internal)?;
            let mut batch = core
                .adopt_copy(qid, info, bytes, epoch, now)
                .map_err(super::internal)?;
            let (more, end) = core
                .reapply_forwarded(qid, now, held, held_through, events)
                .ok_or_else(|| super::internal("promoted queue vanished"))?;
            batch.extend(more);
            Ok((end, batch))
        })
        .await;
    let end = match adopted {
        Ok(end) => end,
        Err(e) => {
            tracing::error!(durable_id = %id, error = %e.message, "promotion failed");
            return;
        }
    };
    let appended = end - copy.replica.log().end();
    shared.core().committed(0, &[(qid, end)]);
    let replica = std::mem::take(&mut copy.replica);
    copy.gone = true;
    shared.member.copies.remove(id);
    shared.recent_forwards().copy_gone(id);
    let shipper = replica.promote(epoch, ShipperConfig::default());
    let lease = Lease::promoted(shared.clock.since_start_ms());
    shared.core().set_deliver_cap(qid, Some(0));
    shared
        .member
        .shipping
        .start(shared, (id, qid), shipper, p, lease);
    if p.handed_over {
        tracing::info!(
            durable_id = %id,
            epoch,
            recovered_from_forwards = appended,
            "took over a queue handed over by its primary (rebalancing)"
        );
        return;
    }
    metrics::counter!(m::FAILOVERS).increment(1);
    tracing::warn!(
        durable_id = %id,
        epoch,
        recovered_from_forwards = appended,
        "promoted: this node is the queue's primary now"
    );
}

/// The event ids of a copy's entries `(acked, end]` (stored offsets).
fn held_ids(
    shared: &Shared,
    qid: tether_storage::QueueId,
    acked: u64,
    end: u64,
) -> Result<Vec<EventId>, RecoveryError> {
    let mut ids = Vec::new();
    let mut bad = None;
    if end > acked {
        shared
            .store
            .read_entries(qid, acked + 1, end, usize::MAX, &mut |o, _, body| {
                // A copy with a hole would lose those events silently once promoted.
                if o != acked + 1 + ids.len() as u64 && bad.is_none() {
                    bad = Some(RecoveryError::CopyNotContiguous {
                        queue: qid,
                        entry: o,
                        after: acked + ids.len() as u64,
                    });
                }
                match tether_transport::codec::decode_body::<EventRecord>(body) {
                    Ok(r) => ids.push(r.id),
                    Err(error) => {
                        bad = Some(RecoveryError::Decode {
                            record: Record::QueueEntry(qid, o),
                            error,
                        })
                    }
                }
            })?;
    }
    match bad {
        Some(e) => Err(e),
        None => Ok(ids),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::{EventOp, PublishOp};

    /// A member being added is a learner until it caught up: it is a member (dialed, pinged,
    /// named) but not a voter, so it must not count towards the majority a primary checks
    /// before it keeps serving without a lease. Two learners answering a primary that reaches
    /// none of the other voters would otherwise make 3 of 5.
    #[test]
    fn a_learner_is_a_member_that_does_not_count_towards_a_majority() {
        use crate::cluster::meta::raft_id;
        use crate::cluster::{Members, PeerNode};
        use std::collections::{BTreeMap, BTreeSet};
        let peer = |name: &str, port: u16| (name.to_string(), format!("127.0.0.1:{port}"));
        let configured =
            Members::new("n1", "127.0.0.1:1", &[peer("n2", 2), peer("n3", 3)]).unwrap();
        assert_eq!(configured.voters.len(), 3, "configured members all vote");
        let voters: BTreeSet<NodeId> = ["n1", "n2", "n3"].map(raft_id).into();
        let nodes: BTreeMap<NodeId, crate::cluster::PeerNode> = (1..=5)
            .map(|i| {
                let (name, addr) = peer(&format!("n{i}"), i);
                (raft_id(&name), PeerNode { name, addr })
            })
            .collect();
        let membership = openraft::Membership::new(vec![voters.clone()], nodes);
        let members = Members::effective(&membership, &configured);
        assert_eq!(members.nodes.len(), 5, "learners are members");
        assert_eq!(members.voters, voters);

        // n1 hears only from the learners n4 and n5.
        let (n1, now) = (raft_id("n1"), 10_000);
        let mut d = FailureDetector::new(members.nodes.keys().copied(), 0, 2_500);
        d.answered(raft_id("n4"), now);
        d.answered(raft_id("n5"), now);
        assert!(!d.majority_reachable(n1, members.voters.iter().copied(), now));
        // Over every member it would count 3 of 5.
        assert!(d.majority_reachable(n1, members.nodes.keys().copied(), now));
        // With one voter more it has its majority.
        d.answered(raft_id("n2"), now);
        assert!(d.majority_reachable(n1, members.voters.iter().copied(), now));
    }

    fn record(r: &mut RecentForwards, origin: &str, offset: u64) {
        record_in(r, &mut Batch::new(), origin, offset);
    }

    fn record_in(r: &mut RecentForwards, batch: &mut Batch, origin: &str, offset: u64) -> u64 {
        let id = EventId {
            node: origin.into(),
            session: 1,
            seq: offset * 10,
        };
        let op = PublishOp::Destroy {
            region: "R".into(),
            key: "k".into(),
        };
        r.record(batch, &id, offset, &[op], &[EventOp::Destroy])
    }

    /// (origin, origin offset) of each kept publish, those in the log read from `store`.
    fn origins(store: &dyn Store, kept: &[KeptPublish]) -> Vec<(String, u64)> {
        let mut out = Vec::new();
        load_kept(store, kept, &mut |chunk| {
            out.extend(
                chunk
                    .iter()
                    .map(|f| (f.origin.node.clone(), f.origin.offset)),
            )
        })
        .unwrap();
        out
    }

    fn offsets(kept: &[KeptPublish]) -> Vec<u64> {
        origins(&tether_storage::MemStore::new(), kept)
            .into_iter()
            .map(|(_, o)| o)
            .collect()
    }

    fn put(
        r: &mut RecentForwards,
        store: &dyn Store,
        origin: &str,
        offset: u64,
        size: usize,
    ) -> u64 {
        let id = EventId {
            node: origin.into(),
            session: 1,
            seq: offset,
        };
        let op = PublishOp::Put {
            region: "R".into(),
            key: "k".into(),
            value: vec![7u8; size],
        };
        let mut b = Batch::new();
        let at = r.record(&mut b, &id, offset, &[op], &[EventOp::Update]);
        store.write(&b, false).unwrap();
        at
    }

    fn kinds(kept: &[KeptPublish]) -> String {
        kept.iter()
            .map(|k| match k {
                KeptPublish::Held(_) => 'h',
                KeptPublish::Logged(_) => 'l',
            })
            .collect()
    }

    #[test]
    fn a_promotion_reads_back_from_the_log_what_is_not_held_in_order() {
        let store = tether_storage::MemStore::new();
        let mut r = RecentForwards::recover(&store).unwrap();
        let published = [("a", 1), ("b", 1), ("a", 2), ("b", 2), ("a", 3)];
        for (origin, offset) in published {
            let at = put(&mut r, &store, origin, offset, 10);
            r.committed(at);
        }
        let (kept, _) = r.snapshot_for("q", 0);
        assert_eq!(kinds(&kept), "hhhhh", "small: all held in memory");
        let all = published.map(|(o, x)| (o.to_string(), x)).to_vec();
        assert_eq!(origins(&store, &kept), all);
        // After a restart every kept publish is read back from the log, in order.
        let mut r = RecentForwards::recover(&store).unwrap();
        let (kept, _) = r.snapshot_for("q", 0);
        assert_eq!(kinds(&kept), "lllll");
        assert_eq!(origins(&store, &kept), all);
        // A copy holding a's publishes up to 2 lacks only the others; the log between them is
        // skipped, not returned.
        r.copy_through("q", &through(&[("a", 2)]));
        let (kept, _) = r.snapshot_for("q", 0);
        assert_eq!(
            origins(&store, &kept),
            [("b", 1), ("b", 2), ("a", 3)]
                .map(|(o, x)| (o.to_string(), x))
                .to_vec()
        );
        // A mix of both (one kept since the restart), in order.
        put(&mut r, &store, "b", 3, 10);
        let (kept, _) = r.snapshot_for("q", 0);
        assert_eq!(kinds(&kept), "lllh");
        assert_eq!(
            origins(&store, &kept),
            [("b", 1), ("b", 2), ("a", 3), ("b", 3)]
                .map(|(o, x)| (o.to_string(), x))
                .to_vec()
        );
    }

    #[test]
    fn only_the_newest_committed_publishes_stay_in_memory() {
        let store = tether_storage::MemStore::new();
        let mut r = RecentForwards::recover(&store).unwrap();
        let size = RECENT_FORWARD_HELD_BYTES_MAX / 4;
        // Eight publishes of a quarter of the budget each; the last two not committed.
        let mut at = Vec::new();
        for offset in 1..=8 {
            at.push(put(&mut r, &store, "a", offset, size));
        }
        for &a in &at[..6] {
            r.committed(a);
        }
        let (kept, _) = r.snapshot_for("q", 0);
        assert_eq!(
            kinds(&kept),
            "lllllhhh",
            "the newest committed within the budget, and every uncommitted one, stay"
        );
        assert!(r.held_bytes <= RECENT_FORWARD_HELD_BYTES_MAX);
        assert_eq!(offsets_in(&store, &kept), (1..=8).collect::<Vec<_>>());
        // The rest commit: within the budget, they stay; one more pushes the oldest out.
        r.committed(at[6]);
        r.committed(at[7]);
        assert_eq!(kinds(&r.snapshot_for("q", 0).0), "lllllhhh");
        let ninth = put(&mut r, &store, "a", 9, size);
        r.committed(ninth);
        assert_eq!(kinds(&r.snapshot_for("q", 0).0), "llllllhhh");
        assert!(r.held_bytes <= RECENT_FORWARD_HELD_BYTES_MAX);
        // Forgetting them all leaves nothing held.
        r.origin_floor("a", 9);
        r.trim(&[], &mut Vec::new());
        assert_eq!(r.len(), 0);
        assert_eq!(r.held_bytes, 0);
    }

    fn offsets_in(store: &dyn Store, kept: &[KeptPublish]) -> Vec<u64> {
        origins(store, kept).into_iter().map(|(_, o)| o).collect()
    }

    #[test]
    fn kept_publishes_are_read_back_in_chunks_of_bounded_size() {
        let store = tether_storage::MemStore::new();
        // Restarted: each publish, of a quarter of a chunk, is read back from the log.
        let mut r = RecentForwards::recover(&store).unwrap();
        let n = 10u64;
        for offset in 1..=n {
            put(&mut r, &store, "a", offset, KEPT_READ_CHUNK_BYTES / 4);
        }
        let r = RecentForwards::recover(&store).unwrap();
        let (kept, _) = r.snapshot_for("q", 0);
        let mut chunks = Vec::new();
        load_kept(&store, &kept, &mut |c| {
            chunks.push(c.iter().map(|f| f.origin.offset).collect::<Vec<_>>())
        })
        .unwrap();
        assert!(chunks.len() >= 3, "{chunks:?}");
        assert!(chunks.iter().all(|c| c.len() <= 4), "{chunks:?}");
        assert_eq!(chunks.concat(), (1..=n).collect::<Vec<_>>());
    }

    fn through(v: &[(&str, u64)]) -> Through {
        v.iter().map(|&(o, x)| (o.to_string(), x)).collect()
    }

    #[test]
    fn a_snapshot_after_an_offset_takes_only_what_was_kept_since() {
        let mut r = RecentForwards::default();
        record(&mut r, "a", 1);
        record(&mut r, "a", 2);
        let (all, upto) = r.snapshot_for("q", 0);
        assert_eq!(all.len(), 2);
        record(&mut r, "a", 3);
        let (late, upto) = r.snapshot_for("q", upto);
        assert_eq!(offsets(&late), vec![3]);
        assert!(r.snapshot_for("q", upto).0.is_empty());
    }

    #[test]
    fn a_publish_is_kept_until_every_copy_holds_it_however_long_that_takes() {
        let mut r = RecentForwards::default();
        record(&mut r, "a", 1);
        record(&mut r, "b", 1);
        record(&mut r, "a", 2);
        r.origin_floor("a", 2);
        r.origin_floor("b", 1);
        let held = vec!["q1".to_string(), "q2".to_string()];
        r.trim(&held, &mut Vec::new());
        assert_eq!(r.len(), 3, "no copy has a watermark yet");
        r.copy_through("q1", &through(&[("a", 2), ("b", 1)]));
        r.trim(&held, &mut Vec::new());
        assert_eq!(r.len(), 3, "q2 holds nothing yet");
        assert_eq!(r.snapshot_for("q1", 0).0.len(), 0);
        assert_eq!(r.snapshot_for("q2", 0).0.len(), 3);
        r.copy_through("q2", &through(&[("a", 1)]));
        r.trim(&held, &mut Vec::new());
        assert_eq!(r.len(), 2, "the first one is held by both");
        // Watermarks never go back.
        r.copy_through("q2", &through(&[("a", 0), ("b", 1)]));
        r.trim(&held, &mut Vec::new());
        assert_eq!(r.len(), 1);
        assert_eq!(offsets(&r.snapshot_for("q2", 0).0), vec![2]);
        // A copy no longer held does not hold anything back.
        r.trim(&["q1".to_string()], &mut Vec::new());
        assert_eq!(r.len(), 0);
    }

    #[test]
    fn without_copies_a_publish_is_kept_until_every_member_applied_it() {
        let mut r = RecentForwards::default();
        record(&mut r, "a", 1);
        record(&mut r, "b", 1);
        record(&mut r, "a", 2);
        r.trim(&[], &mut Vec::new());
        assert_eq!(
            r.len(),
            3,
            "a copy this node gets later may lack any of them"
        );
        r.origin_floor("a", 1);
        r.trim(&[], &mut Vec::new());
        assert_eq!(r.len(), 2);
        r.origin_floor("a", 2);
        r.trim(&[], &mut Vec::new());
        assert_eq!(r.len(), 2, "the oldest, of b, holds the later ones back");
        r.origin_floor("b", 1);
        r.origin_floor("b", 0);
        r.trim(&[], &mut Vec::new());
        assert_eq!(r.len(), 0);
    }

    #[test]
    fn a_copy_holding_a_publish_does_not_forget_it_before_every_member_applied_it() {
        let mut r = RecentForwards::default();
        record(&mut r, "a", 1);
        let held = vec!["q1".to_string()];
        r.copy_through("q1", &through(&[("a", 1)]));
        r.trim(&held, &mut Vec::new());
        assert_eq!(
            r.len(),
            1,
            "a repair may yet place a copy here whose primary lacks it"
        );
        r.origin_floor("a", 1);
        r.trim(&held, &mut Vec::new());
        assert_eq!(r.len(), 0);
    }
}
