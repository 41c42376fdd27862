//! Wire messages of the client protocol.
//!
//! A session is one QUIC connection with two streams:
//! - the **control stream**, a bidirectional stream opened by the client: [`ClientMsg`] frames
//!   up, [`ServerMsg`] frames down. The first client frame is [`ClientMsg::Hello`]; the first
//!   server frame is [`ServerMsg::Welcome`] (queue status and pending count, before any event)
//!   or [`ServerMsg::Error`] followed by a close with the same code.
//! - the **delivery stream**, a unidirectional stream opened by the server after the welcome:
//!   [`Delivery`] frames carrying batches of queue entries and live markers, in offset order.
//!
//! Frames are length-prefixed CBOR (see `tether_transport::codec`). Queue entries travel as the
//! exact bytes stored in the queue log (an encoded [`EventRecord`]) so the server never decodes
//! or re-encodes an event on the replay path.

use serde::{Deserialize, Serialize};

/// Elements a client's list may have in a decoded frame (a key list interest, a publish's
/// operations). Far above the node's own limits for them (10,000 each, refused with
/// `limit-exceeded`), so only absurd lists meet it: a frame may hold millions of one-byte
/// elements (an empty string), each 24 bytes or more once decoded, and decoding stops here
/// before they fill memory (the frame is refused as malformed).
pub const DECODED_LIST_ELEMENTS_MAX: usize = 65_536;

/// Deserializes a list of at most [`DECODED_LIST_ELEMENTS_MAX`] elements: a longer one is an
/// error as soon as its length is read (or its element past the bound, for a list of
/// indefinite length).
fn bounded_list<'de, D, T>(d: D) -> Result<Vec<T>, D::Error>
where
    D: serde::Deserializer<'de>,
    T: Deserialize<'de>,
{
    use serde::de::{Error, SeqAccess, Visitor};
    struct Bounded<T>(std::marker::PhantomData<T>);
    impl<'de, T: Deserialize<'de>> Visitor<'de> for Bounded<T> {
        type Value = Vec<T>;

        fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
            write!(f, "a list of at most {DECODED_LIST_ELEMENTS_MAX} elements")
        }

        fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Vec<T>, A::Error> {
            let announced = seq.size_hint().unwrap_or(0);
            if announced > DECODED_LIST_ELEMENTS_MAX {
                return Err(A::Error::invalid_length(announced, &self));
            }
            let mut out = Vec::with_capacity(announced.min(4096));
            while let Some(element) = seq.next_element()? {
                if out.len() == DECODED_LIST_ELEMENTS_MAX {
                    return Err(A::Error::invalid_length(out.len() + 1, &self));
                }
                out.push(element);
            }
            Ok(out)
        }
    }
    d.deserialize_seq(Bounded(std::marker::PhantomData))
}
pub use tether_transport::ErrorCode;

/// Entry flag: the client's matching interest has `receive_values = false`, so a create or an
/// update arrives as an invalidate without value.
pub const FLAG_NO_VALUE: u8 = 0b0001;
/// Wire flag: the entry was queued before the client said it was ready.
pub const FLAG_REPLAYED: u8 = 0b0010;
/// Wire flag: the entry was written to this durable id before and was not acknowledged.
pub const FLAG_POSSIBLE_DUPLICATE: u8 = 0b0100;
/// Flags a stored entry may carry (the rest are wire-only).
pub const STORED_FLAGS_MASK: u8 = FLAG_NO_VALUE;

/// The operation an entry event reports.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum EventOp {
    Create,
    Update,
    Destroy,
    Invalidate,
}

impl EventOp {
    pub fn as_str(self) -> &'static str {
        match self {
            EventOp::Create => "create",
            EventOp::Update => "update",
            EventOp::Destroy => "destroy",
            EventOp::Invalidate => "invalidate",
        }
    }
}

/// Cluster-unique id of an entry event: origin node, publisher session, sequence in the session.
/// Publisher session numbers are persisted before use, so ids stay unique across restarts.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct EventId {
    pub node: String,
    pub session: u64,
    pub seq: u64,
}

impl std::fmt::Display for EventId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}-{}-{}", self.node, self.session, self.seq)
    }
}

