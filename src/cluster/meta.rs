//! The cluster-metadata state machine: which node holds each durable queue's primary and
//! secondaries, under which epoch, and which durable ids expired.
//!
//! Plain data, no I/O: [`MetaState::apply`] is a pure function of the state, the command and
//! the index of the consensus log entry that carries it, so every replica that applies the
//! same log reaches the same state (openraft replays the log on restart and on followers).
//!
//! # Invariants
//! * A queue's `epoch` is the log index of the entry that last changed its primary or its
//!   replica set. Log indexes are unique and increasing, so epochs only grow, and two
//!   different primaries of one queue never share an epoch: a deposed primary is fenced by
//!   comparing epochs.
//! * Every state-changing command on an existing queue names the epoch it expects
//!   (compare-and-set); a command built from a stale view is refused with
//!   [`MetaResponse::Stale`] and changes nothing, so a retried command is applied at most once.
//! * A queue's primary never appears among its secondaries; secondaries are distinct.
//! * `expired` holds at most [`EXPIRED_IDS_MAX`] ids (oldest dropped first).

use std::collections::{BTreeMap, BTreeSet, VecDeque};

use serde::{Deserialize, Serialize};

/// A node of the consensus group (openraft's `NodeId`): a stable 64-bit hash of the node's
/// name (see [`raft_id`]).
pub use crate::ids::NodeId;

/// Most redundancy (secondaries per queue) a client may ask for.
pub const REDUNDANCY_MAX: u8 = 2;
/// Most expired durable ids remembered (so a returning client learns `expired`).
pub const EXPIRED_IDS_MAX: usize = 100_000;

/// The raft id of a node name: FNV-1a 64 of its bytes ([`fnv1a`]). Node names are chosen by
/// operators and checked to map to distinct ids when the cluster is configured.
pub fn raft_id(name: &str) -> NodeId {
    NodeId(fnv1a(name))
}

/// FNV-1a 64 of `text`'s bytes: a stable hash, the same on every member and every build.
pub fn fnv1a(text: &str) -> u64 {
    const FNV_OFFSET: u64 = 0xcbf2_9ce4_8422_2325;
    const FNV_PRIME: u64 = 0x0000_0100_0000_01b3;
    let mut h = FNV_OFFSET;
    for b in text.as_bytes() {
        h ^= u64::from(*b);
        h = h.wrapping_mul(FNV_PRIME);
    }
    h
}

/// Where one durable queue lives.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Placement {
    /// The node that appends and delivers.
    pub primary: NodeId,
    /// Nodes holding copies, in promotion order.
    pub secondaries: Vec<NodeId>,
    /// Log index of the entry that last changed `primary` or `secondaries`.
    pub epoch: u64,
    /// Secondaries the client asked for (0 to [`REDUNDANCY_MAX`]).
    pub redundancy: u8,
    /// Durable timeout, in milliseconds.
    pub timeout_ms: u64,
    /// Secondaries added to repair redundancy that have not caught up yet: never promoted
    /// (they may lack entries the primary already delivered).
    #[serde(default)]
    pub syncing: Vec<NodeId>,
    /// Set by a [`MetaCommand::Handover`], cleared by every later change of the epoch: the
    /// primary got the queue from a live primary (rebalancing), not by a failover.
    #[serde(default)]
    pub handed_over: bool,
}

/// The peer protocol version that brought membership changes and draining
/// ([`MetaCommand::SetDraining`], `PeerRequest::ChangeMembers`, `ForwardCursor`, `Regions`).
pub const PEER_VERSION_MEMBERSHIP: u32 = 2;
const _: () = assert!(PEER_VERSION_MEMBERSHIP <= tether_transport::PEER_PROTOCOL_VERSION);

