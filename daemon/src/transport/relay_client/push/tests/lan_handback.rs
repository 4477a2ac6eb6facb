//! The 72 h rule for relay-path rows and the hand-back of a refused row to the LAN.

use super::*;

#[tokio::test]
async fn a_relay_path_row_no_relay_accepted_ends_undelivered_after_72_hours_with_the_alert() {
    let s = Setup::new(true).await;
    let id = s.send_to_peer(ID1);
    // ID2 was accepted by a relay once and is pending again for a re-push.
    s.send_to_peer(ID2);
    s.store
        .mailbox
        .with(|c| {
            c.execute(
                "UPDATE outbox SET accepted_at = ?2 WHERE msg_id = ?1",
                rusqlite::params![ID2, T0],
            )?;
            Ok(())
        })
        .unwrap();
    s.relay.on(
        "POST /v2/relay/items",
        push_reject("rejected:target not enrolled"),
    );
    // At exactly 72 h the relay path still retries.
    s.clock.set(T0 + outbox::GIVE_UP_MS);
    s.client.push_due(&session("e1")).await.unwrap();
    assert_eq!(s.row(&id).state, "pending");
    assert!(s.alerts().is_empty());
    // The next refusal past 72 h ends it, with the alert, in the same transaction.
    s.clock.set(T0 + outbox::GIVE_UP_MS + outbox::backoff_ms(0));
    let pass = s.client.push_due(&session("e1")).await.unwrap();
    assert_eq!(pass.failed, 2);
    let row = s.row(&id);
    assert_eq!(
        (row.state.as_str(), row.attempts, row.last_error.as_deref()),
        (
            "undelivered",
            2,
            Some("gave up after 72 h (rejected:target not enrolled)")
        )
    );
    assert_eq!(
        s.alerts(),
        vec![(
            "Undelivered to work: hello".to_string(),
            format!(
                "Message {id} could not be delivered to host work: gave up after 72 h (rejected:target not enrolled)"
            )
        )]
    );
    // The re-push keeps trying, however old: the relay accepted it once.
    let r2 = s.row(ID2);
    assert_eq!((r2.state.as_str(), r2.attempts), ("pending", 2));
    // An ended row is not pushed again.
    s.clock.advance(10 * 3_600_000);
    s.client.push_due(&session("e1")).await.unwrap();
    let last = s.relay.seen("POST /v2/relay/items").pop().unwrap();
    assert_eq!(
        pushed_items(&last)
            .into_iter()
            .map(|p| p.0)
            .collect::<Vec<_>>(),
        vec![ID2.to_string()]
    );
    assert_eq!(s.alerts().len(), 1);
}

#[tokio::test]
async fn a_network_failure_past_72_hours_ends_the_row_too() {
    let s = Setup::new(true).await;
    let id = s.send_to_peer(ID1);
    s.relay.on("POST /v2/relay/items", |_| {
        (503, json!({"error": "down", "code": "UNAVAILABLE"}))
    });
    s.clock.set(T0 + outbox::GIVE_UP_MS + 1);
    s.client.push_due(&session("e1")).await.unwrap();
    let row = s.row(&id);
    assert_eq!(row.state, "undelivered");
    assert!(row
        .last_error
        .as_deref()
        .unwrap()
        .starts_with("gave up after 72 h ("));
    assert_eq!(s.alerts().len(), 1);
}

#[tokio::test]
async fn target_not_enrolled_hands_the_next_attempt_back_to_the_lan() {
    let s = Setup::new(true).await;
    s.lan_addr();
    let id = s.send_to_peer(ID1);
    // The LAN failed twice: the relay's.
    for _ in 0..2 {
        s.store
            .mailbox
            .with(|c| outbox::fail_lan(c, &id, "work", "down", s.clock_now()).map(|_| ()))
            .unwrap();
    }
    s.clock.set(s.row(&id).next_at);
    s.relay.on(
        "POST /v2/relay/items",
        push_reject("rejected:target not enrolled"),
    );
    s.client.push_due(&session("e1")).await.unwrap();
    let row = s.row(&id);
    assert_eq!(
        (row.state.as_str(), row.attempts, row.lan_failures),
        ("pending", 3, 1)
    );
    // The backoff stays; then the LAN takes it, not the relay.
    let c = s.store.fresh_conn();
    let ids = |rows: Vec<outbox::Row>| rows.into_iter().map(|r| r.msg_id).collect::<Vec<_>>();
    assert!(ids(outbox::due_for_lan(&c, row.next_at - 1, 10, true).unwrap()).is_empty());
    assert_eq!(
        ids(outbox::due_for_lan(&c, row.next_at, 10, true).unwrap()),
        vec![id.clone()]
    );
    assert!(ids(outbox::due_for_relay(&c, row.next_at, 10).unwrap()).is_empty());
    // One more LAN failure gives it to the relay again.
    outbox::fail_lan(&c, &id, "work", "down", row.next_at).unwrap();
    let row = s.row(&id);
    assert_eq!(
        ids(outbox::due_for_relay(&c, row.next_at, 10).unwrap()),
        vec![id.clone()]
    );
    // Other refusals keep the row with the relay.
    s.clock.set(row.next_at);
    s.relay.on(
        "POST /v2/relay/items",
        push_reject("rejected:quota:target queue full"),
    );
    s.client.push_due(&session("e1")).await.unwrap();
    assert_eq!(s.row(&id).lan_failures, 2);
}

#[tokio::test]
async fn no_usable_enc_key_on_the_relay_hands_the_row_back_to_the_lan() {
    let s = Setup::new(false).await;
    s.lan_addr();
    let id = s.send_to_peer(ID1);
    s.store
        .mailbox
        .with(|c| {
            c.execute("UPDATE outbox SET lan_failures = 2", [])?;
            Ok(())
        })
        .unwrap();
    // The relay has no ad for the peer (404).
    s.client.push_due(&session("e1")).await.unwrap();
    let row = s.assert_failed_once(&id, T0, "no enc key for work");
    assert_eq!(row.lan_failures, 1);
    assert!(s.relay.seen("POST /v2/relay/items").is_empty());
}

#[tokio::test]
async fn without_a_lan_address_a_refused_row_stays_with_the_relay() {
    let s = Setup::new(true).await;
    let id = s.send_to_peer(ID1);
    s.relay.on(
        "POST /v2/relay/items",
        push_reject("rejected:target not enrolled"),
    );
    s.client.push_due(&session("e1")).await.unwrap();
    let row = s.row(&id);
    assert_eq!((row.attempts, row.lan_failures), (1, 0));
    let c = s.store.fresh_conn();
    assert_eq!(outbox::due_for_relay(&c, row.next_at, 10).unwrap().len(), 1);
    assert!(outbox::due_for_lan(&c, row.next_at, 10, true)
        .unwrap()
        .is_empty());
}
