//! Delivery receipts in the host store (spec §9, `wire.md` §2.11, §4 "Receipts client"):
//!
//! - `receipt_outbox`: receipts this host owes the hosts that sent it mail. The schema-v2
//!   triggers on `deliveries` queue a row in the transaction that changes a delivery of a
//!   message from a peer (`new` is sent as `delivered`). A row is signed once (by
//!   `crate::node::outbound`; this store keeps the bytes, [`set_wire`]), sent over the LAN or
//!   the relay ([`super::lane`] decides, as for mail), deleted when the peer or a verified
//!   relay accept took it ([`sent`]), backed off on failure ([`fail`]), and dropped unsent
//!   after 72 h ([`expire`]: receipts are advisory).
//! - `remote_receipts`: what peers reported for mail this host sent (written by
//!   `node::receipts::accept`), read back with the outbox by [`sent_page`] (`GET /v1/sent`).
//!
//! This module never talks to the network; every function runs in the caller's connection or
//! transaction.

use std::collections::BTreeSet;

use rusqlite::{params, Connection, OptionalExtension};
use serde::Serialize;
use serde_json::Value;

use agentmbx_protocol::limits::utf16_len;
use agentmbx_protocol::records::Receipt;
use agentmbx_protocol::time::iso_ms;

use super::lane::{lan_takes_sql, LAN_FAILURES_BEFORE_RELAY};
use super::schedule::{backoff_ms, cut_error, due_sql, horizon_sql, wake_sql};
use super::MailboxError;

pub use super::messages::{check_note, MAX_NOTE};

/// Receipts per request and per host in one pass (`wire.md` §4: `POST /v1/receipts` ≤200).
pub const RECEIPT_BATCH: usize = 200;
/// Unsent receipts are dropped after this long (ms): 72 h (`wire.md` §2.11).
pub const RECEIPT_TTL_MS: i64 = 72 * 3_600_000;
/// Retry delay for a peer that does not know `POST /v1/receipts` (ms): 1 h (`wire.md` §2.11).
pub const UNSUPPORTED_RETRY_MS: i64 = 3_600_000;
/// How a receipt's `last_error` starts when the peer does not know `POST /v1/receipts`: the
/// mark that its `next_at` may be [`UNSUPPORTED_RETRY_MS`] ahead ([`horizon_of_sql`]).
pub const UNSUPPORTED_ERROR_PREFIX: &str = "receipts unsupported by the peer: ";

/// How far ahead of now a receipt's `next_at` can legitimately be (ms), in SQL over a
/// `receipt_outbox r`: the delay its last failure chose ([`fail`]): [`UNSUPPORTED_RETRY_MS`]
/// after a peer that does not know receipts (`last_error` starts with
/// [`UNSUPPORTED_ERROR_PREFIX`]), else the outbox rule
/// ([`super::schedule::max_horizon_ms`]`(attempts)`; 0 for a new receipt, queued due now). A
/// receipt scheduled further ahead was scheduled by a clock that was ahead (a skew fixed
/// since): it is due now.
pub fn horizon_of_sql() -> String {
    format!(
        "(CASE WHEN r.attempts > 0 AND substr(r.last_error, 1, {}) = '{}' THEN {UNSUPPORTED_RETRY_MS} ELSE {} END)",
        UNSUPPORTED_ERROR_PREFIX.len(),
        UNSUPPORTED_ERROR_PREFIX,
        horizon_sql("r.attempts")
    )
}

fn receipt_due_sql() -> String {
    due_sql("r.next_at", &horizon_of_sql())
}

fn receipt_wake_sql() -> String {
    wake_sql("r.next_at", &horizon_of_sql())
}

/// A queued receipt.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Row {
    /// `receipt_outbox.seq`: the receipt's `seq` on the wire.
    pub seq: i64,
    /// The message the receipt is about.
    pub msg_id: String,
    /// The local agent the message was delivered to.
    pub agent: String,
    /// The peer the receipt is owed to (the message's origin).
    pub host: String,
    /// `delivered`, `read` or `acked`.
    pub state: String,
    /// The agent's ack note, if any.
    pub note: Option<String>,
    /// When the delivery changed (ms).
    pub at: i64,
    /// Failed attempts so far.
    pub attempts: u32,
    /// Failed LAN attempts since the peer was last heard from (spec §10).
    pub lan_failures: u32,
    /// Next attempt (ms).
    pub next_at: i64,
    /// The signed wire `{rec, sig}` once made.
    pub wire: Option<Vec<u8>>,
    /// The peer's pinned host key (the relay target), when the peer is pinned.
    pub target_pubkey: Option<String>,
}

