//! The `tether` command line: server, publishers, subscribers and admin.
//! Its names, flags and JSON fields are a public contract (`docs/cli.md`).

use std::io::Write;
use std::net::{SocketAddr, ToSocketAddrs};
use std::path::{Path, PathBuf};
use std::time::Duration;

use clap::{Args, Parser, Subcommand};
use serde_json::{Value, json};
use tether::client::{
    Client, ClientBuilder, ClientEvent, EventStream, Interest, ReconnectPolicy, Subscription,
};
use tether::config::{
    FileConfig, ServerConfig, SyncMode, parse_addr, parse_metrics, parse_peer, validate_node_id,
};
use tether::limits::{DURABLE_TIMEOUT_SECS_DEFAULT, PUBLISH_OPS_PER_REQUEST_MAX};
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
    about = "Durable client messaging over QUIC, with queues in RocksDB"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run a server node.
    Server(ServerArgs),
    /// Put one key, or N keys in order.
    Put(PutArgs),
    /// Destroy a key.
    Destroy(KeyArgs),
    /// Print the current value of a key.
    Get(KeyArgs),
    /// Connect, register interest and print events as JSON lines.
    Subscribe(SubscribeArgs),
    /// List the subscription queues of the contacted node.
    Queues(Conn),
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
        #[arg(long, conflicts_with = "token")]
        token_file: Option<PathBuf>,
    },
    /// Create (if missing) a data directory's dev CA and server certificate, without starting
    /// a server: copy its tls/ca.pem and tls/ca.key to other nodes' data directories to make
    /// them one cluster.
    DevCa {
        /// The data directory (certificates go to <data-dir>/tls).
        #[arg(long, default_value = "data")]
        data_dir: PathBuf,
    },
    /// Issue a client certificate signed by a data directory's dev CA (for mutual TLS; the
    /// common name is the principal).
    IssueClientCert {
        /// The principal (certificate common name).
        #[arg(long)]
        name: String,
        /// The data directory whose tls/ca.pem and tls/ca.key sign it.
        #[arg(long, default_value = "data")]
        data_dir: PathBuf,
        /// Where to write <name>.pem and <name>.key.
        #[arg(long, default_value = ".")]
        out: PathBuf,
    },
    /// Issue a server certificate signed by a data directory's dev CA for the host names or IP
    /// addresses clients and peers reach a node by (set it with [tls] cert/key/ca).
    IssueServerCert {
        /// A host name or IP address the certificate is valid for (repeat for more; the first
        /// names the files).
        #[arg(long = "name", required = true)]
        names: Vec<String>,
        /// The cluster node the certificate belongs to (its --node-id), for a cluster node.
        #[arg(long)]
        node_id: Option<String>,
        /// The data directory whose tls/ca.pem and tls/ca.key sign it.
        #[arg(long, default_value = "data")]
        data_dir: PathBuf,
        /// Where to write <name>.pem and <name>.key.
        #[arg(long, default_value = ".")]
        out: PathBuf,
    },
    /// Revoke a client certificate: add it to a certificate revocation list signed by a data
    /// directory's dev CA. A node whose `[auth] client-crl` names the list reloads it within a
    /// second, refuses the certificate and closes the connections using it.
    RevokeClientCert {
        /// The client certificate (PEM) to revoke.
        #[arg(long)]
        cert: PathBuf,
        /// The data directory whose tls/ca.pem and tls/ca.key issued it and sign the list.
        #[arg(long, default_value = "data")]
        data_dir: PathBuf,
        /// The revocation list to update, created when missing (default
        /// <data-dir>/tls/client-crl.pem).
        #[arg(long)]
        crl: Option<PathBuf>,
    },
}

