//! The secondary side: checks what a primary ships against the local copy of a queue log.

use std::collections::VecDeque;
use std::fmt;
use std::ops::Range;

use super::{
    AppendHeader, Epoch, LogState, NodeId, Offset, Reply, Shipper, ShipperConfig, SnapshotHeader,
    Transmit,
};

/// The durable state of a queue copy on a secondary. Every [`Write`] carries the value to persist
/// atomically with its entries; [`Replica::recover`] rebuilds a replica from it after a crash.
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct ReplicaState {
    /// Highest epoch this copy has followed (0: none yet).
    pub epoch: Epoch,
    /// The client's cumulative ack as last shipped by a primary, within `[log.start, log.end]`.
    pub acked: Offset,
    /// The entries held.
    pub log: LogState,
}

/// Why a [`ReplicaState`] read from storage was refused.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum InvalidState {
    /// `acked` lies outside `[log.start, log.end]`.
    AckedOutsideLog,
    /// The log holds entries of an epoch above `epoch`.
    EntriesFromLaterEpoch,
}

impl fmt::Display for InvalidState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            InvalidState::AckedOutsideLog => "acked offset outside the log",
            InvalidState::EntriesFromLaterEpoch => "log holds entries of a later epoch",
        })
    }
}

impl std::error::Error for InvalidState {}

/// Identifies a [`Write`] of one [`Replica`]; ids rise in the order the writes are issued.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct WriteId(pub u64);

/// A storage operation the driver performs for a [`Replica`].
///
/// Writes must be applied in the order they were issued, each atomically together with `state`;
/// then the driver reports the highest durable one with [`Replica::on_durable`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Write {
    pub id: WriteId,
    pub op: WriteOp,
    /// The replica's durable state once this write is applied.
    pub state: ReplicaState,
}

/// What a [`Write`] does to the stored entries.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum WriteOp {
    /// From a received append batch: first delete the entries at and above `truncate_to` (a
    /// divergent tail), then store the batch's entries from its `skip`-th on, which are the
    /// entries at offsets `range`, all of epoch `epoch`. `range` may be empty (truncation only).
    Append {
        truncate_to: Option<Offset>,
        skip: usize,
        range: Range<Offset>,
        epoch: Epoch,
    },
    /// Only persist `state` (nothing to do to the entries).
    Meta,
    /// From a received snapshot: delete everything, then store the snapshot's entries, which are
    /// the entries `[start, end)`, with the queue metadata and interest it carried.
    Snapshot { start: Offset, end: Offset },
    /// Delete the entries below `start` (they are acked).
    Trim { start: Offset },
}

/// What the driver does with an append or snapshot received by a [`Replica`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Decision {
    /// Malformed or from a second primary of the same epoch: drop it, send nothing.
    Ignore,
    /// Everything is held but not durable yet: send nothing now, [`Replica::on_durable`] will
    /// produce the ack.
    Pending,
    /// Send this reply to the sender now; nothing to write. A stale epoch gets
    /// [`Reply::Fenced`], a gap or different previous entry [`Reply::Mismatch`], a batch held
    /// durably already (a duplicate) [`Reply::Ack`].
    Reply(Reply),
    /// Perform this write (with the received entries); the ack follows from
    /// [`Replica::on_durable`].
    Write(Write),
}

/// A secondary's replication state machine for one queue copy.
///
/// Inputs: [`on_append`](Self::on_append) and [`on_snapshot`](Self::on_snapshot) (return a
/// [`Decision`]), [`on_durable`](Self::on_durable) (returns the ack to send), plus
/// [`on_ack_offset`](Self::on_ack_offset) and [`trim`](Self::trim).
///
/// It tracks three ends: the log end as written (what later batches are checked against),
/// `durable_end` (as of the last durable write) and `verified_end` (the prefix known to equal the
/// current primary's log). Acks carry `min(durable, verified)`, lowered further while a
/// truncation is still pending, so an ack never claims anything a crash could take away.
#[derive(Debug)]
pub struct Replica {
    state: ReplicaState,
    primary: Option<NodeId>,
    verified_end: Offset,
    durable_end: Offset,
    pending: VecDeque<PendingWrite>,
    next_write: u64,
    ack_sent: Offset,
}

