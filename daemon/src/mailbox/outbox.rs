//! The outbox: one row per (message, target host). A row is `pending` until a verified relay
//! accept moves it to `relay-accepted` (spec §3 sender side); a rejection that retrying cannot
//! help moves it to `rejected` (design README "Rejections"); it is never deleted by a failure.
//!
//! The wire bytes are written once, before the first attempt, and reused byte for byte on every
//! retry ([`set_wire`] never overwrites).

use rusqlite::{params, Connection, OptionalExtension};
use serde::Serialize;

use super::MailboxError;

/// First retry delay (ms); the delay doubles per attempt.
pub const BACKOFF_BASE_MS: i64 = 5_000;
/// Longest retry delay (ms): one hour.
pub const BACKOFF_MAX_MS: i64 = 3_600_000;

/// Retry delay after `attempts` failed attempts: `min(5 s · 2^attempts, 1 h)` (ms).
pub fn backoff_ms(attempts: u32) -> i64 {
    BACKOFF_BASE_MS
        .saturating_mul(1i64 << attempts.min(20))
        .min(BACKOFF_MAX_MS)
}

/// An outbox row.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Row {
    /// Message id (= relay item id).
    pub msg_id: String,
    /// Target host name (peer handle).
    pub host: String,
    /// Pinned target host key.
    pub target_pubkey: String,
    /// `pending`, `relay-accepted`, `rejected` or `delivered`.
    pub state: String,
    /// Failed attempts so far.
    pub attempts: u32,
    /// Next attempt (ms).
    pub next_at: i64,
    /// Last failure.
    pub last_error: Option<String>,
    /// Persisted wire bytes (absent until first sealed).
    #[serde(skip)]
    pub wire: Option<Vec<u8>>,
    /// SHA-256 hex of `wire`.
    pub wire_hash: Option<String>,
    /// Relay seq once accepted.
    pub seq: Option<i64>,
    /// Relay epoch once accepted.
    pub epoch: Option<String>,
}

const COLS: &str = "msg_id, host, target_pubkey, state, attempts, next_at, last_error, wire, wire_hash, seq, epoch";

fn row(r: &rusqlite::Row<'_>) -> rusqlite::Result<Row> {
    Ok(Row {
        msg_id: r.get(0)?,
        host: r.get(1)?,
        target_pubkey: r.get(2)?,
        state: r.get(3)?,
        attempts: r.get(4)?,
        next_at: r.get(5)?,
        last_error: r.get(6)?,
        wire: r.get(7)?,
        wire_hash: r.get(8)?,
        seq: r.get(9)?,
        epoch: r.get(10)?,
    })
}

/// Adds a pending row due now (inside the send transaction).
pub fn enqueue(
    conn: &Connection,
    msg_id: &str,
    host: &str,
    target_pubkey: &str,
    now_ms: i64,
) -> Result<(), MailboxError> {
    conn.execute(
        "INSERT INTO outbox(msg_id, host, target_pubkey, state, next_at, created_at) VALUES (?1,?2,?3,'pending',?4,?4)",
        params![msg_id, host, target_pubkey, now_ms],
    )?;
    Ok(())
}

/// Pending rows due at `now_ms`, oldest first, at most `limit`.
pub fn due(conn: &Connection, now_ms: i64, limit: usize) -> Result<Vec<Row>, MailboxError> {
    let mut st = conn.prepare(&format!(
        "SELECT {COLS} FROM outbox WHERE state = 'pending' AND next_at <= ?1 ORDER BY next_at, created_at, msg_id LIMIT ?2"
    ))?;
    let rows = st
        .query_map(params![now_ms, limit as i64], row)?
        .collect::<Result<Vec<_>, _>>()?;
    Ok(rows)
}

/// The earliest `next_at` among pending rows (ms), for the sender loop's sleep.
pub fn next_due_at(conn: &Connection) -> Result<Option<i64>, MailboxError> {
    Ok(conn.query_row(
        "SELECT MIN(next_at) FROM outbox WHERE state = 'pending'",
        [],
        |r| r.get(0),
    )?)
}

