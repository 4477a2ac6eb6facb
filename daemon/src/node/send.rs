//! Sending: validate → route → build and sign the envelope → store the local copy, deliver to
//! local agents, and add one outbox row per remote target host — all in the caller's one
//! transaction (design README "Data flow"). Sealing happens later, per target, in the transport
//! (the wire bytes are persisted before the first attempt).
//!
//! Addressing in this slice: `name` or `name@<this host>` is local; `name@<peer>` goes to the
//! peer whose host key is pinned under that name (spec §3: targets are keys, never names).

use std::collections::BTreeMap;

use rusqlite::Connection;
use serde::{Deserialize, Serialize};

use agentmbx_protocol::envelope::{self, Draft};
use agentmbx_protocol::limits;

use crate::identity::Identity;
use crate::mailbox::{messages, outbox, peers, MailboxError};

/// Recipients per message from a local agent (tighter than the network cap of 100).
pub const MAX_LOCAL_RECIPIENTS: usize = 20;
/// Refs per message from a local agent.
pub const MAX_LOCAL_REFS: usize = 20;

/// What an agent asks to send (`POST /v1/messages`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct SendRequest {
    /// The sending agent's name on this host (NAME_RE).
    pub from: String,
    /// Recipients: `name` (local), `name@host` (this host or a peer). 1..=20.
    pub to: Vec<String>,
    /// One line, 1..=200 UTF-16 units (control characters become spaces).
    pub subject: String,
    /// Body, ≤ 262,144 UTF-8 bytes.
    #[serde(default)]
    pub body: String,
    /// `message` (default), `request`, `reply`, `status`, `decision`, `alert`, `task`.
    #[serde(default)]
    pub kind: Option<String>,
    /// Thread id; default the new message's id.
    #[serde(default)]
    pub thread: Option<String>,
    /// Message this replies to.
    #[serde(default)]
    pub reply_to: Option<String>,
    /// Whether a reply is expected.
    #[serde(default)]
    pub needs_reply: bool,
    /// References (≤20, each ≤2048).
    #[serde(default)]
    pub refs: Vec<String>,
}

/// How one recipient was routed.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, utoipa::ToSchema)]
pub struct Route {
    /// The address as given.
    pub to: String,
    /// `local` (delivered now) or `remote` (queued for the target host).
    pub route: String,
    /// Target host for remote routes.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub host: Option<String>,
}

/// The answer to a send.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, utoipa::ToSchema)]
pub struct SendOutcome {
    /// Envelope id.
    pub id: String,
    /// Thread id.
    pub thread: String,
    /// Per recipient routing.
    pub recipients: Vec<Route>,
    /// Remote hosts with a queued outbox row.
    pub queued_for_hosts: Vec<String>,
    /// Non-fatal remarks.
    pub warnings: Vec<String>,
}

/// Why a send was refused. Nothing is stored when any of these is returned.
#[derive(Debug, thiserror::Error)]
pub enum SendError {
    /// The request is invalid (message says what).
    #[error("{0}")]
    Invalid(String),
    /// A recipient host is not a known peer.
    #[error("unknown host {0}: add it with `agentmbx peers add {0} <host_pubkey>`")]
    UnknownHost(String),
    /// Storage failed.
    #[error(transparent)]
    Store(#[from] MailboxError),
}

enum Target {
    Local(String),
    Remote { host: String, pubkey: String },
}

fn route(conn: &Connection, own_host: &str, to: &str) -> Result<Target, SendError> {
    if to == "*" || to.starts_with("role:") {
        return Err(SendError::Invalid(format!(
            "{to}: broadcast and role addresses are not supported yet"
        )));
    }
    let (name, host) = match to.split_once('@') {
        Some((n, h)) => (n, Some(h)),
        None => (to, None),
    };
    if !limits::is_name(name) {
        return Err(SendError::Invalid(format!(
            "bad recipient {to:?}: agent names match ^[a-z0-9][a-z0-9-]{{1,39}}$"
        )));
    }
    match host {
        None => Ok(Target::Local(name.to_string())),
        Some(h) if h == own_host => Ok(Target::Local(name.to_string())),
        Some(h) => {
            let peer =
                peers::by_name(conn, h)?.ok_or_else(|| SendError::UnknownHost(h.to_string()))?;
            Ok(Target::Remote {
                host: peer.host,
                pubkey: peer.pubkey,
            })
        }
    }
}

/// Sends `req` from this host inside `conn`'s current transaction. `id` is a fresh ULID and
/// `now_ms` the send time. Errors: [`SendError`]; on error the caller rolls back.
pub fn send(
    conn: &Connection,
    ident: &Identity,
    req: &SendRequest,
    id: String,
    now_ms: i64,
) -> Result<SendOutcome, SendError> {
    let own = ident.host.as_str();
    if !limits::is_name(&req.from) {
        return Err(SendError::Invalid(
            "bad sender: agent names match ^[a-z0-9][a-z0-9-]{1,39}$".into(),
        ));
    }
    if req.to.is_empty() {
        return Err(SendError::Invalid(
            "at least one recipient is required".into(),
        ));
    }
    if req.to.len() > MAX_LOCAL_RECIPIENTS {
        return Err(SendError::Invalid(format!(
            "more than {MAX_LOCAL_RECIPIENTS} recipients"
        )));
    }
    if req.refs.len() > MAX_LOCAL_REFS {
        return Err(SendError::Invalid(format!(
            "more than {MAX_LOCAL_REFS} refs"
        )));
    }
    let mut recipients = Vec::new();
    let mut local = Vec::new();
    let mut remote: BTreeMap<String, String> = BTreeMap::new();
    for to in &req.to {
        match route(conn, own, to)? {
            Target::Local(name) => {
                recipients.push(Route {
                    to: to.clone(),
                    route: "local".into(),
                    host: None,
                });
                local.push(name);
            }
            Target::Remote { host, pubkey } => {
                recipients.push(Route {
                    to: to.clone(),
                    route: "remote".into(),
                    host: Some(host.clone()),
                });
                remote.insert(host, pubkey);
            }
        }
    }
    let draft = Draft {
        from: format!("{}@{own}", req.from),
        to: req.to.clone(),
        subject: req.subject.clone(),
        body: req.body.clone(),
        kind: req.kind.clone(),
        thread: req.thread.clone(),
        reply_to: req.reply_to.clone(),
        needs_reply: req.needs_reply,
        refs: req.refs.clone(),
    };
    let mut env =
        envelope::build(&draft, id, now_ms).map_err(|e| SendError::Invalid(e.to_string()))?;
    env.sign(own, &ident.host_key)
        .map_err(|e| SendError::Invalid(e.to_string()))?;
    let value = env.to_value();
    messages::insert(conn, &value, "local", now_ms)?;
    for name in &local {
        messages::deliver(conn, &env.id, name, now_ms)?;
    }
    for (host, pubkey) in &remote {
        outbox::enqueue(conn, &env.id, host, pubkey, now_ms)?;
    }
    let mut warnings = Vec::new();
    if env.subject != req.subject {
        warnings.push("subject was made one line and cut to 200 characters".into());
    }
    Ok(SendOutcome {
        id: env.id.clone(),
        thread: env.thread.clone(),
        recipients,
        queued_for_hosts: remote.into_keys().collect(),
        warnings,
    })
}
