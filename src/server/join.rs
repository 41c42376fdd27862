//! Joining a running cluster (`--join`, then `tether cluster add-node` on a member).
//!
//! A new member holds no region values, and every publish made before it joined is applied
//! on every other member only. So before it serves anyone, it copies the regions of a member
//! (the *source*), then applies forwarded publishes from where that copy stands:
//!
//! 1. It waits until the group's membership holds it (a member added it) and every other
//!    member forwards to it: each answers how far the new member has applied its publish log,
//!    `c_O`, which is what that member trimmed when it took the newcomer on, and it keeps
//!    every publish after `c_O` for the newcomer from then on.
//! 2. It reads the source's regions in pages. With the first page the source says how far it
//!    had applied each origin's publishes, `a_O`, before reading any page; every page holds at
//!    least that much. `a_O >= c_O`: the origin trimmed only what every member, the source
//!    included, had applied. The source's own publishes count from `c_source` (all committed
//!    there before the page was read).
//! 3. It records `fwd-applied/<O>` = `a_O` (the source: `c_source`) with the mark that it
//!    joined, in one batch, and from then on applies forwarded publishes: each origin sends
//!    from `c_O`, and the new member skips what it already holds and applies the rest in
//!    order. A publish applied twice (in the copy, and again after `a_O`) writes the values it
//!    wrote the first time.
//! 4. It undrains itself (`tether cluster add-node` made it draining before adding it, so no
//!    queue went to it before it held the regions); rebalancing then moves queues to it. The
//!    join mark says whether the undrain is still to do ([`JOINED_UNDRAIN_PENDING`]): a node
//!    stopped between the two undrains itself at its next start ([`undrain`]).
//!
//! Until then it refuses clients (`unavailable`, they try another member) and defers
//! forwarded publishes (their origins keep them and send them again).

use std::collections::BTreeMap;
use std::ops::ControlFlow;
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use tether_storage::{Batch, StorageError, Store};

use super::{Shared, forward};
use crate::cluster::Cluster;
use crate::cluster::meta::{MetaCommand, NodeId};
use crate::cluster::network::{PeerRequest, PeerResponse, RegionsPage};

/// Node-state key set once this node, started with `--join`, has copied the regions; its value
/// is [`JOINED_UNDRAIN_PENDING`] until the node has undrained itself, then [`JOINED_DONE`].
pub const JOINED_KEY: &str = "cluster-joined";
/// [`JOINED_KEY`]'s value once the node joined and undrained itself (the only value before
/// the undrain was recorded: such a node is taken as undrained).
pub const JOINED_DONE: u8 = 1;
/// [`JOINED_KEY`]'s value between recording the join and the undrain committing: a node
/// restarted then undrains itself at start (else it would stay draining until an operator
/// noticed, as an operator's own drain does).
pub const JOINED_UNDRAIN_PENDING: u8 = 2;
/// Pause between the steps of a join that wait on other members, in milliseconds.
pub const JOIN_RETRY_MS: u64 = 200;
/// A join that waits this long on a member says so in the log (and again as often), in
/// milliseconds.
pub const JOIN_WAIT_WARN_MS: u64 = 10_000;
/// Most bytes of region keys and values in one page of a region copy.
pub const REGIONS_PAGE_BYTES_MAX: usize = 1 << 20;
const _: () = assert!(2 * REGIONS_PAGE_BYTES_MAX < crate::cluster::network::PEER_MESSAGE_BYTES_MAX);
/// Deadline of one peer call of a join, in milliseconds.
pub const JOIN_CALL_TIMEOUT_MS: u64 = 10_000;

/// Why a step of a join did not complete (it is tried again).
#[derive(Debug, thiserror::Error)]
enum JoinError {
    #[error("{0} does not forward its publishes to this node yet")]
    NotForwarding(String),
    #[error("no other member to copy the regions from")]
    NoOtherMember,
    #[error("no member gave its regions (the last, {member}: {why})")]
    NoSource { member: String, why: String },
    #[error("{member} did not say how far it applied {origin}'s publishes")]
    NoOffset { member: String, origin: String },
    #[error("{member} applied {origin}'s publishes to {at}, before {origin} keeps them ({kept})")]
    BeforeKept {
        member: String,
        origin: String,
        at: u64,
        kept: u64,
    },
    #[error("recording the join: {0}")]
    Record(String),
    #[error("this node is stopping")]
    Stopping,
}

/// Whether this node finished joining a cluster (or never had to).
pub(crate) fn joined(store: &dyn Store) -> Result<bool, StorageError> {
    Ok(store.state_get(JOINED_KEY)?.is_some())
}

