//! `POST /v1/wakes/*` served for real (see `api::test_support`).

use serde_json::json;

use crate::api::test_support::*;

/// Issue 18 (3): a wait with `notify=false` (the MCP server's channel watcher) returns new mail
/// without recording it `notified`; `/v1/wakes/claim` decides once for the agent (a second
/// claim of the same mail is `none`), `status` mail never wakes, and mute/unmute are checked.
#[tokio::test]
async fn a_watcher_wait_records_nothing_and_wakes_are_claimed_once() {
    let api = Api::start().await;
    let (_, first) = api.inbox("").await;
    let cursor = first["cursor"].as_str().unwrap().to_string();
    let (status, body) = api
        .post(
            "/v1/messages",
            &json!({"from": "alice", "to": ["bob"], "subject": "do it", "body": "b", "kind": "request"}),
            None,
        )
        .await;
    assert_eq!(status, 201, "{body}");
    let id = body["id"].as_str().unwrap().to_string();
    let (status, page) = api
        .inbox(&format!("&wait=5&notify=false&cursor={cursor}"))
        .await;
    assert_eq!(status, 200, "{page}");
    assert_eq!(ids_of(&page), vec![id.clone()]);
    assert_eq!(
        api.store
            .scalar::<i64>("SELECT COUNT(*) FROM deliveries WHERE notified_at IS NOT NULL"),
        0
    );
    let claim = json!({"as": "bob", "ids": [id]});
    let (status, d) = api.post("/v1/wakes/claim", &claim, None).await;
    assert_eq!(status, 200, "{d}");
    assert_eq!(d, json!({"decision": "wake", "messages": [id]}));
    let (_, again) = api.post("/v1/wakes/claim", &claim, None).await;
    assert_eq!(again, json!({"decision": "none"}));
    let status_id = api.send(&["bob"], "fyi").await;
    let (_, s) = api
        .post(
            "/v1/wakes/claim",
            &json!({"as": "bob", "ids": [status_id]}),
            None,
        )
        .await;
    assert_eq!(s, json!({"decision": "none"}));
    for bad in [
        json!({"as": "bob", "minutes": 0}),
        json!({"as": "bob", "minutes": 10081}),
    ] {
        let (status, body) = api.post("/v1/wakes/mute", &bad, None).await;
        assert_eq!(
            (status, body["code"].as_str()),
            (400, Some("BAD_REQUEST")),
            "{body}"
        );
    }
    let (status, m) = api
        .post("/v1/wakes/mute", &json!({"as": "bob"}), None)
        .await;
    assert_eq!(status, 200, "{m}");
    assert!(m["until_ms"].as_i64().unwrap() > 0);
    let (_, u) = api
        .post("/v1/wakes/unmute", &json!({"as": "bob"}), None)
        .await;
    assert_eq!(u, json!({"was_muted": true}));
    let (status, _) = api
        .post("/v1/wakes/unmute", &json!({"as": "nobody"}), None)
        .await;
    assert_eq!(status, 404);
}
