//! The operator's view of a node, as plain data: each queue's lag ([`QueueView`]), the
//! listing query of the admin API ([`ListQuery`]: filter, sort, page with opaque tokens, merged
//! over the members of a cluster), per-queue rates ([`QueueRates`]) and the bounded-cardinality
//! lag metrics ([`render_lag_metrics`]). No I/O: the HTTP driver is `server/admin.rs`.
//!
//! A `QueueView` holds a queue's pending events and bytes, oldest pending age, away since,
//! expires at, rates and drain estimate. Lag accounting costs the publish and delivery paths
//! nothing beyond the counts the queue keeps anyway: rates are sampled by the tick (at most once
//! per queue per 5 s); listings and `/metrics` walk the queues once per request (a page per
//! node, pages merged cluster-wide), and `/metrics` carries at most `metrics-top-queues` series
//! per per-queue metric (the top queues by pending, labelled), plus one histogram of all,
//! whatever the number of queues. Property-tested.

use std::cmp::Ordering;
use std::fmt::Write as _;

use serde::{Deserialize, Serialize};

use crate::protocol::{CopyLag, InterestInfo, QueueReport};

/// Queues one page of `/api/v1/queues` holds when the request names no `limit`.
pub const QUEUES_PAGE_DEFAULT: usize = 100;
/// Most queues one page holds (a larger `limit` is capped to it).
pub const QUEUES_PAGE_MAX: usize = 1_000;
/// Longest paging token accepted, in bytes (a durable id is at most 1 KiB, hex doubles it).
pub const PAGE_TOKEN_BYTES_MAX: usize = 2_200;
/// Least time between two samples of a queue's rates, in milliseconds.
pub const RATE_SAMPLE_INTERVAL_MS: u64 = 5_000;
/// Weight of the newest sample in a queue's smoothed rates (exponential moving average).
pub const RATE_SMOOTHING_NEW_WEIGHT: f64 = 0.5;
/// Upper bounds of the buckets of the queue-size histogram, in pending events.
pub const QUEUE_SIZE_BUCKETS_EVENTS: [u64; 8] =
    [0, 10, 100, 1_000, 10_000, 100_000, 1_000_000, 10_000_000];

/// One queue as the admin API and page show it: where it is, who holds it, and how far its
/// client is behind.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct QueueView {
    /// The durable id, or `node:queue` for a non-durable queue (unique in the cluster).
    pub id: String,
    pub durable_id: Option<String>,
    /// The node this view comes from.
    pub node: String,
    /// `primary` (the queue clients attach to) or `secondary` (a replicated copy).
    pub role: String,
    /// The node holding the primary, when known.
    pub primary: Option<String>,
    /// `ready`, `connected` or `away`.
    pub state: String,
    /// Entries not yet acknowledged.
    pub pending_events: u64,
    /// Bytes of the stored events not yet acknowledged (as the byte limit counts them); None
    /// on a secondary's copy.
    pub pending_bytes: Option<u64>,
    /// Age of the oldest unacknowledged entry (to within a second); None when nothing waits
    /// or on a copy.
    pub oldest_pending_age_ms: Option<u64>,
    /// Wall-clock time (ms since the epoch) the durable client went away.
    pub away_since_ms: Option<u64>,
    /// When the away queue expires unless its client comes back (ms since the epoch).
    pub expires_at_ms: Option<u64>,
    pub timeout_secs: u64,
    pub acked_offset: u64,
    pub end_offset: u64,
    /// Entries appended, sent and acknowledged per second (smoothed over the last samples).
    pub enqueue_rate: f64,
    pub delivery_rate: f64,
    pub ack_rate: f64,
    /// Seconds until the client has acknowledged everything at the current rates: 0 when
    /// nothing waits, None while the queue is not shrinking.
    pub drain_eta_secs: Option<f64>,
    pub interests: Vec<InterestInfo>,
    /// On a primary: each secondary copy and how far behind it is.
    pub copies: Vec<CopyLag>,
}

