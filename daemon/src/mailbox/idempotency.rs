//! Idempotency records of the local API (design README "Local API"): a replay with the same key
//! and body returns the first answer; the same key with another body is a conflict.

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
