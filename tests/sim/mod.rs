//! What the seeded simulations (`replication_sim.rs`, `cluster_sim.rs`) share: their random
//! numbers, a node's durable store of one queue's log, and how a replica's durable write
//! changes that store.

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
