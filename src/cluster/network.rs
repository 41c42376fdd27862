//! Node-to-node RPC over QUIC: openraft's network (append entries, vote, install snapshot),
//! metadata writes forwarded to the leader, forwarded publishes and queue replication.
//!
//! A peer is the member its certificate names (URI SAN `urn:tether:node:<id>`, issued by the
//! cluster CA), never any holder of a cluster-CA certificate: client certificates name no node
//! and are refused as peers, node certificates are refused as clients. Every peer request is
//! checked against that identity (`check_sender`: Raft candidate or leader, publish origin,
//! replication sender; and `control::reconcile::shipped_by_non_primary` against the
//! placement). A node dialing a peer checks that the certificate at the address names the node
//! it called: its verifier checks the chain and the node name, never a host name, so node
//! certificates need only the names their clients use; members may be listed by IP address or
//! by host name, resolved when dialed. Metadata commands are size-checked before they are
//! proposed (`MetaCommand::validate`).
//!
//! One handshake per peer at a time, shared by every RPC to it and never abandoned at an RPC's
//! deadline (`PeerPool`); and a node answers a new connection's first Initial with a stateless
//! Retry (`server/conn.rs`). So no half-open connection outlives `Node::shutdown` (quinn would
//! keep the node's UDP port bound until its idle timeout).
//!
//! One QUIC connection per peer (ALPN [`tether_transport::PEER_ALPN`], mutual TLS under the
//! cluster CA), opened lazily and reused; one bidirectional stream per RPC, so a snapshot
//! never blocks a heartbeat. A request and its response are each one CBOR body that ends
//! with its stream. Every request names the node it is meant for; a node that receives a
//! request for another id answers [`PeerResponse::WrongNode`] (a stale address), which the
//! caller reports as unreachable.

use std::collections::{HashMap, HashSet};
use std::net::SocketAddr;
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use openraft::error::{
    ClientWriteError, InstallSnapshotError, NetworkError, RPCError, RaftError, RemoteError,
    Unreachable,
};
use openraft::network::{RPCOption, RaftNetwork, RaftNetworkFactory};
use openraft::raft::{
    AppendEntriesRequest, AppendEntriesResponse, ClientWriteResponse, InstallSnapshotRequest,
    InstallSnapshotResponse, VoteRequest, VoteResponse,
};
use serde::{Deserialize, Serialize};
use tether_transport::{codec, tls};
use tokio::sync::{Semaphore, watch};

use super::meta::{CommandRefused, MetaCommand, NodeId, raft_id};
use super::{ClusterError, PeerNode, Raft, TypeConfig};
use crate::protocol::PublishOp;

/// Longest peer request or response body, in bytes (a snapshot chunk is at most 3 MiB).
pub const PEER_MESSAGE_BYTES_MAX: usize = codec::FRAME_BYTES_MAX;
/// Timeout of a forwarded metadata write, in milliseconds.
pub const FORWARD_TIMEOUT_MS: u64 = 5_000;
/// Concurrent RPC streams a peer may open on one connection (a client gets
/// [`MAX_CONCURRENT_BIDI_STREAMS`](tether_transport::tls::MAX_CONCURRENT_BIDI_STREAMS)): room
/// for pings and votes beside a burst of replication and forwarding calls.
pub const PEER_STREAMS_MAX: u32 = 64;
/// Streams of one peer connection that only pings and votes may use: every other call waits
/// for one of the other `PEER_STREAMS_MAX - PEER_PING_STREAMS_RESERVED`, so a burst of slow
/// calls (replication, forwarded runs waiting for their predecessor) never delays failure
/// detection or an election.
pub const PEER_PING_STREAMS_RESERVED: u32 = 8;
const _: () = assert!(PEER_PING_STREAMS_RESERVED < PEER_STREAMS_MAX);
/// How long a member's host name, once resolved, is dialed at that address, in milliseconds.
pub const PEER_RESOLVED_TTL_MS: u64 = 30_000;

/// A request from one node to another.
#[derive(Serialize, Deserialize)]
pub enum PeerRequest {
    AppendEntries(AppendEntriesRequest<TypeConfig>),
    Vote(VoteRequest<NodeId>),
    InstallSnapshot(InstallSnapshotRequest<TypeConfig>),
    /// A metadata command forwarded to the node believed to lead.
    Write(MetaCommand),
    /// A change of the group's members (`tether cluster add-node` / `remove-node`), forwarded
    /// to the node believed to lead; answered like [`PeerRequest::Write`].
    ChangeMembers(super::MembershipChange),
    /// How far member `peer` has applied the receiver's publish log, once the receiver
    /// forwards to it (a joining member asks every member before it copies the regions). Answered with
    /// [`PeerResponse::ForwardCursor`].
    ForwardCursor(String),
    /// A page of the receiver's regions, from the first key after `after` (a joining member
    /// copies them). Answered with [`PeerResponse::Regions`].
    Regions {
        after: Option<(String, String)>,
    },
    /// Publishes made on node `origin`, in its publish-log order: each is (offset in the
    /// origin's publish log, the publish). The receiver applies each once (it remembers the
    /// highest offset applied per origin) and in order.
    Publish {
        origin: String,
        entries: Vec<(u64, ForwardedPublish)>,
        /// Every member has applied `origin`'s publishes up to this offset (so any queue's
        /// primary holds them; see `RecentForwards`). Sent alone, with no entries, when it
        /// moves while nothing is left to forward.
        #[serde(default)]
        floor: u64,
        /// A run sent while the one before it (ending at this offset) was still in flight:
        /// applied only once that one is, since the two may arrive in either order. `None`
        /// (the first run after what the receiver confirmed): applied as it comes.
        #[serde(default)]
        follows: Option<u64>,
        /// The first offset of `origin`'s publish log (0: a log from before starts were told,
        /// which starts at 1): nothing below it will come. A node that lost its data directory
        /// starts a new log past every offset of its old one, and its peers take it from
        /// there (`control::forward::applied_before_run`).
        #[serde(default)]
        log_start: u64,
    },
    /// Queue log shipping from a primary to one of its secondaries.
    Replicate(ReplicateMsg),
    /// Liveness probe (failure detection).
    Ping,
    /// The admin API's queue listing: the receiver's page of it (`crate::admin`).
    ListQueues(crate::admin::ListQuery),
}

