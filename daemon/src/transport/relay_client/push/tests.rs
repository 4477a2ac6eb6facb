//! Tests of `push.rs` against the fake relay of `test_support`: each pushed row is settled by
//! its own verified accept, kept pending on anything less, and retried, backed off or ended by
//! rejections.

use std::sync::{Arc, Mutex};

use serde_json::{json, Value};

use agentmbx_protocol::clock::SharedClock;
use agentmbx_protocol::keys::{EncKey, HostKey};
use agentmbx_protocol::records::EncAd;
use agentmbx_protocol::time::iso_ms;
use agentmbx_protocol::wire::PullItem;
use agentmbx_protocol::{hash, records, seal};

use crate::identity::Identity;
use crate::mailbox::{outbox, peers, relay_state};
use crate::testutil::{self, T0};
use crate::transport::relay_client;
use crate::transport::relay_client::test_support::*;

mod enc_keys;
mod lan_handback;
mod receipts;

const ID3: &str = "01KDVDNA3VG2MH8KWSQRCWJZ0V";

#[tokio::test]
async fn rejected_target_not_enrolled_is_retried_with_backoff() {
    let s = Setup::new(true).await;
    let id = s.send_to_peer(ID1);
    s.relay.on(
        "POST /v2/relay/items",
        push_reject("rejected:target not enrolled"),
    );
    let pass = s.client.push_due(&session("e1")).await.unwrap();
    assert_eq!((pass.accepted, pass.failed), (0, 1));
    s.assert_pending_after_one_failure(&id, T0, "target not enrolled");
    let row = s.row(&id);
    // The wire bytes were persisted (and are what was pushed).
    let pushed = pushed_items(&s.relay.seen("POST /v2/relay/items")[0]);
    assert_eq!(row.wire.as_deref(), Some(&pushed[0].2[..]));
    assert_eq!(row.wire_hash, Some(hash::sha256_hex(&pushed[0].2)));
    assert_eq!(pushed[0].1, s.peer_pub(), "targets are keys, never names");
    s.relay.assert_hops_ok();

    // Second failure: attempts 2, next delay doubled.
    s.clock.set(row.next_at);
    s.client.push_due(&session("e1")).await.unwrap();
    let row2 = s.row(&id);
    assert_eq!((row2.state.as_str(), row2.attempts), ("pending", 2));
    assert_eq!(row2.next_at, row.next_at + outbox::backoff_ms(1));
}

#[tokio::test]
async fn rejected_conflict_is_terminal_and_the_row_is_kept() {
    let s = Setup::new(true).await;
    let id = s.send_to_peer(ID1);
    s.relay
        .on("POST /v2/relay/items", push_reject("rejected:conflict"));
    s.client.push_due(&session("e1")).await.unwrap();
    let row = s.row(&id);
    assert_eq!(row.state, "rejected");
    assert_eq!(row.attempts, 1);
    assert_eq!(row.last_error.as_deref(), Some("rejected:conflict"));
    assert!(row.wire.is_none(), "a final row drops its bytes");
    assert!(row.wire_hash.is_some(), "and keeps their hash");
    // A rejected row is not due any more: nothing is pushed again.
    s.clock.advance(10 * 3_600_000);
    s.client.push_due(&session("e1")).await.unwrap();
    assert_eq!(s.relay.seen("POST /v2/relay/items").len(), 1);
    assert_eq!(s.row(&id).state, "rejected");
}

#[tokio::test]
async fn other_rejections_are_retried_and_size_rejections_are_terminal() {
    for (status, terminal) in [
        ("rejected:sender not accepted by target", false),
        ("rejected:quota:target queue full", false),
        ("rejected:rate", false),
        ("rejected:bad wire", true),
        ("rejected:item over size limit", true),
        ("rejected:envelope body is not sealed", true),
        ("rejected:item id is not the envelope id", true),
        ("rejected:duplicate target", true),
        ("something unexpected", false),
    ] {
        let s = Setup::new(true).await;
        let id = s.send_to_peer(ID1);
        s.relay.on("POST /v2/relay/items", push_reject(status));
        s.client.push_due(&session("e1")).await.unwrap();
        let row = s.row(&id);
        let want = if terminal { "rejected" } else { "pending" };
        assert_eq!(row.state, want, "{status}");
        assert_eq!(row.attempts, 1, "{status}");
    }
}

