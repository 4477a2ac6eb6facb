//! History pages with bodies (`GET /v1/replay`) and catchup from a stored per-agent position
//! (`GET /v1/catchup`, `POST /v1/catchup/commit`, `POST /v1/catchup/restart`): 0.5.x's
//! `mbx_replay` and `mbx_catchup` (agent-surface.md).
//!
//! Both list an agent's deliveries (what was delivered to it, whatever its state) in delivery
//! order, oldest first, with bodies, and mark nothing read or notified. Positions are the
//! agent's delivery sequence numbers, handed out as the inbox's cursors
//! ([`messages::inbox_cursor`]: opaque, bound to the agent). The catchup position lives in
//! the `catchup` table (schema version 8): one row per agent, moved forward only by a commit,
//! set by a restart.

use rusqlite::{params, Connection, OptionalExtension};
use serde::Serialize;

use super::messages::{self, Message};
use super::MailboxError;

/// Largest history page (count).
pub const MAX_LIMIT: u32 = 200;
/// Default history page (count).
pub const DEFAULT_LIMIT: u32 = 50;
/// Smallest `max_bytes` of a history page.
pub const MIN_MAX_BYTES: usize = 2048;
/// Largest `max_bytes` of a history page (256 KiB).
pub const MAX_MAX_BYTES: usize = 256 * 1024;
/// Default `max_bytes` of a history page (64 KiB).
pub const DEFAULT_MAX_BYTES: usize = 64 * 1024;

/// A page of an agent's history (replay or catchup).
#[derive(Debug, Clone, PartialEq, Serialize, utoipa::ToSchema)]
pub struct HistoryPage {
    /// Messages delivered to the agent, oldest first (delivery order), with bodies; `state`
    /// is the agent's delivery state, which listing does not change.
    pub messages: Vec<Message>,
    /// Opaque cursor for the next page; absent when this page reached the end.
    #[schema(pattern = "^[a-z0-9][a-z0-9-]{1,39}\\.[0-9]{1,18}$")]
    pub next_cursor: Option<String>,
    /// True when more messages come after this page (then `next_cursor` is set).
    pub has_more: bool,
    /// Opaque position after this page, always present (what `POST /v1/catchup/commit`
    /// takes; as `cursor`, it lists only what comes after this page, mail arriving later
    /// included). Scoped to this agent.
    #[schema(pattern = "^[a-z0-9][a-z0-9-]{1,39}\\.[0-9]{1,18}$")]
    pub cursor: String,
}

/// The agent's newest delivery position (0: none).
pub fn top(conn: &Connection, agent: &str) -> Result<i64, MailboxError> {
    Ok(conn.query_row(
        "SELECT COALESCE(MAX(seq), 0) FROM deliveries WHERE agent = ?1",
        [agent],
        |r| r.get(0),
    )?)
}