const COLS: &str = "r.seq, r.msg_id, r.agent, r.host, r.state, r.note, r.at, r.attempts, r.lan_failures, r.next_at, r.wire, p.pubkey";

fn row(r: &rusqlite::Row<'_>) -> rusqlite::Result<Row> {
    Ok(Row {
        seq: r.get(0)?,
        msg_id: r.get(1)?,
        agent: r.get(2)?,
        host: r.get(3)?,
        state: r.get(4)?,
        note: r.get(5)?,
        at: r.get(6)?,
        attempts: r.get(7)?,
        lan_failures: r.get(8)?,
        next_at: r.get(9)?,
        wire: r.get(10)?,
        target_pubkey: r.get(11)?,
    })
}

/// The LAN part of the selection rule ([`super::lane`]) for a `receipt_outbox r` row joined
/// with `peers p`.
fn lan_sql() -> String {
    lan_takes_sql("r.lan_failures")
}

/// Due receipts the LAN takes (same rule as mail, [`super::lane`]): the peer is
/// pinned with a LAN address and the LAN failed fewer than twice (or no relay is configured).
/// Oldest first, at most `limit`.
pub fn due_for_lan(
    conn: &Connection,
    now_ms: i64,
    limit: usize,
    relay_configured: bool,
) -> Result<Vec<Row>, MailboxError> {
    due_for_lan_except(conn, now_ms, limit, relay_configured, &[])
}

