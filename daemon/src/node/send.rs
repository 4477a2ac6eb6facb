//! Sending: validate → route → build and sign the envelope → store the local copy, deliver to
//! local agents, and add one outbox row per remote target host — all in the caller's one
//! transaction (design README "Data flow"). Sealing happens later, once per target, in the
//! outbound step ([`crate::node::outbound::seal_once`], called by the transport's first attempt;
//! the wire bytes are persisted before they are sent).
//!
//! Addressing (`name`, `name@host`, `role:R`, `*`, `owner`) is expanded by
//! [`route::expand`] into local mailboxes and pinned peers before anything is stored (spec G10:
//! the relay only ever sees concrete host keys; targets are keys, never names, spec §3). The
//! envelope keeps `to` as the agent wrote it; the same signed envelope goes to every remote host,
//! which routes `to` itself (`meta.local_names` lists the names delivered here for bare and
//! broadcast addresses, so a receiving host does not deliver them again).

use rusqlite::Connection;
use serde::{Deserialize, Serialize};

use agentmbx_protocol::envelope::{self, Draft};
use agentmbx_protocol::limits;

use crate::identity::Identity;
use crate::mailbox::{agents, messages, outbox, MailboxError};
use crate::node::route::{self, AddressError, UnknownAgent, UnknownHost, UnlistedAgent};
use crate::node::suggest;

pub use crate::node::route::NAME_RULE;

/// Recipients per message from a local agent (tighter than the network cap of 100).
pub const MAX_LOCAL_RECIPIENTS: usize = 20;
/// Refs per message from a local agent.
pub const MAX_LOCAL_REFS: usize = 20;

/// What an agent asks to send (`POST /v1/messages`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct SendRequest {
    /// The sending agent's name on this host (NAME_RE).
    #[schema(value_type = crate::vocab::AgentName)]
    pub from: String,
    /// Recipients, 1..=20: `name` (a local mailbox, else the one paired host whose directory
    /// lists it, else refused 400 `UNKNOWN_AGENT` unless `new_mailbox`), `name@host` (this host or a pinned peer), `role:R` (local mailboxes with role R
    /// and every paired host), `*` (every local mailbox and every paired host), `owner`.
    #[schema(value_type = Vec<crate::vocab::Address>, min_items = 1, max_items = 20)]
    pub to: Vec<String>,
    /// One line: not only whitespace (else 400); control characters become spaces and a
    /// subject over 200 UTF-16 units is cut to 200, each with a warning in the answer.
    #[schema(min_length = 1, pattern = "[^\\s\\uFEFF]")]
    pub subject: String,
    /// Body, ≤ 262,144 UTF-8 bytes (`maxLength` bounds the characters; the byte count is the
    /// rule: a body over it is 400).
    #[serde(default)]
    #[schema(max_length = 262144)]
    pub body: String,
    /// `message` (default; `reply` when `reply_to` is given), `request`, `reply`, `status`,
    /// `decision`, `alert`, `task`.
    #[serde(default)]
    #[schema(value_type = Option<crate::vocab::Kind>)]
    pub kind: Option<String>,
    /// Thread id; default the parent's thread when `reply_to` is given, else the new message's
    /// id. With `reply_to`, a thread other than the parent's is refused (400), as is an
    /// empty one.
    #[serde(default)]
    #[schema(value_type = Option<crate::vocab::ThreadId>)]
    pub thread: Option<String>,
    /// Id of the message this replies to: one delivered to the sender or sent by it, else 404
    /// (nothing sent). The reply continues that message's thread.
    #[serde(default)]
    #[schema(value_type = Option<crate::vocab::MessageId>)]
    pub reply_to: Option<String>,
    /// Whether a reply is expected.
    #[serde(default)]
    pub needs_reply: bool,
    /// References (≤20, each ≤2048 UTF-16 units).
    #[serde(default)]
    #[schema(value_type = Vec<crate::vocab::RefText>, max_items = 20)]
    pub refs: Vec<String>,
    /// Create a new local mailbox on purpose for each bare name in `to` that is no agent here
    /// nor on any paired host (it is registered, then delivered to); without it such a name
    /// is refused (400 `UNKNOWN_AGENT`, with the closest known names) as a likely typo.
    #[serde(default)]
    pub new_mailbox: bool,
    /// Send to `name@host` even when that paired host's known agent directory lists no `name`
    /// (e.g. an agent that will register there later; the host holds the mail until then).
    /// Without it such an address is refused (400 `UNKNOWN_AGENT`, listing the host's agents).
    #[serde(default)]
    pub force: bool,
}

