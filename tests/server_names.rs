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
