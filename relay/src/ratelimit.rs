//! Rate limits and load shedding (`wire.md` "Resolved details" → "Rate limits", §3.2 "Rate
//! limits"; spec §2 "Challenges and rate windows MAY stay in memory, bounded").
//!
//! # What it owns
//! - **Per (client address, endpoint class) token buckets** on the unauthenticated or
//!   expensive endpoints. Two classes:
//!   - `enrol`: `POST /v1/relay/challenge`, `POST /v1/relay/enrol` and `POST /v2/relay/rotate`
//!     share one bucket per address, as 0.5.x does (one enrolment costs a challenge and an
//!     enrol; default 30 calls per minute);
//!   - `info`: `GET /v2/relay/info` (default 600 per minute: a host asks for info on every
//!     pass, by default every 2 s, so twenty hosts behind one address pass unthrottled).
//!
//!   Past its bucket a caller gets HTTP 429 `{error:"rate_limit_exceeded", code:"RATE_LIMIT",
//!   retry_after}` with a `Retry-After` header, both in whole seconds (at least 1).
//! - **Pushes per sender key** (default 120 requests per minute, one hit per request, whatever
//!   its item count); past it the push handler answers 200 with every item `rejected:rate`, as
//!   0.5.x.
//! - **The client address**: the socket's IP, or with `trust_proxy = "xff"` (`--trust-proxy`,
//!   `MBX_RELAY_TRUST_PROXY=xff|1`) the rightmost `X-Forwarded-For` entry — the one the trusted
//!   proxy appended; earlier entries are client-controlled — or with `"cloudflare"`
//!   `CF-Connecting-IP`. A missing or garbled header falls back to the socket address. The
//!   value is read as an IP address (so two spellings of one address are one bucket) and cut
//!   to 64 characters.
//! - **The body budget**: at most `body_budget_bytes` (default 64 MiB) of request bodies are
//!   held at once over all connections. A request reserves its share (its declared length, or
//!   the 8 MiB body cap when it declares none) before its body is read — that is, before it is
//!   authenticated — and keeps it until its answer is made; when no room is left it is answered
//!   503 `{error, code:"BUSY"}` with `Retry-After: 1` at once. So many concurrent 8 MiB uploads
//!   cannot exhaust the relay's memory.
//!
//! # Bounds
//! Every rate table holds at most `max_keys` keys (default 50,000). An entry whose bucket has
//! refilled completely is forgotten (it is the same as no entry). When a new key arrives at a
//! full table, the refilled entries are swept out; if the table is still full the new key is
//! refused (429 with the time until the earliest entry refills) rather than the table growing
//! or an existing bucket being dropped (dropping one would let a flood of fake addresses reset
//! a real caller's bucket). A full table is swept at most once per earliest-refill time, so a
//! flood cannot make every request pay for a sweep.
//!
//! # Time
//! Buckets run on the relay's clock ([`agentmbx_protocol::clock`]), so tests drive them with
//! the manual clock and a clock offset moves them as it moves everything else.
//!
//! # What it must never do
//! Log or echo request bodies, keys or header values beyond the address it keys by; keep any
//! state on disk (rate windows are memory only: a restart forgets them).

use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};
use std::sync::{Arc, Mutex};

use axum::body::HttpBody;
use axum::extract::{ConnectInfo, Request, State};
use axum::http::{header, HeaderMap, HeaderValue, Method, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::Deserialize;

use agentmbx_protocol::limits::RELAY_MAX_BODY;
use agentmbx_protocol::wire::ErrorBody;

use crate::config::RelayConfig;
use crate::server::SharedRelay;

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
/// Longest client address kept (characters; 0.5.x cuts at 64).
pub const MAX_ADDRESS_CHARS: usize = 64;
/// Granularity of body-budget reservations (1 KiB).
const BUDGET_UNIT: u64 = 1024;

/// Bounds of the `[rate]` keys, `(key, min, max)`:
/// - the per-minute rates are 1..=1,000,000 (a zero rate would refuse everything);
/// - `max_keys` is 1..=10,000,000 (each key costs about a hundred bytes);
/// - `body_budget_bytes` is at least the 8 MiB body cap (else a full-size push could never be
///   admitted) and at most 16 GiB.
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
}

