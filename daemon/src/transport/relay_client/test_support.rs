//! A fake relay for the relay-client tests: an axum router served in-process on 127.0.0.1:0
//! whose answers each test scripts per route, with real `mailbox.db` files, and the host under
//! test ([`Setup`]: this host `home` with peer `work`, the fake relay and a client).
//!
//! Every request the fake receives is logged with whether its signed hop verified against the
//! client's host key, so the tests also check that each call is a correctly signed v2 hop.
//!
//! Shared by the unit tests of every relay-client module (`pull`, `push`, `session`, `state`,
//! `allowlist` and the loop in `mod.rs`); it holds fixtures only, never a test.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use axum::body::Bytes;
use axum::extract::State;
use axum::http::{HeaderMap, Method, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use axum::{Json, Router};
use serde_json::{json, Value};

use agentmbx_protocol::clock::{ManualClock, SharedClock};
use agentmbx_protocol::keys::{HostKey, PublicKey};
use agentmbx_protocol::records::{AcceptStatement, AcceptTarget, EncAd};
use agentmbx_protocol::time::iso_ms;
use agentmbx_protocol::wire::{Limits, PullItem, PushRequest};
use agentmbx_protocol::{b64, hash, hop};

use crate::identity::Identity;
use crate::mailbox::{outbox, peers, relay_state};
use crate::testutil::{self, Store, T0};
use crate::transport::relay_client::session::Session;
use crate::transport::relay_client::state::{self as relay_trust};
use crate::transport::relay_client::{RelayClient, RelayError};

// ---- the fake relay ---------------------------------------------------------------------------

/// One request as the fake relay saw it.
#[derive(Debug, Clone)]
pub(crate) struct Req {
    pub(crate) method: String,
    pub(crate) path: String,
    pub(crate) query: HashMap<String, String>,
    pub(crate) body: String,
    /// The v2 hop verified with the client's host key over the exact path + query and body.
    pub(crate) hop_ok: bool,
    /// The `Authorization` header as sent ("" when absent).
    pub(crate) authorization: String,
}

impl Req {
    pub(crate) fn json(&self) -> Value {
        serde_json::from_str(&self.body).unwrap_or(Value::Null)
    }
    pub(crate) fn q(&self, k: &str) -> &str {
        self.query.get(k).map_or("", String::as_str)
    }
}

pub(crate) type Answer = (u16, Value);

pub(crate) type Handler = Box<dyn FnMut(&Req) -> Answer + Send>;

pub(crate) struct FakeState {
    pub(crate) handlers: Mutex<HashMap<String, Handler>>,
    pub(crate) log: Mutex<Vec<Req>>,
    pub(crate) client_key: PublicKey,
    pub(crate) clock: Arc<ManualClock>,
}

pub(crate) struct FakeRelay {
    pub(crate) url: String,
    pub(crate) key: HostKey,
    pub(crate) state: Arc<FakeState>,
    pub(crate) task: tokio::task::JoinHandle<()>,
}

impl Drop for FakeRelay {
    fn drop(&mut self) {
        self.task.abort();
    }
}

pub(crate) fn percent_decode(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'%' && i + 2 < b.len() {
            if let Ok(v) = u8::from_str_radix(std::str::from_utf8(&b[i + 1..i + 3]).unwrap(), 16) {
                out.push(v);
                i += 3;
                continue;
            }
        }
        out.push(if b[i] == b'+' { b' ' } else { b[i] });
        i += 1;
    }
    String::from_utf8(out).unwrap()
}

