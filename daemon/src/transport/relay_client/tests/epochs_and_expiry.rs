//! New epochs, rewinds, expiry notices, the deadline and quota refusals on the sender's side
//! (spec §5, §6, §7; `wire.md` §3.5 "Epoch change / rewind", "Settle"): against the real relay
//! served in this process (its SQLite store in a temp dir) over a manual clock shared with both
//! hosts, and against the scripted fake where a relay must misbehave (BAD_ACK, a queue head
//! below the checkpoint, forged notices).

use agentmbx_relay::testing::TestRelay;

use super::*;
use crate::mailbox::audit;
use crate::mailbox::outbox::Repush;
use crate::node::settle;

mod quarantine_retry;

const DAY: i64 = 86_400_000;

/// One host talking to the real relay: its store, identity and client.
struct Node {
    store: Store,
    ident: Arc<Identity>,
    client: RelayClient,
}

impl Node {
    fn new(name: &str, relay: &TestRelay, clock: &Arc<ManualClock>) -> Node {
        let store = testutil::store();
        let ident = Arc::new(testutil::identity(name));
        let shared: SharedClock = clock.clone();
        let client = RelayClient::new(
            relay.url(),
            relay.pubkey(),
            ident.clone(),
            store.mailbox.clone(),
            shared,
        )
        .unwrap();
        Node {
            store,
            ident,
            client,
        }
    }

    fn row(&self, id: &str, host: &str) -> outbox::Row {
        self.store
            .mailbox
            .with(|c| outbox::get(c, id, host))
            .unwrap()
            .expect("outbox row")
    }

    fn alerts(&self) -> Vec<(String, String)> {
        alerts_of(&self.store, "alice")
    }

    fn audits(&self, event: &str) -> Vec<audit::AuditEvent> {
        self.store
            .mailbox
            .with(|c| audit::recent(c, Some(event), 50))
            .unwrap()
    }
}

/// The (subject, body) of every alert in `agent`'s inbox, oldest first.
fn alerts_of(store: &Store, agent: &str) -> Vec<(String, String)> {
    let c = store.fresh_conn();
    let mut st = c
        .prepare(
            "SELECT m.subject, m.body FROM messages m JOIN deliveries d ON d.msg_id = m.id
             WHERE m.kind = 'alert' AND d.agent = ?1 ORDER BY m.rowid",
        )
        .unwrap();
    st.query_map([agent], |r| Ok((r.get(0)?, r.get(1)?)))
        .unwrap()
        .collect::<Result<_, _>>()
        .unwrap()
}

/// A relay, `home` (agent alice) and `work` (agent bob) that pin each other (enc keys too),
/// both enrolled with their ads and allowlists published.
async fn two_hosts() -> (Arc<ManualClock>, TestRelay, Node, Node) {
    let clock = testutil::clock();
    let relay = TestRelay::start(clock.clone()).await;
    let home = Node::new("home", &relay, &clock);
    let work = Node::new("work", &relay, &clock);
    home.store.add_peer(&work.ident, true);
    work.store.add_peer(&home.ident, true);
    home.store.register("home", &["alice"]);
    work.store.register("work", &["bob"]);
    super::super::pass(&work.client).await.unwrap();
    super::super::pass(&home.client).await.unwrap();
    (clock, relay, home, work)
}

/// alice@home → bob@work, pushed by one pass: returns the id and the relay-accepted row.
async fn send_accepted(home: &Node, clock: &ManualClock, subject: &str) -> (String, outbox::Row) {
    let id = testutil::ids().next(agentmbx_protocol::clock::Clock::now_ms(clock));
    let now = agentmbx_protocol::clock::Clock::now_ms(clock);
    home.store
        .send(&home.ident, "alice", &["bob@work"], subject, &id, now)
        .unwrap();
    super::super::pass(&home.client).await.unwrap();
    let row = home.row(&id, "work");
    assert_eq!(row.state, "relay-accepted", "{row:?}");
    (id, row)
}

