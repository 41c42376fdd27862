//! Client certificate revocation on a running node: the server's TLS configuration is built
//! with the revocation lists of `[auth] client-crl`, and a task watches that file. When it
//! changes, the new lists apply to every later handshake (the endpoint's configuration is
//! replaced) and every open connection whose certificate they revoke is closed with
//! `unauthenticated`. A damaged new file is refused and the lists in force stay.
//!
//! `FileWatch`, the modification-time poll, serves both reload tasks (this one and
//! `auth_reload.rs`). The lists themselves (loading, matching a certificate, the signing of
//! `tether revoke-client-cert`) are in `transport/src/crl.rs`.

use crate::bug::LockExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use tether_transport::crl::Crls;
use tether_transport::tls::{self, TlsFiles};

use super::{NodeError, Shared};
use crate::protocol::ErrorCode;

/// How often a node looks at its client CRL file for a change, in milliseconds.
pub const CRL_RELOAD_INTERVAL_MS: u64 = 1_000;

/// What a node's TLS server configuration is made of (kept to rebuild it on a CRL change).
pub(super) struct TlsSetup {
    pub files: TlsFiles,
    pub clustered: bool,
    pub client_ca: Option<PathBuf>,
    pub idle_timeout_ms: u64,
    pub receive_window_bytes: u64,
    pub send_window_bytes: u64,
    /// The peer protocol versions this node speaks ([`crate::config::ServerConfig::peer_protocol_versions`]).
    pub peer_versions: std::ops::RangeInclusive<u32>,
}

impl TlsSetup {
    /// The server configuration with these revocation lists.
    pub fn server_config(&self, crls: &Crls) -> Result<quinn::ServerConfig, NodeError> {
        let mut config = match self.client_ca.as_deref() {
            _ if self.clustered => tls::server_config_for_cluster(
                &self.files,
                self.client_ca.as_deref(),
                &crls.ders,
                self.peer_versions.clone(),
            )?,
            Some(client_ca) => {
                tls::server_config_with_client_ca(&self.files, client_ca, &crls.ders)?
            }
            None => tls::server_config(&self.files)?,
        };
        let transport = tls::server_transport_config(
            Duration::from_millis(self.idle_timeout_ms),
            self.receive_window_bytes,
            self.send_window_bytes,
        )?;
        config.transport_config(Arc::new(transport));
        Ok(config)
    }
}

/// The lists in `path` at start: an unreadable or damaged file stops the node with its reason.
pub(super) fn load_at_start(path: &Path) -> Result<(Crls, Option<SystemTime>), NodeError> {
    let modified = modified(path);
    let crls = Crls::load(path).map_err(NodeError::ClientCrl)?;
    Ok((crls, modified))
}

/// A file's modification time, if it can be read.
pub(super) fn modified(path: &Path) -> Option<SystemTime> {
    std::fs::metadata(path).and_then(|m| m.modified()).ok()
}

/// Looks at a file every `interval` for a change of its modification time.
pub(super) struct FileWatch {
    path: PathBuf,
    seen: Option<SystemTime>,
    tick: tokio::time::Interval,
}

impl FileWatch {
    /// Watches `path`, whose modification time was `seen` when it was last read.
    pub(super) fn new(path: PathBuf, seen: Option<SystemTime>, interval: Duration) -> Self {
        let mut tick = tokio::time::interval(interval);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        FileWatch { path, seen, tick }
    }

    pub(super) fn path(&self) -> &Path {
        &self.path
    }

    /// Returns once the file's modification time differs from the one last seen.
    pub(super) async fn changed(&mut self) {
        loop {
            self.tick.tick().await;
            let now = modified(&self.path);
            if now != self.seen {
                self.seen = now;
                return;
            }
        }
    }
}

/// Watches `path` every [`CRL_RELOAD_INTERVAL_MS`]; see the module documentation.
pub(super) async fn watch(
    shared: std::sync::Weak<Shared>,
    endpoint: quinn::Endpoint,
    setup: TlsSetup,
    path: PathBuf,
    seen: Option<SystemTime>,
) {
    let mut file = FileWatch::new(
        path.clone(),
        seen,
        Duration::from_millis(CRL_RELOAD_INTERVAL_MS),
    );
    loop {
        file.changed().await;
        let applied = Crls::load(&path)
            .map_err(|e| e.to_string())
            .and_then(|crls| {
                let config = setup.server_config(&crls).map_err(|e| e.to_string())?;
                endpoint.set_server_config(Some(config));
                Ok(crls)
            });
        match applied {
            Ok(crls) => {
                metrics::counter!(crate::metrics::CLIENT_CRL_RELOADS, "result" => "ok")
                    .increment(1);
                let Some(shared) = shared.upgrade() else {
                    return;
                };
                let closed = close_revoked(&shared, &crls);
                tracing::info!(
                    path = %path.display(),
                    revoked = crls.revoked_count(),
                    closed,
                    "client certificate revocation list reloaded"
                );
            }
            Err(e) => {
                metrics::counter!(crate::metrics::CLIENT_CRL_RELOADS, "result" => "error")
                    .increment(1);
                tracing::error!(
                    path = %path.display(),
                    error = %e,
                    "client certificate revocation list not reloaded; the previous one stays in force"
                );
            }
        }
    }
}

/// Closes every open client connection whose certificate `crls` revoke; returns how many.
fn close_revoked(shared: &Shared, crls: &Crls) -> usize {
    let conns: Vec<quinn::Connection> = shared
        .sessions
        .lock_or_stop()
        .values()
        .filter_map(|s| s.conn.clone())
        .collect();
    let mut closed = 0;
    for conn in conns {
        if crls.revokes_peer(&conn) {
            conn.close(
                ErrorCode::Unauthenticated.varint(),
                b"client certificate revoked",
            );
            closed += 1;
        }
    }
    metrics::counter!(crate::metrics::REVOKED_CONNECTIONS_CLOSED).increment(closed as u64);
    closed
}
