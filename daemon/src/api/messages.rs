//! `POST /v1/messages` (send), `POST /v1/messages/{id}/reply` (reply) and
//! `GET /v1/messages/{id}` (read).

use axum::extract::rejection::PathRejection;
use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode};
use axum::Json;
use serde::Deserialize;
use serde_json::Value;

use crate::mailbox::{messages, MailboxError};
use crate::node::send::{self, ReplyRequest, SendError, SendOutcome, SendRequest};

use super::{idempotent, ApiError, ApiJson, ApiQuery, NoQuery, SharedState};

/// Sends a message from an agent of this host. Local recipients get it at once; each remote
/// host gets one outbox row, sealed and pushed by the relay loop. `name@host` for an agent the
/// host's known directory does not list is refused (400 `UNKNOWN_AGENT`) unless `"force":
/// true`; while that directory is not known yet, the answer's `warnings` say so. Replays with the same
/// `Idempotency-Key` and body return the first answer; another body is 409.
#[utoipa::path(post, path = "/v1/messages", operation_id = "send_message", request_body = SendRequest,
    params(("Idempotency-Key" = Option<String>, Header, description = "replay protection: 1..=200 visible ASCII characters, not starting or ending with a space (else 400); the same key and body again return the first answer, another body is 409", min_length = 1, max_length = 200, pattern = "^[!-~]([ -~]*[!-~])?$")),
    responses((status = 201, body = SendOutcome),
        (status = 400, description = "BAD_REQUEST: a missing, unknown or mistyped field or query parameter (named), one that breaks its rule, an address that reaches nobody, or a thread other than the parent's; INVALID_JSON (with line and column); UNKNOWN_HOST: `name@host` names a host that is not paired (the closest paired names suggested); UNKNOWN_AGENT: a bare recipient name (or name@<this host>) that is no agent here nor on any paired host (the closest known names given; `new_mailbox` creates it), or name@host where that host's known agent directory lists no such agent (its agents listed; `force` sends anyway); nothing was sent", body = super::ErrorBody),
        (status = 404, description = "NOT_FOUND: `reply_to` names no message delivered to or sent by this agent; nothing was sent", body = super::ErrorBody)),
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
    if !req.force {
        refresh_stale_directories(&state, &req.to).await;
    }
    let st = state.clone();
    let answer = idempotent(
        &state,
        &headers,
        "/v1/messages",
        format!("send:{}", req.from),
        &body,
        StatusCode::CREATED,
        move |tx| send_in(&st, tx, &req),
    )
    .await?;
    state.wake.notify_one();
    Ok(answer)
}

/// Before a send is checked against peer directories: fetches again, over the LAN, the
/// directory of each paired host with a LAN address that `to` names as `name@host` where the
/// stored directory lists no `name` (an agent may have registered there since the last
/// refresh), within [`STALE_FETCH_BUDGET`] in all. Failures only leave the stored directory
/// as it is (the send is then checked against it); nothing is fetched when every address is
/// listed, so an ordinary send never waits on the network.
///
/// [`STALE_FETCH_BUDGET`]: crate::transport::lan::directory::STALE_FETCH_BUDGET
pub async fn refresh_stale_directories(state: &SharedState, to: &[String]) {
    use crate::mailbox::{agents, peers};
    use crate::transport::lan::directory;
    let Some(client) = state.lan.get() else {
        return;
    };
    let own = state.ident.host.to_string();
    let to = to.to_vec();
    let stale = state
        .mailbox
        .run(move |c| {
            let mut hosts: Vec<String> = Vec::new();
            for (name, host) in to.iter().filter_map(|t| t.split_once('@')) {
                if host == own || name == agents::OWNER || hosts.iter().any(|h| h == host) {
                    continue;
                }
                let Some(peer) = peers::by_name(c, host)? else {
                    continue;
                };
                if peer.addr.is_some()
                    && agents::directory_known(c, host)?.is_some()
                    && !agents::names_on(c, host)?.iter().any(|n| n == name)
                {
                    hosts.push(host.to_string());
                }
            }
            Ok(hosts)
        })
        .await;
    let hosts = match stale {
        Ok(h) if !h.is_empty() => h,
        Ok(_) => return,
        Err(e) => {
            tracing::debug!(error = %e, "cannot read peer directories before a send");
            return;
        }
    };
    let fetch = directory::refresh(&state.mailbox, client, directory::Which::All, |h| {
        hosts.iter().any(|s| s == h)
    });
    match tokio::time::timeout(directory::STALE_FETCH_BUDGET, fetch).await {
        Ok(Ok(report)) => {
            tracing::debug!(?report.refreshed, ?report.failed, "fetched stale peer directories before a send")
        }
        Ok(Err(e)) => tracing::debug!(error = %e, "stale peer directories not fetched"),
        Err(_) => tracing::debug!("stale peer directories not fetched in time"),
    }
}