#[derive(Clone, Copy, Debug)]
struct PendingWrite {
    id: WriteId,
    end_after: Offset,
    /// Lowest offset whose durable content this write changes (MAX: none).
    changes_from: Offset,
    /// Whether the primary waits for an ack of this write.
    reply: bool,
}

impl Default for Replica {
    fn default() -> Self {
        Self::new()
    }
}

impl Replica {
    /// A new, empty copy that has followed no primary yet.
    pub fn new() -> Self {
        Self::from_state(ReplicaState::default())
    }

    /// Rebuilds a copy from its durable state after a restart.
    pub fn recover(state: ReplicaState) -> Result<Self, InvalidState> {
        if state.acked < state.log.start() || state.acked > state.log.end() {
            return Err(InvalidState::AckedOutsideLog);
        }
        if state.log.last_epoch().is_some_and(|e| e > state.epoch) {
            return Err(InvalidState::EntriesFromLaterEpoch);
        }
        Ok(Self::from_state(state))
    }

    fn from_state(state: ReplicaState) -> Self {
        Replica {
            primary: None,
            // Entries below acked are committed: equal on every copy of every later epoch.
            verified_end: state.acked,
            durable_end: state.log.end(),
            pending: VecDeque::new(),
            next_write: 0,
            ack_sent: 0,
            state,
        }
    }

    /// The state as written (including writes not yet durable). Only the `state` of a durable
    /// [`Write`] is durable.
    pub fn state(&self) -> &ReplicaState {
        &self.state
    }

    /// Highest epoch followed.
    pub fn epoch(&self) -> Epoch {
        self.state.epoch
    }

    /// The client's cumulative ack as known here.
    pub fn acked(&self) -> Offset {
        self.state.acked
    }

    /// The copy's log as written.
    pub fn log(&self) -> &LogState {
        &self.state.log
    }

    /// The primary of the current epoch, once it has been heard from.
    pub fn primary(&self) -> Option<NodeId> {
        self.primary
    }

    /// Whether writes are issued but not reported durable.
    pub fn has_pending_writes(&self) -> bool {
        !self.pending.is_empty()
    }

    /// An append batch from `from`: checks its epoch and that it attaches to the log, and decides
    /// what to write and what to answer.
    pub fn on_append(&mut self, from: NodeId, h: &AppendHeader) -> Decision {
        let well_formed = h.epoch > 0
            && h.first <= h.last
            && h.last <= h.log_end
            && (h.first == h.last || (h.entries_epoch > 0 && h.entries_epoch <= h.epoch))
            && h.prev_epoch.is_some() == (h.first > 0)
            && h.prev_epoch.is_none_or(|e| e <= h.epoch)
            && h.acked <= h.log_end;
        if !well_formed {
            return Decision::Ignore;
        }
        if let Some(decision) = self.check_epoch(from, h.epoch) {
            return decision;
        }
        let epoch = self.state.epoch;
        let log = &self.state.log;
        let mismatch = |end_hint| {
            Decision::Reply(Reply::Mismatch {
                epoch,
                end_hint,
                batch: h.batch,
            })
        };
        if h.first > log.end() {
            return mismatch(log.end());
        }
        // Entries below acked are committed, hence equal to the primary's: no need to compare.
        if h.first > self.state.acked {
            let prev = h.first - 1;
            let held = log.epoch_at(prev).expect("acked <= prev < end is covered");
            if Some(held) != h.prev_epoch {
                let run_first = log.run_first(prev).unwrap_or(prev);
                return mismatch(run_first.max(self.state.acked));
            }
        }

        // The prefix matches. Find the first held entry of the batch's range that differs.
        let (lo, hi) = (h.first.max(log.start()), h.last.min(log.end()));
        let mut conflict = hi.max(lo);
        if lo < hi {
            if log.epoch_at(lo) != Some(h.entries_epoch) {
                conflict = lo;
            } else if let Some(run_end) = log.run_end(lo).filter(|&e| e < hi) {
                conflict = run_end;
            }
        }
        let mut truncate_to = None;
        let mut write_from = None;
        if conflict < hi {
            truncate_to = Some(conflict);
            write_from = Some(conflict);
        } else if h.last > log.end() {
            write_from = Some(log.end());
        }
        // Epochs never fall along a log: a correct primary cannot send this.
        if let Some(w) = write_from.filter(|&w| w > 0)
            && log.epoch_at(w - 1).is_some_and(|e| e > h.entries_epoch)
        {
            debug_assert!(false, "batch epoch below the epoch of the entry before it");
            return Decision::Ignore;
        }
        debug_assert!(truncate_to.is_none_or(|t| t >= self.verified_end));

        let log = &mut self.state.log;
        if let Some(t) = truncate_to {
            log.truncate(t);
        }
        if write_from.is_some() {
            log.append(h.entries_epoch, h.last);
        }
        self.verified_end = self.verified_end.max(h.last);
        // An older-epoch entry at or beyond the primary's end cannot be in the primary's log.
        let stale_from = h.log_end.max(self.verified_end);
        if stale_from < log.end() && log.epoch_at(stale_from).is_some_and(|e| e < h.epoch) {
            debug_assert!(truncate_to.is_none());
            log.truncate(stale_from);
            truncate_to = Some(stale_from);
        }
        self.set_acked(h.acked);

        if truncate_to.is_none() && write_from.is_none() {
            return self.ack_if_durable(h.last);
        }
        let range = match write_from {
            Some(from_offset) => from_offset..h.last,
            None => h.last..h.last,
        };
        let skip = usize::try_from(range.start.saturating_sub(h.first)).expect("batch fits memory");
        let op = WriteOp::Append {
            truncate_to,
            skip,
            range,
            epoch: h.entries_epoch,
        };
        Decision::Write(self.issue(op, true))
    }

