//! Deterministic, seed-driven simulation of queue replication (issue #3).
//!
//! One thread, virtual time (one step = one millisecond), one seeded RNG. A primary and one or
//! two secondaries run the real [`Shipper`] and [`Replica`] cores; the simulated driver keeps
//! each node's durable store (entries with their payload ids and epochs), applies replica writes
//! lazily (so a crash loses what was not durable yet), and moves messages over a network that
//! delays, reorders, drops and duplicates them and is cut by partitions that heal. Nodes crash
//! and restart from their durable state; cluster metadata fails the primary over to a random
//! running in-sync secondary at a higher epoch, and a deposed primary that is still running must
//! learn that it is fenced from the messages it gets. Metadata also replaces secondaries by empty
//! nodes (a lost disk), which catch up by snapshot and become promotable once the primary reports
//! them in sync ([`Shipper::peer_in_sync`]).
//!
//! After the fault phase the network heals, crashed nodes restart and the workload stops; every
//! copy must then converge within `LIVENESS_STEPS_MAX`.
//!
//! Invariants, checked after every step (they draw nothing from the RNG):
//! 1. Log matching: entries two stores hold at the same offset with the same epoch are equal;
//!    every current secondary holds the current primary's entries below its `replicated_end`.
//! 2. No loss: every entry that was ever below any primary's `replicated_end` is in the current
//!    primary's store and in every store metadata may promote, or was trimmed below its `acked`.
//!    Every ack a replica sends is at most its durable end.
//! 3. `replicated_end` never falls during a shipper's life; `acked` never falls on a running copy
//!    nor in any store.
//! 4. Liveness, after the fault phase (see above); then the primary also holds its lease.
//! 5. At most one primary delivers at any instant: of the running, unfenced primaries, at most
//!    one holds its lease ([`Lease`], the server's own rule: every secondary acknowledged, in
//!    the primary's epoch, a message sent less than `LEASE_MS` ago; a promoted primary, and one
//!    restarted, waits `LEASE_MS` first). An ack counts from when the message it answers was
//!    sent (a reply carries the send time of the latest message the replica took from that
//!    primary). A failover drops the old primary from the replica set half the time, as the
//!    metadata's `NodeFailed` does, so the new primary does not wait for its ack.
//!
//! `TETHER_SIM_SEED=<n>` runs one seed, `TETHER_SIM_SEEDS=<count>` sets how many run.

mod sim;

use std::collections::{BTreeMap, BTreeSet, VecDeque};

use sim::{Entry, Envelope, Network, Payload, Rng, Store, apply, env_u64};
use tether::control::lease::Lease;
use tether::replication::{
    AppendHeader, Decision, Epoch, LogState, NodeId, Offset, Replica, Reply, Shipper,
    ShipperConfig, SnapshotHeader, ToSecondary, Write, WriteOp,
};

/// Seeds run by default.
const SEEDS_DEFAULT: u64 = 1_000;
/// Steps (milliseconds) of the fault phase.
const FAULT_STEPS: u64 = 3_000;
/// Steps the copies get to converge once faults stop.
const LIVENESS_STEPS_MAX: u64 = 20_000;

#[test]
fn replication_sim() {
    if let Some(seed) = env_u64("TETHER_SIM_SEED") {
        run_reporting(seed);
        return;
    }
    let seeds = env_u64("TETHER_SIM_SEEDS").unwrap_or(SEEDS_DEFAULT);
    let mut total = Stats::default();
    for seed in 0..seeds {
        total.add(&run_reporting(seed).1);
    }
    if std::env::var_os("TETHER_SIM_STATS").is_some() {
        eprintln!("{seeds} seeds: {total:?}");
    }
    // Coverage guard: a change that stops the simulation from reaching these paths must fail.
    if seeds >= SEEDS_DEFAULT {
        let reached = [
            ("failovers", total.failovers),
            ("fenced primaries demoted", total.demotions),
            ("crashes", total.crashes),
            ("snapshots installed", total.snapshots),
            ("truncating writes", total.truncations),
            ("mismatch replies", total.mismatches),
            ("fenced replies", total.fenced_replies),
            ("duplicates acked at once", total.duplicate_acks),
            ("appends to a deposed primary", total.stale_appends),
            ("replaced secondaries", total.replacements),
            (
                "old primaries dropped at a failover",
                total.dropped_primaries,
            ),
            (
                "a deposed primary holding its lease",
                total.deposed_lease_steps,
            ),
        ];
        for (what, count) in reached {
            assert!(count > 0, "the simulation never reached: {what}");
        }
    }
}

