//! Delivery receipts over the relay (spec §9): pushed as receipt items and settled by a verified
//! accept, dropped on a terminal rejection, and settling the sent row once they travel back.

use super::*;
use crate::transport::relay_client;

#[tokio::test]
async fn receipts_are_pushed_as_receipt_items_and_leave_on_a_verified_accept() {
    let s = Setup::new(true).await;
    let id = s.receive_and_read(ID1);
    let rows = s.receipt_rows();
    assert_eq!(
        rows.iter().map(|r| r.1.as_str()).collect::<Vec<_>>(),
        vec!["delivered", "read"]
    );
    // A rejection retrying can cure keeps them, with backoff, and the same bytes are re-sent.
    s.relay.on(
        "POST /v2/relay/items",
        receipt_answer(
            s.relay.key.clone(),
            s.me_pub(),
            "rejected:target not enrolled",
        ),
    );
    let pass = s.client.push_receipts(&session("e1")).await.unwrap();
    assert_eq!((pass.accepted, pass.failed), (0, 2));
    let after = s.receipt_rows();
    assert!(after.iter().all(|r| r.2 == 1 && r.3 == 0), "{after:?}");
    let first = pushed_receipts(&s.relay.seen("POST /v2/relay/items")[0]);
    // Not due before the backoff.
    assert_eq!(
        s.client.push_receipts(&session("e1")).await.unwrap(),
        relay_client::push::PushPass::default()
    );
    s.clock.advance(outbox::backoff_ms(0));
    // An accept signed by another key does not count.
    s.relay.on(
        "POST /v2/relay/items",
        receipt_answer(HostKey::generate(), s.me_pub(), "accepted"),
    );
    let pass = s.client.push_receipts(&session("e1")).await.unwrap();
    assert_eq!((pass.accepted, pass.failed), (0, 2));
    s.clock.advance(outbox::backoff_ms(1));
    s.relay.on(
        "POST /v2/relay/items",
        receipt_answer(s.relay.key.clone(), s.me_pub(), "accepted"),
    );
    let pass = s.client.push_receipts(&session("e1")).await.unwrap();
    assert_eq!((pass.accepted, pass.failed), (2, 0));
    assert!(s.receipt_rows().is_empty());
    s.relay.assert_hops_ok();

    // Every push carried the same items: kind receipt, id receipt:<msg>:<recipient>:<seq>, the
    // peer's pinned key as the one target, wire canonical({rec, sig}) signed by this host.
    let pushes = s.relay.seen("POST /v2/relay/items");
    assert_eq!(pushes.len(), 3);
    for p in &pushes {
        assert_eq!(
            pushed_receipts(p),
            first,
            "the signed wire is reused byte for byte"
        );
    }
    for ((item_id, target, wire), (seq, state, _, _)) in first.iter().zip(&rows) {
        assert_eq!(item_id, &format!("receipt:{id}:alice@home:{seq}"));
        assert_eq!(target, &s.peer_pub());
        let rec = records::parse_receipt_wire(wire, &s.me.host_key.public()).unwrap();
        assert_eq!(
            (rec.msg.as_str(), rec.recipient.as_str(), rec.state.as_str()),
            (id.as_str(), "alice@home", state.as_str())
        );
        assert_eq!(rec.seq, *seq as u64);
        assert_eq!(rec.note, None);
        let text = std::str::from_utf8(wire).unwrap();
        let v: Value = serde_json::from_str(text).unwrap();
        assert_eq!(text, agentmbx_protocol::canonical::to_string(&v).unwrap());
    }
}

