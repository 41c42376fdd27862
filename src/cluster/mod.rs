//! The cluster: nodes that share durable queues' metadata through consensus.
//!
//! * [`meta`] — the metadata state machine (queue placements, epochs, expired ids): plain data.
//! * `store` — openraft's log storage and state machine over RocksDB ([`tether_storage::RaftLogDb`]).
//! * [`network`] — openraft RPCs and forwarded writes over QUIC with mutual TLS.
//!
//! Every node of a new cluster is configured with the same `--peer` list, and the node with
//! the smallest raft id initializes the group once (openraft's recommended bootstrap: one
//! node, all voters). A restarted node resumes from its data directory. From then on the
//! members are the group's membership ([`Cluster::members`]): `tether cluster add-node` and
//! `remove-node` change it ([`Cluster::add_member`], [`Cluster::remove_member`]), and the
//! metadata forgets a removed member in the same step ([`meta::MetaState::forget_members`]).
//! A node started with `join` never initializes a group: it waits to be added.

pub mod meta;
pub mod network;
mod store;

use crate::bug::LockExt;
use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::sync::{Arc, RwLock};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use tether_storage::RaftLogDb;

use meta::{MetaCommand, MetaResponse, MetaState, NodeId, Placement, raft_id};
use network::{PeerNetwork, PeerPool, PeerRequest, PeerResponse};
use store::{Applied, LogStore, StateMachine};

/// Raft heartbeat interval, in milliseconds.
pub const HEARTBEAT_INTERVAL_MS: u64 = 150;
// A heartbeat times out after one interval, so peers must answer well within it: the round
// trip the peer connections assume before measuring one stays a fraction of it.
const _: () = assert!(3 * tether_transport::tls::PEER_INITIAL_RTT_MS <= HEARTBEAT_INTERVAL_MS);
/// Shortest election timeout, in milliseconds (a follower that hears no leader this long
/// may start an election).
pub const ELECTION_TIMEOUT_MIN_MS: u64 = 750;
/// Longest election timeout, in milliseconds.
pub const ELECTION_TIMEOUT_MAX_MS: u64 = 1_500;
/// Deadline of one snapshot chunk, in milliseconds.
pub const INSTALL_SNAPSHOT_TIMEOUT_MS: u64 = 2_000;
/// A snapshot of the metadata is taken every this many log entries.
pub const SNAPSHOT_EVERY_LOG_ENTRIES: u64 = 5_000;
/// Most nodes in a cluster.
pub const CLUSTER_NODES_MAX: usize = 64;
/// Pause between attempts of a metadata write while no leader is known, in milliseconds.
pub const WRITE_RETRY_MS: u64 = 50;

/// A cluster member as recorded in the consensus membership.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PeerNode {
    /// The node's name (its `--node-id`).
    pub name: String,
    /// Its QUIC address (clients and peers).
    pub addr: String,
}

impl std::fmt::Display for PeerNode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}@{}", self.name, self.addr)
    }
}

openraft::declare_raft_types!(
    /// openraft's type configuration for Tether's metadata group.
    pub TypeConfig:
        D = MetaCommand,
        R = MetaResponse,
        NodeId = NodeId,
        Node = PeerNode,
        SnapshotData = std::io::Cursor<Vec<u8>>,
);

/// The metadata consensus group handle.
pub type Raft = openraft::Raft<TypeConfig>;

