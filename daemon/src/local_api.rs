//! The client of the daemon's local API, shared by the mail commands of the CLI and by
//! `agentmbx mcp`: the base URL from `api.addr` (else the config), the bearer token from
//! `api.token`, one `Idempotency-Key` per mutating call, retries within a budget, and the
//! daemon's refusals mapped to the error classes the CLI's exit code is chosen by.
//!
//! # What it must never do
//! Print, parse command lines or depend on the CLI or the MCP server: both build on it. Never
//! show the token (not even in `Debug`).

use std::path::PathBuf;
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use agentmbx::config::Config;
use agentmbx::paths::Paths;
use agentmbx::token::ApiToken;

/// A usage error found after parsing (exit code 2).
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct UsageError(pub String);

/// The thing asked for does not exist (exit code 3).
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct NotFoundError(pub String);

/// A temporary failure (exit code 75, EX_TEMPFAIL): the outcome is unknown or the daemon's
/// store stayed busy; the text says what to do.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct TempFailError(pub String);

/// How long a mutating call keeps retrying with its one Idempotency-Key before the CLI says the
/// outcome is unknown (exit 75): 60 s, past the longest wait a lock held elsewhere should cause.
/// `MBX_CLI_RETRY_MS` overrides it (tests).
pub const DEFAULT_RETRY_MS: u64 = 60_000;
/// One HTTP attempt gives up after this (the daemon answers a request it cannot start within
/// 20 s with 503 `STORE_BUSY`, before this).
const ATTEMPT_TIMEOUT: Duration = Duration::from_secs(30);
/// An attempt gets at least this long, even when less of the budget is left.
const MIN_ATTEMPT: Duration = Duration::from_secs(1);
/// Pause before the first retry; doubled up to [`MAX_PAUSE`] (a `Retry-After` wins, capped too).
const FIRST_PAUSE: Duration = Duration::from_millis(250);
const MAX_PAUSE: Duration = Duration::from_secs(2);

/// A mutating call: what the CLI says when it cannot settle it.
pub(crate) struct Mutation<'a> {
    /// What it does, e.g. "send".
    pub what: &'a str,
    /// The `Idempotency-Key`, one per invocation (or `--idempotency-key`).
    pub key: &'a str,
    /// The command that shows whether it happened, e.g. "agentmbx sent --as alice".
    pub check: String,
}

/// A `GET` call: what the CLI says when it cannot settle it.
pub(crate) struct Query<'a> {
    /// What it does, e.g. "read".
    pub what: &'a str,
    /// For a `GET` that changes something: what it may have done (e.g. "the message may have
    /// been marked read") and the command that shows it (e.g. "agentmbx inbox --as bob --all").
    pub changes: Option<(&'a str, String)>,
}

/// A call not settled within the budget.
struct Unsettled {
    /// The daemon may have carried it out (a timeout, a broken answer, a 5xx other than
    /// `STORE_BUSY`).
    maybe_done: bool,
    /// The last failure, for the message.
    last: String,
}

/// A fresh `Idempotency-Key`: 128 random bits, lowercase hex (32 characters).
pub(crate) fn mint_key() -> String {
    // Hex, never base64url: a key is printed for a rerun as `--idempotency-key <key>`, and a
    // key that began with `-` would be read as a flag.
    hex::encode(rand::random::<[u8; 16]>())
}

/// The retry budget: `MBX_CLI_RETRY_MS` (ms) or [`DEFAULT_RETRY_MS`].
fn retry_budget() -> anyhow::Result<Duration> {
    match std::env::var("MBX_CLI_RETRY_MS") {
        Err(_) => Ok(Duration::from_millis(DEFAULT_RETRY_MS)),
        Ok(v) => v
            .trim()
            .parse::<u64>()
            .map(Duration::from_millis)
            .map_err(|_| {
                UsageError(format!(
                    "MBX_CLI_RETRY_MS must be a whole number of milliseconds, not {v:?}"
                ))
                .into()
            }),
    }
}

/// What one attempt came to.
enum Attempt {
    /// A final answer (success, or an error that retrying cannot change).
    Done(anyhow::Result<Value>),
    /// Not settled; retry. `maybe_done`: the daemon may have carried the request out (a timeout,
    /// a broken connection, a 5xx other than `STORE_BUSY`). `pause`: the server's `Retry-After`.
    /// `limited`: a 429 `RATE_LIMIT` (nothing done): `pause` is the body's `retry_after`, waited
    /// in full (not capped at [`MAX_PAUSE`]) before the next attempt.
    Retry {
        why: String,
        maybe_done: bool,
        pause: Option<Duration>,
        limited: bool,
    },
    /// The daemon could not be reached at all: nothing was sent.
    Unreachable(String),
}

