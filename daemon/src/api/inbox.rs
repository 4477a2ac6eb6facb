//! `GET /v1/inbox`: an agent's inbox in bounded pages, and the long poll (`wait=<seconds>`).
//!
//! Every answer carries `cursor`, the position after the page (scoped to the agent). With
//! `wait` (1..=[`MAX_WAIT_S`] s), a page that would be empty is held until a message for the
//! agent is committed after that position — the wake comes from the store's one wake point
//! ([`crate::mailbox::wake`]), whatever transport brought the message — or until the wait ends
//! (an empty page then), or the daemon shuts down (an empty page at once). At most
//! [`crate::mailbox::wake::MAX_WAITERS`] requests wait at once; past it a request whose page is
//! empty is refused 503 `TOO_MANY_WAITERS` with `Retry-After` (an empty answer at once would
//! let a waiting loop spin). Waiting uses no timer but its own deadline. The messages an answer
//! to a request with `wait` lists (at once or after waiting) are recorded `notified` when still
//! `new` (spec §9: a live consumer took them), which queues a `notified` receipt for mail from
//! a peer; a plain listing (`wait=0`) records nothing, nor does a wait with `notify=false` (a
//! watcher that only learns of new mail, such as `agentmbx mcp`'s channel notifications).

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
    #[param(value_type = crate::vocab::AgentName)]
    pub as_agent: String,
    /// Opaque cursor from a previous answer of this agent's inbox: `next_cursor` (the next
    /// page) or `cursor` (what comes after that answer); empty: from the start. Another
    /// agent's cursor is 400.
    #[param(pattern = "^([a-z0-9][a-z0-9-]{1,39}\\.[0-9]{1,18})?$")]
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
    /// Long poll, seconds (0..=60, default 0): when the page would be empty, wait up to this
    /// long for a message for the agent committed after `cursor`; an empty page on timeout.
    #[param(minimum = 0, maximum = 60)]
    pub wait: Option<u32>,
    /// With `wait`: record the messages the answer lists `notified` (default true: the caller
    /// is a live consumer that takes them). `false` for a watcher that only learns of new mail
    /// (`agentmbx mcp`'s channel notifications, which are no evidence a consumer took it).
    #[param(default = true)]
    pub notify: Option<bool>,
}

/// Longest `wait` of `GET /v1/inbox` (s): 60. The CLI's attempt timeout is longer.
pub const MAX_WAIT_S: u32 = 60;

/// Marks an answer that waited, so the slow-request log leaves it out.
#[derive(Debug, Clone, Copy)]
pub struct LongPoll;

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
/// With `wait`, an empty page is held until mail for the agent arrives after `cursor` (see
/// the module docs).
#[utoipa::path(get, path = "/v1/inbox", operation_id = "list_inbox", params(InboxQuery),
    responses((status = 200, description = "A page with the position after it (`cursor`); with `wait`, the first page that is not empty, or an empty one when the wait ended (timeout, or the daemon shutting down)", body = InboxPage),
        (status = 400, description = "BAD_REQUEST: bad `limit`, `from` or `cursor`, a cursor of another agent, or `wait` over 60", body = super::ErrorBody),
        (status = 404, description = "UNKNOWN_AGENT: `as` is no agent of this host (no mailbox, no mail delivered to it); the error names the closest agents", body = super::ErrorBody),
        (status = 503, description = "TOO_MANY_WAITERS: `wait` was asked while 256 requests wait already, and the page was empty: this one did not wait; try again after `Retry-After` seconds. STORE_BUSY: see the shared answer", body = super::ErrorBody,
            headers(("Retry-After" = u32, description = "seconds to wait before a retry")))),
    security(("bearer" = [])))]
pub async fn get(
    State(state): State<SharedState>,
    ApiQuery(q): ApiQuery<InboxQuery>,
) -> Result<axum::response::Response, ApiError> {
    use axum::response::IntoResponse;
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
    let wait = q.wait.unwrap_or(0);
    if wait > MAX_WAIT_S {
        return Err(ApiError::Invalid(format!(
            "wait must be 0..={MAX_WAIT_S} seconds"
        )));
    }
    messages::parse_inbox_cursor(&q.as_agent, q.cursor.as_deref())?;
    let filter = InboxFilter {
        include_acked: q.all,
        needs_reply: q.needs_reply,
        from: q.from,
    };
    let agent = q.as_agent;
    let record = q.notify.unwrap_or(true);
    let read = |cursor: Option<String>| {
        let (agent, filter) = (agent.clone(), filter.clone());
        state
            .mailbox
            .run(move |c| messages::inbox(c, &agent, cursor.as_deref(), limit, &filter))
    };
    if wait == 0 {
        return Ok(Json(read(q.cursor).await?).into_response());
    }
    // Subscribe before the first read: a delivery committed after it is seen.
    let hub = state.mailbox.waits();
    let mut arrived = hub.subscribe(&agent);
    let mut closed = hub.closed();
    let page = read(q.cursor.clone()).await?;
    if !page.messages.is_empty() {
        if record {
            notified(&state, &agent, &page).await?;
        }
        return Ok(Json(page).into_response());
    }
    if *closed.borrow() {
        return Ok(Json(page).into_response());
    }
    let Some(_slot) = hub.try_wait_slot() else {
        let why = format!(
            "{} requests wait for mail already: this one did not wait; the page is empty now, \
             try the wait again after Retry-After",
            crate::mailbox::wake::MAX_WAITERS
        );
        tracing::info!("{why}");
        return Err(ApiError::TooManyWaiters(why));
    };
    tracing::debug!(agent = %agent, wait_s = wait, "a reader waits for mail");
    let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(wait.into());
    let mut page = page;
    loop {
        tokio::select! {
            changed = arrived.changed() => {
                if changed.is_err() {
                    break;
                }
            }
            _ = closed.changed() => break,
            () = tokio::time::sleep_until(deadline) => break,
        }
        // Read on from the position of the empty page: only what arrived since.
        page = read(Some(page.cursor.clone())).await?;
        if !page.messages.is_empty() {
            if record {
                notified(&state, &agent, &page).await?;
            }
            break;
        }
    }
    Ok((axum::Extension(LongPoll), Json(page)).into_response())
}

/// A wait returned `page` to `agent`: a live consumer took its messages (spec §9 `notified`,
/// [`messages::mark_notified`]).
async fn notified(state: &SharedState, agent: &str, page: &InboxPage) -> Result<(), ApiError> {
    let ids: Vec<String> = page.messages.iter().map(|m| m.id.clone()).collect();
    let (agent, now) = (agent.to_string(), state.clock.now_ms());
    state
        .mailbox
        .run(move |c| {
            let tx = c.transaction()?;
            messages::mark_notified(&tx, &agent, &ids, now)?;
            tx.commit()?;
            Ok(())
        })
        .await?;
    Ok(())
}

#[cfg(test)]
mod tests;
