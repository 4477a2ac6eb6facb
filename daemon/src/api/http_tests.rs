//! The local API end to end, router-wide: the token, agent names, malformed requests, a busy
//! store and the idempotency table on every route. The tests of each handler live beside it
//! (`messages/tests.rs`, `inbox/tests.rs`, …) over the same fixtures in `test_support.rs`.

use serde_json::{json, Value};

use crate::api::test_support::*;
use crate::testutil::{self};

#[tokio::test]
async fn every_route_but_health_needs_the_token() {
    let api = Api::start().await;
    let resp = api
        .http
        .get(format!("{}/v1/inbox?as=bob", api.base))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status().as_u16(), 401);
    let resp = api
        .http
        .get(format!("{}/v1/health", api.base))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status().as_u16(), 200);
}

#[tokio::test]
async fn a_malformed_agent_name_is_a_bad_request_on_every_mailbox_route() {
    let api = Api::start().await;
    let id = api.send(&["bob"], "hi").await;
    for path in [
        "/v1/inbox?as=Bob".to_string(),
        "/v1/sent?as=ALICE".to_string(),
        format!("/v1/messages/{id}?as=b%40x"),
    ] {
        let (status, body) = api.get(&path).await;
        assert_eq!(status, 400, "{path}: {body}");
        assert_eq!(body["code"], "BAD_REQUEST", "{path}: {body}");
        assert!(
            body["error"].as_str().unwrap().contains("bad agent name"),
            "{body}"
        );
    }
    let (status, body) = api
        .post("/v1/ack", &json!({"as": "-bob", "ids": [id]}), None)
        .await;
    assert_eq!(status, 400, "{body}");
    // Nothing changed: bob's copy is still new.
    let (_, page) = api.inbox("").await;
    assert_eq!(page["messages"][0]["state"], "new");
}

#[tokio::test]
async fn a_store_locked_by_another_process_answers_503_store_busy_and_changes_nothing() {
    let api = Api::start().await;
    // Another process (a backup, a `sqlite3` shell) holds the write lock.
    let other = api.store.fresh_conn();
    other.execute_batch("BEGIN IMMEDIATE").unwrap();
    let req = json!({"from": "alice", "to": ["bob"], "subject": "busy"});
    let resp = api
        .http
        .post(format!("{}/v1/messages", api.base))
        .bearer_auth(&api.token)
        .header("idempotency-key", "busy-1")
        .json(&req)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status().as_u16(), 503);
    let retry_after = resp
        .headers()
        .get("retry-after")
        .and_then(|v| v.to_str().ok())
        .map(str::to_string);
    assert_eq!(retry_after.as_deref(), Some("1"));
    let body: Value = resp.json().await.unwrap();
    assert_eq!(body["code"], "STORE_BUSY", "{body}");
    assert!(
        body["error"]
            .as_str()
            .unwrap()
            .contains("locked by another"),
        "{body}"
    );
    other.execute_batch("ROLLBACK").unwrap();
    assert_eq!(api.count("messages"), 0);
    // Nothing was recorded under the key: the retry stores the message, once.
    let (status, body) = api.post("/v1/messages", &req, Some("busy-1")).await;
    assert_eq!(status, 201, "{body}");
    assert_eq!(api.post("/v1/messages", &req, Some("busy-1")).await.0, 201);
    assert_eq!(api.count("messages"), 1);
}

/// Phrases of serde, serde_json, serde_urlencoded and axum that must never reach a client.
const LIBRARY_PHRASES: [&str; 6] = [
    "Failed to deserialize",
    "Failed to parse",
    "missing field",
    "unknown field `",
    "Json",
    "axum",
];

