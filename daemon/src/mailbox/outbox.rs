//! The outbox: one row per (message, target host). States (`wire.md` §3.5 "Settle"):
//! - `pending`: no relay accepted it yet; the LAN or the relay takes it when due. The peer's
//!   verdict over the LAN settles it (`delivered`, or `rejected` with an alert), a verified relay
//!   accept moves it to `relay-accepted` (spec §3 sender side), a rejection that retrying cannot
//!   help to `rejected` (design README "Rejections").
//! - `relay-accepted`: a relay holds it; the peer's delivery receipt settles it (`delivered`,
//!   spec §9). Its `accepted_at` and `deadline_at` (accepted_at + retention + 24 h) are kept for
//!   good from the first accept.
//! - `repush`: a relay accepted it, then showed a new epoch or went back in time (spec §5, `wire.md`
//!   §3.5 "Epoch change / rewind", [`repush_for_epoch`]): it is pushed again with the same wire
//!   bytes (relay dedup answers `duplicate` where the item survived), and may go over the LAN when
//!   the peer is reachable. A relay accept moves it back to `relay-accepted`, a receipt or a LAN
//!   delivery to `delivered`, a LAN refusal to `rejected`. It keeps its accept time and deadline.
//! - `expired`: the signed expiry notice of the relay that holds the row (its `relay`) said the
//!   target never collected it (spec §6); `unconfirmed`: `relay-accepted` or `repush` with no
//!   delivery receipt by its deadline. Both alert the sender in the transaction that ends the
//!   row (`crate::node::settle`).
//! - `delivered`, `rejected`, `undelivered`, `expired`, `unconfirmed`: final. The peer's own
//!   word still wins over an alert already given: a delivery receipt ([`settle_by_receipt`]) or
//!   a LAN `accepted`/`duplicate` ([`delivered_lan`]) turns an `expired`, `unconfirmed` or
//!   `undelivered` row into `delivered` (the peer has the message), e.g. a LAN delivery of a
//!   re-push that raced the expiry notice, or a push whose answer was lost (the relay had
//!   committed) ended by the 72 h rule.
//!
//! The 72 h rule (`wire.md` §4 "Outbox client"): a `pending` row (never `repush`: no relay ever
//! accepted it) ends `undelivered` once it is more than [`GIVE_UP_MS`] old, with `last_error`
//! `gave up after 72 h (<last error>)` and an alert to the sender in the same transaction. A
//! failed attempt over either transport applies it ([`fail_lan`], [`fail`]), and
//! [`give_up_stale`] (run by the LAN delivery pass, at least once a minute) ends the rows no
//! transport is trying, e.g. for a peer with no LAN address and no relay. A row a relay accepted
//! (`relay-accepted`, `repush`) is never ended by this rule: its deadline is. A row is never
//! deleted by a failure.
//!
//! Which transport takes a due row is decided by the rule of [`super::lane`]; the queries
//! [`due_for_lan`] and [`due_for_relay`] are that rule in SQL, and [`back_to_lan`] is its
//! hand-back after a relay refusal that shows the target is not enrolled there.
//!
//! The wire bytes are written once, before the first attempt, and reused byte for byte on every
//! retry and by both transports ([`set_wire`] never overwrites; the outbound step
//! `crate::node::outbound` seals them, this store only keeps bytes). They are resealed only
//! when the peer's pinned key changed (`wire.md` "Resolved details: Resealing": a new target
//! key, a new dedup key; [`retarget`], [`follow_rotations`]). A row that reaches a final state
//! drops them (`wire = NULL`, `wire.md` §3.5 "Settle"; `wire_hash` stays as the record of what
//! was sent): no transport sends a final row again, a re-push only ever takes `repush` rows,
//! and a late receipt or LAN verdict for a final row only changes its state.

use rusqlite::{params, Connection, OptionalExtension};
use serde::Serialize;

pub use super::schedule::{
    backoff_ms, cut_error, max_horizon_ms, BACKOFF_BASE_MS, BACKOFF_MAX_MS, MAX_LAST_ERROR,
};

use super::lane::{lan_takes_sql, LAN_FAILURES_BEFORE_RELAY, LAN_PEER_SQL};
use super::schedule::{due_sql, horizon_sql, wake_sql};
use super::MailboxError;

/// How long a `pending` row that no relay ever accepted is kept before it is `undelivered`
/// (ms): 72 h (`wire.md` §4 "Outbox client"), whichever transport was trying it, or none.
pub const GIVE_UP_MS: i64 = 72 * 3_600_000;
/// Rows [`give_up_stale`] ends per call (one transaction; the caller repeats while it is full).
pub const GIVE_UP_BATCH: usize = 200;
/// The error named by a row that was never tried because no transport could take it.
pub const NO_TRANSPORT: &str = "no transport could take it";
/// The `last_error` (and alert reason) of a row ended by the 72 h rule:
/// `gave up after 72 h (<error>)`, cut to [`MAX_LAST_ERROR`] characters.
pub fn gave_up_reason(error: &str) -> String {
    cut_error(&format!("gave up after 72 h ({error})"))
}

