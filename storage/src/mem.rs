//! [`MemStore`]: the in-memory twin of [`crate::RocksStore`], with identical semantics.

use std::collections::BTreeMap;
use std::ops::ControlFlow;
use std::sync::{Arc, Mutex, MutexGuard};

use crate::batch::Op;
use crate::{Batch, Offset, QueueId, QueueMeta, StorageError, Store};

/// A stored entry: flags and body.
type StoredEntry = (u8, Arc<[u8]>);

#[derive(Default)]
struct Inner {
    /// `(queue, offset) -> (flags, body)`.
    entries: BTreeMap<(QueueId, Offset), StoredEntry>,
    /// Stored metadata; `end` and `byte_marks` are empty here and derived on read.
    meta: BTreeMap<QueueId, QueueMeta>,
    /// `(queue, offset) -> bytes`.
    marks: BTreeMap<(QueueId, Offset), u64>,
    /// `(region, key) -> value`; `String` order is byte order, like RocksDB.
    regions: BTreeMap<(String, String), Vec<u8>>,
    state: BTreeMap<String, Vec<u8>>,
}

impl Inner {
    fn end(&self, queue: QueueId, acked: Offset) -> Offset {
        let last = self
            .entries
            .range((queue, 0)..=(queue, Offset::MAX))
            .next_back()
            .map(|(&(_, off), _)| off)
            .unwrap_or(0);
        last.max(acked)
    }

    fn with_end(&self, queue: QueueId, m: &QueueMeta) -> QueueMeta {
        QueueMeta {
            end: self.end(queue, m.acked),
            byte_marks: self
                .marks
                .range((queue, m.acked + 1)..=(queue, Offset::MAX))
                .map(|(&(_, o), &b)| (o, b))
                .collect(),
            ..m.clone()
        }
    }

    /// Removes entries and marks `(queue, from..=to)`; cost proportional to the number removed.
    fn delete_entries(&mut self, queue: QueueId, from: Offset, to: Offset) {
        let doomed: Vec<(QueueId, Offset)> = self
            .entries
            .range((queue, from)..=(queue, to))
            .map(|(k, _)| *k)
            .collect();
        for k in doomed {
            self.entries.remove(&k);
        }
        let doomed: Vec<(QueueId, Offset)> = self
            .marks
            .range((queue, from)..=(queue, to))
            .map(|(k, _)| *k)
            .collect();
        for k in doomed {
            self.marks.remove(&k);
        }
    }

    fn apply(&mut self, op: &Op) {
        match op {
            Op::Append {
                queue,
                offset,
                entry,
            } => {
                self.entries
                    .insert((*queue, *offset), (entry.flags, entry.body.clone()));
            }
            Op::PutQueueInfo { queue, epoch, info } => {
                let m = self.meta.entry(*queue).or_default();
                m.epoch = *epoch;
                m.info = info.clone();
            }
            Op::SetAcked { queue, acked } => {
                self.delete_entries(*queue, 0, *acked);
                self.meta.entry(*queue).or_default().acked = *acked;
            }
            Op::PutByteMark {
                queue,
                offset,
                bytes,
            } => {
                self.marks.insert((*queue, *offset), *bytes);
            }
            Op::SetDelivered { queue, delivered } => {
                self.meta.entry(*queue).or_default().delivered = *delivered;
            }
            Op::DropQueue { queue } => {
                self.delete_entries(*queue, 0, Offset::MAX);
                self.meta.remove(queue);
            }
            Op::TruncateQueue { queue, from } => {
                self.delete_entries(*queue, *from, Offset::MAX);
            }
            Op::RegionPut { region, key, value } => {
                self.regions
                    .insert((region.clone(), key.clone()), value.clone());
            }
            Op::RegionDelete { region, key } => {
                self.regions.remove(&(region.clone(), key.clone()));
            }
            Op::StatePut { key, value } => {
                self.state.insert(key.clone(), value.clone());
            }
        }
    }
}