/// Every malformed request on every route kind (query routes, body routes, the open route,
/// unknown routes and methods) is answered `{error, code}` in our words with a stable code:
/// missing and unknown query parameters and body fields are named, invalid JSON has its own
/// code and position, an oversized body is 413 `BODY_TOO_LARGE`, a body not sent as JSON is
/// 415; nothing is stored.
#[tokio::test]
async fn malformed_requests_get_our_words_and_a_stable_code_on_every_route() {
    let api = Api::start().await;
    let send = json!({"from": "alice", "to": ["bob"], "subject": "s", "body": "b"}).to_string();
    let ack = json!({"as": "bob", "ids": ["01KDVDNA3VG2MH8KWSQRCWJZ0S"]}).to_string();
    let agent = json!({"name": "bob"}).to_string();
    let with_colour = |body: &str| {
        let mut v: Value = serde_json::from_str(body).unwrap();
        v["colour"] = json!("red");
        v.to_string()
    };
    let big = format!(
        r#"{{"from":"alice","to":["bob"],"subject":"s","body":"{}"}}"#,
        "x".repeat(super::MAX_REQUEST_BODY + 1)
    );
    const JSON: &str = "application/json";
    // (method, path, content type, body, status, code, a phrase the error must hold)
    let cases: Vec<(&str, String, &str, String, u16, &str, &str)> = vec![
        // Query routes: missing, unknown and mistyped parameters.
        (
            "GET",
            "/v1/inbox".into(),
            "",
            "".into(),
            400,
            "BAD_REQUEST",
            "missing query parameter `as`",
        ),
        (
            "GET",
            "/v1/sent".into(),
            "",
            "".into(),
            400,
            "BAD_REQUEST",
            "missing query parameter `as`",
        ),
        (
            "GET",
            "/v1/messages/01KDVDNA3VG2MH8KWSQRCWJZ0S".into(),
            "",
            "".into(),
            400,
            "BAD_REQUEST",
            "missing query parameter `as`",
        ),
        (
            "GET",
            "/v1/inbox?as=bob&colour=red".into(),
            "",
            "".into(),
            400,
            "BAD_REQUEST",
            "unknown query parameter `colour`",
        ),
        (
            "GET",
            "/v1/sent?as=bob&colour=red".into(),
            "",
            "".into(),
            400,
            "BAD_REQUEST",
            "unknown query parameter `colour`",
        ),
        (
            "GET",
            "/v1/messages/01KDVDNA3VG2MH8KWSQRCWJZ0S?as=bob&colour=red".into(),
            "",
            "".into(),
            400,
            "BAD_REQUEST",
            "unknown query parameter `colour`",
        ),
        (
            "GET",
            "/v1/threads/01KDVDNA3VG2MH8KWSQRCWJZ0S?as=bob&colour=red".into(),
            "",
            "".into(),
            400,
            "BAD_REQUEST",
            "unknown query parameter `colour`",
        ),
        (
            "POST",
            "/v1/messages/01KDVDNA3VG2MH8KWSQRCWJZ0S/reply".into(),
            JSON,
            json!({"from": "bob", "body": "b", "colour": "red"}).to_string(),
            400,
            "BAD_REQUEST",
            "unknown body field `colour`",
        ),
        (
            "GET",
            "/v1/agents?colour=red".into(),
            "",
            "".into(),
            400,
            "BAD_REQUEST",
            "unknown query parameter `colour`",
        ),
        (
            "GET",
            "/v1/health?colour=red".into(),
            "",
            "".into(),
            400,
            "BAD_REQUEST",
            "unknown query parameter `colour`",
        ),
        (
            "GET",
            "/v1/inbox?as=bob&limit=ten".into(),
            "",
            "".into(),
            400,
            "BAD_REQUEST",
            "query parameter `limit`",
        ),
        // Body routes: missing and unknown fields, invalid JSON, size, content type, query.
        (
            "POST",
            "/v1/messages".into(),
            JSON,
            "{}".into(),
            400,
            "BAD_REQUEST",
            "missing body field `from`",
        ),
        (
            "POST",
            "/v1/ack".into(),
            JSON,
            r#"{"as":"bob"}"#.into(),
            400,
            "BAD_REQUEST",
            "missing body field `ids`",
        ),
        (
            "POST",
            "/v1/agents".into(),
            JSON,
            "{}".into(),
            400,
            "BAD_REQUEST",
            "missing body field `name`",
        ),
        (
            "POST",
            "/v1/messages".into(),
            JSON,
            with_colour(&send),
            400,
            "BAD_REQUEST",
            "unknown body field `colour`",
        ),
        (
            "POST",
            "/v1/ack".into(),
            JSON,
            with_colour(&ack),
            400,
            "BAD_REQUEST",
            "unknown body field `colour`",
        ),
        (
            "POST",
            "/v1/agents".into(),
            JSON,
            with_colour(&agent),
            400,
            "BAD_REQUEST",
            "unknown body field `colour`",
        ),
        (
            "POST",
            "/v1/messages".into(),
            JSON,
            r#"{"from": "alice",}"#.into(),
            400,
            "INVALID_JSON",
            "line 1 column 18",
        ),
        (
            "POST",
            "/v1/ack".into(),
            JSON,
            r#"{"as": "#.into(),
            400,
            "INVALID_JSON",
            "line 1 column 7",
        ),
        (
            "POST",
            "/v1/agents".into(),
            JSON,
            "".into(),
            400,
            "INVALID_JSON",
            "empty",
        ),
        (
            "POST",
            "/v1/messages".into(),
            JSON,
            r#"{"from":"alice","to":"bob","subject":"s"}"#.into(),
            400,
            "BAD_REQUEST",
            "body field `to` must be",
        ),
        (
            "POST",
            "/v1/messages".into(),
            JSON,
            big.clone(),
            413,
            "BODY_TOO_LARGE",
            "limit",
        ),
        (
            "POST",
            "/v1/agents".into(),
            JSON,
            big,
            413,
            "BODY_TOO_LARGE",
            "limit",
        ),
        (
            "POST",
            "/v1/messages".into(),
            "text/plain",
            send.clone(),
            415,
            "UNSUPPORTED_MEDIA_TYPE",
            "application/json",
        ),
        (
            "POST",
            "/v1/ack".into(),
            "",
            ack.clone(),
            415,
            "UNSUPPORTED_MEDIA_TYPE",
            "application/json",
        ),
        (
            "POST",
            "/v1/agents".into(),
            "application/x-www-form-urlencoded",
            agent.clone(),
            415,
            "UNSUPPORTED_MEDIA_TYPE",
            "application/json",
        ),
        (
            "POST",
            "/v1/messages?colour=red".into(),
            JSON,
            send.clone(),
            400,
            "BAD_REQUEST",
            "unknown query parameter `colour`",
        ),
        // Unknown routes and methods.
        (
            "GET",
            "/v1/nothing".into(),
            "",
            "".into(),
            404,
            "NOT_FOUND",
            "not found",
        ),
        (
            "DELETE",
            "/v1/inbox?as=bob".into(),
            "",
            "".into(),
            405,
            "METHOD_NOT_ALLOWED",
            "method",
        ),
        (
            "PUT",
            "/v1/messages".into(),
            JSON,
            send,
            405,
            "METHOD_NOT_ALLOWED",
            "method",
        ),
        (
            "POST",
            "/v1/health".into(),
            JSON,
            "{}".into(),
            405,
            "METHOD_NOT_ALLOWED",
            "method",
        ),
    ];
    for (method, path, content_type, body, status, code, phrase) in cases {
        let mut req = api
            .http
            .request(method.parse().unwrap(), format!("{}{path}", api.base))
            .bearer_auth(&api.token);
        if !content_type.is_empty() {
            req = req.header("content-type", content_type);
        }
        if !body.is_empty() {
            req = req.body(body);
        }
        let resp = req.send().await.unwrap();
        let got = resp.status().as_u16();
        let text = resp.text().await.unwrap();
        let answer: Value = serde_json::from_str(&text)
            .unwrap_or_else(|_| panic!("{method} {path}: not JSON: {text}"));
        let error = answer["error"].as_str().unwrap_or_default();
        assert_eq!(
            (got, answer["code"].as_str()),
            (status, Some(code)),
            "{method} {path}: {text}"
        );
        assert!(error.contains(phrase), "{method} {path}: {error}");
        for library in LIBRARY_PHRASES {
            assert!(!error.contains(library), "{method} {path}: {error}");
        }
    }
    assert_eq!(api.count("messages"), 0);
}

