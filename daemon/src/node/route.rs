//! Addressing (`wire.md` §4 "Addressing", spec G10): which local mailboxes and which paired
//! hosts an address means, on the sending side ([`expand`]: before anything reaches a
//! transport, so the relay only ever sees concrete host keys) and on the receiving side
//! ([`receive_recipients`]: which of this host's mailboxes an arriving envelope is for).
//!
//! Address forms: `name`, `name@host`, `role:R`, `*`, `owner`. What a *local mailbox* is, and
//! when a bare name is *known locally*, is defined in [`crate::mailbox::agents`].
//!
//! | address | sending host | receiving host |
//! |---|---|---|
//! | `name@<this host>` | local `name` when it is a mailbox here; else refused like an unknown bare name (unless `--new-mailbox`) | local `name`; held as unclaimed when it has no local row |
//! | `name@<peer>` | that pinned peer (unknown → error; its directory known and without `name` → [`UnlistedAgent`] unless forced; not known → a warning) | ignored (not ours) |
//! | `name` | local if known here; else the unique peer whose directory lists it (several → error); else refused with the closest known names ([`UnknownAgent`]), unless the send asks for a new mailbox (`--new-mailbox`: registered here, then local) | local if known here and not in `meta.local_names` |
//! | `*` | every local mailbox but the sender + every pinned peer | every local mailbox |
//! | `role:R` | local mailboxes with role R but the sender + every pinned peer | local mailboxes with role R |
//! | `owner` | local `owner` | local `owner` |
//!
//! Several addresses on one host make one target; a mailbox named twice gets one delivery. The
//! sender lists in `meta.local_names` the names it delivered locally for bare and broadcast
//! addresses, so a receiving host does not deliver a bare name a second time to its own
//! namesake.
//!
//! A bare name that no local row and no paired host's directory lists is a typo until shown
//! otherwise (`wire.md` §4, T205): the send is refused, naming up to 3 close known names, and
//! nothing is stored. `send --new-mailbox` (API: `"new_mailbox": true`) creates the mailbox on
//! purpose: the name is returned in [`Expansion::new_mailboxes`] and the caller registers it as
//! a local mailbox before delivering.
//!
//! This module only reads the store; it never writes and never touches the network.

use std::collections::BTreeMap;

use rusqlite::Connection;
use serde_json::Value;

use agentmbx_protocol::limits;

use crate::mailbox::agents::{self, OWNER};
use crate::mailbox::{peers, MailboxError};
use crate::node::suggest;

/// How agent names are formed (NAME_RE `^[a-z0-9][a-z0-9-]{1,39}$`), for error messages.
pub const NAME_RULE: &str =
    "agent names are 2 to 40 characters of a-z, 0-9 and '-', not starting with '-'";

/// One resolved target of one address, in the order the addresses were given.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Target {
    /// The address as the agent wrote it.
    pub to: String,
    /// The mailbox name: always for a local target; for a remote one when the address named it.
    pub name: Option<String>,
    /// The pinned peer for a remote target; `None` for a local one.
    pub host: Option<String>,
}

/// A pinned peer the envelope goes to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RemoteHost {
    /// The peer's local name.
    pub host: String,
    /// Its pinned host key (base64): the target is the key, never the name (spec §3).
    pub pubkey: String,
}

/// The addresses of one send expanded to concrete mailboxes and hosts (spec G10).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Expansion {
    /// Per address, what it reached (an address may reach several targets, or none).
    pub targets: Vec<Target>,
    /// Local mailboxes to deliver to, each once, in first-seen order.
    pub local: Vec<String>,
    /// `meta.local_names`: names delivered locally for a bare or broadcast address, each once,
    /// bare names first, at most [`limits::MAX_LOCAL_NAMES`].
    pub local_names: Vec<String>,
    /// Remote hosts, each once, by name: one outbox row (one relay target) per host.
    pub remote: Vec<RemoteHost>,
    /// Non-fatal remarks for the sender.
    pub warnings: Vec<String>,
    /// Bare names known nowhere that the send creates on purpose (`new_mailbox`), each once:
    /// the caller registers each as a local mailbox (they are also in `local`).
    pub new_mailboxes: Vec<String>,
}

/// Why an address was refused. The caller stores nothing when it gets one.
#[derive(Debug, thiserror::Error)]
pub enum AddressError {
    /// The address is malformed or ambiguous (the message says which and why).
    #[error("{0}")]
    Invalid(String),
    /// `name@host` names a host that is not a pinned peer.
    #[error("{0}")]
    UnknownHost(UnknownHost),
    /// A bare name that is no agent here nor on any paired host (and no new mailbox was asked
    /// for).
    #[error("{0}")]
    UnknownAgent(UnknownAgent),
    /// `name@host` names a pinned peer whose agent directory is known and lists no `name`
    /// (and the send was not forced).
    #[error("{0}")]
    Unlisted(UnlistedAgent),
    /// Reading the store failed.
    #[error(transparent)]
    Store(#[from] MailboxError),
}

/// A host named in an address that is not a pinned peer, with the pinned names closest to it
/// ([`suggest::closest`]). Its text is the refusal a user sees: `unknown host hots; did you
/// mean hostb?` when some pinned name is close, else how to pin a new host.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UnknownHost {
    /// The host as written.
    pub host: String,
    /// Up to 3 pinned host names close to it, closest first.
    pub suggestions: Vec<String>,
}

