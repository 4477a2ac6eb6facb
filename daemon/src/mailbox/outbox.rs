//! The outbox: one row per (message, target host). A row is `pending` until the peer's verdict
//! over the LAN settles it (`delivered`, or `rejected` with an alert), or a verified relay accept
//! moves it to `relay-accepted` (spec §3 sender side), which the peer's delivery receipt later
//! settles (`delivered`, spec §9). A rejection that retrying cannot help moves it to `rejected`
//! (design README "Rejections").
//!
//! The 72 h rule (`wire.md` §4 "Outbox client"): a `pending` row that no relay ever accepted
//! (`accepted_at` unset, so not a re-push) ends `undelivered` once it is more than
//! [`GIVE_UP_MS`] old, with `last_error` `gave up after 72 h (<last error>)` and an alert to the
//! sender in the same transaction. A failed attempt over either transport applies it
//! ([`fail_lan`], [`fail`]), and [`give_up_stale`] (run by the LAN delivery pass, at least once a
//! minute) ends the rows no transport is trying, e.g. for a peer with no LAN address and no
//! relay. A row a relay accepted is never ended by this rule. A row is never deleted by a
//! failure.
//!
//! Which transport takes a due row is decided by [`crate::transport::select`]; the queries
//! [`due_for_lan`] and [`due_for_relay`] are that rule in SQL, and [`back_to_lan`] is its
//! hand-back after a relay refusal that shows the target is not enrolled there.
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
/// How long a `pending` row that no relay ever accepted is kept before it is `undelivered`
/// (ms): 72 h (`wire.md` §4 "Outbox client"), whichever transport was trying it, or none.
pub const GIVE_UP_MS: i64 = 72 * 3_600_000;
/// Rows [`give_up_stale`] ends per call (one transaction; the caller repeats while it is full).
pub const GIVE_UP_BATCH: usize = 200;
/// The error named by a row that was never tried because no transport could take it.
pub const NO_TRANSPORT: &str = "no transport could take it";
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

/// The `last_error` (and alert reason) of a row ended by the 72 h rule:
/// `gave up after 72 h (<error>)`, cut to [`MAX_LAST_ERROR`] characters.
pub fn gave_up_reason(error: &str) -> String {
    cut_error(&format!("gave up after 72 h ({error})"))
}

/// Whether the 72 h rule ends a pending row created at `created_at` (ms) at `now_ms`: more
/// than [`GIVE_UP_MS`] old and never accepted by a relay (`accepted_at` unset).
pub fn past_give_up(created_at: i64, accepted_at: Option<i64>, now_ms: i64) -> bool {
    accepted_at.is_none() && now_ms.saturating_sub(created_at) > GIVE_UP_MS
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
    super::select_due(conn, &sql, now_ms, limit, relay_configured, row)
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
    super::select_due(conn, &sql, now_ms, limit, true, row)
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

/// Records a failed relay attempt (`wire.md` §3.5 "Push"): `attempts` + 1, next attempt after
/// [`backoff_ms`], `last_error` cut to 300 characters. `terminal` (a rejection retrying cannot
/// help) moves the row to `rejected` instead; otherwise the 72 h rule ([`past_give_up`]) may
/// end it `undelivered` with `last_error` [`gave_up_reason`]. The caller alerts the sender for
/// [`Failure::Rejected`] and [`Failure::GaveUp`] in the same transaction. Only a `pending` row
/// changes ([`Failure::Gone`] otherwise).
pub fn fail(
    conn: &Connection,
    msg_id: &str,
    host: &str,
    error: &str,
    terminal: bool,
    now_ms: i64,
) -> Result<Failure, MailboxError> {
    let Some((attempts, created_at, accepted_at)) = pending_facts(conn, msg_id, host)? else {
        return Ok(Failure::Gone);
    };
    let next_at = now_ms + backoff_ms(attempts);
    if terminal {
        conn.execute(
            "UPDATE outbox SET state = 'rejected', attempts = attempts + 1, next_at = ?3,
               last_error = ?4, settled_at = ?5
             WHERE msg_id = ?1 AND host = ?2 AND state = 'pending'",
            params![msg_id, host, next_at, cut_error(error), now_ms],
        )?;
        return Ok(Failure::Rejected);
    }
    if past_give_up(created_at, accepted_at, now_ms) {
        give_up(conn, msg_id, host, error, false, now_ms)?;
        return Ok(Failure::GaveUp);
    }
    conn.execute(
        "UPDATE outbox SET attempts = attempts + 1, next_at = ?3, last_error = ?4
         WHERE msg_id = ?1 AND host = ?2 AND state = 'pending'",
        params![msg_id, host, next_at, cut_error(error)],
    )?;
    Ok(Failure::Retry)
}

/// `(attempts, created_at, accepted_at)` of a pending row.
fn pending_facts(
    conn: &Connection,
    msg_id: &str,
    host: &str,
) -> Result<Option<(u32, i64, Option<i64>)>, MailboxError> {
    Ok(conn
        .query_row(
            "SELECT attempts, created_at, accepted_at FROM outbox
             WHERE msg_id = ?1 AND host = ?2 AND state = 'pending'",
            params![msg_id, host],
            |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)),
        )
        .optional()?)
}

