//! `POST /v1/messages`, replies and `GET /v1/messages/{id}` served for real (see
//! `api::test_support`): sending locally and to peers, refusals, idempotency and size limits.

use std::sync::Arc;

use serde_json::{json, Value};

use crate::api;
use crate::api::test_support::*;
use crate::testutil::{self};

#[tokio::test]
async fn sending_to_an_unknown_host_stores_nothing() {
    let api = Api::start().await;
    // A local recipient listed first must not get a delivery either.
    let (status, body) = api
        .post(
            "/v1/messages",
            &json!({"from": "alice", "to": ["bob", "carol@nowhere"], "subject": "s"}),
            None,
        )
        .await;
    assert_eq!(status, 400, "{body}");
    assert_eq!(body["code"], "UNKNOWN_HOST");
    assert!(body["error"].as_str().unwrap().contains("nowhere"));
    assert_eq!(api.count("messages"), 0);
    assert_eq!(api.count("deliveries"), 0);
    assert_eq!(api.count("outbox"), 0);
}

/// Issue 17 (4): a bare name that is no agent here nor on a paired host is refused 400
/// `UNKNOWN_AGENT` with the closest names and stores nothing; `"new_mailbox": true` creates
/// the mailbox and delivers; `inbox`/`read` as a name that is no agent here is 404
/// `UNKNOWN_AGENT`, not an empty page.
#[tokio::test]
async fn an_unknown_bare_name_is_refused_unless_new_mailbox_and_unknown_readers_are_404() {
    let api = Api::start().await;
    let typo = json!({"from": "alice", "to": ["bob", "bbo"], "subject": "s"});
    let (status, body) = api.post("/v1/messages", &typo, None).await;
    assert_eq!(status, 400, "{body}");
    assert_eq!(body["code"], "UNKNOWN_AGENT");
    assert!(
        body["error"]
            .as_str()
            .unwrap()
            .starts_with("no agent named bbo here or on a paired host; did you mean bob?"),
        "{body}"
    );
    assert_eq!((api.count("messages"), api.count("deliveries")), (0, 0));
    let (status, body) = api.get("/v1/inbox?as=bbo").await;
    assert_eq!(status, 404, "{body}");
    assert_eq!(body["code"], "UNKNOWN_AGENT");
    assert_eq!(
        body["error"],
        "no agent named bbo on this host; did you mean bob? (`agentmbx whoami --as bbo` \
         registers a new agent)"
    );
    let (status, body) = api.get("/v1/inbox?as=nobody").await;
    assert_eq!(
        (status, body["code"].as_str()),
        (404, Some("UNKNOWN_AGENT"))
    );
    assert_eq!(
        body["error"],
        "no agent named nobody on this host (`agentmbx whoami --as nobody` registers it)"
    );
    let mut on_purpose = typo.clone();
    on_purpose["new_mailbox"] = json!(true);
    let (status, body) = api.post("/v1/messages", &on_purpose, None).await;
    assert_eq!(status, 201, "{body}");
    let id = body["id"].as_str().unwrap().to_string();
    let (status, body) = api.get(&format!("/v1/messages/{id}?as=zed")).await;
    assert_eq!(
        (status, body["code"].as_str()),
        (404, Some("UNKNOWN_AGENT")),
        "{body}"
    );
    let (status, page) = api.get("/v1/inbox?as=bbo").await;
    assert_eq!(status, 200, "{page}");
    assert_eq!(ids_of(&page), vec![id.clone()]);
    let (status, body) = api.get(&format!("/v1/messages/{id}?as=bbo")).await;
    assert_eq!(
        (status, body["subject"].as_str()),
        (200, Some("s")),
        "{body}"
    );
    // A known agent without mail is an empty page, and the owner always has a mailbox.
    for agent in ["carol", "owner"] {
        let (status, page) = api.get(&format!("/v1/inbox?as={agent}")).await;
        assert_eq!(status, 200, "{agent}: {page}");
        assert!(ids_of(&page).is_empty());
    }
}

