//! Server configuration: command-line flags, `TETHER_*` environment variables and the TOML
//! file, in that order of precedence over the defaults ([`ServerArgs`], [`resolve`]),
//! validated; and the effective configuration printed back as TOML ([`render_toml`]).

use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use clap::parser::ValueSource;
use serde::{Deserialize, Serialize};

/// A configuration value refused: each names the setting and what it accepts.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("cannot read config file {}: {source}", path.display())]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("invalid config file {}: {source}", path.display())]
    Toml {
        path: PathBuf,
        source: Box<toml::de::Error>,
    },
    /// A value of the `--config` file that is refused.
    #[error("config file {}: {error}", path.display())]
    InFile {
        path: PathBuf,
        error: Box<ConfigError>,
    },
    #[error("unknown {setting} {value:?} (expected {expected})")]
    UnknownValue {
        setting: &'static str,
        value: String,
        expected: &'static str,
    },
    #[error("{setting} must be at least {min}")]
    Below { setting: &'static str, min: u64 },
    #[error("{setting} must be at most {max}")]
    Above { setting: &'static str, max: u64 },
    #[error("{setting} must be between {min} and {max}")]
    Outside {
        setting: &'static str,
        min: u64,
        max: u64,
    },
    #[error(
        "limits.idle-timeout-ms must be above the keep-alive interval ({keep_alive}) and at most \
         {max}",
        keep_alive = tether_transport::tls::KEEP_ALIVE_INTERVAL_MS,
        max = IDLE_TIMEOUT_MS_MAX
    )]
    IdleTimeout,
    #[error(
        "node-failure-ms {0} is outside {min}..={max}",
        min = NODE_FAILURE_MS_MIN,
        max = NODE_FAILURE_MS_MAX
    )]
    NodeFailureMs(u64),
    #[error(
        "metrics-top-queues {0} is above the limit of {max}",
        max = METRICS_TOP_QUEUES_MAX
    )]
    MetricsTopQueues(usize),
    #[error("invalid peer {0:?} (expected ID=ADDR, e.g. n2=127.0.0.1:7402)")]
    Peer(String),
    #[error(
        "invalid peer address {0:?} (expected IP:PORT or HOST:PORT, e.g. 127.0.0.1:7402 or \
         tether-2.example.com:7402)"
    )]
    PeerAddress(String),
    #[error("peer {0}: port 0 cannot be dialed")]
    PeerPortZero(String),
    #[error(
        "invalid advertised name {0:?} (expected a DNS name or an IP address, e.g. \
         tether-1.example.com)"
    )]
    Advertise(String),
    #[error("invalid {setting} address {value:?} (expected IP:PORT, e.g. 127.0.0.1:7400)")]
    Address {
        setting: &'static str,
        value: String,
    },
    #[error("empty log filter (e.g. info, or warn,tether=debug)")]
    EmptyLogFilter,
    #[error("invalid log filter {filter:?}: {error} (e.g. info, or warn,tether=debug)")]
    LogFilter {
        filter: String,
        error: Box<tracing_subscriber::filter::ParseError>,
    },
    #[error(
        "invalid node id {0:?}: use 1 to {max} letters, digits, '-', '_' or '.'",
        max = NODE_ID_BYTES_MAX
    )]
    NodeId(String),
    #[error(
        "TLS files go together: give --tls-cert, --tls-key and --tls-ca (or a [tls] table with \
         cert, key and ca)"
    )]
    TlsFilesApart,
    #[error("{0}")]
    Auth(#[from] crate::auth::AuthConfigError),
    #[error("cannot print the configuration: {0}")]
    Print(Box<toml::ser::Error>),
}

/// How storage writes reach the disk.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default, Deserialize, Serialize, clap::ValueEnum)]
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
    type Err = ConfigError;
    fn from_str(s: &str) -> Result<Self, ConfigError> {
        match s {
            "always" => Ok(SyncMode::Always),
            "batch" => Ok(SyncMode::Batch),
            "none" => Ok(SyncMode::None),
            other => Err(ConfigError::UnknownValue {
                setting: "sync mode",
                value: other.to_string(),
                expected: "always, batch or none",
            }),
        }
    }
}

