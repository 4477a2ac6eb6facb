//! `GET /v1/inbox` served for real (see `api::test_support`): paging, filters and long polls.

use std::sync::Arc;

use serde_json::json;

use crate::api::test_support::*;

#[tokio::test]
async fn the_inbox_pages_by_count_and_cursor() {
    let api = Api::start().await;
    let mut sent = Vec::new();
    for n in 0..5 {
        sent.push(api.send(&["bob"], &format!("m{n}")).await);
    }
    let (status, p1) = api.inbox("&limit=2").await;
    assert_eq!(status, 200);
    assert_eq!(ids_of(&p1), sent[0..2].to_vec());
    let c1 = p1["next_cursor"].as_str().unwrap().to_string();
    let (_, p2) = api.inbox(&format!("&limit=2&cursor={c1}")).await;
    assert_eq!(ids_of(&p2), sent[2..4].to_vec());
    let c2 = p2["next_cursor"].as_str().unwrap().to_string();
    let (_, p3) = api.inbox(&format!("&limit=2&cursor={c2}")).await;
    assert_eq!(ids_of(&p3), sent[4..5].to_vec());
    assert!(p3["next_cursor"].is_null(), "the last page has no cursor");
    // A page that ends exactly at the end has no cursor either.
    let (_, all) = api.inbox("&limit=5").await;
    assert_eq!(ids_of(&all), sent);
    assert!(all["next_cursor"].is_null());
    // Bounds: 1 and 200 accepted, 0 and 201 refused; a bad cursor refused.
    assert_eq!(ids_of(&api.inbox("&limit=1").await.1), sent[0..1].to_vec());
    assert_eq!(api.inbox("&limit=200").await.0, 200);
    for bad in [
        "&limit=0",
        "&limit=201",
        "&cursor=abc",
        "&limit=-1",
        "&limit=x",
    ] {
        let (status, body) = api.inbox(bad).await;
        assert_eq!(status, 400, "{bad}: {body}");
        assert_eq!(
            body["code"], "BAD_REQUEST",
            "{bad}: errors are {{error, code}}"
        );
    }
    let (status, body) = api.get("/v1/inbox").await;
    assert_eq!(
        (status, body["code"].as_str()),
        (400, Some("BAD_REQUEST")),
        "{body}"
    );
    // Another agent's inbox is empty.
    let (_, other) = api.get("/v1/inbox?as=carol").await;
    assert!(ids_of(&other).is_empty());
}

#[tokio::test]
async fn inbox_filters_by_needs_reply_and_sender_and_shows_what_a_message_replies_to() {
    let api = Api::start().await;
    let plain = api.send(&["bob"], "plain").await;
    let asks = api
        .send_json(json!({"from": "alice", "to": ["bob"], "subject": "q", "needs_reply": true}))
        .await["id"]
        .as_str()
        .unwrap()
        .to_string();
    let from_carol = api
        .send_json(
            json!({"from": "carol", "to": ["bob", "alice"], "subject": "c", "reply_to": null}),
        )
        .await["id"]
        .as_str()
        .unwrap()
        .to_string();
    let (status, page) = api.inbox("&needs_reply=true").await;
    assert_eq!(status, 200, "{page}");
    assert_eq!(ids_of(&page), vec![asks.clone()]);
    assert_eq!(
        ids_of(&api.inbox("&from=carol").await.1),
        vec![from_carol.clone()]
    );
    assert_eq!(
        ids_of(&api.inbox("&from=alice@home").await.1),
        vec![plain.clone(), asks.clone()]
    );
    assert!(ids_of(&api.inbox("&from=alice@work").await.1).is_empty());
    assert!(ids_of(&api.inbox("&from=alic").await.1).is_empty());
    assert_eq!(
        ids_of(&api.inbox("&from=alice&needs_reply=true").await.1),
        vec![asks.clone()]
    );
    for bad in ["&from=Bad%20Name", "&from=a@", "&needs_reply=maybe"] {
        assert_eq!(api.inbox(bad).await.0, 400, "{bad}");
    }
    // Entries say what they reply to (alice got carol's message too).
    let reply = api
        .send_json(json!({"from": "alice", "to": ["bob"], "subject": "r", "reply_to": from_carol}))
        .await;
    assert!(reply.get("id").is_some());
    let (_, page) = api.inbox("&from=alice").await;
    let last = page["messages"].as_array().unwrap().last().unwrap().clone();
    assert_eq!(last["reply_to"], from_carol.as_str(), "{page}");
    assert_eq!(last["kind"], "reply");
    assert_eq!(last["thread"], from_carol.as_str());
}

