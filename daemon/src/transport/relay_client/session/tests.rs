//! Tests of `session.rs` against the fake relay of `test_support`: opening a session, pinning the
//! relay key, enrolment and its recovery, refusals, revocation and denial.

use std::sync::{Arc, Mutex};

use serde_json::json;

use agentmbx_protocol::clock::SharedClock;
use agentmbx_protocol::keys::HostKey;
use agentmbx_protocol::records::EncAd;
use agentmbx_protocol::time::iso_ms;

use crate::testutil::{self, T0};
use crate::transport::relay_client;
use crate::transport::relay_client::state::{self as relay_trust, Standing};
use crate::transport::relay_client::test_support::*;
use crate::transport::relay_client::RelayError;

mod enc_ad;

#[tokio::test]
async fn a_session_with_another_relay_key_stops() {
    let s = Setup::new(true).await;
    let other = HostKey::generate();
    let answer = info(&other, "e1", None);
    s.relay
        .on("GET /v2/relay/info", move |_| (200, answer.clone()));
    let err = s.client.open_session().await.unwrap_err();
    assert!(matches!(err, RelayError::KeyMismatch { .. }), "{err}");
    assert!(s.relay.seen("POST /v1/relay/challenge").is_empty());
}

#[tokio::test]
async fn a_session_enrols_when_the_relay_forgot_this_host_and_publishes_the_ad() {
    let s = Setup::new(true).await;
    let me = s.me_pub();
    let key = s.relay.key.clone();
    let mut infos = 0;
    s.relay.on("GET /v2/relay/info", move |_| {
        infos += 1;
        let you = (infos > 1).then(|| {
            json!({"host": "home", "pubkey": me, "head_seq": 7, "acked_through": 0, "enc_ad": null})
        });
        (200, info(&key, "e1", you))
    });
    s.relay.on("POST /v1/relay/challenge", |_| {
        (200, json!({"challenge": "Y2hhbGxlbmdl"}))
    });
    s.relay
        .on("POST /v1/relay/enrol", |_| (200, json!({"ok": true})));
    s.relay
        .on("POST /v2/relay/enc-key", |_| (200, json!({"ok": true})));
    let sess = s.client.open_session().await.unwrap();
    assert_eq!((sess.epoch.as_str(), sess.head_seq), ("e1", 7));
    let enrol = s.relay.seen("POST /v1/relay/enrol")[0].json();
    let sig = enrol["sig"].as_str().unwrap();
    let signed =
        agentmbx_protocol::records::enrol_canonical("Y2hhbGxlbmdl", "home", &s.me_pub(), "");
    assert!(s.me.host_key.public().verify(signed.as_bytes(), sig));
    let ad = s.relay.seen("POST /v2/relay/enc-key")[0].json();
    let verified =
        agentmbx_protocol::records::verify_enc_ad(&ad["ad"], ad["sig"].as_str(), &s.me_pub(), T0)
            .unwrap();
    assert_eq!(verified.enc_pub, s.me.enc_key.public().to_b64());
    s.relay.assert_hops_ok_except_plain();
}

