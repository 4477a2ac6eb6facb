//! `GET /v1/events`: Server-Sent Events of new-mail hints for one agent (design issue 19 §1
//! "Events"), for scripts, editors and agents that cannot be pushed to over MCP.
//!
//! The stream begins with `event: open`, whose `id:` is the position it starts from and whose
//! `data:` is `{"cursor": <that position>}`, so a client that reconnects before any mail came
//! resumes from there too (nothing committed while it was away is missed). Then each event is
//! `event: mail`, `id: <inbox cursor>` and `data: <Hint JSON>`
//! ([`crate::mailbox::events::Hint`]: message id, sender address, thread, kind, needs_reply; no
//! subject, no body). The `id` is the delivery's position in the agent's inbox, so a client
//! that reconnects with `Last-Event-ID` (or `?after=`) gets every delivery after it, nothing
//! before it: what arrived while it was away, then what arrives live. Without either the
//! stream starts at the end (only mail committed after the request). A hint moves no cursor
//! and marks nothing read; a hint that was written to the stream (the server went on to the
//! next one) records the delivery `notified` when still new (spec §9: a live consumer took the
//! hint).
//!
//! New mail is learned from the store's one wake point ([`crate::mailbox::wake`]), never by
//! polling; between events a comment (`: keep-alive`) is written every
//! [`KEEP_ALIVE_S`] s so proxies and clients see the connection is alive. At most
//! [`crate::mailbox::wake::MAX_STREAMS`] streams are open at once (past it 503
//! `TOO_MANY_WAITERS` with `Retry-After`); they have their own share of the connection cap
//! ([`super::MAX_CONNECTIONS`]), so open streams never block ordinary calls, and they end at
//! once when the daemon shuts down (shutdown never waits for them).

use std::collections::VecDeque;
use std::convert::Infallible;
use std::time::Duration;

use axum::extract::State;
use axum::http::HeaderMap;
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::IntoResponse;
use serde::Deserialize;
use tokio::sync::{watch, OwnedSemaphorePermit};

use crate::mailbox::events::{self, Hint, MAX_HINTS};
use crate::mailbox::messages;

use super::{ApiError, ApiQuery, SharedState};

/// Seconds between two keep-alive comments on an idle stream.
pub const KEEP_ALIVE_S: u64 = 15;

/// Query of `GET /v1/events`.
#[derive(Debug, Deserialize, utoipa::IntoParams)]
#[serde(deny_unknown_fields)]
#[into_params(parameter_in = Query)]
pub struct EventsQuery {
    /// The agent whose new mail to hint.
    #[serde(rename = "as")]
    #[param(value_type = crate::vocab::AgentName)]
    pub as_agent: String,
    /// Resume after this position: an event `id` of this agent's stream (an inbox cursor,
    /// `<agent>.<seq>`). `Last-Event-ID` wins when both are given; empty or absent with no
    /// `Last-Event-ID`: only mail committed after the request. Another agent's cursor is 400.
    #[param(pattern = "^([a-z0-9][a-z0-9-]{1,39}\\.[0-9]{1,18})?$")]
    pub after: Option<String>,
}

/// A stream of new-mail hints for an agent (see the module docs).
#[utoipa::path(get, path = "/v1/events", operation_id = "stream_events", params(EventsQuery,
        ("Last-Event-ID" = Option<String>, Header, description = "Resume after this event id (an inbox cursor of this agent; sent by SSE clients when they reconnect)", pattern = "^([a-z0-9][a-z0-9-]{1,39}\\.[0-9]{1,18})?$")),
    responses((status = 200, description = "`text/event-stream`: first `event: open` with `id:` and `data: {\"cursor\"}` the start position, then `event: mail` with `id: <inbox cursor>` and `data: <Hint JSON>` for each delivery after the start position, oldest first, then live; `: keep-alive` comments every 15 s. It ends when the daemon shuts down.", content_type = "text/event-stream", body = Hint),
        (status = 400, description = "BAD_REQUEST: bad `after` or `Last-Event-ID`, or one of another agent", body = super::ErrorBody),
        (status = 404, description = "UNKNOWN_AGENT: `as` is no agent of this host; the error names the closest agents", body = super::ErrorBody),
        (status = 503, description = "TOO_MANY_WAITERS: 64 event streams are open already; try again after `Retry-After` seconds. STORE_BUSY: see the shared answer", body = super::ErrorBody,
            headers(("Retry-After" = u32, description = "seconds to wait before a retry")))),
    security(("bearer" = [])))]
