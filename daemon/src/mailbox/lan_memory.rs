//! Per-peer LAN memory (spec §10; issue 22 part 2): the decision "this peer's LAN address does
//! not answer", kept on the peer (`peers.lan_down_since`, `lan_down_reason`, `lan_probe_at`,
//! `lan_probe_fails`), not per row, so it is paid once and not by every message.
//!
//! - [`mark_down`] records the decision (spec §10: two failed LAN attempts, or the address
//!   unreachable) and, in the caller's transaction, switches every row and receipt for the peer
//!   that the LAN was taking to the relay: their `next_at` becomes now, so the first relay push
//!   does not wait out the LAN backoff. Rows already on the relay route and backing off there
//!   are not re-timed. While the mark is set and a relay is configured, the rule of
//!   [`super::lane`] gives every queued and new row and receipt for the peer to the relay.
//! - The mark clears only when the address answers again ([`clear`]): a background probe
//!   ([`due_probes`], [`probe_failed`] with its own backoff, [`probe_delay_ms`]) that got the
//!   peer's signed enc key within the LAN race, or an address proven by the peer's signed
//!   status (presence healing). Clearing makes the peer's queued rows due now with one more LAN
//!   try (`outbox::peer_is_back`); the backoff count is kept across marks until a real LAN
//!   delivery succeeds ([`lan_delivered`]) or the peer stays unmarked for [`STABLE_MS`].
//! - An inbound hop from the peer proves it is alive, not that its address answers:
//!   [`alive`] brings the next probe forward (at most one probe per [`PROBE_FIRST_MS`] on that
//!   account); it never clears the mark and never re-times rows on the relay route.
//!
//! SQL only: no network, no clock, no randomness (the caller passes times and the jittered
//! probe time). It never opens a transaction: every function runs in the caller's.

use rusqlite::{params, Connection, OptionalExtension};
use serde::Serialize;

use super::lane::LAN_FAILURES_BEFORE_RELAY;
use super::MailboxError;

/// First probe of a marked peer's address after the mark, and the base of the probe backoff
/// (ms): 5 s.
pub const PROBE_FIRST_MS: i64 = 5_000;
/// Longest wait between two probes of a marked peer's address (ms): 5 min.
pub const PROBE_MAX_MS: i64 = 300_000;

/// Why a peer's LAN address was marked as not answering (`peers.lan_down_reason`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum DownReason {
    /// The address refused the connection.
    Refused,
    /// No connection, or no answer (response head), within the LAN race (about 2 s) while a
    /// relay route existed; or the client's own timeout.
    Timeout,
    /// Any other network failure (no route to host, network unreachable, reset).
    Unreachable,
    /// Two failed attempts that were not network failures (e.g. 5xx answers).
    Failed,
}

impl DownReason {
    /// The stored word.
    pub fn as_str(self) -> &'static str {
        match self {
            DownReason::Refused => "refused",
            DownReason::Timeout => "timeout",
            DownReason::Unreachable => "unreachable",
            DownReason::Failed => "failed",
        }
    }
}

/// What is known of one peer's LAN address.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct LanState {
    /// The peer's handle.
    pub host: String,
    /// Its pinned LAN address, if any.
    pub addr: Option<String>,
    /// When its address was marked as not answering (ms); `None`: not marked.
    pub down_since: Option<i64>,
    /// Why ([`DownReason::as_str`]).
    pub down_reason: Option<String>,
    /// When the next probe of its address is due (ms), while marked; while not marked, when
    /// its last mark was lifted (ms), if ever.
    pub probe_at: Option<i64>,
    /// Failed probes and lifted marks since the peer was last stable ([`STABLE_MS`] unmarked,
    /// or a real LAN delivery): the exponent of the probe backoff.
    pub probe_fails: u32,
}

const COLS: &str = "host, addr, lan_down_since, lan_down_reason, lan_probe_at, lan_probe_fails";

fn state_row(r: &rusqlite::Row<'_>) -> rusqlite::Result<LanState> {
    Ok(LanState {
        host: r.get(0)?,
        addr: r.get(1)?,
        down_since: r.get(2)?,
        down_reason: r.get(3)?,
        probe_at: r.get(4)?,
        probe_fails: r.get(5)?,
    })
}