/// A change to the metadata, proposed through consensus.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum MetaCommand {
    /// Places a new queue; if the id is already placed, nothing changes and the current
    /// placement is returned (idempotent).
    Place {
        id: String,
        primary: NodeId,
        secondaries: Vec<NodeId>,
        redundancy: u8,
        timeout_ms: u64,
    },
    /// Makes `new_primary` (a current secondary) the primary; the old primary is dropped
    /// from the replica set.
    Promote {
        id: String,
        expected_epoch: u64,
        new_primary: NodeId,
    },
    /// A planned move (rebalancing, see `server/rebalance.rs`): the live primary hands the
    /// queue, whose client is away, over to `new_primary` (a current secondary, not syncing),
    /// as [`Promote`](Self::Promote) does, and marks the placement
    /// [`handed_over`](Placement::handed_over).
    Handover {
        id: String,
        expected_epoch: u64,
        new_primary: NodeId,
    },
    /// Replaces the secondaries (repairing or shrinking redundancy). Secondaries not in the
    /// current set join as `syncing`.
    SetSecondaries {
        id: String,
        expected_epoch: u64,
        secondaries: Vec<NodeId>,
    },
    /// The primary reports that syncing secondary `node` caught up: it may be promoted.
    /// Leaves the epoch unchanged.
    Synced {
        id: String,
        expected_epoch: u64,
        node: NodeId,
    },
    /// Expires the queue cluster-wide, once: its next client learns `expired`. `owner`: the
    /// principal that owned the queue, if any; the id stays theirs on every member.
    Expire {
        id: String,
        expected_epoch: u64,
        #[serde(default)]
        owner: Option<String>,
    },
    /// Removes the queue without recording an expiry (the client closed it, or it was
    /// dropped): its next client starts a `new` queue.
    Release { id: String, expected_epoch: u64 },
    /// A node is gone: every queue it is primary of is promoted to its first secondary that is
    /// not syncing (queues without such a secondary keep their primary: nothing else holds
    /// them all), and the node is dropped from every replica set.
    NodeFailed { node: NodeId },
    /// Changes nothing. A node that starts commits one, through the leader, to learn that its
    /// applied metadata holds everything committed before (a read barrier): a restarted node
    /// must not serve queues from a view older than what the cluster decided while it was down.
    Barrier,
    /// Marks member `node` draining (or no longer): it is given no new queue and no copy, and
    /// it hands its queues and copies to the other members (`server/rebalance.rs`). Leaves
    /// every placement as it is.
    SetDraining { node: NodeId, draining: bool },
}

/// A metadata command refused before it is proposed ([`MetaCommand::validate`], and
/// [`MetaCommand::places_on_members_only`] on the leader).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum CommandRefused {
    #[error("it gives a queue to a node that is not a member (removed while its metadata lagged?)")]
    NotAMember,
    #[error("redundancy {0} is above the limit of {max}", max = REDUNDANCY_MAX)]
    Redundancy(u8),
    #[error("an owner of {0} bytes (at most {max})", max = crate::limits::PRINCIPAL_BYTES_MAX)]
    OwnerBytes(usize),
    #[error(
        "a durable id of {0} bytes (1 to {max})",
        max = crate::limits::DURABLE_ID_BYTES_MAX
    )]
    DurableIdBytes(usize),
    #[error("{0} secondaries (at most {max})", max = REDUNDANCY_MAX)]
    Secondaries(usize),
}

impl MetaCommand {
    /// The oldest peer protocol version that has this command: a member speaking an older one
    /// cannot read it (in a forwarded write or in the consensus log).
    pub fn version_needed(&self) -> u32 {
        match self {
            MetaCommand::SetDraining { .. } => PEER_VERSION_MEMBERSHIP,
            _ => 1,
        }
    }

    /// Whether every node the command gives a queue to (a primary or a copy: `Place`,
    /// `Promote`, `Handover`, `SetSecondaries`) is a member (`is_member`). A member removed
    /// while its metadata lagged (it never applied its draining mark) still places queues on
    /// itself on its stale view, and its writes, forwarded to the leader, would commit: a
    /// queue placed there is on a node the failure detector no longer watches, for good.
    /// The leader refuses such a write, its own ([`Cluster::write`](super::Cluster::write))
    /// or forwarded (`network.rs`).
    pub fn places_on_members_only(&self, is_member: impl Fn(NodeId) -> bool) -> bool {
        match self {
            MetaCommand::Place {
                primary,
                secondaries,
                ..
            } => is_member(*primary) && secondaries.iter().all(|&n| is_member(n)),
            MetaCommand::SetSecondaries { secondaries, .. } => {
                secondaries.iter().all(|&n| is_member(n))
            }
            MetaCommand::Promote { new_primary, .. }
            | MetaCommand::Handover { new_primary, .. } => is_member(*new_primary),
            MetaCommand::Synced { .. }
            | MetaCommand::Expire { .. }
            | MetaCommand::Release { .. }
            | MetaCommand::NodeFailed { .. }
            | MetaCommand::Barrier
            | MetaCommand::SetDraining { .. } => true,
        }
    }

