//! Request plumbing shared by the handlers: the streaming body cap, the UTF-8 check and the v2
//! signed-hop authentication (`wire.md` §2.6 and "Resolved details": hop checks order).
//!
//! Bodies are read under a cap while streaming ([`agentmbx_net::body`]); an oversized one is
//! drained (discarded) for up to 2 s and answered 413 `{error:"request body too large"}`
//! (`wire.md` §3.1).
//!
//! Order: a body that is not valid UTF-8 → 400 before any signature check; then the headers;
//! a `ts` that is not plain decimal digits → 401; the key in `x-mbx-key` (which alone names the
//! caller; `x-mbx-host` is a label) must parse → else 401; the signature by that key over
//! method, normalised path with query, ts and raw body, within ±300,000 ms → else 401; only
//! then is the enrolment looked up: unknown → 401 `NOT_ENROLLED`, revoked → 403 `REVOKED`,
//! deny-listed fingerprint → 403 `DENIED`; on a relay with the account authority the
//! `Authorization: Bearer` token is checked last (spec §8; [`crate::authority`]). So whether a
//! key is enrolled, revoked or denied is told only to a request that key signed.
//!
//! Every refusal of the caller (each 401 above, and the 403s `REVOKED` and `DENIED`; not a
//! signed info that fails a check, which is answered 200 without `you`) is counted by reason in [`RelayState::refused`] and logged at DEBUG with the method, the path
//! and at most the key's fingerprint prefix ([`crate::refusals`]).
//!
//! Signed `GET /v2/relay/info` is the one exception to "every hop carries the token"
//! ([`authenticate_info`]): a host sends its first signed info of a pass without the token,
//! because it must see the relay's key before it hands the token to anyone. Without a bearer
//! the info still counts as the host's when the key was enrolled with an account token (a
//! binding is recorded); a bearer that is present is checked in full. Info reveals only the
//! caller's own queue position and ad, and every other request still needs the token.
//!
//! A hop that passed every check is fed, with its unsigned `x-mbx-instance` header, into the
//! relay's record of daemon instances per host key ([`crate::instances`]); that header is
//! trusted for nothing else.

use std::collections::HashMap;
use std::sync::{Mutex, OnceLock};

use axum::body::{Body, Bytes};
use axum::http::{HeaderMap, Method, StatusCode, Uri};

use agentmbx_net::body::{read_capped, BodyError};
use agentmbx_protocol::hop::{self, header, HopError};
use agentmbx_protocol::keys::PublicKey;

use crate::error::ApiError;
use crate::refusals::AuthRefusal;
use crate::state::RelayState;
use crate::store::Enrolment;

/// Keys the parse memo holds before it is emptied (each entry about 250 bytes).
const KEY_MEMO_MAX: usize = 2_048;

/// [`PublicKey::from_b64`] with a memo of the keys that parsed, by their exact text. Parsing
/// decompresses the Ed25519 point (about 6 µs); a relay sees the same few keys on every hop
/// and as the targets of every push. A text that does not parse is not remembered, and the
/// memo is emptied when full, so it stays small whatever callers send. `None` for a text that
/// is not an Ed25519 key ([`PublicKey::from_b64`]'s refusals).
pub fn parse_key(text: &str) -> Option<PublicKey> {
    static MEMO: OnceLock<Mutex<HashMap<String, PublicKey>>> = OnceLock::new();
    let memo = MEMO.get_or_init(|| Mutex::new(HashMap::new()));
    let lock = || {
        memo.lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    };
    if let Some(key) = lock().get(text) {
        return Some(*key);
    }
    let key = PublicKey::from_b64(text).ok()?;
    let mut known = lock();
    if known.len() >= KEY_MEMO_MAX {
        known.clear();
    }
    known.insert(text.to_owned(), key);
    Some(key)
}

