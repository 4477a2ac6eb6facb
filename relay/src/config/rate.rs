//! The `[rate]` table of `relay.toml` and the `trust_proxy` setting: their shapes, defaults,
//! bounds and parsing (`wire.md` "Resolved details" → "Rate limits").
//!
//! # What it owns
//! The settings only. The rate tables and the body budget they size, and the client address
//! the `trust_proxy` mode selects, are [`crate::ratelimit`]'s (which re-exports these items).
//!
//! # What it must never do
//! Hold runtime state or depend on the server: configuration sits below every module that
//! reads it.

use serde::Deserialize;

use agentmbx_protocol::limits::RELAY_MAX_BODY;

use super::RelayConfig;

/// Default calls per minute per client address on challenge + enrol + rotate (shared bucket;
/// `wire.md` §3.2 "Rate limits": 30/min, 0.5.x's `enrolPerMinutePerIp`).
pub const DEFAULT_ENROL_PER_MIN: u64 = 30;
/// Default `GET /v2/relay/info` calls per minute per client address.
pub const DEFAULT_INFO_PER_MIN: u64 = 600;
/// Default push requests per minute per sender key (`wire.md` §3.2: 120/min, 0.5.x's
/// `pushesPerMinute`).
pub const DEFAULT_PUSH_PER_MIN: u64 = 120;
/// Default hard cap on the keys of each rate table (`wire.md` §3.2: 50,000).
pub const DEFAULT_MAX_KEYS: u64 = 50_000;
/// Default request-body budget over all connections, bytes (64 MiB).
pub const DEFAULT_BODY_BUDGET_BYTES: u64 = 64 * 1024 * 1024;
/// Default request-body bytes one client address may hold at once (16 MiB: two full-size
/// pushes).
pub const DEFAULT_BODY_PER_ADDRESS_BYTES: u64 = 16 * 1024 * 1024;

/// Bounds of the `[rate]` keys, `(key, min, max)`:
/// - the per-minute rates are 1..=1,000,000 (a zero rate would refuse everything);
/// - `max_keys` is 1..=10,000,000 (each key costs about a hundred bytes);
/// - `body_budget_bytes` and `body_per_address_bytes` are at least the 8 MiB body cap (else a
///   full-size push could never be admitted) and at most 16 GiB.
pub const RATE_RANGES: &[(&str, u64, u64)] = &[
    ("enrol_per_min", 1, 1_000_000),
    ("info_per_min", 1, 1_000_000),
    ("push_per_min", 1, 1_000_000),
    ("max_keys", 1, 10_000_000),
    (
        "body_budget_bytes",
        RELAY_MAX_BODY as u64,
        16 * 1024 * 1024 * 1024,
    ),
    (
        "body_per_address_bytes",
        RELAY_MAX_BODY as u64,
        16 * 1024 * 1024 * 1024,
    ),
];

/// `[rate]` in `relay.toml`: rate limits and the body budget (`wire.md` "Rate limits"). A
/// benchmark raises them; the defaults are 0.5.x's where 0.5.x has one.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RateConfig {
    /// Calls per minute per client address on challenge, enrol and rotate together (default
    /// 30).
    pub enrol_per_min: u64,
    /// `GET /v2/relay/info` calls per minute per client address (default 600).
    pub info_per_min: u64,
    /// Push requests per minute per sender key (default 120).
    pub push_per_min: u64,
    /// Keys each rate table holds at most (default 50,000).
    pub max_keys: u64,
    /// Request-body bytes held at once over all connections (default 64 MiB).
    pub body_budget_bytes: u64,
    /// Request-body bytes the requests of one client address hold at once (default 16 MiB);
    /// past it that address is answered 503 `BUSY` while others are still served.
    pub body_per_address_bytes: u64,
}

impl Default for RateConfig {
    fn default() -> Self {
        RateConfig {
            enrol_per_min: DEFAULT_ENROL_PER_MIN,
            info_per_min: DEFAULT_INFO_PER_MIN,
            push_per_min: DEFAULT_PUSH_PER_MIN,
            max_keys: DEFAULT_MAX_KEYS,
            body_budget_bytes: DEFAULT_BODY_BUDGET_BYTES,
            body_per_address_bytes: DEFAULT_BODY_PER_ADDRESS_BYTES,
        }
    }
}

impl RateConfig {
    /// Checks every key against [`RATE_RANGES`]; the error names the first one out of bounds,
    /// e.g. `rate.max_keys must be 1..=10000000, got 0`.
    pub fn validate(&self) -> Result<(), String> {
        let values = [
            self.enrol_per_min,
            self.info_per_min,
            self.push_per_min,
            self.max_keys,
            self.body_budget_bytes,
            self.body_per_address_bytes,
        ];
        for ((key, min, max), value) in RATE_RANGES.iter().zip(values) {
            if !(*min..=*max).contains(&value) {
                return Err(format!("rate.{key} must be {min}..={max}, got {value}"));
            }
        }
        Ok(())
    }
}

/// Where the client address comes from (`wire.md` "Rate limits").
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum TrustProxy {
    /// The socket's peer address (no proxy trusted).
    #[default]
    Socket,
    /// The rightmost `X-Forwarded-For` entry (`xff`, or `1` as 0.5.x spells it).
    Xff,
    /// `CF-Connecting-IP` (`cloudflare`).
    Cloudflare,
}

impl TrustProxy {
    /// Reads a `trust_proxy` setting: `xff` or `1` → [`TrustProxy::Xff`], `cloudflare` →
    /// [`TrustProxy::Cloudflare`]; anything else is an error naming the accepted values.
    pub fn parse(text: &str) -> Result<Self, String> {
        match text {
            "xff" | "1" => Ok(TrustProxy::Xff),
            "cloudflare" => Ok(TrustProxy::Cloudflare),
            other => Err(format!(
                "trust_proxy must be xff (or 1) or cloudflare, got {other:?}"
            )),
        }
    }

    /// The mode of a configuration's `trust_proxy` (unset or invalid: the socket; `load`
    /// refuses invalid values before a relay starts).
    pub fn of(config: &RelayConfig) -> Self {
        config
            .trust_proxy
            .as_deref()
            .and_then(|t| TrustProxy::parse(t).ok())
            .unwrap_or_default()
    }
}

/// Where the client address comes from, in words for the operator's log: e.g. `the
/// connection's peer address (trust_proxy unset: no proxy trusted)`.
impl std::fmt::Display for TrustProxy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            TrustProxy::Socket => {
                "the connection's peer address (trust_proxy unset: no proxy trusted)"
            }
            TrustProxy::Xff => "the rightmost X-Forwarded-For entry (trust_proxy = xff)",
            TrustProxy::Cloudflare => "the CF-Connecting-IP header (trust_proxy = cloudflare)",
        })
    }
}
