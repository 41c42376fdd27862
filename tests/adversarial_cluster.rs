//! Adversarial tests of a cluster's trust boundaries (security review, issue 22): who may be a
//! peer. Real nodes in one process over QUIC with mutual TLS on loopback, RocksDB in temp dirs;
//! the attacker speaks the peer protocol with real certificates from the cluster CA.
//!
//! - A client certificate (issued by the same CA, as `tether issue-client-cert` does) never
//!   opens a peer connection: a vote, a metadata write, a publish and a replication message
//!   are each refused, and the cluster is unaffected.
//! - A member speaks only in its own name: a vote for another candidate, publishes of another
//!   origin, replication in another primary's name or of a queue it does not own are refused.
//! - A node certificate is never a client, a node dialing a peer checks that the certificate
//!   there names the node it called, and a node whose own certificate does not name it does
//!   not start.
//! - A member's calls keep streams free for pings, and a queue's info (its interest, up to
//!   2 MiB) travels to its copies once per change, not with every heartbeat.
//! - A hello refused after its id was placed leaves no placement behind.
//! - A copy keeps a queue's away time in its own clock: skew between members never expires a
//!   queue early after a failover.
//! - A member whose copies did not confirm forwarded publishes in time says so, and the origin
//!   never acknowledges such a publish as replicated (`--ack replicated`).
//! - An expired durable id stays its owner's on every member, not only where it expired.

mod common;

use std::net::SocketAddr;
use std::path::Path;
use std::time::Duration;

use common::cluster::TestCluster;
use common::{drain_quiet, keys, take_events, until_live};
use tether::client::{Client, ClientBuilder, EventStream, Interest};
use tether::cluster::meta::{MetaCommand, NodeId, raft_id};
use tether::cluster::network::{
    ForwardedPublish, PeerPool, PeerRequest, PeerResponse, ReplicateHeader, ReplicateMsg,
    ShippedEntry,
};
use tether::protocol::{ClientMsg, DurableHello, ErrorCode, PublishOp, ServerMsg};
use tether::replication::AppendHeader;
use tether_transport::{codec, endpoint, tls};

/// Deadline of one peer call or client step.
const STEP: Duration = Duration::from_secs(10);
/// The region the watching durable client follows.
const REGION: &str = "adv";
/// The durable id of the watching client (redundancy 1: a primary and a copy).
const WATCHER: &str = "watcher";
/// A term far above any the test cluster reaches by itself.
const FORGED_TERM_ABOVE: u64 = 1_000;

/// The peer-protocol client configuration of one presenting `cert`/`key`.
fn peer_config(ca: &Path, cert: &Path, key: &Path) -> quinn::ClientConfig {
    let files = tls::TlsFiles {
        ca: ca.to_path_buf(),
        cert: cert.to_path_buf(),
        key: key.to_path_buf(),
    };
    tls::peer_client_config(&files).expect("peer client config")
}

/// A peer-protocol client presenting `cert`/`key` (a real QUIC endpoint of its own).
fn pool_with(ca: &Path, cert: &Path, key: &Path, towards: SocketAddr) -> PeerPool {
    let cfg = peer_config(ca, cert, key);
    let ep = endpoint::client_endpoint(cfg.clone(), towards).expect("endpoint");
    PeerPool::new(ep, cfg)
}

/// A raw peer-protocol connection to `addr` presenting `cert`/`key`.
async fn peer_connection(
    ca: &Path,
    cert: &Path,
    key: &Path,
    addr: SocketAddr,
) -> quinn::Connection {
    let ep = endpoint::client_endpoint(peer_config(ca, cert, key), addr).expect("endpoint");
    tokio::time::timeout(STEP, ep.connect(addr, tls::SERVER_NAME).expect("connect"))
        .await
        .expect("a handshake in time")
        .expect("the TLS handshake itself succeeds: the certificate is from the cluster CA")
}

fn addrs(c: &TestCluster) -> Vec<SocketAddr> {
    (0..c.names.len()).map(|i| c.node(i).addr()).collect()
}

fn ca(c: &TestCluster) -> std::path::PathBuf {
    c.dirs[0].path().join("tls").join(tls::CA_CERT_FILE)
}

/// A durable client with redundancy 1 following [`REGION`], live.
async fn watcher(c: &TestCluster) -> (Client, EventStream) {
    let d = ClientBuilder::new()
        .servers(addrs(c))
        .ca_file(ca(c))
        .durable(WATCHER, 600)
        .redundancy(1)
        .connect()
        .await
        .expect("the watcher connects");
    d.region(REGION)
        .register(Interest::all_keys())
        .await
        .expect("register");
    d.ready_for_events().await.expect("ready");
    let mut ev = d.events().expect("events");
    until_live(&mut ev, REGION).await;
    (d, ev)
}

/// The report of a secondary's copy of queue `id`, through the cluster-wide listing.
async fn copy_report(admin: &Client, id: &str) -> Option<tether::protocol::QueueReport> {
    let page = admin
        .queues_page(tether::protocol::QueuesQuery {
            role: Some("secondary".into()),
            prefix: Some(id.into()),
            ..Default::default()
        })
        .await
        .expect("the listing");
    page.queues
        .into_iter()
        .find(|q| q.durable_id.as_deref() == Some(id))
}

/// A durable client (redundancy 1, `timeout_secs`) connected to n1 under an id starting with
/// `prefix` whose primary is n1 and whose copy is on n2 (ids are tried until one is placed so).
async fn durable_on_n1_copied_on_n2(
    c: &TestCluster,
    prefix: &str,
    timeout_secs: u64,
) -> (Client, String) {
    for k in 0..64 {
        let id = format!("{prefix}-{k}");
        let d = ClientBuilder::new()
            .server(c.node(0).addr())
            .ca_file(ca(c))
            .durable(&id, timeout_secs)
            .redundancy(1)
            .connect()
            .await
            .expect("the durable client connects");
        let placed = c.node(0).cluster().unwrap().placement(&id).expect("placed");
        if c.index_of(placed.primary) == 0 && c.index_of(placed.secondaries[0]) == 1 {
            return (d, id);
        }
        d.close(false).await.expect("close");
    }
    panic!("no id placed on n1 with its copy on n2");
}

/// A publish of `key` forged in the name of `origin`.
fn forged_publish(origin: &str, key: &str) -> PeerRequest {
    PeerRequest::Publish {
        origin: origin.into(),
        log_start: 0,
        entries: vec![(
            1 << 40,
            ForwardedPublish {
                session: 77,
                first_seq: 1,
                ops: vec![PublishOp::Put {
                    region: REGION.into(),
                    key: key.into(),
                    value: b"forged".to_vec(),
                }],
            },
        )],
        floor: 0,
        follows: None,
    }
}

