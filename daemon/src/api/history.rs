//! `GET /v1/replay` (history pages with bodies, 0.5.x `mbx_replay`) and the catchup routes
//! (`GET /v1/catchup`, `POST /v1/catchup/commit`, `POST /v1/catchup/restart`: 0.5.x
//! `mbx_catchup`, with the agent's position stored in the mailbox). Listing marks nothing read
//! or notified (unlike `GET /v1/messages/{id}` and the long poll); see
//! [`crate::mailbox::history`].

use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::Json;
use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::mailbox::history::{self, HistoryPage, Restart};
use crate::mailbox::messages;

use super::{idempotent, ApiError, ApiJson, ApiQuery, NoQuery, SharedState};

/// Longest cursor (characters); ours are far shorter.
pub const MAX_CURSOR: usize = 2048;
/// Longest `thread` filter (UTF-16 code units), as a thread id.
pub const MAX_THREAD: usize = 300;

/// Query of `GET /v1/replay`.
#[derive(Debug, Deserialize, utoipa::IntoParams)]
#[serde(deny_unknown_fields)]
#[into_params(parameter_in = Query)]
pub struct ReplayQuery {
    /// The agent whose history to list.
    #[serde(rename = "as")]
    #[param(value_type = crate::vocab::AgentName)]
    pub as_agent: String,
    /// Opaque cursor from a previous answer of this agent (`next_cursor`, or `cursor`: what
    /// comes after that answer); empty: from the beginning. At most 2048 characters; another
    /// agent's cursor is 400.
    #[param(
        pattern = "^([a-z0-9][a-z0-9-]{1,39}\\.[0-9]{1,18})?$",
        max_length = 2048
    )]
    pub cursor: Option<String>,
    /// Page size, 1..=200 (default 50).
    #[param(minimum = 1, maximum = 200)]
    pub limit: Option<u32>,
    /// Byte budget of the page, 2048..=262144 (default 65536): the sum of the messages' JSON
    /// sizes, bodies included. A page always holds at least one message when one follows,
    /// even a message alone over the budget (so the answer is at most that message's size
    /// over it).
    #[param(minimum = 2048, maximum = 262144)]
    pub max_bytes: Option<u32>,
    /// Only messages of this thread (a thread id: 1..=300 UTF-16 code units).
    #[param(value_type = Option<crate::vocab::ThreadId>)]
    pub thread: Option<String>,
}

/// Query of `GET /v1/catchup`.
#[derive(Debug, Deserialize, utoipa::IntoParams)]
#[serde(deny_unknown_fields)]
#[into_params(parameter_in = Query)]
pub struct CatchupQuery {
    /// The agent catching up.
    #[serde(rename = "as")]
    #[param(value_type = crate::vocab::AgentName)]
    pub as_agent: String,
    /// Opaque cursor of a previous catchup answer of this agent (`next_cursor`), to read on
    /// before committing; empty or absent: from the agent's stored position. At most 2048
    /// characters; another agent's cursor is 400.
    #[param(
        pattern = "^([a-z0-9][a-z0-9-]{1,39}\\.[0-9]{1,18})?$",
        max_length = 2048
    )]
    pub cursor: Option<String>,
    /// Page size, 1..=200 (default 50).
    #[param(minimum = 1, maximum = 200)]
    pub limit: Option<u32>,
    /// Byte budget of the page, 2048..=262144 (default 65536), as `GET /v1/replay`'s.
    #[param(minimum = 2048, maximum = 262144)]
    pub max_bytes: Option<u32>,
}

/// Body of `POST /v1/catchup/commit`.
#[derive(Debug, Deserialize, Serialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct CommitRequest {
    /// The agent.
    #[serde(rename = "as")]
    #[schema(value_type = crate::vocab::AgentName)]
    pub as_agent: String,
    /// The `cursor` of a catchup (or replay) answer of this agent: everything up to it has
    /// been taken. Another agent's cursor, or one past the agent's newest message, is 400.
    #[schema(pattern = "^[a-z0-9][a-z0-9-]{1,39}\\.[0-9]{1,18}$", max_length = 2048)]
    pub cursor: String,
}

/// Body of `POST /v1/catchup/restart`.
#[derive(Debug, Deserialize, Serialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct RestartRequest {
    /// The agent.
    #[serde(rename = "as")]
    #[schema(value_type = crate::vocab::AgentName)]
    pub as_agent: String,
    /// `all`: the next catchup lists everything delivered to the agent; `now`: only what
    /// arrives after this.
    pub from: Restart,
}

