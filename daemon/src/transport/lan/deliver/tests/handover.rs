//! The LAN goes first and hands a peer's rows to the relay once its address does not answer
//! (a refusal, spec §10 "unreachable"), until the address answers again; gives up after 72 hours
//! (never on a row a relay accepted), and the sweep ends rows no transport takes.

use super::*;

#[tokio::test]
async fn the_lan_goes_first_a_refusing_address_hands_the_peer_to_the_relay_until_it_answers() {
    let clock = testutil::clock();
    let home = Host::new("home", clock.clone());
    let work = testutil::identity("work");
    let dead = closed_addr().await;
    home.pin(&work, true, Some(&dead));
    home.send(ID1, &["bob@work"]);
    let lan = |c: &rusqlite::Connection, now| {
        outbox::due_for_lan(c, now, 10, true)
            .unwrap()
            .into_iter()
            .map(|r| r.msg_id)
            .collect::<Vec<_>>()
    };
    let relay = |c: &rusqlite::Connection, now| {
        outbox::due_for_relay(c, now, 10)
            .unwrap()
            .into_iter()
            .map(|r| r.msg_id)
            .collect::<Vec<_>>()
    };
    // A new row goes over the LAN first, not to the relay.
    {
        let c = home.store.fresh_conn();
        assert_eq!(lan(&c, T0), vec![ID1.to_string()]);
        assert!(relay(&c, T0).is_empty());
    }
    let d = home.delivery(true);
    // First LAN failure: the address refuses, so it is unreachable (spec §10) and, a relay
    // being configured, the peer is marked at once: the row goes to the relay now, without
    // waiting out the LAN backoff (mailbox::lan_memory).
    let counts = d.pass().await.unwrap();
    assert_eq!(counts.failed, 1);
    let r = home.row(ID1, "work");
    assert_eq!((r.attempts, r.lan_failures, r.next_at), (1, 1, T0));
    // The stored error `sent` shows is in our words: no URL, no `(os error N)`.
    assert_eq!(
        r.last_error.as_deref(),
        Some("peer unreachable: connection refused"),
        "{r:?}"
    );
    assert!(
        r.wire.is_some(),
        "sealed and persisted before the first attempt"
    );
    let marked = |home: &Host| {
        home.store
            .mailbox
            .with(|c| crate::mailbox::lan_memory::get(c, "work"))
            .unwrap()
            .unwrap()
    };
    assert_eq!(marked(&home).down_reason.as_deref(), Some("refused"));
    {
        let c = home.store.fresh_conn();
        assert!(lan(&c, T0).is_empty());
        assert_eq!(relay(&c, T0), vec![ID1.to_string()]);
    }
    assert_eq!(d.pass().await.unwrap(), PassCounts::default());
    // Without a relay the LAN keeps it.
    {
        let c = home.store.fresh_conn();
        assert_eq!(outbox::due_for_lan(&c, T0, 10, false).unwrap().len(), 1);
    }
    // A verified hop from work shows it is alive, not that its address answers: still the
    // relay's.
    clock.set(T0 + 16_000);
    home.store
        .mailbox
        .with(|c| outbox::peer_is_back(c, "work", T0 + 16_000).map(|_| ()))
        .unwrap();
    {
        let c = home.store.fresh_conn();
        assert!(lan(&c, T0 + 16_000).is_empty());
        assert_eq!(relay(&c, T0 + 16_000), vec![ID1.to_string()]);
    }
    // The address answers a probe: the mark clears, the row is the LAN's again.
    home.store
        .mailbox
        .with(|c| crate::mailbox::lan_memory::clear(c, "work", T0 + 16_000).map(|_| ()))
        .unwrap();
    {
        let c = home.store.fresh_conn();
        assert_eq!(lan(&c, T0 + 16_000), vec![ID1.to_string()]);
        assert!(relay(&c, T0 + 16_000).is_empty());
    }
    // It refuses again: marked again, straight back to the relay.
    d.pass().await.unwrap();
    let r = home.row(ID1, "work");
    assert_eq!((r.attempts, r.lan_failures, r.next_at), (2, 2, T0 + 16_000));
    assert!(marked(&home).down_since.is_some());
    {
        let c = home.store.fresh_conn();
        assert_eq!(relay(&c, r.next_at), vec![ID1.to_string()]);
        assert!(lan(&c, r.next_at).is_empty());
    }
    // A relay-accepted row is never sent over the LAN, even after the peer is back; a re-push
    // follows the rule like any row (two LAN failures: the relay's).
    home.store
        .mailbox
        .with(|c| {
            c.execute(
                "UPDATE outbox SET state = 'relay-accepted', accepted_at = ?1",
                [T0],
            )?;
            outbox::peer_is_back(c, "work", T0 + 16_000)?;
            Ok(())
        })
        .unwrap();
    assert_eq!(d.pass().await.unwrap(), PassCounts::default());
    home.store
        .mailbox
        .with(|c| {
            c.execute("UPDATE outbox SET state = 'repush'", [])?;
            Ok(())
        })
        .unwrap();
    {
        let c = home.store.fresh_conn();
        assert!(lan(&c, T0 + 3_600_000).is_empty());
        assert_eq!(relay(&c, T0 + 3_600_000), vec![ID1.to_string()]);
    }
}

