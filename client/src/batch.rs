//! Events handed to the application a delivery frame at a time, without an allocation per
//! event ([`EventStream::next_batch`](crate::EventStream::next_batch)).
//!
//! The delivery task decodes each entry's record once, in place, and keeps only where its
//! fields lie in the received frame ([`EntryIndex`]); an [`EventBatch`] holds the frame and those
//! positions, and its [`EventView`]s borrow their strings and values from it. The owned
//! [`Event`]s of [`EventStream::next`](crate::EventStream::next) are built from the same views,
//! on the application's side of the stream (so they are allocated and freed on one thread).

use bytes::Bytes;

use crate::protocol::{
    EventId, EventIdRef, EventOp, EventRecordRef, FLAG_NO_VALUE, FLAG_POSSIBLE_DUPLICATE,
    FLAG_REPLAYED,
};
use crate::{ClientEvent, Event};

/// A byte range of a frame.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Span {
    start: u32,
    end: u32,
}

/// Where one event's fields lie in its delivery frame: checked (CBOR and UTF-8) when the frame
/// was decoded, so reading them back cannot fail.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct EntryIndex {
    offset: u64,
    op: EventOp,
    flags: u8,
    region: Span,
    key: Span,
    value: Option<Span>,
    node: Span,
    session: u64,
    seq: u64,
}

impl EntryIndex {
    /// Indexes `record`, the stored record of the entry at `offset` with wire `flags`, lying
    /// inside `frame`. `None` if the record does not decode or does not lie inside the frame.
    pub(crate) fn new(frame: &[u8], offset: u64, flags: u8, record: &[u8]) -> Option<EntryIndex> {
        let r: EventRecordRef<'_> = tether_transport::codec::decode_body(record).ok()?;
        let span = |part: &[u8]| -> Option<Span> {
            let start = (part.as_ptr() as usize).checked_sub(frame.as_ptr() as usize)?;
            let end = start.checked_add(part.len())?;
            (end <= frame.len()).then_some(())?;
            Some(Span {
                start: u32::try_from(start).ok()?,
                end: u32::try_from(end).ok()?,
            })
        };
        // An interest without values gets creates and updates as invalidates, without value.
        let (op, value) = match r.op {
            EventOp::Create | EventOp::Update if flags & FLAG_NO_VALUE != 0 => {
                (EventOp::Invalidate, None)
            }
            op => (op, r.value),
        };
        Some(EntryIndex {
            offset,
            op,
            flags,
            region: span(r.region.as_bytes())?,
            key: span(r.key.as_bytes())?,
            value: match value {
                Some(v) => Some(span(v)?),
                None => None,
            },
            node: span(r.id.node.as_bytes())?,
            session: r.id.session,
            seq: r.id.seq,
        })
    }
}

/// One event of an [`EventBatch`], borrowing from the batch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct EventView<'a> {
    pub region: &'a str,
    pub key: &'a str,
    pub op: EventOp,
    pub value: Option<&'a [u8]>,
    pub offset: u64,
    pub event_id: EventIdRef<'a>,
    /// Queued before the client said it was ready.
    pub replayed: bool,
    /// Sent to this durable id before and not acknowledged.
    pub possible_duplicate: bool,
}

impl EventView<'_> {
    /// The event as an owned [`Event`].
    pub fn to_event(&self) -> Event {
        Event {
            region: self.region.to_owned(),
            key: self.key.to_owned(),
            op: self.op,
            value: self.value.map(<[u8]>::to_vec),
            offset: self.offset,
            event_id: self.event_id.to_event_id(),
            replayed: self.replayed,
            possible_duplicate: self.possible_duplicate,
        }
    }
}

/// Consecutive events of one delivery frame, in offset order; [`EventBatch::iter`] reads them
/// in place. Holds the frame (at most a frame's bytes) until dropped.
#[derive(Clone, Debug)]
pub struct EventBatch {
    frame: Bytes,
    entries: Vec<EntryIndex>,
}

impl EventBatch {
    pub(crate) fn new(frame: Bytes, entries: Vec<EntryIndex>) -> Self {
        EventBatch { frame, entries }
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// The `i`-th event.
    pub fn get(&self, i: usize) -> Option<EventView<'_>> {
        self.entries.get(i).map(|e| self.view(e))
    }

    /// The events, in offset order.
    pub fn iter(&self) -> impl ExactSizeIterator<Item = EventView<'_>> + '_ {
        self.entries.iter().map(|e| self.view(e))
    }

    /// Offset of the batch's last event.
    pub fn last_offset(&self) -> Option<u64> {
        self.entries.last().map(|e| e.offset)
    }