impl PeerRequest {
    /// The oldest peer protocol version that has this request (all it carries included): it
    /// is sent only over a connection that negotiated that version or a newer one.
    pub fn version_needed(&self) -> u32 {
        use super::meta::PEER_VERSION_MEMBERSHIP;
        match self {
            PeerRequest::ChangeMembers(_)
            | PeerRequest::ForwardCursor(_)
            | PeerRequest::Regions { .. } => PEER_VERSION_MEMBERSHIP,
            PeerRequest::Write(cmd) => cmd.version_needed(),
            PeerRequest::AppendEntries(r) => r
                .entries
                .iter()
                .map(|e| match &e.payload {
                    openraft::EntryPayload::Normal(cmd) => cmd.version_needed(),
                    _ => 1,
                })
                .max()
                .unwrap_or(1),
            _ => 1,
        }
    }
}

/// One replication message: the header decided by the primary's
/// [`Shipper`](crate::replication::Shipper), the entries it names and the queue's info.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ReplicateMsg {
    /// The sending primary.
    pub from: NodeId,
    /// The queue's durable id (the same on every copy).
    pub durable_id: String,
    pub header: ReplicateHeader,
    /// The primary's clock when it built the message (ms since the Unix epoch; 0: unknown). A
    /// copy measures the queue's away time against it, never against its own clock.
    #[serde(default)]
    pub sent_ms: u64,
    /// The primary's queue info (durable interest, timeout, away time), CBOR; empty when it
    /// has not changed since the copy acknowledged a message carrying it (a copy without one
    /// answers [`PeerResponse::QueueInfoNeeded`]).
    #[serde(with = "serde_bytes")]
    pub info: Vec<u8>,
    /// The entries `[first, last)` of an append, or the whole log of a snapshot, in order:
    /// (flags, body) as stored. A large snapshot comes in several messages, in order, each with
    /// the same header: all but the last have `more` set.
    pub entries: Vec<ShippedEntry>,
    /// More entries of this snapshot follow in the next message.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub more: bool,
    /// A watermark of the queue (per origin node, a publish-log offset): the queue's log up to
    /// `through_end` holds every matching publish of that origin up to there, so a copy that
    /// acknowledges its log that far holds them (see `control/watermark.rs`). Empty: no claim.
    #[serde(default, skip_serializing_if = "std::collections::BTreeMap::is_empty")]
    pub through: std::collections::BTreeMap<String, u64>,
    /// The log end `through` speaks of (at most this message's log end).
    #[serde(default)]
    pub through_end: u64,
    /// The epoch of the queue's placement as the primary knew it when it shipped (the index of
    /// the metadata change that last set its replica set): the receiving node is a secondary
    /// of that placement, so its own metadata must be applied at least that far before it may
    /// conclude it no longer holds the copy.
    #[serde(default)]
    pub placement_epoch: u64,
}

/// A queue entry as stored: flags and body.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ShippedEntry {
    pub flags: u8,
    #[serde(with = "serde_bytes")]
    pub body: Vec<u8>,
}

/// What a [`ReplicateMsg`] carries.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub enum ReplicateHeader {
    Append(crate::replication::AppendHeader),
    Snapshot(crate::replication::SnapshotHeader),
}

/// One publish as the origin logged it: its operations and the event ids it gave them.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ForwardedPublish {
    /// The publishing session on the origin.
    pub session: u64,
    /// Event sequence of the first operation; the others follow.
    pub first_seq: u64,
    pub ops: Vec<PublishOp>,
}

/// The answer to a metadata write or a membership change.
pub type WriteResult =
    Result<ClientWriteResponse<TypeConfig>, RaftError<NodeId, ClientWriteError<NodeId, PeerNode>>>;

/// The answer to a [`PeerRequest`].
#[derive(Serialize, Deserialize)]
pub enum PeerResponse {
    AppendEntries(Result<AppendEntriesResponse<NodeId>, RaftError<NodeId>>),
    Vote(Result<VoteResponse<NodeId>, RaftError<NodeId>>),
    InstallSnapshot(
        Result<InstallSnapshotResponse<NodeId>, RaftError<NodeId, InstallSnapshotError>>,
    ),
    Write(WriteResult),
    /// The request named another node: the caller's address book is stale.
    WrongNode {
        actual: NodeId,
    },
    /// The request could not be decoded.
    BadRequest(String),
    /// Every entry of a [`PeerRequest::Publish`] up to `through` is applied (or was already).
    Published {
        through: u64,
    },
    /// Every entry up to `through` is applied (or was already), but the copies of the queues
    /// they reached did not all confirm them within the node's replicated-ack wait: the origin
    /// must not count them as replicated on this node (`--ack replicated`).
    PublishedUnconfirmed {
        through: u64,
        reason: String,
    },
    /// Entries up to `through` are applied; the next one was refused (a full queue, the node
    /// stopping, a storage error) and must be sent again later.
    PublishDeferred {
        through: u64,
        reason: String,
        /// The node is joining the cluster and holds no queue and no copy: no `--ack
        /// replicated` publish waits for it (the origin keeps the publishes for it).
        #[serde(default)]
        joining: bool,
    },
    /// The answer to a [`PeerRequest::Replicate`]: the secondary's reply, if it has one.
    Replicated(Option<crate::replication::Reply>),
    /// The answer to a [`PeerRequest::Replicate`] without queue info (the info is sent once per
    /// change) for a queue this node holds no copy of: send the info again.
    QueueInfoNeeded,
    /// The answer to a [`PeerRequest::Ping`].
    Pong,
    /// The answer to a [`PeerRequest::ListQueues`].
    Queues(crate::admin::Page),
    /// The answer to a [`PeerRequest::ForwardCursor`]: how far the peer has applied this
    /// node's publish log (None: this node does not forward to it yet).
    ForwardCursor(Option<u64>),
    /// The answer to a [`PeerRequest::Regions`].
    Regions(RegionsPage),
}

