//! `GET /v2/relay/stream?nonce=` (`docs/relay-stream.md` "Opening it"): the push stream's
//! WebSocket upgrade (RFC 6455).
//!
//! Order: the signed hop exactly as for a pull (same refusals: 401 `BAD_HOP`, 401
//! `NOT_ENROLLED`, 403 `REVOKED`, 403 `DENIED`, the account token on an account relay), then
//! the upgrade headers (missing or wrong: 400 or 426 `NOT_UPGRADE`; the nonce is not spent),
//! then the single-use nonce of the caller's signed info (unknown, used, expired or another
//! key's → 401 `BAD_NONCE`). Only then `101 Switching Protocols`.
//!
//! After the upgrade the stream is registered first (closing the key's older stream with
//! 4409), then the key's enrolment and deny entries are read again: a revocation or deny that
//! committed between the authentication and the registration closes the stream (4403), and one
//! that commits after the registration finds it in the registry ([`crate::stream::hub`]). A
//! store error in that second read closes with 1013 (overload), not as a revocation.
//!
//! The connection keeps its slot among `max_connections` for the stream's whole life: the
//! request's [`ConnSlot`] moves into the connection loop.

use std::collections::HashMap;

use axum::extract::ws::WebSocketUpgrade;
use axum::extract::{FromRequestParts, Query, Request, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};

use agentmbx_net::serve::ConnSlot;
use agentmbx_protocol::stream::{close, MAX_CLIENT_FRAME, NONCE_PARAM, STREAM_QUEUE_BYTES};

use crate::auth::{authenticate_stream, blocking};
use crate::error::ApiError;
use crate::state::SharedRelay;
use crate::store::MAX_PULL_ITEMS;
use crate::stream::conn::{self, ConnParams};

/// The WebSocket read buffer of a stream: 2 KiB (client frames are small; a larger one is read
/// in steps up to [`MAX_CLIENT_FRAME`]).
pub const READ_BUFFER_BYTES: usize = 2 * 1024;

/// 401 `BAD_NONCE`: the same answer whatever was wrong with the nonce.
fn bad_nonce() -> ApiError {
    ApiError::new(
        StatusCode::UNAUTHORIZED,
        "missing, unknown, used or expired stream nonce (ask GET /v2/relay/info for one)",
        "BAD_NONCE",
    )
}

/// Handles `GET /v2/relay/stream`.
pub async fn get(State(state): State<SharedRelay>, req: Request) -> Response {
    match upgrade(state, req).await {
        Ok(r) | Err(r) => r,
    }
}

async fn upgrade(state: SharedRelay, req: Request) -> Result<Response, Response> {
    let (mut parts, _) = req.into_parts();
    let (enrolment, token) = authenticate_stream(&state, &parts.method, &parts.uri, &parts.headers)
        .await
        .map_err(IntoResponse::into_response)?;
    // The upgrade headers before the nonce: a request that cannot become a stream does not
    // spend it.
    let ws = WebSocketUpgrade::from_request_parts(&mut parts, &state)
        .await
        .map_err(|rejection| {
            ApiError::new(
                rejection.status(),
                "GET /v2/relay/stream must be a WebSocket upgrade (RFC 6455, version 13)",
                "NOT_UPGRADE",
            )
            .into_response()
        })?;
    let refuse = |why: &str| {
        tracing::debug!(reason = why, "push stream refused: bad nonce");
        let fp = crate::auth::parse_key(&enrolment.host_pubkey).map(|k| k.fingerprint());
        state.refused.auth(
            crate::refusals::AuthRefusal::BadNonce,
            parts.method.as_str(),
            parts.uri.path(),
            fp.as_deref(),
        );
        bad_nonce().into_response()
    };
    let nonce = Query::<HashMap<String, String>>::try_from_uri(&parts.uri)
        .ok()
        .and_then(|Query(mut q)| q.remove(NONCE_PARAM))
        .ok_or_else(|| refuse("no nonce"))?;
    state
        .nonces
        .consume(&nonce, &enrolment.host_pubkey, state.clock.now_ms())
        .map_err(|e| refuse(&e.to_string()))?;
    let slot = parts.extensions.get::<ConnSlot>().cloned();
    let key = enrolment.host_pubkey.clone();
    let fingerprint = crate::auth::parse_key(&key).map_or_else(String::new, |k| k.fingerprint());
    let client_id = token.as_ref().map(|t| t.client_id.clone());
    let (ping_every, pong_timeout) = state.streams.timers();
    let params = ConnParams {
        store: state.store.clone(),
        clock: state.clock.clone(),
        max_pull: i64::try_from(state.config.limits.max_pull)
            .unwrap_or(MAX_PULL_ITEMS)
            .clamp(1, MAX_PULL_ITEMS),
        max_pull_bytes: state.config.limits.max_pull_bytes,
        token_exp_ms: token.as_ref().map(|t| t.exp_ms),
        ping_every,
        pong_timeout,
        max_frame_bytes: 0,
    };
    // The largest frame the relay writes: a replayed item of `max_item_bytes` in base64 plus
    // its fields. The write buffer never holds more than one frame (the loop waits for the
    // socket before the next), so this is a bound, not an allocation.
    let max_item = usize::try_from(state.config.limits.max_item_bytes).unwrap_or(usize::MAX);
    let largest_frame = max_item
        .saturating_add(2)
        .saturating_div(3)
        .saturating_mul(4)
        .saturating_add(8 * 1024)
        .max(STREAM_QUEUE_BYTES);
    let params = ConnParams {
        max_frame_bytes: largest_frame,
        ..params
    };
    // Counted as running before the `101` goes out: shutdown waits for this stream even when
    // its loop has not started yet.
    let running = state.streams.start_running();
    let ws = ws
        .read_buffer_size(READ_BUFFER_BYTES)
        .write_buffer_size(0)
        .max_write_buffer_size(largest_frame.saturating_add(1))
        .max_message_size(MAX_CLIENT_FRAME)
        .max_frame_size(MAX_CLIENT_FRAME);
    Ok(ws.on_upgrade(move |socket| async move {
        let reg = state
            .streams
            .register(&key, &fingerprint, client_id.clone());
        // Read again after registering: a revocation or deny that landed since the
        // authentication closes the stream.
        let store = state.store.clone();
        let (k, fp, client, now) = (key, fingerprint, client_id, state.clock.now_ms());
        let still = blocking(move || {
            crate::stream::key_may_stream(store.as_ref(), &k, &fp, client.as_deref(), now)
        })
        .await;
        match still {
            Ok(true) => {}
            Ok(false) => reg.stream.request_close(close::AUTH),
            // Not a revocation: the relay cannot tell now (pull, reconnect with backoff).
            Err(e) => {
                tracing::warn!(error = ?e, "push stream: the key's status could not be read again");
                reg.stream.request_close(close::OVERLOAD);
            }
        }
        conn::run(socket, reg, params, (slot, running)).await;
    }))
}