impl QueueView {
    /// The same queue as `tether queues` reports it (its older fields, then the lag).
    pub fn into_report(self) -> QueueReport {
        QueueReport {
            durable_id: self.durable_id,
            state: self.state,
            pending: self.pending_events,
            pending_bytes: self.pending_bytes,
            acked_offset: self.acked_offset,
            end_offset: self.end_offset,
            timeout_secs: self.timeout_secs,
            primary: (self.role == "secondary").then_some(self.primary).flatten(),
            role: self.role,
            interests: self.interests,
            copies: self.copies,
            id: Some(self.id),
            node: Some(self.node),
            oldest_pending_age_ms: self.oldest_pending_age_ms,
            away_since_ms: self.away_since_ms,
            expires_at_ms: self.expires_at_ms,
            enqueue_per_min: Some(per_min(self.enqueue_rate)),
            delivery_per_min: Some(per_min(self.delivery_rate)),
            ack_per_min: Some(per_min(self.ack_rate)),
            drain_eta_secs: self.drain_eta_secs.map(|s| s.ceil() as u64),
        }
    }

    /// The wall-clock time the oldest pending entry was enqueued, for sorting by age with a
    /// key that does not move as time passes.
    fn oldest_pending_at_ms(&self, now_ms: u64) -> Option<u64> {
        self.oldest_pending_age_ms.map(|a| now_ms.saturating_sub(a))
    }
}

/// A rate per second as a whole number per minute.
fn per_min(per_sec: f64) -> u64 {
    (per_sec * 60.0).round() as u64
}

/// Seconds until `pending` entries are acknowledged at the net rate `ack_rate - enqueue_rate`.
pub fn drain_eta_secs(pending: u64, ack_rate: f64, enqueue_rate: f64) -> Option<f64> {
    if pending == 0 {
        return Some(0.0);
    }
    let net = ack_rate - enqueue_rate;
    (net > f64::EPSILON).then(|| pending as f64 / net)
}

/// A queue's rates, sampled by the node's tick (never on the publish or delivery path).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct QueueRates {
    sampled_at_ms: u64,
    end: u64,
    delivered: u64,
    acked: u64,
    pub enqueue_per_sec: f64,
    pub delivery_per_sec: f64,
    pub ack_per_sec: f64,
}

impl QueueRates {
    /// Takes a sample of the queue's offsets when [`RATE_SAMPLE_INTERVAL_MS`] has passed since
    /// the last one (the first sample only sets the baseline).
    pub fn sample(&mut self, now_ms: u64, end: u64, delivered: u64, acked: u64) {
        if self.sampled_at_ms == 0 {
            *self = QueueRates {
                sampled_at_ms: now_ms.max(1),
                end,
                delivered,
                acked,
                ..QueueRates::default()
            };
            return;
        }
        let elapsed_ms = now_ms.saturating_sub(self.sampled_at_ms);
        if elapsed_ms < RATE_SAMPLE_INTERVAL_MS {
            return;
        }
        let secs = elapsed_ms as f64 / 1e3;
        let smooth = |old: f64, now: u64, before: u64| {
            let rate = now.saturating_sub(before) as f64 / secs;
            old * (1.0 - RATE_SMOOTHING_NEW_WEIGHT) + rate * RATE_SMOOTHING_NEW_WEIGHT
        };
        self.enqueue_per_sec = smooth(self.enqueue_per_sec, end, self.end);
        self.delivery_per_sec = smooth(self.delivery_per_sec, delivered, self.delivered);
        self.ack_per_sec = smooth(self.ack_per_sec, acked, self.acked);
        self.sampled_at_ms = now_ms;
        self.end = end;
        self.delivered = delivered;
        self.acked = acked;
    }
}

/// What a listing is sorted by.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum SortBy {
    #[default]
    Pending,
    Bytes,
    Age,
    Id,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum SortOrder {
    #[default]
    Desc,
    Asc,
}

/// Which copies of a queue a listing holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum RoleFilter {
    /// Each queue once, where clients attach to it.
    #[default]
    Primary,
    Secondary,
    All,
}

/// A page request of the queue listing, as validated from the query string.
#[derive(Clone, Debug, PartialEq, Default, Serialize, Deserialize)]
pub struct ListQuery {
    pub limit: usize,
    pub after: Option<PageToken>,
    pub sort: SortBy,
    pub order: SortOrder,
    pub state: Option<String>,
    pub region: Option<String>,
    pub prefix: Option<String>,
    pub role: RoleFilter,
    /// When the listing was asked for (ms since the epoch): ages sort as enqueue times.
    pub now_ms: u64,
}

