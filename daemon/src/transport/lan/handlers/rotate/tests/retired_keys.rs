//! Mail and receipts signed by a key the peer has since rotated away from.

use super::*;

#[tokio::test]
async fn mail_signed_by_a_retired_key_is_stored_once_but_a_hop_by_it_is_refused() {
    let f = fx().await;
    let beta_enc = f.beta.enc_key.public();
    let mut ids = testutil::ids();
    // Sealed and signed by alpha before it rotated; delivered after.
    let (lan_id, relay_id) = (ids.next(T0), ids.next(T0));
    let old_wire = |id: &str| {
        testutil::sealed_wire(
            &f.alpha_old,
            &beta_enc,
            id,
            "ann@alpha",
            &["bob@beta"],
            "s",
            T0,
        )
    };
    assert_eq!(f.announce(&[f.rotation()]).await, vec!["rotated"]);

    let client = |i: &Identity| LanClient::new(Arc::new(same(i)), testutil::clock(), 7400).unwrap();
    // A hop is now: the retired key no longer opens the LAN.
    match client(&f.alpha_old)
        .post_envelopes(&f.addr, &[old_wire(&lan_id)])
        .await
    {
        Err(LanError::Status { status: 401, error }) => {
            assert_eq!(error, "bad hop signature")
        }
        other => panic!("expected 401, got {other:?}"),
    }
    assert_eq!(f.store.scalar::<i64>("SELECT COUNT(*) FROM messages"), 0);
    // The same mail through a hop by the new key: stored once.
    let new = client(&f.alpha_new);
    let got = new
        .post_envelopes(&f.addr, &[old_wire(&lan_id)])
        .await
        .unwrap();
    assert_eq!(got[0].result, "accepted");
    let got = new
        .post_envelopes(&f.addr, &[old_wire(&lan_id)])
        .await
        .unwrap();
    assert_eq!(got[0].result, "duplicate");

    // Pushed to the relay by the retired key before the rotation, pulled after.
    let wire = old_wire(&relay_id);
    let ident = same(&f.beta);
    let pull = |sender: String| {
        f.store
            .mailbox
            .with(|c| receive::receive_sealed(c, &ident, &wire, &relay_id, &sender, T0))
            .unwrap()
    };
    assert!(matches!(
        pull(b64(&f.alpha_old)),
        Ok(receive::Verdict::Stored { .. })
    ));
    assert_eq!(pull(b64(&f.alpha_old)), Ok(receive::Verdict::Duplicate));
    // A key alpha never held is no sender, and the new key does not sign the old bytes
    // into something else: still one copy of each.
    assert_eq!(
        pull(HostKey::generate().public().to_b64()),
        Err("host not paired".into())
    );
    let n: i64 = f
        .store
        .scalar("SELECT COUNT(*) FROM messages WHERE origin = 'alpha'");
    assert_eq!(n, 2);

    // A key the peer never held does not verify its mail, even over a good hop.
    let forged = testutil::sealed_wire(
        &with_keys("alpha", HostKey::generate(), EncKey::generate()),
        &beta_enc,
        &ids.next(T0),
        "ann@alpha",
        &["bob@beta"],
        "s",
        T0,
    );
    let got = new.post_envelopes(&f.addr, &[forged]).await.unwrap();
    assert_eq!(got[0].result, "rejected:bad signature");
}

#[tokio::test]
async fn receipts_signed_by_a_retired_key_are_accepted() {
    let f = fx().await;
    let id = testutil::ids().next(T0);
    f.send_to_alpha(&id);
    let receipt = |seq: u64| Receipt {
        v: 1,
        kind: "receipt".into(),
        msg: id.clone(),
        recipient: "ann@alpha".into(),
        state: "read".into(),
        at: agentmbx_protocol::time::iso_ms(T0),
        note: None,
        did: None,
        seq,
    };
    let wire = |seq: u64, key: &HostKey| -> Value {
        serde_json::from_str(&receipt(seq).wire(key).unwrap()).unwrap()
    };
    assert_eq!(f.announce(&[f.rotation()]).await, vec!["rotated"]);
    let accept = |w: &Value, sender: &str| {
        f.store
            .mailbox
            .with(|c| receipts::accept(c, "beta", w, None, Some(sender), T0))
            .unwrap()
    };
    let (old, new) = (b64(&f.alpha_old), b64(&f.alpha_new));
    // Signed and pushed by the retired key before the rotation.
    assert_eq!(accept(&wire(1, &f.alpha_old.host_key), &old), "accepted");
    // Signed by the retired key, pushed by the new one (a receipt signed once, kept).
    assert_eq!(accept(&wire(2, &f.alpha_old.host_key), &new), "accepted");
    assert_eq!(accept(&wire(3, &f.alpha_new.host_key), &new), "accepted");
    // Neither a stranger's push nor a stranger's signature.
    let stranger = HostKey::generate();
    assert_eq!(
        accept(&wire(4, &f.alpha_new.host_key), &stranger.public().to_b64()),
        "rejected:receipt for ann@alpha did not come from alpha"
    );
    assert_eq!(accept(&wire(5, &stranger), &new), "rejected:bad signature");
}
