//! Authentication and authorization: bearer tokens (stored as SHA-256 hashes), per-principal
//! region ACLs with glob patterns, and the admin role. Plain data, no I/O.
//!
//! With no `[auth]` table a node is open (any client that trusts its CA may do anything), which
//! is what `make run` gives for development. With one, every connection presents a token or a
//! client certificate issued by `client-ca` (its subject common name is the principal); the
//! principal is checked on every request:
//! - `publish` patterns gate publishes, `subscribe` patterns gate interest registration and
//!   reads (`get`), per region;
//! - admin principals may do everything, including `tether queues` and `close-durable`;
//! - a durable id belongs to the principal that created its queue: no other principal can
//!   attach to it (enforced by the core, see `NodeCore::connect_as`), and a copy's owner is
//!   checked before a client's failover may promote it (`placement::check_copy_owner`).
//!
//! Each connection authenticates anew, so the credentials of the latest connection are the ones
//! that count.

use std::collections::{HashMap, HashSet};

use serde::Deserialize;

use crate::protocol::{ErrorCode, WireError};

pub use crate::limits::TOKEN_BYTES_MAX;

/// The `[auth]` table of the configuration file.
#[derive(Clone, Debug, Default, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "kebab-case")]
pub struct AuthConfig {
    /// CA (PEM file) whose client certificates authenticate their subject common name as the
    /// principal (mutual TLS). Without it only tokens authenticate.
    #[serde(default)]
    pub client_ca: Option<std::path::PathBuf>,
    /// Certificate revocation lists (PEM file, `X509 CRL` sections, e.g. written by `tether
    /// revoke-client-cert`) for the client certificates: a revoked certificate fails the
    /// handshake. The node reloads the file when it changes and closes open connections whose
    /// certificate the new lists revoke.
    #[serde(default)]
    pub client_crl: Option<std::path::PathBuf>,
    /// Principals with the admin role.
    #[serde(default)]
    pub admins: Vec<String>,
    #[serde(default)]
    pub tokens: Vec<TokenEntry>,
    #[serde(default)]
    pub acl: Vec<AclEntry>,
}

/// A bearer token, stored as the hex SHA-256 of the token (`tether hash-token` prints it).
#[derive(Clone, Debug, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "kebab-case")]
pub struct TokenEntry {
    pub principal: String,
    pub sha256: String,
}

/// What a principal (or `*`, everyone) may do, by region-name glob (`*` any run, `?` one char).
#[derive(Clone, Debug, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "kebab-case")]
pub struct AclEntry {
    pub principal: String,
    #[serde(default)]
    pub publish: Vec<String>,
    #[serde(default)]
    pub subscribe: Vec<String>,
}

/// An authenticated client.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Principal {
    pub name: String,
    pub admin: bool,
}

