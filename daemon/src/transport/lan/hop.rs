//! The LAN signed hop on the server side (`wire.md` §2.5, §4): the middleware every signed
//! route runs behind, and what a good hop sets off.
//!
//! Order: the body must be UTF-8 (400) → the peer named by `x-mbx-host` must be pinned (401
//! `host not paired`) → `|now − ts| ≤ 5 min` (401 `stale or bad hop timestamp (check clocks)`)
//! → the signature over `METHOD\npathname\nts\nsha256hex(body)` by the pinned key (401 `bad hop
//! signature`) → the per-peer rate limit, 600 signed requests a minute (429). Then, in one
//! transaction: `peers.last_seen_at`, "peer is back" (the peer's pending outbox rows become due
//! now, their LAN failure count restarts) and the source address as a *candidate* only (kv
//! `peer-lastseen:<host>` = `ip:port`, not for presence beacons). After the commit, when that
//! candidate is not the pinned address, address healing is started in the background
//! ([`presence::learn_from_hop`], `wire.md` §4 "Presence/healing"); the request never waits
//! for it. `/v1/presence` is left out: its handler heals from the beacon itself. A verified
//! hop's unsigned `x-mbx-instance` header feeds the daemon's record of the peer's instance ids
//! ([`crate::instance::Instance::observe_peer`]), and nothing else.
//!
//! This module never changes trust: a peer is its pinned key; a source address or a port hint
//! is remembered for address healing, which must prove the key before moving anything.

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;

use axum::body::{Body, Bytes};
use axum::extract::{ConnectInfo, Request};
use axum::http::{HeaderMap, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};

use agentmbx_net::rate::RateTable;
use agentmbx_protocol::clock::SharedClock;
use agentmbx_protocol::hop::{self, header, HopError};
use agentmbx_protocol::keys::PublicKey;

use super::http::HttpError;
use super::{presence, SharedLan};
use crate::mailbox::peers::{self, Peer};
use crate::mailbox::{outbox, relay_state};

/// Signed requests one peer may make per minute (`wire.md` §4 server limits).
pub const PEER_REQUESTS_PER_MINUTE: u32 = 600;

/// The LAN port assumed for a peer that gave none (0.5.x's default daemon port).
pub const DEFAULT_LAN_PORT: u16 = 7373;

/// The kv key of the address a peer's last verified hop came from (`ip:port`); defined with
/// the other peer-address keys in [`super::presence`].
pub use super::presence::last_seen_key;

/// The verified caller of a signed route: set as a request extension by [`require_hop`].
#[derive(Debug, Clone)]
pub struct HopPeer(pub Peer);

/// Per-peer rate limit of signed requests (GCRA: a burst of `per_minute`, refilled evenly over
/// the minute; a [`RateTable`] on the daemon's clock, so tests drive it), keyed by the verified
/// peer host. Entries exist only for pinned peers, so the table stays as small as the peer
/// list: it has no cap of its own.
#[derive(Debug)]
pub struct PeerLimiter {
    per_minute: u32,
    clock: SharedClock,
    table: RateTable,
}

impl PeerLimiter {
    /// A limiter allowing `per_minute` requests a minute per peer (at least 1), timed by
    /// `clock`.
    pub fn new(clock: SharedClock, per_minute: u32) -> Self {
        let per_minute = per_minute.max(1);
        PeerLimiter {
            per_minute,
            clock,
            table: RateTable::new(u64::from(per_minute), u64::MAX),
        }
    }

    /// Counts one request from `host`; false when it is over the limit.
    pub fn check(&self, host: &str) -> bool {
        self.table.hit(host, self.clock.now_ms()).allowed()
    }

    /// The 429 answer for `host` (0.5.x's text).
    pub fn refusal(&self, host: &str) -> HttpError {
        HttpError::new(
            StatusCode::TOO_MANY_REQUESTS,
            format!(
                "rate limit: over {} requests a minute from {host}; retry later",
                self.per_minute
            ),
        )
    }
}

/// A header's text, "" when absent or not visible ASCII (0.5.x reads a missing header as "").
fn header_text<'a>(headers: &'a HeaderMap, name: &str) -> &'a str {
    headers
        .get(name)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
}

/// Checks a hop against the pinned `peer` (None: not pinned) at `now_ms`. `target` is the
/// request target (the query is not signed). Errors: 401 with the `wire.md` §2.5 texts.
pub fn check(
    peer: Option<Peer>,
    method: &str,
    target: &str,
    headers: &HeaderMap,
    body: &[u8],
    now_ms: i64,
) -> Result<Peer, HttpError> {
    let Some(peer) = peer else {
        return Err(HttpError::unauthorized("host not paired"));
    };
    let ts = header_text(headers, header::TS);
    let sig = header_text(headers, header::SIG);
    // A pinned key that does not parse verifies nothing.
    let verified = match PublicKey::from_b64(&peer.pubkey) {
        Ok(key) => hop::verify_lan_hop(&key, method, target, ts, body, sig, now_ms),
        Err(_) => Err(HopError::BadSignature),
    };
    match verified {
        Ok(()) => Ok(peer),
        Err(HopError::Stale | HopError::BadTimestamp) => Err(HttpError::unauthorized(
            "stale or bad hop timestamp (check clocks)",
        )),
        Err(_) => Err(HttpError::unauthorized("bad hop signature")),
    }
}