/// Every route that acts as an agent (`as`, or a reply's `from`) answers a name that is no
/// agent here the same way: 404 `UNKNOWN_AGENT` with the closest names, and nothing changes.
#[tokio::test]
async fn every_route_acting_as_an_unknown_agent_is_404_unknown_agent() {
    let api = Api::start().await;
    let id = api.send(&["bob"], "hi").await;
    let before = (api.count("messages"), api.count("deliveries"));
    let checks = [
        api.get(&format!("/v1/threads/{id}?as=bbo")).await,
        api.get("/v1/sent?as=alcie").await,
        api.post("/v1/ack", &json!({"as": "bbo", "ids": [id]}), None)
            .await,
        api.post(
            &format!("/v1/messages/{id}/reply"),
            &json!({"from": "bbo", "body": "b"}),
            None,
        )
        .await,
    ];
    for (status, body) in checks {
        assert_eq!(
            (status, body["code"].as_str()),
            (404, Some("UNKNOWN_AGENT")),
            "{body}"
        );
        assert!(
            body["error"].as_str().unwrap().contains("did you mean"),
            "{body}"
        );
    }
    assert_eq!((api.count("messages"), api.count("deliveries")), before);
    // The real agents are answered as before.
    assert_eq!(api.get(&format!("/v1/threads/{id}?as=bob")).await.0, 200);
    assert_eq!(api.get("/v1/sent?as=alice").await.0, 200);
}

