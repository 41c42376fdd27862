//! openraft storage over [`RaftLogDb`]: the consensus log, vote and committed id on disk,
//! and the metadata state machine ([`MetaState`]) in memory, persisted as snapshots.
//!
//! On restart the state machine is rebuilt from the last snapshot, then openraft re-applies
//! the committed entries after it (we implement `save_committed`/`read_committed` for that).
//! Every write here is fsynced before it is reported done (see [`RaftLogDb`]).

// openraft's traits fix the error type (`StorageError`, over 200 bytes).
#![allow(clippy::result_large_err)]

use std::collections::BTreeSet;
use std::fmt::Debug;
use std::io::Cursor;
use std::ops::{Bound, RangeBounds};
use std::sync::{Arc, RwLock};

use openraft::storage::{LogFlushed, LogState, RaftLogStorage, RaftStateMachine, Snapshot};
use openraft::{
    AnyError, Entry, EntryPayload, ErrorSubject, ErrorVerb, LogId, OptionalSend, RaftLogReader,
    RaftSnapshotBuilder, SnapshotMeta, StorageError, StorageIOError, StoredMembership, Vote,
};
use serde::{Deserialize, Serialize};
use tether_storage::RaftLogDb;
use tether_transport::codec;
use tokio::sync::watch;

use super::meta::{MetaResponse, MetaState, NodeId, PEER_VERSION_MEMBERSHIP};
use super::{Members, PeerNode, TypeConfig};

type StoreResult<T> = Result<T, StorageError<NodeId>>;

/// The consensus log format ([`tether_storage::RAFT_LOG_FORMAT`]) that holds metadata of peer
/// protocol version `peer_version`: format 2 brought [`PEER_VERSION_MEMBERSHIP`]'s.
fn log_format_for(peer_version: u32) -> u32 {
    if peer_version >= PEER_VERSION_MEMBERSHIP {
        2
    } else {
        tether_storage::RAFT_LOG_FORMAT_OLDEST
    }
}
const _: () = assert!(tether_storage::RAFT_LOG_FORMAT == 2);

/// The log format `e` needs (see [`log_format_for`]).
fn log_format_of(e: &Entry<TypeConfig>) -> u32 {
    match &e.payload {
        EntryPayload::Normal(cmd) => log_format_for(cmd.version_needed()),
        EntryPayload::Blank | EntryPayload::Membership(_) => tether_storage::RAFT_LOG_FORMAT_OLDEST,
    }
}

const META_VOTE: &str = "vote";
const META_COMMITTED: &str = "committed";
const META_PURGED: &str = "purged";
const META_SNAPSHOT: &str = "snapshot";

fn io_err(
    subject: ErrorSubject<NodeId>,
    verb: ErrorVerb,
    e: impl std::error::Error + 'static,
) -> StorageError<NodeId> {
    StorageIOError::new(subject, verb, AnyError::new(&e)).into()
}

fn encode<T: Serialize>(v: &T, subject: ErrorSubject<NodeId>) -> StoreResult<Vec<u8>> {
    codec::encode_body(v).map_err(|e| io_err(subject, ErrorVerb::Write, e))
}

fn decode<T: serde::de::DeserializeOwned>(
    b: &[u8],
    subject: ErrorSubject<NodeId>,
) -> StoreResult<T> {
    codec::decode_body(b).map_err(|e| io_err(subject, ErrorVerb::Read, e))
}

/// The consensus log (openraft's `RaftLogStorage` and `RaftLogReader`). Cheap to clone.
#[derive(Clone)]
pub struct LogStore {
    db: Arc<RaftLogDb>,
}

impl LogStore {
    pub fn new(db: Arc<RaftLogDb>) -> Self {
        LogStore { db }
    }

    fn meta<T: serde::de::DeserializeOwned>(
        &self,
        name: &str,
        subject: ErrorSubject<NodeId>,
    ) -> StoreResult<Option<T>> {
        match self.db.meta_get(name) {
            Ok(None) => Ok(None),
            Ok(Some(b)) => decode(&b, subject).map(Some),
            Err(e) => Err(io_err(subject, ErrorVerb::Read, e)),
        }
    }
}