/// The address candidate a verified hop suggests: the source IP (IPv4-mapped unwrapped) with
/// the port from `x-mbx-port` if valid, else the pinned address's port, else
/// [`DEFAULT_LAN_PORT`]; IPv6 in brackets.
pub fn candidate(remote: IpAddr, port_hint: &str, pinned: Option<&str>) -> String {
    let ip = match remote {
        IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(IpAddr::V6(v6), IpAddr::V4),
        v4 => v4,
    };
    let hint = port_hint.parse::<u16>().ok().filter(|p| *p > 0);
    let pinned_port = pinned.and_then(|a| {
        let (_, port) = a.rsplit_once(':')?;
        port.parse::<u16>().ok().filter(|p| *p > 0)
    });
    let port = hint.or(pinned_port).unwrap_or(DEFAULT_LAN_PORT);
    SocketAddr::new(ip, port).to_string()
}

/// The middleware of every signed route (module docs: order). On success the request goes on
/// with its body and a [`HopPeer`] extension; the bookkeeping of a good hop is done before the
/// handler runs (a failure there is logged, never fatal: the backoff still delivers).
pub async fn require_hop(
    state: SharedLan,
    limiter: Arc<PeerLimiter>,
    req: Request,
    next: Next,
) -> Response {
    match verified(&state, &limiter, req).await {
        Ok(req) => next.run(req).await,
        Err(e) => e.into_response(),
    }
}

async fn verified(
    state: &SharedLan,
    limiter: &PeerLimiter,
    req: Request,
) -> Result<Request, HttpError> {
    let (mut parts, body) = req.into_parts();
    // The server's body cap already read the body; this only takes the buffered bytes.
    let body: Bytes = axum::body::to_bytes(body, super::http::MAX_BODY)
        .await
        .map_err(|_| HttpError::bad_request("request body could not be read"))?;
    if std::str::from_utf8(&body).is_err() {
        return Err(HttpError::bad_request("request body is not valid UTF-8"));
    }
    let host = header_text(&parts.headers, header::HOST).to_string();
    let pinned = {
        let host = host.clone();
        state
            .mailbox
            .run(move |conn| peers::by_name(conn, &host))
            .await?
    };
    let target = hop::normalize_target(parts.uri.path());
    let now = state.clock.now_ms();
    let peer = check(
        pinned,
        parts.method.as_str(),
        &target,
        &parts.headers,
        &body,
        now,
    )?;
    if !limiter.check(&peer.host) {
        return Err(limiter.refusal(&peer.host));
    }
    // Two daemons on the peer's key (advisory; a hop without the header never counts).
    let instance_id = header_text(&parts.headers, header::INSTANCE);
    if !instance_id.is_empty() {
        state
            .instance
            .observe_peer(&peer.host, &peer.pubkey, instance_id);
    }
    let remote = parts
        .extensions
        .get::<ConnectInfo<SocketAddr>>()
        .map(|c| c.0.ip());
    let learn = (target != "/v1/presence")
        .then(|| {
            remote.map(|ip| {
                candidate(
                    ip,
                    header_text(&parts.headers, header::PORT),
                    peer.addr.as_deref(),
                )
            })
        })
        .flatten();
    let port_hint = header_text(&parts.headers, header::PORT)
        .parse::<u16>()
        .ok()
        .filter(|p| *p > 0);
    // Only a source that is not where the peer is pinned is worth a probe.
    let heal_from = remote.filter(|_| learn.is_some() && learn != peer.addr);
    let host = peer.host.clone();
    let back = state
        .mailbox
        .run(move |conn| {
            let tx = conn.transaction()?;
            peers::seen(&tx, &host, now)?;
            // Alive, but its address is not proven to answer: a marked peer stays on the relay
            // (its rows keep their relay backoff) and its address is probed soon
            // (mailbox::lan_memory).
            let due = match crate::mailbox::lan_memory::alive(&tx, &host, now)? {
                None => outbox::peer_is_back(&tx, &host, now)?,
                Some(moved) => usize::from(moved),
            };
            if let Some(addr) = &learn {
                relay_state::kv_set(&tx, &last_seen_key(&host), addr)?;
            }
            tx.commit()?;
            Ok(due)
        })
        .await;
    match back {
        Ok(0) => {}
        Ok(due) => {
            tracing::debug!(peer = %peer.host, due, "peer is back: its queued mail is due now");
            state.wake.notify_one();
        }
        Err(e) => tracing::warn!(peer = %peer.host, error = %e, "could not record the peer's hop"),
    }
    if let Some(ip) = heal_from {
        let (state, host) = (state.clone(), peer.host.clone());
        tokio::spawn(async move {
            if let Err(e) = presence::learn_from_hop(&state, &host, ip, port_hint).await {
                tracing::warn!(peer = %host, error = %e, "address healing from a hop failed in the mailbox");
            }
        });
    }
    parts.extensions.insert(HopPeer(peer));
    Ok(Request::from_parts(parts, Body::from(body)))
}
