//! The host's audit trail of trust events (`wire.md` §3.5: `relay.key_changed`,
//! `relay.key_confirmed`, `relay.enrolled`, `relay.enrolment_lost`, `relay.enrol_failed`; §2.10:
//! rotations sent and accepted). Rows are appended inside the caller's transaction, so an event
//! is recorded exactly when the state change it describes commits.
//!
//! It must never store key material, tokens or message bodies: `detail` carries fingerprints,
//! URLs, names and reasons only.

use rusqlite::{params, Connection};
use serde::Serialize;

use super::MailboxError;

/// Most audit rows kept; older ones are deleted as new ones are appended.
pub const AUDIT_KEEP: i64 = 10_000;

/// One audit row.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct AuditEvent {
    /// Increasing id.
    pub id: i64,
    /// When, ms since the epoch.
    pub at: i64,
    /// Dotted event name, e.g. `relay.key_changed`.
    pub event: String,
    /// Event details (JSON object; fingerprints, never keys).
    pub detail: serde_json::Value,
}

/// Appends an event (in the caller's transaction) and trims the trail to [`AUDIT_KEEP`] rows.
/// Errors: SQLite failures.
pub fn record(
    conn: &Connection,
    now_ms: i64,
    event: &str,
    detail: &serde_json::Value,
) -> Result<i64, MailboxError> {
    conn.execute(
        "INSERT INTO audit(at, event, detail) VALUES (?1, ?2, ?3)",
        params![now_ms, event, detail.to_string()],
    )?;
    let id = conn.last_insert_rowid();
    conn.execute("DELETE FROM audit WHERE id <= ?1", params![id - AUDIT_KEEP])?;
    Ok(id)
}

/// The newest events first, at most `limit`, optionally only those named `event`.
/// Errors: SQLite failures.
pub fn recent(
    conn: &Connection,
    event: Option<&str>,
    limit: u32,
) -> Result<Vec<AuditEvent>, MailboxError> {
    let mut stmt = conn.prepare_cached(
        "SELECT id, at, event, detail FROM audit WHERE ?1 IS NULL OR event = ?1
         ORDER BY id DESC LIMIT ?2",
    )?;
    let rows = stmt
        .query_map(params![event, limit], |r| {
            let detail: String = r.get(3)?;
            Ok(AuditEvent {
                id: r.get(0)?,
                at: r.get(1)?,
                event: r.get(2)?,
                detail: serde_json::from_str(&detail).unwrap_or(serde_json::Value::Null),
            })
        })?
        .collect::<Result<Vec<_>, _>>()?;
    Ok(rows)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn events_are_kept_newest_first_and_filtered_by_name() {
        let store = crate::testutil::store();
        store
            .mailbox
            .with(|c| {
                record(
                    c,
                    1,
                    "relay.key_changed",
                    &serde_json::json!({"served": "aaaa"}),
                )?;
                record(c, 2, "relay.enrolled", &serde_json::json!({}))?;
                record(
                    c,
                    3,
                    "relay.key_confirmed",
                    &serde_json::json!({"fp": "bbbb"}),
                )?;
                let all = recent(c, None, 10)?;
                assert_eq!(all.iter().map(|e| e.at).collect::<Vec<_>>(), vec![3, 2, 1]);
                let changed = recent(c, Some("relay.key_changed"), 10)?;
                assert_eq!(changed.len(), 1);
                assert_eq!(changed[0].detail["served"], "aaaa");
                assert_eq!(recent(c, None, 1)?.len(), 1);
                Ok(())
            })
            .unwrap();
    }
}
