//! Receive-side relay state: the position (epoch, received_through, acked_through) per relay,
//! quarantine of rejected items (spec §4: never dropped silently), and a small kv table for
//! cached facts (enrolment, published ad).

use rusqlite::{params, Connection, OptionalExtension};
use serde::Serialize;

use super::MailboxError;

/// Where this host stands with one relay.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Position {
    /// Relay epoch the numbers belong to.
    pub epoch: String,
    /// Highest seq durably processed contiguously.
    pub received_through: i64,
    /// Highest seq the relay confirmed as acked.
    pub acked_through: i64,
}

/// The position for `relay`, if any.
pub fn position(conn: &Connection, relay: &str) -> Result<Option<Position>, MailboxError> {
    Ok(conn
        .query_row(
            "SELECT epoch, received_through, acked_through FROM relay_position WHERE relay = ?1",
            [relay],
            |r| {
                Ok(Position {
                    epoch: r.get(0)?,
                    received_through: r.get(1)?,
                    acked_through: r.get(2)?,
                })
            },
        )
        .optional()?)
}

/// Sets `received_through` (inside the transaction of the last item of the run it covers).
pub fn set_received_through(
    conn: &Connection,
    relay: &str,
    epoch: &str,
    through: i64,
    now_ms: i64,
) -> Result<(), MailboxError> {
    conn.execute(
        "INSERT INTO relay_position(relay, epoch, received_through, acked_through, updated_at) VALUES (?1,?2,?3,0,?4)
         ON CONFLICT(relay) DO UPDATE SET epoch = ?2, received_through = ?3, updated_at = ?4",
        params![relay, epoch, through, now_ms],
    )?;
    Ok(())
}

/// Resets the position to 0 in a new epoch (spec §5: a receiver re-pulls everything).
pub fn reset(conn: &Connection, relay: &str, epoch: &str, now_ms: i64) -> Result<(), MailboxError> {
    conn.execute(
        "INSERT INTO relay_position(relay, epoch, received_through, acked_through, updated_at) VALUES (?1,?2,0,0,?3)
         ON CONFLICT(relay) DO UPDATE SET epoch = ?2, received_through = 0, acked_through = 0, updated_at = ?3",
        params![relay, epoch, now_ms],
    )?;
    Ok(())
}

/// Records the relay's confirmed `acked_through`.
pub fn set_acked_through(
    conn: &Connection,
    relay: &str,
    epoch: &str,
    acked: i64,
    now_ms: i64,
) -> Result<(), MailboxError> {
    conn.execute(
        "UPDATE relay_position SET acked_through = MAX(acked_through, ?3), updated_at = ?4 WHERE relay = ?1 AND epoch = ?2",
        params![relay, epoch, acked, now_ms],
    )?;
    Ok(())
}

/// A quarantined item.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Quarantined {
    /// Relay URL.
    pub relay: String,
    /// Epoch.
    pub epoch: String,
    /// Relay seq.
    pub seq: i64,
    /// Item kind.
    pub kind: String,
    /// Item id.
    pub item_id: String,
    /// Pushing host key.
    pub sender_pubkey: String,
    /// Why it was rejected.
    pub reason: String,
    /// When (ms).
    pub at: i64,
}

/// Puts a rejected item in quarantine (idempotent per relay, epoch, seq).
#[allow(clippy::too_many_arguments)]
pub fn quarantine(
    conn: &Connection,
    relay: &str,
    epoch: &str,
    seq: i64,
    kind: &str,
    item_id: &str,
    sender_pubkey: &str,
    reason: &str,
    wire: &[u8],
    now_ms: i64,
) -> Result<(), MailboxError> {
    conn.execute(
        "INSERT OR IGNORE INTO quarantine(relay, epoch, seq, kind, item_id, sender_pubkey, reason, wire, at)
         VALUES (?1,?2,?3,?4,?5,?6,?7,?8,?9)",
        params![relay, epoch, seq, kind, item_id, sender_pubkey, reason, wire, now_ms],
    )?;
    Ok(())
}

