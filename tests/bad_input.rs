//! Bad input from clients: every test attacks one real node (RocksDB in a temp dir, QUIC+TLS on
//! loopback) over a raw quinn connection, and checks that
//! (a) the attacker gets a clear error: the `ServerMsg::Error` frame with the right code and a
//!     message a human understands, then a close whose application code is that code, or an
//!     error *response* on a connection that stays usable; and
//! (b) the server keeps serving: a well-behaved durable client, connected, registered and ready
//!     before the attack, still receives a freshly published event afterwards, a new client can
//!     still connect, and at the end its queue holds exactly what it should (nothing lost, nothing
//!     extra).
//!
//! Not covered on purpose: a connection that never sends its hello (the handshake timeout is
//! `HANDSHAKE_TIMEOUT_MS`, too slow for this suite).

mod common;

/// Mirrors `ERROR_MESSAGE_BYTES_MAX` of the server's connection handler.
const ERROR_MESSAGE_BYTES_MAX: usize = 256;

use std::net::{SocketAddr, UdpSocket};
use std::time::Duration;

use common::*;
use tether::client::{Client, ClientError, EventStream, Interest};
use tether::limits::*;
use tether::protocol::*;
use tether::transport::codec::{self, FRAME_BYTES_MAX, FRAME_HEADER_BYTES, FrameReader};
use tether::transport::{PROTOCOL_VERSION, endpoint, tls};
use tokio::time::timeout;

/// Bound on any single network step of a test.
const STEP: Duration = Duration::from_secs(10);
/// Well below `HANDSHAKE_TIMEOUT_MS`: a refusal slower than this means the server waited for
/// something (e.g. buffered a huge frame) instead of refusing at once.
const PROMPT: Duration = Duration::from_millis(2_500);
/// The region the well-behaved client listens to; attacks publish elsewhere.
const REGION: &str = "watched";
/// The region attackers write to.
const OTHER: &str = "other";
/// Durable id of the well-behaved client.
const WATCHER: &str = "watcher";

const _: () = assert!(PROMPT.as_millis() < HANDSHAKE_TIMEOUT_MS as u128);

// ------------------------------------------------------------------------------ helpers

/// Small deterministic PRNG (xorshift64*), so failures reproduce.
struct Rng(u64);

impl Rng {
    fn new(seed: u64) -> Self {
        Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }
    fn next_u64(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.0 = x;
        x.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n
    }
    fn bytes(&mut self, len: usize) -> Vec<u8> {
        (0..len).map(|_| self.next_u64() as u8).collect()
    }
}

/// A raw client connection: the control stream driven by hand.
struct Raw {
    _ep: quinn::Endpoint,
    conn: quinn::Connection,
    send: quinn::SendStream,
    reader: FrameReader,
}

impl Raw {
    /// Connects and opens the control stream (nothing sent yet).
    async fn open(n: &TestNode) -> Raw {
        let addr = n.node().addr();
        let cfg = tls::client_config(n.node().ca_file()).expect("client tls config");
        let ep = endpoint::client_endpoint(cfg, addr).expect("client endpoint");
        let conn = timeout(STEP, ep.connect(addr, tls::SERVER_NAME).expect("connect"))
            .await
            .expect("QUIC handshake timed out")
            .expect("QUIC handshake");
        let (send, recv) = timeout(STEP, conn.open_bi())
            .await
            .expect("open_bi timed out")
            .expect("open_bi");
        Raw {
            _ep: ep,
            conn,
            send,
            reader: FrameReader::new(recv),
        }
    }

    /// Connects, says hello and reads the welcome.
    async fn hello(n: &TestNode, durable: Option<DurableHello>) -> Raw {
        let mut raw = Raw::open(n).await;
        raw.send(&hello_msg(PROTOCOL_VERSION, durable)).await;
        match raw.next().await {
            Some(ServerMsg::Welcome { .. }) => {}
            other => panic!("expected a welcome, got {other:?}"),
        }
        raw
    }

    async fn send(&mut self, msg: &ClientMsg) {
        timeout(STEP, codec::write_frame(&mut self.send, msg))
            .await
            .expect("write timed out")
            .expect("write frame");
    }

    async fn send_raw(&mut self, bytes: &[u8]) {
        timeout(STEP, self.send.write_all(bytes))
            .await
            .expect("write timed out")
            .expect("write raw bytes");
    }

    /// The next server frame; None at a clean end of stream or a stream error.
    async fn next(&mut self) -> Option<ServerMsg> {
        timeout(STEP, self.reader.next::<ServerMsg>())
            .await
            .expect("no server frame in time")
            .ok()
            .flatten()
    }

    /// Sends a request and waits for its response.
    async fn request(&mut self, id: u64, body: RequestBody) -> Result<ResponseBody, WireError> {
        self.send(&ClientMsg::Request { id, body }).await;
        loop {
            match self.next().await {
                Some(ServerMsg::Response { id: rid, result }) if rid == id => return result,
                Some(ServerMsg::Ping { nonce }) => self.send(&ClientMsg::Pong { nonce }).await,
                other => panic!("expected the response to request {id}, got {other:?}"),
            }
        }
    }

    /// Asserts a request fails with `code` and a message containing `needle`, and that the
    /// connection is still usable afterwards.
    async fn bad_request(&mut self, id: u64, body: RequestBody, code: ErrorCode, needle: &str) {
        let what = format!("{body:?}");
        let what = &what[..what.len().min(200)];
        match self.request(id, body).await {
            Err(e) => {
                assert_eq!(e.code, code, "wrong code for {what}: {e:?}");
                assert!(
                    e.message.contains(needle),
                    "message for {what} should mention {needle:?}: {:?}",
                    e.message
                );
            }
            Ok(r) => panic!("{what} should have failed with {code}, got {r:?}"),
        }
        self.assert_usable(id + 1_000_000).await;
    }

    /// A harmless request still gets its answer.
    async fn assert_usable(&mut self, id: u64) {
        match self.request(id, RequestBody::ListQueues).await {
            Ok(ResponseBody::Queues { .. }) => {}
            other => panic!("connection no longer usable: {other:?}"),
        }
        assert!(self.conn.close_reason().is_none(), "connection was closed");
    }

    /// Expects the refusal protocol: an error frame with `code` (after an optional welcome),
    /// then the connection closed with the same application code and the message as reason.
    /// Both must come within [`PROMPT`]. Returns the message.
    async fn expect_refusal(mut self, code: ErrorCode) -> String {
        let err = loop {
            let msg = timeout(PROMPT, self.reader.next::<ServerMsg>())
                .await
                .unwrap_or_else(|_| panic!("no {code} error frame within {PROMPT:?}"));
            match msg {
                Ok(Some(ServerMsg::Welcome { .. })) => continue,
                Ok(Some(ServerMsg::Error(e))) => break e,
                other => panic!(
                    "expected a {code} error frame, got {other:?} (close reason {:?})",
                    self.conn.close_reason()
                ),
            }
        };
        assert_eq!(err.code, code, "error frame: {err:?}");
        // A clear message, never an echo of the client's payload: short and printable.
        assert!(
            err.message.len() >= 10,
            "unclear message: {:?}",
            err.message
        );
        assert!(
            err.message.len() <= ERROR_MESSAGE_BYTES_MAX,
            "message of {} bytes",
            err.message.len()
        );
        assert!(
            !err.message
                .chars()
                .any(|c| c.is_control() || c == char::REPLACEMENT_CHARACTER),
            "unprintable message: {:?}",
            err.message
        );
        let reason = timeout(PROMPT, self.conn.closed())
            .await
            .unwrap_or_else(|_| panic!("connection not closed within {PROMPT:?} after {err:?}"));
        match reason {
            quinn::ConnectionError::ApplicationClosed(c) => {
                assert_eq!(c.error_code, code.varint(), "close code: {c:?}");
                // quinn cuts a close reason to fit one packet, so a long message arrives as
                // a prefix.
                assert!(
                    !c.reason.is_empty() && err.message.as_bytes().starts_with(&c.reason),
                    "close reason {:?} vs message {:?}",
                    String::from_utf8_lossy(&c.reason),
                    err.message
                );
                assert_eq!(c.reason.len(), err.message.len(), "close reason cut short");
            }
            other => panic!("expected an application close with {code}, got {other:?}"),
        }
        err.message
    }
}