#[tokio::test]
async fn the_loop_opens_a_session_pushes_on_wake_and_pulls() {
    let s = Setup::new(true).await;
    let me = s.me_pub();
    let enc = s.me.enc_key.public().to_b64();
    let key = s.relay.key.clone();
    s.relay.on("GET /v2/relay/info", move |_| {
        let you = json!({"host": "home", "pubkey": me, "head_seq": 0, "acked_through": 0,
                         "enc_ad": {"enc_pub": enc, "exp": iso_ms(T0 + 30 * 86_400_000), "v1": false}});
        (200, info(&key, "e1", Some(you)))
    });
    s.accept_all("e1", "accepted");
    let mut g = testutil::ids();
    let incoming = g.next(T0);
    let q = Arc::new(Mutex::new(Queue {
        epoch: "e1".into(),
        items: vec![item(
            5,
            &incoming,
            &s.peer_pub(),
            &s.peer_wire(&incoming, "in"),
        )],
        head_override: None,
    }));
    serve_queue(&s.relay, q);

    let wake = Arc::new(tokio::sync::Notify::new());
    let (stop, stopped) = tokio::sync::watch::channel(false);
    let task = tokio::spawn(relay_client::run(
        s.client.clone(),
        std::time::Duration::from_secs(3600),
        wake.clone(),
        stopped,
    ));
    // The first pass pulls what waits for this host.
    wait_for("the pulled message", || {
        s.store.scalar::<i64>("SELECT COUNT(*) FROM messages") == 1
    })
    .await;
    // A send wakes the loop (the pull interval is an hour): the row is pushed and settled.
    let id = s.send_to_peer(ID1);
    wake.notify_one();
    wait_for("the relay accept", || s.row(&id).state == "relay-accepted").await;
    // The session needed no enrolment and no new ad.
    assert!(s.relay.seen("POST /v1/relay/enrol").is_empty());
    assert!(s.relay.seen("POST /v2/relay/enc-key").is_empty());
    s.relay.assert_hops_ok();
    stop.send(true).unwrap();
    tokio::time::timeout(std::time::Duration::from_secs(10), task)
        .await
        .expect("the loop stops on shutdown")
        .unwrap();
}

#[tokio::test]
async fn the_relay_key_is_pinned_on_first_contact_and_kept() {
    let s = Setup::new(true).await;
    let served = Arc::new(Mutex::new(s.relay.key.clone()));
    let current = served.clone();
    s.relay.on("GET /v2/relay/info", move |_| {
        (200, info(&current.lock().unwrap(), "e1", None))
    });
    let clock: SharedClock = s.clock.clone();
    let first = relay_client::pin::resolve_key(&s.relay.url, None, &s.store.mailbox, &clock)
        .await
        .unwrap();
    assert_eq!(first, s.relay.key.public());
    // The relay now serves another key: the pin stays (a mismatch is the session's to report).
    *served.lock().unwrap() = HostKey::generate();
    let again = relay_client::pin::resolve_key(
        &format!("{}/", s.relay.url),
        None,
        &s.store.mailbox,
        &clock,
    )
    .await
    .unwrap();
    assert_eq!(again, first);
    assert_eq!(s.relay.seen("GET /v2/relay/info").len(), 1);
    // A configured key wins over the stored pin.
    let configured = HostKey::generate().public();
    let k = relay_client::pin::resolve_key(
        &s.relay.url,
        Some(&configured.to_b64()),
        &s.store.mailbox,
        &clock,
    )
    .await
    .unwrap();
    assert_eq!(k, configured);
    assert!(
        relay_client::pin::resolve_key(&s.relay.url, Some("junk"), &s.store.mailbox, &clock)
            .await
            .is_err()
    );
}

