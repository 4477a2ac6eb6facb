//! Relay configuration (design README "Files, configuration and keys"): defaults → optional
//! `relay.toml` in the store directory → environment (`PORT`, `MBX_RELAY_DIR`,
//! `MBX_RELAY_TRUST_PROXY`) → command-line flags. Unknown keys are refused.

use std::net::IpAddr;
use std::path::{Path, PathBuf};

use serde::Deserialize;

use agentmbx_protocol::limits;

use crate::store::StoreLimits;

pub mod rate;

/// Default relay port (0.5.x).
pub const DEFAULT_PORT: u16 = 7374;

/// Default request timeout (ms): 30 s (`wire.md` §3.1).
pub const DEFAULT_REQUEST_TIMEOUT_MS: u64 = 30_000;

/// `request_timeout_ms` bounds: at least 1 s (less times out every real request), at most 1 h.
pub const REQUEST_TIMEOUT_MS_RANGE: (u64, u64) = (1_000, 3_600_000);

/// Default header-read timeout (ms): 10 s (`wire.md` §3.1 "headers 10 s").
pub const DEFAULT_HEADER_READ_TIMEOUT_MS: u64 = 10_000;

/// `header_read_timeout_ms` bounds: 1 s to 10 min.
pub const HEADER_READ_TIMEOUT_MS_RANGE: (u64, u64) = (1_000, 600_000);

/// Default keep-alive idle timeout (ms): 5 s (`wire.md` §3.1 "keep-alive 5 s").
pub const DEFAULT_KEEP_ALIVE_TIMEOUT_MS: u64 = 5_000;

/// `keep_alive_timeout_ms` bounds: 1 s to 10 min.
pub const KEEP_ALIVE_TIMEOUT_MS_RANGE: (u64, u64) = (1_000, 600_000);

/// Default bound on open client connections: each holds a file descriptor.
pub const DEFAULT_MAX_CONNECTIONS: u64 = 4_096;

/// `max_connections` bounds: at least one connection, at most 1,000,000.
pub const MAX_CONNECTIONS_RANGE: (u64, u64) = (1, 1_000_000);

/// `lock_wait_ms` bounds: 0 (fail at once) to 1 h (SQLite's busy timeout is an `int` of ms).
pub const LOCK_WAIT_MS_RANGE: (u64, u64) = (0, 3_600_000);

/// Default period of the retention sweep (ms): 10 min (`wire.md` §3.2 "Sweep": at start and
/// every 10 min).
pub const DEFAULT_SWEEP_INTERVAL_MS: u64 = 600_000;

/// `sweep_interval_ms` bounds: 1 s to 1 day (retention is at least one day).
pub const SWEEP_INTERVAL_MS_RANGE: (u64, u64) = (1_000, 86_400_000);

/// The largest quota or capacity value: JavaScript's `Number.MAX_SAFE_INTEGER` (2^53 − 1), so
/// every published limit reads back exactly in any JSON client and fits SQLite's `i64`.
pub const MAX_QUOTA: u64 = (1 << 53) - 1;

