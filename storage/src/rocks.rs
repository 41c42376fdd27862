//! [`RocksStore`]: the durable [`Store`] on RocksDB. Key layout is in [`crate::keys`] and
//! described in the crate documentation.

use std::collections::HashMap;
use std::ops::ControlFlow;
use std::path::Path;

use rocksdb::{
    BlockBasedOptions, Cache, ColumnFamily, ColumnFamilyDescriptor, DB, DBCompressionType,
    FlushOptions, Options, ReadOptions, WriteBatch, WriteOptions,
};

use crate::batch::Op;
use crate::keys::{self, META_FIELD_ACKED, META_FIELD_DELIVERED, META_FIELD_INFO};
use crate::wal_reaper::{WAL_ARCHIVE_DIR, WAL_ARCHIVE_TTL_SECS, WalReaper};
use crate::{Batch, Offset, QueueId, QueueMeta, StorageError, Store};

/// Column family of queue entries.
pub const CF_ENTRIES: &str = "entries";
/// Column family of queue metadata.
pub const CF_META: &str = "meta";
/// Column family of region key/values.
pub const CF_REGIONS: &str = "regions";
/// Column family of the node-state map.
pub const CF_STATE: &str = "state";
/// Column family of queue byte marks (same key layout as `entries`).
pub const CF_MARKS: &str = "marks";
const ALL_CFS: [&str; 5] = [CF_ENTRIES, CF_META, CF_REGIONS, CF_STATE, CF_MARKS];

/// Shared LRU block cache for all column families, in bytes.
pub const BLOCK_CACHE_BYTES: usize = 64 << 20;
/// Block size of the `entries` column family, in bytes (large: entries are read in runs).
pub const ENTRIES_BLOCK_SIZE_BYTES: usize = 32 << 10;
/// Memtable size of the `entries` column family, in bytes.
pub const ENTRIES_WRITE_BUFFER_BYTES: usize = 64 << 20;
/// Memtable size of the small column families, in bytes.
pub const SMALL_CF_WRITE_BUFFER_BYTES: usize = 8 << 20;
/// A memtable of `entries` (one range tombstone per `set_acked`) or `marks` (truncations and
/// drops) holding this many range tombstones is flushed, so reads and flushes never wade
/// through an unbounded tombstone list.
pub const MEMTABLE_MAX_RANGE_DELETIONS_COUNT: usize = 2000;
/// Write-ahead log kept before RocksDB flushes the column families that hold it back, in
/// bytes (a rarely written column family would otherwise keep every log file alive).
pub const WAL_BYTES_MAX: u64 = 256 << 20;
/// Iterator readahead for `read_entries`, in bytes.
pub const READ_AHEAD_BYTES: usize = 256 << 10;
/// Bloom filter bits per key for the point-read column families (meta, regions, state).
pub const BLOOM_BITS_PER_KEY: f64 = 10.0;

/// Durable store on RocksDB (one DB, five column families). `Send + Sync`; all methods
/// take `&self` and may be called from several threads.
pub struct RocksStore {
    db: DB,
    _cache: Cache,
    /// Deletes the logs RocksDB archives (see [`crate::wal_reaper`]); stopped on drop.
    _reaper: WalReaper,
}

impl std::fmt::Debug for RocksStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RocksStore")
            .field("path", &self.db.path())
            .finish()
    }
}

/// The storage layout this build writes (keys, records, column families). Raised with every
/// change a previous build could not read; recorded in each data directory.
pub const STORAGE_FORMAT: u32 = 1;
/// The oldest layout this build reads (one version back is accepted, once there is one).
pub const STORAGE_FORMAT_OLDEST: u32 = 1;
const _: () =
    assert!(STORAGE_FORMAT_OLDEST <= STORAGE_FORMAT && STORAGE_FORMAT_OLDEST + 1 >= STORAGE_FORMAT);
/// Node-state key of a data directory's storage format (a big-endian `u32`).
pub const STORAGE_FORMAT_KEY: &str = "tether-storage-format";

/// How a [`RocksStore`] uses the disk where an operator may choose (`RocksStore::open_tuned`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct StoreTuning {
    /// Flushes and compactions read and write their tables with direct I/O (`O_DIRECT`),
    /// past the page cache. Live writes then wait less behind the log's sync while RocksDB
    /// writes tables in the background; a replay of events just flushed reads them from the
    /// disk instead of the page cache (BENCHMARKS.md has the figures). Needs a file system
    /// that supports `O_DIRECT`.
    pub direct_io_for_flush_and_compaction: bool,
}

impl RocksStore {
    /// Opens (creating if missing) the database in `dir`, with the default tuning.
    pub fn open(dir: &Path) -> Result<Self, StorageError> {
        Self::open_tuned(dir, StoreTuning::default())
    }

