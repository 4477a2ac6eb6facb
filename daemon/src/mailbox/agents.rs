//! The agent directory (`wire.md` §4 GET /v1/agents, "Addressing"): this host's mailboxes with
//! their roles, and the agents paired hosts reported.
//!
//! One table, `agents(name, host, role, description, last_seen, PK(name, host))`:
//! - rows with `host` = this host's name are **local mailboxes**: an agent registered with
//!   `agentmbx whoami --as <agent> [--role R] [--description D]` (or `POST /v1/agents`), and any
//!   agent that sent mail from this host (its `last_seen` is refreshed on every send);
//! - rows with another `host` are what that paired host answered to `GET /v1/agents` (the
//!   directory refresh replaces a host's rows as a whole).
//!
//! What "every local mailbox" means (the audience of `*` on this host): every name with a local
//! row, i.e. registered here, seen sending from here, or created on purpose by a send with
//! `--new-mailbox` ([`local_mailboxes`]). A bare name that is no agent here nor on any paired
//! host is refused at send as a likely typo, with the closest known names (`wire.md` §4
//! "Addressing", T205; [`crate::node::route`]); an agent that only reads becomes a mailbox with
//! `agentmbx whoami --as <agent>` (or `POST /v1/agents`). A bare name is *known locally* (routes
//! here, on the sending and the receiving side) when it has a local row ([`is_local`]). `role:R`
//! reaches the local rows registered with role `R` ([`with_role`]). `inbox`/`read --as` a name
//! are answered when it has a mailbox to read: a local row, or mail delivered to it (mail to an
//! unknown bare name was delivered here, without a row, before such names were refused), or it
//! is the owner ([`has_mailbox`]); any other name is "no agent named …", not an empty list.
//!
//! This module only reads and writes the store; it never touches the network.

use rusqlite::{params, Connection, OptionalExtension};
use serde::{Deserialize, Serialize};

use agentmbx_protocol::envelope;
use agentmbx_protocol::limits::{self, utf16_len};
use agentmbx_protocol::time::{iso_ms, parse_iso_ms};

use super::MailboxError;

/// Longest description, in UTF-16 code units (`wire.md` §4: free text ≤ 200 characters).
pub const MAX_DESCRIPTION: usize = 200;
/// Most directory entries kept per paired host (`wire.md` §4 `refreshDirectory`: ≤ 500).
pub const MAX_PEER_AGENTS: usize = 500;
/// The owner's mailbox name (`owner` addresses it on every host).
pub const OWNER: &str = "owner";

/// One directory entry as `GET /v1/agents` answers it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct AgentEntry {
    /// Agent name (NAME_RE).
    pub name: String,
    /// Role, if registered with one.
    #[serde(default)]
    pub role: Option<String>,
    /// The CLI the agent runs in (null: not tracked by this daemon).
    #[serde(default)]
    pub cli: Option<String>,
    /// Free text, ≤ 200 characters.
    #[serde(default)]
    pub description: Option<String>,
    /// ISO ms time the agent was last seen.
    #[serde(default)]
    pub last_seen: Option<String>,
}

/// A directory row with the host it belongs to (this host's or a paired host's).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, utoipa::ToSchema)]
pub struct DirectoryEntry {
    /// Agent name (NAME_RE).
    pub name: String,
    /// The host the agent lives on (this host's name, or a peer's local name).
    pub host: String,
    /// Role, if registered with one.
    pub role: Option<String>,
    /// Free text, ≤ 200 characters.
    pub description: Option<String>,
    /// ISO ms time the agent was last seen (here: registered or sent; for a peer: as it said).
    pub last_seen: String,
}

/// Checks a role (`role:R` and `--role R` take names: NAME_RE). Errors: [`MailboxError::Invalid`].
pub fn check_role(role: &str) -> Result<(), MailboxError> {
    if limits::is_name(role) {
        Ok(())
    } else {
        Err(MailboxError::Invalid(format!(
            "bad role {role:?}: roles are 2 to 40 characters of a-z, 0-9 and '-', not starting with '-'"
        )))
    }
}

