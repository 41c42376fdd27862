//! One task per client connection (control stream) and one per session (delivery stream).
//!
//! The connection task: the handshake and hello, the control stream's requests, liveness probes,
//! acks and pings.
//! - Before authentication a connection makes the node hold little: the hello's frame is
//!   limited to `HELLO_BYTES_MAX`, a frame header never reserves what it announces, and a
//!   durable hello is validated before anything (consensus included) is done for it.
//! - One attached session per durable id: a second connection first probes the attached one
//!   with a ping (`LIVENESS_PROBE_TIMEOUT_MS`); if it answers, the new one is refused with
//!   `duplicate-durable-id` and the first is untouched; if not, the old connection is closed as
//!   a crash and the new one resumes the queue.
//! - A client's publishes are submitted (offsets assigned) in request order as they are read,
//!   and answered in request order once committed (and copied, under `ack: replicated`), up to
//!   `PUBLISHES_IN_FLIGHT_MAX` and `PUBLISH_BYTES_IN_FLIGHT_PER_CONNECTION_MAX` at once; any
//!   other request waits for the publishes before it. Node-wide, publishes waiting for the
//!   writer hold at most `WRITER_QUEUE_BYTES_MAX` of operations and of what they add to their
//!   queues (`Shared::write_kib`, KiB permits, in `server/mod.rs`; counted once per matching
//!   queue, known once matched: taken under the core lock if free, else the publish waits for
//!   all of it and is planned again); one publish adds at most
//!   `PUBLISH_FANOUT_BYTES_MAX`. A publish taken before the connection ends still finishes
//!   (committed, counted, the clients of queues it dropped told) before the session is torn
//!   down.
//! - `close(keepalive)` is answered only once the session's acks are committed here and held by
//!   every copy of the queue: what a cleanly closed client acknowledged is never delivered to it
//!   again. A close is answered after the session has ended (delivery stopped, queue detached,
//!   the durable id free): a client holding the answer may reconnect at once or exit.
//! - A stopping node answers every client request it read before it started to stop; every one
//!   it reads after (but `close`) is answered `going-away` (`shutdown` to an older client) and
//!   not applied, so a client may send it to another node (`Node::shutdown`, `control_loop`).
//! - Client input that is wrong gets a typed error response, or an error frame and a close with
//!   the same numeric code: never a panic, never another client's data.
//!
//! The delivery task, per session:
//! - A session has at most `INFLIGHT_EVENTS_PER_SESSION_MAX` entries on the wire beyond its
//!   acked offset. A slow client is held back by that window and by QUIC flow control, never by
//!   server memory: a connection holds at most the node's send window
//!   (`connection-send-window-bytes`) of written data, one delivery frame, and what its receive
//!   window lets the client send; an idle session holds no frame buffer.
//! - Live first: a replay's frames (and a live session's backlog of `LIVE_INLINE_ENTRIES_MAX`
//!   entries or more) are read and encoded on the low-priority delivery pool
//!   (`DELIVERY_READ_THREADS` threads at nice `LOW_PRIORITY_NICE`, at most
//!   `DELIVERY_READS_IN_FLIGHT_MAX` frames at once; `low_priority.rs`), never on an async
//!   worker, so they neither queue ahead of another session's live events on the runtime nor
//!   take the CPU from them. A live session's few new entries are framed on its async worker (a
//!   read of at most `LIVE_INLINE_FRAME_BODY_BYTES_MAX`, from the memtable they were just
//!   written to). On either path the session's task awaits the synced delivered mark when a
//!   frame passes the reserved one (`core`'s delivered mark). The client library hands a
//!   frame's events over in batches of `DECODE_BATCH_EVENTS` and yields between them.
//! - A replay is paced only when its client asks (`replay-rate`, `core::pace`); live entries
//!   are never paced.

use crate::bug::LockExt;
use std::collections::VecDeque;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use bytes::{Bytes, BytesMut};
use tether_storage::{Batch, Offset, QueueId};
use tether_transport::codec::{self, CodecError, FrameReader};
use tether_transport::{PROTOCOL_VERSION, tls};
use tokio::sync::{Notify, mpsc, oneshot, watch};

use super::{SessionHandle, Shared, internal};
use crate::auth::{Access, Principal};
use crate::core::pace::ReplayPacer;
use crate::core::{ConnectError, FlagBounds, SeenVerdict, SessionId, Step};
use crate::limits::*;
use crate::metrics as m;
use crate::protocol::*;

/// Liveness probes a session may have waiting at once.
const PROBES_QUEUED_MAX: usize = 4;
/// How long the server waits for a closing client to close the connection after the final
/// answer, in milliseconds.
const CLOSE_LINGER_MS: u64 = 2_000;
/// Connect attempts after taking a dead connection's durable id over.
const TAKEOVER_ATTEMPTS_MAX: usize = 3;

pub(super) async fn accept_loop(shared: Arc<Shared>, endpoint: quinn::Endpoint) {
    // A clustered node keeps room for its peers beyond the client limit: which connections
    // are peers is only known after the handshake (ALPN), where extra clients are refused.
    let headroom = if shared.member.forwarding.is_some() {
        crate::cluster::CLUSTER_NODES_MAX
    } else {
        0
    };
    while let Some(incoming) = endpoint.accept().await {
        // An Initial from an address not yet validated gets a stateless Retry (one round
        // trip, nothing kept here); the client sends it again with the token. Accepted
        // instead, an Initial whose only frame is a CONNECTION_CLOSE (a peer or client gave
        // up a handshake whose first packet never arrived, e.g. while this node was starting)
        // becomes a connection that quinn leaves draining with no close timer: nothing can
        // close it, and it holds the endpoint, so the node's UDP port after shutdown, for the
        // whole idle timeout.
        if !incoming.remote_address_validated() {
            if let Err(e) = incoming.retry() {
                e.into_incoming().refuse();
            }
            continue;
        }
        if shared.connections.load(Ordering::Relaxed) >= shared.limits.connections_max + headroom {
            incoming.refuse();
            continue;
        }
        let shared = shared.clone();
        tokio::spawn(async move {
            shared.connections.fetch_add(1, Ordering::Relaxed);
            let _ = handle_connection(&shared, incoming).await;
            shared.connections.fetch_sub(1, Ordering::Relaxed);
        });
    }
}

/// Ends a connection with an error the client can read: an error frame, then a close code.
async fn refuse(conn: &quinn::Connection, send: &mut quinn::SendStream, err: WireError) {
    metrics::counter!(m::CLIENT_ERRORS, "code" => err.code.name()).increment(1);
    tracing::debug!(code = err.code.name(), message = %err.message, "closing client connection");
    let _ = codec::write_frame(send, &ServerMsg::Error(err.clone())).await;
    let _ = send.finish();
    // Give the frame a moment to leave before the close discards stream data.
    let _ = tokio::time::timeout(Duration::from_millis(200), send.stopped()).await;
    conn.close(err.code.varint(), err.message.as_bytes());
}

/// Longest error message sent back to a client, in bytes. Decode errors can quote the
/// client's own bytes; they are cut and made printable so an error never echoes a payload.
pub const ERROR_MESSAGE_BYTES_MAX: usize = 256;

fn printable_message(text: &str) -> String {
    let mut out = String::new();
    for c in text.chars() {
        let c = if c.is_control() || c == char::REPLACEMENT_CHARACTER {
            '?'
        } else {
            c
        };
        if out.len() + c.len_utf8() > ERROR_MESSAGE_BYTES_MAX - 3 {
            out.push_str("...");
            break;
        }
        out.push(c);
    }
    out
}

fn codec_error(e: &CodecError) -> WireError {
    WireError::new(e.code(), printable_message(&e.to_string()))
}

/// A node-to-node connection: served by the metadata group if this node is clustered and
/// the peer's certificate, from the cluster CA, names a member; closed with an error otherwise.
fn serve_peer(shared: &Arc<Shared>, conn: quinn::Connection) -> Result<(), ()> {
    let Some(cluster) = shared.member.cluster.get() else {
        conn.close(
            ErrorCode::Forbidden.varint(),
            b"this node is not part of a cluster",
        );
        return Err(());
    };
    // A peer is the member its certificate names, never just any holder of a certificate
    // from the cluster CA (client certificates may come from it too).
    let member = tls::peer_node_name(&conn, &shared.member.cluster_ca)
        .map_err(|e| (e.label(), e.to_string()))
        .and_then(|name| {
            cluster.members().id_of(&name).ok_or_else(|| {
                (
                    "not_a_member",
                    format!("node {name:?} is not a member of this cluster"),
                )
            })
        });
    let (reason, message) = match member {
        Ok(id) => {
            let inbox: Arc<dyn crate::cluster::network::PublishSink> =
                Arc::new(super::forward::PeerInbox(Arc::downgrade(shared)));
            cluster.serve(conn, Some(inbox), id);
            return Ok(());
        }
        Err(refused) => refused,
    };
    metrics::counter!(m::PEER_REFUSED, "reason" => reason).increment(1);
    tracing::warn!(remote = %conn.remote_address(), %message, "peer connection refused");
    conn.close(
        ErrorCode::Unauthenticated.varint(),
        printable_message(&message).as_bytes(),
    );
    Err(())
}

