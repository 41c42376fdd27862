//! [`Batch`]: an ordered list of write operations applied atomically by [`crate::Store::write`].

use std::sync::Arc;

/// Queue identifier (chosen by the caller).
pub type QueueId = u64;
/// Position of an entry in a queue. Offsets of a queue start at 1; 0 means "none".
pub type Offset = u64;

/// One stored log entry. Stored value is `[flags][body...]`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Entry {
    /// Caller-defined flag byte, stored in front of the body.
    pub flags: u8,
    /// Opaque payload.
    pub body: Arc<[u8]>,
}

impl Entry {
    /// Convenience constructor.
    pub fn new(flags: u8, body: impl Into<Arc<[u8]>>) -> Self {
        Entry {
            flags,
            body: body.into(),
        }
    }
}

/// Metadata of one queue, as returned by [`crate::Store::queue_meta`] and [`crate::Store::queues`].
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct QueueMeta {
    /// All entries `<= acked` are acknowledged and deleted.
    pub acked: Offset,
    /// Highest offset ever written to the wire.
    pub delivered: Offset,
    /// Caller-defined epoch, stored together with `info`.
    pub epoch: u64,
    /// Opaque blob owned by the caller (durable id, timeout, interests).
    pub info: Vec<u8>,
    /// Highest stored offset, or `acked` when no entry is stored (derived on read, never
    /// stored). Precisely `max(highest stored offset, acked)`, so it never goes below `acked`.
    pub end: Offset,
    /// The queue's byte marks above `acked`, ascending offset: `(offset, value)` as put by
    /// [`Batch::put_byte_mark`] (the caller's cumulative byte count through that entry).
    pub byte_marks: Vec<(Offset, u64)>,
}

/// One operation of a [`Batch`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Op {
    /// Store `entry` at `(queue, offset)` (overwrites an existing entry there).
    Append {
        queue: QueueId,
        offset: Offset,
        entry: Entry,
    },
    /// Set epoch and info; creates the queue's metadata if absent.
    PutQueueInfo {
        queue: QueueId,
        epoch: u64,
        info: Vec<u8>,
    },
    /// Delete every entry and byte mark `<= acked` and record `acked`.
    SetAcked { queue: QueueId, acked: Offset },
    /// Record a byte mark of the queue at `offset` (overwrites one there).
    PutByteMark {
        queue: QueueId,
        offset: Offset,
        bytes: u64,
    },
    /// Record `delivered`.
    SetDelivered { queue: QueueId, delivered: Offset },
    /// Delete all entries, byte marks and metadata of the queue.
    DropQueue { queue: QueueId },
    /// Delete every entry and byte mark `>= from` (a divergent tail); metadata is kept.
    TruncateQueue { queue: QueueId, from: Offset },
    /// Put a key of a region.
    RegionPut {
        region: String,
        key: String,
        value: Vec<u8>,
    },
    /// Delete a key of a region (no error if absent).
    RegionDelete { region: String, key: String },
    /// Put a node-state key.
    StatePut { key: String, value: Vec<u8> },
}

/// An ordered group of writes, applied all-or-nothing, in order, by [`crate::Store::write`].
///
/// Building a batch never fails; arguments are validated when the batch is written, and an
/// invalid op rejects the whole batch before anything is applied.
#[derive(Default, Debug, Clone)]
pub struct Batch {
    ops: Vec<Op>,
}