/// Sends `req` inside `tx`: the closure body of the mutating routes (`Ok(Err(_))` rolls back).
fn send_in(
    st: &SharedState,
    tx: &rusqlite::Transaction<'_>,
    req: &SendRequest,
) -> Result<Result<Value, ApiError>, MailboxError> {
    let id = st
        .ids
        .lock()
        .map_err(|_| MailboxError::Task)?
        .next(st.clock.now_ms());
    match send::send(tx, &st.ident, req, id, st.clock.now_ms()) {
        Ok(outcome) => Ok(Ok(serde_json::to_value(outcome).unwrap_or(Value::Null))),
        Err(e) => send_error(e).map(Err),
    }
}

/// A refused send as the API answers it (a storage fault stays a storage fault).
fn send_error(e: SendError) -> Result<ApiError, MailboxError> {
    Ok(match e {
        SendError::Store(e) => return Err(e),
        SendError::Invalid(m) => ApiError::Invalid(m),
        SendError::ParentNotFound(m) => ApiError::Missing(m),
        e @ SendError::UnknownHost(_) => ApiError::UnknownHost(e.to_string()),
        e @ (SendError::UnknownAgent(_) | SendError::Unlisted(_)) => {
            ApiError::UnknownAgent(e.to_string())
        }
    })
}

/// Replies to message `{id}` as agent `from` (0.5.x `mbx_reply`): to the message's sender, in its
/// thread, subject `Re: <subject>`, kind `reply` unless given. `{id}` must be delivered to
/// `from` or sent by it, else 404 and nothing is sent. `Idempotency-Key` as for a send.
#[utoipa::path(post, path = "/v1/messages/{id}/reply", operation_id = "reply_message", request_body = ReplyRequest,
    params(("id" = crate::vocab::MessageId, Path, description = "the message answered"),
        ("Idempotency-Key" = Option<String>, Header, description = "replay protection: 1..=200 visible ASCII characters, not starting or ending with a space (else 400); the same key and body again return the first answer, another body is 409", min_length = 1, max_length = 200, pattern = "^[!-~]([ -~]*[!-~])?$")),
    responses((status = 201, body = SendOutcome),
        (status = 400, description = "BAD_REQUEST: a missing, unknown or mistyped field or query parameter (named) or one that breaks its rule; INVALID_JSON (with line and column); UNKNOWN_HOST: the parent's sender is on a host that is no longer paired; nothing was sent", body = super::ErrorBody),
        (status = 404, description = "NOT_FOUND: `{id}` names no message delivered to or sent by this agent; UNKNOWN_AGENT: `from` is no agent of this host (no mailbox, no mail delivered to it; the error names the closest agents); nothing was sent", body = super::ErrorBody)),
    security(("bearer" = [])))]
pub async fn reply(
    State(state): State<SharedState>,
    Path(parent): Path<String>,
    headers: HeaderMap,
    _: ApiQuery<NoQuery>,
    ApiJson {
        value: req,
        raw: body,
    }: ApiJson<ReplyRequest>,
) -> Result<(StatusCode, Json<Value>), ApiError> {
    super::check_agent(&req.from)?;
    super::check_reader(&state, &req.from).await?;
    let st = state.clone();
    // The parent is part of what the key protects: the same key and body for another parent
    // is another request (409).
    let mut keyed = parent.as_bytes().to_vec();
    keyed.push(0);
    keyed.extend_from_slice(&body);
    let answer = idempotent(
        &state,
        &headers,
        "/v1/messages/{id}/reply",
        format!("send:{}", req.from),
        &keyed,
        StatusCode::CREATED,
        move |tx| {
            let host = st.ident.host.to_string();
            match send::reply_request(tx, &host, &parent, &req) {
                Ok(send_req) => send_in(&st, tx, &send_req),
                Err(e) => send_error(e).map(Err),
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
#[into_params(parameter_in = Query)]
pub struct ReadQuery {
    /// The reading agent.
    #[serde(rename = "as")]
    #[param(value_type = crate::vocab::AgentName)]
    pub as_agent: String,
}

/// Reads one message as an agent (marks the agent's copy read). The sender may read its own copy.
/// An `as` that is no agent of this host is 404 `UNKNOWN_AGENT`; a message the agent cannot
/// see is 404 `NOT_FOUND`.
#[utoipa::path(get, path = "/v1/messages/{id}", operation_id = "read_message", params(("id" = crate::vocab::MessageId, Path, description = "the message to read"), ReadQuery),
    responses((status = 200, body = messages::Message),
        (status = 404, description = "NOT_FOUND: `{id}` names no message delivered to or sent by this agent; UNKNOWN_AGENT: `as` is no agent of this host (the error names the closest agents)", body = super::ErrorBody)),
    security(("bearer" = [])))]
pub async fn get(
    State(state): State<SharedState>,
    id: Result<Path<String>, PathRejection>,
    ApiQuery(q): ApiQuery<ReadQuery>,
) -> Result<Json<messages::Message>, ApiError> {
    let Path(id) = id?;
    super::check_agent(&q.as_agent)?;
    super::check_reader(&state, &q.as_agent).await?;
    let (host, now) = (state.ident.host.to_string(), state.clock.now_ms());
    let msg = state
        .mailbox
        .run(move |c| messages::read(c, &q.as_agent, &host, &id, now))
        .await?;
    // A first read of mail from a peer queued a `read` receipt (schema triggers): send it now.
    state.wake.notify_one();
    Ok(Json(msg))
}

#[cfg(test)]
mod tests;
