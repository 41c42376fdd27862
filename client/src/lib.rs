//! Tether's client library: what a service embeds to subscribe to durable queues and publish,
//! without the server (this crate does not build RocksDB or the consensus crates; the `tether`
//! crate re-exports it as `tether::client`, and its [`protocol`] as `tether::protocol`).
//!
//! [`ClientBuilder`] connects to the first reachable server of its list over QUIC+TLS and
//! learns the queue status ([`Client::queue_status`], [`Client::pending`]) before any event.
//! Interest is registered through a [`Region`] handle. Events arrive, after
//! [`Client::ready_for_events`], on an [`EventStream`] (an async `Stream`) or through a
//! [`Listener`] driven by [`EventStream::run_listener`]; [`EventStream::next_batch`] hands
//! out a delivery frame's events at once, read in place (no allocation per event).
//!
//! Acknowledgements are cumulative and periodic: an event counts as processed once the
//! application asks the stream for the next one (or closes the client), or, with
//! [`AckMode::Manual`], once the application acks it and everything shown before it; the
//! highest processed offset is acked every `ack_interval`. Events already processed are
//! dropped ([`DedupState`], shareable across reconnects in one process; across a restart of
//! the process, through the application's [`ClientBuilder::checkpoint`]). A [`Subscription`]
//! reconnects by itself.
//!
//! `client/tests/dependencies.rs` fails if this crate's dependency tree ever holds RocksDB or
//! openraft.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use tether_transport::codec::{self, FrameReader};
use tether_transport::{PROTOCOL_VERSION, tls};
use tokio::sync::{Mutex as AsyncMutex, mpsc, oneshot};

mod acks;
mod batch;
pub mod protocol;
mod publisher;
mod reconnect;

pub use crate::acks::{AckError, AckMode, AckTracker};
use crate::batch::EntryIndex;
pub use crate::batch::{EventBatch, EventView, StreamBatch};
use crate::protocol::*;
pub use crate::publisher::Publisher;
pub use crate::reconnect::{
    Backoff, RECONNECT_ATTEMPT_TIMEOUT_MS_DEFAULT, RECONNECT_DELAY_INITIAL_MS_DEFAULT,
    RECONNECT_DELAY_MAX_MS_DEFAULT, RECONNECT_GIVE_UP_SECS_DEFAULT, ReconnectPolicy, Subscription,
};

/// Client-side default acknowledgement interval, in milliseconds.
pub const ACK_INTERVAL_MS_DEFAULT: u64 = 100;
/// Durable timeout used when a client presents none, in seconds.
pub const DURABLE_TIMEOUT_SECS_DEFAULT: u64 = 300;

/// Whether a server that refused a connection with `code` leaves room for another server of the
/// list to accept it: it cannot serve now (`unavailable`: cut off from the cluster, catching up,
/// a queue moving; `shutdown`: stopping), which another member may. Other refusals (credentials,
/// permissions, a bad argument, limits) would be the same anywhere.
fn another_may_serve(code: ErrorCode) -> bool {
    matches!(code, ErrorCode::Unavailable | ErrorCode::Shutdown)
}

/// Most redirects a connection attempt follows.
pub const REDIRECTS_MAX: usize = 3;

/// How one connection attempt ended.
enum Attempt {
    Connected(Box<Client>),
    /// The node does not hold this durable queue; the one at this address (`IP:PORT` or
    /// `HOST:PORT`, as the cluster's member list gives it) does, by the placement of this
    /// epoch (named in the next hello).
    Redirect(String, Option<u64>),
}

/// Batches of decoded events buffered between the delivery stream and the application (each
/// holds at most `DECODE_BATCH_EVENTS` events of one delivery frame); beyond it QUIC flow
/// control pushes back.
pub const CLIENT_BUFFERED_FRAMES_MAX: usize = 32;
/// How long to wait for a server's welcome, in milliseconds.
pub const CONNECT_TIMEOUT_MS: u64 = 10_000;

/// Errors of the client library.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    #[error("no server configured")]
    NoServer,
    #[error("cannot load the CA certificate: {0}")]
    Tls(#[from] tls::TlsError),
    #[error("cannot reach any server ({0})")]
    Connect(String),
    #[error("server refused: {0}")]
    Server(#[from] WireError),
    #[error("protocol error: {0}")]
    Protocol(String),
    #[error("the connection is closed")]
    Closed,
    #[error("{0}")]
    Usage(String),
}

/// An entry event as the application sees it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Event {
    pub region: String,
    pub key: String,
    pub op: EventOp,
    pub value: Option<Vec<u8>>,
    pub offset: u64,
    pub event_id: EventId,
    /// Queued before the client said it was ready.
    pub replayed: bool,
    /// Sent to this durable id before and not acknowledged.
    pub possible_duplicate: bool,
}

/// What the event stream yields.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ClientEvent {
    Event(Event),
    /// The live marker: everything queued before ready has been delivered. The first marker of
    /// a session ends the replay and lists the regions the queue had interest in (none if it
    /// had none); a region that gets interest later gets a marker of its own. Each region is
    /// announced once per session; a client resuming a queue with the [`DedupState`] of an
    /// earlier client whose server failed under it (a failover) is not told again.
    Live {
        regions: Vec<String>,
    },
    /// Only from a [`Subscription`]: the connection was lost (`error` says why); the
    /// subscription is reconnecting. Events processed before it are not shown again.
    Disconnected {
        error: String,
    },
    /// Only from a [`Subscription`]: connected again, with the queue status and pending count
    /// of the new session's welcome (`resumed`: nothing was lost; `expired` or `new`: the queue
    /// did not survive the outage, and its events are gone).
    Reconnected {
        queue: QueueStatus,
        pending: Option<u64>,
    },
}

/// Callbacks for events, as in Geode's `CacheListener`.
pub trait Listener: Send {
    fn after_create(&mut self, _event: &Event) {}
    fn after_update(&mut self, _event: &Event) {}
    fn after_destroy(&mut self, _event: &Event) {}
    fn after_invalidate(&mut self, _event: &Event) {}
    fn after_region_live(&mut self, _region: &str) {}
    /// A [`Subscription`] lost its connection and is reconnecting.
    fn after_disconnect(&mut self, _error: &str) {}
    /// A [`Subscription`] is connected again.
    fn after_reconnect(&mut self, _queue: QueueStatus, _pending: Option<u64>) {}
}

/// What this process has already processed of one durable queue, so events redelivered
/// after a reconnect (flagged `possible_duplicate`) are dropped instead of shown twice; and,
/// on a cluster, which nodes hold the queue, so a client whose session was lost fails over to
/// the queue's copies (client-managed failover, see [`ClientBuilder::connect`]).
///
/// A queue entry keeps its offset and its event id when it is redelivered, and offsets are
/// never reused within a queue's life, so "already processed" is "offset at or below the
/// highest offset processed": O(1), no per-event set. The state resets itself when the server
/// reports the queue `new` or `expired` (offsets start again) or when it is handed to a client
/// with another durable id. Clone it into the builder of a reconnecting client.
#[derive(Clone, Default)]
pub struct DedupState(Arc<Mutex<DedupInner>>);

#[derive(Default)]
struct DedupInner {
    durable_id: Option<String>,
    /// What is processed (cumulatively) and, with manual acks, what is in progress.
    acks: AckTracker,
    /// Whether the queue's live marker was shown, and for which regions: a resumed session
    /// (after a reconnect or a failover) announces only regions not announced before.
    live_shown: bool,
    live_regions: std::collections::BTreeSet<String>,
    /// The queue's servers as the latest session's welcome named them, until the application
    /// ends a session itself: a session that was lost instead fails over to the copies.
    queue_servers: Vec<QueueServer>,
    /// The newest entry of the queue received from a server, told to the next server in the
    /// hello (`DurableHello::seen`).
    seen: Option<SeenEntry>,
}

