//! The local HTTP API for agents on this machine (design README "Local API for agents").
//!
//! This module owns the router, bearer-token authentication and the one mapping from domain
//! errors to HTTP answers ([`ApiError`]: a status plus `{"error": <human text>, "code":
//! <stable machine code>}`). Each resource lives in its own file (`health`, …) and only turns a
//! request into a call on the daemon's state and the result into JSON. Every route reads its
//! body and query through [`ApiJson`] and [`ApiQuery`] ([`extract`]), so no library's error text
//! reaches a client: 404 `NOT_FOUND` for unknown routes, 405 `METHOD_NOT_ALLOWED`, 400
//! `BAD_REQUEST` / `INVALID_JSON`, 413 `BODY_TOO_LARGE`, 415 `UNSUPPORTED_MEDIA_TYPE`.
//!
//! A store lock held by another process or connection is a clear answer, never a 500: a
//! statement that still meets it after the store's busy timeout
//! ([`crate::mailbox::BUSY_TIMEOUT_MS`]) is answered 503 `STORE_BUSY` with `Retry-After`, and so
//! is a mutating request that waited longer than [`MAX_START_WAIT`] for the store; neither
//! changed anything. A request that outlives its client is logged at warn (route, elapsed ms), as
//! is every answer slower than [`SLOW_REQUEST`]; a mutating request whose client disconnected
//! before it reached the store is dropped without doing anything.
//!
//! Every route except `GET /v1/health` requires `Authorization: Bearer <token>` with the token
//! from `api.token` ([`crate::token`]); unknown paths answer 404 only to an authenticated
//! caller (401 otherwise), so the API's shape is not probed without the token.
//!
//! It must never log tokens, keys or message bodies, and never bind a listener itself: callers
//! pass one to [`serve`] (tests bind port 0).

pub mod ack;
pub mod agents;
pub mod events;
pub mod extract;
pub mod health;
pub mod history;
pub mod inbox;
pub mod messages;
pub mod openapi;
pub mod rate;
pub mod search;
pub mod sent;
pub mod threads;
pub mod unclaimed;
pub mod wakes;

#[cfg(test)]
mod http_tests;
#[cfg(test)]
mod test_support;