#[derive(Args)]
struct ServerArgs {
    /// Where RocksDB, TLS material and the node id live.
    #[arg(long)]
    data_dir: Option<PathBuf>,
    /// A host name or IP address clients reach this node by (repeatable): the dev server
    /// certificate carries it, besides localhost, 127.0.0.1, ::1 and the machine's host name.
    #[arg(long, value_name = "NAME")]
    advertise: Vec<String>,
    /// QUIC address for clients and peers; port 0 picks a free port.
    #[arg(long)]
    listen: Option<String>,
    /// Prometheus address (/metrics); port 0 picks a free port; `off` disables.
    #[arg(long)]
    metrics: Option<String>,
    /// This node's id (default: generated once, kept in the data dir).
    #[arg(long)]
    node_id: Option<String>,
    /// TOML file with the same settings; flags win over the file. Its `[auth]` table (tokens,
    /// admins, ACLs) is read again whenever the file changes.
    #[arg(long)]
    config: Option<PathBuf>,
    /// always, batch (fsync once per group commit) or none.
    #[arg(long)]
    sync: Option<String>,
    /// Entries a subscription queue may hold beyond its acked offset.
    #[arg(long)]
    queue_entries_max: Option<u64>,
    /// Bytes of stored events a subscription queue may hold beyond its acked offset.
    #[arg(long)]
    queue_bytes_max: Option<u64>,
    /// What a publish to a full queue does: block, reject or drop-queue.
    #[arg(long)]
    queue_full_policy: Option<String>,
    /// A cluster member as ID=ADDR (repeatable; may include this node). Replaces the
    /// file's `[cluster] peers`. Needs --node-id.
    #[arg(long = "peer", value_name = "ID=ADDR")]
    peers: Vec<String>,
}

#[derive(Args, Clone)]
struct Conn {
    /// Nodes to contact, comma-separated.
    #[arg(long, default_value = "127.0.0.1:7400")]
    server: String,
    /// CA certificate to trust (default data/tls/ca.pem when it exists).
    #[arg(long)]
    ca: Option<PathBuf>,
    /// Bearer token for servers that authenticate clients (also TETHER_TOKEN).
    #[arg(long, env = "TETHER_TOKEN", hide_env_values = true)]
    token: Option<String>,
    /// Client certificate (PEM) for servers that authenticate clients by certificate; the
    /// file may also hold the private key.
    #[arg(long)]
    cert: Option<PathBuf>,
    /// Private key (PEM) of --cert, when it is not in the --cert file. (`--key` is the
    /// region key in every command, so the certificate's key has this name.)
    #[arg(long, requires = "cert")]
    cert_key: Option<PathBuf>,
    /// The name the servers' certificates must be valid for. Default: the host of the first
    /// --server entry when it is a name (not an IP address), else localhost (the name of the
    /// dev certificates).
    #[arg(long)]
    server_name: Option<String>,
}

#[derive(Args)]
struct KeyArgs {
    #[command(flatten)]
    conn: Conn,
    #[arg(long)]
    region: String,
    #[arg(long)]
    key: String,
}

#[derive(Args)]
struct PutArgs {
    #[command(flatten)]
    conn: Conn,
    #[arg(long)]
    region: String,
    /// The key of a single put.
    #[arg(long, conflicts_with_all = ["count", "key_prefix", "keys", "size"])]
    key: Option<String>,
    /// The value of a single put (UTF-8 text).
    #[arg(long, requires = "key")]
    value: Option<String>,
    /// Number of puts.
    #[arg(long)]
    count: Option<u64>,
    /// When the server acknowledges: `local` (committed on the contacted node) or `replicated`
    /// (every matching queue and its copies hold the events).
    #[arg(long, default_value = "local")]
    ack: String,
    /// Key prefix for --count.
    #[arg(long, default_value = "key-")]
    key_prefix: String,
    /// Number of distinct keys for --count (default: --count).
    #[arg(long)]
    keys: Option<u64>,
    /// Value size in bytes for --count (default: the text value-i).
    #[arg(long)]
    size: Option<usize>,
}