#[tokio::test]
async fn a_terminal_rejection_drops_a_receipt_and_old_receipts_expire() {
    let s = Setup::new(true).await;
    s.receive_and_read(ID1);
    s.relay.on(
        "POST /v2/relay/items",
        receipt_answer(s.relay.key.clone(), s.me_pub(), "rejected:bad receipt"),
    );
    s.client.push_receipts(&session("e1")).await.unwrap();
    assert!(
        s.receipt_rows().is_empty(),
        "advisory: dropped, not retried"
    );
    // Receipts that could not be sent for 72 h are dropped before any push.
    s.receive_and_read(ID2);
    assert_eq!(s.receipt_rows().len(), 2);
    s.relay
        .on("POST /v2/relay/items", |_| (503, json!({"error": "down"})));
    s.client.push_receipts(&session("e1")).await.unwrap();
    assert_eq!(s.receipt_rows().len(), 2);
    s.clock.advance(72 * 3_600_000 + 1);
    let pass = s.client.push_receipts(&session("e1")).await.unwrap();
    assert_eq!(pass, relay_client::push::PushPass::default());
    assert!(s.receipt_rows().is_empty());
}

#[tokio::test]
async fn a_receipt_travels_through_the_relay_and_settles_the_sent_row() {
    let s = Setup::new(true).await;
    // home: alice → bob@work, accepted by the relay.
    let id = s.send_to_peer(ID1);
    s.accept_all("e1", "accepted");
    s.client.push_due(&session("e1")).await.unwrap();
    assert_eq!(s.row(&id).state, "relay-accepted");
    let envelope = pushed_items(&s.relay.seen("POST /v2/relay/items")[0])
        .remove(0)
        .2;

    // work: pulls it (here: receives the pushed bytes), bob reads it, and work pushes the two
    // receipts it now owes home to its relay.
    let work = Arc::new(s.peer.clone());
    let work_store = testutil::store();
    work_store.add_peer(&s.me, true);
    work_store.register("work", &["bob"]);
    let work_relay = FakeRelay::start(work.host_key.public(), s.clock.clone()).await;
    let work_client = Setup::client_for(
        &work_relay.url,
        &work_relay.key,
        &work,
        &work_store,
        &s.clock,
    );
    let (w, me_pub) = (work.clone(), s.me_pub());
    work_store
        .mailbox
        .with(|c| {
            let v = crate::node::receive::receive_sealed(c, &w, &envelope, &id, &me_pub, T0)?;
            assert!(v.is_ok(), "{v:?}");
            crate::mailbox::messages::read(c, "bob", "work", &id, T0)?;
            Ok(())
        })
        .unwrap();
    work_relay.on(
        "POST /v2/relay/items",
        receipt_answer(
            work_relay.key.clone(),
            work.host_key.public().to_b64(),
            "accepted",
        ),
    );
    let pass = work_client.push_receipts(&session("e1")).await.unwrap();
    assert_eq!(pass.accepted, 2);
    work_relay.assert_hops_ok();
    let pushed = pushed_receipts(&work_relay.seen("POST /v2/relay/items")[0]);
    assert!(
        pushed.iter().all(|p| p.1 == s.me_pub()),
        "targeted at home's key"
    );

    // home pulls the receipt items (and one forged by a third key, and one pushed by a key that
    // is not the recipient host's): the row is settled by the genuine ones only.
    let stranger = testutil::identity("mars");
    let forged = {
        let rec: Value = serde_json::from_slice::<Value>(&pushed[1].2).unwrap()["rec"].clone();
        let mut rec: records::Receipt = serde_json::from_value(rec).unwrap();
        rec.state = "acked".into();
        rec.wire(&stranger.host_key).unwrap().into_bytes()
    };
    let receipt_item = |seq: i64, item_id: &str, sender: &str, wire: &[u8]| PullItem {
        kind: "receipt".into(),
        ..item(seq, item_id, sender, wire)
    };
    let work_pub = s.peer_pub();
    let stranger_pub = stranger.host_key.public().to_b64();
    let q = Arc::new(Mutex::new(Queue {
        epoch: "e1".into(),
        items: vec![
            receipt_item(10, &pushed[0].0, &work_pub, &pushed[0].2),
            receipt_item(11, &pushed[1].0, &stranger_pub, &pushed[1].2),
            receipt_item(12, "receipt:forged", &work_pub, &forged),
            receipt_item(13, &pushed[1].0, &work_pub, &pushed[1].2),
            receipt_item(14, &pushed[1].0, &work_pub, &pushed[1].2),
        ],
        head_override: None,
    }));
    serve_queue(&s.relay, q);
    let pass = s.client.pull_pass(&session("e1")).await.unwrap();
    assert_eq!(
        (pass.receipts, pass.quarantined, pass.received_through),
        (3, 2, 14)
    );
    let row = s.row(&id);
    assert_eq!(
        (row.state.as_str(), row.via.as_deref()),
        ("delivered", Some("relay"))
    );
    let (state, seq): (String, i64) = s
        .store
        .fresh_conn()
        .query_row(
            "SELECT state, seq FROM remote_receipts WHERE msg_id = ?1 AND recipient = 'bob@work'",
            [&id],
            |r| Ok((r.get(0)?, r.get(1)?)),
        )
        .unwrap();
    assert_eq!(state, "read");
    assert_eq!(seq, 2);
    let reasons: Vec<(i64, String)> = s
        .store
        .mailbox
        .with(|c| relay_state::quarantined(c, 10))
        .unwrap()
        .into_iter()
        .map(|q| (q.seq, q.reason))
        .collect();
    assert_eq!(
        reasons,
        vec![
            (12, "bad signature".to_string()),
            (
                11,
                "receipt for bob@work did not come from work".to_string()
            ),
        ]
    );
    // The sender's view.
    let page = s
        .store
        .mailbox
        .with(|c| crate::mailbox::receipts::sent_page(c, "alice", "home", None, 20))
        .unwrap();
    let r = &page.messages[0].recipients[0];
    assert_eq!(
        (r.recipient.as_str(), r.state.as_str(), r.via.as_deref()),
        ("bob@work", "read", Some("relay"))
    );
}