#[tokio::test]
async fn a_new_epoch_re_pushes_accepted_mail_and_dedup_keeps_its_seq_accept_time_and_deadline() {
    let (clock, relay, home, work) = two_hosts().await;
    let (id, first) = send_accepted(&home, &clock, "hello").await;
    let e1 = relay.epoch().await;
    assert_eq!(first.epoch.as_deref(), Some(e1.as_str()));
    assert_eq!(
        first.deadline_at,
        Some(T0 + 14 * DAY + 24 * 3_600_000),
        "accepted_at + retention + 24 h"
    );
    // The receiver pulls and stores it (its receipt goes out on its next pass).
    super::super::pass(&work.client).await.unwrap();
    assert_eq!(work.store.scalar::<i64>("SELECT COUNT(*) FROM messages"), 1);
    // The relay is restored (its epoch rotates) an hour later.
    clock.advance(3_600_000);
    let e2 = relay.rotate_epoch().await;
    assert_ne!(e1, e2);
    // One pass: the session sees e2, the row becomes `repush`, is pushed again with the same
    // bytes and the relay's dedup answers `duplicate` with the original seq and time.
    super::super::pass(&home.client).await.unwrap();
    let again = home.row(&id, "work");
    assert_eq!(again.state, "relay-accepted", "{again:?}");
    assert_eq!(again.epoch.as_deref(), Some(e2.as_str()));
    assert_eq!(
        (again.seq, again.accepted_at, again.deadline_at),
        (first.seq, first.accepted_at, first.deadline_at)
    );
    assert_eq!(again.wire, first.wire, "the same wire bytes");
    let accept: Value = serde_json::from_str(
        &home
            .store
            .scalar::<String>(&format!("SELECT accept FROM outbox WHERE msg_id = '{id}'")),
    )
    .unwrap();
    assert_eq!(accept["epoch"], e2.as_str());
    assert_eq!(
        accept["at"],
        iso_ms(T0).as_str(),
        "the original accept time"
    );
    let changed = home.audits("relay.epoch_changed");
    assert_eq!(changed.len(), 1, "{changed:?}");
    assert_eq!(changed[0].detail["why"], "epoch");
    assert_eq!(changed[0].detail["repush"], 1);
    assert_eq!(changed[0].detail["to"], e2.as_str());
    // The next pass is steady: nothing more to re-push.
    super::super::pass(&home.client).await.unwrap();
    assert_eq!(home.audits("relay.epoch_changed").len(), 1);
    // The receiver pulls the new epoch from 0: the message is still stored once; its receipt
    // settles the sender's row.
    super::super::pass(&work.client).await.unwrap();
    assert_eq!(work.store.scalar::<i64>("SELECT COUNT(*) FROM messages"), 1);
    let url = work.client.url.clone();
    let pos = work
        .store
        .mailbox
        .with(|c| relay_state::position(c, &url))
        .unwrap()
        .unwrap();
    assert_eq!(pos.epoch, e2);
    super::super::pass(&home.client).await.unwrap();
    assert_eq!(home.row(&id, "work").state, "delivered");
    assert!(home.alerts().is_empty());
    // The deadline never ends a delivered row.
    let ident = home.ident.clone();
    let ended = settle::settle_pass(&home.store.mailbox, ident, T0 + 30 * DAY)
        .await
        .unwrap();
    assert_eq!(ended, 0);
}

