//! The sending side of publish forwarding to one peer, without I/O (the driver is
//! `server/forward.rs`'s `forward_loop`).
//!
//! An origin ships its publish log to each peer in runs, in order, with up to
//! [`FORWARD_RPCS_IN_FLIGHT_MAX`] runs in flight. A run sent while another is in flight says
//! which offset it follows, so the peer applies it only after that one. The peer answers how
//! far it applied the log (`through`); the durable cursor (`sent`, kept by the driver) moves
//! to that. A run that is not answered, or answered short of its last offset, fails the
//! pipeline: nothing more is handed until every run in flight has answered, then after a
//! pause (doubling from [`FORWARD_RETRY_MIN_MS`] to [`FORWARD_RETRY_MAX_MS`], reset by a run
//! answered in full) the sender starts again from the cursor. An answer past what was handed
//! (the peer applied runs sent before this node restarted) moves the next run past it. With
//! nothing to ship and nothing in flight, a run without entries tells the peer the *floor*
//! (how far every peer has applied this log) when it moved since the peer was last told.
//!
//! The receiving side's rules are [`run_ready`], [`entry_step`] and [`applied_before_run`]: a
//! peer applies an origin's entries once each, in order, and never past a gap.
//!
//! A publish log's offsets are never reused, even by a node that lost its data directory and
//! came back under its name: a new log starts at [`new_log_start`], a number that grows with
//! the wall clock faster than any log can, and every run says where its log started, so a
//! peer that applied the old log takes the new one from its start instead of skipping its
//! entries as applied (which it did before: the new log's first publishes never reached the
//! peers' queues).
//!
//! Invariants (asserted): runs are handed in offset order, each starting right after the
//! last offset handed; at most [`FORWARD_RPCS_IN_FLIGHT_MAX`] runs are in flight; a failed
//! pipeline hands nothing until it resumes.

use crate::limits::IDS_EPOCH_MS;

/// Forwarding runs to one peer in flight at once.
pub const FORWARD_RPCS_IN_FLIGHT_MAX: usize = 2;
/// Deadline of one forwarding run (a peer RPC), in milliseconds: past it the run is
/// unanswered.
pub const FORWARD_RPC_TIMEOUT_MS: u64 = 10_000;
/// First pause after a failed forward, in milliseconds (doubles up to the max).
pub const FORWARD_RETRY_MIN_MS: u64 = 50;
/// Longest pause between forwarding attempts to an unreachable peer, in milliseconds.
pub const FORWARD_RETRY_MAX_MS: u64 = 2_000;

/// A new publish log's first offset is the milliseconds since [`IDS_EPOCH_MS`] shifted left
/// by this many bits, plus one: a log started later starts past every offset of one
/// started earlier unless that one averaged 2^12 publishes a millisecond (4 million a second)
/// over its life. Offsets stay below 2^53 (exact in JSON numbers) for 2^41 ms, 69 years.
pub const PUBLISH_LOG_START_SHIFT_BITS: u32 = 12;

/// The first offset of a publish log created at wall time `now_ms`.
pub fn new_log_start(now_ms: u64) -> u64 {
    (now_ms.saturating_sub(IDS_EPOCH_MS) << PUBLISH_LOG_START_SHIFT_BITS) + 1
}

/// What a peer counts as applied of an origin's log before taking a run, having applied it
/// through `applied`, when the run says the log starts at `log_start` (0: a log from before
/// starts were told, which starts at 1): nothing below its start will ever come. A start past
/// what was applied is a new log (its origin lost its data directory; what the old log held
/// past `applied` was lost with it).
pub fn applied_before_run(applied: u64, log_start: u64) -> u64 {
    applied.max(log_start.saturating_sub(1))
}

/// One run handed to the peer: the publish-log offsets `first..=last` it carries (both 0 for
/// a run that only tells the floor), the offset it follows when another run was in flight as
/// it was handed, and the floor it tells.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Run {
    pub first: u64,
    pub last: u64,
    pub follows: Option<u64>,
    pub floor: u64,
}

impl Run {
    /// Whether the run carries no entries (it only tells the floor).
    pub fn floor_only(&self) -> bool {
        self.last == 0
    }
}

/// How a peer answered a run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Answer {
    /// No answer (the call failed or timed out), or one that is not a publish answer.
    None,
    /// The peer applied the log through `through` (its copies may or may not confirm it:
    /// either way it took the run and the floor it carried).
    Applied { through: u64 },
    /// The peer put the run off (joining, stopping, the run before not there yet, a refused
    /// write) having applied the log through `through`.
    Deferred { through: u64 },
}

