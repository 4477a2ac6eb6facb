//! Local alerts to a sending agent (design README "Rejections"; `wire.md` §3.5 "Settle"): when
//! a row can never be delivered, the agent that sent it gets a signed local message
//! `Undelivered to <host>: <subject>` from `agentmbx@<this host>`, kind `alert`, in its inbox;
//! when a relay accepted a row but its host never confirmed delivery by the sender's deadline,
//! `Undelivered/unconfirmed to <host>: <subject>` ([`unconfirmed`]). A relay's expiry notice
//! (spec §6) gets the first form, saying how long the relay held the message
//! ([`relay_expired`]).
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
    undelivered_with(
        conn,
        ident,
        msg_id,
        host,
        UNDELIVERED,
        reason,
        &body,
        now_ms,
    )
}

/// Subject prefix of an alert for mail that will not be delivered.
pub const UNDELIVERED: &str = "Undelivered";
/// Subject prefix of an alert for mail a relay accepted whose delivery was never confirmed.
pub const UNCONFIRMED: &str = "Undelivered/unconfirmed";

/// Whole days a relay held an item, for an expiry alert: `(expired_at − accepted_at)` in days,
/// rounded, at least 1 (ms in, days out).
pub fn held_days(accepted_at_ms: i64, expired_at_ms: i64) -> i64 {
    let ms = expired_at_ms.saturating_sub(accepted_at_ms).max(0);
    ((ms + 43_200_000) / 86_400_000).max(1)
}

/// The alert for a row a relay's verified expiry notice ended (spec §6; `wire.md` §3.5
/// "Settle"): subject `Undelivered to <host>: <subject>`, body `Message <id> could not be
/// delivered to host <host>: the relay held it for <days> day(s) (accepted <accepted_at>) and
/// <host> never collected it, so the relay expired it at <expired_at>.` (`days` from
/// [`held_days`]; the times as the notice gives them, ISO). In the caller's transaction.
#[allow(clippy::too_many_arguments)]
pub fn relay_expired(
    conn: &Connection,
    ident: &Identity,
    msg_id: &str,
    host: &str,
    days: i64,
    accepted_at: &str,
    expired_at: &str,
    now_ms: i64,
) -> Result<(), MailboxError> {
    let reason = format!(
        "the relay held it for {days} day(s) (accepted {accepted_at}) and {host} never collected it, so the relay expired it at {expired_at}"
    );
    let body = format!("Message {msg_id} could not be delivered to host {host}: {reason}.");
    undelivered_with(
        conn,
        ident,
        msg_id,
        host,
        UNDELIVERED,
        &reason,
        &body,
        now_ms,
    )
}

/// Why a relay-accepted row ended `unconfirmed` (`wire.md` §3.5 "Settle"): `ever_confirmed`
/// tells whether any delivery receipt ever came from that host.
pub fn unconfirmed_reason(ever_confirmed: bool) -> &'static str {
    if ever_confirmed {
        "the relay accepted it, but the recipient's host never confirmed delivery"
    } else {
        "the relay accepted it, but there is no delivery confirmation (the recipient's host may run AgentMBX older than 0.5.3, which sends none)"
    }
}

/// The alert for a row past its deadline with no delivery receipt (`wire.md` §3.5 "Settle"):
/// subject `Undelivered/unconfirmed to <host>: <subject>`, body `Message <id> to host <host>:
/// <reason>.` with [`unconfirmed_reason`]. In the caller's transaction.
pub fn unconfirmed(
    conn: &Connection,
    ident: &Identity,
    msg_id: &str,
    host: &str,
    ever_confirmed: bool,
    now_ms: i64,
) -> Result<(), MailboxError> {
    let reason = unconfirmed_reason(ever_confirmed);
    let body = format!("Message {msg_id} to host {host}: {reason}.");
    undelivered_with(
        conn,
        ident,
        msg_id,
        host,
        UNCONFIRMED,
        reason,
        &body,
        now_ms,
    )
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
    undelivered_with(
        conn,
        ident,
        msg_id,
        host,
        UNDELIVERED,
        reason,
        &body,
        now_ms,
    )
}

#[allow(clippy::too_many_arguments)]
fn undelivered_with(
    conn: &Connection,
    ident: &Identity,
    msg_id: &str,
    host: &str,
    prefix: &str,
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
        subject: format!("{prefix} to {host}: {subject}"),
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
    tracing::warn!(id = %msg_id, host, agent, reason, "{prefix} to {host}: {subject}");
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn held_days_round_and_are_at_least_one() {
        let day = 86_400_000;
        assert_eq!(held_days(0, 14 * day), 14);
        assert_eq!(held_days(0, 14 * day + day / 2 - 1), 14);
        assert_eq!(held_days(0, 14 * day + day / 2), 15);
        assert_eq!(held_days(0, 1), 1);
        assert_eq!(
            held_days(5, 0),
            1,
            "a notice dated before its accept still says 1 day"
        );
    }

    #[test]
    fn the_unconfirmed_reason_names_old_peers_only_without_any_receipt() {
        assert!(unconfirmed_reason(false).contains("older than 0.5.3"));
        assert!(!unconfirmed_reason(true).contains("0.5.3"));
        assert!(unconfirmed_reason(true).contains("never confirmed delivery"));
    }
}
