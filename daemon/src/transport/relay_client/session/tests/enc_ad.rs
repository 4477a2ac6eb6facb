//! Publishing this host's enc-key ad to the relay (when it is due) and refusing relay-served ads
//! of peers.

use std::sync::Arc;

use serde_json::json;

use agentmbx_protocol::keys::{EncKey, HostKey};
use agentmbx_protocol::records;
use agentmbx_protocol::records::EncAd;
use agentmbx_protocol::time::iso_ms;

use crate::mailbox::peers;
use crate::testutil::{self, T0};
use crate::transport::relay_client;
use crate::transport::relay_client::state::{self as relay_trust, Standing};
use crate::transport::relay_client::test_support::*;

#[tokio::test]
async fn the_enc_ad_is_republished_on_a_new_epoch_daily_and_on_a_key_change() {
    let s = Setup::new(true).await;
    let t = s.trusty();
    // The relay already holds a fresh ad of this host: adopted, not republished.
    s.client.open_session().await.unwrap();
    assert_eq!(s.relay.seen("POST /v2/relay/enc-key").len(), 0);
    let st = s.relay_state().unwrap();
    assert_eq!(st.enc_ad_exp, Some(iso_ms(T0 + 30 * DAY_MS)));
    // A new epoch (a restore): challenge, enrol and enc-ad publish again, audited.
    *t.epoch.lock().unwrap() = "e2".into();
    t.queue.lock().unwrap().epoch = "e2".into();
    s.client.open_session().await.unwrap();
    assert_eq!(s.relay.seen("POST /v1/relay/enrol").len(), 1);
    let ads = s.relay.seen("POST /v2/relay/enc-key");
    assert_eq!(ads.len(), 1);
    let ad = records::verify_enc_ad(
        &ads[0].json()["ad"],
        ads[0].json()["sig"].as_str(),
        &s.me_pub(),
        T0,
    )
    .unwrap();
    assert_eq!(
        (ad.iat.clone(), ad.exp.clone()),
        (iso_ms(T0), iso_ms(T0 + 30 * DAY_MS))
    );
    let enrolled = s.audits("relay.enrolled");
    assert_eq!(enrolled[0].detail["why"], "new relay epoch");
    assert_eq!(enrolled[0].detail["epoch"], "e2");
    // Same epoch, within the day: nothing.
    s.clock.advance(DAY_MS - 1);
    s.client.open_session().await.unwrap();
    assert_eq!(s.relay.seen("POST /v2/relay/enc-key").len(), 1);
    // A day after the last publish: refreshed (no enrolment).
    s.clock.advance(1);
    s.client.open_session().await.unwrap();
    assert_eq!(s.relay.seen("POST /v2/relay/enc-key").len(), 2);
    assert_eq!(s.relay.seen("POST /v1/relay/enrol").len(), 1);
    // This host's enc key changed: published at once, naming the new key.
    let mut me2 = (*s.me).clone();
    me2.enc_key = EncKey::generate();
    let me2 = Arc::new(me2);
    let c2 = Setup::client_for(&s.relay.url, &s.relay.key, &me2, &s.store, &s.clock);
    c2.open_session().await.unwrap();
    let ads = s.relay.seen("POST /v2/relay/enc-key");
    assert_eq!(ads.len(), 3);
    assert_eq!(
        ads[2].json()["ad"]["enc_pub"],
        me2.enc_key.public().to_b64()
    );
    // A publish the relay refuses is its own state; receiving still works.
    s.relay.on("POST /v2/relay/enc-key", |_| {
        (
            400,
            json!({"error": "enc-key ad refused: expired", "code": "BAD_REQUEST"}),
        )
    });
    s.clock.advance(DAY_MS);
    s.client.open_session().await.unwrap();
    let st = s.relay_state().unwrap();
    assert_eq!((st.state, st.status), (Standing::EncAdFailed, Some(400)));
}

