//! Messages and per-agent deliveries: where a message is stored once (the messages table is the
//! receive dedup set, `wire.md` "Resolved details") and how agents page, read and ack it.

use rusqlite::{params, Connection, OptionalExtension};
use serde::Serialize;
use serde_json::Value;

use agentmbx_protocol::limits::utf16_len;

use super::MailboxError;

/// Longest receipt note (UTF-16 code units, `wire.md` §2.11): the T218 bound 0.5.x peers
/// enforce when they check a receipt. An ack note is held to it at the door ([`check_note`])
/// and cut to it in the receipt (`super::receipts::record`).
pub const MAX_NOTE: usize = 500;

/// Checks an ack note against [`MAX_NOTE`], in the receipt's unit (UTF-16 code units, as
/// JavaScript counts: an emoji is two). Errors: [`MailboxError::Invalid`] naming the note's
/// length and the limit in that unit.
pub fn check_note(note: &str) -> Result<(), MailboxError> {
    let units = utf16_len(note);
    if units > MAX_NOTE {
        return Err(MailboxError::Invalid(format!(
            "note is {units} UTF-16 code units; the limit is {MAX_NOTE}"
        )));
    }
    Ok(())
}

/// Largest inbox page (count).
pub const MAX_INBOX_LIMIT: u32 = 200;
/// Default inbox page (count).
pub const DEFAULT_INBOX_LIMIT: u32 = 50;
/// Byte budget of one inbox page (sum of summary JSON sizes); a page always holds ≥1 entry.
pub const MAX_INBOX_BYTES: usize = 256 * 1024;

/// A message as stored: the plaintext envelope (which still verifies, `wire.md` §2.3) and where
/// it came from (`local` or the peer host name).
#[derive(Debug, Clone, PartialEq, Serialize, utoipa::ToSchema)]
pub struct Message {
    /// Envelope id (ULID).
    pub id: String,
    /// ISO ms send time.
    pub ts: String,
    /// `name@host` of the sender.
    pub from: String,
    /// Recipients as addressed.
    pub to: Vec<String>,
    /// Thread id.
    pub thread: String,
    /// Message replied to.
    pub reply_to: Option<String>,
    /// Kind.
    #[schema(value_type = crate::vocab::Kind)]
    pub kind: String,
    /// Subject.
    pub subject: String,
    /// Plain body.
    pub body: String,
    /// Whether a reply is expected.
    pub needs_reply: bool,
    /// References.
    pub refs: Vec<String>,
    /// `local` or the sending peer's host name.
    pub origin: String,
    /// This agent's delivery state: `new`, `read` or `acked` (null for the sender's copy).
    #[schema(value_type = Option<crate::vocab::DeliveryState>)]
    pub state: Option<String>,
}

/// One inbox line (no body).
#[derive(Debug, Clone, PartialEq, Serialize, utoipa::ToSchema)]
pub struct InboxEntry {
    /// Envelope id.
    pub id: String,
    /// ISO ms send time.
    pub ts: String,
    /// Sender.
    pub from: String,
    /// Subject.
    pub subject: String,
    /// Kind.
    #[schema(value_type = crate::vocab::Kind)]
    pub kind: String,
    /// Thread id.
    pub thread: String,
    /// Whether a reply is expected.
    pub needs_reply: bool,
    /// The message this one replies to, if any.
    pub reply_to: Option<String>,
    /// `new`, `read` or `acked`.
    #[schema(value_type = crate::vocab::DeliveryState)]
    pub state: String,
}

/// Which inbox entries to list (`GET /v1/inbox` query, `inbox` flags as 0.5.x).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct InboxFilter {
    /// Include acked messages.
    pub include_acked: bool,
    /// Only messages that ask for a reply.
    pub needs_reply: bool,
    /// Only messages from this sender: `name@host` exactly, or a bare `name` from any host.
    pub from: Option<String>,
}