/// What an agent asks to answer (`POST /v1/messages/{id}/reply`): a message to the sender of
/// `{id}`, in its thread, with subject `Re: <its subject>` (0.5.x `mbx_reply`). It takes no
/// `force`: its recipient sent from its host, so a reply is never refused as `UNKNOWN_AGENT`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ReplyRequest {
    /// The replying agent's name on this host (NAME_RE); `{id}` must be delivered to it or
    /// sent by it.
    #[schema(value_type = crate::vocab::AgentName)]
    pub from: String,
    /// Body, ≤ 262,144 UTF-8 bytes (`maxLength` bounds the characters; the byte count is the
    /// rule: a body over it is 400).
    #[serde(default)]
    #[schema(max_length = 262144)]
    pub body: String,
    /// Kind (default `reply`); as for a send.
    #[serde(default)]
    #[schema(value_type = Option<crate::vocab::Kind>)]
    pub kind: Option<String>,
    /// Whether a reply is expected.
    #[serde(default)]
    pub needs_reply: bool,
    /// References (≤20, each ≤2048 UTF-16 units).
    #[serde(default)]
    #[schema(value_type = Vec<crate::vocab::RefText>, max_items = 20)]
    pub refs: Vec<String>,
}

/// `Re: <subject>`, not doubled when the subject already starts with `Re:` (any case).
pub fn re_subject(subject: &str) -> String {
    if subject
        .get(..3)
        .is_some_and(|p| p.eq_ignore_ascii_case("re:"))
    {
        subject.to_string()
    } else {
        format!("Re: {subject}")
    }
}

/// The send that answers message `parent_id` for `req`: addressed to the parent's sender (its
/// bare name when that is an agent of this host) — or, when the parent is the replying agent's
/// own message, to the addresses it was sent to (a follow-up to one's own message continues
/// the conversation rather than mailing oneself) — same thread, `Re:` subject. Errors:
/// [`SendError::ParentNotFound`] when the agent cannot see `parent_id`.
pub fn reply_request(
    conn: &Connection,
    own_host: &str,
    parent_id: &str,
    req: &ReplyRequest,
) -> Result<SendRequest, SendError> {
    if !limits::is_name(&req.from) {
        return Err(SendError::Invalid(format!(
            "bad sender {:?}: {NAME_RULE}",
            req.from
        )));
    }
    let parent = match messages::parent(conn, &req.from, own_host, parent_id) {
        Ok(p) => p,
        Err(MailboxError::NotFound(m)) => return Err(SendError::ParentNotFound(m)),
        Err(e) => return Err(e.into()),
    };
    let own_message = parent.from == format!("{}@{own_host}", req.from);
    let to = if own_message && !parent.to.is_empty() {
        parent.to.clone()
    } else {
        match parent.from.split_once('@') {
            Some((name, host)) if host == own_host => vec![name.to_string()],
            _ => vec![parent.from.clone()],
        }
    };
    Ok(SendRequest {
        from: req.from.clone(),
        to,
        subject: re_subject(&parent.subject),
        body: req.body.clone(),
        kind: req.kind.clone(),
        thread: Some(parent.thread),
        reply_to: Some(parent.id),
        needs_reply: req.needs_reply,
        refs: req.refs.clone(),
        new_mailbox: false,
        // A reply goes to an agent that sent from that host: it exists there.
        force: true,
    })
}

