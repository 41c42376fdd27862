//! Server configuration: command-line flags and the TOML file (flags win), validated.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use serde::Deserialize;

/// How storage writes reach the disk.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum SyncMode {
    /// fsync every write request on its own.
    Always,
    /// Group commit: concurrent write requests share one write batch and one fsync.
    #[default]
    Batch,
    /// No fsync: writes reach the OS (they survive a process kill, not a machine crash).
    None,
}

impl std::str::FromStr for SyncMode {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "always" => Ok(SyncMode::Always),
            "batch" => Ok(SyncMode::Batch),
            "none" => Ok(SyncMode::None),
            other => Err(format!(
                "unknown sync mode {other:?} (expected always, batch or none)"
            )),
        }
    }
}

/// What a node does when a publish would grow a subscription queue past its entry or byte
/// limit.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum QueueFullPolicy {
    /// The publisher waits (up to `queue-full-block-ms`) for the client to ack, then is refused.
    Block,
    /// The publish is refused at once with `queue-full`; nothing of it is applied.
    #[default]
    Reject,
    /// The full queue is dropped with its interest; its client is disconnected with
    /// `queue-full` and sees `expired` on its next connection. The publish goes ahead.
    DropQueue,
}

impl std::str::FromStr for QueueFullPolicy {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "block" => Ok(QueueFullPolicy::Block),
            "reject" => Ok(QueueFullPolicy::Reject),
            "drop-queue" => Ok(QueueFullPolicy::DropQueue),
            other => Err(format!(
                "unknown queue-full policy {other:?} (expected block, reject or drop-queue)"
            )),
        }
    }
}

/// Upper bound of `queue-full-block-ms`, in milliseconds.
pub const QUEUE_FULL_BLOCK_MS_MAX: u64 = 60_000;
/// Upper bound of `idle-timeout-ms`, in milliseconds (one hour).
pub const IDLE_TIMEOUT_MS_MAX: u64 = 3_600_000;
/// Default of `queue-full-block-ms`, in milliseconds.
pub const QUEUE_FULL_BLOCK_MS_DEFAULT: u64 = 5_000;

/// The limits a node enforces that operators may change (`[limits]` in the TOML file).
/// Defaults come from `crate::limits`.
#[derive(Clone, Debug, PartialEq, Eq, Deserialize)]
#[serde(default, deny_unknown_fields, rename_all = "kebab-case")]
pub struct Limits {
    /// Entries one queue may hold beyond its acked offset.
    pub queue_entries_max: u64,
    /// Bytes of stored events one queue may hold beyond its acked offset (counted with an
    /// over-estimate of at most 1/64 of this plus one event, never under).
    pub queue_bytes_max: u64,
    /// Cluster: bytes of this node's publishes kept for peers that have not applied them; a
    /// node holding this much refuses new publishes (`unavailable`) until peers catch up.
    pub publish_log_bytes_max: u64,
    pub queue_full_policy: QueueFullPolicy,
    /// How long a publish waits under the `block` policy, in milliseconds.
    pub queue_full_block_ms: u64,
    /// Concurrent client connections.
    pub connections_max: usize,
    /// Time a new connection has to send its hello, in milliseconds.
    pub handshake_timeout_ms: u64,
    /// Events a session may have on the wire beyond its acked offset.
    pub inflight_events_max: u64,
    /// A connection silent this long is closed (treated as a crash: keepalive), in
    /// milliseconds. Must exceed the keep-alive interval.
    pub idle_timeout_ms: u64,
    /// Bytes a client (or peer) may send on one connection beyond what the node has read
    /// (QUIC flow control: what the node buffers for it, all streams together; one stream gets
    /// at most `STREAM_RECEIVE_WINDOW_BYTES` of it).
    pub connection_receive_window_bytes: u64,
    /// Bytes the node keeps written but not yet acknowledged by the other side on one
    /// connection (its send buffer for a slow client).
    pub connection_send_window_bytes: u64,
}