async fn handle_connection(shared: &Arc<Shared>, incoming: quinn::Incoming) -> Result<(), ()> {
    let deadline = Duration::from_millis(shared.limits.handshake_timeout_ms);
    let conn = accept(incoming, deadline).await.ok_or(())?;
    if tls::negotiated_alpn(&conn)
        .as_deref()
        .and_then(tether_transport::peer_protocol_version)
        .is_some()
    {
        return serve_peer(shared, conn);
    }
    // This connection is counted: more than the limit means it is one too many.
    if shared.connections.load(Ordering::Relaxed) > shared.limits.connections_max {
        conn.close(
            ErrorCode::LimitExceeded.varint(),
            b"too many connections to this node",
        );
        return Err(());
    }
    let (mut send, mut reader, hello) = read_hello(&conn, deadline).await.ok_or(())?;
    let admitted = match admit(shared, &conn, hello) {
        Ok(a) => a,
        Err(e) => {
            refuse(&conn, &mut send, e).await;
            return Err(());
        }
    };
    let attached = match attach(shared, &conn, &mut send, &admitted).await {
        Ok(a) => a,
        Err(NoSession::Redirected) => return Err(()),
        Err(NoSession::Refused(e)) => {
            refuse(&conn, &mut send, e).await;
            return Err(());
        }
    };
    let session = attached.connected.session;
    let (wake, probes, finished) = register_session(shared, &conn, session, &admitted);
    let ended = serve_session(
        shared,
        &conn,
        (&mut send, &mut reader),
        &admitted,
        &attached,
        (wake, probes),
    )
    .await;
    end_session(shared, session, admitted.durable.as_ref(), ended.keepalive).await;
    let _ = finished.send(true);
    if let Some(answer) = ended.close_answer
        && codec::write_frame(&mut send, &answer).await.is_ok()
    {
        let _ = send.finish();
        // The client closes the connection once it has read the answer; closing first could
        // discard the answer in flight.
        let _ = tokio::time::timeout(Duration::from_millis(CLOSE_LINGER_MS), conn.closed()).await;
    }
    Ok(())
}

/// The QUIC handshake of an incoming connection, within `deadline`. A client or member that
/// offers no protocol version this node speaks is counted and logged.
async fn accept(incoming: quinn::Incoming, deadline: Duration) -> Option<quinn::Connection> {
    let remote = incoming.remote_address();
    match tokio::time::timeout(deadline, incoming).await {
        Ok(Ok(c)) => Some(c),
        Ok(Err(e)) if tls::no_common_protocol(&e) => {
            // A client or a member of another build, too old or too new for this one.
            metrics::counter!(m::PROTOCOL_VERSION_REFUSED).increment(1);
            tracing::warn!(
                %remote,
                "connection refused: it offers no protocol version this node speaks (clients \
                 {}, members {})",
                String::from_utf8_lossy(tether_transport::ALPN),
                tether_transport::peer_alpns(
                    tether_transport::PEER_PROTOCOL_VERSION_OLDEST
                        ..=tether_transport::PEER_PROTOCOL_VERSION
                )
                .iter()
                .map(|a| String::from_utf8_lossy(a).into_owned())
                .collect::<Vec<_>>()
                .join(", ")
            );
            None
        }
        _ => None,
    }
}

/// The client's control stream and its first frame, within `deadline`; a client that sends
/// none in time, or a frame that does not decode, is refused.
async fn read_hello(
    conn: &quinn::Connection,
    deadline: Duration,
) -> Option<(quinn::SendStream, FrameReader, ClientMsg)> {
    let (mut send, recv) = match tokio::time::timeout(deadline, conn.accept_bi()).await {
        Ok(Ok(s)) => s,
        Ok(Err(_)) => return None,
        Err(_) => {
            conn.close(
                ErrorCode::HandshakeTimeout.varint(),
                b"no control stream opened in time",
            );
            return None;
        }
    };
    // The hello is read before authentication: a small limit (nothing else is decoded).
    let mut reader = FrameReader::with_max(recv, HELLO_BYTES_MAX);
    let hello = match tokio::time::timeout(deadline, reader.next::<ClientMsg>()).await {
        Err(_) => {
            let e = WireError::new(ErrorCode::HandshakeTimeout, "no hello received in time");
            refuse(conn, &mut send, e).await;
            return None;
        }
        Ok(Err(e)) => {
            refuse(conn, &mut send, codec_error(&e)).await;
            return None;
        }
        Ok(Ok(None)) => return None,
        Ok(Ok(Some(m))) => m,
    };
    reader.set_max(codec::FRAME_BYTES_MAX);
    Some((send, reader, hello))
}

/// A hello this node accepts to serve: who sent it and what it asks for.
struct Admitted {
    durable: Option<DurableHello>,
    /// None on an open node (no `[auth]`).
    principal: Option<Principal>,
    /// The token the connection authenticated with (its digest) and its principal: a
    /// reloaded `[auth]` table without it closes the connection.
    token_held: Option<(crate::auth::TokenDigest, String)>,
    /// The client understands `going-away` (else it is told `shutdown`).
    going_away: bool,
}

/// Checks a client's first frame before anything is done for it (consensus included): a
/// hello, while the node is not stopping, of this protocol version, from a client (not a
/// cluster node's certificate) that authenticates, with a valid durable part.
fn admit(
    shared: &Shared,
    conn: &quinn::Connection,
    hello: ClientMsg,
) -> Result<Admitted, WireError> {
    let ClientMsg::Hello {
        version,
        durable,
        token,
        going_away,
        ..
    } = hello
    else {
        return Err(WireError::new(
            ErrorCode::ProtocolViolation,
            "the first frame must be a hello",
        ));
    };
    if *shared.draining.borrow() {
        // Stopping: the client tries its next server.
        return Err(WireError::new(ErrorCode::Shutdown, "the node is stopping"));
    }
    if !*shared.member.joined.borrow() {
        return Err(WireError::new(
            ErrorCode::Unavailable,
            "this node is joining the cluster: it serves clients once it holds the regions' values; try another member",
        ));
    }
    if version != PROTOCOL_VERSION {
        let msg = format!(
            "unsupported protocol version {version}; this server speaks {PROTOCOL_VERSION}"
        );
        return Err(WireError::new(ErrorCode::UnsupportedVersion, msg));
    }
    // A cluster node's certificate identifies a peer, never a client (whatever its CN says).
    if !tls::connection_node_names(conn).is_empty() {
        metrics::counter!(m::PEER_REFUSED, "reason" => "node_cert_as_client").increment(1);
        return Err(WireError::new(
            ErrorCode::Unauthenticated,
            "a cluster node's certificate cannot authenticate a client",
        ));
    }
    // Every connection authenticates anew: the latest credentials are the ones that count.
    let principal = match shared.authorizer() {
        None => None,
        Some(a) => Some(a.authenticate(token.as_deref(), tls::peer_common_name(conn).as_deref())?),
    };
    // Kept with the session so that a reloaded `[auth]` table without it closes the connection.
    let token_held = match (&principal, token.as_deref()) {
        (Some(p), Some(t)) => Some((crate::auth::token_digest(t), p.name.clone())),
        _ => None,
    };
    // Checked before anything is done for the hello: a bad one never reaches consensus.
    if let Some(d) = durable.as_ref() {
        crate::core::validate_durable_hello(d)?;
    }
    Ok(Admitted {
        durable,
        principal,
        token_held,
        going_away,
    })
}

/// Why an admitted hello got no session.
enum NoSession {
    /// Sent to the queue's primary (the redirect is written and the connection closed).
    Redirected,
    Refused(WireError),
}

/// A session attached to its queue.
struct Attached {
    connected: crate::core::Connected,
    /// The queue's placement, on a clustered node.
    placed: Option<crate::cluster::meta::Placement>,
    /// The client's newest seen entry did not match the queue (see [`check_client_seen`]).
    diverged: bool,
}

