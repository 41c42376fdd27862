//! Queue replication, sans-IO: a primary ships its queue log to 0–2 secondaries (issue #3).
//!
//! Two plain state machines, no I/O, no clock, no tokio:
//!
//! - [`Shipper`]: one per queue on its **primary**. It follows the local log (the driver reports
//!   appends, trims and client acks), decides what to send to each secondary
//!   ([`Shipper::poll_transmit`]), digests the secondaries' [`Reply`]s and computes
//!   [`Shipper::replicated_end`], the offset below which every current secondary holds the entries
//!   durably. The node delivers only below it and acknowledges `--ack replicated` publishes when it
//!   passes them.
//! - [`Replica`]: one per queue copy on a **secondary**. It checks every [`AppendHeader`] and
//!   [`SnapshotHeader`] against its log (epoch fencing, Raft's `(prev offset, prev epoch)` log
//!   matching, divergent-tail truncation) and answers with a [`Decision`]: reply now, or perform a
//!   [`Write`] and report it durable with [`Replica::on_durable`], which releases the
//!   [`Reply::Ack`]. Nothing is acknowledged before it is durable.
//!
//! Entry payloads never enter the core. The core names offset ranges ("send `[first, last)` to
//! node 3", "write the batch from its 2nd entry on, after truncating at 40") and the driver moves
//! the bytes between the store and the network.
//!
//! # Model
//!
//! - A queue log holds entries at offsets `[start, end)` ([`LogState`]); `start` rises when acked
//!   entries are trimmed. Every entry carries the [`Epoch`] under which its primary appended it;
//!   [`LogState`] keeps these as runs ([`EpochStart`]), which is all log matching needs.
//! - Epochs come from cluster metadata; a promotion yields a strictly higher epoch and a node
//!   promoted at epoch `e` is the only one ever appending entries of epoch `e`. Hence two copies
//!   holding an entry at the same offset with the same epoch hold the same entry.
//! - `acked` is the client's cumulative ack: entries below it are consumed and may be trimmed.
//!
//! # Invariants
//!
//! - **Ack after durable**: a [`Reply::Ack`] `{ epoch, end }` means "my durable log equals the
//!   epoch-`epoch` primary's log on `[.., end)`", and is only produced from durable state.
//! - **Replicated end**: every current secondary durably holds every entry below
//!   [`Shipper::replicated_end`] (apart from trimmed, acked entries). It never decreases during the
//!   life of a [`Shipper`]; a promoted or restarted primary starts it at its `acked`.
//! - **Promotion safety** follows: a secondary of the current replica set that is promoted
//!   ([`Replica::promote`]) holds everything ever exposed below a `replicated_end`, so nothing that
//!   was delivered or acknowledged as replicated is lost. Secondaries added to a running primary
//!   are not promotable until [`Shipper::peer_in_sync`] says so.
//! - **Committed entries are never truncated**: a secondary truncates only entries that provably
//!   differ from the current primary's log (a conflicting epoch at an offset, or an older-epoch
//!   entry at or beyond the primary's end), never below its `acked`.
//!
//! The deterministic simulation in `tests/replication_sim.rs` checks these at every step under
//! message loss, duplication, reordering, partitions, crashes and failovers.
//!
//! # Driver contract
//!
//! - **Primary**: after the queue core appends durably, call [`Shipper::on_local_append`] and
//!   persist [`Shipper::log`] with the entries (its epoch runs change at a new epoch's first
//!   append). Report trims and client acks. After every input, drain
//!   [`Shipper::poll_transmit`]; read `[first, last)` (or the whole queue for a snapshot) from the
//!   store when polling and send. Call [`Shipper::on_tick`] at [`Shipper::poll_timeout`]. Deliver
//!   and acknowledge `--ack replicated` publishes only below [`Shipper::replicated_end`]; stop
//!   appending and delivering once [`Shipper::fenced`] is `Some`.
//! - **Secondary**: hand each received header to [`Replica::on_append`] or
//!   [`Replica::on_snapshot`] and act on the [`Decision`]. Apply [`Write`]s in issue order, each
//!   atomically with its `state`, then call [`Replica::on_durable`] and send the ack it returns.
//!   After a crash, rebuild with [`Replica::recover`] from the last durable `state`.
//! - **Any node** receiving an append or snapshot for a queue it is primary of calls
//!   [`Shipper::on_rival_primary`] and sends back the reply it returns.
//! - **Promotion**: let pending writes become durable, then [`Replica::promote`], persist the new
//!   epoch and call [`Shipper::set_secondaries`].
use serde::{Deserialize, Serialize};

mod log;
mod replica;
mod shipper;

#[cfg(test)]
mod tests;

