//! Delivery receipts over the LAN: sent until the LAN failed twice then left to the relay, and
//! retried hourly to a peer without the receipts route.

use super::*;

// ---- receipts over the LAN ---------------------------------------------------------------------

impl Host {
    /// Mail bob@work → alice@home received here from `from`: one receipt owed to work.
    fn receive_from(&self, from: &Identity, id: &str) {
        let wire = testutil::sealed_wire(
            from,
            &self.ident.enc_key.public(),
            id,
            "bob@work",
            &["alice@home"],
            "s",
            T0,
        );
        let pk = from.host_key.public().to_b64();
        let me = self.ident.clone();
        self.store
            .mailbox
            .with(|c| {
                crate::node::receive::receive_sealed(c, &me, &wire, id, &pk, T0)
                    .map(|v| assert!(v.is_ok(), "{v:?}"))
            })
            .unwrap();
    }

    fn receipt_rows(&self) -> Vec<(u32, u32)> {
        self.store
            .fresh_conn()
            .prepare("SELECT attempts, lan_failures FROM receipt_outbox ORDER BY seq")
            .unwrap()
            .query_map([], |r| Ok((r.get(0)?, r.get(1)?)))
            .unwrap()
            .collect::<Result<_, _>>()
            .unwrap()
    }
}

#[tokio::test]
async fn receipts_go_over_the_lan_until_it_failed_twice_then_to_the_relay() {
    let clock = testutil::clock();
    let home = Host::new("home", clock.clone());
    let work = testutil::identity("work");
    let peer = FakePeer::start().await;
    home.pin(&work, true, Some(&peer.addr));
    home.receive_from(&work, ID1);
    // A short answer is a failure of the whole request.
    peer.on("POST /v1/receipts", |_| (200, json!({"results": []})));
    let d = home.delivery(true);
    d.pass().await.unwrap();
    assert_eq!(home.receipt_rows(), vec![(1, 1)]);
    let sent = peer.seen("POST /v1/receipts");
    let body: Value = serde_json::from_str(&sent[0]).unwrap();
    let wire = body["receipts"][0].to_string();
    let rec = agentmbx_protocol::records::parse_receipt_wire(
        wire.as_bytes(),
        &home.ident.host_key.public(),
    )
    .unwrap();
    assert_eq!(
        (rec.msg.as_str(), rec.recipient.as_str(), rec.state.as_str()),
        (ID1, "alice@home", "delivered")
    );
    // Not before its backoff; then the second failure hands it to the relay.
    assert_eq!(d.pass().await.unwrap(), PassCounts::default());
    clock.advance(outbox::backoff_ms(0));
    peer.on("POST /v1/receipts", |_| (503, json!({"error": "busy"})));
    d.pass().await.unwrap();
    assert_eq!(home.receipt_rows(), vec![(2, 2)]);
    clock.advance(outbox::backoff_ms(1));
    {
        let c = home.store.fresh_conn();
        let now = clock.now_ms();
        assert!(receipt_store::due_for_lan(&c, now, 10, true)
            .unwrap()
            .is_empty());
        assert_eq!(receipt_store::due_for_relay(&c, now, 10).unwrap().len(), 1);
    }
    // The peer is back: the LAN again; results (even a refusal, which is only logged) remove
    // the receipts, and the same signed bytes were sent each time.
    home.store
        .mailbox
        .with(|c| outbox::peer_is_back(c, "work", clock.now_ms()).map(|_| ()))
        .unwrap();
    peer.on("POST /v1/receipts", |_| {
        (
            200,
            json!({"results": ["rejected:not a message this host sent"]}),
        )
    });
    let counts = d.pass().await.unwrap();
    assert_eq!(counts.receipts_sent, 1);
    assert!(home.receipt_rows().is_empty());
    let sent = peer.seen("POST /v1/receipts");
    assert_eq!(sent.len(), 3);
    assert!(sent.iter().all(|b| b == &sent[0]));
}

#[tokio::test]
async fn a_peer_without_the_receipts_route_is_retried_hourly() {
    let clock = testutil::clock();
    let home = Host::new("home", clock.clone());
    let work = testutil::identity("work");
    let peer = FakePeer::start().await;
    home.pin(&work, true, Some(&peer.addr));
    home.receive_from(&work, ID1);
    home.delivery(false).pass().await.unwrap();
    let next_at: i64 = home.store.scalar("SELECT next_at FROM receipt_outbox");
    assert_eq!(next_at, T0 + receipt_store::UNSUPPORTED_RETRY_MS);
}

