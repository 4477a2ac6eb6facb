//! Healing a peer's address: from a dead port to the live one, only to a candidate that proves
//! the pinned key, through beacons, the failure ladder, mDNS answers and hops.

use super::*;

#[tokio::test]
async fn presence_heals_a_peer_from_a_dead_port_to_the_live_one_and_mail_is_due_now() {
    crate::install_tls_provider();
    let clock = testutil::clock();
    let a = node("alpha", &clock, None).await;
    let b = node("beta", &clock, None).await;
    let dead = dead_addr();
    b.pin(&a, &dead);
    let id = b.queue_failing("alpha", "01KDVDNA3VG2MH8KWSQRCWJZ0S", 3);
    assert!(b.next_at(&id, "alpha") > T0 + 10_000);
    clock.advance(1_000);
    let live = a.addr.to_string();
    let healing = accept_presence(
        &b.lan,
        "alpha",
        &beacon(T0 + 1_000, a.addr.port(), std::slice::from_ref(&live)),
        LOCAL,
    )
    .await
    .unwrap()
    .expect("a probe starts: the pinned port is dead and mail fails");
    let woken = b.lan.wake.clone();
    assert_eq!(healing.await.unwrap(), Some(live.clone()));
    // The sender was woken (a stored permit completes at once).
    tokio::time::timeout(std::time::Duration::from_secs(5), woken.notified())
        .await
        .expect("sender woken");
    let p = b.peer("alpha");
    assert_eq!(
        (p.addr.as_deref(), p.addr_source.as_deref()),
        (Some(live.as_str()), Some("presence"))
    );
    assert!(
        b.next_at(&id, "alpha") <= T0 + 1_000,
        "queued mail is due now"
    );
    let heal: Value = serde_json::from_str(&b.kv(&heal_key("alpha")).unwrap()).unwrap();
    assert_eq!(
        heal,
        json!({"via": "presence", "at": "2026-01-01T00:01:01.000Z", "from": dead, "to": live})
    );

    // One healing run a minute per peer: a new beacon (mail still failing) within the minute
    // probes nothing, after it it does.
    b.store
        .mailbox
        .with(|c| peers::set_addr(c, "alpha", &dead, "pair"))
        .unwrap();
    clock.advance(30_000);
    let again = accept_presence(
        &b.lan,
        "alpha",
        &beacon(T0 + 31_000, a.addr.port(), &[]),
        LOCAL,
    )
    .await
    .unwrap();
    assert!(again.is_none(), "throttled");
    clock.advance(30_000);
    let later = accept_presence(
        &b.lan,
        "alpha",
        &beacon(T0 + 61_000, a.addr.port(), &[]),
        LOCAL,
    )
    .await
    .unwrap()
    .expect("a minute later it probes again");
    assert_eq!(later.await.unwrap(), Some(live));
}

#[tokio::test]
async fn a_candidate_that_cannot_prove_the_pinned_key_is_never_adopted() {
    crate::install_tls_provider();
    let clock = testutil::clock();
    let a = node("alpha", &clock, None).await;
    // An impostor answering as "alpha" with its own key.
    let impostor = node("alpha", &clock, None).await;
    let b = node("beta", &clock, None).await;
    let dead = dead_addr();
    b.pin(&a, &dead);
    b.queue_failing("alpha", "01KDVDNA3VG2MH8KWSQRCWJZ0S", 1);
    let fake = impostor.addr.to_string();
    let healing = accept_presence(
        &b.lan,
        "alpha",
        &beacon(T0, impostor.addr.port(), std::slice::from_ref(&fake)),
        LOCAL,
    )
    .await
    .unwrap()
    .expect("probe starts");
    assert_eq!(healing.await.unwrap(), None);
    assert_eq!(b.peer("alpha").addr.as_deref(), Some(dead.as_str()));
    assert!(b.kv(&heal_key("alpha")).is_none());
    // Nor does an answer that does not list the candidate's IP.
    let unlisted = node("alpha", &clock, Some(vec!["10.9.9.9".parse().unwrap()])).await;
    let peer = b.peer("alpha");
    let key = PublicKey::from_b64(&peer.pubkey).unwrap();
    assert_ne!(key, unlisted.ident.host_key.public());
    assert_eq!(
        heal_peer_addr(&b.lan, "alpha", &unlisted.addr.to_string(), Via::Ladder)
            .await
            .unwrap(),
        None
    );
}

