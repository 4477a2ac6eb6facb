//! The pairing routes of the LAN server (`wire.md` §2.9, §4; the pairing rules and state are
//! [`crate::pairing`]'s): unauthenticated by design, since
//! the caller is not paired yet; each proves itself by a token MAC or by a code the humans
//! compare.
//!
//! | route | answer |
//! |---|---|
//! | `GET /v1/pair/hello` | `{v:1, host, host_pubkey, owner_pubkey:null, nonce}`, nonce single use, 2 min |
//! | `POST /v1/pair/join` | 200 `{v:1, host, mac}` after the joiner is pinned; 400/401/409 `{error}` |
//! | `POST /v1/pair` | `{v:2, commit}` → this host's offer; `{v:2, offer}` → `{ok:true}` (pending comparison) |
//!
//! Hello and join share [`crate::pairing::TOKEN_REQS_PER_MIN`]; `POST /v1/pair` has
//! [`crate::pairing::COMPARE_REQS_PER_MIN`]; past them 429 `{error}` with `Retry-After` (s).
//! Refusal texts are 0.5.x's, so a 0.5.x joiner shows the same message.
//!
//! Invariants: a hello nonce or a commitment answers at most one request; a join pins its
//! joiner and consumes its token in one transaction, committed before the 200; a join whose MAC
//! matches no live token counts a failure on every live token (5 burn it), committed before the
//! 401. These handlers never log a token, a key K, a MAC or a body.

