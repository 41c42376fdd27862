//! Prometheus metrics: names (all `tether_`) and the process-wide recorder. The `/metrics`
//! endpoint is part of the HTTP admin surface (`server/admin.rs`), which appends the per-queue
//! lag metrics rendered by [`crate::admin::render_lag_metrics`] at each scrape. The recorder
//! sets buckets per metric: seconds for the histograms of durations, operations for the
//! write-batch histogram (`tether_storage_write_batch_ops`).

use std::sync::OnceLock;

use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};

pub const EVENTS_PUBLISHED: &str = "tether_events_published_total";
pub const EVENTS_ENQUEUED: &str = "tether_events_enqueued_total";
pub const EVENTS_DELIVERED: &str = "tether_events_delivered_total";
pub const EVENTS_REPLAYED: &str = "tether_events_replayed_total";
pub const EVENTS_REDELIVERED: &str = "tether_events_redelivered_total";
pub const EVENTS_ACKED: &str = "tether_events_acked_total";
pub const QUEUES: &str = "tether_queues";
pub const PENDING_EVENTS: &str = "tether_pending_events";
pub const PENDING_BYTES: &str = "tether_pending_bytes";
pub const OLDEST_UNACKED_AGE: &str = "tether_oldest_unacked_age_seconds";
pub const CONNECTIONS: &str = "tether_connections";
pub const QUEUES_EXPIRED: &str = "tether_queues_expired_total";
pub const REPLAY_DURATION: &str = "tether_replay_duration_seconds";
pub const WRITE_BATCH_OPS: &str = "tether_storage_write_batch_ops";
pub const FSYNC_LATENCY: &str = "tether_storage_fsync_seconds";
pub const WRITER_WAIT: &str = "tether_storage_writer_wait_seconds";
pub const STORAGE_MEMORY: &str = "tether_storage_memory_bytes";
pub const STORAGE_L0_FILES: &str = "tether_storage_l0_files";
pub const HEAP_LIVE: &str = "tether_heap_live_bytes";
pub const HEAP_RETAINED: &str = "tether_heap_retained_bytes";
pub const PUBLISH_REJECTED: &str = "tether_publish_rejected_total";
pub const PUBLISH_BLOCKED: &str = "tether_publish_blocked_total";
pub const QUEUES_DROPPED_FULL: &str = "tether_queues_dropped_full_total";
pub const CLIENT_ERRORS: &str = "tether_client_errors_total";
pub const CLIENT_SEEN_FLAGS_RAISED: &str = "tether_client_seen_flags_raised_total";
pub const CLIENT_SEEN_DIVERGED: &str = "tether_client_seen_diverged_total";
pub const LOCK_HELD_SLOW: &str = "tether_lock_held_slow_total";
pub const LOCK_WAIT_SLOW: &str = "tether_lock_wait_slow_total";
pub const FORWARD_LAG: &str = "tether_forward_lag_entries";
pub const PUBLISH_LOG_BYTES: &str = "tether_publish_log_bytes";
pub const FORWARDED: &str = "tether_forwarded_publishes_total";
pub const CLUSTER_IS_LEADER: &str = "tether_cluster_is_leader";
pub const CLUSTER_TERM: &str = "tether_cluster_term";
pub const CLUSTER_APPLIED_INDEX: &str = "tether_cluster_applied_index";
pub const CLUSTER_PLACED_QUEUES: &str = "tether_cluster_placed_queues";
pub const REPLICATION_LAG: &str = "tether_replication_lag_entries";
pub const REPLICATION_SNAPSHOTS_SENT: &str = "tether_replication_snapshots_sent_total";
pub const REPLICATION_SNAPSHOTS_RECEIVED: &str = "tether_replication_snapshots_received_total";
pub const REPLICATION_SUPERSEDED: &str = "tether_replication_superseded_total";
pub const REPLICATION_COPIES_REGRESSED: &str = "tether_replication_copies_regressed_total";
pub const REPLICATION_DEPOSED_SENDERS_FENCED: &str =
    "tether_replication_deposed_senders_fenced_total";
pub const REPLICATION_COPIES_OF_ANOTHER_QUEUE: &str =
    "tether_replication_copies_of_another_queue_total";
