//! The commands of the `tether` binary: argument parsing (clap), the contract's output and
//! exit statuses (`docs/cli.md`), and each command's work (`queues.rs`, `subscribe.rs`; the
//! server, publishing and the rest here).
//!
//! Every command closes with `Client::close_promptly` (the close answered, the close packet
//! sent, no draining wait), `subscribe` too: the server answers a close only once the session
//! has ended, so a durable client may reconnect at once.

mod queues;
mod subscribe;

use std::io::Write;
use std::net::{SocketAddr, ToSocketAddrs};
use std::path::{Path, PathBuf};
use std::task::Poll;
use std::time::Duration;

use std::ffi::OsString;

use clap::{Args, CommandFactory, FromArgMatches, Parser, Subcommand};
use serde_json::{Value, json};
use tether::client::{
    AckMode, Acker, Client, ClientBuilder, ClientEvent, Event, EventStream, Interest,
    ReconnectPolicy, Subscription,
};
use tether::config::{
    CLIENT_LOG_FILTER_DEFAULT, LogFormat, ServerArgs, ServerConfig, Settings, validate_node_id,
};
use tether::limits::{
    DURABLE_ID_BYTES_MAX, DURABLE_TIMEOUT_SECS_DEFAULT, DURABLE_TIMEOUT_SECS_MAX,
    PUBLISH_OPS_PER_REQUEST_MAX,
};
use tether::protocol::{EventOp, PublishAck, PublishOp, ResultPolicy};
use tether::server::Node;

use queues::list_queues;
use subscribe::subscribe;

/// Publish operations sent per request by `tether put --count`.
const PUT_BATCH_OPS: usize = 1000;
const _: () = assert!(PUT_BATCH_OPS <= PUBLISH_OPS_PER_REQUEST_MAX);

#[derive(Parser)]
#[command(
    name = "tether",
    version,
    about = "Durable client messaging over QUIC, with queues in RocksDB",
    after_help = "Exit status: 0 on success, 2 for a usage error (a bad flag, value or variable), 1 for other failures."
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum ClusterCommand {
    /// Drain a member: it takes no new queue or copy and hands its own to the other members
    /// (clients of its queues reconnect to their new primaries). Prints how many primaries and
    /// copies it still holds; drained (both 0), it can be stopped without moving a queue.
    Drain {
        #[command(flatten)]
        conn: Conn,
        /// The member's node id.
        #[arg(value_parser = node_id_arg)]
        node_id: String,
        /// Stop draining: the member takes queues and copies again.
        #[arg(long, conflicts_with_all = ["status", "wait"])]
        undo: bool,
        /// Only report how far the drain is; change nothing.
        #[arg(long)]
        status: bool,
        /// Wait until the member holds no primary and no copy (printing progress as it goes),
        /// at most this many seconds; exit status 1 if it still holds some then.
        #[arg(long, value_name = "SECS")]
        wait: Option<u64>,
    },
    /// Remove a member from the cluster for good: it is marked draining, and refused while it
    /// is still the primary of a queue (drain it first; a member that is down must first have
    /// its queues failed over). Its copies are dropped (their primaries place new ones), and
    /// the other members keep no more publishes for it. Stop its process afterwards.
    RemoveNode {
        #[command(flatten)]
        conn: Conn,
        /// The member's node id.
        #[arg(value_parser = node_id_arg)]
        node_id: String,
    },
    /// Add a node to the cluster. Start it first with --join, the cluster's CA and --peer
    /// listing the members and itself. It is draining until it has copied the regions' values
    /// from a member, then serves clients and takes queues as rebalancing moves them.
    AddNode {
        #[command(flatten)]
        conn: Conn,
        /// The new node's node id.
        #[arg(value_parser = node_id_arg)]
        node_id: String,
        /// Where the members reach it: IP:PORT or HOST:PORT.
        #[arg(value_parser = peer_addr_arg)]
        addr: String,
    },
}

