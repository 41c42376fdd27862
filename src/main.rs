//! The `tether` command line: server, publishers, subscribers and admin.
//! Its names, flags and JSON fields are a public contract (`docs/cli.md`).

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

/// The server is allocation-heavy on its hot paths (one record per event on the client side,
/// frames on the server side); mimalloc roughly halves allocator time there.
/// Counted (`tether_heap_live_bytes{allocator="rust"}`, src/heap.rs).
#[cfg(not(feature = "system-alloc"))]
#[global_allocator]
static GLOBAL: tether::heap::Counting<mimalloc::MiMalloc> =
    tether::heap::Counting(mimalloc::MiMalloc);
#[cfg(feature = "system-alloc")]
#[global_allocator]
static GLOBAL: tether::heap::Counting<std::alloc::System> =
    tether::heap::Counting(std::alloc::System);

/// mimalloc's settings for a server that runs for long (`tune`, first thing in `main`). By
/// default mimalloc v3 gives memory back to the OS in 2 MiB units where transparent huge pages
/// may be used, and a second after it was freed: a node's resident memory then rose to 300-400
/// MB holding 50-100 MB of live data, and kept rising (BENCHMARKS.md, soak run Y). Without
/// huge pages (64 KiB units) and purging at once, it stayed at 120-190 MB (run Z2).
///
/// mimalloc reads its options and reserves its first arena before `main` runs, advising huge
/// pages for it when they are allowed then: turning `allow_thp` off afterwards only affects
/// later mappings. So `tune` also does what mimalloc itself does when `MIMALLOC_ALLOW_THP=0`
/// is set at start: it disables transparent huge pages for the process (`PR_SET_THP_DISABLE`),
/// which also covers the arena already reserved (run AC: without it, a node's first arena held
/// 240 MB of huge pages).
#[cfg(not(feature = "system-alloc"))]
mod mimalloc_options {
    use std::ffi::{c_int, c_long};

    // Indices in `mi_option_t` of the mimalloc (v3) the `mimalloc` crate builds, from its
    // include/mimalloc.h (its Rust bindings list v2's): the test checks them by their defaults.
    pub const PURGE_DELAY: c_int = 16;
    pub const ALLOW_THP: c_int = 44;
    /// Milliseconds between a free and giving the memory back (mimalloc's default: 1000).
    pub const PURGE_DELAY_MS: c_long = 0;

    unsafe extern "C" {
        fn mi_option_set(option: c_int, value: c_long);
        #[cfg(test)]
        fn mi_option_get(option: c_int) -> c_long;
    }

    /// Huge pages off (the option and the process) and purging at once, each unless the
    /// environment sets it (`MIMALLOC_ALLOW_THP`, `MIMALLOC_PURGE_DELAY`: the operator's
    /// choice, which mimalloc reads itself).
    pub fn tune() {
        // SAFETY (both): a plain option setter of the linked mimalloc, called before any
        // thread starts.
        if std::env::var_os("MIMALLOC_ALLOW_THP").is_none() {
            unsafe { mi_option_set(ALLOW_THP, 0) };
            disable_thp();
        }
        if std::env::var_os("MIMALLOC_PURGE_DELAY").is_none() {
            unsafe { mi_option_set(PURGE_DELAY, PURGE_DELAY_MS) };
        }
    }

    /// Disables transparent huge pages for this process (Linux with glibc; a no-op elsewhere).
    fn disable_thp() {
        #[cfg(all(target_os = "linux", target_env = "gnu"))]
        {
            // SAFETY: prctl with PR_SET_THP_DISABLE takes integer arguments only and changes
            // nothing but this process's huge page policy.
            let rc = unsafe { libc::prctl(libc::PR_SET_THP_DISABLE, 1, 0, 0, 0) };
            if rc != 0 {
                eprintln!(
                    "warning: cannot disable transparent huge pages: {}",
                    std::io::Error::last_os_error()
                );
            }
        }
    }

    #[cfg(test)]
    mod tests {
        use super::*;

