//! TLS for Tether: dev certificate generation and quinn client/server configurations.
//!
//! Everything uses rustls' `ring` provider explicitly, so nothing depends on the process-wide
//! default provider; [`install_crypto_provider`] is still offered for other rustls users.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use quinn::crypto::rustls::{QuicClientConfig, QuicServerConfig};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, CertificateRevocationListDer, PrivateKeyDer};

use crate::{ALPN, PEER_PROTOCOL_VERSION, PEER_PROTOCOL_VERSION_OLDEST, peer_alpns};

/// Server name clients pass to `connect`; the dev server certificate carries it as a SAN.
pub const SERVER_NAME: &str = "localhost";

/// Idle timeout of a connection, in milliseconds.
pub const IDLE_TIMEOUT_MS: u64 = 30_000;
/// Interval between keep-alive packets, in milliseconds (well below [`IDLE_TIMEOUT_MS`]).
pub const KEEP_ALIVE_INTERVAL_MS: u64 = 5_000;
/// Per-stream receive window (flow-control credit), in bytes.
pub const STREAM_RECEIVE_WINDOW_BYTES: u32 = 2 * 1024 * 1024;
/// Per-connection receive window, in bytes.
pub const CONNECTION_RECEIVE_WINDOW_BYTES: u32 = 16 * 1024 * 1024;
/// Per-connection send window, in bytes.
pub const SEND_WINDOW_BYTES: u64 = 16 * 1024 * 1024;
/// A node's default per-connection receive window (what one client may make it buffer, all
/// streams together), in bytes. Far below [`CONNECTION_RECEIVE_WINDOW_BYTES`]: a node serves
/// thousands of connections, a client one.
pub const SERVER_RECEIVE_WINDOW_BYTES: u64 = 2 * 1024 * 1024;
/// A node's default per-connection send window (written, not yet acknowledged), in bytes. A
/// client's delivery stream cannot take more than its stream window
/// ([`STREAM_RECEIVE_WINDOW_BYTES`]) in flight anyway.
pub const SERVER_SEND_WINDOW_BYTES: u64 = 2 * 1024 * 1024;
/// Lowest per-connection window a node accepts in its configuration, in bytes (room for
/// some frames in flight).
pub const CONNECTION_WINDOW_BYTES_LOWEST: u64 = 64 * 1024;
/// Highest per-connection window a node accepts in its configuration, in bytes.
pub const CONNECTION_WINDOW_BYTES_MAX: u64 = 1 << 30;
/// Requested UDP socket send and receive buffer size, in bytes (the OS may cap it).
pub const UDP_SOCKET_BUFFER_BYTES: usize = 4 * 1024 * 1024;
/// Maximum number of concurrent bidirectional streams a peer may open.
pub const MAX_CONCURRENT_BIDI_STREAMS: u32 = 8;
/// Maximum number of concurrent unidirectional streams a peer may open.
pub const MAX_CONCURRENT_UNI_STREAMS: u32 = 8;

/// File name of the dev CA certificate inside the certificate directory.
pub const CA_CERT_FILE: &str = "ca.pem";
/// File name of the dev CA private key inside the certificate directory.
pub const CA_KEY_FILE: &str = "ca.key";
/// File name of the dev server certificate inside the certificate directory.
pub const SERVER_CERT_FILE: &str = "server.pem";
/// File name of the dev server private key inside the certificate directory.
pub const SERVER_KEY_FILE: &str = "server.key";
/// Unix permission bits of generated private key files.
pub const KEY_FILE_MODE: u32 = 0o600;
/// Subject alternative names of the dev server certificate.
pub const DEV_SERVER_SANS: [&str; 3] = [SERVER_NAME, "127.0.0.1", "::1"];
/// Start of the URI subject alternative name that names a cluster node in its certificate:
/// `urn:tether:node:<node-id>`. Peers are identified by it, never by the CA alone: a client
/// certificate (which never carries one) cannot open a peer connection, and a certificate that
/// carries one cannot authenticate a client.
pub const NODE_URI_PREFIX: &str = "urn:tether:node:";
/// Common name of the dev CA, followed by a suffix unique to each CA (from its key), so that
/// two dev CAs never share a name: revocation lists are matched to certificates by issuer
/// name.
pub const DEV_CA_COMMON_NAME: &str = "Tether dev CA";

/// Paths of a CA certificate and a server certificate with its key, all PEM.
#[derive(Clone, Debug)]
pub struct TlsFiles {
    /// CA certificate that clients trust.
    pub ca: PathBuf,
    /// Server certificate (chain), signed by `ca`.
    pub cert: PathBuf,
    /// Server private key (PKCS#8, SEC1 or PKCS#1).
    pub key: PathBuf,
}