/// The bounds of every `[limits]` key, `(key, min, max)`, checked by [`RelayConfig::validate`].
/// - `max_item_bytes` ≤ the 8 MiB request body cap (a larger item could never arrive);
/// - `max_batch` ≤ 1,000 (5× the spec's 200: one push is one group-commit request);
/// - `max_pull` ≤ 500 (`wire.md` §3.2: `n = clamp(limit, 1, 500)`; the store never returns
///   more);
/// - `max_pull_bytes` ≤ 64 MiB (one page is one JSON answer held in memory);
/// - `max_targets` ≤ 1,024 (one item's fan-out is validated and written in one savepoint);
/// - `retention_days` ≤ 3,650 (ten years);
/// - queue, sender and account quotas and `max_live_enrolments` ≤ [`MAX_QUOTA`].
///
/// Every minimum is 1: a zero limit refuses everything (or panics a clamp).
pub const LIMIT_RANGES: &[(&str, u64, u64)] = &[
    ("max_item_bytes", 1, limits::RELAY_MAX_BODY as u64),
    ("max_batch", 1, 1_000),
    ("max_pull", 1, limits::MAX_PULL as u64),
    ("max_pull_bytes", 1, 64 * 1024 * 1024),
    ("max_targets", 1, 1_024),
    ("retention_days", 1, 3_650),
    ("max_queue_items", 1, MAX_QUOTA),
    ("max_queue_bytes", 1, MAX_QUOTA),
    ("max_sender_items", 1, MAX_QUOTA),
    ("max_sender_bytes", 1, MAX_QUOTA),
    ("max_owner_items", 1, MAX_QUOTA),
    ("max_owner_bytes", 1, MAX_QUOTA),
    ("max_live_enrolments", 1, MAX_QUOTA),
];

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

    /// Each limit by its `relay.toml` key, in [`LIMIT_RANGES`] order.
    fn by_key(&self) -> [(&'static str, u64); 13] {
        [
            ("max_item_bytes", self.max_item_bytes),
            ("max_batch", self.max_batch),
            ("max_pull", self.max_pull),
            ("max_pull_bytes", self.max_pull_bytes),
            ("max_targets", self.max_targets),
            ("retention_days", u64::from(self.retention_days)),
            ("max_queue_items", self.max_queue_items),
            ("max_queue_bytes", self.max_queue_bytes),
            ("max_sender_items", self.max_sender_items),
            ("max_sender_bytes", self.max_sender_bytes),
            ("max_owner_items", self.max_owner_items),
            ("max_owner_bytes", self.max_owner_bytes),
            ("max_live_enrolments", self.max_live_enrolments),
        ]
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
    /// Longest time a client may take to send a request's headers (ms, default 10,000,
    /// `wire.md` §3.1); past it the connection is closed. It runs from the moment the relay
    /// waits for a request, so it also closes a kept-alive connection that stays silent that
    /// long.
    pub header_read_timeout_ms: Option<u64>,
    /// How long a kept-alive connection may sit idle between requests before the relay closes
    /// it (ms, default 5,000, `wire.md` §3.1). A fresh connection that sends nothing counts as
    /// idle from the moment it was accepted.
    pub keep_alive_timeout_ms: Option<u64>,
    /// Most client connections open at once (default 4,096); past it new connections wait in
    /// the listen backlog until one closes, so a flood cannot exhaust file descriptors.
    pub max_connections: Option<u64>,
    /// How often the retention sweep runs after the one at start (ms, default 600,000 =
    /// 10 min, `wire.md` §3.2 "Sweep"; [`crate::retention`]).
    pub sweep_interval_ms: Option<u64>,
    /// Limits and quotas.
    pub limits: LimitsConfig,
    /// Rate limits and the request-body budget (`[rate]`, [`crate::ratelimit`]).
    pub rate: rate::RateConfig,
    /// The enrolment authority (`[authority]`, [`crate::authority`]; default the host-key
    /// challenge).
    pub authority: AuthorityConfig,
    /// File holding the admin bearer token of the operator endpoints (`/v2/relay/admin/*`),
    /// relative to the store directory unless absolute. `MBX_RELAY_ADMIN_TOKEN` wins over it.
    /// Neither set: the admin endpoints answer 404.
    pub admin_token_file: Option<PathBuf>,
    /// The admin token, loaded by [`RelayConfig::load`] (never from `relay.toml` itself).
    #[serde(skip)]
    pub admin_token: Option<AdminToken>,
}

/// `"<key> must be <min>..=<max>, got <value>"` when `value` is out of bounds.
fn check_range(key: &str, value: u64, (min, max): (u64, u64)) -> Result<(), String> {
    if (min..=max).contains(&value) {
        Ok(())
    } else {
        Err(format!("{key} must be {min}..={max}, got {value}"))
    }
}

impl RelayConfig {
    /// Checks every bounded setting ([`LIMIT_RANGES`], `request_timeout_ms`,
    /// `header_read_timeout_ms`, `keep_alive_timeout_ms`, `max_connections`, `lock_wait_ms`,
    /// `sweep_interval_ms`, `trust_proxy`, `[rate]`); the error names the first key out of
    /// bounds, e.g. `limits.max_pull must be 1..=500, got 0`.
    pub fn validate(&self) -> Result<(), String> {
        for ((key, value), (range_key, min, max)) in
            self.limits.by_key().into_iter().zip(LIMIT_RANGES)
        {
            debug_assert_eq!(key, *range_key);
            check_range(&format!("limits.{key}"), value, (*min, *max))?;
        }
        if let Some(ms) = self.request_timeout_ms {
            check_range("request_timeout_ms", ms, REQUEST_TIMEOUT_MS_RANGE)?;
        }
        if let Some(ms) = self.header_read_timeout_ms {
            check_range("header_read_timeout_ms", ms, HEADER_READ_TIMEOUT_MS_RANGE)?;
        }
        if let Some(ms) = self.keep_alive_timeout_ms {
            check_range("keep_alive_timeout_ms", ms, KEEP_ALIVE_TIMEOUT_MS_RANGE)?;
        }
        if let Some(n) = self.max_connections {
            check_range("max_connections", n, MAX_CONNECTIONS_RANGE)?;
        }
        if let Some(ms) = self.lock_wait_ms {
            check_range("lock_wait_ms", ms, LOCK_WAIT_MS_RANGE)?;
        }
        if let Some(ms) = self.sweep_interval_ms {
            check_range("sweep_interval_ms", ms, SWEEP_INTERVAL_MS_RANGE)?;
        }
        if let Some(tp) = &self.trust_proxy {
            rate::TrustProxy::parse(tp)?;
        }
        self.rate.validate()?;
        self.authority.validate()?;
        Ok(())
    }

    /// Reads `<dir>/relay.toml` if it exists, then applies the environment (`PORT`,
    /// `MBX_RELAY_TRUST_PROXY`). Every bounded setting is checked ([`RelayConfig::validate`]).
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
            // Empty means unset (the socket address).
            cfg.trust_proxy = Some(tp).filter(|t| !t.is_empty());
        }
        if let Some(tp) = &cfg.trust_proxy {
            rate::TrustProxy::parse(tp).map_err(ConfigError::Env)?;
        }
        cfg.validate()
            .map_err(|message| ConfigError::Invalid { path, message })?;
        cfg.admin_token = AdminToken::load(dir, cfg.admin_token_file.as_deref())?;
        Ok(cfg)
    }

    /// Parses and validates `relay.toml` text. Errors name the offending key.
    pub fn parse(text: &str, path: &Path) -> Result<Self, ConfigError> {
        let invalid = |message: String| ConfigError::Invalid {
            path: path.to_path_buf(),
            message,
        };
        let cfg: Self = toml::from_str(text).map_err(|e| invalid(e.to_string()))?;
        cfg.validate().map_err(invalid)?;
        Ok(cfg)
    }
}

