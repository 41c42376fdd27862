//! [`RaftLogDb`]: the durable log of the cluster-metadata consensus group, in its own RocksDB
//! (a directory apart from the queue store, so metadata fsyncs never wait behind queue
//! writes and vice versa).
//!
//! It stores opaque byte strings: the consensus layer (`src/cluster/`) encodes log entries,
//! votes and snapshots; this module only guarantees order and durability.
//!
//! | column family | key | value |
//! |---|---|---|
//! | `log` | log index u64 big-endian | encoded entry |
//! | `raft_meta` | name (`vote`, `committed`, `purged`, `snapshot`) | encoded value |
//!
//! # Invariants
//! * Every mutation is one atomic `WriteBatch` written with `sync = true`: when a method
//!   returns `Ok`, the change is on disk (a vote must never be forgotten after a crash, an
//!   appended entry acknowledged to the leader must survive one).
//! * The stored indexes form one contiguous run (`truncate_from` and `purge_through` cut
//!   only at the ends), so a range read returns exactly the indexes asked for, in order.

use std::path::Path;

use rocksdb::{ColumnFamily, ColumnFamilyDescriptor, DB, Direction, IteratorMode, Options};
use rocksdb::{WriteBatch, WriteOptions};

use crate::StorageError;

/// Column family of log entries.
pub const CF_RAFT_LOG: &str = "log";
/// Column family of the vote, committed id, purged id and snapshot.
pub const CF_RAFT_META: &str = "raft_meta";

/// The newest consensus log layout this build writes: the column families above and the
/// encoding of entries, votes and snapshots by `src/cluster/`. Raised with every change a
/// previous build could not read; recorded in the database.
///
/// - 1: the first recorded format.
/// - 2: entries and snapshots may hold metadata of peer protocol version 2 (membership
///   changes: a member draining), which a build of format 1 cannot decode.
///
/// A log records the lowest format that describes what it holds: format 1 when created
/// (or the oldest this build reads), raised by [`RaftLogDb::raise_format`] just before the
/// first write that needs more. So a build of the previous format still opens a log that
/// holds nothing new, and refuses, with both numbers, one that does.
pub const RAFT_LOG_FORMAT: u32 = 2;
/// The oldest consensus log layout this build reads (one version back, once there is one).
pub const RAFT_LOG_FORMAT_OLDEST: u32 = 1;
const _: () = assert!(
    RAFT_LOG_FORMAT_OLDEST <= RAFT_LOG_FORMAT && RAFT_LOG_FORMAT_OLDEST + 1 >= RAFT_LOG_FORMAT
);
/// Meta name of the consensus log's format record (a big-endian `u32`).
pub const RAFT_LOG_FORMAT_KEY: &str = "format";

/// Durable consensus log on RocksDB. All methods take `&self` and may be called from
/// several threads; writes are applied in call order per thread.
pub struct RaftLogDb {
    db: DB,
    /// The format recorded under [`RAFT_LOG_FORMAT_KEY`] (read at open, kept by
    /// `raise_format`).
    format: std::sync::atomic::AtomicU32,
}

impl std::fmt::Debug for RaftLogDb {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RaftLogDb")
            .field("path", &self.db.path())
            .finish()
    }
}

fn sync_opts() -> WriteOptions {
    let mut o = WriteOptions::default();
    o.set_sync(true);
    o
}

impl RaftLogDb {
    /// Opens (creating if missing) the database in `dir`.
    pub fn open(dir: &Path) -> Result<Self, StorageError> {
        let mut opts = Options::default();
        opts.create_if_missing(true);
        opts.create_missing_column_families(true);
        let cfs = [CF_RAFT_LOG, CF_RAFT_META]
            .into_iter()
            .map(|name| ColumnFamilyDescriptor::new(name, Options::default()));
        let db = RaftLogDb {
            db: DB::open_cf_descriptors(&opts, dir, cfs)?,
            format: std::sync::atomic::AtomicU32::new(RAFT_LOG_FORMAT_OLDEST),
        };
        // A new log, or one written before formats were recorded (format 1), gets the record
        // of the oldest format: it holds nothing newer yet.
        let record = db.meta_get(RAFT_LOG_FORMAT_KEY)?;
        if crate::error::check_format_record(
            "consensus log",
            record.as_deref(),
            RAFT_LOG_FORMAT_OLDEST,
            RAFT_LOG_FORMAT,
        )? {
            db.meta_put(RAFT_LOG_FORMAT_KEY, &RAFT_LOG_FORMAT_OLDEST.to_be_bytes())?;
        } else if let Some(v) = record {
            let bytes: [u8; 4] = v.as_slice().try_into().expect("checked: four bytes");
            db.format.store(
                u32::from_be_bytes(bytes),
                std::sync::atomic::Ordering::Relaxed,
            );
        }
        Ok(db)
    }