impl DedupState {
    /// Binds the state to the session that just connected; a `checkpoint` (the application's
    /// own record of what it processed) counts for a resumed queue.
    fn attach(
        &self,
        durable_id: Option<&str>,
        status: QueueStatus,
        servers: &[QueueServer],
        checkpoint: Option<u64>,
        diverged: bool,
    ) {
        let mut d = self.0.lock().unwrap_or_else(|p| p.into_inner());
        if d.durable_id.as_deref() != durable_id || status != QueueStatus::Resumed {
            d.durable_id = durable_id.map(str::to_string);
            d.acks.reset(0);
            d.live_shown = false;
            d.live_regions.clear();
            d.seen = None;
        } else if diverged {
            // The server's offsets no longer match the ones processed here: an offset says
            // nothing about an event any more (every entry comes flagged possible_duplicate).
            tracing::warn!(
                durable_id = ?durable_id,
                "the server's queue lost entries this client saw: processed offsets forgotten"
            );
            d.acks.reset(0);
            d.seen = None;
        }
        // A diverged queue's offsets no longer name the events the checkpoint counted.
        if let Some(c) = checkpoint
            && status == QueueStatus::Resumed
            && !diverged
        {
            d.acks.processed(c);
        }
        d.queue_servers = servers.to_vec();
    }

    /// Client-managed failover: if the last session of durable id `id` was lost (not ended by
    /// the application), the node id of its primary and the addresses of the queue's copies.
    fn lost_primary(&self, id: &str) -> Option<(String, Vec<String>)> {
        let d = self.0.lock().unwrap_or_else(|p| p.into_inner());
        if d.durable_id.as_deref() != Some(id) {
            return None;
        }
        let primary = d.queue_servers.iter().find(|s| s.primary)?;
        let copies = d
            .queue_servers
            .iter()
            .filter(|s| !s.primary)
            .map(|s| s.addr.clone())
            .collect();
        Some((primary.node_id.clone(), copies))
    }

    /// The client ended its session itself (a close or a crash): its next session is told
    /// live again, as any reconnecting durable client. Only a session whose server failed
    /// under it resumes without a second marker.
    fn forget_live(&self) {
        let mut d = self.0.lock().unwrap_or_else(|p| p.into_inner());
        d.live_shown = false;
        d.live_regions.clear();
        d.queue_servers.clear();
    }

    /// Filters a live marker: None if everything it announces was announced already to this
    /// process for this queue (a session resumed after its server failed).
    fn live(&self, regions: Vec<String>) -> Option<Vec<String>> {
        let mut d = self.0.lock().unwrap_or_else(|p| p.into_inner());
        if d.durable_id.is_none() {
            return Some(regions); // Non-durable: every session is new.
        }
        let fresh: Vec<String> = regions
            .into_iter()
            .filter(|r| !d.live_regions.contains(r))
            .collect();
        if d.live_shown && fresh.is_empty() {
            return None;
        }
        d.live_shown = true;
        d.live_regions.extend(fresh.iter().cloned());
        Some(fresh)
    }

    fn processed(&self, offset: u64) {
        let mut d = self.0.lock().unwrap_or_else(|p| p.into_inner());
        d.acks.processed(offset);
    }

    /// The newest entry of durable queue `id` received, if this state holds that queue.
    fn seen(&self, id: &str) -> Option<SeenEntry> {
        let d = self.0.lock().unwrap_or_else(|p| p.into_inner());
        if d.durable_id.as_deref() != Some(id) {
            return None;
        }
        d.seen.clone()
    }

    /// An entry at `offset` (with `event_id`, when decoded) was received.
    fn saw(&self, offset: u64, event_id: Option<EventId>) {
        let mut d = self.0.lock().unwrap_or_else(|p| p.into_inner());
        if d.durable_id.is_some() && d.seen.as_ref().is_none_or(|s| s.offset < offset) {
            d.seen = Some(SeenEntry { offset, event_id });
        }
    }

    fn processed_through(&self) -> u64 {
        self.0
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .acks
            .through()
    }

    /// Whether `offset` was shown and is still being worked on (manual acks).
    fn in_progress(&self, offset: u64) -> bool {
        self.0
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .acks
            .in_progress(offset)
    }

    /// No offset above this one is in progress (see [`AckTracker::highest_shown`]): one lock
    /// per delivery frame instead of one per event.
    fn highest_shown(&self) -> u64 {
        self.0
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .acks
            .highest_shown()
    }

    fn shown(&self, offset: u64) {
        let mut d = self.0.lock().unwrap_or_else(|p| p.into_inner());
        d.acks.shown(offset);
    }

    /// [`DedupState::shown`] for each offset, under one lock.
    fn shown_many(&self, offsets: impl Iterator<Item = u64>) {
        let mut d = self.0.lock().unwrap_or_else(|p| p.into_inner());
        for offset in offsets {
            d.acks.shown(offset);
        }
    }

    fn ack(&self, offset: u64) -> Result<u64, AckError> {
        let mut d = self.0.lock().unwrap_or_else(|p| p.into_inner());
        d.acks.ack(offset)
    }

    /// Acks every offset under one lock; the first refusal, if any, after acking the rest.
    fn ack_many(&self, offsets: &[u64]) -> Result<u64, AckError> {
        let mut d = self.0.lock().unwrap_or_else(|p| p.into_inner());
        let mut refused = None;
        for &o in offsets {
            if let Err(e) = d.acks.ack(o) {
                refused.get_or_insert(e);
            }
        }
        match refused {
            Some(e) => Err(e),
            None => Ok(d.acks.through()),
        }
    }
}

/// Builds a [`Client`].
#[derive(Clone)]
pub struct ClientBuilder {
    servers: Vec<SocketAddr>,
    ca_file: Option<PathBuf>,
    ca_pem: Option<Vec<u8>>,
    durable: Option<DurableHello>,
    redundancy: u8,
    failure_timeout: Option<Duration>,
    publish_ack: PublishAck,
    token: Option<String>,
    identity: Option<(PathBuf, PathBuf)>,
    ack_interval: Duration,
    name: String,
    /// Shared with an earlier client only when set explicitly: clones of a builder must not
    /// share one (each durable id has its own processed offsets).
    dedup: Option<DedupState>,
    /// The name every server certificate is verified against, overriding `names`.
    server_name: Option<String>,
    /// The name each server's certificate is verified against, by address (absent:
    /// [`tls::SERVER_NAME`], the dev certificates' name).
    names: HashMap<SocketAddr, String>,
    /// How long one server may take to welcome us.
    attempt_timeout: Duration,
    /// How a [`Subscription`] reconnects.
    reconnect: ReconnectPolicy,
    ack_mode: AckMode,
    checkpoint: Option<u64>,
    /// Events per second the replay is paced at (0: unlimited).
    replay_rate: u64,
}

impl Default for ClientBuilder {
    fn default() -> Self {
        Self::new()
    }
}

impl ClientBuilder {
    pub fn new() -> Self {
        ClientBuilder {
            servers: Vec::new(),
            ca_file: None,
            ca_pem: None,
            durable: None,
            redundancy: 0,
            failure_timeout: None,
            publish_ack: PublishAck::Local,
            token: None,
            identity: None,
            ack_interval: Duration::from_millis(ACK_INTERVAL_MS_DEFAULT),
            name: "tether-client".into(),
            dedup: None,
            server_name: None,
            names: HashMap::new(),
            attempt_timeout: Duration::from_millis(CONNECT_TIMEOUT_MS),
            reconnect: ReconnectPolicy::default(),
            ack_mode: AckMode::Auto,
            checkpoint: None,
            replay_rate: 0,
        }
    }

    /// Adds a server to try (in order).
    pub fn server(mut self, addr: SocketAddr) -> Self {
        self.servers.push(addr);
        self
    }

    pub fn servers(mut self, addrs: impl IntoIterator<Item = SocketAddr>) -> Self {
        self.servers.extend(addrs);
        self
    }

    /// Adds a server reached at `addr` whose certificate must be valid for `name` (the host
    /// name it was resolved from). A redirect to that address, or a queue's copy there, is
    /// verified against the same name.
    pub fn server_named(mut self, addr: SocketAddr, name: impl Into<String>) -> Self {
        self.servers.push(addr);
        self.names.insert(addr, name.into());
        self
    }

