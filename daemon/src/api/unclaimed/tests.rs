//! `GET /v1/unclaimed` and mail to unlisted agents, served for real (see `api::test_support`).

use serde_json::json;

use crate::api::test_support::*;
use crate::testutil::{self};

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
