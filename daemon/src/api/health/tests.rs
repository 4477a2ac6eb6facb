//! `GET /v1/health` served for real (see `api::test_support`).

use serde_json::{json, Value};

use crate::api::test_support::*;

/// `/v1/health` needs no token, and without one names no peer, relay or detail: a degraded
/// answer gives each reason's code only; with the API token (a wrong one counts as none), the
/// whole reasons.
#[tokio::test]
async fn health_without_the_token_gives_reason_codes_only_and_with_it_the_details() {
    let api = Api::start().await;
    let health = |bearer: Option<&str>| {
        let mut req = api.http.get(format!("{}/v1/health", api.base));
        if let Some(t) = bearer {
            req = req.bearer_auth(t);
        }
        async move {
            let resp = req.send().await.unwrap();
            assert_eq!(resp.status().as_u16(), 200);
            resp.json::<Value>().await.unwrap()
        }
    };
    assert_eq!(health(None).await["status"], "ok");
    // Peer `work`'s LAN hops alternate between two daemon instances.
    for id in ["a", "b"].iter().cycle().take(20) {
        if !api.instance.reasons().is_empty() {
            break;
        }
        api.instance
            .observe_peer("work", &api.work.host_key.public().to_b64(), id);
    }
    assert!(!api.instance.reasons().is_empty());

    for bearer in [None, Some("not-the-token")] {
        let h = health(bearer).await;
        assert_eq!(h["status"], "degraded", "{h}");
        assert_eq!(h["host"], "home", "{h}");
        assert_eq!(h["reasons"], json!([{"code": "peer-key-clone"}]), "{h}");
        assert!(!h.to_string().contains("work"), "{h}");
    }
    let h = health(Some(&api.token)).await;
    assert_eq!(h["status"], "degraded", "{h}");
    let r = &h["reasons"][0];
    assert_eq!(r["code"], "peer-key-clone", "{h}");
    assert_eq!(r["peer"], "work", "{h}");
    assert!(
        r["detail"].as_str().is_some_and(|d| d.contains("work")),
        "{h}"
    );
}
