//! Publish forwarding between cluster members: every publish made on a node reaches every
//! other node, which applies it to its own region store and its own queues. So an event
//! published anywhere reaches every queue whose interest matches, wherever the queue lives.
//!
//! # Design
//! * The origin appends each publish (its operations, one entry) to its **publish log**, a
//!   queue of the node's store with the reserved id [`PUBLISH_LOG_QUEUE`], in the same atomic
//!   batch as the publish itself: a publish acknowledged locally is also durably queued for
//!   every peer, whatever happens next (peer down, origin killed and restarted).
//! * The log is bounded (`publish-log-bytes-max`): once it holds that many bytes (a peer down
//!   or slow), new publishes on this node are refused with `unavailable` until the peers catch
//!   up: a publish is never accepted without being kept for every peer. Bytes are counted like
//!   a queue's ([`QueueBytes`], byte marks stored with the log).
//! * One forwarding task per peer ships the log in order (runs of up to
//!   [`FORWARD_BATCH_ENTRIES_MAX`] entries, up to [`FORWARD_RPCS_IN_FLIGHT_MAX`](crate::control::forward::FORWARD_RPCS_IN_FLIGHT_MAX) peer RPCs in
//!   flight, each run after the one before; the pipeline's decisions are
//!   [`crate::control::forward`]'s, without I/O) and records how far the peer has applied
//!   (`fwd-sent/<peer>`), moved only after the peer answered that it applied the entries: in
//!   memory at once, durably with the next group commit, which the loop does not wait for
//!   (a cursor lost in a crash is behind, and the peer skips what it applied). Entries every peer has applied are trimmed (below the lowest peer
//!   cursor). A run sent while another is in flight says which offset it follows (`follows`):
//!   the peer applies it only after that one, else answers with what it applied, and the
//!   origin sends again from there. A member removed and added again is a new generation of
//!   its peer ([`Peer::generation`]): the task of its earlier membership stops instead of
//!   running beside the new one. With its runs the task also tells each peer the *floor*,
//!   how far every peer has applied this node's log (what a promotion's kept publishes wait
//!   for, `failover.rs`).
//! * The receiver applies entries in order, each once: it stores the highest origin offset
//!   applied (`fwd-applied/<origin>`) in the batch that applies it, and skips anything at or
//!   below it (a retry after a lost response). A run's publishes are submitted together and
//!   committed in one group commit.
//! * `--ack replicated`: a publish succeeds only if every live member answered that the copies
//!   of the queues it reached there hold it (`Published`). A member whose wait ran out answers
//!   `PublishedUnconfirmed`, and the publisher gets `unavailable` saying where the publish
//!   stands. Per peer, the origin keeps the runs it applied without its copies confirming them
//!   (`UnconfirmedRuns`), which `--ack replicated` never counts as replicated.
//!
//! Ordering: the entries of one origin are applied in the origin's commit order, so the
//! events of one publisher stay in order on every node. Publishes of different origins
//! interleave differently on different nodes.

use crate::bug::LockExt;
use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

use tether_storage::{Batch, Entry, Offset, QueueId, Store};
use tether_transport::codec;
use tokio::sync::watch;

use super::Shared;
use crate::cluster::meta::{NodeId, raft_id};
use crate::cluster::network::{ForwardedPublish, PeerRequest, PeerResponse, PublishSink};
use crate::cluster::{Cluster, Members};
use crate::config::Limits;
use crate::control::forward::{
    Answer, EntryStep, FORWARD_RPC_TIMEOUT_MS, Run, Sender, applied_before_run, entry_step,
    new_log_start, run_ready,
};
use crate::core::bytes::{QueueBytes, mark_interval_bytes, stored_entry_bytes};
use crate::core::{EventOrigin, RecoveryError, SessionId};
use crate::limits::FORWARD_GAP_WAIT_MS;
use crate::metrics as m;
use crate::protocol::EventId;
use crate::protocol::PublishOp;
use crate::protocol::{ErrorCode, WireError};

/// Queue id of the publish log in the node's store (never allocated to a subscription queue:
/// those count up from 1).
pub const PUBLISH_LOG_QUEUE: QueueId = u64::MAX;
/// Info blob that marks the publish log's metadata.
pub const PUBLISH_LOG_INFO: &[u8] = b"tether-publish-log";
/// Most publish-log entries in one forwarding RPC.
pub const FORWARD_BATCH_ENTRIES_MAX: usize = 512;
/// Most publish-log bytes read for one forwarding RPC.
pub const FORWARD_BATCH_BYTES_MAX: usize = 1 << 20;
/// Most runs a peer applied without confirming their copies kept per peer; past it they merge
/// into one span (see [`UnconfirmedRuns`]).
pub const UNCONFIRMED_RUNS_PER_PEER_MAX: usize = 1_024;
/// How long a peer's unconfirmed run is kept, in multiples of the replicated-ack wait: a
/// `--ack replicated` publish waits at most twice that (for this node's copies, then for the
/// members), so every waiter sees the runs that concern it.
pub const UNCONFIRMED_RUNS_KEPT_WAITS: u32 = 3;
/// With nothing to forward, how often a forwarding task checks whether the floor (what every
/// peer has applied) moved and should be told, in milliseconds.
pub const FORWARD_FLOOR_POLL_MS: u64 = 250;

fn sent_key(peer: &str) -> String {
    format!("fwd-sent/{peer}")
}

fn applied_key(origin: &str) -> String {
    format!("fwd-applied/{origin}")
}

fn read_u64(store: &dyn Store, key: &str) -> Option<u64> {
    let b = store.state_get(key).ok().flatten()?;
    Some(u64::from_be_bytes(b.as_slice().try_into().ok()?))
}

/// Where forwarding to `peer` resumes: its stored cursor, never below what is trimmed (`acked`).
/// A peer without a cursor (new to this node), or with one older than the trim (a member that
/// was removed and is back), gets the publishes from the trim on.
fn start_cursor(store: &dyn Store, peer: &str, acked: Offset) -> Offset {
    read_u64(store, &sent_key(peer)).unwrap_or(acked).max(acked)
}

