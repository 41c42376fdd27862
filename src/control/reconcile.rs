//! Reconciling a node with the metadata: per queue and per copy, what the node does next.
//!
//! Pure decisions over the placement applied here and what the node holds; the driver
//! (`server/failover.rs`, the reconciler every `RECONCILE_MS`) evaluates each one at the moment
//! it acts, under the lock of what it changes (a copy's lock, the core), so a decision is never
//! carried out on inputs older than the action. The driver then executes it: promote, depose,
//! ship, write metadata, drop.
//!
//! - Per queue of the core (`own_queue_step`): ship and repair, depose, drop as ended, wait.
//!   Epochs are indexes of committed metadata, so a node's queue is deposed by a primary of a
//!   higher epoch shipping to it or fencing it even before its metadata says so
//!   (`superseded_by_rival`): a node cut from the metadata leader still hands its queue to the
//!   new primary and becomes its copy.
//! - Per durable hello placed here (`placed_here_step`): serve; send the client to a newer
//!   primary known here (`Shipping::rival` in `server/shipping.rs`); or, for a placement made
//!   before the hello on a node that holds nothing of the queue, confirm it with a read barrier
//!   first, so a new queue is never started on a stale placement, whose epoch could exceed the
//!   copy of the queue's real primary.
//! - Per copy (`copy_step`): promote, keep, or drop. A secondary drops a copy only when its
//!   applied metadata is at least as new as the placement its primary shipped under
//!   (`placement_epoch` on every replication message) and, after a restart, its read barrier is
//!   applied (`copy_not_held`): a node whose metadata lags never drops a copy its primary
//!   counts.
//! - Repair (`repair_step`, one metadata change a round): take out copies that lost data, then
//!   copies this node cannot reach while it reaches a majority, then report synced copies, then
//!   add missing copies, chosen among the live members by rendezvous hashing of (durable id,
//!   member) (`rendezvous`).
//! - `step_aside`: a primary without lease and majority sends its client to a copy.
//! - `shipped_by_non_primary`: a replication message from a member the placement applied here
//!   does not name as the queue's primary is refused (with `network::check_sender`'s identity
//!   check, `cluster/network.rs`); `shipped_for_ended_queue`: so is one shipped under a
//!   placement removed since (a late message of a closed or expired queue).

use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicUsize, Ordering};

use crate::cluster::meta::{MetaState, NodeId, Placement, REDUNDANCY_MAX, fnv1a};

/// What becomes of a durable queue of this node's core, given its placement.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OwnQueueStep {
    /// This node is its primary: ship it to the placement's secondaries and repair its
    /// redundancy ([`repair_step`]).
    Primary,
    /// Another node holds it at a higher epoch (a failover or a handover): drop it here and
    /// send its client on.
    Deposed,
    /// Placed elsewhere at an epoch not above this queue's: this node's metadata or the other
    /// node's promotion is behind; nothing yet.
    Wait,
    /// The cluster placed it (epoch above 0) and the metadata, applied past that placement, no
    /// longer places it: it moved while this node was down, then expired or was released.
    /// Dropped here, or a restarted old primary would bring an ended queue back to life.
    Ended,
    /// No placement: made before the node joined a cluster (or its placement is not applied
    /// here yet). It has no copies and delivers everything committed.
    Unreplicated,
}

/// The step for a queue of the core at `queue_epoch` (the epoch it became primary at here),
/// placed as `placement` in the metadata applied here up to `applied`. `rival_epoch` (0 if
/// none) is the highest epoch another node was seen being this queue's primary at: it shipped
/// to this node as its copy, or a copy answered this node's shipping with it
/// ([`superseded_by_rival`]).
pub fn own_queue_step(
    placement: Option<&Placement>,
    me: NodeId,
    queue_epoch: u64,
    applied: u64,
    rival_epoch: u64,
) -> OwnQueueStep {
    match placement {
        _ if superseded_by_rival(placement, queue_epoch, applied, rival_epoch) => {
            OwnQueueStep::Deposed
        }
        Some(p) if p.primary == me => OwnQueueStep::Primary,
        Some(p) if p.epoch > queue_epoch => OwnQueueStep::Deposed,
        Some(_) => OwnQueueStep::Wait,
        None if queue_epoch > 0 && applied >= queue_epoch => OwnQueueStep::Ended,
        None => OwnQueueStep::Unreplicated,
    }
}

/// Whether another node, seen being primary of a queue at `rival_epoch`, supersedes this
/// node's queue at `queue_epoch` before the metadata applied here (`placement`, applied up to
/// `applied`) says so.
///
/// Epochs are indexes of committed metadata: a node ships as primary at the epoch of the
/// placement that made it primary, and a copy only knows epochs it was shipped at. So a rival
/// epoch above this queue's is a later placement naming another primary, even when this node
/// cannot apply it (cut from the metadata leader, it still reaches the new primary, which
/// chooses it as its copy). A placement applied here at or past the rival's epoch decides
/// instead (this node may have been made primary again since).
pub fn superseded_by_rival(
    placement: Option<&Placement>,
    queue_epoch: u64,
    applied: u64,
    rival_epoch: u64,
) -> bool {
    rival_epoch > queue_epoch && rival_epoch > placement.map_or(applied, |p| p.epoch)
}

/// What a node does with a durable hello for a queue its metadata places on it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PlacedHereStep {
    /// Serve it here (promoting a copy held here first, if the placement makes it primary).
    Serve,
    /// A newer primary is known here before the metadata here says so (it shipped to this
    /// node, or this node handed the queue over to it): the client goes there (`None`: not
    /// known which node; it retries).
    Elsewhere(Option<NodeId>),
    /// Placed here before this hello, yet nothing here holds the queue: the metadata here may
    /// lag behind a move (a handover commits once the *leader* applies it). A read barrier
    /// first; a queue started here on a stale placement would append under that placement's
    /// epoch, above the copy its new primary holds, and its shipping would replace that copy.
    Confirm,
}

/// The step for a durable hello whose `placement` (applied here up to `applied`) makes this
/// node primary: `rival` is the newer primary seen here ([`superseded_by_rival`]; node and
/// epoch), `held` whether this node's core or copies hold the queue, `placed_now` whether this
/// hello placed it (a new queue), `confirmed` whether a read barrier ran since the placement
/// was read.
pub fn placed_here_step(
    placement: &Placement,
    applied: u64,
    rival: Option<(Option<NodeId>, u64)>,
    held: bool,
    placed_now: bool,
    confirmed: bool,
) -> PlacedHereStep {
    match rival {
        Some((node, epoch)) if superseded_by_rival(Some(placement), 0, applied, epoch) => {
            PlacedHereStep::Elsewhere(node)
        }
        _ if held || placed_now || confirmed => PlacedHereStep::Serve,
        _ => PlacedHereStep::Confirm,
    }
}

/// What becomes of a copy this node holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CopyStep {
    /// The metadata made this node the queue's primary at a higher epoch than the copy's: the
    /// copy becomes a queue of the core.
    Promote,
    /// Not held any more ([`copy_not_held`]).
    Drop,
    /// Held, or not known yet to be not held.
    Keep,
}

/// Whether `p` makes this node (`me`) the primary of a queue it holds a copy of at
/// `copy_epoch` (its primary's): the copy is then promoted into a queue of the core.
pub fn promotes(p: &Placement, me: NodeId, copy_epoch: u64) -> bool {
    p.primary == me && p.epoch > copy_epoch
}

