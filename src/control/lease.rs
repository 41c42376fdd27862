//! The primary's lease over its queue's delivery.
//!
//! A primary delivers only while every secondary of its replica set acknowledged, in its epoch,
//! a message sent less than [`LEASE_MS`] ago. A secondary that is promoted stops acknowledging
//! the old epoch at once, so the old primary, which counts it among its secondaries, loses its
//! lease at most [`LEASE_MS`] after the last message the promoted node acknowledged was sent,
//! which was before the promotion. The promoted node delivers only from [`LEASE_MS`] after its
//! promotion: at most one primary delivers at any instant, also when the old one is only cut
//! off, not dead.
//!
//! A node that starts (or restarts) as the primary of a queue it held before may have been
//! promoted in its previous life less than [`LEASE_MS`] ago, and the primary before may still
//! hold its lease: it delivers from [`LEASE_MS`] after the process started
//! ([`Lease::at_start`]), the promotion having come before the process's start. A queue placed
//! on the node in this life had no other primary ([`Lease::placed`]). Times are milliseconds of
//! the caller's monotonic clock.

use std::collections::BTreeMap;

use crate::ids::NodeId;

/// How long a secondary's ack keeps the primary's lease, in milliseconds (from when the
/// acknowledged message was sent). A promoted secondary's node waits this long before it
/// delivers.
pub const LEASE_MS: u64 = 1_500;

/// One primary's lease: from when it may deliver, and when each secondary's latest
/// acknowledged message was sent.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Lease {
    /// No delivery before this.
    deliver_after_ms: u64,
    /// Per secondary: when the latest message it acknowledged in this epoch was sent.
    acked_sent_ms: BTreeMap<NodeId, u64>,
}

impl Lease {
    /// The lease of a node promoted at `now_ms`: it waits out its predecessor's.
    pub fn promoted(now_ms: u64) -> Lease {
        Lease {
            deliver_after_ms: now_ms.saturating_add(LEASE_MS),
            acked_sent_ms: BTreeMap::new(),
        }
    }

    /// The lease of a primary starting to ship at `now_ms` in a process started at
    /// `started_ms` (not promoted in this process: placed here, or promoted before a restart).
    pub fn at_start(now_ms: u64, started_ms: u64) -> Lease {
        Lease {
            deliver_after_ms: now_ms.max(started_ms.saturating_add(LEASE_MS)),
            acked_sent_ms: BTreeMap::new(),
        }
    }

    /// The lease of a queue placed on this node at `now_ms` in this process: it had no
    /// primary before (a new queue, or one this node already shipped in this life).
    pub fn placed(now_ms: u64) -> Lease {
        Lease {
            deliver_after_ms: now_ms,
            acked_sent_ms: BTreeMap::new(),
        }
    }

    /// `peer` acknowledged, in this primary's epoch, a message sent at `sent_ms` (answers may
    /// come out of order: the latest send counts).
    pub fn acked(&mut self, peer: NodeId, sent_ms: u64) {
        let t = self.acked_sent_ms.entry(peer).or_insert(sent_ms);
        *t = (*t).max(sent_ms);
    }

    /// Whether the primary may deliver at `now_ms` with replica set `secondaries`: past its
    /// wait, and every secondary acknowledged a message sent within [`LEASE_MS`].
    pub fn held(&self, now_ms: u64, secondaries: impl IntoIterator<Item = NodeId>) -> bool {
        now_ms >= self.deliver_after_ms
            && secondaries.into_iter().all(|s| {
                self.acked_sent_ms
                    .get(&s)
                    .is_some_and(|&t| now_ms.saturating_sub(t) < LEASE_MS)
            })
    }

    /// From when the primary may deliver at the earliest.
    pub fn deliver_after_ms(&self) -> u64 {
        self.deliver_after_ms
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const A: NodeId = NodeId(1);
    const B: NodeId = NodeId(2);

    #[test]
    fn held_while_every_secondary_acked_a_recent_message() {
        let mut l = Lease::at_start(0, 0);
        assert_eq!(
            l.deliver_after_ms(),
            LEASE_MS,
            "a process's first lease waits"
        );
        l.acked(A, 1_000);
        assert!(!l.held(1_600, [A, B]), "B never acknowledged");
        l.acked(B, 1_200);
        assert!(l.held(1_600, [A, B]));
        assert!(l.held(2_499, [A, B]));
        assert!(!l.held(2_500, [A, B]), "A's ack is LEASE_MS old");
        // An older answer arriving late does not move it back.
        l.acked(A, 2_400);
        l.acked(A, 100);
        assert!(l.held(2_500, [A, B]));
        assert!(l.held(2_699, [B]), "over the replica set given");
    }

    #[test]
    fn a_promoted_primary_delivers_only_after_the_old_lease_ran_out() {
        // The old primary's last ack from the promoted node was for a message sent at or
        // before the promotion (at 10_000).
        let mut old = Lease::at_start(0, 0);
        old.acked(A, 10_000);
        old.acked(B, 10_900);
        let mut new = Lease::promoted(10_000);
        new.acked(B, 10_950);
        for now in 9_000..14_000 {
            assert!(
                !(old.held(now, [A, B]) && new.held(now, [B])),
                "both hold the lease at {now}"
            );
        }
        assert!(new.held(11_500, [B]));
    }

    #[test]
    fn a_primary_restarted_soon_after_its_promotion_waits_as_the_promoted_one_did() {
        // Promoted at 10_000, restarted at 10_400 (its monotonic clock goes on in this model),
        // shipping again at 10_500.
        let mut old = Lease::at_start(0, 0);
        old.acked(A, 10_000);
        old.acked(B, 10_000);
        let mut restarted = Lease::at_start(10_500, 10_400);
        restarted.acked(B, 10_600);
        assert!(!restarted.held(11_000, [B]));
        assert!(!old.held(11_500, [A, B]));
        assert!(restarted.held(11_900, [B]));
        // A primary long up starts shipping at once, and a queue placed here in this life
        // (no other primary had it) at once too.
        assert_eq!(Lease::at_start(50_000, 0).deliver_after_ms(), 50_000);
        assert_eq!(Lease::placed(100).deliver_after_ms(), 100);
    }
}