#[tokio::test]
async fn sending_locally_delivers_at_once_and_remote_queues_one_row_per_host() {
    let api = Api::start().await;
    let (status, body) = api
        .post(
            "/v1/messages",
            &json!({"from": "alice", "to": ["bob", "carol@home", "dave@work", "erin@work"], "subject": "s"}),
            None,
        )
        .await;
    assert_eq!(status, 201, "{body}");
    assert_eq!(body["queued_for_hosts"], json!(["work"]));
    let routes: Vec<&str> = body["recipients"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["route"].as_str().unwrap())
        .collect();
    assert_eq!(routes, vec!["local", "local", "remote", "remote"]);
    assert_eq!(api.count("messages"), 1);
    assert_eq!(api.count("deliveries"), 2);
    assert_eq!(api.count("outbox"), 1);
    let (_, page) = api.inbox("").await;
    assert_eq!(
        ids_of(&page),
        vec![body["id"].as_str().unwrap().to_string()]
    );
    assert_eq!(page["messages"][0]["state"], "new");
    assert_eq!(page["messages"][0]["from"], "alice@home");
}

#[tokio::test]
async fn idempotency_replays_the_first_answer_and_refuses_another_body() {
    let api = Api::start().await;
    let req = json!({"from": "alice", "to": ["bob", "dave@work"], "subject": "once"});
    let (s1, first) = api.post("/v1/messages", &req, Some("key-1")).await;
    let (s2, again) = api.post("/v1/messages", &req, Some("key-1")).await;
    assert_eq!((s1, s2), (201, 201));
    assert_eq!(first, again, "the same answer, the same id");
    assert_eq!(api.count("messages"), 1);
    assert_eq!(api.count("deliveries"), 1);
    assert_eq!(api.count("outbox"), 1);

    let other = json!({"from": "alice", "to": ["bob"], "subject": "different"});
    let (status, body) = api.post("/v1/messages", &other, Some("key-1")).await;
    assert_eq!(status, 409, "{body}");
    assert_eq!(body["code"], "CONFLICT");
    assert_eq!(api.count("messages"), 1);

    // Another key is another message.
    let (_, x) = api.post("/v1/messages", &req, Some("key-2")).await;
    assert_ne!(x["id"], first["id"]);
    assert_eq!(api.count("messages"), 2);

    // A failed call records nothing: the key can be used again once the request is valid.
    let bad = json!({"from": "alice", "to": ["x@nowhere"], "subject": "s"});
    assert_eq!(api.post("/v1/messages", &bad, Some("key-3")).await.0, 400);
    let ok = json!({"from": "alice", "to": ["bob"], "subject": "s"});
    assert_eq!(api.post("/v1/messages", &ok, Some("key-3")).await.0, 201);

    // Acks are idempotent too.
    let id = first["id"].as_str().unwrap();
    let ack = json!({"as": "bob", "ids": [id]});
    let (_, a1) = api.post("/v1/ack", &ack, Some("ack-1")).await;
    let (_, a2) = api.post("/v1/ack", &ack, Some("ack-1")).await;
    assert_eq!(
        (a1["acked"].as_i64(), a2["acked"].as_i64()),
        (Some(1), Some(1))
    );
}

