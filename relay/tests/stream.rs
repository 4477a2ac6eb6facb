//! The push stream (`GET /v2/relay/stream`, `docs/relay-stream.md`) against the real relay on
//! 127.0.0.1 with a real WebSocket client: opening (signed hop, single-use nonce, the pull's
//! refusals), resume and replay (the pull's rules), live `deliver` frames with their
//! `prev_seq`, frame errors and close codes, bounds, and the connection cap.
//!
//! Frames are awaited with a deadline ([`WAIT`]); nothing sleeps and hopes.

use std::time::Duration;

use futures_util::{SinkExt, StreamExt};
use serde_json::{json, Value};
use tokio_tungstenite::tungstenite::client::IntoClientRequest;
use tokio_tungstenite::tungstenite::protocol::Message;
use tokio_tungstenite::tungstenite::Error as WsError;
use tokio_tungstenite::WebSocketStream;

use agentmbx_protocol::stream::{close, MAX_CLIENT_FRAME, STREAM_PATH};

use crate::helper::{env_item, sealed_wire, Host, Relay};

/// How long a test waits for a frame or a close before it fails.
const WAIT: Duration = Duration::from_secs(10);

/// A client's end of one stream.
pub(crate) struct Ws(pub(crate) WebSocketStream<tokio::net::TcpStream>);

/// A refused upgrade: the HTTP status and the JSON body.
#[derive(Debug)]
pub(crate) struct Refused {
    pub(crate) status: u16,
    pub(crate) body: Value,
}

impl Refused {
    #[track_caller]
    fn assert(&self, status: u16, code: &str) {
        assert_eq!(self.status, status, "{self:?}");
        assert_eq!(self.body["code"], code, "{self:?}");
    }
}

/// `you.stream_nonce` of a signed info for `host`.
pub(crate) async fn nonce(relay: &Relay, host: &Host) -> String {
    let r = relay.hop(host, "GET", "/v2/relay/info", "").await;
    r.assert_ok();
    r.json["you"]["stream_nonce"]
        .as_str()
        .unwrap_or_else(|| panic!("no stream nonce: {r:#?}"))
        .to_owned()
}

/// The WebSocket request for `target`, with the hop headers `host` signs for it now (and
/// `extra` headers).
fn signed_request(
    relay: &Relay,
    host: &Host,
    target: &str,
    extra: &[(String, String)],
) -> axum::http::Request<()> {
    let mut req = format!("ws://{}{target}", relay.addr())
        .into_client_request()
        .expect("a client request");
    for (k, v) in host
        .hop_headers("GET", target, "", relay.now())
        .into_iter()
        .chain(extra.iter().cloned())
    {
        if k == "content-type" {
            continue;
        }
        req.headers_mut().insert(
            axum::http::HeaderName::from_bytes(k.as_bytes()).expect("header name"),
            v.parse().expect("header value"),
        );
    }
    req
}

/// Sends `req` over `tcp`: the stream (a `101`), or the relay's refusal.
async fn handshake(
    req: axum::http::Request<()>,
    tcp: tokio::net::TcpStream,
) -> Result<Ws, Refused> {
    match tokio::time::timeout(WAIT, tokio_tungstenite::client_async(req, tcp)).await {
        Err(_) => panic!("the upgrade got no answer"),
        Ok(Ok((ws, resp))) => {
            assert_eq!(resp.status(), 101);
            Ok(Ws(ws))
        }
        Ok(Err(WsError::Http(resp))) => Err(Refused {
            status: resp.status().as_u16(),
            body: resp
                .body()
                .as_ref()
                .and_then(|b| serde_json::from_slice(b).ok())
                .unwrap_or(Value::Null),
        }),
        Ok(Err(e)) => panic!("upgrade failed: {e}"),
    }
}

async fn connect(relay: &Relay) -> tokio::net::TcpStream {
    tokio::net::TcpStream::connect(relay.addr())
        .await
        .expect("connect")
}

/// The upgrade signed by `host` with `nonce` (and `extra` headers).
pub(crate) async fn upgrade_with(
    relay: &Relay,
    host: &Host,
    nonce: &str,
    extra: &[(String, String)],
) -> Result<Ws, Refused> {
    let req = signed_request(relay, host, &format!("{STREAM_PATH}?nonce={nonce}"), extra);
    handshake(req, connect(relay).await).await
}

/// The upgrade signed by `host` without a nonce in its path.
async fn upgrade_missing_nonce(relay: &Relay, host: &Host) -> Result<Ws, Refused> {
    let req = signed_request(relay, host, STREAM_PATH, &[]);
    handshake(req, connect(relay).await).await
}

async fn upgrade(relay: &Relay, host: &Host, nonce: &str) -> Result<Ws, Refused> {
    upgrade_with(relay, host, nonce, &[]).await
}

/// A fresh stream for `host` (info for a nonce, then the upgrade).
async fn open(relay: &Relay, host: &Host) -> Ws {
    let n = nonce(relay, host).await;
    upgrade(relay, host, &n).await.expect("the stream opens")
}

impl Ws {
    pub(crate) async fn send(&mut self, frame: Value) {
        self.0
            .send(Message::Text(frame.to_string().into()))
            .await
            .expect("send a frame");
    }

    pub(crate) async fn resume(&mut self, epoch: &str, after: i64) {
        self.send(json!({"type": "resume", "epoch": epoch, "after": after}))
            .await;
    }

    /// The next text frame (pings included), or a panic naming what came instead.
    pub(crate) async fn frame(&mut self) -> Value {
        loop {
            let next = tokio::time::timeout(WAIT, self.0.next())
                .await
                .expect("a frame within the deadline");
            match next {
                Some(Ok(Message::Text(t))) => {
                    return serde_json::from_str(t.as_str()).expect("a JSON frame")
                }
                Some(Ok(Message::Ping(_) | Message::Pong(_))) => {}
                other => panic!("expected a text frame, got {other:?}"),
            }
        }
    }

    /// The frames of one replay: the `deliver`s, then `resume_complete`.
    pub(crate) async fn replay(&mut self) -> (Vec<Value>, Value) {
        let mut delivered = Vec::new();
        loop {
            let f = self.frame().await;
            match f["type"].as_str() {
                Some("deliver") => delivered.push(f),
                Some("resume_complete") => return (delivered, f),
                _ => panic!("unexpected frame during a replay: {f}"),
            }
        }
    }

    /// Reads until the relay closes; returns the close code (frames before it are skipped).
    pub(crate) async fn closed(&mut self) -> u16 {
        loop {
            let next = tokio::time::timeout(WAIT, self.0.next())
                .await
                .expect("the close within the deadline");
            match next {
                Some(Ok(Message::Close(Some(f)))) => return u16::from(f.code),
                Some(Ok(Message::Close(None))) => panic!("closed without a code"),
                Some(Ok(_)) => {}
                Some(Err(e)) => panic!("the stream failed instead of closing: {e}"),
                None => panic!("the stream ended without a close frame"),
            }
        }
    }
}

