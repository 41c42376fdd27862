//! Fuzz harnesses shared by the cargo-fuzz targets (`fuzz/fuzz_targets/*.rs`) and the stable
//! corpus replay test (`tests/fuzz_corpus.rs`), which both include this file with
//! `#[path = "../fuzz/harness.rs"] mod harness;`. Only `tether` (and its re-exports of the
//! storage and transport crates) is used, so the file compiles in both crates.
//!
//! Every harness takes raw bytes and must never panic: a panic is either a crash of the code
//! under test or a broken invariant (asserted here with a message naming it). The session
//! harness decodes its operation sequence from the bytes itself ([`Unstructured`]), so a corpus
//! file means the same operations to the fuzzer and to the stable test.
#![allow(dead_code)]

use std::collections::{BTreeMap, BTreeSet, HashMap, VecDeque};

use tether::core::{ConnectError, NodeCore, SeenVerdict, SessionId, Step};
use tether::limits::{
    DURABLE_ID_BYTES_MAX, DURABLE_TIMEOUT_SECS_MAX, HELLO_BYTES_MAX, KEY_BYTES_MAX,
    REGION_NAME_BYTES_MAX, VALUE_BYTES_MAX,
};
use tether::protocol::{
    ClientMsg, Delivery, DurableHello, EventOp, EventRecord, FLAG_POSSIBLE_DUPLICATE,
    FLAG_REPLAYED, InterestSpec, PublishOp, QueueStatus, RequestBody, ServerMsg,
};
use tether::storage::{Batch, MemStore, Op as StoreOp, QueueId, Store};
use tether::transport::codec::{self, CodecError, FRAME_HEADER_BYTES, FrameDecoder};
use tether::transport::{ErrorCode, PROTOCOL_VERSION};

// ---------------------------------------------------------------------------------------------
// Byte source
// ---------------------------------------------------------------------------------------------

/// A tiny `arbitrary::Unstructured`: reads choices from the input, zeros once it is used up.
pub struct Unstructured<'a> {
    data: &'a [u8],
    pos: usize,
}

impl<'a> Unstructured<'a> {
    pub fn new(data: &'a [u8]) -> Self {
        Unstructured { data, pos: 0 }
    }

    pub fn is_empty(&self) -> bool {
        self.pos >= self.data.len()
    }

    pub fn u8(&mut self) -> u8 {
        let b = self.data.get(self.pos).copied().unwrap_or(0);
        self.pos += 1;
        b
    }

    pub fn bool(&mut self) -> bool {
        self.u8() & 1 == 1
    }

    pub fn u16(&mut self) -> u16 {
        u16::from_le_bytes([self.u8(), self.u8()])
    }

    pub fn u32(&mut self) -> u32 {
        u32::from_le_bytes([self.u8(), self.u8(), self.u8(), self.u8()])
    }

    pub fn u64(&mut self) -> u64 {
        (u64::from(self.u32()) << 32) | u64::from(self.u32())
    }

    /// A number in `0..n` (n > 0).
    pub fn below(&mut self, n: usize) -> usize {
        if n <= 256 {
            self.u8() as usize % n
        } else {
            self.u32() as usize % n
        }
    }

    /// Up to `max` raw bytes (length first).
    pub fn bytes(&mut self, max: usize) -> &'a [u8] {
        let want = self.below(max + 1);
        let start = self.pos.min(self.data.len());
        let end = (start + want).min(self.data.len());
        self.pos = start + want;
        &self.data[start..end]
    }

    /// A string of up to `max` bytes taken from the input (lossy UTF-8).
    pub fn string(&mut self, max: usize) -> String {
        String::from_utf8_lossy(self.bytes(max)).into_owned()
    }
}

// ---------------------------------------------------------------------------------------------
// frame_decoder
// ---------------------------------------------------------------------------------------------

/// Feeds the input to a [`FrameDecoder`] in input-chosen chunk sizes (first byte: split seed;
/// second byte: whether to use a small body limit) and decodes every frame as a `ClientMsg`
/// (also as a delivery frame and a server message, which the client library decodes).
///
/// Checks: no panic; no byte is lost or reordered (frames + what is buffered = what was
/// pushed); no body exceeds the limit; after an error the decoder stays failed; a decoded
/// `ClientMsg` re-encodes and decodes to itself.
pub fn frame_decoder(data: &[u8]) {
    if data.len() < 2 {
        return;
    }
    let (ctl, input) = data.split_at(2);
    let max = if ctl[1] & 1 == 1 {
        64 + (ctl[1] as usize)
    } else {
        codec::FRAME_BYTES_MAX
    };
    let mut d = FrameDecoder::with_max(max);
    let mut seed = u32::from(ctl[0]) | 1;
    let mut pushed = 0usize;
    let mut consumed = 0usize;
    let mut pos = 0usize;
    let mut failed = false;
    while pos < input.len() {
        // xorshift chunk sizes: 1..=32, or occasionally large.
        seed ^= seed << 13;
        seed ^= seed >> 17;
        seed ^= seed << 5;
        let n = if seed % 8 == 0 {
            input.len()
        } else {
            1 + (seed as usize % 32)
        };
        let end = (pos + n).min(input.len());
        d.push(&input[pos..end]);
        if !failed {
            pushed += end - pos;
        }
        pos = end;
        loop {
            match d.next_raw() {
                Ok(Some(body)) => {
                    assert!(!failed, "frame_decoder: a frame after an error");
                    assert!(body.len() <= max, "frame_decoder: body over the limit");
                    consumed += FRAME_HEADER_BYTES + body.len();
                    decode_client_frame(&body);
                    let _ = codec::decode_body::<Delivery<'_>>(&body);
                    let _ = codec::decode_body::<ServerMsg>(&body);
                    let _ = codec::decode_body::<EventRecord>(&body);
                }
                Ok(None) => {
                    assert!(!failed, "frame_decoder: Ok(None) after an error");
                    break;
                }
                Err(e) => {
                    assert!(
                        matches!(e, CodecError::TooLarge { .. }),
                        "frame_decoder: next_raw gave {e:?}"
                    );
                    failed = true;
                    assert_eq!(
                        d.buffered(),
                        0,
                        "frame_decoder: a failed decoder keeps bytes"
                    );
                    break;
                }
            }
        }
        if !failed {
            assert_eq!(
                consumed + d.buffered(),
                pushed,
                "frame_decoder: bytes lost or invented"
            );
        }
    }
    match d.finish() {
        Ok(()) => assert!(
            !failed && d.is_empty(),
            "frame_decoder: finish ok mid-frame"
        ),
        Err(CodecError::Truncated { need, have }) => {
            assert!(!failed && have == d.buffered() && have < need && have > 0);
        }
        Err(CodecError::TooLarge { .. }) => assert!(failed),
        Err(e) => panic!("frame_decoder: finish gave {e:?}"),
    }
}