/// An inbox page.
#[derive(Debug, Clone, PartialEq, Serialize, utoipa::ToSchema)]
pub struct InboxPage {
    /// Entries, oldest first.
    pub messages: Vec<InboxEntry>,
    /// Opaque cursor for the next page; absent when this page reached the end.
    #[schema(pattern = "^[a-z0-9][a-z0-9-]{1,39}\\.[0-9]{1,18}$")]
    pub next_cursor: Option<String>,
    /// Opaque position after this page, always present: passed back as `cursor`, it lists
    /// only what comes after this page, including mail that arrives later (what a waiter
    /// passes with `wait`). Scoped to this agent: another agent's cursor is refused.
    #[schema(pattern = "^[a-z0-9][a-z0-9-]{1,39}\\.[0-9]{1,18}$")]
    pub cursor: String,
}

/// The inbox cursor of `agent` at delivery position `seq`: `<agent>.<seq>` (agent names hold
/// no `.`). Opaque to clients; bound to the agent so it is refused for another one.
pub fn inbox_cursor(agent: &str, seq: i64) -> String {
    format!("{agent}.{seq}")
}

/// Reads an inbox cursor for `agent` ([`inbox_cursor`]): the delivery position, 0 for `None`
/// or `""`. [`MailboxError::Invalid`] for a malformed cursor or one minted for another agent.
pub fn parse_inbox_cursor(agent: &str, cursor: Option<&str>) -> Result<i64, MailboxError> {
    let Some(c) = cursor.filter(|c| !c.is_empty()) else {
        return Ok(0);
    };
    let (owner, seq) = c.rsplit_once('.').ok_or_else(|| {
        MailboxError::Invalid(format!(
            "bad cursor {c:?}: pass back a cursor an inbox answer gave"
        ))
    })?;
    let seq: i64 = seq
        .parse()
        .ok()
        .filter(|s: &i64| *s >= 0 && seq.bytes().all(|b| b.is_ascii_digit()))
        .ok_or_else(|| {
            MailboxError::Invalid(format!(
                "bad cursor {c:?}: pass back a cursor an inbox answer gave"
            ))
        })?;
    if owner != agent {
        return Err(MailboxError::Invalid(format!(
            "cursor {c:?} belongs to another agent's inbox, not {agent}'s"
        )));
    }
    Ok(seq)
}

/// Stores a plaintext envelope once. Returns false when the id is already stored (dedup).
pub fn insert(
    conn: &Connection,
    env: &Value,
    origin: &str,
    now_ms: i64,
) -> Result<bool, MailboxError> {
    let s = |k: &str| {
        env.get(k)
            .and_then(Value::as_str)
            .unwrap_or_default()
            .to_string()
    };
    // Fires trigger `messages_search_insert` (schema.rs): indexes subject and body for search.
    let n = conn.execute(
        "INSERT OR IGNORE INTO messages(id, ts, from_addr, thread, reply_to, kind, subject, body, envelope, origin, received_at)
         VALUES (?1,?2,?3,?4,?5,?6,?7,?8,?9,?10,?11)",
        params![
            s("id"),
            s("ts"),
            s("from"),
            s("thread"),
            env.get("reply_to").and_then(Value::as_str),
            s("kind"),
            s("subject"),
            s("body"),
            env.to_string(),
            origin,
            now_ms
        ],
    )?;
    Ok(n == 1)
}

/// True when a message with this id is stored.
pub fn exists(conn: &Connection, id: &str) -> Result<bool, MailboxError> {
    Ok(conn
        .query_row("SELECT 1 FROM messages WHERE id = ?1", [id], |_| Ok(()))
        .optional()?
        .is_some())
}

/// Where the stored message `id` came from (`local` or the peer host name), if stored.
pub fn origin_of(conn: &Connection, id: &str) -> Result<Option<String>, MailboxError> {
    Ok(conn
        .query_row("SELECT origin FROM messages WHERE id = ?1", [id], |r| {
            r.get(0)
        })
        .optional()?)
}