/// Why a cluster operation failed.
#[derive(Debug, thiserror::Error)]
pub enum ClusterError {
    #[error("cluster configuration: {0}")]
    Config(String),
    #[error("cluster storage: {0}")]
    Storage(#[from] tether_storage::StorageError),
    #[error("cluster storage: corrupt metadata snapshot: {0}")]
    CorruptSnapshot(#[from] tether_transport::codec::CodecError),
    #[error("metadata command refused: {0}")]
    Refused(#[from] meta::CommandRefused),
    #[error("no metadata leader reachable within {0} ms")]
    NoLeader(u64),
    /// The leader answered a forwarded command with a refusal (its reason).
    #[error("the metadata leader answered: {0}")]
    LeaderRefused(String),
    #[error("membership change refused: {0}")]
    Membership(String),
    #[error("consensus stopped: {0}")]
    Fatal(String),
}

/// A node's view of the cluster's members, validated.
#[derive(Clone, Debug)]
pub struct Members {
    /// Every member including this node, by raft id: the voters and the learners (members
    /// being added, until they caught up with the log).
    pub nodes: BTreeMap<NodeId, PeerNode>,
    /// The members that vote, and so count towards a majority: a learner does not (during a
    /// joint change, the voters of both configurations).
    pub voters: BTreeSet<NodeId>,
}

impl Members {
    /// The raft id of the member named `name`, if it is one.
    pub fn id_of(&self, name: &str) -> Option<NodeId> {
        let id = raft_id(name);
        self.nodes.get(&id).filter(|n| n.name == name).map(|_| id)
    }

    /// The name of member `id` (its raft id in decimal if it is not a configured member).
    pub fn name(&self, id: NodeId) -> String {
        self.nodes
            .get(&id)
            .map_or_else(|| id.to_string(), |n| n.name.clone())
    }

    /// The members of `membership` (voters and learners), with the addresses of `configured`
    /// where it names the same node (a configured address wins, so moving a node to a new
    /// address is a configuration change); `configured` itself while the membership is empty
    /// (a group not initialized yet).
    pub fn effective(
        membership: &openraft::Membership<NodeId, PeerNode>,
        configured: &Members,
    ) -> Arc<Members> {
        let mut nodes: BTreeMap<NodeId, PeerNode> =
            membership.nodes().map(|(id, n)| (*id, n.clone())).collect();
        if nodes.is_empty() {
            return Arc::new(configured.clone());
        }
        for (id, n) in nodes.iter_mut() {
            if let Some(c) = configured.nodes.get(id).filter(|c| c.name == n.name) {
                n.addr.clone_from(&c.addr);
            }
        }
        let voters = membership.voter_ids().collect();
        Arc::new(Members { nodes, voters })
    }

    /// Builds the member list from this node's name and address and its `--peer` list
    /// (which may include the node itself). Refuses duplicate names, names whose raft ids
    /// collide, and more than [`CLUSTER_NODES_MAX`] nodes.
    pub fn new(me: &str, my_addr: &str, peers: &[(String, String)]) -> Result<Self, ClusterError> {
        let mut nodes = BTreeMap::new();
        let mut names = BTreeSet::new();
        nodes.insert(
            raft_id(me),
            PeerNode {
                name: me.to_string(),
                addr: my_addr.to_string(),
            },
        );
        names.insert(me.to_string());
        for (name, addr) in peers {
            if name == me {
                continue;
            }
            if !names.insert(name.clone()) {
                return Err(ClusterError::Config(format!("peer {name} listed twice")));
            }
            let id = raft_id(name);
            if nodes.contains_key(&id) {
                return Err(ClusterError::Config(format!(
                    "node names {name} and {} hash to the same id; rename one",
                    nodes[&id].name
                )));
            }
            nodes.insert(
                id,
                PeerNode {
                    name: name.clone(),
                    addr: addr.clone(),
                },
            );
        }
        if nodes.len() > CLUSTER_NODES_MAX {
            return Err(ClusterError::Config(format!(
                "{} nodes; at most {CLUSTER_NODES_MAX}",
                nodes.len()
            )));
        }
        // Every configured member votes once the group is initialized with them.
        let voters = nodes.keys().copied().collect();
        Ok(Members { nodes, voters })
    }
}

/// A change of the group's members (`tether cluster add-node` / `remove-node`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum MembershipChange {
    /// Adds the node as a learner (waiting until it caught up with the log), then as a voter.
    Add(NodeId, PeerNode),
    /// Removes the voter (and the node).
    Remove(NodeId),
}

impl MembershipChange {
    /// Makes the change on `raft`, which must lead (else the error names the leader), and
    /// returns the answer to its last step.
    pub(crate) async fn apply(&self, raft: &Raft) -> network::WriteResult {
        match self {
            MembershipChange::Add(id, node) => {
                // Re-adding a learner or a voter changes nothing.
                raft.add_learner(*id, node.clone(), true).await?;
                let voters = BTreeSet::from([*id]);
                raft.change_membership(openraft::ChangeMembers::AddVoterIds(voters), false)
                    .await
            }
            MembershipChange::Remove(id) => {
                let ids = BTreeSet::from([*id]);
                let voter = raft
                    .metrics()
                    .borrow()
                    .membership_config
                    .membership()
                    .voter_ids()
                    .any(|v| v == *id);
                // A learner (a node whose addition did not finish) is no voter to remove.
                let change = if voter {
                    openraft::ChangeMembers::RemoveVoters(ids)
                } else {
                    openraft::ChangeMembers::RemoveNodes(ids)
                };
                raft.change_membership(change, false).await
            }
        }
    }
}

/// A running member of the metadata group.
pub struct Cluster {
    me: NodeId,
    raft: Raft,
    applied: Arc<RwLock<Applied>>,
    pool: Arc<PeerPool>,
    /// The members, as the applied membership says ([`Members::effective`]).
    members: tokio::sync::watch::Receiver<Arc<Members>>,
    /// When each peer last answered an RPC of this node (any kind): a node too busy to answer
    /// pings in time but answering replication is alive.
    answered: std::sync::Mutex<std::collections::HashMap<NodeId, Instant>>,
}

impl std::fmt::Debug for Cluster {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Cluster").field("me", &self.me).finish()
    }
}

impl Cluster {
    /// Opens the metadata log in `dir`, joins the group and, on the member with the smallest
    /// raft id of a never-initialized group, initializes it with every member as a voter. A
    /// node that `join`s a running group never initializes one: it waits for a member to add
    /// it ([`Cluster::add_member`]).
    pub async fn start(
        me: &str,
        members: Members,
        join: bool,
        dir: &Path,
        endpoint: quinn::Endpoint,
        peer_client_config: quinn::ClientConfig,
    ) -> Result<Arc<Cluster>, ClusterError> {
        let my_id = raft_id(me);
        let dir = dir.to_path_buf();
        let db = tokio::task::spawn_blocking(move || RaftLogDb::open(&dir))
            .await
            // A panic while opening is a bug: it goes on as the panic it is.
            .unwrap_or_else(|e| std::panic::resume_unwind(e.into_panic()))?;
        let db = Arc::new(db);
        let log = LogStore::new(Arc::clone(&db));
        let sm = StateMachine::open(Arc::clone(&db), members.clone())?;
        let current = sm.members();
        let applied = sm.applied();
        let config = openraft::Config {
            cluster_name: "tether".into(),
            heartbeat_interval: HEARTBEAT_INTERVAL_MS,
            election_timeout_min: ELECTION_TIMEOUT_MIN_MS,
            election_timeout_max: ELECTION_TIMEOUT_MAX_MS,
            install_snapshot_timeout: INSTALL_SNAPSHOT_TIMEOUT_MS,
            snapshot_policy: openraft::SnapshotPolicy::LogsSinceLast(SNAPSHOT_EVERY_LOG_ENTRIES),
            ..Default::default()
        }
        .validate()
        .map_err(|e| ClusterError::Config(e.to_string()))?;
        let pool = Arc::new(PeerPool::new(endpoint, peer_client_config));
        let network = PeerNetwork {
            pool: Arc::clone(&pool),
            addresses: Arc::new(
                members
                    .nodes
                    .iter()
                    .map(|(id, n)| (*id, n.addr.clone()))
                    .collect(),
            ),
        };
        let raft = Raft::new(my_id, Arc::new(config), network, log, sm)
            .await
            .map_err(|e| ClusterError::Fatal(e.to_string()))?;
        let smallest = *members
            .nodes
            .keys()
            .next()
            .expect("members include this node");
        let initialized = raft
            .is_initialized()
            .await
            .map_err(|e| ClusterError::Fatal(e.to_string()))?;
        if !initialized && !join && smallest == my_id {
            match raft.initialize(members.nodes.clone()).await {
                Ok(()) => tracing::info!(members = members.nodes.len(), "initialized the cluster"),
                Err(openraft::error::RaftError::APIError(
                    openraft::error::InitializeError::NotAllowed(_),
                )) => {}
                Err(e) => return Err(ClusterError::Fatal(e.to_string())),
            }
        }
        Ok(Arc::new(Cluster {
            me: my_id,
            raft,
            applied,
            pool,
            members: current,
            answered: Default::default(),
        }))
    }

