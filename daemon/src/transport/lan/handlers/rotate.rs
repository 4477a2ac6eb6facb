//! `POST /v1/rotate {records:[≤50]}`: a paired host announces that it rotated its host key
//! (`wire.md` §2.10, §4; spec §2 "Rotation"). Unsigned by design: a rotated peer signs its hops
//! with a key this host has not pinned yet, so each record authenticates itself (signed by the
//! pinned old key and by the new key). This handler only parses, rate-limits, hands the records
//! to the mail logic ([`crate::node::rotation`]: the matching rules, the refusals and the pin
//! update) and answers.
//!
//! Order: the per-address rate limit, [`ROTATE_REQS_PER_MIN`] a minute per client address (429
//! `{error}` with `Retry-After`, before any byte of the body is read; the table holds at most
//! [`MAX_ROTATE_CLIENTS`] addresses) → the body, at most [`MAX_ROTATE_BODY`] bytes (413) → JSON
//! (400) → `records` an array of at most [`MAX_RECORDS_PER_ANNOUNCE`] (400 `bad batch`) → each
//! record in order, in its own transaction ([`accept_records`]). The answer `{results:[…]}`
//! (0.5.x: one string per record, `rotated`, `current` or `rejected:<why>`) is sent after the
//! last commit; when a pin moved, the sender loops are woken. The refused records of a request
//! are logged as one line (how many, the first reason), at WARN at most once a minute per client
//! address, else at DEBUG.
//!
//! This module never logs a key, a signature or a record: fingerprints and fixed reasons only.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use axum::extract::{ConnectInfo, Request, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::{Json, Router};
use serde_json::Value;

use agentmbx_net::body::{read_capped, BodyError};
use agentmbx_net::log_gate::LogGate;
use agentmbx_net::rate::{RateTable, Verdict, WhenFull};
use agentmbx_protocol::clock::SharedClock;
use agentmbx_protocol::keys::PublicKey;
use agentmbx_protocol::rotation::{RotateAnswer, RotateResult, MAX_RECORDS_PER_ANNOUNCE};

use super::{parse_json, HttpError};
use crate::node::rotation::accept_records;
use crate::transport::lan::SharedLan;

// Rotation acceptance is mail logic ([`crate::node::rotation`]); its items keep their paths
// here too.
pub use crate::node::rotation::{accept_record, Outcome, NEW_KEY_TAKEN, NOT_PAIRED, WRONG_HOST};

/// Rotation announcements one client address may make per minute (`wire.md` §4: 30/min; a
/// burst of 30, then one every 2 s).
pub const ROTATE_REQS_PER_MIN: u32 = 30;
/// Most client addresses the rate table holds; past it the address closest to a full budget
/// is forgotten first (a forgotten address starts with a full budget, as it would anyway).
pub const MAX_ROTATE_CLIENTS: usize = 1024;
/// Largest `POST /v1/rotate` body accepted, in bytes (64 KiB: 50 records are about 25 KiB).
pub const MAX_ROTATE_BODY: usize = 64 * 1024;

/// 429 text (0.5.x).
pub const TOO_MANY: &str = "too many key rotation announcements; retry later";
/// 400 text for a body that is not `{records:[≤50]}` (0.5.x).
pub const BAD_BATCH: &str = "bad batch";
/// A request's refused records are summed up in one log line, at WARN at most once per this
/// many ms per client address (else at DEBUG), so a flood of bad records cannot flood the log.
pub const REFUSAL_WARN_EVERY_MS: i64 = 60_000;

/// The route, merged into the LAN router outside the shared body cap (this route reads its
/// own, smaller one after the rate check).
pub fn router(clock: SharedClock) -> Router<SharedLan> {
    let limiter = Arc::new(AddressLimiter::new(
        clock,
        ROTATE_REQS_PER_MIN,
        MAX_ROTATE_CLIENTS,
    ));
    let gate = Arc::new(LogGate::new(REFUSAL_WARN_EVERY_MS, MAX_ROTATE_CLIENTS));
    Router::new().route(
        "/v1/rotate",
        post(move |State(state): State<SharedLan>, req: Request| {
            let (limiter, gate) = (limiter.clone(), gate.clone());
            async move { handle(state, &limiter, &gate, req).await }
        }),
    )
}

/// A per-client-address rate limit (GCRA: a burst of `per_minute`, refilled evenly over the
/// minute) in a table of at most `cap` addresses, timed by the daemon's clock: a [`RateTable`]
/// that forgets the addresses closest to a full budget when full ([`WhenFull`]).
#[derive(Debug)]
pub struct AddressLimiter {
    clock: SharedClock,
    table: RateTable,
}

impl AddressLimiter {
    /// `per_minute` requests a minute per address (at least 1), at most `cap` addresses (at
    /// least 1) remembered.
    pub fn new(clock: SharedClock, per_minute: u32, cap: usize) -> Self {
        let cap = u64::try_from(cap).unwrap_or(u64::MAX);
        AddressLimiter {
            clock,
            table: RateTable::new(u64::from(per_minute), cap)
                .when_full(WhenFull::ForgetClosestToFull),
        }
    }

