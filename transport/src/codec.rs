//! Framed CBOR codec.
//!
//! A frame is a [`FRAME_HEADER_BYTES`]-byte big-endian `u32` body length followed by the body,
//! which is one CBOR-encoded value. No body may exceed [`FRAME_BYTES_MAX`] bytes.
//!
//! This is the only module in Tether that touches `serde_cbor`; everything else goes through
//! [`encode_body`]/[`decode_body`] (also used for records stored on disk) or the frame helpers.
//! [`FrameDecoder`] is a sans-IO decoder, and [`FrameReader`] drives it from a quinn stream.

use bytes::{BufMut, Bytes, BytesMut};

/// Hard limit on the size of one frame body, in bytes.
pub const FRAME_BYTES_MAX: usize = 8 * 1024 * 1024;

/// Size of the frame header: a big-endian `u32` body length.
pub const FRAME_HEADER_BYTES: usize = 4;

/// Largest chunk [`FrameReader`] asks quinn for in one read.
pub const READ_CHUNK_BYTES_MAX: usize = 256 * 1024;

/// Errors from encoding or decoding frames and bodies.
#[derive(Debug, thiserror::Error)]
pub enum CodecError {
    /// A frame body is (or is announced to be) larger than the limit.
    #[error("frame of {size} bytes exceeds the limit of {max} bytes")]
    TooLarge {
        /// Size of the body, as encoded or as announced by the header.
        size: usize,
        /// The limit, normally [`FRAME_BYTES_MAX`].
        max: usize,
    },
    /// The body is not valid CBOR for the expected type (or a value could not be encoded).
    #[error("malformed frame: {0}")]
    Malformed(String),
    /// The stream ended part way through a frame.
    #[error("stream ended inside a frame ({have} of {need} bytes)")]
    Truncated {
        /// Bytes needed to complete the frame (header included).
        need: usize,
        /// Bytes actually received for the frame (header included).
        have: usize,
    },
    /// The underlying stream failed (reset, connection lost, ...).
    #[error("stream error: {0}")]
    Stream(String),
}

impl CodecError {
    /// The [`ErrorCode`](crate::ErrorCode) that best describes this error when reporting it to a peer.
    pub fn code(&self) -> crate::ErrorCode {
        use crate::ErrorCode;
        match self {
            CodecError::TooLarge { .. } => ErrorCode::FrameTooLarge,
            CodecError::Malformed(_) | CodecError::Truncated { .. } => ErrorCode::MalformedFrame,
            CodecError::Stream(_) => ErrorCode::ClosedByPeer,
        }
    }
}

/// Encodes `msg` as plain CBOR (no frame header). Also used for records stored on disk.
pub fn encode_body<T: serde::Serialize>(msg: &T) -> Result<Vec<u8>, CodecError> {
    serde_cbor::to_vec(msg).map_err(|e| CodecError::Malformed(format!("encode: {e}")))
}

/// Encodes `msg` as *packed* CBOR: struct fields and enum variants by index instead of by
/// name. Smaller and faster to decode; [`decode_body`] reads both forms. Used for event
/// records (stored and shipped as is) and delivery frames, so for those types the order of
/// fields and variants is part of the format: only append.
pub fn encode_body_packed<T: serde::Serialize>(msg: &T) -> Result<Vec<u8>, CodecError> {
    serde_cbor::ser::to_vec_packed(msg).map_err(|e| CodecError::Malformed(format!("encode: {e}")))
}

/// Decodes one CBOR value from `body`, which must contain exactly that value.
///
/// Never panics, whatever the input: bad input gives [`CodecError::Malformed`].
pub fn decode_body<'a, T: serde::Deserialize<'a>>(body: &'a [u8]) -> Result<T, CodecError> {
    serde_cbor::from_slice(body).map_err(|e| CodecError::Malformed(e.to_string()))
}

/// Encodes `msg` as one frame (header + body).
///
/// Returns [`CodecError::TooLarge`] if the body exceeds [`FRAME_BYTES_MAX`].
pub fn encode_frame<T: serde::Serialize>(msg: &T) -> Result<Bytes, CodecError> {
    let mut buf = BytesMut::new();
    encode_frame_into(msg, &mut buf)?;
    Ok(buf.freeze())
}

