//! Rebalancing: spreading durable queues' primaries over the live members again.
//!
//! A queue is placed on the node its client first reaches and moves only when that node fails,
//! so after failovers the survivors hold the primaries (and, as clients come back, their
//! connections) while a returning member holds copies only. Each node that holds more than its
//! share hands queues over to the members below theirs, one planned move at a time:
//!
//! 1. it picks an away queue (no client attached: moving it interrupts nobody) that has an
//!    in-sync copy on the taker, the queue with the fewest pending bytes first;
//! 2. marks it moving in the core ([`NodeCore::begin_handover`](crate::core::NodeCore::begin_handover)):
//!    no client attaches meanwhile (a hello is told `unavailable`, retry), and waits until
//!    every copy confirms the queue's current state, its client's last acks included
//!    ([`HANDOVER_COPY_WAIT_MS`]; else the queue stays);
//! 3. commits [`MetaCommand::Handover`] (compare-and-set on the epoch it read);
//! 4. drops its queue at once (deposed, as after a failover); the taker promotes its copy the
//!    way a failover does (appending the kept publishes its copy lacked), and restores the
//!    queue's redundancy (a new copy, from a snapshot). The queue's next client is redirected.
//!
//! As after a failover, every entry the taker holds then counts as possibly delivered
//! (`possible_duplicate` when replayed): the copy holds the giver's entries at the same
//! offsets, but a forwarded event appended since may repeat one its client acknowledged, which
//! the copy may not know it held (soak run U, when the taker used the giver's delivered offset
//! instead: one event of 2.9 million came again unflagged).
//!
//! How many queues go where is [`plan`], a pure function of the per-member primary counts in the
//! metadata, the same on every node: a member over its share hands queues to a member under
//! theirs only while their counts differ by more than a slack ([`REBALANCE_SLACK_QUEUES_MIN`],
//! [`REBALANCE_SLACK_PERCENT`]), and only down to its share, so moves stop once the counts are
//! close and no queue moves back and forth. A taker repairing many copies already
//! ([`REBALANCE_TARGET_SYNCING_MAX`]) gets none for the time being, which bounds the snapshots
//! a rebalance puts on it.
//!
//! A queue whose client stays connected, or without copies (redundancy 0), is not moved.

use std::collections::BTreeMap;
use std::sync::{Arc, Weak};
use std::time::Duration;

use super::Shared;
use crate::cluster::Cluster;
use crate::cluster::meta::{MetaCommand, MetaResponse, Placement, RaftId};
use crate::core::QueueState;
use crate::metrics as m;

/// Interval between rebalancing rounds, in milliseconds.
pub const REBALANCE_INTERVAL_MS: u64 = 1_000;
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
/// Longest wait of a handover for the copies to confirm the queue's current state (acked
/// offset, interest, away time), in milliseconds; the queue stays where it is if they do not.
pub const HANDOVER_COPY_WAIT_MS: u64 = 5_000;
/// Pause between attempts to learn the outcome of a handover whose commit did not answer, in
/// milliseconds.
pub const HANDOVER_DECIDE_RETRY_MS: u64 = 1_000;

/// How many queues `me` hands over to each member this round, from the count of primaries of
/// every live member (`me` included). Every member computes the same plan from the same
/// counts. A giver holds more than its share (`total / members`, rounded up); a taker less
/// (rounded down); a giver gives a taker queues only while their counts differ by more than
/// the slack, a taker's deficit split over its givers in proportion to their excess. A queue
/// never moves from a member under its share, so none comes back.
pub(crate) fn plan(counts: &BTreeMap<RaftId, usize>, me: RaftId) -> Vec<(RaftId, usize)> {
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

/// Rebalances every [`REBALANCE_INTERVAL_MS`] (clustered nodes with `[cluster] rebalance`),
/// until the node stops.
pub(crate) async fn rebalance_loop(weak: Weak<Shared>, cluster: Arc<Cluster>) {
    let mut interval = tokio::time::interval(Duration::from_millis(REBALANCE_INTERVAL_MS));
    interval.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        interval.tick().await;
        let Some(shared) = weak.upgrade() else {
            return;
        };
        if !*shared.meta_caught_up.borrow() {
            continue;
        }
        round(&shared, &cluster).await;
    }
}

