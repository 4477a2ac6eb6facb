//! Idempotency records of the local API (design README "Local API"): a replay with the same key
//! and body returns the first answer; the same key with another body is a conflict.
//!
//! # Horizon and bound (issue 19 part 4; seed 003)
//! A record is kept for [`HORIZON_MS`] (24 h) after its request, then pruned: the CLI retries a
//! call for at most a minute and `agentmbx mcp` for less, but after an unknown outcome the CLI
//! tells a person to rerun the command with `--idempotency-key K`, which may happen hours
//! later — a day covers a rerun after a night, while a week of records would only grow the
//! store. A replay of a key older than the horizon is a new request.
//!
//! Each scope (one operation of one agent, e.g. `send:alice`) holds at most
//! [`MAX_RECORDS_PER_SCOPE`] records inside the horizon. A new keyed request of a scope that
//! is full is refused ([`Admission::Full`], answered 503 `IDEMPOTENCY_FULL`) and does nothing:
//! a record a client could still replay is never dropped to make room, since dropping it could
//! make a retry do its request twice (seed 003, at most once). Only that agent's operation is
//! refused; other agents, and requests without a key, go on. 10,000 a day is about one keyed
//! call every 9 s around the clock for one operation of one agent — far past a real agent
//! (the send class refills 4 a second, so only a runaway loop reaches it).
//!
//! Pruning runs on write ([`admit`], before each keyed request, inside its transaction): one
//! indexed `DELETE` of the records past the horizon (`idempotency_created`, schema 12), so it
//! costs nothing when there is nothing to prune, and no timer is needed. The bound is checked
//! by counting the scope's records on its primary-key prefix: about 26 µs for a scope of 300
//! records and about 1 ms at the 10,000 cap (measured with the same schema on SQLite in
//! memory, on a loaded 2-core machine), a cost only an agent near its cap pays.

use rusqlite::{params, Connection, OptionalExtension};

use super::MailboxError;

/// A stored answer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Stored {
    /// HTTP status of the first answer.
    pub status: u16,
    /// JSON body of the first answer.
    pub response: String,
}

/// Looks up `(scope, key)`. Same request hash → `Ok(Some(first answer))`; another hash →
/// [`MailboxError::Conflict`]; unknown → `Ok(None)`.
pub fn lookup(
    conn: &Connection,
    scope: &str,
    key: &str,
    request_hash: &str,
) -> Result<Option<Stored>, MailboxError> {
    let row: Option<(String, u16, String)> = conn
        .query_row(
            "SELECT request_hash, status, response FROM idempotency WHERE scope = ?1 AND key = ?2",
            params![scope, key],
            |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)),
        )
        .optional()?;
    match row {
        None => Ok(None),
        Some((h, status, response)) if h == request_hash => Ok(Some(Stored { status, response })),
        Some(_) => Err(MailboxError::Conflict(
            "Idempotency-Key was already used with another request body".into(),
        )),
    }
}

/// Records the answer for `(scope, key)` (inside the caller's transaction).
pub fn record(
    conn: &Connection,
    scope: &str,
    key: &str,
    request_hash: &str,
    status: u16,
    response: &str,
    now_ms: i64,
) -> Result<(), MailboxError> {
    conn.execute(
        "INSERT INTO idempotency(scope, key, request_hash, status, response, created_at) VALUES (?1,?2,?3,?4,?5,?6)",
        params![scope, key, request_hash, status, response, now_ms],
    )?;
    Ok(())
}

/// How long a record is kept after its request (ms): 24 h (module docs).
pub const HORIZON_MS: i64 = 24 * 60 * 60 * 1000;

/// Most records one scope (one operation of one agent) holds inside [`HORIZON_MS`]: 10,000
/// (module docs).
pub const MAX_RECORDS_PER_SCOPE: u64 = 10_000;

/// Whether a new keyed request of a scope may run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Admission {
    /// There is room for its record.
    Room,
    /// The scope holds its cap of records inside the horizon: refuse, doing nothing.
    Full {
        /// Until its oldest record leaves the horizon, ms (at least 1).
        retry_after_ms: i64,
    },
}

