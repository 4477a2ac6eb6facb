//! The outbox: one row per (message, target host). A row is `pending` until the peer's verdict
//! over the LAN settles it (`delivered`, or `rejected` with an alert), or a verified relay accept
//! moves it to `relay-accepted` (spec §3 sender side), which the peer's delivery receipt later
//! settles (`delivered`, spec §9). A rejection that retrying cannot help moves it to `rejected`
//! (design README "Rejections"); the LAN gives up on a row no relay ever accepted after 72 h
//! (`undelivered`, `wire.md` §4 "Outbox client"). A row is never deleted by a failure.
//!
//! Which transport takes a due row is decided by [`crate::transport::select`]; the queries
//! [`due_for_lan`] and [`due_for_relay`] are that rule in SQL.
//!
//! The wire bytes are written once, before the first attempt, and reused byte for byte on every
//! retry and by both transports ([`set_wire`] never overwrites).

use rusqlite::{params, Connection, OptionalExtension};
use serde::Serialize;

use agentmbx_protocol::envelope::Envelope;
use agentmbx_protocol::keys::{EncPublicKey, HostKey};
use agentmbx_protocol::{hash, seal};

use super::MailboxError;
use crate::transport::select::LAN_FAILURES_BEFORE_RELAY;

/// First retry delay (ms); the delay doubles per attempt.
pub const BACKOFF_BASE_MS: i64 = 5_000;
/// Longest retry delay (ms): one hour.
pub const BACKOFF_MAX_MS: i64 = 3_600_000;
/// How long the LAN keeps trying a row no relay accepted before it is `undelivered` (ms):
/// 72 h (`wire.md` §4 "Outbox client").
pub const LAN_GIVE_UP_MS: i64 = 72 * 3_600_000;
/// Longest `last_error` kept (characters, `wire.md` §4).
pub const MAX_LAST_ERROR: usize = 300;

/// Retry delay after `attempts` failed attempts: `min(5 s · 2^attempts, 1 h)` (ms).
pub fn backoff_ms(attempts: u32) -> i64 {
    BACKOFF_BASE_MS
        .saturating_mul(1i64 << attempts.min(20))
        .min(BACKOFF_MAX_MS)
}

/// `text` cut to at most [`MAX_LAST_ERROR`] characters.
pub fn cut_error(text: &str) -> String {
    text.chars().take(MAX_LAST_ERROR).collect()
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
    /// `pending`, `relay-accepted`, `rejected`, `delivered` or `undelivered`.
    pub state: String,
    /// Failed attempts so far (both transports).
    pub attempts: u32,
    /// Failed LAN attempts since the peer was last heard from (spec §10).
    pub lan_failures: u32,
    /// Next attempt (ms).
    pub next_at: i64,
    /// Last failure.
    pub last_error: Option<String>,
    /// When the row was queued (ms).
    pub created_at: i64,
    /// Persisted wire bytes (absent until first sealed).
    #[serde(skip)]
    pub wire: Option<Vec<u8>>,
    /// SHA-256 hex of `wire`.
    pub wire_hash: Option<String>,
    /// Relay seq once accepted.
    pub seq: Option<i64>,
    /// Relay epoch once accepted.
    pub epoch: Option<String>,
    /// When a relay accepted the row (ms); kept through a re-push.
    pub accepted_at: Option<i64>,
    /// The transport that settled the row: `lan`, `relay` or `receipt`.
    pub via: Option<String>,
}

const COLS: &str = "o.msg_id, o.host, o.target_pubkey, o.state, o.attempts, o.lan_failures, o.next_at, o.last_error, o.created_at, o.wire, o.wire_hash, o.seq, o.epoch, o.accepted_at, o.via";

