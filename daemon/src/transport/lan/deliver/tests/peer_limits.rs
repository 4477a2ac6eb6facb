//! A peer's rate limit is waited out in the pass; a peer that keeps refusing is a LAN failure
//! after a few paced tries.

use super::*;

#[tokio::test]
async fn a_peer_rate_limit_is_waited_out_in_the_pass_not_backed_off_as_a_lan_failure() {
    // The closed-loop benchmark's 5 s sends: past the peer's burst of 600 signed requests, a
    // POST answered 429 was a LAN failure (attempts + 1, lan_failures + 1, next_at + 5 s; with a
    // relay, two of them handed the row to the relay). The peer only asked to slow down (its
    // limit refills one request every 100 ms, and a refused request was never processed), so
    // the same batch goes again after a short pause, in the same pass.
    let clock = testutil::clock();
    let home = Host::new("home", clock.clone());
    let work = testutil::identity("work");
    let peer = FakePeer::start().await;
    home.pin(&work, true, Some(&peer.addr));
    peer.on("POST /v2/envelopes", refuse_then(1, answer_all("accepted")));
    home.send(ID1, &["bob@work"]);
    let counts = home.delivery(true).pass().await.unwrap();
    assert_eq!((counts.delivered, counts.failed), (1, 0), "{counts:?}");
    let r = home.row(ID1, "work");
    assert_eq!(
        (r.state.as_str(), r.attempts, r.lan_failures, r.last_error),
        ("delivered", 0, 0, None),
        "no retry backoff was scheduled"
    );
    let sent = peer.seen("POST /v2/envelopes");
    assert_eq!(sent.len(), 2, "the refused batch went once more");
    assert_eq!(sent[0], sent[1], "the same wire bytes");
}

#[tokio::test]
async fn a_peer_that_keeps_refusing_is_a_lan_failure_after_a_few_paced_tries() {
    let clock = testutil::clock();
    let home = Host::new("home", clock.clone());
    let work = testutil::identity("work");
    let peer = FakePeer::start().await;
    home.pin(&work, true, Some(&peer.addr));
    peer.on("POST /v2/envelopes", |_| rate_limited());
    home.send(ID1, &["bob@work"]);
    let counts = home.delivery(true).pass().await.unwrap();
    assert_eq!((counts.delivered, counts.failed), (0, 1), "{counts:?}");
    let r = home.row(ID1, "work");
    assert_eq!(
        (r.state.as_str(), r.attempts, r.lan_failures, r.next_at),
        ("pending", 1, 1, T0 + outbox::backoff_ms(0))
    );
    assert!(r.last_error.unwrap().contains("429"));
    assert_eq!(
        peer.seen("POST /v2/envelopes").len(),
        1 + RATE_LIMIT_RETRIES as usize
    );
}
