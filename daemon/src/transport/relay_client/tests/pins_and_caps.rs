//! The pin a running client honours after `relay set --key <fp>` made while the relay was
//! unreachable, the enrolment backoff across passes, and the size cap of pull pages.

use std::sync::atomic::Ordering;

use super::*;

#[tokio::test]
async fn a_running_client_trusts_only_the_key_named_while_the_relay_was_unreachable() {
    let s = Setup::new(true).await;
    let t = s.trusty();
    let wake = Arc::new(tokio::sync::Notify::new());
    let (stop, stopped) = tokio::sync::watch::channel(false);
    let task = tokio::spawn(super::super::run(
        s.client.clone(),
        std::time::Duration::from_millis(50),
        wake.clone(),
        stopped,
    ));
    wait_for("a first session", || {
        s.relay_state().is_some_and(|st| st.state == Standing::Ok)
    })
    .await;
    // The owner names a new key while the relay cannot be reached (what `relay set <url> --key
    // <fp>` writes then): the stored pin is gone, only the fingerprint is expected.
    let new = HostKey::generate();
    let (url, fp) = (s.url(), new.public().fingerprint());
    let f = fp.clone();
    s.store
        .mailbox
        .with(|c| relay_trust::confirm_key(c, &url, None, Some(&f), T0))
        .unwrap();
    // The relay comes back with the old key: the key in memory is no longer trusted, so mail
    // waits and nothing but info is asked.
    wait_for("the mismatch with the expected key", || {
        s.relay_state()
            .is_some_and(|st| st.state == Standing::KeyMismatch)
    })
    .await;
    // (A pass under way when the owner confirmed has ended: the loop checks the pin first.)
    let seen_before = s.routes().len();
    let id = s.send_to_peer(ID1);
    wake.notify_one();
    wait_for("three more looks at the relay", || {
        s.routes()[seen_before..]
            .iter()
            .filter(|r| *r == "GET /v2/relay/info")
            .count()
            >= 3
    })
    .await;
    let after = s.routes()[seen_before..].to_vec();
    assert!(
        after.iter().all(|r| r == "GET /v2/relay/info"),
        "only info while the served key is not the expected one: {after:?}"
    );
    assert_eq!(s.row(&id).state, "pending");
    assert_eq!(s.row(&id).attempts, 0);
    let st = s.relay_state().unwrap();
    assert_eq!(st.pinned_fp.as_deref(), Some(fp.as_str()));
    assert_eq!(st.relay_fp, Some(s.relay.key.public().fingerprint()));
    let changed = s.audits("relay.key_changed");
    assert_eq!(changed.len(), 1, "{changed:?}");
    assert_eq!(changed[0].detail["expected"], fp);
    // The relay serves the named key: pinned, expectation gone, mail flows, accepts signed by
    // the new key count.
    *t.served.lock().unwrap() = new.clone();
    wake.notify_one();
    wait_for("the push through the named key", || {
        s.row(&id).state == "relay-accepted"
    })
    .await;
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
    assert_eq!((k, e), (Some(new.public().to_b64()), None));
    assert_eq!(
        s.audits("relay.enrolled")[0].detail["relay_key"],
        new.public().fingerprint()
    );
    stop.send(true).unwrap();
    tokio::time::timeout(std::time::Duration::from_secs(10), task)
        .await
        .expect("the loop stops")
        .unwrap();
}

#[tokio::test]
async fn an_expected_key_is_checked_before_any_pass_even_when_it_is_the_one_in_memory() {
    let s = Setup::new(true).await;
    let _t = s.trusty();
    let url = s.url();
    let fp = s.relay.key.public().fingerprint();
    let f = fp.clone();
    s.store
        .mailbox
        .with(|c| relay_trust::confirm_key(c, &url, None, Some(&f), T0))
        .unwrap();
    // Unreachable: no pass, the state says so, the expectation stays.
    let closed = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        format!("http://{}", l.local_addr().unwrap())
    };
    let mut away = Setup::client_for(&closed, &s.relay.key, &s.me, &s.store, &s.clock);
    let f = fp.clone();
    s.store
        .mailbox
        .with(|c| relay_trust::confirm_key(c, &closed, None, Some(&f), T0))
        .unwrap();
    let e = away.reload_pin().await.unwrap_err();
    assert!(matches!(e, RelayError::Unreachable(_)), "{e}");
    let st = s
        .store
        .mailbox
        .with(|c| relay_trust::state(c, &closed))
        .unwrap()
        .unwrap();
    assert_eq!(st.state, Standing::Unreachable);
    // The detail (`relay info`: `unreachable since …: <detail>`) is the cause alone, in our
    // words: it does not repeat "unreachable" nor carry the OS's text.
    assert_eq!(st.detail.as_deref(), Some("connection refused"));
    // Reachable and serving it: pinned.
    let mut c = s.client.clone();
    c.reload_pin().await.unwrap();
    assert_eq!(c.relay_key, s.relay.key.public());
    let k = s
        .store
        .mailbox
        .with(|c| relay_state::kv_get(c, &relay_trust::key_kv(&url)))
        .unwrap();
    assert_eq!(k, Some(s.relay.key.public().to_b64()));
}