/// Appends one frame (header + body) encoding `msg` to `buf`, for batching many frames in one write.
///
/// On error `buf` is left as it was.
pub fn encode_frame_into<T: serde::Serialize>(
    msg: &T,
    buf: &mut BytesMut,
) -> Result<(), CodecError> {
    frame_into(msg, buf, false)
}

/// [`encode_frame_into`] with a packed body (see [`encode_body_packed`]).
pub fn encode_frame_packed_into<T: serde::Serialize>(
    msg: &T,
    buf: &mut BytesMut,
) -> Result<(), CodecError> {
    frame_into(msg, buf, true)
}

fn frame_into<T: serde::Serialize>(
    msg: &T,
    buf: &mut BytesMut,
    packed: bool,
) -> Result<(), CodecError> {
    let start = buf.len();
    buf.put_u32(0);
    let mut ser = serde_cbor::Serializer::new(serde_cbor::ser::IoWrite::new((&mut *buf).writer()));
    if packed {
        ser = ser.packed_format();
    }
    let res = msg.serialize(&mut ser);
    if let Err(e) = res {
        buf.truncate(start);
        return Err(CodecError::Malformed(format!("encode: {e}")));
    }
    let size = buf.len() - start - FRAME_HEADER_BYTES;
    if size > FRAME_BYTES_MAX {
        buf.truncate(start);
        return Err(CodecError::TooLarge {
            size,
            max: FRAME_BYTES_MAX,
        });
    }
    // size <= FRAME_BYTES_MAX < u32::MAX, so the cast is lossless.
    buf[start..start + FRAME_HEADER_BYTES].copy_from_slice(&(size as u32).to_be_bytes());
    Ok(())
}

/// Encodes `msg` as one frame and writes it to `send`.
pub async fn write_frame<T: serde::Serialize>(
    send: &mut quinn::SendStream,
    msg: &T,
) -> Result<(), CodecError> {
    let frame = encode_frame(msg)?;
    write_raw(send, frame).await
}

/// Writes already-encoded bytes (one or more frames, e.g. built with [`encode_frame_into`]) to `send`.
pub async fn write_raw(send: &mut quinn::SendStream, frames: Bytes) -> Result<(), CodecError> {
    send.write_chunk(frames)
        .await
        .map_err(|e| CodecError::Stream(e.to_string()))
}

/// Sans-IO frame decoder: push bytes in, take complete frame bodies out.
///
/// Once it has returned an error it is poisoned: it drops further input and returns the
/// same kind of error again.
#[derive(Debug)]
pub struct FrameDecoder {
    buf: BytesMut,
    max: usize,
    failed: Option<usize>,
}

impl Default for FrameDecoder {
    fn default() -> Self {
        Self::new()
    }
}

impl FrameDecoder {
    /// A decoder enforcing [`FRAME_BYTES_MAX`].
    pub fn new() -> Self {
        Self::with_max(FRAME_BYTES_MAX)
    }

    /// A decoder enforcing a custom body limit (at most [`FRAME_BYTES_MAX`] is sensible).
    pub fn with_max(max: usize) -> Self {
        Self {
            buf: BytesMut::new(),
            max,
            failed: None,
        }
    }

    /// Changes the body limit for the frames still to come (a connection's first frame may be
    /// held to a smaller limit than the rest).
    pub fn set_max(&mut self, max: usize) {
        self.max = max;
    }

    /// Appends received bytes. Ignored once the decoder has failed.
    pub fn push(&mut self, data: &[u8]) {
        if self.failed.is_none() {
            self.buf.extend_from_slice(data);
        }
    }

    /// Number of bytes buffered but not yet returned as frames.
    pub fn buffered(&self) -> usize {
        self.buf.len()
    }

    /// Whether the buffer is at a frame boundary (nothing partial is buffered).
    pub fn is_empty(&self) -> bool {
        self.buf.is_empty()
    }