impl RaftLogReader<TypeConfig> for LogStore {
    async fn try_get_log_entries<RB: RangeBounds<u64> + Clone + Debug + OptionalSend>(
        &mut self,
        range: RB,
    ) -> StoreResult<Vec<Entry<TypeConfig>>> {
        let from = match range.start_bound() {
            Bound::Included(i) => *i,
            Bound::Excluded(i) => i.saturating_add(1),
            Bound::Unbounded => 0,
        };
        let to = match range.end_bound() {
            Bound::Included(i) => i.saturating_add(1),
            Bound::Excluded(i) => *i,
            Bound::Unbounded => u64::MAX,
        };
        let rows = self
            .db
            .range(from, to)
            .map_err(|e| io_err(ErrorSubject::Logs, ErrorVerb::Read, e))?;
        rows.iter()
            .map(|(_, b)| decode(b, ErrorSubject::Logs))
            .collect()
    }
}

impl RaftLogStorage<TypeConfig> for LogStore {
    type LogReader = LogStore;

    async fn get_log_state(&mut self) -> StoreResult<LogState<TypeConfig>> {
        let purged: Option<LogId<NodeId>> = self.meta(META_PURGED, ErrorSubject::Logs)?;
        let last = match self
            .db
            .last()
            .map_err(|e| io_err(ErrorSubject::Logs, ErrorVerb::Read, e))?
        {
            Some((_, b)) => Some(decode::<Entry<TypeConfig>>(&b, ErrorSubject::Logs)?.log_id),
            None => purged,
        };
        Ok(LogState {
            last_purged_log_id: purged,
            last_log_id: last,
        })
    }

    async fn get_log_reader(&mut self) -> Self::LogReader {
        self.clone()
    }

    async fn save_vote(&mut self, vote: &Vote<NodeId>) -> StoreResult<()> {
        let b = encode(vote, ErrorSubject::Vote)?;
        self.db
            .meta_put(META_VOTE, &b)
            .map_err(|e| io_err(ErrorSubject::Vote, ErrorVerb::Write, e))
    }

    async fn read_vote(&mut self) -> StoreResult<Option<Vote<NodeId>>> {
        self.meta(META_VOTE, ErrorSubject::Vote)
    }

    async fn save_committed(&mut self, committed: Option<LogId<NodeId>>) -> StoreResult<()> {
        let b = encode(&committed, ErrorSubject::Store)?;
        self.db
            .meta_put(META_COMMITTED, &b)
            .map_err(|e| io_err(ErrorSubject::Store, ErrorVerb::Write, e))
    }

    async fn read_committed(&mut self) -> StoreResult<Option<LogId<NodeId>>> {
        Ok(self
            .meta::<Option<LogId<NodeId>>>(META_COMMITTED, ErrorSubject::Store)?
            .flatten())
    }

    async fn append<I>(&mut self, entries: I, callback: LogFlushed<TypeConfig>) -> StoreResult<()>
    where
        I: IntoIterator<Item = Entry<TypeConfig>> + OptionalSend,
        I::IntoIter: OptionalSend,
    {
        let mut rows = Vec::new();
        let mut format = tether_storage::RAFT_LOG_FORMAT_OLDEST;
        for e in entries {
            format = format.max(log_format_of(&e));
            rows.push((e.log_id.index, encode(&e, ErrorSubject::Logs)?));
        }
        // The format first: a build that cannot read these entries refuses the log at start
        // instead of failing to decode them.
        let res = self
            .db
            .raise_format(format)
            .and_then(|()| self.db.append(rows.iter().map(|(i, b)| (*i, b.as_slice()))));
        match res {
            Ok(()) => {
                // Synced (RaftLogDb writes with sync = true): durable now.
                callback.log_io_completed(Ok(()));
                Ok(())
            }
            Err(e) => {
                callback.log_io_completed(Err(std::io::Error::other(e.to_string())));
                Err(io_err(ErrorSubject::Logs, ErrorVerb::Write, e))
            }
        }
    }

