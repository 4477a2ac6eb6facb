//! `GET /v1/events` (the event stream) served for real (see `api::test_support`).

use serde_json::Value;

use crate::api::test_support::*;

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
