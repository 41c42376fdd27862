//! Reloading the `[auth]` table of a running node: tokens, admins and region ACLs.
//!
//! A node started with [`ServerConfig::auth_file`](crate::config::ServerConfig::auth_file)
//! looks at that file every [`AUTH_RELOAD_INTERVAL_MS`]. When it changed, the node reads its
//! `[auth]` table again and, if it is valid, puts the new [`Authorizer`] in force at once (it
//! replaces `Shared::authorizer`):
//! - later connections authenticate against it;
//! - every request of an open connection is checked against its admins and ACLs;
//! - open connections that authenticated with a token it no longer has (or now gives to another
//!   principal) are closed with `unauthenticated` ("token withdrawn"). Their durable queues
//!   stay, as after any lost connection, for their owner to resume with valid credentials.
//!
//! A file that cannot be read, is not valid TOML, has no `[auth]` table (a secured node never
//! turns open without a restart) or an invalid one is refused: the table in force stays, and
//! the refusal is logged and counted. `client-ca` and `client-crl` are read at start only (the
//! revocation list itself is reloaded by `revocation.rs`); a change to them is logged and waits
//! for a restart.

use crate::bug::{LockExt, RwLockExt};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Weak};
use std::time::{Duration, SystemTime};

use super::Shared;
use crate::auth::{AuthConfig, Authorizer};
use crate::config::{ConfigError, FileConfig};
use crate::protocol::ErrorCode;

/// How often a node looks at its configuration file for a changed `[auth]` table, in
/// milliseconds.
pub const AUTH_RELOAD_INTERVAL_MS: u64 = 1_000;

/// Reads the `[auth]` table of `path` and builds its authorizer.
fn load(path: &Path) -> Result<(AuthConfig, Authorizer), ReloadRefused> {
    let file = FileConfig::load(path)?;
    let auth = file.auth.ok_or(ReloadRefused::NoAuthTable)?;
    let authorizer = Authorizer::new(&auth).map_err(ConfigError::from)?;
    Ok((auth, authorizer))
}

/// Why a changed configuration file's `[auth]` table is not taken (the one in force stays).
#[derive(Debug, thiserror::Error)]
enum ReloadRefused {
    #[error("{0}")]
    Config(#[from] ConfigError),
    #[error(
        "it has no [auth] table (a node started with one keeps authenticating; restart it to \
         open it)"
    )]
    NoAuthTable,
}

/// Watches `path` (see the module documentation). `started` is the `[auth]` table the node
/// started with, `seen` the file's modification time then.
pub(super) async fn watch(
    shared: Weak<Shared>,
    path: PathBuf,
    started: AuthConfig,
    seen: Option<SystemTime>,
) {
    let mut file = super::revocation::FileWatch::new(
        path,
        seen,
        Duration::from_millis(AUTH_RELOAD_INTERVAL_MS),
    );
    loop {
        file.changed().await;
        let path = file.path();
        let Some(shared) = shared.upgrade() else {
            return;
        };
        match load(path) {
            Ok((auth, authorizer)) => {
                metrics::counter!(crate::metrics::AUTH_RELOADS, "result" => "ok").increment(1);
                if (&auth.client_ca, &auth.client_crl) != (&started.client_ca, &started.client_crl)
                {
                    tracing::warn!(
                        path = %path.display(),
                        "auth.client-ca and auth.client-crl are read at start: their change waits for a restart"
                    );
                }
                let closed = shared.replace_authorizer(Arc::new(authorizer));
                tracing::info!(
                    path = %path.display(),
                    tokens = auth.tokens.len(),
                    closed,
                    "[auth] reloaded"
                );
            }
            Err(e) => {
                metrics::counter!(crate::metrics::AUTH_RELOADS, "result" => "error").increment(1);
                tracing::error!(
                    path = %path.display(),
                    error = %e,
                    "[auth] not reloaded; the table in force stays"
                );
            }
        }
    }
}

impl Shared {
    /// The authorizer in force; None on an open node.
    pub(crate) fn authorizer(&self) -> Option<Arc<Authorizer>> {
        let auth = self.auth.as_ref()?;
        Some(auth.read_or_stop().clone())
    }

    /// Puts `authorizer` in force (on a node with `[auth]`) and closes the open connections
    /// whose token it no longer gives to the principal they authenticated as; returns how many.
    pub(crate) fn replace_authorizer(&self, authorizer: Arc<Authorizer>) -> usize {
        let Some(auth) = self.auth.as_ref() else {
            return 0;
        };
        *auth.write_or_stop() = authorizer.clone();
        let withdrawn: Vec<quinn::Connection> = self
            .sessions
            .lock_or_stop()
            .values()
            .filter(|s| {
                s.token.as_ref().is_some_and(|(digest, principal)| {
                    authorizer.token_principal(digest) != Some(principal.as_str())
                })
            })
            .filter_map(|s| s.conn.clone())
            .collect();
        for conn in &withdrawn {
            conn.close(ErrorCode::Unauthenticated.varint(), b"token withdrawn");
        }
        metrics::counter!(crate::metrics::WITHDRAWN_TOKEN_CONNECTIONS_CLOSED)
            .increment(withdrawn.len() as u64);
        withdrawn.len()
    }
}
