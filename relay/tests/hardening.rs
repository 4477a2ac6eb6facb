//! HTTP-level tests of the relay's answers to abuse (spec §2, §8; `wire.md` §2.10, §3.2,
//! "Resolved details" → "Rate limits"): open enrolment challenges per client address (503
//! `BUSY` with `Retry-After`), rotation records that are not objects or are dated ahead, and
//! the admin endpoints' rate limit and bounded warnings. The real router and `server::serve`
//! run on 127.0.0.1 port 0 over a fresh store, driven by a manual clock.
#![allow(clippy::unwrap_used)] // Tests may unwrap (clippy.toml); the helpers use `expect`.

use std::sync::{Arc, Mutex};

use serde_json::{json, Value};

use agentmbx_protocol::rotation::{SignedRotation, FUTURE_SKEW_MS};

use agentmbx_relay::authority::challenge::{CHALLENGE_TTL_MS, MAX_CHALLENGES_PER_ADDRESS};
use agentmbx_relay::config::{AdminToken, RelayConfig};
use agentmbx_relay::ratelimit::{RateConfig, ADMIN_PER_MIN};

use crate::helper::*;

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

/// Signed `GET /v2/relay/info` refuses nothing: a hop with a stale timestamp, a bad signature
/// or an unenrolled key is answered 200 without `you`, and counts no `refused.auth`.
#[tokio::test]
async fn a_signed_info_answered_without_you_counts_no_refusal() {
    let relay = relay().await;
    let (a, stranger) = (Host::new("alpha"), Host::new("stranger"));
    relay.enrol(&a).await;
    let target = "/v2/relay/info";
    let bad_sig = a
        .hop_headers("GET", target, "", relay.now())
        .into_iter()
        .map(|(k, v)| {
            if k == "x-mbx-sig" {
                (k, "AAAA".to_owned())
            } else {
                (k, v)
            }
        })
        .collect::<Vec<_>>();
    for headers in [
        a.hop_headers("GET", target, "", relay.now() - 400_000),
        stranger.hop_headers("GET", target, "", relay.now()),
        bad_sig,
    ] {
        let info = relay.send("GET", target, &headers, Vec::new()).await;
        let info = info.assert_ok();
        assert!(info.get("you").is_none(), "{info}");
    }
    // A good one still gets `you`.
    let good = a.hop_headers("GET", target, "", relay.now());
    let info = relay.send("GET", target, &good, Vec::new()).await;
    assert!(info.assert_ok().get("you").is_some());

    let auth = vec![("authorization".to_owned(), format!("Bearer {ADMIN}"))];
    let stats = relay
        .send("GET", "/v2/relay/admin/stats", &auth, Vec::new())
        .await;
    for (k, v) in stats.assert_ok()["refused"]["auth"].as_object().unwrap() {
        assert_eq!(v, 0, "refused.auth.{k}");
    }
}