impl UnknownHost {
    /// `host`, with the names in `peers` close to it.
    pub fn new(host: &str, peers: &[peers::Peer]) -> Self {
        UnknownHost {
            host: host.to_string(),
            suggestions: suggest::closest(host, peers.iter().map(|p| p.host.as_str())),
        }
    }
}

impl std::fmt::Display for UnknownHost {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let host = &self.host;
        match self.suggestions.as_slice() {
            [] => write!(
                f,
                "unknown host {host}: add it with `agentmbx peers add {host} <host_pubkey>`"
            ),
            names => write!(
                f,
                "unknown host {host}; did you mean {}? (`agentmbx peers` lists the paired hosts)",
                names.join(", ")
            ),
        }
    }
}

/// A bare recipient name that no local row and no paired host's directory lists, with the
/// known names closest to it. Its text is the refusal a user sees: `no agent named bbo here or
/// on a paired host; did you mean bob, bob@work? …`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UnknownAgent {
    /// The name as written.
    pub name: String,
    /// Up to 3 known names close to it, closest first: local agents as `name`, paired hosts'
    /// agents as `name@host`.
    pub suggestions: Vec<String>,
}

impl UnknownAgent {
    /// `name`, with the closest entries of `directory` (this host's rows, named bare, and
    /// paired hosts' rows, named `name@host`; [`agents::directory`]), compared by name.
    pub fn new(name: &str, own: &str, directory: &[agents::DirectoryEntry]) -> Self {
        let labelled = directory.iter().map(|e| {
            let label = if e.host == own {
                e.name.clone()
            } else {
                format!("{}@{}", e.name, e.host)
            };
            (e.name.as_str(), label)
        });
        UnknownAgent {
            name: name.to_string(),
            suggestions: suggest::closest_labelled(name, labelled),
        }
    }
}

/// Most agent names an [`UnlistedAgent`] refusal lists.
pub const MAX_LISTED_AGENTS: usize = 10;

/// `name@host` where the agent directory of the pinned peer `host` is known and has no agent
/// `name`. Its text is the refusal a user sees: the agents the host has (closest to `name`
/// first, at most [`MAX_LISTED_AGENTS`], with how many more) and how to send anyway.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UnlistedAgent {
    /// The agent name as written.
    pub name: String,
    /// The peer (its local name).
    pub host: String,
    /// Agents the host has: up to 3 close to `name` first ([`suggest::closest`]), then the
    /// others by name; at most [`MAX_LISTED_AGENTS`].
    pub agents: Vec<String>,
    /// How many more agents the host has than `agents` lists.
    pub more: usize,
    /// When this host stored the peer's directory (ms), when known: a name registered there
    /// since then is in its next refresh (every 5 minutes).
    pub fetched_at_ms: Option<i64>,
}

impl UnlistedAgent {
    /// `name` on `host`, whose known agents are `known`.
    pub fn new(name: &str, host: &str, known: &[String]) -> Self {
        let mut agents = suggest::closest(name, known.iter().map(String::as_str));
        for k in known {
            if !agents.contains(k) {
                agents.push(k.clone());
            }
        }
        let more = agents.len().saturating_sub(MAX_LISTED_AGENTS);
        agents.truncate(MAX_LISTED_AGENTS);
        UnlistedAgent {
            name: name.to_string(),
            host: host.to_string(),
            agents,
            more,
            fetched_at_ms: None,
        }
    }
}

impl std::fmt::Display for UnknownAgent {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let name = &self.name;
        match self.suggestions.as_slice() {
            [] => write!(
                f,
                "no agent named {name} here or on a paired host: write {name}@<host> for an \
                 agent of a host whose directory is not known yet, register a new agent on its \
                 host (`agentmbx whoami --as {name}`), or send with --new-mailbox (API: \
                 \"new_mailbox\": true) to create the mailbox {name} on this host"
            ),
            names => write!(
                f,
                "no agent named {name} here or on a paired host; did you mean {}? \
                 (--new-mailbox, API \"new_mailbox\": true, creates the mailbox {name} on this host)",
                names.join(", ")
            ),
        }
    }
}

