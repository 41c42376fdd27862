//! `tether server` processes for the benchmarks, so that a figure of server memory is the
//! server's alone: one node, or a cluster of nodes on loopback sharing one dev CA.
// Each benchmark uses a part of this module.
#![allow(dead_code)]

use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};

use tether::client::ClientBuilder;

use super::rss_kb_of;

/// One `tether server` process (killed when dropped).
pub struct ServerProcess {
    child: Child,
    pub addr: SocketAddr,
    /// The Prometheus address, when started with `--metrics`.
    pub metrics: Option<String>,
    pub ca: PathBuf,
    pub builder: ClientBuilder,
}

impl ServerProcess {
    /// Starts the binary on `data` with `extra` flags (`--listen 127.0.0.1:0` unless given) and
    /// waits for its listening line.
    pub fn start(data: &Path, extra: &[&str]) -> ServerProcess {
        // TETHER_BENCH_SERVER_WRAPPER runs the server under a profiler (`heaptrack`, `perf
        // record -g --`...): words split on spaces, the binary and its arguments after them.
        // The process id is then the wrapper's: resident memory and kill -9 reach the wrapper,
        // not the server (profile without node kills; the figures are the profiler's).
        let wrapper = std::env::var("TETHER_BENCH_SERVER_WRAPPER").unwrap_or_default();
        let mut words = wrapper.split_whitespace();
        let mut cmd = match words.next() {
            Some(program) => {
                let mut cmd = Command::new(program);
                cmd.args(words).arg(env!("CARGO_BIN_EXE_tether"));
                cmd
            }
            None => Command::new(env!("CARGO_BIN_EXE_tether")),
        };
        cmd.arg("server");
        if !extra.contains(&"--metrics") {
            cmd.args(["--metrics", "off"]);
        }
        if !extra.contains(&"--listen") {
            cmd.args(["--listen", "127.0.0.1:0"]);
        }
        // A cluster node's log lines carry its node id, so that interleaved logs can be read.
        let label = extra
            .iter()
            .position(|a| *a == "--node-id")
            .and_then(|i| extra.get(i + 1))
            .map(|id| id.to_string());
        let mut child = cmd
            .args(extra)
            .arg("--data-dir")
            .arg(data)
            .stdout(Stdio::piped())
            .stderr(if label.is_some() {
                Stdio::piped()
            } else {
                Stdio::inherit()
            })
            .spawn()
            .expect("spawn tether server");
        if let (Some(label), Some(err)) = (label, child.stderr.take()) {
            std::thread::spawn(move || {
                for line in BufReader::new(err).lines() {
                    let Ok(line) = line else { break };
                    eprintln!("[{label}] {line}");
                }
            });
        }
        // The listening line is the server's first JSON line (a wrapper may print before it).
        let mut out = BufReader::new(child.stdout.take().unwrap());
        let mut line = String::new();
        while !line.starts_with('{') {
            line.clear();
            if out.read_line(&mut line).expect("listening line") == 0 {
                panic!("the server exited before its listening line");
            }
        }
        let v: serde_json::Value = serde_json::from_str(&line)
            .unwrap_or_else(|e| panic!("bad listening line {line:?}: {e}"));
        assert_eq!(v["type"], "listening");
        let addr = v["addr"].as_str().unwrap().parse().unwrap();
        let ca = PathBuf::from(v["ca"].as_str().unwrap());
        ServerProcess {
            child,
            addr,
            metrics: v["metrics"].as_str().map(str::to_string),
            builder: ClientBuilder::new().server(addr).ca_file(&ca),
            ca,
        }
    }

    /// The process's resident memory, in KiB.
    pub fn rss_kb(&self) -> u64 {
        rss_kb_of(&self.child.id().to_string())
    }

    /// The samples of the node's `/metrics` whose name starts with `prefix`, as
    /// `(name{labels}, value)`; empty without metrics or when the node does not answer.
    pub fn metrics(&self, prefix: &str) -> Vec<(String, f64)> {
        use std::io::{Read, Write};
        let Some(addr) = &self.metrics else {
            return Vec::new();
        };
        let Ok(mut s) = std::net::TcpStream::connect(addr) else {
            return Vec::new();
        };
        let _ = s.set_read_timeout(Some(std::time::Duration::from_secs(5)));
        let _ = write!(
            s,
            "GET /metrics HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n"
        );
        let mut text = String::new();
        let _ = s.read_to_string(&mut text);
        text.lines()
            .filter(|l| l.starts_with(prefix))
            .filter_map(|l| {
                let (name, value) = l.rsplit_once(' ')?;
                Some((name.to_string(), value.parse().ok()?))
            })
            .collect()
    }

    /// SIGTERM and wait: the server's clean stop.
    pub fn stop(mut self) {
        let _ = Command::new("kill")
            .args(["-TERM", &self.child.id().to_string()])
            .status();
        let _ = self.child.wait();
    }
}