/// Places a durable queue (on a clustered node: here, or the client is redirected to its
/// primary), attaches the session, checks what the client says it saw, and caps the queue's
/// delivery at what its copies hold before the welcome.
async fn attach(
    shared: &Arc<Shared>,
    conn: &quinn::Connection,
    send: &mut quinn::SendStream,
    admitted: &Admitted,
) -> Result<Attached, NoSession> {
    let durable = admitted.durable.as_ref();
    let owner = admitted.principal.as_ref().map(|p| p.name.as_str());
    let mut placed = None;
    // Counted from placing to attaching: a refused hello releases a placement nobody uses.
    let mut placing = None;
    if let (Some(d), Some(cluster)) = (durable, shared.member.cluster.get()) {
        placing = Some(shared.member.placing.enter(&d.id));
        match super::placement::place_durable(shared, cluster, d, owner).await {
            Ok(super::placement::Placed::Here(p)) => placed = Some(p),
            Ok(super::placement::Placed::Elsewhere {
                node_id,
                addr,
                epoch,
            }) => {
                let redirect = ServerMsg::Redirect {
                    node_id,
                    addr,
                    epoch,
                };
                let _ = codec::write_frame(send, &redirect).await;
                let _ = send.finish();
                // The client closes once it has read the redirect; do not wait forever.
                let _ = tokio::time::timeout(Duration::from_millis(200), send.stopped()).await;
                conn.close(ErrorCode::Ok.varint(), b"redirected");
                return Err(NoSession::Redirected);
            }
            Err(e) => return Err(NoSession::Refused(e)),
        }
    }
    let connected = match connect(shared, durable, owner, placed.as_ref()).await {
        Ok(c) => c,
        Err(e) => {
            if let (Some(guard), Some(_)) = (&placing, &placed) {
                super::placement::release_unused(shared, guard);
            }
            return Err(NoSession::Refused(e));
        }
    };
    drop(placing);
    let session = connected.session;
    let diverged = match durable.and_then(|d| d.seen.as_ref().map(|s| (d, s))) {
        Some((d, seen)) if connected.status == QueueStatus::Resumed => {
            match check_client_seen(shared, session, &d.id, seen).await {
                Ok(diverged) => diverged,
                Err(e) => {
                    // The session exists: end it as any other (the queue stays, away).
                    shared
                        .apply(|core| {
                            let d = core.disconnect(shared.clock.now_ms(), session, true);
                            Ok(((), d.batch))
                        })
                        .await
                        .ok();
                    return Err(NoSession::Refused(e));
                }
            }
        }
        _ => false,
    };
    if let (Some(p), Some(d)) = (&placed, durable) {
        // Before the welcome: a queue with copies must not deliver what they may lack.
        super::failover::ensure_shipping(shared, &d.id, p);
    }
    Ok(Attached {
        connected,
        placed,
        diverged,
    })
}

/// Makes `session` known to the node (its wake-up, liveness probes, connection and token).
/// Returns its wake-up, its probe receiver and the sender that tells it has finished.
fn register_session(
    shared: &Shared,
    conn: &quinn::Connection,
    session: SessionId,
    admitted: &Admitted,
) -> (
    Arc<Notify>,
    mpsc::Receiver<oneshot::Sender<()>>,
    watch::Sender<bool>,
) {
    let (probe_tx, probe_rx) = mpsc::channel(PROBES_QUEUED_MAX);
    let (finished_tx, finished_rx) = watch::channel(false);
    let wake = Arc::new(Notify::new());
    shared.sessions.lock_or_stop().insert(
        session,
        SessionHandle {
            wake: wake.clone(),
            probe: probe_tx,
            conn: Some(conn.clone()),
            finished: finished_rx,
            token: admitted.token_held.clone(),
        },
    );
    // A reload that ran between the authentication and the line above did not see this
    // session: check the token against the table in force now.
    if let (Some((digest, name)), Some(a)) = (&admitted.token_held, shared.authorizer())
        && a.token_principal(digest) != Some(name.as_str())
    {
        conn.close(ErrorCode::Unauthenticated.varint(), b"token withdrawn");
    }
    (wake, probe_rx, finished_tx)
}

/// Welcomes the client, then runs its delivery task beside the control loop until the
/// session ends.
async fn serve_session(
    shared: &Arc<Shared>,
    conn: &quinn::Connection,
    (send, reader): (&mut quinn::SendStream, &mut FrameReader),
    admitted: &Admitted,
    attached: &Attached,
    (wake, probes): (Arc<Notify>, mpsc::Receiver<oneshot::Sender<()>>),
) -> Ended {
    let connected = &attached.connected;
    let session = connected.session;
    let queue_servers = match (&attached.placed, shared.member.cluster.get()) {
        (Some(p), Some(cluster)) => queue_servers(cluster, p),
        _ => Vec::new(),
    };
    match &admitted.durable {
        Some(d) => tracing::info!(
            durable_id = %d.id,
            session,
            queue = ?connected.status,
            pending = connected.pending,
            remote = %conn.remote_address(),
            "durable client connected"
        ),
        None => tracing::debug!(session, remote = %conn.remote_address(), "client connected"),
    }
    let welcome = ServerMsg::Welcome {
        node_id: shared.node_id.clone(),
        session,
        queue: connected.status,
        pending: connected.pending,
        queue_servers,
        diverged: attached.diverged,
    };
    if codec::write_frame(send, &welcome).await.is_err() {
        return Ended::LOST;
    }
    let Ok(delivery) = conn.open_uni().await else {
        return Ended::LOST;
    };
    let delivery_task = tokio::spawn(deliver(shared.clone(), session, delivery, wake));
    let caller = Caller {
        principal: admitted.principal.as_ref(),
        knows_going_away: admitted.going_away,
    };
    let ended = control_loop(shared, conn, session, caller, reader, send, probes).await;
    delivery_task.abort();
    let _ = delivery_task.await;
    ended
}

/// Tears a session down once its delivery task has stopped (so no more delivered-mark writes
/// for its queue): detaches it (its durable queue kept or dropped) and forgets it.
async fn end_session(
    shared: &Arc<Shared>,
    session: SessionId,
    durable: Option<&DurableHello>,
    keepalive: bool,
) {
    let dropped = shared
        .apply(|core| {
            let d = core.disconnect(shared.clock.now_ms(), session, keepalive);
            Ok((d.queue_dropped, d.batch))
        })
        .await
        .unwrap_or(false);
    match durable {
        Some(d) if dropped => {
            tracing::info!(durable_id = %d.id, session, "durable client left; its queue is dropped");
            super::placement::forget(shared, &d.id, super::placement::Ended::Released);
        }
        Some(d) => tracing::info!(
            durable_id = %d.id,
            session,
            timeout_secs = d.timeout_secs,
            "durable client away; its queue is kept"
        ),
        None => tracing::debug!(session, "client disconnected"),
    }
    shared.sessions.lock_or_stop().remove(&session);
}

/// The nodes holding a placed queue, primary first, for the welcome (the client fails over to
/// the copies when it loses the primary).
fn queue_servers(
    cluster: &crate::cluster::Cluster,
    p: &crate::cluster::meta::Placement,
) -> Vec<QueueServer> {
    let members = cluster.members();
    std::iter::once(p.primary)
        .chain(p.secondaries.iter().copied())
        .filter_map(|n| members.nodes.get(&n).map(|m| (n, m)))
        .map(|(n, m)| QueueServer {
            node_id: m.name.clone(),
            addr: m.addr.clone(),
            primary: n == p.primary,
        })
        .collect()
}

/// Attaches a session, taking over a durable id whose old connection no longer answers.
/// Issue 22, point 9 (defence in depth): checks the newest entry the client of a resumed queue
/// says it saw against the queue, reading the entry stored at its offset for its event id, and
/// raises the session's `possible_duplicate` bound to cover it (every entry, if the queue
/// diverged). Returns whether it diverged. Both outcomes other than "consistent" are counted
/// and logged: they mean this node lost entries or a delivered mark.
async fn check_client_seen(
    shared: &Arc<Shared>,
    session: SessionId,
    durable_id: &str,
    seen: &SeenEntry,
) -> Result<bool, WireError> {
    let Some((queue, acked, visible_end)) = shared.core().resumed_queue(session) else {
        return Ok(false);
    };
    let same_event = match &seen.event_id {
        Some(id) if seen.offset > acked && seen.offset <= visible_end => {
            let store = shared.store.clone();
            let offset = seen.offset;
            let body = tokio::task::spawn_blocking(move || {
                let mut body = None;
                store
                    .read_entries(queue, offset, offset, usize::MAX, &mut |_, _, b| {
                        body = Some(b.to_vec())
                    })
                    .map(|_| body)
            })
            .await
            .map_err(|_| internal("reading a queue entry failed"))?
            .map_err(|e| internal(format!("reading a queue entry failed: {e}")))?;
            body.and_then(|b| codec::decode_body::<EventRecord>(&b).ok())
                .map(|r| &r.id == id)
        }
        _ => None,
    };
    let verdict = shared
        .apply(|core| {
            Ok(match core.client_seen(session, seen.offset, same_event) {
                Some((v, b)) => (Some(v), b.unwrap_or_default()),
                None => (None, Batch::new()),
            })
        })
        .await?;
    match verdict {
        Some(SeenVerdict::FlagsRaised) => {
            super::admin::NodeStats::add(&shared.stats.seen_flags_raised, 1);
            metrics::counter!(m::CLIENT_SEEN_FLAGS_RAISED).increment(1);
            tracing::warn!(
                durable_id,
                session,
                seen = seen.offset,
                "the client saw entries this queue did not mark delivered: flagged now"
            );
            Ok(false)
        }
        Some(SeenVerdict::Diverged) => {
            super::admin::NodeStats::add(&shared.stats.seen_diverged, 1);
            metrics::counter!(m::CLIENT_SEEN_DIVERGED).increment(1);
            tracing::error!(
                durable_id,
                session,
                seen = seen.offset,
                seen_event = ?seen.event_id,
                queue_end = visible_end,
                "the client saw entries this queue does not hold: every entry is flagged \
                 possible_duplicate and the client is told its offsets no longer match"
            );
            Ok(true)
        }
        Some(SeenVerdict::Consistent) | None => Ok(false),
    }
}

