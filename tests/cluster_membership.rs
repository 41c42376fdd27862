//! Changing a cluster's members while it serves: `tether cluster remove-node` takes a member
//! out of the group for good. A member that is down for good stops costing the others their
//! publish log (they keep nothing more for it, and publishing resumes); a member still holding
//! queues is refused until it has handed them away; the metadata forgets a removed member's
//! copies, and their primaries place new ones. Real nodes over QUIC with RocksDB in temp dirs.

mod common;

use std::time::Duration;

use tether::client::{ClientBuilder, Interest};
use tether::protocol::{ErrorCode, QueueStatus};
use tether::server::Node;

use common::cluster::TestCluster;
use common::{entries, eventually, until_live};

fn builder(node: &Node) -> ClientBuilder {
    ClientBuilder::new()
        .server(node.addr())
        .ca_file(node.ca_file())
        .ack_interval(Duration::from_millis(50))
}

/// A durable id that, placed on `primary`, gets its one copy on `copy` rather than on the
/// third member `other` (copies go to the members with the highest rendezvous hash of
/// (id, member name)).
fn id_copied_on(prefix: &str, copy: &str, other: &str) -> String {
    let hash = tether::control::reconcile::rendezvous_key;
    (0..)
        .map(|k| format!("{prefix}{k}"))
        .find(|id| hash(id, copy) > hash(id, other))
        .unwrap()
}

/// Durable client `id` (redundancy 1) connects to `node`, which places its queue, registers
/// interest in every key of region R and goes away, its queue kept.
async fn away_on(node: &Node, id: &str) {
    let d = builder(node)
        .durable(id, 300)
        .redundancy(1)
        .connect()
        .await
        .unwrap();
    assert_eq!(
        d.server_addr(),
        node.addr(),
        "{id} placed where it connected"
    );
    d.region("R").register(Interest::all_keys()).await.unwrap();
    d.close(true).await.unwrap();
}

fn member_names(node: &Node) -> Vec<String> {
    let members = node.cluster().unwrap().members();
    let mut names: Vec<String> = members.nodes.values().map(|n| n.name.clone()).collect();
    names.sort();
    names
}

/// A member down for good fills the other members' publish logs (they keep every publish for
/// it) until they refuse publishes; removing it releases what was kept for it, publishing
/// resumes without it, its copies are dropped and placed again on a live member, and the
/// queue whose copy it held loses nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn removing_a_member_that_is_gone_releases_its_publish_log_and_its_copies() {
    const LIMIT: u64 = 64 * 1024;
    let limits = tether::config::Limits {
        publish_log_bytes_max: LIMIT,
        ..Default::default()
    };
    let mut c = TestCluster::start_with(3, limits).await;
    c.leader().await;
    // A queue on n2 whose copy is on n1, its client away.
    let id = id_copied_on("q", "n1", "n3");
    away_on(c.node(1), &id).await;
    let n1 = tether::cluster::meta::raft_id("n1");
    let cluster = c.node(1).cluster().unwrap().clone();
    eventually("the copy on n1 is in sync", || {
        cluster
            .placement(&id)
            .is_some_and(|p| p.secondaries == vec![n1] && p.syncing.is_empty())
    })
    .await;

    // n1 goes away for good: n2 keeps its publishes for it until its log is full.
    c.nodes[0].take().unwrap().shutdown().await;
    let p = c.node(1).publisher().await.expect("publisher");
    let mut accepted = 0u32;
    let refusal = loop {
        match p.put("R", &format!("k-{accepted:04}"), vec![7; 1024]).await {
            Ok(_) => accepted += 1,
            Err(e) => break e,
        }
        assert!(accepted < 1_000, "the publish log limit never applied");
    };
    assert_eq!(refusal.code, ErrorCode::Unavailable, "{refusal:?}");
    assert!(
        refusal.message.contains("publish log is full") && refusal.message.contains("n1"),
        "{}",
        refusal.message
    );

    // Removed through n3: n1 holds no primary (its only copy is dropped with it).
    let admin = builder(c.node(2)).connect().await.unwrap();
    let members = admin.remove_node("n1").await.unwrap();
    assert_eq!(members, ["n2", "n3"]);
    for i in [1, 2] {
        eventually("the members leave n1 out", || {
            member_names(c.node(i)) == ["n2", "n3"]
        })
        .await;
    }
    // Publishing on n2 resumes without n1 coming back.
    let deadline = tokio::time::Instant::now() + common::WAIT;
    loop {
        match p.put("R", &format!("k-{accepted:04}"), vec![7; 1024]).await {
            Ok(_) => break,
            Err(e) if tokio::time::Instant::now() < deadline => {
                assert_eq!(e.code, ErrorCode::Unavailable, "{e:?}");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            Err(e) => panic!("publishing did not resume after the removal: {e:?}"),
        }
    }
    accepted += 1;
    // Far more than the log held for n1: nothing is kept for it any more.
    for _ in 0..200 {
        p.put("R", &format!("k-{accepted:04}"), vec![7; 1024])
            .await
            .unwrap();
        accepted += 1;
    }
    // The queue's copy went with n1; its primary placed a new one on n3, in sync.
    let n3 = tether::cluster::meta::raft_id("n3");
    eventually("a new copy on n3, in sync", || {
        cluster
            .placement(&id)
            .is_some_and(|p| p.secondaries == vec![n3] && p.syncing.is_empty())
    })
    .await;
    assert!(cluster.read(|s| s.draining.is_empty()), "n1 forgotten");

    // The away client loses nothing.
    let d = builder(c.node(2))
        .durable(id.clone(), 300)
        .redundancy(1)
        .connect()
        .await
        .unwrap();
    assert_eq!(d.server_addr(), c.node(1).addr());
    assert_eq!(
        (d.queue_status(), d.pending()),
        (QueueStatus::Resumed, Some(u64::from(accepted)))
    );
    d.ready_for_events().await.unwrap();
    let got = until_live(&mut d.events().unwrap(), "R").await;
    let got: Vec<String> = entries(&got).iter().map(|e| e.key.clone()).collect();
    let want: Vec<String> = (0..accepted).map(|i| format!("k-{i:04}")).collect();
    assert_eq!(got, want);
    d.close(false).await.unwrap();

    // Removing it again, or any name that is not a member, is refused.
    let e = admin.remove_node("n1").await.unwrap_err();
    assert!(e.to_string().contains("not a member"), "{e}");
    admin.close(false).await.unwrap();
    c.shutdown().await;
}

