//! The wake brake (`wire.md` §4 "Wake brake", 0.5.x `reserveWake`): which new mail may wake an
//! agent's session (a Claude Code channel notification), decided in one transaction of the
//! store so that several MCP servers for one agent never multiply wakes.
//!
//! - Wake-worthy mail ([`is_wake_worthy`]): kind `request`, `task`, `decision` or `alert`, or
//!   `needs_reply`, or an @mention of the agent (`@agent` or `@agent@host` in subject or body).
//!   `status` never wakes, even with `needs_reply` or a mention.
//! - A claim ([`claim`]) names the new messages a session saw. Each message is claimed once per
//!   agent (table `wake_claims`): a second claimer of the same message gets [`Decision::None`].
//!   The wake-worthy ones not yet woken for are *pending*. Then, in order: the agent is muted →
//!   [`Decision::Muted`] (pending mail is dropped from waking); a wake for the agent in the last
//!   [`BATCH_MS`] → [`Decision::Batched`] (pending mail is carried into the next wake: claim
//!   again with no ids after `retry_after_ms`); pending mail whose thread had
//!   [`THREAD_CAP`] wakes in the last hour is dropped from waking, and when none is left →
//!   [`Decision::ThreadCap`]; [`DAILY_CAP`] wakes for the agent in the last 24 h →
//!   [`Decision::DailyCap`]; else a wake is recorded (table `wakes`, one row per woken thread)
//!   and [`Decision::Wake`] lists the messages it covers.
//! - Rows are kept only as long as a rule looks at them: `wakes` 24 h, `wake_claims` 7 days
//!   (pruned for the agent at each claim).
//! - Mute: kv `wake-mute:<agent>` holds the end of the mute (ms since the epoch), as 0.5.x
//!   keeps it; [`mute`] sets it for 1..=[`MAX_MUTE_MINUTES`] minutes, [`unmute`] removes it.

use rusqlite::{params, Connection, OptionalExtension};
use serde::Serialize;

use super::MailboxError;

/// One wake per agent per this long (ms): 30 s; later wake-worthy mail is batched into the
/// next wake.
pub const BATCH_MS: i64 = 30_000;
/// Most wakes per agent and thread per hour: 6.
pub const THREAD_CAP: i64 = 6;
/// Most wakes per agent per 24 h: 60.
pub const DAILY_CAP: i64 = 60;
/// Longest mute (minutes): 10080 (a week).
pub const MAX_MUTE_MINUTES: u32 = 10_080;
/// Mute length when none is given (minutes): 60.
pub const DEFAULT_MUTE_MINUTES: u32 = 60;

const HOUR_MS: i64 = 3_600_000;
const DAY_MS: i64 = 24 * HOUR_MS;
/// How long a claimed message is remembered (ms): 7 days.
const CLAIM_KEEP_MS: i64 = 7 * DAY_MS;

/// What a claim decided.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, utoipa::ToSchema)]
#[serde(rename_all = "snake_case", tag = "decision")]
pub enum Decision {
    /// Wake the session now for these messages (oldest first), carried ones included.
    Wake {
        /// Message ids the wake covers.
        messages: Vec<String>,
    },
    /// The agent woke less than 30 s ago: the mail is carried into the next wake. Claim again
    /// (with no ids) after `retry_after_ms` to wake for it then.
    Batched {
        /// ms until a wake is allowed again.
        retry_after_ms: i64,
    },
    /// Every pending message's thread woke 6 times in the last hour: no wake for them.
    ThreadCap,
    /// The agent woke 60 times in the last 24 h: no wake.
    DailyCap,
    /// The owner muted wakes for this agent (`agentmbx wake mute`): no wake.
    Muted {
        /// When the mute ends (ms since the epoch).
        until_ms: i64,
    },
    /// Nothing to wake for: no new wake-worthy mail (already claimed by another session, not
    /// wake-worthy, or not delivered to this agent).
    None,
}

/// The wake-worthy rule is shared with the hooks' filter: [`crate::wake_rule`].
pub use crate::wake_rule::is_wake_worthy;

/// The end of `agent`'s mute (ms since the epoch) when it is muted at `now_ms`.
pub fn muted_until(
    conn: &Connection,
    agent: &str,
    now_ms: i64,
) -> Result<Option<i64>, MailboxError> {
    let v: Option<String> = conn
        .query_row(
            "SELECT v FROM kv WHERE k = ?1",
            [format!("wake-mute:{agent}")],
            |r| r.get(0),
        )
        .optional()?;
    Ok(v.and_then(|v| v.parse::<i64>().ok())
        .filter(|until| *until > now_ms))
}

/// Mutes wakes for `agent` for `minutes` (1..=[`MAX_MUTE_MINUTES`]) from `now_ms`; returns
/// the end (ms). Errors: [`MailboxError::Invalid`] for minutes out of range.
pub fn mute(
    conn: &Connection,
    agent: &str,
    minutes: u32,
    now_ms: i64,
) -> Result<i64, MailboxError> {
    if !(1..=MAX_MUTE_MINUTES).contains(&minutes) {
        return Err(MailboxError::Invalid(format!(
            "minutes must be 1..={MAX_MUTE_MINUTES}"
        )));
    }
    let until = now_ms + i64::from(minutes) * 60_000;
    conn.execute(
        "INSERT INTO kv(k, v) VALUES (?1, ?2) ON CONFLICT(k) DO UPDATE SET v = ?2",
        params![format!("wake-mute:{agent}"), until.to_string()],
    )?;
    Ok(until)
}

/// Ends `agent`'s mute; returns whether one was set.
pub fn unmute(conn: &Connection, agent: &str) -> Result<bool, MailboxError> {
    Ok(conn.execute(
        "DELETE FROM kv WHERE k = ?1",
        [format!("wake-mute:{agent}")],
    )? > 0)
}