/// Registers (or updates) the local mailbox `name` on host `own` at `now_ms`. `role` and
/// `description`: `None` keeps what is stored, `Some("")` clears it, anything else sets it
/// (role: NAME_RE; description: one line, ≤ 200 UTF-16 units). Errors:
/// [`MailboxError::Invalid`] for a bad name, role or description (nothing changes).
pub fn register(
    conn: &Connection,
    own: &str,
    name: &str,
    role: Option<&str>,
    description: Option<&str>,
    now_ms: i64,
) -> Result<AgentEntry, MailboxError> {
    if !limits::is_name(name) {
        return Err(MailboxError::Invalid(format!(
            "bad agent name {name:?}: agent names are 2 to 40 characters of a-z, 0-9 and '-', not starting with '-'"
        )));
    }
    if let Some(r) = role.filter(|r| !r.is_empty()) {
        check_role(r)?;
    }
    if let Some(d) = description {
        if utf16_len(d) > MAX_DESCRIPTION {
            return Err(MailboxError::Invalid(format!(
                "description is over {MAX_DESCRIPTION} characters"
            )));
        }
        if envelope::one_line(d) != d {
            return Err(MailboxError::Invalid(
                "description must be one line without control characters".into(),
            ));
        }
    }
    // NULL keeps the stored value; '' clears it.
    conn.execute(
        "INSERT INTO agents(name, host, role, description, last_seen)
         VALUES (?1, ?2, NULLIF(?3, ''), NULLIF(?4, ''), ?5)
         ON CONFLICT(name, host) DO UPDATE SET
           role = CASE WHEN ?3 IS NULL THEN role ELSE NULLIF(?3, '') END,
           description = CASE WHEN ?4 IS NULL THEN description ELSE NULLIF(?4, '') END,
           last_seen = MAX(last_seen, excluded.last_seen)",
        params![name, own, role, description, now_ms],
    )?;
    let entry = conn
        .query_row(
            "SELECT name, role, description, last_seen FROM agents WHERE name = ?1 AND host = ?2",
            params![name, own],
            entry_row,
        )
        .optional()?;
    entry.ok_or_else(|| MailboxError::NotFound(format!("agent {name} vanished")))
}

/// Records that the local agent `name` was active at `now_ms` (it sent mail): creates its
/// local row without a role, or moves `last_seen` forward. A name that is not NAME_RE is
/// ignored (the sender check refuses it first).
pub fn touch(conn: &Connection, own: &str, name: &str, now_ms: i64) -> Result<(), MailboxError> {
    if !limits::is_name(name) {
        return Ok(());
    }
    conn.execute(
        "INSERT INTO agents(name, host, last_seen) VALUES (?1, ?2, ?3)
         ON CONFLICT(name, host) DO UPDATE SET last_seen = MAX(last_seen, excluded.last_seen)",
        params![name, own, now_ms],
    )?;
    Ok(())
}

fn entry_row(r: &rusqlite::Row<'_>) -> rusqlite::Result<AgentEntry> {
    Ok(AgentEntry {
        name: r.get(0)?,
        role: r.get(1)?,
        cli: None,
        description: r.get(2)?,
        last_seen: Some(iso_ms(r.get(3)?)),
    })
}

/// This host's agents (`host = own`), by name: what `GET /v1/agents` answers peers.
pub fn local(conn: &Connection, own: &str) -> Result<Vec<AgentEntry>, MailboxError> {
    let mut st = conn.prepare(
        "SELECT name, role, description, last_seen FROM agents WHERE host = ?1 ORDER BY name",
    )?;
    let rows = st
        .query_map([own], entry_row)?
        .collect::<Result<Vec<_>, _>>()?;
    Ok(rows)
}

/// The whole directory: this host's rows and those of pinned peers, by host then name.
pub fn directory(conn: &Connection, own: &str) -> Result<Vec<DirectoryEntry>, MailboxError> {
    let mut st = conn.prepare(
        "SELECT name, host, role, description, last_seen FROM agents
         WHERE host = ?1 OR host IN (SELECT host FROM peers)
         ORDER BY host <> ?1, host, name",
    )?;
    let rows = st
        .query_map([own], |r| {
            Ok(DirectoryEntry {
                name: r.get(0)?,
                host: r.get(1)?,
                role: r.get(2)?,
                description: r.get(3)?,
                last_seen: iso_ms(r.get(4)?),
            })
        })?
        .collect::<Result<Vec<_>, _>>()?;
    Ok(rows)
}

/// Every local mailbox on host `own` (its local rows), sorted: the audience of `*`.
pub fn local_mailboxes(conn: &Connection, own: &str) -> Result<Vec<String>, MailboxError> {
    let mut st = conn.prepare("SELECT name FROM agents WHERE host = ?1 ORDER BY name")?;
    let rows = st
        .query_map([own], |r| r.get::<_, String>(0))?
        .collect::<Result<Vec<_>, _>>()?;
    Ok(rows)
}

/// The local mailboxes on host `own` registered with `role`, sorted (the audience of `role:R`).
pub fn with_role(conn: &Connection, own: &str, role: &str) -> Result<Vec<String>, MailboxError> {
    let mut st =
        conn.prepare("SELECT name FROM agents WHERE host = ?1 AND role = ?2 ORDER BY name")?;
    let rows = st
        .query_map(params![own, role], |r| r.get::<_, String>(0))?
        .collect::<Result<Vec<_>, _>>()?;
    Ok(rows)
}

