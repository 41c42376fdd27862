//! Deterministic, seed-driven simulation of publish forwarding: one origin ships its publish
//! log to two peers through the server's own pipeline ([`Sender`], `control/forward.rs`).
//!
//! One thread, virtual time (one step = one millisecond), one seeded RNG. The origin's driver
//! does what `server/forward.rs`'s `forward_loop` does: it reads a run of at most
//! [`RUN_ENTRIES_MAX`] entries right after what the sender handed (`read_run`: none if the
//! next one was trimmed),
//! hands it, calls the peer with a deadline of [`FORWARD_RPC_TIMEOUT_MS`], records how far
//! each answer says the peer applied (the cursor only moves forward, durably with a later group
//! commit, which also trims what every peer applied), and pauses and resumes as the sender
//! says. A peer does what `apply_forwarded` does, by the same rules ([`run_ready`],
//! [`entry_step`]): a run that follows an offset it has not applied waits for it up to
//! [`FORWARD_GAP_WAIT_MS`], then is deferred with what is applied; entries at or below what it
//! applied are skipped, the rest applied in order, a write may be refused part way (deferred,
//! with how far it got); a joining or stopping peer defers with 0.
//!
//! The network delays each message independently (so two runs in flight may arrive in either
//! order) and drops requests and answers; the origin crashes (its in-memory cursors and trim
//! point fall back to what was committed, its calls in flight are gone) and peers crash
//! (their waiting runs are gone; what they applied is durable, as it is written in the batch
//! that applies it). Some of the origin's restarts come with a lost disk: it starts a new log
//! past the old one's end (as `new_log_start` numbers it), and every run says where its log
//! starts; a peer takes what is below the start as applied ([`applied_before_run`]), in memory
//! until it applies an entry. The first log starts past 1 too. The origin publishes throughout
//! the fault phase.
//!
//! Invariants, checked as they happen and after every step:
//! 1. A peer applies the origin's log exactly once and in order: each entry it applies is the
//!    one right after the last it applied (nothing twice), and no run reaches it past a gap
//!    (the server's receiver would refuse it: a working origin never sends one).
//! 2. The origin's cursor for a peer never passes what that peer applied, and what the origin
//!    trimmed never passes what any peer applied (nothing a peer still needs is gone); what
//!    lies below the origin's log start counts as applied (it is not in that log: lost with
//!    an earlier one, or never written).
//! 3. The floor a peer is told never passes what every peer applied (counted the same way).
//! 4. Liveness after healing: every peer applies the whole (current) log, every cursor reaches
//!    its end, and every peer is told the floor at the end, within [`LIVENESS_STEPS_MAX`].
//!
//! `TETHER_FORWARD_SIM_SEED=<n>` runs one seed, `TETHER_FORWARD_SIM_SEEDS=<count>` sets how
//! many run (`make sim`).

#[allow(dead_code)]
mod sim;

use std::collections::BTreeMap;

use sim::{Envelope, Network, Rng, env_u64};
use tether::control::forward::{
    Answer, EntryStep, FORWARD_RPC_TIMEOUT_MS, Run, Sender, applied_before_run, entry_step,
    run_ready,
};
use tether::limits::FORWARD_GAP_WAIT_MS;
use tether::replication::NodeId;

/// Seeds run by default (`make test`).
const SEEDS_DEFAULT: u64 = 2_000;
/// Steps (milliseconds) of the fault phase.
const FAULT_STEPS: u64 = 15_000;
/// Steps the forwarding gets to converge once faults stop (an unanswered call waits out its
/// deadline, then the pause before the retry).
const LIVENESS_STEPS_MAX: u64 = 3 * FORWARD_RPC_TIMEOUT_MS;
/// Most entries in one run (the server reads up to 512, or 1 MiB: smaller here, so that a
/// backlog takes several runs).
const RUN_ENTRIES_MAX: u64 = 16;
/// Peers of the origin.
const PEERS: usize = 2;
/// The origin's address on the simulated network (peers are 0 and 1).
const ORIGIN: NodeId = NodeId(100);