/// Two enrolled hosts: `alice` pushes to `bob`, who streams.
async fn pair(relay: &Relay) -> (Host, Host) {
    let (alice, bob) = (Host::new("alice"), Host::new("bob"));
    relay.enrol(&alice).await;
    relay.enrol(&bob).await;
    (alice, bob)
}

/// Pushes one sealed envelope from `from` to `to`; returns `(item id, seq)`.
async fn push_one(relay: &Relay, from: &Host, to: &Host, body: &str) -> (String, i64) {
    let (id, wire) = sealed_wire(from, to, body, relay.now());
    let r = relay.push(from, vec![env_item(&id, to, &wire)]).await;
    assert_eq!(r.status1(), "accepted", "{r:#?}");
    let seq = r.json["results"][0]["targets"][0]["seq"]
        .as_i64()
        .expect("seq");
    (id, seq)
}

fn seqs(frames: &[Value]) -> Vec<(i64, i64)> {
    frames
        .iter()
        .map(|f| {
            (
                f["prev_seq"].as_i64().expect("prev_seq"),
                f["seq"].as_i64().expect("seq"),
            )
        })
        .collect()
}

#[tokio::test]
async fn resume_from_zero_replays_the_queue_in_order_then_goes_live() {
    let relay = Relay::start().await;
    let (alice, bob) = pair(&relay).await;
    let (id1, s1) = push_one(&relay, &alice, &bob, "one").await;
    let (id2, s2) = push_one(&relay, &alice, &bob, "two").await;
    let mut ws = open(&relay, &bob).await;
    let epoch = relay.epoch().await;
    ws.resume(&epoch, 0).await;
    let (items, done) = ws.replay().await;
    assert_eq!(seqs(&items), vec![(0, s1), (s1, s2)]);
    assert_eq!(items[0]["item_id"], id1.as_str());
    assert_eq!(items[1]["item_id"], id2.as_str());
    assert!(items.iter().all(|f| f["replay"] == true));
    assert_eq!(items[0]["kind"], "envelope");
    assert_eq!(items[0]["sender_pubkey"], alice.pubkey().as_str());
    // The wire is exactly what a pull returns.
    let pulled = relay.pull(&bob, "after=0").await;
    assert_eq!(items[0]["wire_b64"], pulled.json["items"][0]["wire_b64"]);
    assert_eq!(
        done,
        json!({"type": "resume_complete", "replayed": 2, "head_seq": s2})
    );

    // Live: two more pushes, each frame's prev_seq is the seq before it.
    let (id3, s3) = push_one(&relay, &alice, &bob, "three").await;
    let (_, s4) = push_one(&relay, &alice, &bob, "four").await;
    let f3 = ws.frame().await;
    let f4 = ws.frame().await;
    assert_eq!(f3["type"], "deliver", "{f3}");
    assert_eq!(f3["replay"], false);
    assert_eq!(f3["item_id"], id3.as_str());
    assert_eq!(seqs(&[f3, f4]), vec![(s2, s3), (s3, s4)]);
}

#[tokio::test]
async fn resume_from_the_middle_and_from_beyond_the_head_follow_the_pull() {
    let relay = Relay::start().await;
    let (alice, bob) = pair(&relay).await;
    let (_, s1) = push_one(&relay, &alice, &bob, "one").await;
    let (_, s2) = push_one(&relay, &alice, &bob, "two").await;
    let (_, s3) = push_one(&relay, &alice, &bob, "three").await;
    let epoch = relay.epoch().await;
    let mut ws = open(&relay, &bob).await;
    ws.resume(&epoch, s1).await;
    let (items, done) = ws.replay().await;
    assert_eq!(seqs(&items), vec![(s1, s2), (s2, s3)]);
    assert_eq!(done["replayed"], 2);
    // Beyond the head: an empty replay whose head_seq is below `after` (the client rewinds,
    // as after a pull past the head).
    ws.resume(&epoch, s3 + 1_000).await;
    let (items, done) = ws.replay().await;
    assert!(items.is_empty());
    assert_eq!(
        done,
        json!({"type": "resume_complete", "replayed": 0, "head_seq": s3})
    );
    let pulled = relay.pull(&bob, &format!("after={}", s3 + 1_000)).await;
    assert_eq!(pulled.json["head_seq"], s3);
    assert_eq!(pulled.json["items"], json!([]));
}

#[tokio::test]
async fn a_replay_is_bounded_like_a_pull_page() {
    let relay = Relay::start_with(agentmbx_relay::config::LimitsConfig {
        max_pull: 2,
        ..Default::default()
    })
    .await;
    let (alice, bob) = pair(&relay).await;
    let mut last = 0;
    for i in 0..3 {
        last = push_one(&relay, &alice, &bob, &format!("m{i}")).await.1;
    }
    let mut ws = open(&relay, &bob).await;
    ws.resume("", 0).await;
    let (items, done) = ws.replay().await;
    assert_eq!(items.len(), 2);
    assert_eq!(done["head_seq"], last);
    assert_eq!(done["replayed"], 2);
}

#[tokio::test]
async fn a_stale_epoch_is_answered_with_the_current_one() {
    let relay = Relay::start().await;
    let (alice, bob) = pair(&relay).await;
    push_one(&relay, &alice, &bob, "one").await;
    let mut ws = open(&relay, &bob).await;
    ws.resume("not-the-epoch", 0).await;
    let f = ws.frame().await;
    assert_eq!(f, json!({"type": "epoch", "epoch": relay.epoch().await}));
    // Not live until a resume with the current epoch: the next frame is that replay's.
    push_one(&relay, &alice, &bob, "two").await;
    ws.resume(&relay.epoch().await, 0).await;
    let (items, _) = ws.replay().await;
    assert_eq!(items.len(), 2);
}

#[tokio::test]
async fn live_frames_follow_the_replay_without_repeating_it_and_a_duplicate_is_not_sent() {
    let relay = Relay::start().await;
    let (alice, bob) = pair(&relay).await;
    let mut ws = open(&relay, &bob).await;
    ws.resume("", 0).await;
    let (items, done) = ws.replay().await;
    assert!(items.is_empty());
    assert_eq!(done["head_seq"], 0);
    let (id, wire) = sealed_wire(&alice, &bob, "once", relay.now());
    let r = relay.push(&alice, vec![env_item(&id, &bob, &wire)]).await;
    assert_eq!(r.status1(), "accepted");
    let f = ws.frame().await;
    assert_eq!(f["item_id"], id.as_str());
    assert_eq!(f["prev_seq"], 0);
    // The same push again: `duplicate`, nothing new stored, nothing published.
    let r = relay.push(&alice, vec![env_item(&id, &bob, &wire)]).await;
    assert_eq!(r.status1(), "duplicate");
    let (next_id, next_seq) = push_one(&relay, &alice, &bob, "next").await;
    let f = ws.frame().await;
    assert_eq!(
        f["item_id"],
        next_id.as_str(),
        "the duplicate was published: {f}"
    );
    assert_eq!(f["seq"], next_seq);
}

