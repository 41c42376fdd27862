//! The primary side: ships one queue's log to its secondaries.

use std::collections::{BTreeMap, VecDeque};

use super::{
    AppendHeader, BATCH_ENTRIES_MAX, BATCHES_IN_FLIGHT_PER_PEER_MAX, Epoch, HEARTBEAT_MS, LogState,
    NodeId, Offset, RETRANSMIT_MS, Reply, SNAPSHOT_RETRANSMIT_MS, SnapshotHeader, ToSecondary,
    Transmit,
};

/// Tunables of a [`Shipper`]; [`Default`] takes the module's named constants.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ShipperConfig {
    /// Entries in one append batch ([`BATCH_ENTRIES_MAX`]).
    pub batch_entries_max: u64,
    /// Batches on the wire to one confirmed secondary ([`BATCHES_IN_FLIGHT_PER_PEER_MAX`]). A
    /// secondary not yet confirmed in this epoch gets one at a time.
    pub batches_in_flight_per_peer_max: usize,
    /// Retransmit timeout of an append batch, in milliseconds ([`RETRANSMIT_MS`]).
    pub retransmit_ms: u64,
    /// Retransmit timeout of a snapshot, in milliseconds ([`SNAPSHOT_RETRANSMIT_MS`]).
    pub snapshot_retransmit_ms: u64,
    /// Quiet time before a heartbeat on an idle link, in milliseconds ([`HEARTBEAT_MS`]).
    pub heartbeat_ms: u64,
}

impl Default for ShipperConfig {
    fn default() -> Self {
        ShipperConfig {
            batch_entries_max: BATCH_ENTRIES_MAX,
            batches_in_flight_per_peer_max: BATCHES_IN_FLIGHT_PER_PEER_MAX,
            retransmit_ms: RETRANSMIT_MS,
            snapshot_retransmit_ms: SNAPSHOT_RETRANSMIT_MS,
            heartbeat_ms: HEARTBEAT_MS,
        }
    }
}

/// The primary's replication state machine for one queue.
///
/// Inputs: [`on_local_append`](Self::on_local_append), [`on_local_trim`](Self::on_local_trim),
/// [`on_client_ack`](Self::on_client_ack) (the local log and its ack, as the queue core changes
/// them), [`set_secondaries`](Self::set_secondaries) (cluster metadata),
/// [`on_reply`](Self::on_reply), [`on_peer_lost`](Self::on_peer_lost),
/// [`on_rival_primary`](Self::on_rival_primary) (the network) and [`on_tick`](Self::on_tick) (the
/// time). Outputs: [`poll_transmit`](Self::poll_transmit) until it returns `None`, after every
/// input, and [`poll_timeout`](Self::poll_timeout) for when to call `on_tick` next.
///
/// Per secondary it keeps a pipeline: `next` (the next offset to send), `matched` (the end the
/// secondary has durably acknowledged in this epoch, `None` until its first ack), and up to
/// [`ShipperConfig::batches_in_flight_per_peer_max`] unanswered batches. A new secondary is
/// probed with an empty append at the log end; a [`Reply::Mismatch`] moves `next` back to its
/// hint; a hint below `start` turns into a snapshot. A timeout or a lost connection restarts the
/// pipeline from `matched`.
#[derive(Debug)]
pub struct Shipper {
    config: ShipperConfig,
    epoch: Epoch,
    log: LogState,
    acked: Offset,
    replicated_end: Offset,
    /// The log end when this shipper was created. Earlier lives of the queue (other primaries,
    /// or this node before a restart) may have exposed entries up to here, above `acked`.
    inherited_end: Offset,
    fenced: Option<Epoch>,
    peers: BTreeMap<NodeId, Peer>,
    next_batch: u64,
    /// The peer served last by `poll_transmit`, so that peers take turns.
    last_served: Option<NodeId>,
}

