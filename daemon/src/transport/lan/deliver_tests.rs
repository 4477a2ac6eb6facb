//! Tests of LAN delivery: against the real LAN server of a peer (served on 127.0.0.1:0 with its
//! own `mailbox.db`), and against a scripted peer whose answers each test chooses. Time is a
//! manual clock; nothing sleeps to wait for an outcome.

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

#[tokio::test]
async fn the_lan_goes_first_the_relay_takes_over_after_two_failures_and_a_peer_back_returns_it() {
    let clock = testutil::clock();
    let home = Host::new("home", clock.clone());
    let work = testutil::identity("work");
    let dead = closed_addr().await;
    home.pin(&work, true, Some(&dead));
    home.send(ID1, &["bob@work"]);
    let lan = |c: &rusqlite::Connection, now| {
        outbox::due_for_lan(c, now, 10, true)
            .unwrap()
            .into_iter()
            .map(|r| r.msg_id)
            .collect::<Vec<_>>()
    };
    let relay = |c: &rusqlite::Connection, now| {
        outbox::due_for_relay(c, now, 10)
            .unwrap()
            .into_iter()
            .map(|r| r.msg_id)
            .collect::<Vec<_>>()
    };
    // A new row goes over the LAN first, not to the relay.
    {
        let c = home.store.fresh_conn();
        assert_eq!(lan(&c, T0), vec![ID1.to_string()]);
        assert!(relay(&c, T0).is_empty());
    }
    let d = home.delivery(true);
    // First LAN failure: backoff 5 s; not due before, still the LAN's.
    let counts = d.pass().await.unwrap();
    assert_eq!(counts.failed, 1);
    let r = home.row(ID1, "work");
    assert_eq!((r.attempts, r.lan_failures, r.next_at), (1, 1, T0 + 5_000));
    // The stored error `sent` shows is in our words: no URL, no `(os error N)`.
    assert_eq!(
        r.last_error.as_deref(),
        Some("peer unreachable: connection refused"),
        "{r:?}"
    );
    assert!(
        r.wire.is_some(),
        "sealed and persisted before the first attempt"
    );
    {
        let c = home.store.fresh_conn();
        assert!(lan(&c, T0 + 4_999).is_empty(), "next_at is respected");
        assert!(relay(&c, T0 + 4_999).is_empty());
    }
    assert_eq!(d.pass().await.unwrap(), PassCounts::default());
    clock.set(T0 + 5_000);
    d.pass().await.unwrap();
    let r = home.row(ID1, "work");
    assert_eq!((r.attempts, r.lan_failures, r.next_at), (2, 2, T0 + 15_000));
    // After two LAN failures the relay takes it (when due), the LAN no longer does.
    {
        let c = home.store.fresh_conn();
        assert!(relay(&c, T0 + 14_999).is_empty());
        assert_eq!(relay(&c, T0 + 15_000), vec![ID1.to_string()]);
        assert!(lan(&c, T0 + 15_000).is_empty());
    }
    clock.set(T0 + 15_000);
    assert_eq!(d.pass().await.unwrap(), PassCounts::default());
    // Without a relay the LAN keeps it.
    {
        let c = home.store.fresh_conn();
        assert_eq!(
            outbox::due_for_lan(&c, T0 + 15_000, 10, false)
                .unwrap()
                .len(),
            1
        );
    }
    // A verified hop from work: the row is due now and the LAN's again.
    clock.set(T0 + 16_000);
    home.store
        .mailbox
        .with(|c| outbox::peer_is_back(c, "work", T0 + 16_000).map(|_| ()))
        .unwrap();
    {
        let c = home.store.fresh_conn();
        assert_eq!(lan(&c, T0 + 16_000), vec![ID1.to_string()]);
        assert!(relay(&c, T0 + 16_000).is_empty());
    }
    // One LAN try per sign of life: failing again hands it straight back to the relay (a peer
    // that reaches us while we cannot reach it never keeps the row off the relay).
    d.pass().await.unwrap();
    let r = home.row(ID1, "work");
    assert_eq!((r.attempts, r.lan_failures), (3, 2));
    {
        let c = home.store.fresh_conn();
        assert_eq!(relay(&c, r.next_at), vec![ID1.to_string()]);
        assert!(lan(&c, r.next_at).is_empty());
    }
    // A relay-accepted row is never sent over the LAN, even after the peer is back; a re-push
    // follows the rule like any row (two LAN failures: the relay's).
    home.store
        .mailbox
        .with(|c| {
            c.execute(
                "UPDATE outbox SET state = 'relay-accepted', accepted_at = ?1",
                [T0],
            )?;
            outbox::peer_is_back(c, "work", T0 + 16_000)?;
            Ok(())
        })
        .unwrap();
    assert_eq!(d.pass().await.unwrap(), PassCounts::default());
    home.store
        .mailbox
        .with(|c| {
            c.execute("UPDATE outbox SET state = 'repush'", [])?;
            Ok(())
        })
        .unwrap();
    {
        let c = home.store.fresh_conn();
        assert!(lan(&c, T0 + 3_600_000).is_empty());
        assert_eq!(relay(&c, T0 + 3_600_000), vec![ID1.to_string()]);
    }
}