/// The daemon cannot be reached (nothing answers at its address, or it never wrote its token):
/// nothing was sent. The text names `agentmbx daemon`; `agentmbx mcp` puts its own words on it.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub(crate) struct DaemonDown(pub String);

/// The client of the local API shared by the mail commands and `agentmbx mcp`: the base URL
/// from `api.addr` (else config), the bearer token from `api.token`, retries within a budget.
pub(crate) struct Api {
    base: String,
    token: ApiToken,
    /// Where the token was read, and the home it belongs to: named when the daemon refuses it.
    token_file: PathBuf,
    home: PathBuf,
    http: reqwest::Client,
    budget: Duration,
    /// How long the daemon may hold a request on purpose (`inbox --wait`): added to each
    /// attempt's timeout and to the budget, so the CLI never gives up on a wait in progress.
    pub(crate) wait: Duration,
}

impl std::fmt::Debug for Api {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never the token.
        f.debug_struct("Api")
            .field("base", &self.base)
            .finish_non_exhaustive()
    }
}

impl Api {
    /// Reads the token and address of the daemon of `MBX_HOME`. Errors: an uninitialized
    /// home (`IdentityError::NotInitialized`), no `api.token` yet ([`DaemonDown`]), a bad
    /// `MBX_CLI_RETRY_MS` or config.
    pub(crate) fn connect() -> anyhow::Result<Self> {
        let budget = retry_budget()?;
        let paths = Paths::from_env()?;
        let token = match ApiToken::load(&paths.api_token())? {
            Some(token) => token,
            // Exit 3 with the same words as every other command on an uninitialized home.
            None if !agentmbx::identity::is_initialized(&paths) => {
                return Err(agentmbx::identity::IdentityError::NotInitialized {
                    path: paths.host_key(),
                }
                .into())
            }
            None => {
                return Err(DaemonDown(format!(
                    "no api.token in {}: start the daemon first (agentmbx daemon)",
                    paths.home().display()
                ))
                .into())
            }
        };
        let addr = match std::fs::read_to_string(paths.api_addr_file()) {
            Ok(text) => text.trim().to_string(),
            Err(_) => Config::load(&paths)?.api_addr().to_string(),
        };
        // The local API is on this machine: never through HTTP(S)_PROXY.
        let http = reqwest::Client::builder()
            .no_proxy()
            .connect_timeout(Duration::from_secs(5))
            .build()?;
        Ok(Api {
            base: format!("http://{addr}"),
            token,
            token_file: paths.api_token(),
            home: paths.home().to_path_buf(),
            http,
            budget,
            wait: Duration::ZERO,
        })
    }

    /// The same client with another retry budget (`agentmbx mcp` keeps tool calls short).
    pub(crate) fn with_budget(mut self, budget: Duration) -> Self {
        self.budget = budget;
        self
    }

    /// The daemon's base URL, e.g. `http://127.0.0.1:7777`.
    pub(crate) fn base(&self) -> &str {
        &self.base
    }

    fn unreachable(&self, why: &str) -> anyhow::Error {
        DaemonDown(format!(
            "the daemon does not answer at {} (is `agentmbx daemon` running?): {why}",
            self.base
        ))
        .into()
    }

    /// One `GET` that may take `timeout` (a long poll, `GET /v1/inbox?wait=`): not retried
    /// (the caller waits again), except after 429 `RATE_LIMIT` (nothing was done): asked again
    /// after its `retry_after` while that fits in the budget. Errors: [`DaemonDown`] when
    /// nothing answers, else the API's error as for [`Api::get`].
    pub(crate) async fn get_once(&self, path: &str, timeout: Duration) -> anyhow::Result<Value> {
        let deadline = Instant::now() + self.budget;
        loop {
            match self
                .attempt(self.request(reqwest::Method::GET, path, timeout))
                .await
            {
                Attempt::Done(result) => return result,
                Attempt::Unreachable(why) => return Err(self.unreachable(&why)),
                Attempt::Retry {
                    limited: true,
                    pause: Some(pause),
                    ..
                } if Instant::now() + pause <= deadline => tokio::time::sleep(pause).await,
                Attempt::Retry { why, .. } => return Err(TempFailError(why).into()),
            }
        }
    }

