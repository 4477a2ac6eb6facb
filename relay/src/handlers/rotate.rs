//! `POST /v2/relay/rotate {rotation}` (spec §2 "Rotation"; `wire.md` §2.10, §3.1, §3.2): a host
//! moves its enrolment, queue and allowlists from its old key to its new one.
//!
//! Self-authenticating: no hop is required (a rotated host already signs hops with its new
//! key), because the record `{rec, old_sig, new_sig}` is signed by both keys. It is
//! rate-limited per client address with challenge and enrol ([`crate::ratelimit`]) and its
//! body is at most 8,192 bytes.
//!
//! Order of checks (0.5.x's): a body whose `rotation` is not an object is 400 `BAD_ROTATION`;
//! the old key must be enrolled and live, else 404 `NOT_ENROLLED`; the record must check
//! against it ([`SignedRotation::check`](agentmbx_protocol::rotation::SignedRotation::check))
//! and be dated at most 5 minutes ahead of the relay's clock
//! ([`SignedRotation::check_time`](agentmbx_protocol::rotation::SignedRotation::check_time)),
//! else 400 `BAD_ROTATION` with the reason; it must name the old enrolment's host, else 400
//! `BAD_ROTATION` `rotation names another host`; neither key may be deny-listed — by host
//! fingerprint, or the old key by the `client_id` of its account binding — else 403 `DENIED`
//! (spec §8: a denied host must not escape its entry by moving to a key the deny-list does not
//! name); the new key must not be revoked, else 409 `ROTATION_TARGET`. Then the store applies it in
//! one transaction ([`DirectoryStore::rotate`](crate::store::DirectoryStore::rotate)), which also
//! copies the old fingerprint's active deny entries to the new one (closing the window between this
//! check and the transaction), and `{moved:n}` is answered.
//!
//! Repeating a rotation that was already applied (the host did not see the answer) answers
//! 200 `{moved:0, already_rotated:true}`: the record still checks against the old key and the
//! store remembers that this old key was rotated to this new key, so the host stops resending
//! it. Any other record for a revoked key is 404 `NOT_ENROLLED`.

use axum::extract::{Request, State};
use axum::http::StatusCode;
use axum::Json;
use serde_json::{json, Value};

use agentmbx_protocol::keys::PublicKey;
use agentmbx_protocol::limits::RELAY_SMALL_BODY;
use agentmbx_protocol::rotation::SignedRotation;

use crate::auth::{blocking, read_body, utf8};
use crate::error::ApiError;
use crate::state::SharedRelay;
use crate::store::{RotateOutcome, RotateRequest};

fn not_enrolled() -> ApiError {
    ApiError::new(
        StatusCode::NOT_FOUND,
        "the rotated key is not enrolled here",
        "NOT_ENROLLED",
    )
}

fn bad_rotation(why: &str) -> ApiError {
    ApiError::new(StatusCode::BAD_REQUEST, why, "BAD_ROTATION")
}

fn rotation_target(why: &str) -> ApiError {
    ApiError::new(StatusCode::CONFLICT, why, "ROTATION_TARGET")
}

/// Handles `POST /v2/relay/rotate`.
pub async fn post(State(state): State<SharedRelay>, req: Request) -> Result<Json<Value>, ApiError> {
    let body = read_body(req.into_body(), RELAY_SMALL_BODY).await?;
    let raw = utf8(&body)?;
    let post: Value =
        serde_json::from_str(raw).map_err(|_| bad_rotation("not a rotation record"))?;
    let Some(record) = post.get("rotation").filter(|r| r.is_object()) else {
        return Err(bad_rotation("not a rotation record"));
    };
    // The old key first: an unknown key is 404 whatever the rest of the record says.
    let old_key = record
        .get("rec")
        .and_then(|r| r.get("old_pub"))
        .and_then(Value::as_str)
        .and_then(|k| PublicKey::from_b64(k).ok())
        .ok_or_else(not_enrolled)?;
    let old_text = old_key.to_b64();
    let store = state.store.clone();
    let lookup = old_text.clone();
    let Some(old) = blocking(move || store.enrolment(&lookup)).await? else {
        return Err(not_enrolled());
    };
    let now = state.clock.now_ms();
    let checked = SignedRotation::from_value(record).and_then(|r| {
        r.check(&old_key)?;
        r.check_time(now)?;
        Ok(r)
    });
    let rotation = match checked {
        Ok(r) => r,
        // A revoked key is not enrolled, whatever it signs now.
        Err(_) if old.is_revoked() => return Err(not_enrolled()),
        Err(why) => return Err(bad_rotation(&why.to_string())),
    };
    let new_key = rotation
        .new_key()
        .map_err(|why| bad_rotation(&why.to_string()))?;
    // Only a request both keys signed learns that a key is denied.
    let (old_fp, new_fp) = (old_key.fingerprint(), new_key.fingerprint());
    let (store, lookup, fps) = (
        state.store.clone(),
        old_text.clone(),
        (old_fp.clone(), new_fp.clone()),
    );
    let deny = blocking(move || {
        let client = store.account_binding(&lookup)?.map(|b| b.client_id);
        match store.denied(&fps.0, client.as_deref(), now)? {
            Some(entry) => Ok(Some(entry)),
            None => store.denied(&fps.1, None, now),
        }
    })
    .await?;
    if let Some(entry) = deny {
        tracing::info!(
            old = %old_fp,
            new = %new_fp,
            kind = entry.kind.as_str(),
            "rotation refused: deny-listed host"
        );
        return Err(crate::handlers::enrol::denied(
            crate::handlers::enrol::DENY_LISTED,
        ));
    }
    let req = RotateRequest {
        old_pubkey: old_text,
        new_pubkey: new_key.to_b64(),
        host_name: rotation.rec.host.clone(),
        now_ms: now,
    };
    let store = state.store.clone();
    let old_pubkey = req.old_pubkey.clone();
    let streams = state.streams.clone();
    let outcome = blocking(move || {
        let outcome = store.rotate(req)?;
        if let RotateOutcome::Rotated { .. } = outcome {
            // Committed: the old key's push stream closes (4403); the host opens one with its
            // new key. Here, on the blocking thread, so that it happens even when this request
            // is dropped meanwhile.
            streams.close_key(&old_pubkey, agentmbx_protocol::stream::close::AUTH);
        }
        Ok(outcome)
    })
    .await?;
    match outcome {
        RotateOutcome::Rotated { moved } => {
            tracing::info!(
                old = %old_key.fingerprint(),
                new = %new_key.fingerprint(),
                moved,
                "host key rotated: queue, name and allowlists moved to the new key"
            );
            Ok(Json(json!({ "moved": moved })))
        }
        RotateOutcome::AlreadyRotated => Ok(Json(json!({ "moved": 0, "already_rotated": true }))),
        RotateOutcome::NotEnrolled => Err(not_enrolled()),
        RotateOutcome::OtherHost => Err(bad_rotation("rotation names another host")),
        RotateOutcome::TargetRevoked => {
            Err(rotation_target("the new host key is revoked on this relay"))
        }
        RotateOutcome::TargetNameTaken => Err(rotation_target(
            "the new host key's account already has another host of this name",
        )),
    }
}