#[test]
fn forward_sim() {
    if let Some(seed) = env_u64("TETHER_FORWARD_SIM_SEED") {
        run_reporting(seed);
        return;
    }
    let seeds = env_u64("TETHER_FORWARD_SIM_SEEDS").unwrap_or(SEEDS_DEFAULT);
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
            ("runs handed while another was in flight", total.follows),
            ("runs that waited for the run before", total.waited),
            (
                "runs deferred: the run before never came",
                total.gap_deferred,
            ),
            ("entries skipped as applied before", total.skipped),
            ("writes refused part way", total.partial),
            (
                "runs deferred whole (joining or stopping)",
                total.deferred_whole,
            ),
            ("calls past their deadline", total.timeouts),
            ("resumes after a failure", total.resumes),
            ("runs telling only the floor", total.floor_only),
            ("origin crashes", total.origin_crashes),
            ("origins that lost their disk", total.lost_disks),
            ("peers taking a log from its start", total.new_logs_taken),
            ("peer crashes", total.peer_crashes),
            ("answers past everything handed", total.answers_ahead),
        ];
        for (what, n) in reached {
            assert!(n > 0, "no {what} in {seeds} seeds: {total:?}");
        }
    }
}

/// Found by this simulation: restarted with its cursor for peer 0 at 1155 while the peer had
/// applied through 1203, the origin sent 1156..=1187 and was answered "through 1203"; the
/// entries up to 1203 were then trimmed (every peer had applied them), and the next run was
/// read from 1188, which the log no longer held: nothing was ever sent to that peer again.
/// Since, an answer past what was handed moves the next run past it
/// (`Sender::answered`).
#[test]
fn an_answer_past_what_was_handed_does_not_stall_the_pipeline() {
    run_reporting(32);
}

#[test]
fn replay_is_deterministic() {
    for seed in [1, 2, 3] {
        assert_eq!(run(seed), run(seed), "seed {seed} replayed differently");
    }
}

fn run_reporting(seed: u64) -> (u64, Stats) {
    let replay = format!("TETHER_FORWARD_SIM_SEED={seed} cargo test --release --test forward_sim");
    sim::run_reporting("forward sim", seed, &replay, || run(seed))
}

fn run(seed: u64) -> (u64, Stats) {
    sim::run(World::new(seed), FAULT_STEPS, LIVENESS_STEPS_MAX)
}

/// What the seeds exercised.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
struct Stats {
    follows: u64,
    waited: u64,
    gap_deferred: u64,
    skipped: u64,
    partial: u64,
    deferred_whole: u64,
    timeouts: u64,
    resumes: u64,
    floor_only: u64,
    origin_crashes: u64,
    /// Restarts of the origin with a new log (its disk lost).
    lost_disks: u64,
    /// Runs whose log start moved a peer past what it applied.
    new_logs_taken: u64,
    peer_crashes: u64,
    /// Answers past everything handed (the peer applied runs of before an origin restart).
    answers_ahead: u64,
    applied: u64,
}

impl Stats {
    fn add(&mut self, o: &Stats) {
        self.follows += o.follows;
        self.waited += o.waited;
        self.gap_deferred += o.gap_deferred;
        self.skipped += o.skipped;
        self.partial += o.partial;
        self.deferred_whole += o.deferred_whole;
        self.timeouts += o.timeouts;
        self.resumes += o.resumes;
        self.floor_only += o.floor_only;
        self.origin_crashes += o.origin_crashes;
        self.lost_disks += o.lost_disks;
        self.new_logs_taken += o.new_logs_taken;
        self.peer_crashes += o.peer_crashes;
        self.answers_ahead += o.answers_ahead;
        self.applied += o.applied;
    }
}

/// A run on its way to a peer: the origin's incarnation that sent it, its call id, the run
/// and the offsets it carries.
#[derive(Debug, Clone)]
struct Call {
    incarnation: u64,
    id: u64,
    run: Run,
    offsets: Vec<u64>,
    /// Where the origin's log starts.
    log_start: u64,
}

#[derive(Debug, Clone)]
enum Msg {
    Request(Call),
    Answer {
        incarnation: u64,
        id: u64,
        answer: Answer,
    },
}

/// The origin's forwarding to one peer.
#[derive(Debug)]
struct Link {
    sender: Sender,
    /// How far the peer applied, as its answers said (in memory).
    sent: u64,
    /// `sent` as last committed.
    sent_durable: u64,
    /// While paused after a failure: when the pause ends.
    paused_until: Option<u64>,
    /// Calls in flight: id → (run, deadline).
    calls: BTreeMap<u64, (Run, u64)>,
}

