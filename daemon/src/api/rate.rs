//! Rate classes on the local API (issue 19 part 4; seed 001 "Rate limiting").
//!
//! # What it owns
//! - **One token bucket per (agent, class)**, each class with its own burst and refill rate
//!   from `[api_rate]` in `config.toml` ([`crate::config::ApiRateConfig`]). The classes
//!   ([`RateClass::of`]):
//!   - `wait`: reads that poll — `GET /v1/inbox` (the long poll included), `GET /v1/catchup`,
//!     `GET /v1/replay`, `GET /v1/sent`, and opening an event stream (`GET /v1/events`);
//!   - `send`: `POST /v1/messages` and `POST /v1/messages/{id}/reply`;
//!   - `register`: `POST /v1/agents`;
//!   - `other`: every other authenticated request (unknown routes included).
//!
//!   So a loop that floods sends does not starve its own polls, and one agent's runaway loop
//!   does not touch another agent's buckets.
//! - **The agent** a request counts against: its `as` query parameter, else its JSON body's
//!   `as`, `from` or `name` (the first present) — when that is a well-formed agent name
//!   (NAME_RE). A request without one (or with a malformed one, which its route then refuses
//!   400) draws from one shared bucket of its class, [`NO_AGENT`]. A body is read for this
//!   only up to [`super::MAX_REQUEST_BODY`] and handed on unchanged to the route.
//! - **The answer past a bucket**: 429 `{error, code:"RATE_LIMIT", retry_after}`, the relay's
//!   code and shape (its 429 past a rate limit), with `retry_after` in seconds to
//!   the next token (fractional, ms precision) and a `Retry-After` header in whole seconds
//!   rounded up (at least 1). Nothing of the request was done; a retry after that time with
//!   the same `Idempotency-Key` is safe.
//!
//! `GET /v1/health` is unmetered (it is outside the authenticated router), as are requests
//! refused 401 (the token is checked first).
//!
//! # Bounds
//! The buckets are the shared [`RateTable`] (`agentmbx_net`; GCRA: one timestamp per key): each class's table
//! holds at most `max_keys` agents; a bucket that has refilled completely is the same as none
//! and is swept out when the table is full; if it is still full, a new agent is answered 429
//! until the earliest bucket refills, rather than an existing bucket being dropped (dropping
//! one would let a flood of made-up names reset a real agent's bucket). Memory only: a restart
//! forgets the buckets.
//!
//! # Time
//! Buckets run on the daemon's clock ([`super::AppState::clock`]), so unit tests drive them
//! with the manual clock. A clock stepped back (NTP) holds an empty bucket at most one refill
//! interval longer, never for the size of the step ([`RateTable::hit`]).
//!
//! # What it must never do
//! Log bodies, subjects or tokens: a refusal is logged at debug with the class and agent name.

use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::Method;
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use serde::Deserialize;

use agentmbx_net::body::{read_capped, BodyError};
use agentmbx_net::rate::{RateTable, Verdict};

use crate::config::ApiRateConfig;

use super::{ApiError, SharedState, MAX_REQUEST_BODY};

/// The key of the bucket shared, per class, by requests that name no well-formed agent (not an
/// agent name: NAME_RE names start with a letter or digit).
pub const NO_AGENT: &str = "-";

/// Which bucket of an agent a request draws from (module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RateClass {
    /// Reads that poll: inbox (long poll included), catchup, replay, sent; opening an event
    /// stream.
    Wait,
    /// Send and reply.
    Send,
    /// Agent registration.
    Register,
    /// Every other authenticated request.
    Other,
}

impl RateClass {
    /// The class of a request to `path` with `method` (every authenticated route has one).
    pub fn of(method: &Method, path: &str) -> RateClass {
        let read = method == Method::GET || method == Method::HEAD;
        match path {
            "/v1/inbox" | "/v1/catchup" | "/v1/replay" | "/v1/sent" | "/v1/events" if read => {
                RateClass::Wait
            }
            "/v1/messages" if method == Method::POST => RateClass::Send,
            p if method == Method::POST
                && p.starts_with("/v1/messages/")
                && p.ends_with("/reply") =>
            {
                RateClass::Send
            }
            "/v1/agents" if method == Method::POST => RateClass::Register,
            _ => RateClass::Other,
        }
    }

    /// Its name in the configuration and the log: `wait`, `send`, `register`, `other`.
    pub fn name(self) -> &'static str {
        match self {
            RateClass::Wait => "wait",
            RateClass::Send => "send",
            RateClass::Register => "register",
            RateClass::Other => "other",
        }
    }
}