impl Answer {
    /// How far the peer says it applied the log, if it answered.
    pub fn through(self) -> Option<u64> {
        match self {
            Answer::None => None,
            Answer::Applied { through } | Answer::Deferred { through } => Some(through),
        }
    }
}

/// The forwarding pipeline to one peer.
#[derive(Debug, Clone)]
pub struct Sender {
    /// The last offset handed to a run (in flight or answered).
    handed: u64,
    /// Runs handed and not answered yet.
    in_flight: usize,
    /// A run failed: hand nothing more until the runs in flight have answered, then pause.
    failed: bool,
    /// The pause before the next attempt after a failure, in milliseconds.
    retry_ms: u64,
    /// The floor the peer was last told.
    floor_told: u64,
}

impl Sender {
    /// A pipeline starting after `sent`, how far the peer is known to have applied the log.
    pub fn new(sent: u64) -> Self {
        Sender {
            handed: sent,
            in_flight: 0,
            failed: false,
            retry_ms: FORWARD_RETRY_MIN_MS,
            floor_told: 0,
        }
    }

    /// The last offset handed: the next run reads from the offset after it.
    pub fn handed(&self) -> u64 {
        self.handed
    }

    /// Whether a run may be handed now.
    pub fn may_hand(&self) -> bool {
        !self.failed && self.in_flight < FORWARD_RPCS_IN_FLIGHT_MAX
    }

    /// Whether no run is in flight.
    pub fn idle(&self) -> bool {
        self.in_flight == 0
    }

    /// Whether the peer has not been told `floor` yet.
    pub fn floor_untold(&self, floor: u64) -> bool {
        floor > self.floor_told
    }

    /// After a failure, once every run in flight answered: the pause (milliseconds) to take
    /// before [`resume`](Self::resume). `None` while the pipeline works or runs are in flight.
    pub fn pause_ms(&self) -> Option<u64> {
        (self.failed && self.in_flight == 0).then_some(self.retry_ms)
    }

    /// After the pause: starts again after `sent` (the cursor as the answers left it), with
    /// the next pause doubled.
    pub fn resume(&mut self, sent: u64) {
        assert!(
            self.failed && self.in_flight == 0,
            "resumed a forwarding pipeline that had not failed or still had runs in flight"
        );
        self.retry_ms = (self.retry_ms * 2).min(FORWARD_RETRY_MAX_MS);
        self.failed = false;
        self.handed = sent;
    }

    /// With the entries read after [`handed`](Self::handed) ending at `last_read` (`None`:
    /// nothing to ship) and the current `floor`: the run to send, if any. A run without entries
    /// goes only when nothing is in flight and the floor moved (a run carries it anyway).
    pub fn hand(&mut self, last_read: Option<u64>, floor: u64) -> Option<Run> {
        assert!(self.may_hand(), "handed a run while the pipeline may not");
        let follows = (self.in_flight > 0).then_some(self.handed);
        let run = match last_read {
            Some(last) => {
                assert!(
                    last > self.handed,
                    "a run must carry offsets after {} (it ends at {last})",
                    self.handed
                );
                let first = self.handed + 1;
                self.handed = last;
                Run {
                    first,
                    last,
                    follows,
                    floor,
                }
            }
            None if self.in_flight == 0 && self.floor_untold(floor) => Run {
                first: 0,
                last: 0,
                follows: None,
                floor,
            },
            None => return None,
        };
        self.in_flight += 1;
        Some(run)
    }

    /// The peer answered `run` with `answer`. Returns how far the peer says it applied the
    /// log, for the driver to record (the cursor only moves forward there).
    pub fn answered(&mut self, run: &Run, answer: Answer) -> Option<u64> {
        self.landed();
        if let Answer::Applied { .. } = answer {
            self.floor_told = self.floor_told.max(run.floor);
        }
        let through = answer.through();
        // The peer may have applied more than was handed (runs of before a restart of this
        // node, whose answers or cursor writes were lost): the next run starts after that.
        // Else it would start at entries trimmed meanwhile (every peer applied them), which
        // the log no longer holds, and the pipeline would never hand anything again.
        if let Some(t) = through {
            self.handed = self.handed.max(t);
        }
        // A floor-only run carried nothing (`last` 0): it fails only if unanswered.
        if through.is_none_or(|t| t < run.last) {
            self.failed = true;
        } else if !run.floor_only() {
            self.retry_ms = FORWARD_RETRY_MIN_MS;
        }
        through
    }

    /// A run in flight ended without an answer to read (its task was lost).
    pub fn lost(&mut self) {
        self.landed();
        self.failed = true;
    }

    fn landed(&mut self) {
        assert!(
            self.in_flight > 0,
            "an answer to a run that was not in flight"
        );
        self.in_flight -= 1;
    }
}