/// Issue 18 (1): `POST /v1/agents` with an Idempotency-Key replays the first answer; the same
/// key with another body is 409 and changes nothing; the key is scoped to the agent name.
#[tokio::test]
async fn registering_an_agent_with_an_idempotency_key_replays_and_another_body_is_409() {
    let api = Api::start().await;
    let first = json!({"name": "dave", "role": "dev"});
    let (status, answer) = api.post("/v1/agents", &first, Some("k1")).await;
    assert_eq!(status, 200, "{answer}");
    assert_eq!(answer["role"], "dev");
    // Changed in between: a replay still answers the first answer and changes nothing.
    let (status, _) = api
        .post("/v1/agents", &json!({"name": "dave", "role": "ops"}), None)
        .await;
    assert_eq!(status, 200);
    let (status, replay) = api.post("/v1/agents", &first, Some("k1")).await;
    assert_eq!((status, &replay), (200, &answer));
    let role = |api: &Api| -> String {
        api.store
            .mailbox
            .with(|c| {
                Ok(c.query_row(
                    "SELECT role FROM agents WHERE name = 'dave' AND host = 'home'",
                    [],
                    |r| r.get(0),
                )?)
            })
            .unwrap()
    };
    assert_eq!(role(&api), "ops", "the replay did not register again");
    let (status, body) = api
        .post(
            "/v1/agents",
            &json!({"name": "dave", "role": "qa"}),
            Some("k1"),
        )
        .await;
    assert_eq!(
        (status, body["code"].as_str()),
        (409, Some("CONFLICT")),
        "{body}"
    );
    assert_eq!(role(&api), "ops");
    // Another agent's registration may use the same key.
    let (status, other) = api
        .post("/v1/agents", &json!({"name": "erin"}), Some("k1"))
        .await;
    assert_eq!((status, other["name"].as_str()), (200, Some("erin")));
}

