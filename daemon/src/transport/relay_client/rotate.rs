//! Announcing this host's key rotations to its relay (`wire.md` §2.10, §3.1
//! `POST /v2/relay/rotate {rotation}`; 0.5.x `relay-rotations:<url>`).
//!
//! Each logged rotation ([`crate::identity::Identity::history`]) is sent once, oldest first, one
//! record per request, unsigned (the record proves itself with the old and the new host key).
//! The kv counter `relay-rotations:<url>` counts the records the relay has answered: 200 (it
//! moved the old key's queue, name and allowlist place to the new key) and 404 (it never knew the
//! old key: nothing to move) both advance it. After a 200 the relay has re-sequenced the moved
//! items, so this host's receive position for that relay goes back to 0 in the same transaction
//! (dedup by envelope id makes the re-pull safe). Any other answer stops the pass and is tried
//! again after [`RETRY_MS`] (or the relay's `retry_after`, at most [`RETRY_MAX_MS`]).
//!
//! Called at the start of every session ([`RelayClient::open_session`]): when nothing is owed it
//! costs one kv read. Records go only to a relay that presents the pinned key; otherwise the
//! session reports the mismatch and nothing is sent. The signed info that checks the key is
//! the pass's first and carries no account token (`session.rs`); a match confirms the key for
//! the rest of the pass.

use serde_json::json;

use agentmbx_protocol::keys::PublicKey;
use agentmbx_protocol::wire::{ErrorBody, RelayInfo};

use super::{describe, RelayClient, RelayError};
use crate::mailbox::{audit, relay_state};

/// Pause before a refused or failed announcement is tried again (ms): one minute.
pub const RETRY_MS: i64 = 60_000;
/// Longest pause before the next announcement (ms): one hour, however long a relay's
/// `retry_after` asks for (as for any relay wait, [`super::MAX_RATE_LIMIT_WAIT_MS`]).
pub const RETRY_MAX_MS: i64 = 3_600_000;

/// kv key of the number of records the relay at `url` has answered.
pub fn counter_key(url: &str) -> String {
    format!("relay-rotations:{url}")
}

/// kv key of the earliest time (ms) the next announcement to `url` may be tried, stored as
/// `<at>/<pause>` (ms; see [`waits_at`]).
pub fn next_try_key(url: &str) -> String {
    format!("relay-rotations-next:{url}")
}

/// Whether the stored next-try value `stored` (`<at>/<pause>`, or a bare `<at>` from an older
/// build, taken as paused by [`RETRY_MAX_MS`]) still holds the announcement back at `now_ms`:
/// `at` is ahead, but no further ahead than its pause. A time further ahead was written while
/// the clock was ahead of the current one (a skew fixed since): it is due now.
pub fn waits_at(stored: &str, now_ms: i64) -> bool {
    let (at, pause) = match stored.split_once('/') {
        Some((at, pause)) => (at.parse::<i64>().ok(), pause.parse::<i64>().ok()),
        None => (stored.parse::<i64>().ok(), Some(RETRY_MAX_MS)),
    };
    match (at, pause) {
        (Some(at), Some(pause)) => at > now_ms && at.saturating_sub(now_ms) <= pause,
        _ => false,
    }
}

fn fingerprint(b64: &str) -> String {
    PublicKey::from_b64(b64)
        .map(|k| k.fingerprint())
        .unwrap_or_default()
}