    /// Checks the command's sizes before it is proposed: a durable id of 1 to
    /// [`DURABLE_ID_BYTES_MAX`](crate::limits::DURABLE_ID_BYTES_MAX) bytes, at most
    /// [`REDUNDANCY_MAX`] secondaries. Every command in the log is then small.
    pub fn validate(&self) -> Result<(), CommandRefused> {
        use crate::limits::DURABLE_ID_BYTES_MAX;
        let (id, secondaries) = match self {
            MetaCommand::Place {
                id,
                secondaries,
                redundancy,
                ..
            } => {
                if *redundancy > REDUNDANCY_MAX {
                    return Err(CommandRefused::Redundancy(*redundancy));
                }
                (id, secondaries.len())
            }
            MetaCommand::SetSecondaries {
                id, secondaries, ..
            } => (id, secondaries.len()),
            MetaCommand::Promote { id, .. }
            | MetaCommand::Handover { id, .. }
            | MetaCommand::Synced { id, .. }
            | MetaCommand::Expire { id, .. }
            | MetaCommand::Release { id, .. } => (id, 0),
            MetaCommand::NodeFailed { .. }
            | MetaCommand::Barrier
            | MetaCommand::SetDraining { .. } => return Ok(()),
        };
        if let MetaCommand::Expire {
            owner: Some(owner), ..
        } = self
            && owner.len() > crate::limits::PRINCIPAL_BYTES_MAX
        {
            return Err(CommandRefused::OwnerBytes(owner.len()));
        }
        if id.is_empty() || id.len() > DURABLE_ID_BYTES_MAX {
            return Err(CommandRefused::DurableIdBytes(id.len()));
        }
        if secondaries > usize::from(REDUNDANCY_MAX) {
            return Err(CommandRefused::Secondaries(secondaries));
        }
        Ok(())
    }
}

/// The result of applying one [`MetaCommand`] (openraft's `R`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, Default)]
pub enum MetaResponse {
    /// The queue's placement after the command.
    Placed(Placement),
    /// The command named an epoch that is no longer current (or an invalid target); the
    /// current placement, if any, is returned and nothing changed.
    Stale(Option<Placement>),
    /// The queue was expired by this command.
    Expired,
    /// The queue was released by this command.
    Released,
    /// The queue does not exist (never placed, or expired earlier).
    Unknown { expired: bool },
    /// Count of queues changed by `NodeFailed`.
    Changed(u64),
    /// The members draining after a `SetDraining`.
    Draining(BTreeSet<NodeId>),
    /// A membership that left members out: the queues that changed as they were forgotten
    /// ([`MetaState::forget_members`]).
    Forgot(u64),
    /// Response to entries without a command (blank and membership entries).
    #[default]
    None,
}

/// The whole metadata: the state machine's state.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct MetaState {
    pub queues: BTreeMap<String, Placement>,
    /// Expired ids, oldest first, bounded by [`EXPIRED_IDS_MAX`].
    pub expired: VecDeque<String>,
    /// The owner (principal) of each id in `expired` whose queue had one.
    #[serde(default)]
    pub expired_owners: BTreeMap<String, String>,
    /// Members being drained (`tether cluster drain`): no new queue or copy goes to them, and
    /// they hand theirs over.
    #[serde(default)]
    pub draining: BTreeSet<NodeId>,
}

fn valid_replicas(primary: NodeId, secondaries: &[NodeId]) -> bool {
    !secondaries.contains(&primary)
        && secondaries
            .iter()
            .enumerate()
            .all(|(i, s)| !secondaries[..i].contains(s))
        && secondaries.len() <= usize::from(REDUNDANCY_MAX)
}

impl MetaState {
    /// The oldest peer protocol version that reads all of this state: a member draining is
    /// [`PEER_VERSION_MEMBERSHIP`]'s (an older build would decode the state without it).
    pub fn version_needed(&self) -> u32 {
        if self.draining.is_empty() {
            1
        } else {
            PEER_VERSION_MEMBERSHIP
        }
    }