    /// This node's raft id.
    pub fn id(&self) -> NodeId {
        self.me
    }

    /// The members as this node applied them: the group's membership once it has one, the
    /// configured members before.
    pub fn members(&self) -> Arc<Members> {
        Arc::clone(&self.members.borrow())
    }

    /// Whether the group's membership, as this node knows it, includes this node (a node
    /// started with `join` is not in the group until a member adds it).
    pub fn in_group(&self) -> bool {
        self.raft
            .metrics()
            .borrow()
            .membership_config
            .membership()
            .get_node(&self.me)
            .is_some()
    }

    /// The members, changed whenever an applied membership changes them.
    pub fn members_changes(&self) -> tokio::sync::watch::Receiver<Arc<Members>> {
        self.members.clone()
    }

    /// Removes member `node` from the group (through the leader: a joint membership, then one
    /// without it). The metadata forgets it as the change applies. Refused when `node` is not
    /// a voter or would be the last one.
    pub async fn remove_member(&self, node: NodeId) -> Result<(), ClusterError> {
        self.change_members(MembershipChange::Remove(node)).await
    }

    /// Adds `node` to the group as a voter (through the leader: first as a learner that has
    /// caught up with the log, then a voter). Adding a member again changes nothing.
    pub async fn add_member(&self, id: NodeId, node: PeerNode) -> Result<(), ClusterError> {
        let members = self.members();
        if let Some(m) = members.nodes.get(&id)
            && m.name != node.name
        {
            return Err(ClusterError::Membership(format!(
                "node names {} and {} hash to the same id; rename one",
                node.name, m.name
            )));
        }
        if !members.nodes.contains_key(&id) && members.nodes.len() >= CLUSTER_NODES_MAX {
            return Err(ClusterError::Membership(format!(
                "the cluster has {} members already (at most {CLUSTER_NODES_MAX})",
                members.nodes.len()
            )));
        }
        self.change_members(MembershipChange::Add(id, node)).await
    }