/// Answer of the catchup commit and restart.
#[derive(Debug, Serialize, utoipa::ToSchema)]
pub struct PositionAnswer {
    /// The agent's stored catchup position afterwards (an opaque cursor of this agent).
    #[schema(pattern = "^[a-z0-9][a-z0-9-]{1,39}\\.[0-9]{1,18}$")]
    pub position: String,
}

fn check_page(
    cursor: Option<&str>,
    limit: Option<u32>,
    max_bytes: Option<u32>,
) -> Result<(u32, usize), ApiError> {
    if cursor.is_some_and(|c| c.chars().count() > MAX_CURSOR) {
        return Err(ApiError::Invalid(format!(
            "cursor is longer than {MAX_CURSOR} characters"
        )));
    }
    let limit = limit.unwrap_or(history::DEFAULT_LIMIT);
    if !(1..=history::MAX_LIMIT).contains(&limit) {
        return Err(ApiError::Invalid(format!(
            "limit must be 1..={}",
            history::MAX_LIMIT
        )));
    }
    let max_bytes = max_bytes.map_or(history::DEFAULT_MAX_BYTES, |b| b as usize);
    if !(history::MIN_MAX_BYTES..=history::MAX_MAX_BYTES).contains(&max_bytes) {
        return Err(ApiError::Invalid(format!(
            "max_bytes must be {}..={}",
            history::MIN_MAX_BYTES,
            history::MAX_MAX_BYTES
        )));
    }
    Ok((limit, max_bytes))
}

/// Lists the messages delivered to an agent, oldest first (delivery order), with bodies, in
/// pages bounded by count and bytes; marks nothing read. `thread` keeps one thread's.
#[utoipa::path(get, path = "/v1/replay", operation_id = "replay", params(ReplayQuery),
    responses((status = 200, description = "A page (`has_more` and `next_cursor` when more follow) with the position after it (`cursor`)", body = HistoryPage),
        (status = 400, description = "BAD_REQUEST: bad `limit`, `max_bytes`, `thread` or `cursor`, or a cursor of another agent", body = super::ErrorBody),
        (status = 404, description = "UNKNOWN_AGENT: `as` is no agent of this host (no mailbox, no mail delivered to it); the error names the closest agents", body = super::ErrorBody)),
    security(("bearer" = [])))]
pub async fn replay(
    State(state): State<SharedState>,
    ApiQuery(q): ApiQuery<ReplayQuery>,
) -> Result<Json<HistoryPage>, ApiError> {
    super::check_agent(&q.as_agent)?;
    super::check_reader(&state, &q.as_agent).await?;
    let (limit, max_bytes) = check_page(q.cursor.as_deref(), q.limit, q.max_bytes)?;
    if let Some(t) = &q.thread {
        if !(1..=MAX_THREAD).contains(&t.encode_utf16().count()) {
            return Err(ApiError::Invalid(format!(
                "thread must be 1..={MAX_THREAD} characters"
            )));
        }
    }
    let after = messages::parse_inbox_cursor(&q.as_agent, q.cursor.as_deref())?;
    let page = state
        .mailbox
        .run(move |c| history::page(c, &q.as_agent, after, limit, max_bytes, q.thread.as_deref()))
        .await?;
    Ok(Json(page))
}

/// What arrived for an agent since its stored catchup position (or since `cursor`), oldest
/// first, with bodies, bounded as `GET /v1/replay`; marks nothing read and moves nothing: the
/// position moves with `POST /v1/catchup/commit`.
#[utoipa::path(get, path = "/v1/catchup", operation_id = "catchup", params(CatchupQuery),
    responses((status = 200, description = "A page after the stored position (or `cursor`); `cursor` is what to commit once it is taken", body = HistoryPage),
        (status = 400, description = "BAD_REQUEST: bad `limit`, `max_bytes` or `cursor`, or a cursor of another agent", body = super::ErrorBody),
        (status = 404, description = "UNKNOWN_AGENT: `as` is no agent of this host (no mailbox, no mail delivered to it); the error names the closest agents", body = super::ErrorBody)),
    security(("bearer" = [])))]
pub async fn catchup(
    State(state): State<SharedState>,
    ApiQuery(q): ApiQuery<CatchupQuery>,
) -> Result<Json<HistoryPage>, ApiError> {
    super::check_agent(&q.as_agent)?;
    super::check_reader(&state, &q.as_agent).await?;
    let (limit, max_bytes) = check_page(q.cursor.as_deref(), q.limit, q.max_bytes)?;
    let given = q
        .cursor
        .as_deref()
        .filter(|c| !c.is_empty())
        .map(|c| messages::parse_inbox_cursor(&q.as_agent, Some(c)))
        .transpose()?;
    let page = state
        .mailbox
        .run(move |c| {
            let after = match given {
                Some(seq) => seq,
                None => history::position(c, &q.as_agent)?,
            };
            history::page(c, &q.as_agent, after, limit, max_bytes, None)
        })
        .await?;
    Ok(Json(page))
}