/// Where a page ends: the sort key of its last queue.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PageToken {
    pub sort: SortBy,
    pub order: SortOrder,
    pub value: u64,
    pub id: String,
    /// The node of the last queue (the same id may be listed by several nodes).
    pub node: String,
}

fn push_hex(s: &mut String, text: &str) {
    for b in text.as_bytes() {
        let _ = write!(s, "{b:02x}");
    }
}

fn from_hex(hex: &str) -> Option<String> {
    if !hex.len().is_multiple_of(2) {
        return None;
    }
    let bytes = (0..hex.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(hex.get(i..i + 2)?, 16).ok())
        .collect::<Option<Vec<u8>>>()?;
    String::from_utf8(bytes).ok()
}

impl PageToken {
    /// The opaque text form: `sort.order.value.hex(id).hex(node)`.
    pub fn encode(&self) -> String {
        let mut s = format!(
            "{}.{}.{}.",
            sort_name(self.sort),
            order_name(self.order),
            self.value
        );
        push_hex(&mut s, &self.id);
        s.push('.');
        push_hex(&mut s, &self.node);
        s
    }

    pub fn decode(text: &str) -> Result<PageToken, QueryError> {
        let bad = || QueryError::BadToken;
        if text.len() > PAGE_TOKEN_BYTES_MAX {
            return Err(bad());
        }
        let parts: Vec<&str> = text.split('.').collect();
        let [sort, order, value, id, node] = parts[..] else {
            return Err(bad());
        };
        Ok(PageToken {
            sort: parse_sort(sort).map_err(|_| bad())?,
            order: parse_order(order).map_err(|_| bad())?,
            value: value.parse().map_err(|_| bad())?,
            id: from_hex(id).ok_or_else(bad)?,
            node: from_hex(node).ok_or_else(bad)?,
        })
    }
}

/// A listing query refused: each names the parameter and what it accepts.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum QueryError {
    #[error("bad paging token (use the `next` of the previous page)")]
    BadToken,
    #[error("the paging token belongs to another sort or order: start again without `after`")]
    TokenOfAnotherSort,
    #[error("unknown {parameter} {value:?} (expected {expected})")]
    UnknownValue {
        parameter: &'static str,
        value: String,
        expected: &'static str,
    },
    #[error("limit {0:?} is not a number")]
    LimitNotANumber(String),
    #[error("limit must be at least 1")]
    LimitZero,
    #[error(
        "unknown parameter {0:?} (expected limit, after, sort, order, state, role, region, prefix \
         or scope)"
    )]
    UnknownParameter(String),
}

/// The refusal of `value` for `parameter`, which takes one of `expected`.
fn unknown(parameter: &'static str, value: &str, expected: &'static str) -> QueryError {
    QueryError::UnknownValue {
        parameter,
        value: value.to_string(),
        expected,
    }
}

fn sort_name(s: SortBy) -> &'static str {
    match s {
        SortBy::Pending => "pending",
        SortBy::Bytes => "bytes",
        SortBy::Age => "age",
        SortBy::Id => "id",
    }
}

fn order_name(o: SortOrder) -> &'static str {
    match o {
        SortOrder::Desc => "desc",
        SortOrder::Asc => "asc",
    }
}

pub fn parse_sort(s: &str) -> Result<SortBy, QueryError> {
    match s {
        "pending" => Ok(SortBy::Pending),
        "bytes" => Ok(SortBy::Bytes),
        "age" => Ok(SortBy::Age),
        "id" => Ok(SortBy::Id),
        other => Err(unknown("sort", other, "pending, bytes, age or id")),
    }
}

pub fn parse_order(s: &str) -> Result<SortOrder, QueryError> {
    match s {
        "desc" => Ok(SortOrder::Desc),
        "asc" => Ok(SortOrder::Asc),
        other => Err(unknown("order", other, "desc or asc")),
    }
}