    /// Makes `change` through the leader (forwarded with [`PeerRequest::ChangeMembers`] when
    /// this node does not lead). A change already in progress is waited out and retried until
    /// [`network::FORWARD_TIMEOUT_MS`].
    async fn change_members(&self, change: MembershipChange) -> Result<(), ClusterError> {
        let deadline = Instant::now() + Duration::from_millis(network::FORWARD_TIMEOUT_MS);
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            // Committing the change needs a majority of the members before and after it.
            let Ok(changed) = tokio::time::timeout(left, change.apply(&self.raft)).await else {
                return Err(ClusterError::NoLeader(network::FORWARD_TIMEOUT_MS));
            };
            let result = match changed {
                Ok(_) => return Ok(()),
                Err(e) => match e.forward_to_leader() {
                    Some(f) => match f.leader_id.zip(f.leader_node.clone()) {
                        Some((id, leader)) => {
                            let left = deadline.saturating_duration_since(Instant::now());
                            let addr = self
                                .members()
                                .nodes
                                .get(&id)
                                .map_or(leader.addr.clone(), |n| n.addr.clone());
                            match self
                                .pool
                                .call(id, &addr, PeerRequest::ChangeMembers(change.clone()), left)
                                .await
                            {
                                Ok(PeerResponse::Write(Ok(_))) => return Ok(()),
                                Ok(PeerResponse::Write(Err(e))) => Err(e),
                                Ok(PeerResponse::BadRequest(why)) => {
                                    return Err(ClusterError::Membership(why));
                                }
                                _ => Ok(()),
                            }
                        }
                        None => Ok(()),
                    },
                    None => Err(e),
                },
            };
            // `Ok` here: no leader answered; `Err`: the leader refused or failed.
            if let Err(e) = result {
                use openraft::error::{ChangeMembershipError, ClientWriteError, RaftError};
                match e {
                    RaftError::APIError(ClientWriteError::ChangeMembershipError(
                        ChangeMembershipError::InProgress(_),
                    )) => {}
                    RaftError::APIError(ClientWriteError::ChangeMembershipError(c)) => {
                        return Err(ClusterError::Membership(c.to_string()));
                    }
                    RaftError::APIError(ClientWriteError::ForwardToLeader(_)) => {}
                    RaftError::Fatal(f) => return Err(ClusterError::Fatal(f.to_string())),
                }
            }
            if Instant::now() >= deadline {
                return Err(ClusterError::NoLeader(network::FORWARD_TIMEOUT_MS));
            }
            tokio::time::sleep(Duration::from_millis(WRITE_RETRY_MS)).await;
        }
    }