impl Default for Limits {
    fn default() -> Self {
        use crate::limits::*;
        Limits {
            queue_entries_max: QUEUE_ENTRIES_MAX,
            queue_bytes_max: QUEUE_BYTES_MAX,
            publish_log_bytes_max: PUBLISH_LOG_BYTES_MAX,
            queue_full_policy: QueueFullPolicy::Reject,
            queue_full_block_ms: QUEUE_FULL_BLOCK_MS_DEFAULT,
            connections_max: CONNECTIONS_PER_NODE_MAX,
            handshake_timeout_ms: HANDSHAKE_TIMEOUT_MS,
            inflight_events_max: INFLIGHT_EVENTS_PER_SESSION_MAX,
            idle_timeout_ms: tether_transport::tls::IDLE_TIMEOUT_MS,
            connection_receive_window_bytes: tether_transport::tls::SERVER_RECEIVE_WINDOW_BYTES,
            connection_send_window_bytes: tether_transport::tls::SERVER_SEND_WINDOW_BYTES,
        }
    }
}

impl Limits {
    /// Checks every value; the message names the setting.
    pub fn validate(&self) -> Result<(), String> {
        let positive = [
            ("queue-entries-max", self.queue_entries_max),
            ("connections-max", self.connections_max as u64),
            ("handshake-timeout-ms", self.handshake_timeout_ms),
            ("inflight-events-max", self.inflight_events_max),
        ];
        for (name, v) in positive {
            if v == 0 {
                return Err(format!("limits.{name} must be at least 1"));
            }
        }
        let lowest = crate::limits::QUEUE_BYTES_MAX_LOWEST_BYTES;
        if self.queue_bytes_max < lowest {
            return Err(format!("limits.queue-bytes-max must be at least {lowest}"));
        }
        if self.publish_log_bytes_max < lowest {
            return Err(format!(
                "limits.publish-log-bytes-max must be at least {lowest}"
            ));
        }
        if self.queue_full_block_ms > QUEUE_FULL_BLOCK_MS_MAX {
            return Err(format!(
                "limits.queue-full-block-ms must be at most {QUEUE_FULL_BLOCK_MS_MAX}"
            ));
        }
        let keep_alive = tether_transport::tls::KEEP_ALIVE_INTERVAL_MS;
        if self.idle_timeout_ms <= keep_alive || self.idle_timeout_ms > IDLE_TIMEOUT_MS_MAX {
            return Err(format!(
                "limits.idle-timeout-ms must be above the keep-alive interval ({keep_alive}) and at most {IDLE_TIMEOUT_MS_MAX}"
            ));
        }
        use tether_transport::tls::{CONNECTION_WINDOW_BYTES_LOWEST, CONNECTION_WINDOW_BYTES_MAX};
        for (name, v) in [
            (
                "connection-receive-window-bytes",
                self.connection_receive_window_bytes,
            ),
            (
                "connection-send-window-bytes",
                self.connection_send_window_bytes,
            ),
        ] {
            if !(CONNECTION_WINDOW_BYTES_LOWEST..=CONNECTION_WINDOW_BYTES_MAX).contains(&v) {
                return Err(format!(
                    "limits.{name} must be between {CONNECTION_WINDOW_BYTES_LOWEST} and {CONNECTION_WINDOW_BYTES_MAX}"
                ));
            }
        }
        if self.handshake_timeout_ms > QUEUE_FULL_BLOCK_MS_MAX {
            return Err(format!(
                "limits.handshake-timeout-ms must be at most {QUEUE_FULL_BLOCK_MS_MAX}"
            ));
        }
        Ok(())
    }
}

/// Server certificate files; without them a dev CA and certificate are generated into
/// `<data-dir>/tls/`.
#[derive(Clone, Debug, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TlsConfig {
    pub cert: PathBuf,
    pub key: PathBuf,
    /// The CA clients should trust (printed in the listening line).
    pub ca: PathBuf,
}