/// A member that is still the primary of a queue is refused removal (and is draining from
/// then on); once its queues moved, it is removed, and its away client resumes on the new
/// primary with everything.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_member_is_removed_only_once_it_is_the_primary_of_nothing() {
    // Rebalancing off: only the drain moves queues.
    let mut c = TestCluster::start_tweaked(3, |cfg| cfg.rebalance = false).await;
    c.leader().await;
    away_on(c.node(2), "away").await;
    let p = c.node(0).publisher().await.unwrap();
    for i in 0..5 {
        p.put("R", &format!("a{i}"), b"v".to_vec()).await.unwrap();
    }

    let admin = builder(c.node(0)).connect().await.unwrap();
    let e = admin.remove_node("n3").await.unwrap_err();
    let tether::client::ClientError::Server(w) = &e else {
        panic!("{e:?}")
    };
    assert_eq!(w.code, ErrorCode::Refused, "{w:?}");
    assert!(w.message.contains("still the primary of 1 queues"), "{w:?}");
    assert_eq!(member_names(c.node(0)), ["n1", "n2", "n3"]);
    // The refused removal left n3 draining: its queue moves away.
    let started = std::time::Instant::now();
    loop {
        let r = admin.drain("n3", None).await.unwrap();
        assert!(r.draining);
        if r.primaries == 0 && r.copies == 0 {
            break;
        }
        assert!(started.elapsed() < common::WAIT, "not drained: {r:?}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    for i in 5..10 {
        p.put("R", &format!("a{i}"), b"v".to_vec()).await.unwrap();
    }
    assert_eq!(admin.remove_node("n3").await.unwrap(), ["n1", "n2"]);
    for i in [0, 1] {
        eventually("the members leave n3 out", || {
            member_names(c.node(i)) == ["n1", "n2"]
        })
        .await;
    }
    c.nodes[2].take().unwrap().shutdown().await;
    for i in 10..15 {
        p.put("R", &format!("a{i}"), b"v".to_vec()).await.unwrap();
    }
    // The metadata group goes on with two members (it elects a leader among them).
    let d = builder(c.node(0))
        .durable("new", 300)
        .connect()
        .await
        .unwrap();
    assert_eq!(d.queue_status(), QueueStatus::New);
    d.close(false).await.unwrap();
    let d = builder(c.node(0))
        .durable("away", 300)
        .redundancy(1)
        .connect()
        .await
        .unwrap();
    assert_eq!(
        (d.queue_status(), d.pending()),
        (QueueStatus::Resumed, Some(15))
    );
    d.ready_for_events().await.unwrap();
    let got = until_live(&mut d.events().unwrap(), "R").await;
    let got: Vec<String> = entries(&got).iter().map(|e| e.key.clone()).collect();
    let want: Vec<String> = (0..15).map(|i| format!("a{i}")).collect();
    assert_eq!(got, want);
    d.close(false).await.unwrap();
    admin.close(false).await.unwrap();
    c.shutdown().await;
}