#[tokio::test]
async fn an_item_the_relay_expires_comes_back_as_a_notice_that_expires_the_row_with_one_alert() {
    let (clock, relay, home, work) = two_hosts().await;
    let (id, first) = send_accepted(&home, &clock, "quarterly").await;
    // work never collects it; 14 days later the relay's sweep expires it and queues a notice.
    clock.advance(14 * DAY);
    let report = relay.sweep().await.unwrap();
    assert_eq!(
        (report.expired_envelopes, report.notices),
        (1, 1),
        "{report:?}"
    );
    super::super::pass(&home.client).await.unwrap();
    let row = home.row(&id, "work");
    assert_eq!(row.state, "expired", "{row:?}");
    assert_eq!(
        row.last_error.as_deref(),
        Some("expired by the relay after 14 day(s): work never collected it")
    );
    let alerts = home.alerts();
    assert_eq!(
        alerts,
        vec![(
            "Undelivered to work: quarterly".to_string(),
            format!(
                "Message {id} could not be delivered to host work: the relay held it for 14 day(s) (accepted {}) and work never collected it, so the relay expired it at {}.",
                iso_ms(first.accepted_at.unwrap()),
                iso_ms(T0 + 14 * DAY)
            )
        )]
    );
    assert_eq!(home.audits("relay.expired").len(), 1);
    // Nothing was quarantined, the checkpoint moved past the notice and it was acked.
    assert_eq!(
        home.store.scalar::<i64>("SELECT COUNT(*) FROM quarantine"),
        0
    );
    let url = home.client.url.clone();
    let pos = home
        .store
        .mailbox
        .with(|c| relay_state::position(c, &url))
        .unwrap()
        .unwrap();
    assert!(
        pos.received_through > 0 && pos.acked_through == pos.received_through,
        "{pos:?}"
    );
    // The deadline later finds nothing to do, and the receiver never gets the message.
    super::super::pass(&home.client).await.unwrap();
    let ended = settle::settle_pass(&home.store.mailbox, home.ident.clone(), T0 + 30 * DAY)
        .await
        .unwrap();
    assert_eq!(ended, 0);
    assert_eq!(home.alerts().len(), 1, "one alert");
    super::super::pass(&work.client).await.unwrap();
    assert_eq!(work.store.scalar::<i64>("SELECT COUNT(*) FROM messages"), 0);
    // A second sweep queues no second notice.
    let report = relay.sweep().await.unwrap();
    assert_eq!(report.notices, 0, "not twice: {report:?}");
}

#[tokio::test]
async fn a_row_with_no_receipt_by_its_deadline_is_unconfirmed_even_while_re_pushed() {
    let (clock, relay, home, _work) = two_hosts().await;
    let (id, first) = send_accepted(&home, &clock, "plan").await;
    let deadline = first.deadline_at.unwrap();
    // A new epoch just before the deadline: the row is re-pushed (duplicate), deadline kept.
    clock.set(deadline - 3_600_000);
    relay.rotate_epoch().await;
    home.client.open_session().await.unwrap();
    assert_eq!(home.row(&id, "work").state, "repush");
    let ended = settle::settle_pass(&home.store.mailbox, home.ident.clone(), deadline - 1)
        .await
        .unwrap();
    assert_eq!(ended, 0, "not before the deadline");
    let ended = settle::settle_pass(&home.store.mailbox, home.ident.clone(), deadline)
        .await
        .unwrap();
    assert_eq!(ended, 1);
    let row = home.row(&id, "work");
    assert_eq!(row.state, "unconfirmed");
    assert_eq!(
        home.alerts(),
        vec![(
            "Undelivered/unconfirmed to work: plan".to_string(),
            format!("Message {id} to host work: the relay accepted it, but there is no delivery confirmation (the recipient's host may run AgentMBX older than 0.5.3, which sends none).")
        )]
    );
    // An unconfirmed row is no longer pushed.
    clock.set(deadline + 1);
    let pushed = home
        .client
        .push_due(&super::session(&relay.epoch().await))
        .await
        .unwrap();
    assert_eq!((pushed.accepted, pushed.failed), (0, 0));
}

// ---- the fake relay: rewinds, BAD_ACK, another epoch in an answer ------------------------------

impl Setup {
    /// Marks `id` accepted by this relay in `epoch` at seq 42, accepted at T0 with deadline
    /// T0 + 15 d, wire bytes `w`.
    fn accepted_in(&self, id: &str, epoch: &str) {
        let url = self.client.url.clone();
        self.store
            .mailbox
            .with(|c| {
                outbox::set_wire(c, id, "work", b"w", "h")?;
                let a = outbox::Accepted {
                    relay: &url,
                    epoch,
                    seq: 42,
                    accept: "{}",
                    sig: "s",
                    accepted_at: T0,
                    deadline_at: T0 + 15 * DAY,
                };
                assert!(outbox::settle_accepted(c, id, "work", &a, T0)?);
                Ok(())
            })
            .unwrap();
    }

    fn epoch_audits(&self) -> Vec<Value> {
        self.audits("relay.epoch_changed")
            .into_iter()
            .map(|a| a.detail)
            .collect()
    }