#[derive(Subcommand)]
enum Command {
    /// Run a server node.
    ///
    /// Every setting comes from its flag, else its TETHER_* environment variable, else the
    /// --config file, else its default; --print-config shows the result.
    Server(ServerArgs),
    /// Put one key, or N keys in order.
    Put(PutArgs),
    /// Destroy a key.
    Destroy(KeyArgs),
    /// Print the current value of a key.
    Get(KeyArgs),
    /// Connect, register interest and print events as JSON lines.
    Subscribe(SubscribeArgs),
    /// List the subscription queues with their lag: the contacted node's (primaries and
    /// copies), every member's with --cluster, one page with --limit/--after.
    Queues(QueuesArgs),
    /// Cluster operations (draining a member).
    #[command(subcommand)]
    Cluster(ClusterCommand),
    /// Destroy an away durable client's queue and interest.
    CloseDurable {
        #[command(flatten)]
        conn: Conn,
        /// The durable id.
        id: String,
    },
    /// Print the SHA-256 of a token, as the server's [auth] tokens table stores it.
    HashToken {
        /// The token. Better read from standard input (the default without it) or
        /// --token-file: a command line is visible to other users (ps, shell history).
        token: Option<String>,
        /// Read the token from this file ("-": standard input); one trailing newline is
        /// removed.
        #[arg(long, value_name = "FILE", conflicts_with = "token")]
        token_file: Option<PathBuf>,
    },
    /// Create (if missing) a data directory's dev CA and server certificate, without starting
    /// a server: copy its tls/ca.pem and tls/ca.key to other nodes' data directories to make
    /// them one cluster.
    DevCa {
        /// The data directory (certificates go to <data-dir>/tls).
        #[arg(long, value_name = "DIR", default_value = "data")]
        data_dir: PathBuf,
    },
    /// Issue a client certificate signed by a data directory's dev CA (for mutual TLS; the
    /// common name is the principal).
    IssueClientCert {
        /// The principal (certificate common name): letters, digits, '-', '_', '.', '@'.
        #[arg(long, value_parser = client_name_arg)]
        name: String,
        /// The data directory whose tls/ca.pem and tls/ca.key sign it.
        #[arg(long, value_name = "DIR", default_value = "data")]
        data_dir: PathBuf,
        /// Where to write <name>.pem and <name>.key.
        #[arg(long, value_name = "DIR", default_value = ".")]
        out: PathBuf,
    },
    /// Issue a server certificate signed by a data directory's dev CA for the host names or IP
    /// addresses clients and peers reach a node by (set it with [tls] cert/key/ca).
    IssueServerCert {
        /// A host name or IP address the certificate is valid for (repeat for more; the first
        /// names the files).
        #[arg(long = "name", value_name = "HOST", required = true, value_parser = server_name_arg)]
        names: Vec<String>,
        /// The cluster node the certificate belongs to (its --node-id), for a cluster node.
        #[arg(long, value_name = "ID", value_parser = node_id_arg)]
        node_id: Option<String>,
        /// The data directory whose tls/ca.pem and tls/ca.key sign it.
        #[arg(long, value_name = "DIR", default_value = "data")]
        data_dir: PathBuf,
        /// Where to write <name>.pem and <name>.key.
        #[arg(long, value_name = "DIR", default_value = ".")]
        out: PathBuf,
    },
    /// Revoke a client certificate: add it to a certificate revocation list signed by a data
    /// directory's dev CA. A node whose `[auth] client-crl` names the list reloads it within a
    /// second, refuses the certificate and closes the connections using it.
    RevokeClientCert {
        /// The client certificate (PEM) to revoke.
        #[arg(long, value_name = "FILE")]
        cert: PathBuf,
        /// The data directory whose tls/ca.pem and tls/ca.key issued it and sign the list.
        #[arg(long, value_name = "DIR", default_value = "data")]
        data_dir: PathBuf,
        /// The revocation list to update, created when missing (default
        /// <data-dir>/tls/client-crl.pem).
        #[arg(long, value_name = "FILE")]
        crl: Option<PathBuf>,
    },
    /// Print a shell completion script.
    ///
    /// For example `source <(tether completions bash)`, or `tether completions bash >
    /// /etc/bash_completion.d/tether`.
    Completions {
        /// The shell to complete for.
        #[arg(value_enum)]
        shell: clap_complete::Shell,
    },
}

/// A command-line value refused by its parser (clap prints it after the flag's name).
#[derive(Debug, thiserror::Error)]
enum ArgError {
    #[error("invalid name {0:?}: use letters, digits, '-', '_', '.', '@'")]
    ClientName(String),
    #[error("invalid name {0:?}: a host name or an IP address")]
    ServerName(String),
    #[error("invalid server address {0:?} (expected HOST:PORT)")]
    ServerAddress(String),
    #[error("no server address given")]
    NoServer,
    #[error("must be at least 1")]
    Zero,
    #[error("{0}")]
    NotANumber(#[from] std::num::ParseIntError),
    #[error("a durable id has 1 to {max} bytes", max = DURABLE_ID_BYTES_MAX)]
    DurableIdLength,
}

/// An environment variable (`TETHER_*`) that holds a value its flag refuses.
#[derive(Debug, thiserror::Error)]
enum EnvError {
    #[error("environment variable {var} (for {flag}) is not UTF-8 text")]
    NotText { var: String, flag: String },
    #[error(
        "invalid value{shown} in environment variable {var} (for {flag}): {reason}\n\nFor more \
         information, try 'tether {command} --help'."
    )]
    Refused {
        /// The value, quoted (empty when the flag hides its variable's values).
        shown: String,
        var: String,
        flag: String,
        reason: String,
        command: String,
    },
}

fn client_name_arg(name: &str) -> Result<String, ArgError> {
    if name.is_empty()
        || !name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || "-_.@".contains(c))
    {
        return Err(ArgError::ClientName(name.to_string()));
    }
    Ok(name.to_string())
}

fn server_name_arg(n: &str) -> Result<String, ArgError> {
    let ok = !n.is_empty()
        && n.chars()
            .all(|c| c.is_ascii_alphanumeric() || "-.:".contains(c));
    if !ok {
        return Err(ArgError::ServerName(n.to_string()));
    }
    Ok(n.to_string())
}

fn node_id_arg(id: &str) -> Result<String, tether::config::ConfigError> {
    validate_node_id(id).map(|()| id.to_string())
}

/// Checks a member's peer address (`IP:PORT` or `HOST:PORT`, as in `--peer`).
fn peer_addr_arg(addr: &str) -> Result<String, tether::config::ConfigError> {
    tether::config::parse_peer(&format!("node={addr}")).map(|(_, a)| a)
}

/// Checks the form of a `--server` list (each entry `HOST:PORT`); names are resolved later,
/// when the command starts ([`parse_servers`]).
fn server_list_arg(list: &str) -> Result<String, ArgError> {
    let mut any = false;
    for part in list.split(',').map(str::trim).filter(|s| !s.is_empty()) {
        let port_ok = part
            .rsplit_once(':')
            .is_some_and(|(host, port)| !host.is_empty() && port.parse::<u16>().is_ok());
        if !port_ok {
            return Err(ArgError::ServerAddress(part.to_string()));
        }
        any = true;
    }
    if !any {
        return Err(ArgError::NoServer);
    }
    Ok(list.to_string())
}