impl std::fmt::Display for UnlistedAgent {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let (name, host) = (&self.name, &self.host);
        write!(f, "{host} has no agent {name}")?;
        match self.agents.as_slice() {
            [] => write!(f, " (its agent directory lists none)")?,
            list => {
                write!(f, "; its agents: {}", list.join(", "))?;
                if self.more > 0 {
                    write!(f, " and {} more", self.more)?;
                }
            }
        }
        write!(
            f,
            ". To send anyway (for an agent that will register there later), use --force (API: \"force\": true): {host} holds it until {name} registers"
        )?;
        if let Some(at) = self.fetched_at_ms {
            write!(
                f,
                ". (As of {host}'s agent directory fetched at {}; it is fetched again every 5 minutes.)",
                agentmbx_protocol::time::iso_ms(at)
            )?;
        }
        Ok(())
    }
}

fn bad_recipient(to: &str) -> AddressError {
    AddressError::Invalid(format!("bad recipient {to:?}: {NAME_RULE}"))
}

/// The role of a `role:R` address, checked like a name.
fn role_of(to: &str) -> Option<Result<&str, AddressError>> {
    let role = to.strip_prefix("role:")?;
    Some(if limits::is_name(role) {
        Ok(role)
    } else {
        Err(AddressError::Invalid(format!(
            "bad role in {to:?}: roles are 2 to 40 characters of a-z, 0-9 and '-', not starting with '-'"
        )))
    })
}

#[derive(Default)]
struct Builder {
    out: Expansion,
    bare_local: Vec<String>,
    broadcast_local: Vec<String>,
    remote: BTreeMap<String, String>,
}

impl Builder {
    fn local(&mut self, to: &str, name: &str) {
        self.out.targets.push(Target {
            to: to.into(),
            name: Some(name.into()),
            host: None,
        });
        if !self.out.local.iter().any(|n| n == name) {
            self.out.local.push(name.into());
        }
    }

    fn remote(&mut self, to: &str, name: Option<&str>, peer: peers::Peer) {
        self.out.targets.push(Target {
            to: to.into(),
            name: name.map(Into::into),
            host: Some(peer.host.clone()),
        });
        self.remote.insert(peer.host, peer.pubkey);
    }

    fn finish(mut self) -> Expansion {
        let mut names: Vec<String> = Vec::new();
        for n in self.bare_local.into_iter().chain(self.broadcast_local) {
            if names.len() < limits::MAX_LOCAL_NAMES && !names.contains(&n) {
                names.push(n);
            }
        }
        self.out.local_names = names;
        self.out.remote = self
            .remote
            .into_iter()
            .map(|(host, pubkey)| RemoteHost { host, pubkey })
            .collect();
        self.out
    }
}

/// What a send chose for addresses that name no agent this host knows of (the send body's
/// `new_mailbox` and `force`; `--new-mailbox`, `--force`). Both default to off: refuse.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Choices {
    /// Create a local mailbox for a bare name (or `name@<this host>`) known nowhere.
    pub new_mailbox: bool,
    /// Send `name@peer` even when the peer's known directory lists no `name` (it holds the
    /// mail until such an agent registers there).
    pub force: bool,
}

