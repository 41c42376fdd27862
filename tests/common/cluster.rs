//! A cluster of real nodes in one process: QUIC with mutual TLS under one cluster CA on
//! loopback, RocksDB in temp dirs, static membership from `--peer`-style lists.

use std::path::Path;
use std::time::Duration;

use tether::cluster::meta::{NodeId, raft_id};
use tether::config::ServerConfig;
use tether::server::Node;
use tether_transport::tls;

use super::WAIT;

pub use super::ports::free_ports;

/// Data dirs sharing one cluster CA: each node signs its own certificate with it at start.
pub fn cluster_dirs(n: usize) -> Vec<tempfile::TempDir> {
    let dirs: Vec<tempfile::TempDir> = (0..n).map(|_| tempfile::tempdir().unwrap()).collect();
    tls::ensure_dev_certs(&dirs[0].path().join("tls")).unwrap();
    for d in &dirs[1..] {
        share_ca(dirs[0].path(), d.path());
    }
    dirs
}

/// Gives data dir `to` the cluster CA of data dir `from`.
pub fn share_ca(from: &Path, to: &Path) {
    let (from, to) = (from.join("tls"), to.join("tls"));
    std::fs::create_dir_all(&to).unwrap();
    for file in [tls::CA_CERT_FILE, tls::CA_KEY_FILE] {
        std::fs::copy(from.join(file), to.join(file)).unwrap();
    }
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
    /// Client authentication of every node.
    pub auth: Option<tether::auth::AuthConfig>,
    /// Applied to every node's configuration last (a test's own settings).
    pub tweak: fn(&mut ServerConfig),
    /// Nodes from this index on were added to the running cluster ([`TestCluster::grow`]).
    pub first_joined: usize,
}

impl TestCluster {
    pub async fn start(n: usize) -> TestCluster {
        Self::start_with(n, tether::config::Limits::default()).await
    }

    /// A cluster whose nodes have these limits.
    pub async fn start_with(n: usize, limits: tether::config::Limits) -> TestCluster {
        Self::start_full(n, limits, None, |_| {}).await
    }

    /// A cluster whose nodes authenticate clients with `auth`.
    pub async fn start_with_auth(n: usize, auth: tether::auth::AuthConfig) -> TestCluster {
        Self::start_full(n, tether::config::Limits::default(), Some(auth), |_| {}).await
    }

    /// A cluster whose nodes' configurations are changed by `tweak`.
    pub async fn start_tweaked(n: usize, tweak: fn(&mut ServerConfig)) -> TestCluster {
        Self::start_full(n, tether::config::Limits::default(), None, tweak).await
    }