/// One row.
pub fn get(conn: &Connection, msg_id: &str, host: &str) -> Result<Option<Row>, MailboxError> {
    Ok(conn
        .query_row(
            &format!("SELECT {COLS} FROM outbox WHERE msg_id = ?1 AND host = ?2"),
            params![msg_id, host],
            row,
        )
        .optional()?)
}

/// All rows of a message (the sender's per-recipient view).
pub fn for_message(conn: &Connection, msg_id: &str) -> Result<Vec<Row>, MailboxError> {
    let mut st = conn.prepare(&format!(
        "SELECT {COLS} FROM outbox WHERE msg_id = ?1 ORDER BY host"
    ))?;
    let rows = st
        .query_map([msg_id], row)?
        .collect::<Result<Vec<_>, _>>()?;
    Ok(rows)
}

/// Persists the wire bytes of a row once. Returns the bytes now stored: the given ones, or the
/// ones an earlier attempt already wrote (never overwritten, Decision 4).
pub fn set_wire(
    conn: &Connection,
    msg_id: &str,
    host: &str,
    wire: &[u8],
    wire_hash: &str,
) -> Result<Vec<u8>, MailboxError> {
    conn.execute(
        "UPDATE outbox SET wire = ?3, wire_hash = ?4 WHERE msg_id = ?1 AND host = ?2 AND wire IS NULL",
        params![msg_id, host, wire, wire_hash],
    )?;
    let stored: Option<Vec<u8>> = conn
        .query_row(
            "SELECT wire FROM outbox WHERE msg_id = ?1 AND host = ?2",
            params![msg_id, host],
            |r| r.get(0),
        )
        .optional()?
        .flatten();
    stored.ok_or_else(|| MailboxError::NotFound(format!("no outbox row {msg_id} → {host}")))
}

/// What a verified accept records on its row.
#[derive(Debug, Clone)]
pub struct Accepted<'a> {
    /// Relay URL.
    pub relay: &'a str,
    /// Epoch of the seq.
    pub epoch: &'a str,
    /// Seq for this row's target.
    pub seq: i64,
    /// The accept statement JSON.
    pub accept: &'a str,
    /// The relay's signature.
    pub sig: &'a str,
    /// Accept time (ms).
    pub accepted_at: i64,
    /// Sender deadline (ms): accepted_at + retention + 24 h.
    pub deadline_at: i64,
}

/// Moves a pending row to `relay-accepted`. Only called with an accept verified for this row's
/// target and wire hash.
pub fn settle_accepted(
    conn: &Connection,
    msg_id: &str,
    host: &str,
    a: &Accepted<'_>,
    now_ms: i64,
) -> Result<bool, MailboxError> {
    let n = conn.execute(
        "UPDATE outbox SET state = 'relay-accepted', relay = ?3, epoch = ?4, seq = ?5, accept = ?6, accept_sig = ?7,
           accepted_at = ?8, deadline_at = COALESCE(deadline_at, ?9), settled_at = ?10, last_error = NULL
         WHERE msg_id = ?1 AND host = ?2 AND state = 'pending'",
        params![msg_id, host, a.relay, a.epoch, a.seq, a.accept, a.sig, a.accepted_at, a.deadline_at, now_ms],
    )?;
    Ok(n == 1)
}

/// Records a failed attempt: the row stays, `attempts` + 1, next attempt after [`backoff_ms`].
/// `terminal` (a rejection retrying cannot help) moves it to `rejected` instead.
pub fn fail(
    conn: &Connection,
    msg_id: &str,
    host: &str,
    error: &str,
    terminal: bool,
    now_ms: i64,
) -> Result<(), MailboxError> {
    let attempts: u32 = conn
        .query_row(
            "SELECT attempts FROM outbox WHERE msg_id = ?1 AND host = ?2",
            params![msg_id, host],
            |r| r.get(0),
        )
        .optional()?
        .unwrap_or(0);
    let next_at = now_ms + backoff_ms(attempts);
    conn.execute(
        "UPDATE outbox SET attempts = attempts + 1, next_at = ?3, last_error = ?4,
           state = CASE WHEN ?5 THEN 'rejected' ELSE state END
         WHERE msg_id = ?1 AND host = ?2 AND state = 'pending'",
        params![msg_id, host, next_at, error, terminal],
    )?;
    Ok(())
}

