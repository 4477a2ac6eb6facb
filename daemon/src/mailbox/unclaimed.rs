//! Unclaimed mail (issue 17, point 3): direct mail `name@<this host>` that arrived from a peer
//! for a name with no local mailbox here (no local row in `agents`, see
//! [`super::agents`]). It is stored with the message, in the same transaction, as one
//! `unclaimed(msg_id, name, since)` row per name, and is **not** delivered: no inbox shows it
//! and no `delivered` receipt goes back (a receipt says an agent has it; nobody has it yet).
//!
//! When an agent of that name gets a local row (`agentmbx whoami --as`, `POST /v1/agents`, or
//! its first send from this host: [`super::agents::register`], [`super::agents::touch`]), in
//! that same transaction every row for the name becomes a `new` delivery and is removed
//! ([`claim`]); the delivery queues the `delivered` receipt exactly as a delivery on arrival
//! does (the `deliveries` triggers of the schema). `agentmbx inbox --unclaimed`
//! (`GET /v1/unclaimed`) lists what waits, and `agentmbx doctor` counts it per name.
//!
//! This module only reads and writes the store; it never touches the network.

use rusqlite::{params, Connection};
use serde::Serialize;

use agentmbx_protocol::time::iso_ms;

use super::{messages, MailboxError};

/// Largest page of [`list`] (count).
pub const MAX_UNCLAIMED_LIMIT: u32 = 200;
/// Default page of [`list`] (count).
pub const DEFAULT_UNCLAIMED_LIMIT: u32 = 50;

/// One held message for one name.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, utoipa::ToSchema)]
pub struct UnclaimedEntry {
    /// Envelope id.
    #[schema(value_type = crate::vocab::MessageId)]
    pub id: String,
    /// The name it is addressed to (`name@<this host>`), which has no mailbox here.
    #[schema(value_type = crate::vocab::AgentName)]
    pub name: String,
    /// `name@host` of the sender.
    pub from: String,
    /// Subject.
    pub subject: String,
    /// ISO ms send time.
    pub ts: String,
    /// ISO ms time this host stored it as unclaimed.
    pub since: String,
}

/// What waits for names this host does not have (`GET /v1/unclaimed`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, utoipa::ToSchema)]
pub struct UnclaimedPage {
    /// The oldest held messages first (by the time they were stored, then id), at most the
    /// page size.
    pub messages: Vec<UnclaimedEntry>,
    /// How many (message, name) pairs are held in all; more than `messages` holds when the page
    /// was cut.
    pub total: u64,
}

/// Holds message `msg_id` (already stored) for `name`, which has no local mailbox, at `now_ms`.
/// Idempotent.
pub fn hold(conn: &Connection, msg_id: &str, name: &str, now_ms: i64) -> Result<(), MailboxError> {
    conn.execute(
        "INSERT OR IGNORE INTO unclaimed(msg_id, name, since) VALUES (?1, ?2, ?3)",
        params![msg_id, name, now_ms],
    )?;
    Ok(())
}

/// Delivers everything held for `name` to the agent `name` (one `new` delivery each, which
/// queues its `delivered` receipt for mail from a peer) and removes the rows, inside the
/// caller's transaction. Returns the message ids delivered, oldest first; a second call finds
/// nothing and delivers nothing.
pub fn claim(conn: &Connection, name: &str, now_ms: i64) -> Result<Vec<String>, MailboxError> {
    let ids: Vec<String> = conn
        .prepare("SELECT msg_id FROM unclaimed WHERE name = ?1 ORDER BY since, msg_id")?
        .query_map([name], |r| r.get(0))?
        .collect::<Result<_, _>>()?;
    for id in &ids {
        messages::deliver(conn, id, name, now_ms)?;
    }
    conn.execute("DELETE FROM unclaimed WHERE name = ?1", [name])?;
    Ok(ids)
}

/// The held messages, oldest first, at most `limit` (clamped to 1..=[`MAX_UNCLAIMED_LIMIT`]),
/// with the total count. Reads only.
pub fn list(conn: &Connection, limit: u32) -> Result<UnclaimedPage, MailboxError> {
    let limit = limit.clamp(1, MAX_UNCLAIMED_LIMIT);
    let messages = conn
        .prepare(
            "SELECT u.msg_id, u.name, m.from_addr, m.subject, m.ts, u.since
             FROM unclaimed u JOIN messages m ON m.id = u.msg_id
             ORDER BY u.since, u.msg_id, u.name LIMIT ?1",
        )?
        .query_map([limit], |r| {
            Ok(UnclaimedEntry {
                id: r.get(0)?,
                name: r.get(1)?,
                from: r.get(2)?,
                subject: r.get(3)?,
                ts: r.get(4)?,
                since: iso_ms(r.get(5)?),
            })
        })?
        .collect::<Result<_, _>>()?;
    let total: i64 = conn.query_row("SELECT COUNT(*) FROM unclaimed", [], |r| r.get(0))?;
    Ok(UnclaimedPage {
        messages,
        total: total.max(0) as u64,
    })
}

