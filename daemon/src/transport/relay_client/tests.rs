//! Tests of the relay loop in `mod.rs` against the fake relay of `test_support`: rate limits
//! end a pass and make the loop wait; the child modules cover account tokens, epochs and expiry
//! against the real relay, pins and page caps, and TLS mismatches.

use std::sync::{Arc, Mutex};

use serde_json::{json, Value};

use agentmbx_protocol::b64;
use agentmbx_protocol::clock::{ManualClock, SharedClock};
use agentmbx_protocol::keys::HostKey;
use agentmbx_protocol::time::iso_ms;
use agentmbx_protocol::wire::PullItem;

use crate::identity::Identity;
use crate::mailbox::{outbox, peers, relay_state};
use crate::testutil::{self, Store, T0};
use crate::transport::relay_client::state::{self as relay_trust, Standing};
use crate::transport::relay_client::test_support::*;
use crate::transport::relay_client::{RelayClient, RelayError};

mod account_tokens;
mod epochs_and_expiry;
mod pins_and_caps;
mod tls_mismatch;

// ---- rate limits (wire.md "Rate limits": clients back off by the value given) ------------------

#[test]
fn a_429_waits_the_retry_after_header_else_the_body_else_a_minute() {
    let ms = |header: Option<&str>, body: &str| match super::rate_limited(header, body.as_bytes()) {
        RelayError::RateLimited { retry_after_ms } => retry_after_ms,
        other => panic!("{other}"),
    };
    let body = r#"{"error":"rate_limit_exceeded","code":"RATE_LIMIT","retry_after":12}"#;
    assert_eq!(ms(Some("7"), body), 7_000, "the header wins");
    assert_eq!(ms(None, body), 12_000);
    assert_eq!(ms(Some("Wed, 21 Oct 2026 07:28:00 GMT"), body), 12_000);
    assert_eq!(ms(None, "not json"), super::DEFAULT_RATE_LIMIT_WAIT_MS);
    // Kept within 1 s ..= 1 h.
    assert_eq!(ms(Some("0"), body), 1_000);
    assert_eq!(ms(Some("999999999"), body), super::MAX_RATE_LIMIT_WAIT_MS);
    // Every error answer path turns a 429 into the same typed error.
    assert!(matches!(
        super::status_error(429, body.as_bytes()),
        RelayError::RateLimited {
            retry_after_ms: 12_000
        }
    ));
}

#[tokio::test]
async fn a_429_makes_the_loop_wait_the_given_time_before_its_next_pass() {
    let s = Setup::new(true).await;
    let me = s.me_pub();
    let enc = s.me.enc_key.public().to_b64();
    let key = s.relay.key.clone();
    let mut infos = 0;
    s.relay.on("GET /v2/relay/info", move |_| {
        infos += 1;
        if infos == 1 {
            return (
                429,
                json!({"error": "rate_limit_exceeded", "code": "RATE_LIMIT", "retry_after": 30}),
            );
        }
        let you = json!({"host": "home", "pubkey": me, "head_seq": 0, "acked_through": 0,
                         "enc_ad": {"enc_pub": enc, "exp": iso_ms(T0 + 30 * 86_400_000), "v1": false}});
        (200, info(&key, "e1", Some(you)))
    });
    s.accept_all("e1", "accepted");
    serve_queue(
        &s.relay,
        Arc::new(Mutex::new(Queue {
            epoch: "e1".into(),
            items: vec![],
            head_override: None,
        })),
    );
    let wake = Arc::new(tokio::sync::Notify::new());
    let (stop, stopped) = tokio::sync::watch::channel(false);
    let task = tokio::spawn(super::run(
        s.client.clone(),
        std::time::Duration::from_millis(50),
        wake.clone(),
        stopped,
    ));
    let infos_seen = || s.relay.seen("GET /v2/relay/info").len();
    wait_for("the refused info", || infos_seen() == 1).await;
    // A send wakes the loop, and the relay clock runs to just before the 30 s: no new pass
    // (the pull interval is 50 ms, so a loop that did not wait would have asked many times).
    let id = s.send_to_peer(ID1);
    wake.notify_one();
    // First with the clock where the 429 found it, so the loop reads it for its wait before the
    // clock moves (the test yields every 20 ms in this window).
    let first = tokio::time::timeout(std::time::Duration::from_millis(2_500), async {
        while infos_seen() == 1 {
            tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        }
    })
    .await;
    assert!(first.is_err(), "a pass ran at once after the 429");
    s.clock.advance(29_999);
    let early = tokio::time::timeout(std::time::Duration::from_millis(2_500), async {
        while infos_seen() == 1 {
            tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        }
    })
    .await;
    assert!(early.is_err(), "a pass ran before retry_after had passed");
    assert!(s.relay.seen("POST /v2/relay/items").is_empty());
    // Once it has passed, the next pass runs and the row is pushed.
    s.clock.advance(1);
    wait_for("the pass after the wait", || infos_seen() >= 2).await;
    wait_for("the relay accept", || s.row(&id).state == "relay-accepted").await;
    stop.send(true).unwrap();
    tokio::time::timeout(std::time::Duration::from_secs(10), task)
        .await
        .expect("the loop stops on shutdown")
        .unwrap();
}