/// [`due_for_lan`] leaving out the receipts owed to the peers in `exclude` (a LAN call to them
/// is still open) inside the query, so a busy peer never fills the `limit`.
pub fn due_for_lan_except(
    conn: &Connection,
    now_ms: i64,
    limit: usize,
    relay_configured: bool,
    exclude: &[String],
) -> Result<Vec<Row>, MailboxError> {
    let sql = format!(
        "SELECT {COLS} FROM receipt_outbox r JOIN peers p ON p.host = r.host
         WHERE {} AND {} AND r.host NOT IN (SELECT value FROM json_each(:ex))
         ORDER BY r.seq LIMIT :limit",
        receipt_due_sql(),
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

/// Due receipts the relay takes: the peer is pinned (its key is the target) and the LAN failed
/// twice or the peer has no LAN address. Oldest first, at most `limit`.
pub fn due_for_relay(
    conn: &Connection,
    now_ms: i64,
    limit: usize,
) -> Result<Vec<Row>, MailboxError> {
    let sql = format!(
        "SELECT {COLS} FROM receipt_outbox r JOIN peers p ON p.host = r.host
         WHERE {} AND NOT COALESCE(({}), 0) ORDER BY r.seq LIMIT :limit",
        receipt_due_sql(),
        lan_sql()
    );
    super::select_due(conn, &sql, now_ms, limit, true, row)
}

/// The earliest time (ms) a receipt the LAN takes is due at `now_ms` (`now_ms` for one
/// scheduled beyond its horizon, [`horizon_of_sql`]), for the LAN loop's sleep;
/// receipts owed to the peers in `exclude` (a LAN call to them is still open) are left out.
pub fn next_due_for_lan(
    conn: &Connection,
    relay_configured: bool,
    now_ms: i64,
    exclude: &[String],
) -> Result<Option<i64>, MailboxError> {
    let exclude = serde_json::to_string(exclude).unwrap_or_else(|_| "[]".into());
    let sql = format!(
        "SELECT MIN({}) FROM receipt_outbox r JOIN peers p ON p.host = r.host WHERE {}
           AND r.host NOT IN (SELECT value FROM json_each(:ex))",
        receipt_wake_sql(),
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

/// The earliest time (ms) a receipt the relay takes is due at `now_ms` (`now_ms` for one
/// scheduled beyond its horizon, [`horizon_of_sql`]), for the relay loop's sleep.
pub fn next_due_for_relay(conn: &Connection, now_ms: i64) -> Result<Option<i64>, MailboxError> {
    let sql = format!(
        "SELECT MIN({}) FROM receipt_outbox r JOIN peers p ON p.host = r.host
         WHERE NOT COALESCE(({}), 0)",
        receipt_wake_sql(),
        lan_sql()
    );
    Ok(conn.query_row(
        &sql,
        rusqlite::named_params! {":t": LAN_FAILURES_BEFORE_RELAY, ":r": true, ":now": now_ms},
        |r| r.get(0),
    )?)
}

/// The record for a queued row (`wire.md` §2.11): recipient `<agent>@<own_host>`, `at` in ISO
/// `Z` form, `note` omitted when empty, `seq` the row's seq. An ack note is refused over
/// [`MAX_NOTE`] at the door ([`check_note`]); a longer one stored by an older version is cut
/// to it here so the receipt stays valid.
pub fn record(row: &Row, own_host: &str) -> Receipt {
    let note = row.note.as_deref().filter(|n| !n.is_empty()).map(|n| {
        let mut out = String::new();
        for c in n.chars() {
            if utf16_len(&out) + c.len_utf16() > MAX_NOTE {
                break;
            }
            out.push(c);
        }
        out
    });
    Receipt {
        v: 1,
        kind: "receipt".into(),
        msg: row.msg_id.clone(),
        recipient: format!("{}@{own_host}", row.agent),
        state: row.state.clone(),
        at: iso_ms(row.at),
        note,
        did: None,
        seq: row.seq.max(1) as u64,
    }
}

/// Persists the signed wire `canonical({rec, sig})` of queued receipt `seq` once (the relay
/// item's dedup is byte-exact, so every retry reuses it; the outbound step
/// `crate::node::outbound::receipt_wire_once` signs it). Returns the bytes now stored: the
/// given ones, or the ones an earlier attempt wrote (never overwritten). Errors: the row is
/// gone ([`MailboxError::NotFound`]), storage faults.
pub fn set_wire(conn: &Connection, seq: i64, wire: &[u8]) -> Result<Vec<u8>, MailboxError> {
    conn.execute(
        "UPDATE receipt_outbox SET wire = ?2 WHERE seq = ?1 AND wire IS NULL",
        params![seq, wire],
    )?;
    let stored: Option<Option<Vec<u8>>> = conn
        .query_row(
            "SELECT wire FROM receipt_outbox WHERE seq = ?1",
            [seq],
            |r| r.get(0),
        )
        .optional()?;
    stored
        .flatten()
        .ok_or_else(|| MailboxError::NotFound(format!("no queued receipt {seq}")))
}

/// A repeat of message `msg_id` arrived from its sender (`wire.md` §3.5 "Receive": duplicate →
/// re-queue delivery receipts): queues again, due now, one receipt for each current delivery of
/// the message (state `new` sent as `delivered`, `read`, `acked`; owed to the message's origin),
/// so a sender whose first receipt was lost or dropped after 72 h still settles its
/// relay-accepted row (spec §9). A delivery whose receipt is still queued unsent is skipped,
/// and mail sent from this host queues nothing. Run it in the transaction that found the
/// duplicate. Returns how many receipts were queued.
pub fn requeue(conn: &Connection, msg_id: &str, now_ms: i64) -> Result<usize, MailboxError> {
    Ok(conn.execute(
        "WITH cur AS (
           SELECT d.seq, d.msg_id, d.agent, m.origin AS host, d.note, d.updated_at AS at,
                  CASE d.state WHEN 'new' THEN 'delivered' ELSE d.state END AS state
           FROM deliveries d JOIN messages m ON m.id = d.msg_id
           WHERE d.msg_id = ?1 AND m.origin <> 'local')
         INSERT INTO receipt_outbox(msg_id, agent, host, state, note, at, next_at, created_at)
         SELECT msg_id, agent, host, state, note, at, ?2, ?2 FROM cur
         WHERE NOT EXISTS (SELECT 1 FROM receipt_outbox r
                           WHERE r.msg_id = cur.msg_id AND r.agent = cur.agent AND r.state = cur.state)
         ORDER BY seq",
        params![msg_id, now_ms],
    )?)
}

/// The peer (or a verified relay accept) took these receipts: they leave the queue.
pub fn sent(conn: &Connection, seqs: &[i64]) -> Result<usize, MailboxError> {
    let mut n = 0;
    for s in seqs {
        n += conn.execute("DELETE FROM receipt_outbox WHERE seq = ?1", [s])?;
    }
    Ok(n)
}

/// Records a failed attempt for each of `seqs`: `attempts` + 1, next attempt after
/// `min(5 s·2^attempts, 1 h)` (1 h for a peer that does not support receipts, `unsupported`,
/// whose `last_error` then starts with [`UNSUPPORTED_ERROR_PREFIX`]), `last_error` cut to 300
/// characters; `lan` also counts a LAN failure (spec §10).
pub fn fail(
    conn: &Connection,
    seqs: &[i64],
    error: &str,
    lan: bool,
    unsupported: bool,
    now_ms: i64,
) -> Result<(), MailboxError> {
    let error = if unsupported {
        cut_error(&format!("{UNSUPPORTED_ERROR_PREFIX}{error}"))
    } else {
        cut_error(error)
    };
    for s in seqs {
        let attempts: Option<u32> = conn
            .query_row(
                "SELECT attempts FROM receipt_outbox WHERE seq = ?1",
                [s],
                |r| r.get(0),
            )
            .optional()?;
        let Some(attempts) = attempts else { continue };
        let wait = if unsupported {
            UNSUPPORTED_RETRY_MS
        } else {
            backoff_ms(attempts)
        };
        conn.execute(
            "UPDATE receipt_outbox SET attempts = attempts + 1,
               lan_failures = lan_failures + CASE WHEN ?3 THEN 1 ELSE 0 END,
               next_at = ?2, last_error = ?4 WHERE seq = ?1",
            params![s, now_ms + wait, lan, error],
        )?;
    }
    Ok(())
}

/// Drops receipts queued more than 72 h ago (receipts are advisory: no alert) and logs
/// `receipt.expired` with the count. Returns how many were dropped.
pub fn expire(conn: &Connection, now_ms: i64) -> Result<usize, MailboxError> {
    let n = conn.execute(
        "DELETE FROM receipt_outbox WHERE created_at < ?1",
        [now_ms - RECEIPT_TTL_MS],
    )?;
    if n > 0 {
        tracing::info!(
            event = "receipt.expired",
            count = n,
            hours = 72,
            "unsent delivery receipts dropped"
        );
    }
    Ok(n)
}

/// "Peer is back" for receipts, as for mail (`outbox::peer_is_back`): every receipt owed to
/// `host` is due now and goes over the LAN again (its LAN failure count drops below the
/// handover threshold). Returns how many rows changed.
pub fn peer_is_back(conn: &Connection, host: &str, now_ms: i64) -> Result<usize, MailboxError> {
    Ok(conn.execute(
        "UPDATE receipt_outbox SET next_at = MIN(next_at, ?2), lan_failures = MIN(lan_failures, ?3)
         WHERE host = ?1 AND (next_at > ?2 OR lan_failures > ?3)",
        params![host, now_ms, LAN_FAILURES_BEFORE_RELAY - 1],
    )?)
}

// ---- the sender's view: GET /v1/sent ------------------------------------------------------------

/// Largest `GET /v1/sent` page (count).
pub const MAX_SENT_LIMIT: u32 = 100;
/// Default `GET /v1/sent` page (count).
pub const DEFAULT_SENT_LIMIT: u32 = 20;
/// Byte budget of one sent page (sum of entry JSON sizes); a page always holds ≥1 entry.
pub const MAX_SENT_BYTES: usize = 256 * 1024;

/// The delivery state of one recipient of a sent message.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, utoipa::ToSchema)]
pub struct RecipientState {
    /// `name@host` of the recipient.
    pub recipient: String,
    /// The recipient's host (this host for local recipients).
    pub host: String,
    /// Local recipients: `delivered`, `notified` (a long poll returned it), `read`, `acked`.
    /// Remote ones: the newest receipt
    /// (`delivered`, `notified`, `read`, `acked`), else from the outbox: `queued`,
    /// `relay-accepted`, `repush` (a relay accepted it, then a new epoch: pushed again),
    /// `accepted` (an agent named by `name@host`: the host took the message but no `delivered`
    /// receipt from that agent has come back; a host holds mail for a name it does not have
    /// until that agent registers), `delivered` (the host took it, for a recipient the address
    /// did not name), `undelivered`, `expired` (the relay's notice), `unconfirmed` (no receipt
    /// by the deadline).
    #[schema(value_type = crate::vocab::SentState)]
    pub state: String,
    /// ISO ms time of that state, when known.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub at: Option<String>,
    /// Why it is undelivered, expired or unconfirmed (the peer's, the relay's or the local
    /// reason); for `accepted`, what is still missing.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    /// The transport that delivered it to the host: `lan`, `relay` (remote recipients).
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(value_type = Option<crate::vocab::Via>)]
    pub via: Option<String>,
    /// `queued` and `repush` only: why the last attempt did not get it through (the outbox row's
    /// last error: a relay or LAN error text, never a secret), at most 120 characters (a longer
    /// one is cut and ends with `…`); absent before any failed attempt.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub last_error: Option<String>,
    /// `queued` remote recipients only: the relay's standing when no relay this host uses is
    /// `ok` (`<state> since <ISO ms>[: <detail>]`, e.g. `unreachable since …: connection
    /// refused`), so a LAN error in `last_error` is not the whole story; at most 120 characters.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub relay: Option<String>,
    /// `queued` and `repush` remote recipients only: the route their host's mail takes now and
    /// why (spec §10): `lan`, or `relay (LAN unreachable since <ISO ms> (<reason>), next LAN
    /// probe in <n> s)`, or `relay (no LAN address)`; "relay" only while a relay is configured
    /// (else `lan (unreachable since <ISO ms> (<reason>); no relay configured)`). Set by the API
    /// (`GET /v1/sent`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub route: Option<String>,
    /// A LAN verdict that came back after the LAN race gave up on its call (the row went to
    /// the relay) and that was not applied: a `rejected:<why>` (never applied late, whether the
    /// relay had settled the row yet or not), or a note that a late LAN accept settled a row the
    /// relay had refused. Set by the API (`GET /v1/sent`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub late_lan_verdict: Option<String>,
}

/// Longest `last_error` a sent page shows (characters; longer ones are cut and end with `…`).
pub const MAX_SENT_ERROR_CHARS: usize = 120;

/// One sent message with its per-recipient state.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, utoipa::ToSchema)]
pub struct SentMessage {
    /// Envelope id.
    pub id: String,
    /// ISO ms send time.
    pub ts: String,
    /// Recipients as addressed.
    pub to: Vec<String>,
    /// Subject.
    pub subject: String,
    /// Kind.
    #[schema(value_type = crate::vocab::Kind)]
    pub kind: String,
    /// Thread id.
    pub thread: String,
    /// Per recipient delivery state.
    pub recipients: Vec<RecipientState>,
}

/// A page of sent messages.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, utoipa::ToSchema)]
pub struct SentPage {
    /// Messages, newest first in the order this host stored them (not by `ts`, which a wrong
    /// clock may have written).
    pub messages: Vec<SentMessage>,
    /// Opaque cursor for the next (older) page; absent when this page reached the end.
    pub next_cursor: Option<String>,
}

/// The sent cursor: the local insertion position (`messages.rowid`) of the last message of the
/// previous page, in decimal. Errors: [`MailboxError::Invalid`] for anything else.
fn parse_cursor(cursor: Option<&str>) -> Result<Option<i64>, MailboxError> {
    match cursor {
        None | Some("") => Ok(None),
        Some(c) => c
            .parse::<i64>()
            .ok()
            .filter(|n| *n > 0)
            .map(Some)
            .ok_or_else(|| MailboxError::Invalid("bad cursor".into())),
    }
}

fn local_state(state: &str) -> &str {
    if state == "new" {
        "delivered"
    } else {
        state
    }
}

/// The outbox state as the sender sees it: `(state, reason, last_error)`, with the reason for
/// an undelivered, expired or unconfirmed row and the last error of a queued or re-pushed one
/// (cut to [`MAX_SENT_ERROR_CHARS`]).
fn outbox_state(
    state: &str,
    last_error: Option<String>,
) -> (String, Option<String>, Option<String>) {
    let shown = |e: Option<String>| e.filter(|e| !e.is_empty()).map(|e| cut_shown(&e));
    match state {
        "pending" => ("queued".into(), None, shown(last_error)),
        "repush" => ("repush".into(), None, shown(last_error)),
        "rejected" | "undelivered" => ("undelivered".into(), last_error, None),
        "expired" | "unconfirmed" => (state.to_string(), last_error, None),
        other => (other.to_string(), None, None),
    }
}

/// `text` cut to [`MAX_SENT_ERROR_CHARS`] characters, ending with `…` when cut.
fn cut_shown(text: &str) -> String {
    if text.chars().count() <= MAX_SENT_ERROR_CHARS {
        return text.to_string();
    }
    let mut out: String = text.chars().take(MAX_SENT_ERROR_CHARS - 1).collect();
    out.push('…');
    out
}

/// The outbox columns the sender's view reads.
struct OutboxView {
    host: String,
    state: String,
    last_error: Option<String>,
    via: Option<String>,
    settled_at: Option<i64>,
}

fn recipients_of(
    conn: &Connection,
    msg_id: &str,
    own_host: &str,
    to: &[String],
) -> Result<Vec<RecipientState>, MailboxError> {
    let mut out: Vec<RecipientState> = Vec::new();
    let mut seen = BTreeSet::new();
    let deliveries: Vec<(String, String, i64)> = conn
        .prepare(
            "SELECT agent, CASE WHEN state = 'new' AND notified_at IS NOT NULL THEN 'notified' ELSE state END,
                    CASE WHEN state = 'new' AND notified_at IS NOT NULL THEN notified_at ELSE updated_at END
             FROM deliveries WHERE msg_id = ?1 ORDER BY seq",
        )?
        .query_map([msg_id], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)))?
        .collect::<Result<_, _>>()?;
    let receipts: Vec<(String, String, String, String)> = conn
        .prepare(
            "SELECT recipient, host, state, at FROM remote_receipts WHERE msg_id = ?1 ORDER BY recipient",
        )?
        .query_map([msg_id], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?)))?
        .collect::<Result<_, _>>()?;
    let rows: Vec<OutboxView> = conn
        .prepare(
            "SELECT host, state, last_error, via, settled_at FROM outbox WHERE msg_id = ?1 ORDER BY host",
        )?
        .query_map([msg_id], |r| {
            Ok(OutboxView {
                host: r.get(0)?,
                state: r.get(1)?,
                last_error: r.get(2)?,
                via: r.get(3)?,
                settled_at: r.get(4)?,
            })
        })?
        .collect::<Result<_, _>>()?;
    let via_of = |host: &str| {
        rows.iter()
            .find(|r| r.host == host)
            .and_then(|r| r.via.clone())
            .filter(|v| v == "lan" || v == "relay")
    };
    let local = |out: &mut Vec<RecipientState>, agent: &str, state: &str, at: i64| {
        out.push(RecipientState {
            recipient: format!("{agent}@{own_host}"),
            host: own_host.to_string(),
            state: local_state(state).to_string(),
            at: Some(iso_ms(at)),
            reason: None,
            via: None,
            last_error: None,
            relay: None,
            route: None,
            late_lan_verdict: None,
        });
    };
    for addr in to {
        let (name, host) = match addr.split_once('@') {
            Some((n, h)) => (n, h),
            None => (addr.as_str(), own_host),
        };
        let label = format!("{name}@{host}");
        if !seen.insert(label.clone()) {
            continue;
        }
        if host == own_host {
            if let Some((agent, state, at)) = deliveries.iter().find(|d| d.0 == name) {
                local(&mut out, agent, state, *at);
            }
            continue;
        }
        if let Some((recipient, h, state, at)) = receipts.iter().find(|r| r.0 == label) {
            out.push(RecipientState {
                recipient: recipient.clone(),
                host: h.clone(),
                state: state.clone(),
                at: Some(at.clone()),
                reason: None,
                via: via_of(h),
                last_error: None,
                relay: None,
                route: None,
                late_lan_verdict: None,
            });
            continue;
        }
        if let Some(row) = rows.iter().find(|r| r.host == host) {
            let (mut state, mut reason, last_error) =
                outbox_state(&row.state, row.last_error.clone());
            // The host took the message; whether an agent `name` has it only its receipt says
            // (a host holds mail for a name it does not have, without a receipt).
            if state == "delivered" {
                state = "accepted".into();
                reason = Some(format!(
                    "{host} has it; no delivered receipt from {name} yet ({host} holds mail for an agent it does not have until one registers as {name})"
                ));
            }
            out.push(RecipientState {
                recipient: label,
                host: row.host.clone(),
                state,
                at: row.settled_at.map(iso_ms),
                reason,
                via: row.via.clone().filter(|v| v == "lan" || v == "relay"),
                last_error,
                relay: None,
                route: None,
                late_lan_verdict: None,
            });
        }
    }
    // Recipients the addresses did not name one by one (reported by a peer, or delivered here).
    for (agent, state, at) in &deliveries {
        if seen.insert(format!("{agent}@{own_host}")) {
            local(&mut out, agent, state, *at);
        }
    }
    for (recipient, h, state, at) in &receipts {
        if seen.insert(recipient.clone()) {
            out.push(RecipientState {
                recipient: recipient.clone(),
                host: h.clone(),
                state: state.clone(),
                at: Some(at.clone()),
                reason: None,
                via: via_of(h),
                last_error: None,
                relay: None,
                route: None,
                late_lan_verdict: None,
            });
        }
    }
    // Hosts the message went to that no line shows yet: reached by a bare name, `*` or
    // `role:R` (routed to a peer when sent), with no receipt from there so far. Their outbox
    // row is the only word on them (queued, relay-accepted, delivered or undelivered).
    let covered: BTreeSet<String> = out.iter().map(|r| r.host.clone()).collect();
    let delivered_here: BTreeSet<&str> = deliveries.iter().map(|d| d.0.as_str()).collect();
    for row in rows.iter().filter(|r| !covered.contains(&r.host)) {
        let (state, reason, last_error) = outbox_state(&row.state, row.last_error.clone());
        for label in unqualified_labels(conn, to, &row.host, &delivered_here)? {
            if seen.insert(label.clone()) {
                out.push(RecipientState {
                    recipient: label,
                    host: row.host.clone(),
                    state: state.clone(),
                    at: row.settled_at.map(iso_ms),
                    reason: reason.clone(),
                    via: row.via.clone().filter(|v| v == "lan" || v == "relay"),
                    last_error: last_error.clone(),
                    relay: None,
                    route: None,
                    late_lan_verdict: None,
                });
            }
        }
    }
    Ok(out)
}