/// A replication message for `queue` in the name of `from`, shipped under `placement_epoch`.
fn forged_replicate(from: NodeId, queue: &str, placement_epoch: u64) -> PeerRequest {
    PeerRequest::Replicate(ReplicateMsg {
        from,
        durable_id: queue.into(),
        header: ReplicateHeader::Append(AppendHeader {
            epoch: 1 << 30,
            batch: 1,
            first: 0,
            last: 1,
            prev_epoch: None,
            entries_epoch: 1 << 30,
            log_end: 1,
            acked: 0,
        }),
        sent_ms: 0,
        info: Vec::new(),
        entries: vec![ShippedEntry {
            flags: 0,
            body: b"forged".to_vec(),
        }],
        more: false,
        through: Default::default(),
        through_end: 0,
        placement_epoch,
    })
}

/// A vote request of candidate `candidate` at `term`.
fn forged_vote(candidate: NodeId, term: u64) -> PeerRequest {
    PeerRequest::Vote(openraft::raft::VoteRequest::new(
        openraft::Vote::new(term, candidate),
        None,
    ))
}

/// No member took the term of a forged vote.
fn no_forged_term(c: &TestCluster) {
    for i in 0..c.names.len() {
        let term = c.node(i).cluster().unwrap().term();
        assert!(term < FORGED_TERM_ABOVE, "n{} took a forged term", i + 1);
    }
}