    /// The next complete frame body, `Ok(None)` if more bytes are needed, or
    /// [`CodecError::TooLarge`] as soon as a header announces more than the limit.
    pub fn next_raw(&mut self) -> Result<Option<Bytes>, CodecError> {
        if let Some(size) = self.failed {
            return Err(CodecError::TooLarge {
                size,
                max: self.max,
            });
        }
        if self.buf.len() < FRAME_HEADER_BYTES {
            return Ok(None);
        }
        let mut header = [0u8; FRAME_HEADER_BYTES];
        header.copy_from_slice(&self.buf[..FRAME_HEADER_BYTES]);
        let size = u32::from_be_bytes(header) as usize;
        if size > self.max {
            self.failed = Some(size);
            self.buf = BytesMut::new();
            return Err(CodecError::TooLarge {
                size,
                max: self.max,
            });
        }
        let need = FRAME_HEADER_BYTES + size;
        if self.buf.len() < need {
            // Room for what comes next, but never for more than one read ahead of the data:
            // a header alone must not make the decoder hold the size it announces.
            self.buf
                .reserve((need - self.buf.len()).min(READ_CHUNK_BYTES_MAX));
            return Ok(None);
        }
        let mut frame = self.buf.split_to(need);
        let body = frame.split_off(FRAME_HEADER_BYTES);
        Ok(Some(body.freeze()))
    }

    /// The next complete frame decoded as `T` (see [`next_raw`](Self::next_raw)).
    #[allow(clippy::should_implement_trait)]
    pub fn next<T: serde::de::DeserializeOwned>(&mut self) -> Result<Option<T>, CodecError> {
        match self.next_raw()? {
            Some(body) => decode_body(&body).map(Some),
            None => Ok(None),
        }
    }

    /// Call when the input has ended: `Ok(())` at a frame boundary, otherwise
    /// [`CodecError::Truncated`]. Complete frames must have been drained with `next_raw` first.
    pub fn finish(&self) -> Result<(), CodecError> {
        if let Some(size) = self.failed {
            return Err(CodecError::TooLarge {
                size,
                max: self.max,
            });
        }
        let have = self.buf.len();
        if have == 0 {
            return Ok(());
        }
        let need = if have < FRAME_HEADER_BYTES {
            FRAME_HEADER_BYTES
        } else {
            let mut header = [0u8; FRAME_HEADER_BYTES];
            header.copy_from_slice(&self.buf[..FRAME_HEADER_BYTES]);
            FRAME_HEADER_BYTES + u32::from_be_bytes(header) as usize
        };
        Err(CodecError::Truncated { need, have })
    }
}

/// Reads frames from a quinn receive stream.
#[derive(Debug)]
pub struct FrameReader {
    recv: quinn::RecvStream,
    decoder: FrameDecoder,
    ended: bool,
}

impl FrameReader {
    /// Wraps a receive stream.
    pub fn new(recv: quinn::RecvStream) -> Self {
        Self {
            recv,
            decoder: FrameDecoder::new(),
            ended: false,
        }
    }

    /// Wraps a receive stream whose frames may be at most `max` bytes (see
    /// [`set_max`](Self::set_max)).
    pub fn with_max(recv: quinn::RecvStream, max: usize) -> Self {
        Self {
            recv,
            decoder: FrameDecoder::with_max(max),
            ended: false,
        }
    }

    /// Changes the body limit for the frames still to come.
    pub fn set_max(&mut self, max: usize) {
        self.decoder.set_max(max);
    }

    /// The underlying stream (e.g. to `stop` it with an error code).
    pub fn get_mut(&mut self) -> &mut quinn::RecvStream {
        &mut self.recv
    }

    /// Gives back the underlying stream; bytes buffered but not yet returned are lost.
    pub fn into_inner(self) -> quinn::RecvStream {
        self.recv
    }

    /// Next frame body decoded as `T`.
    ///
    /// `Ok(None)` on a clean end of stream at a frame boundary; [`CodecError::Truncated`] if the
    /// stream ends inside a frame; [`CodecError::TooLarge`] as soon as a header announces more
    /// than [`FRAME_BYTES_MAX`] (before reading the body); [`CodecError::Malformed`] on bad CBOR.
    pub async fn next<T: serde::de::DeserializeOwned>(&mut self) -> Result<Option<T>, CodecError> {
        match self.next_raw().await? {
            Some(body) => decode_body(&body).map(Some),
            None => Ok(None),
        }
    }

