//! The secondary side of queue replication: copies this node holds of queues whose primary is
//! another member, each checked by a sans-IO [`Replica`].
//!
//! A copy is stored like a queue of this node (its entries at the primary's offsets, under a
//! queue id from this node's core), with the primary's queue info and the replica's durable
//! state ([`QueueInfo::copy`]), so recovery tells copies from queues and rebuilds each
//! [`Replica`] as it was. A copy is not in the core: nothing is appended to it but what its
//! primary ships, and no client reads it, until cluster metadata promotes this node
//! (`failover.rs`), when it becomes a queue of the core as it stands.
//!
//! Every message from a primary is handled under the copy's lock, and every write (entries,
//! truncations, snapshots, trims, the primary's queue info) is committed (with the node's sync
//! mode) before the reply leaves: an ack always means durable.
//!
//! A copy keeps the primary's offsets (replication offset `o` is stored entry `o + 1`), so
//! `acked`, `end` and a client's processed offsets mean the same on every copy. A copy is
//! dropped only on metadata at least as new as the placement it was shipped under
//! (`control::reconcile::copy_not_held`), and a replication message from a member the
//! metadata does not name as the queue's primary is refused
//! (`control::reconcile::shipped_by_non_primary`), as is one shipped under a placement the
//! metadata here has removed since (`shipped_for_ended_queue`: a late message of a closed or
//! expired queue would otherwise start a copy of it), or, from a primary the metadata here
//! deposed since the placement it shipped under, answered `Fenced` with the newer epoch
//! (`control::reconcile::deposed_sender`): it never gets a new copy here. A copy of a queue
//! that ended, whose durable id was placed again, is replaced when the new queue is first
//! shipped to it (`control::reconcile::copy_of_another_queue`, by `QueueInfo::incarnation`).

use crate::bug::LockExt;
use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use tether_storage::{Batch, Entry, QueueId, QueueMeta};
use tether_transport::codec::{decode_body, encode_body};

use super::Shared;
use crate::cluster::meta::NodeId;
use crate::cluster::network::{PeerResponse, ReplicateHeader, ReplicateMsg, ShippedEntry};
use crate::config::Limits;
use crate::core::bytes::{QueueBytes, mark_interval_bytes};
use crate::core::{QueueInfo, RecoveryError};
use crate::metrics as m;
use crate::protocol::{EventRecord, WireError};
use crate::replication::{Decision, Replica, Reply, Write, WriteOp};
use tether_storage::StorageError;

/// One queue copy.
pub(crate) struct Copy {
    pub(crate) qid: QueueId,
    pub(crate) replica: Replica,
    /// The primary's queue info as last received (`copy` unset).
    pub(crate) info: QueueInfo,
    /// Removed from [`Copies`] (promoted or dropped): later messages are ignored.
    pub(crate) gone: bool,
    /// Per publisher `(node, session)`, the highest event sequence ever written to this copy
    /// (with the entries held, what a promotion must not append again); stored with each write
    /// of the copy (`QueueInfo::copy_seen`).
    pub(crate) seen: crate::core::SeenEvents,
    /// The copy's byte count: it writes byte marks like a queue, so that once promoted the
    /// queue's count is there (and a restart finds it from the marks).
    pub(crate) bytes: QueueBytes,
    /// The first messages of a snapshot sent in several: (sender, snapshot batch) and entries.
    staged: Option<((NodeId, u64), Vec<ShippedEntry>)>,
    /// The highest placement epoch its primary shipped under ([`ReplicateMsg::placement_epoch`]):
    /// this node's metadata must be applied that far before a placement without this node
    /// means the copy is no longer held (see `control::reconcile::copy_not_held`). In memory only: after
    /// a restart the node's read barrier covers every placement shipped under before.
    pub(crate) placed_at: u64,
}

type CopyCell = Arc<tokio::sync::Mutex<Copy>>;