    /// A repush row as a new epoch or a rewind leaves it: due now, `last_error` `relay <why>:
    /// re-push`, accept time and deadline kept.
    fn assert_repush(&self, id: &str, why: &str) {
        let r = self.row(id);
        assert_eq!(r.state, "repush", "{r:?}");
        assert_eq!(
            r.last_error.as_deref(),
            Some(format!("relay {why}: re-push").as_str())
        );
        assert!(r.next_at <= self.clock_now());
        assert_eq!(
            (r.accepted_at, r.deadline_at),
            (Some(T0), Some(T0 + 15 * DAY))
        );
        assert_eq!(r.wire.as_deref(), Some(&b"w"[..]));
    }
}

#[tokio::test]
async fn head_seq_below_the_checkpoint_re_pushes_accepted_rows_and_re_pulls() {
    let s = Setup::new(true).await;
    let id = s.send_to_peer(ID1);
    s.accepted_in(&id, "e1");
    let url = s.client.url.clone();
    s.store
        .mailbox
        .with(|c| relay_state::set_received_through(c, &url, "e1", 500, T0))
        .unwrap();
    let q = Arc::new(Mutex::new(Queue {
        epoch: "e1".into(),
        items: vec![],
        head_override: Some(100),
    }));
    serve_queue(&s.relay, q);
    s.client.pull_pass(&session("e1")).await.unwrap();
    s.assert_repush(&id, "rewind");
    assert_eq!(s.position().received_through, 0);
    assert_eq!(
        s.pull_afters(),
        vec![("500".into(), "e1".into()), ("0".into(), "e1".into())]
    );
    let audits = s.epoch_audits();
    assert_eq!(audits.len(), 1);
    assert_eq!(
        (
            &audits[0]["why"],
            &audits[0]["reason"],
            &audits[0]["repush"]
        ),
        (
            &json!("rewind"),
            &json!("head_seq below received_through"),
            &json!(1)
        )
    );
}

#[tokio::test]
async fn bad_ack_re_pushes_accepted_rows_in_one_step_with_the_position_reset() {
    let s = Setup::new(true).await;
    let id = s.send_to_peer(ID1);
    s.accepted_in(&id, "e1");
    let peer = s.peer_pub();
    let incoming = testutil::ids().next(T0 + 5);
    let q = Arc::new(Mutex::new(Queue {
        epoch: "e1".into(),
        items: vec![item(30, &incoming, &peer, &s.peer_wire(&incoming, "m"))],
        head_override: None,
    }));
    serve_queue(&s.relay, q);
    let mut first = true;
    s.relay.on("POST /v2/relay/ack", move |req| {
        if std::mem::take(&mut first) {
            return (
                400,
                json!({"error": "ack beyond head", "code": "BAD_ACK", "epoch": "e1", "head_seq": 5}),
            );
        }
        let through = req.json()["through"].as_i64().unwrap();
        (200, json!({"acked_through": through, "deleted": 1, "head_seq": 30}))
    });
    let pass = s.client.pull_pass(&session("e1")).await.unwrap();
    assert_eq!((pass.stored, pass.duplicates), (1, 1));
    s.assert_repush(&id, "rewind");
    let audits = s.epoch_audits();
    assert_eq!(audits.len(), 1);
    assert_eq!(audits[0]["reason"], "BAD_ACK");
    let pos = s.position();
    assert_eq!((pos.received_through, pos.acked_through), (30, 30));
}

