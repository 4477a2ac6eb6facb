//! Unit tests of `POST /v1/rotate`: matching and refusals, the rate limit and the body cap;
//! mail and receipts signed by a retired key are in [`retired_keys`].

use super::*;
use std::sync::Mutex;

use agentmbx_protocol::clock::ManualClock;
use agentmbx_protocol::keys::{EncKey, HostKey};
use agentmbx_protocol::records::Receipt;
use agentmbx_protocol::rotation::SignedRotation;
use serde_json::json;

use crate::identity::Identity;
use crate::mailbox::outbox::{self, Accepted};
use crate::mailbox::peers;
use crate::node::{receipts, receive};
use crate::testutil::{self, Store, T0};
use crate::transport::lan::client::{LanClient, LanError};
use crate::transport::lan::server::serve;
use crate::transport::lan::LanState;

/// `beta` serving its LAN routes; it pinned `alpha` (old keys, enc key known).
struct Fx {
    addr: String,
    state: SharedLan,
    store: Store,
    clock: Arc<ManualClock>,
    beta: Arc<Identity>,
    alpha_old: Identity,
    alpha_new: Identity,
    _stop: tokio::sync::oneshot::Sender<()>,
}

fn with_keys(host: &str, host_key: HostKey, enc_key: EncKey) -> Identity {
    Identity {
        host_key,
        enc_key,
        ..testutil::identity(host)
    }
}

fn same(i: &Identity) -> Identity {
    with_keys(
        i.host.as_str(),
        HostKey::from_seed_b64(&i.host_key.seed_b64_secret()).unwrap(),
        EncKey::from_private_b64(&i.enc_key.private_b64_secret()).unwrap(),
    )
}

async fn fx() -> Fx {
    crate::install_tls_provider();
    let beta = Arc::new(testutil::identity("beta"));
    let alpha_old = testutil::identity("alpha");
    let alpha_new = testutil::identity("alpha");
    let store = testutil::store();
    store.add_peer(&alpha_old, true);
    let clock = testutil::clock();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let state = Arc::new(LanState {
        ident: beta.clone(),
        mailbox: store.mailbox.clone(),
        clock: clock.clone(),
        version: "test",
        started_at: agentmbx_protocol::time::iso_ms(T0),
        port: listener.local_addr().unwrap().port(),
        advertise: String::new(),
        self_addrs: Vec::new(),
        wake: Arc::new(tokio::sync::Notify::new()),
        pairing: crate::pairing::PairingMemory::default(),
        instance: Default::default(),
    });
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    tokio::spawn(serve(listener, state.clone(), async move {
        let _ = stopped.await;
    }));
    Fx {
        addr,
        state,
        store,
        clock,
        beta,
        alpha_old,
        alpha_new,
        _stop: stop,
    }
}

impl Fx {
    /// alpha's rotation from its old keys to its new ones, issued at `T0`.
    fn rotation(&self) -> Value {
        let r = SignedRotation::sign(
            "alpha",
            &self.alpha_old.host_key,
            &self.alpha_new.host_key,
            &self.alpha_new.enc_key.public(),
            T0,
        );
        serde_json::to_value(r).unwrap()
    }

    async fn post_raw(&self, body: Vec<u8>) -> (u16, Option<String>, Value) {
        let res = reqwest::Client::new()
            .post(format!("http://{}/v1/rotate", self.addr))
            .header("content-type", "application/json")
            .body(body)
            .send()
            .await
            .unwrap();
        let status = res.status().as_u16();
        let retry = res
            .headers()
            .get("retry-after")
            .map(|v| v.to_str().unwrap().to_string());
        (status, retry, res.json().await.unwrap_or(Value::Null))
    }

    async fn announce(&self, records: &[Value]) -> Vec<String> {
        let body = serde_json::to_vec(&json!({ "records": records })).unwrap();
        let (status, _, answer) = self.post_raw(body).await;
        assert_eq!(status, 200, "{answer}");
        serde_json::from_value(answer["results"].clone()).unwrap()
    }