/// Whether a copy of a queue whose incarnation is `held` (`QueueInfo::incarnation`) holds
/// another queue than the one its primary now ships, of incarnation `shipped`: the queue
/// copied ended (closed, expired) and its durable id was placed again, maybe on the same
/// member at the same placement epoch, before this node dropped the copy. Its entries share
/// offsets and even epochs with the new queue's, so the replica would take them for the new
/// queue's and acknowledge what it does not hold: the copy is replaced by a new one. An
/// incarnation of 0 is unknown (a queue created before they were recorded): a primary
/// shipping 0 is not told apart from anything (the queue may have passed through a member of
/// an older build, which drops the field), while a copy holding 0 of a queue that now ships
/// one holds an older queue (incarnations are only given when a queue is created).
pub fn copy_of_another_queue(held: u64, shipped: u64) -> bool {
    shipped != 0 && held != shipped
}

/// Whether this node (`me`) may take `p`'s queue over at its client's request (client-managed
/// failover, once the primary does not answer it either): it is a secondary that is not
/// syncing, so it holds everything the queue may have delivered.
pub fn may_take_over(p: &Placement, me: NodeId) -> bool {
    p.primary != me && p.secondaries.contains(&me) && !p.syncing.contains(&me)
}

/// The step for a copy at `copy_epoch` (its primary's), shipped under placements up to
/// `placed_at`; see [`copy_not_held`] for the other inputs.
pub fn copy_step(
    placement: Option<&Placement>,
    me: NodeId,
    copy_epoch: u64,
    placed_at: u64,
    applied: u64,
    caught_up: bool,
) -> CopyStep {
    match placement {
        Some(p) if promotes(p, me, copy_epoch) => CopyStep::Promote,
        _ if copy_not_held(placement, me, copy_epoch, placed_at, applied, caught_up) => {
            CopyStep::Drop
        }
        _ => CopyStep::Keep,
    }
}

/// Whether the primary of a queue sends the queue's client away, and refuses new ones: the
/// queue has copies (`has_copies`), this node lost its lease on them (a copy stopped
/// acknowledging: it delivers nothing) and it does not reach a majority of the cluster. The
/// majority's side then promotes a copy (the metadata leader declares this node failed, or the
/// client itself asks a copy to take over), and the client is better served there; staying
/// attached here it would wait, silent, for the whole partition.
///
/// A primary that still reaches a majority keeps its client: a copy that died is taken out of
/// the replica set there and delivery resumes. A queue without copies stays wherever its only
/// node is.
pub fn step_aside(has_copies: bool, lease_held: bool, majority_reachable: bool) -> bool {
    has_copies && !lease_held && !majority_reachable
}

/// One metadata change that restores a primary's redundancy, at most one per round (each is
/// a compare-and-set on the placement's epoch, which it raises).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RepairStep {
    /// Secondaries lost entries they had acknowledged: out of the replica set with them (they
    /// must not stay promotable); a later round adds members back as syncing.
    TakeOut {
        lost: Vec<NodeId>,
        secondaries: Vec<NodeId>,
    },
    /// Secondaries this node has not reached for a while (it reaches a majority, so the
    /// fault is on their side or on the link): out of the replica set with them, so the queue
    /// delivers again without waiting for the link to heal; a later round adds another
    /// member. The metadata leader may see them alive and never declare them failed.
    TakeOutUnreachable {
        unreachable: Vec<NodeId>,
        secondaries: Vec<NodeId>,
    },
    /// A syncing secondary caught up: report it, it may be promoted from then on.
    Synced(NodeId),
    /// Secondaries on draining members (`tether cluster drain`): out of the replica set once
    /// enough copies on other members are in sync, or first when the set is full (to make
    /// room for their replacements).
    TakeOutDraining {
        draining: Vec<NodeId>,
        secondaries: Vec<NodeId>,
    },
    /// Fewer secondaries than the redundancy asked for: add up to `want` live members, none of
    /// `exclude` (the current secondaries and this node), chosen by [`rendezvous`].
    Add { want: u8, exclude: Vec<NodeId> },
    /// Spreading copies ([`spread_step`]): add a copy on member `to` (syncing); the copy it
    /// replaces goes once it is in sync.
    SpreadTo { to: NodeId },
    /// More copies than asked for, the ones kept in sync: out of the replica set with the
    /// `surplus` (the second half of a [`RepairStep::Spread`]).
    TakeOutSurplus {
        surplus: Vec<NodeId>,
        secondaries: Vec<NodeId>,
    },
    /// Nothing to repair.
    Nothing,
}

/// What a primary observes of its queue's copies, for [`repair_step`].
pub struct CopiesSeen<'a> {
    /// Secondaries that lost what they acknowledged.
    pub regressed: &'a [NodeId],
    /// Whether a secondary holds everything the primary shipped.
    pub in_sync: &'a dyn Fn(NodeId) -> bool,
    /// Whether this node has not reached a member for a while
    /// ([`FailureDetector::unreachable`](super::liveness::FailureDetector::unreachable)).
    pub unreachable: &'a dyn Fn(NodeId) -> bool,
    /// Whether this node reaches a majority of the members.
    pub majority_reachable: bool,
    /// Whether a member is draining (`MetaState::draining`).
    pub draining: &'a dyn Fn(NodeId) -> bool,
    /// What spreading copies needs ([`spread_step`]); None: copies are not spread.
    pub spread: Option<Spread<'a>>,
}

/// The repair of a queue this node (`me`) is primary of, placed as `p`, given what it sees
/// of the copies: copies that lost data go first, then copies this node cannot reach (only
/// while it reaches a majority: a primary on the minority's side leaves its queue to the
/// majority, see [`step_aside`]), then a syncing copy that caught up is reported, then
/// copies move off draining members (see [`drain_step`]), then missing copies are added, then
/// copies are spread (see [`spread_step`], while this node reaches a majority and is not
/// draining).
pub fn repair_step(p: &Placement, me: NodeId, seen: &CopiesSeen<'_>) -> RepairStep {
    let regressed = seen.regressed;
    if regressed.iter().any(|n| p.secondaries.contains(n)) {
        let secondaries = p
            .secondaries
            .iter()
            .copied()
            .filter(|n| !regressed.contains(n))
            .collect();
        return RepairStep::TakeOut {
            lost: regressed.to_vec(),
            secondaries,
        };
    }
    if seen.majority_reachable {
        let (unreachable, secondaries): (Vec<NodeId>, Vec<NodeId>) =
            p.secondaries.iter().partition(|&&n| (seen.unreachable)(n));
        if !unreachable.is_empty() {
            return RepairStep::TakeOutUnreachable {
                unreachable,
                secondaries,
            };
        }
    }
    if let Some(&node) = p.syncing.iter().find(|&&s| (seen.in_sync)(s)) {
        return RepairStep::Synced(node);
    }
    if let Some(step) = drain_step(p, me, seen.draining) {
        return step;
    }
    let have = p.secondaries.len();
    if have >= usize::from(p.redundancy) {
        return match &seen.spread {
            Some(spread) if seen.majority_reachable && !(seen.draining)(me) => {
                spread_step(p, me, spread, seen.in_sync).unwrap_or(RepairStep::Nothing)
            }
            _ => RepairStep::Nothing,
        };
    }
    let mut exclude = p.secondaries.clone();
    exclude.push(me);
    RepairStep::Add {
        want: p.redundancy - have as u8,
        exclude,
    }
}

