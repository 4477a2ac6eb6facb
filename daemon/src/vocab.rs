//! The local API's wire vocabulary: the shared value shapes (names, addresses, ids, kinds,
//! delivery and sent states, …) that the OpenAPI document ([`crate::api::openapi`]) lists as
//! components and that request and answer types — the API's and the store's — point their
//! `#[schema(value_type = …)]` at.
//!
//! # What it owns
//! Shapes for the document only: each type carries its pattern, lengths and enum values for
//! utoipa, and nothing constructs one. What the daemon enforces lives beside the code that
//! enforces it; the document's tests compare the two.
//!
//! # What it must never do
//! Depend on another module of this crate: the store, the API and the send path all name these
//! shapes, so this module sits below them all.

/// An agent's (or role's) name: NAME_RE `^[a-z0-9][a-z0-9-]{1,39}$`
/// ([`agentmbx_protocol::limits::NAME_RE`]); anything else is 400 `BAD_REQUEST`.
#[derive(Debug, utoipa::ToSchema)]
#[schema(
    pattern = "^[a-z0-9][a-z0-9-]{1,39}$",
    min_length = 2,
    max_length = 40,
    example = "alice"
)]
#[allow(dead_code)] // A shape for the document only.
pub struct AgentName(String);

/// A recipient address: `name` (a local mailbox, else the one paired host whose directory
/// lists it, else 400 `UNKNOWN_AGENT` unless the send asks for a new mailbox), `name@host` (this host or a paired one; an unknown host is 400 `UNKNOWN_HOST`),
/// `role:R` (local mailboxes with role R and every paired host), `*` (every local mailbox and
/// every paired host) or `owner`; name, host and R follow NAME_RE. A malformed address, or a
/// send that reaches nobody, is 400 `BAD_REQUEST`.
#[derive(Debug, utoipa::ToSchema)]
#[schema(
    pattern = "^(\\*|role:[a-z0-9][a-z0-9-]{1,39}|[a-z0-9][a-z0-9-]{1,39}(@[a-z0-9][a-z0-9-]{1,39})?)$",
    min_length = 1,
    max_length = 81,
    example = "bob@hostb"
)]
#[allow(dead_code)] // A shape for the document only.
pub struct Address(String);

/// A message id: a ULID (26 Crockford base32 characters, upper case), as every message this
/// daemon stores has. An id that names no message this agent can see is 404 `NOT_FOUND`.
#[derive(Debug, utoipa::ToSchema)]
#[schema(
    pattern = "^[0-9A-HJKMNP-TV-Z]{26}$",
    min_length = 26,
    max_length = 26,
    example = "01KDVDNA3VG2MH8KWSQRCWJZ0S"
)]
#[allow(dead_code)] // A shape for the document only.
pub struct MessageId(String);

/// A thread id: the id of the thread's first message, or any text of at most 300 UTF-16 code
/// units that another host chose (`wire.md` §2.3; JSON Schema counts characters, so a text of
/// characters outside the BMP is held to half as many). A longer one is 400 `BAD_REQUEST`.
#[derive(Debug, utoipa::ToSchema)]
#[schema(
    min_length = 1,
    max_length = 300,
    example = "01KDVDNA3VG2MH8KWSQRCWJZ0S"
)]
#[allow(dead_code)] // A shape for the document only.
pub struct ThreadId(String);

/// A reference (a path, URL or id the message points at): at most 2048 UTF-16 code units
/// (`wire.md` §2.3); a longer one is 400 `BAD_REQUEST`.
#[derive(Debug, utoipa::ToSchema)]
#[schema(max_length = 2048, example = "docs/plan.md")]
#[allow(dead_code)] // A shape for the document only.
pub struct RefText(String);

/// A message's kind (`wire.md` §2.3, [`agentmbx_protocol::envelope::KINDS`]); another value is
/// 400 `BAD_REQUEST`.
#[derive(Debug, utoipa::ToSchema)]
#[schema(rename_all = "lowercase")]
#[allow(dead_code)] // A shape for the document only.
pub enum Kind {
    /// A plain message (the default).
    Message,
    /// A request for work or an answer.
    Request,
    /// A reply (the default of a reply).
    Reply,
    /// A status update.
    Status,
    /// A decision.
    Decision,
    /// An alert.
    Alert,
    /// A task.
    Task,
}

/// An agent's delivery state of a message (inbox, read, thread): `new` (not read yet), `read`,
/// `acked`.
#[derive(Debug, utoipa::ToSchema)]
#[schema(rename_all = "lowercase")]
#[allow(dead_code)] // A shape for the document only.
pub enum DeliveryState {
    /// Not read yet.
    New,
    /// Read by the agent.
    Read,
    /// Acked by the agent.
    Acked,
}

/// One recipient's state in `GET /v1/sent`: local recipients `delivered`, `notified`, `read`, `acked`;
/// remote ones the newest receipt (`delivered`, `notified`, `read`, `acked`), else the outbox
/// (`queued`, `relay-accepted`, `repush`, `delivered`, `undelivered`, `expired`,
/// `unconfirmed`).
#[derive(Debug, utoipa::ToSchema)]
#[schema(rename_all = "kebab-case")]
#[allow(dead_code)] // A shape for the document only.
pub enum SentState {
    /// Waiting to be sent (or sent again).
    Queued,
    /// A relay holds it for the target host.
    RelayAccepted,
    /// A relay accepted it, then lost it (new epoch): pushed again.
    Repush,
    /// The host of an agent named by `name@host` took it, but no `delivered` receipt from that
    /// agent has come back (a host holds mail for a name it does not have until it registers).
    Accepted,
    /// The target host (or mailbox) has it.
    Delivered,
    /// The recipient's agent was told of it.
    Notified,
    /// The recipient read it.
    Read,
    /// The recipient acked it.
    Acked,
    /// Given up or refused (`reason` says why).
    Undelivered,
    /// The relay expired it (`reason`).
    Expired,
    /// No receipt came by the deadline (`reason`).
    Unconfirmed,
}

/// How a send's address reached a target: `local` (delivered now) or `remote` (queued for a
/// paired host).
#[derive(Debug, utoipa::ToSchema)]
#[schema(rename_all = "lowercase")]
#[allow(dead_code)] // A shape for the document only.
pub enum RouteKind {
    /// A mailbox of this host.
    Local,
    /// A paired host.
    Remote,
}

/// The transport that delivered a message to a remote host.
#[derive(Debug, utoipa::ToSchema)]
#[schema(rename_all = "lowercase")]
#[allow(dead_code)] // A shape for the document only.
pub enum Via {
    /// Directly over the LAN.
    Lan,
    /// Through the relay.
    Relay,
}

/// `GET /v1/health` status.
#[derive(Debug, utoipa::ToSchema)]
#[schema(rename_all = "lowercase")]
#[allow(dead_code)] // A shape for the document only.
pub enum HealthStatus {
    /// Nothing known to be wrong.
    Ok,
    /// Up and serving, with `reasons`.
    Degraded,
}

/// Why a health answer is `degraded` ([`crate::instance`]).
#[derive(Debug, utoipa::ToSchema)]
#[schema(rename_all = "kebab-case")]
#[allow(dead_code)] // A shape for the document only.
pub enum HealthReasonCode {
    /// Another daemon uses this host's key.
    HostKeyClone,
    /// A peer's key is used by two daemons.
    PeerKeyClone,
}