#[tokio::test]
async fn a_missing_result_keeps_the_row_pending() {
    let s = Setup::new(true).await;
    let id = s.send_to_peer(ID1);
    s.relay
        .on("POST /v2/relay/items", |_| (200, json!({"results": []})));
    s.client.push_due(&session("e1")).await.unwrap();
    s.assert_pending_after_one_failure(&id, T0, "missing result");
}

#[tokio::test]
async fn a_result_for_another_item_id_is_a_missing_result() {
    let s = Setup::new(true).await;
    let id = s.send_to_peer(ID1);
    let me = s.me_pub();
    let mut inner = push_answer(s.relay.key.clone(), "e1", "accepted", move |a| {
        a.sender = me.clone()
    });
    s.relay.on("POST /v2/relay/items", move |req| {
        let (code, mut body) = inner(req);
        body["results"][0]["item_id"] = json!(ID2);
        (code, body)
    });
    s.client.push_due(&session("e1")).await.unwrap();
    s.assert_pending_after_one_failure(&id, T0, "missing result");
}

#[tokio::test]
async fn an_accept_signed_by_another_key_keeps_the_row_pending() {
    // The pinned relay key named, but signed by another key.
    let s = Setup::new(true).await;
    let id = s.send_to_peer(ID1);
    let me = s.me_pub();
    let other = HostKey::generate();
    s.relay.on(
        "POST /v2/relay/items",
        push_answer(s.relay.key.clone(), "e1", "accepted", move |a| {
            a.sender = me.clone();
            a.signer = other.clone();
        }),
    );
    s.client.push_due(&session("e1")).await.unwrap();
    s.assert_pending_after_one_failure(&id, T0, "not signed by the pinned relay key");

    // Another relay key named and signing consistently: still not ours.
    let s = Setup::new(true).await;
    let id = s.send_to_peer(ID1);
    let me = s.me_pub();
    let other = HostKey::generate();
    s.relay.on(
        "POST /v2/relay/items",
        push_answer(s.relay.key.clone(), "e1", "accepted", move |a| {
            a.sender = me.clone();
            a.relay_pubkey = other.public().to_b64();
            a.signer = other.clone();
        }),
    );
    s.client.push_due(&session("e1")).await.unwrap();
    s.assert_pending_after_one_failure(&id, T0, "not signed by the pinned relay key");

    // A valid accept with the signature missing.
    let s = Setup::new(true).await;
    let id = s.send_to_peer(ID1);
    let me = s.me_pub();
    let mut inner = push_answer(s.relay.key.clone(), "e1", "accepted", move |a| {
        a.sender = me.clone()
    });
    s.relay.on("POST /v2/relay/items", move |req| {
        let (code, mut body) = inner(req);
        body["results"][0]
            .as_object_mut()
            .unwrap()
            .remove("sig")
            .unwrap();
        (code, body)
    });
    s.client.push_due(&session("e1")).await.unwrap();
    s.assert_pending_after_one_failure(&id, T0, "not signed by the pinned relay key");
}

#[tokio::test]
async fn an_accept_naming_another_wire_hash_keeps_the_row_pending() {
    let s = Setup::new(true).await;
    let id = s.send_to_peer(ID1);
    let me = s.me_pub();
    s.relay.on(
        "POST /v2/relay/items",
        push_answer(s.relay.key.clone(), "e1", "accepted", move |a| {
            a.sender = me.clone();
            a.wire_hash = hash::sha256_hex(b"other bytes");
        }),
    );
    s.client.push_due(&session("e1")).await.unwrap();
    s.assert_pending_after_one_failure(&id, T0, "does not cover this target and wire hash");
}