/// An entry event as stored in queue logs and shipped to clients.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct EventRecord {
    pub id: EventId,
    pub region: String,
    pub key: String,
    pub op: EventOp,
    #[serde(with = "serde_bytes")]
    pub value: Option<Vec<u8>>,
}

/// An [`EventRecord`] decoded in place: its strings and value borrow from the encoded bytes
/// (the same fields in the same order, so it reads every encoding of one).
#[derive(Clone, Debug, PartialEq, Eq, Deserialize)]
pub struct EventRecordRef<'a> {
    #[serde(borrow)]
    pub id: EventIdRef<'a>,
    pub region: &'a str,
    pub key: &'a str,
    pub op: EventOp,
    #[serde(borrow, with = "serde_bytes")]
    pub value: Option<&'a [u8]>,
}

/// An [`EventId`] decoded in place.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize)]
pub struct EventIdRef<'a> {
    pub node: &'a str,
    pub session: u64,
    pub seq: u64,
}

impl EventIdRef<'_> {
    pub fn to_event_id(&self) -> EventId {
        EventId {
            node: self.node.to_owned(),
            session: self.session,
            seq: self.seq,
        }
    }
}

/// What a client wants to hear about in one region.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum InterestSpec {
    /// One key.
    Key(String),
    /// A list of keys (registered as one key interest per key).
    Keys(#[serde(deserialize_with = "bounded_list")] Vec<String>),
    /// Keys matching a regular expression (whole-key match).
    Regex(String),
    /// Every key of the region.
    AllKeys,
}

/// What the initial image of a registration contains.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum ResultPolicy {
    /// Keys and their current values (the default).
    #[default]
    KeysValues,
    /// Keys only.
    Keys,
    /// No initial image.
    None,
}

/// A result policy name that is none of `keys-values`, `keys` or `none`.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("unknown result policy {0:?} (expected keys-values, keys or none)")]
pub struct UnknownResultPolicy(pub String);

impl std::str::FromStr for ResultPolicy {
    type Err = UnknownResultPolicy;
    fn from_str(s: &str) -> Result<Self, UnknownResultPolicy> {
        match s {
            "keys-values" => Ok(ResultPolicy::KeysValues),
            "keys" => Ok(ResultPolicy::Keys),
            "none" => Ok(ResultPolicy::None),
            other => Err(UnknownResultPolicy(other.to_string())),
        }
    }
}

/// One publish operation.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum PublishOp {
    Put {
        region: String,
        key: String,
        #[serde(with = "serde_bytes")]
        value: Vec<u8>,
    },
    Destroy {
        region: String,
        key: String,
    },
    Invalidate {
        region: String,
        key: String,
    },
}

/// When a publish is acknowledged to its publisher.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum PublishAck {
    /// Once the contacted node has committed it (under its sync mode): it then reaches every
    /// matching queue, also through failures of other nodes, but a copy of a queue may not
    /// hold it yet.
    #[default]
    Local,
    /// Once every matching queue in the cluster holds it and each of those queues' copies
    /// holds it too (members that are down are not waited for).
    Replicated,
}

impl PublishAck {
    pub fn is_local(&self) -> bool {
        *self == PublishAck::Local
    }

    pub fn as_str(&self) -> &'static str {
        match self {
            PublishAck::Local => "local",
            PublishAck::Replicated => "replicated",
        }
    }
}

/// Durable identity presented in the hello.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct DurableHello {
    pub id: String,
    pub timeout_secs: u64,
    /// Secondary copies the client asks for on a cluster (0 to 2; see `docs/cluster.md`).
    /// Taken when the queue is placed; a single node ignores it.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub redundancy: u8,
    /// Client-managed failover: the node id of the queue's primary this client lost. A
    /// secondary holding an in-sync copy that cannot reach that node either promotes itself
    /// through the cluster metadata and serves the client; otherwise it redirects as usual.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub failed_primary: Option<String>,
    /// The newest entry of this queue the client was shown (a client resuming its queue in the
    /// same process). A node whose queue ends below it, or holds another event at its offset,
    /// lost entries the client saw: it says so in the welcome (`diverged`) and flags every
    /// entry it holds `possible_duplicate`. Otherwise entries up to it are flagged.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub seen: Option<SeenEntry>,
    /// The epoch named by the redirect that sent this client here (`Redirect::epoch`). A node
    /// whose cluster metadata has not applied that far waits until it has (or answers
    /// `unavailable`) instead of acting on an older placement: so a redirect never sends the
    /// client back to where it came from, and redirects converge.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub redirect_epoch: Option<u64>,
}

