//! The cluster-metadata group: three real nodes on loopback (QUIC with mutual TLS under one
//! cluster CA, RocksDB consensus logs in temp dirs) elect a leader, commit metadata written on
//! any node, survive the loss of the leader, and a restarted node catches up.

mod common;

use std::time::{Duration, Instant};

use tether::cluster::ClusterError;
use tether::cluster::meta::{MetaCommand, MetaResponse, raft_id};
use tether::cluster::network::{PeerPool, PeerRequest, PeerResponse};
use tether::config::ServerConfig;
use tether::server::Node;
use tether_transport::tls;

use common::cluster::{TestCluster, free_ports};
use common::eventually;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metadata_commits_survives_leader_loss_and_catches_up_after_restart() {
    let mut c = TestCluster::start(3).await;
    let leader = c.leader().await;
    let follower = (leader + 1) % 3;

    // A write on a follower is forwarded to the leader, and every node applies it.
    let place = MetaCommand::Place {
        id: "d1".into(),
        primary: raft_id(&c.names[follower]),
        secondaries: vec![raft_id(&c.names[leader])],
        redundancy: 1,
        timeout_ms: 60_000,
    };
    let MetaResponse::Placed(p) = c
        .node(follower)
        .cluster()
        .unwrap()
        .write(place.clone())
        .await
        .unwrap()
    else {
        panic!("not placed")
    };
    assert_eq!(p.primary, raft_id(&c.names[follower]));
    // Placing again is idempotent: same placement, same epoch.
    assert_eq!(
        c.node(leader)
            .cluster()
            .unwrap()
            .write(place)
            .await
            .unwrap(),
        MetaResponse::Placed(p.clone())
    );
    for i in 0..3 {
        let cl = c.node(i).cluster().unwrap().clone();
        let want = p.clone();
        eventually("placement applied everywhere", || {
            cl.placement("d1").as_ref() == Some(&want)
        })
        .await;
    }

    // The leader goes away: the other two elect a new one and keep committing.
    c.nodes[leader].take().unwrap().shutdown().await;
    let new_leader = c.leader().await;
    assert_ne!(new_leader, leader);
    let survivor = (0..3).find(|i| *i != leader).unwrap();
    let promote = MetaCommand::Promote {
        id: "d1".into(),
        expected_epoch: p.epoch,
        new_primary: raft_id(&c.names[leader]),
    };
    let MetaResponse::Placed(p2) = c
        .node(survivor)
        .cluster()
        .unwrap()
        .write(promote.clone())
        .await
        .unwrap()
    else {
        panic!("not promoted")
    };
    assert!(
        p2.epoch > p.epoch,
        "epochs grow: {} then {}",
        p.epoch,
        p2.epoch
    );
    assert_eq!(p2.primary, raft_id(&c.names[leader]));
    // The same promotion again is stale (compare-and-set on the epoch): applied once.
    assert_eq!(
        c.node(survivor)
            .cluster()
            .unwrap()
            .write(promote)
            .await
            .unwrap(),
        MetaResponse::Stale(Some(p2.clone()))
    );

    // The old leader restarts on its data directory and catches up.
    let node = c.boot(leader).await;
    c.nodes[leader] = Some(node);
    let cl = c.node(leader).cluster().unwrap().clone();
    eventually("restarted node catches up", || {
        cl.placement("d1").as_ref() == Some(&p2)
    })
    .await;
    c.leader().await;
    c.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metadata_survives_a_full_cluster_restart() {
    let mut c = TestCluster::start(3).await;
    c.leader().await;
    let cl = c.node(2).cluster().unwrap().clone();
    for i in 0..20 {
        let r = cl
            .write(MetaCommand::Place {
                id: format!("q{i}"),
                primary: raft_id("n1"),
                secondaries: vec![],
                redundancy: 0,
                timeout_ms: 1_000,
            })
            .await
            .unwrap();
        assert!(matches!(r, MetaResponse::Placed(_)));
    }
    let expire = MetaCommand::Expire {
        id: "q3".into(),
        expected_epoch: cl.placement("q3").unwrap().epoch,
        owner: None,
    };
    assert_eq!(cl.write(expire).await.unwrap(), MetaResponse::Expired);
    drop(cl);
    for i in 0..3 {
        c.nodes[i].take().unwrap().shutdown().await;
    }
    // Everyone comes back on new addresses: the configured addresses win over the ones
    // recorded in the membership.
    c.ports = free_ports(3);
    c.peers = c
        .names
        .iter()
        .zip(&c.ports)
        .map(|(name, p)| (name.clone(), format!("127.0.0.1:{p}")))
        .collect();
    for i in 0..3 {
        let node = c.boot(i).await;
        c.nodes[i] = Some(node);
    }
    c.leader().await;
    for i in 0..3 {
        let cl = c.node(i).cluster().unwrap().clone();
        eventually("state rebuilt from the log", || {
            cl.read(|s| s.queues.len() == 19 && s.expired.iter().any(|e| e == "q3"))
        })
        .await;
    }
    c.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_without_a_cluster_certificate_is_refused() {
    let c = TestCluster::start(1).await;
    c.leader().await;
    // A stranger: trusts the cluster CA (so it can verify the node) but holds a certificate
    // from another CA.
    let other = tempfile::tempdir().unwrap();
    let own = tls::ensure_dev_certs(other.path()).unwrap();
    let files = tls::TlsFiles {
        ca: c.dirs[0].path().join("tls").join(tls::CA_CERT_FILE),
        cert: own.cert,
        key: own.key,
    };
    let cfg = tls::peer_client_config(&files).unwrap();
    let addr = c.node(0).addr();
    let ep = tether_transport::client_endpoint(cfg, addr).unwrap();
    let refused = match ep.connect(addr, tls::SERVER_NAME).unwrap().await {
        Err(_) => true,
        Ok(conn) => {
            // TLS 1.3 may finish the client side before the server rejects the certificate:
            // the first stream then fails.
            match conn.open_bi().await {
                Err(_) => true,
                Ok((mut s, mut r)) => {
                    let _ = s.write_all(b"x").await;
                    let _ = s.finish();
                    r.read_to_end(1024).await.is_err()
                }
            }
        }
    };
    assert!(refused, "a foreign certificate was accepted as a peer");
    c.shutdown().await;
}

#[tokio::test]
async fn a_clustered_node_needs_a_node_id() {
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = ServerConfig::ephemeral(dir.path());
    cfg.peers = vec![("n2".into(), "127.0.0.1:7402".into())];
    let err = Node::start(cfg).await.err().expect("refused");
    assert!(err.to_string().contains("node id"), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn peers_get_through_when_clients_use_every_slot() {
    let limits = tether::config::Limits {
        connections_max: 1,
        ..Default::default()
    };
    let c = TestCluster::start_with(3, limits).await;
    c.leader().await;
    // Every node's only client slot is taken.
    let mut held = Vec::new();
    for i in 0..3 {
        let n = c.node(i);
        let client = tether::client::ClientBuilder::new()
            .server(n.addr())
            .ca_file(n.ca_file())
            .connect()
            .await
            .unwrap();
        held.push(client);
    }
    let n = c.node(1);
    let extra = tether::client::ClientBuilder::new()
        .server(n.addr())
        .ca_file(n.ca_file())
        .connect()
        .await;
    assert!(extra.is_err(), "a second client is refused");
    // A new peer connection (a member's certificate, a peer ALPN) still gets in and
    // is served: here a metadata write sent straight to the leader.
    let leader = c.leader().await;
    let files = member_tls(&c, 0);
    let addr = c.node(leader).addr();
    let peer_cfg = tls::peer_client_config(&files).unwrap();
    let ep = tether_transport::client_endpoint(peer_cfg.clone(), addr).unwrap();
    let pool = PeerPool::new(ep, peer_cfg);
    let r = pool
        .call(
            raft_id(&c.names[leader]),
            &addr.to_string(),
            place("q", raft_id(&c.names[leader])),
            std::time::Duration::from_secs(10),
        )
        .await
        .expect("the peer connection is served");
    let PeerResponse::Write(Ok(w)) = r else {
        panic!("not a committed write")
    };
    assert!(matches!(w.data, MetaResponse::Placed(_)), "{:?}", w.data);
    pool.close();
    drop(held);
    c.shutdown().await;
}

/// How long a stopped node's UDP port may stay bound after `shutdown` returns (a connection
/// left undrained held it for the QUIC idle timeout, 30 s).
const PORT_FREED_WITHIN: Duration = Duration::from_secs(5);

/// A follower stopped right after the election (its peers dialed it while it was starting)
/// drains its connections and frees its UDP port at once, and comes back on the same port.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stopped_follower_frees_its_port_at_once() {
    let mut c = TestCluster::start(3).await;
    let leader = c.leader().await;
    let follower = (leader + 1) % 3;
    let addr = c.node(follower).addr();
    let start = Instant::now();
    c.nodes[follower].take().unwrap().shutdown().await;
    let took = start.elapsed();
    assert!(
        took < Duration::from_millis(tether::server::ENDPOINT_DRAIN_TIMEOUT_MS),
        "shutdown waited out its drain timeout ({took:?}): a connection did not drain"
    );
    let start = Instant::now();
    loop {
        match std::net::UdpSocket::bind(addr) {
            Ok(_) => break,
            Err(e) => assert!(
                start.elapsed() < PORT_FREED_WITHIN,
                "port {addr} still bound {:?} after shutdown: {e}",
                start.elapsed()
            ),
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let node = c.boot(follower).await;
    c.nodes[follower] = Some(node);
    c.leader().await;
    c.shutdown().await;
}

/// Issue 25 point 4, peer protocol versions: a member of a build that speaks only a newer peer
/// protocol version is refused in the handshake with an error that says so, and the node goes
/// on serving; a member of a build one version ahead (which also speaks this one, as every
/// build speaks one version back) is served, in this build's version.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_member_of_another_peer_protocol_version_is_refused_clearly() {
    use tether_transport::PEER_PROTOCOL_VERSION as V;
    let c = TestCluster::start(3).await;
    let leader = c.leader().await;
    let addr = c.node(leader).addr();
    let write = |id: &str| place(id, raft_id(&c.names[leader]));
    let pool_speaking = |versions| member_pool(&c, 0, addr, versions);
    let leader_id = raft_id(&c.names[leader]);

    let newer_only = pool_speaking(V + 1..=V + 1);
    let err = newer_only
        .call(
            leader_id,
            &addr.to_string(),
            write("q1"),
            Duration::from_secs(10),
        )
        .await
        .err()
        .expect("a member speaking only a newer version is refused");
    let text = err.to_string();
    assert!(
        text.contains("speaks no peer protocol version this node does"),
        "the refusal names the cause: {text}"
    );
    newer_only.close();

    let one_ahead = pool_speaking(V..=V + 1);
    let r = one_ahead
        .call(
            leader_id,
            &addr.to_string(),
            write("q2"),
            Duration::from_secs(10),
        )
        .await
        .expect("a member one version ahead is served");
    let PeerResponse::Write(Ok(w)) = r else {
        panic!("not a committed write")
    };
    assert!(matches!(w.data, MetaResponse::Placed(_)), "{:?}", w.data);
    one_ahead.close();
    c.shutdown().await;
}

/// The TLS files of member `i`: the cluster CA and its own certificate.
fn member_tls(c: &TestCluster, i: usize) -> tls::TlsFiles {
    let dir = c.dirs[i].path().join("tls");
    tls::TlsFiles {
        ca: dir.join(tls::CA_CERT_FILE),
        cert: dir.join(tls::SERVER_CERT_FILE),
        key: dir.join(tls::SERVER_KEY_FILE),
    }
}

/// A peer pool with member `i`'s certificate, speaking `versions` of the peer protocol, its
/// endpoint bound for `to`.
fn member_pool(
    c: &TestCluster,
    i: usize,
    to: std::net::SocketAddr,
    versions: std::ops::RangeInclusive<u32>,
) -> PeerPool {
    let cfg = tls::peer_client_config_speaking(&member_tls(c, i), versions).unwrap();
    let ep = tether_transport::client_endpoint(cfg.clone(), to).unwrap();
    PeerPool::new(ep, cfg)
}

/// A metadata write placing queue `id` on `primary`, without copies.
fn place(id: &str, primary: tether::cluster::meta::NodeId) -> PeerRequest {
    PeerRequest::Write(MetaCommand::Place {
        id: id.into(),
        primary,
        secondaries: vec![],
        redundancy: 0,
        timeout_ms: 1_000,
    })
}

/// A metadata write that gives a queue to a node that is not a member (as a member whose view
/// of the membership lagged a removal would send) is refused by the member it reaches, over
/// the real peer protocol, and commits nothing: the same queue placed on a member afterwards
/// gets that member, not the stranger.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_write_placing_a_queue_on_a_non_member_is_refused_and_commits_nothing() {
    use tether_transport::PEER_PROTOCOL_VERSION as V;
    let c = TestCluster::start(3).await;
    let leader = c.leader().await;
    let addr = c.node(leader).addr();
    let pool = member_pool(&c, 0, addr, V..=V);
    let leader_id = raft_id(&c.names[leader]);
    let stranger = raft_id("not-a-member");
    let call = |request: PeerRequest| {
        let pool = &pool;
        async move {
            pool.call(
                leader_id,
                &addr.to_string(),
                request,
                Duration::from_secs(10),
            )
            .await
            .expect("the member answers")
        }
    };

    let as_copy = PeerRequest::Write(MetaCommand::Place {
        id: "q".into(),
        primary: leader_id,
        secondaries: vec![stranger],
        redundancy: 1,
        timeout_ms: 1_000,
    });
    for request in [place("q", stranger), as_copy] {
        let r = call(request).await;
        let PeerResponse::BadRequest(text) = r else {
            panic!("a write placing a queue on a non-member was not refused")
        };
        assert!(
            text.contains("not a member"),
            "the refusal names the cause: {text}"
        );
    }

    let r = call(place("q", leader_id)).await;
    let PeerResponse::Write(Ok(w)) = r else {
        panic!("not a committed write")
    };
    let MetaResponse::Placed(p) = w.data else {
        panic!("not placed: {:?}", w.data)
    };
    assert_eq!(
        (p.primary, p.secondaries),
        (leader_id, vec![]),
        "nothing of the refused writes"
    );
    pool.close();
    c.shutdown().await;
}

/// A member's own metadata write that gives a queue to a non-member (what a member whose view
/// lagged a removal writes) is refused with its cause: on the leader, which checks it before
/// proposing it, as on a follower, which forwards it and hands back the leader's refusal
/// (instead of retrying it until the caller hears that no leader is reachable). Neither
/// commits: the same queue placed afterwards gets that placement, not the refused one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_members_own_write_placing_a_queue_on_a_non_member_is_refused_with_its_cause() {
    let c = TestCluster::start(3).await;
    let leader = c.leader().await;
    let follower = (leader + 1) % 3;
    let leader_id = raft_id(&c.names[leader]);
    let stranger = raft_id("not-a-member");
    for i in [leader, follower] {
        let copy_on_stranger = MetaCommand::Place {
            id: "q".into(),
            primary: raft_id(&c.names[i]),
            secondaries: vec![stranger],
            redundancy: 1,
            timeout_ms: 1_000,
        };
        let e = c
            .node(i)
            .cluster()
            .unwrap()
            .write(copy_on_stranger)
            .await
            .expect_err("a write placing a copy on a non-member committed");
        assert!(
            !matches!(e, ClusterError::NoLeader(_)),
            "refused for its cause, not for want of a leader: {e}"
        );
        assert!(
            e.to_string().contains("not a member"),
            "the refusal names the cause: {e}"
        );
    }
    let on_leader = MetaCommand::Place {
        id: "q".into(),
        primary: leader_id,
        secondaries: vec![],
        redundancy: 0,
        timeout_ms: 1_000,
    };
    let MetaResponse::Placed(p) = c
        .node(follower)
        .cluster()
        .unwrap()
        .write(on_leader)
        .await
        .unwrap()
    else {
        panic!("not placed")
    };
    assert_eq!(
        (p.primary, p.secondaries),
        (leader_id, vec![]),
        "nothing of the refused writes"
    );
    c.shutdown().await;
}