/// Whether `name` is a local mailbox on host `own` (has a local row).
pub fn is_local(conn: &Connection, own: &str, name: &str) -> Result<bool, MailboxError> {
    let found: Option<i64> = conn
        .query_row(
            "SELECT 1 FROM agents WHERE name = ?1 AND host = ?2",
            params![name, own],
            |r| r.get(0),
        )
        .optional()?;
    Ok(found.is_some())
}

/// Whether `name` has a mailbox to read on host `own`: the owner, a local row ([`is_local`]),
/// or mail delivered to it (a name that received mail before unknown names were refused).
/// `inbox`/`read --as` any other name is refused, not answered with an empty list.
pub fn has_mailbox(conn: &Connection, own: &str, name: &str) -> Result<bool, MailboxError> {
    if name == OWNER || is_local(conn, own, name)? {
        return Ok(true);
    }
    let found: Option<i64> = conn
        .query_row(
            "SELECT 1 FROM deliveries WHERE agent = ?1 LIMIT 1",
            [name],
            |r| r.get(0),
        )
        .optional()?;
    Ok(found.is_some())
}

/// Every name with a mailbox to read on host `own` ([`has_mailbox`]): the local rows and the
/// names mail was delivered to, sorted, each once (the owner only when it has either).
pub fn readers(conn: &Connection, own: &str) -> Result<Vec<String>, MailboxError> {
    let mut st = conn.prepare(
        "SELECT name FROM agents WHERE host = ?1
         UNION SELECT agent FROM deliveries ORDER BY 1",
    )?;
    let rows = st
        .query_map([own], |r| r.get::<_, String>(0))?
        .collect::<Result<Vec<_>, _>>()?;
    Ok(rows)
}

/// The pinned peers (other than `own`) whose directory lists `name`, sorted.
pub fn peers_listing(
    conn: &Connection,
    own: &str,
    name: &str,
) -> Result<Vec<String>, MailboxError> {
    let mut st = conn.prepare(
        "SELECT a.host FROM agents a JOIN peers p ON p.host = a.host
         WHERE a.name = ?1 AND a.host <> ?2 ORDER BY a.host",
    )?;
    let rows = st
        .query_map(params![name, own], |r| r.get::<_, String>(0))?
        .collect::<Result<Vec<_>, _>>()?;
    Ok(rows)
}