/// Case `clock-fix-does-not-release-mail`: an ad published while the clock was 10 min ahead
/// (its `iat` ahead of the right clock, the relay's copy expiring too late to look fresh) is
/// published again as soon as the clock is right, not once the clock has caught up.
#[test]
fn an_ad_published_under_a_clock_ahead_is_due_once_the_clock_is_right() {
    const SKEW: i64 = 600_000;
    let (host, enc, iat) = ("H", "E", T0 + SKEW);
    let published = relay_client::state::PublishedAd {
        host_pubkey: host.into(),
        enc_pub: enc.into(),
        iat,
        exp: iat + 30 * DAY_MS,
        epoch: "e1".into(),
    };
    let served = agentmbx_protocol::wire::YouEncAd {
        enc_pub: enc.into(),
        exp: iso_ms(iat + 30 * DAY_MS),
        v1: false,
    };
    let due = relay_client::session::ad_due;
    assert_eq!(
        due(Some(&published), Some(&served), host, enc, "e1", T0),
        Some("published while the clock was ahead")
    );
    // Under the skewed clock itself it was current.
    assert_eq!(
        due(Some(&published), Some(&served), host, enc, "e1", iat),
        None
    );
}

#[test]
fn the_ad_is_due_exactly_when_the_rules_say() {
    let (host, enc) = ("H", "E");
    let rec = |iat: i64, epoch: &str| relay_client::state::PublishedAd {
        host_pubkey: host.into(),
        enc_pub: enc.into(),
        iat,
        exp: iat + 30 * DAY_MS,
        epoch: epoch.into(),
    };
    let served = |exp: i64, v1: bool, e: &str| agentmbx_protocol::wire::YouEncAd {
        enc_pub: e.into(),
        exp: iso_ms(exp),
        v1,
    };
    let due = relay_client::session::ad_due;
    let now = T0;
    let fresh = served(now + 30 * DAY_MS, false, enc);
    // Nothing published from here, relay copy fresh: adopt. Not fresh: publish.
    assert_eq!(due(None, Some(&fresh), host, enc, "e1", now), None);
    assert!(due(None, None, host, enc, "e1", now).is_some());
    assert!(due(
        None,
        Some(&served(now + 29 * DAY_MS, false, enc)),
        host,
        enc,
        "e1",
        now
    )
    .is_some());
    assert!(due(
        None,
        Some(&served(now + 30 * DAY_MS, true, enc)),
        host,
        enc,
        "e1",
        now
    )
    .is_some());
    assert!(due(
        None,
        Some(&served(now + 30 * DAY_MS, false, "X")),
        host,
        enc,
        "e1",
        now
    )
    .is_some());
    // Published: key change, epoch, daily; drift only after the retry pause.
    let r = rec(now, "e1");
    assert_eq!(
        due(Some(&r), Some(&fresh), host, enc, "e1", now + DAY_MS - 1),
        None
    );
    assert_eq!(
        due(Some(&r), Some(&fresh), host, enc, "e1", now + DAY_MS),
        Some("daily refresh")
    );
    assert_eq!(
        due(Some(&r), Some(&fresh), host, enc, "e2", now),
        Some("new relay epoch")
    );
    assert_eq!(
        due(Some(&r), Some(&fresh), host, "E2", "e1", now),
        Some("this host's keys changed")
    );
    assert_eq!(
        due(Some(&r), Some(&fresh), "H2", enc, "e1", now),
        Some("this host's keys changed")
    );
    assert_eq!(due(Some(&r), None, host, enc, "e1", now + 59_999), None);
    assert!(due(Some(&r), None, host, enc, "e1", now + 60_000).is_some());
}