impl Raw {}

fn hello_msg(version: u32, durable: Option<DurableHello>) -> ClientMsg {
    ClientMsg::Hello {
        version,
        durable,
        token: None,
        client: "bad-input-test".into(),
        going_away: false,
    }
}

fn durable_hello(id: &str, timeout_secs: u64) -> Option<DurableHello> {
    Some(DurableHello {
        redirect_epoch: None,
        id: id.into(),
        timeout_secs,
        redundancy: 0,
        failed_primary: None,
        seen: None,
    })
}

/// A frame with an arbitrary body.
fn frame(body: &[u8]) -> Vec<u8> {
    let mut f = (body.len() as u32).to_be_bytes().to_vec();
    f.extend_from_slice(body);
    f
}

fn encoded(msg: &ClientMsg) -> Vec<u8> {
    codec::encode_frame(msg).expect("encodes").to_vec()
}

fn register(region: &str, interest: InterestSpec, durable: bool) -> RequestBody {
    RequestBody::RegisterInterest {
        region: region.into(),
        interest,
        durable,
        policy: ResultPolicy::KeysValues,
        receive_values: true,
        image_in_parts: false,
    }
}

fn put(region: &str, key: &str, value: &[u8]) -> PublishOp {
    PublishOp::Put {
        region: region.into(),
        key: key.into(),
        value: value.to_vec(),
    }
}

fn publish(ops: Vec<PublishOp>) -> RequestBody {
    RequestBody::Publish {
        ops,
        ack: Default::default(),
    }
}

/// The well-behaved durable client: connected, registered for all keys of [`REGION`] and ready
/// before any attack.
struct Watcher {
    client: Client,
    events: EventStream,
    /// Keys it received, in order.
    seen: Vec<String>,
}

impl Watcher {
    async fn start(n: &TestNode) -> Watcher {
        let client = timeout(STEP, n.durable(WATCHER, 300))
            .await
            .expect("watcher connect timed out");
        timeout(STEP, client.region(REGION).register(Interest::all_keys()))
            .await
            .expect("register timed out")
            .expect("register");
        let mut events = client.events().expect("event stream");
        timeout(STEP, client.ready_for_events())
            .await
            .expect("ready timed out")
            .expect("ready");
        until_live(&mut events, REGION).await;
        Watcher {
            client,
            events,
            seen: Vec::new(),
        }
    }

    /// After an attack: a fresh event reaches the watcher, and a new client can connect.
    async fn still_served(&mut self, n: &TestNode, label: &str) {
        timeout(STEP, n.put(REGION, label, label))
            .await
            .expect("publish after the attack timed out");
        let evs = take_events(&mut self.events, 1).await;
        assert_eq!(keys(&evs), [label], "watcher after {label}");
        assert_eq!(value(entries(&evs)[0]).as_deref(), Some(label));
        self.seen.push(label.to_string());
        let fresh = timeout(STEP, n.builder().name("fresh").connect())
            .await
            .unwrap_or_else(|_| panic!("new client timed out after {label}"))
            .unwrap_or_else(|e| panic!("new client refused after {label}: {e}"));
        timeout(STEP, fresh.close(false))
            .await
            .expect("close timed out")
            .expect("close");
    }

    /// Nothing extra arrived, everything is acked, and the queue holds exactly what was
    /// published to it.
    async fn finish(mut self, n: &TestNode) {
        let extra = drain_quiet(&mut self.events).await;
        assert!(entries(&extra).is_empty(), "unexpected events: {extra:?}");
        self.events.commit();
        timeout(STEP, self.client.ack_now())
            .await
            .expect("ack timed out")
            .expect("ack");
        let want = self.seen.len() as u64;
        eventually("watcher queue fully acked", || {
            n.queue(WATCHER).is_some_and(|q| q.acked_offset == want)
        })
        .await;
        let q = n.queue(WATCHER).expect("watcher queue");
        assert_eq!(q.pending, 0, "{q:?}");
        assert_eq!(q.end_offset, want, "{q:?}");
        assert_eq!(q.state, "ready", "{q:?}");
        assert_eq!(q.interests.len(), 1, "{q:?}");
        timeout(STEP, self.client.close(false))
            .await
            .expect("close timed out")
            .expect("close");
    }
}

// ------------------------------------------------------------------------------ framing

#[tokio::test]
async fn malformed_cbor_body() {
    let n = TestNode::start().await;
    let mut w = Watcher::start(&n).await;

    // Before the hello: not CBOR at all, and CBOR of the wrong shape.
    for (i, body) in [
        vec![0xff, 0x00, 0x13, 0x37],
        codec::encode_body(&"hello").unwrap(),
        codec::encode_body(&(1u8, 2u8, 3u8)).unwrap(),
        // a hello with trailing garbage
        {
            let mut b = codec::encode_body(&hello_msg(PROTOCOL_VERSION, None)).unwrap();
            b.push(0x00);
            b
        },
        Vec::new(),
    ]
    .into_iter()
    .enumerate()
    {
        let mut raw = Raw::open(&n).await;
        raw.send_raw(&frame(&body)).await;
        let msg = raw.expect_refusal(ErrorCode::MalformedFrame).await;
        assert!(msg.starts_with("malformed frame"), "{msg}");
        w.still_served(&n, &format!("after-malformed-pre-{i}"))
            .await;
    }

    // After the hello, from a durable client: the session ends with the same refusal.
    let mut raw = Raw::hello(&n, durable_hello("bad-cbor", 60)).await;
    raw.send_raw(&frame(&[0x9f, 0xff, 0xff, 0xff])).await;
    let msg = raw.expect_refusal(ErrorCode::MalformedFrame).await;
    assert!(msg.starts_with("malformed frame"), "{msg}");
    w.still_served(&n, "after-malformed-post").await;

    w.finish(&n).await;
}

#[tokio::test]
async fn oversize_frame_header_is_refused_at_once() {
    let n = TestNode::start().await;
    let mut w = Watcher::start(&n).await;
    let too_big = (FRAME_BYTES_MAX + 1) as u32;

    // Only the header, stream left open: the server must not wait for bytes that never come.
    // A first frame (the hello, read before authentication) has a limit of its own.
    let hello_too_big = (HELLO_BYTES_MAX + 1) as u32;
    for (i, size) in [hello_too_big, too_big, u32::MAX].into_iter().enumerate() {
        let mut raw = Raw::open(&n).await;
        raw.send_raw(&size.to_be_bytes()).await;
        let msg = raw.expect_refusal(ErrorCode::FrameTooLarge).await;
        assert_eq!(
            msg,
            format!("frame of {size} bytes exceeds the limit of {HELLO_BYTES_MAX} bytes")
        );
        w.still_served(&n, &format!("after-huge-header-{i}")).await;
    }
    // After the hello, frames up to the frame limit are read.
    let mut raw = Raw::hello(&n, None).await;
    raw.send_raw(&too_big.to_be_bytes()).await;
    let msg = raw.expect_refusal(ErrorCode::FrameTooLarge).await;
    assert_eq!(
        msg,
        format!("frame of {too_big} bytes exceeds the limit of {FRAME_BYTES_MAX} bytes")
    );

    // Header plus the start of a body, after a hello.
    let mut raw = Raw::hello(&n, None).await;
    let mut bytes = too_big.to_be_bytes().to_vec();
    bytes.extend(std::iter::repeat_n(0x41, 64 * 1024));
    raw.send_raw(&bytes).await;
    let msg = raw.expect_refusal(ErrorCode::FrameTooLarge).await;
    assert!(msg.contains(&too_big.to_string()), "{msg}");
    w.still_served(&n, "after-huge-header-post").await;

    // A frame of exactly FRAME_BYTES_MAX is not refused for its size (only for its content).
    let mut raw = Raw::hello(&n, None).await;
    let mut bytes = (FRAME_BYTES_MAX as u32).to_be_bytes().to_vec();
    bytes.resize(FRAME_HEADER_BYTES + FRAME_BYTES_MAX, 0xff);
    raw.send_raw(&bytes).await;
    let msg = raw.expect_refusal(ErrorCode::MalformedFrame).await;
    assert!(msg.starts_with("malformed frame"), "{msg}");
    w.still_served(&n, "after-max-frame").await;

    w.finish(&n).await;
}

