//! Peers that move: the address candidate, a signed request from a new address, and a peer
//! whose two daemons alternate on its key.

use super::*;

#[test]
fn the_address_candidate_takes_the_hinted_then_the_pinned_then_the_default_port() {
    let v4: IpAddr = "::ffff:10.0.0.5".parse().unwrap();
    assert_eq!(candidate(v4, "7400", Some("x.local:7444")), "10.0.0.5:7400");
    assert_eq!(candidate(v4, "", Some("x.local:7444")), "10.0.0.5:7444");
    assert_eq!(candidate(v4, "0", Some("x.local")), "10.0.0.5:7373");
    assert_eq!(candidate(v4, "99999", None), "10.0.0.5:7373");
    let v6: IpAddr = "fe80::1".parse().unwrap();
    assert_eq!(candidate(v6, "7400", None), "[fe80::1]:7400");
}

/// A port on 127.0.0.1 that nothing listens on (bound, then released).
fn dead_addr() -> String {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let a = l.local_addr().unwrap();
    drop(l);
    a.to_string()
}

/// Polls `check` every 20 ms for up to 10 s.
async fn poll<T>(what: &str, mut check: impl FnMut() -> Option<T>) -> T {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        if let Some(v) = check() {
            return v;
        }
        assert!(tokio::time::Instant::now() < deadline, "timed out: {what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test]
async fn a_signed_request_from_a_new_address_moves_the_peer_once_its_status_proves_the_key() {
    let n = net().await;
    // alpha's own LAN server (signing 127.0.0.1), where beta does not look for it: beta has
    // alpha pinned at a port where nothing listens.
    let alpha_server = serve_host(
        n.alpha.clone(),
        testutil::store(),
        vec![IpAddr::V4(std::net::Ipv4Addr::LOCALHOST)],
    )
    .await;
    let live = alpha_server.addr.clone();
    let dead = dead_addr();
    let pin = |addr: &str| {
        n.beta
            .store
            .mailbox
            .with(|c| peers::set_addr(c, "alpha", addr, "pair"))
            .unwrap();
    };
    pin(&dead);
    let alpha_at = || {
        n.beta
            .store
            .mailbox
            .with(|c| peers::by_name(c, "alpha"))
            .unwrap()
            .unwrap()
    };

    let client = LanClient::new(
        n.alpha.clone(),
        n.alpha_clock.clone(),
        alpha_server.state.port,
    )
    .unwrap();

    // A signed request from alpha's live server address: probed and adopted.
    let agents = client.get_agents(&n.beta.addr).await.unwrap();
    assert_eq!(
        agents.host, "beta",
        "the request is answered; healing runs on its own"
    );
    let moved = poll("alpha adopted at its live address", || {
        let p = alpha_at();
        (p.addr.as_deref() == Some(live.as_str())).then_some(p)
    })
    .await;
    assert_eq!(moved.addr_source.as_deref(), Some("verified-hop"));
    let heal: serde_json::Value = serde_json::from_str(
        &n.beta
            .store
            .mailbox
            .with(|c| relay_state::kv_get(c, "peer-heal:alpha"))
            .unwrap()
            .unwrap(),
    )
    .unwrap();
    assert_eq!(
        (
            heal["via"].as_str(),
            heal["from"].as_str(),
            heal["to"].as_str()
        ),
        (
            Some("verified-hop"),
            Some(dead.as_str()),
            Some(live.as_str())
        )
    );
    // An impostor with alpha's name but not its key is refused at the hop: nothing moves.
    pin(&dead);
    n.beta.clock.advance(60_000);
    let forger = LanClient::new(
        Arc::new(testutil::identity("alpha")),
        n.alpha_clock.clone(),
        alpha_server.state.port,
    )
    .unwrap();
    forger.get_agents(&n.beta.addr).await.unwrap_err();
    assert_eq!(alpha_at().addr.as_deref(), Some(dead.as_str()));
}

#[tokio::test]
async fn a_peer_whose_two_daemons_alternate_on_its_key_is_reported_and_its_mail_stored_once() {
    use crate::instance::{Instance, PEER_KEY_CLONE};
    let n = net().await;
    let mut ids = testutil::ids();
    // Two daemons of alpha (one home and a copy of it): one identity, two instances.
    let first = n.client.clone().with_instance(Arc::new(Instance::new()));
    let copy = n.client.clone().with_instance(Arc::new(Instance::new()));
    // Without the header (the CLI, 0.5.x), and one restart (one id, then the other for good).
    let plain = n.client.clone();
    let mut sent = Vec::new();
    let mut post = async |client: &LanClient| {
        let id = ids.next(T0);
        let r = client
            .post_envelopes(&n.beta.addr, &[n.wire(&id)])
            .await
            .unwrap();
        assert_eq!(results(&r), ["accepted"]);
        sent.push(id);
    };
    for client in [&plain, &first, &first, &plain, &copy, &copy, &plain] {
        post(client).await;
    }
    assert_eq!(n.beta.state.instance.reasons(), []);
    // Both running: their hops alternate (the third return is the detection).
    for client in [&first, &copy, &first, &copy] {
        post(client).await;
    }
    let reasons = n.beta.state.instance.reasons();
    assert_eq!(reasons.len(), 1, "{reasons:?}");
    assert_eq!(reasons[0].code, PEER_KEY_CLONE);
    assert_eq!(reasons[0].peer.as_deref(), Some("alpha"));
    assert!(reasons[0].detail.contains("peer alpha"), "{reasons:?}");
    // Mail is what it was: every envelope stored once, whichever daemon sent it.
    for id in &sent {
        assert_eq!(
            n.beta
                .count(&format!("SELECT COUNT(*) FROM messages WHERE id = '{id}'")),
            1
        );
    }
    assert_eq!(n.beta.count("SELECT COUNT(*) FROM messages"), 11);
}