    fn alpha(&self) -> (String, Option<String>, Option<i64>, Vec<String>) {
        let c = self.store.fresh_conn();
        let p = peers::by_name(&c, "alpha").unwrap().unwrap();
        (
            p.pubkey,
            p.enc_pub,
            p.enc_ad_iat,
            peers::prev_keys(&c, "alpha").unwrap(),
        )
    }

    fn audits(&self) -> i64 {
        self.store
            .scalar("SELECT COUNT(*) FROM audit WHERE event = 'peer.rotated'")
    }

    fn send_to_alpha(&self, id: &str) {
        self.store
            .send(&self.beta, "bob", &["ann@alpha"], id, id, T0)
            .unwrap();
    }
}

fn b64(i: &Identity) -> String {
    i.host_key.public().to_b64()
}

#[tokio::test]
async fn an_announced_rotation_moves_the_pin_and_retargets_the_mail_still_waiting() {
    let f = fx().await;
    let mut ids = testutil::ids();
    let (waiting, sealed, accepted, done) =
        (ids.next(T0), ids.next(T0), ids.next(T0), ids.next(T0));
    for id in [&waiting, &sealed, &accepted, &done] {
        f.send_to_alpha(id);
    }
    f.store
        .mailbox
        .with(|c| {
            // Backed off for an hour, with wire bytes sealed for the old target.
            c.execute(
                "UPDATE outbox SET next_at = ?2 WHERE msg_id = ?1",
                rusqlite::params![waiting, T0 + 3_600_000],
            )?;
            outbox::set_wire(c, &sealed, "alpha", b"sealed-for-old", "h1")?;
            outbox::set_wire(c, &accepted, "alpha", b"accepted-for-old", "h2")?;
            let a = Accepted {
                relay: "http://relay",
                epoch: "e",
                seq: 7,
                accept: "{}",
                sig: "s",
                accepted_at: T0,
                deadline_at: T0 + 1,
            };
            assert!(outbox::settle_accepted(c, &accepted, "alpha", &a, T0)?);
            assert!(outbox::delivered_lan(c, &done, "alpha", T0)?);
            Ok(())
        })
        .unwrap();
    f.clock.advance(1_000);
    let woken = f.state.wake.clone();
    let woke = tokio::spawn(async move {
        tokio::time::timeout(Duration::from_secs(10), woken.notified())
            .await
            .is_ok()
    });
    tokio::task::yield_now().await;

    let record = f.rotation();
    assert_eq!(
        f.announce(std::slice::from_ref(&record)).await,
        vec!["rotated"]
    );
    assert!(woke.await.unwrap(), "the sender loops were woken");
    let (pin, enc, enc_iat, prev) = f.alpha();
    assert_eq!(pin, b64(&f.alpha_new));
    assert_eq!(enc, Some(f.alpha_new.enc_key.public().to_b64()));
    assert_eq!(
        enc_iat,
        Some(T0),
        "the enc-ad guard restarts at the rotation"
    );
    assert_eq!(prev, vec![b64(&f.alpha_old)]);

    type Row = (String, String, String, Option<Vec<u8>>, i64);
    let rows: Vec<Row> = f
        .store
        .fresh_conn()
        .prepare("SELECT msg_id, state, target_pubkey, wire, next_at FROM outbox ORDER BY msg_id")
        .unwrap()
        .query_map([], |r| {
            Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?, r.get(4)?))
        })
        .unwrap()
        .collect::<Result<_, _>>()
        .unwrap();
    let row = |id: &str| rows.iter().find(|r| r.0 == id).unwrap().clone();
    let now = T0 + 1_000;
    // Waiting rows target the new key, due now, to be sealed again.
    assert_eq!(row(&waiting).2, b64(&f.alpha_new));
    assert_eq!((row(&waiting).3, row(&waiting).4), (None, now));
    assert_eq!(row(&sealed).2, b64(&f.alpha_new));
    assert_eq!(row(&sealed).3, None, "bytes sealed for the old key dropped");
    assert_eq!(row(&sealed).4, T0, "a row already due stays due");
    // A relay-accepted row keeps its target and bytes; a settled one is untouched.
    assert_eq!(row(&accepted).1, "relay-accepted");
    assert_eq!(row(&accepted).2, b64(&f.alpha_old));
    assert_eq!(row(&accepted).3.as_deref(), Some(&b"accepted-for-old"[..]));
    assert_eq!(
        (row(&done).1.as_str(), row(&done).2.clone()),
        ("delivered", b64(&f.alpha_old))
    );

    // Audited once, with fingerprints only.
    assert_eq!(f.audits(), 1);
    let detail: String = f.store.scalar("SELECT detail FROM audit");
    let detail: Value = serde_json::from_str(&detail).unwrap();
    assert_eq!(detail["host"], "alpha");
    assert_eq!(detail["from"], f.alpha_old.host_key.public().fingerprint());
    assert_eq!(detail["to"], f.alpha_new.host_key.public().fingerprint());
    assert_eq!(detail["outbox_retargeted"], 2);
    let text = detail.to_string();
    assert!(!text.contains(&b64(&f.alpha_old)) && !text.contains(&b64(&f.alpha_new)));

    // The same record again: already current, nothing changes.
    assert_eq!(f.announce(&[record]).await, vec!["current"]);
    assert_eq!(f.alpha().0, b64(&f.alpha_new));
    assert_eq!(f.audits(), 1);
}