impl Default for RateConfig {
    fn default() -> Self {
        RateConfig {
            enrol_per_min: DEFAULT_ENROL_PER_MIN,
            info_per_min: DEFAULT_INFO_PER_MIN,
            push_per_min: DEFAULT_PUSH_PER_MIN,
            max_keys: DEFAULT_MAX_KEYS,
            body_budget_bytes: DEFAULT_BODY_BUDGET_BYTES,
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

/// The address text one header value names, if it is an address: an IP, or an IP with a port
/// (`1.2.3.4:5678`, `[::1]:80`); written in canonical form (an IPv4-mapped IPv6 address as
/// IPv4).
fn parse_address(text: &str) -> Option<String> {
    let text = text.trim();
    let ip = text
        .parse::<IpAddr>()
        .ok()
        .or_else(|| text.parse::<SocketAddr>().ok().map(|s| s.ip()))?;
    Some(ip.to_canonical().to_string())
}

/// Cuts `text` to [`MAX_ADDRESS_CHARS`] characters.
fn cut(mut text: String) -> String {
    if let Some((at, _)) = text.char_indices().nth(MAX_ADDRESS_CHARS) {
        text.truncate(at);
    }
    text
}

/// The client address a request is rate-limited by (module docs): with
/// [`TrustProxy::Xff`] the rightmost entry of all `X-Forwarded-For` lines, with
/// [`TrustProxy::Cloudflare`] `CF-Connecting-IP`; a missing or garbled header (not text, not
/// an address) falls back to the socket address; `unknown` without one.
pub fn client_address(headers: &HeaderMap, socket: Option<SocketAddr>, mode: TrustProxy) -> String {
    let from_header = match mode {
        TrustProxy::Socket => None,
        TrustProxy::Xff => headers
            .get_all("x-forwarded-for")
            .iter()
            .next_back()
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.rsplit(',').map(str::trim).find(|p| !p.is_empty()))
            .and_then(parse_address),
        TrustProxy::Cloudflare => headers
            .get("cf-connecting-ip")
            .and_then(|v| v.to_str().ok())
            .and_then(parse_address),
    };
    let address = from_header
        .or_else(|| socket.map(|s| s.ip().to_canonical().to_string()))
        .unwrap_or_else(|| "unknown".to_owned());
    cut(address)
}

/// What a rate table says about one hit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// Within the bucket; the hit was counted.
    Allowed,
    /// The bucket is empty: retry after this many ms (at least 1).
    Limited {
        /// Until the next token, ms.
        retry_after_ms: i64,
    },
    /// The key is new and the table is at its cap with no refilled entry to forget: retry
    /// after this many ms (until the earliest entry refills).
    TableFull {
        /// Until the table can take a new key, ms.
        retry_after_ms: i64,
    },
}

impl Verdict {
    /// Whether the hit was allowed.
    pub fn allowed(self) -> bool {
        self == Verdict::Allowed
    }
}

/// One bounded table of token buckets, keyed by text (a client address or a sender key).
///
/// Each bucket holds `per_min` tokens and refills `per_min` per minute, continuously. It is
/// kept as one number, the time at which the bucket would be full again (GCRA's "theoretical
/// arrival time", in µs of the relay clock): a hit is allowed while that time is at most
/// `per_min − 1` intervals ahead of now, and moves it one interval on.
#[derive(Debug)]
pub struct RateTable {
    /// µs between tokens (60,000,000 / per_min).
    interval_us: i64,
    /// How far ahead of now the full-again time may be and a hit still pass, µs.
    tolerance_us: i64,
    /// Keys at most.
    cap: usize,
    inner: Mutex<TableState>,
}

#[derive(Debug, Default)]
struct TableState {
    /// Key → the time its bucket is full again (µs).
    full_at: HashMap<String, i64>,
    /// While the table is full of unrefilled buckets: no sweep before this time (µs).
    no_sweep_before: i64,
}

impl RateTable {
    /// A table of `per_min`-token buckets holding at most `cap` keys (both at least 1).
    pub fn new(per_min: u64, cap: u64) -> Self {
        let per_min = i64::try_from(per_min.max(1)).unwrap_or(i64::MAX);
        let interval_us = (60_000_000 / per_min).max(1);
        RateTable {
            interval_us,
            tolerance_us: interval_us.saturating_mul(per_min - 1),
            cap: usize::try_from(cap.max(1)).unwrap_or(usize::MAX),
            inner: Mutex::new(TableState::default()),
        }
    }