    /// The name every server's certificate must be valid for (a DNS name or an IP address),
    /// overriding the names given with [`server_named`](Self::server_named). Default: the
    /// server's own name, else `localhost` ([`tls::SERVER_NAME`]), the name of the dev
    /// certificates.
    pub fn server_name(mut self, name: impl Into<String>) -> Self {
        self.server_name = Some(name.into());
        self
    }

    /// The CA certificate (PEM file) to trust.
    pub fn ca_file(mut self, path: impl Into<PathBuf>) -> Self {
        self.ca_file = Some(path.into());
        self
    }

    /// The CA certificate (PEM bytes) to trust.
    pub fn ca_pem(mut self, pem: impl Into<Vec<u8>>) -> Self {
        self.ca_pem = Some(pem.into());
        self
    }

    /// Makes the client durable with this id and timeout (seconds; the latest presented wins).
    pub fn durable(mut self, id: impl Into<String>, timeout_secs: u64) -> Self {
        self.durable = Some(DurableHello {
            redirect_epoch: None,
            id: id.into(),
            timeout_secs,
            redundancy: self.redundancy,
            failed_primary: None,
            seen: None,
        });
        self
    }

    /// Secondary copies of the durable queue on a cluster (0 to 2): with 1 or more the queue
    /// survives the death of the node holding it, online or away. Taken when the queue is
    /// created; ignored by a single node.
    pub fn redundancy(mut self, copies: u8) -> Self {
        self.redundancy = copies;
        if let Some(d) = &mut self.durable {
            d.redundancy = copies;
        }
        self
    }

    /// How long the server may stay silent before the connection counts as lost (the QUIC idle
    /// timeout; keep-alives go out at a third of it). Default 30 s. A client of a cluster with
    /// redundancy sets it low (a few seconds) to fail over quickly when its server dies.
    pub fn failure_timeout(mut self, timeout: Duration) -> Self {
        self.failure_timeout = Some(timeout);
        self
    }

    /// When this client's publishes are acknowledged: [`PublishAck::Local`] (default) or
    /// [`PublishAck::Replicated`] (every matching queue and its copies hold them).
    pub fn publish_ack(mut self, ack: PublishAck) -> Self {
        self.publish_ack = ack;
        self
    }

    /// Durable with the default timeout (300 s).
    pub fn durable_id(self, id: impl Into<String>) -> Self {
        self.durable(id, DURABLE_TIMEOUT_SECS_DEFAULT)
    }

    /// The bearer token to present (servers with `[auth]` require one).
    pub fn token(mut self, token: impl Into<String>) -> Self {
        self.token = Some(token.into());
        self
    }

    /// A client certificate chain and its key (PEM files), for servers that authenticate
    /// clients by certificate (mutual TLS). Needs [`ca_file`](Self::ca_file).
    pub fn identity(mut self, cert: impl Into<PathBuf>, key: impl Into<PathBuf>) -> Self {
        self.identity = Some((cert.into(), key.into()));
        self
    }

    pub fn ack_interval(mut self, every: Duration) -> Self {
        self.ack_interval = every;
        self
    }

    /// Paces the replay of stored events at most at `events_per_s` (0: unlimited, the
    /// default), asked of the server before each [`Client::ready_for_events`] (so after every
    /// reconnect of a [`Subscription`] too); live events are never paced. For a consumer that
    /// must not be flooded by its backlog, or to leave a shared server's capacity to others.
    pub fn replay_rate(mut self, events_per_s: u64) -> Self {
        self.replay_rate = events_per_s;
        self
    }

    pub fn name(mut self, name: impl Into<String>) -> Self {
        self.name = name.into();
        self
    }

    /// Shares processed-event ids with an earlier client of this process.
    pub fn dedup_state(mut self, state: DedupState) -> Self {
        self.dedup = Some(state);
        self
    }

    /// When an event counts as processed: [`AckMode::Auto`] (default: when the application
    /// asks for the next one) or [`AckMode::Manual`] (when the application acks its offset,
    /// in any order; see [`EventStream::ack`]). With manual acks, an application that never
    /// acks stops receiving once the server's in-flight window is full.
    pub fn ack_mode(mut self, mode: AckMode) -> Self {
        self.ack_mode = mode;
        self
    }

    /// The application's checkpoint for its durable queue: every offset up to `offset` is
    /// processed (kept by the application with its own data, so it survives a restart of the
    /// client process). Entries at or below it are acked and never shown; applied only when
    /// the queue is `resumed` (a `new` or `expired` queue numbers its entries from 1 again) and
    /// did not diverge ([`Client::diverged`]: its offsets no longer name the same events).
    /// [`Client::ready_for_events`] refuses a checkpoint beyond the queue's end.
    pub fn checkpoint(mut self, offset: u64) -> Self {
        self.checkpoint = Some(offset);
        self
    }

    /// How a [`Subscription`] made by [`subscribe`](Self::subscribe) reconnects (default:
    /// [`ReconnectPolicy::default`]).
    pub fn reconnect(mut self, policy: ReconnectPolicy) -> Self {
        self.reconnect = policy;
        self
    }

    /// Connects to the first server that answers with a welcome. A server that refuses with
    /// `unavailable` or `shutdown` (it cannot serve now, another member may) is passed over for
    /// the next; that refusal is returned if no server welcomes the client. Other refusals
    /// (credentials, permissions, a bad argument) are returned at once.
    ///
    /// With the [`DedupState`] of a durable session that was lost (its connection died; the
    /// application did not close it), the queue's copies are tried first, naming the lost
    /// primary: a copy that cannot reach that node either is promoted and serves the queue.
    pub async fn connect(self) -> Result<Client, ClientError> {
        tls::install_crypto_provider();
        if self.servers.is_empty() {
            return Err(ClientError::NoServer);
        }
        let mut config = match (&self.ca_pem, &self.ca_file) {
            (_, Some(f)) if self.identity.is_some() => {
                let (cert, key) = self.identity.as_ref().expect("checked");
                tls::client_config_with_identity(f, cert, key)?
            }
            (_, None) if self.identity.is_some() => {
                return Err(ClientError::Usage(
                    "a client certificate needs the CA as a file (ca_file)".into(),
                ));
            }
            (Some(pem), _) => tls::client_config_from_pem(pem)?,
            (None, Some(f)) => tls::client_config(f)?,
            (None, None) => {
                return Err(ClientError::Usage(
                    "no CA certificate given (ca_file or ca_pem)".into(),
                ));
            }
        };
        if let Some(t) = self.failure_timeout {
            let mut transport = tls::transport_config();
            let idle = quinn::IdleTimeout::try_from(t)
                .map_err(|_| ClientError::Usage("failure timeout too large".into()))?;
            transport.max_idle_timeout(Some(idle));
            transport.keep_alive_interval(Some(t / 3));
            config.transport_config(Arc::new(transport));
        }
        // Client-managed failover (as Geode's): after losing its primary, a client goes to the
        // queue's copies first, naming the lost node; a copy that cannot reach it either takes
        // over (see `docs/cluster.md`). The configured servers come after.
        let mut this = self;
        let mut servers = this.servers.clone();
        let lost = match (&this.dedup, &this.durable) {
            (Some(dedup), Some(d)) => dedup.lost_primary(&d.id),
            _ => None,
        };
        let lost = match lost {
            Some((primary, addrs)) => {
                let mut copies = Vec::with_capacity(addrs.len());
                for a in &addrs {
                    match resolve_server(a, None).await {
                        Ok((sock, host)) => {
                            if let Some(h) = host {
                                this.names.entry(sock).or_insert(h);
                            }
                            copies.push(sock);
                        }
                        Err(e) => tracing::warn!(copy = %a, error = %e, "a copy's address"),
                    }
                }
                Some((primary, copies))
            }
            None => None,
        };
        if let (Some((primary, copies)), Some(d)) = (lost, this.durable.as_mut()) {
            tracing::info!(lost = %primary, copies = ?copies, "failing over to the queue's copies");
            d.failed_primary = Some(primary);
            servers.retain(|s| !copies.contains(s));
            servers.splice(0..0, copies);
        }
        let mut errors = Vec::new();
        let mut refused = None;
        // The newest placement epoch a redirect named: every later hello names it, so a node
        // with older metadata catches up instead of sending the client back.
        let mut redirect_epoch = None;
        for &first in &servers {
            let mut addr = first;
            // A cluster node that does not hold this durable queue redirects to the one that
            // does (a bounded number of hops: the placement can move while we follow it).
            for hop in 0..=REDIRECTS_MAX {
                match tokio::time::timeout(
                    this.attempt_timeout,
                    this.connect_one(addr, config.clone(), redirect_epoch),
                )
                .await
                {
                    Ok(Ok(Attempt::Connected(c))) => return Ok(*c),
                    Ok(Ok(Attempt::Redirect(to, epoch))) if hop < REDIRECTS_MAX => {
                        tracing::debug!(from = %addr, to = %to, ?epoch, "redirected");
                        redirect_epoch = redirect_epoch.max(epoch);
                        match resolve_server(&to, Some(addr)).await {
                            Ok((sock, host)) => {
                                // Verified against the member's own host name, unless the
                                // application named that address itself.
                                if let Some(h) = host {
                                    this.names.entry(sock).or_insert(h);
                                }
                                addr = sock;
                                continue;
                            }
                            Err(e) => errors.push(format!("{addr}: redirected to {to}: {e}")),
                        }
                    }
                    Ok(Ok(Attempt::Redirect(to, _))) => {
                        errors.push(format!("{addr}: too many redirects (last to {to})"));
                    }
                    // A member that cannot serve now (cut off from the cluster, stopping,
                    // catching up) may leave the queue to another: the next server is tried,
                    // and the refusal is the answer if none serves.
                    Ok(Err(ClientError::Server(e))) if another_may_serve(e.code) => {
                        tracing::debug!(server = %addr, error = %e, "refused; trying the next server");
                        errors.push(format!("{addr}: {e}"));
                        refused.get_or_insert(e);
                    }
                    Ok(Err(ClientError::Server(e))) => return Err(ClientError::Server(e)),
                    // Said once: "cannot reach any server" wraps the whole list.
                    Ok(Err(ClientError::Connect(e))) => errors.push(format!("{addr}: {e}")),
                    Ok(Err(e)) => errors.push(format!("{addr}: {e}")),
                    Err(_) => errors.push(format!("{addr}: timed out")),
                }
                break;
            }
        }
        match refused {
            Some(e) => Err(ClientError::Server(e)),
            None => Err(ClientError::Connect(errors.join("; "))),
        }
    }

