//! The delivery cursor of one ready session: which offsets to read next, which flags they
//! carry, and when the live marker is due. Plain data, no I/O.
//!
//! Nothing is delivered before ready (non-durable clients are ready from the start). At ready
//! the cursor records `replay_end = end`: entries up to it are flagged `replayed`, a read never
//! crosses `replay_end`, and the live marker for a region goes out once per session, after the
//! last replayed entry and before the first live one.

use std::collections::BTreeSet;

use tether_storage::Offset;

use crate::protocol::{FLAG_POSSIBLE_DUPLICATE, FLAG_REPLAYED};

/// What a session's delivery driver should do next.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Step {
    /// Read entries `from..=to` of the queue and send them (fewer if a frame fills up).
    Read { from: Offset, to: Offset },
    /// Send the live marker for these regions.
    Live(Vec<String>),
    /// Nothing to do until the queue grows, an ack arrives or interest changes.
    Idle,
}

/// The part of a cursor that decides wire flags; fixed for a session once it is ready.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FlagBounds {
    pub replay_end: Offset,
    pub dup_until: Offset,
}

impl FlagBounds {
    /// Flags the wire adds to the entry at `offset`.
    pub fn wire_flags(&self, offset: Offset) -> u8 {
        let mut f = 0;
        if offset <= self.replay_end {
            f |= FLAG_REPLAYED;
        }
        if offset <= self.dup_until {
            f |= FLAG_POSSIBLE_DUPLICATE;
        }
        f
    }
}

/// Delivery position of a ready session.
#[derive(Clone, Debug)]
pub struct Cursor {
    /// Next offset to send.
    pub next: Offset,
    /// Queue end when the client said ready: offsets up to here are `replayed`.
    pub replay_end: Offset,
    /// Highest offset written to this durable id by an earlier session: offsets up to here
    /// (and above the acked offset) are `possible_duplicate`.
    pub dup_until: Offset,
    /// Regions whose live marker this session has sent.
    pub announced: BTreeSet<String>,
    /// Set when regions may need a live marker (at ready, after a registration).
    pub live_check: bool,
    /// Whether the marker that ends the replay has been sent.
    pub live_sent: bool,
}

impl Cursor {
    pub fn new(acked: Offset, replay_end: Offset, dup_until: Offset) -> Self {
        Cursor {
            next: acked + 1,
            replay_end,
            dup_until,
            announced: BTreeSet::new(),
            live_check: true,
            live_sent: false,
        }
    }

    /// Whether every replayed entry has been sent.
    pub fn replay_done(&self) -> bool {
        self.next > self.replay_end
    }

    /// Flags the wire adds to the entry at `offset`.
    pub fn wire_flags(&self, offset: Offset) -> u8 {
        self.bounds().wire_flags(offset)
    }

    pub fn bounds(&self) -> FlagBounds {
        FlagBounds {
            replay_end: self.replay_end,
            dup_until: self.dup_until,
        }
    }

