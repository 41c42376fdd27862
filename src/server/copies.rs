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
//! Every message from a primary is handled under the copy's lock, and every write is committed
//! (with the node's sync mode) before the reply leaves: an ack always means durable.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use tether_storage::{Batch, Entry, QueueId, QueueMeta};
use tether_transport::codec::{decode_body, encode_body};

use super::Shared;
use crate::cluster::network::{PeerResponse, ReplicateHeader, ReplicateMsg, ShippedEntry};
use crate::core::QueueInfo;
use crate::metrics as m;
use crate::protocol::EventRecord;
use crate::replication::{Decision, Replica, Write, WriteOp};

/// One queue copy.
pub(crate) struct Copy {
    pub(crate) qid: QueueId,
    pub(crate) replica: Replica,
    /// The primary's queue info as last received (`copy` unset).
    pub(crate) info: QueueInfo,
    /// Removed from [`Copies`] (promoted or dropped): later messages are ignored.
    pub(crate) gone: bool,
    /// Per publisher `(node, session)`, the highest event sequence written to this copy since
    /// the node started (with the entries held, what a promotion must not append again).
    pub(crate) seen: crate::core::SeenEvents,
    /// The first messages of a snapshot sent in several: (sender, snapshot batch) and entries.
    staged: Option<((u64, u64), Vec<ShippedEntry>)>,
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
    /// Rebuilds the copies found in storage at start.
    pub(crate) fn recover(stored: Vec<(QueueId, QueueMeta, QueueInfo)>) -> Result<Self, String> {
        let mut map = HashMap::new();
        for (qid, _meta, mut info) in stored {
            let state = info.copy.take().expect("split_copies returns copies");
            let replica = Replica::recover(state).map_err(|e| format!("copy queue {qid}: {e}"))?;
            let id = info
                .durable_id
                .clone()
                .ok_or_else(|| format!("copy queue {qid} has no durable id"))?;
            let copy = Copy {
                qid,
                replica,
                info,
                gone: false,
                seen: Default::default(),
                staged: None,
            };
            map.insert(id, Arc::new(tokio::sync::Mutex::new(copy)));
        }
        Ok(Copies {
            count: AtomicUsize::new(map.len()),
            map: Mutex::new(map),
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, CopyCell>> {
        self.map.lock().unwrap_or_else(|p| p.into_inner())
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

    /// Whether this node holds any copy.
    pub(crate) fn held(&self) -> bool {
        self.len() > 0
    }
}

/// Handles one replication message from a primary (see the module docs).
pub(crate) async fn handle(shared: &Arc<Shared>, msg: ReplicateMsg) -> PeerResponse {
    let epoch = match &msg.header {
        ReplicateHeader::Append(h) => h.epoch,
        ReplicateHeader::Snapshot(h) => h.epoch,
    };
    // This node is primary of the queue: a stale primary learns it is fenced, a newer one
    // fences us (the reconciler then follows the metadata).
    if let Some(reply) = shared.shipping.on_rival(&msg.durable_id, epoch) {
        return PeerResponse::Replicated(reply);
    }
    if shared.core().durable_queue(&msg.durable_id).is_some() {
        // Our own queue without copies: metadata will depose us if the sender is right.
        return PeerResponse::Replicated(None);
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
    let info: QueueInfo = match decode_body(&msg.info) {
        Ok(i) => i,
        Err(e) => return PeerResponse::BadRequest(format!("queue info: {e}")),
    };
    if info.durable_id.as_deref() != Some(msg.durable_id.as_str()) || info.copy.is_some() {
        return PeerResponse::BadRequest("queue info does not match the queue".into());
    }
    let cell = match copy_for(shared, &msg.durable_id, &info).await {
        Ok(c) => c,
        Err(e) => {
            tracing::warn!(durable_id = %msg.durable_id, error = %e, "cannot start a copy");
            return PeerResponse::Replicated(None);
        }
    };
    let mut copy = cell.lock().await;
    if copy.gone {
        return PeerResponse::Replicated(None);
    }
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
    let info_changed = copy.info != info;
    copy.info = info;
    let acked = copy.replica.acked();
    if let Some(w) = copy.replica.trim(acked) {
        writes.push(w);
    }
    if writes.is_empty() && info_changed {
        writes.push(copy.replica.checkpoint());
    }
    let Some(last) = writes.last() else {
        return PeerResponse::Replicated(reply);
    };
    let mut batch = Batch::new();
    let mut written = Vec::new();
    for w in &writes {
        if let Err(e) = add_write(&mut batch, copy.qid, w, &msg.entries, first, &mut written) {
            // Cannot happen with a well-formed message (the count was checked): refuse it.
            return PeerResponse::BadRequest(e);
        }
    }
    let mut stored = copy.info.clone();
    stored.copy = Some(last.state.clone());
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
    for body in written {
        if let Ok(r) = decode_body::<EventRecord>(&msg.entries[body].body) {
            crate::core::note_seen(&mut copy.seen, &r.id);
        }
    }
    PeerResponse::Replicated(reply)
}

/// The copy of `id`, started (empty, with a queue id of its own) on the first message.
async fn copy_for(shared: &Arc<Shared>, id: &str, info: &QueueInfo) -> Result<CopyCell, String> {
    if let Some(c) = shared.copies.get(id) {
        return Ok(c);
    }
    // Starting a copy allocates an id through the core; serialised by the map so two messages
    // racing for a new copy start one.
    let qid = shared
        .apply(|core| Ok(core.alloc_copy_id()))
        .await
        .map_err(|e| e.message)?;
    let mut map = shared.copies.lock();
    let cell = map.entry(id.to_string()).or_insert_with(|| {
        Arc::new(tokio::sync::Mutex::new(Copy {
            qid,
            replica: Replica::new(),
            info: info.clone(),
            gone: false,
            seen: Default::default(),
            staged: None,
        }))
    });
    let cell = cell.clone();
    shared.copies.count.store(map.len(), Ordering::Release);
    Ok(cell)
}

/// Adds the storage operations of one replica write. `entries` are the message's entries, the
/// first at replication offset `first`; replication offset `o` is stored as entry `o + 1`.
fn add_write(
    batch: &mut Batch,
    qid: QueueId,
    w: &Write,
    entries: &[ShippedEntry],
    first: u64,
    written: &mut Vec<usize>,
) -> Result<(), String> {
    let mut entry = |offset: u64| -> Result<Entry, String> {
        let i = offset
            .checked_sub(first)
            .and_then(|i| usize::try_from(i).ok())
            .filter(|&i| i < entries.len())
            .ok_or_else(|| format!("offset {offset} is not in the message"))?;
        written.push(i);
        let e = &entries[i];
        Ok(Entry::new(e.flags, e.body.as_slice()))
    };
    match &w.op {
        WriteOp::Append {
            truncate_to, range, ..
        } => {
            if let Some(t) = truncate_to {
                batch.truncate_queue(qid, t + 1);
            }
            for o in range.clone() {
                batch.append(qid, o + 1, entry(o)?);
            }
        }
        WriteOp::Meta => {}
        WriteOp::Snapshot { start, end } => {
            batch.truncate_queue(qid, 0);
            batch.set_acked(qid, *start);
            for o in *start..*end {
                batch.append(qid, o + 1, entry(o)?);
            }
        }
        WriteOp::Trim { start } => batch.set_acked(qid, *start),
    }
    Ok(())
}
