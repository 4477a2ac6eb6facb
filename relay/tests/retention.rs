//! Retention over HTTP (spec §6, §7; `wire.md` §2.12 "Expiry notice", §3.2 "Sweep"): an
//! envelope nobody pulled expires after the published retention, the target's queue no longer
//! holds it, its sender pulls a notice signed by the relay key that `info` publishes, and a
//! late retry is a `duplicate` with the original seq, never a second delivery. Time moves on
//! the relay's manual clock; the sweep runs as the server runs it (`retention::sweep_once`).

use crate::helper;

use std::time::Duration;

use serde_json::{json, Value};

use agentmbx_protocol::b64;
use agentmbx_protocol::canonical;
use agentmbx_protocol::clock::Clock;
use agentmbx_protocol::keys::{HostKey, PublicKey};
use agentmbx_protocol::records::ExpiryNotice;
use agentmbx_protocol::time::iso_ms;

use agentmbx_relay::config::{LimitsConfig, RelayConfig};

use crate::helper::{env_item, sealed_wire, Host, Relay, T0};

const DAY_MS: i64 = 86_400_000;

/// `GET /v2/relay/info` (unsigned): the relay key it publishes and its retention in days.
async fn info(relay: &Relay) -> (PublicKey, u64) {
    let r = relay.plain("GET", "/v2/relay/info", "").await;
    let j = r.assert_ok();
    let key =
        PublicKey::from_b64(j["relay_pubkey"].as_str().expect("relay_pubkey")).expect("relay key");
    let days = j["limits"]["retention_days"]
        .as_u64()
        .expect("retention_days");
    (key, days)
}

/// The one item of a pull page and the page.
fn items(r: &helper::Resp) -> Vec<Value> {
    r.assert_ok()["items"].as_array().expect("items").clone()
}

/// Asserts `wire` is canonical `{notice, sig}` with `sig` by `relay` over canonical(notice);
/// returns the notice.
fn verified_notice(relay: &PublicKey, wire: &[u8]) -> Value {
    let v: Value = serde_json::from_slice(wire).expect("notice wire is JSON");
    assert_eq!(
        canonical::to_string(&v).expect("canonical").as_bytes(),
        wire,
        "the wire bytes are canonical JSON"
    );
    assert_eq!(
        v.as_object().map(|o| o.len()),
        Some(2),
        "{{notice, sig}}: {v}"
    );
    let signed = canonical::to_string(&v["notice"]).expect("canonical notice");
    assert!(
        relay.verify(signed.as_bytes(), v["sig"].as_str().expect("sig")),
        "the notice is signed by the relay key info publishes"
    );
    let typed: ExpiryNotice = serde_json::from_value(v["notice"].clone()).expect("typed notice");
    assert_eq!((typed.v, typed.kind.as_str()), (1, "relay-expired"));
    v["notice"].clone()
}