    async fn truncate(&mut self, log_id: LogId<NodeId>) -> StoreResult<()> {
        self.db
            .truncate_from(log_id.index)
            .map_err(|e| io_err(ErrorSubject::Logs, ErrorVerb::Delete, e))
    }

    async fn purge(&mut self, log_id: LogId<NodeId>) -> StoreResult<()> {
        let b = encode(&Some(log_id), ErrorSubject::Logs)?;
        self.db
            .purge_through(log_id.index, &b)
            .map_err(|e| io_err(ErrorSubject::Logs, ErrorVerb::Delete, e))
    }
}

/// What the state machine holds: the metadata plus what openraft needs to know about it.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct Applied {
    pub last_applied: Option<LogId<NodeId>>,
    pub membership: StoredMembership<NodeId, PeerNode>,
    pub state: MetaState,
}

/// A persisted snapshot: its openraft metadata and the encoded [`Applied`].
#[derive(Serialize, Deserialize)]
struct StoredSnapshot {
    meta: SnapshotMeta<NodeId, PeerNode>,
    #[serde(with = "serde_bytes")]
    data: Vec<u8>,
}

/// The metadata state machine. The [`Applied`] state is shared (read by the node to route
/// clients and run queues); only openraft writes it.
#[derive(Clone)]
pub struct StateMachine {
    db: Arc<RaftLogDb>,
    applied: Arc<RwLock<Applied>>,
    /// The members as the applied membership says (the configured ones before the group has
    /// one), sent again whenever an applied membership changes them.
    members: Arc<watch::Sender<Arc<Members>>>,
    /// The members from this node's configuration: their addresses win over the membership's.
    configured: Arc<Members>,
}

impl StateMachine {
    /// The state machine as of the last stored snapshot (or empty).
    pub fn open(db: Arc<RaftLogDb>, configured: Members) -> Result<Self, super::ClusterError> {
        let applied = match db.meta_get(META_SNAPSHOT)? {
            None => Applied::default(),
            Some(b) => {
                let snap: StoredSnapshot = codec::decode_body(&b)?;
                codec::decode_body(&snap.data)?
            }
        };
        let configured = Arc::new(configured);
        let members = Members::effective(applied.membership.membership(), &configured);
        Ok(StateMachine {
            db,
            applied: Arc::new(RwLock::new(applied)),
            members: Arc::new(watch::channel(members).0),
            configured,
        })
    }

    /// The members, kept current as memberships are applied.
    pub fn members(&self) -> watch::Receiver<Arc<Members>> {
        self.members.subscribe()
    }

    /// Sends the members of `membership` if they differ from the last sent.
    fn publish_members(&self, membership: &openraft::Membership<NodeId, PeerNode>) {
        let next = Members::effective(membership, &self.configured);
        self.members.send_if_modified(|cur| {
            let changed = cur.nodes != next.nodes;
            if changed {
                *cur = next;
            }
            changed
        });
    }

    /// The shared, applied state.
    pub fn applied(&self) -> Arc<RwLock<Applied>> {
        Arc::clone(&self.applied)
    }

    fn snapshot_now(&self) -> StoreResult<Snapshot<TypeConfig>> {
        let (data, last_applied, membership, version) = {
            let a = self.applied.read().expect("metadata lock poisoned");
            (
                encode(&*a, ErrorSubject::StateMachine)?,
                a.last_applied,
                a.membership.clone(),
                a.state.version_needed(),
            )
        };
        let snapshot_id = match last_applied {
            Some(l) => format!("{}-{}", l.leader_id, l.index),
            None => "empty".to_string(),
        };
        let meta = SnapshotMeta {
            last_log_id: last_applied,
            last_membership: membership,
            snapshot_id,
        };
        self.persist(&meta, &data, version)?;
        Ok(Snapshot {
            meta,
            snapshot: Box::new(Cursor::new(data)),
        })
    }