/// What a request needs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Access<'a> {
    Publish(&'a str),
    Subscribe(&'a str),
    Admin,
}

/// The node's authorization state, built from the `[auth]` table (again whenever a node reloads
/// it: `server/auth_reload.rs`).
#[derive(Debug)]
pub struct Authorizer {
    tokens: HashMap<TokenDigest, String>,
    admins: HashSet<String>,
    acl: Vec<AclEntry>,
}

/// The SHA-256 of a token: how an [`Authorizer`] knows it.
pub type TokenDigest = [u8; 32];

/// The SHA-256 of a token.
pub fn token_digest(token: &str) -> TokenDigest {
    let d = ring::digest::digest(&ring::digest::SHA256, token.as_bytes());
    d.as_ref().try_into().expect("sha256 is 32 bytes")
}

/// The hex SHA-256 of a token, as stored in the configuration.
pub fn hash_token(token: &str) -> String {
    token_digest(token)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

fn parse_hash(hex: &str) -> Option<TokenDigest> {
    if hex.len() != 64 {
        return None;
    }
    let mut out = [0u8; 32];
    for (i, byte) in out.iter_mut().enumerate() {
        *byte = u8::from_str_radix(hex.get(2 * i..2 * i + 2)?, 16).ok()?;
    }
    Some(out)
}

/// Glob match of a region name: `*` matches any run of characters, `?` exactly one.
pub fn glob_match(pattern: &str, name: &str) -> bool {
    let (p, n): (Vec<char>, Vec<char>) = (pattern.chars().collect(), name.chars().collect());
    // Iterative matching with backtracking to the last star: linear in practice.
    let (mut pi, mut ni, mut star, mut mark) = (0, 0, None, 0);
    while ni < n.len() {
        if pi < p.len() && (p[pi] == '?' || p[pi] == n[ni]) {
            pi += 1;
            ni += 1;
        } else if pi < p.len() && p[pi] == '*' {
            star = Some(pi);
            mark = ni;
            pi += 1;
        } else if let Some(s) = star {
            pi = s + 1;
            mark += 1;
            ni = mark;
        } else {
            return false;
        }
    }
    p[pi..].iter().all(|&c| c == '*')
}

/// An `[auth]` table refused ([`Authorizer::new`]).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum AuthConfigError {
    #[error("auth.tokens: a token needs a principal")]
    TokenWithoutPrincipal,
    #[error(
        "auth.tokens: a principal name of {0} bytes (at most {max})",
        max = crate::limits::PRINCIPAL_BYTES_MAX
    )]
    PrincipalTooLong(usize),
    #[error("auth.tokens: the sha256 of {0:?} must be 64 hex digits (see tether hash-token)")]
    BadHash(String),
    #[error("auth.tokens: the token of {0:?} is listed twice")]
    TokenListedTwice(String),
    #[error("auth.acl: an entry needs a principal (or \"*\")")]
    AclWithoutPrincipal,
    #[error("auth.acl: empty pattern for {0:?}")]
    AclEmptyPattern(String),
}

fn forbidden(msg: String) -> WireError {
    WireError::new(ErrorCode::Forbidden, msg)
}

impl Authorizer {
    /// Validates the configuration: token hashes, principal names, patterns.
    pub fn new(config: &AuthConfig) -> Result<Self, AuthConfigError> {
        let mut tokens = HashMap::new();
        for t in &config.tokens {
            if t.principal.is_empty() {
                return Err(AuthConfigError::TokenWithoutPrincipal);
            }
            if t.principal.len() > crate::limits::PRINCIPAL_BYTES_MAX {
                return Err(AuthConfigError::PrincipalTooLong(t.principal.len()));
            }
            let h = parse_hash(&t.sha256.to_ascii_lowercase())
                .ok_or_else(|| AuthConfigError::BadHash(t.principal.clone()))?;
            if tokens.insert(h, t.principal.clone()).is_some() {
                return Err(AuthConfigError::TokenListedTwice(t.principal.clone()));
            }
        }
        for a in &config.acl {
            if a.principal.is_empty() {
                return Err(AuthConfigError::AclWithoutPrincipal);
            }
            if a.publish.iter().chain(&a.subscribe).any(String::is_empty) {
                return Err(AuthConfigError::AclEmptyPattern(a.principal.clone()));
            }
        }
        Ok(Authorizer {
            tokens,
            admins: config.admins.iter().cloned().collect(),
            acl: config.acl.clone(),
        })
    }

    /// The principal of a connection: its token's if it presented one, else the common name of
    /// its verified client certificate (`cert_name`, only when `client-ca` is configured).
    pub fn authenticate(
        &self,
        token: Option<&str>,
        cert_name: Option<&str>,
    ) -> Result<Principal, WireError> {
        let unauthenticated = |m: &str| WireError::new(ErrorCode::Unauthenticated, m);
        let token = match (token, cert_name) {
            (Some(t), _) => t,
            (None, Some(name)) => {
                if name.len() > crate::limits::PRINCIPAL_BYTES_MAX {
                    return Err(unauthenticated(
                        "the client certificate's common name is too long",
                    ));
                }
                return Ok(Principal {
                    name: name.to_string(),
                    admin: self.admins.contains(name),
                });
            }
            (None, None) => {
                return Err(unauthenticated(
                    "this server requires a token (--token) or a client certificate (--cert)",
                ));
            }
        };
        if token.len() > TOKEN_BYTES_MAX {
            return Err(unauthenticated("token too long"));
        }
        let name = self
            .tokens
            .get(&token_digest(token))
            .ok_or_else(|| unauthenticated("unknown token"))?;
        Ok(Principal {
            name: name.clone(),
            admin: self.admins.contains(name),
        })
    }