/// How the addresses of `to` that name no host could have reached peer `host`, each as
/// `<address>@<host>`: `*` and `role:R` (every paired host), and a bare name that was not
/// delivered here and that the agent directory lists on `host`. When none can be told, the
/// first address that names no host (or `*`) stands for them.
fn unqualified_labels(
    conn: &Connection,
    to: &[String],
    host: &str,
    delivered_here: &BTreeSet<&str>,
) -> Result<Vec<String>, MailboxError> {
    let unqualified: Vec<&str> = to
        .iter()
        .map(String::as_str)
        .filter(|a| !a.contains('@') && *a != super::agents::OWNER)
        .collect();
    let mut labels = Vec::new();
    for a in &unqualified {
        let reached = if *a == "*" || a.starts_with("role:") {
            true
        } else {
            !delivered_here.contains(a)
                && conn
                    .query_row(
                        "SELECT 1 FROM agents WHERE name = ?1 AND host = ?2",
                        params![a, host],
                        |_| Ok(()),
                    )
                    .optional()?
                    .is_some()
        };
        if reached {
            labels.push(format!("{a}@{host}"));
        }
    }
    if labels.is_empty() {
        labels.push(format!(
            "{}@{host}",
            unqualified.first().copied().unwrap_or("*")
        ));
    }
    Ok(labels)
}

