//! The server node: thin tokio/quinn/RocksDB drivers around [`NodeCore`].
//!
//! - the **core** (`Mutex<NodeCore>`) decides everything; the lock is never held across an
//!   `.await`;
//! - the **writer** thread group-commits the core's batches in the order they were produced;
//! - one **connection task** per client reads the control stream and answers requests;
//! - one **delivery task** per session reads committed entries from storage and writes them to
//!   the delivery stream, woken through a `Notify` when its queue grows or interest changes;
//! - a **tick task** expires away queues and refreshes gauges.
//!
//! [`Node`] is also the embedding API: a host process starts one in-process and feeds it
//! events through a [`Publisher`] without the network.

mod admin;
mod auth_reload;
mod clock;
mod conn;
mod copies;
mod failover;
mod forward;
mod image;
mod join;
mod locks;
mod low_priority;
mod placement;
mod rebalance;
mod revocation;
mod shipping;
mod writer;

use crate::bug::{LockExt, RwLockExt};
use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use tether_storage::{Batch, RocksStore, Store};
use tether_transport::tls::{self, TlsFiles};
use tokio::sync::{Notify, Semaphore, mpsc, oneshot, watch};

pub use auth_reload::AUTH_RELOAD_INTERVAL_MS;
pub use failover::RECONCILE_MS;
pub use join::{JOINED_DONE, JOINED_KEY, JOINED_UNDRAIN_PENDING};
pub use placement::REDIRECT_CATCH_UP_MS;
pub use rebalance::{DRAIN_SESSION_END_WAIT_MS, REBALANCE_INTERVAL_MS};
pub use revocation::CRL_RELOAD_INTERVAL_MS;
pub use writer::{GROUP_COMMIT_REQUESTS_MAX, WriteError, Writer, WriterThread};

use crate::cluster::{Cluster, Members};
use crate::config::{Limits, QueueFullPolicy, ServerConfig, validate_node_id};
use crate::core::{NodeCore, PublishRefused, SessionId};
use crate::interest::{Prematch, RegexMatcher};
use crate::limits::*;
use crate::metrics as m;
use crate::protocol::*;

pub use crate::core::{
    REGION_TAG_INVALID, REGION_TAG_VALUE, decode_region_value, encode_region_value,
};