#[tokio::test]
async fn a_reply_continues_its_parents_thread_as_kind_reply() {
    let api = Api::start().await;
    let first = api.send(&["bob"], "plan").await;
    // `reply_to` in a send: the parent's thread, kind `reply` (not a new thread of its own).
    let out = api
        .send_json(json!({"from": "bob", "to": ["alice"], "subject": "ok", "reply_to": first}))
        .await;
    let second = out["id"].as_str().unwrap().to_string();
    assert_eq!(out["thread"], first.as_str(), "{out}");
    let m = api.read_as("alice", &second).await;
    assert_eq!(
        (
            m["thread"].as_str(),
            m["kind"].as_str(),
            m["reply_to"].as_str()
        ),
        (Some(first.as_str()), Some("reply"), Some(first.as_str())),
        "{m}"
    );
    // A kind given stays.
    let out = api
        .send_json(json!({"from": "alice", "to": ["bob"], "subject": "s", "reply_to": second, "kind": "decision", "thread": first}))
        .await;
    assert_eq!(out["thread"], first.as_str());
    assert_eq!(
        api.read_as("bob", out["id"].as_str().unwrap()).await["kind"],
        "decision"
    );

    // The reply route: to the parent's sender, same thread, `Re:` subject, idempotent.
    let before = api.count("messages");
    let req = json!({"from": "bob", "body": "done", "needs_reply": true});
    let (status, out) = api
        .post(&format!("/v1/messages/{first}/reply"), &req, Some("k1"))
        .await;
    assert_eq!(status, 201, "{out}");
    assert_eq!(out["thread"], first.as_str());
    assert_eq!(out["recipients"][0]["name"], "alice", "{out}");
    let (status, again) = api
        .post(&format!("/v1/messages/{first}/reply"), &req, Some("k1"))
        .await;
    assert_eq!((status, &again["id"]), (201, &out["id"]));
    assert_eq!(api.count("messages"), before + 1);
    let m = api.read_as("alice", out["id"].as_str().unwrap()).await;
    assert_eq!(
        (
            m["subject"].as_str(),
            m["kind"].as_str(),
            m["reply_to"].as_str(),
            m["needs_reply"].as_bool()
        ),
        (
            Some("Re: plan"),
            Some("reply"),
            Some(first.as_str()),
            Some(true)
        ),
        "{m}"
    );
    // Replying to a reply does not stack `Re:`.
    let (status, out) = api
        .post(
            &format!("/v1/messages/{}/reply", out["id"].as_str().unwrap()),
            &json!({"from": "alice"}),
            None,
        )
        .await;
    assert_eq!(status, 201, "{out}");
    assert_eq!(
        api.read_as("bob", out["id"].as_str().unwrap()).await["subject"],
        "Re: plan"
    );

    // A parent the agent cannot see (unknown, or another mailbox's) is 404; a thread other than
    // the parent's is 400; nothing is stored.
    let before = api.count("messages");
    for (agent, parent) in [
        ("bob", "01KDVDNA3VG2MH8KWSQRCWJZ0S"),
        ("carol", first.as_str()),
    ] {
        let (status, body) = api
            .send_json_status(
                json!({"from": agent, "to": ["alice"], "subject": "s", "reply_to": parent}),
            )
            .await;
        assert_eq!(
            (status, body["code"].as_str()),
            (404, Some("NOT_FOUND")),
            "{body}"
        );
        let (status, body) = api
            .post(
                &format!("/v1/messages/{parent}/reply"),
                &json!({"from": agent}),
                None,
            )
            .await;
        assert_eq!(
            (status, body["code"].as_str()),
            (404, Some("NOT_FOUND")),
            "{body}"
        );
    }
    let (status, body) = api
        .send_json_status(json!({"from": "bob", "to": ["alice"], "subject": "s", "reply_to": first, "thread": "other"}))
        .await;
    assert_eq!(status, 400, "{body}");
    assert!(body["error"].as_str().unwrap().contains("thread"), "{body}");
    assert_eq!(api.count("messages"), before);
}

impl Api {
    async fn send_json_status(&self, body: Value) -> (u16, Value) {
        self.post("/v1/messages", &body, None).await
    }
}

