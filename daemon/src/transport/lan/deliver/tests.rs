//! Tests of LAN delivery: against the real LAN server of a peer (served on 127.0.0.1:0 with its
//! own `mailbox.db`), and against a scripted peer whose answers each test chooses. Time is a
//! manual clock; nothing sleeps to wait for an outcome.
//!
//! This module holds the hosts and the scripted peer, batching, delivery end to end, verdicts
//! and the loop; its children cover the hand-over to the relay, peer rate limits and receipts.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use axum::body::Bytes;
use axum::extract::State;
use axum::http::{Method, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use axum::{Json, Router};
use serde_json::{json, Value};

use agentmbx_protocol::clock::{Clock, ManualClock};

use super::*;
use crate::identity::Identity;
use crate::mailbox::receipts as receipt_store;
use crate::testutil::{self, Store, T0};
use crate::transport::lan::{server, LanState};

mod handover;
mod peer_limits;
mod receipts;

// ---- a host: identity, store, clock, and optionally its real LAN server --------------------

struct Host {
    ident: Arc<Identity>,
    store: Store,
    clock: Arc<ManualClock>,
    addr: Option<String>,
    _stop: Option<tokio::sync::oneshot::Sender<()>>,
}

impl Host {
    fn new(name: &str, clock: Arc<ManualClock>) -> Self {
        crate::install_tls_provider();
        let store = testutil::store();
        // The agents these tests mail have mailboxes (else their mail is held as unclaimed):
        // alice on home, bob and carol on work.
        match name {
            "home" => store.register(name, &["alice"]),
            "work" => store.register(name, &["bob", "carol"]),
            _ => {}
        }
        Host {
            ident: Arc::new(testutil::identity(name)),
            store,
            clock,
            addr: None,
            _stop: None,
        }
    }

    /// Serves this host's real LAN routes.
    async fn serve(&mut self) {
        let state = Arc::new(LanState {
            ident: self.ident.clone(),
            mailbox: self.store.mailbox.clone(),
            clock: self.clock.clone(),
            version: "test",
            started_at: agentmbx_protocol::time::iso_ms(T0),
            port: 0,
            advertise: String::new(),
            self_addrs: Vec::new(),
            wake: Arc::new(tokio::sync::Notify::new()),
            pairing: crate::pairing::PairingMemory::default(),
            instance: Default::default(),
        });
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        self.addr = Some(listener.local_addr().unwrap().to_string());
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        tokio::spawn(server::serve(listener, state, async move {
            let _ = stopped.await;
        }));
        self._stop = Some(stop);
    }

    /// Pins `other` (enc key known when `with_enc`) at LAN address `addr`, if any.
    fn pin(&self, other: &Identity, with_enc: bool, addr: Option<&str>) {
        self.store.add_peer(other, with_enc);
        if let Some(a) = addr {
            let host = other.host.to_string();
            self.store
                .mailbox
                .with(|c| peers::set_addr(c, &host, a, "cli"))
                .unwrap();
        }
    }

    fn delivery(&self, relay_configured: bool) -> LanDelivery {
        let client = LanClient::new(self.ident.clone(), self.clock.clone(), 7400).unwrap();
        LanDelivery::new(client, self.store.mailbox.clone(), relay_configured)
    }

    fn send(&self, id: &str, to: &[&str]) {
        let out = self
            .store
            .send(&self.ident, "alice", to, "hello", id, self.clock.now_ms())
            .unwrap();
        assert!(!out.queued_for_hosts.is_empty());
    }

    fn row(&self, id: &str, host: &str) -> outbox::Row {
        self.store
            .mailbox
            .with(|c| outbox::get(c, id, host))
            .unwrap()
            .expect("outbox row")
    }

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
}

// ---- a scripted peer --------------------------------------------------------------------------

type Answer = (u16, Value);

type Handler = Box<dyn FnMut(&str) -> Answer + Send>;

#[derive(Default)]
struct FakeState {
    handlers: Mutex<HashMap<String, Handler>>,
    /// (route, body) of every request.
    log: Mutex<Vec<(String, String)>>,
}

struct FakePeer {
    addr: String,
    state: Arc<FakeState>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for FakePeer {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn fake_handle(
    State(s): State<Arc<FakeState>>,
    method: Method,
    uri: Uri,
    body: Bytes,
) -> Response {
    let route = format!("{method} {}", uri.path());
    let body = String::from_utf8(body.to_vec()).unwrap();
    s.log.lock().unwrap().push((route.clone(), body.clone()));
    let answer = match s.handlers.lock().unwrap().get_mut(&route) {
        Some(h) => h(&body),
        None => (404, json!({"error": "not found"})),
    };
    (StatusCode::from_u16(answer.0).unwrap(), Json(answer.1)).into_response()
}

impl FakePeer {
    async fn start() -> Self {
        let state = Arc::new(FakeState::default());
        let app = Router::new()
            .fallback(fake_handle)
            .layer(axum::extract::DefaultBodyLimit::disable())
            .with_state(state.clone());
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let task = tokio::spawn(async move {
            let _ = axum::serve(listener, app).await;
        });
        FakePeer { addr, state, task }
    }

    fn on(&self, route: &str, h: impl FnMut(&str) -> Answer + Send + 'static) {
        self.state
            .handlers
            .lock()
            .unwrap()
            .insert(route.to_string(), Box::new(h));
    }

    fn seen(&self, route: &str) -> Vec<String> {
        self.state
            .log
            .lock()
            .unwrap()
            .iter()
            .filter(|(r, _)| r == route)
            .map(|(_, b)| b.clone())
            .collect()
    }
}

/// Answers every posted envelope with `result` (by id), the way a peer does.
fn answer_all(result: &'static str) -> impl FnMut(&str) -> Answer + Send + 'static {
    move |body: &str| {
        let v: Value = serde_json::from_str(body).unwrap();
        let results: Vec<Value> = v["envelopes"]
            .as_array()
            .unwrap()
            .iter()
            .map(|e| json!({"id": e["id"], "result": result}))
            .collect();
        (200, json!({ "results": results }))
    }
}

/// A port nothing listens on.
async fn closed_addr() -> String {
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let a = l.local_addr().unwrap().to_string();
    drop(l);
    a
}

const ID1: &str = "01KDVDNA3VG2MH8KWSQRCWJZ0S";

const ID2: &str = "01KDVDNA3VG2MH8KWSQRCWJZ0T";

const ID3: &str = "01KDVDNA3VG2MH8KWSQRCWJZ0V";

// ---- batching -------------------------------------------------------------------------------------

#[test]
fn batches_are_bounded_by_count_and_by_body_bytes() {
    assert!(batches(&[], 200, 100).is_empty());
    // By count.
    let sizes = vec![10; 450];
    let b = batches(&sizes, 200, usize::MAX);
    assert_eq!(b, vec![0..200, 200..400, 400..450]);
    // By bytes: {"envelopes":[a,b]} = 16 + a + 1 + b.
    assert_eq!(body_bytes(&[40, 40]), 97);
    assert_eq!(batches(&[40, 40, 40], 200, 97), vec![0..2, 2..3]);
    assert_eq!(batches(&[40, 40, 40], 200, 96), vec![0..1, 1..2, 2..3]);
    // A wire over the budget alone still travels, alone.
    assert_eq!(batches(&[10, 500, 10], 200, 100), vec![0..1, 1..2, 2..3]);
    // Sealed envelopes of the largest body (~700 KB each) never make a body over 4 MiB.
    let big = vec![700_000; 13];
    for r in batches(&big, MAX_BATCH, MAX_BATCH_BYTES) {
        assert!(body_bytes(&big[r]) <= server::MAX_BODY);
    }
}

#[tokio::test]
async fn a_backlog_of_large_envelopes_goes_in_bodies_under_the_peer_cap() {
    let clock = testutil::clock();
    let home = Host::new("home", clock.clone());
    let work = testutil::identity("work");
    let peer = FakePeer::start().await;
    home.pin(&work, true, Some(&peer.addr));
    peer.on("POST /v2/envelopes", answer_all("accepted"));
    let mut ids = testutil::ids();
    let big = "x".repeat(agentmbx_protocol::limits::MAX_BODY);
    let mut sent = Vec::new();
    for _ in 0..8 {
        let id = ids.next(T0);
        let req = crate::node::send::SendRequest {
            from: "alice".into(),
            to: vec!["bob@work".into()],
            subject: "big".into(),
            body: big.clone(),
            kind: None,
            thread: None,
            reply_to: None,
            needs_reply: false,
            refs: vec![],
            new_mailbox: false,
            force: false,
        };
        home.store
            .mailbox
            .with(|c| {
                let tx = c.transaction()?;
                crate::node::send::send(&tx, &home.ident, &req, id.clone(), T0).unwrap();
                tx.commit()?;
                Ok(())
            })
            .unwrap();
        sent.push(id);
    }
    let counts = home.delivery(true).pass().await.unwrap();
    assert_eq!(counts.delivered, 8);
    let bodies = peer.seen("POST /v2/envelopes");
    assert!(
        bodies.len() >= 2,
        "split by bytes: {} request(s)",
        bodies.len()
    );
    let mut n = 0;
    for b in &bodies {
        assert!(b.len() <= server::MAX_BODY, "{} bytes", b.len());
        n += serde_json::from_str::<Value>(b).unwrap()["envelopes"]
            .as_array()
            .unwrap()
            .len();
    }
    assert_eq!(n, 8);
    for id in &sent {
        assert_eq!(home.row(id, "work").state, "delivered");
    }
}

// ---- delivery end to end against a real peer ---------------------------------------------------

#[tokio::test]
async fn mail_is_sealed_once_delivered_over_the_lan_and_the_receipts_come_back() {
    let clock = testutil::clock();
    let mut home = Host::new("home", clock.clone());
    let mut work = Host::new("work", clock.clone());
    home.serve().await;
    work.serve().await;
    // Each pins the other with its LAN address; home does not know work's enc key yet.
    home.pin(&work.ident, false, work.addr.as_deref());
    work.pin(&home.ident, true, home.addr.as_deref());

    home.send(ID1, &["bob@work", "carol@work"]);
    let counts = home.delivery(true).pass().await.unwrap();
    assert_eq!((counts.delivered, counts.failed), (1, 0));
    let row = home.row(ID1, "work");
    assert_eq!(
        (row.state.as_str(), row.via.as_deref(), row.attempts),
        ("delivered", Some("lan"), 0)
    );
    // The enc key was learned from work's signed ad and pinned; the wire was persisted, and
    // once delivered only its hash stays (`wire.md` §3.5 "Settle").
    let pinned = home
        .store
        .mailbox
        .with(|c| peers::by_name(c, "work"))
        .unwrap()
        .unwrap();
    assert_eq!(pinned.enc_pub, Some(work.ident.enc_key.public().to_b64()));
    assert_eq!(row.wire, None, "a delivered row drops its bytes");
    assert_eq!(row.wire_hash.as_ref().map(String::len), Some(64));
    assert_eq!(
        work.store
            .scalar::<String>(&format!("SELECT body FROM messages WHERE id = '{ID1}'")),
        "body of hello"
    );
    // work owes home two receipts (bob and carol, delivered); bob reads: a third.
    work.store
        .mailbox
        .with(|c| crate::mailbox::messages::read(c, "bob", "work", ID1, T0).map(|_| ()))
        .unwrap();
    let counts = work.delivery(true).pass().await.unwrap();
    assert_eq!(counts.receipts_sent, 3);
    assert_eq!(
        work.store
            .scalar::<i64>("SELECT COUNT(*) FROM receipt_outbox"),
        0
    );
    let states: Vec<(String, String)> = home
        .store
        .fresh_conn()
        .prepare("SELECT recipient, state FROM remote_receipts ORDER BY recipient")
        .unwrap()
        .query_map([], |r| Ok((r.get(0)?, r.get(1)?)))
        .unwrap()
        .collect::<Result<_, _>>()
        .unwrap();
    assert_eq!(
        states,
        vec![
            ("bob@work".to_string(), "read".to_string()),
            ("carol@work".to_string(), "delivered".to_string())
        ]
    );
    // The sender's view.
    let page = home
        .store
        .mailbox
        .with(|c| receipt_store::sent_page(c, "alice", "home", None, 20))
        .unwrap();
    let got: Vec<(&str, &str, Option<&str>)> = page.messages[0]
        .recipients
        .iter()
        .map(|r| (r.recipient.as_str(), r.state.as_str(), r.via.as_deref()))
        .collect();
    assert_eq!(
        got,
        vec![
            ("bob@work", "read", Some("lan")),
            ("carol@work", "delivered", Some("lan"))
        ]
    );
    // Nothing left to do on either side.
    assert_eq!(
        home.delivery(true).pass().await.unwrap(),
        PassCounts::default()
    );
    assert_eq!(
        work.delivery(true).pass().await.unwrap(),
        PassCounts::default()
    );
}

// ---- verdicts, failures, selection ------------------------------------------------------------

#[tokio::test]
async fn a_rejection_or_a_missing_result_ends_the_row_with_an_alert() {
    let clock = testutil::clock();
    let home = Host::new("home", clock.clone());
    let work = testutil::identity("work");
    let peer = FakePeer::start().await;
    home.pin(&work, true, Some(&peer.addr));
    home.send(ID1, &["bob@work"]);
    home.send(ID2, &["bob@work"]);
    peer.on("POST /v2/envelopes", |body: &str| {
        let v: Value = serde_json::from_str(body).unwrap();
        let first = v["envelopes"][0]["id"].clone();
        // One result only, and it names the first envelope: the second has none.
        (
            200,
            json!({"results": [{"id": first, "result": "rejected:no recipient on this host (work)"},
                               {"id": "someone else", "result": "accepted"}]}),
        )
    });
    let counts = home.delivery(true).pass().await.unwrap();
    assert_eq!(counts.rejected, 2);
    let r1 = home.row(ID1, "work");
    assert_eq!(
        (r1.state.as_str(), r1.last_error.as_deref()),
        ("rejected", Some("no recipient on this host (work)"))
    );
    let r2 = home.row(ID2, "work");
    assert_eq!(
        (r2.state.as_str(), r2.last_error.as_deref()),
        ("rejected", Some("missing result"))
    );
    assert_eq!(
        home.alerts(),
        vec![
            (
                "Undelivered to work: hello".to_string(),
                format!("Message {ID1} could not be delivered to host work: no recipient on this host (work)")
            ),
            (
                "Undelivered to work: hello".to_string(),
                format!("Message {ID2} could not be delivered to host work: missing result")
            ),
        ]
    );
    // Rejected rows are never sent again, by either transport.
    let c = home.store.fresh_conn();
    assert!(outbox::due_for_lan(&c, i64::MAX, 10, true)
        .unwrap()
        .is_empty());
    assert!(outbox::due_for_relay(&c, i64::MAX, 10).unwrap().is_empty());
    // The sender sees why.
    let page = home
        .store
        .mailbox
        .with(|c| receipt_store::sent_page(c, "alice", "home", None, 20))
        .unwrap();
    let states: Vec<(&str, Option<&str>)> = page
        .messages
        .iter()
        .map(|m| {
            (
                m.recipients[0].state.as_str(),
                m.recipients[0].reason.as_deref(),
            )
        })
        .collect();
    assert_eq!(
        states,
        vec![
            ("undelivered", Some("missing result")),
            ("undelivered", Some("no recipient on this host (work)"))
        ]
    );
}

/// The run loop's pass sweeps even when nothing is due for any transport and nothing woke it
/// (it then passes again within [`IDLE_WAIT_MS`]).
#[tokio::test]
async fn the_loop_sweeps_when_nothing_is_due() {
    let clock = testutil::clock();
    let home = Host::new("home", clock.clone());
    home.pin(&testutil::identity("work"), true, None);
    home.send(ID1, &["bob@work"]);
    clock.set(T0 + outbox::GIVE_UP_MS + 1);
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let task = tokio::spawn(run(
        home.delivery(false),
        Arc::new(tokio::sync::Notify::new()),
        stop_rx,
    ));
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while home.row(ID1, "work").state != "undelivered" {
        assert!(std::time::Instant::now() < deadline, "the loop never swept");
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    assert_eq!(home.alerts().len(), 1);
    stop_tx.send(true).unwrap();
    task.await.unwrap();
}

/// The answer of a peer's per-peer rate limit (`wire.md` §4: 600 signed requests a minute, 429).
fn rate_limited() -> Answer {
    (
        429,
        json!({"error": "rate limit: over 600 requests a minute from home; retry later"}),
    )
}

/// A handler that answers 429 `refusals` times, then as `then` does.
fn refuse_then(
    refusals: usize,
    mut then: impl FnMut(&str) -> Answer + Send + 'static,
) -> impl FnMut(&str) -> Answer + Send + 'static {
    let mut seen = 0;
    move |body: &str| {
        seen += 1;
        if seen <= refusals {
            rate_limited()
        } else {
            then(body)
        }
    }
}

// ---- the loop -------------------------------------------------------------------------------------

#[tokio::test]
async fn the_loop_delivers_on_wake_and_stops_on_shutdown() {
    let clock = testutil::clock();
    let home = Host::new("home", clock.clone());
    let work = testutil::identity("work");
    let peer = FakePeer::start().await;
    home.pin(&work, true, Some(&peer.addr));
    peer.on("POST /v2/envelopes", answer_all("accepted"));
    let wake = Arc::new(tokio::sync::Notify::new());
    let (stop, stopped) = tokio::sync::watch::channel(false);
    let task = tokio::spawn(run(home.delivery(true), wake.clone(), stopped));
    // The loop is idle (nothing due: it sleeps up to a minute); a send wakes it.
    home.send(ID1, &["bob@work"]);
    wake.notify_one();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while home.row(ID1, "work").state != "delivered" {
        assert!(
            std::time::Instant::now() < deadline,
            "timed out waiting for the delivery"
        );
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    stop.send(true).unwrap();
    tokio::time::timeout(std::time::Duration::from_secs(10), task)
        .await
        .expect("the loop stops on shutdown")
        .unwrap();
}

/// Only a failure to connect, or the LAN race, says the address does not answer; anything
/// after a connection was made (a reset, a broken-off answer, the client's own timeout, a
/// status) counts toward the two-failure rule instead.
#[test]
fn only_connect_failures_and_the_race_mark_at_once() {
    let nc = |t: &str| LanError::NoConnection(t.to_string());
    let un = |t: &str| LanError::Unreachable(t.to_string());
    assert_eq!(
        down_reason(&nc("connection refused")),
        Some(DownReason::Refused)
    );
    assert_eq!(
        down_reason(&nc("timed out after 3 s")),
        Some(DownReason::Timeout)
    );
    assert_eq!(
        down_reason(&nc("no route to host")),
        Some(DownReason::Unreachable)
    );
    assert_eq!(
        down_reason(&race_lost(Duration::from_secs(2))),
        Some(DownReason::Timeout)
    );
    for after_connect in [
        un("connection reset"),
        un("the answer broke off: connection reset"),
        un("connection closed before message completed"),
        un("timed out after 15 s"),
        un("the answer was not HTTP"),
        LanError::Status {
            status: 503,
            error: "busy".into(),
        },
        LanError::BadAnswer("1 results for 2 envelopes".into()),
    ] {
        assert_eq!(down_reason(&after_connect), None, "{after_connect:?}");
    }
}

/// Open calls are counted per peer: two open calls to one peer keep it busy until both end.
#[test]
fn in_flight_calls_are_counted_per_peer() {
    let inflight = InFlight::default();
    let wake = Arc::new(tokio::sync::Notify::new());
    let first = inflight.enter("work", wake.clone());
    let second = inflight.enter("work", wake.clone());
    assert_eq!(
        (inflight.count("work"), inflight.hosts()),
        (2, vec!["work".to_string()])
    );
    drop(first);
    assert_eq!(inflight.count("work"), 1, "one call still open");
    assert_eq!(inflight.hosts(), vec!["work".to_string()]);
    drop(second);
    assert_eq!(inflight.count("work"), 0);
    assert!(inflight.hosts().is_empty());
}

/// The loop's pass never waits for a peer's call: a peer whose address accepts and never
/// answers (no relay: no race, the client's 15 s stand) is skipped while its call is open,
/// another peer's mail is delivered meanwhile, and the next due time leaves the busy peer out
/// (never sooner than the floor while a call is open).
#[tokio::test]
async fn a_hung_peer_never_holds_the_pass_or_another_peer() {
    let clock = testutil::clock();
    let home = Host::new("home", clock.clone());
    let mut work = Host::new("work", clock.clone());
    work.serve().await;
    let play = testutil::identity("play");
    // Accepts connections (the kernel's backlog) and never answers; kept open for the test.
    let hung = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let hung_addr = hung.local_addr().unwrap().to_string();
    home.pin(&work.ident, true, work.addr.as_deref());
    work.pin(&home.ident, true, None);
    home.pin(&play, true, Some(&hung_addr));
    home.send("01KDVDNA3VG2MH8KWSQRCWJZ0S", &["bob@work"]);
    home.send("01KDVDNA3VG2MH8KWSQRCWJZ0T", &["xy@play"]);
    let delivery = home.delivery(false);
    tokio::time::timeout(Duration::from_secs(2), delivery.pass_detached())
        .await
        .expect("the pass does not wait for the hung peer")
        .unwrap();
    // Wait (with a deadline) for the answering peer's delivery.
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while home.row("01KDVDNA3VG2MH8KWSQRCWJZ0S", "work").state != "delivered" {
        let row = home.row("01KDVDNA3VG2MH8KWSQRCWJZ0S", "work");
        assert!(
            std::time::Instant::now() < deadline,
            "work never got its mail: {row:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(
        delivery.inflight.count("play"),
        1,
        "the hung call is still open"
    );
    assert_eq!(
        home.row("01KDVDNA3VG2MH8KWSQRCWJZ0T", "play").state,
        "pending"
    );
    // The hung peer's row is due, but left out while its call is open.
    assert_eq!(delivery.next_due().await.unwrap(), None);
    // Another due row: due now, but never sooner than the floor while a call is open.
    home.send("01KDVDNA3VG2MH8KWSQRCWJZ0V", &["bob@work"]);
    assert_eq!(
        delivery.next_due().await.unwrap(),
        Some(clock.now_ms() + INFLIGHT_FLOOR_MS)
    );
    drop(hung);
}
