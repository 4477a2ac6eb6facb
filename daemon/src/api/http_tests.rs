//! The local API end to end: the real router served on 127.0.0.1:0 over a real `mailbox.db`,
//! called with reqwest (send, inbox paging, read, ack, idempotency).

use std::sync::Arc;

use serde_json::{json, Value};

use agentmbx_protocol::clock::{ManualClock, SharedClock};

use super::{AppState, SharedState};
use crate::identity::Identity;
use crate::testutil::{self, Store};
use crate::token::ApiToken;

struct Api {
    store: Store,
    /// This host (`home`): mail from `work` is sealed for its enc key.
    ident: Arc<Identity>,
    /// The pinned peer `work`.
    work: Identity,
    _clock: Arc<ManualClock>,
    /// The daemon's instance (health reasons).
    instance: Arc<crate::instance::Instance>,
    base: String,
    token: String,
    http: reqwest::Client,
    task: tokio::task::JoinHandle<()>,
    /// The router's state (tests give it a LAN client).
    state: SharedState,
}

impl Drop for Api {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl Api {
    async fn start() -> Self {
        Self::start_with(crate::config::ApiRateConfig::default()).await
    }

    /// With the rate classes `rates` (`[api_rate]`).
    async fn start_with(rates: crate::config::ApiRateConfig) -> Self {
        crate::install_tls_provider();
        let store = testutil::store();
        let clock = testutil::clock();
        let ident: Arc<Identity> = Arc::new(testutil::identity("home"));
        let work = testutil::identity("work");
        store.add_peer(&work, true);
        // The agents the tests mail: a bare name known nowhere is refused.
        store.register("home", &["alice", "bob", "carol"]);
        let token = ApiToken::generate();
        let secret = token.expose_secret().to_string();
        let shared: SharedClock = clock.clone();
        let instance: Arc<crate::instance::Instance> = Default::default();
        let state: SharedState = Arc::new(AppState {
            host: ident.host.clone(),
            token,
            version: crate::VERSION,
            clock: shared,
            ident: ident.clone(),
            mailbox: store.mailbox.clone(),
            wake: Arc::new(tokio::sync::Notify::new()),
            ids: std::sync::Mutex::new(agentmbx_protocol::ulid::Generator::new()),
            instance: instance.clone(),
            lan: Default::default(),
            rates: super::rate::ApiRates::new(&rates),
        });
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let base = format!("http://{}", listener.local_addr().unwrap());
        let served = state.clone();
        let task = tokio::spawn(async move {
            let _ = super::serve(listener, served, std::future::pending()).await;
        });
        Api {
            store,
            ident,
            work,
            _clock: clock,
            instance,
            base,
            token: secret,
            http: reqwest::Client::new(),
            task,
            state,
        }
    }

    async fn post(&self, path: &str, body: &Value, key: Option<&str>) -> (u16, Value) {
        let mut req = self
            .http
            .post(format!("{}{path}", self.base))
            .bearer_auth(&self.token)
            .header("content-type", "application/json")
            .body(body.to_string());
        if let Some(k) = key {
            req = req.header("idempotency-key", k);
        }
        let resp = req.send().await.unwrap();
        let status = resp.status().as_u16();
        (status, resp.json().await.unwrap_or(Value::Null))
    }

    async fn get(&self, path_and_query: &str) -> (u16, Value) {
        let resp = self
            .http
            .get(format!("{}{path_and_query}", self.base))
            .bearer_auth(&self.token)
            .send()
            .await
            .unwrap();
        let status = resp.status().as_u16();
        (status, resp.json().await.unwrap_or(Value::Null))
    }

    async fn send(&self, to: &[&str], subject: &str) -> String {
        let (status, body) = self
            .post(
                "/v1/messages",
                &json!({"from": "alice", "to": to, "subject": subject, "body": "b"}),
                None,
            )
            .await;
        assert_eq!(status, 201, "{body}");
        body["id"].as_str().unwrap().to_string()
    }

    fn count(&self, table: &str) -> i64 {
        self.store.scalar(&format!("SELECT COUNT(*) FROM {table}"))
    }