#[tokio::test]
async fn an_unknown_frame_is_answered_and_the_stream_stays_open() {
    let relay = Relay::start().await;
    let (alice, bob) = pair(&relay).await;
    let mut ws = open(&relay, &bob).await;
    ws.send(json!({"type": "subscribe", "topic": "x"})).await;
    let f = ws.frame().await;
    assert_eq!(
        (
            f["type"].as_str(),
            f["reason"].as_str(),
            f["frame_type"].as_str()
        ),
        (Some("error"), Some("unknown_frame"), Some("subscribe")),
        "{f}"
    );
    assert!(f["detail"].as_str().is_some_and(|d| !d.is_empty()), "{f}");
    ws.send(json!({"type": "resume", "epoch": 7})).await;
    let f = ws.frame().await;
    assert_eq!(
        (f["reason"].as_str(), f["frame_type"].as_str()),
        (Some("bad_frame"), Some("resume"))
    );
    ws.resume("", 0).await;
    ws.replay().await;
    let (id, _) = push_one(&relay, &alice, &bob, "still open").await;
    assert_eq!(ws.frame().await["item_id"], id.as_str());
}

#[tokio::test]
async fn a_binary_or_unreadable_frame_closes_with_policy() {
    let relay = Relay::start().await;
    let (_, bob) = pair(&relay).await;
    let mut ws = open(&relay, &bob).await;
    ws.0.send(Message::Binary(vec![1, 2, 3].into()))
        .await
        .expect("send");
    assert_eq!(ws.closed().await, close::POLICY);
    let mut ws = open(&relay, &bob).await;
    ws.0.send(Message::Text("not json".into()))
        .await
        .expect("send");
    assert_eq!(ws.closed().await, close::POLICY);
}

#[tokio::test]
async fn a_client_frame_over_64_kib_closes_with_oversize() {
    let relay = Relay::start().await;
    let (_, bob) = pair(&relay).await;
    let mut ws = open(&relay, &bob).await;
    let big = json!({"type": "pong", "id": 1, "pad": "x".repeat(MAX_CLIENT_FRAME)});
    ws.send(big).await;
    assert_eq!(ws.closed().await, close::OVERSIZE);
}

#[tokio::test]
async fn a_nonce_is_single_use_bound_to_its_key_and_expires() {
    let relay = Relay::start().await;
    let (alice, bob) = pair(&relay).await;
    // Unknown.
    upgrade(&relay, &bob, "AAAAAAAAAAAAAAAAAAAAAA")
        .await
        .err()
        .expect("refused")
        .assert(401, "BAD_NONCE");
    // Missing.
    upgrade_missing_nonce(&relay, &bob)
        .await
        .err()
        .expect("refused")
        .assert(401, "BAD_NONCE");
    // A signed GET that is not an upgrade: refused before its nonce is looked at, so the
    // nonce still opens a stream.
    let n = nonce(&relay, &bob).await;
    let target = format!("{STREAM_PATH}?nonce={n}");
    let r = relay.hop(&bob, "GET", &target, "").await;
    assert!(matches!(r.status, 400 | 426), "{r:#?}");
    assert_eq!(r.str("code"), "NOT_UPGRADE", "{r:#?}");
    drop(
        upgrade(&relay, &bob, &n)
            .await
            .expect("the nonce was not spent"),
    );
    // Used twice.
    let n = nonce(&relay, &bob).await;
    let ws = upgrade(&relay, &bob, &n).await.expect("first use");
    drop(ws);
    upgrade(&relay, &bob, &n)
        .await
        .err()
        .expect("refused")
        .assert(401, "BAD_NONCE");
    // Another key's.
    let n = nonce(&relay, &alice).await;
    upgrade(&relay, &bob, &n)
        .await
        .err()
        .expect("refused")
        .assert(401, "BAD_NONCE");
    // Expired (the relay's clock moves past the nonce's 120 s).
    let n = nonce(&relay, &bob).await;
    relay
        .clock
        .advance(agentmbx_protocol::stream::NONCE_TTL_MS + 1);
    upgrade(&relay, &bob, &n)
        .await
        .err()
        .expect("refused")
        .assert(401, "BAD_NONCE");
    // Each refusal counted (unknown, missing, used, another key's, expired).
    use agentmbx_relay::refusals::AuthRefusal;
    assert_eq!(relay.state.refused.auths(AuthRefusal::BadNonce), 5);
}

#[tokio::test]
async fn an_unenrolled_revoked_or_denied_key_gets_the_pulls_refusal() {
    let relay = Relay::start().await;
    let (alice, bob) = pair(&relay).await;
    let stranger = Host::new("stranger");
    let pull = relay.pull(&stranger, "").await;
    let refused = upgrade(&relay, &stranger, "AAAAAAAAAAAAAAAAAAAAAA")
        .await
        .err()
        .expect("refused");
    refused.assert(401, "NOT_ENROLLED");
    assert_eq!(refused.body, pull.json);
    // A nonce obtained while enrolled, then the key revoked.
    let n = nonce(&relay, &bob).await;
    relay.revoke(&bob).await;
    let pull = relay.pull(&bob, "").await;
    let refused = upgrade(&relay, &bob, &n).await.err().expect("refused");
    refused.assert(403, "REVOKED");
    assert_eq!(refused.body, pull.json);
    // Deny-listed by fingerprint.
    let n = nonce(&relay, &alice).await;
    deny(&relay, "host", &alice.key.public().fingerprint()).await;
    let pull = relay.pull(&alice, "").await;
    let refused = upgrade(&relay, &alice, &n).await.err().expect("refused");
    refused.assert(403, "DENIED");
    assert_eq!(refused.body, pull.json);
}

/// Adds a deny entry through the store, as `relay deny` does offline.
async fn deny(relay: &Relay, kind: &str, value: &str) {
    let kind = match kind {
        "host" => agentmbx_relay::store::DenyKind::Host,
        _ => agentmbx_relay::store::DenyKind::Client,
    };
    let (value, now) = (value.to_owned(), relay.now());
    relay
        .with_store(move |s| {
            s.deny(agentmbx_relay::store::DenyEntry {
                kind,
                value,
                until_ms: None,
                at_ms: now,
            })
        })
        .await
        .expect("deny");
}

const ADMIN: &str = "admin-token-0123456789abcdef";

/// A relay whose admin endpoints answer to [`ADMIN`].
async fn admin_relay() -> Relay {
    Relay::start_with_config(agentmbx_relay::config::RelayConfig {
        admin_token: Some(agentmbx_relay::config::AdminToken::new(ADMIN).expect("token")),
        ..Default::default()
    })
    .await
}

async fn admin(relay: &Relay, path: &str, body: Value) {
    let headers = vec![
        ("content-type".to_owned(), "application/json".to_owned()),
        ("authorization".to_owned(), format!("Bearer {ADMIN}")),
    ];
    let r = relay
        .send("POST", path, &headers, body.to_string().into_bytes())
        .await;
    r.assert_ok();
}