#[tokio::test]
async fn a_new_epoch_sends_relay_accepted_rows_again_with_the_same_bytes() {
    let s = Setup::new(true).await;
    let id = s.send_to_peer(ID1);
    let url = s.client.url.clone();
    // The row was accepted in epoch e1, with its wire bytes persisted.
    s.store
        .mailbox
        .with(|c| {
            crate::mailbox::outbox::set_wire(c, &id, "work", b"{\"sealed\":1}", "h1")?;
            let a = crate::mailbox::outbox::Accepted {
                relay: &url,
                epoch: "e1",
                seq: 42,
                accept: "{}",
                sig: "",
                accepted_at: T0,
                deadline_at: T0 + 1,
            };
            crate::mailbox::outbox::settle_accepted(c, &id, "work", &a, T0)
        })
        .unwrap();
    let me = s.me_pub();
    let enc = s.me.enc_key.public().to_b64();
    let key = s.relay.key.clone();
    let epoch = std::sync::Arc::new(std::sync::Mutex::new("e1".to_string()));
    let e = epoch.clone();
    s.relay.on("GET /v2/relay/info", move |_| {
        let you = json!({"host": "home", "pubkey": me, "head_seq": 0, "acked_through": 0,
                         "enc_ad": {"enc_pub": enc, "exp": "2099-01-01T00:00:00.000Z", "v1": false}});
        (200, info(&key, &e.lock().unwrap(), Some(you)))
    });
    // First contact records e1 and moves nothing; the same epoch again moves nothing.
    s.client.open_session().await.unwrap();
    s.client.open_session().await.unwrap();
    assert_eq!(s.row(&id).state, "relay-accepted");
    // The relay comes back in a new epoch (a restore): the row is due again, bytes unchanged
    // (and this host enrols again, spec §8).
    s.relay.on("POST /v1/relay/challenge", |_| {
        (200, json!({"challenge": "Y2hhbGxlbmdl"}))
    });
    s.relay
        .on("POST /v1/relay/enrol", |_| (200, json!({"ok": true})));
    *epoch.lock().unwrap() = "e2".into();
    s.client.open_session().await.unwrap();
    let row = s.row(&id);
    assert_eq!(row.state, "repush");
    assert_eq!(row.last_error.as_deref(), Some("relay epoch: re-push"));
    assert_eq!((row.accepted_at, row.deadline_at), (Some(T0), Some(T0 + 1)));
    assert!(row.next_at <= s.clock_now());
    assert_eq!(row.wire.as_deref(), Some(&b"{\"sealed\":1}"[..]));
}

#[tokio::test]
async fn a_401_on_a_signed_request_re_enrols_in_the_same_pass_and_retries_once() {
    for route in [
        "POST /v2/relay/items",
        "GET /v2/relay/enc-key",
        "GET /v2/relay/items",
        "POST /v2/relay/ack",
    ] {
        let s = Setup::new(route != "GET /v2/relay/enc-key").await;
        let t = s.trusty();
        if route == "GET /v2/relay/enc-key" {
            let enc = s.peer.enc_key.public().to_b64();
            let ad = EncAd::new("work", &s.peer.host_key.public(), &enc, T0 - 1_000);
            let answer = enc_answer(&s.peer, &ad, &s.peer.host_key, &enc);
            s.relay
                .on("GET /v2/relay/enc-key", move |_| (200, answer.clone()));
        }
        if route == "POST /v2/relay/ack" {
            let m = testutil::ids().next(T0);
            let w = s.peer_wire(&m, "in");
            t.queue
                .lock()
                .unwrap()
                .items
                .push(item(5, &m, &s.peer_pub(), &w));
        }
        // A first pass confirms the enrolment (the cache is written).
        relay_client::pass(&s.client).await.unwrap();
        assert!(s.relay.seen("POST /v1/relay/enrol").is_empty(), "{route}");
        let id = s.send_to_peer(ID1);
        if route == "POST /v2/relay/ack" {
            // Something new to ack.
            let m = testutil::ids().next(T0 + 1);
            let w = s.peer_wire(&m, "in2");
            t.queue
                .lock()
                .unwrap()
                .items
                .push(item(6, &m, &s.peer_pub(), &w));
        }
        let before = s.relay.seen(route).len();
        s.refuse_once(route, 401, "NOT_ENROLLED", &t);
        relay_client::pass(&s.client).await.unwrap();
        // Challenge, enrol and enc-ad publish ran in this pass, and the request was retried once.
        assert_eq!(s.relay.seen("POST /v1/relay/challenge").len(), 1, "{route}");
        assert_eq!(s.relay.seen("POST /v1/relay/enrol").len(), 1, "{route}");
        assert_eq!(s.relay.seen("POST /v2/relay/enc-key").len(), 1, "{route}");
        assert_eq!(
            s.relay.seen(route).len() - before,
            2,
            "{route}: retried once"
        );
        let row = s.row(&id);
        assert_eq!(row.state, "relay-accepted", "{route}");
        assert_eq!(row.attempts, 0, "{route}: a 401 is not the row's failure");
        if route == "POST /v2/relay/ack" {
            assert_eq!(s.position().acked_through, 6, "{route}");
        }
        assert_eq!(s.audits("relay.enrolment_lost").len(), 1, "{route}");
        assert_eq!(s.audits("relay.enrolled").len(), 1, "{route}");
        assert_eq!(s.relay_state().unwrap().state, Standing::Ok, "{route}");
        s.relay.assert_hops_ok_except_plain();
    }
}