/// Adds a `new` delivery of `msg_id` to `agent` (idempotent).
pub fn deliver(
    conn: &Connection,
    msg_id: &str,
    agent: &str,
    now_ms: i64,
) -> Result<(), MailboxError> {
    // Fires triggers (schema.rs) `deliveries_receipt_insert`: queues a `delivered` receipt to the
    // origin of mail from a peer; `deliveries_hook_inbox`: queues the delivery for the hooks.
    conn.execute(
        "INSERT OR IGNORE INTO deliveries(msg_id, agent, state, updated_at) VALUES (?1, ?2, 'new', ?3)",
        params![msg_id, agent, now_ms],
    )?;
    Ok(())
}

/// A page of `agent`'s inbox after `cursor`, bounded by `limit` (1..=200) and
/// [`MAX_INBOX_BYTES`], holding the entries `filter` selects, with the position after it
/// (`cursor`: the last entry's, or when the page reached the end, the agent's newest delivery
/// at the time of the read, so what is committed later comes after it). A bad cursor, or one
/// of another agent, is [`MailboxError::Invalid`] ([`parse_inbox_cursor`]).
pub fn inbox(
    conn: &Connection,
    agent: &str,
    cursor: Option<&str>,
    limit: u32,
    filter: &InboxFilter,
) -> Result<InboxPage, MailboxError> {
    let after = parse_inbox_cursor(agent, cursor)?;
    // Read the newest position first and list only up to it: a delivery committed between the
    // two reads has a higher seq, so it comes after the position this page hands out.
    let top: i64 = conn.query_row(
        "SELECT COALESCE(MAX(seq), 0) FROM deliveries WHERE agent = ?1",
        [agent],
        |r| r.get(0),
    )?;
    let limit = limit.clamp(1, MAX_INBOX_LIMIT);
    let mut st = conn.prepare(
        "SELECT d.seq, m.id, m.ts, m.from_addr, m.subject, m.kind, m.thread, m.envelope, d.state, m.reply_to
         FROM deliveries d JOIN messages m ON m.id = d.msg_id
         WHERE d.agent = ?1 AND d.seq > ?2 AND d.seq <= ?7 AND (?3 OR d.state != 'acked')
           AND (NOT ?5 OR json_extract(m.envelope, '$.needs_reply') = 1)
           AND (?6 IS NULL OR m.from_addr = ?6 OR substr(m.from_addr, 1, length(?6) + 1) = ?6 || '@')
         ORDER BY d.seq LIMIT ?4",
    )?;
    let rows = st
        .query_map(
            params![
                agent,
                after,
                filter.include_acked,
                limit + 1,
                filter.needs_reply,
                filter.from,
                top
            ],
            |r| {
                let env: String = r.get(7)?;
                let needs_reply = serde_json::from_str::<Value>(&env)
                    .ok()
                    .and_then(|v| v.get("needs_reply").and_then(Value::as_bool))
                    .unwrap_or(false);
                Ok((
                    r.get::<_, i64>(0)?,
                    InboxEntry {
                        id: r.get(1)?,
                        ts: r.get(2)?,
                        from: r.get(3)?,
                        subject: r.get(4)?,
                        kind: r.get(5)?,
                        thread: r.get(6)?,
                        needs_reply,
                        reply_to: r.get(9)?,
                        state: r.get(8)?,
                    },
                ))
            },
        )?
        .collect::<Result<Vec<_>, _>>()?;
    let mut messages = Vec::new();
    let mut bytes = 0usize;
    let mut last_seq = after;
    let mut cut = false;
    for (i, (seq, entry)) in rows.iter().enumerate() {
        let size = serde_json::to_string(entry).map_or(0, |s| s.len());
        if i as u32 >= limit || (!messages.is_empty() && bytes + size > MAX_INBOX_BYTES) {
            cut = true;
            break;
        }
        bytes += size;
        last_seq = *seq;
        messages.push(entry.clone());
    }
    let position = if cut { last_seq } else { top.max(after) };
    Ok(InboxPage {
        messages,
        next_cursor: cut.then(|| inbox_cursor(agent, last_seq)),
        cursor: inbox_cursor(agent, position),
    })
}