pub fn parse_role(s: &str) -> Result<RoleFilter, QueryError> {
    match s {
        "primary" => Ok(RoleFilter::Primary),
        "secondary" => Ok(RoleFilter::Secondary),
        "all" => Ok(RoleFilter::All),
        other => Err(unknown("role", other, "primary, secondary or all")),
    }
}

pub fn parse_state(s: &str) -> Result<String, QueryError> {
    match s {
        "ready" | "connected" | "away" => Ok(s.to_string()),
        other => Err(unknown("state", other, "ready, connected or away")),
    }
}

/// One page of a listing.
#[derive(Clone, Debug, PartialEq, Default, Serialize, Deserialize)]
pub struct Page {
    pub queues: Vec<QueueView>,
    /// Queues matching the filters (on every page, whatever the cursor).
    pub total: u64,
    /// More matching queues follow the last one of `queues`.
    pub more: bool,
}

impl Page {
    /// The token of the next page, if there is one.
    pub fn next(&self, q: &ListQuery) -> Option<PageToken> {
        if !self.more {
            return None;
        }
        self.queues.last().map(|v| PageToken {
            sort: q.sort,
            order: q.order,
            value: sort_value(v, q.sort, q.now_ms),
            id: v.id.clone(),
            node: v.node.clone(),
        })
    }
}

