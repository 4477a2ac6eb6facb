//! Pairing driven by the real client (`client.rs`) against hosts served in process (see
//! `pairing::test_support`): token joins and code comparisons pin both sides, and a man in the
//! middle makes the codes differ.

#![allow(clippy::unwrap_used)]

use std::sync::{Arc, Mutex};

use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::routing;
use axum::{Json, Router};
use serde_json::{json, Value};

use agentmbx_protocol::pairing::{self, offer_commit, PairOffer};

use crate::pairing::client::{self, PairError};
use crate::pairing::test_support::*;
use crate::pairing::{PENDING_TTL_MS, TOKEN_TTL_MS};
use crate::testutil::{self};

// ---- token join ----------------------------------------------------------------------------------

#[tokio::test]
async fn token_join_pins_both_sides_and_the_token_is_single_use() {
    let alice = host("alice").await;
    let bob = host("bob").await;
    let now = alice.now();
    let token = alice
        .store
        .mailbox
        .with(|c| Ok(client::create_token(c, TOKEN_TTL_MS, now)))
        .unwrap()
        .unwrap();
    assert_eq!(pairing::display_token(&token.token).unwrap(), token.token);
    let (state, failures, _) = alice.token_state();
    assert_eq!((state.as_str(), failures), ("live", 0));
    let stored_key: String = alice.store.scalar("SELECT key FROM pair_tokens");
    assert_eq!(stored_key.len(), 64, "K is stored as hex");
    assert!(!stored_key.contains(&token.token));

    // The token is typed in lowercase with spaces: normalisation applies.
    let typed = token.token.to_lowercase().replace('-', " ");
    let paired = client::join(&bob.local(), &alice.addr, &typed)
        .await
        .unwrap();
    assert_eq!(paired.host, "alice");
    assert_eq!(paired.host_pubkey, alice.pubkey());
    assert!(paired.new);

    let on_bob = bob.peer("alice").unwrap();
    assert_eq!(on_bob.pubkey, alice.pubkey());
    assert_eq!(on_bob.addr.as_deref(), Some(alice.addr.as_str()));
    assert_eq!(on_bob.addr_source.as_deref(), Some("pair"));
    let on_alice = alice.peer("bob").unwrap();
    assert_eq!(on_alice.pubkey, bob.pubkey());
    assert_eq!(on_alice.addr.as_deref(), Some(bob.addr.as_str()));
    assert_eq!(on_alice.addr_source.as_deref(), Some("pair"));
    assert_eq!(
        alice.token_state(),
        ("used".to_string(), 0, Some("bob".to_string()))
    );

    // Reused: the token is no longer live.
    let carol = host("carol").await;
    let err = client::join(&carol.local(), &alice.addr, &token.token)
        .await
        .unwrap_err();
    let text = refused_text(err);
    assert!(text.contains("no live pairing token on alice"), "{text}");
    assert!(carol.peer("alice").is_none());
    assert!(alice.peer("carol").is_none());
}

#[tokio::test]
async fn an_unreachable_host_is_said_in_our_words_and_an_assumed_port_is_named() {
    let bob = host("bob").await;
    let closed = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap()
    };
    // With a port: the address, the cause in two words, the hint; no URL, no library text.
    let err = client::join(&bob.local(), &closed.to_string(), "ABCD-EFGH-JKMN")
        .await
        .unwrap_err();
    assert_eq!(
        err.to_string(),
        format!(
            "cannot reach {closed}: connection refused (is the agentmbx daemon running there?)"
        )
    );
    // Without one: the text says 7373 was assumed (127.0.0.7: no test daemon listens there).
    let err = client::join(&bob.local(), "127.0.0.7", "ABCD-EFGH-JKMN")
        .await
        .unwrap_err();
    assert_eq!(
        err.to_string(),
        "cannot reach 127.0.0.7:7373 (the default LAN port; give host:port if the daemon \
         there uses another): connection refused (is the agentmbx daemon running there?)"
    );
    let err = client::compare(&bob.local(), "127.0.0.7")
        .await
        .unwrap_err();
    assert!(
        err.to_string()
            .starts_with("cannot reach 127.0.0.7:7373 (the default LAN port;"),
        "{err}"
    );
}

#[tokio::test]
async fn a_malformed_token_is_a_usage_error_before_any_request() {
    let bob = host("bob").await;
    let err = client::join(&bob.local(), "127.0.0.1:1", "not-a-token")
        .await
        .unwrap_err();
    assert!(err.is_usage(), "{err}");
    assert_eq!(
        err.to_string(),
        "malformed pairing token (expected XXXX-XXXX-XXXX)"
    );
}

