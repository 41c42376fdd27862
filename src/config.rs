//! Server configuration: command-line flags and the TOML file (flags win), validated.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use serde::Deserialize;

/// How storage writes reach the disk.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum SyncMode {
    /// fsync every write request on its own.
    Always,
    /// Group commit: concurrent write requests share one write batch and one fsync.
    #[default]
    Batch,
    /// No fsync: writes reach the OS (they survive a process kill, not a machine crash).
    None,
}

impl std::str::FromStr for SyncMode {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "always" => Ok(SyncMode::Always),
            "batch" => Ok(SyncMode::Batch),
            "none" => Ok(SyncMode::None),
            other => Err(format!(
                "unknown sync mode {other:?} (expected always, batch or none)"
            )),
        }
    }
}

/// Server certificate files; without them a dev CA and certificate are generated into
/// `<data-dir>/tls/`.
#[derive(Clone, Debug, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TlsConfig {
    pub cert: PathBuf,
    pub key: PathBuf,
    /// The CA clients should trust (printed in the listening line).
    pub ca: PathBuf,
}

/// A node's configuration.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ServerConfig {
    pub data_dir: PathBuf,
    pub listen: SocketAddr,
    /// Prometheus `/metrics` address; None disables the endpoint.
    pub metrics: Option<SocketAddr>,
    pub node_id: Option<String>,
    pub sync: SyncMode,
    pub tls: Option<TlsConfig>,
}

/// Default client/peer address.
pub const DEFAULT_LISTEN: &str = "127.0.0.1:7400";
/// Default metrics address.
pub const DEFAULT_METRICS: &str = "127.0.0.1:9400";
/// Longest node id, in bytes.
pub const NODE_ID_BYTES_MAX: usize = 64;

impl Default for ServerConfig {
    fn default() -> Self {
        ServerConfig {
            data_dir: PathBuf::from("data"),
            listen: DEFAULT_LISTEN.parse().expect("valid default"),
            metrics: Some(DEFAULT_METRICS.parse().expect("valid default")),
            node_id: None,
            sync: SyncMode::Batch,
            tls: None,
        }
    }
}

impl ServerConfig {
    /// A config for tests and embedding: loopback port 0, metrics off, data in `dir`.
    pub fn ephemeral(dir: impl Into<PathBuf>) -> Self {
        ServerConfig {
            data_dir: dir.into(),
            listen: "127.0.0.1:0".parse().expect("valid"),
            metrics: None,
            ..Default::default()
        }
    }
}

/// The TOML file: every field optional; unknown fields are an error.
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "kebab-case")]
pub struct FileConfig {
    pub data_dir: Option<PathBuf>,
    pub listen: Option<String>,
    pub metrics: Option<String>,
    pub node_id: Option<String>,
    pub sync: Option<SyncMode>,
    pub tls: Option<TlsConfig>,
}

impl FileConfig {
    pub fn load(path: &Path) -> Result<Self, String> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| format!("cannot read config file {}: {e}", path.display()))?;
        toml::from_str(&text).map_err(|e| format!("invalid config file {}: {e}", path.display()))
    }
}

/// Parses a socket address, with a message naming the setting.
pub fn parse_addr(what: &str, s: &str) -> Result<SocketAddr, String> {
    s.parse().map_err(|_| {
        format!("invalid {what} address {s:?} (expected IP:PORT, e.g. 127.0.0.1:7400)")
    })
}

/// Parses the metrics setting: an address or `off`.
pub fn parse_metrics(s: &str) -> Result<Option<SocketAddr>, String> {
    if s == "off" {
        Ok(None)
    } else {
        parse_addr("metrics", s).map(Some)
    }
}

/// Validates a node id: 1 to 64 of `[A-Za-z0-9_.-]`.
pub fn validate_node_id(id: &str) -> Result<(), String> {
    if id.is_empty()
        || id.len() > NODE_ID_BYTES_MAX
        || !id
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c))
    {
        return Err(format!(
            "invalid node id {id:?}: use 1 to {NODE_ID_BYTES_MAX} letters, digits, '-', '_' or '.'"
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn file_config_parses_and_rejects_unknown_fields() {
        let c: FileConfig =
            toml::from_str("listen = \"127.0.0.1:7500\"\nsync = \"always\"\n").unwrap();
        assert_eq!(c.sync, Some(SyncMode::Always));
        assert!(toml::from_str::<FileConfig>("lisen = \"x\"").is_err());
        assert!(toml::from_str::<FileConfig>("sync = \"sometimes\"").is_err());
    }

    #[test]
    fn values_are_validated() {
        assert!(parse_addr("listen", "localhost").is_err());
        assert_eq!(parse_metrics("off"), Ok(None));
        assert!(validate_node_id("n1").is_ok());
        assert!(validate_node_id("bad id").is_err());
        assert!(validate_node_id("").is_err());
        assert!("sometimes".parse::<SyncMode>().is_err());
    }
}
