//! `POST /v2/relay/senders {list, sig}` (spec §2 "Sender allowlist"; `wire.md` §2.12, §3.1): a
//! target publishes the sender keys it accepts, signed by its own host key.
//!
//! `list` is `{v:1, type:"relay-senders", host_pubkey, senders, iat}`; `sig` is the target's
//! signature over canonical(`list` as received, every field it carries). Checks, in 0.5.x's
//! order, after the v2 hop:
//! 1. the shape — `v` 1, `type` `relay-senders`, `host_pubkey` the caller's own key (the hop
//!    key: a host publishes only its own list), `iat` an ISO ms time, `senders` an array of at
//!    most [`MAX_SENDERS`] Ed25519 keys each in canonical padded base64 — else 400
//!    `bad sender list: <why>`;
//! 2. `iat` at most 5 minutes ahead of the relay clock (so a future-dated list cannot freeze the
//!    allowlist) — else 400 `sender list iat is in the future`;
//! 3. the signature — else 401 `BAD_SIGNATURE`;
//! 4. a stored list with the same or a newer `iat` — 409 `STALE`, nothing changes.
//!
//! Then the list replaces the stored one (repeated senders kept once) and `{ok:true}` is
//! answered after its commit. From then on pushes from keys not listed are refused
//! `rejected:sender not accepted by target` (the push handler and the store check it).

use axum::extract::{Request, State};
use axum::http::StatusCode;
use axum::Json;
use serde_json::{json, Value};

use agentmbx_protocol::canonical;
use agentmbx_protocol::keys::PublicKey;

use crate::auth::{authenticate, blocking, read_body, utf8};
use crate::error::ApiError;
use crate::state::SharedRelay;
use crate::store::{SenderList, SenderListOutcome};

/// Most senders one list names (`wire.md` "Resolved details" → "Sender allowlists": 1,024, as
/// 0.5.x).
pub const MAX_SENDERS: usize = 1_024;

/// Body cap of this endpoint: a full list of [`MAX_SENDERS`] keys is about 48 KiB of JSON.
pub const MAX_BODY: usize = 64 * 1024;

/// How far ahead of the relay clock a list's `iat` may be (ms; spec §2: 5 minutes).
pub const MAX_IAT_AHEAD_MS: i64 = 300_000;

fn bad_list(why: &str) -> ApiError {
    ApiError::bad_request(format!("bad sender list: {why}"))
}

/// Whether `text` is an Ed25519 host key in its one canonical form (what enrolment stores).
fn is_canonical_key(text: &str) -> bool {
    PublicKey::from_b64(text).is_ok_and(|k| k.to_b64() == text)
}

/// The checked fields of a list: `(senders, iat_ms)`.
fn check_shape(list: &Value, caller: &str) -> Result<(Vec<String>, i64), ApiError> {
    let Some(fields) = list.as_object() else {
        return Err(bad_list("list must be an object"));
    };
    if fields.get("v").and_then(Value::as_f64) != Some(1.0)
        || fields.get("type").and_then(Value::as_str) != Some("relay-senders")
    {
        return Err(bad_list("not a relay-senders record"));
    }
    if fields.get("host_pubkey").and_then(Value::as_str) != Some(caller) {
        return Err(bad_list(
            "host_pubkey must be the publishing host's own key",
        ));
    }
    let iat = fields
        .get("iat")
        .and_then(Value::as_str)
        .and_then(agentmbx_protocol::time::parse_iso_ms)
        .ok_or_else(|| bad_list("iat must be an ISO time (YYYY-MM-DDTHH:MM:SS.mmmZ)"))?;
    let Some(senders) = fields.get("senders").and_then(Value::as_array) else {
        return Err(bad_list("senders must be an array of host keys"));
    };
    if senders.len() > MAX_SENDERS {
        return Err(bad_list(&format!("more than {MAX_SENDERS} senders")));
    }
    let senders = senders
        .iter()
        .map(|s| {
            s.as_str()
                .filter(|s| is_canonical_key(s))
                .map(str::to_owned)
        })
        .collect::<Option<Vec<_>>>()
        .ok_or_else(|| bad_list("every sender must be a host key (padded standard base64)"))?;
    Ok((senders, iat))
}

/// Handles `POST /v2/relay/senders`.
pub async fn post(State(state): State<SharedRelay>, req: Request) -> Result<Json<Value>, ApiError> {
    let (parts, body) = req.into_parts();
    let body = read_body(body, MAX_BODY).await?;
    let raw = utf8(&body)?;
    let caller = authenticate(&state, &parts.method, &parts.uri, &parts.headers, raw).await?;
    let post: Value = serde_json::from_str(raw).map_err(|_| bad_list("{list, sig} required"))?;
    let list = post.get("list").cloned().unwrap_or(Value::Null);
    let (senders, iat_ms) = check_shape(&list, &caller.host_pubkey)?;
    if iat_ms > state.clock.now_ms().saturating_add(MAX_IAT_AHEAD_MS) {
        return Err(ApiError::bad_request("sender list iat is in the future"));
    }
    let record = canonical::to_string(&list).map_err(|_| bad_list("list is not canonical JSON"))?;
    let key = PublicKey::from_b64(&caller.host_pubkey).map_err(|_| ApiError::bad_hop())?;
    let sig = post.get("sig").and_then(Value::as_str).unwrap_or("");
    if !key.verify(record.as_bytes(), sig) {
        state.refused.auth(
            crate::refusals::AuthRefusal::BadListSignature,
            parts.method.as_str(),
            parts.uri.path(),
            Some(&key.fingerprint()),
        );
        return Err(ApiError::new(
            StatusCode::UNAUTHORIZED,
            "sender list is not signed by the target",
            "BAD_SIGNATURE",
        ));
    }
    let store = state.store.clone();
    let list = SenderList {
        target_pubkey: caller.host_pubkey,
        senders,
        iat_ms,
        record,
        sig: sig.to_owned(),
    };
    match blocking(move || store.put_sender_list(list)).await? {
        SenderListOutcome::Stored => Ok(Json(json!({"ok": true}))),
        SenderListOutcome::Stale => Err(ApiError::new(
            StatusCode::CONFLICT,
            "a newer sender list is already stored",
            "STALE",
        )),
    }
}