/// Deletes every record older than [`HORIZON_MS`] at `now_ms`; returns how many.
pub fn prune(conn: &Connection, now_ms: i64) -> Result<usize, MailboxError> {
    Ok(conn.execute(
        "DELETE FROM idempotency WHERE created_at < ?1",
        params![now_ms - HORIZON_MS],
    )?)
}

/// Before a keyed request of `scope` not found by [`lookup`]: prunes ([`prune`]), then says
/// whether the scope has room for one more record under `cap` ([`MAX_RECORDS_PER_SCOPE`] in
/// the API). Runs inside the request's transaction.
pub fn admit(
    conn: &Connection,
    scope: &str,
    cap: u64,
    now_ms: i64,
) -> Result<Admission, MailboxError> {
    prune(conn, now_ms)?;
    let held: i64 = conn.query_row(
        "SELECT COUNT(*) FROM idempotency WHERE scope = ?1",
        params![scope],
        |r| r.get(0),
    )?;
    if u64::try_from(held).unwrap_or(0) < cap {
        return Ok(Admission::Room);
    }
    let oldest: i64 = conn.query_row(
        "SELECT MIN(created_at) FROM idempotency WHERE scope = ?1",
        params![scope],
        |r| r.get(0),
    )?;
    Ok(Admission::Full {
        retry_after_ms: (oldest + HORIZON_MS - now_ms).max(1),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn db() -> Connection {
        let mut c = Connection::open_in_memory().unwrap();
        super::super::schema::migrate(&mut c).unwrap();
        c
    }

    #[test]
    fn records_past_the_horizon_are_pruned_and_replay_as_new() {
        let c = db();
        record(&c, "send:alice", "k1", "h", 201, "{}", 0).unwrap();
        record(&c, "send:alice", "k2", "h", 201, "{}", 1_000).unwrap();
        // Inside the horizon: kept, replayed.
        assert_eq!(prune(&c, HORIZON_MS).unwrap(), 0);
        assert!(lookup(&c, "send:alice", "k1", "h").unwrap().is_some());
        // One ms past it: k1 goes, k2 stays.
        assert_eq!(prune(&c, HORIZON_MS + 1).unwrap(), 1);
        assert_eq!(lookup(&c, "send:alice", "k1", "h").unwrap(), None);
        assert!(lookup(&c, "send:alice", "k2", "h").unwrap().is_some());
        // The prune is an indexed delete.
        let plan: String = c
            .query_row(
                "EXPLAIN QUERY PLAN DELETE FROM idempotency WHERE created_at < 5",
                [],
                |r| r.get(3),
            )
            .unwrap();
        assert!(plan.contains("idempotency_created"), "{plan}");
    }

    #[test]
    fn a_full_scope_refuses_a_new_key_and_keeps_every_record() {
        let c = db();
        for i in 0..3 {
            record(
                &c,
                "send:alice",
                &format!("k{i}"),
                "h",
                201,
                "{}",
                i * 1_000,
            )
            .unwrap();
        }
        assert_eq!(admit(&c, "send:alice", 4, 5_000).unwrap(), Admission::Room);
        record(&c, "send:alice", "k3", "h", 201, "{}", 5_000).unwrap();
        // At the cap: refused until the oldest (at 0) leaves the horizon; nothing dropped.
        assert_eq!(
            admit(&c, "send:alice", 4, 6_000).unwrap(),
            Admission::Full {
                retry_after_ms: HORIZON_MS - 6_000
            }
        );
        for i in 0..4 {
            assert!(lookup(&c, "send:alice", &format!("k{i}"), "h")
                .unwrap()
                .is_some());
        }
        // Other scopes are not affected.
        assert_eq!(admit(&c, "send:bob", 4, 6_000).unwrap(), Admission::Room);
        assert_eq!(admit(&c, "ack:alice", 4, 6_000).unwrap(), Admission::Room);
        // Once the oldest ages out there is room again.
        assert_eq!(
            admit(&c, "send:alice", 4, HORIZON_MS + 1).unwrap(),
            Admission::Room
        );
        assert_eq!(lookup(&c, "send:alice", "k0", "h").unwrap(), None);
    }
}