#[tokio::test]
async fn a_signed_beacon_over_the_wire_moves_the_peer_on_the_other_side() {
    crate::install_tls_provider();
    let clock = testutil::clock();
    let a = node("alpha", &clock, None).await;
    let b = node("beta", &clock, None).await;
    // alpha knows where beta is; beta has alpha at a dead port and nothing to send.
    a.pin(&b, &b.addr.to_string());
    let dead = dead_addr();
    b.pin(&a, &dead);
    assert_eq!(send_presence(&a.lan, None).await, vec!["beta".to_string()]);
    let live = a.addr.to_string();
    let moved = testutil_poll(|| {
        let p = b.peer("alpha");
        (p.addr.as_deref() == Some(live.as_str())).then_some(p)
    })
    .await;
    assert_eq!(moved.addr_source.as_deref(), Some("presence"));
    let heal: Value = serde_json::from_str(&b.kv(&heal_key("alpha")).unwrap()).unwrap();
    assert_eq!(
        (heal["via"].as_str(), heal["from"].as_str()),
        (Some("presence"), Some(dead.as_str()))
    );
    // The same beacon again (same ms) is a replay on the wire too.
    let (code, body) = {
        let client = LanClient::new(a.ident.clone(), clock.clone(), a.addr.port()).unwrap();
        let text = status::PresenceBody::new(T0, a.addr.port(), vec![], "x").to_json();
        let (code, bytes) = client
            .call(
                reqwest::Method::POST,
                &b.addr.to_string(),
                "/v1/presence",
                text.into_bytes(),
            )
            .await
            .unwrap();
        (code, serde_json::from_slice::<Value>(&bytes).unwrap())
    };
    assert_eq!(
        (code, body),
        (400, json!({"ok": false, "error": "stale presence (seq)"}))
    );
    // Peers without an address get no beacon; an unknown sender is refused by the hop check.
    let c = node("gamma", &clock, None).await;
    c.store.add_peer(&b.ident, true);
    assert!(send_presence(&c.lan, None).await.is_empty());
    c.store
        .mailbox
        .with(|conn| peers::set_addr(conn, "beta", &b.addr.to_string(), "pair"))
        .unwrap();
    assert!(
        send_presence(&c.lan, None).await.is_empty(),
        "beta has not paired gamma"
    );
}

#[tokio::test]
async fn the_failure_ladder_tries_last_seen_alternates_then_mdns_and_hops_heal_too() {
    crate::install_tls_provider();
    let clock = testutil::clock();
    let a = node("alpha", &clock, None).await;
    let b = node("beta", &clock, None).await;
    let live = a.addr.to_string();
    let dead = dead_addr();
    b.pin(&a, &dead);
    // Not stuck yet (one failure): the ladder leaves it alone.
    b.queue_failing("alpha", "01KDVDNA3VG2MH8KWSQRCWJZ0S", 1);
    b.store
        .mailbox
        .with(|c| relay_state::kv_set(c, &alts_key("alpha"), &json!([live]).to_string()))
        .unwrap();
    assert!(heal_stuck_peers(&b.lan, |_, _| Vec::new()).await.is_empty());
    // Stuck: the stored alternate is proven and adopted.
    b.store
        .mailbox
        .with(|c| outbox::fail(c, "01KDVDNA3VG2MH8KWSQRCWJZ0S", "alpha", "x", false, T0))
        .unwrap();
    assert_eq!(
        heal_stuck_peers(&b.lan, |_, _| Vec::new()).await,
        vec!["alpha".to_string()]
    );
    assert_eq!(b.peer("alpha").addr_source.as_deref(), Some("ladder"));
    // No alternates left: the mDNS rung (given only for the pinned key) moves it.
    b.store
        .mailbox
        .with(|c| {
            peers::set_addr(c, "alpha", &dead, "pair")?;
            relay_state::kv_set(c, &alts_key("alpha"), "[]")
        })
        .unwrap();
    let pinned = a.ident.host_key.public();
    let l = live.clone();
    let moved = heal_stuck_peers(&b.lan, move |host, key| {
        if host == "alpha" && *key == pinned {
            vec![l.clone()]
        } else {
            Vec::new()
        }
    })
    .await;
    assert_eq!(moved, vec!["alpha".to_string()]);
    assert_eq!(b.peer("alpha").addr_source.as_deref(), Some("mdns"));
    // A verified hop from a new place: the source IP with the port hint is probed.
    b.store
        .mailbox
        .with(|c| peers::set_addr(c, "alpha", "127.0.0.9:1", "pair"))
        .unwrap();
    clock.advance(HEAL_THROTTLE_MS);
    let learned = learn_from_hop(&b.lan, "alpha", LOCAL, Some(a.addr.port()))
        .await
        .unwrap()
        .expect("a probe starts");
    assert_eq!(learned.await.unwrap(), Some(live.clone()));
    assert_eq!(b.peer("alpha").addr_source.as_deref(), Some("verified-hop"));
    // From the pinned IP itself nothing is probed.
    assert!(learn_from_hop(&b.lan, "alpha", LOCAL, Some(a.addr.port()))
        .await
        .unwrap()
        .is_none());
    // mDNS answers for a peer whose pinned address still works change nothing.
    assert_eq!(
        consider_mdns(&b.lan, "alpha", vec![live]).await.unwrap(),
        None
    );
}