/// How many messages wait for each name, by name. Reads only.
pub fn counts(conn: &Connection) -> Result<Vec<(String, u64)>, MailboxError> {
    let rows = conn
        .prepare("SELECT name, COUNT(*) FROM unclaimed GROUP BY name ORDER BY name")?
        .query_map([], |r| {
            Ok((r.get::<_, String>(0)?, r.get::<_, i64>(1)?.max(0) as u64))
        })?
        .collect::<Result<_, _>>()?;
    Ok(rows)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::mailbox::agents;
    use crate::node::receive;
    use crate::testutil::{self, T0};

    const ID: &str = "01KDVDND1K20BQNR5GAFG5HETT";

    /// Issue 17 (3): mail for `nobody@home` from a peer is held (no delivery, no receipt); the
    /// agent's registration delivers it and queues exactly one `delivered` receipt; a second
    /// registration (or a send by the agent) delivers nothing again.
    #[test]
    fn held_mail_is_claimed_once_when_the_agent_registers() {
        let store = testutil::store();
        let me = testutil::identity("home");
        let peer = testutil::identity("work");
        store.add_peer(&peer, true);
        let wire = testutil::sealed_wire(
            &peer,
            &me.enc_key.public(),
            ID,
            "ann@work",
            &["nobody@home"],
            "early",
            T0,
        );
        let pk = peer.host_key.public().to_b64();
        let v = store
            .mailbox
            .with(|c| receive::receive_sealed(c, &me, &wire, ID, &pk, T0))
            .unwrap();
        assert!(v.is_ok(), "{v:?}");
        let receipts = |s: &testutil::Store| s.scalar::<i64>("SELECT COUNT(*) FROM receipt_outbox");
        assert_eq!(store.scalar::<i64>("SELECT COUNT(*) FROM deliveries"), 0);
        assert_eq!(receipts(&store), 0);
        let page = store.mailbox.with(|c| list(c, 10)).unwrap();
        assert_eq!(page.total, 1);
        assert_eq!(
            (
                page.messages[0].name.as_str(),
                page.messages[0].from.as_str()
            ),
            ("nobody", "ann@work")
        );
        assert_eq!(
            store.mailbox.with(|c| counts(c)).unwrap(),
            vec![("nobody".to_string(), 1)]
        );
        // Registering delivers it, in the same call, and queues one delivered receipt.
        store
            .mailbox
            .with(|c| agents::register(c, "home", "nobody", None, None, T0 + 5))
            .unwrap();
        let inbox = store
            .mailbox
            .with(|c| messages::inbox(c, "nobody", None, 50, &Default::default()))
            .unwrap();
        assert_eq!(inbox.messages.len(), 1);
        assert_eq!(inbox.messages[0].id, ID);
        assert_eq!(receipts(&store), 1);
        assert_eq!(
            store.scalar::<String>("SELECT state || ' ' || host || ' ' || at FROM receipt_outbox"),
            format!("delivered work {}", T0 + 5)
        );
        assert_eq!(store.mailbox.with(|c| list(c, 10)).unwrap().total, 0);
        // Again: nothing more.
        store
            .mailbox
            .with(|c| {
                agents::register(c, "home", "nobody", Some("dev"), None, T0 + 6)?;
                agents::touch(c, "home", "nobody", T0 + 7)
            })
            .unwrap();
        assert_eq!(store.scalar::<i64>("SELECT COUNT(*) FROM deliveries"), 1);
        assert_eq!(receipts(&store), 1);
    }

    /// A first send from this host (which creates the agent's local row) claims its held mail
    /// too.
    #[test]
    fn a_first_send_claims_held_mail() {
        let store = testutil::store();
        let me = testutil::identity("home");
        let peer = testutil::identity("work");
        store.add_peer(&peer, true);
        let wire = testutil::sealed_wire(
            &peer,
            &me.enc_key.public(),
            ID,
            "ann@work",
            &["zoe@home"],
            "s",
            T0,
        );
        let pk = peer.host_key.public().to_b64();
        store
            .mailbox
            .with(|c| receive::receive_sealed(c, &me, &wire, ID, &pk, T0))
            .unwrap()
            .unwrap();
        store
            .send(
                &me,
                "zoe",
                &["owner"],
                "hi",
                "01KDVDNA3VG2MH8KWSQRCWJZ0S",
                T0 + 1,
            )
            .unwrap();
        assert_eq!(
            store.scalar::<i64>("SELECT COUNT(*) FROM deliveries WHERE agent = 'zoe'"),
            1
        );
        assert_eq!(store.scalar::<i64>("SELECT COUNT(*) FROM unclaimed"), 0);
    }
}
