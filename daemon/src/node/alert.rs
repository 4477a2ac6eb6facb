//! Local alerts to a sending agent (design README "Rejections"): when a row can never be
//! delivered, the agent that sent it gets a signed local message
//! `Undelivered to <host>: <subject>` from `agentmbx@<this host>`, kind `alert`, in its inbox.
//!
//! Every function writes in the caller's transaction (the one that ends the row), and never
//! sends anything over a network.

use rusqlite::{Connection, OptionalExtension};

use agentmbx_protocol::envelope::{self, Draft};

use crate::identity::Identity;
use crate::mailbox::{messages, MailboxError};

/// The local sender name of alerts.
pub const ALERT_SENDER: &str = "agentmbx";

/// Writes an "Undelivered to `host`" alert for message `msg_id` to the agent that sent it (in
/// the caller's transaction). Does nothing when the message is unknown or was not sent by an
/// agent of this host.
pub fn undelivered(
    conn: &Connection,
    ident: &Identity,
    msg_id: &str,
    host: &str,
    reason: &str,
    now_ms: i64,
) -> Result<(), MailboxError> {
    let body = format!("Message {msg_id} to {host} will not be delivered: {reason}.");
    undelivered_with(conn, ident, msg_id, host, reason, &body, now_ms)
}

/// The outbox's alert (`wire.md` §4 "Outbox client"): as [`undelivered`], with the body
/// `Message <id> could not be delivered to host <host>: <reason>`. `reason` is the peer's LAN
/// rejection, or `gave up after 72 h (<last error>)` for a row the 72 h rule ended, whichever
/// transport was trying it (`mailbox::outbox::gave_up_reason`).
pub fn outbox_undelivered(
    conn: &Connection,
    ident: &Identity,
    msg_id: &str,
    host: &str,
    reason: &str,
    now_ms: i64,
) -> Result<(), MailboxError> {
    let body = format!("Message {msg_id} could not be delivered to host {host}: {reason}");
    undelivered_with(conn, ident, msg_id, host, reason, &body, now_ms)
}

fn undelivered_with(
    conn: &Connection,
    ident: &Identity,
    msg_id: &str,
    host: &str,
    reason: &str,
    body: &str,
    now_ms: i64,
) -> Result<(), MailboxError> {
    let row: Option<(String, String)> = conn
        .query_row(
            "SELECT from_addr, subject FROM messages WHERE id = ?1 AND origin = 'local'",
            [msg_id],
            |r| Ok((r.get(0)?, r.get(1)?)),
        )
        .optional()?;
    let Some((from, subject)) = row else {
        return Ok(());
    };
    let own = ident.host.as_str();
    let Some(agent) = from.strip_suffix(&format!("@{own}")) else {
        return Ok(());
    };
    let draft = Draft {
        from: format!("{ALERT_SENDER}@{own}"),
        to: vec![format!("{agent}@{own}")],
        subject: format!("Undelivered to {host}: {subject}"),
        body: body.to_string(),
        kind: Some("alert".into()),
        refs: vec![format!("mbx:{msg_id}@{own}")],
        ..Draft::default()
    };
    let id = agentmbx_protocol::ulid::Generator::new().next(now_ms);
    let mut env =
        envelope::build(&draft, id, now_ms).map_err(|e| MailboxError::Invalid(e.to_string()))?;
    env.sign(own, &ident.host_key)
        .map_err(|e| MailboxError::Invalid(e.to_string()))?;
    messages::insert(conn, &env.to_value(), "local", now_ms)?;
    messages::deliver(conn, &env.id, agent, now_ms)?;
    tracing::warn!(id = %msg_id, host, agent, reason, "Undelivered to {host}: {subject}");
    Ok(())
}