    /// Counts one hit for `key` at `now_ms`.
    pub fn hit(&self, key: &str, now_ms: i64) -> Verdict {
        let now = now_ms.saturating_mul(1_000);
        let mut t = self
            .inner
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let known = t.full_at.get(key).copied();
        if known.is_none() && t.full_at.len() >= self.cap {
            if now < t.no_sweep_before {
                return Verdict::TableFull {
                    retry_after_ms: ms_ceil(t.no_sweep_before - now),
                };
            }
            t.full_at.retain(|_, full| *full > now);
            if t.full_at.len() >= self.cap {
                let earliest = t.full_at.values().copied().min().unwrap_or(now + 1);
                t.no_sweep_before = earliest;
                tracing::warn!(
                    keys = t.full_at.len(),
                    "a relay rate table is full: new callers are refused until buckets refill"
                );
                return Verdict::TableFull {
                    retry_after_ms: ms_ceil(earliest - now),
                };
            }
        }
        // An entry that already refilled is the same as none.
        let start = known.filter(|full| *full > now).unwrap_or(now);
        if start - self.tolerance_us > now {
            return Verdict::Limited {
                retry_after_ms: ms_ceil(start - self.tolerance_us - now),
            };
        }
        t.full_at
            .insert(key.to_owned(), start.saturating_add(self.interval_us));
        Verdict::Allowed
    }

    /// Keys held now (refilled ones included until the next sweep).
    pub fn len(&self) -> usize {
        self.inner
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .full_at
            .len()
    }

    /// Whether the table holds no key.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The most keys it holds.
    pub fn cap(&self) -> usize {
        self.cap
    }
}

/// µs → ms, rounded up, at least 1.
fn ms_ceil(us: i64) -> i64 {
    (us.max(1) + 999) / 1_000
}

/// Which per-address bucket a request draws from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Class {
    /// Challenge, enrol and rotate (one shared bucket).
    Enrol,
    /// `GET` (and `HEAD`) `/v2/relay/info`.
    Info,
}

impl Class {
    /// The class of a request, `None` for requests not rate-limited by address.
    pub fn of(method: &Method, path: &str) -> Option<Class> {
        match (method, path) {
            (&Method::POST, "/v1/relay/challenge" | "/v1/relay/enrol" | "/v2/relay/rotate") => {
                Some(Class::Enrol)
            }
            // axum answers HEAD with the GET handler: it costs the same.
            (&Method::GET | &Method::HEAD, "/v2/relay/info") => Some(Class::Info),
            _ => None,
        }
    }
}

/// The relay's rate tables, address mode and body budget (one per relay, in
/// [`crate::server::RelayState`]).
#[derive(Debug)]
pub struct RateLimits {
    /// Where client addresses come from.
    pub trust_proxy: TrustProxy,
    /// Challenge + enrol + rotate, per client address.
    pub enrol: RateTable,
    /// Info, per client address.
    pub info: RateTable,
    /// Push requests, per sender key.
    pub push: RateTable,
    /// Request-body budget, in [`BUDGET_UNIT`]s.
    budget: Arc<tokio::sync::Semaphore>,
    /// The budget's size in units.
    budget_units: u32,
}