/// Expands the addresses `to` that agent `sender` of host `own` wrote (spec G10: broadcast,
/// role and bare names become concrete hosts before anything reaches a transport). It only
/// reads; the first refused address ends it. Errors: [`AddressError::Invalid`] for a
/// malformed address, a bad role, an ambiguous bare name (`name exists on a, b; address it as
/// name@<host>`) or a send that reaches nobody; [`AddressError::UnknownHost`] for `name@host`
/// with a host that is not pinned; [`AddressError::UnknownAgent`] for a bare name (or
/// `name@<this host>`) known nowhere, unless `choices.new_mailbox` (then it is local and listed
/// in [`Expansion::new_mailboxes`]); [`AddressError::Unlisted`] for `name@host` where the
/// peer's agent directory is known ([`agents::directory_known`]) and lists no `name`, unless
/// `choices.force` (then, and when the directory is not known yet, a warning says the host
/// holds the mail until such an agent registers there). `owner@host` is never refused.
pub fn expand(
    conn: &Connection,
    own: &str,
    sender: &str,
    to: &[String],
    choices: Choices,
) -> Result<Expansion, AddressError> {
    let mut b = Builder::default();
    let all_peers = peers::list(conn)?;
    let every_peer = |b: &mut Builder, to: &str| {
        for p in all_peers.iter().filter(|p| p.host != own) {
            b.remote(to, None, p.clone());
        }
    };
    for t in to {
        let t = t.as_str();
        if t == "*" {
            for name in agents::local_mailboxes(conn, own)? {
                if name != sender {
                    b.local(t, &name);
                    b.broadcast_local.push(name);
                }
            }
            every_peer(&mut b, t);
            continue;
        }
        if let Some(role) = role_of(t) {
            let role = role?;
            for name in agents::with_role(conn, own, role)? {
                if name != sender {
                    b.local(t, &name);
                    b.broadcast_local.push(name);
                }
            }
            every_peer(&mut b, t);
            continue;
        }
        if t == OWNER {
            b.local(t, OWNER);
            continue;
        }
        if let Some((name, host)) = t.split_once('@') {
            if !limits::is_name(name) || !limits::is_name(host) {
                return Err(bad_recipient(t));
            }
            if host == own {
                // As a bare name: a name known nowhere here is a likely typo.
                if !agents::has_mailbox(conn, own, name)? {
                    if !choices.new_mailbox {
                        let directory = agents::directory(conn, own)?;
                        return Err(AddressError::UnknownAgent(UnknownAgent::new(
                            name, own, &directory,
                        )));
                    }
                    if !b.out.new_mailboxes.iter().any(|n| n == name) {
                        b.out.new_mailboxes.push(name.to_string());
                    }
                }
                b.local(t, name);
            } else {
                let peer = peers::by_name(conn, host)?
                    .ok_or_else(|| AddressError::UnknownHost(UnknownHost::new(host, &all_peers)))?;
                if let Some(w) = check_listed(conn, name, &peer.host, choices.force)? {
                    b.out.warnings.push(w);
                }
                b.remote(t, Some(name), peer);
            }
            continue;
        }
        if !limits::is_name(t) {
            return Err(bad_recipient(t));
        }
        let listing = agents::peers_listing(conn, own, t)?;
        if agents::is_local(conn, own, t)? {
            if !listing.is_empty() {
                b.out.warnings.push(format!(
                    "{t} also exists on {}: delivered to {t}@{own}; use {t}@<host> for the other",
                    listing.join(", ")
                ));
            }
            b.local(t, t);
            b.bare_local.push(t.to_string());
            continue;
        }
        match listing.as_slice() {
            [host] => {
                let peer = peers::by_name(conn, host)?
                    .ok_or_else(|| AddressError::UnknownHost(UnknownHost::new(host, &all_peers)))?;
                b.remote(t, Some(t), peer);
            }
            [] if choices.new_mailbox => {
                if !b.out.new_mailboxes.iter().any(|n| n == t) {
                    b.out.new_mailboxes.push(t.to_string());
                }
                b.local(t, t);
                b.bare_local.push(t.to_string());
            }
            [] => {
                let directory = agents::directory(conn, own)?;
                return Err(AddressError::UnknownAgent(UnknownAgent::new(
                    t, own, &directory,
                )));
            }
            hosts => {
                return Err(AddressError::Invalid(format!(
                    "{t} exists on {}; address it as {t}@<host>",
                    hosts.join(", ")
                )))
            }
        }
    }
    let out = b.finish();
    if out.local.is_empty() && out.remote.is_empty() {
        return Err(AddressError::Invalid(format!(
            "{} reach no mailbox: no local agent matches and no host is paired",
            to.join(", ")
        )));
    }
    Ok(out)
}

/// Whether `name@host` (a pinned peer) may be sent to: `Ok(None)` when the peer's known
/// directory lists `name` (or it is `owner`), or the directory is not known yet but `name`
/// sent mail from there or the send is forced; `Ok(Some(warning))` when the directory is not
/// known yet otherwise, or when it lists no `name` and `force` is set; else
/// [`AddressError::Unlisted`].
fn check_listed(
    conn: &Connection,
    name: &str,
    host: &str,
    force: bool,
) -> Result<Option<String>, AddressError> {
    if name == OWNER {
        return Ok(None);
    }
    let Some(fetched_at) = agents::directory_known(conn, host)? else {
        // No directory, but an agent that sent from there exists there; a forced send (a
        // reply, or the sender's own choice) needs no remark.
        if force || agents::names_on(conn, host)?.iter().any(|k| k == name) {
            return Ok(None);
        }
        return Ok(Some(format!(
            "{host}'s agent directory is not known here yet: if {host} has no agent {name}, it holds the message until an agent {name} registers there"
        )));
    };
    let known = agents::names_on(conn, host)?;
    if known.iter().any(|k| k == name) {
        Ok(None)
    } else if force {
        Ok(Some(format!(
            "{host}'s agent directory lists no {name}; sent anyway (forced): {host} holds it until an agent {name} registers there"
        )))
    } else {
        let mut refusal = UnlistedAgent::new(name, host, &known);
        refusal.fetched_at_ms = Some(fetched_at);
        Err(AddressError::Unlisted(refusal))
    }
}

/// Where an arriving envelope goes on this host ([`receive_recipients`]).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Arrival {
    /// Local agent names it is delivered to, each once, in order.
    pub deliver: Vec<String>,
    /// Names addressed directly (`name@<this host>`) that have no local mailbox here: the
    /// message is held for them as unclaimed ([`crate::mailbox::unclaimed`]), each once.
    pub hold: Vec<String>,
}

