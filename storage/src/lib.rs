//! Tether's storage: append-only per-queue logs, queue metadata, a region (key/value)
//! store and a small node-state map, behind one synchronous [`Store`] trait.
//!
//! Two implementations share identical semantics, checked by one suite
//! ([`conformance::run_all`]): [`RocksStore`] (durable, RocksDB) and [`MemStore`]
//! (in-memory twin, for tests).
//!
//! # Writes
//! Every mutation goes through a [`Batch`], applied atomically and in op order by
//! [`Store::write`]; `sync = true` fsyncs the WAL before returning. Batches are validated
//! first (see [`MAX_REGION_NAME_BYTES`], [`MAX_KEY_BYTES`], [`MAX_VALUE_BYTES`]): an
//! invalid op rejects the whole batch and nothing is applied.
//!
//! # RocksDB key layout (all integers big-endian, so byte order = numeric order)
//! | column family | key | value |
//! |---|---|---|
//! | `entries` | queue id u64 ++ offset u64 (16 bytes) | flags u8 ++ body |
//! | `meta` | queue id u64 ++ field u8 (9 bytes) | `1` acked: u64; `2` delivered: u64; `3` info: epoch u64 ++ info blob |
//! | `regions` | region-name length u16 ++ region name ++ key | value |
//! | `state` | key | value |
//! | `marks` | queue id u64 ++ offset u64 (16 bytes) | byte mark u64 |
//!
//! One queue's entries are one contiguous key range, so acknowledging (`set_acked`) is a
//! single DeleteRange of `[(q, 0), (q, acked)]` plus the `acked` meta put (and point deletes
//! of the few byte marks at or below `acked`: a range tombstone per ack would pile up in the
//! slowly filling `marks` memtable), and `drop_queue` is a DeleteRange of the whole queue plus
//! point deletes of its meta keys. Exclusive upper
//! bounds are "key ++ 0x00" (the immediate successor), valid even at `u64::MAX`.
//! The length prefix of region keys keeps regions like `"a"` and `"ab"` disjoint.
//!
//! # Invariants
//! * A queue "exists" (is listed by [`Store::queues`], has [`Store::queue_meta`]) iff at least
//!   one of its meta fields is stored; `put_queue_info`, `set_acked` and `set_delivered` all
//!   create it, absent fields read as 0 / empty.
//! * After `set_acked(q, a)` no entry and no byte mark `<= a` of `q` is stored (until
//!   re-appended); byte marks are read back only above `acked` and only for a queue with
//!   entries (`end > acked`).
//! * [`QueueMeta::end`] is never stored: it is `max(highest stored offset, acked)`, found with
//!   one bounded reverse seek, so recovery ([`Store::queues`]) reads only the meta column
//!   family plus one seek per queue.
//! * Entries of a queue without metadata are stored and readable but not listed.
//! * Stored records with a bad layout yield [`StorageError::Corrupt`], never a panic.

use std::ops::ControlFlow;

mod batch;
pub mod conformance;
mod error;
pub mod keys;
mod mem;
mod raft_log;
mod rocks;
mod wal_reaper;

pub use batch::{Batch, Entry, Offset, Op, QueueId, QueueMeta};
pub use error::StorageError;
pub use keys::{MAX_KEY_BYTES, MAX_REGION_NAME_BYTES, MAX_VALUE_BYTES};
pub use mem::MemStore;
pub use raft_log::{
    CF_RAFT_LOG, CF_RAFT_META, RAFT_LOG_FORMAT, RAFT_LOG_FORMAT_KEY, RAFT_LOG_FORMAT_OLDEST,
    RaftLogDb,
};
pub use rocks::{
    BLOCK_CACHE_BYTES, BLOOM_BITS_PER_KEY, CF_ENTRIES, CF_MARKS, CF_META, CF_REGIONS, CF_STATE,
    ENTRIES_BLOCK_SIZE_BYTES, ENTRIES_WRITE_BUFFER_BYTES, MEMTABLE_MAX_RANGE_DELETIONS_COUNT,
    READ_AHEAD_BYTES, RocksStore, SMALL_CF_WRITE_BUFFER_BYTES, STORAGE_FORMAT, STORAGE_FORMAT_KEY,
    STORAGE_FORMAT_OLDEST, StoreTuning, WAL_BYTES_MAX,
};
pub use wal_reaper::{
    WAL_ARCHIVE_BACKLOG_BYTES_MAX, WAL_ARCHIVE_DIR, WAL_ARCHIVE_POLL_MS, WAL_ARCHIVE_TTL_SECS,
    WAL_DELETE_BYTES_PER_SEC, WAL_DELETE_CHUNK_BYTES, WAL_REAPER_WARN_INTERVAL_SECS,
};