/// Records that a live consumer took `ids` (a long poll returned them to `agent`): each
/// delivery still `new` and not yet notified gets `notified_at` = `now_ms`, which queues a
/// `notified` receipt for mail from a peer (spec §9; the trigger of schema version 7). Read,
/// acked and already notified deliveries are left alone. Returns how many were marked.
pub fn mark_notified(
    conn: &Connection,
    agent: &str,
    ids: &[String],
    now_ms: i64,
) -> Result<usize, MailboxError> {
    // Fires trigger `deliveries_receipt_notified` (schema.rs): queues a `notified` receipt to the
    // origin of mail from a peer.
    let mut st = conn.prepare_cached(
        "UPDATE deliveries SET notified_at = ?3
         WHERE msg_id = ?1 AND agent = ?2 AND state = 'new' AND notified_at IS NULL",
    )?;
    let mut n = 0;
    for id in ids {
        n += st.execute(params![id, agent, now_ms])?;
    }
    Ok(n)
}

pub(super) fn message_from_row(env: &str, origin: String, state: Option<String>) -> Message {
    let v: Value = serde_json::from_str(env).unwrap_or(Value::Null);
    let s = |k: &str| {
        v.get(k)
            .and_then(Value::as_str)
            .unwrap_or_default()
            .to_string()
    };
    let list = |k: &str| {
        v.get(k)
            .and_then(Value::as_array)
            .map(|a| {
                a.iter()
                    .filter_map(Value::as_str)
                    .map(String::from)
                    .collect()
            })
            .unwrap_or_default()
    };
    Message {
        id: s("id"),
        ts: s("ts"),
        from: s("from"),
        to: list("to"),
        thread: s("thread"),
        reply_to: v.get("reply_to").and_then(Value::as_str).map(String::from),
        kind: s("kind"),
        subject: s("subject"),
        body: s("body"),
        needs_reply: v
            .get("needs_reply")
            .and_then(Value::as_bool)
            .unwrap_or(false),
        refs: list("refs"),
        origin,
        state,
    }
}

/// Reads message `id` as `agent`: the agent's delivery (marked `read` if it was `new`), or the
/// sender's own copy when `agent` sent it. [`MailboxError::NotFound`] otherwise.
pub fn read(
    conn: &Connection,
    agent: &str,
    own_host: &str,
    id: &str,
    now_ms: i64,
) -> Result<Message, MailboxError> {
    let row: Option<(String, String, String)> = conn
        .query_row(
            "SELECT envelope, origin, from_addr FROM messages WHERE id = ?1",
            [id],
            |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)),
        )
        .optional()?;
    let Some((env, origin, from)) = row else {
        return Err(MailboxError::NotFound(format!("no message {id}")));
    };
    let state: Option<String> = conn
        .query_row(
            "SELECT state FROM deliveries WHERE msg_id = ?1 AND agent = ?2",
            params![id, agent],
            |r| r.get(0),
        )
        .optional()?;
    match state {
        Some(st) => {
            if st == "new" {
                // Fires trigger `deliveries_receipt_update` (schema.rs): queues a `read`
                // receipt to the origin of mail from a peer.
                conn.execute(
                    "UPDATE deliveries SET state = 'read', updated_at = ?3 WHERE msg_id = ?1 AND agent = ?2 AND state = 'new'",
                    params![id, agent, now_ms],
                )?;
            }
            let st = if st == "new" { "read".to_string() } else { st };
            Ok(message_from_row(&env, origin, Some(st)))
        }
        None if from == format!("{agent}@{own_host}") => Ok(message_from_row(&env, origin, None)),
        None => Err(MailboxError::NotFound(format!(
            "no message {id} for {agent}"
        ))),
    }
}

