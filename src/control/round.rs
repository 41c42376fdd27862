//! One round of a node's reconciler and rebalancer, composed from the per-queue steps of
//! [`reconcile`] and [`rebalance`]: the metadata write a primary's repair asks for, and the
//! takers a rebalancing round offers its queues to.
//!
//! The server (`server/failover.rs`, `server/rebalance.rs`) executes what these return, and
//! the whole-cluster simulation (`tests/cluster_sim.rs`) executes the same decisions over its
//! simulated network and metadata service: the composition is tested there, not a copy of it.

use std::collections::BTreeSet;

use super::rebalance;
use super::reconcile::{self, CopiesSeen, RepairStep, Spread, SpreadRound};
use crate::cluster::meta::{MetaCommand, MetaState, NodeId, Placement};

/// What a node sees of the members in one round, shared by all its repairs.
pub struct MembersSeen<'a> {
    /// This node.
    pub me: NodeId,
    /// Every member, with its name (its rendezvous key).
    pub named: &'a [(NodeId, &'a str)],
    /// The members draining (`MetaState::draining`).
    pub draining: &'a BTreeSet<NodeId>,
    /// Whether a member answers.
    pub live: &'a dyn Fn(NodeId) -> bool,
    /// Whether this node has not reached a member for a while.
    pub unreachable: &'a dyn Fn(NodeId) -> bool,
    /// Whether this node reaches a majority of the members.
    pub majority_reachable: bool,
}

/// What a primary's shipping reports of one queue's copies.
pub struct ShippedSeen<'a> {
    /// Secondaries that lost entries they had acknowledged.
    pub regressed: &'a [NodeId],
    /// Whether a secondary holds everything shipped to it.
    pub in_sync: &'a dyn Fn(NodeId) -> bool,
}

/// Why a repair writes the metadata.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RepairKind {
    /// Secondaries lost entries they had acknowledged: taken out.
    Regressed,
    /// Secondaries this node has not reached for a while: taken out.
    Unreachable,
    /// Secondaries on draining members: taken out.
    Draining,
    /// Copies beyond the redundancy, after a spread or an undrain: taken out.
    Surplus,
    /// A syncing copy caught up: reported.
    Synced,
    /// Copies added to restore the redundancy (or to give a draining primary a taker).
    Added,
    /// A copy added on a member holding far fewer (spreading).
    Spread,
}

/// One metadata write of a repair: a compare-and-set on the placement's epoch.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RepairWrite {
    /// Why.
    pub kind: RepairKind,
    /// The members concerned: taken out, added, or reported in sync.
    pub nodes: Vec<NodeId>,
    /// The command to commit.
    pub cmd: MetaCommand,
}

/// The repair of queue `id`, placed as `p` with this node primary
/// ([`reconcile::repair_step`]), as the metadata write that carries it out; None when nothing
/// is to be changed. Copies to add are chosen here ([`reconcile::choose_secondaries`]); a
/// spread takes one move of the round's budget (`round`), and is skipped when none is left.
pub fn repair(
    id: &str,
    p: &Placement,
    members: &MembersSeen<'_>,
    shipped: &ShippedSeen<'_>,
    round: &SpreadRound,
) -> Option<RepairWrite> {
    let me = members.me;
    let ranked = match round.worth(p) {
        true => round.ranked(id, me),
        false => Vec::new(),
    };
    let seen = CopiesSeen {
        regressed: shipped.regressed,
        in_sync: shipped.in_sync,
        unreachable: members.unreachable,
        majority_reachable: members.majority_reachable,
        draining: &|n| members.draining.contains(&n),
        spread: (!ranked.is_empty()).then_some(Spread {
            ranked: &ranked,
            copies: round.copies(),
            live: members.live,
            may_add: round.may_add(),
        }),
    };
    let set = |kind, nodes, secondaries| {
        let cmd = MetaCommand::SetSecondaries {
            id: id.to_string(),
            expected_epoch: p.epoch,
            secondaries,
        };
        Some(RepairWrite { kind, nodes, cmd })
    };
    let added = |kind, add: Vec<NodeId>| {
        let mut secondaries = p.secondaries.clone();
        secondaries.extend(&add);
        set(kind, add, secondaries)
    };
    match reconcile::repair_step(p, me, &seen) {
        RepairStep::TakeOut { lost, secondaries } => set(RepairKind::Regressed, lost, secondaries),
        RepairStep::TakeOutUnreachable {
            unreachable,
            secondaries,
        } => set(RepairKind::Unreachable, unreachable, secondaries),
        RepairStep::TakeOutDraining {
            draining,
            secondaries,
        } => set(RepairKind::Draining, draining, secondaries),
        RepairStep::TakeOutSurplus {
            surplus,
            secondaries,
        } => set(RepairKind::Surplus, surplus, secondaries),
        RepairStep::Synced(node) => Some(RepairWrite {
            kind: RepairKind::Synced,
            nodes: vec![node],
            cmd: MetaCommand::Synced {
                id: id.to_string(),
                expected_epoch: p.epoch,
                node,
            },
        }),
        RepairStep::Add { want, exclude } => {
            let add = reconcile::choose_secondaries(
                members.named.iter().copied(),
                id,
                want,
                &exclude,
                members.draining,
                members.live,
            );
            (!add.is_empty()).then(|| added(RepairKind::Added, add))?
        }
        RepairStep::SpreadTo { to } => round
            .take_move()
            .then(|| added(RepairKind::Spread, vec![to]))?,
        RepairStep::Nothing => None,
    }
}