/// Pinned: with a restarted primary's lease starting at once (as the server's
/// `ensure_shipping` had it, `Lease::at_start(now, 0)` here), seed 790 fails invariant 5:
/// nodes 1 (the primary, epoch 3) and 2 both held their leases at step 3016, just after the
/// heal phase restarted the nodes that were down. A primary starting in a new process now
/// waits `LEASE_MS` from its start (`Lease::at_start(now, now)`), and the seed passes.
#[test]
fn a_primary_restarted_soon_after_a_failover_waits_out_the_old_lease() {
    run_reporting(790);
}

#[test]
fn replay_is_deterministic() {
    for seed in [1, 2, 3] {
        assert_eq!(run(seed), run(seed), "seed {seed} replayed differently");
    }
}

fn run_reporting(seed: u64) -> (u64, Stats) {
    let replay = format!("TETHER_SIM_SEED={seed} cargo test --release --test replication_sim");
    sim::run_reporting("replication sim", seed, &replay, || run(seed))
}

/// Runs one seed; returns a fingerprint of everything that happened and what it exercised.
fn run(seed: u64) -> (u64, Stats) {
    sim::run(World::new(seed), FAULT_STEPS, LIVENESS_STEPS_MAX)
}

impl sim::World for World {
    type Stats = Stats;

    fn step(&mut self, faults: bool) {
        self.faults = faults;
        self.now += 1;
        self.deliver_due();
        self.record_committed();
        if faults {
            self.workload_and_faults();
        } else if self.rng.per_mille(50) {
            // The client re-sends its cumulative ack periodically.
            self.client_ack(self.primary.0 as usize);
        }
        self.flush_some();
        self.demote_fenced();
        self.tick_and_transmit();
        self.record_committed();
        self.learn_in_sync();
        self.check_invariants();
    }

    fn heal_all(&mut self) {
        self.faults = false;
        self.cut.clear();
        for id in self.members.clone() {
            if matches!(self.nodes[id.0 as usize].role, Role::Down) {
                self.restart(id);
            }
        }
        // The client reconnects to the primary and re-sends its cursor.
        self.client_ack(self.primary.0 as usize);
    }

    fn converged(&self) -> bool {
        let Role::Primary(s) = &self.nodes[self.primary.0 as usize].role else {
            return false;
        };
        let primary = &self.nodes[self.primary.0 as usize];
        let pstore = &primary.store;
        if s.replicated_end() != s.log().end() || !primary.lease.held(self.now, s.secondaries()) {
            return false;
        }
        self.secondaries_of(self.primary).into_iter().all(|id| {
            let n = &self.nodes[id.0 as usize];
            let Role::Secondary(r) = &n.role else {
                return false;
            };
            let store = &n.store;
            n.pending.is_empty()
                && r.epoch() == self.epoch
                && r.acked() == s.acked()
                && store.log.end() == pstore.log.end()
                && (store.log.start().max(pstore.log.start())..pstore.log.end())
                    .all(|o| store.get(o) == pstore.get(o))
        })
    }

    fn describe(&self) -> String {
        let mut out = format!(
            "seed {} epoch {} primary {} {:?}",
            self.seed, self.epoch, self.primary, self.opts
        );
        for n in &self.nodes {
            let role = match &n.role {
                Role::Down => "down".to_string(),
                Role::Primary(s) => format!(
                    "primary e{} acked {} replicated_end {} fenced {:?} {s:?}",
                    s.epoch(),
                    s.acked(),
                    s.replicated_end(),
                    s.fenced()
                ),
                Role::Secondary(r) => format!(
                    "replica e{} acked {} log {:?}",
                    r.epoch(),
                    r.acked(),
                    r.log()
                ),
            };
            out += &format!(
                "\n  node {}: {role}; store {:?} acked {}",
                n.id, n.store.log, n.store.acked
            );
        }
        out
    }

    fn finish(mut self, liveness_steps: u64) -> (u64, Stats) {
        self.stats.liveness_steps_max = liveness_steps;
        (self.trace, self.stats)
    }
}

/// What a run exercised.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
struct Stats {
    failovers: u64,
    demotions: u64,
    crashes: u64,
    snapshots: u64,
    truncations: u64,
    mismatches: u64,
    fenced_replies: u64,
    duplicate_acks: u64,
    stale_appends: u64,
    replacements: u64,
    committed: u64,
    liveness_steps_max: u64,
    /// Failovers that dropped the old primary from the replica set.
    dropped_primaries: u64,
    /// Steps in which a running, unfenced primary other than the current one held its lease.
    deposed_lease_steps: u64,
}