    /// Opens a stream (`GET /v1/events`) with no timeout once it answered, resuming after
    /// `last_event_id` when given (`Last-Event-ID`). Errors: [`DaemonDown`] when nothing
    /// answers; the daemon's refusal as the CLI's errors ([`refusal`]: exit 2, 3,
    /// or 75 while busy or when the answer broke off).
    pub(crate) async fn open_stream(
        &self,
        path: &str,
        last_event_id: Option<&str>,
    ) -> anyhow::Result<reqwest::Response> {
        let mut req = self
            .http
            .get(format!("{}{path}", self.base))
            .bearer_auth(self.token.expose_secret())
            .header(reqwest::header::ACCEPT, "text/event-stream");
        if let Some(id) = last_event_id {
            req = req.header("Last-Event-ID", id);
        }
        let describe = agentmbx::transport::relay_client::describe;
        let resp = match req.send().await {
            Ok(resp) => resp,
            Err(e) if e.is_connect() => return Err(self.unreachable(&describe(&e))),
            Err(e) => {
                return Err(
                    TempFailError(format!("the daemon does not answer: {}", describe(&e))).into(),
                )
            }
        };
        let status = resp.status();
        if status.is_success() {
            return Ok(resp);
        }
        if status.as_u16() == 401 {
            return Err(anyhow::anyhow!(
                "the daemon at {} refused the API token read from {} (MBX_HOME {}): use the \
                 MBX_HOME the daemon runs with, or restart the daemon (HTTP 401)",
                self.base,
                self.token_file.display(),
                self.home.display()
            ));
        }
        let value: Value = resp.json().await.unwrap_or(Value::Null);
        let msg = value["error"]
            .as_str()
            .unwrap_or("request failed")
            .to_string();
        let code = value["code"].as_str().unwrap_or_default();
        Err(refusal(status.as_u16(), code, msg))
    }

    /// A `GET`: retried within the budget on timeouts, broken answers and 5xx (a repeated GET
    /// is safe: at most it marks read again what one already marked) and while the daemon
    /// answers 503 `STORE_BUSY`. A daemon that cannot be reached before anything was sent is a
    /// plain failure (exit 1). An unsettled call is [`TempFailError`] (exit 75): a `read`
    /// marks the message read and queues its `read` receipt, so after a timeout or a broken
    /// answer the outcome is unknown; the message says so and how to check (`q.check`).
    pub(crate) async fn get(&self, path: &str, q: &Query<'_>) -> anyhow::Result<Value> {
        let (started, settled) = self
            .settle(|timeout| self.request(reqwest::Method::GET, path, timeout))
            .await;
        let Unsettled { maybe_done, last } = match settled {
            Ok(result) => return result,
            Err(unsettled) => unsettled,
        };
        let secs = started.elapsed().as_secs();
        let what = q.what;
        Err(TempFailError(match (&q.changes, maybe_done) {
            (Some((effect, check)), true) => format!(
                "the daemon did not answer the {what} within {secs} s (last: {last}); the outcome \
                 is unknown: {effect}. Check with `{check}`; running it again is safe"
            ),
            (None, true) => format!(
                "the daemon did not answer the {what} within {secs} s (last: {last}); it changes \
                 nothing: rerun later"
            ),
            (_, false) => {
                format!(
                "the daemon's store stayed busy, or the agent rate-limited, for {secs} s (last: \
                 {last}); the {what} was not done: rerun later"
            )
            }
        })
        .into())
    }

