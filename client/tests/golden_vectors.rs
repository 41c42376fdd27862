//! Golden test vectors of the wire protocol (`docs/protocol.md`, "Golden test vectors").
//!
//! `tests/vectors/messages.json` holds, for every kind of message, the exact CBOR bytes the
//! codec (`tether_transport::codec`) writes, the frame that carries them, and a readable view
//! of the bytes: another implementation checks itself against the file, and this test checks
//! the file against the Rust types and the codec, both ways (Rust value -> bytes -> Rust value).
//!
//! A deliberate protocol change regenerates the file from the values below:
//!
//! ```text
//! TETHER_WRITE_VECTORS=1 cargo test --release -p tether-client --test golden_vectors
//! ```

use std::collections::{BTreeMap, BTreeSet};

use bytes::BytesMut;
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value as Json, json};
use tether_client::protocol::*;
use tether_transport::{ALPN, PROTOCOL_VERSION, codec};

/// The vector file, relative to this crate.
const VECTORS_FILE: &str = "tests/vectors/messages.json";
/// Set to `1` to write the vector file instead of checking it.
const WRITE_ENV: &str = "TETHER_WRITE_VECTORS";

/// A message of one of the protocol's top-level types.
enum Msg {
    /// Control stream, client to server.
    Client(ClientMsg),
    /// Control stream, server to client.
    Server(ServerMsg),
    /// Delivery stream (server to client).
    Delivery(Delivery<'static>),
    /// A stored event, as carried inside a delivery entry (never framed alone).
    Record(EventRecord),
}

/// How the codec writes a message.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Form {
    /// `codec::encode_body`: struct fields and enum variants by name.
    Named,
    /// `codec::encode_body_packed`: struct fields and enum variants by index.
    Packed,
}

impl Form {
    fn as_str(self) -> &'static str {
        match self {
            Form::Named => "named",
            Form::Packed => "packed",
        }
    }
}

impl Msg {
    fn type_name(&self) -> &'static str {
        match self {
            Msg::Client(_) => "ClientMsg",
            Msg::Server(_) => "ServerMsg",
            Msg::Delivery(_) => "Delivery",
            Msg::Record(_) => "EventRecord",
        }
    }

    /// The form the Rust side sends this message in: the server writes event frames (and
    /// stores records) packed, and everything else, live markers included, named. In the
    /// packed form serde_cbor writes struct fields and *unit and struct* variants by index,
    /// but newtype variants (`events`, `live`, `Ok`, `Err`, ...) still by name.
    fn form(&self) -> Form {
        match self {
            Msg::Delivery(Delivery::Events(_)) | Msg::Record(_) => Form::Packed,
            _ => Form::Named,
        }
    }

    fn encode_as(&self, form: Form) -> Vec<u8> {
        fn enc<T: Serialize>(v: &T, form: Form) -> Vec<u8> {
            match form {
                Form::Named => codec::encode_body(v),
                Form::Packed => codec::encode_body_packed(v),
            }
            .expect("vectors encode")
        }
        match self {
            Msg::Client(m) => enc(m, form),
            Msg::Server(m) => enc(m, form),
            Msg::Delivery(m) => enc(m, form),
            Msg::Record(m) => enc(m, form),
        }
    }

    fn encode(&self) -> Vec<u8> {
        self.encode_as(self.form())
    }

    /// The frame the codec's frame writers make of the message (None: never framed alone).
    fn frame(&self) -> Option<Vec<u8>> {
        let frame = match self {
            Msg::Client(m) => codec::encode_frame(m),
            Msg::Server(m) => codec::encode_frame(m),
            // As the server's delivery task writes them (`src/server/conn.rs`).
            Msg::Delivery(m @ Delivery::Events(_)) => {
                let mut buf = BytesMut::new();
                codec::encode_frame_packed_into(m, &mut buf).map(|()| buf.freeze())
            }
            Msg::Delivery(m @ Delivery::Live(_)) => codec::encode_frame(m),
            Msg::Record(_) => return None,
        };
        Some(frame.expect("vectors encode").to_vec())
    }

    /// Decodes `bytes` as this message's type and compares with it.
    fn decodes_from(&self, bytes: &'static [u8]) -> Result<bool, codec::CodecError> {
        Ok(match self {
            Msg::Client(m) => codec::decode_body::<ClientMsg>(bytes)? == *m,
            Msg::Server(m) => codec::decode_body::<ServerMsg>(bytes)? == *m,
            Msg::Delivery(m) => codec::decode_body::<Delivery<'static>>(bytes)? == *m,
            Msg::Record(m) => codec::decode_body::<EventRecord>(bytes)? == *m,
        })
    }
}

struct Vector {
    name: &'static str,
    description: &'static str,
    msg: Msg,
}

fn v(name: &'static str, description: &'static str, msg: Msg) -> Vector {
    Vector {
        name,
        description,
        msg,
    }
}

/// Test data lives for the whole test run (delivery entries borrow their records).
fn leak(bytes: Vec<u8>) -> &'static [u8] {
    Box::leak(bytes.into_boxed_slice())
}

const REGION: &str = "orders";

fn s(text: &str) -> String {
    text.to_string()
}

fn record(seq: u64, key: &str, op: EventOp, value: Option<&[u8]>) -> EventRecord {
    EventRecord {
        id: EventId {
            node: s("n1"),
            session: 7,
            seq,
        },
        region: s(REGION),
        key: s(key),
        op,
        value: value.map(<[u8]>::to_vec),
    }
}