/// Errors starting or running a node.
#[derive(Debug, thiserror::Error)]
pub enum NodeError {
    #[error("data directory {path}: {source}")]
    DataDir {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{0}")]
    Config(#[from] crate::config::ConfigError),
    #[error("{}: {error}", path.display())]
    NodeIdFile {
        path: PathBuf,
        error: crate::config::ConfigError,
    },
    #[error(
        "the certificate {} names cluster node(s) {names:?}, not {node:?}: a cluster node's \
         certificate carries exactly one URI subject alternative name {uri} (see \
         docs/operations.md, security)",
        cert.display()
    )]
    NodeCertificate {
        cert: PathBuf,
        names: Vec<String>,
        node: String,
        uri: String,
    },
    #[error(
        "a clustered node needs an explicit node id (--node-id), the name its peers know it by"
    )]
    ClusterWithoutNodeId,
    #[error("--join needs the members to join: give --peer (the members and this node)")]
    JoinWithoutPeers,
    #[error("auth.client-crl revokes client certificates: it needs auth.client-ca")]
    CrlWithoutClientCa,
    #[error("auth.client-crl: {0}")]
    ClientCrl(tether_transport::tls::TlsError),
    #[error("storage: {0}")]
    Storage(#[from] tether_storage::StorageError),
    #[error(transparent)]
    Cluster(#[from] crate::cluster::ClusterError),
    #[error("tls: {0}")]
    Tls(#[from] tether_transport::tls::TlsError),
    #[error("cannot listen on {addr}: {source}")]
    Listen {
        addr: SocketAddr,
        source: std::io::Error,
    },
    #[error("recovery: {0}")]
    Recovery(#[from] crate::core::RecoveryError),
    #[error("{0}")]
    Request(#[from] WireError),
}

/// What the node keeps per live session, for waking its delivery and probing its liveness.
struct SessionHandle {
    wake: Arc<Notify>,
    probe: mpsc::Sender<oneshot::Sender<()>>,
    conn: Option<quinn::Connection>,
    finished: watch::Receiver<bool>,
    /// The token the connection authenticated with (its digest) and the principal it gave:
    /// a reloaded `[auth]` table that no longer has it closes the connection.
    token: Option<(crate::auth::TokenDigest, String)>,
}

/// State shared by the node's tasks.
pub(crate) struct Shared {
    core: Mutex<NodeCore>,
    /// The durable queues this node held when it started: it may have been promoted for one
    /// of them in its previous life less than the lease ago, so their first shipping waits out
    /// a predecessor's lease (`control::lease::Lease::at_start`). A queue placed here since
    /// had no other primary.
    pub(crate) held_at_start: std::collections::BTreeSet<String>,
    /// The node's clock (`clock.rs`): every timestamp the core keeps comes from it.
    pub(crate) clock: clock::Clock,
    /// Longest wait for the copies of queues to hold a change before an answer
    /// ([`ServerConfig::replicated_ack_timeout_ms`]).
    pub(crate) replicated_wait: Duration,
    store: Arc<dyn Store>,
    writer: Writer,
    /// After `writer`: dropping the shared state closes the channel, then joins the thread.
    _writer_thread: WriterThread,
    write_permits: Arc<Semaphore>,
    /// KiB of publish operations submitted to the writer and not committed
    /// ([`WRITER_QUEUE_KIB_MAX`](crate::limits::WRITER_QUEUE_KIB_MAX) permits).
    write_kib: Arc<Semaphore>,
    /// Bytes of publish operations read from client connections and not answered yet.
    pub(crate) publish_bytes_in_flight: std::sync::atomic::AtomicU64,
    /// Client requests read and not answered yet (publishes included), node-wide: a stopping
    /// node answers them before it closes ([`Node::shutdown`]).
    pub(crate) requests_unanswered: AtomicUsize,
    /// Set when the node starts to stop: sessions answer every later request `going-away`
    /// (not applied) and new sessions are refused, while the requests under way finish.
    pub(crate) draining: watch::Sender<bool>,
    /// Set once the sessions are drained and the node closes: waits that hold the shared state
    /// (a peer's forwarded publishes waiting for this node's copies) end at once.
    pub(crate) closing: watch::Sender<bool>,
    /// Bytes of publish operations submitted to the writer and not committed.
    writer_queue_bytes: std::sync::atomic::AtomicU64,
    /// The core's regex matchers of the regions published to, so a publish matches its keys
    /// outside the core lock ([`Shared::prematch`]); brought up to date by the publishes
    /// that found them out of date.
    regex_matchers: std::sync::RwLock<HashMap<String, Arc<RegexMatcher>>>,
    /// Publish operations whose keys were matched against regexes under the core lock (their
    /// region's matcher was unknown here or out of date).
    regex_matches_under_lock: std::sync::atomic::AtomicU64,
    /// Delivery reads of queue entries queued or running on `delivery_pool` at once (each with
    /// a storage iterator and its frame buffer; a live session's small inline reads take none).
    pub(crate) delivery_reads: Semaphore,
    /// Where those reads run: threads at a lower CPU priority than the async workers and the
    /// storage writer, so a replay's bulk never delays live events for CPU.
    pub(crate) delivery_pool: low_priority::LowPriorityPool,
    sessions: Mutex<HashMap<SessionId, SessionHandle>>,
    connections: AtomicUsize,
    /// Notified when acks free queue space (publishers blocked by a full queue wait on it).
    pub(crate) space: Notify,
    pub(crate) limits: Limits,
    /// None: an open node (no `[auth]`). Replaced when the `[auth]` table is reloaded
    /// (`auth_reload.rs`); read through [`Shared::authorizer`].
    auth: Option<std::sync::RwLock<Arc<crate::auth::Authorizer>>>,
    fatal: watch::Sender<Option<Arc<tether_storage::StorageError>>>,
    node_id: String,
    /// Event totals since start, for the admin API (`admin.rs`).
    pub(crate) stats: admin::NodeStats,
    /// The node as a member of a cluster (empty on a single node).
    pub(crate) member: Member,
}

/// What a node holds as a member of a cluster: its metadata group, its copies of other
/// primaries' queues, the shipping of its own, and the publishes it forwards and keeps. On a
/// single node the cluster is never set and the rest stays empty.
pub(crate) struct Member {
    /// The metadata group, on a clustered node (set once, before accepting connections).
    pub(crate) cluster: std::sync::OnceLock<Arc<crate::cluster::Cluster>>,
    /// The cluster CA a peer's certificate must come from (clustered nodes).
    pub(crate) cluster_ca: PathBuf,
    /// Publish forwarding to the other members (clustered nodes).
    pub(crate) forwarding: Option<forward::Forwarding>,
    /// Copies of other primaries' queues held here (clustered nodes).
    pub(crate) copies: copies::Copies,
    /// Durable hellos between placing and attaching (`placement.rs`).
    pub(crate) placing: placement::Placing,
    /// Durable ids whose placement this node is removing (`placement::forget`).
    pub(crate) releasing: placement::Releasing,
    /// Queues this node ships to their secondaries (clustered nodes).
    pub(crate) shipping: shipping::Shipping,
    /// When each member last answered (clustered nodes).
    pub(crate) liveness: failover::Liveness,
    /// Publishes applied here lately (forwarded and own), kept while a copy held here now or
    /// later may lack them (see `failover.rs`: a promotion appends those the failed primary had
    /// not shipped).
    pub(crate) recent: Mutex<failover::RecentForwards>,
    /// Per origin node (this one included): the highest publish-log offset whose publish is
    /// committed here, queue entries visible (read before a shipped queue's end, `control/watermark.rs`).
    applied_through: Mutex<crate::control::watermark::Through>,
    /// Set once this node's metadata holds everything committed before it started (clustered
    /// nodes serve durable clients only then; see `failover::catch_up`).
    pub(crate) meta_caught_up: watch::Sender<bool>,
    /// False while this node joins a running cluster and has not copied the regions' values
    /// yet: it serves no client and applies no forwarded publish until then (`join.rs`).
    pub(crate) joined: watch::Sender<bool>,
}

impl Shared {
    #[track_caller]
    fn core(&self) -> locks::Timed<'_, NodeCore> {
        locks::lock(&self.core, "core")
    }

    #[track_caller]
    pub(crate) fn recent_forwards(&self) -> locks::Timed<'_, failover::RecentForwards> {
        locks::lock(&self.member.recent, "recent")
    }

    /// A snapshot of what this node applied, per origin (see `applied_through`).
    pub(crate) fn applied_through(&self) -> crate::control::watermark::Through {
        self.member.applied_through.lock_or_stop().clone()
    }

    fn wake(&self, session: SessionId) {
        if let Some(h) = self.sessions.lock_or_stop().get(&session) {
            h.wake.notify_one();
        }
    }

    /// Runs `f` on the core and submits its batch while still holding the lock, so commits
    /// follow the core's order; then waits for durability.
    /// (Not an `async fn`, so that a long hold of the core is logged with the caller's place.)
    #[track_caller]
    fn apply<'a, T: 'a>(
        &'a self,
        f: impl FnOnce(&mut NodeCore) -> Result<(T, Batch), WireError> + 'a,
    ) -> impl Future<Output = Result<T, WireError>> + 'a {
        let at = std::panic::Location::caller();
        async move {
            let _permit = self
                .write_permits
                .acquire()
                .await
                .map_err(|_| shutdown_error())?;
            let (value, rx) = {
                let mut core = locks::lock_at(&self.core, "core", at);
                let (value, batch) = f(&mut core)?;
                if batch.is_empty() {
                    return Ok(value);
                }
                (value, self.writer.submit(batch, None))
            };
            wait_commit(rx).await?;
            Ok(value)
        }
    }

    /// Publishes operations for a session: validates, assigns offsets, commits, wakes the
    /// sessions whose queues grew. Returns the number of events.
    pub(crate) async fn publish(
        self: &Arc<Self>,
        session: SessionId,
        ops: &[PublishOp],
    ) -> Result<u64, WireError> {
        Ok(self.publish_receipt(session, ops, None).await?.count)
    }

    /// [`Shared::publish`] of operations that came from a peer: `origin` is the origin node
    /// and the entry's offset in its publish log (recorded with the publish, never forwarded
    /// again). `None`: a local publish (forwarded to the peers on a clustered node).
    pub(crate) async fn publish_receipt(
        self: &Arc<Self>,
        session: SessionId,
        ops: &[PublishOp],
        origin: Option<&forward::Origin<'_>>,
    ) -> Result<Receipt, WireError> {
        let submitted = self.submit_publish(session, ops, origin).await?;
        self.finish_publish(submitted).await
    }

    /// The first half of [`Shared::publish_receipt`]: the publish validated, its offsets
    /// assigned and its batch handed to the writer (waiting for queue space under the block
    /// policy), not yet committed. The writer commits in submission order, so publishes
    /// submitted one after the other may be finished together: one group commit for all.
    pub(crate) async fn submit_publish(
        self: &Arc<Self>,
        session: SessionId,
        ops: &[PublishOp],
        origin: Option<&forward::Origin<'_>>,
    ) -> Result<Submitted, WireError> {
        let block = Duration::from_millis(self.limits.queue_full_block_ms);
        let deadline = tokio::time::Instant::now() + block;
        loop {
            // Armed before the attempt, so an ack that frees space meanwhile is not missed.
            let space = self.space.notified();
            tokio::pin!(space);
            space.as_mut().enable();
            match self.try_publish(session, ops, origin).await {
                Err(e) if e.code == ErrorCode::QueueFull => {
                    let blocking = self.limits.queue_full_policy == QueueFullPolicy::Block;
                    if !blocking || tokio::time::timeout_at(deadline, space).await.is_err() {
                        metrics::counter!(m::PUBLISH_REJECTED, "reason" => "queue-full")
                            .increment(1);
                        return Err(if blocking {
                            WireError::new(
                                ErrorCode::QueueFull,
                                format!(
                                    "{} (waited {} ms for space)",
                                    e.message,
                                    block.as_millis()
                                ),
                            )
                        } else {
                            e
                        });
                    }
                    metrics::counter!(m::PUBLISH_BLOCKED).increment(1);
                }
                other => return other,
            }
        }
    }

    /// Each op's regex matches found outside the core lock with the node's last known
    /// matchers of their regions (`None` for a region with no regexes known).
    fn prematch(&self, ops: &[PublishOp]) -> Vec<Option<Prematch>> {
        let matchers: Vec<Option<Arc<RegexMatcher>>> = {
            let known = self.regex_matchers.read_or_stop();
            if known.is_empty() {
                return Vec::new();
            }
            ops.iter()
                .map(|op| known.get(crate::core::op_target(op).0).cloned())
                .collect()
        };
        ops.iter()
            .zip(matchers)
            .map(|(op, m)| m.map(|m| Prematch::new(m, crate::core::op_target(op).1)))
            .collect()
    }

    /// Takes the matchers of the regions of `ops` from `core` (under its lock, so none can
    /// change meanwhile), forgetting those of regions without regexes.
    fn refresh_matchers(&self, core: &NodeCore, ops: &[PublishOp]) {
        let mut known = self.regex_matchers.write_or_stop();
        for op in ops {
            let region = crate::core::op_target(op).0;
            match core.regex_matcher(region) {
                Some(m) => {
                    if !known.get(region).is_some_and(|k| Arc::ptr_eq(k, &m)) {
                        known.insert(region.to_string(), m);
                    }
                }
                None => {
                    known.remove(region);
                }
            }
        }
    }

    async fn try_publish(
        self: &Arc<Self>,
        session: SessionId,
        ops: &[PublishOp],
        origin: Option<&forward::Origin<'_>>,
    ) -> Result<Submitted, WireError> {
        let bytes = publish_ops_bytes(ops) as u64;
        // The writer's queue holds the operations and what they add to their queues (known
        // once matched): KiB for the operations are taken first, the rest under the core
        // lock if free; if not, the publish waits for all of it and is planned again.
        let mut want_kib = writer_kib(bytes);
        let pre = self.prematch(ops);
        let mut request = None;
        let receipt_appended;
        let receipt_logged;
        let (count, enqueued, dropped, rx) = loop {
            let mut kib = self
                .write_kib
                .clone()
                .acquire_many_owned(want_kib)
                .await
                .map_err(|_| shutdown_error())?;
            if request.is_none() {
                request = Some(
                    self.write_permits
                        .clone()
                        .acquire_owned()
                        .await
                        .map_err(|_| shutdown_error())?,
                );
            }
            let mut core = self.core();
            if let (None, Some(f)) = (origin, &self.member.forwarding) {
                f.check_room().inspect_err(|_| {
                    metrics::counter!(m::PUBLISH_REJECTED, "reason" => "publish-log-full")
                        .increment(1);
                })?;
            }
            let store = self.store.clone();
            let ids = origin.map(|o| &o.ids);
            let mut held = (want_kib, bytes);
            let planned = core.publish_within(
                self.clock.now_ms(),
                session,
                ops,
                ids,
                &pre,
                &mut |region, key| match store.region_contains(region, key) {
                    Ok(v) => Ok(v),
                    Err(e) => Err(internal(format!(
                        "reading key {key:?} of region {region:?}: {e}; nothing was published"
                    ))),
                },
                &mut |fanout_bytes| {
                    let need = writer_kib(bytes + fanout_bytes);
                    if need > held.0 {
                        match self.write_kib.clone().try_acquire_many_owned(need - held.0) {
                            Ok(more) => kib.merge(more),
                            Err(_) => return false,
                        }
                    }
                    held = (need.max(held.0), bytes + fanout_bytes);
                    true
                },
            );
            let plan = match planned {
                Ok(plan) => {
                    if plan.regexes_matched_here > 0 {
                        self.regex_matches_under_lock.fetch_add(
                            plan.regexes_matched_here,
                            std::sync::atomic::Ordering::Relaxed,
                        );
                        self.refresh_matchers(&core, ops);
                    }
                    plan
                }
                Err(PublishRefused::Error(e)) => return Err(e),
                Err(PublishRefused::NoRoom { fanout_bytes }) => {
                    // Wait for all of it (holding none meanwhile: two publishes each holding
                    // a part and waiting for the rest would wait for each other).
                    drop(core);
                    drop(kib);
                    want_kib = writer_kib(bytes + fanout_bytes);
                    continue;
                }
            };
            // Given back once the writer has committed the publish (or failed it), not when
            // its answer is written: a connection waiting here for room must not wait on its
            // own committed publishes, which it answers only after this.
            self.writer_queue_bytes
                .fetch_add(held.1, std::sync::atomic::Ordering::Relaxed);
            let queued = QueuedBytes {
                _kib: kib,
                _request: request.take().expect("taken once"),
                shared: self.clone(),
                bytes: held.1,
            };
            let mut batch = plan.batch;
            let logged = match (origin, &self.member.forwarding) {
                (Some(o), _) => {
                    let (k, v) = forward::applied_marker(o.node, o.offset);
                    batch.state_put(&k, v);
                    None
                }
                (None, Some(f)) => f.log_publish(&mut batch, plan.first_id.as_ref(), ops),
                (None, None) => None,
            };
            // Origin node and publish-log offset of the publish (forwarded or this node's own).
            let origin_offset = match (origin, logged) {
                (Some(o), _) => Some((o.node.to_string(), o.offset)),
                (None, Some(offset)) => plan.first_id.as_ref().map(|id| (id.node.clone(), offset)),
                (None, None) => None,
            };
            // Keep the publish for a promotion of a copy held here now or later: its primary
            // may fail before it applies or ships the publish.
            let kept_at = match (&plan.first_id, &origin_offset) {
                (Some(id), Some((_, offset))) => Some(self.recent_forwards().record(
                    &mut batch,
                    id,
                    *offset,
                    ops,
                    &plan.event_ops,
                )),
                _ => None,
            };
            let shared = self.clone();
            let (seq, appended) = (plan.seq, plan.appended);
            receipt_appended = appended.clone();
            receipt_logged = logged;
            let on_commit: writer::OnCommit = Box::new(move || {
                drop(queued);
                if let (Some(offset), Some(f)) = (logged, &shared.member.forwarding) {
                    f.committed.send_replace(offset);
                }
                if let Some(at) = kept_at {
                    shared.recent_forwards().committed(at);
                }
                let wake: Vec<SessionId> = {
                    let mut core = shared.core();
                    core.committed(seq, &appended);
                    appended
                        .iter()
                        .filter_map(|(q, _)| core.attached_session(*q))
                        .collect()
                };
                // After the entries became visible (shipping reads this before a queue's end).
                if let Some((node, offset)) = origin_offset {
                    let mut t = shared.member.applied_through.lock_or_stop();
                    let e = t.entry(node).or_insert(0);
                    *e = (*e).max(offset);
                }
                for s in wake {
                    shared.wake(s);
                }
                for (q, _) in &appended {
                    shared.member.shipping.wake(*q);
                }
            });
            metrics::counter!(m::QUEUES_DROPPED_FULL).increment(plan.dropped_queues);
            break (
                plan.count,
                plan.enqueued,
                plan.dropped_sessions,
                self.writer.submit(batch, Some(on_commit)),
            );
        };
        Ok(Submitted {
            rx,
            enqueued,
            dropped,
            receipt: Receipt {
                count,
                appended: receipt_appended,
                logged: receipt_logged,
            },
        })
    }

    /// The second half of [`Shared::publish_receipt`]: waits for the commit of a submitted
    /// publish, then tells the clients whose queues it dropped and counts it.
    pub(crate) async fn finish_publish(&self, submitted: Submitted) -> Result<Receipt, WireError> {
        let Submitted {
            rx,
            enqueued,
            dropped,
            receipt,
        } = submitted;
        wait_commit(rx).await?;
        let count = receipt.count;
        // Clients whose queue was dropped for being full learn it now, and `expired` on their
        // next connection.
        for s in dropped {
            tracing::info!(
                session = s,
                "queue full under the drop-queue policy: dropped, its client disconnected"
            );
            self.disconnect_session(
                s,
                ErrorCode::QueueFull,
                "your queue was full and has been dropped; reconnect to start a new one",
            );
        }
        metrics::counter!(m::EVENTS_PUBLISHED).increment(count);
        metrics::counter!(m::EVENTS_ENQUEUED).increment(enqueued);
        admin::NodeStats::add(&self.stats.published, count);
        admin::NodeStats::add(&self.stats.enqueued, enqueued);
        Ok(receipt)
    }

    /// Waits until this node's queues that received `appended` entries hold them on every
    /// copy (queues without copies hold them once committed). False on timeout.
    pub(crate) async fn wait_local_replicated(
        &self,
        appended: &[(tether_storage::QueueId, tether_storage::Offset)],
        timeout: Duration,
    ) -> bool {
        let deadline = tokio::time::Instant::now() + timeout;
        for &(qid, off) in appended {
            if !self
                .member
                .shipping
                .wait_replicated(qid, off, deadline)
                .await
            {
                return false;
            }
        }
        true
    }

    /// After a change of session `session`'s durable interest: waits until every copy of its
    /// queue holds the change, so an acknowledged registration survives a failover. At once for
    /// a queue without copies.
    pub(crate) async fn wait_interest_copied(&self, session: SessionId) -> Result<(), WireError> {
        if self.wait_queue_state_copied(session).await {
            return Ok(());
        }
        Err(WireError::new(
            ErrorCode::Unavailable,
            format!(
                "the interest change is committed here but not on every copy of the queue within {} ms; retry (registration is idempotent)",
                self.replicated_wait.as_millis()
            ),
        ))
    }

    /// Before a close with keepalive is answered: the session's acks are committed here (under
    /// the node's sync mode) and held by every copy of its queue, so a client that closed
    /// cleanly never gets what it acknowledged again, whichever node serves it next.
    pub(crate) async fn wait_acks_durable(&self, session: SessionId) -> Result<(), WireError> {
        // The writer commits in submission order: once this empty batch is committed, so is
        // every ack this session made before it.
        match self.writer.submit(Batch::new(), None).await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => return Err(WireError::new(ErrorCode::Internal, e.to_string())),
            Err(_) => {
                return Err(WireError::new(ErrorCode::Shutdown, "the node is stopping"));
            }
        }
        if self.wait_queue_state_copied(session).await {
            return Ok(());
        }
        Err(WireError::new(
            ErrorCode::Unavailable,
            format!(
                "the session is closed and its acks are committed here, but not on every copy of the queue within {} ms; events acknowledged last may come again, flagged possible_duplicate",
                self.replicated_wait.as_millis()
            ),
        ))
    }

    /// Waits until every copy of session `session`'s queue holds the queue's current state
    /// (interest and away time, sent again after each change, and the acked offset, which every
    /// replication message carries: a fresh message is forced and awaited). True at
    /// once for a queue without copies; false if that takes over `replicated_wait`.
    async fn wait_queue_state_copied(&self, session: SessionId) -> bool {
        let qid = match self.core().session(session) {
            Some(s) => s.queue,
            None => return true,
        };
        let Some((sq, version)) = self.member.shipping.info_changed(qid) else {
            return true;
        };
        let deadline = tokio::time::Instant::now() + self.replicated_wait;
        shipping::Shipping::wait_info(sq, version, deadline).await
    }

    /// The committed end of every queue this node ships to copies: once each copy holds its
    /// queue up to there, it holds everything this node applied so far.
    pub(crate) fn shipped_ends(&self) -> Vec<(tether_storage::QueueId, tether_storage::Offset)> {
        let qids = self.member.shipping.shipped();
        let core = self.core();
        qids.into_iter()
            .filter_map(|qid| core.queue(qid).map(|q| (qid, q.visible_end)))
            .collect()
    }

    /// `--ack replicated`: waits until every matching queue in the cluster and each of its
    /// copies holds the publish of `receipt` (members that are down are not waited for: their
    /// queues' copies take over with the publish, see `failover.rs`). A member that applied
    /// the publish but whose copies did not confirm it in its own wait fails the wait at once;
    /// the error says which members hold it replicated, which applied it only, and which have
    /// not applied it yet.
    pub(crate) async fn wait_replicated(&self, receipt: &Receipt) -> Result<(), WireError> {
        let wait_ms = self.replicated_wait.as_millis();
        if !self
            .wait_local_replicated(&receipt.appended, self.replicated_wait)
            .await
        {
            return Err(WireError::new(
                ErrorCode::Unavailable,
                format!(
                    "the publish is committed here but the copies of this node's queues it reached do not all hold it within {wait_ms} ms; it will reach every queue"
                ),
            ));
        }
        let (Some(offset), Some(f)) = (receipt.logged, &self.member.forwarding) else {
            return Ok(());
        };
        let deadline = tokio::time::Instant::now() + self.replicated_wait;
        loop {
            let applied = f.sent_changed.notified();
            tokio::pin!(applied);
            applied.as_mut().enable();
            let status = f.replication_of(offset, |id| self.member.liveness.is_live(id));
            if !status.unconfirmed.is_empty() {
                return Err(WireError::new(
                    ErrorCode::Unavailable,
                    format!(
                        "the publish is committed here and on this node's copies, but not confirmed replicated on every member: {status}; it will reach every queue"
                    ),
                ));
            }
            if status.done() {
                return Ok(());
            }
            // Liveness changes without a notification: look again at least this often.
            let step = tokio::time::Instant::now() + Duration::from_millis(REPLICATED_POLL_MS);
            if tokio::time::timeout_at(step.min(deadline), applied)
                .await
                .is_err()
                && tokio::time::Instant::now() >= deadline
            {
                return Err(WireError::new(
                    ErrorCode::Unavailable,
                    format!(
                        "the publish is committed here and on this node's copies, but not replicated on every member within {wait_ms} ms: {status}; it will reach every queue"
                    ),
                ));
            }
        }
    }

    /// The session forwarded publishes are made under (created once).
    async fn forward_session(self: &Arc<Self>) -> Result<SessionId, WireError> {
        let Some(f) = &self.member.forwarding else {
            return Err(internal("not clustered"));
        };
        if let Some(id) = *f.session_slot().lock().expect("forward lock") {
            return Ok(id);
        }
        let id = self.apply(|core| Ok(core.publisher_session())).await?;
        *f.session_slot().lock().expect("forward lock") = Some(id);
        Ok(id)
    }

    /// Closes a session's connection with an error code.
    fn disconnect_session(&self, session: SessionId, code: ErrorCode, why: &str) {
        if let Some(h) = self.sessions.lock_or_stop().get(&session)
            && let Some(c) = &h.conn
        {
            c.close(code.varint(), why.as_bytes());
        }
    }

    /// Reports of this node's queues, with each copy's replication lag on a cluster.
    fn primary_reports(&self) -> Vec<QueueReport> {
        let mut reports = self.core().queue_reports();
        for r in &mut reports {
            if let Some(d) = r.durable_id.as_deref() {
                r.copies = self.copy_lags(d);
            }
        }
        reports
    }

    /// [`Shared::primary_reports`] followed by the copies held here for other primaries
    /// (ordered by durable id).
    pub(crate) async fn queue_reports(&self) -> Vec<QueueReport> {
        let mut reports = self.primary_reports();
        let mut copies = self
            .queue_views(crate::admin::RoleFilter::Secondary, self.clock.now_ms())
            .await;
        copies.sort_by(|a, b| a.id.cmp(&b.id));
        reports.extend(copies.into_iter().map(|v| v.into_report()));
        reports
    }

    /// Current value of a key (None when absent or invalidated).
    pub(crate) fn get(&self, region: &str, key: &str) -> Result<Option<Vec<u8>>, WireError> {
        crate::core::validate_region(region)?;
        crate::interest::validate_key(key)?;
        let v = self.store.region_get(region, key).map_err(internal)?;
        Ok(v.and_then(|v| decode_region_value(&v).map(<[u8]>::to_vec)))
    }
}

