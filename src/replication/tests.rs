//! Focused tests of the replication cores. The randomized whole-cluster checks live in
//! `tests/replication_sim.rs`.

use super::*;

const P: NodeId = NodeId(1);
const S: NodeId = NodeId(2);

fn log(start: Offset, end: Offset, runs: &[(Epoch, Offset)]) -> LogState {
    let epochs = runs
        .iter()
        .map(|&(epoch, first)| EpochStart { epoch, first })
        .collect();
    LogState::new(start, end, epochs).expect("valid test log")
}

fn replica(epoch: Epoch, acked: Offset, log: LogState) -> Replica {
    Replica::recover(ReplicaState { epoch, acked, log }).expect("valid test state")
}

fn config() -> ShipperConfig {
    ShipperConfig {
        batch_entries_max: 4,
        batches_in_flight_per_peer_max: 2,
        ..Default::default()
    }
}

fn append(t: Transmit<ToSecondary>) -> AppendHeader {
    match t.message {
        ToSecondary::Append(h) => h,
        other => panic!("expected an append, got {other:?}"),
    }
}

fn write(d: Decision) -> Write {
    match d {
        Decision::Write(w) => w,
        other => panic!("expected a write, got {other:?}"),
    }
}

/// Delivers everything between a shipper and its replicas, with every write durable at once,
/// until both sides are quiet.
fn pump(shipper: &mut Shipper, replicas: &mut [(NodeId, &mut Replica)], now_ms: u64) {
    for _ in 0..1_000 {
        let Some(t) = shipper.poll_transmit(now_ms) else {
            return;
        };
        // A peer left out of `replicas` is down: its messages are lost.
        let Some((_, r)) = replicas.iter_mut().find(|(id, _)| *id == t.to) else {
            continue;
        };
        let decision = match &t.message {
            ToSecondary::Append(h) => r.on_append(P, h),
            ToSecondary::Snapshot(h) => r.on_snapshot(P, h),
        };
        match decision {
            Decision::Reply(reply) => shipper.on_reply(t.to, reply, now_ms),
            Decision::Write(w) => {
                if let Some(ack) = r.on_durable(w.id) {
                    shipper.on_reply(t.to, ack.message, now_ms);
                }
            }
            Decision::Ignore | Decision::Pending => {}
        }
    }
    panic!("pump did not settle");
}

#[test]
fn log_state_tracks_epochs_across_trim_and_truncate() {
    let mut l = LogState::empty();
    l.append(1, 5);
    l.append(3, 8);
    assert_eq!(l.epoch_at(4), Some(1));
    assert_eq!(l.epoch_at(5), Some(3));
    assert_eq!(l.run_end(2), Some(5));
    l.trim(6);
    // The entry below start keeps its epoch: a primary needs it as prev_epoch.
    assert_eq!(l.epoch_at(5), Some(3));
    assert_eq!(l.epoch_at(4), None);
    assert_eq!(l.epochs(), &[EpochStart { epoch: 3, first: 5 }]);
    l.truncate(6);
    assert_eq!((l.start(), l.end(), l.epoch_at(5)), (6, 6, Some(3)));
    assert_eq!(LogState::new(3, 2, vec![]), Err(InvalidLog::StartAfterEnd));
    assert_eq!(
        LogState::new(0, 2, vec![]),
        Err(InvalidLog::EpochRunsNotCovering)
    );
}

#[test]
fn stale_epoch_is_fenced_on_both_sides() {
    let mut r = replica(5, 0, log(0, 3, &[(5, 0)]));
    let mut old = Shipper::new(4, log(0, 3, &[(4, 0)]), 0, config());
    old.set_secondaries(&[S], 0);
    let h = append(old.poll_transmit(0).expect("probe"));
    let decision = r.on_append(P, &h);
    assert_eq!(decision, Decision::Reply(Reply::Fenced { epoch: 5 }));
    let Decision::Reply(reply) = decision else {
        unreachable!()
    };
    old.on_reply(S, reply, 1);
    assert_eq!(old.fenced(), Some(5));
    assert_eq!(old.poll_transmit(1), None, "a fenced primary ships nothing");
    // A primary that hears from a rival: older rival is told, newer rival fences us.
    let mut current = Shipper::new(5, LogState::empty(), 0, config());
    assert_eq!(
        current.on_rival_primary(4),
        Some(Reply::Fenced { epoch: 5 })
    );
    assert_eq!(current.fenced(), None);
    assert_eq!(current.on_rival_primary(6), None);
    assert_eq!(current.fenced(), Some(6));
}