    async fn connect_one(
        &self,
        addr: SocketAddr,
        config: quinn::ClientConfig,
        redirect_epoch: Option<u64>,
    ) -> Result<Attempt, ClientError> {
        let endpoint = tether_transport::endpoint::client_endpoint(config, addr)
            .map_err(|e| ClientError::Connect(e.to_string()))?;
        let name = self
            .server_name
            .as_deref()
            .or_else(|| self.names.get(&addr).map(String::as_str))
            .unwrap_or(tls::SERVER_NAME);
        let conn = endpoint
            .connect(addr, name)
            .map_err(|e| ClientError::Connect(e.to_string()))?
            .await
            .map_err(|e| {
                ClientError::Connect(if tls::no_common_protocol(&e) {
                    format!(
                        "the server speaks no version of the Tether protocol this client does \
                         (this client speaks {}): upgrade the client or the server",
                        String::from_utf8_lossy(tether_transport::ALPN)
                    )
                } else {
                    e.to_string()
                })
            })?;
        let (mut send, recv) = conn
            .open_bi()
            .await
            .map_err(|e| ClientError::Connect(e.to_string()))?;
        let mut durable = self.durable.clone();
        if let (Some(d), Some(dedup)) = (durable.as_mut(), &self.dedup) {
            d.seen = dedup.seen(&d.id);
        }
        if let Some(d) = durable.as_mut() {
            d.redirect_epoch = redirect_epoch;
        }
        let hello = ClientMsg::Hello {
            version: PROTOCOL_VERSION,
            durable,
            token: self.token.clone(),
            client: self.name.clone(),
            going_away: true,
        };
        codec::write_frame(&mut send, &hello)
            .await
            .map_err(|e| ClientError::Connect(e.to_string()))?;
        let mut reader = FrameReader::new(recv);
        let (node_id, status, pending, queue_servers, diverged) =
            match reader.next::<ServerMsg>().await {
                Ok(Some(ServerMsg::Welcome {
                    node_id,
                    queue,
                    pending,
                    queue_servers,
                    diverged,
                    ..
                })) => (node_id, queue, pending, queue_servers, diverged),
                Ok(Some(ServerMsg::Error(e))) => return Err(ClientError::Server(e)),
                Ok(Some(ServerMsg::Redirect {
                    addr: to,
                    node_id,
                    epoch,
                })) => {
                    conn.close(0u32.into(), b"redirected");
                    tracing::debug!(node = %node_id, to = %to, ?epoch, "redirect");
                    return Ok(Attempt::Redirect(to, epoch));
                }
                Ok(Some(other)) => {
                    return Err(ClientError::Protocol(format!(
                        "expected a welcome, got {other:?}"
                    )));
                }
                Ok(None) | Err(_) => {
                    return Err(match conn.close_reason() {
                        Some(r) => ClientError::Connect(r.to_string()),
                        None => ClientError::Connect("the server closed the stream".into()),
                    });
                }
            };
        let dedup = self.dedup.clone().unwrap_or_default();
        dedup.attach(
            self.durable.as_ref().map(|d| d.id.as_str()),
            status,
            &queue_servers,
            self.checkpoint,
            diverged,
        );
        let inner = Arc::new(Inner {
            send: AsyncMutex::new(send),
            pending: Mutex::new(HashMap::new()),
            next_id: AtomicU64::new(1),
            processed: AtomicU64::new(0),
            received: AtomicU64::new(0),
            acked: AtomicU64::new(0),
            conn: conn.clone(),
            dedup: dedup.clone(),
        });
        let (events_tx, events_rx) = mpsc::channel(CLIENT_BUFFERED_FRAMES_MAX);
        let control = tokio::spawn(control_task(inner.clone(), reader));
        let delivery = tokio::spawn(delivery_task(
            conn.clone(),
            inner.clone(),
            events_tx,
            dedup.clone(),
        ));
        let acker = tokio::spawn(ack_task(inner.clone(), self.ack_interval));
        Ok(Attempt::Connected(Box::new(Client {
            inner,
            endpoint,
            server: addr,
            node_id,
            status,
            pending,
            queue_servers,
            diverged,
            durable: self.durable.is_some(),
            events: Mutex::new(Some(events_rx)),
            dedup,
            publish_ack: self.publish_ack,
            ack_mode: self.ack_mode,
            checkpoint: self
                .checkpoint
                .filter(|_| status == QueueStatus::Resumed && !diverged),
            replay_rate: self.replay_rate,
            tasks: vec![control, delivery, acker],
        })))
    }
}

/// The address of a server given as `IP:PORT`, or `HOST:PORT` (resolved now, with the host
/// name its certificate is verified against). Of several addresses, one of the family of `like`
/// (the server that named this one), else IPv4, is taken first.
pub(crate) async fn resolve_server(
    target: &str,
    like: Option<SocketAddr>,
) -> Result<(SocketAddr, Option<String>), ResolveError> {
    if let Ok(a) = target.parse::<SocketAddr>() {
        return Ok((a, None));
    }
    let host = target
        .rsplit_once(':')
        .map(|(h, _)| h.trim_start_matches('[').trim_end_matches(']'))
        .filter(|h| !h.is_empty())
        .ok_or_else(|| ResolveError::Invalid(target.to_string()))?
        .to_string();
    let found: Vec<SocketAddr> = tokio::net::lookup_host(target)
        .await
        .map_err(|error| ResolveError::Lookup {
            target: target.to_string(),
            error,
        })?
        .collect();
    let v4 = like.is_none_or(|a| a.is_ipv4());
    let sock = found
        .iter()
        .find(|a| a.is_ipv4() == v4)
        .or(found.first())
        .copied()
        .ok_or_else(|| ResolveError::NoAddress(target.to_string()))?;
    Ok((sock, Some(host)))
}