    /// Opens (creating if missing) the database in `dir`.
    pub fn open_tuned(dir: &Path, tuning: StoreTuning) -> Result<Self, StorageError> {
        let cache = Cache::new_lru_cache(BLOCK_CACHE_BYTES);

        let mut db_opts = Options::default();
        db_opts.create_if_missing(true);
        db_opts.create_missing_column_families(true);
        db_opts.set_max_open_files(-1);
        db_opts.set_max_total_wal_size(WAL_BYTES_MAX);
        // Obsolete logs are renamed into `archive/` and deleted gradually by the reaper.
        db_opts.set_wal_ttl_seconds(WAL_ARCHIVE_TTL_SECS);
        let cores = std::thread::available_parallelism().map_or(2, |n| n.get());
        db_opts.increase_parallelism(i32::try_from(cores).unwrap_or(2).max(2));
        db_opts
            .set_use_direct_io_for_flush_and_compaction(tuning.direct_io_for_flush_and_compaction);

        let mut entries_table = BlockBasedOptions::default();
        entries_table.set_block_size(ENTRIES_BLOCK_SIZE_BYTES);
        entries_table.set_block_cache(&cache);
        let mut entries_opts = Options::default();
        entries_opts.set_compression_type(DBCompressionType::None);
        entries_opts.set_write_buffer_size(ENTRIES_WRITE_BUFFER_BYTES);
        entries_opts.set_block_based_table_factory(&entries_table);

        let small = |compression: DBCompressionType| {
            let mut table = BlockBasedOptions::default();
            table.set_block_cache(&cache);
            table.set_bloom_filter(BLOOM_BITS_PER_KEY, false);
            let mut o = Options::default();
            o.set_compression_type(compression);
            o.set_write_buffer_size(SMALL_CF_WRITE_BUFFER_BYTES);
            o.set_block_based_table_factory(&table);
            o
        };

        let cfs = vec![
            ColumnFamilyDescriptor::new(CF_ENTRIES, entries_opts),
            ColumnFamilyDescriptor::new(CF_META, small(DBCompressionType::None)),
            ColumnFamilyDescriptor::new(CF_REGIONS, small(DBCompressionType::Lz4)),
            ColumnFamilyDescriptor::new(CF_STATE, small(DBCompressionType::None)),
            ColumnFamilyDescriptor::new(CF_MARKS, small(DBCompressionType::None)),
        ];
        let db = DB::open_cf_descriptors(&db_opts, dir, cfs)?;
        let reaper =
            WalReaper::spawn(dir.join(WAL_ARCHIVE_DIR)).map_err(|source| StorageError::Io {
                what: "starting the write-ahead log reaper",
                source,
            })?;
        let store = RocksStore {
            db,
            _cache: cache,
            _reaper: reaper,
        };
        // Not exposed by the rocksdb crate's Options; it is a mutable CF option, so set it
        // on every open.
        let limit = MEMTABLE_MAX_RANGE_DELETIONS_COUNT.to_string();
        for cf in [CF_ENTRIES, CF_MARKS] {
            store
                .db
                .set_options_cf(store.cf(cf)?, &[("memtable_max_range_deletions", &limit)])?;
        }
        store.check_format()?;
        tracing::debug!(path = %dir.display(), ?tuning, "opened rocksdb store");
        Ok(store)
    }

    /// Checks the directory's storage format ([`STORAGE_FORMAT_KEY`]) against the formats
    /// this build reads, and records this build's in a directory that has none (a new one, or
    /// one written before formats were recorded: format 1).
    fn check_format(&self) -> Result<(), StorageError> {
        let record = self.state_get(STORAGE_FORMAT_KEY)?;
        if crate::error::check_format_record(
            "storage",
            record.as_deref(),
            STORAGE_FORMAT_OLDEST,
            STORAGE_FORMAT,
        )? {
            let mut b = Batch::new();
            b.state_put(STORAGE_FORMAT_KEY, STORAGE_FORMAT.to_be_bytes().to_vec());
            self.write(&b, true)?;
        }
        Ok(())
    }

    /// Offsets of `queue`'s stored byte marks at or below `to`.
    fn marks_through(
        &self,
        marks: &ColumnFamily,
        queue: QueueId,
        to: Offset,
    ) -> Result<Vec<Offset>, StorageError> {
        let lower = keys::entry_key(queue, 0);
        let mut ro = ReadOptions::default();
        ro.set_iterate_lower_bound(lower.to_vec());
        ro.set_iterate_upper_bound(keys::entry_key_after(queue, to).to_vec());
        let mut it = self.db.raw_iterator_cf_opt(marks, ro);
        it.seek(lower);
        let mut out = Vec::new();
        while let Some(k) = it.key() {
            out.push(keys::decode_entry_key(k)?.1);
            it.next();
        }
        it.status()?;
        Ok(out)
    }

    fn cf(&self, name: &'static str) -> Result<&ColumnFamily, StorageError> {
        self.db
            .cf_handle(name)
            .ok_or(StorageError::MissingColumnFamily(name))
    }