fn record_create() -> EventRecord {
    record(1, "k1", EventOp::Create, Some(b"v1"))
}
fn record_update() -> EventRecord {
    record(2, "k1", EventOp::Update, Some(b"v2"))
}
fn record_destroy() -> EventRecord {
    record(3, "k2", EventOp::Destroy, None)
}
fn record_invalidate() -> EventRecord {
    record(4, "k3", EventOp::Invalidate, None)
}

fn entry(offset: u64, flags: u8, rec: &EventRecord) -> WireEntry<'static> {
    WireEntry {
        offset,
        flags,
        record: leak(codec::encode_body_packed(rec).expect("records encode")),
    }
}

fn request(id: u64, body: RequestBody) -> Msg {
    Msg::Client(ClientMsg::Request { id, body })
}

fn register(id: u64, interest: InterestSpec, durable: bool, policy: ResultPolicy) -> Msg {
    request(
        id,
        RequestBody::RegisterInterest {
            region: s(REGION),
            interest,
            durable,
            policy,
            receive_values: policy != ResultPolicy::Keys,
            image_in_parts: false,
        },
    )
}

fn response(id: u64, result: Result<ResponseBody, WireError>) -> Msg {
    Msg::Server(ServerMsg::Response { id, result })
}

fn welcome(session: u64, queue: QueueStatus, pending: Option<u64>) -> ServerMsg {
    ServerMsg::Welcome {
        node_id: s("n1"),
        session,
        queue,
        pending,
        queue_servers: Vec::new(),
        diverged: false,
    }
}

