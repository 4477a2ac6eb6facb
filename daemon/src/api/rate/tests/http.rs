//! The `[api_rate]` classes enforced by the real router (see `api::test_support`).

use serde_json::{json, Value};

use crate::api::test_support::*;

/// A tight `[api_rate]` for the rate tests: 3 sends and 4 polls a burst, refilled one a second.
fn tight() -> crate::config::ApiRateConfig {
    crate::config::ApiRateConfig {
        send_burst: 3,
        send_per_min: 60,
        wait_burst: 4,
        wait_per_min: 60,
        ..Default::default()
    }
}

/// A flood of sends from one agent is refused 429 `RATE_LIMIT` past its burst, with
/// `retry_after` (fractional seconds) and `Retry-After` (whole seconds, rounded up), and does
/// nothing; another agent's sends, and the same agent's polls, still go through; a second of
/// refill admits one more.
#[tokio::test]
async fn a_flood_from_one_agent_is_429_while_another_agent_goes_through() {
    let api = Api::start_with(tight()).await;
    let send = |from: &str, n: usize| json!({"from": from, "to": ["bob"], "subject": format!("s{n}"), "body": "b"});
    // At the burst: every one sent.
    for n in 0..3 {
        let (status, v) = api.post("/v1/messages", &send("alice", n), None).await;
        assert_eq!(status, 201, "{v}");
    }
    // Past it: 429 with the relay's code and shape.
    let resp = api
        .http
        .post(format!("{}/v1/messages", api.base))
        .bearer_auth(&api.token)
        .header("content-type", "application/json")
        .header("idempotency-key", "flood-1")
        .body(send("alice", 3).to_string())
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status().as_u16(), 429);
    assert_eq!(resp.headers()["retry-after"], "1");
    let v: Value = resp.json().await.unwrap();
    assert_eq!(v["code"], "RATE_LIMIT", "{v}");
    assert_eq!(v["retry_after"], 1.0, "{v}");
    assert!(v["error"].as_str().unwrap().contains("rate limit"), "{v}");
    // Nothing was done: bob has the 3 messages, and the key was not recorded.
    let (_, inbox) = api.get("/v1/inbox?as=bob&limit=50").await;
    assert_eq!(inbox["messages"].as_array().unwrap().len(), 3, "{inbox}");
    // Another agent's sends go through; alice's other classes too.
    let (status, v) = api.post("/v1/messages", &send("carol", 9), None).await;
    assert_eq!(status, 201, "{v}");
    let (status, v) = api.get("/v1/inbox?as=alice").await;
    assert_eq!(status, 200, "{v}");
    // Health is never metered.
    for _ in 0..20 {
        let resp = api
            .http
            .get(format!("{}/v1/health", api.base))
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status().as_u16(), 200);
    }
    // 400 ms of refill is not a token: retry_after says how long is left (fractional).
    api._clock.advance(400);
    let (status, v) = api.post("/v1/messages", &send("alice", 4), None).await;
    assert_eq!((status, v["retry_after"].as_f64()), (429, Some(0.6)), "{v}");
    // A whole second is one token, then empty again.
    api._clock.advance(600);
    let (status, v) = api
        .post("/v1/messages", &send("alice", 5), Some("flood-1"))
        .await;
    assert_eq!(status, 201, "{v}");
    let (status, _) = api.post("/v1/messages", &send("alice", 6), None).await;
    assert_eq!(status, 429);
}

/// Polls (`wait` class) from one agent: at the burst all pass, past it 429, while another
/// agent's polls pass; requests naming no agent share one bucket per class.
#[tokio::test]
async fn polls_have_their_own_class_and_requests_without_an_agent_share_a_bucket() {
    let api = Api::start_with(tight()).await;
    for _ in 0..4 {
        assert_eq!(api.get("/v1/inbox?as=bob").await.0, 200);
    }
    let (status, v) = api.get("/v1/inbox?as=bob&wait=5").await;
    assert_eq!((status, &v["code"]), (429, &json!("RATE_LIMIT")), "{v}");
    assert_eq!(api.get("/v1/inbox?as=carol").await.0, 200);
    // No `as` (a 400 from the route): four pass the shared bucket, the fifth is refused.
    for _ in 0..4 {
        assert_eq!(api.get("/v1/inbox").await.0, 400);
    }
    assert_eq!(api.get("/v1/inbox").await.0, 429);
    // Without the token: 401 first, never counted.
    let resp = api
        .http
        .get(format!("{}/v1/inbox?as=carol", api.base))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status().as_u16(), 401);
}