#[derive(Args)]
struct SubscribeArgs {
    #[command(flatten)]
    conn: Conn,
    #[arg(long)]
    region: String,
    #[arg(long)]
    durable_id: Option<String>,
    #[arg(long, default_value_t = DURABLE_TIMEOUT_SECS_DEFAULT)]
    timeout: u64,
    /// Secondary copies of the durable queue on a cluster (0 to 2).
    #[arg(long, default_value_t = 0)]
    redundancy: u8,
    #[arg(long)]
    key: Vec<String>,
    #[arg(long)]
    regex: Vec<String>,
    #[arg(long)]
    all_keys: bool,
    #[arg(long)]
    non_durable: bool,
    #[arg(long, default_value = "keys-values")]
    policy: String,
    #[arg(long)]
    no_values: bool,
    #[arg(long)]
    no_ready: bool,
    #[arg(long, default_value_t = 0)]
    ready_delay_ms: u64,
    #[arg(long)]
    max_events: Option<u64>,
    #[arg(long)]
    exit_on_live: bool,
    #[arg(long)]
    idle_exit_ms: Option<u64>,
    /// keepalive or drop.
    #[arg(long)]
    close: Option<String>,
    #[arg(long)]
    crash: bool,
    #[arg(long, default_value_t = 100)]
    ack_interval_ms: u64,
    /// Reconnect by itself when the connection is lost (with backoff, across every server it
    /// knows), resuming the durable queue and registering the interest again. Default: exit.
    #[arg(long, conflicts_with_all = ["no_ready", "ready_delay_ms"])]
    reconnect: bool,
    /// With --reconnect: give up after this many seconds without a connection (0: never).
    #[arg(long, default_value_t = tether::client::RECONNECT_GIVE_UP_SECS_DEFAULT, requires = "reconnect")]
    reconnect_max_secs: u64,
    /// How long the server may stay silent before the connection counts as lost, in
    /// milliseconds (the QUIC idle timeout). Default 30000.
    #[arg(long)]
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
    // Allocator settings first, before threads and the first large allocations.
    #[cfg(not(feature = "system-alloc"))]
    mimalloc_options::tune();
    tether::heap::tune_native_heap();
    let cli = match Cli::try_parse() {
        Ok(c) => c,
        Err(e) => {
            use clap::error::ErrorKind;
            if matches!(
                e.kind(),
                ErrorKind::DisplayHelp
                    | ErrorKind::DisplayVersion
                    | ErrorKind::DisplayHelpOnMissingArgumentOrSubcommand
            ) {
                let _ = e.print();
                std::process::exit(
                    if e.kind() == ErrorKind::DisplayHelpOnMissingArgumentOrSubcommand {
                        2
                    } else {
                        0
                    },
                );
            }
            let text = e.render().to_string();
            let first = text
                .lines()
                .next()
                .unwrap_or("invalid arguments")
                .trim_start_matches("error: ");
            eprintln!("error: {first} (see tether --help)");
            std::process::exit(2);
        }
    };
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "warn".into()),
        )
        .with_writer(std::io::stderr)
        .init();
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
    let result = runtime.block_on(run(cli.command));
    let code = match result {
        Ok(()) => 0,
        Err(Fail(msg)) => {
            eprintln!("error: {}", msg.lines().collect::<Vec<_>>().join("; "));
            1
        }
    };
    // Do not wait for stray tasks (a crashed subscriber's connection, say).
    runtime.shutdown_timeout(Duration::from_millis(100));
    std::process::exit(code);
}

async fn run(cmd: Command) -> Result<(), Fail> {
    match cmd {
        Command::Server(a) => server(a).await,
        Command::Put(a) => put(a).await,
        Command::Destroy(a) => {
            let c = connect(&a.conn, None, 100).await?;
            let n = c.region(&a.region).destroy(a.key).await.map(|_| 1)?;
            emit(json!({"type":"published","count":n}));
            c.close(false).await?;
            Ok(())
        }
        Command::Get(a) => {
            let c = connect(&a.conn, None, 100).await?;
            let v = c.region(&a.region).get(a.key.clone()).await?;
            emit(
                json!({"type":"value","region":a.region,"key":a.key,"value":v.map(|v| String::from_utf8_lossy(&v).into_owned())}),
            );
            c.close(false).await?;
            Ok(())
        }
        Command::Subscribe(a) => subscribe(a).await,
        Command::Queues(conn) => {
            let c = connect(&conn, None, 100).await?;
            for q in c.queues().await? {
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
                emit(line);
            }
            c.close(false).await?;
            Ok(())
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
            if name.is_empty()
                || !name
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || "-_.@".contains(c))
            {
                return Err(Fail(format!(
                    "invalid name {name:?}: use letters, digits, '-', '_', '.', '@'"
                )));
            }
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
            for n in &names {
                let ok = !n.is_empty()
                    && n.chars()
                        .all(|c| c.is_ascii_alphanumeric() || "-.:".contains(c));
                if !ok {
                    return Err(Fail(format!(
                        "invalid name {n:?}: a host name or an IP address"
                    )));
                }
            }
            if let Some(id) = &node_id {
                validate_node_id(id)?;
            }
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
            c.close_durable(&id).await?;
            emit(json!({"type":"closed-durable","durable_id":id}));
            c.close(false).await?;
            Ok(())
        }
    }
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