// ---- [authority] and the admin token (spec §8; authority/, handlers/admin.rs) ----------------

/// Which enrolment authority admits hosts (`[authority] kind`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
pub enum AuthorityKind {
    /// `"host-key-challenge"` (default, self-hosted): every key that proves possession enrols.
    #[default]
    #[serde(rename = "host-key-challenge")]
    HostKeyChallenge,
    /// `"account"` (hosted relay): account tokens verified against the issuer's JWKS; every hop
    /// also carries the token.
    #[serde(rename = "account")]
    Account,
}

/// `[authority]` in `relay.toml`. With `kind = "account"`, `issuer`, `jwks_url` and `audience`
/// are required:
///
/// ```toml
/// [authority]
/// kind = "account"
/// issuer = "https://accounts.example.org"
/// jwks_url = "https://accounts.example.org/.well-known/jwks.json"
/// audience = "https://relay.example.org"   # this relay's public URL
/// max_token_ttl_ms = 900000                # optional, 60000..=900000
/// ```
#[derive(Debug, Clone, PartialEq, Eq, Default, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct AuthorityConfig {
    /// Which authority.
    pub kind: AuthorityKind,
    /// The tokens' `iss` (exact match).
    pub issuer: Option<String>,
    /// Where the issuer publishes its JWKS: `https://`, or `http://` to a loopback host only.
    pub jwks_url: Option<String>,
    /// The tokens' `aud`: this relay's public URL (`http(s)://…`); tokens for any other audience
    /// (e.g. the accounts API) are refused.
    pub audience: Option<String>,
    /// Longest token lifetime `exp − iat` accepted (ms, default and maximum 900,000 = 15 min,
    /// minimum 60,000).
    pub max_token_ttl_ms: Option<u64>,
}