/// A whole number of at least 1.
fn positive_arg(s: &str) -> Result<u64, ArgError> {
    match s.parse::<u64>()? {
        0 => Err(ArgError::Zero),
        n => Ok(n),
    }
}

fn durable_id_arg(id: &str) -> Result<String, ArgError> {
    if id.is_empty() || id.len() > DURABLE_ID_BYTES_MAX {
        return Err(ArgError::DurableIdLength);
    }
    Ok(id.to_string())
}

#[derive(Args, Clone)]
struct Conn {
    /// Nodes to contact, comma-separated HOST:PORT entries (host names are resolved when the
    /// command starts).
    #[arg(long, value_name = "ADDR[,ADDR...]", default_value = "127.0.0.1:7400", value_parser = server_list_arg)]
    server: String,
    /// CA certificate to trust (default data/tls/ca.pem when it exists).
    #[arg(long, value_name = "FILE")]
    ca: Option<PathBuf>,
    /// Bearer token for servers that authenticate clients (prefer TETHER_TOKEN: a command
    /// line is visible to other users).
    #[arg(long, env = "TETHER_TOKEN", hide_env_values = true)]
    token: Option<String>,
    /// Client certificate (PEM) for servers that authenticate clients by certificate; the
    /// file may also hold the private key.
    #[arg(long, value_name = "FILE")]
    cert: Option<PathBuf>,
    /// Private key (PEM) of --cert, when it is not in the --cert file. (`--key` is the
    /// region key in every command, so the certificate's key has this name.)
    #[arg(long, value_name = "FILE", requires = "cert")]
    cert_key: Option<PathBuf>,
    /// The name the servers' certificates must be valid for. Default: the host of each
    /// --server entry when it is a name (not an IP address), else localhost (the name of the
    /// dev certificates).
    #[arg(long, value_name = "NAME")]
    server_name: Option<String>,
}

#[derive(Args)]
struct KeyArgs {
    #[command(flatten)]
    conn: Conn,
    /// The region of the key.
    #[arg(long)]
    region: String,
    /// The key.
    #[arg(long)]
    key: String,
}

/// How `tether queues` prints.
#[derive(Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum FormatArg {
    /// One JSON line per queue (for scripts).
    Json,
    /// An aligned table for people.
    Table,
}

#[derive(Args)]
struct QueuesArgs {
    #[command(flatten)]
    conn: Conn,
    /// Print one page of this many queues, then a `page` line with the token of the next
    /// (default: every queue, without a `page` line). At most 1000.
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u64).range(1..=1000))]
    limit: Option<u64>,
    /// Start after this token (the `next` of a previous `page` line).
    #[arg(long, value_name = "TOKEN")]
    after: Option<String>,
    /// Only the queue with this id (a durable id, or NODE:NUMBER for a non-durable queue).
    #[arg(long, value_name = "ID", conflicts_with_all = ["prefix", "after", "limit"])]
    id: Option<String>,
    /// Only queues whose id starts with this.
    #[arg(long, value_name = "PREFIX")]
    prefix: Option<String>,
    /// Only queues with interest in this region.
    #[arg(long, value_name = "REGION")]
    region: Option<String>,
    /// Only queues in this state.
    #[arg(long, value_parser = ["ready", "connected", "away"])]
    state: Option<String>,
    /// Which copies of each queue: primary (where its client attaches), secondary, or all.
    #[arg(long, value_parser = ["primary", "secondary", "all"], default_value = "all")]
    role: String,
    /// Sort by pending events, pending bytes, age of the oldest pending event, or id.
    #[arg(long, value_parser = ["pending", "bytes", "age", "id"], default_value = "pending")]
    sort: String,
    /// Sort order.
    #[arg(long, value_parser = ["desc", "asc"], default_value = "desc")]
    order: String,
    /// Every member's queues, asked through the contacted node (default: the contacted node's
    /// only, as before the option existed).
    #[arg(long)]
    cluster: bool,
    /// Output format.
    #[arg(long, value_enum, default_value_t = FormatArg::Json)]
    format: FormatArg,
}

/// When `tether put` is acknowledged.
#[derive(Clone, Copy, clap::ValueEnum)]
enum AckArg {
    /// Once the contacted node committed the puts.
    Local,
    /// Once every matching queue and each of its copies holds them (a cluster).
    Replicated,
}

#[derive(Args)]
#[command(group(clap::ArgGroup::new("what").required(true).args(["key", "count"])))]
struct PutArgs {
    #[command(flatten)]
    conn: Conn,
    /// The region to put into.
    #[arg(long)]
    region: String,
    /// The key of a single put (with --value).
    #[arg(long, requires = "value", conflicts_with_all = ["count", "key_prefix", "keys", "size"])]
    key: Option<String>,
    /// The value of a single put (UTF-8 text).
    #[arg(long, requires = "key")]
    value: Option<String>,
    /// Number of puts: put number i (from 0) writes key <key-prefix><i mod keys>.
    #[arg(long, value_name = "N")]
    count: Option<u64>,
    /// When the server acknowledges the puts.
    #[arg(long, value_enum, default_value_t = AckArg::Local)]
    ack: AckArg,
    /// Key prefix for --count.
    #[arg(long, value_name = "P", default_value = "key-", requires = "count")]
    key_prefix: String,
    /// Number of distinct keys for --count (default: --count).
    #[arg(long, value_name = "M", requires = "count", value_parser = positive_arg)]
    keys: Option<u64>,
    /// Value size in bytes for --count (printable ASCII; default: the text value-i).
    #[arg(long, value_name = "BYTES", requires = "count")]
    size: Option<usize>,
}