pub use log::{EpochStart, InvalidLog, LogState};
pub use replica::{Decision, InvalidState, Replica, ReplicaState, Write, WriteId, WriteOp};
pub use shipper::{Shipper, ShipperConfig};

/// Position of an entry in a queue log. Logs hold `[start, end)`.
pub type Offset = u64;
/// Primary generation from cluster metadata. Valid epochs start at 1; 0 means "none yet".
pub type Epoch = u64;
pub use crate::ids::NodeId;

/// Entries in one [`AppendHeader`] batch, by default.
pub const BATCH_ENTRIES_MAX: u64 = 256;
/// Append batches a primary has on the wire to one secondary before it waits for acks, by default.
pub const BATCHES_IN_FLIGHT_PER_PEER_MAX: usize = 8;
/// Time after which an unanswered append batch (and everything sent after it) is sent again,
/// in milliseconds.
pub const RETRANSMIT_MS: u64 = 1_000;
/// Time after which an unanswered snapshot is sent again, in milliseconds. Snapshots ship a whole
/// queue, so they get far longer than batches.
pub const SNAPSHOT_RETRANSMIT_MS: u64 = 30_000;
/// Longest quiet time on an idle link before the primary sends an empty append (heartbeat),
/// in milliseconds. It carries `acked` and lets a deposed primary learn that it is fenced.
pub const HEARTBEAT_MS: u64 = 250;

const _: () = {
    assert!(BATCH_ENTRIES_MAX > 0);
    assert!(BATCHES_IN_FLIGHT_PER_PEER_MAX > 0);
    // An idle link must see a heartbeat well before a batch would be declared lost.
    assert!(HEARTBEAT_MS < RETRANSMIT_MS);
    assert!(RETRANSMIT_MS <= SNAPSHOT_RETRANSMIT_MS);
};

/// A message for a peer: the driver sends `message` to node `to`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Transmit<M> {
    pub to: NodeId,
    pub message: M,
}

/// A message from a primary to a secondary.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ToSecondary {
    /// Entries `[first, last)`: the driver reads them from its store and sends them with the
    /// header. An empty batch (`first == last`) is a probe or heartbeat.
    Append(AppendHeader),
    /// The whole queue `[log.start, log.end)`: the driver ships every entry plus the queue's
    /// metadata and interest, read at the time it polled this message.
    Snapshot(SnapshotHeader),
}

/// Header of an append batch: entries `[first, last)`, all appended under `entries_epoch`.
///
/// A batch never spans two epoch runs, so one epoch describes all its entries.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct AppendHeader {
    /// The sending primary's epoch.
    pub epoch: Epoch,
    /// Identifies the batch among those the primary sent (echoed by [`Reply::Mismatch`]).
    pub batch: u64,
    /// First offset of the batch.
    pub first: Offset,
    /// End of the batch (exclusive). Equal to `first` for a probe or heartbeat.
    pub last: Offset,
    /// Epoch of the primary's entry at `first - 1` (log matching); `None` when `first == 0`.
    pub prev_epoch: Option<Epoch>,
    /// Epoch of every entry in the batch (meaningless for an empty batch).
    pub entries_epoch: Epoch,
    /// The primary's log end when it sent the batch: an older-epoch entry a secondary holds at or
    /// beyond it cannot be in the primary's log and is truncated.
    pub log_end: Offset,
    /// The primary's `acked`.
    pub acked: Offset,
}

/// Header of a snapshot: the primary's whole log, sent when a secondary needs entries below the
/// primary's `start`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SnapshotHeader {
    /// The sending primary's epoch.
    pub epoch: Epoch,
    /// Identifies the snapshot among the messages the primary sent.
    pub batch: u64,
    /// Shape of the shipped log: `[start, end)` and the epoch runs of its entries.
    pub log: LogState,
    /// The primary's `acked`, within `[log.start, log.end]`.
    pub acked: Offset,
}

/// A secondary's answer to an [`AppendHeader`] or [`SnapshotHeader`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Reply {
    /// My durable log equals the epoch-`epoch` primary's log on `[.., end)`.
    Ack { epoch: Epoch, end: Offset },
    /// You are deposed: I already follow `epoch`, which is higher than yours.
    Fenced { epoch: Epoch },
    /// Batch `batch` does not attach to my log (a gap, or a different entry at `first - 1`):
    /// resume at `end_hint`, which is at most my end and at least my `acked`.
    Mismatch {
        epoch: Epoch,
        end_hint: Offset,
        batch: u64,
    },
}

impl Reply {
    /// The epoch the reply was made under.
    pub fn epoch(&self) -> Epoch {
        match *self {
            Reply::Ack { epoch, .. } | Reply::Fenced { epoch } | Reply::Mismatch { epoch, .. } => {
                epoch
            }
        }
    }
}
