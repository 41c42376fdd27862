//! Failure detection: which members answer, and which the metadata leader declares failed.
//!
//! A sans-IO state machine. The driver (`server/failover.rs`, `detect_loop`) pings every member
//! each [`PING_INTERVAL_MS`], reports what answered ([`FailureDetector::answered_ping`],
//! [`FailureDetector::answered`]) with the time on its own monotonic clock in milliseconds,
//! and, on the metadata leader, asks [`FailureDetector::to_declare`] which members to declare
//! failed; it reports each declaration the metadata accepted ([`FailureDetector::declared`]).
//!
//! Rules:
//! - every member counts as seen when the detector starts, so each gets the failure time once
//!   before it can be declared failed;
//! - a member is declared failed when it has been silent for the failure time, only by the
//!   metadata leader, only if it holds a queue or a copy (declaring it changes placements), and
//!   once until it answers a ping again;
//! - a declaration the metadata did not accept is asked for again at the next tick;
//! - time never goes back: an answer older than one already seen changes nothing;
//! - any answer counts, not only pings (replication, forwarding: [`FailureDetector::answered`]).
//!
//! The detector also tells whether this node reaches a majority of the members
//! ([`FailureDetector::majority_reachable`]: a primary without lease or majority steps aside)
//! and which members it has not reached for [`SECONDARY_UNREACHABLE_FAILURE_PERIODS`] failure
//! times ([`FailureDetector::unreachable`]: a primary that reaches a majority takes those
//! secondaries out of its replica sets).

use std::collections::{BTreeMap, BTreeSet};

use crate::cluster::meta::NodeId;

/// Interval between liveness pings to each member, in milliseconds.
pub const PING_INTERVAL_MS: u64 = 300;
/// Timeout of one ping, in milliseconds.
pub const PING_TIMEOUT_MS: u64 = 1_000;
/// A member that answered a ping within this time counts as live when choosing nodes for
/// copies and when waiting for copies, in milliseconds.
pub const MEMBER_LIVE_MS: u64 = 1_500;

/// A secondary this node has not reached for this many failure times (`node-failure-ms`) is
/// unreachable from here ([`FailureDetector::unreachable`]): its primary takes it out of the
/// replica set if the primary reaches a majority. Longer than the one failure time after
/// which the metadata leader declares a member failed, so a member that died is taken out by
/// that one declaration, not by one metadata write per queue.
pub const SECONDARY_UNREACHABLE_FAILURE_PERIODS: u64 = 2;

const _: () = assert!(PING_INTERVAL_MS < MEMBER_LIVE_MS && PING_TIMEOUT_MS < MEMBER_LIVE_MS);
const _: () = assert!(PING_TIMEOUT_MS < crate::config::NODE_FAILURE_MS_MIN);

/// When each member last answered, and which were declared failed since.
#[derive(Debug, Clone)]
pub struct FailureDetector {
    failure_ms: u64,
    /// Per member: when it last answered (the driver's clock, in milliseconds).
    last_seen_ms: BTreeMap<NodeId, u64>,
    /// Members declared failed that have not answered a ping since.
    declared: BTreeSet<NodeId>,
    /// Whether the driver started (counted every member as seen once): before, the detector
    /// has no evidence of a partition.
    started: bool,
}

impl FailureDetector {
    /// A detector for `members` (this node excluded by the caller), each counted as seen at
    /// `now_ms`; a member silent for `failure_ms` is declared failed.
    pub fn new(members: impl IntoIterator<Item = NodeId>, now_ms: u64, failure_ms: u64) -> Self {
        Self {
            failure_ms,
            last_seen_ms: members.into_iter().map(|n| (n, now_ms)).collect(),
            declared: BTreeSet::new(),
            started: true,
        }
    }

    /// A detector that has seen nobody (before the driver starts): every member counts as down.
    pub fn empty(failure_ms: u64) -> Self {
        Self {
            started: false,
            ..Self::new([], 0, failure_ms)
        }
    }

    /// The driver starts: every one of `members` counts as seen at `now_ms` (each gets the
    /// failure time once before it can be declared failed).
    pub fn start(&mut self, members: impl IntoIterator<Item = NodeId>, now_ms: u64) {
        for n in members {
            self.answered(n, now_ms);
        }
        self.started = true;
    }