/// A publish's place in the writer's queue: one of its requests and its KiB, and its bytes in
/// the node's count, all given back when it is dropped (by the writer once it has committed
/// the publish or failed it, or at once if the publish is refused before it is submitted).
struct QueuedBytes {
    _kib: tokio::sync::OwnedSemaphorePermit,
    _request: tokio::sync::OwnedSemaphorePermit,
    shared: Arc<Shared>,
    bytes: u64,
}

impl Drop for QueuedBytes {
    fn drop(&mut self) {
        self.shared
            .writer_queue_bytes
            .fetch_sub(self.bytes, std::sync::atomic::Ordering::Relaxed);
    }
}

/// The writer's KiB permits for `bytes` (all of them for more than the writer's queue holds).
fn writer_kib(bytes: u64) -> u32 {
    bytes
        .div_ceil(1024)
        .min(crate::limits::WRITER_QUEUE_KIB_MAX as u64) as u32
}

/// The bytes a publish's operations carry (region names, keys and values): what the writer's
/// queue and a connection's publishes in flight are bounded by.
pub(crate) fn publish_ops_bytes(ops: &[PublishOp]) -> usize {
    ops.iter()
        .map(|op| match op {
            PublishOp::Put { region, key, value } => region.len() + key.len() + value.len(),
            PublishOp::Destroy { region, key } | PublishOp::Invalidate { region, key } => {
                region.len() + key.len()
            }
        })
        .sum()
}