    /// The format the log records: the newest layout of anything written to it.
    pub fn format(&self) -> u32 {
        self.format.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Records `format` (at most [`RAFT_LOG_FORMAT`]) durably, before a write that needs it;
    /// nothing when the log already records it or a newer one. The caller serializes writes
    /// (openraft's storage calls are sequential).
    pub fn raise_format(&self, format: u32) -> Result<(), StorageError> {
        assert!(
            format <= RAFT_LOG_FORMAT,
            "format {format} is newer than this build's {RAFT_LOG_FORMAT}"
        );
        if format <= self.format() {
            return Ok(());
        }
        self.meta_put(RAFT_LOG_FORMAT_KEY, &format.to_be_bytes())?;
        self.format
            .store(format, std::sync::atomic::Ordering::Relaxed);
        Ok(())
    }

    fn cf(&self, name: &str) -> &ColumnFamily {
        self.db
            .cf_handle(name)
            .expect("column family created at open")
    }

    /// Reads a metadata value.
    pub fn meta_get(&self, name: &str) -> Result<Option<Vec<u8>>, StorageError> {
        Ok(self.db.get_cf(self.cf(CF_RAFT_META), name)?)
    }

    /// Writes a metadata value durably.
    pub fn meta_put(&self, name: &str, value: &[u8]) -> Result<(), StorageError> {
        let mut b = WriteBatch::default();
        b.put_cf(self.cf(CF_RAFT_META), name, value);
        Ok(self.db.write_opt(b, &sync_opts())?)
    }

    /// Appends (or overwrites) entries durably, in one atomic batch.
    pub fn append<'a>(
        &self,
        entries: impl IntoIterator<Item = (u64, &'a [u8])>,
    ) -> Result<(), StorageError> {
        let cf = self.cf(CF_RAFT_LOG);
        let mut b = WriteBatch::default();
        for (index, bytes) in entries {
            b.put_cf(cf, index.to_be_bytes(), bytes);
        }
        Ok(self.db.write_opt(b, &sync_opts())?)
    }

    /// Deletes every entry with index `>= index`, durably.
    pub fn truncate_from(&self, index: u64) -> Result<(), StorageError> {
        let mut b = WriteBatch::default();
        // Exclusive upper bound past every 8-byte key: u64::MAX ++ 0x00.
        let mut past_end = u64::MAX.to_be_bytes().to_vec();
        past_end.push(0);
        b.delete_range_cf(
            self.cf(CF_RAFT_LOG),
            index.to_be_bytes().as_slice(),
            past_end.as_slice(),
        );
        Ok(self.db.write_opt(b, &sync_opts())?)
    }

    /// Deletes every entry with index `<= index` and records `purged` under the meta name
    /// `purged`, in one durable batch.
    pub fn purge_through(&self, index: u64, purged: &[u8]) -> Result<(), StorageError> {
        let mut b = WriteBatch::default();
        b.delete_range_cf(
            self.cf(CF_RAFT_LOG),
            0u64.to_be_bytes(),
            index.saturating_add(1).to_be_bytes(),
        );
        if index == u64::MAX {
            b.delete_cf(self.cf(CF_RAFT_LOG), u64::MAX.to_be_bytes());
        }
        b.put_cf(self.cf(CF_RAFT_META), "purged", purged);
        Ok(self.db.write_opt(b, &sync_opts())?)
    }

    /// Entries with `from <= index < to`, in index order.
    pub fn range(&self, from: u64, to: u64) -> Result<Vec<(u64, Vec<u8>)>, StorageError> {
        let mut out = Vec::new();
        if from >= to {
            return Ok(out);
        }
        let start = from.to_be_bytes();
        let iter = self.db.iterator_cf(
            self.cf(CF_RAFT_LOG),
            IteratorMode::From(&start, Direction::Forward),
        );
        for item in iter {
            let (k, v) = item?;
            let index = decode_index(&k)?;
            if index >= to {
                break;
            }
            out.push((index, v.to_vec()));
        }
        Ok(out)
    }

    /// The entry with the highest index, if any.
    pub fn last(&self) -> Result<Option<(u64, Vec<u8>)>, StorageError> {
        let mut iter = self.db.iterator_cf(self.cf(CF_RAFT_LOG), IteratorMode::End);
        match iter.next() {
            None => Ok(None),
            Some(item) => {
                let (k, v) = item?;
                Ok(Some((decode_index(&k)?, v.to_vec())))
            }
        }
    }
}

fn decode_index(key: &[u8]) -> Result<u64, StorageError> {
    let bytes: [u8; 8] = key
        .try_into()
        .map_err(|_| StorageError::Corrupt(format!("raft log key of {} bytes", key.len())))?;
    Ok(u64::from_be_bytes(bytes))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn append_range_truncate_purge_reopen() {
        let dir = tempfile::tempdir().unwrap();
        {
            let db = RaftLogDb::open(dir.path()).unwrap();
            assert_eq!(db.last().unwrap(), None);
            let data: Vec<(u64, Vec<u8>)> = (1..=10).map(|i| (i, vec![i as u8; 3])).collect();
            db.append(data.iter().map(|(i, v)| (*i, v.as_slice())))
                .unwrap();
            assert_eq!(db.range(3, 6).unwrap(), data[2..5].to_vec());
            assert_eq!(db.last().unwrap(), Some((10, vec![10; 3])));
            db.truncate_from(8).unwrap();
            assert_eq!(db.last().unwrap().unwrap().0, 7);
            db.purge_through(4, b"p4").unwrap();
            assert_eq!(db.range(0, 100).unwrap().first().unwrap().0, 5);
            db.meta_put("vote", b"v1").unwrap();
        }
        let db = RaftLogDb::open(dir.path()).unwrap();
        assert_eq!(db.meta_get("vote").unwrap(), Some(b"v1".to_vec()));
        assert_eq!(db.meta_get("purged").unwrap(), Some(b"p4".to_vec()));
        let idx: Vec<u64> = db.range(0, 100).unwrap().iter().map(|e| e.0).collect();
        assert_eq!(idx, vec![5, 6, 7]);
        assert_eq!(db.range(6, 6).unwrap(), vec![]);
    }

    #[test]
    fn the_log_records_its_format_and_another_format_is_refused_unchanged() {
        let dir = tempfile::tempdir().unwrap();
        {
            let db = RaftLogDb::open(dir.path()).unwrap();
            // A new log holds nothing newer than the oldest format.
            assert_eq!(
                db.meta_get(RAFT_LOG_FORMAT_KEY).unwrap(),
                Some(RAFT_LOG_FORMAT_OLDEST.to_be_bytes().to_vec())
            );
            assert_eq!(db.format(), RAFT_LOG_FORMAT_OLDEST);
            db.meta_put("vote", b"v1").unwrap();
        }
        // The database opened without the format check.
        let raw = || RaftLogDb {
            db: DB::open_cf(&Options::default(), dir.path(), [CF_RAFT_LOG, CF_RAFT_META]).unwrap(),
            format: Default::default(),
        };
        for found in [RAFT_LOG_FORMAT + 1, RAFT_LOG_FORMAT_OLDEST - 1] {
            raw()
                .meta_put(RAFT_LOG_FORMAT_KEY, &found.to_be_bytes())
                .unwrap();
            let Err(e) = RaftLogDb::open(dir.path()) else {
                panic!("format {found} was opened");
            };
            let msg = e.to_string();
            assert!(
                msg.contains(&format!("consensus log format is {found}")),
                "{msg}"
            );
            assert!(
                msg.contains(&format!(
                    "formats {RAFT_LOG_FORMAT_OLDEST} to {RAFT_LOG_FORMAT}"
                )),
                "{msg}"
            );
        }
        // A log without the record (written before it existed) is read as format 1, unchanged.
        {
            let db = raw();
            let mut b = WriteBatch::default();
            b.delete_cf(db.cf(CF_RAFT_META), RAFT_LOG_FORMAT_KEY);
            db.db.write_opt(b, &sync_opts()).unwrap();
        }
        let db = RaftLogDb::open(dir.path()).unwrap();
        assert_eq!(db.meta_get("vote").unwrap(), Some(b"v1".to_vec()));
        assert_eq!(
            db.meta_get(RAFT_LOG_FORMAT_KEY).unwrap(),
            Some(1u32.to_be_bytes().to_vec())
        );
    }

    #[test]
    fn the_format_is_raised_before_a_write_that_needs_it_and_kept_across_opens() {
        let dir = tempfile::tempdir().unwrap();
        {
            let db = RaftLogDb::open(dir.path()).unwrap();
            db.raise_format(RAFT_LOG_FORMAT_OLDEST).unwrap();
            assert_eq!(db.format(), RAFT_LOG_FORMAT_OLDEST, "nothing to raise");
            db.raise_format(RAFT_LOG_FORMAT).unwrap();
            assert_eq!(db.format(), RAFT_LOG_FORMAT);
            db.append([(1, b"an entry of the newer format".as_slice())])
                .unwrap();
        }
        let db = RaftLogDb::open(dir.path()).unwrap();
        assert_eq!(db.format(), RAFT_LOG_FORMAT, "recorded durably");
        assert_eq!(
            db.meta_get(RAFT_LOG_FORMAT_KEY).unwrap(),
            Some(RAFT_LOG_FORMAT.to_be_bytes().to_vec())
        );
        // Never lowered.
        db.raise_format(RAFT_LOG_FORMAT_OLDEST).unwrap();
        assert_eq!(db.format(), RAFT_LOG_FORMAT);
        drop(db);
        // What a build of the previous format does with this log: refuses it, with both
        // numbers, and changes nothing.
        let record = {
            let db = RaftLogDb::open(dir.path()).unwrap();
            db.meta_get(RAFT_LOG_FORMAT_KEY).unwrap()
        };
        let e = crate::error::check_format_record(
            "consensus log",
            record.as_deref(),
            RAFT_LOG_FORMAT - 1,
            RAFT_LOG_FORMAT - 1,
        )
        .unwrap_err();
        assert!(
            e.to_string()
                .contains(&format!("consensus log format is {RAFT_LOG_FORMAT}")),
            "{e}"
        );
    }
}