    /// Stores a snapshot of metadata of peer protocol version `version` (raising the log's
    /// format first when it needs to).
    fn persist(
        &self,
        meta: &SnapshotMeta<NodeId, PeerNode>,
        data: &[u8],
        version: u32,
    ) -> StoreResult<()> {
        let stored = StoredSnapshot {
            meta: meta.clone(),
            data: data.to_vec(),
        };
        let b = encode(&stored, ErrorSubject::Snapshot(Some(meta.signature())))?;
        let db = &self.db;
        let res = db
            .raise_format(log_format_for(version))
            .and_then(|()| db.meta_put(META_SNAPSHOT, &b));
        res.map_err(|e| {
            io_err(
                ErrorSubject::Snapshot(Some(meta.signature())),
                ErrorVerb::Write,
                e,
            )
        })
    }
}

impl RaftSnapshotBuilder<TypeConfig> for StateMachine {
    async fn build_snapshot(&mut self) -> StoreResult<Snapshot<TypeConfig>> {
        self.snapshot_now()
    }
}

impl RaftStateMachine<TypeConfig> for StateMachine {
    type SnapshotBuilder = StateMachine;

    async fn applied_state(
        &mut self,
    ) -> StoreResult<(Option<LogId<NodeId>>, StoredMembership<NodeId, PeerNode>)> {
        let a = self.applied.read().expect("metadata lock poisoned");
        Ok((a.last_applied, a.membership.clone()))
    }

    async fn apply<I>(&mut self, entries: I) -> StoreResult<Vec<MetaResponse>>
    where
        I: IntoIterator<Item = Entry<TypeConfig>> + OptionalSend,
        I::IntoIter: OptionalSend,
    {
        let mut a = self.applied.write().expect("metadata lock poisoned");
        let mut out = Vec::new();
        let mut membership_changed = false;
        for e in entries {
            a.last_applied = Some(e.log_id);
            let r = match &e.payload {
                EntryPayload::Blank => MetaResponse::None,
                EntryPayload::Normal(cmd) => a.state.apply(e.log_id.index, cmd),
                EntryPayload::Membership(m) => {
                    // A member no longer in the group is forgotten by the metadata in the
                    // same step (its copies dropped, its queues promoted), on every node.
                    let before: BTreeSet<NodeId> = a
                        .membership
                        .membership()
                        .nodes()
                        .map(|(id, _)| *id)
                        .collect();
                    let gone: Vec<NodeId> = before
                        .into_iter()
                        .filter(|id| m.get_node(id).is_none())
                        .collect();
                    let forgotten = a.state.forget_members(e.log_id.index, &gone);
                    a.membership = StoredMembership::new(Some(e.log_id), m.clone());
                    membership_changed = true;
                    forgotten
                }
            };
            out.push(r);
        }
        if membership_changed {
            self.publish_members(a.membership.membership());
        }
        Ok(out)
    }

    async fn get_snapshot_builder(&mut self) -> Self::SnapshotBuilder {
        self.clone()
    }

    async fn begin_receiving_snapshot(&mut self) -> StoreResult<Box<Cursor<Vec<u8>>>> {
        Ok(Box::new(Cursor::new(Vec::new())))
    }

    async fn install_snapshot(
        &mut self,
        meta: &SnapshotMeta<NodeId, PeerNode>,
        snapshot: Box<Cursor<Vec<u8>>>,
    ) -> StoreResult<()> {
        let data = snapshot.into_inner();
        let mut applied: Applied = decode(&data, ErrorSubject::Snapshot(Some(meta.signature())))?;
        applied.last_applied = meta.last_log_id;
        applied.membership = meta.last_membership.clone();
        self.persist(meta, &data, applied.state.version_needed())?;
        let membership = applied.membership.membership().clone();
        *self.applied.write().expect("metadata lock poisoned") = applied;
        self.publish_members(&membership);
        Ok(())
    }

    async fn get_current_snapshot(&mut self) -> StoreResult<Option<Snapshot<TypeConfig>>> {
        let Some(b) = self
            .db
            .meta_get(META_SNAPSHOT)
            .map_err(|e| io_err(ErrorSubject::Snapshot(None), ErrorVerb::Read, e))?
        else {
            return Ok(None);
        };
        let snap: StoredSnapshot = decode(&b, ErrorSubject::Snapshot(None))?;
        Ok(Some(Snapshot {
            meta: snap.meta,
            snapshot: Box::new(Cursor::new(snap.data)),
        }))
    }
}