#[tokio::test]
async fn an_accept_for_another_item_sender_or_target_keeps_the_row_pending() {
    type Tweak = Box<dyn Fn(&mut AcceptSpec, &str) + Send + Sync>;
    let cases: Vec<(Tweak, &str)> = vec![
        (
            Box::new(|a, me| {
                a.sender = me.into();
                a.item_id = ID2.into();
            }),
            "another sender or item",
        ),
        (
            Box::new(|a, _me| a.sender = HostKey::generate().public().to_b64()),
            "another sender or item",
        ),
        (
            Box::new(|a, me| {
                a.sender = me.into();
                a.target = HostKey::generate().public().to_b64();
            }),
            "does not cover this target",
        ),
        (
            Box::new(|a, me| {
                a.sender = me.into();
                a.seq = 0;
            }),
            "does not cover this target",
        ),
    ];
    for (tweak, why) in cases {
        let s = Setup::new(true).await;
        let id = s.send_to_peer(ID1);
        let me = s.me_pub();
        s.relay.on(
            "POST /v2/relay/items",
            push_answer(s.relay.key.clone(), "e1", "accepted", move |a| {
                tweak(a, &me)
            }),
        );
        s.client.push_due(&session("e1")).await.unwrap();
        s.assert_pending_after_one_failure(&id, T0, why);
    }
}

#[tokio::test]
async fn a_valid_duplicate_settles_the_row_with_the_original_seq() {
    let s = Setup::new(true).await;
    let id = s.send_to_peer(ID1);
    let me = s.me_pub();
    let original_at = T0 - 60_000;
    s.relay.on(
        "POST /v2/relay/items",
        push_answer(s.relay.key.clone(), "e7", "duplicate", move |a| {
            a.sender = me.clone();
            a.seq = 1_767_225_600_123;
            a.at = original_at;
        }),
    );
    s.clock.advance(1_000);
    let pass = s.client.push_due(&session("e7")).await.unwrap();
    assert_eq!((pass.accepted, pass.failed), (1, 0));
    let row = s.row(&id);
    assert_eq!(row.state, "relay-accepted");
    assert_eq!(row.seq, Some(1_767_225_600_123));
    assert_eq!(row.epoch.as_deref(), Some("e7"));
    assert_eq!(row.attempts, 0);
    assert_eq!(row.last_error, None);
    let (accept, sig, deadline) = s.stored_accept(&id);
    let accept: Value = serde_json::from_str(&accept.unwrap()).unwrap();
    assert_eq!(accept["type"], "relay-accept");
    assert_eq!(accept["item_id"], id.as_str());
    assert_eq!(accept["at"], iso_ms(original_at));
    assert!(sig.is_some_and(|s| !s.is_empty()));
    // Deadline = accept time + retention (14 d) + 24 h grace (spec §3).
    assert_eq!(
        deadline,
        Some(original_at + 14 * 86_400_000 + 24 * 3_600_000)
    );
    // Settled rows are not due any more.
    s.clock.advance(10 * 3_600_000);
    s.client.push_due(&session("e7")).await.unwrap();
    assert_eq!(s.relay.seen("POST /v2/relay/items").len(), 1);
}

#[tokio::test]
async fn a_network_failure_or_5xx_keeps_the_row_pending() {
    // The relay answers 500.
    let s = Setup::new(true).await;
    let id = s.send_to_peer(ID1);
    s.relay.on("POST /v2/relay/items", |_| {
        (500, json!({"error": "boom", "code": "INTERNAL"}))
    });
    s.client.push_due(&session("e1")).await.unwrap();
    s.assert_pending_after_one_failure(&id, T0, "500");

    // Nobody listens at the relay address any more (connection refused).
    let s = Setup::new(true).await;
    let id = s.send_to_peer(ID1);
    let dead = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        format!("http://{}", l.local_addr().unwrap())
    };
    let client = Setup::client_for(&dead, &s.relay.key, &s.me, &s.store, &s.clock);
    let pass = client.push_due(&session("e1")).await.unwrap();
    assert_eq!(pass.failed, 1);
    // The stored last_error (shown by `sent`) is in our words: no URL, no `os error`.
    s.assert_pending_after_one_failure(&id, T0, "relay unreachable: connection refused");
    assert!(
        s.row(&id).wire.is_some(),
        "sealed and kept before the attempt"
    );

    // A 200 whose body is not a push response.
    let s = Setup::new(true).await;
    let id = s.send_to_peer(ID1);
    s.relay
        .on("POST /v2/relay/items", |_| (200, json!({"stored": 1})));
    s.client.push_due(&session("e1")).await.unwrap();
    s.assert_pending_after_one_failure(&id, T0, "malformed relay answer");
}