struct Origin {
    up: bool,
    /// Bumped at every restart: answers to an earlier incarnation's calls are dropped.
    incarnation: u64,
    /// The first offset of the current log (a new one after a lost disk).
    log_start: u64,
    /// The log's last committed offset.
    end: u64,
    /// Everything at or below it is trimmed (every peer applied it), in memory and committed.
    trimmed: u64,
    trimmed_durable: u64,
    /// Cursor writes submitted and not committed yet: (peer, sent, trimmed).
    uncommitted: Vec<(usize, u64, u64)>,
    links: Vec<Link>,
    next_call: u64,
    down_until: u64,
}

#[derive(Debug)]
struct Peer {
    up: bool,
    down_until: u64,
    /// The last offset of the origin's log applied here, or just below the start of a log
    /// it was told of (in memory, as the server's `applied`).
    done: u64,
    /// The last entry applied (durable with it, `fwd-applied`): `done` after a restart.
    applied_entry: u64,
    /// The highest floor this peer was told.
    floor_told: u64,
    /// Runs waiting for the run before them: (call, give-up time).
    waiting: Vec<(Call, u64)>,
}

struct World {
    rng: Rng,
    /// Whether a restart lost the origin's disk.
    disk_rng: Rng,
    now: u64,
    faults: bool,
    origin: Origin,
    peers: Vec<Peer>,
    net: Network<Msg>,
    stats: Stats,
    /// A fingerprint of everything delivered, for the determinism check.
    hash: u64,
    /// `TETHER_SIM_TRACE=1`: print every run, answer and crash.
    trace: bool,
}

impl World {
    fn new(seed: u64) -> World {
        // Neither the first log's start nor the lost disks draw from `rng`: a seed replays the
        // faults it did before they were modelled, unless a disk is lost first.
        let start = 1 + seed % 50;
        let link = || Link {
            sender: Sender::new(start - 1),
            sent: start - 1,
            sent_durable: start - 1,
            paused_until: None,
            calls: BTreeMap::new(),
        };
        let peer = || Peer {
            up: true,
            down_until: 0,
            done: 0,
            applied_entry: 0,
            floor_told: 0,
            waiting: Vec::new(),
        };
        World {
            rng: Rng(seed),
            disk_rng: Rng(seed ^ 0xd15c),
            now: 0,
            faults: true,
            origin: Origin {
                up: true,
                incarnation: 0,
                log_start: start,
                end: start - 1,
                trimmed: start - 1,
                trimmed_durable: start - 1,
                uncommitted: Vec::new(),
                links: (0..PEERS).map(|_| link()).collect(),
                next_call: 0,
                down_until: 0,
            },
            peers: (0..PEERS).map(|_| peer()).collect(),
            net: Network::default(),
            stats: Stats::default(),
            hash: seed,
            trace: std::env::var_os("TETHER_SIM_TRACE").is_some(),
        }
    }

    fn mix(&mut self, v: u64) {
        self.hash = (self.hash ^ v).wrapping_mul(0x100_0000_01b3);
    }

    /// Sends `msg` with a random delay (1–40 ms), or drops it (faults only).
    fn send(&mut self, from: NodeId, to: NodeId, msg: Msg) {
        if self.faults && self.rng.per_mille(30) {
            return;
        }
        let delay = self.rng.between(1, 40);
        let sent_at = self.now;
        self.net.push(
            self.now + delay,
            Envelope {
                from,
                to,
                sent_at,
                msg,
            },
        );
    }

    /// The floor: how far every peer applied the log, as the origin knows it (what it trimmed).
    fn floor(&self) -> u64 {
        self.origin.trimmed
    }

    fn publish(&mut self) {
        if self.faults && self.origin.up && self.rng.per_mille(100) {
            self.origin.end += self.rng.between(1, 3);
        }
    }