/// A node's forwarding state (clustered nodes only).
pub(crate) struct Forwarding {
    /// Peers, this node excluded: the members (`set_peers`).
    peers: std::sync::RwLock<Vec<Peer>>,
    /// The generation the next peer added gets.
    next_generation: AtomicU64,
    /// The first offset of this node's publish log (0: a log from before that was recorded,
    /// which started at 1); told with every run (`control::forward::applied_before_run`).
    log_start: Offset,
    /// Highest publish-log offset assigned (under the core lock, so in commit order).
    pub(crate) log_end: AtomicU64,
    /// Highest publish-log offset committed; forwarding tasks wait on it.
    pub(crate) committed: watch::Sender<Offset>,
    /// Per peer: highest offset it has applied (mirrors `fwd-sent/<peer>`).
    sent: Mutex<HashMap<String, Offset>>,
    /// Notified whenever a peer's applied offset moves.
    pub(crate) sent_changed: tokio::sync::Notify,
    /// Offsets at or below this are trimmed from the log.
    trimmed: AtomicU64,
    /// Bytes of the log not trimmed yet (locked under the core lock on the publish path).
    bytes: Mutex<QueueBytes>,
    /// `publish-log-bytes-max`.
    bytes_max: u64,
    /// Per origin: highest offset applied here; the lock also serializes forwarded applies.
    applied: tokio::sync::Mutex<HashMap<String, Offset>>,
    /// Notified whenever `applied` moves (a run waiting for the one before it).
    applied_changed: tokio::sync::Notify,
    /// The session forwarded publishes are made under (created on first use).
    session: Mutex<Option<SessionId>>,
    /// Per peer: runs it applied without confirming that its queues' copies hold them.
    unconfirmed: Mutex<HashMap<String, UnconfirmedRuns>>,
    /// Peers whose last answer said they are joining the cluster, holding nothing.
    joining: Mutex<std::collections::HashSet<String>>,
    /// How long an unconfirmed run is kept.
    unconfirmed_kept: Duration,
}

/// A member this node forwards its publish log to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Peer {
    pub(crate) name: String,
    pub(crate) id: NodeId,
    /// Which time it was added: a member removed and added again gets a new generation, and
    /// the forwarding task of its earlier membership stops (it would otherwise run beside the
    /// new one, sending the same runs twice and moving the cursor with the answers of a member
    /// that may have started over from an empty data directory).
    pub(crate) generation: u64,
}

/// Runs of this node's publish log a peer applied without confirming that the copies of the
/// queues they reached hold them (the peer's own wait for its copies ran out): a
/// `--ack replicated` publish among them is not confirmed replicated there. A run is kept for
/// a while (longer than any such wait); past [`UNCONFIRMED_RUNS_PER_PEER_MAX`] runs they merge
/// into one span, which may count more publishes as unconfirmed, never fewer.
#[derive(Default)]
pub(crate) struct UnconfirmedRuns {
    /// `(first, last, noted at)`, oldest first.
    runs: VecDeque<(Offset, Offset, Instant)>,
}

impl UnconfirmedRuns {
    /// The peer applied offsets `first..=last` without confirming their copies.
    pub(crate) fn note(&mut self, first: Offset, last: Offset, now: Instant, kept: Duration) {
        while self
            .runs
            .front()
            .is_some_and(|(_, _, at)| now.saturating_duration_since(*at) >= kept)
        {
            self.runs.pop_front();
        }
        self.runs.push_back((first, last, now));
        if self.runs.len() > UNCONFIRMED_RUNS_PER_PEER_MAX {
            let lo = self.runs.iter().map(|r| r.0).min().unwrap_or(first);
            let hi = self.runs.iter().map(|r| r.1).max().unwrap_or(last);
            self.runs.clear();
            self.runs.push_back((lo, hi, now));
        }
    }

    /// Whether `offset` is in a run kept as unconfirmed.
    pub(crate) fn covers(&self, offset: Offset) -> bool {
        self.runs
            .iter()
            .any(|&(first, last, _)| (first..=last).contains(&offset))
    }
}

/// Where a publish of this node's log stands on the other members (`--ack replicated`).
#[derive(Debug, Default, PartialEq, Eq)]
pub(crate) struct Replication {
    /// Applied, and held by the copies of the queues it reached there.
    pub(crate) replicated: Vec<String>,
    /// Applied, but the member's copies did not confirm it within its wait.
    pub(crate) unconfirmed: Vec<String>,
    /// Not applied yet, the member alive.
    pub(crate) pending: Vec<String>,
    /// Not applied yet, the member down: not waited for (its queues' copies take over).
    pub(crate) down: Vec<String>,
    /// Not applied yet, the member joining the cluster and holding no queue: not waited for.
    pub(crate) joining: Vec<String>,
}

impl Replication {
    /// Nothing left to wait for and nothing unconfirmed.
    pub(crate) fn done(&self) -> bool {
        self.pending.is_empty() && self.unconfirmed.is_empty()
    }
}

impl std::fmt::Display for Replication {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let parts = [
            (&self.replicated, "replicated on ", ""),
            (
                &self.unconfirmed,
                "applied on ",
                " but not confirmed by the copies of the queues it reached there",
            ),
            (&self.pending, "not applied yet on ", ""),
            (&self.down, "", " down (the copies of its queues take over)"),
            (
                &self.joining,
                "",
                " joining the cluster (it holds no queue yet; the publish is kept for it)",
            ),
        ];
        let described: Vec<String> = parts
            .iter()
            .filter(|(names, _, _)| !names.is_empty())
            .map(|(names, before, after)| format!("{before}{}{after}", names.join(", ")))
            .collect();
        f.write_str(&described.join("; "))
    }
}

