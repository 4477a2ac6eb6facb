//! The host side of the durable relay (spec §1, §3, §4, §8; `wire.md` §3.5).
//!
//! - [`session`]: signed info, relay key pinning check, enrolment (and its recovery) and
//!   enc-key ad publishing;
//! - [`allowlist`]: this host's sender allowlist at the relay;
//! - [`answer`]: every relay answer is read under a size cap;
//! - [`state`]: the relay state, pins, enrolment cache and backoff kept in `mailbox.db`;
//! - [`push`]: sealing each outbox row for its target once, pushing, and settling rows only on
//!   a verified accept receipt;
//! - [`pull`]: pulling after `received_through`, receiving in seq order with the checkpoint in
//!   the last item's transaction, quarantine, then the transport ack;
//! - [`stream`]: the push stream (`GET /v2/relay/stream`): pushed items through the same
//!   receive path, the prev_seq rule, acks after the commit, and the loop's reconnects.
//!
//! Every request carries the v2 signed hop ([`agentmbx_protocol::hop`]), and from the daemon
//! its instance id in `x-mbx-instance` (unsigned, advisory: [`crate::instance`]). This module never
//! trusts the relay for content: peers' enc keys come only from ads signed by their pinned host
//! key, accepts only count when signed by the pinned relay key.

pub mod account;
pub mod allowlist;
pub mod answer;
pub mod pull;
pub mod push;
pub mod rotate;
pub mod session;
pub mod state;
pub mod stream;

#[cfg(test)]
mod test_support;
#[cfg(test)]
mod tests;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use agentmbx_protocol::clock::SharedClock;
use agentmbx_protocol::failpoint::Failpoints;
use agentmbx_protocol::hop;
use agentmbx_protocol::keys::PublicKey;
use agentmbx_protocol::wire::ErrorBody;

use crate::identity::Identity;
use crate::mailbox::{Mailbox, MailboxError};

/// Longest pause between relay passes after failures (ms): 10 s, so mail waiting while the
/// relay was down moves within seconds of its return (a new send wakes the loop at once).
pub const MAX_RETRY_DELAY_MS: u64 = 10_000;

/// Longest wait a relay's 429 can impose (ms): 1 h, so a relay that asks for more does not
/// silence this host for longer than the enrolment backoff's ceiling.
pub const MAX_RATE_LIMIT_WAIT_MS: u64 = 3_600_000;

/// Wait after a 429 that names no usable time (ms): 0.5.x's "retry in a minute".
pub const DEFAULT_RATE_LIMIT_WAIT_MS: u64 = 60_000;

/// How often a wait on the clock (after a 429) looks at the clock again (ms).
pub const CLOCK_WAIT_STEP_MS: u64 = 1_000;

/// Client timeout of one relay request (`wire.md` §2.6: 15 s for v2).
pub const REQUEST_TIMEOUT: Duration = Duration::from_secs(15);

/// The relay loop's liveness bound ([`crate::liveness`]): 60 s. [`run`] stamps at each
/// pass, before each relay call ([`RelayClient::call_capped`]), before each pulled item and
/// while it waits (every 10 s), so between two stamps there is at most one call (the account
/// token command, [`account::TOKEN_COMMAND_TIMEOUT`] 10 s, then the request,
/// [`REQUEST_TIMEOUT`] 15 s with its answer) and the store work around it (one item received,
/// a push's rows settled, each waiting at most SQLite's 5 s busy timeout); 25 s plus 35 s for the
/// store, so a slow relay or a busy disk never costs a restart while a loop stuck for a minute
/// is reported.
pub const LIVENESS_MAX_GAP: Duration =
    Duration::from_secs(account::TOKEN_COMMAND_TIMEOUT.as_secs() + REQUEST_TIMEOUT.as_secs() + 35);

/// A relay exchange that did not give a usable answer.
#[derive(Debug, thiserror::Error)]
pub enum RelayError {
    /// Network failure or timeout: the effect is unknown, the caller retries.
    #[error("relay unreachable: {0}")]
    Unreachable(String),
    /// The relay answered with an error status.
    #[error("relay answered {status}: {error}")]
    Status {
        /// HTTP status.
        status: u16,
        /// `error` text of the body (or the raw body, cut).
        error: String,
        /// Parsed error body, when it was one (boxed: it is the largest part of the error).
        body: Option<Box<ErrorBody>>,
    },
    /// The relay's answer could not be parsed.
    #[error("malformed relay answer: {0}")]
    Malformed(String),
    /// The relay presents another key than the pinned one: relay use stops (spec §1).
    #[error("relay key changed: pinned {pinned}, served {served}; confirm with `agentmbx relay set <url> --key {served}` if expected")]
    KeyMismatch {
        /// Pinned fingerprint.
        pinned: String,
        /// Served fingerprint.
        served: String,
    },
    /// The relay answered 429 (`wire.md` "Rate limits"): no request to it before
    /// `retry_after_ms` have passed ([`rate_limited`]; the relay loop waits that long, and a
    /// new send does not cut the wait short).
    #[error("the relay rate-limits this host: retry in {retry_after_ms} ms")]
    RateLimited {
        /// How long to wait (ms; 1 s to [`MAX_RATE_LIMIT_WAIT_MS`]).
        retry_after_ms: u64,
    },
    /// The relay's enrolment authority cannot decide now (503 `AUTHORITY_UNAVAILABLE`, spec §8:
    /// the account issuer's keys cannot be had): not a denial. The relay loop records
    /// `enrol-failed` with this reason and waits `retry_after_ms` before the next pass.
    #[error("the relay's enrolment authority is unavailable: retry in {retry_after_ms} ms")]
    AuthorityUnavailable {
        /// How long to wait (ms; 1 s to [`MAX_RATE_LIMIT_WAIT_MS`]; the relay's `retry_after`,
        /// else [`DEFAULT_RATE_LIMIT_WAIT_MS`]).
        retry_after_ms: u64,
    },
    /// Local storage failed.
    #[error(transparent)]
    Store(#[from] MailboxError),
    /// No account token could be had for the relay (`[relay] token_command`, spec §8); the
    /// pass is retried like any other failure.
    #[error("no account token for the relay: {0}")]
    Token(String),
    /// The relay refuses this host (403 `DENIED` for now or `REVOKED` for good, or a refusal
    /// right after a fresh enrolment): no enrolment is tried before `retry_at_ms` (`wire.md` §3.5
    /// `relay-enrol-backoff`, 1 min doubling to 1 h). The verdict is in the relay state.
    #[error("the relay refuses this host ({standing}): {detail}")]
    Refused {
        /// `clock-skew`, `refused-after-enrol`, `denied` or `revoked`.
        standing: state::Standing,
        /// What happened, for a person.
        detail: String,
        /// Next enrolment attempt (ms since the epoch).
        retry_at_ms: i64,
    },
}

impl RelayError {
    /// The HTTP status of an error answer, if this is one.
    pub fn status(&self) -> Option<u16> {
        match self {
            RelayError::Status { status, .. } => Some(*status),
            RelayError::AuthorityUnavailable { .. } => Some(503),
            _ => None,
        }
    }