/// `max_token_ttl_ms` bounds: 1 to 15 minutes (spec §8: "exp ≤ 15 min").
pub const MAX_TOKEN_TTL_MS_RANGE: (u64, u64) = (60_000, 900_000);

/// Whether `url` is `http(s)://<host>…` with a non-empty host; `Some(host)` when so.
fn url_host(url: &str) -> Option<(&str, &str)> {
    let (scheme, rest) = url
        .strip_prefix("https://")
        .map(|r| ("https", r))
        .or_else(|| url.strip_prefix("http://").map(|r| ("http", r)))?;
    let authority = rest.split(['/', '?', '#']).next().unwrap_or("");
    let host = if let Some(bracketed) = authority.strip_prefix('[') {
        bracketed.split(']').next().unwrap_or("")
    } else {
        authority.rsplit_once(':').map_or(authority, |(h, _)| h)
    };
    (!host.is_empty() && !authority.contains('@') && !url.chars().any(char::is_whitespace))
        .then_some((scheme, host))
}

impl AuthorityConfig {
    /// Checks the section: the account authority's three URLs/strings present and well formed,
    /// `jwks_url` over https (http only to 127.0.0.0/8, `localhost` or `::1`), the TTL in
    /// [`MAX_TOKEN_TTL_MS_RANGE`]; the host-key challenge takes no other key.
    pub fn validate(&self) -> Result<(), String> {
        match self.kind {
            AuthorityKind::HostKeyChallenge => {
                let set = [
                    ("issuer", self.issuer.is_some()),
                    ("jwks_url", self.jwks_url.is_some()),
                    ("audience", self.audience.is_some()),
                    ("max_token_ttl_ms", self.max_token_ttl_ms.is_some()),
                ];
                if let Some((key, _)) = set.iter().find(|(_, s)| *s) {
                    return Err(format!(
                        "authority.{key} applies only with authority.kind = \"account\""
                    ));
                }
            }
            AuthorityKind::Account => {
                match self.issuer.as_deref() {
                    Some(i) if !i.trim().is_empty() && i.len() <= 1024 => {}
                    _ => return Err("authority.issuer is required with kind = \"account\"".into()),
                }
                let Some(jwks) = self.jwks_url.as_deref() else {
                    return Err("authority.jwks_url is required with kind = \"account\"".into());
                };
                match url_host(jwks) {
                    Some(("https", _)) => {}
                    Some(("http", host))
                        if host == "localhost"
                            || host
                                .parse::<IpAddr>()
                                .is_ok_and(|ip| ip.is_loopback()) => {}
                    Some(_) => {
                        return Err(format!(
                            "authority.jwks_url must be https:// (http:// only to a loopback host), got {jwks:?}"
                        ))
                    }
                    None => return Err(format!("authority.jwks_url is not a URL: {jwks:?}")),
                }
                let Some(aud) = self.audience.as_deref() else {
                    return Err(
                        "authority.audience (this relay's public URL) is required with kind = \"account\""
                            .into(),
                    );
                };
                if url_host(aud).is_none() {
                    return Err(format!(
                        "authority.audience must be this relay's public http(s) URL, got {aud:?}"
                    ));
                }
                if let Some(ms) = self.max_token_ttl_ms {
                    check_range("authority.max_token_ttl_ms", ms, MAX_TOKEN_TTL_MS_RANGE)?;
                }
            }
        }
        Ok(())
    }
}

/// Environment variable holding the admin bearer token (wins over `admin_token_file`).
pub const ADMIN_TOKEN_ENV: &str = "MBX_RELAY_ADMIN_TOKEN";

/// Shortest admin token accepted (bytes): it guards revocation and the deny-list.
pub const MIN_ADMIN_TOKEN_BYTES: usize = 16;
/// Longest admin token accepted (bytes).
pub const MAX_ADMIN_TOKEN_BYTES: usize = 1024;

