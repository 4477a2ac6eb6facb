//! Publishing the sender allowlist against the fake relay of `test_support`.

use std::sync::{Arc, Mutex};

use serde_json::{json, Value};

use agentmbx_protocol::time::iso_ms;

use crate::mailbox::peers;
use crate::testutil::{self, T0};
use crate::transport::relay_client;
use crate::transport::relay_client::state::Standing;
use crate::transport::relay_client::test_support::*;

#[tokio::test]
async fn the_allowlist_is_published_signed_and_republished_when_peers_change() {
    let s = Setup::new(true).await;
    let t = s.trusty();
    s.client.open_session().await.unwrap();
    let check = |n: usize, expect: &[String]| {
        let lists = t.lists.lock().unwrap();
        assert_eq!(lists.len(), n, "{lists:?}");
        let body = lists.last().unwrap();
        let list = &body["list"];
        assert_eq!(list["type"], "relay-senders");
        assert_eq!(list["v"], 1);
        assert_eq!(list["host_pubkey"], s.me_pub());
        assert_eq!(list["senders"], json!(expect));
        let signed = agentmbx_protocol::canonical::to_string(list).unwrap();
        assert!(s
            .me
            .host_key
            .public()
            .verify(signed.as_bytes(), body["sig"].as_str().unwrap()));
        list["iat"].as_str().unwrap().to_string()
    };
    let iat1 = check(1, &[s.peer_pub()]);
    assert_eq!(iat1, iso_ms(T0));
    // Unchanged peers: not published again.
    s.client.open_session().await.unwrap();
    assert_eq!(t.lists.lock().unwrap().len(), 1);
    // A new peer (pairing): republished, sorted, with a later iat.
    let third = testutil::identity("third");
    s.store.add_peer(&third, false);
    s.clock.advance(1_000);
    s.client.open_session().await.unwrap();
    let mut both = vec![s.peer_pub(), third.host_key.public().to_b64()];
    both.sort();
    let iat2 = check(2, &both);
    assert!(iat2 > iat1);
    // Unpairing: republished without it.
    s.store
        .mailbox
        .with(|c| peers::remove(c, "work").map(|_| ()))
        .unwrap();
    s.client.open_session().await.unwrap();
    check(3, &[third.host_key.public().to_b64()]);
    s.relay.assert_hops_ok_except_plain();
}

#[tokio::test]
async fn a_stale_allowlist_is_signed_again_once_and_a_refusal_waits() {
    let s = Setup::new(true).await;
    let _t = s.trusty();
    let bodies = Arc::new(Mutex::new(Vec::<Value>::new()));
    let b = bodies.clone();
    let mut answers = vec![
        (409, "STALE"),
        (409, "STALE"),
        (404, "NOT_FOUND"),
        (401, "BAD_SIGNATURE"),
    ]
    .into_iter();
    s.relay.on("POST /v2/relay/senders", move |req| {
        b.lock().unwrap().push(req.json());
        match answers.next() {
            Some((status, code)) => (status, json!({"error": "refused", "code": code})),
            None => (200, json!({"ok": true})),
        }
    });
    let iat = |n: usize| {
        agentmbx_protocol::time::parse_iso_ms(
            bodies.lock().unwrap()[n]["list"]["iat"].as_str().unwrap(),
        )
        .unwrap()
    };
    // 409 STALE: signed again once with iat = now + 4 min; refused again → waits a minute.
    s.client.open_session().await.unwrap();
    assert_eq!(bodies.lock().unwrap().len(), 2);
    assert_eq!(
        (iat(0), iat(1)),
        (T0, T0 + relay_client::allowlist::STALE_BUMP_MS)
    );
    assert_eq!(s.audits("relay.senders_failed").len(), 1);
    s.client.open_session().await.unwrap();
    assert_eq!(bodies.lock().unwrap().len(), 2, "no retry inside the pause");
    // After the pause: tried again (404: the relay has no allowlist endpoint), audited once.
    s.clock
        .advance(relay_client::allowlist::RETRY_AFTER_FAILURE_MS);
    s.client.open_session().await.unwrap();
    assert_eq!(bodies.lock().unwrap().len(), 3);
    assert_eq!(s.audits("relay.senders_failed").len(), 1);
    // A 401 about the list's signature is the list's failure, not a lost enrolment.
    s.clock
        .advance(relay_client::allowlist::RETRY_AFTER_FAILURE_MS);
    s.client.open_session().await.unwrap();
    assert_eq!(bodies.lock().unwrap().len(), 4);
    assert!(s.relay.seen("POST /v1/relay/enrol").is_empty());
    // Then it is taken, and recorded: nothing more.
    s.clock
        .advance(relay_client::allowlist::RETRY_AFTER_FAILURE_MS);
    s.client.open_session().await.unwrap();
    s.client.open_session().await.unwrap();
    assert_eq!(bodies.lock().unwrap().len(), 5);
    assert_eq!(s.relay_state().unwrap().state, Standing::Ok);
}