fn shutdown_error() -> WireError {
    WireError::new(ErrorCode::Shutdown, "the node is shutting down")
}

fn internal(e: impl std::fmt::Display) -> WireError {
    WireError::new(ErrorCode::Internal, e.to_string())
}

async fn wait_commit(rx: oneshot::Receiver<Result<(), WriteError>>) -> Result<(), WireError> {
    match rx.await {
        Ok(Ok(())) => Ok(()),
        Ok(Err(e)) => Err(WireError::new(
            ErrorCode::Internal,
            format!("storage failed: {e}"),
        )),
        Err(_) => Err(shutdown_error()),
    }
}

/// A publish handed to the writer ([`Shared::submit_publish`]), to be finished by
/// [`Shared::finish_publish`]. Its place among the writer's queued requests and bytes
/// ([`QueuedBytes`]) is given back by the writer itself once it is committed.
pub(crate) struct Submitted {
    rx: oneshot::Receiver<Result<(), WriteError>>,
    enqueued: u64,
    /// Sessions whose queue the publish dropped for being full (drop-queue policy).
    dropped: Vec<SessionId>,
    receipt: Receipt,
}

/// What a publish did here, for `--ack replicated`.
pub(crate) struct Receipt {
    pub(crate) count: u64,
    /// Last offset appended per local queue.
    pub(crate) appended: Vec<(tether_storage::QueueId, tether_storage::Offset)>,
    /// The publish's offset in this node's publish log (a local publish on a cluster).
    pub(crate) logged: Option<tether_storage::Offset>,
}