#[test]
fn gap_is_answered_with_mismatch_and_the_primary_resumes_there() {
    let mut p = Shipper::new(1, log(0, 10, &[(1, 0)]), 0, config());
    let mut r = replica(1, 0, log(0, 3, &[(1, 0)]));
    p.set_secondaries(&[S], 0);
    // The probe at the primary's end finds a gap.
    let probe = append(p.poll_transmit(0).expect("probe"));
    assert_eq!((probe.first, probe.last), (10, 10));
    let d = r.on_append(P, &probe);
    assert_eq!(
        d,
        Decision::Reply(Reply::Mismatch {
            epoch: 1,
            end_hint: 3,
            batch: probe.batch
        })
    );
    let Decision::Reply(reply) = d else {
        unreachable!()
    };
    p.on_reply(S, reply, 1);
    let h = append(p.poll_transmit(1).expect("resume"));
    assert_eq!((h.first, h.last, h.prev_epoch), (3, 7, Some(1)));
    let w = write(r.on_append(P, &h));
    assert_eq!(
        w.op,
        WriteOp::Append {
            truncate_to: None,
            skip: 0,
            range: 3..7,
            epoch: 1
        }
    );
    // A stale mismatch (for a batch no longer on the wire) does not rewind the pipeline.
    p.on_reply(
        S,
        Reply::Mismatch {
            epoch: 1,
            end_hint: 0,
            batch: probe.batch,
        },
        2,
    );
    let ack = r.on_durable(w.id).expect("ack");
    p.on_reply(S, ack.message, 2);
    pump(&mut p, &mut [(S, &mut r)], 2);
    assert_eq!(r.log().end(), 10);
    assert_eq!(p.replicated_end(), 10);
}

#[test]
fn duplicate_batch_is_acked_without_rewriting() {
    let mut r = replica(2, 0, log(0, 0, &[]));
    let h = AppendHeader {
        epoch: 2,
        batch: 7,
        first: 0,
        last: 4,
        prev_epoch: None,
        entries_epoch: 2,
        log_end: 4,
        acked: 0,
    };
    let w = write(r.on_append(P, &h));
    // Held but not durable: the duplicate waits for the write's ack.
    assert_eq!(r.on_append(P, &h), Decision::Pending);
    let ack = r.on_durable(w.id).expect("ack after durable");
    assert_eq!(
        ack,
        Transmit {
            to: P,
            message: Reply::Ack { epoch: 2, end: 4 }
        }
    );
    assert_eq!(
        r.on_append(P, &h),
        Decision::Reply(Reply::Ack { epoch: 2, end: 4 })
    );
    // A partly held batch writes only its new tail.
    let h2 = AppendHeader {
        first: 2,
        last: 6,
        prev_epoch: Some(2),
        log_end: 6,
        ..h
    };
    let w2 = write(r.on_append(P, &h2));
    assert_eq!(
        w2.op,
        WriteOp::Append {
            truncate_to: None,
            skip: 2,
            range: 4..6,
            epoch: 2
        }
    );
}

#[test]
fn divergent_tail_is_truncated() {
    // The copy followed epoch 1 to offset 8; the epoch-2 primary kept only [0, 5) of it.
    let mut r = replica(1, 2, log(0, 8, &[(1, 0)]));
    let mut p = Shipper::new(2, log(0, 5, &[(1, 0)]), 2, config());
    p.on_local_append(7);
    p.set_secondaries(&[S], 0);
    // Probe at 7: entry 6 has epoch 1 here but 2 there, so resume at the run start (the ack).
    let probe = append(p.poll_transmit(0).expect("probe"));
    let Decision::Reply(reply) = r.on_append(P, &probe) else {
        panic!("expected a reply")
    };
    assert_eq!(
        reply,
        Reply::Mismatch {
            epoch: 2,
            end_hint: 2,
            batch: probe.batch
        }
    );
    p.on_reply(S, reply, 0);
    let h = append(p.poll_transmit(0).expect("batch"));
    assert_eq!((h.first, h.last, h.entries_epoch), (2, 5, 1));
    let w = write(r.on_append(P, &h));
    // [2, 5) is held with the same epoch. [7, 8) is an epoch-1 entry at or beyond the epoch-2
    // primary's end (7): it cannot be in its log, so it goes now.
    assert_eq!(
        w.op,
        WriteOp::Append {
            truncate_to: Some(7),
            skip: 3,
            range: 5..5,
            epoch: 1
        }
    );
    r.on_durable(w.id);
    p.on_reply(S, Reply::Ack { epoch: 2, end: 5 }, 0);
    // The next batch conflicts at 5 (epoch 1 here, 2 there): truncate, then write.
    let h = append(p.poll_transmit(0).expect("batch"));
    let w = write(r.on_append(P, &h));
    assert_eq!(
        w.op,
        WriteOp::Append {
            truncate_to: Some(5),
            skip: 0,
            range: 5..7,
            epoch: 2
        }
    );
    let ack = r.on_durable(w.id).expect("ack");
    p.on_reply(S, ack.message, 0);
    pump(&mut p, &mut [(S, &mut r)], 0);
    assert_eq!(r.log(), p.log());
    assert_eq!(p.replicated_end(), 7);
}

