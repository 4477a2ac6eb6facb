//! Tests of the stream's frame handling: the prev_seq rule against a real store (an item that
//! fits is stored with its checkpoint, an old one ignored, one above a gap asks for a pull),
//! pings answered, and the close codes and delays.

use agentmbx_protocol::stream::{close, ClientFrame, ServerFrame};

use super::*;
use crate::testutil::{self, T0};
use crate::transport::relay_client::test_support::*;

fn deliver(seq: i64, prev_seq: i64, id: &str, sender: &str, wire: &[u8]) -> ServerFrame {
    ServerFrame::Deliver {
        seq,
        prev_seq,
        kind: "envelope".into(),
        item_id: id.into(),
        sender_pubkey: sender.into(),
        wire_b64: agentmbx_protocol::b64::encode(wire),
        replay: false,
    }
}

#[test]
fn the_prev_seq_rule() {
    assert_eq!(fit(10, 10, 15), Fit::Store, "next after the checkpoint");
    assert_eq!(
        fit(10, 7, 15),
        Fit::Store,
        "a prev at or below the checkpoint"
    );
    assert_eq!(
        fit(10, 12, 15),
        Fit::Gap,
        "an item not stored lies before it"
    );
    assert_eq!(fit(10, 5, 10), Fit::Old);
    assert_eq!(fit(10, 1, 3), Fit::Old);
    assert_eq!(
        fit(10, 15, 15),
        Fit::Gap,
        "a prev not below its seq is no run"
    );
    assert_eq!(fit(0, 0, 1), Fit::Store, "the first item ever");
}

#[tokio::test]
async fn a_frame_that_fits_is_stored_an_old_one_ignored_and_a_gap_pulls() {
    let s = Setup::new(true).await;
    let mut g = testutil::ids();
    let (m1, m2, m3) = (g.next(T0), g.next(T0), g.next(T0));
    let peer = s.peer_pub();
    let (w1, w2, w3) = (
        s.peer_wire(&m1, "one"),
        s.peer_wire(&m2, "two"),
        s.peer_wire(&m3, "three"),
    );
    s.client
        .epoch_changed("e1", crate::mailbox::outbox::Repush::Epoch, "test")
        .await
        .unwrap();
    let mut pos = at(&s.client, "e1").await.unwrap();
    assert_eq!(pos.through, 0);

    // Fits: stored, and the checkpoint moves in the item's transaction.
    let mut turn = Turn::default();
    let reply = handle(
        &s.client,
        deliver(100, 0, &m1, &peer, &w1),
        &mut pos,
        &mut turn,
    )
    .await
    .unwrap();
    assert!(reply.is_none());
    assert_eq!(pos.through, 100);
    assert_eq!(s.position().received_through, 100);
    assert_eq!(s.messages(), 1);
    assert!(turn.ack && !turn.pull);

    // Old: nothing changes.
    let mut turn = Turn::default();
    handle(
        &s.client,
        deliver(100, 0, &m1, &peer, &w1),
        &mut pos,
        &mut turn,
    )
    .await
    .unwrap();
    assert_eq!((s.messages(), s.position().received_through), (1, 100));
    assert!(!turn.ack && !turn.pull);

    // A gap (seq 300 after 200, which this host never saw): nothing stored, a pull asked for.
    let mut turn = Turn::default();
    handle(
        &s.client,
        deliver(300, 200, &m3, &peer, &w3),
        &mut pos,
        &mut turn,
    )
    .await
    .unwrap();
    assert_eq!((s.messages(), s.position().received_through), (1, 100));
    assert!(turn.pull && !turn.ack);
    // With the pull owed, even a frame that fits waits for it (the pull stores it in order).
    handle(
        &s.client,
        deliver(200, 100, &m2, &peer, &w2),
        &mut pos,
        &mut turn,
    )
    .await
    .unwrap();
    assert_eq!((s.messages(), s.position().received_through), (1, 100));

    // Then the missing one fits, and the one after it.
    let mut turn = Turn::default();
    handle(
        &s.client,
        deliver(200, 100, &m2, &peer, &w2),
        &mut pos,
        &mut turn,
    )
    .await
    .unwrap();
    handle(
        &s.client,
        deliver(300, 200, &m3, &peer, &w3),
        &mut pos,
        &mut turn,
    )
    .await
    .unwrap();
    assert_eq!((s.messages(), s.position().received_through), (3, 300));
    assert!(turn.ack && !turn.pull);
}