#[tokio::test]
async fn wire_bytes_are_persisted_before_the_first_push_and_reused_byte_for_byte() {
    let s = Setup::new(true).await;
    let id = s.send_to_peer(ID1);
    assert_eq!(s.row(&id).wire, None, "sealing happens in the transport");
    // First attempt: the relay checks that the bytes are already committed in mailbox.db,
    // then loses the answer (500).
    let path = s.store.path.clone();
    let committed: Arc<Mutex<Vec<Option<Vec<u8>>>>> = Arc::default();
    let seen = committed.clone();
    let me = s.me_pub();
    let mut accept = push_answer(s.relay.key.clone(), "e1", "accepted", move |a| {
        a.sender = me.clone()
    });
    let mut calls = 0;
    s.relay.on("POST /v2/relay/items", move |req| {
        let c = rusqlite::Connection::open(&path).unwrap();
        let w: Option<Vec<u8>> = c
            .query_row("SELECT wire FROM outbox", [], |r| r.get(0))
            .unwrap();
        seen.lock().unwrap().push(w);
        calls += 1;
        if calls == 1 {
            (500, json!({"error": "lost", "code": "INTERNAL"}))
        } else {
            accept(req)
        }
    });
    s.client.push_due(&session("e1")).await.unwrap();
    let row = s.row(&id);
    assert_eq!(row.state, "pending");
    s.clock.set(row.next_at);
    let pass = s.client.push_due(&session("e1")).await.unwrap();
    assert_eq!(pass.accepted, 1);

    let pushes = s.relay.seen("POST /v2/relay/items");
    assert_eq!(pushes.len(), 2);
    let b64_of = |r: &Req| r.json()["items"][0]["targets"][0]["wire_b64"].clone();
    assert_eq!(
        b64_of(&pushes[0]),
        b64_of(&pushes[1]),
        "same bytes on retry"
    );
    let first = pushed_items(&pushes[0]).remove(0).2;
    let committed = committed.lock().unwrap().clone();
    assert_eq!(committed, vec![Some(first.clone()), Some(first.clone())]);
    let row = s.row(&id);
    assert_eq!(row.state, "relay-accepted");
    assert_eq!(row.wire.as_deref(), Some(&first[..]));
    assert_eq!(row.wire_hash, Some(hash::sha256_hex(&first)));
    // The bytes are sealed for the target and signed by this host: never plaintext.
    let env: Value = serde_json::from_slice(&first).unwrap();
    assert!(env["enc"].is_object());
    assert!(!String::from_utf8_lossy(&first).contains("body of hello"));
    let enc: seal::Enc = serde_json::from_value(env["enc"].clone()).unwrap();
    assert_eq!(
        seal::open(&enc, &s.peer.enc_key, &id).unwrap(),
        "body of hello"
    );
    assert!(agentmbx_protocol::envelope::verify(
        &env,
        &s.me.host_key.public()
    ));
    s.relay.assert_hops_ok();
}