    /// The events' offsets, in order.
    pub fn offsets(&self) -> impl ExactSizeIterator<Item = u64> + '_ {
        self.entries.iter().map(|e| e.offset)
    }

    /// Drops the first `n` events.
    pub(crate) fn skip(&mut self, n: usize) {
        self.entries.drain(..n.min(self.entries.len()));
    }

    /// The newest event's id.
    pub(crate) fn last_event_id(&self) -> Option<EventId> {
        self.get(self.len().checked_sub(1)?)
            .map(|v| v.event_id.to_event_id())
    }

    fn str_at(&self, s: Span) -> &str {
        std::str::from_utf8(self.bytes_at(s))
            .expect("checked as UTF-8 when the frame was decoded (EntryIndex::new)")
    }

    fn bytes_at(&self, s: Span) -> &[u8] {
        &self.frame[s.start as usize..s.end as usize]
    }

    fn view(&self, e: &EntryIndex) -> EventView<'_> {
        EventView {
            region: self.str_at(e.region),
            key: self.str_at(e.key),
            op: e.op,
            value: e.value.map(|s| self.bytes_at(s)),
            offset: e.offset,
            event_id: EventIdRef {
                node: self.str_at(e.node),
                session: e.session,
                seq: e.seq,
            },
            replayed: e.flags & FLAG_REPLAYED != 0,
            possible_duplicate: e.flags & FLAG_POSSIBLE_DUPLICATE != 0,
        }
    }
}

/// What [`EventStream::next_batch`](crate::EventStream::next_batch) yields: the events of a
/// delivery frame (or what is left of them), or one of the stream's other items (never
/// [`ClientEvent::Event`]).
#[derive(Clone, Debug)]
pub enum StreamBatch {
    Events(EventBatch),
    Other(ClientEvent),
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::{EventRecord, FLAG_NO_VALUE, FLAG_REPLAYED};

    fn record(key: &str, value: Option<&[u8]>) -> EventRecord {
        EventRecord {
            id: EventId {
                node: "n1".into(),
                session: 7,
                seq: 9,
            },
            region: "orders".into(),
            key: key.into(),
            op: EventOp::Update,
            value: value.map(<[u8]>::to_vec),
        }
    }

    type Encode = fn(&EventRecord) -> Result<Vec<u8>, tether_transport::codec::CodecError>;
    /// How records are stored (packed: fields by index) and the named form.
    const ENCODINGS: [Encode; 2] = [
        tether_transport::codec::encode_body_packed::<EventRecord>,
        tether_transport::codec::encode_body::<EventRecord>,
    ];

    /// A frame holding the encoded records back to back (what a delivery frame's entries are,
    /// between their CBOR headers).
    fn frame_of(records: &[EventRecord], encode: Encode) -> (Bytes, Vec<(usize, usize)>) {
        let mut frame = vec![0xffu8; 3];
        let mut spans = Vec::new();
        for r in records {
            let body = encode(r).unwrap();
            spans.push((frame.len(), frame.len() + body.len()));
            frame.extend_from_slice(&body);
        }
        (Bytes::from(frame), spans)
    }

    #[test]
    fn a_view_reads_what_the_owned_decoding_reads() {
        let records = [
            record("k-1", Some(b"v1")),
            record("ключ", None),
            record("", Some(b"")),
        ];
        for encode in ENCODINGS {
            check_views(&records, encode);
        }
    }

    fn check_views(records: &[EventRecord], encode: Encode) {
        let (frame, spans) = frame_of(records, encode);
        let entries: Vec<EntryIndex> = spans
            .iter()
            .enumerate()
            .map(|(i, &(a, b))| {
                EntryIndex::new(&frame, 10 + i as u64, FLAG_REPLAYED, &frame[a..b]).unwrap()
            })
            .collect();
        let batch = EventBatch::new(frame, entries);
        assert_eq!(batch.len(), 3);
        assert_eq!(batch.last_offset(), Some(12));
        for (i, (view, r)) in batch.iter().zip(records).enumerate() {
            let e = view.to_event();
            assert_eq!(e.offset, 10 + i as u64);
            assert_eq!(e.region, r.region);
            assert_eq!(e.key, r.key);
            assert_eq!(e.value, r.value);
            assert_eq!(e.event_id, r.id);
            assert_eq!(e.op, EventOp::Update);
            assert!(e.replayed && !e.possible_duplicate);
        }
        assert_eq!(batch.last_event_id(), Some(records[2].id.clone()));
    }

    #[test]
    fn an_interest_without_values_sees_an_invalidate_without_value() {
        let (frame, spans) = frame_of(&[record("k", Some(b"v"))], ENCODINGS[0]);
        let (a, b) = spans[0];
        let e = EntryIndex::new(&frame, 1, FLAG_NO_VALUE, &frame[a..b]).unwrap();
        let batch = EventBatch::new(frame, vec![e]);
        let v = batch.get(0).unwrap();
        assert_eq!((v.op, v.value), (EventOp::Invalidate, None));
    }

    #[test]
    fn a_record_that_does_not_decode_or_lies_outside_the_frame_is_refused() {
        let (frame, spans) = frame_of(&[record("k", Some(b"v"))], ENCODINGS[0]);
        let (a, b) = spans[0];
        assert!(EntryIndex::new(&frame, 1, 0, &frame[a..b - 1]).is_none());
        assert!(EntryIndex::new(&frame, 1, 0, &frame[..2]).is_none());
        // The same bytes, but not inside this frame.
        let elsewhere = frame[a..b].to_vec();
        assert!(EntryIndex::new(&frame, 1, 0, &elsewhere).is_none());
    }
}