    /// Highest stored offset of `queue`, by one bounded reverse seek.
    fn last_offset(&self, queue: QueueId) -> Result<Option<Offset>, StorageError> {
        let mut ro = ReadOptions::default();
        ro.set_iterate_lower_bound(keys::entry_key(queue, 0).to_vec());
        ro.set_iterate_upper_bound(keys::entry_key_after(queue, Offset::MAX).to_vec());
        let mut it = self.db.raw_iterator_cf_opt(self.cf(CF_ENTRIES)?, ro);
        it.seek_for_prev(keys::entry_key(queue, Offset::MAX));
        let last = match it.key() {
            Some(k) => Some(keys::decode_entry_key(k)?.1),
            None => None,
        };
        it.status()?;
        Ok(last)
    }

    /// Folds one `meta` record into `m`.
    fn apply_meta_field(m: &mut QueueMeta, field: u8, value: &[u8]) -> Result<(), StorageError> {
        match field {
            META_FIELD_ACKED => m.acked = keys::decode_u64_value(value, "acked")?,
            META_FIELD_DELIVERED => m.delivered = keys::decode_u64_value(value, "delivered")?,
            META_FIELD_INFO => {
                let (epoch, info) = keys::decode_info_value(value)?;
                m.epoch = epoch;
                m.info = info.to_vec();
            }
            other => return Err(StorageError::Corrupt(format!("unknown meta field {other}"))),
        }
        Ok(())
    }

    /// The byte marks of `queue` above `acked`, ascending.
    fn byte_marks(
        &self,
        queue: QueueId,
        acked: Offset,
    ) -> Result<Vec<(Offset, u64)>, StorageError> {
        let lower = keys::entry_key(queue, acked.saturating_add(1));
        let mut ro = ReadOptions::default();
        ro.set_iterate_lower_bound(lower.to_vec());
        ro.set_iterate_upper_bound(keys::entry_key_after(queue, Offset::MAX).to_vec());
        ro.fill_cache(false);
        let mut it = self.db.raw_iterator_cf_opt(self.cf(CF_MARKS)?, ro);
        it.seek(lower);
        let mut marks = Vec::new();
        while let Some((k, v)) = it.item() {
            let (_, offset) = keys::decode_entry_key(k)?;
            marks.push((offset, keys::decode_u64_value(v, "byte mark")?));
            it.next();
        }
        it.status()?;
        Ok(marks)
    }

    fn finish_meta(&self, queue: QueueId, mut m: QueueMeta) -> Result<QueueMeta, StorageError> {
        m.end = self.last_offset(queue)?.unwrap_or(0).max(m.acked);
        if m.end > m.acked {
            m.byte_marks = self.byte_marks(queue, m.acked)?;
        }
        Ok(m)
    }
}

/// A RocksDB write batch's header, in bytes.
const WRITE_BATCH_HEADER_BYTES: usize = 12;
/// What a write batch adds to an operation's key and value, at most, in bytes: its type, a
/// column family id and two lengths (varints).
const WRITE_BATCH_RECORD_OVERHEAD_BYTES: usize = 16;
/// What the operations without a value of their own (deletes, acks, byte marks, range
/// deletes) take in a write batch, about, in bytes.
const WRITE_BATCH_SMALL_RECORD_BYTES: usize = 64;

/// About the bytes `batch` takes as a RocksDB write batch (a few deletes of byte marks
/// not counted): the capacity the write batch is created with.
fn write_batch_bytes(batch: &Batch) -> usize {
    let record = |key: usize, value: usize| WRITE_BATCH_RECORD_OVERHEAD_BYTES + key + value;
    WRITE_BATCH_HEADER_BYTES
        + batch
            .ops()
            .iter()
            .map(|op| match op {
                Op::Append { entry, .. } => record(keys::ENTRY_KEY_BYTES, 1 + entry.body.len()),
                Op::PutQueueInfo { info, .. } => record(keys::META_KEY_BYTES, 8 + info.len()),
                Op::RegionPut { region, key, value } => {
                    record(2 + region.len() + key.len(), value.len())
                }
                Op::RegionDelete { region, key } => record(2 + region.len() + key.len(), 0),
                Op::StatePut { key, value } => record(key.len(), value.len()),
                Op::SetAcked { .. }
                | Op::PutByteMark { .. }
                | Op::SetDelivered { .. }
                | Op::DropQueue { .. }
                | Op::TruncateQueue { .. } => WRITE_BATCH_SMALL_RECORD_BYTES,
            })
            .sum::<usize>()
}

