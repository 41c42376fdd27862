//! [`QueueBytes`]: how many bytes of entries wait in one queue, for the per-queue byte limit.
//!
//! Acks are cumulative and the core keeps no per-entry sizes (a queue may hold tens of
//! millions of entries), so the count works with sparse *byte marks*: `(offset, cumulative
//! bytes through that entry)`, one each time the queue grows by one mark interval
//! ([`mark_interval_bytes`]: 1/64 of the limit, within 4 KiB..=1 MiB) since the last mark. Marks are written to storage with the entries (and deleted with them),
//! so a restart rebuilds the count from a few marks and two short reads, never the backlog.
//!
//! Pending bytes are counted from the last mark at or below the acked offset: an over-count by
//! at most one mark interval plus one entry, never an under-count, so the limit is never
//! exceeded. (A truncated tail, on a secondary's copy, may leave one interval more per
//! truncation until the queue is wholly acked.) Plain state machine, no I/O: the caller persists the marks it returns and supplies
//! the short reads at recovery.

use std::collections::VecDeque;

use tether_storage::{Offset, QueueId, StorageError, Store};

/// Marks per `queue-bytes-max` of entries: the count over-states by at most 1/this of the
/// limit (plus one entry).
pub const BYTE_MARKS_PER_LIMIT: u64 = 64;
/// Narrowest spacing of byte marks, in bytes (marks held in memory: 16 bytes each, so at most
/// 0.4% of the bytes they count).
pub const BYTE_MARK_INTERVAL_MIN_BYTES: u64 = 4 << 10;
/// Widest spacing of byte marks, in bytes: also about the most a recovery reads per queue
/// (twice).
pub const BYTE_MARK_INTERVAL_MAX_BYTES: u64 = 1 << 20;

/// Spacing of byte marks for a queue byte limit, in bytes.
pub fn mark_interval_bytes(queue_bytes_max: u64) -> u64 {
    (queue_bytes_max / BYTE_MARKS_PER_LIMIT)
        .clamp(BYTE_MARK_INTERVAL_MIN_BYTES, BYTE_MARK_INTERVAL_MAX_BYTES)
}

/// The most an event's stored encoding adds to the bytes of its origin node id, region name,
/// key and value, in bytes (CBOR map headers, string headers, two u64s, the operation).
pub const EVENT_ENCODING_OVERHEAD_BYTES_MAX: u64 = 64;

/// Upper bound of the stored size of one event (what the byte limit counts), in bytes.
pub fn event_bytes_max(node: &str, region: &str, key: &str, value_bytes: usize) -> u64 {
    (node.len() + region.len() + key.len() + value_bytes) as u64 + EVENT_ENCODING_OVERHEAD_BYTES_MAX
}

/// The bytes of the stored entries `from..=to` of `queue` (a recovery read, for
/// [`QueueBytes::recover`]).
pub fn stored_entry_bytes(
    store: &dyn Store,
    queue: QueueId,
    from: Offset,
    to: Offset,
) -> Result<u64, StorageError> {
    let mut total = 0u64;
    store.read_entries(queue, from, to, usize::MAX, &mut |_, _, body| {
        total += body.len() as u64;
    })?;
    Ok(total)
}

/// One queue's byte count. Cumulative counts are relative to an arbitrary origin (they are
/// only ever subtracted from each other).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct QueueBytes {
    /// Cumulative bytes through the acked offset, as far as the marks tell: the last mark at or
    /// below it (or the count at recovery).
    base: u64,
    /// Cumulative bytes through the queue's end.
    end: u64,
    /// Marks above the acked offset, ascending: `(offset, cumulative bytes through it)`.
    marks: VecDeque<(Offset, u64)>,
}

impl QueueBytes {
    /// Bytes of the entries waiting (appended, not acked); over by at most one mark interval
    /// plus one entry (and one interval per truncation since the queue was last wholly acked),
    /// never under.
    pub fn pending(&self) -> u64 {
        self.end - self.base
    }