    /// The current leader as this node last heard (not linearizable).
    pub fn leader(&self) -> Option<NodeId> {
        self.raft.metrics().borrow().current_leader
    }

    /// The current consensus term as this node knows it.
    pub fn term(&self) -> u64 {
        self.raft.metrics().borrow().current_term
    }

    /// The placement of durable queue `id` as applied on this node.
    pub fn placement(&self, id: &str) -> Option<Placement> {
        self.read(|s| s.queues.get(id).cloned())
    }

    /// Reads the applied metadata on this node.
    pub fn read<T>(&self, f: impl FnOnce(&MetaState) -> T) -> T {
        f(&self.applied.read().expect("metadata lock poisoned").state)
    }

    /// The log index applied on this node.
    pub fn applied_index(&self) -> u64 {
        self.applied
            .read()
            .expect("metadata lock poisoned")
            .last_applied
            .map_or(0, |l| l.index)
    }

    /// Commits `cmd` through consensus (forwarding to the leader when this node does not
    /// lead) and returns its result once it is applied on the leader. Retries across leader
    /// changes until [`network::FORWARD_TIMEOUT_MS`]; commands are compare-and-set or
    /// idempotent, so a retry never applies a change twice. A command the leader refuses
    /// ([`meta::CommandRefused`]: on the leader itself, or forwarded and answered with its
    /// reason) is not retried.
    pub async fn write(&self, cmd: MetaCommand) -> Result<MetaResponse, ClusterError> {
        self.write_logged(cmd).await.map(|(r, _)| r)
    }

    /// A read barrier: commits [`MetaCommand::Barrier`] and returns once it is applied here,
    /// so the metadata read here afterwards holds every command committed before it, and no
    /// command proposed before it and not in it commits later.
    pub async fn barrier(&self) -> Result<(), ClusterError> {
        let (_, index) = self.write_logged(MetaCommand::Barrier).await?;
        let wait = Duration::from_millis(network::FORWARD_TIMEOUT_MS);
        if self.applied_index() >= index || self.wait_applied(index, wait).await {
            Ok(())
        } else {
            Err(ClusterError::NoLeader(network::FORWARD_TIMEOUT_MS))
        }
    }

    /// [`write`](Self::write), with the log index of the entry that carried the command.
    async fn write_logged(&self, cmd: MetaCommand) -> Result<(MetaResponse, u64), ClusterError> {
        cmd.validate()?;
        let deadline = Instant::now() + Duration::from_millis(network::FORWARD_TIMEOUT_MS);
        loop {
            let leader = if network::places_on_members(&self.raft, &cmd) {
                match self.raft.client_write(cmd.clone()).await {
                    Ok(r) => return Ok((r.data, r.log_id.index)),
                    Err(e) => match e.forward_to_leader() {
                        Some(f) => f.leader_id.zip(f.leader_node.clone()),
                        None => return Err(ClusterError::Fatal(e.to_string())),
                    },
                }
            } else {
                // A node the command gives a queue to is not a member as this node knows the
                // group. The leader's membership is the latest: there it is refused; a
                // follower's may lag a member just added, so the leader decides.
                let metrics = self.raft.metrics().borrow().clone();
                match metrics.current_leader {
                    Some(id) if id == self.me => {
                        return Err(meta::CommandRefused::NotAMember.into());
                    }
                    Some(id) => metrics
                        .membership_config
                        .membership()
                        .get_node(&id)
                        .map(|node| (id, node.clone())),
                    None => None,
                }
            };
            if let Some((id, node)) = leader {
                let left = deadline.saturating_duration_since(Instant::now());
                let members = self.members();
                let addr = members.nodes.get(&id).map_or(&node.addr, |n| &n.addr);
                match self
                    .pool
                    .call(id, addr, PeerRequest::Write(cmd.clone()), left)
                    .await
                {
                    Ok(PeerResponse::Write(Ok(r))) => {
                        // Make the change visible here too before returning.
                        self.wait_applied(r.log_id.index, left).await;
                        return Ok((r.data, r.log_id.index));
                    }
                    Ok(PeerResponse::Write(Err(e))) if e.forward_to_leader().is_none() => {
                        return Err(ClusterError::Fatal(e.to_string()));
                    }
                    // Refused for what it says (sent again, it would be again).
                    Ok(PeerResponse::BadRequest(why)) => {
                        return Err(ClusterError::LeaderRefused(why));
                    }
                    _ => {}
                }
            }
            if Instant::now() >= deadline {
                return Err(ClusterError::NoLeader(network::FORWARD_TIMEOUT_MS));
            }
            tokio::time::sleep(Duration::from_millis(WRITE_RETRY_MS)).await;
        }
    }