/// A page of `agent`'s deliveries after position `after`, in the thread `thread` when given,
/// bounded by `limit` (clamped to 1..=[`MAX_LIMIT`]) messages and by `max_bytes` (the sum of
/// the messages' JSON sizes, bodies included; clamped to
/// [`MIN_MAX_BYTES`]..=[`MAX_MAX_BYTES`]). A page always holds at least one message when one
/// follows, even one alone over `max_bytes`. Reads only.
pub fn page(
    conn: &Connection,
    agent: &str,
    after: i64,
    limit: u32,
    max_bytes: usize,
    thread: Option<&str>,
) -> Result<HistoryPage, MailboxError> {
    // As the inbox: read the newest position first and list only up to it, so a delivery
    // committed between the two reads comes after the position this page hands out.
    let top = top(conn, agent)?;
    let limit = limit.clamp(1, MAX_LIMIT);
    let max_bytes = max_bytes.clamp(MIN_MAX_BYTES, MAX_MAX_BYTES);
    let mut st = conn.prepare(
        "SELECT d.seq, m.envelope, m.origin, d.state
         FROM deliveries d JOIN messages m ON m.id = d.msg_id
         WHERE d.agent = ?1 AND d.seq > ?2 AND d.seq <= ?3 AND (?4 IS NULL OR m.thread = ?4)
         ORDER BY d.seq LIMIT ?5",
    )?;
    let rows = st
        .query_map(params![agent, after, top, thread, limit + 1], |r| {
            let env: String = r.get(1)?;
            Ok((
                r.get::<_, i64>(0)?,
                messages::message_from_row(&env, r.get(2)?, r.get(3)?),
            ))
        })?
        .collect::<Result<Vec<_>, _>>()?;
    let mut list = Vec::new();
    let mut bytes = 0usize;
    let mut last_seq = after;
    let mut cut = false;
    for (i, (seq, msg)) in rows.into_iter().enumerate() {
        let size = serde_json::to_string(&msg).map_or(0, |s| s.len());
        if i as u32 >= limit || (!list.is_empty() && bytes + size > max_bytes) {
            cut = true;
            break;
        }
        bytes += size;
        last_seq = seq;
        list.push(msg);
    }
    let position = if cut { last_seq } else { top.max(after) };
    Ok(HistoryPage {
        messages: list,
        next_cursor: cut.then(|| messages::inbox_cursor(agent, last_seq)),
        has_more: cut,
        cursor: messages::inbox_cursor(agent, position),
    })
}

/// The stored catchup position of `agent` (0: none stored, the beginning).
pub fn position(conn: &Connection, agent: &str) -> Result<i64, MailboxError> {
    Ok(conn
        .query_row("SELECT seq FROM catchup WHERE agent = ?1", [agent], |r| {
            r.get(0)
        })
        .optional()?
        .unwrap_or(0))
}

/// Moves `agent`'s catchup position forward to `seq` (never back: an older `seq` leaves it
/// where it is). Returns the stored position after it. A `seq` past the agent's newest
/// delivery is [`MailboxError::Invalid`] (no answer handed it out; storing it would hide
/// mail that has not arrived yet).
pub fn commit(conn: &Connection, agent: &str, seq: i64, now_ms: i64) -> Result<i64, MailboxError> {
    if seq > top(conn, agent)? {
        return Err(MailboxError::Invalid(format!(
            "cursor is past {agent}'s newest message: pass back the cursor of a catchup answer"
        )));
    }
    conn.execute(
        "INSERT INTO catchup(agent, seq, updated_at) VALUES (?1, ?2, ?3)
         ON CONFLICT(agent) DO UPDATE SET seq = excluded.seq, updated_at = excluded.updated_at
         WHERE excluded.seq > catchup.seq",
        params![agent, seq, now_ms],
    )?;
    position(conn, agent)
}

/// Where a catchup restarts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Deserialize, Serialize, utoipa::ToSchema)]
#[serde(rename_all = "lowercase")]
pub enum Restart {
    /// From the beginning: the next catchup lists everything delivered to the agent.
    All,
    /// From now: the next catchup lists only what arrives after this.
    Now,
}