async fn connect(
    shared: &Arc<Shared>,
    durable: Option<&DurableHello>,
    principal: Option<&str>,
    placed: Option<&crate::cluster::meta::Placement>,
) -> Result<crate::core::Connected, WireError> {
    for _ in 0..TAKEOVER_ATTEMPTS_MAX {
        let attempt = {
            let mut core = shared.core();
            // A queue of the id ended here and its placement is being removed: a new queue
            // would lose that placement when the removal commits (`placement::forget`).
            if let (Some(d), Some(_)) = (durable, placed)
                && core.durable_queue(&d.id).is_none()
                && shared.member.releasing.contains(&d.id)
            {
                return Err(WireError::new(
                    ErrorCode::Unavailable,
                    "this durable id's queue just ended here and its placement is being \
                     removed; retry",
                ));
            }
            match core.connect_as(durable, principal) {
                Ok(mut c) => {
                    let mut batch = std::mem::take(&mut c.batch);
                    // A new queue placed by the cluster appends under its placement's epoch
                    // (its delivery cap is set by `ensure_shipping` before the welcome).
                    if let Some(p) = placed.filter(|_| c.status != QueueStatus::Resumed) {
                        let qid = core.session(c.session).map_or(0, |s| s.queue);
                        batch.extend(core.set_queue_epoch(qid, p.epoch));
                    }
                    Ok((c, shared.writer.submit(batch, None)))
                }
                Err(e) => Err(e),
            }
        };
        match attempt {
            Ok((c, rx)) => {
                super::wait_commit(rx).await?;
                return Ok(c);
            }
            Err(ConnectError::Invalid(e)) => return Err(e),
            Err(ConnectError::Attached(holder)) => {
                let id = durable.map(|d| d.id.as_str()).unwrap_or_default();
                if probe(shared, holder).await {
                    return Err(WireError::new(
                        ErrorCode::DuplicateDurableId,
                        format!("durable id {id:?} is already connected to this server"),
                    ));
                }
                tracing::info!(
                    durable_id = id,
                    "old connection did not answer a liveness probe; taking over"
                );
                let handle = {
                    let sessions = shared.sessions.lock_or_stop();
                    sessions
                        .get(&holder)
                        .map(|h| (h.conn.clone(), h.finished.clone()))
                };
                if let Some((conn, mut finished)) = handle {
                    if let Some(c) = conn {
                        c.close(
                            ErrorCode::Crashed.varint(),
                            b"superseded by a new connection",
                        );
                    }
                    let _ = tokio::time::timeout(Duration::from_secs(5), finished.wait_for(|d| *d))
                        .await;
                }
            }
        }
    }
    Err(WireError::new(
        ErrorCode::DuplicateDurableId,
        "durable id is busy; try again",
    ))
}

/// Whether the session answers a ping within the probe deadline.
async fn probe(shared: &Arc<Shared>, session: SessionId) -> bool {
    let tx = {
        let sessions = shared.sessions.lock_or_stop();
        match sessions.get(&session) {
            Some(h) => h.probe.clone(),
            None => return false,
        }
    };
    let (answer_tx, answer_rx) = oneshot::channel();
    match tx.try_send(answer_tx) {
        Ok(()) => {}
        // Probes pile up only while the session is busy answering: count it as alive.
        Err(mpsc::error::TrySendError::Full(_)) => return true,
        // Its control stream has ended: the session is being torn down.
        Err(mpsc::error::TrySendError::Closed(_)) => return false,
    }
    matches!(
        tokio::time::timeout(Duration::from_millis(LIVENESS_PROBE_TIMEOUT_MS), answer_rx).await,
        Ok(Ok(()))
    )
}

/// How a session's control stream ended.
struct Ended {
    /// Whether the queue is kept.
    keepalive: bool,
    /// The answer to the client's close request, written only once the session has ended
    /// (queue detached, delivery stopped, the durable id free): a client that has its answer
    /// may reconnect at once, or exit without waiting for the connection to drain.
    close_answer: Option<ServerMsg>,
}

impl Ended {
    /// The stream ended or broke without a close request (a crash, a lost network, a
    /// protocol violation): the queue is kept.
    const LOST: Ended = Ended {
        keepalive: true,
        close_answer: None,
    };
}

/// Who a session serves, as its hello and authentication said.
struct Caller<'a> {
    /// The authenticated principal (None on an open node).
    principal: Option<&'a Principal>,
    /// The client understands `going-away` (its hello said so).
    knows_going_away: bool,
}

/// Reads the control stream until the session ends.
async fn control_loop(
    shared: &Arc<Shared>,
    conn: &quinn::Connection,
    session: SessionId,
    caller: Caller<'_>,
    reader: &mut FrameReader,
    send: &mut quinn::SendStream,
    mut probes: mpsc::Receiver<oneshot::Sender<()>>,
) -> Ended {
    let Caller {
        principal,
        knows_going_away,
    } = caller;
    let mut next_nonce: u64 = 1;
    let mut waiting: Vec<(u64, oneshot::Sender<()>)> = Vec::new();
    let mut publishing =
        Answering::new(&shared.publish_bytes_in_flight, &shared.requests_unanswered);
    let draining = shared.draining.subscribe();
    let (stop_tx, stop) = watch::channel(false);
    let ended = 'session: loop {
        let msg = tokio::select! {
            answer = publishing.first_answer() => {
                if codec::write_frame(send, &answer).await.is_err() {
                    break 'session Ended::LOST;
                }
                continue;
            }
            m = reader.next::<ClientMsg>(), if publishing.has_room() => m,
            Some(answer) = probes.recv() => {
                let nonce = next_nonce;
                next_nonce += 1;
                waiting.push((nonce, answer));
                if codec::write_frame(send, &ServerMsg::Ping { nonce }).await.is_err() {
                    break 'session Ended::LOST;
                }
                continue;
            }
        };
        let msg = match msg {
            Ok(Some(m)) => m,
            // The stream ended or the connection dropped without a close request: a crash or
            // a lost network, which keeps the queue.
            Ok(None) => break 'session Ended::LOST,
            Err(CodecError::Stream(_)) => break 'session Ended::LOST,
            Err(e) => {
                refuse_after(conn, send, &mut publishing, codec_error(&e)).await;
                break 'session Ended::LOST;
            }
        };
        match msg {
            ClientMsg::Hello { .. } => {
                let twice = WireError::new(ErrorCode::ProtocolViolation, "hello sent twice");
                refuse_after(conn, send, &mut publishing, twice).await;
                break 'session Ended::LOST;
            }
            ClientMsg::Pong { nonce } => {
                if let Some(i) = waiting.iter().position(|(n, _)| *n == nonce) {
                    let (_, answer) = waiting.swap_remove(i);
                    let _ = answer.send(());
                }
            }
            ClientMsg::Ack { offset } => {
                let result = {
                    let mut core = shared.core();
                    let queue = core
                        .session(session)
                        .and_then(|s| core.queue(s.queue))
                        .map(|q| (q.id, q.acked));
                    core.ack(session, offset).map(|b| (b, queue))
                };
                match result {
                    Ok((Some(batch), Some((qid, before)))) => {
                        metrics::counter!(m::EVENTS_ACKED).increment(offset.saturating_sub(before));
                        super::admin::NodeStats::add(
                            &shared.stats.acked,
                            offset.saturating_sub(before),
                        );
                        // Acks need no fsync of their own: a lost ack only means a redelivery
                        // flagged possible_duplicate.
                        // The in-flight window may have been what held delivery back.
                        shared.wake(session);
                        let stored = shared.clone();
                        let on_commit = move || {
                            // Only now may the copies hear of it (shipping reads acked_stored).
                            stored.core().ack_stored(qid, offset);
                            stored.space.notify_waiters();
                        };
                        drop(shared.writer.submit(batch, Some(Box::new(on_commit))));
                    }
                    Ok(_) => {}
                    Err(e) => {
                        refuse_after(conn, send, &mut publishing, e).await;
                        break 'session Ended::LOST;
                    }
                }
            }
            ClientMsg::Request { id, ref body }
                if *draining.borrow() && !matches!(body, RequestBody::Close { .. }) =>
            {
                // Stopping: not applied, and said so, after the answers of the publishes before.
                let answer = ServerMsg::Response {
                    id,
                    result: Err(going_away(knows_going_away)),
                };
                if !answer_all(send, &mut publishing).await
                    || codec::write_frame(send, &answer).await.is_err()
                {
                    break 'session Ended::LOST;
                }
            }
            ClientMsg::Request {
                id,
                body: RequestBody::Publish { ops, ack },
            } => {
                let _unanswered = Unanswered::count(&shared.requests_unanswered);
                // Submitted (offsets assigned, in request order) before the next frame is
                // read; its commit and copies are awaited while later requests come in.
                let submitted = match authorize_publish(shared, principal, &ops) {
                    Ok(()) => shared.submit_publish(session, &ops, None).await,
                    Err(e) => Err(e),
                };
                let stop = stop.clone();
                let bytes = super::publish_ops_bytes(&ops);
                publishing.push(
                    bytes,
                    match submitted {
                        Ok(p) => Box::pin(async move {
                            ServerMsg::Response {
                                id,
                                result: published(shared, p, ack, stop).await,
                            }
                        }),
                        Err(e) => Box::pin(std::future::ready(ServerMsg::Response {
                            id,
                            result: Err(e),
                        })),
                    },
                );
            }
            ClientMsg::Request { id, body } => {
                let _unanswered = Unanswered::count(&shared.requests_unanswered);
                // Every other request sees the publishes before it committed, and is answered
                // after them.
                if !answer_all(send, &mut publishing).await {
                    break 'session Ended::LOST;
                }
                let close = match &body {
                    RequestBody::Close { keepalive } => Some(*keepalive),
                    _ => None,
                };
                let result = match authorize(shared, principal, &body) {
                    // A registration may write parts of its image ahead of its answer.
                    Ok(()) if matches!(body, RequestBody::RegisterInterest { .. }) => {
                        match super::image::register(shared, session, id, body, send).await {
                            Some(result) => result,
                            None => break 'session Ended::LOST,
                        }
                    }
                    Ok(()) => request(shared, session, body).await,
                    Err(e) => Err(e),
                };
                let answer = ServerMsg::Response { id, result };
                if let Some(keepalive) = close {
                    // Answered once the session has ended (see `Ended::close_answer`).
                    break 'session Ended {
                        keepalive,
                        close_answer: Some(answer),
                    };
                }
                if codec::write_frame(send, &answer).await.is_err() {
                    break 'session Ended::LOST;
                }
            }
        }
    };
    // Publishes taken before the end still finish (committed, counted, the clients of queues
    // they dropped told), without waiting for copies: there is nobody left to answer.
    let _ = stop_tx.send(true);
    while !publishing.is_empty() {
        publishing.first_answer().await;
    }
    ended
}