impl ListQuery {
    /// The query named by `params` (the HTTP API's query parameters) at time `now_ms`, and
    /// whether it covers the whole cluster. Unknown parameters and bad values are errors.
    pub fn from_params<'a>(
        params: impl IntoIterator<Item = (&'a str, &'a str)>,
        now_ms: u64,
    ) -> Result<(ListQuery, bool), QueryError> {
        let mut q = ListQuery {
            limit: QUEUES_PAGE_DEFAULT,
            now_ms,
            ..ListQuery::default()
        };
        let mut cluster_wide = true;
        for (k, v) in params {
            match k {
                "limit" => {
                    let n: u64 = v
                        .parse()
                        .map_err(|_| QueryError::LimitNotANumber(v.to_string()))?;
                    if n == 0 {
                        return Err(QueryError::LimitZero);
                    }
                    q.limit = n.min(QUEUES_PAGE_MAX as u64) as usize;
                }
                "after" => q.after = Some(PageToken::decode(v)?),
                "sort" => q.sort = parse_sort(v)?,
                "order" => q.order = parse_order(v)?,
                "state" => q.state = Some(parse_state(v)?),
                "role" => q.role = parse_role(v)?,
                "region" => q.region = Some(v.to_string()).filter(|r| !r.is_empty()),
                "prefix" => q.prefix = Some(v.to_string()).filter(|p| !p.is_empty()),
                "scope" => {
                    cluster_wide = match v {
                        "cluster" => true,
                        "node" => false,
                        other => return Err(unknown("scope", other, "cluster or node")),
                    }
                }
                other => return Err(QueryError::UnknownParameter(other.to_string())),
            }
        }
        q.check_token()?;
        Ok((q, cluster_wide))
    }

    /// The query of a wire request ([`crate::protocol::QueuesQuery`]).
    pub fn from_wire(
        w: &crate::protocol::QueuesQuery,
        now_ms: u64,
    ) -> Result<(ListQuery, bool), QueryError> {
        let limit = w.limit.map(|l| l.to_string());
        let pairs = [
            ("limit", limit.as_deref()),
            ("after", w.after.as_deref()),
            ("sort", w.sort.as_deref()),
            ("order", w.order.as_deref()),
            ("state", w.state.as_deref()),
            ("region", w.region.as_deref()),
            ("prefix", w.prefix.as_deref()),
            ("role", w.role.as_deref()),
            ("scope", w.node_only.then_some("node")),
        ];
        Self::from_params(
            pairs.into_iter().filter_map(|(k, v)| v.map(|v| (k, v))),
            now_ms,
        )
    }

    /// Whether `v` passes the filters (not the cursor).
    pub fn matches(&self, v: &QueueView) -> bool {
        let role_ok = match self.role {
            RoleFilter::Primary => v.role == "primary",
            RoleFilter::Secondary => v.role == "secondary",
            RoleFilter::All => true,
        };
        role_ok
            && self.state.as_deref().is_none_or(|s| v.state == s)
            && self.prefix.as_deref().is_none_or(|p| v.id.starts_with(p))
            && self
                .region
                .as_deref()
                .is_none_or(|r| v.interests.iter().any(|i| i.region == r))
    }

    /// The listing's order of two queues (ties broken by id, then node).
    pub fn compare(&self, a: &QueueView, b: &QueueView) -> Ordering {
        let (va, vb) = (
            sort_value(a, self.sort, self.now_ms),
            sort_value(b, self.sort, self.now_ms),
        );
        let by_value = match self.order {
            SortOrder::Desc => vb.cmp(&va),
            SortOrder::Asc => va.cmp(&vb),
        };
        by_value
            .then_with(|| match (self.sort, self.order) {
                (SortBy::Id, SortOrder::Desc) => b.id.cmp(&a.id),
                _ => a.id.cmp(&b.id),
            })
            .then_with(|| a.node.cmp(&b.node))
    }

    /// Whether `v` comes after the page token.
    fn after_token(&self, v: &QueueView) -> bool {
        let Some(t) = &self.after else {
            return true;
        };
        let value = sort_value(v, self.sort, self.now_ms);
        let by_value = match self.order {
            SortOrder::Desc => t.value.cmp(&value),
            SortOrder::Asc => value.cmp(&t.value),
        };
        let by_id = match (self.sort, self.order) {
            (SortBy::Id, SortOrder::Desc) => t.id.as_str().cmp(v.id.as_str()),
            _ => v.id.as_str().cmp(t.id.as_str()),
        };
        by_value
            .then(by_id)
            .then_with(|| v.node.as_str().cmp(t.node.as_str()))
            == Ordering::Greater
    }

    /// Checks that a page token belongs to this query's sort.
    pub fn check_token(&self) -> Result<(), QueryError> {
        match &self.after {
            Some(t) if t.sort != self.sort || t.order != self.order => {
                Err(QueryError::TokenOfAnotherSort)
            }
            _ => Ok(()),
        }
    }

    /// The page of `views` this query asks for.
    pub fn select(&self, views: impl IntoIterator<Item = QueueView>) -> Page {
        let mut total = 0u64;
        let mut rest: Vec<QueueView> = views
            .into_iter()
            .filter(|v| self.matches(v))
            .inspect(|_| total += 1)
            .filter(|v| self.after_token(v))
            .collect();
        let limit = self.limit.clamp(1, QUEUES_PAGE_MAX);
        let more = rest.len() > limit;
        if more {
            rest.select_nth_unstable_by(limit, |a, b| self.compare(a, b));
            rest.truncate(limit);
        }
        rest.sort_by(|a, b| self.compare(a, b));
        Page {
            queues: rest,
            total,
            more,
        }
    }

    /// Merges the pages several nodes returned for this query into one.
    pub fn merge(&self, pages: impl IntoIterator<Item = Page>) -> Page {
        let mut all = Vec::new();
        let mut total = 0;
        let mut more = false;
        for p in pages {
            total += p.total;
            more |= p.more;
            all.extend(p.queues);
        }
        let limit = self.limit.clamp(1, QUEUES_PAGE_MAX);
        all.sort_by(|a, b| self.compare(a, b));
        if all.len() > limit {
            all.truncate(limit);
            more = true;
        }
        Page {
            queues: all,
            total,
            more,
        }
    }
}

/// The value a queue sorts by (larger first in descending order).
fn sort_value(v: &QueueView, sort: SortBy, now_ms: u64) -> u64 {
    match sort {
        SortBy::Pending => v.pending_events,
        SortBy::Bytes => v.pending_bytes.unwrap_or(0),
        // The older the oldest pending entry, the larger; stable while time passes.
        SortBy::Age => v.oldest_pending_at_ms(now_ms).map_or(0, |at| u64::MAX - at),
        SortBy::Id => 0,
    }
}

/// Pending events over a node's queues, in the buckets of [`QUEUE_SIZE_BUCKETS_EVENTS`].
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct QueueSizes {
    /// Queues with at most each bucket's bound (cumulative, as Prometheus counts).
    pub buckets: [u64; QUEUE_SIZE_BUCKETS_EVENTS.len()],
    pub sum: u64,
    pub count: u64,
}

