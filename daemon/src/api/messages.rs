//! `POST /v1/messages` (send) and `GET /v1/messages/{id}` (read).

use axum::extract::rejection::PathRejection;
use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode};
use axum::Json;
use serde::Deserialize;
use serde_json::Value;

use crate::mailbox::{messages, MailboxError};
use crate::node::send::{self, SendError, SendOutcome, SendRequest};

use super::{idempotent, ApiError, ApiJson, ApiQuery, NoQuery, SharedState};

/// Sends a message from an agent of this host. Local recipients get it at once; each remote
/// host gets one outbox row, sealed and pushed by the relay loop. Replays with the same
/// `Idempotency-Key` and body return the first answer; another body is 409.
#[utoipa::path(post, path = "/v1/messages", operation_id = "send_message", request_body = SendRequest,
    params(("Idempotency-Key" = Option<String>, Header, description = "replay protection, ≤200 chars")),
    responses((status = 201, body = SendOutcome), (status = 400, description = "BAD_REQUEST (a missing, unknown or mistyped field or query parameter, named) or INVALID_JSON (with line and column)", body = super::ErrorBody), (status = 409, body = super::ErrorBody),
        (status = 413, description = "BODY_TOO_LARGE: the body is over 2 MiB; nothing was read", body = super::ErrorBody),
        (status = 415, description = "UNSUPPORTED_MEDIA_TYPE: the body is not sent as application/json", body = super::ErrorBody),
        (status = 503, description = "STORE_BUSY: the store is locked elsewhere or busy; nothing was stored; retry after Retry-After with the same Idempotency-Key", body = super::ErrorBody)),
    security(("bearer" = [])))]
pub async fn post(
    State(state): State<SharedState>,
    headers: HeaderMap,
    _: ApiQuery<NoQuery>,
    ApiJson {
        value: req,
        raw: body,
    }: ApiJson<SendRequest>,
) -> Result<(StatusCode, Json<Value>), ApiError> {
    let st = state.clone();
    let answer = idempotent(
        &state,
        &headers,
        "/v1/messages",
        format!("send:{}", req.from),
        &body,
        StatusCode::CREATED,
        move |tx| {
            let id = st
                .ids
                .lock()
                .map_err(|_| MailboxError::Task)?
                .next(st.clock.now_ms());
            match send::send(tx, &st.ident, &req, id, st.clock.now_ms()) {
                Ok(outcome) => Ok(Ok(serde_json::to_value(outcome).unwrap_or(Value::Null))),
                Err(SendError::Store(e)) => Err(e),
                Err(SendError::Invalid(m)) => Ok(Err(ApiError::Invalid(m))),
                Err(e @ SendError::UnknownHost(_)) => Ok(Err(ApiError::UnknownHost(e.to_string()))),
            }
        },
    )
    .await?;
    state.wake.notify_one();
    Ok(answer)
}

/// Query of `GET /v1/messages/{id}`.
#[derive(Debug, Deserialize, utoipa::IntoParams)]
#[serde(deny_unknown_fields)]
pub struct ReadQuery {
    /// The reading agent.
    #[serde(rename = "as")]
    pub as_agent: String,
}

/// Reads one message as an agent (marks the agent's copy read). The sender may read its own copy.
#[utoipa::path(get, path = "/v1/messages/{id}", operation_id = "read_message", params(("id" = String, Path), ReadQuery),
    responses((status = 200, body = messages::Message), (status = 400, description = "BAD_REQUEST: a missing, unknown or mistyped query parameter, named", body = super::ErrorBody), (status = 404, body = super::ErrorBody)),
    security(("bearer" = [])))]
pub async fn get(
    State(state): State<SharedState>,
    id: Result<Path<String>, PathRejection>,
    ApiQuery(q): ApiQuery<ReadQuery>,
) -> Result<Json<messages::Message>, ApiError> {
    let Path(id) = id?;
    super::check_agent(&q.as_agent)?;
    let (host, now) = (state.ident.host.to_string(), state.clock.now_ms());
    let msg = state
        .mailbox
        .run(move |c| messages::read(c, &q.as_agent, &host, &id, now))
        .await?;
    // A first read of mail from a peer queued a `read` receipt (schema triggers): send it now.
    state.wake.notify_one();
    Ok(Json(msg))
}