#[derive(Debug)]
struct Peer {
    next: Offset,
    matched: Option<Offset>,
    in_flight: VecDeque<InFlight>,
    last_send_ms: Option<u64>,
    acked_sent: Offset,
    /// The queue's metadata changed since the last message to this peer: send one soon, even
    /// with no entries (see [`Shipper::on_metadata_change`]).
    metadata_due: bool,
    /// Pipeline restarts so far (see [`Shipper::pipeline`]).
    restarts: u64,
    /// The peer answered, in this epoch, with a log end below what it had acknowledged: it lost
    /// entries it held durably (its copy was dropped and started again). It no longer counts as
    /// in sync, and the driver must take it out of the replica set (see
    /// [`Shipper::regressed_peers`]).
    regressed: bool,
}

#[derive(Clone, Copy, Debug)]
struct InFlight {
    batch: u64,
    /// `next` before this batch was sent: where a pipeline restart resumes if nothing is matched.
    resume: Offset,
    last: Offset,
    sent_ms: u64,
    snapshot: bool,
}

impl Shipper {
    /// A primary at `epoch` over its durable local log `log`, with the client's `acked`, and no
    /// secondaries yet (call [`set_secondaries`](Self::set_secondaries)).
    ///
    /// `replicated_end` starts at `acked`: what lies below it is consumed, so no secondary can
    /// lack anything that matters there. Use this at queue creation (empty log), when a primary
    /// restarts, and through [`Replica::promote`](super::Replica::promote).
    ///
    /// # Panics
    /// If `epoch` is 0, is below the epoch of the log's last entry, or `acked` is outside
    /// `[log.start, log.end]` (caller bugs: the values come from this module or metadata).
    pub fn new(epoch: Epoch, log: LogState, acked: Offset, config: ShipperConfig) -> Self {
        assert!(epoch > 0, "epoch 0 is reserved");
        assert!(
            log.last_epoch().is_none_or(|e| e <= epoch),
            "log has entries from a later epoch"
        );
        assert!(
            log.start() <= acked && acked <= log.end(),
            "acked outside the log"
        );
        assert!(config.batch_entries_max > 0 && config.batches_in_flight_per_peer_max > 0);
        Shipper {
            config,
            epoch,
            replicated_end: acked,
            inherited_end: log.end(),
            acked,
            log,
            fenced: None,
            peers: BTreeMap::new(),
            next_batch: 0,
            last_served: None,
        }
    }

    /// This primary's epoch.
    pub fn epoch(&self) -> Epoch {
        self.epoch
    }

    /// The local log as the shipper knows it.
    pub fn log(&self) -> &LogState {
        &self.log
    }

    /// The client's cumulative ack.
    pub fn acked(&self) -> Offset {
        self.acked
    }

    /// The delivery high-watermark: every current secondary holds the entries below it durably
    /// (equal to the log end when there are no secondaries). Never decreases.
    pub fn replicated_end(&self) -> Offset {
        self.replicated_end
    }

    /// `Some(epoch)` once a peer showed a higher epoch: this node was deposed and must stop
    /// appending and delivering. The shipper then sends nothing more; the node should rebuild
    /// itself as a [`Replica`](super::Replica) from its durable state when metadata says so.
    pub fn fenced(&self) -> Option<Epoch> {
        self.fenced
    }

