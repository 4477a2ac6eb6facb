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

/// How agent names are formed (NAME_RE `^[a-z0-9][a-z0-9-]{1,39}$`), for error messages.
pub const NAME_RULE: &str =
    "agent names are 2 to 40 characters of a-z, 0-9 and '-', not starting with '-'";

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
            "bad recipient {to:?}: {NAME_RULE}"
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
        return Err(SendError::Invalid(format!(
            "bad sender {:?}: {NAME_RULE}",
            req.from
        )));
    }
    if req.to.is_empty() {
        return Err(SendError::Invalid(
            "at least one recipient is required".into(),
        ));
    }
    if let Some(kind) = req.kind.as_deref() {
        if !envelope::KINDS.contains(&kind) {
            return Err(SendError::Invalid(format!(
                "bad kind {kind:?}: one of {}",
                envelope::KINDS.join(", ")
            )));
        }
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testutil::{self, T0};

    const ID: &str = "01KDVDNA3VG2MH8KWSQRCWJZ0S";

    fn counts(s: &testutil::Store) -> (i64, i64, i64) {
        (
            s.scalar("SELECT COUNT(*) FROM messages"),
            s.scalar("SELECT COUNT(*) FROM deliveries"),
            s.scalar("SELECT COUNT(*) FROM outbox"),
        )
    }

    #[test]
    fn an_unknown_host_is_an_error_and_nothing_is_stored() {
        let s = testutil::store();
        let me = testutil::identity("home");
        let err = s
            .send(&me, "alice", &["bob", "carol@nowhere"], "s", ID, T0)
            .unwrap_err();
        assert!(
            matches!(&err, SendError::UnknownHost(h) if h == "nowhere"),
            "{err}"
        );
        assert_eq!(counts(&s), (0, 0, 0));
        // Refused addresses store nothing either.
        for to in ["*", "role:dev", "Bad Name", "x@"] {
            assert!(
                s.send(&me, "alice", &["bob", to], "s", ID, T0).is_err(),
                "{to}"
            );
        }
        assert!(s.send(&me, "Not A Name", &["bob"], "s", ID, T0).is_err());
        assert!(s.send(&me, "alice", &[], "s", ID, T0).is_err());
        assert_eq!(counts(&s), (0, 0, 0));
    }

    #[test]
    fn local_recipients_get_the_message_at_once() {
        let s = testutil::store();
        let me = testutil::identity("home");
        let out = s
            .send(
                &me,
                "alice",
                &["bob", "carol@home", "bob@home"],
                "hi",
                ID,
                T0,
            )
            .unwrap();
        assert_eq!(out.id, ID);
        assert!(out.queued_for_hosts.is_empty());
        assert_eq!(counts(&s), (1, 2, 0));
        let page = s
            .mailbox
            .with(|c| crate::mailbox::messages::inbox(c, "bob", None, 50, false))
            .unwrap();
        assert_eq!(page.messages.len(), 1);
        assert_eq!(page.messages[0].state, "new");
        // The stored copy is the signed plaintext envelope.
        let env: String = s.scalar("SELECT envelope FROM messages");
        let env: serde_json::Value = serde_json::from_str(&env).unwrap();
        assert!(env["enc"].is_null());
        assert!(envelope::verify(&env, &me.host_key.public()));
    }

    #[test]
    fn remote_recipients_get_one_pending_row_per_host_due_now() {
        let s = testutil::store();
        let me = testutil::identity("home");
        let peer = testutil::identity("work");
        s.add_peer(&peer, false);
        let out = s
            .send(
                &me,
                "alice",
                &["bob@work", "dave@work", "carol"],
                "hi",
                ID,
                T0,
            )
            .unwrap();
        assert_eq!(out.queued_for_hosts, vec!["work".to_string()]);
        assert_eq!(counts(&s), (1, 1, 1));
        let rows = s.mailbox.with(|c| outbox::due(c, T0, 10)).unwrap();
        assert_eq!(rows.len(), 1);
        let r = &rows[0];
        assert_eq!(
            (r.state.as_str(), r.attempts, r.next_at, r.wire.is_none()),
            ("pending", 0, T0, true)
        );
        assert_eq!(r.target_pubkey, peer.host_key.public().to_b64());
    }
}