    /// A 401 about the caller: the relay does not (or no longer) know this host key
    /// (`NOT_ENROLLED`), or refused the hop (`BAD_HOP`: e.g. the clocks). A 401 about a record
    /// in the request (`BAD_SIGNATURE` of a sender list) is not one.
    pub fn is_not_enrolled(&self) -> bool {
        match self {
            RelayError::Status {
                status: 401, body, ..
            } => body.as_ref().is_none_or(|b| b.code != "BAD_SIGNATURE"),
            _ => false,
        }
    }

    /// A 401 about the caller ([`Self::is_not_enrolled`]) or a 403: the answer concerns this
    /// host's standing with the relay, not the request, so it ends the pass before any outbox
    /// row or receipt is charged a failed attempt.
    pub fn is_auth(&self) -> bool {
        self.is_not_enrolled() || self.status() == Some(403)
    }

    /// An answer about this host rather than about one row, receipt or page: its standing
    /// ([`Self::is_auth`]) or a 429 ([`RelayError::RateLimited`], `wire.md` "Rate limits").
    /// It ends the pass at once, without charging any outbox row or receipt a failed attempt,
    /// and [`run`] handles it (a 429 waits the time the relay gave before the next pass).
    pub fn ends_pass(&self) -> bool {
        self.is_auth()
            || matches!(
                self,
                RelayError::RateLimited { .. } | RelayError::AuthorityUnavailable { .. }
            )
    }
}

/// What the relay client needs: the relay, this host, the store and the clock.
#[derive(Clone, Debug)]
pub struct RelayClient {
    http: reqwest::Client,
    /// Relay base URL without a trailing slash (also the key of local relay state).
    pub url: String,
    /// The pinned relay key.
    pub relay_key: PublicKey,
    /// This host.
    pub ident: Arc<Identity>,
    /// The host store.
    pub mailbox: Mailbox,
    /// The one clock.
    pub clock: SharedClock,
    /// Notified after a pull stored new mail or queued receipts again (a duplicate), so the
    /// sender loops send the owed delivery receipts without waiting for their next timer.
    pub received: Option<Arc<tokio::sync::Notify>>,
    /// What the relay's answers said (the `Date` header of the last one).
    pub observed: Arc<state::Observed>,
    /// Account tokens, for a relay run with the account authority (`[relay] token_command`,
    /// spec §8): every call after the relay key was confirmed in this pass carries
    /// `Authorization: Bearer <token>` and enrolment carries the proof. `None`: the host-key
    /// challenge only.
    pub account: Option<Arc<account::AccountTokens>>,
    /// The daemon's instance: its id goes in `x-mbx-instance` on every hop (unsigned,
    /// advisory), and the relay's `you.instance_conflict` is noted in it each pass
    /// ([`crate::instance`]). `None` (tests, CLI): no header, nothing noted.
    pub instance: Option<Arc<crate::instance::Instance>>,
    /// The failpoints this client hits (`push:before-send`, `push:after-response`,
    /// `receive:after-deliver`, `ack:before-send`, `ack:after-response`): the daemon's own set;
    /// [`Self::new`] gives the process's ([`Failpoints::from_env`]).
    pub failpoints: Failpoints,
    /// Whether [`run`] keeps a push stream open to the relay ([`stream`]; `relay_stream` in
    /// `config.toml`, `MBX_RELAY_STREAM`). [`Self::new`] leaves it off; [`start`] sets it.
    pub stream: bool,
    /// Whether the relay presented the pinned key in this pass ([`Self::confirm_relay_key`]).
    /// The account token is sent only while it is true: the first signed info of a pass goes
    /// without it, and a relay presenting another key never receives it.
    key_confirmed: Arc<AtomicBool>,
}

/// The HTTP client every relay call uses: `timeout` per request, no redirects, and the
/// standard proxy environment honoured (`HTTPS_PROXY`/`https_proxy` for https relay URLs,
/// `HTTP_PROXY`/`http_proxy` for http ones, `ALL_PROXY`, and `NO_PROXY` exempting hosts;
/// reqwest's default, which this builder must never turn off: relays are on the internet,
/// unlike LAN peers, whose client calls `no_proxy()`). Errors: [`RelayError::Unreachable`] when
/// the client cannot be built (no TLS provider, a malformed proxy URL).
pub(crate) fn http_client(timeout: Duration) -> Result<reqwest::Client, RelayError> {
    reqwest::Client::builder()
        .timeout(timeout)
        .redirect(reqwest::redirect::Policy::none())
        .build()
        .map_err(|e| RelayError::Unreachable(describe(&e)))
}

impl RelayClient {
    /// A client for `url` with its pinned key.
    pub fn new(
        url: &str,
        relay_key: PublicKey,
        ident: Arc<Identity>,
        mailbox: Mailbox,
        clock: SharedClock,
    ) -> Result<Self, RelayError> {
        let http = http_client(REQUEST_TIMEOUT)?;
        Ok(RelayClient {
            http,
            url: url.trim_end_matches('/').to_string(),
            relay_key,
            ident,
            mailbox,
            clock,
            received: None,
            observed: Arc::new(state::Observed::default()),
            account: None,
            instance: None,
            failpoints: Failpoints::from_env(),
            stream: false,
            key_confirmed: Arc::new(AtomicBool::new(false)),
        })
    }