/// Whether the 72 h rule ends a row in `state` created at `created_at` (ms) at `now_ms`: a
/// `pending` row more than [`GIVE_UP_MS`] old that no relay ever accepted (`accepted_at`
/// unset). A `repush` row (a relay accepted it once) never ends by this rule.
pub fn past_give_up(state: &str, created_at: i64, accepted_at: Option<i64>, now_ms: i64) -> bool {
    state == "pending" && accepted_at.is_none() && now_ms.saturating_sub(created_at) > GIVE_UP_MS
}

/// The outbox states a transport may still send: `pending` and `repush` (SQL list).
pub const SENDABLE_SQL: &str = "('pending', 'repush')";

/// The states the peer's own word (a delivery receipt, a LAN `accepted`/`duplicate`) turns
/// into `delivered` (SQL list): every state but `delivered` and `rejected` (module doc).
pub const PEER_SETTLES_SQL: &str =
    "('pending', 'repush', 'relay-accepted', 'unconfirmed', 'expired', 'undelivered')";

/// An outbox row.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Row {
    /// Message id (= relay item id).
    pub msg_id: String,
    /// Target host name (peer handle).
    pub host: String,
    /// Pinned target host key.
    pub target_pubkey: String,
    /// `pending`, `repush`, `relay-accepted`, `rejected`, `delivered`, `undelivered`,
    /// `expired` or `unconfirmed` (module doc).
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
    /// Persisted wire bytes: absent until first sealed, and again once the row is final
    /// (module doc).
    #[serde(skip)]
    pub wire: Option<Vec<u8>>,
    /// SHA-256 hex of the wire bytes last sealed (kept when a final row drops them).
    pub wire_hash: Option<String>,
    /// Relay seq once accepted.
    pub seq: Option<i64>,
    /// Relay epoch once accepted.
    pub epoch: Option<String>,
    /// When a relay first accepted the row (ms); kept through a re-push.
    pub accepted_at: Option<i64>,
    /// The sender's own deadline (ms): `accepted_at` + retention + 24 h, set by the first
    /// accept and kept through a re-push; past it a row without a receipt is `unconfirmed`.
    pub deadline_at: Option<i64>,
    /// The transport that settled the row: `lan`, `relay` or `receipt`.
    pub via: Option<String>,
    /// URL of the relay that last accepted the row (no trailing `/`); kept through a re-push.
    pub relay: Option<String>,
}

const COLS: &str = "o.msg_id, o.host, o.target_pubkey, o.state, o.attempts, o.lan_failures, o.next_at, o.last_error, o.created_at, o.wire, o.wire_hash, o.seq, o.epoch, o.accepted_at, o.via, o.deadline_at, o.relay";

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
        deadline_at: r.get(15)?,
        relay: r.get(16)?,
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

/// Every `pending` or `repush` row due at `now_ms` (as in [`due_for_lan`]), whichever transport
/// takes it, soonest first (a row due for being beyond its horizon counts as due at `now_ms`),
/// then in the order they were queued, at most `limit` (the transports use [`due_for_lan`] and
/// [`due_for_relay`]).
pub fn due(conn: &Connection, now_ms: i64, limit: usize) -> Result<Vec<Row>, MailboxError> {
    let mut st = conn.prepare(&format!(
        "SELECT {COLS} FROM outbox o WHERE o.state IN {SENDABLE_SQL} AND {}
         ORDER BY {}, o.rowid LIMIT :limit",
        row_due_sql(),
        row_wake_sql()
    ))?;
    let rows = st
        .query_map(
            rusqlite::named_params! {":now": now_ms, ":limit": limit as i64},
            row,
        )?
        .collect::<Result<Vec<_>, _>>()?;
    Ok(rows)
}

/// The earliest time (ms) any `pending` or `repush` row is due at `now_ms` (`wake_sql`: a
/// row scheduled beyond its [`max_horizon_ms`] counts as due now); each sender loop sleeps on
/// its own ([`next_due_for_lan`], [`next_due_for_relay`]).
pub fn next_due_at(conn: &Connection, now_ms: i64) -> Result<Option<i64>, MailboxError> {
    Ok(conn.query_row(
        &format!(
            "SELECT MIN({}) FROM outbox o WHERE o.state IN {SENDABLE_SQL}",
            row_wake_sql()
        ),
        rusqlite::named_params! {":now": now_ms},
        |r| r.get(0),
    )?)
}

/// [`due_sql`] for an outbox row `o`.
fn row_due_sql() -> String {
    due_sql("o.next_at", &horizon_sql("o.attempts"))
}

