//! Addresses the owner types: stored once they answer with the pinned key, or forced and stored
//! unproven without a heal record.

use super::*;

/// [`set_addr_by_owner`] on `on` for `host`.
async fn owner_sets(
    on: &Node,
    host: &str,
    addr: &str,
    force: bool,
) -> Result<OwnerAddr, OwnerAddrError> {
    let clock = on.lan.clock.clone();
    set_addr_by_owner(&on.store.mailbox, &clock, host, addr, force).await
}

#[tokio::test]
async fn an_address_the_owner_types_is_stored_only_once_it_answers_with_the_pinned_key() {
    crate::install_tls_provider();
    let clock = testutil::clock();
    let a = node("alpha", &clock, None).await;
    let b = node("beta", &clock, None).await;
    let dead = dead_addr();
    b.pin(&a, &dead);
    let id = b.queue_failing("alpha", "01KDVDNA3VG2MH8KWSQRCWJZ0S", 3);
    clock.advance(1_000);

    // Verified: stored with source cli, a heal record, and the queued mail due now.
    let live = a.addr.to_string();
    let set = owner_sets(&b, "alpha", &live, false).await.unwrap();
    assert_eq!(
        set,
        OwnerAddr {
            host: "alpha".into(),
            addr: live.clone(),
            verified: true,
            why: None
        }
    );
    let p = b.peer("alpha");
    assert_eq!(
        (p.addr.as_deref(), p.addr_source.as_deref()),
        (Some(live.as_str()), Some("cli"))
    );
    assert!(
        b.next_at(&id, "alpha") <= T0 + 1_000,
        "queued mail is due now"
    );
    let heal: Value = serde_json::from_str(&b.kv(&heal_key("alpha")).unwrap()).unwrap();
    assert_eq!(
        heal,
        json!({"via": "cli", "at": "2026-01-01T00:01:01.000Z", "from": dead, "to": live})
    );
    // A name the peer does not list is fine when the owner typed it.
    let named = format!("localhost:{}", a.addr.port());
    assert!(
        owner_sets(&b, "alpha", &named, false)
            .await
            .unwrap()
            .verified
    );
    assert_eq!(b.peer("alpha").addr.as_deref(), Some(named.as_str()));

    // Refused, naming why, and nothing changes: no answer ...
    let before = (b.peer("alpha"), b.kv(&heal_key("alpha")));
    let e = owner_sets(&b, "alpha", &dead, false).await.unwrap_err();
    let text = e.to_string();
    assert!(
        matches!(&e, OwnerAddrError::Unverified { why, .. } if why.starts_with("no answer")),
        "{text}"
    );
    assert!(
        text.starts_with(&format!("{dead} did not prove to be alpha: no answer")),
        "{text}"
    );
    assert!(text.contains("--force"), "{text}");
    // ... another key under the same name ...
    let impostor = node("alpha", &clock, None).await;
    let e = owner_sets(&b, "alpha", &impostor.addr.to_string(), false)
        .await
        .unwrap_err();
    assert!(
        e.to_string()
            .contains("it answered with another key than the one pinned"),
        "{e}"
    );
    // ... another host ...
    let e = owner_sets(&b, "alpha", &b.addr.to_string(), false)
        .await
        .unwrap_err();
    assert!(
        e.to_string()
            .contains("it answered as another host, \"beta\""),
        "names the host it answered as: {e}"
    );
    // ... not an agentmbx status at all.
    let (other, _) = plain_server().await;
    let e = owner_sets(&b, "alpha", &other, false).await.unwrap_err();
    assert!(e.to_string().contains("it answered HTTP 404"), "{e}");
    assert_eq!((b.peer("alpha"), b.kv(&heal_key("alpha"))), before);

    // An IP the peer does not sign is refused even when typed (a proxy or NAT in between).
    let c = node("gamma", &clock, Some(vec!["10.9.9.9".parse().unwrap()])).await;
    b.pin(&c, &dead);
    let e = owner_sets(&b, "gamma", &c.addr.to_string(), false)
        .await
        .unwrap_err();
    assert!(e.to_string().contains("does not list that IP"), "{e}");
    assert_eq!(b.peer("gamma").addr.as_deref(), Some(dead.as_str()));

    // Unknown peers are not found.
    assert!(matches!(
        owner_sets(&b, "nobody", &live, true).await,
        Err(OwnerAddrError::NotPaired(h)) if h == "nobody"
    ));
}