#[tokio::test]
async fn the_relay_takes_a_row_only_after_two_lan_failures_or_without_a_lan_address() {
    let s = Setup::new(true).await;
    s.store
        .mailbox
        .with(|c| peers::set_addr(c, "work", "127.0.0.1:1", "cli"))
        .unwrap();
    let id = s.send_to_peer(ID1);
    s.accept_all("e1", "accepted");
    // The peer has a LAN address and the LAN has not failed yet: not the relay's.
    let pass = s.client.push_due(&session("e1")).await.unwrap();
    assert_eq!(pass, relay_client::push::PushPass::default());
    assert!(s.relay.seen("POST /v2/relay/items").is_empty());
    // One LAN failure: still not.
    s.store
        .mailbox
        .with(|c| outbox::fail_lan(c, &id, "work", "down", s.clock_now()).map(|_| ()))
        .unwrap();
    s.clock.advance(outbox::backoff_ms(0));
    assert_eq!(s.client.push_due(&session("e1")).await.unwrap().accepted, 0);
    // The second one hands it over, when due (its backoff is respected).
    s.store
        .mailbox
        .with(|c| outbox::fail_lan(c, &id, "work", "down", s.clock_now()).map(|_| ()))
        .unwrap();
    assert_eq!(s.client.push_due(&session("e1")).await.unwrap().accepted, 0);
    s.clock.advance(outbox::backoff_ms(1));
    assert_eq!(s.client.push_due(&session("e1")).await.unwrap().accepted, 1);
    let row = s.row(&id);
    assert_eq!(
        (row.state.as_str(), row.via.as_deref()),
        ("relay-accepted", Some("relay"))
    );
    // A peer back over the LAN does not make a relay-accepted row the LAN's again.
    s.store
        .mailbox
        .with(|c| outbox::peer_is_back(c, "work", s.clock_now()).map(|_| ()))
        .unwrap();
    let c = s.store.fresh_conn();
    assert!(outbox::due_for_lan(&c, i64::MAX, 10, true)
        .unwrap()
        .is_empty());
    // A peer without a LAN address: the relay at once.
    let s = Setup::new(true).await;
    s.accept_all("e1", "accepted");
    s.send_to_peer(ID2);
    assert_eq!(s.client.push_due(&session("e1")).await.unwrap().accepted, 1);
}
