//! Forgetting a peer (`peers remove` here, or `POST /v1/unpair` from the peer; `wire.md` §4):
//! its pinned key goes, and mail still waiting for it ends as `undelivered` with a local alert
//! to each sender, in one transaction. Rows a relay already accepted are left as they are:
//! their delivery receipt or deadline settles them (spec §10).

use rusqlite::{params, Connection};

use crate::identity::Identity;
use crate::mailbox::{peers, MailboxError};
use crate::node::alert;

/// The `last_error` and alert reason of rows ended by an unpairing.
pub const REASON: &str = "the host was unpaired";

/// Removes peer `host` and ends its pending outbox rows (inside the caller's transaction).
/// Returns how many rows ended as undelivered. Errors: [`MailboxError::NotFound`] for an
/// unknown peer; storage faults.
pub fn forget_peer(
    conn: &Connection,
    ident: &Identity,
    host: &str,
    now_ms: i64,
) -> Result<usize, MailboxError> {
    let ids: Vec<String> = conn
        .prepare("SELECT msg_id FROM outbox WHERE host = ?1 AND state = 'pending' ORDER BY rowid")?
        .query_map([host], |r| r.get(0))?
        .collect::<Result<_, _>>()?;
    for id in &ids {
        conn.execute(
            "UPDATE outbox SET state = 'undelivered', last_error = ?3, settled_at = ?4, wire = NULL WHERE msg_id = ?1 AND host = ?2",
            params![id, host, REASON, now_ms],
        )?;
        alert::undelivered(conn, ident, id, host, REASON, now_ms)?;
    }
    if !peers::remove(conn, host)? {
        return Err(MailboxError::NotFound(format!("no peer named {host}")));
    }
    Ok(ids.len())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testutil::{self, T0};

    #[test]
    fn forgetting_a_peer_ends_its_waiting_mail_with_an_alert_and_keeps_relayed_rows() {
        let s = testutil::store();
        let me = testutil::identity("home");
        let peer = testutil::identity("work");
        s.add_peer(&peer, false);
        s.send(
            &me,
            "alice",
            &["bob@work"],
            "one",
            "01KDVDNA3VG2MH8KWSQRCWJZ0S",
            T0,
        )
        .unwrap();
        s.send(
            &me,
            "alice",
            &["bob@work"],
            "two",
            "01KDVDNA3VG2MH8KWSQRCWJZ0T",
            T0,
        )
        .unwrap();
        s.mailbox
            .with(|c| {
                c.execute(
                    "UPDATE outbox SET state = 'relay-accepted' WHERE msg_id = '01KDVDNA3VG2MH8KWSQRCWJZ0T'",
                    [],
                )?;
                Ok(())
            })
            .unwrap();
        let ended = s
            .mailbox
            .with(|c| forget_peer(c, &me, "work", T0 + 1))
            .unwrap();
        assert_eq!(ended, 1);
        assert_eq!(s.scalar::<i64>("SELECT COUNT(*) FROM peers"), 0);
        assert_eq!(
            s.scalar::<String>(
                "SELECT group_concat(state, ',') FROM (SELECT state FROM outbox ORDER BY msg_id)"
            ),
            "undelivered,relay-accepted"
        );
        let alert: String = s.scalar("SELECT subject FROM messages WHERE kind = 'alert'");
        assert_eq!(alert, "Undelivered to work: one");
        let err = s
            .mailbox
            .with(|c| forget_peer(c, &me, "work", T0 + 2))
            .unwrap_err();
        assert!(matches!(err, MailboxError::NotFound(_)), "{err}");
    }
}
