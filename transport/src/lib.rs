//! Tether's QUIC transport layer.
//!
//! * [`codec`] — length-prefixed CBOR frames (the only place in Tether that touches `serde_cbor`).
//! * [`tls`] — dev certificate generation and rustls/quinn client and server configurations.
//! * [`error`] — stable numeric error codes used as QUIC close codes and in error replies.
//! * [`endpoint`] — helpers that bind UDP sockets and build quinn endpoints.

#![warn(missing_docs)]

pub mod codec;
pub mod crl;
pub mod endpoint;
pub mod error;
pub mod tls;

pub use codec::{
    CodecError, FRAME_BYTES_MAX, FRAME_HEADER_BYTES, FrameDecoder, FrameReader, decode_body,
    encode_body, encode_frame, encode_frame_into, write_frame,
};
pub use endpoint::{client_endpoint, server_endpoint};
pub use error::ErrorCode;
pub use tls::{
    SERVER_NAME, TlsError, TlsFiles, client_config, client_config_from_pem, ensure_dev_certs,
    install_crypto_provider, server_config, transport_config,
};

/// Version of the Tether wire protocol spoken over [`ALPN`].
pub const PROTOCOL_VERSION: u32 = 1;

/// The TLS application-layer protocol name negotiated by Tether clients and servers.
pub const ALPN: &[u8] = b"tether/1";

/// The TLS application-layer protocol name of node-to-node (cluster) connections at this
/// build's [`PEER_PROTOCOL_VERSION`]. Served on the same address as clients; only certificates
/// issued by the cluster CA may speak it.
pub const PEER_ALPN: &[u8] = b"tether-peer/2";

/// Version of the node-to-node protocol this build speaks first.
///
/// - 1: consensus, forwarded publishes, queue shipping, pings, queue listings.
/// - 2: membership changes (`ChangeMembers`, and the `ForwardCursor` and `Regions` requests a
///   joining member copies with) and draining (the `SetDraining` metadata command). A node
///   sends a request only over a connection that negotiated a version that has it, and the
///   cluster drains or changes members only once no member speaks an older version.
pub const PEER_PROTOCOL_VERSION: u32 = 2;
/// Oldest node-to-node protocol version this build still speaks: one version back, once there
/// is one, so that a cluster is upgraded one node at a time (a rolling upgrade) with old and
/// new members talking meanwhile.
pub const PEER_PROTOCOL_VERSION_OLDEST: u32 = 1;
const _: () = assert!(
    PEER_PROTOCOL_VERSION_OLDEST <= PEER_PROTOCOL_VERSION
        && PEER_PROTOCOL_VERSION_OLDEST + 1 >= PEER_PROTOCOL_VERSION
);

/// Prefix of the peer protocol's ALPN names: `tether-peer/` and the version in decimal.
pub const PEER_ALPN_PREFIX: &str = "tether-peer/";

/// The ALPN name of node-to-node protocol version `version`.
pub fn peer_alpn(version: u32) -> Vec<u8> {
    format!("{PEER_ALPN_PREFIX}{version}").into_bytes()
}

/// The ALPN names of the node-to-node protocol versions `versions`, newest first. A node
/// offers all it speaks, dialing and served; the serving side picks the first of its own
/// list that the dialer offers, so two members speak the newest version both know, and two
/// with none in common fail the handshake (`no_application_protocol`, see
/// [`tls::no_common_protocol`]).
pub fn peer_alpns(versions: std::ops::RangeInclusive<u32>) -> Vec<Vec<u8>> {
    versions.rev().map(peer_alpn).collect()
}

/// The node-to-node protocol version an ALPN name stands for, if this build speaks it.
pub fn peer_protocol_version(alpn: &[u8]) -> Option<u32> {
    let version: u32 = std::str::from_utf8(alpn.strip_prefix(PEER_ALPN_PREFIX.as_bytes())?)
        .ok()?
        .parse()
        .ok()?;
    (PEER_PROTOCOL_VERSION_OLDEST..=PEER_PROTOCOL_VERSION)
        .contains(&version)
        .then_some(version)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_current_peer_alpn_is_the_named_one_and_versions_parse_back() {
        assert_eq!(peer_alpn(PEER_PROTOCOL_VERSION), PEER_ALPN);
        let all = peer_alpns(PEER_PROTOCOL_VERSION_OLDEST..=PEER_PROTOCOL_VERSION);
        assert_eq!(
            all.first().map(Vec::as_slice),
            Some(PEER_ALPN),
            "newest first"
        );
        for a in &all {
            assert!(peer_protocol_version(a).is_some(), "{a:?}");
        }
        for other in [
            peer_alpn(PEER_PROTOCOL_VERSION + 1),
            peer_alpn(0),
            b"tether-peer/".to_vec(),
            b"tether-peer/x".to_vec(),
            ALPN.to_vec(),
        ] {
            assert_eq!(peer_protocol_version(&other), None, "{other:?}");
        }
    }
}
