//! The HTTP admin surface of real nodes (axum on loopback, RocksDB in temp dirs, clients over
//! QUIC+TLS): health and readiness, `/metrics` with the per-queue lag series, the JSON API
//! (queues with their lag, paged, sorted, filtered, cluster-wide through any member), its bad
//! input, and its admin role where the node authenticates clients.

mod common;

use std::io::{Read, Write};
use std::net::SocketAddr;

use common::cluster::TestCluster;
use common::*;
use serde_json::Value;
use tether::auth::{AuthConfig, TokenEntry, hash_token};
use tether::client::Interest;
use tether::config::ServerConfig;
use tether::server::Node;

/// A response: status, headers (lower-case names) and body.
struct Http {
    status: u16,
    headers: String,
    body: String,
}

impl Http {
    fn json(&self) -> Value {
        serde_json::from_str(&self.body).unwrap_or_else(|e| panic!("not JSON ({e}): {}", self.body))
    }
}

/// One HTTP/1.1 request on a fresh connection (blocking std socket, on a blocking thread).
async fn request(addr: SocketAddr, method: &str, path: &str, headers: &[(&str, &str)]) -> Http {
    let (method, path) = (method.to_string(), path.to_string());
    let headers: Vec<(String, String)> = headers
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    tokio::task::spawn_blocking(move || {
        let mut s = std::net::TcpStream::connect(addr).expect("connect");
        s.set_read_timeout(Some(WAIT)).unwrap();
        let mut req = format!("{method} {path} HTTP/1.1\r\nhost: {addr}\r\nconnection: close\r\n");
        for (k, v) in &headers {
            req.push_str(&format!("{k}: {v}\r\n"));
        }
        req.push_str("\r\n");
        s.write_all(req.as_bytes()).unwrap();
        let mut raw = Vec::new();
        s.read_to_end(&mut raw).unwrap();
        let raw = String::from_utf8(raw).expect("utf-8 response");
        let (head, body) = raw.split_once("\r\n\r\n").expect("a response head");
        let status = head.split(' ').nth(1).unwrap().parse().unwrap();
        Http {
            status,
            headers: head.to_ascii_lowercase(),
            body: body.to_string(),
        }
    })
    .await
    .unwrap()
}

async fn get(addr: SocketAddr, path: &str) -> Http {
    request(addr, "GET", path, &[]).await
}

async fn start_node(auth: Option<AuthConfig>) -> (Node, tempfile::TempDir) {
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = ServerConfig::ephemeral(dir.path());
    cfg.metrics = Some("127.0.0.1:0".parse().unwrap());
    cfg.metrics_top_queues = 2;
    cfg.auth = auth;
    (Node::start(cfg).await.expect("node starts"), dir)
}

/// A durable client that registers `interest` in `region`, becomes ready and goes away
/// keeping its queue.
async fn away_durable(
    builder: tether::client::ClientBuilder,
    id: &str,
    region: &str,
    interest: Interest,
) {
    let c = builder.durable(id, 300).connect().await.expect("connects");
    c.region(region).register(interest).await.unwrap();
    c.ready_for_events().await.unwrap();
    c.close(true).await.unwrap();
}

async fn publish(node: &Node, region: &str, n: u32) {
    let p = node.publisher().await.unwrap();
    for i in 0..n {
        p.put(region, &format!("k{i}"), vec![b'x'; 100])
            .await
            .unwrap();
    }
}