/// Longest reason sent with a connection close, in bytes (it must fit one packet).
const CLOSE_REASON_BYTES_MAX: usize = 512;

/// How often a `--ack replicated` publish looks again at which members are alive, in ms.
pub const REPLICATED_POLL_MS: u64 = 100;

/// A running node.
pub struct Node {
    shared: Arc<Shared>,
    endpoint: quinn::Endpoint,
    addr: SocketAddr,
    metrics_addr: Option<SocketAddr>,
    ca: PathBuf,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

/// Publishes events into a node from the host process, without the network.
pub struct Publisher {
    shared: Arc<Shared>,
    session: SessionId,
}

impl Publisher {
    /// Publishes operations; returns once they are committed per the node's sync mode.
    pub async fn publish(&self, ops: &[PublishOp]) -> Result<u64, WireError> {
        self.shared.publish(self.session, ops).await
    }

    pub async fn put(
        &self,
        region: &str,
        key: &str,
        value: impl Into<Vec<u8>>,
    ) -> Result<(), WireError> {
        self.publish(&[PublishOp::Put {
            region: region.into(),
            key: key.into(),
            value: value.into(),
        }])
        .await
        .map(drop)
    }

    pub async fn destroy(&self, region: &str, key: &str) -> Result<(), WireError> {
        self.publish(&[PublishOp::Destroy {
            region: region.into(),
            key: key.into(),
        }])
        .await
        .map(drop)
    }