/// Every vector, in file order.
fn vectors() -> Vec<Vector> {
    vec![
        // Control stream, client to server.
        v(
            "hello-durable",
            "First frame of a durable client: protocol version 1, durable id d1 with a 300 s timeout; redundancy 0 and no failed primary, so both fields are absent; no token.",
            Msg::Client(ClientMsg::Hello {
                version: PROTOCOL_VERSION,
                durable: Some(DurableHello {
                    redirect_epoch: None,
                    id: s("d1"),
                    timeout_secs: 300,
                    redundancy: 0,
                    failed_primary: None,
                    seen: None,
                }),
                token: None,
                client: s("app"),
                going_away: false,
            }),
        ),
        v(
            "hello-durable-failover",
            "Hello of a durable client asking for one copy of its queue, failing over from its lost primary n1, with a bearer token.",
            Msg::Client(ClientMsg::Hello {
                version: PROTOCOL_VERSION,
                durable: Some(DurableHello {
                    redirect_epoch: None,
                    id: s("d1"),
                    timeout_secs: 300,
                    redundancy: 1,
                    failed_primary: Some(s("n1")),
                    seen: None,
                }),
                token: Some(s("t0k3n")),
                client: s("app"),
                going_away: false,
            }),
        ),
        v(
            "hello-durable-seen",
            "Hello of a durable client resuming its queue in the same process: the newest entry it received was offset 42, event n1-7-3.",
            Msg::Client(ClientMsg::Hello {
                version: PROTOCOL_VERSION,
                durable: Some(DurableHello {
                    redirect_epoch: None,
                    id: s("d1"),
                    timeout_secs: 300,
                    redundancy: 0,
                    failed_primary: None,
                    seen: Some(SeenEntry {
                        offset: 42,
                        event_id: Some(EventId {
                            node: s("n1"),
                            session: 7,
                            seq: 3,
                        }),
                    }),
                }),
                token: None,
                client: s("app"),
                going_away: false,
            }),
        ),
        v(
            "hello-durable-redirected",
            "Hello of a durable client sent here by a redirect that named placement epoch 12.",
            Msg::Client(ClientMsg::Hello {
                version: PROTOCOL_VERSION,
                durable: Some(DurableHello {
                    redirect_epoch: Some(12),
                    id: s("d1"),
                    timeout_secs: 300,
                    redundancy: 1,
                    failed_primary: None,
                    seen: None,
                }),
                token: None,
                client: s("app"),
                going_away: true,
            }),
        ),
        v(
            "hello-non-durable",
            "Hello of a non-durable client (a publisher, an admin tool): durable is null.",
            Msg::Client(ClientMsg::Hello {
                version: PROTOCOL_VERSION,
                durable: None,
                token: None,
                client: s("pub"),
                going_away: false,
            }),
        ),
        v(
            "request-register-interest-key",
            "Durable interest in one key, initial image with values, events with values.",
            register(
                1,
                InterestSpec::Key(s("k1")),
                true,
                ResultPolicy::KeysValues,
            ),
        ),
        v(
            "request-register-interest-keys",
            "Non-durable interest in a key list, initial image of keys only, events without values (receive_values false).",
            register(
                2,
                InterestSpec::Keys(vec![s("k1"), s("k2")]),
                false,
                ResultPolicy::Keys,
            ),
        ),
        v(
            "request-register-interest-regex",
            "Durable interest in the keys matching a regex (whole-key match), no initial image.",
            register(
                3,
                InterestSpec::Regex(s("k[0-9]+")),
                true,
                ResultPolicy::None,
            ),
        ),
        v(
            "request-register-interest-all-keys",
            "Durable interest in every key of the region: all-keys is a unit variant, a bare text string.",
            register(4, InterestSpec::AllKeys, true, ResultPolicy::KeysValues),
        ),
        v(
            "request-register-interest-image-in-parts",
            "Durable interest in every key, taking the initial image in parts: several registered answers with id 4, each but the last with more set. The field is left out when false.",
            request(
                4,
                RequestBody::RegisterInterest {
                    region: s(REGION),
                    interest: InterestSpec::AllKeys,
                    durable: true,
                    policy: ResultPolicy::KeysValues,
                    receive_values: true,
                    image_in_parts: true,
                },
            ),
        ),
        v(
            "request-unregister-interest",
            "Removes the key interest of request 1.",
            request(
                5,
                RequestBody::UnregisterInterest {
                    region: s(REGION),
                    interest: InterestSpec::Key(s("k1")),
                },
            ),
        ),
        v(
            "request-ready",
            "The client is ready for events: a unit variant, a bare text string.",
            request(6, RequestBody::Ready),
        ),
        v(
            "request-publish",
            "Publishes a put, a destroy and an invalidate, acknowledged once committed on the node (ack local: the field is absent).",
            request(
                7,
                RequestBody::Publish {
                    ops: vec![
                        PublishOp::Put {
                            region: s(REGION),
                            key: s("k1"),
                            value: b"v1".to_vec(),
                        },
                        PublishOp::Destroy {
                            region: s(REGION),
                            key: s("k2"),
                        },
                        PublishOp::Invalidate {
                            region: s(REGION),
                            key: s("k3"),
                        },
                    ],
                    ack: PublishAck::Local,
                },
            ),
        ),
        v(
            "request-publish-replicated",
            "A put acknowledged once every matching queue and its copies hold it.",
            request(
                8,
                RequestBody::Publish {
                    ops: vec![PublishOp::Put {
                        region: s(REGION),
                        key: s("k1"),
                        value: b"v2".to_vec(),
                    }],
                    ack: PublishAck::Replicated,
                },
            ),
        ),
        v(
            "request-get",
            "Reads the current value of one key.",
            request(
                9,
                RequestBody::Get {
                    region: s(REGION),
                    key: s("k1"),
                },
            ),
        ),
        v(
            "request-list-queues",
            "Admin: the node's queues (a unit variant).",
            request(10, RequestBody::ListQueues),
        ),
        v(
            "request-list-queues-page",
            "Admin: the second page of away queues with interest in the region, 20 per page, most pending first, over every member.",
            request(
                12,
                RequestBody::ListQueuesPage(QueuesQuery {
                    limit: Some(20),
                    after: Some(s("pending.desc.40.6431.6e31")),
                    state: Some(s("away")),
                    region: Some(s(REGION)),
                    ..Default::default()
                }),
            ),
        ),
        v(
            "request-close-durable",
            "Admin: destroys the queue of the away durable client d2.",
            request(
                11,
                RequestBody::CloseDurable {
                    durable_id: s("d2"),
                },
            ),
        ),
        v(
            "request-close",
            "Ends the session, keeping the durable queue for its timeout.",
            request(12, RequestBody::Close { keepalive: true }),
        ),
        v(
            "request-replay-rate",
            "Paces this session's replay at 5,000 events per second (0 lifts the limit).",
            request(
                13,
                RequestBody::ReplayRate {
                    events_per_s: 5_000,
                },
            ),
        ),
        v(
            "request-drain",
            "Admin, on a cluster: marks member n1 draining (omit draining to only ask how far its drain is).",
            request(
                14,
                RequestBody::Drain {
                    node_id: s("n1"),
                    draining: Some(true),
                },
            ),
        ),
        v(
            "request-remove-node",
            "Admin, on a cluster: removes member n3 (drained first: it must be the primary of no queue).",
            request(15, RequestBody::RemoveNode { node_id: s("n3") }),
        ),
        v(
            "request-add-node",
            "Admin, on a cluster: adds node n4, started with --join, which peers reach at 10.0.0.4:7400.",
            request(
                16,
                RequestBody::AddNode {
                    node_id: s("n4"),
                    addr: s("10.0.0.4:7400"),
                },
            ),
        ),
        v(
            "ack",
            "Cumulative acknowledgement: every entry up to offset 2 is processed.",
            Msg::Client(ClientMsg::Ack { offset: 2 }),
        ),
        v(
            "pong",
            "Answer to the server's ping with nonce 1.",
            Msg::Client(ClientMsg::Pong { nonce: 1 }),
        ),
        // Control stream, server to client.
        v(
            "welcome-new",
            "First frame of the server for a durable client whose id had no queue: pending is null, no queue servers (single node: the field is absent).",
            Msg::Server(welcome(7, QueueStatus::New, None)),
        ),
        v(
            "welcome-diverged",
            "A resumed queue that lost entries its client received (it ends below the seen offset): 3 entries wait, every one flagged possible_duplicate; the client forgets its processed offsets.",
            Msg::Server(ServerMsg::Welcome {
                node_id: s("n1"),
                session: 9,
                queue: QueueStatus::Resumed,
                pending: Some(3),
                queue_servers: Vec::new(),
                diverged: true,
            }),
        ),
        v(
            "welcome-resumed-cluster",
            "A durable client resumes its queue on a cluster node: 2 entries wait after the acked offset; the queue's primary (this node) and its copy.",
            Msg::Server(ServerMsg::Welcome {
                node_id: s("n1"),
                session: 8,
                queue: QueueStatus::Resumed,
                pending: Some(2),
                queue_servers: vec![
                    QueueServer {
                        node_id: s("n1"),
                        addr: s("127.0.0.1:7501"),
                        primary: true,
                    },
                    QueueServer {
                        node_id: s("n2"),
                        addr: s("127.0.0.1:7502"),
                        primary: false,
                    },
                ],
                diverged: false,
            }),
        ),
        v(
            "welcome-expired",
            "The durable id's queue timed out while the client was away (reported once); a new queue was made.",
            Msg::Server(welcome(9, QueueStatus::Expired, None)),
        ),
        v(
            "welcome-non-durable",
            "Welcome of a non-durable client.",
            Msg::Server(welcome(10, QueueStatus::None, None)),
        ),
        v(
            "response-registered",
            "Answer to a registration: the initial image, a key with a value and an invalidated key (null value). result is serde's Result: a map keyed \"Ok\" or \"Err\".",
            response(
                1,
                Ok(ResponseBody::Registered {
                    initial: vec![
                        InitialEntry {
                            key: s("k1"),
                            value: Some(b"v1".to_vec()),
                        },
                        InitialEntry {
                            key: s("k2"),
                            value: None,
                        },
                    ],
                    more: false,
                }),
            ),
        ),
        v(
            "response-registered-part",
            "One part of an initial image taken in parts (request 4 set image_in_parts): more parts follow with the same id; the last has more false (left out).",
            response(
                4,
                Ok(ResponseBody::Registered {
                    initial: vec![InitialEntry {
                        key: s("k1"),
                        value: Some(b"v1".to_vec()),
                    }],
                    more: true,
                }),
            ),
        ),
        v(
            "response-unregistered",
            "Answer to unregister-interest: the interest was registered and is removed.",
            response(5, Ok(ResponseBody::Unregistered { removed: true })),
        ),
        v(
            "response-ready",
            "Answer to ready: offsets up to 2 are replayed, then the live marker comes.",
            response(6, Ok(ResponseBody::Ready { replay_end: 2 })),
        ),
        v(
            "response-published",
            "Answer to a publish of 3 operations.",
            response(7, Ok(ResponseBody::Published { count: 3 })),
        ),
        v(
            "response-value",
            "Answer to get: the value.",
            response(
                9,
                Ok(ResponseBody::Value {
                    value: Some(b"v1".to_vec()),
                }),
            ),
        ),
        v(
            "response-value-absent",
            "Answer to get of an absent or invalidated key: null.",
            response(9, Ok(ResponseBody::Value { value: None })),
        ),
        v(
            "response-queues",
            "Answer to list-queues: a primary queue with a copy lagging one entry, and a secondary's copy of another queue (pending_bytes absent, primary named).",
            response(
                10,
                Ok(ResponseBody::Queues {
                    queues: vec![
                        QueueReport {
                            durable_id: Some(s("d1")),
                            state: s("ready"),
                            pending: 2,
                            pending_bytes: Some(120),
                            acked_offset: 1,
                            end_offset: 3,
                            timeout_secs: 300,
                            role: s("primary"),
                            interests: vec![InterestInfo {
                                region: s(REGION),
                                kind: s("key"),
                                spec: Some(s("k1")),
                                durable: true,
                            }],
                            copies: vec![CopyLag {
                                node: s("n2"),
                                lag_entries: 1,
                            }],
                            primary: None,
                            ..Default::default()
                        },
                        QueueReport {
                            durable_id: Some(s("d3")),
                            state: s("away"),
                            pending: 0,
                            pending_bytes: None,
                            acked_offset: 5,
                            end_offset: 5,
                            timeout_secs: 60,
                            role: s("secondary"),
                            interests: vec![InterestInfo {
                                region: s(REGION),
                                kind: s("all"),
                                spec: None,
                                durable: true,
                            }],
                            copies: Vec::new(),
                            primary: Some(s("n2")),
                            ..Default::default()
                        },
                    ],
                }),
            ),
        ),
        v(
            "response-queues-page",
            "Answer to list-queues-page: one away durable queue with its lag, and the token of the next page.",
            response(
                12,
                Ok(ResponseBody::QueuesPage(QueuesPage {
                    queues: vec![QueueReport {
                        durable_id: Some(s("d1")),
                        state: s("away"),
                        pending: 40,
                        pending_bytes: Some(5_120),
                        acked_offset: 10,
                        end_offset: 50,
                        timeout_secs: 300,
                        role: s("primary"),
                        interests: vec![InterestInfo {
                            region: s(REGION),
                            kind: s("all"),
                            spec: None,
                            durable: true,
                        }],
                        copies: Vec::new(),
                        primary: None,
                        id: Some(s("d1")),
                        node: Some(s("n1")),
                        oldest_pending_age_ms: Some(61_000),
                        away_since_ms: Some(1_764_000_000_000),
                        expires_at_ms: Some(1_764_000_300_000),
                        enqueue_per_min: Some(150),
                        delivery_per_min: Some(0),
                        ack_per_min: Some(0),
                        drain_eta_secs: None,
                    }],
                    next: Some(s("pending.desc.40.6431.6e31")),
                    total: 7,
                    unreachable: vec![s("n3")],
                })),
            ),
        ),
        v(
            "response-closed-durable",
            "Answer to close-durable.",
            response(
                11,
                Ok(ResponseBody::ClosedDurable {
                    durable_id: s("d2"),
                }),
            ),
        ),
        v(
            "response-closed",
            "Answer to close: the session is over; the client closes the connection.",
            response(12, Ok(ResponseBody::Closed { keepalive: true })),
        ),
        v(
            "response-replay-rate",
            "Answer to replay-rate: the rate now in force.",
            response(
                13,
                Ok(ResponseBody::ReplayRate {
                    events_per_s: 5_000,
                }),
            ),
        ),
        v(
            "response-drain",
            "Answer to drain: n1 is draining and still primary of 3 queues and holder of 1 copy.",
            response(
                14,
                Ok(ResponseBody::Drain(DrainReport {
                    node_id: s("n1"),
                    draining: true,
                    primaries: 3,
                    copies: 1,
                })),
            ),
        ),
        v(
            "response-remove-node",
            "Answer to remove-node: n3 is no longer a member; n1 and n2 are.",
            response(
                15,
                Ok(ResponseBody::NodeRemoved {
                    node_id: s("n3"),
                    members: vec![s("n1"), s("n2")],
                }),
            ),
        ),
        v(
            "response-add-node",
            "Answer to add-node: n4 is a member, with n1, n2 and n3.",
            response(
                16,
                Ok(ResponseBody::NodeAdded {
                    node_id: s("n4"),
                    members: vec![s("n1"), s("n2"), s("n3"), s("n4")],
                }),
            ),
        ),
        v(
            "response-error",
            "A request refused with invalid-argument (code 8): the connection stays open.",
            response(
                3,
                Err(WireError::new(
                    ErrorCode::InvalidArgument,
                    "region name is empty",
                )),
            ),
        ),
        v(
            "ping",
            "Liveness probe; the client answers pong with the same nonce.",
            Msg::Server(ServerMsg::Ping { nonce: 1 }),
        ),
        v(
            "error-unsupported-version",
            "Refusal of a hello with another protocol version (code 6); a QUIC close with the same code follows.",
            Msg::Server(ServerMsg::Error(WireError::new(
                ErrorCode::UnsupportedVersion,
                "unsupported protocol version 2; this server speaks 1",
            ))),
        ),
        v(
            "redirect",
            "Answer to a durable hello on a cluster node that does not hold the queue: connect to node n2 instead.",
            Msg::Server(ServerMsg::Redirect {
                node_id: s("n2"),
                addr: s("127.0.0.1:7502"),
                epoch: None,
            }),
        ),
        v(
            "redirect-epoch",
            "A redirect naming the placement epoch (a metadata log index, 12) it sends the client by: the next hello names it (redirect_epoch).",
            Msg::Server(ServerMsg::Redirect {
                node_id: s("n2"),
                addr: s("127.0.0.1:7502"),
                epoch: Some(12),
            }),
        ),
        // Stored events, as delivery entries carry them.
        v(
            "record-create",
            "A create event (packed EventRecord, op 0): event id n1-7-1, value v1.",
            Msg::Record(record_create()),
        ),
        v(
            "record-update",
            "An update event (op 1) with its value.",
            Msg::Record(record_update()),
        ),
        v(
            "record-destroy",
            "A destroy event (op 2): value null.",
            Msg::Record(record_destroy()),
        ),
        v(
            "record-invalidate",
            "An invalidate event (op 3): value null.",
            Msg::Record(record_invalidate()),
        ),
        // Delivery stream.
        v(
            "delivery-events-replayed",
            "Events frame (packed: entry fields by index; the newtype variant keeps its name, events) of two replayed entries: offset 1 (flags 6: replayed, possible duplicate) holds record-create, offset 2 (flags 3: no value, replayed) holds record-update, which the client reports as an invalidate without value.",
            Msg::Delivery(Delivery::Events(vec![
                entry(1, FLAG_REPLAYED | FLAG_POSSIBLE_DUPLICATE, &record_create()),
                entry(2, FLAG_NO_VALUE | FLAG_REPLAYED, &record_update()),
            ])),
        ),
        v(
            "delivery-live",
            "Live marker: the replay is over for region orders. Sent named, but its packed form is the same bytes (a newtype variant keeps its name, and it has no struct fields).",
            Msg::Delivery(Delivery::Live(vec![s(REGION)])),
        ),
        v(
            "delivery-live-none",
            "First live marker of a session whose queue has no interest: it still ends the replay.",
            Msg::Delivery(Delivery::Live(Vec::new())),
        ),
        v(
            "delivery-events-live",
            "Events frame (packed) of two live entries: offset 3 (flags 0) holds record-destroy, offset 4 (flags 1: no value) holds record-invalidate.",
            Msg::Delivery(Delivery::Events(vec![
                entry(3, 0, &record_destroy()),
                entry(4, FLAG_NO_VALUE, &record_invalidate()),
            ])),
        ),
    ]
}

