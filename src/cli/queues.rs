//! `tether queues`: the listing, as JSON lines or a table.

use super::*;

/// Queues per request when `tether queues` lists everything.
const QUEUES_LIST_PAGE: u64 = 1_000;

/// Prints the queues (`tether queues`): every page, or the one asked for.
pub(super) async fn list_queues(c: &Client, a: &QueuesArgs) -> Result<(), Fail> {
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