impl RelayClient {
    /// Sends every rotation record the relay has not answered yet, in order (module docs).
    /// Returns how many records it answered in this call. A refused or unreachable relay is
    /// logged and tried again later, not an error. Errors: only the host store failing.
    pub async fn announce_rotations(&self) -> Result<usize, RelayError> {
        let records = &self.ident.history.rotations;
        if records.is_empty() {
            return Ok(0);
        }
        let (url, now) = (self.url.clone(), self.clock.now_ms());
        let (sent, next_try) = self
            .mailbox
            .run(move |c| {
                let sent = relay_state::kv_get(c, &counter_key(&url))?;
                let next = relay_state::kv_get(c, &next_try_key(&url))?;
                Ok((sent, next))
            })
            .await?;
        let sent: usize = sent.and_then(|s| s.parse().ok()).unwrap_or(0);
        if sent >= records.len() || next_try.is_some_and(|n| waits_at(&n, now)) {
            return Ok(0);
        }
        match self
            .call_json::<RelayInfo>("GET", "/v2/relay/info", "")
            .await
        {
            // The pinned key: the account token may go with later requests of this pass.
            Ok(info) if info.relay_pubkey == self.relay_key.to_b64() => self.confirm_relay_key(),
            Ok(_) => {
                self.unconfirm_relay_key();
                return Ok(0); // the session stops on the key mismatch
            }
            Err(e) => {
                self.defer_rotations(RETRY_MS, &e.to_string()).await?;
                return Ok(0);
            }
        }
        let mut answered = 0;
        for (i, record) in records.iter().enumerate().skip(sent) {
            let body = json!({ "rotation": record }).to_string();
            let (status, bytes) = match self.post_rotation(&body).await {
                Ok(answer) => answer,
                Err(e) => {
                    self.defer_rotations(RETRY_MS, &e.to_string()).await?;
                    break;
                }
            };
            if status != 200 && status != 404 {
                let err: Option<ErrorBody> = serde_json::from_slice(&bytes).ok();
                let wait = err
                    .as_ref()
                    .and_then(|b| b.retry_after)
                    .map_or(RETRY_MS, |s| (s as i64).saturating_mul(1000).max(1000));
                let why = err.map_or_else(
                    || format!("relay answered {status}"),
                    |b| format!("relay answered {status}: {}", b.error),
                );
                self.defer_rotations(wait, &why).await?;
                break;
            }
            let (url, now) = (self.url.clone(), self.clock.now_ms());
            let detail = json!({
                "relay": url,
                "from": fingerprint(&record.rec.old_pub),
                "to": fingerprint(&record.rec.new_pub),
                "status": status,
            });
            let count = i + 1;
            self.mailbox
                .run(move |c| {
                    let tx = c.transaction()?;
                    relay_state::kv_set(&tx, &counter_key(&url), &count.to_string())?;
                    if status == 200 {
                        if let Some(p) = relay_state::position(&tx, &url)? {
                            relay_state::reset(&tx, &url, &p.epoch, now)?;
                        }
                    }
                    audit::record(&tx, now, "relay.rotation_sent", &detail)?;
                    tx.commit()?;
                    Ok(())
                })
                .await?;
            tracing::info!(relay = %self.url, status, "relay answered this host's key rotation");
            answered += 1;
        }
        Ok(answered)
    }

    /// Plain `POST /v2/relay/rotate` (the record authenticates itself; no hop); the answer is
    /// read up to [`super::answer::MAX_ANSWER`] bytes (else [`RelayError::Malformed`]).
    async fn post_rotation(&self, body: &str) -> Result<(u16, bytes::Bytes), RelayError> {
        let resp = self
            .http
            .post(format!("{}/v2/relay/rotate", self.url))
            .header("content-type", "application/json")
            .body(body.to_string())
            .send()
            .await
            .map_err(|e| RelayError::Unreachable(describe(&e)))?;
        let status = resp.status().as_u16();
        let bytes = super::answer::read_capped(resp, super::answer::MAX_ANSWER).await?;
        Ok((status, bytes))
    }