/// A page of a node's regions, for a joining member.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct RegionsPage {
    /// (region, key, value as stored), in the store's order.
    pub entries: Vec<(String, String, serde_bytes::ByteBuf)>,
    /// More follow: ask again after the last entry.
    pub more: bool,
    /// On the first page (`after` None) only: per origin member, how far this node had applied
    /// its publishes before the page was read (every later page holds at least that much).
    pub applied: std::collections::BTreeMap<String, u64>,
}

/// Where a node applies the publishes its peers forward to it (the server implements it).
pub trait PublishSink: Send + Sync + 'static {
    /// Applies `entries` forwarded by `origin`, in order, each at most once; `floor`: every
    /// member has applied `origin`'s publishes up to there; `follows`: apply them only after
    /// `origin`'s publishes up to there (see [`PeerRequest::Publish`]).
    fn apply_forwarded(
        &self,
        origin: String,
        entries: Vec<(u64, ForwardedPublish)>,
        floor: u64,
        follows: Option<u64>,
        log_start: u64,
    ) -> std::pin::Pin<Box<dyn std::future::Future<Output = PeerResponse> + Send + '_>>;

    /// Handles a replication message from a queue's primary.
    fn replicate(
        &self,
        msg: ReplicateMsg,
    ) -> std::pin::Pin<Box<dyn std::future::Future<Output = PeerResponse> + Send + '_>>;

    /// How far `peer` has applied this node's publish log, once this node forwards to it.
    fn forward_cursor(&self, peer: &str) -> Option<u64>;

    /// A page of this node's regions after `after` (see [`PeerRequest::Regions`]).
    fn regions(
        &self,
        after: Option<(String, String)>,
    ) -> std::pin::Pin<Box<dyn std::future::Future<Output = PeerResponse> + Send + '_>>;

    /// This node's page of an admin queue listing.
    fn list_queues(
        &self,
        query: crate::admin::ListQuery,
    ) -> std::pin::Pin<Box<dyn std::future::Future<Output = PeerResponse> + Send + '_>>;
}

#[derive(Serialize, Deserialize)]
struct Envelope {
    to: NodeId,
    request: PeerRequest,
}

/// The bytes of a request for node `to` as they travel on a peer stream (for tests and tools
/// that speak the peer protocol by hand).
pub fn encode_request(to: NodeId, request: PeerRequest) -> Result<Vec<u8>, codec::CodecError> {
    codec::encode_body(&Envelope { to, request })
}

/// The member a peer connection comes from, as its certificate names it
/// ([`tether_transport::tls::peer_node_name`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PeerIdentity {
    pub id: NodeId,
    pub name: String,
}

/// Whether `peer` may send `request`: every node a request claims to come from (a Raft
/// candidate or leader, a publish's origin, a replication message's primary) must be the
/// connection's own. Metadata writes ([`PeerRequest::Write`]) may come from any member: every
/// member proposes them. The error says what was claimed.
pub fn check_sender(peer: &PeerIdentity, request: &PeerRequest) -> Result<(), SenderRefused> {
    let claimed = |what: &'static str, id: Option<NodeId>| {
        if id == Some(peer.id) {
            Ok(())
        } else {
            Err(SenderRefused::InNameOf {
                peer: peer.name.clone(),
                what,
                claimed: id,
            })
        }
    };
    match request {
        PeerRequest::AppendEntries(r) => {
            claimed("entries of a leader", r.vote.leader_id().voted_for())
        }
        PeerRequest::Vote(r) => claimed("a vote request", r.vote.leader_id().voted_for()),
        PeerRequest::InstallSnapshot(r) => {
            claimed("a snapshot of a leader", r.vote.leader_id().voted_for())
        }
        PeerRequest::Publish { origin, .. } if *origin == peer.name => Ok(()),
        PeerRequest::Publish { origin, .. } => Err(SenderRefused::PublishOrigin {
            peer: peer.name.clone(),
            origin: origin.clone(),
        }),
        PeerRequest::Replicate(m) => claimed("queue replication", Some(m.from)),
        PeerRequest::Write(_)
        | PeerRequest::ChangeMembers(_)
        | PeerRequest::ForwardCursor(_)
        | PeerRequest::Regions { .. }
        | PeerRequest::Ping
        | PeerRequest::ListQueues(_) => Ok(()),
    }
}

/// A peer request refused by [`check_sender`]: it claims to come from another node.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum SenderRefused {
    /// A Raft message or a replication message in the name of another node (or none).
    #[error("node {peer} sent {what} in the name of {}", claimed_name(*.claimed))]
    InNameOf {
        peer: String,
        what: &'static str,
        claimed: Option<NodeId>,
    },
    /// Forwarded publishes of another origin.
    #[error("node {peer} sent publishes of origin {origin:?}")]
    PublishOrigin { peer: String, origin: String },
}

/// How a refusal names the node a request claimed to come from.
fn claimed_name(id: Option<NodeId>) -> String {
    id.map_or_else(|| "no node".to_string(), |id| format!("node {id:x}"))
}

/// Why an RPC failed before a response arrived.
#[derive(Debug, thiserror::Error)]
pub enum PeerError {
    #[error("cannot reach {addr}: {reason}")]
    Unreachable { addr: String, reason: String },
    #[error("rpc to {addr}: {reason}")]
    Network { addr: String, reason: String },
    #[error("rpc to {addr} timed out")]
    Timeout { addr: String },
    /// The member speaks an older peer protocol version than the request needs (a member not
    /// upgraded yet): nothing was sent.
    #[error(
        "the member at {addr} speaks peer protocol version {speaks}, and this request needs \
         version {needs}: upgrade every member first"
    )]
    OlderPeer {
        addr: String,
        speaks: u32,
        needs: u32,
    },
}