/// Case `clock-fix-does-not-release-mail`: a healing run recorded while the clock was 10 min
/// ahead does not hold the peer's slot for the length of the skew once the clock is right.
#[test]
fn a_heal_slot_taken_under_a_clock_ahead_is_free_once_the_clock_is_right() {
    let s = testutil::store();
    s.mailbox
        .with(|c| {
            assert!(take_heal_slot(c, "work", Slot::Presence, T0 + 600_000)?);
            assert!(take_heal_slot(c, "work", Slot::Presence, T0)?);
            assert!(
                !take_heal_slot(c, "work", Slot::Presence, T0 + 1)?,
                "throttled"
            );
            assert!(take_heal_slot(
                c,
                "work",
                Slot::Presence,
                T0 + HEAL_THROTTLE_MS
            )?);
            Ok(())
        })
        .unwrap();
}

/// Polls `check` every 20 ms for up to 10 s.
async fn testutil_poll<T>(mut check: impl FnMut() -> Option<T>) -> T {
    let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(10);
    loop {
        if let Some(v) = check() {
            return v;
        }
        assert!(tokio::time::Instant::now() < deadline, "timed out");
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
}

#[tokio::test]
async fn mdns_answers_never_take_the_slot_presence_and_hops_heal_with() {
    crate::install_tls_provider();
    let clock = testutil::clock();
    let a = node("alpha", &clock, None).await;
    let impostor = node("alpha", &clock, None).await;
    let b = node("beta", &clock, None).await;
    let dead = dead_addr();
    b.pin(&a, &dead);
    b.queue_failing("alpha", "01KDVDNA3VG2MH8KWSQRCWJZ0S", 1);
    // Someone advertises alpha's name (and its public fingerprint) at its own address.
    let fake = impostor.addr.to_string();
    assert_eq!(
        consider_mdns(&b.lan, "alpha", vec![fake.clone()])
            .await
            .unwrap(),
        None
    );
    assert_eq!(b.peer("alpha").addr.as_deref(), Some(dead.as_str()));
    // Its own slot is taken: a second answer within the minute probes nothing.
    assert_eq!(
        consider_mdns(&b.lan, "alpha", vec![a.addr.to_string()])
            .await
            .unwrap(),
        None
    );
    assert_eq!(b.peer("alpha").addr.as_deref(), Some(dead.as_str()));
    // The genuine beacon and hop still heal at once.
    let live = a.addr.to_string();
    let healing = accept_presence(
        &b.lan,
        "alpha",
        &beacon(T0, a.addr.port(), std::slice::from_ref(&live)),
        LOCAL,
    )
    .await
    .unwrap()
    .expect("presence probes: its slot is free");
    assert_eq!(healing.await.unwrap(), Some(live.clone()));
    b.store
        .mailbox
        .with(|c| peers::set_addr(c, "alpha", &dead, "pair"))
        .unwrap();
    let learned = learn_from_hop(&b.lan, "alpha", LOCAL, Some(a.addr.port()))
        .await
        .unwrap()
        .expect("the hop probes: its slot is free");
    assert_eq!(learned.await.unwrap(), Some(live.clone()));
    // A minute later mDNS may try again, and the genuine answer moves it.
    b.store
        .mailbox
        .with(|c| peers::set_addr(c, "alpha", &dead, "pair"))
        .unwrap();
    clock.advance(HEAL_THROTTLE_MS);
    assert_eq!(
        consider_mdns(&b.lan, "alpha", vec![fake, live.clone()])
            .await
            .unwrap(),
        Some(live)
    );
    assert_eq!(b.peer("alpha").addr_source.as_deref(), Some("mdns"));
}

#[tokio::test]
async fn a_hop_from_another_reported_address_keeps_a_working_pin_until_mail_fails() {
    crate::install_tls_provider();
    let clock = testutil::clock();
    // alpha serves on 127.0.0.1 and also reports 127.0.0.2 (two interfaces).
    let two = vec![LOCAL, "127.0.0.2".parse().unwrap()];
    let a = node("alpha", &clock, Some(two)).await;
    let b = node("beta", &clock, None).await;
    let pinned = format!("127.0.0.2:{}", a.addr.port());
    b.pin(&a, &pinned);
    // A hop from 127.0.0.1: the candidate proves alpha's key, but alpha still reports the
    // pinned address and no mail fails, so the pin stays.
    let kept = learn_from_hop(&b.lan, "alpha", LOCAL, Some(a.addr.port()))
        .await
        .unwrap()
        .expect("a probe starts: the hop came from another IP");
    assert_eq!(kept.await.unwrap(), None);
    assert_eq!(b.peer("alpha").addr.as_deref(), Some(pinned.as_str()));
    assert!(b.kv(&heal_key("alpha")).is_none());
    // Once mail to it fails, the proven address is taken.
    b.queue_failing("alpha", "01KDVDNA3VG2MH8KWSQRCWJZ0S", 1);
    clock.advance(HEAL_THROTTLE_MS);
    let moved = learn_from_hop(&b.lan, "alpha", LOCAL, Some(a.addr.port()))
        .await
        .unwrap()
        .expect("a probe starts");
    assert_eq!(moved.await.unwrap(), Some(a.addr.to_string()));
    assert_eq!(b.peer("alpha").addr_source.as_deref(), Some("verified-hop"));
}