#[test]
fn relay_served_enc_ads_are_refused_with_the_exact_reasons() {
    let peer = testutil::identity("work");
    let pk = peer.host_key.public().to_b64();
    let enc = peer.enc_key.public().to_b64();
    let answer = |ad: Option<&EncAd>, signer: &HostKey, served: &str, v1sig: Option<&str>| {
        agentmbx_protocol::wire::EncKeyAnswer {
            host: "work".into(),
            host_pubkey: pk.clone(),
            enc_pub: served.into(),
            sig: v1sig.map(String::from),
            ad: ad.map(|a| a.to_value()),
            ad_sig: ad.map(|a| a.sign(signer)),
        }
    };
    let check = |a: &agentmbx_protocol::wire::EncKeyAnswer| {
        relay_client::session::enc_ad_from_answer(a, &pk, T0).map(|ad| ad.enc_pub)
    };
    let good = EncAd::new("work", &peer.host_key.public(), &enc, T0);
    assert_eq!(
        check(&answer(Some(&good), &peer.host_key, &enc, None)),
        Ok(enc.clone())
    );
    let other = EncKey::generate().public().to_b64();
    assert_eq!(
        check(&answer(Some(&good), &peer.host_key, &other, None)).unwrap_err(),
        "tampered: the served key differs from the signed advertisement"
    );
    let v1 = check(&answer(None, &peer.host_key, &enc, Some("c2ln"))).unwrap_err();
    assert!(v1.starts_with("unexpiring v1 advertisement ("), "{v1}");
    assert_eq!(
        check(&answer(None, &peer.host_key, &enc, None)).unwrap_err(),
        "unsigned"
    );
    assert_eq!(
        check(&answer(Some(&good), &HostKey::generate(), &enc, None)).unwrap_err(),
        "bad signature"
    );
    let stranger = HostKey::generate();
    let theirs = EncAd::new("work", &stranger.public(), &enc, T0);
    assert_eq!(
        check(&answer(Some(&theirs), &stranger, &enc, None)).unwrap_err(),
        "wrong peer"
    );
    let old = EncAd::new("work", &peer.host_key.public(), &enc, T0 - 31 * DAY_MS);
    assert_eq!(
        check(&answer(Some(&old), &peer.host_key, &enc, None)).unwrap_err(),
        "expired"
    );
    let ahead = EncAd::new("work", &peer.host_key.public(), &enc, T0 + 300_001);
    assert_eq!(
        check(&answer(Some(&ahead), &peer.host_key, &enc, None)).unwrap_err(),
        "not yet valid"
    );
    let mut long = EncAd::new("work", &peer.host_key.public(), &enc, T0);
    long.exp = iso_ms(T0 + 90 * DAY_MS + 1);
    assert_eq!(
        check(&answer(Some(&long), &peer.host_key, &enc, None)).unwrap_err(),
        "lifetime over the maximum"
    );
    let mut bad = answer(Some(&good), &peer.host_key, &enc, None);
    bad.ad_sig = Some(String::new());
    assert_eq!(check(&bad).unwrap_err(), "unsigned");
}

#[tokio::test]
async fn a_rolled_back_relay_ad_is_refused_recorded_and_audited_once() {
    let s = Setup::new(false).await;
    let k1 = EncKey::generate().public().to_b64();
    let k2 = s.peer.enc_key.public().to_b64();
    let peer = s.peer_pub();
    // The newest ad accepted for this peer host key named k1 at T0 (the peer row later lost
    // its enc key, e.g. through a rotation); the relay now replays an older ad naming k2.
    s.store
        .mailbox
        .with(|c| relay_trust::guard_enc_ad(c, &peer, &k1, T0).map(|r| r.unwrap()))
        .unwrap();
    let older = EncAd::new("work", &s.peer.host_key.public(), &k2, T0 - DAY_MS);
    let answer = enc_answer(&s.peer, &older, &s.peer.host_key, &k2);
    s.relay
        .on("GET /v2/relay/enc-key", move |_| (200, answer.clone()));
    s.accept_all("e1", "accepted");
    let id = s.send_to_peer(ID1);
    for _ in 0..2 {
        let pass = s.client.push_due(&session("e1")).await.unwrap();
        assert_eq!(pass.accepted, 0);
        s.clock.advance(60_000);
    }
    assert_eq!(s.row(&id).wire, None, "never sealed for a rolled-back key");
    assert!(s.relay.seen("POST /v2/relay/items").is_empty());
    let why = s
        .store
        .mailbox
        .with(|c| relay_trust::enc_refusal(c, "work"))
        .unwrap()
        .unwrap();
    assert!(why.starts_with("rolled back: "), "{why}");
    let audited = s.audits("enc_key.rejected");
    assert_eq!(audited.len(), 1, "once per reason");
    assert_eq!(audited[0].detail["reason"], why.as_str());
    let p = s
        .store
        .mailbox
        .with(|c| peers::by_name(c, "work"))
        .unwrap()
        .unwrap();
    assert_eq!(p.enc_pub, None);
    // A newer ad naming k2 is accepted, and the refusal record is cleared.
    let newer = EncAd::new("work", &s.peer.host_key.public(), &k2, T0 + 1);
    let answer = enc_answer(&s.peer, &newer, &s.peer.host_key, &k2);
    s.relay
        .on("GET /v2/relay/enc-key", move |_| (200, answer.clone()));
    s.clock.advance(10 * 60_000);
    let pass = s.client.push_due(&session("e1")).await.unwrap();
    assert_eq!(pass.accepted, 1);
    assert_eq!(
        s.store
            .mailbox
            .with(|c| relay_trust::enc_refusal(c, "work"))
            .unwrap(),
        None
    );
}