/// The watcher still receives what is published, and nothing forged came before it.
async fn still_delivers(c: &TestCluster, ev: &mut EventStream, key: &str) {
    let p = ClientBuilder::new()
        .server(c.node(0).addr())
        .ca_file(ca(c))
        .connect()
        .await
        .expect("a publisher connects");
    p.region(REGION)
        .put(key, b"real".to_vec())
        .await
        .expect("a real put");
    assert_eq!(keys(&take_events(ev, 1).await), [key]);
    assert_eq!(
        p.region(REGION).get("forged").await.expect("get"),
        None,
        "a forged publish was applied"
    );
    p.close(false).await.ok();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_certificate_is_never_a_peer() {
    let c = TestCluster::start(3).await;
    let leader = c.leader().await;
    let (d, mut ev) = watcher(&c).await;
    let cluster = c.node(0).cluster().expect("clustered");
    let placed = cluster.placement(WATCHER).expect("the watcher is placed");
    // A client certificate from the cluster CA, as `tether issue-client-cert` makes them.
    let out = tempfile::tempdir().unwrap();
    let (cert, key) =
        tls::issue_dev_client_cert(&c.dirs[0].path().join("tls"), "mallory", out.path())
            .expect("a client certificate");
    for (i, addr) in addrs(&c).into_iter().enumerate() {
        let target = raft_id(&c.names[i]);
        let attacks = [
            (
                "a vote",
                forged_vote(raft_id("n2"), cluster.term() + FORGED_TERM_ABOVE),
            ),
            (
                "a metadata write",
                PeerRequest::Write(MetaCommand::NodeFailed {
                    node: placed.primary,
                }),
            ),
            ("a publish", forged_publish("n2", "forged")),
            (
                "a replication message",
                forged_replicate(placed.primary, "victim", 0),
            ),
            (
                "a replication message of a real queue",
                forged_replicate(placed.primary, WATCHER, placed.epoch),
            ),
        ];
        for (what, request) in attacks {
            // A fresh connection each time: the node closes the attacker's after the handshake.
            let conn = peer_connection(&ca(&c), &cert, &key, addr).await;
            let bytes = tether::cluster::network::encode_request(target, request).unwrap();
            let answered = async {
                let (mut send, mut recv) = conn.open_bi().await.ok()?;
                send.write_all(&bytes).await.ok()?;
                send.finish().ok()?;
                recv.read_to_end(1 << 20).await.ok()
            }
            .await;
            assert!(
                answered.is_none(),
                "{what} from a client certificate was answered by n{}",
                i + 1
            );
            match tokio::time::timeout(STEP, conn.closed()).await {
                Ok(quinn::ConnectionError::ApplicationClosed(close)) => {
                    assert_eq!(close.error_code, ErrorCode::Unauthenticated.varint());
                    let reason = String::from_utf8_lossy(&close.reason);
                    assert!(reason.contains("names no cluster node"), "{what}: {reason}");
                }
                other => panic!("{what} to n{}: the node did not refuse: {other:?}", i + 1),
            }
        }
    }
    // The cluster is unaffected: the same leader, no forged term, the queue where it was (no
    // failure declared), nothing forged delivered, and no copy of "victim" anywhere.
    assert_eq!(c.leader().await, leader);
    no_forged_term(&c);
    for i in 0..3 {
        let now = c
            .node(i)
            .cluster()
            .unwrap()
            .placement(WATCHER)
            .expect("still placed");
        assert_eq!((now.primary, now.epoch), (placed.primary, placed.epoch));
    }
    still_delivers(&c, &mut ev, "after-mallory").await;
    for addr in addrs(&c) {
        let admin = ClientBuilder::new()
            .server(addr)
            .ca_file(ca(&c))
            .connect()
            .await
            .expect("an admin connects");
        let queues = admin.queues().await.expect("queues");
        assert!(
            queues
                .iter()
                .all(|q| q.durable_id.as_deref() != Some("victim")),
            "a forged replication message made a copy on {addr}: {queues:?}"
        );
        admin.close(false).await.ok();
    }
    drop(ev);
    d.close(false).await.ok();
    c.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_member_speaks_only_in_its_own_name() {
    let c = TestCluster::start(3).await;
    c.leader().await;
    let (d, mut ev) = watcher(&c).await;
    let cluster = c.node(0).cluster().expect("clustered");
    let placed = cluster.placement(WATCHER).expect("the watcher is placed");
    let index = |id| c.index_of(id);
    // A member that is neither the watcher's primary nor its copy: its certificate is real.
    let other = (0..3)
        .map(|i| raft_id(&c.names[i]))
        .find(|id| *id != placed.primary && !placed.secondaries.contains(id))
        .expect("a third member");
    let secondary = placed.secondaries[0];
    let tls_dir = c.dirs[index(other)].path().join("tls");
    let (cert, key) = (
        tls_dir.join(tls::SERVER_CERT_FILE),
        tls_dir.join(tls::SERVER_KEY_FILE),
    );
    let other_name = c.names[index(other)].clone();
    let primary_name = c.names[index(placed.primary)].clone();
    let sec_addr = c.node(index(secondary)).addr();
    let pool = pool_with(&ca(&c), &cert, &key, sec_addr);
    let term = cluster.term() + FORGED_TERM_ABOVE;
    let attacks = [
        (
            "a vote for another candidate",
            forged_vote(placed.primary, term),
            "vote request",
        ),
        (
            "publishes of another origin",
            forged_publish(&primary_name, "forged"),
            "origin",
        ),
        (
            "replication in the primary's name",
            forged_replicate(placed.primary, WATCHER, placed.epoch),
            "replication",
        ),
        (
            "replication of a queue it is not primary of",
            forged_replicate(other, WATCHER, placed.epoch),
            "is not the primary",
        ),
    ];
    for (what, request, expected) in attacks {
        let answer = pool
            .call(secondary, &sec_addr.to_string(), request, STEP)
            .await
            .unwrap_or_else(|e| panic!("{what}: no answer: {e}"));
        match answer {
            PeerResponse::BadRequest(why) => {
                assert!(why.contains(expected), "{what}: {why}");
                if expected != "is not the primary" {
                    assert!(why.contains(&other_name), "{what}: {why}");
                }
            }
            _ => panic!("{what} from {other_name} was not refused"),
        }
    }
    // Its own requests are still served: a ping.
    assert!(matches!(
        pool.call(secondary, &sec_addr.to_string(), PeerRequest::Ping, STEP)
            .await,
        Ok(PeerResponse::Pong)
    ));
    // Dialing: the node at the secondary's address is not the primary; calling the primary
    // there fails, naming the certificate found.
    let Err(e) = pool
        .call(
            placed.primary,
            &sec_addr.to_string(),
            PeerRequest::Ping,
            STEP,
        )
        .await
    else {
        panic!("a call was answered by another node's certificate");
    };
    assert!(
        e.to_string()
            .contains("presents a certificate for cluster node(s)"),
        "{e}"
    );
    pool.close();
    no_forged_term(&c);
    assert_eq!(
        cluster.placement(WATCHER).map(|p| (p.primary, p.epoch)),
        Some((placed.primary, placed.epoch))
    );
    still_delivers(&c, &mut ev, "after-member").await;

    // A node certificate is not a client's, whatever its common name.
    let node_tls = c.dirs[0].path().join("tls");
    let refused = ClientBuilder::new()
        .server(c.node(0).addr())
        .ca_file(ca(&c))
        .identity(
            node_tls.join(tls::SERVER_CERT_FILE),
            node_tls.join(tls::SERVER_KEY_FILE),
        )
        .connect()
        .await
        .err()
        .expect("a node certificate authenticates no client");
    assert!(
        refused
            .to_string()
            .contains("a cluster node's certificate cannot authenticate a client"),
        "{refused}"
    );
    drop(ev);
    d.close(false).await.ok();
    c.shutdown().await;
}

/// A cluster node whose configured certificate does not name it does not start, with an error
/// naming the SAN it needs; the dev certificate of a data directory made before node names
/// were carried is signed again at start.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_certificate_must_name_its_node() {
    let dir = tempfile::tempdir().unwrap();
    let plain = tls::ensure_dev_certs(&dir.path().join("own")).unwrap();
    let peers = vec![
        ("n1".to_string(), "127.0.0.1:9".to_string()),
        ("n2".to_string(), "127.0.0.1:10".to_string()),
    ];
    let mut cfg = common::cluster::node_config(dir.path(), "n1", 0, &peers);
    cfg.tls = Some(tether::config::TlsConfig {
        cert: plain.cert.clone(),
        key: plain.key.clone(),
        ca: plain.ca.clone(),
    });
    let e = tether::server::Node::start(cfg)
        .await
        .err()
        .expect("a node whose certificate does not name it");
    let e = e.to_string();
    assert!(e.contains("urn:tether:node:n1"), "{e}");
    // Dev certificates: signed again, naming the node.
    let data = dir.path().join("data");
    let old = tls::ensure_dev_certs(&data.join("tls")).unwrap();
    assert!(tls::file_node_names(&old.cert).unwrap().is_empty());
    let port = common::cluster::free_ports(1)[0];
    let alone = [("n1".to_string(), format!("127.0.0.1:{port}"))];
    let cfg = common::cluster::node_config(&data, "n1", port, &alone);
    let node = tether::server::Node::start(cfg).await.expect("starts");
    assert_eq!(tls::file_node_names(&old.cert).unwrap(), ["n1"]);
    node.shutdown().await;
}

/// Sends a hello with `durable` to `addr` by hand and returns the server's first answer.
async fn raw_hello(addr: SocketAddr, ca: &Path, durable: DurableHello) -> ServerMsg {
    raw_hello_as(addr, ca, durable, None).await
}

/// [`raw_hello`] with a bearer token.
async fn raw_hello_as(
    addr: SocketAddr,
    ca: &Path,
    durable: DurableHello,
    token: Option<&str>,
) -> ServerMsg {
    let cfg = tls::client_config(ca).expect("client tls config");
    let ep = endpoint::client_endpoint(cfg, addr).expect("client endpoint");
    let conn = tokio::time::timeout(STEP, ep.connect(addr, tls::SERVER_NAME).expect("connect"))
        .await
        .expect("handshake in time")
        .expect("handshake");
    let (mut send, recv) = conn.open_bi().await.expect("control stream");
    let hello = ClientMsg::Hello {
        version: tether_transport::PROTOCOL_VERSION,
        durable: Some(durable),
        token: token.map(str::to_string),
        client: "adversarial".into(),
        going_away: false,
    };
    codec::write_frame(&mut send, &hello)
        .await
        .expect("hello sent");
    let mut reader = codec::FrameReader::new(recv);
    tokio::time::timeout(STEP, reader.next::<ServerMsg>())
        .await
        .expect("an answer in time")
        .expect("a frame")
        .expect("an answer")
}

/// A durable hello is validated before its id is placed through consensus: an id past the
/// limit, a timeout past the limit or a bad failed-primary name is refused with
/// invalid_argument, and no member's metadata holds a placement for it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bad_durable_hello_never_reaches_consensus() {
    let c = TestCluster::start(3).await;
    c.leader().await;
    let long_id = "x".repeat(tether::limits::DURABLE_ID_BYTES_MAX * 40);
    let bad = [
        DurableHello {
            redirect_epoch: None,
            id: long_id.clone(),
            timeout_secs: 60,
            redundancy: 1,
            failed_primary: None,
            seen: None,
        },
        DurableHello {
            redirect_epoch: None,
            id: "timeout-too-long".into(),
            timeout_secs: tether::limits::DURABLE_TIMEOUT_SECS_MAX + 1,
            redundancy: 1,
            failed_primary: None,
            seen: None,
        },
        DurableHello {
            redirect_epoch: None,
            id: "bad-failed-primary".into(),
            timeout_secs: 60,
            redundancy: 1,
            failed_primary: Some("n1 and more ".repeat(100)),
            seen: None,
        },
    ];
    for hello in bad {
        let id = hello.id.clone();
        match raw_hello(c.node(0).addr(), &ca(&c), hello).await {
            ServerMsg::Error(e) => assert_eq!(e.code, ErrorCode::InvalidArgument, "{e:?}"),
            other => panic!("a bad durable hello was answered {other:?}"),
        }
        for i in 0..3 {
            assert!(
                c.node(i).cluster().unwrap().placement(&id).is_none(),
                "n{} holds a placement for a refused hello ({} bytes of id)",
                i + 1,
                id.len()
            );
        }
    }
    // A good hello is placed as usual.
    let (d, ev) = watcher(&c).await;
    assert!(c.node(0).cluster().unwrap().placement(WATCHER).is_some());
    drop(ev);
    d.close(false).await.ok();
    c.shutdown().await;
}