impl RocksStore {
    /// `batch` (validated, not empty) as RocksDB's write batch.
    fn write_batch(&self, batch: &Batch) -> Result<WriteBatch, StorageError> {
        let entries = self.cf(CF_ENTRIES)?;
        let meta = self.cf(CF_META)?;
        let regions = self.cf(CF_REGIONS)?;
        let state = self.cf(CF_STATE)?;
        let marks = self.cf(CF_MARKS)?;
        // Sized up front: grown by doubling, the batch of a large group commit was copied
        // over and over (its string's reallocations and their page faults took a fifth of the
        // writer thread in a publish profile).
        let mut wb = WriteBatch::with_capacity_bytes(write_batch_bytes(batch));
        // One buffer for every entry's stored value (flags, then body).
        let mut value = Vec::new();
        // Byte marks put earlier in this batch, per queue: a later ack in the same batch must
        // delete them too, and a read of the store does not see them yet.
        let mut batch_marks: HashMap<QueueId, Vec<Offset>> = HashMap::new();
        for op in batch.ops() {
            match op {
                Op::Append {
                    queue,
                    offset,
                    entry,
                } => {
                    keys::encode_entry_value(&mut value, entry.flags, &entry.body);
                    wb.put_cf(entries, keys::entry_key(*queue, *offset), &value)
                }
                Op::PutQueueInfo { queue, epoch, info } => wb.put_cf(
                    meta,
                    keys::meta_key(*queue, META_FIELD_INFO),
                    keys::encode_info_value(*epoch, info),
                ),
                Op::SetAcked { queue, acked } => {
                    wb.delete_range_cf(
                        entries,
                        &keys::entry_key(*queue, 0)[..],
                        &keys::entry_key_after(*queue, *acked)[..],
                    );
                    // Byte marks are sparse (a few per queue): the ones at or below `acked` are
                    // deleted one by one. A range tombstone per ack (clients ack every 100 ms)
                    // would pile up in the marks memtable, which fills slowly: its flush then
                    // takes seconds and gigabytes (seen in `make soak`: 129,232 tombstones,
                    // 33 s, 3 GB).
                    for o in self.marks_through(marks, *queue, *acked)? {
                        wb.delete_cf(marks, keys::entry_key(*queue, o));
                    }
                    if let Some(put) = batch_marks.get_mut(queue) {
                        put.retain(|&o| {
                            if o <= *acked {
                                wb.delete_cf(marks, keys::entry_key(*queue, o));
                            }
                            o > *acked
                        });
                    }
                    wb.put_cf(
                        meta,
                        keys::meta_key(*queue, META_FIELD_ACKED),
                        acked.to_be_bytes(),
                    );
                }
                Op::PutByteMark {
                    queue,
                    offset,
                    bytes,
                } => {
                    wb.put_cf(marks, keys::entry_key(*queue, *offset), bytes.to_be_bytes());
                    batch_marks.entry(*queue).or_default().push(*offset);
                }
                Op::SetDelivered { queue, delivered } => wb.put_cf(
                    meta,
                    keys::meta_key(*queue, META_FIELD_DELIVERED),
                    delivered.to_be_bytes(),
                ),
                Op::DropQueue { queue } => {
                    for cf in [entries, marks] {
                        wb.delete_range_cf(
                            cf,
                            &keys::entry_key(*queue, 0)[..],
                            &keys::entry_key_after(*queue, Offset::MAX)[..],
                        );
                    }
                    for field in [META_FIELD_ACKED, META_FIELD_DELIVERED, META_FIELD_INFO] {
                        wb.delete_cf(meta, keys::meta_key(*queue, field));
                    }
                }
                Op::TruncateQueue { queue, from } => {
                    for cf in [entries, marks] {
                        wb.delete_range_cf(
                            cf,
                            &keys::entry_key(*queue, *from)[..],
                            &keys::entry_key_after(*queue, Offset::MAX)[..],
                        );
                    }
                }
                Op::RegionPut { region, key, value } => {
                    wb.put_cf(regions, keys::region_key(region, key)?, value)
                }
                Op::RegionDelete { region, key } => {
                    wb.delete_cf(regions, keys::region_key(region, key)?)
                }
                Op::StatePut { key, value } => wb.put_cf(state, key.as_bytes(), value),
            }
        }
        Ok(wb)
    }
}

impl Store for RocksStore {
    fn write(&self, batch: &Batch, sync: bool) -> Result<(), StorageError> {
        batch.validate()?;
        if batch.is_empty() {
            if sync {
                self.db.flush_wal(true)?;
            }
            return Ok(());
        }
        let wb = self.write_batch(batch)?;
        let mut wo = WriteOptions::default();
        wo.set_sync(sync);
        self.db.write_opt(wb, &wo)?;
        Ok(())
    }

    fn queue_meta(&self, queue: QueueId) -> Result<Option<QueueMeta>, StorageError> {
        let (lower, upper) = keys::meta_bounds(queue);
        let mut ro = ReadOptions::default();
        ro.set_iterate_lower_bound(lower.to_vec());
        ro.set_iterate_upper_bound(upper.to_vec());
        let mut it = self.db.raw_iterator_cf_opt(self.cf(CF_META)?, ro);
        it.seek_to_first();
        let mut found = None;
        while let Some((k, v)) = it.item() {
            let (q, field) = keys::decode_meta_key(k)?;
            if q != queue {
                return Err(StorageError::Corrupt(format!(
                    "meta key of queue {q} in range of {queue}"
                )));
            }
            Self::apply_meta_field(found.get_or_insert_with(QueueMeta::default), field, v)?;
            it.next();
        }
        it.status()?;
        drop(it);
        found.map(|m| self.finish_meta(queue, m)).transpose()
    }