/// Errors building TLS material or configurations.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    /// Reading or writing a file failed.
    #[error("{path}: {source}")]
    Io {
        /// The file or directory concerned.
        path: PathBuf,
        /// The underlying error.
        #[source]
        source: std::io::Error,
    },
    /// A PEM file could not be parsed or held nothing usable.
    #[error("{path}: {message}")]
    Pem {
        /// The file concerned (empty for in-memory PEM).
        path: PathBuf,
        /// What went wrong.
        message: String,
    },
    /// Certificate generation failed.
    #[error("certificate generation: {0}")]
    Rcgen(#[from] rcgen::Error),
    /// rustls rejected the configuration (bad key, unusable certificate, ...).
    #[error("rustls: {0}")]
    Rustls(#[from] rustls::Error),
    /// The rustls configuration cannot be used for QUIC.
    #[error("QUIC TLS configuration: {0}")]
    Quic(String),
}

pub(crate) fn io_err(path: &Path) -> impl FnOnce(std::io::Error) -> TlsError + '_ {
    move |source| TlsError::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// Installs rustls' `ring` provider as the process default. Idempotent: an already installed
/// provider is left in place.
pub fn install_crypto_provider() {
    let _ = rustls::crypto::ring::default_provider().install_default();
}

fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// The transport settings of a node's incoming connections: [`transport_config`] with the
/// node's idle timeout and per-connection windows, which bound the memory one connection can
/// hold on the node (receive window plus send window, see `docs/operations.md`).
pub fn server_transport_config(
    idle_timeout: Duration,
    receive_window_bytes: u64,
    send_window_bytes: u64,
) -> Result<quinn::TransportConfig, TlsError> {
    let mut t = transport_config();
    let bad = |what: &str| TlsError::Quic(format!("{what} out of range"));
    let receive =
        quinn::VarInt::from_u64(receive_window_bytes).map_err(|_| bad("receive window"))?;
    let stream =
        quinn::VarInt::from_u64(receive_window_bytes.min(STREAM_RECEIVE_WINDOW_BYTES as u64))
            .map_err(|_| bad("receive window"))?;
    t.max_idle_timeout(Some(
        quinn::IdleTimeout::try_from(idle_timeout).map_err(|_| bad("idle timeout"))?,
    ))
    .receive_window(receive)
    .stream_receive_window(stream)
    .send_window(send_window_bytes);
    Ok(t)
}

/// The quinn transport settings shared by clients and servers (the constants of this module).
pub fn transport_config() -> quinn::TransportConfig {
    let mut t = quinn::TransportConfig::default();
    t.max_idle_timeout(Some(
        quinn::IdleTimeout::try_from(Duration::from_millis(IDLE_TIMEOUT_MS))
            .expect("IDLE_TIMEOUT_MS fits a QUIC varint"),
    ))
    .keep_alive_interval(Some(Duration::from_millis(KEEP_ALIVE_INTERVAL_MS)))
    .stream_receive_window(quinn::VarInt::from_u32(STREAM_RECEIVE_WINDOW_BYTES))
    .receive_window(quinn::VarInt::from_u32(CONNECTION_RECEIVE_WINDOW_BYTES))
    .send_window(SEND_WINDOW_BYTES)
    .max_concurrent_bidi_streams(quinn::VarInt::from_u32(MAX_CONCURRENT_BIDI_STREAMS))
    .max_concurrent_uni_streams(quinn::VarInt::from_u32(MAX_CONCURRENT_UNI_STREAMS));
    t
}

pub(crate) fn read_file(path: &Path) -> Result<Vec<u8>, TlsError> {
    std::fs::read(path).map_err(io_err(path))
}

pub(crate) fn parse_certs(
    pem: &[u8],
    path: &Path,
) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let certs = CertificateDer::pem_slice_iter(pem)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| TlsError::Pem {
            path: path.to_path_buf(),
            message: e.to_string(),
        })?;
    if certs.is_empty() {
        return Err(TlsError::Pem {
            path: path.to_path_buf(),
            message: "no CERTIFICATE section".into(),
        });
    }
    Ok(certs)
}

fn parse_key(pem: &[u8], path: &Path) -> Result<PrivateKeyDer<'static>, TlsError> {
    PrivateKeyDer::from_pem_slice(pem).map_err(|e| TlsError::Pem {
        path: path.to_path_buf(),
        message: e.to_string(),
    })
}

/// Server configuration from `files.cert` (chain) and `files.key`, with Tether's ALPN and
/// [`transport_config`]. TLS 1.3 only, no client authentication.
pub fn server_config(files: &TlsFiles) -> Result<quinn::ServerConfig, TlsError> {
    let certs = parse_certs(&read_file(&files.cert)?, &files.cert)?;
    let key = parse_key(&read_file(&files.key)?, &files.key)?;
    let tls = rustls::ServerConfig::builder_with_provider(provider())
        .with_protocol_versions(&[&rustls::version::TLS13])?
        .with_no_client_auth()
        .with_single_cert(certs, key)?;
    finish_server(tls)
}

/// ALPN, QUIC wrapping and [`transport_config`] for a rustls server configuration.
fn finish_server(mut tls: rustls::ServerConfig) -> Result<quinn::ServerConfig, TlsError> {
    tls.alpn_protocols = vec![ALPN.to_vec()];
    let quic = QuicServerConfig::try_from(tls).map_err(|e| TlsError::Quic(e.to_string()))?;
    let mut cfg = quinn::ServerConfig::with_crypto(Arc::new(quic));
    cfg.transport_config(Arc::new(transport_config()));
    Ok(cfg)
}

/// ALPN, QUIC wrapping and [`transport_config`] for a rustls client configuration.
fn finish_client(mut tls: rustls::ClientConfig) -> Result<quinn::ClientConfig, TlsError> {
    tls.alpn_protocols = vec![ALPN.to_vec()];
    let quic = QuicClientConfig::try_from(tls).map_err(|e| TlsError::Quic(e.to_string()))?;
    let mut cfg = quinn::ClientConfig::new(Arc::new(quic));
    cfg.transport_config(Arc::new(transport_config()));
    Ok(cfg)
}

/// The certificates of a PEM file as a root store.
pub(crate) fn roots_from(path: &Path) -> Result<rustls::RootCertStore, TlsError> {
    roots_from_pem(&read_file(path)?, path)
}

fn roots_from_pem(pem: &[u8], path: &Path) -> Result<rustls::RootCertStore, TlsError> {
    let mut roots = rustls::RootCertStore::empty();
    for cert in parse_certs(pem, path)? {
        roots.add(cert)?;
    }
    Ok(roots)
}