#[tokio::test]
async fn a_429_on_receipts_pull_or_ack_ends_the_pass_and_charges_nothing() {
    // Receipts keep their attempts.
    let s = Setup::new(true).await;
    s.receive_and_read(ID1);
    let before = s.receipt_rows();
    s.relay.on("POST /v2/relay/items", |_| too_many(12));
    assert_rate_limited(s.client.push_receipts(&session("e1")).await, 12_000);
    assert_eq!(s.receipt_rows(), before);
    assert!(before.iter().all(|r| r.2 == 0), "{before:?}");

    // A 429 on the pull.
    let s = Setup::new(true).await;
    s.relay.on("GET /v2/relay/items", |_| too_many(5));
    assert_rate_limited(s.client.pull_pass(&session("e1")).await, 5_000);
    assert_eq!(s.messages(), 0);

    // A 429 on the ack: the checkpoint already written stays, the pass ends.
    let s = Setup::new(true).await;
    let mut g = testutil::ids();
    let peer = s.peer_pub();
    let id = g.next(T0);
    let q = Arc::new(Mutex::new(Queue {
        epoch: "e1".into(),
        items: vec![item(10, &id, &peer, &s.peer_wire(&id, "m"))],
        head_override: None,
    }));
    serve_queue(&s.relay, q);
    s.relay.on("POST /v2/relay/ack", |_| too_many(9));
    assert_rate_limited(s.client.pull_pass(&session("e1")).await, 9_000);
    let pos = s.position();
    assert_eq!((pos.received_through, pos.acked_through), (10, 0));
    assert_eq!(s.messages(), 1);
    assert_eq!(s.relay.seen("GET /v2/relay/items").len(), 1);
}

#[tokio::test]
async fn a_429_on_push_makes_the_loop_wait_the_given_time_before_its_next_pass() {
    let s = Setup::new(true).await;
    let me = s.me_pub();
    let enc = s.me.enc_key.public().to_b64();
    let key = s.relay.key.clone();
    s.relay.on("GET /v2/relay/info", move |_| {
        let you = json!({"host": "home", "pubkey": me, "head_seq": 0, "acked_through": 0,
                         "enc_ad": {"enc_pub": enc, "exp": iso_ms(T0 + 30 * 86_400_000), "v1": false}});
        (200, info(&key, "e1", Some(you)))
    });
    serve_queue(
        &s.relay,
        Arc::new(Mutex::new(Queue {
            epoch: "e1".into(),
            items: vec![],
            head_override: None,
        })),
    );
    // The first push is answered 429 (30 s); later ones are accepted.
    let me = s.me_pub();
    let mut accept = push_answer(s.relay.key.clone(), "e1", "accepted", move |a| {
        a.sender = me.clone()
    });
    let mut pushes = 0;
    s.relay.on("POST /v2/relay/items", move |req| {
        pushes += 1;
        if pushes == 1 {
            return too_many(30);
        }
        accept(req)
    });
    let id = s.send_to_peer(ID1);
    let wake = Arc::new(tokio::sync::Notify::new());
    let (stop, stopped) = tokio::sync::watch::channel(false);
    let task = tokio::spawn(super::run(
        s.client.clone(),
        std::time::Duration::from_millis(50),
        wake.clone(),
        stopped,
    ));
    let pushes_seen = || s.relay.seen("POST /v2/relay/items").len();
    wait_for("the refused push", || pushes_seen() == 1).await;
    let infos = s.relay.seen("GET /v2/relay/info").len();
    // No pass runs before the 30 s have passed on the clock, whatever wakes the loop (the pull
    // interval is 50 ms, so a loop that did not wait would have passed many times).
    wake.notify_one();
    // First with the clock where the 429 found it: the loop reads the clock once it has the
    // answer, and this window (the test yields every 20 ms) lets it do so before the clock moves,
    // so its wait ends 30 s after the refusal, not 30 s after a clock already moved on.
    let no_pass = || async {
        tokio::time::timeout(std::time::Duration::from_millis(2_500), async {
            while s.relay.seen("GET /v2/relay/info").len() == infos {
                tokio::time::sleep(std::time::Duration::from_millis(20)).await;
            }
        })
        .await
    };
    assert!(no_pass().await.is_err(), "a pass ran at once after the 429");
    s.clock.advance(29_999);
    assert!(
        no_pass().await.is_err(),
        "a pass ran before retry_after had passed"
    );
    assert_eq!(pushes_seen(), 1);
    let row = s.row(&id);
    assert_eq!((row.state.as_str(), row.attempts), ("pending", 0));
    // Then the next pass pushes the row again and it settles.
    s.clock.advance(1);
    wait_for("the relay accept", || s.row(&id).state == "relay-accepted").await;
    assert_eq!(pushes_seen(), 2);
    stop.send(true).unwrap();
    tokio::time::timeout(std::time::Duration::from_secs(10), task)
        .await
        .expect("the loop stops on shutdown")
        .unwrap();
}

#[tokio::test]
async fn the_stream_backoff_cuts_only_a_wait_that_lies_before_it() {
    use super::{stream_cap, StreamCtl};
    use std::time::Duration;
    let delay = Duration::from_secs(10);
    let mut ctl = StreamCtl::default();
    assert_eq!(stream_cap(delay, &ctl, true), delay, "no attempt pending");
    ctl.not_before = Some(tokio::time::Instant::now() - Duration::from_secs(1));
    assert_eq!(
        stream_cap(delay, &ctl, true),
        delay,
        "an attempt already due never makes the wait 0"
    );
    ctl.not_before = Some(tokio::time::Instant::now() + Duration::from_secs(2));
    let cut = stream_cap(delay, &ctl, true);
    assert!(
        cut > Duration::ZERO && cut <= Duration::from_secs(2),
        "{cut:?}"
    );
    assert_eq!(stream_cap(delay, &ctl, false), delay, "the stream is off");
}