#[tokio::test]
async fn truncated_frame_then_finish() {
    let n = TestNode::start().await;
    let mut w = Watcher::start(&n).await;

    let hello = encoded(&hello_msg(PROTOCOL_VERSION, None));
    // (bytes sent, expected message): half a header; a header promising more than follows.
    let cases: Vec<(Vec<u8>, String)> = vec![
        (
            vec![0, 0],
            "stream ended inside a frame (2 of 4 bytes)".into(),
        ),
        (
            hello[..hello.len() - 3].to_vec(),
            format!(
                "stream ended inside a frame ({} of {} bytes)",
                hello.len() - 3,
                hello.len()
            ),
        ),
    ];
    for (i, (bytes, want)) in cases.into_iter().enumerate() {
        let mut raw = Raw::open(&n).await;
        raw.send_raw(&bytes).await;
        raw.send.finish().expect("finish");
        let msg = raw.expect_refusal(ErrorCode::MalformedFrame).await;
        assert_eq!(msg, want);
        w.still_served(&n, &format!("after-truncated-pre-{i}"))
            .await;
    }

    // After the hello.
    let mut raw = Raw::hello(&n, durable_hello("truncated", 60)).await;
    let ready = encoded(&ClientMsg::Request {
        id: 1,
        body: RequestBody::Ready,
    });
    raw.send_raw(&ready[..ready.len() - 1]).await;
    raw.send.finish().expect("finish");
    let msg = raw.expect_refusal(ErrorCode::MalformedFrame).await;
    assert!(msg.starts_with("stream ended inside a frame"), "{msg}");
    w.still_served(&n, "after-truncated-post").await;

    w.finish(&n).await;
}

// ------------------------------------------------------------------------------ handshake

#[tokio::test]
async fn first_frame_not_a_hello() {
    let n = TestNode::start().await;
    let mut w = Watcher::start(&n).await;
    let firsts = [
        ClientMsg::Request {
            id: 1,
            body: RequestBody::Ready,
        },
        ClientMsg::Request {
            id: 1,
            body: publish(vec![put(REGION, "sneaky", b"x")]),
        },
        ClientMsg::Ack { offset: 0 },
        ClientMsg::Pong { nonce: 7 },
    ];
    for (i, first) in firsts.iter().enumerate() {
        let mut raw = Raw::open(&n).await;
        raw.send(first).await;
        let msg = raw.expect_refusal(ErrorCode::ProtocolViolation).await;
        assert_eq!(msg, "the first frame must be a hello");
        w.still_served(&n, &format!("after-not-hello-{i}")).await;
    }
    // The publish sent instead of a hello was not applied.
    assert_eq!(n.node().get(REGION, "sneaky").unwrap(), None);
    w.finish(&n).await;
}

#[tokio::test]
async fn unsupported_protocol_version() {
    let n = TestNode::start().await;
    let mut w = Watcher::start(&n).await;
    for version in [0, PROTOCOL_VERSION + 1, u32::MAX] {
        let mut raw = Raw::open(&n).await;
        raw.send(&hello_msg(version, durable_hello("future", 60)))
            .await;
        let msg = raw.expect_refusal(ErrorCode::UnsupportedVersion).await;
        assert_eq!(
            msg,
            format!(
                "unsupported protocol version {version}; this server speaks {PROTOCOL_VERSION}"
            )
        );
        w.still_served(&n, &format!("after-version-{version}"))
            .await;
    }
    // A refused hello creates no queue.
    assert!(n.queue("future").is_none());
    w.finish(&n).await;
}

#[tokio::test]
async fn hello_sent_twice() {
    let n = TestNode::start().await;
    let mut w = Watcher::start(&n).await;

    let mut raw = Raw::hello(&n, None).await;
    raw.send(&hello_msg(PROTOCOL_VERSION, None)).await;
    let msg = raw.expect_refusal(ErrorCode::ProtocolViolation).await;
    assert_eq!(msg, "hello sent twice");
    w.still_served(&n, "after-hello-twice").await;

    // Both hellos in one write, durable.
    let mut raw = Raw::open(&n).await;
    let mut bytes = encoded(&hello_msg(PROTOCOL_VERSION, durable_hello("twice", 60)));
    bytes.extend(encoded(&hello_msg(
        PROTOCOL_VERSION,
        durable_hello("twice", 60),
    )));
    raw.send_raw(&bytes).await;
    let msg = raw.expect_refusal(ErrorCode::ProtocolViolation).await;
    assert_eq!(msg, "hello sent twice");
    w.still_served(&n, "after-hello-twice-durable").await;

    // A durable hello naming the watcher's id while it is connected: the watcher answers the
    // liveness probe, so the newcomer is refused and the watcher is untouched.
    let mut raw = Raw::open(&n).await;
    raw.send(&hello_msg(PROTOCOL_VERSION, durable_hello(WATCHER, 60)))
        .await;
    let msg = raw.expect_refusal(ErrorCode::DuplicateDurableId).await;
    assert!(msg.contains(WATCHER), "{msg}");
    w.still_served(&n, "after-duplicate-id").await;

    w.finish(&n).await;
}

#[tokio::test]
async fn durable_hello_with_bad_values() {
    let n = TestNode::start().await;
    let mut w = Watcher::start(&n).await;
    let long_id = "d".repeat(DURABLE_ID_BYTES_MAX + 1);
    let cases = [
        (
            String::new(),
            60,
            format!("durable id must be 1 to {DURABLE_ID_BYTES_MAX} bytes"),
        ),
        (
            long_id.clone(),
            60,
            format!("durable id must be 1 to {DURABLE_ID_BYTES_MAX} bytes"),
        ),
        (
            "slow".to_string(),
            DURABLE_TIMEOUT_SECS_MAX + 1,
            format!(
                "durable timeout {} s exceeds the limit of {DURABLE_TIMEOUT_SECS_MAX} s",
                DURABLE_TIMEOUT_SECS_MAX + 1
            ),
        ),
        (
            "slower".to_string(),
            u64::MAX,
            format!(
                "durable timeout {} s exceeds the limit of {DURABLE_TIMEOUT_SECS_MAX} s",
                u64::MAX
            ),
        ),
    ];
    for (i, (id, secs, want)) in cases.into_iter().enumerate() {
        let mut raw = Raw::open(&n).await;
        raw.send(&hello_msg(PROTOCOL_VERSION, durable_hello(&id, secs)))
            .await;
        let msg = raw.expect_refusal(ErrorCode::InvalidArgument).await;
        assert_eq!(msg, want);
        w.still_served(&n, &format!("after-bad-durable-{i}")).await;
    }
    // Refused hellos leave no queue behind.
    let ids: Vec<_> = n
        .node()
        .queues()
        .into_iter()
        .filter_map(|q| q.durable_id)
        .collect();
    assert_eq!(ids, [WATCHER]);

    // The limits themselves are accepted: a multi-byte id of exactly the limit, the maximal
    // timeout.
    let id = "é".repeat(DURABLE_ID_BYTES_MAX / 2);
    assert_eq!(id.len(), DURABLE_ID_BYTES_MAX);
    let mut raw = Raw::hello(&n, durable_hello(&id, DURABLE_TIMEOUT_SECS_MAX)).await;
    raw.assert_usable(1).await;
    let q = n.queue(&id).expect("queue of the longest id");
    assert_eq!(q.timeout_secs, DURABLE_TIMEOUT_SECS_MAX);

    w.finish(&n).await;
}

// ------------------------------------------------------------------------------ acks

