//! The HTTP admin surface on the metrics address (axum): `/healthz`, `/readyz`, `/metrics`,
//! the JSON API under `/api/v1/` and the admin web page at `/`. A thin driver: what a queue's
//! lag is, how listings filter, sort, page and merge, and how the lag metrics render is
//! `crate::admin`, plain data.
//!
//! `/healthz`, `/readyz` and `/metrics` are open (load balancers and Prometheus); the API needs
//! an admin principal's bearer token where the node authenticates clients.
//!
//! `/readyz` checks storage, the metadata caught up and a leader known; `/metrics` is the
//! recorder's text plus the lag series rendered at each scrape. The node's views of its queues
//! are its primaries (with each copy's lag) and its copies; a cluster-wide listing sends the
//! same query to every member in parallel (`PeerRequest::ListQueues`) and merges the pages.
//! `NodeStats` keeps the event totals behind the page's rate chart.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use axum::Router;
use axum::extract::{Path, Query, Request, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use serde_json::{Value, json};

use super::Shared;
use crate::admin::{ListQuery, Page, QUEUES_PAGE_MAX, QueueView, RoleFilter};
use crate::cluster::network::{PeerRequest, PeerResponse};
use crate::protocol::CopyLag;

/// How long a cluster-wide listing waits for each other member, in milliseconds.
pub const ADMIN_PEER_TIMEOUT_MS: u64 = 2_000;
/// Longest bearer token read from an `Authorization` header, in bytes.
const BEARER_TOKEN_BYTES_MAX: usize = 4_096;

/// Totals since the node started, for the API and the page's rate chart (the same events as
/// the Prometheus counters of the same names).
#[derive(Default)]
pub(crate) struct NodeStats {
    pub(crate) published: AtomicU64,
    pub(crate) enqueued: AtomicU64,
    pub(crate) delivered: AtomicU64,
    pub(crate) acked: AtomicU64,
    /// Resumed queues whose client saw entries they did not mark delivered (issue 22, point 9).
    pub(crate) seen_flags_raised: AtomicU64,
    /// Resumed queues that lost entries their client saw.
    pub(crate) seen_diverged: AtomicU64,
}

impl NodeStats {
    pub(crate) fn add(counter: &AtomicU64, n: u64) {
        counter.fetch_add(n, Ordering::Relaxed);
    }
}

struct Admin {
    shared: Weak<Shared>,
    started: Instant,
    /// The node's QUIC address.
    addr: SocketAddr,
    /// Durable queues exported one by one in `/metrics`.
    top_queues: usize,
}

type AdminState = Arc<Admin>;

/// Serves the admin surface on `addr` until the task is aborted. Returns the bound address.
pub(crate) async fn serve(
    addr: SocketAddr,
    shared: Weak<Shared>,
    quic_addr: SocketAddr,
    top_queues: usize,
) -> std::io::Result<(SocketAddr, tokio::task::JoinHandle<()>)> {
    let listener = tokio::net::TcpListener::bind(addr).await?;
    let bound = listener.local_addr()?;
    let state = Arc::new(Admin {
        shared,
        started: Instant::now(),
        addr: quic_addr,
        top_queues,
    });
    let app = router(state);
    let task = tokio::spawn(async move {
        if let Err(e) = axum::serve(listener, app).await {
            tracing::error!(error = %e, "admin HTTP server stopped");
        }
    });
    Ok((bound, task))
}

fn router(state: AdminState) -> Router {
    Router::new()
        .route("/", get(page_index))
        .route("/app.js", get(page_script))
        .route("/style.css", get(page_style))
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz))
        .route("/metrics", get(metrics))
        .route("/api/v1/node", get(api_node))
        .route("/api/v1/cluster", get(api_cluster))
        .route("/api/v1/queues", get(api_queues))
        .route("/api/v1/queues/{id}", get(api_queue))
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .with_state(state)
}

/// An API error: status and a JSON body `{"error":{"code","message"}}`.
struct ApiError(StatusCode, &'static str, String);

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let body = json!({"error": {"code": self.1, "message": self.2}});
        (self.0, axum::Json(body)).into_response()
    }
}

fn bad_request(message: impl Into<String>) -> ApiError {
    ApiError(StatusCode::BAD_REQUEST, "invalid_argument", message.into())
}

fn stopping() -> ApiError {
    ApiError(
        StatusCode::SERVICE_UNAVAILABLE,
        "shutdown",
        "the node is shutting down".into(),
    )
}

async fn not_found(req: Request) -> ApiError {
    ApiError(
        StatusCode::NOT_FOUND,
        "not_found",
        format!("no such path: {}", req.uri().path()),
    )
}