/// One round: plans from the metadata, picks the queues, hands them over (all at once).
async fn round(shared: &Arc<Shared>, cluster: &Arc<Cluster>) {
    let me = cluster.id();
    let live: Vec<RaftId> = cluster
        .members()
        .nodes
        .keys()
        .copied()
        .filter(|&n| n == me || shared.liveness.is_live(n))
        .collect();
    let (counts, syncing) = cluster.read(|s| {
        let mut counts: BTreeMap<RaftId, usize> = live.iter().map(|&n| (n, 0)).collect();
        let mut syncing: BTreeMap<RaftId, usize> = BTreeMap::new();
        for p in s.queues.values() {
            if let Some(c) = counts.get_mut(&p.primary) {
                *c += 1;
            }
            if !p.syncing.is_empty() {
                *syncing.entry(p.primary).or_default() += 1;
            }
        }
        (counts, syncing)
    });
    let mut wanted: Vec<(RaftId, usize)> = plan(&counts, me)
        .into_iter()
        .filter(|(t, _)| syncing.get(t).copied().unwrap_or(0) < REBALANCE_TARGET_SYNCING_MAX)
        .collect();
    if wanted.is_empty() {
        return;
    }
    // Only now (most rounds plan nothing) this node's placements that could move.
    let mine: Vec<(String, Placement)> = cluster.read(|s| {
        s.queues
            .iter()
            .filter(|(_, p)| p.primary == me && p.syncing.is_empty() && !p.secondaries.is_empty())
            .map(|(id, p)| (id.clone(), p.clone()))
            .collect()
    });
    let mut moves = tokio::task::JoinSet::new();
    for (id, p, target) in pick(shared, &mine, &mut wanted) {
        let (shared, cluster) = (shared.clone(), cluster.clone());
        moves.spawn(async move { hand_over(&shared, &cluster, &id, &p, target).await });
    }
    while moves.join_next().await.is_some() {}
}

/// The queues to hand over this round (at most [`REBALANCE_MOVES_PER_ROUND`]): away, not
/// moving, with an in-sync copy on a wanted taker, fewest pending bytes first.
fn pick(
    shared: &Shared,
    mine: &[(String, Placement)],
    wanted: &mut [(RaftId, usize)],
) -> Vec<(String, Placement, RaftId)> {
    let mut candidates: Vec<(u64, &String, &Placement)> = {
        let core = shared.core();
        mine.iter()
            .filter_map(|(id, p)| {
                let q = core.durable_queue(id)?;
                // (Its epoch is the one it became primary at here: a later change of its
                // secondaries raised the placement's, not the queue's.)
                let away = matches!(q.state, QueueState::Away { .. }) && !q.moving;
                away.then(|| (q.pending_bytes(), id, p))
            })
            .collect()
    };
    candidates.sort_unstable_by_key(|&(bytes, id, _)| (bytes, id.clone()));
    let mut moves = Vec::new();
    for (_, id, p) in candidates {
        if moves.len() >= REBALANCE_MOVES_PER_ROUND {
            break;
        }
        let Some(ship) = shared.shipping.get(id) else {
            continue;
        };
        let taker = wanted
            .iter_mut()
            .find(|(t, left)| *left > 0 && p.secondaries.contains(t) && ship.in_sync(*t));
        if let Some((t, left)) = taker {
            *left -= 1;
            moves.push((id.clone(), p.clone(), *t));
        }
    }
    moves
}

/// Hands `id` (placed as `p`, primary here) over to `target`; see the module documentation.
async fn hand_over(
    shared: &Arc<Shared>,
    cluster: &Arc<Cluster>,
    id: &str,
    p: &Placement,
    target: RaftId,
) {
    let qid = {
        let mut core = shared.core();
        if !core.begin_handover(id) {
            return; // A client attached since the pick.
        }
        core.durable_queue(id).map(|q| q.id)
    };
    // The copy must hold the queue's state as it is now, its client's last acks above all
    // (they travel with every replication message): else the taker would send again what the
    // client acknowledged here.
    let copied = match qid.and_then(|q| shared.shipping.info_changed(q)) {
        Some((sq, version)) => {
            let deadline =
                tokio::time::Instant::now() + Duration::from_millis(HANDOVER_COPY_WAIT_MS);
            super::shipping::Shipping::wait_info(sq, version, deadline).await
        }
        None => false,
    };
    if !copied {
        tracing::debug!(durable_id = %id, "handover skipped: the copy did not confirm the queue's state in time");
        shared.core().end_handover(id);
        return;
    }
    let cmd = MetaCommand::Handover {
        id: id.to_string(),
        expected_epoch: p.epoch,
        new_primary: target,
    };
    match cluster.write(cmd).await {
        Ok(MetaResponse::Placed(moved)) if moved.primary == target => {
            metrics::counter!(m::REBALANCE_MOVES).increment(1);
            tracing::info!(durable_id = %id, to = target, epoch = moved.epoch, "handed the queue over");
            super::failover::depose(shared, id, &moved).await;
        }
        Ok(other) => {
            // Changed meanwhile (expired, failed over, closed): nothing moved.
            tracing::debug!(durable_id = %id, result = ?other, "handover not applied");
            shared.core().end_handover(id);
        }
        Err(e) => {
            // The command may still commit: clients stay out until the metadata tells.
            tracing::warn!(durable_id = %id, error = %e, "handover unanswered; waiting for the metadata");
            let (weak, cluster, id, epoch) = (
                Arc::downgrade(shared),
                cluster.clone(),
                id.to_string(),
                p.epoch,
            );
            tokio::spawn(async move { decide(weak, cluster, id, epoch).await });
        }
    }
}