use std::future::Future;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::extract::{Request, State};
use axum::http::{header, HeaderValue, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde::Serialize;

use agentmbx_protocol::clock::SharedClock;
use agentmbx_protocol::ulid;

use crate::host_name::HostName;
use crate::identity::Identity;
use crate::mailbox::{idempotency, Mailbox, MailboxError};
use crate::token::ApiToken;

pub use extract::{ApiJson, ApiQuery, NoQuery, MAX_REQUEST_BODY};

/// What every handler can reach.
#[derive(Debug)]
pub struct AppState {
    /// This host's name.
    pub host: HostName,
    /// The bearer token callers must present.
    pub token: ApiToken,
    /// The daemon's version, reported by `/v1/health`.
    pub version: &'static str,
    /// The one clock (shifted by `MBX_CLOCK_OFFSET_MS` in drills); every time read goes here.
    pub clock: SharedClock,
    /// This host's identity (signs what agents send).
    pub ident: Arc<Identity>,
    /// The host store.
    pub mailbox: Mailbox,
    /// Woken when a send queued outbox rows, so the transport does not wait for its tick.
    pub wake: Arc<tokio::sync::Notify>,
    /// Envelope id generator (monotonic ULIDs).
    pub ids: Mutex<ulid::Generator>,
    /// This daemon process's instance and its findings (`/v1/health` reasons).
    pub instance: Arc<crate::instance::Instance>,
    /// The LAN client, once the LAN side runs (empty in tests that need none): a send refused
    /// for a stale peer directory fetches that directory again first
    /// ([`messages::refresh_stale_directories`]).
    pub lan: std::sync::OnceLock<crate::transport::lan::client::LanClient>,
    /// The per-(agent, class) rate tables ([`rate`]; `[api_rate]` in `config.toml`).
    pub rates: rate::ApiRates,
    /// Whether a relay is configured now: the flag the LAN delivery loop reads at each pass
    /// (set as `[relay]` comes and goes in `config.toml`); `agentmbx sent` names the relay
    /// route only while it is set.
    pub relay_configured: Arc<std::sync::atomic::AtomicBool>,
}

/// Checks an agent name given as `as` (NAME_RE): 400 with the rule otherwise, so a typo such as
/// an upper-case name is an error, not an empty mailbox.
pub fn check_agent(name: &str) -> Result<(), ApiError> {
    if agentmbx_protocol::limits::is_name(name) {
        Ok(())
    } else {
        Err(ApiError::Invalid(format!(
            "bad agent name {name:?}: {}",
            crate::node::send::NAME_RULE
        )))
    }
}

/// Checks that `name` (already NAME_RE, [`check_agent`]) has a mailbox to read on this host
/// ([`crate::mailbox::agents::has_mailbox`]): otherwise 404 `UNKNOWN_AGENT` naming up to 3
/// close names that have one, so a mistyped `as` is an error, not an empty inbox.
pub async fn check_reader(state: &AppState, name: &str) -> Result<(), ApiError> {
    use crate::mailbox::agents;
    let (own, who) = (state.ident.host.to_string(), name.to_string());
    let missing = state
        .mailbox
        .run(move |c| {
            if agents::has_mailbox(c, &own, &who)? {
                return Ok(None);
            }
            let readers = agents::readers(c, &own)?;
            Ok(Some(crate::node::suggest::closest(
                &who,
                readers.iter().map(String::as_str),
            )))
        })
        .await?;
    let Some(suggestions) = missing else {
        return Ok(());
    };
    Err(ApiError::NoSuchAgent(match suggestions.as_slice() {
        [] => format!(
            "no agent named {name} on this host (`agentmbx whoami --as {name}` registers it)"
        ),
        names => format!(
            "no agent named {name} on this host; did you mean {}? (`agentmbx whoami --as \
             {name}` registers a new agent)",
            names.join(", ")
        ),
    }))
}

/// Shared handle to [`AppState`].
pub type SharedState = Arc<AppState>;

/// A failed request, as the API reports it. The one place that chooses status and `code`.
#[derive(Debug, thiserror::Error)]
pub enum ApiError {
    /// No `Authorization: Bearer` header, or the wrong token. 401 `UNAUTHORIZED`.
    #[error("missing or bad bearer token")]
    Unauthorized,
    /// No such route or resource. 404 `NOT_FOUND`.
    #[error("not found")]
    NotFound,
    /// The path exists but not with this method. 405 `METHOD_NOT_ALLOWED`.
    #[error("method not allowed")]
    MethodNotAllowed,
    /// The request is invalid (the message says why, naming a missing, unknown or mistyped
    /// field or query parameter). 400 `BAD_REQUEST`.
    #[error("{0}")]
    Invalid(String),
    /// The request body is not JSON (the message gives the line and column). 400 `INVALID_JSON`.
    #[error("{0}")]
    InvalidJson(String),
    /// The request body is over [`MAX_REQUEST_BODY`]. 413 `BODY_TOO_LARGE`.
    #[error("{0}")]
    BodyTooLarge(String),
    /// The request body is not sent as `application/json`. 415 `UNSUPPORTED_MEDIA_TYPE`.
    #[error("{0}")]
    UnsupportedMediaType(String),
    /// A recipient host is not a known peer. 400 `UNKNOWN_HOST`.
    #[error("{0}")]
    UnknownHost(String),
    /// A recipient is no agent the sender can know of: a bare name that is no agent here nor
    /// on any paired host (a likely typo; the text names the closest known names;
    /// `"new_mailbox": true` creates it), or `name@host` that the paired host's known directory
    /// does not list (the text lists the agents it has; `"force": true` sends anyway).
    /// 400 `UNKNOWN_AGENT`, as `UNKNOWN_HOST`.
    #[error("{0}")]
    UnknownAgent(String),
    /// The agent a request is made as (`as`) is no agent of this host: no local mailbox and
    /// no mail delivered to it (the message names the closest agents). 404 `UNKNOWN_AGENT`.
    #[error("{0}")]
    NoSuchAgent(String),
    /// The named resource does not exist. 404 `NOT_FOUND`.
    #[error("{0}")]
    Missing(String),
    /// The request conflicts with stored state (e.g. an Idempotency-Key reused with another
    /// body). 409 `CONFLICT`.
    #[error("{0}")]
    Conflict(String),
    /// The store is locked by another process or connection, or too busy to start the request
    /// in time; nothing was changed. 503 `STORE_BUSY` with `Retry-After:`
    /// [`STORE_BUSY_RETRY_AFTER_S`]: retry (with the same `Idempotency-Key`).
    #[error("{0}")]
    StoreBusy(String),
    /// A long poll found [`crate::mailbox::wake::MAX_WAITERS`] requests waiting already; it
    /// did not wait. 503 `TOO_MANY_WAITERS` with `Retry-After:` [`STORE_BUSY_RETRY_AFTER_S`]
    /// (an empty answer at once would make a waiting loop spin).
    #[error("{0}")]
    TooManyWaiters(String),
    /// The caller's (agent, class) bucket is empty ([`rate`]): nothing was done. 429
    /// `RATE_LIMIT` with `retry_after` (seconds to the next token, fractional) in the body and
    /// `Retry-After` (whole seconds, rounded up, at least 1): the relay's code and shape.
    #[error("rate limit exceeded: too many {class} requests from this agent; nothing was done: retry after {:.3} s", *retry_after_ms as f64 / 1000.0)]
    RateLimited {
        /// The class ([`rate::RateClass::name`]).
        class: &'static str,
        /// Until the next token, ms (at least 1).
        retry_after_ms: u64,
    },
    /// A mutating request with an `Idempotency-Key` found its agent's records for this
    /// operation full ([`idempotency::MAX_RECORDS_PER_SCOPE`] inside
    /// [`idempotency::HORIZON_MS`]): nothing was done, and no record a client could still
    /// replay was dropped (seed 003). 503 `IDEMPOTENCY_FULL` with `Retry-After` (whole seconds
    /// until the oldest record leaves the horizon). A request without the header is not
    /// refused for it.
    #[error("{message}")]
    IdempotencyFull {
        /// The human text.
        message: String,
        /// Until a record leaves the horizon, whole seconds (at least 1).
        retry_after_s: u64,
    },
    /// A fault on our side. 500 `INTERNAL`; the detail is logged, never sent.
    #[error("internal error")]
    Internal(#[source] Box<dyn std::error::Error + Send + Sync>),
}

impl From<MailboxError> for ApiError {
    fn from(e: MailboxError) -> Self {
        match e {
            MailboxError::NotFound(m) => ApiError::Missing(m),
            MailboxError::Conflict(m) => ApiError::Conflict(m),
            MailboxError::Invalid(m) => ApiError::Invalid(m),
            e if e.is_busy() => ApiError::StoreBusy(format!(
                "the mailbox store is locked by another process or connection (still locked after \
                 {} ms); nothing was changed: retry later",
                crate::mailbox::BUSY_TIMEOUT_MS
            )),
            other => ApiError::Internal(Box::new(other)),
        }
    }
}

/// A path segment that does not decode (e.g. bad percent-encoding) is a 400 in the API's own
/// words, not axum's plain-text rejection.
impl From<axum::extract::rejection::PathRejection> for ApiError {
    fn from(_: axum::extract::rejection::PathRejection) -> Self {
        ApiError::Invalid("the path holds an id that is not valid UTF-8 text".into())
    }
}

impl ApiError {
    /// One error of each kind, in declaration order: what the OpenAPI document's `code` enum
    /// is built from ([`openapi::error_codes`]). A new variant must be added here too (the
    /// match below has no catch-all, so the compiler asks for it).
    pub fn examples() -> Vec<ApiError> {
        let all = vec![
            ApiError::Unauthorized,
            ApiError::NotFound,
            ApiError::MethodNotAllowed,
            ApiError::Invalid(String::new()),
            ApiError::InvalidJson(String::new()),
            ApiError::BodyTooLarge(String::new()),
            ApiError::UnsupportedMediaType(String::new()),
            ApiError::UnknownHost(String::new()),
            ApiError::UnknownAgent(String::new()),
            ApiError::NoSuchAgent(String::new()),
            ApiError::Missing(String::new()),
            ApiError::Conflict(String::new()),
            ApiError::StoreBusy(String::new()),
            ApiError::TooManyWaiters(String::new()),
            ApiError::RateLimited {
                class: "send",
                retry_after_ms: 1,
            },
            ApiError::IdempotencyFull {
                message: String::new(),
                retry_after_s: 1,
            },
            ApiError::Internal("example".into()),
        ];
        for e in &all {
            match e {
                ApiError::Unauthorized
                | ApiError::NotFound
                | ApiError::MethodNotAllowed
                | ApiError::Invalid(_)
                | ApiError::InvalidJson(_)
                | ApiError::BodyTooLarge(_)
                | ApiError::UnsupportedMediaType(_)
                | ApiError::UnknownHost(_)
                | ApiError::UnknownAgent(_)
                | ApiError::NoSuchAgent(_)
                | ApiError::Missing(_)
                | ApiError::Conflict(_)
                | ApiError::StoreBusy(_)
                | ApiError::TooManyWaiters(_)
                | ApiError::RateLimited { .. }
                | ApiError::IdempotencyFull { .. }
                | ApiError::Internal(_) => {}
            }
        }
        all
    }

    /// HTTP status for this error.
    pub fn status(&self) -> StatusCode {
        match self {
            ApiError::Unauthorized => StatusCode::UNAUTHORIZED,
            ApiError::NotFound => StatusCode::NOT_FOUND,
            ApiError::MethodNotAllowed => StatusCode::METHOD_NOT_ALLOWED,
            ApiError::Invalid(_)
            | ApiError::InvalidJson(_)
            | ApiError::UnknownHost(_)
            | ApiError::UnknownAgent(_) => StatusCode::BAD_REQUEST,
            ApiError::NoSuchAgent(_) => StatusCode::NOT_FOUND,
            ApiError::BodyTooLarge(_) => StatusCode::PAYLOAD_TOO_LARGE,
            ApiError::UnsupportedMediaType(_) => StatusCode::UNSUPPORTED_MEDIA_TYPE,
            ApiError::Missing(_) => StatusCode::NOT_FOUND,
            ApiError::Conflict(_) => StatusCode::CONFLICT,
            ApiError::StoreBusy(_)
            | ApiError::TooManyWaiters(_)
            | ApiError::IdempotencyFull { .. } => StatusCode::SERVICE_UNAVAILABLE,
            ApiError::RateLimited { .. } => StatusCode::TOO_MANY_REQUESTS,
            ApiError::Internal(_) => StatusCode::INTERNAL_SERVER_ERROR,
        }
    }

    /// Stable machine code for this error (part of the API contract).
    pub fn code(&self) -> &'static str {
        match self {
            ApiError::Unauthorized => "UNAUTHORIZED",
            ApiError::NotFound => "NOT_FOUND",
            ApiError::MethodNotAllowed => "METHOD_NOT_ALLOWED",
            ApiError::Invalid(_) => "BAD_REQUEST",
            ApiError::InvalidJson(_) => "INVALID_JSON",
            ApiError::BodyTooLarge(_) => "BODY_TOO_LARGE",
            ApiError::UnsupportedMediaType(_) => "UNSUPPORTED_MEDIA_TYPE",
            ApiError::UnknownHost(_) => "UNKNOWN_HOST",
            ApiError::UnknownAgent(_) | ApiError::NoSuchAgent(_) => "UNKNOWN_AGENT",
            ApiError::Missing(_) => "NOT_FOUND",
            ApiError::Conflict(_) => "CONFLICT",
            ApiError::StoreBusy(_) => "STORE_BUSY",
            ApiError::TooManyWaiters(_) => "TOO_MANY_WAITERS",
            ApiError::RateLimited { .. } => "RATE_LIMIT",
            ApiError::IdempotencyFull { .. } => "IDEMPOTENCY_FULL",
            ApiError::Internal(_) => "INTERNAL",
        }
    }
}

/// JSON body of every error answer.
#[derive(Debug, Serialize, utoipa::ToSchema)]
pub struct ErrorBody {
    /// Human-readable text.
    pub error: String,
    /// Stable machine code (one of the document's enum: [`openapi::error_codes`]).
    pub code: &'static str,
    /// With `RATE_LIMIT` only: seconds until the bucket has a token again (fractional, ms
    /// precision; the `Retry-After` header has it rounded up to whole seconds).
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(minimum = 0.001)]
    pub retry_after: Option<f64>,
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        match &self {
            ApiError::Internal(source) => {
                tracing::error!(error = %source, "local API request failed");
            }
            ApiError::StoreBusy(why) => tracing::warn!("local API answered 503 STORE_BUSY: {why}"),
            _ => {}
        }
        let retry_after = match &self {
            ApiError::RateLimited { retry_after_ms, .. } => {
                Some((*retry_after_ms).max(1) as f64 / 1000.0)
            }
            _ => None,
        };
        let body = ErrorBody {
            error: self.to_string(),
            code: self.code(),
            retry_after,
        };
        let mut response = (self.status(), Json(body)).into_response();
        match &self {
            ApiError::Unauthorized => {
                response
                    .headers_mut()
                    .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
            }
            ApiError::StoreBusy(_) | ApiError::TooManyWaiters(_) => {
                response.headers_mut().insert(
                    header::RETRY_AFTER,
                    HeaderValue::from(STORE_BUSY_RETRY_AFTER_S),
                );
            }
            ApiError::RateLimited { retry_after_ms, .. } => {
                let secs = agentmbx_net::rate::retry_after_secs(
                    i64::try_from(*retry_after_ms).unwrap_or(i64::MAX),
                );
                response
                    .headers_mut()
                    .insert(header::RETRY_AFTER, HeaderValue::from(secs));
            }
            ApiError::IdempotencyFull { retry_after_s, .. } => {
                tracing::warn!("local API answered 503 IDEMPOTENCY_FULL: {self}");
                response.headers_mut().insert(
                    header::RETRY_AFTER,
                    HeaderValue::from((*retry_after_s).max(1)),
                );
            }
            _ => {}
        }
        response
    }
}

