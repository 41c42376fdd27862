//! Every limit Tether enforces, as a named constant with its unit in the name.
//!
//! Frame-level limits live in `tether_transport` (`FRAME_BYTES_MAX`, idle and keep-alive
//! timeouts); this module holds the ones the protocol and the node enforce. Relationships
//! between limits are checked at compile time at the bottom of the file.

use tether_transport::codec::FRAME_BYTES_MAX;

/// Client-side defaults, defined by the client crate.
pub use tether_client::{ACK_INTERVAL_MS_DEFAULT, DURABLE_TIMEOUT_SECS_DEFAULT};

/// Longest region name, in bytes of UTF-8.
pub const REGION_NAME_BYTES_MAX: usize = 256;
/// Longest key, in bytes of UTF-8.
pub const KEY_BYTES_MAX: usize = 1024;
/// Largest value of one key, in bytes.
pub const VALUE_BYTES_MAX: usize = 1024 * 1024;
/// Longest durable id, in bytes of UTF-8.
pub const DURABLE_ID_BYTES_MAX: usize = 256;
/// Longest token a client may present, in bytes.
pub const TOKEN_BYTES_MAX: usize = 4096;
/// Longest node id, in bytes.
pub const NODE_ID_BYTES_MAX: usize = 64;
/// Longest wait of a `--ack replicated` publish for its copies, in milliseconds.
pub const REPLICATED_ACK_TIMEOUT_MS: u64 = 10_000;
/// Longest principal name (a token's principal or a client certificate's common name), in
/// bytes: the owner of a durable id travels in the cluster's metadata commands.
pub const PRINCIPAL_BYTES_MAX: usize = 1024;
/// Largest first frame (the hello) of a client connection, in bytes: it is read before the
/// client is authenticated, so it is held far below the frame limit.
pub const HELLO_BYTES_MAX: usize = 16 * 1024;
/// Longest regex source text, in bytes.
pub const REGEX_SOURCE_BYTES_MAX: usize = 1024;
/// Size limit handed to the `regex` crate for one compiled interest regex, in bytes.
pub const REGEX_COMPILED_BYTES_MAX: usize = 256 * 1024;
/// Distinct interest regexes one region may hold, over every queue: each is tried on every key
/// published to the region.
pub const REGEXES_PER_REGION_MAX: usize = 10_000;
/// Distinct interest regexes (by region and source) the queues of one authenticated principal
/// may hold between them, in every region: a tenth of a region's, so one principal cannot
/// take a region's whole room. An open node's clients share no principal and are not counted.
pub const REGEXES_PER_PRINCIPAL_MAX: usize = 1_000;
/// Regexes registered (or removed) in a region since its regex set was built that make it be
/// built again, at the least (an eighth of the set, when more).
pub const REGEX_SET_CHANGES_MIN: usize = 32;
/// Cache a region's regex set may use for its lazy DFA, in bytes (grown as keys need it): less
/// makes regexes that match anywhere in the key (`.*x.*`) slower together than one by one.
pub const REGEX_SET_DFA_BYTES_MAX: usize = 32 * 1024 * 1024;
/// Interest registrations one client queue may hold (each key of a key list counts once).
pub const INTERESTS_PER_QUEUE_MAX: usize = 10_000;
/// Bytes of interest one client queue may hold: region names plus keys or regex sources, each
/// registration counted with [`INTEREST_OVERHEAD_BYTES`]. A queue's durable interest travels
/// with the replication messages of its queue (each message until the copies acknowledge a
/// change), which must fit a peer message.
pub const INTEREST_BYTES_PER_QUEUE_MAX: usize = 2 * 1024 * 1024;
/// What one interest registration counts for beyond its text, in bytes.
pub const INTEREST_OVERHEAD_BYTES: usize = 16;
/// Operations in one publish request.
pub const PUBLISH_OPS_PER_REQUEST_MAX: usize = 10_000;
/// Largest durable timeout a client may present, in seconds (one week).
pub const DURABLE_TIMEOUT_SECS_MAX: u64 = 7 * 24 * 3600;
/// Entries waiting in one queue before publishes that match it are rejected.
pub const QUEUE_ENTRIES_MAX: u64 = 50_000_000;
/// Bytes of stored events waiting in one queue before publishes that match it are refused
/// (16 GiB).
pub const QUEUE_BYTES_MAX: u64 = 16 << 30;
/// Lowest `queue-bytes-max` a node accepts, in bytes.
pub const QUEUE_BYTES_MAX_LOWEST_BYTES: u64 = 4096;
/// Bytes of publishes a clustered node keeps for peers that have not applied them (a peer
/// down or slow) before it refuses new publishes (32 GiB).
pub const PUBLISH_LOG_BYTES_MAX: u64 = 32 << 30;
/// Concurrent client connections one node accepts.
pub const CONNECTIONS_PER_NODE_MAX: usize = 10_000;
/// Time a new connection has to send its hello frame, in milliseconds.
pub const HANDSHAKE_TIMEOUT_MS: u64 = 5_000;
/// Deadline for the old connection of a durable id to answer a liveness ping before a new
/// connection with the same id takes the queue over, in milliseconds.
pub const LIVENESS_PROBE_TIMEOUT_MS: u64 = 1_000;
/// Events a session may have on the wire beyond its acked offset before delivery pauses.
pub const INFLIGHT_EVENTS_PER_SESSION_MAX: u64 = 1_000_000;
/// Delivery reads of queue entries a node runs at once, whatever the number of sessions
/// replaying: more would only add blocking threads, storage iterators and frame buffers (each
/// allocator heap of a thread keeps memory), not throughput.
pub const DELIVERY_READS_IN_FLIGHT_MAX: usize = 8;
/// Threads of the low-priority pool that reads and frames replays (one per core of the
/// development machine; a frame's delivered mark is awaited by its session's task, never here).
pub const DELIVERY_READ_THREADS: usize = 2;
/// Bytes of entry bodies read from storage into one delivery frame.
pub const DELIVERY_FRAME_BODY_BYTES_MAX: usize = 256 * 1024;
/// Entries a queue's stored delivered mark is reserved past its end: one synced write of the
/// mark covers the replay and this many live entries after it. After a power cut, entries
/// that existed then and were not sent may come back flagged `possible_duplicate`.
pub const DELIVERED_MARK_RESERVE_ENTRIES: u64 = 4096;
/// Session ids a node skips at each restart: more than a node can allocate between two
/// writebacks of its storage, so an id whose write a power cut lost (`--sync none`) is never
/// allocated again, and event ids (node, session, sequence) stay unique.
pub const SESSION_IDS_SKIPPED_AT_RESTART: u64 = 1 << 24;
/// Unix time of 2026-01-01T00:00:00Z, in milliseconds. A new data directory numbers its
/// publish log and its publisher sessions from the milliseconds since then
/// (`control::forward::new_log_start`, [`SESSION_IDS_START_SHIFT_BITS`]): a node that lost its
/// data directory and came back under its name reuses neither, so its peers neither skip its
/// new publishes as applied nor take its new events for ones they hold.
pub const IDS_EPOCH_MS: u64 = 1_767_225_600_000;
/// A new data directory's first publisher session id is the milliseconds since
/// [`IDS_EPOCH_MS`] shifted left by this many bits, plus one: past every id an earlier data
/// directory of the node allocated, unless that one's sessions and restarts (each skipping
/// [`SESSION_IDS_SKIPPED_AT_RESTART`], 4,096 ms' worth) outran 4,096 ids a millisecond over
/// its life. Ids stay below 2^53 (exact in JSON numbers) for 69 years.
pub const SESSION_IDS_START_SHIFT_BITS: u32 = 12;
/// Bytes of region keys whose existence the core remembers once their write committed, so
/// that a publish to a key written lately (create or update?) does not read the store under
/// the core lock: the point read took about half of the publish path's time under the lock
/// in a profile (`NodeCore::publish_within`). Each key counts its region's and its own bytes
/// plus [`KNOWN_REGION_KEY_OVERHEAD_BYTES`]; past the sum the set starts over.
pub const KNOWN_REGION_KEYS_BYTES_MAX: usize = 8 << 20;
/// What one remembered region key costs besides its region's and its own bytes: the map's
/// entry and the two strings' allocations, in bytes.
pub const KNOWN_REGION_KEY_OVERHEAD_BYTES: usize = 128;
/// Expired durable ids remembered so that their next connection sees `expired` once.
pub const EXPIRED_IDS_REMEMBERED_MAX: usize = 100_000;
/// How often the node looks for away queues whose durable timeout has passed, in milliseconds.
pub const EXPIRY_TICK_MS: u64 = 200;
/// Publish operations and acks waiting for the storage writer before new ones wait.
pub const WRITER_QUEUE_REQUESTS_MAX: usize = 4_096;
/// Longest wait of a forwarded run of a peer's publish log for the run before it (sent
/// earlier, arriving later) to be applied, in milliseconds; then it is answered with what is
/// applied, and the peer sends again from there.
pub const FORWARD_GAP_WAIT_MS: u64 = 2_000;
/// Publish requests of one client connection submitted and not yet answered (waiting for
/// their commit, or their copies under `ack: replicated`); the connection's next frame is read
/// once the oldest is answered.
pub const PUBLISHES_IN_FLIGHT_MAX: usize = 64;
/// Bytes of publish operations (region names, keys and values) of one client connection
/// submitted and not yet answered; the connection's next frame is read once fewer are in
/// flight, so a connection makes the node hold at most this plus one frame of publishes.
pub const PUBLISH_BYTES_IN_FLIGHT_PER_CONNECTION_MAX: usize = 16 * 1024 * 1024;
/// Bytes of publish operations submitted to the storage writer and not yet committed, on the
/// whole node; a publish beyond it waits (its connection stops reading) until commits free
/// room. Counted in KiB ([`WRITER_QUEUE_KIB_MAX`]).
pub const WRITER_QUEUE_BYTES_MAX: usize = 64 * 1024 * 1024;
/// [`WRITER_QUEUE_BYTES_MAX`] in KiB, the unit of the writer's byte permits.
pub const WRITER_QUEUE_KIB_MAX: usize = WRITER_QUEUE_BYTES_MAX / 1024;
/// Bytes one publish may add to queues, counted once per matching queue (an event is stored
/// in each queue it matches: an 8 MiB publish matching 32 queues writes 256 MiB in one
/// batch). A publish beyond it is refused with `limit-exceeded`. A publish's queue bytes
/// also count in the writer's queue ([`WRITER_QUEUE_BYTES_MAX`]); one beyond that takes it
/// all, so at most one such publish waits for the writer at a time.
pub const PUBLISH_FANOUT_BYTES_MAX: usize = 256 * 1024 * 1024;
/// Bytes of keys and values in one part of an initial image sent in parts (a part holds at
/// least one entry, so it may pass this by one entry).
pub const INITIAL_IMAGE_PART_BYTES_MAX: usize = 1024 * 1024;
/// Parts of an initial image read ahead of the connection's writes.
pub const INITIAL_IMAGE_PARTS_AHEAD: usize = 2;
/// Bytes an initial image answered in one frame may hold (clients that do not take parts),
/// counted as for a part: the frame limit less room for the answer's envelope.
pub const INITIAL_IMAGE_ONE_ANSWER_BYTES_MAX: usize = FRAME_BYTES_MAX - 4 * 1024;
/// What one initial-image entry counts for beyond its key and value, in bytes: at least its
/// CBOR encoding adds (map header, field names, string and byte-string headers).
pub const INITIAL_IMAGE_ENTRY_OVERHEAD_BYTES: usize = 24;