impl QueueSizes {
    pub fn add(&mut self, pending: u64) {
        self.sum += pending;
        self.count += 1;
        for (i, &le) in QUEUE_SIZE_BUCKETS_EVENTS.iter().enumerate() {
            if pending <= le {
                self.buckets[i] += 1;
            }
        }
    }
}

/// The lag metrics of a node's primary queues in Prometheus' text format: the durable queues
/// of `top` (the N with the most pending events, in order) one by one (label `durable_id`), and
/// the histogram of every queue's pending events. Bounded: as many series per metric as `top`
/// holds, whatever the number of queues.
pub fn render_lag_metrics(top: &[QueueView], sizes: &QueueSizes, now_ms: u64) -> String {
    let mut out = String::new();
    if !top.is_empty() {
        type Field = fn(&QueueView, u64) -> Option<f64>;
        let series: [(&str, &str, Field); 6] = [
            (
                crate::metrics::QUEUE_PENDING_EVENTS,
                "Pending events of the durable queues with the most (top N by pending, label durable_id)",
                |v, _| Some(v.pending_events as f64),
            ),
            (
                crate::metrics::QUEUE_PENDING_BYTES,
                "Pending bytes of the same queues",
                |v, _| v.pending_bytes.map(|b| b as f64),
            ),
            (
                crate::metrics::QUEUE_OLDEST_PENDING_AGE,
                "Age of the oldest pending entry of the same queues",
                |v, _| Some(v.oldest_pending_age_ms.unwrap_or(0) as f64 / 1e3),
            ),
            (
                crate::metrics::QUEUE_AWAY,
                "Seconds the client of the same queues has been away (0 while connected)",
                |v, now| Some(v.away_since_ms.map_or(0, |s| now.saturating_sub(s)) as f64 / 1e3),
            ),
            (
                crate::metrics::QUEUE_ACK_RATE,
                "Entries acknowledged per second by the client of the same queues",
                |v, _| Some(v.ack_rate),
            ),
            (
                crate::metrics::QUEUE_DRAIN_ETA,
                "Estimated seconds until the same queues are drained (absent while not shrinking)",
                |v, _| v.drain_eta_secs,
            ),
        ];
        for (name, help, field) in series {
            let _ = writeln!(out, "# HELP {name} {help}");
            let _ = writeln!(out, "# TYPE {name} gauge");
            for v in top {
                if let Some(x) = field(v, now_ms) {
                    let id = escape_label(v.durable_id.as_deref().unwrap_or(&v.id));
                    let _ = writeln!(out, "{name}{{durable_id=\"{id}\"}} {x}");
                }
            }
        }
    }
    let name = crate::metrics::QUEUE_SIZE;
    let _ = writeln!(
        out,
        "# HELP {name} Pending events per queue, over every primary queue of the node"
    );
    let _ = writeln!(out, "# TYPE {name} histogram");
    for (i, le) in QUEUE_SIZE_BUCKETS_EVENTS.iter().enumerate() {
        let _ = writeln!(out, "{name}_bucket{{le=\"{le}\"}} {}", sizes.buckets[i]);
    }
    let _ = writeln!(out, "{name}_bucket{{le=\"+Inf\"}} {}", sizes.count);
    let _ = writeln!(out, "{name}_sum {}", sizes.sum);
    let _ = writeln!(out, "{name}_count {}", sizes.count);
    out
}