/// The API's routes: `/v1/health` open, everything else behind the bearer token.
pub fn router(state: SharedState) -> Router {
    let open = Router::new()
        .route("/v1/health", get(health::get))
        .method_not_allowed_fallback(method_not_allowed);
    // Authenticated resources are added here, before the 405 fallback (which applies only to
    // routes present when it is set).
    let authed = Router::new()
        .route("/v1/messages", post(messages::post))
        .route("/v1/messages/{id}", get(messages::get))
        .route("/v1/messages/{id}/reply", post(messages::reply))
        .route("/v1/threads/{id}", get(threads::get))
        .route("/v1/inbox", get(inbox::get))
        .route("/v1/events", get(events::get))
        .route("/v1/search", get(search::get))
        .route("/v1/ack", post(ack::post))
        .route("/v1/sent", get(sent::get))
        .route("/v1/unclaimed", get(unclaimed::get))
        .route("/v1/agents", get(agents::get).post(agents::post))
        .route("/v1/wakes/claim", post(wakes::claim))
        .route("/v1/wakes/mute", post(wakes::mute))
        .route("/v1/wakes/unmute", post(wakes::unmute))
        .route("/v1/replay", get(history::replay))
        .route("/v1/catchup", get(history::catchup))
        .route("/v1/catchup/commit", post(history::commit))
        .route("/v1/catchup/restart", post(history::restart))
        .method_not_allowed_fallback(method_not_allowed)
        .fallback(not_found)
        // Inside the token check: only authenticated requests are counted.
        .layer(middleware::from_fn_with_state(state.clone(), rate::guard))
        .layer(middleware::from_fn_with_state(state.clone(), require_token))
        .layer(middleware::from_fn(watch_duration));
    open.merge(authed)
        .layer(axum::extract::DefaultBodyLimit::max(MAX_REQUEST_BODY))
        .with_state(state)
}