    fn queues(&self) -> Result<Vec<(QueueId, QueueMeta)>, StorageError> {
        let mut grouped: Vec<(QueueId, QueueMeta)> = Vec::new();
        {
            // A one-time scan at start: it does not fill the block cache (with 100,000 idle
            // queues that would be tens of MB held for nothing).
            let mut ro = ReadOptions::default();
            ro.fill_cache(false);
            let mut it = self.db.raw_iterator_cf_opt(self.cf(CF_META)?, ro);
            it.seek_to_first();
            while let Some((k, v)) = it.item() {
                let (q, field) = keys::decode_meta_key(k)?;
                if grouped.last().is_none_or(|(last, _)| *last != q) {
                    grouped.push((q, QueueMeta::default()));
                }
                if let Some((_, m)) = grouped.last_mut() {
                    Self::apply_meta_field(m, field, v)?;
                }
                it.next();
            }
            it.status()?;
        }
        grouped
            .into_iter()
            .map(|(q, m)| Ok((q, self.finish_meta(q, m)?)))
            .collect()
    }

    fn read_entries(
        &self,
        queue: QueueId,
        from: Offset,
        to: Offset,
        max_bytes: usize,
        visit: &mut dyn FnMut(Offset, u8, &[u8]),
    ) -> Result<usize, StorageError> {
        if from > to {
            return Ok(0);
        }
        let lower = keys::entry_key(queue, from);
        let mut ro = ReadOptions::default();
        ro.set_iterate_lower_bound(lower.to_vec());
        ro.set_iterate_upper_bound(keys::entry_key_after(queue, to).to_vec());
        ro.set_readahead_size(READ_AHEAD_BYTES);
        // A replay reads each entry once, in order: its blocks would only push other data out of
        // the block cache, and make the server's memory grow with the backlog it replays.
        ro.fill_cache(false);
        let mut it = self.db.raw_iterator_cf_opt(self.cf(CF_ENTRIES)?, ro);
        it.seek(lower);
        let mut visited = 0usize;
        let mut total = 0usize;
        while let Some((k, v)) = it.item() {
            let (_, offset) = keys::decode_entry_key(k)?;
            let (flags, body) = keys::decode_entry_value(v)?;
            visit(offset, flags, body);
            visited += 1;
            total = total.saturating_add(body.len());
            if total >= max_bytes {
                break;
            }
            it.next();
        }
        it.status()?;
        Ok(visited)
    }

    fn region_get(&self, region: &str, key: &str) -> Result<Option<Vec<u8>>, StorageError> {
        let k = keys::region_key(region, key)?;
        Ok(self.db.get_cf(self.cf(CF_REGIONS)?, k)?)
    }

    fn region_contains(&self, region: &str, key: &str) -> Result<bool, StorageError> {
        let k = keys::region_key(region, key)?;
        Ok(self.db.get_pinned_cf(self.cf(CF_REGIONS)?, k)?.is_some())
    }

    fn region_scan(
        &self,
        region: &str,
        after: Option<&str>,
        visit: &mut dyn FnMut(&str, &[u8]) -> ControlFlow<()>,
    ) -> Result<(), StorageError> {
        let prefix = keys::region_prefix(region)?;
        // The first key after `after` is at least `after` followed by a zero byte.
        let start = match after {
            Some(key) => {
                let mut k = keys::region_key(region, key)?;
                k.push(0);
                k
            }
            None => prefix.clone(),
        };
        let mut ro = ReadOptions::default();
        ro.set_iterate_lower_bound(start.clone());
        if let Some(upper) = keys::prefix_successor(&prefix) {
            ro.set_iterate_upper_bound(upper);
        }
        let mut it = self.db.raw_iterator_cf_opt(self.cf(CF_REGIONS)?, ro);
        it.seek(&start);
        while let Some((k, v)) = it.item() {
            let Some(key) = k.strip_prefix(&prefix[..]) else {
                break;
            };
            let key = std::str::from_utf8(key).map_err(|_| {
                StorageError::Corrupt(format!("non UTF-8 key in region {region:?}"))
            })?;
            if visit(key, v).is_break() {
                return Ok(());
            }
            it.next();
        }
        it.status()?;
        Ok(())
    }

    fn regions_scan(
        &self,
        after: Option<(&str, &str)>,
        visit: &mut crate::RegionVisitor<'_>,
    ) -> Result<(), StorageError> {
        let mut it = self.db.raw_iterator_cf(self.cf(CF_REGIONS)?);
        match after {
            // The first key after it is at least it followed by a zero byte.
            Some((region, key)) => {
                let mut k = keys::region_key(region, key)?;
                k.push(0);
                it.seek(&k);
            }
            None => it.seek_to_first(),
        }
        while let Some((k, v)) = it.item() {
            let (region, key) = keys::split_region_key(k)?;
            if visit(region, key, v).is_break() {
                return Ok(());
            }
            it.next();
        }
        it.status()?;
        Ok(())
    }