    pub async fn start_full(
        n: usize,
        limits: tether::config::Limits,
        auth: Option<tether::auth::AuthConfig>,
        tweak: fn(&mut ServerConfig),
    ) -> TestCluster {
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
            auth,
            tweak,
            first_joined: n,
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
            cfg.auth = self.auth.clone();
            cfg.join = i >= self.first_joined;
            (self.tweak)(&mut cfg);
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

    /// Starts one more node (`--join`, the cluster's CA, the members as its peers) and returns
    /// its index; a member adds it (`tether cluster add-node`).
    pub async fn grow(&mut self) -> usize {
        let i = self.names.len();
        let dir = tempfile::tempdir().unwrap();
        share_ca(self.dirs[0].path(), dir.path());
        let port = free_ports(1)[0];
        let name = format!("n{}", i + 1);
        self.peers.push((name.clone(), format!("127.0.0.1:{port}")));
        self.names.push(name);
        self.ports.push(port);
        self.dirs.push(dir);
        let node = self.boot(i).await;
        self.nodes.push(Some(node));
        i
    }

    pub fn node(&self, i: usize) -> &Node {
        self.nodes[i].as_ref().expect("running")
    }

    pub fn index_of(&self, raft: NodeId) -> usize {
        self.names
            .iter()
            .position(|n| raft_id(n) == raft)
            .expect("a member")
    }

    /// Waits until every running node knows the same leader; returns its index.
    pub async fn leader(&self) -> usize {
        let deadline = tokio::time::Instant::now() + WAIT;
        loop {
            let seen: Vec<Option<NodeId>> = self
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

/// A cluster of real `tether server` processes on loopback (node `i` is named `n{i+1}`), each
/// with its data in a temp dir; nodes can be killed with SIGKILL and started again on their port.
pub struct ProcCluster {
    pub dirs: Vec<tempfile::TempDir>,
    pub ports: Vec<u16>,
    pub procs: Vec<Option<super::ServerProc>>,
    /// `routes[i][j]`: the address node `i` uses for node `j`, when not its real port (a relay).
    pub routes: Vec<Vec<Option<std::net::SocketAddr>>>,
    /// A TOML file every node starts with (`--config`), if any.
    pub config: Option<tempfile::NamedTempFile>,
    /// Whether nodes serve `/metrics` (on a port of their choosing): [`ProcCluster::leader`].
    pub metrics: bool,
}

impl ProcCluster {
    pub fn start(n: usize) -> ProcCluster {
        Self::start_routed(free_ports(n), vec![vec![None; n]; n])
    }

    /// Starts `n` nodes, each with the TOML file `toml` (`--config`).
    pub fn start_with_config(n: usize, toml: &str) -> ProcCluster {
        let mut f = tempfile::NamedTempFile::new().expect("config file");
        std::io::Write::write_all(&mut f, toml.as_bytes()).expect("write config");
        Self::start_inner(free_ports(n), vec![vec![None; n]; n], Some(f), false)
    }

    /// Starts nodes on `ports`, node `i` reaching node `j` at `routes[i][j]` when set.
    pub fn start_routed(
        ports: Vec<u16>,
        routes: Vec<Vec<Option<std::net::SocketAddr>>>,
    ) -> ProcCluster {
        Self::start_inner(ports, routes, None, false)
    }

    /// [`ProcCluster::start_routed`], each node serving `/metrics` (for [`ProcCluster::leader`]).
    pub fn start_routed_observed(
        ports: Vec<u16>,
        routes: Vec<Vec<Option<std::net::SocketAddr>>>,
    ) -> ProcCluster {
        Self::start_inner(ports, routes, None, true)
    }

    fn start_inner(
        ports: Vec<u16>,
        routes: Vec<Vec<Option<std::net::SocketAddr>>>,
        config: Option<tempfile::NamedTempFile>,
        metrics: bool,
    ) -> ProcCluster {
        let n = ports.len();
        let mut p = ProcCluster {
            dirs: cluster_dirs(n),
            ports,
            procs: Vec::new(),
            routes,
            config,
            metrics,
        };
        for i in 0..n {
            let s = p.spawn(i);
            p.procs.push(Some(s));
        }
        p
    }

    /// Starts node `i` (not yet running) and waits for its listening line.
    pub fn spawn(&self, i: usize) -> super::ServerProc {
        let listen = format!("127.0.0.1:{}", self.ports[i]);
        let name = format!("n{}", i + 1);
        let peers: Vec<String> = (0..self.ports.len())
            .map(|j| match self.routes[i][j] {
                Some(via) => format!("n{}={via}", j + 1),
                None => format!("n{}=127.0.0.1:{}", j + 1, self.ports[j]),
            })
            .collect();
        let config = self
            .config
            .as_ref()
            .map(|f| f.path().to_str().expect("utf-8 temp path").to_string());
        let mut args: Vec<&str> = vec!["--listen", &listen, "--node-id", &name];
        if self.metrics {
            args.extend(["--metrics", "127.0.0.1:0"]);
        }
        if let Some(c) = &config {
            args.push("--config");
            args.push(c);
        }
        for p in &peers {
            args.push("--peer");
            args.push(p);
        }
        super::ServerProc::start(self.dirs[i].path(), &args)
    }

    pub fn get(&self, i: usize) -> &super::ServerProc {
        self.procs[i].as_ref().expect("running")
    }

    /// The metadata leader (index), once every running node's `/metrics` agrees on one in two
    /// readings a second apart (the gauge is refreshed every second). Needs a cluster started
    /// with metrics ([`ProcCluster::start_routed_observed`]).
    pub async fn leader(&self) -> usize {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
        let mut last = None;
        loop {
            let leaders: Vec<usize> = (0..self.procs.len())
                .filter(|&i| {
                    self.procs[i].as_ref().is_some_and(|p| {
                        let addr = p.metrics.expect("nodes started with metrics").to_string();
                        super::http_get(&addr, "/metrics")
                            .lines()
                            .any(|l| l.trim() == "tether_cluster_is_leader 1")
                    })
                })
                .collect();
            let now = (leaders.len() == 1).then(|| leaders[0]);
            if now.is_some() && now == last {
                return leaders[0];
            }
            assert!(
                std::time::Instant::now() < deadline,
                "no agreed leader: {leaders:?}"
            );
            last = now;
            tokio::time::sleep(std::time::Duration::from_secs(1)).await;
        }
    }

    /// SIGKILL node `i`.
    pub fn kill9(&mut self, i: usize) {
        self.procs[i].take().expect("running").kill9();
    }

    /// Starts node `i` again after a kill.
    pub fn restart(&mut self, i: usize) {
        assert!(self.procs[i].is_none(), "node {i} is running");
        self.procs[i] = Some(self.spawn(i));
    }

    /// The address of node `i` (running or not).
    pub fn addr(&self, i: usize) -> std::net::SocketAddr {
        format!("127.0.0.1:{}", self.ports[i]).parse().unwrap()
    }

    /// The index of the node named `name`.
    pub fn index(&self, name: &str) -> usize {
        name.strip_prefix('n')
            .and_then(|n| n.parse::<usize>().ok())
            .map(|n| n - 1)
            .filter(|&i| i < self.ports.len())
            .unwrap_or_else(|| panic!("no node named {name:?}"))
    }

    /// A client builder trying the running nodes among `nodes`, in order.
    pub fn builder(&self, nodes: &[usize]) -> tether::client::ClientBuilder {
        let any = nodes
            .iter()
            .find_map(|&i| self.procs[i].as_ref())
            .expect("a running node");
        tether::client::ClientBuilder::new()
            .servers(
                nodes
                    .iter()
                    .filter(|&&i| self.procs[i].is_some())
                    .map(|&i| self.addr(i)),
            )
            .ca_file(&any.ca)
    }
}

/// Publishes puts `k-{from..to}` of region R (value = the number as text) through `builder`'s
/// server, `ops_per_publish` per request, each acknowledged before the next; `progress` follows
/// the acknowledged count. Returns how many were acknowledged before an error.
pub async fn publish_numbered(
    builder: tether::client::ClientBuilder,
    from: u32,
    to: u32,
    ops_per_publish: u32,
    progress: &std::sync::atomic::AtomicU32,
) -> u32 {
    let c = builder.connect().await.expect("publisher connects");
    let mut done = from;
    while done < to {
        let n = ops_per_publish.min(to - done);
        if c.publish(numbered_puts(done..done + n)).await.is_err() {
            break;
        }
        done += n;
        progress.store(done, std::sync::atomic::Ordering::SeqCst);
    }
    done
}

/// Puts `k-{i}` of region R with the number `i` as text for its value, for each `i` of
/// `numbers`: the events whose values tests count.
pub fn numbered_puts(numbers: std::ops::Range<u32>) -> Vec<tether::protocol::PublishOp> {
    numbers
        .map(|i| tether::protocol::PublishOp::Put {
            region: "R".into(),
            key: format!("k-{i}"),
            value: i.to_string().into_bytes(),
        })
        .collect()
}