/// The copies held by this node, by durable id.
#[derive(Default)]
pub(crate) struct Copies {
    map: Mutex<HashMap<String, CopyCell>>,
    /// The map's size, read without the lock on the publish path.
    count: AtomicUsize,
}

impl Copies {
    /// Rebuilds the copies found in storage at start; `entry_bytes(queue, from, to)` reads the
    /// bytes of stored entries (see [`QueueBytes::recover`]). Also returns each copy's stored
    /// replicated watermark.
    pub(crate) fn recover(
        stored: Vec<(QueueId, QueueMeta, QueueInfo)>,
        mut entry_bytes: impl FnMut(QueueId, u64, u64) -> Result<u64, StorageError>,
    ) -> Result<(Self, Vec<(String, crate::control::watermark::Through)>), RecoveryError> {
        let mut map = HashMap::new();
        let mut through = Vec::new();
        for (qid, meta, mut info) in stored {
            let bytes =
                QueueBytes::recover(meta.acked, meta.end, &meta.byte_marks, &mut |from, to| {
                    entry_bytes(qid, from, to)
                })
                .map_err(|error| RecoveryError::ByteCount { queue: qid, error })?;
            let state = info.copy.take().expect("split_copies returns copies");
            let replica = Replica::recover(state)
                .map_err(|error| RecoveryError::InvalidCopy { queue: qid, error })?;
            let id = info
                .durable_id
                .clone()
                .ok_or(RecoveryError::CopyWithoutDurableId { queue: qid })?;
            through.push((id.clone(), std::mem::take(&mut info.copy_through)));
            let seen = std::mem::take(&mut info.copy_seen);
            let copy = Copy {
                qid,
                replica,
                info,
                gone: false,
                seen,
                bytes,
                staged: None,
                placed_at: 0,
            };
            map.insert(id, Arc::new(tokio::sync::Mutex::new(copy)));
        }
        let copies = Copies {
            count: AtomicUsize::new(map.len()),
            map: Mutex::new(map),
        };
        Ok((copies, through))
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, CopyCell>> {
        self.map.lock_or_stop()
    }

    pub(crate) fn get(&self, id: &str) -> Option<CopyCell> {
        self.lock().get(id).cloned()
    }

    /// The durable ids of every copy held.
    pub(crate) fn ids(&self) -> Vec<String> {
        self.lock().keys().cloned().collect()
    }

    pub(crate) fn remove(&self, id: &str) {
        let mut map = self.lock();
        map.remove(id);
        self.count.store(map.len(), Ordering::Release);
    }

    pub(crate) fn len(&self) -> usize {
        self.count.load(Ordering::Acquire)
    }
}

/// Handles one replication message from a primary (see the module docs).
pub(crate) async fn handle(shared: &Arc<Shared>, msg: ReplicateMsg) -> PeerResponse {
    if let Some(cluster) = shared.member.cluster.get() {
        let placement = cluster.placement(&msg.durable_id);
        if crate::control::reconcile::shipped_by_non_primary(
            placement.as_ref(),
            msg.from,
            msg.placement_epoch,
            cluster.applied_index(),
        ) {
            metrics::counter!(m::PEER_REFUSED, "reason" => "not_primary").increment(1);
            let why = format!(
                "node {} is not the primary of queue {:?} at placement epoch {}",
                cluster.members().name(msg.from),
                msg.durable_id,
                msg.placement_epoch
            );
            tracing::warn!(%why, "replication message refused");
            return PeerResponse::BadRequest(why);
        }
        if crate::control::reconcile::shipped_for_ended_queue(
            placement.as_ref(),
            msg.placement_epoch,
            cluster.applied_index(),
        ) {
            metrics::counter!(m::PEER_REFUSED, "reason" => "queue_ended").increment(1);
            let why = format!(
                "queue {:?} placed at epoch {} has ended (its placement was removed)",
                msg.durable_id, msg.placement_epoch
            );
            tracing::debug!(%why, "replication message refused");
            return PeerResponse::BadRequest(why);
        }
        if let Some(epoch) = crate::control::reconcile::deposed_sender(
            placement.as_ref(),
            msg.from,
            msg.placement_epoch,
        ) {
            // Deposed since it shipped: told at once, and never given a copy here.
            metrics::counter!(m::REPLICATION_DEPOSED_SENDERS_FENCED).increment(1);
            return PeerResponse::Replicated(Some(Reply::Fenced { epoch }));
        }
    }
    let epoch = match &msg.header {
        ReplicateHeader::Append(h) => h.epoch,
        ReplicateHeader::Snapshot(h) => h.epoch,
    };
    // This node is primary of the queue: a stale primary learns it is fenced, a newer one
    // fences us (the reconciler then follows the metadata).
    if let Some(reply) = shared.member.shipping.on_rival(&msg.durable_id, epoch) {
        return PeerResponse::Replicated(reply);
    }
    let own_epoch = shared
        .core()
        .durable_queue(&msg.durable_id)
        .map(|q| q.epoch);
    if let Some(own_epoch) = own_epoch {
        if epoch <= own_epoch {
            // Our own queue without copies, and the sender a stale primary: its copies fence it.
            return PeerResponse::Replicated(None);
        }
        // A newer primary ships to this node as its copy: the metadata made it primary after
        // this node's queue was placed, though this node may not have applied that (cut from
        // the metadata leader while it reaches the new primary). Give the queue up now and
        // take the copy; until the metadata here catches up, the queue's clients are sent to
        // the sender.
        shared
            .member
            .shipping
            .note_rival(&msg.durable_id, Some(msg.from), epoch);
        super::shipping::depose(shared, &msg.durable_id, (Some(msg.from), epoch)).await;
        metrics::counter!(m::QUEUES_DEPOSED_BY_RIVAL).increment(1);
        if shared.core().durable_queue(&msg.durable_id).is_some() {
            return PeerResponse::Replicated(None); // Not deposed (storage): next message.
        }
    }
    if let ReplicateHeader::Append(h) = &msg.header
        && h.last.checked_sub(h.first) != Some(msg.entries.len() as u64)
    {
        return PeerResponse::BadRequest(format!(
            "replication of {:?}: {} entries for an append of [{}, {})",
            msg.durable_id,
            msg.entries.len(),
            h.first,
            h.last
        ));
    }
    if msg.more && !matches!(msg.header, ReplicateHeader::Snapshot(_)) {
        return PeerResponse::BadRequest("only a snapshot comes in several messages".into());
    }
    // No info: unchanged since this copy acknowledged it (the primary sends it once per change).
    let info = match msg.info.is_empty() {
        true => None,
        false => {
            let mut info: QueueInfo = match decode_body(&msg.info) {
                Ok(i) => i,
                Err(e) => return PeerResponse::BadRequest(format!("queue info: {e}")),
            };
            // A copy's own (stored below), never the primary's.
            info.copy_through.clear();
            info.copy_seen.clear();
            if info.durable_id.as_deref() != Some(msg.durable_id.as_str()) || info.copy.is_some() {
                return PeerResponse::BadRequest("queue info does not match the queue".into());
            }
            // The away time in this node's clock: members' clocks may differ by any amount,
            // but both readings of the elapsed time come from the primary's.
            if let Some(since) = info.away_since_ms
                && msg.sent_ms > 0
            {
                let away_for = msg.sent_ms.saturating_sub(since);
                info.away_since_ms = Some(shared.clock.now_ms().saturating_sub(away_for));
            }
            Some(info)
        }
    };
    let placed_at = msg.placement_epoch.max(epoch);
    if let Some(info) = &info
        && let Some(held) = shared.member.copies.get(&msg.durable_id)
    {
        let mut copy = held.lock().await;
        if !copy.gone
            && crate::control::reconcile::copy_of_another_queue(
                copy.info.incarnation,
                info.incarnation,
            )
        {
            // The queue copied ended and its id was placed again: a new copy starts below.
            if !drop_copy(shared, &msg.durable_id, &mut copy).await {
                return PeerResponse::Replicated(None);
            }
            metrics::counter!(m::REPLICATION_COPIES_OF_ANOTHER_QUEUE).increment(1);
            tracing::warn!(
                durable_id = %msg.durable_id,
                held = copy.info.incarnation,
                shipped = info.incarnation,
                "the copy held an ended queue of this durable id: replaced by the new queue's"
            );
        }
    }
    let cell = match &info {
        Some(info) => match copy_for(shared, &msg.durable_id, info, placed_at).await {
            Ok(c) => c,
            Err(e) => {
                tracing::warn!(durable_id = %msg.durable_id, error = %e, "cannot start a copy");
                return PeerResponse::Replicated(None);
            }
        },
        // A copy started anew (a node that lost its data) cannot start without it.
        None => match shared.member.copies.get(&msg.durable_id) {
            Some(c) => c,
            None => return PeerResponse::QueueInfoNeeded,
        },
    };
    let mut copy = cell.lock().await;
    if copy.gone {
        return PeerResponse::Replicated(None);
    }
    copy.placed_at = copy.placed_at.max(placed_at);
    let mut msg = msg;
    if let ReplicateHeader::Snapshot(h) = &msg.header {
        // A snapshot in several messages: stage the entries until the last one.
        let key = (msg.from, h.batch);
        let entries = std::mem::take(&mut msg.entries);
        let mut all = match copy.staged.take() {
            Some((k, mut staged)) if k == key => {
                staged.extend(entries);
                staged
            }
            _ => entries,
        };
        if all.len() as u64 > h.log.len() {
            return PeerResponse::BadRequest(format!(
                "snapshot of {:?}: more entries than its log holds",
                msg.durable_id
            ));
        }
        if msg.more {
            copy.staged = Some((key, all));
            return PeerResponse::Replicated(None);
        }
        if all.len() as u64 != h.log.len() {
            return PeerResponse::BadRequest(format!(
                "snapshot of {:?}: {} entries for a log of {}",
                msg.durable_id,
                all.len(),
                h.log.len()
            ));
        }
        msg.entries = std::mem::take(&mut all);
    }
    tracing::trace!(durable_id = %msg.durable_id, header = ?msg.header, "replication message");
    let (decision, first) = match &msg.header {
        ReplicateHeader::Append(h) => (copy.replica.on_append(msg.from, h), h.first),
        ReplicateHeader::Snapshot(h) => (copy.replica.on_snapshot(msg.from, h), h.log.start()),
    };
    let mut reply = None;
    let mut writes = Vec::new();
    match decision {
        Decision::Ignore | Decision::Pending => {}
        Decision::Reply(r) => reply = Some(r),
        Decision::Write(w) => writes.push(w),
    }
    let info_changed = match info {
        Some(info) if copy.info != info => {
            copy.info = info;
            true
        }
        _ => false,
    };
    let acked = copy.replica.acked();
    if let Some(w) = copy.replica.trim(acked) {
        writes.push(w);
    }
    if writes.is_empty() && info_changed {
        writes.push(copy.replica.checkpoint());
    }
    // The message's watermark holds once this copy acknowledged the log up to its end in the
    // message's epoch; a log cut back (a new primary's tail) no longer holds what it said.
    let holds_watermark = |reply: &Option<Reply>| {
        !msg.through.is_empty()
            && matches!(*reply, Some(Reply::Ack { epoch: e, end }) if e == epoch && end >= msg.through_end)
    };
    let cut_back = writes.iter().any(|w| {
        matches!(
            w.op,
            WriteOp::Snapshot { .. }
                | WriteOp::Append {
                    truncate_to: Some(_),
                    ..
                }
        )
    });
    if cut_back {
        shared.recent_forwards().copy_gone(&msg.durable_id);
    }
    let Some(last) = writes.last() else {
        if holds_watermark(&reply) {
            shared
                .recent_forwards()
                .copy_through(&msg.durable_id, &msg.through);
        }
        return PeerResponse::Replicated(reply);
    };
    let mut batch = Batch::new();
    let mut written = Vec::new();
    let copy = &mut *copy;
    for w in &writes {
        let out = Out {
            batch: &mut batch,
            bytes: &mut copy.bytes,
            written: &mut written,
        };
        if let Err(e) = add_write(out, &shared.limits, copy.qid, w, &msg.entries, first) {
            // Cannot happen with a well-formed message (the count was checked): refuse it.
            return PeerResponse::BadRequest(e.to_string());
        }
    }
    // Noted before the write and stored with it: the events this copy held stay known after a
    // restart, once its client acknowledged them and they were trimmed.
    for &body in &written {
        if let Ok(r) = decode_body::<EventRecord>(&msg.entries[body].body) {
            crate::core::note_seen(&mut copy.seen, &r.id);
        }
    }
    crate::core::bound_seen(&mut copy.seen);
    let mut stored = copy.info.clone();
    stored.copy = Some(last.state.clone());
    stored.copy_through = shared.recent_forwards().through_of(&msg.durable_id);
    stored.copy_seen = copy.seen.clone();
    let epoch = last.state.epoch;
    let last_id = last.id;
    batch.put_queue_info(
        copy.qid,
        epoch,
        encode_body(&stored).expect("queue info always encodes"),
    );
    if writes
        .iter()
        .any(|w| matches!(w.op, WriteOp::Snapshot { .. }))
    {
        metrics::counter!(m::REPLICATION_SNAPSHOTS_RECEIVED).increment(1);
    }
    if shared.apply(|_| Ok(((), batch))).await.is_err() {
        // The node stops on a failed write; the primary retransmits to whoever is next.
        return PeerResponse::Replicated(None);
    }
    if let Some(t) = copy.replica.on_durable(last_id) {
        reply = Some(t.message);
    }
    if holds_watermark(&reply) {
        shared
            .recent_forwards()
            .copy_through(&msg.durable_id, &msg.through);
    }
    PeerResponse::Replicated(reply)
}

/// Drops the copy of `id` (`copy`, locked): its entries go, and it leaves the map (later
/// messages for it are ignored). False if the write failed: the copy stays.
pub(crate) async fn drop_copy(shared: &Arc<Shared>, id: &str, copy: &mut Copy) -> bool {
    let mut batch = Batch::new();
    batch.drop_queue(copy.qid);
    if shared.apply(|_| Ok(((), batch))).await.is_err() {
        return false;
    }
    copy.gone = true;
    shared.member.copies.remove(id);
    shared.recent_forwards().copy_gone(id);
    true
}

/// The copy of `id`, started (empty, with a queue id of its own) on the first message, which
/// its primary shipped under placement epoch `placed_at`.
async fn copy_for(
    shared: &Arc<Shared>,
    id: &str,
    info: &QueueInfo,
    placed_at: u64,
) -> Result<CopyCell, WireError> {
    if let Some(c) = shared.member.copies.get(id) {
        return Ok(c);
    }
    // Starting a copy allocates an id through the core; serialised by the map so two messages
    // racing for a new copy start one.
    let qid = shared.apply(|core| Ok(core.alloc_copy_id())).await?;
    let mut map = shared.member.copies.lock();
    let cell = map.entry(id.to_string()).or_insert_with(|| {
        Arc::new(tokio::sync::Mutex::new(Copy {
            qid,
            replica: Replica::new(),
            info: info.clone(),
            gone: false,
            seen: Default::default(),
            bytes: QueueBytes::default(),
            staged: None,
            placed_at,
        }))
    });
    let cell = cell.clone();
    shared
        .member
        .copies
        .count
        .store(map.len(), Ordering::Release);
    Ok(cell)
}

/// A replica write names an offset its message does not carry: a malformed message, refused.
#[derive(Debug, thiserror::Error)]
#[error("offset {0} is not in the message")]
struct OffsetNotShipped(u64);

/// Where [`add_write`] puts what it does.
struct Out<'a> {
    batch: &'a mut Batch,
    /// The copy's byte count, kept in step with the batch (marks go into it).
    bytes: &'a mut QueueBytes,
    /// Indices of the message entries written.
    written: &'a mut Vec<usize>,
}