/// A subscription's initial image.
#[derive(Clone, Copy, clap::ValueEnum)]
enum PolicyArg {
    /// Keys and their current values.
    KeysValues,
    /// Keys only (values null).
    Keys,
    /// No initial image.
    None,
}

impl From<PolicyArg> for ResultPolicy {
    fn from(p: PolicyArg) -> Self {
        match p {
            PolicyArg::KeysValues => ResultPolicy::KeysValues,
            PolicyArg::Keys => ResultPolicy::Keys,
            PolicyArg::None => ResultPolicy::None,
        }
    }
}

/// What `tether subscribe` does with a durable queue on exit.
#[derive(Clone, Copy, clap::ValueEnum)]
enum CloseArg {
    /// Keep the durable queue and its interest (for the durable timeout).
    Keepalive,
    /// Destroy the durable queue and its interest.
    Drop,
}

#[derive(Args)]
struct SubscribeArgs {
    #[command(flatten)]
    conn: Conn,
    /// The region this subscription registers interest in.
    #[arg(long)]
    region: String,
    /// Make the client durable under this id (default: not durable).
    #[arg(long, value_name = "ID", value_parser = durable_id_arg)]
    durable_id: Option<String>,
    /// Durable timeout presented to the server: how long the queue is kept while the client
    /// is away (seconds).
    #[arg(long, value_name = "SECS", default_value_t = DURABLE_TIMEOUT_SECS_DEFAULT, value_parser = clap::value_parser!(u64).range(0..=DURABLE_TIMEOUT_SECS_MAX))]
    timeout: u64,
    /// Secondary copies of the durable queue on other cluster nodes (taken when the queue is
    /// created).
    #[arg(long, value_name = "N", default_value_t = 0, value_parser = clap::value_parser!(u8).range(0..=i64::from(tether::cluster::meta::REDUNDANCY_MAX)))]
    redundancy: u8,
    /// Interest in key K (repeatable).
    #[arg(long, value_name = "K")]
    key: Vec<String>,
    /// Interest in keys matching RE (repeatable).
    #[arg(long, value_name = "RE")]
    regex: Vec<String>,
    /// Interest in every key of the region.
    #[arg(long)]
    all_keys: bool,
    /// The interest registered by this invocation is not durable (default: durable for a
    /// durable client).
    #[arg(long)]
    non_durable: bool,
    /// Initial image of the registration.
    #[arg(long, value_name = "P", value_enum, default_value_t = PolicyArg::KeysValues)]
    policy: PolicyArg,
    /// Creates and updates arrive as invalidate events, without values.
    #[arg(long)]
    no_values: bool,
    /// Never send ready: print the status, register, then wait (events stay queued).
    #[arg(long)]
    no_ready: bool,
    /// Wait this long after registering before sending ready (milliseconds).
    #[arg(long, value_name = "MS", default_value_t = 0)]
    ready_delay_ms: u64,
    /// Exit after printing N events.
    #[arg(long, value_name = "N")]
    max_events: Option<u64>,
    /// Exit right after the (last) live line.
    #[arg(long)]
    exit_on_live: bool,
    /// Exit after this long with no event printed (milliseconds; counted from ready, or from
    /// connect with --no-ready).
    #[arg(long, value_name = "MS")]
    idle_exit_ms: Option<u64>,
    /// What happens to a durable queue on exit [default: keepalive for a durable client].
    #[arg(long, value_name = "MODE", value_enum)]
    close: Option<CloseArg>,
    /// On exit, vanish without closing or flushing acks, as a killed process would.
    #[arg(long)]
    crash: bool,
    /// How often processed offsets are acknowledged (milliseconds).
    #[arg(long, value_name = "MS", default_value_t = tether::client::ACK_INTERVAL_MS_DEFAULT, value_parser = positive_arg)]
    ack_interval_ms: u64,
    /// Pace the replay of the queued events at most at N events per second (asked again after
    /// every reconnect); live events are never paced. 0: unlimited.
    #[arg(long, value_name = "N", default_value_t = 0)]
    replay_rate: u64,
    /// Reconnect by itself when the connection is lost (with backoff, across every server it
    /// knows), resuming the durable queue and registering the interest again. Default: exit.
    #[arg(long, conflicts_with_all = ["no_ready", "ready_delay_ms"])]
    reconnect: bool,
    /// With --reconnect: give up after this many seconds without a connection (0: never).
    #[arg(long, value_name = "SECS", default_value_t = tether::client::RECONNECT_GIVE_UP_SECS_DEFAULT, requires = "reconnect")]
    reconnect_max_secs: u64,
    /// How long the server may stay silent before the connection counts as lost, in
    /// milliseconds (the QUIC idle timeout) [default: 30000].
    #[arg(long, value_name = "MS", value_parser = clap::value_parser!(u64).range(FAILURE_TIMEOUT_MS_MIN..=FAILURE_TIMEOUT_MS_MAX))]
    failure_timeout_ms: Option<u64>,
}