/// Outgoing peer connections, one per address, shared by every RPC client of a node.
///
/// One handshake per peer runs in a task of its own, and every call waits for it within its
/// own deadline. openraft's RPCs time out after a heartbeat interval, no later than quinn
/// sends a lost first Initial again (one PTO): a handshake given up with its RPC would never
/// reach a peer that is down or starting, would drain here (holding the endpoint, so a
/// shutdown and the UDP port), and its CONNECTION_CLOSE could reach a peer come up meanwhile
/// as a first packet (see `server::conn::accept_loop`). A handshake nobody answers ends
/// silently at the peer idle timeout
/// ([`PEER_IDLE_TIMEOUT_MS`](tether_transport::tls::PEER_IDLE_TIMEOUT_MS)): an idle timeout
/// sends nothing and leaves nothing to drain.
pub struct PeerPool {
    state: Arc<PoolState>,
    client_config: quinn::ClientConfig,
}

/// What a [`PeerPool`] shares with its handshake tasks.
struct PoolState {
    /// The node's own endpoint (one UDP socket for clients and peers); taken out at close so
    /// RPC clients that outlive the node do not keep the socket bound.
    endpoint: Mutex<Option<quinn::Endpoint>>,
    /// Member host names resolved, with when.
    resolved: Mutex<HashMap<String, (SocketAddr, std::time::Instant)>>,
    conns: Mutex<HashMap<SocketAddr, PeerConn>>,
    /// Per peer address: the streams calls other than pings may hold at once.
    call_slots: Mutex<HashMap<SocketAddr, Arc<Semaphore>>>,
    /// Peer addresses whose handshake failed for want of a common protocol version, logged
    /// once each (until a handshake there succeeds).
    version_mismatch_logged: Mutex<HashSet<SocketAddr>>,
}

/// An established peer connection and the node names its server certificate carries.
type Dialed = (quinn::Connection, Arc<[String]>);

/// The outcome of a handshake, once known: the connection, or why there is none.
type Handshake = Option<Result<Dialed, HandshakeError>>;

/// Why there is no connection to a peer address.
#[derive(Clone, Debug, thiserror::Error)]
pub enum HandshakeError {
    #[error("this node is stopping")]
    Stopping,
    /// The connection could not even be started (an address of the wrong family...).
    #[error("{0}")]
    Connect(#[from] quinn::ConnectError),
    /// The handshake failed (no answer, refused, a certificate not trusted...).
    #[error("{0}")]
    Connection(quinn::ConnectionError),
    /// A member of another build that speaks no peer protocol version in common: it will not
    /// heal by itself.
    #[error(
        "the node at {addr} speaks no peer protocol version this node does (this node speaks \
         versions {oldest}–{newest}): upgrade a cluster one version at a time",
        oldest = tether_transport::PEER_PROTOCOL_VERSION_OLDEST,
        newest = tether_transport::PEER_PROTOCOL_VERSION
    )]
    NoCommonVersion { addr: SocketAddr },
}

/// A peer's entry in the pool.
enum PeerConn {
    /// An established connection (it may have closed since; the next call replaces it).
    Up(Dialed),
    /// A handshake in flight, whose outcome every waiting call receives.
    Connecting(watch::Receiver<Handshake>),
}

impl PeerPool {
    pub fn new(endpoint: quinn::Endpoint, client_config: quinn::ClientConfig) -> Self {
        PeerPool {
            state: Arc::new(PoolState {
                endpoint: Mutex::new(Some(endpoint)),
                resolved: Mutex::new(HashMap::new()),
                conns: Mutex::new(HashMap::new()),
                call_slots: Mutex::new(HashMap::new()),
                version_mismatch_logged: Mutex::new(HashSet::new()),
            }),
            client_config,
        }
    }

    /// The connection to `addr`: the established one, or the outcome of the handshake in
    /// flight (started now if there is none).
    async fn connection(&self, addr: SocketAddr) -> Result<Dialed, PeerError> {
        let unreachable = |e: HandshakeError| PeerError::Unreachable {
            addr: addr.to_string(),
            reason: e.to_string(),
        };
        let mut handshake = {
            let mut conns = self.state.conns.lock().expect("pool lock");
            match conns.get(&addr) {
                Some(PeerConn::Up(c)) if c.0.close_reason().is_none() => return Ok(c.clone()),
                // A closed channel: the handshake's task is gone (the runtime is stopping).
                Some(PeerConn::Connecting(rx)) if rx.has_changed().is_ok() => rx.clone(),
                _ => {
                    let rx = self.start_handshake(addr).map_err(unreachable)?;
                    conns.insert(addr, PeerConn::Connecting(rx.clone()));
                    rx
                }
            }
        };
        let outcome = handshake
            .wait_for(Option::is_some)
            .await
            .map_err(|_| unreachable(HandshakeError::Stopping))?
            .clone();
        outcome.expect("waited for an outcome").map_err(unreachable)
    }

    /// Starts a handshake with `addr` in a task of its own; the pool's entry for `addr` becomes
    /// the connection (or goes, on failure) before the outcome is announced.
    fn start_handshake(
        &self,
        addr: SocketAddr,
    ) -> Result<watch::Receiver<Handshake>, HandshakeError> {
        let endpoint = self
            .state
            .endpoint
            .lock()
            .expect("pool lock")
            .clone()
            .ok_or(HandshakeError::Stopping)?;
        let connecting = endpoint.connect_with(
            self.client_config.clone(),
            addr,
            tether_transport::SERVER_NAME,
        )?;
        drop(endpoint);
        let (tx, rx) = watch::channel(None);
        let state = Arc::downgrade(&self.state);
        tokio::spawn(async move {
            let outcome = connecting
                .await
                .map_err(|e| handshake_error(&state, addr, e))
                .map(|conn| {
                    let names: Arc<[String]> = tls::connection_node_names(&conn).into();
                    (conn, names)
                });
            let outcome = match (state.upgrade(), outcome) {
                (Some(state), outcome) => state.handshake_done(addr, outcome),
                (None, Ok((conn, _))) => {
                    conn.close(0u32.into(), b"node stopping");
                    Err(HandshakeError::Stopping)
                }
                (None, Err(e)) => Err(e),
            };
            tx.send_replace(Some(outcome));
        });
        Ok(rx)
    }