/// Polls until `n` requests wait for mail (at most 10 s).
async fn until_waiting(api: &Api, n: usize) {
    let hub = api.state.mailbox.waits();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while hub.waiting() != n {
        assert!(
            std::time::Instant::now() < deadline,
            "{} waiting, not {n}",
            hub.waiting()
        );
        tokio::time::sleep(std::time::Duration::from_millis(5)).await;
    }
}

/// Issue 18 (2): a long poll started before a local send answers with that message as soon as
/// it is committed, far before its wait ends; every answer carries the position cursor.
#[tokio::test]
async fn a_long_poll_is_woken_by_a_local_send() {
    let api = Arc::new(Api::start().await);
    let (status, first) = api.inbox("").await;
    assert_eq!(status, 200, "{first}");
    assert!(first["messages"].as_array().unwrap().is_empty());
    let cursor = first["cursor"].as_str().unwrap().to_string();
    assert!(cursor.starts_with("bob."), "{cursor}");
    let waiter = {
        let api = api.clone();
        tokio::spawn(async move {
            let started = std::time::Instant::now();
            let answer = api.inbox(&format!("&wait=30&cursor={cursor}")).await;
            (answer, started.elapsed())
        })
    };
    until_waiting(&api, 1).await;
    let id = api.send(&["bob"], "wake up").await;
    let ((status, page), elapsed) = waiter.await.unwrap();
    assert_eq!(status, 200, "{page}");
    assert_eq!(ids_of(&page), vec![id.clone()]);
    assert!(elapsed < std::time::Duration::from_secs(10), "{elapsed:?}");
    assert_eq!(api.state.mailbox.waits().waiting(), 0);
    // From that answer's position, the same message is not listed again.
    let after = page["cursor"].as_str().unwrap();
    let (_, again) = api.inbox(&format!("&cursor={after}")).await;
    assert!(ids_of(&again).is_empty(), "{again}");
    // Mail that arrived between two calls is not missed: the next wait answers at once.
    let id2 = api.send(&["bob"], "between calls").await;
    let started = std::time::Instant::now();
    let (_, next) = api.inbox(&format!("&wait=30&cursor={after}")).await;
    assert_eq!(ids_of(&next), vec![id2]);
    assert!(started.elapsed() < std::time::Duration::from_secs(5));
}

/// Issue 18 (2): with nothing arriving, a wait ends with an empty page and its position; `wait`
/// over 60 and a cursor of another agent are 400 with the rule.
#[tokio::test]
async fn a_long_poll_times_out_empty_and_bad_waits_and_other_agents_cursors_are_refused() {
    let api = Api::start().await;
    let id = api.send(&["carol"], "not for bob").await;
    let started = std::time::Instant::now();
    let (status, page) = api.inbox("&wait=1").await;
    let elapsed = started.elapsed();
    assert_eq!(status, 200, "{page}");
    assert!(ids_of(&page).is_empty());
    assert!(page["next_cursor"].is_null());
    assert!(page["cursor"].as_str().unwrap().starts_with("bob."));
    assert!(
        elapsed >= std::time::Duration::from_millis(900)
            && elapsed < std::time::Duration::from_secs(5),
        "{elapsed:?}"
    );
    let (status, body) = api.inbox("&wait=61").await;
    assert_eq!((status, body["code"].as_str()), (400, Some("BAD_REQUEST")));
    assert_eq!(body["error"], "wait must be 0..=60 seconds");
    let (_, carols) = api.get("/v1/inbox?as=carol").await;
    assert_eq!(ids_of(&carols), vec![id]);
    let foreign = carols["cursor"].as_str().unwrap();
    for query in [
        format!("&cursor={foreign}"),
        format!("&wait=1&cursor={foreign}"),
    ] {
        let (status, body) = api.inbox(&query).await;
        assert_eq!(
            (status, body["code"].as_str()),
            (400, Some("BAD_REQUEST")),
            "{query}"
        );
        assert!(
            body["error"]
                .as_str()
                .unwrap()
                .contains("another agent's inbox"),
            "{body}"
        );
    }
    let (status, _) = api.inbox("&cursor=12").await;
    assert_eq!(status, 400, "a bare number is no cursor of bob's");
}