    /// A snapshot from `from`: installs it unless the log already holds its last entry, in which
    /// case it acts like a duplicate batch (as Raft's `InstallSnapshot`).
    pub fn on_snapshot(&mut self, from: NodeId, h: &SnapshotHeader) -> Decision {
        let well_formed = h.epoch > 0
            && h.log.last_epoch().is_none_or(|e| e <= h.epoch)
            && h.log.start() <= h.acked
            && h.acked <= h.log.end();
        if !well_formed {
            return Decision::Ignore;
        }
        if let Some(decision) = self.check_epoch(from, h.epoch) {
            return decision;
        }
        let end = h.log.end();
        let log = &self.state.log;
        let holds_last = end <= self.state.acked
            || (end <= log.end()
                && log.epoch_at(end - 1).is_some()
                && log.epoch_at(end - 1) == h.log.epoch_at(end - 1));
        if holds_last {
            self.verified_end = self.verified_end.max(end);
            let stale_from = end.max(self.verified_end);
            let log = &mut self.state.log;
            let stale =
                stale_from < log.end() && log.epoch_at(stale_from).is_some_and(|e| e < h.epoch);
            if stale {
                log.truncate(stale_from);
            }
            self.set_acked(h.acked);
            if !stale {
                return self.ack_if_durable(end);
            }
            let op = WriteOp::Append {
                truncate_to: Some(stale_from),
                skip: 0,
                range: stale_from..stale_from,
                epoch: h.epoch,
            };
            return Decision::Write(self.issue(op, true));
        }
        let acked = self.state.acked.max(h.acked);
        if acked > end {
            // Cannot happen with a correct primary: its log holds everything ever acked.
            debug_assert!(false, "snapshot ends below acked");
            return Decision::Ignore;
        }
        self.state.log = h.log.clone();
        self.state.acked = acked;
        self.verified_end = end;
        Decision::Write(self.issue(
            WriteOp::Snapshot {
                start: h.log.start(),
                end,
            },
            true,
        ))
    }

    /// The primary's ack moved to `acked`. Applied only up to the verified prefix; never moves
    /// backwards. Persisted with the next write (see [`checkpoint`](Self::checkpoint)).
    pub fn on_ack_offset(&mut self, acked: Offset) {
        self.set_acked(acked);
    }