#[tokio::test]
async fn a_409_or_a_page_of_another_epoch_re_pushes_rows_of_the_old_epoch_once() {
    let s = Setup::new(true).await;
    let mut g = testutil::ids();
    let (a, b) = (g.next(T0), g.next(T0));
    s.send_to_peer(&a);
    s.send_to_peer(&b);
    s.accepted_in(&a, "e1");
    s.accepted_in(&b, "e2");
    let url = s.client.url.clone();
    s.store
        .mailbox
        .with(|c| relay_state::set_received_through(c, &url, "e1", 70, T0))
        .unwrap();
    serve_queue(
        &s.relay,
        Arc::new(Mutex::new(Queue {
            epoch: "e2".into(),
            items: vec![],
            head_override: None,
        })),
    );
    // The session still believes e1: the pull answers 409 with e2.
    s.client.pull_pass(&session("e1")).await.unwrap();
    s.assert_repush(&a, "epoch");
    assert_eq!(s.row(&b).state, "relay-accepted", "accepted in e2 already");
    let pos = s.position();
    assert_eq!((pos.epoch.as_str(), pos.received_through), ("e2", 0));
    let audits = s.epoch_audits();
    assert_eq!(audits.len(), 1);
    assert_eq!(
        (&audits[0]["from"], &audits[0]["to"], &audits[0]["reason"]),
        (
            &json!("e1"),
            &json!("e2"),
            &json!("stale epoch (409) on pull")
        )
    );
    // Later passes in e2 change nothing more (the recorded epoch is e2 now).
    s.client.pull_pass(&session("e1")).await.unwrap();
    assert_eq!(s.epoch_audits().len(), 1);
    // A page of yet another epoch is one more change.
    s.relay
        .on("GET /v2/relay/items", |_| (200, page("e3", 0, &[], false)));
    s.client.pull_pass(&session("e2")).await.unwrap();
    assert_eq!(s.epoch_audits().len(), 2);
    assert_eq!(s.row(&b).state, "repush");
}

#[tokio::test]
async fn an_accept_of_another_epoch_re_pushes_the_rows_of_the_old_one_before_settling() {
    let s = Setup::new(true).await;
    let mut g = testutil::ids();
    let (old, new) = (g.next(T0), g.next(T0));
    s.send_to_peer(&old);
    s.accepted_in(&old, "e1");
    let url = s.client.url.clone();
    s.store
        .mailbox
        .with(|c| {
            relay_state::kv_set(c, &super::super::state::epoch_kv(&url), "e1")?;
            relay_state::set_received_through(c, &url, "e1", 9, T0)
        })
        .unwrap();
    s.send_to_peer(&new);
    // The relay was restored between the session's info and this push.
    s.accept_all("e2", "accepted");
    let pass = s.client.push_due(&session("e1")).await.unwrap();
    assert_eq!(pass.accepted, 1);
    assert_eq!(
        (s.row(&new).state.as_str(), s.row(&new).epoch.as_deref()),
        ("relay-accepted", Some("e2"))
    );
    s.assert_repush(&old, "epoch");
    let pos = s.position();
    assert_eq!((pos.epoch.as_str(), pos.received_through), ("e2", 0));
    assert_eq!(
        s.epoch_audits()[0]["reason"],
        "another epoch in a push accept"
    );
    // The re-push goes out and settles again in e2, keeping its first accept time.
    s.clock.advance(1);
    s.client.push_due(&session("e1")).await.unwrap();
    let r = s.row(&old);
    assert_eq!(
        (r.state.as_str(), r.epoch.as_deref(), r.accepted_at),
        ("relay-accepted", Some("e2"), Some(T0))
    );
    assert_eq!(s.epoch_audits().len(), 1);
}

#[tokio::test]
async fn a_receipt_accept_of_another_epoch_is_a_new_epoch_too() {
    let s = Setup::new(true).await;
    let mut g = testutil::ids();
    let sent = g.next(T0);
    s.send_to_peer(&sent);
    s.accepted_in(&sent, "e0");
    let url = s.client.url.clone();
    s.store
        .mailbox
        .with(|c| relay_state::kv_set(c, &super::super::state::epoch_kv(&url), "e0"))
        .unwrap();
    s.receive_and_read(&g.next(T0));
    // The relay answers the receipts with accepts of epoch e1.
    s.relay.on(
        "POST /v2/relay/items",
        receipt_answer(s.relay.key.clone(), s.me_pub(), "accepted"),
    );
    let pass = s.client.push_receipts(&session("e0")).await.unwrap();
    assert_eq!(pass.accepted, 2);
    s.assert_repush(&sent, "epoch");
    assert_eq!(s.position().epoch, "e1");
    // The same epoch again changes nothing more.
    s.receive_and_read(&g.next(T0));
    s.client.push_receipts(&session("e0")).await.unwrap();
    assert_eq!(s.epoch_audits().len(), 1);
}

// ---- quota and rate refusals -------------------------------------------------------------------