/// The real time (ms): the fake relay's `Date` header comes from the system clock, so the
/// tests that classify a refusal by it set the host's manual clock relative to it.
fn wall_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as i64
}

#[tokio::test]
async fn a_refusal_right_after_enrolment_backs_off_and_is_classified_by_the_relay_date() {
    use std::sync::atomic::Ordering;
    // (host clock offset from the relay's, how the relay refuses, expected verdict)
    let cases = [
        (10 * 60_000, "no you", Standing::ClockSkew),
        (-10 * 60_000, "401", Standing::ClockSkew),
        (0, "no you", Standing::RefusedAfterEnrol),
        (0, "401", Standing::RefusedAfterEnrol),
    ];
    for (offset, how, verdict) in cases {
        let s = Setup::new(true).await;
        let t = s.trusty();
        s.clock.set(wall_ms() + offset);
        t.enrolled.store(false, Ordering::SeqCst);
        let refusing = Arc::new(std::sync::atomic::AtomicBool::new(true));
        if how == "no you" {
            // The relay takes the enrolment but its signed info never knows this host.
            let r = refusing.clone();
            let e = t.enrolled.clone();
            s.relay.on("POST /v1/relay/enrol", move |_| {
                e.store(!r.load(Ordering::SeqCst), Ordering::SeqCst);
                (200, json!({"ok": true}))
            });
        } else {
            // The relay's info knows the host, but every signed write is refused.
            for route in ["POST /v2/relay/enc-key", "POST /v2/relay/senders"] {
                let r = refusing.clone();
                s.relay.on(route, move |_| {
                    if r.load(Ordering::SeqCst) {
                        (401, json!({"error": "stale or bad hop timestamp (check clocks)", "code": "BAD_HOP"}))
                    } else {
                        (200, json!({"ok": true}))
                    }
                });
            }
        }
        let case = format!("{offset} {how}");
        let err = s.client.open_session().await.unwrap_err();
        let now = s.clock_now();
        let RelayError::Refused {
            standing,
            retry_at_ms,
            ..
        } = err
        else {
            panic!("{case}: {err}");
        };
        assert_eq!((standing, retry_at_ms), (verdict, now + 60_000), "{case}");
        let st = s.relay_state().unwrap();
        assert_eq!(st.state, verdict, "{case}");
        assert_eq!(st.next_at, Some(iso_ms(now + 60_000)), "{case}");
        assert_eq!(st.status, Some(401), "{case}");
        if verdict == Standing::ClockSkew {
            assert!(
                st.detail.as_deref().unwrap().contains("10 min"),
                "{case}: {st:?}"
            );
        }
        let failed = s.audits("relay.enrol_failed");
        assert_eq!(failed.len(), 1, "{case}");
        assert_eq!(failed[0].detail["reason"], verdict.as_str(), "{case}");
        // Within the backoff nothing is tried again (no hot loop).
        s.clock.advance(59_000);
        assert!(matches!(
            s.client.open_session().await,
            Err(RelayError::Refused { .. })
        ));
        assert_eq!(s.relay.seen("POST /v1/relay/challenge").len(), 1, "{case}");
        // After it, one more attempt, refused again: the pause doubles, audited once per episode.
        s.clock.advance(1_001);
        let Err(RelayError::Refused { retry_at_ms, .. }) = s.client.open_session().await else {
            panic!("{case}: refused again");
        };
        assert_eq!(retry_at_ms, s.clock_now() + 120_000, "{case}");
        assert_eq!(s.relay.seen("POST /v1/relay/challenge").len(), 2, "{case}");
        assert_eq!(s.audits("relay.enrol_failed").len(), 1, "{case}");
        // The relay takes the host again: the next attempt after the pause succeeds.
        refusing.store(false, Ordering::SeqCst);
        s.clock.advance(120_000);
        relay_client::pass(&s.client).await.unwrap();
        assert_eq!(s.relay_state().unwrap().state, Standing::Ok, "{case}");
        let url = s.url();
        assert_eq!(
            s.store
                .mailbox
                .with(|c| relay_trust::backoff(c, &url))
                .unwrap(),
            None,
            "{case}: the episode ended"
        );
    }
}

