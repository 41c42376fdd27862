//! The cluster-metadata group: three real nodes on loopback (QUIC with mutual TLS under one
//! cluster CA, RocksDB consensus logs in temp dirs) elect a leader, commit metadata written on
//! any node, survive the loss of the leader, and a restarted node catches up.

use std::path::Path;
use std::time::Duration;

use tether::cluster::meta::{MetaCommand, MetaResponse, raft_id};
use tether::config::ServerConfig;
use tether::server::Node;
use tether_transport::tls;

const WAIT: Duration = Duration::from_secs(20);

/// Free UDP ports on loopback (bound, read, released: the nodes bind them right after).
fn free_ports(n: usize) -> Vec<u16> {
    let socks: Vec<std::net::UdpSocket> = (0..n)
        .map(|_| std::net::UdpSocket::bind("127.0.0.1:0").expect("bind"))
        .collect();
    socks
        .iter()
        .map(|s| s.local_addr().expect("addr").port())
        .collect()
}

/// Data dirs sharing one cluster CA: each node signs its own certificate with it at start.
fn cluster_dirs(n: usize) -> Vec<tempfile::TempDir> {
    let dirs: Vec<tempfile::TempDir> = (0..n).map(|_| tempfile::tempdir().unwrap()).collect();
    let first = tls::ensure_dev_certs(&dirs[0].path().join("tls")).unwrap();
    for d in &dirs[1..] {
        let t = d.path().join("tls");
        std::fs::create_dir_all(&t).unwrap();
        std::fs::copy(&first.ca, t.join(tls::CA_CERT_FILE)).unwrap();
        std::fs::copy(
            first.ca.with_file_name(tls::CA_KEY_FILE),
            t.join(tls::CA_KEY_FILE),
        )
        .unwrap();
    }
    dirs
}

fn node_config(dir: &Path, name: &str, port: u16, peers: &[(String, String)]) -> ServerConfig {
    let mut c = ServerConfig::ephemeral(dir);
    c.listen = format!("127.0.0.1:{port}").parse().unwrap();
    c.node_id = Some(name.to_string());
    c.peers = peers.to_vec();
    c
}

struct TestCluster {
    dirs: Vec<tempfile::TempDir>,
    names: Vec<String>,
    ports: Vec<u16>,
    peers: Vec<(String, String)>,
    nodes: Vec<Option<Node>>,
}

impl TestCluster {
    async fn start(n: usize) -> TestCluster {
        let dirs = cluster_dirs(n);
        let ports = free_ports(n);
        let names: Vec<String> = (1..=n).map(|i| format!("n{i}")).collect();
        let peers: Vec<(String, String)> = names
            .iter()
            .zip(&ports)
            .map(|(name, p)| (name.clone(), format!("127.0.0.1:{p}")))
            .collect();
        let mut c = TestCluster {
            dirs,
            names,
            ports,
            peers,
            nodes: Vec::new(),
        };
        for i in 0..n {
            let node = c.boot(i).await;
            c.nodes.push(Some(node));
        }
        c
    }

    /// Starts node `i` on its port. A node stopped a moment ago releases its UDP socket
    /// when quinn's endpoint driver task ends, so a restart retries a busy port briefly.
    async fn boot(&self, i: usize) -> Node {
        let deadline = tokio::time::Instant::now() + WAIT;
        loop {
            let cfg = node_config(
                self.dirs[i].path(),
                &self.names[i],
                self.ports[i],
                &self.peers,
            );
            match Node::start(cfg).await {
                Ok(node) => return node,
                Err(tether::server::NodeError::Listen { .. })
                    if tokio::time::Instant::now() < deadline =>
                {
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
                Err(e) => panic!("node {i} starts: {e}"),
            }
        }
    }

    fn node(&self, i: usize) -> &Node {
        self.nodes[i].as_ref().expect("running")
    }

    fn index_of(&self, raft: u64) -> usize {
        self.names
            .iter()
            .position(|n| raft_id(n) == raft)
            .expect("a member")
    }

    /// Waits until every running node knows the same leader; returns its index.
    async fn leader(&self) -> usize {
        let deadline = tokio::time::Instant::now() + WAIT;
        loop {
            let seen: Vec<Option<u64>> = self
                .nodes
                .iter()
                .flatten()
                .map(|n| n.cluster().expect("clustered").leader())
                .collect();
            if let Some(Some(l)) = seen.first() {
                let l = *l;
                let running = self.index_of(l);
                if seen.iter().all(|s| *s == Some(l)) && self.nodes[running].is_some() {
                    return running;
                }
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "no agreed leader: {seen:?}"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    async fn shutdown(mut self) {
        for n in self.nodes.iter_mut() {
            if let Some(n) = n.take() {
                n.shutdown().await;
            }
        }
    }
}

async fn eventually(what: &str, mut check: impl FnMut() -> bool) {
    let deadline = tokio::time::Instant::now() + WAIT;
    while !check() {
        assert!(tokio::time::Instant::now() < deadline, "timed out: {what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

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