/// What a node does when a publish would grow a subscription queue past its entry or byte
/// limit.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default, Deserialize, Serialize, clap::ValueEnum)]
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
    type Err = ConfigError;
    fn from_str(s: &str) -> Result<Self, ConfigError> {
        match s {
            "block" => Ok(QueueFullPolicy::Block),
            "reject" => Ok(QueueFullPolicy::Reject),
            "drop-queue" => Ok(QueueFullPolicy::DropQueue),
            other => Err(ConfigError::UnknownValue {
                setting: "queue-full policy",
                value: other.to_string(),
                expected: "block, reject or drop-queue",
            }),
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
#[derive(Clone, Debug, PartialEq, Eq, Deserialize, Serialize)]
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
    pub fn validate(&self) -> Result<(), ConfigError> {
        let positive = [
            ("limits.queue-entries-max", self.queue_entries_max),
            ("limits.connections-max", self.connections_max as u64),
            ("limits.handshake-timeout-ms", self.handshake_timeout_ms),
            ("limits.inflight-events-max", self.inflight_events_max),
        ];
        for (setting, v) in positive {
            if v == 0 {
                return Err(ConfigError::Below { setting, min: 1 });
            }
        }
        let lowest = crate::limits::QUEUE_BYTES_MAX_LOWEST_BYTES;
        for (setting, v) in [
            ("limits.queue-bytes-max", self.queue_bytes_max),
            ("limits.publish-log-bytes-max", self.publish_log_bytes_max),
        ] {
            if v < lowest {
                return Err(ConfigError::Below {
                    setting,
                    min: lowest,
                });
            }
        }
        if self.queue_full_block_ms > QUEUE_FULL_BLOCK_MS_MAX {
            return Err(ConfigError::Above {
                setting: "limits.queue-full-block-ms",
                max: QUEUE_FULL_BLOCK_MS_MAX,
            });
        }
        let keep_alive = tether_transport::tls::KEEP_ALIVE_INTERVAL_MS;
        if self.idle_timeout_ms <= keep_alive || self.idle_timeout_ms > IDLE_TIMEOUT_MS_MAX {
            return Err(ConfigError::IdleTimeout);
        }
        use tether_transport::tls::{CONNECTION_WINDOW_BYTES_LOWEST, CONNECTION_WINDOW_BYTES_MAX};
        for (setting, v) in [
            (
                "limits.connection-receive-window-bytes",
                self.connection_receive_window_bytes,
            ),
            (
                "limits.connection-send-window-bytes",
                self.connection_send_window_bytes,
            ),
        ] {
            if !(CONNECTION_WINDOW_BYTES_LOWEST..=CONNECTION_WINDOW_BYTES_MAX).contains(&v) {
                return Err(ConfigError::Outside {
                    setting,
                    min: CONNECTION_WINDOW_BYTES_LOWEST,
                    max: CONNECTION_WINDOW_BYTES_MAX,
                });
            }
        }
        if self.handshake_timeout_ms > QUEUE_FULL_BLOCK_MS_MAX {
            return Err(ConfigError::Above {
                setting: "limits.handshake-timeout-ms",
                max: QUEUE_FULL_BLOCK_MS_MAX,
            });
        }
        Ok(())
    }
}

/// Server certificate files; without them a dev CA and certificate are generated into
/// `<data-dir>/tls/`.
#[derive(Clone, Debug, PartialEq, Eq, Deserialize, Serialize)]
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
    /// RocksDB's flushes and compactions use direct I/O, past the page cache (live events
    /// wait less behind the log's sync; a replay of just-flushed events reads the disk).
    /// TOML `direct-io`, default false.
    pub direct_io: bool,
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
    /// This node joins a running cluster (`tether cluster add-node`): it never starts a
    /// consensus group of its own, and serves clients once a member added it and it copied the
    /// regions' values. TOML `[cluster] join`, default false.
    pub join: bool,
    /// Host names or IP addresses clients reach this node by, besides `localhost`, the
    /// loopback addresses and the machine's host name: the dev server certificate carries
    /// them (`--advertise`, TOML `advertise`). Unused with `[tls]` (the operator's certificate
    /// names what it names).
    pub advertise: Vec<String>,
    /// Durable queues exported one by one in `/metrics` (the most pending events first,
    /// label `durable_id`); 0 exports none. The rest is in the queue-size histogram.
    pub metrics_top_queues: usize,
    /// Shifts this node's clock by this many milliseconds, to simulate clock skew between
    /// members in tests. Not read from the configuration file or the command line; 0 in
    /// production.
    pub clock_offset_ms: i64,
    /// Longest wait for the copies of queues to hold a change before answering a client that
    /// asked for it (`--ack replicated`, a durable registration, a close with keepalive) or a
    /// peer that forwarded publishes, in milliseconds. Default
    /// [`REPLICATED_ACK_TIMEOUT_MS`](crate::limits::REPLICATED_ACK_TIMEOUT_MS); tests shorten
    /// it. Not read from the configuration file or the command line.
    pub replicated_ack_timeout_ms: u64,
    /// The peer protocol versions this node speaks, offered when it dials a member and when
    /// it is dialed: [`PEER_PROTOCOL_VERSION_OLDEST`](tether_transport::PEER_PROTOCOL_VERSION_OLDEST)`..=`[`PEER_PROTOCOL_VERSION`](tether_transport::PEER_PROTOCOL_VERSION)
    /// in production; tests of a mixed-version cluster make a node of the previous build
    /// speak fewer. Not read from the configuration file or the command line.
    pub peer_protocol_versions: std::ops::RangeInclusive<u32>,
}

/// Default of [`ServerConfig::metrics_top_queues`].
pub const METRICS_TOP_QUEUES_DEFAULT: usize = 20;
/// Most [`ServerConfig::metrics_top_queues`]: bounds the series a scrape carries.
pub const METRICS_TOP_QUEUES_MAX: usize = 1_000;

/// Default of [`ServerConfig::node_failure_ms`], in milliseconds.
pub const NODE_FAILURE_MS_DEFAULT: u64 = 2_500;
/// Least [`ServerConfig::node_failure_ms`], in milliseconds (above the peer ping timeout).
pub const NODE_FAILURE_MS_MIN: u64 = 1_500;
/// Most [`ServerConfig::node_failure_ms`], in milliseconds.
pub const NODE_FAILURE_MS_MAX: u64 = 3_600_000;

/// Checks a `node-failure-ms` value.
pub fn validate_node_failure_ms(ms: u64) -> Result<(), ConfigError> {
    if !(NODE_FAILURE_MS_MIN..=NODE_FAILURE_MS_MAX).contains(&ms) {
        return Err(ConfigError::NodeFailureMs(ms));
    }
    Ok(())
}

/// Default client/peer address.
pub const DEFAULT_LISTEN: &str = "127.0.0.1:7400";
/// Default metrics address.
pub const DEFAULT_METRICS: &str = "127.0.0.1:9400";
pub use crate::limits::NODE_ID_BYTES_MAX;