    /// An entry of `bytes` was appended at `offset`. Returns the mark to store with it, if one
    /// is due (`interval`: see [`mark_interval_bytes`]).
    pub fn append(&mut self, offset: Offset, bytes: u64, interval: u64) -> Option<(Offset, u64)> {
        self.end += bytes;
        let last = self.marks.back().map_or(self.base, |&(_, b)| b);
        if self.end - last >= interval {
            self.marks.push_back((offset, self.end));
            Some((offset, self.end))
        } else {
            None
        }
    }

    /// Entries through `acked` are acknowledged; `all` when that is every entry of the queue
    /// (the count is then exactly zero).
    pub fn ack(&mut self, acked: Offset, all: bool) {
        if all {
            self.base = self.end;
            self.marks.clear();
            return;
        }
        while let Some(&(o, b)) = self.marks.front() {
            if o > acked {
                break;
            }
            self.base = b;
            self.marks.pop_front();
        }
    }

    /// Entries from `from` on were removed (a divergent tail); their marks go, like in storage.
    /// No mark was placed between the last remaining one and `from`, so the entries kept
    /// there total less than one interval: the count keeps at most that much too many.
    pub fn truncate(&mut self, from: Offset, interval: u64) {
        while self.marks.back().is_some_and(|&(o, _)| o >= from) {
            self.marks.pop_back();
        }
        let last = self.marks.back().map_or(self.base, |&(_, b)| b);
        self.end = self.end.min(last + interval);
    }