pub(crate) async fn fake_handle(
    State(s): State<Arc<FakeState>>,
    method: Method,
    uri: Uri,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let target = uri.path_and_query().map_or("/", |p| p.as_str()).to_string();
    let body = String::from_utf8(body.to_vec()).unwrap();
    let header = |k: &str| {
        headers
            .get(k)
            .and_then(|v| v.to_str().ok())
            .unwrap_or("")
            .to_string()
    };
    let hop_ok = header(hop::header::KEY) == s.client_key.to_b64()
        && hop::verify_relay_hop(
            &s.client_key,
            method.as_str(),
            &target,
            &header(hop::header::TS),
            &body,
            &header(hop::header::SIG),
            agentmbx_protocol::clock::Clock::now_ms(&*s.clock),
        )
        .is_ok();
    let query = uri
        .query()
        .unwrap_or("")
        .split('&')
        .filter(|p| !p.is_empty())
        .map(|p| {
            let (k, v) = p.split_once('=').unwrap_or((p, ""));
            (percent_decode(k), percent_decode(v))
        })
        .collect();
    let req = Req {
        method: method.to_string(),
        path: uri.path().to_string(),
        query,
        body,
        hop_ok,
        authorization: header("authorization"),
    };
    s.log.lock().unwrap().push(req.clone());
    let route = format!("{} {}", req.method, req.path);
    let answer = match s.handlers.lock().unwrap().get_mut(&route) {
        Some(h) => h(&req),
        None => (404, json!({"error": "not found", "code": "NOT_FOUND"})),
    };
    (StatusCode::from_u16(answer.0).unwrap(), Json(answer.1)).into_response()
}

impl FakeRelay {
    pub(crate) async fn start(client_key: PublicKey, clock: Arc<ManualClock>) -> Self {
        let state = Arc::new(FakeState {
            handlers: Mutex::new(HashMap::new()),
            log: Mutex::new(Vec::new()),
            client_key,
            clock,
        });
        let app = Router::new()
            .fallback(fake_handle)
            .with_state(state.clone());
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let task = tokio::spawn(async move {
            let _ = axum::serve(listener, app).await;
        });
        FakeRelay {
            url,
            key: HostKey::generate(),
            state,
            task,
        }
    }

    /// Scripts the answers of `route` (`"POST /v2/relay/items"`).
    pub(crate) fn on(&self, route: &str, h: impl FnMut(&Req) -> Answer + Send + 'static) {
        self.state
            .handlers
            .lock()
            .unwrap()
            .insert(route.to_string(), Box::new(h));
    }

    /// The requests seen on `route`, oldest first.
    pub(crate) fn seen(&self, route: &str) -> Vec<Req> {
        self.state
            .log
            .lock()
            .unwrap()
            .iter()
            .filter(|r| format!("{} {}", r.method, r.path) == route)
            .cloned()
            .collect()
    }

    pub(crate) fn assert_hops_ok(&self) {
        for r in self.state.log.lock().unwrap().iter() {
            assert!(
                r.hop_ok,
                "unsigned or badly signed hop: {} {}",
                r.method, r.path
            );
        }
    }
}

// ---- records the fake signs --------------------------------------------------------------------

pub(crate) fn limits() -> Limits {
    Limits {
        max_item_bytes: 786_432,
        max_batch: 200,
        max_pull: 100,
        max_pull_bytes: 4 << 20,
        max_targets: 64,
        retention_days: 14,
        max_queue_items: 10_000,
        max_queue_bytes: 52_428_800,
        max_sender_items: 2_000,
        max_sender_bytes: 20_971_520,
        max_owner_items: 10_000,
        max_owner_bytes: 52_428_800,
    }
}

pub(crate) fn session(epoch: &str) -> Session {
    Session {
        epoch: epoch.into(),
        limits: limits(),
        head_seq: 0,
        stream_nonce: None,
    }
}

/// What a relay signs for one item with one target.
#[derive(Clone)]
pub(crate) struct AcceptSpec {
    pub(crate) signer: HostKey,
    pub(crate) relay_pubkey: String,
    pub(crate) epoch: String,
    pub(crate) sender: String,
    pub(crate) item_id: String,
    pub(crate) target: String,
    pub(crate) wire_hash: String,
    pub(crate) seq: i64,
    pub(crate) at: i64,
}