    /// The socket address of member address `addr`: an `IP:PORT` as it is; a `HOST:PORT`
    /// resolved (again after [`PEER_RESOLVED_TTL_MS`]: a member's address may change), an
    /// address of this node's endpoint's family first (an IPv4 socket cannot reach an IPv6
    /// address).
    async fn resolve(&self, addr: &str) -> Result<SocketAddr, PeerError> {
        if let Ok(sock) = addr.parse() {
            return Ok(sock);
        }
        let fresh = Duration::from_millis(PEER_RESOLVED_TTL_MS);
        if let Some((sock, at)) = self.state.resolved.lock().expect("pool lock").get(addr)
            && at.elapsed() < fresh
        {
            return Ok(*sock);
        }
        let unreachable = |reason: String| PeerError::Unreachable {
            addr: addr.to_string(),
            reason,
        };
        let found: Vec<SocketAddr> = tokio::net::lookup_host(addr)
            .await
            .map_err(|e| unreachable(format!("cannot resolve: {e}")))?
            .collect();
        let v4 = self
            .state
            .endpoint
            .lock()
            .expect("pool lock")
            .as_ref()
            .and_then(|e| e.local_addr().ok())
            .is_none_or(|a| a.is_ipv4());
        let sock = found
            .iter()
            .find(|a| a.is_ipv4() == v4)
            .or(found.first())
            .copied()
            .ok_or_else(|| unreachable("resolves to no address".into()))?;
        self.state
            .resolved
            .lock()
            .expect("pool lock")
            .insert(addr.to_string(), (sock, std::time::Instant::now()));
        Ok(sock)
    }

    /// Sends `request` to node `to` at `addr` and waits up to `timeout` for its response.
    pub async fn call(
        &self,
        to: NodeId,
        addr: &str,
        request: PeerRequest,
        timeout: Duration,
    ) -> Result<PeerResponse, PeerError> {
        let ping = matches!(request, PeerRequest::Ping | PeerRequest::Vote(_));
        let needs = request.version_needed();
        let body =
            codec::encode_body(&Envelope { to, request }).map_err(|e| PeerError::Network {
                addr: addr.to_string(),
                reason: e.to_string(),
            })?;
        let network = |reason: String| PeerError::Network {
            addr: addr.to_string(),
            reason,
        };
        // The connection the exchange used, if it got one.
        let used = Mutex::new(None);
        let exchange = async {
            let sock = self.resolve(addr).await?;
            // Pings and votes keep streams of their own; other calls hold a slot until their
            // exchange ends.
            let _slot = if ping {
                None
            } else {
                let slots = self.state.call_slots(sock);
                Some(
                    slots
                        .acquire_owned()
                        .await
                        .map_err(|e| network(e.to_string()))?,
                )
            };
            let (conn, names) = self.connection(sock).await?;
            if needs > tether_transport::PEER_PROTOCOL_VERSION_OLDEST {
                let speaks = negotiated_version(&conn);
                if speaks < needs {
                    // The connection is sound: kept for the requests the member does speak.
                    return Err(PeerError::OlderPeer {
                        addr: addr.to_string(),
                        speaks,
                        needs,
                    });
                }
            }
            *used.lock().expect("used lock") = Some((sock, conn.clone()));
            // The node that answers there must be the one called, by its certificate.
            if !matches!(&names[..], [name] if raft_id(name) == to) {
                return Err(PeerError::Unreachable {
                    addr: addr.to_string(),
                    reason: format!(
                        "the node there presents a certificate for cluster node(s) {:?}, not for node {to:x}",
                        &names[..]
                    ),
                });
            }
            let (mut send, mut recv) =
                conn.open_bi().await.map_err(|e| PeerError::Unreachable {
                    addr: addr.to_string(),
                    reason: e.to_string(),
                })?;
            if ping {
                // Their bytes go before those of bulk calls queued on the connection.
                let _ = send.set_priority(1);
            }
            send.write_all(&body)
                .await
                .map_err(|e| network(e.to_string()))?;
            send.finish().map_err(|e| network(e.to_string()))?;
            let reply = recv
                .read_to_end(PEER_MESSAGE_BYTES_MAX)
                .await
                .map_err(|e| network(e.to_string()))?;
            codec::decode_body::<PeerResponse>(&reply).map_err(|e| network(e.to_string()))
        };
        let result = tokio::time::timeout(timeout, exchange)
            .await
            .map_err(|_| PeerError::Timeout {
                addr: addr.to_string(),
            })
            .and_then(|r| r);
        if result.is_err()
            && let Some((sock, conn)) = used.lock().expect("used lock").take()
        {
            // The peer may have died (a killed process never closes its connections, which
            // then linger until their idle timeout): reconnect on the next call.
            self.state.discard(sock, &conn);
        }
        result
    }

    /// The peer protocol version the connection to the member at `addr` negotiated (dialed
    /// now if there is none), within `timeout`.
    pub async fn speaks(&self, addr: &str, timeout: Duration) -> Result<u32, PeerError> {
        let dial = async {
            let sock = self.resolve(addr).await?;
            let (conn, _) = self.connection(sock).await?;
            Ok(negotiated_version(&conn))
        };
        tokio::time::timeout(timeout, dial)
            .await
            .map_err(|_| PeerError::Timeout {
                addr: addr.to_string(),
            })?
    }

    /// Bytes sent so far on the open outgoing connections (UDP payloads: QUIC framing and
    /// retransmissions included). A connection replaced since no longer counts.
    pub fn bytes_sent(&self) -> u64 {
        self.state
            .conns
            .lock()
            .expect("pool lock")
            .values()
            .map(|c| match c {
                PeerConn::Up((c, _)) => c.stats().udp_tx.bytes,
                PeerConn::Connecting(_) => 0,
            })
            .sum()
    }

    /// Closes every outgoing connection.
    pub fn close(&self) {
        self.state.endpoint.lock().expect("pool lock").take();
        for (_, c) in self.state.conns.lock().expect("pool lock").drain() {
            if let PeerConn::Up((c, _)) = c {
                c.close(0u32.into(), b"node stopping");
            }
        }
    }
}