#[test]
fn snapshot_when_the_secondary_is_behind_start() {
    let mut p = Shipper::new(3, log(0, 20, &[(1, 0), (3, 12)]), 15, config());
    p.on_local_trim(15);
    let mut r = Replica::new();
    p.set_secondaries(&[S], 0);
    let probe = append(p.poll_transmit(0).expect("probe"));
    let Decision::Reply(reply) = r.on_append(P, &probe) else {
        panic!("expected a reply")
    };
    assert_eq!(
        reply,
        Reply::Mismatch {
            epoch: 3,
            end_hint: 0,
            batch: probe.batch
        }
    );
    p.on_reply(S, reply, 0);
    let t = p.poll_transmit(0).expect("snapshot");
    let ToSecondary::Snapshot(h) = t.message else {
        panic!("expected a snapshot")
    };
    assert_eq!((h.log.start(), h.log.end(), h.acked), (15, 20, 15));
    assert_eq!(
        p.poll_transmit(0),
        None,
        "nothing else while a snapshot is on the wire"
    );
    let w = write(r.on_snapshot(P, &h));
    assert_eq!(w.op, WriteOp::Snapshot { start: 15, end: 20 });
    assert_eq!(w.state.log, *p.log());
    assert_eq!(w.state.acked, 15);
    // A duplicate of the snapshot installs nothing again.
    assert_eq!(r.on_snapshot(P, &h), Decision::Pending);
    let ack = r.on_durable(w.id).expect("ack");
    p.on_reply(S, ack.message, 1);
    assert_eq!(
        r.on_snapshot(P, &h),
        Decision::Reply(Reply::Ack { epoch: 3, end: 20 })
    );
    assert_eq!(p.replicated_end(), 20);
    p.on_local_append(22);
    pump(&mut p, &mut [(S, &mut r)], 1);
    assert_eq!(r.log(), p.log());
}

#[test]
fn ack_never_precedes_durability() {
    let mut p = Shipper::new(1, log(0, 6, &[(1, 0)]), 0, config());
    let mut r = Replica::new();
    p.set_secondaries(&[S], 0);
    let probe = append(p.poll_transmit(0).expect("probe"));
    let Decision::Reply(reply) = r.on_append(P, &probe) else {
        panic!("expected a reply")
    };
    p.on_reply(S, reply, 0);
    let h1 = append(p.poll_transmit(0).expect("first batch"));
    let w1 = write(r.on_append(P, &h1));
    // Unconfirmed peer: one batch at a time. Make it confirmed with an ack of nothing new.
    assert_eq!(p.poll_transmit(0), None);
    assert_eq!(
        p.replicated_end(),
        0,
        "nothing is durable on the secondary yet"
    );
    let ack = r.on_durable(w1.id).expect("ack");
    assert_eq!(ack.message, Reply::Ack { epoch: 1, end: 4 });
    p.on_reply(S, ack.message, 0);
    assert_eq!(p.replicated_end(), 4);
    let h2 = append(p.poll_transmit(0).expect("second batch"));
    let w2 = write(r.on_append(P, &h2));
    // A crash loses the un-durable write: the copy restarts from its last durable state.
    let mut r = Replica::recover(w1.state.clone()).expect("durable state");
    assert_eq!(r.log().end(), 4);
    drop(w2);
    p.on_tick(RETRANSMIT_MS);
    let h2 = append(p.poll_transmit(RETRANSMIT_MS).expect("retransmit"));
    assert_eq!((h2.first, h2.last), (4, 6));
    let w2 = write(r.on_append(P, &h2));
    assert_eq!(
        r.on_durable(w2.id).map(|t| t.message),
        Some(Reply::Ack { epoch: 1, end: 6 })
    );
}