/// Why a server's address (`HOST:PORT`) gave no socket address.
#[derive(Debug, thiserror::Error)]
pub(crate) enum ResolveError {
    #[error("invalid server address {0:?}")]
    Invalid(String),
    #[error("cannot resolve {target:?}: {error}")]
    Lookup {
        target: String,
        error: std::io::Error,
    },
    #[error("{0:?} resolves to no address")]
    NoAddress(String),
}

struct Inner {
    send: AsyncMutex<quinn::SendStream>,
    pending: Mutex<HashMap<u64, Waiter>>,
    next_id: AtomicU64,
    /// Processed through, as this session saw it (dropped redeliveries included).
    processed: AtomicU64,
    /// The highest offset this session was sent: no ack may pass it.
    received: AtomicU64,
    acked: AtomicU64,
    conn: quinn::Connection,
    /// What this process processed of the queue, over every session (manual acks, a
    /// checkpoint, earlier sessions).
    dedup: DedupState,
}

/// A request waiting for its answer.
struct Waiter {
    tx: oneshot::Sender<Result<ResponseBody, WireError>>,
    /// The parts of an initial image received so far (answers with `more` set).
    image: Vec<InitialEntry>,
}

impl Waiter {
    /// Takes one answer: `Some` once the request is answered in full.
    fn take(
        &mut self,
        result: Result<ResponseBody, WireError>,
    ) -> Option<Result<ResponseBody, WireError>> {
        match result {
            Ok(ResponseBody::Registered { mut initial, more }) => {
                if self.image.is_empty() {
                    self.image = initial;
                } else {
                    self.image.append(&mut initial);
                }
                (!more).then(|| {
                    Ok(ResponseBody::Registered {
                        initial: std::mem::take(&mut self.image),
                        more: false,
                    })
                })
            }
            other => Some(other),
        }
    }
}

impl Inner {
    async fn send(&self, msg: &ClientMsg) -> Result<(), ClientError> {
        let mut s = self.send.lock().await;
        // A write fails when the connection is gone: say why the server closed it, if it did.
        codec::write_frame(&mut s, msg)
            .await
            .map_err(|_| self.closed_error())
    }

    async fn call(&self, body: RequestBody) -> Result<ResponseBody, ClientError> {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = oneshot::channel();
        self.pending
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(
                id,
                Waiter {
                    tx,
                    image: Vec::new(),
                },
            );
        if let Err(e) = self.send(&ClientMsg::Request { id, body }).await {
            self.pending
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .remove(&id);
            return Err(e);
        }
        match rx.await {
            Ok(Ok(r)) => Ok(r),
            Ok(Err(e)) => Err(ClientError::Server(e)),
            Err(_) => Err(self.closed_error()),
        }
    }

    fn closed_error(&self) -> ClientError {
        match self.conn.close_reason() {
            Some(quinn::ConnectionError::ApplicationClosed(c)) => {
                let code = ErrorCode::from_varint(c.error_code).unwrap_or(ErrorCode::Internal);
                ClientError::Server(WireError::new(
                    code,
                    String::from_utf8_lossy(&c.reason).into_owned(),
                ))
            }
            _ => ClientError::Closed,
        }
    }

    async fn flush_ack(&self) -> Result<(), ClientError> {
        // Never beyond what this session was sent (the server refuses that): what an earlier
        // session or a checkpoint covers is acked as this session is sent it again.
        let p = self
            .processed
            .load(Ordering::Acquire)
            .max(self.dedup.processed_through())
            .min(self.received.load(Ordering::Acquire));
        if p > self.acked.load(Ordering::Acquire) {
            self.send(&ClientMsg::Ack { offset: p }).await?;
            self.acked.fetch_max(p, Ordering::AcqRel);
        }
        Ok(())
    }
}

async fn control_task(inner: Arc<Inner>, mut reader: FrameReader) {
    loop {
        match reader.next::<ServerMsg>().await {
            Ok(Some(ServerMsg::Response { id, result })) => {
                let mut pending = inner.pending.lock().unwrap_or_else(|p| p.into_inner());
                if let Some(waiter) = pending.get_mut(&id)
                    && let Some(result) = waiter.take(result)
                {
                    let waiter = pending.remove(&id).expect("just found");
                    let _ = waiter.tx.send(result);
                }
            }
            Ok(Some(ServerMsg::Ping { nonce })) => {
                if inner.send(&ClientMsg::Pong { nonce }).await.is_err() {
                    break;
                }
            }
            Ok(Some(ServerMsg::Error(e))) => {
                tracing::warn!(code = e.code.name(), message = %e.message, "server error");
                let waiting: Vec<_> = inner
                    .pending
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .drain()
                    .collect();
                for (_, waiter) in waiting {
                    let _ = waiter.tx.send(Err(e.clone()));
                }
            }
            Ok(Some(ServerMsg::Welcome { .. } | ServerMsg::Redirect { .. }))
            | Ok(None)
            | Err(_) => {
                break;
            }
        }
    }
    inner
        .pending
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .clear();
}

async fn delivery_task(
    conn: quinn::Connection,
    inner: Arc<Inner>,
    tx: mpsc::Sender<StreamBatch>,
    dedup: DedupState,
) {
    let Ok(recv) = conn.accept_uni().await else {
        return;
    };
    let mut reader = FrameReader::new(recv);
    while let Ok(Some(frame)) = reader.next_raw().await {
        match codec::decode_body::<Delivery<'_>>(&frame) {
            Ok(Delivery::Live(regions)) => {
                if let Some(regions) = dedup.live(regions)
                    && tx
                        .send(StreamBatch::Other(ClientEvent::Live { regions }))
                        .await
                        .is_err()
                {
                    return;
                }
            }
            Ok(Delivery::Events(entries)) => {
                let seen = dedup.processed_through();
                // Offsets shown later than this are ones this loop passed already (events are
                // shown in offset order), so only offsets at or below it can be in progress.
                let shown_through = dedup.highest_shown();
                let batch_len = entries.len().min(DECODE_BATCH_EVENTS);
                let mut out = Vec::with_capacity(batch_len);
                // The frame's newest entry, told to the next server of this queue.
                let newest = entries.last().map(|e| (e.offset, e.record));
                let mut newest_shown = None;
                for e in &entries {
                    if out.len() >= DECODE_BATCH_EVENTS {
                        // A replay's frame holds thousands of events: hand them over in
                        // batches and let the runtime's other tasks (another session's live
                        // events) run between them.
                        let full = std::mem::replace(&mut out, Vec::with_capacity(batch_len));
                        let batch = StreamBatch::Events(EventBatch::new(frame.clone(), full));
                        if tx.send(batch).await.is_err() {
                            return;
                        }
                        tokio::task::yield_now().await;
                    }
                    inner.received.fetch_max(e.offset, Ordering::AcqRel);
                    if e.offset <= seen {
                        // Processed by this process before (or under its checkpoint): not
                        // shown again, but acked. Offsets are never reused within a resumed
                        // queue's life, so the offset alone says it; such entries form a
                        // prefix of the replay, so acking them skips nothing.
                        inner.processed.fetch_max(e.offset, Ordering::AcqRel);
                        continue;
                    }
                    if e.offset <= shown_through && dedup.in_progress(e.offset) {
                        // Shown to the application, which is still working on it (manual
                        // acks): its ack will count; showing it again would run it twice.
                        continue;
                    }
                    // Decoded in place: only where its fields lie is kept (no allocation).
                    let Some(index) = EntryIndex::new(&frame, e.offset, e.flags, e.record) else {
                        tracing::warn!(offset = e.offset, "undecodable event record");
                        conn.close(
                            ErrorCode::MalformedFrame.varint(),
                            b"undecodable event record",
                        );
                        return;
                    };
                    out.push(index);
                    newest_shown = Some(e.offset);
                }
                let tail = EventBatch::new(frame.clone(), out);
                if let Some((offset, record)) = newest {
                    let id = if newest_shown == Some(offset) {
                        tail.last_event_id()
                    } else {
                        // Not shown (processed before): decoded for its id alone.
                        codec::decode_body::<EventRecordRef<'_>>(record)
                            .ok()
                            .map(|r| r.id.to_event_id())
                    };
                    dedup.saw(offset, id);
                }
                drop(entries);
                if !tail.is_empty() && tx.send(StreamBatch::Events(tail)).await.is_err() {
                    return;
                }
            }
            Err(e) => {
                tracing::warn!(error = %e, "undecodable delivery frame");
                conn.close(
                    ErrorCode::MalformedFrame.varint(),
                    b"undecodable delivery frame",
                );
                return;
            }
        }
    }
}