/// The newest queue entry a client was shown: its offset and, when known, its event id.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SeenEntry {
    pub offset: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub event_id: Option<EventId>,
}

/// One node holding a durable queue (its primary or a copy), as told in the welcome.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct QueueServer {
    pub node_id: String,
    /// The node's client address (`IP:PORT`).
    pub addr: String,
    /// True for the primary (the node the client is connected to); false for a copy.
    pub primary: bool,
}

fn is_zero(n: &u8) -> bool {
    *n == 0
}

fn is_false(b: &bool) -> bool {
    !*b
}

/// Client → server frames on the control stream.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum ClientMsg {
    Hello {
        version: u32,
        durable: Option<DurableHello>,
        /// Bearer token, when the server requires authentication.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        token: Option<String>,
        client: String,
        /// The client understands `going-away` (19): a request the node read while stopping,
        /// and did not apply. A client that does not say so is answered `shutdown` (12)
        /// instead, which it knows.
        #[serde(default, skip_serializing_if = "std::ops::Not::not")]
        going_away: bool,
    },
    Request {
        id: u64,
        body: RequestBody,
    },
    /// Cumulative: every offset up to and including `offset` has been processed.
    Ack {
        offset: u64,
    },
    Pong {
        nonce: u64,
    },
}

/// Requests; each gets one [`ServerMsg::Response`] with the same id (a registration taking its
/// initial image in parts may get several).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum RequestBody {
    RegisterInterest {
        region: String,
        interest: InterestSpec,
        durable: bool,
        policy: ResultPolicy,
        receive_values: bool,
        /// The client takes the initial image in parts: several [`ResponseBody::Registered`]
        /// answers with this request's id, each but the last with `more` set. Without it, an
        /// image larger than one frame is refused (`limit-exceeded`) and nothing is registered.
        #[serde(default, skip_serializing_if = "std::ops::Not::not")]
        image_in_parts: bool,
    },
    UnregisterInterest {
        region: String,
        interest: InterestSpec,
    },
    Ready,
    Publish {
        #[serde(deserialize_with = "bounded_list")]
        ops: Vec<PublishOp>,
        /// When the publish is acknowledged (see [`PublishAck`]).
        #[serde(default, skip_serializing_if = "PublishAck::is_local")]
        ack: PublishAck,
    },
    Get {
        region: String,
        key: String,
    },
    ListQueues,
    CloseDurable {
        durable_id: String,
    },
    Close {
        keepalive: bool,
    },
    /// Admin: a page of the queue listing, with each queue's lag (`tether queues` with
    /// paging, filters or cluster scope; the HTTP API's `/api/v1/queues`).
    ListQueuesPage(QueuesQuery),
    /// Paces this session's replay: stored events are sent at most at this rate, in events
    /// per second (0: unlimited, the default); live events are never paced. May be sent at
    /// any time; applies from the next delivery frame. Answered with
    /// [`ResponseBody::ReplayRate`].
    ReplayRate {
        events_per_s: u64,
    },
    /// Admin, on a cluster: marks member `node_id` draining (`Some(true)`: it takes no new
    /// queue or copy and hands its own to the other members), no longer draining
    /// (`Some(false)`), or only asks how far its drain is (`None`). Answered with
    /// [`ResponseBody::Drain`].
    Drain {
        node_id: String,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        draining: Option<bool>,
    },
    /// Admin, on a cluster: removes member `node_id` from the cluster (it is marked draining
    /// first, and refused while it is still the primary of a queue). Its copies are dropped
    /// (their primaries place new ones) and nothing more is kept for it in the other members'
    /// publish logs. Answered with [`ResponseBody::NodeRemoved`].
    RemoveNode {
        node_id: String,
    },
    /// Admin, on a cluster: adds node `node_id`, reachable by peers at `addr` (`HOST:PORT`),
    /// to the cluster. The node must have been started with `--join` and the cluster's CA; it
    /// is marked draining until it has copied the regions' values, then takes queues as
    /// rebalancing moves them. Answered with [`ResponseBody::NodeAdded`].
    AddNode {
        node_id: String,
        addr: String,
    },
}