/// Whether a peer that applied an origin's log through `applied` takes a run that follows
/// offset `follows` now; else the run waits for the one before it (up to
/// `FORWARD_GAP_WAIT_MS`, then it is deferred with what is applied).
pub fn run_ready(applied: u64, follows: Option<u64>) -> bool {
    follows.is_none_or(|after| applied >= after)
}

/// What a peer does with the entry at `offset` of an origin's log, having applied (or
/// submitted) the log through `applied`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EntryStep {
    /// Applied before (a run sent again after a lost answer): skipped.
    Skip,
    /// The next entry: applied.
    Apply,
    /// Past a gap: the entries between were never applied here. Nothing more of the run is
    /// applied; the peer answers with what it applied and the origin sends again from there.
    Gap,
}

/// The step for the entry at `offset` after `applied`.
pub fn entry_step(applied: u64, offset: u64) -> EntryStep {
    match offset.cmp(&(applied + 1)) {
        std::cmp::Ordering::Less => EntryStep::Skip,
        std::cmp::Ordering::Equal => EntryStep::Apply,
        std::cmp::Ordering::Greater => EntryStep::Gap,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A log created later starts past every offset a log created earlier used, at any rate
    /// a node can publish; a peer that applied the old log takes the new one from its start,
    /// and one behind a log's start (new to it) waits for nothing below it.
    #[test]
    fn a_new_log_starts_past_the_old_one_and_its_peers_take_it_from_there() {
        let old_created_ms = IDS_EPOCH_MS + 3_600_000;
        let old = new_log_start(old_created_ms);
        // The old log took a million publishes a second for a day, then the node lost its data.
        let old_end = old + 86_400 * 1_000_000;
        let new = new_log_start(old_created_ms + 86_400_001);
        assert!(new > old_end, "{new} > {old_end}");
        // Or a thousand publishes in its first second.
        assert!(new_log_start(old_created_ms + 1000) > old + 1000);
        assert!(new_log_start(IDS_EPOCH_MS + (69 * 365 * 86_400_000)) < 1 << 53);
        assert_eq!(applied_before_run(old_end, new), new - 1);
        assert_eq!(
            entry_step(applied_before_run(old_end, new), new),
            EntryStep::Apply
        );
        // The same log: what was applied stands.
        assert_eq!(applied_before_run(new + 5, new), new + 5);
        // A log from before starts were told (0), or a clock before the epoch (start 1).
        assert_eq!(applied_before_run(7, 0), 7);
        assert_eq!(new_log_start(0), 1);
        assert_eq!(applied_before_run(0, new_log_start(0)), 0);
        // A peer new to the log waits for nothing below its start.
        assert_eq!(
            entry_step(applied_before_run(0, old), old),
            EntryStep::Apply
        );
    }

    fn run(first: u64, last: u64, follows: Option<u64>, floor: u64) -> Run {
        Run {
            first,
            last,
            follows,
            floor,
        }
    }

    #[test]
    fn runs_follow_each_other_and_the_second_says_which_it_follows() {
        let mut s = Sender::new(10);
        let a = s.hand(Some(15), 3).unwrap();
        assert_eq!(a, run(11, 15, None, 3));
        assert!(s.may_hand());
        let b = s.hand(Some(20), 3).unwrap();
        assert_eq!(b, run(16, 20, Some(15), 3));
        // Two in flight: the pipeline is full.
        assert!(!s.may_hand());
        assert_eq!(s.answered(&a, Answer::Applied { through: 15 }), Some(15));
        assert!(s.may_hand());
        assert_eq!(
            s.hand(None, 3),
            None,
            "nothing new and the floor told with a run"
        );
        assert_eq!(s.answered(&b, Answer::Applied { through: 20 }), Some(20));
        assert!(s.idle());
        assert_eq!(s.pause_ms(), None);
        assert_eq!(s.hand(Some(21), 3).unwrap(), run(21, 21, None, 3));
    }

    #[test]
    fn a_run_answered_short_stops_the_pipeline_until_the_runs_in_flight_answer() {
        let mut s = Sender::new(0);
        let a = s.hand(Some(5), 0).unwrap();
        let b = s.hand(Some(9), 0).unwrap();
        // The peer applied 1..=3 only: the pipeline fails and hands nothing more.
        assert_eq!(s.answered(&a, Answer::Deferred { through: 3 }), Some(3));
        assert!(!s.may_hand());
        assert_eq!(s.pause_ms(), None, "a run is still in flight");
        // The second run comes back deferred too (the run before it never completed).
        assert_eq!(s.answered(&b, Answer::Deferred { through: 3 }), Some(3));
        assert_eq!(s.pause_ms(), Some(FORWARD_RETRY_MIN_MS));
        // Resumed from the cursor, not from what was handed.
        s.resume(3);
        assert_eq!(s.handed(), 3);
        assert_eq!(s.hand(Some(9), 0).unwrap(), run(4, 9, None, 0));
    }

    #[test]
    fn the_pause_doubles_to_its_limit_and_a_full_answer_resets_it() {
        let mut s = Sender::new(0);
        let mut pauses = Vec::new();
        for _ in 0..8 {
            let r = s.hand(Some(4), 0).unwrap();
            assert_eq!(s.answered(&r, Answer::None), None);
            let pause = s.pause_ms().unwrap();
            pauses.push(pause);
            s.resume(0);
        }
        assert_eq!(pauses, [50, 100, 200, 400, 800, 1_600, 2_000, 2_000]);
        let r = s.hand(Some(4), 0).unwrap();
        assert_eq!(s.answered(&r, Answer::Applied { through: 4 }), Some(4));
        let r = s.hand(Some(6), 0).unwrap();
        s.lost();
        assert_eq!(
            s.pause_ms(),
            Some(FORWARD_RETRY_MIN_MS),
            "{r:?} lost after a reset"
        );
    }

    #[test]
    fn the_floor_goes_alone_only_when_idle_and_moved_and_is_told_once_taken() {
        let mut s = Sender::new(7);
        assert_eq!(s.hand(None, 0), None, "the floor 0 needs no telling");
        let f = s.hand(None, 4).unwrap();
        assert!(f.floor_only());
        assert_eq!(f, run(0, 0, None, 4));
        // Unanswered: the floor is still untold, and the pipeline pauses (the peer is away).
        assert_eq!(s.answered(&f, Answer::None), None);
        assert!(s.floor_untold(4));
        s.resume(7);
        let f = s.hand(None, 4).unwrap();
        // Deferred (say the peer is joining): it did not take the floor.
        assert_eq!(s.answered(&f, Answer::Deferred { through: 0 }), Some(0));
        assert_eq!(
            s.pause_ms(),
            None,
            "a floor-only run answered is no failure"
        );
        assert!(s.floor_untold(4));
        let f = s.hand(None, 4).unwrap();
        assert_eq!(s.answered(&f, Answer::Applied { through: 7 }), Some(7));
        assert!(!s.floor_untold(4));
        assert_eq!(s.hand(None, 4), None);
        // With a run in flight, the floor waits for the next run that carries entries.
        let a = s.hand(Some(8), 5).unwrap();
        assert_eq!(s.hand(None, 6), None);
        assert_eq!(s.answered(&a, Answer::Applied { through: 8 }), Some(8));
        assert!(!s.floor_untold(5));
        assert!(s.floor_untold(6));
    }

    #[test]
    fn an_answer_past_what_was_handed_moves_the_next_run_past_it() {
        // Restarted with the cursor at 10 while the peer had applied through 40.
        let mut s = Sender::new(10);
        let a = s.hand(Some(20), 10).unwrap();
        let b = s.hand(Some(30), 10).unwrap();
        assert_eq!(s.answered(&a, Answer::Applied { through: 40 }), Some(40));
        // Runs start after 40 (what is at or below it may be trimmed already), and follow it
        // while `b` is in flight.
        assert_eq!(s.handed(), 40);
        assert_eq!(s.hand(Some(45), 40).unwrap(), run(41, 45, Some(40), 40));
        assert_eq!(s.answered(&b, Answer::Applied { through: 45 }), Some(45));
        assert_eq!(s.handed(), 45);
    }

    #[test]
    fn a_peer_applies_the_next_entry_skips_older_ones_and_stops_at_a_gap() {
        assert_eq!(entry_step(4, 3), EntryStep::Skip);
        assert_eq!(entry_step(4, 4), EntryStep::Skip);
        assert_eq!(entry_step(4, 5), EntryStep::Apply);
        assert_eq!(entry_step(4, 6), EntryStep::Gap);
        assert_eq!(entry_step(0, 1), EntryStep::Apply);
        assert!(run_ready(4, None));
        assert!(run_ready(4, Some(4)));
        assert!(run_ready(4, Some(3)));
        assert!(!run_ready(4, Some(5)));
    }

    #[test]
    #[should_panic(expected = "a run must carry offsets after 5")]
    fn a_run_that_does_not_start_after_the_last_handed_is_a_bug() {
        let mut s = Sender::new(5);
        s.hand(Some(5), 0);
    }

    #[test]
    #[should_panic(expected = "an answer to a run that was not in flight")]
    fn an_answer_without_a_run_in_flight_is_a_bug() {
        let mut s = Sender::new(0);
        s.lost();
    }
}
