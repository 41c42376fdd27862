//! Where durable queues live in a cluster: placing a new queue on the node its client first
//! reaches, redirecting a client that reaches another node, and removing the placement when
//! the queue ends (expiry, close, drop) so the id can start anew anywhere. A placement made
//! for a hello whose queue is then refused is released at once ([`release_unused`]).
//!
//! A new queue gets up to `redundancy` secondaries among the members that answer pings,
//! chosen by rendezvous hashing of (durable id, member) so placements spread evenly.
//!
//! - A clustered node serves durable hellos only after a read barrier (a no-op metadata command
//!   committed after it started) is applied locally; a cluster-placed queue (epoch above 0)
//!   that the caught-up metadata no longer places is dropped (it ended elsewhere while this
//!   node was down: `control::reconcile::own_queue_step`, `Ended`).
//! - A node serves a durable hello only if the metadata places that id on it (placing it there
//!   if it is nowhere); otherwise it redirects. A placement made before the hello, on a node
//!   that holds nothing of the queue, is confirmed by a read barrier first, and a newer primary
//!   known here before the metadata (`Shipping::rival`) gets the client
//!   (`control::reconcile::placed_here_step`).
//! - A primary without lease or majority refuses the hello (`unavailable`) as its shipping
//!   sends such a queue's client away (`control::reconcile::step_aside`).
//! - A client naming a lost primary has a copy promoted only if it is the queue's owner
//!   (`check_copy_owner`).
//! - A redirect names the placement epoch it sends the client by, and the client names it in
//!   its next hello; a node that has not applied that far waits for its metadata (at most
//!   [`REDIRECT_CATCH_UP_MS`]) or answers `unavailable`, and never redirects by an older
//!   placement: so redirects converge (`control::reconcile::redirect_catch_up`).
//! - A queue that ends here (close, expiry, drop) has its placement removed ([`forget`]); until
//!   that removal is settled no new queue of the id starts here ([`Releasing`]), or a late
//!   removal would take the new queue's placement away. Found by the whole-cluster simulation
//!   (`tests/cluster_sim.rs`, seed 6 of the version that first closed queues).

use crate::bug::LockExt;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tether_transport::ErrorCode;

use super::Shared;
use crate::cluster::Cluster;
use crate::cluster::meta::{MetaCommand, MetaResponse, REDUNDANCY_MAX};
use crate::control::reconcile::{self, PlacedHereStep};
use crate::protocol::{DurableHello, WireError};

/// Durable ids whose hellos are between placing and attaching on this node, with how many.
#[derive(Default)]
pub(crate) struct Placing(Mutex<HashMap<String, usize>>);

impl Placing {
    fn map(&self) -> std::sync::MutexGuard<'_, HashMap<String, usize>> {
        self.0.lock_or_stop()
    }

    /// Counts a hello for `id` until the guard drops.
    pub(crate) fn enter(&self, id: &str) -> PlacingGuard<'_> {
        *self.map().entry(id.to_string()).or_insert(0) += 1;
        PlacingGuard {
            placing: self,
            id: id.to_string(),
        }
    }

    /// Hellos for `id` under way here.
    fn count(&self, id: &str) -> usize {
        self.map().get(id).copied().unwrap_or(0)
    }
}

/// See [`Placing::enter`].
pub(crate) struct PlacingGuard<'a> {
    placing: &'a Placing,
    id: String,
}

impl Drop for PlacingGuard<'_> {
    fn drop(&mut self) {
        let mut map = self.placing.map();
        if let Some(n) = map.get_mut(&self.id) {
            *n -= 1;
            if *n == 0 {
                map.remove(&self.id);
            }
        }
    }
}

/// After a durable hello was refused past its placement (`guard` still counts it): releases
/// the placement of its id when it makes this node primary and nothing here holds the id (no
/// queue, no copy, no other hello under way), so refused hellos leave nothing in the
/// metadata. Without this, each refused hello for a new id would keep a placement forever.
pub(crate) fn release_unused(shared: &Arc<Shared>, guard: &PlacingGuard<'_>) {
    let id = guard.id.as_str();
    let unused = shared.core().durable_queue(id).is_none()
        && shared.member.copies.get(id).is_none()
        && shared.member.placing.count(id) == 1;
    if unused {
        tracing::debug!(durable_id = %id, "releasing the placement of a refused hello");
        forget(shared, id, Ended::Released);
    }
}