pub async fn get(
    State(state): State<SharedState>,
    headers: HeaderMap,
    ApiQuery(q): ApiQuery<EventsQuery>,
) -> Result<axum::response::Response, ApiError> {
    super::check_agent(&q.as_agent)?;
    let last = match headers.get("last-event-id") {
        None => None,
        Some(v) => Some(
            v.to_str()
                .map_err(|_| {
                    ApiError::Invalid("Last-Event-ID must be an event id of this stream".into())
                })?
                .trim()
                .to_string(),
        ),
    };
    let agent = q.as_agent;
    let start = last.or(q.after).filter(|c| !c.is_empty());
    let after = match &start {
        Some(c) => Some(messages::parse_inbox_cursor(&agent, Some(c))?),
        None => None,
    };
    super::check_reader(&state, &agent).await?;
    let hub = state.mailbox.waits();
    let Some(slot) = hub.try_stream_slot() else {
        let why = format!(
            "{} event streams are open already: try again after Retry-After",
            crate::mailbox::wake::MAX_STREAMS
        );
        tracing::info!("{why}");
        return Err(ApiError::TooManyWaiters(why));
    };
    // Subscribe before reading the start: a delivery committed after it is seen.
    let arrived = hub.subscribe(&agent);
    let closed = hub.closed();
    let pos = match after {
        Some(seq) => seq,
        None => {
            let who = agent.clone();
            state.mailbox.run(move |c| events::end_of(c, &who)).await?
        }
    };
    tracing::debug!(agent = %agent, "an event stream is open");
    let stream = Stream {
        state,
        agent,
        pos,
        arrived,
        closed,
        queue: VecDeque::new(),
        written: Vec::new(),
        opened: false,
        _slot: slot,
    };
    let events = futures_util::stream::unfold(stream, Stream::next);
    let sse = Sse::new(events).keep_alive(
        KeepAlive::new()
            .interval(Duration::from_secs(KEEP_ALIVE_S))
            .text("keep-alive"),
    );
    Ok(sse.into_response())
}

/// One open stream: where it is, what it waits on, and what it wrote.
struct Stream {
    state: SharedState,
    agent: String,
    /// The `seq` of the last delivery hinted (or the start position).
    pos: i64,
    arrived: watch::Receiver<i64>,
    closed: watch::Receiver<bool>,
    /// Hints read and not yet written.
    queue: VecDeque<(i64, Hint)>,
    /// Ids of hints handed to the connection since the last mark.
    written: Vec<String>,
    /// The `open` event was handed out.
    opened: bool,
    /// This stream's permit ([`crate::mailbox::wake::MAX_STREAMS`]).
    _slot: OwnedSemaphorePermit,
}

impl Stream {
    /// The next event, or `None` to end the stream (daemon shutdown, or the store failed).
    async fn next(mut self) -> Option<(Result<Event, Infallible>, Stream)> {
        // The server asks for the next event once it took the previous ones.
        self.mark_written().await;
        if !self.opened {
            self.opened = true;
            let cursor = messages::inbox_cursor(&self.agent, self.pos);
            let event = Event::default()
                .event("open")
                .id(cursor.clone())
                .data(serde_json::json!({ "cursor": cursor }).to_string());
            return Some((Ok(event), self));
        }
        loop {
            if *self.closed.borrow() {
                return None;
            }
            if let Some((seq, hint)) = self.queue.pop_front() {
                self.pos = seq;
                self.written.push(hint.id.clone());
                let event = Event::default()
                    .event("mail")
                    .id(hint.cursor.clone())
                    .json_data(&hint)
                    .unwrap_or_else(|_| Event::default().comment("unencodable hint"));
                return Some((Ok(event), self));
            }
            let (agent, after) = (self.agent.clone(), self.pos);
            match self
                .state
                .mailbox
                .run(move |c| events::hints_after(c, &agent, after, MAX_HINTS))
                .await
            {
                Ok(rows) if !rows.is_empty() => {
                    self.queue.extend(rows);
                    continue;
                }
                Ok(_) => {}
                Err(e) => {
                    tracing::warn!(error = %e, "event stream ends: cannot read new deliveries");
                    return None;
                }
            }
            tokio::select! {
                changed = self.arrived.changed() => {
                    if changed.is_err() {
                        return None;
                    }
                }
                _ = self.closed.changed() => return None,
            }
        }
    }

    /// Records `notified` for the hints written since the last call (logged, never fatal).
    async fn mark_written(&mut self) {
        if self.written.is_empty() {
            return;
        }
        let ids = std::mem::take(&mut self.written);
        let (agent, now) = (self.agent.clone(), self.state.clock.now_ms());
        let marked = self
            .state
            .mailbox
            .run(move |c| {
                let tx = c.transaction()?;
                messages::mark_notified(&tx, &agent, &ids, now)?;
                tx.commit()?;
                Ok(())
            })
            .await;
        if let Err(e) = marked {
            tracing::warn!(error = %e, "cannot record hinted mail notified");
        }
    }
}

#[cfg(test)]
mod tests;
