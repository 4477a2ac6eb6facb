//! Host-key challenge enrolment (spec §2, §8; `wire.md` §3.1–§3.2): `POST /v1/relay/challenge`
//! then `POST /v1/relay/enrol`. Challenges live in memory, single use, 5-minute TTL, at most
//! 10,000 open (a restart only invalidates outstanding challenges; clients retry). The default
//! enrolment authority (host-key challenge) admits every key that proves possession.

use std::collections::HashMap;

use axum::extract::{Request, State};
use axum::http::StatusCode;
use axum::Json;
use rand::RngCore;
use serde::Deserialize;
use serde_json::{json, Value};

use agentmbx_protocol::keys::PublicKey;
use agentmbx_protocol::limits::RELAY_SMALL_BODY;
use agentmbx_protocol::records;
use agentmbx_protocol::wire::ChallengeResponse;

use crate::auth::{blocking, read_body, utf8};
use crate::error::ApiError;
use crate::server::SharedRelay;
use crate::store::{AuthorityStrength, EnrolOutcome, EnrolRequest};

/// Challenge lifetime (ms).
pub const CHALLENGE_TTL_MS: i64 = 300_000;
/// Open challenges at most.
pub const MAX_OPEN_CHALLENGES: usize = 10_000;

/// An outstanding challenge for one host key.
#[derive(Debug, Clone)]
pub struct Pending {
    challenge: String,
    expires_ms: i64,
}

/// The in-memory challenge table, keyed by host key (one pending per key; a new one replaces).
#[derive(Debug, Default)]
pub struct Challenges(std::sync::Mutex<HashMap<String, Pending>>);

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

#[derive(Deserialize)]
struct ChallengeBody {
    host: Option<Value>,
    pubkey: Option<Value>,
}

/// Handles `POST /v1/relay/challenge` `{host, pubkey}` → `{challenge}`.
pub async fn challenge(
    State(state): State<SharedRelay>,
    req: Request,
) -> Result<Json<ChallengeResponse>, ApiError> {
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
    let now = state.clock.now_ms();
    let mut raw = [0u8; 16];
    rand::rngs::OsRng.fill_bytes(&mut raw);
    let challenge = agentmbx_protocol::b64::encode_url(&raw);
    {
        let mut table = state.challenges.0.lock().map_err(|_| {
            ApiError::new(
                StatusCode::INTERNAL_SERVER_ERROR,
                "relay state poisoned",
                "INTERNAL",
            )
        })?;
        if table.len() >= MAX_OPEN_CHALLENGES {
            table.retain(|_, p| p.expires_ms > now);
        }
        if table.len() >= MAX_OPEN_CHALLENGES && !table.contains_key(&pubkey) {
            return Err(ApiError::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "too many open enrolment challenges; retry later",
                "BUSY",
            ));
        }
        table.insert(
            pubkey,
            Pending {
                challenge: challenge.clone(),
                expires_ms: now + CHALLENGE_TTL_MS,
            },
        );
    }
    Ok(Json(ChallengeResponse { challenge }))
}

#[derive(Deserialize)]
struct EnrolBody {
    host: Option<String>,
    pubkey: Option<String>,
    owner_fp: Option<String>,
    sig: Option<String>,
}

/// Handles `POST /v1/relay/enrol` `{host, pubkey, owner_fp, sig}` → `{ok:true}`.
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
    let pending = state
        .challenges
        .0
        .lock()
        .map_err(|_| {
            ApiError::new(
                StatusCode::INTERNAL_SERVER_ERROR,
                "relay state poisoned",
                "INTERNAL",
            )
        })?
        .remove(&pubkey)
        .filter(|p| p.expires_ms > now);
    let Some(pending) = pending else {
        return Err(ApiError::new(
            StatusCode::UNAUTHORIZED,
            "no pending challenge",
            "NO_CHALLENGE",
        ));
    };
    let signed = records::enrol_canonical(&pending.challenge, &host, &pubkey, &owner_fp);
    if !key.verify(signed.as_bytes(), &sig) {
        return Err(ApiError::new(
            StatusCode::UNAUTHORIZED,
            "bad enrolment signature",
            "BAD_SIGNATURE",
        ));
    }
    let store = state.store.clone();
    let req = EnrolRequest {
        host_pubkey: pubkey,
        host_name: host,
        owner_fp,
        account: None,
        authorized_by: "host-key-challenge".into(),
        strength: AuthorityStrength::HostKeyChallenge,
        now_ms: now,
    };
    match blocking(move || store.enrol(req)).await? {
        EnrolOutcome::Enrolled(_) => Ok(Json(json!({"ok": true}))),
        EnrolOutcome::Revoked => Err(ApiError::new(
            StatusCode::FORBIDDEN,
            "this host key is revoked on this relay",
            "REVOKED",
        )),
        EnrolOutcome::NameTaken => Err(ApiError::new(
            StatusCode::CONFLICT,
            "host name taken in this account",
            "NAME_TAKEN",
        )),
        EnrolOutcome::Full => Err(ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "relay enrolment capacity reached",
            "FULL",
        )),
    }
}