/// A node's configuration.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ServerConfig {
    pub data_dir: PathBuf,
    pub listen: SocketAddr,
    /// Prometheus `/metrics` address; None disables the endpoint.
    pub metrics: Option<SocketAddr>,
    pub node_id: Option<String>,
    pub sync: SyncMode,
    pub tls: Option<TlsConfig>,
    pub limits: Limits,
    /// Authentication and authorization; None: an open node.
    pub auth: Option<crate::auth::AuthConfig>,
    /// The configuration file `auth` was read from: a node with `[auth]` reads the file's
    /// `[auth]` table again whenever the file changes (tokens, admins, ACLs; see
    /// `server/auth_reload.rs`). None: `auth` is read once.
    pub auth_file: Option<PathBuf>,
    /// Cluster members as (node id, QUIC address); empty: a single node. May include this
    /// node itself (so every member can share one list).
    pub peers: Vec<(String, String)>,
    /// A member silent this long is declared failed by the metadata leader (the queues it was
    /// primary of fail over), in milliseconds. TOML `[cluster] node-failure-ms`.
    pub node_failure_ms: u64,
    /// Whether this node hands durable queues over to members holding fewer primaries
    /// (`server/rebalance.rs`). TOML `[cluster] rebalance`, default true.
    pub rebalance: bool,
    /// Host names or IP addresses clients reach this node by, besides `localhost`, the
    /// loopback addresses and the machine's host name: the dev server certificate carries
    /// them (`--advertise`, TOML `advertise`). Unused with `[tls]` (the operator's certificate
    /// names what it names).
    pub advertise: Vec<String>,
}

/// Default of [`ServerConfig::node_failure_ms`], in milliseconds.
pub const NODE_FAILURE_MS_DEFAULT: u64 = 2_500;
/// Least [`ServerConfig::node_failure_ms`], in milliseconds (above the peer ping timeout).
pub const NODE_FAILURE_MS_MIN: u64 = 1_500;
/// Most [`ServerConfig::node_failure_ms`], in milliseconds.
pub const NODE_FAILURE_MS_MAX: u64 = 3_600_000;

/// Checks a `node-failure-ms` value.
pub fn validate_node_failure_ms(ms: u64) -> Result<(), String> {
    if !(NODE_FAILURE_MS_MIN..=NODE_FAILURE_MS_MAX).contains(&ms) {
        return Err(format!(
            "node-failure-ms {ms} is outside {NODE_FAILURE_MS_MIN}..={NODE_FAILURE_MS_MAX}"
        ));
    }
    Ok(())
}

/// Default client/peer address.
pub const DEFAULT_LISTEN: &str = "127.0.0.1:7400";
/// Default metrics address.
pub const DEFAULT_METRICS: &str = "127.0.0.1:9400";
/// Longest node id, in bytes.
pub const NODE_ID_BYTES_MAX: usize = 64;

impl Default for ServerConfig {
    fn default() -> Self {
        ServerConfig {
            data_dir: PathBuf::from("data"),
            listen: DEFAULT_LISTEN.parse().expect("valid default"),
            metrics: Some(DEFAULT_METRICS.parse().expect("valid default")),
            node_id: None,
            sync: SyncMode::Batch,
            tls: None,
            limits: Limits::default(),
            auth: None,
            auth_file: None,
            peers: Vec::new(),
            node_failure_ms: NODE_FAILURE_MS_DEFAULT,
            rebalance: true,
            advertise: Vec::new(),
        }
    }
}

impl ServerConfig {
    /// A config for tests and embedding: loopback port 0, metrics off, data in `dir`.
    pub fn ephemeral(dir: impl Into<PathBuf>) -> Self {
        ServerConfig {
            data_dir: dir.into(),
            listen: "127.0.0.1:0".parse().expect("valid"),
            metrics: None,
            ..Default::default()
        }
    }
}