    pub async fn invalidate(&self, region: &str, key: &str) -> Result<(), WireError> {
        self.publish(&[PublishOp::Invalidate {
            region: region.into(),
            key: key.into(),
        }])
        .await
        .map(drop)
    }
}

impl Drop for Publisher {
    fn drop(&mut self) {
        self.shared
            .core()
            .disconnect(self.shared.clock.now_ms(), self.session, true);
    }
}

/// Refuses to start a cluster node whose certificate does not name it: its peers identify it by
/// the certificate's node name ([`tls::NODE_URI_PREFIX`]), never by the CA alone.
fn check_node_certificate(cert: &Path, node: &str) -> Result<(), NodeError> {
    let names = tls::file_node_names(cert)?;
    if names == [node] {
        return Ok(());
    }
    Err(NodeError::NodeCertificate {
        cert: cert.to_path_buf(),
        names,
        node: node.to_string(),
        uri: tls::node_uri(node),
    })
}

fn node_id_for(data_dir: &Path, configured: Option<&str>) -> Result<String, NodeError> {
    let file = data_dir.join("node-id");
    let io = |source| NodeError::DataDir {
        path: file.clone(),
        source,
    };
    if let Some(id) = configured {
        validate_node_id(id)?;
        std::fs::write(&file, id).map_err(io)?;
        return Ok(id.to_string());
    }
    match std::fs::read_to_string(&file) {
        Ok(s) => {
            let id = s.trim().to_string();
            validate_node_id(&id).map_err(|error| NodeError::NodeIdFile {
                path: file.clone(),
                error,
            })?;
            Ok(id)
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            use std::hash::{BuildHasher, Hasher};
            let mut h = std::collections::hash_map::RandomState::new().build_hasher();
            h.write_u128(
                SystemTime::now()
                    .duration_since(UNIX_EPOCH)
                    .map(|d| d.as_nanos())
                    .unwrap_or(0),
            );
            h.write_u32(std::process::id());
            let id = format!("n{:08x}", h.finish() as u32);
            std::fs::write(&file, &id).map_err(io)?;
            Ok(id)
        }
        Err(e) => Err(io(e)),
    }
}

/// Checks the settings a host may have built by hand (the command line checks them too), and
/// builds the authorizer of the `[auth]` table. Warns when the node is open beyond loopback.
fn check_config(
    config: &ServerConfig,
) -> Result<Option<std::sync::RwLock<Arc<crate::auth::Authorizer>>>, NodeError> {
    config.limits.validate()?;
    if let Some(w) = crate::config::open_node_warning(config.listen, config.auth.is_some()) {
        tracing::warn!("{w}");
    }
    crate::config::validate_node_failure_ms(config.node_failure_ms)?;
    Ok(match &config.auth {
        Some(a) => Some(std::sync::RwLock::new(Arc::new(
            crate::auth::Authorizer::new(a).map_err(crate::config::ConfigError::from)?,
        ))),
        None => None,
    })
}

/// The node's TLS material at start: its certificate files, the server configuration's
/// inputs, and the client certificate revocation lists in force.
struct NodeTls {
    files: TlsFiles,
    setup: revocation::TlsSetup,
    crls: tether_transport::crl::Crls,
    /// `[auth] client-crl`, watched for changes, and its modification time at start.
    client_crl: Option<PathBuf>,
    crl_modified: Option<SystemTime>,
}

impl NodeTls {
    /// The configured certificate files, or dev ones generated under `<data-dir>/tls`; a
    /// cluster node's certificate must name it (that is how its peers know who it is).
    fn set_up(config: &ServerConfig, data_dir: &Path, clustered: bool) -> Result<Self, NodeError> {
        let cluster_node = config.node_id.as_deref().filter(|_| clustered);
        let files = match &config.tls {
            Some(t) => TlsFiles {
                ca: t.ca.clone(),
                cert: t.cert.clone(),
                key: t.key.clone(),
            },
            None => {
                // Every name a local setup reaches the node by: the defaults, the machine's
                // host name, and the advertised names.
                let mut names: Vec<String> =
                    crate::config::machine_host_name().into_iter().collect();
                names.extend(config.advertise.iter().cloned());
                tls::ensure_dev_node_certs(&data_dir.join("tls"), cluster_node, &names)?
            }
        };
        if let Some(node) = cluster_node {
            check_node_certificate(&files.cert, node)?;
        }
        let client_ca = config.auth.as_ref().and_then(|a| a.client_ca.clone());
        let client_crl = config.auth.as_ref().and_then(|a| a.client_crl.clone());
        if client_crl.is_some() && client_ca.is_none() && !clustered {
            return Err(NodeError::CrlWithoutClientCa);
        }
        let setup = revocation::TlsSetup {
            files: files.clone(),
            clustered,
            client_ca,
            idle_timeout_ms: config.limits.idle_timeout_ms,
            receive_window_bytes: config.limits.connection_receive_window_bytes,
            send_window_bytes: config.limits.connection_send_window_bytes,
            peer_versions: config.peer_protocol_versions.clone(),
        };
        let (crls, crl_modified) = match &client_crl {
            Some(path) => revocation::load_at_start(path)?,
            None => Default::default(),
        };
        Ok(NodeTls {
            files,
            setup,
            crls,
            client_crl,
            crl_modified,
        })
    }
}

/// What a node rebuilds from its store at start.
struct Recovered {
    core: NodeCore,
    copies: copies::Copies,
    recent: failover::RecentForwards,
    forwarding: Option<forward::Forwarding>,
    /// This node joins a running cluster and has not copied its regions yet (`join.rs`).
    joining: bool,
}

/// Rebuilds the core, the copies held here and (on a clustered node) the recent publishes and
/// the publish log from `store`; writes the recovery's batch.
fn recover(
    config: &ServerConfig,
    store: &Arc<dyn Store>,
    node_id: &str,
    now_ms: u64,
    clustered: bool,
) -> Result<Recovered, NodeError> {
    let mut queues = store.queues()?;
    queues.retain(|(q, _)| *q != forward::PUBLISH_LOG_QUEUE && *q != failover::RECENT_LOG_QUEUE);
    let (queues, copies) = NodeCore::split_copies(queues)?;
    let entry_bytes = |q, from, to| crate::core::bytes::stored_entry_bytes(&**store, q, from, to);
    let (copies, copies_through) = copies::Copies::recover(copies, entry_bytes)?;
    // Only a clustered node holds copies (and so keeps recent publishes).
    let mut recent = if clustered {
        failover::RecentForwards::recover(&**store)?
    } else {
        failover::RecentForwards::default()
    };
    for (id, through) in &copies_through {
        recent.copy_through(id, through);
    }
    let recovered = queues.len();
    let (core, batch) =
        NodeCore::recover(node_id, now_ms, queues, |k| store.state_get(k), entry_bytes)?;
    let mut core = core.with_limits(config.limits.clone());
    if clustered {
        // Until the reconciler has looked at the metadata, deliver only what is acked
        // (nothing): a queue with copies must not deliver what they may lack.
        core.cap_all_queues();
    }
    store.write(&batch, true)?;
    tracing::info!(
        node_id,
        queues = recovered,
        copies = copies.len(),
        "recovered storage"
    );
    let forwarding = if clustered {
        Some(forward::Forwarding::open(
            &**store,
            now_ms,
            node_id,
            &config.peers,
            &config.limits,
            Duration::from_millis(config.replicated_ack_timeout_ms),
        )?)
    } else {
        None
    };
    let joining = clustered && config.join && !join::joined(&**store)?;
    Ok(Recovered {
        core,
        copies,
        recent,
        forwarding,
        joining,
    })
}

/// Follows the cluster's members: forwards this node's publishes to each (a task per peer,
/// started for the members of the configuration and for each member that joins), and stops
/// keeping publishes for a member that is removed. A node that finds itself removed says so.
async fn membership_loop(weak: Weak<Shared>, cluster: Arc<Cluster>) {
    let mut changes = cluster.members_changes();
    let mut forwarders = tokio::task::JoinSet::new();
    let mut told_removed = false;
    if let Some(s) = weak.upgrade()
        && let Some(f) = &s.member.forwarding
    {
        for peer in f.peers() {
            forwarders.spawn(forward::forward_loop(weak.clone(), cluster.clone(), peer));
        }
    }
    loop {
        let members = Arc::clone(&changes.borrow_and_update());
        let Some(s) = weak.upgrade() else { return };
        if !members.nodes.contains_key(&cluster.id()) && !told_removed {
            told_removed = true;
            tracing::warn!("this node was removed from the cluster: it holds no queue; stop it");
        }
        for peer in forward::set_peers(&s, &members).await {
            forwarders.spawn(forward::forward_loop(weak.clone(), cluster.clone(), peer));
        }
        drop(s);
        tokio::select! {
            changed = changes.changed() => if changed.is_err() { return },
            // Reap forwarders that ended (a removed peer's).
            Some(_) = forwarders.join_next(), if !forwarders.is_empty() => {}
        }
    }
}

/// Starts a clustered node's tasks: the members' follower (forwarding to each peer), the
/// reconciler, the failure detector, the metadata catch-up, the trim of recent publishes and
/// rebalancing.
fn spawn_cluster_tasks(
    shared: &Arc<Shared>,
    cluster: &Arc<Cluster>,
    rebalance: bool,
) -> Vec<tokio::task::JoinHandle<()>> {
    let weak = || Arc::downgrade(shared);
    vec![
        tokio::spawn(membership_loop(weak(), cluster.clone())),
        tokio::spawn(failover::reconcile_loop(weak(), cluster.clone())),
        tokio::spawn(failover::detect_loop(weak(), cluster.clone())),
        tokio::spawn(failover::catch_up(weak(), cluster.clone())),
        tokio::spawn(failover::recent_trim_loop(weak())),
        // Without `rebalance`, the loop still hands queues over while this node drains.
        tokio::spawn(rebalance::rebalance_loop(
            weak(),
            cluster.clone(),
            rebalance,
        )),
    ]
}

impl Shared {
    /// The shared state of a node starting with what it `recovered`; `ids` are its authorizer,
    /// node id and cluster CA.
    fn new(
        config: &ServerConfig,
        store: Arc<dyn Store>,
        clock: clock::Clock,
        ids: (
            Option<std::sync::RwLock<Arc<crate::auth::Authorizer>>>,
            String,
            PathBuf,
        ),
        recovered: Recovered,
    ) -> Self {
        let (auth, node_id, cluster_ca) = ids;
        let (fatal, _) = watch::channel(None);
        let fatal_tx = fatal.clone();
        let (writer, writer_thread) = Writer::start(
            store.clone(),
            config.sync,
            Box::new(move |e| {
                // `send_replace`: the value must stick even with no receiver yet (a host may ask
                // `Node::failed` after the failure).
                fatal_tx.send_replace(Some(e));
            }),
        );
        Shared {
            held_at_start: recovered
                .core
                .durable_epochs()
                .into_iter()
                .map(|(id, _)| id)
                .collect(),
            core: Mutex::new(recovered.core),
            clock,
            replicated_wait: Duration::from_millis(config.replicated_ack_timeout_ms),
            store,
            writer,
            _writer_thread: WriterThread::new(writer_thread),
            write_permits: Arc::new(Semaphore::new(WRITER_QUEUE_REQUESTS_MAX)),
            write_kib: Arc::new(Semaphore::new(crate::limits::WRITER_QUEUE_KIB_MAX)),
            regex_matchers: Default::default(),
            regex_matches_under_lock: Default::default(),
            publish_bytes_in_flight: std::sync::atomic::AtomicU64::new(0),
            requests_unanswered: AtomicUsize::new(0),
            draining: watch::Sender::new(false),
            closing: watch::Sender::new(false),
            writer_queue_bytes: std::sync::atomic::AtomicU64::new(0),
            delivery_reads: Semaphore::new(DELIVERY_READS_IN_FLIGHT_MAX),
            delivery_pool: low_priority::LowPriorityPool::start(
                "tether-delivery",
                DELIVERY_READ_THREADS,
            ),
            sessions: Mutex::new(HashMap::new()),
            connections: AtomicUsize::new(0),
            space: Notify::new(),
            limits: config.limits.clone(),
            auth,
            fatal,
            node_id,
            stats: admin::NodeStats::default(),
            member: Member {
                cluster: std::sync::OnceLock::new(),
                cluster_ca,
                forwarding: recovered.forwarding,
                copies: recovered.copies,
                placing: Default::default(),
                releasing: Default::default(),
                shipping: shipping::Shipping::default(),
                liveness: failover::Liveness::new(Duration::from_millis(config.node_failure_ms)),
                recent: Mutex::new(recovered.recent),
                applied_through: Mutex::new(Default::default()),
                meta_caught_up: watch::channel(false).0,
                joined: watch::channel(!recovered.joining).0,
            },
        }
    }
}

impl Node {
    /// Opens (or creates) the data directory, recovers every durable queue, and starts
    /// accepting clients.
    pub async fn start(config: ServerConfig) -> Result<Node, NodeError> {
        let db_dir = config.data_dir.join("db");
        std::fs::create_dir_all(&config.data_dir).map_err(|source| NodeError::DataDir {
            path: config.data_dir.clone(),
            source,
        })?;
        let tuning = tether_storage::StoreTuning {
            direct_io_for_flush_and_compaction: config.direct_io,
        };
        let store: Arc<dyn Store> = Arc::new(
            tokio::task::spawn_blocking(move || RocksStore::open_tuned(&db_dir, tuning))
                .await
                // A panic while opening is a bug: it goes on as the panic it is.
                .unwrap_or_else(|e| std::panic::resume_unwind(e.into_panic()))?,
        );
        Self::start_with_store(config, store).await
    }