/// [`server_config`] that also accepts client certificates issued by the CA(s) in the PEM
/// file `client_ca` (mutual TLS). A client without a certificate is still accepted (it may
/// authenticate with a token instead); one with a certificate that does not verify fails the
/// handshake, and so does one that the revocation lists `crls` revoke. The verified subject is
/// read with [`peer_common_name`].
pub fn server_config_with_client_ca(
    files: &TlsFiles,
    client_ca: &Path,
    crls: &[CertificateRevocationListDer<'static>],
) -> Result<quinn::ServerConfig, TlsError> {
    let certs = parse_certs(&read_file(&files.cert)?, &files.cert)?;
    let key = parse_key(&read_file(&files.key)?, &files.key)?;
    let verifier = client_verifier(roots_from(client_ca)?, crls)?;
    let tls = rustls::ServerConfig::builder_with_provider(provider())
        .with_protocol_versions(&[&rustls::version::TLS13])?
        .with_client_cert_verifier(verifier)
        .with_single_cert(certs, key)?;
    finish_server(tls)
}

/// Server configuration of a cluster node: serves clients (ALPN [`ALPN`]) and peers (the
/// peer protocol versions this build speaks, [`peer_alpns`]) on one address. Client certificates are verified against the cluster CA
/// (`files.ca`) and, if given, the client CA; a client without a certificate is accepted
/// (tokens, or an open node). Whether a peer connection's certificate comes from the cluster
/// CA is checked after the handshake with [`peer_issued_by_ca`]. `crls` revoke client
/// certificates. `peer_versions`: the peer protocol versions served, normally
/// [`PEER_PROTOCOL_VERSION_OLDEST`]`..=`[`PEER_PROTOCOL_VERSION`] (fewer: a node of an older
/// build, in tests of a mixed-version cluster).
pub fn server_config_for_cluster(
    files: &TlsFiles,
    client_ca: Option<&Path>,
    crls: &[CertificateRevocationListDer<'static>],
    peer_versions: std::ops::RangeInclusive<u32>,
) -> Result<quinn::ServerConfig, TlsError> {
    let certs = parse_certs(&read_file(&files.cert)?, &files.cert)?;
    let key = parse_key(&read_file(&files.key)?, &files.key)?;
    let client_roots = match client_ca {
        Some(client_ca) => roots_from(client_ca)?,
        None => roots_from(&files.ca)?,
    };
    let verifier = Arc::new(ClusterClientVerifier::new(
        client_verifier(client_roots, crls)?,
        client_verifier(roots_from(&files.ca)?, &[])?,
    ));
    let mut tls = rustls::ServerConfig::builder_with_provider(provider())
        .with_protocol_versions(&[&rustls::version::TLS13])?
        .with_client_cert_verifier(verifier)
        .with_single_cert(certs, key)?;
    tls.alpn_protocols = vec![ALPN.to_vec()];
    tls.alpn_protocols.extend(peer_alpns(peer_versions));
    let quic = QuicServerConfig::try_from(tls).map_err(|e| TlsError::Quic(e.to_string()))?;
    let mut cfg = quinn::ServerConfig::with_crypto(Arc::new(quic));
    cfg.transport_config(Arc::new(transport_config()));
    Ok(cfg)
}

/// The client-certificate verifier of a server: chains to `roots`, a client without a
/// certificate allowed (tokens, or an open node), end-entity certificates checked against the
/// revocation lists `crls`; a certificate whose issuer has no list is not revoked (peers'
/// certificates under the cluster CA, a client CA without a list).
fn client_verifier(
    roots: rustls::RootCertStore,
    crls: &[CertificateRevocationListDer<'static>],
) -> Result<Arc<dyn rustls::server::danger::ClientCertVerifier>, TlsError> {
    rustls::server::WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider())
        .allow_unauthenticated()
        .with_crls(crls.iter().cloned())
        .only_check_end_entity_revocation()
        .allow_unknown_revocation_status()
        .build()
        .map_err(|e| TlsError::Quic(format!("client verifier: {e}")))
}

/// A cluster node's client-certificate verifier: a certificate is first verified as a client's
/// (the client CA, or the cluster CA without one, with the revocation lists); a revoked one is
/// refused there. Any other failure falls back to the peers' verifier (the cluster CA, no
/// lists: revocation lists are for client certificates). Two verifiers rather than one store
/// with both CAs, because a revocation list is matched to a certificate by issuer *name*: a
/// client CA's list must not be applied to peer certificates from a cluster CA of the same
/// name (dev CAs made before their names were unique all share one, and other CAs may too).
#[derive(Debug)]
struct ClusterClientVerifier {
    clients: Arc<dyn rustls::server::danger::ClientCertVerifier>,
    peers: Arc<dyn rustls::server::danger::ClientCertVerifier>,
    hints: Vec<rustls::DistinguishedName>,
}

impl ClusterClientVerifier {
    fn new(
        clients: Arc<dyn rustls::server::danger::ClientCertVerifier>,
        peers: Arc<dyn rustls::server::danger::ClientCertVerifier>,
    ) -> Self {
        let mut hints = clients.root_hint_subjects().to_vec();
        for h in peers.root_hint_subjects() {
            if !hints.iter().any(|x| x.as_ref() == h.as_ref()) {
                hints.push(h.clone());
            }
        }
        ClusterClientVerifier {
            clients,
            peers,
            hints,
        }
    }
}

impl rustls::server::danger::ClientCertVerifier for ClusterClientVerifier {
    fn offer_client_auth(&self) -> bool {
        true
    }

    fn client_auth_mandatory(&self) -> bool {
        false
    }

    fn root_hint_subjects(&self) -> &[rustls::DistinguishedName] {
        &self.hints
    }

    fn verify_client_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        now: rustls::pki_types::UnixTime,
    ) -> Result<rustls::server::danger::ClientCertVerified, rustls::Error> {
        match self
            .clients
            .verify_client_cert(end_entity, intermediates, now)
        {
            Ok(v) => Ok(v),
            Err(e @ rustls::Error::InvalidCertificate(rustls::CertificateError::Revoked)) => Err(e),
            Err(e) => self
                .peers
                .verify_client_cert(end_entity, intermediates, now)
                .map_err(|_| e),
        }
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &rustls::DigitallySignedStruct,
    ) -> Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
        self.peers.verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &rustls::DigitallySignedStruct,
    ) -> Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
        self.peers.verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<rustls::SignatureScheme> {
        self.peers.supported_verify_schemes()
    }
}

/// Idle timeout of node-to-node connections, in milliseconds.
pub const PEER_IDLE_TIMEOUT_MS: u64 = 3_000;
/// Keep-alive interval of node-to-node connections, in milliseconds.
pub const PEER_KEEP_ALIVE_INTERVAL_MS: u64 = 500;
/// Round-trip time a node assumes towards a peer until it measures one, in milliseconds.
/// Cluster members answer each other within a heartbeat interval, far below the 333 ms quinn
/// assumes of an unknown path (RFC 9002). A lost first Initial is sent again after 3x this
/// (150 ms: a peer that was starting gets the handshake soon, not after 1 s), and a handshake
/// that ends before completing (refused by a stopping peer, closed by a stopping node) drains
/// for 9x this (450 ms instead of 3 s), holding the endpoint and its UDP port meanwhile.
pub const PEER_INITIAL_RTT_MS: u64 = 50;

/// Client configuration a node uses towards its peers: trusts the cluster CA (`files.ca`),
/// presents the node's own certificate, offers the peer protocol versions this build speaks.
pub fn peer_client_config(files: &TlsFiles) -> Result<quinn::ClientConfig, TlsError> {
    peer_client_config_speaking(files, PEER_PROTOCOL_VERSION_OLDEST..=PEER_PROTOCOL_VERSION)
}