    async fn defer_rotations(&self, wait_ms: i64, why: &str) -> Result<(), RelayError> {
        let wait_ms = wait_ms.clamp(0, RETRY_MAX_MS);
        tracing::warn!(relay = %self.url, error = %why, retry_in_ms = wait_ms, "key rotation not announced to the relay yet");
        let (url, at) = (
            self.url.clone(),
            self.clock.now_ms().saturating_add(wait_ms),
        );
        self.mailbox
            .run(move |c| relay_state::kv_set(c, &next_try_key(&url), &format!("{at}/{wait_ms}")))
            .await?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::{Arc, Mutex};

    use axum::extract::State;
    use axum::http::{Method, StatusCode, Uri};
    use axum::{Json, Router};
    use serde_json::Value;

    use agentmbx_protocol::clock::{Clock, ManualClock};
    use agentmbx_protocol::keys::{EncKey, HostKey};
    use agentmbx_protocol::rotation::SignedRotation;
    use agentmbx_protocol::time::iso_ms;

    use crate::identity::{Identity, KeyHistory};
    use crate::testutil::{self, T0};

    #[derive(Default)]
    struct Fake {
        /// `(method path, body)` of every request.
        log: Vec<(String, Value)>,
        /// Status answered to `POST /v2/relay/rotate`, front first (the last repeats).
        rotate: Vec<u16>,
        /// The `you` object `GET /v2/relay/info` answers (None: not enrolled).
        you: Option<Value>,
    }

    type Shared = Arc<Mutex<Fake>>;

    fn limits() -> Value {
        json!({"max_item_bytes": 1, "max_batch": 1, "max_pull": 1, "max_pull_bytes": 1,
               "max_targets": 1, "retention_days": 1, "max_queue_items": 1, "max_queue_bytes": 1,
               "max_sender_items": 1, "max_sender_bytes": 1, "max_owner_items": 1,
               "max_owner_bytes": 1})
    }

    async fn serve(relay_key: PublicKey, fake: Shared) -> String {
        crate::install_tls_provider();
        async fn handle(
            State((key, fake)): State<(PublicKey, Shared)>,
            method: Method,
            uri: Uri,
            body: axum::body::Bytes,
        ) -> (StatusCode, Json<Value>) {
            let body: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
            let route = format!("{method} {}", uri.path());
            let mut f = fake.lock().unwrap();
            f.log.push((route.clone(), body));
            let (code, answer) = match route.as_str() {
                "GET /v2/relay/info" => {
                    let mut info = json!({"v": 2, "relay_pubkey": key.to_b64(), "epoch": "e1",
                                          "version": "t", "limits": limits()});
                    if let Some(you) = &f.you {
                        info["you"] = you.clone();
                    }
                    (200, info)
                }
                "POST /v2/relay/rotate" => {
                    let code = if f.rotate.len() > 1 {
                        f.rotate.remove(0)
                    } else {
                        f.rotate[0]
                    };
                    let body = if code == 200 {
                        json!({"moved": 2})
                    } else {
                        json!({"error": "nope", "code": "X"})
                    };
                    (code, body)
                }
                _ if method == Method::POST => (200, json!({"ok": true})),
                _ => (404, json!({"error": "not found"})),
            };
            (StatusCode::from_u16(code).unwrap(), Json(answer))
        }
        let app = Router::new().fallback(handle).with_state((relay_key, fake));
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move {
            let _ = axum::serve(listener, app).await;
        });
        format!("http://{addr}")
    }

    /// `alpha` after one rotation: its new keys, the old ones retired, the record logged.
    fn rotated() -> (Identity, HostKey, EncKey) {
        let old_host = HostKey::generate();
        let old_enc = EncKey::generate();
        let new = testutil::identity("alpha");
        let record =
            SignedRotation::sign("alpha", &old_host, &new.host_key, &new.enc_key.public(), T0);
        let ident = Identity {
            history: KeyHistory {
                retired_host: vec![old_host.public()],
                retired_enc: vec![old_enc.clone()],
                rotations: vec![record],
            },
            ..new
        };
        (ident, old_host, old_enc)
    }

    fn rotate_posts(fake: &Shared) -> Vec<Value> {
        fake.lock()
            .unwrap()
            .log
            .iter()
            .filter(|(r, _)| r == "POST /v2/relay/rotate")
            .map(|(_, b)| b.clone())
            .collect()
    }