    /// Records that the relay's signed info in this pass served the pinned key: from now on
    /// calls carry the account token.
    pub fn confirm_relay_key(&self) {
        self.key_confirmed.store(true, Ordering::SeqCst);
    }

    /// Forgets the confirmation (a new pass, or another key served): calls carry no account
    /// token until the pinned key is seen again.
    pub fn unconfirm_relay_key(&self) {
        self.key_confirmed.store(false, Ordering::SeqCst);
    }

    /// Whether the pinned key was seen in this pass ([`Self::confirm_relay_key`]).
    pub fn relay_key_confirmed(&self) -> bool {
        self.key_confirmed.load(Ordering::SeqCst)
    }

    /// Sends a signed v2 hop `method target` with `body` (empty for GET) and returns the status
    /// and raw body, read up to [`answer::MAX_ANSWER`] bytes ([`Self::call_capped`]). `target`
    /// must already be normalised (path + query).
    pub async fn call(
        &self,
        method: &str,
        target: &str,
        body: &str,
    ) -> Result<(u16, bytes::Bytes), RelayError> {
        self.call_capped(method, target, body, answer::MAX_ANSWER)
            .await
    }

    /// Like [`Self::call`], with the answer read up to `cap` bytes (a pull page:
    /// [`answer::pull_answer_cap`]). Errors: [`RelayError::Malformed`] `answer over <cap>
    /// bytes` past it, and those of [`Self::call`].
    pub async fn call_capped(
        &self,
        method: &str,
        target: &str,
        body: &str,
        cap: usize,
    ) -> Result<(u16, bytes::Bytes), RelayError> {
        crate::liveness::progress();
        let req = self.signed_request(method, target, body).await?;
        let resp = req
            .send()
            .await
            .map_err(|e| RelayError::Unreachable(describe(&e)))?;
        let status = resp.status().as_u16();
        self.observed.note_date(
            resp.headers()
                .get(reqwest::header::DATE)
                .and_then(|v| v.to_str().ok()),
        );
        let retry_after = resp
            .headers()
            .get(reqwest::header::RETRY_AFTER)
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned);
        let bytes = answer::read_capped(resp, cap).await?;
        if status == 429 {
            return Err(rate_limited(retry_after.as_deref(), &bytes));
        }
        if let Some(account) = self.account.as_ref().filter(|_| status == 401) {
            if account::refused_token(&bytes) {
                account.invalidate().await;
            }
        }
        Ok((status, bytes))
    }

    /// The signed v2 hop `method target` with `body` as a request of this client's HTTP client
    /// (so the proxy environment applies): the hop headers, `x-mbx-instance` and, once the
    /// relay presented the pinned key in this pass, the account token. `target` is normalised
    /// here and signed with its query. Errors: [`RelayError::Token`] when no account token
    /// could be had.
    pub(crate) async fn signed_request(
        &self,
        method: &str,
        target: &str,
        body: &str,
    ) -> Result<reqwest::RequestBuilder, RelayError> {
        let target = hop::normalize_target(target);
        let h = hop::sign_relay_hop(
            &self.ident.host_key,
            self.ident.host.as_str(),
            method,
            &target,
            self.clock.now_ms(),
            body,
        );
        let url = format!("{}{}", self.url, target);
        let mut req = match method {
            "GET" => self.http.get(url),
            _ => self
                .http
                .post(url)
                .header("content-type", "application/json")
                .body(body.to_string()),
        };
        for (k, v) in h.pairs() {
            req = req.header(k, v);
        }
        // Not part of the signed bytes: advisory only (crate::instance).
        if let Some(instance) = &self.instance {
            req = req.header(hop::header::INSTANCE, instance.id());
        }
        // The token only to a relay that presented the pinned key in this pass (spec §1, §8).
        if let Some(account) = self.account.as_ref().filter(|_| self.relay_key_confirmed()) {
            let token = account
                .bearer(&self.ident)
                .await
                .map_err(|e| RelayError::Token(e.to_string()))?;
            req = req.bearer_auth(token);
        }
        Ok(req)
    }

    /// Like [`Self::call`], but a non-2xx status becomes [`RelayError::Status`] and the body is
    /// parsed as `T`.
    pub async fn call_json<T: serde::de::DeserializeOwned>(
        &self,
        method: &str,
        target: &str,
        body: &str,
    ) -> Result<T, RelayError> {
        self.call_json_capped(method, target, body, answer::MAX_ANSWER)
            .await
    }

    /// Like [`Self::call_json`], with the answer read up to `cap` bytes
    /// ([`Self::call_capped`]).
    pub async fn call_json_capped<T: serde::de::DeserializeOwned>(
        &self,
        method: &str,
        target: &str,
        body: &str,
        cap: usize,
    ) -> Result<T, RelayError> {
        let (status, bytes) = self.call_capped(method, target, body, cap).await?;
        if !(200..300).contains(&status) {
            return Err(status_error(status, &bytes));
        }
        serde_json::from_slice(&bytes).map_err(|e| RelayError::Malformed(e.to_string()))
    }
}

/// A network error with the relay in our words ([`crate::net_error::describe`]: e.g.
/// `connection refused`, `timed out`), never the URL or the libraries' text.
///
/// A TLS failure names the relay: e.g. an `https://` URL aimed at a relay that speaks plain
/// HTTP is `the relay does not speak TLS at this address …`.
pub fn describe(e: &reqwest::Error) -> String {
    use std::error::Error as _;
    let mut source = e.source();
    while let Some(s) = source {
        if let Some(tls) = tls_failure(s) {
            return tls;
        }
        source = s.source();
    }
    crate::net_error::describe(e, None)
}