impl Forwarding {
    /// Loads the publish log's position and the per-peer cursors; creates the log's metadata
    /// on first start. `peers` are the other members' names.
    pub(crate) fn open(
        store: &dyn Store,
        now_ms: u64,
        me: &str,
        peers: &[(String, String)],
        limits: &Limits,
        replicated_wait: Duration,
    ) -> Result<Self, RecoveryError> {
        let meta = store.queue_meta(PUBLISH_LOG_QUEUE)?;
        // The log's first offset is kept as its metadata's epoch (0: a log from before that,
        // which started at 1).
        let (acked, end, marks, log_start) = match meta {
            Some(m) => (m.acked, m.end, m.byte_marks, m.epoch),
            None => {
                let start = new_log_start(now_ms);
                let mut b = Batch::new();
                b.put_queue_info(PUBLISH_LOG_QUEUE, start, PUBLISH_LOG_INFO.to_vec());
                b.set_acked(PUBLISH_LOG_QUEUE, start - 1);
                store.write(&b, true)?;
                (start - 1, start - 1, Vec::new(), start)
            }
        };
        let bytes = QueueBytes::recover(acked, end, &marks, &mut |from, to| {
            stored_entry_bytes(store, PUBLISH_LOG_QUEUE, from, to)
        })
        .map_err(|error| RecoveryError::ByteCount {
            queue: PUBLISH_LOG_QUEUE,
            error,
        })?;
        let peers: Vec<Peer> = peers
            .iter()
            .filter(|(name, _)| name != me)
            .enumerate()
            .map(|(i, (name, _))| Peer {
                name: name.clone(),
                id: raft_id(name),
                generation: i as u64,
            })
            .collect();
        let sent = peers
            .iter()
            .map(|p| (p.name.clone(), start_cursor(store, &p.name, acked)))
            .collect();
        Ok(Forwarding {
            next_generation: AtomicU64::new(peers.len() as u64),
            peers: std::sync::RwLock::new(peers),
            log_start,
            log_end: AtomicU64::new(end),
            committed: watch::channel(end).0,
            sent: Mutex::new(sent),
            sent_changed: tokio::sync::Notify::new(),
            trimmed: AtomicU64::new(acked),
            bytes: Mutex::new(bytes),
            bytes_max: limits.publish_log_bytes_max,
            applied: tokio::sync::Mutex::new(HashMap::new()),
            applied_changed: tokio::sync::Notify::new(),
            session: Mutex::new(None),
            unconfirmed: Mutex::new(HashMap::new()),
            joining: Mutex::new(Default::default()),
            unconfirmed_kept: replicated_wait * UNCONFIRMED_RUNS_KEPT_WAITS,
        })
    }

