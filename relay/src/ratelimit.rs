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
//!     pass, by default every 2 s, so twenty hosts behind one address pass unthrottled);
//!   - `admin`: the operator endpoints `/v2/relay/admin/*` ([`ADMIN_PER_MIN`] per minute: an
//!     operator issues a few commands, a token guesser many).
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
//!   value is read as an IP address (so two spellings of one address are one bucket); an IPv6
//!   address counts by its /64 network (`2001:db8:1:2::/64`: one subscriber's allocation, in
//!   which a caller can pick fresh addresses at will), an IPv4-mapped IPv6 address as the IPv4
//!   address it maps. The text is cut to 64 characters.
//! - **The body budget**: at most `body_budget_bytes` (default 64 MiB) of request bodies are
//!   held at once over all connections, and at most `body_per_address_bytes` (default 16 MiB)
//!   by the requests of one client address. A request reserves its share (its declared length,
//!   or the 8 MiB body cap when it declares none — also counted against its address) before
//!   its body is read — that is, before it is authenticated — and keeps it until its answer is
//!   made; when no room is left, relay-wide or for its address, it is answered 503
//!   `{error, code:"BUSY"}` with `Retry-After: 1` at once. So many concurrent 8 MiB uploads
//!   cannot exhaust the relay's memory, and one address's slow uploads hold at most its own
//!   share: other addresses are still served.
//!
//! # Bounds
//! The tables and the budget are the shared building blocks ([`agentmbx_net::rate::RateTable`],
//! [`agentmbx_net::budget::BodyBudget`]); this module owns which tables exist, their limits and
//! keys, and the relay's answers. Every rate table holds at most `max_keys` keys (default
//! 50,000). An entry whose bucket has
//! refilled completely is forgotten (it is the same as no entry). When a new key arrives at a
//! full table, the refilled entries are swept out; if the table is still full the new key is
//! refused (429 with the time until the earliest entry refills) rather than the table growing
//! or an existing bucket being dropped (dropping one would let a flood of fake addresses reset
//! a real caller's bucket). A full table is swept at most once per earliest-refill time, so a
//! flood cannot make every request pay for a sweep.
//!
//! The per-address body reservations are kept only while a reservation is held; each holds at
//! least one 1 KiB unit of the relay-wide budget, so there are never more addresses in that
//! table than units in the budget (65,536 for 64 MiB).
//!
//! # Time
//! Buckets run on the relay's clock ([`agentmbx_protocol::clock`]), so tests drive them with
//! the manual clock and a clock offset moves them as it moves everything else.
//!
//! # What it must never do
//! Log or echo request bodies, keys or header values beyond the address it keys by; keep any
//! state on disk (rate windows are memory only: a restart forgets them).

use std::net::{IpAddr, SocketAddr};

use axum::body::HttpBody;
use axum::extract::{ConnectInfo, Request};
use axum::http::{header, HeaderMap, HeaderValue, Method, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::Json;

use agentmbx_net::budget::{BodyBudget, Refusal};
use agentmbx_net::log_gate::LogGate;
use agentmbx_net::rate::{self, retry_after_secs, RateTable, Verdict};

use agentmbx_protocol::clock::SharedClock;
use agentmbx_protocol::limits::RELAY_MAX_BODY;
use agentmbx_protocol::wire::ErrorBody;

use crate::config::RelayConfig;

/// The `[rate]` settings and the `trust_proxy` mode are configuration ([`crate::config::rate`]);
/// re-exported here beside the tables they size.
pub use crate::config::rate::{
    RateConfig, TrustProxy, DEFAULT_BODY_BUDGET_BYTES, DEFAULT_BODY_PER_ADDRESS_BYTES,
    DEFAULT_ENROL_PER_MIN, DEFAULT_INFO_PER_MIN, DEFAULT_MAX_KEYS, DEFAULT_PUSH_PER_MIN,
    RATE_RANGES,
};

/// Admin endpoint calls (`/v2/relay/admin/*`) per minute per client address.
pub const ADMIN_PER_MIN: u64 = 30;
/// Prefix length IPv6 client addresses are counted by (a /64 is one subscriber's network).
pub const IPV6_PREFIX_BITS: u32 = 64;
/// Longest client address kept (characters; 0.5.x cuts at 64).
pub const MAX_ADDRESS_CHARS: usize = 64;

/// The key an IP address is counted by (module docs): an IPv4 address (also one mapped into
/// IPv6) as itself, `203.0.113.7`; an IPv6 address by its /64 network, `2001:db8:1:2::/64`.
pub fn address_key(ip: IpAddr) -> String {
    match ip.to_canonical() {
        IpAddr::V4(v4) => v4.to_string(),
        IpAddr::V6(v6) => {
            let mask = u128::MAX << (128 - IPV6_PREFIX_BITS);
            let net = std::net::Ipv6Addr::from(u128::from(v6) & mask);
            format!("{net}/{IPV6_PREFIX_BITS}")
        }
    }
}

/// The address key one header value names, if it is an address: an IP, or an IP with a port
/// (`1.2.3.4:5678`, `[::1]:80`); see [`address_key`].
fn parse_address(text: &str) -> Option<String> {
    let text = text.trim();
    let ip = text
        .parse::<IpAddr>()
        .ok()
        .or_else(|| text.parse::<SocketAddr>().ok().map(|s| s.ip()))?;
    Some(address_key(ip))
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
/// an address) falls back to the socket address; `unknown` without one. Written as
/// [`address_key`] writes it (IPv6 by its /64).
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
        .or_else(|| socket.map(|s| address_key(s.ip())))
        .unwrap_or_else(|| "unknown".to_owned());
    cut(address)
}

/// Which per-address bucket a request draws from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Class {
    /// Challenge, enrol and rotate (one shared bucket).
    Enrol,
    /// `GET` (and `HEAD`) `/v2/relay/info`.
    Info,
    /// The admin endpoints, `/v2/relay/admin/*`.
    Admin,
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
            (_, p) if p.starts_with("/v2/relay/admin/") => Some(Class::Admin),
            _ => None,
        }
    }
}