impl AcceptSpec {
    pub(crate) fn signed(&self) -> (Value, String) {
        let st = AcceptStatement {
            v: 1,
            kind: "relay-accept".into(),
            relay_pubkey: self.relay_pubkey.clone(),
            epoch: self.epoch.clone(),
            sender_pubkey: self.sender.clone(),
            item_id: self.item_id.clone(),
            targets: vec![AcceptTarget {
                host_pubkey: self.target.clone(),
                seq: self.seq,
                wire_hash: self.wire_hash.clone(),
            }],
            at: iso_ms(self.at),
        };
        let sig = st.sign(&self.signer);
        (serde_json::to_value(&st).unwrap(), sig)
    }
}

/// The pushed envelope items of a request, with the decoded wire bytes of their (single)
/// target. Receipt items travel in requests of their own ([`pushed_receipts`]).
pub(crate) fn pushed_items(req: &Req) -> Vec<(String, String, Vec<u8>)> {
    let p: PushRequest = serde_json::from_str(&req.body).unwrap();
    p.items
        .into_iter()
        .filter(|i| i.kind != "receipt")
        .map(|i| {
            assert_eq!(i.kind, "envelope");
            assert_eq!(i.targets.len(), 1, "one target per item");
            let t = &i.targets[0];
            (
                i.item_id.clone(),
                t.host_pubkey.clone(),
                b64::decode(&t.wire_b64).unwrap(),
            )
        })
        .collect()
}

/// A push handler answering every item with `status` and an accept that `tweak` may alter
/// (the default is an accept signed by the relay key at seq 1000 + index, with an empty
/// sender that `tweak` sets).
pub(crate) fn push_answer(
    relay_key: HostKey,
    epoch: &str,
    status: &'static str,
    tweak: impl Fn(&mut AcceptSpec) + Send + 'static,
) -> impl FnMut(&Req) -> Answer + Send + 'static {
    let epoch = epoch.to_string();
    move |req: &Req| {
        let results: Vec<Value> = pushed_items(req)
            .into_iter()
            .enumerate()
            .map(|(n, (item_id, target, wire))| {
                let mut spec = AcceptSpec {
                    signer: relay_key.clone(),
                    relay_pubkey: relay_key.public().to_b64(),
                    epoch: epoch.clone(),
                    // Each test names the sender (normally this host) in `tweak`.
                    sender: String::new(),
                    item_id: item_id.clone(),
                    target: target.clone(),
                    wire_hash: hash::sha256_hex(&wire),
                    seq: 1000 + n as i64,
                    at: T0,
                };
                tweak(&mut spec);
                let (accept, sig) = spec.signed();
                json!({"item_id": item_id, "status": status,
                       "targets": [{"host_pubkey": target, "seq": spec.seq}],
                       "accept": accept, "sig": sig})
            })
            .collect();
        (200, json!({ "results": results }))
    }
}

