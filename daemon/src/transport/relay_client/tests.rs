//! Tests of the host's relay path against a fake relay: an axum router served in-process on
//! 127.0.0.1:0 whose answers each test scripts per route, with real `mailbox.db` files.
//!
//! Every request the fake receives is logged with whether its signed hop verified against the
//! client's host key, so the tests also check that each call is a correctly signed v2 hop.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use axum::body::Bytes;
use axum::extract::State;
use axum::http::{HeaderMap, Method, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use axum::{Json, Router};
use serde_json::{json, Value};

use agentmbx_protocol::clock::{ManualClock, SharedClock};
use agentmbx_protocol::keys::{EncKey, HostKey, PublicKey};
use agentmbx_protocol::records::{AcceptStatement, AcceptTarget, EncAd};
use agentmbx_protocol::time::iso_ms;
use agentmbx_protocol::wire::{Limits, PullItem, PushRequest};
use agentmbx_protocol::{b64, hash, hop, records, seal};

use super::session::Session;
use super::{RelayClient, RelayError};
use crate::identity::Identity;
use crate::mailbox::{outbox, peers, relay_state};
use crate::testutil::{self, Store, T0};

mod account_tokens;
mod epochs_and_expiry;
mod pins_and_caps;
mod tls_mismatch;

// ---- the fake relay ---------------------------------------------------------------------------

/// One request as the fake relay saw it.
#[derive(Debug, Clone)]
struct Req {
    method: String,
    path: String,
    query: HashMap<String, String>,
    body: String,
    /// The v2 hop verified with the client's host key over the exact path + query and body.
    hop_ok: bool,
    /// The `Authorization` header as sent ("" when absent).
    authorization: String,
}

impl Req {
    fn json(&self) -> Value {
        serde_json::from_str(&self.body).unwrap_or(Value::Null)
    }
    fn q(&self, k: &str) -> &str {
        self.query.get(k).map_or("", String::as_str)
    }
}

type Answer = (u16, Value);
type Handler = Box<dyn FnMut(&Req) -> Answer + Send>;

struct FakeState {
    handlers: Mutex<HashMap<String, Handler>>,
    log: Mutex<Vec<Req>>,
    client_key: PublicKey,
    clock: Arc<ManualClock>,
}

struct FakeRelay {
    url: String,
    key: HostKey,
    state: Arc<FakeState>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for FakeRelay {
    fn drop(&mut self) {
        self.task.abort();
    }
}

fn percent_decode(s: &str) -> String {
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

async fn fake_handle(
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
    async fn start(client_key: PublicKey, clock: Arc<ManualClock>) -> Self {
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
    fn on(&self, route: &str, h: impl FnMut(&Req) -> Answer + Send + 'static) {
        self.state
            .handlers
            .lock()
            .unwrap()
            .insert(route.to_string(), Box::new(h));
    }

    /// The requests seen on `route`, oldest first.
    fn seen(&self, route: &str) -> Vec<Req> {
        self.state
            .log
            .lock()
            .unwrap()
            .iter()
            .filter(|r| format!("{} {}", r.method, r.path) == route)
            .cloned()
            .collect()
    }

    fn assert_hops_ok(&self) {
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

fn limits() -> Limits {
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

fn session(epoch: &str) -> Session {
    Session {
        epoch: epoch.into(),
        limits: limits(),
        head_seq: 0,
    }
}

/// What a relay signs for one item with one target.
#[derive(Clone)]
struct AcceptSpec {
    signer: HostKey,
    relay_pubkey: String,
    epoch: String,
    sender: String,
    item_id: String,
    target: String,
    wire_hash: String,
    seq: i64,
    at: i64,
}

impl AcceptSpec {
    fn signed(&self) -> (Value, String) {
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
fn pushed_items(req: &Req) -> Vec<(String, String, Vec<u8>)> {
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
fn push_answer(
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
fn push_reject(status: &'static str) -> impl FnMut(&Req) -> Answer + Send + 'static {
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
struct Setup {
    store: Store,
    clock: Arc<ManualClock>,
    me: Arc<Identity>,
    peer: Identity,
    relay: FakeRelay,
    client: RelayClient,
}

impl Setup {
    async fn new(peer_enc_known: bool) -> Self {
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

    fn client_for(
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

    fn me_pub(&self) -> String {
        self.me.host_key.public().to_b64()
    }

    fn peer_pub(&self) -> String {
        self.peer.host_key.public().to_b64()
    }

    /// alice@home → bob@work: one pending outbox row for `work`. Returns the message id.
    fn send_to_peer(&self, id: &str) -> String {
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

    fn clock_now(&self) -> i64 {
        agentmbx_protocol::clock::Clock::now_ms(&*self.clock)
    }

    fn row(&self, id: &str) -> outbox::Row {
        self.store
            .mailbox
            .with(|c| outbox::get(c, id, "work"))
            .unwrap()
            .expect("outbox row")
    }

    /// The accept and accept_sig stored on a row.
    fn stored_accept(&self, id: &str) -> (Option<String>, Option<String>, Option<i64>) {
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
    fn accept_all(&self, epoch: &str, status: &'static str) {
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
    fn assert_pending_after_one_failure(&self, id: &str, now: i64, error_part: &str) {
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
    fn assert_pending_unsealed(&self, id: &str, now: i64, error_part: &str) {
        let row = self.assert_failed_once(id, now, error_part);
        assert_eq!((row.wire, row.wire_hash), (None, None), "never sealed");
    }

    fn assert_failed_once(&self, id: &str, now: i64, error_part: &str) -> outbox::Row {
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

const ID1: &str = "01KDVDNA3VG2MH8KWSQRCWJZ0S";
const ID2: &str = "01KDVDNA3VG2MH8KWSQRCWJZ0T";
const ID3: &str = "01KDVDNA3VG2MH8KWSQRCWJZ0V";

#[tokio::test]
async fn rejected_target_not_enrolled_is_retried_with_backoff() {
    let s = Setup::new(true).await;
    let id = s.send_to_peer(ID1);
    s.relay.on(
        "POST /v2/relay/items",
        push_reject("rejected:target not enrolled"),
    );
    let pass = s.client.push_due(&session("e1")).await.unwrap();
    assert_eq!((pass.accepted, pass.failed), (0, 1));
    s.assert_pending_after_one_failure(&id, T0, "target not enrolled");
    let row = s.row(&id);
    // The wire bytes were persisted (and are what was pushed).
    let pushed = pushed_items(&s.relay.seen("POST /v2/relay/items")[0]);
    assert_eq!(row.wire.as_deref(), Some(&pushed[0].2[..]));
    assert_eq!(row.wire_hash, Some(hash::sha256_hex(&pushed[0].2)));
    assert_eq!(pushed[0].1, s.peer_pub(), "targets are keys, never names");
    s.relay.assert_hops_ok();

    // Second failure: attempts 2, next delay doubled.
    s.clock.set(row.next_at);
    s.client.push_due(&session("e1")).await.unwrap();
    let row2 = s.row(&id);
    assert_eq!((row2.state.as_str(), row2.attempts), ("pending", 2));
    assert_eq!(row2.next_at, row.next_at + outbox::backoff_ms(1));
}

#[tokio::test]
async fn rejected_conflict_is_terminal_and_the_row_is_kept() {
    let s = Setup::new(true).await;
    let id = s.send_to_peer(ID1);
    s.relay
        .on("POST /v2/relay/items", push_reject("rejected:conflict"));
    s.client.push_due(&session("e1")).await.unwrap();
    let row = s.row(&id);
    assert_eq!(row.state, "rejected");
    assert_eq!(row.attempts, 1);
    assert_eq!(row.last_error.as_deref(), Some("rejected:conflict"));
    assert!(row.wire.is_none(), "a final row drops its bytes");
    assert!(row.wire_hash.is_some(), "and keeps their hash");
    // A rejected row is not due any more: nothing is pushed again.
    s.clock.advance(10 * 3_600_000);
    s.client.push_due(&session("e1")).await.unwrap();
    assert_eq!(s.relay.seen("POST /v2/relay/items").len(), 1);
    assert_eq!(s.row(&id).state, "rejected");
}

#[tokio::test]
async fn other_rejections_are_retried_and_size_rejections_are_terminal() {
    for (status, terminal) in [
        ("rejected:sender not accepted by target", false),
        ("rejected:quota:target queue full", false),
        ("rejected:rate", false),
        ("rejected:bad wire", true),
        ("rejected:item over size limit", true),
        ("rejected:envelope body is not sealed", true),
        ("rejected:item id is not the envelope id", true),
        ("rejected:duplicate target", true),
        ("something unexpected", false),
    ] {
        let s = Setup::new(true).await;
        let id = s.send_to_peer(ID1);
        s.relay.on("POST /v2/relay/items", push_reject(status));
        s.client.push_due(&session("e1")).await.unwrap();
        let row = s.row(&id);
        let want = if terminal { "rejected" } else { "pending" };
        assert_eq!(row.state, want, "{status}");
        assert_eq!(row.attempts, 1, "{status}");
    }
}

#[tokio::test]
async fn a_missing_result_keeps_the_row_pending() {
    let s = Setup::new(true).await;
    let id = s.send_to_peer(ID1);
    s.relay
        .on("POST /v2/relay/items", |_| (200, json!({"results": []})));
    s.client.push_due(&session("e1")).await.unwrap();
    s.assert_pending_after_one_failure(&id, T0, "missing result");
}

#[tokio::test]
async fn a_result_for_another_item_id_is_a_missing_result() {
    let s = Setup::new(true).await;
    let id = s.send_to_peer(ID1);
    let me = s.me_pub();
    let mut inner = push_answer(s.relay.key.clone(), "e1", "accepted", move |a| {
        a.sender = me.clone()
    });
    s.relay.on("POST /v2/relay/items", move |req| {
        let (code, mut body) = inner(req);
        body["results"][0]["item_id"] = json!(ID2);
        (code, body)
    });
    s.client.push_due(&session("e1")).await.unwrap();
    s.assert_pending_after_one_failure(&id, T0, "missing result");
}

#[tokio::test]
async fn an_accept_signed_by_another_key_keeps_the_row_pending() {
    // The pinned relay key named, but signed by another key.
    let s = Setup::new(true).await;
    let id = s.send_to_peer(ID1);
    let me = s.me_pub();
    let other = HostKey::generate();
    s.relay.on(
        "POST /v2/relay/items",
        push_answer(s.relay.key.clone(), "e1", "accepted", move |a| {
            a.sender = me.clone();
            a.signer = other.clone();
        }),
    );
    s.client.push_due(&session("e1")).await.unwrap();
    s.assert_pending_after_one_failure(&id, T0, "not signed by the pinned relay key");

    // Another relay key named and signing consistently: still not ours.
    let s = Setup::new(true).await;
    let id = s.send_to_peer(ID1);
    let me = s.me_pub();
    let other = HostKey::generate();
    s.relay.on(
        "POST /v2/relay/items",
        push_answer(s.relay.key.clone(), "e1", "accepted", move |a| {
            a.sender = me.clone();
            a.relay_pubkey = other.public().to_b64();
            a.signer = other.clone();
        }),
    );
    s.client.push_due(&session("e1")).await.unwrap();
    s.assert_pending_after_one_failure(&id, T0, "not signed by the pinned relay key");

    // A valid accept with the signature missing.
    let s = Setup::new(true).await;
    let id = s.send_to_peer(ID1);
    let me = s.me_pub();
    let mut inner = push_answer(s.relay.key.clone(), "e1", "accepted", move |a| {
        a.sender = me.clone()
    });
    s.relay.on("POST /v2/relay/items", move |req| {
        let (code, mut body) = inner(req);
        body["results"][0]
            .as_object_mut()
            .unwrap()
            .remove("sig")
            .unwrap();
        (code, body)
    });
    s.client.push_due(&session("e1")).await.unwrap();
    s.assert_pending_after_one_failure(&id, T0, "not signed by the pinned relay key");
}

#[tokio::test]
async fn an_accept_naming_another_wire_hash_keeps_the_row_pending() {
    let s = Setup::new(true).await;
    let id = s.send_to_peer(ID1);
    let me = s.me_pub();
    s.relay.on(
        "POST /v2/relay/items",
        push_answer(s.relay.key.clone(), "e1", "accepted", move |a| {
            a.sender = me.clone();
            a.wire_hash = hash::sha256_hex(b"other bytes");
        }),
    );
    s.client.push_due(&session("e1")).await.unwrap();
    s.assert_pending_after_one_failure(&id, T0, "does not cover this target and wire hash");
}

#[tokio::test]
async fn an_accept_for_another_item_sender_or_target_keeps_the_row_pending() {
    type Tweak = Box<dyn Fn(&mut AcceptSpec, &str) + Send + Sync>;
    let cases: Vec<(Tweak, &str)> = vec![
        (
            Box::new(|a, me| {
                a.sender = me.into();
                a.item_id = ID2.into();
            }),
            "another sender or item",
        ),
        (
            Box::new(|a, _me| a.sender = HostKey::generate().public().to_b64()),
            "another sender or item",
        ),
        (
            Box::new(|a, me| {
                a.sender = me.into();
                a.target = HostKey::generate().public().to_b64();
            }),
            "does not cover this target",
        ),
        (
            Box::new(|a, me| {
                a.sender = me.into();
                a.seq = 0;
            }),
            "does not cover this target",
        ),
    ];
    for (tweak, why) in cases {
        let s = Setup::new(true).await;
        let id = s.send_to_peer(ID1);
        let me = s.me_pub();
        s.relay.on(
            "POST /v2/relay/items",
            push_answer(s.relay.key.clone(), "e1", "accepted", move |a| {
                tweak(a, &me)
            }),
        );
        s.client.push_due(&session("e1")).await.unwrap();
        s.assert_pending_after_one_failure(&id, T0, why);
    }
}

#[tokio::test]
async fn a_valid_duplicate_settles_the_row_with_the_original_seq() {
    let s = Setup::new(true).await;
    let id = s.send_to_peer(ID1);
    let me = s.me_pub();
    let original_at = T0 - 60_000;
    s.relay.on(
        "POST /v2/relay/items",
        push_answer(s.relay.key.clone(), "e7", "duplicate", move |a| {
            a.sender = me.clone();
            a.seq = 1_767_225_600_123;
            a.at = original_at;
        }),
    );
    s.clock.advance(1_000);
    let pass = s.client.push_due(&session("e7")).await.unwrap();
    assert_eq!((pass.accepted, pass.failed), (1, 0));
    let row = s.row(&id);
    assert_eq!(row.state, "relay-accepted");
    assert_eq!(row.seq, Some(1_767_225_600_123));
    assert_eq!(row.epoch.as_deref(), Some("e7"));
    assert_eq!(row.attempts, 0);
    assert_eq!(row.last_error, None);
    let (accept, sig, deadline) = s.stored_accept(&id);
    let accept: Value = serde_json::from_str(&accept.unwrap()).unwrap();
    assert_eq!(accept["type"], "relay-accept");
    assert_eq!(accept["item_id"], id.as_str());
    assert_eq!(accept["at"], iso_ms(original_at));
    assert!(sig.is_some_and(|s| !s.is_empty()));
    // Deadline = accept time + retention (14 d) + 24 h grace (spec §3).
    assert_eq!(
        deadline,
        Some(original_at + 14 * 86_400_000 + 24 * 3_600_000)
    );
    // Settled rows are not due any more.
    s.clock.advance(10 * 3_600_000);
    s.client.push_due(&session("e7")).await.unwrap();
    assert_eq!(s.relay.seen("POST /v2/relay/items").len(), 1);
}

#[tokio::test]
async fn a_network_failure_or_5xx_keeps_the_row_pending() {
    // The relay answers 500.
    let s = Setup::new(true).await;
    let id = s.send_to_peer(ID1);
    s.relay.on("POST /v2/relay/items", |_| {
        (500, json!({"error": "boom", "code": "INTERNAL"}))
    });
    s.client.push_due(&session("e1")).await.unwrap();
    s.assert_pending_after_one_failure(&id, T0, "500");

    // Nobody listens at the relay address any more (connection refused).
    let s = Setup::new(true).await;
    let id = s.send_to_peer(ID1);
    let dead = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        format!("http://{}", l.local_addr().unwrap())
    };
    let client = Setup::client_for(&dead, &s.relay.key, &s.me, &s.store, &s.clock);
    let pass = client.push_due(&session("e1")).await.unwrap();
    assert_eq!(pass.failed, 1);
    // The stored last_error (shown by `sent`) is in our words: no URL, no `os error`.
    s.assert_pending_after_one_failure(&id, T0, "relay unreachable: connection refused");
    assert!(
        s.row(&id).wire.is_some(),
        "sealed and kept before the attempt"
    );

    // A 200 whose body is not a push response.
    let s = Setup::new(true).await;
    let id = s.send_to_peer(ID1);
    s.relay
        .on("POST /v2/relay/items", |_| (200, json!({"stored": 1})));
    s.client.push_due(&session("e1")).await.unwrap();
    s.assert_pending_after_one_failure(&id, T0, "malformed relay answer");
}

#[tokio::test]
async fn wire_bytes_are_persisted_before_the_first_push_and_reused_byte_for_byte() {
    let s = Setup::new(true).await;
    let id = s.send_to_peer(ID1);
    assert_eq!(s.row(&id).wire, None, "sealing happens in the transport");
    // First attempt: the relay checks that the bytes are already committed in mailbox.db,
    // then loses the answer (500).
    let path = s.store.path.clone();
    let committed: Arc<Mutex<Vec<Option<Vec<u8>>>>> = Arc::default();
    let seen = committed.clone();
    let me = s.me_pub();
    let mut accept = push_answer(s.relay.key.clone(), "e1", "accepted", move |a| {
        a.sender = me.clone()
    });
    let mut calls = 0;
    s.relay.on("POST /v2/relay/items", move |req| {
        let c = rusqlite::Connection::open(&path).unwrap();
        let w: Option<Vec<u8>> = c
            .query_row("SELECT wire FROM outbox", [], |r| r.get(0))
            .unwrap();
        seen.lock().unwrap().push(w);
        calls += 1;
        if calls == 1 {
            (500, json!({"error": "lost", "code": "INTERNAL"}))
        } else {
            accept(req)
        }
    });
    s.client.push_due(&session("e1")).await.unwrap();
    let row = s.row(&id);
    assert_eq!(row.state, "pending");
    s.clock.set(row.next_at);
    let pass = s.client.push_due(&session("e1")).await.unwrap();
    assert_eq!(pass.accepted, 1);

    let pushes = s.relay.seen("POST /v2/relay/items");
    assert_eq!(pushes.len(), 2);
    let b64_of = |r: &Req| r.json()["items"][0]["targets"][0]["wire_b64"].clone();
    assert_eq!(
        b64_of(&pushes[0]),
        b64_of(&pushes[1]),
        "same bytes on retry"
    );
    let first = pushed_items(&pushes[0]).remove(0).2;
    let committed = committed.lock().unwrap().clone();
    assert_eq!(committed, vec![Some(first.clone()), Some(first.clone())]);
    let row = s.row(&id);
    assert_eq!(row.state, "relay-accepted");
    assert_eq!(row.wire.as_deref(), Some(&first[..]));
    assert_eq!(row.wire_hash, Some(hash::sha256_hex(&first)));
    // The bytes are sealed for the target and signed by this host: never plaintext.
    let env: Value = serde_json::from_slice(&first).unwrap();
    assert!(env["enc"].is_object());
    assert!(!String::from_utf8_lossy(&first).contains("body of hello"));
    let enc: seal::Enc = serde_json::from_value(env["enc"].clone()).unwrap();
    assert_eq!(
        seal::open(&enc, &s.peer.enc_key, &id).unwrap(),
        "body of hello"
    );
    assert!(agentmbx_protocol::envelope::verify(
        &env,
        &s.me.host_key.public()
    ));
    s.relay.assert_hops_ok();
}

#[tokio::test]
async fn next_at_is_respected() {
    let s = Setup::new(true).await;
    let id = s.send_to_peer(ID1);
    s.relay.on("POST /v2/relay/items", |_| {
        (503, json!({"error": "busy", "code": "BUSY"}))
    });
    s.client.push_due(&session("e1")).await.unwrap();
    let next_at = s.row(&id).next_at;
    assert_eq!(next_at, T0 + outbox::backoff_ms(0));

    // Before next_at: the row is not due, nothing is pushed, nothing changes.
    s.clock.set(next_at - 1);
    let due = s
        .store
        .mailbox
        .with(|c| outbox::due(c, next_at - 1, 10))
        .unwrap();
    assert!(due.is_empty());
    let pass = s.client.push_due(&session("e1")).await.unwrap();
    assert_eq!((pass.accepted, pass.failed), (0, 0));
    assert_eq!(s.relay.seen("POST /v2/relay/items").len(), 1);
    assert_eq!(s.row(&id).attempts, 1);
    assert_eq!(
        s.store
            .mailbox
            .with(|c| outbox::next_due_at(c, next_at - 1))
            .unwrap(),
        Some(next_at)
    );

    // At next_at it is pushed again.
    s.clock.set(next_at);
    s.accept_all("e1", "accepted");
    let pass = s.client.push_due(&session("e1")).await.unwrap();
    assert_eq!(pass.accepted, 1);
    assert_eq!(s.relay.seen("POST /v2/relay/items").len(), 2);
    assert_eq!(s.row(&id).state, "relay-accepted");
    assert_eq!(
        s.store
            .mailbox
            .with(|c| outbox::next_due_at(c, next_at))
            .unwrap(),
        None
    );
}

/// Case `clock-fix-does-not-release-mail` over the relay: with the clock 10 min ahead a row
/// failed once and another was queued after it; once the clock is right again both are due at
/// once (pushed by the next pass, and the loop's wake-up is now), instead of waiting out the
/// skew. A row that fails at the right clock still waits its backoff.
#[tokio::test]
async fn rows_scheduled_under_a_clock_ahead_are_due_once_it_is_right() {
    const SKEW: i64 = 600_000;
    let s = Setup::new(true).await;
    s.clock.set(T0 + SKEW);
    let failed = s.send_to_peer(ID1);
    s.relay.on("POST /v2/relay/items", |_| {
        (503, json!({"error": "busy", "code": "BUSY"}))
    });
    s.client.push_due(&session("e1")).await.unwrap();
    assert_eq!(s.row(&failed).next_at, T0 + SKEW + outbox::backoff_ms(0));
    let queued = s.send_to_peer(ID2);
    assert_eq!(s.row(&queued).next_at, T0 + SKEW);

    // The clock is right again.
    s.clock.set(T0);
    let next_due = |now: i64| {
        s.store
            .mailbox
            .with(|c| outbox::next_due_for_relay(c, now))
            .unwrap()
    };
    assert_eq!(next_due(T0), Some(T0), "the loop wakes now");
    s.accept_all("e1", "accepted");
    let pass = s.client.push_due(&session("e1")).await.unwrap();
    assert_eq!(pass.accepted, 2);
    for id in [&failed, &queued] {
        assert_eq!(s.row(id).state, "relay-accepted", "{id}");
    }

    // A failure at the right clock keeps its backoff.
    let later = s.send_to_peer(ID3);
    s.relay.on("POST /v2/relay/items", |_| {
        (503, json!({"error": "busy", "code": "BUSY"}))
    });
    s.client.push_due(&session("e1")).await.unwrap();
    assert_eq!(s.row(&later).next_at, T0 + outbox::backoff_ms(0));
    assert_eq!(next_due(T0), Some(T0 + outbox::backoff_ms(0)));
    let pass = s.client.push_due(&session("e1")).await.unwrap();
    assert_eq!((pass.accepted, pass.failed), (0, 0));
}

/// A wait on the clock (after a 429) started while the clock was 10 min ahead ends once the
/// clock is set right, instead of lasting the skew on top of the wait.
#[tokio::test]
async fn a_wait_on_the_clock_ends_when_the_clock_is_set_back() {
    let clock = testutil::clock();
    clock.set(T0 + 600_000);
    let shared: SharedClock = clock.clone();
    let (_stop, mut stopped) = tokio::sync::watch::channel(false);
    let wait = tokio::spawn(async move {
        super::wait_until_clock(&shared, T0 + 600_000 + 60_000, &mut stopped).await
    });
    // The wait has started (this test's runtime is single-threaded: the sleep lets it run).
    tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    assert!(!wait.is_finished());
    clock.set(T0);
    let done = tokio::time::timeout(std::time::Duration::from_secs(10), wait)
        .await
        .expect("the wait ends once the clock is set back")
        .unwrap();
    assert!(done);
}

#[tokio::test]
async fn a_batch_settles_each_row_on_its_own_result() {
    let s = Setup::new(true).await;
    let a = s.send_to_peer(ID1);
    let b = s.send_to_peer(ID2);
    let me = s.me_pub();
    let mut inner = push_answer(s.relay.key.clone(), "e1", "accepted", move |x| {
        x.sender = me.clone()
    });
    s.relay.on("POST /v2/relay/items", move |req| {
        let (code, mut body) = inner(req);
        // The second item is refused.
        body["results"][1] =
            json!({"item_id": ID2, "status": "rejected:quota:items", "targets": []});
        (code, body)
    });
    let pass = s.client.push_due(&session("e1")).await.unwrap();
    assert_eq!((pass.accepted, pass.failed), (1, 1));
    assert_eq!(s.row(&a).state, "relay-accepted");
    assert_eq!(s.row(&b).state, "pending");
    assert_eq!(s.relay.seen("POST /v2/relay/items").len(), 1, "one batch");
}

// ---- enc key learning --------------------------------------------------------------------------

/// A `GET /v2/relay/enc-key` answer for `peer`: `ad` signed by `signer`, `served_enc` as the
/// top-level `enc_pub`.
fn enc_answer(peer: &Identity, ad: &EncAd, signer: &HostKey, served_enc: &str) -> Value {
    json!({
        "host": peer.host.as_str(),
        "host_pubkey": peer.host_key.public().to_b64(),
        "enc_pub": served_enc,
        "ad": ad.to_value(),
        "ad_sig": ad.sign(signer),
    })
}

#[tokio::test]
async fn a_relay_ad_signed_by_the_pinned_key_is_used() {
    let s = Setup::new(false).await;
    let id = s.send_to_peer(ID1);
    let enc = s.peer.enc_key.public().to_b64();
    let ad = EncAd::new("work", &s.peer.host_key.public(), &enc, T0 - 1_000);
    let answer = enc_answer(&s.peer, &ad, &s.peer.host_key, &enc);
    s.relay
        .on("GET /v2/relay/enc-key", move |_| (200, answer.clone()));
    s.accept_all("e1", "accepted");
    let pass = s.client.push_due(&session("e1")).await.unwrap();
    assert_eq!(pass.accepted, 1);
    // The lookup is by the pinned key (URL-encoded), and signed.
    let lookups = s.relay.seen("GET /v2/relay/enc-key");
    assert_eq!(lookups.len(), 1);
    assert_eq!(lookups[0].q("pubkey"), s.peer_pub());
    s.relay.assert_hops_ok();
    // Recorded with its iat (rollback guard), and the body was sealed to it.
    let p = s
        .store
        .mailbox
        .with(|c| peers::by_name(c, "work"))
        .unwrap()
        .unwrap();
    assert_eq!(p.enc_pub.as_deref(), Some(enc.as_str()));
    assert_eq!(p.enc_ad_iat, Some(T0 - 1_000));
    let wire = s.row(&id).wire.unwrap();
    let env: Value = serde_json::from_slice(&wire).unwrap();
    let sealed: seal::Enc = serde_json::from_value(env["enc"].clone()).unwrap();
    assert_eq!(
        seal::open(&sealed, &s.peer.enc_key, &id).unwrap(),
        "body of hello"
    );
}

#[tokio::test]
async fn bad_relay_ads_are_never_used() {
    let day = 86_400_000;
    // (case, the relay's answer for the peer)
    type Make = Box<dyn Fn(&Identity) -> (u16, Value)>;
    let cases: Vec<(&str, Make)> = vec![
        (
            "signed by another key",
            Box::new(|p: &Identity| {
                let enc = p.enc_key.public().to_b64();
                let ad = EncAd::new("work", &p.host_key.public(), &enc, T0);
                (200, enc_answer(p, &ad, &HostKey::generate(), &enc))
            }),
        ),
        (
            "another host's ad",
            Box::new(|p: &Identity| {
                let other = HostKey::generate();
                let enc = p.enc_key.public().to_b64();
                let ad = EncAd::new("work", &other.public(), &enc, T0);
                (200, enc_answer(p, &ad, &other, &enc))
            }),
        ),
        (
            "expired",
            Box::new(move |p: &Identity| {
                let enc = p.enc_key.public().to_b64();
                let ad = EncAd::new("work", &p.host_key.public(), &enc, T0 - 31 * day);
                (200, enc_answer(p, &ad, &p.host_key, &enc))
            }),
        ),
        (
            "not yet valid",
            Box::new(|p: &Identity| {
                let enc = p.enc_key.public().to_b64();
                let ad = EncAd::new("work", &p.host_key.public(), &enc, T0 + 3_600_000);
                (200, enc_answer(p, &ad, &p.host_key, &enc))
            }),
        ),
        (
            "tampered: served enc_pub differs from ad.enc_pub",
            Box::new(|p: &Identity| {
                let enc = p.enc_key.public().to_b64();
                let ad = EncAd::new("work", &p.host_key.public(), &enc, T0);
                let served = EncKey::generate().public().to_b64();
                (200, enc_answer(p, &ad, &p.host_key, &served))
            }),
        ),
        (
            "ad edited after signing",
            Box::new(|p: &Identity| {
                let enc = p.enc_key.public().to_b64();
                let ad = EncAd::new("work", &p.host_key.public(), &enc, T0);
                let mut a = enc_answer(p, &ad, &p.host_key, &enc);
                let evil = EncKey::generate().public().to_b64();
                a["ad"]["enc_pub"] = json!(evil);
                a["enc_pub"] = json!(evil);
                (200, a)
            }),
        ),
        (
            "v1 only (no v2 ad)",
            Box::new(|p: &Identity| {
                (
                    200,
                    json!({"host": "work", "host_pubkey": p.host_key.public().to_b64(),
                           "enc_pub": p.enc_key.public().to_b64(), "sig": "c2ln"}),
                )
            }),
        ),
        (
            "unknown host",
            Box::new(|_p: &Identity| (404, json!({"error": "unknown host", "code": "NOT_FOUND"}))),
        ),
    ];
    for (name, make) in cases {
        let s = Setup::new(false).await;
        let id = s.send_to_peer(ID1);
        let answer = make(&s.peer);
        s.relay.on("GET /v2/relay/enc-key", move |_| answer.clone());
        s.accept_all("e1", "accepted");
        let pass = s.client.push_due(&session("e1")).await.unwrap();
        assert_eq!((pass.accepted, pass.failed), (0, 1), "{name}");
        s.assert_pending_unsealed(&id, T0, "no enc key");
        let row = s.row(&id);
        assert_eq!(row.wire, None, "{name}: never sealed with a refused key");
        assert!(
            s.relay.seen("POST /v2/relay/items").is_empty(),
            "{name}: nothing pushed, never plaintext"
        );
        let p = s
            .store
            .mailbox
            .with(|c| peers::by_name(c, "work"))
            .unwrap()
            .unwrap();
        assert_eq!(p.enc_pub, None, "{name}");
        assert_eq!(
            s.relay.seen("GET /v2/relay/enc-key").len(),
            1,
            "{name}: asked once"
        );
    }
}

#[tokio::test]
async fn an_enc_key_lookup_failure_keeps_the_row_pending_unsealed() {
    let s = Setup::new(false).await;
    let id = s.send_to_peer(ID1);
    s.relay.on("GET /v2/relay/enc-key", |_| {
        (500, json!({"error": "boom", "code": "INTERNAL"}))
    });
    s.client.push_due(&session("e1")).await.unwrap();
    s.assert_pending_unsealed(&id, T0, "500");
    assert!(s.relay.seen("POST /v2/relay/items").is_empty());
}

#[tokio::test]
async fn the_rollback_guard_refuses_an_older_ad_naming_another_key() {
    let s = Setup::new(false).await;
    let k1 = EncKey::generate().public().to_b64();
    let k2 = EncKey::generate().public().to_b64();
    let day = 86_400_000;
    s.store
        .mailbox
        .with(|c| {
            assert!(peers::set_enc_key(c, "work", &k1, T0)?);
            // Older ad naming another key: refused, nothing changes.
            assert!(!peers::set_enc_key(c, "work", &k2, T0 - day)?);
            // Same iat, another key: not newer, refused.
            assert!(!peers::set_enc_key(c, "work", &k2, T0)?);
            // An older ad for the same key is fine (nothing to roll back) and keeps the iat.
            assert!(peers::set_enc_key(c, "work", &k1, T0 - day)?);
            let p = peers::by_name(c, "work")?.unwrap();
            assert_eq!(
                (p.enc_pub.as_deref(), p.enc_ad_iat),
                (Some(k1.as_str()), Some(T0))
            );
            // A newer ad naming another key replaces it.
            assert!(peers::set_enc_key(c, "work", &k2, T0 + day)?);
            let p = peers::by_name(c, "work")?.unwrap();
            assert_eq!(
                (p.enc_pub.as_deref(), p.enc_ad_iat),
                (Some(k2.as_str()), Some(T0 + day))
            );
            // And now the first key is the older one.
            assert!(!peers::set_enc_key(c, "work", &k1, T0)?);
            Ok(())
        })
        .unwrap();
}

// ---- receiver ----------------------------------------------------------------------------------

/// A pull item for `wire` pushed by `sender`.
fn item(seq: i64, id: &str, sender: &str, wire: &[u8]) -> PullItem {
    PullItem {
        seq,
        kind: "envelope".into(),
        item_id: id.into(),
        sender_pubkey: sender.into(),
        wire_b64: b64::encode(wire),
    }
}

fn page(epoch: &str, head: i64, items: &[PullItem], more: bool) -> Value {
    let last = items.iter().map(|i| i.seq).max().unwrap_or(0);
    json!({"epoch": epoch, "head_seq": head, "items": items, "last_seq": last, "more": more})
}

/// A relay queue for this host: pages after `after`, 409 on another epoch, ack with BAD_ACK
/// past the head (the real relay's rules).
#[derive(Debug, Default)]
struct Queue {
    epoch: String,
    items: Vec<PullItem>,
    head_override: Option<i64>,
}

impl Queue {
    fn head(&self) -> i64 {
        self.head_override
            .unwrap_or_else(|| self.items.iter().map(|i| i.seq).max().unwrap_or(0))
    }
}

fn serve_queue(relay: &FakeRelay, q: Arc<Mutex<Queue>>) {
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
    fn peer_wire(&self, id: &str, subject: &str) -> Vec<u8> {
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

    fn position(&self) -> relay_state::Position {
        let url = self.client.url.clone();
        self.store
            .mailbox
            .with(|c| relay_state::position(c, &url))
            .unwrap()
            .expect("a position")
    }

    fn messages(&self) -> i64 {
        self.store.scalar("SELECT COUNT(*) FROM messages")
    }

    fn deliveries(&self) -> i64 {
        self.store.scalar("SELECT COUNT(*) FROM deliveries")
    }

    fn acks(&self) -> Vec<Value> {
        self.relay
            .seen("POST /v2/relay/ack")
            .iter()
            .map(Req::json)
            .collect()
    }

    fn pull_afters(&self) -> Vec<(String, String)> {
        self.relay
            .seen("GET /v2/relay/items")
            .iter()
            .map(|r| (r.q("after").to_string(), r.q("epoch").to_string()))
            .collect()
    }
}

#[tokio::test]
async fn a_page_with_repeats_and_reordering_stores_each_message_once() {
    let s = Setup::new(true).await;
    let mut g = testutil::ids();
    let (m1, m2, m3) = (g.next(T0), g.next(T0), g.next(T0));
    let peer = s.peer_pub();
    let (w1, w2, w3) = (
        s.peer_wire(&m1, "one"),
        s.peer_wire(&m2, "two"),
        s.peer_wire(&m3, "three"),
    );
    let first = page(
        "e1",
        30,
        &[
            item(30, &m3, &peer, &w3),
            item(10, &m1, &peer, &w1),
            item(20, &m2, &peer, &w2),
            item(30, &m3, &peer, &w3),
            item(10, &m1, &peer, &w1),
        ],
        false,
    );
    // The next page repeats seq 20 (at or below the checkpoint: skipped) and carries m2 again
    // under a new seq (a sender's re-push: a duplicate at receive).
    let second = page(
        "e1",
        40,
        &[item(20, &m2, &peer, &w2), item(40, &m2, &peer, &w2)],
        false,
    );
    let mut pages = vec![first, second].into_iter();
    s.relay.on("GET /v2/relay/items", move |_| {
        (
            200,
            pages.next().unwrap_or_else(|| page("e1", 40, &[], false)),
        )
    });
    s.relay.on("POST /v2/relay/ack", |req| {
        let t = req.json()["through"].clone();
        (
            200,
            json!({"acked_through": t, "deleted": 1, "head_seq": 40}),
        )
    });

    let pass = s.client.pull_pass(&session("e1")).await.unwrap();
    assert_eq!((pass.stored, pass.duplicates, pass.quarantined), (3, 0, 0));
    assert_eq!(pass.received_through, 30);
    assert_eq!(s.position().received_through, 30);
    let pass = s.client.pull_pass(&session("e1")).await.unwrap();
    assert_eq!((pass.stored, pass.duplicates, pass.quarantined), (0, 1, 0));
    assert_eq!(pass.received_through, 40);

    assert_eq!(s.messages(), 3);
    assert_eq!(s.deliveries(), 3);
    let pos = s.position();
    assert_eq!(
        (pos.epoch.as_str(), pos.received_through, pos.acked_through),
        ("e1", 40, 40)
    );
    assert_eq!(
        s.pull_afters(),
        vec![("0".into(), "e1".into()), ("30".into(), "e1".into())]
    );
    assert_eq!(
        s.acks(),
        vec![
            json!({"epoch": "e1", "through": 30}),
            json!({"epoch": "e1", "through": 40})
        ]
    );
    // Stored decrypted, delivered to the addressed local agent, from the peer.
    let (from, origin, body): (String, String, String) = s
        .store
        .fresh_conn()
        .query_row(
            "SELECT from_addr, origin, body FROM messages WHERE id = ?1",
            [&m1],
            |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)),
        )
        .unwrap();
    assert_eq!(
        (from.as_str(), origin.as_str(), body.as_str()),
        ("bob@work", "work", "secret body of one")
    );
    let agent: String = s.store.scalar("SELECT DISTINCT agent FROM deliveries");
    assert_eq!(agent, "alice");
    s.relay.assert_hops_ok();
}

#[tokio::test]
async fn rejected_items_go_to_quarantine_and_the_checkpoint_advances_past_them() {
    let s = Setup::new(true).await;
    let mut g = testutil::ids();
    let ids: Vec<String> = (0..8).map(|_| g.next(T0)).collect();
    let peer = s.peer_pub();
    let me_enc = s.me.enc_key.public();

    let good1 = s.peer_wire(&ids[0], "good one");
    let good2 = s.peer_wire(&ids[1], "good two");
    // Signed by the peer, then edited: the signature no longer verifies.
    let mut v: Value = serde_json::from_slice(&s.peer_wire(&ids[2], "original")).unwrap();
    v["subject"] = json!("edited by the relay");
    let bad_sig = serde_json::to_vec(&v).unwrap();
    // Sealed for another host's enc key.
    let undecryptable = testutil::sealed_wire(
        &s.peer,
        &EncKey::generate().public(),
        &ids[3],
        "bob@work",
        &["alice@home"],
        "not for us",
        T0,
    );
    // A host this host never paired with (valid signature with its own key).
    let stranger = testutil::identity("stranger");
    let unpaired = testutil::sealed_wire(
        &stranger,
        &me_enc,
        &ids[4],
        "eve@stranger",
        &["alice@home"],
        "hi",
        T0,
    );
    let malformed = b"{not json".to_vec();
    // Signed by the paired peer, but claiming to come from an agent on another host.
    let spoofed = testutil::sealed_wire(
        &s.peer,
        &me_enc,
        &ids[5],
        "ceo@elsewhere",
        &["alice@home"],
        "wire the money",
        T0,
    );
    // Signed by the peer but not sealed: never accepted over the relay.
    let plaintext = {
        let draft = agentmbx_protocol::envelope::Draft {
            from: "bob@work".into(),
            to: vec!["alice@home".into()],
            subject: "in clear".into(),
            body: "visible".into(),
            ..Default::default()
        };
        let mut env = agentmbx_protocol::envelope::build(&draft, ids[7].clone(), T0).unwrap();
        env.sign("work", &s.peer.host_key).unwrap();
        env.wire_json().into_bytes()
    };
    let items = vec![
        item(1, &ids[0], &peer, &good1),
        item(2, &ids[2], &peer, &bad_sig),
        item(3, &ids[3], &peer, &undecryptable),
        item(4, &ids[1], &peer, &good2),
        item(5, &ids[4], &stranger.host_key.public().to_b64(), &unpaired),
        item(6, &ids[5], &peer, &spoofed),
        item(7, &ids[7], &peer, &plaintext),
        item(8, &ids[6], &peer, &malformed),
    ];
    let q = Arc::new(Mutex::new(Queue {
        epoch: "e1".into(),
        items,
        head_override: None,
    }));
    serve_queue(&s.relay, q);
    let pass = s.client.pull_pass(&session("e1")).await.unwrap();
    assert_eq!((pass.stored, pass.duplicates, pass.quarantined), (2, 0, 6));
    // The last item of the page was rejected, and the checkpoint still covers it.
    assert_eq!(pass.received_through, 8);
    assert_eq!(s.position().received_through, 8);
    assert_eq!(s.acks(), vec![json!({"epoch": "e1", "through": 8})]);
    assert_eq!(s.messages(), 2);

    let rows: Vec<(i64, String, String, String, Vec<u8>, String)> = {
        let c = s.store.fresh_conn();
        let mut st = c
            .prepare("SELECT seq, item_id, sender_pubkey, reason, wire, epoch FROM quarantine ORDER BY seq")
            .unwrap();
        st.query_map([], |r| {
            Ok((
                r.get(0)?,
                r.get(1)?,
                r.get(2)?,
                r.get(3)?,
                r.get(4)?,
                r.get(5)?,
            ))
        })
        .unwrap()
        .collect::<Result<_, _>>()
        .unwrap()
    };
    let got: Vec<(i64, &str)> = rows.iter().map(|r| (r.0, r.3.as_str())).collect();
    assert_eq!(
        got,
        vec![
            (2, "bad signature"),
            (3, "undecryptable body"),
            (5, "host not paired"),
            (6, "sender host mismatch"),
            (7, "envelope body is not sealed"),
            (8, "malformed: not JSON"),
        ]
    );
    assert_eq!(rows[0].4, bad_sig, "the exact wire is kept");
    assert_eq!(rows[2].4, unpaired);
    assert_eq!(rows[5].4, malformed);
    assert_eq!(rows[2].2, stranger.host_key.public().to_b64());
    assert!(rows.iter().all(|r| r.5 == "e1"));
    assert_eq!(rows[1].1, ids[3]);
    // The quarantine listing shows them, newest first.
    let listed = s
        .store
        .mailbox
        .with(|c| relay_state::quarantined(c, 200))
        .unwrap();
    assert_eq!(listed.len(), 6);
    assert_eq!(listed[0].seq, 8);

    // Pulling again re-quarantines nothing and stores nothing twice.
    s.client.pull_pass(&session("e1")).await.unwrap();
    assert_eq!(s.store.scalar::<i64>("SELECT COUNT(*) FROM quarantine"), 6);
    assert_eq!(s.messages(), 2);
}

#[tokio::test]
async fn the_ack_carries_received_through_and_a_lost_ack_is_covered_by_the_next() {
    let s = Setup::new(true).await;
    let mut g = testutil::ids();
    let peer = s.peer_pub();
    let items: Vec<PullItem> = (1..=3)
        .map(|n| {
            let id = g.next(T0);
            item(n * 10, &id, &peer, &s.peer_wire(&id, "m"))
        })
        .collect();
    let q = Arc::new(Mutex::new(Queue {
        epoch: "e1".into(),
        items,
        head_override: None,
    }));
    serve_queue(&s.relay, q.clone());
    // The first ack is lost (500): the checkpoint stays, the ack is not recorded.
    let q2 = q.clone();
    let mut acks = 0;
    s.relay.on("POST /v2/relay/ack", move |req| {
        acks += 1;
        if acks == 1 {
            return (500, json!({"error": "lost", "code": "INTERNAL"}));
        }
        let through = req.json()["through"].as_i64().unwrap();
        let head = q2.lock().unwrap().head();
        (
            200,
            json!({"acked_through": through, "deleted": 3, "head_seq": head}),
        )
    });
    let pass = s.client.pull_pass(&session("e1")).await.unwrap();
    assert_eq!(pass.stored, 3);
    let pos = s.position();
    assert_eq!((pos.received_through, pos.acked_through), (30, 0));
    assert_eq!(s.acks(), vec![json!({"epoch": "e1", "through": 30})]);

    // The next pass finds nothing new and acks the same checkpoint again.
    let pass = s.client.pull_pass(&session("e1")).await.unwrap();
    assert_eq!((pass.stored, pass.duplicates), (0, 0));
    let pos = s.position();
    assert_eq!((pos.received_through, pos.acked_through), (30, 30));
    assert_eq!(
        s.acks(),
        vec![
            json!({"epoch": "e1", "through": 30}),
            json!({"epoch": "e1", "through": 30})
        ]
    );
    // Once confirmed, an unchanged checkpoint is not acked again.
    s.client.pull_pass(&session("e1")).await.unwrap();
    assert_eq!(s.acks().len(), 2);
    // The pulls resumed after the checkpoint, not from 0.
    assert_eq!(
        s.pull_afters()
            .iter()
            .map(|p| p.0.as_str())
            .collect::<Vec<_>>(),
        vec!["0", "30", "30"]
    );
    assert_eq!(s.messages(), 3);
}

#[tokio::test]
async fn an_epoch_409_on_pull_resets_to_zero_and_repulls_without_duplicates() {
    let s = Setup::new(true).await;
    let mut g = testutil::ids();
    let peer = s.peer_pub();
    let wires: Vec<(String, Vec<u8>)> = (0..3)
        .map(|_| {
            let id = g.next(T0);
            let w = s.peer_wire(&id, "m");
            (id, w)
        })
        .collect();
    let e1_items: Vec<PullItem> = wires
        .iter()
        .enumerate()
        .map(|(n, (id, w))| item(100 + n as i64, id, &peer, w))
        .collect();
    let q = Arc::new(Mutex::new(Queue {
        epoch: "e1".into(),
        items: e1_items,
        head_override: None,
    }));
    serve_queue(&s.relay, q.clone());
    s.client.pull_pass(&session("e1")).await.unwrap();
    assert_eq!(s.position().received_through, 102);
    assert_eq!(s.messages(), 3);

    // The relay was restored and rotated its epoch: the same items (re-pushed by the sender)
    // under new, lower seqs, plus one new message.
    let new_id = g.next(T0);
    let new_wire = s.peer_wire(&new_id, "new");
    {
        let mut q = q.lock().unwrap();
        q.epoch = "e2".into();
        q.items = wires
            .iter()
            .enumerate()
            .map(|(n, (id, w))| item(1 + n as i64, id, &peer, w))
            .collect();
        q.items.push(item(4, &new_id, &peer, &new_wire));
    }
    // The session still believes e1: the pull answers 409 with e2.
    let pass = s.client.pull_pass(&session("e1")).await.unwrap();
    assert_eq!((pass.stored, pass.duplicates), (1, 3));
    let pos = s.position();
    assert_eq!(
        (pos.epoch.as_str(), pos.received_through, pos.acked_through),
        ("e2", 4, 4)
    );
    assert_eq!(s.messages(), 4);
    assert_eq!(s.deliveries(), 4);
    assert_eq!(
        s.pull_afters(),
        vec![
            ("0".into(), "e1".into()),
            ("102".into(), "e1".into()),
            ("0".into(), "e2".into())
        ]
    );
    assert_eq!(
        s.acks().last().unwrap(),
        &json!({"epoch": "e2", "through": 4})
    );
}

#[tokio::test]
async fn a_new_epoch_in_the_session_resets_the_position() {
    let s = Setup::new(true).await;
    let url = s.client.url.clone();
    s.store
        .mailbox
        .with(|c| relay_state::set_received_through(c, &url, "e1", 500, T0))
        .unwrap();
    let q = Arc::new(Mutex::new(Queue {
        epoch: "e2".into(),
        items: vec![],
        head_override: None,
    }));
    serve_queue(&s.relay, q);
    s.client.pull_pass(&session("e2")).await.unwrap();
    let pos = s.position();
    assert_eq!((pos.epoch.as_str(), pos.received_through), ("e2", 0));
    assert_eq!(s.pull_afters(), vec![("0".into(), "e2".into())]);
}

#[tokio::test]
async fn head_seq_below_the_checkpoint_rewinds_to_zero() {
    let s = Setup::new(true).await;
    let mut g = testutil::ids();
    let peer = s.peer_pub();
    let (a, b) = (g.next(T0), g.next(T0));
    let (wa, wb) = (s.peer_wire(&a, "a"), s.peer_wire(&b, "b"));
    let q = Arc::new(Mutex::new(Queue {
        epoch: "e1".into(),
        items: vec![item(10, &a, &peer, &wa), item(20, &b, &peer, &wb)],
        head_override: None,
    }));
    serve_queue(&s.relay, q.clone());
    s.client.pull_pass(&session("e1")).await.unwrap();
    assert_eq!(s.position().received_through, 20);

    // A restore that kept its epoch: the store is back at an older state (head 15 < 20).
    let c = g.next(T0);
    let wc = s.peer_wire(&c, "c");
    {
        let mut q = q.lock().unwrap();
        q.items = vec![item(10, &a, &peer, &wa), item(15, &c, &peer, &wc)];
    }
    let pass = s.client.pull_pass(&session("e1")).await.unwrap();
    assert_eq!((pass.stored, pass.duplicates), (1, 1));
    let pos = s.position();
    assert_eq!((pos.epoch.as_str(), pos.received_through), ("e1", 15));
    assert_eq!(
        s.pull_afters()
            .iter()
            .map(|p| p.0.as_str())
            .collect::<Vec<_>>(),
        vec!["0", "20", "0"]
    );
    assert_eq!(s.messages(), 3);
    assert_eq!(s.acks().last().unwrap()["through"], 15);
}

#[tokio::test]
async fn bad_ack_rewinds_to_zero() {
    let s = Setup::new(true).await;
    let mut g = testutil::ids();
    let peer = s.peer_pub();
    let ids: Vec<String> = (0..3).map(|_| g.next(T0)).collect();
    let items: Vec<PullItem> = ids
        .iter()
        .enumerate()
        .map(|(n, id)| item(10 * (n as i64 + 1), id, &peer, &s.peer_wire(id, "m")))
        .collect();
    // The relay went back in time but its pages still show the old head: the ack of 30 is
    // refused once with BAD_ACK.
    let q = Arc::new(Mutex::new(Queue {
        epoch: "e1".into(),
        items,
        head_override: None,
    }));
    serve_queue(&s.relay, q.clone());
    let mut first = true;
    s.relay.on("POST /v2/relay/ack", move |req| {
        let through = req.json()["through"].as_i64().unwrap();
        if std::mem::take(&mut first) {
            return (
                400,
                json!({"error": "ack beyond head", "code": "BAD_ACK", "epoch": "e1", "head_seq": 5}),
            );
        }
        (
            200,
            json!({"acked_through": through, "deleted": 0, "head_seq": 30}),
        )
    });
    let pass = s.client.pull_pass(&session("e1")).await.unwrap();
    assert_eq!((pass.stored, pass.duplicates), (3, 3));
    let pos = s.position();
    assert_eq!(
        (pos.epoch.as_str(), pos.received_through, pos.acked_through),
        ("e1", 30, 30)
    );
    assert_eq!(
        s.pull_afters()
            .iter()
            .map(|p| p.0.as_str())
            .collect::<Vec<_>>(),
        vec!["0", "0"]
    );
    assert_eq!(s.acks().len(), 2);
    assert_eq!(s.messages(), 3);
}

#[tokio::test]
async fn a_page_is_pulled_in_several_pages_and_each_is_acked() {
    let s = Setup::new(true).await;
    let mut g = testutil::ids();
    let peer = s.peer_pub();
    let items: Vec<PullItem> = (1..=5)
        .map(|n| {
            let id = g.next(T0);
            item(n, &id, &peer, &s.peer_wire(&id, "m"))
        })
        .collect();
    let q = Arc::new(Mutex::new(Queue {
        epoch: "e1".into(),
        items,
        head_override: None,
    }));
    serve_queue(&s.relay, q);
    let mut sess = session("e1");
    sess.limits.max_pull = 2;
    let pass = s.client.pull_pass(&sess).await.unwrap();
    assert_eq!(pass.stored, 5);
    assert_eq!(
        s.pull_afters()
            .iter()
            .map(|p| p.0.as_str())
            .collect::<Vec<_>>(),
        vec!["0", "2", "4"]
    );
    let throughs: Vec<i64> = s
        .acks()
        .iter()
        .map(|a| a["through"].as_i64().unwrap())
        .collect();
    assert_eq!(throughs, vec![2, 4, 5]);
}

// ---- session -----------------------------------------------------------------------------------

fn info(relay_key: &HostKey, epoch: &str, you: Option<Value>) -> Value {
    let mut v = json!({"v": 2, "relay_pubkey": relay_key.public().to_b64(), "epoch": epoch,
                       "version": "test", "limits": serde_json::to_value(limits()).unwrap()});
    if let Some(y) = you {
        v["you"] = y;
    }
    v
}

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

impl FakeRelay {
    /// Like [`Self::assert_hops_ok`], but the unauthenticated enrolment calls carry no hop.
    fn assert_hops_ok_except_plain(&self) {
        for r in self.state.log.lock().unwrap().iter() {
            if r.path.starts_with("/v1/relay/") {
                continue;
            }
            assert!(r.hop_ok, "badly signed hop: {} {}", r.method, r.path);
        }
    }
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
    let task = tokio::spawn(super::run(
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

/// Polls `f` every 20 ms until it holds, for at most 10 s.
async fn wait_for(what: &str, f: impl Fn() -> bool) {
    let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(10);
    while !f() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "timed out waiting for {what}"
        );
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
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
    let first = super::pin::resolve_key(&s.relay.url, None, &s.store.mailbox, &clock)
        .await
        .unwrap();
    assert_eq!(first, s.relay.key.public());
    // The relay now serves another key: the pin stays (a mismatch is the session's to report).
    *served.lock().unwrap() = HostKey::generate();
    let again =
        super::pin::resolve_key(&format!("{}/", s.relay.url), None, &s.store.mailbox, &clock)
            .await
            .unwrap();
    assert_eq!(again, first);
    assert_eq!(s.relay.seen("GET /v2/relay/info").len(), 1);
    // A configured key wins over the stored pin.
    let configured = HostKey::generate().public();
    let k = super::pin::resolve_key(
        &s.relay.url,
        Some(&configured.to_b64()),
        &s.store.mailbox,
        &clock,
    )
    .await
    .unwrap();
    assert_eq!(k, configured);
    assert!(
        super::pin::resolve_key(&s.relay.url, Some("junk"), &s.store.mailbox, &clock)
            .await
            .is_err()
    );
}

// ---- alerts and epoch changes --------------------------------------------------------------------

#[tokio::test]
async fn a_terminal_rejection_alerts_the_sending_agent() {
    let s = Setup::new(true).await;
    let id = s.send_to_peer(ID1);
    s.relay
        .on("POST /v2/relay/items", push_reject("rejected:conflict"));
    s.client.push_due(&session("e1")).await.unwrap();
    assert_eq!(s.row(&id).state, "rejected");
    let page = s
        .store
        .mailbox
        .with(|c| crate::mailbox::messages::inbox(c, "alice", None, 50, &Default::default()))
        .unwrap();
    assert_eq!(page.messages.len(), 1, "one alert for alice");
    let alert = &page.messages[0];
    assert_eq!(alert.subject, "Undelivered to work: hello");
    assert_eq!(
        (alert.kind.as_str(), alert.from.as_str()),
        ("alert", "agentmbx@home")
    );
    // A retryable rejection alerts nobody.
    let s = Setup::new(true).await;
    s.send_to_peer(ID1);
    s.relay.on(
        "POST /v2/relay/items",
        push_reject("rejected:target not enrolled"),
    );
    s.client.push_due(&session("e1")).await.unwrap();
    let page = s
        .store
        .mailbox
        .with(|c| crate::mailbox::messages::inbox(c, "alice", None, 50, &Default::default()))
        .unwrap();
    assert!(page.messages.is_empty());
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
async fn one_message_to_two_hosts_settles_each_row_by_its_own_result() {
    let s = Setup::new(true).await;
    let lab = testutil::identity("lab");
    s.store.add_peer(&lab, true);
    let out = s
        .store
        .send(
            &s.me,
            "alice",
            &["bob@work", "carol@lab"],
            "hello",
            ID1,
            s.clock_now(),
        )
        .unwrap();
    assert_eq!(out.queued_for_hosts.len(), 2);
    let key = s.relay.key.clone();
    let me = s.me_pub();
    // Both items carry the same id: the first is refused for good, the second accepted.
    s.relay.on("POST /v2/relay/items", move |req: &Req| {
        let items = pushed_items(req);
        assert_eq!(items.len(), 2);
        let (id0, _, _) = &items[0];
        let (id1, target1, wire1) = &items[1];
        let spec = AcceptSpec {
            signer: key.clone(),
            relay_pubkey: key.public().to_b64(),
            epoch: "e1".into(),
            sender: me.clone(),
            item_id: id1.clone(),
            target: target1.clone(),
            wire_hash: hash::sha256_hex(wire1),
            seq: 77,
            at: T0,
        };
        let (accept, sig) = spec.signed();
        (200, json!({"results": [
            {"item_id": id0, "status": "rejected:conflict", "targets": []},
            {"item_id": id1, "status": "accepted", "targets": [{"host_pubkey": target1, "seq": 77}], "accept": accept, "sig": sig},
        ]}))
    });
    s.client.push_due(&session("e1")).await.unwrap();
    let pushed = pushed_items(&s.relay.seen("POST /v2/relay/items")[0]);
    let second_host = if pushed[1].1 == s.peer_pub() {
        "work"
    } else {
        "lab"
    };
    let first_host = if second_host == "work" { "lab" } else { "work" };
    let accepted = s
        .store
        .mailbox
        .with(|c| outbox::get(c, ID1, second_host))
        .unwrap()
        .unwrap();
    let refused = s
        .store
        .mailbox
        .with(|c| outbox::get(c, ID1, first_host))
        .unwrap()
        .unwrap();
    assert_eq!(
        (accepted.state.as_str(), accepted.seq),
        ("relay-accepted", Some(77))
    );
    assert_eq!(refused.state, "rejected");
}

#[tokio::test]
async fn mail_from_a_host_pinned_later_leaves_quarantine() {
    let s = Setup::new(true).await;
    let lab = testutil::identity("lab");
    let wire = testutil::sealed_wire(
        &lab,
        &s.me.enc_key.public(),
        ID1,
        "carol@lab",
        &["alice@home"],
        "late",
        T0,
    );
    let (url, lab_pub, w) = (
        s.client.url.clone(),
        lab.host_key.public().to_b64(),
        wire.clone(),
    );
    s.store
        .mailbox
        .with(|c| {
            relay_state::quarantine(
                c,
                &url,
                "e1",
                5,
                "envelope",
                ID1,
                &lab_pub,
                "host not paired",
                &w,
                T0,
            )
        })
        .unwrap();
    // Not pinned yet: it stays where it is.
    assert_eq!(s.client.retry_quarantined().await.unwrap(), 0);
    assert_eq!(s.store.scalar::<i64>("SELECT COUNT(*) FROM quarantine"), 1);
    // Pinned now: received, delivered, and out of quarantine.
    s.store.add_peer(&lab, false);
    assert_eq!(s.client.retry_quarantined().await.unwrap(), 1);
    assert_eq!(s.store.scalar::<i64>("SELECT COUNT(*) FROM quarantine"), 0);
    assert_eq!(
        s.store.scalar::<String>("SELECT agent FROM deliveries"),
        "alice"
    );
    assert_eq!(s.client.retry_quarantined().await.unwrap(), 0);
}

// ---- delivery receipts over the relay (spec §9) -------------------------------------------------

/// The pushed receipt items of a request: (item id, target, wire).
fn pushed_receipts(req: &Req) -> Vec<(String, String, Vec<u8>)> {
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
fn receipt_answer(
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
    fn receive_and_read(&self, id: &str) -> String {
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

    fn receipt_rows(&self) -> Vec<(i64, String, u32, u32)> {
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

#[tokio::test]
async fn receipts_are_pushed_as_receipt_items_and_leave_on_a_verified_accept() {
    let s = Setup::new(true).await;
    let id = s.receive_and_read(ID1);
    let rows = s.receipt_rows();
    assert_eq!(
        rows.iter().map(|r| r.1.as_str()).collect::<Vec<_>>(),
        vec!["delivered", "read"]
    );
    // A rejection retrying can cure keeps them, with backoff, and the same bytes are re-sent.
    s.relay.on(
        "POST /v2/relay/items",
        receipt_answer(
            s.relay.key.clone(),
            s.me_pub(),
            "rejected:target not enrolled",
        ),
    );
    let pass = s.client.push_receipts(&session("e1")).await.unwrap();
    assert_eq!((pass.accepted, pass.failed), (0, 2));
    let after = s.receipt_rows();
    assert!(after.iter().all(|r| r.2 == 1 && r.3 == 0), "{after:?}");
    let first = pushed_receipts(&s.relay.seen("POST /v2/relay/items")[0]);
    // Not due before the backoff.
    assert_eq!(
        s.client.push_receipts(&session("e1")).await.unwrap(),
        super::push::PushPass::default()
    );
    s.clock.advance(outbox::backoff_ms(0));
    // An accept signed by another key does not count.
    s.relay.on(
        "POST /v2/relay/items",
        receipt_answer(HostKey::generate(), s.me_pub(), "accepted"),
    );
    let pass = s.client.push_receipts(&session("e1")).await.unwrap();
    assert_eq!((pass.accepted, pass.failed), (0, 2));
    s.clock.advance(outbox::backoff_ms(1));
    s.relay.on(
        "POST /v2/relay/items",
        receipt_answer(s.relay.key.clone(), s.me_pub(), "accepted"),
    );
    let pass = s.client.push_receipts(&session("e1")).await.unwrap();
    assert_eq!((pass.accepted, pass.failed), (2, 0));
    assert!(s.receipt_rows().is_empty());
    s.relay.assert_hops_ok();

    // Every push carried the same items: kind receipt, id receipt:<msg>:<recipient>:<seq>, the
    // peer's pinned key as the one target, wire canonical({rec, sig}) signed by this host.
    let pushes = s.relay.seen("POST /v2/relay/items");
    assert_eq!(pushes.len(), 3);
    for p in &pushes {
        assert_eq!(
            pushed_receipts(p),
            first,
            "the signed wire is reused byte for byte"
        );
    }
    for ((item_id, target, wire), (seq, state, _, _)) in first.iter().zip(&rows) {
        assert_eq!(item_id, &format!("receipt:{id}:alice@home:{seq}"));
        assert_eq!(target, &s.peer_pub());
        let rec = records::parse_receipt_wire(wire, &s.me.host_key.public()).unwrap();
        assert_eq!(
            (rec.msg.as_str(), rec.recipient.as_str(), rec.state.as_str()),
            (id.as_str(), "alice@home", state.as_str())
        );
        assert_eq!(rec.seq, *seq as u64);
        assert_eq!(rec.note, None);
        let text = std::str::from_utf8(wire).unwrap();
        let v: Value = serde_json::from_str(text).unwrap();
        assert_eq!(text, agentmbx_protocol::canonical::to_string(&v).unwrap());
    }
}

#[tokio::test]
async fn a_terminal_rejection_drops_a_receipt_and_old_receipts_expire() {
    let s = Setup::new(true).await;
    s.receive_and_read(ID1);
    s.relay.on(
        "POST /v2/relay/items",
        receipt_answer(s.relay.key.clone(), s.me_pub(), "rejected:bad receipt"),
    );
    s.client.push_receipts(&session("e1")).await.unwrap();
    assert!(
        s.receipt_rows().is_empty(),
        "advisory: dropped, not retried"
    );
    // Receipts that could not be sent for 72 h are dropped before any push.
    s.receive_and_read(ID2);
    assert_eq!(s.receipt_rows().len(), 2);
    s.relay
        .on("POST /v2/relay/items", |_| (503, json!({"error": "down"})));
    s.client.push_receipts(&session("e1")).await.unwrap();
    assert_eq!(s.receipt_rows().len(), 2);
    s.clock.advance(72 * 3_600_000 + 1);
    let pass = s.client.push_receipts(&session("e1")).await.unwrap();
    assert_eq!(pass, super::push::PushPass::default());
    assert!(s.receipt_rows().is_empty());
}

#[tokio::test]
async fn a_receipt_travels_through_the_relay_and_settles_the_sent_row() {
    let s = Setup::new(true).await;
    // home: alice → bob@work, accepted by the relay.
    let id = s.send_to_peer(ID1);
    s.accept_all("e1", "accepted");
    s.client.push_due(&session("e1")).await.unwrap();
    assert_eq!(s.row(&id).state, "relay-accepted");
    let envelope = pushed_items(&s.relay.seen("POST /v2/relay/items")[0])
        .remove(0)
        .2;

    // work: pulls it (here: receives the pushed bytes), bob reads it, and work pushes the two
    // receipts it now owes home to its relay.
    let work = Arc::new(s.peer.clone());
    let work_store = testutil::store();
    work_store.add_peer(&s.me, true);
    work_store.register("work", &["bob"]);
    let work_relay = FakeRelay::start(work.host_key.public(), s.clock.clone()).await;
    let work_client = Setup::client_for(
        &work_relay.url,
        &work_relay.key,
        &work,
        &work_store,
        &s.clock,
    );
    let (w, me_pub) = (work.clone(), s.me_pub());
    work_store
        .mailbox
        .with(|c| {
            let v = crate::node::receive::receive_sealed(c, &w, &envelope, &id, &me_pub, T0)?;
            assert!(v.is_ok(), "{v:?}");
            crate::mailbox::messages::read(c, "bob", "work", &id, T0)?;
            Ok(())
        })
        .unwrap();
    work_relay.on(
        "POST /v2/relay/items",
        receipt_answer(
            work_relay.key.clone(),
            work.host_key.public().to_b64(),
            "accepted",
        ),
    );
    let pass = work_client.push_receipts(&session("e1")).await.unwrap();
    assert_eq!(pass.accepted, 2);
    work_relay.assert_hops_ok();
    let pushed = pushed_receipts(&work_relay.seen("POST /v2/relay/items")[0]);
    assert!(
        pushed.iter().all(|p| p.1 == s.me_pub()),
        "targeted at home's key"
    );

    // home pulls the receipt items (and one forged by a third key, and one pushed by a key that
    // is not the recipient host's): the row is settled by the genuine ones only.
    let stranger = testutil::identity("mars");
    let forged = {
        let rec: Value = serde_json::from_slice::<Value>(&pushed[1].2).unwrap()["rec"].clone();
        let mut rec: records::Receipt = serde_json::from_value(rec).unwrap();
        rec.state = "acked".into();
        rec.wire(&stranger.host_key).unwrap().into_bytes()
    };
    let receipt_item = |seq: i64, item_id: &str, sender: &str, wire: &[u8]| PullItem {
        kind: "receipt".into(),
        ..item(seq, item_id, sender, wire)
    };
    let work_pub = s.peer_pub();
    let stranger_pub = stranger.host_key.public().to_b64();
    let q = Arc::new(Mutex::new(Queue {
        epoch: "e1".into(),
        items: vec![
            receipt_item(10, &pushed[0].0, &work_pub, &pushed[0].2),
            receipt_item(11, &pushed[1].0, &stranger_pub, &pushed[1].2),
            receipt_item(12, "receipt:forged", &work_pub, &forged),
            receipt_item(13, &pushed[1].0, &work_pub, &pushed[1].2),
            receipt_item(14, &pushed[1].0, &work_pub, &pushed[1].2),
        ],
        head_override: None,
    }));
    serve_queue(&s.relay, q);
    let pass = s.client.pull_pass(&session("e1")).await.unwrap();
    assert_eq!(
        (pass.receipts, pass.quarantined, pass.received_through),
        (3, 2, 14)
    );
    let row = s.row(&id);
    assert_eq!(
        (row.state.as_str(), row.via.as_deref()),
        ("delivered", Some("relay"))
    );
    let (state, seq): (String, i64) = s
        .store
        .fresh_conn()
        .query_row(
            "SELECT state, seq FROM remote_receipts WHERE msg_id = ?1 AND recipient = 'bob@work'",
            [&id],
            |r| Ok((r.get(0)?, r.get(1)?)),
        )
        .unwrap();
    assert_eq!(state, "read");
    assert_eq!(seq, 2);
    let reasons: Vec<(i64, String)> = s
        .store
        .mailbox
        .with(|c| relay_state::quarantined(c, 10))
        .unwrap()
        .into_iter()
        .map(|q| (q.seq, q.reason))
        .collect();
    assert_eq!(
        reasons,
        vec![
            (12, "bad signature".to_string()),
            (
                11,
                "receipt for bob@work did not come from work".to_string()
            ),
        ]
    );
    // The sender's view.
    let page = s
        .store
        .mailbox
        .with(|c| crate::mailbox::receipts::sent_page(c, "alice", "home", None, 20))
        .unwrap();
    let r = &page.messages[0].recipients[0];
    assert_eq!(
        (r.recipient.as_str(), r.state.as_str(), r.via.as_deref()),
        ("bob@work", "read", Some("relay"))
    );
}

#[tokio::test]
async fn the_relay_takes_a_row_only_after_two_lan_failures_or_without_a_lan_address() {
    let s = Setup::new(true).await;
    s.store
        .mailbox
        .with(|c| peers::set_addr(c, "work", "127.0.0.1:1", "cli"))
        .unwrap();
    let id = s.send_to_peer(ID1);
    s.accept_all("e1", "accepted");
    // The peer has a LAN address and the LAN has not failed yet: not the relay's.
    let pass = s.client.push_due(&session("e1")).await.unwrap();
    assert_eq!(pass, super::push::PushPass::default());
    assert!(s.relay.seen("POST /v2/relay/items").is_empty());
    // One LAN failure: still not.
    s.store
        .mailbox
        .with(|c| outbox::fail_lan(c, &id, "work", "down", s.clock_now()).map(|_| ()))
        .unwrap();
    s.clock.advance(outbox::backoff_ms(0));
    assert_eq!(s.client.push_due(&session("e1")).await.unwrap().accepted, 0);
    // The second one hands it over, when due (its backoff is respected).
    s.store
        .mailbox
        .with(|c| outbox::fail_lan(c, &id, "work", "down", s.clock_now()).map(|_| ()))
        .unwrap();
    assert_eq!(s.client.push_due(&session("e1")).await.unwrap().accepted, 0);
    s.clock.advance(outbox::backoff_ms(1));
    assert_eq!(s.client.push_due(&session("e1")).await.unwrap().accepted, 1);
    let row = s.row(&id);
    assert_eq!(
        (row.state.as_str(), row.via.as_deref()),
        ("relay-accepted", Some("relay"))
    );
    // A peer back over the LAN does not make a relay-accepted row the LAN's again.
    s.store
        .mailbox
        .with(|c| outbox::peer_is_back(c, "work", s.clock_now()).map(|_| ()))
        .unwrap();
    let c = s.store.fresh_conn();
    assert!(outbox::due_for_lan(&c, i64::MAX, 10, true)
        .unwrap()
        .is_empty());
    // A peer without a LAN address: the relay at once.
    let s = Setup::new(true).await;
    s.accept_all("e1", "accepted");
    s.send_to_peer(ID2);
    assert_eq!(s.client.push_due(&session("e1")).await.unwrap().accepted, 1);
}

#[tokio::test]
async fn a_pull_that_stored_mail_wakes_the_senders_of_its_receipts() {
    let mut s = Setup::new(true).await;
    let received = Arc::new(tokio::sync::Notify::new());
    s.client.received = Some(received.clone());
    let incoming = testutil::ids().next(T0);
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
    let woken = received.notified();
    tokio::pin!(woken);
    woken.as_mut().enable();
    let pass = s.client.pull_pass(&session("e1")).await.unwrap();
    assert_eq!(pass.stored, 1);
    tokio::time::timeout(std::time::Duration::from_secs(5), woken)
        .await
        .expect("the sender loops are woken");
    assert_eq!(
        s.store.scalar::<i64>("SELECT COUNT(*) FROM receipt_outbox"),
        1
    );
}

// ---- the 72 h rule and the hand-back to the LAN -------------------------------------------------

impl Setup {
    /// The (subject, body) of every alert in alice's inbox, oldest first.
    fn alerts(&self) -> Vec<(String, String)> {
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
    fn lan_addr(&self) {
        self.store
            .mailbox
            .with(|c| peers::set_addr(c, "work", "127.0.0.1:1", "cli"))
            .unwrap();
    }
}

#[tokio::test]
async fn a_relay_path_row_no_relay_accepted_ends_undelivered_after_72_hours_with_the_alert() {
    let s = Setup::new(true).await;
    let id = s.send_to_peer(ID1);
    // ID2 was accepted by a relay once and is pending again for a re-push.
    s.send_to_peer(ID2);
    s.store
        .mailbox
        .with(|c| {
            c.execute(
                "UPDATE outbox SET accepted_at = ?2 WHERE msg_id = ?1",
                rusqlite::params![ID2, T0],
            )?;
            Ok(())
        })
        .unwrap();
    s.relay.on(
        "POST /v2/relay/items",
        push_reject("rejected:target not enrolled"),
    );
    // At exactly 72 h the relay path still retries.
    s.clock.set(T0 + outbox::GIVE_UP_MS);
    s.client.push_due(&session("e1")).await.unwrap();
    assert_eq!(s.row(&id).state, "pending");
    assert!(s.alerts().is_empty());
    // The next refusal past 72 h ends it, with the alert, in the same transaction.
    s.clock.set(T0 + outbox::GIVE_UP_MS + outbox::backoff_ms(0));
    let pass = s.client.push_due(&session("e1")).await.unwrap();
    assert_eq!(pass.failed, 2);
    let row = s.row(&id);
    assert_eq!(
        (row.state.as_str(), row.attempts, row.last_error.as_deref()),
        (
            "undelivered",
            2,
            Some("gave up after 72 h (rejected:target not enrolled)")
        )
    );
    assert_eq!(
        s.alerts(),
        vec![(
            "Undelivered to work: hello".to_string(),
            format!(
                "Message {id} could not be delivered to host work: gave up after 72 h (rejected:target not enrolled)"
            )
        )]
    );
    // The re-push keeps trying, however old: the relay accepted it once.
    let r2 = s.row(ID2);
    assert_eq!((r2.state.as_str(), r2.attempts), ("pending", 2));
    // An ended row is not pushed again.
    s.clock.advance(10 * 3_600_000);
    s.client.push_due(&session("e1")).await.unwrap();
    let last = s.relay.seen("POST /v2/relay/items").pop().unwrap();
    assert_eq!(
        pushed_items(&last)
            .into_iter()
            .map(|p| p.0)
            .collect::<Vec<_>>(),
        vec![ID2.to_string()]
    );
    assert_eq!(s.alerts().len(), 1);
}

#[tokio::test]
async fn a_network_failure_past_72_hours_ends_the_row_too() {
    let s = Setup::new(true).await;
    let id = s.send_to_peer(ID1);
    s.relay.on("POST /v2/relay/items", |_| {
        (503, json!({"error": "down", "code": "UNAVAILABLE"}))
    });
    s.clock.set(T0 + outbox::GIVE_UP_MS + 1);
    s.client.push_due(&session("e1")).await.unwrap();
    let row = s.row(&id);
    assert_eq!(row.state, "undelivered");
    assert!(row
        .last_error
        .as_deref()
        .unwrap()
        .starts_with("gave up after 72 h ("));
    assert_eq!(s.alerts().len(), 1);
}

#[tokio::test]
async fn target_not_enrolled_hands_the_next_attempt_back_to_the_lan() {
    let s = Setup::new(true).await;
    s.lan_addr();
    let id = s.send_to_peer(ID1);
    // The LAN failed twice: the relay's.
    for _ in 0..2 {
        s.store
            .mailbox
            .with(|c| outbox::fail_lan(c, &id, "work", "down", s.clock_now()).map(|_| ()))
            .unwrap();
    }
    s.clock.set(s.row(&id).next_at);
    s.relay.on(
        "POST /v2/relay/items",
        push_reject("rejected:target not enrolled"),
    );
    s.client.push_due(&session("e1")).await.unwrap();
    let row = s.row(&id);
    assert_eq!(
        (row.state.as_str(), row.attempts, row.lan_failures),
        ("pending", 3, 1)
    );
    // The backoff stays; then the LAN takes it, not the relay.
    let c = s.store.fresh_conn();
    let ids = |rows: Vec<outbox::Row>| rows.into_iter().map(|r| r.msg_id).collect::<Vec<_>>();
    assert!(ids(outbox::due_for_lan(&c, row.next_at - 1, 10, true).unwrap()).is_empty());
    assert_eq!(
        ids(outbox::due_for_lan(&c, row.next_at, 10, true).unwrap()),
        vec![id.clone()]
    );
    assert!(ids(outbox::due_for_relay(&c, row.next_at, 10).unwrap()).is_empty());
    // One more LAN failure gives it to the relay again.
    outbox::fail_lan(&c, &id, "work", "down", row.next_at).unwrap();
    let row = s.row(&id);
    assert_eq!(
        ids(outbox::due_for_relay(&c, row.next_at, 10).unwrap()),
        vec![id.clone()]
    );
    // Other refusals keep the row with the relay.
    s.clock.set(row.next_at);
    s.relay.on(
        "POST /v2/relay/items",
        push_reject("rejected:quota:target queue full"),
    );
    s.client.push_due(&session("e1")).await.unwrap();
    assert_eq!(s.row(&id).lan_failures, 2);
}

#[tokio::test]
async fn no_usable_enc_key_on_the_relay_hands_the_row_back_to_the_lan() {
    let s = Setup::new(false).await;
    s.lan_addr();
    let id = s.send_to_peer(ID1);
    s.store
        .mailbox
        .with(|c| {
            c.execute("UPDATE outbox SET lan_failures = 2", [])?;
            Ok(())
        })
        .unwrap();
    // The relay has no ad for the peer (404).
    s.client.push_due(&session("e1")).await.unwrap();
    let row = s.assert_failed_once(&id, T0, "no enc key for work");
    assert_eq!(row.lan_failures, 1);
    assert!(s.relay.seen("POST /v2/relay/items").is_empty());
}

#[tokio::test]
async fn without_a_lan_address_a_refused_row_stays_with_the_relay() {
    let s = Setup::new(true).await;
    let id = s.send_to_peer(ID1);
    s.relay.on(
        "POST /v2/relay/items",
        push_reject("rejected:target not enrolled"),
    );
    s.client.push_due(&session("e1")).await.unwrap();
    let row = s.row(&id);
    assert_eq!((row.attempts, row.lan_failures), (1, 0));
    let c = s.store.fresh_conn();
    assert_eq!(outbox::due_for_relay(&c, row.next_at, 10).unwrap().len(), 1);
    assert!(outbox::due_for_lan(&c, row.next_at, 10, true)
        .unwrap()
        .is_empty());
}

// ---- duplicates re-queue delivery receipts -------------------------------------------------------

impl Setup {
    /// (msg_id, agent, host, state, next_at) of every queued receipt, oldest first.
    fn queued_receipts(&self) -> Vec<(String, String, String, String, i64)> {
        let c = self.store.fresh_conn();
        let mut st = c
            .prepare("SELECT msg_id, agent, host, state, next_at FROM receipt_outbox ORDER BY seq")
            .unwrap();
        st.query_map([], |r| {
            Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?, r.get(4)?))
        })
        .unwrap()
        .collect::<Result<_, _>>()
        .unwrap()
    }
}

#[tokio::test]
async fn a_duplicate_from_the_relay_queues_the_delivery_receipts_again() {
    let mut s = Setup::new(true).await;
    let received = Arc::new(tokio::sync::Notify::new());
    s.client.received = Some(received.clone());
    let m = testutil::ids().next(T0);
    let wire = s.peer_wire(&m, "in");
    let peer = s.peer_pub();
    let q = Arc::new(Mutex::new(Queue {
        epoch: "e1".into(),
        items: vec![item(5, &m, &peer, &wire)],
        head_override: None,
    }));
    serve_queue(&s.relay, q.clone());
    let pass = s.client.pull_pass(&session("e1")).await.unwrap();
    assert_eq!((pass.stored, pass.receipts_requeued), (1, 0));
    // alice read it, and the receipts went out (and were lost on the way, or expired).
    s.store
        .mailbox
        .with(|c| {
            crate::mailbox::messages::read(c, "alice", "home", &m, T0 + 1)?;
            c.execute("DELETE FROM receipt_outbox", [])?;
            Ok(())
        })
        .unwrap();
    // The sender pushes the same envelope again (its row is still relay-accepted).
    s.clock.set(T0 + 3_600_000);
    q.lock().unwrap().items.push(item(6, &m, &peer, &wire));
    let woken = received.notified();
    tokio::pin!(woken);
    woken.as_mut().enable();
    let pass = s.client.pull_pass(&session("e1")).await.unwrap();
    assert_eq!(
        (pass.stored, pass.duplicates, pass.receipts_requeued),
        (0, 1, 1)
    );
    // One receipt for the delivery as it is now, owed to the message's origin, due now.
    assert_eq!(
        s.queued_receipts(),
        vec![(
            m.clone(),
            "alice".to_string(),
            "work".to_string(),
            "read".to_string(),
            T0 + 3_600_000
        )]
    );
    tokio::time::timeout(std::time::Duration::from_secs(5), woken)
        .await
        .expect("the sender loops are woken");
    // A repeat while that receipt is still queued adds nothing.
    q.lock().unwrap().items.push(item(7, &m, &peer, &wire));
    let pass = s.client.pull_pass(&session("e1")).await.unwrap();
    assert_eq!((pass.duplicates, pass.receipts_requeued), (1, 0));
    assert_eq!(s.queued_receipts().len(), 1);
    // The re-queued receipt carries the delivery's state and time.
    let rec = s
        .store
        .mailbox
        .with(|c| {
            let row = crate::mailbox::receipts::due_for_relay(c, i64::MAX, 10)?.remove(0);
            Ok(crate::mailbox::receipts::record(&row, "home"))
        })
        .unwrap();
    assert_eq!(
        (rec.recipient.as_str(), rec.state.as_str(), rec.at.clone()),
        ("alice@home", "read", iso_ms(T0 + 1))
    );
}

// ---- relay trust: key pinning, enrolment recovery, enc-key ads, allowlist ---------------------

use super::state::{self as relay_trust, Standing};

const DAY_MS: i64 = 86_400_000;

/// A scripted relay that behaves: it serves `served` as its key in `epoch`, shows `you` (with a
/// fresh ad of this host) while `enrolled`, enrols on challenge + enrol, takes enc-key ads and
/// sender lists (recorded in `lists`), accepts pushes signed by the served key, and serves
/// `queue` for pulls and acks.
struct Trusty {
    served: Arc<Mutex<HostKey>>,
    epoch: Arc<Mutex<String>>,
    enrolled: Arc<std::sync::atomic::AtomicBool>,
    lists: Arc<Mutex<Vec<Value>>>,
    queue: Arc<Mutex<Queue>>,
}

impl Setup {
    fn trusty(&self) -> Trusty {
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

    fn url(&self) -> String {
        self.client.url.clone()
    }

    fn relay_state(&self) -> Option<relay_trust::RelayState> {
        let url = self.url();
        self.store
            .mailbox
            .with(|c| relay_trust::state(c, &url))
            .unwrap()
    }

    fn audits(&self, event: &str) -> Vec<crate::mailbox::audit::AuditEvent> {
        self.store
            .mailbox
            .with(|c| crate::mailbox::audit::recent(c, Some(event), 100))
            .unwrap()
    }

    /// Every request the relay saw, as `METHOD /path`, oldest first.
    fn routes(&self) -> Vec<String> {
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
    fn refuse_once(&self, route: &str, status: u16, code: &str, t: &Trusty) {
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

#[tokio::test]
async fn a_relay_key_change_stops_all_relay_use_until_the_owner_confirms_the_new_key() {
    let s = Setup::new(true).await;
    let t = s.trusty();
    let wake = Arc::new(tokio::sync::Notify::new());
    let (stop, stopped) = tokio::sync::watch::channel(false);
    let task = tokio::spawn(super::run(
        s.client.clone(),
        std::time::Duration::from_millis(50),
        wake.clone(),
        stopped,
    ));
    wait_for("a first session", || {
        s.relay_state().is_some_and(|st| st.state == Standing::Ok)
    })
    .await;
    // The relay now presents another key (a different relay behind the same URL).
    let new = HostKey::generate();
    *t.served.lock().unwrap() = new.clone();
    wait_for("the key mismatch", || {
        s.relay_state()
            .is_some_and(|st| st.state == Standing::KeyMismatch)
    })
    .await;
    // (The pass that was under way when the key changed has ended with the mismatch.)
    let seen_before = s.routes().len();
    // Mail waits: a send wakes the loop, but nothing is pushed, pulled or enrolled.
    let id = s.send_to_peer(ID1);
    wake.notify_one();
    wait_for("three more passes", || {
        s.routes()[seen_before..]
            .iter()
            .filter(|r| *r == "GET /v2/relay/info")
            .count()
            >= 3
    })
    .await;
    let after: Vec<String> = s.routes()[seen_before..].to_vec();
    assert!(
        after.iter().all(|r| r == "GET /v2/relay/info"),
        "only info while the key is wrong: {after:?}"
    );
    assert_eq!(s.row(&id).state, "pending");
    assert_eq!(s.row(&id).attempts, 0, "the row is not charged");
    // Audited once for this served key, not every pass; the state names both keys and the fix.
    let changed = s.audits("relay.key_changed");
    assert_eq!(changed.len(), 1, "{changed:?}");
    assert_eq!(changed[0].detail["served"], new.public().fingerprint());
    assert_eq!(
        changed[0].detail["pinned"],
        s.relay.key.public().fingerprint()
    );
    let st = s.relay_state().unwrap();
    assert_eq!(st.relay_fp, Some(new.public().fingerprint()));
    assert_eq!(st.pinned_fp, Some(s.relay.key.public().fingerprint()));
    assert_eq!(
        st.fix(&s.url()).unwrap(),
        format!(
            "agentmbx relay set {} --key {}",
            s.url(),
            new.public().fingerprint()
        )
    );
    // The owner confirms (what `relay set <url> --key <new>` writes): use resumes without a
    // restart, with a new enrolment for the new relay key, and accepts signed by it count.
    let (url, newpub) = (s.url(), new.public());
    s.store
        .mailbox
        .with(|c| relay_trust::confirm_key(c, &url, Some(&newpub), None, T0))
        .unwrap();
    assert_eq!(s.audits("relay.key_confirmed").len(), 1);
    wake.notify_one();
    wait_for("the push through the confirmed relay", || {
        s.row(&id).state == "relay-accepted"
    })
    .await;
    assert_eq!(
        s.relay.seen("POST /v1/relay/enrol").len(),
        1,
        "enrolled with the new key"
    );
    let enrolled = s.audits("relay.enrolled");
    assert_eq!(enrolled[0].detail["relay_key"], newpub.fingerprint());
    assert_eq!(enrolled[0].detail["why"], "the relay key changed");
    assert_eq!(s.audits("relay.key_changed").len(), 1);
    wait_for("state ok", || {
        s.relay_state().is_some_and(|st| st.state == Standing::Ok)
    })
    .await;
    s.relay.assert_hops_ok_except_plain();
    stop.send(true).unwrap();
    tokio::time::timeout(std::time::Duration::from_secs(10), task)
        .await
        .expect("the loop stops")
        .unwrap();
}

#[tokio::test]
async fn the_expected_key_is_the_only_one_pinned_on_first_contact() {
    let s = Setup::new(true).await;
    let _t = s.trusty();
    let url = s.url();
    let clock: SharedClock = s.clock.clone();
    // `relay set --key <fp>` while the relay was unreachable named another key.
    let other = HostKey::generate().public().fingerprint();
    let o = other.clone();
    s.store
        .mailbox
        .with(|c| relay_trust::confirm_key(c, &url, None, Some(&o), T0))
        .unwrap();
    for _ in 0..2 {
        let err = super::pin::resolve_key(&url, None, &s.store.mailbox, &clock)
            .await
            .unwrap_err();
        assert!(matches!(err, RelayError::KeyMismatch { .. }), "{err}");
    }
    let st = s.relay_state().unwrap();
    assert_eq!(
        (st.state, st.pinned_fp.as_deref()),
        (Standing::KeyMismatch, Some(other.as_str()))
    );
    let changed = s.audits("relay.key_changed");
    assert_eq!(changed.len(), 1);
    assert_eq!(changed[0].detail["expected"], other);
    // The expectation names the served key: pinned, expectation gone.
    let fp = s.relay.key.public().fingerprint();
    s.store
        .mailbox
        .with(|c| relay_trust::confirm_key(c, &url, None, Some(&fp), T0))
        .unwrap();
    assert_eq!(
        s.relay_state(),
        None,
        "the confirmation clears the mismatch"
    );
    let key = super::pin::resolve_key(&url, None, &s.store.mailbox, &clock)
        .await
        .unwrap();
    assert_eq!(key, s.relay.key.public());
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
    assert_eq!((k, e), (Some(s.relay.key.public().to_b64()), None));
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
        super::pass(&s.client).await.unwrap();
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
        super::pass(&s.client).await.unwrap();
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
        super::pass(&s.client).await.unwrap();
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
    super::pass(&s.client).await.unwrap();
    let id = s.send_to_peer(ID1);
    s.relay.on("POST /v2/relay/items", |_| {
        (
            403,
            json!({"error": "this host key is revoked on this relay", "code": "REVOKED"}),
        )
    });
    let err = super::pass(&s.client).await.unwrap_err();
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
            super::pass(&s.client).await,
            Err(RelayError::Refused {
                standing: Standing::Revoked,
                ..
            })
        ));
    }
    assert!(s.relay.seen("POST /v1/relay/challenge").is_empty());
    s.clock.advance(60_000);
    assert!(matches!(
        super::pass(&s.client).await,
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
    super::pass(&s.client).await.unwrap();
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
    let err = super::pass(&s.client).await.unwrap_err();
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
        super::pass(&s.client).await,
        Err(RelayError::Refused {
            standing: Standing::Denied,
            ..
        })
    ));
    assert_eq!(s.relay.seen("POST /v1/relay/enrol").len(), 1);
    // The operator lifts the deny: after the pause the host enrols again and is ok.
    denying.store(false, Ordering::SeqCst);
    s.clock.advance(60_000);
    super::pass(&s.client).await.unwrap();
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
        super::session::refusal_of(&status(Some("REVOKED"))).0,
        Standing::Revoked
    );
    for code in [Some("DENIED"), Some("SOMETHING_ELSE"), None] {
        let (standing, detail) = super::session::refusal_of(&status(code));
        assert_eq!(standing, Standing::Denied, "{code:?}");
        assert!(detail.contains("for now"), "{detail}");
    }
    assert!(super::session::refusal_of(&status(None))
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

#[tokio::test]
async fn the_enc_ad_is_republished_on_a_new_epoch_daily_and_on_a_key_change() {
    let s = Setup::new(true).await;
    let t = s.trusty();
    // The relay already holds a fresh ad of this host: adopted, not republished.
    s.client.open_session().await.unwrap();
    assert_eq!(s.relay.seen("POST /v2/relay/enc-key").len(), 0);
    let st = s.relay_state().unwrap();
    assert_eq!(st.enc_ad_exp, Some(iso_ms(T0 + 30 * DAY_MS)));
    // A new epoch (a restore): challenge, enrol and enc-ad publish again, audited.
    *t.epoch.lock().unwrap() = "e2".into();
    t.queue.lock().unwrap().epoch = "e2".into();
    s.client.open_session().await.unwrap();
    assert_eq!(s.relay.seen("POST /v1/relay/enrol").len(), 1);
    let ads = s.relay.seen("POST /v2/relay/enc-key");
    assert_eq!(ads.len(), 1);
    let ad = records::verify_enc_ad(
        &ads[0].json()["ad"],
        ads[0].json()["sig"].as_str(),
        &s.me_pub(),
        T0,
    )
    .unwrap();
    assert_eq!(
        (ad.iat.clone(), ad.exp.clone()),
        (iso_ms(T0), iso_ms(T0 + 30 * DAY_MS))
    );
    let enrolled = s.audits("relay.enrolled");
    assert_eq!(enrolled[0].detail["why"], "new relay epoch");
    assert_eq!(enrolled[0].detail["epoch"], "e2");
    // Same epoch, within the day: nothing.
    s.clock.advance(DAY_MS - 1);
    s.client.open_session().await.unwrap();
    assert_eq!(s.relay.seen("POST /v2/relay/enc-key").len(), 1);
    // A day after the last publish: refreshed (no enrolment).
    s.clock.advance(1);
    s.client.open_session().await.unwrap();
    assert_eq!(s.relay.seen("POST /v2/relay/enc-key").len(), 2);
    assert_eq!(s.relay.seen("POST /v1/relay/enrol").len(), 1);
    // This host's enc key changed: published at once, naming the new key.
    let mut me2 = (*s.me).clone();
    me2.enc_key = EncKey::generate();
    let me2 = Arc::new(me2);
    let c2 = Setup::client_for(&s.relay.url, &s.relay.key, &me2, &s.store, &s.clock);
    c2.open_session().await.unwrap();
    let ads = s.relay.seen("POST /v2/relay/enc-key");
    assert_eq!(ads.len(), 3);
    assert_eq!(
        ads[2].json()["ad"]["enc_pub"],
        me2.enc_key.public().to_b64()
    );
    // A publish the relay refuses is its own state; receiving still works.
    s.relay.on("POST /v2/relay/enc-key", |_| {
        (
            400,
            json!({"error": "enc-key ad refused: expired", "code": "BAD_REQUEST"}),
        )
    });
    s.clock.advance(DAY_MS);
    s.client.open_session().await.unwrap();
    let st = s.relay_state().unwrap();
    assert_eq!((st.state, st.status), (Standing::EncAdFailed, Some(400)));
}

/// Case `clock-fix-does-not-release-mail`: an ad published while the clock was 10 min ahead
/// (its `iat` ahead of the right clock, the relay's copy expiring too late to look fresh) is
/// published again as soon as the clock is right, not once the clock has caught up.
#[test]
fn an_ad_published_under_a_clock_ahead_is_due_once_the_clock_is_right() {
    const SKEW: i64 = 600_000;
    let (host, enc, iat) = ("H", "E", T0 + SKEW);
    let published = super::state::PublishedAd {
        host_pubkey: host.into(),
        enc_pub: enc.into(),
        iat,
        exp: iat + 30 * DAY_MS,
        epoch: "e1".into(),
    };
    let served = agentmbx_protocol::wire::YouEncAd {
        enc_pub: enc.into(),
        exp: iso_ms(iat + 30 * DAY_MS),
        v1: false,
    };
    let due = super::session::ad_due;
    assert_eq!(
        due(Some(&published), Some(&served), host, enc, "e1", T0),
        Some("published while the clock was ahead")
    );
    // Under the skewed clock itself it was current.
    assert_eq!(
        due(Some(&published), Some(&served), host, enc, "e1", iat),
        None
    );
}

#[test]
fn the_ad_is_due_exactly_when_the_rules_say() {
    let (host, enc) = ("H", "E");
    let rec = |iat: i64, epoch: &str| super::state::PublishedAd {
        host_pubkey: host.into(),
        enc_pub: enc.into(),
        iat,
        exp: iat + 30 * DAY_MS,
        epoch: epoch.into(),
    };
    let served = |exp: i64, v1: bool, e: &str| agentmbx_protocol::wire::YouEncAd {
        enc_pub: e.into(),
        exp: iso_ms(exp),
        v1,
    };
    let due = super::session::ad_due;
    let now = T0;
    let fresh = served(now + 30 * DAY_MS, false, enc);
    // Nothing published from here, relay copy fresh: adopt. Not fresh: publish.
    assert_eq!(due(None, Some(&fresh), host, enc, "e1", now), None);
    assert!(due(None, None, host, enc, "e1", now).is_some());
    assert!(due(
        None,
        Some(&served(now + 29 * DAY_MS, false, enc)),
        host,
        enc,
        "e1",
        now
    )
    .is_some());
    assert!(due(
        None,
        Some(&served(now + 30 * DAY_MS, true, enc)),
        host,
        enc,
        "e1",
        now
    )
    .is_some());
    assert!(due(
        None,
        Some(&served(now + 30 * DAY_MS, false, "X")),
        host,
        enc,
        "e1",
        now
    )
    .is_some());
    // Published: key change, epoch, daily; drift only after the retry pause.
    let r = rec(now, "e1");
    assert_eq!(
        due(Some(&r), Some(&fresh), host, enc, "e1", now + DAY_MS - 1),
        None
    );
    assert_eq!(
        due(Some(&r), Some(&fresh), host, enc, "e1", now + DAY_MS),
        Some("daily refresh")
    );
    assert_eq!(
        due(Some(&r), Some(&fresh), host, enc, "e2", now),
        Some("new relay epoch")
    );
    assert_eq!(
        due(Some(&r), Some(&fresh), host, "E2", "e1", now),
        Some("this host's keys changed")
    );
    assert_eq!(
        due(Some(&r), Some(&fresh), "H2", enc, "e1", now),
        Some("this host's keys changed")
    );
    assert_eq!(due(Some(&r), None, host, enc, "e1", now + 59_999), None);
    assert!(due(Some(&r), None, host, enc, "e1", now + 60_000).is_some());
}

#[test]
fn relay_served_enc_ads_are_refused_with_the_exact_reasons() {
    let peer = testutil::identity("work");
    let pk = peer.host_key.public().to_b64();
    let enc = peer.enc_key.public().to_b64();
    let answer = |ad: Option<&EncAd>, signer: &HostKey, served: &str, v1sig: Option<&str>| {
        agentmbx_protocol::wire::EncKeyAnswer {
            host: "work".into(),
            host_pubkey: pk.clone(),
            enc_pub: served.into(),
            sig: v1sig.map(String::from),
            ad: ad.map(|a| a.to_value()),
            ad_sig: ad.map(|a| a.sign(signer)),
        }
    };
    let check = |a: &agentmbx_protocol::wire::EncKeyAnswer| {
        super::session::enc_ad_from_answer(a, &pk, T0).map(|ad| ad.enc_pub)
    };
    let good = EncAd::new("work", &peer.host_key.public(), &enc, T0);
    assert_eq!(
        check(&answer(Some(&good), &peer.host_key, &enc, None)),
        Ok(enc.clone())
    );
    let other = EncKey::generate().public().to_b64();
    assert_eq!(
        check(&answer(Some(&good), &peer.host_key, &other, None)).unwrap_err(),
        "tampered: the served key differs from the signed advertisement"
    );
    let v1 = check(&answer(None, &peer.host_key, &enc, Some("c2ln"))).unwrap_err();
    assert!(v1.starts_with("unexpiring v1 advertisement ("), "{v1}");
    assert_eq!(
        check(&answer(None, &peer.host_key, &enc, None)).unwrap_err(),
        "unsigned"
    );
    assert_eq!(
        check(&answer(Some(&good), &HostKey::generate(), &enc, None)).unwrap_err(),
        "bad signature"
    );
    let stranger = HostKey::generate();
    let theirs = EncAd::new("work", &stranger.public(), &enc, T0);
    assert_eq!(
        check(&answer(Some(&theirs), &stranger, &enc, None)).unwrap_err(),
        "wrong peer"
    );
    let old = EncAd::new("work", &peer.host_key.public(), &enc, T0 - 31 * DAY_MS);
    assert_eq!(
        check(&answer(Some(&old), &peer.host_key, &enc, None)).unwrap_err(),
        "expired"
    );
    let ahead = EncAd::new("work", &peer.host_key.public(), &enc, T0 + 300_001);
    assert_eq!(
        check(&answer(Some(&ahead), &peer.host_key, &enc, None)).unwrap_err(),
        "not yet valid"
    );
    let mut long = EncAd::new("work", &peer.host_key.public(), &enc, T0);
    long.exp = iso_ms(T0 + 90 * DAY_MS + 1);
    assert_eq!(
        check(&answer(Some(&long), &peer.host_key, &enc, None)).unwrap_err(),
        "lifetime over the maximum"
    );
    let mut bad = answer(Some(&good), &peer.host_key, &enc, None);
    bad.ad_sig = Some(String::new());
    assert_eq!(check(&bad).unwrap_err(), "unsigned");
}

#[tokio::test]
async fn a_rolled_back_relay_ad_is_refused_recorded_and_audited_once() {
    let s = Setup::new(false).await;
    let k1 = EncKey::generate().public().to_b64();
    let k2 = s.peer.enc_key.public().to_b64();
    let peer = s.peer_pub();
    // The newest ad accepted for this peer host key named k1 at T0 (the peer row later lost
    // its enc key, e.g. through a rotation); the relay now replays an older ad naming k2.
    s.store
        .mailbox
        .with(|c| relay_trust::guard_enc_ad(c, &peer, &k1, T0).map(|r| r.unwrap()))
        .unwrap();
    let older = EncAd::new("work", &s.peer.host_key.public(), &k2, T0 - DAY_MS);
    let answer = enc_answer(&s.peer, &older, &s.peer.host_key, &k2);
    s.relay
        .on("GET /v2/relay/enc-key", move |_| (200, answer.clone()));
    s.accept_all("e1", "accepted");
    let id = s.send_to_peer(ID1);
    for _ in 0..2 {
        let pass = s.client.push_due(&session("e1")).await.unwrap();
        assert_eq!(pass.accepted, 0);
        s.clock.advance(60_000);
    }
    assert_eq!(s.row(&id).wire, None, "never sealed for a rolled-back key");
    assert!(s.relay.seen("POST /v2/relay/items").is_empty());
    let why = s
        .store
        .mailbox
        .with(|c| relay_trust::enc_refusal(c, "work"))
        .unwrap()
        .unwrap();
    assert!(why.starts_with("rolled back: "), "{why}");
    let audited = s.audits("enc_key.rejected");
    assert_eq!(audited.len(), 1, "once per reason");
    assert_eq!(audited[0].detail["reason"], why.as_str());
    let p = s
        .store
        .mailbox
        .with(|c| peers::by_name(c, "work"))
        .unwrap()
        .unwrap();
    assert_eq!(p.enc_pub, None);
    // A newer ad naming k2 is accepted, and the refusal record is cleared.
    let newer = EncAd::new("work", &s.peer.host_key.public(), &k2, T0 + 1);
    let answer = enc_answer(&s.peer, &newer, &s.peer.host_key, &k2);
    s.relay
        .on("GET /v2/relay/enc-key", move |_| (200, answer.clone()));
    s.clock.advance(10 * 60_000);
    let pass = s.client.push_due(&session("e1")).await.unwrap();
    assert_eq!(pass.accepted, 1);
    assert_eq!(
        s.store
            .mailbox
            .with(|c| relay_trust::enc_refusal(c, "work"))
            .unwrap(),
        None
    );
}

#[tokio::test]
async fn the_allowlist_is_published_signed_and_republished_when_peers_change() {
    let s = Setup::new(true).await;
    let t = s.trusty();
    s.client.open_session().await.unwrap();
    let check = |n: usize, expect: &[String]| {
        let lists = t.lists.lock().unwrap();
        assert_eq!(lists.len(), n, "{lists:?}");
        let body = lists.last().unwrap();
        let list = &body["list"];
        assert_eq!(list["type"], "relay-senders");
        assert_eq!(list["v"], 1);
        assert_eq!(list["host_pubkey"], s.me_pub());
        assert_eq!(list["senders"], json!(expect));
        let signed = agentmbx_protocol::canonical::to_string(list).unwrap();
        assert!(s
            .me
            .host_key
            .public()
            .verify(signed.as_bytes(), body["sig"].as_str().unwrap()));
        list["iat"].as_str().unwrap().to_string()
    };
    let iat1 = check(1, &[s.peer_pub()]);
    assert_eq!(iat1, iso_ms(T0));
    // Unchanged peers: not published again.
    s.client.open_session().await.unwrap();
    assert_eq!(t.lists.lock().unwrap().len(), 1);
    // A new peer (pairing): republished, sorted, with a later iat.
    let third = testutil::identity("third");
    s.store.add_peer(&third, false);
    s.clock.advance(1_000);
    s.client.open_session().await.unwrap();
    let mut both = vec![s.peer_pub(), third.host_key.public().to_b64()];
    both.sort();
    let iat2 = check(2, &both);
    assert!(iat2 > iat1);
    // Unpairing: republished without it.
    s.store
        .mailbox
        .with(|c| peers::remove(c, "work").map(|_| ()))
        .unwrap();
    s.client.open_session().await.unwrap();
    check(3, &[third.host_key.public().to_b64()]);
    s.relay.assert_hops_ok_except_plain();
}

#[tokio::test]
async fn a_stale_allowlist_is_signed_again_once_and_a_refusal_waits() {
    let s = Setup::new(true).await;
    let _t = s.trusty();
    let bodies = Arc::new(Mutex::new(Vec::<Value>::new()));
    let b = bodies.clone();
    let mut answers = vec![
        (409, "STALE"),
        (409, "STALE"),
        (404, "NOT_FOUND"),
        (401, "BAD_SIGNATURE"),
    ]
    .into_iter();
    s.relay.on("POST /v2/relay/senders", move |req| {
        b.lock().unwrap().push(req.json());
        match answers.next() {
            Some((status, code)) => (status, json!({"error": "refused", "code": code})),
            None => (200, json!({"ok": true})),
        }
    });
    let iat = |n: usize| {
        agentmbx_protocol::time::parse_iso_ms(
            bodies.lock().unwrap()[n]["list"]["iat"].as_str().unwrap(),
        )
        .unwrap()
    };
    // 409 STALE: signed again once with iat = now + 4 min; refused again → waits a minute.
    s.client.open_session().await.unwrap();
    assert_eq!(bodies.lock().unwrap().len(), 2);
    assert_eq!((iat(0), iat(1)), (T0, T0 + super::allowlist::STALE_BUMP_MS));
    assert_eq!(s.audits("relay.senders_failed").len(), 1);
    s.client.open_session().await.unwrap();
    assert_eq!(bodies.lock().unwrap().len(), 2, "no retry inside the pause");
    // After the pause: tried again (404: the relay has no allowlist endpoint), audited once.
    s.clock.advance(super::allowlist::RETRY_AFTER_FAILURE_MS);
    s.client.open_session().await.unwrap();
    assert_eq!(bodies.lock().unwrap().len(), 3);
    assert_eq!(s.audits("relay.senders_failed").len(), 1);
    // A 401 about the list's signature is the list's failure, not a lost enrolment.
    s.clock.advance(super::allowlist::RETRY_AFTER_FAILURE_MS);
    s.client.open_session().await.unwrap();
    assert_eq!(bodies.lock().unwrap().len(), 4);
    assert!(s.relay.seen("POST /v1/relay/enrol").is_empty());
    // Then it is taken, and recorded: nothing more.
    s.clock.advance(super::allowlist::RETRY_AFTER_FAILURE_MS);
    s.client.open_session().await.unwrap();
    s.client.open_session().await.unwrap();
    assert_eq!(bodies.lock().unwrap().len(), 5);
    assert_eq!(s.relay_state().unwrap().state, Standing::Ok);
}

// ---- rate limits (wire.md "Rate limits": clients back off by the value given) ------------------

#[test]
fn a_429_waits_the_retry_after_header_else_the_body_else_a_minute() {
    let ms = |header: Option<&str>, body: &str| match super::rate_limited(header, body.as_bytes()) {
        RelayError::RateLimited { retry_after_ms } => retry_after_ms,
        other => panic!("{other}"),
    };
    let body = r#"{"error":"rate_limit_exceeded","code":"RATE_LIMIT","retry_after":12}"#;
    assert_eq!(ms(Some("7"), body), 7_000, "the header wins");
    assert_eq!(ms(None, body), 12_000);
    assert_eq!(ms(Some("Wed, 21 Oct 2026 07:28:00 GMT"), body), 12_000);
    assert_eq!(ms(None, "not json"), super::DEFAULT_RATE_LIMIT_WAIT_MS);
    // Kept within 1 s ..= 1 h.
    assert_eq!(ms(Some("0"), body), 1_000);
    assert_eq!(ms(Some("999999999"), body), super::MAX_RATE_LIMIT_WAIT_MS);
    // Every error answer path turns a 429 into the same typed error.
    assert!(matches!(
        super::status_error(429, body.as_bytes()),
        RelayError::RateLimited {
            retry_after_ms: 12_000
        }
    ));
}

#[tokio::test]
async fn a_429_makes_the_loop_wait_the_given_time_before_its_next_pass() {
    let s = Setup::new(true).await;
    let me = s.me_pub();
    let enc = s.me.enc_key.public().to_b64();
    let key = s.relay.key.clone();
    let mut infos = 0;
    s.relay.on("GET /v2/relay/info", move |_| {
        infos += 1;
        if infos == 1 {
            return (
                429,
                json!({"error": "rate_limit_exceeded", "code": "RATE_LIMIT", "retry_after": 30}),
            );
        }
        let you = json!({"host": "home", "pubkey": me, "head_seq": 0, "acked_through": 0,
                         "enc_ad": {"enc_pub": enc, "exp": iso_ms(T0 + 30 * 86_400_000), "v1": false}});
        (200, info(&key, "e1", Some(you)))
    });
    s.accept_all("e1", "accepted");
    serve_queue(
        &s.relay,
        Arc::new(Mutex::new(Queue {
            epoch: "e1".into(),
            items: vec![],
            head_override: None,
        })),
    );
    let wake = Arc::new(tokio::sync::Notify::new());
    let (stop, stopped) = tokio::sync::watch::channel(false);
    let task = tokio::spawn(super::run(
        s.client.clone(),
        std::time::Duration::from_millis(50),
        wake.clone(),
        stopped,
    ));
    let infos_seen = || s.relay.seen("GET /v2/relay/info").len();
    wait_for("the refused info", || infos_seen() == 1).await;
    // A send wakes the loop, and the relay clock runs to just before the 30 s: no new pass
    // (the pull interval is 50 ms, so a loop that did not wait would have asked many times).
    let id = s.send_to_peer(ID1);
    wake.notify_one();
    s.clock.advance(29_999);
    let early = tokio::time::timeout(std::time::Duration::from_millis(2_500), async {
        while infos_seen() == 1 {
            tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        }
    })
    .await;
    assert!(early.is_err(), "a pass ran before retry_after had passed");
    assert!(s.relay.seen("POST /v2/relay/items").is_empty());
    // Once it has passed, the next pass runs and the row is pushed.
    s.clock.advance(1);
    wait_for("the pass after the wait", || infos_seen() >= 2).await;
    wait_for("the relay accept", || s.row(&id).state == "relay-accepted").await;
    stop.send(true).unwrap();
    tokio::time::timeout(std::time::Duration::from_secs(10), task)
        .await
        .expect("the loop stops on shutdown")
        .unwrap();
}

#[tokio::test]
async fn rejected_rate_keeps_the_row_queued_and_backs_it_off() {
    let s = Setup::new(true).await;
    let id = s.send_to_peer(ID1);
    s.relay
        .on("POST /v2/relay/items", push_reject("rejected:rate"));
    let pass = s.client.push_due(&session("e1")).await.unwrap();
    assert_eq!((pass.accepted, pass.failed), (0, 1));
    s.assert_pending_after_one_failure(&id, T0, "rejected:rate");
    // Not pushed again before its backoff ends; pushed again after.
    s.clock.advance(outbox::backoff_ms(0) - 1);
    s.client.push_due(&session("e1")).await.unwrap();
    assert_eq!(s.relay.seen("POST /v2/relay/items").len(), 1);
    s.clock.advance(1);
    s.accept_all("e1", "accepted");
    s.client.push_due(&session("e1")).await.unwrap();
    assert_eq!(s.relay.seen("POST /v2/relay/items").len(), 2);
    assert_eq!(s.row(&id).state, "relay-accepted");
}

/// A relay's 429 answer asking for `secs` seconds.
fn too_many(secs: u64) -> Answer {
    (
        429,
        json!({"error": "rate_limit_exceeded", "code": "RATE_LIMIT", "retry_after": secs}),
    )
}

#[track_caller]
fn assert_rate_limited<T: std::fmt::Debug>(got: Result<T, RelayError>, ms: u64) {
    match got {
        Err(RelayError::RateLimited { retry_after_ms }) => assert_eq!(retry_after_ms, ms),
        other => panic!("expected RateLimited({ms} ms), got {other:?}"),
    }
}

#[tokio::test]
async fn a_429_on_push_or_enc_key_lookup_ends_the_pass_and_charges_no_row() {
    // On the push itself: the row keeps its attempts, error and due time.
    let s = Setup::new(true).await;
    let id = s.send_to_peer(ID1);
    let before = s.row(&id);
    s.relay.on("POST /v2/relay/items", |_| too_many(30));
    assert_rate_limited(s.client.push_due(&session("e1")).await, 30_000);
    let after = s.row(&id);
    assert_eq!(
        (
            after.state.as_str(),
            after.attempts,
            after.next_at,
            after.last_error.as_deref()
        ),
        (
            before.state.as_str(),
            0,
            before.next_at,
            before.last_error.as_deref()
        )
    );
    assert_eq!(s.relay.seen("POST /v2/relay/items").len(), 1);
    // Still due: the next pass pushes it (the same sealed bytes).
    s.accept_all("e1", "accepted");
    s.client.push_due(&session("e1")).await.unwrap();
    assert_eq!(s.row(&id).state, "relay-accepted");

    // On the enc-key lookup: nothing is sealed, pushed or charged.
    let s = Setup::new(false).await;
    let id = s.send_to_peer(ID1);
    s.relay.on("GET /v2/relay/enc-key", |_| too_many(7));
    assert_rate_limited(s.client.push_due(&session("e1")).await, 7_000);
    let row = s.row(&id);
    assert_eq!((row.attempts, row.wire, row.last_error), (0, None, None));
    assert!(s.relay.seen("POST /v2/relay/items").is_empty());
}

#[tokio::test]
async fn a_429_on_receipts_pull_or_ack_ends_the_pass_and_charges_nothing() {
    // Receipts keep their attempts.
    let s = Setup::new(true).await;
    s.receive_and_read(ID1);
    let before = s.receipt_rows();
    s.relay.on("POST /v2/relay/items", |_| too_many(12));
    assert_rate_limited(s.client.push_receipts(&session("e1")).await, 12_000);
    assert_eq!(s.receipt_rows(), before);
    assert!(before.iter().all(|r| r.2 == 0), "{before:?}");

    // A 429 on the pull.
    let s = Setup::new(true).await;
    s.relay.on("GET /v2/relay/items", |_| too_many(5));
    assert_rate_limited(s.client.pull_pass(&session("e1")).await, 5_000);
    assert_eq!(s.messages(), 0);

    // A 429 on the ack: the checkpoint already written stays, the pass ends.
    let s = Setup::new(true).await;
    let mut g = testutil::ids();
    let peer = s.peer_pub();
    let id = g.next(T0);
    let q = Arc::new(Mutex::new(Queue {
        epoch: "e1".into(),
        items: vec![item(10, &id, &peer, &s.peer_wire(&id, "m"))],
        head_override: None,
    }));
    serve_queue(&s.relay, q);
    s.relay.on("POST /v2/relay/ack", |_| too_many(9));
    assert_rate_limited(s.client.pull_pass(&session("e1")).await, 9_000);
    let pos = s.position();
    assert_eq!((pos.received_through, pos.acked_through), (10, 0));
    assert_eq!(s.messages(), 1);
    assert_eq!(s.relay.seen("GET /v2/relay/items").len(), 1);
}

#[tokio::test]
async fn a_429_on_push_makes_the_loop_wait_the_given_time_before_its_next_pass() {
    let s = Setup::new(true).await;
    let me = s.me_pub();
    let enc = s.me.enc_key.public().to_b64();
    let key = s.relay.key.clone();
    s.relay.on("GET /v2/relay/info", move |_| {
        let you = json!({"host": "home", "pubkey": me, "head_seq": 0, "acked_through": 0,
                         "enc_ad": {"enc_pub": enc, "exp": iso_ms(T0 + 30 * 86_400_000), "v1": false}});
        (200, info(&key, "e1", Some(you)))
    });
    serve_queue(
        &s.relay,
        Arc::new(Mutex::new(Queue {
            epoch: "e1".into(),
            items: vec![],
            head_override: None,
        })),
    );
    // The first push is answered 429 (30 s); later ones are accepted.
    let me = s.me_pub();
    let mut accept = push_answer(s.relay.key.clone(), "e1", "accepted", move |a| {
        a.sender = me.clone()
    });
    let mut pushes = 0;
    s.relay.on("POST /v2/relay/items", move |req| {
        pushes += 1;
        if pushes == 1 {
            return too_many(30);
        }
        accept(req)
    });
    let id = s.send_to_peer(ID1);
    let wake = Arc::new(tokio::sync::Notify::new());
    let (stop, stopped) = tokio::sync::watch::channel(false);
    let task = tokio::spawn(super::run(
        s.client.clone(),
        std::time::Duration::from_millis(50),
        wake.clone(),
        stopped,
    ));
    let pushes_seen = || s.relay.seen("POST /v2/relay/items").len();
    wait_for("the refused push", || pushes_seen() == 1).await;
    let infos = s.relay.seen("GET /v2/relay/info").len();
    // No pass runs before the 30 s have passed on the clock, whatever wakes the loop (the pull
    // interval is 50 ms, so a loop that did not wait would have passed many times).
    wake.notify_one();
    s.clock.advance(29_999);
    let early = tokio::time::timeout(std::time::Duration::from_millis(2_500), async {
        while s.relay.seen("GET /v2/relay/info").len() == infos {
            tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        }
    })
    .await;
    assert!(early.is_err(), "a pass ran before retry_after had passed");
    assert_eq!(pushes_seen(), 1);
    let row = s.row(&id);
    assert_eq!((row.state.as_str(), row.attempts), ("pending", 0));
    // Then the next pass pushes the row again and it settles.
    s.clock.advance(1);
    wait_for("the relay accept", || s.row(&id).state == "relay-accepted").await;
    assert_eq!(pushes_seen(), 2);
    stop.send(true).unwrap();
    tokio::time::timeout(std::time::Duration::from_secs(10), task)
        .await
        .expect("the loop stops on shutdown")
        .unwrap();
}

#[tokio::test]
async fn a_key_change_stays_recorded_after_the_relay_serves_the_pinned_key_again() {
    let s = Setup::new(true).await;
    let t = s.trusty();
    let wake = Arc::new(tokio::sync::Notify::new());
    let (stop, stopped) = tokio::sync::watch::channel(false);
    let task = tokio::spawn(super::run(
        s.client.clone(),
        std::time::Duration::from_millis(50),
        wake.clone(),
        stopped,
    ));
    wait_for("a first session", || {
        s.relay_state().is_some_and(|st| st.state == Standing::Ok)
    })
    .await;
    let url = s.url();
    let change = |s: &Setup| {
        s.store
            .mailbox
            .with(|c| relay_trust::key_change(c, &url))
            .unwrap()
    };
    assert_eq!(change(&s), None);
    // Another key for a while, then the pinned one again.
    let other = HostKey::generate();
    *t.served.lock().unwrap() = other.clone();
    wait_for("the key mismatch", || {
        s.relay_state()
            .is_some_and(|st| st.state == Standing::KeyMismatch)
    })
    .await;
    *t.served.lock().unwrap() = s.relay.key.clone();
    wake.notify_one();
    wait_for("use resumed with the pinned key", || {
        s.relay_state().is_some_and(|st| st.state == Standing::Ok)
    })
    .await;
    let id = s.send_to_peer(ID1);
    wake.notify_one();
    wait_for("the push through the pinned key", || {
        s.row(&id).state == "relay-accepted"
    })
    .await;
    // The change is still on record: which key, since when; audited once.
    let c = change(&s).expect("the key change is kept");
    assert_eq!(
        (c.how.as_str(), c.pinned.as_str(), c.served.as_str()),
        (
            "pinned",
            s.relay.key.public().fingerprint().as_str(),
            other.public().fingerprint().as_str()
        )
    );
    assert_eq!(c.at, iso_ms(T0));
    assert_eq!(s.audits("relay.key_changed").len(), 1);
    // The other key again: the same change, not audited twice.
    *t.served.lock().unwrap() = other.clone();
    wake.notify_one();
    wait_for("the key mismatch again", || {
        s.relay_state()
            .is_some_and(|st| st.state == Standing::KeyMismatch)
    })
    .await;
    assert_eq!(s.audits("relay.key_changed").len(), 1);
    assert_eq!(change(&s), Some(c));
    *t.served.lock().unwrap() = s.relay.key.clone();
    wake.notify_one();
    wait_for("use resumed again", || {
        s.relay_state().is_some_and(|st| st.state == Standing::Ok)
    })
    .await;
    // The owner keeps the pinned key: the record goes, the decision is audited.
    let pinned = s.relay.key.public();
    let done = s
        .store
        .mailbox
        .with(|c| relay_trust::confirm_key(c, &url, Some(&pinned), None, T0))
        .unwrap();
    assert!(done.changed);
    assert_eq!(change(&s), None);
    let confirmed = s.audits("relay.key_confirmed");
    assert_eq!(confirmed.len(), 1);
    assert_eq!(confirmed[0].detail["kept"], true);
    assert_eq!(confirmed[0].detail["served"], other.public().fingerprint());
    assert_eq!(confirmed[0].detail["to"], pinned.fingerprint());
    stop.send(true).unwrap();
    tokio::time::timeout(std::time::Duration::from_secs(10), task)
        .await
        .expect("the loop stops")
        .unwrap();
}