    /// Writes issued up to `id` are durable. Returns the ack to send to the primary, if any.
    pub fn on_durable(&mut self, id: WriteId) -> Option<Transmit<Reply>> {
        let mut reply = false;
        while let Some(w) = self.pending.front().copied().filter(|w| w.id <= id) {
            self.pending.pop_front();
            self.durable_end = w.end_after;
            reply |= w.reply;
        }
        let end = self.ackable_end();
        let primary = self.primary?;
        if !(reply || end > self.ack_sent) {
            return None;
        }
        self.ack_sent = self.ack_sent.max(end);
        Some(Transmit {
            to: primary,
            message: Reply::Ack {
                epoch: self.state.epoch,
                end,
            },
        })
    }

    /// Deletes the acked entries below `new_start` (capped at `acked`). `None` if nothing to do.
    pub fn trim(&mut self, new_start: Offset) -> Option<Write> {
        let new_start = new_start.min(self.state.acked);
        if new_start <= self.state.log.start() {
            return None;
        }
        self.state.log.trim(new_start);
        Some(self.issue(WriteOp::Trim { start: new_start }, false))
    }

    /// A write that only persists the current epoch and ack, for a driver that wants them
    /// durable without waiting for the next batch.
    pub fn checkpoint(&mut self) -> Write {
        self.issue(WriteOp::Meta, false)
    }

    /// Turns this copy into the primary at `new_epoch` (chosen by cluster metadata), with its log
    /// as is: the other secondaries then catch up from it, truncating divergent tails.
    ///
    /// # Panics
    /// If writes are pending (the driver must let them become durable first, so that the
    /// shipper's log is the stored log) or `new_epoch` is not above the followed epoch.
    pub fn promote(self, new_epoch: Epoch, config: ShipperConfig) -> Shipper {
        assert!(self.pending.is_empty(), "promote with writes pending");
        assert!(
            new_epoch > self.state.epoch,
            "promotion must raise the epoch"
        );
        Shipper::new(new_epoch, self.state.log, self.state.acked, config)
    }

    /// Rejects an older epoch, follows a newer one.
    fn check_epoch(&mut self, from: NodeId, epoch: Epoch) -> Option<Decision> {
        if epoch < self.state.epoch {
            return Some(Decision::Reply(Reply::Fenced {
                epoch: self.state.epoch,
            }));
        }
        if epoch > self.state.epoch {
            self.state.epoch = epoch;
            self.primary = Some(from);
            self.verified_end = self.state.acked;
            self.ack_sent = 0;
            return None;
        }
        match self.primary {
            None => {
                self.primary = Some(from);
                None
            }
            Some(p) if p == from => None,
            Some(_) => Some(Decision::Ignore),
        }
    }

    fn set_acked(&mut self, acked: Offset) {
        self.state.acked = self.state.acked.max(acked.min(self.verified_end));
    }

    /// What an ack may claim now: durable, verified, and not about to be rewritten.
    fn ackable_end(&self) -> Offset {
        let changing = self
            .pending
            .iter()
            .map(|w| w.changes_from)
            .min()
            .unwrap_or(Offset::MAX);
        self.durable_end.min(self.verified_end).min(changing)
    }

    fn ack_if_durable(&mut self, last: Offset) -> Decision {
        let end = self.ackable_end();
        if end < last {
            return Decision::Pending;
        }
        self.ack_sent = self.ack_sent.max(end);
        Decision::Reply(Reply::Ack {
            epoch: self.state.epoch,
            end,
        })
    }

    fn issue(&mut self, op: WriteOp, reply: bool) -> Write {
        let id = WriteId(self.next_write);
        self.next_write += 1;
        let changes_from = match op {
            WriteOp::Append {
                truncate_to: Some(t),
                ..
            } => t,
            WriteOp::Snapshot { .. } => 0,
            WriteOp::Append {
                truncate_to: None, ..
            }
            | WriteOp::Meta
            | WriteOp::Trim { .. } => Offset::MAX,
        };
        self.pending.push_back(PendingWrite {
            id,
            end_after: self.state.log.end(),
            changes_from,
            reply,
        });
        Write {
            id,
            op,
            state: self.state.clone(),
        }
    }
}