/// A rejecting push handler.
pub(crate) fn push_reject(status: &'static str) -> impl FnMut(&Req) -> Answer + Send + 'static {
    move |req: &Req| {
        let results: Vec<Value> = pushed_items(req)
            .into_iter()
            .map(|(id, _, _)| json!({"item_id": id, "status": status, "targets": []}))
            .collect();
        (200, json!({ "results": results }))
    }
}

// ---- the host under test ---------------------------------------------------------------------

/// This host `home` (agent alice) with peer `work` (agent bob), a fake relay and a client.
pub(crate) struct Setup {
    pub(crate) store: Store,
    pub(crate) clock: Arc<ManualClock>,
    pub(crate) me: Arc<Identity>,
    pub(crate) peer: Identity,
    pub(crate) relay: FakeRelay,
    pub(crate) client: RelayClient,
}

impl Setup {
    pub(crate) async fn new(peer_enc_known: bool) -> Self {
        crate::install_tls_provider();
        let store = testutil::store();
        let clock = testutil::clock();
        let me = Arc::new(testutil::identity("home"));
        let peer = testutil::identity("work");
        store.add_peer(&peer, peer_enc_known);
        // alice has a mailbox here: mail from work for alice@home is delivered, not held.
        store.register("home", &["alice"]);
        let relay = FakeRelay::start(me.host_key.public(), clock.clone()).await;
        let client = Self::client_for(&relay.url, &relay.key, &me, &store, &clock);
        Setup {
            store,
            clock,
            me,
            peer,
            relay,
            client,
        }
    }

    pub(crate) fn client_for(
        url: &str,
        relay_key: &HostKey,
        me: &Arc<Identity>,
        store: &Store,
        clock: &Arc<ManualClock>,
    ) -> RelayClient {
        let shared: SharedClock = clock.clone();
        RelayClient::new(
            url,
            relay_key.public(),
            me.clone(),
            store.mailbox.clone(),
            shared,
        )
        .unwrap()
    }

    pub(crate) fn me_pub(&self) -> String {
        self.me.host_key.public().to_b64()
    }

    pub(crate) fn peer_pub(&self) -> String {
        self.peer.host_key.public().to_b64()
    }

    /// alice@home → bob@work: one pending outbox row for `work`. Returns the message id.
    pub(crate) fn send_to_peer(&self, id: &str) -> String {
        let out = self
            .store
            .send(
                &self.me,
                "alice",
                &["bob@work"],
                "hello",
                id,
                self.clock_now(),
            )
            .unwrap();
        assert_eq!(out.queued_for_hosts, vec!["work".to_string()]);
        out.id
    }

    pub(crate) fn clock_now(&self) -> i64 {
        agentmbx_protocol::clock::Clock::now_ms(&*self.clock)
    }

    pub(crate) fn row(&self, id: &str) -> outbox::Row {
        self.store
            .mailbox
            .with(|c| outbox::get(c, id, "work"))
            .unwrap()
            .expect("outbox row")
    }

    /// The accept and accept_sig stored on a row.
    pub(crate) fn stored_accept(&self, id: &str) -> (Option<String>, Option<String>, Option<i64>) {
        self.store
            .fresh_conn()
            .query_row(
                "SELECT accept, accept_sig, deadline_at FROM outbox WHERE msg_id = ?1",
                [id],
                |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)),
            )
            .unwrap()
    }

    /// A correct push handler: accepted, signed by the relay key, for this host as sender.
    pub(crate) fn accept_all(&self, epoch: &str, status: &'static str) {
        let me = self.me_pub();
        self.relay.on(
            "POST /v2/relay/items",
            push_answer(self.relay.key.clone(), epoch, status, move |s| {
                s.sender = me.clone()
            }),
        );
    }

    /// After one failed push attempt: pending, attempts 1, next_at moved by the first backoff,
    /// no accept, and the sealed wire bytes kept (equal to what was pushed, if it was).
    pub(crate) fn assert_pending_after_one_failure(&self, id: &str, now: i64, error_part: &str) {
        let row = self.assert_failed_once(id, now, error_part);
        let wire = row.wire.expect("sealed and persisted before the push");
        assert_eq!(row.wire_hash, Some(hash::sha256_hex(&wire)));
        if let Some(last) = self.relay.seen("POST /v2/relay/items").last() {
            let pushed = pushed_items(last)
                .into_iter()
                .find(|p| p.0 == id)
                .expect("the row was pushed");
            assert_eq!(pushed.2, wire, "the pushed bytes are the persisted ones");
        }
    }

    /// After one attempt that could not seal (no usable enc key): pending, no wire at all.
    pub(crate) fn assert_pending_unsealed(&self, id: &str, now: i64, error_part: &str) {
        let row = self.assert_failed_once(id, now, error_part);
        assert_eq!((row.wire, row.wire_hash), (None, None), "never sealed");
    }

    pub(crate) fn assert_failed_once(&self, id: &str, now: i64, error_part: &str) -> outbox::Row {
        let row = self.row(id);
        assert_eq!(row.state, "pending", "{row:?}");
        assert_eq!(row.attempts, 1, "{row:?}");
        assert_eq!(row.next_at, now + outbox::backoff_ms(0), "{row:?}");
        assert!(
            row.last_error.as_deref().unwrap_or("").contains(error_part),
            "last_error {:?} should mention {error_part:?}",
            row.last_error
        );
        assert_eq!(row.seq, None);
        assert_eq!(row.epoch, None);
        assert_eq!(self.stored_accept(id).0, None);
        row
    }
}