/// [`peer_client_config`] offering the peer protocol `versions` (a node of another build, in
/// tests of version negotiation).
pub fn peer_client_config_speaking(
    files: &TlsFiles,
    versions: std::ops::RangeInclusive<u32>,
) -> Result<quinn::ClientConfig, TlsError> {
    let roots = roots_from(&files.ca)?;
    let chain = parse_certs(&read_file(&files.cert)?, &files.cert)?;
    let key = parse_key(&read_file(&files.key)?, &files.key)?;
    let verifier = Arc::new(NodeCertVerifier {
        roots: Arc::new(roots),
        provider: provider(),
    });
    let mut tls = rustls::ClientConfig::builder_with_provider(provider())
        .with_protocol_versions(&[&rustls::version::TLS13])?
        .dangerous()
        .with_custom_certificate_verifier(verifier)
        .with_client_auth_cert(chain, key)?;
    tls.alpn_protocols = peer_alpns(versions);
    let quic = QuicClientConfig::try_from(tls).map_err(|e| TlsError::Quic(e.to_string()))?;
    let mut cfg = quinn::ClientConfig::new(Arc::new(quic));
    let mut transport = transport_config();
    // A peer that dies without closing (kill -9, network cut) must be noticed quickly: its
    // RPCs would otherwise wait on a dead connection until the idle timeout.
    transport.keep_alive_interval(Some(Duration::from_millis(PEER_KEEP_ALIVE_INTERVAL_MS)));
    transport.max_idle_timeout(Some(
        quinn::IdleTimeout::try_from(Duration::from_millis(PEER_IDLE_TIMEOUT_MS))
            .expect("a small timeout"),
    ));
    transport.initial_rtt(Duration::from_millis(PEER_INITIAL_RTT_MS));
    cfg.transport_config(Arc::new(transport));
    Ok(cfg)
}

/// How a node verifies the certificate of a peer it dials: the chain must lead to the cluster
/// CA (as for any server), and instead of a host name the leaf must name a cluster node
/// ([`NODE_URI_PREFIX`]). Peers are dialed by the addresses of the member list and known by
/// their node names, so a node certificate needs no DNS name or IP address its peers dial
/// (only the names its clients use); which node it names is checked against the node dialed
/// once the handshake is done (`connection_node_names`).
#[derive(Debug)]
struct NodeCertVerifier {
    roots: Arc<rustls::RootCertStore>,
    provider: Arc<rustls::crypto::CryptoProvider>,
}

impl rustls::client::danger::ServerCertVerifier for NodeCertVerifier {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        _server_name: &rustls::pki_types::ServerName<'_>,
        _ocsp_response: &[u8],
        now: rustls::pki_types::UnixTime,
    ) -> Result<rustls::client::danger::ServerCertVerified, rustls::Error> {
        let cert = rustls::server::ParsedCertificate::try_from(end_entity)?;
        rustls::client::verify_server_cert_signed_by_trust_anchor(
            &cert,
            &self.roots,
            intermediates,
            now,
            self.provider.signature_verification_algorithms.all,
        )?;
        if cert_node_names(end_entity).is_empty() {
            return Err(rustls::Error::General(format!(
                "the peer's certificate names no cluster node (no {NODE_URI_PREFIX}<id> SAN)"
            )));
        }
        Ok(rustls::client::danger::ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &rustls::DigitallySignedStruct,
    ) -> Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(
            message,
            cert,
            dss,
            &self.provider.signature_verification_algorithms,
        )
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &rustls::DigitallySignedStruct,
    ) -> Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(
            message,
            cert,
            dss,
            &self.provider.signature_verification_algorithms,
        )
    }

    fn supported_verify_schemes(&self) -> Vec<rustls::SignatureScheme> {
        self.provider
            .signature_verification_algorithms
            .supported_schemes()
    }
}

/// TLS alert `no_application_protocol` (RFC 8446, 120): the two sides offered no ALPN name in
/// common.
const TLS_ALERT_NO_APPLICATION_PROTOCOL: u8 = 120;

/// Whether a handshake failed because the two sides speak no protocol version in common (no
/// ALPN name in common: a build too old or too new for the other side), on either side.
pub fn no_common_protocol(e: &quinn::ConnectionError) -> bool {
    let code = quinn::TransportErrorCode::crypto(TLS_ALERT_NO_APPLICATION_PROTOCOL);
    match e {
        quinn::ConnectionError::ConnectionClosed(c) => c.error_code == code,
        quinn::ConnectionError::TransportError(t) => t.code == code,
        _ => false,
    }
}

/// The ALPN protocol a connection negotiated, if any.
pub fn negotiated_alpn(conn: &quinn::Connection) -> Option<Vec<u8>> {
    conn.handshake_data()?
        .downcast::<quinn::crypto::rustls::HandshakeData>()
        .ok()?
        .protocol
}

/// Whether the (verified) certificate a connection presented was issued by the CA whose
/// certificate is in the PEM file `ca_pem` (its signature checked against that CA, see
/// [`chains_to`]). The handshake verified the chain against every configured root, so this
/// tells which one: a peer must hold a cluster-CA certificate, not a client-CA one, even when
/// the two CAs have the same name (dev CAs made before names were unique all do).
pub fn peer_issued_by_ca(conn: &quinn::Connection, ca_pem: &Path) -> bool {
    let Some((leaf, intermediates)) = peer_leaf(conn) else {
        return false;
    };
    roots_from(ca_pem).is_ok_and(|roots| chains_to(&leaf, &intermediates, roots))
}

/// The URI subject alternative name naming cluster node `node` (see [`NODE_URI_PREFIX`]).
pub fn node_uri(node: &str) -> String {
    format!("{NODE_URI_PREFIX}{node}")
}

/// The cluster node names (URI SANs under [`NODE_URI_PREFIX`]) a DER certificate carries;
/// empty for an unparseable certificate.
pub fn cert_node_names(cert: &CertificateDer<'_>) -> Vec<String> {
    let Ok((_, cert)) = x509_parser::parse_x509_certificate(cert.as_ref()) else {
        return Vec::new();
    };
    let Ok(Some(san)) = cert.subject_alternative_name() else {
        return Vec::new();
    };
    san.value
        .general_names
        .iter()
        .filter_map(|n| match n {
            x509_parser::extensions::GeneralName::URI(uri) => uri.strip_prefix(NODE_URI_PREFIX),
            _ => None,
        })
        .map(str::to_string)
        .collect()
}