/// Ends a pending row by the 72 h rule after a failed attempt (`lan`: it was a LAN one).
fn give_up(
    conn: &Connection,
    msg_id: &str,
    host: &str,
    error: &str,
    lan: bool,
    now_ms: i64,
) -> Result<(), MailboxError> {
    conn.execute(
        "UPDATE outbox SET state = 'undelivered', attempts = attempts + 1,
           lan_failures = lan_failures + CASE WHEN ?5 THEN 1 ELSE 0 END,
           settled_at = ?3, last_error = ?4
         WHERE msg_id = ?1 AND host = ?2 AND state = 'pending'",
        params![msg_id, host, now_ms, gave_up_reason(error), lan],
    )?;
    Ok(())
}

/// The relay refused a row in a way that shows the target cannot be reached through it
/// ([`crate::transport::select::relay_cannot_reach`]; spec §10: a row moves to the relay only
/// once the target is enrolled): when the peer is pinned with the row's key and has a LAN
/// address, the row's LAN failures drop to one below the handover threshold, so the LAN takes
/// its next attempt (when due: its backoff stays). Only a pending row no relay ever accepted
/// changes. Returns whether it changed.
pub fn back_to_lan(conn: &Connection, msg_id: &str, host: &str) -> Result<bool, MailboxError> {
    let n = conn.execute(
        &format!(
            "UPDATE outbox SET lan_failures = ?3
             WHERE msg_id = ?1 AND host = ?2 AND state = 'pending' AND accepted_at IS NULL
               AND lan_failures > ?3
               AND EXISTS (SELECT 1 FROM peers p WHERE p.host = outbox.host
                           AND p.pubkey = outbox.target_pubkey AND {LAN_PEER_SQL})"
        ),
        params![msg_id, host, LAN_FAILURES_BEFORE_RELAY - 1],
    )?;
    Ok(n == 1)
}

/// A row ended by [`give_up_stale`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GaveUp {
    /// Message id.
    pub msg_id: String,
    /// Target host name.
    pub host: String,
    /// The stored `last_error`: `gave up after 72 h (<last error, or` [`NO_TRANSPORT`]`>)`.
    pub reason: String,
}

/// The 72 h sweep (`wire.md` §4 "Outbox client"): ends, oldest first, at most `limit`
/// `pending` rows that no relay ever accepted and that are more than [`GIVE_UP_MS`] old,
/// whichever transport was trying them or none (no LAN address and no relay): state
/// `undelivered`, `settled_at` now, `last_error` [`gave_up_reason`] of the row's last error
/// (or [`NO_TRANSPORT`] when it was never tried). Run it in the transaction that alerts each
/// sender. Returns the rows it ended.
pub fn give_up_stale(
    conn: &Connection,
    now_ms: i64,
    limit: usize,
) -> Result<Vec<GaveUp>, MailboxError> {
    let found: Vec<(String, String, Option<String>)> = conn
        .prepare(
            "SELECT msg_id, host, last_error FROM outbox
             WHERE state = 'pending' AND accepted_at IS NULL AND created_at < ?1
             ORDER BY created_at, msg_id LIMIT ?2",
        )?
        .query_map(
            params![now_ms.saturating_sub(GIVE_UP_MS), limit as i64],
            |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)),
        )?
        .collect::<Result<_, _>>()?;
    let mut out = Vec::with_capacity(found.len());
    for (msg_id, host, last_error) in found {
        let reason = gave_up_reason(last_error.as_deref().unwrap_or(NO_TRANSPORT));
        conn.execute(
            "UPDATE outbox SET state = 'undelivered', settled_at = ?3, last_error = ?4
             WHERE msg_id = ?1 AND host = ?2 AND state = 'pending'",
            params![msg_id, host, now_ms, reason],
        )?;
        out.push(GaveUp {
            msg_id,
            host,
            reason,
        });
    }
    Ok(out)
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

/// The peer `host` rotated its host key from `old_pub` to `new_pub` (`wire.md` §2.10,
/// "Resealing"): every `pending` row still aimed at `old_pub` now targets `new_pub` (a new
/// target key, so a new dedup key at the relay), its wire bytes sealed for the old target are
/// dropped so the next attempt seals for the new one, and it is due at `now_ms`. Rows a relay
/// accepted (`relay-accepted`) keep their target: their receipts settle them. Returns how many
/// rows moved; run it in the transaction that moves the pin.
pub fn retarget(
    conn: &Connection,
    host: &str,
    old_pub: &str,
    new_pub: &str,
    now_ms: i64,
) -> Result<usize, MailboxError> {
    Ok(conn.execute(
        "UPDATE outbox SET target_pubkey = ?3, wire = NULL, wire_hash = NULL,
           next_at = MIN(next_at, ?4)
         WHERE host = ?1 AND target_pubkey = ?2 AND state = 'pending'",
        params![host, old_pub, new_pub, now_ms],
    )?)
}

