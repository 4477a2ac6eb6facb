//! The LAN server and client end to end: the real router served on 127.0.0.1:0, called by the
//! real [`LanClient`] of another identity (and by raw requests where a client of ours would
//! never send such a thing).
//!
//! This module holds the served hosts and the server's refusals and limits; its children cover
//! the other routes, peers that move address, and the client's answer caps.

use std::net::IpAddr;
use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};

use agentmbx_protocol::clock::ManualClock;
use agentmbx_protocol::envelope::{self, Draft};
use agentmbx_protocol::keys::{EncPublicKey, HostKey};
use agentmbx_protocol::seal;

use super::client::{LanClient, LanError};
use super::hop::candidate;
use super::server::{serve, MAX_BODY};
use super::{LanState, SharedLan};
use crate::identity::Identity;
use crate::mailbox::{peers, relay_state};
use crate::testutil::{self, Store, T0};

mod answer_caps;
mod peer_address;
mod routes;

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
    assert!(matches!(e, LanError::NoConnection(_)), "{e:?}");
    assert!(e.is_retryable());
}