/// Reads the body, refusing more than `cap` bytes while streaming
/// ([`agentmbx_net::body::read_capped`]): a declared length over the cap, or a body that grows
/// past it, keeps nothing more and is discarded for up to [`agentmbx_net::body::DRAIN_FOR`],
/// then answered 413. A body that breaks off is 400.
///
/// Memory grows with the bytes that actually arrived, never with the declared length: the
/// request is not authenticated yet, so a `content-length` costs the sender nothing.
pub async fn read_body(body: Body, cap: usize) -> Result<Bytes, ApiError> {
    match read_capped(body, cap).await {
        Ok(buf) => Ok(Bytes::from(buf)),
        Err(BodyError::TooLarge) => Err(ApiError::too_large()),
        Err(BodyError::Broken) => Err(ApiError::bad_request("request body could not be read")),
    }
}

/// The body as UTF-8 text, else 400 (`wire.md` "Resolved details": raw body).
pub fn utf8(body: &Bytes) -> Result<&str, ApiError> {
    std::str::from_utf8(body).map_err(|_| ApiError::bad_request("request body is not valid UTF-8"))
}

fn header_str<'a>(headers: &'a HeaderMap, name: &'static str) -> Result<&'a str, ApiError> {
    headers
        .get(name)
        .and_then(|v| v.to_str().ok())
        .ok_or_else(ApiError::bad_hop)
}

/// The normalised request target the hop signs (path + query).
pub fn signed_target(uri: &Uri) -> String {
    hop::normalize_target(uri.path_and_query().map_or(uri.path(), |pq| pq.as_str()))
}

/// Whether a hop must carry the account token (on a relay whose authority wants one).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum TokenRule {
    /// Every request but signed info.
    Required,
    /// Signed info: checked when present; when absent the key must have an account binding.
    IfPresent,
}

/// Authenticates a v2 hop and returns the caller's live enrolment. The signature and its time
/// window are checked before the store is asked anything (module docs: order).
pub async fn authenticate(
    state: &RelayState,
    method: &Method,
    uri: &Uri,
    headers: &HeaderMap,
    raw_body: &str,
) -> Result<Enrolment, ApiError> {
    authenticate_as(state, method, uri, headers, raw_body, TokenRule::Required)
        .await
        .map(|(enrolment, _)| enrolment)
}

/// [`authenticate`] for the push stream's upgrade (`GET /v2/relay/stream`, an empty body):
/// the same checks and refusals, and on an account relay also the verified token, whose `exp`
/// bounds the stream and whose `client_id` a deny entry may name.
pub async fn authenticate_stream(
    state: &RelayState,
    method: &Method,
    uri: &Uri,
    headers: &HeaderMap,
) -> Result<(Enrolment, Option<crate::authority::HopToken>), ApiError> {
    authenticate_as(state, method, uri, headers, "", TokenRule::Required).await
}

/// [`authenticate`] for signed `GET /v2/relay/info`: on an account relay a hop without
/// `Authorization` is still the caller's when its key was enrolled with an account token
/// (module docs); a bearer that is present must pass every check. A hop that fails a check is
/// not a refusal (info answers 200 all the same, without `you`): it is not counted in
/// [`RelayState::refused`], only logged at DEBUG with its reason.
pub async fn authenticate_info(
    state: &RelayState,
    method: &Method,
    uri: &Uri,
    headers: &HeaderMap,
) -> Result<Enrolment, ApiError> {
    check_hop(state, method, uri, headers, "", TokenRule::IfPresent)
        .await
        .map(|(enrolment, _)| enrolment)
        .map_err(|Refused { reason, error, .. }| {
            if let Some(reason) = reason {
                tracing::debug!(
                    reason = reason.key(),
                    "signed relay info answered without `you`"
                );
            }
            error
        })
}