/// The local agent names an arriving envelope is delivered to on the host `own` (`wire.md` §4
/// receive, routing in receive mode), each once, in order: `name@own` → `name`; a bare `name`
/// only when it is a local mailbox here and not listed in `meta.local_names` (the sending host
/// delivered it to its own namesake); `*` → every local mailbox; `role:R` → the local mailboxes
/// with role R; `owner` → `owner`. Names that are not NAME_RE and other hosts' addresses are
/// dropped. A `name@own` whose `name` has no local row (and is not `owner`) is not delivered:
/// it goes to [`Arrival::hold`].
pub fn receive_recipients(
    conn: &Connection,
    own: &str,
    env: &Value,
) -> Result<Arrival, MailboxError> {
    let skip: Vec<&str> = env
        .get("meta")
        .and_then(|m| m.get("local_names"))
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .filter_map(Value::as_str)
        .collect();
    let mut recipients: Vec<String> = Vec::new();
    let mut hold: Vec<String> = Vec::new();
    let mut add = |name: &str| {
        if limits::is_name(name) && !recipients.iter().any(|d| d == name) {
            recipients.push(name.to_string());
        }
    };
    for to in env
        .get("to")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .filter_map(Value::as_str)
    {
        if to == "*" {
            agents::local_mailboxes(conn, own)?
                .iter()
                .for_each(|n| add(n));
        } else if let Some(role) = to.strip_prefix("role:") {
            if limits::is_name(role) {
                agents::with_role(conn, own, role)?
                    .iter()
                    .for_each(|n| add(n));
            }
        } else if to == OWNER {
            add(OWNER);
        } else if let Some((name, host)) = to.split_once('@') {
            if host == own && limits::is_name(name) {
                if name == OWNER || agents::is_local(conn, own, name)? {
                    add(name);
                } else if !hold.iter().any(|h| h == name) {
                    hold.push(name.to_string());
                }
            }
        } else if limits::is_name(to) && !skip.contains(&to) && agents::is_local(conn, own, to)? {
            add(to);
        }
    }
    Ok(Arrival {
        deliver: recipients,
        hold,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::mailbox::agents::{register, replace_host, AgentEntry};
    use crate::testutil::{self, T0};
    use serde_json::json;

    fn entry(name: &str) -> AgentEntry {
        AgentEntry {
            name: name.into(),
            role: None,
            cli: None,
            description: None,
            last_seen: None,
        }
    }

    /// A host `home` with local agents alice, bob (dev), dan (dev); peers work (lists bob,
    /// carol, erin) and lab (lists erin).
    fn world() -> testutil::Store {
        let s = testutil::store();
        s.add_peer(&testutil::identity("work"), false);
        s.add_peer(&testutil::identity("lab"), false);
        s.mailbox
            .with(|c| {
                register(c, "home", "alice", None, None, T0)?;
                register(c, "home", "bob", Some("dev"), None, T0)?;
                register(c, "home", "dan", Some("dev"), None, T0)?;
                replace_host(
                    c,
                    "work",
                    &[entry("bob"), entry("carol"), entry("erin")],
                    T0,
                )?;
                replace_host(c, "lab", &[entry("erin")], T0)?;
                Ok(())
            })
            .unwrap();
        s
    }

    fn exp(s: &testutil::Store, sender: &str, to: &[&str]) -> Result<Expansion, AddressError> {
        exp_forced(s, sender, to, false)
    }

    fn exp_forced(
        s: &testutil::Store,
        sender: &str,
        to: &[&str],
        force: bool,
    ) -> Result<Expansion, AddressError> {
        let to: Vec<String> = to.iter().map(|t| t.to_string()).collect();
        s.mailbox
            .with(|c| {
                let choices = Choices {
                    force,
                    ..Choices::default()
                };
                Ok(expand(c, "home", sender, &to, choices))
            })
            .unwrap()
    }

    fn hosts(e: &Expansion) -> Vec<&str> {
        e.remote.iter().map(|r| r.host.as_str()).collect()
    }

    #[test]
    fn names_on_this_host_and_on_peers() {
        let s = world();
        let e = exp(
            &s,
            "alice",
            &["bob@home", "dan@home", "carol@work", "erin@work", "owner"],
        )
        .unwrap();
        assert_eq!(e.local, vec!["bob", "dan", "owner"]);
        assert_eq!(hosts(&e), vec!["work"]);
        assert!(
            e.local_names.is_empty(),
            "explicit addresses are not local_names"
        );
        assert!(e.warnings.is_empty());
        assert_eq!(e.targets.len(), 5);
        assert!(matches!(
            exp(&s, "alice", &["bob", "xy@nowhere"]),
            Err(AddressError::UnknownHost(h)) if h.host == "nowhere"
        ));
    }

    /// Issue 17 (8b): a typo of a paired host's name is refused with the closest paired names,
    /// not with advice to pin the typo; a name close to none still says how to pin a new host.
    #[test]
    fn an_unknown_host_suggests_the_closest_paired_names() {
        let s = world();
        let err = exp(&s, "alice", &["carol@wrok"]).unwrap_err();
        assert_eq!(
            err.to_string(),
            "unknown host wrok; did you mean work? (`agentmbx peers` lists the paired hosts)"
        );
        assert!(
            matches!(&err, AddressError::UnknownHost(u) if u.suggestions == ["work"]),
            "{err:?}"
        );
        let err = exp(&s, "alice", &["carol@elsewhere"]).unwrap_err();
        assert_eq!(
            err.to_string(),
            "unknown host elsewhere: add it with `agentmbx peers add elsewhere <host_pubkey>`"
        );
    }

    #[test]
    fn bare_names_local_first_then_the_unique_peer_listing_them() {
        let s = world();
        // bob is local (and also on work: a warning says so).
        let e = exp(&s, "alice", &["bob"]).unwrap();
        assert_eq!(
            (e.local.clone(), hosts(&e)),
            (vec!["bob".to_string()], vec![])
        );
        assert_eq!(e.local_names, vec!["bob"]);
        assert!(
            e.warnings[0].contains("bob also exists on work"),
            "{:?}",
            e.warnings
        );
        // carol is only on work.
        let e = exp(&s, "alice", &["carol"]).unwrap();
        assert!(e.local.is_empty());
        assert_eq!(hosts(&e), vec!["work"]);
        assert_eq!(e.targets[0].name.as_deref(), Some("carol"));
        // nobody knows zoe: refused (see below), not delivered here.
        assert!(matches!(
            exp(&s, "alice", &["zoe"]),
            Err(AddressError::UnknownAgent(a)) if a.name == "zoe"
        ));
    }

    /// Issue 17 (4): a bare name known nowhere is a likely typo: refused, naming at most 3 of
    /// the closest known names (local agents bare, paired hosts' agents as `name@host`).
    #[test]
    fn a_bare_name_known_nowhere_is_refused_with_the_closest_names() {
        let s = world();
        let err = exp(&s, "alice", &["carol", "bbo"]).unwrap_err();
        assert_eq!(
            err.to_string(),
            "no agent named bbo here or on a paired host; did you mean bob, bob@work? \
             (--new-mailbox, API \"new_mailbox\": true, creates the mailbox bbo on this host)"
        );
        // At most 3, closest first, ties by name.
        s.register("home", &["dave"]);
        let err = exp(&s, "alice", &["dab"]).unwrap_err();
        assert!(
            matches!(&err, AddressError::UnknownAgent(a) if a.suggestions == ["dan", "bob", "bob@work"]),
            "{err:?}"
        );
        // Close to nothing: says how to register it or create it on purpose.
        let err = exp(&s, "alice", &["zzzzzz"]).unwrap_err();
        assert_eq!(
            err.to_string(),
            "no agent named zzzzzz here or on a paired host: write zzzzzz@<host> for an agent \
             of a host whose directory is not known yet, register a new agent on its host \
             (`agentmbx whoami --as zzzzzz`), or send with --new-mailbox (API: \
             \"new_mailbox\": true) to create the mailbox zzzzzz on this host"
        );
        // Nor does a host that is no longer paired count, even with stale directory rows.
        s.mailbox
            .with(|c| {
                c.execute("DELETE FROM peers WHERE host = 'work'", [])?;
                Ok(())
            })
            .unwrap();
        assert!(matches!(
            exp(&s, "alice", &["carol"]),
            Err(AddressError::UnknownAgent(a)) if a.suggestions.is_empty()
        ));
    }

    /// Issue 17 (4): `new_mailbox` makes a name known nowhere a local mailbox on purpose; names
    /// known somewhere route as always.
    #[test]
    fn new_mailbox_makes_an_unknown_bare_name_local() {
        let s = world();
        let to: Vec<String> = ["zoe", "bob", "carol", "zoe", "zed@home"]
            .iter()
            .map(|t| t.to_string())
            .collect();
        let choices = Choices {
            new_mailbox: true,
            ..Choices::default()
        };
        let e = s
            .mailbox
            .with(|c| Ok(expand(c, "home", "alice", &to, choices)))
            .unwrap()
            .unwrap();
        assert_eq!(e.new_mailboxes, vec!["zoe", "zed"]);
        assert_eq!(e.local, vec!["zoe", "bob", "zed"]);
        assert_eq!(e.local_names, vec!["zoe", "bob"]);
        assert_eq!(hosts(&e), vec!["work"]);
        assert!(exp(&s, "alice", &["bob", "carol"])
            .unwrap()
            .new_mailboxes
            .is_empty());
    }

    #[test]
    fn a_bare_name_on_several_peers_is_refused() {
        let s = world();
        let err = exp(&s, "alice", &["bob", "erin"]).unwrap_err();
        assert_eq!(
            err.to_string(),
            "erin exists on lab, work; address it as erin@<host>"
        );
        // A host removed from the peers no longer counts, even with stale directory rows.
        s.mailbox
            .with(|c| {
                c.execute("DELETE FROM peers WHERE host = 'lab'", [])?;
                Ok(())
            })
            .unwrap();
        let e = exp(&s, "alice", &["erin"]).unwrap();
        assert_eq!(hosts(&e), vec!["work"]);
    }

    #[test]
    fn broadcast_and_role_reach_local_mailboxes_and_every_peer() {
        let s = world();
        let e = exp(&s, "alice", &["*"]).unwrap();
        assert_eq!(
            e.local,
            vec!["bob", "dan"],
            "the sender is not its own audience"
        );
        assert_eq!(hosts(&e), vec!["lab", "work"]);
        assert_eq!(e.local_names, vec!["bob", "dan"]);
        let e = exp(&s, "dan", &["role:dev"]).unwrap();
        assert_eq!(e.local, vec!["bob"]);
        assert_eq!(hosts(&e), vec!["lab", "work"]);
        let e = exp(&s, "alice", &["role:ops"]).unwrap();
        assert!(e.local.is_empty());
        assert_eq!(hosts(&e), vec!["lab", "work"]);
        for bad in [
            "role:", "role:Dev", "role:-x", "Bad", "x@", "@home", "a@b@c", "",
        ] {
            assert!(
                matches!(exp(&s, "alice", &[bad]), Err(AddressError::Invalid(_))),
                "{bad}"
            );
        }
    }

    #[test]
    fn several_addresses_on_one_host_make_one_target_and_one_delivery() {
        let s = world();
        let e = exp(
            &s,
            "alice",
            &["carol", "erin@work", "*", "bob", "bob@home", "role:dev"],
        )
        .unwrap();
        assert_eq!(hosts(&e), vec!["lab", "work"]);
        assert_eq!(e.local, vec!["bob", "dan"]);
        assert_eq!(e.local_names, vec!["bob", "dan"], "bare first, each once");
    }

    #[test]
    fn a_send_that_reaches_nobody_is_refused() {
        let s = testutil::store();
        let to = vec!["*".to_string()];
        let r = s
            .mailbox
            .with(|c| Ok(expand(c, "home", "alice", &to, Choices::default())))
            .unwrap();
        assert!(matches!(r, Err(AddressError::Invalid(m)) if m.contains("reach no mailbox")));
    }

    /// Issue 17 (4): `name@<this host>` for a name that is no mailbox here is the same typo as
    /// the bare name (refused with the closest names); `owner@<this host>` and a name that was
    /// delivered to before are mailboxes.
    #[test]
    fn a_name_at_this_host_that_is_no_mailbox_here_is_refused_like_a_bare_typo() {
        let s = world();
        let err = exp(&s, "alice", &["bbo@home"]).unwrap_err();
        assert!(
            matches!(&err, AddressError::UnknownAgent(a) if a.name == "bbo" && a.suggestions[0] == "bob"),
            "{err:?}"
        );
        let e = exp(&s, "alice", &["owner@home", "dan@home"]).unwrap();
        assert_eq!(e.local, vec!["owner", "dan"]);
    }

    fn recv(s: &testutil::Store, env: Value) -> Vec<String> {
        arrive(s, env).deliver
    }

    fn arrive(s: &testutil::Store, env: Value) -> Arrival {
        s.mailbox
            .with(|c| receive_recipients(c, "home", &env))
            .unwrap()
    }

    #[test]
    fn receiving_routes_each_form_to_this_hosts_mailboxes() {
        let s = world();
        let r = |to: Value| recv(&s, json!({"to": to, "meta": {}}));
        // zoe has no mailbox here: held, not delivered (see below).
        assert_eq!(
            r(json!(["zoe@home", "bob@work", "alice@home"])),
            vec!["alice"]
        );
        // Bare names only when known here.
        assert_eq!(r(json!(["bob", "carol"])), vec!["bob"]);
        assert_eq!(r(json!(["*"])), vec!["alice", "bob", "dan"]);
        assert_eq!(r(json!(["role:dev", "bob@home"])), vec!["bob", "dan"]);
        assert_eq!(
            r(json!(["role:Bad Role", "role:ops"])),
            Vec::<String>::new()
        );
        assert_eq!(r(json!(["owner"])), vec!["owner"]);
        // Names that are not NAME_RE are dropped.
        assert_eq!(
            r(json!(["Bob@home", "../x@home", "-x@home", "x@home"])),
            Vec::<String>::new()
        );
    }

    /// Issue 17 (3): `name@<this host>` for a name with no local row is held, each once;
    /// `owner@<this host>` is always delivered; bare names and broadcasts hold nothing.
    #[test]
    fn direct_mail_for_a_name_without_a_mailbox_here_is_held() {
        let s = world();
        let a = arrive(
            &s,
            json!({"to": ["zoe@home", "bob@home", "zoe@home", "owner@home", "yan", "*"], "meta": {}}),
        );
        assert_eq!(a.deliver, vec!["bob", "owner", "alice", "dan"]);
        assert_eq!(a.hold, vec!["zoe"]);
        let a = arrive(
            &s,
            json!({"to": ["yan", "role:ops", "zoe@work"], "meta": {}}),
        );
        assert_eq!(a, Arrival::default());
    }

    /// Issue 17 (3): `name@peer` where the peer's directory is known and has no `name` is
    /// refused, listing its agents closest first; `force` sends with a warning; `owner@peer`
    /// is never refused.
    #[test]
    fn an_agent_a_known_directory_does_not_list_is_refused_unless_forced() {
        let s = world();
        let err = exp(&s, "alice", &["bob", "carl@work"]).unwrap_err();
        let AddressError::Unlisted(u) = &err else {
            panic!("{err:?}")
        };
        assert_eq!(
            (u.name.as_str(), u.host.as_str(), u.more),
            ("carl", "work", 0)
        );
        assert_eq!(u.agents, vec!["carol", "bob", "erin"], "closest first");
        assert_eq!(
            err.to_string(),
            format!(
                "work has no agent carl; its agents: carol, bob, erin. To send anyway (for an \
                 agent that will register there later), use --force (API: \"force\": true): \
                 work holds it until carl registers. (As of work's agent directory fetched at \
                 {}; it is fetched again every 5 minutes.)",
                agentmbx_protocol::time::iso_ms(T0)
            )
        );
        let e = exp_forced(&s, "alice", &["carl@work"], true).unwrap();
        assert_eq!(hosts(&e), vec!["work"]);
        assert_eq!(
            e.warnings,
            vec![
                "work's agent directory lists no carl; sent anyway (forced): work holds it until \
                 an agent carl registers there"
            ]
        );
        let e = exp(&s, "alice", &["owner@work", "carol@work"]).unwrap();
        assert_eq!((hosts(&e), e.warnings.len()), (vec!["work"], 0));
        // An empty known directory refuses every name but owner, and says it lists none.
        s.mailbox
            .with(|c| replace_host(c, "lab", &[], T0).map(|_| ()))
            .unwrap();
        let err = exp(&s, "alice", &["erin@lab"]).unwrap_err();
        assert!(
            err.to_string()
                .starts_with("lab has no agent erin (its agent directory lists none). "),
            "{err}"
        );
    }

    /// Issue 17 (3): a refusal lists at most 10 agents and says how many more there are.
    #[test]
    fn a_refusal_lists_a_bounded_number_of_agents() {
        let known: Vec<String> = (0..25).map(|i| format!("agent-{i:02}")).collect();
        let u = UnlistedAgent::new("agent-7", "work", &known);
        assert_eq!(u.agents.len(), MAX_LISTED_AGENTS);
        assert_eq!(u.more, 15);
        assert_eq!(
            &u.agents[..4],
            &["agent-07", "agent-17", "agent-00", "agent-01"]
        );
        assert!(u.to_string().contains(" and 15 more."), "{u}");
    }

    /// Issue 17 (3): while a peer's directory is not known, `name@peer` is sent with a warning
    /// that says the host holds it when it has no such agent.
    #[test]
    fn an_unknown_directory_sends_with_a_warning() {
        let s = testutil::store();
        s.add_peer(&testutil::identity("work"), false);
        // A row from mail work sent does not make its directory known.
        s.mailbox
            .with(|c| {
                c.execute(
                    "INSERT INTO agents(name, host, last_seen) VALUES ('ann', 'work', 1)",
                    [],
                )?;
                Ok(())
            })
            .unwrap();
        let e = exp(&s, "alice", &["nobody@work"]).unwrap();
        assert_eq!(hosts(&e), vec!["work"]);
        assert_eq!(
            e.warnings,
            vec![
                "work's agent directory is not known here yet: if work has no agent nobody, it \
                 holds the message until an agent nobody registers there"
            ]
        );
        // An agent that sent mail from work exists there; a forced send needs no remark.
        assert!(exp(&s, "alice", &["ann@work"]).unwrap().warnings.is_empty());
        let forced = exp_forced(&s, "alice", &["nobody@work"], true).unwrap();
        assert!(forced.warnings.is_empty(), "{:?}", forced.warnings);
    }

    #[test]
    fn local_names_stop_a_second_delivery_of_a_bare_name() {
        let s = world();
        let env = json!({"to": ["bob", "dan", "x@home"], "meta": {"local_names": ["bob"]}});
        assert_eq!(recv(&s, env), vec!["dan"]);
        // Only bare addresses are affected: explicit and broadcast ones still deliver.
        let env = json!({"to": ["bob@home", "*"], "meta": {"local_names": ["bob", "dan"]}});
        assert_eq!(recv(&s, env), vec!["bob", "alice", "dan"]);
    }
}