/// The TLS library's error inside `e` (directly, or wrapped in `std::io::Error`s, whose
/// `source` skips it), said in words a user can act on; `None` when `e` holds none.
fn tls_failure(e: &(dyn std::error::Error + 'static)) -> Option<String> {
    use rustls::{CertificateError, Error as Tls};
    if let Some(io) = e.downcast_ref::<std::io::Error>() {
        return io.get_ref().and_then(|inner| tls_failure(inner));
    }
    Some(match e.downcast_ref::<Tls>()? {
        // The first bytes back were not TLS: typically an HTTP answer to the TLS greeting.
        Tls::InvalidMessage(_) => "the relay does not speak TLS at this address (it answered \
            in plain HTTP); use its http:// URL, or the port where it serves TLS"
            .to_string(),
        Tls::InvalidCertificate(why) => {
            let why = match why {
                CertificateError::UnknownIssuer => {
                    "it is issued by an authority this host does not trust"
                }
                CertificateError::Expired | CertificateError::ExpiredContext { .. } => {
                    "it has expired"
                }
                CertificateError::NotValidForName
                | CertificateError::NotValidForNameContext { .. } => {
                    "it is issued for another name than the URL's"
                }
                _ => "it is not valid",
            };
            format!("the relay's TLS certificate was refused: {why}")
        }
        _ => "the TLS handshake with the relay failed".to_string(),
    })
}

/// The [`RelayError::RateLimited`] of a 429 answer: the `Retry-After` header (whole seconds)
/// when it is one, else the body's `retry_after` (seconds), else
/// [`DEFAULT_RATE_LIMIT_WAIT_MS`]; kept within 1 s ..= [`MAX_RATE_LIMIT_WAIT_MS`].
pub fn rate_limited(retry_after_header: Option<&str>, body: &[u8]) -> RelayError {
    let secs = retry_after_header
        .and_then(|h| h.trim().parse::<u64>().ok())
        .or_else(|| {
            serde_json::from_slice::<ErrorBody>(body)
                .ok()
                .and_then(|b| b.retry_after)
        });
    let ms = secs.map_or(DEFAULT_RATE_LIMIT_WAIT_MS, |s| s.saturating_mul(1_000));
    RelayError::RateLimited {
        retry_after_ms: ms.clamp(1_000, MAX_RATE_LIMIT_WAIT_MS),
    }
}

/// Waits until `clock` reads `until_ms` or later, looking at it at least every
/// [`CLOCK_WAIT_STEP_MS`] (so a shifted or manual clock is followed); nothing but `shutdown`
/// cuts it short. The wait never grows: should `until_ms` ever lie further ahead than it did
/// at the start (the clock was set back meanwhile, e.g. a skew fixed), it is over. `false`
/// when shutdown came first.
pub async fn wait_until_clock(
    clock: &SharedClock,
    until_ms: i64,
    shutdown: &mut tokio::sync::watch::Receiver<bool>,
) -> bool {
    let longest = until_ms.saturating_sub(clock.now_ms());
    loop {
        let left = until_ms.saturating_sub(clock.now_ms());
        if left <= 0 || left > longest {
            return true;
        }
        let step = Duration::from_millis((left as u64).min(CLOCK_WAIT_STEP_MS));
        crate::liveness::progress();
        tokio::select! {
            _ = tokio::time::sleep(step) => {}
            _ = shutdown.changed() => return false,
        }
    }
}

/// Turns an error answer into [`RelayError::Status`] ([`RelayError::RateLimited`] for a 429,
/// [`RelayError::AuthorityUnavailable`] for a 503 `AUTHORITY_UNAVAILABLE`, its wait from the
/// body's `retry_after`).
pub fn status_error(status: u16, bytes: &[u8]) -> RelayError {
    if status == 429 {
        return rate_limited(None, bytes);
    }
    let body: Option<ErrorBody> = serde_json::from_slice(bytes).ok();
    if let Some(b) = body
        .as_ref()
        .filter(|b| status == 503 && b.code == "AUTHORITY_UNAVAILABLE")
    {
        let ms = b
            .retry_after
            .map_or(DEFAULT_RATE_LIMIT_WAIT_MS, |s| s.saturating_mul(1_000));
        return RelayError::AuthorityUnavailable {
            retry_after_ms: ms.clamp(1_000, MAX_RATE_LIMIT_WAIT_MS),
        };
    }
    let error = body
        .as_ref()
        .map(|b| b.error.clone())
        .unwrap_or_else(|| String::from_utf8_lossy(&bytes[..bytes.len().min(200)]).into_owned());
    RelayError::Status {
        status,
        error,
        body: body.map(Box::new),
    }
}

/// Runs the relay loop until `shutdown`: read the pin again, open a session, push due rows,
/// pull and ack; then wait for `wake` (a new outbox row), the next due row or `pull_interval`,
/// whichever comes first. Failures are logged and retried on the next pass with a doubling
/// delay (≤ 10 s). A relay key mismatch stops all relay use except the signed info that
/// detects it (spec §1): the loop checks again every `pull_interval` (at least 1 s) and resumes
/// once the owner confirmed, with `relay set <url> --key <fp>`, a key the relay serves (the pin
/// is read from the mailbox each pass, no restart needed). A [`RelayError::Refused`] waits for
/// its backoff, checking at least once a minute whether the relay confirms this host again.
/// A [`RelayError::RateLimited`] (a 429 on any request of the pass: session, push, enc-key
/// lookup, receipts, pull or ack) waits the time the relay gave, on the clock, before the next
/// pass; a new send does not cut that wait short.
///
/// The loop is registered as `relay` in [`crate::liveness::global`]
/// ([`LIVENESS_MAX_GAP`]) while it runs: a loop stopped because the relay left the config is
/// not reported.
pub async fn run(
    client: RelayClient,
    pull_interval: Duration,
    wake: Arc<tokio::sync::Notify>,
    shutdown: tokio::sync::watch::Receiver<bool>,
) {
    let beat = crate::liveness::global().register("relay", LIVENESS_MAX_GAP);
    beat.scope(run_loop(client, pull_interval, wake, shutdown))
        .await
}

async fn run_loop(
    mut client: RelayClient,
    pull_interval: Duration,
    wake: Arc<tokio::sync::Notify>,
    mut shutdown: tokio::sync::watch::Receiver<bool>,
) {
    let mut failures: u32 = 0;
    let mut ctl = StreamCtl::default();
    // The record of a previous run must not say "up" while this one has not opened a stream.
    let first = if client.stream {
        (
            stream::StreamState::Reconnecting,
            Some("starting: the stream opens after the first relay pass".to_string()),
        )
    } else {
        (stream::StreamState::Disabled, None)
    };
    client.note_stream(first.0, first.1, 0).await;
    loop {
        if *shutdown.borrow() {
            return;
        }
        crate::liveness::progress();
        let outcome = match client.reload_pin().await {
            Ok(()) => pass_session(&client, true).await,
            Err(e) => Err(e),
        };
        // The pass pulled: open the push stream now when it is on and not waiting for its
        // backoff; it runs until it ends, then this loop goes on as after a pass.
        let outcome = match outcome {
            Ok(session) if client.stream && ctl.due() => {
                match stream_turn(&mut client, &mut ctl, &session, &wake, &mut shutdown).await {
                    Some(r) => r,
                    None => return,
                }
            }
            Ok(_) => Ok(()),
            Err(e) => Err(e),
        };
        let delay = match outcome {
            Ok(()) => {
                if failures > 0 {
                    tracing::info!(relay = %client.url, after_failures = failures, "relay reachable again");
                }
                failures = 0;
                // Only what the relay takes (spec §10): rows the LAN takes must not spin this loop.
                // A row scheduled beyond its backoff (by a clock that was ahead) counts as due
                // now, so the loop never sleeps until a skewed time.
                let now = client.clock.now_ms();
                let next_due = client
                    .mailbox
                    .run(move |c| {
                        let rows = crate::mailbox::outbox::next_due_for_relay(c, now)?;
                        let receipts = crate::mailbox::receipts::next_due_for_relay(c, now)?;
                        Ok(rows.into_iter().chain(receipts).min())
                    })
                    .await
                    .ok()
                    .flatten();
                let until_due = next_due.map_or(pull_interval, |t| {
                    Duration::from_millis((t - now).max(0) as u64)
                });
                // Polling while the stream waits for its backoff: wake up for its next
                // attempt. Only this outcome's wait, and only while that attempt lies ahead:
                // an error's or a refusal's backoff is never shortened.
                stream_cap(until_due.min(pull_interval), &ctl, client.stream)
            }
            // Logged once per served key when it was recorded (session::check_relay_key).
            Err(RelayError::KeyMismatch { .. }) => {
                failures = 0;
                pull_interval.max(Duration::from_secs(1))
            }
            // Logged once per episode when it was recorded (the relay state says the rest).
            Err(RelayError::Refused { retry_at_ms, .. }) => {
                failures = 0;
                let wait = (retry_at_ms - client.clock.now_ms()).clamp(1_000, 60_000);
                Duration::from_millis(wait as u64)
            }
            // Back off by the value given (`wire.md` "Rate limits"): no pass before it, whatever
            // wakes the loop meanwhile.
            Err(RelayError::RateLimited { retry_after_ms }) => {
                tracing::warn!(relay = %client.url, retry_after_ms, "the relay rate-limits this host; waiting as it asks");
                let until = client
                    .clock
                    .now_ms()
                    .saturating_add(i64::try_from(retry_after_ms).unwrap_or(i64::MAX));
                if !wait_until_clock(&client.clock, until, &mut shutdown).await {
                    return;
                }
                continue;
            }
            // Not a denial (recorded as `enrol-failed` with the reason): wait as the relay asks.
            Err(RelayError::AuthorityUnavailable { retry_after_ms }) => {
                failures = 0;
                tracing::warn!(relay = %client.url, retry_after_ms, "the relay's enrolment authority is unavailable; retrying when it asks");
                let until = client
                    .clock
                    .now_ms()
                    .saturating_add(i64::try_from(retry_after_ms).unwrap_or(i64::MAX));
                if !wait_until_clock(&client.clock, until, &mut shutdown).await {
                    return;
                }
                continue;
            }
            Err(e) => {
                failures = failures.saturating_add(1);
                tracing::warn!(relay = %client.url, error = %e, "relay pass failed; retrying");
                if client.stream {
                    client
                        .note_stream(
                            stream::StreamState::Reconnecting,
                            Some(format!("the relay pass failed: {e}")),
                            ctl.replaced,
                        )
                        .await;
                }
                Duration::from_millis((500u64 << failures.min(7)).min(MAX_RETRY_DELAY_MS))
            }
        };
        // Stamps the loop's liveness while it waits.
        let stop = crate::liveness::waiting(async {
            tokio::select! {
                _ = tokio::time::sleep(delay) => false,
                _ = wake.notified() => false,
                _ = shutdown.changed() => true,
            }
        })
        .await;
        if stop {
            return;
        }
    }
}

/// The wait after a pass that succeeded, `delay`, cut to the stream's next attempt when the
/// stream is on (`stream`) and that attempt (`ctl.not_before`) lies in the future; otherwise
/// `delay`. Never applied to an error's or a refusal's backoff.
fn stream_cap(delay: Duration, ctl: &StreamCtl, stream: bool) -> Duration {
    match ctl.not_before {
        Some(t) if stream => {
            let left = t.saturating_duration_since(tokio::time::Instant::now());
            if left.is_zero() {
                delay
            } else {
                delay.min(left)
            }
        }
        _ => delay,
    }
}

/// The push stream's part of the relay loop: when it may be tried again, its failures in a
/// row and the 4409 replacements seen.
#[derive(Debug, Default)]
struct StreamCtl {
    /// No stream attempt before this (`None`: now).
    not_before: Option<tokio::time::Instant>,
    /// Reopen attempts in a row that did not give a stream that stayed up.
    failures: u32,
    /// 4409 `replaced` closes since the loop started.
    replaced: u64,
}

impl StreamCtl {
    fn due(&self) -> bool {
        self.not_before
            .is_none_or(|t| tokio::time::Instant::now() >= t)
    }

    /// Reopen after the reconnect backoff ([`stream::reconnect_delay`]).
    async fn retry_later(&mut self, client: &RelayClient, reason: String) {
        let wait = stream::reconnect_delay(self.failures);
        self.failures = self.failures.saturating_add(1);
        self.not_before = Some(tokio::time::Instant::now() + wait);
        client
            .note_stream(
                stream::StreamState::Reconnecting,
                Some(reason),
                self.replaced,
            )
            .await;
    }

    /// Poll, and try the stream again after [`stream::RETRY_STREAM_WHEN_POLLING`].
    async fn poll(&mut self, client: &RelayClient, reason: String) {
        self.failures = 0;
        self.not_before = Some(tokio::time::Instant::now() + stream::RETRY_STREAM_WHEN_POLLING);
        client
            .note_stream(stream::StreamState::Polling, Some(reason), self.replaced)
            .await;
    }
}

/// Opens the push stream with the nonce of `session` and serves it until it ends, then sets
/// when it is tried again (module [`stream`]). Returns the outcome the loop handles as a pass's
/// (`Ok` when the stream merely ended), or `None` at shutdown.
async fn stream_turn(
    client: &mut RelayClient,
    ctl: &mut StreamCtl,
    session: &session::Session,
    wake: &tokio::sync::Notify,
    shutdown: &mut tokio::sync::watch::Receiver<bool>,
) -> Option<Result<(), RelayError>> {
    let Some(nonce) = session.stream_nonce.as_deref() else {
        if ctl.not_before.is_none() {
            tracing::info!(relay = %client.url, "the relay does not offer the push stream: polling");
        }
        ctl.poll(
            client,
            "the relay does not offer the push stream (no stream nonce in its signed info: an older relay)".into(),
        )
        .await;
        return Some(Ok(()));
    };
    let mut opened = client.open_stream(nonce, &session.limits).await;
    // The pass's nonce may have expired while it pushed and pulled: once more with a fresh one.
    if matches!(&opened, Err(stream::OpenError::Relay(e)) if stream::bad_nonce(e)) {
        tracing::info!(relay = %client.url, "the stream nonce was refused; opening with a fresh one");
        opened = match client.fresh_stream_nonce().await {
            Ok(Some(fresh)) => client.open_stream(&fresh, &session.limits).await,
            Ok(None) => Err(stream::OpenError::NotOffered(
                "the relay no longer offers the push stream (no stream nonce in its signed info)"
                    .into(),
            )),
            Err(e) => Err(stream::OpenError::Relay(e)),
        };
    }
    let ws = match opened {
        Ok(ws) => ws,
        Err(stream::OpenError::NotOffered(why)) => {
            tracing::info!(relay = %client.url, reason = %why, "push stream not available: polling");
            ctl.poll(client, why).await;
            return Some(Ok(()));
        }
        Err(stream::OpenError::Relay(e)) => {
            tracing::warn!(relay = %client.url, error = %e, "push stream not opened; polling until it is tried again");
            ctl.retry_later(client, format!("the stream could not be opened: {e}"))
                .await;
            return Some(match e {
                RelayError::RateLimited { .. } => Err(e),
                _ => Ok(()),
            });
        }
    };
    tracing::info!(relay = %client.url, "relay stream open");
    client
        .note_stream(stream::StreamState::Up, None, ctl.replaced)
        .await;
    let opened = tokio::time::Instant::now();
    let end = stream::serve(client, ws, session, wake, shutdown).await;
    if opened.elapsed() >= stream::STABLE_AFTER {
        ctl.failures = 0;
    }
    // Up for a whole replacement run's window: the next 4409 starts the backoff over.
    if opened.elapsed().as_millis() >= crate::instance::REPLACED_WINDOW_MS as u128 {
        ctl.replaced = 0;
    }
    match end {
        stream::End::Shutdown => None,
        stream::End::Failed(e) => {
            ctl.retry_later(client, format!("the stream stopped: {e}"))
                .await;
            Some(Err(e))
        }
        stream::End::Closed { code, reason } => {
            let code_text = code.map_or_else(|| "none".to_string(), |c| c.to_string());
            match stream::after_close(code) {
                stream::AfterClose::Reconnect => {
                    tracing::info!(relay = %client.url, code = %code_text, reason = %reason, "push stream closed; reconnecting with backoff");
                    ctl.retry_later(client, format!("closed (code {code_text}); reconnecting"))
                        .await;
                }
                stream::AfterClose::NewToken => {
                    tracing::info!(relay = %client.url, "the account token of the push stream expired; reopening with a fresh one");
                    if let Some(account) = &client.account {
                        account.invalidate().await;
                    }
                    ctl.retry_later(client, "the account token expired; reopening".into())
                        .await;
                }
                stream::AfterClose::Refused => {
                    tracing::warn!(relay = %client.url, "the relay closed the push stream: this host was revoked or denied");
                    ctl.retry_later(
                        client,
                        "the relay refused this host (revoked or denied)".into(),
                    )
                    .await;
                }
                stream::AfterClose::Replaced => {
                    ctl.replaced += 1;
                    let total = client
                        .instance
                        .as_ref()
                        .map_or(ctl.replaced, |i| i.note_replaced(&client.url).0);
                    let wait = stream::replaced_delay(ctl.replaced);
                    tracing::warn!(relay = %client.url, replaced = total, wait_ms = wait.as_millis() as u64,
                        "the relay replaced this daemon's push stream with another one opened with the same host key (another daemon with this key?); reopening after a long backoff");
                    ctl.not_before = Some(tokio::time::Instant::now() + wait);
                    client
                        .note_stream(
                            stream::StreamState::Reconnecting,
                            Some(format!(
                                "replaced by another stream opened with this host key ({} time(s): a cloned key?)",
                                ctl.replaced
                            )),
                            ctl.replaced,
                        )
                        .await;
                }
            }
            Some(Ok(()))
        }
    }
}

/// Starts the relay transport for `url`: resolves the pinned key (the configured one, the one
/// pinned on first contact, or — when the relay cannot be reached yet — retried with a doubling
/// delay up to 60 s, so a relay that is down at daemon start is used once it is up), then
/// [`run`]s until `shutdown`. `received` is notified when a pull stored new mail or queued receipts again
/// ([`RelayClient::received`]). `account` (from `[relay] token_command`) makes every call
/// carry the account token ([`RelayClient::account`]). `instance` is the daemon's
/// ([`RelayClient::instance`]). `failpoints` are the daemon's ([`RelayClient::failpoints`]).
/// `stream` keeps the push stream open while the relay offers it ([`RelayClient::stream`]).
#[allow(clippy::too_many_arguments)]
pub async fn start(
    url: String,
    configured_key: Option<String>,
    ident: Arc<Identity>,
    mailbox: Mailbox,
    clock: SharedClock,
    pull_interval: Duration,
    wake: Arc<tokio::sync::Notify>,
    received: Option<Arc<tokio::sync::Notify>>,
    account: Option<Arc<account::AccountTokens>>,
    instance: Option<Arc<crate::instance::Instance>>,
    failpoints: Failpoints,
    stream: bool,
    mut shutdown: tokio::sync::watch::Receiver<bool>,
) {
    let mut delay = Duration::from_millis(500);
    let key = loop {
        match pin::resolve_key(&url, configured_key.as_deref(), &mailbox, &clock).await {
            Ok(k) => break k,
            Err(e @ (RelayError::Malformed(_) | RelayError::Store(_))) => {
                tracing::error!(relay = %url, error = %e, "relay transport off");
                return;
            }
            // Recorded and logged once per served key by resolve_key; the owner's `relay set`
            // (read from the mailbox on the next try) ends it.
            Err(RelayError::KeyMismatch { .. }) => {
                tokio::select! {
                    _ = tokio::time::sleep(delay) => {}
                    _ = shutdown.changed() => return,
                }
                delay = (delay * 2).min(Duration::from_secs(60));
            }
            // A 429 on first contact: wait at least as long as the relay asked.
            Err(RelayError::RateLimited { retry_after_ms }) => {
                delay = delay.max(Duration::from_millis(retry_after_ms));
                tracing::warn!(relay = %url, retry_in_ms = delay.as_millis() as u64, "the relay rate-limits this host; retrying");
                tokio::select! {
                    _ = tokio::time::sleep(delay) => {}
                    _ = shutdown.changed() => return,
                }
            }
            Err(e) => {
                tracing::warn!(relay = %url, error = %e, retry_in_ms = delay.as_millis() as u64, "relay key not known yet; retrying");
                tokio::select! {
                    _ = tokio::time::sleep(delay) => {}
                    _ = shutdown.changed() => return,
                }
                delay = (delay * 2).min(Duration::from_secs(60));
            }
        }
    };
    tracing::info!(relay = %url, relay_fingerprint = %key.fingerprint(), "relay transport on");
    match RelayClient::new(&url, key, ident, mailbox, clock) {
        Ok(mut client) => {
            client.received = received;
            client.account = account;
            client.instance = instance;
            client.failpoints = failpoints;
            client.stream = stream;
            run(client, pull_interval, wake, shutdown).await
        }
        Err(e) => tracing::error!(relay = %url, error = %e, "relay transport off"),
    }
}

/// One relay pass. A 401 on a signed request (push, pull, ack, enc-key) means the relay lost
/// this host's enrolment (spec §8): challenge, enrol and enc-ad publish run again in this pass
/// and the transfer is retried once; a second 401 is a refusal right after a fresh enrolment
/// (backoff and classification), a 403 the `denied` or `revoked` state.
pub async fn pass(client: &RelayClient) -> Result<(), RelayError> {
    pass_session(client, true).await.map(|_| ())
}

/// [`pass`], pulling only when `pull` is set (a pass while the push stream is up pushes only:
/// the stream delivers). Returns the session of the pass (its `stream_nonce` opens the stream).
pub async fn pass_session(
    client: &RelayClient,
    pull: bool,
) -> Result<session::Session, RelayError> {
    let mut session = client.open_session().await?;
    let result = match transfer(client, &session, pull).await {
        Err(e) if e.is_not_enrolled() => {
            tracing::warn!(relay = %client.url, error = %e, "the relay no longer knows this host: enrolling again in this pass");
            session = client.recover_enrolment().await?;
            match transfer(client, &session, pull).await {
                Err(e) if e.is_not_enrolled() => {
                    Err(client.refused_after_enrol(&session.epoch).await?)
                }
                Err(e) if e.is_auth() => Err(client.refused_by_relay(&e, &session.epoch).await?),
                other => other,
            }
        }
        Err(e) if e.is_auth() => Err(client.refused_by_relay(&e, &session.epoch).await?),
        other => other,
    };
    match &result {
        // Signed requests were accepted all through the pass: any refusal episode is over.
        Ok(()) => client.end_backoff().await?,
        Err(RelayError::Unreachable(why)) => {
            // The standing already says `unreachable`: the detail is only the cause.
            let mut st = state::RelayState::new(state::Standing::Unreachable);
            st.detail = Some(why.clone());
            client.note(st, false).await?;
        }
        Err(_) => {}
    }
    result.map(|()| session)
}

/// Pushes due rows and receipts, retries quarantined items and, when `pull` is set, pulls, in
/// that order.
async fn transfer(
    client: &RelayClient,
    session: &session::Session,
    pull: bool,
) -> Result<(), RelayError> {
    client.push_due(session).await?;
    client.push_receipts(session).await?;
    client.retry_quarantined().await?;
    if pull {
        client.pull_pass(session).await?;
    }
    Ok(())
}

pub mod pin {
    //! The relay key pin (spec §1; `wire.md` §3.5 "Key pinning"): `relay set <url>` (trust on
    //! first use, or `--key <fp>` without it) writes `[relay] key` in `config.toml` and kv
    //! `relay-key:<url>`; a daemon with neither pins the key the relay presents on first
    //! contact, or, when `relay set --key <fp>` could not reach the relay (kv
    //! `relay-key-expect:<url>`), only a key with that fingerprint. Afterwards a different
    //! served key stops relay use until the owner confirms. This module never trusts a key the
    //! owner did not name once one is pinned or expected.

    use agentmbx_protocol::clock::SharedClock;
    use agentmbx_protocol::keys::PublicKey;
    use agentmbx_protocol::wire::RelayInfo;

    use super::{state, RelayError};
    use crate::mailbox::{relay_state, Mailbox};

    /// The pinned relay key for `url`: the configured key (copied to kv `relay-key:<url>`, so
    /// the running loop and `relay info` see the same pin), else the one pinned in
    /// `mailbox.db`, else fetched now (unsigned info) and pinned: only when its fingerprint is
    /// the expected one if `relay set --key` named one, else on first use. Errors:
    /// [`RelayError::KeyMismatch`] (the relay serves another key than the expected one;
    /// recorded in the relay state and audited once per served key), network and storage
    /// errors, [`RelayError::Malformed`] for a bad configured or stored key.
    pub async fn resolve_key(
        url: &str,
        configured: Option<&str>,
        mailbox: &Mailbox,
        clock: &SharedClock,
    ) -> Result<PublicKey, RelayError> {
        let url = url.trim_end_matches('/').to_string();
        if let Some(k) = configured {
            let key = PublicKey::from_b64(k).map_err(|_| {
                RelayError::Malformed("[relay] key in config.toml is not a relay public key".into())
            })?;
            let (u, text) = (url.clone(), key.to_b64());
            mailbox
                .run(move |c| {
                    let tx = c.transaction()?;
                    if relay_state::kv_get(&tx, &state::key_kv(&u))?.as_deref() != Some(&text) {
                        relay_state::kv_set(&tx, &state::key_kv(&u), &text)?;
                    }
                    state::kv_delete(&tx, &state::expect_kv(&u))?;
                    tx.commit()?;
                    Ok(())
                })
                .await?;
            return Ok(key);
        }
        let u = url.clone();
        let (stored, expected) = mailbox
            .run(move |c| {
                Ok((
                    relay_state::kv_get(c, &state::key_kv(&u))?,
                    relay_state::kv_get(c, &state::expect_kv(&u))?,
                ))
            })
            .await?;
        if let Some(k) = stored {
            return PublicKey::from_b64(&k)
                .map_err(|_| RelayError::Malformed("stored relay key is invalid".into()));
        }
        let info = fetch_info(&url).await?;
        let key = PublicKey::from_b64(&info.relay_pubkey)
            .map_err(|_| RelayError::Malformed("relay_pubkey".into()))?;
        let served = key.fingerprint();
        if let Some(fp) = expected.filter(|fp| *fp != served) {
            let (u, f, s) = (url.clone(), fp.clone(), served.clone());
            let now = clock.now_ms();
            let new = mailbox
                .run(move |c| state::record_key_mismatch(c, &u, "expected", &f, &s, now))
                .await?;
            if new {
                tracing::error!(relay = %url, expected = %fp, served = %served,
                    "the relay presents another key than the one `relay set --key` named: not pinned, relay not used; if the operator changed it, confirm with `agentmbx relay set {url} --key {served}`");
            }
            return Err(RelayError::KeyMismatch { pinned: fp, served });
        }
        let (u, text) = (url.clone(), key.to_b64());
        let was_expected = mailbox
            .run(move |c| {
                let tx = c.transaction()?;
                relay_state::kv_set(&tx, &state::key_kv(&u), &text)?;
                let was = state::kv_delete(&tx, &state::expect_kv(&u))?;
                tx.commit()?;
                Ok(was)
            })
            .await?;
        if was_expected {
            tracing::info!(relay = %url, relay_fingerprint = %served, "pinned the relay key the owner named with `relay set --key`");
        } else {
            tracing::warn!(relay = %url, relay_fingerprint = %served, "pinned the relay key on first contact; pin it explicitly with `agentmbx relay set <url> --key <fingerprint>`");
        }
        Ok(key)
    }

    /// Unsigned `GET /v2/relay/info` (used by `relay set` and first contact), the answer read
    /// up to [`super::answer::MAX_ANSWER`] bytes.
    pub async fn fetch_info(url: &str) -> Result<RelayInfo, RelayError> {
        let client = super::http_client(std::time::Duration::from_secs(10))?;
        let resp = client
            .get(format!("{}/v2/relay/info", url.trim_end_matches('/')))
            .send()
            .await
            .map_err(|e| RelayError::Unreachable(super::describe(&e)))?;
        let status = resp.status().as_u16();
        let bytes = super::answer::read_capped(resp, super::answer::MAX_ANSWER).await?;
        if status != 200 {
            return Err(super::status_error(status, &bytes));
        }
        serde_json::from_slice(&bytes).map_err(|e| RelayError::Malformed(e.to_string()))
    }

    /// Parses a relay key pin: 16 hex digits of a fingerprint (any case; dashes, colons and
    /// spaces optional) or a full base64 public key. `None` when malformed.
    pub fn parse_pin(text: &str) -> Option<Pin> {
        if let Ok(k) = PublicKey::from_b64(text.trim()) {
            return Some(Pin::Key(k));
        }
        let hex: String = text
            .chars()
            .filter(|c| !matches!(c, '-' | ':' | ' '))
            .collect::<String>()
            .to_ascii_lowercase();
        (hex.len() == 16 && hex.chars().all(|c| c.is_ascii_hexdigit())).then(|| {
            Pin::Fingerprint(format!(
                "{}-{}-{}-{}",
                &hex[0..4],
                &hex[4..8],
                &hex[8..12],
                &hex[12..16]
            ))
        })
    }

    /// A relay key pin as given to `relay set --key`.
    #[derive(Debug, Clone, PartialEq, Eq)]
    pub enum Pin {
        /// A fingerprint `xxxx-xxxx-xxxx-xxxx`.
        Fingerprint(String),
        /// A full key.
        Key(PublicKey),
    }

    impl Pin {
        /// True when `key` is the pinned one.
        pub fn matches(&self, key: &PublicKey) -> bool {
            match self {
                Pin::Fingerprint(fp) => &key.fingerprint() == fp,
                Pin::Key(k) => k == key,
            }
        }
    }

    #[cfg(test)]
    mod tests {
        use super::*;

        #[test]
        fn pins_parse() {
            assert_eq!(
                parse_pin("ABCD:EF01 2345-6789"),
                Some(Pin::Fingerprint("abcd-ef01-2345-6789".into()))
            );
            assert_eq!(parse_pin("abcd-ef01-2345-678"), None);
            assert_eq!(parse_pin("zzzz-ef01-2345-6789"), None);
        }
    }
}
