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
//! How many queues go where, and which, is decided in [`control::rebalance`](rebalance), pure
//! functions of the per-member primary counts in the metadata, the same on every node: a
//! member over its share hands queues to a member under theirs only while their counts differ
//! by more than a slack, and only down to its share, so moves stop once the counts are close
//! and no queue moves back and forth. A taker repairing many copies already gets none for the
//! time being, which bounds the snapshots a rebalance puts on it.
//!
//! A queue whose client stays connected, or without copies (redundancy 0), is not moved.
//! A handover whose metadata write is unanswered keeps the queue closed to clients (the core's
//! `Queue::moving`) until a read barrier (`Cluster::barrier`, applied locally) settles whether
//! it committed. `control::rebalance::plan` never moves a queue from a member under its share.

use std::sync::{Arc, Weak};
use std::time::Duration;

use super::Shared;
use crate::cluster::Cluster;
use crate::cluster::meta::{MetaCommand, MetaResponse, NodeId, Placement};
use crate::control::rebalance::{self, Candidate};
use crate::control::round;
use crate::core::QueueState;
use crate::metrics as m;
use crate::protocol::ErrorCode;

/// Interval between rebalancing rounds, in milliseconds.
pub const REBALANCE_INTERVAL_MS: u64 = 1_000;
/// Longest wait of a handover for the copies to confirm the queue's current state (acked
/// offset, interest, away time), in milliseconds; the queue stays where it is if they do not.
pub const HANDOVER_COPY_WAIT_MS: u64 = 5_000;
/// Pause between attempts to learn the outcome of a handover whose commit did not answer, in
/// milliseconds.
pub const HANDOVER_DECIDE_RETRY_MS: u64 = 1_000;

/// Rebalances every [`REBALANCE_INTERVAL_MS`] (with `[cluster] rebalance`, else only while this
/// node drains), until the node stops.
pub(crate) async fn rebalance_loop(weak: Weak<Shared>, cluster: Arc<Cluster>, rebalance: bool) {
    let mut interval = tokio::time::interval(Duration::from_millis(REBALANCE_INTERVAL_MS));
    interval.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        interval.tick().await;
        let Some(shared) = weak.upgrade() else {
            return;
        };
        if !*shared.member.meta_caught_up.borrow() {
            continue;
        }
        round(&shared, &cluster, rebalance).await;
    }
}

