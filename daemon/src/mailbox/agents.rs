//! The agent directory (`wire.md` §4 GET /v1/agents, "Addressing"): this host's mailboxes with
//! their roles, and the agents paired hosts reported.

use rusqlite::Connection;
use serde::Serialize;

use super::MailboxError;

/// One directory entry as `GET /v1/agents` answers it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct AgentEntry {
    /// Agent name (NAME_RE).
    pub name: String,
    /// Role, if registered with one.
    pub role: Option<String>,
    /// The CLI the agent runs in (null: not tracked by this daemon).
    pub cli: Option<String>,
    /// Free text, ≤ 200 characters.
    pub description: Option<String>,
    /// ISO ms time the agent was last seen.
    pub last_seen: Option<String>,
}

/// This host's agents (`host = own`), by name.
pub fn local(_conn: &Connection, _own: &str) -> Result<Vec<AgentEntry>, MailboxError> {
    Ok(Vec::new())
}