#[tokio::test]
async fn a_revoked_host_is_its_own_state_and_never_a_hot_loop() {
    use std::sync::atomic::Ordering;
    let s = Setup::new(true).await;
    let t = s.trusty();
    // Revoked while enrolled: the push answers 403.
    relay_client::pass(&s.client).await.unwrap();
    let id = s.send_to_peer(ID1);
    s.relay.on("POST /v2/relay/items", |_| {
        (
            403,
            json!({"error": "this host key is revoked on this relay", "code": "REVOKED"}),
        )
    });
    let err = relay_client::pass(&s.client).await.unwrap_err();
    assert!(
        matches!(
            err,
            RelayError::Refused {
                standing: Standing::Revoked,
                ..
            }
        ),
        "{err}"
    );
    assert_eq!(s.row(&id).attempts, 0, "not the row's failure");
    let st = s.relay_state().unwrap();
    assert_eq!((st.state, st.status), (Standing::Revoked, Some(403)));
    let detail = st.detail.clone().unwrap();
    assert!(detail.contains("REVOKED"), "{detail}");
    assert!(detail.contains("for good"), "{detail}");
    assert!(!detail.contains("until it accepts"), "{detail}");
    assert_eq!(
        st.fix(&s.url()).as_deref(),
        Some(relay_trust::REVOKED_FIX),
        "revocation is for good: no command can undo it"
    );
    assert!(relay_trust::REVOKED_FIX.contains("can never use this relay again"));
    // The relay no longer shows `you` and refuses the enrolment: no attempt inside the pause.
    t.enrolled.store(false, Ordering::SeqCst);
    s.relay.on("POST /v1/relay/enrol", |_| {
        (403, json!({"error": "revoked", "code": "REVOKED"}))
    });
    for _ in 0..3 {
        assert!(matches!(
            relay_client::pass(&s.client).await,
            Err(RelayError::Refused {
                standing: Standing::Revoked,
                ..
            })
        ));
    }
    assert!(s.relay.seen("POST /v1/relay/challenge").is_empty());
    s.clock.advance(60_000);
    assert!(matches!(
        relay_client::pass(&s.client).await,
        Err(RelayError::Refused {
            standing: Standing::Revoked,
            ..
        })
    ));
    assert_eq!(s.relay.seen("POST /v1/relay/enrol").len(), 1);
    let url = s.url();
    let b = s
        .store
        .mailbox
        .with(|c| relay_trust::backoff(c, &url))
        .unwrap()
        .unwrap();
    assert_eq!(b.n, 2);
    assert_eq!(s.audits("relay.enrol_failed").len(), 1, "once per episode");
}