/// Learns the outcome of a handover of `id` from epoch `epoch` whose commit did not answer:
/// once a read barrier commits (and is applied here), the metadata holds the handover if it
/// ever commits. Until then the queue stays closed to clients.
async fn decide(weak: Weak<Shared>, cluster: Arc<Cluster>, id: String, epoch: u64) {
    loop {
        if cluster.barrier().await.is_ok() {
            let Some(shared) = weak.upgrade() else {
                return;
            };
            match cluster.placement(&id) {
                Some(p) if p.primary != cluster.id() => {
                    if p.epoch > epoch {
                        super::failover::depose(&shared, &id, &p).await;
                    }
                }
                // Still here (the handover did not commit), or gone (the reconciler drops it).
                _ => shared.core().end_handover(&id),
            }
            return;
        }
        if weak.strong_count() == 0 {
            return;
        }
        tokio::time::sleep(Duration::from_millis(HANDOVER_DECIDE_RETRY_MS)).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn counts(c: &[(RaftId, usize)]) -> BTreeMap<RaftId, usize> {
        c.iter().copied().collect()
    }

    #[test]
    fn a_member_over_its_share_gives_its_excess_to_the_members_under_theirs() {
        let c = counts(&[(1, 30), (2, 0), (3, 0)]);
        assert_eq!(plan(&c, 1), vec![(2, 10), (3, 10)]);
        assert!(plan(&c, 2).is_empty() && plan(&c, 3).is_empty());
        // Two givers split the taker's deficit in proportion to their excess.
        let c = counts(&[(1, 20), (2, 20), (3, 0)]);
        assert_eq!(plan(&c, 1), vec![(3, 6)]);
        assert_eq!(plan(&c, 2), vec![(3, 6)]);
        let c = counts(&[(1, 40), (2, 26), (3, 0)]);
        assert_eq!((plan(&c, 1), plan(&c, 2)), (vec![(3, 18)], vec![(3, 4)]));
        // Applied together, nobody gives afterwards: no queue moves back.
        let after = counts(&[(1, 22), (2, 22), (3, 22)]);
        for n in 1..=3 {
            assert!(plan(&after, n).is_empty(), "{n}: {:?}", plan(&after, n));
        }
    }

    #[test]
    fn counts_within_the_slack_move_nothing() {
        for c in [
            counts(&[(1, 13), (2, 10), (3, 10)]),
            counts(&[(1, 4), (2, 0), (3, 0)]),
            counts(&[(1, 1090), (2, 1000), (3, 990)]),
            counts(&[(1, 5)]),
            counts(&[]),
        ] {
            for n in 1..=3 {
                assert!(plan(&c, n).is_empty(), "{c:?} {n}");
            }
        }
        // Over the slack: 1,200 against a share of 1,000 and a slack of 100.
        let c = counts(&[(1, 1200), (2, 900), (3, 900)]);
        assert_eq!(plan(&c, 1), vec![(2, 100), (3, 100)]);
        // Only the taker far enough below gets queues.
        let c = counts(&[(1, 1150), (2, 1000), (3, 850)]);
        assert_eq!(plan(&c, 1), vec![(3, 150)]);
    }

    #[test]
    fn repeated_rounds_converge_without_moving_back() {
        // Every member applies its plan each round, moving at most a round's worth.
        let mut c = counts(&[(1, 300), (2, 290), (3, 0), (4, 10)]);
        let mut gave_then_took = false;
        let mut gave = std::collections::BTreeSet::new();
        for _ in 0..100 {
            let plans: Vec<(RaftId, Vec<(RaftId, usize)>)> =
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
            assert!(plan(&c, n).is_empty(), "{c:?}");
        }
    }
}