/// A keyed mutating request of an agent whose records of that operation are at their cap
/// inside the horizon is refused 503 `IDEMPOTENCY_FULL` with `Retry-After`, doing nothing and
/// keeping every record (a replay of a kept key still answers); past the horizon the oldest
/// is pruned and the request goes through.
#[tokio::test]
async fn a_full_idempotency_table_refuses_a_new_key_and_keeps_the_records() {
    use crate::mailbox::idempotency::{HORIZON_MS, MAX_RECORDS_PER_SCOPE};
    let api = Api::start().await;
    let (status, first) = api
        .post("/v1/agents", &json!({"name": "bob"}), Some("k-first"))
        .await;
    assert_eq!(status, 200, "{first}");
    // Fill bob's register scope to its cap (records made directly: the API's rate limit would take
    // a while), all newer than the first.
    let now = testutil::T0;
    api.store
        .mailbox
        .with(move |c| {
            let tx = c.transaction()?;
            for i in 1..MAX_RECORDS_PER_SCOPE {
                crate::mailbox::idempotency::record(
                    &tx,
                    "register:bob",
                    &format!("k{i}"),
                    "h",
                    200,
                    "{}",
                    now + 1_000,
                )?;
            }
            tx.commit()?;
            Ok(())
        })
        .unwrap();
    let resp = api
        .http
        .post(format!("{}/v1/agents", api.base))
        .bearer_auth(&api.token)
        .header("content-type", "application/json")
        .header("idempotency-key", "k-new")
        .body(json!({"name": "bob"}).to_string())
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status().as_u16(), 503);
    assert_eq!(
        resp.headers()["retry-after"],
        (HORIZON_MS / 1000).to_string().as_str()
    );
    let v: Value = resp.json().await.unwrap();
    assert_eq!(v["code"], "IDEMPOTENCY_FULL", "{v}");
    // The first record is kept and still replays; another agent is not refused.
    let (status, again) = api
        .post("/v1/agents", &json!({"name": "bob"}), Some("k-first"))
        .await;
    assert_eq!((status, &again), (200, &first));
    let (status, _) = api
        .post("/v1/agents", &json!({"name": "carol"}), Some("k-new"))
        .await;
    assert_eq!(status, 200);
    let count = |api: &Api| {
        api.store
            .mailbox
            .with(|c| {
                Ok(c.query_row(
                    "SELECT COUNT(*) FROM idempotency WHERE scope = 'register:bob'",
                    [],
                    |r| r.get::<_, i64>(0),
                )? as u64)
            })
            .unwrap()
    };
    assert_eq!(count(&api), MAX_RECORDS_PER_SCOPE);
    // Past the first record's horizon it is pruned and the new key goes through.
    api._clock.advance(HORIZON_MS + 1);
    let (status, v) = api
        .post("/v1/agents", &json!({"name": "bob"}), Some("k-new"))
        .await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(count(&api), MAX_RECORDS_PER_SCOPE);
}

/// Issue 19 (4): a key past the idempotency horizon is a new request, as documented: the same
/// key with another body is carried out, not answered 409 from the expired record.
#[tokio::test]
async fn a_key_past_the_horizon_is_a_new_request() {
    use crate::mailbox::idempotency::HORIZON_MS;
    let api = Api::start().await;
    let send =
        |subject: &str| json!({"from": "alice", "to": ["bob"], "subject": subject, "body": "b"});
    let (status, first) = api.post("/v1/messages", &send("one"), Some("k")).await;
    assert_eq!(status, 201, "{first}");
    let (status, _) = api.post("/v1/messages", &send("two"), Some("k")).await;
    assert_eq!(status, 409, "inside the horizon another body is a conflict");
    api._clock.advance(HORIZON_MS + 1);
    let (status, second) = api.post("/v1/messages", &send("two"), Some("k")).await;
    assert_eq!(status, 201, "{second}");
    assert_ne!(first["id"], second["id"]);
}