fn to_hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn from_hex(hex: &str) -> Vec<u8> {
    assert!(hex.len().is_multiple_of(2), "odd hex length");
    (0..hex.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&hex[i..i + 2], 16).expect("hex digits"))
        .collect()
}

/// The readable view of a CBOR body (the `value` of a vector, see `docs/protocol.md`):
/// unsigned integers are numbers, text strings are strings, `null`/`true`/`false` are
/// themselves, arrays are arrays, byte strings are `{"$bytes": "<hex>"}` and maps are objects
/// in their encoded order, an unsigned integer key `n` written `"#n"`. Anything else (negative
/// integers, floats, tags, indefinite lengths, non-shortest heads) is not in the protocol and
/// fails the test.
fn cbor_view(bytes: &[u8]) -> Json {
    let mut pos = 0;
    let v = cbor_item(bytes, &mut pos);
    assert_eq!(pos, bytes.len(), "bytes after the CBOR item");
    v
}

fn cbor_head(b: &[u8], pos: &mut usize) -> (u8, u64) {
    let first = b[*pos];
    *pos += 1;
    let (major, info) = (first >> 5, first & 0x1f);
    let width = match info {
        0..=23 => return (major, u64::from(info)),
        24 => 1,
        25 => 2,
        26 => 4,
        27 => 8,
        _ => panic!("indefinite length or reserved head {first:#04x}"),
    };
    assert!(major != 7, "floats are not in the protocol ({first:#04x})");
    let arg = b[*pos..*pos + width]
        .iter()
        .fold(0u64, |n, &d| (n << 8) | u64::from(d));
    *pos += width;
    let shortest = match width {
        1 => arg >= 24,
        2 => arg > 0xff,
        4 => arg > 0xffff,
        _ => arg > 0xffff_ffff,
    };
    assert!(
        shortest,
        "head {first:#04x} {arg} is not in its shortest form"
    );
    (major, arg)
}

