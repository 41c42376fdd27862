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

/// The TLS application-layer protocol name of node-to-node (cluster) connections. Served on
/// the same address as clients; only certificates issued by the cluster CA may speak it.
pub const PEER_ALPN: &[u8] = b"tether-peer/1";