/// The admin bearer token. Its `Debug` never shows it; compare it only with
/// [`AdminToken::matches`] (constant time).
#[derive(Clone, PartialEq, Eq)]
pub struct AdminToken(String);

impl std::fmt::Debug for AdminToken {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("AdminToken(<redacted>)")
    }
}

impl AdminToken {
    /// A token from text (surrounding whitespace trimmed): printable ASCII without spaces,
    /// [`MIN_ADMIN_TOKEN_BYTES`]..=[`MAX_ADMIN_TOKEN_BYTES`] bytes. The error never contains the
    /// text.
    pub fn new(text: &str) -> Result<Self, String> {
        let t = text.trim();
        if t.len() < MIN_ADMIN_TOKEN_BYTES || t.len() > MAX_ADMIN_TOKEN_BYTES {
            return Err(format!(
                "the admin token must be {MIN_ADMIN_TOKEN_BYTES}..={MAX_ADMIN_TOKEN_BYTES} bytes"
            ));
        }
        if !t.bytes().all(|b| b.is_ascii_graphic()) {
            return Err("the admin token must be printable ASCII without spaces".to_owned());
        }
        Ok(AdminToken(t.to_owned()))
    }

    /// Whether `presented` is this token, compared in constant time (over the longer length).
    pub fn matches(&self, presented: &str) -> bool {
        use subtle::ConstantTimeEq as _;
        let (a, b) = (self.0.as_bytes(), presented.as_bytes());
        let len_ok = a.len().ct_eq(&b.len());
        let n = a.len().max(b.len());
        let pad = |s: &[u8]| {
            let mut v = vec![0u8; n];
            v[..s.len()].copy_from_slice(s);
            v
        };
        (len_ok & pad(a).ct_eq(&pad(b))).into()
    }

    /// The secret text, for a client that must send it (the `--url` operator commands).
    pub fn expose(&self) -> &str {
        &self.0
    }

    /// The token from [`ADMIN_TOKEN_ENV`], else from `file` (relative to `dir`), else `None`.
    /// Errors: the file cannot be read, or the token is malformed (never echoed).
    pub fn load(dir: &Path, file: Option<&Path>) -> Result<Option<Self>, ConfigError> {
        if let Ok(text) = std::env::var(ADMIN_TOKEN_ENV) {
            return Self::new(&text)
                .map(Some)
                .map_err(|e| ConfigError::Env(format!("{ADMIN_TOKEN_ENV}: {e}")));
        }
        let Some(file) = file else {
            return Ok(None);
        };
        let path = if file.is_absolute() {
            file.to_path_buf()
        } else {
            dir.join(file)
        };
        let text = std::fs::read_to_string(&path).map_err(|source| ConfigError::Read {
            path: path.clone(),
            source,
        })?;
        Self::new(&text)
            .map(Some)
            .map_err(|message| ConfigError::Invalid { path, message })
    }
}

#[cfg(test)]
mod authority_tests {
    use super::*;

    fn parse(text: &str) -> Result<RelayConfig, String> {
        RelayConfig::parse(text, Path::new("relay.toml")).map_err(|e| e.to_string())
    }

    const ACCOUNT: &str =
        "[authority]\nkind = \"account\"\nissuer = \"https://accounts.example\"\n\
        jwks_url = \"https://accounts.example/jwks\"\naudience = \"https://relay.example\"\n";

    #[test]
    fn the_default_is_the_host_key_challenge_and_account_needs_its_settings() {
        let cfg = parse("").expect("empty");
        assert_eq!(cfg.authority.kind, AuthorityKind::HostKeyChallenge);
        let cfg = parse(ACCOUNT).expect("account");
        assert_eq!(cfg.authority.kind, AuthorityKind::Account);
        for key in ["issuer", "jwks_url", "audience"] {
            let text: String = ACCOUNT
                .lines()
                .filter(|l| !l.starts_with(key))
                .map(|l| format!("{l}\n"))
                .collect();
            let e = parse(&text).expect_err(key);
            assert!(e.contains(&format!("authority.{key}")), "{e}");
        }
        let e = parse("[authority]\nissuer = \"x\"\n").expect_err("challenge + issuer");
        assert!(e.contains("authority.issuer applies only"), "{e}");
        let e = parse("[authority]\nkind = \"jwt\"\n").expect_err("unknown kind");
        assert!(e.contains("kind"), "{e}");
        let e = parse(&format!("{ACCOUNT}jwks = 1\n")).expect_err("unknown key");
        assert!(e.contains("jwks"), "{e}");
    }