#[tokio::test]
async fn ack_beyond_delivered_offset() {
    let n = TestNode::start().await;
    let mut w = Watcher::start(&n).await;

    // Nothing delivered yet (not even ready).
    for (i, offset) in [1, u64::MAX].into_iter().enumerate() {
        let mut raw = Raw::hello(&n, None).await;
        raw.send(&ClientMsg::Ack { offset }).await;
        let msg = raw.expect_refusal(ErrorCode::ProtocolViolation).await;
        assert_eq!(
            msg,
            format!("ack of offset {offset} beyond the last delivered offset 0")
        );
        w.still_served(&n, &format!("after-early-ack-{i}")).await;
    }

    // A durable client that received one event acks two.
    let mut raw = Raw::hello(&n, durable_hello("acker", 300)).await;
    raw.request(1, register(OTHER, InterestSpec::AllKeys, true))
        .await
        .expect("register");
    raw.request(2, RequestBody::Ready).await.expect("ready");
    let delivery = timeout(STEP, raw.conn.accept_uni())
        .await
        .expect("no delivery stream")
        .expect("delivery stream");
    let mut delivery = FrameReader::new(delivery);
    timeout(STEP, n.put(OTHER, "k1", "v1"))
        .await
        .expect("put timed out");
    // Offsets of the delivered entries.
    let mut got: Vec<u64> = Vec::new();
    while got.is_empty() {
        let body = timeout(STEP, delivery.next_raw())
            .await
            .expect("no delivery")
            .expect("delivery stream")
            .expect("delivery stream ended");
        match codec::decode_body::<Delivery>(&body).expect("delivery frame") {
            Delivery::Events(es) => got.extend(es.iter().map(|e| e.offset)),
            Delivery::Live(_) => {}
        }
    }
    assert_eq!(got, [1]);
    // Acking what was delivered is fine (and idempotent).
    raw.send(&ClientMsg::Ack { offset: 1 }).await;
    raw.send(&ClientMsg::Ack { offset: 0 }).await;
    raw.send(&ClientMsg::Ack { offset: 1 }).await;
    raw.assert_usable(3).await;
    eventually("acker acked 1", || {
        n.queue("acker").is_some_and(|q| q.acked_offset == 1)
    })
    .await;
    // One more than delivered is a violation.
    raw.send(&ClientMsg::Ack { offset: 2 }).await;
    let msg = raw.expect_refusal(ErrorCode::ProtocolViolation).await;
    assert_eq!(msg, "ack of offset 2 beyond the last delivered offset 1");
    // The bogus ack moved nothing: the queue kept its acked offset.
    eventually("acker queue away", || {
        n.queue("acker").is_some_and(|q| q.state == "away")
    })
    .await;
    let q = n.queue("acker").unwrap();
    assert_eq!(
        (q.acked_offset, q.end_offset, q.pending),
        (1, 1, 0),
        "{q:?}"
    );
    w.still_served(&n, "after-ack-beyond").await;

    w.finish(&n).await;
}

// ------------------------------------------------------------------------------ close

/// A durable client whose close (keepalive) was answered but that keeps its connection open
/// (a slow or careless client; or the close of a process that exits at once, lost on the way)
/// holds nothing: by the answer the server has ended the session, so the queue is away and the
/// same durable id reconnects at once and resumes it, with the event published in between.
#[tokio::test]
async fn a_closed_session_left_open_holds_nothing() {
    let n = TestNode::start().await;
    let mut raw = Raw::hello(&n, durable_hello("lingerer", 300)).await;
    raw.request(1, register(OTHER, InterestSpec::AllKeys, true))
        .await
        .expect("register");
    raw.request(2, RequestBody::Ready).await.expect("ready");
    match raw.request(3, RequestBody::Close { keepalive: true }).await {
        Ok(ResponseBody::Closed { keepalive: true }) => {}
        other => panic!("expected the close's answer, got {other:?}"),
    }
    let q = n.queue("lingerer").expect("queue kept");
    assert_eq!(q.state, "away", "{q:?}");
    n.put(OTHER, "k1", "v1").await;
    let c = timeout(STEP, n.builder().durable("lingerer", 300).connect())
        .await
        .expect("reconnect timed out")
        .expect("the same durable id reconnects while the old connection is open");
    assert_eq!(c.queue_status(), QueueStatus::Resumed);
    assert_eq!(c.pending(), Some(1));
    let mut events = c.events().unwrap();
    c.ready_for_events().await.unwrap();
    assert_eq!(keys(&until_live(&mut events, OTHER).await), ["k1"]);
    // The old connection, answered, is closed by the server in time.
    timeout(PROMPT * 2, raw.conn.closed())
        .await
        .expect("old connection still open");
}

// ------------------------------------------------------------------------------ pipelining

/// Publishes sent back to back without waiting for their answers (more than
/// `PUBLISHES_IN_FLIGHT_MAX` of them, some refused) are each answered, in request order, with
/// their own result; a `get` sent behind them sees the last one's value, and a subscriber gets
/// every accepted put in request order.
#[tokio::test]
async fn pipelined_publishes_are_answered_in_order() {
    let n = TestNode::start().await;
    let mut w = Watcher::start(&n).await;
    let sub = n.plain().await;
    sub.region(OTHER)
        .register(Interest::all_keys())
        .await
        .expect("register");
    let mut sub_events = sub.events().expect("events");
    let mut raw = Raw::hello(&n, None).await;
    let sent = PUBLISHES_IN_FLIGHT_MAX as u64 + 20;
    // Every seventh request is refused (an empty region); the rest put `k` = their id.
    let bad = |id: u64| id.is_multiple_of(7);
    for id in 1..=sent {
        let region = if bad(id) { "" } else { OTHER };
        let op = put(region, "k", id.to_string().as_bytes());
        raw.send(&ClientMsg::Request {
            id,
            body: publish(vec![op]),
        })
        .await;
    }
    let get = RequestBody::Get {
        region: OTHER.into(),
        key: "k".into(),
    };
    raw.send(&ClientMsg::Request {
        id: sent + 1,
        body: get,
    })
    .await;
    for expected in 1..=sent + 1 {
        let (id, result) = loop {
            match raw.next().await {
                Some(ServerMsg::Response { id, result }) => break (id, result),
                Some(ServerMsg::Ping { nonce }) => raw.send(&ClientMsg::Pong { nonce }).await,
                other => panic!("expected response {expected}, got {other:?}"),
            }
        };
        assert_eq!(id, expected, "answers out of request order");
        match result {
            Ok(ResponseBody::Published { count: 1 }) if id <= sent && !bad(id) => {}
            Err(e) if id <= sent && bad(id) => assert_eq!(e.code, ErrorCode::InvalidArgument),
            Ok(ResponseBody::Value { value }) if id == sent + 1 => {
                let last = (1..=sent).rev().find(|i| !bad(*i)).unwrap();
                assert_eq!(value, Some(last.to_string().into_bytes()));
            }
            other => panic!("request {id}: unexpected {other:?}"),
        }
    }
    raw.assert_usable(sent + 2).await;
    let accepted: Vec<String> = (1..=sent)
        .filter(|i| !bad(*i))
        .map(|i| i.to_string())
        .collect();
    let got = take_events(&mut sub_events, accepted.len()).await;
    let values: Vec<String> = entries(&got).iter().filter_map(|e| value(e)).collect();
    assert_eq!(values, accepted, "puts delivered out of request order");
    sub.close(false).await.ok();
    w.still_served(&n, "after-pipelined-publishes").await;
    w.finish(&n).await;
}