/// What a reply needs from the message it answers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Parent {
    /// The parent's id.
    pub id: String,
    /// Its thread (the reply's thread).
    pub thread: String,
    /// `name@host` of its sender (whom `reply` addresses).
    pub from: String,
    /// Its subject (`reply` answers `Re: <subject>`).
    pub subject: String,
    /// Its addresses as its sender wrote them (a reply to one's own message goes to them).
    pub to: Vec<String>,
}

/// SQL condition: message `m` is visible to agent `?1` (delivered to it, or sent by it: `?2` is
/// `agent@own_host`).
pub(super) const VISIBLE: &str = "(m.from_addr = ?2 OR EXISTS (SELECT 1 FROM deliveries d WHERE d.msg_id = m.id AND d.agent = ?1))";

/// The message `id` as a parent of a reply by `agent`: it must be visible to the agent
/// (delivered to it, or its own sent message). [`MailboxError::NotFound`] otherwise, with the
/// same text whether it does not exist or is someone else's (no probing of other mailboxes).
pub fn parent(
    conn: &Connection,
    agent: &str,
    own_host: &str,
    id: &str,
) -> Result<Parent, MailboxError> {
    let me = format!("{agent}@{own_host}");
    conn.query_row(
        &format!("SELECT m.id, m.thread, m.from_addr, m.subject, json_extract(m.envelope, '$.to') FROM messages m WHERE m.id = ?3 AND {VISIBLE}"),
        params![agent, me, id],
        |r| {
            let to: Option<String> = r.get(4)?;
            Ok(Parent {
                id: r.get(0)?,
                thread: r.get(1)?,
                from: r.get(2)?,
                subject: r.get(3)?,
                to: to
                    .and_then(|t| serde_json::from_str(&t).ok())
                    .unwrap_or_default(),
            })
        },
    )
    .optional()?
    .ok_or_else(|| MailboxError::NotFound(format!("no message {id} for {agent}")))
}

/// Largest thread page (count).
pub const MAX_THREAD_LIMIT: u32 = 200;
/// Default thread page (count).
pub const DEFAULT_THREAD_LIMIT: u32 = 50;
/// Byte budget of one thread page (sum of message JSON sizes, bodies included); a page always
/// holds ≥1 message.
pub const MAX_THREAD_BYTES: usize = 256 * 1024;

/// A page of a thread.
#[derive(Debug, Clone, PartialEq, Serialize, utoipa::ToSchema)]
pub struct ThreadPage {
    /// The thread id.
    pub thread: String,
    /// The thread's messages this agent can see, oldest first (send time, then id), with
    /// bodies; `state` is the agent's delivery state (absent on its own sent messages).
    /// Listing marks nothing read.
    pub messages: Vec<Message>,
    /// Opaque cursor for the next page; absent when this page reached the end.
    pub next_cursor: Option<String>,
}