// ---- sender ------------------------------------------------------------------------------------

pub(crate) const ID1: &str = "01KDVDNA3VG2MH8KWSQRCWJZ0S";

pub(crate) const ID2: &str = "01KDVDNA3VG2MH8KWSQRCWJZ0T";

// ---- enc key learning --------------------------------------------------------------------------

/// A `GET /v2/relay/enc-key` answer for `peer`: `ad` signed by `signer`, `served_enc` as the
/// top-level `enc_pub`.
pub(crate) fn enc_answer(peer: &Identity, ad: &EncAd, signer: &HostKey, served_enc: &str) -> Value {
    json!({
        "host": peer.host.as_str(),
        "host_pubkey": peer.host_key.public().to_b64(),
        "enc_pub": served_enc,
        "ad": ad.to_value(),
        "ad_sig": ad.sign(signer),
    })
}

// ---- receiver ----------------------------------------------------------------------------------

/// A pull item for `wire` pushed by `sender`.
pub(crate) fn item(seq: i64, id: &str, sender: &str, wire: &[u8]) -> PullItem {
    PullItem {
        seq,
        kind: "envelope".into(),
        item_id: id.into(),
        sender_pubkey: sender.into(),
        wire_b64: b64::encode(wire),
    }
}

pub(crate) fn page(epoch: &str, head: i64, items: &[PullItem], more: bool) -> Value {
    let last = items.iter().map(|i| i.seq).max().unwrap_or(0);
    json!({"epoch": epoch, "head_seq": head, "items": items, "last_seq": last, "more": more})
}

/// A relay queue for this host: pages after `after`, 409 on another epoch, ack with BAD_ACK
/// past the head (the real relay's rules).
#[derive(Debug, Default)]
pub(crate) struct Queue {
    pub(crate) epoch: String,
    pub(crate) items: Vec<PullItem>,
    pub(crate) head_override: Option<i64>,
}

impl Queue {
    pub(crate) fn head(&self) -> i64 {
        self.head_override
            .unwrap_or_else(|| self.items.iter().map(|i| i.seq).max().unwrap_or(0))
    }
}

pub(crate) fn serve_queue(relay: &FakeRelay, q: Arc<Mutex<Queue>>) {
    let q2 = q.clone();
    relay.on("GET /v2/relay/items", move |req| {
        let q = q.lock().unwrap();
        if req.q("epoch") != q.epoch {
            return (
                409,
                json!({"error": "stale epoch", "code": "EPOCH", "epoch": q.epoch, "head_seq": q.head()}),
            );
        }
        let after: i64 = req.q("after").parse().unwrap();
        let limit: usize = req.q("limit").parse().unwrap();
        let mut rest: Vec<PullItem> = q.items.iter().filter(|i| i.seq > after).cloned().collect();
        rest.sort_by_key(|i| i.seq);
        let more = rest.len() > limit;
        rest.truncate(limit);
        (200, page(&q.epoch, q.head(), &rest, more))
    });
    relay.on("POST /v2/relay/ack", move |req| {
        let q = q2.lock().unwrap();
        let body = req.json();
        if body["epoch"] != q.epoch.as_str() {
            return (
                409,
                json!({"error": "stale epoch", "code": "EPOCH", "epoch": q.epoch, "head_seq": q.head()}),
            );
        }
        let through = body["through"].as_i64().unwrap();
        if through > q.head() {
            return (
                400,
                json!({"error": "ack beyond head", "code": "BAD_ACK", "epoch": q.epoch, "head_seq": q.head()}),
            );
        }
        (
            200,
            json!({"acked_through": through, "deleted": 0, "head_seq": q.head()}),
        )
    });
}