    /// Counts one request from `addr` (IPv4-mapped IPv6 counts as its IPv4 address): `Ok`
    /// when allowed, else how long until the next one is.
    pub fn check(&self, addr: IpAddr) -> Result<(), Duration> {
        let key = addr.to_canonical().to_string();
        match self.table.hit(&key, self.clock.now_ms()) {
            Verdict::Allowed => Ok(()),
            Verdict::Limited { retry_after_ms } | Verdict::TableFull { retry_after_ms } => Err(
                Duration::from_millis(u64::try_from(retry_after_ms).unwrap_or(1)),
            ),
        }
    }

    /// Addresses held now (never more than the cap).
    pub fn len(&self) -> usize {
        self.table.len()
    }

    /// Whether no address is held.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

fn fingerprint(b64: &str) -> String {
    PublicKey::from_b64(b64)
        .map(|k| k.fingerprint())
        .unwrap_or_default()
}

/// 429 `{error:`[`TOO_MANY`]`}` with `Retry-After` in whole seconds, rounded up (at least 1).
fn too_many(wait: Duration) -> Response {
    let wait_ms = i64::try_from(wait.as_millis()).unwrap_or(i64::MAX);
    agentmbx_net::rate::too_many(
        wait_ms,
        HttpError::new(StatusCode::TOO_MANY_REQUESTS, TOO_MANY),
    )
}

/// The records of a `{records:[≤50]}` body, else 400 [`BAD_BATCH`].
fn records(body: Value) -> Result<Vec<Value>, HttpError> {
    let records = match body {
        Value::Object(mut map) => map.remove("records"),
        _ => None,
    };
    match records {
        Some(Value::Array(items)) if items.len() <= MAX_RECORDS_PER_ANNOUNCE => Ok(items),
        _ => Err(HttpError::bad_request(BAD_BATCH)),
    }
}

async fn handle(
    state: SharedLan,
    limiter: &AddressLimiter,
    gate: &LogGate,
    req: Request,
) -> Response {
    let remote = req
        .extensions()
        .get::<ConnectInfo<SocketAddr>>()
        .map_or(IpAddr::V4(Ipv4Addr::UNSPECIFIED), |c| c.0.ip());
    if let Err(wait) = limiter.check(remote) {
        // Not a warning: a flood would fill the log.
        tracing::debug!(client = %remote, "key rotation announcements over the rate limit");
        return too_many(wait);
    }
    let body = match read_capped(req.into_body(), MAX_ROTATE_BODY).await {
        Ok(b) => b,
        Err(BodyError::TooLarge) => return HttpError::too_large(MAX_ROTATE_BODY).into_response(),
        Err(BodyError::Broken) => {
            return HttpError::bad_request("request body could not be read").into_response()
        }
    };
    match answer(&state, &body, remote, gate).await {
        Ok(a) => Json(a).into_response(),
        Err(e) => e.into_response(),
    }
}

async fn answer(
    state: &SharedLan,
    body: &[u8],
    remote: IpAddr,
    gate: &LogGate,
) -> Result<RotateAnswer, HttpError> {
    let records = records(parse_json(body)?)?;
    let now = state.clock.now_ms();
    let outcomes = state
        .mailbox
        .run(move |conn| accept_records(conn, &records, now))
        .await?;
    let mut moved = false;
    let (mut refused, mut first_reason) = (0usize, None::<&str>);
    for o in &outcomes {
        match (&o.result, &o.rotated) {
            (RotateResult::Rotated, Some(r)) => {
                moved = true;
                tracing::info!(
                    peer = %r.host,
                    from = %fingerprint(&r.old_pub),
                    to = %fingerprint(&r.new_pub),
                    retargeted = o.retargeted,
                    "the peer rotated its host key: pin moved, the old key only verifies mail signed before"
                );
            }
            (RotateResult::Rejected(why), _) => {
                refused += 1;
                first_reason.get_or_insert(why.as_str());
            }
            _ => {}
        }
    }
    if let Some(first) = first_reason {
        // One line per request; at WARN at most once a minute per address (anyone can send
        // bad records).
        let client = match remote {
            IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(IpAddr::V6(v6), IpAddr::V4),
            v4 => v4,
        };
        if gate.warn(&client.to_string(), now) {
            tracing::warn!(%client, refused, first_reason = %first, "key rotation records refused (further refusals from this address in the next minute are logged at debug)");
        } else {
            tracing::debug!(%client, refused, first_reason = %first, "key rotation records refused");
        }
    }
    if moved {
        // Mail for the peer is due now, sealed for its new key; the allowlist follows the pin.
        state.wake.notify_one();
    }
    Ok(RotateAnswer {
        results: outcomes.into_iter().map(|o| o.result).collect(),
    })
}

#[cfg(test)]
mod tests;