use axum::body::Bytes;
use axum::extract::{DefaultBodyLimit, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use rusqlite::TransactionBehavior;
use serde_json::{json, Value};

use agentmbx_protocol::pairing::{
    offer_commit, sas_code, HolderParty, PairAccept, PairHello, PairJoin, PairOffer,
};

use crate::mailbox::MailboxError;
use crate::pairing::{
    check_party, own_offer, store, valid_addr, valid_text, MAX_MAC_LEN, MAX_NONCE_LEN,
};
use crate::transport::lan::{LanState, SharedLan};

/// Largest pairing request body accepted, in bytes: a join or an offer is well under 2 KiB.
pub const MAX_BODY_BYTES: usize = 16 * 1024;

/// `400` for a join that is not `{v:1, host, host_pubkey, owner_pubkey, nonce, addr, nonce_a,
/// mac}` with valid fields.
pub const BAD_JOIN: &str = "bad join request";
/// `401` for a join whose `nonce_a` was never issued, was used, or lapsed.
pub const UNKNOWN_HELLO: &str = "unknown or expired hello nonce; run join again";
/// `401` for a join whose MAC matches no live token.
pub const NOT_VERIFIED: &str = "pairing token or transcript does not verify";
/// `401` for a join whose token stopped being live between its check and its use.
pub const JUST_USED: &str = "pairing token was just used";
/// `409` (join) or refusal (comparison) for a peer with this host's own name.
pub const SAME_NAME: &str =
    "peer has the same host name as this host; rename one (host in config.toml)";
/// `400` for a `POST /v1/pair` that is neither `{v:2, commit}` nor `{v:2, offer}`.
pub const BAD_OFFER: &str = "bad offer: code-compare pairing commits before it reveals (v2); upgrade AgentMBX on the initiating host";
/// `401` for a revealed offer that matches no live commitment.
pub const NO_COMMITMENT: &str = "no live commitment matches this offer; run pair --compare again";

/// The pairing routes, to be merged into the LAN server's router (which supplies the state).
pub fn router() -> Router<SharedLan> {
    Router::new()
        .route("/v1/pair/hello", get(hello).fallback(method_not_allowed))
        .route("/v1/pair/join", post(join).fallback(method_not_allowed))
        .route("/v1/pair", post(compare).fallback(method_not_allowed))
        .layer(DefaultBodyLimit::max(MAX_BODY_BYTES))
}

fn refuse(status: StatusCode, error: impl Into<String>) -> Response {
    (status, Json(json!({ "error": error.into() }))).into_response()
}

/// 429 `{error}` with `Retry-After` in whole seconds, rounded up (at least 1).
fn too_many(wait_ms: i64, error: &str) -> Response {
    agentmbx_net::rate::too_many(wait_ms, Json(json!({ "error": error })))
}

fn internal(e: &MailboxError) -> Response {
    tracing::error!(error = %e, "pairing: mailbox error");
    refuse(StatusCode::INTERNAL_SERVER_ERROR, "internal error")
}

async fn method_not_allowed() -> Response {
    refuse(StatusCode::METHOD_NOT_ALLOWED, "method not allowed")
}

/// This host as party A of a token join, for the hello nonce `nonce`.
fn holder(lan: &LanState, nonce: String) -> HolderParty {
    HolderParty {
        host: lan.ident.host.to_string(),
        host_pubkey: lan.ident.host_key.public().to_b64(),
        owner_pubkey: None,
        nonce,
    }
}

/// `GET /v1/pair/hello`.
async fn hello(State(lan): State<SharedLan>) -> Response {
    if let Err(wait) = lan.pairing.check_token_rate(&lan.clock) {
        return too_many(wait, "too many pairing attempts; wait a minute");
    }
    let nonce = lan.pairing.issue_hello(lan.clock.now_ms());
    Json(PairHello {
        v: 1,
        holder: holder(&lan, nonce),
    })
    .into_response()
}

/// The shape checks of a join body (`wire.md` §2.9 "Validation").
fn parse_join(body: &[u8]) -> Option<PairJoin> {
    let j: PairJoin = serde_json::from_slice(body).ok()?;
    let b = &j.joiner;
    let ok = j.v == 1
        && check_party(&b.host, &b.host_pubkey, b.owner_pubkey.as_deref(), &b.nonce).is_ok()
        && valid_addr(&b.addr)
        && valid_text(&j.nonce_a, MAX_NONCE_LEN)
        && valid_text(&j.mac, MAX_MAC_LEN);
    ok.then_some(j)
}

/// What the join transaction decided.
enum JoinOutcome {
    Accepted {
        accept: PairAccept,
        token_id: String,
    },
    Refused(StatusCode, String),
}

/// `POST /v1/pair/join`.
async fn join(State(lan): State<SharedLan>, body: Bytes) -> Response {
    if let Err(wait) = lan.pairing.check_token_rate(&lan.clock) {
        return too_many(wait, "too many pairing attempts; wait a minute");
    }
    let Some(j) = parse_join(&body) else {
        return refuse(StatusCode::BAD_REQUEST, BAD_JOIN);
    };
    let now = lan.clock.now_ms();
    if !lan.pairing.take_hello(&j.nonce_a, now) {
        return refuse(StatusCode::UNAUTHORIZED, UNKNOWN_HELLO);
    }
    let holder = holder(&lan, j.nonce_a.clone());
    let local = lan.ident.host.to_string();
    let joiner = j.joiner.clone();
    let outcome = lan
        .mailbox
        .run(move |conn| {
            let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate)?;
            let tokens = store::live_tokens(&tx, now)?;
            if tokens.is_empty() {
                return Ok(JoinOutcome::Refused(
                    StatusCode::UNAUTHORIZED,
                    format!("no live pairing token on {local} (expired, used or burned); run 'agentmbx pair' there again"),
                ));
            }
            let Some(token) = tokens.iter().find(|t| j.verify(&holder, &t.key)) else {
                store::record_failure(&tx, now)?;
                tx.commit()?;
                return Ok(JoinOutcome::Refused(
                    StatusCode::UNAUTHORIZED,
                    NOT_VERIFIED.to_string(),
                ));
            };
            let b = &j.joiner;
            if b.host == local {
                return Ok(JoinOutcome::Refused(StatusCode::CONFLICT, SAME_NAME.into()));
            }
            if let Some(why) = store::pin_conflict(&tx, &local, &b.host, &b.host_pubkey)? {
                return Ok(JoinOutcome::Refused(StatusCode::CONFLICT, why));
            }
            if !store::consume_token(&tx, &token.id, &b.host, now)? {
                return Ok(JoinOutcome::Refused(
                    StatusCode::UNAUTHORIZED,
                    JUST_USED.into(),
                ));
            }
            store::pin(
                &tx,
                &b.host,
                &b.host_pubkey,
                b.owner_pubkey.as_deref(),
                Some(&b.addr),
                now,
            )?;
            tx.commit()?;
            Ok(JoinOutcome::Accepted {
                accept: PairAccept::new(&holder, b, &token.key),
                token_id: token.id.clone(),
            })
        })
        .await;
    match outcome {
        Ok(JoinOutcome::Accepted { accept, token_id }) => {
            tracing::info!(
                peer = %joiner.host,
                addr = %joiner.addr,
                token = %token_id,
                "paired with {} using pairing token {token_id}",
                joiner.host
            );
            Json(accept).into_response()
        }
        Ok(JoinOutcome::Refused(status, why)) => {
            tracing::warn!(peer = %joiner.host, addr = %joiner.addr, %status, "pairing join refused: {why}");
            refuse(status, why)
        }
        Err(e) => internal(&e),
    }
}