impl Setup {
    /// A sealed envelope bob@work → alice@home, as the peer pushes it.
    pub(crate) fn peer_wire(&self, id: &str, subject: &str) -> Vec<u8> {
        testutil::sealed_wire(
            &self.peer,
            &self.me.enc_key.public(),
            id,
            "bob@work",
            &["alice@home"],
            subject,
            T0,
        )
    }

    pub(crate) fn position(&self) -> relay_state::Position {
        let url = self.client.url.clone();
        self.store
            .mailbox
            .with(|c| relay_state::position(c, &url))
            .unwrap()
            .expect("a position")
    }

    pub(crate) fn messages(&self) -> i64 {
        self.store.scalar("SELECT COUNT(*) FROM messages")
    }

    pub(crate) fn deliveries(&self) -> i64 {
        self.store.scalar("SELECT COUNT(*) FROM deliveries")
    }

    pub(crate) fn acks(&self) -> Vec<Value> {
        self.relay
            .seen("POST /v2/relay/ack")
            .iter()
            .map(Req::json)
            .collect()
    }

    pub(crate) fn pull_afters(&self) -> Vec<(String, String)> {
        self.relay
            .seen("GET /v2/relay/items")
            .iter()
            .map(|r| (r.q("after").to_string(), r.q("epoch").to_string()))
            .collect()
    }
}

// ---- session -----------------------------------------------------------------------------------

pub(crate) fn info(relay_key: &HostKey, epoch: &str, you: Option<Value>) -> Value {
    let mut v = json!({"v": 2, "relay_pubkey": relay_key.public().to_b64(), "epoch": epoch,
                       "version": "test", "limits": serde_json::to_value(limits()).unwrap()});
    if let Some(y) = you {
        v["you"] = y;
    }
    v
}

impl FakeRelay {
    /// Like [`Self::assert_hops_ok`], but the unauthenticated enrolment calls carry no hop.
    pub(crate) fn assert_hops_ok_except_plain(&self) {
        for r in self.state.log.lock().unwrap().iter() {
            if r.path.starts_with("/v1/relay/") {
                continue;
            }
            assert!(r.hop_ok, "badly signed hop: {} {}", r.method, r.path);
        }
    }
}

/// Polls `f` every 20 ms until it holds, for at most 10 s.
pub(crate) async fn wait_for(what: &str, f: impl Fn() -> bool) {
    let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(10);
    while !f() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "timed out waiting for {what}"
        );
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
}

// ---- delivery receipts over the relay (spec §9) -------------------------------------------------

/// The pushed receipt items of a request: (item id, target, wire).
pub(crate) fn pushed_receipts(req: &Req) -> Vec<(String, String, Vec<u8>)> {
    let p: PushRequest = serde_json::from_str(&req.body).unwrap();
    p.items
        .into_iter()
        .filter(|i| i.kind == "receipt")
        .map(|i| {
            assert_eq!(i.targets.len(), 1, "one target per receipt");
            let t = &i.targets[0];
            (
                i.item_id.clone(),
                t.host_pubkey.clone(),
                b64::decode(&t.wire_b64).unwrap(),
            )
        })
        .collect()
}

/// A push handler accepting every receipt item with an accept signed by `relay_key` for
/// `sender`, or answering `status` when it is not `accepted`/`duplicate`.
pub(crate) fn receipt_answer(
    relay_key: HostKey,
    sender: String,
    status: &'static str,
) -> impl FnMut(&Req) -> Answer + Send + 'static {
    move |req: &Req| {
        let results: Vec<Value> = pushed_receipts(req)
            .into_iter()
            .enumerate()
            .map(|(n, (item_id, target, wire))| {
                if status != "accepted" && status != "duplicate" {
                    return json!({"item_id": item_id, "status": status, "targets": []});
                }
                let spec = AcceptSpec {
                    signer: relay_key.clone(),
                    relay_pubkey: relay_key.public().to_b64(),
                    epoch: "e1".into(),
                    sender: sender.clone(),
                    item_id: item_id.clone(),
                    target: target.clone(),
                    wire_hash: hash::sha256_hex(&wire),
                    seq: 2000 + n as i64,
                    at: T0,
                };
                let (accept, sig) = spec.signed();
                json!({"item_id": item_id, "status": status,
                       "targets": [{"host_pubkey": target, "seq": spec.seq}],
                       "accept": accept, "sig": sig})
            })
            .collect();
        (200, json!({ "results": results }))
    }
}

