//! quinn endpoints on UDP sockets with enlarged buffers.

use std::net::{Ipv4Addr, Ipv6Addr, SocketAddr};
use std::sync::Arc;

use socket2::{Domain, Protocol, Socket, Type};

use crate::tls::UDP_SOCKET_BUFFER_BYTES;

/// Creates a UDP socket bound to `addr`, asking for [`UDP_SOCKET_BUFFER_BYTES`] send and receive
/// buffers (the OS may grant less; failure to enlarge is only logged).
pub fn bind_udp(addr: SocketAddr) -> std::io::Result<std::net::UdpSocket> {
    let socket = Socket::new(Domain::for_address(addr), Type::DGRAM, Some(Protocol::UDP))?;
    if addr.is_ipv6()
        && addr.ip().is_unspecified()
        && let Err(e) = socket.set_only_v6(false)
    {
        tracing::debug!(%e, "unable to make UDP socket dual-stack");
    }
    if let Err(e) = socket.set_recv_buffer_size(UDP_SOCKET_BUFFER_BYTES) {
        tracing::debug!(%e, "unable to set SO_RCVBUF");
    }
    if let Err(e) = socket.set_send_buffer_size(UDP_SOCKET_BUFFER_BYTES) {
        tracing::debug!(%e, "unable to set SO_SNDBUF");
    }
    socket.bind(&addr.into())?;
    Ok(socket.into())
}

fn endpoint(
    socket: std::net::UdpSocket,
    server: Option<quinn::ServerConfig>,
) -> std::io::Result<quinn::Endpoint> {
    quinn::Endpoint::new(
        quinn::EndpointConfig::default(),
        server,
        socket,
        Arc::new(quinn::TokioRuntime),
    )
}

/// Binds a UDP socket on `addr` (port 0 picks a free port; read it back with
/// `Endpoint::local_addr`) and builds a quinn server endpoint. Must run inside a tokio runtime.
pub fn server_endpoint(
    addr: SocketAddr,
    config: quinn::ServerConfig,
) -> std::io::Result<quinn::Endpoint> {
    endpoint(bind_udp(addr)?, Some(config))
}

/// A client endpoint on an ephemeral port of the family of `peer_hint`, with `config` as the
/// default client config. IPv4 binds `127.0.0.1` for a loopback peer and `0.0.0.0` otherwise;
/// IPv6 binds `[::]` (dual-stack where allowed). Must run inside a tokio runtime.
pub fn client_endpoint(
    config: quinn::ClientConfig,
    peer_hint: SocketAddr,
) -> std::io::Result<quinn::Endpoint> {
    let local: SocketAddr = match peer_hint {
        SocketAddr::V4(a) if a.ip().is_loopback() => (Ipv4Addr::LOCALHOST, 0).into(),
        SocketAddr::V4(_) => (Ipv4Addr::UNSPECIFIED, 0).into(),
        SocketAddr::V6(_) => (Ipv6Addr::UNSPECIFIED, 0).into(),
    };
    let mut ep = endpoint(bind_udp(local)?, None)?;
    ep.set_default_client_config(config);
    Ok(ep)
}