/// The latest `limit` quarantined items, newest first.
pub fn quarantined(conn: &Connection, limit: u32) -> Result<Vec<Quarantined>, MailboxError> {
    let mut st = conn.prepare(
        "SELECT relay, epoch, seq, kind, item_id, sender_pubkey, reason, at FROM quarantine ORDER BY id DESC LIMIT ?1",
    )?;
    let rows = st
        .query_map([limit], |r| {
            Ok(Quarantined {
                relay: r.get(0)?,
                epoch: r.get(1)?,
                seq: r.get(2)?,
                kind: r.get(3)?,
                item_id: r.get(4)?,
                sender_pubkey: r.get(5)?,
                reason: r.get(6)?,
                at: r.get(7)?,
            })
        })?
        .collect::<Result<Vec<_>, _>>()?;
    Ok(rows)
}

/// Reads a kv value.
pub fn kv_get(conn: &Connection, k: &str) -> Result<Option<String>, MailboxError> {
    Ok(conn
        .query_row("SELECT v FROM kv WHERE k = ?1", [k], |r| r.get(0))
        .optional()?)
}

/// Writes a kv value.
pub fn kv_set(conn: &Connection, k: &str, v: &str) -> Result<(), MailboxError> {
    conn.execute(
        "INSERT INTO kv(k, v) VALUES (?1, ?2) ON CONFLICT(k) DO UPDATE SET v = ?2",
        params![k, v],
    )?;
    Ok(())
}

/// Deletes kv keys starting with `prefix`.
pub fn kv_delete_prefix(conn: &Connection, prefix: &str) -> Result<(), MailboxError> {
    conn.execute(
        "DELETE FROM kv WHERE substr(k, 1, length(?1)) = ?1",
        [prefix],
    )?;
    Ok(())
}

/// A quarantined item that may be received now: it was refused as `host not paired` and its
/// sender key has been pinned since (`wire.md` §3.5).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Retryable {
    /// Quarantine row id.
    pub id: i64,
    /// Item id.
    pub item_id: String,
    /// Pushing host key (now a peer).
    pub sender_pubkey: String,
    /// Wire bytes as received.
    pub wire: Vec<u8>,
}

/// Up to `limit` `host not paired` envelopes of `relay` whose sender is now a pinned peer.
pub fn retryable(
    conn: &Connection,
    relay: &str,
    limit: u32,
) -> Result<Vec<Retryable>, MailboxError> {
    let mut st = conn.prepare(
        "SELECT q.id, q.item_id, q.sender_pubkey, q.wire FROM quarantine q
         JOIN peers p ON p.pubkey = q.sender_pubkey
         WHERE q.relay = ?1 AND q.kind = 'envelope' AND q.reason = 'host not paired'
         ORDER BY q.id LIMIT ?2",
    )?;
    let rows = st
        .query_map(params![relay, limit], |r| {
            Ok(Retryable {
                id: r.get(0)?,
                item_id: r.get(1)?,
                sender_pubkey: r.get(2)?,
                wire: r.get(3)?,
            })
        })?
        .collect::<Result<Vec<_>, _>>()?;
    Ok(rows)
}

/// Takes a quarantined item out (it was received after all).
pub fn release(conn: &Connection, id: i64) -> Result<(), MailboxError> {
    conn.execute("DELETE FROM quarantine WHERE id = ?1", [id])?;
    Ok(())
}

/// Records a new reason for a quarantined item that was retried and refused again.
pub fn requarantine(
    conn: &Connection,
    id: i64,
    reason: &str,
    now_ms: i64,
) -> Result<(), MailboxError> {
    conn.execute(
        "UPDATE quarantine SET reason = ?2, at = ?3 WHERE id = ?1",
        params![id, reason, now_ms],
    )?;
    Ok(())
}
