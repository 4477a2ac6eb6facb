//! The pairing routes of `pairing.rs` served in process (see `pairing::test_support`): wrong,
//! expired and malformed tokens, single-use nonces, tampered transcripts, name clashes,
//! commitments and the rate limits.

#![allow(clippy::unwrap_used)]

use serde_json::{json, Value};

use agentmbx_protocol::pairing::{
    self, offer_commit, HolderParty, JoinerParty, PairHello, PairJoin, PairOffer,
};

use crate::identity::Identity;
use crate::pairing::client::{self, PairError};
use crate::pairing::own_offer;
use crate::pairing::test_support::*;
use crate::pairing::{MAX_TOKEN_TTL_MS, NONCE_TTL_MS, PENDING_TTL_MS, TOKEN_TTL_MS};
use crate::testutil::{self};
use crate::transport::lan::handlers::pairing as server;

async fn get_hello(addr: &str) -> HolderParty {
    let hello: PairHello = http()
        .get(format!("http://{addr}/v1/pair/hello"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(hello.v, 1);
    hello.holder
}

fn joiner_of(ident: &Identity, addr: &str) -> JoinerParty {
    JoinerParty {
        host: ident.host.to_string(),
        host_pubkey: ident.host_key.public().to_b64(),
        owner_pubkey: None,
        nonce: crate::pairing::new_nonce(),
        addr: addr.to_string(),
    }
}

/// A hand-made join from `ident` to `holder_addr` with key `key`; `tamper` may change the
/// request after its MAC was computed, and `holder_view` what the joiner believes about the
/// holder before (as a man in the middle would make it believe).
async fn raw_join(
    holder_addr: &str,
    ident: &Identity,
    key: &[u8; 32],
    holder_view: impl FnOnce(&mut HolderParty),
    tamper: impl FnOnce(&mut PairJoin),
) -> (u16, Value) {
    let mut holder = get_hello(holder_addr).await;
    holder_view(&mut holder);
    let mut join = PairJoin::new(&holder, joiner_of(ident, "127.0.0.1:9"), key);
    tamper(&mut join);
    post(
        holder_addr,
        "/v1/pair/join",
        &serde_json::to_value(&join).unwrap(),
    )
    .await
}

#[tokio::test]
async fn five_wrong_tokens_burn_every_live_token() {
    let alice = host("alice").await;
    let bob = host("bob").await;
    alice.add_token(KEY, TOKEN_TTL_MS);
    for i in 1..=5 {
        let err = client::join_with_key(&bob.local(), &alice.addr, &WRONG)
            .await
            .unwrap_err();
        assert_eq!(
            refused_text(err),
            format!(
                "alice ({}) refused the join: {}",
                alice.addr,
                server::NOT_VERIFIED
            )
        );
        let (state, failures, _) = alice.token_state();
        assert_eq!(failures, i);
        assert_eq!(state, if i < 5 { "live" } else { "burned" });
    }
    // The right token now finds nothing live.
    let err = client::join_with_key(&bob.local(), &alice.addr, &KEY)
        .await
        .unwrap_err();
    assert!(refused_text(err).contains("no live pairing token"));
    assert!(alice.peer("bob").is_none());
    assert!(bob.peer("alice").is_none());
}

#[tokio::test]
async fn an_expired_token_is_refused() {
    let alice = host("alice").await;
    let bob = host("bob").await;
    alice.add_token(KEY, TOKEN_TTL_MS);
    alice.clock.advance(TOKEN_TTL_MS);
    let err = client::join_with_key(&bob.local(), &alice.addr, &KEY)
        .await
        .unwrap_err();
    assert!(refused_text(err).contains("no live pairing token on alice (expired, used or burned)"));
    assert!(alice.peer("bob").is_none());
    // A token of the longest TTL still works just before it lapses.
    alice.add_token([9; 32], MAX_TOKEN_TTL_MS);
    alice.clock.advance(MAX_TOKEN_TTL_MS - 1);
    client::join_with_key(&bob.local(), &alice.addr, &[9; 32])
        .await
        .unwrap();
}

#[tokio::test]
async fn hello_nonces_are_single_use_and_lapse_after_two_minutes() {
    let alice = host("alice").await;
    let bob = testutil::identity("bob");
    alice.add_token(KEY, MAX_TOKEN_TTL_MS);

    // Replayed: the same join (same nonce_a) twice.
    let holder = get_hello(&alice.addr).await;
    let join = PairJoin::new(&holder, joiner_of(&bob, "127.0.0.1:9"), &KEY);
    let body = serde_json::to_value(&join).unwrap();
    let (status, first) = post(&alice.addr, "/v1/pair/join", &body).await;
    assert_eq!(status, 200, "{first}");
    assert_eq!(first["v"], 1);
    assert_eq!(first["host"], "alice");
    assert!(join_accept_verifies(&first, &holder, &join.joiner, &KEY));
    let (status, again) = post(&alice.addr, "/v1/pair/join", &body).await;
    assert_eq!(
        (status, again["error"].as_str()),
        (401, Some(server::UNKNOWN_HELLO))
    );

    // Never issued.
    let (status, made_up) = raw_join(
        &alice.addr,
        &bob,
        &KEY,
        |h| h.nonce = "made-up".into(),
        |_| {},
    )
    .await;
    assert_eq!(
        (status, made_up["error"].as_str()),
        (401, Some(server::UNKNOWN_HELLO))
    );

    // Lapsed: 2 minutes after the hello.
    alice.add_token([3; 32], MAX_TOKEN_TTL_MS);
    let holder = get_hello(&alice.addr).await;
    alice.clock.advance(NONCE_TTL_MS);
    let join = PairJoin::new(&holder, joiner_of(&bob, "127.0.0.1:9"), &[3; 32]);
    let (status, late) = post(
        &alice.addr,
        "/v1/pair/join",
        &serde_json::to_value(&join).unwrap(),
    )
    .await;
    assert_eq!(
        (status, late["error"].as_str()),
        (401, Some(server::UNKNOWN_HELLO))
    );
    // A nonce failure is not a MAC failure: the token is untouched.
    let failures: i64 = alice
        .store
        .scalar("SELECT failures FROM pair_tokens WHERE state = 'live'");
    assert_eq!(failures, 0);
}

fn join_accept_verifies(
    answer: &Value,
    holder: &HolderParty,
    joiner: &JoinerParty,
    key: &[u8; 32],
) -> bool {
    let accept: pairing::PairAccept = serde_json::from_value(answer.clone()).unwrap();
    accept.verify(holder, joiner, key)
}

#[tokio::test]
async fn a_tampered_transcript_fails_the_mac_and_counts_a_failure() {
    let alice = host("alice").await;
    let bob = testutil::identity("bob");
    let mallory = testutil::identity("mallory");
    alice.add_token(KEY, TOKEN_TTL_MS);
    let mk = mallory.host_key.public().to_b64();
    type HolderView = Box<dyn FnOnce(&mut HolderParty)>;
    type Tamper = Box<dyn FnOnce(&mut PairJoin)>;
    let keep_holder = || -> HolderView { Box::new(|_| {}) };
    let keep_join = || -> Tamper { Box::new(|_| {}) };
    let swapped_key = mk.clone();
    let cases: Vec<(&str, HolderView, Tamper)> = vec![
        (
            "joiner key swapped",
            keep_holder(),
            Box::new(move |j| j.joiner.host_pubkey = swapped_key),
        ),
        (
            "joiner name swapped",
            keep_holder(),
            Box::new(|j| j.joiner.host = "mallory".into()),
        ),
        (
            "joiner address swapped",
            keep_holder(),
            Box::new(|j| j.joiner.addr = "10.6.6.6:7373".into()),
        ),
        (
            "joiner nonce swapped",
            keep_holder(),
            Box::new(|j| j.joiner.nonce = "other".into()),
        ),
        // A man in the middle showed the joiner its own key as the holder's.
        (
            "holder key swapped",
            Box::new(move |h| h.host_pubkey = mk),
            keep_join(),
        ),
    ];
    let mut failures = 0;
    for (what, holder_view, tamper) in cases {
        if failures == 4 {
            // Four failures so far: one more would burn the token; start from a fresh one.
            alice
                .store
                .mailbox
                .with(|c| Ok(c.execute("DELETE FROM pair_tokens", [])?))
                .unwrap();
            alice.add_token(KEY, TOKEN_TTL_MS);
            failures = 0;
        }
        let (status, answer) = raw_join(&alice.addr, &bob, &KEY, holder_view, tamper).await;
        assert_eq!(
            (status, answer["error"].as_str()),
            (401, Some(server::NOT_VERIFIED)),
            "{what}"
        );
        failures += 1;
        assert_eq!(alice.token_state().1, failures, "{what}");
        assert!(
            alice.peer("bob").is_none() && alice.peer("mallory").is_none(),
            "{what}"
        );
    }
    // The honest join still works: the token was not burned.
    let (status, _) = raw_join(&alice.addr, &bob, &KEY, |_| {}, |_| {}).await;
    assert_eq!(status, 200);
    assert_eq!(
        alice.peer("bob").unwrap().pubkey,
        bob.host_key.public().to_b64()
    );
}

#[tokio::test]
async fn a_bad_join_body_is_400_and_changes_nothing() {
    let alice = host("alice").await;
    let bob = testutil::identity("bob");
    alice.add_token(KEY, TOKEN_TTL_MS);
    for (what, tamper) in [
        (
            "v",
            Box::new(|j: &mut PairJoin| j.v = 2) as Box<dyn FnOnce(&mut PairJoin)>,
        ),
        ("host rule", Box::new(|j| j.joiner.host = "Bob".into())),
        ("host length", Box::new(|j| j.joiner.host = "b".repeat(41))),
        (
            "key",
            Box::new(|j| j.joiner.host_pubkey = "not a key".into()),
        ),
        (
            "owner",
            Box::new(|j| j.joiner.owner_pubkey = Some("o".repeat(65))),
        ),
        ("nonce", Box::new(|j| j.joiner.nonce = "n".repeat(65))),
        ("empty addr", Box::new(|j| j.joiner.addr = String::new())),
        ("addr length", Box::new(|j| j.joiner.addr = "a".repeat(257))),
        (
            "addr with a newline (a forged log line)",
            Box::new(|j| j.joiner.addr = "x\n2030-01-01T00:00:00Z ERROR forged".into()),
        ),
        (
            "addr with a terminal escape",
            Box::new(|j| j.joiner.addr = "h:7373\u{1b}[2J".into()),
        ),
        (
            "addr with a space",
            Box::new(|j| j.joiner.addr = "h 7373".into()),
        ),
        ("nonce_a", Box::new(|j| j.nonce_a = "n".repeat(65))),
    ] {
        let (status, answer) = raw_join(&alice.addr, &bob, &KEY, |_| {}, tamper).await;
        assert_eq!(
            (status, answer["error"].as_str()),
            (400, Some(server::BAD_JOIN)),
            "{what}"
        );
    }
    let (status, answer) = post(&alice.addr, "/v1/pair/join", &json!("text")).await;
    assert_eq!(
        (status, answer["error"].as_str()),
        (400, Some(server::BAD_JOIN))
    );
    assert_eq!(alice.token_state(), ("live".to_string(), 0, None));
}

#[tokio::test]
async fn the_same_host_name_is_refused_on_both_sides() {
    let alice = host("alice").await;
    alice.add_token(KEY, TOKEN_TTL_MS);
    let twin = host("alice").await;
    // The joiner's own check.
    let err = client::join_with_key(&twin.local(), &alice.addr, &KEY)
        .await
        .unwrap_err();
    assert!(matches!(err, PairError::SameHost(_)), "{err}");
    assert!(err.to_string().contains("same host name"), "{err}");
    // The holder's check, for a joiner that does not check.
    let (status, answer) = raw_join(&alice.addr, &twin.ident, &KEY, |_| {}, |_| {}).await;
    assert_eq!(
        (status, answer["error"].as_str()),
        (409, Some(server::SAME_NAME))
    );
    assert_eq!(alice.token_state(), ("live".to_string(), 0, None));
    assert!(twin.peer("alice").is_none());
}

#[tokio::test]
async fn a_second_key_for_a_known_name_is_409() {
    let alice = host("alice").await;
    let old_bob = testutil::identity("bob");
    alice.store.add_peer(&old_bob, false);
    alice.add_token(KEY, TOKEN_TTL_MS);
    let new_bob = host("bob").await;
    let (status, answer) = raw_join(&alice.addr, &new_bob.ident, &KEY, |_| {}, |_| {}).await;
    assert_eq!(status, 409);
    let text = answer["error"].as_str().unwrap();
    assert_eq!(
        text,
        "alice already has bob paired with a different key; run 'agentmbx peers remove bob' there first"
    );
    // Through the client: the holder's text is shown, nothing is pinned on the joiner.
    let err = client::join_with_key(&new_bob.local(), &alice.addr, &KEY)
        .await
        .unwrap_err();
    let text = refused_text(err);
    assert!(
        text.starts_with(&format!(
            "alice ({}) refused the join: alice already has bob paired with a different key",
            alice.addr
        )),
        "{text}"
    );
    assert!(new_bob.peer("alice").is_none());
    assert_eq!(
        alice.peer("bob").unwrap().pubkey,
        old_bob.host_key.public().to_b64()
    );
    // A 409 does not use the token.
    assert_eq!(alice.token_state(), ("live".to_string(), 0, None));

    // The joiner refuses a holder whose name it knows under another key, before any join.
    let bob = host("bob").await;
    let fake_alice = testutil::identity("alice");
    bob.store.add_peer(&fake_alice, false);
    let err = client::join_with_key(&bob.local(), &alice.addr, &KEY)
        .await
        .unwrap_err();
    assert!(matches!(err, PairError::Conflict(_)), "{err}");
    assert_eq!(
        err.to_string(),
        "host alice is already paired with a different key; remove it first (agentmbx peers remove alice)"
    );
    assert_eq!(alice.token_state(), ("live".to_string(), 0, None));
}

#[tokio::test]
async fn hello_and_join_share_thirty_requests_a_minute() {
    let alice = host("alice").await;
    for _ in 0..30 {
        get_hello(&alice.addr).await;
    }
    let res = http()
        .get(format!("http://{}/v1/pair/hello", alice.addr))
        .send()
        .await
        .unwrap();
    assert_eq!(res.status().as_u16(), 429);
    assert!(res.headers().get("retry-after").is_some());
    let (status, answer) = post(&alice.addr, "/v1/pair/join", &json!({})).await;
    assert_eq!(status, 429, "{answer}");
    // One request's worth of time later, one more is allowed.
    alice.clock.advance(2_000);
    get_hello(&alice.addr).await;
}

// ---- comparison --------------------------------------------------------------------------------

fn offer_of(h: &Host) -> PairOffer {
    own_offer(&h.ident, &h.addr, crate::pairing::new_nonce())
}

#[tokio::test]
async fn a_reveal_without_its_commitment_is_refused() {
    let bob = host("bob").await;
    let alice = host("alice").await;
    let offer = serde_json::to_value(offer_of(&alice)).unwrap();
    let (status, answer) = post(&bob.addr, "/v1/pair", &json!({"v": 2, "offer": offer})).await;
    assert_eq!(
        (status, answer["error"].as_str()),
        (401, Some(server::NO_COMMITMENT))
    );
    // Committed to one offer, revealing another.
    let other = serde_json::to_value(offer_of(&alice)).unwrap();
    let (status, _) = post(
        &bob.addr,
        "/v1/pair",
        &json!({"v": 2, "commit": offer_commit(&offer).unwrap()}),
    )
    .await;
    assert_eq!(status, 200);
    let (status, answer) = post(&bob.addr, "/v1/pair", &json!({"v": 2, "offer": other})).await;
    assert_eq!(
        (status, answer["error"].as_str()),
        (401, Some(server::NO_COMMITMENT))
    );
    // A bare 0.5.x v1 offer.
    let (status, answer) = post(&bob.addr, "/v1/pair", &offer).await;
    assert_eq!(
        (status, answer["error"].as_str()),
        (400, Some(server::BAD_OFFER))
    );
    // A commitment lapses after 2 minutes.
    let (status, _) = post(
        &bob.addr,
        "/v1/pair",
        &json!({"v": 2, "commit": offer_commit(&other).unwrap()}),
    )
    .await;
    assert_eq!(status, 200);
    bob.clock.advance(NONCE_TTL_MS);
    let (status, answer) = post(&bob.addr, "/v1/pair", &json!({"v": 2, "offer": other})).await;
    assert_eq!(
        (status, answer["error"].as_str()),
        (401, Some(server::NO_COMMITMENT))
    );
    assert!(bob.pending("alice").is_none());
}

#[tokio::test]
async fn the_same_host_name_is_refused_in_a_comparison() {
    let alice = host("alice").await;
    let twin = host("alice").await;
    let err = client::compare(&twin.local(), &alice.addr)
        .await
        .unwrap_err();
    assert!(matches!(err, PairError::SameHost(_)), "{err}");
    // The responder's own check, for an initiator that does not check.
    let offer = serde_json::to_value(offer_of(&twin)).unwrap();
    post(
        &alice.addr,
        "/v1/pair",
        &json!({"v": 2, "commit": offer_commit(&offer).unwrap()}),
    )
    .await;
    let (status, answer) = post(&alice.addr, "/v1/pair", &json!({"v": 2, "offer": offer})).await;
    assert_eq!(
        (status, answer["error"].as_str()),
        (409, Some(server::SAME_NAME))
    );
    assert!(alice.pending("alice").is_none());
}

#[tokio::test]
async fn pending_comparisons_expire_after_ten_minutes() {
    let alice = host("alice").await;
    let bob = host("bob").await;
    let compared = client::compare(&alice.local(), &bob.addr).await.unwrap();
    alice.clock.advance(PENDING_TTL_MS - 1);
    bob.clock.advance(PENDING_TTL_MS);
    // Just in time on alice's side.
    alice.approve("bob", &compared.code).unwrap();
    // Lapsed on bob's: refused and removed, even with the right code.
    let err = bob.approve("alice", &compared.code).unwrap_err();
    assert!(matches!(err, PairError::Expired(_)), "{err}");
    assert!(bob.pending("alice").is_none());
    assert!(bob.peer("alice").is_none());
    assert!(bob
        .approve("alice", &compared.code)
        .unwrap_err()
        .is_not_found());
}

#[tokio::test]
async fn the_compare_route_allows_ten_requests_a_minute() {
    let bob = host("bob").await;
    for i in 0..10 {
        let (status, _) = post(
            &bob.addr,
            "/v1/pair",
            &json!({"v": 2, "commit": format!("c{i}")}),
        )
        .await;
        assert_eq!(status, 200);
    }
    let (status, answer) = post(&bob.addr, "/v1/pair", &json!({"v": 2, "commit": "c"})).await;
    assert_eq!(
        (status, answer["error"].as_str()),
        (429, Some("too many pairing attempts"))
    );
}