impl Default for ServerConfig {
    fn default() -> Self {
        ServerConfig {
            data_dir: PathBuf::from("data"),
            listen: DEFAULT_LISTEN.parse().expect("valid default"),
            metrics: Some(DEFAULT_METRICS.parse().expect("valid default")),
            node_id: None,
            sync: SyncMode::Batch,
            direct_io: false,
            tls: None,
            limits: Limits::default(),
            auth: None,
            auth_file: None,
            peers: Vec::new(),
            node_failure_ms: NODE_FAILURE_MS_DEFAULT,
            rebalance: true,
            join: false,
            advertise: Vec::new(),
            metrics_top_queues: METRICS_TOP_QUEUES_DEFAULT,
            clock_offset_ms: 0,
            replicated_ack_timeout_ms: crate::limits::REPLICATED_ACK_TIMEOUT_MS,
            peer_protocol_versions: tether_transport::PEER_PROTOCOL_VERSION_OLDEST
                ..=tether_transport::PEER_PROTOCOL_VERSION,
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
    /// See [`ServerConfig::direct_io`].
    pub direct_io: Option<bool>,
    pub tls: Option<TlsConfig>,
    pub limits: Option<Limits>,
    pub auth: Option<crate::auth::AuthConfig>,
    pub cluster: Option<ClusterFileConfig>,
    /// See [`ServerConfig::advertise`].
    pub advertise: Option<Vec<String>>,
    /// See [`ServerConfig::metrics_top_queues`].
    pub metrics_top_queues: Option<usize>,
    /// See [`LogSettings::format`].
    pub log_format: Option<LogFormat>,
    /// See [`LogSettings::level`].
    pub log_level: Option<String>,
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
    /// See [`ServerConfig::join`].
    pub join: Option<bool>,
}

/// Parses a `--peer` value `ID=ADDR` (ADDR an `IP:PORT`).
pub fn parse_peer(s: &str) -> Result<(String, String), ConfigError> {
    let (id, addr) = s
        .split_once('=')
        .ok_or_else(|| ConfigError::Peer(s.to_string()))?;
    validate_node_id(id)?;
    let invalid = || ConfigError::PeerAddress(addr.to_string());
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
        return Err(ConfigError::PeerPortZero(id.to_string()));
    }
    Ok((id.to_string(), addr))
}

impl FileConfig {
    pub fn load(path: &Path) -> Result<Self, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
            path: path.to_path_buf(),
            source,
        })?;
        toml::from_str(&text).map_err(|source| ConfigError::Toml {
            path: path.to_path_buf(),
            source: Box::new(source),
        })
    }
}

/// Checks a name a node is advertised by: a DNS name or an IP address a certificate can carry.
pub fn validate_advertise(name: &str) -> Result<(), ConfigError> {
    match rustls::pki_types::ServerName::try_from(name) {
        Ok(_) => Ok(()),
        Err(_) => Err(ConfigError::Advertise(name.to_string())),
    }
}

/// The machine's host name, if it is a valid DNS name (the dev server certificate carries it).
pub fn machine_host_name() -> Option<String> {
    let name = std::fs::read_to_string("/proc/sys/kernel/hostname").ok()?;
    let name = name.trim().to_ascii_lowercase();
    (!name.is_empty() && validate_advertise(&name).is_ok()).then_some(name)
}

/// Parses a socket address, with a message naming the setting.
pub fn parse_addr(setting: &'static str, s: &str) -> Result<SocketAddr, ConfigError> {
    s.parse().map_err(|_| ConfigError::Address {
        setting,
        value: s.to_string(),
    })
}

/// Parses the metrics setting: an address or `off`.
pub fn parse_metrics(s: &str) -> Result<Option<SocketAddr>, ConfigError> {
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

/// Checks a `metrics-top-queues` value.
pub fn validate_metrics_top_queues(n: usize) -> Result<(), ConfigError> {
    if n > METRICS_TOP_QUEUES_MAX {
        return Err(ConfigError::MetricsTopQueues(n));
    }
    Ok(())
}

/// How the server writes its logs (stderr).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default, Deserialize, Serialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum LogFormat {
    /// One human-readable line per event (coloured only when stderr is a terminal).
    #[default]
    Text,
    /// One JSON object per line: timestamp, level, target, fields (with the message).
    Json,
}

/// The server's default log filter: the tether crates' life-cycle events at info (the
/// `tether` target prefix covers `tether_transport`, `tether_storage` and `tether_client`),
/// other crates' warnings and errors, and nothing from openraft. Openraft reports every
/// unanswered RPC of a forming or recovering cluster as a WARN or ERROR ("RPCError … rpc to
/// 127.0.0.1:7402 timed out", "A message will be ignored because vote changed"): expected
/// noise, while its real failures reach tether as errors of its API, which tether logs itself
/// (and members it cannot reach are declared failed by tether's own failure detection).
/// `--log-level info,openraft=info` (or `RUST_LOG`) shows openraft again.
pub const SERVER_LOG_FILTER_DEFAULT: &str = "warn,tether=info,openraft=off";
/// The log filter of the client commands (`put`, `subscribe`, …): quiet.
pub const CLIENT_LOG_FILTER_DEFAULT: &str = "warn";

/// Checks a log filter (a `tracing_subscriber::EnvFilter` directive list, as `RUST_LOG` takes).
pub fn validate_log_filter(s: &str) -> Result<(), ConfigError> {
    if s.trim().is_empty() {
        return Err(ConfigError::EmptyLogFilter);
    }
    tracing_subscriber::EnvFilter::builder()
        .parse(s)
        .map(|_| ())
        .map_err(|error| ConfigError::LogFilter {
            filter: s.to_string(),
            error: Box::new(error),
        })
}

/// A server's log settings (`--log-format`, `--log-level`; `RUST_LOG` wins over the level).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LogSettings {
    pub format: LogFormat,
    /// An `EnvFilter` directive list; [`SERVER_LOG_FILTER_DEFAULT`] unless set.
    pub level: String,
}