#[tokio::test]
async fn an_envelope_expires_after_retention_and_its_sender_pulls_a_signed_notice() {
    let relay = Relay::start().await;
    let (alpha, beta) = (Host::new("alpha"), Host::new("beta"));
    relay.enrol(&alpha).await;
    relay.enrol(&beta).await;
    let (relay_key, days) = info(&relay).await;
    assert_eq!(days, 14, "the default retention is published");
    assert_eq!(relay_key, relay.relay_pub);

    let (id, wire) = sealed_wire(&alpha, &beta, "hello", relay.now());
    let pushed = relay.push(&alpha, vec![env_item(&id, &beta, &wire)]).await;
    assert_eq!(pushed.status1(), "accepted");
    let result = pushed.json["results"][0].clone();
    let seq = result["targets"][0]["seq"].as_i64().expect("seq");
    let accepted_at = result["accept"]["at"]
        .as_str()
        .expect("accept at")
        .to_owned();
    assert_eq!(accepted_at, iso_ms(T0));

    // 1 ms before the 14 days are over the item is kept.
    relay.clock.advance(14 * DAY_MS - 1);
    let early = relay.sweep().await;
    assert_eq!(early.expired_items, 0, "{early:?}");
    assert_eq!(relay.queue_ids(&beta).await, vec![id.clone()]);

    relay.clock.advance(1);
    let swept = relay.sweep().await;
    assert_eq!(
        (swept.expired_envelopes, swept.notices),
        (1, 1),
        "{swept:?}"
    );
    let expired_at = relay.now();

    // The target's queue is empty.
    let target = relay.pull(&beta, "after=0&limit=500").await;
    assert!(items(&target).is_empty(), "{target:#?}");

    // The sender pulls the relay-signed notice.
    let sender = relay.pull(&alpha, "after=0&limit=500").await;
    let got = items(&sender);
    assert_eq!(got.len(), 1, "{sender:#?}");
    let n = &got[0];
    assert_eq!(n["kind"], "expired");
    assert_eq!(
        n["item_id"],
        json!(format!("expired:{id}:{}", beta.pubkey()))
    );
    assert_eq!(n["sender_pubkey"], json!(relay_key.to_b64()));
    assert_eq!(n["seq"], json!(expired_at), "seq = max(next_seq, now)");
    let wire_bytes = b64::decode(n["wire_b64"].as_str().expect("wire_b64")).expect("base64");
    let notice = verified_notice(&relay_key, &wire_bytes);
    assert_eq!(
        notice,
        json!({
            "v": 1, "type": "relay-expired", "item_id": id, "target_pubkey": beta.pubkey(),
            "accepted_at": accepted_at, "expired_at": iso_ms(expired_at),
        })
    );

    // A late retry of the expired item settles as a duplicate with the original seq and time,
    // and is not delivered again.
    relay.clock.advance(60_000);
    let retry = relay.push(&alpha, vec![env_item(&id, &beta, &wire)]).await;
    assert_eq!(retry.status1(), "duplicate");
    let again = &retry.json["results"][0];
    assert_eq!(again["targets"][0]["seq"], json!(seq));
    assert_eq!(again["accept"]["at"], json!(accepted_at));
    assert!(items(&relay.pull(&beta, "after=0&limit=500").await).is_empty());

    // The sweep is in the relay log.
    let ops = relay.with_store(|s| s.ops(10).expect("ops")).await;
    let sweep = ops
        .iter()
        .find(|o| o.op == "relay-sweep")
        .expect("a relay-sweep receipt");
    assert_eq!(sweep.receipt["type"], "relay-sweep");
    assert_eq!(sweep.receipt["at"], json!(iso_ms(expired_at)));
    assert_eq!(sweep.receipt["expired"]["envelope"], 1);
    assert_eq!(sweep.receipt["notices"], 1);
    relay.stop().await;
}

#[tokio::test]
async fn a_configured_retention_is_published_and_used() {
    let relay = Relay::start_with(LimitsConfig {
        retention_days: 2,
        ..LimitsConfig::default()
    })
    .await;
    let (alpha, beta) = (Host::new("alpha"), Host::new("beta"));
    relay.enrol(&alpha).await;
    relay.enrol(&beta).await;
    assert_eq!(info(&relay).await.1, 2);
    let (id, wire) = sealed_wire(&alpha, &beta, "short", relay.now());
    let pushed = relay.push(&alpha, vec![env_item(&id, &beta, &wire)]).await;
    assert_eq!(pushed.status1(), "accepted");
    relay.clock.advance(2 * DAY_MS - 1);
    assert_eq!(relay.sweep().await.expired_items, 0);
    relay.clock.advance(1);
    assert_eq!(relay.sweep().await.expired_items, 1);
    assert!(relay.queue_ids(&beta).await.is_empty());
    assert_eq!(
        relay.queue_ids(&alpha).await,
        vec![format!("expired:{id}:{}", beta.pubkey())]
    );
    relay.stop().await;
}

#[tokio::test]
async fn the_relay_sweeps_at_start() {
    let store_dir = tempfile::tempdir().expect("temp dir");
    let key = HostKey::generate();
    let (alpha, beta) = (Host::new("alpha"), Host::new("beta"));
    let id = {
        let relay =
            Relay::start_at(store_dir.path(), key.clone(), RelayConfig::default(), T0).await;
        relay.enrol(&alpha).await;
        relay.enrol(&beta).await;
        let (id, wire) = sealed_wire(&alpha, &beta, "while away", relay.now());
        let pushed = relay.push(&alpha, vec![env_item(&id, &beta, &wire)]).await;
        assert_eq!(pushed.status1(), "accepted");
        relay.stop().await;
        id
    };
    // Fifteen days later the relay starts again: its first sweep runs before anyone asks.
    let relay = Relay::start_at(
        store_dir.path(),
        key,
        RelayConfig::default(),
        T0 + 15 * DAY_MS,
    )
    .await;
    let expected = vec![format!("expired:{id}:{}", beta.pubkey())];
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    loop {
        let ids = relay.queue_ids(&alpha).await;
        if ids == expected {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "no notice 30 s after start: {ids:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(relay.queue_ids(&beta).await.is_empty());
    assert_eq!(
        relay.clock.now_ms(),
        T0 + 15 * DAY_MS,
        "the clock did not move"
    );
    relay.stop().await;
}