/// An initial image larger than a frame (issue 22 point 6; it used to drop the connection
/// with an empty close reason). A client taking the image in parts (the library) gets all of
/// it, in key order with its values, then live events. A client that does not (a raw
/// registration without `image_in_parts`) gets `limit-exceeded` before anything is registered,
/// on a connection that stays usable, and a small image still comes in one answer.
#[tokio::test]
async fn an_initial_image_larger_than_a_frame_comes_in_parts() {
    const KEYS: usize = 40_000;
    const VALUE_BYTES: usize = 300;
    let n = TestNode::start().await;
    let mut w = Watcher::start(&n).await;
    let value = |i: usize| {
        let mut v = format!("{i:06}").into_bytes();
        v.resize(VALUE_BYTES, b'.');
        v
    };
    let key = |i: usize| format!("k{i:06}");
    let publisher = n.plain().await;
    for chunk in (0..KEYS).collect::<Vec<_>>().chunks(2_000) {
        let ops = chunk
            .iter()
            .map(|&i| put(OTHER, &key(i), &value(i)))
            .collect();
        timeout(STEP, publisher.publish(ops))
            .await
            .expect("publish timed out")
            .expect("publish");
    }
    assert!(KEYS * (key(0).len() + VALUE_BYTES) > FRAME_BYTES_MAX);

    let sub = n.plain().await;
    let image = timeout(STEP, sub.region(OTHER).register(Interest::all_keys()))
        .await
        .expect("register timed out")
        .expect("register");
    assert_eq!(image.len(), KEYS);
    for (i, e) in image.iter().enumerate() {
        assert_eq!(e.key, key(i), "image out of key order");
        assert_eq!(
            e.value.as_deref(),
            Some(&value(i)[..]),
            "value of {}",
            e.key
        );
    }
    // The same through a regex, keys only (one part) and with values (parts).
    let odd = timeout(
        STEP,
        sub.region(OTHER)
            .register(Interest::regex("k[0-9]{5}[13579]").policy(ResultPolicy::KeysValues)),
    )
    .await
    .expect("register timed out")
    .expect("register regex");
    assert_eq!(odd.len(), KEYS / 2);
    assert!(
        odd.iter()
            .all(|e| e.value.as_ref().is_some_and(|v| v.len() == VALUE_BYTES))
    );
    let mut events = sub.events().expect("events");
    timeout(STEP, publisher.publish(vec![put(OTHER, "after", b"live")]))
        .await
        .expect("publish timed out")
        .expect("publish");
    let got = take_events(&mut events, 1).await;
    assert_eq!(keys(&got), ["after"]);

    // Without image_in_parts: refused, nothing registered.
    let in_other = |r: &Result<ResponseBody, WireError>| match r {
        Ok(ResponseBody::Queues { queues }) => queues
            .iter()
            .filter(|q| q.interests.iter().any(|i| i.region == OTHER))
            .count(),
        other => panic!("expected the queue listing, got {other:?}"),
    };
    let mut raw = Raw::hello(&n, None).await;
    raw.bad_request(
        1,
        register(OTHER, InterestSpec::AllKeys, false),
        ErrorCode::LimitExceeded,
        "exceeds one answer",
    )
    .await;
    assert_eq!(in_other(&raw.request(2, RequestBody::ListQueues).await), 1);
    // A small image still comes whole in one answer.
    let one = raw
        .request(3, register(OTHER, InterestSpec::Key(key(7)), false))
        .await;
    match one {
        Ok(ResponseBody::Registered {
            initial,
            more: false,
        }) => {
            assert_eq!(initial.len(), 1);
            assert_eq!(initial[0].value.as_deref(), Some(&value(7)[..]));
        }
        other => panic!("expected a one-part image, got {other:?}"),
    }
    assert_eq!(in_other(&raw.request(4, RequestBody::ListQueues).await), 2);
    sub.close(false).await.ok();
    publisher.close(false).await.ok();
    w.still_served(&n, "after-large-image").await;
    w.finish(&n).await;
}

/// A publish taken just before the connection breaks (a malformed frame right behind it, in
/// the same write) still finishes: committed and answered before the refusal, and the client
/// whose queue it dropped for being full (drop-queue policy) is told and disconnected, as if
/// the publisher had stayed.
#[tokio::test]
async fn a_publish_in_flight_when_the_connection_breaks_still_finishes() {
    let n = TestNode::start_with(tether::config::Limits {
        queue_entries_max: 1,
        queue_full_policy: tether::config::QueueFullPolicy::DropQueue,
        ..tether::config::Limits::default()
    })
    .await;
    let y = n.durable("Y", 600).await;
    y.region(OTHER)
        .register(Interest::all_keys())
        .await
        .expect("register");
    timeout(STEP, n.put(OTHER, "k0", "v0")).await.expect("put");
    let mut raw = Raw::hello(&n, None).await;
    let mut bytes = encoded(&ClientMsg::Request {
        id: 1,
        body: publish(vec![put(OTHER, "k1", b"v1")]),
    });
    bytes.extend(frame(&[0xff, 0x00, 0x13, 0x37]));
    raw.send_raw(&bytes).await;
    // The client learns the fate of every request read before the bad frame, then the error.
    match raw.next().await {
        Some(ServerMsg::Response {
            id: 1,
            result: Ok(ResponseBody::Published { count: 1 }),
        }) => {}
        other => panic!("expected the publish's answer before the refusal, got {other:?}"),
    }
    raw.expect_refusal(ErrorCode::MalformedFrame).await;
    assert_eq!(
        n.node().get(OTHER, "k1").unwrap().as_deref(),
        Some(&b"v1"[..]),
        "the publish taken before the bad frame is committed"
    );
    match timeout(STEP, y.queues()).await.expect("Y answered") {
        Err(ClientError::Server(e)) => assert_eq!(e.code, ErrorCode::QueueFull, "{e:?}"),
        other => panic!("Y should have been disconnected with queue-full: {other:?}"),
    }
}

// ------------------------------------------------------------------------------ requests