impl Default for LogSettings {
    fn default() -> Self {
        LogSettings {
            format: LogFormat::Text,
            level: SERVER_LOG_FILTER_DEFAULT.to_string(),
        }
    }
}

/// What `tether server` runs with: the node's configuration and its log settings.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Settings {
    pub server: ServerConfig,
    pub log: LogSettings,
}

/// Largest integer a TOML file (and so `--print-config`) can hold.
const TOML_INT_MAX: u64 = i64::MAX as u64;

fn listen_arg(s: &str) -> Result<SocketAddr, ConfigError> {
    parse_addr("listen", s)
}

fn metrics_arg(s: &str) -> Result<String, ConfigError> {
    parse_metrics(s).map(|_| s.to_string())
}

fn node_id_arg(s: &str) -> Result<String, ConfigError> {
    validate_node_id(s).map(|()| s.to_string())
}

fn advertise_arg(s: &str) -> Result<String, ConfigError> {
    validate_advertise(s).map(|()| s.to_string())
}

fn peer_arg(s: &str) -> Result<String, ConfigError> {
    parse_peer(s).map(|_| s.to_string())
}

fn log_filter_arg(s: &str) -> Result<String, ConfigError> {
    validate_log_filter(s).map(|()| s.to_string())
}

/// `tether server`'s flags. Each setting is also read from a `TETHER_*` environment variable
/// and from the `--config` file: flag > variable > file > default ([`resolve`]).
#[derive(clap::Args, Clone, Debug)]
pub struct ServerArgs {
    /// TOML file with the same settings as these flags (`--print-config` prints one); flags
    /// and TETHER_* variables win over it. Its [auth] table (tokens, admins, ACLs) is read
    /// again whenever the file changes.
    #[arg(long, env = "TETHER_CONFIG", value_name = "FILE")]
    pub config: Option<PathBuf>,
    /// Print the effective configuration (flags > TETHER_* variables > file > defaults) as a
    /// TOML file usable with --config, and exit without starting the server or touching the
    /// data directory. Token hashes are not printed.
    #[arg(long)]
    pub print_config: bool,
    /// Where RocksDB, TLS material and the node id live; created if missing.
    #[arg(
        long,
        env = "TETHER_DATA_DIR",
        value_name = "DIR",
        default_value = "data"
    )]
    pub data_dir: PathBuf,
    /// QUIC address for clients and peers (IP:PORT); port 0 picks a free port.
    #[arg(long, env = "TETHER_LISTEN", value_name = "ADDR", default_value = DEFAULT_LISTEN, value_parser = listen_arg)]
    pub listen: SocketAddr,
    /// Prometheus address (/metrics, IP:PORT); port 0 picks a free port; `off` disables it.
    #[arg(long, env = "TETHER_METRICS", value_name = "ADDR|off", default_value = DEFAULT_METRICS, value_parser = metrics_arg)]
    pub metrics: String,
    /// Durable queues exported one by one in /metrics (the most pending first; 0: none).
    #[arg(long, env = "TETHER_METRICS_TOP_QUEUES", value_name = "N", default_value_t = METRICS_TOP_QUEUES_DEFAULT as u64, value_parser = clap::value_parser!(u64).range(0..=METRICS_TOP_QUEUES_MAX as u64))]
    pub metrics_top_queues: u64,
    /// This node's id (1 to 64 letters, digits, '-', '_', '.'). Default: generated once and
    /// kept in the data directory.
    #[arg(long, env = "TETHER_NODE_ID", value_name = "ID", value_parser = node_id_arg)]
    pub node_id: Option<String>,
    /// A host name or IP address clients reach this node by (repeatable or comma-separated):
    /// the dev server certificate carries it, besides localhost, 127.0.0.1, ::1 and the
    /// machine's host name. Ignored with TLS files.
    #[arg(long, env = "TETHER_ADVERTISE", value_name = "NAME", value_delimiter = ',', value_parser = advertise_arg)]
    pub advertise: Vec<String>,
    /// How storage writes reach the disk.
    #[arg(long, env = "TETHER_SYNC", value_name = "MODE", value_enum, default_value_t = SyncMode::Batch)]
    pub sync: SyncMode,
    /// RocksDB flushes and compactions bypass the page cache (O_DIRECT): live events wait less
    /// behind the log's sync; a replay of just-flushed events reads from the disk.
    #[arg(long, env = "TETHER_DIRECT_IO", value_name = "BOOL", num_args = 0..=1, default_missing_value = "true", action = clap::ArgAction::Set, default_value_t = false, value_parser = clap::value_parser!(bool))]
    pub direct_io: bool,

    /// A cluster member as ID=ADDR (repeatable or comma-separated; may include this node;
    /// ADDR is IP:PORT or HOST:PORT). Replaces the file's [cluster] peers. Needs --node-id.
    #[arg(long = "peer", env = "TETHER_PEERS", value_name = "ID=ADDR", value_delimiter = ',', value_parser = peer_arg, help_heading = "Cluster")]
    pub peers: Vec<String>,
    /// A member silent this long is declared failed and its queues fail over (milliseconds).
    #[arg(long, env = "TETHER_NODE_FAILURE_MS", value_name = "MS", default_value_t = NODE_FAILURE_MS_DEFAULT, value_parser = clap::value_parser!(u64).range(NODE_FAILURE_MS_MIN..=NODE_FAILURE_MS_MAX), help_heading = "Cluster")]
    pub node_failure_ms: u64,
    /// Hand durable queues over to members holding fewer primaries.
    #[arg(long, env = "TETHER_REBALANCE", value_name = "BOOL", action = clap::ArgAction::Set, default_value_t = true, value_parser = clap::value_parser!(bool), help_heading = "Cluster")]
    pub rebalance: bool,
    /// Join a running cluster: wait to be added (`tether cluster add-node`) instead of starting
    /// a new one. Give --peer the running members and this node.
    #[arg(long, env = "TETHER_JOIN", value_name = "BOOL", num_args = 0..=1, default_missing_value = "true", action = clap::ArgAction::Set, default_value_t = false, value_parser = clap::value_parser!(bool), help_heading = "Cluster")]
    pub join: bool,

    /// Entries a subscription queue may hold beyond its acked offset.
    #[arg(long, env = "TETHER_QUEUE_ENTRIES_MAX", value_name = "N", default_value_t = crate::limits::QUEUE_ENTRIES_MAX, value_parser = clap::value_parser!(u64).range(1..=TOML_INT_MAX), help_heading = "Limits")]
    pub queue_entries_max: u64,
    /// Bytes of stored events a subscription queue may hold beyond its acked offset (at least
    /// 4096).
    #[arg(long, env = "TETHER_QUEUE_BYTES_MAX", value_name = "BYTES", default_value_t = crate::limits::QUEUE_BYTES_MAX, value_parser = clap::value_parser!(u64).range(crate::limits::QUEUE_BYTES_MAX_LOWEST_BYTES..=TOML_INT_MAX), help_heading = "Limits")]
    pub queue_bytes_max: u64,
    /// Cluster: bytes of this node's publishes kept for peers that have not applied them; past
    /// it new publishes are refused until peers catch up (at least 4096).
    #[arg(long, env = "TETHER_PUBLISH_LOG_BYTES_MAX", value_name = "BYTES", default_value_t = crate::limits::PUBLISH_LOG_BYTES_MAX, value_parser = clap::value_parser!(u64).range(crate::limits::QUEUE_BYTES_MAX_LOWEST_BYTES..=TOML_INT_MAX), help_heading = "Limits")]
    pub publish_log_bytes_max: u64,
    /// What a publish to a full queue does.
    #[arg(long, env = "TETHER_QUEUE_FULL_POLICY", value_name = "POLICY", value_enum, default_value_t = QueueFullPolicy::Reject, help_heading = "Limits")]
    pub queue_full_policy: QueueFullPolicy,
    /// How long a publish waits for a full queue under the block policy (milliseconds).
    #[arg(long, env = "TETHER_QUEUE_FULL_BLOCK_MS", value_name = "MS", default_value_t = QUEUE_FULL_BLOCK_MS_DEFAULT, value_parser = clap::value_parser!(u64).range(0..=QUEUE_FULL_BLOCK_MS_MAX), help_heading = "Limits")]
    pub queue_full_block_ms: u64,
    /// Concurrent client connections.
    #[arg(long, env = "TETHER_CONNECTIONS_MAX", value_name = "N", default_value_t = crate::limits::CONNECTIONS_PER_NODE_MAX as u64, value_parser = clap::value_parser!(u64).range(1..=u32::MAX as u64), help_heading = "Limits")]
    pub connections_max: u64,
    /// Time a new connection has to send its hello (milliseconds).
    #[arg(long, env = "TETHER_HANDSHAKE_TIMEOUT_MS", value_name = "MS", default_value_t = crate::limits::HANDSHAKE_TIMEOUT_MS, value_parser = clap::value_parser!(u64).range(1..=QUEUE_FULL_BLOCK_MS_MAX), help_heading = "Limits")]
    pub handshake_timeout_ms: u64,
    /// Events a session may have on the wire beyond its acked offset.
    #[arg(long, env = "TETHER_INFLIGHT_EVENTS_MAX", value_name = "N", default_value_t = crate::limits::INFLIGHT_EVENTS_PER_SESSION_MAX, value_parser = clap::value_parser!(u64).range(1..=TOML_INT_MAX), help_heading = "Limits")]
    pub inflight_events_max: u64,
    /// A connection silent this long is closed, as a crash (milliseconds; above the 5000 ms
    /// keep-alive interval).
    #[arg(long, env = "TETHER_IDLE_TIMEOUT_MS", value_name = "MS", default_value_t = tether_transport::tls::IDLE_TIMEOUT_MS, value_parser = clap::value_parser!(u64).range(tether_transport::tls::KEEP_ALIVE_INTERVAL_MS + 1..=IDLE_TIMEOUT_MS_MAX), help_heading = "Limits")]
    pub idle_timeout_ms: u64,
    /// Bytes a client may send on one connection beyond what the node has read (QUIC flow
    /// control; 64 KiB to 1 GiB).
    #[arg(long, env = "TETHER_CONNECTION_RECEIVE_WINDOW_BYTES", value_name = "BYTES", default_value_t = tether_transport::tls::SERVER_RECEIVE_WINDOW_BYTES, value_parser = clap::value_parser!(u64).range(tether_transport::tls::CONNECTION_WINDOW_BYTES_LOWEST..=tether_transport::tls::CONNECTION_WINDOW_BYTES_MAX), help_heading = "Limits")]
    pub connection_receive_window_bytes: u64,
    /// Bytes the node keeps written but unacknowledged on one connection (its send buffer for
    /// a slow client; 64 KiB to 1 GiB).
    #[arg(long, env = "TETHER_CONNECTION_SEND_WINDOW_BYTES", value_name = "BYTES", default_value_t = tether_transport::tls::SERVER_SEND_WINDOW_BYTES, value_parser = clap::value_parser!(u64).range(tether_transport::tls::CONNECTION_WINDOW_BYTES_LOWEST..=tether_transport::tls::CONNECTION_WINDOW_BYTES_MAX), help_heading = "Limits")]
    pub connection_send_window_bytes: u64,

    /// Server certificate (PEM), instead of the generated dev one; needs --tls-key and
    /// --tls-ca (or the file's [tls] table). Overrides [tls] cert.
    #[arg(
        long,
        env = "TETHER_TLS_CERT",
        value_name = "FILE",
        help_heading = "TLS"
    )]
    pub tls_cert: Option<PathBuf>,
    /// Private key (PEM) of --tls-cert. Overrides [tls] key.
    #[arg(
        long,
        env = "TETHER_TLS_KEY",
        value_name = "FILE",
        help_heading = "TLS"
    )]
    pub tls_key: Option<PathBuf>,
    /// CA certificate clients should trust (printed in the listening line). Overrides [tls] ca.
    #[arg(long, env = "TETHER_TLS_CA", value_name = "FILE", help_heading = "TLS")]
    pub tls_ca: Option<PathBuf>,

    /// Log line format on stderr.
    #[arg(long, env = "TETHER_LOG_FORMAT", value_name = "FORMAT", value_enum, default_value_t = LogFormat::Text, help_heading = "Logs")]
    pub log_format: LogFormat,
    /// What is logged: a tracing EnvFilter directive list (e.g. info, or warn,tether=debug).
    /// RUST_LOG, when set, wins over it. The default shows tether's life-cycle events and
    /// other crates' warnings, and hides openraft (its view of a forming cluster is noise;
    /// info,openraft=info shows it).
    #[arg(long, env = "TETHER_LOG_LEVEL", value_name = "FILTER", default_value = SERVER_LOG_FILTER_DEFAULT, value_parser = log_filter_arg, help_heading = "Logs")]
    pub log_level: String,
}