/// A member's drain, as the answering node's cluster metadata says.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct DrainReport {
    pub node_id: String,
    pub draining: bool,
    /// Durable queues the member is still primary of.
    pub primaries: u64,
    /// Copies of durable queues the member still holds for other primaries.
    pub copies: u64,
}

/// A page request of the queue listing. Unset fields take the listing's defaults; values are
/// those of the HTTP API's query parameters (docs/admin.md).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct QueuesQuery {
    /// Queues per page (default 100, capped at 1000).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub limit: Option<u64>,
    /// The `next` token of the previous page.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub after: Option<String>,
    /// `pending` (default), `bytes`, `age` or `id`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sort: Option<String>,
    /// `desc` (default) or `asc`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub order: Option<String>,
    /// `ready`, `connected` or `away`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub state: Option<String>,
    /// Queues with interest in this region.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub region: Option<String>,
    /// Queues whose id starts with this.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prefix: Option<String>,
    /// `primary` (default), `secondary` or `all`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub role: Option<String>,
    /// Only the contacted node's queues (default: every member's).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub node_only: bool,
}

/// One page of the queue listing.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct QueuesPage {
    pub queues: Vec<QueueReport>,
    /// The token of the next page (None: this is the last).
    pub next: Option<String>,
    /// Queues matching the filters, over every page.
    pub total: u64,
    /// Members that did not answer (their queues are missing).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub unreachable: Vec<String>,
}

/// Queue status sent in the welcome, before any event.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum QueueStatus {
    /// No queue existed for this durable id.
    New,
    /// The queue timed out while the client was away and was dropped (reported once).
    Expired,
    /// The queue was kept; `pending` events wait after the acked offset.
    Resumed,
    /// Not a durable client.
    None,
}

impl QueueStatus {
    pub fn as_str(self) -> &'static str {
        match self {
            QueueStatus::New => "new",
            QueueStatus::Expired => "expired",
            QueueStatus::Resumed => "resumed",
            QueueStatus::None => "none",
        }
    }
}

/// An error carried in a response or before a close.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, thiserror::Error)]
#[error("{message} ({})", code.name())]
pub struct WireError {
    pub code: ErrorCode,
    pub message: String,
}

impl WireError {
    pub fn new(code: ErrorCode, message: impl Into<String>) -> Self {
        WireError {
            code,
            message: message.into(),
        }
    }
}

/// Server → client frames on the control stream.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum ServerMsg {
    Welcome {
        node_id: String,
        session: u64,
        queue: QueueStatus,
        pending: Option<u64>,
        /// On a cluster, the nodes holding this durable queue: the primary (this node) and
        /// its copies, in promotion order. Empty for a single node or a non-durable client.
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        queue_servers: Vec<QueueServer>,
        /// The resumed queue lost entries the client said it saw (`DurableHello::seen`): its
        /// offsets no longer match the client's. Every entry it holds is flagged
        /// `possible_duplicate`; the client forgets which offsets it processed.
        #[serde(default, skip_serializing_if = "is_false")]
        diverged: bool,
    },
    Response {
        id: u64,
        result: Result<ResponseBody, WireError>,
    },
    Ping {
        nonce: u64,
    },
    Error(WireError),
    /// Answer to a durable hello on a node that does not hold the queue: connect to `addr`
    /// (node `node_id`) instead. The connection closes after this frame.
    Redirect {
        node_id: String,
        addr: String,
        /// The queue's placement epoch (a metadata log index) this node redirects by: the
        /// client names it in its next hello (`DurableHello::redirect_epoch`).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        epoch: Option<u64>,
    },
}