#[tokio::test]
async fn next_at_is_respected() {
    let s = Setup::new(true).await;
    let id = s.send_to_peer(ID1);
    s.relay.on("POST /v2/relay/items", |_| {
        (503, json!({"error": "busy", "code": "BUSY"}))
    });
    s.client.push_due(&session("e1")).await.unwrap();
    let next_at = s.row(&id).next_at;
    assert_eq!(next_at, T0 + outbox::backoff_ms(0));

    // Before next_at: the row is not due, nothing is pushed, nothing changes.
    s.clock.set(next_at - 1);
    let due = s
        .store
        .mailbox
        .with(|c| outbox::due(c, next_at - 1, 10))
        .unwrap();
    assert!(due.is_empty());
    let pass = s.client.push_due(&session("e1")).await.unwrap();
    assert_eq!((pass.accepted, pass.failed), (0, 0));
    assert_eq!(s.relay.seen("POST /v2/relay/items").len(), 1);
    assert_eq!(s.row(&id).attempts, 1);
    assert_eq!(
        s.store
            .mailbox
            .with(|c| outbox::next_due_at(c, next_at - 1))
            .unwrap(),
        Some(next_at)
    );

    // At next_at it is pushed again.
    s.clock.set(next_at);
    s.accept_all("e1", "accepted");
    let pass = s.client.push_due(&session("e1")).await.unwrap();
    assert_eq!(pass.accepted, 1);
    assert_eq!(s.relay.seen("POST /v2/relay/items").len(), 2);
    assert_eq!(s.row(&id).state, "relay-accepted");
    assert_eq!(
        s.store
            .mailbox
            .with(|c| outbox::next_due_at(c, next_at))
            .unwrap(),
        None
    );
}

/// Case `clock-fix-does-not-release-mail` over the relay: with the clock 10 min ahead a row
/// failed once and another was queued after it; once the clock is right again both are due at
/// once (pushed by the next pass, and the loop's wake-up is now), instead of waiting out the
/// skew. A row that fails at the right clock still waits its backoff.
#[tokio::test]
async fn rows_scheduled_under_a_clock_ahead_are_due_once_it_is_right() {
    const SKEW: i64 = 600_000;
    let s = Setup::new(true).await;
    s.clock.set(T0 + SKEW);
    let failed = s.send_to_peer(ID1);
    s.relay.on("POST /v2/relay/items", |_| {
        (503, json!({"error": "busy", "code": "BUSY"}))
    });
    s.client.push_due(&session("e1")).await.unwrap();
    assert_eq!(s.row(&failed).next_at, T0 + SKEW + outbox::backoff_ms(0));
    let queued = s.send_to_peer(ID2);
    assert_eq!(s.row(&queued).next_at, T0 + SKEW);

    // The clock is right again.
    s.clock.set(T0);
    let next_due = |now: i64| {
        s.store
            .mailbox
            .with(|c| outbox::next_due_for_relay(c, now))
            .unwrap()
    };
    assert_eq!(next_due(T0), Some(T0), "the loop wakes now");
    s.accept_all("e1", "accepted");
    let pass = s.client.push_due(&session("e1")).await.unwrap();
    assert_eq!(pass.accepted, 2);
    for id in [&failed, &queued] {
        assert_eq!(s.row(id).state, "relay-accepted", "{id}");
    }

    // A failure at the right clock keeps its backoff.
    let later = s.send_to_peer(ID3);
    s.relay.on("POST /v2/relay/items", |_| {
        (503, json!({"error": "busy", "code": "BUSY"}))
    });
    s.client.push_due(&session("e1")).await.unwrap();
    assert_eq!(s.row(&later).next_at, T0 + outbox::backoff_ms(0));
    assert_eq!(next_due(T0), Some(T0 + outbox::backoff_ms(0)));
    let pass = s.client.push_due(&session("e1")).await.unwrap();
    assert_eq!((pass.accepted, pass.failed), (0, 0));
}