/// Resolves the settings of `tether server`: for each one the flag, else its `TETHER_*`
/// variable (both in `args`, as clap read them; `matches` tells which were given), else the
/// `--config` file, else the default. Validates the result; reads the file, nothing else.
pub fn resolve(args: &ServerArgs, matches: &clap::ArgMatches) -> Result<Settings, ConfigError> {
    let given = |id: &str| {
        matches!(
            matches.value_source(id),
            Some(ValueSource::CommandLine | ValueSource::EnvVariable)
        )
    };
    fn pick<T: Clone>(given: bool, arg: &T, file: Option<T>) -> T {
        if given {
            arg.clone()
        } else {
            file.unwrap_or_else(|| arg.clone())
        }
    }
    let file = match &args.config {
        Some(p) => FileConfig::load(p)?,
        None => FileConfig::default(),
    };
    let in_file = |e: ConfigError| match &args.config {
        Some(p) => ConfigError::InFile {
            path: p.clone(),
            error: Box::new(e),
        },
        None => e,
    };
    let mut cfg = ServerConfig {
        data_dir: pick(given("data_dir"), &args.data_dir, file.data_dir.clone()),
        ..ServerConfig::default()
    };
    let file_listen = file
        .listen
        .as_deref()
        .map(|s| parse_addr("listen", s))
        .transpose()
        .map_err(in_file)?;
    cfg.listen = pick(given("listen"), &args.listen, file_listen);
    let metrics = pick(given("metrics"), &args.metrics, file.metrics.clone());
    cfg.metrics = parse_metrics(&metrics).map_err(in_file)?;
    let top = pick(
        given("metrics_top_queues"),
        &(args.metrics_top_queues as usize),
        file.metrics_top_queues,
    );
    validate_metrics_top_queues(top).map_err(in_file)?;
    cfg.metrics_top_queues = top;
    cfg.node_id = args.node_id.clone().or(file.node_id.clone());
    if let Some(id) = &cfg.node_id {
        validate_node_id(id).map_err(in_file)?;
    }
    cfg.advertise = if args.advertise.is_empty() {
        file.advertise.clone().unwrap_or_default()
    } else {
        args.advertise.clone()
    };
    for name in &cfg.advertise {
        validate_advertise(name).map_err(in_file)?;
    }
    cfg.sync = pick(given("sync"), &args.sync, file.sync);
    cfg.direct_io = pick(given("direct_io"), &args.direct_io, file.direct_io);

    let mut l = file.limits.clone().unwrap_or_default();
    macro_rules! limit {
        ($($field:ident),*) => {$(
            if given(stringify!($field)) {
                l.$field = args.$field as _;
            }
        )*};
    }
    limit!(
        queue_entries_max,
        queue_bytes_max,
        publish_log_bytes_max,
        queue_full_block_ms,
        connections_max,
        handshake_timeout_ms,
        inflight_events_max,
        idle_timeout_ms,
        connection_receive_window_bytes,
        connection_send_window_bytes
    );
    if given("queue_full_policy") {
        l.queue_full_policy = args.queue_full_policy;
    }
    l.validate().map_err(in_file)?;
    cfg.limits = l;

    let cluster = file.cluster.clone().unwrap_or_default();
    cfg.node_failure_ms = pick(
        given("node_failure_ms"),
        &args.node_failure_ms,
        cluster.node_failure_ms,
    );
    validate_node_failure_ms(cfg.node_failure_ms).map_err(in_file)?;
    cfg.rebalance = pick(given("rebalance"), &args.rebalance, cluster.rebalance);
    cfg.join = pick(given("join"), &args.join, cluster.join);
    let peers = if args.peers.is_empty() {
        &cluster.peers
    } else {
        &args.peers
    };
    cfg.peers = peers
        .iter()
        .map(|p| parse_peer(p))
        .collect::<Result<_, _>>()
        .map_err(in_file)?;

    let file_tls = file.tls.clone();
    let cert = args
        .tls_cert
        .clone()
        .or(file_tls.as_ref().map(|t| t.cert.clone()));
    let key = args
        .tls_key
        .clone()
        .or(file_tls.as_ref().map(|t| t.key.clone()));
    let ca = args
        .tls_ca
        .clone()
        .or(file_tls.as_ref().map(|t| t.ca.clone()));
    cfg.tls = match (cert, key, ca) {
        (Some(cert), Some(key), Some(ca)) => Some(TlsConfig { cert, key, ca }),
        (None, None, None) => None,
        _ => {
            return Err(ConfigError::TlsFilesApart);
        }
    };

    cfg.auth = file.auth.clone();
    if let Some(auth) = &cfg.auth {
        crate::auth::Authorizer::new(auth).map_err(|e| in_file(e.into()))?;
    }
    // Its [auth] table is read again when the file changes (tokens, admins, ACLs).
    cfg.auth_file = args.config.clone().filter(|_| cfg.auth.is_some());

    let level = pick(given("log_level"), &args.log_level, file.log_level.clone());
    validate_log_filter(&level).map_err(in_file)?;
    let log = LogSettings {
        format: pick(given("log_format"), &args.log_format, file.log_format),
        level,
    };
    Ok(Settings { server: cfg, log })
}