    /// Adds the publish `ops` to the publish log in `batch`; returns its offset. Call under
    /// the core lock, with the batch submitted before the lock is released.
    pub(crate) fn log_publish(
        &self,
        batch: &mut Batch,
        first_id: Option<&EventId>,
        ops: &[PublishOp],
    ) -> Option<Offset> {
        let first_id = first_id?;
        if self.peers.read().expect("forward lock").is_empty() {
            return None;
        }
        // Encoded from the borrowed operations (same fields as `ForwardedPublish`): no copy
        // of the values on the publish path.
        #[derive(serde::Serialize)]
        struct Logged<'a> {
            session: u64,
            first_seq: u64,
            ops: &'a [PublishOp],
        }
        let entry = Logged {
            session: first_id.session,
            first_seq: first_id.seq,
            ops,
        };
        let body = codec::encode_body(&entry).ok()?;
        // The offset is assigned under the byte count's lock, so a trim never counts an entry
        // as applied that it has not seen assigned.
        let mut bytes = self.lock_bytes();
        let offset = self.log_end.fetch_add(1, Ordering::SeqCst) + 1;
        let interval = mark_interval_bytes(self.bytes_max);
        if let Some((at, total)) = bytes.append(offset, body.len() as u64, interval) {
            batch.put_byte_mark(PUBLISH_LOG_QUEUE, at, total);
        }
        batch.append(PUBLISH_LOG_QUEUE, offset, Entry::new(0, body));
        Some(offset)
    }

    fn lock_bytes(&self) -> std::sync::MutexGuard<'_, QueueBytes> {
        self.bytes.lock_or_stop()
    }

    /// Bytes of the log not yet applied by every peer.
    pub(crate) fn pending_bytes(&self) -> u64 {
        self.lock_bytes().pending()
    }

    /// Refuses a new publish while the log holds `publish-log-bytes-max` (so it holds at most
    /// that plus one publish). Call under the core lock, before planning the publish.
    pub(crate) fn check_room(&self) -> Result<(), WireError> {
        if self.peers.read().expect("forward lock").is_empty() {
            return Ok(());
        }
        let held = self.pending_bytes();
        if held < self.bytes_max {
            return Ok(());
        }
        let sent = self.sent.lock().expect("forward lock");
        let end = self.log_end.load(Ordering::SeqCst);
        let behind: Vec<String> = sent
            .iter()
            .filter(|(_, s)| **s < end)
            .map(|(p, s)| format!("{p} ({} publishes behind)", end - s))
            .collect();
        Err(WireError::new(
            ErrorCode::Unavailable,
            format!(
                "the publish log is full ({held} of {} bytes kept for peers that have not applied them: {}); publishes resume as they catch up",
                self.bytes_max,
                behind.join(", ")
            ),
        ))
    }

    /// How far `peer` has applied this node's publish log.
    pub(crate) fn sent(&self, peer: &str) -> Offset {
        self.sent
            .lock()
            .expect("forward lock")
            .get(peer)
            .copied()
            .unwrap_or(0)
    }

    /// The peers this node forwards to.
    pub(crate) fn peers(&self) -> Vec<Peer> {
        self.peers.read().expect("forward lock").clone()
    }

    /// Whether this node forwards to `peer`.
    pub(crate) fn forwards_to(&self, peer: &str) -> bool {
        self.peers
            .read()
            .expect("forward lock")
            .iter()
            .any(|p| p.name == peer)
    }

    /// Whether this node still forwards to `peer` in the membership of `generation` (not
    /// removed since, even if added again).
    pub(crate) fn forwards_to_generation(&self, peer: &str, generation: u64) -> bool {
        self.peers
            .read()
            .expect("forward lock")
            .iter()
            .any(|p| p.name == peer && p.generation == generation)
    }

    /// Makes `next` (name, raft id) the peers: returns those added, each with a new
    /// generation, and the names of those gone. A peer keeps its generation while it stays.
    fn replace_peers(&self, next: &[(String, NodeId)]) -> (Vec<Peer>, Vec<String>) {
        let mut peers = self.peers.write().expect("forward lock");
        let gone: Vec<String> = peers
            .iter()
            .filter(|p| !next.iter().any(|(name, id)| *name == p.name && *id == p.id))
            .map(|p| p.name.clone())
            .collect();
        peers.retain(|p| !gone.contains(&p.name));
        let mut added = Vec::new();
        for (name, id) in next {
            if !peers.iter().any(|p| p.name == *name) {
                let generation = self.next_generation.fetch_add(1, Ordering::SeqCst);
                let p = Peer {
                    name: name.clone(),
                    id: *id,
                    generation,
                };
                peers.push(p.clone());
                added.push(p);
            }
        }
        (added, gone)
    }

    /// Trims the log through `min` (what every peer has applied) in `batch`, if that is past
    /// the trim: the trim only moves forward.
    fn trim_to(&self, batch: &mut Batch, min: Offset) {
        let mut bytes = self.lock_bytes();
        if min > self.trimmed.load(Ordering::SeqCst) {
            batch.set_acked(PUBLISH_LOG_QUEUE, min);
            self.trimmed.store(min, Ordering::SeqCst);
            let all = min >= self.log_end.load(Ordering::SeqCst);
            bytes.ack(min, all);
        }
    }

    /// Every peer has applied this node's publish log up to here (what is trimmed).
    pub(crate) fn all_applied(&self) -> Offset {
        self.trimmed.load(Ordering::SeqCst)
    }

    /// Whether `peer` said, in its last answer, that it is joining the cluster and holds
    /// nothing ([`Replication::joining`]).
    fn note_joining(&self, peer: &str, joining: bool) {
        let changed = {
            let mut set = self.joining.lock_or_stop();
            if joining {
                set.insert(peer.to_string())
            } else {
                set.remove(peer)
            }
        };
        if changed {
            self.sent_changed.notify_waiters();
        }
    }

    /// `peer` applied `first..=last` without confirming that its copies hold them.
    fn note_unconfirmed(&self, peer: &str, first: Offset, last: Offset) {
        self.unconfirmed
            .lock_or_stop()
            .entry(peer.to_string())
            .or_default()
            .note(first, last, Instant::now(), self.unconfirmed_kept);
        self.sent_changed.notify_waiters();
    }

    /// Where the publish at `offset` of this node's log stands on each peer; `is_live` tells
    /// whether a member is up.
    pub(crate) fn replication_of(
        &self,
        offset: Offset,
        is_live: impl Fn(NodeId) -> bool,
    ) -> Replication {
        let unconfirmed = self.unconfirmed.lock_or_stop();
        let joining = self.joining.lock_or_stop();
        let mut r = Replication::default();
        for Peer { name, id, .. } in &self.peers() {
            let into = if self.sent(name) < offset {
                if joining.contains(name) {
                    &mut r.joining
                } else if is_live(*id) {
                    &mut r.pending
                } else {
                    &mut r.down
                }
            } else if unconfirmed.get(name).is_some_and(|u| u.covers(offset)) {
                &mut r.unconfirmed
            } else {
                &mut r.replicated
            };
            into.push(name.clone());
        }
        r
    }

    /// Publish-log entries waiting for `peer`.
    pub(crate) fn lag(&self, peer: &str) -> u64 {
        self.committed.borrow().saturating_sub(self.sent(peer))
    }
}

/// Reads the next run of publish-log entries after `from` (contiguous, in order).
fn read_run(store: &dyn Store, from: Offset, to: Offset) -> Vec<(u64, ForwardedPublish)> {
    let mut out = Vec::new();
    let mut next = from + 1;
    let _ = store.read_entries(
        PUBLISH_LOG_QUEUE,
        next,
        to,
        FORWARD_BATCH_BYTES_MAX,
        &mut |off, _, body| {
            if off != next || out.len() >= FORWARD_BATCH_ENTRIES_MAX {
                return;
            }
            match codec::decode_body::<ForwardedPublish>(body) {
                Ok(p) => {
                    out.push((off, p));
                    next = off + 1;
                }
                Err(e) => {
                    // Never skip an entry: forwarding stops here, loudly, rather than lose it.
                    tracing::error!(offset = off, error = %e, "corrupt publish-log entry");
                    next = u64::MAX;
                }
            }
        },
    );
    out
}