    fn state_get(&self, key: &str) -> Result<Option<Vec<u8>>, StorageError> {
        keys::check_key(key)?;
        Ok(self.db.get_cf(self.cf(CF_STATE)?, key.as_bytes())?)
    }

    fn quiesce(&self) {
        self.db.cancel_all_background_work(true);
    }

    fn memory(&self) -> crate::StorageMemory {
        let sum = |prop: &str| -> u64 {
            ALL_CFS
                .iter()
                .filter_map(|n| self.cf(n).ok())
                .filter_map(|cf| self.db.property_int_value_cf(cf, prop).ok().flatten())
                .sum()
        };
        let db = |prop: &str| self.db.property_int_value(prop).ok().flatten().unwrap_or(0);
        crate::StorageMemory {
            memtables_bytes: sum("rocksdb.cur-size-all-mem-tables"),
            table_readers_bytes: sum("rocksdb.estimate-table-readers-mem"),
            // One cache is shared by every column family: read it once.
            block_cache_bytes: db("rocksdb.block-cache-usage"),
            block_cache_pinned_bytes: db("rocksdb.block-cache-pinned-usage"),
            entries_l0_files: self
                .cf(CF_ENTRIES)
                .ok()
                .and_then(|cf| {
                    self.db
                        .property_int_value_cf(cf, "rocksdb.num-files-at-level0")
                        .ok()
                        .flatten()
                })
                .unwrap_or(0),
        }
    }

    fn flush(&self) -> Result<(), StorageError> {
        self.db.flush_wal(true)?;
        let mut fo = FlushOptions::default();
        fo.set_wait(true);
        let cfs = ALL_CFS
            .iter()
            .map(|n| self.cf(n))
            .collect::<Result<Vec<_>, _>>()?;
        self.db.flush_cfs_opt(&cfs, &fo)?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Writes `value` as the storage format record of the directory `dir`, bypassing the check.
    fn force_format(dir: &Path, value: &[u8]) {
        let opts = Options::default();
        let cfs = DB::list_cf(&opts, dir).unwrap();
        let db = DB::open_cf(&opts, dir, &cfs).unwrap();
        let state = db.cf_handle(CF_STATE).unwrap();
        db.put_cf(state, STORAGE_FORMAT_KEY.as_bytes(), value)
            .unwrap();
        db.flush_wal(true).unwrap();
    }

    #[test]
    fn a_data_directory_records_its_format_and_another_format_is_refused_unchanged() {
        let dir = tempfile::tempdir().unwrap();
        {
            let s = RocksStore::open(dir.path()).unwrap();
            assert_eq!(
                s.state_get(STORAGE_FORMAT_KEY).unwrap(),
                Some(STORAGE_FORMAT.to_be_bytes().to_vec())
            );
            let mut b = Batch::new();
            b.state_put("node-id", b"n1".to_vec());
            s.write(&b, true).unwrap();
        }
        // Reopened by the same build: fine, nothing lost.
        let s = RocksStore::open(dir.path()).unwrap();
        assert_eq!(s.state_get("node-id").unwrap(), Some(b"n1".to_vec()));
        drop(s);
        // A newer build's directory, or one two versions old: refused with both numbers.
        for found in [STORAGE_FORMAT + 1, STORAGE_FORMAT_OLDEST - 1] {
            force_format(dir.path(), &found.to_be_bytes());
            let Err(e) = RocksStore::open(dir.path()) else {
                panic!("format {found} was opened");
            };
            assert!(
                matches!(e, StorageError::IncompatibleFormat { found: f, .. } if f == found),
                "{e}"
            );
            let msg = e.to_string();
            assert!(msg.contains(&format!("storage format is {found}")), "{msg}");
            assert!(
                msg.contains(&format!(
                    "formats {STORAGE_FORMAT_OLDEST} to {STORAGE_FORMAT}"
                )),
                "{msg}"
            );
        }
        // A record that is not a format number: corrupt, never a panic.
        force_format(dir.path(), b"xyz");
        assert!(matches!(
            RocksStore::open(dir.path()),
            Err(StorageError::Corrupt(_))
        ));
    }

    #[test]
    fn a_directory_written_before_formats_were_recorded_is_read_as_format_1() {
        let dir = tempfile::tempdir().unwrap();
        let s = RocksStore::open(dir.path()).unwrap();
        let mut b = Batch::new();
        b.state_put("node-id", b"n1".to_vec());
        s.write(&b, true).unwrap();
        // As a directory of before this record existed: the key absent, data present.
        s.db.delete_cf(s.cf(CF_STATE).unwrap(), STORAGE_FORMAT_KEY.as_bytes())
            .unwrap();
        drop(s);
        let s = RocksStore::open(dir.path()).unwrap();
        assert_eq!(s.state_get("node-id").unwrap(), Some(b"n1".to_vec()));
        assert_eq!(
            s.state_get(STORAGE_FORMAT_KEY).unwrap(),
            Some(1u32.to_be_bytes().to_vec())
        );
    }

    /// The option recorded in the newest `OPTIONS-*` file RocksDB wrote in `dir`.
    fn recorded_option(dir: &Path, name: &str) -> String {
        let newest = std::fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().path())
            .filter(|p| {
                p.file_name()
                    .is_some_and(|n| n.to_string_lossy().starts_with("OPTIONS-"))
            })
            .max()
            .expect("an OPTIONS file");
        let text = std::fs::read_to_string(&newest).unwrap();
        let prefix = format!("{name}=");
        let values: Vec<&str> = text
            .lines()
            .filter_map(|l| l.trim().strip_prefix(prefix.as_str()))
            .collect();
        assert_eq!(values.len(), 1, "{name} in {}", newest.display());
        values[0].to_string()
    }

