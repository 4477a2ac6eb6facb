//! HTTP-level tests of the relay's answers to abuse (spec §2, §8; `wire.md` §2.10, §3.2,
//! "Resolved details" → "Rate limits"): open enrolment challenges per client address (503
//! `BUSY` with `Retry-After`), rotation records that are not objects or are dated ahead, and
//! the admin endpoints' rate limit and bounded warnings. The real router and `server::serve`
//! run on 127.0.0.1 port 0 over a fresh store, driven by a manual clock.
#![allow(clippy::unwrap_used)] // Tests may unwrap (clippy.toml); the helpers use `expect`.

mod helper;

use std::sync::{Arc, Mutex};

use serde_json::{json, Value};

use agentmbx_protocol::rotation::{SignedRotation, FUTURE_SKEW_MS};

use agentmbx_relay::authority::challenge::{CHALLENGE_TTL_MS, MAX_CHALLENGES_PER_ADDRESS};
use agentmbx_relay::config::{AdminToken, RelayConfig};
use agentmbx_relay::ratelimit::{RateConfig, ADMIN_PER_MIN};

use helper::*;

const ADMIN: &str = "admin-token-0123456789abcdef";

/// A relay that takes the client address from `X-Forwarded-For`, with room for many
/// challenges a minute per address and an admin token.
async fn relay() -> Relay {
    Relay::start_with_config(RelayConfig {
        rate: RateConfig {
            enrol_per_min: 100_000,
            ..RateConfig::default()
        },
        trust_proxy: Some("xff".into()),
        admin_token: Some(AdminToken::new(ADMIN).unwrap()),
        ..RelayConfig::default()
    })
    .await
}

/// An answer with its `Retry-After` header.
#[derive(Debug)]
struct Answer {
    status: u16,
    retry_after: Option<String>,
    json: Value,
}

/// A request from client address `from` (`X-Forwarded-For`) with a JSON body and extra
/// headers.
async fn call(
    relay: &Relay,
    method: &str,
    target: &str,
    from: &str,
    headers: &[(&str, &str)],
    body: &str,
) -> Answer {
    let http = reqwest::Client::builder().no_proxy().build().unwrap();
    let method = reqwest::Method::from_bytes(method.as_bytes()).unwrap();
    let mut req = http
        .request(method, format!("{}{target}", relay.base))
        .header("content-type", "application/json")
        .header("x-forwarded-for", from);
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    if !body.is_empty() {
        req = req.body(body.to_owned());
    }
    let res = req.send().await.unwrap();
    let status = res.status().as_u16();
    let retry_after = res
        .headers()
        .get("retry-after")
        .map(|v| v.to_str().unwrap().to_owned());
    let text = res.text().await.unwrap();
    Answer {
        status,
        retry_after,
        json: serde_json::from_str(&text).unwrap_or(Value::Null),
    }
}