#[tokio::test]
async fn a_denied_host_is_denied_not_revoked_and_resumes_when_the_relay_takes_it_again() {
    use std::sync::atomic::{AtomicBool, Ordering};
    let s = Setup::new(true).await;
    let t = s.trusty();
    relay_client::pass(&s.client).await.unwrap();
    // The operator deny-lists this host: signed info no longer shows `you`, the enrolment is
    // refused with 403 DENIED.
    t.enrolled.store(false, Ordering::SeqCst);
    let denying = Arc::new(AtomicBool::new(true));
    let (d, enrolled) = (denying.clone(), t.enrolled.clone());
    s.relay.on("POST /v1/relay/enrol", move |_| {
        if d.load(Ordering::SeqCst) {
            return (
                403,
                json!({"error": "this host is denied on this relay\u{1b}[2J", "code": "DENIED"}),
            );
        }
        enrolled.store(true, Ordering::SeqCst);
        (200, json!({"ok": true}))
    });
    let err = relay_client::pass(&s.client).await.unwrap_err();
    assert!(
        matches!(
            err,
            RelayError::Refused {
                standing: Standing::Denied,
                ..
            }
        ),
        "{err}"
    );
    let st = s.relay_state().unwrap();
    assert_eq!((st.state, st.status), (Standing::Denied, Some(403)));
    assert_eq!(st.state.as_str(), "denied");
    let detail = st.detail.clone().unwrap();
    assert!(
        detail.contains("(DENIED: this host is denied on this relay\\u{1b}[2J)"),
        "the relay's words, escaped: {detail}"
    );
    assert!(
        !detail.contains("for good") && !detail.contains('\u{1b}'),
        "{detail}"
    );
    assert_eq!(st.fix(&s.url()).as_deref(), Some(relay_trust::DENIED_FIX));
    assert!(st.next_at.is_some());
    let failed = s.audits("relay.enrol_failed");
    assert_eq!(failed.len(), 1);
    assert_eq!(failed[0].detail["reason"], "denied");
    // Within the pause nothing is tried; the same standing is reported.
    assert!(matches!(
        relay_client::pass(&s.client).await,
        Err(RelayError::Refused {
            standing: Standing::Denied,
            ..
        })
    ));
    assert_eq!(s.relay.seen("POST /v1/relay/enrol").len(), 1);
    // The operator lifts the deny: after the pause the host enrols again and is ok.
    denying.store(false, Ordering::SeqCst);
    s.clock.advance(60_000);
    relay_client::pass(&s.client).await.unwrap();
    assert_eq!(s.relay_state().unwrap().state, Standing::Ok);
}

#[test]
fn a_403_is_revoked_only_with_the_code_revoked() {
    let status = |code: Option<&str>| RelayError::Status {
        status: 403,
        error: "no".into(),
        body: code.map(|c| {
            Box::new(agentmbx_protocol::wire::ErrorBody {
                error: "no".into(),
                code: c.into(),
                epoch: None,
                head_seq: None,
                retry_after: None,
            })
        }),
    };
    assert_eq!(
        relay_client::session::refusal_of(&status(Some("REVOKED"))).0,
        Standing::Revoked
    );
    for code in [Some("DENIED"), Some("SOMETHING_ELSE"), None] {
        let (standing, detail) = relay_client::session::refusal_of(&status(code));
        assert_eq!(standing, Standing::Denied, "{code:?}");
        assert!(detail.contains("for now"), "{detail}");
    }
    assert!(relay_client::session::refusal_of(&status(None))
        .1
        .contains("(403: no)"));
}

#[tokio::test]
async fn an_enrolment_refusal_is_enrol_failed_and_audited() {
    use std::sync::atomic::Ordering;
    let s = Setup::new(true).await;
    let t = s.trusty();
    t.enrolled.store(false, Ordering::SeqCst);
    s.relay.on("POST /v1/relay/enrol", |_| {
        (409, json!({"error": "name taken", "code": "NAME_TAKEN"}))
    });
    for _ in 0..2 {
        let err = s.client.open_session().await.unwrap_err();
        assert_eq!(err.status(), Some(409), "{err}");
    }
    let st = s.relay_state().unwrap();
    assert_eq!((st.state, st.status), (Standing::EnrolFailed, Some(409)));
    assert_eq!(s.audits("relay.enrol_failed").len(), 1, "once per status");
}
