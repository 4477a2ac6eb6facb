//! `POST /v2/relay/ack {epoch, through}` (spec §4): deletes the caller's items with
//! `seq ≤ through` and records `acked_through = max(old, through)`. A stale epoch answers 409
//! `EPOCH`; `through` beyond the head answers 400 `BAD_ACK` (the receiver treats it as an epoch
//! change); `through` must be a non-negative integer (a fraction is 400).

use axum::extract::{Request, State};
use axum::http::StatusCode;
use axum::Json;

use agentmbx_protocol::limits::RELAY_SMALL_BODY;
use agentmbx_protocol::records::MAX_SAFE_INT;
use agentmbx_protocol::wire::{AckRequest, AckResponse};

use crate::auth::{authenticate, blocking, read_body, utf8};
use crate::error::ApiError;
use crate::server::SharedRelay;
use crate::store::{self, AckResult};

/// Handles `POST /v2/relay/ack`.
pub async fn post(
    State(state): State<SharedRelay>,
    req: Request,
) -> Result<Json<AckResponse>, ApiError> {
    let (parts, body) = req.into_parts();
    let body = read_body(body, RELAY_SMALL_BODY).await?;
    let raw = utf8(&body)?;
    let caller = authenticate(&state, &parts.method, &parts.uri, &parts.headers, raw).await?;
    let ack: AckRequest = serde_json::from_str(raw)
        .map_err(|_| ApiError::bad_request("bad ack: {epoch, through} required"))?;
    let through = ack
        .through
        .as_i64()
        .filter(|t| (0..=MAX_SAFE_INT).contains(t))
        .ok_or_else(|| ApiError::bad_request("bad ack: through must be a non-negative integer"))?;
    let store = state.store.clone();
    let req = store::AckRequest {
        target_pubkey: caller.host_pubkey,
        through,
        epoch: Some(ack.epoch),
    };
    match blocking(move || store.ack(req)).await? {
        AckResult::Acked(a) => Ok(Json(AckResponse {
            acked_through: a.acked_through,
            deleted: a.deleted,
            head_seq: a.head_seq,
        })),
        AckResult::BeyondHead { head_seq, epoch } => Err(ApiError::new(
            StatusCode::BAD_REQUEST,
            "ack beyond the last allocated seq: treat as an epoch change",
            "BAD_ACK",
        )
        .with_epoch(epoch, head_seq)),
        AckResult::StaleEpoch { epoch, head_seq } => {
            Err(ApiError::new(StatusCode::CONFLICT, "stale epoch", "EPOCH")
                .with_epoch(epoch, head_seq))
        }
    }
}
