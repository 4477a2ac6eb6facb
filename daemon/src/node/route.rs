//! Addressing (`wire.md` §4 "Addressing", spec G10): which local mailboxes and which paired
//! hosts an address means, on the sending side (expansion before anything reaches a transport)
//! and on the receiving side (which of this host's mailboxes an arriving envelope is for).
//!
//! This module only reads the store; it never writes and never touches the network.

use rusqlite::Connection;
use serde_json::Value;

use crate::mailbox::MailboxError;

/// The local agent names an arriving envelope is delivered to on the host `own`: each
/// `name@own` in `to`, once, in order.
pub fn receive_recipients(
    _conn: &Connection,
    own: &str,
    env: &Value,
) -> Result<Vec<String>, MailboxError> {
    let mut recipients: Vec<String> = Vec::new();
    for to in env
        .get("to")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .filter_map(Value::as_str)
    {
        if let Some((name, host)) = to.split_once('@') {
            if host == own
                && agentmbx_protocol::limits::is_name(name)
                && !recipients.iter().any(|d| d == name)
            {
                recipients.push(name.to_string());
            }
        }
    }
    Ok(recipients)
}