/// A page of the thread of `id` as `agent` sees it: `id` is a message id the agent can see (its
/// thread is listed) or a thread id of which the agent can see a message. Messages of the
/// thread the agent cannot see (another mailbox's) are left out. Bounded by `limit`
/// (1..=[`MAX_THREAD_LIMIT`]) and [`MAX_THREAD_BYTES`]; `cursor` is a previous page's
/// `next_cursor`. Errors: [`MailboxError::NotFound`] when the agent sees nothing of it,
/// [`MailboxError::Invalid`] for a bad cursor. Reads only.
pub fn thread(
    conn: &Connection,
    agent: &str,
    own_host: &str,
    id: &str,
    cursor: Option<&str>,
    limit: u32,
) -> Result<ThreadPage, MailboxError> {
    let me = format!("{agent}@{own_host}");
    let by_message: Option<String> = conn
        .query_row(
            &format!("SELECT m.thread FROM messages m WHERE m.id = ?3 AND {VISIBLE}"),
            params![agent, me, id],
            |r| r.get(0),
        )
        .optional()?;
    let thread = match by_message {
        Some(t) => t,
        None => conn
            .query_row(
                &format!(
                    "SELECT m.thread FROM messages m WHERE m.thread = ?3 AND {VISIBLE} LIMIT 1"
                ),
                params![agent, me, id],
                |r| r.get(0),
            )
            .optional()?
            .ok_or_else(|| {
                MailboxError::NotFound(format!("no message or thread {id} for {agent}"))
            })?,
    };
    // The cursor is the last listed message's id; it must be a message of this thread.
    let (after_ts, after_id) = match cursor {
        None | Some("") => (String::new(), String::new()),
        Some(c) => conn
            .query_row(
                "SELECT ts, id FROM messages WHERE id = ?1 AND thread = ?2",
                params![c, thread],
                |r| Ok((r.get(0)?, r.get(1)?)),
            )
            .optional()?
            .ok_or_else(|| MailboxError::Invalid("bad cursor".into()))?,
    };
    let limit = limit.clamp(1, MAX_THREAD_LIMIT);
    let mut st = conn.prepare(&format!(
        "SELECT m.id, m.envelope, m.origin,
                (SELECT d.state FROM deliveries d WHERE d.msg_id = m.id AND d.agent = ?1)
         FROM messages m
         WHERE m.thread = ?3 AND {VISIBLE} AND (m.ts, m.id) > (?4, ?5)
         ORDER BY m.ts, m.id LIMIT ?6"
    ))?;
    let rows = st
        .query_map(
            params![agent, me, thread, after_ts, after_id, limit + 1],
            |r| {
                let env: String = r.get(1)?;
                Ok((
                    r.get::<_, String>(0)?,
                    message_from_row(&env, r.get(2)?, r.get(3)?),
                ))
            },
        )?
        .collect::<Result<Vec<_>, _>>()?;
    let mut messages = Vec::new();
    let mut bytes = 0usize;
    let mut cut = false;
    for (i, (_, msg)) in rows.iter().enumerate() {
        let size = serde_json::to_string(msg).map_or(0, |s| s.len());
        if i as u32 >= limit || (!messages.is_empty() && bytes + size > MAX_THREAD_BYTES) {
            cut = true;
            break;
        }
        bytes += size;
        messages.push(msg.clone());
    }
    let next_cursor = if cut {
        messages.last().map(|m: &Message| m.id.clone())
    } else {
        None
    };
    Ok(ThreadPage {
        thread,
        messages,
        next_cursor,
    })
}

/// Acks `ids` for `agent` (mailbox ack, never a transport ack). Returns how many changed state;
/// an id not delivered to the agent is [`MailboxError::NotFound`] and a note over the receipt's
/// limit ([`check_note`]) is [`MailboxError::Invalid`]; either changes nothing.
/// Runs inside the caller's transaction (all or nothing).
pub fn ack(
    tx: &Connection,
    agent: &str,
    ids: &[String],
    note: Option<&str>,
    now_ms: i64,
) -> Result<u64, MailboxError> {
    if let Some(note) = note {
        check_note(note)?;
    }
    let mut changed = 0;
    for id in ids {
        let state: Option<String> = tx
            .query_row(
                "SELECT state FROM deliveries WHERE msg_id = ?1 AND agent = ?2",
                params![id, agent],
                |r| r.get(0),
            )
            .optional()?;
        match state {
            None => {
                return Err(MailboxError::NotFound(format!(
                    "no message {id} for {agent}"
                )))
            }
            Some(s) if s == "acked" => {}
            Some(_) => {
                // Fires trigger `deliveries_receipt_update` (schema.rs): queues an `acked`
                // receipt (with the note) to the origin of mail from a peer.
                tx.execute(
                    "UPDATE deliveries SET state = 'acked', note = ?3, updated_at = ?4 WHERE msg_id = ?1 AND agent = ?2",
                    params![id, agent, note, now_ms],
                )?;
                changed += 1;
            }
        }
    }
    Ok(changed)
}
