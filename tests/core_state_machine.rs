//! Deterministic tests of the sans-IO node core, driven with explicit time and the in-memory
//! storage twin (no network, no RocksDB): life cycle, offsets, expiry, and recovery.

use std::collections::BTreeMap;

use proptest::prelude::*;
use tether::core::{ConnectError, NodeCore, PublishPlan, PublishRefused, Step};
use tether::interest::Prematch;
use tether::protocol::{DurableHello, InterestSpec, PublishOp, QueueReport, QueueStatus};
use tether::storage::{Batch, MemStore, Store};

/// The core plus a store that every batch is applied to, as the real driver does.
struct Sim {
    core: NodeCore,
    store: MemStore,
    now: u64,
}

impl Sim {
    fn new() -> Sim {
        Sim {
            core: NodeCore::new("n1"),
            now: 0,
            store: MemStore::new(),
        }
    }

    fn apply(&self, b: Batch) {
        self.store.write(&b, true).unwrap();
    }

    fn connect(&mut self, id: Option<&str>, timeout: u64) -> (u64, QueueStatus, Option<u64>) {
        let hello = id.map(|id| DurableHello {
            redirect_epoch: None,
            id: id.into(),
            timeout_secs: timeout,
            redundancy: 0,
            failed_primary: None,
            seen: None,
        });
        let c = self.core.connect(hello.as_ref()).expect("connect");
        self.apply(c.batch);
        (c.session, c.status, c.pending)
    }

    fn register(&mut self, s: u64, region: &str, spec: InterestSpec, durable: bool) {
        let (_, b) = self.core.register(s, region, &spec, durable, true).unwrap();
        self.apply(b);
    }

    /// `NodeCore::publish_within` of `ops` on this store's region keys (the plan is not
    /// applied).
    fn plan(
        &mut self,
        publisher: u64,
        ops: &[PublishOp],
        pre: &[Option<Prematch>],
        room: &mut dyn FnMut(u64) -> bool,
    ) -> Result<PublishPlan, PublishRefused> {
        let store = &self.store;
        self.core.publish_within(
            self.now,
            publisher,
            ops,
            None,
            pre,
            &mut |r, k| Ok(store.region_get(r, k).unwrap().is_some()),
            room,
        )
    }

    fn put(&mut self, publisher: u64, region: &str, key: &str) -> u64 {
        let store = &self.store;
        let plan = self
            .core
            .publish(
                self.now,
                publisher,
                &[PublishOp::Put {
                    region: region.into(),
                    key: key.into(),
                    value: b"v".to_vec(),
                }],
                &mut |r, k| Ok(store.region_get(r, k).unwrap().is_some()),
            )
            .unwrap();
        self.store.write(&plan.batch, true).unwrap();
        self.core.committed(plan.seq, &plan.appended);
        plan.enqueued
    }

    /// Delivers everything deliverable to a session; returns (offset, flags) pairs and markers.
    fn drain(&mut self, s: u64) -> (Vec<(u64, u8)>, Vec<String>) {
        let (mut got, mut live) = (Vec::new(), Vec::new());
        loop {
            match self.core.delivery_step(s) {
                Step::Idle => return (got, live),
                Step::Live(r) => live.extend(r),
                Step::Read { from, to } => {
                    let q = self.core.session(s).unwrap().queue;
                    let bounds = self.core.flag_bounds(s).unwrap();
                    let mut last = 0;
                    self.store
                        .read_entries(q, from, to, usize::MAX, &mut |o, _, _| {
                            got.push((o, bounds.wire_flags(o)));
                            last = o;
                        })
                        .unwrap();
                    if let Some(b) = self.core.will_send(s, last) {
                        self.apply(b);
                    }
                }
            }
        }
    }

    fn disconnect(&mut self, now: u64, s: u64, keepalive: bool) {
        let d = self.core.disconnect(now, s, keepalive);
        self.apply(d.batch);
    }

    fn recover(&self, now: u64) -> NodeCore {
        let (core, b) = NodeCore::recover(
            "n1",
            now,
            self.store.queues().unwrap(),
            |k| self.store.state_get(k),
            |q, from, to| tether::core::bytes::stored_entry_bytes(&self.store, q, from, to),
        )
        .unwrap();
        self.apply(b);
        core
    }
}

fn by_id(reports: Vec<QueueReport>) -> BTreeMap<String, QueueReport> {
    reports
        .into_iter()
        .filter_map(|q| q.durable_id.clone().map(|id| (id, q)))
        .collect()
}