/// One key of an initial image.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct InitialEntry {
    pub key: String,
    #[serde(with = "serde_bytes")]
    pub value: Option<Vec<u8>>,
}

/// An interest as reported by `tether queues`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct InterestInfo {
    pub region: String,
    pub kind: String,
    pub spec: Option<String>,
    pub durable: bool,
}

/// A queue as reported by `tether queues`.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct QueueReport {
    pub durable_id: Option<String>,
    pub state: String,
    pub pending: u64,
    /// Bytes of the stored events waiting, as the byte limit counts them (over by at most
    /// 1/64 of `queue-bytes-max` plus one event). Absent for a secondary's copy.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pending_bytes: Option<u64>,
    pub acked_offset: u64,
    pub end_offset: u64,
    pub timeout_secs: u64,
    pub role: String,
    pub interests: Vec<InterestInfo>,
    /// Cluster, on a primary: each secondary copy and how far behind it is.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub copies: Vec<CopyLag>,
    /// Cluster, on a secondary's copy: the node holding the primary.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub primary: Option<String>,
    /// The fields below come with a page of the listing ([`RequestBody::ListQueuesPage`]).
    /// The queue's id: its durable id, or `node:number` for a non-durable queue.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub id: Option<String>,
    /// The node the report comes from.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node: Option<String>,
    /// Age of the oldest unacknowledged entry, in milliseconds.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub oldest_pending_age_ms: Option<u64>,
    /// When the durable client went away (ms since the epoch).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub away_since_ms: Option<u64>,
    /// When the away queue expires unless its client returns (ms since the epoch).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub expires_at_ms: Option<u64>,
    /// Entries appended, sent and acknowledged per minute (rounded: the protocol carries no
    /// floats).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub enqueue_per_min: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub delivery_per_min: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ack_per_min: Option<u64>,
    /// Seconds until everything is acknowledged at the current rates, rounded up (None: not
    /// shrinking).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub drain_eta_secs: Option<u64>,
}

/// One secondary copy of a queue, as its primary sees it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct CopyLag {
    /// The node holding the copy.
    pub node: String,
    /// Entries the copy has not acknowledged yet.
    pub lag_entries: u64,
}

/// Successful responses.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum ResponseBody {
    /// The initial image, or one part of it (see `image_in_parts`): the keys come in key
    /// order for a scan, in the registration's order for a key list.
    Registered {
        initial: Vec<InitialEntry>,
        /// More parts of this image follow, with the same request id.
        #[serde(default, skip_serializing_if = "std::ops::Not::not")]
        more: bool,
    },
    Unregistered {
        removed: bool,
    },
    Ready {
        replay_end: u64,
    },
    Published {
        count: u64,
    },
    Value {
        #[serde(with = "serde_bytes")]
        value: Option<Vec<u8>>,
    },
    Queues {
        queues: Vec<QueueReport>,
    },
    QueuesPage(QueuesPage),
    ClosedDurable {
        durable_id: String,
    },
    Closed {
        keepalive: bool,
    },
    /// The replay rate now in force (events per second; 0: unlimited).
    ReplayRate {
        events_per_s: u64,
    },
    Drain(DrainReport),
    /// Member `node_id` was removed; `members` are the cluster's members after it, by name.
    NodeRemoved {
        node_id: String,
        members: Vec<String>,
    },
    /// Member `node_id` was added; `members` are the cluster's members after it, by name.
    NodeAdded {
        node_id: String,
        members: Vec<String>,
    },
}

/// One queue entry on the delivery stream. Borrows its record, so the server encodes straight
/// from its storage reads and the client decodes without copying the frame.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct WireEntry<'a> {
    pub offset: u64,
    pub flags: u8,
    /// An encoded [`EventRecord`], exactly as stored.
    #[serde(borrow, with = "serde_bytes")]
    pub record: &'a [u8],
}

/// Server → client frames on the delivery stream.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Delivery<'a> {
    #[serde(borrow)]
    Events(Vec<WireEntry<'a>>),
    /// The live marker: everything queued before ready has been delivered for these regions.
    Live(Vec<String>),
}