/// Ships this node's publish log to `peer`, in order, until the node stops.
///
/// Up to [`FORWARD_RPCS_IN_FLIGHT_MAX`](crate::control::forward::FORWARD_RPCS_IN_FLIGHT_MAX) runs of the log are in flight at once, each starting
/// where the one before it ends: the peer applies one run while the one before waits for the
/// copies of the queues it reached. A run that fails, or that the peer applied only in part,
/// sends the loop back to what the peer has confirmed, once the runs in flight have answered
/// (the peer skips what it has already applied, so nothing is applied twice). What to hand
/// and when to pause and resume is [`Sender`]'s to decide; this loop reads the log, calls the
/// peer and records its answers.
pub(crate) async fn forward_loop(shared: Weak<Shared>, cluster: Arc<Cluster>, peer: Peer) {
    let Peer {
        name: peer,
        id: peer_id,
        generation,
    } = peer;
    let mut committed = match shared.upgrade() {
        Some(s) => match &s.member.forwarding {
            Some(f) => f.committed.subscribe(),
            None => return,
        },
        None => return,
    };
    // Runs in flight, each answering with itself and the peer's answer.
    let mut in_flight: tokio::task::JoinSet<(Run, Option<PeerResponse>)> =
        tokio::task::JoinSet::new();
    let mut sender = match shared.upgrade() {
        Some(s) => Sender::new(s.member.forwarding.as_ref().map_or(0, |f| f.sent(&peer))),
        None => return,
    };
    loop {
        if let Some(pause) = sender.pause_ms() {
            tokio::time::sleep(Duration::from_millis(pause)).await;
            let Some(s) = shared.upgrade() else { return };
            sender.resume(s.member.forwarding.as_ref().map_or(0, |f| f.sent(&peer)));
        }
        if sender.may_hand() {
            let (entries, me, floor, log_start) = {
                let Some(s) = shared.upgrade() else { return };
                let Some(f) = &s.member.forwarding else {
                    return;
                };
                if !f.forwards_to_generation(&peer, generation) {
                    tracing::debug!(peer, "forwarding stopped: no longer a member");
                    return;
                }
                let end = *committed.borrow_and_update();
                let floor = f.all_applied();
                let from = sender.handed();
                let entries = if end > from {
                    let store = s.store.clone();
                    tokio::task::spawn_blocking(move || read_run(&*store, from, end + 1))
                        .await
                        .unwrap_or_default()
                } else {
                    Vec::new()
                };
                (entries, s.node_id.clone(), floor, f.log_start)
            };
            if let Some(run) = sender.hand(entries.last().map(|&(last, _)| last), floor) {
                let request = PeerRequest::Publish {
                    origin: me,
                    entries,
                    floor: run.floor,
                    follows: run.follows,
                    log_start,
                };
                let cluster = cluster.clone();
                in_flight.spawn(async move {
                    let timeout = Duration::from_millis(FORWARD_RPC_TIMEOUT_MS);
                    (run, cluster.call(peer_id, request, timeout).await.ok())
                });
                continue;
            }
        }
        // Wait for an answer, for more to ship, or (idle) for the floor to move.
        let room = sender.may_hand();
        let idle = sender.idle();
        let answered = tokio::select! {
            Some(done) = in_flight.join_next(), if !idle => done.ok(),
            changed = committed.changed(), if room => {
                if changed.is_err() {
                    return;
                }
                continue;
            }
            // The floor moves when another peer applies: look again now and then.
            _ = tokio::time::sleep(Duration::from_millis(FORWARD_FLOOR_POLL_MS)), if idle => {
                continue;
            }
        };
        let Some((run, response)) = answered else {
            sender.lost();
            continue;
        };
        let answer = {
            let s = shared.upgrade();
            let f = s.as_ref().and_then(|s| s.member.forwarding.as_ref());
            // Every answer says whether the peer is still joining (holding nothing).
            let joining = |joining| {
                if let Some(f) = f {
                    f.note_joining(&peer, joining);
                }
            };
            match response {
                Some(PeerResponse::Published { through }) => {
                    joining(false);
                    Answer::Applied { through }
                }
                Some(PeerResponse::PublishedUnconfirmed { through, reason }) => {
                    tracing::debug!(peer, reason, "forwarded publishes not confirmed on copies");
                    joining(false);
                    if let Some(f) = f
                        && through >= run.first
                        && !run.floor_only()
                    {
                        f.note_unconfirmed(&peer, run.first, through);
                    }
                    Answer::Applied { through }
                }
                Some(PeerResponse::PublishDeferred {
                    through,
                    reason,
                    joining: is_joining,
                }) => {
                    tracing::debug!(peer, reason, "forwarded publish deferred");
                    joining(is_joining);
                    Answer::Deferred { through }
                }
                _ => Answer::None,
            }
        };
        if let Some(t) = sender.answered(&run, answer) {
            let Some(s) = shared.upgrade() else { return };
            // An answer to a membership that ended is not the current member's.
            if s.member
                .forwarding
                .as_ref()
                .is_none_or(|f| !f.forwards_to_generation(&peer, generation))
            {
                return;
            }
            let before = s.member.forwarding.as_ref().map_or(0, |f| f.sent(&peer));
            record_sent(&s, &peer, t);
            if let Some(f) = &s.member.forwarding {
                metrics::counter!(m::FORWARDED, "peer" => peer.clone())
                    .increment(t.saturating_sub(before));
                metrics::gauge!(m::FORWARD_LAG, "peer" => peer.clone()).set(f.lag(&peer) as f64);
            }
        }
    }
}

/// Records that `peer` applied the log through `through` and trims what every peer has
/// applied: at once in memory (a publisher waiting for the peer is answered now), durably in
/// the next group commit, not waited for. The writer commits batches in the order they are
/// submitted, so the durable cursor only moves forward, and the forwarding goes on without a
/// sync per answer. A cursor lost in a crash is only behind: the peer skips what it applied.
fn record_sent(s: &Arc<Shared>, peer: &str, through: Offset) {
    let Some(f) = &s.member.forwarding else {
        return;
    };
    let (moved, min) = {
        let mut sent = f.sent.lock().expect("forward lock");
        // A peer removed meanwhile has no cursor any more: nothing to record.
        let Some(cur) = sent.get_mut(peer) else {
            return;
        };
        let moved = through > *cur;
        if moved {
            *cur = through;
        }
        (moved, sent.values().copied().min().unwrap_or(0))
    };
    if !moved {
        return;
    }
    let mut b = Batch::new();
    b.state_put(&sent_key(peer), through.to_be_bytes().to_vec());
    f.trim_to(&mut b, min);
    // A failed write stops the node's writer (and the node): nothing to do with the answer.
    drop(s.writer.submit(b, None));
    f.sent_changed.notify_waiters();
}