/// The relay's standing for a `queued` recipient ([`RecipientState::relay`]): `None` when no
/// relay state is recorded (no relay used) or one relay is `ok`; else the newest recorded one,
/// `<state> since <at>[: <detail>]`, cut as `last_error` is. Reads the relay loop's kv
/// `relay-state:<url>` records (`transport::relay_client::state`).
fn relay_trouble(conn: &Connection) -> Result<Option<String>, MailboxError> {
    let states: Vec<Value> = conn
        .prepare("SELECT v FROM kv WHERE k LIKE 'relay-state:%'")?
        .query_map([], |r| r.get::<_, String>(0))?
        .filter_map(|v| v.ok().and_then(|v| serde_json::from_str(&v).ok()))
        .collect();
    let field = |v: &Value, k: &str| v.get(k).and_then(Value::as_str).map(str::to_string);
    if states
        .iter()
        .any(|v| field(v, "state").as_deref() == Some("ok"))
    {
        return Ok(None);
    }
    let newest = states
        .iter()
        .filter_map(|v| Some((field(v, "at")?, field(v, "state")?, field(v, "detail"))))
        .max();
    Ok(newest.map(|(at, state, detail)| {
        let text = match detail {
            Some(d) => format!("{state} since {at}: {d}"),
            None => format!("{state} since {at}"),
        };
        cut_shown(&text)
    }))
}