/// Client authentication with two principals, alice and bob (token `<name>-secret`), each
/// allowed to publish and subscribe in [`REGION`].
fn alice_and_bob() -> tether::auth::AuthConfig {
    use tether::auth::{AuthConfig, TokenEntry, hash_token};
    let token = |principal: &str| TokenEntry {
        principal: principal.into(),
        sha256: hash_token(&format!("{principal}-secret")),
    };
    AuthConfig {
        client_ca: None,
        client_crl: None,
        admins: vec![],
        tokens: vec![token("alice"), token("bob")],
        acl: vec![tether::auth::AclEntry {
            principal: "*".into(),
            publish: vec![REGION.into()],
            subscribe: vec![REGION.into()],
        }],
    }
}

/// Client-managed failover asks a secondary to promote its copy when the client lost the
/// primary. Only the queue's owner may: another principal naming the lost primary is refused
/// before any promotion, and the placement stays as it was; the owner's own failover then
/// promotes the copy and resumes the queue. (Failure detection is slowed down so that only
/// the hellos can promote.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_the_owner_can_have_a_copy_promoted() {
    let auth = alice_and_bob();
    let mut c = TestCluster::start_full(3, tether::config::Limits::default(), Some(auth), |cfg| {
        cfg.node_failure_ms = tether::config::NODE_FAILURE_MS_MAX
    })
    .await;
    c.leader().await;
    let a = ClientBuilder::new()
        .server(c.node(0).addr())
        .ca_file(ca(&c))
        .token("alice-secret")
        .durable("owned", 600)
        .redundancy(1)
        .connect()
        .await
        .expect("alice connects");
    assert_eq!(a.node_id(), "n1");
    a.region(REGION)
        .register(Interest::all_keys())
        .await
        .expect("register");
    a.close(true).await.expect("away");
    let placed = c.node(1).cluster().unwrap().placement("owned").unwrap();
    let copy = c.index_of(placed.secondaries[0]);
    // The copy holds the owner once its primary shipped the queue's info.
    c.nodes[0].take().unwrap().shutdown().await;
    let hello = |id: &str| DurableHello {
        redirect_epoch: None,
        id: id.into(),
        timeout_secs: 600,
        redundancy: 1,
        failed_primary: Some("n1".into()),
        seen: None,
    };
    let (copy_addr, ca_file) = (c.node(copy).addr(), ca(&c));
    let failover_as =
        |token: &'static str| raw_hello_as(copy_addr, &ca_file, hello("owned"), Some(token));
    match failover_as("bob-secret").await {
        ServerMsg::Error(e) => {
            assert_eq!(e.code, ErrorCode::Forbidden, "{e:?}");
            assert!(e.message.contains("belongs to another principal"), "{e:?}");
        }
        other => panic!("bob's failover hello was answered {other:?}"),
    }
    let now = c.node(copy).cluster().unwrap().placement("owned").unwrap();
    assert_eq!(
        (now.primary, now.epoch),
        (placed.primary, placed.epoch),
        "a non-owner's hello promoted the copy"
    );
    // Alice's own failover promotes the copy and resumes her queue there.
    match failover_as("alice-secret").await {
        ServerMsg::Welcome { queue, .. } => {
            assert_eq!(queue, tether::protocol::QueueStatus::Resumed)
        }
        other => panic!("alice's failover hello was answered {other:?}"),
    }
    let now = c.node(copy).cluster().unwrap().placement("owned").unwrap();
    assert_eq!(now.primary, placed.secondaries[0]);
    c.shutdown().await;
}

/// A peer's RPCs each take a stream; a connection holding many calls at once (a replication
/// burst) still has room for a ping: peers get `PEER_STREAMS_MAX` concurrent streams, not a
/// client's eight. Twenty streams are held open (requests never finished) while a ping is sent.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn held_rpc_streams_leave_room_for_a_ping() {
    use tether::cluster::network::PEER_STREAMS_MAX;
    const HELD_STREAMS: usize = 20;
    const _: () = assert!(HELD_STREAMS < PEER_STREAMS_MAX as usize);
    let c = TestCluster::start(1).await;
    c.leader().await;
    let me = raft_id("n1");
    let tls_dir = c.dirs[0].path().join("tls");
    let conn = peer_connection(
        &tls_dir.join(tls::CA_CERT_FILE),
        &tls_dir.join(tls::SERVER_CERT_FILE),
        &tls_dir.join(tls::SERVER_KEY_FILE),
        c.node(0).addr(),
    )
    .await;
    let mut held = Vec::new();
    for _ in 0..HELD_STREAMS {
        let (mut send, recv) = tokio::time::timeout(STEP, conn.open_bi())
            .await
            .expect("a stream within the peer's budget")
            .expect("a stream");
        // Half a request: the node waits for the rest on this stream.
        send.write_all(&[0xa2]).await.unwrap();
        held.push((send, recv));
    }
    let ping = tether::cluster::network::encode_request(me, PeerRequest::Ping).unwrap();
    let (mut send, mut recv) = tokio::time::timeout(STEP, conn.open_bi())
        .await
        .expect("room for a ping beside the held calls")
        .unwrap();
    send.write_all(&ping).await.unwrap();
    send.finish().unwrap();
    let reply = tokio::time::timeout(STEP, recv.read_to_end(1 << 16))
        .await
        .expect("a pong in time")
        .unwrap();
    assert!(matches!(
        codec::decode_body::<PeerResponse>(&reply).unwrap(),
        PeerResponse::Pong
    ));
    drop(held);
    conn.close(0u32.into(), b"done");
    c.shutdown().await;
}

/// Issue 22 point 10: a member's calls to a peer never take every stream of the connection,
/// so a ping (failure detection) is answered at once during a burst of slow calls. Here more
/// forwarded runs than the connection has streams, each held at the receiver for
/// `FORWARD_GAP_WAIT_MS` (it waits for a predecessor that never comes), then a ping through
/// the same pool: it must be answered while every run is still waiting.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_burst_of_slow_calls_leaves_a_stream_for_pings() {
    use tether::cluster::network::PEER_STREAMS_MAX;
    use tether::limits::FORWARD_GAP_WAIT_MS;
    let c = TestCluster::start(2).await;
    c.leader().await;
    let receiver = raft_id(&c.names[1]);
    let tls_dir = c.dirs[0].path().join("tls");
    let to = c.node(1).addr();
    let pool = std::sync::Arc::new(pool_with(
        &ca(&c),
        &tls_dir.join(tls::SERVER_CERT_FILE),
        &tls_dir.join(tls::SERVER_KEY_FILE),
        to,
    ));
    let origin = c.names[0].clone();
    let log = fresh_log();
    let runs: Vec<_> = (0..PEER_STREAMS_MAX as u64 + 8)
        .map(|i| {
            let pool = pool.clone();
            // Far past anything applied: each waits for its predecessor, then is deferred.
            let run = run_of(&origin, log, 1_000_000 + i, &["never"], Some(999_999 + i));
            tokio::spawn(async move { pool.call(receiver, &to.to_string(), run, STEP).await })
        })
        .collect();
    tokio::time::sleep(Duration::from_millis(FORWARD_GAP_WAIT_MS / 4)).await;
    assert!(
        runs.iter().all(|r| !r.is_finished()),
        "a run was answered before its wait ended"
    );
    let pong = pool
        .call(receiver, &to.to_string(), PeerRequest::Ping, STEP)
        .await
        .expect("a ping answered");
    assert!(matches!(pong, PeerResponse::Pong));
    let waiting = runs.iter().filter(|r| !r.is_finished()).count();
    assert_eq!(
        waiting,
        runs.len(),
        "the ping waited for a stream until a run was answered"
    );
    for r in runs {
        match r.await.unwrap() {
            Ok(PeerResponse::PublishDeferred { .. }) => {}
            other => panic!(
                "a run past a gap should be deferred, got {:?}",
                other.map(|_| ())
            ),
        }
    }
    c.shutdown().await;
}