    #[tokio::test]
    async fn a_relay_that_moved_the_queue_resets_the_receive_position_once() {
        let (ident, old_host, old_enc) = rotated();
        let relay_key = HostKey::generate();
        let fake: Shared = Arc::new(Mutex::new(Fake {
            rotate: vec![503, 200],
            ..Fake::default()
        }));
        let url = serve(relay_key.public(), fake.clone()).await;
        let store = testutil::store();
        let clock = Arc::new(ManualClock::new(T0));
        store
            .mailbox
            .with(|c| relay_state::set_received_through(c, &url, "e1", 41, T0))
            .unwrap();
        let client = RelayClient::new(
            &url,
            relay_key.public(),
            Arc::new(ident.clone()),
            store.mailbox.clone(),
            clock.clone(),
        )
        .unwrap();

        // A 503 keeps the counter and the position, and defers the next try by a minute.
        assert_eq!(client.announce_rotations().await.unwrap(), 0);
        assert_eq!(rotate_posts(&fake).len(), 1);
        assert_eq!(client.announce_rotations().await.unwrap(), 0);
        assert_eq!(rotate_posts(&fake).len(), 1, "not before the minute is up");
        let pos = store
            .mailbox
            .with(|c| relay_state::position(c, &url))
            .unwrap()
            .unwrap();
        assert_eq!(pos.received_through, 41);

        clock.advance(RETRY_MS);
        assert_eq!(client.announce_rotations().await.unwrap(), 1);
        let posts = rotate_posts(&fake);
        assert_eq!(posts.len(), 2);
        assert_eq!(
            posts[1],
            json!({"rotation": serde_json::to_value(&ident.history.rotations[0]).unwrap()})
        );
        assert_eq!(
            posts[1]["rotation"]["rec"]["old_pub"],
            old_host.public().to_b64()
        );
        let pos = store
            .mailbox
            .with(|c| relay_state::position(c, &url))
            .unwrap()
            .unwrap();
        assert_eq!(
            (pos.epoch.as_str(), pos.received_through, pos.acked_through),
            ("e1", 0, 0)
        );
        let counter = store
            .mailbox
            .with(|c| relay_state::kv_get(c, &counter_key(&url)))
            .unwrap();
        assert_eq!(counter.as_deref(), Some("1"));
        let events = store
            .mailbox
            .with(|c| audit::recent(c, Some("relay.rotation_sent"), 5))
            .unwrap();
        assert_eq!(events.len(), 1);
        assert_eq!(events[0].detail["from"], old_host.public().fingerprint());
        assert!(!events[0]
            .detail
            .to_string()
            .contains(&old_enc.private_b64_secret()));

        // Taken: later sessions send nothing, even when time passes.
        clock.advance(10 * RETRY_MS);
        store
            .mailbox
            .with(|c| relay_state::set_received_through(c, &url, "e1", 7, clock.now_ms()))
            .unwrap();
        assert_eq!(client.announce_rotations().await.unwrap(), 0);
        assert_eq!(rotate_posts(&fake).len(), 2);
        let pos = store
            .mailbox
            .with(|c| relay_state::position(c, &url))
            .unwrap()
            .unwrap();
        assert_eq!(pos.received_through, 7, "only a 200 of a new record resets");
    }

    #[tokio::test]
    async fn a_relay_that_never_knew_the_old_key_answers_404_and_the_position_stays() {
        let (ident, _, _) = rotated();
        let relay_key = HostKey::generate();
        let fake: Shared = Arc::new(Mutex::new(Fake {
            rotate: vec![404],
            ..Fake::default()
        }));
        let url = serve(relay_key.public(), fake.clone()).await;
        let store = testutil::store();
        store
            .mailbox
            .with(|c| relay_state::set_received_through(c, &url, "e1", 5, T0))
            .unwrap();
        let client = RelayClient::new(
            &url,
            relay_key.public(),
            Arc::new(ident),
            store.mailbox.clone(),
            testutil::clock(),
        )
        .unwrap();
        assert_eq!(client.announce_rotations().await.unwrap(), 1);
        assert_eq!(client.announce_rotations().await.unwrap(), 0);
        assert_eq!(rotate_posts(&fake).len(), 1);
        let pos = store
            .mailbox
            .with(|c| relay_state::position(c, &url))
            .unwrap()
            .unwrap();
        assert_eq!(pos.received_through, 5);
    }

    #[tokio::test]
    async fn a_relay_with_another_key_is_not_told() {
        let (ident, _, _) = rotated();
        let fake: Shared = Arc::new(Mutex::new(Fake {
            rotate: vec![200],
            ..Fake::default()
        }));
        let url = serve(HostKey::generate().public(), fake.clone()).await;
        let store = testutil::store();
        let client = RelayClient::new(
            &url,
            HostKey::generate().public(),
            Arc::new(ident),
            store.mailbox.clone(),
            testutil::clock(),
        )
        .unwrap();
        assert_eq!(client.announce_rotations().await.unwrap(), 0);
        assert!(rotate_posts(&fake).is_empty());
    }