#[tokio::test]
async fn each_refusal_has_its_reason_and_changes_nothing() {
    let f = fx().await;
    let good = f.rotation();
    let mut bad_old = good.clone();
    bad_old["old_sig"] = good["new_sig"].clone();
    let mut bad_new = good.clone();
    bad_new["new_sig"] = good["old_sig"].clone();
    let same_key = serde_json::to_value(SignedRotation::sign(
        "alpha",
        &f.alpha_old.host_key,
        &f.alpha_old.host_key,
        &f.alpha_new.enc_key.public(),
        T0,
    ))
    .unwrap();
    let stranger = HostKey::generate();
    let not_pinned = serde_json::to_value(SignedRotation::sign(
        "alpha",
        &stranger,
        &f.alpha_new.host_key,
        &f.alpha_new.enc_key.public(),
        T0,
    ))
    .unwrap();
    let unknown_host = serde_json::to_value(SignedRotation::sign(
        "gamma",
        &stranger,
        &HostKey::generate(),
        &EncKey::generate().public(),
        T0,
    ))
    .unwrap();
    let wrong_host = serde_json::to_value(SignedRotation::sign(
        "gamma",
        &f.alpha_old.host_key,
        &f.alpha_new.host_key,
        &f.alpha_new.enc_key.public(),
        T0,
    ))
    .unwrap();
    let mut extra_field = good.clone();
    extra_field["rec"]["note"] = "x".into();

    let results = f
        .announce(&[
            bad_old,
            bad_new,
            same_key,
            not_pinned,
            unknown_host,
            wrong_host,
            extra_field,
            json!({}),
            json!("rotated"),
        ])
        .await;
    assert_eq!(
        results,
        vec![
            "rejected:rotation is not signed by the pinned host key",
            "rejected:rotation is not signed by the new host key",
            "rejected:rotation keeps the same host key",
            "rejected:rotation does not start from the pinned host key",
            "rejected:host not paired",
            format!("rejected:{WRONG_HOST}").as_str(),
            "rejected:not a rotation record",
            "rejected:not a rotation record",
            "rejected:not a rotation record",
        ]
    );
    let (pin, enc, _, prev) = f.alpha();
    assert_eq!(pin, b64(&f.alpha_old));
    assert_eq!(enc, Some(f.alpha_old.enc_key.public().to_b64()));
    assert!(prev.is_empty());
    assert_eq!(f.audits(), 0);

    // Records are taken in order: a refusal does not stop the good one after it.
    let mut bad_old = good.clone();
    bad_old["old_sig"] = good["new_sig"].clone();
    assert_eq!(
        f.announce(&[bad_old, good.clone(), good]).await,
        vec![
            "rejected:rotation is not signed by the pinned host key",
            "rotated",
            "current"
        ]
    );
}