/// A run of `origin`'s publish log starting at `log` (0: a log from before starts were told,
/// which starts at 1): the puts of `keys` at its positions `first`, `first + 1`... (position 1
/// is offset `log`), following position `follows` when given.
fn run_of(origin: &str, log: u64, first: u64, keys: &[&str], follows: Option<u64>) -> PeerRequest {
    let base = log.saturating_sub(1);
    PeerRequest::Publish {
        origin: origin.into(),
        log_start: log,
        entries: keys
            .iter()
            .zip(base + first..)
            .map(|(key, offset)| {
                let publish = ForwardedPublish {
                    session: 77,
                    first_seq: offset,
                    ops: vec![PublishOp::Put {
                        region: REGION.into(),
                        key: (*key).into(),
                        value: b"run".to_vec(),
                    }],
                };
                (offset, publish)
            })
            .collect(),
        floor: 0,
        follows: follows.map(|f| base + f),
    }
}

/// The start of a publish log created now: past the log of every node started before (a
/// test speaking in a member's name sends runs of a log of its own, which the receiver takes
/// as the member's new log).
fn fresh_log() -> u64 {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64;
    tether::control::forward::new_log_start(now)
}

/// Publish forwarding with runs in flight (`FORWARD_RPCS_IN_FLIGHT_MAX`): runs of one origin
/// that arrive out of order are applied in log order, and a run whose predecessor never
/// arrives is answered with what is applied, applying nothing of its own, as is a run that
/// starts past what is applied; sent again from there, nothing is lost and nothing applied
/// twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forwarded_runs_out_of_order_are_applied_in_order() {
    use tether::limits::FORWARD_GAP_WAIT_MS;
    let c = TestCluster::start(3).await;
    c.leader().await;
    let (d, mut ev) = watcher(&c).await;
    let cluster = c.node(0).cluster().expect("clustered");
    let placed = cluster.placement(WATCHER).expect("the watcher is placed");
    // A member that is not the watcher's primary forwards to it, in its own name (it
    // publishes nothing itself in this test, so its log is the test's).
    let sender = (0..3)
        .map(|i| raft_id(&c.names[i]))
        .find(|id| *id != placed.primary)
        .expect("another member");
    let tls_dir = c.dirs[c.index_of(sender)].path().join("tls");
    let origin = c.names[c.index_of(sender)].clone();
    let to = c.node(c.index_of(placed.primary)).addr();
    let pool = std::sync::Arc::new(pool_with(
        &ca(&c),
        &tls_dir.join(tls::SERVER_CERT_FILE),
        &tls_dir.join(tls::SERVER_KEY_FILE),
        to,
    ));
    let call = |request: PeerRequest| {
        let pool = pool.clone();
        let primary = placed.primary;
        tokio::spawn(async move { pool.call(primary, &to.to_string(), request, STEP).await })
    };
    // Runs of a log of the test's (the receiver takes it as the member's new one).
    let log = fresh_log();
    let at = |position: u64| log - 1 + position;
    // The second run arrives first: it waits for the first.
    let second = call(run_of(&origin, log, 2, &["k2"], Some(1)));
    tokio::time::sleep(Duration::from_millis(FORWARD_GAP_WAIT_MS / 4)).await;
    assert!(
        !second.is_finished(),
        "a run was applied before the one it follows"
    );
    let first = call(run_of(&origin, log, 1, &["k1"], None));
    assert!(matches!(
        first.await.unwrap(),
        Ok(PeerResponse::Published { through }) if through == at(1)
    ));
    assert!(matches!(
        second.await.unwrap(),
        Ok(PeerResponse::Published { through }) if through == at(2)
    ));
    assert_eq!(keys(&take_events(&mut ev, 2).await), ["k1", "k2"]);
    // A run whose predecessor (offset 3) is lost: answered with what is applied.
    match call(run_of(&origin, log, 4, &["k4"], Some(3)))
        .await
        .unwrap()
    {
        Ok(PeerResponse::PublishDeferred { through, .. }) if through == at(2) => {}
        Ok(_) => panic!("a run past a gap was applied"),
        Err(e) => panic!("no answer: {e}"),
    }
    // Sent again from what was confirmed (a retry carries what was applied already).
    assert!(matches!(
        call(run_of(&origin, log, 2, &["k2", "k3", "k4"], None))
            .await
            .unwrap(),
        Ok(PeerResponse::Published { through }) if through == at(4)
    ));
    assert_eq!(keys(&take_events(&mut ev, 2).await), ["k3", "k4"]);
    assert!(
        drain_quiet(&mut ev).await.is_empty(),
        "something was applied twice"
    );
    // A run that starts past what is applied and names no run before it (what a sender's bug
    // would send) applies nothing either: answered with what is applied, then sent again
    // from there.
    match call(run_of(&origin, log, 6, &["k6"], None)).await.unwrap() {
        Ok(PeerResponse::PublishDeferred { through, .. }) if through == at(4) => {}
        Ok(_) => panic!("a run past a gap was applied"),
        Err(e) => panic!("no answer: {e}"),
    }
    assert!(
        drain_quiet(&mut ev).await.is_empty(),
        "an entry past a gap was applied"
    );
    assert!(matches!(
        call(run_of(&origin, log, 5, &["k5", "k6"], None)).await.unwrap(),
        Ok(PeerResponse::Published { through }) if through == at(6)
    ));
    assert_eq!(keys(&take_events(&mut ev, 2).await), ["k5", "k6"]);
    pool.close();
    drop(ev);
    d.close(false).await.ok();
    c.shutdown().await;
}