/// Issue 18 (2): 300 waiters (more than the 256 that may wait) do not starve ordinary calls;
/// the ones past the bound are refused at once with 503 `TOO_MANY_WAITERS` and `Retry-After`
/// (an empty 200 would let a waiting loop spin); closing the hub (daemon shutdown) ends every
/// wait.
#[tokio::test]
async fn many_waiters_leave_ordinary_calls_prompt_and_shutdown_ends_them() {
    // 300 waits of one agent on a stopped clock: past any default bucket (rate classes are
    // tested below); this test is about the waiters' bound.
    let api = Arc::new(
        Api::start_with(crate::config::ApiRateConfig {
            wait_burst: 1_000,
            ..Default::default()
        })
        .await,
    );
    let mut waiters = tokio::task::JoinSet::new();
    // One client for all: HTTP/1.1 carries one request at a time per connection, so each
    // waiter still holds a connection of its own (and 300 clients, each loading the system's
    // root certificates, would spend the wait deadline being built).
    let client = reqwest::Client::new();
    for _ in 0..300 {
        let api = api.clone();
        let client = client.clone();
        waiters.spawn(async move {
            let resp = client
                .get(format!("{}/v1/inbox?as=bob&wait=60", api.base))
                .bearer_auth(&api.token)
                .send()
                .await
                .unwrap();
            let at = std::time::Instant::now();
            let status = resp.status().as_u16();
            let retry_after = resp
                .headers()
                .get("retry-after")
                .map(|v| v.to_str().unwrap().to_string());
            let body: serde_json::Value = resp.json().await.unwrap();
            (status, at, retry_after, body)
        });
    }
    until_waiting(&api, crate::mailbox::wake::MAX_WAITERS).await;
    // The 44 past the bound were refused at once.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    let mut early = 0;
    while early < 300 - crate::mailbox::wake::MAX_WAITERS {
        let left = deadline.saturating_duration_since(std::time::Instant::now());
        let (status, _, retry_after, body) = tokio::time::timeout(left, waiters.join_next())
            .await
            .expect("the waiters past the bound answer at once")
            .unwrap()
            .unwrap();
        assert_eq!(status, 503, "{body}");
        assert_eq!(body["code"], "TOO_MANY_WAITERS", "{body}");
        assert_eq!(retry_after.as_deref(), Some("1"));
        early += 1;
    }
    for _ in 0..3 {
        let started = std::time::Instant::now();
        let (status, body) = api.get("/v1/agents").await;
        assert_eq!(status, 200, "{body}");
        assert!(
            started.elapsed() < std::time::Duration::from_secs(2),
            "an ordinary call waited {:?}",
            started.elapsed()
        );
    }
    let closed = std::time::Instant::now();
    api.state.mailbox.waits().close();
    while let Some(done) = waiters.join_next().await {
        let (status, at, _, body) = done.unwrap();
        assert_eq!(status, 200, "{body}");
        assert_eq!(body["messages"], json!([]), "{body}");
        assert!(at.duration_since(closed) < std::time::Duration::from_secs(5));
    }
    assert_eq!(api.state.mailbox.waits().waiting(), 0);
}