/// Drops this node's copy of `id`, a queue the metadata no longer places
/// (`control::reconcile::copy_step` says `Drop`), before a new queue of the id is placed
/// here. A copy shipped under a placement the metadata here has not applied yet cannot be
/// judged: the hello is told `unavailable` (retry).
async fn drop_ended_copy(
    shared: &Arc<Shared>,
    cluster: &Cluster,
    id: &str,
) -> Result<(), WireError> {
    let Some(cell) = shared.member.copies.get(id) else {
        return Ok(());
    };
    let mut copy = cell.lock().await;
    if copy.gone {
        return Ok(());
    }
    let step = reconcile::copy_step(
        cluster.placement(id).as_ref(),
        cluster.id(),
        copy.replica.epoch(),
        copy.placed_at,
        cluster.applied_index(),
        *shared.member.meta_caught_up.borrow(),
    );
    if step == reconcile::CopyStep::Drop && super::copies::drop_copy(shared, id, &mut copy).await {
        tracing::info!(durable_id = %id, "dropped a copy of an ended queue before placing the id here");
        return Ok(());
    }
    Err(WireError::new(
        ErrorCode::Unavailable,
        "this node still holds a copy of an ended queue of this durable id; retry",
    ))
}

/// Longest wait of a redirected hello for this node's metadata to apply the epoch the
/// redirect named, in milliseconds; it is refused with `unavailable` after it.
pub const REDIRECT_CATCH_UP_MS: u64 = 1_000;

/// Where a durable hello should be served.
pub(crate) enum Placed {
    /// Here: proceed with the connection; the queue's placement.
    Here(crate::cluster::meta::Placement),
    /// On another member: redirect the client to (node name, address), by the placement of
    /// `epoch` (None for a queue not placed yet).
    Elsewhere {
        node_id: String,
        addr: String,
        epoch: Option<u64>,
    },
}