/// A user-facing failure: printed as one `error:` line.
/// A secret read from `file` (`-` or None: standard input), without one trailing newline.
fn read_secret(file: Option<&std::path::Path>) -> Result<String, Fail> {
    use std::io::Read;
    let mut text = String::new();
    match file {
        Some(f) if f != std::path::Path::new("-") => {
            text = std::fs::read_to_string(f)
                .map_err(|e| Fail(format!("cannot read {}: {e}", f.display())))?;
        }
        _ => {
            std::io::stdin()
                .read_to_string(&mut text)
                .map_err(|e| Fail(format!("cannot read standard input: {e}")))?;
        }
    }
    let trimmed = text
        .strip_suffix("\r\n")
        .or_else(|| text.strip_suffix('\n'))
        .unwrap_or(&text);
    Ok(trimmed.to_string())
}

struct Fail(String);

impl<E: std::fmt::Display> From<E> for Fail {
    fn from(e: E) -> Self {
        Fail(e.to_string())
    }
}

fn emit(v: Value) {
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{v}");
    let _ = out.flush();
}

/// Parses the command line and runs the command; exits with the contract's status.
pub fn main() -> ! {
    // An empty TETHER_* variable counts as unset.
    for (name, value) in std::env::vars_os() {
        if value.is_empty() && name.to_string_lossy().starts_with("TETHER_") {
            // SAFETY: no other thread runs yet: nothing has been spawned.
            unsafe { std::env::remove_var(&name) };
        }
    }
    let argv: Vec<OsString> = std::env::args_os().collect();
    let mut cmd = Cli::command();
    cmd.build();
    if let Err(msg) = check_env(&cmd, &argv) {
        eprintln!("error: {msg}");
        std::process::exit(2);
    }
    // Usage errors: clap's whole message (the error, a tip such as a similar flag, the usage,
    // the pointer to --help), exit status 2; --help and --version: stdout, exit status 0.
    let matches = cmd
        .try_get_matches_from_mut(&argv)
        .unwrap_or_else(|e| e.exit());
    let cli = Cli::from_arg_matches(&matches).unwrap_or_else(|e| e.format(&mut cmd).exit());
    let settings = match &cli.command {
        Command::Server(args) => {
            let m = matches
                .subcommand_matches("server")
                .expect("the server subcommand's matches");
            let settings = match tether::config::resolve(args, m) {
                Ok(s) => s,
                Err(e) => {
                    eprintln!("error: {}", one_line(&e.to_string()));
                    std::process::exit(1);
                }
            };
            if args.print_config {
                let rust_log = std::env::var("RUST_LOG")
                    .ok()
                    .filter(|v| !v.trim().is_empty());
                match tether::config::render_toml(&settings, rust_log.as_deref()) {
                    Ok(text) => {
                        let mut out = std::io::stdout().lock();
                        let _ = out.write_all(text.as_bytes());
                        let _ = out.flush();
                        std::process::exit(0);
                    }
                    Err(e) => {
                        eprintln!("error: {}", one_line(&e.to_string()));
                        std::process::exit(1);
                    }
                }
            }
            init_logs(settings.log.format, &settings.log.level);
            Some(settings)
        }
        Command::Completions { shell } => {
            let mut out = std::io::stdout().lock();
            clap_complete::generate(*shell, &mut Cli::command(), "tether", &mut out);
            let _ = out.flush();
            std::process::exit(0);
        }
        _ => {
            init_logs(LogFormat::Text, CLIENT_LOG_FILTER_DEFAULT);
            None
        }
    };
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(r) => r,
        Err(e) => {
            eprintln!("error: cannot start the runtime: {e}");
            std::process::exit(1);
        }
    };
    let result = runtime.block_on(run(cli.command, settings));
    let code = match result {
        Ok(()) => 0,
        Err(Fail(msg)) => {
            eprintln!("error: {}", one_line(&msg));
            1
        }
    };
    // Do not wait for stray tasks (a crashed subscriber's connection, say).
    runtime.shutdown_timeout(Duration::from_millis(100));
    std::process::exit(code);
}

/// A message on one line (the contract's one `error:` line).
fn one_line(msg: &str) -> String {
    msg.lines().collect::<Vec<_>>().join("; ")
}

/// Logs to stderr: `format`, and the filter `RUST_LOG` gives when set (it wins), else
/// `filter`. Colours only when stderr is a terminal (and `NO_COLOR` is not set): logs
/// redirected to a file or a pipe carry no escape codes.
fn init_logs(format: LogFormat, filter: &str) {
    use std::io::IsTerminal;
    use tracing_subscriber::EnvFilter;
    let filter = match std::env::var("RUST_LOG") {
        Ok(v) if !v.trim().is_empty() => match EnvFilter::builder().parse(&v) {
            Ok(f) => f,
            Err(e) => {
                eprintln!("warning: ignoring RUST_LOG={v:?}: {e}");
                EnvFilter::new(filter)
            }
        },
        _ => EnvFilter::new(filter),
    };
    let ansi = std::io::stderr().is_terminal()
        && std::env::var_os("NO_COLOR").is_none_or(|v| v.is_empty());
    let logs = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    match format {
        LogFormat::Text => logs.with_ansi(ansi).init(),
        LogFormat::Json => logs.json().with_ansi(false).init(),
    }
}