impl Stats {
    fn add(&mut self, o: &Stats) {
        self.failovers += o.failovers;
        self.demotions += o.demotions;
        self.crashes += o.crashes;
        self.snapshots += o.snapshots;
        self.truncations += o.truncations;
        self.mismatches += o.mismatches;
        self.fenced_replies += o.fenced_replies;
        self.duplicate_acks += o.duplicate_acks;
        self.stale_appends += o.stale_appends;
        self.replacements += o.replacements;
        self.committed += o.committed;
        self.dropped_primaries += o.dropped_primaries;
        self.deposed_lease_steps += o.deposed_lease_steps;
        self.liveness_steps_max = self.liveness_steps_max.max(o.liveness_steps_max);
    }
}

// ---------------------------------------------------------------------------------------------
// Randomness and knobs.

/// Fault and workload knobs of one run, drawn from the seed.
#[derive(Debug)]
struct Options {
    secondaries: usize,
    delay_ms_max: u64,
    drop_per_mille: u64,
    duplicate_per_mille: u64,
    append_per_mille: u64,
    ack_per_mille: u64,
    trim_per_mille: u64,
    crash_per_mille: u64,
    restart_per_mille: u64,
    partition_per_mille: u64,
    heal_per_mille: u64,
    failover_per_mille: u64,
    replace_per_mille: u64,
    flush_per_mille: u64,
    shipper: ShipperConfig,
}

