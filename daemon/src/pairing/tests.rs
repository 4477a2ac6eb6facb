//! In-process pairing tests: each host serves the pairing router on 127.0.0.1:0 with its own
//! `mailbox.db` and manual clock, and the real client code drives it. Token keys are set
//! directly where the token text does not matter, so scrypt runs only where it is under test.

#![allow(clippy::unwrap_used)]

use std::sync::{Arc, Mutex};

use agentmbx_protocol::clock::{ManualClock, SharedClock};
use agentmbx_protocol::pairing::{
    self, offer_commit, HolderParty, JoinerParty, PairHello, PairJoin, PairOffer,
};
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::routing;
use axum::{Json, Router};
use serde_json::{json, Value};

use super::client::{self, Local, PairError};
use super::own_offer;
use super::store;
use super::{PairingMemory, MAX_TOKEN_TTL_MS, NONCE_TTL_MS, PENDING_TTL_MS, TOKEN_TTL_MS};
use crate::identity::Identity;
use crate::mailbox::peers;
use crate::testutil::{self, Store};
use crate::transport::lan::handlers::pairing as server;
use crate::transport::lan::{LanState, SharedLan};

/// The token key most tests pair with (what scrypt would give for some token).
const KEY: [u8; 32] = [0x4b; 32];
/// A key that matches no token.
const WRONG: [u8; 32] = [0x57; 32];

/// A host serving the pairing routes.
struct Host {
    ident: Arc<Identity>,
    store: Store,
    clock: Arc<ManualClock>,
    /// `127.0.0.1:<port>` of its server (also its advertise address).
    addr: String,
}

async fn serve(router: Router) -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    tokio::spawn(async move {
        let _ = axum::serve(listener, router).await;
    });
    addr
}

async fn host(name: &str) -> Host {
    host_with(testutil::identity(name)).await
}

async fn host_with(ident: Identity) -> Host {
    let ident = Arc::new(ident);
    let store = testutil::store();
    let clock = testutil::clock();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let bound = listener.local_addr().unwrap();
    let shared: SharedClock = clock.clone();
    let lan: SharedLan = Arc::new(LanState {
        ident: ident.clone(),
        mailbox: store.mailbox.clone(),
        clock: shared,
        version: "test",
        started_at: agentmbx_protocol::time::iso_ms(testutil::T0),
        port: bound.port(),
        advertise: bound.to_string(),
        self_addrs: vec![bound.ip()],
        wake: Arc::new(tokio::sync::Notify::new()),
        pairing: PairingMemory::default(),
        instance: Default::default(),
    });
    let app = server::router().with_state(lan);
    tokio::spawn(async move {
        let _ = axum::serve(listener, app).await;
    });
    Host {
        ident,
        store,
        clock,
        addr: bound.to_string(),
    }
}

impl Host {
    fn local(&self) -> Local {
        Local {
            ident: self.ident.clone(),
            mailbox: self.store.mailbox.clone(),
            clock: self.clock.clone(),
            advertise: self.addr.clone(),
        }
    }

    fn name(&self) -> String {
        self.ident.host.to_string()
    }

    fn pubkey(&self) -> String {
        self.ident.host_key.public().to_b64()
    }

    fn now(&self) -> i64 {
        use agentmbx_protocol::clock::Clock;
        self.clock.now_ms()
    }

    /// Stores a live token with key `key`, valid `ttl_ms`.
    fn add_token(&self, key: [u8; 32], ttl_ms: i64) {
        let now = self.now();
        self.store
            .mailbox
            .with(|c| store::insert_token(c, &pairing::token_id(&key), &key, now, now + ttl_ms))
            .unwrap();
    }

    fn token_state(&self) -> (String, i64, Option<String>) {
        self.store
            .fresh_conn()
            .query_row(
                "SELECT state, failures, used_by FROM pair_tokens",
                [],
                |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)),
            )
            .unwrap()
    }

    fn peer(&self, host: &str) -> Option<peers::Peer> {
        peers::by_name(&self.store.fresh_conn(), host).unwrap()
    }

    fn pending(&self, host: &str) -> Option<store::Pending> {
        store::pending(&self.store.fresh_conn(), host).unwrap()
    }

    fn approve(&self, host: &str, code: &str) -> Result<client::Paired, PairError> {
        let now = self.now();
        let own = self.name();
        self.store
            .mailbox
            .with(|c| Ok(client::approve(c, &own, host, code, now)))
            .unwrap()
    }
}

fn http() -> reqwest::Client {
    crate::install_tls_provider();
    reqwest::Client::builder()
        .redirect(reqwest::redirect::Policy::none())
        .build()
        .unwrap()
}

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

async fn post(addr: &str, path: &str, body: &Value) -> (u16, Value) {
    let res = http()
        .post(format!("http://{addr}{path}"))
        .json(body)
        .send()
        .await
        .unwrap();
    let status = res.status().as_u16();
    (status, res.json().await.unwrap_or(Value::Null))
}

fn joiner_of(ident: &Identity, addr: &str) -> JoinerParty {
    JoinerParty {
        host: ident.host.to_string(),
        host_pubkey: ident.host_key.public().to_b64(),
        owner_pubkey: None,
        nonce: super::new_nonce(),
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

fn refused_text(e: PairError) -> String {
    match e {
        PairError::Refused(text) => text,
        other => panic!("expected a refusal, got {other:?}"),
    }
}

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
    own_offer(&h.ident, &h.addr, super::new_nonce())
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
            nonce: super::new_nonce(),
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

#[test]
fn pin_conflicts_are_worded_for_the_other_host_or_for_this_ones_owner() {
    let s = testutil::store();
    let bob = testutil::identity("bob");
    s.add_peer(&bob, false);
    let bob_key = bob.host_key.public().to_b64();
    let other_key = testutil::identity("bob").host_key.public().to_b64();
    let (server_text, own_text) = s
        .mailbox
        .with(|c| {
            Ok((
                store::pin_conflict(c, "alice", "bob", &other_key)?,
                store::own_pin_conflict(c, "bob", &other_key)?,
            ))
        })
        .unwrap();
    // 0.5.x's 409 answer, and its joiner's own refusal.
    assert_eq!(
        server_text.as_deref(),
        Some("alice already has bob paired with a different key; run 'agentmbx peers remove bob' there first")
    );
    assert_eq!(
        own_text.as_deref(),
        Some("host bob is already paired with a different key; remove it first (agentmbx peers remove bob)")
    );
    // A known key under another name.
    let (server_text, own_text) = s
        .mailbox
        .with(|c| {
            Ok((
                store::pin_conflict(c, "alice", "robert", &bob_key)?,
                store::own_pin_conflict(c, "robert", &bob_key)?,
            ))
        })
        .unwrap();
    assert_eq!(
        server_text.as_deref(),
        Some("alice already has this host key paired as bob; a key has one name")
    );
    assert_eq!(
        own_text.as_deref(),
        Some("this host key is already paired here as bob; a key has one name (agentmbx peers remove bob first)")
    );
    // The same pair again, or a new one: no conflict.
    let none = s
        .mailbox
        .with(|c| {
            Ok((
                store::pin_conflict(c, "alice", "bob", &bob_key)?,
                store::own_pin_conflict(c, "carol", &other_key)?,
            ))
        })
        .unwrap();
    assert_eq!(none, (None, None));
}