#[test]
fn durable_life_cycle_with_replay_flags() {
    let mut sim = Sim::new();
    let (p, _) = sim.core.publisher_session();
    let (s, status, pending) = sim.connect(Some("X"), 300);
    assert_eq!((status, pending), (QueueStatus::New, None));
    sim.register(s, "R", InterestSpec::AllKeys, true);
    assert_eq!(
        sim.core.delivery_step(s),
        Step::Idle,
        "nothing before ready"
    );
    for k in ["a", "b", "c"] {
        assert_eq!(sim.put(p, "R", k), 1);
    }
    assert_eq!(sim.core.ready(s).unwrap(), 3);
    let (got, live) = sim.drain(s);
    assert_eq!(got.iter().map(|g| g.0).collect::<Vec<_>>(), [1, 2, 3]);
    assert!(
        got.iter()
            .all(|(_, f)| *f == tether::protocol::FLAG_REPLAYED)
    );
    assert_eq!(live, ["R"]);
    sim.put(p, "R", "d");
    let (got, live) = sim.drain(s);
    assert_eq!(
        (got, live.len()),
        (vec![(4, 0)], 0),
        "live event, no second marker"
    );
    // Ack 2, go away; 4 events remain and 3..4 were delivered: possible duplicates.
    let b = sim.core.ack(s, 2).unwrap().unwrap();
    sim.apply(b);
    sim.disconnect(1_000, s, true);
    sim.put(p, "R", "e");
    let (s2, status, pending) = sim.connect(Some("X"), 300);
    assert_eq!((status, pending), (QueueStatus::Resumed, Some(3)));
    sim.core.ready(s2).unwrap();
    let (got, _) = sim.drain(s2);
    use tether::protocol::{FLAG_POSSIBLE_DUPLICATE as D, FLAG_REPLAYED as R};
    assert_eq!(got, [(3, R | D), (4, R | D), (5, R)]);
}

#[test]
fn oldest_unacked_age_follows_acks() {
    let mut sim = Sim::new();
    let (p, _) = sim.core.publisher_session();
    let (s, ..) = sim.connect(Some("X"), 300);
    sim.register(s, "R", InterestSpec::AllKeys, true);
    sim.core.ready(s).unwrap();
    sim.now = 1_000;
    sim.put(p, "R", "a");
    sim.now = 5_000;
    sim.put(p, "R", "b");
    assert_eq!(sim.core.counts(6_000).oldest_unacked_age_ms, 5_000);
    sim.drain(s);
    let b = sim.core.ack(s, 1).unwrap().unwrap();
    sim.apply(b);
    assert_eq!(
        sim.core.counts(6_000).oldest_unacked_age_ms,
        1_000,
        "now dated by the second entry"
    );
    let b = sim.core.ack(s, 2).unwrap().unwrap();
    sim.apply(b);
    assert_eq!(sim.core.counts(6_000).oldest_unacked_age_ms, 0);
}

#[test]
fn inflight_window_limits_replay_reads() {
    let mut sim = Sim::new();
    sim.core = NodeCore::new("n1").with_limits(tether::config::Limits {
        inflight_events_max: 5,
        ..Default::default()
    });
    let (p, _) = sim.core.publisher_session();
    let (s, ..) = sim.connect(Some("X"), 300);
    sim.register(s, "R", InterestSpec::AllKeys, true);
    sim.disconnect(0, s, true);
    for i in 0..20 {
        sim.put(p, "R", &format!("k{i}"));
    }
    let (s, ..) = sim.connect(Some("X"), 300);
    sim.core.ready(s).unwrap();
    let (got, _) = sim.drain(s);
    assert_eq!(got.iter().map(|g| g.0).collect::<Vec<_>>(), [1, 2, 3, 4, 5]);
    let b = sim.core.ack(s, 5).unwrap().unwrap();
    sim.apply(b);
    let (got, _) = sim.drain(s);
    assert_eq!(
        got.iter().map(|g| g.0).collect::<Vec<_>>(),
        [6, 7, 8, 9, 10]
    );
}

#[test]
fn acks_beyond_delivery_are_refused_and_duplicates_attached_ids_conflict() {
    let mut sim = Sim::new();
    let (s, ..) = sim.connect(Some("X"), 300);
    assert!(sim.core.ack(s, 1).is_err());
    assert_eq!(
        sim.core
            .connect(Some(&DurableHello {
                redirect_epoch: None,
                id: "X".into(),
                timeout_secs: 1,
                redundancy: 0,
                failed_primary: None,
                seen: None,
            }))
            .unwrap_err(),
        ConnectError::Attached(s)
    );
}