#[tokio::test]
async fn a_new_key_pinned_as_another_peer_is_refused() {
    let f = fx().await;
    let gamma = testutil::identity("gamma");
    f.store.add_peer(&gamma, false);
    let record = serde_json::to_value(SignedRotation::sign(
        "alpha",
        &f.alpha_old.host_key,
        &gamma.host_key,
        &gamma.enc_key.public(),
        T0,
    ))
    .unwrap();
    assert_eq!(
        f.announce(&[record]).await,
        vec![format!("rejected:{NEW_KEY_TAKEN}")]
    );
    assert_eq!(f.alpha().0, b64(&f.alpha_old));
    assert_eq!(f.audits(), 0);
}

#[tokio::test]
async fn a_rotation_back_to_a_retired_key_is_refused_so_old_records_cannot_be_replayed() {
    let f = fx().await;
    let forward = f.rotation();
    assert_eq!(
        f.announce(std::slice::from_ref(&forward)).await,
        vec!["rotated"]
    );
    // Back to the retired key, signed by both keys (the peer itself, or whoever holds the
    // old key): refused, the pin stays.
    let back = serde_json::to_value(SignedRotation::sign(
        "alpha",
        &f.alpha_new.host_key,
        &f.alpha_old.host_key,
        &f.alpha_old.enc_key.public(),
        T0 + 1,
    ))
    .unwrap();
    assert_eq!(
        f.announce(std::slice::from_ref(&back)).await,
        vec![format!("rejected:{}", peers::ROTATION_TO_RETIRED)]
    );
    let (pin, enc, _, prev) = f.alpha();
    assert_eq!(pin, b64(&f.alpha_new));
    assert_eq!(enc, Some(f.alpha_new.enc_key.public().to_b64()));
    assert_eq!(prev, vec![b64(&f.alpha_old)]);
    // Replaying the public records in any order never moves the pin again.
    assert_eq!(
        f.announce(&[forward.clone(), back.clone(), forward, back])
            .await,
        vec![
            "current".to_string(),
            format!("rejected:{}", peers::ROTATION_TO_RETIRED),
            "current".to_string(),
            format!("rejected:{}", peers::ROTATION_TO_RETIRED),
        ]
    );
    assert_eq!(f.alpha().0, b64(&f.alpha_new));
    assert_eq!(f.audits(), 1);
}

#[tokio::test]
async fn a_record_dated_more_than_5_minutes_ahead_is_refused() {
    use agentmbx_protocol::clock::Clock as _;
    let f = fx().await;
    let now = f.clock.now_ms();
    let at = |iat: i64| {
        serde_json::to_value(SignedRotation::sign(
            "alpha",
            &f.alpha_old.host_key,
            &f.alpha_new.host_key,
            &f.alpha_new.enc_key.public(),
            iat,
        ))
        .unwrap()
    };
    let skew = agentmbx_protocol::rotation::FUTURE_SKEW_MS;
    let mut no_ms = at(now);
    no_ms["rec"]["iat"] = "2026-01-01T00:00:00Z".into();
    assert_eq!(
        f.announce(&[at(now + skew + 1), no_ms]).await,
        vec![
            "rejected:rotation is dated more than 5 minutes ahead",
            "rejected:rotation iat is not an ISO time with milliseconds",
        ]
    );
    assert_eq!(f.alpha().0, b64(&f.alpha_old));
    assert_eq!(f.announce(&[at(now + skew)]).await, vec!["rotated"]);
}

/// Log lines written while `f` runs on this thread (the server tasks of a current-thread
/// test runtime run here too).
#[derive(Clone, Default)]
struct Captured(Arc<Mutex<Vec<u8>>>);