    /// The current secondaries, in ascending order.
    pub fn secondaries(&self) -> impl Iterator<Item = NodeId> + '_ {
        self.peers.keys().copied()
    }

    /// Entries between the local end and what `peer` has durably acknowledged in this epoch
    /// (the whole log if it has not acknowledged yet); `None` if `peer` is not a secondary.
    pub fn peer_lag(&self, peer: NodeId) -> Option<u64> {
        let p = self.peers.get(&peer)?;
        Some(self.log.end() - p.matched.unwrap_or(0))
    }

    /// Whether `peer` is known to hold everything any primary of this queue may have exposed:
    /// it has acknowledged, in this epoch, both `replicated_end` and the log end this shipper
    /// started with (earlier primaries may have exposed entries up to there, while this
    /// shipper's `replicated_end` starts at `acked`).
    ///
    /// Metadata may promote only a secondary that is in sync, or that was in sync with the
    /// previous primary and has not lost its disk since: a secondary added to a running primary
    /// counts towards `replicated_end` from then on but lacks what was exposed before.
    pub fn peer_in_sync(&self, peer: NodeId) -> bool {
        let needed = self.replicated_end.max(self.inherited_end);
        self.peers
            .get(&peer)
            .and_then(|p| p.matched)
            .is_some_and(|m| m >= needed)
    }

    /// Secondaries that lost entries they had acknowledged in this epoch (a Mismatch whose hint
    /// lies below what they acknowledged). Metadata still counts them as holding the queue
    /// (promotable), which is no longer true: the driver takes each one out of the replica set,
    /// so that it joins again as `syncing`. `replicated_end` is kept (entries below it were
    /// delivered and every other secondary holds them); the peer counts as holding nothing
    /// until it acknowledges again.
    pub fn regressed_peers(&self) -> impl Iterator<Item = NodeId> + '_ {
        self.peers
            .iter()
            .filter(|(_, p)| p.regressed)
            .map(|(&id, _)| id)
    }

    /// Sets the replica set from cluster metadata. Removed secondaries are forgotten; added ones
    /// start with a probe at the log end.
    pub fn set_secondaries(&mut self, secondaries: &[NodeId], _now_ms: u64) {
        self.peers.retain(|id, _| secondaries.contains(id));
        for &id in secondaries {
            self.peers.entry(id).or_insert_with(|| Peer {
                next: self.log.end(),
                matched: None,
                in_flight: VecDeque::new(),
                last_send_ms: None,
                acked_sent: 0,
                metadata_due: false,
                restarts: 0,
                regressed: false,
            });
        }
        self.update_replicated_end();
    }

    /// The local log grew to `new_end`, durably, with entries of this epoch.
    ///
    /// # Panics
    /// If `new_end` is below the current end (a caller bug).
    pub fn on_local_append(&mut self, new_end: Offset) {
        self.log.append(self.epoch, new_end);
        self.update_replicated_end();
    }

    /// The local log's entries below `new_start` were deleted.
    ///
    /// # Panics
    /// If `new_start > acked` (a caller bug: only consumed entries may be trimmed).
    pub fn on_local_trim(&mut self, new_start: Offset) {
        assert!(new_start <= self.acked, "trim beyond acked");
        self.log.trim(new_start);
    }

    /// The client acknowledged everything below `acked`. The ack never goes backwards, and is
    /// capped at `replicated_end`, so that every in-sync secondary (hence every future primary)
    /// holds the log up to `acked` and never reuses an offset the client has consumed.
    ///
    /// A client only receives entries below `replicated_end`, so the cap only bites after a
    /// failover, when a reconnecting client re-sends a cursor beyond what the new primary has
    /// replicated yet; the client's periodic cumulative acks then apply it as replication catches
    /// up.
    pub fn on_client_ack(&mut self, acked: Offset) {
        self.acked = self.acked.max(acked.min(self.replicated_end));
    }

    /// A secondary answered.
    pub fn on_reply(&mut self, from: NodeId, reply: Reply, _now_ms: u64) {
        let epoch = reply.epoch();
        if epoch > self.epoch {
            self.fenced = self.fenced.max(Some(epoch));
            return;
        }
        if epoch < self.epoch {
            return; // From an earlier life of this queue; say nothing about this epoch.
        }
        let log_end = self.log.end();
        let Some(peer) = self.peers.get_mut(&from) else {
            return;
        };
        match reply {
            Reply::Ack { end, .. } => {
                if end > log_end {
                    return; // Not an answer to anything we sent.
                }
                let matched = peer.matched.unwrap_or(0).max(end);
                peer.matched = Some(matched);
                while peer.in_flight.front().is_some_and(|f| f.last <= matched) {
                    peer.in_flight.pop_front();
                }
                peer.next = peer.next.max(matched);
                self.update_replicated_end();
            }
            Reply::Mismatch {
                end_hint, batch, ..
            } => {
                // Only an answer to a batch still on the wire restarts the pipeline: replies to
                // batches of an earlier pipeline are stale.
                if peer.in_flight.iter().any(|f| f.batch == batch) {
                    peer.in_flight.clear();
                    peer.next = end_hint.min(log_end);
                    // A copy's end never falls below what it acknowledged in this epoch (acks
                    // are durable, truncation stops at acknowledged entries): this one lost its
                    // log. What it acknowledged no longer says anything about what it holds.
                    if peer.matched.is_some_and(|m| end_hint < m) {
                        peer.matched = None;
                        peer.regressed = true;
                    }
                }
            }
            Reply::Fenced { .. } => {} // Same epoch: meaningless.
        }
    }

    /// Another node sent this node an append or snapshot as primary of `epoch`. Returns the
    /// reply to send to it: [`Reply::Fenced`] if `epoch` is older than ours. A newer `epoch`
    /// fences this shipper instead.
    pub fn on_rival_primary(&mut self, epoch: Epoch) -> Option<Reply> {
        if epoch < self.epoch {
            return Some(Reply::Fenced { epoch: self.epoch });
        }
        if epoch > self.epoch {
            self.fenced = self.fenced.max(Some(epoch));
        }
        None
    }

    /// The queue's metadata (its durable interest) changed: every secondary gets a message soon,
    /// with no entries if there are none to send, so the driver can attach the new metadata
    /// (and learn from the replies when every copy holds it).
    pub fn on_metadata_change(&mut self) {
        for p in self.peers.values_mut() {
            p.metadata_due = true;
        }
    }

    /// The pipeline generation of `peer`: it changes whenever the pipeline restarts (a lost
    /// connection, a retransmit timeout), after which every message polled before is superseded
    /// by what [`poll_transmit`](Self::poll_transmit) sends again. A driver that queues messages
    /// may drop the superseded ones instead of sending them. `None` for an unknown peer.
    pub fn pipeline(&self, peer: NodeId) -> Option<u64> {
        self.peers.get(&peer).map(|p| p.restarts)
    }

    /// The connection to `peer` dropped: what was on the wire is lost, restart its pipeline.
    pub fn on_peer_lost(&mut self, peer: NodeId) {
        if let Some(p) = self.peers.get_mut(&peer) {
            p.restart();
        }
    }

    /// The time passed: restarts the pipeline of every peer whose oldest unanswered message has
    /// waited for its retransmit timeout.
    pub fn on_tick(&mut self, now_ms: u64) {
        let config = self.config;
        for peer in self.peers.values_mut() {
            if let Some(front) = peer.in_flight.front() {
                let timeout_ms = if front.snapshot {
                    config.snapshot_retransmit_ms
                } else {
                    config.retransmit_ms
                };
                if now_ms >= front.sent_ms.saturating_add(timeout_ms) {
                    peer.restart();
                }
            }
        }
    }

    /// The earliest time at which [`on_tick`](Self::on_tick) or a heartbeat from
    /// [`poll_transmit`](Self::poll_transmit) has something to do.
    pub fn poll_timeout(&self) -> Option<u64> {
        if self.fenced.is_some() {
            return None;
        }
        self.peers
            .values()
            .map(|p| match p.in_flight.front() {
                Some(f) if f.snapshot => {
                    f.sent_ms.saturating_add(self.config.snapshot_retransmit_ms)
                }
                Some(f) => f.sent_ms.saturating_add(self.config.retransmit_ms),
                None if p.metadata_due => 0,
                None => p
                    .last_send_ms
                    .map_or(0, |t| t.saturating_add(self.config.heartbeat_ms)),
            })
            .min()
    }

    /// The next message to send, if any. Call until `None` after every input. Peers take turns.
    pub fn poll_transmit(&mut self, now_ms: u64) -> Option<Transmit<ToSecondary>> {
        if self.fenced.is_some() || self.peers.is_empty() {
            return None;
        }
        let after = self
            .last_served
            .map_or(NodeId(0), |id| NodeId(id.0.saturating_add(1)));
        let order: Vec<NodeId> = self
            .peers
            .range(after..)
            .chain(self.peers.range(..after))
            .map(|(&id, _)| id)
            .collect();
        for id in order {
            if let Some(message) = self.next_message(id, now_ms) {
                self.last_served = Some(id);
                return Some(Transmit { to: id, message });
            }
        }
        None
    }

    fn next_message(&mut self, id: NodeId, now_ms: u64) -> Option<ToSecondary> {
        let (epoch, acked, config) = (self.epoch, self.acked, self.config);
        let log = &self.log;
        let batch = self.next_batch;
        let peer = self.peers.get_mut(&id)?;
        let resume = peer.next;
        if peer.next < log.start() {
            if !peer.in_flight.is_empty() {
                return None;
            }
            let header = SnapshotHeader {
                epoch,
                batch,
                log: log.clone(),
                acked,
            };
            peer.sent(InFlight {
                batch,
                resume,
                last: log.end(),
                sent_ms: now_ms,
                snapshot: true,
            });
            self.next_batch += 1;
            return Some(ToSecondary::Snapshot(header));
        }
        let window = if peer.matched.is_some() {
            config.batches_in_flight_per_peer_max
        } else {
            1
        };
        if peer.in_flight.len() >= window {
            return None;
        }
        let first = peer.next;
        let last = if first < log.end() {
            let run_end = log.run_end(first).expect("start <= first < end is covered");
            log.end()
                .min(run_end)
                .min(first.saturating_add(config.batch_entries_max))
        } else {
            let quiet = peer
                .last_send_ms
                .is_none_or(|t| now_ms >= t + config.heartbeat_ms);
            let due =
                peer.matched.is_none() || acked > peer.acked_sent || quiet || peer.metadata_due;
            if !peer.in_flight.is_empty() || !due {
                return None;
            }
            first
        };
        let prev_epoch = match first {
            0 => None,
            _ => Some(
                log.epoch_at(first - 1)
                    .expect("start - 1 <= first - 1 < end is covered"),
            ),
        };
        let entries_epoch = if first < last {
            log.epoch_at(first).unwrap_or(epoch)
        } else {
            epoch
        };
        let header = AppendHeader {
            epoch,
            batch,
            first,
            last,
            prev_epoch,
            entries_epoch,
            log_end: log.end(),
            acked,
        };
        peer.next = last;
        peer.acked_sent = acked;
        peer.sent(InFlight {
            batch,
            resume,
            last,
            sent_ms: now_ms,
            snapshot: false,
        });
        self.next_batch += 1;
        Some(ToSecondary::Append(header))
    }

    fn update_replicated_end(&mut self) {
        let lowest_peer = self.peers.values().map(|p| p.matched.unwrap_or(0)).min();
        let candidate = lowest_peer.map_or(self.log.end(), |m| m.min(self.log.end()));
        self.replicated_end = self.replicated_end.max(candidate);
    }
}

impl Peer {
    fn sent(&mut self, in_flight: InFlight) {
        self.last_send_ms = Some(in_flight.sent_ms);
        self.metadata_due = false;
        self.in_flight.push_back(in_flight);
    }

    /// Forgets what is on the wire and resumes from what is known to be held.
    fn restart(&mut self) {
        if let Some(front) = self.in_flight.front() {
            self.next = self.matched.unwrap_or(front.resume);
        }
        self.in_flight.clear();
        self.restarts += 1;
    }
}