fn cbor_take<'a>(b: &'a [u8], pos: &mut usize, len: u64) -> &'a [u8] {
    let len = usize::try_from(len).expect("length fits");
    let s = &b[*pos..*pos + len];
    *pos += len;
    s
}

fn cbor_item(b: &[u8], pos: &mut usize) -> Json {
    let (major, arg) = cbor_head(b, pos);
    match major {
        0 => json!(arg),
        2 => json!({ "$bytes": to_hex(cbor_take(b, pos, arg)) }),
        3 => json!(std::str::from_utf8(cbor_take(b, pos, arg)).expect("text strings are UTF-8")),
        4 => Json::Array((0..arg).map(|_| cbor_item(b, pos)).collect()),
        5 => {
            let mut map = Map::new();
            for _ in 0..arg {
                let key = match cbor_item(b, pos) {
                    Json::String(k) => {
                        assert!(!k.starts_with(['#', '$']), "ambiguous key {k:?}");
                        k
                    }
                    Json::Number(n) => format!("#{n}"),
                    other => panic!("map key {other} is not a text string or an integer"),
                };
                let value = cbor_item(b, pos);
                assert!(map.insert(key.clone(), value).is_none(), "key {key} twice");
            }
            Json::Object(map)
        }
        7 => match arg {
            20 => json!(false),
            21 => json!(true),
            22 => Json::Null,
            _ => panic!("simple value {arg} is not in the protocol"),
        },
        _ => panic!("CBOR major type {major} is not in the protocol"),
    }
}