    /// A change (`POST`): sent with `m.key` as `Idempotency-Key` and retried with the same key
    /// and bytes on timeouts, broken connections, 5xx and 503 `STORE_BUSY` until it is
    /// settled or the budget is spent; the daemon replays the first answer to a repeated key,
    /// so a retry never does it twice. A daemon that cannot be reached before anything was
    /// sent is a plain failure (exit 1); an unsettled call is [`TempFailError`] (exit 75) that
    /// says whether the outcome is unknown, how to check, and the key to rerun with.
    pub(crate) async fn mutate(
        &self,
        path: &str,
        body: &Value,
        m: &Mutation<'_>,
    ) -> anyhow::Result<Value> {
        let bytes = serde_json::to_vec(body)?;
        let (started, settled) = self
            .settle(|timeout| {
                self.request(reqwest::Method::POST, path, timeout)
                    .header("idempotency-key", m.key)
                    .header(reqwest::header::CONTENT_TYPE, "application/json")
                    .body(bytes.clone())
            })
            .await;
        let Unsettled { maybe_done, last } = match settled {
            Ok(result) => return result,
            Err(unsettled) => unsettled,
        };
        let secs = started.elapsed().as_secs();
        let (what, key, check) = (m.what, m.key, &m.check);
        let text = if maybe_done {
            format!(
                "the daemon did not confirm the {what} within {secs} s (last: {last}); the outcome \
                 is unknown: it may have been done. Check with `{check}`; to retry without doing \
                 it twice, rerun the same command with --idempotency-key {key}"
            )
        } else {
            format!(
                "the daemon's store stayed busy, or the agent rate-limited, for {secs} s (last: \
                 {last}); the {what} was not done: rerun later (with --idempotency-key {key} it \
                 cannot be done twice)"
            )
        };
        Err(TempFailError(text).into())
    }

    /// Sends the request `build` makes (given the attempt's timeout) until it is settled or
    /// the budget is spent: retried on timeouts, broken connections, 5xx and 503
    /// `STORE_BUSY`, pausing [`FIRST_PAUSE`] doubling to [`MAX_PAUSE`] (or `Retry-After`), and
    /// on 429 `RATE_LIMIT` (nothing was done), pausing its `retry_after` in full.
    /// Returns when it started and the final answer, or [`Unsettled`] once the budget is
    /// spent. A daemon unreachable before any attempt reached it is a final answer (an error).
    async fn settle(
        &self,
        build: impl Fn(Duration) -> reqwest::RequestBuilder,
    ) -> (Instant, Result<anyhow::Result<Value>, Unsettled>) {
        let started = Instant::now();
        let deadline = started + self.budget + self.wait;
        let mut pause = FIRST_PAUSE;
        let mut maybe_done = false;
        let mut last: String;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            let req = build(left.clamp(MIN_ATTEMPT, ATTEMPT_TIMEOUT) + self.wait);
            let after = match self.attempt(req).await {
                Attempt::Done(result) => return (started, Ok(result)),
                // Nothing ever reached the daemon: nothing was done.
                Attempt::Unreachable(why) if !maybe_done => {
                    return (started, Ok(Err(self.unreachable(&why))))
                }
                Attempt::Unreachable(why) => {
                    last = why;
                    None
                }
                Attempt::Retry {
                    why,
                    maybe_done: maybe,
                    pause: retry_after,
                    limited,
                } => {
                    maybe_done |= maybe;
                    last = why;
                    // A rate limit's pause is exact: retrying sooner only meets it again.
                    retry_after.map(|p| if limited { p } else { p.min(MAX_PAUSE) })
                }
            };
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return (started, Err(Unsettled { maybe_done, last }));
            }
            tokio::time::sleep(after.unwrap_or(pause).min(left)).await;
            pause = (pause * 2).min(MAX_PAUSE);
        }
    }

    fn request(
        &self,
        method: reqwest::Method,
        path: &str,
        timeout: Duration,
    ) -> reqwest::RequestBuilder {
        self.http
            .request(method, format!("{}{path}", self.base))
            .bearer_auth(self.token.expose_secret())
            .timeout(timeout)
    }

    /// Sends one attempt and sorts its outcome.
    async fn attempt(&self, req: reqwest::RequestBuilder) -> Attempt {
        let describe = agentmbx::transport::relay_client::describe;
        let resp = match req.send().await {
            Ok(resp) => resp,
            Err(e) if e.is_connect() => return Attempt::Unreachable(describe(&e)),
            Err(e) => {
                return Attempt::Retry {
                    why: format!("the daemon does not answer: {}", describe(&e)),
                    maybe_done: true,
                    pause: None,
                    limited: false,
                }
            }
        };
        let status = resp.status();
        let retry_after = resp
            .headers()
            .get(reqwest::header::RETRY_AFTER)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.trim().parse::<u64>().ok())
            .map(Duration::from_secs);
        let bytes = match resp.bytes().await {
            Ok(bytes) => bytes,
            // The answer broke off: it may have been a success.
            Err(e) => {
                let cause = describe(&e);
                let why = match cause.strip_prefix("the answer broke off") {
                    Some(rest) => format!("the daemon's answer broke off{rest}"),
                    None => format!("the daemon's answer broke off: {cause}"),
                };
                return Attempt::Retry {
                    why,
                    maybe_done: true,
                    pause: None,
                    limited: false,
                };
            }
        };
        let value: Value = serde_json::from_slice(&bytes).unwrap_or(Value::Null);
        if status.is_success() {
            return Attempt::Done(Ok(value));
        }
        let msg = value
            .get("error")
            .and_then(Value::as_str)
            .unwrap_or("request failed")
            .to_string();
        let code = value
            .get("code")
            .and_then(Value::as_str)
            .unwrap_or_default();
        if status.as_u16() == 429 {
            // Nothing was done; `retry_after` (fractional seconds) is more exact than the
            // header's whole seconds.
            let pause = value
                .get("retry_after")
                .and_then(Value::as_f64)
                .filter(|s| s.is_finite() && *s > 0.0)
                .map(|s| Duration::from_secs_f64(s.min(3600.0)))
                .or(retry_after)
                .unwrap_or(FIRST_PAUSE);
            return Attempt::Retry {
                why: format!("{msg} (HTTP {status})"),
                maybe_done: false,
                pause: Some(pause),
                limited: true,
            };
        }
        if status.as_u16() == 503 && code == "IDEMPOTENCY_FULL" {
            // Nothing was done, and retrying within the budget cannot help (the records age
            // out over hours).
            return Attempt::Done(Err(TempFailError(format!("{msg} (HTTP {status})")).into()));
        }
        if status.is_server_error() {
            return Attempt::Retry {
                why: format!("{msg} (HTTP {status})"),
                // 503 STORE_BUSY or TOO_MANY_WAITERS: the daemon did nothing. Any other 5xx
                // may follow a commit.
                maybe_done: !(status.as_u16() == 503
                    && (code == "STORE_BUSY" || code == "TOO_MANY_WAITERS")),
                pause: retry_after,
                limited: false,
            };
        }
        Attempt::Done(Err(match status.as_u16() {
            404 => NotFoundError(msg).into(),
            400 if code == "UNKNOWN_HOST" || code == "UNKNOWN_AGENT" => NotFoundError(msg).into(),
            400 => UsageError(msg).into(),
            401 => anyhow::anyhow!(
                "the daemon at {} refused the API token read from {} (MBX_HOME {}): that \
                 daemon runs with another home's token, or api.token changed since it started; \
                 use the MBX_HOME the daemon runs with, or restart the daemon (HTTP 401)",
                self.base,
                self.token_file.display(),
                self.home.display()
            ),
            _ => anyhow::anyhow!("{msg} (HTTP {status})"),
        }))
    }
}

