//! Stable numeric error codes, used as QUIC application close codes and in error replies.
//!
//! The numbers are part of the wire protocol: never renumber, only append.

use std::fmt;

/// A stable protocol error code. Serializes as its number.
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(into = "u32", try_from = "u32")]
pub enum ErrorCode {
    /// No error.
    Ok = 0,
    /// Clean close by the peer.
    ClosedByPeer = 1,
    /// Unexpected internal failure.
    Internal = 2,
    /// The peer broke the protocol (unexpected message, wrong order, ...).
    ProtocolViolation = 3,
    /// A frame could not be decoded.
    MalformedFrame = 4,
    /// A frame exceeded [`FRAME_BYTES_MAX`](crate::FRAME_BYTES_MAX).
    FrameTooLarge = 5,
    /// The peer speaks a protocol version this side does not support.
    UnsupportedVersion = 6,
    /// A durable client id is already connected.
    DuplicateDurableId = 7,
    /// A request argument was invalid.
    InvalidArgument = 8,
    /// A configured limit was exceeded.
    LimitExceeded = 9,
    /// The requested object does not exist.
    NotFound = 10,
    /// The request was refused.
    Refused = 11,
    /// The server is shutting down.
    Shutdown = 12,
    /// The peer did not complete the handshake in time.
    HandshakeTimeout = 13,
    /// The client simulated a crash (closed without a clean goodbye).
    Crashed = 14,
    /// A subscription queue is full: the publish was refused (or blocked past its timeout), or
    /// the queue was dropped under the `drop-queue` policy.
    QueueFull = 15,
    /// The server requires credentials and the client presented none or unknown ones.
    Unauthenticated = 16,
    /// The authenticated principal may not do this (ACL, admin role, durable id owned by
    /// another principal).
    Forbidden = 17,
    /// The cluster could not serve the request now (no metadata leader reachable); retry.
    Unavailable = 18,
    /// The node is stopping and did not apply this request: send it to another node.
    GoingAway = 19,
}

impl ErrorCode {
    /// Every code, in numeric order.
    pub const ALL: [ErrorCode; 20] = [
        ErrorCode::Ok,
        ErrorCode::ClosedByPeer,
        ErrorCode::Internal,
        ErrorCode::ProtocolViolation,
        ErrorCode::MalformedFrame,
        ErrorCode::FrameTooLarge,
        ErrorCode::UnsupportedVersion,
        ErrorCode::DuplicateDurableId,
        ErrorCode::InvalidArgument,
        ErrorCode::LimitExceeded,
        ErrorCode::NotFound,
        ErrorCode::Refused,
        ErrorCode::Shutdown,
        ErrorCode::HandshakeTimeout,
        ErrorCode::Crashed,
        ErrorCode::QueueFull,
        ErrorCode::Unauthenticated,
        ErrorCode::Forbidden,
        ErrorCode::Unavailable,
        ErrorCode::GoingAway,
    ];

    /// The numeric value.
    pub fn as_u32(self) -> u32 {
        self as u32
    }

    /// The code with numeric value `n`, if any.
    pub fn from_u32(n: u32) -> Option<Self> {
        Self::ALL.get(n as usize).copied()
    }

    /// The code as a QUIC variable-length integer (for close and reset codes).
    pub fn varint(self) -> quinn::VarInt {
        quinn::VarInt::from_u32(self.as_u32())
    }

    /// The code carried by a QUIC close or reset code, if it is one of ours.
    pub fn from_varint(v: quinn::VarInt) -> Option<Self> {
        u32::try_from(v.into_inner()).ok().and_then(Self::from_u32)
    }

    /// Stable kebab-case name, e.g. `"duplicate-durable-id"`.
    pub fn name(self) -> &'static str {
        match self {
            ErrorCode::Ok => "ok",
            ErrorCode::ClosedByPeer => "closed-by-peer",
            ErrorCode::Internal => "internal",
            ErrorCode::ProtocolViolation => "protocol-violation",
            ErrorCode::MalformedFrame => "malformed-frame",
            ErrorCode::FrameTooLarge => "frame-too-large",
            ErrorCode::UnsupportedVersion => "unsupported-version",
            ErrorCode::DuplicateDurableId => "duplicate-durable-id",
            ErrorCode::InvalidArgument => "invalid-argument",
            ErrorCode::LimitExceeded => "limit-exceeded",
            ErrorCode::NotFound => "not-found",
            ErrorCode::Refused => "refused",
            ErrorCode::Shutdown => "shutdown",
            ErrorCode::HandshakeTimeout => "handshake-timeout",
            ErrorCode::Crashed => "crashed",
            ErrorCode::QueueFull => "queue-full",
            ErrorCode::Unauthenticated => "unauthenticated",
            ErrorCode::Forbidden => "forbidden",
            ErrorCode::Unavailable => "unavailable",
            ErrorCode::GoingAway => "going-away",
        }
    }

    /// The code whose [`name`](Self::name) is `name`, if any.
    pub fn from_name(name: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|c| c.name() == name)
    }
}

impl fmt::Display for ErrorCode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl From<ErrorCode> for u32 {
    fn from(c: ErrorCode) -> u32 {
        c.as_u32()
    }
}

impl From<ErrorCode> for quinn::VarInt {
    fn from(c: ErrorCode) -> quinn::VarInt {
        c.varint()
    }
}

/// Error for a number that is not a known [`ErrorCode`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[error("unknown error code {0}")]
pub struct UnknownErrorCode(pub u32);

impl TryFrom<u32> for ErrorCode {
    type Error = UnknownErrorCode;
    fn try_from(n: u32) -> Result<Self, Self::Error> {
        Self::from_u32(n).ok_or(UnknownErrorCode(n))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn numbers_and_names_roundtrip() {
        for (i, c) in ErrorCode::ALL.into_iter().enumerate() {
            assert_eq!(c.as_u32(), i as u32);
            assert_eq!(ErrorCode::from_u32(i as u32), Some(c));
            assert_eq!(ErrorCode::from_varint(c.varint()), Some(c));
            assert_eq!(ErrorCode::from_name(c.name()), Some(c));
        }
        assert_eq!(ErrorCode::from_u32(ErrorCode::ALL.len() as u32), None);
        assert_eq!(ErrorCode::DuplicateDurableId.name(), "duplicate-durable-id");
        assert_eq!(
            ErrorCode::from_varint(quinn::VarInt::from_u64(1 << 40).unwrap()),
            None
        );
    }

    #[test]
    fn serializes_as_number() {
        let bytes = crate::encode_body(&ErrorCode::DuplicateDurableId).unwrap();
        assert_eq!(bytes, vec![0x07]);
        let c: ErrorCode = crate::decode_body(&bytes).unwrap();
        assert_eq!(c, ErrorCode::DuplicateDurableId);
        assert!(crate::decode_body::<ErrorCode>(&[0x18, 99]).is_err());
    }
}