/// Checks the environment variables (`TETHER_*`) of the invoked subcommand's flags that its
/// command line does not give, as clap would parse them: a bad value is a usage error that
/// names the variable (clap's own message would name the flag only).
fn check_env(cmd: &clap::Command, argv: &[OsString]) -> Result<(), EnvError> {
    let args: Vec<String> = argv
        .iter()
        .skip(1)
        .map(|a| a.to_string_lossy().into_owned())
        .collect();
    let Some(sub) = args
        .iter()
        .find(|a| !a.starts_with('-'))
        .and_then(|name| cmd.find_subcommand(name))
    else {
        return Ok(());
    };
    for arg in sub.get_arguments() {
        let (Some(var), Some(long)) = (arg.get_env(), arg.get_long()) else {
            continue;
        };
        let flag = format!("--{long}");
        let on_line = args
            .iter()
            .take_while(|a| a.as_str() != "--")
            .any(|a| *a == flag || a.starts_with(&format!("{flag}=")));
        let Some(value) = std::env::var_os(var) else {
            continue;
        };
        if on_line {
            continue;
        }
        let var = var.to_string_lossy().into_owned();
        let Some(text) = value.to_str() else {
            return Err(EnvError::NotText { var, flag });
        };
        let values: Vec<&str> = match arg.get_value_delimiter() {
            Some(d) => text.split(d).collect(),
            None => vec![text],
        };
        // The flag alone, with the same parser, given the variable's value.
        let probe = clap::Command::new("tether").no_binary_name(true).arg(
            clap::Arg::new("value")
                .required(true)
                .allow_hyphen_values(true)
                .value_parser(arg.get_value_parser().clone()),
        );
        for v in values {
            if let Err(e) = probe.clone().try_get_matches_from([v]) {
                let shown = if arg.is_hide_env_values_set() {
                    String::new()
                } else {
                    format!(" {text:?}")
                };
                return Err(EnvError::Refused {
                    shown,
                    var,
                    flag,
                    reason: parse_error_reason(&e),
                    command: sub.get_name().to_string(),
                });
            }
        }
    }
    Ok(())
}

/// Why clap refused a value, in a few words.
fn parse_error_reason(e: &clap::Error) -> String {
    use clap::error::{ContextKind, ContextValue};
    if let Some(source) = std::error::Error::source(e) {
        return source.to_string();
    }
    if let Some(ContextValue::Strings(values)) = e.get(ContextKind::ValidValue) {
        return format!("possible values: {}", values.join(", "));
    }
    let text = e.render().to_string();
    text.lines()
        .next()
        .unwrap_or("invalid value")
        .trim_start_matches("error: ")
        .to_string()
}

/// Closes a connected client whatever `result` is (an error after connecting must not leave
/// the connection open until the server's idle timeout): `result`'s error first, else the
/// close's. For the one-shot commands, whose sessions are not durable: the process exits
/// once the close is sent, without waiting for the connection to drain (`close_promptly`).
async fn close_after<T>(c: Client, keepalive: bool, result: Result<T, Fail>) -> Result<T, Fail> {
    let closed = c.close_promptly(keepalive).await;
    let value = result?;
    closed?;
    Ok(value)
}

async fn run(cmd: Command, settings: Option<Settings>) -> Result<(), Fail> {
    match cmd {
        Command::Server(_) => {
            let settings = settings.expect("resolved before the runtime starts");
            server(settings.server).await
        }
        Command::Put(a) => put(a).await,
        Command::Destroy(a) => {
            let c = connect(&a.conn, None, 100).await?;
            let r = async {
                c.region(&a.region).destroy(a.key).await?;
                emit(json!({"type":"published","count":1}));
                Ok(())
            }
            .await;
            close_after(c, false, r).await
        }
        Command::Get(a) => {
            let c = connect(&a.conn, None, 100).await?;
            let r = async {
                let v = c.region(&a.region).get(a.key.clone()).await?;
                emit(
                    json!({"type":"value","region":a.region,"key":a.key,"value":v.map(|v| String::from_utf8_lossy(&v).into_owned())}),
                );
                Ok(())
            }
            .await;
            close_after(c, false, r).await
        }
        Command::Subscribe(a) => subscribe(a).await,
        Command::Completions { shell } => {
            let mut out = std::io::stdout().lock();
            clap_complete::generate(shell, &mut Cli::command(), "tether", &mut out);
            Ok(())
        }
        Command::Queues(a) => {
            let c = connect(&a.conn, None, 100).await?;
            let r = list_queues(&c, &a).await;
            close_after(c, false, r).await
        }
        Command::DevCa { data_dir } => {
            let files = tether::transport::tls::ensure_dev_certs(&data_dir.join("tls"))?;
            emit(json!({"type":"dev-ca","ca":files.ca.display().to_string()}));
            Ok(())
        }
        Command::IssueClientCert {
            name,
            data_dir,
            out,
        } => {
            let (cert, key) =
                tether::transport::tls::issue_dev_client_cert(&data_dir.join("tls"), &name, &out)?;
            emit(
                json!({"type":"client-cert","name":name,"cert":cert.display().to_string(),"key":key.display().to_string()}),
            );
            Ok(())
        }
        Command::RevokeClientCert {
            cert,
            data_dir,
            crl,
        } => {
            let tls_dir = data_dir.join("tls");
            let crl = crl.unwrap_or_else(|| tls_dir.join("client-crl.pem"));
            let r = tether::transport::crl::revoke_dev_client_cert(&tls_dir, &cert, &crl)?;
            emit(json!({
                "type": "client-crl",
                "crl": r.crl.display().to_string(),
                "serial": r.serial,
                "revoked": r.revoked,
                "crl_number": r.crl_number,
            }));
            Ok(())
        }
        Command::IssueServerCert {
            names,
            node_id,
            data_dir,
            out,
        } => {
            let (cert, key) = tether::transport::tls::issue_dev_server_cert(
                &data_dir.join("tls"),
                &names,
                node_id.as_deref(),
                &out,
            )?;
            emit(json!({"type":"server-cert","names":names,"node_id":node_id,
                "cert":cert.display().to_string(),"key":key.display().to_string(),
                "ca":data_dir.join("tls").join("ca.pem").display().to_string()}));
            Ok(())
        }
        Command::HashToken { token, token_file } => {
            let token = match token {
                Some(t) => t,
                None => read_secret(token_file.as_deref())?,
            };
            if token.is_empty() {
                return Err(Fail("the token is empty".into()));
            }
            emit(json!({"type":"token-hash","sha256":tether::auth::hash_token(&token)}));
            Ok(())
        }
        Command::Cluster(ClusterCommand::Drain {
            conn,
            node_id,
            undo,
            status,
            wait,
        }) => {
            let c = connect(&conn, None, 100).await?;
            let draining = match (status, undo) {
                (true, _) => None,
                (false, undo) => Some(!undo),
            };
            let r = drain(&c, &node_id, draining, wait).await;
            close_after(c, false, r).await
        }
        Command::Cluster(ClusterCommand::RemoveNode { conn, node_id }) => {
            let c = connect(&conn, None, 100).await?;
            let r = async {
                let members = c.remove_node(&node_id).await?;
                emit(json!({"type":"node-removed","node_id":node_id,"members":members}));
                Ok(())
            }
            .await;
            close_after(c, false, r).await
        }
        Command::Cluster(ClusterCommand::AddNode {
            conn,
            node_id,
            addr,
        }) => {
            let c = connect(&conn, None, 100).await?;
            let r = async {
                let members = c.add_node(&node_id, &addr).await?;
                emit(json!({"type":"node-added","node_id":node_id,"members":members}));
                Ok(())
            }
            .await;
            close_after(c, false, r).await
        }
        Command::CloseDurable { conn, id } => {
            let c = connect(&conn, None, 100).await?;
            let r = async {
                c.close_durable(&id).await?;
                emit(json!({"type":"closed-durable","durable_id":id}));
                Ok(())
            }
            .await;
            close_after(c, false, r).await
        }
    }
}