impl Batch {
    /// An empty batch.
    pub fn new() -> Self {
        Self::default()
    }
    /// True when the batch holds no op.
    pub fn is_empty(&self) -> bool {
        self.ops.is_empty()
    }
    /// Number of ops.
    pub fn len(&self) -> usize {
        self.ops.len()
    }
    /// The ops, in application order.
    pub fn ops(&self) -> &[Op] {
        &self.ops
    }
    /// Removes every op, keeping the allocation.
    pub fn clear(&mut self) {
        self.ops.clear();
    }
    /// Stores `entry` at `offset` of `queue`.
    pub fn append(&mut self, queue: QueueId, offset: Offset, entry: Entry) {
        self.ops.push(Op::Append {
            queue,
            offset,
            entry,
        });
    }
    /// Sets epoch and info; creates the queue's metadata if absent (acked/delivered default 0).
    pub fn put_queue_info(&mut self, queue: QueueId, epoch: u64, info: Vec<u8>) {
        self.ops.push(Op::PutQueueInfo { queue, epoch, info });
    }
    /// Deletes every entry and byte mark `<= acked` (DeleteRanges in RocksDB) and records
    /// `acked`, atomically. Creates the queue's metadata if absent.
    pub fn set_acked(&mut self, queue: QueueId, acked: Offset) {
        self.ops.push(Op::SetAcked { queue, acked });
    }
    /// Records a byte mark: `bytes` is the caller's cumulative count of the queue's entry bytes
    /// through `offset`. Marks go with the entries (acked, truncated, dropped alike) and come
    /// back in [`QueueMeta::byte_marks`], so a restart finds a queue's byte count from a few
    /// marks instead of reading its whole backlog. Does not create the queue's metadata.
    pub fn put_byte_mark(&mut self, queue: QueueId, offset: Offset, bytes: u64) {
        self.ops.push(Op::PutByteMark {
            queue,
            offset,
            bytes,
        });
    }
    /// Records `delivered`. Creates the queue's metadata if absent.
    pub fn set_delivered(&mut self, queue: QueueId, delivered: Offset) {
        self.ops.push(Op::SetDelivered { queue, delivered });
    }
    /// Deletes all entries, byte marks and metadata of the queue.
    pub fn drop_queue(&mut self, queue: QueueId) {
        self.ops.push(Op::DropQueue { queue });
    }
    /// Deletes every entry and byte mark at or above `from` (DeleteRanges in RocksDB);
    /// metadata stays.
    pub fn truncate_queue(&mut self, queue: QueueId, from: Offset) {
        self.ops.push(Op::TruncateQueue { queue, from });
    }
    /// Puts `key = value` in `region`.
    pub fn region_put(&mut self, region: &str, key: &str, value: Vec<u8>) {
        self.ops.push(Op::RegionPut {
            region: region.to_owned(),
            key: key.to_owned(),
            value,
        });
    }
    /// Deletes `key` from `region`.
    pub fn region_delete(&mut self, region: &str, key: &str) {
        self.ops.push(Op::RegionDelete {
            region: region.to_owned(),
            key: key.to_owned(),
        });
    }
    /// Puts a node-state key.
    pub fn state_put(&mut self, key: &str, value: Vec<u8>) {
        self.ops.push(Op::StatePut {
            key: key.to_owned(),
            value,
        });
    }
    /// Concatenates `other` after this batch's ops (group commit).
    pub fn extend(&mut self, other: Batch) {
        if self.ops.is_empty() {
            self.ops = other.ops;
        } else {
            self.ops.extend(other.ops);
        }
    }

    /// Checks every op against the store limits; used by both stores before applying anything.
    pub(crate) fn validate(&self) -> Result<(), crate::StorageError> {
        use crate::keys::{check_key, check_region, check_value};
        for op in &self.ops {
            match op {
                Op::Append { entry, .. } => check_value(entry.body.len() + 1)?,
                Op::PutQueueInfo { info, .. } => check_value(info.len() + 8)?,
                Op::SetAcked { .. }
                | Op::PutByteMark { .. }
                | Op::SetDelivered { .. }
                | Op::DropQueue { .. }
                | Op::TruncateQueue { .. } => {}
                Op::RegionPut { region, key, value } => {
                    check_region(region)?;
                    check_key(key)?;
                    check_value(value.len())?;
                }
                Op::RegionDelete { region, key } => {
                    check_region(region)?;
                    check_key(key)?;
                }
                Op::StatePut { key, value } => {
                    check_key(key)?;
                    check_value(value.len())?;
                }
            }
        }
        Ok(())
    }
}