impl RateLimits {
    /// The limits `config` asks for (`[rate]` and `trust_proxy`).
    pub fn new(config: &RelayConfig) -> Self {
        let r = &config.rate;
        let units = (r.body_budget_bytes / BUDGET_UNIT)
            .clamp(1, tokio::sync::Semaphore::MAX_PERMITS as u64);
        let budget_units = u32::try_from(units).unwrap_or(u32::MAX);
        RateLimits {
            trust_proxy: TrustProxy::of(config),
            enrol: RateTable::new(r.enrol_per_min, r.max_keys),
            info: RateTable::new(r.info_per_min, r.max_keys),
            push: RateTable::new(r.push_per_min, r.max_keys),
            budget: Arc::new(tokio::sync::Semaphore::new(budget_units as usize)),
            budget_units,
        }
    }

    /// Counts one push request of `sender` (a host key) at `now_ms`; `false` means every item
    /// of the request is answered `rejected:rate`.
    pub fn allow_push(&self, sender: &str, now_ms: i64) -> bool {
        self.push.hit(sender, now_ms).allowed()
    }

    /// Request-body bytes reserved right now.
    pub fn body_bytes_reserved(&self) -> u64 {
        let free = self.budget.available_permits() as u64;
        (u64::from(self.budget_units).saturating_sub(free)) * BUDGET_UNIT
    }

    fn table(&self, class: Class) -> &RateTable {
        match class {
            Class::Enrol => &self.enrol,
            Class::Info => &self.info,
        }
    }
}

/// 429 `{error:"rate_limit_exceeded", code:"RATE_LIMIT", retry_after}` with `Retry-After`, both
/// in whole seconds rounded up (at least 1).
pub fn too_many(retry_after_ms: i64) -> Response {
    let secs = u64::try_from(retry_after_ms.max(1))
        .unwrap_or(1)
        .div_ceil(1_000);
    let body = ErrorBody {
        error: "rate_limit_exceeded".into(),
        code: "RATE_LIMIT".into(),
        epoch: None,
        head_seq: None,
        retry_after: Some(secs),
    };
    (
        StatusCode::TOO_MANY_REQUESTS,
        [(header::RETRY_AFTER, HeaderValue::from(secs))],
        Json(body),
    )
        .into_response()
}

/// 503 `{error, code:"BUSY"}` with `Retry-After: 1`: the body budget is spent.
fn busy() -> Response {
    let body = ErrorBody {
        error: "relay busy: too many request bodies in flight; retry shortly".into(),
        code: "BUSY".into(),
        epoch: None,
        head_seq: None,
        retry_after: Some(1),
    };
    (
        StatusCode::SERVICE_UNAVAILABLE,
        [(header::RETRY_AFTER, HeaderValue::from(1u64))],
        Json(body),
    )
        .into_response()
}