/// How often `tether cluster drain --wait` asks how far the drain is, in milliseconds.
const DRAIN_POLL_MS: u64 = 500;

/// `tether cluster drain`: sets the drain (unless `draining` is None), prints the report, and
/// with `wait` prints each changed report until the member holds nothing (or the wait ends).
async fn drain(
    c: &Client,
    node_id: &str,
    draining: Option<bool>,
    wait: Option<u64>,
) -> Result<(), Fail> {
    let line = |r: &tether::protocol::DrainReport| {
        json!({
            "type": "drain",
            "node_id": r.node_id,
            "draining": r.draining,
            "primaries": r.primaries,
            "copies": r.copies,
        })
    };
    let mut report = c.drain(node_id, draining).await?;
    emit(line(&report));
    let Some(secs) = wait else {
        return Ok(());
    };
    let deadline = tokio::time::Instant::now() + Duration::from_secs(secs);
    while report.primaries + report.copies > 0 {
        if tokio::time::Instant::now() >= deadline {
            return Err(Fail(format!(
                "{node_id} still holds {} primaries and {} copies after {secs} s",
                report.primaries, report.copies
            )));
        }
        tokio::time::sleep(Duration::from_millis(DRAIN_POLL_MS)).await;
        let next = c.drain(node_id, None).await?;
        if next != report {
            emit(line(&next));
        }
        report = next;
    }
    Ok(())
}

/// The `--server` list: each entry's address, and its host when it is a name (its certificate
/// is verified against that name).
fn parse_servers(list: &str) -> Result<Vec<(SocketAddr, Option<String>)>, Fail> {
    let mut out = Vec::new();
    for part in list.split(',').map(str::trim).filter(|s| !s.is_empty()) {
        let port_ok = part
            .rsplit_once(':')
            .is_some_and(|(host, port)| !host.is_empty() && port.parse::<u16>().is_ok());
        if !port_ok {
            return Err(Fail(format!(
                "invalid server address {part:?} (expected HOST:PORT)"
            )));
        }
        let mut addrs = part
            .to_socket_addrs()
            .map_err(|e| Fail(format!("cannot resolve server {part:?}: {e}")))?;
        match addrs.next() {
            Some(a) => out.push((a, host_name_of(part))),
            None => return Err(Fail(format!("server {part:?} resolves to no address"))),
        }
    }
    if out.is_empty() {
        return Err(Fail("no server address given".into()));
    }
    Ok(out)
}

/// The host of a `HOST:PORT` entry when it is a DNS name: the name that server's certificate
/// is verified against (an IP address keeps the dev certificates' `localhost`).
fn host_name_of(entry: &str) -> Option<String> {
    let (host, _) = entry.trim().rsplit_once(':')?;
    let host = host.trim_start_matches('[').trim_end_matches(']');
    if host.is_empty() || host.parse::<std::net::IpAddr>().is_ok() {
        None
    } else {
        Some(host.to_string())
    }
}

fn ca_path(conn: &Conn) -> Result<PathBuf, Fail> {
    match &conn.ca {
        Some(p) if p.exists() => Ok(p.clone()),
        Some(p) => Err(Fail(format!(
            "CA certificate {} does not exist",
            p.display()
        ))),
        None => {
            let default = Path::new("data/tls/ca.pem");
            if default.exists() {
                Ok(default.to_path_buf())
            } else {
                Err(Fail(
                    "no CA certificate: pass --ca FILE (data/tls/ca.pem does not exist)".into(),
                ))
            }
        }
    }
}

