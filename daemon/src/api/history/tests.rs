//! `GET /v1/replay` and `/v1/catchup` served for real (see `api::test_support`).

use serde_json::json;

use crate::api::test_support::*;

impl Api {
    /// Sends from alice to bob with `body`, in thread `thread` when given (a reply); its id.
    async fn send_body(&self, body: &str, reply_to: Option<&str>) -> String {
        let mut req = json!({"from": "alice", "to": ["bob"], "subject": "s", "body": body});
        if let Some(r) = reply_to {
            req["reply_to"] = json!(r);
        }
        let (status, answer) = self.post("/v1/messages", &req, None).await;
        assert_eq!(status, 201, "{answer}");
        answer["id"].as_str().unwrap().to_string()
    }

    fn bob_states(&self) -> Vec<String> {
        self.store
            .mailbox
            .with(|c| {
                Ok(
                    c.prepare("SELECT state FROM deliveries WHERE agent = 'bob' ORDER BY seq")?
                        .query_map([], |r| r.get(0))?
                        .collect::<Result<_, _>>()?,
                )
            })
            .unwrap()
    }
}

/// Issue 18: `GET /v1/replay` pages bob's history with bodies, bounded by count and bytes (a
/// message alone over the budget still makes a page), filters by thread, marks nothing read,
/// and refuses another agent's cursor and out-of-range bounds.
#[tokio::test]
async fn replay_pages_by_count_and_bytes_with_bodies_and_marks_nothing_read() {
    let api = Api::start().await;
    let first = api.send_body("one", None).await;
    let big = api.send_body(&"x".repeat(10_000), None).await;
    let reply = api.send_body("three", Some(&first)).await;
    let (status, page) = api.get("/v1/replay?as=bob&limit=2").await;
    assert_eq!(status, 200, "{page}");
    assert_eq!(ids_of(&page), vec![first.clone(), big.clone()]);
    assert_eq!(page["messages"][0]["body"], "one");
    assert_eq!(page["has_more"], true);
    let next = page["next_cursor"].as_str().unwrap().to_string();
    let (_, page) = api.get(&format!("/v1/replay?as=bob&cursor={next}")).await;
    assert_eq!(ids_of(&page), vec![reply.clone()]);
    assert_eq!(page["has_more"], false);
    assert!(page["next_cursor"].is_null());
    // Bytes: at 2048 the 10 kB message comes alone, on a page of its own.
    let (_, page) = api.get("/v1/replay?as=bob&max_bytes=2048").await;
    assert_eq!(ids_of(&page), vec![first.clone()]);
    let next = page["next_cursor"].as_str().unwrap().to_string();
    let (_, page) = api
        .get(&format!("/v1/replay?as=bob&max_bytes=2048&cursor={next}"))
        .await;
    assert_eq!(ids_of(&page), vec![big.clone()]);
    assert_eq!(page["messages"][0]["body"].as_str().unwrap().len(), 10_000);
    assert_eq!(page["has_more"], true);
    // Thread: the first message and its reply.
    let (_, page) = api.get(&format!("/v1/replay?as=bob&thread={first}")).await;
    assert_eq!(ids_of(&page), vec![first.clone(), reply.clone()]);
    // Nothing was marked read.
    assert_eq!(api.bob_states(), vec!["new"; 3]);
    // Another agent's cursor, and bounds.
    for bad in [
        "/v1/replay?as=bob&cursor=carol.1",
        "/v1/replay?as=bob&limit=0",
        "/v1/replay?as=bob&limit=201",
        "/v1/replay?as=bob&max_bytes=2047",
        "/v1/replay?as=bob&max_bytes=262145",
        "/v1/replay?as=bob&thread=",
    ] {
        let (status, body) = api.get(bad).await;
        assert_eq!(
            (status, body["code"].as_str()),
            (400, Some("BAD_REQUEST")),
            "{bad}: {body}"
        );
    }
    let long = format!("/v1/replay?as=bob&cursor={}", "1".repeat(2049));
    assert_eq!(api.get(&long).await.0, 400);
}

/// Issue 18: catchup lists what arrived since bob's stored position, the commit moves it
/// forward only (idempotent with a key, 409 for the key with another body), restart all / now
/// set it, another agent's cursor is 400, and nothing is marked read.
#[tokio::test]
async fn catchup_lists_since_the_stored_position_and_commit_moves_it_forward_only() {
    let api = Api::start().await;
    let a = api.send_body("a", None).await;
    let b = api.send_body("b", None).await;
    let (status, page) = api.get("/v1/catchup?as=bob").await;
    assert_eq!(status, 200, "{page}");
    assert_eq!(ids_of(&page), vec![a.clone(), b.clone()]);
    // Without a commit, the same again.
    let (_, again) = api.get("/v1/catchup?as=bob&limit=1").await;
    assert_eq!(ids_of(&again), vec![a.clone()]);
    let early = again["cursor"].as_str().unwrap().to_string();
    let late = page["cursor"].as_str().unwrap().to_string();
    let commit = |cursor: &str| json!({"as": "bob", "cursor": cursor});
    let (status, answer) = api
        .post("/v1/catchup/commit", &commit(&late), Some("k1"))
        .await;
    assert_eq!(
        (status, answer["position"].as_str()),
        (200, Some(late.as_str())),
        "{answer}"
    );
    // The same key and body: the first answer; another body: 409.
    let (status, replay) = api
        .post("/v1/catchup/commit", &commit(&late), Some("k1"))
        .await;
    assert_eq!((status, &replay), (200, &answer));
    let (status, _) = api
        .post("/v1/catchup/commit", &commit(&early), Some("k1"))
        .await;
    assert_eq!(status, 409);
    // Never back.
    let (status, answer) = api.post("/v1/catchup/commit", &commit(&early), None).await;
    assert_eq!(
        (status, answer["position"].as_str()),
        (200, Some(late.as_str()))
    );
    let (_, page) = api.get("/v1/catchup?as=bob").await;
    assert!(ids_of(&page).is_empty(), "{page}");
    let c = api.send_body("c", None).await;
    let (_, page) = api.get("/v1/catchup?as=bob").await;
    assert_eq!(ids_of(&page), vec![c.clone()]);
    // Restart from the beginning, then from now.
    let restart = |from: &str| json!({"as": "bob", "from": from});
    let (status, _) = api.post("/v1/catchup/restart", &restart("all"), None).await;
    assert_eq!(status, 200);
    let (_, page) = api.get("/v1/catchup?as=bob").await;
    assert_eq!(ids_of(&page), vec![a.clone(), b.clone(), c.clone()]);
    let (status, _) = api.post("/v1/catchup/restart", &restart("now"), None).await;
    assert_eq!(status, 200);
    let (_, page) = api.get("/v1/catchup?as=bob").await;
    assert!(ids_of(&page).is_empty(), "{page}");
    // Another agent's cursor, a cursor past the newest, a bad `from`.
    let (status, _) = api
        .post(
            "/v1/catchup/commit",
            &json!({"as": "carol", "cursor": late}),
            None,
        )
        .await;
    assert_eq!(status, 400);
    let (status, _) = api
        .post("/v1/catchup/commit", &commit("bob.99"), None)
        .await;
    assert_eq!(status, 400);
    assert_eq!(
        api.get(&format!("/v1/catchup?as=carol&cursor={late}"))
            .await
            .0,
        400
    );
    assert_eq!(
        api.post("/v1/catchup/restart", &restart("later"), None)
            .await
            .0,
        400
    );
    assert_eq!(api.bob_states(), vec!["new"; 3]);
}