/// In-memory [`Store`]: one mutex around ordered maps. Not durable; `sync` and `flush` are
/// no-ops. Used by tests and as the reference for the conformance suite.
#[derive(Default)]
pub struct MemStore {
    inner: Mutex<Inner>,
}

impl MemStore {
    /// An empty store.
    pub fn new() -> Self {
        Self::default()
    }

    fn lock(&self) -> Result<MutexGuard<'_, Inner>, StorageError> {
        self.inner.lock().map_err(|_| StorageError::Poisoned)
    }
}

impl Store for MemStore {
    fn write(&self, batch: &Batch, _sync: bool) -> Result<(), StorageError> {
        batch.validate()?;
        let mut inner = self.lock()?;
        for op in batch.ops() {
            inner.apply(op);
        }
        Ok(())
    }

    fn queue_meta(&self, queue: QueueId) -> Result<Option<QueueMeta>, StorageError> {
        let inner = self.lock()?;
        Ok(inner.meta.get(&queue).map(|m| inner.with_end(queue, m)))
    }

    fn queues(&self) -> Result<Vec<(QueueId, QueueMeta)>, StorageError> {
        let inner = self.lock()?;
        Ok(inner
            .meta
            .iter()
            .map(|(&q, m)| (q, inner.with_end(q, m)))
            .collect())
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
        // Collect under the lock (cheap `Arc` clones), visit outside it so the visitor may
        // call back into the store.
        let mut picked = Vec::new();
        {
            let inner = self.lock()?;
            let mut total = 0usize;
            for (&(_, off), (flags, body)) in inner.entries.range((queue, from)..=(queue, to)) {
                picked.push((off, *flags, body.clone()));
                total = total.saturating_add(body.len());
                if total >= max_bytes {
                    break;
                }
            }
        }
        for (off, flags, body) in &picked {
            visit(*off, *flags, body);
        }
        Ok(picked.len())
    }

    fn region_get(&self, region: &str, key: &str) -> Result<Option<Vec<u8>>, StorageError> {
        crate::keys::region_key(region, key)?;
        let inner = self.lock()?;
        Ok(inner
            .regions
            .get(&(region.to_owned(), key.to_owned()))
            .cloned())
    }

    fn regions_scan(
        &self,
        after: Option<(&str, &str)>,
        visit: &mut crate::RegionVisitor<'_>,
    ) -> Result<(), StorageError> {
        use std::ops::Bound;
        let from = match after {
            Some((r, k)) => Bound::Excluded((r.to_owned(), k.to_owned())),
            None => Bound::Unbounded,
        };
        let items: Vec<((String, String), Vec<u8>)> = {
            let inner = self.lock()?;
            inner
                .regions
                .range((from, Bound::Unbounded))
                .map(|(rk, v)| (rk.clone(), v.clone()))
                .collect()
        };
        for ((r, k), v) in &items {
            if visit(r, k, v).is_break() {
                break;
            }
        }
        Ok(())
    }

    fn region_scan(
        &self,
        region: &str,
        after: Option<&str>,
        visit: &mut dyn FnMut(&str, &[u8]) -> ControlFlow<()>,
    ) -> Result<(), StorageError> {
        use std::ops::Bound;
        crate::keys::check_region(region)?;
        let from = match after {
            Some(key) => Bound::Excluded((region.to_owned(), key.to_owned())),
            None => Bound::Included((region.to_owned(), String::new())),
        };
        let items: Vec<(String, Vec<u8>)> = {
            let inner = self.lock()?;
            inner
                .regions
                .range((from, Bound::Unbounded))
                .take_while(|((r, _), _)| r == region)
                .map(|((_, k), v)| (k.clone(), v.clone()))
                .collect()
        };
        for (k, v) in &items {
            if visit(k, v).is_break() {
                break;
            }
        }
        Ok(())
    }

    fn state_get(&self, key: &str) -> Result<Option<Vec<u8>>, StorageError> {
        crate::keys::check_key(key)?;
        Ok(self.lock()?.state.get(key).cloned())
    }

    fn flush(&self) -> Result<(), StorageError> {
        Ok(())
    }
}
