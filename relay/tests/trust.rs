//! HTTP-level tests of the relay's trust rules (spec §2, §7, §8; `wire.md` §2.10, §2.12, §3.1,
//! §3.2, "Resolved details" → "Rate limits", "Sender allowlists"): rate limits and the client
//! address behind proxies, bounded rate tables, the request-body budget, sender allowlists,
//! name squatting and crowded names, and key rotation. The real router and `server::serve` run
//! on 127.0.0.1 port 0 over a fresh store, driven by a manual clock (buckets refill only when a
//! test moves it).
#![allow(clippy::unwrap_used)] // Tests may unwrap (clippy.toml); the helpers use `expect`.

use std::collections::HashMap;

use serde_json::{json, Value};

use agentmbx_protocol::canonical;
use agentmbx_protocol::hop::header;
use agentmbx_protocol::keys::HostKey;
use agentmbx_protocol::limits::RELAY_SMALL_BODY;
use agentmbx_protocol::rotation::SignedRotation;
use agentmbx_protocol::time::iso_ms;

use agentmbx_relay::config::RelayConfig;
use agentmbx_relay::ratelimit::RateConfig;
use agentmbx_relay::store::{self as relay_store, AuthorityStrength, EnrolRequest};

use crate::helper::*;

// ---- local fixtures ---------------------------------------------------------------------------

/// A relay whose `[rate]` section and `trust_proxy` are as given.
async fn relay_with(rate: RateConfig, trust_proxy: Option<&str>) -> Relay {
    Relay::start_with_config(RelayConfig {
        rate,
        trust_proxy: trust_proxy.map(str::to_owned),
        ..RelayConfig::default()
    })
    .await
}

/// Default rates except those `f` changes.
fn rates(f: impl FnOnce(&mut RateConfig)) -> RateConfig {
    let mut r = RateConfig::default();
    f(&mut r);
    r
}

/// An answer with the header the rate limits set.
#[derive(Debug)]
struct Answer {
    status: u16,
    retry_after: Option<String>,
    json: Value,
}

/// A request with extra headers, keeping `Retry-After`.
async fn call(
    http: &reqwest::Client,
    relay: &Relay,
    method: &str,
    target: &str,
    headers: &[(&str, &str)],
    body: &str,
) -> Answer {
    let method = reqwest::Method::from_bytes(method.as_bytes()).unwrap();
    let mut req = http
        .request(method, format!("{}{target}", relay.base))
        .header("content-type", "application/json");
    if !body.is_empty() {
        req = req.body(body.to_owned());
    }
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    let res = req.send().await.expect("http request");
    let status = res.status().as_u16();
    let retry_after = res
        .headers()
        .get("retry-after")
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned);
    let text = res.text().await.expect("body");
    Answer {
        status,
        retry_after,
        json: serde_json::from_str(&text).unwrap_or(Value::Null),
    }
}

fn client() -> reqwest::Client {
    reqwest::Client::builder()
        .no_proxy()
        .timeout(std::time::Duration::from_secs(60))
        .build()
        .unwrap()
}

/// Asserts a 429 rate-limit answer waiting `secs` seconds (body and header agree).
#[track_caller]
fn assert_429(a: &Answer, secs: u64) {
    assert_eq!(a.status, 429, "{a:#?}");
    assert_eq!(
        a.json,
        json!({"error": "rate_limit_exceeded", "code": "RATE_LIMIT", "retry_after": secs}),
        "{a:#?}"
    );
    assert_eq!(a.retry_after.as_deref(), Some(secs.to_string().as_str()));
}

/// `GET /v2/relay/info` (unsigned) with extra headers.
async fn info(http: &reqwest::Client, relay: &Relay, headers: &[(&str, &str)]) -> Answer {
    call(http, relay, "GET", "/v2/relay/info", headers, "").await
}

/// `POST /v1/relay/challenge` for `host`.
async fn challenge(http: &reqwest::Client, relay: &Relay, host: &Host) -> Answer {
    let body = json!({"host": host.name, "pubkey": host.pubkey()}).to_string();
    call(http, relay, "POST", "/v1/relay/challenge", &[], &body).await
}

/// A signed allowlist body `{list, sig}` of `target` naming `senders`, issued at `iat_ms`.
fn senders_body(target: &Host, senders: &[String], iat_ms: i64) -> String {
    let list = json!({"v": 1, "type": "relay-senders", "host_pubkey": target.pubkey(),
                      "senders": senders, "iat": iso_ms(iat_ms)});
    let sig = target
        .key
        .sign(canonical::to_string(&list).unwrap().as_bytes());
    json!({"list": list, "sig": sig}).to_string()
}

/// `POST /v2/relay/senders` signed by `target`.
async fn publish(relay: &Relay, target: &Host, senders: &[&Host], iat_ms: i64) -> Resp {
    let keys: Vec<String> = senders.iter().map(|h| h.pubkey()).collect();
    let body = senders_body(target, &keys, iat_ms);
    relay.hop(target, "POST", "/v2/relay/senders", &body).await
}

/// Pushes one fresh sealed envelope `from` → `to` and returns `(status, item id, wire)`.
async fn push_env(relay: &Relay, from: &Host, to: &Host, body: &str) -> (String, String, String) {
    let (id, wire) = sealed_wire(from, to, body, relay.now());
    let r = relay.push(from, vec![env_item(&id, to, &wire)]).await;
    (r.status1(), id, wire)
}

/// Enrols `host` through the store with a proven `account` (what an account authority records).
async fn enrol_in_account(relay: &Relay, host: &Host, account: Option<&str>) {
    let req = EnrolRequest {
        host_pubkey: host.pubkey(),
        host_name: host.name.clone(),
        owner_fp: String::new(),
        account: account.map(str::to_owned),
        authorized_by: if account.is_some() {
            "account-token".into()
        } else {
            "host-key-challenge".into()
        },
        strength: if account.is_some() {
            AuthorityStrength::Account
        } else {
            AuthorityStrength::HostKeyChallenge
        },
        now_ms: relay.now(),
    };
    let out = relay.with_store(move |s| s.enrol(req)).await;
    assert!(
        matches!(out, Ok(relay_store::EnrolOutcome::Enrolled(_))),
        "{out:?}"
    );
}

