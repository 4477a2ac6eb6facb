//! `GET /v1/threads/{id}`: a thread as one agent sees it, in bounded pages.

use axum::extract::{Path, State};
use axum::Json;
use serde::Deserialize;

use crate::mailbox::messages::{self, ThreadPage};

use super::{ApiError, ApiQuery, SharedState};

/// Query of `GET /v1/threads/{id}`.
#[derive(Debug, Deserialize, utoipa::IntoParams)]
#[serde(deny_unknown_fields)]
#[into_params(parameter_in = Query)]
pub struct ThreadQuery {
    /// The agent whose view of the thread to list.
    #[serde(rename = "as")]
    #[param(value_type = crate::vocab::AgentName)]
    pub as_agent: String,
    /// Opaque cursor from the previous page's `next_cursor` (a message id of this thread; any
    /// other is 400).
    #[param(value_type = Option<crate::vocab::MessageId>)]
    pub cursor: Option<String>,
    /// Page size, 1..=200 (default 50); pages are also bounded to 256 KiB.
    #[param(minimum = 1, maximum = 200)]
    pub limit: Option<u32>,
}

/// Lists the messages of a thread that the agent can see (delivered to it or sent by it),
/// oldest first, with bodies; marks nothing read. `{id}` is a message id (its thread is listed)
/// or a thread id. 404 when the agent sees nothing of it.
#[utoipa::path(get, path = "/v1/threads/{id}", operation_id = "get_thread",
    params(("id" = crate::vocab::ThreadId, Path, description = "a message id or a thread id"), ThreadQuery),
    responses((status = 200, body = ThreadPage),
        (status = 400, description = "BAD_REQUEST: a missing, unknown or mistyped query parameter (named), one that breaks its rule, or a cursor that is not a message of this thread", body = super::ErrorBody),
        (status = 404, description = "NOT_FOUND: the agent sees no message of this id or thread; UNKNOWN_AGENT: `as` is no agent of this host (no mailbox, no mail delivered to it); the error names the closest agents", body = super::ErrorBody)),
    security(("bearer" = [])))]
pub async fn get(
    State(state): State<SharedState>,
    Path(id): Path<String>,
    ApiQuery(q): ApiQuery<ThreadQuery>,
) -> Result<Json<ThreadPage>, ApiError> {
    super::check_agent(&q.as_agent)?;
    super::check_reader(&state, &q.as_agent).await?;
    let limit = q.limit.unwrap_or(messages::DEFAULT_THREAD_LIMIT);
    if !(1..=messages::MAX_THREAD_LIMIT).contains(&limit) {
        return Err(ApiError::Invalid(format!(
            "limit must be 1..={}",
            messages::MAX_THREAD_LIMIT
        )));
    }
    let host = state.ident.host.to_string();
    let page = state
        .mailbox
        .run(move |c| messages::thread(c, &q.as_agent, &host, &id, q.cursor.as_deref(), limit))
        .await?;
    Ok(Json(page))
}

#[cfg(test)]
mod tests;