/// The cluster node names the leaf certificate of PEM file `cert` carries (the first
/// certificate of the chain).
pub fn file_node_names(cert: &Path) -> Result<Vec<String>, TlsError> {
    let chain = parse_certs(&read_file(cert)?, cert)?;
    Ok(cert_node_names(&chain[0]))
}

/// The leaf certificate the other side of `conn` presented (verified by the handshake).
fn peer_leaf(
    conn: &quinn::Connection,
) -> Option<(CertificateDer<'static>, Vec<CertificateDer<'static>>)> {
    let identity = conn.peer_identity()?;
    let chain = identity.downcast_ref::<Vec<CertificateDer<'static>>>()?;
    let (leaf, rest) = chain.split_first()?;
    Some((leaf.clone(), rest.to_vec()))
}

/// The cluster node names in the certificate the other side of `conn` presented (none without
/// a certificate). A node's server certificate as seen by a peer dialing it, or a client
/// certificate that must not carry one.
pub fn connection_node_names(conn: &quinn::Connection) -> Vec<String> {
    peer_leaf(conn).map_or_else(Vec::new, |(leaf, _)| cert_node_names(&leaf))
}

/// Why a peer connection's certificate does not identify a cluster node.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PeerIdentityError {
    /// No certificate, or one not issued by the cluster CA.
    #[error("peer connections need a certificate from the cluster CA")]
    NotClusterCa,
    /// A cluster-CA certificate that names no node (a client certificate).
    #[error(
        "the certificate names no cluster node (a node's certificate carries the SAN {NODE_URI_PREFIX}<node-id>)"
    )]
    NoNodeName,
    /// A certificate naming more than one node.
    #[error("the certificate names several cluster nodes: {0:?}")]
    SeveralNodeNames(Vec<String>),
}

impl PeerIdentityError {
    /// A short label for metrics and logs.
    pub fn label(&self) -> &'static str {
        match self {
            PeerIdentityError::NotClusterCa => "not_cluster_ca",
            PeerIdentityError::NoNodeName => "no_node_name",
            PeerIdentityError::SeveralNodeNames(_) => "several_node_names",
        }
    }
}

/// The cluster node a peer connection comes from: its certificate chains to the CA in the PEM
/// file `ca_pem` (see [`peer_issued_by_ca`]) and carries exactly one node name
/// ([`NODE_URI_PREFIX`]). Whether that name is a member is the caller's to check.
pub fn peer_node_name(
    conn: &quinn::Connection,
    ca_pem: &Path,
) -> Result<String, PeerIdentityError> {
    if !peer_issued_by_ca(conn, ca_pem) {
        return Err(PeerIdentityError::NotClusterCa);
    }
    let mut names = connection_node_names(conn);
    match names.len() {
        0 => Err(PeerIdentityError::NoNodeName),
        1 => Ok(names.remove(0)),
        _ => Err(PeerIdentityError::SeveralNodeNames(names)),
    }
}

/// Whether the end-entity certificate `leaf` (with the `intermediates` it came with) was issued
/// by one of the CAs in `roots`: the same verification as a client certificate in a handshake
/// (signatures, validity, key usage).
pub fn chains_to(
    leaf: &CertificateDer<'_>,
    intermediates: &[CertificateDer<'_>],
    roots: rustls::RootCertStore,
) -> bool {
    let Ok(verifier) =
        rustls::server::WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider())
            .build()
    else {
        return false;
    };
    verifier
        .verify_client_cert(leaf, intermediates, rustls::pki_types::UnixTime::now())
        .is_ok()
}

/// Client configuration trusting the CA in `ca_pem` and presenting the certificate chain in
/// `cert` with its private key `key` (mutual TLS).
pub fn client_config_with_identity(
    ca_pem: &Path,
    cert: &Path,
    key: &Path,
) -> Result<quinn::ClientConfig, TlsError> {
    let roots = roots_from(ca_pem)?;
    let chain = parse_certs(&read_file(cert)?, cert)?;
    let key = parse_key(&read_file(key)?, key)?;
    let tls = rustls::ClientConfig::builder_with_provider(provider())
        .with_protocol_versions(&[&rustls::version::TLS13])?
        .with_root_certificates(roots)
        .with_client_auth_cert(chain, key)?;
    finish_client(tls)
}

/// The subject common name of the client certificate a connection presented and the server
/// verified, if any.
pub fn peer_common_name(conn: &quinn::Connection) -> Option<String> {
    let identity = conn.peer_identity()?;
    let chain = identity.downcast_ref::<Vec<CertificateDer<'static>>>()?;
    let (_, cert) = x509_parser::parse_x509_certificate(chain.first()?.as_ref()).ok()?;
    let cn = cert
        .subject()
        .iter_common_name()
        .next()?
        .as_str()
        .ok()?
        .to_string();
    Some(cn)
}

/// Issues a client certificate with subject common name `common_name`, signed by the dev CA
/// in `tls_dir` (made by [`ensure_dev_certs`]), into `out_dir` as `<name>.pem` and
/// `<name>.key`. Returns the two paths.
pub fn issue_dev_client_cert(
    tls_dir: &Path,
    common_name: &str,
    out_dir: &Path,
) -> Result<(PathBuf, PathBuf), TlsError> {
    let mut p = rcgen::CertificateParams::new(Vec::<String>::new())?;
    p.extended_key_usages = vec![rcgen::ExtendedKeyUsagePurpose::ClientAuth];
    sign_dev_leaf(tls_dir, p, common_name, out_dir, common_name)
}