/// Issue 22 point 5: a queue's info (its durable interest, up to
/// `INTEREST_BYTES_PER_QUEUE_MAX`, its timeout and away time) goes to a copy when it changes,
/// not with every replication message. An idle queue with a large interest costs its primary's
/// peer connection heartbeats only; each change still reaches the copy: the registration is
/// answered once the copy holds it, and the copy learns of its client going away.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_queues_info_goes_to_its_copies_once_per_change() {
    /// Keys of the large interest, each of `KEY_BYTES` bytes.
    const KEYS: usize = 1_500;
    const KEY_BYTES: usize = 1_000;
    /// The window in which the queue is idle: many heartbeats long.
    const IDLE: Duration = Duration::from_secs(3);
    let c = TestCluster::start(2).await;
    c.leader().await;
    let (d, ev) = watcher(&c).await;
    let big: Vec<String> = (0..KEYS)
        .map(|i| format!("{i:05}{}", "k".repeat(KEY_BYTES - 5)))
        .collect();
    let interest_bytes = KEYS * KEY_BYTES;
    d.region(REGION)
        .register(Interest::keys(big))
        .await
        .expect("a large interest, within the per-queue limit");
    let primary = (0..2)
        .find(|&i| {
            c.node(i)
                .queues()
                .iter()
                .any(|q| q.durable_id.as_deref() == Some(WATCHER))
        })
        .expect("a primary holds the watcher's queue");
    let sent = || {
        c.node(primary)
            .cluster()
            .expect("clustered")
            .peer_bytes_sent()
    };
    // Settled: the registration is answered once the copy holds it.
    let before = sent();
    tokio::time::sleep(IDLE).await;
    let idle = sent().saturating_sub(before);
    println!(
        "idle queue with a {interest_bytes}-byte interest: {idle} bytes to its copy in {IDLE:?}"
    );
    assert!(
        idle < (interest_bytes / 8) as u64,
        "an idle queue sent {idle} bytes to its copy in {IDLE:?}: its {interest_bytes}-byte interest rides on its heartbeats"
    );
    // A node that holds no copy of a queue asks for the info of a message without it (here
    // one from the real primary of a queue without copies, with that node's certificate).
    let placed = c
        .node(0)
        .cluster()
        .expect("clustered")
        .placement(WATCHER)
        .expect("placed");
    let copy_node = c.index_of(placed.secondaries[0]);
    let mut solo = None;
    for k in 0..32 {
        let id = format!("solo-{k}");
        let client = ClientBuilder::new()
            .servers(addrs(&c))
            .ca_file(ca(&c))
            .durable(&id, 600)
            .connect()
            .await
            .expect("a durable client without copies");
        let p = c.node(0).cluster().unwrap().placement(&id).expect("placed");
        if p.primary == placed.primary {
            solo = Some((client, id, p.epoch));
            break;
        }
        client.close(false).await.expect("close");
    }
    let (solo_client, solo_id, solo_epoch) = solo.expect("a queue placed on the primary");
    let tls_dir = c.dirs[primary].path().join("tls");
    let to = c.node(copy_node).addr();
    let as_primary = pool_with(
        &ca(&c),
        &tls_dir.join(tls::SERVER_CERT_FILE),
        &tls_dir.join(tls::SERVER_KEY_FILE),
        to,
    );
    let answer = as_primary
        .call(
            placed.secondaries[0],
            &to.to_string(),
            forged_replicate(placed.primary, &solo_id, solo_epoch),
            STEP,
        )
        .await
        .expect("an answer");
    assert!(
        matches!(answer, PeerResponse::QueueInfoNeeded),
        "a message without info for a queue the node holds no copy of was not answered queue-info-needed"
    );
    solo_client.close(false).await.expect("close");
    // A change still reaches the copy: one more key, then the client goes away.
    d.region(REGION)
        .register(Interest::key("one-more"))
        .await
        .expect("register one more key");
    drop(ev);
    d.close(true).await.expect("close, keeping the queue");
    let admin = ClientBuilder::new()
        .servers(addrs(&c))
        .ca_file(ca(&c))
        .connect()
        .await
        .expect("an admin client");
    let copy_view = || copy_report(&admin, WATCHER);
    let deadline = tokio::time::Instant::now() + STEP;
    loop {
        let view = copy_view().await;
        let held = view.as_ref().is_some_and(|q| {
            q.state == "away"
                && q.interests
                    .iter()
                    .any(|i| i.spec.as_deref() == Some("one-more"))
        });
        if held {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the copy never learnt of the change: {view:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    c.shutdown().await;
}

/// Issue 22 point 13: members' clocks may disagree by any amount. Here n2's clock runs an
/// hour ahead. A durable client (timeout 600 s) whose copy is on n2 goes away with events
/// waiting; its primary n1 stops, and n2 promotes the copy. The queue must last the client's
/// whole timeout on n2's clock: the copy measured the away time against the primary's clock
/// and keeps it in its own (before, it kept n1's instant, an hour old on n2's clock, and the
/// promoted queue expired at once with its events).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_copy_whose_clock_runs_ahead_keeps_the_away_queue() {
    use tether::protocol::QueueStatus;
    /// How far n2's clock runs ahead of the others, in milliseconds.
    const SKEW_MS: i64 = 3_600_000;
    const TIMEOUT_SECS: u64 = 600;
    let mut c = TestCluster::start_full(3, tether::config::Limits::default(), None, |cfg| {
        if cfg.node_id.as_deref() == Some("n2") {
            cfg.clock_offset_ms = SKEW_MS;
        }
    })
    .await;
    c.leader().await;
    // A durable id whose primary is n1 (the node it connects to) and whose copy is on n2.
    let (d, id) = durable_on_n1_copied_on_n2(&c, "skewed", TIMEOUT_SECS).await;
    d.region(REGION)
        .register(Interest::all_keys())
        .await
        .expect("register");
    d.close(true).await.expect("away, keeping the queue");
    let publisher = ClientBuilder::new()
        .server(c.node(2).addr())
        .ca_file(ca(&c))
        .connect()
        .await
        .expect("a publisher");
    for k in ["a", "b", "c"] {
        publisher
            .region(REGION)
            .put(k, b"v".to_vec())
            .await
            .expect("put");
    }
    // The copy holds the events and the away time, in its own clock.
    let admin = ClientBuilder::new()
        .server(c.node(1).addr())
        .ca_file(ca(&c))
        .connect()
        .await
        .expect("an admin client");
    let deadline = tokio::time::Instant::now() + STEP;
    let away_since = loop {
        let copy = copy_report(&admin, &id).await;
        if let Some(q) = &copy
            && q.end_offset - q.acked_offset == 3
            && let Some(since) = q.away_since_ms
        {
            break since;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the copy never held the away queue: {copy:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    let wall = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64;
    assert!(
        away_since + 60_000 >= wall + SKEW_MS as u64,
        "the copy keeps the away time in the primary's clock: {away_since}, its own clock reads about {}",
        wall + SKEW_MS as u64
    );
    publisher.close(false).await.ok();
    admin.close(false).await.ok();
    // n1 stops; n2 promotes its copy once n1 is declared failed.
    c.nodes[0].take().unwrap().shutdown().await;
    let deadline = tokio::time::Instant::now() + STEP * 3;
    while c
        .node(1)
        .queues()
        .iter()
        .all(|q| q.durable_id.as_deref() != Some(id.as_str()))
    {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the copy was never promoted"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // Expiry is checked every EXPIRY_TICK_MS: give it several ticks to act.
    tokio::time::sleep(Duration::from_millis(5 * tether::limits::EXPIRY_TICK_MS)).await;
    let d = ClientBuilder::new()
        .servers([c.node(1).addr(), c.node(2).addr()])
        .ca_file(ca(&c))
        .durable(&id, TIMEOUT_SECS)
        .redundancy(1)
        .connect()
        .await
        .expect("the client comes back");
    assert_eq!(d.queue_status(), QueueStatus::Resumed, "the queue expired");
    assert_eq!(d.pending(), Some(3));
    d.region(REGION)
        .register(Interest::all_keys())
        .await
        .expect("register");
    d.ready_for_events().await.expect("ready");
    let mut ev = d.events().expect("events");
    assert_eq!(keys(&take_events(&mut ev, 3).await), ["a", "b", "c"]);
    d.close(false).await.ok();
    c.shutdown().await;
}

/// Bob's durable hello for `id` (alice's, expired) at `addr` is refused `forbidden`.
async fn bob_is_refused(addr: SocketAddr, ca: &Path, id: &str) {
    let hello = DurableHello {
        redirect_epoch: None,
        id: id.into(),
        timeout_secs: 1,
        redundancy: 0,
        failed_primary: None,
        seen: None,
    };
    match raw_hello_as(addr, ca, hello, Some("bob-secret")).await {
        ServerMsg::Error(e) => assert_eq!(e.code, ErrorCode::Forbidden, "{e:?}"),
        other => panic!("bob's hello at {addr} for alice's expired id was answered {other:?}"),
    }
}

/// Issue 22 point 2: a placement committed for a durable hello whose queue is then refused
/// is released at once, so refused hellos leave nothing in the cluster's metadata. Here bob
/// asks for the id of alice's expired queue: the node places it, then refuses bob
/// (`forbidden`: the expired id stays alice's). The placement must go; alice still learns
/// `expired` and gets her id back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_hello_leaves_no_placement() {
    use tether::protocol::QueueStatus;
    let auth = alice_and_bob();
    let c = TestCluster::start_full(3, tether::config::Limits::default(), Some(auth), |_| {}).await;
    c.leader().await;
    let connect_as = |token: &'static str| {
        ClientBuilder::new()
            .server(c.node(0).addr())
            .ca_file(ca(&c))
            .token(token)
            .durable("brief", 1)
            .connect()
    };
    let a = connect_as("alice-secret").await.expect("alice connects");
    assert_eq!(a.node_id(), "n1");
    a.close(true).await.expect("away");
    let meta = c.node(0).cluster().expect("clustered");
    let deadline = tokio::time::Instant::now() + STEP;
    while meta.placement("brief").is_some() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "alice's queue never expired"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    bob_is_refused(c.node(0).addr(), &ca(&c), "brief").await;
    let deadline = tokio::time::Instant::now() + STEP;
    while let Some(p) = meta.placement("brief") {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the refused hello's placement stayed: {p:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let a = connect_as("alice-secret").await.expect("alice comes back");
    assert_eq!(a.queue_status(), QueueStatus::Expired);
    a.close(false).await.ok();
    c.shutdown().await;
}

/// Issue 22 point 11: a member that applied forwarded publishes but whose copies do not hold
/// them within its wait says so (`PublishedUnconfirmed`), and the origin does not count them as
/// replicated there: a `--ack replicated` publish gets `unavailable` naming what is replicated
/// where, never a success. A retried run (its first answer lost) is confirmed only once every
/// copy on the member holds what the member holds.
///
/// n1 holds a durable queue whose copy is on n2; n2 stops, and is not declared failed during
/// the test (`node_failure_ms`), so n1's copy never confirms. n3 publishes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_member_whose_copies_lag_never_claims_a_publish_replicated() {
    use tether::protocol::PublishAck;
    /// The wait of n1 and n2 for their copies, in milliseconds: short, so n1 answers before
    /// n2 is declared down.
    const MEMBER_WAIT_MS: u64 = 300;
    /// The wait of n3 (the origin), in milliseconds: long enough for n1's answer to arrive.
    const ORIGIN_WAIT_MS: u64 = 8_000;
    let mut c = TestCluster::start_full(3, tether::config::Limits::default(), None, |cfg| {
        cfg.node_failure_ms = 60_000;
        cfg.replicated_ack_timeout_ms = if cfg.node_id.as_deref() == Some("n3") {
            ORIGIN_WAIT_MS
        } else {
            MEMBER_WAIT_MS
        };
    })
    .await;
    c.leader().await;
    let (d, _id) = durable_on_n1_copied_on_n2(&c, "lagging", 600).await;
    d.region(REGION)
        .register(Interest::all_keys())
        .await
        .expect("register");
    d.ready_for_events().await.expect("ready");
    let mut ev = d.events().expect("events");
    until_live(&mut ev, REGION).await;
    let publisher = ClientBuilder::new()
        .server(c.node(2).addr())
        .ca_file(ca(&c))
        .publish_ack(PublishAck::Replicated)
        .connect()
        .await
        .expect("a publisher on n3");
    // Every member up: the publish is replicated everywhere (n3's publish log offset 1).
    publisher
        .region(REGION)
        .put("before", b"v".to_vec())
        .await
        .expect("replicated while every member is up");
    assert_eq!(keys(&take_events(&mut ev, 1).await), ["before"]);
    c.nodes[1].take().unwrap().shutdown().await;
    // Until n3 sees n2 down it waits for n2 too; then n2 is not waited for, and n1's answer
    // decides.
    let deadline = tokio::time::Instant::now() + STEP * 2;
    let refused = loop {
        match publisher.region(REGION).put("after", b"v".to_vec()).await {
            Ok(_) => panic!("a publish n1 holds unreplicated was acknowledged as replicated"),
            Err(e) if e.to_string().contains("not applied yet on n2") => {
                assert!(
                    tokio::time::Instant::now() < deadline,
                    "n3 never saw n2 down: {e}"
                );
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            Err(e) => break e.to_string(),
        }
    };
    assert!(
        refused.contains("applied on n1 but not confirmed"),
        "the refusal names n1 as applied but unconfirmed: {refused}"
    );
    assert!(
        refused.contains("n2 down"),
        "the refusal names n2 as down: {refused}"
    );
    // A retry of n3's first run, as after a lost answer: n1 applied it long ago, and it is
    // confirmed only if every copy on n1 holds what n1 holds, which n2's does not.
    let tls_dir = c.dirs[2].path().join("tls");
    let to = c.node(0).addr();
    let pool = pool_with(
        &ca(&c),
        &tls_dir.join(tls::SERVER_CERT_FILE),
        &tls_dir.join(tls::SERVER_KEY_FILE),
        to,
    );
    match pool
        .call(
            raft_id("n1"),
            &to.to_string(),
            run_of("n3", 0, 1, &["before"], None),
            STEP,
        )
        .await
    {
        Ok(PeerResponse::PublishedUnconfirmed { through, .. }) => assert!(through >= 1),
        Ok(PeerResponse::Published { .. }) => {
            panic!("a retried run was confirmed while a copy on n1 lags")
        }
        Ok(_) => panic!("the retried run was not applied"),
        Err(e) => panic!("no answer: {e}"),
    }
    pool.close();
    publisher.close(false).await.ok();
    drop(ev);
    d.close(false).await.ok();
    c.shutdown().await;
}

/// Issue 22 point 7: an expired durable id keeps its owner on every member, not only on the
/// node where it expired. Alice's queue expires on n1; Bob asks n2 for the id and is refused
/// `forbidden` before anything is placed (he neither takes the id nor learns that it expired);
/// Alice then gets it back on n2 as `expired`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_expired_id_keeps_its_owner_on_every_member() {
    use tether::protocol::QueueStatus;
    let auth = alice_and_bob();
    let c = TestCluster::start_full(3, tether::config::Limits::default(), Some(auth), |_| {}).await;
    c.leader().await;
    let a = ClientBuilder::new()
        .server(c.node(0).addr())
        .ca_file(ca(&c))
        .token("alice-secret")
        .durable("kept", 1)
        .connect()
        .await
        .expect("alice connects");
    assert_eq!(a.node_id(), "n1");
    a.close(true).await.expect("away");
    let meta = c.node(1).cluster().expect("clustered");
    let deadline = tokio::time::Instant::now() + STEP;
    while meta.placement("kept").is_some() || !meta.read(|s| s.expired.iter().any(|e| e == "kept"))
    {
        assert!(
            tokio::time::Instant::now() < deadline,
            "n2 never learned that alice's queue expired"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    bob_is_refused(c.node(1).addr(), &ca(&c), "kept").await;
    assert!(
        meta.placement("kept").is_none(),
        "bob's refused hello placed the id"
    );
    let a = ClientBuilder::new()
        .server(c.node(1).addr())
        .ca_file(ca(&c))
        .token("alice-secret")
        .durable("kept", 1)
        .connect()
        .await
        .expect("alice comes back on n2");
    assert_eq!(a.node_id(), "n2");
    assert_eq!(a.queue_status(), QueueStatus::Expired);
    a.close(false).await.ok();
    c.shutdown().await;
}

/// Issue 25 point 7, redirects converge: a redirect names the placement epoch it sends the
/// client by, and a node whose metadata has not applied the epoch a hello names does not act
/// on its older view (it would send the client back): it waits for its metadata, and if that
/// does not come (here an epoch no log reaches), it answers `unavailable` and places nothing.
/// (`control::reconcile::redirect_catch_up` has the model of why the chains end.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redirected_hello_waits_for_the_metadata_it_was_sent_by() {
    let c = TestCluster::start(3).await;
    c.leader().await;
    let ca = ca(&c);
    let hello = |id: &str, redirect_epoch| DurableHello {
        redirect_epoch,
        id: id.into(),
        timeout_secs: 60,
        redundancy: 1,
        failed_primary: None,
        seen: None,
    };
    // Placed on n1 by its first hello; n2 redirects there, naming the placement's epoch.
    let first = ClientBuilder::new()
        .server(c.node(0).addr())
        .ca_file(&ca)
        .durable("q", 60)
        .redundancy(1)
        .connect()
        .await
        .expect("placed on n1");
    first.close(true).await.expect("away");
    let placement = c.node(1).cluster().unwrap().placement("q").expect("placed");
    match raw_hello(c.node(1).addr(), &ca, hello("q", None)).await {
        ServerMsg::Redirect { node_id, epoch, .. } => {
            assert_eq!((node_id.as_str(), epoch), ("n1", Some(placement.epoch)))
        }
        other => panic!("n2 answered {other:?}"),
    }
    // Naming that epoch, the hello is served where the redirect pointed.
    match raw_hello(c.node(0).addr(), &ca, hello("q", Some(placement.epoch))).await {
        ServerMsg::Welcome { node_id, .. } => assert_eq!(node_id, "n1"),
        other => panic!("n1 answered {other:?}"),
    }
    // An epoch this node's metadata has not applied (nor will): refused after the wait, and
    // not acted on: the unplaced id is not placed.
    let ahead = c.node(2).cluster().unwrap().applied_index() + 1_000_000;
    let asked = std::time::Instant::now();
    match raw_hello(c.node(2).addr(), &ca, hello("fresh", Some(ahead))).await {
        ServerMsg::Error(e) => {
            assert_eq!(e.code, ErrorCode::Unavailable, "{e:?}");
            assert!(
                e.message.contains("behind the node that redirected"),
                "{e:?}"
            );
        }
        other => panic!("n3 answered {other:?}"),
    }
    let waited = asked.elapsed();
    assert!(
        waited >= Duration::from_millis(tether::server::REDIRECT_CATCH_UP_MS),
        "answered after {waited:?}, without waiting for the metadata"
    );
    assert!(c.node(2).cluster().unwrap().placement("fresh").is_none());
    c.shutdown().await;
}

/// The refusals a member counts in `tether_peer_refused_total`, by reason, as an operator reads
/// them from the `/metrics` of a `tether server` process: a run of a member's publish log past
/// a gap (`forward_gap`) and a publish in another member's name (`sender_mismatch`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refused_peer_requests_are_counted_by_reason() {
    use common::cluster::{ProcCluster, free_ports};
    let c = ProcCluster::start_routed_observed(free_ports(2), vec![vec![None; 2]; 2]);
    c.leader().await;
    let tls_dir = c.dirs[0].path().join("tls");
    let to = c.addr(1);
    let pool = pool_with(
        &tls_dir.join(tls::CA_CERT_FILE),
        &tls_dir.join(tls::SERVER_CERT_FILE),
        &tls_dir.join(tls::SERVER_KEY_FILE),
        to,
    );
    let n2 = raft_id("n2");
    let refused = |reason: &str| -> u64 {
        let metrics = c.get(1).metrics.expect("serving /metrics").to_string();
        let label = format!("reason=\"{reason}\"");
        common::http_get(&metrics, "/metrics")
            .lines()
            .find(|l| l.starts_with("tether_peer_refused_total{") && l.contains(&label))
            .and_then(|l| l.rsplit(' ').next()?.parse().ok())
            .unwrap_or(0)
    };
    assert_eq!(refused("forward_gap"), 0);
    assert_eq!(refused("sender_mismatch"), 0);
    // n1's log (one of the test's, starting at `log`) from its fifth entry, nothing before.
    let log = fresh_log();
    match pool
        .call(
            n2,
            &to.to_string(),
            run_of("n1", log, 5, &["gap"], None),
            STEP,
        )
        .await
    {
        Ok(PeerResponse::PublishDeferred { through, .. }) => assert_eq!(through, log - 1),
        Ok(_) => panic!("a run past a gap was applied"),
        Err(e) => panic!("no answer: {e}"),
    }
    // n1 publishing in n2's name.
    match pool
        .call(n2, &to.to_string(), forged_publish("n2", "forged"), STEP)
        .await
    {
        Ok(PeerResponse::BadRequest(why)) => assert!(why.contains("origin"), "{why}"),
        Ok(_) => panic!("a publish in another member's name was taken"),
        Err(e) => panic!("no answer: {e}"),
    }
    assert_eq!(refused("forward_gap"), 1);
    assert_eq!(refused("sender_mismatch"), 1);
    pool.close();
}