/// Whether this node recorded its join but not yet that it undrained itself.
pub(crate) fn undrain_pending(store: &dyn Store) -> Result<bool, StorageError> {
    Ok(store.state_get(JOINED_KEY)?.as_deref() == Some(&[JOINED_UNDRAIN_PENDING]))
}

/// A source's page of its regions after `after` (see [`RegionsPage`]).
pub(crate) async fn regions_page(s: &Arc<Shared>, after: Option<(String, String)>) -> PeerResponse {
    // How far this node applied each origin, read before any page is: every page holds it.
    let applied = match (&after, s.member.cluster.get()) {
        (None, Some(cluster)) => {
            let origins = cluster
                .members()
                .nodes
                .values()
                .map(|n| n.name.clone())
                .filter(|n| *n != s.node_id)
                .collect::<Vec<_>>();
            forward::applied_of(s, origins.into_iter()).await
        }
        _ => BTreeMap::new(),
    };
    let store = s.store.clone();
    let read = tokio::task::spawn_blocking(move || {
        let mut page = RegionsPage {
            applied,
            ..Default::default()
        };
        let mut bytes = 0;
        let from = after.as_ref().map(|(r, k)| (r.as_str(), k.as_str()));
        store.regions_scan(from, &mut |region, key, value| {
            if bytes >= REGIONS_PAGE_BYTES_MAX {
                page.more = true;
                return ControlFlow::Break(());
            }
            bytes += region.len() + key.len() + value.len();
            page.entries.push((
                region.to_string(),
                key.to_string(),
                serde_bytes::ByteBuf::from(value.to_vec()),
            ));
            ControlFlow::Continue(())
        })?;
        Ok::<_, StorageError>(page)
    })
    .await;
    match read {
        Ok(Ok(page)) => PeerResponse::Regions(page),
        Ok(Err(e)) => PeerResponse::BadRequest(format!("reading the regions: {e}")),
        Err(_) => PeerResponse::BadRequest("reading the regions failed".into()),
    }
}

/// Joins the cluster once a member has added this node (see the module doc), then undrains it.
pub(crate) async fn join_loop(weak: Weak<Shared>, cluster: Arc<Cluster>) {
    let retry = Duration::from_millis(JOIN_RETRY_MS);
    let mut warned = Instant::now();
    let mut waiting = |what: &str| {
        if warned.elapsed() >= Duration::from_millis(JOIN_WAIT_WARN_MS) {
            warned = Instant::now();
            tracing::warn!("joining the cluster, still waiting: {what}");
        }
    };
    tracing::info!("waiting to be added to the cluster (`tether cluster add-node` on a member)");
    while !cluster.in_group() {
        if weak.strong_count() == 0 {
            return;
        }
        waiting("a member to add this node (`tether cluster add-node`)");
        tokio::time::sleep(retry).await;
    }
    tracing::info!("added to the cluster: copying the regions");
    loop {
        let Some(me) = weak.upgrade().map(|s| s.node_id.clone()) else {
            return;
        };
        let cursors = match forward_cursors(&cluster, &me).await {
            Ok(c) => c,
            Err(why) => {
                waiting(&why.to_string());
                tokio::time::sleep(retry).await;
                continue;
            }
        };
        match copy_regions(&weak, &cluster, &cursors).await {
            Ok(()) => break,
            Err(JoinError::Stopping) => return,
            Err(why) => {
                waiting(&format!("a member to copy the regions from ({why})"));
                tracing::debug!(%why, "copying the regions failed; trying again");
                tokio::time::sleep(retry).await;
            }
        }
    }
    tracing::info!("joined the cluster: serving clients");
    undrain(weak, cluster).await;
}

/// The last step of a join: undrains this node through the metadata (retrying until it
/// commits), then records that it did. Run again at start by a node that recorded its join
/// but not the undrain ([`undrain_pending`]).
pub(crate) async fn undrain(weak: Weak<Shared>, cluster: Arc<Cluster>) {
    let retry = Duration::from_millis(JOIN_RETRY_MS);
    let undrain = MetaCommand::SetDraining {
        node: cluster.id(),
        draining: false,
    };
    while let Err(e) = cluster.write(undrain.clone()).await {
        if weak.strong_count() == 0 {
            return;
        }
        tracing::debug!(error = %e, "undraining this node after its join; retrying");
        tokio::time::sleep(retry).await;
    }
    let Some(s) = weak.upgrade() else {
        return;
    };
    let mut done = Batch::new();
    done.state_put(JOINED_KEY, vec![JOINED_DONE]);
    match s.writer.submit(done, None).await {
        Ok(Ok(())) => tracing::info!("undrained after joining the cluster"),
        // A write failure stops the node (the writer's fail-stop); it undrains again at start.
        Ok(Err(e)) => tracing::warn!(error = %e, "recording the undrain after the join"),
        Err(_) => {}
    }
}

