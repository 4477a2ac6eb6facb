//! The enc-key, unpair and receipts routes, and what a good hop does to a peer's queued mail.

use super::*;

#[tokio::test]
async fn the_enc_key_answer_verifies_against_the_pinned_key_only() {
    let n = net().await;
    let peer = beta_peer(&n);
    let enc = n.client.get_enc_key(&n.beta.addr, &peer).await.unwrap();
    assert_eq!(enc, n.beta_enc.to_b64());

    // Pinned to another key under the same name: the answer does not verify.
    let wrong = peers::Peer {
        pubkey: HostKey::generate().public().to_b64(),
        ..peer.clone()
    };
    let e = n
        .client
        .get_enc_key(&n.beta.addr, &wrong)
        .await
        .unwrap_err();
    assert!(
        matches!(&e, LanError::BadAnswer(m) if m == "enc-key answer is not signed by the pinned host key"),
        "{e:?}"
    );
    // Asked as if it were another host: the signed name does not match.
    let renamed = peers::Peer {
        host: "other".into(),
        ..peer
    };
    let e = n
        .client
        .get_enc_key(&n.beta.addr, &renamed)
        .await
        .unwrap_err();
    assert!(
        matches!(&e, LanError::BadAnswer(m) if m == "enc-key answer is for host beta, not other"),
        "{e:?}"
    );

    let agents = n.client.get_agents(&n.beta.addr).await.unwrap();
    assert_eq!(agents.host, "beta");
}

#[tokio::test]
async fn unpair_removes_the_calling_peer_and_ends_its_pending_mail() {
    let n = net().await;
    seed_outbox(&n.beta.store, "m1", "alpha", "pending", T0 + 3_600_000, 2);
    n.client.unpair(&n.beta.addr).await.unwrap();
    assert_eq!(
        n.beta
            .count("SELECT COUNT(*) FROM peers WHERE host = 'alpha'"),
        0
    );
    assert_eq!(
        n.beta
            .count("SELECT COUNT(*) FROM outbox WHERE host = 'alpha' AND state = 'undelivered'"),
        1
    );
    let e = n.client.unpair(&n.beta.addr).await.unwrap_err();
    assert_eq!(status_of(e), (401, "host not paired".into()));
}

/// A local message `id` with one outbox row to `host`.
fn seed_outbox(store: &Store, id: &str, host: &str, state: &str, next_at: i64, lan_failures: i64) {
    store
        .mailbox
        .with(|c| {
            c.execute(
                "INSERT OR IGNORE INTO messages VALUES (?1,'t','bob@beta',?1,NULL,'message','s','b','{}','local',1)",
                [id],
            )?;
            c.execute(
                "INSERT INTO outbox(msg_id, host, target_pubkey, state, attempts, lan_failures, next_at, created_at)
                 VALUES (?1, ?2, 'K', ?3, 3, ?4, ?5, ?6)",
                rusqlite::params![id, host, state, lan_failures, next_at, T0 - 60_000],
            )?;
            Ok(())
        })
        .unwrap();
}

#[tokio::test]
async fn a_good_hop_makes_the_peers_queued_mail_due_now_and_records_where_it_came_from() {
    let n = net().await;
    seed_outbox(&n.beta.store, "m1", "alpha", "pending", T0 + 3_600_000, 2);
    seed_outbox(
        &n.beta.store,
        "m2",
        "alpha",
        "relay-accepted",
        T0 + 3_600_000,
        2,
    );
    seed_outbox(&n.beta.store, "m3", "gamma", "pending", T0 + 3_600_000, 2);
    let wake = n.beta.state.wake.clone();
    let woken = wake.notified();
    tokio::pin!(woken);
    woken.as_mut().enable();

    n.client.get_agents(&n.beta.addr).await.unwrap();

    let row = |id: &str| -> (i64, i64) {
        n.beta
            .store
            .fresh_conn()
            .query_row(
                "SELECT next_at, lan_failures FROM outbox WHERE msg_id = ?1",
                [id],
                |r| Ok((r.get(0)?, r.get(1)?)),
            )
            .unwrap()
    };
    // Due now and the LAN's again (one LAN failure short of the relay handover).
    assert_eq!(row("m1"), (T0, 1));
    assert_eq!(row("m2"), (T0 + 3_600_000, 2));
    assert_eq!(row("m3"), (T0 + 3_600_000, 2));
    tokio::time::timeout(Duration::from_secs(5), woken)
        .await
        .expect("the sender loops are woken");
    assert_eq!(
        n.beta
            .count("SELECT last_seen_at FROM peers WHERE host = 'alpha'"),
        T0
    );
    let seen = n
        .beta
        .store
        .mailbox
        .with(|c| relay_state::kv_get(c, "peer-lastseen:alpha"))
        .unwrap();
    assert_eq!(seen.as_deref(), Some("127.0.0.1:7400"));

    // A refused hop changes nothing.
    seed_outbox(&n.beta.store, "m4", "alpha", "pending", T0 + 3_600_000, 2);
    let forger = n.client_as(testutil::identity("alpha"));
    forger.get_agents(&n.beta.addr).await.unwrap_err();
    assert_eq!(row("m4"), (T0 + 3_600_000, 2));
}

#[tokio::test]
async fn receipts_are_answered_one_result_each_in_order() {
    let n = net().await;
    let wires = vec![
        br#"{"rec":{"v":1},"sig":"x"}"#.to_vec(),
        br#"{"rec":{"v":1},"sig":"y"}"#.to_vec(),
    ];
    let r = n.client.post_receipts(&n.beta.addr, &wires).await.unwrap();
    assert_eq!(r.len(), 2);
    assert!(r.iter().all(|x| x.starts_with("rejected:")), "{r:?}");
    let body = format!("{{\"receipts\":[{}]}}", vec!["{}"; 201].join(","));
    let e = n
        .client
        .signed_post_json(&n.beta.addr, "/v1/receipts", body.into_bytes())
        .await
        .unwrap_err();
    assert_eq!(
        status_of(e),
        (
            400,
            "bad batch: receipts must be an array of at most 200".into()
        )
    );
}