/// A validated `{v:2, offer}` reveal: the offer as received (committed over) and typed.
fn parse_offer(body: &Value) -> Option<(&Value, PairOffer)> {
    if body.get("v").and_then(Value::as_u64) != Some(2) {
        return None;
    }
    let raw = body.get("offer")?;
    let offer: PairOffer = serde_json::from_value(raw.clone()).ok()?;
    let ok = offer.v == 1
        && check_party(
            &offer.host,
            &offer.host_pubkey,
            offer.owner_pubkey.as_deref(),
            &offer.nonce,
        )
        .is_ok()
        && valid_addr(&offer.addr);
    ok.then_some((raw, offer))
}

/// `POST /v1/pair` (SAS, commit-reveal).
async fn compare(State(lan): State<SharedLan>, body: Bytes) -> Response {
    if let Err(wait) = lan.pairing.check_compare_rate(&lan.clock) {
        return too_many(wait, "too many pairing attempts");
    }
    let Ok(body) = serde_json::from_slice::<Value>(&body) else {
        return refuse(StatusCode::BAD_REQUEST, BAD_OFFER);
    };
    let now = lan.clock.now_ms();
    // Step 1: the initiator commits; answer with this host's offer, nonce bound to the commit.
    if body.get("v").and_then(Value::as_u64) == Some(2) {
        if let Some(commit) = body.get("commit").and_then(Value::as_str) {
            if !valid_text(commit, 64) {
                return refuse(StatusCode::BAD_REQUEST, BAD_OFFER);
            }
            let nonce = lan.pairing.issue_commitment(commit, now);
            return Json(own_offer(&lan.ident, &lan.advertise, nonce)).into_response();
        }
    }
    // Step 2: the initiator reveals; pend it only if it is what was committed to.
    let Some((raw, offer)) = parse_offer(&body) else {
        return refuse(StatusCode::BAD_REQUEST, BAD_OFFER);
    };
    let Ok(commit) = offer_commit(raw) else {
        return refuse(StatusCode::BAD_REQUEST, BAD_OFFER);
    };
    let Some(local_nonce) = lan.pairing.take_commitment(&commit, now) else {
        return refuse(StatusCode::UNAUTHORIZED, NO_COMMITMENT);
    };
    let local = lan.ident.host.to_string();
    if offer.host == local {
        return refuse(StatusCode::CONFLICT, SAME_NAME);
    }
    let mine = own_offer(&lan.ident, &lan.advertise, local_nonce);
    let code = sas_code(&[mine.clone(), offer.clone()]);
    let pending = store::Pending {
        host: offer.host.clone(),
        pubkey: offer.host_pubkey.clone(),
        owner_pubkey: offer.owner_pubkey.clone(),
        addr: Some(offer.addr.clone()),
        nonce_local: mine.nonce,
        nonce_remote: offer.nonce.clone(),
        code: code.clone(),
        created_at: now,
        expires_at: now + crate::pairing::PENDING_TTL_MS,
    };
    let stored = lan
        .mailbox
        .run(move |conn| {
            let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate)?;
            store::purge_pending(&tx, now)?;
            if let Some(why) = store::pin_conflict(&tx, &local, &pending.host, &pending.pubkey)? {
                return Ok(Err(why));
            }
            store::put_pending(&tx, &pending)?;
            tx.commit()?;
            Ok(Ok(()))
        })
        .await;
    match stored {
        Ok(Ok(())) => {
            tracing::info!(
                peer = %offer.host,
                addr = %offer.addr,
                "pairing request from {} ({}): code {code}; if the other host shows the same code, approve with: agentmbx pair approve {} {code}",
                offer.host,
                offer.addr,
                offer.host
            );
            Json(json!({ "ok": true })).into_response()
        }
        Ok(Err(why)) => refuse(StatusCode::CONFLICT, why),
        Err(e) => internal(&e),
    }
}

#[cfg(test)]
mod tests;