/// The local API's rate tables, one per class (in [`super::AppState::rates`]).
#[derive(Debug)]
pub struct ApiRates {
    wait: RateTable,
    send: RateTable,
    register: RateTable,
    other: RateTable,
}

impl Default for ApiRates {
    /// The default `[api_rate]`.
    fn default() -> Self {
        ApiRates::new(&ApiRateConfig::default())
    }
}

impl ApiRates {
    /// The tables `config` asks for.
    pub fn new(config: &ApiRateConfig) -> Self {
        let c = config;
        ApiRates {
            wait: RateTable::with_burst(c.wait_burst, c.wait_per_min, c.max_keys),
            send: RateTable::with_burst(c.send_burst, c.send_per_min, c.max_keys),
            register: RateTable::with_burst(c.register_burst, c.register_per_min, c.max_keys),
            other: RateTable::with_burst(c.other_burst, c.other_per_min, c.max_keys),
        }
    }

    /// The table of `class`.
    pub fn table(&self, class: RateClass) -> &RateTable {
        match class {
            RateClass::Wait => &self.wait,
            RateClass::Send => &self.send,
            RateClass::Register => &self.register,
            RateClass::Other => &self.other,
        }
    }

    /// Counts one request of `agent` (`None`, or not NAME_RE: the shared [`NO_AGENT`] bucket)
    /// in `class` at `now_ms`: `Ok(())` when within its bucket, else the ms until it may retry.
    pub fn hit(&self, class: RateClass, agent: Option<&str>, now_ms: i64) -> Result<(), u64> {
        let key = agent
            .filter(|a| agentmbx_protocol::limits::is_name(a))
            .unwrap_or(NO_AGENT);
        match self.table(class).hit(key, now_ms) {
            Verdict::Allowed => Ok(()),
            Verdict::Limited { retry_after_ms } | Verdict::TableFull { retry_after_ms } => {
                Err(u64::try_from(retry_after_ms.max(1)).unwrap_or(1))
            }
        }
    }
}

/// The fields a request may name its agent by.
#[derive(Deserialize)]
struct Named {
    #[serde(rename = "as")]
    as_agent: Option<String>,
    from: Option<String>,
    name: Option<String>,
}

/// The agent `as=` of a query string names, if any.
fn query_agent(query: Option<&str>) -> Option<String> {
    form_urlencoded::parse(query?.as_bytes())
        .find(|(k, _)| k == "as")
        .map(|(_, v)| v.into_owned())
}

/// The agent a JSON body names (`as`, `from`, `name`, in that order), if any; a body that is
/// not such JSON names none (its route refuses it).
fn body_agent(body: &[u8]) -> Option<String> {
    let n: Named = serde_json::from_slice(body).ok()?;
    n.as_agent.or(n.from).or(n.name)
}

/// Middleware over the authenticated routes (after the token check): counts the request
/// against its (agent, class) bucket and answers 429 `RATE_LIMIT` past it (module docs).
pub async fn guard(
    State(state): State<SharedState>,
    request: Request,
    next: Next,
) -> Result<Response, ApiError> {
    let class = RateClass::of(request.method(), request.uri().path());
    let (request, agent) = match query_agent(request.uri().query()) {
        Some(agent) => (request, Some(agent)),
        None if request.method() == Method::POST => read_agent(request).await?,
        None => (request, None),
    };
    match state
        .rates
        .hit(class, agent.as_deref(), state.clock.now_ms())
    {
        Ok(()) => Ok(next.run(request).await),
        Err(retry_after_ms) => {
            tracing::debug!(
                class = class.name(),
                agent = agent.as_deref().unwrap_or(NO_AGENT),
                retry_after_ms,
                "local API request rate-limited"
            );
            Ok(ApiError::RateLimited {
                class: class.name(),
                retry_after_ms,
            }
            .into_response())
        }
    }
}

/// Reads a `POST` body (up to [`MAX_REQUEST_BODY`], with the shared streaming cap,
/// [`agentmbx_net::body::read_capped`]) for the agent it names and puts it back; a body over
/// the limit is 413 `BODY_TOO_LARGE`, as its route would answer.
async fn read_agent(request: Request) -> Result<(Request, Option<String>), ApiError> {
    let (parts, body) = request.into_parts();
    let bytes = read_capped(body, MAX_REQUEST_BODY)
        .await
        .map_err(|e| match e {
            BodyError::TooLarge => ApiError::BodyTooLarge(format!(
                "the request body is over the limit of {MAX_REQUEST_BODY} bytes"
            )),
            BodyError::Broken => {
                ApiError::Invalid("the request body could not be read in full".into())
            }
        })?;
    let agent = body_agent(&bytes);
    Ok((Request::from_parts(parts, Body::from(bytes)), agent))
}