#[test]
fn pending_truncation_holds_back_acks() {
    // Durable epoch-1 entries [0, 6); an epoch-2 batch replaces [3, 6) but is not durable yet.
    let mut r = replica(1, 0, log(0, 6, &[(1, 0)]));
    let h = AppendHeader {
        epoch: 2,
        batch: 0,
        first: 3,
        last: 5,
        prev_epoch: Some(1),
        entries_epoch: 2,
        log_end: 5,
        acked: 0,
    };
    let w = write(r.on_append(P, &h));
    assert_eq!(
        w.op,
        WriteOp::Append {
            truncate_to: Some(3),
            skip: 0,
            range: 3..5,
            epoch: 2
        }
    );
    // A heartbeat at 3 must not ack [3, 6) of the old epoch that the write is replacing.
    let hb = AppendHeader {
        first: 3,
        last: 3,
        batch: 1,
        ..h
    };
    assert_eq!(
        r.on_append(P, &hb),
        Decision::Reply(Reply::Ack { epoch: 2, end: 3 })
    );
    assert_eq!(
        r.on_durable(w.id).map(|t| t.message),
        Some(Reply::Ack { epoch: 2, end: 5 })
    );
}

#[test]
fn replicated_end_waits_for_every_secondary_and_never_falls() {
    let mut p = Shipper::new(1, LogState::empty(), 0, config());
    p.on_local_append(3);
    assert_eq!(p.replicated_end(), 3, "no secondaries: the local end");
    let mut a = Replica::new();
    let mut b = Replica::new();
    p.set_secondaries(&[NodeId(2), NodeId(3)], 0);
    assert_eq!(
        p.replicated_end(),
        3,
        "a joining secondary does not pull it back"
    );
    assert!(!p.peer_in_sync(NodeId(2)));
    p.on_local_append(9);
    pump(&mut p, &mut [(NodeId(2), &mut a)], 0);
    assert_eq!(p.replicated_end(), 3, "secondary 3 has not acked");
    // Its probe was lost; the retransmit timeout restarts its pipeline.
    p.on_tick(RETRANSMIT_MS);
    pump(
        &mut p,
        &mut [(NodeId(2), &mut a), (NodeId(3), &mut b)],
        RETRANSMIT_MS,
    );
    assert_eq!(p.replicated_end(), 9);
    assert!(p.peer_in_sync(NodeId(2)) && p.peer_in_sync(NodeId(3)));
    assert_eq!(p.peer_lag(NodeId(3)), Some(0));
    // Acks travel with heartbeats and move the copies' acked (never beyond what they hold).
    p.on_client_ack(7);
    pump(
        &mut p,
        &mut [(NodeId(2), &mut a), (NodeId(3), &mut b)],
        RETRANSMIT_MS,
    );
    assert_eq!((a.acked(), b.acked()), (7, 7));
    p.on_client_ack(100);
    assert_eq!(p.acked(), 9, "the client ack is capped at replicated_end");
    a.on_ack_offset(2);
    assert_eq!(a.acked(), 7, "acked never moves backwards");
    let trim = a.trim(100).expect("trim");
    assert_eq!(trim.op, WriteOp::Trim { start: 7 });
}

#[test]
fn promotion_keeps_the_log_and_starts_replicated_end_at_acked() {
    let r = replica(1, 4, log(0, 9, &[(1, 0)]));
    let p = r.promote(2, config());
    assert_eq!(
        (p.epoch(), p.log().end(), p.acked(), p.replicated_end()),
        (2, 9, 4, 4)
    );
}

#[test]
fn metadata_change_sends_every_idle_secondary_a_message_at_once() {
    let mut p = Shipper::new(1, LogState::empty(), 0, config());
    p.on_local_append(2);
    let mut a = Replica::new();
    p.set_secondaries(&[NodeId(2)], 0);
    pump(&mut p, &mut [(NodeId(2), &mut a)], 0);
    assert!(p.peer_in_sync(NodeId(2)));
    // Idle and within the heartbeat time: nothing to send.
    assert!(p.poll_transmit(1).is_none());
    p.on_metadata_change();
    assert_eq!(p.poll_timeout(), Some(0), "due at once");
    let h = append(p.poll_transmit(1).expect("a message for the new metadata"));
    assert_eq!((h.first, h.last), (2, 2), "no entries");
    assert!(p.poll_transmit(1).is_none(), "one message per change");
}

