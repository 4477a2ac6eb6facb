//! The LAN server and client end to end: the real router served on 127.0.0.1:0, called by the
//! real [`LanClient`] of another identity (and by raw requests where a client of ours would
//! never send such a thing).

use std::net::IpAddr;
use std::sync::Arc;
use std::time::Duration;

use agentmbx_protocol::clock::ManualClock;
use agentmbx_protocol::envelope::{self, Draft};
use agentmbx_protocol::keys::{EncPublicKey, HostKey};
use agentmbx_protocol::seal;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use super::client::{LanClient, LanError};
use super::hop::candidate;
use super::server::{serve, MAX_BODY};
use super::{LanState, SharedLan};
use crate::identity::Identity;
use crate::mailbox::{peers, relay_state};
use crate::testutil::{self, Store, T0};

/// The LAN port the calling host announces in `x-mbx-port`.
const A_PORT: u16 = 7400;

/// Host `beta` serving its LAN routes; it has pinned `alpha`.
struct Beta {
    addr: String,
    state: SharedLan,
    store: Store,
    clock: Arc<ManualClock>,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    task: tokio::task::JoinHandle<std::io::Result<()>>,
}

impl Beta {
    fn count(&self, sql: &str) -> i64 {
        self.store.scalar(sql)
    }
}

/// `alpha` (the caller, with its own clock and store) and `beta` (serving).
struct Net {
    alpha: Arc<Identity>,
    alpha_clock: Arc<ManualClock>,
    alpha_store: Store,
    client: LanClient,
    beta_enc: EncPublicKey,
    beta: Beta,
}

async fn serve_beta(ident: Identity, store: Store) -> Beta {
    serve_host(Arc::new(ident), store, Vec::new()).await
}

/// `ident` serving the real LAN router on 127.0.0.1:0, signing `self_addrs` in its status.
async fn serve_host(ident: Arc<Identity>, store: Store, self_addrs: Vec<IpAddr>) -> Beta {
    let clock = testutil::clock();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let state = Arc::new(LanState {
        ident,
        mailbox: store.mailbox.clone(),
        clock: clock.clone(),
        version: "test",
        started_at: agentmbx_protocol::time::iso_ms(T0),
        port: listener.local_addr().unwrap().port(),
        advertise: String::new(),
        self_addrs,
        wake: Arc::new(tokio::sync::Notify::new()),
        pairing: crate::pairing::PairingMemory::default(),
        instance: Default::default(),
    });
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let task = tokio::spawn(serve(listener, state.clone(), async move {
        let _ = stopped.await;
    }));
    Beta {
        addr,
        state,
        store,
        clock,
        stop: Some(stop),
        task,
    }
}

async fn net() -> Net {
    crate::install_tls_provider();
    let alpha = Arc::new(testutil::identity("alpha"));
    let beta = testutil::identity("beta");
    let beta_enc = beta.enc_key.public();
    let alpha_store = testutil::store();
    alpha_store.add_peer(&beta, false);
    let store = testutil::store();
    store.add_peer(&alpha, false);
    // bob has a mailbox on beta: mail for bob@beta is delivered, not held as unclaimed.
    store.register("beta", &["bob"]);
    let beta = serve_beta(beta, store).await;
    let alpha_clock = testutil::clock();
    let client = LanClient::new(alpha.clone(), alpha_clock.clone(), A_PORT).unwrap();
    Net {
        alpha,
        alpha_clock,
        alpha_store,
        client,
        beta_enc,
        beta,
    }
}

impl Net {
    /// A client signing as `ident` (same clock and port as alpha's).
    fn client_as(&self, ident: Identity) -> LanClient {
        LanClient::new(Arc::new(ident), self.alpha_clock.clone(), A_PORT).unwrap()
    }

    /// A sealed envelope from `ann@alpha` to `bob@beta`.
    fn wire(&self, id: &str) -> Vec<u8> {
        testutil::sealed_wire(
            &self.alpha,
            &self.beta_enc,
            id,
            "ann@alpha",
            &["bob@beta"],
            "hello",
            T0,
        )
    }
}

fn status_of(e: LanError) -> (u16, String) {
    match e {
        LanError::Status { status, error } => (status, error),
        other => panic!("expected an HTTP error, got {other:?}"),
    }
}

fn results(r: &[super::client::EnvelopeResult]) -> Vec<&str> {
    r.iter().map(|x| x.result.as_str()).collect()
}