    #[test]
    fn the_jwks_url_is_https_or_loopback_http_and_the_ttl_is_bounded() {
        let with = |k: &str, v: &str| {
            ACCOUNT.replace(
                &format!("{k} = \"https://accounts.example/jwks\""),
                &format!("{k} = \"{v}\""),
            )
        };
        for ok in [
            "http://127.0.0.1:9/jwks",
            "http://localhost/jwks",
            "http://[::1]:80/k",
        ] {
            parse(&with("jwks_url", ok)).unwrap_or_else(|e| panic!("{ok}: {e}"));
        }
        for bad in [
            "http://10.0.0.1/jwks",
            "http://accounts.example/jwks",
            "ftp://x/y",
            "https://",
            "https://u@h/x",
        ] {
            let e = parse(&with("jwks_url", bad)).expect_err(bad);
            assert!(e.contains("authority.jwks_url"), "{bad}: {e}");
        }
        for (ttl, ok) in [
            (60_000, true),
            (900_000, true),
            (59_999, false),
            (900_001, false),
        ] {
            let r = parse(&format!("{ACCOUNT}max_token_ttl_ms = {ttl}\n"));
            assert_eq!(r.is_ok(), ok, "{ttl}: {r:?}");
            if !ok {
                assert!(r
                    .expect_err("bad")
                    .contains("authority.max_token_ttl_ms must be 60000..=900000"));
            }
        }
    }