impl Setup {
    /// Mail bob@work → alice@home received here (as from the relay), and alice reads it: two
    /// receipts owed to work (delivered, then read). Returns the message id.
    pub(crate) fn receive_and_read(&self, id: &str) -> String {
        let wire = self.peer_wire(id, "for alice");
        let peer = self.peer_pub();
        let me = self.me.clone();
        self.store
            .mailbox
            .with(|c| {
                let v = crate::node::receive::receive_sealed(c, &me, &wire, id, &peer, T0)?;
                assert!(v.is_ok(), "{v:?}");
                crate::mailbox::messages::read(c, "alice", "home", id, T0)?;
                Ok(())
            })
            .unwrap();
        id.to_string()
    }

    pub(crate) fn receipt_rows(&self) -> Vec<(i64, String, u32, u32)> {
        self.store
            .fresh_conn()
            .prepare("SELECT seq, state, attempts, lan_failures FROM receipt_outbox ORDER BY seq")
            .unwrap()
            .query_map([], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?)))
            .unwrap()
            .collect::<Result<_, _>>()
            .unwrap()
    }
}

// ---- the 72 h rule and the hand-back to the LAN -------------------------------------------------

impl Setup {
    /// The (subject, body) of every alert in alice's inbox, oldest first.
    pub(crate) fn alerts(&self) -> Vec<(String, String)> {
        let c = self.store.fresh_conn();
        let mut st = c
            .prepare(
                "SELECT m.subject, m.body FROM messages m JOIN deliveries d ON d.msg_id = m.id
                 WHERE m.kind = 'alert' AND d.agent = 'alice' ORDER BY m.rowid",
            )
            .unwrap();
        st.query_map([], |r| Ok((r.get(0)?, r.get(1)?)))
            .unwrap()
            .collect::<Result<_, _>>()
            .unwrap()
    }

    /// Gives `work` a LAN address.
    pub(crate) fn lan_addr(&self) {
        self.store
            .mailbox
            .with(|c| peers::set_addr(c, "work", "127.0.0.1:1", "cli"))
            .unwrap();
    }
}

pub(crate) const DAY_MS: i64 = 86_400_000;

/// A scripted relay that behaves: it serves `served` as its key in `epoch`, shows `you` (with a
/// fresh ad of this host) while `enrolled`, enrols on challenge + enrol, takes enc-key ads and
/// sender lists (recorded in `lists`), accepts pushes signed by the served key, and serves
/// `queue` for pulls and acks.
pub(crate) struct Trusty {
    pub(crate) served: Arc<Mutex<HostKey>>,
    pub(crate) epoch: Arc<Mutex<String>>,
    pub(crate) enrolled: Arc<std::sync::atomic::AtomicBool>,
    pub(crate) lists: Arc<Mutex<Vec<Value>>>,
    pub(crate) queue: Arc<Mutex<Queue>>,
}