#[tokio::test]
async fn requests_with_bad_values_get_error_responses() {
    let n = TestNode::start().await;
    let mut w = Watcher::start(&n).await;
    let mut raw = Raw::hello(&n, durable_hello("requester", 300)).await;
    let big_key = "k".repeat(KEY_BYTES_MAX + 1);
    let big_region = "r".repeat(REGION_NAME_BYTES_MAX + 1);
    let invalid = ErrorCode::InvalidArgument;
    let limit = ErrorCode::LimitExceeded;

    let cases: Vec<(RequestBody, ErrorCode, String)> = vec![
        // regexes
        (
            register(OTHER, InterestSpec::Regex("(".into()), true),
            invalid,
            "invalid regex \"(\"".into(),
        ),
        (
            register(
                OTHER,
                InterestSpec::Regex("a".repeat(REGEX_SOURCE_BYTES_MAX + 1)),
                true,
            ),
            invalid,
            format!(
                "regex of {} bytes exceeds the limit of {REGEX_SOURCE_BYTES_MAX} bytes",
                REGEX_SOURCE_BYTES_MAX + 1
            ),
        ),
        (
            // short source, huge compiled program
            register(OTHER, InterestSpec::Regex(r"\w{1000}\w{1000}".into()), true),
            invalid,
            "invalid regex".into(),
        ),
        (
            RequestBody::UnregisterInterest {
                region: OTHER.into(),
                interest: InterestSpec::Regex("[z-a]".into()),
            },
            invalid,
            "invalid regex".into(),
        ),
        // keys
        (
            register(OTHER, InterestSpec::Key(big_key.clone()), true),
            invalid,
            format!(
                "key of {} bytes exceeds the limit of {KEY_BYTES_MAX} bytes",
                KEY_BYTES_MAX + 1
            ),
        ),
        (
            register(
                OTHER,
                InterestSpec::Keys(vec!["fine".into(), big_key.clone()]),
                true,
            ),
            invalid,
            "exceeds the limit".into(),
        ),
        (
            register(OTHER, InterestSpec::Keys(vec![]), true),
            invalid,
            "at least one key".into(),
        ),
        (
            publish(vec![put(OTHER, &big_key, b"v")]),
            invalid,
            format!("key of {} bytes", KEY_BYTES_MAX + 1),
        ),
        (
            publish(vec![PublishOp::Destroy {
                region: OTHER.into(),
                key: big_key.clone(),
            }]),
            invalid,
            format!("key of {} bytes", KEY_BYTES_MAX + 1),
        ),
        (
            register(
                OTHER,
                InterestSpec::Keys(
                    (0..=INTERESTS_PER_QUEUE_MAX)
                        .map(|i| format!("i-{i}"))
                        .collect(),
                ),
                true,
            ),
            limit,
            format!("at most {INTERESTS_PER_QUEUE_MAX} interest registrations"),
        ),
        // values
        (
            publish(vec![put(OTHER, "big", &vec![7u8; VALUE_BYTES_MAX + 1])]),
            limit,
            format!(
                "value of {} bytes exceeds the limit of {VALUE_BYTES_MAX} bytes",
                VALUE_BYTES_MAX + 1
            ),
        ),
        // region names
        (
            register("", InterestSpec::AllKeys, true),
            invalid,
            "region name is empty".into(),
        ),
        (
            register(&big_region, InterestSpec::AllKeys, true),
            invalid,
            format!(
                "region name of {} bytes exceeds the limit of {REGION_NAME_BYTES_MAX} bytes",
                REGION_NAME_BYTES_MAX + 1
            ),
        ),
        (
            publish(vec![put("", "k", b"v")]),
            invalid,
            "region name is empty".into(),
        ),
        (
            publish(vec![PublishOp::Invalidate {
                region: big_region.clone(),
                key: "k".into(),
            }]),
            invalid,
            "region name of".into(),
        ),
        (
            RequestBody::UnregisterInterest {
                region: String::new(),
                interest: InterestSpec::AllKeys,
            },
            invalid,
            "region name is empty".into(),
        ),
        // too many ops
        (
            publish(
                (0..=PUBLISH_OPS_PER_REQUEST_MAX)
                    .map(|i| PublishOp::Destroy {
                        region: OTHER.into(),
                        key: format!("many-{i}"),
                    })
                    .collect(),
            ),
            limit,
            format!("at most {PUBLISH_OPS_PER_REQUEST_MAX} operations"),
        ),
        // one bad op spoils the whole publish, including the good ones before it
        (
            publish(vec![
                put(OTHER, "good-before-bad", b"v"),
                put(REGION, "good-before-bad", b"v"),
                put("", "k", b"v"),
            ]),
            invalid,
            "region name is empty".into(),
        ),
        // durable admin
        (
            RequestBody::CloseDurable {
                durable_id: "nobody".into(),
            },
            ErrorCode::NotFound,
            "no durable client \"nobody\"".into(),
        ),
        (
            RequestBody::CloseDurable {
                durable_id: String::new(),
            },
            ErrorCode::NotFound,
            "no durable client".into(),
        ),
        (
            RequestBody::CloseDurable {
                durable_id: "x".repeat(DURABLE_ID_BYTES_MAX + 1),
            },
            ErrorCode::NotFound,
            "no durable client".into(),
        ),
        (
            RequestBody::CloseDurable {
                durable_id: WATCHER.into(),
            },
            ErrorCode::Refused,
            "is connected".into(),
        ),
    ];
    for (i, (body, code, needle)) in cases.into_iter().enumerate() {
        raw.bad_request(10 + i as u64, body, code, &needle).await;
    }

    // A non-durable client asking for durable interest.
    let mut plain = Raw::hello(&n, None).await;
    plain
        .bad_request(
            1,
            register(OTHER, InterestSpec::AllKeys, true),
            invalid,
            "only for durable clients",
        )
        .await;

    // No failed request left anything behind.
    let q = n.queue("requester").expect("requester queue");
    assert!(q.interests.is_empty(), "{q:?}");
    assert_eq!(q.end_offset, 0, "{q:?}");
    assert_eq!(n.node().get(OTHER, "good-before-bad").unwrap(), None);
    assert_eq!(n.node().get(REGION, "good-before-bad").unwrap(), None);
    assert_eq!(n.node().get(OTHER, "fine").unwrap(), None);

    // The values at the limits are accepted on the same connection.
    let at_limit_key = "k".repeat(KEY_BYTES_MAX);
    let at_limit_region = "r".repeat(REGION_NAME_BYTES_MAX);
    match raw
        .request(
            100,
            publish(vec![put(
                &at_limit_region,
                &at_limit_key,
                &vec![1u8; VALUE_BYTES_MAX],
            )]),
        )
        .await
    {
        Ok(ResponseBody::Published { count: 1 }) => {}
        other => panic!("publish at the limits: {other:?}"),
    }
    assert_eq!(
        n.node()
            .get(&at_limit_region, &at_limit_key)
            .unwrap()
            .map(|v| v.len()),
        Some(VALUE_BYTES_MAX)
    );
    let ops: Vec<PublishOp> = (0..PUBLISH_OPS_PER_REQUEST_MAX)
        .map(|i| PublishOp::Destroy {
            region: OTHER.into(),
            key: format!("many-{i}"),
        })
        .collect();
    match raw.request(101, publish(ops)).await {
        Ok(ResponseBody::Published { count }) => {
            assert_eq!(count, PUBLISH_OPS_PER_REQUEST_MAX as u64)
        }
        other => panic!("publish of the most ops: {other:?}"),
    }
    match raw
        .request(
            102,
            register(
                OTHER,
                InterestSpec::Regex("a".repeat(REGEX_SOURCE_BYTES_MAX)),
                true,
            ),
        )
        .await
    {
        Ok(ResponseBody::Registered { .. }) => {}
        other => panic!("regex at the source limit: {other:?}"),
    }

    w.still_served(&n, "after-bad-requests").await;
    w.finish(&n).await;
}

#[tokio::test]
async fn unusual_keys_destroy_and_get() {
    let n = TestNode::start().await;
    let mut w = Watcher::start(&n).await;
    let mut raw = Raw::hello(&n, None).await;
    let max_multibyte = "é".repeat(KEY_BYTES_MAX / 2);
    assert_eq!(max_multibyte.len(), KEY_BYTES_MAX);
    let keys = [
        "ключ-🔑-鍵".to_string(),
        String::new(),
        " ".into(),
        "a\0b".into(),
        "\u{feff}\u{200b}".into(),
        "../../etc/passwd".into(),
        "\u{10ffff}".into(),
        "e\u{301}".into(), // decomposed é: a different key from "é"
        "é".into(),
        max_multibyte,
    ];
    let mut id = 0;
    for key in &keys {
        let what = format!("{:?}", key.chars().take(20).collect::<String>());
        // destroying a key that never existed is not an error
        match call(
            &mut raw,
            &mut id,
            publish(vec![PublishOp::Destroy {
                region: OTHER.into(),
                key: key.clone(),
            }]),
        )
        .await
        {
            Ok(ResponseBody::Published { count: 1 }) => {}
            other => panic!("destroy of absent {what}: {other:?}"),
        }
        let value = format!("value of {key}").into_bytes();
        match call(&mut raw, &mut id, publish(vec![put(OTHER, key, &value)])).await {
            Ok(ResponseBody::Published { count: 1 }) => {}
            other => panic!("put {what}: {other:?}"),
        }
        match call(
            &mut raw,
            &mut id,
            RequestBody::Get {
                region: OTHER.into(),
                key: key.clone(),
            },
        )
        .await
        {
            Ok(ResponseBody::Value { value: Some(v) }) => assert_eq!(v, value, "{what}"),
            other => panic!("get {what}: {other:?}"),
        }
    }
    // Each key kept its own value (no two keys collapsed into one).
    for key in &keys {
        assert_eq!(
            n.node().get(OTHER, key).unwrap(),
            Some(format!("value of {key}").into_bytes())
        );
    }
    for key in &keys {
        let what = format!("{:?}", key.chars().take(20).collect::<String>());
        match call(
            &mut raw,
            &mut id,
            publish(vec![PublishOp::Destroy {
                region: OTHER.into(),
                key: key.clone(),
            }]),
        )
        .await
        {
            Ok(ResponseBody::Published { count: 1 }) => {}
            other => panic!("destroy {what}: {other:?}"),
        }
        match call(
            &mut raw,
            &mut id,
            RequestBody::Get {
                region: OTHER.into(),
                key: key.clone(),
            },
        )
        .await
        {
            Ok(ResponseBody::Value { value: None }) => {}
            other => panic!("get after destroy {what}: {other:?}"),
        }
    }
    // Unicode region names work too.
    match call(
        &mut raw,
        &mut id,
        publish(vec![put("régión-地域", "k", b"v")]),
    )
    .await
    {
        Ok(ResponseBody::Published { count: 1 }) => {}
        other => panic!("unicode region: {other:?}"),
    }
    assert_eq!(
        n.node().get("régión-地域", "k").unwrap(),
        Some(b"v".to_vec())
    );

    // Gets with out-of-limit names are refused as invalid arguments; the connection stays
    // usable.
    let odd_gets = [
        (String::new(), "k".to_string()),
        ("r".repeat(REGION_NAME_BYTES_MAX + 1), "k".to_string()),
        (OTHER.to_string(), "k".repeat(KEY_BYTES_MAX + 1)),
        ("r".repeat(u16::MAX as usize + 1), "k".to_string()),
    ];
    for (region, key) in odd_gets {
        match call(&mut raw, &mut id, RequestBody::Get { region, key }).await {
            Err(e) => assert_eq!(e.code, ErrorCode::InvalidArgument, "{e:?}"),
            other => panic!("a get with an invalid region or key must be refused: {other:?}"),
        }
        raw.assert_usable(500).await;
    }

    w.still_served(&n, "after-unusual-keys").await;
    w.finish(&n).await;
}

