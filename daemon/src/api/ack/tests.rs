//! `POST /v1/ack` served for real (see `api::test_support`): reading marks read, acks are all or
//! nothing, and ack notes are bounded in UTF-16 units.

use serde_json::json;

use crate::api::test_support::*;

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