/// Best effort, for `whoami --as <name>` after its direct write delivered mail held for
/// `name`: tells a running daemon, with the same `POST /v1/agents {"name"}` (which changes
/// nothing more: no role or description given keeps them), so the delivered receipts queued
/// go out now instead of at the daemon's next idle pass. Returns whether the daemon answered
/// 200; any failure (no daemon, no token) is only `false`.
pub(crate) fn wake_daemon_for(name: &str) -> bool {
    let Ok(api) = Api::connect() else {
        return false;
    };
    block_on(async {
        let r = api
            .request(reqwest::Method::POST, "/v1/agents", Duration::from_secs(3))
            .json(&json!({ "name": name }))
            .send()
            .await?;
        Ok(r.status().is_success())
    })
    .unwrap_or(false)
}

/// Runs `f` to completion on a fresh current-thread runtime (the CLI is synchronous).
pub(crate) fn block_on<T>(
    f: impl std::future::Future<Output = anyhow::Result<T>>,
) -> anyhow::Result<T> {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?
        .block_on(f)
}

/// `s` percent-encoded for a path segment or query value of the local API.
pub(crate) fn enc(s: &str) -> String {
    agentmbx::transport::relay_client::push::urlencode(s)
}

/// Maps the daemon's refusal of a stream to the CLI's errors (exit 2 for a bad request, 3 for
/// an unknown agent, 75 while busy or rate-limited: `watch` tries again), for
/// [`Api::open_stream`].
pub(crate) fn refusal(status: u16, code: &str, msg: String) -> anyhow::Error {
    match status {
        404 => NotFoundError(msg).into(),
        400 if code == "UNKNOWN_AGENT" => NotFoundError(msg).into(),
        400 => UsageError(msg).into(),
        s if s >= 500 || s == 429 => TempFailError(format!("{msg} (HTTP {s})")).into(),
        s => anyhow::anyhow!("{msg} (HTTP {s})"),
    }
}