#[tokio::test]
async fn quota_and_rate_refusals_keep_the_row_and_back_it_off_a_re_push_too() {
    for status in [
        "rejected:quota:queue depth exceeded for work",
        "rejected:quota:queue bytes exceeded for work",
        "rejected:quota:sender share exceeded for work",
        "rejected:quota:owner queue depth exceeded for work",
        "rejected:rate",
    ] {
        let s = Setup::new(true).await;
        let mut g = testutil::ids();
        let (fresh, again) = (g.next(T0), g.next(T0));
        s.send_to_peer(&fresh);
        s.send_to_peer(&again);
        s.accepted_in(&again, "e1");
        let url = s.client.url.clone();
        s.store
            .mailbox
            .with(|c| outbox::repush_for_epoch(c, &url, "e2", Repush::Epoch, T0))
            .unwrap();
        s.relay.on("POST /v2/relay/items", push_reject(status));
        let pass = s.client.push_due(&session("e2")).await.unwrap();
        assert_eq!((pass.accepted, pass.failed), (0, 2), "{status}");
        // A re-push starts at attempts 2 (`wire.md` §3.5 "Epoch change / rewind").
        for (id, state, before) in [(&fresh, "pending", 0), (&again, "repush", 2)] {
            let r = s.row(id);
            assert_eq!(
                (
                    r.state.as_str(),
                    r.attempts,
                    r.next_at,
                    r.last_error.as_deref()
                ),
                (
                    state,
                    before + 1,
                    T0 + outbox::backoff_ms(before),
                    Some(status)
                ),
                "{status}"
            );
        }
        // Not pushed again before the backoff; the second refusal doubles it.
        s.client.push_due(&session("e2")).await.unwrap();
        assert_eq!(s.relay.seen("POST /v2/relay/items").len(), 1, "{status}");
        s.clock.advance(outbox::backoff_ms(2));
        s.client.push_due(&session("e2")).await.unwrap();
        let r = s.row(&again);
        assert_eq!(
            (r.state.as_str(), r.attempts, r.next_at),
            ("repush", 4, s.clock_now() + outbox::backoff_ms(3)),
            "{status}"
        );
        // A re-push refused long after 72 h is still kept: only its deadline ends it.
        s.clock.set(T0 + 10 * DAY);
        s.client.push_due(&session("e2")).await.unwrap();
        assert_eq!(s.row(&again).state, "repush", "{status}");
        assert_eq!(s.row(&fresh).state, "undelivered", "{status}");
        assert_eq!(s.alerts().len(), 1, "{status}: only the 72 h alert");
    }
}

// ---- expiry notices through the pull -----------------------------------------------------------

/// A notice item for `id` aimed at `target`, the notice signed by `signer` and the item pushed
/// by `pusher` (the relay key in a genuine one).
fn notice_item(seq: i64, id: &str, target: &str, signer: &HostKey, pusher: &str) -> PullItem {
    let notice = json!({"v": 1, "type": "relay-expired", "item_id": id, "target_pubkey": target,
                        "accepted_at": iso_ms(T0), "expired_at": iso_ms(T0 + 14 * DAY)});
    let sig = signer.sign(
        agentmbx_protocol::canonical::to_string(&notice)
            .unwrap()
            .as_bytes(),
    );
    let wire =
        agentmbx_protocol::canonical::to_string(&json!({"notice": notice, "sig": sig})).unwrap();
    PullItem {
        seq,
        kind: "expired".into(),
        item_id: format!("expired:{id}:{target}"),
        sender_pubkey: pusher.into(),
        wire_b64: b64::encode(wire.as_bytes()),
    }
}

impl Setup {
    fn quarantine(&self) -> Vec<(i64, String, String)> {
        let c = self.store.fresh_conn();
        let mut st = c
            .prepare("SELECT seq, kind, reason FROM quarantine ORDER BY seq")
            .unwrap();
        st.query_map([], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)))
            .unwrap()
            .collect::<Result<_, _>>()
            .unwrap()
    }
}