#[tokio::test]
async fn a_401_after_each_fresh_enrolment_doubles_the_pause_across_passes() {
    let s = Setup::new(true).await;
    let t = s.trusty();
    // Every push is refused as not enrolled, and the relay forgets the enrolment each time;
    // enrolment and the enc-key ad are accepted.
    let refusing = Arc::new(std::sync::atomic::AtomicBool::new(true));
    let inner = s
        .relay
        .state
        .handlers
        .lock()
        .unwrap()
        .remove("POST /v2/relay/items")
        .unwrap();
    let inner = Arc::new(Mutex::new(inner));
    let (r, enrolled) = (refusing.clone(), t.enrolled.clone());
    s.relay.on("POST /v2/relay/items", move |req| {
        if r.load(Ordering::SeqCst) {
            enrolled.store(false, Ordering::SeqCst);
            return (
                401,
                json!({"error": "not enrolled", "code": "NOT_ENROLLED"}),
            );
        }
        (inner.lock().unwrap())(req)
    });
    let id = s.send_to_peer(ID1);
    let refused = |e: RelayError| match e {
        RelayError::Refused { retry_at_ms, .. } => retry_at_ms,
        e => panic!("expected a refusal, got {e}"),
    };
    // First pass: the 401 after the fresh enrolment of recovery: 1 minute.
    let at = refused(super::super::pass(&s.client).await.unwrap_err());
    assert_eq!(at, s.clock_now() + 60_000);
    let ads = s.relay.seen("POST /v2/relay/enc-key").len();
    assert!(ads >= 1, "the fresh enrolment's ad was accepted");
    // Second pass, after the pause: enrolled afresh, ad accepted, push refused again: the
    // pause doubles (the accepted ad did not end the episode).
    s.clock.advance(60_000);
    let at = refused(super::super::pass(&s.client).await.unwrap_err());
    assert_eq!(at, s.clock_now() + 120_000);
    assert!(s.relay.seen("POST /v2/relay/enc-key").len() > ads);
    let url = s.url();
    let backoff = |s: &Setup| {
        s.store
            .mailbox
            .with(|c| relay_trust::backoff(c, &url))
            .unwrap()
    };
    assert_eq!(backoff(&s).map(|b| b.n), Some(2));
    assert_eq!(s.audits("relay.enrol_failed").len(), 1, "once per episode");
    // The relay takes the host again: a whole pass succeeds and only that ends the episode.
    refusing.store(false, Ordering::SeqCst);
    s.clock.advance(120_000);
    super::super::pass(&s.client).await.unwrap();
    assert_eq!(s.row(&id).state, "relay-accepted");
    assert_eq!(backoff(&s), None);
}

/// Junk envelope items of `each` bytes from the peer (they go to quarantine when pulled).
fn junk_items(s: &Setup, n: usize, each: usize) -> Vec<PullItem> {
    let mut g = testutil::ids();
    (1..=n)
        .map(|seq| item(seq as i64, &g.next(T0), &s.peer_pub(), &vec![b'x'; each]))
        .collect()
}

#[tokio::test]
async fn a_pull_page_may_exceed_the_small_cap_but_not_the_page_cap() {
    use crate::transport::relay_client::answer::{pull_answer_cap, MAX_ANSWER};
    let s = Setup::new(true).await;
    let sess = session("e1");
    let cap = pull_answer_cap(&sess.limits);
    assert_eq!(cap, 16 * 1024 * 1024);
    // Three items of 768 KiB: a page of about 3 MiB, past the 1 MiB cap of other answers.
    let items = junk_items(&s, 3, 768 * 1024);
    assert!(page("e1", 3, &items, false).to_string().len() > MAX_ANSWER);
    let q = Arc::new(Mutex::new(Queue {
        epoch: "e1".into(),
        items,
        head_override: None,
    }));
    serve_queue(&s.relay, q.clone());
    let pass = s.client.pull_pass(&sess).await.unwrap();
    assert_eq!((pass.quarantined, pass.received_through), (3, 3));
    // A page past the page cap (17 such items: 17 MiB in base64) is refused unread: nothing
    // processed, the checkpoint stays.
    q.lock().unwrap().items = junk_items(&s, 20, 768 * 1024)
        .into_iter()
        .filter(|i| i.seq > 3)
        .collect();
    let e = s.client.pull_pass(&sess).await.unwrap_err();
    assert!(
        matches!(&e, RelayError::Malformed(m) if *m == format!("answer over {cap} bytes")),
        "{e}"
    );
    assert_eq!(s.position().received_through, 3);
}