#[tokio::test]
async fn the_lan_gives_up_after_72_hours_but_never_on_a_row_a_relay_accepted() {
    let clock = testutil::clock();
    let home = Host::new("home", clock.clone());
    let work = testutil::identity("work");
    let dead = closed_addr().await;
    home.pin(&work, true, Some(&dead));
    home.send(ID1, &["bob@work"]);
    home.send(ID2, &["bob@work"]);
    // ID2 was accepted by a relay once and is to be pushed again (a new epoch).
    home.store
        .mailbox
        .with(|c| {
            c.execute(
                "UPDATE outbox SET state = 'repush', accepted_at = ?2 WHERE msg_id = ?1",
                rusqlite::params![ID2, T0],
            )?;
            Ok(())
        })
        .unwrap();
    let d = home.delivery(false);
    // At exactly 72 h the LAN still retries.
    clock.set(T0 + outbox::GIVE_UP_MS);
    d.pass().await.unwrap();
    assert_eq!(home.row(ID1, "work").state, "pending");
    assert!(home.alerts().is_empty());
    clock.set(T0 + outbox::GIVE_UP_MS + outbox::backoff_ms(1));
    d.pass().await.unwrap();
    let r = home.row(ID1, "work");
    assert_eq!(r.state, "undelivered");
    assert!(
        r.last_error
            .as_deref()
            .unwrap()
            .starts_with("gave up after 72 h (peer unreachable"),
        "{r:?}"
    );
    let alerts = home.alerts();
    assert_eq!(alerts.len(), 1);
    assert_eq!(alerts[0].0, "Undelivered to work: hello");
    assert!(
        alerts[0].1.starts_with(&format!(
            "Message {ID1} could not be delivered to host work: gave up after 72 h ("
        )),
        "{}",
        alerts[0].1
    );
    // The re-push is tried over the LAN too, and never dropped by it.
    let r2 = home.row(ID2, "work");
    assert_eq!((r2.state.as_str(), r2.attempts), ("repush", 2));
    // The fail rule itself never drops a row a relay accepted, however old.
    let out = home
        .store
        .mailbox
        .with(|c| outbox::fail_lan(c, ID2, "work", "x", T0 + 1_000 * outbox::GIVE_UP_MS))
        .unwrap();
    assert_eq!(out, outbox::Failure::Retry);
    assert_eq!(home.row(ID2, "work").state, "repush");
}

