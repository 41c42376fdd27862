//! Servers reached by their real host names: a node whose certificate names only
//! `tether-1.test` (no `localhost`) serves clients that verify that name
//! (`ClientBuilder::server_name`, `--server-name`) and refuses the others with one clear error
//! naming the expected name and the certificate's names. Real node, QUIC+TLS on loopback,
//! RocksDB in a temp dir; the certificate comes from `tether issue-server-cert`.

use std::path::{Path, PathBuf};
use std::process::Command;

use tether::client::{ClientBuilder, ClientError};
use tether::config::{ServerConfig, TlsConfig};
use tether::server::Node;
use tether_transport::tls;

mod common;

/// The host name the node's certificate is issued for (no DNS needed: clients dial the IP).
const HOST: &str = "tether-1.test";

/// Issues a server certificate for [`HOST`] with the CLI from a dev CA in `dir/ca`; returns
/// (cert, key, ca).
fn issue(dir: &Path) -> (PathBuf, PathBuf, PathBuf) {
    let ca_dir = dir.join("ca");
    tls::ensure_dev_certs(&ca_dir.join("tls")).unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_tether"))
        .args(["issue-server-cert", "--name", HOST, "--name", "10.9.8.7"])
        .arg("--data-dir")
        .arg(&ca_dir)
        .arg("--out")
        .arg(dir.join("certs"))
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let line: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(line["type"], "server-cert");
    let path = |k: &str| PathBuf::from(line[k].as_str().unwrap());
    (path("cert"), path("key"), path("ca"))
}