/// One target an address reached (an address such as `*` can reach several).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, utoipa::ToSchema)]
pub struct Route {
    /// The address as given.
    pub to: String,
    /// `local` (delivered now) or `remote` (queued for the target host).
    #[schema(value_type = crate::vocab::RouteKind)]
    pub route: String,
    /// The mailbox: always for a local route; for a remote one when the address named it.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
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
    /// Per address, each target it reached, in the order the addresses were given.
    pub recipients: Vec<Route>,
    /// Remote hosts with a queued outbox row.
    pub queued_for_hosts: Vec<String>,
    /// Non-fatal remarks.
    pub warnings: Vec<String>,
}

/// Why a send was refused. Nothing is stored when any of these is returned.
#[derive(Debug, thiserror::Error)]
pub enum SendError {
    /// The request is invalid, or an address is malformed, ambiguous or reaches nobody
    /// (message says what).
    #[error("{0}")]
    Invalid(String),
    /// A recipient host is not a known peer.
    #[error("{0}")]
    UnknownHost(UnknownHost),
    /// A bare recipient name is no agent here nor on any paired host, and `new_mailbox` was
    /// not asked for.
    #[error("{0}")]
    UnknownAgent(UnknownAgent),
    /// `name@host` where the peer's known agent directory lists no `name` (not forced).
    #[error("{0}")]
    Unlisted(UnlistedAgent),
    /// The message replied to is not one the sender can see (unknown id, or another mailbox's).
    #[error("{0}")]
    ParentNotFound(String),
    /// Storage failed.
    #[error(transparent)]
    Store(#[from] MailboxError),
}

impl From<AddressError> for SendError {
    fn from(e: AddressError) -> Self {
        match e {
            AddressError::Invalid(m) => SendError::Invalid(m),
            AddressError::UnknownHost(h) => SendError::UnknownHost(h),
            AddressError::UnknownAgent(a) => SendError::UnknownAgent(a),
            AddressError::Unlisted(a) => SendError::Unlisted(a),
            AddressError::Store(e) => SendError::Store(e),
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
    if req.thread.as_deref() == Some("") {
        return Err(SendError::Invalid(
            "thread is empty: give a thread id, or leave thread out for a new thread".into(),
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
    // A reply continues its parent's thread and is a `reply` unless told otherwise.
    let mut thread = req.thread.clone();
    let mut kind = req.kind.clone();
    if let Some(parent_id) = req.reply_to.as_deref() {
        let parent = match messages::parent(conn, &req.from, own, parent_id) {
            Ok(p) => p,
            Err(MailboxError::NotFound(m)) => return Err(SendError::ParentNotFound(m)),
            Err(e) => return Err(e.into()),
        };
        if let Some(t) = thread.as_deref() {
            if t != parent.thread {
                return Err(SendError::Invalid(format!(
                    "thread {t:?} is not the thread of {parent_id} ({}): a reply stays in its parent's thread",
                    parent.thread
                )));
            }
        }
        thread = Some(parent.thread);
        kind.get_or_insert_with(|| "reply".into());
    }
    // The sender is a local mailbox from its first send on (`agents` module docs). A first send
    // under a name close to an existing agent's is most likely a typo of it: say so (the
    // replies would go to a mailbox nobody reads).
    let mut first_send: Option<String> = None;
    if !agents::has_mailbox(conn, own, &req.from)? {
        let known = agents::local_mailboxes(conn, own)?;
        let close = suggest::closest(&req.from, known.iter().map(String::as_str));
        if !close.is_empty() {
            first_send = Some(format!(
                "{} is a new agent on this host (this is its first message; replies come to it); did you mean {}?",
                req.from,
                close.join(", ")
            ));
        }
    }
    agents::touch(conn, own, &req.from, now_ms)?;
    let choices = route::Choices {
        new_mailbox: req.new_mailbox,
        force: req.force,
    };
    // An address given twice is one address (the envelope's `to` lists it once).
    let mut to: Vec<String> = Vec::with_capacity(req.to.len());
    for t in &req.to {
        if !to.contains(t) {
            to.push(t.clone());
        }
    }
    let plan = route::expand(conn, own, &req.from, &to, choices)?;
    // Mailboxes created on purpose are real mailboxes from now on (`agents` module docs).
    for name in &plan.new_mailboxes {
        agents::register(conn, own, name, None, None, now_ms)?;
    }
    let recipients = plan
        .targets
        .iter()
        .map(|t| Route {
            to: t.to.clone(),
            route: if t.host.is_some() { "remote" } else { "local" }.into(),
            name: t.name.clone(),
            host: t.host.clone(),
        })
        .collect();
    let draft = Draft {
        from: format!("{}@{own}", req.from),
        to,
        subject: req.subject.clone(),
        body: req.body.clone(),
        kind,
        thread,
        reply_to: req.reply_to.clone(),
        needs_reply: req.needs_reply,
        refs: req.refs.clone(),
    };
    let mut env =
        envelope::build(&draft, id, now_ms).map_err(|e| SendError::Invalid(e.to_string()))?;
    // Signed data: set before signing (`wire.md` §2.3 `local_names[]`).
    if !plan.local_names.is_empty() {
        env.meta.local_names = Some(plan.local_names.clone());
    }
    env.sign(own, &ident.host_key)
        .map_err(|e| SendError::Invalid(e.to_string()))?;
    let value = env.to_value();
    messages::insert(conn, &value, "local", now_ms)?;
    for name in &plan.local {
        messages::deliver(conn, &env.id, name, now_ms)?;
    }
    for r in &plan.remote {
        outbox::enqueue(conn, &env.id, &r.host, &r.pubkey, now_ms)?;
    }
    let mut warnings: Vec<String> = first_send.into_iter().collect();
    warnings.extend(plan.warnings);
    for name in &plan.new_mailboxes {
        warnings.push(format!("created the new mailbox {name} on this host"));
    }
    if env.subject != req.subject {
        warnings.push("subject was made one line and cut to 200 characters".into());
    }
    Ok(SendOutcome {
        id: env.id.clone(),
        thread: env.thread.clone(),
        recipients,
        queued_for_hosts: plan.remote.into_iter().map(|r| r.host).collect(),
        warnings,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testutil::{self, T0};

    const ID: &str = "01KDVDNA3VG2MH8KWSQRCWJZ0S";

    #[test]
    fn a_reply_subject_gets_one_re_prefix() {
        assert_eq!(re_subject("plan"), "Re: plan");
        assert_eq!(re_subject("Re: plan"), "Re: plan");
        assert_eq!(re_subject("RE:plan"), "RE:plan");
        assert_eq!(re_subject("Ré"), "Re: Ré");
        assert_eq!(re_subject("R"), "Re: R");
    }

    #[test]
    fn an_empty_thread_is_refused_and_nothing_is_stored() {
        let s = testutil::store();
        let me = testutil::identity("home");
        let req: SendRequest = serde_json::from_value(serde_json::json!(
            {"from": "alice", "to": ["bob"], "subject": "s", "thread": ""}
        ))
        .unwrap();
        let out = s
            .mailbox
            .with(|c| Ok(send(c, &me, &req, ID.into(), T0)))
            .unwrap();
        assert!(
            matches!(&out, Err(SendError::Invalid(m)) if m.starts_with("thread is empty")),
            "{out:?}"
        );
        assert_eq!(s.scalar::<i64>("SELECT COUNT(*) FROM messages"), 0);
    }

    #[test]
    fn a_reply_to_mail_from_another_host_is_addressed_to_its_sender_there() {
        let s = testutil::store();
        // Mail alice@work sent to bob here, in a thread of its own.
        let draft = Draft {
            from: "alice@work".into(),
            to: vec!["bob@home".into()],
            subject: "from work".into(),
            body: String::new(),
            kind: None,
            thread: Some("T1".into()),
            reply_to: None,
            needs_reply: true,
            refs: vec![],
        };
        let env = envelope::build(&draft, ID.into(), T0).unwrap();
        s.mailbox
            .with(|c| {
                messages::insert(c, &env.to_value(), "work", T0)?;
                messages::deliver(c, ID, "bob", T0)
            })
            .unwrap();
        let req = ReplyRequest {
            from: "bob".into(),
            body: String::new(),
            kind: None,
            needs_reply: false,
            refs: vec![],
        };
        let out = s
            .mailbox
            .with(|c| Ok::<_, MailboxError>(reply_request(c, "home", ID, &req)))
            .unwrap()
            .unwrap();
        assert_eq!(out.to, vec!["alice@work".to_string()]);
        assert_eq!(out.subject, "Re: from work");
        assert_eq!(out.reply_to.as_deref(), Some(ID));
        assert_eq!(out.thread.as_deref(), Some("T1"));
        // Its recipient sent from work: never refused for work's directory (issue 17, 3).
        assert!(out.force);
        // Another local agent cannot answer bob's mail.
        let carol = ReplyRequest {
            from: "carol".into(),
            ..req
        };
        assert!(matches!(
            s.mailbox
                .with(|c| Ok::<_, MailboxError>(reply_request(c, "home", ID, &carol)))
                .unwrap(),
            Err(SendError::ParentNotFound(_))
        ));
    }

    /// A reply to one's own message (a follow-up) goes to the addresses that message was sent
    /// to, not back to oneself.
    #[test]
    fn a_reply_to_ones_own_message_goes_to_its_recipients() {
        let s = testutil::store();
        let me = testutil::identity("home");
        s.add_peer(&testutil::identity("work"), true);
        s.register("home", &["alice", "bob"]);
        s.send(&me, "bob", &["alice", "carol@work"], "plan", ID, T0)
            .unwrap();
        let req = ReplyRequest {
            from: "bob".into(),
            body: String::new(),
            kind: None,
            needs_reply: false,
            refs: vec![],
        };
        let out = s
            .mailbox
            .with(|c| Ok::<_, MailboxError>(reply_request(c, "home", ID, &req)))
            .unwrap()
            .unwrap();
        assert_eq!(out.to, vec!["alice".to_string(), "carol@work".to_string()]);
        assert_eq!(out.subject, "Re: plan");
        // alice answering the same message still answers bob.
        let alice = ReplyRequest {
            from: "alice".into(),
            ..req
        };
        let out = s
            .mailbox
            .with(|c| Ok::<_, MailboxError>(reply_request(c, "home", ID, &alice)))
            .unwrap()
            .unwrap();
        assert_eq!(out.to, vec!["bob".to_string()]);
    }

    /// A first send under a name close to an existing agent's says so (a likely typo of the
    /// sender); a new name close to none, and a known sender, send without that warning. An
    /// address given twice is one address in the envelope.
    #[test]
    fn a_first_send_as_a_name_close_to_an_agent_warns_and_repeated_addresses_are_one() {
        let s = testutil::store();
        let me = testutil::identity("home");
        s.register("home", &["alice", "bob"]);
        let mut ids = testutil::ids();
        let out = s
            .send(&me, "alcie", &["bob", "bob"], "s", &ids.next(T0), T0)
            .unwrap();
        assert_eq!(
            out.warnings,
            vec![
                "alcie is a new agent on this host (this is its first message; replies come to \
                 it); did you mean alice?"
                    .to_string()
            ]
        );
        assert_eq!(out.recipients.len(), 1, "{:?}", out.recipients);
        assert_eq!(
            s.scalar::<String>(&format!(
                "SELECT json_extract(envelope, '$.to') FROM messages WHERE id = '{}'",
                out.id
            )),
            r#"["bob"]"#
        );
        // Its second send is no first send.
        let out = s
            .send(&me, "alcie", &["bob"], "s", &ids.next(T0), T0)
            .unwrap();
        assert!(out.warnings.is_empty(), "{:?}", out.warnings);
        let out = s
            .send(&me, "zeta-robot", &["bob"], "s", &ids.next(T0), T0)
            .unwrap();
        assert!(out.warnings.is_empty(), "{:?}", out.warnings);
    }

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
        s.register("home", &["bob"]);
        let err = s
            .send(&me, "alice", &["bob", "carol@nowhere"], "s", ID, T0)
            .unwrap_err();
        assert!(
            matches!(&err, SendError::UnknownHost(h) if h.host == "nowhere"),
            "{err}"
        );
        assert_eq!(counts(&s), (0, 0, 0));
        // Refused addresses store nothing either (not even the sender's directory row).
        for to in ["role:Dev", "role:", "Bad Name", "x@", "bo@b@c"] {
            assert!(
                matches!(
                    s.send(&me, "alice", &["bob", to], "s", ID, T0),
                    Err(SendError::Invalid(_))
                ),
                "{to}"
            );
        }
        assert_eq!(
            s.scalar::<i64>("SELECT COUNT(*) FROM agents WHERE name <> 'bob'"),
            0
        );
        assert!(s.send(&me, "Not A Name", &["bob"], "s", ID, T0).is_err());
        assert!(s.send(&me, "alice", &[], "s", ID, T0).is_err());
        assert_eq!(counts(&s), (0, 0, 0));
    }

    /// Issue 17 (4): a typo of a bare name stores nothing (no message, no delivery, no
    /// directory row, not even the sender's); `new_mailbox` registers the name as a local
    /// mailbox and delivers to it.
    #[test]
    fn an_unknown_bare_name_stores_nothing_unless_a_new_mailbox_is_asked_for() {
        let s = testutil::store();
        let me = testutil::identity("home");
        s.register("home", &["bob"]);
        let err = s
            .send(&me, "alice", &["bob", "bbo"], "s", ID, T0)
            .unwrap_err();
        assert!(
            matches!(&err, SendError::UnknownAgent(a) if a.name == "bbo" && a.suggestions == ["bob"]),
            "{err:?}"
        );
        assert_eq!(counts(&s), (0, 0, 0));
        assert_eq!(
            s.scalar::<i64>("SELECT COUNT(*) FROM agents WHERE name <> 'bob'"),
            0
        );
        let mut req = SendRequest {
            from: "alice".into(),
            to: vec!["bob".into(), "bbo".into()],
            subject: "s".into(),
            body: String::new(),
            kind: None,
            thread: None,
            reply_to: None,
            needs_reply: false,
            refs: vec![],
            new_mailbox: true,
            force: false,
        };
        let out = s
            .mailbox
            .with(|c| Ok(send(c, &me, &req, ID.into(), T0)))
            .unwrap()
            .unwrap();
        assert_eq!(counts(&s), (1, 2, 0));
        assert_eq!(
            out.warnings,
            vec!["created the new mailbox bbo on this host"]
        );
        let is_local = |n: &str| s.mailbox.with(|c| agents::is_local(c, "home", n)).unwrap();
        assert!(is_local("bbo"), "a real mailbox from now on");
        // From now on it is a known name: no flag needed.
        req.new_mailbox = false;
        s.mailbox
            .with(|c| Ok(send(c, &me, &req, "01KDVDNA3VG2MH8KWSQRCWJZ0T".into(), T0)))
            .unwrap()
            .unwrap();
        assert_eq!(counts(&s).1, 4);
    }

    #[test]
    fn local_recipients_get_the_message_at_once() {
        let s = testutil::store();
        let me = testutil::identity("home");
        s.register("home", &["bob", "carol"]);
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
            .with(|c| crate::mailbox::messages::inbox(c, "bob", None, 50, &Default::default()))
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
        s.register("home", &["carol"]);
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

    fn directory(s: &testutil::Store, host: &str, names: &[&str]) {
        let entries: Vec<agents::AgentEntry> = names
            .iter()
            .map(|n| agents::AgentEntry {
                name: n.to_string(),
                role: None,
                cli: None,
                description: None,
                last_seen: None,
            })
            .collect();
        s.mailbox
            .with(|c| agents::replace_host(c, host, &entries, T0))
            .unwrap();
    }

    fn stored_envelope(s: &testutil::Store) -> serde_json::Value {
        let env: String = s.scalar("SELECT envelope FROM messages");
        serde_json::from_str(&env).unwrap()
    }

    #[test]
    fn broadcast_and_role_go_to_local_mailboxes_and_once_to_every_peer() {
        let s = testutil::store();
        let me = testutil::identity("home");
        s.add_peer(&testutil::identity("work"), false);
        s.add_peer(&testutil::identity("lab"), false);
        s.mailbox
            .with(|c| {
                agents::register(c, "home", "bob", Some("dev"), None, T0)?;
                agents::register(c, "home", "carol", None, None, T0)?;
                Ok(())
            })
            .unwrap();
        let to = ["*", "role:dev", "x1@work", "owner", "bob"];
        let out = s.send(&me, "alice", &to, "hi", ID, T0).unwrap();
        assert_eq!(out.queued_for_hosts, vec!["lab".to_string(), "work".into()]);
        // bob, carol, owner: each once; one outbox row per host.
        assert_eq!(counts(&s), (1, 3, 2));
        let delivered: String = s.scalar(
            "SELECT group_concat(agent, ',') FROM (SELECT agent FROM deliveries ORDER BY agent)",
        );
        assert_eq!(delivered, "bob,carol,owner");
        assert!(out
            .recipients
            .iter()
            .any(|r| r.to == "*" && r.route == "remote" && r.host.as_deref() == Some("lab")));
        // `to` stays as written; local_names (bare first) is signed data.
        let env = stored_envelope(&s);
        assert_eq!(env["to"], serde_json::json!(to));
        assert_eq!(
            env["meta"]["local_names"],
            serde_json::json!(["bob", "carol"])
        );
        assert!(envelope::verify(&env, &me.host_key.public()));
        // The sender became a local mailbox.
        assert_eq!(
            s.scalar::<i64>("SELECT COUNT(*) FROM agents WHERE name = 'alice' AND host = 'home'"),
            1
        );
    }

    #[test]
    fn a_bare_name_goes_to_the_one_peer_listing_it_and_ambiguity_stores_nothing() {
        let s = testutil::store();
        let me = testutil::identity("home");
        s.add_peer(&testutil::identity("work"), false);
        s.add_peer(&testutil::identity("lab"), false);
        directory(&s, "work", &["dave", "erin"]);
        directory(&s, "lab", &["erin"]);
        let err = s
            .send(&me, "alice", &["dave", "erin"], "s", ID, T0)
            .unwrap_err();
        assert_eq!(
            err.to_string(),
            "erin exists on lab, work; address it as erin@<host>"
        );
        assert_eq!(counts(&s), (0, 0, 0));
        assert_eq!(
            s.scalar::<i64>("SELECT COUNT(*) FROM agents WHERE host = 'home'"),
            0
        );
        let out = s
            .send(&me, "alice", &["dave", "erin@lab"], "s", ID, T0)
            .unwrap();
        assert_eq!(out.queued_for_hosts, vec!["lab".to_string(), "work".into()]);
        assert_eq!(counts(&s), (1, 0, 2));
        assert!(stored_envelope(&s)["meta"].get("local_names").is_none());
    }

    /// Issue 17 (3): `name@peer` missing from the peer's known directory is refused with the
    /// host's agents and stores nothing; `force` sends it with a warning; a peer whose
    /// directory is not known yet gets it with a warning in the answer.
    #[test]
    fn an_agent_missing_from_a_known_directory_is_refused_unless_forced() {
        let s = testutil::store();
        let me = testutil::identity("home");
        s.add_peer(&testutil::identity("work"), false);
        s.add_peer(&testutil::identity("lab"), false);
        directory(&s, "work", &["bob", "carol"]);
        let err = s
            .send(&me, "alice", &["nobody@work"], "s", ID, T0)
            .unwrap_err();
        assert!(
            matches!(&err, SendError::Unlisted(u) if u.host == "work" && u.agents == ["bob", "carol"]),
            "{err:?}"
        );
        assert!(err.to_string().contains("its agents: bob, carol"), "{err}");
        assert_eq!(counts(&s), (0, 0, 0));
        let req = SendRequest {
            from: "alice".into(),
            to: vec!["nobody@work".into(), "zed@lab".into()],
            subject: "s".into(),
            body: String::new(),
            kind: None,
            thread: None,
            reply_to: None,
            needs_reply: false,
            refs: vec![],
            new_mailbox: false,
            force: true,
        };
        let out = s
            .mailbox
            .with(|c| {
                let tx = c.transaction()?;
                let out = send(&tx, &me, &req, ID.into(), T0);
                tx.commit()?;
                Ok(out)
            })
            .unwrap()
            .unwrap();
        assert_eq!(out.queued_for_hosts, vec!["lab".to_string(), "work".into()]);
        // Forced: the remark for the listed-no-one host; none for lab's unknown directory.
        assert_eq!(out.warnings.len(), 1, "{:?}", out.warnings);
        assert!(out.warnings[0].starts_with("work's agent directory lists no nobody; sent anyway"));
        // A request body without "force" is not forced.
        let body: SendRequest =
            serde_json::from_str(r#"{"from":"alice","to":["x@work"],"subject":"s"}"#).unwrap();
        assert!(!body.force);
    }

    #[test]
    fn local_names_keep_the_receiving_host_from_delivering_a_bare_name_again() {
        use crate::node::receive::{self, Verdict};
        // home: bob is local. work: has its own bob and carol.
        let (home, work) = (testutil::identity("home"), testutil::identity("work"));
        let (hs, ws) = (testutil::store(), testutil::store());
        hs.add_peer(&work, true);
        ws.add_peer(&home, true);
        hs.mailbox
            .with(|c| agents::register(c, "home", "bob", None, None, T0))
            .unwrap();
        ws.mailbox
            .with(|c| {
                agents::register(c, "work", "bob", None, None, T0)?;
                agents::register(c, "work", "carol", None, None, T0)
            })
            .unwrap();
        hs.send(&home, "alice", &["bob", "carol@work"], "s", ID, T0)
            .unwrap();
        assert_eq!(counts(&hs), (1, 1, 1));
        let plain: envelope::Envelope = serde_json::from_value(stored_envelope(&hs)).unwrap();
        assert_eq!(plain.meta.local_names, Some(vec!["bob".to_string()]));
        let sealed = agentmbx_protocol::seal::seal_envelope(
            &plain,
            &work.enc_key.public(),
            "home",
            &home.host_key,
        )
        .unwrap();
        let via = ws
            .mailbox
            .with(|c| crate::mailbox::peers::by_name(c, "home"))
            .unwrap()
            .unwrap();
        let v = ws
            .mailbox
            .with(|c| receive::receive(c, &work, &sealed.to_value(), &via, T0))
            .unwrap();
        assert_eq!(
            v,
            Ok(Verdict::Stored {
                delivered: vec!["carol".into()]
            })
        );
    }
}