/// The LAN state of peer `host`, or `None` when it is not a peer. Errors: storage faults.
pub fn get(conn: &Connection, host: &str) -> Result<Option<LanState>, MailboxError> {
    Ok(conn
        .query_row(
            &format!("SELECT {COLS} FROM peers WHERE host = ?1"),
            [host],
            state_row,
        )
        .optional()?)
}

/// The LAN state of every peer, by handle. Errors: storage faults.
pub fn all(conn: &Connection) -> Result<Vec<LanState>, MailboxError> {
    let mut st = conn.prepare(&format!("SELECT {COLS} FROM peers ORDER BY host"))?;
    let rows = st
        .query_map([], state_row)?
        .collect::<Result<Vec<_>, _>>()?;
    Ok(rows)
}

/// The wait before probe number `fails + 1` of a marked address (ms): [`PROBE_FIRST_MS`]
/// doubled per failed probe, at most [`PROBE_MAX_MS`], times `0.75 + jitter / 2` for `jitter`
/// in `[0, 1)` (±25 %, so many daemons marked at once do not probe in step).
pub fn probe_delay_ms(fails: u32, jitter: f64) -> i64 {
    let base = PROBE_FIRST_MS
        .saturating_mul(1i64 << fails.min(16))
        .min(PROBE_MAX_MS);
    let j = jitter.clamp(0.0, 1.0);
    (base as f64 * (0.75 + j / 2.0)) as i64
}

/// The rows and receipts for `host` the LAN is taking now (its route while the peer is not
/// marked): `pending`/`repush` outbox rows and queued receipts with fewer than
/// [`LAN_FAILURES_BEFORE_RELAY`] LAN failures. Read before a failure is recorded, so the rows of
/// the failed attempt are switched too ([`mark_down`]).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct LanRoute {
    /// Outbox rows (`msg_id`).
    pub rows: Vec<String>,
    /// Receipt queue rows (`seq`).
    pub receipts: Vec<i64>,
}

/// [`LanRoute`] of `host` now. Errors: storage faults.
pub fn lan_route(conn: &Connection, host: &str) -> Result<LanRoute, MailboxError> {
    let rows = conn
        .prepare(
            "SELECT msg_id FROM outbox WHERE host = ?1 AND state IN ('pending', 'repush')
               AND lan_failures < ?2",
        )?
        .query_map(params![host, LAN_FAILURES_BEFORE_RELAY], |r| r.get(0))?
        .collect::<Result<Vec<String>, _>>()?;
    let receipts = conn
        .prepare("SELECT seq FROM receipt_outbox WHERE host = ?1 AND lan_failures < ?2")?
        .query_map(params![host, LAN_FAILURES_BEFORE_RELAY], |r| r.get(0))?
        .collect::<Result<Vec<i64>, _>>()?;
    Ok(LanRoute { rows, receipts })
}

/// How long a peer must stay unmarked (ms) before the count of its failed probes and lifted
/// marks ([`LanState::probe_fails`]) starts again from zero: 10 min. A real LAN delivery
/// resets it at once ([`lan_delivered`]).
pub const STABLE_MS: i64 = 600_000;