async fn node_with_host_cert(dir: &Path) -> (Node, PathBuf) {
    let (cert, key, ca) = issue(dir);
    let mut cfg = ServerConfig::ephemeral(dir.join("data"));
    cfg.tls = Some(TlsConfig {
        cert,
        key,
        ca: ca.clone(),
    });
    (Node::start(cfg).await.expect("starts"), ca)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_certificate_for_a_real_host_name_is_verified_against_that_name() {
    let dir = tempfile::tempdir().unwrap();
    let (node, ca) = node_with_host_cert(dir.path()).await;
    let c = ClientBuilder::new()
        .server(node.addr())
        .ca_file(&ca)
        .server_name(HOST)
        .connect()
        .await
        .expect("a client verifying the certificate's name connects");
    c.region("R").put("k", b"v".to_vec()).await.unwrap();
    assert_eq!(c.region("R").get("k").await.unwrap(), Some(b"v".to_vec()));
    c.close(false).await.unwrap();
    // Verified against the default name (localhost): refused, saying which name was expected
    // and which the certificate holds, once.
    let e = ClientBuilder::new()
        .server(node.addr())
        .ca_file(&ca)
        .connect()
        .await
        .err()
        .expect("the certificate does not name localhost");
    assert!(matches!(e, ClientError::Connect(_)), "{e:?}");
    let msg = e.to_string();
    assert!(
        msg.contains("\"localhost\"") && msg.contains(HOST) && msg.contains("10.9.8.7"),
        "{msg}"
    );
    assert_eq!(msg.matches("cannot reach any server").count(), 1, "{msg}");
    node.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_cli_verifies_the_name_given_with_server_name() {
    let dir = tempfile::tempdir().unwrap();
    let (node, ca) = node_with_host_cert(dir.path()).await;
    let put = |extra: &[&str]| {
        Command::new(env!("CARGO_BIN_EXE_tether"))
            .args(["put", "--server", &node.addr().to_string(), "--ca"])
            .arg(&ca)
            .args(["--region", "R", "--key", "k", "--value", "v"])
            .args(extra)
            .output()
            .unwrap()
    };
    let ok = put(&["--server-name", HOST]);
    assert!(
        ok.status.success(),
        "{}",
        String::from_utf8_lossy(&ok.stderr)
    );
    let refused = put(&[]);
    assert_eq!(refused.status.code(), Some(1));
    let err = String::from_utf8_lossy(&refused.stderr);
    let lines: Vec<&str> = err.lines().filter(|l| l.starts_with("error:")).collect();
    assert_eq!(lines.len(), 1, "{err}");
    assert!(
        lines[0].contains(HOST) && lines[0].contains("\"localhost\""),
        "{err}"
    );
    assert_eq!(
        lines[0].matches("cannot reach any server").count(),
        1,
        "{err}"
    );
    // A name that does not resolve, and one without a port: each its own clear error.
    let port = node.addr().port();
    for (server, expected) in [
        (
            format!("no-such-host.invalid:{port}"),
            "cannot resolve server",
        ),
        ("no-port.invalid".to_string(), "expected HOST:PORT"),
    ] {
        let out = Command::new(env!("CARGO_BIN_EXE_tether"))
            .args(["put", "--server", &server, "--ca"])
            .arg(&ca)
            .args(["--region", "R", "--key", "k", "--value", "v"])
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            !out.status.success() && err.contains(expected),
            "{server}: {err}"
        );
    }
    node.shutdown().await;
}

/// The certificate of cluster node `cfg`, from the cluster's dev CA: only its own host name
/// `tether-<id>.test` and its node name; no `localhost`, no IP address.
fn own_name_only(cfg: &mut ServerConfig) {
    let id = cfg.node_id.clone().expect("a cluster node");
    let tls_dir = cfg.data_dir.join("tls");
    let (cert, key) = tls::issue_dev_server_cert(
        &tls_dir,
        &[format!("tether-{id}.test")],
        Some(&id),
        &cfg.data_dir.join("named"),
    )
    .unwrap();
    cfg.tls = Some(TlsConfig {
        cert,
        key,
        ca: tls_dir.join(tls::CA_CERT_FILE),
    });
}

/// A three-node cluster whose node certificates carry only their own host names: peers know
/// each other by node name, so the cluster forms; clients verify each node by the name they
/// were given for its address (redirects included); when the primary of a queue with a copy
/// stops, the copy takes over and the client, verifying the new primary's own name, gets
/// every event.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cluster_whose_certificates_name_only_their_own_hosts_forms_and_fails_over() {
    use std::time::Duration;
    use tether::client::{ClientEvent, Interest};
    const EVENTS: u32 = 50;
    let mut c = common::cluster::TestCluster::start_tweaked(3, own_name_only).await;
    c.leader().await;
    let ca = c.dirs[0].path().join("tls").join(tls::CA_CERT_FILE);
    let addrs: Vec<std::net::SocketAddr> = c
        .ports
        .iter()
        .map(|p| format!("127.0.0.1:{p}").parse().unwrap())
        .collect();
    // Every node by its own name; `skip`: a node not to dial first (it is down).
    let builder = |skip: Option<usize>| {
        let mut b = ClientBuilder::new().ca_file(&ca);
        for i in (0..3).filter(|i| Some(*i) != skip) {
            b = b.server_named(addrs[i], format!("tether-n{}.test", i + 1));
        }
        b
    };
    let d = builder(None)
        .durable("d", 600)
        .redundancy(1)
        .connect()
        .await
        .expect("the durable client connects (maybe through a redirect)");
    let primary = c.names.iter().position(|n| n == d.node_id()).unwrap();
    d.region("R").register(Interest::all_keys()).await.unwrap();
    d.ready_for_events().await.unwrap();
    d.close(true).await.unwrap();
    let publisher = builder(None).connect().await.unwrap();
    for i in 0..EVENTS {
        publisher
            .region("R")
            .put(format!("k-{i}"), format!("v-{i}"))
            .await
            .unwrap();
    }
    publisher.close(false).await.unwrap();
    common::eventually("the copy holds every event", || {
        c.node(primary).queues().iter().any(|q| {
            q.durable_id.as_deref() == Some("d")
                && q.end_offset == u64::from(EVENTS)
                && q.copies.len() == 1
                && q.copies[0].lag_entries == 0
        })
    })
    .await;
    c.nodes[primary].take().unwrap().shutdown().await;
    // Through the surviving nodes until one serves the promoted copy.
    let start = std::time::Instant::now();
    let d = loop {
        assert!(start.elapsed() < common::WAIT, "no failover");
        match builder(Some(primary))
            .durable("d", 600)
            .failure_timeout(Duration::from_secs(2))
            .connect()
            .await
        {
            Ok(d) if d.pending() == Some(u64::from(EVENTS)) => break d,
            Ok(d) => d.close(true).await.unwrap(),
            Err(e) => eprintln!("failover attempt: {e}"),
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    assert_ne!(d.node_id(), c.names[primary]);
    let mut events = d.events().unwrap();
    d.ready_for_events().await.unwrap();
    let mut keys = Vec::new();
    loop {
        match tokio::time::timeout(common::WAIT, events.next()).await {
            Ok(Some(ClientEvent::Event(e))) => keys.push(e.key),
            Ok(Some(ClientEvent::Live { .. })) => break,
            other => panic!("stream: {other:?}"),
        }
    }
    let expected: Vec<String> = (0..EVENTS).map(|i| format!("k-{i}")).collect();
    assert_eq!(keys, expected);
    d.close(false).await.unwrap();
    c.shutdown().await;
}

/// `advertise` names go into the dev server certificate, besides localhost and the loopback
/// addresses: a client verifying such a name is served.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_dev_certificate_carries_the_advertised_names() {
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = ServerConfig::ephemeral(dir.path());
    cfg.advertise = vec!["tether-7.test".into()];
    let node = Node::start(cfg).await.unwrap();
    for name in ["tether-7.test", "localhost", "127.0.0.1"] {
        let c = ClientBuilder::new()
            .server(node.addr())
            .ca_file(node.ca_file())
            .server_name(name)
            .connect()
            .await
            .unwrap_or_else(|e| panic!("{name}: {e}"));
        c.close(false).await.unwrap();
    }
    let err = ClientBuilder::new()
        .server(node.addr())
        .ca_file(node.ca_file())
        .server_name("tether-8.test")
        .connect()
        .await
        .err()
        .expect("a name the certificate does not carry is refused");
    assert!(err.to_string().contains("tether-8.test"), "{err}");
    node.shutdown().await;
}

/// Members listed by host name (`localhost:PORT` here: a name every machine resolves): peers
/// resolve and dial it, so the cluster forms, and a client coming through a node that does not
/// hold its queue is redirected by that name, resolves it and is served by the queue's primary.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn members_listed_by_host_name_are_dialed_and_redirected_to_by_that_name() {
    fn by_host_name(cfg: &mut ServerConfig) {
        for (_, addr) in cfg.peers.iter_mut() {
            *addr = addr.replace("127.0.0.1", "localhost");
        }
    }
    let c = common::cluster::TestCluster::start_tweaked(3, by_host_name).await;
    c.leader().await;
    let members = &c.node(0).cluster().expect("clustered").members().nodes;
    assert!(
        members
            .values()
            .filter(|n| n.name != "n1")
            .all(|n| n.addr.starts_with("localhost:")),
        "{members:?}"
    );
    let via = |i: usize| {
        ClientBuilder::new()
            .server(c.node(i).addr())
            .ca_file(c.node(i).ca_file())
    };
    let d = via(0).durable("h", 300).connect().await.unwrap();
    let primary = c.names.iter().position(|n| n == d.node_id()).unwrap();
    d.close(true).await.unwrap();
    let other = (0..3).find(|&i| i != primary).unwrap();
    let d = via(other).durable("h", 300).connect().await.unwrap();
    assert_eq!(d.node_id(), c.names[primary], "redirected to the primary");
    assert_eq!(d.server_addr().port(), c.ports[primary]);
    assert!(d.server_addr().ip().is_loopback());
    d.close(false).await.unwrap();
    c.shutdown().await;
}

