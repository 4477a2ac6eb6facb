//! `GET /v1/threads/{id}` served for real (see `api::test_support`).

use serde_json::json;

use crate::api::test_support::*;

#[tokio::test]
async fn a_thread_lists_what_the_agent_sees_in_order_in_bounded_pages() {
    let api = Api::start().await;
    let first = api.send(&["bob"], "plan").await;
    let mut ids = vec![first.clone()];
    for (from, to) in [("bob", "alice"), ("alice", "bob")] {
        let out = api
            .send_json(
                json!({"from": from, "to": [to], "subject": "r", "reply_to": ids.last().unwrap()}),
            )
            .await;
        ids.push(out["id"].as_str().unwrap().to_string());
    }
    // Mail of the same thread to carol only: bob does not see it.
    api.send_json(json!({"from": "alice", "to": ["carol"], "subject": "aside", "thread": first}))
        .await;
    let unrelated = api.send(&["bob"], "other").await;
    // By a message id (any of the thread's) or by the thread id, oldest first, bodies included.
    for by in [&first, &ids[2]] {
        let (status, page) = api.get(&format!("/v1/threads/{by}?as=bob")).await;
        assert_eq!(status, 200, "{page}");
        assert_eq!(page["thread"], first.as_str());
        assert_eq!(ids_of(&page), ids, "{page}");
        assert!(page["next_cursor"].is_null());
        assert_eq!(page["messages"][0]["body"], "b");
    }
    assert!(
        !ids_of(&api.get(&format!("/v1/threads/{first}?as=alice")).await.1).contains(&unrelated)
    );
    assert_eq!(
        ids_of(&api.get(&format!("/v1/threads/{first}?as=carol")).await.1).len(),
        1
    );
    // Pages with a cursor.
    let mut seen = vec![];
    let mut cursor = String::new();
    loop {
        let (status, page) = api
            .get(&format!(
                "/v1/threads/{first}?as=bob&limit=2&cursor={cursor}"
            ))
            .await;
        assert_eq!(status, 200, "{page}");
        seen.extend(ids_of(&page));
        match page["next_cursor"].as_str() {
            Some(c) => cursor = c.to_string(),
            None => break,
        }
    }
    assert_eq!(seen, ids);
    // Listing marks nothing read.
    let (_, inbox) = api.inbox("").await;
    assert!(
        inbox["messages"]
            .as_array()
            .unwrap()
            .iter()
            .all(|m| m["state"] == "new"),
        "{inbox}"
    );
    // Nothing the agent can see: 404; bad cursor and limit: 400.
    api.store.register("home", &["dave"]);
    for q in [
        format!("{first}?as=dave"),
        "01KDVDNA3VG2MH8KWSQRCWJZ0S?as=bob".into(),
    ] {
        let (status, body) = api.get(&format!("/v1/threads/{q}")).await;
        assert_eq!(
            (status, body["code"].as_str()),
            (404, Some("NOT_FOUND")),
            "{body}"
        );
    }
    for q in [
        format!("cursor={unrelated}"),
        "limit=0".into(),
        "limit=201".into(),
    ] {
        let (status, _) = api.get(&format!("/v1/threads/{first}?as=bob&{q}")).await;
        assert_eq!(status, 400, "{q}");
    }
}
