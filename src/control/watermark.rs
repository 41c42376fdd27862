//! Per-queue watermarks: how far, per origin, a copy of a queue holds the publishes its
//! primary applied. A sans-IO state machine; `server/shipping.rs` drives it, `server/copies.rs`
//! records what a copy is told.
//!
//! Why: a node keeps the publishes it applied lately (`RecentForwards`) for a promotion of
//! a copy it holds (the failed primary may not have shipped them yet). It may forget a publish
//! only once each copy it holds is known to hold it (and every member applied it, see
//! `server/failover.rs`); a promotion appends only the kept publishes its copy does not hold.
//! Applied publishes are counted per origin by the origin's publish-log offset (each origin's
//! entries are applied in order, see `server/forward.rs`), so "everything from origin `o` up to
//! offset `x`" is one number per origin ([`Through`]).
//!
//! How: before the primary reads a queue's committed end `E` to ship it, it reads what it has
//! applied, `A` (entries become visible before their publish counts as applied, so the queue's
//! log up to `E` holds every matching publish counted in `A`). The pair `(E, A)` is a
//! [`Coverage`] point. A message whose log reaches `E` carries the latest such point; the copy
//! records `A` as its watermark once it acknowledged its log up to `E` (durably, in the message's
//! epoch), and forgets it if its log is cut back (a new primary with another tail).

use std::collections::{BTreeMap, VecDeque};

/// Per origin node: the highest publish-log offset covered.
pub type Through = BTreeMap<String, u64>;

/// Most coverage points kept per shipped queue; when full, every other one goes (a message may
/// then carry an older point: the watermark moves in coarser steps, never wrongly).
pub const COVERAGE_POINTS_MAX: usize = 64;

/// Raises every origin of `into` to at least its value in `from`.
pub fn merge(into: &mut Through, from: &Through) {
    for (origin, &offset) in from {
        let e = into.entry(origin.clone()).or_insert(0);
        *e = (*e).max(offset);
    }
}

/// A primary's coverage points of one queue, oldest first: `(end, applied)`, the queue's log up
/// to `end` holds every matching publish counted in `applied`. Ends and applied offsets only
/// grow along the list.
#[derive(Default)]
pub struct Coverage {
    points: VecDeque<(u64, Through)>,
}

impl Coverage {
    /// `applied` was read before the queue's committed end `end`.
    pub fn note(&mut self, applied: Through, end: u64) {
        if applied.is_empty() {
            return;
        }
        if let Some((e, a)) = self.points.back_mut()
            && *e == end
        {
            *a = applied;
            return;
        }
        debug_assert!(
            self.points.back().is_none_or(|(e, _)| *e < end),
            "a queue's committed end never falls"
        );
        if self.points.len() >= COVERAGE_POINTS_MAX {
            let mut i = 0;
            self.points.retain(|_| {
                i += 1;
                i % 2 == 1
            });
        }
        self.points.push_back((end, applied));
    }

    /// The point a message whose log reaches `log_end` may carry: the latest at or below it.
    pub fn for_end(&self, log_end: u64) -> Option<&(u64, Through)> {
        self.points.iter().rev().find(|(e, _)| *e <= log_end)
    }

    /// Every copy acknowledged up to `replicated_end`: the points before the latest one at or
    /// below it are of no more use.
    pub fn prune(&mut self, replicated_end: u64) {
        while self.points.len() > 1 && self.points[1].0 <= replicated_end {
            self.points.pop_front();
        }
    }

    #[cfg(test)]
    fn len(&self) -> usize {
        self.points.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn through(v: &[(&str, u64)]) -> Through {
        v.iter().map(|&(o, x)| (o.to_string(), x)).collect()
    }

    #[test]
    fn a_message_carries_the_latest_point_its_log_reaches() {
        let mut c = Coverage::default();
        assert!(c.for_end(10).is_none());
        c.note(through(&[("a", 5)]), 4);
        c.note(through(&[("a", 7), ("b", 1)]), 9);
        assert!(
            c.for_end(3).is_none(),
            "the log does not reach the first point"
        );
        assert_eq!(c.for_end(8), Some(&(4, through(&[("a", 5)]))));
        assert_eq!(c.for_end(9), Some(&(9, through(&[("a", 7), ("b", 1)]))));
        assert_eq!(c.for_end(100).map(|p| p.0), Some(9));
    }

    #[test]
    fn a_later_read_at_the_same_end_replaces_the_point() {
        let mut c = Coverage::default();
        c.note(through(&[("a", 5)]), 4);
        c.note(through(&[("a", 6)]), 4);
        assert_eq!(c.len(), 1);
        assert_eq!(c.for_end(4), Some(&(4, through(&[("a", 6)]))));
        c.note(Through::new(), 8);
        assert_eq!(c.len(), 1, "nothing applied yet says nothing");
    }

    #[test]
    fn points_every_copy_passed_are_pruned_but_the_latest_stays() {
        let mut c = Coverage::default();
        for (i, end) in [2, 4, 6, 8].into_iter().enumerate() {
            c.note(through(&[("a", i as u64 + 1)]), end);
        }
        c.prune(5);
        assert_eq!(c.len(), 3, "4 is the latest at or below 5; 2 goes");
        assert_eq!(c.for_end(5).map(|p| p.0), Some(4));
        c.prune(100);
        assert_eq!(c.len(), 1);
        assert_eq!(c.for_end(8), Some(&(8, through(&[("a", 4)]))));
    }

    #[test]
    fn at_most_the_bounded_number_of_points_are_kept() {
        let mut c = Coverage::default();
        for i in 0..(COVERAGE_POINTS_MAX as u64 + 10) {
            c.note(through(&[("a", i + 1)]), i + 1);
        }
        assert!(c.len() <= COVERAGE_POINTS_MAX);
        let newest = COVERAGE_POINTS_MAX as u64 + 10;
        assert_eq!(
            c.for_end(newest),
            Some(&(newest, through(&[("a", newest)])))
        );
        // Every other older point went: a log ending at one of those gets the one before.
        assert_eq!(c.for_end(2), Some(&(1, through(&[("a", 1)]))));
        assert_eq!(c.for_end(3).map(|p| p.0), Some(3));
    }
}
