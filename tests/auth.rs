//! Authentication and authorization on a real node: tokens, durable-id ownership, region ACLs,
//! the admin role, and the errors a user sees for each refusal.

mod common;

use common::*;
use tether::auth::{AclEntry, AuthConfig, TokenEntry, hash_token};
use tether::client::{ClientError, Interest};
use tether::protocol::{ErrorCode, QueueStatus};

fn auth() -> AuthConfig {
    let token = |principal: &str, secret: &str| TokenEntry {
        principal: principal.into(),
        sha256: hash_token(secret),
    };
    AuthConfig {
        client_ca: None,
        client_crl: None,
        admins: vec!["ops".into()],
        tokens: vec![
            token("alice", "alice-secret"),
            token("bob", "bob-secret"),
            token("ops", "ops-secret"),
        ],
        acl: vec![
            AclEntry {
                principal: "alice".into(),
                publish: vec!["fx-*".into()],
                subscribe: vec!["fx-*".into()],
            },
            AclEntry {
                principal: "bob".into(),
                publish: vec![],
                subscribe: vec!["fx-*".into()],
            },
        ],
    }
}

fn refusal(err: ClientError) -> tether::protocol::WireError {
    match err {
        ClientError::Server(e) => e,
        other => panic!("expected a refusal from the server, got {other:?}"),
    }
}

#[tokio::test]
async fn connections_need_a_known_token() {
    let n = TestNode::start_auth(auth()).await;
    let e = refusal(n.builder().connect().await.err().expect("no token"));
    assert_eq!(e.code, ErrorCode::Unauthenticated);
    assert!(e.message.contains("requires a token"), "{}", e.message);
    let e = refusal(
        n.builder()
            .token("guess")
            .connect()
            .await
            .err()
            .expect("bad token"),
    );
    assert_eq!(
        (e.code, e.message.as_str()),
        (ErrorCode::Unauthenticated, "unknown token")
    );
    n.builder()
        .token("alice-secret")
        .connect()
        .await
        .expect("a known token")
        .close(false)
        .await
        .unwrap();
}

/// Issue 22 point 4: the queues of one principal hold at most REGEXES_PER_PRINCIPAL_MAX
/// distinct interest regexes between them (a non-durable client's count too), so one
/// principal cannot take a region's whole room; another principal keeps its own, and the
/// room comes back when the client holding them goes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_principals_interest_regexes_are_bounded() {
    use tether::limits::REGEXES_PER_PRINCIPAL_MAX as MAX;
    let n = TestNode::start_auth(auth()).await;
    let regex = |n: usize| Interest::regex(format!("k{n}-[0-9]+"));
    let alice = n.builder().token("alice-secret").connect().await.unwrap();
    for i in 0..MAX {
        alice.region("fx-a").register(regex(i)).await.unwrap();
    }
    let e = refusal(alice.region("fx-a").register(regex(MAX)).await.unwrap_err());
    assert_eq!(e.code, ErrorCode::LimitExceeded, "{e:?}");
    assert!(e.message.contains("principal \"alice\""), "{e:?}");
    // Another of her clients shares her room.
    let alice2 = n.builder().token("alice-secret").connect().await.unwrap();
    let e = refusal(alice2.region("fx-b").register(regex(0)).await.unwrap_err());
    assert_eq!(e.code, ErrorCode::LimitExceeded, "{e:?}");
    let bob = n.builder().token("bob-secret").connect().await.unwrap();
    bob.region("fx-a").register(regex(MAX)).await.unwrap();
    alice.close(false).await.unwrap();
    alice2.region("fx-b").register(regex(0)).await.unwrap();
}

#[tokio::test]
async fn a_durable_id_belongs_to_its_creator() {
    let n = TestNode::start_auth(auth()).await;
    let a = n
        .builder()
        .token("alice-secret")
        .durable("dash", 600)
        .connect()
        .await
        .unwrap();
    a.region("fx-eur")
        .register(Interest::all_keys())
        .await
        .unwrap();
    a.close(true).await.unwrap();
    let e = refusal(
        n.builder()
            .token("bob-secret")
            .durable("dash", 600)
            .connect()
            .await
            .err()
            .expect("not bob's"),
    );
    assert_eq!(e.code, ErrorCode::Forbidden);
    assert!(
        e.message.contains("belongs to another principal"),
        "{}",
        e.message
    );
    // Not even while alice is connected (no liveness probe for a stranger).
    let a = n
        .builder()
        .token("alice-secret")
        .durable("dash", 600)
        .connect()
        .await
        .unwrap();
    assert_eq!(a.queue_status(), QueueStatus::Resumed);
    let e = refusal(
        n.builder()
            .token("bob-secret")
            .durable("dash", 600)
            .connect()
            .await
            .err()
            .unwrap(),
    );
    assert_eq!(e.code, ErrorCode::Forbidden);
    a.close(true).await.unwrap();
    // Ownership survives a restart.
    let mut n = n;
    n.restart().await;
    let e = refusal(
        n.builder()
            .token("bob-secret")
            .durable("dash", 600)
            .connect()
            .await
            .err()
            .unwrap(),
    );
    assert_eq!(e.code, ErrorCode::Forbidden);
    let a = n
        .builder()
        .token("alice-secret")
        .durable("dash", 600)
        .connect()
        .await
        .unwrap();
    assert_eq!(a.queue_status(), QueueStatus::Resumed);
}