impl Setup {
    pub(crate) fn trusty(&self) -> Trusty {
        use std::sync::atomic::{AtomicBool, Ordering};
        let t = Trusty {
            served: Arc::new(Mutex::new(self.relay.key.clone())),
            epoch: Arc::new(Mutex::new("e1".into())),
            enrolled: Arc::new(AtomicBool::new(true)),
            lists: Arc::new(Mutex::new(Vec::new())),
            queue: Arc::new(Mutex::new(Queue {
                epoch: "e1".into(),
                items: Vec::new(),
                head_override: None,
            })),
        };
        let (me, enc) = (self.me_pub(), self.me.enc_key.public().to_b64());
        let (served, epoch, enrolled, clock) = (
            t.served.clone(),
            t.epoch.clone(),
            t.enrolled.clone(),
            self.clock.clone(),
        );
        self.relay.on("GET /v2/relay/info", move |_| {
            let now = agentmbx_protocol::clock::Clock::now_ms(&*clock);
            let you = enrolled.load(Ordering::SeqCst).then(|| {
                json!({"host": "home", "pubkey": me, "head_seq": 0, "acked_through": 0,
                       "enc_ad": {"enc_pub": enc, "exp": iso_ms(now + 30 * DAY_MS), "v1": false}})
            });
            let key = served.lock().unwrap().clone();
            let ep = epoch.lock().unwrap().clone();
            (200, info(&key, &ep, you))
        });
        self.relay.on("POST /v1/relay/challenge", |_| {
            (200, json!({"challenge": "Y2hhbGxlbmdl"}))
        });
        let enrolled = t.enrolled.clone();
        self.relay.on("POST /v1/relay/enrol", move |_| {
            enrolled.store(true, Ordering::SeqCst);
            (200, json!({"ok": true}))
        });
        self.relay
            .on("POST /v2/relay/enc-key", |_| (200, json!({"ok": true})));
        let lists = t.lists.clone();
        self.relay.on("POST /v2/relay/senders", move |req| {
            lists.lock().unwrap().push(req.json());
            (200, json!({"ok": true}))
        });
        let (me, served, epoch) = (self.me_pub(), t.served.clone(), t.epoch.clone());
        self.relay.on("POST /v2/relay/items", move |req| {
            let me = me.clone();
            let key = served.lock().unwrap().clone();
            let ep = epoch.lock().unwrap().clone();
            push_answer(key, &ep, "accepted", move |s| s.sender = me.clone())(req)
        });
        serve_queue(&self.relay, t.queue.clone());
        t
    }

    pub(crate) fn url(&self) -> String {
        self.client.url.clone()
    }

    pub(crate) fn relay_state(&self) -> Option<relay_trust::RelayState> {
        let url = self.url();
        self.store
            .mailbox
            .with(|c| relay_trust::state(c, &url))
            .unwrap()
    }

    pub(crate) fn audits(&self, event: &str) -> Vec<crate::mailbox::audit::AuditEvent> {
        self.store
            .mailbox
            .with(|c| crate::mailbox::audit::recent(c, Some(event), 100))
            .unwrap()
    }

    /// Every request the relay saw, as `METHOD /path`, oldest first.
    pub(crate) fn routes(&self) -> Vec<String> {
        self.relay
            .state
            .log
            .lock()
            .unwrap()
            .iter()
            .map(|r| format!("{} {}", r.method, r.path))
            .collect()
    }

    /// Replaces the handler of `route` so that its first call answers `status` with `code`
    /// (and, for 401, the relay forgets the enrolment), then behaves as before.
    pub(crate) fn refuse_once(&self, route: &str, status: u16, code: &str, t: &Trusty) {
        use std::sync::atomic::Ordering;
        let mut inner = self
            .relay
            .state
            .handlers
            .lock()
            .unwrap()
            .remove(route)
            .expect("a handler to wrap");
        let (enrolled, code) = (t.enrolled.clone(), code.to_string());
        let mut first = true;
        self.relay.on(route, move |req| {
            if std::mem::take(&mut first) {
                if status == 401 {
                    enrolled.store(false, Ordering::SeqCst);
                }
                return (status, json!({"error": "refused", "code": code}));
            }
            inner(req)
        });
    }
}

/// A relay's 429 answer asking for `secs` seconds.
pub(crate) fn too_many(secs: u64) -> Answer {
    (
        429,
        json!({"error": "rate_limit_exceeded", "code": "RATE_LIMIT", "retry_after": secs}),
    )
}

#[track_caller]
pub(crate) fn assert_rate_limited<T: std::fmt::Debug>(got: Result<T, RelayError>, ms: u64) {
    match got {
        Err(RelayError::RateLimited { retry_after_ms }) => assert_eq!(retry_after_ms, ms),
        other => panic!("expected RateLimited({ms} ms), got {other:?}"),
    }
}