#[tokio::test]
async fn a_ping_is_answered_and_a_replay_below_the_head_pulls() {
    let s = Setup::new(true).await;
    s.client
        .epoch_changed("e1", crate::mailbox::outbox::Repush::Epoch, "test")
        .await
        .unwrap();
    let mut pos = at(&s.client, "e1").await.unwrap();
    let mut turn = Turn::default();
    let reply = handle(&s.client, ServerFrame::Ping { id: 7 }, &mut pos, &mut turn)
        .await
        .unwrap();
    assert_eq!(reply, Some(ClientFrame::Pong { id: 7 }));
    handle(
        &s.client,
        ServerFrame::ResumeComplete {
            replayed: 0,
            head_seq: 0,
        },
        &mut pos,
        &mut turn,
    )
    .await
    .unwrap();
    assert!(!turn.pull, "nothing beyond the checkpoint");
    handle(
        &s.client,
        ServerFrame::ResumeComplete {
            replayed: 0,
            head_seq: 9,
        },
        &mut pos,
        &mut turn,
    )
    .await
    .unwrap();
    assert!(turn.pull);
    let mut turn = Turn::default();
    handle(
        &s.client,
        ServerFrame::Lagged { from_seq: 3 },
        &mut pos,
        &mut turn,
    )
    .await
    .unwrap();
    assert!(
        turn.pull && turn.resume,
        "no live frame follows lagged until the next resume"
    );
}

#[tokio::test]
async fn resume_complete_is_judged_against_the_after_of_the_resume_it_answers() {
    let s = Setup::new(true).await;
    s.client
        .epoch_changed("e1", crate::mailbox::outbox::Repush::Epoch, "test")
        .await
        .unwrap();
    let mut pos = at(&s.client, "e1").await.unwrap();
    // Resumed after 50; a pull since moved received-through to 100; the relay's head was 80
    // when it answered: no rewind, nothing to pull.
    pos.through = 100;
    pos.resumed = Some(50);
    let mut turn = Turn::default();
    let complete = |head_seq| ServerFrame::ResumeComplete {
        replayed: 0,
        head_seq,
    };
    handle(&s.client, complete(80), &mut pos, &mut turn)
        .await
        .unwrap();
    assert!(!turn.pull && !turn.resume && !turn.push, "{turn:?}");
    assert_eq!(pos.resumed, None, "the replay is over");
    assert_eq!(pos.through, 100);
    // A head below the resume's own `after` is a rewind (spec §5).
    pos.resumed = Some(50);
    handle(&s.client, complete(40), &mut pos, &mut turn)
        .await
        .unwrap();
    assert!(turn.pull && turn.resume && turn.push, "{turn:?}");
}