/// The body limit is exact: a request of `MAX_REQUEST_BODY` bytes is read (here an ack padded
/// with JSON whitespace, answered 200), one byte more is 413 `BODY_TOO_LARGE` and changes
/// nothing; a thread page of the largest size is served, one past it refused.
#[tokio::test]
async fn a_body_at_the_size_limit_is_read_and_one_byte_more_is_413() {
    let api = Api::start().await;
    let id = api.send(&["bob"], "s").await;
    let ack = json!({"as": "bob", "ids": [id]}).to_string();
    let at_limit = ack.clone() + &" ".repeat(api::MAX_REQUEST_BODY - ack.len());
    assert_eq!(at_limit.len(), api::MAX_REQUEST_BODY);
    let over = format!("{at_limit} ");
    let post = |body: String| {
        api.http
            .post(format!("{}/v1/ack", api.base))
            .bearer_auth(&api.token)
            .header("content-type", "application/json")
            .body(body)
            .send()
    };
    let resp = post(over).await.unwrap();
    assert_eq!(resp.status().as_u16(), 413);
    let body: Value = resp.json().await.unwrap();
    assert_eq!(body["code"], "BODY_TOO_LARGE", "{body}");
    let (_, inbox) = api.inbox("").await;
    assert_eq!(
        inbox["messages"].as_array().map(Vec::len),
        Some(1),
        "{inbox}"
    );
    let resp = post(at_limit).await.unwrap();
    assert_eq!(resp.status().as_u16(), 200);
    let (_, inbox) = api.inbox("").await;
    assert_eq!(
        inbox["messages"].as_array().map(Vec::len),
        Some(0),
        "acked: {inbox}"
    );
    let (status, page) = api.get(&format!("/v1/threads/{id}?as=bob&limit=200")).await;
    assert_eq!(status, 200, "{page}");
}

/// A user registers an agent on a paired host and mails it before this host's next directory
/// refresh: the send fetches that host's directory again instead of refusing from the stale
/// copy; a name the fresh directory does not list is still refused, and a listed one never
/// waits on the network.
#[tokio::test]
async fn a_send_refused_by_a_stale_directory_fetches_it_again_first() {
    use axum::routing::get;
    use std::sync::atomic::{AtomicUsize, Ordering};
    let api = Api::start().await;
    let asked = Arc::new(AtomicUsize::new(0));
    let addr = {
        let asked = asked.clone();
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let app = axum::Router::new().route(
            "/v1/agents",
            get(move || async move {
                asked.fetch_add(1, Ordering::SeqCst);
                axum::Json(json!({"host": "work", "agents": [{"name": "carol"}, {"name": "erin"}]}))
            }),
        );
        tokio::spawn(async move { axum::serve(listener, app).await });
        addr
    };
    api.store
        .mailbox
        .with(|c| {
            crate::mailbox::peers::set_addr(c, "work", &addr, "cli")?;
            let carol = crate::mailbox::agents::AgentEntry {
                name: "carol".into(),
                role: None,
                cli: None,
                description: None,
                last_seen: None,
            };
            crate::mailbox::agents::replace_host(c, "work", &[carol], testutil::T0).map(|_| ())
        })
        .unwrap();
    let client =
        crate::transport::lan::client::LanClient::new(api.ident.clone(), testutil::clock(), 7373)
            .unwrap();
    assert!(api.state.lan.set(client).is_ok());
    // Listed: sent without asking.
    api.send(&["carol@work"], "listed").await;
    assert_eq!(asked.load(Ordering::SeqCst), 0);
    // Registered there since the stored copy: fetched again, then sent.
    api.send(&["erin@work"], "new there").await;
    assert_eq!(asked.load(Ordering::SeqCst), 1);
    assert_eq!(
        api.store
            .scalar::<i64>("SELECT COUNT(*) FROM agents WHERE host = 'work' AND name = 'erin'"),
        1
    );
    // Not there even now: refused, after one more fetch.
    let (status, body) = api
        .post(
            "/v1/messages",
            &json!({"from": "alice", "to": ["nobody@work"], "subject": "s"}),
            None,
        )
        .await;
    assert_eq!(
        (status, body["code"].as_str()),
        (400, Some("UNKNOWN_AGENT")),
        "{body}"
    );
    assert!(
        body["error"]
            .as_str()
            .unwrap()
            .contains("its agents: carol, erin"),
        "{body}"
    );
    assert_eq!(asked.load(Ordering::SeqCst), 2);
}
