//! Explicit acknowledgement: the I/O-free bookkeeping of [`AckMode::Manual`].
//!
//! The application acks each event's offset when its work is done, in any order (events
//! processed concurrently finish out of order). Acks to the server are cumulative, so an
//! offset counts as processed only once every offset shown before it is acked too: the
//! tracker holds an out-of-order ack until the gap below it closes.

use std::collections::BTreeMap;

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
    /// Offsets above `through` shown to the application: acked or not.
    shown: BTreeMap<u64, bool>,
}

impl AckTracker {
    /// Starts with everything through `offset` processed (a checkpoint, or a queue's start).
    pub fn new(through: u64) -> Self {
        AckTracker {
            through,
            shown: BTreeMap::new(),
        }
    }

    /// Everything at or below this offset is processed.
    pub fn through(&self) -> u64 {
        self.through
    }

    /// Whether `offset` was shown to the application and is not processed yet (a redelivery
    /// of it must not be shown again while the application works on it).
    pub fn in_progress(&self, offset: u64) -> bool {
        self.shown.contains_key(&offset)
    }

    /// Offsets shown and not acked yet.
    pub fn outstanding(&self) -> usize {
        self.shown.values().filter(|acked| !**acked).count()
    }

    /// `offset` is shown to the application. Offsets at or below `through` are ignored.
    pub fn shown(&mut self, offset: u64) {
        if offset > self.through {
            self.shown.entry(offset).or_insert(false);
        }
    }

    /// The application processed `offset`. Returns the new cumulative offset. Acking an
    /// offset twice, or one at or below `through`, changes nothing.
    pub fn ack(&mut self, offset: u64) -> Result<u64, AckError> {
        if offset <= self.through {
            return Ok(self.through);
        }
        match self.shown.get_mut(&offset) {
            Some(acked) => *acked = true,
            None => return Err(AckError::NotDelivered(offset)),
        }
        // Close the gap: the lowest shown offsets, while acked. Offsets between two shown
        // ones were never shown (dropped as processed before, or other queues' numbering
        // after an expiry reset the tracker), so they do not hold the cumulative offset back.
        while let Some(entry) = self.shown.first_entry() {
            if !*entry.get() {
                break;
            }
            self.through = *entry.key();
            entry.remove();
        }
        Ok(self.through)
    }

    /// Processed through `offset` by other means (a dropped redelivery; auto mode).
    pub fn processed(&mut self, offset: u64) {
        if offset > self.through {
            self.through = offset;
            self.shown.retain(|o, _| *o > offset);
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

    proptest! {
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
