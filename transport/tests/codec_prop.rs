//! Property tests of the sans-IO frame decoder.

use bytes::BytesMut;
use proptest::prelude::*;
use serde::{Deserialize, Serialize};
use tether_transport::codec::{
    CodecError, FRAME_BYTES_MAX, FRAME_HEADER_BYTES, FrameDecoder, decode_body, encode_frame,
    encode_frame_into,
};

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
enum Msg {
    Hello {
        version: u32,
        id: String,
    },
    Data {
        seq: u64,
        #[serde(with = "serde_bytes")]
        payload: Vec<u8>,
    },
    Ack(Vec<u64>),
    Bye,
}

fn msg() -> impl Strategy<Value = Msg> {
    prop_oneof![
        (any::<u32>(), ".{0,40}").prop_map(|(version, id)| Msg::Hello { version, id }),
        (
            any::<u64>(),
            proptest::collection::vec(any::<u8>(), 0..2000)
        )
            .prop_map(|(seq, payload)| Msg::Data { seq, payload }),
        proptest::collection::vec(any::<u64>(), 0..20).prop_map(Msg::Ack),
        Just(Msg::Bye),
    ]
}

/// Feeds `bytes` to a decoder in chunks cut at `cuts` and collects all frames.
fn decode_chunked(bytes: &[u8], cuts: &[usize]) -> Result<Vec<Msg>, CodecError> {
    let mut points: Vec<usize> = cuts.iter().map(|c| c % (bytes.len() + 1)).collect();
    points.push(0);
    points.push(bytes.len());
    points.sort_unstable();
    let mut d = FrameDecoder::new();
    let mut out = Vec::new();
    for w in points.windows(2) {
        d.push(&bytes[w[0]..w[1]]);
        while let Some(m) = d.next::<Msg>()? {
            out.push(m);
        }
    }
    d.finish()?;
    Ok(out)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn roundtrip_any_split(msgs in proptest::collection::vec(msg(), 0..12),
                           cuts in proptest::collection::vec(any::<usize>(), 0..30)) {
        let mut buf = BytesMut::new();
        for m in &msgs {
            encode_frame_into(m, &mut buf).unwrap();
        }
        // encode_frame produces the same bytes as encode_frame_into.
        let concat: Vec<u8> = msgs.iter().flat_map(|m| encode_frame(m).unwrap().to_vec()).collect();
        prop_assert_eq!(&concat[..], &buf[..]);
        let got = decode_chunked(&buf, &cuts).unwrap();
        prop_assert_eq!(got, msgs);
    }

    #[test]
    fn decoder_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..4096),
                            cuts in proptest::collection::vec(any::<usize>(), 0..10)) {
        let _ = decode_chunked(&bytes, &cuts);
        let mut d = FrameDecoder::new();
        d.push(&bytes);
        while let Ok(Some(body)) = d.next_raw() {
            let _ = decode_body::<Msg>(&body);
            let _ = decode_body::<serde_cbor_value_free::Any>(&body);
        }
        let _ = d.finish();
    }

    #[test]
    fn decode_body_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
        let _ = decode_body::<Msg>(&bytes);
        let _ = decode_body::<Vec<String>>(&bytes);
        let _ = decode_body::<serde_cbor_value_free::Any>(&bytes);
    }

    #[test]
    fn oversize_header_is_too_large(extra in 1usize..1_000_000, body_prefix in proptest::collection::vec(any::<u8>(), 0..1000)) {
        let size = FRAME_BYTES_MAX + extra;
        let mut d = FrameDecoder::new();
        d.push(&(size as u32).to_be_bytes());
        d.push(&body_prefix);
        match d.next_raw() {
            Err(CodecError::TooLarge { size: s, max }) => {
                prop_assert_eq!(s, size);
                prop_assert_eq!(max, FRAME_BYTES_MAX);
            }
            other => prop_assert!(false, "expected TooLarge, got {:?}", other),
        }
        // Nothing of the body is kept, and more input is dropped.
        prop_assert_eq!(d.buffered(), 0);
        d.push(&[0u8; 4096]);
        prop_assert_eq!(d.buffered(), 0);
        prop_assert!(
            matches!(d.next_raw(), Err(CodecError::TooLarge { .. })),
            "decoder must stay failed"
        );
    }

    #[test]
    fn truncated_frame_is_truncated(m in msg(), cut_seed in any::<usize>()) {
        let frame = encode_frame(&m).unwrap();
        let cut = 1 + cut_seed % (frame.len() - 1); // 1..len-1: strictly inside the frame
        let mut d = FrameDecoder::new();
        d.push(&frame[..cut]);
        prop_assert!(d.next_raw().unwrap().is_none());
        match d.finish() {
            Err(CodecError::Truncated { need, have }) => {
                prop_assert_eq!(have, cut);
                if cut < FRAME_HEADER_BYTES {
                    prop_assert_eq!(need, FRAME_HEADER_BYTES);
                } else {
                    prop_assert_eq!(need, frame.len());
                }
            }
            other => prop_assert!(false, "expected Truncated, got {:?}", other),
        }
    }
}

/// A "deserialize anything" type, so random CBOR is walked fully without `serde_cbor::Value`
/// leaking into the test's imports.
mod serde_cbor_value_free {
    use serde::de::{Deserialize, Deserializer, IgnoredAny};

    pub struct Any;
    impl<'de> Deserialize<'de> for Any {
        fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
            IgnoredAny::deserialize(d).map(|_| Any)
        }
    }
}