#[test]
fn expiry_happens_once_at_the_timeout_and_is_reported_once() {
    let mut sim = Sim::new();
    let (s, ..) = sim.connect(Some("X"), 10);
    sim.disconnect(5_000, s, true);
    let (b, ids) = sim.core.tick(14_999);
    assert!(ids.is_empty() && b.is_empty());
    let (b, ids) = sim.core.tick(15_000);
    assert_eq!(ids, ["X"]);
    sim.apply(b);
    // The expired id survives a restart and is reported once.
    let mut core = sim.recover(20_000);
    let c = core
        .connect(Some(&DurableHello {
            redirect_epoch: None,
            id: "X".into(),
            timeout_secs: 10,
            redundancy: 0,
            failed_primary: None,
            seen: None,
        }))
        .unwrap();
    assert_eq!(c.status, QueueStatus::Expired);
    core.disconnect(21_000, c.session, false);
    let c = core
        .connect(Some(&DurableHello {
            redirect_epoch: None,
            id: "X".into(),
            timeout_secs: 10,
            redundancy: 0,
            failed_primary: None,
            seen: None,
        }))
        .unwrap();
    assert_eq!(c.status, QueueStatus::New);
}

/// The stored delivered mark is reserved ahead (one synced write covers many frames) and a
/// restart clamps it to the queue's end: entries that existed may come back flagged, entries
/// appended after the restart never are.
#[test]
fn the_delivered_mark_is_reserved_ahead_and_clamped_at_recovery() {
    use tether::limits::DELIVERED_MARK_RESERVE_ENTRIES as RESERVE;
    use tether::protocol::{FLAG_POSSIBLE_DUPLICATE as D, FLAG_REPLAYED as R};
    let mut sim = Sim::new();
    let (p, _) = sim.core.publisher_session();
    let (s, ..) = sim.connect(Some("X"), 300);
    sim.register(s, "R", InterestSpec::AllKeys, true);
    sim.put(p, "R", "a");
    sim.core.ready(s).unwrap();
    let q = sim.core.session(s).unwrap().queue;
    let stored = |sim: &Sim| sim.store.queue_meta(q).unwrap().unwrap().delivered;
    // The first frame reserves the mark past the end.
    assert_eq!(sim.drain(s).0, [(1, R)]);
    assert_eq!(stored(&sim), 1 + RESERVE);
    // Frames inside the reservation write nothing.
    for k in ["b", "c"] {
        sim.put(p, "R", k);
        let step = sim.core.delivery_step(s);
        assert!(matches!(step, Step::Read { .. }), "{step:?}");
        assert!(
            sim.core
                .will_send(s, sim.core.queue_reports()[0].end_offset)
                .is_none()
        );
    }
    assert_eq!(stored(&sim), 1 + RESERVE);
    // Past the reservation: a new one, from the end.
    for i in 0..RESERVE {
        sim.put(p, "R", &format!("k{i}"));
    }
    let end = 3 + RESERVE;
    assert_eq!(sim.core.queue_reports()[0].end_offset, end);
    let b = sim
        .core
        .will_send(s, 2 + RESERVE)
        .expect("past the reservation");
    sim.apply(b);
    assert_eq!(stored(&sim), end + RESERVE);
    assert!(
        sim.core.will_send(s, end).is_none(),
        "covered by the reservation just made"
    );
    // A crash, then a restart: sent entries are flagged, a new one is not.
    let mut core = sim.recover(10_000);
    sim.core = std::mem::replace(&mut core, NodeCore::new("n1"));
    let (p, _) = sim.core.publisher_session();
    sim.put(p, "R", "new");
    let (s2, status, pending) = sim.connect(Some("X"), 300);
    assert_eq!((status, pending), (QueueStatus::Resumed, Some(end + 1)));
    sim.core.ready(s2).unwrap();
    let (got, _) = sim.drain(s2);
    assert_eq!(got.len() as u64, end + 1);
    assert!(
        got[..end as usize].iter().all(|g| g.1 == R | D),
        "{:?}",
        &got[..4]
    );
    assert_eq!(got[end as usize], (end + 1, R));
    // The client goes away: the stored mark comes back to what was sent, so entries queued
    // while it is away are not flagged after a restart.
    assert_eq!(
        stored(&sim),
        end + RESERVE,
        "the reservation from before the crash"
    );
    sim.disconnect(20_000, s2, true);
    assert_eq!(stored(&sim), end + 1);
    sim.put(p, "R", "away");
    sim.core = sim.recover(30_000);
    let (s3, ..) = sim.connect(Some("X"), 300);
    sim.core.ready(s3).unwrap();
    let (got, _) = sim.drain(s3);
    assert_eq!(got.last(), Some(&(end + 2, R)));
}