    /// Like [`next`](Self::next) but returns the raw body bytes (for callers that decode lazily).
    pub async fn next_raw(&mut self) -> Result<Option<Bytes>, CodecError> {
        loop {
            if let Some(body) = self.decoder.next_raw()? {
                return Ok(Some(body));
            }
            if self.ended {
                self.decoder.finish()?;
                return Ok(None);
            }
            match self.recv.read_chunk(READ_CHUNK_BYTES_MAX, true).await {
                Ok(Some(chunk)) => self.decoder.push(&chunk.bytes),
                Ok(None) => self.ended = true,
                Err(e) => return Err(CodecError::Stream(e.to_string())),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_header_alone_does_not_reserve_the_size_it_announces() {
        let mut d = FrameDecoder::new();
        d.push(&((FRAME_BYTES_MAX as u32).to_be_bytes()));
        assert!(d.next_raw().unwrap().is_none());
        assert!(
            d.buf.capacity() <= 2 * READ_CHUNK_BYTES_MAX,
            "{} bytes held for a header",
            d.buf.capacity()
        );
        // A smaller limit for what comes next (a hello) refuses a big header at once.
        let mut d = FrameDecoder::new();
        d.set_max(1024);
        d.push(&(2048u32.to_be_bytes()));
        assert!(matches!(
            d.next_raw(),
            Err(CodecError::TooLarge {
                size: 2048,
                max: 1024
            })
        ));
    }

    #[test]
    fn roundtrip_single() {
        let frame = encode_frame(&("hi", 7u32)).unwrap();
        assert_eq!(&frame[..4], &((frame.len() - 4) as u32).to_be_bytes());
        let mut d = FrameDecoder::new();
        d.push(&frame);
        let v: (String, u32) = d.next().unwrap().unwrap();
        assert_eq!(v, ("hi".to_string(), 7));
        assert!(d.next_raw().unwrap().is_none());
        d.finish().unwrap();
    }

    #[test]
    fn encode_too_large() {
        let big = serde_bytes::ByteBuf::from(vec![0u8; FRAME_BYTES_MAX + 1]);
        let mut buf = BytesMut::from(&b"xyz"[..]);
        match encode_frame_into(&big, &mut buf) {
            Err(CodecError::TooLarge { size, max }) => {
                assert!(size > FRAME_BYTES_MAX);
                assert_eq!(max, FRAME_BYTES_MAX);
            }
            other => panic!("unexpected {other:?}"),
        }
        assert_eq!(&buf[..], b"xyz");
    }

    #[test]
    fn max_size_body_ok() {
        // A body of exactly FRAME_BYTES_MAX bytes is accepted.
        let payload = vec![1u8; FRAME_BYTES_MAX - 5]; // bytes header: 1 + 4 bytes
        let frame = encode_frame(&serde_bytes::ByteBuf::from(payload)).unwrap();
        assert_eq!(frame.len(), FRAME_HEADER_BYTES + FRAME_BYTES_MAX);
        let mut d = FrameDecoder::new();
        d.push(&frame);
        assert_eq!(d.next_raw().unwrap().unwrap().len(), FRAME_BYTES_MAX);
    }

    #[test]
    fn truncated_header_and_body() {
        let mut d = FrameDecoder::new();
        d.push(&[0, 0]);
        assert!(d.next_raw().unwrap().is_none());
        assert!(matches!(
            d.finish(),
            Err(CodecError::Truncated { need: 4, have: 2 })
        ));
        let mut d = FrameDecoder::new();
        d.push(&[0, 0, 0, 10, 1, 2, 3]);
        assert!(d.next_raw().unwrap().is_none());
        assert!(matches!(
            d.finish(),
            Err(CodecError::Truncated { need: 14, have: 7 })
        ));
    }

    #[test]
    fn malformed_body() {
        assert!(matches!(
            decode_body::<u32>(&[0xff, 0x00]),
            Err(CodecError::Malformed(_))
        ));
        // trailing bytes are rejected
        assert!(matches!(
            decode_body::<u32>(&[0x01, 0x01]),
            Err(CodecError::Malformed(_))
        ));
    }

    #[test]
    fn bytes_are_cbor_byte_strings() {
        let b = serde_bytes::ByteBuf::from(vec![1u8, 2, 3]);
        assert_eq!(encode_body(&b).unwrap(), vec![0x43, 1, 2, 3]);
    }
}
