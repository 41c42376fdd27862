//! Explicit acknowledgement: the I/O-free bookkeeping of [`AckMode::Manual`].
//!
//! The application acks each event's offset when its work is done, in any order (events
//! processed concurrently finish out of order). Acks to the server are cumulative, so an
//! offset counts as processed only once every offset shown before it is acked too: the
//! tracker holds an out-of-order ack until the gap below it closes. What is in progress (shown,
//! not acked) is not shown again.

use std::collections::VecDeque;

/// When an event counts as processed.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum AckMode {
    /// When the application asks the stream for the next event (or commits): today's
    /// default, for applications that process one event at a time.
    #[default]
    Auto,
    /// When the application acks its offset ([`EventStream::ack`](crate::EventStream::ack),
    /// [`Acker::ack`](crate::Acker::ack)); for applications that process events concurrently.
    Manual,
}

/// Why an ack was refused.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum AckError {
    #[error("offset {0} was never delivered to this client")]
    NotDelivered(u64),
    #[error("acks are automatic in this client's ack mode (use AckMode::Manual)")]
    NotManual,
}

/// The offsets shown to the application and not yet processed cumulatively.
#[derive(Debug, Default)]
pub struct AckTracker {
    /// Everything at or below it is processed.
    through: u64,
    /// Offsets above `through` shown to the application, ascending, each with whether it was
    /// acked. Events are shown in offset order, so a new one goes at the back (O(1), no
    /// allocation per event once the buffer has grown); lookups are binary searches.
    shown: VecDeque<(u64, bool)>,
}

impl AckTracker {
    /// Starts with everything through `offset` processed (a checkpoint, or a queue's start).
    pub fn new(through: u64) -> Self {
        AckTracker {
            through,
            shown: VecDeque::new(),
        }
    }

    /// Everything at or below this offset is processed.
    pub fn through(&self) -> u64 {
        self.through
    }

    /// The highest offset shown and not processed yet; `through` when there is none. No
    /// offset above it is in progress.
    pub fn highest_shown(&self) -> u64 {
        self.shown.back().map_or(self.through, |&(o, _)| o)
    }

    fn find(&self, offset: u64) -> Result<usize, usize> {
        self.shown.binary_search_by_key(&offset, |&(o, _)| o)
    }

    /// Whether `offset` was shown to the application and is not processed yet (a redelivery
    /// of it must not be shown again while the application works on it).
    pub fn in_progress(&self, offset: u64) -> bool {
        self.find(offset).is_ok()
    }

    /// Offsets shown and not acked yet.
    pub fn outstanding(&self) -> usize {
        self.shown.iter().filter(|&&(_, acked)| !acked).count()
    }

    /// `offset` is shown to the application. Offsets at or below `through` are ignored.
    pub fn shown(&mut self, offset: u64) {
        if offset <= self.through {
            return;
        }
        match self.shown.back() {
            Some(&(last, _)) if offset <= last => {
                if let Err(at) = self.find(offset) {
                    self.shown.insert(at, (offset, false));
                }
            }
            _ => self.shown.push_back((offset, false)),
        }
    }

    /// The application processed `offset`. Returns the new cumulative offset. Acking an
    /// offset twice, or one at or below `through`, changes nothing.
    pub fn ack(&mut self, offset: u64) -> Result<u64, AckError> {
        if offset <= self.through {
            return Ok(self.through);
        }
        match self.find(offset) {
            Ok(at) => self.shown[at].1 = true,
            Err(_) => return Err(AckError::NotDelivered(offset)),
        }
        // Close the gap: the lowest shown offsets, while acked. Offsets between two shown
        // ones were never shown (dropped as processed before, or other queues' numbering
        // after an expiry reset the tracker), so they do not hold the cumulative offset back.
        while let Some(&(o, true)) = self.shown.front() {
            self.through = o;
            self.shown.pop_front();
        }
        Ok(self.through)
    }

    /// Processed through `offset` by other means (a dropped redelivery; auto mode).
    pub fn processed(&mut self, offset: u64) {
        if offset > self.through {
            self.through = offset;
            while self.shown.front().is_some_and(|&(o, _)| o <= offset) {
                self.shown.pop_front();
            }
        }
    }