/// The router layer over every relay route: the per-address bucket of the request's class
/// (429 past it), then the body budget (503 when spent; the reservation lives until the answer
/// is made). Requests of routes that do not exist never reach it.
pub async fn guard(State(state): State<SharedRelay>, req: Request, next: Next) -> Response {
    let limits = &state.rates;
    if let Some(class) = Class::of(req.method(), req.uri().path()) {
        let socket = req
            .extensions()
            .get::<ConnectInfo<SocketAddr>>()
            .map(|c| c.0);
        let address = client_address(req.headers(), socket, limits.trust_proxy);
        let verdict = limits.table(class).hit(&address, state.clock.now_ms());
        match verdict {
            Verdict::Allowed => {}
            Verdict::Limited { retry_after_ms } | Verdict::TableFull { retry_after_ms } => {
                tracing::debug!(?class, address = %address, retry_after_ms, "rate limited");
                return too_many(retry_after_ms);
            }
        }
    }
    let hint = req.body().size_hint();
    let share = hint
        .exact()
        .unwrap_or_else(|| hint.upper().unwrap_or(u64::MAX))
        .min(RELAY_MAX_BODY as u64);
    if share == 0 {
        return next.run(req).await;
    }
    let units = u32::try_from(share.div_ceil(BUDGET_UNIT))
        .unwrap_or(u32::MAX)
        .min(limits.budget_units);
    let Ok(_reserved) = limits.budget.clone().try_acquire_many_owned(units) else {
        tracing::warn!(
            reserved_bytes = limits.body_bytes_reserved(),
            "relay body budget spent: answering 503"
        );
        return busy();
    };
    next.run(req).await
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIN: i64 = 60_000;

    #[test]
    fn a_bucket_holds_per_min_hits_then_refills_one_interval_at_a_time() {
        let t = RateTable::new(30, 10);
        for i in 0..30 {
            assert_eq!(t.hit("a", 0), Verdict::Allowed, "hit {i}");
        }
        assert_eq!(
            t.hit("a", 0),
            Verdict::Limited {
                retry_after_ms: 2_000
            }
        );
        // Another key has its own bucket.
        assert_eq!(t.hit("b", 0), Verdict::Allowed);
        // One interval later, one more token.
        assert_eq!(t.hit("a", 1_999), Verdict::Limited { retry_after_ms: 1 });
        assert_eq!(t.hit("a", 2_000), Verdict::Allowed);
        assert!(!t.hit("a", 2_000).allowed());
        // A whole minute refills the bucket completely.
        for _ in 0..30 {
            assert!(t.hit("a", 2_000 + MIN).allowed());
        }
        assert!(!t.hit("a", 2_000 + MIN).allowed());
    }

    #[test]
    fn a_full_table_sweeps_refilled_buckets_and_otherwise_refuses_new_keys() {
        let t = RateTable::new(60, 3); // one token per second
        for k in ["a", "b", "c"] {
            assert!(t.hit(k, 0).allowed());
        }
        // Full of buckets that have not refilled: a new key is refused, known keys go on.
        assert_eq!(
            t.hit("d", 500),
            Verdict::TableFull {
                retry_after_ms: 500
            }
        );
        assert_eq!(t.len(), 3);
        assert!(t.hit("a", 500).allowed());
        // No sweep before the earliest refill, even for other new keys.
        assert!(matches!(t.hit("e", 900), Verdict::TableFull { .. }));
        // "b" and "c" refilled at 1,000 ("a" took a second hit): they are swept, "d" gets in.
        assert!(t.hit("d", 1_000).allowed());
        assert_eq!(t.len(), 2);
        assert!(t.len() <= t.cap());
    }

    #[test]
    fn sixty_thousand_distinct_keys_never_grow_a_table_past_its_cap() {
        let t = RateTable::new(30, 50_000);
        let mut refused = 0;
        for i in 0..60_000u32 {
            let key = std::net::Ipv4Addr::from(0x0A00_0000 + i).to_string();
            if !t.hit(&key, 0).allowed() {
                refused += 1;
            }
        }
        assert_eq!((t.len(), refused), (50_000, 10_000));
        // Once their buckets refilled, new keys are admitted again.
        assert!(t.hit("fresh", 2_000).allowed());
        assert_eq!(t.len(), 1);
    }

    fn headers(pairs: &[(&str, &str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (k, v) in pairs {
            h.append(
                axum::http::HeaderName::from_bytes(k.as_bytes()).unwrap(),
                HeaderValue::from_str(v).unwrap(),
            );
        }
        h
    }

    #[test]
    fn client_address_by_mode() {
        let sock: SocketAddr = "192.0.2.9:4040".parse().unwrap();
        let xff = headers(&[("x-forwarded-for", "6.6.6.6, 203.0.113.7")]);
        assert_eq!(
            client_address(&xff, Some(sock), TrustProxy::Socket),
            "192.0.2.9"
        );
        assert_eq!(
            client_address(&xff, Some(sock), TrustProxy::Xff),
            "203.0.113.7"
        );
        // Several header lines: the last line's rightmost entry.
        let two = headers(&[
            ("x-forwarded-for", "1.1.1.1"),
            ("x-forwarded-for", "forged, 198.51.100.4:8443"),
        ]);
        assert_eq!(
            client_address(&two, Some(sock), TrustProxy::Xff),
            "198.51.100.4"
        );
        // Spellings of one address are one key.
        let v6 = headers(&[("x-forwarded-for", "[0:0::1]:80")]);
        assert_eq!(client_address(&v6, Some(sock), TrustProxy::Xff), "::1");
        let mapped = headers(&[("cf-connecting-ip", " ::ffff:10.0.0.1 ")]);
        assert_eq!(
            client_address(&mapped, Some(sock), TrustProxy::Cloudflare),
            "10.0.0.1"
        );
        // Missing or garbled: the socket.
        for h in [
            headers(&[]),
            headers(&[("x-forwarded-for", "not an address")]),
            headers(&[("x-forwarded-for", " , ")]),
            headers(&[("cf-connecting-ip", "999.1.1.1")]),
        ] {
            for mode in [TrustProxy::Xff, TrustProxy::Cloudflare] {
                assert_eq!(client_address(&h, Some(sock), mode), "192.0.2.9");
            }
        }
        assert_eq!(
            client_address(&headers(&[]), None, TrustProxy::Xff),
            "unknown"
        );
        assert_eq!(cut("x".repeat(100)).len(), 64);
    }

    #[test]
    fn trust_proxy_values() {
        assert_eq!(TrustProxy::parse("xff"), Ok(TrustProxy::Xff));
        assert_eq!(TrustProxy::parse("1"), Ok(TrustProxy::Xff));
        assert_eq!(TrustProxy::parse("cloudflare"), Ok(TrustProxy::Cloudflare));
        assert!(TrustProxy::parse("XFF").is_err());
        assert!(TrustProxy::parse("").is_err());
    }

    #[test]
    fn rate_config_bounds() {
        RateConfig::default().validate().unwrap();
        for (i, (key, min, max)) in RATE_RANGES.iter().enumerate() {
            for (value, ok) in [
                (*min, true),
                (*max, true),
                (min - 1, false),
                (max + 1, false),
            ] {
                let mut c = RateConfig::default();
                let field = match i {
                    0 => &mut c.enrol_per_min,
                    1 => &mut c.info_per_min,
                    2 => &mut c.push_per_min,
                    3 => &mut c.max_keys,
                    _ => &mut c.body_budget_bytes,
                };
                *field = value;
                let got = c.validate();
                assert_eq!(got.is_ok(), ok, "{key}={value}: {got:?}");
                if !ok {
                    assert_eq!(
                        got.unwrap_err(),
                        format!("rate.{key} must be {min}..={max}, got {value}")
                    );
                }
            }
        }
    }

    #[test]
    fn relay_toml_rate_section_and_trust_proxy_are_checked() {
        let p = std::path::Path::new("relay.toml");
        let cfg = RelayConfig::parse(
            "trust_proxy = \"cloudflare\"\n[rate]\npush_per_min = 100000\nmax_keys = 7\n",
            p,
        )
        .unwrap();
        assert_eq!((cfg.rate.push_per_min, cfg.rate.max_keys), (100_000, 7));
        assert_eq!(cfg.rate.enrol_per_min, DEFAULT_ENROL_PER_MIN);
        assert_eq!(TrustProxy::of(&cfg), TrustProxy::Cloudflare);
        let limits = RateLimits::new(&cfg);
        assert_eq!(
            (limits.push.cap(), limits.trust_proxy),
            (7, TrustProxy::Cloudflare)
        );
        let e = RelayConfig::parse("[rate]\ninfo_per_min = 0\n", p)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("rate.info_per_min must be 1..=1000000, got 0"),
            "{e}"
        );
        let e = RelayConfig::parse("[rate]\nburst = 3\n", p)
            .unwrap_err()
            .to_string();
        assert!(e.contains("burst"), "{e}");
        let e = RelayConfig::parse("trust_proxy = \"yes\"\n", p)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("trust_proxy must be xff (or 1) or cloudflare"),
            "{e}"
        );
        assert_eq!(TrustProxy::of(&RelayConfig::default()), TrustProxy::Socket);
    }

    #[test]
    fn retry_after_is_whole_seconds_at_least_one() {
        for (ms, secs) in [
            (1, "1"),
            (999, "1"),
            (1_000, "1"),
            (1_001, "2"),
            (59_000, "59"),
        ] {
            let r = too_many(ms);
            assert_eq!(r.status(), StatusCode::TOO_MANY_REQUESTS);
            assert_eq!(r.headers()[header::RETRY_AFTER], secs, "{ms}");
        }
    }
}
