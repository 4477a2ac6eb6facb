//! Tests of `pull.rs` against the fake relay of `test_support`: pages are stored once, bad items
//! quarantined, the checkpoint acked, and epochs, rewinds and duplicates handled.

use std::sync::{Arc, Mutex};

use serde_json::{json, Value};

use agentmbx_protocol::keys::EncKey;
use agentmbx_protocol::time::iso_ms;
use agentmbx_protocol::wire::PullItem;

use crate::mailbox::relay_state;
use crate::testutil::{self, T0};
use crate::transport::relay_client::test_support::*;

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