#[test]
fn recovery_keeps_durable_state_and_drops_non_durable_queues() {
    let mut sim = Sim::new();
    let (p, _) = sim.core.publisher_session();
    let (x, ..) = sim.connect(Some("X"), 300);
    sim.register(x, "R", InterestSpec::Regex("D-.*".into()), true);
    sim.register(x, "R", InterestSpec::Key("k".into()), false);
    let (nd, ..) = sim.connect(None, 0);
    sim.register(nd, "R", InterestSpec::AllKeys, false);
    sim.put(p, "R", "D-1");
    sim.put(p, "R", "k");
    let before = by_id(sim.core.queue_reports());
    // A crash: no disconnect. Recovery treats X as away since the restart.
    let mut core = sim.recover(50_000);
    let after = by_id(core.queue_reports());
    assert_eq!(after["X"].pending, before["X"].pending);
    assert_eq!(after["X"].end_offset, 2);
    assert_eq!(after["X"].state, "away");
    assert_eq!(
        after["X"].interests.len(),
        1,
        "only durable interest survives"
    );
    assert_eq!(
        core.queue_reports().len(),
        1,
        "the non-durable queue is gone"
    );
    // Timeout counts from the restart.
    assert!(core.tick(50_000 + 299_999).1.is_empty());
    assert_eq!(core.tick(50_000 + 300_000).1, ["X"]);
}

#[derive(Clone, Debug)]
enum Op {
    Put(u8),
    Ready,
    Deliver,
    Ack,
    Away,
    Back,
    Restart,
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (0u8..4).prop_map(Op::Put),
        1 => Just(Op::Ready),
        2 => Just(Op::Deliver),
        1 => Just(Op::Ack),
        1 => Just(Op::Away),
        1 => Just(Op::Back),
        1 => Just(Op::Restart),
    ]
}

proptest! {
    /// Any sequence of publishes, deliveries, acks, disconnects and restarts: every event is
    /// delivered in offset order, none is lost, an event is delivered again only flagged as a
    /// possible duplicate, and the pending count always equals end - acked.
    #[test]
    fn no_loss_and_flagged_redelivery(ops in proptest::collection::vec(op(), 1..80)) {
        let mut sim = Sim::new();
        let (mut p, _) = sim.core.publisher_session();
        let (mut s, ..) = sim.connect(Some("X"), 300);
        sim.register(s, "R", InterestSpec::AllKeys, true);
        let mut attached = true;
        let mut published = 0u64;
        let mut delivered: Vec<u64> = Vec::new();
        let mut last_seen = 0u64;
        let mut acked = 0u64;
        for op in ops {
            match op {
                Op::Put(k) => { sim.put(p, "R", &format!("k{k}")); published += 1; }
                Op::Ready if attached => { sim.core.ready(s).unwrap(); }
                Op::Deliver if attached => {
                    let (got, _) = sim.drain(s);
                    for (o, f) in got {
                        if o <= last_seen {
                            prop_assert!(f & tether::protocol::FLAG_POSSIBLE_DUPLICATE != 0, "unflagged redelivery of {}", o);
                        }
                        last_seen = last_seen.max(o);
                        delivered.push(o);
                    }
                }
                Op::Ack if attached => {
                    let sent = sim.core.session(s).unwrap().sent;
                    if let Some(b) = sim.core.ack(s, sent).unwrap() { sim.apply(b); }
                    acked = acked.max(sent);
                }
                Op::Away if attached => { sim.disconnect(1, s, true); attached = false; }
                Op::Back if !attached => {
                    let (ns, status, pending) = sim.connect(Some("X"), 300);
                    prop_assert_eq!(status, QueueStatus::Resumed);
                    prop_assert_eq!(pending, Some(published - acked));
                    s = ns; attached = true;
                }
                Op::Restart => {
                    sim.core = sim.recover(2);
                    let (np, _) = sim.core.publisher_session();
                    p = np;
                    let (ns, _, pending) = sim.connect(Some("X"), 300);
                    prop_assert_eq!(pending, Some(published - acked));
                    s = ns; attached = true;
                }
                _ => {}
            }
            let q = by_id(sim.core.queue_reports());
            prop_assert_eq!(q["X"].pending, q["X"].end_offset - q["X"].acked_offset);
            prop_assert_eq!(q["X"].end_offset, published);
        }
        // Finally everything not acked is delivered.
        if !attached { let (ns, ..) = sim.connect(Some("X"), 300); s = ns; }
        sim.core.ready(s).unwrap();
        let (got, _) = sim.drain(s);
        delivered.extend(got.iter().map(|g| g.0));
        let mut unique = delivered.clone();
        unique.sort();
        unique.dedup();
        prop_assert_eq!(unique, (1..=published).collect::<Vec<_>>());
    }
}