/// A wait on the clock (after a 429) started while the clock was 10 min ahead ends once the
/// clock is set right, instead of lasting the skew on top of the wait.
#[tokio::test]
async fn a_wait_on_the_clock_ends_when_the_clock_is_set_back() {
    let clock = testutil::clock();
    clock.set(T0 + 600_000);
    let shared: SharedClock = clock.clone();
    let (_stop, mut stopped) = tokio::sync::watch::channel(false);
    let wait = tokio::spawn(async move {
        relay_client::wait_until_clock(&shared, T0 + 600_000 + 60_000, &mut stopped).await
    });
    // The wait has started (this test's runtime is single-threaded: the sleep lets it run).
    tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    assert!(!wait.is_finished());
    clock.set(T0);
    let done = tokio::time::timeout(std::time::Duration::from_secs(10), wait)
        .await
        .expect("the wait ends once the clock is set back")
        .unwrap();
    assert!(done);
}

#[tokio::test]
async fn a_batch_settles_each_row_on_its_own_result() {
    let s = Setup::new(true).await;
    let a = s.send_to_peer(ID1);
    let b = s.send_to_peer(ID2);
    let me = s.me_pub();
    let mut inner = push_answer(s.relay.key.clone(), "e1", "accepted", move |x| {
        x.sender = me.clone()
    });
    s.relay.on("POST /v2/relay/items", move |req| {
        let (code, mut body) = inner(req);
        // The second item is refused.
        body["results"][1] =
            json!({"item_id": ID2, "status": "rejected:quota:items", "targets": []});
        (code, body)
    });
    let pass = s.client.push_due(&session("e1")).await.unwrap();
    assert_eq!((pass.accepted, pass.failed), (1, 1));
    assert_eq!(s.row(&a).state, "relay-accepted");
    assert_eq!(s.row(&b).state, "pending");
    assert_eq!(s.relay.seen("POST /v2/relay/items").len(), 1, "one batch");
}

// ---- alerts and epoch changes --------------------------------------------------------------------

#[tokio::test]
async fn a_terminal_rejection_alerts_the_sending_agent() {
    let s = Setup::new(true).await;
    let id = s.send_to_peer(ID1);
    s.relay
        .on("POST /v2/relay/items", push_reject("rejected:conflict"));
    s.client.push_due(&session("e1")).await.unwrap();
    assert_eq!(s.row(&id).state, "rejected");
    let page = s
        .store
        .mailbox
        .with(|c| crate::mailbox::messages::inbox(c, "alice", None, 50, &Default::default()))
        .unwrap();
    assert_eq!(page.messages.len(), 1, "one alert for alice");
    let alert = &page.messages[0];
    assert_eq!(alert.subject, "Undelivered to work: hello");
    assert_eq!(
        (alert.kind.as_str(), alert.from.as_str()),
        ("alert", "agentmbx@home")
    );
    // A retryable rejection alerts nobody.
    let s = Setup::new(true).await;
    s.send_to_peer(ID1);
    s.relay.on(
        "POST /v2/relay/items",
        push_reject("rejected:target not enrolled"),
    );
    s.client.push_due(&session("e1")).await.unwrap();
    let page = s
        .store
        .mailbox
        .with(|c| crate::mailbox::messages::inbox(c, "alice", None, 50, &Default::default()))
        .unwrap();
    assert!(page.messages.is_empty());
}