/// A builder trying every running node of `c`, `first` first.
fn builder_over(c: &TestCluster, first: usize) -> ClientBuilder {
    let others = (0..c.nodes.len()).filter(move |&i| i != first && c.nodes[i].is_some());
    ClientBuilder::new()
        .servers(
            std::iter::once(first)
                .chain(others)
                .map(|i| c.node(i).addr()),
        )
        .ca_file(c.node(0).ca_file())
        .ack_interval(Duration::from_millis(50))
}

/// Waits until member `name` is the primary of no queue and holds no copy.
async fn drained(admin: &tether::client::Client, name: &str) {
    let started = std::time::Instant::now();
    loop {
        let r = admin.drain(name, None).await.unwrap();
        if r.primaries == 0 && r.copies == 0 {
            return;
        }
        assert!(
            started.elapsed() < Duration::from_secs(90),
            "{name} not drained: {r:?}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Issue 25 #3: a three-node cluster grows to five (`tether cluster add-node`, each new node
/// started with `--join`) and then retires two of its first members (drained, then removed),
/// while a publisher publishes all along and durable clients stay connected (reconnecting) or
/// away. The new members copy the regions' values before they serve anyone, take queues, and
/// every acknowledged publish reaches every queue; an event shown twice is flagged.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cluster_grows_to_five_and_retires_two_under_load_losing_nothing() {
    let mut c = TestCluster::start(3).await;
    c.leader().await;
    let publisher = c.node(0).publisher().await.unwrap();
    // Values the new members must copy: published before they join, to no queue.
    for i in 0..20 {
        publisher
            .put("V", &format!("old{i}"), format!("v{i}").into_bytes())
            .await
            .unwrap();
    }
    publisher.destroy("V", "old0").await.unwrap();
    let policy = tether::client::ReconnectPolicy {
        delay_initial: Duration::from_millis(100),
        delay_max: Duration::from_millis(500),
        ..Default::default()
    };
    // Connected clients, reading all along (a subscription reconnects as it is read).
    let mut readers = Vec::new();
    for (k, first) in [0, 1, 2].into_iter().enumerate() {
        let mut sub = builder_over(&c, first)
            .durable(format!("on{k}"), 300)
            .redundancy(1)
            .reconnect(policy.clone())
            .subscribe([("R".to_string(), Interest::all_keys())])
            .await
            .unwrap();
        readers.push(tokio::spawn(async move {
            let mut seen = std::collections::HashSet::new();
            loop {
                match sub.next().await {
                    Some(tether::client::ClientEvent::Event(e)) => {
                        assert!(
                            seen.insert(e.key.clone()) || e.possible_duplicate,
                            "{} shown twice without the flag",
                            e.key
                        );
                        if e.key == "end" {
                            break;
                        }
                    }
                    Some(_) => {}
                    None => panic!("the subscription ended"),
                }
            }
            sub.close(false).await.unwrap();
            seen
        }));
    }
    // Away clients (one queue without copies).
    let away: Vec<(String, u8)> = vec![
        ("away0".into(), 1),
        ("away1".into(), 1),
        ("away2".into(), 1),
        ("away3".into(), 0),
    ];
    for (k, (id, redundancy)) in away.iter().enumerate() {
        let d = builder_over(&c, k % 3)
            .durable(id.clone(), 300)
            .redundancy(*redundancy)
            .connect()
            .await
            .unwrap();
        d.region("R").register(Interest::all_keys()).await.unwrap();
        d.close(true).await.unwrap();
    }
    // The load: puts through n1 until told to stop; the acknowledged ones are kept.
    let (stop, mut stopped) = tokio::sync::watch::channel(false);
    let load = tokio::spawn(async move {
        let mut acked = Vec::new();
        for i in 0.. {
            if *stopped.borrow_and_update() {
                break;
            }
            let key = format!("e{i}");
            if publisher.put("R", &key, b"v".to_vec()).await.is_ok() {
                acked.push(key);
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        (publisher, acked)
    });

    let admin = builder(c.node(0)).connect().await.unwrap();
    for name in ["n4", "n5"] {
        let i = c.grow().await;
        assert!(c.node(i).joining(), "{name} waits to be added");
        let members = admin
            .add_node(name, &c.node(i).addr().to_string())
            .await
            .unwrap();
        assert!(members.iter().any(|m| m == name), "{members:?}");
        let node = c.node(i);
        eventually(&format!("{name} joins"), || !node.joining()).await;
        for k in 1..20 {
            let v = node.get("V", &format!("old{k}")).unwrap();
            assert_eq!(
                v.as_deref(),
                Some(format!("v{k}").as_bytes()),
                "{name} old{k}"
            );
        }
        assert_eq!(node.get("V", "old0").unwrap(), None, "{name}");
        // Undrained once joined.
        let joined = node.cluster().unwrap().id();
        let (n1, own) = (c.node(0).cluster().unwrap(), node.cluster().unwrap());
        eventually(&format!("{name} undrained"), || {
            [n1, own]
                .iter()
                .all(|cl| cl.read(|s| !s.draining.contains(&joined)))
        })
        .await;
    }
    assert_eq!(member_names(c.node(0)), ["n1", "n2", "n3", "n4", "n5"]);
    // A new member takes queues: a new queue placed through it...
    let d = builder_over(&c, 3)
        .durable("new-on-n4", 300)
        .connect()
        .await
        .unwrap();
    assert_eq!(d.server_addr(), c.node(3).addr());
    d.close(false).await.unwrap();

    // Retire n2 and n3: drained, then removed.
    for name in ["n2", "n3"] {
        let r = admin.drain(name, Some(true)).await.unwrap();
        assert!(r.draining, "{r:?}");
    }
    for name in ["n2", "n3"] {
        drained(&admin, name).await;
        admin.remove_node(name).await.unwrap();
    }
    assert_eq!(member_names(c.node(0)), ["n1", "n4", "n5"]);
    // ...and rebalancing moves queues to the new members (away ones, where they hold a copy).
    eventually("a queue moves to n4 or n5", || {
        c.node(3).queues().len() + c.node(4).queues().len() > 0
    })
    .await;
    for i in [1, 2] {
        c.nodes[i].take().unwrap().shutdown().await;
    }

    stop.send_replace(true);
    let (publisher, acked) = load.await.unwrap();
    publisher.put("R", "end", b"v".to_vec()).await.unwrap();
    eprintln!("{} publishes acknowledged under load", acked.len());
    assert!(acked.len() > 50, "the load ran: {}", acked.len());
    for reader in readers {
        let seen = tokio::time::timeout(Duration::from_secs(60), reader)
            .await
            .expect("every connected client gets to the end")
            .unwrap();
        let lost: Vec<&String> = acked.iter().filter(|k| !seen.contains(*k)).collect();
        assert!(lost.is_empty(), "lost: {lost:?}");
    }
    for (id, redundancy) in &away {
        let d = builder_over(&c, 0)
            .durable(id.clone(), 300)
            .redundancy(*redundancy)
            .connect()
            .await
            .unwrap();
        assert_eq!(d.queue_status(), QueueStatus::Resumed, "{id}");
        d.ready_for_events().await.unwrap();
        let got = until_live(&mut d.events().unwrap(), "R").await;
        let mut seen = std::collections::HashSet::new();
        for e in entries(&got) {
            assert!(
                seen.insert(e.key.clone()) || e.possible_duplicate,
                "{id}: {} shown twice without the flag",
                e.key
            );
        }
        let lost: Vec<&String> = acked.iter().filter(|k| !seen.contains(*k)).collect();
        assert!(lost.is_empty(), "{id} lost: {lost:?}");
        assert!(seen.contains("end"), "{id}");
        d.close(false).await.unwrap();
    }
    admin.close(false).await.unwrap();
    c.shutdown().await;
}

/// `--join` without the members to join is refused at start, saying what is missing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn joining_without_peers_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = tether::config::ServerConfig::ephemeral(dir.path());
    cfg.listen = "127.0.0.1:0".parse().unwrap();
    cfg.node_id = Some("n4".into());
    cfg.join = true;
    match Node::start(cfg).await {
        Err(e) => assert!(e.to_string().contains("--join needs"), "{e}"),
        Ok(_) => panic!("a node joining nothing started"),
    }
}

/// A node started with `--join` is not ready (`/readyz` 503, saying it is joining) until it was
/// added and copied the regions; then it is.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_joining_node_is_not_ready_until_it_joined() {
    fn with_admin_http(cfg: &mut tether::config::ServerConfig) {
        cfg.metrics = Some("127.0.0.1:0".parse().unwrap());
    }
    let readyz = |node: &Node| {
        let addr = node.metrics_addr().expect("admin HTTP").to_string();
        async move {
            tokio::task::spawn_blocking(move || common::http_get(&addr, "/readyz"))
                .await
                .unwrap()
        }
    };
    let mut c = TestCluster::start_tweaked(3, with_admin_http).await;
    c.leader().await;
    let i = c.grow().await;
    assert!(c.node(i).joining());
    let r = readyz(c.node(i)).await;
    assert!(r.starts_with("HTTP/1.1 503"), "{r}");
    assert!(r.contains("joining the cluster"), "{r}");
    let admin = builder(c.node(0)).connect().await.unwrap();
    admin
        .add_node("n4", &c.node(i).addr().to_string())
        .await
        .unwrap();
    let deadline = std::time::Instant::now() + common::WAIT;
    loop {
        let r = readyz(c.node(i)).await;
        if r.starts_with("HTTP/1.1 200") {
            assert!(r.contains(r#""ready":true"#), "{r}");
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "n4 not ready after it was added: {r}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    admin.close(false).await.unwrap();
    c.shutdown().await;
}

/// Issue 25 point 4, a rolling upgrade: a member of the previous build (it speaks peer protocol
/// version 1 only, as a build before membership changes did) serves beside the new ones:
/// consensus, forwarded publishes, a durable queue on it with a copy elsewhere. What it could not
/// read is never sent to it: draining, adding or removing a member are refused with an error
/// naming it, and a request of the newer version to it fails before anything is sent. Once it
/// restarts on the new build (its data kept), the drain goes through.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_member_of_the_previous_build_serves_and_holds_back_only_membership_changes() {
    fn previous_build(cfg: &mut tether::config::ServerConfig) {
        if cfg.node_id.as_deref() == Some("n3") {
            cfg.peer_protocol_versions = 1..=1;
        }
    }
    let mut c = TestCluster::start_tweaked(3, previous_build).await;
    c.leader().await;
    // It serves: a durable queue placed on it, with a copy, fed by publishes through n1.
    away_on(c.node(2), "upgrading").await;
    let p = c.node(0).publisher().await.unwrap();
    for i in 0..5 {
        p.put("R", &format!("k{i}"), b"v".to_vec()).await.unwrap();
    }
    let d = builder(c.node(2))
        .durable("upgrading", 300)
        .redundancy(1)
        .connect()
        .await
        .unwrap();
    assert_eq!(d.queue_status(), QueueStatus::Resumed);
    d.ready_for_events().await.unwrap();
    // Forwarded to it as they were acknowledged on n1 (`--ack local`): stored or live.
    let mut events = d.events().unwrap();
    let mut keys = Vec::new();
    while keys.len() < 5 {
        let ev = tokio::time::timeout(common::WAIT, events.next())
            .await
            .unwrap_or_else(|_| panic!("only {keys:?} reached the member of the previous build"))
            .expect("stream open");
        if let tether::client::ClientEvent::Event(e) = ev {
            keys.push(e.key.clone());
        }
    }
    assert_eq!(keys, ["k0", "k1", "k2", "k3", "k4"]);
    d.close(true).await.unwrap();

    // What it could not read is refused, naming it, whichever member is asked.
    let admin = builder(c.node(0)).connect().await.unwrap();
    let older = |e: tether::client::ClientError| {
        let tether::client::ClientError::Server(w) = &e else {
            panic!("{e:?}")
        };
        assert_eq!(w.code, ErrorCode::Refused, "{w:?}");
        assert!(
            w.message.contains("n3 speaks version 1") && w.message.contains("upgrade"),
            "{w:?}"
        );
    };
    older(admin.drain("n2", Some(true)).await.unwrap_err());
    older(admin.remove_node("n2").await.unwrap_err());
    older(admin.add_node("n4", "127.0.0.1:9").await.unwrap_err());
    // Nothing was written: nobody is draining and the members are the same.
    assert!(!admin.drain("n2", None).await.unwrap().draining);
    assert_eq!(member_names(c.node(0)), ["n1", "n2", "n3"]);
    // A request of the newer version fails before it is sent, the connection kept.
    let cluster = c.node(0).cluster().unwrap().clone();
    let n3 = tether::cluster::meta::raft_id("n3");
    let Err(e) = cluster
        .call(
            n3,
            tether::cluster::network::PeerRequest::ForwardCursor("n1".into()),
            Duration::from_secs(5),
        )
        .await
    else {
        panic!("a request of version 2 was answered by a member speaking version 1")
    };
    assert!(
        matches!(
            e,
            tether::cluster::network::PeerError::OlderPeer {
                speaks: 1,
                needs: 2,
                ..
            }
        ),
        "{e}"
    );
    let pong = cluster
        .call(
            n3,
            tether::cluster::network::PeerRequest::Ping,
            Duration::from_secs(5),
        )
        .await
        .unwrap();
    assert!(matches!(pong, tether::cluster::network::PeerResponse::Pong));

    // n3 restarts on the new build: the drain goes through, and its queue kept everything.
    c.nodes[2].take().unwrap().shutdown().await;
    // Its consensus log holds nothing of version 2 yet: a build of the previous format (1)
    // could still open it (a rollback).
    assert_eq!(raft_log_format(c.dirs[2].path()), 1);
    c.tweak = |_| {};
    let node = c.boot(2).await;
    c.nodes[2] = Some(node);
    c.leader().await;
    let deadline = tokio::time::Instant::now() + common::WAIT;
    let report = loop {
        match admin.drain("n2", Some(true)).await {
            Ok(r) => break r,
            // The members dial n3 again as it comes back.
            Err(e) if tokio::time::Instant::now() < deadline => {
                tracing::info!(%e, "drain not yet");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            Err(e) => panic!("the drain stays refused after the upgrade: {e:?}"),
        }
    };
    assert!(report.draining, "{report:?}");
    admin.drain("n2", Some(false)).await.unwrap();
    let d = builder(c.node(2))
        .durable("upgrading", 300)
        .redundancy(1)
        .connect()
        .await
        .unwrap();
    assert_eq!(d.queue_status(), QueueStatus::Resumed);
    d.close(false).await.unwrap();
    admin.close(false).await.unwrap();
    let dirs = std::mem::take(&mut c.dirs);
    c.shutdown().await;
    // The drain's entries are of version 2: every member's log records format 2 now, so a
    // build of format 1 refuses it at start rather than failing to decode an entry.
    for dir in &dirs {
        assert_eq!(raft_log_format(dir.path()), 2, "{}", dir.path().display());
    }
}

/// The format a stopped node's consensus log records (`tether_storage::RAFT_LOG_FORMAT_KEY`).
fn raft_log_format(data_dir: &std::path::Path) -> u32 {
    tether_storage::RaftLogDb::open(&data_dir.join(tether::server::RAFT_DIR))
        .unwrap()
        .format()
}

/// Issue 25 point 3, a member added takes its part without a member leaving: copies spread to
/// it (each moved from a member holding far more, the new copy in sync before the old one
/// goes), then primaries by rebalancing onto those copies. The away clients whose queues moved
/// lose nothing, and an event shown again is flagged.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_member_added_takes_copies_then_primaries_losing_nothing() {
    const QUEUES: usize = 18;
    let mut c = TestCluster::start(3).await;
    c.leader().await;
    // Durable queues at redundancy 1, placed on the three members in turn, their clients away.
    for q in 0..QUEUES {
        away_on(c.node(q % 3), &format!("s{q}")).await;
    }
    let p = c.node(0).publisher().await.unwrap();
    let mut acked = Vec::new();
    for i in 0..10 {
        let key = format!("before-{i}");
        p.put("R", &key, b"v".to_vec()).await.unwrap();
        acked.push(key);
    }
    let n4 = tether::cluster::meta::raft_id("n4");
    let cluster = c.node(0).cluster().unwrap().clone();
    assert_eq!(cluster.read(|s| s.held_by(n4)), (0, 0));

    let (_, admin) = grow_and_add(&mut c, "n4").await;
    eventually("n4 holds copies, then primaries", || {
        let (primaries, copies) = cluster.read(|s| s.held_by(n4));
        primaries >= 1 && copies >= 2
    })
    .await;
    // No queue has more copies than asked for once the moves are over.
    eventually("every queue back to one copy, in sync", || {
        cluster.read(|s| {
            s.queues
                .values()
                .all(|p| p.secondaries.len() == 1 && p.syncing.is_empty())
        })
    })
    .await;
    for i in 0..10 {
        let key = format!("after-{i}");
        p.put("R", &key, b"v".to_vec()).await.unwrap();
        acked.push(key);
    }
    for q in 0..QUEUES {
        let id = format!("s{q}");
        let d = builder(c.node(q % 3))
            .durable(id.clone(), 300)
            .redundancy(1)
            .connect()
            .await
            .unwrap();
        assert_eq!(d.queue_status(), QueueStatus::Resumed, "{id}");
        d.ready_for_events().await.unwrap();
        let mut events = d.events().unwrap();
        let mut seen = std::collections::HashSet::new();
        // Forwarded publishes may reach a queue after its live marker: read until all came.
        while !acked.iter().all(|k| seen.contains(k)) {
            let ev = tokio::time::timeout(common::WAIT, events.next())
                .await
                .unwrap_or_else(|_| panic!("{id}: only {seen:?} came"))
                .expect("stream open");
            if let tether::client::ClientEvent::Event(e) = ev {
                assert!(
                    seen.insert(e.key.clone()) || e.possible_duplicate,
                    "{id}: {} shown twice without the flag",
                    e.key
                );
            }
        }
        d.close(false).await.unwrap();
    }
    let (primaries, copies) = cluster.read(|s| s.held_by(n4));
    tracing::info!(primaries, copies, "n4 at the end");
    admin.close(false).await.unwrap();
    c.shutdown().await;
}

/// A member joining while two members publish large values as fast as they can gets every
/// publish made after it joined. The regions it copies hold each origin's publishes up to
/// where its source had applied them, often well past where the origin started keeping its
/// log for it: the new member's first answers say "applied through there", past the runs the
/// origin had sent, and the origin trims up to there once every other member applied it too.
/// Before the forwarding pipeline moved its next run past such an answer, that run started at
/// an entry the log no longer held, and nothing more was forwarded to the new member.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_member_joining_under_heavy_publishing_gets_every_later_publish() {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, Ordering};
    /// Five values fill a forwarding run (`FORWARD_BATCH_BYTES_MAX`, 1 MiB), so the copy's
    /// head start over the runs sent is many runs long.
    const VALUE_BYTES: usize = 200 << 10;
    let mut c = TestCluster::start(3).await;
    c.leader().await;
    let stop = Arc::new(AtomicBool::new(false));
    let mut publishers = Vec::new();
    // Two origins: at most one of them is the new member's source.
    for k in 0..2 {
        let p = c.node(k).publisher().await.unwrap();
        let stop = stop.clone();
        publishers.push(tokio::spawn(async move {
            let mut n = 0u64;
            while !stop.load(Ordering::Relaxed) {
                p.put("R", &format!("n{k}-{}", n % 64), vec![b'x'; VALUE_BYTES])
                    .await
                    .unwrap();
                n += 1;
            }
            p.put("R", &format!("last-{k}"), b"end".to_vec())
                .await
                .unwrap();
            n
        }));
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    let (i, admin) = grow_and_add(&mut c, "n4").await;
    eventually("n4 joins", || !c.node(i).joining()).await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    stop.store(true, Ordering::Relaxed);
    for (k, p) in publishers.into_iter().enumerate() {
        let n = p.await.unwrap();
        tracing::info!(origin = k, publishes = n, "published");
    }
    let n4 = c.node(i);
    eventually("n4 applies the last publish of both origins", || {
        (0..2).all(|k| n4.get("R", &format!("last-{k}")).unwrap().is_some())
    })
    .await;
    admin.close(false).await.unwrap();
    c.shutdown().await;
}

/// A member joins a cluster in which nobody has published yet, right after the member it
/// copies the regions from restarted. Publish logs start past 1 (they are numbered from the
/// wall clock), and a member learns where another's log starts from the runs it sends, the
/// first of which only tells the floor. If the source forgot that at its restart, it told the
/// newcomer it had applied nothing of the other members' logs, less than they keep for the
/// newcomer, and the join waited for it for good.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_member_joins_after_its_source_restarted_with_nothing_published() {
    use tether::cluster::meta::raft_id;
    let mut c = TestCluster::start(3).await;
    c.leader().await;
    // A join copies the regions of the first member in raft-id order that gives them.
    let source = (0..3).min_by_key(|&i| raft_id(&c.names[i])).unwrap();
    // The members tell each other where their logs start (a floor-only run each), then the
    // source restarts.
    tokio::time::sleep(Duration::from_secs(1)).await;
    c.nodes[source].take().unwrap().shutdown().await;
    let node = c.boot(source).await;
    c.nodes[source] = Some(node);
    c.leader().await;
    let (i, admin) = grow_and_add(&mut c, "n4").await;
    eventually("n4 joins", || !c.node(i).joining()).await;
    let other = (source + 1) % 3;
    c.node(other)
        .publisher()
        .await
        .unwrap()
        .put("R", "after", b"1".to_vec())
        .await
        .unwrap();
    eventually("n4 gets a publish made after it joined", || {
        c.node(i).get("R", "after").unwrap().is_some()
    })
    .await;
    admin.close(false).await.unwrap();
    c.shutdown().await;
}

/// `--ack replicated` publishes while a member joins are not held back by it: it holds no queue
/// (it is drained until it has joined) and its publish log waits for it. Here the join cannot
/// finish (a member is down, and the newcomer waits for every member to say how far it keeps
/// its log for it); before, every such publish answered `unavailable` after the replicated-ack
/// wait, "not applied yet on n4", for as long as the join lasted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replicated_publishes_are_not_held_back_by_a_joining_member() {
    fn short_wait(cfg: &mut tether::config::ServerConfig) {
        cfg.replicated_ack_timeout_ms = 2_000;
    }
    let mut c = TestCluster::start_tweaked(3, short_wait).await;
    c.leader().await;
    c.nodes[2].take().unwrap().shutdown().await;
    let (i, admin) = grow_and_add(&mut c, "n4").await;
    let publisher = builder(c.node(0))
        .publish_ack(tether::protocol::PublishAck::Replicated)
        .connect()
        .await
        .unwrap();
    let put = |n: u32| {
        let publisher = &publisher;
        async move {
            publisher
                .region("R")
                .put(&format!("k{n}"), b"v".to_vec())
                .await
        }
    };
    // n1 takes a failure-detection period to see n3 down (until then it waits for n3 too).
    let deadline = tokio::time::Instant::now() + common::WAIT;
    while let Err(e) = put(0).await {
        assert!(
            tokio::time::Instant::now() < deadline,
            "no replicated publish while n3 is down: {e}"
        );
    }
    // Then every publish succeeds for as long as the join lasts (here, for good).
    for n in 1..=20 {
        if let Err(e) = put(n).await {
            panic!("replicated publish {n} while n4 joins: {e}");
        }
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    assert!(c.node(i).joining(), "n4 was still joining");
    publisher.close(false).await.unwrap();
    admin.close(false).await.unwrap();
    c.shutdown().await;
}

/// Starts a node with `--join` (it gets index `i`, named `name`) and adds it through n1;
/// returns `i` and the admin connection used.
async fn grow_and_add(c: &mut TestCluster, name: &str) -> (usize, tether::client::Client) {
    let i = c.grow().await;
    let admin = builder(c.node(0)).connect().await.unwrap();
    admin
        .add_node(name, &c.node(i).addr().to_string())
        .await
        .unwrap();
    (i, admin)
}

/// The join mark in a stopped node's store (`tether::server::JOINED_KEY`).
fn joined_mark(data_dir: &std::path::Path) -> Option<Vec<u8>> {
    use tether_storage::Store;
    let store = tether_storage::RocksStore::open(&data_dir.join("db")).unwrap();
    store.state_get(tether::server::JOINED_KEY).unwrap()
}

/// Waits until joined node `i` recorded its undrain, stops it, and checks the mark it left.
async fn recorded_undrain_then_stop(c: &mut TestCluster, i: usize) {
    eventually("the node records its undrain", || {
        !c.node(i).join_undrain_pending().unwrap()
    })
    .await;
    c.nodes[i].take().unwrap().shutdown().await;
    assert_eq!(
        joined_mark(c.dirs[i].path()),
        Some(vec![tether::server::JOINED_DONE])
    );
}

/// A node restarted after it recorded its join but before its undrain committed undrains itself
/// at start, while a joined node that an operator drained stays drained across a restart. (The
/// first state is made by hand in the stopped node's store: the window between the join's last
/// two writes is too short to stop a node in.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_joined_node_restarted_before_its_undrain_undrains_itself() {
    use tether::server::{JOINED_KEY, JOINED_UNDRAIN_PENDING};
    let mut c = TestCluster::start(3).await;
    c.leader().await;
    let (i, admin) = grow_and_add(&mut c, "n4").await;
    let n4 = tether::cluster::meta::raft_id("n4");
    let cluster = c.node(0).cluster().unwrap().clone();
    let draining = || cluster.read(|s| s.draining.contains(&n4));
    eventually("n4 undrained after its join", || !draining()).await;
    recorded_undrain_then_stop(&mut c, i).await;

    // What a stop between the join's two writes leaves: draining, the undrain pending.
    admin.drain("n4", Some(true)).await.unwrap();
    {
        use tether_storage::Store;
        let store = tether_storage::RocksStore::open(&c.dirs[i].path().join("db")).unwrap();
        let mut b = tether_storage::Batch::new();
        b.state_put(JOINED_KEY, vec![JOINED_UNDRAIN_PENDING]);
        store.write(&b, true).unwrap();
    }
    c.nodes[i] = Some(c.boot(i).await);
    eventually("n4 undrains itself at start", || !draining()).await;
    recorded_undrain_then_stop(&mut c, i).await;

    // An operator's drain of a joined node outlasts its restart.
    admin.drain("n4", Some(true)).await.unwrap();
    c.nodes[i] = Some(c.boot(i).await);
    let leader_applied = cluster.applied_index();
    let n4_cluster = c.node(i).cluster().unwrap().clone();
    eventually("n4 caught up with the metadata", || {
        n4_cluster.applied_index() >= leader_applied
    })
    .await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert!(draining(), "a restart undid an operator's drain");
    admin.close(false).await.unwrap();
    c.shutdown().await;
}