    #[tokio::test]
    async fn after_a_rotation_the_session_announces_it_and_republishes_the_enc_ad() {
        let (ident, _, old_enc) = rotated();
        let relay_key = HostKey::generate();
        // The relay moved the enrolment to the new key; its ad still names the old enc key.
        let you = json!({"host": "alpha", "pubkey": ident.host_key.public().to_b64(),
                         "head_seq": 0, "acked_through": 0,
                         "enc_ad": {"enc_pub": old_enc.public().to_b64(),
                                    "exp": iso_ms(T0 + 29 * 86_400_000), "v1": false}});
        let fake: Shared = Arc::new(Mutex::new(Fake {
            rotate: vec![200],
            you: Some(you),
            ..Fake::default()
        }));
        let url = serve(relay_key.public(), fake.clone()).await;
        let store = testutil::store();
        let client = RelayClient::new(
            &url,
            relay_key.public(),
            Arc::new(ident.clone()),
            store.mailbox.clone(),
            testutil::clock(),
        )
        .unwrap();
        client.open_session().await.unwrap();
        let log = fake.lock().unwrap().log.clone();
        let routes: Vec<&str> = log.iter().map(|(r, _)| r.as_str()).collect();
        let rotate_at = routes.iter().position(|r| *r == "POST /v2/relay/rotate");
        let ad_at = routes.iter().position(|r| *r == "POST /v2/relay/enc-key");
        assert!(rotate_at.is_some() && ad_at.is_some(), "{routes:?}");
        assert!(rotate_at < ad_at, "the rotation goes first: {routes:?}");
        let (_, body) = &log[ad_at.unwrap()];
        let ad = &body["ad"];
        assert_eq!(ad["enc_pub"], ident.enc_key.public().to_b64());
        assert_eq!(ad["host_pubkey"], ident.host_key.public().to_b64());
        let text = agentmbx_protocol::canonical::of(ad).unwrap();
        assert!(ident
            .host_key
            .public()
            .verify(text.as_bytes(), body["sig"].as_str().unwrap()));
        // The next session neither announces again nor enrols.
        fake.lock().unwrap().log.clear();
        client.open_session().await.unwrap();
        let routes: Vec<String> = fake
            .lock()
            .unwrap()
            .log
            .iter()
            .map(|(r, _)| r.clone())
            .collect();
        assert!(
            !routes
                .iter()
                .any(|r| r.contains("rotate") || r.contains("enrol")),
            "{routes:?}"
        );
    }

    /// Case `clock-fix-does-not-release-mail`: a retry put off by a minute while the clock was
    /// 10 min ahead is due once the clock is right; one put off at the right clock waits.
    #[test]
    fn a_retry_put_off_under_a_clock_ahead_is_due_once_the_clock_is_right() {
        let skewed = format!("{}/{RETRY_MS}", T0 + 600_000 + RETRY_MS);
        assert!(waits_at(&skewed, T0 + 600_000));
        assert!(!waits_at(&skewed, T0));
        let right = format!("{}/{RETRY_MS}", T0 + RETRY_MS);
        assert!(waits_at(&right, T0));
        assert!(!waits_at(&right, T0 + RETRY_MS));
        // An older bare time is held to the longest pause.
        assert!(waits_at(&(T0 + RETRY_MAX_MS).to_string(), T0));
        assert!(!waits_at(&(T0 + RETRY_MAX_MS + 1).to_string(), T0));
        assert!(!waits_at("junk", T0));
    }

    #[tokio::test]
    async fn an_oversized_answer_to_the_rotation_is_no_answer() {
        use crate::transport::relay_client::answer::{raw, MAX_ANSWER};
        crate::install_tls_provider();
        let (ident, _, _) = rotated();
        let relay_key = HostKey::generate();
        let info = json!({"v": 2, "relay_pubkey": relay_key.public().to_b64(), "epoch": "e1",
                          "version": "t", "limits": limits()})
        .to_string()
        .into_bytes();
        // A 200 whose body streams past the cap: the relay cannot fill this host's memory, and
        // the record counts as not answered.
        let (url, task) = raw::serve(move |route| {
            if route.starts_with("POST /v2/relay/rotate") {
                raw::RawAnswer::ok(raw::json_of_len(MAX_ANSWER + 1), true)
            } else {
                raw::RawAnswer::ok(info.clone(), false)
            }
        })
        .await;
        let store = testutil::store();
        let clock = Arc::new(ManualClock::new(T0));
        let client = RelayClient::new(
            &url,
            relay_key.public(),
            Arc::new(ident),
            store.mailbox.clone(),
            clock.clone(),
        )
        .unwrap();
        assert_eq!(client.announce_rotations().await.unwrap(), 0);
        let (counter, next) = store
            .mailbox
            .with(|c| {
                Ok((
                    relay_state::kv_get(c, &counter_key(&url))?,
                    relay_state::kv_get(c, &next_try_key(&url))?,
                ))
            })
            .unwrap();
        assert_eq!(counter, None, "not counted as answered");
        assert_eq!(
            next,
            Some(format!("{}/{RETRY_MS}", T0 + RETRY_MS)),
            "tried again later"
        );
        task.abort();
    }
}
