//! Replicated watermarks: how far, per origin, the copies of this node's queues hold the
//! publishes this node applied. A sans-IO state machine; `shipping.rs` drives it.
//!
//! Why: a secondary keeps the publishes it applied lately ([`RecentForwards`]) for a promotion
//! (the failed primary may not have shipped them yet). It may forget a publish only once every
//! primary of the copies it holds has applied it *and* replicated it to its copies. Applied
//! publishes are counted per origin by the origin's publish-log offset (each origin's entries
//! are applied in order, see `forward.rs`), so "everything from origin `o` up to offset `x`" is
//! one number per origin.
//!
//! How: every so often the primary takes a checkpoint: the offsets applied so far per origin
//! ([`Through`]) and, after that, the end of each queue it ships. Once each of those queues has
//! replicated to its end (or stopped being shipped here), every copy holds what the checkpoint
//! names: it becomes the replicated watermark, carried by every replication message. A queue
//! whose shipping started after a checkpoint was taken is not covered by it (a promotion may
//! have appended older publishes to it), so its messages carry a watermark only from the next
//! checkpoint on.
//!
//! [`RecentForwards`]: super::failover::RecentForwards

use std::collections::{BTreeMap, VecDeque};

use tether_storage::{Offset, QueueId};

/// Per origin node: the highest publish-log offset covered.
pub(crate) type Through = BTreeMap<String, u64>;

/// Most checkpoints waiting for replication; while full, no new one is taken (the watermark
/// then advances in coarser steps, never wrongly).
pub const WATERMARK_CHECKPOINTS_MAX: usize = 64;

/// Raises every origin of `into` to at least its value in `from`.
pub(crate) fn merge(into: &mut Through, from: &Through) {
    for (origin, &offset) in from {
        let e = into.entry(origin.clone()).or_insert(0);
        *e = (*e).max(offset);
    }
}

struct Checkpoint {
    /// Checkpoint number (the shipping epoch a queue must predate to be covered).
    seq: u64,
    applied: Through,
    ends: Vec<(QueueId, Offset)>,
}

/// The primary side: checkpoints and the replicated watermark.
#[derive(Default)]
pub(crate) struct Watermark {
    next_seq: u64,
    pending: VecDeque<Checkpoint>,
    replicated: Through,
    /// Number of the latest checkpoint that became the watermark (0: none yet).
    replicated_seq: u64,
}

impl Watermark {
    /// The number a queue whose shipping starts now is given: it is covered by checkpoints
    /// numbered above it.
    pub(crate) fn shipping_started(&mut self) -> u64 {
        self.next_seq
    }

    /// Takes a checkpoint: `applied`, read before the queue ends `ends` (each end at least what
    /// the queue held when `applied` was read). Returns false if none was taken (full).
    pub(crate) fn checkpoint(&mut self, applied: Through, ends: Vec<(QueueId, Offset)>) -> bool {
        if self.pending.len() >= WATERMARK_CHECKPOINTS_MAX {
            return false;
        }
        self.next_seq += 1;
        self.pending.push_back(Checkpoint {
            seq: self.next_seq,
            applied,
            ends,
        });
        true
    }

    /// Moves the watermark past every oldest checkpoint whose queues all replicated to their
    /// checkpointed end. `replicated_end(q)`: `None` if `q` is no longer shipped here.
    pub(crate) fn advance(&mut self, replicated_end: impl Fn(QueueId) -> Option<Offset>) {
        while let Some(c) = self.pending.front() {
            let done = c
                .ends
                .iter()
                .all(|&(q, end)| replicated_end(q).is_none_or(|r| r >= end));
            if !done {
                break;
            }
            let c = self.pending.pop_front().expect("front exists");
            merge(&mut self.replicated, &c.applied);
            self.replicated_seq = c.seq;
        }
    }

    /// The watermark a message of a queue whose shipping started at `started` may carry: empty
    /// until a checkpoint taken after that start is replicated.
    pub(crate) fn for_queue(&self, started: u64) -> Through {
        if self.replicated_seq > started {
            self.replicated.clone()
        } else {
            Through::new()
        }
    }

    /// Checkpoints waiting for replication.
    pub(crate) fn pending(&self) -> usize {
        self.pending.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn through(v: &[(&str, u64)]) -> Through {
        v.iter().map(|&(o, x)| (o.to_string(), x)).collect()
    }

    #[test]
    fn a_checkpoint_counts_once_every_queue_replicated_its_end() {
        let mut w = Watermark::default();
        let started = w.shipping_started();
        assert!(w.checkpoint(through(&[("a", 5), ("b", 2)]), vec![(1, 10), (2, 4)]));
        w.advance(|q| Some(if q == 1 { 10 } else { 3 }));
        assert!(w.for_queue(started).is_empty(), "queue 2 is behind");
        w.advance(|q| Some(if q == 1 { 10 } else { 4 }));
        assert_eq!(w.for_queue(started), through(&[("a", 5), ("b", 2)]));
        assert_eq!(w.pending(), 0);
    }

    #[test]
    fn a_queue_no_longer_shipped_does_not_hold_the_watermark_back() {
        let mut w = Watermark::default();
        w.checkpoint(through(&[("a", 5)]), vec![(1, 10)]);
        w.advance(|_| None);
        assert_eq!(w.for_queue(0), through(&[("a", 5)]));
    }

    #[test]
    fn checkpoints_advance_in_order() {
        let mut w = Watermark::default();
        w.checkpoint(through(&[("a", 1)]), vec![(1, 2)]);
        w.checkpoint(through(&[("a", 3)]), vec![(1, 6)]);
        w.advance(|_| Some(5));
        assert_eq!(w.for_queue(0), through(&[("a", 1)]));
        w.advance(|_| Some(6));
        assert_eq!(w.for_queue(0), through(&[("a", 3)]));
    }

    #[test]
    fn a_queue_started_after_a_checkpoint_waits_for_the_next_one() {
        let mut w = Watermark::default();
        w.checkpoint(through(&[("a", 1)]), vec![]);
        let late = w.shipping_started();
        w.advance(|_| Some(0));
        assert_eq!(w.for_queue(0), through(&[("a", 1)]));
        assert!(w.for_queue(late).is_empty());
        w.checkpoint(through(&[("a", 2)]), vec![(7, 3)]);
        w.advance(|_| Some(3));
        assert_eq!(w.for_queue(late), through(&[("a", 2)]));
    }

    #[test]
    fn at_most_the_bounded_number_of_checkpoints_wait() {
        let mut w = Watermark::default();
        for i in 0..(WATERMARK_CHECKPOINTS_MAX as u64 + 10) {
            w.checkpoint(through(&[("a", i + 1)]), vec![(1, i + 1)]);
        }
        assert_eq!(w.pending(), WATERMARK_CHECKPOINTS_MAX);
        w.advance(|_| Some(u64::MAX));
        assert_eq!(
            w.for_queue(0),
            through(&[("a", WATERMARK_CHECKPOINTS_MAX as u64)])
        );
        assert!(w.checkpoint(through(&[("a", 99)]), vec![]));
    }
}