/// Signs a leaf certificate with `params` (its common name `common_name`, key usage digital
/// signature, not a CA) by the dev CA in `tls_dir`, into `out_dir` as `<stem>.pem` and
/// `<stem>.key` (mode [`KEY_FILE_MODE`]). Returns the two paths.
fn sign_dev_leaf(
    tls_dir: &Path,
    mut p: rcgen::CertificateParams,
    common_name: &str,
    out_dir: &Path,
    stem: &str,
) -> Result<(PathBuf, PathBuf), TlsError> {
    let issuer = dev_ca_issuer(tls_dir)?;
    p.distinguished_name = rcgen::DistinguishedName::new();
    p.distinguished_name
        .push(rcgen::DnType::CommonName, common_name);
    p.is_ca = rcgen::IsCa::ExplicitNoCa;
    p.key_usages = vec![rcgen::KeyUsagePurpose::DigitalSignature];
    p.use_authority_key_identifier_extension = true;
    let kp = rcgen::KeyPair::generate()?;
    let cert = p.signed_by(&kp, &issuer)?;
    std::fs::create_dir_all(out_dir).map_err(io_err(out_dir))?;
    let (cert_path, key_path) = (
        out_dir.join(format!("{stem}.pem")),
        out_dir.join(format!("{stem}.key")),
    );
    write_file(
        &key_path,
        kp.serialize_pem().as_bytes(),
        Some(KEY_FILE_MODE),
    )?;
    write_file(&cert_path, cert.pem().as_bytes(), None)?;
    Ok((cert_path, key_path))
}

/// Issues a server certificate for the host names or IP addresses `names` (its subject
/// alternative names; the first is also its common name), and, for a cluster node, naming node
/// `node` ([`node_uri`]), signed by the dev CA in `tls_dir`, into `out_dir` as `<first
/// name>.pem` and `<first name>.key`. Returns the two paths. For nodes reached by their real
/// host names (clients verify the name they dial, or `--server-name`).
pub fn issue_dev_server_cert(
    tls_dir: &Path,
    names: &[String],
    node: Option<&str>,
    out_dir: &Path,
) -> Result<(PathBuf, PathBuf), TlsError> {
    let Some(first) = names.first() else {
        return Err(TlsError::Pem {
            path: out_dir.to_path_buf(),
            message: "a server certificate needs at least one name".into(),
        });
    };
    let mut p = rcgen::CertificateParams::new(names.to_vec())?;
    p.extended_key_usages = vec![
        rcgen::ExtendedKeyUsagePurpose::ServerAuth,
        rcgen::ExtendedKeyUsagePurpose::ClientAuth,
    ];
    if let Some(node) = node {
        let uri = rcgen::string::Ia5String::try_from(node_uri(node))?;
        p.subject_alt_names.push(rcgen::SanType::URI(uri));
    }
    sign_dev_leaf(tls_dir, p, first, out_dir, &first.replace(':', "_"))
}

/// Client configuration trusting only the CA certificate(s) in the PEM file `ca_pem`.
pub fn client_config(ca_pem: &Path) -> Result<quinn::ClientConfig, TlsError> {
    let pem = read_file(ca_pem)?;
    client_config_inner(&pem, ca_pem)
}

/// Client configuration trusting only the CA certificate(s) in the PEM text `ca_pem`.
pub fn client_config_from_pem(ca_pem: &[u8]) -> Result<quinn::ClientConfig, TlsError> {
    client_config_inner(ca_pem, Path::new(""))
}

fn client_config_inner(pem: &[u8], path: &Path) -> Result<quinn::ClientConfig, TlsError> {
    let tls = rustls::ClientConfig::builder_with_provider(provider())
        .with_protocol_versions(&[&rustls::version::TLS13])?
        .with_root_certificates(roots_from_pem(pem, path)?)
        .with_no_client_auth();
    finish_client(tls)
}

/// Parameters of a new dev CA whose key is `key`: its common name is [`DEV_CA_COMMON_NAME`]
/// and eight hex digits derived from the key.
fn ca_params(key: &rcgen::KeyPair) -> Result<rcgen::CertificateParams, TlsError> {
    use std::hash::{Hash, Hasher};
    let mut h = std::collections::hash_map::DefaultHasher::new();
    key.public_key_raw().hash(&mut h);
    let name = format!("{DEV_CA_COMMON_NAME} {:08x}", h.finish() as u32);
    let mut p = rcgen::CertificateParams::new(Vec::<String>::new())?;
    p.distinguished_name = rcgen::DistinguishedName::new();
    p.distinguished_name.push(rcgen::DnType::CommonName, name);
    p.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
    p.key_usages = vec![
        rcgen::KeyUsagePurpose::KeyCertSign,
        rcgen::KeyUsagePurpose::CrlSign,
        rcgen::KeyUsagePurpose::DigitalSignature,
    ];
    Ok(p)
}

/// The dev CA in `tls_dir` (`ca.pem`, `ca.key`) as an issuer: its name, key identifier and key
/// usages are read from the certificate itself, so what it signs names it exactly (also a CA
/// made before names were unique).
pub(crate) fn dev_ca_issuer(
    tls_dir: &Path,
) -> Result<rcgen::Issuer<'static, rcgen::KeyPair>, TlsError> {
    let ca_key = tls_dir.join(CA_KEY_FILE);
    let key =
        rcgen::KeyPair::from_pem(&std::fs::read_to_string(&ca_key).map_err(io_err(&ca_key))?)?;
    let ca_cert = tls_dir.join(CA_CERT_FILE);
    let pem = std::fs::read_to_string(&ca_cert).map_err(io_err(&ca_cert))?;
    Ok(rcgen::Issuer::from_ca_cert_pem(&pem, key)?)
}

/// The names a dev server certificate carries: [`DEV_SERVER_SANS`], then `extra` (host names
/// or IP addresses), each once.
fn dev_server_names(extra: &[String]) -> Vec<String> {
    let mut names: Vec<String> = DEV_SERVER_SANS.iter().map(|s| s.to_string()).collect();
    for n in extra {
        if !names.contains(n) {
            names.push(n.clone());
        }
    }
    names
}

/// The DNS names and IP addresses the leaf certificate of PEM file `cert` carries.
pub fn file_host_names(cert: &Path) -> Result<Vec<String>, TlsError> {
    let chain = parse_certs(&read_file(cert)?, cert)?;
    let Ok((_, c)) = x509_parser::parse_x509_certificate(chain[0].as_ref()) else {
        return Ok(Vec::new());
    };
    let Ok(Some(san)) = c.subject_alternative_name() else {
        return Ok(Vec::new());
    };
    Ok(san
        .value
        .general_names
        .iter()
        .filter_map(|n| match n {
            x509_parser::extensions::GeneralName::DNSName(d) => Some(d.to_string()),
            x509_parser::extensions::GeneralName::IPAddress(b) => match b.len() {
                4 => Some(std::net::IpAddr::from(<[u8; 4]>::try_from(*b).ok()?).to_string()),
                16 => Some(std::net::IpAddr::from(<[u8; 16]>::try_from(*b).ok()?).to_string()),
                _ => None,
            },
            _ => None,
        })
        .collect())
}