#[tokio::test]
async fn a_mail_frame_that_cannot_be_read_pulls_an_unknown_one_is_ignored() {
    let s = Setup::new(true).await;
    let mut turn = Turn::default();
    unreadable(&s.client, r#"{"type":"news","text":"hi"}"#, &mut turn);
    unreadable(&s.client, "not json", &mut turn);
    assert!(!turn.pull && !turn.resume);
    for text in [
        r#"{"type":"deliver","seq":5,"kind":"envelope"}"#,
        r#"{"type":"lagged"}"#,
        r#"{"type":"epoch","epoch":7}"#,
        r#"{"type":"resume_complete","replayed":1}"#,
    ] {
        let mut turn = Turn::default();
        unreadable(&s.client, text, &mut turn);
        assert!(turn.pull && turn.resume, "{text}");
    }
}

#[test]
fn close_codes_and_delays() {
    assert_eq!(after_close(Some(close::GOING_AWAY)), AfterClose::Reconnect);
    assert_eq!(after_close(Some(close::OVERLOAD)), AfterClose::Reconnect);
    assert_eq!(after_close(None), AfterClose::Reconnect);
    assert_eq!(
        after_close(Some(close::TOKEN_EXPIRED)),
        AfterClose::NewToken
    );
    assert_eq!(after_close(Some(close::AUTH)), AfterClose::Refused);
    assert_eq!(after_close(Some(close::REPLACED)), AfterClose::Replaced);
    for f in 0..20 {
        let d = reconnect_delay(f);
        assert!(
            d >= RECONNECT_MIN && d <= RECONNECT_MAX + RECONNECT_MAX / 4,
            "{d:?}"
        );
    }
    assert!(reconnect_delay(0) <= RECONNECT_MIN + RECONNECT_MIN / 4);
    assert!(replaced_delay(1) >= REPLACED_MIN);
    assert!(replaced_delay(3) >= REPLACED_MIN * 4);
    assert!(replaced_delay(100) <= REPLACED_MAX + REPLACED_MAX / 4);
}

#[tokio::test]
async fn an_epoch_frame_runs_the_new_epoch_handling_and_asks_for_a_pass_and_a_resume() {
    let s = Setup::new(true).await;
    let mut g = testutil::ids();
    let m1 = g.next(T0);
    let peer = s.peer_pub();
    let w1 = s.peer_wire(&m1, "one");
    s.client
        .epoch_changed("e1", crate::mailbox::outbox::Repush::Epoch, "test")
        .await
        .unwrap();
    let mut pos = at(&s.client, "e1").await.unwrap();
    let mut turn = Turn::default();
    handle(
        &s.client,
        deliver(50, 0, &m1, &peer, &w1),
        &mut pos,
        &mut turn,
    )
    .await
    .unwrap();
    assert_eq!(s.position().received_through, 50);

    let mut turn = Turn::default();
    handle(
        &s.client,
        ServerFrame::Epoch { epoch: "e2".into() },
        &mut pos,
        &mut turn,
    )
    .await
    .unwrap();
    // Spec §5: the position restarts at 0 in the new epoch, recorded in one transaction.
    let p = s.position();
    assert_eq!((p.epoch.as_str(), p.received_through), ("e2", 0));
    assert_eq!((pos.epoch.as_str(), pos.through), ("e2", 0));
    assert!(turn.pull && turn.push && turn.resume, "{turn:?}");
    assert_eq!(s.audits("relay.epoch_changed").len(), 1);
}

#[test]
fn the_reader_answers_pings_and_forwards_every_other_message() {
    use tokio_tungstenite::tungstenite::Message;
    assert_eq!(
        ping_id(&Message::text(r#"{"type":"ping","id":42}"#)),
        Some(42)
    );
    assert_eq!(
        ping_id(&Message::text(r#"{"type":"lagged","from_seq":3}"#)),
        None
    );
    assert_eq!(ping_id(&Message::text(r#"{"type":"ping"}"#)), None, "no id");
    assert_eq!(
        ping_id(&Message::Ping(vec![1].into())),
        None,
        "the library's own"
    );
}

#[test]
fn only_a_401_bad_nonce_asks_for_a_fresh_nonce() {
    use crate::transport::relay_client::status_error;
    let body = |code: &str| format!(r#"{{"error":"refused","code":"{code}"}}"#);
    assert!(bad_nonce(&status_error(401, body("BAD_NONCE").as_bytes())));
    assert!(!bad_nonce(&status_error(
        401,
        body("NOT_ENROLLED").as_bytes()
    )));
    assert!(!bad_nonce(&status_error(400, body("BAD_NONCE").as_bytes())));
}

#[test]
fn an_upgrade_that_did_not_reach_the_relay_means_polling() {
    let body = |code: &str| format!(r#"{{"error":"x","code":"{code}"}}"#);
    assert!(not_offered(404, b"").is_some(), "an older relay");
    assert!(not_offered(400, body("NOT_UPGRADE").as_bytes()).is_some());
    assert!(not_offered(426, body("NOT_UPGRADE").as_bytes()).is_some());
    assert!(not_offered(200, b"<html>").is_some(), "a proxy's page");
    assert!(not_offered(401, body("BAD_NONCE").as_bytes()).is_none());
    assert!(not_offered(400, body("BAD_HOP").as_bytes()).is_none());
    assert!(not_offered(503, b"").is_none());
}