/// Makes the members other than this node the peers it forwards to, and returns the peers
/// new to it (their forwarding tasks are the caller's to start). A new peer starts at what is
/// trimmed. A peer that is no longer a member is forgotten: nothing more is kept for it, and
/// what only it had not applied is trimmed (a removed member's share of the log is released).
pub(crate) async fn set_peers(s: &Arc<Shared>, members: &Members) -> Vec<Peer> {
    let Some(f) = &s.member.forwarding else {
        return Vec::new();
    };
    let next: Vec<(String, NodeId)> = members
        .nodes
        .iter()
        .filter(|(_, n)| n.name != s.node_id)
        .map(|(id, n)| (n.name.clone(), *id))
        .collect();
    let (added, gone, min) = {
        let (added, gone) = f.replace_peers(&next);
        if added.is_empty() && gone.is_empty() {
            return Vec::new();
        }
        let mut sent = f.sent.lock().expect("forward lock");
        let trimmed = f.trimmed.load(Ordering::SeqCst);
        for name in &gone {
            sent.remove(name);
        }
        for p in &added {
            sent.insert(p.name.clone(), start_cursor(&*s.store, &p.name, trimmed));
        }
        // With no peer left, nothing is kept for anyone.
        let min = sent
            .values()
            .copied()
            .min()
            .unwrap_or_else(|| f.log_end.load(Ordering::SeqCst));
        (added, gone, min)
    };
    // Not under `sent`: `replication_of` takes `unconfirmed` before `sent`.
    f.unconfirmed
        .lock_or_stop()
        .retain(|name, _| !gone.contains(name));
    f.joining.lock_or_stop().retain(|name| !gone.contains(name));
    for name in &gone {
        tracing::info!(peer = %name, "no longer a member: publishes are not kept for it");
    }
    for p in &added {
        tracing::info!(peer = %p.name, "a new member: publishes are kept for it from here");
    }
    if !gone.is_empty() {
        let mut b = Batch::new();
        f.trim_to(&mut b, min);
        if !b.is_empty() {
            let _ = s.writer.submit(b, None).await;
        }
        f.sent_changed.notify_waiters();
    }
    added
}

/// Applies publishes forwarded by peers (held weakly: a stopping node refuses them).
pub(crate) struct PeerInbox(pub(crate) Weak<Shared>);

impl PublishSink for PeerInbox {
    fn forward_cursor(&self, peer: &str) -> Option<u64> {
        let s = self.0.upgrade()?;
        let f = s.member.forwarding.as_ref()?;
        f.forwards_to(peer).then(|| f.sent(peer))
    }

