//! `POST /v1/ack`: an agent acks messages in its mailbox (a mailbox ack, never a transport ack).

use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::Json;
use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::mailbox::{messages, receipts, MailboxError};

use super::{idempotent, ApiError, ApiJson, ApiQuery, NoQuery, SharedState};

/// Most message ids one `POST /v1/ack` takes.
pub const MAX_ACK_IDS: usize = 50;

/// Body of `POST /v1/ack`.
#[derive(Debug, Deserialize, Serialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct AckRequest {
    /// The acking agent.
    #[serde(rename = "as")]
    #[schema(value_type = crate::vocab::AgentName)]
    pub as_agent: String,
    /// Message ids, 1..=50.
    #[schema(value_type = Vec<crate::vocab::MessageId>, min_items = 1, max_items = 50)]
    pub ids: Vec<String>,
    /// Optional note, at most 500 UTF-16 code units (the delivery receipt's limit, which
    /// 0.5.x peers enforce; an emoji counts two); a longer one is refused (400 `BAD_REQUEST`,
    /// nothing acked), never cut.
    #[serde(default)]
    #[schema(max_length = 500)]
    pub note: Option<String>,
}

/// Answer of `POST /v1/ack`.
#[derive(Debug, Serialize, utoipa::ToSchema)]
pub struct AckAnswer {
    /// How many deliveries moved to `acked` (already-acked ones are not counted).
    pub acked: u64,
}

/// Acks messages for an agent; all or nothing (an unknown id changes nothing, 404).
#[utoipa::path(post, path = "/v1/ack", operation_id = "ack_messages", request_body = AckRequest,
    params(("Idempotency-Key" = Option<String>, Header, description = "replay protection: 1..=200 visible ASCII characters, not starting or ending with a space (else 400); the same key and body again return the first answer, another body is 409", min_length = 1, max_length = 200, pattern = "^[!-~]([ -~]*[!-~])?$")),
    responses((status = 200, body = AckAnswer),
        (status = 400, description = "BAD_REQUEST: e.g. a note over 500 UTF-16 code units, a bad agent name, no ids or more than 50, or a missing, unknown or mistyped field (named); INVALID_JSON; nothing acked", body = super::ErrorBody),
        (status = 404, description = "NOT_FOUND: an id names no message delivered to this agent; UNKNOWN_AGENT: `as` is no agent of this host (no mailbox, no mail delivered to it); the error names the closest agents; nothing acked", body = super::ErrorBody)),
    security(("bearer" = [])))]
pub async fn post(
    State(state): State<SharedState>,
    headers: HeaderMap,
    _: ApiQuery<NoQuery>,
    ApiJson {
        value: req,
        raw: body,
    }: ApiJson<AckRequest>,
) -> Result<(StatusCode, Json<Value>), ApiError> {
    super::check_agent(&req.as_agent)?;
    super::check_reader(&state, &req.as_agent).await?;
    if req.ids.is_empty() || req.ids.len() > MAX_ACK_IDS {
        return Err(ApiError::Invalid(format!(
            "ids must hold 1..={MAX_ACK_IDS} message ids"
        )));
    }
    if let Some(note) = &req.note {
        receipts::check_note(note)?;
    }
    let now = state.clock.now_ms();
    let answer = idempotent(
        &state,
        &headers,
        "/v1/ack",
        format!("ack:{}", req.as_agent),
        &body,
        StatusCode::OK,
        move |tx| match messages::ack(
            tx,
            &req.as_agent,
            &req.ids,
            req.note.as_deref().filter(|n| !n.is_empty()),
            now,
        ) {
            Ok(n) => Ok(Ok(
                serde_json::to_value(AckAnswer { acked: n }).unwrap_or(Value::Null)
            )),
            Err(MailboxError::NotFound(m)) => Ok(Err(ApiError::Missing(m))),
            Err(e) => Err(e),
        },
    )
    .await;
    // An ack of mail from a peer queued an `acked` receipt (schema triggers): send it now.
    state.wake.notify_one();
    answer
}

#[cfg(test)]
mod tests;