/// Adds the storage operations of one replica write. `entries` are the message's entries, the
/// first at replication offset `first`; replication offset `o` is stored as entry `o + 1`.
fn add_write(
    out: Out<'_>,
    limits: &Limits,
    qid: QueueId,
    w: &Write,
    entries: &[ShippedEntry],
    first: u64,
) -> Result<(), OffsetNotShipped> {
    let Out {
        batch,
        bytes,
        written,
    } = out;
    let interval = mark_interval_bytes(limits.queue_bytes_max);
    let append = |batch: &mut Batch, bytes: &mut QueueBytes, offset: u64| {
        let i = offset
            .checked_sub(first)
            .and_then(|i| usize::try_from(i).ok())
            .filter(|&i| i < entries.len())
            .ok_or(OffsetNotShipped(offset))?;
        let e = &entries[i];
        batch.append(qid, offset + 1, Entry::new(e.flags, e.body.as_slice()));
        if let Some((at, total)) = bytes.append(offset + 1, e.body.len() as u64, interval) {
            batch.put_byte_mark(qid, at, total);
        }
        Ok::<usize, OffsetNotShipped>(i)
    };
    match &w.op {
        WriteOp::Append {
            truncate_to, range, ..
        } => {
            if let Some(t) = truncate_to {
                batch.truncate_queue(qid, t + 1);
                bytes.truncate(t + 1, interval);
            }
            for o in range.clone() {
                written.push(append(batch, bytes, o)?);
            }
        }
        WriteOp::Meta => {}
        WriteOp::Snapshot { start, end } => {
            batch.truncate_queue(qid, 0);
            batch.set_acked(qid, *start);
            *bytes = QueueBytes::default();
            for o in *start..*end {
                written.push(append(batch, bytes, o)?);
            }
        }
        WriteOp::Trim { start } => {
            batch.set_acked(qid, *start);
            // Whether the trim reaches the copy's end is not known here: count conservatively.
            bytes.ack(*start, false);
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::EventId;
    use crate::replication::{EpochStart, LogState, ReplicaState};

    #[test]
    fn what_a_copy_held_is_known_again_after_a_restart() {
        let mut seen = crate::core::SeenEvents::new();
        let id = EventId {
            node: "n1".into(),
            session: 4,
            seq: 90,
        };
        crate::core::note_seen(&mut seen, &id);
        let info = QueueInfo {
            durable_id: Some("d".into()),
            timeout_secs: 60,
            away_since_ms: None,
            interests: Vec::new(),
            owner: None,
            prior_runs: Vec::new(),
            promoted_at: 0,
            copy: Some(ReplicaState {
                epoch: 3,
                acked: 10,
                log: LogState::new(10, 12, vec![EpochStart { epoch: 3, first: 0 }]).unwrap(),
            }),
            copy_through: Default::default(),
            copy_seen: seen.clone(),
            incarnation: 5,
        };
        // As stored with a write of the copy, and read back at start.
        let info: QueueInfo = decode_body(&encode_body(&info).unwrap()).unwrap();
        let meta = QueueMeta {
            acked: 10,
            delivered: 12,
            epoch: 3,
            info: Vec::new(),
            end: 12,
            byte_marks: Vec::new(),
        };
        let (copies, _) = Copies::recover(vec![(7, meta, info)], |_, _, _| Ok(0)).unwrap();
        let cell = copies.get("d").expect("the copy is back");
        let copy = cell.try_lock().unwrap();
        assert_eq!(copy.seen, seen);
        assert!(
            copy.info.copy_seen.is_empty(),
            "held in the copy, not twice"
        );
    }
}