async fn authenticate_as(
    state: &RelayState,
    method: &Method,
    uri: &Uri,
    headers: &HeaderMap,
    raw_body: &str,
    rule: TokenRule,
) -> Result<(Enrolment, Option<crate::authority::HopToken>), ApiError> {
    match check_hop(state, method, uri, headers, raw_body, rule).await {
        Ok(found) => Ok(found),
        Err(Refused {
            reason,
            key_fp,
            error,
        }) => {
            if let Some(reason) = reason {
                state
                    .refused
                    .auth(reason, method.as_str(), uri.path(), key_fp.as_deref());
            }
            Err(error)
        }
    }
}

/// A hop [`check_hop`] refused: the answer, and for a refusal of the caller (not a store or
/// authority fault) its reason and the caller's key fingerprint when the key parsed, for the
/// counters and the DEBUG line ([`crate::refusals`]).
struct Refused {
    reason: Option<AuthRefusal>,
    key_fp: Option<String>,
    error: ApiError,
}

impl From<ApiError> for Refused {
    /// A fault that is not the caller's (a store error): not counted.
    fn from(error: ApiError) -> Self {
        Refused {
            reason: None,
            key_fp: None,
            error,
        }
    }
}

impl Refused {
    fn new(reason: AuthRefusal, key_fp: Option<&str>, error: ApiError) -> Self {
        Refused {
            reason: Some(reason),
            key_fp: key_fp.map(str::to_owned),
            error,
        }
    }
}

/// The hop checks in the order of the module docs; every refusal carries its reason.
async fn check_hop(
    state: &RelayState,
    method: &Method,
    uri: &Uri,
    headers: &HeaderMap,
    raw_body: &str,
    rule: TokenRule,
) -> Result<(Enrolment, Option<crate::authority::HopToken>), Refused> {
    let missing = |_| Refused::new(AuthRefusal::MissingHeader, None, ApiError::bad_hop());
    let key_text = header_str(headers, header::KEY).map_err(missing)?;
    let ts = header_str(headers, header::TS).map_err(missing)?;
    let sig = header_str(headers, header::SIG).map_err(missing)?;
    hop::parse_relay_ts(ts)
        .map_err(|_| Refused::new(AuthRefusal::BadTimestamp, None, ApiError::bad_hop()))?;
    let key = parse_key(key_text)
        .ok_or_else(|| Refused::new(AuthRefusal::BadKey, None, ApiError::bad_hop()))?;
    let fp = key.fingerprint();
    let target = signed_target(uri);
    match hop::verify_relay_hop(
        &key,
        method.as_str(),
        &target,
        ts,
        raw_body,
        sig,
        state.clock.now_ms(),
    ) {
        Ok(()) => {}
        Err(HopError::Stale) => {
            return Err(Refused::new(
                AuthRefusal::StaleTimestamp,
                Some(&fp),
                ApiError::new(
                    StatusCode::UNAUTHORIZED,
                    "stale or bad hop timestamp (check clocks)",
                    "BAD_HOP",
                ),
            ))
        }
        Err(HopError::BadTimestamp | HopError::Missing(_)) => {
            return Err(Refused::new(
                AuthRefusal::BadTimestamp,
                Some(&fp),
                ApiError::bad_hop(),
            ))
        }
        Err(HopError::BadSignature) => {
            return Err(Refused::new(
                AuthRefusal::BadSignature,
                Some(&fp),
                ApiError::bad_hop(),
            ))
        }
    }
    // Looked up by the canonical text enrolment stored, whatever padding the header used.
    let store = state.store.clone();
    let k = key.to_b64();
    let now = state.clock.now_ms();
    // Two point reads by key, run right here: they take microseconds in WAL mode, far less
    // than handing them to a blocking thread and waking this task again (measured on the
    // reference machine: `GET /v2/relay/info` cost the relay 88–108 µs of CPU with its one
    // read on a blocking thread, 45 µs with the read here; the difference is thread wake-ups).
    let (enrolment, host_denied) = (
        store.enrolment(&k).map_err(ApiError::from)?,
        store.denied(&fp, None, now).map_err(ApiError::from)?,
    );
    let Some(enrolment) = enrolment else {
        return Err(Refused::new(
            AuthRefusal::NotEnrolled,
            Some(&fp),
            ApiError::new(StatusCode::UNAUTHORIZED, "not enrolled", "NOT_ENROLLED"),
        ));
    };
    if enrolment.is_revoked() {
        return Err(Refused::new(
            AuthRefusal::Revoked,
            Some(&fp),
            ApiError::new(
                StatusCode::FORBIDDEN,
                "this host key is revoked on this relay",
                "REVOKED",
            ),
        ));
    }
    if host_denied.is_some() {
        return Err(Refused::new(
            AuthRefusal::Denied,
            Some(&fp),
            crate::error::denied(crate::error::DENY_LISTED),
        ));
    }
    let token = check_account_token(state, headers, &key, &enrolment, now, rule)
        .await
        .map_err(|error| Refused {
            reason: token_refusal(&error),
            key_fp: Some(fp),
            error,
        })?;
    // Only a hop that passed every check counts for the instance record (advisory).
    state.instances.observe(&key, &enrolment.host_name, headers);
    Ok((enrolment, token))
}