    async fn inbox(&self, query: &str) -> (u16, Value) {
        self.get(&format!("/v1/inbox?as=bob{query}")).await
    }
}

fn ids_of(page: &Value) -> Vec<String> {
    page["messages"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["id"].as_str().unwrap().to_string())
        .collect()
}

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
async fn read_marks_read_and_ack_is_all_or_nothing() {
    let api = Api::start().await;
    let a = api.send(&["bob"], "a").await;
    let b = api.send(&["bob"], "b").await;

    let (status, msg) = api.get(&format!("/v1/messages/{a}?as=bob")).await;
    assert_eq!(status, 200);
    assert_eq!(
        (msg["state"].as_str(), msg["body"].as_str()),
        (Some("read"), Some("b"))
    );
    let (_, page) = api.inbox("").await;
    let states: Vec<&str> = page["messages"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["state"].as_str().unwrap())
        .collect();
    assert_eq!(states, vec!["read", "new"]);
    let (status, body) = api.get(&format!("/v1/messages/{a}")).await;
    assert_eq!(
        (status, body["code"].as_str()),
        (400, Some("BAD_REQUEST")),
        "{body}"
    );
    // Someone who neither sent nor received it cannot read it.
    let (status, _) = api.get(&format!("/v1/messages/{a}?as=carol")).await;
    assert_eq!(status, 404);
    // The sender reads its own copy, without a delivery state.
    let (status, own) = api.get(&format!("/v1/messages/{a}?as=alice")).await;
    assert_eq!(status, 200);
    assert!(own["state"].is_null());

    // An unknown id in the list: 404 and nothing acked.
    let (status, body) = api
        .post(
            "/v1/ack",
            &json!({"as": "bob", "ids": [a, "01KDVDNA3VG2MH8KWSQRCWJZ0S"]}),
            None,
        )
        .await;
    assert_eq!(status, 404, "{body}");
    let acked: i64 = api
        .store
        .scalar("SELECT COUNT(*) FROM deliveries WHERE state = 'acked'");
    assert_eq!(acked, 0);

    let (status, body) = api
        .post("/v1/ack", &json!({"as": "bob", "ids": [a, b]}), None)
        .await;
    assert_eq!((status, body["acked"].as_i64()), (200, Some(2)));
    assert!(ids_of(&api.inbox("").await.1).is_empty());
    assert_eq!(ids_of(&api.inbox("&all=true").await.1), vec![a.clone(), b]);
    // Acking again changes nothing.
    let (_, body) = api
        .post("/v1/ack", &json!({"as": "bob", "ids": [a]}), None)
        .await;
    assert_eq!(body["acked"], 0);
    // Bounds of the request.
    let (status, _) = api
        .post("/v1/ack", &json!({"as": "bob", "ids": []}), None)
        .await;
    assert_eq!(status, 400);
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

/// Stores a message `id` from `ann@work` to `bob@home` as if it had arrived from the peer, so
/// acking it queues a receipt back to `work` (bob is registered first: mail for a name with no
/// mailbox here would be held, not delivered).
fn receive_from_work(api: &Api, id: &str) {
    api.store.register("home", &["bob"]);
    receive_from_work_to(api, id, &["bob@home"], "from work");
}

/// Stores a message `id` from `ann@work` to `to` with `subject` as if it had arrived from the
/// peer (sealed for this host, its hop signed by `work`); asserts the store took it.
fn receive_from_work_to(api: &Api, id: &str, to: &[&str], subject: &str) {
    let wire = testutil::sealed_wire(
        &api.work,
        &api.ident.enc_key.public(),
        id,
        "ann@work",
        to,
        subject,
        testutil::T0,
    );
    let pk = api.work.host_key.public().to_b64();
    let ident = api.ident.clone();
    api.store
        .mailbox
        .with(|c| {
            let verdict =
                crate::node::receive::receive_sealed(c, &ident, &wire, id, &pk, testutil::T0)?;
            assert!(verdict.is_ok(), "{verdict:?}");
            Ok(())
        })
        .unwrap();
}

#[tokio::test]
async fn an_ack_note_over_the_receipt_limit_is_refused_in_utf16_units_and_one_at_it_is_carried_whole(
) {
    use crate::mailbox::receipts;
    let api = Api::start().await;
    let (over, at) = ("01KDVDNA3VG2MH8KWSQRCWJZ0S", "01KDVDNA3VG2MH8KWSQRCWJZ0T");
    receive_from_work(&api, over);
    receive_from_work(&api, at);

    // 251 four-byte emoji: 251 characters but 502 UTF-16 units, over the receipt's 500.
    let long = "😀".repeat(251);
    let (status, body) = api
        .post(
            "/v1/ack",
            &json!({"as": "bob", "ids": [over], "note": long}),
            None,
        )
        .await;
    assert_eq!(status, 400, "{body}");
    assert_eq!(body["code"], "BAD_REQUEST", "{body}");
    assert_eq!(
        body["error"], "note is 502 UTF-16 code units; the limit is 500",
        "{body}"
    );
    // Nothing changed: no ack, no acked receipt queued.
    let acked: i64 = api
        .store
        .scalar("SELECT COUNT(*) FROM deliveries WHERE state = 'acked'");
    assert_eq!(acked, 0);
    assert_eq!(
        api.store
            .scalar::<i64>("SELECT COUNT(*) FROM receipt_outbox WHERE state = 'acked'"),
        0
    );

    // 250 of them (500 units, the limit): accepted, and the receipt carries the note whole.
    let whole = "😀".repeat(250);
    let (status, body) = api
        .post(
            "/v1/ack",
            &json!({"as": "bob", "ids": [at], "note": whole}),
            None,
        )
        .await;
    assert_eq!((status, body["acked"].as_i64()), (200, Some(1)), "{body}");
    let rows = api
        .store
        .mailbox
        .with(|c| receipts::due_for_relay(c, i64::MAX, 50))
        .unwrap();
    let acked: Vec<_> = rows.iter().filter(|r| r.state == "acked").collect();
    assert_eq!(acked.len(), 1);
    assert_eq!(acked[0].msg_id, at);
    let record = receipts::record(acked[0], "home");
    assert_eq!(record.note.as_deref(), Some(whole.as_str()));
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

impl Api {
    /// Sends `body` (a `POST /v1/messages` request) and returns the answer, asserting 201.
    async fn send_json(&self, body: Value) -> Value {
        let (status, out) = self.post("/v1/messages", &body, None).await;
        assert_eq!(status, 201, "{out}");
        out
    }

    async fn read_as(&self, agent: &str, id: &str) -> Value {
        let (status, m) = self.get(&format!("/v1/messages/{id}?as={agent}")).await;
        assert_eq!(status, 200, "{m}");
        m
    }
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

/// The body limit is exact: a request of `MAX_REQUEST_BODY` bytes is read (here an ack padded
/// with JSON whitespace, answered 200), one byte more is 413 `BODY_TOO_LARGE` and changes
/// nothing; a thread page of the largest size is served, one past it refused.
#[tokio::test]
async fn a_body_at_the_size_limit_is_read_and_one_byte_more_is_413() {
    let api = Api::start().await;
    let id = api.send(&["bob"], "s").await;
    let ack = json!({"as": "bob", "ids": [id]}).to_string();
    let at_limit = ack.clone() + &" ".repeat(super::MAX_REQUEST_BODY - ack.len());
    assert_eq!(at_limit.len(), super::MAX_REQUEST_BODY);
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

/// Issue 17 (3), API: `name@work` missing from work's known directory is 400 `UNKNOWN_AGENT`
/// listing work's agents, nothing stored; `"force": true` sends it (201, with a warning); mail
/// that arrived for a name this host does not have is listed by `GET /v1/unclaimed` and becomes
/// the agent's mail when it registers with `POST /v1/agents`.
#[tokio::test]
async fn an_unlisted_agent_is_refused_unless_forced_and_unclaimed_mail_is_listed_until_claimed() {
    let api = Api::start().await;
    api.store
        .mailbox
        .with(|c| {
            crate::mailbox::agents::replace_host(
                c,
                "work",
                &[crate::mailbox::agents::AgentEntry {
                    name: "carol".into(),
                    role: None,
                    cli: None,
                    description: None,
                    last_seen: None,
                }],
                testutil::T0,
            )
        })
        .unwrap();
    let (status, body) = api
        .post(
            "/v1/messages",
            &json!({"from": "alice", "to": ["carl@work"], "subject": "s"}),
            None,
        )
        .await;
    assert_eq!(status, 400, "{body}");
    assert_eq!(body["code"], "UNKNOWN_AGENT", "{body}");
    assert!(
        body["error"]
            .as_str()
            .unwrap()
            .starts_with("work has no agent carl; its agents: carol."),
        "{body}"
    );
    assert_eq!(api.count("messages"), 0);
    let (status, body) = api
        .post(
            "/v1/messages",
            &json!({"from": "alice", "to": ["carl@work"], "subject": "s", "force": true}),
            None,
        )
        .await;
    assert_eq!(status, 201, "{body}");
    assert_eq!(body["queued_for_hosts"], json!(["work"]));
    assert!(
        body["warnings"][0]
            .as_str()
            .unwrap()
            .contains("sent anyway (forced)"),
        "{body}"
    );
    let (status, body) = api
        .post(
            "/v1/messages",
            &json!({"from": "alice", "to": ["carl@work"], "subject": "s", "force": "yes"}),
            None,
        )
        .await;
    assert_eq!((status, body["code"].as_str()), (400, Some("BAD_REQUEST")));

    // Mail from work for nobody@home: held, listed, no receipt.
    let id = "01KDVDNA3VG2MH8KWSQRCWJZ0S";
    receive_from_work_to(&api, id, &["nobody@home"], "early");
    let (status, page) = api.get("/v1/unclaimed").await;
    assert_eq!(status, 200, "{page}");
    assert_eq!(page["total"], 1);
    assert_eq!(page["messages"][0]["id"], id);
    assert_eq!(page["messages"][0]["name"], "nobody");
    assert_eq!(page["messages"][0]["from"], "ann@work");
    assert_eq!(api.count("receipt_outbox"), 0);
    for bad in ["/v1/unclaimed?limit=0", "/v1/unclaimed?as=bob"] {
        let (status, body) = api.get(bad).await;
        assert_eq!(
            (status, body["code"].as_str()),
            (400, Some("BAD_REQUEST")),
            "{bad}"
        );
    }
    let (status, body) = api
        .post("/v1/agents", &json!({"name": "nobody"}), None)
        .await;
    assert_eq!(status, 200, "{body}");
    let (_, page) = api.get("/v1/inbox?as=nobody").await;
    assert_eq!(ids_of(&page), vec![id.to_string()]);
    assert_eq!(api.count("receipt_outbox"), 1);
    let (_, page) = api.get("/v1/unclaimed").await;
    assert_eq!(page["total"], 0);
    // Registering again delivers nothing twice.
    api.post("/v1/agents", &json!({"name": "nobody"}), None)
        .await;
    assert_eq!(api.count("receipt_outbox"), 1);
    assert_eq!(api.count("deliveries"), 1);
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
    for _ in 0..300 {
        let api = api.clone();
        // A client each: one connection per waiter.
        waiters.spawn(async move {
            let resp = reqwest::Client::new()
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

/// Reads `resp` (an open event stream) until `n` `mail` events came (10 s at most); returns
/// each event's `id` and `data`, and keeps what follows in `buf`. Comments are skipped.
async fn mail_events(
    resp: &mut reqwest::Response,
    buf: &mut String,
    n: usize,
) -> Vec<(String, Value)> {
    let mut out = Vec::new();
    let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(10);
    while out.len() < n {
        while let Some(end) = buf.find("\n\n") {
            let block: String = buf.drain(..end + 2).collect();
            let field = |name: &str| {
                block
                    .lines()
                    .find_map(|l| l.strip_prefix(&format!("{name}: ")))
                    .map(str::to_string)
            };
            if field("event").as_deref() == Some("mail") {
                let data: Value = serde_json::from_str(&field("data").unwrap()).unwrap();
                out.push((field("id").unwrap(), data));
            }
        }
        if out.len() >= n {
            break;
        }
        let chunk = tokio::time::timeout_at(deadline, resp.chunk())
            .await
            .unwrap_or_else(|_| panic!("{} of {n} events within 10 s: {buf:?}", out.len()))
            .unwrap()
            .expect("the stream is still open");
        buf.push_str(std::str::from_utf8(&chunk).unwrap());
    }
    out
}

impl Api {
    /// `GET /v1/events?as=<agent>` with `Last-Event-ID` when given: the open response.
    async fn events(&self, agent: &str, last: Option<&str>) -> reqwest::Response {
        let mut req = self
            .http
            .get(format!("{}/v1/events?as={agent}", self.base))
            .bearer_auth(&self.token);
        if let Some(id) = last {
            req = req.header("last-event-id", id);
        }
        req.send().await.unwrap()
    }
}

/// Issue 19 (1): an event stream hints each new delivery with its inbox position as the event
/// id, never the subject or body; reconnecting with `Last-Event-ID` (or `after=`) gets what
/// came after that position and nothing before; bad, foreign and unknown starts are refused.
#[tokio::test]
async fn an_event_stream_hints_new_mail_and_resumes_after_last_event_id() {
    let api = Api::start().await;
    let old = api.send(&["bob"], "before the stream").await;
    let (_, listed) = api.inbox("").await;
    let end = listed["cursor"].as_str().unwrap().to_string();
    let mut resp = api.events("bob", None).await;
    assert_eq!(resp.status(), 200);
    assert_eq!(
        resp.headers()["content-type"].to_str().unwrap(),
        "text/event-stream"
    );
    // The first event names the start position (the end of the inbox), before any mail.
    let mut head = String::new();
    while !head.contains("\n\n") {
        let chunk = tokio::time::timeout(std::time::Duration::from_secs(10), resp.chunk())
            .await
            .expect("the open event within 10 s")
            .unwrap()
            .unwrap();
        head.push_str(std::str::from_utf8(&chunk).unwrap());
    }
    let (open, rest) = head.split_once("\n\n").unwrap();
    assert_eq!(
        open,
        format!("event: open\nid: {end}\ndata: {{\"cursor\":\"{end}\"}}")
    );
    let (first, second) = (
        api.send(&["bob"], "secret-subject one").await,
        api.send(&["bob"], "secret-subject two").await,
    );
    let mut buf = rest.to_string();
    let got = mail_events(&mut resp, &mut buf, 2).await;
    let ids: Vec<&str> = got.iter().map(|(_, d)| d["id"].as_str().unwrap()).collect();
    assert_eq!(ids, vec![first.as_str(), second.as_str()], "not {old}");
    for (event_id, data) in &got {
        assert_eq!(data["cursor"], event_id.as_str());
        assert_eq!(data["from"], "alice@home");
        assert_eq!(data["kind"], "message");
        assert_eq!(data["needs_reply"], false);
        let keys: Vec<&String> = data.as_object().unwrap().keys().collect();
        assert_eq!(
            keys,
            ["cursor", "from", "id", "kind", "needs_reply", "thread"]
        );
    }
    assert!(!buf.contains("secret-subject"));
    // The inbox lists what came after the first event's position: the second message.
    let (_, page) = api.inbox(&format!("&cursor={}", got[0].0)).await;
    assert_eq!(ids_of(&page), vec![second.clone()]);
    drop(resp);
    let third = api.send(&["bob"], "while away").await;
    let mut again = api.events("bob", Some(&got[0].0)).await;
    let mut buf = String::new();
    let resumed = mail_events(&mut again, &mut buf, 2).await;
    let ids: Vec<&str> = resumed
        .iter()
        .map(|(_, d)| d["id"].as_str().unwrap())
        .collect();
    assert_eq!(ids, vec![second.as_str(), third.as_str()]);
    // `after=` is the same start for clients that cannot set the header.
    let resp = api
        .http
        .get(format!("{}/v1/events?as=bob&after={}", api.base, got[1].0))
        .bearer_auth(&api.token)
        .send()
        .await
        .unwrap();
    let mut resp = resp;
    let mut buf = String::new();
    let after = mail_events(&mut resp, &mut buf, 1).await;
    assert_eq!(after[0].1["id"], third.as_str());
    // Refusals: another agent's position, a malformed one, an agent that is not here.
    for (agent, last, status, code) in [
        ("bob", Some("alice.1"), 400, "BAD_REQUEST"),
        ("bob", Some("12"), 400, "BAD_REQUEST"),
        ("bbo", None, 404, "UNKNOWN_AGENT"),
        ("Bob", None, 400, "BAD_REQUEST"),
    ] {
        let resp = api.events(agent, last).await;
        assert_eq!(resp.status().as_u16(), status, "{agent} {last:?}");
        let body: Value = resp.json().await.unwrap();
        assert_eq!(body["code"], code, "{body}");
    }
}

/// Issue 19 (1): a hint written to an open stream is evidence that a live consumer took it:
/// the delivery is recorded `notified` (a receipt queued for mail from a peer), once.
#[tokio::test]
async fn a_hint_written_to_a_stream_records_the_delivery_notified() {
    let api = Api::start().await;
    let notified = |api: &Api| -> i64 {
        api.store.scalar(
            "SELECT COUNT(*) FROM receipt_outbox WHERE state = 'notified' AND host = 'work'",
        )
    };
    let mut resp = api.events("bob", None).await;
    let remote = "01J00000000000000000000WRK";
    receive_from_work(&api, remote);
    let mut buf = String::new();
    let got = mail_events(&mut resp, &mut buf, 1).await;
    assert_eq!(got[0].1["id"], remote);
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while notified(&api) == 0 {
        assert!(
            std::time::Instant::now() < deadline,
            "never recorded notified"
        );
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
    // A second stream from the start hints it again, and records nothing more.
    let mut resp2 = api.events("bob", Some("bob.0")).await;
    let mut buf = String::new();
    assert_eq!(
        mail_events(&mut resp2, &mut buf, 1).await[0].1["id"],
        remote
    );
    assert_eq!(notified(&api), 1);
}

/// Issue 19 (1): at most 64 streams are open at once (the next is 503 `TOO_MANY_WAITERS` with
/// `Retry-After`), open streams leave ordinary calls prompt, and shutdown ends every stream.
#[tokio::test]
async fn event_streams_have_their_own_cap_and_shutdown_ends_them() {
    let api = Api::start().await;
    let mut open = Vec::new();
    for _ in 0..crate::mailbox::wake::MAX_STREAMS {
        // A client each: one connection per stream.
        let resp = reqwest::Client::new()
            .get(format!("{}/v1/events?as=bob", api.base))
            .bearer_auth(&api.token)
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status(), 200);
        open.push(resp);
    }
    assert_eq!(
        api.state.mailbox.waits().streaming(),
        crate::mailbox::wake::MAX_STREAMS
    );
    let refused = api.events("bob", None).await;
    assert_eq!(refused.status(), 503);
    assert_eq!(refused.headers()["retry-after"], "1");
    let body: Value = refused.json().await.unwrap();
    assert_eq!(body["code"], "TOO_MANY_WAITERS", "{body}");
    let (status, body) = api.get("/v1/agents").await;
    assert_eq!(status, 200, "{body}");
    // Shutdown: every stream ends (its body completes) at once.
    api.state.mailbox.waits().close();
    for mut resp in open {
        let ended = tokio::time::timeout(std::time::Duration::from_secs(5), async {
            while resp.chunk().await.unwrap().is_some() {}
        })
        .await;
        assert!(ended.is_ok(), "a stream stayed open after shutdown");
    }
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
    while api.state.mailbox.waits().streaming() != 0 {
        assert!(std::time::Instant::now() < deadline, "stream permits kept");
        tokio::time::sleep(std::time::Duration::from_millis(5)).await;
    }
}

impl Api {
    /// `GET /v1/search` with `params` (as, q, limit, cursor) encoded by reqwest.
    async fn search(&self, params: &[(&str, &str)]) -> (u16, Value) {
        let resp = self
            .http
            .get(format!(
                "{}/v1/search?{}",
                self.base,
                form_urlencoded::Serializer::new(String::new())
                    .extend_pairs(params)
                    .finish()
            ))
            .bearer_auth(&self.token)
            .send()
            .await
            .unwrap();
        let status = resp.status().as_u16();
        (status, resp.json().await.unwrap_or(Value::Null))
    }

    /// Sends `subject` / `body` from alice to `to` through the API; the message id.
    async fn send_text(&self, to: &[&str], subject: &str, body: &str) -> String {
        let (status, out) = self
            .post(
                "/v1/messages",
                &json!({"from": "alice", "to": to, "subject": subject, "body": body}),
                None,
            )
            .await;
        assert_eq!(status, 201, "{out}");
        out["id"].as_str().unwrap().to_string()
    }
}

/// Issue 19 (3): a local send and mail received from a peer are found at once (the index is
/// written with the message); a message matching twice ranks above one matching once; the
/// answer carries a snippet, never the body; another agent's mail is not found.
#[tokio::test]
async fn search_finds_sent_and_received_mail_ranked_with_snippets_only() {
    let api = Api::start().await;
    let long_tail = "filler ".repeat(2000);
    let once = api
        .send_text(&["bob"], "weekly", &format!("deploy the api {long_tail}"))
        .await;
    let twice = api
        .send_text(
            &["bob"],
            "weekly",
            &format!("deploy and deploy {long_tail}"),
        )
        .await;
    let _carol = api
        .send_text(&["carol"], "weekly", "deploy deploy deploy")
        .await;
    let (status, page) = api.search(&[("as", "bob"), ("q", "deploy")]).await;
    assert_eq!(status, 200, "{page}");
    assert_eq!(ids_of(&page), vec![twice.clone(), once.clone()], "{page}");
    let hits = page["messages"].as_array().unwrap();
    assert!(hits[0]["rank"].as_f64().unwrap() > hits[1]["rank"].as_f64().unwrap());
    for hit in hits {
        assert!(hit.get("body").is_none(), "{hit}");
        let snippet = hit["snippet"].as_str().unwrap();
        assert!(
            snippet.contains("deploy") && snippet.chars().count() <= 200,
            "{snippet}"
        );
        for k in ["id", "from", "subject", "thread", "kind", "ts"] {
            assert!(hit[k].is_string(), "{k}: {hit}");
        }
        assert_eq!(hit["from"], "alice@home");
    }
    assert!(page.get("next_cursor").is_none() || page["next_cursor"].is_null());
    // Alice finds what she sent (all three); carol only hers.
    assert_eq!(
        ids_of(&api.search(&[("as", "alice"), ("q", "deploy")]).await.1).len(),
        3
    );
    assert_eq!(
        ids_of(&api.search(&[("as", "carol"), ("q", "deploy")]).await.1).len(),
        1
    );
    // Mail from a peer (opened from its sealed body on receive) is found by its body.
    receive_from_work(&api, "01KDVDNA3VG2MH8KWSQRCWJZ0S");
    let (_, page) = api.search(&[("as", "bob"), ("q", "secret work")]).await;
    assert_eq!(ids_of(&page), vec!["01KDVDNA3VG2MH8KWSQRCWJZ0S"], "{page}");
    // Searching marks nothing read.
    let (_, inbox) = api.inbox("").await;
    assert!(
        inbox["messages"]
            .as_array()
            .unwrap()
            .iter()
            .all(|m| m["state"] == "new"),
        "{inbox}"
    );
}

/// Issue 19 (3): bounds at and past them (query length, limit, cursor), pages by cursor,
/// unknown and malformed readers.
#[tokio::test]
async fn search_bounds_pages_and_readers() {
    let api = Api::start().await;
    let mut sent = Vec::new();
    for i in 0..5 {
        sent.push(
            api.send_text(&["bob"], &format!("note {i}"), "alpha beta")
                .await,
        );
    }
    let at_200 = format!("alpha {}", "x".repeat(194));
    assert_eq!(at_200.chars().count(), 200);
    let over_200 = format!("{at_200}x");
    let at_200_wide = format!("alpha {}", "é".repeat(194));
    let cases: Vec<(Vec<(&str, &str)>, u16)> = vec![
        (vec![("as", "bob"), ("q", "ab")], 200),
        (vec![("as", "bob"), ("q", "a")], 400),
        (vec![("as", "bob"), ("q", "")], 400),
        (vec![("as", "bob"), ("q", &at_200)], 200),
        (vec![("as", "bob"), ("q", &at_200_wide)], 200),
        (vec![("as", "bob"), ("q", &over_200)], 400),
        (vec![("as", "bob"), ("q", "alpha"), ("limit", "1")], 200),
        (vec![("as", "bob"), ("q", "alpha"), ("limit", "50")], 200),
        (vec![("as", "bob"), ("q", "alpha"), ("limit", "0")], 400),
        (vec![("as", "bob"), ("q", "alpha"), ("limit", "51")], 400),
        (vec![("as", "bob"), ("q", "alpha"), ("limit", "-1")], 400),
        (vec![("as", "bob"), ("q", "alpha"), ("cursor", "")], 200),
        (vec![("as", "bob"), ("q", "alpha"), ("cursor", "9999")], 200),
        (
            vec![("as", "bob"), ("q", "alpha"), ("cursor", "10000")],
            400,
        ),
        (
            vec![("as", "bob"), ("q", "alpha"), ("cursor", "bob.1")],
            400,
        ),
        (vec![("as", "bob")], 400),
        (vec![("q", "alpha")], 400),
        (vec![("as", "bob"), ("q", "alpha"), ("sort", "ts")], 400),
        (vec![("as", "Bob"), ("q", "alpha")], 400),
        (vec![("as", "bbo"), ("q", "alpha")], 404),
    ];
    for (params, want) in &cases {
        let (status, body) = api.search(params).await;
        assert_eq!(status, *want, "{params:?}: {body}");
        if *want != 200 {
            let code = if *want == 404 {
                "UNKNOWN_AGENT"
            } else {
                "BAD_REQUEST"
            };
            assert_eq!(body["code"], code, "{params:?}: {body}");
        }
    }
    let (_, body) = api.search(&[("as", "bbo"), ("q", "alpha")]).await;
    assert!(
        body["error"].as_str().unwrap().contains("did you mean bob"),
        "{body}"
    );
    // Paging with limit 2 lists each match once, then ends.
    let mut seen = Vec::new();
    let mut cursor = String::new();
    loop {
        let (status, page) = api
            .search(&[
                ("as", "bob"),
                ("q", "beta"),
                ("limit", "2"),
                ("cursor", &cursor),
            ])
            .await;
        assert_eq!(status, 200, "{page}");
        assert!(ids_of(&page).len() <= 2);
        seen.extend(ids_of(&page));
        match page["next_cursor"].as_str() {
            Some(c) => cursor = c.to_string(),
            None => break,
        }
    }
    seen.sort();
    sent.sort();
    assert_eq!(seen, sent);
}

/// Issue 19 (3): a query is words, never FTS5 syntax. Each hostile query is answered 200 with
/// the plain-word reading (found or not, as that reading says) or a typed 400 when it holds no
/// word; never a 500 or an SQLite error, and the store is unchanged.
#[tokio::test]
async fn hostile_queries_are_plain_words_or_a_typed_400() {
    let api = Api::start().await;
    let deploy = api
        .send_text(&["bob"], "release plan", "deploy the api on friday")
        .await;
    let other = api
        .send_text(&["bob"], "lunch", "soup and bread, or salad")
        .await;
    let before = (api.count("messages"), api.count("deliveries"));
    // (query, what it finds: Some(ids) for 200, None for 400)
    let d = || Some(vec![deploy.clone()]);
    let none = || Some(vec![]);
    let cases: Vec<(&str, Option<Vec<String>>)> = vec![
        ("deploy", d()),
        ("\"deploy\"", d()),
        ("deploy\"", d()),
        ("\"deploy", d()),
        ("\"deploy friday\"", d()),
        ("DEPLOY", d()),
        ("déploy", d()),
        ("deplo*", d()),
        ("depl* fri*", d()),
        ("*deploy", d()),
        ("deploy*api", d()),
        ("^deploy", d()),
        ("-deploy", d()),
        ("+deploy", d()),
        ("(deploy)", d()),
        ("{deploy}", d()),
        ("[deploy]", d()),
        ("deploy:", d()),
        ("deploy;--", d()),
        ("deploy\u{0}", d()),
        ("deploy\t\n", d()),
        ("deploy 🙂", d()),
        ("deploy «»", d()),
        ("subject:deploy", none()),
        ("body:deploy", none()),
        ("plan:release", d()),
        ("NEAR(deploy friday)", none()),
        ("NEAR(deploy friday, 2)", none()),
        ("deploy NEAR friday", none()),
        ("deploy AND friday", none()),
        ("soup OR deploy", none()),
        ("soup NOT deploy", none()),
        ("NOT deploy", none()),
        ("soup or", d().map(|_| vec![other.clone()])),
        ("and soup", d().map(|_| vec![other.clone()])),
        ("'; DROP TABLE messages; --", none()),
        ("\") OR 1=1 --", none()),
        ("x'00' deploy", none()),
        ("rank:1", none()),
        ("bm25(message_search)", none()),
        ("msg_id:deploy", none()),
        ("%deploy%", d()),
        ("\\deploy", d()),
        ("«»", none()),
        ("🙂🙂", none()),
        ("*", None),
        ("**", None),
        ("* *", None),
        ("()", None),
        ("\"\"", None),
        ("\"\"\"", None),
        ("^^", None),
        ("-:", None),
        ("  ", None),
        ("\u{0}\u{0}", None),
        ("\u{3000}\u{3000}", None),
        ("NEAR(", d().map(|_| vec![])),
        (")(", None),
    ];
    for (q, want) in &cases {
        let (status, body) = api.search(&[("as", "bob"), ("q", q)]).await;
        match want {
            Some(ids) => {
                assert_eq!(status, 200, "{q:?}: {body}");
                let mut got = ids_of(&body);
                got.sort();
                let mut ids = ids.clone();
                ids.sort();
                assert_eq!(got, ids, "{q:?}");
            }
            None => {
                assert_eq!(
                    (status, body["code"].as_str()),
                    (400, Some("BAD_REQUEST")),
                    "{q:?}: {body}"
                );
                let text = body["error"].as_str().unwrap();
                assert!(!text.to_lowercase().contains("fts5"), "{q:?}: {text}");
                assert!(!text.contains("syntax"), "{q:?}: {text}");
            }
        }
    }
    assert_eq!((api.count("messages"), api.count("deliveries")), before);
}

/// Issue 19 (3): mail held for a name with no agent here is found by nobody until that agent
/// registers; the registration's deliveries make it that agent's to find.
#[tokio::test]
async fn held_mail_becomes_searchable_when_its_agent_registers() {
    let api = Api::start().await;
    let id = "01KDVDNA3VG2MH8KWSQRCWJZ0S";
    receive_from_work_to(&api, id, &["nobody@home"], "early");
    let q = [("as", "bob"), ("q", "secret early")];
    assert!(ids_of(&api.search(&q).await.1).is_empty());
    let (status, body) = api.search(&[("as", "nobody"), ("q", "secret early")]).await;
    assert_eq!(
        (status, body["code"].as_str()),
        (404, Some("UNKNOWN_AGENT"))
    );
    let (status, body) = api
        .post("/v1/agents", &json!({"name": "nobody"}), None)
        .await;
    assert_eq!(status, 200, "{body}");
    let (status, page) = api.search(&[("as", "nobody"), ("q", "secret early")]).await;
    assert_eq!(status, 200, "{page}");
    assert_eq!(ids_of(&page), vec![id.to_string()]);
}

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