/// An answer to come: a submitted publish awaiting its commit (and, with `ack: replicated`,
/// its copies).
type Answer<'a> = Pin<Box<dyn Future<Output = ServerMsg> + Send + 'a>>;

/// Answers of a session's publishes, submitted in request order and written in request
/// order, with the bytes of their operations: at most [`PUBLISHES_IN_FLIGHT_MAX`] publishes
/// and [`PUBLISH_BYTES_IN_FLIGHT_PER_CONNECTION_MAX`] bytes (plus the last one read) are in
/// flight. The bytes are also counted node-wide (`Shared::publish_bytes_in_flight`) until
/// answered or dropped.
struct Answering<'a> {
    queue: VecDeque<(usize, Answer<'a>)>,
    bytes: usize,
    node_bytes: &'a AtomicU64,
    /// The node's count of requests not answered (`Shared::requests_unanswered`).
    node_requests: &'a AtomicUsize,
}

impl<'a> Answering<'a> {
    fn new(node_bytes: &'a AtomicU64, node_requests: &'a AtomicUsize) -> Self {
        Answering {
            queue: VecDeque::new(),
            bytes: 0,
            node_bytes,
            node_requests,
        }
    }

    fn push(&mut self, bytes: usize, answer: Answer<'a>) {
        self.bytes += bytes;
        self.node_bytes.fetch_add(bytes as u64, Ordering::Relaxed);
        self.node_requests.fetch_add(1, Ordering::Relaxed);
        self.queue.push_back((bytes, answer));
    }

    fn is_empty(&self) -> bool {
        self.queue.is_empty()
    }

    /// Whether another frame may be read: a publish it carries fits the budgets.
    fn has_room(&self) -> bool {
        self.queue.len() < PUBLISHES_IN_FLIGHT_MAX
            && self.bytes < PUBLISH_BYTES_IN_FLIGHT_PER_CONNECTION_MAX
    }

    /// The answer of the oldest publish in flight, once it is ready (never, with none in
    /// flight). Cancel-safe: a publish not finished stays first.
    async fn first_answer(&mut self) -> ServerMsg {
        match self.queue.front_mut() {
            Some((_, first)) => {
                let answer = first.await;
                if let Some((bytes, _)) = self.queue.pop_front() {
                    self.bytes -= bytes;
                    self.node_bytes.fetch_sub(bytes as u64, Ordering::Relaxed);
                    self.node_requests.fetch_sub(1, Ordering::Relaxed);
                }
                answer
            }
            None => std::future::pending().await,
        }
    }
}

impl Drop for Answering<'_> {
    fn drop(&mut self) {
        self.node_bytes
            .fetch_sub(self.bytes as u64, Ordering::Relaxed);
        self.node_requests
            .fetch_sub(self.queue.len(), Ordering::Relaxed);
    }
}

/// One request read and not answered yet, counted in `Shared::requests_unanswered` while
/// this lives.
struct Unanswered<'a>(&'a AtomicUsize);

impl<'a> Unanswered<'a> {
    fn count(node_requests: &'a AtomicUsize) -> Self {
        node_requests.fetch_add(1, Ordering::Relaxed);
        Unanswered(node_requests)
    }
}

impl Drop for Unanswered<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

/// The answer to a request read while the node stops: not applied; send it to another node.
/// `going-away` to a client that understands it (its hello says so), else `shutdown`.
fn going_away(knows_going_away: bool) -> WireError {
    let code = if knows_going_away {
        ErrorCode::GoingAway
    } else {
        ErrorCode::Shutdown
    };
    WireError::new(
        code,
        "the node is stopping and did not apply this request: send it to another node",
    )
}

/// Writes the answers of every publish in flight, in request order: before a later request's
/// answer, and before a refusal (the client learns the fate of every request read before the
/// bad one). False if the stream broke; the publishes not answered stay in `publishing`.
async fn answer_all(send: &mut quinn::SendStream, publishing: &mut Answering<'_>) -> bool {
    while !publishing.is_empty() {
        let answer = publishing.first_answer().await;
        if codec::write_frame(send, &answer).await.is_err() {
            return false;
        }
    }
    true
}

/// Refuses the session with `err` once the publishes read before the bad frame are answered.
async fn refuse_after(
    conn: &quinn::Connection,
    send: &mut quinn::SendStream,
    publishing: &mut Answering<'_>,
    err: WireError,
) {
    answer_all(send, publishing).await;
    refuse(conn, send, err).await;
}

/// The answer of a submitted publish: once committed, and with `ack: replicated` once every
/// matching queue's copies hold it (or once `stop` says the answer is no longer wanted).
async fn published(
    shared: &Arc<Shared>,
    submitted: super::Submitted,
    ack: PublishAck,
    mut stop: watch::Receiver<bool>,
) -> Result<ResponseBody, WireError> {
    let receipt = shared.finish_publish(submitted).await?;
    if ack == PublishAck::Replicated {
        tokio::select! {
            copied = shared.wait_replicated(&receipt) => copied?,
            _ = stop.wait_for(|stop| *stop) => {}
        }
    }
    Ok(ResponseBody::Published {
        count: receipt.count,
    })
}

/// Checks a publish's operations against the node's ACLs (always allowed on an open node).
fn authorize_publish(
    shared: &Shared,
    principal: Option<&Principal>,
    ops: &[PublishOp],
) -> Result<(), WireError> {
    let (Some(auth), Some(p)) = (shared.authorizer(), principal) else {
        return Ok(());
    };
    ops.iter().try_for_each(|op| {
        let region = match op {
            PublishOp::Put { region, .. }
            | PublishOp::Destroy { region, .. }
            | PublishOp::Invalidate { region, .. } => region,
        };
        auth.check(p, Access::Publish(region))
    })
}

/// Checks a request against the node's ACLs (always allowed on an open node).
fn authorize(
    shared: &Shared,
    principal: Option<&Principal>,
    body: &RequestBody,
) -> Result<(), WireError> {
    let (Some(auth), Some(p)) = (shared.authorizer(), principal) else {
        return Ok(());
    };
    match body {
        RequestBody::RegisterInterest { region, .. }
        | RequestBody::UnregisterInterest { region, .. }
        | RequestBody::Get { region, .. } => auth.check(p, Access::Subscribe(region)),
        RequestBody::Publish { ops, .. } => authorize_publish(shared, principal, ops),
        RequestBody::ListQueues
        | RequestBody::ListQueuesPage(_)
        | RequestBody::CloseDurable { .. }
        | RequestBody::Drain { .. }
        | RequestBody::RemoveNode { .. }
        | RequestBody::AddNode { .. } => auth.check(p, Access::Admin),
        RequestBody::Ready | RequestBody::Close { .. } | RequestBody::ReplayRate { .. } => Ok(()),
    }
}

