//! Learning a peer's enc key from the relay before sealing: only ads signed by the pinned peer
//! key are used, a failed lookup keeps the row unsealed, and the rollback guard refuses older ads
//! naming another key.

use super::*;

#[tokio::test]
async fn a_relay_ad_signed_by_the_pinned_key_is_used() {
    let s = Setup::new(false).await;
    let id = s.send_to_peer(ID1);
    let enc = s.peer.enc_key.public().to_b64();
    let ad = EncAd::new("work", &s.peer.host_key.public(), &enc, T0 - 1_000);
    let answer = enc_answer(&s.peer, &ad, &s.peer.host_key, &enc);
    s.relay
        .on("GET /v2/relay/enc-key", move |_| (200, answer.clone()));
    s.accept_all("e1", "accepted");
    let pass = s.client.push_due(&session("e1")).await.unwrap();
    assert_eq!(pass.accepted, 1);
    // The lookup is by the pinned key (URL-encoded), and signed.
    let lookups = s.relay.seen("GET /v2/relay/enc-key");
    assert_eq!(lookups.len(), 1);
    assert_eq!(lookups[0].q("pubkey"), s.peer_pub());
    s.relay.assert_hops_ok();
    // Recorded with its iat (rollback guard), and the body was sealed to it.
    let p = s
        .store
        .mailbox
        .with(|c| peers::by_name(c, "work"))
        .unwrap()
        .unwrap();
    assert_eq!(p.enc_pub.as_deref(), Some(enc.as_str()));
    assert_eq!(p.enc_ad_iat, Some(T0 - 1_000));
    let wire = s.row(&id).wire.unwrap();
    let env: Value = serde_json::from_slice(&wire).unwrap();
    let sealed: seal::Enc = serde_json::from_value(env["enc"].clone()).unwrap();
    assert_eq!(
        seal::open(&sealed, &s.peer.enc_key, &id).unwrap(),
        "body of hello"
    );
}

#[tokio::test]
async fn bad_relay_ads_are_never_used() {
    let day = 86_400_000;
    // (case, the relay's answer for the peer)
    type Make = Box<dyn Fn(&Identity) -> (u16, Value)>;
    let cases: Vec<(&str, Make)> = vec![
        (
            "signed by another key",
            Box::new(|p: &Identity| {
                let enc = p.enc_key.public().to_b64();
                let ad = EncAd::new("work", &p.host_key.public(), &enc, T0);
                (200, enc_answer(p, &ad, &HostKey::generate(), &enc))
            }),
        ),
        (
            "another host's ad",
            Box::new(|p: &Identity| {
                let other = HostKey::generate();
                let enc = p.enc_key.public().to_b64();
                let ad = EncAd::new("work", &other.public(), &enc, T0);
                (200, enc_answer(p, &ad, &other, &enc))
            }),
        ),
        (
            "expired",
            Box::new(move |p: &Identity| {
                let enc = p.enc_key.public().to_b64();
                let ad = EncAd::new("work", &p.host_key.public(), &enc, T0 - 31 * day);
                (200, enc_answer(p, &ad, &p.host_key, &enc))
            }),
        ),
        (
            "not yet valid",
            Box::new(|p: &Identity| {
                let enc = p.enc_key.public().to_b64();
                let ad = EncAd::new("work", &p.host_key.public(), &enc, T0 + 3_600_000);
                (200, enc_answer(p, &ad, &p.host_key, &enc))
            }),
        ),
        (
            "tampered: served enc_pub differs from ad.enc_pub",
            Box::new(|p: &Identity| {
                let enc = p.enc_key.public().to_b64();
                let ad = EncAd::new("work", &p.host_key.public(), &enc, T0);
                let served = EncKey::generate().public().to_b64();
                (200, enc_answer(p, &ad, &p.host_key, &served))
            }),
        ),
        (
            "ad edited after signing",
            Box::new(|p: &Identity| {
                let enc = p.enc_key.public().to_b64();
                let ad = EncAd::new("work", &p.host_key.public(), &enc, T0);
                let mut a = enc_answer(p, &ad, &p.host_key, &enc);
                let evil = EncKey::generate().public().to_b64();
                a["ad"]["enc_pub"] = json!(evil);
                a["enc_pub"] = json!(evil);
                (200, a)
            }),
        ),
        (
            "v1 only (no v2 ad)",
            Box::new(|p: &Identity| {
                (
                    200,
                    json!({"host": "work", "host_pubkey": p.host_key.public().to_b64(),
                           "enc_pub": p.enc_key.public().to_b64(), "sig": "c2ln"}),
                )
            }),
        ),
        (
            "unknown host",
            Box::new(|_p: &Identity| (404, json!({"error": "unknown host", "code": "NOT_FOUND"}))),
        ),
    ];
    for (name, make) in cases {
        let s = Setup::new(false).await;
        let id = s.send_to_peer(ID1);
        let answer = make(&s.peer);
        s.relay.on("GET /v2/relay/enc-key", move |_| answer.clone());
        s.accept_all("e1", "accepted");
        let pass = s.client.push_due(&session("e1")).await.unwrap();
        assert_eq!((pass.accepted, pass.failed), (0, 1), "{name}");
        s.assert_pending_unsealed(&id, T0, "no enc key");
        let row = s.row(&id);
        assert_eq!(row.wire, None, "{name}: never sealed with a refused key");
        assert!(
            s.relay.seen("POST /v2/relay/items").is_empty(),
            "{name}: nothing pushed, never plaintext"
        );
        let p = s
            .store
            .mailbox
            .with(|c| peers::by_name(c, "work"))
            .unwrap()
            .unwrap();
        assert_eq!(p.enc_pub, None, "{name}");
        assert_eq!(
            s.relay.seen("GET /v2/relay/enc-key").len(),
            1,
            "{name}: asked once"
        );
    }
}

