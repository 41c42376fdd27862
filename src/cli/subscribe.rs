//! `tether subscribe`: one session or a reconnecting subscription, events printed as JSON
//! lines through a buffered writer that formats without allocating per event.
//!
//! The lines go into one buffer, flushed whenever no event is ready, and an event is
//! acknowledged only once its line is written.

use super::*;

/// Where `tether subscribe` reads its events from: one session, or a subscription that
/// reconnects by itself (`--reconnect`). One per process: its size does not matter.
#[allow(clippy::large_enum_variant)]
enum Feed {
    Session { client: Client, events: EventStream },
    Reconnecting(Subscription),
}

impl Feed {
    async fn next(&mut self) -> Option<ClientEvent> {
        match self {
            Feed::Session { events, .. } => events.next().await,
            Feed::Reconnecting(s) => s.next().await,
        }
    }

    /// Why the feed ended by itself.
    fn lost(&self) -> Fail {
        match self {
            Feed::Session { .. } => Fail("the connection to the server was lost".into()),
            Feed::Reconnecting(s) => Fail(match s.ended() {
                Some(e) => format!("the connection to the server was lost: {e}"),
                None => "the connection to the server was lost".into(),
            }),
        }
    }

    /// Acks events as they are written (the subscriber's events are acked by hand).
    fn acker(&self) -> Result<Acker, tether::client::ClientError> {
        match self {
            Feed::Session { events, .. } => events.acker(),
            Feed::Reconnecting(s) => s.acker(),
        }
    }

    fn crash(self) {
        match self {
            Feed::Session { client, .. } => client.crash(),
            Feed::Reconnecting(s) => drop(s),
        }
    }

    async fn close(self, keepalive: bool) -> Result<(), tether::client::ClientError> {
        match self {
            Feed::Session { client, mut events } => {
                events.commit();
                client.close_promptly(keepalive).await
            }
            Feed::Reconnecting(s) => s.close_promptly(keepalive).await,
        }
    }
}

fn print_initial(
    out: &mut Out,
    region: &str,
    policy: ResultPolicy,
    entry: tether::protocol::InitialEntry,
) {
    let value = match policy {
        ResultPolicy::Keys => None,
        _ => entry
            .value
            .map(|v| String::from_utf8_lossy(&v).into_owned()),
    };
    let _ = out.line(&json!({"type":"initial","region":region,"key":entry.key,"value":value}));
}

/// Bytes of lines `tether subscribe` gathers before writing them, whatever comes next.
const OUT_BUFFER_BYTES: usize = 64 * 1024;

/// Events between two looks at the signals while events keep coming without a pause.
const SIGNAL_CHECK_EVENTS: u32 = 1024;

/// The standard output of `tether subscribe`: its lines gathered in one buffer and written
/// with one system call per buffer; event lines formatted straight into it, without an
/// allocation per event (at hundreds of thousands of events a second, building a
/// `serde_json::Value` per event was the subscriber's bottleneck). Events count as processed
/// (and are acked, in the client's manual ack mode) once written, as they did when every
/// line was written at once: a subscriber killed with events in its buffer gets them again.
struct Out {
    buf: Vec<u8>,
    /// The offsets of the events in `buf`, acked once it is written.
    offsets: Vec<u64>,
    acker: Option<Acker>,
}

impl Out {
    fn new() -> Out {
        Out {
            buf: Vec::with_capacity(OUT_BUFFER_BYTES + 4096),
            offsets: Vec::new(),
            acker: None,
        }
    }

    /// One event line: written with the next non-event line, at the next `flush`, or now
    /// when the buffer is full.
    fn event(&mut self, e: &Event) -> std::io::Result<()> {
        event_line(&mut self.buf, e);
        self.offsets.push(e.offset);
        if self.buf.len() >= OUT_BUFFER_BYTES {
            self.flush()
        } else {
            Ok(())
        }
    }

    /// Any other line, written at once after what is buffered.
    fn line(&mut self, v: &Value) -> std::io::Result<()> {
        // As `emit` writes it; writing to a Vec cannot fail.
        let _ = writeln!(self.buf, "{v}");
        self.flush()
    }

    /// Writes what is buffered, then acks its events (the ones of a failed write are not
    /// acked: the server keeps them).
    fn flush(&mut self) -> std::io::Result<()> {
        self.write()?;
        if let Some(a) = &self.acker {
            // Refused only for offsets this process no longer tracks (a queue that expired
            // meanwhile): nothing to ack for them.
            let _ = a.ack_many(&self.offsets);
        }
        self.offsets.clear();
        Ok(())
    }