pub const REPLICATION_STEPPED_ASIDE: &str = "tether_replication_stepped_aside_total";
pub const REPLICATION_COPIES_UNREACHABLE: &str = "tether_replication_copies_unreachable_total";
pub const QUEUES_DEPOSED_BY_RIVAL: &str = "tether_queues_deposed_by_rival_total";
pub const FAILOVERS: &str = "tether_failovers_total";
pub const CLIENT_FAILOVERS: &str = "tether_client_failovers_total";
pub const REBALANCE_MOVES: &str = "tether_rebalance_moves_total";
pub const DRAIN_COPIES_MOVED: &str = "tether_drain_copies_moved_total";
pub const SPREAD_COPIES_MOVED: &str = "tether_spread_copies_moved_total";
pub const QUEUE_COPIES: &str = "tether_queue_copies";
pub const RECENT_PUBLISH_OPS: &str = "tether_failover_recent_publish_ops";
pub const RECENT_PUBLISH_OPS_DROPPED: &str = "tether_failover_recent_publish_ops_dropped_total";
pub const RECENT_PUBLISH_HELD_BYTES: &str = "tether_failover_recent_publish_held_bytes";
pub const CLIENT_CRL_RELOADS: &str = "tether_client_crl_reloads_total";
pub const REVOKED_CONNECTIONS_CLOSED: &str = "tether_revoked_connections_closed_total";
pub const AUTH_RELOADS: &str = "tether_auth_reloads_total";
pub const WITHDRAWN_TOKEN_CONNECTIONS_CLOSED: &str =
    "tether_withdrawn_token_connections_closed_total";
pub const PEER_REFUSED: &str = "tether_peer_refused_total";
pub const PROTOCOL_VERSION_REFUSED: &str = "tether_protocol_version_refused_total";
// Per durable queue, rendered at each scrape for the top N queues by pending events only.
pub const QUEUE_PENDING_EVENTS: &str = "tether_queue_pending_events";
pub const QUEUE_PENDING_BYTES: &str = "tether_queue_pending_bytes";
pub const QUEUE_OLDEST_PENDING_AGE: &str = "tether_queue_oldest_pending_age_seconds";
pub const QUEUE_AWAY: &str = "tether_queue_away_seconds";
pub const QUEUE_ACK_RATE: &str = "tether_queue_ack_rate";
pub const QUEUE_DRAIN_ETA: &str = "tether_queue_drain_eta_seconds";
/// Histogram of pending events over every queue of a node (rendered at each scrape).
pub const QUEUE_SIZE: &str = "tether_queue_size_events";

/// Buckets of the histograms that measure seconds (fsync, replay), from 10 µs to a minute.
pub const SECONDS_BUCKETS: [f64; 13] = [
    1e-5, 1e-4, 5e-4, 1e-3, 5e-3, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 10.0, 60.0,
];
/// Buckets of `tether_storage_write_batch_ops`: operations per group commit, in powers of two.
pub const WRITE_BATCH_OPS_BUCKETS: [f64; 14] = [
    1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0, 1024.0, 2048.0, 4096.0, 8192.0,
];

static HANDLE: OnceLock<PrometheusHandle> = OnceLock::new();

/// Installs the process-wide recorder once and returns its handle. Several in-process nodes
/// (tests, embedding) share it.
pub fn handle() -> &'static PrometheusHandle {
    HANDLE.get_or_init(|| {
        let recorder = PrometheusBuilder::new()
            .set_buckets(&SECONDS_BUCKETS)
            .and_then(|b| {
                b.set_buckets_for_metric(
                    Matcher::Full(WRITE_BATCH_OPS.to_string()),
                    &WRITE_BATCH_OPS_BUCKETS,
                )
            })
            .expect("static buckets are valid")
            .build_recorder();
        let handle = recorder.handle();
        // Another recorder may already be installed by a host process; then ours only renders.
        let _ = metrics::set_global_recorder(recorder);
        describe();
        handle
    })
}