    /// Rebuilds the count of a stored queue holding `(acked, end]`, from its stored marks
    /// (ascending, above `acked`) and `scan(from, to)`: the bytes of the stored entries
    /// `from..=to`. Reads at most two stretches of about one mark interval each.
    pub fn recover<E>(
        acked: Offset,
        end: Offset,
        marks: &[(Offset, u64)],
        scan: &mut dyn FnMut(Offset, Offset) -> Result<u64, E>,
    ) -> Result<Self, E> {
        if end <= acked {
            return Ok(Self::default());
        }
        let marks: VecDeque<(Offset, u64)> = marks
            .iter()
            .copied()
            .filter(|&(o, _)| o > acked && o <= end)
            .collect();
        let (Some(&(first, first_bytes)), Some(&(last, last_bytes))) =
            (marks.front(), marks.back())
        else {
            return Ok(QueueBytes {
                base: 0,
                end: scan(acked + 1, end)?,
                marks,
            });
        };
        let head = scan(acked + 1, first)?;
        let tail = if last < end { scan(last + 1, end)? } else { 0 };
        let base = first_bytes.saturating_sub(head);
        Ok(QueueBytes {
            base,
            end: last_bytes + tail,
            marks,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const INTERVAL: u64 = BYTE_MARK_INTERVAL_MAX_BYTES;

    /// A queue model: exact entry sizes, cumulative acks, truncations, with the stored marks.
    struct Model {
        sizes: Vec<u64>, // sizes[o - 1] = bytes of entry o
        acked: Offset,
        stored: Vec<(Offset, u64)>,
        count: QueueBytes,
        /// Truncations since the queue was last wholly acked: each may leave up to one
        /// interval over-counted until then.
        truncations: u64,
    }

    impl Model {
        fn exact(&self) -> u64 {
            self.sizes[self.acked as usize..].iter().sum()
        }
        fn check(&self) {
            let exact = self.exact();
            let max_entry = self.sizes.iter().copied().max().unwrap_or(0);
            assert!(self.count.pending() >= exact, "under-count");
            assert!(
                self.count.pending() <= exact + (1 + self.truncations) * INTERVAL + max_entry,
                "over-count beyond one interval per truncation"
            );
        }
        fn recovered(&self) -> QueueBytes {
            let stored: Vec<(Offset, u64)> = self
                .stored
                .iter()
                .copied()
                .filter(|&(o, _)| o > self.acked)
                .collect();
            let end = self.sizes.len() as u64;
            let mut read = 0u64;
            let r = QueueBytes::recover::<()>(self.acked, end, &stored, &mut |from, to| {
                let s: u64 = self.sizes[(from - 1) as usize..to as usize].iter().sum();
                read += s;
                Ok(s)
            })
            .unwrap();
            let max_entry = self.sizes.iter().copied().max().unwrap_or(0);
            assert!(read <= 2 * (INTERVAL + max_entry), "recovery read {read}");
            r
        }
    }

    #[derive(Debug, Clone)]
    enum Step {
        Append(u64),
        Ack(u8),
        Truncate(u8),
        Restart,
    }

    fn step() -> impl Strategy<Value = Step> {
        prop_oneof![
            6 => (1u64..400_000).prop_map(Step::Append),
            2 => any::<u8>().prop_map(Step::Ack),
            1 => any::<u8>().prop_map(Step::Truncate),
            1 => Just(Step::Restart),
        ]
    }

    proptest! {
        /// Never under, over by at most one interval plus an entry, and a restart from the
        /// stored marks reads at most two short stretches and finds the same bounds.
        #[test]
        fn pending_bytes_are_bounded_over_counts(steps in prop::collection::vec(step(), 1..200)) {
            let mut m = Model {
                sizes: Vec::new(),
                acked: 0,
                stored: Vec::new(),
                count: QueueBytes::default(),
                truncations: 0,
            };
            for s in steps {
                match s {
                    Step::Append(b) => {
                        m.sizes.push(b);
                        let o = m.sizes.len() as u64;
                        if let Some(mark) = m.count.append(o, b, INTERVAL) {
                            m.stored.retain(|&(x, _)| x != o);
                            m.stored.push(mark);
                        }
                    }
                    Step::Ack(f) => {
                        let end = m.sizes.len() as u64;
                        let to = m.acked + (end - m.acked) * u64::from(f) / 255;
                        m.acked = to;
                        m.stored.retain(|&(o, _)| o > to);
                        m.count.ack(to, to == end);
                        if to == end {
                            m.truncations = 0;
                        }
                    }
                    Step::Truncate(f) => {
                        let end = m.sizes.len() as u64;
                        let from = m.acked + 1 + (end - m.acked) * u64::from(f) / 256;
                        m.sizes.truncate((from - 1) as usize);
                        m.stored.retain(|&(o, _)| o < from);
                        m.count.truncate(from, INTERVAL);
                        m.truncations += 1;
                    }
                    Step::Restart => m.count = m.recovered(),
                }
                m.check();
                // A restart from storage at any point also satisfies the bounds.
                let r = m.recovered();
                prop_assert!(r.pending() >= m.exact());
            }
        }
    }

    #[test]
    fn mark_spacing_follows_the_limit_within_bounds() {
        assert_eq!(mark_interval_bytes(64 << 10), BYTE_MARK_INTERVAL_MIN_BYTES);
        assert_eq!(mark_interval_bytes(16 << 20), 256 << 10);
        assert_eq!(
            mark_interval_bytes(crate::limits::QUEUE_BYTES_MAX),
            BYTE_MARK_INTERVAL_MAX_BYTES
        );
    }

    #[test]
    fn recovery_without_marks_reads_the_pending_entries() {
        let r = QueueBytes::recover::<()>(5, 8, &[], &mut |from, to| {
            assert_eq!((from, to), (6, 8));
            Ok(300)
        })
        .unwrap();
        assert_eq!(r.pending(), 300);
        assert_eq!(
            QueueBytes::recover::<()>(8, 8, &[], &mut |_, _| panic!("no read for an empty queue"))
                .unwrap()
                .pending(),
            0
        );
    }

    #[test]
    fn event_size_bound_holds_for_real_encodings() {
        use crate::protocol::{EventId, EventOp, EventRecord};
        for (node, region, key, value) in [
            ("", "", "", None),
            ("n", "r", "k", Some(vec![])),
            ("node-1", "orders", "k-1", Some(vec![7u8; 23])),
            (
                "x".repeat(255).as_str(),
                &"r".repeat(256),
                &"k".repeat(1024),
                Some(vec![1; 70_000]),
            ),
        ] {
            let record = EventRecord {
                id: EventId {
                    node: node.to_string(),
                    session: u64::MAX,
                    seq: u64::MAX,
                },
                region: region.to_string(),
                key: key.to_string(),
                op: EventOp::Update,
                value: value.clone(),
            };
            let body = tether_transport::codec::encode_body_packed(&record).unwrap();
            let bound = event_bytes_max(node, region, key, value.map_or(0, |v| v.len()));
            assert!(body.len() as u64 <= bound, "{} > {bound}", body.len());
        }
    }
}