/// Finds (or makes, through consensus) the placement of durable id `d` and says whether this
/// node serves it. A queue never placed goes to this node; placing is idempotent, so two nodes
/// racing to place one id agree on the winner.
pub(crate) async fn place_durable(
    shared: &Arc<Shared>,
    cluster: &Cluster,
    d: &DurableHello,
    principal: Option<&str>,
) -> Result<Placed, WireError> {
    let me = cluster.id();
    if d.redundancy > REDUNDANCY_MAX {
        return Err(WireError::new(
            ErrorCode::InvalidArgument,
            format!(
                "redundancy {} is above the limit of {REDUNDANCY_MAX}",
                d.redundancy
            ),
        ));
    }
    super::failover::metadata_caught_up(shared).await?;
    // Sent here by a node whose metadata is newer: catch up first, so this node does not send
    // the client back by an older placement.
    if let Some(index) = reconcile::redirect_catch_up(d.redirect_epoch, cluster.applied_index())
        && !cluster
            .wait_applied(index, Duration::from_millis(REDIRECT_CATCH_UP_MS))
            .await
    {
        return Err(WireError::new(
            ErrorCode::Unavailable,
            "this node's cluster metadata is behind the node that redirected this client \
             here; retry",
        ));
    }
    // Whether this hello placed the queue (a new queue, nothing to confirm).
    let mut placed_now = false;
    let placement = match cluster.placement(&d.id) {
        Some(p) => p,
        None => {
            // A queue left here from before the queue moved (this node was down) and ended.
            super::failover::drop_unplaced(shared, cluster, &d.id).await;
            // A copy of an ended queue of the id, not dropped yet: placed here, the new queue
            // would be that copy promoted (the closed queue's events back).
            drop_ended_copy(shared, cluster, &d.id).await?;
            // Expired on whichever node held it: this connection must say `expired` once, to
            // the id's owner only (checked before anything is placed).
            let (expired, owner) = cluster.read(|s| {
                (
                    s.expired.contains(&d.id),
                    s.expired_owners.get(&d.id).cloned(),
                )
            });
            if owner.as_deref().is_some_and(|o| Some(o) != principal) {
                return Err(crate::core::not_yours(&d.id));
            }
            if expired {
                shared
                    .apply(|core| Ok(((), core.note_expired_elsewhere(&d.id, owner.as_deref()))))
                    .await?;
            }
            // A draining node places no queue: the member that would hold its first copy does.
            if cluster.read(|s| s.draining.contains(&me))
                && let Some(&to) =
                    super::failover::choose_secondaries(shared, cluster, &d.id, 1, &[me]).first()
            {
                return redirect(cluster, to, None);
            }
            let cmd = MetaCommand::Place {
                id: d.id.clone(),
                primary: me,
                secondaries: super::failover::choose_secondaries(
                    shared,
                    cluster,
                    &d.id,
                    d.redundancy,
                    &[me],
                ),
                redundancy: d.redundancy,
                timeout_ms: d.timeout_secs.saturating_mul(1_000),
            };
            match cluster.write(cmd).await {
                Ok(MetaResponse::Placed(p)) => {
                    placed_now = true;
                    p
                }
                Ok(other) => {
                    return Err(WireError::new(
                        ErrorCode::Internal,
                        format!("placing durable id: unexpected {other:?}"),
                    ));
                }
                Err(e) => return Err(metadata_unavailable(e)),
            }
        }
    };
    let mut placement = placement;
    let lost = d.failed_primary.as_deref();
    if lost.is_some() {
        // Only the queue's owner may have its copy promoted here: checked before, not after.
        check_copy_owner(shared, &d.id, principal).await?;
    }
    if reconcile::may_take_over(&placement, me)
        && lost.is_some_and(|lost| {
            cluster
                .members()
                .nodes
                .get(&placement.primary)
                .is_some_and(|n| n.name == lost)
        })
        && let Some(p) = super::failover::client_failover(cluster, &d.id, &placement).await?
    {
        placement = p;
    }
    if placement.primary == me {
        let mut confirmed = false;
        loop {
            let held = shared.core().durable_queue(&d.id).is_some()
                || shared.member.copies.get(&d.id).is_some();
            let rival = shared
                .member
                .shipping
                .rival(&d.id)
                .map(|r| (r.node, r.epoch));
            let step = crate::control::reconcile::placed_here_step(
                &placement,
                cluster.applied_index(),
                rival,
                held,
                placed_now,
                confirmed,
            );
            match step {
                PlacedHereStep::Serve => break,
                PlacedHereStep::Elsewhere(Some(node)) => {
                    // The newer primary known here (a rival, by its epoch) or the placement's.
                    let epoch = rival
                        .filter(|&(n, _)| n == Some(node))
                        .map_or(placement.epoch, |(_, e)| e);
                    return redirect(cluster, node, Some(epoch));
                }
                PlacedHereStep::Elsewhere(None) => {
                    return Err(WireError::new(
                        ErrorCode::Unavailable,
                        "this queue moved to another node; reconnect",
                    ));
                }
                PlacedHereStep::Confirm => {
                    cluster.barrier().await.map_err(metadata_unavailable)?;
                    if cluster.placement(&d.id).as_ref() != Some(&placement) {
                        return Err(WireError::new(
                            ErrorCode::Unavailable,
                            "the queue's placement changed meanwhile; retry",
                        ));
                    }
                    confirmed = true;
                }
            }
        }
    }
    if placement.primary == me {
        // Cut off from the majority without a lease: a copy there takes the queue over (the
        // client goes to the copies first once refused here).
        let lease_held = shared
            .member
            .shipping
            .get(&d.id)
            .is_none_or(|sq| sq.lease_held(std::time::Instant::now()));
        let has_copies = !placement.secondaries.is_empty();
        if crate::control::reconcile::step_aside(
            has_copies,
            lease_held,
            shared.member.liveness.majority_reachable(cluster),
        ) {
            return Err(WireError::new(
                ErrorCode::Unavailable,
                super::shipping::CUT_OFF_REASON,
            ));
        }
        if let Some(refused) = draining_refusal(shared, cluster, &d.id, &placement) {
            return Err(refused);
        }
        // Promoted (by a client's failover or by the cluster): the copy must be a queue of the
        // core before the session attaches, or the client would find a new, empty queue.
        super::failover::adopt_promoted_copy(shared, &d.id, &placement).await?;
        return Ok(Placed::Here(placement));
    }
    redirect(cluster, placement.primary, Some(placement.epoch))
}

/// On a draining node, a queue that can move ([`super::rebalance::can_leave`]) takes no
/// client: the rebalancing round hands it over, and its client, told `unavailable`, comes back
/// to the taker. A queue that cannot move yet is served here.
fn draining_refusal(
    shared: &Shared,
    cluster: &Cluster,
    id: &str,
    p: &crate::cluster::meta::Placement,
) -> Option<WireError> {
    let draining = cluster.read(|s| s.draining.clone());
    (draining.contains(&cluster.id()) && super::rebalance::can_leave(shared, &draining, id, p))
        .then(|| WireError::new(ErrorCode::Unavailable, super::rebalance::DRAINING_REASON))
}

/// Sends the client to member `node`, which holds the queue by the placement of `epoch`.
fn redirect(
    cluster: &Cluster,
    node: crate::cluster::meta::NodeId,
    epoch: Option<u64>,
) -> Result<Placed, WireError> {
    match cluster.members().nodes.get(&node) {
        Some(n) => Ok(Placed::Elsewhere {
            node_id: n.name.clone(),
            addr: n.addr.clone(),
            epoch,
        }),
        None => Err(WireError::new(
            ErrorCode::Unavailable,
            "the node holding this durable queue is not a configured member",
        )),
    }
}