/// A new relay epoch (spec §5): every `relay-accepted` row of `relay` accepted in another epoch
/// goes back to `pending` (due now, same wire bytes, same deadline) so it is pushed again; relay
/// dedup answers `duplicate` where the restored store still holds it. Returns how many rows.
pub fn repush_for_epoch(
    conn: &Connection,
    relay: &str,
    epoch: &str,
    now_ms: i64,
) -> Result<usize, MailboxError> {
    Ok(conn.execute(
        "UPDATE outbox SET state = 'pending', next_at = ?3, attempts = 0
         WHERE state = 'relay-accepted' AND relay = ?1 AND epoch != ?2",
        params![relay, epoch, now_ms],
    )?)
}

/// Row counts by state.
pub fn counts(conn: &Connection) -> Result<Vec<(String, i64)>, MailboxError> {
    let mut st =
        conn.prepare("SELECT state, COUNT(*) FROM outbox GROUP BY state ORDER BY state")?;
    let rows = st
        .query_map([], |r| Ok((r.get(0)?, r.get(1)?)))?
        .collect::<Result<Vec<_>, _>>()?;
    Ok(rows)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_doubles_and_caps() {
        assert_eq!(backoff_ms(0), 5_000);
        assert_eq!(backoff_ms(1), 10_000);
        assert_eq!(backoff_ms(9), 2_560_000);
        assert_eq!(backoff_ms(10), 3_600_000);
        assert_eq!(backoff_ms(60), 3_600_000);
    }
}

#[cfg(test)]
mod wire_tests {
    use super::*;
    use crate::testutil::{self, T0};

    #[test]
    fn wire_bytes_are_written_once_and_failures_never_delete() {
        let s = testutil::store();
        let me = testutil::identity("home");
        s.add_peer(&testutil::identity("work"), false);
        let id = "01KDVDNA3VG2MH8KWSQRCWJZ0S";
        s.send(&me, "alice", &["bob@work"], "hi", id, T0).unwrap();
        s.mailbox
            .with(|c| {
                assert_eq!(set_wire(c, id, "work", b"first", "h1")?, b"first");
                // A second sealing never replaces the first bytes.
                assert_eq!(set_wire(c, id, "work", b"second", "h2")?, b"first");
                let r = get(c, id, "work")?.unwrap();
                assert_eq!(r.wire_hash.as_deref(), Some("h1"));
                assert!(set_wire(c, id, "nohost", b"x", "h").is_err());
                // Retryable failures keep the row pending with backoff.
                fail(c, id, "work", "e1", false, T0)?;
                fail(c, id, "work", "e2", false, T0 + 10)?;
                let r = get(c, id, "work")?.unwrap();
                assert_eq!(
                    (r.state.as_str(), r.attempts, r.next_at),
                    ("pending", 2, T0 + 10 + backoff_ms(1))
                );
                // A terminal one keeps it, as rejected; later failures change nothing.
                fail(c, id, "work", "rejected:conflict", true, T0 + 20)?;
                fail(c, id, "work", "late", false, T0 + 30)?;
                let r = get(c, id, "work")?.unwrap();
                assert_eq!(
                    (r.state.as_str(), r.attempts, r.last_error.as_deref()),
                    ("rejected", 3, Some("rejected:conflict"))
                );
                assert!(due(c, i64::MAX, 10)?.is_empty());
                assert_eq!(counts(c)?, vec![("rejected".to_string(), 1)]);
                Ok(())
            })
            .unwrap();
    }
}