/// A Prometheus label value with `\`, `"` and newlines escaped.
fn escape_label(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '"' => out.push_str("\\\""),
            '\n' => out.push_str("\\n"),
            c => out.push(c),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn view(id: &str, pending: u64, age: Option<u64>) -> QueueView {
        QueueView {
            id: id.into(),
            durable_id: Some(id.into()),
            node: "n1".into(),
            role: "primary".into(),
            primary: Some("n1".into()),
            state: "away".into(),
            pending_events: pending,
            pending_bytes: Some(pending * 10),
            oldest_pending_age_ms: age,
            away_since_ms: Some(1_000),
            expires_at_ms: Some(301_000),
            timeout_secs: 300,
            acked_offset: 0,
            end_offset: pending,
            enqueue_rate: 0.0,
            delivery_rate: 0.0,
            ack_rate: 0.0,
            drain_eta_secs: None,
            interests: vec![InterestInfo {
                region: format!("r{}", pending % 3),
                kind: "all".into(),
                spec: None,
                durable: true,
            }],
            copies: Vec::new(),
        }
    }

    fn query(sort: SortBy, order: SortOrder, limit: usize) -> ListQuery {
        ListQuery {
            limit,
            sort,
            order,
            now_ms: 1_000_000,
            ..ListQuery::default()
        }
    }

    /// Every page in turn, following the tokens.
    fn all_pages(q: &ListQuery, views: &[QueueView]) -> Vec<String> {
        let mut q = q.clone();
        let mut seen = Vec::new();
        loop {
            let page = q.select(views.iter().cloned());
            assert_eq!(
                page.total,
                views.iter().filter(|v| q.matches(v)).count() as u64
            );
            seen.extend(page.queues.iter().map(|v| v.id.clone()));
            match page.next(&q) {
                Some(t) => {
                    let t = PageToken::decode(&t.encode()).unwrap();
                    q.after = Some(t);
                }
                None => return seen,
            }
        }
    }

    #[test]
    fn pages_follow_the_sort_and_cover_every_queue_once() {
        let views: Vec<QueueView> = (0..25)
            .map(|i| view(&format!("q{i:02}"), i % 7, Some(i * 100)))
            .collect();
        for sort in [SortBy::Pending, SortBy::Bytes, SortBy::Age, SortBy::Id] {
            for order in [SortOrder::Desc, SortOrder::Asc] {
                let q = query(sort, order, 4);
                let ids = all_pages(&q, &views);
                let mut expected = views.clone();
                expected.sort_by(|a, b| q.compare(a, b));
                let expected: Vec<String> = expected.into_iter().map(|v| v.id).collect();
                assert_eq!(ids, expected, "{sort:?} {order:?}");
            }
        }
        let q = query(SortBy::Pending, SortOrder::Desc, 3);
        let first = q.select(views.iter().cloned());
        assert_eq!(first.queues[0].pending_events, 6);
        assert!(first.more);
    }

    #[test]
    fn filters_select_by_state_region_prefix_and_role() {
        let mut views: Vec<QueueView> = (0..9).map(|i| view(&format!("a{i}"), i, None)).collect();
        views[0].state = "ready".into();
        views[1].id = "b1".into();
        views[2].role = "secondary".into();
        let mut q = query(SortBy::Id, SortOrder::Asc, 100);
        q.state = Some("ready".into());
        assert_eq!(q.select(views.clone()).total, 1);
        q.state = None;
        q.prefix = Some("a".into());
        assert_eq!(
            q.select(views.clone()).total,
            7,
            "b1 and the secondary are out"
        );
        q.role = RoleFilter::All;
        assert_eq!(q.select(views.clone()).total, 8);
        q.prefix = None;
        q.role = RoleFilter::Primary;
        q.region = Some("r0".into());
        let ids: Vec<String> = q.select(views).queues.into_iter().map(|v| v.id).collect();
        assert_eq!(ids, ["a0", "a3", "a6"]);
    }

    #[test]
    fn bad_tokens_are_refused() {
        for t in [
            "",
            "x",
            "pending.desc.1.61",
            "pending.desc.x.61.6e31",
            "pending.up.1.61.6e31",
            "pending.desc.1.6.6e31",
            "pending.desc.1.61.6e31.00",
            "pending.desc.1.zz.6e31",
        ] {
            assert!(PageToken::decode(t).is_err(), "{t:?}");
        }
        assert!(PageToken::decode(&"a".repeat(PAGE_TOKEN_BYTES_MAX + 1)).is_err());
        let mut q = query(SortBy::Id, SortOrder::Asc, 10);
        q.after = Some(PageToken::decode("pending.desc.1.61.6e31").unwrap());
        assert!(q.check_token().is_err());
    }

    #[test]
    fn drain_eta_needs_a_shrinking_queue() {
        assert_eq!(drain_eta_secs(0, 0.0, 5.0), Some(0.0));
        assert_eq!(drain_eta_secs(100, 10.0, 5.0), Some(20.0));
        assert_eq!(drain_eta_secs(100, 5.0, 5.0), None);
        assert_eq!(drain_eta_secs(100, 0.0, 0.0), None);
    }

    #[test]
    fn rates_are_sampled_at_intervals_and_smoothed() {
        let mut r = QueueRates::default();
        r.sample(10_000, 0, 0, 0);
        r.sample(11_000, 500, 500, 500);
        assert_eq!(r.ack_per_sec, 0.0, "too early for a sample");
        r.sample(15_000, 1_000, 800, 500);
        assert_eq!(r.enqueue_per_sec, 100.0); // 200/s smoothed with 0
        assert_eq!(r.delivery_per_sec, 80.0);
        assert_eq!(r.ack_per_sec, 50.0);
        r.sample(20_000, 2_000, 1_800, 1_500);
        assert_eq!(r.enqueue_per_sec, 150.0);
    }

    #[test]
    fn lag_metrics_hold_the_top_queues_and_a_histogram_of_all() {
        let mut top: Vec<QueueView> = [1_000, 49, 48]
            .iter()
            .map(|&p| view(&format!("q{p}"), p, Some(5_000)))
            .collect();
        top[0].durable_id = Some("we\"ird\\id\n".into());
        top[2].drain_eta_secs = Some(4.0);
        let mut sizes = QueueSizes::default();
        for p in 0..50 {
            sizes.add(p);
        }
        let text = render_lag_metrics(&top, &sizes, 10_000);
        let lines: Vec<&str> = text
            .lines()
            .filter(|l| l.starts_with("tether_queue_pending_events{"))
            .collect();
        assert_eq!(
            lines,
            [
                r#"tether_queue_pending_events{durable_id="we\"ird\\id\n"} 1000"#,
                r#"tether_queue_pending_events{durable_id="q49"} 49"#,
                r#"tether_queue_pending_events{durable_id="q48"} 48"#,
            ]
        );
        assert!(
            text.contains("tether_queue_size_events_bucket{le=\"10\"} 11\n"),
            "{text}"
        );
        assert!(text.contains("tether_queue_size_events_bucket{le=\"+Inf\"} 50\n"));
        assert!(text.contains("tether_queue_size_events_sum 1225\n"));
        assert!(text.contains("tether_queue_away_seconds{durable_id=\"q49\"} 9\n"));
        let etas: Vec<&str> = text
            .lines()
            .filter(|l| l.starts_with("tether_queue_drain_eta_seconds{"))
            .collect();
        assert_eq!(
            etas,
            [r#"tether_queue_drain_eta_seconds{durable_id="q48"} 4"#]
        );
        let none = render_lag_metrics(&[], &sizes, 10_000);
        assert!(!none.contains("durable_id"));
        assert!(none.contains("tether_queue_size_events_count 50"));
    }

    proptest! {
        #[test]
        fn merged_pages_equal_one_listing(
            pendings in proptest::collection::vec(0u64..20, 0..40),
            nodes in 1usize..4,
            limit in 1usize..10,
            desc in any::<bool>(),
        ) {
            let order = if desc { SortOrder::Desc } else { SortOrder::Asc };
            let views: Vec<QueueView> = pendings
                .iter()
                .enumerate()
                .map(|(i, &p)| {
                    let mut v = view(&format!("q{i:02}"), p, None);
                    v.node = format!("n{}", i % nodes);
                    v
                })
                .collect();
            let mut q = query(SortBy::Pending, order, limit);
            let mut merged = Vec::new();
            loop {
                let pages = (0..nodes).map(|n| {
                    let node = format!("n{n}");
                    q.select(views.iter().filter(|v| v.node == node).cloned())
                });
                let page = q.merge(pages);
                prop_assert_eq!(page.total, views.len() as u64);
                merged.extend(page.queues.iter().map(|v| v.id.clone()));
                match page.next(&q) {
                    Some(t) => q.after = Some(t),
                    None => break,
                }
            }
            let mut all = views.clone();
            all.sort_by(|a, b| q.compare(a, b));
            let all: Vec<String> = all.into_iter().map(|v| v.id).collect();
            prop_assert_eq!(merged, all);
        }
    }
}
