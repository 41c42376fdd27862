//! Rebalancing decisions: how many queues each member hands over, and which.
//!
//! Pure functions of the metadata and of what the driver (`server/rebalance.rs`) reads off the
//! node; the same counts give the same plan on every member. See the driver's documentation
//! for the protocol of one handover.

use std::collections::BTreeMap;

use crate::cluster::meta::{NodeId, Placement};

/// Most queues one node hands over in a round.
pub const REBALANCE_MOVES_PER_ROUND: usize = 8;
/// A member hands queues over to another only while it holds over this many queues more, at
/// least.
pub const REBALANCE_SLACK_QUEUES_MIN: usize = 4;
/// ... or over this part of a member's share, in percent, when that is more.
pub const REBALANCE_SLACK_PERCENT: usize = 10;
/// A member that is primary of this many queues with a copy still syncing (snapshots under
/// way) is not handed more for the time being.
pub const REBALANCE_TARGET_SYNCING_MAX: usize = 8;

/// Per live member (`live`, this node included): how many queues it is primary of; and per
/// member, how many of its queues have a copy still syncing.
pub fn primary_counts<'a>(
    live: &[NodeId],
    placements: impl IntoIterator<Item = &'a Placement>,
) -> (BTreeMap<NodeId, usize>, BTreeMap<NodeId, usize>) {
    let mut counts: BTreeMap<NodeId, usize> = live.iter().map(|&n| (n, 0)).collect();
    let mut syncing: BTreeMap<NodeId, usize> = BTreeMap::new();
    for p in placements {
        if let Some(c) = counts.get_mut(&p.primary) {
            *c += 1;
        }
        if !p.syncing.is_empty() {
            *syncing.entry(p.primary).or_default() += 1;
        }
    }
    (counts, syncing)
}

/// [`plan`], less the takers repairing too many copies already
/// ([`REBALANCE_TARGET_SYNCING_MAX`]).
pub fn wanted(
    counts: &BTreeMap<NodeId, usize>,
    syncing: &BTreeMap<NodeId, usize>,
    me: NodeId,
) -> Vec<(NodeId, usize)> {
    plan(counts, me)
        .into_iter()
        .filter(|(t, _)| syncing.get(t).copied().unwrap_or(0) < REBALANCE_TARGET_SYNCING_MAX)
        .collect()
}

/// Whether this node's queue placed as `p` could move at all: it has copies, none syncing.
pub fn movable(p: &Placement, me: NodeId) -> bool {
    p.primary == me && p.syncing.is_empty() && !p.secondaries.is_empty()
}

/// The takers of a draining member `me` (`tether cluster drain`), from the primary counts of
/// the live members that are not draining (`counts`, which may hold `me`): every other member
/// of `counts`, the fewest primaries first (ties by id), each wanted for as many queues as
/// `me` holds. [`pick`] then gives each queue to the first of them that holds an in-sync copy of
/// it, so a drain is never held up by a member's share, and the usual plan evens the counts
/// out afterwards.
pub fn drain_takers(counts: &BTreeMap<NodeId, usize>, me: NodeId) -> Vec<(NodeId, usize)> {
    let mine = counts.get(&me).copied().unwrap_or(0);
    let mut takers: Vec<(usize, NodeId)> = counts
        .iter()
        .filter(|&(&n, _)| n != me)
        .map(|(&n, &c)| (c, n))
        .collect();
    takers.sort_unstable();
    takers.into_iter().map(|(_, n)| (n, mine)).collect()
}

/// A queue that could be handed over: its id, placement and pending bytes. Only away queues
/// not already moving are candidates (the driver reads that off the core).
#[derive(Debug, Clone)]
pub struct Candidate {
    pub id: String,
    pub placement: Placement,
    pub pending_bytes: u64,
}