/// A durable identity for [`connect`]: id, timeout in seconds, redundancy.
type DurableArgs = (String, u64, u8);

/// Bounds of `--failure-timeout-ms`: above a keep-alive round trip, below a QUIC idle timeout
/// that still detects a dead server.
const FAILURE_TIMEOUT_MS_MIN: u64 = 300;
const FAILURE_TIMEOUT_MS_MAX: u64 = 600_000;

async fn connect(conn: &Conn, durable: Option<DurableArgs>, ack_ms: u64) -> Result<Client, Fail> {
    Ok(client_builder(conn, durable, ack_ms)?.connect().await?)
}

/// The builder of a client of `conn` (checked and loaded before anything is sent).
fn client_builder(
    conn: &Conn,
    durable: Option<DurableArgs>,
    ack_ms: u64,
) -> Result<ClientBuilder, Fail> {
    let mut b = ClientBuilder::new();
    for (addr, host) in parse_servers(&conn.server)? {
        b = match host {
            Some(h) => b.server_named(addr, h),
            None => b.server(addr),
        };
    }
    let mut b = b
        .ca_file(ca_path(conn)?)
        .ack_interval(Duration::from_millis(ack_ms.max(1)))
        .name("tether-cli");
    if let Some(t) = &conn.token {
        b = b.token(t.clone());
    }
    if let Some(name) = &conn.server_name {
        b = b.server_name(name.clone());
    }
    if let Some(cert) = &conn.cert {
        let key = conn.cert_key.as_ref().unwrap_or(cert);
        for f in [cert, key] {
            if !f.exists() {
                return Err(Fail(format!("{} does not exist", f.display())));
            }
        }
        b = b.identity(cert, key);
    }
    if let Some((id, timeout, redundancy)) = durable {
        b = b.durable(id, timeout).redundancy(redundancy);
    }
    Ok(b)
}

/// Runs a node with its resolved configuration (`tether::config::resolve`) until SIGTERM or
/// SIGINT.
async fn server(cfg: ServerConfig) -> Result<(), Fail> {
    let node = Node::start(cfg).await?;
    emit(json!({
        "type": "listening",
        "node_id": node.node_id(),
        "addr": node.addr().to_string(),
        "metrics": node.metrics_addr().map(|a| a.to_string()),
        "ca": node.ca_file().display().to_string(),
    }));
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    let failure = tokio::select! {
        _ = tokio::signal::ctrl_c() => None,
        _ = term.recv() => None,
        e = node.failed() => Some(e),
    };
    node.shutdown().await;
    match failure {
        Some(e) => Err(Fail(format!("storage failed, node stopped: {e}"))),
        None => Ok(()),
    }
}

/// Printable ASCII value of `size` bytes for put number `i`.
fn sized_value(i: u64, size: usize) -> Vec<u8> {
    let head = format!("value-{i}-");
    (0..size)
        .map(|j| {
            head.as_bytes()
                .get(j)
                .copied()
                .unwrap_or(b'a' + (j % 26) as u8)
        })
        .collect()
}

async fn put(a: PutArgs) -> Result<(), Fail> {
    // Every argument was checked by the parser: nothing can fail after connecting but the
    // puts themselves.
    let ack = match a.ack {
        AckArg::Local => PublishAck::Local,
        AckArg::Replicated => PublishAck::Replicated,
    };
    let c = connect(&a.conn, None, 100).await?;
    let r = async {
        let count = match (&a.key, a.count) {
            (Some(k), None) => {
                let v = a.value.clone().unwrap_or_default();
                c.publish_with(
                    vec![PublishOp::Put {
                        region: a.region.clone(),
                        key: k.clone(),
                        value: v.into_bytes(),
                    }],
                    ack,
                )
                .await?
            }
            (None, Some(n)) => {
                let m = a.keys.unwrap_or(n).max(1);
                let mut sent = 0;
                let mut i = 0;
                while i < n {
                    let end = (i + PUT_BATCH_OPS as u64).min(n);
                    let ops = (i..end)
                        .map(|j| PublishOp::Put {
                            region: a.region.clone(),
                            key: format!("{}{}", a.key_prefix, j % m),
                            value: match a.size {
                                Some(s) => sized_value(j, s),
                                None => format!("value-{j}").into_bytes(),
                            },
                        })
                        .collect();
                    sent += c.publish_with(ops, ack).await?;
                    i = end;
                }
                sent
            }
            _ => return Err(Fail("give either --key K --value V or --count N".into())),
        };
        emit(json!({"type":"published","count":count}));
        Ok(())
    }
    .await;
    close_after(c, false, r).await
}

#[cfg(test)]
mod tests {
    use super::host_name_of;

    #[test]
    fn each_server_is_verified_against_the_name_dialed() {
        // A host name: that name.
        assert_eq!(
            host_name_of("tether-1.example.com:7400").as_deref(),
            Some("tether-1.example.com")
        );
        // An IP address (v4 or v6): the dev certificates' localhost (None).
        assert_eq!(host_name_of("127.0.0.1:7400"), None);
        assert_eq!(host_name_of("[::1]:7400"), None);
        assert_eq!(host_name_of(" tether-2:7400").as_deref(), Some("tether-2"));
    }
}
