//! The host side of the durable relay (spec §1, §3, §4, §8; `wire.md` §3.5).
//!
//! - [`session`]: signed info, relay key pinning check, enrolment and enc-key ad publishing;
//! - [`push`]: sealing each outbox row for its target once, pushing, and settling rows only on
//!   a verified accept receipt;
//! - [`pull`]: pulling after `received_through`, receiving in seq order with the checkpoint in
//!   the last item's transaction, quarantine, then the transport ack.
//!
//! Every request carries the v2 signed hop ([`agentmbx_protocol::hop`]). This module never
//! trusts the relay for content: peers' enc keys come only from ads signed by their pinned host
//! key, accepts only count when signed by the pinned relay key.

pub mod pull;
pub mod push;
pub mod session;

#[cfg(test)]
mod tests;

use std::sync::Arc;
use std::time::Duration;

use agentmbx_protocol::clock::SharedClock;
use agentmbx_protocol::hop;
use agentmbx_protocol::keys::PublicKey;
use agentmbx_protocol::wire::ErrorBody;

use crate::identity::Identity;
use crate::mailbox::{Mailbox, MailboxError};

/// Longest pause between relay passes after failures (ms): 10 s, so mail waiting while the
/// relay was down moves within seconds of its return (a new send wakes the loop at once).
pub const MAX_RETRY_DELAY_MS: u64 = 10_000;

/// Client timeout of one relay request (`wire.md` §2.6: 15 s for v2).
pub const REQUEST_TIMEOUT: Duration = Duration::from_secs(15);

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
    /// Local storage failed.
    #[error(transparent)]
    Store(#[from] MailboxError),
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
        let http = reqwest::Client::builder()
            .timeout(REQUEST_TIMEOUT)
            .redirect(reqwest::redirect::Policy::none())
            .build()
            .map_err(|e| RelayError::Unreachable(describe(&e)))?;
        Ok(RelayClient {
            http,
            url: url.trim_end_matches('/').to_string(),
            relay_key,
            ident,
            mailbox,
            clock,
            received: None,
        })
    }

    /// Sends a signed v2 hop `method target` with `body` (empty for GET) and returns the status
    /// and raw body. `target` must already be normalised (path + query).
    pub async fn call(
        &self,
        method: &str,
        target: &str,
        body: &str,
    ) -> Result<(u16, bytes::Bytes), RelayError> {
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
        let resp = req
            .send()
            .await
            .map_err(|e| RelayError::Unreachable(describe(&e)))?;
        let status = resp.status().as_u16();
        let bytes = resp
            .bytes()
            .await
            .map_err(|e| RelayError::Unreachable(describe(&e)))?;
        Ok((status, bytes))
    }

    /// Like [`Self::call`], but a non-2xx status becomes [`RelayError::Status`] and the body is
    /// parsed as `T`.
    pub async fn call_json<T: serde::de::DeserializeOwned>(
        &self,
        method: &str,
        target: &str,
        body: &str,
    ) -> Result<T, RelayError> {
        let (status, bytes) = self.call(method, target, body).await?;
        if !(200..300).contains(&status) {
            return Err(status_error(status, &bytes));
        }
        serde_json::from_slice(&bytes).map_err(|e| RelayError::Malformed(e.to_string()))
    }
}

/// A network error in one line a person can act on: what failed, then the root cause (e.g.
/// `cannot connect to the relay: Connection refused (os error 111)`), without repeating the URL.
pub fn describe(e: &reqwest::Error) -> String {
    use std::error::Error as _;
    let mut root: Option<String> = None;
    let mut source = e.source();
    while let Some(s) = source {
        root = Some(s.to_string());
        source = s.source();
    }
    let what = if e.is_timeout() {
        "timed out"
    } else if e.is_connect() {
        "cannot connect"
    } else if e.is_body() || e.is_decode() {
        "the answer broke off"
    } else {
        "request failed"
    };
    match root {
        Some(r) if !e.is_timeout() => format!("{what}: {r}"),
        _ => what.to_string(),
    }
}