#[tokio::test]
async fn a_sealed_envelope_is_stored_once_and_a_tampered_one_nowhere() {
    let n = net().await;
    let mut ids = testutil::ids();
    let id = ids.next(T0);
    let wire = n.wire(&id);

    let r = n
        .client
        .post_envelopes(&n.beta.addr, std::slice::from_ref(&wire))
        .await
        .unwrap();
    assert_eq!(r.len(), 1);
    assert_eq!(
        (r[0].id.as_str(), r[0].result.as_str()),
        (id.as_str(), "accepted")
    );
    assert_eq!(
        n.beta.count(&format!(
            "SELECT COUNT(*) FROM messages WHERE id = '{id}' AND origin = 'alpha'"
        )),
        1
    );
    assert_eq!(
        n.beta.count(&format!(
            "SELECT COUNT(*) FROM deliveries WHERE msg_id = '{id}' AND agent = 'bob' AND state = 'new'"
        )),
        1
    );
    // The stored copy is the opened plaintext.
    assert_eq!(
        n.beta
            .store
            .scalar::<String>(&format!("SELECT body FROM messages WHERE id = '{id}'")),
        "secret body of hello"
    );

    // The same wire again: a duplicate, nothing more stored. The delivered receipt queued at
    // the first arrival was sent (dropped here); the repeat queues it again for the sender.
    assert_eq!(n.beta.count("SELECT COUNT(*) FROM receipt_outbox"), 1);
    n.beta
        .store
        .mailbox
        .with(|c| Ok(c.execute("DELETE FROM receipt_outbox", [])?))
        .unwrap();
    let r = n
        .client
        .post_envelopes(&n.beta.addr, std::slice::from_ref(&wire))
        .await
        .unwrap();
    assert_eq!(results(&r), ["duplicate"]);
    assert_eq!(n.beta.count("SELECT COUNT(*) FROM deliveries"), 1);
    assert_eq!(
        n.beta.count(
            "SELECT COUNT(*) FROM receipt_outbox WHERE state = 'delivered' AND host = 'alpha'"
        ),
        1
    );

    // The sealed ciphertext changed (both copies, so the shape still holds): bad signature.
    let id2 = ids.next(T0);
    let text = String::from_utf8(n.wire(&id2)).unwrap();
    let v: serde_json::Value = serde_json::from_str(&text).unwrap();
    let cipher = v["enc"]["body"].as_str().unwrap().to_string();
    let first = if cipher.starts_with('A') { "B" } else { "A" };
    let tampered_cipher = format!("{first}{}", &cipher[1..]);
    let tampered = text.replace(&cipher, &tampered_cipher).into_bytes();
    let r = n
        .client
        .post_envelopes(&n.beta.addr, &[tampered, wire])
        .await
        .unwrap();
    assert_eq!(results(&r), ["rejected:bad signature", "duplicate"]);
    assert_eq!(r[0].id, id2);
    assert_eq!(
        n.beta
            .count(&format!("SELECT COUNT(*) FROM messages WHERE id = '{id2}'")),
        0
    );
    assert_eq!(n.beta.count("SELECT COUNT(*) FROM messages"), 1);

    // /v1/envelopes is the same handler.
    let id3 = ids.next(T0);
    let body = format!(
        "{{\"envelopes\":[{}]}}",
        String::from_utf8(n.wire(&id3)).unwrap()
    );
    let answer = n
        .client
        .signed_post_json(&n.beta.addr, "/v1/envelopes", body.into_bytes())
        .await
        .unwrap();
    assert_eq!(
        answer,
        serde_json::json!({"results": [{"id": id3, "result": "accepted"}]})
    );
}

#[tokio::test]
async fn a_sender_address_with_a_newline_or_a_second_at_is_refused_and_stored_nowhere() {
    let n = net().await;
    let mut ids = testutil::ids();
    let mut wires = Vec::new();
    for from in ["ann\n@alpha", "ann@x@alpha"] {
        let draft = Draft {
            from: "ann@alpha".into(),
            to: vec!["bob@beta".into()],
            subject: "s".into(),
            body: "b".into(),
            ..Draft::default()
        };
        let mut plain = envelope::build(&draft, ids.next(T0), T0).unwrap();
        plain.from = from.into();
        let sealed = seal::seal_envelope(&plain, &n.beta_enc, "alpha", &n.alpha.host_key).unwrap();
        wires.push(sealed.wire_json().into_bytes());
    }
    let r = n.client.post_envelopes(&n.beta.addr, &wires).await.unwrap();
    assert_eq!(
        results(&r),
        ["rejected:bad sender address", "rejected:bad sender address"]
    );
    assert_eq!(n.beta.count("SELECT COUNT(*) FROM messages"), 0);
    assert_eq!(n.beta.count("SELECT COUNT(*) FROM deliveries"), 0);
    // Only beta's own registered agent: no sender joined the directory.
    assert_eq!(
        n.beta
            .count("SELECT COUNT(*) FROM agents WHERE host <> 'beta'"),
        0
    );
}