    /// The origin's driver: pauses, resumes, reads runs and hands them, as `forward_loop`.
    fn drive(&mut self) {
        if !self.origin.up {
            return;
        }
        for p in 0..PEERS {
            let link = &mut self.origin.links[p];
            if let Some(until) = link.paused_until {
                if self.now < until {
                    continue;
                }
                link.paused_until = None;
                link.sender.resume(link.sent);
                self.stats.resumes += 1;
            }
            if let Some(pause) = link.sender.pause_ms() {
                link.paused_until = Some(self.now + pause);
                continue;
            }
            while self.origin.links[p].sender.may_hand() {
                let link = &self.origin.links[p];
                // As `read_run`: the entries right after what was handed, in order, stopping
                // at the first missing one (only what is not trimmed is in the store).
                let from = link.sender.handed() + 1;
                let to = self.origin.end.min(from - 1 + RUN_ENTRIES_MAX);
                let offsets: Vec<u64> = if from > self.origin.trimmed {
                    (from..=to).collect()
                } else {
                    Vec::new()
                };
                let floor = self.floor();
                let link = &mut self.origin.links[p];
                let Some(run) = link.sender.hand(offsets.last().copied(), floor) else {
                    break;
                };
                if run.follows.is_some() {
                    self.stats.follows += 1;
                }
                if run.floor_only() {
                    self.stats.floor_only += 1;
                }
                let id = self.origin.next_call;
                self.origin.next_call += 1;
                link.calls
                    .insert(id, (run, self.now + FORWARD_RPC_TIMEOUT_MS));
                let call = Call {
                    incarnation: self.origin.incarnation,
                    id,
                    run,
                    offsets,
                    log_start: self.origin.log_start,
                };
                if self.trace {
                    eprintln!("{} hand to {p}: {:?} (call {id})", self.now, call.run);
                }
                self.send(ORIGIN, NodeId(p as u64), Msg::Request(call));
            }
        }
    }

    /// Calls past their deadline end unanswered.
    fn expire_calls(&mut self) {
        if !self.origin.up {
            return;
        }
        for p in 0..PEERS {
            let now = self.now;
            let link = &mut self.origin.links[p];
            let late: Vec<u64> = link
                .calls
                .iter()
                .filter(|(_, (_, deadline))| *deadline <= now)
                .map(|(&id, _)| id)
                .collect();
            for id in late {
                let (run, _) = link.calls.remove(&id).expect("a call in flight");
                assert_eq!(link.sender.answered(&run, Answer::None), None);
                self.stats.timeouts += 1;
            }
        }
    }

    /// The origin records an answer: the cursor moves forward in memory at once and durably
    /// with a later commit, which also trims what every peer applied (`record_sent`).
    fn answered(&mut self, p: usize, incarnation: u64, id: u64, answer: Answer) {
        if !self.origin.up || incarnation != self.origin.incarnation {
            return;
        }
        if self.trace {
            eprintln!("{} answer from {p} to call {id}: {answer:?}", self.now);
        }
        let link = &mut self.origin.links[p];
        let Some((run, _)) = link.calls.remove(&id) else {
            return; // Past its deadline: counted unanswered already.
        };
        let handed = link.sender.handed();
        let Some(through) = link.sender.answered(&run, answer) else {
            return;
        };
        if through > handed {
            self.stats.answers_ahead += 1;
        }
        if through <= link.sent {
            return;
        }
        link.sent = through;
        // Invariant 2: the cursor never passes what the peer applied.
        let applied = self.applied(p);
        assert!(
            through <= applied,
            "the origin's cursor for peer {p} moved to {through}, past what it applied ({applied})",
        );
        let min = self.origin.links.iter().map(|l| l.sent).min().unwrap_or(0);
        self.origin.trimmed = self.origin.trimmed.max(min);
        self.origin
            .uncommitted
            .push((p, through, self.origin.trimmed));
    }

    /// Some step's group commit makes the cursor writes submitted so far durable, in order.
    fn commit(&mut self) {
        if self.origin.up && self.rng.per_mille(200) {
            for (p, sent, trimmed) in std::mem::take(&mut self.origin.uncommitted) {
                let link = &mut self.origin.links[p];
                link.sent_durable = link.sent_durable.max(sent);
                self.origin.trimmed_durable = self.origin.trimmed_durable.max(trimmed);
            }
        }
    }

