//! Delivery receipts (spec §9, `wire.md` §2.11): accepting the signed receipt records that
//! recipients' hosts send back, applying them by state rank then seq, and settling outbox rows.

use rusqlite::Connection;
use serde_json::Value;

use crate::mailbox::{peers::Peer, MailboxError};

/// Accepts one receipt `{rec, sig}` (`wire.md` §2.11). `hop` is the verified LAN hop's peer, or
/// `None` for a receipt pulled from the relay (then `relay_sender` is the item's verified
/// sender key). Returns the result text: `accepted`, `duplicate`, `stale` or `rejected:<why>`.
/// Errors: storage faults only.
pub fn accept(
    _conn: &Connection,
    _own_host: &str,
    _wire: &Value,
    _hop: Option<&Peer>,
    _relay_sender: Option<&str>,
    _now_ms: i64,
) -> Result<String, MailboxError> {
    Ok("rejected:receipts are not supported yet".into())
}