impl PoolState {
    /// The call slots of the peer at `addr`.
    fn call_slots(&self, addr: SocketAddr) -> Arc<Semaphore> {
        self.call_slots
            .lock()
            .expect("pool lock")
            .entry(addr)
            .or_insert_with(|| {
                Arc::new(Semaphore::new(
                    (PEER_STREAMS_MAX - PEER_PING_STREAMS_RESERVED) as usize,
                ))
            })
            .clone()
    }

    /// Records the outcome of the handshake with `addr`.
    fn handshake_done(
        &self,
        addr: SocketAddr,
        outcome: Result<Dialed, HandshakeError>,
    ) -> Result<Dialed, HandshakeError> {
        let stopping = self.endpoint.lock().expect("pool lock").is_none();
        let mut conns = self.conns.lock().expect("pool lock");
        match outcome {
            Ok((conn, _)) if stopping => {
                // Closed while connecting: do not keep the connection (it holds the socket).
                conn.close(0u32.into(), b"node stopping");
                conns.remove(&addr);
                Err(HandshakeError::Stopping)
            }
            Ok(conn) => {
                self.version_mismatch_logged
                    .lock()
                    .expect("pool lock")
                    .remove(&addr);
                conns.insert(addr, PeerConn::Up(conn.clone()));
                Ok(conn)
            }
            Err(e) => {
                conns.remove(&addr);
                Err(e)
            }
        }
    }

    /// Forgets `conn` (the connection to `addr` an RPC failed on) and closes it, so the next
    /// call reconnects; a handshake already in flight for `addr` is left alone.
    fn discard(&self, addr: SocketAddr, conn: &quinn::Connection) {
        let mut conns = self.conns.lock().expect("pool lock");
        if let Some(PeerConn::Up((c, _))) = conns.get(&addr)
            && c.stable_id() == conn.stable_id()
        {
            conns.remove(&addr);
        }
        conn.close(0u32.into(), b"rpc failed");
    }
}

/// The peer protocol version a peer connection negotiated (the oldest spoken if the ALPN
/// name is missing, which a peer handshake never leaves).
fn negotiated_version(conn: &quinn::Connection) -> u32 {
    tls::negotiated_alpn(conn)
        .as_deref()
        .and_then(tether_transport::peer_protocol_version)
        .unwrap_or(tether_transport::PEER_PROTOCOL_VERSION_OLDEST)
}

/// Why a handshake with the peer at `addr` failed, for the operator: a member of another build
/// that speaks no peer protocol version in common is named as such, and logged at error once
/// (it will not heal by itself).
fn handshake_error(
    state: &Weak<PoolState>,
    addr: SocketAddr,
    e: quinn::ConnectionError,
) -> HandshakeError {
    if !tls::no_common_protocol(&e) {
        return HandshakeError::Connection(e);
    }
    let why = HandshakeError::NoCommonVersion { addr };
    if let Some(state) = state.upgrade()
        && state
            .version_mismatch_logged
            .lock()
            .expect("pool lock")
            .insert(addr)
    {
        tracing::error!("{why}");
    }
    why
}

/// Serves RPCs arriving on one verified peer connection (from member `peer`) until it closes.
pub async fn serve_peer(
    conn: quinn::Connection,
    raft: Raft,
    me: NodeId,
    peer: PeerIdentity,
    sink: Option<Arc<dyn PublishSink>>,
    members: tokio::sync::watch::Receiver<Arc<super::Members>>,
) {
    let peer = Arc::new(peer);
    // The endpoint's transport settings are a client's; a peer gets more streams at once.
    conn.set_max_concurrent_bi_streams(quinn::VarInt::from_u32(PEER_STREAMS_MAX));
    loop {
        let (mut send, mut recv) = match conn.accept_bi().await {
            Ok(s) => s,
            Err(_) => return,
        };
        // A member removed from the group is served no more, on the connections it already had
        // either.
        if !members.borrow().nodes.contains_key(&peer.id) {
            metrics::counter!(crate::metrics::PEER_REFUSED, "reason" => "not_a_member")
                .increment(1);
            tracing::warn!(peer = %peer.name, "connection of a removed member closed");
            conn.close(
                tether_transport::ErrorCode::Unauthenticated.varint(),
                b"this node is no longer a member of the cluster",
            );
            return;
        }
        let raft = raft.clone();
        let sink = sink.clone();
        let peer = peer.clone();
        tokio::spawn(async move {
            let response = match recv.read_to_end(PEER_MESSAGE_BYTES_MAX).await {
                Err(e) => PeerResponse::BadRequest(e.to_string()),
                Ok(body) => match codec::decode_body::<Envelope>(&body) {
                    Err(e) => PeerResponse::BadRequest(e.to_string()),
                    Ok(env) if env.to != me => PeerResponse::WrongNode { actual: me },
                    Ok(env) => match check_sender(&peer, &env.request) {
                        Ok(()) => dispatch(&raft, sink.as_deref(), env.request).await,
                        Err(why) => {
                            metrics::counter!(crate::metrics::PEER_REFUSED, "reason" => "sender_mismatch")
                                .increment(1);
                            tracing::warn!(peer = %peer.name, %why, "peer request refused");
                            PeerResponse::BadRequest(why.to_string())
                        }
                    },
                },
            };
            if let Ok(bytes) = codec::encode_body(&response) {
                let _ = send.write_all(&bytes).await;
                let _ = send.finish();
            }
        });
    }
}

/// Whether `cmd` gives queues only to members of the group as this node knows it (its latest
/// membership, committed or not: a member being removed counts as gone).
pub(super) fn places_on_members(raft: &Raft, cmd: &MetaCommand) -> bool {
    let metrics = raft.metrics();
    let metrics = metrics.borrow();
    let membership = metrics.membership_config.membership();
    cmd.places_on_members_only(|n| membership.get_node(&n).is_some())
}

/// Whether this node leads the group, as far as it knows.
fn leads(raft: &Raft) -> bool {
    let metrics = raft.metrics();
    let metrics = metrics.borrow();
    metrics.current_leader == Some(metrics.id)
}