/// The reason of a refusal by [`check_account_token`], from its code; `None` for the faults
/// that are not the caller's (503 `AUTHORITY_UNAVAILABLE`, a store error).
fn token_refusal(e: &ApiError) -> Option<AuthRefusal> {
    match e.body.code.as_str() {
        "TOKEN_REQUIRED" => Some(AuthRefusal::TokenRequired),
        "BAD_TOKEN" => Some(AuthRefusal::BadToken),
        "NOT_ENROLLED" => Some(AuthRefusal::NoAccountBinding),
        "DENIED" => Some(AuthRefusal::Denied),
        _ => None,
    }
}

/// The token of `Authorization: Bearer <token>` (scheme case-insensitive); `Ok(None)` without
/// the header, 401 for another scheme or a header that is not text.
fn bearer(headers: &HeaderMap) -> Result<Option<&str>, ApiError> {
    let Some(value) = headers.get(axum::http::header::AUTHORIZATION) else {
        return Ok(None);
    };
    let bad = || {
        ApiError::new(
            StatusCode::UNAUTHORIZED,
            "the Authorization header must be Bearer <token>",
            "BAD_TOKEN",
        )
    };
    let text = value.to_str().map_err(|_| bad())?;
    match text.split_once(' ') {
        Some((scheme, token))
            if scheme.eq_ignore_ascii_case("bearer") && !token.trim().is_empty() =>
        {
            Ok(Some(token.trim()))
        }
        _ => Err(bad()),
    }
}

