//! Enrolment (spec §2, §8; `wire.md` §3.1–§3.2): `POST /v1/relay/challenge` then `POST
//! /v1/relay/enrol`.
//!
//! Order of checks at enrol: the body (400), the pending challenge (401 NO_CHALLENGE) and the
//! host key's signature over it (401 BAD_SIGNATURE) — the possession proof,
//! [`crate::authority::challenge`]; the challenge is used up (single use) only once that
//! signature verified, so a junk signature cannot burn a host's challenge. Then the deny-list by
//! host fingerprint (403 DENIED); then the configured [`crate::authority::EnrolmentAuthority`]
//! with the body's `proof` and the challenge (403 DENIED with its reason; an authority that
//! fails answers 503 `AUTHORITY_UNAVAILABLE` with `Retry-After`); then the deny-list by the
//! token's client_id (403 DENIED); then the store (403 REVOKED, 409 NAME_TAKEN, 409
//! CLOUD_KEY_TAKEN, 503 FULL), which records the enrolment with the authority's account,
//! `authorized_by` and strength — and, for the account authority, the token binding — in one
//! transaction. `{ok:true}` is sent only after that commit.

use axum::extract::{Request, State};
use axum::http::StatusCode;
use axum::Json;
use serde::Deserialize;
use serde_json::{json, Value};

use agentmbx_protocol::keys::PublicKey;
use agentmbx_protocol::limits::RELAY_SMALL_BODY;
use agentmbx_protocol::records;
use agentmbx_protocol::wire::ChallengeResponse;

use crate::auth::{blocking, read_body, utf8};
use crate::authority::challenge::ChallengeError;
use crate::authority::AuthorizeRequest;
use crate::error::ApiError;
use crate::refusals::AuthRefusal;
use crate::state::SharedRelay;
use crate::store::{AccountBinding, EnrolOutcome, EnrolRequest};

pub use crate::authority::challenge::{Challenges, CHALLENGE_TTL_MS, MAX_OPEN_CHALLENGES};

/// HOST_RE for relay enrolment: `^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$`.
pub fn is_host_name(host: &str) -> bool {
    let b = host.as_bytes();
    !b.is_empty()
        && b.len() <= 63
        && b[0].is_ascii_alphanumeric()
        && b.iter()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, b'.' | b'_' | b'-'))
}

fn owner_fp_ok(fp: &str) -> bool {
    fp.len() <= 64
        && fp
            .bytes()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, b'-' | b':' | b'_'))
}

/// The host key of a challenge or enrolment: an Ed25519 key written in its one canonical form,
/// padded standard base64 (`PublicKey::to_b64`), else 400 `bad host key`. Every table is keyed
/// by that text, so an alias (unpadded, which the lenient decoder would read as the same key)
/// is refused rather than becoming a second enrolment the hop lookup can never find, or a way
/// around a revocation.
fn canonical_host_key(text: &str) -> Result<PublicKey, ApiError> {
    match PublicKey::from_b64(text) {
        Ok(key) if key.to_b64() == text => Ok(key),
        _ => Err(ApiError::bad_request("bad host key")),
    }
}

fn poisoned() -> ApiError {
    ApiError::new(
        StatusCode::INTERNAL_SERVER_ERROR,
        "relay state poisoned",
        "INTERNAL",
    )
}

/// The refusals enrolment shares with hop authentication ([`crate::auth`]) and rotation; they
/// live in [`crate::error`], below both.
pub use crate::error::{authority_unavailable, denied, DENY_LISTED};

#[derive(Deserialize)]
struct ChallengeBody {
    host: Option<Value>,
    pubkey: Option<Value>,
}