/// Serves the API on `listener` until `shutdown` completes, then stops accepting and lets
/// requests in flight finish; requests waiting for mail (`GET /v1/inbox?wait=`) end at once
/// with what they have and event streams (`GET /v1/events`) end ([`crate::mailbox::wake::WaitHub::close`]). Logs `local API listening on <addr>` (the bound address) once
/// before accepting. Errors: the listener's address cannot be read, or the server fails.
pub async fn serve(
    listener: tokio::net::TcpListener,
    state: SharedState,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let addr = listener.local_addr()?;
    tracing::info!("local API listening on {addr}");
    let mailbox = state.mailbox.clone();
    let shutdown = async move {
        shutdown.await;
        // Shutdown never waits for long polls.
        mailbox.waits().close();
    };
    // Any local process can connect before it shows a token: the same accept loop as the LAN
    // and relay servers bounds how long a connection may idle and how many may be open, so a
    // misbehaving client cannot use up the daemon's file handles.
    let settings = agentmbx_net::serve::ConnSettings {
        name: "local API",
        header_read: HEADER_READ_TIMEOUT,
        keep_alive: KEEP_ALIVE_TIMEOUT,
        max_connections: MAX_CONNECTIONS,
    };
    agentmbx_net::serve::accept_loop(listener, router(state), settings, shutdown).await;
    tracing::info!("local API stopped");
    Ok(())
}