/// On a relay whose authority wants hop tokens (the account authority): the bearer token must
/// verify ([`crate::authority::EnrolmentAuthority::check_hop`]), be bound to the cloud key the
/// enrolment recorded for this hop key, carry the client_id and name the account recorded at
/// enrolment, and its client_id must not be deny-listed. Refusals: 401 `TOKEN_REQUIRED` /
/// `BAD_TOKEN`, 401 `NOT_ENROLLED` when the key was enrolled without an account token (the host
/// enrols again), 403 `DENIED`, 503 `AUTHORITY_UNAVAILABLE` when the issuer's keys were never
/// fetched. Under [`TokenRule::IfPresent`] (signed info) a hop without `Authorization` needs
/// only the recorded binding. Returns the verified token, when one was checked.
async fn check_account_token(
    state: &RelayState,
    headers: &HeaderMap,
    key: &PublicKey,
    enrolment: &Enrolment,
    now: i64,
    rule: TokenRule,
) -> Result<Option<crate::authority::HopToken>, ApiError> {
    use crate::authority::HopTokenError;
    if !state.authority.wants_hop_token() {
        return Ok(None);
    }
    let presented = bearer(headers)?;
    if presented.is_none() && rule == TokenRule::IfPresent {
        let store = state.store.clone();
        let k = enrolment.host_pubkey.clone();
        return match blocking(move || store.account_binding(&k)).await? {
            Some(_) => Ok(None),
            None => Err(ApiError::new(
                StatusCode::UNAUTHORIZED,
                "not enrolled with an account token on this relay",
                "NOT_ENROLLED",
            )),
        };
    }
    let token = match state.authority.check_hop(presented, key).await {
        Ok(None) => return Ok(None),
        Ok(Some(t)) => t,
        Err(e @ HopTokenError::Missing) => {
            return Err(ApiError::new(
                StatusCode::UNAUTHORIZED,
                e.to_string(),
                "TOKEN_REQUIRED",
            ))
        }
        Err(e @ HopTokenError::Refused(_)) => {
            return Err(ApiError::new(
                StatusCode::UNAUTHORIZED,
                e.to_string(),
                "BAD_TOKEN",
            ))
        }
        Err(HopTokenError::Unavailable) => return Err(crate::error::authority_unavailable()),
    };
    let store = state.store.clone();
    let (k, fp, client) = (
        enrolment.host_pubkey.clone(),
        key.fingerprint(),
        token.client_id.clone(),
    );
    let (binding, client_denied) = blocking(move || {
        Ok((
            store.account_binding(&k)?,
            store.denied(&fp, Some(&client), now)?,
        ))
    })
    .await?;
    if client_denied.is_some() {
        return Err(crate::error::denied(crate::error::DENY_LISTED));
    }
    let Some(binding) = binding else {
        return Err(ApiError::new(
            StatusCode::UNAUTHORIZED,
            "not enrolled with an account token on this relay",
            "NOT_ENROLLED",
        ));
    };
    if binding.cloud_jkt != token.cnf_jkt {
        return Err(ApiError::new(
            StatusCode::UNAUTHORIZED,
            "account token refused: it is bound to another key",
            "BAD_TOKEN",
        ));
    }
    if binding.client_id != token.client_id {
        return Err(ApiError::new(
            StatusCode::UNAUTHORIZED,
            "account token refused: it is for another client",
            "BAD_TOKEN",
        ));
    }
    if enrolment.account.as_deref() != Some(token.account.as_str()) {
        return Err(ApiError::new(
            StatusCode::UNAUTHORIZED,
            "account token refused: it is for another account",
            "BAD_TOKEN",
        ));
    }
    Ok(Some(token))
}

/// Runs a blocking store call off the async runtime.
pub async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> Result<T, crate::store::StoreError> + Send + 'static,
) -> Result<T, ApiError> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|_| {
            ApiError::new(
                StatusCode::INTERNAL_SERVER_ERROR,
                "relay task failed",
                "INTERNAL",
            )
        })?
        .map_err(ApiError::from)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parse_key_agrees_with_from_b64_and_stays_bounded() {
        use agentmbx_protocol::keys::HostKey;
        let keys: Vec<String> = (0..KEY_MEMO_MAX + 10)
            .map(|_| HostKey::generate().public().to_b64())
            .collect();
        for k in &keys {
            assert_eq!(parse_key(k), PublicKey::from_b64(k).ok());
            assert_eq!(
                parse_key(k).map(|p| p.to_b64()).as_deref(),
                Some(k.as_str())
            );
        }
        // Past the bound the memo starts over; every key still parses.
        assert_eq!(
            parse_key(&keys[0]).map(|p| p.to_b64()),
            Some(keys[0].clone())
        );
        // Not base64, the wrong length, a small-order point: refused every time.
        let small_order = agentmbx_protocol::b64::encode(&[0u8; 32]);
        for bad in ["", "not a key", "AAAA", small_order.as_str()] {
            assert!(PublicKey::from_b64(bad).is_err());
            assert_eq!(parse_key(bad), None, "{bad:?}");
            assert_eq!(parse_key(bad), None, "{bad:?} again");
        }
    }
}