#[tokio::test]
async fn both_sides_compute_the_same_code_and_approve_pins() {
    let alice = host("alice").await;
    let bob = host("bob").await;
    let compared = client::compare(&alice.local(), &bob.addr).await.unwrap();
    assert_eq!(compared.host, "bob");
    assert_eq!(compared.host_pubkey, bob.pubkey());
    assert_eq!(compared.code.len(), 6);
    let on_alice = alice.pending("bob").unwrap();
    let on_bob = bob.pending("alice").unwrap();
    assert_eq!(on_alice.code, compared.code);
    assert_eq!(on_bob.code, compared.code);
    assert_eq!(on_alice.nonce_local, on_bob.nonce_remote);
    assert_eq!(on_bob.nonce_local, on_alice.nonce_remote);
    assert_eq!(on_bob.pubkey, alice.pubkey());
    assert_eq!(on_bob.expires_at, bob.now() + PENDING_TTL_MS);
    // Nothing is pinned before approval.
    assert!(alice.peer("bob").is_none() && bob.peer("alice").is_none());

    // A wrong code pins nothing and keeps the comparison.
    let wrong = if compared.code == "000000" {
        "111111"
    } else {
        "000000"
    };
    let err = bob.approve("alice", wrong).unwrap_err();
    assert!(matches!(err, PairError::CodeMismatch { .. }), "{err}");
    // The text says the codes differ without showing this host's (it would be retyped).
    let text = err.to_string();
    assert!(!text.contains(&compared.code), "{text}");
    assert!(!format!("{err:?}").contains(&compared.code), "{err:?}");
    assert!(
        text.starts_with(&format!(
            "code mismatch: {wrong} is not the code this host computed for alice; nothing was paired."
        )),
        "{text}"
    );
    assert!(
        text.contains("start over with `agentmbx pair --compare <host:port>`"),
        "{text}"
    );
    // Its own name is never a peer to approve.
    assert!(matches!(
        bob.approve("bob", &compared.code),
        Err(PairError::SameHost(_))
    ));
    assert!(bob.peer("alice").is_none() && bob.pending("alice").is_some());
    assert!(bob.approve("alice", "12345").unwrap_err().is_usage());
    assert!(bob
        .approve("carol", &compared.code)
        .unwrap_err()
        .is_not_found());

    bob.approve("alice", &compared.code).unwrap();
    alice.approve("bob", &compared.code).unwrap();
    let pinned = bob.peer("alice").unwrap();
    assert_eq!(pinned.pubkey, alice.pubkey());
    assert_eq!(pinned.addr.as_deref(), Some(alice.addr.as_str()));
    assert_eq!(pinned.addr_source.as_deref(), Some("pair"));
    let pinned = alice.peer("bob").unwrap();
    assert_eq!(pinned.pubkey, bob.pubkey());
    assert_eq!(pinned.addr.as_deref(), Some(bob.addr.as_str()));
    assert!(alice.pending("bob").is_none() && bob.pending("alice").is_none());
}

/// A man in the middle of a comparison: to the initiator it poses as the responder and to the
/// responder as the initiator, each time with its own key. It must commit to its offer towards
/// the responder before it sees the initiator's, so it cannot steer the two codes together.
#[derive(Clone)]
struct Mitm {
    target: String,
    key: String,
    seen: Arc<Mutex<Option<PairOffer>>>,
}

async fn mitm_pair(State(m): State<Mitm>, Json(body): Json<Value>) -> Response {
    if body.get("commit").is_some() {
        // Toward the responder: commit to an offer claiming to be the initiator.
        let posing = PairOffer {
            v: 1,
            host: "alice".into(),
            host_pubkey: m.key.clone(),
            owner_pubkey: None,
            nonce: crate::pairing::new_nonce(),
            addr: "10.6.6.6:7373".into(),
        };
        let posing_value = serde_json::to_value(&posing).unwrap();
        let (_, real) = post(
            &m.target,
            "/v1/pair",
            &json!({"v": 2, "commit": offer_commit(&posing_value).unwrap()}),
        )
        .await;
        *m.seen.lock().unwrap() = Some(posing);
        // Toward the initiator: the responder's offer with the intruder's key.
        let mut fake: PairOffer = serde_json::from_value(real).unwrap();
        fake.host_pubkey = m.key.clone();
        return Json(fake).into_response();
    }
    let posing = m.seen.lock().unwrap().clone().unwrap();
    let (status, answer) = post(&m.target, "/v1/pair", &json!({"v": 2, "offer": posing})).await;
    assert_eq!(status, 200, "{answer}");
    Json(answer).into_response()
}

#[tokio::test]
async fn a_man_in_the_middle_who_swaps_offers_makes_the_codes_differ() {
    let alice = host("alice").await;
    let bob = host("bob").await;
    let mallory = testutil::identity("mallory");
    let mitm = Mitm {
        target: bob.addr.clone(),
        key: mallory.host_key.public().to_b64(),
        seen: Arc::new(Mutex::new(None)),
    };
    let mitm_addr = serve(
        Router::new()
            .route("/v1/pair", routing::post(mitm_pair))
            .with_state(mitm),
    )
    .await;
    let compared = client::compare(&alice.local(), &mitm_addr).await.unwrap();
    // alice believes it compared with "bob", but holds mallory's key; bob holds mallory's key as "alice".
    assert_eq!(compared.host, "bob");
    assert_eq!(compared.host_pubkey, mallory.host_key.public().to_b64());
    let on_bob = bob.pending("alice").unwrap();
    assert_eq!(on_bob.pubkey, mallory.host_key.public().to_b64());
    assert_ne!(
        compared.code, on_bob.code,
        "the humans see two different codes"
    );
    // So neither side's code approves on the other.
    assert!(matches!(
        bob.approve("alice", &compared.code),
        Err(PairError::CodeMismatch { .. })
    ));
    assert!(matches!(
        alice.approve("bob", &on_bob.code),
        Err(PairError::CodeMismatch { .. })
    ));
    assert!(bob.peer("alice").is_none() && alice.peer("bob").is_none());
}