/// Time a client of the local API has to send its request headers, also while a kept-alive
/// connection waits for its next request (10 s).
pub const HEADER_READ_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);
/// An idle kept-alive local API connection closes after this (30 s: agents poll).
pub const KEEP_ALIVE_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(30);
/// Most local API connections open at once; past it new ones wait in the listen backlog:
/// 256 for ordinary calls plus [`crate::mailbox::wake::MAX_WAITERS`] (256) for requests that
/// wait for mail and [`crate::mailbox::wake::MAX_STREAMS`] (64) for event streams, which take
/// their own permits while they wait, so neither uses up the connections ordinary calls need.
pub const MAX_CONNECTIONS: usize =
    256 + crate::mailbox::wake::MAX_WAITERS + crate::mailbox::wake::MAX_STREAMS;

/// Longest accepted `Idempotency-Key` (characters).
pub const MAX_IDEMPOTENCY_KEY: usize = 200;

/// `Retry-After` of a 503 `STORE_BUSY` answer (seconds): 1. The lock may go at any moment; a
/// retry costs one busy wait.
pub const STORE_BUSY_RETRY_AFTER_S: u32 = 1;

/// A mutating request that waited this long for the store before it could start (other
/// requests ahead of it meeting a lock held elsewhere, each for up to the store's 5-s busy
/// timeout) is answered 503 `STORE_BUSY` and does nothing: 20 s. With the busy wait it may then
/// meet, every answer comes before the CLI gives up on an attempt (30 s), so the CLI hears a
/// clear "not done" instead of guessing.
pub const MAX_START_WAIT: Duration = Duration::from_secs(20);

