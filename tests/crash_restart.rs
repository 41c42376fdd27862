//! kill -9 of a real server process while durable clients are away (and while one is
//! connected), then a restart on the same data directory: queues, exact pending counts,
//! durable interest and region values come back; replay delivers every event exactly once in
//! order, plus flagged duplicates for what was delivered and not acknowledged. And the other
//! way a node dies: a bug (a panic on any thread) aborts the process.

mod common;

use std::collections::HashSet;
use std::time::Duration;

use common::*;
use tether::client::Interest;
use tether::protocol::{PublishOp, QueueStatus};

async fn publish(server: &ServerProc, region: &str, range: std::ops::Range<u32>) {
    let c = server.builder().connect().await.unwrap();
    let ops: Vec<PublishOp> = range
        .map(|i| PublishOp::Put {
            region: region.into(),
            key: format!("k{i}"),
            value: format!("v{i}").into_bytes(),
        })
        .collect();
    for chunk in ops.chunks(500) {
        c.publish(chunk.to_vec()).await.unwrap();
    }
    c.close(false).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill9_restart_keeps_queues_counts_interest_and_values() {
    let dir = tempfile::tempdir().unwrap();
    let server = ServerProc::start(dir.path(), &[]);
    // X: durable regex interest, processes and acks the first 100 events, then goes away.
    let x = server
        .builder()
        .durable("X", 600)
        .ack_interval(Duration::from_millis(10))
        .connect()
        .await
        .unwrap();
    x.region("R")
        .register(Interest::regex("k.*"))
        .await
        .unwrap();
    x.ready_for_events().await.unwrap();
    let mut ev = x.events().unwrap();
    until_live(&mut ev, "R").await;
    publish(&server, "R", 0..100).await;
    take_events(&mut ev, 100).await;
    ev.commit();
    x.close(true).await.unwrap();
    // Y: durable key-list interest, never ready.
    let y = server.builder().durable("Y", 600).connect().await.unwrap();
    y.region("R")
        .register(Interest::keys(["k5", "k1500"]))
        .await
        .unwrap();
    y.close(true).await.unwrap();
    // Z: connected at the moment of the kill, with delivered but unacknowledged events.
    let z = server
        .builder()
        .durable("Z", 600)
        .ack_interval(Duration::from_secs(3600))
        .connect()
        .await
        .unwrap();
    z.region("R").register(Interest::all_keys()).await.unwrap();
    z.ready_for_events().await.unwrap();
    let mut zev = z.events().unwrap();
    until_live(&mut zev, "R").await;
    publish(&server, "R", 100..2000).await;
    let z_first = take_events(&mut zev, 50).await;
    let pre_ids: HashSet<String> = entries(&z_first)
        .iter()
        .map(|e| e.event_id.to_string())
        .collect();
    server.kill9();
    drop(zev);
    z.crash();

    let server = ServerProc::start(dir.path(), &[]);
    // Region values survived.
    let c = server.builder().connect().await.unwrap();
    assert_eq!(
        c.region("R").get("k1999").await.unwrap().as_deref(),
        Some(&b"v1999"[..])
    );
    c.close(false).await.unwrap();

    // X: exactly the 1,900 events published after its acked offset, in order, once each.
    let x = server.builder().durable("X", 600).connect().await.unwrap();
    assert_eq!(
        (x.queue_status(), x.pending()),
        (QueueStatus::Resumed, Some(1900))
    );
    x.ready_for_events().await.unwrap();
    let got = until_live(&mut x.events().unwrap(), "R").await;
    let e = entries(&got);
    assert_eq!(e.len(), 1900);
    for (i, ev) in e.iter().enumerate() {
        assert_eq!(ev.key, format!("k{}", i + 100));
        assert!(ev.replayed && !ev.possible_duplicate, "{ev:?}");
    }
    assert!(e.windows(2).all(|w| w[0].offset + 1 == w[1].offset));

    // Y: its durable key-list interest survived (k5 was put before Y registered: only k1500
    // was queued), and it keeps matching after the restart.
    let y = server.builder().durable("Y", 600).connect().await.unwrap();
    assert_eq!(y.pending(), Some(1));
    y.ready_for_events().await.unwrap();
    let mut yev = y.events().unwrap();
    assert_eq!(keys(&until_live(&mut yev, "R").await), ["k1500"]);

    // Z: every event once; those written to Z before the kill (at least the 50 it saw, maybe
    // more that were in flight) are flagged possible duplicates, and only those: a prefix.
    let z = server.builder().durable("Z", 600).connect().await.unwrap();
    assert_eq!(
        (z.queue_status(), z.pending()),
        (QueueStatus::Resumed, Some(1900))
    );
    z.ready_for_events().await.unwrap();
    let got = until_live(&mut z.events().unwrap(), "R").await;
    let e = entries(&got);
    assert_eq!(e.len(), 1900);
    for (i, ev) in e.iter().enumerate() {
        assert_eq!(ev.key, format!("k{}", i + 100));
        if i < 50 {
            assert!(ev.possible_duplicate, "event {i}: {ev:?}");
            assert!(
                pre_ids.contains(&ev.event_id.to_string()),
                "a redelivery keeps its event id"
            );
        }
    }
    let flagged = e.iter().filter(|e| e.possible_duplicate).count();
    assert!(
        e[..flagged].iter().all(|e| e.possible_duplicate),
        "flags form a prefix"
    );

    // Event ids stay unique across the restart.
    let before: HashSet<String> = e.iter().map(|e| e.event_id.to_string()).collect();
    let w = server.builder().durable("W", 600).connect().await.unwrap();
    w.region("R").register(Interest::all_keys()).await.unwrap();
    w.ready_for_events().await.unwrap();
    let mut wev = w.events().unwrap();
    until_live(&mut wev, "R").await;
    publish(&server, "R", 0..100).await;
    let after = take_events(&mut wev, 100).await;
    for ev in entries(&after) {
        assert!(
            !before.contains(&ev.event_id.to_string()),
            "event id {} reused after restart",
            ev.event_id
        );
    }
    // Y's recovered interest matches new publishes (the batch above holds k5).
    assert_eq!(keys(&take_events(&mut yev, 1).await), ["k5"]);
}

/// Set in the environment of the child process `a_panic_on_any_thread_aborts_the_process`
/// starts: `hook` installs `tether::bug::stop_on_panic`, `none` does not.
const PANIC_CHILD_ENV: &str = "TETHER_TEST_PANIC_CHILD";
/// Printed by the child when it survives the panic.
const WENT_ON: &str = "the process went on after the panic";

/// The child process's body (this test binary, started again by the test below with
/// `PANIC_CHILD_ENV` set; run by the harness on its own it has nothing to do). A task panics;
/// tokio catches the panic in the task's handle and the runtime goes on, unless the hook stops
/// the process first.
#[test]
fn panic_child_process() {
    let Ok(mode) = std::env::var(PANIC_CHILD_ENV) else {
        return;
    };
    if mode == "hook" {
        tether::bug::stop_on_panic();
    }
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .build()
        .unwrap();
    let joined = rt.block_on(async { tokio::spawn(async { panic!("a bug in a task") }).await });
    assert!(joined.is_err(), "the task panicked");
    println!("{WENT_ON}");
}

/// A bug stops the node: with `stop_on_panic` (which the `tether` binary installs first thing)
/// a panic on a runtime's worker aborts the whole process once reported, instead of being
/// caught by the runtime while the rest of the node goes on with the state the panic left.
#[test]
fn a_panic_on_any_thread_aborts_the_process() {
    use std::os::unix::process::ExitStatusExt;
    let run = |mode: &str| {
        std::process::Command::new(std::env::current_exe().unwrap())
            .args([
                "--exact",
                "panic_child_process",
                "--nocapture",
                "--test-threads=1",
            ])
            .env(PANIC_CHILD_ENV, mode)
            .output()
            .unwrap()
    };
    // The control: without the hook the runtime catches the panic and the process goes on.
    let without = run("none");
    let out = String::from_utf8_lossy(&without.stdout);
    assert!(without.status.success(), "{without:?}");
    assert!(out.contains(WENT_ON), "{out}");
    // With it: aborted (SIGABRT) after the panic's report and the stopping line.
    let with = run("hook");
    let (out, err) = (
        String::from_utf8_lossy(&with.stdout),
        String::from_utf8_lossy(&with.stderr),
    );
    assert_eq!(with.status.signal(), Some(libc::SIGABRT), "{with:?}");
    assert!(!out.contains(WENT_ON), "{out}");
    assert!(err.contains("a bug in a task"), "{err}");
    assert!(err.contains(tether::bug::STOPPING_LINE), "{err}");
}

/// What a publisher saw of one publish while the node stopped.
#[derive(Debug)]
enum Outcome {
    Applied,
    GoingAway,
    /// Any other error: the outcome is unknown (the connection closed with it under way).
    Unknown(String),
}

/// Graceful stop (issue 25 point 4): a stopping node answers every publish it read before it
/// started to stop, and answers `going-away` to those it read after, without applying them.
/// Four clients publish back to back while the node stops; after the restart, every publish
/// answered as applied is there and every one answered `going-away` is not.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stopping_node_applies_what_it_answers_and_not_what_it_sends_away() {
    use tether::protocol::ErrorCode;
    const PUBLISHERS: usize = 4;
    let mut t = TestNode::start().await;
    let mut tasks = Vec::new();
    for c in 0..PUBLISHERS {
        let client = t.plain().await;
        tasks.push(tokio::spawn(async move {
            let mut outcomes = Vec::new();
            for n in 0.. {
                let key = format!("p{c}-{n}");
                let op = PublishOp::Put {
                    region: "R".into(),
                    key: key.clone(),
                    value: b"v".to_vec(),
                };
                let outcome = match client.publish(vec![op]).await {
                    Ok(_) => Outcome::Applied,
                    Err(tether::client::ClientError::Server(e))
                        if e.code == ErrorCode::GoingAway =>
                    {
                        Outcome::GoingAway
                    }
                    Err(e) => Outcome::Unknown(e.to_string()),
                };
                let last = !matches!(outcome, Outcome::Applied);
                outcomes.push((key, outcome));
                if last {
                    break;
                }
            }
            outcomes
        }));
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    t.restart().await;
    let reader = t.plain().await;
    let (mut applied, mut sent_away) = (0, 0);
    for task in tasks {
        for (key, outcome) in task.await.unwrap() {
            let stored = reader.region("R").get(&key).await.unwrap();
            match outcome {
                Outcome::Applied => {
                    applied += 1;
                    assert_eq!(stored.as_deref(), Some(&b"v"[..]), "{key} answered applied");
                }
                Outcome::GoingAway => {
                    sent_away += 1;
                    assert_eq!(stored, None, "{key} answered going-away but applied");
                }
                Outcome::Unknown(e) => eprintln!("{key}: outcome unknown ({e})"),
            }
        }
    }
    eprintln!("{applied} publishes applied, {sent_away} answered going-away");
    assert!(applied > 0, "the clients published before the stop");
    assert!(
        sent_away > 0,
        "a publish sent during the stop was answered going-away"
    );
    reader.close(false).await.ok();
}