    /// Applies `cmd`, carried by the log entry at `index`.
    pub fn apply(&mut self, index: u64, cmd: &MetaCommand) -> MetaResponse {
        match cmd {
            MetaCommand::Place {
                id,
                primary,
                secondaries,
                redundancy,
                timeout_ms,
            } => {
                if let Some(p) = self.queues.get(id) {
                    return MetaResponse::Placed(p.clone());
                }
                if !valid_replicas(*primary, secondaries) || *redundancy > REDUNDANCY_MAX {
                    return MetaResponse::Stale(None);
                }
                self.expired.retain(|e| e != id);
                self.expired_owners.remove(id);
                let p = Placement {
                    primary: *primary,
                    secondaries: secondaries.clone(),
                    epoch: index,
                    redundancy: *redundancy,
                    timeout_ms: *timeout_ms,
                    syncing: Vec::new(),
                    handed_over: false,
                };
                self.queues.insert(id.clone(), p.clone());
                MetaResponse::Placed(p)
            }
            MetaCommand::Promote {
                id,
                expected_epoch,
                new_primary,
            }
            | MetaCommand::Handover {
                id,
                expected_epoch,
                new_primary,
            } => {
                let Some(p) = self.queues.get_mut(id) else {
                    return self.unknown(id);
                };
                if p.epoch != *expected_epoch
                    || !p.secondaries.contains(new_primary)
                    || p.syncing.contains(new_primary)
                {
                    return MetaResponse::Stale(Some(p.clone()));
                }
                p.secondaries.retain(|s| s != new_primary);
                p.primary = *new_primary;
                p.epoch = index;
                p.handed_over = matches!(cmd, MetaCommand::Handover { .. });
                MetaResponse::Placed(p.clone())
            }
            MetaCommand::SetSecondaries {
                id,
                expected_epoch,
                secondaries,
            } => {
                let Some(p) = self.queues.get_mut(id) else {
                    return self.unknown(id);
                };
                if p.epoch != *expected_epoch || !valid_replicas(p.primary, secondaries) {
                    return MetaResponse::Stale(Some(p.clone()));
                }
                let old = std::mem::replace(&mut p.secondaries, secondaries.clone());
                p.syncing.retain(|s| secondaries.contains(s));
                for s in secondaries {
                    if !old.contains(s) && !p.syncing.contains(s) {
                        p.syncing.push(*s);
                    }
                }
                p.epoch = index;
                p.handed_over = false;
                MetaResponse::Placed(p.clone())
            }
            MetaCommand::Synced {
                id,
                expected_epoch,
                node,
            } => {
                let Some(p) = self.queues.get_mut(id) else {
                    return self.unknown(id);
                };
                if p.epoch != *expected_epoch {
                    return MetaResponse::Stale(Some(p.clone()));
                }
                p.syncing.retain(|s| s != node);
                MetaResponse::Placed(p.clone())
            }
            MetaCommand::Expire {
                id, expected_epoch, ..
            }
            | MetaCommand::Release { id, expected_epoch } => {
                let Some(p) = self.queues.get(id) else {
                    return self.unknown(id);
                };
                if p.epoch != *expected_epoch {
                    return MetaResponse::Stale(Some(p.clone()));
                }
                self.queues.remove(id);
                if matches!(cmd, MetaCommand::Release { .. }) {
                    return MetaResponse::Released;
                }
                self.expired.push_back(id.clone());
                if let MetaCommand::Expire {
                    owner: Some(owner), ..
                } = cmd
                {
                    self.expired_owners.insert(id.clone(), owner.clone());
                }
                while self.expired.len() > EXPIRED_IDS_MAX {
                    if let Some(old) = self.expired.pop_front() {
                        self.expired_owners.remove(&old);
                    }
                }
                MetaResponse::Expired
            }
            MetaCommand::NodeFailed { node } => {
                let mut changed = 0u64;
                for p in self.queues.values_mut() {
                    let before = (p.primary, p.secondaries.len());
                    if p.primary == *node
                        && let Some(i) = p.secondaries.iter().position(|s| !p.syncing.contains(s))
                    {
                        p.primary = p.secondaries.remove(i);
                    }
                    p.secondaries.retain(|s| s != node);
                    p.syncing.retain(|s| s != node);
                    if (p.primary, p.secondaries.len()) != before {
                        p.epoch = index;
                        p.handed_over = false;
                        changed += 1;
                    }
                }
                MetaResponse::Changed(changed)
            }
            MetaCommand::Barrier => MetaResponse::None,
            MetaCommand::SetDraining { node, draining } => {
                match draining {
                    true => self.draining.insert(*node),
                    false => self.draining.remove(node),
                };
                MetaResponse::Draining(self.draining.clone())
            }
        }
    }