/// Turns an error answer into [`RelayError::Status`].
pub fn status_error(status: u16, bytes: &[u8]) -> RelayError {
    let body: Option<ErrorBody> = serde_json::from_slice(bytes).ok();
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

/// Runs the relay loop until `shutdown`: open a session, push due rows, pull and ack; then wait
/// for `wake` (a new outbox row), the next due row or `pull_interval`, whichever comes first.
/// Failures are logged and retried on the next pass with a doubling delay (≤ 10 s); a relay key
/// mismatch stops relay use for good until the owner confirms the key and restarts.
pub async fn run(
    client: RelayClient,
    pull_interval: Duration,
    wake: Arc<tokio::sync::Notify>,
    mut shutdown: tokio::sync::watch::Receiver<bool>,
) {
    let mut failures: u32 = 0;
    loop {
        if *shutdown.borrow() {
            return;
        }
        let delay = match pass(&client).await {
            Ok(()) => {
                if failures > 0 {
                    tracing::info!(relay = %client.url, after_failures = failures, "relay reachable again");
                }
                failures = 0;
                // Only what the relay takes (spec §10): rows the LAN takes must not spin this loop.
                let next_due = client
                    .mailbox
                    .run(|c| {
                        let rows = crate::mailbox::outbox::next_due_for_relay(c)?;
                        let receipts = crate::mailbox::receipts::next_due_for_relay(c)?;
                        Ok(rows.into_iter().chain(receipts).min())
                    })
                    .await
                    .ok()
                    .flatten();
                let now = client.clock.now_ms();
                let until_due = next_due.map_or(pull_interval, |t| {
                    Duration::from_millis((t - now).max(0) as u64)
                });
                until_due.min(pull_interval)
            }
            Err(RelayError::KeyMismatch { pinned, served }) => {
                tracing::error!(relay = %client.url, pinned = %pinned, served = %served,
                    "relay key changed: relay use stopped; confirm with `agentmbx relay set {} --key {served}` and restart", client.url);
                let _ = shutdown.changed().await;
                return;
            }
            Err(e) => {
                failures = failures.saturating_add(1);
                tracing::warn!(relay = %client.url, error = %e, "relay pass failed; retrying");
                Duration::from_millis((500u64 << failures.min(7)).min(MAX_RETRY_DELAY_MS))
            }
        };
        tokio::select! {
            _ = tokio::time::sleep(delay) => {}
            _ = wake.notified() => {}
            _ = shutdown.changed() => return,
        }
    }
}

/// Starts the relay transport for `url`: resolves the pinned key (the configured one, the one
/// pinned on first contact, or — when the relay cannot be reached yet — retried with a doubling
/// delay up to 60 s, so a relay that is down at daemon start is used once it is up), then
/// [`run`]s until `shutdown`. `received` is notified when a pull stored new mail or queued receipts again
/// ([`RelayClient::received`]).
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
    mut shutdown: tokio::sync::watch::Receiver<bool>,
) {
    let mut delay = Duration::from_millis(500);
    let key = loop {
        match pin::resolve_key(&url, configured_key.as_deref(), &mailbox).await {
            Ok(k) => break k,
            Err(e @ (RelayError::Malformed(_) | RelayError::Store(_))) => {
                tracing::error!(relay = %url, error = %e, "relay transport off");
                return;
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
            run(client, pull_interval, wake, shutdown).await
        }
        Err(e) => tracing::error!(relay = %url, error = %e, "relay transport off"),
    }
}

async fn pass(client: &RelayClient) -> Result<(), RelayError> {
    let session = client.open_session().await?;
    client.push_due(&session).await?;
    client.push_receipts(&session).await?;
    client.retry_quarantined().await?;
    client.pull_pass(&session).await?;
    Ok(())
}

pub mod pin {
    //! The relay key pin (spec §1): `relay set <url> --key <fp>` or the first contact pins it;
    //! afterwards a different served key stops relay use until the owner confirms.

    use agentmbx_protocol::keys::PublicKey;
    use agentmbx_protocol::wire::RelayInfo;

    use super::RelayError;
    use crate::mailbox::{relay_state, Mailbox};

    /// The pinned relay key for `url`: the configured key, else the one pinned in `mailbox.db`
    /// on first contact, else fetched now (unsigned info) and pinned (trust on first use).
    pub async fn resolve_key(
        url: &str,
        configured: Option<&str>,
        mailbox: &Mailbox,
    ) -> Result<PublicKey, RelayError> {
        if let Some(k) = configured {
            return PublicKey::from_b64(k).map_err(|_| {
                RelayError::Malformed("[relay] key in config.toml is not a relay public key".into())
            });
        }
        let kv_key = format!("relay-key:{}", url.trim_end_matches('/'));
        let k2 = kv_key.clone();
        if let Some(k) = mailbox.run(move |c| relay_state::kv_get(c, &k2)).await? {
            return PublicKey::from_b64(&k)
                .map_err(|_| RelayError::Malformed("stored relay key is invalid".into()));
        }
        let info = fetch_info(url).await?;
        let key = PublicKey::from_b64(&info.relay_pubkey)
            .map_err(|_| RelayError::Malformed("relay_pubkey".into()))?;
        let text = key.to_b64();
        mailbox
            .run(move |c| relay_state::kv_set(c, &kv_key, &text))
            .await?;
        tracing::warn!(relay = %url, relay_fingerprint = %key.fingerprint(), "pinned the relay key on first contact; pin it explicitly with `agentmbx relay set <url> --key <fingerprint>`");
        Ok(key)
    }

    /// Unsigned `GET /v2/relay/info` (used by `relay set` and first contact).
    pub async fn fetch_info(url: &str) -> Result<RelayInfo, RelayError> {
        let client = reqwest::Client::builder()
            .timeout(std::time::Duration::from_secs(10))
            .redirect(reqwest::redirect::Policy::none())
            .build()
            .map_err(|e| RelayError::Unreachable(super::describe(&e)))?;
        let resp = client
            .get(format!("{}/v2/relay/info", url.trim_end_matches('/')))
            .send()
            .await
            .map_err(|e| RelayError::Unreachable(super::describe(&e)))?;
        let status = resp.status().as_u16();
        let bytes = resp
            .bytes()
            .await
            .map_err(|e| RelayError::Unreachable(super::describe(&e)))?;
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