impl Drop for ServerProcess {
    fn drop(&mut self) {
        if std::env::var_os("TETHER_BENCH_SERVER_WRAPPER").is_some() {
            // The child is the wrapper: its children (the server) go first.
            let _ = Command::new("pkill")
                .args(["-KILL", "-P", &self.child.id().to_string()])
                .status();
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Every primary queue report of the nodes behind `admins` (one admin connection to each).
pub async fn primary_queues(admins: &[ClientBuilder]) -> Vec<tether::protocol::QueueReport> {
    let mut out = Vec::new();
    for b in admins {
        let Ok(c) = b.clone().connect().await else {
            continue;
        };
        if let Ok(qs) = c.queues().await {
            out.extend(qs.into_iter().filter(|q| q.role == "primary"));
        }
        let _ = c.close(false).await;
    }
    out
}

/// `n` nodes: one plain node, or (`n` > 1) a cluster named `n1..` on fixed loopback ports with
/// one dev cluster CA. Nodes can be killed (-9) and started again on their data and port.
pub struct Nodes {
    dirs: Vec<PathBuf>,
    ports: Vec<u16>,
    extra: Vec<String>,
    pub procs: Vec<Option<ServerProcess>>,
    pub ca: PathBuf,
}

impl Nodes {
    pub fn start(dir: &Path, n: usize, extra: &[&str]) -> Nodes {
        assert!(n >= 1);
        let dirs: Vec<PathBuf> = (1..=n).map(|i| dir.join(format!("n{i}"))).collect();
        if n > 1 {
            let first =
                tether::transport::tls::ensure_dev_certs(&dirs[0].join("tls")).expect("cluster CA");
            for d in &dirs[1..] {
                let t = d.join("tls");
                std::fs::create_dir_all(&t).unwrap();
                std::fs::copy(&first.ca, t.join("ca.pem")).unwrap();
                std::fs::copy(first.ca.with_file_name("ca.key"), t.join("ca.key")).unwrap();
            }
        }
        // Outside the ephemeral range: a killed node restarts on its port while clients churn.
        let ports = super::ports::free_ports(n);
        let mut nodes = Nodes {
            dirs,
            ports,
            extra: extra.iter().map(|s| s.to_string()).collect(),
            procs: Vec::new(),
            ca: PathBuf::new(),
        };
        for i in 0..n {
            let p = nodes.spawn(i);
            nodes.ca = p.ca.clone();
            nodes.procs.push(Some(p));
        }
        nodes
    }

    pub fn len(&self) -> usize {
        self.ports.len()
    }

    pub fn addr(&self, i: usize) -> SocketAddr {
        format!("127.0.0.1:{}", self.ports[i]).parse().unwrap()
    }

    fn spawn(&self, i: usize) -> ServerProcess {
        let listen = format!("127.0.0.1:{}", self.ports[i]);
        let mut args: Vec<String> = vec![
            "--listen".into(),
            listen,
            "--metrics".into(),
            "127.0.0.1:0".into(),
        ];
        if self.len() > 1 {
            args.push("--node-id".into());
            args.push(format!("n{}", i + 1));
            for j in 0..self.len() {
                args.push("--peer".into());
                args.push(format!("n{}=127.0.0.1:{}", j + 1, self.ports[j]));
            }
        }
        args.extend(self.extra.iter().cloned());
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        ServerProcess::start(&self.dirs[i], &args)
    }

    /// A builder trying every node, starting with node `first % n` (so that new durable queues
    /// are placed across the cluster).
    pub fn builder(&self, first: usize) -> ClientBuilder {
        let n = self.len();
        ClientBuilder::new()
            .servers((0..n).map(|k| self.addr((first + k) % n)))
            .ca_file(&self.ca)
    }

    /// Resident memory of every running node, in KiB (0 for a node that is down).
    pub fn rss_kb(&self) -> Vec<u64> {
        self.procs
            .iter()
            .map(|p| p.as_ref().map_or(0, ServerProcess::rss_kb))
            .collect()
    }

    pub fn kill9(&mut self, i: usize) {
        drop(self.procs[i].take());
    }

    pub fn restart(&mut self, i: usize) {
        assert!(self.procs[i].is_none(), "node {i} is running");
        self.procs[i] = Some(self.spawn(i));
    }

    /// Every running node's samples of `/metrics` starting with `prefix` (see
    /// [`ServerProcess::metrics`]), by node index.
    pub fn metrics(&self, prefix: &str) -> Vec<(usize, Vec<(String, f64)>)> {
        self.procs
            .iter()
            .enumerate()
            .filter_map(|(i, p)| Some((i, p.as_ref()?.metrics(prefix))))
            .collect()
    }

    /// Admin client builders, one for each running node.
    pub fn admin_builders(&self) -> Vec<ClientBuilder> {
        self.procs
            .iter()
            .flatten()
            .map(|p| p.builder.clone())
            .collect()
    }

    /// Stops every node cleanly (SIGTERM).
    pub fn stop(mut self) {
        for p in self.procs.iter_mut() {
            if let Some(p) = p.take() {
                p.stop();
            }
        }
    }
}