async fn request(
    shared: &Arc<Shared>,
    session: SessionId,
    body: RequestBody,
) -> Result<ResponseBody, WireError> {
    match body {
        RequestBody::RegisterInterest { .. } | RequestBody::Publish { .. } => Err(internal(
            "registrations and publishes are answered by the control loop",
        )),
        RequestBody::UnregisterInterest { region, interest } => {
            let removed = shared
                .apply(|core| core.unregister(session, &region, &interest))
                .await?;
            if removed {
                shared.wait_interest_copied(session).await?;
            }
            Ok(ResponseBody::Unregistered { removed })
        }
        RequestBody::Ready => {
            let replay_end = shared.core().ready(session)?;
            shared.wake(session);
            Ok(ResponseBody::Ready { replay_end })
        }
        RequestBody::ReplayRate { events_per_s } => {
            shared.core().set_replay_rate(session, events_per_s)?;
            // A paced replay waiting for its next frame sees the new rate at once.
            shared.wake(session);
            Ok(ResponseBody::ReplayRate { events_per_s })
        }
        RequestBody::Get { region, key } => Ok(ResponseBody::Value {
            value: shared.get(&region, &key)?,
        }),
        RequestBody::ListQueues => Ok(ResponseBody::Queues {
            queues: shared.queue_reports().await,
        }),
        RequestBody::ListQueuesPage(query) => {
            let (q, cluster_wide) =
                crate::admin::ListQuery::from_wire(&query, shared.clock.now_ms())
                    .map_err(|e| WireError::new(ErrorCode::InvalidArgument, e.to_string()))?;
            let (page, unreachable) = shared.list_queues(&q, cluster_wide).await;
            let next = page.next(&q).map(|t| t.encode());
            Ok(ResponseBody::QueuesPage(QueuesPage {
                queues: page.queues.into_iter().map(|v| v.into_report()).collect(),
                next,
                total: page.total,
                unreachable,
            }))
        }
        RequestBody::CloseDurable { durable_id } => {
            shared
                .apply(|core| Ok(((), core.close_durable(&durable_id)?)))
                .await?;
            super::placement::forget(shared, &durable_id, super::placement::Ended::Released);
            Ok(ResponseBody::ClosedDurable { durable_id })
        }
        RequestBody::Drain { node_id, draining } => drain(shared, &node_id, draining).await,
        RequestBody::RemoveNode { node_id } => remove_node(shared, &node_id).await,
        RequestBody::AddNode { node_id, addr } => add_node(shared, &node_id, &addr).await,
        RequestBody::Close { keepalive } => {
            if keepalive {
                shared.wait_acks_durable(session).await?;
            }
            Ok(ResponseBody::Closed { keepalive })
        }
    }
}

/// `tether cluster drain`: marks member `name` draining or not (`draining`), through the
/// metadata, and reports what it still holds in the metadata applied here.
async fn drain(
    shared: &Arc<Shared>,
    name: &str,
    draining: Option<bool>,
) -> Result<ResponseBody, WireError> {
    let cluster = admin_cluster(shared, "there is nothing to drain")?;
    let node = member_id(cluster, name)?;
    if let Some(draining) = draining {
        require_upgraded(cluster, "drain a member", None).await?;
        let cmd = crate::cluster::meta::MetaCommand::SetDraining { node, draining };
        cluster
            .write(cmd)
            .await
            .map_err(super::placement::metadata_unavailable)?;
        tracing::info!(node = name, draining, "drain set");
    }
    let report = cluster.read(|s| {
        let (primaries, copies) = s.held_by(node);
        DrainReport {
            node_id: name.to_string(),
            draining: s.draining.contains(&node),
            primaries,
            copies,
        }
    });
    // The write is applied on the leader; this node's metadata may not say so yet.
    let report = DrainReport {
        draining: draining.unwrap_or(report.draining),
        ..report
    };
    Ok(ResponseBody::Drain(report))
}

/// How long an admin command that drains or changes members waits for every member to say
/// which peer protocol version it speaks, in milliseconds.
const MEMBER_VERSION_ASK_MS: u64 = 2_000;

/// Refuses `what` (a drain or a membership change) while a member, other than `except`,
/// speaks a peer protocol older than [`PEER_VERSION_MEMBERSHIP`]: in a rolling upgrade not
/// finished, it could not read what `what` writes to the metadata log.
async fn require_upgraded(
    cluster: &crate::cluster::Cluster,
    what: &str,
    except: Option<crate::cluster::meta::NodeId>,
) -> Result<(), WireError> {
    use crate::cluster::meta::PEER_VERSION_MEMBERSHIP;
    let ask = Duration::from_millis(MEMBER_VERSION_ASK_MS);
    let older = cluster
        .members_older_than(PEER_VERSION_MEMBERSHIP, ask, except)
        .await;
    if older.is_empty() {
        return Ok(());
    }
    let named: Vec<String> = older
        .iter()
        .map(|(name, v)| format!("{name} speaks version {v}"))
        .collect();
    Err(WireError::new(
        ErrorCode::Refused,
        format!(
            "cannot {what}: it needs peer protocol version {PEER_VERSION_MEMBERSHIP} on every \
             member, and {}: finish the upgrade first (restart each member on the new build)",
            named.join(", ")
        ),
    ))
}

/// The cluster of this node, for an admin command about its members; refused on a node that
/// is not a member of one (`why`: what that means for the command).
fn admin_cluster<'a>(
    shared: &'a Shared,
    why: &str,
) -> Result<&'a Arc<crate::cluster::Cluster>, WireError> {
    shared.member.cluster.get().ok_or_else(|| {
        WireError::new(
            ErrorCode::InvalidArgument,
            format!("this node is not a cluster member: {why}"),
        )
    })
}

/// The raft id of member `name`; refused if it is not one.
fn member_id(
    cluster: &crate::cluster::Cluster,
    name: &str,
) -> Result<crate::cluster::meta::NodeId, WireError> {
    cluster.members().id_of(name).ok_or_else(|| {
        WireError::new(
            ErrorCode::InvalidArgument,
            format!("{name:?} is not a member of this cluster"),
        )
    })
}

/// `tether cluster remove-node`: marks member `name` draining (so nothing new goes to it),
/// refuses while the metadata still makes it the primary of a queue, then removes it from the
/// group; the metadata forgets it as the change applies (`MetaState::forget_members`).
async fn remove_node(shared: &Arc<Shared>, name: &str) -> Result<ResponseBody, WireError> {
    let cluster = admin_cluster(shared, "there is no member to remove")?;
    let node = member_id(cluster, name)?;
    require_upgraded(cluster, "remove a member", Some(node)).await?;
    let unavailable = super::placement::metadata_unavailable;
    let draining = crate::cluster::meta::MetaCommand::SetDraining {
        node,
        draining: true,
    };
    cluster.write(draining).await.map_err(unavailable)?;
    // Read after everything committed before: a queue placed or promoted there just now counts.
    cluster.barrier().await.map_err(unavailable)?;
    let (primaries, _) = cluster.read(|s| s.held_by(node));
    if primaries > 0 {
        return Err(WireError::new(
            ErrorCode::Refused,
            format!(
                "{name} is still the primary of {primaries} queues (it is now draining): wait until \
                 `tether cluster drain {name} --status` shows 0 primaries, or, if it is down, \
                 until its queues fail over to their copies; a queue without a copy elsewhere \
                 needs {name} back"
            ),
        ));
    }
    cluster
        .remove_member(node)
        .await
        .map_err(|e| membership_refused(e, "remove", name))?;
    tracing::info!(node = name, "member removed");
    Ok(ResponseBody::NodeRemoved {
        node_id: name.to_string(),
        members: members_after(cluster, Some(node), None),
    })
}

/// `tether cluster add-node`: marks node `name` draining (no queue goes to it before it holds
/// the regions' values; it undrains itself once it does, `join.rs`), then adds it to the group.
/// Adding a member again answers as the first time.
async fn add_node(shared: &Arc<Shared>, name: &str, addr: &str) -> Result<ResponseBody, WireError> {
    let cluster = admin_cluster(shared, "there is no cluster to add a node to")?;
    let (name, addr) = crate::config::parse_peer(&format!("{name}={addr}"))
        .map_err(|e| WireError::new(ErrorCode::InvalidArgument, e.to_string()))?;
    let node = crate::cluster::meta::raft_id(&name);
    require_upgraded(cluster, "add a member", None).await?;
    let unavailable = super::placement::metadata_unavailable;
    // Refused before anything is written: the draining mark below would fall on the other.
    if let Some(other) = cluster.members().nodes.get(&node)
        && other.name != name
    {
        return Err(WireError::new(
            ErrorCode::Refused,
            format!(
                "cannot add {name}: its raft id is member {}'s; choose another name",
                other.name
            ),
        ));
    }
    if cluster.members().id_of(&name).is_none() {
        let draining = crate::cluster::meta::MetaCommand::SetDraining {
            node,
            draining: true,
        };
        cluster.write(draining).await.map_err(unavailable)?;
    }
    let peer = crate::cluster::PeerNode {
        name: name.clone(),
        addr,
    };
    cluster
        .add_member(node, peer)
        .await
        .map_err(|e| membership_refused(e, "add", &name))?;
    tracing::info!(node = name, "member added");
    let members = members_after(cluster, None, Some(&name));
    Ok(ResponseBody::NodeAdded {
        node_id: name,
        members,
    })
}