    /// Decides the next step. `visible_end` is the highest committed offset, `acked` the acked
    /// offset, `regions` the regions the queue has interest in now.
    pub fn step<'a>(
        &mut self,
        visible_end: Offset,
        acked: Offset,
        inflight_max: u64,
        regions: impl FnOnce() -> Vec<&'a str>,
    ) -> Step {
        if self.live_check && self.replay_done() {
            self.live_check = false;
            let due: Vec<String> = regions()
                .into_iter()
                .filter(|r| !self.announced.contains(*r))
                .map(str::to_string)
                .collect();
            // The first marker ends the replay even when no region has interest (it then lists
            // none); later ones announce regions that got interest since.
            if !due.is_empty() || !self.live_sent {
                self.live_sent = true;
                self.announced.extend(due.iter().cloned());
                return Step::Live(due);
            }
        }
        let window_end = acked.saturating_add(inflight_max);
        // Never cross the replay boundary in one read: the live marker goes between.
        let mut to = visible_end.min(window_end);
        if self.next <= self.replay_end {
            to = to.min(self.replay_end);
        }
        if self.next <= to {
            Step::Read {
                from: self.next,
                to,
            }
        } else {
            Step::Idle
        }
    }

    /// Records that offsets up to `last` were handed to the wire.
    pub fn sent(&mut self, last: Offset) {
        debug_assert!(last >= self.next);
        let was_replaying = !self.replay_done();
        self.next = last + 1;
        if was_replaying && self.replay_done() {
            self.live_check = true;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::limits::INFLIGHT_EVENTS_PER_SESSION_MAX;

    /// The in-flight window the tests use.
    const W: u64 = INFLIGHT_EVENTS_PER_SESSION_MAX;

    #[test]
    fn replay_then_live_then_tail() {
        let mut c = Cursor::new(2, 5, 3);
        assert_eq!(c.step(5, 2, W, || vec!["R"]), Step::Read { from: 3, to: 5 });
        assert_eq!(c.wire_flags(3), FLAG_REPLAYED | FLAG_POSSIBLE_DUPLICATE);
        assert_eq!(c.wire_flags(4), FLAG_REPLAYED);
        c.sent(5);
        assert_eq!(c.step(5, 2, W, || vec!["R"]), Step::Live(vec!["R".into()]));
        assert_eq!(c.step(5, 2, W, || vec!["R"]), Step::Idle);
        assert_eq!(c.step(7, 2, W, || vec!["R"]), Step::Read { from: 6, to: 7 });
        assert_eq!(c.wire_flags(6), 0);
    }

    #[test]
    fn read_stops_at_replay_end_even_when_more_is_visible() {
        let mut c = Cursor::new(0, 2, 0);
        assert_eq!(
            c.step(10, 0, W, || vec!["R"]),
            Step::Read { from: 1, to: 2 }
        );
        c.sent(2);
        assert_eq!(c.step(10, 0, W, || vec!["R"]), Step::Live(vec!["R".into()]));
        assert_eq!(
            c.step(10, 0, W, || vec!["R"]),
            Step::Read { from: 3, to: 10 }
        );
    }

    #[test]
    fn empty_replay_is_live_at_once_and_new_regions_get_one_marker() {
        let mut c = Cursor::new(0, 0, 0);
        assert_eq!(c.step(0, 0, W, || vec!["A"]), Step::Live(vec!["A".into()]));
        c.live_check = true; // a registration in a new region
        assert_eq!(
            c.step(0, 0, W, || vec!["A", "B"]),
            Step::Live(vec!["B".into()])
        );
        c.live_check = true;
        assert_eq!(c.step(0, 0, W, || vec!["A", "B"]), Step::Idle);
    }

    #[test]
    fn replay_end_is_marked_even_without_interest() {
        let mut c = Cursor::new(0, 2, 0);
        assert_eq!(c.step(2, 0, W, Vec::new), Step::Read { from: 1, to: 2 });
        c.sent(2);
        assert_eq!(c.step(2, 0, W, Vec::new), Step::Live(vec![]));
        assert_eq!(c.step(2, 0, W, Vec::new), Step::Idle);
        c.live_check = true; // interest registered later: its region gets its marker
        assert_eq!(c.step(2, 0, W, || vec!["R"]), Step::Live(vec!["R".into()]));
    }

    #[test]
    fn inflight_window_bounds_reads() {
        let mut c = Cursor::new(0, 0, 0);
        c.live_check = false;
        let far = INFLIGHT_EVENTS_PER_SESSION_MAX + 10;
        assert_eq!(
            c.step(far, 0, W, Vec::new),
            Step::Read {
                from: 1,
                to: INFLIGHT_EVENTS_PER_SESSION_MAX
            }
        );
        c.sent(INFLIGHT_EVENTS_PER_SESSION_MAX);
        assert_eq!(c.step(far, 0, W, Vec::new), Step::Idle);
        assert_eq!(
            c.step(far, 5, W, Vec::new),
            Step::Read {
                from: INFLIGHT_EVENTS_PER_SESSION_MAX + 1,
                to: INFLIGHT_EVENTS_PER_SESSION_MAX + 5
            }
        );
    }
}