    /// A peer takes a run (`apply_forwarded`): waits for the run before it, or applies it.
    fn receive(&mut self, p: usize, call: Call) {
        // Invariant 3: the floor told never passes what every peer applied.
        let all = self.applied_min();
        assert!(
            call.run.floor <= all,
            "peer {p} was told the floor {} while a peer had applied only {all}",
            call.run.floor
        );
        if self.faults && self.rng.per_mille(20) {
            // Joining or stopping: nothing applied, the floor not taken.
            self.stats.deferred_whole += 1;
            self.answer(p, &call, Answer::Deferred { through: 0 });
            return;
        }
        // Nothing below the run's log start will come (`apply_forwarded`).
        let done = applied_before_run(self.peers[p].done, call.log_start);
        if done > self.peers[p].done {
            self.stats.new_logs_taken += 1;
            if self.trace {
                eprintln!(
                    "{} peer {p} takes the log starting at {} (applied {})",
                    self.now, call.log_start, self.peers[p].done
                );
            }
            self.peers[p].done = done;
        }
        if !run_ready(self.peers[p].done, call.run.follows) {
            self.stats.waited += 1;
            let give_up = self.now + FORWARD_GAP_WAIT_MS;
            self.peers[p].waiting.push((call, give_up));
            return;
        }
        self.apply(p, call);
    }

    fn apply(&mut self, p: usize, call: Call) {
        let refuse_at = (self.faults && !call.offsets.is_empty() && self.rng.per_mille(50))
            .then(|| self.rng.below(call.offsets.len() as u64) as usize);
        let peer = &mut self.peers[p];
        peer.floor_told = peer.floor_told.max(call.run.floor);
        let mut refused = false;
        for (i, &offset) in call.offsets.iter().enumerate() {
            match entry_step(peer.done, offset) {
                EntryStep::Skip => {
                    self.stats.skipped += 1;
                    continue;
                }
                EntryStep::Apply => {}
                // Invariant 1: the server's receiver refuses such a run (and nothing is lost),
                // but a working origin never sends one.
                EntryStep::Gap => panic!(
                    "peer {p} got {offset} right after {}, the last it applied: {call:?}",
                    peer.done
                ),
            }
            if refuse_at == Some(i) {
                refused = true;
                self.stats.partial += 1;
                break;
            }
            peer.done = offset;
            peer.applied_entry = offset;
            self.stats.applied += 1;
        }
        let through = peer.done;
        let answer = if refused {
            Answer::Deferred { through }
        } else {
            Answer::Applied { through }
        };
        self.answer(p, &call, answer);
    }

    fn answer(&mut self, p: usize, call: &Call, answer: Answer) {
        let msg = Msg::Answer {
            incarnation: call.incarnation,
            id: call.id,
            answer,
        };
        self.send(NodeId(p as u64), ORIGIN, msg);
    }

    /// Runs whose predecessor was applied meanwhile go on; those past their wait are deferred.
    fn wake_waiting(&mut self) {
        for p in 0..PEERS {
            if !self.peers[p].up {
                continue;
            }
            let waiting = std::mem::take(&mut self.peers[p].waiting);
            for (call, give_up) in waiting {
                let done = self.peers[p].done;
                if run_ready(done, call.run.follows) {
                    self.apply(p, call);
                } else if self.now >= give_up {
                    self.stats.gap_deferred += 1;
                    self.answer(p, &call, Answer::Deferred { through: done });
                } else {
                    self.peers[p].waiting.push((call, give_up));
                }
            }
        }
    }

    fn deliver_due(&mut self) {
        while let Some((seq, env)) = self.net.pop_due(self.now) {
            self.mix(seq);
            match env.msg {
                Msg::Request(call) => {
                    let p = env.to.0 as usize;
                    if self.peers[p].up {
                        self.receive(p, call);
                    }
                }
                Msg::Answer {
                    incarnation,
                    id,
                    answer,
                } => {
                    let p = env.from.0 as usize;
                    self.answered(p, incarnation, id, answer);
                }
            }
        }
    }

    /// What peer `p` applied of the origin's current log, what is below its start included.
    fn applied(&self, p: usize) -> u64 {
        applied_before_run(self.peers[p].done, self.origin.log_start)
    }

    fn applied_min(&self) -> u64 {
        (0..PEERS).map(|p| self.applied(p)).min().unwrap_or(0)
    }