/// Sends a request with the next id.
async fn call(raw: &mut Raw, id: &mut u64, body: RequestBody) -> Result<ResponseBody, WireError> {
    *id += 1;
    raw.request(*id, body).await
}

// ------------------------------------------------------------------------------ noise

#[tokio::test]
async fn garbage_udp_datagrams() {
    let n = TestNode::start().await;
    let mut w = Watcher::start(&n).await;
    let target: SocketAddr = n.node().addr();
    let sock = UdpSocket::bind("127.0.0.1:0").expect("udp socket");
    let mut rng = Rng::new(0xBAD_5EED);
    for i in 0..400u32 {
        let len = match i % 4 {
            0 => 1 + rng.below(40) as usize,
            1 => 1200 + rng.below(300) as usize,
            _ => 1 + rng.below(1500) as usize,
        };
        let mut d = rng.bytes(len);
        match i % 5 {
            // looks like a QUIC v1 long-header Initial with random CIDs and payload
            0 if len >= 1200 => {
                d[0] = 0xC0 | (d[0] & 0x0f);
                d[1..5].copy_from_slice(&1u32.to_be_bytes());
                d[5] = 8;
                d[14] = 8;
            }
            // long header with an unknown version (asks for version negotiation)
            1 if len >= 16 => {
                d[0] |= 0x80;
                d[1..5].copy_from_slice(&0x0a0a_0a0au32.to_be_bytes());
                d[5] = 8;
                d[14] = 8;
            }
            // short header (1-RTT) with a random connection id
            2 => d[0] = 0x40 | (d[0] & 0x3f),
            _ => {}
        }
        sock.send_to(&d, target).expect("send datagram");
        if i % 50 == 49 {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }
    w.still_served(&n, "after-udp-garbage").await;
    let mut raw = Raw::hello(&n, None).await;
    raw.assert_usable(1).await;
    w.finish(&n).await;
}

#[tokio::test]
async fn random_bytes_on_the_control_stream() {
    let n = TestNode::start().await;
    let mut w = Watcher::start(&n).await;
    for seed in 1..=12u64 {
        let mut rng = Rng::new(seed);
        let after_hello = seed % 2 == 0;
        let len = 1 + rng.below(8192) as usize;
        let mut bytes = rng.bytes(len);
        if seed % 3 == 0 && len > FRAME_HEADER_BYTES {
            // a plausible header in front of a random body
            let body = (len - FRAME_HEADER_BYTES) as u32;
            bytes[..FRAME_HEADER_BYTES].copy_from_slice(&body.to_be_bytes());
        }
        let mut raw = if after_hello {
            Raw::hello(&n, durable_hello(&format!("random-{seed}"), 60)).await
        } else {
            Raw::open(&n).await
        };
        raw.send_raw(&bytes).await;
        raw.send.finish().expect("finish");
        let announced = if len >= FRAME_HEADER_BYTES {
            u32::from_be_bytes(bytes[..4].try_into().unwrap()) as usize
        } else {
            0
        };
        let limit = if after_hello {
            FRAME_BYTES_MAX
        } else {
            HELLO_BYTES_MAX
        };
        let code = if len >= FRAME_HEADER_BYTES && announced > limit {
            ErrorCode::FrameTooLarge
        } else {
            ErrorCode::MalformedFrame
        };
        let msg = raw.expect_refusal(code).await;
        assert!(
            msg.contains("exceeds the limit")
                || msg.starts_with("malformed frame")
                || msg.starts_with("stream ended inside a frame"),
            "seed {seed}: {msg}"
        );
        w.still_served(&n, &format!("after-random-{seed}")).await;
    }
    w.finish(&n).await;
}

#[tokio::test]
async fn garbage_on_extra_streams_is_ignored() {
    let n = TestNode::start().await;
    let mut w = Watcher::start(&n).await;
    let mut raw = Raw::hello(&n, None).await;
    let mut rng = Rng::new(42);
    for _ in 0..3 {
        let mut uni = timeout(STEP, raw.conn.open_uni())
            .await
            .expect("open_uni timed out")
            .expect("open_uni");
        let _ = timeout(STEP, uni.write_all(&rng.bytes(4096))).await;
        let _ = uni.finish();
        let (mut bi, _recv) = timeout(STEP, raw.conn.open_bi())
            .await
            .expect("open_bi timed out")
            .expect("open_bi");
        let _ = timeout(STEP, bi.write_all(&rng.bytes(4096))).await;
        let _ = bi.finish();
    }
    raw.assert_usable(1).await;
    w.still_served(&n, "after-extra-streams").await;
    w.finish(&n).await;
}

/// Issue 22 point 3, bounded lists: a frame within the frame limit may still hold millions of
/// elements (an empty string is one byte of CBOR and 24 or more once decoded, so a 4 MB key
/// list would take about 100 MB). A client's list longer than `DECODED_LIST_ELEMENTS_MAX`
/// (a key list interest, a publish's operations) is refused as a malformed frame while the
/// frame is decoded, before the node holds it; nobody else is affected. A list over the
/// node's own limit but under that bound still gets its `limit-exceeded` answer (above).
#[tokio::test]
async fn a_list_of_millions_of_elements_is_refused_while_decoded() {
    use tether::protocol::DECODED_LIST_ELEMENTS_MAX;
    let n = TestNode::start().await;
    let mut w = Watcher::start(&n).await;
    let keys = InterestSpec::Keys(vec![String::new(); 4_000_000]);
    let ops = vec![
        PublishOp::Destroy {
            region: String::new(),
            key: String::new(),
        };
        200_000
    ];
    let bodies = [
        RequestBody::RegisterInterest {
            region: "R".into(),
            interest: keys,
            durable: false,
            policy: ResultPolicy::None,
            receive_values: true,
            image_in_parts: false,
        },
        RequestBody::Publish {
            ops,
            ack: Default::default(),
        },
    ];
    for (i, body) in bodies.into_iter().enumerate() {
        let mut raw = Raw::hello(&n, None).await;
        raw.send(&ClientMsg::Request { id: 1, body }).await;
        let msg = raw.expect_refusal(ErrorCode::MalformedFrame).await;
        assert!(
            msg.contains(&format!("at most {DECODED_LIST_ELEMENTS_MAX} elements")),
            "{msg}"
        );
        w.still_served(&n, &format!("after-long-list-{i}")).await;
    }
    w.finish(&n).await;
}

/// A well-formed CBOR map whose key is a huge unknown message name. The decode error quotes the
/// name verbatim, so the server's error message is as large as the client's frame: near
/// `FRAME_BYTES_MAX` the error frame no longer fits a frame and is not sent at all (see the
/// report). Checked here: the close code, and that nobody else is affected.
#[tokio::test]
async fn huge_unknown_message_name() {
    let n = TestNode::start().await;
    let mut w = Watcher::start(&n).await;
    for (i, len) in [100, 100_000, FRAME_BYTES_MAX - 7].into_iter().enumerate() {
        // Past the first frame's own limit only after a hello.
        let mut raw = if i >= 1 {
            Raw::hello(&n, None).await
        } else {
            Raw::open(&n).await
        };
        let body = codec::encode_body(&std::collections::BTreeMap::from([("x".repeat(len), 1u8)]))
            .unwrap();
        assert!(body.len() <= FRAME_BYTES_MAX);
        raw.send_raw(&frame(&body)).await;
        // Whatever the size of the offending name, the client gets a short error frame.
        let msg = raw.expect_refusal(ErrorCode::MalformedFrame).await;
        assert!(msg.starts_with("malformed frame: unknown variant"), "{msg}");
        w.still_served(&n, &format!("after-huge-name-{i}")).await;
    }
    w.finish(&n).await;
}

/// Bad input on the peer protocol, from a connection holding a valid cluster certificate (a
/// buggy or compromised member): bytes that are no envelope, an envelope for another node, a
/// replication message whose entries do not match its header, one with undecodable queue info.
/// Each gets an error answer on its own stream (the connection stays usable for the next); the
/// node keeps serving: a durable client placed on it receives an event published afterwards,
/// and no copy was created by the bad messages.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_peer_messages_get_error_answers_and_hurt_nothing() {
    use tether::cluster::network::{
        PeerPool, PeerRequest, PeerResponse, ReplicateHeader, ReplicateMsg, ShippedEntry,
    };
    use tether::replication::AppendHeader;
    let c = common::cluster::TestCluster::start(1).await;
    c.leader().await;
    let node = c.node(0);
    let me = tether::cluster::meta::raft_id("n1");
    let tls_dir = c.dirs[0].path().join("tls");
    // The node's own certificate: issued by the cluster CA, so the connection is a peer's.
    let files = tls::TlsFiles {
        ca: tls_dir.join(tls::CA_CERT_FILE),
        cert: tls_dir.join(tls::SERVER_CERT_FILE),
        key: tls_dir.join(tls::SERVER_KEY_FILE),
    };
    let cfg = tls::peer_client_config(&files).unwrap();
    let addr = node.addr();
    let ep = endpoint::client_endpoint(cfg.clone(), addr).unwrap();
    let conn = ep.connect(addr, tls::SERVER_NAME).unwrap().await.unwrap();
    let answer = |conn: quinn::Connection, bytes: Vec<u8>| async move {
        let (mut s, mut r) = conn
            .open_bi()
            .await
            .expect("a stream on the peer connection");
        s.write_all(&bytes).await.unwrap();
        s.finish().unwrap();
        let reply = timeout(STEP, r.read_to_end(1 << 20))
            .await
            .expect("an answer")
            .expect("an answer");
        codec::decode_body::<PeerResponse>(&reply).expect("a peer response")
    };
    for garbage in [
        b"not cbor at all".to_vec(),
        vec![0xff; 64],
        codec::encode_body(&"a string, not an envelope").unwrap(),
    ] {
        match answer(conn.clone(), garbage).await {
            PeerResponse::BadRequest(why) => assert!(!why.is_empty()),
            _ => panic!("garbage was not refused as a bad request"),
        }
    }
    let wrong =
        tether::cluster::network::encode_request(tether::ids::NodeId(me.0 ^ 1), PeerRequest::Ping)
            .unwrap();
    assert!(
        matches!(answer(conn.clone(), wrong).await, PeerResponse::WrongNode { actual } if actual == me),
        "a request for another node"
    );
    let pool = PeerPool::new(ep.clone(), cfg);
    let target = addr.to_string();
    let append = |first, last, entries: usize, info: Vec<u8>| {
        PeerRequest::Replicate(ReplicateMsg {
            // In the connection's own name (the node's certificate): a member's bad message.
            from: me,
            durable_id: "victim".into(),
            header: ReplicateHeader::Append(AppendHeader {
                epoch: 5,
                batch: 1,
                first,
                last,
                prev_epoch: None,
                entries_epoch: 5,
                log_end: last,
                acked: 0,
            }),
            sent_ms: 0,
            info,
            entries: (0..entries)
                .map(|_| ShippedEntry {
                    flags: 0,
                    body: b"x".to_vec(),
                })
                .collect(),
            more: false,
            through: Default::default(),
            through_end: 0,
            placement_epoch: 0,
        })
    };
    match pool
        .call(me, &target, append(0, 5, 3, Vec::new()), STEP)
        .await
        .unwrap()
    {
        PeerResponse::BadRequest(why) => assert!(why.contains("3 entries"), "{why}"),
        _ => panic!("an append whose entries do not match its header was not refused"),
    }
    match pool
        .call(me, &target, append(0, 2, 2, b"\xff\xfe".to_vec()), STEP)
        .await
        .unwrap()
    {
        PeerResponse::BadRequest(why) => assert!(why.contains("queue info"), "{why}"),
        _ => panic!("undecodable queue info was not refused"),
    }
    pool.close();
    conn.close(0u32.into(), b"done");
    // The node still serves clients, and holds no copy of "victim".
    let ca = files.ca.clone();
    let d = tether::client::ClientBuilder::new()
        .server(addr)
        .ca_file(&ca)
        .durable("after", 600)
        .connect()
        .await
        .unwrap();
    d.region(REGION)
        .register(Interest::all_keys())
        .await
        .unwrap();
    d.ready_for_events().await.unwrap();
    let mut ev = d.events().unwrap();
    until_live(&mut ev, REGION).await;
    let p = tether::client::ClientBuilder::new()
        .server(addr)
        .ca_file(&ca)
        .connect()
        .await
        .unwrap();
    p.region(REGION).put("k", b"v".to_vec()).await.unwrap();
    assert_eq!(keys(&take_events(&mut ev, 1).await), ["k"]);
    let qs = p.queues().await.unwrap();
    assert!(
        qs.iter().all(|q| q.durable_id.as_deref() != Some("victim")),
        "a bad message created a copy: {qs:?}"
    );
    drop(ev);
    d.close(true).await.unwrap();
    p.close(false).await.unwrap();
    c.shutdown().await;
}