    /// The queue started again (`new` or `expired`): nothing is in progress.
    pub fn reset(&mut self, through: u64) {
        *self = AckTracker::new(through);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn an_ack_above_a_gap_waits_for_the_gap() {
        let mut t = AckTracker::new(0);
        for o in 1..=4 {
            t.shown(o);
        }
        assert_eq!(t.ack(3), Ok(0));
        assert_eq!(t.ack(2), Ok(0));
        assert_eq!(t.ack(1), Ok(3));
        assert_eq!(t.outstanding(), 1);
        assert!(t.in_progress(4) && !t.in_progress(3));
        assert_eq!(t.ack(4), Ok(4));
        assert_eq!(t.ack(4), Ok(4), "twice: nothing changes");
    }

    #[test]
    fn an_offset_never_shown_is_refused() {
        let mut t = AckTracker::new(10);
        t.shown(12);
        assert_eq!(t.ack(11), Err(AckError::NotDelivered(11)));
        assert_eq!(t.ack(13), Err(AckError::NotDelivered(13)));
        assert_eq!(
            t.ack(9),
            Ok(10),
            "at or below the checkpoint: already processed"
        );
        // 11 was never shown (dropped before): it does not hold 12 back.
        assert_eq!(t.ack(12), Ok(12));
    }

    #[test]
    fn processed_elsewhere_moves_past_what_was_shown() {
        let mut t = AckTracker::new(0);
        for o in 1..=3 {
            t.shown(o);
        }
        t.processed(2);
        assert_eq!((t.through(), t.outstanding()), (2, 1));
        assert_eq!(t.ack(3), Ok(3));
    }

    /// The tracker as it was first written, on an ordered map: the model the deque-based one
    /// must agree with.
    #[derive(Default)]
    struct Model {
        through: u64,
        shown: std::collections::BTreeMap<u64, bool>,
    }

    impl Model {
        fn shown(&mut self, o: u64) {
            if o > self.through {
                self.shown.entry(o).or_insert(false);
            }
        }
        fn ack(&mut self, o: u64) -> Result<u64, AckError> {
            if o <= self.through {
                return Ok(self.through);
            }
            match self.shown.get_mut(&o) {
                Some(a) => *a = true,
                None => return Err(AckError::NotDelivered(o)),
            }
            while let Some(e) = self.shown.first_entry() {
                if !*e.get() {
                    break;
                }
                self.through = *e.key();
                e.remove();
            }
            Ok(self.through)
        }
        fn processed(&mut self, o: u64) {
            if o > self.through {
                self.through = o;
                self.shown.retain(|k, _| *k > o);
            }
        }
    }

    proptest! {
        /// Any sequence of shown (in any order, repeated), acked and processed offsets gives
        /// the same answers as the ordered-map model.
        #[test]
        fn the_tracker_agrees_with_the_ordered_map_model(
            steps in proptest::collection::vec((0u8..3, 0u64..40), 0..200),
        ) {
            let (mut t, mut m) = (AckTracker::new(0), Model::default());
            for (kind, o) in steps {
                match kind {
                    0 => { t.shown(o); m.shown(o); }
                    1 => prop_assert_eq!(t.ack(o), m.ack(o)),
                    _ => { t.processed(o); m.processed(o); }
                }
                prop_assert_eq!(t.through(), m.through);
                prop_assert_eq!(t.outstanding(), m.shown.values().filter(|a| !**a).count());
                prop_assert_eq!(
                    t.highest_shown(),
                    m.shown.keys().next_back().copied().unwrap_or(m.through)
                );
                for k in 0..40 {
                    prop_assert_eq!(t.in_progress(k), m.shown.contains_key(&k));
                }
            }
        }

        /// Whatever the order of acks, the cumulative offset is the longest prefix of shown
        /// offsets all acked, and it never goes back.
        #[test]
        fn the_cumulative_offset_is_the_acked_prefix(
            n in 1usize..60,
            order in proptest::collection::vec(any::<prop::sample::Index>(), 0..80),
        ) {
            let mut t = AckTracker::new(0);
            for o in 1..=n as u64 {
                t.shown(o);
            }
            let mut acked = vec![false; n + 1];
            let mut last = 0;
            for i in order {
                let o = i.index(n) as u64 + 1;
                let through = t.ack(o).unwrap();
                acked[o as usize] = true;
                let prefix = (1..=n).take_while(|&k| acked[k]).count() as u64;
                prop_assert_eq!(through, prefix);
                prop_assert!(through >= last);
                last = through;
            }
        }
    }
}