/// The TOML file: every field optional; unknown fields are an error.
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "kebab-case")]
pub struct FileConfig {
    pub data_dir: Option<PathBuf>,
    pub listen: Option<String>,
    pub metrics: Option<String>,
    pub node_id: Option<String>,
    pub sync: Option<SyncMode>,
    pub tls: Option<TlsConfig>,
    pub limits: Option<Limits>,
    pub auth: Option<crate::auth::AuthConfig>,
    pub cluster: Option<ClusterFileConfig>,
    /// See [`ServerConfig::advertise`].
    pub advertise: Option<Vec<String>>,
}

/// The `[cluster]` table of the TOML file.
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "kebab-case")]
pub struct ClusterFileConfig {
    /// Members as `ID=ADDR`, like `--peer`.
    #[serde(default)]
    pub peers: Vec<String>,
    /// See [`ServerConfig::node_failure_ms`].
    pub node_failure_ms: Option<u64>,
    /// See [`ServerConfig::rebalance`].
    pub rebalance: Option<bool>,
}

/// Parses a `--peer` value `ID=ADDR` (ADDR an `IP:PORT`).
pub fn parse_peer(s: &str) -> Result<(String, String), String> {
    let (id, addr) = s
        .split_once('=')
        .ok_or_else(|| format!("invalid peer {s:?} (expected ID=ADDR, e.g. n2=127.0.0.1:7402)"))?;
    validate_node_id(id)?;
    let invalid = || {
        format!(
            "invalid peer address {addr:?} (expected IP:PORT or HOST:PORT, e.g. 127.0.0.1:7402 or tether-2.example.com:7402)"
        )
    };
    // An IP address as is; a host name is resolved each time the peer is dialed.
    let (addr, port) = match addr.parse::<SocketAddr>() {
        Ok(a) => (a.to_string(), a.port()),
        Err(_) => {
            let (host, port) = addr.rsplit_once(':').ok_or_else(invalid)?;
            let port: u16 = port.parse().map_err(|_| invalid())?;
            if host.parse::<std::net::IpAddr>().is_ok()
                || host.starts_with('[')
                || validate_advertise(host).is_err()
            {
                return Err(invalid());
            }
            (addr.to_string(), port)
        }
    };
    if port == 0 {
        return Err(format!("peer {id}: port 0 cannot be dialed"));
    }
    Ok((id.to_string(), addr))
}

impl FileConfig {
    pub fn load(path: &Path) -> Result<Self, String> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| format!("cannot read config file {}: {e}", path.display()))?;
        toml::from_str(&text).map_err(|e| format!("invalid config file {}: {e}", path.display()))
    }
}

/// Checks a name a node is advertised by: a DNS name or an IP address a certificate can carry.
pub fn validate_advertise(name: &str) -> Result<(), String> {
    match rustls::pki_types::ServerName::try_from(name) {
        Ok(_) => Ok(()),
        Err(_) => Err(format!(
            "invalid advertised name {name:?} (expected a DNS name or an IP address, e.g. tether-1.example.com)"
        )),
    }
}

/// The machine's host name, if it is a valid DNS name (the dev server certificate carries it).
pub fn machine_host_name() -> Option<String> {
    let name = std::fs::read_to_string("/proc/sys/kernel/hostname").ok()?;
    let name = name.trim().to_ascii_lowercase();
    (!name.is_empty() && validate_advertise(&name).is_ok()).then_some(name)
}

/// Parses a socket address, with a message naming the setting.
pub fn parse_addr(what: &str, s: &str) -> Result<SocketAddr, String> {
    s.parse().map_err(|_| {
        format!("invalid {what} address {s:?} (expected IP:PORT, e.g. 127.0.0.1:7400)")
    })
}

/// Parses the metrics setting: an address or `off`.
pub fn parse_metrics(s: &str) -> Result<Option<SocketAddr>, String> {
    if s == "off" {
        Ok(None)
    } else {
        parse_addr("metrics", s).map(Some)
    }
}