/// Marks `host`'s LAN address as not answering since `now_ms` for `reason`, and switches
/// `route` (read by [`lan_route`] in the same transaction, before the failure was recorded) to
/// the relay: each of those rows and receipts still queued becomes due at `now_ms` (never later
/// than it was). Rows not in `route` (already on the relay route) keep their `next_at`.
///
/// `probe_at` (ms) is when the first probe would be due for a peer never marked before
/// (`now_ms` + [`probe_delay_ms`] of 0, jittered); the kept count of failed probes and lifted
/// marks ([`LanState::probe_fails`], reset only after [`STABLE_MS`] unmarked or a real LAN
/// delivery) doubles that wait per count, at most [`PROBE_MAX_MS`] (jittered the same way), so
/// a peer that keeps failing right after each probe is probed less and less often. Returns
/// `false` (and changes nothing) when the peer is gone or already marked. Runs in the
/// caller's transaction. Errors: storage faults.
pub fn mark_down(
    conn: &Connection,
    host: &str,
    reason: DownReason,
    now_ms: i64,
    probe_at: i64,
    route: &LanRoute,
) -> Result<bool, MailboxError> {
    let first = (probe_at - now_ms).max(0);
    let cap = PROBE_MAX_MS.saturating_mul(first) / PROBE_FIRST_MS;
    let n = conn.execute(
        "UPDATE peers SET lan_down_since = ?2, lan_down_reason = ?3,
           lan_probe_fails = CASE WHEN lan_probe_at IS NOT NULL AND ?2 - lan_probe_at >= ?6
                             THEN 0 ELSE lan_probe_fails END,
           lan_probe_at = ?2 + MIN(?4 << MIN(CASE WHEN lan_probe_at IS NOT NULL
                                                    AND ?2 - lan_probe_at >= ?6
                                               THEN 0 ELSE lan_probe_fails END, 16), ?5)
         WHERE host = ?1 AND lan_down_since IS NULL",
        params![host, now_ms, reason.as_str(), first, cap, STABLE_MS],
    )?;
    if n == 0 {
        return Ok(false);
    }
    for id in &route.rows {
        conn.execute(
            "UPDATE outbox SET next_at = MIN(next_at, ?3)
             WHERE msg_id = ?1 AND host = ?2 AND state IN ('pending', 'repush')",
            params![id, host, now_ms],
        )?;
    }
    for seq in &route.receipts {
        conn.execute(
            "UPDATE receipt_outbox SET next_at = MIN(next_at, ?2) WHERE seq = ?1",
            params![seq, now_ms],
        )?;
    }
    Ok(true)
}

/// `host`'s LAN address answered again (a probe got its enc key, signed by its pinned host
/// key, within the LAN race; or an address proven by its signed status): the mark is lifted
/// and its queued rows and receipts are due now with one more LAN try (`outbox::peer_is_back`:
/// one more failure hands them back to the relay). The lift is provisional until a real LAN
/// delivery succeeds ([`lan_delivered`]): it counts in `lan_probe_fails`, so a peer marked
/// again soon after (e.g. one answering the probe but failing deliveries with 5xx) waits twice
/// as long for its next probe. `lan_probe_at` keeps the time of the lift (ms; [`STABLE_MS`]).
/// Returns whether a mark was cleared (`false`: not marked, nothing changed). Runs in the
/// caller's transaction. Errors: storage faults.
pub fn clear(conn: &Connection, host: &str, now_ms: i64) -> Result<bool, MailboxError> {
    let n = conn.execute(
        "UPDATE peers SET lan_down_since = NULL, lan_down_reason = NULL, lan_probe_at = ?2,
           lan_probe_fails = lan_probe_fails + 1
         WHERE host = ?1 AND lan_down_since IS NOT NULL",
        params![host, now_ms],
    )?;
    if n == 0 {
        return Ok(false);
    }
    super::outbox::peer_is_back(conn, host, now_ms)?;
    Ok(true)
}

/// A real LAN delivery to `host` succeeded (the peer accepted mail over its LAN address): the
/// count of failed probes and lifted marks starts again from zero. Only for an unmarked peer.
/// Errors: storage faults.
pub fn lan_delivered(conn: &Connection, host: &str) -> Result<(), MailboxError> {
    conn.execute(
        "UPDATE peers SET lan_probe_fails = 0
         WHERE host = ?1 AND lan_down_since IS NULL AND lan_probe_fails <> 0",
        [host],
    )?;
    Ok(())
}

/// A probe of `host`'s marked address got no answer in time, or not a valid one: one more
/// failed probe, the next at `now_ms` + [`probe_delay_ms`] of the new count with `jitter`
/// (`[0, 1)`), in one guarded statement. Returns the new failed-probe count, or `None` when the
/// peer is not marked (any more). Errors: storage faults.
pub fn probe_failed(
    conn: &Connection,
    host: &str,
    now_ms: i64,
    jitter: f64,
) -> Result<Option<u32>, MailboxError> {
    let factor = 0.75 + jitter.clamp(0.0, 1.0) / 2.0;
    Ok(conn
        .query_row(
            "UPDATE peers SET lan_probe_fails = lan_probe_fails + 1,
               lan_probe_at = ?2 + CAST(MIN(?3 << MIN(lan_probe_fails + 1, 16), ?4) * ?5 AS INTEGER)
             WHERE host = ?1 AND lan_down_since IS NOT NULL
             RETURNING lan_probe_fails",
            params![host, now_ms, PROBE_FIRST_MS, PROBE_MAX_MS, factor],
            |r| r.get(0),
        )
        .optional()?)
}