impl Options {
    fn draw(rng: &mut Rng) -> Self {
        Options {
            secondaries: if rng.below(3) == 0 { 1 } else { 2 },
            delay_ms_max: rng.between(1, 20),
            drop_per_mille: rng.below(60),
            duplicate_per_mille: rng.below(60),
            append_per_mille: rng.between(20, 150),
            ack_per_mille: rng.between(20, 150),
            trim_per_mille: rng.between(5, 50),
            crash_per_mille: rng.below(4),
            restart_per_mille: rng.between(2, 20),
            partition_per_mille: rng.below(4),
            heal_per_mille: rng.between(2, 10),
            failover_per_mille: rng.below(3),
            replace_per_mille: rng.below(2),
            flush_per_mille: rng.between(100, 900),
            shipper: ShipperConfig {
                batch_entries_max: rng.between(2, 16),
                batches_in_flight_per_peer_max: rng.between(1, 4) as usize,
                retransmit_ms: rng.between(40, 150),
                snapshot_retransmit_ms: rng.between(150, 400),
                heartbeat_ms: rng.between(10, 30),
            },
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Nodes, stores and the network.

enum Role {
    Down,
    Primary(Box<Shipper>),
    Secondary(Box<Replica>),
}

struct Node {
    id: NodeId,
    role: Role,
    store: Store,
    /// Replica writes issued but not durable, with the entries they write.
    pending: VecDeque<(Write, Vec<Entry>)>,
    /// `replicated_end` of the running shipper when last checked (reset with each new shipper).
    last_replicated_end: Offset,
    /// `acked` of the running core when last checked (reset at each restart).
    last_acked: Offset,
    /// Highest `acked` this node's store ever held.
    store_acked_max: Offset,
    /// Its lease while it is a primary.
    lease: Lease,
    /// Per primary: when the latest message this replica took from it was sent.
    taken_sent_at: BTreeMap<NodeId, u64>,
}

impl Node {
    fn new(id: NodeId, role: Role) -> Self {
        Node {
            id,
            role,
            store: Store::default(),
            pending: VecDeque::new(),
            last_replicated_end: 0,
            last_acked: 0,
            store_acked_max: 0,
            lease: Lease::at_start(0, 0),
            taken_sent_at: BTreeMap::new(),
        }
    }
}

#[derive(Clone)]
enum Msg {
    Append(AppendHeader, Vec<Entry>),
    Snapshot(SnapshotHeader, Vec<Entry>),
    /// A reply, with the send time of the latest message the replica took from the primary.
    Reply(Reply, u64),
}

struct World {
    seed: u64,
    rng: Rng,
    opts: Options,
    now: u64,
    nodes: Vec<Node>,
    /// The primary according to cluster metadata, and its epoch.
    primary: NodeId,
    epoch: Epoch,
    /// The replica set according to metadata (the primary included); replaced nodes leave it.
    members: Vec<NodeId>,
    /// Members metadata may promote: initial ones, and those the primary reported in sync.
    in_sync: BTreeSet<NodeId>,
    net: Network<Msg>,
    /// Links cut by a partition, as (lower id, higher id).
    cut: BTreeSet<(NodeId, NodeId)>,
    faults: bool,
    next_payload: Payload,
    /// The client's cursor: the highest ack it ever sent.
    client_acked: Offset,
    /// Every entry ever exposed below a `replicated_end`, by offset.
    committed: BTreeMap<Offset, Entry>,
    trace: u64,
    stats: Stats,
}

impl World {
    fn new(seed: u64) -> Self {
        let mut rng = Rng(seed ^ 0x7e7e_u64.rotate_left(40));
        let opts = Options::draw(&mut rng);
        let count = 1 + opts.secondaries as u64;
        let mut nodes: Vec<Node> = (0..count)
            .map(|id| Node::new(NodeId(id), Role::Secondary(Box::new(Replica::new()))))
            .collect();
        let mut shipper = Shipper::new(1, LogState::empty(), 0, opts.shipper);
        shipper.set_secondaries(&(1..count).map(NodeId).collect::<Vec<_>>(), 0);
        nodes[0].role = Role::Primary(Box::new(shipper));
        nodes[0].store.epoch = 1;
        World {
            seed,
            rng,
            opts,
            now: 0,
            nodes,
            primary: NodeId(0),
            epoch: 1,
            members: (0..count).map(NodeId).collect(),
            in_sync: (0..count).map(NodeId).collect(),
            net: Network::default(),
            cut: BTreeSet::new(),
            faults: true,
            next_payload: 1,
            client_acked: 0,
            committed: BTreeMap::new(),
            trace: seed,
            stats: Stats::default(),
        }
    }

    fn note(&mut self, event: u64) {
        self.trace = (self.trace ^ event)
            .wrapping_mul(0x0100_0000_01b3)
            .rotate_left(7);
    }

    // -- the network --------------------------------------------------------------------------

    fn send(&mut self, from: NodeId, to: NodeId, msg: Msg) {
        self.note(from.0 << 8 | to.0);
        if self.faults && self.rng.per_mille(self.opts.drop_per_mille) {
            return;
        }
        if self.faults && self.rng.per_mille(self.opts.duplicate_per_mille) {
            self.enqueue(from, to, msg.clone());
        }
        self.enqueue(from, to, msg);
    }

    fn enqueue(&mut self, from: NodeId, to: NodeId, msg: Msg) {
        let delay = self.rng.between(1, self.opts.delay_ms_max);
        let sent_at = self.now;
        let envelope = Envelope {
            from,
            to,
            sent_at,
            msg,
        };
        self.net.push(self.now + delay, envelope);
    }

    fn linked(&self, a: NodeId, b: NodeId) -> bool {
        !self.cut.contains(&(a.min(b), a.max(b)))
    }

    fn deliver_due(&mut self) {
        while let Some((seq, env)) = self.net.pop_due(self.now) {
            if !self.linked(env.from, env.to) {
                continue;
            }
            self.note(seq);
            self.deliver(env);
        }
    }

    fn deliver(&mut self, env: Envelope<Msg>) {
        let now = self.now;
        let (from, to) = (env.from, env.to);
        let node = &mut self.nodes[to.0 as usize];
        let mut reply = None;
        if matches!(
            (&node.role, &env.msg),
            (Role::Secondary(_), Msg::Append(..) | Msg::Snapshot(..))
        ) {
            let t = node.taken_sent_at.entry(from).or_insert(env.sent_at);
            *t = (*t).max(env.sent_at);
        }
        match (&mut node.role, env.msg) {
            (Role::Down, _) => {}
            (Role::Primary(s), Msg::Reply(r, sent_at)) => {
                s.on_reply(from, r, now);
                // As the server does: an ack in the shipper's epoch keeps the lease.
                if matches!(r, Reply::Ack { epoch, .. } if epoch == s.epoch()) {
                    node.lease.acked(from, sent_at);
                }
            }
            (Role::Secondary(_), Msg::Reply(..)) => {} // To a primary since deposed.
            (Role::Primary(s), Msg::Append(h, _)) => reply = s.on_rival_primary(h.epoch),
            (Role::Primary(s), Msg::Snapshot(h, _)) => reply = s.on_rival_primary(h.epoch),
            (Role::Secondary(r), Msg::Append(h, entries)) => {
                assert_eq!(entries.len() as u64, h.last - h.first);
                assert!(
                    entries.iter().all(|e| e.epoch == h.entries_epoch),
                    "batch spans epochs"
                );
                match r.on_append(from, &h) {
                    Decision::Write(w) => {
                        let new = match &w.op {
                            WriteOp::Append {
                                skip, truncate_to, ..
                            } => {
                                self.stats.truncations += u64::from(truncate_to.is_some());
                                entries[*skip..].to_vec()
                            }
                            _ => unreachable!("appends write appends"),
                        };
                        node.pending.push_back((w, new));
                    }
                    Decision::Reply(r) => {
                        self.stats.duplicate_acks += u64::from(matches!(r, Reply::Ack { .. }));
                        reply = Some(r);
                    }
                    Decision::Ignore | Decision::Pending => {}
                }
            }
            (Role::Secondary(r), Msg::Snapshot(h, entries)) => match r.on_snapshot(from, &h) {
                Decision::Write(w) => {
                    let new = match &w.op {
                        WriteOp::Snapshot { .. } => {
                            self.stats.snapshots += 1;
                            entries
                        }
                        _ => Vec::new(),
                    };
                    node.pending.push_back((w, new));
                }
                Decision::Reply(r) => reply = Some(r),
                Decision::Ignore | Decision::Pending => {}
            },
        }
        if let Some(r) = reply {
            self.send_reply(to, from, r);
        }
    }

    fn send_reply(&mut self, from: NodeId, to: NodeId, reply: Reply) {
        match reply {
            Reply::Ack { .. } => {}
            Reply::Fenced { .. } => self.stats.fenced_replies += 1,
            Reply::Mismatch { .. } => self.stats.mismatches += 1,
        }
        if let Reply::Ack { end, .. } = reply {
            // Never ack what is not durable.
            let store = &self.nodes[from.0 as usize].store;
            assert!(
                end <= store.log.end(),
                "node {from} acked {end} beyond its durable end"
            );
        }
        let answering = self.nodes[from.0 as usize]
            .taken_sent_at
            .get(&to)
            .copied()
            .unwrap_or(0);
        self.send(from, to, Msg::Reply(reply, answering));
    }

    // -- the drivers --------------------------------------------------------------------------

    /// Makes some replica writes durable, in order, and sends the acks they release.
    fn flush_some(&mut self) {
        for id in 0..self.nodes.len() {
            if self.nodes[id].pending.is_empty() || !self.rng.per_mille(self.opts.flush_per_mille) {
                continue;
            }
            let count = self.rng.between(1, self.nodes[id].pending.len() as u64);
            let node = &mut self.nodes[id];
            let mut last = None;
            for _ in 0..count {
                let (w, entries) = node.pending.pop_front().expect("pending write");
                apply(&mut node.store, &w, entries, node.id);
                last = Some(w.id);
            }
            let Role::Secondary(r) = &mut node.role else {
                unreachable!("only replicas write")
            };
            let ack = r.on_durable(last.expect("flushed one"));
            if let Some(t) = ack {
                self.send_reply(NodeId(id as u64), t.to, t.message);
            }
        }
    }

    fn tick_and_transmit(&mut self) {
        let now = self.now;
        for id in 0..self.nodes.len() {
            let mut out = Vec::new();
            if let Role::Primary(s) = &mut self.nodes[id].role {
                s.on_tick(now);
                while let Some(t) = s.poll_transmit(now) {
                    out.push(t);
                }
            }
            for t in out {
                let store = &self.nodes[id].store;
                let msg = match t.message {
                    ToSecondary::Append(h) => Msg::Append(h, store.range(h.first, h.last)),
                    ToSecondary::Snapshot(h) => {
                        let entries = store.range(h.log.start(), h.log.end());
                        Msg::Snapshot(h, entries)
                    }
                };
                self.send(NodeId(id as u64), t.to, msg);
            }
        }
    }

    fn workload_and_faults(&mut self) {
        let p = self.primary.0 as usize;
        if self.rng.per_mille(self.opts.append_per_mille) {
            let count = self.rng.between(1, 3);
            self.append(p, count);
        }
        // A deposed primary that still runs may take appends from stale clients.
        if self.rng.per_mille(self.opts.append_per_mille / 4) {
            let stale = self.members.iter().map(|&m| m.0 as usize).find(|&i| {
                i != p && matches!(&self.nodes[i].role, Role::Primary(s) if s.fenced().is_none())
            });
            if let Some(i) = stale {
                self.stats.stale_appends += 1;
                self.append(i, 1);
            }
        }
        if self.rng.per_mille(self.opts.ack_per_mille) {
            self.client_ack(p);
        }
        if self.rng.per_mille(self.opts.trim_per_mille) {
            let i = self.random_member();
            self.trim(i.0 as usize);
        }
        if self.rng.per_mille(self.opts.crash_per_mille) {
            let i = self.random_member();
            self.crash(i);
        }
        if self.rng.per_mille(self.opts.restart_per_mille) {
            let i = self.random_member();
            if matches!(self.nodes[i.0 as usize].role, Role::Down) {
                self.restart(i);
            }
        }
        if self.rng.per_mille(self.opts.replace_per_mille) {
            self.replace();
        }
        if self.rng.per_mille(self.opts.partition_per_mille) {
            let a = self.random_member();
            for b in self.members.clone() {
                if b != a && self.rng.below(2) == 0 {
                    self.cut.insert((a.min(b), a.max(b)));
                    self.connection_lost(a);
                    self.connection_lost(b);
                }
            }
        }
        if self.rng.per_mille(self.opts.heal_per_mille) {
            self.cut.clear();
        }
        if self.rng.per_mille(self.opts.failover_per_mille) {
            self.failover();
        }
    }

    fn append(&mut self, i: usize, count: u64) {
        let node = &mut self.nodes[i];
        let Role::Primary(s) = &mut node.role else {
            return;
        };
        for _ in 0..count {
            node.store.entries.push_back(Entry {
                epoch: s.epoch(),
                payload: self.next_payload,
            });
            self.next_payload += 1;
        }
        s.on_local_append(s.log().end() + count);
        node.store.log = s.log().clone();
    }

    /// The client acknowledges up to a random point at most the primary's `replicated_end` (it
    /// received nothing beyond), or re-sends its cursor after a failover.
    fn client_ack(&mut self, i: usize) {
        let Role::Primary(s) = &mut self.nodes[i].role else {
            return;
        };
        let mut to = self.client_acked;
        if s.replicated_end() > s.acked() {
            to = to.max(self.rng.between(s.acked() + 1, s.replicated_end()));
        }
        s.on_client_ack(to);
        self.client_acked = self.client_acked.max(s.acked());
        self.nodes[i].store.acked = s.acked();
    }

    fn trim(&mut self, i: usize) {
        let node = &mut self.nodes[i];
        match &mut node.role {
            Role::Down => {}
            Role::Primary(s) => {
                if s.fenced().is_some() || s.acked() <= s.log().start() {
                    return;
                }
                let to = self.rng.between(s.log().start() + 1, s.acked());
                s.on_local_trim(to);
                let store = &mut node.store;
                store.entries.drain(..(to - store.log.start()) as usize);
                store.log = s.log().clone();
            }
            Role::Secondary(r) => {
                if r.acked() <= r.log().start() {
                    return;
                }
                let to = self.rng.between(r.log().start() + 1, r.acked());
                if let Some(w) = r.trim(to) {
                    node.pending.push_back((w, Vec::new()));
                }
            }
        }
    }

    fn crash(&mut self, id: NodeId) {
        let node = &mut self.nodes[id.0 as usize];
        node.role = Role::Down;
        node.pending.clear();
        self.stats.crashes += 1;
        self.note(0xdead_0000 | id.0);
        self.connection_lost(id);
    }

    /// Shippers notice that their connection to `peer` dropped (sometimes: a partition may look
    /// like a slow link for a while).
    fn connection_lost(&mut self, peer: NodeId) {
        for node in &mut self.nodes {
            if let Role::Primary(s) = &mut node.role
                && self.rng.below(2) == 0
            {
                s.on_peer_lost(peer);
            }
        }
    }

    /// Restarts a node from its store, in the role metadata gives it.
    fn restart(&mut self, id: NodeId) {
        self.note(0xbeef_0000 | id.0);
        let secondaries = self.secondaries_of(id);
        let node = &mut self.nodes[id.0 as usize];
        if id == self.primary {
            node.store.epoch = self.epoch;
            let store = &node.store;
            let mut s = Shipper::new(
                self.epoch,
                store.log.clone(),
                store.acked,
                self.opts.shipper,
            );
            s.set_secondaries(&secondaries, self.now);
            node.last_replicated_end = s.replicated_end();
            node.last_acked = s.acked();
            // The process starts now, as the server's `ensure_shipping` sees it.
            node.lease = Lease::at_start(self.now, self.now);
            node.role = Role::Primary(Box::new(s));
        } else {
            let r = Replica::recover(node.store.replica_state()).expect("durable state recovers");
            node.last_acked = r.acked();
            node.role = Role::Secondary(Box::new(r));
        }
    }

    fn secondaries_of(&self, primary: NodeId) -> Vec<NodeId> {
        self.members
            .iter()
            .copied()
            .filter(|&i| i != primary)
            .collect()
    }

    fn random_member(&mut self) -> NodeId {
        self.members[self.rng.below(self.members.len() as u64) as usize]
    }

    /// Metadata replaces a secondary (its disk is gone) by a new, empty node. The new node is not
    /// promotable until the primary reports it in sync.
    fn replace(&mut self) {
        let choices = self.secondaries_of(self.primary);
        let old = choices[self.rng.below(choices.len() as u64) as usize];
        self.crash(old);
        self.nodes[old.0 as usize].store = Store::default();
        self.members.retain(|&m| m != old);
        self.in_sync.remove(&old);
        let id = NodeId((self.nodes.len()) as u64);
        self.nodes
            .push(Node::new(id, Role::Secondary(Box::new(Replica::new()))));
        self.members.push(id);
        self.stats.replacements += 1;
        self.note(0x2e91_0000 | id.0);
        let secondaries = self.secondaries_of(self.primary);
        if let Role::Primary(s) = &mut self.nodes[self.primary.0 as usize].role {
            s.set_secondaries(&secondaries, self.now);
        }
    }

    /// Metadata learns from the running primary which secondaries are in sync.
    fn learn_in_sync(&mut self) {
        let Role::Primary(s) = &self.nodes[self.primary.0 as usize].role else {
            return;
        };
        for id in s.secondaries().collect::<Vec<_>>() {
            if s.peer_in_sync(id) {
                self.in_sync.insert(id);
            }
        }
    }

    /// Metadata promotes a random running secondary at a higher epoch. The old primary, if it
    /// runs, is not told: it must find out that it is fenced.
    fn failover(&mut self) {
        let candidates: Vec<NodeId> = self
            .secondaries_of(self.primary)
            .into_iter()
            .filter(|i| self.in_sync.contains(i))
            .filter(|&i| matches!(self.nodes[i.0 as usize].role, Role::Secondary(_)))
            .collect();
        if candidates.is_empty() {
            return;
        }
        let new = candidates[self.rng.below(candidates.len() as u64) as usize];
        let old = self.primary;
        if self.rng.below(2) == 0 {
            self.crash(old);
        }
        // Half the time the metadata drops the old primary (`NodeFailed`), keeping a copy.
        if self.members.len() > 2 && self.rng.below(2) == 0 {
            self.members.retain(|&m| m != old);
            self.in_sync.remove(&old);
            self.stats.dropped_primaries += 1;
        }
        self.epoch += 1;
        self.primary = new;
        self.stats.failovers += 1;
        self.note(0xfa11_0000 | new.0);
        let secondaries = self.secondaries_of(new);
        let node = &mut self.nodes[new.0 as usize];
        let Role::Secondary(mut r) = std::mem::replace(&mut node.role, Role::Down) else {
            unreachable!("candidates are replicas")
        };
        // The driver lets pending writes become durable before promoting.
        let mut last = None;
        while let Some((w, entries)) = node.pending.pop_front() {
            apply(&mut node.store, &w, entries, new);
            last = Some(w.id);
        }
        if let Some(id) = last {
            r.on_durable(id); // The ack would go to the old primary: moot.
        }
        let mut s = r.promote(self.epoch, self.opts.shipper);
        s.set_secondaries(&secondaries, self.now);
        node.store.epoch = self.epoch;
        node.store.acked = s.acked();
        node.last_replicated_end = s.replicated_end();
        node.last_acked = s.acked();
        node.lease = Lease::promoted(self.now);
        node.role = Role::Primary(Box::new(s));
    }

    /// A running shipper that learned of a higher epoch becomes a replica (metadata tells it
    /// which primary to follow; the sim restarts it from its store, as after a crash).
    fn demote_fenced(&mut self) {
        for id in (0..self.nodes.len() as u64).map(NodeId) {
            let Role::Primary(s) = &self.nodes[id.0 as usize].role else {
                continue;
            };
            let Some(fenced) = s.fenced() else { continue };
            assert_ne!(id, self.primary, "the current primary was fenced");
            assert!(
                fenced > s.epoch() && fenced <= self.epoch,
                "fenced by epoch {fenced}"
            );
            let node = &mut self.nodes[id.0 as usize];
            let r = Replica::recover(node.store.replica_state()).expect("durable state recovers");
            node.last_acked = r.acked();
            node.role = Role::Secondary(Box::new(r));
            self.stats.demotions += 1;
            self.note(0xfe0c_0000 | id.0);
        }
    }

    // -- the invariants -----------------------------------------------------------------------

    /// Records every entry below a running shipper's `replicated_end` as committed.
    fn record_committed(&mut self) {
        for node in &mut self.nodes {
            let Role::Primary(s) = &node.role else {
                continue;
            };
            let end = s.replicated_end();
            assert!(
                end >= node.last_replicated_end,
                "node {}: replicated_end fell",
                node.id
            );
            for o in node.last_replicated_end.max(node.store.log.start())..end {
                let entry = node
                    .store
                    .get(o)
                    .expect("primary holds its replicated entries");
                self.stats.committed += 1;
                let previous = *self.committed.entry(o).or_insert(entry);
                assert_eq!(
                    previous, entry,
                    "two different entries committed at offset {o}"
                );
            }
            node.last_replicated_end = end;
        }
    }

    fn check_invariants(&mut self) {
        // 5. At most one primary delivers.
        let holding: Vec<NodeId> = self
            .nodes
            .iter()
            .filter(|n| match &n.role {
                Role::Primary(s) => s.fenced().is_none() && n.lease.held(self.now, s.secondaries()),
                _ => false,
            })
            .map(|n| n.id)
            .collect();
        assert!(
            holding.len() <= 1,
            "primaries {holding:?} hold their leases at {} (primary {}, epoch {})",
            self.now,
            self.primary,
            self.epoch
        );
        if holding.iter().any(|&h| h != self.primary) {
            self.stats.deposed_lease_steps += 1;
        }
        for &id in &self.members {
            let node = &mut self.nodes[id.0 as usize];
            node.store.check(node.id);
            assert!(
                node.store.acked >= node.store_acked_max,
                "node {}: stored acked fell",
                node.id
            );
            node.store_acked_max = node.store.acked;
            let acked = match &node.role {
                Role::Down => continue,
                Role::Primary(s) => s.acked(),
                Role::Secondary(r) => r.acked(),
            };
            assert!(acked >= node.last_acked, "node {}: acked fell", node.id);
            node.last_acked = acked;
        }
        // 1. Log matching between every pair of stores.
        for (k, &a) in self.members.iter().enumerate() {
            for &b in &self.members[k + 1..] {
                let (a, b) = (a.0 as usize, b.0 as usize);
                let (sa, sb) = (&self.nodes[a].store, &self.nodes[b].store);
                let lo = sa.log.start().max(sb.log.start());
                let hi = sa.log.end().min(sb.log.end());
                for o in lo..hi {
                    let (ea, eb) = (sa.get(o).expect("held"), sb.get(o).expect("held"));
                    if ea.epoch == eb.epoch {
                        assert_eq!(ea, eb, "nodes {a} and {b} differ at {o} in one epoch");
                    }
                }
            }
        }
        let primary = &self.nodes[self.primary.0 as usize];
        let pstore = &primary.store;
        // 1. Every current secondary holds the primary's entries below its replicated_end.
        if let Role::Primary(s) = &primary.role {
            let end = s.replicated_end();
            assert!(
                s.acked() <= end,
                "primary acked {} beyond replicated_end {end}",
                s.acked()
            );
            for &id in self.in_sync.iter().filter(|&&id| id != self.primary) {
                let node = &self.nodes[id.0 as usize];
                let store = &node.store;
                assert!(
                    store.log.end() >= end,
                    "node {} lacks entries below replicated_end {end}",
                    node.id
                );
                for o in store.log.start().max(pstore.log.start())..end {
                    assert_eq!(
                        store.get(o),
                        pstore.get(o),
                        "node {} differs at {o}",
                        node.id
                    );
                }
            }
        }
        // 2. No committed entry is missing from a store metadata may promote.
        for &id in &self.in_sync {
            let store = &self.nodes[id.0 as usize].store;
            for (&o, &entry) in self.committed.range(store.log.start()..) {
                assert_eq!(
                    store.get(o),
                    Some(entry),
                    "committed entry {o} lost by in-sync node {id}"
                );
            }
        }
        // 2. No committed entry is missing from the current primary's store.
        for (&o, &entry) in self.committed.range(pstore.log.start()..) {
            assert_eq!(
                pstore.get(o),
                Some(entry),
                "committed entry {o} lost by primary {}",
                self.primary
            );
        }
        let lowest = self
            .members
            .iter()
            .map(|&m| self.nodes[m.0 as usize].store.log.start())
            .min();
        let lowest = lowest.unwrap_or(0);
        while self
            .committed
            .first_key_value()
            .is_some_and(|(&o, _)| o < lowest)
        {
            self.committed.pop_first();
        }
    }
}