#[tokio::test]
async fn a_pulled_notice_expires_its_row_and_forged_ones_go_to_quarantine() {
    let s = Setup::new(true).await;
    let mut g = testutil::ids();
    let (a, b) = (g.next(T0), g.next(T0));
    s.send_to_peer(&a);
    s.send_to_peer(&b);
    s.accepted_in(&a, "e1");
    s.accepted_in(&b, "e1");
    let relay_pub = s.relay.key.public().to_b64();
    let target = s.peer_pub();
    let forger = HostKey::generate();
    let q = Arc::new(Mutex::new(Queue {
        epoch: "e1".into(),
        items: vec![
            // Signed by another key, though pushed as the relay.
            notice_item(10, &b, &target, &forger, &relay_pub),
            // Well signed by the relay key but pushed by another key.
            notice_item(11, &b, &target, &s.relay.key, &forger.public().to_b64()),
            // For a message this host never sent.
            notice_item(12, ID2, &target, &s.relay.key, &relay_pub),
            // The genuine one, then a repeat of it.
            notice_item(13, &a, &target, &s.relay.key, &relay_pub),
            notice_item(14, &a, &target, &s.relay.key, &relay_pub),
        ],
        head_override: None,
    }));
    serve_queue(&s.relay, q);
    let pass = s.client.pull_pass(&session("e1")).await.unwrap();
    assert_eq!((pass.notices, pass.quarantined), (2, 3));
    assert_eq!(
        s.quarantine(),
        vec![
            (10, "expired".into(), settle::BAD_NOTICE_SIG.into()),
            (11, "expired".into(), settle::NOT_FROM_RELAY.into()),
            (12, "expired".into(), settle::NO_ROW.into()),
        ]
    );
    assert_eq!(s.row(&a).state, "expired");
    assert_eq!(
        s.row(&b).state,
        "relay-accepted",
        "a forged notice changes nothing"
    );
    assert_eq!(
        s.alerts(),
        vec![(
            "Undelivered to work: hello".to_string(),
            format!(
                "Message {a} could not be delivered to host work: the relay held it for 14 day(s) (accepted {}) and work never collected it, so the relay expired it at {}.",
                iso_ms(T0),
                iso_ms(T0 + 14 * DAY)
            )
        )]
    );
    // Every item counts as processed: the checkpoint is past them all, and acked.
    let pos = s.position();
    assert_eq!((pos.received_through, pos.acked_through), (14, 14));
}

#[tokio::test]
async fn a_notice_from_a_relay_that_does_not_hold_the_row_is_quarantined_and_changes_nothing() {
    let s = Setup::new(true).await;
    let mut g = testutil::ids();
    let (here, elsewhere, never) = (g.next(T0), g.next(T0), g.next(T0));
    for id in [&here, &elsewhere, &never] {
        s.send_to_peer(id);
    }
    s.accepted_in(&here, "e1");
    s.accepted_in(&elsewhere, "e1");
    // `elsewhere` was last accepted by another relay (this host moved to this one since);
    // `never` no relay accepted yet.
    s.store
        .mailbox
        .with(|c| {
            c.execute(
                "UPDATE outbox SET relay = 'http://127.0.0.1:1' WHERE msg_id = ?1",
                [&elsewhere],
            )?;
            Ok(())
        })
        .unwrap();
    let relay_pub = s.relay.key.public().to_b64();
    let target = s.peer_pub();
    let q = Arc::new(Mutex::new(Queue {
        epoch: "e1".into(),
        items: vec![
            notice_item(20, &elsewhere, &target, &s.relay.key, &relay_pub),
            notice_item(21, &never, &target, &s.relay.key, &relay_pub),
            notice_item(22, &here, &target, &s.relay.key, &relay_pub),
        ],
        head_override: None,
    }));
    serve_queue(&s.relay, q);
    let pass = s.client.pull_pass(&session("e1")).await.unwrap();
    assert_eq!((pass.notices, pass.quarantined), (1, 2));
    assert_eq!(
        s.quarantine(),
        vec![
            (20, "expired".into(), settle::NOT_HELD_BY_RELAY.into()),
            (21, "expired".into(), settle::NOT_HELD_BY_RELAY.into()),
        ]
    );
    let states: Vec<String> = [&here, &elsewhere, &never]
        .iter()
        .map(|id| s.row(id).state)
        .collect();
    assert_eq!(states, ["expired", "relay-accepted", "pending"]);
    assert_eq!(s.alerts().len(), 1, "only the row this relay held");
    let pos = s.position();
    assert_eq!((pos.received_through, pos.acked_through), (22, 22));
}