/// Handles `POST /v1/relay/challenge` `{host, pubkey}` → `{challenge}`; 503 `BUSY` with
/// `Retry-After` when the challenge table is full or the client address
/// ([`crate::ratelimit::client_address`]) holds
/// [`MAX_CHALLENGES_PER_ADDRESS`](crate::authority::challenge::MAX_CHALLENGES_PER_ADDRESS)
/// open challenges.
pub async fn challenge(
    State(state): State<SharedRelay>,
    req: Request,
) -> Result<Json<ChallengeResponse>, ApiError> {
    let socket = req
        .extensions()
        .get::<axum::extract::ConnectInfo<std::net::SocketAddr>>()
        .map(|c| c.0);
    let address = crate::ratelimit::client_address(req.headers(), socket, state.rates.trust_proxy);
    let body = read_body(req.into_body(), RELAY_SMALL_BODY).await?;
    let b: ChallengeBody = serde_json::from_str(utf8(&body)?)
        .map_err(|_| ApiError::bad_request("missing host or pubkey"))?;
    let (Some(Value::String(host)), Some(Value::String(pubkey))) = (b.host, b.pubkey) else {
        return Err(ApiError::bad_request("missing host or pubkey"));
    };
    if !is_host_name(&host) {
        return Err(ApiError::bad_request("bad host name"));
    }
    canonical_host_key(&pubkey)?;
    let challenge = state
        .challenges
        .issue(&pubkey, &address, state.clock.now_ms())
        .map_err(|e| match e {
            ChallengeError::Busy { retry_after_ms }
            | ChallengeError::AddressBusy { retry_after_ms } => {
                let now = state.clock.now_ms();
                if matches!(e, ChallengeError::Busy { .. })
                    && state.rates.warn_gate.warn("challenge-table", now)
                {
                    tracing::warn!("the enrolment challenge table is full: answering 503 BUSY");
                } else {
                    tracing::debug!(client = %address, error = %e, "challenge refused: 503 BUSY");
                }
                let secs = u64::try_from(retry_after_ms.max(1))
                    .unwrap_or(1)
                    .div_ceil(1_000);
                ApiError::new(StatusCode::SERVICE_UNAVAILABLE, e.to_string(), "BUSY")
                    .with_retry_after(secs)
            }
            ChallengeError::Poisoned => poisoned(),
        })?;
    Ok(Json(ChallengeResponse { challenge }))
}

#[derive(Deserialize)]
struct EnrolBody {
    host: Option<String>,
    pubkey: Option<String>,
    owner_fp: Option<String>,
    sig: Option<String>,
    #[serde(default)]
    proof: Option<Value>,
}