async fn method_not_allowed(req: Request) -> ApiError {
    ApiError(
        StatusCode::METHOD_NOT_ALLOWED,
        "method_not_allowed",
        format!(
            "{} is not allowed on {} (use GET)",
            req.method(),
            req.uri().path()
        ),
    )
}

const INDEX_HTML: &str = include_str!("../admin/ui/index.html");
const APP_JS: &str = include_str!("../admin/ui/app.js");
const STYLE_CSS: &str = include_str!("../admin/ui/style.css");

fn asset(content_type: &'static str, body: &'static str) -> Response {
    (
        [
            (header::CONTENT_TYPE, content_type),
            (header::CACHE_CONTROL, "no-cache"),
        ],
        body,
    )
        .into_response()
}

async fn page_index() -> Response {
    asset("text/html; charset=utf-8", INDEX_HTML)
}

async fn page_script() -> Response {
    asset("text/javascript; charset=utf-8", APP_JS)
}

async fn page_style() -> Response {
    asset("text/css; charset=utf-8", STYLE_CSS)
}

async fn healthz() -> Response {
    axum::Json(json!({"status": "ok"})).into_response()
}

/// Why the node is not ready to serve durable clients (empty: ready).
fn not_ready_reasons(shared: &Shared) -> Vec<String> {
    let mut reasons = Vec::new();
    if let Some(e) = shared.fatal.borrow().clone() {
        reasons.push(format!("storage failed: {e}"));
    }
    if let Some(cluster) = shared.member.cluster.get() {
        if !*shared.member.meta_caught_up.borrow() {
            reasons.push(
                "cluster metadata not caught up: this node does not yet hold everything committed before it started".into(),
            );
        }
        if cluster.leader().is_none() {
            reasons.push("no cluster metadata leader known".into());
        }
        if !*shared.member.joined.borrow() {
            reasons.push(
                "joining the cluster: not added yet, or the regions' values not copied yet".into(),
            );
        }
    }
    reasons
}