/// A page of the messages `agent` sent from this host, newest first, after `cursor`, bounded
/// by `limit` (1..=100) and [`MAX_SENT_BYTES`], each with its per-recipient state. "Newest" is
/// the order this host stored them in (`messages.rowid`; the store is never vacuumed, so rowids
/// keep their order), never a stored time: a send time written while the clock was wrong
/// (e.g. ahead, then fixed) does not reorder the list, and the cursor follows the same order.
/// Errors: [`MailboxError::Invalid`] for a bad cursor.
pub fn sent_page(
    conn: &Connection,
    agent: &str,
    own_host: &str,
    cursor: Option<&str>,
    limit: u32,
) -> Result<SentPage, MailboxError> {
    let before = parse_cursor(cursor)?.unwrap_or(i64::MAX);
    let limit = limit.clamp(1, MAX_SENT_LIMIT);
    let mut st = conn.prepare(
        "SELECT id, ts, subject, kind, thread, envelope, rowid FROM messages
         WHERE origin = 'local' AND from_addr = ?1 AND rowid < ?2
         ORDER BY rowid DESC LIMIT ?3",
    )?;
    let found: Vec<(String, String, String, String, String, String, i64)> = st
        .query_map(
            params![format!("{agent}@{own_host}"), before, limit + 1],
            |r| {
                Ok((
                    r.get(0)?,
                    r.get(1)?,
                    r.get(2)?,
                    r.get(3)?,
                    r.get(4)?,
                    r.get(5)?,
                    r.get(6)?,
                ))
            },
        )?
        .collect::<Result<_, _>>()?;
    let relay_trouble = relay_trouble(conn)?;
    let mut messages = Vec::new();
    let mut bytes = 0usize;
    let mut last: Option<i64> = None;
    let mut cut = false;
    for (i, (id, ts, subject, kind, thread, env, rowid)) in found.into_iter().enumerate() {
        if i as u32 >= limit {
            cut = true;
            break;
        }
        let to: Vec<String> = serde_json::from_str::<Value>(&env)
            .ok()
            .and_then(|v| {
                v.get("to").and_then(Value::as_array).map(|a| {
                    a.iter()
                        .filter_map(Value::as_str)
                        .map(String::from)
                        .collect()
                })
            })
            .unwrap_or_default();
        let mut recipients = recipients_of(conn, &id, own_host, &to)?;
        for r in recipients
            .iter_mut()
            .filter(|r| r.state == "queued" && r.host != own_host)
        {
            r.relay = relay_trouble.clone();
        }
        let entry = SentMessage {
            id,
            ts,
            to,
            subject,
            kind,
            thread,
            recipients,
        };
        let size = serde_json::to_string(&entry).map_or(0, |s| s.len());
        if !messages.is_empty() && bytes + size > MAX_SENT_BYTES {
            cut = true;
            break;
        }
        bytes += size;
        last = Some(rowid);
        messages.push(entry);
    }
    Ok(SentPage {
        messages,
        next_cursor: if cut {
            last.map(|n| n.to_string())
        } else {
            None
        },
    })
}

#[cfg(test)]
mod tests;