    /// Whether this node reaches a majority of the cluster's `members` (every voter, this node
    /// included, which counts as reached) at `now_ms`: more than half of them answered within
    /// [`MEMBER_LIVE_MS`]. True before the driver started (no evidence yet).
    pub fn majority_reachable(
        &self,
        me: NodeId,
        members: impl IntoIterator<Item = NodeId>,
        now_ms: u64,
    ) -> bool {
        if !self.started {
            return true;
        }
        let (mut reached, mut all) = (0, 0);
        for n in members {
            all += 1;
            reached += usize::from(n == me || self.is_live(n, now_ms));
        }
        reached * 2 > all
    }

    /// `node` answered a ping at `at_ms`: it is seen, and may be declared failed again later.
    pub fn answered_ping(&mut self, node: NodeId, at_ms: u64) {
        self.answered(node, at_ms);
        self.declared.remove(&node);
    }

    /// `node` answered something (replication, forwarding) at `at_ms`: a member too busy to
    /// answer a ping in time is not declared failed while it answers those.
    pub fn answered(&mut self, node: NodeId, at_ms: u64) {
        let t = self.last_seen_ms.entry(node).or_insert(at_ms);
        *t = (*t).max(at_ms);
    }

    /// How long `node` has been silent at `now_ms` (None: never seen).
    pub fn silent_ms(&self, node: NodeId, now_ms: u64) -> Option<u64> {
        self.last_seen_ms
            .get(&node)
            .map(|&t| now_ms.saturating_sub(t))
    }

    /// Whether `node` has been silent here for [`SECONDARY_UNREACHABLE_FAILURE_PERIODS`]
    /// failure times at `now_ms` (never seen counts, once the driver started).
    pub fn unreachable(&self, node: NodeId, now_ms: u64) -> bool {
        let period = SECONDARY_UNREACHABLE_FAILURE_PERIODS * self.failure_ms;
        self.started && self.silent_ms(node, now_ms).is_none_or(|t| t >= period)
    }

    /// Whether `node` answered within [`MEMBER_LIVE_MS`] of `now_ms`.
    pub fn is_live(&self, node: NodeId, now_ms: u64) -> bool {
        self.silent_ms(node, now_ms)
            .is_some_and(|t| t < MEMBER_LIVE_MS)
    }

    /// The members to declare failed at `now_ms`, in id order: none unless this node leads the
    /// metadata (`leader`); of `members`, those silent for the failure time (or never seen),
    /// not declared already, and `involved` (primary or secondary of some queue).
    pub fn to_declare(
        &self,
        members: &[NodeId],
        now_ms: u64,
        leader: bool,
        involved: impl Fn(NodeId) -> bool,
    ) -> Vec<NodeId> {
        if !leader {
            return Vec::new();
        }
        let mut out: Vec<NodeId> = members
            .iter()
            .copied()
            .filter(|&n| {
                self.silent_ms(n, now_ms)
                    .is_none_or(|t| t >= self.failure_ms)
                    && !self.declared.contains(&n)
                    && involved(n)
            })
            .collect();
        out.sort_unstable();
        out.dedup();
        out
    }