/// Events decoded from a delivery frame before they are handed to the application's stream
/// and the task yields to the runtime.
const DECODE_BATCH_EVENTS: usize = 256;

async fn ack_task(inner: Arc<Inner>, every: Duration) {
    // The first ack goes out one interval after connecting, not whenever this task first runs.
    let mut interval = tokio::time::interval_at(tokio::time::Instant::now() + every, every);
    loop {
        interval.tick().await;
        if inner.flush_ack().await.is_err() {
            return;
        }
    }
}

/// A connected client.
pub struct Client {
    inner: Arc<Inner>,
    endpoint: quinn::Endpoint,
    server: SocketAddr,
    node_id: String,
    status: QueueStatus,
    pending: Option<u64>,
    queue_servers: Vec<QueueServer>,
    diverged: bool,
    durable: bool,
    events: Mutex<Option<mpsc::Receiver<StreamBatch>>>,
    dedup: DedupState,
    publish_ack: PublishAck,
    ack_mode: AckMode,
    /// The checkpoint presented, if the queue was resumed (checked at ready).
    checkpoint: Option<u64>,
    /// The replay rate asked for at ready (events per second; 0: unlimited).
    replay_rate: u64,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl Client {
    /// `new`, `expired` or `resumed` for durable clients; `none` otherwise.
    pub fn queue_status(&self) -> QueueStatus {
        self.status
    }

    /// Events waiting after the acked offset, when the queue was resumed.
    pub fn pending(&self) -> Option<u64> {
        self.pending
    }

    /// Whether the server's resumed queue lost entries this client had received in an earlier
    /// session of this process (see `docs/protocol.md`): every entry it replays is flagged
    /// `possible_duplicate`, and offsets processed before no longer filter anything.
    pub fn diverged(&self) -> bool {
        self.diverged
    }

    /// The server this client is connected to.
    pub fn server_addr(&self) -> SocketAddr {
        self.server
    }

    pub fn node_id(&self) -> &str {
        &self.node_id
    }

    /// On a cluster, the nodes holding this durable queue as the welcome named them: the
    /// primary (this client's server) and its copies, in promotion order. A client with the
    /// [`DedupState`] of a session that was lost fails over to the copies first.
    pub fn queue_servers(&self) -> &[QueueServer] {
        &self.queue_servers
    }

    pub fn is_durable(&self) -> bool {
        self.durable
    }

    /// The processed-event ids, to hand to a reconnecting client of this process.
    pub fn dedup_state(&self) -> DedupState {
        self.dedup.clone()
    }

    /// A handle on one region.
    pub fn region(&self, name: impl Into<String>) -> Region<'_> {
        Region {
            client: self,
            name: name.into(),
        }
    }

    /// Tells the server to start delivering: queued events first (replayed), then the live
    /// marker per region, then live events. Returns the offset replay ends at.
    pub async fn ready_for_events(&self) -> Result<u64, ClientError> {
        if self.replay_rate > 0 {
            self.set_replay_rate(self.replay_rate).await?;
        }
        match self.inner.call(RequestBody::Ready).await? {
            ResponseBody::Ready { replay_end } => match self.checkpoint {
                Some(c) if c > replay_end => Err(ClientError::Usage(format!(
                    "checkpoint {c} is beyond the end of the queue (offset {replay_end}): it \
                     belongs to another queue or to another durable id"
                ))),
                _ => Ok(replay_end),
            },
            other => Err(unexpected(other)),
        }
    }

    /// Paces this session's replay at most at `events_per_s` (0: unlimited), from the next
    /// delivery frame on; live events are never paced. May be called at any time, e.g. to
    /// slow down or speed up a replay under way.
    pub async fn set_replay_rate(&self, events_per_s: u64) -> Result<(), ClientError> {
        match self
            .inner
            .call(RequestBody::ReplayRate { events_per_s })
            .await?
        {
            ResponseBody::ReplayRate { .. } => Ok(()),
            other => Err(unexpected(other)),
        }
    }

    /// The event stream (once per client).
    pub fn events(&self) -> Result<EventStream, ClientError> {
        let rx = self
            .events
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take()
            .ok_or_else(|| ClientError::Usage("the event stream was already taken".into()))?;
        Ok(EventStream {
            rx,
            current: None,
            inner: self.inner.clone(),
            dedup: self.dedup.clone(),
            last: None,
            mode: self.ack_mode,
        })
    }

    /// Admin: every queue of the connected node.
    pub async fn queues(&self) -> Result<Vec<QueueReport>, ClientError> {
        match self.inner.call(RequestBody::ListQueues).await? {
            ResponseBody::Queues { queues } => Ok(queues),
            other => Err(unexpected(other)),
        }
    }

    /// Admin: a page of the queue listing with each queue's lag: paged, sorted, filtered, over
    /// every member of a cluster unless `query.node_only` (see [`QueuesQuery`]).
    pub async fn queues_page(&self, query: QueuesQuery) -> Result<QueuesPage, ClientError> {
        match self.inner.call(RequestBody::ListQueuesPage(query)).await? {
            ResponseBody::QueuesPage(page) => Ok(page),
            other => Err(unexpected(other)),
        }
    }

    /// Admin: destroys an away durable client's queue.
    pub async fn close_durable(&self, durable_id: &str) -> Result<(), ClientError> {
        match self
            .inner
            .call(RequestBody::CloseDurable {
                durable_id: durable_id.into(),
            })
            .await?
        {
            ResponseBody::ClosedDurable { .. } => Ok(()),
            other => Err(unexpected(other)),
        }
    }

    /// Admin, on a cluster: marks member `node_id` draining (`Some(true)`), no longer draining
    /// (`Some(false)`), or only reports its drain (`None`); returns what the member still
    /// holds. A drained member (no primaries, no copies) can be stopped without moving a
    /// queue. See `docs/cluster.md`.
    pub async fn drain(
        &self,
        node_id: &str,
        draining: Option<bool>,
    ) -> Result<DrainReport, ClientError> {
        match self
            .inner
            .call(RequestBody::Drain {
                node_id: node_id.into(),
                draining,
            })
            .await?
        {
            ResponseBody::Drain(report) => Ok(report),
            other => Err(unexpected(other)),
        }
    }

    /// Admin, on a cluster: removes member `node_id` (marked draining first; refused while it
    /// is still the primary of a queue: drain it, or wait for its queues' failover if it is
    /// down). Returns the members left, by name. See `docs/cluster.md`.
    pub async fn remove_node(&self, node_id: &str) -> Result<Vec<String>, ClientError> {
        match self
            .inner
            .call(RequestBody::RemoveNode {
                node_id: node_id.into(),
            })
            .await?
        {
            ResponseBody::NodeRemoved { members, .. } => Ok(members),
            other => Err(unexpected(other)),
        }
    }