fn describe() {
    use metrics::{describe_counter, describe_gauge, describe_histogram};
    describe_counter!(EVENTS_PUBLISHED, "Entry events published");
    describe_counter!(
        EVENTS_ENQUEUED,
        "Queue entries appended (one per matching queue)"
    );
    describe_counter!(EVENTS_DELIVERED, "Queue entries written to clients");
    describe_gauge!(
        FORWARD_LAG,
        "Publishes of this node not yet applied by a peer (label peer)"
    );
    describe_gauge!(
        PUBLISH_LOG_BYTES,
        "Bytes of this node's publishes kept until every peer applied them (limit: publish-log-bytes-max)"
    );
    describe_gauge!(
        CLUSTER_IS_LEADER,
        "1 while this node leads the metadata group, else 0"
    );
    describe_gauge!(CLUSTER_TERM, "Current term of the metadata group");
    describe_gauge!(
        CLUSTER_APPLIED_INDEX,
        "Metadata log index applied on this node"
    );
    describe_gauge!(
        CLUSTER_PLACED_QUEUES,
        "Durable queues the metadata places on this node"
    );
    describe_gauge!(
        REPLICATION_LAG,
        "Largest replication lag towards a secondary over this node's primary queues, in entries"
    );
    describe_counter!(
        REPLICATION_SNAPSHOTS_SENT,
        "Queue snapshots sent to new or far-behind secondaries"
    );
    describe_counter!(
        REPLICATION_COPIES_REGRESSED,
        "Secondaries found holding less than they had acknowledged (their copy was lost), taken out of the replica set to join again as syncing"
    );
    describe_counter!(
        REPLICATION_DEPOSED_SENDERS_FENCED,
        "Replication messages from a primary the metadata here deposed since it shipped them, answered fenced (no copy taken from it)"
    );
    describe_counter!(
        REPLICATION_COPIES_OF_ANOTHER_QUEUE,
        "Copies replaced because their primary shipped another queue of the same durable id (the one copied had ended, and the id was placed again)"
    );
    describe_counter!(
        REPLICATION_COPIES_UNREACHABLE,
        "Secondaries their primary could not reach for two failure times while it reached a majority, taken out of the replica set (another member becomes a copy)"
    );
    describe_counter!(
        QUEUES_DEPOSED_BY_RIVAL,
        "Queues this node gave up when a newer primary shipped to it as its copy before the metadata here said so (this node cut from the metadata leader)"
    );
    describe_counter!(
        REPLICATION_STEPPED_ASIDE,
        "Client sessions a primary sent away because it lost its lease and reaches no majority of the cluster (the client fails over to a copy)"
    );
    describe_counter!(
        REPLICATION_SUPERSEDED,
        "Replication messages dropped unsent: their pipeline restarted (a retransmit timeout, a lost connection) while they waited for a slow peer"
    );
    describe_counter!(
        REPLICATION_SNAPSHOTS_RECEIVED,
        "Queue snapshots installed as a secondary"
    );
    describe_counter!(
        FAILOVERS,
        "Queues this node took over as primary after their primary failed"
    );
    describe_counter!(
        CLIENT_FAILOVERS,
        "Promotions of this node asked for by a client that lost its primary (also counted in tether_failovers_total)"
    );
    describe_counter!(
        REBALANCE_MOVES,
        "Away durable queues this node handed over to a member holding fewer primaries (rebalancing), or to any member while this node drains"
    );
    describe_counter!(
        DRAIN_COPIES_MOVED,
        "Copies of this node's primary queues taken off a draining member once their replacements elsewhere were in sync"
    );
    describe_counter!(
        SPREAD_COPIES_MOVED,
        "Copies of this node's primary queues moved to a member holding far fewer copies, once the new copy was in sync (spreading copies)"
    );
    describe_gauge!(QUEUE_COPIES, "Queue copies this node holds as a secondary");
    describe_gauge!(
        RECENT_PUBLISH_OPS,
        "Publish operations kept for a promotion: applied here, not yet applied by every member or held by every copy this node holds"
    );
    describe_gauge!(
        RECENT_PUBLISH_HELD_BYTES,
        "Estimated bytes of the kept publishes held in memory (the newest, up to RECENT_FORWARD_HELD_BYTES_MAX; older ones are read back from the recent-publish log)"
    );
    describe_counter!(
        RECENT_PUBLISH_OPS_DROPPED,
        "Publish operations forgotten before every copy held them (over RECENT_FORWARD_OPS_MAX): a failover then may miss them"
    );
    describe_counter!(
        CLIENT_CRL_RELOADS,
        "Client certificate revocation lists loaded after a change of the file (label result: ok, error)"
    );
    describe_counter!(
        REVOKED_CONNECTIONS_CLOSED,
        "Open client connections closed because their certificate was revoked"
    );
    describe_counter!(
        AUTH_RELOADS,
        "[auth] tables read again after a change of the configuration file (label result: ok, error)"
    );
    describe_counter!(
        WITHDRAWN_TOKEN_CONNECTIONS_CLOSED,
        "Open client connections closed because a reloaded [auth] table no longer has their token (or gives it to another principal)"
    );
    describe_counter!(
        PEER_REFUSED,
        "Peer connections and requests refused: for their identity, or for what they ask (label reason: not_cluster_ca, no_node_name, several_node_names, not_a_member, sender_mismatch, not_primary, queue_ended, node_cert_as_client, forward_gap)"
    );
    describe_counter!(
        PROTOCOL_VERSION_REFUSED,
        "Connections refused in the handshake for offering no protocol version this node speaks (a client or member of another build)"
    );
    describe_counter!(
        FORWARDED,
        "Publishes of this node applied by a peer (label peer)"
    );
    describe_counter!(EVENTS_REPLAYED, "Entries delivered flagged replayed");
    describe_counter!(
        EVENTS_REDELIVERED,
        "Entries delivered flagged possible_duplicate"
    );
    describe_counter!(EVENTS_ACKED, "Queue entries acknowledged by clients");
    describe_gauge!(QUEUES, "Subscription queues by state");
    describe_gauge!(
        PENDING_EVENTS,
        "Queued entries not yet acknowledged, all queues"
    );
    describe_gauge!(
        PENDING_BYTES,
        "Bytes of stored events not yet acknowledged, all queues (as the byte limit counts them)"
    );
    describe_gauge!(
        OLDEST_UNACKED_AGE,
        "Age of the oldest unacknowledged queue entry"
    );
    describe_gauge!(CONNECTIONS, "Open client connections");
    describe_counter!(QUEUES_EXPIRED, "Durable queues dropped by their timeout");
    describe_histogram!(REPLAY_DURATION, "Time from ready to the live marker");
    describe_histogram!(WRITE_BATCH_OPS, "Operations per storage group commit");
    describe_histogram!(FSYNC_LATENCY, "Duration of a synced storage write");
    describe_histogram!(
        WRITER_WAIT,
        "Time the oldest request of a group commit waited for the storage writer"
    );
    describe_gauge!(
        STORAGE_MEMORY,
        "Memory the storage engine holds, by kind: memtables, table_readers, block_cache, block_cache_pinned"
    );
    describe_gauge!(
        HEAP_LIVE,
        "Bytes in live heap allocations, by allocator: rust (when counted), native (the C allocator, RocksDB's)"
    );
    describe_gauge!(
        HEAP_RETAINED,
        "Bytes freed but kept by the C allocator (native)"
    );
    describe_gauge!(
        STORAGE_L0_FILES,
        "Level-0 table files of the queue entries (many: compaction is behind)"
    );
    describe_counter!(PUBLISH_REJECTED, "Publishes refused, by reason");
    describe_counter!(
        PUBLISH_BLOCKED,
        "Times a publish waited for a full queue to drain"
    );
    describe_counter!(
        QUEUES_DROPPED_FULL,
        "Queues dropped by the drop-queue policy"
    );
    describe_counter!(CLIENT_ERRORS, "Clients disconnected for an error, by code");
    describe_counter!(
        CLIENT_SEEN_FLAGS_RAISED,
        "Resumed durable queues whose client had seen entries the queue did not mark delivered \
         (flagged possible_duplicate on the client's word)"
    );
    describe_counter!(
        CLIENT_SEEN_DIVERGED,
        "Resumed durable queues that lost entries their client had seen (every entry flagged; \
         the client told its offsets no longer match)"
    );
    describe_counter!(
        LOCK_HELD_SLOW,
        "Node state locks held 100 ms or longer, by lock (each also logged with its caller)"
    );
    describe_counter!(
        LOCK_WAIT_SLOW,
        "Node state locks waited for 100 ms or longer, by lock"
    );
}
