//! `GET /v1/inbox`: an agent's inbox in bounded pages.

use axum::extract::State;
use axum::Json;
use serde::Deserialize;

use crate::mailbox::messages::{self, InboxFilter, InboxPage};

use super::{ApiError, ApiQuery, SharedState};

/// Query of `GET /v1/inbox`.
#[derive(Debug, Deserialize, utoipa::IntoParams)]
#[serde(deny_unknown_fields)]
#[into_params(parameter_in = Query)]
pub struct InboxQuery {
    /// The agent whose inbox to list.
    #[serde(rename = "as")]
    #[param(value_type = crate::api::openapi::AgentName)]
    pub as_agent: String,
    /// Opaque cursor from the previous page's `next_cursor` (empty: the first page).
    #[param(pattern = "^[0-9]{0,18}$")]
    pub cursor: Option<String>,
    /// Page size, 1..=200 (default 50); pages are also bounded to 256 KiB.
    #[param(minimum = 1, maximum = 200)]
    pub limit: Option<u32>,
    /// Include acked messages.
    #[serde(default)]
    pub all: bool,
    /// Only messages that ask for a reply.
    #[serde(default)]
    pub needs_reply: bool,
    /// Only messages from this sender: `name@host`, or a bare `name` (from any host).
    #[param(pattern = "^[a-z0-9][a-z0-9-]{1,39}(@[^@]+)?$")]
    pub from: Option<String>,
}

/// Checks the `from` filter: an agent name (NAME_RE), optionally `@host` (anything but `@`,
/// not empty). Errors: 400 `BAD_REQUEST` saying so.
pub fn check_from(from: &str) -> Result<(), ApiError> {
    let (name, host) = match from.split_once('@') {
        Some((n, h)) => (n, Some(h)),
        None => (from, None),
    };
    if !agentmbx_protocol::limits::is_name(name)
        || host.is_some_and(|h| h.is_empty() || h.contains('@'))
    {
        return Err(ApiError::Invalid(format!(
            "bad from {from:?}: an agent name or name@host"
        )));
    }
    Ok(())
}

/// Lists an agent's messages, oldest first, without bodies. An `as` that is no agent of this
/// host (no local mailbox, no mail delivered to it) is 404 `UNKNOWN_AGENT`, not an empty page.
#[utoipa::path(get, path = "/v1/inbox", operation_id = "list_inbox", params(InboxQuery),
    responses((status = 200, body = InboxPage),
        (status = 404, description = "UNKNOWN_AGENT: `as` is no agent of this host (no mailbox, no mail delivered to it); the error names the closest agents", body = super::ErrorBody)),
    security(("bearer" = [])))]
pub async fn get(
    State(state): State<SharedState>,
    ApiQuery(q): ApiQuery<InboxQuery>,
) -> Result<Json<InboxPage>, ApiError> {
    super::check_agent(&q.as_agent)?;
    super::check_reader(&state, &q.as_agent).await?;
    let limit = q.limit.unwrap_or(messages::DEFAULT_INBOX_LIMIT);
    if !(1..=messages::MAX_INBOX_LIMIT).contains(&limit) {
        return Err(ApiError::Invalid(format!(
            "limit must be 1..={}",
            messages::MAX_INBOX_LIMIT
        )));
    }
    if let Some(from) = q.from.as_deref() {
        check_from(from)?;
    }
    let filter = InboxFilter {
        include_acked: q.all,
        needs_reply: q.needs_reply,
        from: q.from,
    };
    let page = state
        .mailbox
        .run(move |c| messages::inbox(c, &q.as_agent, q.cursor.as_deref(), limit, &filter))
        .await?;
    Ok(Json(page))
}
