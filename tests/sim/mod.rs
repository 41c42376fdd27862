//! What the seeded simulations (`replication_sim.rs`, `cluster_sim.rs`, `forward_sim.rs`)
//! share: their random numbers, their simulated network, a node's durable store of one queue's
//! log, and how a replica's durable write changes that store.

use std::collections::VecDeque;

use tether::replication::{Epoch, LogState, NodeId, Offset, ReplicaState, Write, WriteOp};

/// splitmix64.
pub struct Rng(pub u64);

impl Rng {
    pub fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in `[0, n)`; `n > 0`.
    pub fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }

    /// Uniform in `[lo, hi]`.
    pub fn between(&mut self, lo: u64, hi: u64) -> u64 {
        lo + self.below(hi - lo + 1)
    }

    pub fn per_mille(&mut self, p: u64) -> bool {
        self.below(1_000) < p
    }
}

/// The unique id a workload append gives its entry, standing in for its payload.
pub type Payload = u64;

/// An entry as stored and shipped: its epoch and payload.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Entry {
    pub epoch: Epoch,
    pub payload: Payload,
}

/// What a node keeps of one queue across crashes.
#[derive(Clone, Debug, Default)]
pub struct Store {
    pub epoch: Epoch,
    pub acked: Offset,
    pub log: LogState,
    pub entries: VecDeque<Entry>,
}

impl Store {
    pub fn get(&self, offset: Offset) -> Option<Entry> {
        let i = offset.checked_sub(self.log.start())?;
        self.entries.get(usize::try_from(i).ok()?).copied()
    }

    pub fn range(&self, first: Offset, last: Offset) -> Vec<Entry> {
        (first..last)
            .map(|o| self.get(o).expect("range held"))
            .collect()
    }

    pub fn replica_state(&self) -> ReplicaState {
        ReplicaState {
            epoch: self.epoch,
            acked: self.acked,
            log: self.log.clone(),
        }
    }

    /// Checks that the entries agree with the log shape, including every entry's epoch.
    pub fn check(&self, node: NodeId) {
        let log = &self.log;
        assert_eq!(
            self.entries.len() as u64,
            log.len(),
            "node {node}: store length"
        );
        assert!(
            log.start() <= self.acked && self.acked <= log.end(),
            "node {node}: acked {}",
            self.acked
        );
        for (i, e) in self.entries.iter().enumerate() {
            let o = log.start() + i as u64;
            assert_eq!(
                log.epoch_at(o),
                Some(e.epoch),
                "node {node}: epoch of entry {o}"
            );
        }
    }
}

/// Applies a durable replica write to the store.
pub fn apply(store: &mut Store, w: &Write, entries: Vec<Entry>, node: NodeId) {
    match &w.op {
        WriteOp::Append {
            truncate_to,
            range,
            epoch,
            ..
        } => {
            if let Some(t) = truncate_to {
                store.entries.truncate((t - store.log.start()) as usize);
            }
            assert_eq!(entries.len() as u64, range.end - range.start);
            assert!(entries.iter().all(|e| e.epoch == *epoch));
            store.entries.extend(entries);
        }
        WriteOp::Meta => {}
        WriteOp::Snapshot { start, end } => {
            assert_eq!(entries.len() as u64, end - start);
            store.entries = entries.into();
        }
        WriteOp::Trim { start } => {
            store.entries.drain(..(start - store.log.start()) as usize);
        }
    }
    store.epoch = w.state.epoch;
    store.acked = w.state.acked;
    store.log = w.state.log.clone();
    store.check(node);
}

/// Reads a whole-number setting from the environment.
pub fn env_u64(name: &str) -> Option<u64> {
    let value = std::env::var(name).ok()?;
    Some(
        value
            .parse()
            .unwrap_or_else(|_| panic!("{name} must be an integer, got {value:?}")),
    )
}

/// A panic's message.
pub fn panic_message(panic: &(dyn std::any::Any + Send)) -> String {
    panic
        .downcast_ref::<String>()
        .cloned()
        .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
        .unwrap_or_default()
}

/// A simulated world: stepped through a fault phase, healed, then stepped until it converges.
pub trait World {
    /// What a run exercised.
    type Stats;
    /// One millisecond, with faults or not.
    fn step(&mut self, faults: bool);
    /// Ends the faults: links healed, nodes restarted.
    fn heal_all(&mut self);
    /// Whether everything is back in line.
    fn converged(&self) -> bool;
    /// The state, for a failure's message.
    fn describe(&self) -> String;
    /// The run's fingerprint and what it exercised, given the steps it took to converge.
    fn finish(self, liveness_steps: u64) -> (u64, Self::Stats);
}

/// Runs `world` for `fault_steps` steps with faults, heals it, and steps it until it converges
/// (liveness), at most `liveness_steps_max` steps.
pub fn run<W: World>(mut world: W, fault_steps: u64, liveness_steps_max: u64) -> (u64, W::Stats) {
    for _ in 0..fault_steps {
        world.step(true);
    }
    world.heal_all();
    for step in 1..=liveness_steps_max {
        world.step(false);
        if world.converged() {
            return world.finish(step);
        }
    }
    panic!(
        "liveness: no convergence within {liveness_steps_max} steps: {}",
        world.describe()
    );
}

/// Runs `run` for `seed`; a failure names the seed and the command (`replay`) that replays it.
pub fn run_reporting<T>(what: &str, seed: u64, replay: &str, run: impl FnOnce() -> T) -> T {
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(run)) {
        Ok(outcome) => outcome,
        Err(panic) => panic!(
            "{what} failed for seed {seed}: {}\nreplay: {replay}",
            panic_message(&*panic)
        ),
    }
}

/// A message on the simulated network.
pub struct Envelope<M> {
    pub from: NodeId,
    pub to: NodeId,
    /// When it was sent (a duplicate too).
    pub sent_at: u64,
    pub msg: M,
}

/// Messages in flight, delivered in order of their delivery time (then of sending).
pub struct Network<M> {
    queue: std::collections::BinaryHeap<std::cmp::Reverse<(u64, u64)>>,
    in_flight: std::collections::BTreeMap<u64, Envelope<M>>,
    next_seq: u64,
}

impl<M> Default for Network<M> {
    fn default() -> Self {
        Network {
            queue: Default::default(),
            in_flight: Default::default(),
            next_seq: 0,
        }
    }
}

impl<M> Network<M> {
    /// Sends `envelope`, to be delivered at `at`.
    pub fn push(&mut self, at: u64, envelope: Envelope<M>) {
        let seq = self.next_seq;
        self.next_seq += 1;
        self.queue.push(std::cmp::Reverse((at, seq)));
        self.in_flight.insert(seq, envelope);
    }

    /// The next message due at `now`, with its sequence number.
    pub fn pop_due(&mut self, now: u64) -> Option<(u64, Envelope<M>)> {
        let &std::cmp::Reverse((at, seq)) = self.queue.peek()?;
        if at > now {
            return None;
        }
        self.queue.pop();
        let envelope = self.in_flight.remove(&seq).expect("queued message");
        Some((seq, envelope))
    }
}