/// Moves the agent's stored catchup position forward to `cursor` (never back: an older
/// cursor leaves it where it is and answers where it is).
#[utoipa::path(post, path = "/v1/catchup/commit", operation_id = "commit_catchup", request_body = CommitRequest,
    params(("Idempotency-Key" = Option<String>, Header, description = "replay protection: 1..=200 visible ASCII characters, not starting or ending with a space (else 400); the same key and body again return the first answer, another body is 409", min_length = 1, max_length = 200, pattern = "^[!-~]([ -~]*[!-~])?$")),
    responses((status = 200, body = PositionAnswer),
        (status = 400, description = "BAD_REQUEST: a bad agent name or cursor, a cursor of another agent or past the agent's newest message, or a missing, unknown or mistyped field (named); INVALID_JSON; nothing changed", body = super::ErrorBody),
        (status = 404, description = "UNKNOWN_AGENT: `as` is no agent of this host (no mailbox, no mail delivered to it); the error names the closest agents", body = super::ErrorBody)),
    security(("bearer" = [])))]
pub async fn commit(
    State(state): State<SharedState>,
    headers: HeaderMap,
    _: ApiQuery<NoQuery>,
    ApiJson {
        value: req,
        raw: body,
    }: ApiJson<CommitRequest>,
) -> Result<(StatusCode, Json<Value>), ApiError> {
    super::check_agent(&req.as_agent)?;
    super::check_reader(&state, &req.as_agent).await?;
    if req.cursor.is_empty() || req.cursor.chars().count() > MAX_CURSOR {
        return Err(ApiError::Invalid(
            "cursor must be the cursor of a catchup answer".into(),
        ));
    }
    let seq = messages::parse_inbox_cursor(&req.as_agent, Some(&req.cursor))?;
    let now = state.clock.now_ms();
    let agent = req.as_agent;
    idempotent(
        &state,
        &headers,
        "/v1/catchup/commit",
        format!("catchup:{agent}"),
        &body,
        StatusCode::OK,
        move |tx| match history::commit(tx, &agent, seq, now) {
            Ok(p) => Ok(Ok(position_answer(&agent, p))),
            Err(crate::mailbox::MailboxError::Invalid(m)) => Ok(Err(ApiError::Invalid(m))),
            Err(e) => Err(e),
        },
    )
    .await
}

/// Sets the agent's stored catchup position: to the beginning (`all`) or to its newest
/// message (`now`). The one way the position moves back.
#[utoipa::path(post, path = "/v1/catchup/restart", operation_id = "restart_catchup", request_body = RestartRequest,
    params(("Idempotency-Key" = Option<String>, Header, description = "replay protection: 1..=200 visible ASCII characters, not starting or ending with a space (else 400); the same key and body again return the first answer, another body is 409", min_length = 1, max_length = 200, pattern = "^[!-~]([ -~]*[!-~])?$")),
    responses((status = 200, body = PositionAnswer),
        (status = 400, description = "BAD_REQUEST: a bad agent name, a `from` other than all or now, or a missing, unknown or mistyped field (named); INVALID_JSON; nothing changed", body = super::ErrorBody),
        (status = 404, description = "UNKNOWN_AGENT: `as` is no agent of this host (no mailbox, no mail delivered to it); the error names the closest agents", body = super::ErrorBody)),
    security(("bearer" = [])))]
pub async fn restart(
    State(state): State<SharedState>,
    headers: HeaderMap,
    _: ApiQuery<NoQuery>,
    ApiJson {
        value: req,
        raw: body,
    }: ApiJson<RestartRequest>,
) -> Result<(StatusCode, Json<Value>), ApiError> {
    super::check_agent(&req.as_agent)?;
    super::check_reader(&state, &req.as_agent).await?;
    let now = state.clock.now_ms();
    let agent = req.as_agent;
    idempotent(
        &state,
        &headers,
        "/v1/catchup/restart",
        format!("catchup-restart:{agent}"),
        &body,
        StatusCode::OK,
        move |tx| {
            let p = history::restart(tx, &agent, req.from, now)?;
            Ok(Ok(position_answer(&agent, p)))
        },
    )
    .await
}

fn position_answer(agent: &str, seq: i64) -> Value {
    serde_json::to_value(PositionAnswer {
        position: messages::inbox_cursor(agent, seq),
    })
    .unwrap_or(Value::Null)
}

#[cfg(test)]
mod tests;