/// Decodes one body as a client message; a decoded message must round-trip.
fn decode_client_frame(body: &[u8]) -> Option<ClientMsg> {
    let msg = codec::decode_body::<ClientMsg>(body).ok()?;
    let frame = codec::encode_frame(&msg).expect("a decoded ClientMsg re-encodes");
    let mut d = FrameDecoder::new();
    d.push(&frame);
    let again: ClientMsg = d
        .next()
        .expect("re-encoded frame decodes")
        .expect("re-encoded frame is complete");
    assert_eq!(again, msg, "ClientMsg does not round-trip");
    Some(msg)
}

// ---------------------------------------------------------------------------------------------
// handshake
// ---------------------------------------------------------------------------------------------

/// What the server does with a connection's first bytes (mirrors `server::conn`).
#[derive(Debug, PartialEq, Eq)]
pub enum HandshakeOutcome {
    /// The stream ended before a complete first frame (clean end: the server just drops it).
    Ended,
    /// Refused with this error code before or at `NodeCore::connect`.
    Refused(ErrorCode),
    /// Welcomed with this queue status.
    Welcome(QueueStatus),
}

/// Decodes the input as the control stream the server reads at a handshake, with the same
/// validation (first frame a hello, protocol version, `NodeCore::connect` limits).
pub fn handshake_outcome(data: &[u8]) -> HandshakeOutcome {
    let mut core = NodeCore::new("n1");
    let store = MemStore::new();
    handshake_on(&mut core, &store, data)
}

fn handshake_on(core: &mut NodeCore, store: &MemStore, data: &[u8]) -> HandshakeOutcome {
    // The first frame is read before authentication, under the hello's own limit.
    let mut d = FrameDecoder::with_max(HELLO_BYTES_MAX);
    d.push(data);
    let first = match d.next::<ClientMsg>() {
        Err(e) => return HandshakeOutcome::Refused(e.code()),
        Ok(None) => {
            // The server's reader reports a stream that ends inside a frame as malformed.
            return match d.finish() {
                Ok(()) => HandshakeOutcome::Ended,
                Err(e) => HandshakeOutcome::Refused(e.code()),
            };
        }
        Ok(Some(m)) => m,
    };
    let ClientMsg::Hello {
        version, durable, ..
    } = first
    else {
        return HandshakeOutcome::Refused(ErrorCode::ProtocolViolation);
    };
    if version != PROTOCOL_VERSION {
        return HandshakeOutcome::Refused(ErrorCode::UnsupportedVersion);
    }
    match core.connect(durable.as_ref()) {
        Ok(c) => {
            store
                .write(&c.batch, true)
                .expect("a connect batch is always writable");
            if let Some(h) = &durable {
                assert!(
                    !h.id.is_empty()
                        && h.id.len() <= DURABLE_ID_BYTES_MAX
                        && h.timeout_secs <= DURABLE_TIMEOUT_SECS_MAX,
                    "handshake: connect accepted an out-of-limit durable hello {h:?}"
                );
            }
            HandshakeOutcome::Welcome(c.status)
        }
        Err(ConnectError::Invalid(e)) => HandshakeOutcome::Refused(e.code),
        Err(ConnectError::Attached(s)) => HandshakeOutcome::Refused(if core.session(s).is_some() {
            ErrorCode::DuplicateDurableId
        } else {
            panic!("handshake: durable id attached to a session that does not exist")
        }),
    }
}

/// The handshake harness: the input's first frame on a fresh node, then the same input again
/// (a second connection), then again after the first session went away (a resume). Checks
/// the outcome codes against the protocol document.
pub fn handshake(data: &[u8]) {
    let mut core = NodeCore::new("n1");
    let store = MemStore::new();
    let first = handshake_on(&mut core, &store, data);
    match &first {
        HandshakeOutcome::Ended => return,
        HandshakeOutcome::Refused(code) => {
            assert!(
                matches!(
                    code,
                    ErrorCode::MalformedFrame
                        | ErrorCode::FrameTooLarge
                        | ErrorCode::ProtocolViolation
                        | ErrorCode::UnsupportedVersion
                        | ErrorCode::InvalidArgument
                ),
                "handshake: unexpected refusal {code:?}"
            );
            return;
        }
        HandshakeOutcome::Welcome(status) => {
            assert!(
                matches!(status, QueueStatus::New | QueueStatus::None),
                "handshake: fresh node said {status:?}"
            );
        }
    }
    let durable = matches!(first, HandshakeOutcome::Welcome(QueueStatus::New));
    // Same hello again while the first session is attached.
    let second = handshake_on(&mut core, &store, data);
    if durable {
        assert_eq!(
            second,
            HandshakeOutcome::Refused(ErrorCode::DuplicateDurableId),
            "handshake: a second session got the same durable id"
        );
        // The first session goes away (keepalive): the next hello resumes with nothing pending.
        let sessions: Vec<SessionId> = (1..=4).filter(|s| core.session(*s).is_some()).collect();
        for s in sessions {
            let d = core.disconnect(0, s, true);
            store.write(&d.batch, true).expect("disconnect batch");
        }
        let third = handshake_on(&mut core, &store, data);
        assert_eq!(third, HandshakeOutcome::Welcome(QueueStatus::Resumed));
        let reports = core.queue_reports();
        assert_eq!(reports.len(), 1, "handshake: one durable queue");
        assert_eq!(reports[0].pending, 0);
    } else {
        assert_eq!(second, HandshakeOutcome::Welcome(QueueStatus::None));
    }
}