    /// Forgets members that left the group (a membership entry at `index` without them): each
    /// is dropped from every replica set and from the draining set, and a queue it was primary
    /// of is promoted as for [`MetaCommand::NodeFailed`] (a member is removed only once it is
    /// primary of nothing, so that is a race's fallback). Returns how many queues changed.
    pub fn forget_members(&mut self, index: u64, gone: &[NodeId]) -> MetaResponse {
        if gone.is_empty() {
            return MetaResponse::None;
        }
        let mut changed = 0;
        for node in gone {
            self.draining.remove(node);
            if let MetaResponse::Changed(n) =
                self.apply(index, &MetaCommand::NodeFailed { node: *node })
            {
                changed += n;
            }
        }
        MetaResponse::Forgot(changed)
    }

    /// How many queues member `node` is primary of, and how many copies it holds.
    pub fn held_by(&self, node: NodeId) -> (u64, u64) {
        self.queues.values().fold((0, 0), |(primaries, copies), p| {
            (
                primaries + u64::from(p.primary == node),
                copies + u64::from(p.secondaries.contains(&node)),
            )
        })
    }

    fn unknown(&self, id: &str) -> MetaResponse {
        MetaResponse::Unknown {
            expired: self.expired.iter().any(|e| e == id),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn place(id: &str, primary: NodeId, secondaries: &[NodeId]) -> MetaCommand {
        MetaCommand::Place {
            id: id.into(),
            primary,
            secondaries: secondaries.to_vec(),
            redundancy: secondaries.len() as u8,
            timeout_ms: 60_000,
        }
    }

    #[test]
    fn a_command_giving_a_queue_to_a_non_member_is_told() {
        let (n1, n2, gone) = (NodeId(1), NodeId(2), NodeId(9));
        let member = |n: NodeId| n != gone;
        assert!(place("q", n1, &[n2]).places_on_members_only(member));
        assert!(!place("q", gone, &[n2]).places_on_members_only(member));
        assert!(!place("q", n1, &[gone]).places_on_members_only(member));
        let promote = |new_primary| MetaCommand::Promote {
            id: "q".into(),
            expected_epoch: 3,
            new_primary,
        };
        assert!(promote(n2).places_on_members_only(member));
        assert!(!promote(gone).places_on_members_only(member));
        let set = MetaCommand::SetSecondaries {
            id: "q".into(),
            expected_epoch: 3,
            secondaries: vec![n2, gone],
        };
        assert!(!set.places_on_members_only(member));
        let failed = MetaCommand::NodeFailed { node: gone };
        assert!(
            failed.places_on_members_only(member),
            "forgetting one is no placement"
        );
    }

    #[test]
    fn oversized_commands_are_refused_before_they_are_proposed() {
        assert_eq!(
            place("q", NodeId(1), &[NodeId(2), NodeId(3)]).validate(),
            Ok(())
        );
        let long = "x".repeat(crate::limits::DURABLE_ID_BYTES_MAX + 1);
        assert!(
            place(&long, NodeId(1), &[])
                .validate()
                .unwrap_err()
                .to_string()
                .contains("durable id")
        );
        assert!(place("", NodeId(1), &[]).validate().is_err());
        assert!(
            place("q", NodeId(1), &[NodeId(2), NodeId(3), NodeId(4)])
                .validate()
                .unwrap_err()
                .to_string()
                .contains("redundancy")
        );
        let set = MetaCommand::SetSecondaries {
            id: "q".into(),
            expected_epoch: 1,
            secondaries: vec![NodeId(2), NodeId(3), NodeId(4)],
        };
        assert!(
            set.validate()
                .unwrap_err()
                .to_string()
                .contains("secondaries")
        );
        let release = MetaCommand::Release {
            id: long,
            expected_epoch: 1,
        };
        assert!(release.validate().is_err());
        assert_eq!(
            MetaCommand::NodeFailed { node: NodeId(3) }.validate(),
            Ok(())
        );
    }

    #[test]
    fn a_removed_member_is_forgotten_by_every_placement() {
        let (n1, n2, n3) = (NodeId(1), NodeId(2), NodeId(3));
        let mut s = MetaState::default();
        s.apply(1, &place("copy-on-3", n1, &[n3]));
        s.apply(2, &place("copies-on-2-3", n1, &[n2, n3]));
        s.apply(3, &place("primary-3", n3, &[n2]));
        s.apply(4, &place("untouched", n1, &[n2]));
        s.apply(
            5,
            &MetaCommand::SetDraining {
                node: n3,
                draining: true,
            },
        );
        assert_eq!(s.forget_members(6, &[]), MetaResponse::None);
        assert_eq!(s.forget_members(7, &[n3]), MetaResponse::Forgot(3));
        assert_eq!(s.held_by(n3), (0, 0));
        assert!(s.draining.is_empty());
        let p = |id: &str| s.queues[id].clone();
        assert_eq!(
            (p("copy-on-3").secondaries, p("copy-on-3").epoch),
            (vec![], 7)
        );
        assert_eq!(p("copies-on-2-3").secondaries, vec![n2]);
        // The race's fallback: a queue it was still primary of goes to its copy.
        assert_eq!(
            (p("primary-3").primary, p("primary-3").secondaries),
            (n2, vec![])
        );
        assert_eq!(p("untouched").epoch, 4);
    }

    #[test]
    fn barrier_changes_nothing() {
        let mut s = MetaState::default();
        s.apply(1, &place("q", NodeId(1), &[NodeId(2)]));
        let before = s.clone();
        assert_eq!(s.apply(2, &MetaCommand::Barrier), MetaResponse::None);
        assert_eq!(s, before);
    }

    #[test]
    fn draining_is_a_set_of_members_and_leaves_placements_alone() {
        let mut s = MetaState::default();
        s.apply(1, &place("q", NodeId(1), &[NodeId(2)]));
        let before = s.queues.clone();
        assert_eq!(
            (
                s.held_by(NodeId(1)),
                s.held_by(NodeId(2)),
                s.held_by(NodeId(3))
            ),
            ((1, 0), (0, 1), (0, 0))
        );
        let drain = |node, draining| MetaCommand::SetDraining { node, draining };
        assert_eq!(drain(NodeId(1), true).validate(), Ok(()));
        assert_eq!(
            s.apply(2, &drain(NodeId(1), true)),
            MetaResponse::Draining([NodeId(1)].into())
        );
        // Idempotent; a member not draining undrained changes nothing.
        s.apply(3, &drain(NodeId(1), true));
        s.apply(4, &drain(NodeId(3), false));
        assert_eq!(s.draining, [NodeId(1)].into());
        assert_eq!(s.queues, before);
        assert_eq!(
            s.apply(5, &drain(NodeId(1), false)),
            MetaResponse::Draining(BTreeSet::new())
        );
        // A snapshot written before draining existed reads as no member draining.
        #[derive(Serialize)]
        struct Before {
            queues: BTreeMap<String, Placement>,
            expired: VecDeque<String>,
            expired_owners: BTreeMap<String, String>,
        }
        let old = Before {
            queues: before,
            expired: VecDeque::new(),
            expired_owners: BTreeMap::new(),
        };
        let bytes = tether_transport::codec::encode_body(&old).unwrap();
        let read: MetaState = tether_transport::codec::decode_body(&bytes).unwrap();
        assert_eq!((read.queues, read.draining), (old.queues, BTreeSet::new()));
    }

    #[test]
    fn place_is_idempotent_and_epoch_is_the_log_index() {
        let mut s = MetaState::default();
        let MetaResponse::Placed(p) = s.apply(5, &place("q", NodeId(1), &[NodeId(2), NodeId(3)]))
        else {
            panic!()
        };
        assert_eq!(p.epoch, 5);
        assert_eq!(
            s.apply(9, &place("q", NodeId(2), &[])),
            MetaResponse::Placed(p)
        );
    }

    #[test]
    fn promote_is_compare_and_set_on_the_epoch() {
        let mut s = MetaState::default();
        s.apply(5, &place("q", NodeId(1), &[NodeId(2), NodeId(3)]));
        let promote = |epoch, node| MetaCommand::Promote {
            id: "q".into(),
            expected_epoch: epoch,
            new_primary: node,
        };
        let MetaResponse::Placed(p) = s.apply(7, &promote(5, NodeId(3))) else {
            panic!()
        };
        assert_eq!(
            (p.primary, p.secondaries.clone(), p.epoch),
            (NodeId(3), vec![NodeId(2)], 7)
        );
        assert!(!p.handed_over);
        // The same command again (a retry) is stale and changes nothing.
        assert_eq!(
            s.apply(8, &promote(5, NodeId(3))),
            MetaResponse::Stale(Some(p.clone()))
        );
        // Only a secondary can be promoted.
        assert!(matches!(
            s.apply(9, &promote(7, NodeId(1))),
            MetaResponse::Stale(_)
        ));
    }

    #[test]
    fn a_handover_moves_the_primary_and_is_marked_until_the_next_change() {
        let mut s = MetaState::default();
        s.apply(5, &place("q", NodeId(1), &[NodeId(2), NodeId(3)]));
        s.apply(
            6,
            &MetaCommand::SetSecondaries {
                id: "q".into(),
                expected_epoch: 5,
                secondaries: vec![NodeId(2), NodeId(3)],
            },
        );
        let handover = |epoch, node| MetaCommand::Handover {
            id: "q".into(),
            expected_epoch: epoch,
            new_primary: node,
        };
        // Compare-and-set as a promotion.
        assert!(matches!(
            s.apply(7, &handover(5, NodeId(2))),
            MetaResponse::Stale(_)
        ));
        let MetaResponse::Placed(p) = s.apply(8, &handover(6, NodeId(2))) else {
            panic!()
        };
        assert_eq!(
            (p.primary, p.secondaries.clone(), p.epoch, p.handed_over),
            (NodeId(2), vec![NodeId(3)], 8, true)
        );
        // A syncing secondary is not a target.
        s.apply(
            9,
            &MetaCommand::SetSecondaries {
                id: "q".into(),
                expected_epoch: 8,
                secondaries: vec![NodeId(3), NodeId(1)],
            },
        );
        assert!(!s.queues["q"].handed_over);
        assert!(matches!(
            s.apply(10, &handover(9, NodeId(1))),
            MetaResponse::Stale(_)
        ));
        let MetaResponse::Placed(p) = s.apply(11, &handover(9, NodeId(3))) else {
            panic!()
        };
        assert_eq!((p.primary, p.handed_over), (NodeId(3), true));
        s.apply(12, &MetaCommand::NodeFailed { node: NodeId(1) });
        assert_eq!(
            (s.queues["q"].epoch, s.queues["q"].handed_over),
            (12, false)
        );
    }

    #[test]
    fn node_failed_promotes_first_secondary_and_drops_the_node() {
        let mut s = MetaState::default();
        s.apply(1, &place("a", NodeId(1), &[NodeId(2)]));
        s.apply(2, &place("b", NodeId(2), &[NodeId(1), NodeId(3)]));
        s.apply(3, &place("c", NodeId(1), &[]));
        s.apply(4, &place("d", NodeId(3), &[NodeId(2)]));
        assert_eq!(
            s.apply(10, &MetaCommand::NodeFailed { node: NodeId(1) }),
            MetaResponse::Changed(2)
        );
        assert_eq!(
            (s.queues["a"].primary, s.queues["a"].epoch),
            (NodeId(2), 10)
        );
        assert_eq!(s.queues["b"].secondaries, vec![NodeId(3)]);
        // Nothing else holds "c": it stays where it is, waiting for node 1.
        assert_eq!((s.queues["c"].primary, s.queues["c"].epoch), (NodeId(1), 3));
        assert_eq!(s.queues["d"].epoch, 4);
    }

    #[test]
    fn repaired_secondaries_are_promoted_only_once_synced() {
        let mut s = MetaState::default();
        s.apply(1, &place("q", NodeId(1), &[NodeId(2)]));
        let MetaResponse::Placed(p) = s.apply(
            2,
            &MetaCommand::SetSecondaries {
                id: "q".into(),
                expected_epoch: 1,
                secondaries: vec![NodeId(3), NodeId(2)],
            },
        ) else {
            panic!()
        };
        assert_eq!((p.syncing.clone(), p.epoch), (vec![NodeId(3)], 2));
        // Node 2 fails: 3 is not synced, so 1 stays primary.
        s.apply(3, &MetaCommand::NodeFailed { node: NodeId(2) });
        assert_eq!(
            (s.queues["q"].primary, s.queues["q"].secondaries.clone()),
            (NodeId(1), vec![NodeId(3)])
        );
        let epoch = s.queues["q"].epoch;
        let synced = MetaCommand::Synced {
            id: "q".into(),
            expected_epoch: epoch,
            node: NodeId(3),
        };
        assert!(
            matches!(s.apply(4, &synced), MetaResponse::Placed(p) if p.syncing.is_empty() && p.epoch == epoch)
        );
        s.apply(5, &MetaCommand::NodeFailed { node: NodeId(1) });
        assert_eq!((s.queues["q"].primary, s.queues["q"].epoch), (NodeId(3), 5));
    }

    #[test]
    fn expire_once_and_remember() {
        let mut s = MetaState::default();
        s.apply(1, &place("q", NodeId(1), &[]));
        let expire = MetaCommand::Expire {
            id: "q".into(),
            expected_epoch: 1,
            owner: Some("alice".into()),
        };
        assert_eq!(s.apply(2, &expire), MetaResponse::Expired);
        assert_eq!(s.expired_owners.get("q").map(String::as_str), Some("alice"));
        assert_eq!(s.apply(3, &expire), MetaResponse::Unknown { expired: true });
        s.apply(4, &place("q", NodeId(2), &[]));
        assert!(s.expired.is_empty() && s.expired_owners.is_empty());
        let release = MetaCommand::Release {
            id: "q".into(),
            expected_epoch: 4,
        };
        assert_eq!(s.apply(5, &release), MetaResponse::Released);
        assert!(s.queues.is_empty() && s.expired.is_empty());
    }

    #[test]
    fn the_oldest_expired_id_goes_with_its_owner() {
        let mut s = MetaState::default();
        let expire = |s: &mut MetaState, id: &str, index: u64, owner: Option<&str>| {
            s.apply(index, &place(id, NodeId(1), &[]));
            let cmd = MetaCommand::Expire {
                id: id.into(),
                expected_epoch: index,
                owner: owner.map(str::to_string),
            };
            assert_eq!(s.apply(index + 1, &cmd), MetaResponse::Expired);
        };
        expire(&mut s, "q0", 1, Some("alice"));
        // Fill the list without owners (directly: placing each would take long).
        s.expired
            .extend((1..EXPIRED_IDS_MAX).map(|i| format!("filler-{i}")));
        expire(&mut s, "last", 3, None);
        assert_eq!(s.expired.len(), EXPIRED_IDS_MAX);
        assert_eq!(s.expired.front().map(String::as_str), Some("filler-1"));
        assert!(s.expired_owners.is_empty(), "q0's owner outlived its id");
    }

    #[test]
    fn an_owner_past_the_limit_is_refused_before_proposal() {
        let expire = |len: usize| MetaCommand::Expire {
            id: "q".into(),
            expected_epoch: 1,
            owner: Some("a".repeat(len)),
        };
        assert!(
            expire(crate::limits::PRINCIPAL_BYTES_MAX)
                .validate()
                .is_ok()
        );
        assert!(
            expire(crate::limits::PRINCIPAL_BYTES_MAX + 1)
                .validate()
                .is_err()
        );
    }

    #[test]
    fn invalid_replica_sets_are_refused() {
        let mut s = MetaState::default();
        assert_eq!(
            s.apply(1, &place("q", NodeId(1), &[NodeId(1)])),
            MetaResponse::Stale(None)
        );
        assert_eq!(
            s.apply(1, &place("q", NodeId(1), &[NodeId(2), NodeId(2)])),
            MetaResponse::Stale(None)
        );
        assert_eq!(
            s.apply(
                1,
                &place("q", NodeId(1), &[NodeId(2), NodeId(3), NodeId(4)])
            ),
            MetaResponse::Stale(None)
        );
    }

    #[test]
    fn raft_ids_are_stable() {
        assert_eq!(raft_id("n1"), raft_id("n1"));
        assert_ne!(raft_id("n1"), raft_id("n2"));
    }
}