/// Issue-level behaviour (relay log and counters): every refused pushed item and every request
/// refused for its sender is counted by reason in `GET /v2/relay/admin/stats` `refused` (the
/// writer's fields stay), and logged at DEBUG with its reason and at most a fingerprint
/// prefix: no key, no signature, no token in those lines.
#[tokio::test]
async fn refused_pushes_and_callers_are_counted_by_reason_and_logged_at_debug_without_keys() {
    use agentmbx_relay::config::LimitsConfig;
    use agentmbx_relay::store::SenderList;
    let log = Captured::default();
    let writer = log.clone();
    let subscriber = tracing_subscriber::fmt()
        .with_max_level(tracing::Level::DEBUG)
        .with_ansi(false)
        .with_writer(move || writer.clone())
        .finish();
    let _guard = tracing::subscriber::set_default(subscriber);
    let relay = Relay::start_with_config(RelayConfig {
        rate: RateConfig {
            push_per_min: 3,
            enrol_per_min: 100_000,
            ..RateConfig::default()
        },
        limits: LimitsConfig {
            max_queue_items: 1,
            ..LimitsConfig::default()
        },
        admin_token: Some(AdminToken::new(ADMIN).unwrap()),
        ..RelayConfig::default()
    })
    .await;
    let stats = |token: &'static str| {
        let relay = &relay;
        async move {
            let auth = vec![("authorization".to_owned(), format!("Bearer {token}"))];
            relay
                .send("GET", "/v2/relay/admin/stats", &auth, Vec::new())
                .await
        }
    };
    let zero = stats(ADMIN).await.assert_ok().clone();
    for (k, v) in zero["refused"]["push"].as_object().unwrap() {
        assert_eq!(v, 0, "refused.push.{k} at start");
    }
    for (k, v) in zero["refused"]["auth"].as_object().unwrap() {
        assert_eq!(v, 0, "refused.auth.{k} at start");
    }

    let (a, b, c, f, r) = (
        Host::new("alpha"),
        Host::new("beta"),
        Host::new("gamma"),
        Host::new("flood"),
        Host::new("gone"),
    );
    let stranger = Host::new("stranger");
    for h in [&a, &b, &c, &f, &r] {
        relay.enrol(h).await;
    }
    // gamma accepts beta only.
    let list = SenderList {
        target_pubkey: c.pubkey(),
        senders: vec![b.pubkey()],
        iat_ms: relay.now(),
        record: "{}".into(),
        sig: "x".into(),
    };
    relay
        .with_store(move |s| s.put_sender_list(list).unwrap())
        .await;
    relay.revoke(&r).await;

    // Push refusals. One request: accepted, target not enrolled, sender not accepted,
    // duplicate target, bad item id.
    let now = relay.now();
    let plain = plain_envelope(&a, &b, "first", now);
    let seal = |p: &agentmbx_protocol::envelope::Envelope| {
        agentmbx_protocol::seal::seal_envelope(p, &b.enc.public(), &a.name, &a.key)
            .unwrap()
            .wire_json()
    };
    let (first, second) = (seal(&plain), seal(&plain));
    let (id_d, wire_d) = sealed_wire(&a, &stranger, "to nobody", now);
    let (id_c, wire_c) = sealed_wire(&a, &c, "not accepted", now);
    let (id_bb, wire_bb) = sealed_wire(&a, &b, "twice", now);
    let twice = item(
        "envelope",
        &id_bb,
        &[(&b, wire_bb.as_bytes()), (&b, wire_bb.as_bytes())],
    );
    let p = relay
        .push(
            &a,
            vec![
                env_item(&plain.id, &b, &first),
                env_item(&id_d, &stranger, &wire_d),
                env_item(&id_c, &c, &wire_c),
                twice,
                env_item("", &b, &first),
            ],
        )
        .await;
    assert_eq!(
        p.statuses(),
        [
            "accepted",
            "rejected:target not enrolled",
            "rejected:sender not accepted by target",
            "rejected:duplicate target",
            "rejected:bad item id"
        ]
    );
    // Another: a conflict (same id, other bytes) and a full queue (max_queue_items 1).
    relay.clock.advance(1_000);
    let (id_q, wire_q) = sealed_wire(&a, &b, "one too many", relay.now());
    let p = relay
        .push(
            &a,
            vec![
                env_item(&plain.id, &b, &second),
                env_item(&id_q, &b, &wire_q),
            ],
        )
        .await;
    let s = p.statuses();
    assert_eq!(s[0], "rejected:conflict");
    assert!(s[1].starts_with("rejected:quota:queue depth"), "{s:?}");
    // Four pushes of two items by one sender with a limit of three a minute: the last two
    // items are `rate`.
    for i in 0..4 {
        let items = (0..2)
            .map(|j| {
                let (id, wire) = sealed_wire(&f, &stranger, &format!("{i}.{j}"), relay.now());
                env_item(&id, &stranger, &wire)
            })
            .collect();
        let want = if i < 3 {
            "rejected:target not enrolled"
        } else {
            "rejected:rate"
        };
        assert_eq!(relay.push(&f, items).await.statuses(), [want, want]);
    }

    // Caller refusals.
    let target = "/v2/relay/items";
    let signed = |h: &Host, ts: i64| h.hop_headers("GET", target, "", ts);
    let without = |headers: Vec<(String, String)>, name: &str| {
        headers
            .into_iter()
            .filter(|(k, _)| k != name)
            .collect::<Vec<_>>()
    };
    let with = |headers: Vec<(String, String)>, name: &str, value: &str| {
        headers
            .into_iter()
            .map(|(k, v)| {
                if k == name {
                    (k, value.to_owned())
                } else {
                    (k, v)
                }
            })
            .collect::<Vec<_>>()
    };
    let mut sigs = Vec::new();
    let send = |headers: Vec<(String, String)>| {
        let relay = &relay;
        async move { relay.send("GET", target, &headers, Vec::new()).await }
    };
    let h = signed(&a, relay.now());
    sigs.extend(
        h.iter()
            .filter(|(k, _)| k == "x-mbx-sig")
            .map(|(_, v)| v.clone()),
    );
    assert_eq!(send(without(h.clone(), "x-mbx-sig")).await.status, 401);
    assert_eq!(send(with(h.clone(), "x-mbx-ts", "soon")).await.status, 401);
    assert_eq!(
        send(with(h.clone(), "x-mbx-key", "not-a-key")).await.status,
        401
    );
    // Signed for another target: the signature does not verify for this one.
    let other = a.hop_headers("GET", "/v2/relay/items?after=1", "", relay.now());
    let other_sig = other
        .iter()
        .find(|(k, _)| k == "x-mbx-sig")
        .unwrap()
        .1
        .clone();
    sigs.push(other_sig.clone());
    assert_eq!(
        send(with(h.clone(), "x-mbx-sig", &other_sig)).await.status,
        401
    );
    let stale = signed(&a, relay.now() - 400_000);
    sigs.extend(
        stale
            .iter()
            .filter(|(k, _)| k == "x-mbx-sig")
            .map(|(_, v)| v.clone()),
    );
    assert_eq!(send(stale).await.status, 401);
    let h = signed(&stranger, relay.now());
    sigs.extend(
        h.iter()
            .filter(|(k, _)| k == "x-mbx-sig")
            .map(|(_, v)| v.clone()),
    );
    assert_eq!(send(h).await.json["code"], "NOT_ENROLLED");
    let h = signed(&r, relay.now());
    sigs.extend(
        h.iter()
            .filter(|(k, _)| k == "x-mbx-sig")
            .map(|(_, v)| v.clone()),
    );
    assert_eq!(send(h).await.json["code"], "REVOKED");
    const WRONG: &str = "wrong-token-0123456789abcdef";
    assert_eq!(stats(WRONG).await.status, 401);
    // An enrolment with no challenge pending.
    let e = relay
        .plain(
            "POST",
            "/v1/relay/enrol",
            &stranger.enrol_body("no-such-challenge"),
        )
        .await;
    assert_eq!(e.json["code"], "NO_CHALLENGE", "{e:#?}");

    let after = stats(ADMIN).await.assert_ok().clone();
    // The writer's counters are still there.
    for k in ["write_requests", "groups", "commits", "queued"] {
        assert!(after[k].is_u64(), "{k}: {after}");
    }
    let nonzero = |side: &str| {
        after["refused"][side]
            .as_object()
            .unwrap()
            .iter()
            .filter(|(_, v)| **v != 0)
            .map(|(k, v)| (k.clone(), v.as_u64().unwrap()))
            .collect::<std::collections::BTreeMap<String, u64>>()
    };
    let want = |pairs: &[(&str, u64)]| {
        pairs
            .iter()
            .map(|(k, v)| ((*k).to_owned(), *v))
            .collect::<std::collections::BTreeMap<String, u64>>()
    };
    assert_eq!(
        nonzero("push"),
        want(&[
            ("target_not_enrolled", 1 + 6),
            ("sender_not_accepted", 1),
            ("duplicate_target", 1),
            ("bad_item_id", 1),
            ("conflict", 1),
            ("quota_queue_depth", 1),
            ("rate_limit", 2),
        ]),
        "{after}"
    );
    assert_eq!(
        nonzero("auth"),
        want(&[
            ("missing_header", 1),
            ("bad_timestamp", 1),
            ("bad_key", 1),
            ("bad_signature", 1),
            ("stale_timestamp", 1),
            ("not_enrolled", 1),
            ("revoked", 1),
            ("admin_token", 1),
            ("no_challenge", 1),
        ]),
        "{after}"
    );
    // Every key is listed, zero or not.
    assert!(
        after["refused"]["push"]["quota_owner_queue_bytes"] == 0,
        "{after}"
    );
    assert!(after["refused"]["auth"]["bad_token"] == 0, "{after}");

    // One DEBUG line per refusal, with its reason and no key material.
    let text = String::from_utf8_lossy(&log.0.lock().unwrap()).into_owned();
    let lines = |what: &str| -> Vec<String> {
        text.lines()
            .filter(|l| l.contains("DEBUG") && l.contains(what))
            .map(str::to_owned)
            .collect()
    };
    let (pushed, callers) = (lines("push item refused"), lines("caller refused"));
    assert_eq!(pushed.len(), 14, "{pushed:#?}");
    assert_eq!(callers.len(), 9, "{callers:#?}");
    for reason in [
        "quota_queue_depth",
        "conflict",
        "rate_limit",
        "sender_not_accepted",
    ] {
        assert!(
            pushed.iter().any(|l| l.contains(reason)),
            "{reason}: {pushed:#?}"
        );
    }
    let a_fp = a.key.public().fingerprint();
    assert!(
        callers
            .iter()
            .any(|l| l.contains("stale_timestamp") && l.contains(&a_fp[..9])),
        "{callers:#?}"
    );
    let mut secrets: Vec<String> = vec![ADMIN.into(), WRONG.into()];
    for h in [&a, &b, &c, &f, &r, &stranger] {
        secrets.push(h.pubkey());
        secrets.push(h.pubkey().trim_end_matches('=').to_owned());
        secrets.push(h.key.public().fingerprint());
    }
    secrets.extend(sigs);
    for line in pushed.iter().chain(&callers) {
        for secret in &secrets {
            assert!(!line.contains(secret.as_str()), "{secret} in {line}");
        }
    }
    relay.stop().await;
}