/// The relay's rate tables, address mode and body budget (one per relay, in
/// [`crate::state::RelayState`]).
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
    /// Admin endpoint calls, per client address ([`ADMIN_PER_MIN`]).
    pub admin: RateTable,
    /// Warnings anyone can cause (a wrong admin token, a full challenge table), at most one a
    /// minute per key.
    pub warn_gate: LogGate,
    /// Request-body budget: relay-wide, and per client address.
    budget: BodyBudget,
}

impl RateLimits {
    /// The limits `config` asks for (`[rate]` and `trust_proxy`).
    pub fn new(config: &RelayConfig) -> Self {
        let r = &config.rate;
        RateLimits {
            trust_proxy: TrustProxy::of(config),
            enrol: RateTable::new(r.enrol_per_min, r.max_keys),
            info: RateTable::new(r.info_per_min, r.max_keys),
            push: RateTable::new(r.push_per_min, r.max_keys),
            admin: RateTable::new(ADMIN_PER_MIN, r.max_keys),
            warn_gate: LogGate::default(),
            budget: BodyBudget::new(r.body_budget_bytes, r.body_per_address_bytes),
        }
    }

    /// Counts one push request of `sender` (a host key) at `now_ms`; `false` means every item
    /// of the request is answered `rejected:rate`.
    pub fn allow_push(&self, sender: &str, now_ms: i64) -> bool {
        self.push.hit(sender, now_ms).allowed()
    }

    /// Request-body bytes reserved right now.
    pub fn body_bytes_reserved(&self) -> u64 {
        self.budget.bytes_reserved()
    }

    /// Request-body bytes the requests of client address `address` (as [`client_address`]
    /// writes it) hold right now.
    pub fn body_bytes_reserved_by(&self, address: &str) -> u64 {
        self.budget.bytes_reserved_by(address)
    }

    fn table(&self, class: Class) -> &RateTable {
        match class {
            Class::Enrol => &self.enrol,
            Class::Info => &self.info,
            Class::Admin => &self.admin,
        }
    }
}

/// 429 `{error:"rate_limit_exceeded", code:"RATE_LIMIT", retry_after}` with `Retry-After`, both
/// in whole seconds rounded up (at least 1).
pub fn too_many(retry_after_ms: i64) -> Response {
    let body = ErrorBody {
        error: "rate_limit_exceeded".into(),
        code: "RATE_LIMIT".into(),
        epoch: None,
        head_seq: None,
        retry_after: Some(retry_after_secs(retry_after_ms)),
    };
    rate::too_many(retry_after_ms, Json(body))
}