/// `work` after rotating its host key and enc key: the new identity (retired keys and the
/// signed record in its history) and the record as a JSON value.
fn rotated(old: &Identity, at_ms: i64) -> (Identity, Value) {
    let mut new = testutil::identity(old.host.as_str());
    let record = agentmbx_protocol::rotation::SignedRotation::sign(
        old.host.as_str(),
        &old.host_key,
        &new.host_key,
        &new.enc_key.public(),
        at_ms,
    );
    let value = serde_json::to_value(&record).unwrap();
    new.history.retired_host.push(old.host_key.public());
    new.history.retired_enc.push(old.enc_key.clone());
    new.history.rotations.push(record);
    (new, value)
}

#[tokio::test]
async fn a_re_push_aimed_at_a_key_the_peer_rotated_away_from_is_resealed_for_the_new_one() {
    let (clock, relay, home, work) = two_hosts().await;
    let (id, first) = send_accepted(&home, &clock, "rotated").await;
    let old_pub = work.ident.host_key.public().to_b64();
    assert_eq!(first.target_pubkey, old_pub);
    // The relay loses the item and its dedup row (a restore from a backup taken before it).
    let db = rusqlite::Connection::open(relay.store_db()).unwrap();
    db.busy_timeout(std::time::Duration::from_secs(5)).unwrap();
    for table in ["items", "dedup"] {
        let n = db
            .execute(&format!("DELETE FROM {table} WHERE item_id = ?1"), [&id])
            .unwrap();
        assert_eq!(n, 1, "{table}");
    }
    drop(db);
    // work rotates its keys; home learns it over the LAN while the row is relay-accepted (it
    // keeps its target: the relay moves its queue), and the relay learns it from work.
    clock.advance(60_000);
    let now = agentmbx_protocol::clock::Clock::now_ms(&*clock);
    let (new_work, record) = rotated(&work.ident, now);
    let new_pub = new_work.host_key.public().to_b64();
    home.store
        .mailbox
        .with(|c| {
            let tx = c.transaction()?;
            let out = crate::transport::lan::handlers::rotate::accept_record(&tx, &record, now)?;
            assert_eq!(out.retargeted, 0, "a relay-accepted row keeps its target");
            tx.commit()?;
            Ok(())
        })
        .unwrap();
    assert_eq!(home.row(&id, "work").target_pubkey, old_pub);
    let new_work = Arc::new(new_work);
    let shared: SharedClock = clock.clone();
    let work_client = RelayClient::new(
        relay.url(),
        relay.pubkey(),
        new_work.clone(),
        work.store.mailbox.clone(),
        shared,
    )
    .unwrap();
    super::super::pass(&work_client).await.unwrap();
    // The restore rotates the epoch: home re-pushes. The old key is revoked at the relay, so
    // the same bytes for it could only be refused `target not enrolled`: the row follows the
    // rotation, is resealed for the new key and accepted, keeping its accept time and deadline.
    clock.advance(60_000);
    relay.rotate_epoch().await;
    super::super::pass(&home.client).await.unwrap();
    let again = home.row(&id, "work");
    assert_eq!(
        (again.state.as_str(), again.target_pubkey.as_str()),
        ("relay-accepted", new_pub.as_str()),
        "{again:?}"
    );
    assert_eq!(
        (again.accepted_at, again.deadline_at),
        (first.accepted_at, first.deadline_at)
    );
    assert_ne!(again.wire_hash, first.wire_hash, "resealed");
    assert_ne!(again.seq, None);
    // work (its new key) pulls it once; its receipt settles home's row, which drops its bytes.
    super::super::pass(&work_client).await.unwrap();
    assert_eq!(
        work.store
            .scalar::<i64>(&format!("SELECT COUNT(*) FROM messages WHERE id = '{id}'")),
        1
    );
    super::super::pass(&work_client).await.unwrap();
    super::super::pass(&home.client).await.unwrap();
    let done = home.row(&id, "work");
    assert_eq!(
        (done.state.as_str(), done.wire.as_deref()),
        ("delivered", None)
    );
    assert_eq!(done.wire_hash, again.wire_hash);
    assert!(home.alerts().is_empty());
}
