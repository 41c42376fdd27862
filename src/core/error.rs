//! What a node finds wrong in what its storage holds, when it rebuilds its state at start or
//! reads a stored record back later. Each variant names the record, so an operator reading the
//! refusal to start knows which queue or record to look at.

use std::fmt;

use tether_storage::{Offset, QueueId, StorageError};
use tether_transport::codec::CodecError;

use crate::replication::{InvalidLog, InvalidState};

/// A stored record that did not decode.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Record {
    /// The node's set of expired durable ids.
    ExpiredIds,
    /// A queue's info (durable id, interest, replication state).
    QueueInfo(QueueId),
    /// An entry of the recent-publish log, at its offset.
    RecentPublish(Offset),
    /// A queue's entry, at its offset.
    QueueEntry(QueueId, Offset),
}

impl fmt::Display for Record {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Record::ExpiredIds => f.write_str("expired ids"),
            Record::QueueInfo(q) => write!(f, "info of queue {q}"),
            Record::RecentPublish(at) => write!(f, "recent publish {at}"),
            Record::QueueEntry(q, at) => write!(f, "entry {at} of queue {q}"),
        }
    }
}

/// Why stored state could not be read back.
#[derive(Debug, thiserror::Error)]
pub enum RecoveryError {
    /// The store itself failed.
    #[error("storage: {0}")]
    Storage(#[from] StorageError),
    /// A node-state record is not the 8-byte number it must be.
    #[error("corrupt node state record {key}: not an 8-byte number")]
    StateRecord { key: &'static str },
    /// Reading a queue's entries to count its pending bytes failed (`queue` is the store's id;
    /// the publish log and copies have theirs too).
    #[error("byte count of queue {queue}: {error}")]
    ByteCount { queue: QueueId, error: StorageError },
    /// A record did not decode.
    #[error("corrupt {record}: {error}")]
    Decode { record: Record, error: CodecError },
    /// A copy's stored replication state is not one a replica can hold.
    #[error("copy queue {queue}: {error}")]
    InvalidCopy { queue: QueueId, error: InvalidState },
    /// A queue's stored log shape (its epoch runs) is not valid.
    #[error("queue {queue} has an invalid replication log shape: {error}")]
    InvalidLog { queue: QueueId, error: InvalidLog },
    /// A copy's entries have a hole: a copy promoted with it would lose those events.
    #[error("the entries of copy queue {queue} are not contiguous: entry {entry} follows {after}")]
    CopyNotContiguous {
        queue: QueueId,
        entry: Offset,
        after: Offset,
    },
    /// A copy's info names no durable id.
    #[error("copy queue {queue} has no durable id")]
    CopyWithoutDurableId { queue: QueueId },
}

/// Why a copy could not become a queue of the core ([`NodeCore::adopt_copy`](super::NodeCore::adopt_copy)).
#[derive(Debug, thiserror::Error)]
pub enum AdoptError {
    #[error("queue {queue} is not a copy")]
    NotACopy { queue: QueueId },
    #[error("copy queue {queue} has no durable id")]
    NoDurableId { queue: QueueId },
    #[error("durable id {durable_id:?} already has a queue here")]
    DurableIdTaken { durable_id: String },
}