/// A membership change that failed: `refused` when the group refused it (`verb` and `name` say
/// which), else the metadata is unavailable.
fn membership_refused(e: crate::cluster::ClusterError, verb: &str, name: &str) -> WireError {
    match e {
        crate::cluster::ClusterError::Membership(why) => {
            WireError::new(ErrorCode::Refused, format!("cannot {verb} {name}: {why}"))
        }
        e => super::placement::metadata_unavailable(e),
    }
}

/// The members' names once a change removing `removed` or adding `added` applied, sorted: the
/// change is applied on the leader, and this node's view may be a moment behind.
fn members_after(
    cluster: &crate::cluster::Cluster,
    removed: Option<crate::cluster::meta::NodeId>,
    added: Option<&str>,
) -> Vec<String> {
    let mut members: Vec<String> = cluster
        .members()
        .nodes
        .iter()
        .filter(|(id, _)| Some(**id) != removed)
        .map(|(_, n)| n.name.clone())
        .chain(added.map(str::to_string))
        .collect();
    members.sort();
    members.dedup();
    members
}

/// Body bytes of a session's first delivery frame; each next frame doubles it up to
/// `DELIVERY_FRAME_BODY_BYTES_MAX`.
const FIRST_DELIVERY_FRAME_BODY_BYTES: usize = 8 * 1024;
/// A live (caught-up) session's read of fewer new entries than this is framed on its async
/// worker rather than on the blocking pool.
const LIVE_INLINE_ENTRIES_MAX: u64 = 256;
/// Body bytes of a frame built on an async worker at most (a read stops at its budget).
const LIVE_INLINE_FRAME_BODY_BYTES_MAX: usize = 64 * 1024;
/// CBOR bytes a wire entry adds to its record (map header, field names, offset, flags).
const WIRE_ENTRY_OVERHEAD_BYTES: usize = 40;

/// Capacity a caught-up delivery task keeps of its frame buffers, in bytes; more is freed.
const DELIVERY_BUFFER_BYTES_KEPT: usize = 64 * 1024;

/// A delivery write still blocked after this long (the client's stream window is full: it
/// stalled or is far behind) gives back the read buffers it holds for the next frame, in
/// milliseconds. A replay whose client keeps up never waits that long and keeps them.
const DELIVERY_BLOCKED_RELEASE_MS: u64 = 200;

/// Frame buffers a delivery task cycles through, at most. A frame's bytes stay with QUIC until
/// the client acknowledges them, so the buffer of the next frame is a new allocation unless the
/// task comes back to one whose frame is gone: with a few in rotation a replay reuses them
/// instead of allocating (and faulting in) a frame's worth of fresh memory per frame.
const DELIVERY_FRAME_BUFFERS_MAX: usize = 8;

/// The frame buffers of one delivery task, oldest first (see [`DELIVERY_FRAME_BUFFERS_MAX`]),
/// each with the bytes of the allocation behind it (a buffer whose frame was split off shows
/// only what is left after the frame as its capacity).
#[derive(Default)]
struct FrameBuffers(std::collections::VecDeque<(BytesMut, usize)>);

impl FrameBuffers {
    /// A buffer for a frame read up to `budget` body bytes: one whose earlier frame is gone,
    /// with room for the budget (the oldest such), or an empty one. A frame needs a little
    /// more than its budget (the CBOR around each record, and the read's last record may pass
    /// it), so asking for more than the budget would refuse the very buffers earlier frames
    /// of the same budget were built in; [`fit_frame_buffer`] makes room when one is short.
    fn take(&mut self, budget: usize) -> BytesMut {
        for _ in 0..self.0.len() {
            let Some((mut b, size)) = self.0.pop_front() else {
                break;
            };
            if b.try_reclaim(budget) {
                return b;
            }
            self.0.push_back((b, size));
        }
        BytesMut::new()
    }

    /// Gives back a buffer after a frame of `frame_bytes` was split off it; the oldest is
    /// dropped beyond [`DELIVERY_FRAME_BUFFERS_MAX`] (its memory goes with its frame).
    fn give_back(&mut self, b: BytesMut, frame_bytes: usize) {
        let size = frame_bytes + b.capacity();
        if size == 0 {
            return; // never allocated
        }
        self.0.push_back((b, size));
        if self.0.len() > DELIVERY_FRAME_BUFFERS_MAX {
            self.0.pop_front();
        }
    }

    /// Bytes of the allocations behind the buffers.
    fn bytes(&self) -> usize {
        self.0.iter().map(|(_, size)| size).sum()
    }

    fn clear(&mut self) {
        self.0.clear();
    }
}

/// Makes room for `need` bytes in a frame's buffer: a reused one too small for this frame is
/// let go and a buffer of exactly `need` bytes allocated (growing it in place would copy
/// nothing useful and round its size up to double, which every later frame then pins).
fn fit_frame_buffer(out: &mut BytesMut, need: usize) {
    if out.capacity() < need {
        *out = BytesMut::with_capacity(need);
    }
}

/// An entry read from storage, waiting in the frame arena.
struct Pending {
    offset: Offset,
    flags: u8,
    start: usize,
    end: usize,
}

/// The writer's answer for a delivered mark's group commit.
type MarkWrite = oneshot::Receiver<Result<(), super::writer::WriteError>>;

/// Counts of the entries in one delivery frame, for the metrics.
struct FrameCounts {
    n: u64,
    replayed: u64,
    dups: u64,
}

/// One delivery frame to read and encode, with the buffers it reuses.
struct FrameJob {
    queue: QueueId,
    from: Offset,
    to: Offset,
    budget: usize,
    bounds: FlagBounds,
    arena: Vec<u8>,
    pending: Vec<Pending>,
    out: BytesMut,
}

impl FrameJob {
    /// Reads the entries and encodes the frame; when the frame passes the stored delivered
    /// mark, submits the mark's move and returns its write, which must be durable before the
    /// bytes reach the wire. `Ok(None)`: nothing readable in the range; `Err`: the session must
    /// end (the reason is logged).
    #[allow(clippy::type_complexity)]
    fn build(
        &mut self,
        shared: &Shared,
        session: SessionId,
    ) -> Result<Option<(Bytes, FrameCounts, Option<MarkWrite>)>, ()> {
        let (a, p) = (&mut self.arena, &mut self.pending);
        a.clear();
        p.clear();
        let read = shared.store.read_entries(
            self.queue,
            self.from,
            self.to,
            self.budget,
            &mut |offset, flags, body| {
                let start = a.len();
                a.extend_from_slice(body);
                p.push(Pending {
                    offset,
                    flags,
                    start,
                    end: a.len(),
                });
            },
        );
        if let Err(e) = read {
            tracing::error!(error = %e, "reading a queue failed");
            return Err(());
        }
        let Some(last) = self.pending.last().map(|p| p.offset) else {
            return Ok(None);
        };
        let (mut replayed, mut dups) = (0u64, 0u64);
        let refs: Vec<WireEntry<'_>> = self
            .pending
            .iter()
            .map(|e| {
                let flags = (e.flags & STORED_FLAGS_MASK) | self.bounds.wire_flags(e.offset);
                replayed += u64::from(flags & FLAG_REPLAYED != 0);
                dups += u64::from(flags & FLAG_POSSIBLE_DUPLICATE != 0);
                WireEntry {
                    offset: e.offset,
                    flags,
                    record: &self.arena[e.start..e.end],
                }
            })
            .collect();
        // Records plus a few bytes of CBOR per entry: one allocation, no regrowth.
        fit_frame_buffer(
            &mut self.out,
            self.arena.len() + self.pending.len() * WIRE_ENTRY_OVERHEAD_BYTES + 16,
        );
        if let Err(e) = codec::encode_frame_packed_into(&Delivery::Events(refs), &mut self.out) {
            tracing::error!(error = %e, "encoding a delivery frame failed");
            return Err(());
        }
        let frame: Bytes = self.out.split().freeze();
        // Submitted under the core lock, as every write is (the writer commits in that order).
        let mark = {
            let mut core = shared.core();
            core.will_send(session, last)
                .map(|batch| shared.writer.submit(batch, None))
        };
        // The delivered mark must be durable (synced, in a group commit) before the bytes
        // reach the wire; one such write covers many frames (`DELIVERED_MARK_RESERVE_ENTRIES`).
        let n = self.pending.len() as u64;
        Ok(Some((frame, FrameCounts { n, replayed, dups }, mark)))
    }
}