/// The vector file's content for these vectors.
fn document(vectors: &[Vector]) -> Json {
    let entries: Vec<Json> = vectors
        .iter()
        .map(|v| {
            let body = v.msg.encode();
            json!({
                "name": v.name,
                "type": v.msg.type_name(),
                "encoding": v.msg.form().as_str(),
                "description": v.description,
                "hex": to_hex(&body),
                "frame_hex": v.msg.frame().map(|f| to_hex(&f)),
                "value": cbor_view(&body),
            })
        })
        .collect();
    json!({
        "description": "Golden vectors of the Tether wire protocol: the exact CBOR body (hex) of each message as the reference implementation encodes it, the frame carrying it (frame_hex: 4-byte big-endian body length, then the body; null for a record, which only travels inside a delivery entry), and a readable view of the body (value). Format and notation: docs/protocol.md, section Golden test vectors. Checked and regenerated by client/tests/golden_vectors.rs.",
        "protocol_version": PROTOCOL_VERSION,
        "alpn": String::from_utf8_lossy(ALPN),
        "vectors": entries,
    })
}

/// The package's directory as cargo names it when it runs this test. The path compiled in
/// (`env!`) may be another checkout's: a target directory shared between checkouts reuses a
/// test binary whose sources did not change.
fn manifest_dir() -> std::path::PathBuf {
    std::env::var_os("CARGO_MANIFEST_DIR")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")))
}

fn file_path() -> std::path::PathBuf {
    manifest_dir().join(VECTORS_FILE)
}

fn writing() -> bool {
    std::env::var(WRITE_ENV).is_ok_and(|v| v == "1")
}

fn read_file() -> Json {
    let text = std::fs::read_to_string(file_path()).expect("the vector file exists");
    serde_json::from_str(&text).expect("the vector file is JSON")
}

const REGENERATE: &str = "if the protocol changed on purpose, regenerate the file with TETHER_WRITE_VECTORS=1 cargo test --release -p tether-client --test golden_vectors (see docs/protocol.md)";

#[test]
fn vectors_match_the_codec_both_ways() {
    let vectors = vectors();
    if writing() {
        let mut text = serde_json::to_string_pretty(&document(&vectors)).expect("JSON");
        text.push('\n');
        let path = file_path();
        std::fs::create_dir_all(path.parent().expect("a directory")).expect("mkdir");
        std::fs::write(&path, text).expect("the vector file is written");
        eprintln!("wrote {} vectors to {}", vectors.len(), path.display());
        return;
    }
    let file = read_file();
    assert_eq!(
        file["protocol_version"],
        json!(PROTOCOL_VERSION),
        "{REGENERATE}"
    );
    assert_eq!(file["alpn"], json!("tether/1"), "{REGENERATE}");
    let entries = file["vectors"].as_array().expect("a vectors array");
    let by_name: BTreeMap<&str, &Json> = entries
        .iter()
        .map(|e| (e["name"].as_str().expect("a name"), e))
        .collect();
    assert_eq!(by_name.len(), entries.len(), "vector names are unique");
    for v in &vectors {
        let name = v.name;
        let e = by_name
            .get(name)
            .unwrap_or_else(|| panic!("vector {name} is missing from the file; {REGENERATE}"));
        assert_eq!(e["type"], json!(v.msg.type_name()), "{name}: type");
        assert_eq!(
            e["encoding"],
            json!(v.msg.form().as_str()),
            "{name}: encoding"
        );
        assert_eq!(
            e["description"],
            json!(v.description),
            "{name}: {REGENERATE}"
        );
        // Rust value -> bytes: the codec writes exactly the file's bytes.
        let hex = e["hex"].as_str().expect("hex");
        let body = v.msg.encode();
        assert_eq!(
            to_hex(&body),
            hex,
            "{name}: encoded bytes differ; {REGENERATE}"
        );
        match (v.msg.frame(), e["frame_hex"].as_str()) {
            (Some(frame), Some(frame_hex)) => {
                assert_eq!(to_hex(&frame), frame_hex, "{name}: frame; {REGENERATE}");
                let len = u32::try_from(body.len()).expect("small").to_be_bytes();
                assert_eq!(frame[..4], len, "{name}: frame header is the body length");
                assert_eq!(frame[4..], body, "{name}: frame body");
            }
            (None, None) => {}
            (frame, file_frame) => panic!("{name}: frame {frame:?} vs file {file_frame:?}"),
        }
        // Bytes -> Rust value: the file's bytes decode to the value.
        let bytes = leak(from_hex(hex));
        match v.msg.decodes_from(bytes) {
            Ok(true) => {}
            Ok(false) => panic!("{name}: the file's bytes decode to another value"),
            Err(err) => panic!("{name}: the file's bytes do not decode: {err}"),
        }
        // The readable view is the view of the bytes.
        assert_eq!(e["value"], cbor_view(bytes), "{name}: value; {REGENERATE}");
    }
    assert_eq!(
        entries.len(),
        vectors.len(),
        "the file has vectors this test does not know; {REGENERATE}"
    );
}