/// The takers of one rebalancing round of `me`, each with how many queues it may take
/// (counting down in [`rebalance::pick`]); empty when `me` hands nothing over this round. The
/// round runs while `me` drains ([`rebalance::drain_takers`]: every other live member that is
/// not draining), or with rebalancing on (`rebalance`: [`rebalance::wanted`], the members
/// under their share). `members` are the cluster's members; `live` whether one answers.
pub fn takers(
    me: NodeId,
    members: impl IntoIterator<Item = NodeId>,
    live: &dyn Fn(NodeId) -> bool,
    state: &MetaState,
    rebalance: bool,
) -> Vec<(NodeId, usize)> {
    let me_draining = state.draining.contains(&me);
    if !rebalance && !me_draining {
        return Vec::new();
    }
    let live: Vec<NodeId> = members
        .into_iter()
        .filter(|&n| n == me || (live(n) && !state.draining.contains(&n)))
        .collect();
    let (counts, syncing) = rebalance::primary_counts(&live, state.queues.values());
    match me_draining {
        true => rebalance::drain_takers(&counts, me),
        false => rebalance::wanted(&counts, &syncing, me),
    }
}

/// This node's queues that a rebalancing round could hand over ([`rebalance::movable`]).
pub fn movable(state: &MetaState, me: NodeId) -> Vec<(String, Placement)> {
    state
        .queues
        .iter()
        .filter(|(_, p)| rebalance::movable(p, me))
        .map(|(id, p)| (id.clone(), p.clone()))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn placement(secondaries: &[u64], syncing: &[u64], redundancy: u8) -> Placement {
        Placement {
            primary: NodeId(1),
            secondaries: secondaries.iter().map(|&n| NodeId(n)).collect(),
            syncing: syncing.iter().map(|&n| NodeId(n)).collect(),
            epoch: 7,
            redundancy,
            timeout_ms: 60_000,
            handed_over: false,
        }
    }

    /// The repair write of node 1 for `p`, over members 1 to 4 and the metadata `state`.
    fn write(
        p: &Placement,
        state: &MetaState,
        in_sync: &dyn Fn(NodeId) -> bool,
        live: &dyn Fn(NodeId) -> bool,
    ) -> (Option<RepairWrite>, bool) {
        let names: Vec<(NodeId, String)> = (1..=4).map(|n| (NodeId(n), format!("n{n}"))).collect();
        let named: Vec<(NodeId, &str)> = names.iter().map(|(n, s)| (*n, s.as_str())).collect();
        let members = MembersSeen {
            me: NodeId(1),
            named: &named,
            draining: &state.draining,
            live,
            unreachable: &|_| false,
            majority_reachable: true,
        };
        let shipped = ShippedSeen {
            regressed: &[],
            in_sync,
        };
        let round = SpreadRound::read(state, named.iter().copied(), NodeId(1));
        let w = repair("q", p, &members, &shipped, &round);
        (w, round.may_add())
    }

    fn set(secondaries: &[u64]) -> MetaCommand {
        MetaCommand::SetSecondaries {
            id: "q".into(),
            expected_epoch: 7,
            secondaries: secondaries.iter().map(|&n| NodeId(n)).collect(),
        }
    }

    #[test]
    fn a_missing_copy_is_added_on_the_one_live_member_not_draining() {
        let p = placement(&[2], &[], 2);
        let state = MetaState {
            draining: BTreeSet::from([NodeId(3)]),
            ..MetaState::default()
        };
        let (w, _) = write(&p, &state, &|_| true, &|n| n != NodeId(4));
        assert_eq!(w, None, "no member to add: no write");
        let (w, _) = write(&p, &state, &|_| true, &|_| true);
        let w = w.expect("a repair");
        assert_eq!((w.kind, w.nodes), (RepairKind::Added, vec![NodeId(4)]));
        assert_eq!(w.cmd, set(&[2, 4]));
    }

    #[test]
    fn a_caught_up_copy_is_reported_and_a_lagging_one_waits() {
        let p = placement(&[2, 3], &[3], 2);
        let state = MetaState::default();
        let (w, _) = write(&p, &state, &|n| n == NodeId(2), &|_| true);
        assert_eq!(w, None);
        let (w, _) = write(&p, &state, &|_| true, &|_| true);
        let w = w.expect("a report");
        assert_eq!((w.kind, w.nodes), (RepairKind::Synced, vec![NodeId(3)]));
        let synced = MetaCommand::Synced {
            id: "q".into(),
            expected_epoch: 7,
            node: NodeId(3),
        };
        assert_eq!(w.cmd, synced);
    }

    #[test]
    fn a_spread_takes_the_rounds_budget_and_a_surplus_goes_once_in_sync() {
        // Node 2 holds many copies, nodes 3 and 4 none: `q`'s copy moves up its order.
        let mut state = MetaState::default();
        for i in 0..6 {
            state
                .queues
                .insert(format!("other{i}"), placement(&[2], &[], 1));
        }
        let p = placement(&[2], &[], 1);
        state.queues.insert("q".into(), p.clone());
        let (w, budget_left) = write(&p, &state, &|_| true, &|_| true);
        let w = w.expect("a spread");
        assert_eq!(w.kind, RepairKind::Spread);
        assert!(!budget_left, "the move took the round's budget");
        let [to] = w.nodes[..] else {
            panic!("one copy added: {w:?}")
        };
        assert!(to == NodeId(3) || to == NodeId(4));
        assert_eq!(w.cmd, set(&[2, to.0]));
        // Then, the new copy in sync: the surplus goes (whichever ranks lower of the two).
        let spread = placement(&[2, to.0], &[], 1);
        let (w, _) = write(&spread, &state, &|_| true, &|_| true);
        let w = w.expect("the surplus taken out");
        assert_eq!(w.kind, RepairKind::Surplus);
        assert_eq!(w.nodes.len(), 1);
        // Not while the kept copy is syncing.
        let (w, _) = write(&spread, &state, &|n| n == w.nodes[0], &|_| true);
        assert_eq!(w, None);
    }

    #[test]
    fn takers_are_offered_only_while_draining_or_rebalancing() {
        let mut state = MetaState::default();
        for i in 0..12 {
            state
                .queues
                .insert(format!("q{i}"), placement(&[2], &[], 1));
        }
        let members = [NodeId(1), NodeId(2), NodeId(3)];
        let live = |n: NodeId| n != NodeId(3);
        assert_eq!(takers(NodeId(1), members, &live, &state, false), vec![]);
        // Rebalancing: node 2, live and holding none, is under its share.
        let t = takers(NodeId(1), members, &live, &state, true);
        assert_eq!(t.iter().map(|t| t.0).collect::<Vec<_>>(), vec![NodeId(2)]);
        // Draining: every live member not draining takes up to all of this node's queues.
        state.draining.insert(NodeId(1));
        let t = takers(NodeId(1), members, &|_| true, &state, false);
        assert_eq!(t, vec![(NodeId(2), 12), (NodeId(3), 12)]);
        state.draining.insert(NodeId(3));
        let t = takers(NodeId(1), members, &|_| true, &state, false);
        assert_eq!(t, vec![(NodeId(2), 12)]);
        assert_eq!(movable(&state, NodeId(1)).len(), 12);
        assert_eq!(movable(&state, NodeId(2)).len(), 0);
    }
}