    /// [`Node::start`] on a store the host provides instead of the RocksDB store in
    /// `<data-dir>/db` (the data directory still holds TLS material, the node id and, on a
    /// clustered node, the consensus log). For hosts with their own storage wrapper, and for
    /// fault-injection tests.
    pub async fn start_with_store(
        config: ServerConfig,
        store: Arc<dyn Store>,
    ) -> Result<Node, NodeError> {
        tls::install_crypto_provider();
        let auth = check_config(&config)?;
        let clock = clock::Clock::start(config.clock_offset_ms);
        // The file's time before the table in force was read: a change after it is seen.
        let auth_file = match (&config.auth, &config.auth_file) {
            (Some(a), Some(path)) => Some((path.clone(), a.clone(), revocation::modified(path))),
            _ => None,
        };
        let data_dir = config.data_dir.clone();
        std::fs::create_dir_all(&data_dir).map_err(|source| NodeError::DataDir {
            path: data_dir.clone(),
            source,
        })?;
        let node_id = node_id_for(&data_dir, config.node_id.as_deref())?;
        let clustered = !config.peers.is_empty();
        if clustered && config.node_id.is_none() {
            return Err(NodeError::ClusterWithoutNodeId);
        }
        if config.join && !clustered {
            return Err(NodeError::JoinWithoutPeers);
        }
        let tls = NodeTls::set_up(&config, &data_dir, clustered)?;
        let server_config = tls.setup.server_config(&tls.crls)?;
        let recovered = recover(&config, &store, &node_id, clock.now_ms(), clustered)?;
        let shared = Arc::new(Shared::new(
            &config,
            store,
            clock,
            (auth, node_id, tls.files.ca.clone()),
            recovered,
        ));
        let endpoint = tether_transport::endpoint::server_endpoint(config.listen, server_config)
            .map_err(|source| NodeError::Listen {
                addr: config.listen,
                source,
            })?;
        let addr = endpoint.local_addr().map_err(|source| NodeError::Listen {
            addr: config.listen,
            source,
        })?;
        let mut tasks = Vec::new();
        m::handle();
        let metrics_addr = match config.metrics {
            Some(a) => {
                let (bound, task) =
                    admin::serve(a, Arc::downgrade(&shared), addr, config.metrics_top_queues)
                        .await
                        .map_err(|source| NodeError::Listen { addr: a, source })?;
                tasks.push(task);
                Some(bound)
            }
            None => None,
        };
        if clustered {
            let members = Members::new(&shared.node_id, &addr.to_string(), &config.peers)?;
            let cluster = Cluster::start(
                &shared.node_id,
                members,
                config.join,
                &data_dir.join(RAFT_DIR),
                endpoint.clone(),
                tls::peer_client_config_speaking(
                    &tls.files,
                    config.peer_protocol_versions.clone(),
                )?,
            )
            .await?;
            tasks.extend(spawn_cluster_tasks(&shared, &cluster, config.rebalance));
            if !*shared.member.joined.borrow() {
                tasks.push(tokio::spawn(join::join_loop(
                    Arc::downgrade(&shared),
                    cluster.clone(),
                )));
            } else if join::undrain_pending(&*shared.store)? {
                tracing::info!("this node joined but did not undrain itself before it stopped");
                tasks.push(tokio::spawn(join::undrain(
                    Arc::downgrade(&shared),
                    cluster.clone(),
                )));
            }
            let _ = shared.member.cluster.set(cluster);
        }
        tasks.push(tokio::spawn(conn::accept_loop(
            shared.clone(),
            endpoint.clone(),
        )));
        tasks.push(tokio::spawn(tick_loop(shared.clone())));
        if let Some((path, started, modified)) = auth_file {
            tasks.push(tokio::spawn(auth_reload::watch(
                Arc::downgrade(&shared),
                path,
                started,
                modified,
            )));
        }
        if let Some(path) = tls.client_crl {
            tasks.push(tokio::spawn(revocation::watch(
                Arc::downgrade(&shared),
                endpoint.clone(),
                tls.setup,
                path,
                tls.crl_modified,
            )));
        }
        Ok(Node {
            shared,
            endpoint,
            addr,
            metrics_addr,
            ca: tls.files.ca,
            tasks,
        })
    }

    /// The bound QUIC address.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// The bound metrics address, if enabled.
    pub fn metrics_addr(&self) -> Option<SocketAddr> {
        self.metrics_addr
    }

    /// The CA certificate clients should trust.
    pub fn ca_file(&self) -> &Path {
        &self.ca
    }