/// An answer slower than this is logged at warn with its route and elapsed ms: 2 s (the store
/// is local; anything slower means it waited on a lock or on other requests).
pub const SLOW_REQUEST: Duration = Duration::from_secs(2);

/// Runs a mutating call `f` for `route` in one immediate transaction with idempotency (keys are
/// scoped per operation and agent, e.g. `send:alice`, as 0.5.x's `idem:<agent>:<key>`): with an
/// `Idempotency-Key` header, a replay with the same body returns the first answer (status and
/// body) and the same key with another body is 409; the answer is recorded in the same
/// transaction as the effect. `f` returns `Ok(Ok(json))` to commit, `Ok(Err(api_error))` to roll
/// back with that answer, `Err(_)` on a storage fault.
///
/// Waiting for the store: a request whose client disconnected before it reached the store does
/// nothing (logged at warn); one that waited longer than [`MAX_START_WAIT`] is 503
/// `STORE_BUSY`, as is a lock still held elsewhere after the busy timeout. One that finishes
/// after its client disconnected is logged at warn with the route and elapsed ms (what it did
/// stands; a retry with the same key gets its answer).
pub(crate) async fn idempotent<F>(
    state: &SharedState,
    headers: &axum::http::HeaderMap,
    route: &'static str,
    scope: String,
    body: &[u8],
    ok_status: StatusCode,
    f: F,
) -> Result<(StatusCode, Json<serde_json::Value>), ApiError>
where
    F: FnOnce(
            &rusqlite::Transaction<'_>,
        ) -> Result<Result<serde_json::Value, ApiError>, MailboxError>
        + Send
        + 'static,
{
    let key = match headers.get("idempotency-key") {
        None => None,
        Some(v) => {
            let k = v
                .to_str()
                .ok()
                .filter(|k| !k.is_empty() && k.chars().count() <= MAX_IDEMPOTENCY_KEY);
            Some(k.ok_or_else(|| ApiError::Invalid(format!("Idempotency-Key must be 1..={MAX_IDEMPOTENCY_KEY} visible ASCII characters")))?.to_string())
        }
    };
    let hash = agentmbx_protocol::hash::sha256_hex(body);
    let now = state.clock.now_ms();
    let started = Instant::now();
    // Set when this future is dropped (the client disconnected) before the store answered.
    let gone = Arc::new(AtomicBool::new(false));
    let _client = SetOnDrop(gone.clone());
    let outcome = state
        .mailbox
        .run(move |c| {
            let waited_ms = started.elapsed().as_millis() as u64;
            if gone.load(Ordering::SeqCst) {
                tracing::warn!(
                    route,
                    waited_ms,
                    "local API request dropped before it started: its client had disconnected (nothing done)"
                );
                return Ok(Err(ApiError::StoreBusy("the client disconnected".into())));
            }
            if started.elapsed() > MAX_START_WAIT {
                return Ok(Err(ApiError::StoreBusy(format!(
                    "the mailbox store is busy: the request could not start within {} ms; \
                     nothing was changed: retry later",
                    MAX_START_WAIT.as_millis()
                ))));
            }
            let done = run_idempotent(c, key, &scope, &hash, ok_status, now, f);
            if gone.load(Ordering::SeqCst) {
                let outcome = match &done {
                    Ok(Ok(_)) => "committed; a retry with the same Idempotency-Key gets its answer",
                    _ => "nothing changed",
                };
                tracing::warn!(
                    route,
                    elapsed_ms = started.elapsed().as_millis() as u64,
                    "local API request finished after its client disconnected: {outcome}"
                );
            }
            done
        })
        .await??;
    let (status, text) = outcome;
    let status = StatusCode::from_u16(status).unwrap_or(StatusCode::OK);
    let value = serde_json::from_str(&text).unwrap_or(serde_json::Value::Null);
    Ok((status, Json(value)))
}