// ---------------------------------------------------------------------------------------------
// session
// ---------------------------------------------------------------------------------------------

const REGIONS: &[&str] = &["R", "S", "prices", "ünï"];
const KEYS: &[&str] = &["a", "b", "k1", "k2", "EUR-1", "", "é"];
const DURABLE_IDS: &[&str] = &["X", "Y", "Z"];
const REGEXES: &[&str] = &[
    "k.*",
    ".*",
    "(",
    "a|b|",
    "\\",
    "[[:alpha:]]+",
    "(?i)K\\d",
    "(a+)+$",
    "x{0}",
    "a{1000}{1000}",
    "\\p{Greek}*",
    "(?-u:\\xff)",
    "[^\\x00-\\x{10FFFF}]",
    "(?s).",
    "$^",
    "é|EUR-.*",
    "\\b\\B",
    "(?P<n>k)\\k<n>",
];

/// Limits on one run, so a single input stays fast.
const SESSION_OPS_MAX: usize = 400;
const DELIVERY_STEPS_MAX: usize = 64;

fn pick<'s>(u: &mut Unstructured<'_>, set: &[&'s str]) -> &'s str {
    set[u.below(set.len())]
}

fn gen_region(u: &mut Unstructured<'_>) -> String {
    match u.below(64) {
        0 => String::new(),
        1 => "r".repeat(REGION_NAME_BYTES_MAX + 1),
        2 => "r".repeat(REGION_NAME_BYTES_MAX),
        3 => u.string(8),
        4..=7 => pick(u, REGIONS).to_string(),
        _ => REGIONS[u.below(2)].to_string(),
    }
}

fn gen_key(u: &mut Unstructured<'_>) -> String {
    match u.below(64) {
        0 => "k".repeat(KEY_BYTES_MAX + 1),
        1 => "k".repeat(KEY_BYTES_MAX),
        2 => u.string(8),
        _ => pick(u, KEYS).to_string(),
    }
}

fn gen_spec(u: &mut Unstructured<'_>) -> InterestSpec {
    match u.below(10) {
        0 => InterestSpec::Key(gen_key(u)),
        1 => {
            let n = u.below(4);
            InterestSpec::Keys((0..n).map(|_| gen_key(u)).collect())
        }
        2 => InterestSpec::Regex(pick(u, REGEXES).to_string()),
        3 => match u.below(4) {
            0 => InterestSpec::Regex("a".repeat(1025)),
            _ => InterestSpec::Regex(u.string(24)),
        },
        _ => InterestSpec::AllKeys,
    }
}

fn gen_publish_op(u: &mut Unstructured<'_>) -> PublishOp {
    let region = gen_region(u);
    let key = gen_key(u);
    match u.below(8) {
        0 => PublishOp::Destroy { region, key },
        1 => PublishOp::Invalidate { region, key },
        _ => {
            let len = match u.below(256) {
                0 => VALUE_BYTES_MAX + 1,
                1 => 1000,
                n => n,
            };
            PublishOp::Put {
                region,
                key,
                value: vec![u.u8(); len],
            }
        }
    }
}

/// One write waiting for the (simulated) storage writer, in submission order.
struct Pending {
    batch: Batch,
    /// For a publish plan: its sequence and appended offsets, to mark visible once committed.
    plan: Option<(u64, Vec<(QueueId, u64)>)>,
}

/// What the harness knows about one queue (by id; ids are never reused).
#[derive(Default, Clone)]
struct QModel {
    acked: u64,
    end: u64,
    delivered: u64,
    /// Highest offset ever handed to the wire (in any session).
    sent_max: u64,
    /// Event id (as text) → offset, for every entry ever delivered from this queue.
    ids: HashMap<String, u64>,
}

/// What the harness knows about one live session.
#[derive(Default, Clone)]
struct SModel {
    durable: bool,
    ready: bool,
    replay_end: u64,
    /// Offsets at or below this were sent by an earlier session: expected possible_duplicate.
    dup_until: u64,
    /// Last offset sent in this session (or acked at ready).
    last: u64,
    live_regions: BTreeSet<String>,
    live_first_seen: bool,
}

struct SessionSim {
    core: NodeCore,
    store: MemStore,
    now: u64,
    fifo: VecDeque<Pending>,
    alive: Vec<SessionId>,
    dead: Vec<SessionId>,
    smodel: HashMap<SessionId, SModel>,
    qmodel: BTreeMap<QueueId, QModel>,
    max_qid: QueueId,
    /// Region keys as they exist in the committed store (for create vs update).
    exists: BTreeMap<(String, String), bool>,
    check_op_kind: bool,
    stats: SessionStats,
}

impl SessionSim {
    fn new() -> Self {
        SessionSim {
            core: NodeCore::new("n1"),
            store: MemStore::new(),
            now: 1_000_000,
            fifo: VecDeque::new(),
            alive: Vec::new(),
            dead: Vec::new(),
            smodel: HashMap::new(),
            qmodel: BTreeMap::new(),
            max_qid: 0,
            exists: BTreeMap::new(),
            check_op_kind: false,
            stats: SessionStats::default(),
        }
    }

    fn submit(&mut self, batch: Batch, plan: Option<(u64, Vec<(QueueId, u64)>)>) {
        self.fifo.push_back(Pending { batch, plan });
    }

    /// Commits the first `n` waiting writes, in order.
    fn commit(&mut self, n: usize) {
        for _ in 0..n {
            let Some(p) = self.fifo.pop_front() else {
                return;
            };
            self.store
                .write(&p.batch, true)
                .unwrap_or_else(|e| panic!("session: the core built an unwritable batch: {e}"));
            for op in p.batch.ops() {
                match op {
                    StoreOp::RegionPut { region, key, .. } => {
                        self.exists.insert((region.clone(), key.clone()), true);
                    }
                    StoreOp::RegionDelete { region, key } => {
                        self.exists.insert((region.clone(), key.clone()), false);
                    }
                    _ => {}
                }
            }
            if let Some((seq, appended)) = p.plan {
                self.core.committed(seq, &appended);
            }
        }
    }

    fn flush(&mut self) {
        let n = self.fifo.len();
        self.commit(n);
    }

    fn pick_session(&mut self, u: &mut Unstructured<'_>) -> SessionId {
        match u.below(16) {
            0 if !self.dead.is_empty() => self.dead[u.below(self.dead.len())],
            1 => u.u64() % 64,
            _ if !self.alive.is_empty() => self.alive[u.below(self.alive.len())],
            _ => 1,
        }
    }

    /// The client of a session not ready yet says which entry it saw last (issue 22, point 9):
    /// the verdict follows the queue's end and the event check, and entries up to the bound
    /// count as possibly sent from now on.
    fn client_seen(&mut self, s: SessionId, u: &mut Unstructured<'_>) {
        let Some(qid) = self.core.session(s).filter(|x| x.durable).map(|x| x.queue) else {
            return;
        };
        let Some(q) = self.core.queue(qid) else {
            return;
        };
        let (end, delivered) = (q.end, q.delivered);
        let offset = u.below(end as usize + 3) as u64;
        let same_event = match u.below(3) {
            0 => None,
            1 => Some(true),
            _ => Some(false),
        };
        let Some((verdict, batch)) = self.core.client_seen(s, offset, same_event) else {
            return;
        };
        let diverged = offset > end || same_event == Some(false);
        let expected = if diverged {
            SeenVerdict::Diverged
        } else if offset > delivered {
            SeenVerdict::FlagsRaised
        } else {
            SeenVerdict::Consistent
        };
        assert_eq!(
            verdict, expected,
            "session: client_seen({offset}) of queue end {end}"
        );
        self.stats.seen_checks += 1;
        self.stats.seen_diverged += usize::from(diverged);
        if let Some(b) = batch {
            self.submit(b, None);
            self.flush();
        }
        let bound = if diverged { end } else { offset };
        let qm = self.qmodel.entry(qid).or_default();
        qm.sent_max = qm.sent_max.max(bound);
    }

    fn note_session(&mut self, s: SessionId, durable: bool) {
        self.alive.push(s);
        self.smodel.insert(
            s,
            SModel {
                durable,
                // Non-durable clients are ready from the start, with nothing to replay.
                ready: !durable,
                ..Default::default()
            },
        );
        self.note_queue_of(s);
    }

    fn note_queue_of(&mut self, s: SessionId) {
        if let Some(sess) = self.core.session(s) {
            self.max_qid = self.max_qid.max(sess.queue);
        }
    }

    fn end_session(&mut self, s: SessionId) {
        self.alive.retain(|&x| x != s);
        self.smodel.remove(&s);
        if !self.dead.contains(&s) {
            self.dead.push(s);
        }
        if self.dead.len() > 16 {
            self.dead.remove(0);
        }
    }

    fn connect(&mut self, hello: Option<DurableHello>, takeover: bool) {
        match self.core.connect(hello.as_ref()) {
            Ok(c) => {
                if let Some(h) = &hello {
                    assert!(
                        !h.id.is_empty()
                            && h.id.len() <= DURABLE_ID_BYTES_MAX
                            && h.timeout_secs <= DURABLE_TIMEOUT_SECS_MAX,
                        "session: out-of-limit durable hello accepted: {h:?}"
                    );
                    if c.status == QueueStatus::Resumed {
                        self.stats.resumes += 1;
                        let q = self.core.queue(self.core.session(c.session).unwrap().queue);
                        let q = q.expect("a resumed session has its queue");
                        assert_eq!(c.pending, Some(q.end - q.acked), "session: resume pending");
                    } else {
                        assert_eq!(c.pending, None);
                    }
                }
                self.submit(c.batch, None);
                self.flush();
                self.note_session(c.session, hello.is_some());
            }
            Err(ConnectError::Invalid(e)) => {
                assert_eq!(e.code, ErrorCode::InvalidArgument, "session: connect {e:?}");
            }
            Err(ConnectError::Attached(holder)) => {
                assert!(
                    self.alive.contains(&holder),
                    "session: durable id attached to dead session {holder}"
                );
                if takeover {
                    // The server's takeover: the holder did not answer the probe.
                    self.disconnect(holder, true);
                    match self.core.connect(hello.as_ref()) {
                        Ok(c) => {
                            assert_eq!(c.status, QueueStatus::Resumed, "session: takeover");
                            self.submit(c.batch, None);
                            self.flush();
                            self.note_session(c.session, true);
                        }
                        Err(e) => panic!("session: connect after takeover failed: {e:?}"),
                    }
                }
            }
        }
    }

    fn disconnect(&mut self, s: SessionId, keepalive: bool) {
        let d = self.core.disconnect(self.now, s, keepalive);
        self.submit(d.batch, None);
        self.flush();
        self.end_session(s);
    }

    fn publish(&mut self, s: SessionId, ops: Vec<PublishOp>, defer: bool) {
        let before = self.snapshot_ends();
        let first_seq = self.core.session(s).map_or(0, |x| x.next_seq);
        let store = &self.store;
        let res = self.core.publish(self.now, s, &ops, &mut |r, k| {
            Ok(matches!(store.region_get(r, k), Ok(Some(_))))
        });
        match res {
            Ok(plan) => {
                assert_eq!(plan.count as usize, ops.len(), "session: publish count");
                self.stats.publishes_ok += 1;
                let after = self.snapshot_ends();
                let grown: u64 = after
                    .iter()
                    .map(|(q, e)| e - before.get(q).copied().unwrap_or(0))
                    .sum();
                assert_eq!(grown, plan.enqueued, "session: enqueued vs queue ends");
                if self.check_op_kind {
                    self.check_plan_ops(&plan.batch, &ops, first_seq);
                }
                self.submit(plan.batch, Some((plan.seq, plan.appended)));
                if !defer {
                    self.flush();
                }
            }
            Err(e) => {
                assert!(
                    matches!(
                        e.code,
                        ErrorCode::InvalidArgument | ErrorCode::LimitExceeded | ErrorCode::NotFound
                    ),
                    "session: publish error {e:?}"
                );
                assert_eq!(
                    before,
                    self.snapshot_ends(),
                    "session: a refused publish changed queue ends"
                );
            }
        }
    }

    /// A put reports `create` exactly when the key does not exist in the region store as it
    /// will be when the plan commits (the committed store plus earlier uncommitted plans).
    fn check_plan_ops(&mut self, batch: &Batch, ops: &[PublishOp], first_seq: u64) {
        let mut exists = self.exists.clone();
        for p in &self.fifo {
            for op in p.batch.ops() {
                match op {
                    StoreOp::RegionPut { region, key, .. } => {
                        exists.insert((region.clone(), key.clone()), true);
                    }
                    StoreOp::RegionDelete { region, key } => {
                        exists.insert((region.clone(), key.clone()), false);
                    }
                    _ => {}
                }
            }
        }
        let mut records: Vec<EventRecord> = Vec::new();
        let mut seen_bodies = BTreeSet::new();
        for op in batch.ops() {
            if let StoreOp::Append { entry, .. } = op
                && seen_bodies.insert(entry.body.to_vec())
            {
                records.push(codec::decode_body(&entry.body).expect("record decodes"));
            }
        }
        for (i, op) in ops.iter().enumerate() {
            let (region, key) = match op {
                PublishOp::Put { region, key, .. }
                | PublishOp::Destroy { region, key }
                | PublishOp::Invalidate { region, key } => (region.clone(), key.clone()),
            };
            let existed = exists.get(&(region.clone(), key.clone())).copied();
            let existed = existed.unwrap_or(false);
            // The record of op i carries the i-th sequence number of this publish (it exists
            // when the op matched at least one queue).
            if let PublishOp::Put { .. } = op
                && let Some(r) = records.iter().find(|r| r.id.seq == first_seq + i as u64)
            {
                let want = if existed {
                    EventOp::Update
                } else {
                    EventOp::Create
                };
                assert_eq!(
                    r.op, want,
                    "session: put of {region}/{key} reported {:?}",
                    r.op
                );
            }
            // A destroy removes the key; an invalidate keeps an existing key (value gone) and
            // leaves an absent one absent; a put makes it exist.
            let after = match op {
                PublishOp::Put { .. } => true,
                PublishOp::Destroy { .. } => false,
                PublishOp::Invalidate { .. } => existed,
            };
            exists.insert((region, key), after);
        }
    }

    fn snapshot_ends(&self) -> BTreeMap<QueueId, u64> {
        (1..=self.max_qid)
            .filter_map(|q| self.core.queue(q).map(|x| (q, x.end)))
            .collect()
    }

    fn ack(&mut self, s: SessionId, mode: u8, raw: u64, defer: bool) {
        let sent = self.core.session(s).map_or(0, |x| x.sent);
        let qid = self.core.session(s).map(|x| x.queue);
        let acked_before = qid.and_then(|q| self.core.queue(q)).map(|q| q.acked);
        let offset = match mode % 6 {
            0 => sent,
            1 => sent.saturating_sub(1),
            2 => sent + 1,
            3 => acked_before.unwrap_or(0),
            4 => 0,
            _ => raw,
        };
        let res = self.core.ack(s, offset);
        let acked_after = qid.and_then(|q| self.core.queue(q)).map(|q| q.acked);
        match res {
            Ok(Some(b)) => {
                assert!(offset <= sent, "session: ack beyond sent accepted");
                self.stats.acks_ok += 1;
                assert_eq!(acked_after, Some(offset), "session: ack did not move acked");
                assert!(
                    acked_before.is_some_and(|a| a < offset),
                    "session: ack batch without progress"
                );
                self.submit(b, None);
                if !defer {
                    self.flush();
                }
            }
            Ok(None) => assert_eq!(acked_before, acked_after, "session: silent ack moved acked"),
            Err(e) => {
                assert_eq!(acked_before, acked_after, "session: failed ack moved acked");
                if e.code == ErrorCode::ProtocolViolation {
                    assert!(offset > sent, "session: in-range ack refused: {e:?}");
                    // The server closes the connection: a crash, which keeps the queue.
                    if self.alive.contains(&s) {
                        self.disconnect(s, true);
                    }
                }
            }
        }
    }

    fn ready(&mut self, s: SessionId) {
        let Some(sess) = self.core.session(s) else {
            assert!(self.core.ready(s).is_err(), "session: ready of no session");
            return;
        };
        let qid = sess.queue;
        let had_cursor = sess.cursor.is_some();
        let res = self.core.ready(s);
        let Some(m) = self.smodel.get(&s).cloned() else {
            return;
        };
        match res {
            Ok(replay_end) => {
                if had_cursor {
                    if m.ready {
                        assert_eq!(m.replay_end, replay_end, "session: ready twice changed");
                    }
                    return;
                }
                let q = self.core.queue(qid).expect("ready session has a queue");
                let acked = q.acked;
                assert_eq!(replay_end, q.end, "session: replay_end is the queue end");
                let qm = self.qmodel.entry(qid).or_default();
                let mm = self.smodel.get_mut(&s).unwrap();
                mm.ready = true;
                mm.replay_end = replay_end;
                mm.dup_until = qm.sent_max;
                mm.last = acked;
            }
            Err(e) => {
                assert_eq!(e.code, ErrorCode::NotFound, "session: ready {e:?}");
                assert!(!had_cursor);
            }
        }
    }

    fn deliver(&mut self, s: SessionId, steps: usize, max_bytes: usize) {
        for _ in 0..steps {
            let step = self.core.delivery_step(s);
            let Some(m) = self.smodel.get(&s).cloned() else {
                assert_eq!(step, Step::Idle, "session: delivery to a dead session");
                return;
            };
            if !m.ready {
                assert_eq!(step, Step::Idle, "session: delivery before ready");
                return;
            }
            match step {
                Step::Idle => return,
                Step::Live(regions) => {
                    let sess = self.core.session(s).unwrap();
                    let acked = self.core.queue(sess.queue).map_or(0, |q| q.acked);
                    assert!(
                        m.last.max(acked) >= m.replay_end,
                        "session: live marker before the end of the replay (last {}, replay_end {})",
                        m.last,
                        m.replay_end
                    );
                    let mm = self.smodel.get_mut(&s).unwrap();
                    if mm.live_first_seen {
                        assert!(!regions.is_empty(), "session: empty later live marker");
                    }
                    mm.live_first_seen = true;
                    for r in regions {
                        assert!(mm.live_regions.insert(r.clone()), "session: {r} live twice");
                    }
                }
                Step::Read { from, to } => {
                    let sess = self.core.session(s).unwrap();
                    let qid = sess.queue;
                    let q = self.core.queue(qid).expect("read of a missing queue");
                    assert!(
                        from <= to && to <= q.visible_end && from > q.acked,
                        "session: bad read {from}..={to} (acked {}, visible {})",
                        q.acked,
                        q.visible_end
                    );
                    assert_eq!(from, m.last + 1, "session: read skips or repeats");
                    if from <= m.replay_end {
                        assert!(to <= m.replay_end, "session: a read crosses replay_end");
                    }
                    let bounds = self.core.flag_bounds(s).expect("ready session has bounds");
                    let mut got: Vec<(u64, u8, Vec<u8>)> = Vec::new();
                    self.store
                        .read_entries(qid, from, to, max_bytes, &mut |o, f, b| {
                            got.push((o, f, b.to_vec()))
                        })
                        .expect("read entries");
                    assert!(
                        !got.is_empty(),
                        "session: committed entries {from}..={to} of queue {qid} are missing"
                    );
                    let qm = self.qmodel.entry(qid).or_default();
                    for (i, (o, stored_flags, body)) in got.iter().enumerate() {
                        assert_eq!(*o, from + i as u64, "session: gap in the queue log");
                        assert_eq!(stored_flags & !1, 0, "session: stored wire flags");
                        let f = bounds.wire_flags(*o);
                        assert_eq!(
                            f & FLAG_REPLAYED != 0,
                            *o <= m.replay_end,
                            "session: replayed flag of {o}"
                        );
                        assert_eq!(
                            f & FLAG_POSSIBLE_DUPLICATE != 0,
                            *o <= m.dup_until,
                            "session: possible_duplicate flag of {o} (sent before up to {})",
                            m.dup_until
                        );
                        let rec: EventRecord =
                            codec::decode_body(body).expect("stored record decodes");
                        let id = rec.id.to_string();
                        if let Some(&prev) = qm.ids.get(&id) {
                            assert_eq!(prev, *o, "session: event id {id} at two offsets");
                            assert!(
                                f & FLAG_POSSIBLE_DUPLICATE != 0,
                                "session: offset {o} delivered twice without possible_duplicate"
                            );
                        }
                        qm.ids.insert(id, *o);
                        self.stats.entries_delivered += 1;
                        if f & FLAG_POSSIBLE_DUPLICATE != 0 {
                            self.stats.flagged_duplicates += 1;
                        }
                    }
                    let last = got.last().unwrap().0;
                    qm.sent_max = qm.sent_max.max(last);
                    if let Some(b) = self.core.will_send(s, last) {
                        // The delivered mark reaches storage before the bytes reach the wire.
                        self.submit(b, None);
                        self.flush();
                    }
                    self.smodel.get_mut(&s).unwrap().last = last;
                }
            }
        }
    }

    /// Invariants that hold after every operation.
    fn check(&mut self) {
        let _ = self.core.counts(self.now);
        for r in self.core.queue_reports() {
            assert!(
                r.acked_offset <= r.end_offset,
                "session: acked beyond end {r:?}"
            );
            assert_eq!(
                r.pending,
                r.end_offset - r.acked_offset,
                "session: pending != end - acked"
            );
        }
        for qid in 1..=self.max_qid {
            let Some(q) = self.core.queue(qid) else {
                continue;
            };
            assert!(
                q.acked <= q.visible_end && q.visible_end <= q.end,
                "session: queue {qid} offsets acked {} visible {} end {}",
                q.acked,
                q.visible_end,
                q.end
            );
            let m = self.qmodel.entry(qid).or_default();
            assert!(
                q.acked >= m.acked,
                "session: acked of queue {qid} went back"
            );
            assert!(q.end >= m.end, "session: end of queue {qid} went back");
            assert!(q.delivered >= m.delivered, "session: delivered went back");
            m.acked = q.acked;
            m.end = q.end;
            m.delivered = q.delivered;
        }
    }

    /// kill -9: the first `keep` waiting writes reach storage, the rest are lost; the core is
    /// rebuilt from storage.
    fn crash_and_recover(&mut self, keep: usize) {
        self.stats.recoveries += 1;
        let all_committed = keep >= self.fifo.len();
        self.commit(keep);
        self.fifo.clear();
        let before: BTreeMap<String, (u64, u64, u64, Vec<String>)> = self
            .core
            .queue_reports()
            .into_iter()
            .filter_map(|r| {
                let interests = r
                    .interests
                    .iter()
                    .filter(|i| i.durable)
                    .map(|i| format!("{}/{}/{:?}", i.region, i.kind, i.spec))
                    .collect();
                r.durable_id
                    .map(|id| (id, (r.acked_offset, r.end_offset, r.pending, interests)))
            })
            .collect();
        let metas = self.store.queues().expect("queues");
        let store = &self.store;
        let (core, batch) = NodeCore::recover(
            "n1",
            self.now,
            metas.clone(),
            |k| store.state_get(k),
            |q, from, to| tether::core::bytes::stored_entry_bytes(store, q, from, to),
        )
        .unwrap_or_else(|e| panic!("session: recovery failed: {e}"));
        self.core = core;
        self.store.write(&batch, true).expect("recovery batch");
        for s in self.alive.clone() {
            self.end_session(s);
        }
        self.dead.clear();
        self.smodel.clear();
        // Queue state as storage has it: exactly what recovery must restore.
        for (qid, meta) in metas {
            if let Some(q) = self.core.queue(qid) {
                assert_eq!(
                    (q.acked, q.end, q.pending()),
                    (meta.acked, meta.end, meta.end - meta.acked),
                    "session: recovered queue {qid} differs from storage"
                );
                let m = self.qmodel.entry(qid).or_default();
                // Lost (unsynced) acks may come back lower; what storage had is the floor.
                m.acked = q.acked;
                m.end = q.end;
                m.delivered = q.delivered;
                // Delivered marks always reach storage before the bytes: nothing sent is above.
                assert!(
                    q.delivered >= m.sent_max,
                    "session: a sent entry above delivered"
                );
                // The stored mark is reserved ahead of what was sent and a restart clamps it to
                // the queue's end: entries up to it count as possibly sent from now on.
                assert!(q.delivered <= q.end, "session: delivered past the end");
                m.sent_max = q.delivered;
            }
        }
        let after: BTreeMap<String, (u64, u64, u64, Vec<String>)> = self
            .core
            .queue_reports()
            .into_iter()
            .filter_map(|r| {
                assert_eq!(r.state, "away", "session: recovered queue not away");
                let id = r.durable_id.clone();
                assert!(
                    id.is_some(),
                    "session: a non-durable queue survived recovery"
                );
                let interests = r
                    .interests
                    .iter()
                    .map(|i| {
                        assert!(i.durable, "session: non-durable interest recovered");
                        format!("{}/{}/{:?}", i.region, i.kind, i.spec)
                    })
                    .collect();
                id.map(|id| (id, (r.acked_offset, r.end_offset, r.pending, interests)))
            })
            .collect();
        if all_committed {
            assert_eq!(
                before, after,
                "session: recovery changed durable queues (acked, end, pending, interests)"
            );
        }
    }

    fn gen_hello(&mut self, u: &mut Unstructured<'_>) -> DurableHello {
        let id = match u.below(32) {
            0 => String::new(),
            1 => "d".repeat(DURABLE_ID_BYTES_MAX + u.below(2)),
            2 => u.string(6),
            _ => pick(u, DURABLE_IDS).to_string(),
        };
        let timeout_secs = match u.below(16) {
            0 => 0,
            1 => DURABLE_TIMEOUT_SECS_MAX,
            2 => DURABLE_TIMEOUT_SECS_MAX + 1,
            3 => u64::MAX,
            4 => u.u64(),
            _ => 1 + u.below(600) as u64,
        };
        DurableHello {
            redirect_epoch: None,
            id,
            timeout_secs,
            redundancy: 0,
            failed_primary: None,
            seen: None,
        }
    }

    fn register_op(
        &mut self,
        s: SessionId,
        region: &str,
        spec: &InterestSpec,
        u: &mut Unstructured<'_>,
    ) {
        let session_durable = self.core.session(s).is_some_and(|x| x.durable);
        let durable = if session_durable {
            u.below(4) != 0
        } else {
            u.below(8) == 0
        };
        let values = u.below(4) != 0;
        if let Ok((_, b)) = self.core.register(s, region, spec, durable, values) {
            self.submit(b, None);
            self.flush();
        }
        self.note_queue_of(s);
    }

    fn ack_sent(&mut self, s: SessionId) {
        self.ack(s, 0, 0, false);
    }

    fn step(&mut self, u: &mut Unstructured<'_>) {
        match u.below(32) {
            0..=2 => {
                let hello = self.gen_hello(u);
                let takeover = u.bool();
                self.connect(Some(hello), takeover);
            }
            3 => self.connect(None, false),
            4 => {
                let (s, b) = self.core.publisher_session();
                self.submit(b, None);
                self.flush();
                self.note_session(s, false);
            }
            5 | 6 => {
                let s = self.pick_session(u);
                let region = gen_region(u);
                let spec = gen_spec(u);
                self.register_op(s, &region, &spec, u);
            }
            7 => {
                let s = self.pick_session(u);
                let region = gen_region(u);
                let spec = gen_spec(u);
                if let Ok((_, b)) = self.core.unregister(s, &region, &spec) {
                    self.submit(b, None);
                    self.flush();
                }
            }
            8 | 9 => {
                let s = self.pick_session(u);
                self.ready(s);
            }
            10..=14 => {
                let s = self.pick_session(u);
                let n = 1 + u.below(4);
                let ops = (0..n).map(|_| gen_publish_op(u)).collect();
                let defer = u.bool();
                self.publish(s, ops, defer);
            }
            15..=17 => {
                let s = self.pick_session(u);
                let (mode, raw, defer) = (u.u8(), u.u64(), u.bool());
                let mode = if mode < 128 { 0 } else { mode };
                self.ack(s, mode, raw, defer);
            }
            18..=22 => {
                let s = self.pick_session(u);
                let steps = 1 + u.below(DELIVERY_STEPS_MAX);
                let max_bytes = if u.below(4) == 0 { 1 } else { usize::MAX };
                self.deliver(s, steps, max_bytes);
            }
            23 | 24 => {
                let s = self.pick_session(u);
                self.deliver(s, DELIVERY_STEPS_MAX, usize::MAX);
                if u.bool() {
                    self.ack_sent(s);
                }
            }
            25 => {
                let s = self.pick_session(u);
                let keepalive = u.below(4) != 0;
                self.disconnect(s, keepalive);
            }
            26 => {
                self.flush();
                self.now = match u.below(6) {
                    0 => u.u64(),
                    1 => self.now.saturating_sub(u.u32() as u64),
                    2 => self.now.saturating_add(u64::from(u.u32()) * 1000),
                    _ => self.now.saturating_add(u.u16() as u64 * 10),
                };
                let (b, ids) = self.core.tick(self.now);
                for id in &ids {
                    assert!(
                        !self.core.durable_ids().contains(id),
                        "session: expired id still known"
                    );
                }
                self.submit(b, None);
                self.flush();
            }
            27 => {
                let id = pick(u, DURABLE_IDS);
                if let Ok(b) = self.core.close_durable(id) {
                    self.submit(b, None);
                    self.flush();
                }
            }
            28 | 29 => {
                // A typical durable subscriber: connect, register in a common region, ready.
                let hello = DurableHello {
                    redirect_epoch: None,
                    id: pick(u, DURABLE_IDS).to_string(),
                    timeout_secs: 1 + u.below(600) as u64,
                    redundancy: 0,
                    // A single node ignores a failover request.
                    failed_primary: (u.below(4) == 0).then(|| "n1".to_string()),
                    seen: None,
                };
                self.connect(Some(hello), true);
                if let Some(&s) = self.alive.last()
                    && u.below(4) == 0
                {
                    self.client_seen(s, u);
                }
                if let Some(&s) = self.alive.last() {
                    let spec = match u.below(3) {
                        0 => InterestSpec::AllKeys,
                        1 => InterestSpec::Regex("k.*|a".into()),
                        _ => InterestSpec::Keys(vec!["a".into(), "k1".into()]),
                    };
                    let region = REGIONS[u.below(2)];
                    self.register_op(s, region, &spec, u);
                    self.ready(s);
                }
            }
            30 => self.flush(),
            _ => {
                let keep = u.below(4);
                self.crash_and_recover(keep);
            }
        }
        // Sessions whose connection the core no longer knows (expired, dropped) are dead.
        for s in self.alive.clone() {
            if self.core.session(s).is_none() {
                self.end_session(s);
            }
        }
        self.check();
    }
}

/// The session harness: decodes a sequence of operations from the input and applies them to
/// a `NodeCore` with a `MemStore`, checking the invariants after each, including that a put
/// reports `create` exactly when the key is absent from the region store.
pub fn session(data: &[u8]) {
    session_with(data, true);
}

/// [`session`], with the create/update check optional.
pub fn session_with(data: &[u8], check_op_kind: bool) -> SessionStats {
    let mut u = Unstructured::new(data);
    let mut sim = SessionSim::new();
    sim.check_op_kind = check_op_kind;
    let mut n = 0;
    while !u.is_empty() && n < SESSION_OPS_MAX {
        sim.step(&mut u);
        n += 1;
    }
    // Finally: everyone reconnects after a clean flush + crash, and drains everything.
    sim.crash_and_recover(usize::MAX);
    for id in DURABLE_IDS {
        sim.connect(
            Some(DurableHello {
                redirect_epoch: None,
                id: id.to_string(),
                timeout_secs: 60,
                redundancy: 0,
                failed_primary: None,
                seen: None,
            }),
            false,
        );
    }
    for s in sim.alive.clone() {
        sim.ready(s);
        sim.deliver(s, 10_000, usize::MAX);
        sim.check();
    }
    sim.stats.ops = n;
    sim.stats
}

/// What one session run exercised (so tests can tell a meaningful run from a trivial one).
#[derive(Debug, Default, Clone, Copy)]
pub struct SessionStats {
    pub ops: usize,
    pub publishes_ok: usize,
    pub entries_delivered: usize,
    pub flagged_duplicates: usize,
    pub acks_ok: usize,
    pub recoveries: usize,
    pub resumes: usize,
    /// Checks of what a client saw, and how many of them found the queue diverged.
    pub seen_checks: usize,
    pub seen_diverged: usize,
}

/// Runs a harness by target name (for the corpus replay test).
pub fn run(target: &str, data: &[u8]) {
    match target {
        "frame_decoder" => frame_decoder(data),
        "handshake" => handshake(data),
        "session" => session(data),
        other => panic!("unknown fuzz target {other}"),
    }
}

/// Names of the fuzz targets, as directories of `fuzz/corpus/`.
pub const TARGETS: &[&str] = &["frame_decoder", "handshake", "session"];

/// Encodes a client message as a frame (for building seeds).
pub fn frame_of(msg: &ClientMsg) -> Vec<u8> {
    codec::encode_frame(msg).expect("encodes").to_vec()
}

/// A hello frame (for building seeds).
pub fn hello_frame(version: u32, durable: Option<(&str, u64)>) -> Vec<u8> {
    frame_of(&ClientMsg::Hello {
        version,
        durable: durable.map(|(id, t)| DurableHello {
            redirect_epoch: None,
            id: id.into(),
            timeout_secs: t,
            redundancy: 0,
            failed_primary: None,
            seen: None,
        }),
        token: None,
        client: "seed".into(),
        going_away: false,
    })
}

/// A request frame (for building seeds).
pub fn request_frame(body: RequestBody) -> Vec<u8> {
    frame_of(&ClientMsg::Request { id: 1, body })
}