#[tokio::test]
async fn an_enc_key_lookup_failure_keeps_the_row_pending_unsealed() {
    let s = Setup::new(false).await;
    let id = s.send_to_peer(ID1);
    s.relay.on("GET /v2/relay/enc-key", |_| {
        (500, json!({"error": "boom", "code": "INTERNAL"}))
    });
    s.client.push_due(&session("e1")).await.unwrap();
    s.assert_pending_unsealed(&id, T0, "500");
    assert!(s.relay.seen("POST /v2/relay/items").is_empty());
}

#[tokio::test]
async fn the_rollback_guard_refuses_an_older_ad_naming_another_key() {
    let s = Setup::new(false).await;
    let k1 = EncKey::generate().public().to_b64();
    let k2 = EncKey::generate().public().to_b64();
    let day = 86_400_000;
    s.store
        .mailbox
        .with(|c| {
            assert!(peers::set_enc_key(c, "work", &k1, T0)?);
            // Older ad naming another key: refused, nothing changes.
            assert!(!peers::set_enc_key(c, "work", &k2, T0 - day)?);
            // Same iat, another key: not newer, refused.
            assert!(!peers::set_enc_key(c, "work", &k2, T0)?);
            // An older ad for the same key is fine (nothing to roll back) and keeps the iat.
            assert!(peers::set_enc_key(c, "work", &k1, T0 - day)?);
            let p = peers::by_name(c, "work")?.unwrap();
            assert_eq!(
                (p.enc_pub.as_deref(), p.enc_ad_iat),
                (Some(k1.as_str()), Some(T0))
            );
            // A newer ad naming another key replaces it.
            assert!(peers::set_enc_key(c, "work", &k2, T0 + day)?);
            let p = peers::by_name(c, "work")?.unwrap();
            assert_eq!(
                (p.enc_pub.as_deref(), p.enc_ad_iat),
                (Some(k2.as_str()), Some(T0 + day))
            );
            // And now the first key is the older one.
            assert!(!peers::set_enc_key(c, "work", &k1, T0)?);
            Ok(())
        })
        .unwrap();
}