    fn crash_and_restart(&mut self) {
        if self.origin.up && self.faults && self.rng.per_mille(1) {
            // The origin stops: its calls and uncommitted cursor writes are gone.
            self.stats.origin_crashes += 1;
            if self.trace {
                eprintln!("{} origin crashes", self.now);
            }
            self.origin.up = false;
            self.origin.uncommitted.clear();
            self.origin.down_until = self.now + self.rng.between(10, 500);
        }
        if !self.origin.up && self.now >= self.origin.down_until {
            // Restarted: cursors as committed, never behind what is trimmed (`start_cursor`).
            // With its disk lost (a tenth of the restarts), it starts a new log past the old
            // one's end: nothing is committed, every cursor and the trim are below its start.
            if self.faults && self.disk_rng.per_mille(100) {
                self.stats.lost_disks += 1;
                let o = &mut self.origin;
                o.log_start = o.end + self.disk_rng.between(1, 200);
                o.end = o.log_start - 1;
                o.trimmed_durable = o.log_start - 1;
                for link in &mut o.links {
                    link.sent_durable = o.log_start - 1;
                }
                if self.trace {
                    eprintln!(
                        "{} origin lost its disk: new log from {}",
                        self.now, o.log_start
                    );
                }
            }
            let o = &mut self.origin;
            o.up = true;
            o.incarnation += 1;
            o.trimmed = o.trimmed_durable;
            if self.trace {
                let sent: Vec<u64> = o.links.iter().map(|l| l.sent_durable).collect();
                eprintln!(
                    "{} origin restarts: trimmed {}, cursors {sent:?}",
                    self.now, o.trimmed
                );
            }
            for link in &mut o.links {
                let start = link.sent_durable.max(o.trimmed_durable);
                link.sent = start;
                link.sent_durable = start;
                link.sender = Sender::new(start);
                link.paused_until = None;
                link.calls.clear();
            }
        }
        for p in 0..PEERS {
            if self.peers[p].up && self.faults && self.rng.per_mille(1) {
                self.stats.peer_crashes += 1;
                let peer = &mut self.peers[p];
                peer.up = false;
                peer.waiting.clear();
                peer.done = peer.applied_entry;
                peer.down_until = self.now + self.rng.between(10, 500);
            }
            if !self.peers[p].up && self.now >= self.peers[p].down_until {
                self.peers[p].up = true;
            }
        }
    }

    fn check(&self) {
        let min = self.applied_min();
        assert!(
            self.origin.trimmed <= min && self.origin.trimmed_durable <= min,
            "the origin trimmed through {} (committed {}) while a peer applied only {min}",
            self.origin.trimmed,
            self.origin.trimmed_durable
        );
        for (p, link) in self.origin.links.iter().enumerate() {
            let applied = self.applied(p);
            assert!(
                link.sent <= applied && link.sent_durable <= applied,
                "the cursor of peer {p} ({}, committed {}) is past what it applied ({applied})",
                link.sent,
                link.sent_durable,
            );
        }
    }
}

impl sim::World for World {
    type Stats = Stats;

    fn step(&mut self, faults: bool) {
        self.faults = faults;
        self.now += 1;
        self.crash_and_restart();
        self.deliver_due();
        self.wake_waiting();
        self.expire_calls();
        self.publish();
        self.drive();
        self.commit();
        self.check();
    }

    fn heal_all(&mut self) {
        self.faults = false;
        // Crashed nodes come back now.
        self.origin.down_until = self.now;
        for p in &mut self.peers {
            p.down_until = self.now;
        }
        self.crash_and_restart();
    }

    fn converged(&self) -> bool {
        let end = self.origin.end;
        self.origin.up
            && self
                .peers
                .iter()
                .all(|p| p.done == end && p.floor_told == end)
            && self.origin.links.iter().all(|l| l.sent == end)
    }

    fn describe(&self) -> String {
        format!(
            "at {}: log {}..={}, trimmed {} (committed {}), links {:?}, peers {:?}",
            self.now,
            self.origin.log_start,
            self.origin.end,
            self.origin.trimmed,
            self.origin.trimmed_durable,
            self.origin.links,
            self.peers,
        )
    }

    fn finish(mut self, liveness_steps: u64) -> (u64, Stats) {
        self.mix(liveness_steps);
        self.mix(self.origin.end);
        (self.hash, self.stats)
    }
}