/// The warning a node starts with when it is open (no `[auth]`) and listens beyond loopback:
/// every client that reaches it may publish, subscribe and run admin commands.
pub fn open_node_warning(listen: SocketAddr, secured: bool) -> Option<String> {
    if secured || listen.ip().is_loopback() {
        return None;
    }
    Some(format!(
        "OPEN NODE on {listen}: no [auth] table, so every client that reaches this address may publish, subscribe and run admin commands; configure [auth] (docs/operations.md) or listen on loopback only"
    ))
}

/// Validates a node id: 1 to 64 of `[A-Za-z0-9_.-]`.
pub fn validate_node_id(id: &str) -> Result<(), String> {
    if id.is_empty()
        || id.len() > NODE_ID_BYTES_MAX
        || !id
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c))
    {
        return Err(format!(
            "invalid node id {id:?}: use 1 to {NODE_ID_BYTES_MAX} letters, digits, '-', '_' or '.'"
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn file_config_parses_and_rejects_unknown_fields() {
        let c: FileConfig =
            toml::from_str("listen = \"127.0.0.1:7500\"\nsync = \"always\"\n").unwrap();
        assert_eq!(c.sync, Some(SyncMode::Always));
        assert!(toml::from_str::<FileConfig>("lisen = \"x\"").is_err());
        assert!(toml::from_str::<FileConfig>("sync = \"sometimes\"").is_err());
    }

    #[test]
    fn limits_parse_with_defaults_and_validate() {
        let c: FileConfig =
            toml::from_str("[limits]\nqueue-entries-max = 5\nqueue-full-policy = \"drop-queue\"\n")
                .unwrap();
        let l = c.limits.unwrap();
        assert_eq!(
            (l.queue_entries_max, l.queue_full_policy),
            (5, QueueFullPolicy::DropQueue)
        );
        assert_eq!(l.connections_max, crate::limits::CONNECTIONS_PER_NODE_MAX);
        assert!(l.validate().is_ok());
        assert!(toml::from_str::<FileConfig>("[limits]\nqueue-full-policy = \"wait\"\n").is_err());
        assert!(toml::from_str::<FileConfig>("[limits]\nqueue-size = 1\n").is_err());
        let zero = Limits {
            inflight_events_max: 0,
            ..Limits::default()
        };
        assert!(zero.validate().unwrap_err().contains("inflight-events-max"));
        let long = Limits {
            queue_full_block_ms: QUEUE_FULL_BLOCK_MS_MAX + 1,
            ..Limits::default()
        };
        assert!(long.validate().is_err());
        let bytes: FileConfig =
            toml::from_str("[limits]\nqueue-bytes-max = 65536\npublish-log-bytes-max = 1048576\n")
                .unwrap();
        let l = bytes.limits.unwrap();
        assert_eq!(
            (l.queue_bytes_max, l.publish_log_bytes_max),
            (65536, 1 << 20)
        );
        let windows: FileConfig = toml::from_str(
            "[limits]\nconnection-receive-window-bytes = 65536\nconnection-send-window-bytes = 131072\n",
        )
        .unwrap();
        let l = windows.limits.unwrap();
        assert_eq!(
            (
                l.connection_receive_window_bytes,
                l.connection_send_window_bytes
            ),
            (65536, 131072)
        );
        assert!(l.validate().is_ok());
        for (tiny, name) in [
            (
                Limits {
                    queue_bytes_max: 4095,
                    ..Limits::default()
                },
                "queue-bytes-max",
            ),
            (
                Limits {
                    publish_log_bytes_max: 0,
                    ..Limits::default()
                },
                "publish-log-bytes-max",
            ),
            (
                Limits {
                    connection_receive_window_bytes: 1024,
                    ..Limits::default()
                },
                "connection-receive-window-bytes",
            ),
            (
                Limits {
                    connection_send_window_bytes: 2 << 30,
                    ..Limits::default()
                },
                "connection-send-window-bytes",
            ),
        ] {
            assert!(tiny.validate().unwrap_err().contains(name), "{name}");
        }
    }

    #[test]
    fn values_are_validated() {
        assert!(parse_addr("listen", "localhost").is_err());
        assert_eq!(parse_metrics("off"), Ok(None));
        assert!(validate_node_id("n1").is_ok());
        let addr = |s: &str| s.parse::<SocketAddr>().unwrap();
        assert_eq!(open_node_warning(addr("127.0.0.1:7400"), false), None);
        assert_eq!(open_node_warning(addr("[::1]:7400"), false), None);
        assert_eq!(open_node_warning(addr("0.0.0.0:7400"), true), None);
        let w = open_node_warning(addr("0.0.0.0:7400"), false).unwrap();
        assert!(w.contains("OPEN NODE on 0.0.0.0:7400"), "{w}");
        assert!(open_node_warning(addr("[::]:7400"), false).is_some());
        assert!(validate_node_id("bad id").is_err());
        assert!(validate_node_id("").is_err());
    }

    #[test]
    fn cluster_table_parses() {
        let f: FileConfig =
            toml::from_str("[cluster]\npeers = [\"n1=127.0.0.1:7401\", \"n2=127.0.0.1:7402\"]\n")
                .unwrap();
        let peers = f.cluster.unwrap().peers;
        assert_eq!(peers, ["n1=127.0.0.1:7401", "n2=127.0.0.1:7402"]);
        assert!(peers.iter().all(|p| parse_peer(p).is_ok()));
        assert!(toml::from_str::<FileConfig>("[cluster]\nmembers = []\n").is_err());
    }

    #[test]
    fn rebalance_is_on_unless_turned_off() {
        assert!(ServerConfig::default().rebalance);
        let f: FileConfig = toml::from_str("[cluster]\nrebalance = false\n").unwrap();
        assert_eq!(f.cluster.unwrap().rebalance, Some(false));
        assert!(toml::from_str::<FileConfig>("[cluster]\nrebalance = \"no\"\n").is_err());
    }

    #[test]
    fn node_failure_ms_parses_and_is_bounded() {
        let f: FileConfig = toml::from_str("[cluster]\nnode-failure-ms = 4000\n").unwrap();
        assert_eq!(f.cluster.unwrap().node_failure_ms, Some(4_000));
        assert!(validate_node_failure_ms(NODE_FAILURE_MS_DEFAULT).is_ok());
        assert!(validate_node_failure_ms(NODE_FAILURE_MS_MIN).is_ok());
        assert!(validate_node_failure_ms(NODE_FAILURE_MS_MAX).is_ok());
        assert!(validate_node_failure_ms(NODE_FAILURE_MS_MIN - 1).is_err());
        assert!(validate_node_failure_ms(NODE_FAILURE_MS_MAX + 1).is_err());
    }

    #[test]
    fn peers_parse() {
        assert_eq!(
            parse_peer("n2=127.0.0.1:7402").unwrap(),
            ("n2".to_string(), "127.0.0.1:7402".to_string())
        );
        // A host name, resolved when the peer is dialed.
        assert_eq!(
            parse_peer("n2=tether-2.example.com:7402").unwrap(),
            ("n2".to_string(), "tether-2.example.com:7402".to_string())
        );
        assert_eq!(parse_peer("n3=[::1]:7403").unwrap().1, "[::1]:7403");
        for bad in [
            "n2",
            "=127.0.0.1:1",
            "n2=localhost",
            "n2=localhost:x",
            "n2=localhost:0",
            "n2=not a host:7402",
            "n2=::1:7402",
            "n 2=127.0.0.1:1",
            "n2=127.0.0.1:0",
        ] {
            assert!(parse_peer(bad).is_err(), "{bad}");
        }
        assert!("sometimes".parse::<SyncMode>().is_err());
    }
}