/// Draining (`tether cluster drain`): copies on draining members are replaced by copies on
/// others, and a queue whose primary (`me`) is draining gets a copy even at redundancy 0, so
/// the rebalancer can hand it over (a handover needs an in-sync copy on the taker). A copy
/// is added first (syncing) while the replica set has room; the draining copy goes once the
/// copies elsewhere are enough and in sync. When the set is full, the draining copy goes
/// first, to make room. None when nothing is draining here.
pub fn drain_step(
    p: &Placement,
    me: NodeId,
    draining: &dyn Fn(NodeId) -> bool,
) -> Option<RepairStep> {
    let (leaving, staying): (Vec<NodeId>, Vec<NodeId>) =
        p.secondaries.iter().partition(|&&n| draining(n));
    let want = usize::from(p.redundancy.max(u8::from(draining(me))));
    if staying.len() < want {
        if p.secondaries.len() < usize::from(REDUNDANCY_MAX) {
            let room = usize::from(REDUNDANCY_MAX) - p.secondaries.len();
            let mut exclude = p.secondaries.clone();
            exclude.push(me);
            return Some(RepairStep::Add {
                want: (want - staying.len()).min(room) as u8,
                exclude,
            });
        }
        if leaving.is_empty() {
            return None;
        }
    } else if leaving.is_empty() || staying.iter().any(|n| p.syncing.contains(n)) {
        return None;
    }
    Some(RepairStep::TakeOutDraining {
        draining: leaving,
        secondaries: staying,
    })
}

/// Most copy moves ([`spread_step`]) one primary starts in a reconcile round.
pub const SPREAD_MOVES_PER_ROUND: usize = 1;
/// A primary starts no copy move while this many of its queues have a copy syncing (each is a
/// snapshot under way).
pub const SPREAD_SYNCING_MAX: usize = 4;
/// A copy moves to a member only while the member holding it holds over this many copies more.
pub const SPREAD_SLACK_COPIES: usize = 2;

/// What a primary knows, in one reconcile round, to spread copies over the members
/// ([`spread_step`]).
pub struct Spread<'a> {
    /// The members that may hold this queue's copies (not draining, this node left out), in
    /// the queue's rendezvous order, best first ([`rendezvous`] over every such member).
    pub ranked: &'a [NodeId],
    /// Per member, the copies it holds in the metadata (syncing ones included).
    pub copies: &'a BTreeMap<NodeId, usize>,
    /// Whether a member is live.
    pub live: &'a dyn Fn(NodeId) -> bool,
    /// Whether this node may start a move now (its budget for the round).
    pub may_add: bool,
}

/// Spreading copies over the members, so that a member added (or back after its copies were
/// placed elsewhere) takes its part of them, and then of the primaries (a handover needs an
/// in-sync copy on the taker). For a queue this node (`me`) is primary of, placed as `p`, with
/// its copies all in sync and as many as asked for: the copy on member `s` moves to member `t`
/// when `t` ranks above `s` in the queue's rendezvous order, is live, and holds over
/// [`SPREAD_SLACK_COPIES`] copies fewer than `s`. The new copy is added first (syncing, as a
/// repair's); once it is in sync, the lowest-ranked copies beyond the redundancy go
/// ([`RepairStep::TakeOutSurplus`]). A copy only ever moves up its queue's fixed order, so no
/// copy moves back and forth and moves end; the counts keep a balanced cluster from moving
/// any. A queue whose replica set is full ([`REDUNDANCY_MAX`] copies) is not spread (the copy
/// would have to go before its replacement is in sync). A surplus goes at any redundancy,
/// 0 included: the copy a drain gave a queue without redundancy ([`drain_step`]) goes once its
/// primary is undrained, or the queue's lease would wait on it for ever.
pub fn spread_step(
    p: &Placement,
    me: NodeId,
    spread: &Spread<'_>,
    in_sync: &dyn Fn(NodeId) -> bool,
) -> Option<RepairStep> {
    if p.primary != me || !p.syncing.is_empty() {
        return None;
    }
    let want = usize::from(p.redundancy);
    let rank = |n: NodeId| {
        spread
            .ranked
            .iter()
            .position(|&r| r == n)
            .unwrap_or(usize::MAX)
    };
    if p.secondaries.len() > want {
        let mut by_rank = p.secondaries.clone();
        by_rank.sort_by_key(|&n| rank(n));
        let (keep, surplus) = by_rank.split_at(want);
        if !keep.iter().all(|&n| in_sync(n)) {
            return None;
        }
        return Some(RepairStep::TakeOutSurplus {
            surplus: surplus.to_vec(),
            secondaries: p
                .secondaries
                .iter()
                .copied()
                .filter(|n| keep.contains(n))
                .collect(),
        });
    }
    if p.redundancy == 0
        || !spread.may_add
        || p.secondaries.len() < want
        || p.secondaries.len() >= usize::from(REDUNDANCY_MAX)
    {
        return None;
    }
    let count = |n: NodeId| spread.copies.get(&n).copied().unwrap_or(0);
    // The lowest-ranked copy first.
    let mut held = p.secondaries.clone();
    held.sort_by_key(|&n| std::cmp::Reverse(rank(n)));
    held.into_iter().find_map(|s| {
        spread
            .ranked
            .iter()
            .take_while(|&&t| t != s)
            .find(|&&t| {
                !p.secondaries.contains(&t)
                    && (spread.live)(t)
                    && count(s) > count(t) + SPREAD_SLACK_COPIES
            })
            .map(|&to| RepairStep::SpreadTo { to })
    })
}

/// What spreading copies reads once per reconcile round ([`spread_step`]), from the
/// metadata: shared by the round's repairs, which run at once.
pub struct SpreadRound {
    /// The members that may hold copies (not draining), with their names (rendezvous keys).
    eligible: Vec<(NodeId, String)>,
    /// Per member, the copies the metadata places on it (syncing ones included).
    copies: BTreeMap<NodeId, usize>,
    /// The fewest copies an eligible member holds.
    fewest: usize,
    /// Copy moves this node may still start in the round.
    budget: AtomicUsize,
}

impl SpreadRound {
    /// The round of member `me` over the metadata `state` and the cluster's `members` (id and
    /// name).
    pub fn read<'a>(
        state: &MetaState,
        members: impl IntoIterator<Item = (NodeId, &'a str)>,
        me: NodeId,
    ) -> SpreadRound {
        let mut copies = BTreeMap::new();
        let mut syncing_here = 0;
        for p in state.queues.values() {
            for n in &p.secondaries {
                *copies.entry(*n).or_insert(0) += 1;
            }
            if p.primary == me && !p.syncing.is_empty() {
                syncing_here += 1;
            }
        }
        let budget = SPREAD_MOVES_PER_ROUND.min(SPREAD_SYNCING_MAX.saturating_sub(syncing_here));
        let eligible: Vec<(NodeId, String)> = members
            .into_iter()
            .filter(|(n, _)| !state.draining.contains(n))
            .map(|(n, name)| (n, name.to_string()))
            .collect();
        let fewest = eligible
            .iter()
            .map(|(n, _)| copies.get(n).copied().unwrap_or(0))
            .min()
            .unwrap_or(0);
        SpreadRound {
            eligible,
            copies,
            fewest,
            budget: budget.into(),
        }
    }

    /// Whether spreading could change `p` at all: it has a surplus copy, or a copy on a member
    /// holding over the slack more than the eligible member holding the fewest. Most queues,
    /// most rounds, are not: their order is then not computed.
    pub fn worth(&self, p: &Placement) -> bool {
        let count = |n: &NodeId| self.copies.get(n).copied().unwrap_or(0);
        p.secondaries.len() > usize::from(p.redundancy)
            || p.secondaries
                .iter()
                .any(|s| count(s) > self.fewest + SPREAD_SLACK_COPIES)
    }