/// Brings the next probe of `host`'s marked address forward to `at` (ms) when it was later:
/// evidence the peer is alive (an inbound hop, a presence announcement, an mDNS sighting) that
/// does not yet show its address answers. Returns whether the probe time moved. Errors:
/// storage faults.
pub fn probe_soon(conn: &Connection, host: &str, at: i64) -> Result<bool, MailboxError> {
    let n = conn.execute(
        "UPDATE peers SET lan_probe_at = ?2
         WHERE host = ?1 AND lan_down_since IS NOT NULL
           AND (lan_probe_at IS NULL OR lan_probe_at > ?2)",
        params![host, at],
    )?;
    Ok(n == 1)
}

/// Evidence that `host` is alive that does not prove its address answers (an inbound hop, a
/// presence announcement, an mDNS sighting at its pinned address). For a marked peer it only
/// brings the next probe forward to `now_ms` + [`PROBE_FIRST_MS`] at the soonest
/// ([`probe_soon`]): however often such evidence comes, the address is probed at most once per
/// [`PROBE_FIRST_MS`] on its account, and rows on the relay route keep their `next_at` (spec §10:
/// the relay pass respects it). Returns `None` when the peer is not marked (the caller treats
/// the evidence as it always did), else `Some(whether the probe moved)`. Errors: storage faults.
pub fn alive(conn: &Connection, host: &str, now_ms: i64) -> Result<Option<bool>, MailboxError> {
    let marked = conn
        .query_row(
            "SELECT lan_down_since IS NOT NULL FROM peers WHERE host = ?1",
            [host],
            |r| r.get::<_, bool>(0),
        )
        .optional()?
        .unwrap_or(false);
    if !marked {
        return Ok(None);
    }
    Ok(Some(probe_soon(conn, host, now_ms + PROBE_FIRST_MS)?))
}

/// kv key recording that the relay refused mail for `host` with `target not enrolled`
/// (`crate::transport::select::TARGET_NOT_ENROLLED`); its value is the target key refused.
pub fn cannot_reach_kv(host: &str) -> String {
    format!("relay-cannot-reach:{host}")
}

/// The relay refused mail for `host` (pinned as `target_pubkey`) with `target not enrolled`
/// (spec §10: a row moves to the relay only once the target is enrolled): recorded for that
/// key, and a mark is lifted so the LAN takes the peer's mail again (`outbox::back_to_lan`
/// hands the row back). Without a relay route for the peer nothing is marked again
/// ([`relay_route`]). Runs in the caller's transaction. Errors: storage faults.
pub fn relay_cannot_reach(
    conn: &Connection,
    host: &str,
    target_pubkey: &str,
) -> Result<(), MailboxError> {
    super::relay_state::kv_set(conn, &cannot_reach_kv(host), target_pubkey)?;
    conn.execute(
        "UPDATE peers SET lan_down_since = NULL, lan_down_reason = NULL
         WHERE host = ?1 AND lan_down_since IS NOT NULL",
        [host],
    )?;
    Ok(())
}

/// A relay accepted mail for `host`: the target is enrolled there, a recorded refusal
/// ([`relay_cannot_reach`]) no longer holds. Errors: storage faults.
pub fn relay_reaches(conn: &Connection, host: &str) -> Result<(), MailboxError> {
    conn.execute("DELETE FROM kv WHERE k = ?1", [cannot_reach_kv(host)])?;
    Ok(())
}