    /// Admin, on a cluster: adds node `node_id`, reachable by peers at `addr` (`HOST:PORT`;
    /// started with `--join`). Returns the members after it, by name. The new member serves
    /// clients once it has copied the regions' values. See `docs/cluster.md`.
    pub async fn add_node(&self, node_id: &str, addr: &str) -> Result<Vec<String>, ClientError> {
        match self
            .inner
            .call(RequestBody::AddNode {
                node_id: node_id.into(),
                addr: addr.into(),
            })
            .await?
        {
            ResponseBody::NodeAdded { members, .. } => Ok(members),
            other => Err(unexpected(other)),
        }
    }

    /// Publishes a batch of operations; resolves once the server committed them (or, with
    /// [`ClientBuilder::publish_ack`] replicated, once every matching queue's copies hold them).
    pub async fn publish(&self, ops: Vec<PublishOp>) -> Result<u64, ClientError> {
        self.publish_with(ops, self.publish_ack).await
    }

    /// [`Client::publish`] with an explicit acknowledgement mode.
    pub async fn publish_with(
        &self,
        ops: Vec<PublishOp>,
        ack: PublishAck,
    ) -> Result<u64, ClientError> {
        match self.inner.call(RequestBody::Publish { ops, ack }).await? {
            ResponseBody::Published { count } => Ok(count),
            other => Err(unexpected(other)),
        }
    }

    /// Acknowledges everything processed so far, now.
    pub async fn ack_now(&self) -> Result<(), ClientError> {
        self.inner.flush_ack().await
    }

    /// Closes the session. `keepalive`: a durable queue and its durable interest are kept for
    /// the timeout; otherwise both are destroyed. Processed events are acked first. The
    /// server answers the close once it has ended the session (queue detached, the durable id
    /// free to connect again). Returns once the connection has drained (three probe timeouts
    /// after the close, about 80 ms on loopback, at most 2 s).
    pub async fn close(self, keepalive: bool) -> Result<(), ClientError> {
        let result = self.close_request(keepalive).await;
        self.abandon(ErrorCode::ClosedByPeer, b"closed");
        let _ = tokio::time::timeout(Duration::from_secs(2), self.endpoint.wait_idle()).await;
        result
    }

    /// Closes the session as [`Client::close`] does (processed events acked, the server
    /// told to keep or drop a durable queue, and its answer awaited, by when the session has
    /// ended on the server), but returns as soon as the connection's close has been handed
    /// to the network instead of waiting for the connection to drain: for a process about to
    /// exit (the `tether` command line). While the runtime runs on, the connection drains in
    /// the background. A client connecting at once with the same durable id resumes the
    /// queue.
    pub async fn close_promptly(self, keepalive: bool) -> Result<(), ClientError> {
        let result = self.close_request(keepalive).await;
        for t in &self.tasks {
            t.abort();
        }
        // Closed from a task of the runtime: the connection's driver, woken by the close, is
        // then queued on the same worker and runs at the task's next yield (woken from outside
        // the runtime, it waits for a worker to wake up).
        let conn = self.inner.conn.clone();
        let closing = tokio::spawn(async move {
            // Nothing more is sent on a connection that is closed already.
            let before = conn
                .close_reason()
                .is_none()
                .then(|| conn.stats().udp_tx.datagrams);
            conn.close(ErrorCode::ClosedByPeer.varint(), b"closed");
            if let Some(before) = before {
                close_sent(&conn, before).await;
            }
        });
        let _ = closing.await;
        result
    }

    /// The close request (processed events acked first) and its answer.
    async fn close_request(&self, keepalive: bool) -> Result<(), ClientError> {
        self.dedup.forget_live();
        let ack = self.inner.flush_ack().await;
        match self.inner.call(RequestBody::Close { keepalive }).await {
            Ok(ResponseBody::Closed { .. }) => ack,
            Ok(other) => Err(unexpected(other)),
            Err(e) => Err(e),
        }
    }

    /// Vanishes like a killed process: no acks flushed, no close request.
    pub fn crash(self) {
        self.dedup.forget_live();
        self.abandon(ErrorCode::Crashed, b"crashed");
    }

    /// Whether the connection is closed (by either side, or lost).
    pub fn is_closed(&self) -> bool {
        self.inner.conn.close_reason().is_some()
    }

    /// Stops this client's tasks and closes its connection (if still open) with `code`,
    /// leaving the [`DedupState`] as it is: a lost session's next session resumes it.
    fn abandon(&self, code: ErrorCode, reason: &[u8]) {
        for t in &self.tasks {
            t.abort();
        }
        self.inner.conn.close(code.varint(), reason);
    }

    /// Why the connection closed, as the server said it (or [`ClientError::Closed`]).
    fn closed_error(&self) -> ClientError {
        self.inner.closed_error()
    }
}

/// Longest wait of [`Client::close_promptly`] for the connection's close to be sent.
const CLOSE_SENT_WAIT_MS_MAX: u64 = 100;

/// Waits until `conn`, closed, has sent a datagram beyond the `before` it had sent when it was
/// closed (at most `CLOSE_SENT_WAIT_MS_MAX`). Once a connection is closed, each datagram it
/// builds carries its CONNECTION_CLOSE and nothing else, and its driver hands a datagram to
/// the socket in the same step (under the lock `stats` takes) as it counts it: so the close is
/// on the wire. (A datagram sent between the count and the close, an acknowledgement say, ends
/// the wait early. Should the close then be lost with the process, nothing is held: the
/// server ended the session before it answered the close request, and closes the connection
/// itself a bounded time after that.)
async fn close_sent(conn: &quinn::Connection, before: u64) {
    let deadline = tokio::time::Instant::now() + Duration::from_millis(CLOSE_SENT_WAIT_MS_MAX);
    let mut polls = 0u32;
    while conn.stats().udp_tx.datagrams <= before && tokio::time::Instant::now() < deadline {
        // The connection's driver is another task, woken by the close: usually done at the
        // first yield; a socket that is not writable takes longer.
        if polls < 100 {
            polls += 1;
            tokio::task::yield_now().await;
        } else {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    }
}

fn unexpected(r: ResponseBody) -> ClientError {
    ClientError::Protocol(format!("unexpected response {r:?}"))
}

/// Interest to register (see [`Region::register`]).
#[derive(Clone, Debug)]
pub struct Interest {
    pub spec: InterestSpec,
    /// None: durable for a durable client.
    pub durable: Option<bool>,
    pub policy: ResultPolicy,
    pub receive_values: bool,
}

impl Interest {
    fn new(spec: InterestSpec) -> Self {
        Interest {
            spec,
            durable: None,
            policy: ResultPolicy::KeysValues,
            receive_values: true,
        }
    }
    pub fn key(k: impl Into<String>) -> Self {
        Self::new(InterestSpec::Key(k.into()))
    }
    pub fn keys(keys: impl IntoIterator<Item = impl Into<String>>) -> Self {
        Self::new(InterestSpec::Keys(
            keys.into_iter().map(Into::into).collect(),
        ))
    }
    pub fn regex(re: impl Into<String>) -> Self {
        Self::new(InterestSpec::Regex(re.into()))
    }
    pub fn all_keys() -> Self {
        Self::new(InterestSpec::AllKeys)
    }
    pub fn durable(mut self, durable: bool) -> Self {
        self.durable = Some(durable);
        self
    }
    pub fn policy(mut self, policy: ResultPolicy) -> Self {
        self.policy = policy;
        self
    }
    pub fn receive_values(mut self, receive: bool) -> Self {
        self.receive_values = receive;
        self
    }
}

/// A handle on one region of a connected client.
pub struct Region<'a> {
    client: &'a Client,
    name: String,
}