/// A region holds at most REGEXES_PER_REGION_MAX distinct regexes over every queue (each is
/// tried on every key published there, under the core lock); a regex it already holds may
/// still be registered by another queue, and another region has its own budget.
#[test]
fn distinct_regexes_per_region_are_bounded() {
    use tether::limits::REGEXES_PER_REGION_MAX;
    let mut sim = Sim::new();
    let (a, _, _) = sim.connect(Some("regexes-a"), 60);
    let (b, _, _) = sim.connect(Some("regexes-b"), 60);
    let regex = |n: usize| InterestSpec::Regex(format!("r{n}-[0-9]+"));
    let half = REGEXES_PER_REGION_MAX / 2;
    for n in 0..REGEXES_PER_REGION_MAX {
        let s = if n < half { a } else { b };
        let (_, batch) = sim.core.register(s, "R", &regex(n), true, true).unwrap();
        sim.apply(batch);
    }
    let refused = sim
        .core
        .register(b, "R", &regex(REGEXES_PER_REGION_MAX), true, true)
        .unwrap_err();
    assert_eq!(refused.code, tether::protocol::ErrorCode::LimitExceeded);
    assert!(
        refused.message.contains("distinct interest regexes"),
        "{refused:?}"
    );
    // One the region holds: accepted.
    let (_, batch) = sim.core.register(b, "R", &regex(0), true, true).unwrap();
    sim.apply(batch);
    // Another region has its own budget.
    let (_, batch) = sim
        .core
        .register(b, "S", &regex(REGEXES_PER_REGION_MAX), true, true)
        .unwrap();
    sim.apply(batch);
    // A removed regex makes room.
    let (removed, batch) = sim.core.unregister(a, "R", &regex(1)).unwrap();
    assert!(removed);
    sim.apply(batch);
    let (_, batch) = sim
        .core
        .register(b, "R", &regex(REGEXES_PER_REGION_MAX), true, true)
        .unwrap();
    sim.apply(batch);
    // Every regex still matches its keys and only them.
    let (publisher, _, _) = sim.connect(None, 0);
    for n in [
        0,
        1,
        2,
        half,
        REGEXES_PER_REGION_MAX - 1,
        REGEXES_PER_REGION_MAX,
    ] {
        let key = format!("r{n}-7");
        let want = match n {
            0 => 2,
            1 => 0,
            _ => 1,
        };
        assert_eq!(sim.put(publisher, "R", &key), want, "queues matching {key}");
    }
}