/// Case `clock-fix-does-not-release-mail` over the LAN: with the clock 10 min ahead a row
/// failed once, another was queued after it and a receipt failed once; once the clock is right
/// again all three are due at once (the pass takes them and the loop's wake-up is now), instead
/// of waiting out the skew.
#[tokio::test]
async fn mail_and_receipts_scheduled_under_a_clock_ahead_are_due_once_it_is_right() {
    const SKEW: i64 = 600_000;
    let clock = testutil::clock();
    clock.set(T0 + SKEW);
    let home = Host::new("home", clock.clone());
    let work = testutil::identity("work");
    let peer = FakePeer::start().await;
    home.pin(&work, true, Some(&peer.addr));
    home.receive_from(&work, ID3);
    peer.on("POST /v2/envelopes", |_| (500, json!({"error": "boom"})));
    peer.on("POST /v1/receipts", |_| (500, json!({"error": "boom"})));
    home.send(ID1, &["bob@work"]);
    let d = home.delivery(true);
    let counts = d.pass().await.unwrap();
    assert_eq!((counts.failed, counts.receipts_sent), (1, 0));
    assert_eq!(
        home.row(ID1, "work").next_at,
        T0 + SKEW + outbox::backoff_ms(0)
    );
    assert_eq!(home.receipt_rows(), vec![(1, 1)]);
    home.send(ID2, &["bob@work"]);
    assert_eq!(home.row(ID2, "work").next_at, T0 + SKEW);

    // The clock is right again.
    clock.set(T0);
    assert_eq!(d.next_due().await.unwrap(), Some(T0), "the loop wakes now");
    peer.on("POST /v2/envelopes", answer_all("accepted"));
    peer.on("POST /v1/receipts", |_| {
        (200, json!({"results": ["accepted"]}))
    });
    let counts = d.pass().await.unwrap();
    assert_eq!((counts.delivered, counts.receipts_sent), (2, 1));
    for id in [ID1, ID2] {
        assert_eq!(home.row(id, "work").state, "delivered", "{id}");
    }
    assert!(home.receipt_rows().is_empty());
}

/// A receipt a peer without the receipts route put off for an hour is not due early: that hour
/// is within its backoff rule, unlike a time a clock ahead wrote.
#[tokio::test]
async fn an_hour_put_off_for_a_peer_without_receipts_is_kept() {
    let clock = testutil::clock();
    let home = Host::new("home", clock.clone());
    let work = testutil::identity("work");
    let peer = FakePeer::start().await;
    home.pin(&work, true, Some(&peer.addr));
    home.receive_from(&work, ID1);
    let d = home.delivery(false);
    d.pass().await.unwrap();
    assert_eq!(peer.seen("POST /v1/receipts").len(), 1);
    clock.advance(receipt_store::UNSUPPORTED_RETRY_MS - 1);
    assert_eq!(
        d.next_due().await.unwrap(),
        Some(T0 + receipt_store::UNSUPPORTED_RETRY_MS)
    );
    d.pass().await.unwrap();
    assert_eq!(
        peer.seen("POST /v1/receipts").len(),
        1,
        "not before the hour"
    );
    clock.advance(1);
    d.pass().await.unwrap();
    assert_eq!(peer.seen("POST /v1/receipts").len(), 2);
}

#[tokio::test]
async fn receipts_a_peer_rate_limited_go_in_the_same_pass() {
    let clock = testutil::clock();
    let home = Host::new("home", clock.clone());
    let work = testutil::identity("work");
    let peer = FakePeer::start().await;
    home.pin(&work, true, Some(&peer.addr));
    home.receive_from(&work, ID1);
    peer.on(
        "POST /v1/receipts",
        refuse_then(2, |_| (200, json!({"results": ["accepted"]}))),
    );
    let counts = home.delivery(true).pass().await.unwrap();
    assert_eq!(counts.receipts_sent, 1);
    assert!(home.receipt_rows().is_empty());
    assert_eq!(peer.seen("POST /v1/receipts").len(), 3);
}