async fn server(a: ServerArgs) -> Result<(), Fail> {
    let file = match &a.config {
        Some(p) => FileConfig::load(p)?,
        None => FileConfig::default(),
    };
    let mut cfg = ServerConfig::default();
    if let Some(d) = a.data_dir.or(file.data_dir) {
        cfg.data_dir = d;
    }
    if let Some(l) = a.listen.or(file.listen) {
        cfg.listen = parse_addr("listen", &l)?;
    }
    if let Some(m) = a.metrics.or(file.metrics) {
        cfg.metrics = parse_metrics(&m)?;
    }
    if let Some(id) = a.node_id.or(file.node_id) {
        validate_node_id(&id)?;
        cfg.node_id = Some(id);
    }
    cfg.advertise = if a.advertise.is_empty() {
        file.advertise.clone().unwrap_or_default()
    } else {
        a.advertise.clone()
    };
    for name in &cfg.advertise {
        tether::config::validate_advertise(name)?;
    }
    cfg.sync = match a.sync {
        Some(s) => s.parse::<SyncMode>()?,
        None => file.sync.unwrap_or_default(),
    };
    cfg.tls = file.tls;
    cfg.limits = file.limits.unwrap_or_default();
    if let Some(n) = a.queue_bytes_max {
        cfg.limits.queue_bytes_max = n;
    }
    if let Some(n) = a.queue_entries_max {
        cfg.limits.queue_entries_max = n;
    }
    if let Some(p) = a.queue_full_policy {
        cfg.limits.queue_full_policy = p.parse()?;
    }
    cfg.limits.validate()?;
    cfg.auth = file.auth;
    // Its [auth] table is read again when the file changes (tokens, admins, ACLs).
    cfg.auth_file = a.config.clone().filter(|_| cfg.auth.is_some());
    let cluster_file = file.cluster.unwrap_or_default();
    if let Some(r) = cluster_file.rebalance {
        cfg.rebalance = r;
    }
    if let Some(ms) = cluster_file.node_failure_ms {
        tether::config::validate_node_failure_ms(ms)?;
        cfg.node_failure_ms = ms;
    }
    let peers = if a.peers.is_empty() {
        cluster_file.peers
    } else {
        a.peers
    };
    cfg.peers = peers
        .iter()
        .map(|p| parse_peer(p))
        .collect::<Result<_, _>>()?;
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
    let ack = match a.ack.as_str() {
        "local" => PublishAck::Local,
        "replicated" => PublishAck::Replicated,
        other => {
            return Err(Fail(format!(
                "invalid --ack {other:?} (expected local or replicated)"
            )));
        }
    };
    let c = connect(&a.conn, None, 100).await?;
    let count = match (&a.key, a.count) {
        (Some(k), None) => {
            let v = a
                .value
                .clone()
                .ok_or_else(|| Fail("--key needs --value".into()))?;
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
            let m = a.keys.unwrap_or(n);
            if m == 0 && n > 0 {
                return Err(Fail("--keys must be at least 1".into()));
            }
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
    c.close(false).await?;
    Ok(())
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
                client.close(keepalive).await
            }
            Feed::Reconnecting(s) => s.close(keepalive).await,
        }
    }
}

fn print_initial(region: &str, policy: ResultPolicy, entry: tether::protocol::InitialEntry) {
    let value = match policy {
        ResultPolicy::Keys => None,
        _ => entry
            .value
            .map(|v| String::from_utf8_lossy(&v).into_owned()),
    };
    emit(json!({"type":"initial","region":region,"key":entry.key,"value":value}));
}