#[tokio::test]
async fn hop_refusals_answer_401_with_the_exact_texts() {
    let n = net().await;
    let wire = n.wire(&testutil::ids().next(T0));

    // alpha's name, another key.
    let forger = n.client_as(testutil::identity("alpha"));
    let e = forger
        .post_envelopes(&n.beta.addr, std::slice::from_ref(&wire))
        .await
        .unwrap_err();
    assert_eq!(status_of(e), (401, "bad hop signature".into()));

    // A host beta never paired with.
    let stranger = n.client_as(testutil::identity("gamma"));
    let e = stranger
        .post_envelopes(&n.beta.addr, std::slice::from_ref(&wire))
        .await
        .unwrap_err();
    assert_eq!(status_of(e), (401, "host not paired".into()));

    // Five minutes off is still fresh; a millisecond more is not (both directions).
    for (offset, fresh) in [
        (-300_000, true),
        (300_000, true),
        (-300_001, false),
        (300_001, false),
    ] {
        n.alpha_clock.set(T0 + offset);
        let got = n.client.get_enc_key(&n.beta.addr, &beta_peer(&n)).await;
        if fresh {
            got.unwrap();
        } else {
            assert_eq!(
                status_of(got.unwrap_err()),
                (401, "stale or bad hop timestamp (check clocks)".into())
            );
        }
    }
    n.alpha_clock.set(T0);

    // No hop headers at all: not paired (the empty name is nobody's).
    let raw = reqwest::Client::new()
        .post(format!("http://{}/v2/envelopes", n.beta.addr))
        .body("{\"envelopes\":[]}")
        .send()
        .await
        .unwrap();
    assert_eq!(raw.status().as_u16(), 401);
    assert_eq!(raw.text().await.unwrap(), r#"{"error":"host not paired"}"#);

    // A body that is not UTF-8 is refused before any signature check.
    let raw = reqwest::Client::new()
        .post(format!("http://{}/v2/envelopes", n.beta.addr))
        .header("x-mbx-host", "alpha")
        .body(vec![0xff, 0xfe])
        .send()
        .await
        .unwrap();
    assert_eq!(raw.status().as_u16(), 400);
    assert_eq!(
        raw.text().await.unwrap(),
        r#"{"error":"request body is not valid UTF-8"}"#
    );
    assert_eq!(n.beta.count("SELECT COUNT(*) FROM messages"), 0);
}

#[tokio::test]
async fn batches_over_200_and_bodies_over_4_mib_are_refused() {
    let n = net().await;
    let items = |k: usize| format!("{{\"envelopes\":[{}]}}", vec!["{}"; k].join(","));

    let e = n
        .client
        .signed_post_json(&n.beta.addr, "/v2/envelopes", items(201).into_bytes())
        .await
        .unwrap_err();
    assert_eq!(
        status_of(e),
        (
            400,
            "bad batch: envelopes must be an array of at most 200".into()
        )
    );
    // 200 is a batch: each item gets its own refusal (no id to echo).
    let answer = n
        .client
        .signed_post_json(&n.beta.addr, "/v2/envelopes", items(200).into_bytes())
        .await
        .unwrap();
    let list = answer["results"].as_array().unwrap();
    assert_eq!(list.len(), 200);
    assert_eq!(
        list[0],
        serde_json::json!({"result": "rejected:unsupported version"})
    );
    let e = n
        .client
        .signed_post_json(
            &n.beta.addr,
            "/v2/envelopes",
            b"{\"envelopes\":{}}".to_vec(),
        )
        .await
        .unwrap_err();
    assert_eq!(
        status_of(e),
        (
            400,
            "bad batch: envelopes must be an array of at most 200".into()
        )
    );
    let e = n
        .client
        .signed_post_json(&n.beta.addr, "/v2/envelopes", b"{\"envelopes\":".to_vec())
        .await
        .unwrap_err();
    assert_eq!(status_of(e), (400, "bad JSON body".into()));

    // Exactly 4 MiB passes the cap (and the hop covers all of it).
    let mut body = b"{\"envelopes\":[]}".to_vec();
    body.resize(MAX_BODY, b' ');
    let answer = n
        .client
        .signed_post_json(&n.beta.addr, "/v2/envelopes", body)
        .await
        .unwrap();
    assert_eq!(answer, serde_json::json!({"results": []}));

    // One byte more: 413 on the declared length.
    let mut body = b"{\"envelopes\":[]}".to_vec();
    body.resize(MAX_BODY + 1, b' ');
    let e = n
        .client
        .signed_post_json(&n.beta.addr, "/v2/envelopes", body)
        .await
        .unwrap_err();
    assert_eq!(
        status_of(e),
        (413, "request body over 4194304 bytes".into())
    );

    // And while streaming, when no length is declared (chunked).
    let answer = chunked_post(&n.beta.addr, "/v2/envelopes", MAX_BODY + 1).await;
    assert!(answer.starts_with("HTTP/1.1 413 "), "{answer}");
    assert!(
        answer.ends_with(r#"{"error":"request body over 4194304 bytes"}"#),
        "{answer}"
    );
}

/// POSTs `size` bytes in 64 KiB chunks with `Transfer-Encoding: chunked`; the raw answer.
async fn chunked_post(addr: &str, path: &str, size: usize) -> String {
    let mut tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
    let head = format!(
        "POST {path} HTTP/1.1\r\nhost: {addr}\r\ntransfer-encoding: chunked\r\nconnection: close\r\n\r\n"
    );
    tcp.write_all(head.as_bytes()).await.unwrap();
    let chunk = vec![b' '; 64 * 1024];
    let mut left = size;
    while left > 0 {
        let k = left.min(chunk.len());
        let frame = format!("{k:x}\r\n");
        // The server may answer and stop reading once over the cap.
        if tcp.write_all(frame.as_bytes()).await.is_err()
            || tcp.write_all(&chunk[..k]).await.is_err()
            || tcp.write_all(b"\r\n").await.is_err()
        {
            break;
        }
        left -= k;
    }
    let _ = tcp.write_all(b"0\r\n\r\n").await;
    let mut answer = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(10), tcp.read_to_end(&mut answer)).await;
    String::from_utf8_lossy(&answer).into_owned()
}

#[tokio::test]
async fn more_than_600_signed_requests_a_minute_from_one_peer_answer_429() {
    let n = net().await;
    let peer = beta_peer(&n);
    for i in 0..600 {
        n.client
            .get_enc_key(&n.beta.addr, &peer)
            .await
            .unwrap_or_else(|e| panic!("request {i}: {e}"));
    }
    let e = n.client.get_enc_key(&n.beta.addr, &peer).await.unwrap_err();
    assert_eq!(
        status_of(e),
        (
            429,
            "rate limit: over 600 requests a minute from alpha; retry later".into()
        )
    );
    // Another peer has its own budget.
    let delta = testutil::identity("delta");
    n.beta.store.add_peer(&delta, false);
    let other = n.client_as(delta);
    other.get_agents(&n.beta.addr).await.unwrap();
    // The budget refills evenly: 100 ms buys one more request.
    n.beta.clock.advance(100);
    n.client.get_enc_key(&n.beta.addr, &peer).await.unwrap();
    let e = n.client.get_enc_key(&n.beta.addr, &peer).await.unwrap_err();
    assert_eq!(status_of(e).0, 429);
}

/// beta as alpha pinned it.
fn beta_peer(n: &Net) -> peers::Peer {
    n.alpha_store
        .mailbox
        .with(|c| peers::by_name(c, "beta"))
        .unwrap()
        .unwrap()
}

#[tokio::test]
async fn the_enc_key_answer_verifies_against_the_pinned_key_only() {
    let n = net().await;
    let peer = beta_peer(&n);
    let enc = n.client.get_enc_key(&n.beta.addr, &peer).await.unwrap();
    assert_eq!(enc, n.beta_enc.to_b64());

    // Pinned to another key under the same name: the answer does not verify.
    let wrong = peers::Peer {
        pubkey: HostKey::generate().public().to_b64(),
        ..peer.clone()
    };
    let e = n
        .client
        .get_enc_key(&n.beta.addr, &wrong)
        .await
        .unwrap_err();
    assert!(
        matches!(&e, LanError::BadAnswer(m) if m == "enc-key answer is not signed by the pinned host key"),
        "{e:?}"
    );
    // Asked as if it were another host: the signed name does not match.
    let renamed = peers::Peer {
        host: "other".into(),
        ..peer
    };
    let e = n
        .client
        .get_enc_key(&n.beta.addr, &renamed)
        .await
        .unwrap_err();
    assert!(
        matches!(&e, LanError::BadAnswer(m) if m == "enc-key answer is for host beta, not other"),
        "{e:?}"
    );

    let agents = n.client.get_agents(&n.beta.addr).await.unwrap();
    assert_eq!(agents.host, "beta");
}

#[tokio::test]
async fn unpair_removes_the_calling_peer_and_ends_its_pending_mail() {
    let n = net().await;
    seed_outbox(&n.beta.store, "m1", "alpha", "pending", T0 + 3_600_000, 2);
    n.client.unpair(&n.beta.addr).await.unwrap();
    assert_eq!(
        n.beta
            .count("SELECT COUNT(*) FROM peers WHERE host = 'alpha'"),
        0
    );
    assert_eq!(
        n.beta
            .count("SELECT COUNT(*) FROM outbox WHERE host = 'alpha' AND state = 'undelivered'"),
        1
    );
    let e = n.client.unpair(&n.beta.addr).await.unwrap_err();
    assert_eq!(status_of(e), (401, "host not paired".into()));
}

/// A local message `id` with one outbox row to `host`.
fn seed_outbox(store: &Store, id: &str, host: &str, state: &str, next_at: i64, lan_failures: i64) {
    store
        .mailbox
        .with(|c| {
            c.execute(
                "INSERT OR IGNORE INTO messages VALUES (?1,'t','bob@beta',?1,NULL,'message','s','b','{}','local',1)",
                [id],
            )?;
            c.execute(
                "INSERT INTO outbox(msg_id, host, target_pubkey, state, attempts, lan_failures, next_at, created_at)
                 VALUES (?1, ?2, 'K', ?3, 3, ?4, ?5, ?6)",
                rusqlite::params![id, host, state, lan_failures, next_at, T0 - 60_000],
            )?;
            Ok(())
        })
        .unwrap();
}

#[tokio::test]
async fn a_good_hop_makes_the_peers_queued_mail_due_now_and_records_where_it_came_from() {
    let n = net().await;
    seed_outbox(&n.beta.store, "m1", "alpha", "pending", T0 + 3_600_000, 2);
    seed_outbox(
        &n.beta.store,
        "m2",
        "alpha",
        "relay-accepted",
        T0 + 3_600_000,
        2,
    );
    seed_outbox(&n.beta.store, "m3", "gamma", "pending", T0 + 3_600_000, 2);
    let wake = n.beta.state.wake.clone();
    let woken = wake.notified();
    tokio::pin!(woken);
    woken.as_mut().enable();

    n.client.get_agents(&n.beta.addr).await.unwrap();

    let row = |id: &str| -> (i64, i64) {
        n.beta
            .store
            .fresh_conn()
            .query_row(
                "SELECT next_at, lan_failures FROM outbox WHERE msg_id = ?1",
                [id],
                |r| Ok((r.get(0)?, r.get(1)?)),
            )
            .unwrap()
    };
    // Due now and the LAN's again (one LAN failure short of the relay handover).
    assert_eq!(row("m1"), (T0, 1));
    assert_eq!(row("m2"), (T0 + 3_600_000, 2));
    assert_eq!(row("m3"), (T0 + 3_600_000, 2));
    tokio::time::timeout(Duration::from_secs(5), woken)
        .await
        .expect("the sender loops are woken");
    assert_eq!(
        n.beta
            .count("SELECT last_seen_at FROM peers WHERE host = 'alpha'"),
        T0
    );
    let seen = n
        .beta
        .store
        .mailbox
        .with(|c| relay_state::kv_get(c, "peer-lastseen:alpha"))
        .unwrap();
    assert_eq!(seen.as_deref(), Some("127.0.0.1:7400"));

    // A refused hop changes nothing.
    seed_outbox(&n.beta.store, "m4", "alpha", "pending", T0 + 3_600_000, 2);
    let forger = n.client_as(testutil::identity("alpha"));
    forger.get_agents(&n.beta.addr).await.unwrap_err();
    assert_eq!(row("m4"), (T0 + 3_600_000, 2));
}

#[tokio::test]
async fn unknown_routes_are_404_and_the_server_stops_on_shutdown() {
    let mut n = net().await;
    let e = n
        .client
        .signed_get(&n.beta.addr, "/v1/nothing")
        .await
        .unwrap_err();
    assert_eq!(status_of(e), (404, "not found".into()));
    let raw = reqwest::get(format!("http://{}/nothing", n.beta.addr))
        .await
        .unwrap();
    assert_eq!(raw.status().as_u16(), 404);
    assert_eq!(raw.text().await.unwrap(), r#"{"error":"not found"}"#);
    // The unsigned routes need no hop.
    let raw = reqwest::get(format!("http://{}/v1/status", n.beta.addr))
        .await
        .unwrap();
    assert_eq!(raw.status().as_u16(), 200);
    let status: serde_json::Value = raw.json().await.unwrap();
    assert_eq!(status["host"], "beta");
    let raw = reqwest::get(format!("http://{}/v1/pair/hello", n.beta.addr))
        .await
        .unwrap();
    assert_eq!(raw.status().as_u16(), 200);

    let _ = n.beta.stop.take().unwrap().send(());
    tokio::time::timeout(Duration::from_secs(10), &mut n.beta.task)
        .await
        .expect("serve returns after shutdown")
        .unwrap()
        .unwrap();
    let e = n.client.get_agents(&n.beta.addr).await.unwrap_err();
    assert!(matches!(e, LanError::Unreachable(_)), "{e:?}");
    assert!(e.is_retryable());
}

#[tokio::test]
async fn receipts_are_answered_one_result_each_in_order() {
    let n = net().await;
    let wires = vec![
        br#"{"rec":{"v":1},"sig":"x"}"#.to_vec(),
        br#"{"rec":{"v":1},"sig":"y"}"#.to_vec(),
    ];
    let r = n.client.post_receipts(&n.beta.addr, &wires).await.unwrap();
    assert_eq!(r.len(), 2);
    assert!(r.iter().all(|x| x.starts_with("rejected:")), "{r:?}");
    let body = format!("{{\"receipts\":[{}]}}", vec!["{}"; 201].join(","));
    let e = n
        .client
        .signed_post_json(&n.beta.addr, "/v1/receipts", body.into_bytes())
        .await
        .unwrap_err();
    assert_eq!(
        status_of(e),
        (
            400,
            "bad batch: receipts must be an array of at most 200".into()
        )
    );
}

#[test]
fn the_address_candidate_takes_the_hinted_then_the_pinned_then_the_default_port() {
    let v4: IpAddr = "::ffff:10.0.0.5".parse().unwrap();
    assert_eq!(candidate(v4, "7400", Some("x.local:7444")), "10.0.0.5:7400");
    assert_eq!(candidate(v4, "", Some("x.local:7444")), "10.0.0.5:7444");
    assert_eq!(candidate(v4, "0", Some("x.local")), "10.0.0.5:7373");
    assert_eq!(candidate(v4, "99999", None), "10.0.0.5:7373");
    let v6: IpAddr = "fe80::1".parse().unwrap();
    assert_eq!(candidate(v6, "7400", None), "[fe80::1]:7400");
}

/// A port on 127.0.0.1 that nothing listens on (bound, then released).
fn dead_addr() -> String {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let a = l.local_addr().unwrap();
    drop(l);
    a.to_string()
}

/// Polls `check` every 20 ms for up to 10 s.
async fn poll<T>(what: &str, mut check: impl FnMut() -> Option<T>) -> T {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        if let Some(v) = check() {
            return v;
        }
        assert!(tokio::time::Instant::now() < deadline, "timed out: {what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test]
async fn a_signed_request_from_a_new_address_moves_the_peer_once_its_status_proves_the_key() {
    let n = net().await;
    // alpha's own LAN server (signing 127.0.0.1), where beta does not look for it: beta has
    // alpha pinned at a port where nothing listens.
    let alpha_server = serve_host(
        n.alpha.clone(),
        testutil::store(),
        vec![IpAddr::V4(std::net::Ipv4Addr::LOCALHOST)],
    )
    .await;
    let live = alpha_server.addr.clone();
    let dead = dead_addr();
    let pin = |addr: &str| {
        n.beta
            .store
            .mailbox
            .with(|c| peers::set_addr(c, "alpha", addr, "pair"))
            .unwrap();
    };
    pin(&dead);
    let alpha_at = || {
        n.beta
            .store
            .mailbox
            .with(|c| peers::by_name(c, "alpha"))
            .unwrap()
            .unwrap()
    };

    let client = LanClient::new(
        n.alpha.clone(),
        n.alpha_clock.clone(),
        alpha_server.state.port,
    )
    .unwrap();

    // A signed request from alpha's live server address: probed and adopted.
    let agents = client.get_agents(&n.beta.addr).await.unwrap();
    assert_eq!(
        agents.host, "beta",
        "the request is answered; healing runs on its own"
    );
    let moved = poll("alpha adopted at its live address", || {
        let p = alpha_at();
        (p.addr.as_deref() == Some(live.as_str())).then_some(p)
    })
    .await;
    assert_eq!(moved.addr_source.as_deref(), Some("verified-hop"));
    let heal: serde_json::Value = serde_json::from_str(
        &n.beta
            .store
            .mailbox
            .with(|c| relay_state::kv_get(c, "peer-heal:alpha"))
            .unwrap()
            .unwrap(),
    )
    .unwrap();
    assert_eq!(
        (
            heal["via"].as_str(),
            heal["from"].as_str(),
            heal["to"].as_str()
        ),
        (
            Some("verified-hop"),
            Some(dead.as_str()),
            Some(live.as_str())
        )
    );
    // An impostor with alpha's name but not its key is refused at the hop: nothing moves.
    pin(&dead);
    n.beta.clock.advance(60_000);
    let forger = LanClient::new(
        Arc::new(testutil::identity("alpha")),
        n.alpha_clock.clone(),
        alpha_server.state.port,
    )
    .unwrap();
    forger.get_agents(&n.beta.addr).await.unwrap_err();
    assert_eq!(alpha_at().addr.as_deref(), Some(dead.as_str()));
}

/// A server on 127.0.0.1:0 answering every request 200 with a body that never ends (64 KiB
/// chunks until the client goes away), or — with `declared` — a `content-length` of that many
/// bytes and no body at all. Returns its address and a counter of the bytes it managed to send.
async fn endless_answers(declared: Option<usize>) -> (String, Arc<std::sync::atomic::AtomicUsize>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let sent = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let counter = sent.clone();
    tokio::spawn(async move {
        loop {
            let Ok((mut tcp, _)) = listener.accept().await else {
                return;
            };
            let counter = counter.clone();
            tokio::spawn(async move {
                // The request head (the body, if any, is small and never read).
                let mut head = Vec::new();
                let mut byte = [0u8; 1];
                while !head.ends_with(b"\r\n\r\n") {
                    if tcp.read(&mut byte).await.unwrap_or(0) == 0 {
                        return;
                    }
                    head.push(byte[0]);
                }
                if let Some(len) = declared {
                    let answer = format!(
                        "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {len}\r\n\r\n"
                    );
                    let _ = tcp.write_all(answer.as_bytes()).await;
                    let _ =
                        tokio::time::timeout(Duration::from_secs(20), tcp.read(&mut byte)).await;
                    return;
                }
                let head = "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ntransfer-encoding: chunked\r\n\r\n";
                if tcp.write_all(head.as_bytes()).await.is_err() {
                    return;
                }
                let chunk = vec![b' '; 64 * 1024];
                loop {
                    let frame = format!("{:x}\r\n", chunk.len());
                    if tcp.write_all(frame.as_bytes()).await.is_err()
                        || tcp.write_all(&chunk).await.is_err()
                        || tcp.write_all(b"\r\n").await.is_err()
                    {
                        return;
                    }
                    counter.fetch_add(chunk.len(), std::sync::atomic::Ordering::Relaxed);
                }
            });
        }
    });
    (addr, sent)
}

fn over_cap(e: LanError) -> String {
    match e {
        LanError::BadAnswer(m) => m,
        other => panic!("expected a refused oversized answer, got {other:?}"),
    }
}

#[tokio::test]
async fn answers_over_their_cap_are_refused_without_reading_the_rest() {
    use super::client::{MAX_AGENTS_ANSWER, MAX_RESULTS_ANSWER, MAX_SMALL_ANSWER};
    let n = net().await;
    let (addr, sent) = endless_answers(None).await;
    let peer = beta_peer(&n);
    let wire = n.wire(&testutil::ids().next(T0));
    let started = std::time::Instant::now();

    let e = n
        .client
        .post_envelopes(&addr, std::slice::from_ref(&wire))
        .await
        .unwrap_err();
    assert_eq!(
        over_cap(e),
        format!("answer to /v2/envelopes over {MAX_RESULTS_ANSWER} bytes")
    );
    let e = n
        .client
        .post_receipts(&addr, &[br#"{"rec":{},"sig":"x"}"#.to_vec()])
        .await
        .unwrap_err();
    assert_eq!(
        over_cap(e),
        format!("answer to /v1/receipts over {MAX_RESULTS_ANSWER} bytes")
    );
    let e = n.client.get_agents(&addr).await.unwrap_err();
    assert_eq!(
        over_cap(e),
        format!("answer to /v1/agents over {MAX_AGENTS_ANSWER} bytes")
    );
    let e = n.client.get_enc_key(&addr, &peer).await.unwrap_err();
    assert_eq!(
        over_cap(e),
        format!("answer to /v1/enc-key over {MAX_SMALL_ANSWER} bytes")
    );
    let e = n.client.unpair(&addr).await.unwrap_err();
    assert_eq!(
        over_cap(e),
        format!("answer to /v1/unpair over {MAX_SMALL_ANSWER} bytes")
    );
    let e = n
        .client
        .signed_get(&addr, "/v1/anything")
        .await
        .unwrap_err();
    assert_eq!(
        over_cap(e),
        format!(
            "answer to /v1/anything over {} bytes",
            super::client::MAX_ANSWER
        )
    );
    // Far from the 15 s a call may take: each read stopped at its cap.
    assert!(
        started.elapsed() < Duration::from_secs(10),
        "{:?}",
        started.elapsed()
    );
    // What the server managed to push is bounded by the caps (plus socket buffers), not by
    // the time the calls were allowed.
    let total = sent.load(std::sync::atomic::Ordering::Relaxed);
    assert!(total < 64 * 1024 * 1024, "{total} bytes sent");

    // A declared length over the cap is refused before any of the body is read.
    let (addr, _) = endless_answers(Some(512 * 1024 * 1024)).await;
    let e = n.client.get_enc_key(&addr, &peer).await.unwrap_err();
    assert_eq!(
        over_cap(e),
        format!("answer to /v1/enc-key over {MAX_SMALL_ANSWER} bytes")
    );
    let e = n
        .client
        .post_envelopes(&addr, std::slice::from_ref(&wire))
        .await
        .unwrap_err();
    assert!(!e.is_retryable(), "{e:?}");

    // Real answers are far below the caps and still pass.
    assert_eq!(
        n.client.get_enc_key(&n.beta.addr, &peer).await.unwrap(),
        n.beta_enc.to_b64()
    );
}

#[tokio::test]
async fn a_peer_whose_two_daemons_alternate_on_its_key_is_reported_and_its_mail_stored_once() {
    use crate::instance::{Instance, PEER_KEY_CLONE};
    let n = net().await;
    let mut ids = testutil::ids();
    // Two daemons of alpha (one home and a copy of it): one identity, two instances.
    let first = n.client.clone().with_instance(Arc::new(Instance::new()));
    let copy = n.client.clone().with_instance(Arc::new(Instance::new()));
    // Without the header (the CLI, 0.5.x), and one restart (one id, then the other for good).
    let plain = n.client.clone();
    let mut sent = Vec::new();
    let mut post = async |client: &LanClient| {
        let id = ids.next(T0);
        let r = client
            .post_envelopes(&n.beta.addr, &[n.wire(&id)])
            .await
            .unwrap();
        assert_eq!(results(&r), ["accepted"]);
        sent.push(id);
    };
    for client in [&plain, &first, &first, &plain, &copy, &copy, &plain] {
        post(client).await;
    }
    assert_eq!(n.beta.state.instance.reasons(), []);
    // Both running: their hops alternate (the third return is the detection).
    for client in [&first, &copy, &first, &copy] {
        post(client).await;
    }
    let reasons = n.beta.state.instance.reasons();
    assert_eq!(reasons.len(), 1, "{reasons:?}");
    assert_eq!(reasons[0].code, PEER_KEY_CLONE);
    assert_eq!(reasons[0].peer.as_deref(), Some("alpha"));
    assert!(reasons[0].detail.contains("peer alpha"), "{reasons:?}");
    // Mail is what it was: every envelope stored once, whichever daemon sent it.
    for id in &sent {
        assert_eq!(
            n.beta
                .count(&format!("SELECT COUNT(*) FROM messages WHERE id = '{id}'")),
            1
        );
    }
    assert_eq!(n.beta.count("SELECT COUNT(*) FROM messages"), 11);
}