    /// Waits until this node applied log index `index` (or `timeout` passes).
    pub async fn wait_applied(&self, index: u64, timeout: Duration) -> bool {
        self.raft
            .wait(Some(timeout))
            .applied_index_at_least(Some(index), "wait_applied")
            .await
            .is_ok()
    }

    /// Serves the RPCs of member `peer` (identified by its certificate) on `conn`, spawned per
    /// connection; forwarded publishes go to `sink`.
    pub fn serve(
        &self,
        conn: quinn::Connection,
        sink: Option<Arc<dyn network::PublishSink>>,
        peer: NodeId,
    ) {
        let peer = network::PeerIdentity {
            id: peer,
            name: self.members().name(peer),
        };
        tokio::spawn(network::serve_peer(
            conn,
            self.raft.clone(),
            self.me,
            peer,
            sink,
            self.members_changes(),
        ));
    }

    /// Bytes this node sent to its peers on the connections it opened (replication, forwarded
    /// publishes, metadata calls), for operators and tests.
    pub fn peer_bytes_sent(&self) -> u64 {
        self.pool.bytes_sent()
    }

    /// Sends `request` to member `to` at its configured address.
    pub async fn call(
        &self,
        to: NodeId,
        request: PeerRequest,
        timeout: Duration,
    ) -> Result<PeerResponse, network::PeerError> {
        let addr = self
            .members()
            .nodes
            .get(&to)
            .map(|n| n.addr.clone())
            .unwrap_or_default();
        let r = self.pool.call(to, &addr, request, timeout).await;
        if r.is_ok() {
            self.answered.lock_or_stop().insert(to, Instant::now());
        }
        r
    }

    /// The members other than this node that speak an older peer protocol than `version`,
    /// each with the version it speaks, by name. Every member is asked at once (dialed if
    /// needed), within `timeout`, except member `except`; a member that cannot be reached is
    /// not counted (its version
    /// is not known: it learns what it missed when it is back, or refuses to, loudly).
    pub async fn members_older_than(
        &self,
        version: u32,
        timeout: Duration,
        except: Option<NodeId>,
    ) -> Vec<(String, u32)> {
        let mut asks = tokio::task::JoinSet::new();
        for (id, node) in &self.members().nodes {
            if *id == self.me || Some(*id) == except {
                continue;
            }
            let (pool, node) = (Arc::clone(&self.pool), node.clone());
            asks.spawn(async move { (pool.speaks(&node.addr, timeout).await, node.name) });
        }
        let mut older = Vec::new();
        while let Some(asked) = asks.join_next().await {
            if let Ok((Ok(speaks), name)) = asked
                && speaks < version
            {
                older.push((name, speaks));
            }
        }
        older.sort();
        older
    }

    /// When peer `to` last answered an RPC of this node (None: never since start).
    pub fn last_answer(&self, to: NodeId) -> Option<Instant> {
        self.answered.lock_or_stop().get(&to).copied()
    }

    /// Stops consensus and closes peer connections.
    pub async fn shutdown(&self) {
        let _ = self.raft.shutdown().await;
        self.pool.close();
    }
}