/// The queues to hand over this round (at most [`REBALANCE_MOVES_PER_ROUND`]), each with its
/// taker: fewest pending bytes first (ties by id), to a wanted taker that holds an in-sync
/// copy (`in_sync(id, taker)`); `wanted` counts down as takers are given queues.
pub fn pick(
    mut candidates: Vec<Candidate>,
    wanted: &mut [(NodeId, usize)],
    in_sync: impl Fn(&str, NodeId) -> bool,
) -> Vec<(Candidate, NodeId)> {
    candidates.sort_unstable_by(|a, b| (a.pending_bytes, &a.id).cmp(&(b.pending_bytes, &b.id)));
    let mut moves = Vec::new();
    for c in candidates {
        if moves.len() >= REBALANCE_MOVES_PER_ROUND {
            break;
        }
        let taker = wanted.iter_mut().find(|(t, left)| {
            *left > 0 && c.placement.secondaries.contains(t) && in_sync(&c.id, *t)
        });
        if let Some((t, left)) = taker {
            *left -= 1;
            let t = *t;
            moves.push((c, t));
        }
    }
    moves
}

/// How many queues `me` hands over to each member this round, from the count of primaries of
/// every live member (`me` included). Every member computes the same plan from the same
/// counts. A giver holds more than its share (`total / members`, rounded up); a taker less
/// (rounded down); a giver gives a taker queues only while their counts differ by more than
/// the slack, a taker's deficit split over its givers in proportion to their excess. A queue
/// never moves from a member under its share, so none comes back.
pub fn plan(counts: &BTreeMap<NodeId, usize>, me: NodeId) -> Vec<(NodeId, usize)> {
    let n = counts.len();
    let Some(&mine) = counts.get(&me) else {
        return Vec::new();
    };
    if n < 2 {
        return Vec::new();
    }
    let total: usize = counts.values().sum();
    let (hi, lo) = (total.div_ceil(n), total / n);
    if mine <= hi {
        return Vec::new();
    }
    let slack = REBALANCE_SLACK_QUEUES_MIN.max(hi * REBALANCE_SLACK_PERCENT / 100);
    let mut out = Vec::new();
    let mut left = mine - hi;
    for (&node, &c) in counts {
        if c >= lo || mine - c <= slack || left == 0 {
            continue;
        }
        let excess_of_givers: usize = counts
            .values()
            .filter(|&&g| g > hi && g - c > slack)
            .map(|&g| g - hi)
            .sum();
        let share = ((lo - c) * (mine - hi))
            .div_ceil(excess_of_givers)
            .min(left);
        out.push((node, share));
        left -= share;
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn counts(c: &[(NodeId, usize)]) -> BTreeMap<NodeId, usize> {
        c.iter().copied().collect()
    }

    #[test]
    fn a_draining_member_offers_every_queue_to_the_least_loaded_members_first() {
        let (n1, n2, n3) = (NodeId(1), NodeId(2), NodeId(3));
        let c = counts(&[(n1, 5), (n2, 7), (n3, 2)]);
        assert_eq!(drain_takers(&c, n1), vec![(n3, 5), (n2, 5)]);
        assert!(drain_takers(&counts(&[(n1, 5)]), n1).is_empty());
        // A queue whose only in-sync copy is on the busier member still goes there.
        let candidate = |id: &str| Candidate {
            id: id.into(),
            placement: Placement {
                primary: n1,
                secondaries: vec![n2],
                epoch: 1,
                redundancy: 1,
                timeout_ms: 1_000,
                syncing: vec![],
                handed_over: false,
            },
            pending_bytes: 0,
        };
        let mut wanted = drain_takers(&counts(&[(n1, 2), (n2, 7), (n3, 2)]), n1);
        let moves = pick(vec![candidate("a"), candidate("b")], &mut wanted, |_, t| {
            t == n2
        });
        let to: Vec<(&str, NodeId)> = moves.iter().map(|(c, t)| (c.id.as_str(), *t)).collect();
        assert_eq!(to, vec![("a", n2), ("b", n2)]);
    }

    #[test]
    fn a_member_over_its_share_gives_its_excess_to_the_members_under_theirs() {
        let c = counts(&[(NodeId(1), 30), (NodeId(2), 0), (NodeId(3), 0)]);
        assert_eq!(plan(&c, NodeId(1)), vec![(NodeId(2), 10), (NodeId(3), 10)]);
        assert!(plan(&c, NodeId(2)).is_empty() && plan(&c, NodeId(3)).is_empty());
        // Two givers split the taker's deficit in proportion to their excess.
        let c = counts(&[(NodeId(1), 20), (NodeId(2), 20), (NodeId(3), 0)]);
        assert_eq!(plan(&c, NodeId(1)), vec![(NodeId(3), 6)]);
        assert_eq!(plan(&c, NodeId(2)), vec![(NodeId(3), 6)]);
        let c = counts(&[(NodeId(1), 40), (NodeId(2), 26), (NodeId(3), 0)]);
        assert_eq!(
            (plan(&c, NodeId(1)), plan(&c, NodeId(2))),
            (vec![(NodeId(3), 18)], vec![(NodeId(3), 4)])
        );
        // Applied together, nobody gives afterwards: no queue moves back.
        let after = counts(&[(NodeId(1), 22), (NodeId(2), 22), (NodeId(3), 22)]);
        for n in 1..=3 {
            assert!(
                plan(&after, NodeId(n)).is_empty(),
                "{n}: {:?}",
                plan(&after, NodeId(n))
            );
        }
    }

    #[test]
    fn counts_within_the_slack_move_nothing() {
        for c in [
            counts(&[(NodeId(1), 13), (NodeId(2), 10), (NodeId(3), 10)]),
            counts(&[(NodeId(1), 4), (NodeId(2), 0), (NodeId(3), 0)]),
            counts(&[(NodeId(1), 1090), (NodeId(2), 1000), (NodeId(3), 990)]),
            counts(&[(NodeId(1), 5)]),
            counts(&[]),
        ] {
            for n in 1..=3 {
                assert!(plan(&c, NodeId(n)).is_empty(), "{c:?} {n}");
            }
        }
        // Over the slack: 1,200 against a share of 1,000 and a slack of 100.
        let c = counts(&[(NodeId(1), 1200), (NodeId(2), 900), (NodeId(3), 900)]);
        assert_eq!(
            plan(&c, NodeId(1)),
            vec![(NodeId(2), 100), (NodeId(3), 100)]
        );
        // Only the taker far enough below gets queues.
        let c = counts(&[(NodeId(1), 1150), (NodeId(2), 1000), (NodeId(3), 850)]);
        assert_eq!(plan(&c, NodeId(1)), vec![(NodeId(3), 150)]);
    }

    #[test]
    fn repeated_rounds_converge_without_moving_back() {
        // Every member applies its plan each round, moving at most a round's worth.
        let mut c = counts(&[
            (NodeId(1), 300),
            (NodeId(2), 290),
            (NodeId(3), 0),
            (NodeId(4), 10),
        ]);
        let mut gave_then_took = false;
        let mut gave = std::collections::BTreeSet::new();
        for _ in 0..100 {
            let plans: Vec<(NodeId, Vec<(NodeId, usize)>)> =
                c.keys().map(|&n| (n, plan(&c, n))).collect();
            for (from, moves) in plans {
                let mut budget = REBALANCE_MOVES_PER_ROUND;
                for (to, k) in moves {
                    let k = k.min(budget);
                    budget -= k;
                    *c.get_mut(&from).unwrap() -= k;
                    *c.get_mut(&to).unwrap() += k;
                    gave.insert(from);
                    gave_then_took |= k > 0 && gave.contains(&to);
                }
            }
        }
        assert!(!gave_then_took);
        assert_eq!(c.values().sum::<usize>(), 600);
        let (min, max) = (*c.values().min().unwrap(), *c.values().max().unwrap());
        // Share 150, slack 15.
        assert!(max - min <= 15 + 1, "{c:?}");
        for n in 1..=4 {
            assert!(plan(&c, NodeId(n)).is_empty(), "{c:?}");
        }
    }

    fn placement(primary: NodeId, secondaries: &[NodeId], syncing: &[NodeId]) -> Placement {
        Placement {
            primary,
            secondaries: secondaries.to_vec(),
            epoch: 10,
            redundancy: secondaries.len() as u8,
            timeout_ms: 60_000,
            syncing: syncing.to_vec(),
            handed_over: false,
        }
    }

    #[test]
    fn counts_cover_live_members_only_and_syncing_takers_get_nothing() {
        let ps: Vec<Placement> = (0..REBALANCE_TARGET_SYNCING_MAX)
            .map(|_| placement(NodeId(3), &[NodeId(1)], &[NodeId(1)]))
            .chain((0..30).map(|_| placement(NodeId(1), &[NodeId(2)], &[])))
            .chain([placement(NodeId(9), &[NodeId(1)], &[])])
            .collect();
        let (counts, syncing) = primary_counts(&[NodeId(1), NodeId(2), NodeId(3)], &ps);
        assert_eq!(
            counts,
            super::tests::counts(&[(NodeId(1), 30), (NodeId(2), 0), (NodeId(3), 8)])
        );
        assert_eq!(syncing.get(&NodeId(3)), Some(&REBALANCE_TARGET_SYNCING_MAX));
        // Node 3 is under its share but repairing too many copies: only node 2 is given queues.
        assert_eq!(
            plan(&counts, NodeId(1)),
            vec![(NodeId(2), 12), (NodeId(3), 4)]
        );
        assert_eq!(wanted(&counts, &syncing, NodeId(1)), vec![(NodeId(2), 12)]);
        assert!(movable(&ps[10], NodeId(1)) && !movable(&ps[10], NodeId(2)));
        assert!(
            !movable(&ps[0], NodeId(3)),
            "a queue with a syncing copy stays"
        );
        assert!(
            !movable(&placement(NodeId(1), &[], &[]), NodeId(1)),
            "a queue without copies stays"
        );
    }

    #[test]
    fn the_smallest_queues_go_first_to_takers_holding_an_in_sync_copy() {
        let c = |id: &str, bytes, secondaries: &[NodeId]| Candidate {
            id: id.to_string(),
            placement: placement(NodeId(1), secondaries, &[]),
            pending_bytes: bytes,
        };
        let candidates = vec![
            c("big", 900, &[NodeId(2)]),
            c("b", 5, &[NodeId(2), NodeId(3)]),
            c("a", 5, &[NodeId(3)]),
            c("no-copy-on-taker", 1, &[NodeId(4)]),
            c("lagging", 2, &[NodeId(2)]),
        ];
        let mut wanted = vec![(NodeId(2), 1), (NodeId(3), 5)];
        let moves = pick(candidates, &mut wanted, |id, _| id != "lagging");
        let got: Vec<(&str, NodeId)> = moves.iter().map(|(c, t)| (c.id.as_str(), *t)).collect();
        // "a" before "b" (same size, by id); "b" goes to 2 (first wanted holding a copy), and
        // "big" then finds 2 used up and no copy on 3.
        assert_eq!(got, vec![("a", NodeId(3)), ("b", NodeId(2))]);
        assert_eq!(wanted, vec![(NodeId(2), 0), (NodeId(3), 4)]);
        // At most a round's worth.
        let many: Vec<Candidate> = (0..20)
            .map(|i| c(&format!("q{i:02}"), i, &[NodeId(2)]))
            .collect();
        let moves = pick(many, &mut [(NodeId(2), 100)], |_, _| true);
        assert_eq!(moves.len(), REBALANCE_MOVES_PER_ROUND);
        assert_eq!(moves[0].0.id, "q00");
    }
}