/// Whether a relay route exists for `host` (spec §10), given whether a relay is configured:
/// the relay loop's last verdict (kv `relay-state:<url>`) is `ok` or `enc-ad-failed` (sending
/// works), or not recorded yet; and no `target not enrolled` refusal is recorded for the
/// peer's pinned key ([`relay_cannot_reach`]). Only then does the LAN race apply and a failure
/// mark the peer. Errors: storage faults.
pub fn relay_route(conn: &Connection, host: &str, relay: bool) -> Result<bool, MailboxError> {
    if !relay {
        return Ok(false);
    }
    let states = conn
        .prepare("SELECT v FROM kv WHERE k LIKE 'relay-state:%'")?
        .query_map([], |r| r.get::<_, String>(0))?
        .collect::<Result<Vec<_>, _>>()?;
    let usable = states.is_empty()
        || states.iter().any(|v| {
            serde_json::from_str::<serde_json::Value>(v)
                .ok()
                .and_then(|j| j.get("state").and_then(|s| s.as_str()).map(str::to_string))
                .is_some_and(|s| s == "ok" || s == "enc-ad-failed")
        });
    if !usable {
        return Ok(false);
    }
    let refused: bool = conn.query_row(
        "SELECT EXISTS (SELECT 1 FROM kv k JOIN peers p ON p.host = ?1
                        WHERE k.k = ?2 AND k.v = p.pubkey)",
        params![host, cannot_reach_kv(host)],
        |r| r.get(0),
    )?;
    Ok(!refused)
}

/// Marked peers whose probe is due at `now_ms` and who have an address to probe:
/// `(host, addr)`. Errors: storage faults.
pub fn due_probes(conn: &Connection, now_ms: i64) -> Result<Vec<(String, String)>, MailboxError> {
    let mut st = conn.prepare(
        "SELECT host, addr FROM peers
         WHERE lan_down_since IS NOT NULL AND addr IS NOT NULL AND addr <> ''
           AND COALESCE(lan_probe_at, 0) <= ?1
         ORDER BY host",
    )?;
    let rows = st
        .query_map([now_ms], |r| Ok((r.get(0)?, r.get(1)?)))?
        .collect::<Result<Vec<_>, _>>()?;
    Ok(rows)
}

/// The earliest probe time (ms) of a marked peer with an address, if any. Errors: storage
/// faults.
pub fn next_probe_at(conn: &Connection) -> Result<Option<i64>, MailboxError> {
    Ok(conn.query_row(
        "SELECT MIN(COALESCE(lan_probe_at, 0)) FROM peers
         WHERE lan_down_since IS NOT NULL AND addr IS NOT NULL AND addr <> ''",
        [],
        |r| r.get(0),
    )?)
}

/// A wait in words: `<n> s` under two minutes, else `<n> min`; `now` when due or past.
fn wait_words(ms: i64) -> String {
    if ms <= 0 {
        "now".to_string()
    } else if ms < 120_000 {
        format!("{} s", (ms + 999) / 1000)
    } else {
        format!("{} min", (ms + 59_999) / 60_000)
    }
}

/// The route `host`'s mail takes at `now_ms`, in words for `agentmbx sent` and `doctor`
/// (spec §10): `lan`; `relay (LAN unreachable since <ISO ms> (<reason>), next LAN probe in
/// <wait>)` while the peer is marked and `relay` is true (a relay is in use); `relay (no LAN
/// address)`; `lan (unreachable since <ISO ms> (<reason>); no relay configured)` when marked
/// without a relay (the LAN keeps trying). `None`: not a peer, or no route at all (no address,
/// no relay). Errors: storage faults.
pub fn route_text(
    conn: &Connection,
    host: &str,
    now_ms: i64,
    relay: bool,
) -> Result<Option<String>, MailboxError> {
    let Some(st) = get(conn, host)? else {
        return Ok(None);
    };
    let has_addr = st.addr.as_deref().is_some_and(|a| !a.is_empty());
    let reason = st.down_reason.as_deref().unwrap_or("unreachable");
    Ok(match (st.down_since, has_addr, relay) {
        (_, false, true) => Some("relay (no LAN address)".to_string()),
        (_, false, false) => None,
        (Some(since), true, true) => Some(format!(
            "relay (LAN unreachable since {} ({reason}), next LAN probe in {})",
            agentmbx_protocol::time::iso_ms(since),
            wait_words(st.probe_at.unwrap_or(now_ms) - now_ms)
        )),
        (Some(since), true, false) => Some(format!(
            "lan (unreachable since {} ({reason}); no relay configured)",
            agentmbx_protocol::time::iso_ms(since)
        )),
        (None, true, _) => Some("lan".to_string()),
    })
}

#[cfg(test)]
mod tests;