/// Asks every other member how far this node has applied its publish log; `Err` names one
/// that does not forward to this node yet (or did not answer).
async fn forward_cursors(
    cluster: &Cluster,
    me: &str,
) -> Result<BTreeMap<NodeId, (String, u64)>, JoinError> {
    let timeout = Duration::from_millis(JOIN_CALL_TIMEOUT_MS);
    let mut cursors = BTreeMap::new();
    for (id, node) in &cluster.members().nodes {
        if *id == cluster.id() {
            continue;
        }
        let request = PeerRequest::ForwardCursor(me.to_string());
        match cluster.call(*id, request, timeout).await {
            Ok(PeerResponse::ForwardCursor(Some(c))) => {
                cursors.insert(*id, (node.name.clone(), c));
            }
            _ => return Err(JoinError::NotForwarding(node.name.clone())),
        }
    }
    Ok(cursors)
}

/// Copies the regions of one member (the first that gives them) and records where the copy
/// stands.
async fn copy_regions(
    weak: &Weak<Shared>,
    cluster: &Cluster,
    cursors: &BTreeMap<NodeId, (String, u64)>,
) -> Result<(), JoinError> {
    let timeout = Duration::from_millis(JOIN_CALL_TIMEOUT_MS);
    let mut last_error = JoinError::NoOtherMember;
    for (source, (source_name, source_cursor)) in cursors {
        let mut after = None;
        let mut applied = None;
        let mut keys = 0u64;
        let copied = loop {
            let request = PeerRequest::Regions {
                after: after.clone(),
            };
            let page = match cluster.call(*source, request, timeout).await {
                Ok(PeerResponse::Regions(page)) => page,
                Ok(PeerResponse::BadRequest(why)) => break Err(why),
                Ok(_) => break Err("an unexpected answer".into()),
                Err(e) => break Err(e.to_string()),
            };
            if applied.is_none() {
                applied = Some(page.applied);
            }
            let Some(s) = weak.upgrade() else {
                return Err(JoinError::Stopping);
            };
            let mut b = Batch::new();
            for (region, key, value) in &page.entries {
                b.region_put(region, key, value.to_vec());
            }
            keys += page.entries.len() as u64;
            after = page.entries.last().map(|(r, k, _)| (r.clone(), k.clone()));
            if !b.is_empty() {
                match s.writer.submit(b, None).await {
                    // The core's knowledge of which keys exist is out of date.
                    Ok(Ok(())) => s.core().forget_region_keys(),
                    Ok(Err(e)) => break Err(format!("storing the regions: {e}")),
                    Err(_) => return Err(JoinError::Stopping),
                }
            }
            if !page.more {
                break Ok(());
            }
        };
        if let Err(why) = copied {
            last_error = JoinError::NoSource {
                member: source_name.clone(),
                why,
            };
            continue;
        }
        let applied = applied.unwrap_or_default();
        // Where forwarding resumes, per origin: what the copy holds.
        let mut from = BTreeMap::new();
        for (id, (name, cursor)) in cursors {
            let at = if id == source {
                *source_cursor
            } else {
                match applied.get(name) {
                    Some(a) => *a,
                    None => {
                        return Err(JoinError::NoOffset {
                            member: source_name.clone(),
                            origin: name.clone(),
                        });
                    }
                }
            };
            // The origin keeps for this node only what follows `cursor`.
            if at < *cursor {
                return Err(JoinError::BeforeKept {
                    member: source_name.clone(),
                    origin: name.clone(),
                    at,
                    kept: *cursor,
                });
            }
            from.insert(name.clone(), at);
        }
        let Some(s) = weak.upgrade() else {
            return Err(JoinError::Stopping);
        };
        let mut done = Batch::new();
        done.state_put(JOINED_KEY, vec![JOINED_UNDRAIN_PENDING]);
        forward::joined_at(&s, &from, done)
            .await
            .map_err(|e| JoinError::Record(e.message))?;
        tracing::info!(source = %source_name, keys, "copied the regions");
        return Ok(());
    }
    Err(last_error)
}