/// The transaction of [`idempotent`]: replay, or run `f` and record its answer.
fn run_idempotent<F>(
    c: &mut rusqlite::Connection,
    key: Option<String>,
    scope: &str,
    hash: &str,
    ok_status: StatusCode,
    now: i64,
    f: F,
) -> Result<Result<(u16, String), ApiError>, MailboxError>
where
    F: FnOnce(
        &rusqlite::Transaction<'_>,
    ) -> Result<Result<serde_json::Value, ApiError>, MailboxError>,
{
    let tx = c.transaction_with_behavior(rusqlite::TransactionBehavior::Immediate)?;
    if let Some(k) = &key {
        // Past the horizon a record is gone before it is looked up: a replay of an older key
        // is a new request, as the module says ([`idempotency`]).
        idempotency::prune(&tx, now)?;
        if let Some(stored) = idempotency::lookup(&tx, scope, k, hash)? {
            return Ok(Ok((stored.status, stored.response)));
        }
        // Prunes past the horizon, then refuses rather than drop a record (seed 003).
        let cap = idempotency::MAX_RECORDS_PER_SCOPE;
        if let idempotency::Admission::Full { retry_after_ms } =
            idempotency::admit(&tx, scope, cap, now)?
        {
            // Keep what the prune removed; nothing else was done.
            tx.commit()?;
            let retry_after_s = u64::try_from(retry_after_ms).unwrap_or(1).div_ceil(1000);
            return Ok(Err(ApiError::IdempotencyFull {
                message: format!(
                    "this agent holds {cap} idempotency records for this operation from the \
                     last {} h, the most kept: nothing was done; retry after {retry_after_s} s, \
                     or send without an Idempotency-Key",
                    idempotency::HORIZON_MS / 3_600_000
                ),
                retry_after_s,
            }));
        }
    }
    match f(&tx)? {
        Ok(value) => {
            let text = value.to_string();
            if let Some(k) = &key {
                idempotency::record(&tx, scope, k, hash, ok_status.as_u16(), &text, now)?;
            }
            tx.commit()?;
            Ok(Ok((ok_status.as_u16(), text)))
        }
        Err(e) => Ok(Err(e)),
    }
}