fn row(r: &rusqlite::Row<'_>) -> rusqlite::Result<Row> {
    Ok(Row {
        msg_id: r.get(0)?,
        host: r.get(1)?,
        target_pubkey: r.get(2)?,
        state: r.get(3)?,
        attempts: r.get(4)?,
        lan_failures: r.get(5)?,
        next_at: r.get(6)?,
        last_error: r.get(7)?,
        created_at: r.get(8)?,
        wire: r.get(9)?,
        wire_hash: r.get(10)?,
        seq: r.get(11)?,
        epoch: r.get(12)?,
        accepted_at: r.get(13)?,
        via: r.get(14)?,
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

/// Every pending row due at `now_ms`, whichever transport takes it, soonest first, at most
/// `limit` (the transports use [`due_for_lan`] and [`due_for_relay`]).
pub fn due(conn: &Connection, now_ms: i64, limit: usize) -> Result<Vec<Row>, MailboxError> {
    let mut st = conn.prepare(&format!(
        "SELECT {COLS} FROM outbox o WHERE o.state = 'pending' AND o.next_at <= ?1 ORDER BY o.next_at, o.created_at, o.msg_id LIMIT ?2"
    ))?;
    let rows = st
        .query_map(params![now_ms, limit as i64], row)?
        .collect::<Result<Vec<_>, _>>()?;
    Ok(rows)
}

/// The earliest `next_at` among all pending rows (ms); each sender loop sleeps on its own
/// ([`next_due_for_lan`], [`next_due_for_relay`]).
pub fn next_due_at(conn: &Connection) -> Result<Option<i64>, MailboxError> {
    Ok(conn.query_row(
        "SELECT MIN(next_at) FROM outbox WHERE state = 'pending'",
        [],
        |r| r.get(0),
    )?)
}

/// The LAN part of the selection rule ([`crate::transport::select::choose`]) over `outbox o`
/// joined with `peers p`: never accepted by a relay, the peer is pinned with this row's key and
/// has a LAN address, and fewer than `:t` LAN failures unless no relay is configured (`:r`
/// false). Shared with the receipt queries (without the relay-accepted part).
pub(crate) const LAN_PEER_SQL: &str =
    "p.pubkey IS NOT NULL AND p.addr IS NOT NULL AND p.addr <> ''";

fn lan_sql() -> String {
    format!(
        "o.accepted_at IS NULL AND p.pubkey = o.target_pubkey AND {LAN_PEER_SQL} AND (o.lan_failures < :t OR NOT :r)"
    )
}

/// Pending rows due at `now_ms` that the LAN takes (spec §10, [`crate::transport::select`]):
/// oldest first, at most `limit`. `relay_configured` false lets the LAN keep every row whose
/// peer has an address, however often it failed.
pub fn due_for_lan(
    conn: &Connection,
    now_ms: i64,
    limit: usize,
    relay_configured: bool,
) -> Result<Vec<Row>, MailboxError> {
    let sql = format!(
        "SELECT {COLS} FROM outbox o JOIN peers p ON p.host = o.host
         WHERE o.state = 'pending' AND o.next_at <= :now AND {}
         ORDER BY o.created_at, o.msg_id LIMIT :limit",
        lan_sql()
    );
    let mut st = conn.prepare(&sql)?;
    let rows = st
        .query_map(
            rusqlite::named_params! {
                ":now": now_ms, ":limit": limit as i64, ":t": LAN_FAILURES_BEFORE_RELAY,
                ":r": relay_configured,
            },
            row,
        )?
        .collect::<Result<Vec<_>, _>>()?;
    Ok(rows)
}

/// Pending rows due at `now_ms` that the relay takes (spec §10): every due pending row the LAN
/// does not take with a relay configured — the LAN failed twice, the peer has no LAN address
/// (or is no longer pinned with the row's key), or a relay accepted the row before (a re-push).
/// Oldest first, at most `limit`.
pub fn due_for_relay(
    conn: &Connection,
    now_ms: i64,
    limit: usize,
) -> Result<Vec<Row>, MailboxError> {
    let sql = format!(
        "SELECT {COLS} FROM outbox o LEFT JOIN peers p ON p.host = o.host
         WHERE o.state = 'pending' AND o.next_at <= :now AND NOT COALESCE(({}), 0)
         ORDER BY o.next_at, o.created_at, o.msg_id LIMIT :limit",
        lan_sql()
    );
    let mut st = conn.prepare(&sql)?;
    let rows = st
        .query_map(
            rusqlite::named_params! {
                ":now": now_ms, ":limit": limit as i64, ":t": LAN_FAILURES_BEFORE_RELAY, ":r": true,
            },
            row,
        )?
        .collect::<Result<Vec<_>, _>>()?;
    Ok(rows)
}

/// The earliest `next_at` (ms) among pending rows the LAN takes (due or not), for the LAN
/// loop's sleep.
pub fn next_due_for_lan(
    conn: &Connection,
    relay_configured: bool,
) -> Result<Option<i64>, MailboxError> {
    let sql = format!(
        "SELECT MIN(o.next_at) FROM outbox o JOIN peers p ON p.host = o.host
         WHERE o.state = 'pending' AND {}",
        lan_sql()
    );
    Ok(conn.query_row(
        &sql,
        rusqlite::named_params! {":t": LAN_FAILURES_BEFORE_RELAY, ":r": relay_configured},
        |r| r.get(0),
    )?)
}

/// The earliest `next_at` (ms) among pending rows the relay takes, for the relay loop's sleep.
pub fn next_due_for_relay(conn: &Connection) -> Result<Option<i64>, MailboxError> {
    let sql = format!(
        "SELECT MIN(o.next_at) FROM outbox o LEFT JOIN peers p ON p.host = o.host
         WHERE o.state = 'pending' AND NOT COALESCE(({}), 0)",
        lan_sql()
    );
    Ok(conn.query_row(
        &sql,
        rusqlite::named_params! {":t": LAN_FAILURES_BEFORE_RELAY, ":r": true},
        |r| r.get(0),
    )?)
}

/// One row.
pub fn get(conn: &Connection, msg_id: &str, host: &str) -> Result<Option<Row>, MailboxError> {
    Ok(conn
        .query_row(
            &format!("SELECT {COLS} FROM outbox o WHERE o.msg_id = ?1 AND o.host = ?2"),
            params![msg_id, host],
            row,
        )
        .optional()?)
}

/// All rows of a message (the sender's per-recipient view).
pub fn for_message(conn: &Connection, msg_id: &str) -> Result<Vec<Row>, MailboxError> {
    let mut st = conn.prepare(&format!(
        "SELECT {COLS} FROM outbox o WHERE o.msg_id = ?1 ORDER BY o.host"
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
           accepted_at = ?8, deadline_at = COALESCE(deadline_at, ?9), settled_at = ?10, last_error = NULL,
           via = 'relay'
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
        params![msg_id, host, next_at, cut_error(error), terminal],
    )?;
    Ok(())
}

/// Seals the row's stored message for its target's enc key and persists the wire bytes once
/// (`wire.md` Decision 4: the same bytes serve the LAN and the relay, on every retry). Returns
/// the stored bytes: the row's own when it already had them (nothing is sealed then), else the
/// first bytes written. Errors: [`MailboxError::NotFound`] (no such row or message),
/// [`MailboxError::Invalid`] (the stored envelope cannot be sealed).
pub fn seal_once(
    conn: &Connection,
    row: &Row,
    enc_pub: &EncPublicKey,
    own_host: &str,
    host_key: &HostKey,
) -> Result<Vec<u8>, MailboxError> {
    if let Some(w) = &row.wire {
        return Ok(w.clone());
    }
    let stored: Option<String> = conn
        .query_row(
            "SELECT envelope FROM messages WHERE id = ?1",
            [&row.msg_id],
            |r| r.get(0),
        )
        .optional()?;
    let stored =
        stored.ok_or_else(|| MailboxError::NotFound(format!("no message {}", row.msg_id)))?;
    let plain: Envelope = serde_json::from_str(&stored)
        .map_err(|e| MailboxError::Invalid(format!("stored envelope {}: {e}", row.msg_id)))?;
    let sealed = seal::seal_envelope(&plain, enc_pub, own_host, host_key)
        .map_err(|e| MailboxError::Invalid(format!("cannot seal {}: {e}", row.msg_id)))?;
    let wire = sealed.wire_json().into_bytes();
    let wire_hash = hash::sha256_hex(&wire);
    set_wire(conn, &row.msg_id, &row.host, &wire, &wire_hash)
}

/// The peer accepted the row over the LAN (`accepted` or `duplicate`): `delivered`, via `lan`.
/// A row a relay accepted meanwhile is settled too (the peer has it). Returns whether it changed.
pub fn delivered_lan(
    conn: &Connection,
    msg_id: &str,
    host: &str,
    now_ms: i64,
) -> Result<bool, MailboxError> {
    let n = conn.execute(
        "UPDATE outbox SET state = 'delivered', via = 'lan', settled_at = ?3, last_error = NULL
         WHERE msg_id = ?1 AND host = ?2 AND state IN ('pending', 'relay-accepted')",
        params![msg_id, host, now_ms],
    )?;
    Ok(n == 1)
}

/// The peer refused the row over the LAN (`rejected:<why>`): state `rejected` with the reason
/// (`wire.md` §4: the sender is alerted by the caller, in the same transaction). Returns whether
/// it changed.
pub fn rejected_lan(
    conn: &Connection,
    msg_id: &str,
    host: &str,
    why: &str,
    now_ms: i64,
) -> Result<bool, MailboxError> {
    let n = conn.execute(
        "UPDATE outbox SET state = 'rejected', via = 'lan', settled_at = ?3, last_error = ?4
         WHERE msg_id = ?1 AND host = ?2 AND state = 'pending'",
        params![msg_id, host, now_ms, cut_error(why)],
    )?;
    Ok(n == 1)
}

/// What a failed LAN attempt did to its row.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LanFailure {
    /// Kept pending: `attempts` and `lan_failures` + 1, next attempt after the backoff.
    Retry,
    /// More than 72 h old and never accepted by a relay: now `undelivered` (the caller alerts).
    GaveUp,
    /// The row is no longer pending (settled meanwhile): nothing changed.
    Gone,
}

/// Records a failed LAN attempt (network error, or an HTTP answer that is no verdict;
/// `wire.md` §4 "Outbox client"): when `now − created_at` > 72 h and no relay ever accepted the
/// row (not a re-push), it becomes `undelivered`; else `attempts` + 1, `lan_failures` + 1,
/// `next_at = now + min(5 s·2^attempts_before, 1 h)`, `last_error` cut to 300 characters.
pub fn fail_lan(
    conn: &Connection,
    msg_id: &str,
    host: &str,
    error: &str,
    now_ms: i64,
) -> Result<LanFailure, MailboxError> {
    let found: Option<(u32, i64, Option<i64>)> = conn
        .query_row(
            "SELECT attempts, created_at, accepted_at FROM outbox
             WHERE msg_id = ?1 AND host = ?2 AND state = 'pending'",
            params![msg_id, host],
            |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)),
        )
        .optional()?;
    let Some((attempts, created_at, accepted_at)) = found else {
        return Ok(LanFailure::Gone);
    };
    if now_ms - created_at > LAN_GIVE_UP_MS && accepted_at.is_none() {
        conn.execute(
            "UPDATE outbox SET state = 'undelivered', attempts = attempts + 1,
               lan_failures = lan_failures + 1, settled_at = ?3, last_error = ?4
             WHERE msg_id = ?1 AND host = ?2",
            params![
                msg_id,
                host,
                now_ms,
                cut_error(&format!("gave up after 72 h ({error})"))
            ],
        )?;
        return Ok(LanFailure::GaveUp);
    }
    conn.execute(
        "UPDATE outbox SET attempts = attempts + 1, lan_failures = lan_failures + 1,
           next_at = ?3, last_error = ?4
         WHERE msg_id = ?1 AND host = ?2",
        params![
            msg_id,
            host,
            now_ms + backoff_ms(attempts),
            cut_error(error)
        ],
    )?;
    Ok(LanFailure::Retry)
}

/// A delivery receipt (delivered or later) from `host` for `msg_id` arrived (spec §9): a row
/// still `pending` or `relay-accepted` is `delivered`; `via` is kept, or set to `relay` for a
/// row a relay accepted and `receipt` otherwise. Returns whether it changed.
pub fn settle_by_receipt(
    conn: &Connection,
    msg_id: &str,
    host: &str,
    now_ms: i64,
) -> Result<bool, MailboxError> {
    let n = conn.execute(
        "UPDATE outbox SET state = 'delivered', settled_at = ?3, last_error = NULL,
           via = COALESCE(via, CASE WHEN accepted_at IS NOT NULL THEN 'relay' ELSE 'receipt' END)
         WHERE msg_id = ?1 AND host = ?2 AND state IN ('pending', 'relay-accepted')",
        params![msg_id, host, now_ms],
    )?;
    Ok(n == 1)
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

/// "Peer is back" (`wire.md` §4, spec §10): a verified hop from `host` shows it is up, so every
/// pending row for it becomes due now (`next_at` = `now_ms` where it was later) and goes over the
/// LAN again: its LAN failure count drops to at most one below the handover threshold, so a row
/// the relay was taking gets one more LAN attempt at once. (Not to 0: a peer that can reach us
/// but that we cannot reach would otherwise keep its rows off the relay for good, each of its
/// hops undoing the LAN failures in between.) Rows a relay accepted are not touched. The
/// receipts owed to `host` get the same treatment ([`super::receipts::peer_is_back`]). Returns
/// how many outbox rows changed.
pub fn peer_is_back(conn: &Connection, host: &str, now_ms: i64) -> Result<usize, MailboxError> {
    super::receipts::peer_is_back(conn, host, now_ms)?;
    Ok(conn.execute(
        "UPDATE outbox SET next_at = MIN(next_at, ?2), lan_failures = MIN(lan_failures, ?3)
         WHERE host = ?1 AND state = 'pending' AND (next_at > ?2 OR lan_failures > ?3)",
        params![host, now_ms, LAN_FAILURES_BEFORE_RELAY - 1],
    )?)
}