async fn readyz(State(a): State<AdminState>) -> Response {
    let Some(shared) = a.shared.upgrade() else {
        return stopping().into_response();
    };
    let reasons = not_ready_reasons(&shared);
    let status = if reasons.is_empty() {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    let body = json!({"ready": reasons.is_empty(), "reasons": reasons});
    (status, axum::Json(body)).into_response()
}

async fn metrics(State(a): State<AdminState>) -> Response {
    let mut body = crate::metrics::handle().render();
    if let Some(shared) = a.shared.upgrade() {
        let now = shared.clock.now_ms();
        let (top, sizes) = shared
            .core()
            .lag_summary(&shared.node_id, a.top_queues, now);
        body.push_str(&crate::admin::render_lag_metrics(&top, &sizes, now));
    }
    (
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        body,
    )
        .into_response()
}

/// The node's state, or an error response when the caller may not read it.
fn authorized(a: &Admin, headers: &HeaderMap) -> Result<Arc<Shared>, ApiError> {
    let shared = a.shared.upgrade().ok_or_else(stopping)?;
    let Some(auth) = shared.authorizer() else {
        return Ok(shared);
    };
    let unauthenticated = |m: &str| ApiError(StatusCode::UNAUTHORIZED, "unauthenticated", m.into());
    let token = match headers.get(header::AUTHORIZATION) {
        None => {
            return Err(unauthenticated(
                "this node requires an admin token: send `Authorization: Bearer <token>`",
            ));
        }
        Some(v) => v
            .to_str()
            .ok()
            .filter(|v| v.len() <= BEARER_TOKEN_BYTES_MAX)
            .and_then(|v| v.strip_prefix("Bearer "))
            .map(str::trim)
            .ok_or_else(|| unauthenticated("the Authorization header must be `Bearer <token>`"))?,
    };
    let principal = auth
        .authenticate(Some(token), None)
        .map_err(|e| unauthenticated(&e.message))?;
    auth.check(&principal, crate::auth::Access::Admin)
        .map_err(|e| ApiError(StatusCode::FORBIDDEN, "forbidden", e.message))?;
    Ok(shared)
}

async fn api_node(State(a): State<AdminState>, headers: HeaderMap) -> Result<Response, ApiError> {
    let shared = authorized(&a, &headers)?;
    let now = shared.clock.now_ms();
    let c = shared.core().counts(now);
    let reasons = not_ready_reasons(&shared);
    let s = &shared.stats;
    let body = json!({
        "node_id": shared.node_id,
        "version": env!("CARGO_PKG_VERSION"),
        "addr": a.addr.to_string(),
        "uptime_secs": a.started.elapsed().as_secs(),
        "clustered": shared.member.cluster.get().is_some(),
        "ready": reasons.is_empty(),
        "reasons": reasons,
        "connections": shared.connections.load(Ordering::Relaxed),
        "queues": {
            "total": c.attached + c.ready + c.away,
            "ready": c.ready,
            "connected": c.attached,
            "away": c.away,
        },
        "pending_events": c.pending_total,
        "pending_bytes": c.pending_bytes_total,
        "oldest_pending_age_ms": c.oldest_unacked_age_ms,
        "counters": {
            "events_published": s.published.load(Ordering::Relaxed),
            "events_enqueued": s.enqueued.load(Ordering::Relaxed),
            "events_delivered": s.delivered.load(Ordering::Relaxed),
            "events_acked": s.acked.load(Ordering::Relaxed),
            "client_seen_flags_raised": s.seen_flags_raised.load(Ordering::Relaxed),
            "client_seen_diverged": s.seen_diverged.load(Ordering::Relaxed),
        },
        "now_ms": now,
    });
    Ok(axum::Json(body).into_response())
}

async fn api_cluster(
    State(a): State<AdminState>,
    headers: HeaderMap,
) -> Result<Response, ApiError> {
    let shared = authorized(&a, &headers)?;
    let Some(cluster) = shared.member.cluster.get() else {
        let body = json!({
            "clustered": false,
            "node_id": shared.node_id,
            "leader": null,
            "term": null,
            "applied_index": null,
            "members": [{
                "node_id": shared.node_id,
                "addr": a.addr.to_string(),
                "alive": true,
                "leader": false,
                "self": true,
                "draining": false,
                "primaries": null,
                "copies": null,
            }],
        });
        return Ok(axum::Json(body).into_response());
    };
    let me = cluster.id();
    let leader = cluster.leader();
    let members: Vec<Value> = cluster
        .members()
        .nodes
        .iter()
        .map(|(&id, node)| {
            let (draining, (primaries, copies)) =
                cluster.read(|s| (s.draining.contains(&id), s.held_by(id)));
            json!({
                "node_id": node.name,
                "addr": node.addr,
                "alive": id == me || shared.member.liveness.is_live(id),
                "leader": leader == Some(id),
                "self": id == me,
                "draining": draining,
                "primaries": primaries,
                "copies": copies,
            })
        })
        .collect();
    let body = json!({
        "clustered": true,
        "node_id": shared.node_id,
        "leader": leader.map(|l| cluster.members().name(l)),
        "term": cluster.term(),
        "applied_index": cluster.applied_index(),
        "caught_up": *shared.member.meta_caught_up.borrow(),
        "members": members,
    });
    Ok(axum::Json(body).into_response())
}

async fn api_queues(
    State(a): State<AdminState>,
    headers: HeaderMap,
    Query(params): Query<HashMap<String, String>>,
) -> Result<Response, ApiError> {
    let shared = authorized(&a, &headers)?;
    let (q, cluster_wide) = ListQuery::from_params(
        params.iter().map(|(k, v)| (k.as_str(), v.as_str())),
        shared.clock.now_ms(),
    )
    .map_err(|e| bad_request(e.to_string()))?;
    let (page, unreachable) = shared.list_queues(&q, cluster_wide).await;
    let body = json!({
        "queues": page.queues,
        "next": page.next(&q).map(|t| t.encode()),
        "total": page.total,
        "unreachable": unreachable,
    });
    Ok(axum::Json(body).into_response())
}

async fn api_queue(
    State(a): State<AdminState>,
    headers: HeaderMap,
    Path(id): Path<String>,
) -> Result<Response, ApiError> {
    let shared = authorized(&a, &headers)?;
    let q = ListQuery {
        limit: QUEUES_PAGE_MAX,
        prefix: Some(id.clone()),
        role: RoleFilter::All,
        now_ms: shared.clock.now_ms(),
        ..ListQuery::default()
    };
    let (page, _) = shared.list_queues(&q, true).await;
    let mut matching: Vec<QueueView> = page.queues.into_iter().filter(|v| v.id == id).collect();
    // The primary first: clients attach there, and it knows each copy's lag.
    matching.sort_by_key(|v| v.role != "primary");
    let mut found = matching.into_iter();
    let Some(queue) = found.next() else {
        return Err(ApiError(
            StatusCode::NOT_FOUND,
            "not_found",
            format!("no queue {id:?} on any reachable member"),
        ));
    };
    let mut body = serde_json::to_value(&queue).unwrap_or(Value::Null);
    body["replicas"] = serde_json::to_value(found.collect::<Vec<_>>()).unwrap_or(Value::Null);
    Ok(axum::Json(body).into_response())
}

impl Shared {
    /// Each secondary copy of this node's primary queue `durable_id` and how far behind it is
    /// (empty off a cluster or without copies).
    pub(crate) fn copy_lags(&self, durable_id: &str) -> Vec<CopyLag> {
        let (Some(cluster), Some(sq)) = (
            self.member.cluster.get(),
            self.member.shipping.get(durable_id),
        ) else {
            return Vec::new();
        };
        sq.lags()
            .into_iter()
            .map(|(n, lag)| CopyLag {
                node: cluster.members().name(n),
                lag_entries: lag,
            })
            .collect()
    }

    /// Every queue this node holds, as the admin API shows it: its primaries (with each copy's
    /// lag) and, unless only primaries are asked for, the copies it holds for other primaries.
    pub(crate) async fn queue_views(&self, role: RoleFilter, now: u64) -> Vec<QueueView> {
        let mut views = if role == RoleFilter::Secondary {
            Vec::new()
        } else {
            self.core().queue_views(&self.node_id, now)
        };
        let Some(cluster) = self.member.cluster.get() else {
            return views;
        };
        for v in &mut views {
            if let Some(d) = v.durable_id.as_deref() {
                v.copies = self.copy_lags(d);
            }
        }
        if role == RoleFilter::Primary {
            return views;
        }
        for id in self.member.copies.ids() {
            let Some(cell) = self.member.copies.get(&id) else {
                continue;
            };
            let copy = cell.lock().await;
            if copy.gone {
                continue;
            }
            let log = copy.replica.log();
            let acked = copy.replica.acked();
            let away_since_ms = copy.info.away_since_ms;
            views.push(QueueView {
                id: id.clone(),
                durable_id: Some(id.clone()),
                node: self.node_id.clone(),
                role: "secondary".into(),
                primary: cluster
                    .placement(&id)
                    .map(|p| cluster.members().name(p.primary)),
                state: if away_since_ms.is_some() {
                    "away"
                } else {
                    "connected"
                }
                .into(),
                pending_events: log.end() - acked,
                pending_bytes: None,
                oldest_pending_age_ms: None,
                away_since_ms,
                expires_at_ms: away_since_ms
                    .map(|s| s.saturating_add(copy.info.timeout_secs.saturating_mul(1_000))),
                timeout_secs: copy.info.timeout_secs,
                acked_offset: acked,
                end_offset: log.end(),
                enqueue_rate: 0.0,
                delivery_rate: 0.0,
                ack_rate: 0.0,
                drain_eta_secs: None,
                interests: copy
                    .info
                    .interests
                    .iter()
                    .map(|(r, sel, reg)| sel.info(r, reg.durable))
                    .collect(),
                copies: Vec::new(),
            });
        }
        views
    }

    /// This node's page of a listing.
    pub(crate) async fn local_page(&self, q: &ListQuery) -> Page {
        q.select(self.queue_views(q.role, q.now_ms).await)
    }

    /// A page of a listing, over every member when `cluster_wide` (asked in parallel; those
    /// that do not answer within [`ADMIN_PEER_TIMEOUT_MS`] are named in the second value).
    pub(crate) async fn list_queues(
        &self,
        q: &ListQuery,
        cluster_wide: bool,
    ) -> (Page, Vec<String>) {
        let local = self.local_page(q).await;
        let Some(cluster) = self.member.cluster.get().filter(|_| cluster_wide) else {
            return (local, Vec::new());
        };
        let me = cluster.id();
        let members = cluster.members();
        let calls = members.nodes.keys().filter(|&&id| id != me).map(|&id| {
            let cluster = cluster.clone();
            let request = PeerRequest::ListQueues(q.clone());
            async move {
                let r = cluster
                    .call(id, request, Duration::from_millis(ADMIN_PEER_TIMEOUT_MS))
                    .await;
                (id, r)
            }
        });
        let answers = futures_join_all(calls).await;
        let mut pages = vec![local];
        let mut unreachable = Vec::new();
        for (id, answer) in answers {
            match answer {
                Ok(PeerResponse::Queues(page)) => pages.push(page),
                Ok(PeerResponse::BadRequest(why)) => {
                    tracing::debug!(peer = %cluster.members().name(id), %why, "queue listing refused");
                    unreachable.push(cluster.members().name(id));
                }
                Ok(_) => {
                    tracing::debug!(peer = %cluster.members().name(id), "unexpected answer to a queue listing");
                    unreachable.push(cluster.members().name(id));
                }
                Err(e) => {
                    tracing::debug!(peer = %cluster.members().name(id), error = %e, "queue listing");
                    unreachable.push(cluster.members().name(id));
                }
            }
        }
        (q.merge(pages), unreachable)
    }
}

/// Runs futures concurrently and collects their outputs (in completion order).
async fn futures_join_all<F: std::future::Future + Send + 'static>(
    futures: impl Iterator<Item = F>,
) -> Vec<F::Output>
where
    F::Output: Send + 'static,
{
    let mut set = tokio::task::JoinSet::new();
    for f in futures {
        set.spawn(f);
    }
    let mut out = Vec::new();
    while let Some(r) = set.join_next().await {
        if let Ok(v) = r {
            out.push(v);
        }
    }
    out
}