    /// A store opened with direct I/O for flushes and compactions runs with it (RocksDB
    /// records the option), flushes and compacts its tables that way, and a store opened
    /// later without it reads every event back: the choice changes no byte on disk.
    #[test]
    fn direct_io_for_flushes_and_compactions_is_applied_and_keeps_the_data_readable() {
        let dir = tempfile::tempdir().unwrap();
        const ROUNDS: u64 = 3;
        const EVENTS_PER_ROUND: u64 = 200;
        {
            let s = RocksStore::open_tuned(
                dir.path(),
                StoreTuning {
                    direct_io_for_flush_and_compaction: true,
                },
            )
            .unwrap();
            assert_eq!(
                recorded_option(dir.path(), "use_direct_io_for_flush_and_compaction"),
                "true"
            );
            for round in 0..ROUNDS {
                let mut b = Batch::new();
                for i in 1..=EVENTS_PER_ROUND {
                    let off = round * EVENTS_PER_ROUND + i;
                    b.append(3, off, crate::Entry::new(0, off.to_be_bytes().to_vec()));
                }
                s.write(&b, true).unwrap();
                // One table per round, written past the page cache...
                s.flush().unwrap();
            }
            // ... and merged by a compaction that reads and writes them the same way.
            s.db.compact_range_cf(s.cf(CF_ENTRIES).unwrap(), None::<&[u8]>, None::<&[u8]>);
        }
        let s = RocksStore::open(dir.path()).unwrap();
        assert_eq!(
            recorded_option(dir.path(), "use_direct_io_for_flush_and_compaction"),
            "false"
        );
        let mut read = Vec::new();
        s.read_entries(
            3,
            1,
            ROUNDS * EVENTS_PER_ROUND,
            usize::MAX,
            &mut |off, _, body| {
                read.push((off, u64::from_be_bytes(body.try_into().unwrap())));
            },
        )
        .unwrap();
        let expected: Vec<(u64, u64)> = (1..=ROUNDS * EVENTS_PER_ROUND).map(|o| (o, o)).collect();
        assert_eq!(read, expected);
    }

    /// Every stored byte-mark offset of `queue`.
    fn stored_marks(s: &RocksStore, queue: QueueId) -> Vec<Offset> {
        s.marks_through(s.cf(CF_MARKS).unwrap(), queue, Offset::MAX - 1)
            .unwrap()
    }

    /// Obsolete write-ahead logs are renamed into the archive, not unlinked whole, and the
    /// store's reaper empties it; the live log and the data stay.
    #[test]
    fn obsolete_logs_are_archived_then_deleted_by_the_reaper() {
        let dir = tempfile::tempdir().unwrap();
        let s = RocksStore::open(dir.path()).unwrap();
        for round in 1..=3u64 {
            let mut b = Batch::new();
            b.append(1, round, crate::Entry::new(0, &b"v"[..]));
            b.state_put("round", round.to_be_bytes().to_vec());
            s.write(&b, true).unwrap();
            // Every column family flushed: the log written so far is obsolete.
            s.flush().unwrap();
        }
        // RocksDB moved the obsolete logs into the archive rather than unlinking them (its
        // info log records each move)...
        let info = std::fs::read_to_string(dir.path().join("LOG")).unwrap();
        assert!(info.contains("Move log file"), "no log was archived");
        // ... and the reaper deleted them there.
        let archive = dir.path().join(WAL_ARCHIVE_DIR);
        assert_eq!(
            crate::wal_reaper::wait_until_empty(&archive),
            Vec::new(),
            "archived logs left"
        );
        assert_eq!(
            crate::wal_reaper::log_files(dir.path()).len(),
            1,
            "only the live log stays"
        );
        assert_eq!(
            s.state_get("round").unwrap(),
            Some(3u64.to_be_bytes().to_vec())
        );
    }