/// One round: plans from the metadata ([`control::rebalance`]), reads which of this node's
/// queues are away, hands the picked ones over (all at once). A draining node offers every
/// queue to every other member ([`rebalance::drain_takers`]), first sending the clients of
/// those it could hand over away ([`DRAINING_REASON`]); draining members take no queue.
async fn round(shared: &Arc<Shared>, cluster: &Arc<Cluster>, rebalance: bool) {
    let me = cluster.id();
    let members = cluster.members();
    let live = |n| shared.member.liveness.is_live(n);
    let (mut wanted, draining) = cluster.read(|s| {
        let takers = round::takers(me, members.nodes.keys().copied(), &live, s, rebalance);
        (takers, s.draining.clone())
    });
    if wanted.is_empty() {
        return;
    }
    let me_draining = draining.contains(&me);
    // Only now (most rounds plan nothing) this node's placements that could move.
    let mine = cluster.read(|s| round::movable(s, me));
    let in_sync = |id: &str, taker| {
        shared
            .member
            .shipping
            .get(id)
            .is_some_and(|s| s.in_sync(taker))
    };
    let mut attached = Vec::new();
    let mut candidates: Vec<Candidate> = {
        let core = shared.core();
        mine.into_iter()
            .filter_map(|(id, placement)| {
                let q = core.durable_queue(&id)?;
                if me_draining && !matches!(q.state, QueueState::Away { .. }) && !q.moving {
                    // Attached: its client is sent away below if a taker holds its copy.
                    attached.push((id, placement, core.attached_session(q.id)));
                    return None;
                }
                away_candidate(&core, id, placement)
            })
            .collect()
    };
    // A draining node's clients go first; their queues move in this round once their
    // sessions have ended (a hello meanwhile is refused: `placement::draining_refusal`).
    let mut sent_away = Vec::new();
    for (id, p, session) in attached {
        if let (true, Some(session)) = (can_leave(shared, &draining, &id, &p), session) {
            tracing::info!(durable_id = %id, "draining: the queue's client is sent away");
            shared.disconnect_session(session, ErrorCode::Unavailable, DRAINING_REASON);
            sent_away.push((id, p));
        }
    }
    if !sent_away.is_empty() {
        let deadline =
            tokio::time::Instant::now() + Duration::from_millis(DRAIN_SESSION_END_WAIT_MS);
        let away = |shared: &Shared, id: &str| {
            let core = shared.core();
            core.durable_queue(id)
                .is_none_or(|q| matches!(q.state, QueueState::Away { .. }))
        };
        while tokio::time::Instant::now() < deadline
            && !sent_away.iter().all(|(id, _)| away(shared, id))
        {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let core = shared.core();
        candidates.extend(
            sent_away
                .into_iter()
                .filter_map(|(id, p)| away_candidate(&core, id, p)),
        );
    }
    let mut moves = tokio::task::JoinSet::new();
    for (c, target) in rebalance::pick(candidates, &mut wanted, in_sync) {
        let (shared, cluster) = (shared.clone(), cluster.clone());
        moves.spawn(async move { hand_over(&shared, &cluster, &c.id, &c.placement, target).await });
    }
    while moves.join_next().await.is_some() {}
}

/// Whether a draining node's queue `id`, placed as `p`, has a taker: a live member that is
/// not draining and holds an in-sync copy (the takers of [`rebalance::drain_takers`]). Its
/// client is then sent away, and its hellos refused, until the queue has moved.
pub(crate) fn can_leave(
    shared: &Shared,
    draining: &std::collections::BTreeSet<NodeId>,
    id: &str,
    p: &Placement,
) -> bool {
    let Some(shipped) = shared.member.shipping.get(id) else {
        return false;
    };
    p.secondaries
        .iter()
        .any(|&s| !draining.contains(&s) && shared.member.liveness.is_live(s) && shipped.in_sync(s))
}

/// A queue of this node placed as `placement` that could be handed over now: away, not
/// moving already.
fn away_candidate(
    core: &crate::core::NodeCore,
    id: String,
    placement: Placement,
) -> Option<Candidate> {
    let q = core.durable_queue(&id)?;
    // (Its epoch is the one it became primary at here: a later change of its secondaries
    // raised the placement's, not the queue's.)
    let away = matches!(q.state, QueueState::Away { .. }) && !q.moving;
    away.then(|| Candidate {
        id,
        placement,
        pending_bytes: q.pending_bytes(),
    })
}

/// How long a draining node's rebalancing round waits for the sessions it ended to end, so
/// their queues move in the same round, in milliseconds.
pub const DRAIN_SESSION_END_WAIT_MS: u64 = 500;

/// The reason a draining node gives the clients it sends away.
pub const DRAINING_REASON: &str =
    "this node is draining: the queue is moving to another member; reconnect";

/// Hands `id` (placed as `p`, primary here) over to `target`; see the module documentation.
async fn hand_over(
    shared: &Arc<Shared>,
    cluster: &Arc<Cluster>,
    id: &str,
    p: &Placement,
    target: NodeId,
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
    let copied = match qid.and_then(|q| shared.member.shipping.info_changed(q)) {
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
            tracing::info!(durable_id = %id, to = target.0, epoch = moved.epoch, "handed the queue over");
            // Committed once the leader applied it: the metadata here may not say so yet, and
            // until it does, this node's clients of the queue are sent to the taker (not given
            // a new queue on the placement this node still reads).
            shared
                .member
                .shipping
                .note_rival(id, Some(target), moved.epoch);
            super::shipping::depose(shared, id, (Some(moved.primary), moved.epoch)).await;
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
                        super::shipping::depose(&shared, &id, (Some(p.primary), p.epoch)).await;
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