/// Issue 22 point 4: the queues of one authenticated principal hold at most
/// REGEXES_PER_PRINCIPAL_MAX distinct regexes between them (durable queues and non-durable
/// ones, in every region), so one principal cannot take a region's whole room. A regex it
/// holds already may be registered by another of its queues; another principal has its own
/// budget; a client of an open node is not counted. The count stays exact as interest is
/// unregistered, as a non-durable queue goes and across a restart.
#[test]
fn distinct_regexes_per_principal_are_bounded() {
    use tether::limits::REGEXES_PER_PRINCIPAL_MAX as MAX;
    use tether::protocol::ErrorCode;
    let connect = |sim: &mut Sim, id: Option<&str>, who: Option<&str>| {
        let hello = id.map(|id| DurableHello {
            redirect_epoch: None,
            id: id.into(),
            timeout_secs: 60,
            redundancy: 0,
            failed_primary: None,
            seen: None,
        });
        let c = sim.core.connect_as(hello.as_ref(), who).unwrap();
        sim.apply(c.batch);
        c.session
    };
    let regex = |n: usize| InterestSpec::Regex(format!("p{n}-[0-9]+"));
    let register = |sim: &mut Sim, s: u64, region: &str, n: usize, durable: bool| {
        let (_, b) = sim.core.register(s, region, &regex(n), durable, true)?;
        sim.apply(b);
        Ok::<(), tether::protocol::WireError>(())
    };
    let refused = |r: Result<(), tether::protocol::WireError>| {
        let e = r.expect_err("past the principal's regexes");
        assert_eq!(e.code, ErrorCode::LimitExceeded, "{e:?}");
        assert!(e.message.contains("principal \"alice\""), "{e:?}");
    };
    let mut sim = Sim::new();
    let a = connect(&mut sim, Some("alice-1"), Some("alice"));
    let b = connect(&mut sim, Some("alice-2"), Some("alice"));
    let live = connect(&mut sim, None, Some("alice"));
    for n in 0..MAX {
        match n % 3 {
            0 => register(&mut sim, a, "R", n, true),
            1 => register(&mut sim, b, "S", n, true),
            _ => register(&mut sim, live, "R", n, false),
        }
        .unwrap();
    }
    refused(register(&mut sim, a, "R", MAX, true));
    // Held by the non-durable queue in R already: another of her queues may take it; in
    // another region it is another regex.
    register(&mut sim, a, "R", 2, true).unwrap();
    refused(register(&mut sim, a, "S", 2, true));
    // Another principal, and an open node's client, have their own room.
    let bob = connect(&mut sim, Some("bob-1"), Some("bob"));
    register(&mut sim, bob, "R", MAX, true).unwrap();
    let open = connect(&mut sim, Some("open-1"), None);
    for n in 0..=MAX {
        register(&mut sim, open, "O", n, true).unwrap();
    }
    // The non-durable queue goes with its regexes, but for the one `a` holds too.
    sim.disconnect(1, live, false);
    let freed = (0..MAX).filter(|n| n % 3 == 2).count() - 1;
    for k in 0..freed {
        register(&mut sim, a, "R", MAX + 1 + k, true).unwrap();
    }
    refused(register(&mut sim, a, "R", MAX + 1 + freed, true));
    // Counted again from the stored interest after a restart.
    for s in [a, b, bob, open] {
        sim.disconnect(2, s, true);
    }
    sim.core = sim.recover(3);
    let a = connect(&mut sim, Some("alice-1"), Some("alice"));
    refused(register(&mut sim, a, "R", MAX + 1 + freed, true));
    // Unregistering one makes room for one.
    let (removed, b) = sim.core.unregister(a, "R", &regex(0)).unwrap();
    assert!(removed);
    sim.apply(b);
    register(&mut sim, a, "R", MAX + 1 + freed, true).unwrap();
    refused(register(&mut sim, a, "R", MAX + 2 + freed, true));
}

/// Issue 22 point 4: a publish's keys can be matched against their region's regexes outside
/// the core lock, with the region's matcher taken earlier (`Prematch`). The core uses those
/// matches while the matcher is the region's, and matches again itself (counted in the plan,
/// so the driver takes the new matcher) once a regex was added since.
#[test]
fn keys_matched_outside_the_lock_are_used_while_the_regexes_stay() {
    let mut sim = Sim::new();
    let (a, _, _) = sim.connect(Some("a"), 60);
    let (b, _, _) = sim.connect(Some("b"), 60);
    sim.register(a, "R", InterestSpec::Regex("k-[0-9]+".into()), true);
    let (publisher, _, _) = sim.connect(None, 0);
    let matcher = sim.core.regex_matcher("R").expect("R holds a regex");
    assert!(sim.core.regex_matcher("S").is_none());
    let publish = |sim: &mut Sim, key: &str| {
        let ops = [PublishOp::Put {
            region: "R".into(),
            key: key.into(),
            value: b"v".to_vec(),
        }];
        let pre = [Some(Prematch::new(matcher.clone(), key))];
        let plan = sim.plan(publisher, &ops, &pre, &mut |_| true).unwrap();
        sim.store.write(&plan.batch, true).unwrap();
        sim.core.committed(plan.seq, &plan.appended);
        (plan.enqueued, plan.regexes_matched_here)
    };
    assert_eq!(publish(&mut sim, "k-1"), (1, 0), "matched outside the lock");
    assert_eq!(publish(&mut sim, "x-1"), (0, 0));
    // Another queue taking the same regex changes no matcher.
    sim.register(b, "R", InterestSpec::Regex("k-[0-9]+".into()), true);
    assert_eq!(publish(&mut sim, "k-2"), (2, 0));
    // A new regex does: the old matcher would miss it, so the core matches itself.
    sim.register(b, "R", InterestSpec::Regex("x-[0-9]+".into()), true);
    assert_eq!(
        publish(&mut sim, "x-2"),
        (1, 1),
        "matched again under the lock"
    );
    assert_eq!(publish(&mut sim, "k-3"), (2, 1));
}