        #[test]
        fn the_option_indices_are_those_of_the_linked_mimalloc() {
            // Read before any test sets them: mimalloc v3's defaults (allow_thp 1, purge_delay
            // 1000 ms) are what these indices hold; another index or version fails here.
            // SAFETY: plain option getters.
            let (thp, delay) = unsafe { (mi_option_get(ALLOW_THP), mi_option_get(PURGE_DELAY)) };
            assert!(
                (thp, delay) == (1, 1000) || (thp, delay) == (0, PURGE_DELAY_MS),
                "allow_thp={thp} purge_delay={delay}"
            );
            tune();
            // SAFETY: as above.
            let after = unsafe { (mi_option_get(ALLOW_THP), mi_option_get(PURGE_DELAY)) };
            if std::env::var_os("MIMALLOC_ALLOW_THP").is_none()
                && std::env::var_os("MIMALLOC_PURGE_DELAY").is_none()
            {
                assert_eq!(after, (0, PURGE_DELAY_MS));
            }
            #[cfg(all(target_os = "linux", target_env = "gnu"))]
            if std::env::var_os("MIMALLOC_ALLOW_THP").is_none() {
                // SAFETY: PR_GET_THP_DISABLE only reads the process's flag.
                let disabled = unsafe { libc::prctl(libc::PR_GET_THP_DISABLE, 0, 0, 0, 0) };
                assert_eq!(disabled, 1, "transparent huge pages still allowed");
            }
        }
    }
}

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

fn client_name_arg(name: &str) -> Result<String, String> {
    if name.is_empty()
        || !name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || "-_.@".contains(c))
    {
        return Err(format!(
            "invalid name {name:?}: use letters, digits, '-', '_', '.', '@'"
        ));
    }
    Ok(name.to_string())
}

fn server_name_arg(n: &str) -> Result<String, String> {
    let ok = !n.is_empty()
        && n.chars()
            .all(|c| c.is_ascii_alphanumeric() || "-.:".contains(c));
    if !ok {
        return Err(format!("invalid name {n:?}: a host name or an IP address"));
    }
    Ok(n.to_string())
}

fn node_id_arg(id: &str) -> Result<String, String> {
    validate_node_id(id).map(|()| id.to_string())
}

/// Checks the form of a `--server` list (each entry `HOST:PORT`); names are resolved later,
/// when the command starts ([`parse_servers`]).
fn server_list_arg(list: &str) -> Result<String, String> {
    let mut any = false;
    for part in list.split(',').map(str::trim).filter(|s| !s.is_empty()) {
        let port_ok = part
            .rsplit_once(':')
            .is_some_and(|(host, port)| !host.is_empty() && port.parse::<u16>().is_ok());
        if !port_ok {
            return Err(format!(
                "invalid server address {part:?} (expected HOST:PORT)"
            ));
        }
        any = true;
    }
    if !any {
        return Err("no server address given".into());
    }
    Ok(list.to_string())
}

/// A whole number of at least 1.
fn positive_arg(s: &str) -> Result<u64, String> {
    match s.parse::<u64>() {
        Ok(0) => Err("must be at least 1".into()),
        Ok(n) => Ok(n),
        Err(e) => Err(e.to_string()),
    }
}