    /// `id`'s eligible members but `me`, in the queue's rendezvous order.
    pub fn ranked(&self, id: &str, me: NodeId) -> Vec<NodeId> {
        let candidates = self
            .eligible
            .iter()
            .filter(|(n, _)| *n != me)
            .map(|(n, name)| (*n, rendezvous_key(id, name)));
        rendezvous(candidates, u8::MAX)
    }

    /// Per member, the copies the metadata places on it.
    pub fn copies(&self) -> &BTreeMap<NodeId, usize> {
        &self.copies
    }

    /// Whether a move is left in the round's budget.
    pub fn may_add(&self) -> bool {
        self.budget.load(Ordering::Relaxed) > 0
    }

    /// Takes one move of the round's budget; false when none is left.
    pub fn take_move(&self) -> bool {
        self.budget
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |b| b.checked_sub(1))
            .is_ok()
    }
}

/// Up to `count` of the `members` (id and name) for copies of `id`: live (`live`), not
/// draining, none of `exclude`; the members with the highest rendezvous hash of (id, member),
/// so each id has a stable preference order and queues spread over the members.
pub fn choose_secondaries<'a>(
    members: impl IntoIterator<Item = (NodeId, &'a str)>,
    id: &str,
    count: u8,
    exclude: &[NodeId],
    draining: &BTreeSet<NodeId>,
    live: impl Fn(NodeId) -> bool,
) -> Vec<NodeId> {
    let candidates = members
        .into_iter()
        .filter(|&(n, _)| !exclude.contains(&n) && !draining.contains(&n) && live(n))
        .map(|(n, name)| (n, rendezvous_key(id, name)));
    rendezvous(candidates, count)
}

/// The rendezvous hash of queue `id` on the member named `name` ([`rendezvous`]).
pub fn rendezvous_key(id: &str, name: &str) -> u64 {
    fnv1a(&format!("{id}\u{0}{name}"))
}

/// A hello that a redirect sent here, naming placement epoch `told`: the metadata log index
/// this node (its metadata applied up to `applied`) must apply before it acts on the queue's
/// placement, if any. Epochs are log indexes, so a node that applied `told` knows that
/// placement or a newer one: a redirect then goes only to a placement at least as new as the
/// one that sent the client here, never back by an older one, and a chain of redirects ends
/// as soon as the placement stops moving (two members with different metadata views used to
/// send a client back and forth until its redirects ran out).
pub fn redirect_catch_up(told: Option<u64>, applied: u64) -> Option<u64> {
    told.filter(|&epoch| epoch > applied)
}

/// Up to `count` of `candidates` (member id, hash of the queue id with the member's name) for
/// copies: those with the highest hash, so each queue id has a stable preference order and
/// queues spread over the members.
pub fn rendezvous(candidates: impl IntoIterator<Item = (NodeId, u64)>, count: u8) -> Vec<NodeId> {
    let mut ranked: Vec<(u64, NodeId)> = candidates.into_iter().map(|(n, h)| (h, n)).collect();
    ranked.sort_unstable_by(|a, b| b.cmp(a));
    ranked
        .into_iter()
        .take(usize::from(count))
        .map(|(_, n)| n)
        .collect()
}

/// Whether this node no longer holds its copy of a queue (so the copy is dropped), given the
/// queue's placement in the metadata applied here up to `applied`, the copy's epoch (its
/// primary's) and `placed_at` (the highest placement epoch its primary shipped under).
///
/// A placement without this node is not enough: this node's metadata may lag behind the
/// primary's, which added this node to the replica set and shipped to it before this node
/// applied that change. Dropping the copy then would leave the primary counting a copy that is
/// gone, one the metadata may promote. So the metadata must be applied at least as far as the
/// placement the copy was shipped under, and, after a restart (when `placed_at` is forgotten),
/// the node's read barrier must have been applied (`caught_up`): every placement shipped under
/// before the restart is then known here.
pub fn copy_not_held(
    placement: Option<&Placement>,
    me: NodeId,
    copy_epoch: u64,
    placed_at: u64,
    applied: u64,
    caught_up: bool,
) -> bool {
    match placement {
        // To be promoted (or the promotion failed and is tried again next time).
        Some(p) if promotes(p, me, copy_epoch) => false,
        Some(p) if p.secondaries.contains(&me) => false,
        _ => caught_up && applied >= copy_epoch.max(placed_at),
    }
}

/// Whether a replication message from node `from`, shipped under placement epoch
/// `shipped_under` ([`ReplicateMsg::placement_epoch`](crate::cluster::network::ReplicateMsg)),
/// contradicts the metadata applied here (up to `applied`): the placement in force at that
/// epoch is known here (applied that far, and `placement` not changed since) and names another
/// primary. A primary ships under the placement that made it primary, so this never holds for
/// one; a member shipping a queue it does not own is refused. Metadata applied less far here
/// cannot tell (the copy's epochs then fence a stale primary, as before).
pub fn shipped_by_non_primary(
    placement: Option<&Placement>,
    from: NodeId,
    shipped_under: u64,
    applied: u64,
) -> bool {
    placement
        .is_some_and(|p| applied >= shipped_under && p.epoch <= shipped_under && p.primary != from)
}

/// Whether a replication message shipped under placement epoch `shipped_under` belongs to a
/// queue that ended: the metadata applied here (up to `applied`) holds no placement of the
/// durable id (`placement`) though it is applied past that epoch, so the placement was removed
/// since (a close, an expiry, a drop). A message the sender sent before its queue ended may
/// still arrive after this node dropped its copy; taken, it would start a copy of the ended
/// queue, which a new placement of the id on this node would then promote instead of starting
/// the new queue empty (found by `tests/cluster_sim.rs`, seed 5419). A message without a
/// placement epoch (0) claims nothing.
pub fn shipped_for_ended_queue(
    placement: Option<&Placement>,
    shipped_under: u64,
    applied: u64,
) -> bool {
    placement.is_none() && shipped_under > 0 && applied >= shipped_under
}