/// The variant names of an enum type, as serde knows them: a text string naming no variant
/// makes its decoder list them all ("unknown variant `x`, expected one of `a`, `b`").
fn serde_variants<T: Deserialize<'static>>() -> BTreeSet<String> {
    let probe = leak(codec::encode_body(&"no-such-variant").expect("encodes"));
    let err = match codec::decode_body::<T>(probe) {
        Ok(_) => panic!("a made-up variant name decoded"),
        Err(e) => e.to_string(),
    };
    let (_, expected) = err
        .split_once("expected ")
        .unwrap_or_else(|| panic!("not an unknown-variant error: {err}"));
    let names: BTreeSet<String> = expected
        .split('`')
        .skip(1)
        .step_by(2)
        .map(str::to_string)
        .collect();
    assert!(!names.is_empty(), "no variant names in {err}");
    names
}

/// The variant name of an enum value, as the named form writes it: a text string (unit
/// variant) or the single key of a map.
fn variant_name<T: Serialize>(value: &T) -> String {
    match cbor_view(&codec::encode_body(value).expect("encodes")) {
        Json::String(name) => name,
        Json::Object(map) if map.len() == 1 => map.keys().next().expect("one key").clone(),
        other => panic!("not an enum value: {other}"),
    }
}

type Coverage = BTreeMap<&'static str, BTreeSet<String>>;

fn note<T: Serialize>(seen: &mut Coverage, type_name: &'static str, value: &T) {
    seen.entry(type_name)
        .or_default()
        .insert(variant_name(value));
}

/// Records the variants of every enum type a message holds.
fn cover(msg: &Msg, seen: &mut Coverage, flags: &mut u8) {
    match msg {
        Msg::Client(m) => {
            note(seen, "ClientMsg", m);
            if let ClientMsg::Request { body, .. } = m {
                note(seen, "RequestBody", body);
                match body {
                    RequestBody::RegisterInterest {
                        interest, policy, ..
                    } => {
                        note(seen, "InterestSpec", interest);
                        note(seen, "ResultPolicy", policy);
                    }
                    RequestBody::UnregisterInterest { interest, .. } => {
                        note(seen, "InterestSpec", interest);
                    }
                    RequestBody::Publish { ops, ack } => {
                        for op in ops {
                            note(seen, "PublishOp", op);
                        }
                        note(seen, "PublishAck", ack);
                    }
                    _ => {}
                }
            }
        }
        Msg::Server(m) => {
            note(seen, "ServerMsg", m);
            match m {
                ServerMsg::Welcome { queue, .. } => note(seen, "QueueStatus", queue),
                ServerMsg::Response { result, .. } => {
                    note(seen, "Result", result);
                    if let Ok(body) = result {
                        note(seen, "ResponseBody", body);
                    }
                }
                _ => {}
            }
        }
        Msg::Delivery(d) => {
            note(seen, "Delivery", d);
            if let Delivery::Events(entries) = d {
                for e in entries {
                    *flags |= e.flags;
                    let rec: EventRecord = codec::decode_body(e.record).expect("records decode");
                    note(seen, "EventOp", &rec.op);
                }
            }
        }
        Msg::Record(r) => note(seen, "EventOp", &r.op),
    }
}