/// A client whose hello does not say it knows `going-away` (an older client: `going_away`
/// false) is answered `shutdown` for a request a stopping node read but did not apply, never
/// the `going-away` code it would not know: it then reconnects as it always did. Raw clients
/// publish in a loop while the node stops; each ends on its first error.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stopping_node_answers_an_older_client_shutdown_not_going_away() {
    const PUBLISHERS: usize = 4;
    let mut t = TestNode::start().await;
    let mut tasks = Vec::new();
    for c in 0..PUBLISHERS {
        let mut raw = Raw::hello(&t, None).await;
        tasks.push(tokio::spawn(async move {
            for id in 1.. {
                let op = put(OTHER, &format!("p{c}-{id}"), b"v");
                raw.send(&ClientMsg::Request {
                    id,
                    body: publish(vec![op]),
                })
                .await;
                loop {
                    match raw.next().await {
                        Some(ServerMsg::Response { id: rid, result }) if rid == id => {
                            match result {
                                Ok(_) => break,
                                Err(e) => return Some(e.code),
                            }
                        }
                        Some(ServerMsg::Ping { nonce }) => {
                            raw.send(&ClientMsg::Pong { nonce }).await
                        }
                        Some(_) => {}
                        None => return None, // Closed before answering: not counted.
                    }
                }
            }
            None
        }));
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    t.restart().await;
    let mut codes = Vec::new();
    for task in tasks {
        codes.extend(task.await.unwrap());
    }
    eprintln!("errors answered while stopping: {codes:?}");
    assert!(
        codes.contains(&ErrorCode::Shutdown),
        "an older client's publish during the stop was answered shutdown: {codes:?}"
    );
    assert!(
        !codes.contains(&ErrorCode::GoingAway),
        "an older client was answered going-away: {codes:?}"
    );
}