async fn dispatch(
    raft: &Raft,
    sink: Option<&dyn PublishSink>,
    request: PeerRequest,
) -> PeerResponse {
    match request {
        PeerRequest::AppendEntries(r) => PeerResponse::AppendEntries(raft.append_entries(r).await),
        PeerRequest::Vote(r) => PeerResponse::Vote(raft.vote(r).await),
        PeerRequest::InstallSnapshot(r) => {
            PeerResponse::InstallSnapshot(raft.install_snapshot(r).await)
        }
        PeerRequest::Write(cmd) => match cmd.validate() {
            // Refused by the leader only: a node that lost the lead may lag a member just
            // added, and its `client_write` names the leader to send the write to instead.
            Ok(()) if !places_on_members(raft, &cmd) && leads(raft) => {
                PeerResponse::BadRequest(ClusterError::from(CommandRefused::NotAMember).to_string())
            }
            Ok(()) => PeerResponse::Write(raft.client_write(cmd).await),
            Err(e) => PeerResponse::BadRequest(format!("metadata command refused: {e}")),
        },
        PeerRequest::ChangeMembers(change) => {
            // Adding a learner waits for it to catch up, however long: not past the caller.
            let wait = std::time::Duration::from_millis(FORWARD_TIMEOUT_MS);
            match tokio::time::timeout(wait, change.apply(raft)).await {
                Ok(r) => PeerResponse::Write(r),
                Err(_) => PeerResponse::BadRequest(format!(
                    "the membership change did not complete within {FORWARD_TIMEOUT_MS} ms (a new member not reachable, or not catching up?)"
                )),
            }
        }
        PeerRequest::ForwardCursor(peer) => match sink {
            Some(sink) => PeerResponse::ForwardCursor(sink.forward_cursor(&peer)),
            None => PeerResponse::ForwardCursor(None),
        },
        PeerRequest::Regions { after } => match sink {
            Some(sink) => sink.regions(after).await,
            None => PeerResponse::BadRequest("this node serves no regions".into()),
        },
        PeerRequest::Publish {
            origin,
            entries,
            floor,
            follows,
            log_start,
        } => match sink {
            Some(sink) => {
                sink.apply_forwarded(origin, entries, floor, follows, log_start)
                    .await
            }
            None => PeerResponse::PublishDeferred {
                through: 0,
                reason: "this node does not take publishes yet".into(),
                joining: false,
            },
        },
        PeerRequest::Replicate(msg) => match sink {
            Some(sink) => sink.replicate(msg).await,
            None => PeerResponse::Replicated(None),
        },
        PeerRequest::Ping => PeerResponse::Pong,
        PeerRequest::ListQueues(q) => match sink {
            Some(sink) => sink.list_queues(q).await,
            None => PeerResponse::Queues(crate::admin::Page::default()),
        },
    }
}

/// openraft's network factory: makes one [`PeerClient`] per target.
#[derive(Clone)]
pub struct PeerNetwork {
    pub pool: Arc<PeerPool>,
    /// Addresses from this node's configuration; they win over the ones recorded in the
    /// membership, so moving a node to a new address is a configuration change.
    pub addresses: Arc<HashMap<NodeId, String>>,
}

impl RaftNetworkFactory<TypeConfig> for PeerNetwork {
    type Network = PeerClient;

    async fn new_client(&mut self, target: NodeId, node: &PeerNode) -> PeerClient {
        let mut node = node.clone();
        if let Some(addr) = self.addresses.get(&target) {
            node.addr.clone_from(addr);
        }
        PeerClient {
            pool: Arc::clone(&self.pool),
            target,
            node,
        }
    }
}

/// openraft's RPC client towards one node. Connects lazily (on the first RPC).
pub struct PeerClient {
    pool: Arc<PeerPool>,
    target: NodeId,
    node: PeerNode,
}

type RpcResult<T, E = openraft::error::Infallible> =
    Result<T, RPCError<NodeId, PeerNode, RaftError<NodeId, E>>>;

impl PeerClient {
    async fn call(
        &self,
        request: PeerRequest,
        option: &RPCOption,
    ) -> Result<PeerResponse, RPCError<NodeId, PeerNode, RaftError<NodeId, InstallSnapshotError>>>
    {
        match self
            .pool
            .call(self.target, &self.node.addr, request, option.hard_ttl())
            .await
        {
            Ok(PeerResponse::WrongNode { actual }) => {
                let e = PeerError::Unreachable {
                    addr: self.node.addr.clone(),
                    reason: format!("node {actual:x} answers there, not {:x}", self.target),
                };
                Err(RPCError::Unreachable(Unreachable::new(&e)))
            }
            Ok(PeerResponse::BadRequest(reason)) => {
                let e = PeerError::Network {
                    addr: self.node.addr.clone(),
                    reason,
                };
                Err(RPCError::Network(NetworkError::new(&e)))
            }
            Ok(r) => Ok(r),
            Err(e @ PeerError::Unreachable { .. }) => {
                Err(RPCError::Unreachable(Unreachable::new(&e)))
            }
            Err(e) => Err(RPCError::Network(NetworkError::new(&e))),
        }
    }

    fn remote<E: std::error::Error>(
        &self,
        e: RaftError<NodeId, E>,
    ) -> RPCError<NodeId, PeerNode, RaftError<NodeId, E>> {
        RPCError::RemoteError(RemoteError::new_with_node(
            self.target,
            self.node.clone(),
            e,
        ))
    }
}

/// Re-types a transport-level RPC error (which never carries a remote error) for another
/// RPC's error type.
fn retype<E: std::error::Error>(
    e: RPCError<NodeId, PeerNode, RaftError<NodeId, InstallSnapshotError>>,
) -> RPCError<NodeId, PeerNode, RaftError<NodeId, E>> {
    match e {
        RPCError::Timeout(t) => RPCError::Timeout(t),
        RPCError::Unreachable(u) => RPCError::Unreachable(u),
        RPCError::PayloadTooLarge(p) => RPCError::PayloadTooLarge(p),
        RPCError::Network(n) => RPCError::Network(n),
        RPCError::RemoteError(r) => RPCError::Network(NetworkError::new(&r)),
    }
}