/// `POST /v1/relay/challenge` for a fresh key from `from`.
async fn challenge_from(relay: &Relay, from: &str) -> Answer {
    let h = Host::new("mac");
    let body = json!({"host": h.name, "pubkey": h.pubkey()}).to_string();
    call(relay, "POST", "/v1/relay/challenge", from, &[], &body).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_address_holds_at_most_32_open_challenges_then_503_with_retry_after() {
    let relay = relay().await;
    assert_eq!(MAX_CHALLENGES_PER_ADDRESS, 32);
    // One a second from one address: all 32 are handed out.
    for i in 0..MAX_CHALLENGES_PER_ADDRESS {
        let a = challenge_from(&relay, "203.0.113.7").await;
        assert_eq!(a.status, 200, "challenge {i}: {a:#?}");
        relay.clock.advance(1_000);
    }
    // The 33rd: 503 BUSY, retry when the oldest (issued 32 s ago) expires.
    let a = challenge_from(&relay, "203.0.113.7").await;
    let wait = (CHALLENGE_TTL_MS - 32_000) / 1_000;
    assert_eq!(a.status, 503, "{a:#?}");
    assert_eq!(a.json["code"], "BUSY", "{a:#?}");
    assert_eq!(a.json["retry_after"], wait, "{a:#?}");
    assert_eq!(a.retry_after, Some(wait.to_string()), "{a:#?}");
    // Other addresses are served; an IPv6 /64 counts as one address.
    assert_eq!(challenge_from(&relay, "198.51.100.1").await.status, 200);
    for i in 1..=MAX_CHALLENGES_PER_ADDRESS {
        let from = format!("2001:db8:1:2::{i:x}");
        assert_eq!(challenge_from(&relay, &from).await.status, 200, "{from}");
    }
    let a = challenge_from(&relay, "2001:db8:1:2::ffff").await;
    assert_eq!((a.status, a.json["code"].as_str()), (503, Some("BUSY")));
    assert_eq!(challenge_from(&relay, "2001:db8:1:3::1").await.status, 200);
    // Once the oldest expired, the first address may ask again: one more.
    relay.clock.advance(CHALLENGE_TTL_MS - 32_000);
    assert_eq!(challenge_from(&relay, "203.0.113.7").await.status, 200);
    let a = challenge_from(&relay, "203.0.113.7").await;
    assert_eq!(a.status, 503, "{a:#?}");
    assert_eq!(a.retry_after.as_deref(), Some("1"), "{a:#?}");
    relay.stop().await;
}

/// `POST /v2/relay/rotate {rotation}` (no hop).
async fn post(relay: &Relay, rotation: Value) -> Resp {
    let body = json!({ "rotation": rotation }).to_string();
    relay.plain("POST", "/v2/relay/rotate", &body).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rotation_bodies_that_are_not_objects_and_records_dated_ahead_are_400() {
    let relay = relay().await;
    let (old, new) = (Host::new("laptop"), Host::new("laptop"));
    relay.enrol(&old).await;
    for body in [
        json!({"rotation": "x"}),
        json!({"rotation": [1, 2]}),
        json!({"rotation": null}),
        json!({"rotation": 7}),
    ] {
        let r = relay
            .plain("POST", "/v2/relay/rotate", &body.to_string())
            .await;
        r.assert_error(400, "not a rotation record", "BAD_ROTATION");
    }
    let now = relay.now();
    let at = |iat: i64| {
        let r = SignedRotation::sign("laptop", &old.key, &new.key, &new.enc.public(), iat);
        serde_json::to_value(r).unwrap()
    };
    post(&relay, at(now + FUTURE_SKEW_MS + 1))
        .await
        .assert_error(
            400,
            "rotation is dated more than 5 minutes ahead",
            "BAD_ROTATION",
        );
    let mut extra = at(now);
    extra["note"] = "x".into();
    post(&relay, extra)
        .await
        .assert_error(400, "not a rotation record", "BAD_ROTATION");
    // Nothing moved; at the bound it is taken.
    assert!(
        relay
            .with_store({
                let k = old.pubkey();
                move |s| !s.enrolment(&k).unwrap().unwrap().is_revoked()
            })
            .await
    );
    let ok = post(&relay, at(now + FUTURE_SKEW_MS)).await;
    assert_eq!(ok.assert_ok(), &json!({"moved": 0}));
    relay.stop().await;
}

/// Log lines written on this thread while the guard lives (a current-thread test runtime runs
/// the server's tasks here too).
#[derive(Clone, Default)]
struct Captured(Arc<Mutex<Vec<u8>>>);

impl std::io::Write for Captured {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl Captured {
    fn count(&self, level: &str, text: &str) -> usize {
        String::from_utf8_lossy(&self.0.lock().unwrap())
            .lines()
            .filter(|l| l.contains(level) && l.contains(text))
            .count()
    }
}

#[tokio::test]
async fn admin_routes_are_rate_limited_per_address_and_wrong_tokens_warned_once_a_minute() {
    let log = Captured::default();
    let writer = log.clone();
    let subscriber = tracing_subscriber::fmt()
        .with_max_level(tracing::Level::DEBUG)
        .with_ansi(false)
        .with_writer(move || writer.clone())
        .finish();
    let _guard = tracing::subscriber::set_default(subscriber);
    let relay = relay().await;
    let right = format!("Bearer {ADMIN}");
    const WRONG: &str = "Bearer wrong-token-0123456789abcdef";
    let list = |from: &'static str, token: &str| {
        let (relay, auth) = (&relay, token.to_owned());
        async move {
            let headers = [("authorization", auth.as_str())];
            call(relay, "GET", "/v2/relay/admin/deny", from, &headers, "").await
        }
    };
    for i in 0..ADMIN_PER_MIN {
        let a = list("192.0.2.66", WRONG).await;
        assert_eq!(a.status, 401, "guess {i}: {a:#?}");
    }
    // Past the budget: 429 with Retry-After, the token is not even looked at.
    let a = list("192.0.2.66", &right).await;
    assert_eq!(a.status, 429, "{a:#?}");
    assert_eq!(a.json["code"], "RATE_LIMIT");
    assert_eq!(a.retry_after.as_deref(), Some("2"), "{a:#?}");
    // Another address is served.
    let a = list("192.0.2.1", &right).await;
    assert_eq!(a.status, 200, "{a:#?}");
    // Thirty wrong tokens: one warning, the rest at debug.
    let refused = "admin request refused";
    assert_eq!(log.count("WARN", refused), 1);
    assert_eq!(log.count("DEBUG", refused), (ADMIN_PER_MIN - 1) as usize);
    // A minute later: budget and warning are back.
    relay.clock.advance(60_000);
    assert_eq!(list("192.0.2.66", WRONG).await.status, 401);
    assert_eq!(log.count("WARN", refused), 2);
    relay.stop().await;
}