fn durable_id_arg(id: &str) -> Result<String, String> {
    if id.is_empty() || id.len() > DURABLE_ID_BYTES_MAX {
        return Err(format!(
            "a durable id has 1 to {DURABLE_ID_BYTES_MAX} bytes"
        ));
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

fn main() {
    // A bug stops the process, on whichever thread it shows (see `tether::bug`).
    tether::bug::stop_on_panic();
    // Allocator settings first, before threads and the first large allocations.
    #[cfg(not(feature = "system-alloc"))]
    mimalloc_options::tune();
    tether::heap::tune_native_heap();
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
                    eprintln!("error: {}", one_line(&e));
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
                        eprintln!("error: {}", one_line(&e));
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
fn check_env(cmd: &clap::Command, argv: &[OsString]) -> Result<(), String> {
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
        let var = var.to_string_lossy();
        let text = value
            .to_str()
            .ok_or_else(|| format!("environment variable {var} (for {flag}) is not UTF-8 text"))?;
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
                return Err(format!(
                    "invalid value{shown} in environment variable {var} (for {flag}): {}\n\nFor more information, try 'tether {} --help'.",
                    parse_error_reason(&e),
                    sub.get_name()
                ));
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

/// Queues per request when `tether queues` lists everything.
const QUEUES_LIST_PAGE: u64 = 1_000;

/// Prints the queues (`tether queues`): every page, or the one asked for.
async fn list_queues(c: &Client, a: &QueuesArgs) -> Result<(), Fail> {
    let one_page = a.limit.is_some() || a.after.is_some();
    let mut query = tether::protocol::QueuesQuery {
        limit: Some(a.limit.unwrap_or(QUEUES_LIST_PAGE)),
        after: a.after.clone(),
        sort: Some(a.sort.clone()),
        order: Some(a.order.clone()),
        state: a.state.clone(),
        region: a.region.clone(),
        prefix: a.id.clone().or_else(|| a.prefix.clone()),
        role: Some(a.role.clone()),
        node_only: !a.cluster,
    };
    let mut table = Vec::new();
    let mut table_footer = None;
    let mut unreachable = std::collections::BTreeSet::new();
    loop {
        let page = c.queues_page(query.clone()).await?;
        unreachable.extend(page.unreachable.iter().cloned());
        for q in page.queues {
            if a.id.as_ref().is_some_and(|id| q.id.as_ref() != Some(id)) {
                continue;
            }
            match a.format {
                FormatArg::Json => emit(queue_line(&q)),
                FormatArg::Table => table.push(q),
            }
        }
        if one_page {
            if a.format == FormatArg::Json {
                emit(json!({
                    "type": "page",
                    "next": page.next,
                    "total": page.total,
                    "unreachable": page.unreachable,
                }));
            } else if let Some(next) = &page.next {
                table_footer = Some(format!("more: --after {next}"));
            }
            break;
        }
        match page.next {
            Some(next) => query.after = Some(next),
            None => break,
        }
    }
    if a.format == FormatArg::Table {
        print_queue_table(&table);
        if let Some(f) = table_footer {
            println!("{f}");
        }
    }
    if !unreachable.is_empty() {
        let names: Vec<String> = unreachable.into_iter().collect();
        eprintln!(
            "warning: members {} did not answer; their queues are missing",
            names.join(", ")
        );
    }
    Ok(())
}

/// One `queue` line of `tether queues` (docs/cli.md).
fn queue_line(q: &tether::protocol::QueueReport) -> Value {
    let mut line = json!({
        "type": "queue",
        "durable_id": q.durable_id,
        "state": q.state,
        "pending": q.pending,
        "acked_offset": q.acked_offset,
        "end_offset": q.end_offset,
        "timeout_secs": q.timeout_secs,
        "role": q.role,
        "interests": q.interests.iter().map(|i| json!({"region":i.region,"kind":i.kind,"spec":i.spec,"durable":i.durable})).collect::<Vec<_>>(),
    });
    // Cluster additions: a primary's copies with their lag, a copy's primary.
    if !q.copies.is_empty() {
        line["copies"] = json!(
            q.copies
                .iter()
                .map(|c| json!({"node":c.node,"lag_entries":c.lag_entries}))
                .collect::<Vec<_>>()
        );
    }
    if let Some(p) = &q.primary {
        line["primary"] = json!(p);
    }
    if let Some(b) = q.pending_bytes {
        line["pending_bytes"] = json!(b);
    }
    // The lag: present when the node reports it, null otherwise.
    line["id"] = json!(q.id);
    line["node"] = json!(q.node);
    line["oldest_pending_age_ms"] = json!(q.oldest_pending_age_ms);
    line["away_since_ms"] = json!(q.away_since_ms);
    line["expires_at_ms"] = json!(q.expires_at_ms);
    line["enqueue_per_min"] = json!(q.enqueue_per_min);
    line["delivery_per_min"] = json!(q.delivery_per_min);
    line["ack_per_min"] = json!(q.ack_per_min);
    line["drain_eta_secs"] = json!(q.drain_eta_secs);
    line
}

/// A duration in seconds as people read it: 45s, 12m, 3h, 2d.
fn human_secs(secs: u64) -> String {
    match secs {
        s if s < 120 => format!("{s}s"),
        s if s < 7_200 => format!("{}m", s / 60),
        s if s < 172_800 => format!("{}h", s / 3_600),
        s => format!("{}d", s / 86_400),
    }
}

/// `tether queues --format table`.
fn print_queue_table(queues: &[tether::protocol::QueueReport]) {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64);
    let dash = || "-".to_string();
    let header = [
        "ID", "NODE", "ROLE", "STATE", "PENDING", "BYTES", "OLDEST", "AWAY", "EXPIRES", "ACK/MIN",
        "ETA",
    ];
    let rows: Vec<[String; 11]> = queues
        .iter()
        .map(|q| {
            [
                q.id.clone()
                    .or_else(|| q.durable_id.clone())
                    .unwrap_or_else(dash),
                q.node.clone().unwrap_or_else(dash),
                q.role.clone(),
                q.state.clone(),
                q.pending.to_string(),
                q.pending_bytes.map_or_else(dash, |b| b.to_string()),
                q.oldest_pending_age_ms
                    .map_or_else(dash, |ms| human_secs(ms / 1_000)),
                q.away_since_ms
                    .map_or_else(dash, |t| human_secs(now.saturating_sub(t) / 1_000)),
                q.expires_at_ms
                    .map_or_else(dash, |t| human_secs(t.saturating_sub(now) / 1_000)),
                q.ack_per_min.map_or_else(dash, |r| r.to_string()),
                q.drain_eta_secs.map_or_else(dash, human_secs),
            ]
        })
        .collect();
    let mut widths = header.map(str::len);
    for r in &rows {
        for (w, cell) in widths.iter_mut().zip(r) {
            *w = (*w).max(cell.chars().count());
        }
    }
    let mut out = std::io::stdout().lock();
    let mut print = |cells: Vec<&str>| {
        let line: Vec<String> = cells
            .iter()
            .zip(widths)
            .enumerate()
            .map(|(i, (c, w))| {
                // Numbers right-aligned, text left-aligned.
                if i >= 4 {
                    format!("{c:>w$}")
                } else {
                    format!("{c:<w$}")
                }
            })
            .collect();
        let _ = writeln!(out, "{}", line.join("  ").trim_end());
    };
    print(header.to_vec());
    for r in &rows {
        print(r.iter().map(String::as_str).collect());
    }
    let _ = out.flush();
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

/// Where `tether subscribe` reads its events from: one session, or a subscription that
/// reconnects by itself (`--reconnect`). One per process: its size does not matter.
#[allow(clippy::large_enum_variant)]
enum Feed {
    Session { client: Client, events: EventStream },
    Reconnecting(Subscription),
}

impl Feed {
    async fn next(&mut self) -> Option<ClientEvent> {
        match self {
            Feed::Session { events, .. } => events.next().await,
            Feed::Reconnecting(s) => s.next().await,
        }
    }

    /// Why the feed ended by itself.
    fn lost(&self) -> Fail {
        match self {
            Feed::Session { .. } => Fail("the connection to the server was lost".into()),
            Feed::Reconnecting(s) => Fail(match s.ended() {
                Some(e) => format!("the connection to the server was lost: {e}"),
                None => "the connection to the server was lost".into(),
            }),
        }
    }

    /// Acks events as they are written (the subscriber's events are acked by hand).
    fn acker(&self) -> Result<Acker, tether::client::ClientError> {
        match self {
            Feed::Session { events, .. } => events.acker(),
            Feed::Reconnecting(s) => s.acker(),
        }
    }

    fn crash(self) {
        match self {
            Feed::Session { client, .. } => client.crash(),
            Feed::Reconnecting(s) => drop(s),
        }
    }

    async fn close(self, keepalive: bool) -> Result<(), tether::client::ClientError> {
        match self {
            Feed::Session { client, mut events } => {
                events.commit();
                client.close_promptly(keepalive).await
            }
            Feed::Reconnecting(s) => s.close_promptly(keepalive).await,
        }
    }
}

fn print_initial(
    out: &mut Out,
    region: &str,
    policy: ResultPolicy,
    entry: tether::protocol::InitialEntry,
) {
    let value = match policy {
        ResultPolicy::Keys => None,
        _ => entry
            .value
            .map(|v| String::from_utf8_lossy(&v).into_owned()),
    };
    let _ = out.line(&json!({"type":"initial","region":region,"key":entry.key,"value":value}));
}

/// Bytes of lines `tether subscribe` gathers before writing them, whatever comes next.
const OUT_BUFFER_BYTES: usize = 64 * 1024;

/// Events between two looks at the signals while events keep coming without a pause.
const SIGNAL_CHECK_EVENTS: u32 = 1024;

/// The standard output of `tether subscribe`: its lines gathered in one buffer and written
/// with one system call per buffer; event lines formatted straight into it, without an
/// allocation per event (at hundreds of thousands of events a second, building a
/// `serde_json::Value` per event was the subscriber's bottleneck). Events count as processed
/// (and are acked, in the client's manual ack mode) once written, as they did when every
/// line was written at once: a subscriber killed with events in its buffer gets them again.
struct Out {
    buf: Vec<u8>,
    /// The offsets of the events in `buf`, acked once it is written.
    offsets: Vec<u64>,
    acker: Option<Acker>,
}

impl Out {
    fn new() -> Out {
        Out {
            buf: Vec::with_capacity(OUT_BUFFER_BYTES + 4096),
            offsets: Vec::new(),
            acker: None,
        }
    }

    /// One event line: written with the next non-event line, at the next `flush`, or now
    /// when the buffer is full.
    fn event(&mut self, e: &Event) -> std::io::Result<()> {
        event_line(&mut self.buf, e);
        self.offsets.push(e.offset);
        if self.buf.len() >= OUT_BUFFER_BYTES {
            self.flush()
        } else {
            Ok(())
        }
    }

    /// Any other line, written at once after what is buffered.
    fn line(&mut self, v: &Value) -> std::io::Result<()> {
        // As `emit` writes it; writing to a Vec cannot fail.
        let _ = writeln!(self.buf, "{v}");
        self.flush()
    }

    /// Writes what is buffered, then acks its events (the ones of a failed write are not
    /// acked: the server keeps them).
    fn flush(&mut self) -> std::io::Result<()> {
        self.write()?;
        if let Some(a) = &self.acker {
            // Refused only for offsets this process no longer tracks (a queue that expired
            // meanwhile): nothing to ack for them.
            let _ = a.ack_many(&self.offsets);
        }
        self.offsets.clear();
        Ok(())
    }

    /// Writes what is buffered without acking its events (`--crash`: acks are lost as with
    /// a killed process).
    fn write(&mut self) -> std::io::Result<()> {
        if self.buf.is_empty() {
            return Ok(());
        }
        let written = {
            let mut out = std::io::stdout().lock();
            out.write_all(&self.buf).and_then(|()| out.flush())
        };
        self.buf.clear();
        if self.buf.capacity() > 4 * OUT_BUFFER_BYTES {
            // After a huge value: back to the usual size.
            self.buf = Vec::with_capacity(OUT_BUFFER_BYTES + 4096);
        }
        if written.is_err() {
            self.offsets.clear();
        }
        written
    }
}

/// Appends the `event` line of `e` to `buf`: byte for byte the line `emit` printed of
/// `json!({"type":"event","region":…,"key":…,"op":…,"value":…,"offset":…,"event_id":…,
/// "replayed":…,"possible_duplicate":…})` (fields in that order: serde_json keeps insertion
/// order in this build; its string escaping; the value as `String::from_utf8_lossy` reads it,
/// null for destroy and invalidate), without building that value.
fn event_line(buf: &mut Vec<u8>, e: &Event) {
    buf.extend_from_slice(br#"{"type":"event","region":"#);
    json_str(buf, &e.region);
    buf.extend_from_slice(br#","key":"#);
    json_str(buf, &e.key);
    buf.extend_from_slice(br#","op":"#);
    json_str(buf, e.op.as_str());
    buf.extend_from_slice(br#","value":"#);
    match (e.op, &e.value) {
        (EventOp::Create | EventOp::Update, Some(v)) => match std::str::from_utf8(v) {
            Ok(text) => json_str(buf, text),
            Err(_) => json_str(buf, &String::from_utf8_lossy(v)),
        },
        _ => buf.extend_from_slice(b"null"),
    }
    buf.extend_from_slice(br#","offset":"#);
    json_u64(buf, e.offset);
    // The id's text is `NODE-SESSION-SEQ`: the node escaped, the rest is '-' and digits.
    buf.extend_from_slice(br#","event_id":"#);
    json_str(buf, &e.event_id.node);
    buf.pop(); // the closing quote, written again below
    buf.push(b'-');
    json_u64(buf, e.event_id.session);
    buf.push(b'-');
    json_u64(buf, e.event_id.seq);
    buf.extend_from_slice(br#"","replayed":"#);
    json_bool(buf, e.replayed);
    buf.extend_from_slice(br#","possible_duplicate":"#);
    json_bool(buf, e.possible_duplicate);
    buf.extend_from_slice(b"}\n");
}

fn json_bool(buf: &mut Vec<u8>, b: bool) {
    buf.extend_from_slice(if b { b"true".as_slice() } else { b"false" });
}

/// A JSON string, quoted and escaped as serde_json does (through serde_json when there is
/// something to escape; most keys and values have nothing: they are copied as they are).
fn json_str(buf: &mut Vec<u8>, s: &str) {
    if needs_escape(s.as_bytes()) {
        serde_json::to_writer(&mut *buf, s).expect("a string serializes into a Vec");
    } else {
        buf.reserve(s.len() + 2);
        buf.push(b'"');
        buf.extend_from_slice(s.as_bytes());
        buf.push(b'"');
    }
}

/// Whether `bytes` hold a byte a JSON string escapes: a control character (below 0x20), '"'
/// or '\\'. Eight bytes at a time: a byte below `n` (`n` ≤ 0x80) leaves its high bit set in
/// `(x - n·ONES) & !x` (a borrow can mark a byte above it too, never hide one), and a byte
/// equal to `c` is a zero byte of `x ^ c·ONES`.
fn needs_escape(bytes: &[u8]) -> bool {
    const ONES: u64 = 0x0101_0101_0101_0101;
    const HIGH: u64 = 0x8080_8080_8080_8080;
    let below = |x: u64, n: u64| x.wrapping_sub(n * ONES) & !x & HIGH;
    let mut words = bytes.chunks_exact(8);
    for w in &mut words {
        let x = u64::from_le_bytes(w.try_into().expect("eight bytes"));
        let hits = below(x, 0x20)
            | below(x ^ (u64::from(b'"') * ONES), 1)
            | below(x ^ (u64::from(b'\\') * ONES), 1);
        if hits != 0 {
            return true;
        }
    }
    words
        .remainder()
        .iter()
        .any(|&b| b < 0x20 || b == b'"' || b == b'\\')
}

fn json_u64(buf: &mut Vec<u8>, n: u64) {
    serde_json::to_writer(&mut *buf, &n).expect("a number serializes into a Vec");
}

/// Polls `f` once: its output if it is ready now, without waiting (`f` goes on from there
/// when polled again).
async fn poll_once<F: std::future::Future>(mut f: std::pin::Pin<&mut F>) -> Poll<F::Output> {
    std::future::poll_fn(|cx| Poll::Ready(f.as_mut().poll(cx))).await
}

/// Whether `signal` arrived (since the last look), without waiting.
async fn signalled(signal: &mut tokio::signal::unix::Signal) -> bool {
    std::future::poll_fn(|cx| Poll::Ready(signal.poll_recv(cx).is_ready())).await
}

async fn subscribe(a: SubscribeArgs) -> Result<(), Fail> {
    // The arguments' values were checked by the parser.
    let policy: ResultPolicy = a.policy.into();
    let durable = a.durable_id.is_some();
    let keepalive = match a.close {
        None => durable,
        Some(CloseArg::Keepalive) => true,
        Some(CloseArg::Drop) => false,
    };
    let mut builder = client_builder(
        &a.conn,
        a.durable_id.clone().map(|id| (id, a.timeout, a.redundancy)),
        a.ack_interval_ms,
    )?
    // An event is processed once its line is written (`Out`), not once the next is read.
    .ack_mode(AckMode::Manual)
    .replay_rate(a.replay_rate);
    if let Some(ms) = a.failure_timeout_ms {
        builder = builder.failure_timeout(Duration::from_millis(ms));
    }
    let mut interests: Vec<Interest> = a.key.iter().map(Interest::key).collect();
    interests.extend(a.regex.iter().map(Interest::regex));
    if a.all_keys {
        interests.push(Interest::all_keys());
    }
    let interests: Vec<Interest> = interests
        .into_iter()
        .map(|i| {
            i.durable(durable && !a.non_durable)
                .policy(policy)
                .receive_values(!a.no_values)
        })
        .collect();
    // A non-durable client has nothing to replay: with no interest to register it is live at
    // once (with interest, the server's marker follows the registration).
    let announce_live = interests.is_empty() && !durable;
    let mut out = Out::new();
    let connected = |out: &mut Out, c: &Client| {
        let _ = out.line(&json!({
            "type": "connected",
            "durable_id": a.durable_id,
            "queue": c.queue_status().as_str(),
            "pending": c.pending(),
            "primary": c.server_addr().to_string(),
        }));
    };
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    let mut feed = if a.reconnect {
        let give_up = (a.reconnect_max_secs > 0).then(|| Duration::from_secs(a.reconnect_max_secs));
        let mut sub = builder
            .reconnect(ReconnectPolicy {
                give_up_after: give_up,
                ..ReconnectPolicy::default()
            })
            .subscribe(interests.into_iter().map(|i| (a.region.clone(), i)))
            .await?;
        connected(
            &mut out,
            sub.client().expect("a new subscription is connected"),
        );
        for (region, entry) in sub.take_initial() {
            print_initial(&mut out, &region, policy, entry);
        }
        Feed::Reconnecting(sub)
    } else {
        let c = builder.connect().await?;
        connected(&mut out, &c);
        let setup = async {
            let region = c.region(&a.region);
            let events = c.events()?;
            for i in interests {
                for entry in region.register(i).await? {
                    print_initial(&mut out, &a.region, policy, entry);
                }
            }
            if !a.no_ready {
                if a.ready_delay_ms > 0 {
                    tokio::time::sleep(Duration::from_millis(a.ready_delay_ms)).await;
                }
                if durable {
                    c.ready_for_events().await?;
                }
            }
            Ok::<_, Fail>(events)
        }
        .await;
        match setup {
            Ok(events) => Feed::Session { client: c, events },
            Err(e) => {
                // Close (a durable queue is kept, as after a lost connection) rather than
                // leave the connection to the server's idle timeout.
                let _ = c.close_promptly(durable).await;
                return Err(e);
            }
        }
    };
    out.acker = Some(feed.acker()?);
    let idle = a.idle_exit_ms.map(Duration::from_millis);
    let mut printed = 0u64;
    let mut lost = false;
    // Standard output failed: stop, leaving what was not written to the queue.
    let mut broken: Option<std::io::Error> = None;
    let mut done = false;
    if announce_live {
        if let Err(e) = out.line(&json!({"type":"live","region":a.region})) {
            broken = Some(e);
        }
        done = a.exit_on_live;
    }
    if done || broken.is_some() {
        // `--exit-on-live` with nothing to replay: done already.
    } else {
        // Listened for from here on (before, ctrl-c ends the process as usual).
        let mut interrupt =
            tokio::signal::unix::signal(tokio::signal::unix::SignalKind::interrupt())?;
        let mut until_signal_check = SIGNAL_CHECK_EVENTS;
        loop {
            if a.max_events.is_some_and(|m| printed >= m) {
                break;
            }
            if until_signal_check == 0 {
                // Events keep coming without a pause: the signals are looked at all the same.
                until_signal_check = SIGNAL_CHECK_EVENTS;
                if signalled(&mut interrupt).await || signalled(&mut term).await {
                    break;
                }
            }
            let next = feed.next();
            tokio::pin!(next);
            // What is ready now is printed without waiting, into the buffer; when nothing is
            // ready, the buffer is written before waiting: an event reaches standard output
            // as soon as the subscriber has nothing else to do.
            let ev = match poll_once(next.as_mut()).await {
                Poll::Ready(ev) => {
                    until_signal_check -= 1;
                    Some(ev)
                }
                Poll::Pending => {
                    if let Err(e) = out.flush() {
                        broken = Some(e);
                        break;
                    }
                    let wait = async {
                        match idle {
                            Some(d) => tokio::time::timeout(d, next.as_mut()).await.ok(),
                            None => Some(next.as_mut().await),
                        }
                    };
                    tokio::select! {
                        ev = wait => ev,
                        _ = interrupt.recv() => break,
                        _ = term.recv() => break,
                    }
                }
            };
            let written = match ev {
                None => break, // idle timeout
                Some(None) => {
                    lost = true;
                    break;
                }
                Some(Some(ClientEvent::Live { regions })) => {
                    // The marker that ends the replay lists no region when the queue had no
                    // interest: the session is live all the same, for the subscriber's region.
                    let mut written = Ok(());
                    if regions.is_empty() {
                        written = out.line(&json!({"type":"live","region":a.region}));
                    }
                    for region in &regions {
                        written = written
                            .and_then(|()| out.line(&json!({"type":"live","region":region})));
                    }
                    if a.exit_on_live && written.is_ok() {
                        break;
                    }
                    written
                }
                Some(Some(ClientEvent::Disconnected { error })) => {
                    out.line(&json!({"type":"disconnected","error":error}))
                }
                Some(Some(ClientEvent::Reconnected { queue, pending })) => out
                    .line(&json!({"type":"reconnected","queue":queue.as_str(),"pending":pending})),
                Some(Some(ClientEvent::Event(e))) => {
                    printed += 1;
                    out.event(&e)
                }
            };
            if let Err(e) = written {
                broken = Some(e);
                break;
            }
        }
    }
    // Everything printed is written before the process goes on to close or exits.
    let written = if a.crash { out.write() } else { out.flush() };
    if let Err(e) = written {
        broken.get_or_insert(e);
    }
    if a.crash {
        feed.crash();
        return Ok(());
    }
    if lost {
        return Err(feed.lost());
    }
    feed.close(keepalive).await?;
    if let Some(e) = broken {
        return Err(Fail(format!("cannot write to standard output: {e}")));
    }
    let _ = out.line(&json!({"type":"closed","keepalive":keepalive}));
    Ok(())
}

#[cfg(test)]
mod event_line_tests {
    use super::*;
    use proptest::prelude::*;
    use tether::protocol::EventId;

    /// The line `tether subscribe` printed for an event before `event_line`: a `json!` value
    /// per event, printed by `emit`.
    fn old_line(e: &Event) -> String {
        let e = e.clone();
        let value = match e.op {
            EventOp::Create | EventOp::Update => {
                e.value.map(|v| String::from_utf8_lossy(&v).into_owned())
            }
            _ => None,
        };
        let v = json!({
            "type": "event",
            "region": e.region,
            "key": e.key,
            "op": e.op.as_str(),
            "value": value,
            "offset": e.offset,
            "event_id": e.event_id.to_string(),
            "replayed": e.replayed,
            "possible_duplicate": e.possible_duplicate,
        });
        format!("{v}\n")
    }

    fn new_line(e: &Event) -> String {
        let mut buf = Vec::new();
        event_line(&mut buf, e);
        String::from_utf8(buf).expect("UTF-8")
    }

    fn event(
        region: &str,
        key: &str,
        op: EventOp,
        value: Option<&[u8]>,
        node: &str,
        numbers: (u64, u64, u64),
    ) -> Event {
        Event {
            region: region.into(),
            key: key.into(),
            op,
            value: value.map(<[u8]>::to_vec),
            offset: numbers.0,
            event_id: EventId {
                node: node.into(),
                session: numbers.1,
                seq: numbers.2,
            },
            replayed: numbers.0.is_multiple_of(2),
            possible_duplicate: numbers.1.is_multiple_of(3),
        }
    }

    #[test]
    fn the_contract_line() {
        let e = event("R", "K", EventOp::Update, Some(b"V"), "n1", (17, 3, 42));
        let line = new_line(&Event {
            replayed: true,
            possible_duplicate: false,
            ..e
        });
        // docs/cli.md, tether subscribe, line 3.
        assert_eq!(
            line,
            "{\"type\":\"event\",\"region\":\"R\",\"key\":\"K\",\"op\":\"update\",\"value\":\"V\",\"offset\":17,\"event_id\":\"n1-3-42\",\"replayed\":true,\"possible_duplicate\":false}\n"
        );
    }

    #[test]
    fn edge_cases_match_the_old_line() {
        let ops = [
            EventOp::Create,
            EventOp::Update,
            EventOp::Destroy,
            EventOp::Invalidate,
        ];
        let texts = [
            "",
            "\"",
            "\\",
            "\u{0}\u{1}\u{8}\t\n\u{b}\u{c}\r\u{1f}\u{7f}",
            "é€😀\u{2028}\u{2029}",
            "</script>",
        ];
        let values: [Option<&[u8]>; 6] = [
            None,
            Some(b""),
            Some(b"\xff\xfe"),
            Some(b"ok \xc3"),
            Some(b"\xed\xa0\x80 surrogate"),
            Some("\"quoted\"\n".as_bytes()),
        ];
        for op in ops {
            for t in texts {
                for v in values {
                    for numbers in [(0, 0, 0), (u64::MAX, u64::MAX, u64::MAX), (1, 10, 100)] {
                        let e = event(t, t, op, v, t, numbers);
                        assert_eq!(new_line(&e), old_line(&e), "{e:?}");
                    }
                }
            }
        }
    }

    #[test]
    fn needs_escape_finds_every_byte_json_escapes() {
        // Each byte value, at each position of a word and in the tail, among bytes that need
        // no escape (ASCII letters and the bytes of non-ASCII characters).
        for b in 0..=255u8 {
            let want = b < 0x20 || b == b'"' || b == b'\\';
            for len in 1..=19 {
                for at in 0..len {
                    for filler in [b'a', 0x80, 0xff, 0x21] {
                        let mut bytes = vec![filler; len];
                        bytes[at] = b;
                        assert_eq!(needs_escape(&bytes), want, "{b:#x} at {at} of {len}");
                    }
                }
            }
        }
        assert!(!needs_escape(b""));
    }

    fn any_op() -> impl Strategy<Value = EventOp> {
        prop_oneof![
            Just(EventOp::Create),
            Just(EventOp::Update),
            Just(EventOp::Destroy),
            Just(EventOp::Invalidate),
        ]
    }

    /// Values: arbitrary bytes (mostly not UTF-8), and text with escapes and non-ASCII.
    fn any_value() -> impl Strategy<Value = Option<Vec<u8>>> {
        prop_oneof![
            Just(None),
            proptest::collection::vec(any::<u8>(), 0..64).prop_map(Some),
            "[\\x00-\\x7f\"\\\\é😀]{0,40}".prop_map(|s| Some(s.into_bytes())),
            any::<String>().prop_map(|s| Some(s.into_bytes())),
        ]
    }

    /// Text with control characters, quotes and backslashes often, any character sometimes.
    fn any_text() -> impl Strategy<Value = String> {
        prop_oneof!["[\\x00-\\x7f\"\\\\é😀]{0,24}", any::<String>()]
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(4096))]

        #[test]
        fn every_event_line_is_the_old_line(
            region in any_text(),
            key in any_text(),
            op in any_op(),
            value in any_value(),
            node in any_text(),
            offset in any::<u64>(),
            session in any::<u64>(),
            seq in any::<u64>(),
            replayed in any::<bool>(),
            possible_duplicate in any::<bool>(),
        ) {
            let e = Event {
                region,
                key,
                op,
                value,
                offset,
                event_id: EventId { node, session, seq },
                replayed,
                possible_duplicate,
            };
            prop_assert_eq!(new_line(&e), old_line(&e));
        }
    }
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