fn unexpected<E: std::error::Error>(
    addr: &str,
) -> RPCError<NodeId, PeerNode, RaftError<NodeId, E>> {
    let e = PeerError::Network {
        addr: addr.to_string(),
        reason: "response of the wrong kind".into(),
    };
    RPCError::Network(NetworkError::new(&e))
}

impl RaftNetwork<TypeConfig> for PeerClient {
    async fn append_entries(
        &mut self,
        rpc: AppendEntriesRequest<TypeConfig>,
        option: RPCOption,
    ) -> RpcResult<AppendEntriesResponse<NodeId>> {
        match self.call(PeerRequest::AppendEntries(rpc), &option).await {
            Ok(PeerResponse::AppendEntries(Ok(r))) => Ok(r),
            Ok(PeerResponse::AppendEntries(Err(e))) => Err(self.remote(e)),
            Ok(_) => Err(unexpected(&self.node.addr)),
            Err(e) => Err(retype(e)),
        }
    }

    async fn install_snapshot(
        &mut self,
        rpc: InstallSnapshotRequest<TypeConfig>,
        option: RPCOption,
    ) -> RpcResult<InstallSnapshotResponse<NodeId>, InstallSnapshotError> {
        match self.call(PeerRequest::InstallSnapshot(rpc), &option).await {
            Ok(PeerResponse::InstallSnapshot(Ok(r))) => Ok(r),
            Ok(PeerResponse::InstallSnapshot(Err(e))) => Err(self.remote(e)),
            Ok(_) => Err(unexpected(&self.node.addr)),
            Err(e) => Err(e),
        }
    }

    async fn vote(
        &mut self,
        rpc: VoteRequest<NodeId>,
        option: RPCOption,
    ) -> RpcResult<VoteResponse<NodeId>> {
        match self.call(PeerRequest::Vote(rpc), &option).await {
            Ok(PeerResponse::Vote(Ok(r))) => Ok(r),
            Ok(PeerResponse::Vote(Err(e))) => Err(self.remote(e)),
            Ok(_) => Err(unexpected(&self.node.addr)),
            Err(e) => Err(retype(e)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::replication::AppendHeader;

    fn replicate(from: NodeId) -> PeerRequest {
        PeerRequest::Replicate(ReplicateMsg {
            from,
            durable_id: "q".into(),
            header: ReplicateHeader::Append(AppendHeader {
                epoch: 1,
                batch: 1,
                first: 0,
                last: 0,
                prev_epoch: None,
                entries_epoch: 1,
                log_end: 0,
                acked: 0,
            }),
            sent_ms: 0,
            info: Vec::new(),
            entries: Vec::new(),
            more: false,
            through: Default::default(),
            through_end: 0,
            placement_epoch: 0,
        })
    }

    #[test]
    fn a_request_is_of_the_version_that_brought_it() {
        use super::super::MembershipChange;
        use super::super::meta::PEER_VERSION_MEMBERSHIP as V2;
        let draining = MetaCommand::SetDraining {
            node: raft_id("n2"),
            draining: true,
        };
        let barrier = MetaCommand::Barrier;
        let entry = |cmd: &MetaCommand| openraft::Entry::<TypeConfig> {
            log_id: openraft::LogId::new(openraft::CommittedLeaderId::new(1, raft_id("n1")), 1),
            payload: openraft::EntryPayload::Normal(cmd.clone()),
        };
        let append = |cmds: &[&MetaCommand]| {
            PeerRequest::AppendEntries(AppendEntriesRequest {
                vote: openraft::Vote::new_committed(1, raft_id("n1")),
                prev_log_id: None,
                entries: cmds.iter().map(|c| entry(c)).collect(),
                leader_commit: None,
            })
        };
        for (request, version) in [
            (PeerRequest::Ping, 1),
            (replicate(raft_id("n1")), 1),
            (PeerRequest::Write(barrier.clone()), 1),
            (append(&[]), 1),
            (append(&[&barrier]), 1),
            (PeerRequest::Write(draining.clone()), V2),
            (append(&[&barrier, &draining]), V2),
            (
                PeerRequest::ChangeMembers(MembershipChange::Remove(raft_id("n2"))),
                V2,
            ),
            (PeerRequest::ForwardCursor("n1".into()), V2),
            (PeerRequest::Regions { after: None }, V2),
        ] {
            let name = format!("{:?}", std::mem::discriminant(&request));
            assert_eq!(request.version_needed(), version, "{name}");
        }
    }

    #[test]
    fn a_peer_speaks_only_in_its_own_name() {
        let n2 = PeerIdentity {
            id: raft_id("n2"),
            name: "n2".into(),
        };
        let n3 = raft_id("n3");
        let vote = |candidate| {
            PeerRequest::Vote(VoteRequest::new(openraft::Vote::new(7, candidate), None))
        };
        let publish = |origin: &str| PeerRequest::Publish {
            origin: origin.into(),
            log_start: 0,
            entries: Vec::new(),
            floor: 0,
            follows: None,
        };
        assert_eq!(check_sender(&n2, &vote(n2.id)), Ok(()));
        assert_eq!(check_sender(&n2, &publish("n2")), Ok(()));
        assert_eq!(check_sender(&n2, &replicate(n2.id)), Ok(()));
        assert_eq!(check_sender(&n2, &PeerRequest::Ping), Ok(()));
        assert_eq!(
            check_sender(&n2, &PeerRequest::Write(MetaCommand::Barrier)),
            Ok(())
        );
        let e = check_sender(&n2, &vote(n3)).unwrap_err().to_string();
        assert!(
            e.contains("vote request") && e.contains(&format!("{n3:x}")),
            "{e}"
        );
        let e = check_sender(&n2, &publish("n3")).unwrap_err().to_string();
        assert!(e.contains("origin \"n3\""), "{e}");
        let e = check_sender(&n2, &replicate(n3)).unwrap_err().to_string();
        assert!(e.contains("replication"), "{e}");
    }
}