fn ids(page: &Value) -> Vec<String> {
    page["queues"]
        .as_array()
        .unwrap()
        .iter()
        .map(|q| q["id"].as_str().unwrap().to_string())
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_reports_health_and_each_durable_queues_lag() {
    let (node, _dir) = start_node(None).await;
    let http = node.metrics_addr().expect("admin address");
    let builder = || {
        tether::client::ClientBuilder::new()
            .server(node.addr())
            .ca_file(node.ca_file())
    };
    // alpha takes every key of r, beta three keys of it, gamma region other.
    away_durable(builder(), "alpha", "r", Interest::all_keys()).await;
    away_durable(builder(), "beta", "r", Interest::keys(["k0", "k1", "k2"])).await;
    away_durable(builder(), "gamma", "other", Interest::all_keys()).await;
    publish(&node, "r", 3).await;
    publish(&node, "r", 5).await;
    publish(&node, "other", 2).await;

    let h = get(http, "/healthz").await;
    assert_eq!((h.status, h.json()["status"].as_str()), (200, Some("ok")));
    let r = get(http, "/readyz").await;
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(r.json()["ready"], true);
    assert_eq!(r.json()["reasons"], serde_json::json!([]));

    // The node and its totals.
    let n = get(http, "/api/v1/node").await.json();
    assert_eq!(n["node_id"], node.node_id());
    assert_eq!(n["queues"]["away"], 3);
    assert_eq!(n["pending_events"], 16);
    assert_eq!(n["counters"]["events_published"], 10);
    assert_eq!(n["counters"]["events_enqueued"], 16);
    let c = get(http, "/api/v1/cluster").await.json();
    assert_eq!(c["clustered"], false);
    assert_eq!(c["members"][0]["self"], true);
    assert_eq!(c["members"][0]["draining"], false);

    // Lag per queue, most pending first.
    let page = get(http, "/api/v1/queues").await;
    assert_eq!(page.status, 200, "{}", page.body);
    let page = page.json();
    assert_eq!(ids(&page), ["alpha", "beta", "gamma"]);
    assert_eq!(page["total"], 3);
    assert_eq!(page["next"], Value::Null);
    assert_eq!(
        page["queues"]
            .as_array()
            .unwrap()
            .iter()
            .map(|q| q["pending_events"].as_u64().unwrap())
            .collect::<Vec<_>>(),
        [8, 6, 2]
    );
    let alpha = &page["queues"][0];
    assert_eq!(alpha["pending_events"], 8);
    assert_eq!(alpha["state"], "away");
    assert_eq!(alpha["role"], "primary");
    assert!(alpha["pending_bytes"].as_u64().unwrap() >= 800);
    assert!(alpha["oldest_pending_age_ms"].is_u64());
    let away = alpha["away_since_ms"].as_u64().unwrap();
    assert_eq!(alpha["expires_at_ms"].as_u64().unwrap(), away + 300_000);
    assert_eq!(alpha["interests"][0]["region"], "r");
    assert_eq!(alpha["drain_eta_secs"], Value::Null, "not draining");

    // Paging: one queue at a time, following `next`, covers each once in order.
    let mut seen = Vec::new();
    let mut path = "/api/v1/queues?limit=1&sort=id&order=desc".to_string();
    loop {
        let p = get(http, &path).await.json();
        seen.extend(ids(&p));
        match p["next"].as_str() {
            Some(t) => path = format!("/api/v1/queues?limit=1&sort=id&order=desc&after={t}"),
            None => break,
        }
    }
    assert_eq!(seen, ["gamma", "beta", "alpha"]);
    // Filters.
    assert_eq!(
        ids(&get(http, "/api/v1/queues?region=other").await.json()),
        ["gamma"]
    );
    assert_eq!(
        ids(&get(http, "/api/v1/queues?prefix=be").await.json()),
        ["beta"]
    );
    assert_eq!(
        ids(&get(http, "/api/v1/queues?state=ready").await.json()),
        Vec::<String>::new()
    );
    assert_eq!(
        ids(
            &get(http, "/api/v1/queues?sort=pending&order=asc&limit=100000")
                .await
                .json()
        ),
        ["gamma", "beta", "alpha"]
    );

    // One queue in detail.
    let d = get(http, "/api/v1/queues/beta").await;
    assert_eq!(d.status, 200, "{}", d.body);
    assert_eq!(d.json()["pending_events"], 6);
    let missing = get(http, "/api/v1/queues/nobody").await;
    assert_eq!(missing.status, 404);
    assert_eq!(missing.json()["error"]["code"], "not_found");

    // Prometheus: the top 2 durable queues one by one, every queue in the histogram, the
    // write-batch histogram in operations.
    let m = get(http, "/metrics?x=1").await;
    assert_eq!(m.status, 200);
    assert!(
        m.headers.contains("content-type: text/plain"),
        "{}",
        m.headers
    );
    let series: Vec<&str> = m
        .body
        .lines()
        .filter(|l| l.starts_with("tether_queue_pending_events{"))
        .collect();
    assert_eq!(
        series,
        [
            r#"tether_queue_pending_events{durable_id="alpha"} 8"#,
            r#"tether_queue_pending_events{durable_id="beta"} 6"#
        ]
    );
    assert!(
        m.body
            .contains("tether_queue_size_events_bucket{le=\"0\"} 0\n"),
        "{}",
        m.body
    );
    assert!(
        m.body
            .contains("tether_queue_size_events_bucket{le=\"10\"} 3\n")
    );
    assert!(m.body.contains("tether_queue_size_events_count 3\n"));
    assert!(
        m.body
            .contains("tether_storage_write_batch_ops_bucket{le=\"64\"}"),
        "write batches are counted in operations"
    );
    let head = request(http, "HEAD", "/metrics", &[]).await;
    assert_eq!((head.status, head.body.as_str()), (200, ""));

    // Bad input: clear JSON errors, nothing else changes.
    for (path, status, code) in [
        ("/nowhere", 404, "not_found"),
        ("/api/v1/queues?limit=0", 400, "invalid_argument"),
        ("/api/v1/queues?limit=many", 400, "invalid_argument"),
        ("/api/v1/queues?after=garbage", 400, "invalid_argument"),
        ("/api/v1/queues?sort=size", 400, "invalid_argument"),
        ("/api/v1/queues?state=asleep", 400, "invalid_argument"),
        ("/api/v1/queues?colour=red", 400, "invalid_argument"),
        ("/api/v1/queues?scope=galaxy", 400, "invalid_argument"),
    ] {
        let r = get(http, path).await;
        assert_eq!(r.status, status, "{path}: {}", r.body);
        assert_eq!(r.json()["error"]["code"], code, "{path}");
        assert!(
            r.json()["error"]["message"]
                .as_str()
                .is_some_and(|m| !m.is_empty())
        );
    }
    // A token from another sort is refused, not misread.
    let t = get(http, "/api/v1/queues?limit=1").await.json()["next"]
        .as_str()
        .unwrap()
        .to_string();
    let r = get(http, &format!("/api/v1/queues?sort=id&after={t}")).await;
    assert_eq!(r.status, 400, "{}", r.body);
    let post = request(http, "POST", "/api/v1/queues", &[]).await;
    assert_eq!(post.status, 405);
    assert_eq!(post.json()["error"]["code"], "method_not_allowed");
    assert_eq!(get(http, "/api/v1/queues").await.json()["total"], 3);

    // The same listing over the client protocol (`tether queues`), with the lag in whole
    // numbers (the wire carries no floats).
    let admin = builder().connect().await.unwrap();
    let mut pages = Vec::new();
    let mut query = tether::protocol::QueuesQuery {
        limit: Some(2),
        ..Default::default()
    };
    loop {
        let page = admin.queues_page(query.clone()).await.unwrap();
        assert_eq!(page.total, 3);
        pages.push(
            page.queues
                .iter()
                .map(|q| q.id.clone().unwrap())
                .collect::<Vec<_>>(),
        );
        match page.next {
            Some(t) => query.after = Some(t),
            None => break,
        }
    }
    assert_eq!(pages, [vec!["alpha", "beta"], vec!["gamma"]]);
    let beta = admin
        .queues_page(tether::protocol::QueuesQuery {
            prefix: Some("beta".into()),
            ..Default::default()
        })
        .await
        .unwrap()
        .queues
        .remove(0);
    assert_eq!((beta.pending, beta.state.as_str()), (6, "away"));
    assert_eq!(beta.node.as_deref(), Some(node.node_id()));
    assert_eq!(beta.expires_at_ms, beta.away_since_ms.map(|a| a + 300_000));
    assert!(beta.oldest_pending_age_ms.is_some() && beta.ack_per_min == Some(0));
    let bad = admin
        .queues_page(tether::protocol::QueuesQuery {
            after: Some("garbage".into()),
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert!(bad.to_string().contains("paging token"), "{bad}");
    admin.close(false).await.unwrap();

    // The page and its assets are served from the binary.
    let index = get(http, "/").await;
    assert_eq!(index.status, 200);
    assert!(index.headers.contains("content-type: text/html"));
    assert!(get(http, "/app.js").await.headers.contains("javascript"));
    assert!(get(http, "/style.css").await.headers.contains("text/css"));
    node.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_api_needs_an_admin_token_where_clients_authenticate() {
    let token = |principal: &str, secret: &str| TokenEntry {
        principal: principal.into(),
        sha256: hash_token(secret),
    };
    let auth = AuthConfig {
        client_ca: None,
        client_crl: None,
        admins: vec!["ops".into()],
        tokens: vec![token("alice", "alice-secret"), token("ops", "ops-secret")],
        acl: vec![],
    };
    let (node, _dir) = start_node(Some(auth)).await;
    let http = node.metrics_addr().unwrap();
    // Load balancers and Prometheus need no token.
    assert_eq!(get(http, "/healthz").await.status, 200);
    assert_eq!(get(http, "/readyz").await.status, 200);
    assert_eq!(get(http, "/metrics").await.status, 200);
    let none = get(http, "/api/v1/queues").await;
    assert_eq!(none.status, 401);
    assert_eq!(none.json()["error"]["code"], "unauthenticated");
    let wrong = request(
        http,
        "GET",
        "/api/v1/node",
        &[("authorization", "Bearer nope")],
    )
    .await;
    assert_eq!(wrong.status, 401);
    let basic = request(
        http,
        "GET",
        "/api/v1/node",
        &[("authorization", "Basic b3Bz")],
    )
    .await;
    assert_eq!(basic.status, 401);
    let alice = request(
        http,
        "GET",
        "/api/v1/node",
        &[("authorization", "Bearer alice-secret")],
    )
    .await;
    assert_eq!(alice.status, 403);
    assert_eq!(alice.json()["error"]["code"], "forbidden");
    let ops = request(
        http,
        "GET",
        "/api/v1/queues",
        &[("authorization", "Bearer ops-secret")],
    )
    .await;
    assert_eq!(ops.status, 200, "{}", ops.body);
    // The protocol's listing needs the admin role too.
    let b = |t: &str| {
        tether::client::ClientBuilder::new()
            .server(node.addr())
            .ca_file(node.ca_file())
            .token(t)
    };
    let alice = b("alice-secret").connect().await.unwrap();
    let refused = alice.queues_page(Default::default()).await.unwrap_err();
    assert!(refused.to_string().contains("not an admin"), "{refused}");
    let ops = b("ops-secret").connect().await.unwrap();
    assert_eq!(ops.queues_page(Default::default()).await.unwrap().total, 0);
    node.shutdown().await;
}

fn with_admin_http(c: &mut ServerConfig) {
    c.metrics = Some("127.0.0.1:0".parse().unwrap());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn any_member_lists_the_queues_of_the_whole_cluster() {
    let cluster = TestCluster::start_tweaked(3, with_admin_http).await;
    let leader = cluster.leader().await;
    let http = |i: usize| cluster.node(i).metrics_addr().unwrap();
    eventually_async("every member ready", || async {
        let mut all = true;
        for i in 0..3 {
            all &= get(http(i), "/readyz").await.status == 200;
        }
        all
    })
    .await;
    // Durable queues with one copy each, placed by the cluster; events published on one node.
    for i in 0..6 {
        let b = tether::client::ClientBuilder::new()
            .server(cluster.node(i % 3).addr())
            .ca_file(cluster.node(0).ca_file())
            .redundancy(1);
        away_durable(b, &format!("q{i}"), "r", Interest::all_keys()).await;
    }
    let p = cluster.node(0).publisher().await.unwrap();
    for i in 0..4 {
        p.put("r", &format!("k{i}"), b"v".to_vec()).await.unwrap();
    }
    // Every member answers with all six primaries, each once, whatever node is asked.
    for i in 0..3 {
        eventually_async("six queues with 4 pending each", || async {
            let page = get(http(i), "/api/v1/queues").await.json();
            page["total"] == 6
                && page["unreachable"] == serde_json::json!([])
                && page["queues"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .all(|q| q["pending_events"] == 4 && q["copies"].as_array().unwrap().len() == 1)
        })
        .await;
    }
    let mut node_totals = 0;
    for i in 0..3 {
        node_totals += get(http(i), "/api/v1/queues?scope=node").await.json()["total"]
            .as_u64()
            .unwrap();
    }
    assert_eq!(node_totals, 6, "each primary on one node");
    // With the copies: twelve views, paged two at a time across the members.
    let mut seen = Vec::new();
    let mut path = "/api/v1/queues?role=all&limit=2".to_string();
    loop {
        let p = get(http(1), &path).await.json();
        assert_eq!(p["total"], 12);
        for q in p["queues"].as_array().unwrap() {
            seen.push((
                q["id"].as_str().unwrap().to_string(),
                q["role"].as_str().unwrap().to_string(),
            ));
        }
        match p["next"].as_str() {
            Some(t) => path = format!("/api/v1/queues?role=all&limit=2&after={t}"),
            None => break,
        }
    }
    seen.sort();
    seen.dedup();
    assert_eq!(seen.len(), 12, "{seen:?}");
    // Over the client protocol: any member, cluster-wide by default.
    let admin = tether::client::ClientBuilder::new()
        .server(cluster.node(2).addr())
        .ca_file(cluster.node(0).ca_file())
        .connect()
        .await
        .unwrap();
    let page = admin.queues_page(Default::default()).await.unwrap();
    assert_eq!((page.total, page.queues.len()), (6, 6));
    assert!(page.unreachable.is_empty());
    let here = admin
        .queues_page(tether::protocol::QueuesQuery {
            node_only: true,
            ..Default::default()
        })
        .await
        .unwrap();
    assert!(here.queues.iter().all(|q| q.node.as_deref() == Some("n3")));
    admin.close(false).await.unwrap();
    // A queue in detail through a member that holds neither it nor its copy, if any.
    let d = get(http(2), "/api/v1/queues/q0").await.json();
    assert_eq!(d["role"], "primary");
    assert_eq!(d["replicas"].as_array().unwrap().len(), 1);
    assert_eq!(d["replicas"][0]["role"], "secondary");
    // The members and the leader.
    let c = get(http(2), "/api/v1/cluster").await.json();
    assert_eq!(c["clustered"], true);
    assert_eq!(c["members"].as_array().unwrap().len(), 3);
    let members = c["members"].as_array().unwrap();
    assert!(members.iter().all(|m| m["draining"] == false), "{c}");
    let primaries: u64 = members
        .iter()
        .map(|m| m["primaries"].as_u64().unwrap())
        .sum();
    assert_eq!(primaries, 6, "every queue's primary counted once: {c}");
    // A member marked draining says so (`tether cluster drain`).
    let admin = tether::client::ClientBuilder::new()
        .server(cluster.node(0).addr())
        .ca_file(cluster.node(0).ca_file())
        .connect()
        .await
        .unwrap();
    admin.drain("n3", Some(true)).await.unwrap();
    admin.close(false).await.unwrap();
    // (Asked of n3, whose metadata may apply the change a moment later than n1's.)
    let started = std::time::Instant::now();
    loop {
        let c = get(http(2), "/api/v1/cluster").await.json();
        let draining: Vec<String> = c["members"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|m| m["draining"] == true)
            .map(|m| m["node_id"].as_str().unwrap().to_string())
            .collect();
        if draining == ["n3"] {
            break;
        }
        assert!(
            started.elapsed() < std::time::Duration::from_secs(10),
            "{c}"
        );
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    assert_eq!(c["leader"], cluster.names[leader].as_str());
    assert!(
        c["members"]
            .as_array()
            .unwrap()
            .iter()
            .all(|m| m["alive"] == true)
    );
    cluster.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_member_without_its_cluster_is_not_ready_and_says_why() {
    let dirs = common::cluster::cluster_dirs(1);
    let ports = common::cluster::free_ports(3);
    let peers: Vec<(String, String)> = (0..3)
        .map(|i| (format!("n{}", i + 1), format!("127.0.0.1:{}", ports[i])))
        .collect();
    let mut cfg = common::cluster::node_config(dirs[0].path(), "n1", ports[0], &peers);
    with_admin_http(&mut cfg);
    let node = Node::start(cfg).await.unwrap();
    let http = node.metrics_addr().unwrap();
    assert_eq!(
        get(http, "/healthz").await.status,
        200,
        "alive, though not ready"
    );
    let r = get(http, "/readyz").await;
    assert_eq!(r.status, 503, "{}", r.body);
    let reasons = r.json()["reasons"].to_string();
    assert!(reasons.contains("leader"), "{reasons}");
    // Its listing names the members it could not ask.
    let page = get(http, "/api/v1/queues").await.json();
    let mut unreachable: Vec<String> = page["unreachable"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_str().unwrap().to_string())
        .collect();
    unreachable.sort();
    assert_eq!(unreachable, ["n2", "n3"]);
    node.shutdown().await;
}

/// Waits (up to [`WAIT`]) until the async condition holds.
async fn eventually_async<F, Fut>(what: &str, mut f: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = tokio::time::Instant::now() + WAIT;
    while !f().await {
        assert!(
            tokio::time::Instant::now() < deadline,
            "timed out waiting for {what}"
        );
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_consuming_client_shows_its_rates() {
    let (node, _dir) = start_node(None).await;
    let http = node.metrics_addr().unwrap();
    let c = tether::client::ClientBuilder::new()
        .server(node.addr())
        .ca_file(node.ca_file())
        .durable("reader", 300)
        .connect()
        .await
        .unwrap();
    c.region("r").register(Interest::all_keys()).await.unwrap();
    let mut events = c.events().unwrap();
    c.ready_for_events().await.unwrap();
    // A publisher at a steady pace while the client reads (and acks) everything; rates are
    // sampled every 5 s, so they show after one full interval.
    let p = node.publisher().await.unwrap();
    let reader = tokio::spawn(async move { while events.next().await.is_some() {} });
    let mut seen = None;
    for i in 0..200u32 {
        p.put("r", &format!("k{i}"), b"v".to_vec()).await.unwrap();
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        if i % 10 == 0 {
            let q = get(http, "/api/v1/queues/reader").await.json();
            if q["ack_rate"].as_f64().unwrap() > 0.0 {
                seen = Some(q);
                break;
            }
        }
    }
    let q = seen.expect("an ack rate within 10 s");
    assert_eq!(q["state"], "ready");
    assert!(q["enqueue_rate"].as_f64().unwrap() > 0.0, "{q}");
    assert!(q["delivery_rate"].as_f64().unwrap() > 0.0, "{q}");
    // Keeping up: little or nothing pending, so it drains at once or soon.
    assert!(q["pending_events"].as_u64().unwrap() < 50, "{q}");
    reader.abort();
    drop(c);
    node.shutdown().await;
}