#[tokio::test]
async fn the_lan_gives_up_after_72_hours_but_never_on_a_row_a_relay_accepted() {
    let clock = testutil::clock();
    let home = Host::new("home", clock.clone());
    let work = testutil::identity("work");
    let dead = closed_addr().await;
    home.pin(&work, true, Some(&dead));
    home.send(ID1, &["bob@work"]);
    home.send(ID2, &["bob@work"]);
    // ID2 was accepted by a relay once and is to be pushed again (a new epoch).
    home.store
        .mailbox
        .with(|c| {
            c.execute(
                "UPDATE outbox SET state = 'repush', accepted_at = ?2 WHERE msg_id = ?1",
                rusqlite::params![ID2, T0],
            )?;
            Ok(())
        })
        .unwrap();
    let d = home.delivery(false);
    // At exactly 72 h the LAN still retries.
    clock.set(T0 + outbox::GIVE_UP_MS);
    d.pass().await.unwrap();
    assert_eq!(home.row(ID1, "work").state, "pending");
    assert!(home.alerts().is_empty());
    clock.set(T0 + outbox::GIVE_UP_MS + outbox::backoff_ms(1));
    d.pass().await.unwrap();
    let r = home.row(ID1, "work");
    assert_eq!(r.state, "undelivered");
    assert!(
        r.last_error
            .as_deref()
            .unwrap()
            .starts_with("gave up after 72 h (peer unreachable"),
        "{r:?}"
    );
    let alerts = home.alerts();
    assert_eq!(alerts.len(), 1);
    assert_eq!(alerts[0].0, "Undelivered to work: hello");
    assert!(
        alerts[0].1.starts_with(&format!(
            "Message {ID1} could not be delivered to host work: gave up after 72 h ("
        )),
        "{}",
        alerts[0].1
    );
    // The re-push is tried over the LAN too, and never dropped by it.
    let r2 = home.row(ID2, "work");
    assert_eq!((r2.state.as_str(), r2.attempts), ("repush", 2));
    // The fail rule itself never drops a row a relay accepted, however old.
    let out = home
        .store
        .mailbox
        .with(|c| outbox::fail_lan(c, ID2, "work", "x", T0 + 1_000 * outbox::GIVE_UP_MS))
        .unwrap();
    assert_eq!(out, outbox::Failure::Retry);
    assert_eq!(home.row(ID2, "work").state, "repush");
}