    /// The write batch is created as large as it gets (not grown by doubling, each time
    /// copied), for every kind of operation; the estimate stays within a small factor of what
    /// the batch takes.
    #[test]
    fn the_write_batch_is_sized_up_front() {
        let dir = tempfile::tempdir().unwrap();
        let s = RocksStore::open(dir.path()).unwrap();
        let mut b = Batch::new();
        for off in 1..=1_000u64 {
            b.append(7, off, crate::Entry::new(1, vec![9u8; 128]));
            b.region_put("bench", &format!("key-{off}"), vec![3u8; 129]);
            if off % 100 == 0 {
                b.put_byte_mark(7, off, off * 129);
            }
        }
        b.region_delete("bench", "key-1");
        b.put_queue_info(7, 3, vec![5u8; 40]);
        b.set_delivered(7, 10);
        b.state_put("fwd-applied/n2", 42u64.to_be_bytes().to_vec());
        b.set_acked(7, 5);
        b.truncate_queue(7, 900);
        b.drop_queue(8);
        let wb = s.write_batch(&b).unwrap();
        let estimate = write_batch_bytes(&b);
        assert!(
            wb.size_in_bytes() <= estimate,
            "{} bytes written, {estimate} estimated",
            wb.size_in_bytes()
        );
        assert!(estimate < 2 * wb.size_in_bytes(), "{estimate} estimated");
    }

    /// Acks delete a queue's byte marks one by one, also marks put earlier in the same batch,
    /// and leave no range tombstone in the marks column family: thousands of acks do not pile
    /// up tombstones in its slowly filling memtable (found by `make soak`: a flush of 129,232
    /// of them took 33 s and 3 GB).
    #[test]
    fn acks_delete_byte_marks_without_range_tombstones() {
        let dir = tempfile::tempdir().unwrap();
        let s = RocksStore::open(dir.path()).unwrap();
        let mut b = Batch::new();
        for off in 1..=100u64 {
            b.append(7, off, crate::Entry::new(0, &b"v"[..]));
            if off % 10 == 0 {
                b.put_byte_mark(7, off, off);
            }
        }
        s.write(&b, false).unwrap();
        assert_eq!(
            stored_marks(&s, 7),
            (1..=10).map(|i| i * 10).collect::<Vec<_>>()
        );
        for acked in 1..=55u64 {
            let mut b = Batch::new();
            b.set_acked(7, acked);
            s.write(&b, false).unwrap();
        }
        assert_eq!(stored_marks(&s, 7), vec![60, 70, 80, 90, 100]);
        // Read ignoring range tombstones: marks deleted by one would show up again (checked: the
        // earlier range deletion fails here). Deprecated only as a performance hint.
        let mut ro = ReadOptions::default();
        #[allow(deprecated)]
        ro.set_ignore_range_deletions(true);
        let mut it = s.db.raw_iterator_cf_opt(s.cf(CF_MARKS).unwrap(), ro);
        it.seek_to_first();
        let mut raw = Vec::new();
        while let Some(k) = it.key() {
            raw.push(keys::decode_entry_key(k).unwrap().1);
            it.next();
        }
        assert_eq!(
            raw,
            vec![60, 70, 80, 90, 100],
            "acks wrote range tombstones on marks"
        );
        // A mark put and acked in one batch is gone too.
        let mut b = Batch::new();
        b.append(7, 101, crate::Entry::new(0, &b"v"[..]));
        b.put_byte_mark(7, 101, 101);
        b.set_acked(7, 101);
        s.write(&b, false).unwrap();
        assert_eq!(stored_marks(&s, 7), Vec::<Offset>::new());
    }

    #[test]
    fn corrupt_records_are_errors_not_panics() {
        let dir = tempfile::tempdir().unwrap();
        let s = RocksStore::open(dir.path()).unwrap();
        let entries = s.cf(CF_ENTRIES).unwrap();
        let meta = s.cf(CF_META).unwrap();
        s.db.put_cf(entries, keys::entry_key(1, 1), b"").unwrap();
        s.db.put_cf(meta, keys::meta_key(2, META_FIELD_ACKED), b"short")
            .unwrap();
        s.db.put_cf(meta, keys::meta_key(3, 99), 0u64.to_be_bytes())
            .unwrap();
        s.db.put_cf(meta, keys::meta_key(4, META_FIELD_INFO), b"1234")
            .unwrap();
        fn corrupt<T>(r: Result<T, StorageError>) -> bool {
            matches!(r, Err(StorageError::Corrupt(_)))
        }
        assert!(corrupt(s.read_entries(1, 0, 5, 100, &mut |_, _, _| {})));
        assert!(corrupt(s.queue_meta(2)));
        assert!(corrupt(s.queue_meta(3)));
        assert!(corrupt(s.queue_meta(4)));
        assert!(corrupt(s.queues()));
        s.db.put_cf(s.cf(CF_REGIONS).unwrap(), [0u8, 1, b'r', 0xFF], b"v")
            .unwrap();
        assert!(corrupt(
            s.region_scan("r", None, &mut |_, _| ControlFlow::Continue(()))
        ));
    }
}