/// The 72 h sweep of the LAN pass ends the rows no transport can take (no LAN address, no
/// relay) and the ones the relay holds without ever having accepted them, each with its alert,
/// and never a row a relay accepted.
#[tokio::test]
async fn the_sweep_ends_rows_no_transport_takes_after_72_hours_but_never_relay_accepted_ones() {
    let clock = testutil::clock();
    let home = Host::new("home", clock.clone());
    let work = testutil::identity("work");
    // No LAN address for work, and (below) no relay: no transport can take its rows.
    home.pin(&work, true, None);
    let mut ids = testutil::ids();
    let (stuck, on_relay, accepted, repush) =
        (ids.next(T0), ids.next(T0), ids.next(T0), ids.next(T0));
    for id in [&stuck, &on_relay, &accepted, &repush] {
        home.send(id, &["bob@work"]);
    }
    home.store
        .mailbox
        .with(|c| {
            // Held by the relay, which keeps refusing it; waiting for its next backoff.
            c.execute(
                "UPDATE outbox SET lan_failures = 2, attempts = 9, next_at = ?2,
                   last_error = 'rejected:target not enrolled' WHERE msg_id = ?1",
                rusqlite::params![on_relay, T0 + 100 * outbox::GIVE_UP_MS],
            )?;
            c.execute(
                "UPDATE outbox SET state = 'relay-accepted', accepted_at = ?2, via = 'relay'
                 WHERE msg_id = ?1",
                rusqlite::params![accepted, T0],
            )?;
            // Accepted by a relay once, to be pushed again (a new epoch).
            c.execute(
                "UPDATE outbox SET state = 'repush', accepted_at = ?2 WHERE msg_id = ?1",
                rusqlite::params![repush, T0],
            )?;
            Ok(())
        })
        .unwrap();
    let select = |relay_configured| {
        crate::transport::select::choose(crate::transport::select::Facts {
            lan_failures: 0,
            has_addr: false,
            relay_configured,
        })
    };
    assert_eq!(select(false), None, "no transport takes the stuck row");
    let d = home.delivery(false);
    // Nothing ends at exactly 72 h.
    clock.set(T0 + outbox::GIVE_UP_MS);
    assert_eq!(d.pass().await.unwrap(), PassCounts::default());
    assert_eq!(home.row(&stuck, "work").state, "pending");
    assert!(home.alerts().is_empty());
    // Past it, the pass's sweep ends both rows no relay accepted, each with its alert.
    clock.set(T0 + outbox::GIVE_UP_MS + 1);
    let counts = d.pass().await.unwrap();
    assert_eq!(counts.gave_up, 2);
    let r = home.row(&stuck, "work");
    assert_eq!(
        (r.state.as_str(), r.last_error.as_deref()),
        (
            "undelivered",
            Some("gave up after 72 h (no transport could take it)")
        )
    );
    let r = home.row(&on_relay, "work");
    assert_eq!(
        (r.state.as_str(), r.last_error.as_deref()),
        (
            "undelivered",
            Some("gave up after 72 h (rejected:target not enrolled)")
        )
    );
    let settled: Option<i64> = home
        .store
        .fresh_conn()
        .query_row(
            "SELECT settled_at FROM outbox WHERE msg_id = ?1",
            [&stuck],
            |r| r.get(0),
        )
        .unwrap();
    assert_eq!(settled, Some(T0 + outbox::GIVE_UP_MS + 1));
    let alerts = home.alerts();
    assert_eq!(alerts.len(), 2);
    assert!(alerts.iter().all(|a| a.0 == "Undelivered to work: hello"));
    assert!(alerts.contains(&(
        "Undelivered to work: hello".to_string(),
        format!(
            "Message {stuck} could not be delivered to host work: gave up after 72 h (no transport could take it)"
        )
    )));
    // Rows a relay accepted are never ended by the rule, however old.
    clock.set(T0 + 1_000 * outbox::GIVE_UP_MS);
    assert_eq!(home.delivery(true).pass().await.unwrap().gave_up, 0);
    assert_eq!(home.row(&accepted, "work").state, "relay-accepted");
    assert_eq!(home.row(&repush, "work").state, "repush");
    assert_eq!(home.alerts().len(), 2);
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

#[tokio::test]
async fn an_http_error_counts_as_a_lan_failure_and_no_enc_key_keeps_the_row_unsealed() {
    let clock = testutil::clock();
    let home = Host::new("home", clock.clone());
    let work = testutil::identity("work");
    let peer = FakePeer::start().await;
    home.pin(&work, false, Some(&peer.addr));
    home.send(ID1, &["bob@work"]);
    // No enc key: the peer's /v1/enc-key answers 404.
    home.delivery(true).pass().await.unwrap();
    let r = home.row(ID1, "work");
    assert_eq!((r.lan_failures, r.wire.is_none()), (1, true));
    assert!(r.last_error.unwrap().contains("no enc key for work"));
    assert!(
        peer.seen("POST /v2/envelopes").is_empty(),
        "never plaintext"
    );
    // With the key known: a 500 is a failure too.
    home.store
        .mailbox
        .with(|c| peers::set_enc_key(c, "work", &work.enc_key.public().to_b64(), T0).map(|_| ()))
        .unwrap();
    peer.on("POST /v2/envelopes", |_| (500, json!({"error": "boom"})));
    clock.advance(outbox::backoff_ms(0));
    home.delivery(true).pass().await.unwrap();
    let r = home.row(ID1, "work");
    assert_eq!((r.state.as_str(), r.lan_failures), ("pending", 2));
    assert!(r.last_error.unwrap().contains("boom"));
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

#[tokio::test]
async fn a_peer_rate_limit_is_waited_out_in_the_pass_not_backed_off_as_a_lan_failure() {
    // The closed-loop benchmark's 5 s sends: past the peer's burst of 600 signed requests, a
    // POST answered 429 was a LAN failure (attempts + 1, lan_failures + 1, next_at + 5 s; with a
    // relay, two of them handed the row to the relay). The peer only asked to slow down (its
    // limit refills one request every 100 ms, and a refused request was never processed), so
    // the same batch goes again after a short pause, in the same pass.
    let clock = testutil::clock();
    let home = Host::new("home", clock.clone());
    let work = testutil::identity("work");
    let peer = FakePeer::start().await;
    home.pin(&work, true, Some(&peer.addr));
    peer.on("POST /v2/envelopes", refuse_then(1, answer_all("accepted")));
    home.send(ID1, &["bob@work"]);
    let counts = home.delivery(true).pass().await.unwrap();
    assert_eq!((counts.delivered, counts.failed), (1, 0), "{counts:?}");
    let r = home.row(ID1, "work");
    assert_eq!(
        (r.state.as_str(), r.attempts, r.lan_failures, r.last_error),
        ("delivered", 0, 0, None),
        "no retry backoff was scheduled"
    );
    let sent = peer.seen("POST /v2/envelopes");
    assert_eq!(sent.len(), 2, "the refused batch went once more");
    assert_eq!(sent[0], sent[1], "the same wire bytes");
}

#[tokio::test]
async fn a_peer_that_keeps_refusing_is_a_lan_failure_after_a_few_paced_tries() {
    let clock = testutil::clock();
    let home = Host::new("home", clock.clone());
    let work = testutil::identity("work");
    let peer = FakePeer::start().await;
    home.pin(&work, true, Some(&peer.addr));
    peer.on("POST /v2/envelopes", |_| rate_limited());
    home.send(ID1, &["bob@work"]);
    let counts = home.delivery(true).pass().await.unwrap();
    assert_eq!((counts.delivered, counts.failed), (0, 1), "{counts:?}");
    let r = home.row(ID1, "work");
    assert_eq!(
        (r.state.as_str(), r.attempts, r.lan_failures, r.next_at),
        ("pending", 1, 1, T0 + outbox::backoff_ms(0))
    );
    assert!(r.last_error.unwrap().contains("429"));
    assert_eq!(
        peer.seen("POST /v2/envelopes").len(),
        1 + RATE_LIMIT_RETRIES as usize
    );
}

// ---- receipts over the LAN ---------------------------------------------------------------------

impl Host {
    /// Mail bob@work → alice@home received here from `from`: one receipt owed to work.
    fn receive_from(&self, from: &Identity, id: &str) {
        let wire = testutil::sealed_wire(
            from,
            &self.ident.enc_key.public(),
            id,
            "bob@work",
            &["alice@home"],
            "s",
            T0,
        );
        let pk = from.host_key.public().to_b64();
        let me = self.ident.clone();
        self.store
            .mailbox
            .with(|c| {
                crate::node::receive::receive_sealed(c, &me, &wire, id, &pk, T0)
                    .map(|v| assert!(v.is_ok(), "{v:?}"))
            })
            .unwrap();
    }

    fn receipt_rows(&self) -> Vec<(u32, u32)> {
        self.store
            .fresh_conn()
            .prepare("SELECT attempts, lan_failures FROM receipt_outbox ORDER BY seq")
            .unwrap()
            .query_map([], |r| Ok((r.get(0)?, r.get(1)?)))
            .unwrap()
            .collect::<Result<_, _>>()
            .unwrap()
    }
}

#[tokio::test]
async fn receipts_go_over_the_lan_until_it_failed_twice_then_to_the_relay() {
    let clock = testutil::clock();
    let home = Host::new("home", clock.clone());
    let work = testutil::identity("work");
    let peer = FakePeer::start().await;
    home.pin(&work, true, Some(&peer.addr));
    home.receive_from(&work, ID1);
    // A short answer is a failure of the whole request.
    peer.on("POST /v1/receipts", |_| (200, json!({"results": []})));
    let d = home.delivery(true);
    d.pass().await.unwrap();
    assert_eq!(home.receipt_rows(), vec![(1, 1)]);
    let sent = peer.seen("POST /v1/receipts");
    let body: Value = serde_json::from_str(&sent[0]).unwrap();
    let wire = body["receipts"][0].to_string();
    let rec = agentmbx_protocol::records::parse_receipt_wire(
        wire.as_bytes(),
        &home.ident.host_key.public(),
    )
    .unwrap();
    assert_eq!(
        (rec.msg.as_str(), rec.recipient.as_str(), rec.state.as_str()),
        (ID1, "alice@home", "delivered")
    );
    // Not before its backoff; then the second failure hands it to the relay.
    assert_eq!(d.pass().await.unwrap(), PassCounts::default());
    clock.advance(outbox::backoff_ms(0));
    peer.on("POST /v1/receipts", |_| (503, json!({"error": "busy"})));
    d.pass().await.unwrap();
    assert_eq!(home.receipt_rows(), vec![(2, 2)]);
    clock.advance(outbox::backoff_ms(1));
    {
        let c = home.store.fresh_conn();
        let now = clock.now_ms();
        assert!(receipt_store::due_for_lan(&c, now, 10, true)
            .unwrap()
            .is_empty());
        assert_eq!(receipt_store::due_for_relay(&c, now, 10).unwrap().len(), 1);
    }
    // The peer is back: the LAN again; results (even a refusal, which is only logged) remove
    // the receipts, and the same signed bytes were sent each time.
    home.store
        .mailbox
        .with(|c| outbox::peer_is_back(c, "work", clock.now_ms()).map(|_| ()))
        .unwrap();
    peer.on("POST /v1/receipts", |_| {
        (
            200,
            json!({"results": ["rejected:not a message this host sent"]}),
        )
    });
    let counts = d.pass().await.unwrap();
    assert_eq!(counts.receipts_sent, 1);
    assert!(home.receipt_rows().is_empty());
    let sent = peer.seen("POST /v1/receipts");
    assert_eq!(sent.len(), 3);
    assert!(sent.iter().all(|b| b == &sent[0]));
}

#[tokio::test]
async fn a_peer_without_the_receipts_route_is_retried_hourly() {
    let clock = testutil::clock();
    let home = Host::new("home", clock.clone());
    let work = testutil::identity("work");
    let peer = FakePeer::start().await;
    home.pin(&work, true, Some(&peer.addr));
    home.receive_from(&work, ID1);
    home.delivery(false).pass().await.unwrap();
    let next_at: i64 = home.store.scalar("SELECT next_at FROM receipt_outbox");
    assert_eq!(next_at, T0 + receipt_store::UNSUPPORTED_RETRY_MS);
}

/// Case `clock-fix-does-not-release-mail` over the LAN: with the clock 10 min ahead a row
/// failed once, another was queued after it and a receipt failed once; once the clock is right
/// again all three are due at once (the pass takes them and the loop's wake-up is now), instead
/// of waiting out the skew.
#[tokio::test]
async fn mail_and_receipts_scheduled_under_a_clock_ahead_are_due_once_it_is_right() {
    const SKEW: i64 = 600_000;
    let clock = testutil::clock();
    clock.set(T0 + SKEW);
    let home = Host::new("home", clock.clone());
    let work = testutil::identity("work");
    let peer = FakePeer::start().await;
    home.pin(&work, true, Some(&peer.addr));
    home.receive_from(&work, ID3);
    peer.on("POST /v2/envelopes", |_| (500, json!({"error": "boom"})));
    peer.on("POST /v1/receipts", |_| (500, json!({"error": "boom"})));
    home.send(ID1, &["bob@work"]);
    let d = home.delivery(true);
    let counts = d.pass().await.unwrap();
    assert_eq!((counts.failed, counts.receipts_sent), (1, 0));
    assert_eq!(
        home.row(ID1, "work").next_at,
        T0 + SKEW + outbox::backoff_ms(0)
    );
    assert_eq!(home.receipt_rows(), vec![(1, 1)]);
    home.send(ID2, &["bob@work"]);
    assert_eq!(home.row(ID2, "work").next_at, T0 + SKEW);

    // The clock is right again.
    clock.set(T0);
    assert_eq!(d.next_due().await.unwrap(), Some(T0), "the loop wakes now");
    peer.on("POST /v2/envelopes", answer_all("accepted"));
    peer.on("POST /v1/receipts", |_| {
        (200, json!({"results": ["accepted"]}))
    });
    let counts = d.pass().await.unwrap();
    assert_eq!((counts.delivered, counts.receipts_sent), (2, 1));
    for id in [ID1, ID2] {
        assert_eq!(home.row(id, "work").state, "delivered", "{id}");
    }
    assert!(home.receipt_rows().is_empty());
}

/// A receipt a peer without the receipts route put off for an hour is not due early: that hour
/// is within its backoff rule, unlike a time a clock ahead wrote.
#[tokio::test]
async fn an_hour_put_off_for_a_peer_without_receipts_is_kept() {
    let clock = testutil::clock();
    let home = Host::new("home", clock.clone());
    let work = testutil::identity("work");
    let peer = FakePeer::start().await;
    home.pin(&work, true, Some(&peer.addr));
    home.receive_from(&work, ID1);
    let d = home.delivery(false);
    d.pass().await.unwrap();
    assert_eq!(peer.seen("POST /v1/receipts").len(), 1);
    clock.advance(receipt_store::UNSUPPORTED_RETRY_MS - 1);
    assert_eq!(
        d.next_due().await.unwrap(),
        Some(T0 + receipt_store::UNSUPPORTED_RETRY_MS)
    );
    d.pass().await.unwrap();
    assert_eq!(
        peer.seen("POST /v1/receipts").len(),
        1,
        "not before the hour"
    );
    clock.advance(1);
    d.pass().await.unwrap();
    assert_eq!(peer.seen("POST /v1/receipts").len(), 2);
}

#[tokio::test]
async fn receipts_a_peer_rate_limited_go_in_the_same_pass() {
    let clock = testutil::clock();
    let home = Host::new("home", clock.clone());
    let work = testutil::identity("work");
    let peer = FakePeer::start().await;
    home.pin(&work, true, Some(&peer.addr));
    home.receive_from(&work, ID1);
    peer.on(
        "POST /v1/receipts",
        refuse_then(2, |_| (200, json!({"results": ["accepted"]}))),
    );
    let counts = home.delivery(true).pass().await.unwrap();
    assert_eq!(counts.receipts_sent, 1);
    assert!(home.receipt_rows().is_empty());
    assert_eq!(peer.seen("POST /v1/receipts").len(), 3);
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