/// Issue 22 point 12: an event is stored once per queue it matches, so one publish may add
/// at most PUBLISH_FANOUT_BYTES_MAX bytes to its queues: past it, the publish is refused with
/// `limit-exceeded` and changes nothing. Below it, the caller is asked for room for those
/// bytes first (the node's writer queue counts them); without room, nothing changes either.
#[test]
fn a_publishs_fan_out_is_bounded_in_bytes() {
    use tether::core::bytes::event_bytes_max;
    use tether::limits::{PUBLISH_FANOUT_BYTES_MAX, VALUE_BYTES_MAX};
    use tether::protocol::ErrorCode;
    let per_queue = event_bytes_max("n1", "R", "k", VALUE_BYTES_MAX);
    let fits = (PUBLISH_FANOUT_BYTES_MAX as u64 / per_queue) as usize;
    let mut sim = Sim::new();
    let mut sessions = Vec::new();
    for q in 0..=fits {
        let (s, _, _) = sim.connect(Some(&format!("q{q}")), 60);
        sim.register(s, "R", InterestSpec::AllKeys, true);
        sessions.push(s);
    }
    let (publisher, _, _) = sim.connect(None, 0);
    let ops = [PublishOp::Put {
        region: "R".into(),
        key: "k".into(),
        value: vec![1; VALUE_BYTES_MAX],
    }];
    let unchanged = |sim: &Sim| {
        assert!(sim.core.queue_reports().iter().all(|r| r.end_offset == 0));
        assert_eq!(sim.store.region_get("R", "k").unwrap(), None);
    };
    let Err(PublishRefused::Error(e)) = sim.plan(publisher, &ops, &[], &mut |_| true) else {
        panic!("one queue too many: refused");
    };
    assert_eq!(e.code, ErrorCode::LimitExceeded, "{e:?}");
    assert!(e.message.contains("nothing was published"), "{e:?}");
    unchanged(&sim);
    // One queue fewer: within the bound, once the caller has room for it.
    sim.disconnect(1, sessions.pop().unwrap(), false);
    let mut asked = Vec::new();
    let refused = sim.plan(publisher, &ops, &[], &mut |b| {
        asked.push(b);
        false
    });
    let want = fits as u64 * per_queue;
    assert!(
        matches!(refused, Err(PublishRefused::NoRoom { fanout_bytes }) if fanout_bytes == want),
        "{refused:?}"
    );
    assert_eq!(asked, [want]);
    unchanged(&sim);
    let plan = sim.plan(publisher, &ops, &[], &mut |_| true).unwrap();
    assert_eq!(plan.enqueued, fits as u64);
}