/// Sets `agent`'s catchup position (the one way it moves back): to the beginning
/// ([`Restart::All`]) or to its newest delivery ([`Restart::Now`]). Returns it.
pub fn restart(
    conn: &Connection,
    agent: &str,
    to: Restart,
    now_ms: i64,
) -> Result<i64, MailboxError> {
    let seq = match to {
        Restart::All => 0,
        Restart::Now => top(conn, agent)?,
    };
    conn.execute(
        "INSERT INTO catchup(agent, seq, updated_at) VALUES (?1, ?2, ?3)
         ON CONFLICT(agent) DO UPDATE SET seq = excluded.seq, updated_at = excluded.updated_at",
        params![agent, seq, now_ms],
    )?;
    Ok(seq)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testutil::{self, T0};

    const IDS: [&str; 4] = [
        "01KDVDNA3VG2MH8KWSQRCWJZ01",
        "01KDVDNA3VG2MH8KWSQRCWJZ02",
        "01KDVDNA3VG2MH8KWSQRCWJZ03",
        "01KDVDNA3VG2MH8KWSQRCWJZ04",
    ];

    fn states(c: &Connection) -> Vec<String> {
        c.prepare("SELECT state FROM deliveries WHERE agent = 'bob' ORDER BY seq")
            .unwrap()
            .query_map([], |r| r.get(0))
            .unwrap()
            .collect::<Result<_, _>>()
            .unwrap()
    }

    #[test]
    fn pages_are_bounded_by_count_and_bytes_and_mark_nothing() {
        let store = testutil::store();
        let ident = testutil::identity("home");
        store.register("home", &["bob"]);
        for (i, id) in IDS.iter().enumerate() {
            store
                .send(&ident, "alice", &["bob"], "hi", id, T0 + i as i64)
                .unwrap();
        }
        store
            .mailbox
            .with(|c| {
                c.execute(
                    "UPDATE messages SET envelope = json_set(envelope, '$.body', ?1) WHERE id = ?2",
                    params!["x".repeat(5000), IDS[1]],
                )?;
                // Count: 2 per page.
                let p = page(c, "bob", 0, 2, DEFAULT_MAX_BYTES, None)?;
                assert_eq!(p.messages.len(), 2);
                assert!(p.has_more);
                assert_eq!(p.messages[1].body.len(), 5000);
                let after = messages::parse_inbox_cursor("bob", p.next_cursor.as_deref())?;
                let p2 = page(c, "bob", after, 2, DEFAULT_MAX_BYTES, None)?;
                assert_eq!(p2.messages.len(), 2);
                assert!(!p2.has_more && p2.next_cursor.is_none());
                // Bytes: the 5000-byte body alone is over 2048, yet a page holds it.
                let p = page(c, "bob", 0, 200, MIN_MAX_BYTES, None)?;
                assert_eq!(
                    p.messages.len(),
                    1,
                    "the first is small, the second does not fit"
                );
                let after = messages::parse_inbox_cursor("bob", p.next_cursor.as_deref())?;
                let p = page(c, "bob", after, 200, MIN_MAX_BYTES, None)?;
                assert_eq!(p.messages.len(), 1);
                assert_eq!(p.messages[0].id, IDS[1]);
                assert!(p.has_more);
                // The thread filter (each of these messages starts its own thread).
                let p = page(c, "bob", 0, 200, DEFAULT_MAX_BYTES, Some(IDS[2]))?;
                let ids: Vec<&str> = p.messages.iter().map(|m| m.id.as_str()).collect();
                assert_eq!(ids, vec![IDS[2]]);
                // Nothing marked read or notified.
                assert_eq!(states(c), vec!["new"; 4]);
                Ok(())
            })
            .unwrap();
    }

    #[test]
    fn catchup_position_moves_forward_only_and_restarts() {
        let store = testutil::store();
        let ident = testutil::identity("home");
        store.register("home", &["bob"]);
        for (i, id) in IDS.iter().enumerate() {
            store
                .send(&ident, "alice", &["bob"], "hi", id, T0 + i as i64)
                .unwrap();
        }
        store
            .mailbox
            .with(|c| {
                assert_eq!(position(c, "bob")?, 0);
                assert_eq!(commit(c, "bob", 3, T0)?, 3);
                assert_eq!(commit(c, "bob", 1, T0)?, 3, "never back");
                assert!(matches!(
                    commit(c, "bob", 99, T0),
                    Err(MailboxError::Invalid(_))
                ));
                assert_eq!(position(c, "bob")?, 3);
                assert_eq!(restart(c, "bob", Restart::All, T0)?, 0);
                assert_eq!(restart(c, "bob", Restart::Now, T0)?, 4);
                assert_eq!(position(c, "bob")?, 4);
                Ok(())
            })
            .unwrap();
    }
}