/// Parameters of a dev server certificate for `names`; `node`: the cluster node it names
/// ([`NODE_URI_PREFIX`]), for a clustered node.
fn server_params(
    names: Vec<String>,
    node: Option<&str>,
) -> Result<rcgen::CertificateParams, TlsError> {
    let mut p = rcgen::CertificateParams::new(names)?;
    if let Some(node) = node {
        let uri = rcgen::string::Ia5String::try_from(node_uri(node))?;
        p.subject_alt_names.push(rcgen::SanType::URI(uri));
    }
    p.distinguished_name = rcgen::DistinguishedName::new();
    p.distinguished_name
        .push(rcgen::DnType::CommonName, SERVER_NAME);
    p.is_ca = rcgen::IsCa::ExplicitNoCa;
    p.key_usages = vec![rcgen::KeyUsagePurpose::DigitalSignature];
    // A node's certificate is also its client identity towards its cluster peers.
    p.extended_key_usages = vec![
        rcgen::ExtendedKeyUsagePurpose::ServerAuth,
        rcgen::ExtendedKeyUsagePurpose::ClientAuth,
    ];
    p.use_authority_key_identifier_extension = true;
    Ok(p)
}

/// Writes `contents` to `path` atomically (temp file + rename), with `mode` on Unix.
pub(crate) fn write_file(path: &Path, contents: &[u8], mode: Option<u32>) -> Result<(), TlsError> {
    let tmp = path.with_extension(format!("tmp{}", std::process::id()));
    let mut opts = std::fs::OpenOptions::new();
    opts.write(true).create(true).truncate(true);
    #[cfg(unix)]
    if let Some(mode) = mode {
        use std::os::unix::fs::OpenOptionsExt;
        opts.mode(mode);
    }
    #[cfg(not(unix))]
    let _ = mode;
    let mut f = opts.open(&tmp).map_err(io_err(&tmp))?;
    f.write_all(contents).map_err(io_err(&tmp))?;
    f.sync_all().map_err(io_err(&tmp))?;
    drop(f);
    std::fs::rename(&tmp, path).map_err(io_err(path))
}

/// Generates into `dir` (created if missing), on first call, a dev CA (`ca.pem`, `ca.key`) and a
/// server certificate signed by it (`server.pem`, `server.key`) with SANs `localhost`,
/// `127.0.0.1` and `::1`. Existing files are reused unchanged: if the CA exists but the server
/// files are missing, a new server certificate is signed by the existing CA. Key files get
/// mode [`KEY_FILE_MODE`].
pub fn ensure_dev_certs(dir: &Path) -> Result<TlsFiles, TlsError> {
    ensure_dev_node_certs(dir, None, &[])
}