/// The epoch to fence a replication message's sender with, when the placement applied here
/// (`placement`) is newer than the one the message was shipped under (`shipped_under`) and
/// names another primary: the sender was deposed (a failover, a handover) and has not learned
/// it yet. The answer `Reply::Fenced` with that epoch tells it at once.
///
/// The copy's epochs fence a deposed primary only where a copy at a higher epoch exists. A
/// node whose queue was deposed and dropped, or that never held a copy, would take a new copy
/// from the deposed primary and acknowledge it, raising that primary's `replicated_end` (and
/// its lease, were this its only copy) beside the real primary's (found by
/// `tests/cluster_sim.rs`, seed 2354). A message without a placement epoch (0) claims nothing.
pub fn deposed_sender(
    placement: Option<&Placement>,
    from: NodeId,
    shipped_under: u64,
) -> Option<u64> {
    placement
        .filter(|p| shipped_under > 0 && p.epoch > shipped_under && p.primary != from)
        .map(|p| p.epoch)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A queue placed on `primary` at `epoch`, with a copy on node 2.
    fn shipped_placement(primary: NodeId, epoch: u64) -> Placement {
        Placement {
            primary,
            secondaries: vec![NodeId(2)],
            epoch,
            redundancy: 1,
            timeout_ms: 60_000,
            syncing: Vec::new(),
            handed_over: false,
        }
    }

    #[test]
    fn a_deposed_primary_shipping_under_an_older_placement_is_fenced_by_the_newer_one() {
        let placement = shipped_placement;
        // Node 1 shipped under 40; the metadata here made node 3 primary at 60.
        assert_eq!(
            deposed_sender(Some(&placement(NodeId(3), 60)), NodeId(1), 40),
            Some(60)
        );
        // Still node 1's at 60 (its secondaries changed): shipping on.
        assert_eq!(
            deposed_sender(Some(&placement(NodeId(1), 60)), NodeId(1), 40),
            None
        );
        // The metadata here no newer than the message: nothing to tell it.
        assert_eq!(
            deposed_sender(Some(&placement(NodeId(3), 40)), NodeId(1), 40),
            None
        );
        assert_eq!(
            deposed_sender(Some(&placement(NodeId(3), 30)), NodeId(1), 40),
            None
        );
        // No placement here, or a message without an epoch: no claim.
        assert_eq!(deposed_sender(None, NodeId(1), 40), None);
        assert_eq!(
            deposed_sender(Some(&placement(NodeId(3), 60)), NodeId(1), 0),
            None
        );
    }

    #[test]
    fn a_copy_is_dropped_only_on_metadata_as_new_as_what_it_was_shipped_under() {
        let placement = |primary, secondaries: &[NodeId], epoch| Placement {
            primary,
            secondaries: secondaries.to_vec(),
            epoch,
            redundancy: 1,
            timeout_ms: 60_000,
            syncing: Vec::new(),
            handed_over: false,
        };
        // Node 2 holds a copy of a queue its primary 1 promoted at epoch 10 and shipped under the
        // placement of epoch 40 (the repair that added node 2).
        let dropped = |p: Option<&Placement>, placed_at, applied, caught_up| {
            copy_not_held(p, NodeId(2), 10, placed_at, applied, caught_up)
        };
        let mine = placement(NodeId(1), &[NodeId(2)], 40);
        let other = placement(NodeId(1), &[NodeId(3)], 50);
        // Listed: held, whatever else.
        assert!(!dropped(Some(&mine), 40, 60, true));
        // Metadata applied here only to 30 (before the repair): the placement it shows is older
        // than the one the primary shipped under; the copy stays.
        let before_repair = placement(NodeId(1), &[], 30);
        assert!(!dropped(Some(&before_repair), 40, 30, true));
        assert!(!dropped(None, 40, 39, true));
        // Applied past it, this node taken out (or the queue gone): dropped.
        assert!(dropped(Some(&other), 40, 50, true));
        assert!(dropped(None, 40, 60, true));
        // After a restart (placed_at forgotten), only once the read barrier was applied.
        assert!(!dropped(Some(&before_repair), 0, 30, false));
        assert!(dropped(Some(&other), 0, 55, true));
        // Promoted here: kept for the promotion.
        assert!(!dropped(Some(&placement(NodeId(2), &[], 70)), 40, 70, true));
    }

    #[test]
    fn only_the_primary_of_the_placement_shipped_under_may_replicate() {
        let placement = shipped_placement;
        let at_40 = placement(NodeId(1), 40);
        // The primary of the placement it ships under: never refused.
        assert!(!shipped_by_non_primary(Some(&at_40), NodeId(1), 40, 40));
        assert!(!shipped_by_non_primary(Some(&at_40), NodeId(1), 40, 90));
        // Another member claiming that placement, once the metadata here is applied that far.
        assert!(shipped_by_non_primary(Some(&at_40), NodeId(3), 40, 40));
        // Or claiming a later epoch that never changed this queue (applied past it here).
        assert!(shipped_by_non_primary(Some(&at_40), NodeId(3), 45, 50));
        // The metadata here not applied as far as the claim: it cannot tell.
        assert!(!shipped_by_non_primary(Some(&at_40), NodeId(3), 45, 44));
        // A primary deposed since (the placement here is newer): not refused, fenced
        // (`deposed_sender`).
        assert!(!shipped_by_non_primary(
            Some(&placement(NodeId(3), 60)),
            NodeId(1),
            40,
            60
        ));
        // No placement known here, or a message without an epoch (0): no claim to check.
        assert!(!shipped_by_non_primary(None, NodeId(3), 40, 90));
        assert!(!shipped_by_non_primary(Some(&at_40), NodeId(3), 0, 90));
    }

    #[test]
    fn a_message_shipped_under_a_placement_removed_since_belongs_to_an_ended_queue() {
        let at_40 = shipped_placement(NodeId(1), 40);
        // Placed here: not ended (whoever ships it).
        assert!(!shipped_for_ended_queue(Some(&at_40), 40, 90));
        // No placement, though applied past the epoch it was shipped under: removed since.
        assert!(shipped_for_ended_queue(None, 40, 40));
        assert!(shipped_for_ended_queue(None, 40, 90));
        // Not applied that far here (a queue placed since): cannot tell.
        assert!(!shipped_for_ended_queue(None, 40, 39));
        // A message without an epoch claims nothing.
        assert!(!shipped_for_ended_queue(None, 0, 90));
    }

    fn placed(
        primary: NodeId,
        secondaries: &[NodeId],
        syncing: &[NodeId],
        epoch: u64,
    ) -> Placement {
        Placement {
            primary,
            secondaries: secondaries.to_vec(),
            epoch,
            redundancy: 2,
            timeout_ms: 60_000,
            syncing: syncing.to_vec(),
            handed_over: false,
        }
    }

    #[test]
    fn a_queue_of_the_core_is_shipped_deposed_or_dropped_by_its_placement() {
        use OwnQueueStep::*;
        // This node (1) holds the queue at epoch 10.
        let step = |p: Option<&Placement>, applied| own_queue_step(p, NodeId(1), 10, applied, 0);
        assert_eq!(
            step(Some(&placed(NodeId(1), &[NodeId(2)], &[], 12)), 12),
            Primary
        );
        assert_eq!(
            step(Some(&placed(NodeId(2), &[NodeId(3)], &[], 11)), 11),
            Deposed
        );
        assert_eq!(
            step(Some(&placed(NodeId(2), &[NodeId(3)], &[], 10)), 11),
            Wait
        );
        assert_eq!(
            step(Some(&placed(NodeId(2), &[NodeId(3)], &[], 9)), 11),
            Wait
        );
        // No placement: ended once the metadata is applied past the queue's own placement.
        assert_eq!(step(None, 10), Ended);
        assert_eq!(step(None, 9), Unreplicated);
        // Never placed by the cluster (epoch 0).
        assert_eq!(own_queue_step(None, NodeId(1), 0, 50, 0), Unreplicated);
    }

    #[test]
    fn a_newer_primary_seen_here_deposes_a_queue_the_metadata_here_still_places_here() {
        use OwnQueueStep::*;
        // This node (1) holds the queue at epoch 10; node 2 was seen primary at epoch 20.
        let step = |p: Option<&Placement>, applied| own_queue_step(p, NodeId(1), 10, applied, 20);
        // Cut from the metadata leader: the placement here still makes this node primary.
        assert_eq!(
            step(Some(&placed(NodeId(1), &[NodeId(2)], &[], 12)), 15),
            Deposed
        );
        assert_eq!(step(None, 15), Deposed);
        // Applied past the rival's epoch, the metadata decides: this node primary again...
        assert_eq!(
            step(Some(&placed(NodeId(1), &[NodeId(3)], &[], 25)), 25),
            Primary
        );
        // ...the rival's placement itself, or the queue ended since.
        assert_eq!(
            step(Some(&placed(NodeId(2), &[NodeId(1)], &[NodeId(1)], 20)), 22),
            Deposed
        );
        assert_eq!(step(None, 30), Ended);
        // A rival at an epoch not above this queue's is a stale primary: it changes nothing.
        let stale = |p: Option<&Placement>| own_queue_step(p, NodeId(1), 10, 12, 8);
        assert_eq!(
            stale(Some(&placed(NodeId(1), &[NodeId(2)], &[], 12))),
            Primary
        );
        assert_eq!(stale(None), Ended);
    }

    #[test]
    fn a_hello_placed_here_is_served_only_on_what_this_node_holds_or_knows_to_be_current() {
        use PlacedHereStep::*;
        let here = placed(NodeId(1), &[NodeId(2)], &[], 12);
        // Held here (the queue, or a copy to promote), or placed by this very hello.
        assert_eq!(placed_here_step(&here, 12, None, true, false, false), Serve);
        assert_eq!(placed_here_step(&here, 12, None, false, true, false), Serve);
        // Placed earlier and held nowhere here: confirm the placement first, then serve.
        assert_eq!(
            placed_here_step(&here, 12, None, false, false, false),
            Confirm
        );
        assert_eq!(placed_here_step(&here, 30, None, false, false, true), Serve);
        // A newer primary known here: its node, or a retry when only its epoch is known.
        let rival = |node, epoch| Some((node, epoch));
        assert_eq!(
            placed_here_step(&here, 12, rival(Some(NodeId(2)), 20), true, false, false),
            Elsewhere(Some(NodeId(2)))
        );
        assert_eq!(
            placed_here_step(&here, 12, rival(None, 20), false, false, true),
            Elsewhere(None)
        );
        // A rival the metadata here has reached (or a stale one) changes nothing.
        let later = placed(NodeId(1), &[NodeId(2)], &[], 25);
        assert_eq!(
            placed_here_step(&later, 25, rival(Some(NodeId(2)), 20), true, false, false),
            Serve
        );
        assert_eq!(
            placed_here_step(&here, 12, rival(Some(NodeId(2)), 9), true, false, false),
            Serve
        );
    }

    #[test]
    fn a_copy_is_promoted_only_above_its_epoch_and_dropped_only_when_not_held() {
        use CopyStep::*;
        // Node 2 holds a copy at epoch 10, shipped under the placement of epoch 40.
        let step = |p: Option<&Placement>, applied| copy_step(p, NodeId(2), 10, 40, applied, true);
        assert_eq!(
            step(Some(&placed(NodeId(2), &[NodeId(3)], &[], 70)), 70),
            Promote
        );
        assert_eq!(
            step(Some(&placed(NodeId(1), &[NodeId(2)], &[], 40)), 60),
            Keep
        );
        assert_eq!(
            step(Some(&placed(NodeId(1), &[NodeId(3)], &[], 50)), 50),
            Drop
        );
        assert_eq!(step(None, 39), Keep);
        assert_eq!(step(None, 40), Drop);
    }

    #[test]
    fn a_copy_of_another_queue_of_the_id_is_told_apart_only_by_known_incarnations() {
        assert!(!copy_of_another_queue(7, 7), "the same queue");
        assert!(copy_of_another_queue(7, 9), "the id placed again");
        assert!(
            copy_of_another_queue(0, 9),
            "a copy from before incarnations"
        );
        assert!(
            !copy_of_another_queue(7, 0),
            "a primary that does not say (an older build in the queue's past)"
        );
        assert!(!copy_of_another_queue(0, 0));
    }

    #[test]
    fn only_a_secondary_not_syncing_takes_over_for_a_client() {
        let p = placed(NodeId(1), &[NodeId(2), NodeId(3)], &[NodeId(3)], 40);
        assert!(may_take_over(&p, NodeId(2)));
        assert!(
            !may_take_over(&p, NodeId(3)),
            "syncing: it may lack delivered entries"
        );
        assert!(!may_take_over(&p, NodeId(1)), "the primary itself");
        assert!(!may_take_over(&p, NodeId(4)), "no copy");
    }

    fn step(p: &Placement, regressed: &[NodeId], in_sync: fn(NodeId) -> bool) -> RepairStep {
        let seen = CopiesSeen {
            regressed,
            in_sync: &in_sync,
            unreachable: &|_| false,
            majority_reachable: true,
            draining: &|_| false,
            spread: None,
        };
        repair_step(p, NodeId(1), &seen)
    }

    #[test]
    fn a_repair_takes_out_lost_copies_first_then_reports_synced_ones_then_adds() {
        use RepairStep::*;
        let p = placed(NodeId(1), &[NodeId(2), NodeId(3)], &[NodeId(3)], 20);
        assert_eq!(
            step(&p, &[NodeId(2)], |_| true),
            TakeOut {
                lost: vec![NodeId(2)],
                secondaries: vec![NodeId(3)]
            }
        );
        // A regressed node that is no longer a secondary changes nothing.
        assert_eq!(
            step(&p, &[NodeId(4)], |n| n == NodeId(3)),
            Synced(NodeId(3))
        );
        assert_eq!(step(&p, &[], |_| false), Nothing);
        let short = placed(NodeId(1), &[NodeId(3)], &[], 20);
        assert_eq!(
            step(&short, &[], |_| true),
            Add {
                want: 1,
                exclude: vec![NodeId(3), NodeId(1)]
            }
        );
        let none = Placement {
            redundancy: 0,
            ..placed(NodeId(1), &[], &[], 5)
        };
        assert_eq!(step(&none, &[], |_| true), Nothing);
    }

    #[test]
    fn a_primary_reaching_a_majority_takes_out_the_copies_it_cannot_reach() {
        use RepairStep::*;
        let p = placed(NodeId(1), &[NodeId(2), NodeId(3)], &[], 20);
        let seen = |regressed: &'static [NodeId], majority_reachable| CopiesSeen {
            regressed,
            in_sync: &|_| true,
            unreachable: &|n| n == NodeId(3),
            majority_reachable,
            draining: &|_| false,
            spread: None,
        };
        assert_eq!(
            repair_step(&p, NodeId(1), &seen(&[], true)),
            TakeOutUnreachable {
                unreachable: vec![NodeId(3)],
                secondaries: vec![NodeId(2)]
            }
        );
        // On the minority's side it leaves the queue to the majority (see step_aside).
        assert_eq!(repair_step(&p, NodeId(1), &seen(&[], false)), Nothing);
        // A copy that lost data goes first.
        assert_eq!(
            repair_step(&p, NodeId(1), &seen(&[NodeId(2)], true)),
            TakeOut {
                lost: vec![NodeId(2)],
                secondaries: vec![NodeId(3)]
            }
        );
    }

    #[test]
    fn copies_leave_a_draining_member_once_their_replacements_are_in_sync() {
        use RepairStep::*;
        let (n1, n2, n3, n4) = (NodeId(1), NodeId(2), NodeId(3), NodeId(4));
        let with = |secondaries: &[NodeId], syncing: &[NodeId], redundancy| Placement {
            redundancy,
            ..placed(n1, secondaries, syncing, 20)
        };
        let n2_draining = |n| n == n2;
        // Room in the set: the replacement is added first...
        assert_eq!(
            drain_step(&with(&[n2], &[], 1), n1, &n2_draining),
            Some(Add {
                want: 1,
                exclude: vec![n2, n1]
            })
        );
        // ...and the draining copy leaves once it is in sync, not before.
        assert_eq!(
            drain_step(&with(&[n2, n3], &[n3], 1), n1, &n2_draining),
            None
        );
        let settled = TakeOutDraining {
            draining: vec![n2],
            secondaries: vec![n3],
        };
        assert_eq!(
            drain_step(&with(&[n2, n3], &[], 1), n1, &n2_draining),
            Some(settled.clone())
        );
        // A full set (redundancy 2) makes room first: the draining copy leaves, and the
        // usual repair adds another member.
        assert_eq!(
            drain_step(&with(&[n2, n3], &[], 2), n1, &n2_draining),
            Some(TakeOutDraining {
                draining: vec![n2],
                secondaries: vec![n3],
            })
        );
        let p = with(&[n3], &[], 2);
        assert_eq!(
            drain_step(&p, n1, &n2_draining),
            Some(Add {
                want: 1,
                exclude: vec![n3, n1]
            })
        );
        // Nothing draining: nothing to do.
        assert_eq!(drain_step(&with(&[n3, n4], &[], 2), n1, &|_| false), None);
        // In the whole repair, a synced replacement is reported before the draining copy
        // leaves, and lost copies still go first.
        let seen = |regressed: &'static [NodeId]| CopiesSeen {
            regressed,
            in_sync: &|_| true,
            unreachable: &|_| false,
            majority_reachable: true,
            draining: &|n| n == NodeId(2),
            spread: None,
        };
        assert_eq!(
            repair_step(&with(&[n2, n3], &[n3], 1), n1, &seen(&[])),
            Synced(n3)
        );
        assert_eq!(
            repair_step(&with(&[n2, n3], &[], 1), n1, &seen(&[])),
            settled
        );
        assert_eq!(
            repair_step(&with(&[n2, n3], &[], 1), n1, &seen(&[NodeId(3)])),
            TakeOut {
                lost: vec![n3],
                secondaries: vec![n2]
            }
        );
    }

    #[test]
    fn a_draining_primary_gets_a_copy_to_hand_its_queue_to_even_at_redundancy_0() {
        use RepairStep::*;
        let (n1, n2) = (NodeId(1), NodeId(2));
        let alone = Placement {
            redundancy: 0,
            ..placed(n1, &[], &[], 20)
        };
        assert_eq!(drain_step(&alone, n1, &|_| false), None);
        assert_eq!(
            drain_step(&alone, n1, &|n| n == n1),
            Some(Add {
                want: 1,
                exclude: vec![n1]
            })
        );
        // One copy elsewhere is enough to hand it over.
        let copied = Placement {
            redundancy: 0,
            ..placed(n1, &[n2], &[], 20)
        };
        assert_eq!(drain_step(&copied, n1, &|n| n == n1), None);
    }

    /// Found by `tests/cluster_sim.rs` (seed 134 of the first version with draining): a queue
    /// without redundancy whose primary was drained and then undrained before the handover kept
    /// the copy the drain gave it for ever, and with it a lease that waits on that copy.
    #[test]
    fn a_queue_without_redundancy_sheds_the_copy_a_drain_gave_it() {
        use RepairStep::*;
        let (n1, n2, n3) = (NodeId(1), NodeId(2), NodeId(3));
        let copied = Placement {
            redundancy: 0,
            ..placed(n1, &[n2], &[], 20)
        };
        let (ranked, copies) = ([n2, n3], BTreeMap::from([(n2, 1), (n3, 0)]));
        let (yes, no) = (|_| true, |_| false);
        let seen = |draining: &'static dyn Fn(NodeId) -> bool| CopiesSeen {
            regressed: &[],
            in_sync: &yes,
            unreachable: &no,
            majority_reachable: true,
            draining,
            spread: Some(Spread {
                ranked: &ranked,
                copies: &copies,
                live: &yes,
                may_add: true,
            }),
        };
        // Draining: the copy stays (the queue is handed over to it).
        assert_eq!(
            repair_step(&copied, n1, &seen(&|n| n == NodeId(1))),
            Nothing
        );
        // Undrained: the copy goes.
        assert_eq!(
            repair_step(&copied, n1, &seen(&|_| false)),
            TakeOutSurplus {
                surplus: vec![n2],
                secondaries: vec![]
            }
        );
    }

    /// A model of redirects between members whose metadata applied different prefixes of one
    /// queue's placement history: every member follows the placement it knows, and with the
    /// catch-up rule a member behind the redirect's epoch first applies up to it. From every
    /// combination of views (and every member the client starts at), the client reaches the
    /// queue's primary in at most one redirect per placement; without the rule, some
    /// combination sends it back and forth for ever.
    #[test]
    fn redirects_that_name_their_epoch_converge() {
        // Placements of one queue: (epoch = log index, primary).
        let history = [(3, NodeId(1)), (7, NodeId(2)), (9, NodeId(3))];
        let members = [NodeId(1), NodeId(2), NodeId(3)];
        let placement_at = |applied: u64| history.iter().rev().find(|(e, _)| *e <= applied);
        // Each member's applied index: one of 3, 7, 9 (all know the first placement).
        let views: Vec<[u64; 3]> = (0..27)
            .map(|k| [k % 3, k / 3 % 3, k / 9].map(|i| history[i as usize].0))
            .collect();
        let follow = |views: &[u64; 3], start: usize, catch_up: bool| -> Option<usize> {
            let mut views = *views;
            let (mut at, mut told) = (start, None);
            for hops in 0..10 {
                if catch_up && let Some(index) = redirect_catch_up(told, views[at]) {
                    views[at] = index; // Applied (a member that cannot: `unavailable`).
                }
                let &(epoch, primary) = placement_at(views[at]).unwrap();
                if primary == members[at] {
                    return Some(hops);
                }
                at = members.iter().position(|&m| m == primary).unwrap();
                told = Some(epoch);
            }
            None
        };
        let mut looped_without = false;
        for v in &views {
            for start in 0..3 {
                let hops = follow(v, start, true);
                assert!(
                    hops.is_some_and(|h| h <= history.len()),
                    "views {v:?} from n{}: {hops:?}",
                    start + 1
                );
                looped_without |= follow(v, start, false).is_none();
            }
        }
        assert!(looped_without, "the model shows the loop without the rule");
        // (Whether a member may serve by what it applied is checked apart:
        // `placed_here_step`.)
        assert_eq!(follow(&[9, 9, 9], 0, true), Some(1));
        assert_eq!(redirect_catch_up(None, 5), None);
        assert_eq!(redirect_catch_up(Some(5), 5), None);
        assert_eq!(redirect_catch_up(Some(6), 5), Some(6));
    }

    #[test]
    fn only_a_primary_without_lease_and_majority_sends_its_client_away() {
        assert!(step_aside(true, false, false));
        // A dead copy (the majority is reached): the client stays; the copy is replaced.
        assert!(!step_aside(true, false, true));
        // Cut from most members but still acknowledged by every copy: it still delivers.
        assert!(!step_aside(true, true, false));
        // Without copies there is nowhere else to go.
        assert!(!step_aside(false, false, false));
    }

    #[test]
    fn rendezvous_takes_the_highest_hashes_in_a_stable_order() {
        let c = [(1, 50), (2, 90), (3, 10), (4, 70)].map(|(n, h)| (NodeId(n), h));
        assert_eq!(rendezvous(c, 2), vec![NodeId(2), NodeId(4)]);
        let mut shuffled = c;
        shuffled.reverse();
        assert_eq!(rendezvous(shuffled, 2), vec![NodeId(2), NodeId(4)]);
        assert_eq!(
            rendezvous(c, 9),
            vec![NodeId(2), NodeId(4), NodeId(1), NodeId(3)]
        );
        assert!(rendezvous(c, 0).is_empty());
    }

    fn spread_placement(secondaries: &[NodeId], syncing: &[NodeId], redundancy: u8) -> Placement {
        Placement {
            primary: NodeId(1),
            secondaries: secondaries.to_vec(),
            epoch: 10,
            redundancy,
            timeout_ms: 60_000,
            syncing: syncing.to_vec(),
            handed_over: false,
        }
    }

    #[test]
    fn a_copy_moves_up_its_queue_order_to_a_member_holding_far_fewer() {
        use RepairStep::*;
        let (n1, n2, n3, n4) = (NodeId(1), NodeId(2), NodeId(3), NodeId(4));
        let at = |secondaries: &[NodeId]| spread_placement(secondaries, &[], 1);
        // The queue's order is n4, n2, n3 (n1 is its primary); n4 was just added.
        let ranked = [n4, n2, n3];
        let far = BTreeMap::from([(n2, 10), (n3, 10), (n4, 0)]);
        let close = BTreeMap::from([(n2, 5), (n3, 5), (n4, 3)]);
        let live = |_| true;
        let n4_down = |n| n != n4;
        fn spread<'a>(
            ranked: &'a [NodeId],
            copies: &'a BTreeMap<NodeId, usize>,
            live: &'a dyn Fn(NodeId) -> bool,
            may_add: bool,
        ) -> Spread<'a> {
            Spread {
                ranked,
                copies,
                live,
                may_add,
            }
        }
        let synced = |_| true;
        let step = |p: &Placement, s: &Spread<'_>| spread_step(p, n1, s, &synced);

        // The copy on n2 (or on n3) moves to n4, which holds far fewer: added first.
        let moving = spread(&ranked, &far, &live, true);
        assert_eq!(step(&at(&[n2]), &moving), Some(SpreadTo { to: n4 }));
        assert_eq!(step(&at(&[n3]), &moving), Some(SpreadTo { to: n4 }));
        // Not without this round's budget, nor to a member that is down, nor while the counts
        // are within the slack.
        assert_eq!(step(&at(&[n2]), &spread(&ranked, &far, &live, false)), None);
        assert_eq!(
            step(&at(&[n2]), &spread(&ranked, &far, &n4_down, true)),
            None
        );
        assert_eq!(
            step(&at(&[n2]), &spread(&ranked, &close, &live, true)),
            None
        );
        // A copy never moves down its queue's order, however few the lower member holds.
        let n4_last = [n2, n3, n4];
        assert_eq!(step(&at(&[n2]), &spread(&n4_last, &far, &live, true)), None);
        // The copy on n3 may move up to n2 when n2 holds far fewer.
        let n2_few = BTreeMap::from([(n2, 1), (n3, 10), (n4, 10)]);
        assert_eq!(
            step(&at(&[n3]), &spread(&n4_last, &n2_few, &live, true)),
            Some(SpreadTo { to: n2 })
        );
        // While the new copy syncs nothing more happens; once it is in sync, the copy it
        // replaces (the lowest ranked) goes.
        assert_eq!(step(&spread_placement(&[n2, n4], &[n4], 1), &moving), None);
        assert_eq!(
            step(&at(&[n2, n4]), &moving),
            Some(TakeOutSurplus {
                surplus: vec![n2],
                secondaries: vec![n4]
            })
        );
        let n4_behind = |n| n != n4;
        assert_eq!(spread_step(&at(&[n2, n4]), n1, &moving, &n4_behind), None);
        // A full replica set, a queue without copies, another node's queue: not spread.
        assert_eq!(step(&spread_placement(&[n2, n3], &[], 2), &moving), None);
        assert_eq!(step(&spread_placement(&[], &[], 0), &moving), None);
        assert_eq!(spread_step(&at(&[n2]), n3, &moving, &synced), None);
        // In the whole repair: only while this node reaches a majority and is not draining.
        let (nothing_drains, n1_drains) = (|_| false, |n| n == n1);
        for (majority_reachable, draining, want) in [
            (
                true,
                &nothing_drains as &dyn Fn(NodeId) -> bool,
                SpreadTo { to: n4 },
            ),
            (false, &nothing_drains, Nothing),
            (true, &n1_drains, Nothing),
        ] {
            let seen = CopiesSeen {
                regressed: &[],
                in_sync: &synced,
                unreachable: &|_| false,
                majority_reachable,
                draining,
                spread: Some(spread(&ranked, &far, &live, true)),
            };
            assert_eq!(repair_step(&at(&[n2]), n1, &seen), want);
        }
    }

    /// Sixty queues at redundancy 1 on three members, their copies placed before a fourth
    /// member came: spreading rounds (one move per primary and round, the counts read at the
    /// round's start as a node does) end, no copy ever moves down its queue's order, and the
    /// new member ends with its part of the copies.
    #[test]
    fn spreading_ends_without_moving_a_copy_back_and_fills_a_new_member() {
        let members: Vec<NodeId> = (1..=4).map(NodeId).collect();
        let name = |n: NodeId| format!("n{}", n.0);
        let order = |id: &str, primary: NodeId| -> Vec<NodeId> {
            let candidates = members
                .iter()
                .filter(|&&n| n != primary)
                .map(|&n| (n, rendezvous_key(id, &name(n))));
            rendezvous(candidates, u8::MAX)
        };
        let mut queues: Vec<(String, Placement, Vec<NodeId>)> = (0..60)
            .map(|i| {
                let id = format!("q{i}");
                let primary = members[i % 3];
                let ranked = order(&id, primary);
                // Placed while only n1..n3 were members.
                let first = *ranked.iter().find(|&&n| n != NodeId(4)).unwrap();
                let mut p = spread_placement(&[first], &[], 1);
                p.primary = primary;
                (id, p, ranked)
            })
            .collect();
        let rank = |ranked: &[NodeId], n: NodeId| ranked.iter().position(|&r| r == n).unwrap();
        let live = |_| true;
        let synced = |_| true;
        let mut rounds = 0;
        loop {
            rounds += 1;
            assert!(rounds < 500, "spreading does not end");
            let mut copies: BTreeMap<NodeId, usize> = members.iter().map(|&n| (n, 0)).collect();
            for (_, p, _) in &queues {
                for s in &p.secondaries {
                    *copies.get_mut(s).unwrap() += 1;
                }
            }
            let mut budget: BTreeMap<NodeId, usize> = members
                .iter()
                .map(|&n| (n, SPREAD_MOVES_PER_ROUND))
                .collect();
            let mut changed = false;
            for (_, p, ranked) in queues.iter_mut() {
                // Added last round: in sync now (reported as a repair does).
                p.syncing.clear();
                let best_before = p.secondaries.iter().map(|&n| rank(ranked, n)).min();
                let spread = Spread {
                    ranked,
                    copies: &copies,
                    live: &live,
                    may_add: budget[&p.primary] > 0,
                };
                match spread_step(p, p.primary, &spread, &synced) {
                    Some(RepairStep::SpreadTo { to }) => {
                        *budget.get_mut(&p.primary).unwrap() -= 1;
                        p.secondaries.push(to);
                        p.syncing.push(to);
                        changed = true;
                    }
                    Some(RepairStep::TakeOutSurplus { secondaries, .. }) => {
                        p.secondaries = secondaries;
                        changed = true;
                    }
                    None => {}
                    Some(other) => panic!("{other:?}"),
                }
                let best_after = p.secondaries.iter().map(|&n| rank(ranked, n)).min();
                assert!(
                    best_after <= best_before,
                    "a copy moved down its queue's order"
                );
            }
            if !changed && queues.iter().all(|(_, p, _)| p.syncing.is_empty()) {
                break;
            }
        }
        let mut copies: BTreeMap<NodeId, usize> = BTreeMap::new();
        for (_, p, _) in &queues {
            assert_eq!(p.secondaries.len(), 1, "{p:?}");
            *copies.entry(p.secondaries[0]).or_default() += 1;
        }
        let n4 = copies.get(&NodeId(4)).copied().unwrap_or(0);
        let most = copies.values().copied().max().unwrap();
        assert!(
            n4 + SPREAD_SLACK_COPIES + 1 >= most,
            "the new member holds {n4} copies, the most any holds is {most}: {copies:?}"
        );
    }
}