/// The effective configuration as a TOML file with the keys `--config` reads (so that it can
/// be saved and used as one). Token hashes are not printed: the `[auth]` table keeps its
/// other keys and a comment counts the tokens. `rust_log`: the `RUST_LOG` value, which wins
/// over `log-level` (noted in a comment).
pub fn render_toml(s: &Settings, rust_log: Option<&str>) -> Result<String, ConfigError> {
    #[derive(Serialize)]
    #[serde(rename_all = "kebab-case")]
    struct Printed<'a> {
        data_dir: &'a Path,
        listen: String,
        metrics: String,
        #[serde(skip_serializing_if = "Option::is_none")]
        node_id: Option<&'a str>,
        sync: SyncMode,
        direct_io: bool,
        advertise: &'a [String],
        metrics_top_queues: usize,
        log_format: LogFormat,
        log_level: &'a str,
        limits: &'a Limits,
        cluster: PrintedCluster,
        #[serde(skip_serializing_if = "Option::is_none")]
        tls: Option<&'a TlsConfig>,
        #[serde(skip_serializing_if = "Option::is_none")]
        auth: Option<toml::Table>,
    }
    #[derive(Serialize)]
    #[serde(rename_all = "kebab-case")]
    struct PrintedCluster {
        peers: Vec<String>,
        node_failure_ms: u64,
        rebalance: bool,
        join: bool,
    }
    let c = &s.server;
    let auth = c.auth.as_ref().map(|a| {
        let mut t = toml::Table::new();
        let path = |p: &Path| toml::Value::String(p.display().to_string());
        if let Some(p) = &a.client_ca {
            t.insert("client-ca".into(), path(p));
        }
        if let Some(p) = &a.client_crl {
            t.insert("client-crl".into(), path(p));
        }
        t.insert(
            "admins".into(),
            toml::Value::Array(a.admins.iter().cloned().map(toml::Value::String).collect()),
        );
        let strings =
            |v: &[String]| toml::Value::Array(v.iter().cloned().map(toml::Value::String).collect());
        let acl = a
            .acl
            .iter()
            .map(|e| {
                let mut t = toml::Table::new();
                t.insert("principal".into(), toml::Value::String(e.principal.clone()));
                t.insert("publish".into(), strings(&e.publish));
                t.insert("subscribe".into(), strings(&e.subscribe));
                toml::Value::Table(t)
            })
            .collect();
        t.insert("acl".into(), toml::Value::Array(acl));
        t
    });
    let printed = Printed {
        data_dir: &c.data_dir,
        listen: c.listen.to_string(),
        metrics: c
            .metrics
            .map_or_else(|| "off".to_string(), |a| a.to_string()),
        node_id: c.node_id.as_deref(),
        sync: c.sync,
        direct_io: c.direct_io,
        advertise: &c.advertise,
        metrics_top_queues: c.metrics_top_queues,
        log_format: s.log.format,
        log_level: &s.log.level,
        limits: &c.limits,
        cluster: PrintedCluster {
            peers: c.peers.iter().map(|(id, a)| format!("{id}={a}")).collect(),
            node_failure_ms: c.node_failure_ms,
            rebalance: c.rebalance,
            join: c.join,
        },
        tls: c.tls.as_ref(),
        auth,
    };
    let body = toml::to_string(&printed).map_err(|e| ConfigError::Print(Box::new(e)))?;
    let mut out = String::from(
        "# tether server: effective configuration (flag > TETHER_* variable > --config file > default).\n",
    );
    if c.node_id.is_none() {
        out.push_str("# node-id: not set; generated once and kept in <data-dir>/node-id.\n");
    }
    if let Some(a) = &c.auth
        && !a.tokens.is_empty()
    {
        let principals: Vec<&str> = a.tokens.iter().map(|t| t.principal.as_str()).collect();
        out.push_str(&format!(
            "# [auth] tokens: {} (of {}); their hashes are not printed: copy [[auth.tokens]] from the original file.\n",
            a.tokens.len(),
            principals.join(", ")
        ));
    }
    if let Some(v) = rust_log {
        out.push_str(&format!(
            "# RUST_LOG is set ({v:?}) and wins over log-level.\n"
        ));
    }
    out.push('\n');
    out.push_str(&body);
    Ok(out)
}