    #[test]
    fn the_admin_token_is_bounded_redacted_and_compared_exactly() {
        assert!(AdminToken::new(&"a".repeat(MIN_ADMIN_TOKEN_BYTES - 1)).is_err());
        assert!(AdminToken::new(&"a".repeat(MAX_ADMIN_TOKEN_BYTES + 1)).is_err());
        assert!(AdminToken::new(&format!("{} b", "a".repeat(20))).is_err());
        AdminToken::new(&"a".repeat(MAX_ADMIN_TOKEN_BYTES)).expect("at the bound");
        let t = AdminToken::new(" 0123456789abcdef\n").expect("trimmed");
        assert_eq!(format!("{t:?}"), "AdminToken(<redacted>)");
        assert!(t.matches("0123456789abcdef"));
        for bad in [
            "0123456789abcdeF",
            "0123456789abcde",
            "0123456789abcdef0",
            "",
        ] {
            assert!(!t.matches(bad), "{bad}");
        }
        let dir = tempfile::tempdir().expect("tempdir");
        assert_eq!(AdminToken::load(dir.path(), None).expect("none"), None);
        std::fs::write(dir.path().join("admin.token"), "0123456789abcdef\n").expect("write");
        let loaded = AdminToken::load(dir.path(), Some(Path::new("admin.token"))).expect("load");
        assert_eq!(loaded, Some(t));
        std::fs::write(dir.path().join("short"), "abc").expect("write");
        let e = AdminToken::load(dir.path(), Some(Path::new("short"))).expect_err("short");
        assert!(!e.to_string().contains("abc"), "{e}");
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

    #[test]
    fn defaults_are_valid() {
        RelayConfig::default().validate().unwrap();
        let cfg = RelayConfig::parse("", Path::new("relay.toml")).unwrap();
        assert_eq!(cfg, RelayConfig::default());
    }

    /// Parses one setting; `Err` holds the message.
    fn one(section: &str, key: &str, value: u64) -> Result<RelayConfig, String> {
        let text = if section.is_empty() {
            format!("{key} = {value}\n")
        } else {
            format!("[{section}]\n{key} = {value}\n")
        };
        RelayConfig::parse(&text, Path::new("relay.toml")).map_err(|e| e.to_string())
    }

    #[test]
    fn every_limit_is_checked_at_and_past_its_bounds() {
        let mut checked = 0;
        for (key, min, max) in LIMIT_RANGES {
            let want = format!("limits.{key} must be {min}..={max}, got ");
            for ok in [*min, *max] {
                let cfg = one("limits", key, ok).unwrap_or_else(|e| panic!("{key}={ok}: {e}"));
                let got = cfg.limits.by_key().into_iter().find(|(k, _)| k == key);
                assert_eq!(got, Some((*key, ok)), "{key}");
            }
            for bad in [min.checked_sub(1), max.checked_add(1)]
                .into_iter()
                .flatten()
            {
                match one("limits", key, bad) {
                    Err(e) => assert!(e.contains(&format!("{want}{bad}")), "{key}={bad}: {e}"),
                    // A value that TOML or the field type cannot hold is refused too.
                    Ok(_) => panic!("{key}={bad} was accepted"),
                }
            }
            checked += 1;
        }
        assert_eq!(checked, LimitsConfig::default().by_key().len());
        // The reported crash: max_pull = 0 would panic every pull's clamp.
        let e = one("limits", "max_pull", 0).unwrap_err();
        assert!(e.contains("limits.max_pull must be 1..=500, got 0"), "{e}");
        // Past what the field can hold (u32) or TOML can write (i64): refused, naming the key.
        let e = one("limits", "retention_days", u64::from(u32::MAX) + 1).unwrap_err();
        assert!(e.contains("retention_days"), "{e}");
        let e = RelayConfig::parse(
            "[limits]\nmax_queue_items = 18446744073709551615\n",
            Path::new("relay.toml"),
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("max_queue_items"), "{e}");
    }

    #[test]
    fn timeouts_and_connection_limit_are_checked_at_and_past_their_bounds() {
        for (key, (min, max)) in [
            ("request_timeout_ms", REQUEST_TIMEOUT_MS_RANGE),
            ("header_read_timeout_ms", HEADER_READ_TIMEOUT_MS_RANGE),
            ("keep_alive_timeout_ms", KEEP_ALIVE_TIMEOUT_MS_RANGE),
            ("max_connections", MAX_CONNECTIONS_RANGE),
            ("lock_wait_ms", LOCK_WAIT_MS_RANGE),
        ] {
            for ok in [min, max] {
                one("", key, ok).unwrap_or_else(|e| panic!("{key}={ok}: {e}"));
            }
            for bad in [min.checked_sub(1), max.checked_add(1)]
                .into_iter()
                .flatten()
            {
                let e = one("", key, bad).unwrap_err();
                assert!(
                    e.contains(&format!("{key} must be {min}..={max}, got {bad}")),
                    "{e}"
                );
            }
        }
        let e = one("", "request_timeout_ms", 0).unwrap_err();
        assert!(
            e.contains("request_timeout_ms must be 1000..=3600000"),
            "{e}"
        );
        let e = one("", "header_read_timeout_ms", 999).unwrap_err();
        assert!(
            e.contains("header_read_timeout_ms must be 1000..=600000, got 999"),
            "{e}"
        );
        let e = one("", "max_connections", 0).unwrap_err();
        assert!(
            e.contains("max_connections must be 1..=1000000, got 0"),
            "{e}"
        );
        let cfg = RelayConfig::parse(
            "header_read_timeout_ms = 2000\nkeep_alive_timeout_ms = 3000\nmax_connections = 7\n",
            Path::new("relay.toml"),
        )
        .unwrap();
        assert_eq!(
            (
                cfg.header_read_timeout_ms,
                cfg.keep_alive_timeout_ms,
                cfg.max_connections
            ),
            (Some(2000), Some(3000), Some(7))
        );
    }

    #[test]
    fn load_validates_the_file() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("relay.toml"), "[limits]\nmax_batch = 0\n").unwrap();
        let e = RelayConfig::load(dir.path()).unwrap_err().to_string();
        assert!(
            e.contains("limits.max_batch must be 1..=1000, got 0"),
            "{e}"
        );
        assert!(e.contains("relay.toml"), "{e}");
    }
}