/// What a failed attempt ([`fail`], [`fail_lan`]) did to its row.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Failure {
    /// Kept pending: `attempts` + 1 (and `lan_failures` + 1 for a LAN attempt), next attempt
    /// after the backoff.
    Retry,
    /// A rejection retrying cannot help: now `rejected` (the caller alerts; [`fail`] only).
    Rejected,
    /// More than 72 h old and never accepted by a relay: now `undelivered` (the caller alerts).
    GaveUp,
    /// The row is no longer pending (settled meanwhile): nothing changed.
    Gone,
}

/// Records a failed LAN attempt (network error, or an HTTP answer that is no verdict;
/// `wire.md` §4 "Outbox client"): when the 72 h rule applies ([`past_give_up`]: more than 72 h
/// old, no relay ever accepted the row) it becomes `undelivered`; else `attempts` + 1,
/// `lan_failures` + 1, `next_at = now + min(5 s·2^attempts_before, 1 h)`, `last_error` cut to
/// 300 characters.
pub fn fail_lan(
    conn: &Connection,
    msg_id: &str,
    host: &str,
    error: &str,
    now_ms: i64,
) -> Result<Failure, MailboxError> {
    let Some((attempts, created_at, accepted_at)) = pending_facts(conn, msg_id, host)? else {
        return Ok(Failure::Gone);
    };
    if past_give_up(created_at, accepted_at, now_ms) {
        give_up(conn, msg_id, host, error, true, now_ms)?;
        return Ok(Failure::GaveUp);
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
    Ok(Failure::Retry)
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

    #[test]
    fn the_72_hour_rule_spares_rows_a_relay_accepted_and_the_sweep_ends_the_rest() {
        let s = testutil::store();
        let me = testutil::identity("home");
        s.add_peer(&testutil::identity("work"), false);
        let mut ids = testutil::ids();
        let (a, b, c3) = (ids.next(T0), ids.next(T0), ids.next(T0));
        for id in [&a, &b, &c3] {
            s.send(&me, "alice", &["bob@work"], "hi", id, T0).unwrap();
        }
        let late = T0 + GIVE_UP_MS + 1;
        s.mailbox
            .with(|c| {
                c.execute(
                    "UPDATE outbox SET accepted_at = ?2 WHERE msg_id = ?1",
                    params![b, T0],
                )?;
                assert_eq!(fail(c, &b, "work", "x", false, late)?, Failure::Retry);
                assert_eq!(
                    fail(c, &a, "work", "x", false, T0 + GIVE_UP_MS)?,
                    Failure::Retry
                );
                assert_eq!(fail(c, &a, "work", "x", false, late)?, Failure::GaveUp);
                assert_eq!(fail(c, &a, "work", "x", false, late)?, Failure::Gone);
                let r = get(c, &a, "work")?.unwrap();
                assert_eq!(
                    (r.state.as_str(), r.last_error.as_deref()),
                    ("undelivered", Some("gave up after 72 h (x)"))
                );
                // The sweep: only c3 is left to end; b was accepted by a relay once.
                assert!(give_up_stale(c, T0 + GIVE_UP_MS, 10)?.is_empty());
                let ended = give_up_stale(c, late, 10)?;
                assert_eq!(
                    ended,
                    vec![GaveUp {
                        msg_id: c3.clone(),
                        host: "work".into(),
                        reason: format!("gave up after 72 h ({NO_TRANSPORT})"),
                    }]
                );
                assert!(give_up_stale(c, i64::MAX, 10)?.is_empty());
                assert_eq!(get(c, &b, "work")?.unwrap().state, "pending");
                Ok(())
            })
            .unwrap();
    }

    #[test]
    fn back_to_lan_needs_a_lan_address_and_a_row_no_relay_accepted() {
        let s = testutil::store();
        let me = testutil::identity("home");
        s.add_peer(&testutil::identity("work"), false);
        let mut ids = testutil::ids();
        let (a, b) = (ids.next(T0), ids.next(T0));
        for id in [&a, &b] {
            s.send(&me, "alice", &["bob@work"], "hi", id, T0).unwrap();
        }
        s.mailbox
            .with(|c| {
                c.execute("UPDATE outbox SET lan_failures = 3", [])?;
                // No LAN address: stays with the relay.
                assert!(!back_to_lan(c, &a, "work")?);
                c.execute(
                    "UPDATE peers SET addr = '127.0.0.1:1' WHERE host = 'work'",
                    [],
                )?;
                assert!(back_to_lan(c, &a, "work")?);
                assert_eq!(
                    get(c, &a, "work")?.unwrap().lan_failures,
                    LAN_FAILURES_BEFORE_RELAY - 1
                );
                // Already below the threshold: nothing to do.
                assert!(!back_to_lan(c, &a, "work")?);
                // A row a relay accepted once never goes back to the LAN.
                c.execute(
                    "UPDATE outbox SET accepted_at = ?2 WHERE msg_id = ?1",
                    params![b, T0],
                )?;
                assert!(!back_to_lan(c, &b, "work")?);
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