/// A stream that resumed and replayed (nothing queued): live from now on.
async fn live(relay: &Relay, host: &Host) -> Ws {
    let mut ws = open(relay, host).await;
    ws.resume("", 0).await;
    ws.replay().await;
    ws
}

#[tokio::test]
async fn a_key_revoked_while_connected_is_closed_with_4403() {
    let relay = admin_relay().await;
    let (alice, bob) = pair(&relay).await;
    let mut a = live(&relay, &alice).await;
    let mut b = live(&relay, &bob).await;
    admin(
        &relay,
        "/v2/relay/admin/revoke",
        json!({"host": bob.pubkey()}),
    )
    .await;
    assert_eq!(b.closed().await, close::AUTH);
    // Only that key's stream.
    let carol = Host::new("carol");
    relay.enrol(&carol).await;
    let (id, _) = push_one(&relay, &carol, &alice, "still here").await;
    assert_eq!(a.frame().await["item_id"], id.as_str());
}

#[tokio::test]
async fn a_deny_entry_closes_only_the_streams_it_matches() {
    let relay = admin_relay().await;
    let (alice, bob) = pair(&relay).await;
    let mut a = live(&relay, &alice).await;
    let mut b = live(&relay, &bob).await;
    // A client_id entry matches no stream of a host-key relay.
    admin(
        &relay,
        "/v2/relay/admin/deny",
        json!({"target": "client-bob", "kind": "client"}),
    )
    .await;
    admin(
        &relay,
        "/v2/relay/admin/deny",
        json!({"target": bob.key.public().fingerprint()}),
    )
    .await;
    assert_eq!(b.closed().await, close::AUTH);
    let carol = Host::new("carol");
    relay.enrol(&carol).await;
    let (id, _) = push_one(&relay, &carol, &alice, "alice is not denied").await;
    assert_eq!(a.frame().await["item_id"], id.as_str());
}

#[tokio::test]
async fn a_rotation_closes_the_old_keys_stream() {
    let relay = Relay::start().await;
    let old = Host::new("laptop");
    let new = Host::new("laptop");
    relay.enrol(&old).await;
    relay.enrol(&new).await;
    let mut ws = live(&relay, &old).await;
    relay.clock.advance(1_000);
    let rotation = agentmbx_protocol::rotation::SignedRotation::sign(
        "laptop",
        &old.key,
        &new.key,
        &new.enc.public(),
        relay.now(),
    );
    let body = json!({ "rotation": rotation }).to_string();
    relay
        .plain("POST", "/v2/relay/rotate", &body)
        .await
        .assert_ok();
    assert_eq!(ws.closed().await, close::AUTH);
    // The new key streams.
    let mut fresh = live(&relay, &new).await;
    let alice = Host::new("alice");
    relay.enrol(&alice).await;
    let (id, _) = push_one(&relay, &alice, &new, "to the new key").await;
    assert_eq!(fresh.frame().await["item_id"], id.as_str());
}

#[tokio::test]
async fn a_second_stream_for_a_key_replaces_the_first_with_4409() {
    let relay = Relay::start().await;
    let (alice, bob) = pair(&relay).await;
    let mut first = live(&relay, &bob).await;
    let mut second = live(&relay, &bob).await;
    assert_eq!(first.closed().await, close::REPLACED);
    let (id, _) = push_one(&relay, &alice, &bob, "to the newer one").await;
    assert_eq!(second.frame().await["item_id"], id.as_str());
    let stats = relay.state.streams.stats();
    assert_eq!(stats["open"], 1, "{stats}");
    assert_eq!(stats["closes"]["4409"], 1, "{stats}");
}