/// Issue 22 point 7: a durable id stays its owner's after its queue expired (also across a
/// restart): another principal can neither take it nor learn that it expired; its owner
/// learns `expired` once. A queue created while the node was open belongs to the first
/// principal that resumes it.
#[test]
fn an_expired_durable_id_stays_its_owners() {
    use tether::core::ConnectError;
    let hello = |id: &str| DurableHello {
        redirect_epoch: None,
        id: id.into(),
        timeout_secs: 1,
        redundancy: 0,
        failed_primary: None,
        seen: None,
    };
    let forbidden = |r: Result<tether::core::Connected, ConnectError>| match r {
        Err(ConnectError::Invalid(e)) => {
            assert_eq!(e.code, tether::protocol::ErrorCode::Forbidden, "{e:?}");
            assert!(e.message.contains("another principal"), "{e:?}");
        }
        Err(ConnectError::Attached(_)) => panic!("expected forbidden, got attached"),
        Ok(c) => panic!("expected forbidden, got {:?}", c.status),
    };
    let mut sim = Sim::new();
    for id in ["alices", "open"] {
        let owner = (id == "alices").then_some("alice");
        let c = sim.core.connect_as(Some(&hello(id)), owner).unwrap();
        sim.apply(c.batch);
        sim.disconnect(0, c.session, true);
    }
    let (b, mut ids) = sim.core.tick(5_000);
    sim.apply(b);
    ids.sort();
    assert_eq!(ids, ["alices", "open"]);
    forbidden(sim.core.connect_as(Some(&hello("alices")), Some("bob")));
    let mut core = sim.recover(6_000);
    forbidden(core.connect_as(Some(&hello("alices")), Some("bob")));
    let c = core
        .connect_as(Some(&hello("alices")), Some("alice"))
        .unwrap();
    assert_eq!(c.status, QueueStatus::Expired);
    // An id no principal owned: anyone may take it, once told it expired.
    let c = core.connect_as(Some(&hello("open")), Some("bob")).unwrap();
    assert_eq!(c.status, QueueStatus::Expired);
    // A queue created while the node was open: the first principal to resume it owns it.
    let mut sim = Sim::new();
    let c = sim.core.connect_as(Some(&hello("old")), None).unwrap();
    sim.apply(c.batch);
    sim.disconnect(0, c.session, true);
    let c = sim
        .core
        .connect_as(Some(&hello("old")), Some("carol"))
        .unwrap();
    assert_eq!(c.status, QueueStatus::Resumed);
    sim.apply(c.batch);
    sim.disconnect(0, c.session, true);
    forbidden(sim.core.connect_as(Some(&hello("old")), Some("bob")));
    let mut core = sim.recover(500);
    forbidden(core.connect_as(Some(&hello("old")), Some("bob")));
}

/// A queue's interest is bounded in bytes as well as in count: it travels with every
/// replication message of the queue, which must fit a peer message.
#[test]
fn interest_bytes_per_queue_are_bounded() {
    use tether::limits::{INTEREST_BYTES_PER_QUEUE_MAX, KEY_BYTES_MAX};
    let mut sim = Sim::new();
    let (s, _, _) = sim.connect(Some("big-interest"), 60);
    let batch = |n: usize| -> Vec<String> {
        (0..500)
            .map(|i| format!("{n:03}-{i:04}-{}", "k".repeat(KEY_BYTES_MAX - 9)))
            .collect()
    };
    let mut accepted = 0;
    let refused = loop {
        let spec = InterestSpec::Keys(batch(accepted));
        match sim.core.register(s, "R", &spec, true, true) {
            Ok((_, b)) => {
                sim.apply(b);
                accepted += 1;
            }
            Err(e) => break e,
        }
        assert!(accepted < 20, "no byte limit on interest");
    };
    assert_eq!(refused.code, tether::protocol::ErrorCode::LimitExceeded);
    assert!(refused.message.contains("bytes of interest"), "{refused:?}");
    // Everything accepted is within the limit, and the refused batch changed nothing.
    assert_eq!(
        accepted,
        INTEREST_BYTES_PER_QUEUE_MAX / (500 * (KEY_BYTES_MAX + 1 + 16))
    );
    // Registering again what is held costs nothing.
    let (_, b) = sim
        .core
        .register(s, "R", &InterestSpec::Keys(batch(0)), true, true)
        .unwrap();
    sim.apply(b);
}

/// A queue whose client left with an ack not yet stored is not handed over until it is: the
/// copies are shipped the stored ack (`acked_stored`), and a handover confirmed on an older
/// one would leave the taker with events the client acknowledged, which it sends again (a
/// cluster soak run ended with 2,117 such events pending on four handed-over queues).
#[test]
fn a_queue_is_handed_over_only_once_its_client_acks_are_stored() {
    let mut sim = Sim::new();
    let (p, _) = sim.core.publisher_session();
    let (s, _, _) = sim.connect(Some("X"), 300);
    sim.register(s, "R", InterestSpec::AllKeys, true);
    for k in ["a", "b", "c"] {
        sim.put(p, "R", k);
    }
    sim.core.ready(s).unwrap();
    sim.drain(s);
    let qid = sim.core.session(s).unwrap().queue;
    // The client acks everything and leaves before its ack batch is committed.
    let ack = sim.core.ack(s, 3).unwrap().unwrap();
    sim.disconnect(1_000, s, true);
    assert!(
        !sim.core.begin_handover("X"),
        "handed over with its last ack not stored"
    );
    sim.apply(ack);
    sim.core.ack_stored(qid, 3);
    assert!(sim.core.begin_handover("X"));
}