#[tokio::test]
async fn region_acls_gate_publish_subscribe_and_get() {
    let n = TestNode::start_auth(auth()).await;
    let bob = n.builder().token("bob-secret").connect().await.unwrap();
    let e = refusal(bob.region("fx-eur").put("k", "v").await.unwrap_err());
    assert_eq!(e.code, ErrorCode::Forbidden);
    assert!(
        e.message
            .contains("bob may not publish to region \"fx-eur\""),
        "{}",
        e.message
    );
    bob.region("fx-eur")
        .register(Interest::all_keys())
        .await
        .expect("bob may subscribe to fx-*");
    let e = refusal(
        bob.region("secret")
            .register(Interest::all_keys())
            .await
            .unwrap_err(),
    );
    assert!(e.message.contains("may not subscribe"), "{}", e.message);
    let e = refusal(bob.region("secret").get("k").await.unwrap_err());
    assert_eq!(e.code, ErrorCode::Forbidden);
    // The connection stays usable after a refusal, and what is allowed works end to end.
    let alice = n.builder().token("alice-secret").connect().await.unwrap();
    alice.region("fx-eur").put("k", "v").await.unwrap();
    let e = refusal(alice.region("rates").put("k", "v").await.unwrap_err());
    assert_eq!(e.code, ErrorCode::Forbidden);
    assert_eq!(
        n.node().get("rates", "k").unwrap(),
        None,
        "a refused publish changes nothing"
    );
    assert_eq!(
        bob.region("fx-eur").get("k").await.unwrap().as_deref(),
        Some(&b"v"[..])
    );
}

#[tokio::test]
async fn admin_commands_need_the_admin_role() {
    let n = TestNode::start_auth(auth()).await;
    let a = n
        .builder()
        .token("alice-secret")
        .durable("dash", 600)
        .connect()
        .await
        .unwrap();
    a.close(true).await.unwrap();
    let alice = n.builder().token("alice-secret").connect().await.unwrap();
    assert_eq!(
        refusal(alice.queues().await.unwrap_err()).code,
        ErrorCode::Forbidden
    );
    let e = refusal(alice.close_durable("dash").await.unwrap_err());
    assert_eq!(e.code, ErrorCode::Forbidden);
    assert!(e.message.contains("alice is not an admin"), "{}", e.message);
    let e = refusal(alice.drain("n1", Some(true)).await.unwrap_err());
    assert_eq!(e.code, ErrorCode::Forbidden);
    let e = refusal(alice.remove_node("n1").await.unwrap_err());
    assert_eq!(e.code, ErrorCode::Forbidden);
    let e = refusal(alice.add_node("n4", "127.0.0.1:7400").await.unwrap_err());
    assert_eq!(e.code, ErrorCode::Forbidden);
    let ops = n.builder().token("ops-secret").connect().await.unwrap();
    // Allowed, and refused for what it is: this node is no cluster member.
    let e = refusal(ops.drain("n1", Some(true)).await.unwrap_err());
    assert_eq!(e.code, ErrorCode::InvalidArgument, "{}", e.message);
    let e = refusal(ops.remove_node("n1").await.unwrap_err());
    assert_eq!(e.code, ErrorCode::InvalidArgument, "{}", e.message);
    let e = refusal(ops.add_node("n4", "127.0.0.1:7400").await.unwrap_err());
    assert_eq!(e.code, ErrorCode::InvalidArgument, "{}", e.message);
    assert_eq!(ops.queues().await.unwrap().len(), 1);
    ops.close_durable("dash").await.unwrap();
    assert!(ops.queues().await.unwrap().is_empty());
}

