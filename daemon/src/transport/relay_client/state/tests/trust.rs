//! Relay key changes against the fake relay of `test_support`: all relay use stops until the
//! owner confirms, only the expected key is pinned, and a recorded change stays when the pinned
//! key is served again.

use std::sync::Arc;

use agentmbx_protocol::clock::SharedClock;
use agentmbx_protocol::keys::HostKey;
use agentmbx_protocol::time::iso_ms;

use crate::mailbox::relay_state;
use crate::testutil::T0;
use crate::transport::relay_client;
use crate::transport::relay_client::state::{self as relay_trust, Standing};
use crate::transport::relay_client::test_support::*;
use crate::transport::relay_client::RelayError;

#[tokio::test]
async fn a_relay_key_change_stops_all_relay_use_until_the_owner_confirms_the_new_key() {
    let s = Setup::new(true).await;
    let t = s.trusty();
    let wake = Arc::new(tokio::sync::Notify::new());
    let (stop, stopped) = tokio::sync::watch::channel(false);
    let task = tokio::spawn(relay_client::run(
        s.client.clone(),
        std::time::Duration::from_millis(50),
        wake.clone(),
        stopped,
    ));
    wait_for("a first session", || {
        s.relay_state().is_some_and(|st| st.state == Standing::Ok)
    })
    .await;
    // The relay now presents another key (a different relay behind the same URL).
    let new = HostKey::generate();
    *t.served.lock().unwrap() = new.clone();
    wait_for("the key mismatch", || {
        s.relay_state()
            .is_some_and(|st| st.state == Standing::KeyMismatch)
    })
    .await;
    // (The pass that was under way when the key changed has ended with the mismatch.)
    let seen_before = s.routes().len();
    // Mail waits: a send wakes the loop, but nothing is pushed, pulled or enrolled.
    let id = s.send_to_peer(ID1);
    wake.notify_one();
    wait_for("three more passes", || {
        s.routes()[seen_before..]
            .iter()
            .filter(|r| *r == "GET /v2/relay/info")
            .count()
            >= 3
    })
    .await;
    let after: Vec<String> = s.routes()[seen_before..].to_vec();
    assert!(
        after.iter().all(|r| r == "GET /v2/relay/info"),
        "only info while the key is wrong: {after:?}"
    );
    assert_eq!(s.row(&id).state, "pending");
    assert_eq!(s.row(&id).attempts, 0, "the row is not charged");
    // Audited once for this served key, not every pass; the state names both keys and the fix.
    let changed = s.audits("relay.key_changed");
    assert_eq!(changed.len(), 1, "{changed:?}");
    assert_eq!(changed[0].detail["served"], new.public().fingerprint());
    assert_eq!(
        changed[0].detail["pinned"],
        s.relay.key.public().fingerprint()
    );
    let st = s.relay_state().unwrap();
    assert_eq!(st.relay_fp, Some(new.public().fingerprint()));
    assert_eq!(st.pinned_fp, Some(s.relay.key.public().fingerprint()));
    assert_eq!(
        st.fix(&s.url()).unwrap(),
        format!(
            "agentmbx relay set {} --key {}",
            s.url(),
            new.public().fingerprint()
        )
    );
    // The owner confirms (what `relay set <url> --key <new>` writes): use resumes without a
    // restart, with a new enrolment for the new relay key, and accepts signed by it count.
    let (url, newpub) = (s.url(), new.public());
    s.store
        .mailbox
        .with(|c| relay_trust::confirm_key(c, &url, Some(&newpub), None, T0))
        .unwrap();
    assert_eq!(s.audits("relay.key_confirmed").len(), 1);
    wake.notify_one();
    wait_for("the push through the confirmed relay", || {
        s.row(&id).state == "relay-accepted"
    })
    .await;
    assert_eq!(
        s.relay.seen("POST /v1/relay/enrol").len(),
        1,
        "enrolled with the new key"
    );
    let enrolled = s.audits("relay.enrolled");
    assert_eq!(enrolled[0].detail["relay_key"], newpub.fingerprint());
    assert_eq!(enrolled[0].detail["why"], "the relay key changed");
    assert_eq!(s.audits("relay.key_changed").len(), 1);
    wait_for("state ok", || {
        s.relay_state().is_some_and(|st| st.state == Standing::Ok)
    })
    .await;
    s.relay.assert_hops_ok_except_plain();
    stop.send(true).unwrap();
    tokio::time::timeout(std::time::Duration::from_secs(10), task)
        .await
        .expect("the loop stops")
        .unwrap();
}