/// 503 `{error, code:"BUSY"}` with `Retry-After: 1`: the body budget is spent, relay-wide or
/// for the caller's address.
fn busy(refusal: Refusal) -> Response {
    let error = match refusal {
        Refusal::Budget => "relay busy: too many request bodies in flight; retry shortly",
        Refusal::Share => {
            "relay busy: too many request bodies in flight from this address; retry shortly"
        }
    };
    let body = ErrorBody {
        error: error.into(),
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
/// (429 past it), then the body budget, relay-wide and per client address (503 when spent;
/// the reservation lives until the answer is made). Requests of routes that do not exist never
/// reach it.
pub async fn guard(limits: &RateLimits, clock: &SharedClock, req: Request, next: Next) -> Response {
    let socket = req
        .extensions()
        .get::<ConnectInfo<SocketAddr>>()
        .map(|c| c.0);
    let address = client_address(req.headers(), socket, limits.trust_proxy);
    if let Some(class) = Class::of(req.method(), req.uri().path()) {
        let verdict = limits.table(class).hit(&address, clock.now_ms());
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
    let _reserved = match limits.budget.try_reserve(&address, share) {
        Ok(r) => r,
        Err(Refusal::Budget) => {
            tracing::warn!(
                reserved_bytes = limits.body_bytes_reserved(),
                "relay body budget spent: answering 503"
            );
            return busy(Refusal::Budget);
        }
        Err(Refusal::Share) => {
            tracing::debug!(address = %address, "the body share of one address is spent: answering 503");
            return busy(Refusal::Share);
        }
    };
    next.run(req).await
}

#[cfg(test)]
mod tests {
    use super::*;

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
    fn the_mode_is_said_in_words_for_the_log() {
        assert_eq!(
            TrustProxy::Socket.to_string(),
            "the connection's peer address (trust_proxy unset: no proxy trusted)"
        );
        assert!(TrustProxy::Xff.to_string().contains("X-Forwarded-For"));
        assert!(TrustProxy::Cloudflare
            .to_string()
            .contains("CF-Connecting-IP"));
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
        // Spellings of one address are one key (an IPv6 one counted by its /64).
        let v6 = headers(&[("x-forwarded-for", "[0:0::1]:80")]);
        assert_eq!(client_address(&v6, Some(sock), TrustProxy::Xff), "::/64");
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
    fn ipv6_addresses_count_by_their_64_and_mapped_ones_as_ipv4() {
        let key = |t: &str| address_key(t.parse().unwrap());
        assert_eq!(key("2001:db8:1:2::1"), "2001:db8:1:2::/64");
        assert_eq!(
            key("2001:db8:1:2:ffff:ffff:ffff:ffff"),
            key("2001:db8:1:2:abcd::9")
        );
        assert_ne!(key("2001:db8:1:2::1"), key("2001:db8:1:3::1"));
        assert_eq!(key("::ffff:203.0.113.7"), "203.0.113.7");
        assert_eq!(key("203.0.113.7"), "203.0.113.7");
        // The same through every source of the address.
        let sock: SocketAddr = "[2001:db8:aa:bb:1:2:3:4]:443".parse().unwrap();
        assert_eq!(
            client_address(&headers(&[]), Some(sock), TrustProxy::Socket),
            "2001:db8:aa:bb::/64"
        );
        let mapped: SocketAddr = "[::ffff:192.0.2.1]:443".parse().unwrap();
        assert_eq!(
            client_address(&headers(&[]), Some(mapped), TrustProxy::Socket),
            "192.0.2.1"
        );
        let cf = headers(&[("cf-connecting-ip", "2001:db8:aa:bb::77")]);
        assert_eq!(
            client_address(&cf, Some(mapped), TrustProxy::Cloudflare),
            "2001:db8:aa:bb::/64"
        );
        // One bucket for the whole /64: fresh addresses inside it do not get fresh tokens.
        let t = RateTable::new(2, 10);
        let ip = |n: u16| {
            let h = headers(&[("x-forwarded-for", &format!("2001:db8:5:6::{n:x}") as &str)]);
            client_address(&h, None, TrustProxy::Xff)
        };
        assert!(t.hit(&ip(1), 0).allowed());
        assert!(t.hit(&ip(2), 0).allowed());
        assert!(!t.hit(&ip(3), 0).allowed());
        assert_eq!(t.len(), 1);
        let other = headers(&[("x-forwarded-for", "2001:db8:5:7::1")]);
        assert!(t
            .hit(&client_address(&other, None, TrustProxy::Xff), 0)
            .allowed());
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
                    4 => &mut c.body_budget_bytes,
                    _ => &mut c.body_per_address_bytes,
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
}