/// Issue 18 (bench): latency from the commit of a local delivery to the waiter's answer, over
/// 50 runs through the real router on loopback. Printed, not asserted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn long_poll_latency_from_commit_to_answer() {
    let api = Arc::new(Api::start().await);
    let mut samples = Vec::new();
    let (_, page) = api.inbox("").await;
    let mut cursor = page["cursor"].as_str().unwrap().to_string();
    for i in 0..50 {
        let waiter = {
            let (api, cursor) = (api.clone(), cursor.clone());
            tokio::spawn(async move {
                let answer = api.inbox(&format!("&wait=30&cursor={cursor}")).await;
                (answer, std::time::Instant::now())
            })
        };
        until_waiting(&api, 1).await;
        let id = format!("01J000000000000000000{i:05}");
        let env = json!({"id": id, "ts": "2026-01-01T00:00:00.000Z", "from": "alice@home",
            "to": ["bob@home"], "thread": id, "kind": "note", "subject": "s", "body": "b"});
        let committed = api
            .store
            .mailbox
            .run(move |c| {
                let tx = c.transaction()?;
                crate::mailbox::messages::insert(&tx, &env, "local", 0)?;
                crate::mailbox::messages::deliver(&tx, &id, "bob", 0)?;
                tx.commit()?;
                Ok(std::time::Instant::now())
            })
            .await
            .unwrap();
        let ((status, page), answered) = waiter.await.unwrap();
        assert_eq!(status, 200);
        assert_eq!(page["messages"].as_array().unwrap().len(), 1);
        cursor = page["cursor"].as_str().unwrap().to_string();
        samples.push(answered.duration_since(committed));
    }
    samples.sort();
    eprintln!(
        "long poll, commit -> answer over {} runs: p50 {:?}, p99 {:?}, max {:?}",
        samples.len(),
        samples[samples.len() / 2],
        samples[samples.len() * 99 / 100],
        samples[samples.len() - 1]
    );
}

/// Issue 18 (3): `notified` is recorded only when a wait returned the message: a long poll woken
/// by mail from a peer queues one `notified` receipt to that peer (a plain listing queues none,
/// a second wait none again), and a local sender's `sent` shows `notified` for a local
/// recipient whose wait returned it; a message already read stays `read`.
#[tokio::test]
async fn a_wait_that_returned_a_message_records_it_notified() {
    let api = Arc::new(Api::start().await);
    let receipts = |api: &Api, state: &str| -> i64 {
        api.store.scalar(&format!(
            "SELECT COUNT(*) FROM receipt_outbox WHERE state = '{state}' AND host = 'work'"
        ))
    };
    let (_, first) = api.inbox("").await;
    let cursor = first["cursor"].as_str().unwrap().to_string();
    let waiter = {
        let api = api.clone();
        tokio::spawn(async move { api.inbox(&format!("&wait=30&cursor={cursor}")).await })
    };
    until_waiting(&api, 1).await;
    let remote = "01J00000000000000000000WRK";
    receive_from_work(&api, remote);
    let (status, page) = waiter.await.unwrap();
    assert_eq!(status, 200, "{page}");
    assert_eq!(ids_of(&page), vec![remote.to_string()]);
    assert_eq!(page["messages"][0]["state"], "new");
    assert_eq!(receipts(&api, "notified"), 1);
    // Listing again, waiting or not, records nothing more.
    let (_, _) = api.inbox("").await;
    let (_, again) = api.inbox("&wait=1").await;
    assert_eq!(ids_of(&again), vec![remote.to_string()]);
    assert_eq!(receipts(&api, "notified"), 1);
    // A plain listing of a new local message records nothing; a wait that returns it does.
    let local = api.send(&["bob"], "local").await;
    let state_of = |api: Arc<Api>, id: String| async move {
        let (status, sent) = api.get("/v1/sent?as=alice").await;
        assert_eq!(status, 200, "{sent}");
        let m = sent["messages"]
            .as_array()
            .unwrap()
            .iter()
            .find(|m| m["id"] == id.as_str())
            .cloned()
            .unwrap();
        m["recipients"][0]["state"].as_str().unwrap().to_string()
    };
    let (_, listed) = api.inbox("").await;
    assert!(ids_of(&listed).contains(&local));
    assert_eq!(state_of(api.clone(), local.clone()).await, "delivered");
    let after_remote = page["cursor"].as_str().unwrap();
    let (_, waited) = api.inbox(&format!("&wait=5&cursor={after_remote}")).await;
    assert_eq!(ids_of(&waited), vec![local.clone()]);
    assert_eq!(state_of(api.clone(), local.clone()).await, "notified");
    let (status, _) = api.get(&format!("/v1/messages/{local}?as=bob")).await;
    assert_eq!(status, 200);
    assert_eq!(state_of(api.clone(), local).await, "read");
}