/// Replaces the directory rows of paired host `host` with `entries` (what it answered to
/// `GET /v1/agents`) in one transaction: entries whose name is not NAME_RE are skipped, a role
/// that is not NAME_RE is dropped, descriptions are made one line and cut to 200 UTF-16 units,
/// a repeated name keeps its first entry, and at most [`MAX_PEER_AGENTS`] are kept. `last_seen`
/// is the entry's own time when it parses, else `now_ms`. Returns how many rows were stored.
/// Errors: [`MailboxError::Invalid`] when `host` is not a NAME_RE name; SQLite.
pub fn replace_host(
    conn: &mut Connection,
    host: &str,
    entries: &[AgentEntry],
    now_ms: i64,
) -> Result<usize, MailboxError> {
    if !limits::is_name(host) {
        return Err(MailboxError::Invalid(format!("bad host name {host:?}")));
    }
    let tx = conn.transaction_with_behavior(rusqlite::TransactionBehavior::Immediate)?;
    tx.execute("DELETE FROM agents WHERE host = ?1", [host])?;
    let mut stored = 0;
    {
        let mut st = tx.prepare(
            "INSERT OR IGNORE INTO agents(name, host, role, description, last_seen)
             VALUES (?1, ?2, ?3, ?4, ?5)",
        )?;
        for e in entries.iter().filter(|e| limits::is_name(&e.name)) {
            if stored >= MAX_PEER_AGENTS {
                break;
            }
            let role = e.role.as_deref().filter(|r| limits::is_name(r));
            let description = e
                .description
                .as_deref()
                .map(|d| envelope::truncate_utf16(&envelope::one_line(d), MAX_DESCRIPTION))
                .filter(|d| !d.is_empty());
            let seen = e
                .last_seen
                .as_deref()
                .and_then(parse_iso_ms)
                .unwrap_or(now_ms);
            stored += st.execute(params![e.name, host, role, description, seen])?;
        }
    }
    tx.commit()?;
    Ok(stored)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testutil::{self, T0};

    fn entry(name: &str, role: Option<&str>) -> AgentEntry {
        AgentEntry {
            name: name.into(),
            role: role.map(Into::into),
            cli: None,
            description: None,
            last_seen: None,
        }
    }

    #[test]
    fn register_keeps_what_is_not_given_and_refuses_bad_input() {
        let s = testutil::store();
        s.mailbox
            .with(|c| {
                let e = register(c, "home", "bob", Some("dev"), Some("builds things"), T0)?;
                assert_eq!(
                    (e.role.as_deref(), e.description.as_deref()),
                    (Some("dev"), Some("builds things"))
                );
                assert_eq!(e.last_seen.as_deref(), Some("2026-01-01T00:01:00.000Z"));
                // None keeps, "" clears.
                let e = register(c, "home", "bob", None, Some(""), T0 + 5)?;
                assert_eq!((e.role.as_deref(), e.description), (Some("dev"), None));
                for (name, role, desc) in [
                    ("Bob", None, None),
                    ("bob", Some("Dev Team"), None),
                    ("bob", None, Some("two\nlines")),
                ] {
                    assert!(matches!(
                        register(c, "home", name, role, desc, T0),
                        Err(MailboxError::Invalid(_))
                    ));
                }
                let long = "x".repeat(MAX_DESCRIPTION + 1);
                assert!(register(c, "home", "bob", None, Some(&long), T0).is_err());
                assert_eq!(local(c, "home")?.len(), 1);
                assert_eq!(with_role(c, "home", "dev")?, vec!["bob".to_string()]);
                Ok(())
            })
            .unwrap();
    }

    #[test]
    fn local_mailboxes_are_registered_or_have_sent() {
        let s = testutil::store();
        let me = testutil::identity("home");
        s.register("home", &["bob"]);
        // alice sends to bob; carol got the same mail delivered before unknown bare names were
        // refused: she has mail to read but is no mailbox of this host.
        let id = "01KDVDNA3VG2MH8KWSQRCWJZ0S";
        s.send(&me, "alice", &["bob"], "s", id, T0).unwrap();
        s.mailbox
            .with(|c| super::super::messages::deliver(c, id, "carol", T0))
            .unwrap();
        s.mailbox
            .with(|c| {
                register(c, "work", "zed", None, None, T0)?;
                assert_eq!(
                    local_mailboxes(c, "home")?,
                    vec!["alice".to_string(), "bob".into()]
                );
                assert!(is_local(c, "home", "bob")?);
                assert!(!is_local(c, "home", "carol")?);
                assert!(!is_local(c, "home", "zed")?);
                // Issue 17 (4): what `inbox`/`read --as` accept.
                for name in ["alice", "bob", "carol", OWNER] {
                    assert!(has_mailbox(c, "home", name)?, "{name}");
                }
                for name in ["zed", "bbo", "nobody"] {
                    assert!(!has_mailbox(c, "home", name)?, "{name}");
                }
                assert_eq!(readers(c, "home")?, vec!["alice", "bob", "carol"]);
                Ok(())
            })
            .unwrap();
    }

    #[test]
    fn a_peer_directory_is_replaced_whole_and_bounded() {
        let s = testutil::store();
        let peer = testutil::identity("work");
        s.add_peer(&peer, false);
        let mut first: Vec<AgentEntry> =
            (0..600).map(|i| entry(&format!("a{i:03}"), None)).collect();
        first.push(entry("Bad Name", None));
        let n = s
            .mailbox
            .with(|c| replace_host(c, "work", &first, T0))
            .unwrap();
        assert_eq!(n, MAX_PEER_AGENTS);
        let mut second = vec![
            entry("bob", Some("dev")),
            entry("bob", Some("ops")),
            entry("eve", Some("Not A Role")),
        ];
        second[0].description = Some("line\none".into());
        second[0].last_seen = Some("2026-01-01T00:00:00.000Z".into());
        let n = s
            .mailbox
            .with(|c| replace_host(c, "work", &second, T0))
            .unwrap();
        assert_eq!(n, 2);
        let dir = s.mailbox.with(|c| directory(c, "home")).unwrap();
        assert_eq!(
            dir,
            vec![
                DirectoryEntry {
                    name: "bob".into(),
                    host: "work".into(),
                    role: Some("dev".into()),
                    description: Some("line one".into()),
                    last_seen: "2026-01-01T00:00:00.000Z".into(),
                },
                DirectoryEntry {
                    name: "eve".into(),
                    host: "work".into(),
                    role: None,
                    description: None,
                    last_seen: "2026-01-01T00:01:00.000Z".into(),
                },
            ]
        );
        assert_eq!(
            s.mailbox.with(|c| peers_listing(c, "home", "bob")).unwrap(),
            vec!["work".to_string()]
        );
    }
}