#[tokio::test]
async fn forced_owner_addresses_are_stored_unproven_without_a_heal_record() {
    crate::install_tls_provider();
    let clock = testutil::clock();
    let a = node("alpha", &clock, None).await;
    let b = node("beta", &clock, None).await;
    b.pin(&a, &a.addr.to_string());
    let id = b.queue_failing("alpha", "01KDVDNA3VG2MH8KWSQRCWJZ0S", 3);
    let dead = dead_addr();
    let set = owner_sets(&b, "alpha", &dead, true).await.unwrap();
    assert!(!set.verified);
    assert!(
        set.why.as_deref().unwrap().starts_with("no answer"),
        "{set:?}"
    );
    assert_eq!(
        serde_json::to_value(&set).unwrap()["verified"],
        json!(false)
    );
    let p = b.peer("alpha");
    assert_eq!(
        (p.addr.as_deref(), p.addr_source.as_deref()),
        (Some(dead.as_str()), Some("cli"))
    );
    assert!(
        b.next_at(&id, "alpha") <= T0,
        "mail to it is tried there now"
    );
    assert!(b.kv(&heal_key("alpha")).is_none(), "nothing was proven");
    // Forcing an address that does verify is just a verified store.
    let live = a.addr.to_string();
    let set = owner_sets(&b, "alpha", &live, true).await.unwrap();
    assert!(set.verified && set.why.is_none());
    assert!(serde_json::to_value(&set).unwrap().get("why").is_none());
    let heal: Value = serde_json::from_str(&b.kv(&heal_key("alpha")).unwrap()).unwrap();
    assert_eq!(
        (heal["via"].as_str(), heal["from"].as_str()),
        (Some("cli"), Some(dead.as_str()))
    );
}

/// A plain HTTP server on 127.0.0.1:0 that is not agentmbx (404 for everything).
async fn plain_server() -> (String, tokio::task::JoinHandle<()>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let task = tokio::spawn(async move {
        axum::serve(listener, Router::new()).await.unwrap();
    });
    (addr, task)
}

/// The owner setting the address already pinned: verified, the LAN mark clears (its signed
/// status answered there); forced while it does not answer, the mark stays and the address is
/// probed now.
#[tokio::test]
async fn the_owner_setting_the_pinned_address_again_clears_or_probes_the_mark() {
    use crate::mailbox::lan_memory::{self, DownReason};
    crate::install_tls_provider();
    let clock = testutil::clock();
    let a = node("alpha", &clock, None).await;
    let b = node("beta", &clock, None).await;
    let live = a.addr.to_string();
    b.pin(&a, &live);
    let mark = |now: i64| {
        b.store
            .mailbox
            .with(|c| {
                let route = lan_memory::lan_route(c, "alpha")?;
                lan_memory::mark_down(c, "alpha", DownReason::Timeout, now, now + 60_000, &route)
            })
            .unwrap()
    };
    let state = || {
        b.store
            .mailbox
            .with(|c| lan_memory::get(c, "alpha"))
            .unwrap()
            .unwrap()
    };
    assert!(mark(T0));
    assert!(
        owner_sets(&b, "alpha", &live, false)
            .await
            .unwrap()
            .verified
    );
    assert_eq!(
        state().down_since,
        None,
        "verified at the pinned address: cleared"
    );

    // A pinned address that does not answer, forced again: unproven.
    let dead = dead_addr();
    b.pin(&a, &dead);
    let now = agentmbx_protocol::clock::Clock::now_ms(&*clock);
    assert!(mark(now));
    assert!(!owner_sets(&b, "alpha", &dead, true).await.unwrap().verified);
    let st = state();
    assert_eq!(
        (st.down_since, st.probe_at),
        (Some(now), Some(now)),
        "forced: probed now"
    );
}