#[test]
fn a_pipeline_restart_supersedes_what_was_polled_before_it() {
    let mut p = Shipper::new(1, log(0, 8, &[(1, 0)]), 0, config());
    let mut r = Replica::new();
    assert_eq!(p.pipeline(S), None, "not a secondary yet");
    p.set_secondaries(&[S], 0);
    let start = p.pipeline(S).expect("a secondary");
    let probe = append(p.poll_transmit(0).expect("probe"));
    let Decision::Reply(reply) = r.on_append(P, &probe) else {
        panic!("expected a reply")
    };
    p.on_reply(S, reply, 0);
    let h1 = append(p.poll_transmit(0).expect("first batch"));
    assert_eq!(
        p.pipeline(S),
        Some(start),
        "answers and sends keep the pipeline"
    );
    // Unanswered for the retransmit timeout: the batch polled before is superseded and comes
    // again, polled in the new pipeline.
    p.on_tick(RETRANSMIT_MS);
    let after_timeout = p.pipeline(S).expect("a secondary");
    assert_ne!(after_timeout, start);
    let again = append(p.poll_transmit(RETRANSMIT_MS).expect("sent again"));
    assert_eq!((again.first, again.last), (h1.first, h1.last));
    // A lost connection restarts it too.
    p.on_peer_lost(S);
    assert_ne!(p.pipeline(S), Some(after_timeout));
    // What the new pipeline sends still reaches the copy in full.
    let w = write(r.on_append(P, &append(p.poll_transmit(RETRANSMIT_MS).expect("resent"))));
    let ack = r.on_durable(w.id).expect("ack");
    p.on_reply(S, ack.message, RETRANSMIT_MS);
    pump(&mut p, &mut [(S, &mut r)], RETRANSMIT_MS);
    assert_eq!(p.replicated_end(), 8);
}

#[test]
fn a_secondary_that_lost_what_it_acknowledged_is_out_of_sync_and_reported() {
    let mut p = Shipper::new(1, LogState::empty(), 0, config());
    p.on_local_append(6);
    let mut r = Replica::new();
    p.set_secondaries(&[S], 0);
    pump(&mut p, &mut [(S, &mut r)], 0);
    assert!(p.peer_in_sync(S));
    assert_eq!(p.replicated_end(), 6);
    assert_eq!(
        p.regressed_peers().count(),
        0,
        "a normal catch-up is no regression"
    );

    // The secondary's copy is dropped and started again, empty (as a node whose metadata lags
    // behind may do): the next batch does not attach and its hint lies below what it acked.
    let mut fresh = Replica::new();
    p.on_local_append(8);
    let h = append(p.poll_transmit(1).expect("the new entries"));
    assert_eq!((h.first, h.last), (6, 8));
    let Decision::Reply(reply) = fresh.on_append(P, &h) else {
        panic!("expected a mismatch")
    };
    assert!(matches!(reply, Reply::Mismatch { end_hint: 0, .. }));
    p.on_reply(S, reply, 1);
    assert!(!p.peer_in_sync(S), "what it acknowledged is gone");
    assert_eq!(p.regressed_peers().collect::<Vec<_>>(), vec![S]);
    assert_eq!(p.peer_lag(S), Some(8), "it counts as holding nothing");
    assert_eq!(
        p.replicated_end(),
        6,
        "delivered entries stay delivered, and nothing more is until it holds them"
    );

    // It is sent the whole log again; once it acknowledges everything it holds it again (the
    // driver still takes it out of the replica set: metadata must see it as syncing).
    pump(&mut p, &mut [(S, &mut fresh)], 1);
    assert_eq!(fresh.log().end(), 8);
    assert_eq!(p.replicated_end(), 8);
    assert_eq!(p.regressed_peers().collect::<Vec<_>>(), vec![S]);
    // Leaving the replica set forgets it; joining again starts afresh.
    p.set_secondaries(&[], 2);
    p.set_secondaries(&[S], 2);
    assert_eq!(p.regressed_peers().count(), 0);
    assert!(
        !p.peer_in_sync(S),
        "a rejoining secondary must acknowledge again"
    );
}