#[cfg(test)]
mod tests {
    use super::*;

    mod http;

    #[test]
    fn every_route_has_its_class() {
        let get = Method::GET;
        let post = Method::POST;
        for (m, p, want) in [
            (&get, "/v1/inbox", RateClass::Wait),
            (&get, "/v1/catchup", RateClass::Wait),
            (&get, "/v1/replay", RateClass::Wait),
            (&get, "/v1/sent", RateClass::Wait),
            (&get, "/v1/events", RateClass::Wait),
            (&get, "/v1/search", RateClass::Other),
            (&post, "/v1/messages", RateClass::Send),
            (
                &post,
                "/v1/messages/01KDVDNA3VG2MH8KWSQRCWJZ0S/reply",
                RateClass::Send,
            ),
            (&post, "/v1/agents", RateClass::Register),
            (&get, "/v1/agents", RateClass::Other),
            (
                &get,
                "/v1/messages/01KDVDNA3VG2MH8KWSQRCWJZ0S",
                RateClass::Other,
            ),
            (&post, "/v1/ack", RateClass::Other),
            (&post, "/v1/catchup/commit", RateClass::Other),
            (&post, "/v1/inbox", RateClass::Other),
            (&get, "/v1/nothing", RateClass::Other),
        ] {
            assert_eq!(RateClass::of(m, p), want, "{m} {p}");
        }
    }

    #[test]
    fn the_agent_comes_from_the_query_or_the_body() {
        assert_eq!(query_agent(Some("cursor=&as=bob")).as_deref(), Some("bob"));
        assert_eq!(query_agent(Some("as=b%6Fb")).as_deref(), Some("bob"));
        assert_eq!(query_agent(Some("limit=3")), None);
        assert_eq!(query_agent(None), None);
        assert_eq!(
            body_agent(br#"{"from":"alice","to":["bob"]}"#).as_deref(),
            Some("alice")
        );
        assert_eq!(
            body_agent(br#"{"as":"carol","ids":[]}"#).as_deref(),
            Some("carol")
        );
        assert_eq!(body_agent(br#"{"name":"dave"}"#).as_deref(), Some("dave"));
        assert_eq!(body_agent(b"not json"), None);
        assert_eq!(body_agent(br#"{"from":5}"#), None);
    }

    #[test]
    fn agents_have_their_own_buckets_and_bad_names_share_one() {
        let rates = ApiRates::new(&ApiRateConfig {
            send_burst: 2,
            send_per_min: 60,
            ..ApiRateConfig::default()
        });
        let send = RateClass::Send;
        assert_eq!(rates.hit(send, Some("alice"), 0), Ok(()));
        assert_eq!(rates.hit(send, Some("alice"), 0), Ok(()));
        assert_eq!(rates.hit(send, Some("alice"), 0), Err(1_000));
        // Another agent, and another class of the same agent, are untouched.
        assert_eq!(rates.hit(send, Some("bob"), 0), Ok(()));
        assert_eq!(rates.hit(RateClass::Wait, Some("alice"), 0), Ok(()));
        // No agent, or a malformed one: one shared bucket.
        assert_eq!(rates.hit(send, None, 0), Ok(()));
        assert_eq!(rates.hit(send, Some("Not A Name"), 0), Ok(()));
        assert!(rates.hit(send, Some(""), 0).is_err());
        // Refill: one token a second.
        assert_eq!(rates.hit(send, Some("alice"), 999), Err(1));
        assert_eq!(rates.hit(send, Some("alice"), 1_000), Ok(()));
    }

    #[test]
    fn a_table_never_holds_more_than_max_keys_agents() {
        let rates = ApiRates::new(&ApiRateConfig {
            max_keys: 3,
            other_burst: 2,
            other_per_min: 60,
            ..ApiRateConfig::default()
        });
        let other = RateClass::Other;
        for a in ["a1", "a2", "a3"] {
            assert_eq!(rates.hit(other, Some(a), 0), Ok(()));
        }
        // Full of unrefilled buckets: a new agent waits for the earliest refill (1 s), known
        // agents go on.
        assert_eq!(rates.hit(other, Some("a4"), 0), Err(1_000));
        assert_eq!(rates.hit(other, Some("a1"), 0), Ok(()));
        assert_eq!(rates.table(other).len(), 3);
        // a2 and a3 refilled at 1 s (a1 took a second token): they are swept, a4 gets in.
        assert_eq!(rates.hit(other, Some("a4"), 1_000), Ok(()));
        assert_eq!(rates.table(other).len(), 2);
    }
}