#[tokio::test]
async fn one_message_to_two_hosts_settles_each_row_by_its_own_result() {
    let s = Setup::new(true).await;
    let lab = testutil::identity("lab");
    s.store.add_peer(&lab, true);
    let out = s
        .store
        .send(
            &s.me,
            "alice",
            &["bob@work", "carol@lab"],
            "hello",
            ID1,
            s.clock_now(),
        )
        .unwrap();
    assert_eq!(out.queued_for_hosts.len(), 2);
    let key = s.relay.key.clone();
    let me = s.me_pub();
    // Both items carry the same id: the first is refused for good, the second accepted.
    s.relay.on("POST /v2/relay/items", move |req: &Req| {
        let items = pushed_items(req);
        assert_eq!(items.len(), 2);
        let (id0, _, _) = &items[0];
        let (id1, target1, wire1) = &items[1];
        let spec = AcceptSpec {
            signer: key.clone(),
            relay_pubkey: key.public().to_b64(),
            epoch: "e1".into(),
            sender: me.clone(),
            item_id: id1.clone(),
            target: target1.clone(),
            wire_hash: hash::sha256_hex(wire1),
            seq: 77,
            at: T0,
        };
        let (accept, sig) = spec.signed();
        (200, json!({"results": [
            {"item_id": id0, "status": "rejected:conflict", "targets": []},
            {"item_id": id1, "status": "accepted", "targets": [{"host_pubkey": target1, "seq": 77}], "accept": accept, "sig": sig},
        ]}))
    });
    s.client.push_due(&session("e1")).await.unwrap();
    let pushed = pushed_items(&s.relay.seen("POST /v2/relay/items")[0]);
    let second_host = if pushed[1].1 == s.peer_pub() {
        "work"
    } else {
        "lab"
    };
    let first_host = if second_host == "work" { "lab" } else { "work" };
    let accepted = s
        .store
        .mailbox
        .with(|c| outbox::get(c, ID1, second_host))
        .unwrap()
        .unwrap();
    let refused = s
        .store
        .mailbox
        .with(|c| outbox::get(c, ID1, first_host))
        .unwrap()
        .unwrap();
    assert_eq!(
        (accepted.state.as_str(), accepted.seq),
        ("relay-accepted", Some(77))
    );
    assert_eq!(refused.state, "rejected");
}

#[tokio::test]
async fn rejected_rate_keeps_the_row_queued_and_backs_it_off() {
    let s = Setup::new(true).await;
    let id = s.send_to_peer(ID1);
    s.relay
        .on("POST /v2/relay/items", push_reject("rejected:rate"));
    let pass = s.client.push_due(&session("e1")).await.unwrap();
    assert_eq!((pass.accepted, pass.failed), (0, 1));
    s.assert_pending_after_one_failure(&id, T0, "rejected:rate");
    // Not pushed again before its backoff ends; pushed again after.
    s.clock.advance(outbox::backoff_ms(0) - 1);
    s.client.push_due(&session("e1")).await.unwrap();
    assert_eq!(s.relay.seen("POST /v2/relay/items").len(), 1);
    s.clock.advance(1);
    s.accept_all("e1", "accepted");
    s.client.push_due(&session("e1")).await.unwrap();
    assert_eq!(s.relay.seen("POST /v2/relay/items").len(), 2);
    assert_eq!(s.row(&id).state, "relay-accepted");
}

#[tokio::test]
async fn a_429_on_push_or_enc_key_lookup_ends_the_pass_and_charges_no_row() {
    // On the push itself: the row keeps its attempts, error and due time.
    let s = Setup::new(true).await;
    let id = s.send_to_peer(ID1);
    let before = s.row(&id);
    s.relay.on("POST /v2/relay/items", |_| too_many(30));
    assert_rate_limited(s.client.push_due(&session("e1")).await, 30_000);
    let after = s.row(&id);
    assert_eq!(
        (
            after.state.as_str(),
            after.attempts,
            after.next_at,
            after.last_error.as_deref()
        ),
        (
            before.state.as_str(),
            0,
            before.next_at,
            before.last_error.as_deref()
        )
    );
    assert_eq!(s.relay.seen("POST /v2/relay/items").len(), 1);
    // Still due: the next pass pushes it (the same sealed bytes).
    s.accept_all("e1", "accepted");
    s.client.push_due(&session("e1")).await.unwrap();
    assert_eq!(s.row(&id).state, "relay-accepted");

    // On the enc-key lookup: nothing is sealed, pushed or charged.
    let s = Setup::new(false).await;
    let id = s.send_to_peer(ID1);
    s.relay.on("GET /v2/relay/enc-key", |_| too_many(7));
    assert_rate_limited(s.client.push_due(&session("e1")).await, 7_000);
    let row = s.row(&id);
    assert_eq!((row.attempts, row.wire, row.last_error), (0, None, None));
    assert!(s.relay.seen("POST /v2/relay/items").is_empty());
}
