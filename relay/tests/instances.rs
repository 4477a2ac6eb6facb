//! Two daemons on one host key, over HTTP against a served relay: hops carrying the unsigned
//! `x-mbx-instance` header feed the relay's per-key record, and a key whose instance ids
//! alternate is told in `you.instance_conflict` of its signed `GET /v2/relay/info` and counted
//! in `GET /v2/relay/admin/stats` (`instance_conflicts`). One id, a restart (one id, then
//! another for good) and hops without the header never count.

use serde_json::Value;

use agentmbx_protocol::instance::{CONFLICT_WINDOW_MS, INSTANCE_HEADER};
use agentmbx_relay::config::{AdminToken, RelayConfig};

use crate::helper::*;

const ADMIN: &str = "admin-token-0123456789abcdef";

/// A signed hop from `host` with instance id `id` (no header for `None`).
async fn hop_as(relay: &Relay, host: &Host, id: Option<&str>, target: &str) -> Resp {
    let mut headers = host.hop_headers("GET", target, "", relay.now());
    if let Some(id) = id {
        headers.push((INSTANCE_HEADER.to_owned(), id.to_owned()));
    }
    relay.send("GET", target, &headers, Vec::new()).await
}

/// `you` of a signed info from `host` carrying `id`; asserts it is there.
async fn you(relay: &Relay, host: &Host, id: Option<&str>) -> Value {
    let r = hop_as(relay, host, id, "/v2/relay/info").await;
    let info = r.assert_ok();
    assert_eq!(info["you"]["pubkey"], host.pubkey().as_str(), "{info}");
    info["you"].clone()
}

/// `instance_conflicts` of the admin stats.
async fn conflict_stats(relay: &Relay) -> Value {
    let auth = vec![("authorization".to_owned(), format!("Bearer {ADMIN}"))];
    let r = relay
        .send("GET", "/v2/relay/admin/stats", &auth, Vec::new())
        .await;
    r.assert_ok()["instance_conflicts"].clone()
}

/// Six hops from `host`, pulls and infos in turn, carrying `ids` in order.
async fn hops(relay: &Relay, host: &Host, ids: &[Option<&str>]) {
    for (i, id) in ids.iter().enumerate() {
        let target = if i % 2 == 0 {
            "/v2/relay/items?after=0"
        } else {
            "/v2/relay/info"
        };
        let r = hop_as(relay, host, *id, target).await;
        assert_eq!(r.status, 200, "{r:#?}");
    }
}

#[tokio::test]
async fn alternating_instance_ids_of_one_key_are_reported_in_signed_info_and_counted() {
    let relay = Relay::start_with_config(RelayConfig {
        admin_token: Some(AdminToken::new(ADMIN).unwrap()),
        ..RelayConfig::default()
    })
    .await;
    let (single, restarted, bare, cloned) = (
        Host::new("single"),
        Host::new("restarted"),
        Host::new("bare"),
        Host::new("cloned"),
    );
    for h in [&single, &restarted, &bare, &cloned] {
        relay.enrol(h).await;
    }
    let (a, b) = (Some("aaaa0001"), Some("bbbb0002"));
    // One daemon: one id all along.
    hops(&relay, &single, &[a, a, a, a, a, a, a, a]).await;
    // A restart: one id, then another for good (one stray hop of the old process included).
    hops(&relay, &restarted, &[a, a, a, b, a, b, b, b]).await;
    // Hops without the header (0.5.x daemons, the CLI) never count, whatever else is sent.
    hops(&relay, &bare, &[None, a, None, b, None, None, b, None]).await;
    for h in [&single, &restarted, &bare] {
        let y = you(&relay, h, None).await;
        assert!(y.get("instance_conflict").is_none(), "{}: {y}", h.name);
    }
    assert_eq!(
        conflict_stats(&relay).await,
        serde_json::json!({"detected": 0, "active": 0})
    );

    // Two daemons with one key: their hops alternate.
    hops(&relay, &cloned, &[a, b, a, b, a, b, a, b]).await;
    for id in [a, b, None] {
        let y = you(&relay, &cloned, id).await;
        let c = &y["instance_conflict"];
        assert_eq!(c["instances"], 2, "{y}");
        assert!(c["returns"].as_u64().unwrap() >= 3, "{y}");
        assert_eq!(c["window_ms"], CONFLICT_WINDOW_MS, "{y}");
        assert!(c["since_ms"].as_i64().unwrap() <= c["last_ms"].as_i64().unwrap());
    }
    // Only that key is told; unsigned info has no `you` at all.
    for h in [&single, &restarted, &bare] {
        let y = you(&relay, h, None).await;
        assert!(y.get("instance_conflict").is_none(), "{}: {y}", h.name);
    }
    let unsigned = relay.plain("GET", "/v2/relay/info", "").await;
    assert!(unsigned.assert_ok().get("you").is_none());
    // One detection however long the alternation goes on.
    hops(&relay, &cloned, &[a, b, a, b]).await;
    assert_eq!(
        conflict_stats(&relay).await,
        serde_json::json!({"detected": 1, "active": 1})
    );
    relay.stop().await;
}
