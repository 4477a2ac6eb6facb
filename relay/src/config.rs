//! Relay configuration (design README "Files, configuration and keys"): defaults → optional
//! `relay.toml` in the store directory → environment (`PORT`, `MBX_RELAY_DIR`,
//! `MBX_RELAY_TRUST_PROXY`) → command-line flags. Unknown keys are refused.

use std::net::IpAddr;
use std::path::{Path, PathBuf};

use serde::Deserialize;

use agentmbx_protocol::limits;

use crate::store::StoreLimits;

/// Default relay port (0.5.x).
pub const DEFAULT_PORT: u16 = 7374;

/// Default request timeout (ms): 30 s (`wire.md` §3.1).
pub const DEFAULT_REQUEST_TIMEOUT_MS: u64 = 30_000;

/// Errors reading the configuration.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// `relay.toml` could not be read.
    #[error("cannot read {path}: {source}")]
    Read {
        /// The file.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// `relay.toml` is not valid (unknown key, wrong type…).
    #[error("invalid {path}: {message}")]
    Invalid {
        /// The file.
        path: PathBuf,
        /// What is wrong (names the key).
        message: String,
    },
    /// An environment variable has a bad value.
    #[error("{0}")]
    Env(String),
}

/// Published limits and quotas (`[limits]` in `relay.toml`). Defaults are the spec's.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct LimitsConfig {
    /// Largest decoded wire item, bytes (default 786,432).
    pub max_item_bytes: u64,
    /// Items per push request (default 200).
    pub max_batch: u64,
    /// Items per pull page (default 500).
    pub max_pull: u64,
    /// Byte budget of a pull page (default 8 MiB).
    pub max_pull_bytes: u64,
    /// Targets per item (default 64).
    pub max_targets: u64,
    /// Retention in days (default 14).
    pub retention_days: u32,
    /// Per target queue items (default 10,000).
    pub max_queue_items: u64,
    /// Per target queue bytes (default 50 MiB).
    pub max_queue_bytes: u64,
    /// Per sender per target items (default 2,000).
    pub max_sender_items: u64,
    /// Per sender per target bytes (default 20 MiB).
    pub max_sender_bytes: u64,
    /// Per account items (default 10,000).
    pub max_owner_items: u64,
    /// Per account bytes (default 50 MiB).
    pub max_owner_bytes: u64,
    /// Live enrolments at most (default 100,000).
    pub max_live_enrolments: u64,
}

impl Default for LimitsConfig {
    fn default() -> Self {
        let s = StoreLimits::default();
        LimitsConfig {
            max_item_bytes: limits::MAX_ITEM_BYTES as u64,
            max_batch: limits::MAX_BATCH as u64,
            max_pull: limits::MAX_PULL as u64,
            max_pull_bytes: limits::MAX_PULL_BYTES as u64,
            max_targets: limits::MAX_TARGETS as u64,
            retention_days: s.retention_days,
            max_queue_items: s.max_queue_items,
            max_queue_bytes: s.max_queue_bytes,
            max_sender_items: s.max_sender_items,
            max_sender_bytes: s.max_sender_bytes,
            max_owner_items: s.max_owner_items,
            max_owner_bytes: s.max_owner_bytes,
            max_live_enrolments: s.max_live_enrolments,
        }
    }
}

impl LimitsConfig {
    /// The store's share of the limits.
    pub fn store_limits(&self) -> StoreLimits {
        StoreLimits {
            max_queue_items: self.max_queue_items,
            max_queue_bytes: self.max_queue_bytes,
            max_sender_items: self.max_sender_items,
            max_sender_bytes: self.max_sender_bytes,
            max_owner_items: self.max_owner_items,
            max_owner_bytes: self.max_owner_bytes,
            retention_days: self.retention_days,
            max_live_enrolments: self.max_live_enrolments,
        }
    }

    /// The published form (`GET /v2/relay/info` `limits`).
    pub fn published(&self) -> agentmbx_protocol::wire::Limits {
        agentmbx_protocol::wire::Limits {
            max_item_bytes: self.max_item_bytes,
            max_batch: self.max_batch,
            max_pull: self.max_pull,
            max_pull_bytes: self.max_pull_bytes,
            max_targets: self.max_targets,
            retention_days: u64::from(self.retention_days),
            max_queue_items: self.max_queue_items,
            max_queue_bytes: self.max_queue_bytes,
            max_sender_items: self.max_sender_items,
            max_sender_bytes: self.max_sender_bytes,
            max_owner_items: self.max_owner_items,
            max_owner_bytes: self.max_owner_bytes,
        }
    }
}

/// `relay.toml`.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize, Default)]
#[serde(deny_unknown_fields, default)]
pub struct RelayConfig {
    /// Address to bind (default 0.0.0.0).
    pub bind: Option<IpAddr>,
    /// Port (default 7374; 0 picks a free port).
    pub port: Option<u16>,
    /// Client address source behind a proxy: `xff` or `cloudflare` (unset: the socket address).
    pub trust_proxy: Option<String>,
    /// How long `serve` waits for `relay.lock` held by another process (ms, default 60,000).
    pub lock_wait_ms: Option<u64>,
    /// Longest time one request may take, body upload included (ms, default 30,000,
    /// `wire.md` §3.1 server timeouts); past it the relay answers 408 and closes.
    pub request_timeout_ms: Option<u64>,
    /// Limits and quotas.
    pub limits: LimitsConfig,
}

impl RelayConfig {
    /// Reads `<dir>/relay.toml` if it exists, then applies the environment (`PORT`,
    /// `MBX_RELAY_TRUST_PROXY`).
    pub fn load(dir: &Path) -> Result<Self, ConfigError> {
        let path = dir.join("relay.toml");
        let mut cfg = match std::fs::read_to_string(&path) {
            Ok(text) => Self::parse(&text, &path)?,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => RelayConfig::default(),
            Err(source) => return Err(ConfigError::Read { path, source }),
        };
        if let Ok(port) = std::env::var("PORT") {
            cfg.port = Some(port.trim().parse().map_err(|_| {
                ConfigError::Env(format!("PORT must be a port number, got {port:?}"))
            })?);
        }
        if let Ok(tp) = std::env::var("MBX_RELAY_TRUST_PROXY") {
            cfg.trust_proxy = Some(tp);
        }
        if let Some(tp) = &cfg.trust_proxy {
            if !matches!(tp.as_str(), "xff" | "1" | "cloudflare") {
                return Err(ConfigError::Env(format!(
                    "trust_proxy must be xff or cloudflare, got {tp:?}"
                )));
            }
        }
        Ok(cfg)
    }

    /// Parses `relay.toml` text. Errors name the offending key.
    pub fn parse(text: &str, path: &Path) -> Result<Self, ConfigError> {
        toml::from_str(text).map_err(|e| ConfigError::Invalid {
            path: path.to_path_buf(),
            message: e.to_string(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unknown_keys_are_refused_and_limits_override() {
        let p = Path::new("relay.toml");
        let err = RelayConfig::parse("prot = 1\n", p).unwrap_err().to_string();
        assert!(err.contains("prot"), "{err}");
        let err = RelayConfig::parse("[limits]\nmax_bach = 3\n", p)
            .unwrap_err()
            .to_string();
        assert!(err.contains("max_bach"), "{err}");
        let cfg = RelayConfig::parse("port = 9\n[limits]\nmax_batch = 3\n", p).unwrap();
        assert_eq!(
            (cfg.port, cfg.limits.max_batch, cfg.limits.max_pull),
            (Some(9), 3, 500)
        );
    }
}