/// Reads committed entries and writes them to the delivery stream, in offset order, with the
/// live marker between the last replayed entry and the first live one.
async fn deliver(
    shared: Arc<Shared>,
    session: SessionId,
    mut send: quinn::SendStream,
    wake: Arc<Notify>,
) {
    let mut ready_at: Option<Instant> = None;
    // Grows with the first reads (to a frame's budget plus one value at most), never allocated
    // up front: a connected session that receives nothing costs no frame buffer.
    let mut arena: Vec<u8> = Vec::new();
    let mut pending: Vec<Pending> = Vec::new();
    let mut buffers = FrameBuffers::default();
    // Small first frames get the first events out fast; larger ones then carry the bulk.
    let mut frame_budget = FIRST_DELIVERY_FRAME_BODY_BYTES;
    // The replay rate the client asked for, on a clock counted from here.
    let origin = Instant::now();
    let mut pacer = ReplayPacer::default();
    loop {
        let (step, queue, bounds, rate) = {
            let mut core = shared.core();
            let step = core.delivery_step(session);
            let queue = core.session(session).map(|s| s.queue).unwrap_or(0);
            (
                step,
                queue,
                core.flag_bounds(session),
                core.replay_rate(session),
            )
        };
        if rate != pacer.rate() {
            pacer.set_rate(rate);
        }
        if bounds.is_some() && ready_at.is_none() {
            ready_at = Some(Instant::now());
        }
        match step {
            Step::Idle => {
                // Caught up: give back what a replay grew (a live stream's small frames keep
                // theirs), so idle sessions hold no large buffers.
                if arena.capacity() > DELIVERY_BUFFER_BYTES_KEPT {
                    arena = Vec::new();
                    pending = Vec::new();
                }
                if buffers.bytes() > DELIVERY_BUFFER_BYTES_KEPT {
                    buffers.clear();
                }
                wake.notified().await
            }
            Step::Live(regions) => {
                if let Some(t) = ready_at {
                    metrics::histogram!(m::REPLAY_DURATION).record(t.elapsed().as_secs_f64());
                }
                if codec::write_frame(&mut send, &Delivery::Live(regions))
                    .await
                    .is_err()
                {
                    return;
                }
            }
            Step::Read { from, to } => {
                let Some(bounds) = bounds else { return };
                let replaying = from <= bounds.replay_end;
                let to = if replaying {
                    let wait_us = pacer.wait_us(origin.elapsed().as_micros() as u64);
                    if wait_us > 0 {
                        // Paced: wait for the rate (or for a change, e.g. of the rate).
                        tokio::select! {
                            _ = tokio::time::sleep(Duration::from_micros(wait_us)) => {}
                            _ = wake.notified() => {}
                        }
                        continue;
                    }
                    pacer.read_end(from, to)
                } else {
                    to
                };
                // A live session's few new entries are framed right here (read from the
                // memtable they were just written to); a replay's frames, and a live session's large backlogs,
                // on the low-priority delivery pool, so they never hold an async worker that
                // live sessions' events wait for, nor take the CPU from them.
                let inline = !replaying && to.saturating_sub(from) < LIVE_INLINE_ENTRIES_MAX;
                let budget = if inline {
                    frame_budget.min(LIVE_INLINE_FRAME_BODY_BYTES_MAX)
                } else {
                    frame_budget
                };
                let mut job = FrameJob {
                    queue,
                    from,
                    to,
                    budget,
                    bounds,
                    arena: std::mem::take(&mut arena),
                    pending: std::mem::take(&mut pending),
                    out: buffers.take(budget),
                };
                let built = if inline {
                    job.build(&shared, session)
                } else {
                    let Ok(permit) = shared.delivery_reads.acquire().await else {
                        return;
                    };
                    let sh = shared.clone();
                    let built = shared
                        .delivery_pool
                        .run(move || {
                            let built = job.build(&sh, session);
                            (built, job)
                        })
                        .await;
                    drop(permit);
                    let Ok((built, built_job)) = built else {
                        return;
                    };
                    job = built_job;
                    built
                };
                (arena, pending) = (job.arena, job.pending);
                let frame_bytes = match &built {
                    Ok(Some((frame, ..))) => frame.len(),
                    _ => 0,
                };
                buffers.give_back(job.out, frame_bytes);
                let (frame, counts) = match built {
                    Ok(Some((frame, counts, mark))) => {
                        // Awaited here, on either path: no thread blocks on the writer.
                        if let Some(mark) = mark
                            && !matches!(mark.await, Ok(Ok(())))
                        {
                            return;
                        }
                        (frame, counts)
                    }
                    Ok(None) => {
                        // Committed entries must be readable; a gap means acked meanwhile.
                        wake.notified().await;
                        continue;
                    }
                    Err(()) => return,
                };
                frame_budget = (frame_budget * 2).min(DELIVERY_FRAME_BODY_BYTES_MAX);
                let FrameCounts { n, replayed, dups } = counts;
                let write = send.write_chunk(frame);
                tokio::pin!(write);
                let written = match tokio::time::timeout(
                    Duration::from_millis(DELIVERY_BLOCKED_RELEASE_MS),
                    &mut write,
                )
                .await
                {
                    Ok(written) => written,
                    Err(_) => {
                        // The client takes nothing (stalled, or far behind): do not hold the
                        // read buffers of the next frame while waiting for it.
                        arena = Vec::new();
                        pending = Vec::new();
                        buffers.clear();
                        write.await
                    }
                };
                if written.is_err() {
                    return;
                }
                if replaying {
                    pacer.sent(n, origin.elapsed().as_micros() as u64);
                }
                metrics::counter!(m::EVENTS_DELIVERED).increment(n);
                super::admin::NodeStats::add(&shared.stats.delivered, n);
                metrics::counter!(m::EVENTS_REPLAYED).increment(replayed);
                metrics::counter!(m::EVENTS_REDELIVERED).increment(dups);
            }
        }
    }
}

#[cfg(test)]
mod frame_buffer_tests {
    use super::*;

    /// A frame of `bytes` split off its buffer and sent, as `deliver` and `FrameJob::build`
    /// take, fit and fill it.
    fn frame(buffers: &mut FrameBuffers, bytes: usize) -> (Bytes, *const u8) {
        framed(buffers, bytes, bytes)
    }

    /// A frame read up to `budget` body bytes that came to `bytes` on the wire.
    fn framed(buffers: &mut FrameBuffers, budget: usize, bytes: usize) -> (Bytes, *const u8) {
        let mut b = buffers.take(budget);
        fit_frame_buffer(&mut b, bytes);
        b.extend_from_slice(&vec![7u8; bytes]);
        let frame = b.split().freeze();
        let at = frame.as_ptr();
        buffers.give_back(b, frame.len());
        (frame, at)
    }

    #[test]
    fn a_buffer_is_reused_once_its_frame_is_gone_and_never_before() {
        let mut buffers = FrameBuffers::default();
        let (first, at) = frame(&mut buffers, 1000);
        // Its frame still in flight: the next frame gets other memory.
        let (second, second_at) = frame(&mut buffers, 1000);
        assert_ne!(second_at, at);
        assert_eq!(&first[..], &second[..]);
        // The first frame acknowledged and dropped: its buffer comes back.
        drop(first);
        let (_third, third_at) = frame(&mut buffers, 1000);
        assert_eq!(third_at, at);
    }

    /// A frame's wire bytes pass its read budget by its records' CBOR (a few percent with
    /// 1 KiB values, a fifth with 128 B ones): its buffer must still serve the next frames of
    /// that budget once it is acknowledged, and never grow beyond what a frame needed.
    #[test]
    fn frames_a_little_larger_than_their_budget_reuse_their_buffers() {
        let budget = DELIVERY_FRAME_BODY_BYTES_MAX;
        for wire in [budget + budget / 25, budget + budget / 5] {
            let mut buffers = FrameBuffers::default();
            let (first, at) = framed(&mut buffers, budget, wire);
            drop(first);
            let (second, second_at) = framed(&mut buffers, budget, wire);
            assert_eq!(second_at, at, "a {wire}-byte frame's buffer was not reused");
            drop(second);
            // A frame larger than the buffer gets one of its own size, the short one let go.
            let (larger, larger_at) = framed(&mut buffers, budget, wire + 1000);
            assert_ne!(larger_at, at);
            assert_eq!(larger.len(), wire + 1000);
            assert_eq!(
                buffers.bytes(),
                wire + 1000,
                "buffers kept: {}",
                buffers.0.len()
            );
        }
    }

    #[test]
    fn at_most_the_bound_of_buffers_is_kept() {
        let mut buffers = FrameBuffers::default();
        let in_flight: Vec<_> = (0..DELIVERY_FRAME_BUFFERS_MAX + 5)
            .map(|_| frame(&mut buffers, 100).0)
            .collect();
        assert_eq!(buffers.0.len(), DELIVERY_FRAME_BUFFERS_MAX);
        assert!(buffers.bytes() >= DELIVERY_FRAME_BUFFERS_MAX * 100);
        drop(in_flight);
        buffers.clear();
        assert_eq!(buffers.bytes(), 0);
    }
}