    /// The principal a token (by its [`token_digest`]) authenticates, if it is configured.
    pub fn token_principal(&self, digest: &TokenDigest) -> Option<&str> {
        self.tokens.get(digest).map(String::as_str)
    }

    /// Whether `principal` may do `access`; the error says what is missing. The admin role and
    /// the ACL are this authorizer's, whatever they were when the principal authenticated (a
    /// reloaded `[auth]` table applies to the next request of every connection).
    pub fn check(&self, principal: &Principal, access: Access<'_>) -> Result<(), WireError> {
        if self.admins.contains(&principal.name) {
            return Ok(());
        }
        let entries = || {
            self.acl
                .iter()
                .filter(|a| a.principal == principal.name || a.principal == "*")
        };
        let allowed = match access {
            Access::Admin => false,
            Access::Publish(region) => {
                entries().any(|a| a.publish.iter().any(|p| glob_match(p, region)))
            }
            Access::Subscribe(region) => {
                entries().any(|a| a.subscribe.iter().any(|p| glob_match(p, region)))
            }
        };
        if allowed {
            return Ok(());
        }
        Err(forbidden(match access {
            Access::Admin => format!("{} is not an admin", principal.name),
            Access::Publish(r) => format!("{} may not publish to region {r:?}", principal.name),
            Access::Subscribe(r) => format!("{} may not subscribe to region {r:?}", principal.name),
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn globs() {
        assert!(glob_match("prices", "prices"));
        assert!(glob_match("fx-*", "fx-eur"));
        assert!(glob_match("*", ""));
        assert!(glob_match("a*b*c", "axxbyyc"));
        assert!(glob_match("?x", "ax"));
        assert!(!glob_match("fx-*", "fy-eur"));
        assert!(!glob_match("prices", "prices2"));
        assert!(!glob_match("a*b", "acbd"));
    }

    fn authorizer() -> Authorizer {
        Authorizer::new(&AuthConfig {
            client_ca: None,
            client_crl: None,
            admins: vec!["ops".into()],
            tokens: vec![
                TokenEntry {
                    principal: "alice".into(),
                    sha256: hash_token("a-secret"),
                },
                TokenEntry {
                    principal: "ops".into(),
                    sha256: hash_token("o-secret").to_uppercase(),
                },
            ],
            acl: vec![
                AclEntry {
                    principal: "alice".into(),
                    publish: vec!["fx-*".into()],
                    subscribe: vec![],
                },
                AclEntry {
                    principal: "*".into(),
                    publish: vec![],
                    subscribe: vec!["public".into()],
                },
            ],
        })
        .unwrap()
    }

    #[test]
    fn principal_names_are_bounded() {
        use crate::limits::PRINCIPAL_BYTES_MAX;
        let a = authorizer();
        let long = "c".repeat(PRINCIPAL_BYTES_MAX + 1);
        assert_eq!(
            a.authenticate(None, Some(&long)).unwrap_err().code,
            ErrorCode::Unauthenticated
        );
        let fits = "c".repeat(PRINCIPAL_BYTES_MAX);
        assert_eq!(a.authenticate(None, Some(&fits)).unwrap().name, fits);
        let config = AuthConfig {
            client_ca: None,
            client_crl: None,
            admins: vec![],
            tokens: vec![TokenEntry {
                principal: long,
                sha256: hash_token("l-secret"),
            }],
            acl: vec![],
        };
        let Err(err) = Authorizer::new(&config) else {
            panic!("a long principal is refused");
        };
        assert!(err.to_string().contains("principal name"), "{err}");
    }

    #[test]
    fn tokens_map_to_principals() {
        let a = authorizer();
        assert_eq!(
            a.authenticate(Some("a-secret"), None).unwrap(),
            Principal {
                name: "alice".into(),
                admin: false
            }
        );
        assert!(a.authenticate(Some("o-secret"), None).unwrap().admin);
        assert_eq!(
            a.authenticate(Some("nope"), None).unwrap_err().code,
            ErrorCode::Unauthenticated
        );
        assert_eq!(
            a.authenticate(None, None).unwrap_err().code,
            ErrorCode::Unauthenticated
        );
        let carol = a.authenticate(None, Some("carol")).unwrap();
        assert_eq!(
            carol,
            Principal {
                name: "carol".into(),
                admin: false
            }
        );
        assert!(a.authenticate(None, Some("ops")).unwrap().admin);
        let both = a.authenticate(Some("a-secret"), Some("ops")).unwrap();
        assert_eq!(both.name, "alice", "a token wins over a certificate");
    }

    #[test]
    fn a_new_table_decides_for_principals_authenticated_under_the_old_one() {
        let old = authorizer();
        let ops = old.authenticate(Some("o-secret"), None).unwrap();
        let alice = old.authenticate(Some("a-secret"), None).unwrap();
        assert_eq!(
            old.token_principal(&token_digest("o-secret")),
            Some("ops"),
            "a stored hash in upper case is the same token"
        );
        // Reloaded: ops loses the admin role and its token, alice keeps hers.
        let new = Authorizer::new(&AuthConfig {
            admins: vec![],
            tokens: vec![TokenEntry {
                principal: "alice".into(),
                sha256: hash_token("a-secret"),
            }],
            ..AuthConfig::default()
        })
        .unwrap();
        assert!(ops.admin, "as authenticated");
        assert_eq!(
            new.check(&ops, Access::Admin).unwrap_err().code,
            ErrorCode::Forbidden
        );
        assert_eq!(new.token_principal(&token_digest("o-secret")), None);
        assert_eq!(
            new.token_principal(&token_digest("a-secret")),
            Some("alice")
        );
        assert!(
            new.check(&alice, Access::Publish("fx-eur")).is_err(),
            "no ACL entry any more"
        );
    }

    #[test]
    fn acl_and_admin() {
        let a = authorizer();
        let alice = a.authenticate(Some("a-secret"), None).unwrap();
        assert!(a.check(&alice, Access::Publish("fx-eur")).is_ok());
        assert!(
            a.check(&alice, Access::Subscribe("public")).is_ok(),
            "the * entry applies to all"
        );
        let e = a.check(&alice, Access::Subscribe("fx-eur")).unwrap_err();
        assert_eq!(e.code, ErrorCode::Forbidden);
        assert!(e.message.contains("may not subscribe"), "{}", e.message);
        assert!(a.check(&alice, Access::Admin).is_err());
        let ops = a.authenticate(Some("o-secret"), None).unwrap();
        assert!(a.check(&ops, Access::Admin).is_ok());
    }

    #[test]
    fn bad_configuration_is_refused() {
        let bad = AuthConfig {
            tokens: vec![TokenEntry {
                principal: "x".into(),
                sha256: "abc".into(),
            }],
            ..Default::default()
        };
        assert!(
            Authorizer::new(&bad)
                .unwrap_err()
                .to_string()
                .contains("64 hex digits")
        );
        let dup = AuthConfig {
            tokens: vec![
                TokenEntry {
                    principal: "x".into(),
                    sha256: hash_token("t"),
                },
                TokenEntry {
                    principal: "y".into(),
                    sha256: hash_token("t"),
                },
            ],
            ..Default::default()
        };
        assert!(Authorizer::new(&dup).is_err());
    }
}