#[test]
fn every_variant_and_flag_has_a_vector() {
    let vectors = vectors();
    let mut seen = Coverage::new();
    let mut flags = 0u8;
    for v in &vectors {
        cover(&v.msg, &mut seen, &mut flags);
    }
    let all: Vec<(&str, BTreeSet<String>)> = vec![
        ("ClientMsg", serde_variants::<ClientMsg>()),
        ("RequestBody", serde_variants::<RequestBody>()),
        ("InterestSpec", serde_variants::<InterestSpec>()),
        ("ResultPolicy", serde_variants::<ResultPolicy>()),
        ("PublishOp", serde_variants::<PublishOp>()),
        ("PublishAck", serde_variants::<PublishAck>()),
        ("ServerMsg", serde_variants::<ServerMsg>()),
        ("QueueStatus", serde_variants::<QueueStatus>()),
        (
            "Result",
            serde_variants::<Result<ResponseBody, WireError>>(),
        ),
        ("ResponseBody", serde_variants::<ResponseBody>()),
        ("Delivery", serde_variants::<Delivery<'static>>()),
        ("EventOp", serde_variants::<EventOp>()),
    ];
    assert_eq!(
        seen.keys().copied().collect::<BTreeSet<_>>(),
        all.iter().map(|(t, _)| *t).collect::<BTreeSet<_>>(),
        "enum types"
    );
    for (type_name, variants) in &all {
        assert_eq!(
            &seen[type_name], variants,
            "{type_name}: the vectors (left) do not cover every variant (right)"
        );
    }
    let all_flags = FLAG_NO_VALUE | FLAG_REPLAYED | FLAG_POSSIBLE_DUPLICATE;
    assert_eq!(flags, all_flags, "every entry flag appears in a vector");
    // Names are unique and the file (unless being written) has exactly these vectors.
    let names: Vec<&str> = vectors.iter().map(|v| v.name).collect();
    let unique: BTreeSet<&str> = names.iter().copied().collect();
    assert_eq!(unique.len(), names.len(), "vector names are unique");
    if !writing() {
        let file = read_file();
        let in_file: Vec<&str> = file["vectors"]
            .as_array()
            .expect("a vectors array")
            .iter()
            .map(|e| e["name"].as_str().expect("a name"))
            .collect();
        assert_eq!(in_file, names, "the file's vectors; {REGENERATE}");
    }
}

#[test]
fn decoders_read_both_forms() {
    // The server writes event frames and records packed and everything else named; the
    // decoder takes either form of any message.
    for v in vectors() {
        let other = match v.msg.form() {
            Form::Named => Form::Packed,
            Form::Packed => Form::Named,
        };
        let bytes = leak(v.msg.encode_as(other));
        if let Msg::Delivery(Delivery::Live(_)) = v.msg {
            assert_eq!(
                bytes,
                &v.msg.encode()[..],
                "a live marker is the same in both forms"
            );
        }
        assert!(
            matches!(v.msg.decodes_from(bytes), Ok(true)),
            "{}: the {} form does not decode",
            v.name,
            other.as_str()
        );
    }
}

/// A later protocol's hello, with a field this one does not know.
#[derive(Serialize)]
#[serde(rename_all = "kebab-case")]
enum LaterClientMsg {
    Hello {
        version: u32,
        durable: Option<DurableHello>,
        client: String,
        priority: u64,
    },
    Subscribe {
        region: String,
    },
}

#[test]
fn unknown_fields_are_ignored_and_unknown_variants_refused() {
    let later = codec::encode_body(&LaterClientMsg::Hello {
        version: 1,
        durable: None,
        client: s("app"),
        priority: 5,
    })
    .expect("encodes");
    assert_eq!(
        codec::decode_body::<ClientMsg>(&later).expect("an unknown field is ignored"),
        ClientMsg::Hello {
            version: 1,
            durable: None,
            token: None,
            client: s("app"),
            going_away: false,
        }
    );
    let subscribe =
        codec::encode_body(&LaterClientMsg::Subscribe { region: s(REGION) }).expect("encodes");
    assert!(codec::decode_body::<ClientMsg>(&subscribe).is_err());
    // An error code this side does not know makes the whole frame undecodable.
    #[derive(Serialize)]
    struct LaterError {
        code: u32,
        message: String,
    }
    #[derive(Serialize)]
    #[serde(rename_all = "kebab-case")]
    enum LaterServerMsg {
        Error(LaterError),
    }
    let code = u32::try_from(ErrorCode::ALL.len()).expect("small");
    let err = codec::encode_body(&LaterServerMsg::Error(LaterError {
        code,
        message: s("new"),
    }))
    .expect("encodes");
    assert!(codec::decode_body::<ServerMsg>(&err).is_err());
    // Unknown flag bits decode (the client tests the bits it knows and ignores the others).
    let entry = codec::encode_body_packed(&Delivery::Events(vec![WireEntry {
        offset: 1,
        flags: 0x80,
        record: &[],
    }]))
    .expect("encodes");
    let decoded: Delivery<'_> = codec::decode_body(&entry).expect("unknown flag bits decode");
    assert!(matches!(decoded, Delivery::Events(e) if e[0].flags == 0x80));
}

#[test]
fn absent_fields() {
    // Fields with a default may be absent (the encoder leaves them out at their default).
    #[derive(Serialize)]
    struct BareDurable {
        id: String,
        timeout_secs: u64,
    }
    #[derive(Serialize)]
    #[serde(rename_all = "kebab-case")]
    enum BareClientMsg {
        Hello {
            version: u32,
            durable: Option<BareDurable>,
            client: String,
        },
    }
    let hello = codec::encode_body(&BareClientMsg::Hello {
        version: 1,
        durable: Some(BareDurable {
            id: s("d1"),
            timeout_secs: 300,
        }),
        client: s("app"),
    })
    .expect("encodes");
    let ClientMsg::Hello { durable, token, .. } =
        codec::decode_body::<ClientMsg>(&hello).expect("decodes")
    else {
        panic!("not a hello")
    };
    let durable = durable.expect("durable");
    assert_eq!((durable.redundancy, durable.failed_primary), (0, None));
    assert_eq!(token, None);
    // A null-able field without a default may be absent too (read as null) when it is a
    // plain option, but not when it is a byte string (`value`): send every such field.
    #[derive(Serialize)]
    #[serde(rename_all = "kebab-case")]
    enum BareServerMsg {
        Welcome {
            node_id: String,
            session: u64,
            queue: QueueStatus,
        },
    }
    let welcome = codec::encode_body(&BareServerMsg::Welcome {
        node_id: s("n1"),
        session: 1,
        queue: QueueStatus::New,
    })
    .expect("encodes");
    assert_eq!(
        codec::decode_body::<ServerMsg>(&welcome).expect("pending may be absent"),
        ServerMsg::Welcome {
            node_id: s("n1"),
            session: 1,
            queue: QueueStatus::New,
            pending: None,
            queue_servers: Vec::new(),
            diverged: false,
        }
    );
    #[derive(Serialize)]
    struct BareEntry {
        key: String,
    }
    let entry = codec::encode_body(&BareEntry { key: s("k1") }).expect("encodes");
    assert!(codec::decode_body::<InitialEntry>(&entry).is_err());
}