async fn subscribe(a: SubscribeArgs) -> Result<(), Fail> {
    let policy: ResultPolicy = a.policy.parse()?;
    let durable = a.durable_id.is_some();
    let keepalive = match a.close.as_deref() {
        None => durable,
        Some("keepalive") => true,
        Some("drop") => false,
        Some(other) => {
            return Err(Fail(format!(
                "invalid --close {other:?} (expected keepalive or drop)"
            )));
        }
    };
    if a.ack_interval_ms == 0 {
        return Err(Fail("--ack-interval-ms must be at least 1".into()));
    }
    if a.redundancy > tether::cluster::meta::REDUNDANCY_MAX {
        return Err(Fail(format!(
            "--redundancy {} is above the limit of {}",
            a.redundancy,
            tether::cluster::meta::REDUNDANCY_MAX
        )));
    }
    let mut builder = client_builder(
        &a.conn,
        a.durable_id.clone().map(|id| (id, a.timeout, a.redundancy)),
        a.ack_interval_ms,
    )?;
    if let Some(ms) = a.failure_timeout_ms {
        if !(FAILURE_TIMEOUT_MS_MIN..=FAILURE_TIMEOUT_MS_MAX).contains(&ms) {
            return Err(Fail(format!(
                "--failure-timeout-ms {ms} is outside {FAILURE_TIMEOUT_MS_MIN} to {FAILURE_TIMEOUT_MS_MAX}"
            )));
        }
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
    let connected = |c: &Client| {
        emit(json!({
            "type": "connected",
            "durable_id": a.durable_id,
            "queue": c.queue_status().as_str(),
            "pending": c.pending(),
            "primary": c.server_addr().to_string(),
        }));
    };
    let mut feed = if a.reconnect {
        let give_up = (a.reconnect_max_secs > 0).then(|| Duration::from_secs(a.reconnect_max_secs));
        let mut sub = builder
            .reconnect(ReconnectPolicy {
                give_up_after: give_up,
                ..ReconnectPolicy::default()
            })
            .subscribe(interests.into_iter().map(|i| (a.region.clone(), i)))
            .await?;
        connected(sub.client().expect("a new subscription is connected"));
        for (region, entry) in sub.take_initial() {
            print_initial(&region, policy, entry);
        }
        Feed::Reconnecting(sub)
    } else {
        let c = builder.connect().await?;
        connected(&c);
        let region = c.region(&a.region);
        let events = c.events()?;
        for i in interests {
            for entry in region.register(i).await? {
                print_initial(&a.region, policy, entry);
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
        Feed::Session { client: c, events }
    };
    let idle = a.idle_exit_ms.map(Duration::from_millis);
    let mut printed = 0u64;
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    let mut lost = false;
    let mut done = false;
    if announce_live {
        emit(json!({"type":"live","region":a.region}));
        done = a.exit_on_live;
    }
    if done {
        // `--exit-on-live` with nothing to replay: done already.
    } else {
        loop {
            if a.max_events.is_some_and(|m| printed >= m) {
                break;
            }
            let next = async {
                match idle {
                    Some(d) => tokio::time::timeout(d, feed.next()).await.ok(),
                    None => Some(feed.next().await),
                }
            };
            let ev = tokio::select! {
                ev = next => ev,
                _ = tokio::signal::ctrl_c() => break,
                _ = term.recv() => break,
            };
            match ev {
                None => break, // idle timeout
                Some(None) => {
                    lost = true;
                    break;
                }
                Some(Some(ClientEvent::Live { regions })) => {
                    // The marker that ends the replay lists no region when the queue had no
                    // interest: the session is live all the same, for the subscriber's region.
                    if regions.is_empty() {
                        emit(json!({"type":"live","region":a.region}));
                    }
                    for region in &regions {
                        emit(json!({"type":"live","region":region}));
                    }
                    if a.exit_on_live {
                        break;
                    }
                }
                Some(Some(ClientEvent::Disconnected { error })) => {
                    emit(json!({"type":"disconnected","error":error}));
                }
                Some(Some(ClientEvent::Reconnected { queue, pending })) => {
                    emit(json!({"type":"reconnected","queue":queue.as_str(),"pending":pending}));
                }
                Some(Some(ClientEvent::Event(e))) => {
                    let value = match e.op {
                        EventOp::Create | EventOp::Update => {
                            e.value.map(|v| String::from_utf8_lossy(&v).into_owned())
                        }
                        _ => None,
                    };
                    emit(json!({
                        "type": "event",
                        "region": e.region,
                        "key": e.key,
                        "op": e.op.as_str(),
                        "value": value,
                        "offset": e.offset,
                        "event_id": e.event_id.to_string(),
                        "replayed": e.replayed,
                        "possible_duplicate": e.possible_duplicate,
                    }));
                    printed += 1;
                }
            }
        }
    }
    if a.crash {
        feed.crash();
        return Ok(());
    }
    if lost {
        return Err(feed.lost());
    }
    feed.close(keepalive).await?;
    emit(json!({"type":"closed","keepalive":keepalive}));
    Ok(())
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