impl Region<'_> {
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Registers interest; returns the initial image (never delivered as events).
    pub async fn register(&self, interest: Interest) -> Result<Vec<InitialEntry>, ClientError> {
        let body = RequestBody::RegisterInterest {
            region: self.name.clone(),
            interest: interest.spec,
            durable: interest.durable.unwrap_or(self.client.durable),
            policy: interest.policy,
            receive_values: interest.receive_values,
            image_in_parts: true,
        };
        match self.client.inner.call(body).await? {
            ResponseBody::Registered { initial, .. } => Ok(initial),
            other => Err(unexpected(other)),
        }
    }

    /// Removes interest; false if it was not registered.
    pub async fn unregister(&self, spec: InterestSpec) -> Result<bool, ClientError> {
        let body = RequestBody::UnregisterInterest {
            region: self.name.clone(),
            interest: spec,
        };
        match self.client.inner.call(body).await? {
            ResponseBody::Unregistered { removed } => Ok(removed),
            other => Err(unexpected(other)),
        }
    }

    pub async fn put(
        &self,
        key: impl Into<String>,
        value: impl Into<Vec<u8>>,
    ) -> Result<(), ClientError> {
        self.client
            .publish(vec![PublishOp::Put {
                region: self.name.clone(),
                key: key.into(),
                value: value.into(),
            }])
            .await
            .map(drop)
    }

    pub async fn destroy(&self, key: impl Into<String>) -> Result<(), ClientError> {
        self.client
            .publish(vec![PublishOp::Destroy {
                region: self.name.clone(),
                key: key.into(),
            }])
            .await
            .map(drop)
    }

    pub async fn invalidate(&self, key: impl Into<String>) -> Result<(), ClientError> {
        self.client
            .publish(vec![PublishOp::Invalidate {
                region: self.name.clone(),
                key: key.into(),
            }])
            .await
            .map(drop)
    }

    /// The current value (None when absent or invalidated).
    pub async fn get(&self, key: impl Into<String>) -> Result<Option<Vec<u8>>, ClientError> {
        match self
            .client
            .inner
            .call(RequestBody::Get {
                region: self.name.clone(),
                key: key.into(),
            })
            .await?
        {
            ResponseBody::Value { value } => Ok(value),
            other => Err(unexpected(other)),
        }
    }
}

/// The events of a client, in order. Ends when the connection closes.
pub struct EventStream {
    rx: mpsc::Receiver<StreamBatch>,
    /// The batch [`EventStream::next`] is taking events from, and how many it took.
    current: Option<(EventBatch, usize)>,
    inner: Arc<Inner>,
    dedup: DedupState,
    /// Offset of the event yielded last: processed once the next one is asked for.
    last: Option<u64>,
    mode: AckMode,
}

/// Acks events of a client in [`AckMode::Manual`]; cheap to clone and to send to the tasks
/// that process events (see [`EventStream::acker`]).
#[derive(Clone)]
pub struct Acker {
    dedup: DedupState,
}

impl Acker {
    /// The application processed the event at `offset`. Acks are cumulative on the wire: an
    /// offset above one still being processed is held until the gap closes. Returns the
    /// offset everything is processed through (the checkpoint to keep with the
    /// application's data). Refused for an offset never shown to this process.
    pub fn ack(&self, offset: u64) -> Result<u64, ClientError> {
        self.dedup
            .ack(offset)
            .map_err(|e| ClientError::Usage(e.to_string()))
    }

    /// [`Acker::ack`] for each of `offsets` at once (one lock for all of them, for an
    /// application that processes events in batches). Every offset that can be acked is; if
    /// some were refused, the first refusal is returned.
    pub fn ack_many(&self, offsets: &[u64]) -> Result<u64, ClientError> {
        self.dedup
            .ack_many(offsets)
            .map_err(|e| ClientError::Usage(e.to_string()))
    }
}

impl EventStream {
    /// The processed offset is sent to the server every `ack_interval`, and at a clean close.
    /// See [`Acker::ack`]. Refused in [`AckMode::Auto`].
    pub fn ack(&self, offset: u64) -> Result<u64, ClientError> {
        self.acker()?.ack(offset)
    }

    /// A handle to ack from other tasks ([`AckMode::Manual`]).
    pub fn acker(&self) -> Result<Acker, ClientError> {
        match self.mode {
            AckMode::Manual => Ok(Acker {
                dedup: self.dedup.clone(),
            }),
            AckMode::Auto => Err(ClientError::Usage(AckError::NotManual.to_string())),
        }
    }

    fn mark_processed(&mut self) {
        if let Some(o) = self.last.take() {
            self.inner.processed.fetch_max(o, Ordering::AcqRel);
            self.dedup.processed(o);
        }
    }

    /// The next event; None once the connection is gone.
    pub async fn next(&mut self) -> Option<ClientEvent> {
        std::future::poll_fn(|cx| self.poll_next_event(cx)).await
    }

    fn poll_next_event(&mut self, cx: &mut Context<'_>) -> Poll<Option<ClientEvent>> {
        self.mark_processed();
        loop {
            if let Some((batch, taken)) = &mut self.current {
                if let Some(view) = batch.get(*taken) {
                    *taken += 1;
                    let event = view.to_event();
                    match self.mode {
                        AckMode::Auto => self.last = Some(event.offset),
                        AckMode::Manual => self.dedup.shown(event.offset),
                    }
                    return Poll::Ready(Some(ClientEvent::Event(event)));
                }
                self.current = None;
            }
            match self.rx.poll_recv(cx) {
                Poll::Ready(Some(StreamBatch::Events(batch))) => self.current = Some((batch, 0)),
                Poll::Ready(Some(StreamBatch::Other(ev))) => return Poll::Ready(Some(ev)),
                Poll::Ready(None) => return Poll::Ready(None),
                Poll::Pending => return Poll::Pending,
            }
        }
    }

    /// The next events of a delivery frame (up to a few hundred, those [`EventStream::next`]
    /// has not yielded yet), read in place: no allocation per event. Or the stream's next other
    /// item ([`ClientEvent::Live`], ...). None once the connection is gone.
    ///
    /// Acknowledgement as with [`EventStream::next`], for the batch as a whole: with
    /// [`AckMode::Auto`] its events count as processed once the application asks for the next
    /// batch or event (or commits, or closes the client); with [`AckMode::Manual`] each of them
    /// is shown and must be acked.
    pub async fn next_batch(&mut self) -> Option<StreamBatch> {
        std::future::poll_fn(|cx| self.poll_next_batch(cx)).await
    }

    fn poll_next_batch(&mut self, cx: &mut Context<'_>) -> Poll<Option<StreamBatch>> {
        self.mark_processed();
        let batch = match self.current.take() {
            Some((mut batch, taken)) if taken < batch.len() => {
                batch.skip(taken);
                batch
            }
            _ => match self.rx.poll_recv(cx) {
                Poll::Ready(Some(StreamBatch::Events(batch))) => batch,
                Poll::Ready(other) => return Poll::Ready(other),
                Poll::Pending => return Poll::Pending,
            },
        };
        match self.mode {
            AckMode::Auto => self.last = batch.last_offset(),
            AckMode::Manual => self.dedup.shown_many(batch.offsets()),
        }
        Poll::Ready(Some(StreamBatch::Events(batch)))
    }

    /// Marks the last yielded event processed without waiting for the next one.
    pub fn commit(&mut self) {
        self.mark_processed();
    }

    /// Drives a listener until the stream ends.
    pub async fn run_listener(mut self, listener: &mut dyn Listener) {
        while let Some(ev) = self.next().await {
            dispatch(listener, &ev);
        }
    }
}

/// Calls the listener callback for one event.
fn dispatch(listener: &mut dyn Listener, ev: &ClientEvent) {
    match ev {
        ClientEvent::Live { regions } => {
            for r in regions {
                listener.after_region_live(r);
            }
        }
        ClientEvent::Event(e) => match e.op {
            EventOp::Create => listener.after_create(e),
            EventOp::Update => listener.after_update(e),
            EventOp::Destroy => listener.after_destroy(e),
            EventOp::Invalidate => listener.after_invalidate(e),
        },
        ClientEvent::Disconnected { error } => listener.after_disconnect(error),
        ClientEvent::Reconnected { queue, pending } => listener.after_reconnect(*queue, *pending),
    }
}

impl futures_core::Stream for EventStream {
    type Item = ClientEvent;
    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<ClientEvent>> {
        self.get_mut().poll_next_event(cx)
    }
}
