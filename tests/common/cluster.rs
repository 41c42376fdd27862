//! A cluster of real nodes in one process: QUIC with mutual TLS under one cluster CA on
//! loopback, RocksDB in temp dirs, static membership from `--peer`-style lists.

use std::path::Path;
use std::time::Duration;

use tether::cluster::meta::raft_id;
use tether::config::ServerConfig;
use tether::server::Node;
use tether_transport::tls;

use super::WAIT;

/// Free UDP ports on loopback (bound, read, released: the nodes bind them right after).
pub fn free_ports(n: usize) -> Vec<u16> {
    let socks: Vec<std::net::UdpSocket> = (0..n)
        .map(|_| std::net::UdpSocket::bind("127.0.0.1:0").expect("bind"))
        .collect();
    socks
        .iter()
        .map(|s| s.local_addr().expect("addr").port())
        .collect()
}

/// Data dirs sharing one cluster CA: each node signs its own certificate with it at start.
pub fn cluster_dirs(n: usize) -> Vec<tempfile::TempDir> {
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

pub fn node_config(dir: &Path, name: &str, port: u16, peers: &[(String, String)]) -> ServerConfig {
    let mut c = ServerConfig::ephemeral(dir);
    c.listen = format!("127.0.0.1:{port}").parse().unwrap();
    c.node_id = Some(name.to_string());
    c.peers = peers.to_vec();
    c
}

pub struct TestCluster {
    pub dirs: Vec<tempfile::TempDir>,
    pub names: Vec<String>,
    pub ports: Vec<u16>,
    pub peers: Vec<(String, String)>,
    pub nodes: Vec<Option<Node>>,
    /// Operator limits of every node.
    pub limits: tether::config::Limits,
}

impl TestCluster {
    pub async fn start(n: usize) -> TestCluster {
        Self::start_with(n, tether::config::Limits::default()).await
    }

    /// A cluster whose nodes have these limits.
    pub async fn start_with(n: usize, limits: tether::config::Limits) -> TestCluster {
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
            limits,
        };
        for i in 0..n {
            let node = c.boot(i).await;
            c.nodes.push(Some(node));
        }
        c
    }

    /// Starts node `i` on its port. A node stopped a moment ago releases its UDP socket
    /// when quinn's endpoint driver task ends, so a restart retries a busy port briefly.
    pub async fn boot(&self, i: usize) -> Node {
        let deadline = tokio::time::Instant::now() + WAIT;
        loop {
            let mut cfg = node_config(
                self.dirs[i].path(),
                &self.names[i],
                self.ports[i],
                &self.peers,
            );
            cfg.limits = self.limits.clone();
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

    pub fn node(&self, i: usize) -> &Node {
        self.nodes[i].as_ref().expect("running")
    }

    pub fn index_of(&self, raft: u64) -> usize {
        self.names
            .iter()
            .position(|n| raft_id(n) == raft)
            .expect("a member")
    }

    /// Waits until every running node knows the same leader; returns its index.
    pub async fn leader(&self) -> usize {
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

    pub async fn shutdown(mut self) {
        for n in self.nodes.iter_mut() {
            if let Some(n) = n.take() {
                n.shutdown().await;
            }
        }
    }
}