#[tokio::test]
async fn the_expected_key_is_the_only_one_pinned_on_first_contact() {
    let s = Setup::new(true).await;
    let _t = s.trusty();
    let url = s.url();
    let clock: SharedClock = s.clock.clone();
    // `relay set --key <fp>` while the relay was unreachable named another key.
    let other = HostKey::generate().public().fingerprint();
    let o = other.clone();
    s.store
        .mailbox
        .with(|c| relay_trust::confirm_key(c, &url, None, Some(&o), T0))
        .unwrap();
    for _ in 0..2 {
        let err = relay_client::pin::resolve_key(&url, None, &s.store.mailbox, &clock)
            .await
            .unwrap_err();
        assert!(matches!(err, RelayError::KeyMismatch { .. }), "{err}");
    }
    let st = s.relay_state().unwrap();
    assert_eq!(
        (st.state, st.pinned_fp.as_deref()),
        (Standing::KeyMismatch, Some(other.as_str()))
    );
    let changed = s.audits("relay.key_changed");
    assert_eq!(changed.len(), 1);
    assert_eq!(changed[0].detail["expected"], other);
    // The expectation names the served key: pinned, expectation gone.
    let fp = s.relay.key.public().fingerprint();
    s.store
        .mailbox
        .with(|c| relay_trust::confirm_key(c, &url, None, Some(&fp), T0))
        .unwrap();
    assert_eq!(
        s.relay_state(),
        None,
        "the confirmation clears the mismatch"
    );
    let key = relay_client::pin::resolve_key(&url, None, &s.store.mailbox, &clock)
        .await
        .unwrap();
    assert_eq!(key, s.relay.key.public());
    let (k, e) = s
        .store
        .mailbox
        .with(|c| {
            Ok((
                relay_state::kv_get(c, &relay_trust::key_kv(&url))?,
                relay_state::kv_get(c, &relay_trust::expect_kv(&url))?,
            ))
        })
        .unwrap();
    assert_eq!((k, e), (Some(s.relay.key.public().to_b64()), None));
}

#[tokio::test]
async fn a_key_change_stays_recorded_after_the_relay_serves_the_pinned_key_again() {
    let s = Setup::new(true).await;
    let t = s.trusty();
    let wake = Arc::new(tokio::sync::Notify::new());
    let (stop, stopped) = tokio::sync::watch::channel(false);
    let task = tokio::spawn(relay_client::run(
        s.client.clone(),
        std::time::Duration::from_millis(50),
        wake.clone(),
        stopped,
    ));
    wait_for("a first session", || {
        s.relay_state().is_some_and(|st| st.state == Standing::Ok)
    })
    .await;
    let url = s.url();
    let change = |s: &Setup| {
        s.store
            .mailbox
            .with(|c| relay_trust::key_change(c, &url))
            .unwrap()
    };
    assert_eq!(change(&s), None);
    // Another key for a while, then the pinned one again.
    let other = HostKey::generate();
    *t.served.lock().unwrap() = other.clone();
    wait_for("the key mismatch", || {
        s.relay_state()
            .is_some_and(|st| st.state == Standing::KeyMismatch)
    })
    .await;
    *t.served.lock().unwrap() = s.relay.key.clone();
    wake.notify_one();
    wait_for("use resumed with the pinned key", || {
        s.relay_state().is_some_and(|st| st.state == Standing::Ok)
    })
    .await;
    let id = s.send_to_peer(ID1);
    wake.notify_one();
    wait_for("the push through the pinned key", || {
        s.row(&id).state == "relay-accepted"
    })
    .await;
    // The change is still on record: which key, since when; audited once.
    let c = change(&s).expect("the key change is kept");
    assert_eq!(
        (c.how.as_str(), c.pinned.as_str(), c.served.as_str()),
        (
            "pinned",
            s.relay.key.public().fingerprint().as_str(),
            other.public().fingerprint().as_str()
        )
    );
    assert_eq!(c.at, iso_ms(T0));
    assert_eq!(s.audits("relay.key_changed").len(), 1);
    // The other key again: the same change, not audited twice.
    *t.served.lock().unwrap() = other.clone();
    wake.notify_one();
    wait_for("the key mismatch again", || {
        s.relay_state()
            .is_some_and(|st| st.state == Standing::KeyMismatch)
    })
    .await;
    assert_eq!(s.audits("relay.key_changed").len(), 1);
    assert_eq!(change(&s), Some(c));
    *t.served.lock().unwrap() = s.relay.key.clone();
    wake.notify_one();
    wait_for("use resumed again", || {
        s.relay_state().is_some_and(|st| st.state == Standing::Ok)
    })
    .await;
    // The owner keeps the pinned key: the record goes, the decision is audited.
    let pinned = s.relay.key.public();
    let done = s
        .store
        .mailbox
        .with(|c| relay_trust::confirm_key(c, &url, Some(&pinned), None, T0))
        .unwrap();
    assert!(done.changed);
    assert_eq!(change(&s), None);
    let confirmed = s.audits("relay.key_confirmed");
    assert_eq!(confirmed.len(), 1);
    assert_eq!(confirmed[0].detail["kept"], true);
    assert_eq!(confirmed[0].detail["served"], other.public().fingerprint());
    assert_eq!(confirmed[0].detail["to"], pinned.fingerprint());
    stop.send(true).unwrap();
    tokio::time::timeout(std::time::Duration::from_secs(10), task)
        .await
        .expect("the loop stops")
        .unwrap();
}