    fn regions(
        &self,
        after: Option<(String, String)>,
    ) -> std::pin::Pin<Box<dyn std::future::Future<Output = PeerResponse> + Send + '_>> {
        Box::pin(async move {
            let Some(s) = self.0.upgrade() else {
                return PeerResponse::BadRequest("node stopping".into());
            };
            if !*s.member.joined.borrow() {
                return PeerResponse::BadRequest(
                    "this node is joining the cluster itself: it has no regions to give".into(),
                );
            }
            super::join::regions_page(&s, after).await
        })
    }

    fn list_queues(
        &self,
        query: crate::admin::ListQuery,
    ) -> std::pin::Pin<Box<dyn std::future::Future<Output = PeerResponse> + Send + '_>> {
        Box::pin(async move {
            match self.0.upgrade() {
                Some(s) => PeerResponse::Queues(s.local_page(&query).await),
                None => PeerResponse::BadRequest("node stopping".into()),
            }
        })
    }

    fn apply_forwarded(
        &self,
        origin: String,
        entries: Vec<(u64, ForwardedPublish)>,
        floor: u64,
        follows: Option<u64>,
        log_start: u64,
    ) -> std::pin::Pin<Box<dyn std::future::Future<Output = PeerResponse> + Send + '_>> {
        Box::pin(async move {
            let Some(s) = self.0.upgrade() else {
                return PeerResponse::PublishDeferred {
                    through: 0,
                    reason: "node stopping".into(),
                    joining: false,
                };
            };
            let Some(f) = &s.member.forwarding else {
                return PeerResponse::PublishDeferred {
                    through: 0,
                    reason: "not clustered".into(),
                    joining: false,
                };
            };
            // A joining node applies forwarded publishes only on top of the regions it copies
            // (`join.rs`), from where that copy stands.
            // It holds no queue then (drained until it has joined), unless an operator
            // undrained it early: only then must `--ack replicated` wait for it.
            if !*s.member.joined.borrow() {
                let joining = s.member.copies.len() == 0 && s.core().holds_no_queue();
                return PeerResponse::PublishDeferred {
                    through: 0,
                    reason: "this node is joining the cluster: it has not copied the regions yet"
                        .into(),
                    joining,
                };
            }
            s.recent_forwards().origin_floor(&origin, floor);
            let deadline = tokio::time::Instant::now() + Duration::from_millis(FORWARD_GAP_WAIT_MS);
            let (mut applied, mut done) = loop {
                let mut applied = f.applied.lock().await;
                let held = match applied.get(&origin) {
                    Some(a) => *a,
                    None => read_u64(&*s.store, &applied_key(&origin)).unwrap_or(0),
                };
                let done = applied_before_run(held, log_start);
                if done > held {
                    if held > 0 {
                        tracing::warn!(
                            origin,
                            applied = held,
                            log_start,
                            "the origin's publish log starts past what was applied of it here: \
                             a new log (the origin lost its data directory); taking it from its start"
                        );
                    }
                    // Recorded at once, durably: what this node says it applied of each log
                    // (`applied_of`, for a member joining from a copy of its regions) must not
                    // fall back below the log's start at a restart.
                    let (k, v) = applied_marker(&origin, done);
                    let mut b = Batch::new();
                    b.state_put(&k, v);
                    match s.writer.submit(b, None).await {
                        Ok(Ok(())) => {
                            applied.insert(origin.clone(), done);
                        }
                        // A failed write stops the node (the writer's fail-stop).
                        Ok(Err(e)) => {
                            return PeerResponse::PublishDeferred {
                                through: held,
                                reason: e.to_string(),
                                joining: false,
                            };
                        }
                        Err(_) => {
                            return PeerResponse::PublishDeferred {
                                through: held,
                                reason: "node stopping".into(),
                                joining: false,
                            };
                        }
                    }
                }
                if run_ready(done, follows) {
                    break (applied, done);
                }
                // The run before this one has not arrived (or not been applied) yet.
                let changed = f.applied_changed.notified();
                tokio::pin!(changed);
                changed.as_mut().enable();
                drop(applied);
                if tokio::time::timeout_at(deadline, changed).await.is_err() {
                    return PeerResponse::PublishDeferred {
                        through: done,
                        reason: "the run before this one has not arrived".into(),
                        joining: false,
                    };
                }
            };
            // Every entry is submitted to the writer before the first commit is awaited: the
            // writer commits in submission order, so the run costs one group commit, not one
            // per entry. The first refusal ends the run; what was submitted before it is
            // still finished, and the answer says how far it got. (A failed write poisons the
            // writer, which then refuses every later batch: nothing past `done` commits.)
            let mut submitted = Vec::new();
            let mut refused = None;
            let skipped = entries.iter().any(|(offset, _)| *offset <= done);
            // The last offset applied or submitted: each entry must be the one right after.
            let mut before = done;
            for (offset, publish) in &entries {
                let offset = *offset;
                match entry_step(before, offset) {
                    EntryStep::Skip => continue,
                    EntryStep::Apply => before = offset,
                    EntryStep::Gap => {
                        // Never sent by a working origin (it sends from what this node
                        // confirmed): applying it would lose the entries in between.
                        metrics::counter!(m::PEER_REFUSED, "reason" => "forward_gap").increment(1);
                        tracing::warn!(
                            origin,
                            offset,
                            after = before,
                            "refused a forwarded run past a gap in its origin's publish log"
                        );
                        refused = Some(WireError::new(
                            ErrorCode::ProtocolViolation,
                            format!(
                                "entry {offset} of {origin}'s publish log does not follow {before}, \
                                 the last one applied here"
                            ),
                        ));
                        break;
                    }
                }
                let session = match s.forward_session().await {
                    Ok(id) => id,
                    Err(e) => {
                        refused = Some(e);
                        break;
                    }
                };
                let from = Origin {
                    node: &origin,
                    offset,
                    ids: EventOrigin {
                        node: origin.clone(),
                        session: publish.session,
                        first_seq: publish.first_seq,
                        offset,
                    },
                };
                match s.submit_publish(session, &publish.ops, Some(&from)).await {
                    Ok(p) => submitted.push((offset, p)),
                    Err(e) => {
                        refused = Some(e);
                        break;
                    }
                }
            }
            let mut appended = Vec::new();
            for (offset, p) in submitted {
                match s.finish_publish(p).await {
                    Ok(r) => {
                        done = offset;
                        appended.extend(r.appended);
                    }
                    Err(e) => {
                        refused = Some(e);
                        break;
                    }
                }
            }
            applied.insert(origin.clone(), done);
            drop(applied);
            f.applied_changed.notify_waiters();
            if let Some(e) = refused {
                return PeerResponse::PublishDeferred {
                    through: done,
                    reason: e.message,
                    joining: false,
                };
            }
            // The origin counts a publish as held here once this answer arrives: wait until
            // the queues it reached hold it on their copies too (`--ack replicated`). Entries
            // applied by an earlier call (a retry after a lost answer) reached queues this call
            // does not know: every shipped queue's copies must then hold what it holds now.
            if skipped {
                appended.extend(s.shipped_ends());
            }
            // Not past this node's close: the wait holds the node's shared state, which its
            // shutdown waits for.
            let mut closing = s.closing.subscribe();
            let replicated = tokio::select! {
                r = s.wait_local_replicated(&appended, s.replicated_wait) => Some(r),
                _ = closing.wait_for(|c| *c) => None,
            };
            match replicated {
                Some(true) => {}
                Some(false) => {
                    tracing::warn!(
                        origin,
                        through = done,
                        "forwarded publishes not replicated in time"
                    );
                    return PeerResponse::PublishedUnconfirmed {
                        through: done,
                        reason: format!(
                            "applied, but the copies of the queues they reached do not all hold them within {} ms",
                            s.replicated_wait.as_millis()
                        ),
                    };
                }
                None => {
                    return PeerResponse::PublishedUnconfirmed {
                        through: done,
                        reason:
                            "applied, but this node is stopping before its copies confirmed them"
                                .into(),
                    };
                }
            }
            PeerResponse::Published { through: done }
        })
    }

    fn replicate(
        &self,
        msg: crate::cluster::network::ReplicateMsg,
    ) -> std::pin::Pin<Box<dyn std::future::Future<Output = PeerResponse> + Send + '_>> {
        Box::pin(async move {
            match self.0.upgrade() {
                Some(s) => super::copies::handle(&s, msg).await,
                None => PeerResponse::Replicated(None),
            }
        })
    }
}

/// A publish that came from a peer: the origin node, the entry's offset in its publish log,
/// and the event ids the origin gave its operations.
pub(crate) struct Origin<'a> {
    pub(crate) node: &'a str,
    pub(crate) offset: Offset,
    pub(crate) ids: EventOrigin,
}

/// How far this node has applied the publish log of each of `origins` (a region copy for a
/// joining member starts there).
pub(crate) async fn applied_of(
    s: &Shared,
    origins: impl Iterator<Item = String>,
) -> std::collections::BTreeMap<String, Offset> {
    let Some(f) = &s.member.forwarding else {
        return Default::default();
    };
    let applied = f.applied.lock().await;
    origins
        .map(|o| {
            let at = match applied.get(&o) {
                Some(a) => *a,
                None => read_u64(&*s.store, &applied_key(&o)).unwrap_or(0),
            };
            (o, at)
        })
        .collect()
}