/// Waits (up to [`WAIT`]) until `cond` holds.
async fn until(what: &str, cond: impl Fn() -> bool) {
    let deadline = tokio::time::Instant::now() + WAIT;
    while !cond() {
        assert!(tokio::time::Instant::now() < deadline, "never: {what}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// A stream of `host` whose socket has a 4 KiB receive buffer, so the kernel holds little of
/// what the relay writes while the client does not read.
async fn open_slow(relay: &Relay, host: &Host) -> Ws {
    let n = nonce(relay, host).await;
    let req = signed_request(relay, host, &format!("{STREAM_PATH}?nonce={n}"), &[]);
    let socket = tokio::net::TcpSocket::new_v4().expect("socket");
    socket.set_recv_buffer_size(4096).expect("rcvbuf");
    let tcp = socket
        .connect(relay.addr().parse().expect("addr"))
        .await
        .expect("connect");
    handshake(req, tcp).await.expect("the stream opens")
}

#[tokio::test]
async fn a_reader_that_stops_reading_gets_lagged_and_the_queue_stays_bounded() {
    use agentmbx_protocol::stream::STREAM_QUEUE_BYTES;
    let relay = Relay::start().await;
    let (alice, bob) = pair(&relay).await;
    let mut ws = open_slow(&relay, &bob).await;
    ws.resume("", 0).await;
    ws.replay().await;
    // Stop reading; push far more than the queue holds (each item about 48 KiB of wire).
    let body = "y".repeat(48 * 1024);
    let mut pushed = Vec::new();
    for _ in 0..80 {
        pushed.push(push_one(&relay, &alice, &bob, &body).await.1);
        let used = relay.state.streams.budget_used();
        assert!(
            used <= STREAM_QUEUE_BYTES + 1024,
            "queued {used} bytes past the stream's cap"
        );
    }
    let stats = relay.state.streams.stats();
    assert_eq!(
        stats["lagged"], 1,
        "lagged once until the next resume: {stats}"
    );
    // Reading again: deliver frames in order, contiguous by prev_seq, then `lagged` from the
    // first seq that was dropped.
    let mut last = 0;
    let from = loop {
        let f = ws.frame().await;
        match f["type"].as_str() {
            Some("deliver") => {
                assert_eq!(f["prev_seq"], last, "{f}");
                last = f["seq"].as_i64().expect("seq");
            }
            Some("lagged") => break f["from_seq"].as_i64().expect("from_seq"),
            _ => panic!("unexpected {f}"),
        }
    };
    assert!(from > last && pushed.contains(&from), "{from} after {last}");
    // A resume starts over: the replay from the client's position.
    ws.resume("", last).await;
    let (items, done) = ws.replay().await;
    assert_eq!(items[0]["seq"], from);
    assert!(done["replayed"].as_u64().expect("replayed") >= 1);
    drop(ws);
    until("the stream's bytes return to the budget", || {
        relay.state.streams.running() == 0 && relay.state.streams.budget_used() == 0
    })
    .await;
}

#[tokio::test]
async fn shutdown_closes_every_stream_with_going_away() {
    let relay = Relay::start().await;
    let (alice, bob) = pair(&relay).await;
    let mut a = live(&relay, &alice).await;
    let mut b = live(&relay, &bob).await;
    let stopping = tokio::spawn(relay.stop());
    assert_eq!(a.closed().await, close::GOING_AWAY);
    assert_eq!(b.closed().await, close::GOING_AWAY);
    tokio::time::timeout(WAIT, stopping)
        .await
        .expect("serve returned within the deadline")
        .expect("the stop task");
}

#[tokio::test]
async fn a_stream_holds_its_connection_slot_until_it_closes() {
    let relay = Relay::start_with_config(agentmbx_relay::config::RelayConfig {
        max_connections: Some(1),
        // The HTTP client's kept-alive connection (the info request) gives its slot back soon.
        keep_alive_timeout_ms: Some(50),
        ..Default::default()
    })
    .await;
    let (_, bob) = pair(&relay).await;
    let ws = live(&relay, &bob).await;
    // The one slot is the stream's: another connection is not served while it is open.
    let addr = relay.addr();
    let (raw, early) = tokio::task::spawn_blocking(move || {
        let mut raw = crate::helper::RawConn::connect(&addr);
        raw.send(b"GET /v2/relay/info HTTP/1.1\r\nhost: relay\r\n\r\n")
            .expect("send");
        let early = raw.try_response(Duration::from_millis(500));
        (raw, early)
    })
    .await
    .expect("the raw connection");
    assert!(
        early.is_none(),
        "answered while the stream held the only slot"
    );
    drop(ws);
    let later = tokio::task::spawn_blocking(move || {
        let mut raw = raw;
        raw.try_response(WAIT)
    })
    .await
    .expect("the raw connection");
    assert_eq!(later.expect("answered once the stream closed").0, 200);
}

#[tokio::test]
async fn an_expiry_notice_from_the_sweep_is_delivered_live_and_counted_in_admin_stats() {
    let relay = admin_relay().await;
    let (alice, bob) = pair(&relay).await;
    let (id, _) = push_one(&relay, &alice, &bob, "never pulled").await;
    let mut a = live(&relay, &alice).await;
    let days = i64::from(agentmbx_relay::config::LimitsConfig::default().retention_days);
    relay.clock.advance(days * 86_400_000);
    let report = relay.sweep().await;
    assert_eq!(report.notices, 1);
    let f = a.frame().await;
    assert_eq!(f["kind"], "expired", "{f}");
    assert_eq!(f["replay"], false);
    assert_eq!(f["prev_seq"], 0);
    assert_eq!(f["seq"], report.stored[0].seq);
    assert_eq!(f["sender_pubkey"], relay.relay_pub.to_b64().as_str());
    assert!(f["item_id"].as_str().expect("id").contains(&id));
    let headers = vec![("authorization".to_owned(), format!("Bearer {ADMIN}"))];
    let r = relay
        .send("GET", "/v2/relay/admin/stats", &headers, Vec::new())
        .await;
    let streams = &r.assert_ok()["streams"];
    assert_eq!(streams["open"], 1, "{streams}");
    assert_eq!(streams["queued_bytes"], 0, "{streams}");
    assert_eq!(
        streams["budget_bytes"],
        agentmbx_protocol::stream::RELAY_STREAM_BUDGET_BYTES
    );
}

#[tokio::test]
async fn an_epoch_rotation_is_announced_and_the_stream_waits_for_a_resume_in_it() {
    let relay = admin_relay().await;
    let (alice, bob) = pair(&relay).await;
    let old = relay.epoch().await;
    let mut ws = open(&relay, &bob).await;
    ws.resume(&old, 0).await;
    ws.replay().await;
    admin(&relay, "/v2/relay/admin/rotate-epoch", json!({})).await;
    let new = relay.epoch().await;
    assert_ne!(new, old);
    assert_eq!(ws.frame().await, json!({"type": "epoch", "epoch": new}));
    // Not live: a push now reaches bob through the next replay, not as a live frame.
    let (id, seq) = push_one(&relay, &alice, &bob, "after the rotation").await;
    ws.resume(&old, 0).await;
    assert_eq!(ws.frame().await, json!({"type": "epoch", "epoch": new}));
    ws.resume(&new, 0).await;
    let (items, done) = ws.replay().await;
    assert_eq!(items.len(), 1);
    assert_eq!(items[0]["item_id"], id.as_str());
    assert_eq!(done["head_seq"], seq);
}

#[tokio::test]
async fn pings_keep_an_answering_stream_open_and_a_silent_one_is_closed_with_policy() {
    let relay = Relay::start().await;
    let (alice, bob) = pair(&relay).await;
    // Shortened timers (the contract's are 25 s and 60 s): a ping every 50 ms, 300 ms to answer.
    relay.state.streams.set_timers(50, 300);
    let mut ws = live(&relay, &bob).await;
    // Answer ten pings: well past the pong timeout, the stream is still open.
    let mut ids = Vec::new();
    while ids.len() < 10 {
        let f = ws.frame().await;
        assert_eq!(f["type"], "ping", "{f}");
        let id = f["id"].as_u64().expect("id");
        ws.send(json!({"type": "pong", "id": id})).await;
        ids.push(id);
    }
    // Random ids: not a counter a client could answer without reading the pings.
    assert!(!ids.windows(2).all(|w| w[1] == w[0] + 1), "{ids:?}");
    let distinct: std::collections::HashSet<u64> = ids.iter().copied().collect();
    assert_eq!(distinct.len(), ids.len(), "{ids:?}");
    let (id, _) = push_one(&relay, &alice, &bob, "still open").await;
    loop {
        let f = ws.frame().await;
        if f["type"] == "deliver" {
            assert_eq!(f["item_id"], id.as_str());
            break;
        }
    }
    // Stop answering: closed with 1008.
    assert_eq!(ws.closed().await, close::POLICY);
}

/// The next text frame that is not a `ping`.
async fn non_ping(ws: &mut Ws) -> Value {
    loop {
        let f = ws.frame().await;
        if f["type"] != "ping" {
            return f;
        }
    }
}

#[tokio::test]
async fn a_client_that_keeps_sending_does_not_starve_the_writes() {
    let relay = Relay::start().await;
    let (alice, bob) = pair(&relay).await;
    let ws = live(&relay, &bob).await;
    let (mut tx, mut rx) = ws.0.split();
    // Pongs for no ping: read and dropped (no answer), as fast as the client can write.
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let stopping = stop.clone();
    let writer = tokio::spawn(async move {
        let pad = "p".repeat(1_000);
        while !stopping.load(std::sync::atomic::Ordering::Relaxed) {
            let frame = json!({"type": "pong", "id": 1, "pad": pad}).to_string();
            tx.send(Message::Text(frame.into())).await.expect("send");
        }
        tx
    });
    // Two live deliver frames arrive while the client keeps writing.
    for body in ["one", "two"] {
        let (id, _) = push_one(&relay, &alice, &bob, body).await;
        let f = loop {
            match tokio::time::timeout(WAIT, rx.next())
                .await
                .expect("a frame while the client writes")
            {
                Some(Ok(Message::Text(t))) => {
                    break serde_json::from_str::<Value>(t.as_str()).expect("json")
                }
                Some(Ok(Message::Ping(_) | Message::Pong(_))) => {}
                other => panic!("{other:?}"),
            }
        };
        assert_eq!(f["item_id"], id.as_str(), "{f}");
    }
    assert!(!writer.is_finished(), "the client was still writing");
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let tx = tokio::time::timeout(WAIT, writer)
        .await
        .expect("the writer stops")
        .expect("the writer");
    let mut ws = Ws(tx.reunite(rx).expect("the two halves"));
    let (id, _) = push_one(&relay, &alice, &bob, "still live").await;
    assert_eq!(non_ping(&mut ws).await["item_id"], id.as_str());
}

#[tokio::test]
async fn unknown_frames_past_the_allowed_rate_close_with_policy() {
    use agentmbx_relay::stream::conn::BAD_FRAME_BURST;
    let relay = Relay::start().await;
    let (_alice, bob) = pair(&relay).await;
    let mut ws = live(&relay, &bob).await;
    // Well past the burst, faster than the refill (one a second).
    let n = BAD_FRAME_BURST as usize * 4;
    for i in 0..n {
        let frame = json!({"type": format!("x{i}")}).to_string();
        if ws.0.send(Message::Text(frame.into())).await.is_err() {
            break;
        }
    }
    let mut answered = 0;
    let code = loop {
        let next = tokio::time::timeout(WAIT, ws.0.next())
            .await
            .expect("answers, then the close");
        match next {
            Some(Ok(Message::Text(t))) => {
                let f: Value = serde_json::from_str(t.as_str()).expect("json");
                assert_eq!(f["reason"], "unknown_frame", "{f}");
                answered += 1;
            }
            Some(Ok(Message::Close(Some(f)))) => break u16::from(f.code),
            Some(Ok(Message::Ping(_) | Message::Pong(_))) => {}
            other => panic!("{other:?}"),
        }
    };
    assert_eq!(code, close::POLICY);
    assert!(
        answered >= BAD_FRAME_BURST as usize && answered < n,
        "{answered} answered"
    );
}

#[tokio::test]
async fn a_resume_with_a_negative_after_or_during_a_replay_is_a_bad_frame() {
    let relay = Relay::start().await;
    let (alice, bob) = pair(&relay).await;
    let mut ws = open(&relay, &bob).await;
    ws.resume("", -1).await;
    let f = ws.frame().await;
    assert_eq!(
        (f["reason"].as_str(), f["frame_type"].as_str()),
        (Some("bad_frame"), Some("resume")),
        "{f}"
    );
    // A replay of many chunks (each item about 48 KiB of wire, the chunks about 192 KiB):
    // a second resume sent right behind the first finds it running.
    let body = "z".repeat(48 * 1024);
    let mut pushed = Vec::new();
    for _ in 0..24 {
        pushed.push(push_one(&relay, &alice, &bob, &body).await.1);
    }
    ws.resume("", 0).await;
    ws.resume("", 0).await;
    let mut delivered = Vec::new();
    let mut refused = 0;
    let done = loop {
        let f = ws.frame().await;
        match f["type"].as_str() {
            Some("deliver") => delivered.push(f),
            Some("error") => {
                assert_eq!(f["reason"], "bad_frame", "{f}");
                refused += 1;
            }
            Some("resume_complete") => break f,
            _ => panic!("unexpected {f}"),
        }
    };
    assert_eq!(refused, 1, "the second resume was answered bad_frame");
    let got: Vec<i64> = delivered
        .iter()
        .map(|f| f["seq"].as_i64().expect("seq"))
        .collect();
    assert_eq!(got, pushed, "the whole queue, in order, across chunks");
    let mut prev = 0;
    for (p, q) in seqs(&delivered) {
        assert_eq!(p, prev);
        prev = q;
    }
    assert_eq!(done["replayed"], 24);
    assert_eq!(done["head_seq"], *pushed.last().expect("pushed"));
    until("the replay's bytes return to the budget", || {
        relay.state.streams.budget_used() == 0
    })
    .await;
    // Live again after the replay.
    let (id, _) = push_one(&relay, &alice, &bob, "live").await;
    assert_eq!(non_ping(&mut ws).await["item_id"], id.as_str());
}

#[tokio::test]
async fn concurrent_pushes_to_one_target_arrive_as_one_prev_seq_chain() {
    let relay = Relay::start().await;
    let bob = std::sync::Arc::new(Host::new("bob"));
    relay.enrol(&bob).await;
    let mut senders = Vec::new();
    for i in 0..8 {
        let h = Host::new(&format!("sender{i}"));
        relay.enrol(&h).await;
        senders.push(h);
    }
    let mut ws = live(&relay, &bob).await;
    let relay = std::sync::Arc::new(relay);
    let mut tasks = Vec::new();
    for (i, h) in senders.into_iter().enumerate() {
        let (relay, to) = (relay.clone(), bob.clone());
        tasks.push(tokio::spawn(async move {
            let mut ids = Vec::new();
            for j in 0..5 {
                let (id, wire) = sealed_wire(&h, &to, &format!("{i}-{j}"), relay.now());
                let r = relay.push(&h, vec![env_item(&id, &to, &wire)]).await;
                assert_eq!(r.status1(), "accepted", "{r:#?}");
                ids.push(id);
            }
            ids
        }));
    }
    let mut total = 0;
    for t in tasks {
        total += t.await.expect("a sender").len();
    }
    // Every live frame continues the previous one: committed and published in one order.
    let mut prev = 0;
    for _ in 0..total {
        let f = non_ping(&mut ws).await;
        assert_eq!(f["type"], "deliver", "{f}");
        assert_eq!(f["prev_seq"], prev, "out of commit order: {f}");
        prev = f["seq"].as_i64().expect("seq");
    }
}

#[tokio::test]
async fn a_late_pong_does_not_push_the_pong_deadline() {
    let relay = Relay::start().await;
    let (_alice, bob) = pair(&relay).await;
    // A ping every 50 ms, 300 ms to answer each.
    relay.state.streams.set_timers(50, 300);
    let mut ws = live(&relay, &bob).await;
    // The client answers every ping, in order, but only one every 250 ms: each answer is within
    // 300 ms of the previous answer, never of its own ping. The oldest unanswered ping sets
    // the deadline, so the stream closes.
    let started = tokio::time::Instant::now();
    let mut unanswered = std::collections::VecDeque::new();
    let mut answer = tokio::time::interval(Duration::from_millis(250));
    let code = loop {
        tokio::select! {
            next = tokio::time::timeout(WAIT, ws.0.next()) => {
                match next.expect("a frame or the close within the deadline") {
                    Some(Ok(Message::Text(t))) => {
                        let f: Value = serde_json::from_str(t.as_str()).expect("json");
                        assert_eq!(f["type"], "ping", "{f}");
                        unanswered.push_back(f["id"].as_u64().expect("id"));
                    }
                    Some(Ok(Message::Close(Some(f)))) => break u16::from(f.code),
                    Some(Ok(Message::Ping(_) | Message::Pong(_))) => {}
                    other => panic!("{other:?}"),
                }
            }
            _ = answer.tick() => {
                if let Some(id) = unanswered.pop_front() {
                    ws.send(json!({"type": "pong", "id": id})).await;
                }
            }
        }
    };
    assert_eq!(code, close::POLICY);
    assert!(
        started.elapsed() < Duration::from_secs(3),
        "closed only after {:?}",
        started.elapsed()
    );
}

#[tokio::test]
async fn a_stored_item_too_large_for_a_frame_ends_the_replay_before_it() {
    // Items up to 32 KiB now; one of 400 KiB stored earlier (under a larger setting) is
    // larger than any frame this relay writes.
    let relay = Relay::start_with(agentmbx_relay::config::LimitsConfig {
        max_item_bytes: 32 * 1024,
        ..Default::default()
    })
    .await;
    let (alice, bob) = pair(&relay).await;
    let (first, first_seq) = push_one(&relay, &alice, &bob, "small").await;
    let (from, to, now) = (alice.pubkey(), bob.pubkey(), relay.now());
    relay
        .with_store(move |s| {
            s.push(agentmbx_relay::testing::conformance::envelope(
                &from,
                "alice",
                now,
                agentmbx_relay::store::Expiry::Retention,
                "01JBIGBIGBIGBIGBIGBIGBIGBI",
                &to,
                &vec![b'w'; 400 * 1024],
            ))
            .expect("stored")
        })
        .await;
    let (_, last_seq) = push_one(&relay, &alice, &bob, "after").await;
    let mut ws = open(&relay, &bob).await;
    ws.resume("", 0).await;
    let (items, done) = ws.replay().await;
    assert_eq!(items.len(), 1, "{items:?}");
    assert_eq!(items[0]["item_id"], first.as_str());
    assert_eq!(done["replayed"], 1, "{done}");
    assert_eq!(done["head_seq"], last_seq, "{done}");
    // The stream stays open and live (the client pulls the rest).
    let (id, _) = push_one(&relay, &alice, &bob, "live").await;
    let f = non_ping(&mut ws).await;
    assert_eq!(f["item_id"], id.as_str(), "{f}");
    assert!(f["seq"].as_i64() > Some(first_seq));
}

#[tokio::test]
async fn a_text_frame_that_is_not_utf8_closes_with_policy() {
    use tokio_tungstenite::tungstenite::protocol::frame::coding::{Data, OpCode};
    use tokio_tungstenite::tungstenite::protocol::frame::Frame;
    let relay = Relay::start().await;
    let (_alice, bob) = pair(&relay).await;
    let mut ws = live(&relay, &bob).await;
    let bad = Frame::message(vec![b'{', 0xff, 0xfe, b'}'], OpCode::Data(Data::Text), true);
    ws.0.send(Message::Frame(bad)).await.expect("send");
    assert_eq!(ws.closed().await, close::POLICY);
}

#[tokio::test]
async fn a_client_close_is_answered_with_a_close_frame() {
    let relay = Relay::start().await;
    let (_alice, bob) = pair(&relay).await;
    let mut ws = live(&relay, &bob).await;
    ws.0.send(Message::Close(Some(
        tokio_tungstenite::tungstenite::protocol::CloseFrame {
            code: 1000.into(),
            reason: "bye".into(),
        },
    )))
    .await
    .expect("send the close");
    // The relay's reply to the close reaches the client (then the stream ends).
    assert_eq!(ws.closed().await, 1000);
    until("the stream is unregistered", || {
        relay.state.streams.running() == 0
    })
    .await;
}

#[tokio::test]
async fn two_streams_opened_at_once_for_one_key_leave_exactly_one() {
    let relay = Relay::start().await;
    let (alice, bob) = pair(&relay).await;
    let (n1, n2) = (nonce(&relay, &bob).await, nonce(&relay, &bob).await);
    let (a, b) = tokio::join!(upgrade(&relay, &bob, &n1), upgrade(&relay, &bob, &n2));
    let (mut a, mut b) = (a.expect("first opens"), b.expect("second opens"));
    until("one stream left for the key", || {
        relay.state.streams.open() == 1 && relay.state.streams.running() == 1
    })
    .await;
    // One of the two was replaced (4409); the other is live after its resume.
    a.resume("", 0).await;
    b.resume("", 0).await;
    let (mut alive, code) = tokio::select! {
        code = a.closed() => (b, code),
        code = b.closed() => (a, code),
    };
    assert_eq!(code, close::REPLACED);
    alive.replay().await;
    let (id, _) = push_one(&relay, &alice, &bob, "to the survivor").await;
    assert_eq!(non_ping(&mut alive).await["item_id"], id.as_str());
}

#[tokio::test]
async fn a_revocation_between_the_authentication_and_the_registration_closes_the_stream() {
    use crate::helper::ReadHook;
    let (relay, store) = Relay::start_failing().await;
    let (_alice, bob) = pair(&relay).await;
    let n = nonce(&relay, &bob).await;
    // The upgrade's authentication reads the enrolment (live); the revocation commits right
    // before the next read, the one after the registration. The revoke never went through the
    // handler, so only that second read can close the stream.
    store.on_enrolment_read(&bob.pubkey(), 2, ReadHook::Revoke(relay.now()));
    let mut ws = upgrade(&relay, &bob, &n)
        .await
        .expect("authenticated before the revoke");
    assert_eq!(ws.closed().await, close::AUTH);
}

#[tokio::test]
async fn a_store_error_in_the_second_read_closes_with_overload_not_auth() {
    use crate::helper::ReadHook;
    let (relay, store) = Relay::start_failing().await;
    let (_alice, bob) = pair(&relay).await;
    let n = nonce(&relay, &bob).await;
    store.on_enrolment_read(&bob.pubkey(), 2, ReadHook::Fail);
    let mut ws = upgrade(&relay, &bob, &n).await.expect("authenticated");
    assert_eq!(ws.closed().await, close::OVERLOAD);
}

#[tokio::test]
async fn a_resume_from_a_key_denied_without_a_close_request_is_closed_with_4403() {
    let relay = Relay::start().await;
    let (alice, bob) = pair(&relay).await;
    // Not live yet (no resume): the item waits in the queue.
    let mut ws = open(&relay, &bob).await;
    push_one(&relay, &alice, &bob, "queued for bob").await;
    // The deny entry commits without reaching the stream (as when the admin request that made
    // it was dropped after its commit): the next resume reads it and gets no replay.
    deny(&relay, "host", &bob.key.public().fingerprint()).await;
    assert_eq!(relay.state.streams.open(), 1);
    ws.resume("", 0).await;
    loop {
        let next = tokio::time::timeout(WAIT, ws.0.next())
            .await
            .expect("the close within the deadline");
        match next {
            Some(Ok(Message::Close(Some(f)))) => {
                assert_eq!(u16::from(f.code), close::AUTH);
                break;
            }
            Some(Ok(Message::Text(t))) => {
                let f: Value = serde_json::from_str(t.as_str()).expect("a JSON frame");
                assert_ne!(f["type"], "deliver", "a denied key read its queue: {f}");
            }
            Some(Ok(_)) => {}
            other => panic!("expected the close, got {other:?}"),
        }
    }
}

#[tokio::test]
async fn an_idle_stream_of_a_key_denied_without_a_close_request_is_closed_with_4403() {
    let relay = Relay::start().await;
    let (_alice, bob) = pair(&relay).await;
    // A ping every 50 ms: the key is read again every few pings.
    relay.state.streams.set_timers(50, 10_000);
    let mut ws = live(&relay, &bob).await;
    deny(&relay, "host", &bob.key.public().fingerprint()).await;
    assert_eq!(ws.closed().await, close::AUTH);
}

#[tokio::test]
async fn an_epoch_rotation_announces_the_epoch_it_committed_without_reading_it_again() {
    let (relay, store) = Relay::start_failing_with_config(agentmbx_relay::config::RelayConfig {
        admin_token: Some(agentmbx_relay::config::AdminToken::new(ADMIN).expect("token")),
        ..Default::default()
    })
    .await;
    let (_alice, bob) = pair(&relay).await;
    let old = relay.epoch().await;
    let mut ws = open(&relay, &bob).await;
    ws.resume(&old, 0).await;
    ws.replay().await;
    // Reading the epoch alone fails from now on: the announcement uses the rotation's result.
    store.fail_epoch_reads();
    let headers = vec![
        ("content-type".to_owned(), "application/json".to_owned()),
        ("authorization".to_owned(), format!("Bearer {ADMIN}")),
    ];
    let r = relay
        .send(
            "POST",
            "/v2/relay/admin/rotate-epoch",
            &headers,
            b"{}".to_vec(),
        )
        .await;
    r.assert_ok();
    let new = r.json["to"].as_str().expect("the receipt's new epoch");
    assert_ne!(new, old);
    assert_eq!(
        non_ping(&mut ws).await,
        json!({"type": "epoch", "epoch": new})
    );
}

#[tokio::test]
async fn a_long_replay_under_traffic_carries_the_live_frames_it_dropped_without_lagged() {
    use agentmbx_protocol::stream::STREAM_QUEUE_BYTES;
    let relay = Relay::start().await;
    let (alice, bob) = pair(&relay).await;
    // Two senders: each stays within the relay's per-sender rate.
    let carol = Host::new("carol");
    relay.enrol(&carol).await;
    let senders = [&alice, &carol];
    // A backlog far larger than one replay chunk and what the kernel buffers: 100 items of a
    // 16 KiB body (sealed and signed, about 44 KB of wire bytes each), with the 20 live ones
    // about 5.3 MB, within one pull page (8 MiB).
    let body = "y".repeat(16 * 1024);
    let mut pushed = Vec::new();
    for i in 0..100 {
        pushed.push(push_one(&relay, senders[i % 2], &bob, &body).await.1);
    }
    let hub = relay.state.streams.clone();
    let mut ws = open_slow(&relay, &bob).await;
    ws.resume("", 0).await;
    // The replay runs: its first frame arrives. Then the client stops reading, and the replay
    // (about 5.9 MB of frames) stalls on what the kernel buffers.
    let first = ws.frame().await;
    assert_eq!(
        (first["type"].as_str(), first["seq"].as_i64()),
        (Some("deliver"), Some(pushed[0])),
        "{first}"
    );
    // Live items committed meanwhile: far more than the stream's queue holds.
    for i in 0..20 {
        pushed.push(push_one(&relay, senders[i % 2], &bob, &body).await.1);
        assert!(
            hub.budget_used() <= 2 * STREAM_QUEUE_BYTES,
            "{}",
            hub.budget_used()
        );
    }
    let stats = hub.stats();
    assert!(
        stats["dropped_frames"].as_u64().expect("dropped") > 0,
        "the queue overflowed while the replay ran: {stats}"
    );
    // Reading again: the replay carries every item (the page bound covers them all), in order
    // and contiguous, then resume_complete; the dropped live frames were all replayed, so no
    // `lagged` and nothing twice.
    let (mut items, done) = ws.replay().await;
    items.insert(0, first);
    let got: Vec<i64> = items
        .iter()
        .map(|f| f["seq"].as_i64().expect("seq"))
        .collect();
    assert_eq!(got, pushed, "every item once, in order");
    let prev = *pushed.last().expect("pushed");
    assert_eq!(done["replayed"], 120);
    assert_eq!(hub.stats()["lagged"], 0, "{}", hub.stats());
    // Live after it: the next item comes once, as a live frame.
    let (id, seq) = push_one(&relay, &carol, &bob, "after the replay").await;
    let f = non_ping(&mut ws).await;
    assert_eq!(
        (f["type"].as_str(), f["item_id"].as_str()),
        (Some("deliver"), Some(id.as_str())),
        "{f}"
    );
    assert_eq!(
        (
            f["seq"].as_i64(),
            f["prev_seq"].as_i64(),
            f["replay"].as_bool()
        ),
        (Some(seq), Some(prev), Some(false))
    );
    drop(ws);
    until("the stream's bytes return to the budget", || {
        hub.running() == 0 && hub.budget_used() == 0
    })
    .await;
}

#[tokio::test]
async fn a_full_relay_budget_ends_the_replay_early_and_the_stream_stays_open() {
    use agentmbx_protocol::stream::RELAY_STREAM_BUDGET_BYTES;
    let relay = Relay::start().await;
    let (alice, bob) = pair(&relay).await;
    let mut last = 0;
    for i in 0..3 {
        last = push_one(&relay, &alice, &bob, &format!("m{i}")).await.1;
    }
    let hub = relay.state.streams.clone();
    // Other streams hold the whole relay-wide budget.
    let held = RELAY_STREAM_BUDGET_BYTES - hub.budget_used();
    assert!(hub.reserve_bytes(held));
    let mut ws = open(&relay, &bob).await;
    ws.resume("", 0).await;
    // No chunk can be had: the replay ends at once and names the head (the client pulls).
    let (items, done) = ws.replay().await;
    assert!(items.is_empty(), "{items:?}");
    assert_eq!(
        (done["replayed"].as_u64(), done["head_seq"].as_i64()),
        (Some(0), Some(last))
    );
    // Not closed: once the budget has room, a resume replays.
    hub.release_bytes(held);
    ws.resume("", 0).await;
    let (items, done) = ws.replay().await;
    assert_eq!(items.len(), 3);
    assert_eq!(done["replayed"], 3);
    let (id, _) = push_one(&relay, &alice, &bob, "live").await;
    assert_eq!(non_ping(&mut ws).await["item_id"], id.as_str());
    assert_eq!(hub.stats()["closes"], json!({}), "{}", hub.stats());
    drop(ws);
    until("the stream's bytes return to the budget", || {
        hub.running() == 0 && hub.budget_used() == 0
    })
    .await;
}
