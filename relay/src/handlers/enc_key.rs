//! Enc-key advertisements on the relay (spec §2, §8; `wire.md` §2.8): `POST /v2/relay/enc-key`
//! `{ad, sig}` stores a host's own valid v2 ad (else 400 `enc-key ad refused: <reason>`);
//! `GET /v2/relay/enc-key?pubkey=|host=` serves it with its signature so the asking host
//! verifies it against the *pinned* key (the relay grants nothing).
//!
//! A lookup by name resolves only when exactly one live enrolment carries the name, or exactly
//! one inside the caller's proven account; a name carried by more than [`MAX_PER_NAME`] live
//! enrolments is *crowded* and never resolves (spec §2: common names could otherwise be
//! pre-squatted; enrolment is never refused for it). An ambiguous or crowded name answers 404
//! `{error:"host name ambiguous: …", code:"AMBIGUOUS"}`; look such a host up by key.

use std::collections::HashMap;

use axum::extract::{Query, Request, State};
use axum::http::StatusCode;
use axum::Json;
use serde_json::{json, Value};

use agentmbx_protocol::keys::PublicKey;
use agentmbx_protocol::limits::RELAY_SMALL_BODY;
use agentmbx_protocol::records;
use agentmbx_protocol::wire::EncKeyAnswer;

use crate::auth::{authenticate, blocking, read_body, utf8};
use crate::error::ApiError;
use crate::state::SharedRelay;
use crate::store::{EncAdV2, Enrolment};

/// Live enrolments one name may carry before it is crowded (spec §2: "more than 16"; 0.5.x
/// `maxPerName`). Defined beside the store's name query, which reads one row more.
pub use crate::store::MAX_PER_NAME;

/// What a name lookup found (spec §2 v1 name lookups).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ByName {
    /// Exactly one host: its key.
    One(String),
    /// Several hosts carry the name (none of them alone in the caller's account), or the name
    /// is crowded.
    Ambiguous,
    /// No live host carries it.
    Unknown,
}

/// Resolves a name among its live enrolments `live` for a caller in `account` (if proven).
pub fn resolve_name(live: &[Enrolment], account: Option<&str>) -> ByName {
    if live.len() > MAX_PER_NAME {
        return ByName::Ambiguous;
    }
    if let [one] = live {
        return ByName::One(one.host_pubkey.clone());
    }
    if let Some(account) = account {
        let mine: Vec<&Enrolment> = live
            .iter()
            .filter(|e| e.account.as_deref() == Some(account))
            .collect();
        if let [one] = mine.as_slice() {
            return ByName::One(one.host_pubkey.clone());
        }
    }
    if live.is_empty() {
        ByName::Unknown
    } else {
        ByName::Ambiguous
    }
}

/// Handles `POST /v2/relay/enc-key {ad, sig}`.
pub async fn post(State(state): State<SharedRelay>, req: Request) -> Result<Json<Value>, ApiError> {
    let (parts, body) = req.into_parts();
    let body = read_body(body, RELAY_SMALL_BODY).await?;
    let raw = utf8(&body)?;
    let caller = authenticate(&state, &parts.method, &parts.uri, &parts.headers, raw).await?;
    // `{ad, sig}` read field by field, so a missing or non-string `sig` is `unsigned` and a
    // missing `ad` is `malformed`, in 0.5.x's order (`wire.md` §2.8).
    let post: Value = serde_json::from_str(raw)
        .map_err(|_| ApiError::bad_request("enc-key ad refused: malformed"))?;
    let (ad, sig) = (
        post.get("ad").cloned().unwrap_or(Value::Null),
        post.get("sig").and_then(Value::as_str),
    );
    let now = state.clock.now_ms();
    let verified = records::verify_enc_ad(&ad, sig, &caller.host_pubkey, now)
        .map_err(|why| ApiError::bad_request(format!("enc-key ad refused: {why}")))?;
    let record = agentmbx_protocol::canonical::to_string(&ad)
        .map_err(|_| ApiError::bad_request("enc-key ad refused: malformed"))?;
    let store = state.store.clone();
    let v2 = EncAdV2 {
        host_pubkey: caller.host_pubkey,
        enc_pub: verified.enc_pub,
        record,
        sig: sig.unwrap_or_default().to_owned(),
        at_ms: now,
    };
    blocking(move || store.put_enc_ad_v2(v2)).await?;
    Ok(Json(json!({"ok": true})))
}

/// Handles `GET /v2/relay/enc-key?pubkey=<b64>` or `?host=<name>` (a name resolves as
/// [`resolve_name`] says; an ambiguous or crowded one is 404 `AMBIGUOUS`). `pubkey` is looked
/// up in its canonical padded form, so the unpadded text of an enrolled key finds it; text that
/// is not a key is unknown (404).
pub async fn get(
    State(state): State<SharedRelay>,
    req: Request,
) -> Result<Json<EncKeyAnswer>, ApiError> {
    let (parts, _) = req.into_parts();
    let caller = authenticate(&state, &parts.method, &parts.uri, &parts.headers, "").await?;
    let Query(mut q) = Query::<HashMap<String, String>>::try_from_uri(&parts.uri)
        .map_err(|_| ApiError::bad_request("bad query"))?;
    let (pubkey, host) = (q.remove("pubkey"), q.remove("host"));
    let store = state.store.clone();
    let ad = blocking(move || {
        let pk = match (pubkey, host) {
            // Looked up in canonical form (what enrolment stored); not a key: unknown.
            (Some(pk), _) => PublicKey::from_b64(&pk).ok().map(|k| k.to_b64()),
            (None, Some(h)) => {
                let live = store.live_enrolments_by_name(&h)?;
                match resolve_name(&live, caller.account.as_deref()) {
                    ByName::One(pk) => Some(pk),
                    ByName::Unknown => None,
                    ByName::Ambiguous => return Ok(Err(())),
                }
            }
            _ => None,
        };
        match pk {
            Some(pk) => store.get_enc_ad(&pk).map(Ok),
            None => Ok(Ok(None)),
        }
    })
    .await?;
    let Ok(ad) = ad else {
        return Err(ApiError::new(
            StatusCode::NOT_FOUND,
            "host name ambiguous: several hosts use that name here; look the host up by key",
            "AMBIGUOUS",
        ));
    };
    let Some(ad) = ad else {
        return Err(ApiError::new(
            StatusCode::NOT_FOUND,
            "unknown host",
            "NOT_FOUND",
        ));
    };
    let (record, ad_sig) = match ad.v2 {
        Some(v2) => (serde_json::from_str::<Value>(&v2.record).ok(), Some(v2.sig)),
        None => (None, None),
    };
    Ok(Json(EncKeyAnswer {
        host: ad.host_name,
        host_pubkey: ad.host_pubkey,
        enc_pub: ad.enc_pub,
        sig: ad.v1.map(|v1| v1.sig),
        ad: record,
        ad_sig,
    }))
}