/// A joining node copied the regions holding each origin's publishes up to `applied`: records
/// that (with `done`, the batch that says the join is finished) and starts applying forwarded
/// publishes after it. Serialized with forwarded applies, which a joining node refuses until
/// then.
pub(crate) async fn joined_at(
    s: &Arc<Shared>,
    applied: &std::collections::BTreeMap<String, Offset>,
    mut done: Batch,
) -> Result<(), WireError> {
    let Some(f) = &s.member.forwarding else {
        return Err(WireError::new(ErrorCode::Internal, "not clustered"));
    };
    let mut held = f.applied.lock().await;
    for (origin, at) in applied {
        let (k, v) = applied_marker(origin, *at);
        done.state_put(&k, v);
    }
    match s.writer.submit(done, None).await {
        Ok(Ok(())) => {}
        Ok(Err(e)) => return Err(WireError::new(ErrorCode::Internal, e.to_string())),
        Err(_) => return Err(WireError::new(ErrorCode::Shutdown, "node stopping")),
    }
    for (origin, at) in applied {
        held.insert(origin.clone(), *at);
        let mut t = s.member.applied_through.lock_or_stop();
        let e = t.entry(origin.clone()).or_insert(0);
        *e = (*e).max(*at);
    }
    s.member.joined.send_replace(true);
    drop(held);
    f.applied_changed.notify_waiters();
    Ok(())
}

/// The state key and value recording that `origin`'s publish `offset` is applied.
pub(crate) fn applied_marker(origin: &str, offset: Offset) -> (String, Vec<u8>) {
    (applied_key(origin), offset.to_be_bytes().to_vec())
}

impl Forwarding {
    pub(crate) fn session_slot(&self) -> &Mutex<Option<SessionId>> {
        &self.session
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const KEPT: Duration = Duration::from_secs(30);

    fn forwarding(peers: &[&str]) -> Forwarding {
        let store = tether_storage::MemStore::new();
        let peers: Vec<(String, String)> = peers
            .iter()
            .map(|p| (p.to_string(), "127.0.0.1:1".to_string()))
            .collect();
        Forwarding::open(&store, 0, "n1", &peers, &Limits::default(), KEPT).unwrap()
    }

    fn next(names: &[&str]) -> Vec<(String, NodeId)> {
        names.iter().map(|n| (n.to_string(), raft_id(n))).collect()
    }

    /// A member removed and added again before its old forwarding task looked at the members
    /// gets a new generation: the old task sees that its membership ended and stops, instead
    /// of running beside the new one.
    #[test]
    fn a_member_added_again_is_a_new_generation_and_ends_the_old_one() {
        let f = forwarding(&["n1", "n2", "n3"]);
        let start: Vec<Peer> = f.peers();
        assert_eq!(
            start.iter().map(|p| p.name.as_str()).collect::<Vec<_>>(),
            ["n2", "n3"]
        );
        let n3 = start[1].clone();
        assert!(f.forwards_to_generation("n3", n3.generation));
        // Unchanged members: nothing added or gone, generations kept.
        assert_eq!(f.replace_peers(&next(&["n2", "n3"])), (vec![], vec![]));
        assert!(f.forwards_to_generation("n3", n3.generation));
        // n3 removed, then added again.
        let (added, gone) = f.replace_peers(&next(&["n2"]));
        assert_eq!((added, gone), (vec![], vec!["n3".to_string()]));
        assert!(!f.forwards_to("n3"));
        let (added, gone) = f.replace_peers(&next(&["n2", "n3"]));
        assert!(gone.is_empty());
        assert_eq!(added.len(), 1);
        assert_ne!(added[0].generation, n3.generation);
        assert!(f.forwards_to("n3"));
        assert!(
            !f.forwards_to_generation("n3", n3.generation),
            "the old task stops"
        );
        assert!(f.forwards_to_generation("n3", added[0].generation));
        assert!(
            f.forwards_to_generation("n2", start[0].generation),
            "n2 untouched"
        );
    }

    #[test]
    fn an_unconfirmed_run_covers_its_offsets_until_it_is_old() {
        let start = Instant::now();
        let mut runs = UnconfirmedRuns::default();
        runs.note(5, 8, start, KEPT);
        assert!(!runs.covers(4));
        assert!(runs.covers(5) && runs.covers(8));
        assert!(!runs.covers(9));
        // A later note drops the runs older than `kept`.
        runs.note(20, 20, start + KEPT, KEPT);
        assert!(!runs.covers(5));
        assert!(runs.covers(20));
    }

    #[test]
    fn too_many_unconfirmed_runs_merge_into_one_span() {
        let now = Instant::now();
        let mut runs = UnconfirmedRuns::default();
        for i in 0..=UNCONFIRMED_RUNS_PER_PEER_MAX as u64 {
            runs.note(10 * i + 1, 10 * i + 2, now, KEPT);
        }
        assert_eq!(runs.runs.len(), 1);
        // Offsets between the runs now count as unconfirmed too: more, never fewer.
        assert!(runs.covers(1) && runs.covers(5) && runs.covers(10 * 1_024 + 2));
        assert!(!runs.covers(10 * 1_024 + 3));
    }

    #[test]
    fn a_replication_status_names_each_member_once() {
        let r = Replication {
            replicated: vec!["n2".into()],
            unconfirmed: vec!["n3".into(), "n4".into()],
            pending: vec!["n5".into()],
            down: vec!["n6".into()],
            joining: vec!["n7".into()],
        };
        assert!(!r.done());
        assert_eq!(
            r.to_string(),
            "replicated on n2; applied on n3, n4 but not confirmed by the copies of the queues it reached there; not applied yet on n5; n6 down (the copies of its queues take over); n7 joining the cluster (it holds no queue yet; the publish is kept for it)"
        );
        let r = Replication {
            replicated: vec!["n2".into()],
            down: vec!["n3".into()],
            joining: vec!["n4".into()],
            ..Default::default()
        };
        assert!(r.done());
    }
}