/// Visits one region entry of [`Store::regions_scan`]: (region, key, value as stored).
pub type RegionVisitor<'a> = dyn FnMut(&str, &str, &[u8]) -> ControlFlow<()> + 'a;

/// A queue log + metadata + region + node-state store. Synchronous; implementations are
/// shared between threads.
pub trait Store: Send + Sync + 'static {
    /// Applies the whole batch atomically, in op order. `sync`: fsync the WAL before returning.
    fn write(&self, batch: &Batch, sync: bool) -> Result<(), StorageError>;
    /// Metadata of one queue (with `end` derived), None if the queue has no metadata.
    fn queue_meta(&self, queue: QueueId) -> Result<Option<QueueMeta>, StorageError>;
    /// Every queue that has metadata, ascending id. Used for recovery: does not scan
    /// entries (one reverse seek per queue finds `end`).
    fn queues(&self) -> Result<Vec<(QueueId, QueueMeta)>, StorageError>;
    /// Visits entries of `queue` with `from <= offset <= to`, ascending, stopping early once
    /// the visited bodies total `>= max_bytes` (at least one entry is visited if any exists).
    /// Returns the number visited. Bodies are borrowed slices (zero-copy in RocksDB).
    fn read_entries(
        &self,
        queue: QueueId,
        from: Offset,
        to: Offset,
        max_bytes: usize,
        visit: &mut dyn FnMut(Offset, u8, &[u8]),
    ) -> Result<usize, StorageError>;
    /// Value of `key` in `region`, None if absent.
    fn region_get(&self, region: &str, key: &str) -> Result<Option<Vec<u8>>, StorageError>;
    /// Whether `key` exists in `region` (the publish path's question: create or update),
    /// without copying its value out.
    fn region_contains(&self, region: &str, key: &str) -> Result<bool, StorageError> {
        Ok(self.region_get(region, key)?.is_some())
    }
    /// Visits the keys of a region in key (byte) order, from the first key after `after` (from
    /// the first key when None), until `visit` breaks.
    fn region_scan(
        &self,
        region: &str,
        after: Option<&str>,
        visit: &mut dyn FnMut(&str, &[u8]) -> ControlFlow<()>,
    ) -> Result<(), StorageError>;
    /// Visits every key of every region, in the store's own order of (region, key), from the
    /// first after `after` (from the first of all when None), until `visit` breaks. Resuming
    /// after the last key visited goes on where a scan stopped (a paged copy of the regions).
    fn regions_scan(
        &self,
        after: Option<(&str, &str)>,
        visit: &mut RegionVisitor<'_>,
    ) -> Result<(), StorageError>;
    /// Value of a node-state key, None if absent.
    fn state_get(&self, key: &str) -> Result<Option<Vec<u8>>, StorageError>;
    /// Flush memtables / sync WAL (used at clean shutdown).
    fn flush(&self) -> Result<(), StorageError>;
    /// Stops background work (flushes, compactions) and waits for it, so the process may exit
    /// even while a handle on the store is still alive. Call after the last write.
    fn quiesce(&self) {}
    /// What the storage engine holds in memory, by kind (for metrics); empty when it does not
    /// say.
    fn memory(&self) -> StorageMemory {
        StorageMemory::default()
    }
}

/// Memory the storage engine reports it holds, in bytes, and its level-0 file count.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct StorageMemory {
    /// Write buffers (active and immutable memtables, all column families).
    pub memtables_bytes: u64,
    /// Table readers: index and filter blocks of every open table file.
    pub table_readers_bytes: u64,
    /// The block cache's content.
    pub block_cache_bytes: u64,
    /// Of the block cache, blocks pinned by iterators and readers.
    pub block_cache_pinned_bytes: u64,
    /// Level-0 table files of the queue entries (many means compaction is behind).
    pub entries_l0_files: u64,
}