/// Sets its flag when dropped: a handler future dropped before the store answered means the
/// client disconnected.
struct SetOnDrop(Arc<AtomicBool>);

impl Drop for SetOnDrop {
    fn drop(&mut self) {
        self.0.store(true, Ordering::SeqCst);
    }
}

/// Middleware: logs at warn an answer slower than [`SLOW_REQUEST`], and a request whose client
/// disconnected before the answer, each with its method, route (the path, without the query)
/// and elapsed ms.
async fn watch_duration(request: Request, next: Next) -> Response {
    let mut watch = Watch {
        method: request.method().clone(),
        // The path only: the query names agents and cursors, which the log does not need.
        route: request.uri().path().to_string(),
        started: Instant::now(),
        answered: false,
    };
    let response = next.run(request).await;
    watch.answered = true;
    let elapsed = watch.started.elapsed();
    // A long poll is slow on purpose.
    let waited = response.extensions().get::<inbox::LongPoll>().is_some();
    if elapsed > SLOW_REQUEST && !waited {
        tracing::warn!(
            method = %watch.method,
            route = %watch.route,
            status = response.status().as_u16(),
            elapsed_ms = elapsed.as_millis() as u64,
            "slow local API request"
        );
    }
    response
}

/// One request under [`watch_duration`].
struct Watch {
    method: axum::http::Method,
    route: String,
    started: Instant,
    answered: bool,
}

impl Drop for Watch {
    fn drop(&mut self) {
        if !self.answered {
            tracing::warn!(
                method = %self.method,
                route = %self.route,
                elapsed_ms = self.started.elapsed().as_millis() as u64,
                "local API client disconnected before the answer"
            );
        }
    }
}

async fn not_found() -> ApiError {
    ApiError::NotFound
}

async fn method_not_allowed() -> ApiError {
    ApiError::MethodNotAllowed
}

/// Middleware: lets the request through only with the right bearer token.
async fn require_token(
    State(state): State<SharedState>,
    request: Request,
    next: Next,
) -> Result<Response, ApiError> {
    let presented = request
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|value| bearer_credentials(value.as_bytes()));
    match presented {
        Some(token) if state.token.matches(token) => Ok(next.run(request).await),
        _ => {
            tracing::debug!(path = %request.uri().path(), "refused request without a valid bearer token");
            Err(ApiError::Unauthorized)
        }
    }
}

/// The credentials of an `Authorization: Bearer <credentials>` header value (scheme matched
/// case-insensitively, RFC 7235 §2.1), or `None` for any other scheme or an empty value.
fn bearer_credentials(value: &[u8]) -> Option<&[u8]> {
    let space = value.iter().position(|b| *b == b' ')?;
    let (scheme, rest) = value.split_at(space);
    if !scheme.eq_ignore_ascii_case(b"bearer") {
        return None;
    }
    let credentials = rest.trim_ascii();
    (!credentials.is_empty()).then_some(credentials)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bearer_header_parsing() {
        assert_eq!(bearer_credentials(b"Bearer abc"), Some(&b"abc"[..]));
        assert_eq!(bearer_credentials(b"bearer   abc "), Some(&b"abc"[..]));
        assert_eq!(bearer_credentials(b"Basic abc"), None);
        assert_eq!(bearer_credentials(b"Bearer "), None);
        assert_eq!(bearer_credentials(b"Bearerabc"), None);
    }

    #[test]
    fn error_codes_are_stable() {
        assert_eq!(
            (
                ApiError::Unauthorized.status().as_u16(),
                ApiError::Unauthorized.code()
            ),
            (401, "UNAUTHORIZED")
        );
        assert_eq!(
            (
                ApiError::NotFound.status().as_u16(),
                ApiError::NotFound.code()
            ),
            (404, "NOT_FOUND")
        );
        assert_eq!(
            ApiError::Unauthorized.to_string(),
            "missing or bad bearer token"
        );
    }
}