/// [`ensure_dev_certs`] for cluster node `node` (if given): its server certificate also carries
/// the node's name ([`node_uri`]), the identity its peers know it by, and the host names or IP
/// addresses `names` besides [`DEV_SERVER_SANS`] (the machine's host name, the names the node
/// is advertised by). An existing server certificate that does not name `node` (made before
/// node names were carried, or for another node) or lacks one of the names is signed again by
/// the dev CA; without the CA's key, a missing node name is an error and missing host names
/// are only logged.
pub fn ensure_dev_node_certs(
    dir: &Path,
    node: Option<&str>,
    names: &[String],
) -> Result<TlsFiles, TlsError> {
    let names = dev_server_names(names);
    std::fs::create_dir_all(dir).map_err(io_err(dir))?;
    let ca_cert = dir.join(CA_CERT_FILE);
    let ca_key = dir.join(CA_KEY_FILE);
    let files = TlsFiles {
        ca: ca_cert.clone(),
        cert: dir.join(SERVER_CERT_FILE),
        key: dir.join(SERVER_KEY_FILE),
    };
    if files.cert.exists() && files.key.exists() && ca_cert.exists() {
        let nodes = file_node_names(&files.cert)?;
        let held = file_host_names(&files.cert)?;
        let missing: Vec<&String> = names.iter().filter(|n| !held.contains(n)).collect();
        // A single node keeps whatever node name its certificate has (from an earlier run in a
        // cluster): it is not used.
        let node_ok = match node {
            None => true,
            Some(n) => nodes == [n],
        };
        match node {
            _ if node_ok && missing.is_empty() => return Ok(files),
            _ if node_ok && !ca_key.exists() => {
                tracing::warn!(
                    cert = %files.cert.display(),
                    ?missing,
                    "the dev server certificate lacks these names and there is no dev CA key to sign one that has them"
                );
                return Ok(files);
            }
            Some(n) if !ca_key.exists() => {
                return Err(TlsError::Pem {
                    path: files.cert.clone(),
                    message: format!(
                        "does not name cluster node {n:?} (SAN {}), and there is no dev CA key ({}) to sign one that does",
                        node_uri(n),
                        ca_key.display()
                    ),
                });
            }
            _ => {}
        }
    }

    if !(ca_cert.exists() && ca_key.exists()) {
        let kp = rcgen::KeyPair::generate()?;
        let cert = ca_params(&kp)?.self_signed(&kp)?;
        write_file(&ca_key, kp.serialize_pem().as_bytes(), Some(KEY_FILE_MODE))?;
        write_file(&ca_cert, cert.pem().as_bytes(), None)?;
        tracing::info!(dir = %dir.display(), "generated dev CA");
    }
    let issuer = dev_ca_issuer(dir)?;

    let server_kp = rcgen::KeyPair::generate()?;
    let server_cert = server_params(names, node)?.signed_by(&server_kp, &issuer)?;
    write_file(
        &files.key,
        server_kp.serialize_pem().as_bytes(),
        Some(KEY_FILE_MODE),
    )?;
    write_file(&files.cert, server_cert.pem().as_bytes(), None)?;
    tracing::info!(dir = %dir.display(), node, "generated dev server certificate");
    Ok(files)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn transport_config_builds() {
        let _ = transport_config();
    }

    fn subject_and_issuer(cert: &Path) -> (String, String) {
        let der = parse_certs(&read_file(cert).unwrap(), cert)
            .unwrap()
            .swap_remove(0);
        let (_, c) = x509_parser::parse_x509_certificate(der.as_ref()).unwrap();
        (c.subject().to_string(), c.issuer().to_string())
    }

    #[test]
    fn every_dev_ca_has_its_own_name_and_signs_under_it() {
        let (a, b) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
        let fa = ensure_dev_certs(a.path()).unwrap();
        let fb = ensure_dev_certs(b.path()).unwrap();
        let (ca_a, _) = subject_and_issuer(&fa.ca);
        let (ca_b, _) = subject_and_issuer(&fb.ca);
        assert!(
            ca_a.starts_with(&format!("CN={DEV_CA_COMMON_NAME} ")),
            "{ca_a}"
        );
        assert_ne!(ca_a, ca_b, "two dev CAs share a name");
        assert_eq!(subject_and_issuer(&fa.cert).1, ca_a);
        let (cert, _) = issue_dev_client_cert(a.path(), "alice", a.path()).unwrap();
        assert_eq!(
            subject_and_issuer(&cert),
            ("CN=alice".to_string(), ca_a.clone())
        );
        assert!(chains_to(
            &parse_certs(&read_file(&cert).unwrap(), &cert).unwrap()[0],
            &[],
            roots_from(&fa.ca).unwrap()
        ));
        // A server certificate signed again later (its files deleted) names the same CA.
        std::fs::remove_file(&fa.cert).unwrap();
        let again = ensure_dev_certs(a.path()).unwrap();
        assert_eq!(subject_and_issuer(&again.cert).1, ca_a);
    }

    #[test]
    fn a_dev_ca_from_before_unique_names_still_signs() {
        let dir = tempfile::tempdir().unwrap();
        let kp = rcgen::KeyPair::generate().unwrap();
        let mut params = ca_params(&kp).unwrap();
        params.distinguished_name = rcgen::DistinguishedName::new();
        params
            .distinguished_name
            .push(rcgen::DnType::CommonName, DEV_CA_COMMON_NAME);
        let ca = params.self_signed(&kp).unwrap();
        write_file(
            &dir.path().join(CA_KEY_FILE),
            kp.serialize_pem().as_bytes(),
            None,
        )
        .unwrap();
        write_file(&dir.path().join(CA_CERT_FILE), ca.pem().as_bytes(), None).unwrap();
        let files = ensure_dev_certs(dir.path()).unwrap();
        let (_, issuer) = subject_and_issuer(&files.cert);
        assert_eq!(issuer, format!("CN={DEV_CA_COMMON_NAME}"));
        assert!(chains_to(
            &parse_certs(&read_file(&files.cert).unwrap(), &files.cert).unwrap()[0],
            &[],
            roots_from(&files.ca).unwrap()
        ));
    }

    #[test]
    fn a_cluster_node_certificate_names_its_node_and_a_client_certificate_none() {
        let dir = tempfile::tempdir().unwrap();
        let plain = ensure_dev_certs(dir.path()).unwrap();
        assert!(file_node_names(&plain.cert).unwrap().is_empty());
        // The same data directory started as cluster node n1: signed again, naming n1.
        let n1 = ensure_dev_node_certs(dir.path(), Some("n1"), &[]).unwrap();
        assert_eq!(file_node_names(&n1.cert).unwrap(), ["n1"]);
        let before = std::fs::read(&n1.cert).unwrap();
        ensure_dev_node_certs(dir.path(), Some("n1"), &[]).unwrap();
        assert_eq!(
            std::fs::read(&n1.cert).unwrap(),
            before,
            "a fitting certificate is kept"
        );
        // Renamed to n2: a certificate naming n2 only.
        let n2 = ensure_dev_node_certs(dir.path(), Some("n2"), &[]).unwrap();
        assert_eq!(file_node_names(&n2.cert).unwrap(), ["n2"]);
        // Client certificates from the same CA name no node.
        let (alice, _) = issue_dev_client_cert(dir.path(), "alice", dir.path()).unwrap();
        assert!(file_node_names(&alice).unwrap().is_empty());
        // Without the CA's key, a certificate for another node cannot be made: a clear error.
        std::fs::remove_file(dir.path().join(CA_KEY_FILE)).unwrap();
        let e = ensure_dev_node_certs(dir.path(), Some("n3"), &[])
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("does not name cluster node \"n3\"") && e.contains(CA_KEY_FILE),
            "{e}"
        );
    }

    #[test]
    fn a_dev_certificate_carries_the_names_a_local_setup_needs() {
        let dir = tempfile::tempdir().unwrap();
        let plain = ensure_dev_certs(dir.path()).unwrap();
        assert_eq!(
            file_host_names(&plain.cert).unwrap(),
            ["localhost", "127.0.0.1", "::1"]
        );
        let ca = std::fs::read(&plain.ca).unwrap();
        // An advertised name (and the machine's host name) missing: signed again, by the same CA.
        let names = ["tether-9.test".to_string(), "10.1.2.3".to_string()];
        let f = ensure_dev_node_certs(dir.path(), None, &names).unwrap();
        assert_eq!(
            file_host_names(&f.cert).unwrap(),
            ["localhost", "127.0.0.1", "::1", "tether-9.test", "10.1.2.3"]
        );
        assert_eq!(std::fs::read(&f.ca).unwrap(), ca);
        let before = std::fs::read(&f.cert).unwrap();
        ensure_dev_node_certs(dir.path(), None, &names[..1]).unwrap();
        assert_eq!(
            std::fs::read(&f.cert).unwrap(),
            before,
            "a certificate that has every name is kept"
        );
        // Without the CA's key a missing host name is no reason to refuse to start.
        std::fs::remove_file(dir.path().join(CA_KEY_FILE)).unwrap();
        ensure_dev_node_certs(dir.path(), None, &["tether-10.test".to_string()]).unwrap();
        assert_eq!(std::fs::read(&f.cert).unwrap(), before);
    }

    #[test]
    fn bad_pem_is_an_error() {
        assert!(matches!(
            client_config_from_pem(b"not pem"),
            Err(TlsError::Pem { .. })
        ));
    }
}