    /// Writes what is buffered without acking its events (`--crash`: acks are lost as with
    /// a killed process).
    fn write(&mut self) -> std::io::Result<()> {
        if self.buf.is_empty() {
            return Ok(());
        }
        let written = {
            let mut out = std::io::stdout().lock();
            out.write_all(&self.buf).and_then(|()| out.flush())
        };
        self.buf.clear();
        if self.buf.capacity() > 4 * OUT_BUFFER_BYTES {
            // After a huge value: back to the usual size.
            self.buf = Vec::with_capacity(OUT_BUFFER_BYTES + 4096);
        }
        if written.is_err() {
            self.offsets.clear();
        }
        written
    }
}

/// Appends the `event` line of `e` to `buf`: byte for byte the line `emit` printed of
/// `json!({"type":"event","region":…,"key":…,"op":…,"value":…,"offset":…,"event_id":…,
/// "replayed":…,"possible_duplicate":…})` (fields in that order: serde_json keeps insertion
/// order in this build; its string escaping; the value as `String::from_utf8_lossy` reads it,
/// null for destroy and invalidate), without building that value.
fn event_line(buf: &mut Vec<u8>, e: &Event) {
    buf.extend_from_slice(br#"{"type":"event","region":"#);
    json_str(buf, &e.region);
    buf.extend_from_slice(br#","key":"#);
    json_str(buf, &e.key);
    buf.extend_from_slice(br#","op":"#);
    json_str(buf, e.op.as_str());
    buf.extend_from_slice(br#","value":"#);
    match (e.op, &e.value) {
        (EventOp::Create | EventOp::Update, Some(v)) => match std::str::from_utf8(v) {
            Ok(text) => json_str(buf, text),
            Err(_) => json_str(buf, &String::from_utf8_lossy(v)),
        },
        _ => buf.extend_from_slice(b"null"),
    }
    buf.extend_from_slice(br#","offset":"#);
    json_u64(buf, e.offset);
    // The id's text is `NODE-SESSION-SEQ`: the node escaped, the rest is '-' and digits.
    buf.extend_from_slice(br#","event_id":"#);
    json_str(buf, &e.event_id.node);
    buf.pop(); // the closing quote, written again below
    buf.push(b'-');
    json_u64(buf, e.event_id.session);
    buf.push(b'-');
    json_u64(buf, e.event_id.seq);
    buf.extend_from_slice(br#"","replayed":"#);
    json_bool(buf, e.replayed);
    buf.extend_from_slice(br#","possible_duplicate":"#);
    json_bool(buf, e.possible_duplicate);
    buf.extend_from_slice(b"}\n");
}

fn json_bool(buf: &mut Vec<u8>, b: bool) {
    buf.extend_from_slice(if b { b"true".as_slice() } else { b"false" });
}

/// A JSON string, quoted and escaped as serde_json does (through serde_json when there is
/// something to escape; most keys and values have nothing: they are copied as they are).
fn json_str(buf: &mut Vec<u8>, s: &str) {
    if needs_escape(s.as_bytes()) {
        serde_json::to_writer(&mut *buf, s).expect("a string serializes into a Vec");
    } else {
        buf.reserve(s.len() + 2);
        buf.push(b'"');
        buf.extend_from_slice(s.as_bytes());
        buf.push(b'"');
    }
}

/// Whether `bytes` hold a byte a JSON string escapes: a control character (below 0x20), '"'
/// or '\\'. Eight bytes at a time: a byte below `n` (`n` ≤ 0x80) leaves its high bit set in
/// `(x - n·ONES) & !x` (a borrow can mark a byte above it too, never hide one), and a byte
/// equal to `c` is a zero byte of `x ^ c·ONES`.
fn needs_escape(bytes: &[u8]) -> bool {
    const ONES: u64 = 0x0101_0101_0101_0101;
    const HIGH: u64 = 0x8080_8080_8080_8080;
    let below = |x: u64, n: u64| x.wrapping_sub(n * ONES) & !x & HIGH;
    let mut words = bytes.chunks_exact(8);
    for w in &mut words {
        let x = u64::from_le_bytes(w.try_into().expect("eight bytes"));
        let hits = below(x, 0x20)
            | below(x ^ (u64::from(b'"') * ONES), 1)
            | below(x ^ (u64::from(b'\\') * ONES), 1);
        if hits != 0 {
            return true;
        }
    }
    words
        .remainder()
        .iter()
        .any(|&b| b < 0x20 || b == b'"' || b == b'\\')
}

fn json_u64(buf: &mut Vec<u8>, n: u64) {
    serde_json::to_writer(&mut *buf, &n).expect("a number serializes into a Vec");
}

/// Polls `f` once: its output if it is ready now, without waiting (`f` goes on from there
/// when polled again).
async fn poll_once<F: std::future::Future>(mut f: std::pin::Pin<&mut F>) -> Poll<F::Output> {
    std::future::poll_fn(|cx| Poll::Ready(f.as_mut().poll(cx))).await
}

/// Whether `signal` arrived (since the last look), without waiting.
async fn signalled(signal: &mut tokio::signal::unix::Signal) -> bool {
    std::future::poll_fn(|cx| Poll::Ready(signal.poll_recv(cx).is_ready())).await
}

pub(super) async fn subscribe(a: SubscribeArgs) -> Result<(), Fail> {
    // The arguments' values were checked by the parser.
    let policy: ResultPolicy = a.policy.into();
    let durable = a.durable_id.is_some();
    let keepalive = match a.close {
        None => durable,
        Some(CloseArg::Keepalive) => true,
        Some(CloseArg::Drop) => false,
    };
    let mut builder = client_builder(
        &a.conn,
        a.durable_id.clone().map(|id| (id, a.timeout, a.redundancy)),
        a.ack_interval_ms,
    )?
    // An event is processed once its line is written (`Out`), not once the next is read.
    .ack_mode(AckMode::Manual)
    .replay_rate(a.replay_rate);
    if let Some(ms) = a.failure_timeout_ms {
        builder = builder.failure_timeout(Duration::from_millis(ms));
    }
    let mut interests: Vec<Interest> = a.key.iter().map(Interest::key).collect();
    interests.extend(a.regex.iter().map(Interest::regex));
    if a.all_keys {
        interests.push(Interest::all_keys());
    }
    let interests: Vec<Interest> = interests
        .into_iter()
        .map(|i| {
            i.durable(durable && !a.non_durable)
                .policy(policy)
                .receive_values(!a.no_values)
        })
        .collect();
    // A non-durable client has nothing to replay: with no interest to register it is live at
    // once (with interest, the server's marker follows the registration).
    let announce_live = interests.is_empty() && !durable;
    let mut out = Out::new();
    let connected = |out: &mut Out, c: &Client| {
        let _ = out.line(&json!({
            "type": "connected",
            "durable_id": a.durable_id,
            "queue": c.queue_status().as_str(),
            "pending": c.pending(),
            "primary": c.server_addr().to_string(),
        }));
    };
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    let mut feed = if a.reconnect {
        let give_up = (a.reconnect_max_secs > 0).then(|| Duration::from_secs(a.reconnect_max_secs));
        let mut sub = builder
            .reconnect(ReconnectPolicy {
                give_up_after: give_up,
                ..ReconnectPolicy::default()
            })
            .subscribe(interests.into_iter().map(|i| (a.region.clone(), i)))
            .await?;
        connected(
            &mut out,
            sub.client().expect("a new subscription is connected"),
        );
        for (region, entry) in sub.take_initial() {
            print_initial(&mut out, &region, policy, entry);
        }
        Feed::Reconnecting(sub)
    } else {
        let c = builder.connect().await?;
        connected(&mut out, &c);
        let setup = async {
            let region = c.region(&a.region);
            let events = c.events()?;
            for i in interests {
                for entry in region.register(i).await? {
                    print_initial(&mut out, &a.region, policy, entry);
                }
            }
            if !a.no_ready {
                if a.ready_delay_ms > 0 {
                    tokio::time::sleep(Duration::from_millis(a.ready_delay_ms)).await;
                }
                if durable {
                    c.ready_for_events().await?;
                }
            }
            Ok::<_, Fail>(events)
        }
        .await;
        match setup {
            Ok(events) => Feed::Session { client: c, events },
            Err(e) => {
                // Close (a durable queue is kept, as after a lost connection) rather than
                // leave the connection to the server's idle timeout.
                let _ = c.close_promptly(durable).await;
                return Err(e);
            }
        }
    };
    out.acker = Some(feed.acker()?);
    let idle = a.idle_exit_ms.map(Duration::from_millis);
    let mut printed = 0u64;
    let mut lost = false;
    // Standard output failed: stop, leaving what was not written to the queue.
    let mut broken: Option<std::io::Error> = None;
    let mut done = false;
    if announce_live {
        if let Err(e) = out.line(&json!({"type":"live","region":a.region})) {
            broken = Some(e);
        }
        done = a.exit_on_live;
    }
    if done || broken.is_some() {
        // `--exit-on-live` with nothing to replay: done already.
    } else {
        // Listened for from here on (before, ctrl-c ends the process as usual).
        let mut interrupt =
            tokio::signal::unix::signal(tokio::signal::unix::SignalKind::interrupt())?;
        let mut until_signal_check = SIGNAL_CHECK_EVENTS;
        loop {
            if a.max_events.is_some_and(|m| printed >= m) {
                break;
            }
            if until_signal_check == 0 {
                // Events keep coming without a pause: the signals are looked at all the same.
                until_signal_check = SIGNAL_CHECK_EVENTS;
                if signalled(&mut interrupt).await || signalled(&mut term).await {
                    break;
                }
            }
            let next = feed.next();
            tokio::pin!(next);
            // What is ready now is printed without waiting, into the buffer; when nothing is
            // ready, the buffer is written before waiting: an event reaches standard output
            // as soon as the subscriber has nothing else to do.
            let ev = match poll_once(next.as_mut()).await {
                Poll::Ready(ev) => {
                    until_signal_check -= 1;
                    Some(ev)
                }
                Poll::Pending => {
                    if let Err(e) = out.flush() {
                        broken = Some(e);
                        break;
                    }
                    let wait = async {
                        match idle {
                            Some(d) => tokio::time::timeout(d, next.as_mut()).await.ok(),
                            None => Some(next.as_mut().await),
                        }
                    };
                    tokio::select! {
                        ev = wait => ev,
                        _ = interrupt.recv() => break,
                        _ = term.recv() => break,
                    }
                }
            };
            let written = match ev {
                None => break, // idle timeout
                Some(None) => {
                    lost = true;
                    break;
                }
                Some(Some(ClientEvent::Live { regions })) => {
                    // The marker that ends the replay lists no region when the queue had no
                    // interest: the session is live all the same, for the subscriber's region.
                    let mut written = Ok(());
                    if regions.is_empty() {
                        written = out.line(&json!({"type":"live","region":a.region}));
                    }
                    for region in &regions {
                        written = written
                            .and_then(|()| out.line(&json!({"type":"live","region":region})));
                    }
                    if a.exit_on_live && written.is_ok() {
                        break;
                    }
                    written
                }
                Some(Some(ClientEvent::Disconnected { error })) => {
                    out.line(&json!({"type":"disconnected","error":error}))
                }
                Some(Some(ClientEvent::Reconnected { queue, pending })) => out
                    .line(&json!({"type":"reconnected","queue":queue.as_str(),"pending":pending})),
                Some(Some(ClientEvent::Event(e))) => {
                    printed += 1;
                    out.event(&e)
                }
            };
            if let Err(e) = written {
                broken = Some(e);
                break;
            }
        }
    }
    // Everything printed is written before the process goes on to close or exits.
    let written = if a.crash { out.write() } else { out.flush() };
    if let Err(e) = written {
        broken.get_or_insert(e);
    }
    if a.crash {
        feed.crash();
        return Ok(());
    }
    if lost {
        return Err(feed.lost());
    }
    feed.close(keepalive).await?;
    if let Some(e) = broken {
        return Err(Fail(format!("cannot write to standard output: {e}")));
    }
    let _ = out.line(&json!({"type":"closed","keepalive":keepalive}));
    Ok(())
}

#[cfg(test)]
mod event_line_tests {
    use super::*;
    use proptest::prelude::*;
    use tether::protocol::EventId;

    /// The line `tether subscribe` printed for an event before `event_line`: a `json!` value
    /// per event, printed by `emit`.
    fn old_line(e: &Event) -> String {
        let e = e.clone();
        let value = match e.op {
            EventOp::Create | EventOp::Update => {
                e.value.map(|v| String::from_utf8_lossy(&v).into_owned())
            }
            _ => None,
        };
        let v = json!({
            "type": "event",
            "region": e.region,
            "key": e.key,
            "op": e.op.as_str(),
            "value": value,
            "offset": e.offset,
            "event_id": e.event_id.to_string(),
            "replayed": e.replayed,
            "possible_duplicate": e.possible_duplicate,
        });
        format!("{v}\n")
    }

    fn new_line(e: &Event) -> String {
        let mut buf = Vec::new();
        event_line(&mut buf, e);
        String::from_utf8(buf).expect("UTF-8")
    }

    fn event(
        region: &str,
        key: &str,
        op: EventOp,
        value: Option<&[u8]>,
        node: &str,
        numbers: (u64, u64, u64),
    ) -> Event {
        Event {
            region: region.into(),
            key: key.into(),
            op,
            value: value.map(<[u8]>::to_vec),
            offset: numbers.0,
            event_id: EventId {
                node: node.into(),
                session: numbers.1,
                seq: numbers.2,
            },
            replayed: numbers.0.is_multiple_of(2),
            possible_duplicate: numbers.1.is_multiple_of(3),
        }
    }

    #[test]
    fn the_contract_line() {
        let e = event("R", "K", EventOp::Update, Some(b"V"), "n1", (17, 3, 42));
        let line = new_line(&Event {
            replayed: true,
            possible_duplicate: false,
            ..e
        });
        // docs/cli.md, tether subscribe, line 3.
        assert_eq!(
            line,
            "{\"type\":\"event\",\"region\":\"R\",\"key\":\"K\",\"op\":\"update\",\"value\":\"V\",\"offset\":17,\"event_id\":\"n1-3-42\",\"replayed\":true,\"possible_duplicate\":false}\n"
        );
    }

    #[test]
    fn edge_cases_match_the_old_line() {
        let ops = [
            EventOp::Create,
            EventOp::Update,
            EventOp::Destroy,
            EventOp::Invalidate,
        ];
        let texts = [
            "",
            "\"",
            "\\",
            "\u{0}\u{1}\u{8}\t\n\u{b}\u{c}\r\u{1f}\u{7f}",
            "é€😀\u{2028}\u{2029}",
            "</script>",
        ];
        let values: [Option<&[u8]>; 6] = [
            None,
            Some(b""),
            Some(b"\xff\xfe"),
            Some(b"ok \xc3"),
            Some(b"\xed\xa0\x80 surrogate"),
            Some("\"quoted\"\n".as_bytes()),
        ];
        for op in ops {
            for t in texts {
                for v in values {
                    for numbers in [(0, 0, 0), (u64::MAX, u64::MAX, u64::MAX), (1, 10, 100)] {
                        let e = event(t, t, op, v, t, numbers);
                        assert_eq!(new_line(&e), old_line(&e), "{e:?}");
                    }
                }
            }
        }
    }

    #[test]
    fn needs_escape_finds_every_byte_json_escapes() {
        // Each byte value, at each position of a word and in the tail, among bytes that need
        // no escape (ASCII letters and the bytes of non-ASCII characters).
        for b in 0..=255u8 {
            let want = b < 0x20 || b == b'"' || b == b'\\';
            for len in 1..=19 {
                for at in 0..len {
                    for filler in [b'a', 0x80, 0xff, 0x21] {
                        let mut bytes = vec![filler; len];
                        bytes[at] = b;
                        assert_eq!(needs_escape(&bytes), want, "{b:#x} at {at} of {len}");
                    }
                }
            }
        }
        assert!(!needs_escape(b""));
    }

    fn any_op() -> impl Strategy<Value = EventOp> {
        prop_oneof![
            Just(EventOp::Create),
            Just(EventOp::Update),
            Just(EventOp::Destroy),
            Just(EventOp::Invalidate),
        ]
    }

    /// Values: arbitrary bytes (mostly not UTF-8), and text with escapes and non-ASCII.
    fn any_value() -> impl Strategy<Value = Option<Vec<u8>>> {
        prop_oneof![
            Just(None),
            proptest::collection::vec(any::<u8>(), 0..64).prop_map(Some),
            "[\\x00-\\x7f\"\\\\é😀]{0,40}".prop_map(|s| Some(s.into_bytes())),
            any::<String>().prop_map(|s| Some(s.into_bytes())),
        ]
    }

    /// Text with control characters, quotes and backslashes often, any character sometimes.
    fn any_text() -> impl Strategy<Value = String> {
        prop_oneof!["[\\x00-\\x7f\"\\\\é😀]{0,24}", any::<String>()]
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(4096))]

        #[test]
        fn every_event_line_is_the_old_line(
            region in any_text(),
            key in any_text(),
            op in any_op(),
            value in any_value(),
            node in any_text(),
            offset in any::<u64>(),
            session in any::<u64>(),
            seq in any::<u64>(),
            replayed in any::<bool>(),
            possible_duplicate in any::<bool>(),
        ) {
            let e = Event {
                region,
                key,
                op,
                value,
                offset,
                event_id: EventId { node, session, seq },
                replayed,
                possible_duplicate,
            };
            prop_assert_eq!(new_line(&e), old_line(&e));
        }
    }
}