/// Handles `POST /v1/relay/enrol` `{host, pubkey, owner_fp, sig, proof?}` → `{ok:true}` (module
/// docs: the order of checks).
pub async fn enrol(
    State(state): State<SharedRelay>,
    req: Request,
) -> Result<Json<Value>, ApiError> {
    let body = read_body(req.into_body(), RELAY_SMALL_BODY).await?;
    let b: EnrolBody = serde_json::from_str(utf8(&body)?).map_err(|_| {
        ApiError::new(
            StatusCode::BAD_REQUEST,
            "incomplete enrolment",
            "BAD_REQUEST",
        )
    })?;
    let (Some(host), Some(pubkey), Some(sig)) = (b.host, b.pubkey, b.sig) else {
        return Err(ApiError::new(
            StatusCode::BAD_REQUEST,
            "incomplete enrolment",
            "BAD_REQUEST",
        ));
    };
    let owner_fp = b.owner_fp.unwrap_or_default();
    if !is_host_name(&host) || !owner_fp_ok(&owner_fp) {
        return Err(ApiError::bad_request("bad host name or owner_fp"));
    }
    let key = canonical_host_key(&pubkey)?;
    let now = state.clock.now_ms();
    let refused = |reason: AuthRefusal, error: ApiError| {
        state
            .refused
            .auth(reason, "POST", "/v1/relay/enrol", Some(&key.fingerprint()));
        error
    };
    let no_challenge = || {
        ApiError::new(
            StatusCode::UNAUTHORIZED,
            "no pending challenge",
            "NO_CHALLENGE",
        )
    };
    let Some(challenge) = state
        .challenges
        .pending(&pubkey, now)
        .map_err(|_| poisoned())?
    else {
        return Err(refused(AuthRefusal::NoChallenge, no_challenge()));
    };
    let signed = records::enrol_canonical(&challenge, &host, &pubkey, &owner_fp);
    if !key.verify(signed.as_bytes(), &sig) {
        // The challenge stays pending: only its key's signature may use it up.
        return Err(refused(
            AuthRefusal::BadEnrolSignature,
            ApiError::new(
                StatusCode::UNAUTHORIZED,
                "bad enrolment signature",
                "BAD_SIGNATURE",
            ),
        ));
    }
    // Single use: a concurrent enrolment that verified the same challenge first wins.
    if !state
        .challenges
        .consume(&pubkey, &challenge, now)
        .map_err(|_| poisoned())?
    {
        return Err(refused(AuthRefusal::NoChallenge, no_challenge()));
    }
    // The deny-list by host fingerprint, before the authority is asked anything.
    let fp = key.fingerprint();
    {
        let (store, fp1) = (state.store.clone(), fp.clone());
        if blocking(move || store.denied(&fp1, None, now))
            .await?
            .is_some()
        {
            tracing::info!(host_fingerprint = %fp, "enrolment refused: deny-listed host");
            return Err(refused(AuthRefusal::Denied, denied(DENY_LISTED)));
        }
    }
    let ask = AuthorizeRequest {
        host_name: host.clone(),
        host_pubkey: pubkey.clone(),
        owner_fp: owner_fp.clone(),
        challenge,
        proof: b.proof,
    };
    let authority = state.authority.clone();
    let answer = match authority.authorize(&ask).await {
        Ok(a) => a,
        Err(e) => {
            tracing::warn!(authority = authority.name(), error = %e, "enrolment authority failed; enrolment refused for now (503)");
            return Err(authority_unavailable());
        }
    };
    if !answer.ok {
        let reason = answer
            .reason
            .unwrap_or_else(|| "enrolment denied by the enrolment authority".to_owned());
        tracing::info!(host_fingerprint = %fp, reason = %reason, "enrolment denied by the authority");
        return Err(refused(AuthRefusal::AuthorityDenied, denied(reason)));
    }
    if let Some(b) = &answer.binding {
        let (store, fp2, client) = (state.store.clone(), fp.clone(), b.client_id.clone());
        if blocking(move || store.denied(&fp2, Some(&client), now))
            .await?
            .is_some()
        {
            tracing::info!(host_fingerprint = %fp, "enrolment refused: deny-listed client");
            return Err(refused(AuthRefusal::Denied, denied(DENY_LISTED)));
        }
    }
    let binding = answer.binding.map(|b| AccountBinding {
        host_pubkey: pubkey.clone(),
        cloud_jkt: b.cloud_jkt,
        client_id: b.client_id,
        sub: b.sub,
        org: answer.org.clone(),
        at_ms: now,
    });
    let store = state.store.clone();
    let req = EnrolRequest {
        host_pubkey: pubkey,
        host_name: host,
        owner_fp,
        account: answer.account,
        authorized_by: authority.name().to_owned(),
        strength: authority.strength(),
        now_ms: now,
    };
    match blocking(move || store.enrol_bound(req, binding)).await? {
        EnrolOutcome::Enrolled(_) => Ok(Json(json!({"ok": true}))),
        EnrolOutcome::Revoked => Err(refused(
            AuthRefusal::Revoked,
            ApiError::new(
                StatusCode::FORBIDDEN,
                "this host key is revoked on this relay",
                "REVOKED",
            ),
        )),
        EnrolOutcome::NameTaken => Err(ApiError::new(
            StatusCode::CONFLICT,
            "host name taken in this account",
            "NAME_TAKEN",
        )),
        EnrolOutcome::CloudKeyTaken => Err(ApiError::new(
            StatusCode::CONFLICT,
            "this cloud key is bound to another live host key on this relay",
            "CLOUD_KEY_TAKEN",
        )),
        EnrolOutcome::Full => Err(ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "relay enrolment capacity reached",
            "FULL",
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::response::IntoResponse;

    #[test]
    fn an_unavailable_authority_is_503_with_retry_after() {
        let e = authority_unavailable();
        assert_eq!(e.status, StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(e.body.code, "AUTHORITY_UNAVAILABLE");
        assert_eq!(e.body.retry_after, Some(60));
        let resp = e.into_response();
        assert_eq!(
            resp.headers()
                .get(axum::http::header::RETRY_AFTER)
                .and_then(|v| v.to_str().ok()),
            Some("60")
        );
    }
}