/// The metadata could not be written or read through consensus: the client retries.
pub(crate) fn metadata_unavailable(e: crate::cluster::ClusterError) -> WireError {
    WireError::new(
        ErrorCode::Unavailable,
        format!("cluster metadata unavailable, retry: {e}"),
    )
}

/// Refuses `principal` a durable id whose copy held here belongs to another principal (the
/// owner travels with the queue's info to its copies), by the rule `NodeCore::connect_as`
/// applies to a queue. Nothing to check without a copy here.
async fn check_copy_owner(
    shared: &Arc<Shared>,
    id: &str,
    principal: Option<&str>,
) -> Result<(), WireError> {
    let Some(copy) = shared.member.copies.get(id) else {
        return Ok(());
    };
    let owner = copy.lock().await.info.owner.clone();
    match owner {
        Some(o) if Some(o.as_str()) != principal => Err(WireError::new(
            ErrorCode::Forbidden,
            format!("durable id {id:?} belongs to another principal"),
        )),
        _ => Ok(()),
    }
}

/// How a durable queue ended on this node.
pub(crate) enum Ended {
    /// Its timeout passed: its next client learns `expired`, and the id stays `owner`'s.
    Expired { owner: Option<String> },
    /// Closed by its client, or dropped: its next client starts a `new` queue.
    Released,
}

/// Removes durable id `id`'s placement if this node holds it: its queue ended here, by expiry
/// or by a close or drop (`ended`). Runs in the background;
/// a failed removal is not retried yet and only means the next client with this id is sent
/// here, where it starts a new queue.
///
/// Until the removal is settled (committed, refused, or, unanswered, known not to commit
/// after a read barrier), no new queue of the id starts here ([`Releasing`]): a removal that
/// commits late would take the new queue's placement away, and the queue with it (what its
/// client was acknowledged included). A new queue that started before the mark keeps the
/// placement: nothing is removed.
pub(crate) fn forget(shared: &Arc<Shared>, id: &str, ended: Ended) {
    let Some(cluster) = shared.member.cluster.get().cloned() else {
        return;
    };
    let Some(p) = cluster.placement(id) else {
        return;
    };
    if p.primary != cluster.id() {
        return;
    }
    let mark = shared.member.releasing.mark(id);
    if shared.core().durable_queue(id).is_some() {
        // A new queue of the id started here since this one ended: its placement stays.
        shared.member.releasing.settled(id, mark);
        return;
    }
    let id = id.to_string();
    let weak = Arc::downgrade(shared);
    tokio::spawn(async move {
        let cmd = match ended {
            Ended::Expired { owner } => MetaCommand::Expire {
                id: id.clone(),
                expected_epoch: p.epoch,
                owner,
            },
            Ended::Released => MetaCommand::Release {
                id: id.clone(),
                expected_epoch: p.epoch,
            },
        };
        if let Err(e) = cluster.write(cmd).await {
            tracing::warn!(durable_id = %id, error = %e, "could not remove the queue's placement");
            // It may still commit: a read barrier settles it either way.
            while cluster.barrier().await.is_err() {
                if weak.strong_count() == 0 {
                    return; // The node stopped.
                }
                tokio::time::sleep(Duration::from_millis(RELEASE_SETTLE_RETRY_MS)).await;
            }
        }
        if let Some(shared) = weak.upgrade() {
            shared.member.releasing.settled(&id, mark);
        }
    });
}

/// Pause between read barriers that settle an unanswered removal of a placement
/// ([`forget`]), in milliseconds.
pub const RELEASE_SETTLE_RETRY_MS: u64 = 1_000;

/// Durable ids whose queue ended on this node while the removal of their placement is not
/// settled ([`forget`]): no new queue of the id starts here meanwhile (the hello is told
/// `unavailable`, retry). Each mark has a generation, so an older removal that settles last
/// does not lift a newer one's mark.
#[derive(Default)]
pub(crate) struct Releasing {
    marks: Mutex<HashMap<String, u64>>,
    next: std::sync::atomic::AtomicU64,
}

impl Releasing {
    /// Marks `id`; returns the mark's generation, for [`settled`](Self::settled).
    fn mark(&self, id: &str) -> u64 {
        let generation = self.next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        self.marks.lock_or_stop().insert(id.to_string(), generation);
        generation
    }

    /// Lifts mark `generation` of `id`, unless a newer one replaced it.
    fn settled(&self, id: &str, generation: u64) {
        let mut marks = self.marks.lock_or_stop();
        if marks.get(id) == Some(&generation) {
            marks.remove(id);
        }
    }

    /// Whether the removal of `id`'s placement is under way here.
    pub(crate) fn contains(&self, id: &str) -> bool {
        self.marks.lock_or_stop().contains_key(id)
    }
}