    /// Bytes of publish operations read from client connections and not answered yet (each
    /// connection holds at most
    /// [`PUBLISH_BYTES_IN_FLIGHT_PER_CONNECTION_MAX`](crate::limits::PUBLISH_BYTES_IN_FLIGHT_PER_CONNECTION_MAX)
    /// plus one frame).
    pub fn publish_bytes_in_flight(&self) -> u64 {
        self.shared
            .publish_bytes_in_flight
            .load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Bytes of publishes submitted to the storage writer and not committed yet: their
    /// operations and what they add to their queues (at most
    /// [`WRITER_QUEUE_BYTES_MAX`](crate::limits::WRITER_QUEUE_BYTES_MAX), or one publish
    /// beyond it).
    pub fn writer_queue_bytes(&self) -> u64 {
        self.shared
            .writer_queue_bytes
            .load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Requests (publishes and other writes) submitted to the storage writer and not
    /// committed yet (at most [`WRITER_QUEUE_REQUESTS_MAX`]).
    pub fn writer_queue_requests(&self) -> usize {
        WRITER_QUEUE_REQUESTS_MAX - self.shared.write_permits.available_permits()
    }

    /// Publish operations whose keys were matched against their region's interest regexes
    /// under the core lock, since the node started: the first publish to a region after its
    /// regexes changed; the others are matched before the lock is taken.
    pub fn regex_matches_under_lock(&self) -> u64 {
        self.shared
            .regex_matches_under_lock
            .load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Resumed durable queues whose client had seen more than they knew, since the node
    /// started: `(flags raised, diverged)` (see [`SeenVerdict`](crate::core::SeenVerdict)).
    pub fn client_seen_counts(&self) -> (u64, u64) {
        let s = &self.shared.stats;
        let load = |c: &std::sync::atomic::AtomicU64| c.load(std::sync::atomic::Ordering::Relaxed);
        (load(&s.seen_flags_raised), load(&s.seen_diverged))
    }

    /// Whether this node is still joining a running cluster (`--join`): added or waiting to
    /// be, it has not copied the regions' values yet and serves no client.
    pub fn joining(&self) -> bool {
        !*self.shared.member.joined.borrow()
    }

    /// Whether this node recorded its join (`--join`) but not yet its undrain after it.
    pub fn join_undrain_pending(&self) -> Result<bool, tether_storage::StorageError> {
        join::undrain_pending(&*self.shared.store)
    }

    /// The metadata group handle, on a clustered node.
    pub fn cluster(&self) -> Option<&Arc<Cluster>> {
        self.shared.member.cluster.get()
    }

    pub fn node_id(&self) -> &str {
        &self.shared.node_id
    }

    /// A publisher session for the host process (its own event-id session number).
    pub async fn publisher(&self) -> Result<Publisher, NodeError> {
        let session = self
            .shared
            .apply(|core| Ok(core.publisher_session()))
            .await?;
        Ok(Publisher {
            shared: self.shared.clone(),
            session,
        })
    }

    /// The current value of a key.
    pub fn get(&self, region: &str, key: &str) -> Result<Option<Vec<u8>>, NodeError> {
        Ok(self.shared.get(region, key)?)
    }

    /// Every queue this node holds.
    pub fn queues(&self) -> Vec<QueueReport> {
        self.shared.primary_reports()
    }

    /// Resolves with the storage failure if storage fails (the node then refuses all work).
    pub async fn failed(&self) -> Arc<tether_storage::StorageError> {
        let mut rx = self.shared.fatal.subscribe();
        loop {
            if let Some(e) = rx.borrow().clone() {
                return e;
            }
            if rx.changed().await.is_err() {
                std::future::pending::<()>().await;
            }
        }
    }

    /// Stops gracefully: first drains the client sessions (every request read so far is
    /// answered, later ones are answered `going-away`, not applied, so a client sends them to
    /// another node; at most [`SHUTDOWN_REQUESTS_DRAIN_MS`]), then stops accepting, closes
    /// every session as after a client crash (durable queues are kept), flushes storage.
    pub async fn shutdown(self) {
        self.drain_requests().await;
        self.shared.closing.send_replace(true);
        if let Some(c) = self.shared.member.cluster.get() {
            c.shutdown().await;
        }
        // Clients learn why: a plain shutdown, or the storage failure that stopped the node.
        let mut why = match self.shared.fatal.borrow().clone() {
            Some(e) => format!("storage failed: {e}"),
            None => "node shutting down".to_string(),
        };
        if why.len() > CLOSE_REASON_BYTES_MAX {
            let mut end = CLOSE_REASON_BYTES_MAX;
            while !why.is_char_boundary(end) {
                end -= 1;
            }
            why.truncate(end);
        }
        self.endpoint
            .close(ErrorCode::Shutdown.varint(), why.as_bytes());
        let waiters: Vec<watch::Receiver<bool>> = self
            .shared
            .sessions
            .lock_or_stop()
            .values()
            .map(|h| h.finished.clone())
            .collect();
        for mut w in waiters {
            let _ = tokio::time::timeout(Duration::from_secs(5), w.wait_for(|done| *done)).await;
        }
        for t in &self.tasks {
            t.abort();
        }
        let _ = tokio::time::timeout(
            Duration::from_millis(ENDPOINT_DRAIN_TIMEOUT_MS),
            self.endpoint.wait_idle(),
        )
        .await;
        // Everything submitted so far is committed once this empty request is.
        let _ = self.shared.writer.submit(Batch::new(), None).await;
        let store = self.shared.store.clone();
        let _ = tokio::task::spawn_blocking(move || store.flush()).await;
        // Close the database before returning: the writer thread ends when the last handle on
        // the shared state goes, and RocksDB must not be open while the process exits.
        let start = std::time::Instant::now();
        while Arc::strong_count(&self.shared) > 1
            && start.elapsed() < Duration::from_secs(SHUTDOWN_DRAIN_SECS)
        {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        if Arc::strong_count(&self.shared) > 1 {
            // Something still holds the store: stop RocksDB's background threads so the process
            // can exit safely anyway (nothing writes after the flush above).
            self.shared.store.quiesce();
            tracing::warn!(
                "a publisher or session still holds the node; storage stays open until it is dropped"
            );
        }
        // Dropping the last handle joins the writer thread and closes the database.
        let shared = self.shared.clone();
        drop(self);
        let _ = tokio::task::spawn_blocking(move || drop(shared)).await;
    }
}

impl Node {
    /// The first step of [`Node::shutdown`]: no new request is taken, and those under way are
    /// answered (for at most [`SHUTDOWN_REQUESTS_DRAIN_MS`]). Acks and deliveries go on.
    async fn drain_requests(&self) {
        self.shared.draining.send_replace(true);
        let start = std::time::Instant::now();
        let under_way = || self.shared.requests_unanswered.load(Ordering::Relaxed);
        let had_sessions = !self.shared.sessions.lock_or_stop().is_empty();
        while under_way() > 0 && start.elapsed() < Duration::from_millis(SHUTDOWN_REQUESTS_DRAIN_MS)
        {
            tokio::time::sleep(Duration::from_millis(SHUTDOWN_DRAIN_POLL_MS)).await;
        }
        if under_way() > 0 {
            tracing::warn!(
                requests = under_way(),
                "stopping with client requests not answered"
            );
        }
        if had_sessions {
            // The last answers are written to their streams; give them a moment on the wire
            // before the close discards what is not sent.
            tokio::time::sleep(Duration::from_millis(SHUTDOWN_ANSWERS_GRACE_MS)).await;
        }
    }
}

/// How long a stopping node waits for the client requests under way to be answered, in
/// milliseconds (a publish with `ack: replicated` waits for copies).
pub const SHUTDOWN_REQUESTS_DRAIN_MS: u64 = 3_000;
/// Pause between two looks at the requests under way while draining, in milliseconds.
pub const SHUTDOWN_DRAIN_POLL_MS: u64 = 5;
/// How long a stopping node that had sessions leaves its last answers to reach their clients
/// before it closes the connections, in milliseconds.
pub const SHUTDOWN_ANSWERS_GRACE_MS: u64 = 50;

impl Drop for Node {
    /// A node dropped without [`Node::shutdown`] stops its tasks; its storage closes once the
    /// runtime has dropped the sessions that still hold it.
    fn drop(&mut self) {
        for t in &self.tasks {
            t.abort();
        }
        self.endpoint
            .close(ErrorCode::Shutdown.varint(), b"node dropped");
    }
}

/// Directory of the metadata consensus log, under the data directory.
pub const RAFT_DIR: &str = "raft";

/// How long shutdown waits for sessions and tasks to let go of the node, in seconds.
pub const SHUTDOWN_DRAIN_SECS: u64 = 5;

/// How long shutdown waits for the endpoint's closed connections to drain (so peers and
/// clients learn of the close and the UDP socket is released), in milliseconds.
pub const ENDPOINT_DRAIN_TIMEOUT_MS: u64 = 2_000;

/// Ticks between two readings of the heap figures (`crate::heap::native_heap` walks glibc's
/// arenas under their locks).
const HEAP_METRICS_EVERY_TICKS: u64 = 10;

async fn tick_loop(shared: Arc<Shared>) {
    let mut interval = tokio::time::interval(Duration::from_millis(EXPIRY_TICK_MS));
    let mut ticks = 0u64;
    loop {
        interval.tick().await;
        ticks += 1;
        let expired = shared
            .apply(|core| {
                let (batch, ids) = core.tick(shared.clock.now_ms());
                Ok((ids, batch))
            })
            .await;
        // Blocked publishers re-check at least this often (queues also shrink by expiry, drops
        // and closes, not only by acks).
        shared.space.notify_waiters();
        if let Ok(ids) = expired {
            for id in &ids {
                tracing::info!(durable_id = %id, "durable queue expired");
                let owner = shared.core().expired_owner(id).map(str::to_string);
                placement::forget(&shared, id, placement::Ended::Expired { owner });
            }
            metrics::counter!(m::QUEUES_EXPIRED).increment(ids.len() as u64);
        }
        let c = {
            let now = shared.clock.now_ms();
            let mut core = shared.core();
            core.sample_rates(now);
            core.counts(now)
        };
        metrics::gauge!(m::QUEUES, "state" => "connected").set(c.attached as f64);
        metrics::gauge!(m::QUEUES, "state" => "ready").set(c.ready as f64);
        metrics::gauge!(m::QUEUES, "state" => "away").set(c.away as f64);
        metrics::gauge!(m::PENDING_EVENTS).set(c.pending_total as f64);
        metrics::gauge!(m::PENDING_BYTES).set(c.pending_bytes_total as f64);
        if let Some(f) = &shared.member.forwarding {
            metrics::gauge!(m::PUBLISH_LOG_BYTES).set(f.pending_bytes() as f64);
            // Also between forwarding rounds: new publishes raise the lag before they go out.
            for peer in f.peers() {
                metrics::gauge!(m::FORWARD_LAG, "peer" => peer.name.clone())
                    .set(f.lag(&peer.name) as f64);
            }
        }
        metrics::gauge!(m::OLDEST_UNACKED_AGE).set(c.oldest_unacked_age_ms as f64 / 1e3);
        metrics::gauge!(m::CONNECTIONS).set(shared.connections.load(Ordering::Relaxed) as f64);
        let mem = shared.store.memory();
        for (kind, bytes) in [
            ("memtables", mem.memtables_bytes),
            ("table_readers", mem.table_readers_bytes),
            ("block_cache", mem.block_cache_bytes),
            ("block_cache_pinned", mem.block_cache_pinned_bytes),
        ] {
            metrics::gauge!(m::STORAGE_MEMORY, "kind" => kind).set(bytes as f64);
        }
        metrics::gauge!(m::STORAGE_L0_FILES).set(mem.entries_l0_files as f64);
        if let Some(b) = crate::heap::rust_heap_bytes() {
            metrics::gauge!(m::HEAP_LIVE, "allocator" => "rust").set(b as f64);
        }
        if ticks % HEAP_METRICS_EVERY_TICKS == 1
            && let Some(h) = crate::heap::native_heap()
        {
            metrics::gauge!(m::HEAP_LIVE, "allocator" => "native").set(h.live_bytes as f64);
            metrics::gauge!(m::HEAP_RETAINED, "allocator" => "native").set(h.retained_bytes as f64);
        }
        if let Some(cl) = shared.member.cluster.get() {
            let me = cl.id();
            metrics::gauge!(m::CLUSTER_IS_LEADER).set(f64::from(u8::from(cl.leader() == Some(me))));
            metrics::gauge!(m::CLUSTER_TERM).set(cl.term() as f64);
            metrics::gauge!(m::CLUSTER_APPLIED_INDEX).set(cl.applied_index() as f64);
            let placed = cl.read(|s| s.queues.values().filter(|p| p.primary == me).count());
            metrics::gauge!(m::CLUSTER_PLACED_QUEUES).set(placed as f64);
            metrics::gauge!(m::QUEUE_COPIES).set(shared.member.copies.len() as f64);
            let mut lag: HashMap<crate::ids::NodeId, u64> = HashMap::new();
            for sq in shared.member.shipping.all() {
                for (peer, l) in sq.lags() {
                    let e = lag.entry(peer).or_default();
                    *e = (*e).max(l);
                }
            }
            for (peer, l) in lag {
                metrics::gauge!(m::REPLICATION_LAG, "peer" => cl.members().name(peer))
                    .set(l as f64);
            }
        }
    }
}