/// Claims a wake for `agent` (of host `host`) at `now_ms` for the messages `ids` a session saw
/// arrive (may be empty: a retry after [`Decision::Batched`]). Call it inside one transaction
/// (the API runs it in an immediate one): the whole decision is atomic. Ids that are no
/// message delivered to `agent` are ignored. See the module docs for the order of the rules.
pub fn claim(
    conn: &Connection,
    agent: &str,
    host: &str,
    ids: &[String],
    now_ms: i64,
) -> Result<Decision, MailboxError> {
    // 0. Forget what no rule looks at any more: wakes older than 24 h, claims older than a week
    //    (a watcher only claims mail that arrived while it watched).
    conn.execute(
        "DELETE FROM wakes WHERE agent = ?1 AND at <= ?2",
        params![agent, now_ms - DAY_MS],
    )?;
    conn.execute(
        "DELETE FROM wake_claims WHERE agent = ?1 AND at <= ?2",
        params![agent, now_ms - CLAIM_KEEP_MS],
    )?;
    // 1. Record each message once per agent, with whether it may wake.
    let mut load = conn.prepare_cached(
        "SELECT m.thread, m.kind, m.subject, m.body,
                COALESCE(json_extract(m.envelope, '$.needs_reply'), 0)
         FROM deliveries d JOIN messages m ON m.id = d.msg_id
         WHERE d.msg_id = ?1 AND d.agent = ?2",
    )?;
    let mut insert = conn.prepare_cached(
        "INSERT OR IGNORE INTO wake_claims(agent, msg_id, thread, at, outcome)
         VALUES (?1, ?2, ?3, ?4, ?5)",
    )?;
    for id in ids {
        let row: Option<(String, String, String, String, i64)> = load
            .query_row(params![id, agent], |r| {
                Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?, r.get(4)?))
            })
            .optional()?;
        let Some((thread, kind, subject, body, needs_reply)) = row else {
            continue;
        };
        let worthy = is_wake_worthy(agent, host, &kind, needs_reply != 0, &subject, &body);
        let outcome: Option<&str> = if worthy { None } else { Some("not-worthy") };
        insert.execute(params![agent, id, thread, now_ms, outcome])?;
    }
    // 2. What is pending (wake-worthy, not woken for, not dropped), oldest first.
    let pending: Vec<(String, String)> = conn
        .prepare_cached(
            "SELECT msg_id, thread FROM wake_claims WHERE agent = ?1 AND outcome IS NULL
             ORDER BY at, rowid",
        )?
        .query_map([agent], |r| Ok((r.get(0)?, r.get(1)?)))?
        .collect::<Result<_, _>>()?;
    if pending.is_empty() {
        return Ok(Decision::None);
    }
    let settle = |ids: &[String], outcome: &str| -> Result<(), MailboxError> {
        let mut st = conn.prepare_cached(
            "UPDATE wake_claims SET outcome = ?3 WHERE agent = ?1 AND msg_id = ?2",
        )?;
        for id in ids {
            st.execute(params![agent, id, outcome])?;
        }
        Ok(())
    };
    let all: Vec<String> = pending.iter().map(|p| p.0.clone()).collect();
    if let Some(until_ms) = muted_until(conn, agent, now_ms)? {
        settle(&all, "muted")?;
        return Ok(Decision::Muted { until_ms });
    }
    let last: Option<i64> =
        conn.query_row("SELECT MAX(at) FROM wakes WHERE agent = ?1", [agent], |r| {
            r.get(0)
        })?;
    if let Some(last) = last.filter(|l| now_ms - l < BATCH_MS) {
        return Ok(Decision::Batched {
            retry_after_ms: BATCH_MS - (now_ms - last),
        });
    }
    let mut thread_wakes = conn.prepare_cached(
        "SELECT COUNT(*) FROM wakes WHERE agent = ?1 AND thread = ?2 AND at > ?3",
    )?;
    let mut keep = Vec::new();
    let mut capped = Vec::new();
    for (id, thread) in &pending {
        let n: i64 =
            thread_wakes.query_row(params![agent, thread, now_ms - HOUR_MS], |r| r.get(0))?;
        if n >= THREAD_CAP {
            capped.push(id.clone());
        } else {
            keep.push((id.clone(), thread.clone()));
        }
    }
    settle(&capped, "thread-cap")?;
    if keep.is_empty() {
        return Ok(Decision::ThreadCap);
    }
    let day: i64 = conn.query_row(
        "SELECT COUNT(DISTINCT wake) FROM wakes WHERE agent = ?1 AND at > ?2",
        params![agent, now_ms - DAY_MS],
        |r| r.get(0),
    )?;
    if day >= DAILY_CAP {
        let ids: Vec<String> = keep.iter().map(|k| k.0.clone()).collect();
        settle(&ids, "daily-cap")?;
        return Ok(Decision::DailyCap);
    }
    let wake: i64 = conn.query_row("SELECT COALESCE(MAX(wake), 0) + 1 FROM wakes", [], |r| {
        r.get(0)
    })?;
    let mut threads: Vec<&str> = keep.iter().map(|k| k.1.as_str()).collect();
    threads.sort_unstable();
    threads.dedup();
    for thread in threads {
        conn.execute(
            "INSERT INTO wakes(wake, agent, thread, at) VALUES (?1, ?2, ?3, ?4)",
            params![wake, agent, thread, now_ms],
        )?;
    }
    let ids: Vec<String> = keep.into_iter().map(|k| k.0).collect();
    settle(&ids, "woke")?;
    Ok(Decision::Wake { messages: ids })
}

#[cfg(test)]
mod tests;