/// The command line: `hash-token` prints what the `[auth]` table stores; `--token` (or
/// TETHER_TOKEN) authenticates; a refusal is one `error:` line naming the reason; `tether server
/// --config FILE` reloads the file's `[auth]` table when it changes.
#[test]
fn cli_tokens_and_refusals() {
    use std::io::{BufRead, BufReader};
    use std::process::{Command, Stdio};
    let bin = env!("CARGO_BIN_EXE_tether");
    let out = Command::new(bin)
        .args(["hash-token", "alice-secret"])
        .output()
        .unwrap();
    let line: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(line["type"], "token-hash");
    assert_eq!(line["sha256"], hash_token("alice-secret"));
    // Kept off the command line: from standard input (one trailing newline removed) or a file.
    let mut hashing = Command::new(bin)
        .arg("hash-token")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    std::io::Write::write_all(hashing.stdin.as_mut().unwrap(), b"alice-secret\n").unwrap();
    drop(hashing.stdin.take());
    let out = hashing.wait_with_output().unwrap();
    let line: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(line["sha256"], hash_token("alice-secret"));
    let secret_file = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(secret_file.path(), "alice-secret").unwrap();
    let out = Command::new(bin)
        .arg("hash-token")
        .arg("--token-file")
        .arg(secret_file.path())
        .output()
        .unwrap();
    let line: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(line["sha256"], hash_token("alice-secret"));
    let out = Command::new(bin)
        .arg("hash-token")
        .stdin(Stdio::null())
        .output()
        .unwrap();
    assert!(!out.status.success(), "an empty token was hashed");
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("the token is empty"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );

    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("tether.toml");
    std::fs::write(
        &config,
        format!(
            "[auth]\nadmins = []\n[[auth.tokens]]\nprincipal = \"alice\"\nsha256 = \"{}\"\n[[auth.acl]]\nprincipal = \"alice\"\npublish = [\"fx-*\"]\nsubscribe = [\"fx-*\"]\n",
            hash_token("alice-secret")
        ),
    )
    .unwrap();
    let mut server = Command::new(bin)
        .args([
            "server",
            "--listen",
            "127.0.0.1:0",
            "--metrics",
            "off",
            "--config",
        ])
        .arg(&config)
        .arg("--data-dir")
        .arg(dir.path().join("data"))
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut first = String::new();
    BufReader::new(server.stdout.take().unwrap())
        .read_line(&mut first)
        .unwrap();
    let listening: serde_json::Value = serde_json::from_str(&first).unwrap();
    let (addr, ca) = (
        listening["addr"].as_str().unwrap(),
        listening["ca"].as_str().unwrap(),
    );
    let put = |extra: &[&str], env_token: Option<&str>| {
        let mut c = Command::new(bin);
        c.args([
            "put", "--server", addr, "--ca", ca, "--region", "fx-eur", "--key", "k", "--value", "v",
        ])
        .args(extra);
        c.env_remove("TETHER_TOKEN");
        if let Some(t) = env_token {
            c.env("TETHER_TOKEN", t);
        }
        c.output().unwrap()
    };
    let ok = put(&["--token", "alice-secret"], None);
    assert!(
        ok.status.success(),
        "{}",
        String::from_utf8_lossy(&ok.stderr)
    );
    assert!(
        put(&[], Some("alice-secret")).status.success(),
        "TETHER_TOKEN works too"
    );
    for (extra, want) in [
        (&[][..], "requires a token"),
        (&["--token", "nope"][..], "unknown token"),
    ] {
        let bad = put(extra, None);
        assert!(!bad.status.success());
        let stderr = String::from_utf8_lossy(&bad.stderr);
        let lines: Vec<&str> = stderr.lines().collect();
        assert_eq!(lines.len(), 1, "{stderr}");
        assert!(
            lines[0].starts_with("error:") && lines[0].contains(want),
            "{stderr}"
        );
    }
    // The server reads the [auth] table of its --config file again when the file changes:
    // alice's token is withdrawn, bob's added, without a restart.
    std::fs::write(
        &config,
        format!(
            "[auth]\nadmins = []\n[[auth.tokens]]\nprincipal = \"bob\"\nsha256 = \"{}\"\n[[auth.acl]]\nprincipal = \"bob\"\npublish = [\"fx-*\"]\n",
            hash_token("bob-secret")
        ),
    )
    .unwrap();
    let start = std::time::Instant::now();
    loop {
        let old = put(&["--token", "alice-secret"], None);
        if !old.status.success() {
            let stderr = String::from_utf8_lossy(&old.stderr);
            // Refused at the hello, or, when the reload lands between the hello's check and
            // the session's start, closed as withdrawn: both refuse the old token.
            assert!(
                stderr.contains("unknown token") || stderr.contains("token withdrawn"),
                "{stderr}"
            );
            break;
        }
        assert!(start.elapsed() < WAIT, "the --config file was not reloaded");
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
    let bob = put(&["--token", "bob-secret"], None);
    assert!(
        bob.status.success(),
        "{}",
        String::from_utf8_lossy(&bob.stderr)
    );
    let _ = server.kill();
    let _ = server.wait();
}

/// Mutual TLS: a client certificate issued by `client-ca` authenticates its common name; one
/// from another CA fails the handshake; ownership and ACLs apply to certificate principals too.
#[tokio::test]
async fn client_certificates_authenticate_their_common_name() {
    use tether::transport::tls;
    let dir = tempfile::tempdir().unwrap();
    let tls_dir = dir.path().join("tls");
    let files = tls::ensure_dev_certs(&tls_dir).unwrap();
    let mut config = tether::config::ServerConfig::ephemeral(dir.path());
    let mut a = auth();
    a.client_ca = Some(files.ca.clone());
    a.acl.push(AclEntry {
        principal: "carol".into(),
        publish: vec![],
        subscribe: vec!["fx-*".into()],
    });
    config.auth = Some(a);
    let node = tether::server::Node::start(config).await.unwrap();
    let (cert, key) =
        tls::issue_dev_client_cert(&tls_dir, "carol", &dir.path().join("clients")).unwrap();
    let builder = || {
        tether::client::ClientBuilder::new()
            .server(node.addr())
            .ca_file(&files.ca)
    };

    let carol = builder()
        .identity(&cert, &key)
        .durable("carol-dash", 600)
        .connect()
        .await
        .expect("carol's certificate");
    carol
        .region("fx-eur")
        .register(Interest::all_keys())
        .await
        .unwrap();
    let e = refusal(carol.region("fx-eur").put("k", "v").await.unwrap_err());
    assert!(e.message.contains("carol may not publish"), "{}", e.message);
    carol.close(true).await.unwrap();
    // Her durable id is hers: a token principal cannot take it.
    let e = refusal(
        builder()
            .token("alice-secret")
            .durable("carol-dash", 600)
            .connect()
            .await
            .err()
            .unwrap(),
    );
    assert_eq!(e.code, ErrorCode::Forbidden);
    let carol = builder()
        .identity(&cert, &key)
        .durable("carol-dash", 600)
        .connect()
        .await
        .unwrap();
    assert_eq!(carol.queue_status(), QueueStatus::Resumed);
    carol.close(true).await.unwrap();

    // Neither certificate nor token: refused, saying what is missing.
    let e = refusal(builder().connect().await.err().unwrap());
    assert_eq!(e.code, ErrorCode::Unauthenticated);
    assert!(e.message.contains("client certificate"), "{}", e.message);
    // A certificate from a CA the server does not trust fails the handshake.
    let other = tempfile::tempdir().unwrap();
    tls::ensure_dev_certs(&other.path().join("tls")).unwrap();
    let (mcert, mkey) =
        tls::issue_dev_client_cert(&other.path().join("tls"), "mallory", other.path()).unwrap();
    let err = builder()
        .identity(&mcert, &mkey)
        .connect()
        .await
        .err()
        .expect("untrusted certificate");
    assert!(matches!(err, ClientError::Connect(_)), "{err:?}");
    node.shutdown().await;
}

/// Runs `tether revoke-client-cert` and returns its JSON line.
fn revoke(data_dir: &std::path::Path, cert: &std::path::Path) -> serde_json::Value {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_tether"))
        .arg("revoke-client-cert")
        .arg("--cert")
        .arg(cert)
        .arg("--data-dir")
        .arg(data_dir)
        .output()
        .expect("run tether revoke-client-cert");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("one JSON line")
}

/// Certificate revocation: `tether revoke-client-cert` writes a list signed by the CA; a node
/// with `[auth] client-crl` refuses a revoked certificate at the handshake, reloads the list
/// when it changes and closes the open connections of a certificate revoked meanwhile; other
/// certificates keep working, and a damaged new list leaves the one in force.
#[tokio::test]
async fn revoked_client_certificates_are_refused_and_their_connections_closed() {
    use tether::transport::tls;
    let dir = tempfile::tempdir().unwrap();
    let tls_dir = dir.path().join("tls");
    let files = tls::ensure_dev_certs(&tls_dir).unwrap();
    let clients = dir.path().join("clients");
    let issue = |name: &str| tls::issue_dev_client_cert(&tls_dir, name, &clients).unwrap();
    let (carol_cert, carol_key) = issue("carol");
    let (dave_cert, dave_key) = issue("dave");
    let (eve_cert, eve_key) = issue("eve");
    let first = revoke(dir.path(), &eve_cert);
    assert_eq!(first["type"], "client-crl");
    assert_eq!(first["revoked"], 1);
    assert_eq!(first["crl_number"], 1);
    let crl = std::path::PathBuf::from(first["crl"].as_str().unwrap());
    assert_eq!(crl, tls_dir.join("client-crl.pem"));

    let mut config = tether::config::ServerConfig::ephemeral(dir.path());
    let mut a = auth();
    a.client_ca = Some(files.ca.clone());
    a.client_crl = Some(crl.clone());
    for who in ["carol", "dave", "eve"] {
        a.acl.push(AclEntry {
            principal: who.into(),
            publish: vec!["fx-*".into()],
            subscribe: vec!["fx-*".into()],
        });
    }
    config.auth = Some(a.clone());
    let node = tether::server::Node::start(config).await.unwrap();
    let builder = |cert: &std::path::Path, key: &std::path::Path| {
        tether::client::ClientBuilder::new()
            .server(node.addr())
            .ca_file(&files.ca)
            .identity(cert, key)
    };

    // Revoked before the node started: the handshake fails.
    let err = builder(&eve_cert, &eve_key)
        .connect()
        .await
        .err()
        .expect("eve's certificate is revoked");
    let ClientError::Connect(msg) = &err else {
        panic!("expected a failed handshake, got {err:?}");
    };
    assert!(
        msg.contains("error 44: invalid peer certificate: Revoked"),
        "{msg}"
    );

    let carol = builder(&carol_cert, &carol_key)
        .durable("carol-dash", 600)
        .connect()
        .await
        .expect("carol's certificate");
    carol
        .region("fx-eur")
        .register(Interest::all_keys())
        .await
        .unwrap();
    let dave = builder(&dave_cert, &dave_key).connect().await.unwrap();
    dave.region("fx-eur").put("k", "1").await.unwrap();

    // Carol's certificate is revoked while she is connected: the node reloads the list and
    // closes her connection, saying why.
    let second = revoke(dir.path(), &carol_cert);
    assert_eq!(second["revoked"], 2);
    assert_eq!(second["crl_number"], 2);
    let closed = closed_by_the_node(&carol).await;
    assert!(
        format!("{closed:?}").contains("revoked"),
        "the client learns why: {closed:?}"
    );
    let err = builder(&carol_cert, &carol_key)
        .durable("carol-dash", 600)
        .connect()
        .await
        .err()
        .expect("carol's certificate is revoked now");
    assert!(matches!(err, ClientError::Connect(_)), "{err:?}");
    // Dave was not revoked: his connection and new ones keep working.
    dave.region("fx-eur").put("k", "2").await.unwrap();
    let dave2 = builder(&dave_cert, &dave_key).connect().await.unwrap();
    assert_eq!(
        dave2.region("fx-eur").get("k").await.unwrap().as_deref(),
        Some(&b"2"[..])
    );

    // A damaged list is refused; the one in force stays (carol still out, dave still in).
    std::fs::write(
        &crl,
        "-----BEGIN X509 CRL-----\nAAAA\n-----END X509 CRL-----\n",
    )
    .unwrap();
    tokio::time::sleep(std::time::Duration::from_millis(
        3 * tether::server::CRL_RELOAD_INTERVAL_MS,
    ))
    .await;
    let dave3 = builder(&dave_cert, &dave_key).connect().await.unwrap();
    dave3.region("fx-eur").put("k", "3").await.unwrap();
    assert!(
        builder(&carol_cert, &carol_key).connect().await.is_err(),
        "carol stays revoked"
    );
    drop((dave, dave2, dave3));
    node.shutdown().await;

    // At start, a damaged list stops the node with its reason; so does a list without a CA.
    let mut config = tether::config::ServerConfig::ephemeral(dir.path());
    config.auth = Some(a.clone());
    let e = tether::server::Node::start(config)
        .await
        .err()
        .unwrap()
        .to_string();
    assert!(e.contains("client-crl"), "{e}");
    let mut config = tether::config::ServerConfig::ephemeral(dir.path());
    let mut no_ca = a;
    no_ca.client_ca = None;
    config.auth = Some(no_ca);
    let e = tether::server::Node::start(config)
        .await
        .err()
        .unwrap()
        .to_string();
    assert!(e.contains("needs auth.client-ca"), "{e}");
}

/// Revocation on a cluster: the nodes' peers (cluster CA) keep working with a client CRL in
/// force, a client certificate from a separate client CA (with the same dev-CA name) is
/// checked against the list on every node, and a revocation reaches every node.
#[tokio::test]
async fn revocation_applies_on_every_cluster_node() {
    use common::cluster::TestCluster;
    use tether::client::ClientEvent;
    use tether::transport::tls;
    let clients = tempfile::tempdir().unwrap();
    let client_tls = clients.path().join("tls");
    let client_ca = tls::ensure_dev_certs(&client_tls).unwrap();
    let out = clients.path().join("certs");
    let (carol_cert, carol_key) = tls::issue_dev_client_cert(&client_tls, "carol", &out).unwrap();
    let (eve_cert, eve_key) = tls::issue_dev_client_cert(&client_tls, "eve", &out).unwrap();
    let crl = std::path::PathBuf::from(
        revoke(clients.path(), &eve_cert)["crl"]
            .as_str()
            .unwrap()
            .to_string(),
    );
    let mut a = auth();
    a.client_ca = Some(client_ca.ca.clone());
    a.client_crl = Some(crl);
    for who in ["carol", "eve"] {
        a.acl.push(AclEntry {
            principal: who.into(),
            publish: vec!["fx-*".into()],
            subscribe: vec!["fx-*".into()],
        });
    }
    let c = TestCluster::start_with_auth(2, a).await;
    c.leader().await;
    let cluster_ca = c.dirs[0].path().join("tls").join(tls::CA_CERT_FILE);
    let to = |i: usize, cert: &std::path::Path, key: &std::path::Path| {
        tether::client::ClientBuilder::new()
            .server(c.node(i).addr())
            .ca_file(&cluster_ca)
            .identity(cert, key)
    };
    for i in 0..2 {
        let err = to(i, &eve_cert, &eve_key).connect().await.err();
        assert!(
            matches!(&err, Some(ClientError::Connect(m)) if m.contains("Revoked")),
            "node {i}: {err:?}"
        );
    }
    // Carol's durable queue (placed by the cluster) gets what she publishes through node 1:
    // the peers work with the list in force.
    let sub = to(0, &carol_cert, &carol_key)
        .durable("carol-feed", 600)
        .connect()
        .await
        .unwrap();
    sub.region("fx-eur")
        .register(Interest::all_keys())
        .await
        .unwrap();
    let mut events = sub.events().unwrap();
    sub.ready_for_events().await.unwrap();
    let publisher = to(1, &carol_cert, &carol_key).connect().await.unwrap();
    publisher.region("fx-eur").put("k", "1").await.unwrap();
    let got = loop {
        match tokio::time::timeout(WAIT, events.next())
            .await
            .expect("event")
        {
            Some(ClientEvent::Event(e)) => break e,
            Some(ClientEvent::Live { .. }) => continue,
            Some(other) => panic!("a session's stream yielded {other:?}"),
            None => panic!("stream ended"),
        }
    };
    assert_eq!(got.value.as_deref(), Some(&b"1"[..]));

    // Revoked: both her connections close, and neither node lets her in again.
    revoke(clients.path(), &carol_cert);
    let start = std::time::Instant::now();
    while publisher.region("fx-eur").put("k", "2").await.is_ok() {
        assert!(
            start.elapsed() < WAIT,
            "carol's publishing connection stays open"
        );
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    while sub.region("fx-eur").get("k").await.is_ok() {
        assert!(
            start.elapsed() < WAIT,
            "carol's durable connection stays open"
        );
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    for i in 0..2 {
        assert!(
            to(i, &carol_cert, &carol_key).connect().await.is_err(),
            "node {i} refuses carol"
        );
    }
}

/// Credentials are checked at every connection, so the latest ones count: after the operator
/// rotates alice's token (the node restarted with the new configuration), the old token is
/// refused and the new one resumes alice's durable queue; a principal whose subscribe right was
/// withdrawn meanwhile can no longer register, and keeps its queue.
#[tokio::test]
async fn rotated_credentials_count_at_the_next_connection() {
    let mut n = TestNode::start_auth(auth()).await;
    let a = n
        .builder()
        .token("alice-secret")
        .durable("dash", 600)
        .connect()
        .await
        .unwrap();
    a.region("fx-eur")
        .register(Interest::all_keys())
        .await
        .unwrap();
    a.close(true).await.unwrap();
    n.put("fx-eur", "EURUSD", "1.08").await;
    let mut rotated = auth();
    rotated.tokens.retain(|t| t.principal != "alice");
    rotated.tokens.push(TokenEntry {
        principal: "alice".into(),
        sha256: hash_token("alice-rotated"),
    });
    rotated.acl.retain(|e| e.principal != "alice");
    rotated.acl.push(AclEntry {
        principal: "alice".into(),
        publish: vec![],
        subscribe: vec!["fx-gbp".into()],
    });
    n.auth = Some(rotated);
    n.restart().await;
    let e = refusal(
        n.builder()
            .token("alice-secret")
            .durable("dash", 600)
            .connect()
            .await
            .err()
            .expect("the old token is gone"),
    );
    assert_eq!(
        (e.code, e.message.as_str()),
        (ErrorCode::Unauthenticated, "unknown token")
    );
    let a = n
        .builder()
        .token("alice-rotated")
        .durable("dash", 600)
        .connect()
        .await
        .expect("the new token is alice's");
    assert_eq!(
        (a.queue_status(), a.pending()),
        (QueueStatus::Resumed, Some(1))
    );
    let e = refusal(
        a.region("fx-eur")
            .register(Interest::all_keys())
            .await
            .expect_err("alice may no longer subscribe to fx-eur"),
    );
    assert_eq!(e.code, ErrorCode::Forbidden);
    a.close(true).await.unwrap();
}

/// On a cluster, a durable id's owner travels with the queue's copy: after its primary is
/// stopped and the copy promoted, the owner resumes it through another node with every event,
/// and another principal is refused there as on the first node.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ownership_and_acls_hold_on_a_promoted_copy() {
    use common::cluster::TestCluster;
    use tether::client::ClientEvent;
    let mut c = TestCluster::start_with_auth(3, auth()).await;
    c.leader().await;
    let ca = c.dirs[0]
        .path()
        .join("tls")
        .join(tether::transport::tls::CA_CERT_FILE);
    let via = |c: &TestCluster, nodes: &[usize], token: &str| {
        tether::client::ClientBuilder::new()
            .servers(nodes.iter().map(|&i| c.node(i).addr()))
            .ca_file(&ca)
            .token(token)
    };
    let a = via(&c, &[0], "alice-secret")
        .durable("dash", 600)
        .redundancy(1)
        .connect()
        .await
        .unwrap();
    assert_eq!(a.node_id(), "n1");
    a.region("fx-eur")
        .register(Interest::all_keys())
        .await
        .unwrap();
    a.close(true).await.unwrap();
    let p = via(&c, &[1], "alice-secret").connect().await.unwrap();
    for i in 0..10 {
        p.region("fx-eur")
            .put(format!("k{i}"), b"v".to_vec())
            .await
            .unwrap();
    }
    // Bob is refused for alice's id, and may not publish at all.
    let e = refusal(
        via(&c, &[1, 2], "bob-secret")
            .durable("dash", 600)
            .connect()
            .await
            .err()
            .unwrap(),
    );
    assert_eq!(e.code, ErrorCode::Forbidden);
    let b = via(&c, &[2], "bob-secret").connect().await.unwrap();
    let e = refusal(
        b.region("fx-eur")
            .put("k", b"v".to_vec())
            .await
            .err()
            .unwrap(),
    );
    assert_eq!(e.code, ErrorCode::Forbidden);
    b.close(false).await.unwrap();
    // The primary goes away; the copy on n2 or n3 is promoted (with the owner in its info).
    c.nodes[0].take().unwrap().shutdown().await;
    let start = std::time::Instant::now();
    let a = loop {
        match via(&c, &[1, 2], "alice-secret")
            .durable("dash", 600)
            .connect()
            .await
        {
            Ok(a) if a.node_id() != "n1" => break a,
            Ok(a) => a.close(true).await.unwrap(),
            Err(e) => {
                assert!(start.elapsed() < WAIT, "no promotion: {e}");
                tokio::time::sleep(std::time::Duration::from_millis(200)).await;
            }
        }
    };
    assert_eq!(
        (a.queue_status(), a.pending()),
        (QueueStatus::Resumed, Some(10))
    );
    let e = refusal(
        via(&c, &[1, 2], "bob-secret")
            .durable("dash", 600)
            .connect()
            .await
            .err()
            .expect("still alice's on the new primary"),
    );
    assert_eq!(e.code, ErrorCode::Forbidden);
    assert!(
        e.message.contains("belongs to another principal"),
        "{}",
        e.message
    );
    a.ready_for_events().await.unwrap();
    let mut ev = a.events().unwrap();
    let got = until_live(&mut ev, "fx-eur").await;
    assert_eq!(
        got.iter()
            .filter(|e| matches!(e, ClientEvent::Event(_)))
            .count(),
        10
    );
    drop(ev);
    a.close(true).await.unwrap();
    p.close(false).await.ok();
    c.shutdown().await;
}

/// The `[auth]` table of a node's configuration file in TOML, with the tokens given as
/// `(principal, secret)` and alice's publish patterns.
fn auth_toml(tokens: &[(&str, &str)], alice_publishes: &[&str]) -> String {
    let mut s = String::from("[auth]\nadmins = [\"ops\"]\n");
    for (principal, secret) in tokens {
        s += &format!(
            "[[auth.tokens]]\nprincipal = \"{principal}\"\nsha256 = \"{}\"\n",
            hash_token(secret)
        );
    }
    s += &format!(
        "[[auth.acl]]\nprincipal = \"alice\"\npublish = {alice_publishes:?}\nsubscribe = [\"fx-*\"]\n"
    );
    s += "[[auth.acl]]\nprincipal = \"bob\"\nsubscribe = [\"fx-*\"]\n";
    s
}

/// Reads from `client` until the node has closed its connection; the error the client got.
/// Fails after [`WAIT`].
async fn closed_by_the_node(client: &tether::client::Client) -> ClientError {
    let start = std::time::Instant::now();
    loop {
        match client.region("fx-eur").get("k").await {
            Ok(_) => {
                assert!(start.elapsed() < WAIT, "the connection was not closed");
                tokio::time::sleep(std::time::Duration::from_millis(50)).await;
            }
            Err(e) => return e,
        }
    }
}

/// Waits until `f` returns true, polling; fails after [`WAIT`].
async fn eventually<F: std::future::Future<Output = bool>>(what: &str, mut f: impl FnMut() -> F) {
    let start = std::time::Instant::now();
    while !f().await {
        assert!(start.elapsed() < WAIT, "{what}");
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
}

/// Tokens are withdrawn and ACLs changed without a restart: the node reads the `[auth]` table of
/// its configuration file again when the file changes. A withdrawn token's open connection is
/// closed with `unauthenticated` ("token withdrawn") and its durable queue stays; an ACL change
/// applies to the next request of open connections; a damaged file, or one without `[auth]`,
/// leaves the table in force.
#[tokio::test]
async fn a_changed_auth_table_is_reloaded_without_a_restart() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("tether.toml");
    let everyone = [
        ("alice", "alice-secret"),
        ("bob", "bob-secret"),
        ("ops", "ops-secret"),
    ];
    std::fs::write(&file, auth_toml(&everyone, &["fx-*"])).unwrap();
    let mut config = tether::config::ServerConfig::ephemeral(dir.path().join("data"));
    config.auth = tether::config::FileConfig::load(&file).unwrap().auth;
    config.auth_file = Some(file.clone());
    let n = TestNode {
        node: Some(tether::server::Node::start(config).await.unwrap()),
        dir,
        limits: Default::default(),
        auth: None,
    };
    let bob = n
        .builder()
        .token("bob-secret")
        .durable("bob-dash", 600)
        .connect()
        .await
        .unwrap();
    bob.region("fx-eur")
        .register(Interest::all_keys())
        .await
        .unwrap();
    let alice = n.builder().token("alice-secret").connect().await.unwrap();
    alice.region("fx-eur").put("k", "1").await.unwrap();

    // Bob's token is withdrawn, alice may publish to fx-usd only, carol gets a token.
    let changed = [
        ("alice", "alice-secret"),
        ("carol", "carol-secret"),
        ("ops", "ops-secret"),
    ];
    std::fs::write(&file, auth_toml(&changed, &["fx-usd"])).unwrap();
    eventually("bob's token is refused after the reload", || async {
        let e = n.builder().token("bob-secret").connect().await;
        matches!(e, Err(ClientError::Server(e)) if e.code == ErrorCode::Unauthenticated
            && e.message == "unknown token")
    })
    .await;
    // His open connection was closed, saying why.
    let closed = closed_by_the_node(&bob).await;
    assert!(
        format!("{closed:?}").contains("token withdrawn"),
        "the client learns why: {closed:?}"
    );
    // Alice's open connection follows the new ACL at its next request.
    let e = refusal(alice.region("fx-eur").put("k", "2").await.unwrap_err());
    assert_eq!(
        (e.code, e.message.as_str()),
        (
            ErrorCode::Forbidden,
            "alice may not publish to region \"fx-eur\""
        )
    );
    alice.region("fx-usd").put("k", "1").await.unwrap();
    let carol = n.builder().token("carol-secret").connect().await.unwrap();
    // Bob's queue stays, away, with the event published before the reload.
    let ops = n.builder().token("ops-secret").connect().await.unwrap();
    eventually("bob's queue stays, away, with its event", || async {
        let queues = ops.queues().await.unwrap();
        let bob_q = queues
            .iter()
            .find(|q| q.durable_id.as_deref() == Some("bob-dash"))
            .expect("bob's queue stays");
        bob_q.state == "away" && bob_q.pending == 1
    })
    .await;

    // A damaged file and a file without [auth] are refused: the table in force stays.
    for bad in ["[auth\nadmins = [", "listen = \"127.0.0.1:0\"\n"] {
        std::fs::write(&file, bad).unwrap();
        tokio::time::sleep(std::time::Duration::from_millis(
            3 * tether::server::AUTH_RELOAD_INTERVAL_MS,
        ))
        .await;
        let e = refusal(
            n.builder()
                .connect()
                .await
                .err()
                .expect("still authenticating"),
        );
        assert_eq!(e.code, ErrorCode::Unauthenticated);
        alice.region("fx-usd").put("k", "2").await.unwrap();
        alice.region("fx-eur").put("k", "2").await.unwrap_err();
        // Carol's connection stays open (she has no ACL entry: refused, not closed).
        let e = refusal(carol.region("fx-usd").get("k").await.unwrap_err());
        assert_eq!(e.code, ErrorCode::Forbidden, "{e:?}");
        n.builder().token("carol-secret").connect().await.unwrap();
        assert!(n.builder().token("bob-secret").connect().await.is_err());
    }
    drop((alice, carol, ops));
}