    /// The metadata accepted the declaration of `node`: not asked for again until it answers
    /// a ping.
    pub fn declared(&mut self, node: NodeId) {
        self.declared.insert(node);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const FAIL_MS: u64 = 3_000;

    #[test]
    fn a_member_gets_the_failure_time_from_the_start_before_it_is_declared() {
        let d = FailureDetector::new([2, 3].map(NodeId), 1_000, FAIL_MS);
        assert!(
            d.to_declare(&[NodeId(2), NodeId(3)], 3_999, true, |_| true)
                .is_empty()
        );
        assert_eq!(
            d.to_declare(&[NodeId(2), NodeId(3)], 4_000, true, |_| true),
            vec![NodeId(2), NodeId(3)]
        );
        assert!(d.is_live(NodeId(2), 2_499));
        assert!(!d.is_live(NodeId(2), 2_500));
    }

    #[test]
    fn only_the_leader_declares_and_only_members_holding_queues() {
        let d = FailureDetector::new([2, 3].map(NodeId), 0, FAIL_MS);
        assert!(
            d.to_declare(&[NodeId(2), NodeId(3)], 10_000, false, |_| true)
                .is_empty()
        );
        assert_eq!(
            d.to_declare(&[NodeId(2), NodeId(3)], 10_000, true, |n| n == NodeId(3)),
            vec![NodeId(3)]
        );
    }

    #[test]
    fn a_declared_member_is_declared_once_until_it_answers_a_ping() {
        let mut d = FailureDetector::new([2].map(NodeId), 0, FAIL_MS);
        assert_eq!(
            d.to_declare(&[NodeId(2)], 5_000, true, |_| true),
            vec![NodeId(2)]
        );
        // Not accepted (no leader, a write error): asked for again.
        assert_eq!(
            d.to_declare(&[NodeId(2)], 5_300, true, |_| true),
            vec![NodeId(2)]
        );
        d.declared(NodeId(2));
        assert!(d.to_declare(&[NodeId(2)], 9_000, true, |_| true).is_empty());
        // Another answer (replication) does not clear the declaration; a ping does.
        d.answered(NodeId(2), 9_100);
        assert!(
            d.to_declare(&[NodeId(2)], 20_000, true, |_| true)
                .is_empty()
        );
        d.answered_ping(NodeId(2), 20_100);
        assert!(
            d.to_declare(&[NodeId(2)], 23_099, true, |_| true)
                .is_empty()
        );
        assert_eq!(
            d.to_declare(&[NodeId(2)], 23_100, true, |_| true),
            vec![NodeId(2)]
        );
    }

    #[test]
    fn any_answer_keeps_a_member_from_being_declared_and_time_never_goes_back() {
        let mut d = FailureDetector::new([2].map(NodeId), 0, FAIL_MS);
        d.answered(NodeId(2), 2_900);
        d.answered(NodeId(2), 100); // An older answer reported late.
        assert_eq!(d.silent_ms(NodeId(2), 5_000), Some(2_100));
        assert!(d.to_declare(&[NodeId(2)], 5_899, true, |_| true).is_empty());
        assert_eq!(
            d.to_declare(&[NodeId(2)], 5_900, true, |_| true),
            vec![NodeId(2)]
        );
    }

    #[test]
    fn a_majority_is_reached_while_more_than_half_the_members_answer() {
        let mut d = FailureDetector::empty(FAIL_MS);
        // Before the driver starts: no evidence of a partition.
        assert!(d.majority_reachable(NodeId(1), [1, 2, 3].map(NodeId), 100_000));
        d.start([2, 3].map(NodeId), 1_000);
        assert!(d.majority_reachable(NodeId(1), [1, 2, 3].map(NodeId), 2_000));
        // Both peers silent for the live time: this node alone is a minority.
        assert!(!d.majority_reachable(NodeId(1), [1, 2, 3].map(NodeId), 2_500));
        d.answered(NodeId(3), 2_600);
        assert!(d.majority_reachable(NodeId(1), [1, 2, 3].map(NodeId), 2_700));
        // Two of four is not a majority; a single member always reaches itself.
        assert!(!d.majority_reachable(NodeId(1), [1, 2, 3, 4].map(NodeId), 2_700));
        assert!(d.majority_reachable(NodeId(1), [1].map(NodeId), 1_000_000));
        // Two members: the survivor of a cut reaches no majority (neither side may act).
        assert!(!d.majority_reachable(NodeId(1), [1, 2].map(NodeId), 1_000_000));
    }

    #[test]
    fn a_member_is_unreachable_after_two_failure_times_of_silence() {
        let mut d = FailureDetector::empty(FAIL_MS);
        assert!(
            !d.unreachable(NodeId(2), 1_000_000),
            "no evidence before the start"
        );
        d.start([2].map(NodeId), 1_000);
        assert!(!d.unreachable(NodeId(2), 1_000 + 2 * FAIL_MS - 1));
        assert!(d.unreachable(NodeId(2), 1_000 + 2 * FAIL_MS));
        d.answered(NodeId(2), 9_000);
        assert!(!d.unreachable(NodeId(2), 9_000 + 2 * FAIL_MS - 1));
        assert!(d.unreachable(NodeId(3), 0), "never seen");
    }

    #[test]
    fn a_member_never_seen_counts_as_down() {
        let d = FailureDetector::empty(FAIL_MS);
        assert_eq!(d.silent_ms(NodeId(7), 0), None);
        assert!(!d.is_live(NodeId(7), 0));
        assert_eq!(
            d.to_declare(&[NodeId(7)], 0, true, |_| true),
            vec![NodeId(7)]
        );
    }
}