/// A server that speaks no version of the Tether protocol the client does (another ALPN: a
/// newer server, or not Tether) refuses the handshake (TLS alert 120), and the client says
/// so, naming the version it speaks, instead of a bare TLS error.
#[tokio::test]
async fn a_server_speaking_no_common_protocol_version_is_refused_with_a_clear_error() {
    use rustls::pki_types::pem::PemObject;
    use rustls::pki_types::{CertificateDer, PrivateKeyDer};
    use std::sync::Arc;
    tls::install_crypto_provider();
    let dir = tempfile::tempdir().unwrap();
    let files = tls::ensure_dev_certs(dir.path()).unwrap();
    let certs: Vec<CertificateDer<'static>> = CertificateDer::pem_file_iter(&files.cert)
        .unwrap()
        .map(|c| c.unwrap())
        .collect();
    let key = PrivateKeyDer::from_pem_file(&files.key).unwrap();
    let mut server_tls = rustls::ServerConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_protocol_versions(&[&rustls::version::TLS13])
    .unwrap()
    .with_no_client_auth()
    .with_single_cert(certs, key)
    .unwrap();
    server_tls.alpn_protocols = vec![b"tether/99".to_vec()];
    let quic = quinn::crypto::rustls::QuicServerConfig::try_from(server_tls).unwrap();
    let server = tether_transport::endpoint::server_endpoint(
        "127.0.0.1:0".parse().unwrap(),
        quinn::ServerConfig::with_crypto(Arc::new(quic)),
    )
    .unwrap();
    let addr = server.local_addr().unwrap();
    tokio::spawn(async move {
        while let Some(incoming) = server.accept().await {
            let _ = incoming.await;
        }
    });
    let err = ClientBuilder::new()
        .server(addr)
        .ca_file(&files.ca)
        .connect()
        .await
        .err()
        .expect("no protocol version in common");
    let message = err.to_string();
    assert!(matches!(err, ClientError::Connect(_)), "{err:?}");
    assert!(
        message.contains("the server speaks no version of the Tether protocol this client does")
            && message.contains(&String::from_utf8_lossy(tether_transport::ALPN).into_owned()),
        "{message}"
    );
}