impl std::io::Write for Captured {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl Captured {
    fn lines(&self, level: &str) -> Vec<String> {
        String::from_utf8_lossy(&self.0.lock().unwrap())
            .lines()
            .filter(|l| l.contains(level) && l.contains("key rotation records refused"))
            .map(str::to_owned)
            .collect()
    }
}

#[tokio::test]
async fn refused_records_are_logged_as_one_line_per_request_and_warned_once_a_minute() {
    let log = Captured::default();
    let writer = log.clone();
    let subscriber = tracing_subscriber::fmt()
        .with_max_level(tracing::Level::DEBUG)
        .with_ansi(false)
        .with_writer(move || writer.clone())
        .finish();
    let _guard = tracing::subscriber::set_default(subscriber);
    let f = fx().await;
    let flood = vec![json!({}); MAX_RECORDS_PER_ANNOUNCE];
    for _ in 0..3 {
        assert_eq!(f.announce(&flood).await.len(), MAX_RECORDS_PER_ANNOUNCE);
    }
    let warned = log.lines("WARN");
    assert_eq!(warned.len(), 1, "{warned:#?}");
    assert!(warned[0].contains("refused=50"), "{}", warned[0]);
    assert!(
        warned[0].contains("first_reason=not a rotation record"),
        "{}",
        warned[0]
    );
    assert!(warned[0].contains("client=127.0.0.1"), "{}", warned[0]);
    assert_eq!(log.lines("DEBUG").len(), 2, "the other requests, at debug");
    // A minute later the address is warned about again.
    f.clock.advance(REFUSAL_WARN_EVERY_MS);
    f.announce(&flood).await;
    assert_eq!(log.lines("WARN").len(), 2);
}

#[tokio::test]
async fn a_chain_of_rotations_is_followed_in_order_and_its_steps_are_current_after() {
    let f = fx().await;
    let mid = testutil::identity("alpha");
    let step = |from: &Identity, to: &Identity| {
        serde_json::to_value(SignedRotation::sign(
            "alpha",
            &from.host_key,
            &to.host_key,
            &to.enc_key.public(),
            T0,
        ))
        .unwrap()
    };
    let first = step(&f.alpha_old, &mid);
    let second = step(&mid, &f.alpha_new);
    // Out of order, the second step does not start from the pin.
    assert_eq!(
        f.announce(&[second.clone(), first.clone()]).await,
        vec![
            "rejected:rotation does not start from the pinned host key",
            "rotated"
        ]
    );
    assert_eq!(
        f.announce(&[first.clone(), second.clone()]).await,
        vec!["current", "rotated"]
    );
    let (pin, _, _, prev) = f.alpha();
    assert_eq!(pin, b64(&f.alpha_new));
    assert_eq!(prev, vec![b64(&f.alpha_old), b64(&mid)]);
    // The whole log announced again (a lost answer): every step is current.
    assert_eq!(
        f.announce(&[first, second]).await,
        vec!["current", "current"]
    );
    assert_eq!(f.audits(), 2);
}

#[tokio::test]
async fn batches_over_50_records_and_bodies_that_are_not_batches_are_refused() {
    let f = fx().await;
    let fifty = vec![json!({}); MAX_RECORDS_PER_ANNOUNCE];
    let results = f.announce(&fifty).await;
    assert_eq!(results.len(), 50);
    assert!(results
        .iter()
        .all(|r| r == "rejected:not a rotation record"));

    let mut fifty_one = fifty.clone();
    fifty_one[50 - 1] = f.rotation();
    fifty_one.push(f.rotation());
    let body = serde_json::to_vec(&json!({ "records": fifty_one })).unwrap();
    let (status, _, answer) = f.post_raw(body).await;
    assert_eq!((status, answer), (400, json!({"error": "bad batch"})));
    for body in [
        &b"{\"records\":{}}"[..],
        b"[]",
        b"{}",
        b"{\"records\":null}",
    ] {
        let (status, _, answer) = f.post_raw(body.to_vec()).await;
        assert_eq!((status, answer), (400, json!({"error": "bad batch"})));
    }
    let (status, _, answer) = f.post_raw(b"{not json".to_vec()).await;
    assert_eq!((status, answer), (400, json!({"error": "bad JSON body"})));
    // Nothing of the refused batches was applied.
    assert_eq!(f.alpha().0, b64(&f.alpha_old));
}

#[tokio::test]
async fn the_body_cap_holds_at_64_kib() {
    let f = fx().await;
    let frame = serde_json::to_vec(&json!({ "records": [f.rotation()] })).unwrap();
    let pad = |n: usize| {
        let mut b = frame.clone();
        b.resize(n, b' ');
        b
    };
    let (status, _, answer) = f.post_raw(pad(MAX_ROTATE_BODY + 1)).await;
    assert_eq!(
        (status, answer),
        (413, json!({"error": "request body over 65536 bytes"}))
    );
    assert_eq!(f.alpha().0, b64(&f.alpha_old), "nothing applied");
    let (status, _, answer) = f.post_raw(pad(MAX_ROTATE_BODY)).await;
    assert_eq!((status, answer), (200, json!({"results": ["rotated"]})));
}

#[tokio::test]
async fn thirty_announcements_a_minute_per_address_then_429_with_retry_after() {
    let f = fx().await;
    for i in 0..ROTATE_REQS_PER_MIN {
        let (status, _, _) = f.post_raw(b"{\"records\":[]}".to_vec()).await;
        assert_eq!(status, 200, "request {i}");
    }
    let (status, retry, answer) = f.post_raw(b"{\"records\":[]}".to_vec()).await;
    assert_eq!((status, retry.as_deref()), (429, Some("2")));
    assert_eq!(answer, json!({"error": TOO_MANY}));
    // A refused request reads no body and applies nothing.
    let body = serde_json::to_vec(&json!({ "records": [f.rotation()] })).unwrap();
    assert_eq!(f.post_raw(body.clone()).await.0, 429);
    assert_eq!(f.alpha().0, b64(&f.alpha_old));
    // One more every 2 s.
    f.clock.advance(2_000);
    assert_eq!(f.post_raw(body).await.0, 200);
    assert_eq!(f.post_raw(b"{\"records\":[]}".to_vec()).await.0, 429);
    // After a minute the whole budget is back.
    f.clock.advance(60_000);
    for _ in 0..ROTATE_REQS_PER_MIN {
        assert_eq!(f.post_raw(b"{\"records\":[]}".to_vec()).await.0, 200);
    }
}

#[test]
fn the_rate_table_stays_bounded_under_a_flood_of_addresses() {
    let clock = testutil::clock();
    let limiter = AddressLimiter::new(clock.clone(), ROTATE_REQS_PER_MIN, MAX_ROTATE_CLIENTS);
    let addr = |i: u32| IpAddr::V4(Ipv4Addr::from(0x0a00_0000 + i));
    // One address uses up its budget.
    for _ in 0..ROTATE_REQS_PER_MIN {
        assert!(limiter.check(addr(0)).is_ok());
    }
    assert_eq!(limiter.check(addr(0)), Err(Duration::from_millis(2_000)));
    // The same address written as IPv4-mapped IPv6 is the same client.
    let mapped = match addr(0) {
        IpAddr::V4(v4) => IpAddr::V6(v4.to_ipv6_mapped()),
        v6 => v6,
    };
    assert!(limiter.check(mapped).is_err());
    // A flood of distinct addresses, each allowed, never grows the table past the cap.
    for i in 1..=5_000 {
        assert!(limiter.check(addr(i)).is_ok(), "address {i}");
        assert!(limiter.len() <= MAX_ROTATE_CLIENTS);
    }
    assert_eq!(limiter.len(), MAX_ROTATE_CLIENTS);
    // The table at its cap: addresses whose budget is full again make room first.
    clock.advance(60_000);
    assert!(limiter.check(addr(9_999)).is_ok());
    assert_eq!(limiter.len(), 1);
}

mod retired_keys;