/// The 72 h sweep of the LAN pass ends the rows no transport can take (no LAN address, no
/// relay) and the ones the relay holds without ever having accepted them, each with its alert,
/// and never a row a relay accepted.
#[tokio::test]
async fn the_sweep_ends_rows_no_transport_takes_after_72_hours_but_never_relay_accepted_ones() {
    let clock = testutil::clock();
    let home = Host::new("home", clock.clone());
    let work = testutil::identity("work");
    // No LAN address for work, and (below) no relay: no transport can take its rows.
    home.pin(&work, true, None);
    let mut ids = testutil::ids();
    let (stuck, on_relay, accepted, repush) =
        (ids.next(T0), ids.next(T0), ids.next(T0), ids.next(T0));
    for id in [&stuck, &on_relay, &accepted, &repush] {
        home.send(id, &["bob@work"]);
    }
    home.store
        .mailbox
        .with(|c| {
            // Held by the relay, which keeps refusing it; waiting for its next backoff.
            c.execute(
                "UPDATE outbox SET lan_failures = 2, attempts = 9, next_at = ?2,
                   last_error = 'rejected:target not enrolled' WHERE msg_id = ?1",
                rusqlite::params![on_relay, T0 + 100 * outbox::GIVE_UP_MS],
            )?;
            c.execute(
                "UPDATE outbox SET state = 'relay-accepted', accepted_at = ?2, via = 'relay'
                 WHERE msg_id = ?1",
                rusqlite::params![accepted, T0],
            )?;
            // Accepted by a relay once, to be pushed again (a new epoch).
            c.execute(
                "UPDATE outbox SET state = 'repush', accepted_at = ?2 WHERE msg_id = ?1",
                rusqlite::params![repush, T0],
            )?;
            Ok(())
        })
        .unwrap();
    let select = |relay_configured| {
        crate::transport::select::choose(crate::transport::select::Facts {
            lan_failures: 0,
            has_addr: false,
            lan_down: false,
            relay_configured,
        })
    };
    assert_eq!(select(false), None, "no transport takes the stuck row");
    let d = home.delivery(false);
    // Nothing ends at exactly 72 h.
    clock.set(T0 + outbox::GIVE_UP_MS);
    assert_eq!(d.pass().await.unwrap(), PassCounts::default());
    assert_eq!(home.row(&stuck, "work").state, "pending");
    assert!(home.alerts().is_empty());
    // Past it, the pass's sweep ends both rows no relay accepted, each with its alert.
    clock.set(T0 + outbox::GIVE_UP_MS + 1);
    let counts = d.pass().await.unwrap();
    assert_eq!(counts.gave_up, 2);
    let r = home.row(&stuck, "work");
    assert_eq!(
        (r.state.as_str(), r.last_error.as_deref()),
        (
            "undelivered",
            Some("gave up after 72 h (no transport could take it)")
        )
    );
    let r = home.row(&on_relay, "work");
    assert_eq!(
        (r.state.as_str(), r.last_error.as_deref()),
        (
            "undelivered",
            Some("gave up after 72 h (rejected:target not enrolled)")
        )
    );
    let settled: Option<i64> = home
        .store
        .fresh_conn()
        .query_row(
            "SELECT settled_at FROM outbox WHERE msg_id = ?1",
            [&stuck],
            |r| r.get(0),
        )
        .unwrap();
    assert_eq!(settled, Some(T0 + outbox::GIVE_UP_MS + 1));
    let alerts = home.alerts();
    assert_eq!(alerts.len(), 2);
    assert!(alerts.iter().all(|a| a.0 == "Undelivered to work: hello"));
    assert!(alerts.contains(&(
        "Undelivered to work: hello".to_string(),
        format!(
            "Message {stuck} could not be delivered to host work: gave up after 72 h (no transport could take it)"
        )
    )));
    // Rows a relay accepted are never ended by the rule, however old.
    clock.set(T0 + 1_000 * outbox::GIVE_UP_MS);
    assert_eq!(home.delivery(true).pass().await.unwrap().gave_up, 0);
    assert_eq!(home.row(&accepted, "work").state, "relay-accepted");
    assert_eq!(home.row(&repush, "work").state, "repush");
    assert_eq!(home.alerts().len(), 2);
}

#[tokio::test]
async fn an_http_error_counts_as_a_lan_failure_and_no_enc_key_keeps_the_row_unsealed() {
    let clock = testutil::clock();
    let home = Host::new("home", clock.clone());
    let work = testutil::identity("work");
    let peer = FakePeer::start().await;
    home.pin(&work, false, Some(&peer.addr));
    home.send(ID1, &["bob@work"]);
    // No enc key: the peer's /v1/enc-key answers 404.
    home.delivery(true).pass().await.unwrap();
    let r = home.row(ID1, "work");
    assert_eq!((r.lan_failures, r.wire.is_none()), (1, true));
    assert!(r.last_error.unwrap().contains("no enc key for work"));
    assert!(
        peer.seen("POST /v2/envelopes").is_empty(),
        "never plaintext"
    );
    // With the key known: a 500 is a failure too.
    home.store
        .mailbox
        .with(|c| peers::set_enc_key(c, "work", &work.enc_key.public().to_b64(), T0).map(|_| ()))
        .unwrap();
    peer.on("POST /v2/envelopes", |_| (500, json!({"error": "boom"})));
    clock.advance(outbox::backoff_ms(0));
    home.delivery(true).pass().await.unwrap();
    let r = home.row(ID1, "work");
    assert_eq!((r.state.as_str(), r.lan_failures), ("pending", 2));
    assert!(r.last_error.unwrap().contains("boom"));
}