/// [`wake_sql`] for an outbox row `o`.
fn row_wake_sql() -> String {
    wake_sql("o.next_at", &horizon_sql("o.attempts"))
}

/// The LAN part of the selection rule ([`super::lane`]) for an `outbox o` row joined with
/// `peers p`: the peer is pinned with this row's key, and [`lan_takes_sql`] over its LAN
/// failures. A `repush` row follows the same rule as a `pending` one.
fn lan_sql() -> String {
    format!(
        "p.pubkey = o.target_pubkey AND {}",
        lan_takes_sql("o.lan_failures")
    )
}

/// `pending` and `repush` rows due at `now_ms` (`next_at ≤ now`, or beyond the row's
/// [`max_horizon_ms`]) that the LAN takes (spec §10, [`super::lane`]): in the
/// order they were queued here (rowid, never a stored time), at most `limit`. `relay_configured` false lets
/// the LAN keep every row whose peer has an address, however often it failed.
pub fn due_for_lan(
    conn: &Connection,
    now_ms: i64,
    limit: usize,
    relay_configured: bool,
) -> Result<Vec<Row>, MailboxError> {
    due_for_lan_except(conn, now_ms, limit, relay_configured, &[])
}

/// [`due_for_lan`] leaving out the rows of the peers in `exclude` (a LAN call to them is still
/// open) inside the query, so a busy peer's backlog never fills the `limit` and starves the
/// others.
pub fn due_for_lan_except(
    conn: &Connection,
    now_ms: i64,
    limit: usize,
    relay_configured: bool,
    exclude: &[String],
) -> Result<Vec<Row>, MailboxError> {
    let sql = format!(
        "SELECT {COLS} FROM outbox o JOIN peers p ON p.host = o.host
         WHERE o.state IN {SENDABLE_SQL} AND {} AND {}
           AND o.host NOT IN (SELECT value FROM json_each(:ex))
         ORDER BY o.rowid LIMIT :limit",
        row_due_sql(),
        lan_sql()
    );
    super::select_due_except(
        conn,
        &sql,
        now_ms,
        limit,
        relay_configured,
        Some(exclude),
        row,
    )
}

/// `pending` and `repush` rows due at `now_ms` that the relay takes (spec §10): every due row
/// the LAN does not take with a relay configured — the LAN failed twice, or the peer has no LAN
/// address (or is no longer pinned with the row's key). Due as in [`due_for_lan`]; in the
/// order they were queued here, at most `limit`.
pub fn due_for_relay(
    conn: &Connection,
    now_ms: i64,
    limit: usize,
) -> Result<Vec<Row>, MailboxError> {
    let sql = format!(
        "SELECT {COLS} FROM outbox o LEFT JOIN peers p ON p.host = o.host
         WHERE o.state IN {SENDABLE_SQL} AND {} AND NOT COALESCE(({}), 0)
         ORDER BY o.rowid LIMIT :limit",
        row_due_sql(),
        lan_sql()
    );
    super::select_due(conn, &sql, now_ms, limit, true, row)
}

/// The earliest time (ms) a `pending` or `repush` row the LAN takes is due at `now_ms` (due or
/// not; `now_ms` for a row scheduled beyond its [`max_horizon_ms`]), for the LAN loop's sleep;
/// rows of the peers in `exclude` (a LAN call to them is still open) are left out.
pub fn next_due_for_lan(
    conn: &Connection,
    relay_configured: bool,
    now_ms: i64,
    exclude: &[String],
) -> Result<Option<i64>, MailboxError> {
    let exclude = serde_json::to_string(exclude).unwrap_or_else(|_| "[]".into());
    let sql = format!(
        "SELECT MIN({}) FROM outbox o JOIN peers p ON p.host = o.host
         WHERE o.state IN {SENDABLE_SQL} AND {}
           AND o.host NOT IN (SELECT value FROM json_each(:ex))",
        row_wake_sql(),
        lan_sql()
    );
    Ok(conn.query_row(
        &sql,
        rusqlite::named_params! {
            ":t": LAN_FAILURES_BEFORE_RELAY, ":r": relay_configured, ":now": now_ms,
            ":ex": exclude,
        },
        |r| r.get(0),
    )?)
}