/// Publishes `host`'s v2 enc-key ad.
async fn publish_ad(relay: &Relay, host: &Host) {
    let (ad, sig) = host.enc_ad(relay.now());
    let body = json!({"ad": ad, "sig": sig}).to_string();
    let r = relay.hop(host, "POST", "/v2/relay/enc-key", &body).await;
    assert_eq!(r.assert_ok(), &json!({"ok": true}));
}

/// Percent-encodes a base64 key for a query string.
fn b64_query(s: &str) -> String {
    s.replace('+', "%2B")
        .replace('/', "%2F")
        .replace('=', "%3D")
}

/// Polls `f` every 10 ms for up to 10 s.
async fn wait_until(what: &str, f: impl Fn() -> bool) {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while !f() {
        assert!(std::time::Instant::now() < deadline, "timed out: {what}");
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
}

// ---- per-address rate limits ------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn enrolment_calls_share_one_bucket_per_address_and_refill_with_the_clock() {
    let relay = Relay::start().await;
    let http = client();
    let host = Host::new("alpha");
    // 30 calls a minute (wire.md §3.2): the 30th passes, the 31st is refused.
    for i in 0..30 {
        let a = challenge(&http, &relay, &host).await;
        assert_eq!(a.status, 200, "call {i}: {a:#?}");
    }
    let a = challenge(&http, &relay, &host).await;
    assert_429(&a, 2);
    // Enrol and rotate draw from the same bucket.
    let a = call(
        &http,
        &relay,
        "POST",
        "/v1/relay/enrol",
        &[],
        &host.enrol_body("x"),
    )
    .await;
    assert_429(&a, 2);
    let a = call(&http, &relay, "POST", "/v2/relay/rotate", &[], "{}").await;
    assert_429(&a, 2);
    // Info is another class: not limited by it.
    assert_eq!(info(&http, &relay, &[]).await.status, 200);
    // A token comes back every 2 s of relay time; not before.
    relay.clock.advance(1_999);
    assert_429(&challenge(&http, &relay, &host).await, 1);
    relay.clock.advance(1);
    assert_eq!(challenge(&http, &relay, &host).await.status, 200);
    assert_429(&challenge(&http, &relay, &host).await, 2);
    // A whole minute refills the bucket.
    relay.clock.advance(60_000);
    for _ in 0..30 {
        assert_eq!(challenge(&http, &relay, &host).await.status, 200);
    }
    assert_429(&challenge(&http, &relay, &host).await, 2);
    relay.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn info_has_its_own_bucket_and_the_limits_are_configurable() {
    let relay = relay_with(rates(|r| r.info_per_min = 5), None).await;
    let http = client();
    for _ in 0..5 {
        assert_eq!(info(&http, &relay, &[]).await.status, 200);
    }
    // 5 a minute: one token per 12 s.
    assert_429(&info(&http, &relay, &[]).await, 12);
    // A signed info counts the same (it is the address that is limited).
    let host = Host::new("alpha");
    relay.enrol(&host).await;
    let r = relay.hop(&host, "GET", "/v2/relay/info", "").await;
    assert_eq!(r.status, 429, "{r:#?}");
    relay.clock.advance(12_000);
    let r = relay.hop(&host, "GET", "/v2/relay/info", "").await;
    assert_eq!(r.assert_ok()["you"]["pubkey"], host.pubkey());
    relay.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn xff_mode_keys_by_the_rightmost_entry_and_ignores_forged_ones() {
    let relay = relay_with(rates(|r| r.info_per_min = 2), Some("xff")).await;
    let http = client();
    let xff = |v: &'static str| [("x-forwarded-for", v)];
    for _ in 0..2 {
        let a = info(&http, &relay, &xff("6.6.6.6, 203.0.113.7")).await;
        assert_eq!(a.status, 200);
    }
    assert_429(&info(&http, &relay, &xff("6.6.6.6, 203.0.113.7")).await, 30);
    // The client controls everything left of what the proxy appended: a forged leftmost entry
    // is the same caller, not a new bucket.
    assert_429(
        &info(&http, &relay, &xff("7.7.7.7, 8.8.8.8, 203.0.113.7")).await,
        30,
    );
    assert_429(&info(&http, &relay, &xff("203.0.113.7:41000")).await, 30);
    // Another rightmost address is another caller.
    assert_eq!(
        info(&http, &relay, &xff("203.0.113.7, 203.0.113.8"))
            .await
            .status,
        200
    );
    // Without the header (or with a garbled one) the socket address is the caller.
    for _ in 0..2 {
        assert_eq!(info(&http, &relay, &[]).await.status, 200);
    }
    assert_429(&info(&http, &relay, &[]).await, 30);
    assert_429(&info(&http, &relay, &xff("not-an-address")).await, 30);
    // CF-Connecting-IP means nothing in xff mode.
    assert_429(
        &info(&http, &relay, &[("cf-connecting-ip", "198.51.100.1")]).await,
        30,
    );
    relay.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cloudflare_mode_keys_by_cf_connecting_ip() {
    let relay = relay_with(rates(|r| r.info_per_min = 2), Some("cloudflare")).await;
    let http = client();
    let cf = [("cf-connecting-ip", "198.51.100.1")];
    for _ in 0..2 {
        assert_eq!(info(&http, &relay, &cf).await.status, 200);
    }
    assert_429(&info(&http, &relay, &cf).await, 30);
    // X-Forwarded-For is not trusted in this mode.
    let both = [
        ("cf-connecting-ip", "198.51.100.1"),
        ("x-forwarded-for", "192.0.2.55"),
    ];
    assert_429(&info(&http, &relay, &both).await, 30);
    assert_eq!(
        info(&http, &relay, &[("cf-connecting-ip", "198.51.100.2")])
            .await
            .status,
        200
    );
    relay.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn socket_mode_ignores_proxy_headers() {
    let relay = relay_with(rates(|r| r.info_per_min = 2), None).await;
    let http = client();
    for _ in 0..2 {
        assert_eq!(info(&http, &relay, &[]).await.status, 200);
    }
    for h in [
        ("x-forwarded-for", "192.0.2.1"),
        ("cf-connecting-ip", "192.0.2.2"),
    ] {
        assert_429(&info(&http, &relay, &[h]).await, 30);
    }
    relay.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rate_tables_stay_bounded_under_a_flood_of_distinct_addresses() {
    let relay = relay_with(RateConfig::default(), Some("xff")).await;
    let http = client();
    let cap = relay.state.rates.info.cap();
    assert_eq!(cap, 50_000);
    // One address known before the flood.
    let known = [("x-forwarded-for", "192.0.2.1")];
    assert_eq!(info(&http, &relay, &known).await.status, 200);
    let flood = 60_000u32;
    let workers = 16u32;
    let mut tasks = Vec::new();
    for w in 0..workers {
        let (http, base) = (http.clone(), relay.base.clone());
        tasks.push(tokio::spawn(async move {
            let mut counts: HashMap<u16, u32> = HashMap::new();
            let mut i = w;
            while i < flood {
                let addr = std::net::Ipv4Addr::from(0x0A00_0000 + i).to_string();
                let res = http
                    .get(format!("{base}/v2/relay/info"))
                    .header("x-forwarded-for", format!("forged, {addr}"))
                    .send()
                    .await
                    .expect("request");
                *counts.entry(res.status().as_u16()).or_default() += 1;
                let _ = res.bytes().await;
                i += workers;
            }
            counts
        }));
    }
    let mut counts: HashMap<u16, u32> = HashMap::new();
    for t in tasks {
        for (k, v) in t.await.unwrap() {
            *counts.entry(k).or_default() += v;
        }
    }
    // The table filled up to its cap and then refused new addresses instead of growing.
    assert_eq!(counts.get(&200), Some(&49_999), "{counts:?}");
    assert_eq!(counts.get(&429), Some(&10_001), "{counts:?}");
    assert_eq!(relay.state.rates.info.len(), cap);
    assert!(relay.state.rates.enrol.is_empty());
    // The known address still has its bucket (599 tokens left) while new ones wait...
    assert_eq!(info(&http, &relay, &known).await.status, 200);
    assert_429(
        &info(&http, &relay, &[("x-forwarded-for", "192.0.2.200")]).await,
        1,
    );
    // ...until the buckets refill (one token per 100 ms): the full ones are swept out.
    relay.clock.advance(100);
    assert_eq!(
        info(&http, &relay, &[("x-forwarded-for", "192.0.2.200")])
            .await
            .status,
        200
    );
    assert!(relay.state.rates.info.len() <= 2);
    relay.stop().await;
}

// ---- push rate per sender key -----------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pushes_past_the_sender_rate_are_rejected_rate_item_by_item() {
    let relay = Relay::start().await;
    let (a, b, c) = (Host::new("alpha"), Host::new("beta"), Host::new("gamma"));
    for h in [&a, &b, &c] {
        relay.enrol(h).await;
    }
    let cheap = || json!({"kind": "bad", "item_id": "x", "targets": []});
    // 120 requests a minute per sender key, one hit per request whatever it carries.
    for i in 0..119 {
        let r = relay.push(&a, vec![cheap()]).await;
        assert_eq!(r.status1(), "rejected:bad kind", "request {i}");
    }
    let (status, _, _) = push_env(&relay, &a, &b, "the 120th request").await;
    assert_eq!(status, "accepted");
    // Past the limit: 200, every item `rejected:rate`, nothing stored.
    let (id1, w1) = sealed_wire(&a, &b, "over the limit", relay.now());
    let (id2, w2) = sealed_wire(&a, &b, "over the limit too", relay.now());
    let r = relay
        .push(&a, vec![env_item(&id1, &b, &w1), env_item(&id2, &b, &w2)])
        .await;
    assert_eq!(r.statuses(), vec!["rejected:rate", "rejected:rate"]);
    let res = &r.json["results"];
    assert_eq!(
        (res[0]["item_id"].as_str(), res[1]["item_id"].as_str()),
        (Some(id1.as_str()), Some(id2.as_str()))
    );
    assert_eq!(relay.queue_ids(&b).await.len(), 1);
    // Another sender has its own budget.
    let (status, _, _) = push_env(&relay, &c, &b, "from gamma").await;
    assert_eq!(status, "accepted");
    // One token per 500 ms of relay time.
    relay.clock.advance(499);
    let r = relay.push(&a, vec![env_item(&id1, &b, &w1)]).await;
    assert_eq!(r.status1(), "rejected:rate");
    relay.clock.advance(1);
    let r = relay.push(&a, vec![env_item(&id1, &b, &w1)]).await;
    assert_eq!(r.status1(), "accepted");
    assert_eq!(relay.queue_ids(&b).await.len(), 3);
    relay.stop().await;
}

// ---- body budget ------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_large_bodies_past_the_budget_are_503() {
    let budget = 16 * 1024 * 1024;
    let relay = relay_with(rates(|r| r.body_budget_bytes = budget), None).await;
    let addr = relay.addr();
    let head = "POST /v2/relay/items HTTP/1.1\r\nhost: relay\r\ncontent-type: application/json\r\n\
                content-length: 8388608\r\n\r\n{\"items\":";
    // Two 8 MiB uploads in progress hold the whole budget (before any authentication).
    let mut held = Vec::new();
    for _ in 0..2 {
        let mut conn = RawConn::connect(&addr);
        conn.send(head.as_bytes()).unwrap();
        held.push(conn);
    }
    let rates = &relay.state.rates;
    wait_until("both uploads reserved their share", || {
        rates.body_bytes_reserved() == budget
    })
    .await;
    // A third is answered at once: 503 BUSY, Retry-After 1, its body never read.
    let third = addr.clone();
    let (status, head3, body) = tokio::task::spawn_blocking(move || {
        let mut conn = RawConn::connect(&third);
        conn.send(
            b"POST /v2/relay/items HTTP/1.1\r\nhost: relay\r\ncontent-length: 8388608\r\n\r\n",
        )
        .unwrap();
        conn.response()
    })
    .await
    .unwrap();
    assert_eq!(status, 503, "{body}");
    assert!(head3.contains("retry-after: 1"), "{head3}");
    let j: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(j["code"], "BUSY");
    // A small body still fits? No: the budget is spent to the byte.
    let small = addr.clone();
    let (status, _, _) = tokio::task::spawn_blocking(move || {
        let mut conn = RawConn::connect(&small);
        conn.send(b"POST /v2/relay/ack HTTP/1.1\r\nhost: relay\r\ncontent-length: 2\r\n\r\n{}")
            .unwrap();
        conn.response()
    })
    .await
    .unwrap();
    assert_eq!(status, 503);
    // Bodiless requests need no budget.
    let r = relay.plain("GET", "/v2/relay/info", "").await;
    assert_eq!(r.status, 200);
    // One upload gives up: its share comes back and requests are read again.
    drop(held.pop());
    wait_until("the abandoned upload's share came back", || {
        rates.body_bytes_reserved() == budget / 2
    })
    .await;
    let r = relay.plain("POST", "/v2/relay/ack", "{}").await;
    r.assert_error(401, "bad relay hop", "BAD_HOP");
    drop(held);
    wait_until("every share came back", || rates.body_bytes_reserved() == 0).await;
    relay.stop().await;
}

// ---- sender allowlists ------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_published_allowlist_refuses_other_senders_and_newer_lists_replace_it() {
    let relay = Relay::start().await;
    let (a, b, c) = (Host::new("alpha"), Host::new("beta"), Host::new("gamma"));
    for h in [&a, &b, &c] {
        relay.enrol(h).await;
    }
    let t0 = relay.now();
    let r = publish(&relay, &b, &[&c], t0).await;
    assert_eq!(r.assert_ok(), &json!({"ok": true}));
    let stored = relay
        .with_store({
            let b = b.pubkey();
            move |s| s.sender_list(&b).unwrap().unwrap()
        })
        .await;
    assert_eq!(stored.senders, vec![c.pubkey()]);
    assert_eq!(stored.iat_ms, t0);
    let (status, _, _) = push_env(&relay, &a, &b, "from alpha").await;
    assert_eq!(status, "rejected:sender not accepted by target");
    let (status, id_c, _) = push_env(&relay, &c, &b, "from gamma").await;
    assert_eq!(status, "accepted");
    assert_eq!(relay.queue_ids(&b).await, vec![id_c.clone()]);
    // A list with the same or an older iat is stale and changes nothing.
    for iat in [t0, t0 - 1] {
        let r = publish(&relay, &b, &[&a], iat).await;
        r.assert_error(409, "a newer sender list is already stored", "STALE");
    }
    let (status, _, _) = push_env(&relay, &a, &b, "still refused").await;
    assert_eq!(status, "rejected:sender not accepted by target");
    // A newer one replaces it (repeated senders kept once).
    let r = publish(&relay, &b, &[&a, &a], t0 + 1).await;
    r.assert_ok();
    let (status, id_a, _) = push_env(&relay, &a, &b, "now accepted").await;
    assert_eq!(status, "accepted");
    let (status, _, _) = push_env(&relay, &c, &b, "now refused").await;
    assert_eq!(status, "rejected:sender not accepted by target");
    assert_eq!(relay.queue_ids(&b).await, vec![id_c, id_a]);
    // An empty list accepts nobody.
    let r = publish(&relay, &b, &[], t0 + 2).await;
    r.assert_ok();
    let (status, _, _) = push_env(&relay, &a, &b, "nobody").await;
    assert_eq!(status, "rejected:sender not accepted by target");
    relay.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn allowlist_refusals() {
    let relay = Relay::start().await;
    let (a, b) = (Host::new("alpha"), Host::new("beta"));
    relay.enrol(&a).await;
    relay.enrol(&b).await;
    let now = relay.now();
    let keys = |n: usize| -> Vec<String> {
        (0..n)
            .map(|_| HostKey::generate().public().to_b64())
            .collect()
    };
    // iat: at most 5 minutes ahead of the relay clock.
    let r = relay
        .hop(
            &b,
            "POST",
            "/v2/relay/senders",
            &senders_body(&b, &[], now + 300_001),
        )
        .await;
    r.assert_error(400, "sender list iat is in the future", "BAD_REQUEST");
    let r = relay
        .hop(
            &b,
            "POST",
            "/v2/relay/senders",
            &senders_body(&b, &[], now + 300_000),
        )
        .await;
    r.assert_ok();
    // 1,024 senders at most.
    let full = keys(1_024);
    let r = relay
        .hop(
            &b,
            "POST",
            "/v2/relay/senders",
            &senders_body(&b, &full, now + 300_001),
        )
        .await;
    r.assert_error(400, "sender list iat is in the future", "BAD_REQUEST");
    relay.clock.advance(1);
    let r = relay
        .hop(
            &b,
            "POST",
            "/v2/relay/senders",
            &senders_body(&b, &full, now + 300_001),
        )
        .await;
    r.assert_ok();
    let stored = relay
        .with_store({
            let b = b.pubkey();
            move |s| s.sender_list(&b).unwrap().unwrap()
        })
        .await;
    assert_eq!(stored.senders.len(), 1_024);
    relay.clock.advance(10_000);
    let over = keys(1_025);
    let r = relay
        .hop(
            &b,
            "POST",
            "/v2/relay/senders",
            &senders_body(&b, &over, now + 300_002),
        )
        .await;
    r.assert_error(
        400,
        "bad sender list: more than 1024 senders",
        "BAD_REQUEST",
    );
    // Signed by another key, or tampered after signing: 401 BAD_SIGNATURE.
    let mut forged: Value =
        serde_json::from_str(&senders_body(&b, &[a.pubkey()], now + 300_002)).unwrap();
    forged["sig"] = json!(a
        .key
        .sign(canonical::to_string(&forged["list"]).unwrap().as_bytes()));
    let r = relay
        .hop(&b, "POST", "/v2/relay/senders", &forged.to_string())
        .await;
    r.assert_error(
        401,
        "sender list is not signed by the target",
        "BAD_SIGNATURE",
    );
    let mut tampered: Value =
        serde_json::from_str(&senders_body(&b, &[a.pubkey()], now + 300_002)).unwrap();
    tampered["list"]["senders"] = json!([HostKey::generate().public().to_b64()]);
    let r = relay
        .hop(&b, "POST", "/v2/relay/senders", &tampered.to_string())
        .await;
    r.assert_error(
        401,
        "sender list is not signed by the target",
        "BAD_SIGNATURE",
    );
    let mut unsigned = tampered.clone();
    unsigned.as_object_mut().unwrap().remove("sig");
    let r = relay
        .hop(&b, "POST", "/v2/relay/senders", &unsigned.to_string())
        .await;
    r.assert_error(
        401,
        "sender list is not signed by the target",
        "BAD_SIGNATURE",
    );
    // A host publishes only its own list: alpha cannot post beta's, even signed by beta.
    let r = relay
        .hop(
            &a,
            "POST",
            "/v2/relay/senders",
            &senders_body(&b, &[], now + 300_002),
        )
        .await;
    r.assert_error(
        400,
        "bad sender list: host_pubkey must be the publishing host's own key",
        "BAD_REQUEST",
    );
    // Shapes.
    let unpadded = a.pubkey().trim_end_matches('=').to_owned();
    for (body, why) in [
        (
            senders_body(&b, &[unpadded], now + 300_002),
            "every sender must be a host key (padded standard base64)",
        ),
        (
            senders_body(&b, &["not a key".into()], now + 300_002),
            "every sender must be a host key (padded standard base64)",
        ),
        (
            json!({"list": {"v": 2, "type": "relay-senders"}, "sig": "x"}).to_string(),
            "not a relay-senders record",
        ),
        (json!({"sig": "x"}).to_string(), "list must be an object"),
        ("[]".to_owned(), "list must be an object"),
    ] {
        let r = relay.hop(&b, "POST", "/v2/relay/senders", &body).await;
        r.assert_error(400, &format!("bad sender list: {why}"), "BAD_REQUEST");
    }
    let mut bad_iat: Value = serde_json::from_str(&senders_body(&b, &[], now)).unwrap();
    bad_iat["list"]["iat"] = json!("yesterday");
    let r = relay
        .hop(&b, "POST", "/v2/relay/senders", &bad_iat.to_string())
        .await;
    r.assert_error(
        400,
        "bad sender list: iat must be an ISO time (YYYY-MM-DDTHH:MM:SS.mmmZ)",
        "BAD_REQUEST",
    );
    // Publishing needs a hop.
    let r = relay
        .plain(
            "POST",
            "/v2/relay/senders",
            &senders_body(&b, &[], now + 300_003),
        )
        .await;
    r.assert_error(401, "bad relay hop", "BAD_HOP");
    // Nothing refused changed the stored list.
    let stored = relay
        .with_store({
            let b = b.pubkey();
            move |s| s.sender_list(&b).unwrap().unwrap()
        })
        .await;
    assert_eq!(stored.senders, full);
    relay.stop().await;
}

// ---- names are labels -------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_name_squatter_never_receives_the_real_hosts_mail_and_cannot_push_as_it() {
    let relay = Relay::start().await;
    let real = Host::new("laptop");
    let squatter = Host::new("laptop");
    let sender = Host::new("desk");
    for h in [&real, &sender] {
        relay.enrol(h).await;
    }
    publish_ad(&relay, &real).await;
    // Enrolment is never refused for a name: the squatter enrols "laptop" too.
    relay.enrol(&squatter).await;
    // Mail is routed by key: only the real host's queue has it.
    let (status, id, _) = push_env(&relay, &sender, &real, "for the real laptop").await;
    assert_eq!(status, "accepted");
    assert_eq!(relay.queue_ids(&real).await, vec![id]);
    assert!(relay.queue_ids(&squatter).await.is_empty());
    // A lookup by the shared name resolves to nobody (so the squatter's key is never served as
    // the laptop's); by key the real host's ad is served.
    let r = relay
        .hop(&sender, "GET", "/v2/relay/enc-key?host=laptop", "")
        .await;
    r.assert_error(
        404,
        "host name ambiguous: several hosts use that name here; look the host up by key",
        "AMBIGUOUS",
    );
    let target = format!("/v2/relay/enc-key?pubkey={}", b64_query(&real.pubkey()));
    let r = relay.hop(&sender, "GET", &target, "").await;
    assert_eq!(r.assert_ok()["host_pubkey"], real.pubkey());
    // The squatter cannot act as the real host: naming its key without its signature is 401,
    // and whatever the squatter pushes carries the squatter's own key.
    let (wid, wire) = sealed_wire(&squatter, &sender, "spoof", relay.now());
    let body = json!({"items": [env_item(&wid, &sender, &wire)]}).to_string();
    let headers: Vec<(String, String)> = squatter
        .hop_headers("POST", "/v2/relay/items", &body, relay.now())
        .into_iter()
        .map(|(k, v)| {
            if k == header::KEY {
                (k, real.pubkey())
            } else {
                (k, v)
            }
        })
        .collect();
    let r = relay
        .send("POST", "/v2/relay/items", &headers, body.into_bytes())
        .await;
    r.assert_error(401, "bad relay hop", "BAD_HOP");
    let (status, _, _) = push_env(&relay, &squatter, &sender, "from the squatter").await;
    assert_eq!(status, "accepted");
    let page = relay.pull(&sender, "after=0").await;
    let items = page.assert_ok()["items"].as_array().unwrap().clone();
    assert_eq!(items.len(), 1);
    assert_eq!(items[0]["sender_pubkey"], squatter.pubkey());
    // The squatter cannot pull the real host's queue either: its hop shows its own queue.
    assert!(relay.queue_ids(&squatter).await.is_empty());
    relay.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_name_carried_by_more_than_16_hosts_is_crowded() {
    let relay = Relay::start().await;
    let viewer = Host::new("viewer");
    enrol_in_account(&relay, &viewer, Some("acct-1")).await;
    let mine = Host::new("macbook");
    enrol_in_account(&relay, &mine, Some("acct-1")).await;
    publish_ad(&relay, &mine).await;
    let lookup = "/v2/relay/enc-key?host=macbook";
    // One carrier: it resolves for anyone.
    let r = relay.hop(&viewer, "GET", lookup, "").await;
    assert_eq!(r.assert_ok()["host_pubkey"], mine.pubkey());
    // Fifteen more owners' "macbook" (16 live in all): ambiguous for a caller outside
    // acct-1, still the one of its own account for a caller inside it.
    let outsider = Host::new("outsider");
    relay.enrol(&outsider).await;
    for _ in 0..15 {
        relay.enrol_direct(&Host::new("macbook")).await;
    }
    let live = relay
        .with_store(|s| s.live_enrolments_by_name("MacBook").unwrap().len())
        .await;
    assert_eq!(live, 16);
    let r = relay.hop(&viewer, "GET", lookup, "").await;
    assert_eq!(r.assert_ok()["host_pubkey"], mine.pubkey());
    let r = relay.hop(&outsider, "GET", lookup, "").await;
    assert_eq!((r.status, r.str("code")), (404, "AMBIGUOUS"), "{r:#?}");
    // A 17th: the name is crowded, nobody resolves it; enrolment itself is never refused.
    relay.enrol(&Host::new("macbook")).await;
    let r = relay.hop(&viewer, "GET", lookup, "").await;
    r.assert_error(
        404,
        "host name ambiguous: several hosts use that name here; look the host up by key",
        "AMBIGUOUS",
    );
    relay.enrol(&Host::new("macbook")).await;
    // By key it is served as always.
    let target = format!("/v2/relay/enc-key?pubkey={}", b64_query(&mine.pubkey()));
    let r = relay.hop(&viewer, "GET", &target, "").await;
    assert_eq!(r.assert_ok()["host_pubkey"], mine.pubkey());
    relay.stop().await;
}

// ---- rotation ---------------------------------------------------------------------------------

/// `POST /v2/relay/rotate {rotation}` (no hop).
async fn rotate(relay: &Relay, rotation: &SignedRotation) -> Resp {
    let body = json!({ "rotation": rotation }).to_string();
    relay.plain("POST", "/v2/relay/rotate", &body).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rotation_moves_the_queue_name_and_allowlists_to_the_new_key() {
    let relay = Relay::start().await;
    let old = Host::new("laptop");
    let new = Host::new("laptop");
    let (a, b, c) = (Host::new("alpha"), Host::new("beta"), Host::new("gamma"));
    for h in [&old, &new, &a, &b, &c] {
        relay.enrol(h).await;
    }
    publish_ad(&relay, &old).await;
    // The old key accepts alpha only; beta accepts the old key and alpha.
    publish(&relay, &old, &[&a], relay.now()).await.assert_ok();
    publish(&relay, &b, &[&old, &a], relay.now())
        .await
        .assert_ok();
    let b_before = relay
        .with_store({
            let b = b.pubkey();
            move |s| s.sender_list(&b).unwrap().unwrap()
        })
        .await;
    // Three items for the old key, one already waiting for the new key.
    let mut old_ids = Vec::new();
    let mut first_wire = None;
    for n in 0..3 {
        relay.clock.advance(10);
        let (status, id, wire) = push_env(&relay, &a, &old, &format!("old {n}")).await;
        assert_eq!(status, "accepted");
        first_wire.get_or_insert((id.clone(), wire));
        old_ids.push(id);
    }
    relay.clock.advance(10);
    let (status, new_own, _) = push_env(&relay, &c, &new, "new key's own").await;
    assert_eq!(status, "accepted");

    relay.clock.advance(1_000);
    let rotation =
        SignedRotation::sign("laptop", &old.key, &new.key, &new.enc.public(), relay.now());
    let r = rotate(&relay, &rotation).await;
    assert_eq!(r.assert_ok(), &json!({"moved": 3}));

    // The old key is revoked: its hops are refused, and it is not enrolled any more.
    let r = relay.pull(&old, "after=0").await;
    r.assert_error(403, "this host key is revoked on this relay", "REVOKED");
    let e = relay
        .with_store({
            let k = new.pubkey();
            move |s| s.enrolment(&k).unwrap().unwrap()
        })
        .await;
    assert_eq!((e.host_name.as_str(), e.revoked_at_ms), ("laptop", None));
    // The new key pulls its own item first, then the old queue in order, re-sequenced.
    let page = relay.pull(&new, "after=0").await;
    let items = page.assert_ok()["items"].as_array().unwrap().clone();
    let ids: Vec<&str> = items
        .iter()
        .map(|i| i["item_id"].as_str().unwrap())
        .collect();
    let mut want = vec![new_own.as_str()];
    want.extend(old_ids.iter().map(String::as_str));
    assert_eq!(ids, want);
    let seqs: Vec<i64> = items.iter().map(|i| i["seq"].as_i64().unwrap()).collect();
    assert!(seqs.windows(2).all(|w| w[0] < w[1]), "{seqs:?}");
    assert!(seqs[1] >= relay.now(), "moved items get new seqs: {seqs:?}");
    // The old key's ad is gone; the host republishes for its new key.
    let target = format!("/v2/relay/enc-key?pubkey={}", b64_query(&old.pubkey()));
    let r = relay.hop(&a, "GET", &target, "").await;
    r.assert_error(404, "unknown host", "NOT_FOUND");
    // The old key's allowlist is the new key's now.
    let (status, _, _) = push_env(&relay, &c, &new, "gamma is not listed").await;
    assert_eq!(status, "rejected:sender not accepted by target");
    let (status, _, _) = push_env(&relay, &a, &new, "alpha is").await;
    assert_eq!(status, "accepted");
    // In beta's list the new key replaced the old one; the signed record stays as beta signed.
    let b_after = relay
        .with_store({
            let b = b.pubkey();
            move |s| s.sender_list(&b).unwrap().unwrap()
        })
        .await;
    assert_eq!(b_after.senders, vec![new.pubkey(), a.pubkey()]);
    assert_eq!(
        (b_after.record, b_after.sig, b_after.iat_ms),
        (b_before.record, b_before.sig, b_before.iat_ms)
    );
    let (status, _, _) = push_env(&relay, &new, &b, "from the new key").await;
    assert_eq!(status, "accepted");
    // A sender retrying a push to the old key (it has not learned the rotation) settles as a
    // duplicate: nothing is stored twice.
    let (id0, wire0) = first_wire.unwrap();
    let r = relay.push(&a, vec![env_item(&id0, &old, &wire0)]).await;
    assert_eq!(r.status1(), "duplicate");

    // The same rotation again (the host missed the answer): a success that changes nothing.
    let before = relay.queue_ids(&new).await;
    let r = rotate(&relay, &rotation).await;
    assert_eq!(r.assert_ok(), &json!({"moved": 0, "already_rotated": true}));
    assert_eq!(relay.queue_ids(&new).await, before);
    // The retired key cannot rotate again to any other key.
    let other = Host::new("laptop");
    let again = SignedRotation::sign(
        "laptop",
        &old.key,
        &other.key,
        &other.enc.public(),
        relay.now(),
    );
    let r = rotate(&relay, &again).await;
    r.assert_error(404, "the rotated key is not enrolled here", "NOT_ENROLLED");
    relay.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rotation_refusals_change_nothing() {
    let relay = Relay::start().await;
    let old = Host::new("laptop");
    let new = Host::new("laptop");
    let a = Host::new("alpha");
    for h in [&old, &a] {
        relay.enrol(h).await;
    }
    let (status, id, _) = push_env(&relay, &a, &old, "stays").await;
    assert_eq!(status, "accepted");
    let now = relay.now();
    // An old key that is not enrolled here: 404.
    let stranger = Host::new("laptop");
    let r = rotate(
        &relay,
        &SignedRotation::sign("laptop", &stranger.key, &new.key, &new.enc.public(), now),
    )
    .await;
    r.assert_error(404, "the rotated key is not enrolled here", "NOT_ENROLLED");
    // Not signed by both keys: 400 with the reason.
    let good = SignedRotation::sign("laptop", &old.key, &new.key, &new.enc.public(), now);
    let mut bad = good.clone();
    bad.new_sig = old.key.sign(bad.canonical().as_bytes());
    let r = rotate(&relay, &bad).await;
    r.assert_error(
        400,
        "rotation is not signed by the new host key",
        "BAD_ROTATION",
    );
    let mut bad = good.clone();
    bad.old_sig = new.key.sign(bad.canonical().as_bytes());
    let r = rotate(&relay, &bad).await;
    r.assert_error(
        400,
        "rotation is not signed by the pinned host key",
        "BAD_ROTATION",
    );
    let same = SignedRotation::sign("laptop", &old.key, &old.key, &old.enc.public(), now);
    let r = rotate(&relay, &same).await;
    r.assert_error(400, "rotation keeps the same host key", "BAD_ROTATION");
    let r = relay
        .plain(
            "POST",
            "/v2/relay/rotate",
            &json!({"rotation": {"rec": {"old_pub": old.pubkey()}}}).to_string(),
        )
        .await;
    r.assert_error(400, "not a rotation record", "BAD_ROTATION");
    // Another host's name.
    let r = rotate(
        &relay,
        &SignedRotation::sign("desktop", &old.key, &new.key, &new.enc.public(), now),
    )
    .await;
    r.assert_error(400, "rotation names another host", "BAD_ROTATION");
    // A revoked new key.
    relay.enrol(&new).await;
    relay.revoke(&new).await;
    let r = rotate(&relay, &good).await;
    r.assert_error(
        409,
        "the new host key is revoked on this relay",
        "ROTATION_TARGET",
    );
    // Bodies are small.
    let big = json!({"rotation": good, "pad": "x".repeat(RELAY_SMALL_BODY)}).to_string();
    let r = relay.plain("POST", "/v2/relay/rotate", &big).await;
    r.assert_error(413, "request body too large", "TOO_LARGE");
    // Nothing moved: the old key is live with its queue.
    assert_eq!(relay.queue_ids(&old).await, vec![id]);
    relay.stop().await;
}

// ---- rotation and the deny-list ---------------------------------------------------------------

/// Deny-lists (or, with `on = false`, lifts the entry of) `host` by its fingerprint.
async fn deny_fp(relay: &Relay, host: &Host, on: bool) {
    let fp = host.key.public().fingerprint();
    let now = relay.now();
    relay
        .with_store(move |s| {
            if on {
                let entry = relay_store::DenyEntry {
                    kind: relay_store::DenyKind::Host,
                    value: fp,
                    until_ms: None,
                    at_ms: now,
                };
                assert!(matches!(
                    s.deny(entry).unwrap(),
                    relay_store::DenyOutcome::Stored(_)
                ));
            } else {
                assert!(s.undeny(relay_store::DenyKind::Host, &fp).unwrap());
            }
        })
        .await;
}

/// The old key's revocation time (`Some(None)`: live) and the new key's enrolment, if any.
async fn enrolments_of(
    relay: &Relay,
    old: &Host,
    new: &Host,
) -> (Option<Option<i64>>, Option<relay_store::Enrolment>) {
    let (old_k, new_k) = (old.pubkey(), new.pubkey());
    relay
        .with_store(move |s| {
            (
                s.enrolment(&old_k).unwrap().map(|e| e.revoked_at_ms),
                s.enrolment(&new_k).unwrap(),
            )
        })
        .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deny_listed_host_cannot_rotate_away_from_its_entry() {
    let relay = Relay::start().await;
    let (old, new, a) = (Host::new("laptop"), Host::new("laptop"), Host::new("alpha"));
    for h in [&old, &a] {
        relay.enrol(h).await;
    }
    let (status, id, _) = push_env(&relay, &a, &old, "waits").await;
    assert_eq!(status, "accepted");
    let rotation =
        SignedRotation::sign("laptop", &old.key, &new.key, &new.enc.public(), relay.now());
    // The old key is denied: 403 DENIED, nothing moves.
    deny_fp(&relay, &old, true).await;
    let r = rotate(&relay, &rotation).await;
    r.assert_error(403, "this host is denied on this relay", "DENIED");
    assert_eq!(enrolments_of(&relay, &old, &new).await, (Some(None), None));
    let old_k = old.pubkey();
    let queued = relay
        .with_store(move |s| {
            s.pull(relay_store::PullRequest {
                target_pubkey: old_k,
                after: 0,
                limit: 500,
                max_bytes: u64::MAX,
            })
            .unwrap()
            .items
            .len()
        })
        .await;
    assert_eq!(queued, 1);
    // The new key is denied: the same.
    deny_fp(&relay, &old, false).await;
    deny_fp(&relay, &new, true).await;
    let r = rotate(&relay, &rotation).await;
    r.assert_error(403, "this host is denied on this relay", "DENIED");
    assert_eq!(enrolments_of(&relay, &old, &new).await, (Some(None), None));
    // Neither denied: the rotation is applied.
    deny_fp(&relay, &new, false).await;
    let r = rotate(&relay, &rotation).await;
    assert_eq!(r.assert_ok(), &json!({"moved": 1}));
    assert_eq!(relay.queue_ids(&new).await, vec![id]);
    relay.stop().await;
}

// ---- body budget per client address -----------------------------------------------------------

/// A request head for `POST <path>` from `xff` (the trusted proxy's X-Forwarded-For) with a
/// declared length, or chunked without one.
fn upload_head(path: &str, xff: &str, length: Option<u64>) -> String {
    let framing = match length {
        Some(n) => format!("content-length: {n}"),
        None => "transfer-encoding: chunked".to_owned(),
    };
    format!(
        "POST {path} HTTP/1.1\r\nhost: relay\r\ncontent-type: application/json\r\n\
         x-forwarded-for: {xff}\r\n{framing}\r\n\r\n"
    )
}

/// Sends `head` (and `body`) on a new connection and reads the answer.
async fn answer_of(addr: &str, head: String, body: &'static [u8]) -> (u16, String, String) {
    let addr = addr.to_owned();
    tokio::task::spawn_blocking(move || {
        let mut conn = RawConn::connect(&addr);
        conn.send(head.as_bytes()).unwrap();
        conn.send(body).unwrap();
        conn.response()
    })
    .await
    .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_address_holding_its_body_share_does_not_block_another() {
    const MIB: u64 = 1024 * 1024;
    // The relay-wide budget (64 MiB) is far from spent: only the per-address cap refuses.
    let relay = relay_with(RateConfig::default(), Some("xff")).await;
    assert_eq!(RateConfig::default().body_per_address_bytes, 16 * MIB);
    let addr = relay.addr();
    let rates = &relay.state.rates;
    let (a, b) = ("192.0.2.10", "198.51.100.20");
    // Address A: two slow 8 MiB uploads hold its 16 MiB.
    let mut held = Vec::new();
    for _ in 0..2 {
        let mut conn = RawConn::connect(&addr);
        conn.send(upload_head("/v2/relay/items", a, Some(8 * MIB)).as_bytes())
            .unwrap();
        held.push(conn);
    }
    wait_until("A holds its cap", || {
        rates.body_bytes_reserved_by(a) == 16 * MIB
    })
    .await;
    // A third body from A, however small: 503 BUSY with Retry-After, its body never read.
    let (status, head, body) =
        answer_of(&addr, upload_head("/v2/relay/ack", a, Some(2)), b"{}").await;
    assert_eq!(status, 503, "{body}");
    assert!(head.contains("retry-after: 1"), "{head}");
    let j: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(j["code"], "BUSY");
    assert_eq!(rates.body_bytes_reserved(), 16 * MIB);
    // Address B is served as usual (the request reaches the handler: an unsigned ack is 401).
    let (status, _, body) = answer_of(&addr, upload_head("/v2/relay/ack", b, Some(2)), b"{}").await;
    assert_eq!(status, 401, "{body}");
    // Bodies without a declared length are counted at the 8 MiB body cap against B's share.
    let mut chunked = Vec::new();
    for n in 1..=2u64 {
        let mut conn = RawConn::connect(&addr);
        conn.send(upload_head("/v2/relay/items", b, None).as_bytes())
            .unwrap();
        chunked.push(conn);
        wait_until("B's chunked upload reserved the body cap", || {
            rates.body_bytes_reserved_by(b) == n * 8 * MIB
        })
        .await;
    }
    let (status, _, _) =
        answer_of(&addr, upload_head("/v2/relay/items", b, None), b"0\r\n\r\n").await;
    assert_eq!(status, 503);
    // A gives up one upload: its share comes back and A is served again.
    drop(held.pop());
    wait_until("A's share came back", || {
        rates.body_bytes_reserved_by(a) == 8 * MIB
    })
    .await;
    let (status, _, _) = answer_of(&addr, upload_head("/v2/relay/ack", a, Some(2)), b"{}").await;
    assert_eq!(status, 401);
    drop(held);
    drop(chunked);
    wait_until("every share came back", || rates.body_bytes_reserved() == 0).await;
    assert_eq!(rates.body_bytes_reserved_by(a), 0);
    relay.stop().await;
}