const _: () = {
    // A delivery frame holds bodies plus per-entry overhead; keep a wide margin below the
    // transport's hard frame limit.
    assert!(DELIVERY_FRAME_BODY_BYTES_MAX + VALUE_BYTES_MAX + 64 * 1024 < FRAME_BYTES_MAX);
    // One publish of maximal values must fit a frame when sent one op at a time.
    assert!(VALUE_BYTES_MAX + KEY_BYTES_MAX + REGION_NAME_BYTES_MAX < FRAME_BYTES_MAX);
    // One largest publish always fits the budgets.
    assert!(FRAME_BYTES_MAX <= PUBLISH_BYTES_IN_FLIGHT_PER_CONNECTION_MAX);
    assert!(FRAME_BYTES_MAX <= WRITER_QUEUE_BYTES_MAX);
    assert!(FRAME_BYTES_MAX <= PUBLISH_FANOUT_BYTES_MAX);
    assert!(DURABLE_TIMEOUT_SECS_DEFAULT <= DURABLE_TIMEOUT_SECS_MAX);
    // A hello with the longest durable id, token and node name fits its limit with room to
    // spare (field names, the client's name).
    assert!(DURABLE_ID_BYTES_MAX + TOKEN_BYTES_MAX + NODE_ID_BYTES_MAX < HELLO_BYTES_MAX / 2);
    assert!(LIVENESS_PROBE_TIMEOUT_MS < HANDSHAKE_TIMEOUT_MS);
    // A part of an initial image, passed by one largest entry, fits a frame with room.
    assert!(
        INITIAL_IMAGE_PART_BYTES_MAX
            + KEY_BYTES_MAX
            + VALUE_BYTES_MAX
            + INITIAL_IMAGE_ENTRY_OVERHEAD_BYTES
            < INITIAL_IMAGE_ONE_ANSWER_BYTES_MAX
    );
};