/// The earliest time (ms) a `pending` or `repush` row the relay takes is due at `now_ms`
/// (`now_ms` for a row scheduled beyond its [`max_horizon_ms`]), for the relay loop's sleep.
pub fn next_due_for_relay(conn: &Connection, now_ms: i64) -> Result<Option<i64>, MailboxError> {
    let sql = format!(
        "SELECT MIN({}) FROM outbox o LEFT JOIN peers p ON p.host = o.host
         WHERE o.state IN {SENDABLE_SQL} AND NOT COALESCE(({}), 0)",
        row_wake_sql(),
        lan_sql()
    );
    Ok(conn.query_row(
        &sql,
        rusqlite::named_params! {":t": LAN_FAILURES_BEFORE_RELAY, ":r": true, ":now": now_ms},
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

/// Persists the wire bytes of a `pending` or `repush` row once. Returns the bytes now stored:
/// the given ones, or the ones an earlier attempt already wrote (never overwritten, Decision 4).
/// A row that became final meanwhile keeps no bytes (module doc): the given ones are returned
/// unstored, for the attempt already under way. Errors: [`MailboxError::NotFound`] (no such
/// row), storage faults.
pub fn set_wire(
    conn: &Connection,
    msg_id: &str,
    host: &str,
    wire: &[u8],
    wire_hash: &str,
) -> Result<Vec<u8>, MailboxError> {
    conn.execute(
        &format!(
            "UPDATE outbox SET wire = ?3, wire_hash = ?4
             WHERE msg_id = ?1 AND host = ?2 AND wire IS NULL AND state IN {SENDABLE_SQL}"
        ),
        params![msg_id, host, wire, wire_hash],
    )?;
    let stored: Option<Option<Vec<u8>>> = conn
        .query_row(
            "SELECT wire FROM outbox WHERE msg_id = ?1 AND host = ?2",
            params![msg_id, host],
            |r| r.get(0),
        )
        .optional()?;
    match stored {
        Some(Some(w)) => Ok(w),
        Some(None) => Ok(wire.to_vec()),
        None => Err(MailboxError::NotFound(format!(
            "no outbox row {msg_id} → {host}"
        ))),
    }
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

/// Moves a `pending` or `repush` row to `relay-accepted`, recording the relay, epoch, seq and
/// accept. A re-pushed row keeps its first `accepted_at` and `deadline_at` (spec §3: retries
/// never move the sender's deadline). Only called with an accept verified for this row's target
/// and wire hash. Returns whether the row changed.
pub fn settle_accepted(
    conn: &Connection,
    msg_id: &str,
    host: &str,
    a: &Accepted<'_>,
    now_ms: i64,
) -> Result<bool, MailboxError> {
    let n = conn.execute(
        &format!(
            "UPDATE outbox SET state = 'relay-accepted', relay = ?3, epoch = ?4, seq = ?5, accept = ?6, accept_sig = ?7,
           accepted_at = COALESCE(accepted_at, ?8), deadline_at = COALESCE(deadline_at, ?9),
           settled_at = ?10, last_error = NULL, via = 'relay'
         WHERE msg_id = ?1 AND host = ?2 AND state IN {SENDABLE_SQL}"
        ),
        params![msg_id, host, a.relay, a.epoch, a.seq, a.accept, a.sig, a.accepted_at, a.deadline_at, now_ms],
    )?;
    Ok(n == 1)
}

/// Records a failed relay attempt (`wire.md` §3.5 "Push"): `attempts` + 1, next attempt after
/// [`backoff_ms`], `last_error` cut to 300 characters. `terminal` (a rejection retrying cannot
/// help) moves a `pending` row to `rejected` instead; otherwise the 72 h rule ([`past_give_up`])
/// may end it `undelivered` with `last_error` [`gave_up_reason`]. The caller alerts the sender
/// for [`Failure::Rejected`] and [`Failure::GaveUp`] in the same transaction. A `repush` row is
/// only ever retried: a relay already accepted it once, so its receipt or its deadline ends it
/// (`unconfirmed`, with an alert), never a refusal of the copy. Only a `pending` or `repush`
/// row changes ([`Failure::Gone`] otherwise).
pub fn fail(
    conn: &Connection,
    msg_id: &str,
    host: &str,
    error: &str,
    terminal: bool,
    now_ms: i64,
) -> Result<Failure, MailboxError> {
    let Some(f) = pending_facts(conn, msg_id, host)? else {
        return Ok(Failure::Gone);
    };
    let next_at = now_ms + backoff_ms(f.attempts);
    if terminal && f.state == "pending" {
        conn.execute(
            "UPDATE outbox SET state = 'rejected', attempts = attempts + 1, next_at = ?3,
               last_error = ?4, settled_at = ?5, wire = NULL
             WHERE msg_id = ?1 AND host = ?2 AND state = 'pending'",
            params![msg_id, host, next_at, cut_error(error), now_ms],
        )?;
        return Ok(Failure::Rejected);
    }
    if past_give_up(&f.state, f.created_at, f.accepted_at, now_ms) {
        give_up(conn, msg_id, host, error, false, now_ms)?;
        return Ok(Failure::GaveUp);
    }
    conn.execute(
        &format!(
            "UPDATE outbox SET attempts = attempts + 1, next_at = ?3, last_error = ?4
         WHERE msg_id = ?1 AND host = ?2 AND state IN {SENDABLE_SQL}"
        ),
        params![msg_id, host, next_at, cut_error(error)],
    )?;
    Ok(Failure::Retry)
}

/// What a failed attempt needs to know of a `pending` or `repush` row.
struct SendableFacts {
    state: String,
    attempts: u32,
    created_at: i64,
    accepted_at: Option<i64>,
}

/// The facts of a `pending` or `repush` row, if it is one.
fn pending_facts(
    conn: &Connection,
    msg_id: &str,
    host: &str,
) -> Result<Option<SendableFacts>, MailboxError> {
    Ok(conn
        .query_row(
            &format!(
                "SELECT state, attempts, created_at, accepted_at FROM outbox
             WHERE msg_id = ?1 AND host = ?2 AND state IN {SENDABLE_SQL}"
            ),
            params![msg_id, host],
            |r| {
                Ok(SendableFacts {
                    state: r.get(0)?,
                    attempts: r.get(1)?,
                    created_at: r.get(2)?,
                    accepted_at: r.get(3)?,
                })
            },
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
           settled_at = ?3, last_error = ?4, wire = NULL
         WHERE msg_id = ?1 AND host = ?2 AND state = 'pending'",
        params![msg_id, host, now_ms, gave_up_reason(error), lan],
    )?;
    Ok(())
}

/// The relay refused a row in a way that shows the target cannot be reached through it
/// ([`crate::transport::select::relay_cannot_reach`]; spec §10: a row moves to the relay only
/// once the target is enrolled): when the peer is pinned with the row's key and has a LAN
/// address, the row's LAN failures drop to one below the handover threshold, so the LAN takes
/// its next attempt (when due: its backoff stays). Only a `pending` or `repush` row changes.
/// Returns whether it changed.
pub fn back_to_lan(conn: &Connection, msg_id: &str, host: &str) -> Result<bool, MailboxError> {
    let n = conn.execute(
        &format!(
            "UPDATE outbox SET lan_failures = ?3
             WHERE msg_id = ?1 AND host = ?2 AND state IN {SENDABLE_SQL}
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
            "UPDATE outbox SET state = 'undelivered', settled_at = ?3, last_error = ?4, wire = NULL
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

/// The stored plain envelope (JSON text) of the message behind an outbox row, the input the
/// outbound step seals for each target (`crate::node::outbound::seal_once`). Errors:
/// [`MailboxError::NotFound`] (no such message), storage faults.
pub fn plain_envelope(conn: &Connection, msg_id: &str) -> Result<String, MailboxError> {
    let stored: Option<String> = conn
        .query_row(
            "SELECT envelope FROM messages WHERE id = ?1",
            [msg_id],
            |r| r.get(0),
        )
        .optional()?;
    stored.ok_or_else(|| MailboxError::NotFound(format!("no message {msg_id}")))
}

/// The peer accepted the row over the LAN (`accepted` or `duplicate`): `delivered`, via `lan`,
/// wire bytes dropped. A `repush` row, one a relay accepted meanwhile, and one an alert already
/// ended while the attempt was under way (`expired`, `unconfirmed`, `undelivered`:
/// [`PEER_SETTLES_SQL`]) are settled too: the peer has it, and its word wins. Returns whether
/// it changed.
pub fn delivered_lan(
    conn: &Connection,
    msg_id: &str,
    host: &str,
    now_ms: i64,
) -> Result<bool, MailboxError> {
    let n = conn.execute(
        &format!(
            "UPDATE outbox SET state = 'delivered', via = 'lan', settled_at = ?3, last_error = NULL,
               wire = NULL
             WHERE msg_id = ?1 AND host = ?2 AND state IN {PEER_SETTLES_SQL}"
        ),
        params![msg_id, host, now_ms],
    )?;
    Ok(n == 1)
}

/// The peer refused the row over the LAN (`rejected:<why>`): state `rejected` with the reason,
/// wire bytes dropped (`wire.md` §4: the sender is alerted by the caller, in the same
/// transaction); a `repush` row too (`wire.md` §3.5 "Settle": `rejected` is the LAN rejection
/// of a re-push). Returns whether it changed.
pub fn rejected_lan(
    conn: &Connection,
    msg_id: &str,
    host: &str,
    why: &str,
    now_ms: i64,
) -> Result<bool, MailboxError> {
    let n = conn.execute(
        &format!(
            "UPDATE outbox SET state = 'rejected', via = 'lan', settled_at = ?3, last_error = ?4,
           wire = NULL
         WHERE msg_id = ?1 AND host = ?2 AND state IN {SENDABLE_SQL}"
        ),
        params![msg_id, host, now_ms, cut_error(why)],
    )?;
    Ok(n == 1)
}

/// The peer `host` rotated its host key from `old_pub` to `new_pub` (`wire.md` §2.10,
/// "Resolved details: Resealing"): every `pending` or `repush` row still aimed at `old_pub` now
/// targets `new_pub` (a new target key, so a new dedup key at the relay), its wire bytes sealed
/// for the old target are dropped so the next attempt seals for the new one, and it is due at
/// `now_ms`. A `repush` row keeps its state, `accepted_at` and `deadline_at`: the relay that
/// accepted it may have lost it (that is why it is re-pushed), and the old key is revoked there,
/// so the same bytes for the old key could only be refused `target not enrolled`; a copy the
/// relay still holds was moved to the new key, and the receiver's dedup by envelope id absorbs
/// the second one. Rows a relay holds (`relay-accepted`) keep their target and bytes (the relay
/// moves its queued copy to the new key): their receipts or deadlines settle them, and should
/// one become `repush` later, [`repush_for_epoch`] retargets it ([`follow_rotations`]).
/// Returns how many rows moved; run it in the transaction that moves the pin.
pub fn retarget(
    conn: &Connection,
    host: &str,
    old_pub: &str,
    new_pub: &str,
    now_ms: i64,
) -> Result<usize, MailboxError> {
    Ok(conn.execute(
        &format!(
            "UPDATE outbox SET target_pubkey = ?3, wire = NULL, wire_hash = NULL,
               next_at = MIN(next_at, ?4)
             WHERE host = ?1 AND target_pubkey = ?2 AND state IN {SENDABLE_SQL}"
        ),
        params![host, old_pub, new_pub, now_ms],
    )?)
}

/// Retargets sendable rows whose peer rotated away from their target key since ([`retarget`]
/// for rows it could not reach then, e.g. a `relay-accepted` row that a new epoch made
/// `repush`): every `pending` or `repush` row — only `msg_id`'s when given — whose
/// `target_pubkey` is one of its peer's retired keys (`peers.prev_keys`, i.e. a rotation this
/// host verified) while the peer is pinned with another key now targets the pinned key, drops
/// its wire bytes (the next attempt seals for the new key) and is due at `now_ms`. A row aimed
/// at a key the peer never rotated away from (e.g. a host unpaired and paired again under the
/// same name) is never moved. Accept time and deadline are kept. Returns how many rows moved.
/// Errors: storage faults.
pub fn follow_rotations(
    conn: &Connection,
    msg_id: Option<&str>,
    now_ms: i64,
) -> Result<usize, MailboxError> {
    Ok(conn.execute(
        &format!(
            "UPDATE outbox SET
               target_pubkey = (SELECT p.pubkey FROM peers p WHERE p.host = outbox.host),
               wire = NULL, wire_hash = NULL, next_at = MIN(next_at, ?2)
             WHERE state IN {SENDABLE_SQL} AND (?1 IS NULL OR msg_id = ?1)
               AND EXISTS (
                 SELECT 1 FROM peers p, json_each(p.prev_keys) AS r
                 WHERE p.host = outbox.host AND p.pubkey IS NOT NULL
                   AND p.pubkey <> outbox.target_pubkey
                   AND CASE r.type
                         WHEN 'text' THEN r.value
                         WHEN 'object' THEN json_extract(r.value, '$.key')
                       END = outbox.target_pubkey)"
        ),
        params![msg_id, now_ms],
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
    /// The row is no longer `pending` or `repush` (settled meanwhile): nothing changed.
    Gone,
}

/// Records a failed LAN attempt (network error, or an HTTP answer that is no verdict;
/// `wire.md` §4 "Outbox client"): when the 72 h rule applies ([`past_give_up`]: a `pending`
/// row more than 72 h old that no relay ever accepted) it becomes `undelivered`; else (always
/// for a `repush` row) `attempts` + 1, `lan_failures` + 1, `next_at = now + min(5 s·2^attempts_before,
/// 1 h)`, `last_error` cut to 300 characters.
pub fn fail_lan(
    conn: &Connection,
    msg_id: &str,
    host: &str,
    error: &str,
    now_ms: i64,
) -> Result<Failure, MailboxError> {
    let Some(f) = pending_facts(conn, msg_id, host)? else {
        return Ok(Failure::Gone);
    };
    if past_give_up(&f.state, f.created_at, f.accepted_at, now_ms) {
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
            now_ms + backoff_ms(f.attempts),
            cut_error(error)
        ],
    )?;
    Ok(Failure::Retry)
}

/// A delivery receipt (delivered or later) from `host` for `msg_id` arrived (spec §9): a row
/// still `pending`, `repush` or `relay-accepted` is `delivered`, and so is one the sender was
/// already told about (`unconfirmed`, `expired`, `undelivered`, e.g. a push whose answer was
/// lost while the relay had committed, then ended by the 72 h rule: the receipt proves the host
/// has it after all; [`PEER_SETTLES_SQL`]). `via` is kept, or set to `relay` for a row a relay
/// accepted and `receipt` otherwise; the wire bytes are dropped (already gone for a row that
/// was final). A `rejected` row stays rejected. Returns whether it changed.
pub fn settle_by_receipt(
    conn: &Connection,
    msg_id: &str,
    host: &str,
    now_ms: i64,
) -> Result<bool, MailboxError> {
    let n = conn.execute(
        &format!(
            "UPDATE outbox SET state = 'delivered', settled_at = ?3, last_error = NULL, wire = NULL,
               via = COALESCE(via, CASE WHEN accepted_at IS NOT NULL THEN 'relay' ELSE 'receipt' END)
             WHERE msg_id = ?1 AND host = ?2 AND state IN {PEER_SETTLES_SQL}"
        ),
        params![msg_id, host, now_ms],
    )?;
    Ok(n == 1)
}

/// Why a relay's accepted rows must be pushed again (`wire.md` §3.5 "Epoch change / rewind").
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Repush {
    /// The relay shows another epoch (info, a push accept, a pull page or a 409): rows accepted
    /// in any other epoch go again.
    Epoch,
    /// The relay went back in time within its epoch (`head_seq` below `received_through`, or
    /// an ack answered BAD_ACK): every row it accepted goes again.
    Rewind,
}

impl Repush {
    /// The word in `last_error` (`relay <word>: re-push`) and in the audit: `epoch`, `rewind`.
    pub fn as_str(self) -> &'static str {
        match self {
            Repush::Epoch => "epoch",
            Repush::Rewind => "rewind",
        }
    }
}

/// `attempts` of a row made `repush` (`wire.md` §3.5 "Epoch change / rewind": attempts=2). A
/// re-push is not a first attempt; in this outbox `attempts` only sets the backoff of the next
/// failure ([`backoff_ms`]), while the LAN-or-relay choice counts `lan_failures`
/// ([`super::lane`]), which a re-push leaves as it was.
pub const REPUSH_ATTEMPTS: u32 = 2;

/// The relay `relay` showed a new epoch `epoch` or went back in time (spec §5 "On seeing a new
/// epoch"; `wire.md` §3.5 "Epoch change / rewind"): every `relay-accepted` row of that relay
/// without a delivery receipt from its host (for [`Repush::Epoch`] only those accepted in
/// another epoch), and every `repush` row of it, becomes `repush`: due now, `attempts`
/// [`REPUSH_ATTEMPTS`], `last_error` `relay <why>: re-push`, the same wire bytes, `accepted_at`
/// and `deadline_at` kept. Relay dedup answers `duplicate` where the store still holds the
/// item. A row whose peer rotated its key since it was accepted is retargeted to the pinned key
/// and resealed ([`follow_rotations`]; the old key is revoked at the relay). Run it in the
/// transaction that resets the receive position. Returns how many rows became (or stayed)
/// `repush`.
pub fn repush_for_epoch(
    conn: &Connection,
    relay: &str,
    epoch: &str,
    why: Repush,
    now_ms: i64,
) -> Result<usize, MailboxError> {
    let n = conn.execute(
        "UPDATE outbox SET state = 'repush', next_at = ?3, attempts = ?6, last_error = ?4
         WHERE relay = ?1
           AND (state = 'repush'
                OR (state = 'relay-accepted' AND (?5 OR epoch IS NOT ?2)
                    AND NOT EXISTS (SELECT 1 FROM remote_receipts r
                                    WHERE r.msg_id = outbox.msg_id AND r.host = outbox.host)))",
        params![
            relay,
            epoch,
            now_ms,
            format!("relay {}: re-push", why.as_str()),
            why == Repush::Rewind,
            REPUSH_ATTEMPTS
        ],
    )?;
    if n > 0 {
        follow_rotations(conn, None, now_ms)?;
    }
    Ok(n)
}

/// Ends a row the verified expiry notice of relay `relay` (its URL; a trailing `/` is ignored)
/// names (spec §6): a `relay-accepted` or `repush` row that this relay accepted (its `relay`)
/// becomes `expired` with `last_error` `reason` (cut to 300 characters), `settled_at` now, wire
/// bytes dropped. Run it in the transaction that alerts the sender. Returns whether it changed
/// (false: the row is final already, e.g. `delivered`, and stays so; or no relay accepted it,
/// or another one did: one relay's notice says nothing about another relay's copy).
pub fn expire(
    conn: &Connection,
    msg_id: &str,
    host: &str,
    relay: &str,
    reason: &str,
    now_ms: i64,
) -> Result<bool, MailboxError> {
    let n = conn.execute(
        "UPDATE outbox SET state = 'expired', settled_at = ?3, last_error = ?4, wire = NULL
         WHERE msg_id = ?1 AND host = ?2 AND state IN ('relay-accepted', 'repush')
           AND relay = ?5",
        params![
            msg_id,
            host,
            now_ms,
            cut_error(reason),
            relay.trim_end_matches('/')
        ],
    )?;
    Ok(n == 1)
}

/// Rows past their deadline with no delivery receipt (`wire.md` §3.5 "Settle"): `relay-accepted`
/// or `repush` with `deadline_at` ≤ `now_ms`, earliest deadline first, at most `limit`.
pub fn overdue(conn: &Connection, now_ms: i64, limit: usize) -> Result<Vec<Row>, MailboxError> {
    let mut st = conn.prepare(&format!(
        "SELECT {COLS} FROM outbox o
         WHERE o.state IN ('relay-accepted', 'repush') AND o.deadline_at <= ?1
         ORDER BY o.deadline_at, o.msg_id, o.host LIMIT ?2"
    ))?;
    let rows = st
        .query_map(params![now_ms, limit as i64], row)?
        .collect::<Result<Vec<_>, _>>()?;
    Ok(rows)
}

/// Ends one row [`overdue`] found: a `relay-accepted` or `repush` row whose `deadline_at` is at
/// or before `now_ms` becomes `unconfirmed` with `last_error` `reason`, `settled_at` now, wire
/// bytes dropped. Run it in the transaction that alerts the sender. Returns whether it changed.
pub fn unconfirm(
    conn: &Connection,
    msg_id: &str,
    host: &str,
    reason: &str,
    now_ms: i64,
) -> Result<bool, MailboxError> {
    let n = conn.execute(
        "UPDATE outbox SET state = 'unconfirmed', settled_at = ?3, last_error = ?4, wire = NULL
         WHERE msg_id = ?1 AND host = ?2 AND state IN ('relay-accepted', 'repush')
           AND deadline_at <= ?3",
        params![msg_id, host, now_ms, cut_error(reason)],
    )?;
    Ok(n == 1)
}

/// What the outbox holds for one relay (`relay info`): rows waiting for any transport, and the
/// rows of `relay` by state.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct RelayCounts {
    /// `pending` rows (any transport).
    pub queued: i64,
    /// `relay-accepted` rows of this relay (waiting for the target's receipt).
    pub relay_accepted: i64,
    /// `repush` rows of this relay (to be pushed again after a new epoch or a rewind).
    pub repush: i64,
    /// `unconfirmed` rows of this relay (no receipt by the deadline; the sender was alerted).
    pub unconfirmed: i64,
    /// `expired` rows of this relay (the relay's notice; the sender was alerted).
    pub expired: i64,
}

/// [`RelayCounts`] for `relay` (its URL; a trailing `/` is ignored). Errors: SQLite failures.
pub fn relay_counts(conn: &Connection, relay: &str) -> Result<RelayCounts, MailboxError> {
    let relay = relay.trim_end_matches('/');
    Ok(conn.query_row(
        "SELECT (SELECT COUNT(*) FROM outbox WHERE state = 'pending'),
                COALESCE(SUM(state = 'relay-accepted'), 0), COALESCE(SUM(state = 'repush'), 0),
                COALESCE(SUM(state = 'unconfirmed'), 0), COALESCE(SUM(state = 'expired'), 0)
         FROM outbox WHERE relay = ?1",
        [relay],
        |r| {
            Ok(RelayCounts {
                queued: r.get(0)?,
                relay_accepted: r.get(1)?,
                repush: r.get(2)?,
                unconfirmed: r.get(3)?,
                expired: r.get(4)?,
            })
        },
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
mod tests;

#[cfg(test)]
mod wire_tests;

/// "Peer is back" (`wire.md` §4, spec §10): a verified hop from `host` shows it is up, so every
/// `pending` or `repush` row for it becomes due now (`next_at` = `now_ms` where it was later) and goes over the
/// LAN again: its LAN failure count drops to at most one below the handover threshold, so a row
/// the relay was taking gets one more LAN attempt at once. (Not to 0: a peer that can reach us
/// but that we cannot reach would otherwise keep its rows off the relay for good, each of its
/// hops undoing the LAN failures in between.) Rows a relay holds (`relay-accepted`) are not
/// touched; a `repush` row may go over the LAN like a pending one. The
/// receipts owed to `host` get the same treatment ([`super::receipts::peer_is_back`]). Returns
/// how many outbox rows changed.
pub fn peer_is_back(conn: &Connection, host: &str, now_ms: i64) -> Result<usize, MailboxError> {
    super::receipts::peer_is_back(conn, host, now_ms)?;
    Ok(conn.execute(
        "UPDATE outbox SET next_at = MIN(next_at, ?2), lan_failures = MIN(lan_failures, ?3)
         WHERE host = ?1 AND state IN ('pending', 'repush') AND (next_at > ?2 OR lan_failures > ?3)",
        params![host, now_ms, LAN_FAILURES_BEFORE_RELAY - 1],
    )?)
}

#[cfg(test)]
mod durability_tests;
