//! New-mail hints for event streams (`GET /v1/events`, design issue 19 §1 "Events").
//!
//! A hint says that a delivery exists and where it sits in the agent's inbox: its position (an
//! inbox cursor, [`super::messages::inbox_cursor`]), the message id, the sender address, the
//! thread, the kind and whether a reply is asked for. Never the subject or the body: a hint
//! reaches whatever listens on the stream, and reading the message stays an explicit call.
//!
//! This module only reads; it never changes a delivery (a hint moves no cursor and marks
//! nothing read). Recording `notified` for a hint written to a stream is the caller's
//! ([`super::messages::mark_notified`]).

use rusqlite::{params, Connection};
use serde::Serialize;

use super::messages::inbox_cursor;
use super::MailboxError;

/// Most hints read from the store at once.
pub const MAX_HINTS: u32 = 100;

/// One new-mail hint: what an event stream tells of a delivery.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, utoipa::ToSchema)]
pub struct Hint {
    /// The delivery's position in the agent's inbox: an inbox cursor (`<agent>.<seq>`), also
    /// the event's SSE `id`. Pass it as `Last-Event-ID` (or `after`) to resume after it, or as
    /// `cursor` to `GET /v1/inbox` to list what came after it.
    pub cursor: String,
    /// Message id (ULID).
    pub id: String,
    /// Sender address (`name@host`).
    pub from: String,
    /// Thread id (sender-chosen text unless it is a message id).
    pub thread: String,
    /// Message kind (`message`, `request`, `task`, `decision`, `alert`, `status`, ...).
    pub kind: String,
    /// Whether the sender asks for a reply.
    pub needs_reply: bool,
}

/// The hints of `agent`'s deliveries after position `after` (a delivery `seq`; 0: from the
/// first), oldest first, at most `limit` (clamped to 1..=[`MAX_HINTS`]), whatever their
/// state (a message read or acked in the meantime is still hinted once: the stream tells of
/// arrivals, not of what is unread). Returns each hint with its `seq`.
pub fn hints_after(
    conn: &Connection,
    agent: &str,
    after: i64,
    limit: u32,
) -> Result<Vec<(i64, Hint)>, MailboxError> {
    let mut st = conn.prepare_cached(
        "SELECT d.seq, m.id, m.from_addr, m.thread, m.kind,
                COALESCE(json_extract(m.envelope, '$.needs_reply') = 1, 0)
         FROM deliveries d JOIN messages m ON m.id = d.msg_id
         WHERE d.agent = ?1 AND d.seq > ?2
         ORDER BY d.seq LIMIT ?3",
    )?;
    let rows = st
        .query_map(params![agent, after, limit.clamp(1, MAX_HINTS)], |r| {
            let seq: i64 = r.get(0)?;
            Ok((
                seq,
                Hint {
                    cursor: inbox_cursor(agent, seq),
                    id: r.get(1)?,
                    from: r.get(2)?,
                    thread: r.get(3)?,
                    kind: r.get(4)?,
                    needs_reply: r.get(5)?,
                },
            ))
        })?
        .collect::<Result<Vec<_>, _>>()?;
    Ok(rows)
}

/// The position after `agent`'s newest delivery (its highest `seq`, 0 when it has none): a
/// stream that starts here hints only mail committed later.
pub fn end_of(conn: &Connection, agent: &str) -> Result<i64, MailboxError> {
    Ok(conn.query_row(
        "SELECT COALESCE(MAX(seq), 0) FROM deliveries WHERE agent = ?1",
        [agent],
        |r| r.get(0),
    )?)
}