/// Validates a node id: 1 to 64 of `[A-Za-z0-9_.-]`.
pub fn validate_node_id(id: &str) -> Result<(), ConfigError> {
    if id.is_empty()
        || id.len() > NODE_ID_BYTES_MAX
        || !id
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c))
    {
        return Err(ConfigError::NodeId(id.to_string()));
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
        assert!(
            zero.validate()
                .unwrap_err()
                .to_string()
                .contains("inflight-events-max")
        );
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
            assert!(
                tiny.validate().unwrap_err().to_string().contains(name),
                "{name}"
            );
        }
    }

    #[test]
    fn values_are_validated() {
        assert!(parse_addr("listen", "localhost").is_err());
        assert!(matches!(parse_metrics("off"), Ok(None)));
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
    fn join_is_off_unless_asked() {
        assert!(!ServerConfig::default().join);
        let f: FileConfig = toml::from_str("[cluster]\njoin = true\n").unwrap();
        assert_eq!(f.cluster.unwrap().join, Some(true));
        assert!(toml::from_str::<FileConfig>("[cluster]\njoin = 1\n").is_err());
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

    /// `tether server ARGS` resolved (with whatever `TETHER_*` variables the test runs with).
    fn resolved(args: &[&str]) -> Result<Settings, String> {
        #[derive(clap::Parser)]
        struct Cli {
            #[command(flatten)]
            server: ServerArgs,
        }
        use clap::{CommandFactory, FromArgMatches};
        let m = Cli::command()
            .try_get_matches_from(std::iter::once("server").chain(args.iter().copied()))
            .map_err(|e| e.to_string())?;
        let cli = Cli::from_arg_matches(&m).map_err(|e| e.to_string())?;
        resolve(&cli.server, &m).map_err(|e| e.to_string())
    }

    #[test]
    fn flag_defaults_are_the_config_defaults() {
        let s = resolved(&[]).unwrap();
        assert_eq!(s.server, ServerConfig::default());
        assert_eq!(s.log, LogSettings::default());
    }

    #[test]
    fn flags_win_over_the_file_which_wins_over_defaults() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("t.toml");
        std::fs::write(
            &file,
            "listen = \"127.0.0.1:7500\"\nsync = \"none\"\ndirect-io = true\nmetrics-top-queues = 3\nlog-level = \"debug\"\n[limits]\nqueue-entries-max = 5\nidle-timeout-ms = 9000\n[cluster]\nrebalance = false\nnode-failure-ms = 3000\n",
        )
        .unwrap();
        let f = file.to_str().unwrap();
        let s = resolved(&["--config", f]).unwrap();
        assert_eq!(s.server.listen.to_string(), "127.0.0.1:7500");
        assert_eq!(s.server.sync, SyncMode::None);
        assert!(s.server.direct_io);
        assert_eq!(s.server.metrics_top_queues, 3);
        assert_eq!(s.log.level, "debug");
        assert_eq!(s.server.limits.queue_entries_max, 5);
        assert_eq!(s.server.limits.idle_timeout_ms, 9000);
        assert_eq!(
            s.server.limits.connections_max,
            Limits::default().connections_max
        );
        assert!(!s.server.rebalance);
        assert_eq!(s.server.node_failure_ms, 3000);
        let s = resolved(&[
            "--config",
            f,
            "--listen",
            "127.0.0.1:7600",
            "--queue-entries-max",
            "6",
            "--rebalance",
            "true",
            "--sync",
            "always",
            "--metrics-top-queues",
            "0",
            "--direct-io",
            "false",
        ])
        .unwrap();
        assert_eq!(s.server.listen.to_string(), "127.0.0.1:7600");
        assert_eq!(s.server.limits.queue_entries_max, 6);
        assert_eq!(
            s.server.limits.idle_timeout_ms, 9000,
            "the file's, not given"
        );
        assert!(s.server.rebalance);
        assert_eq!(s.server.sync, SyncMode::Always);
        assert_eq!(s.server.metrics_top_queues, 0);
        assert!(!s.server.direct_io, "the flag's, over the file's");
        // The bare flag means true.
        assert!(resolved(&["--direct-io"]).unwrap().server.direct_io);
    }

    #[test]
    fn bad_settings_are_refused() {
        for args in [
            &["--metrics-top-queues", "1001"][..],
            &["--idle-timeout-ms", "5000"],
            &["--queue-bytes-max", "4095"],
            &["--log-level", "tether=loud"],
            &["--log-format", "xml"],
            &["--tls-cert", "/x.pem"],
            &["--node-failure-ms", "1"],
            &["--direct-io", "yes"],
        ] {
            assert!(resolved(args).is_err(), "{args:?}");
        }
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("t.toml");
        std::fs::write(&file, "metrics-top-queues = 5000\n").unwrap();
        let err = resolved(&["--config", file.to_str().unwrap()]).unwrap_err();
        assert!(err.contains("metrics-top-queues"), "{err}");
        assert!(validate_metrics_top_queues(METRICS_TOP_QUEUES_MAX).is_ok());
        assert!(validate_log_filter("info,openraft=off").is_ok());
        assert!(validate_log_filter(SERVER_LOG_FILTER_DEFAULT).is_ok());
        assert!(validate_log_filter(" ").is_err());
    }

    #[test]
    fn the_printed_configuration_reads_back_the_same() {
        let dir = tempfile::tempdir().unwrap();
        let s = resolved(&[
            "--listen",
            "127.0.0.1:0",
            "--metrics",
            "off",
            "--node-id",
            "n1",
            "--peer",
            "n1=127.0.0.1:7401,n2=tether-2.example.com:7402",
            "--advertise",
            "tether-1.example.com",
            "--queue-full-policy",
            "drop-queue",
            "--tls-cert",
            "/c.pem",
            "--tls-key",
            "/k.pem",
            "--tls-ca",
            "/ca.pem",
            "--log-format",
            "json",
            "--direct-io",
        ])
        .unwrap();
        let text = render_toml(&s, None).unwrap();
        assert!(text.contains("direct-io = true"), "{text}");
        let file = dir.path().join("printed.toml");
        std::fs::write(&file, &text).unwrap();
        let back = resolved(&["--config", file.to_str().unwrap()]).unwrap();
        assert_eq!(back, s, "{text}");
        assert_eq!(render_toml(&back, None).unwrap(), text);
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
