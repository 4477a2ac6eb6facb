//! End-to-end mail through a real relay, and the crash windows of spec §5, each with real child
//! processes: `agentmbx relay serve` and two `agentmbx daemon`s (`hosta` sends, `hostb`
//! receives), SIGKILLed exactly at a named failpoint (`MBX_FAILPOINTS`, design README
//! "Decisions") and restarted on the same store (the relay on the same port, so the daemons'
//! pinned configuration stays valid). State is checked in the stores themselves (`relay.db`,
//! `mailbox.db`, opened read-only) and through the local API and CLI.
//!
//! Crash windows (spec §5 "Crash windows"):
//! - relay commits but the response is lost → the sender retries and gets `duplicate` with the
//!   same seq ([`relay_killed_after_commit_answers_the_retry_as_a_duplicate_with_the_same_seq`]);
//! - the sender's process dies with the answer unread
//!   ([`sender_killed_with_the_push_answer_unread_gets_a_duplicate_after_restart`]);
//! - relay crashes before commit → accepted once
//!   ([`relay_killed_before_commit_accepts_the_retry_once`]);
//! - receiver commits but not the checkpoint ([`receiver_killed_mid_page_stores_each_message_once`]);
//! - receiver checkpoints but the ack is lost ([`ack_never_sent_is_covered_by_the_next_ack`],
//!   [`ack_answer_lost_is_covered_by_the_next_ack`], and the relay side of it:
//!   [`relay_killed_before_committing_an_ack_gets_it_again`],
//!   [`relay_killed_after_committing_an_ack_gets_it_again`]).
//!
//! The two relay push crashes wait out the sender's first outbox backoff (5 s): a failed
//! attempt is retried no sooner, and the tests do not shift the sender's clock mid-run.

use crate::helper::mesh::{contains, unique_tag, Host, Mesh, Relay};
use crate::helper::wait_for;
use base64::Engine;

/// Waits until `host`'s agent `agent` has message `id` in its inbox.
fn wait_inbox(host: &Host, agent: &str, id: &str) {
    wait_for(&format!("{id} in {agent}@{}'s inbox", host.name), || {
        host.inbox_ids(agent).iter().any(|i| i == id).then_some(())
    });
}

/// Sends one message alice@hosta → bob@hostb through A's local API; returns its id.
fn send_to_bob(mesh: &Mesh, subject: &str, body: &str) -> String {
    let sent = mesh.a.send("alice", "bob@hostb", subject, body);
    assert_eq!(
        sent["queued_for_hosts"],
        serde_json::json!(["hostb"]),
        "{sent}"
    );
    sent["id"].as_str().expect("id").to_string()
}

/// The `relay accepted` log line of message `id` carries `status=<status>`. The line follows
/// the row's commit, so it is waited for.
fn assert_accept_status(host: &Host, id: &str, status: &str) {
    let line = wait_for(&format!("the `relay accepted` log line of {id}"), || {
        host.log()
            .lines()
            .find(|l| l.contains("relay accepted") && l.contains(&format!("id={id}")))
            .map(str::to_string)
    });
    assert!(
        line.contains(&format!("status={status}")),
        "expected status={status}: {line}"
    );
}

/// After a message reached B: exactly one stored copy and one delivery, B's checkpoint and the
/// relay's acked_through at `seq`, nothing left queued, nothing quarantined.
fn assert_delivered_once(mesh: &Mesh, id: &str, seq: i64) {
    mesh.wait_queue_drained(&mesh.b);
    let url = mesh.relay.url();
    let pos = wait_for("B's acked_through to reach the item's seq", || {
        mesh.b.position(&url).filter(|p| p.acked_through >= seq)
    });
    assert_eq!(mesh.b.messages_with_id(id), 1, "stored copies of {id}");
    assert_eq!(mesh.b.deliveries_of(id), 1, "deliveries of {id}");
    assert_eq!(mesh.b.message_count(), 1, "B stores only this message");
    assert_eq!(mesh.b.quarantined(), 0);
    assert_eq!((pos.received_through, pos.acked_through), (seq, seq));
    assert_eq!(mesh.relay.acked_through(&mesh.b.pubkey), Some(seq));
    assert_eq!(mesh.relay.dedup_rows(id).len(), 1, "dedup rows of {id}");
}

#[test]
fn mail_crosses_the_relay_sealed_and_the_queue_drains_after_ack() {
    let mut mesh = Mesh::start(None);
    // The subject is envelope metadata, in the clear on the wire by design (`wire.md` §2.4:
    // only the body is sealed, as in 0.5.x); the body must never reach the relay in plaintext.
    let subject = format!("quarterly canary subject {}", unique_tag());
    let tag = unique_tag();
    let body: String = (0..24)
        .map(|i| format!("line {i:02} of the plaintext canary body {tag} must stay sealed\n"))
        .collect();
    assert!(
        body.len() > 1000 && body.lines().count() == 24,
        "non-trivial body"
    );

    // B is away while A pushes, so the row is still relay-accepted with its bytes when it is
    // read (a delivered row drops them, keeping their hash).
    mesh.b.stop();
    let id = send_to_bob(&mesh, &subject, &body);
    let row = mesh.a.wait_relay_accepted(&id);
    let seq = row.seq.expect("an accepted row records its seq");
    let wire = row
        .wire
        .clone()
        .expect("wire bytes persisted before the push");
    assert!(
        !contains(&wire, tag.as_bytes()),
        "the wire bytes are sealed"
    );
    mesh.b.start(None);

    wait_inbox(&mesh.b, "bob", &id);
    let inbox = mesh.b.inbox("bob");
    let entry = &inbox["messages"][0];
    assert_eq!(entry["id"], id.as_str(), "{inbox}");
    assert_eq!(entry["subject"], subject.as_str(), "{inbox}");
    assert_eq!(entry["from"], "alice@hosta", "{inbox}");
    assert_eq!(entry["state"], "new", "{inbox}");

    let msg = mesh.b.read(&id, "bob");
    assert_eq!(msg["subject"], subject.as_str(), "{msg}");
    assert_eq!(msg["body"], body.as_str(), "{msg}");
    assert_eq!(msg["from"], "alice@hosta", "{msg}");
    assert_eq!(msg["to"], serde_json::json!(["bob@hostb"]), "{msg}");
    assert_eq!(msg["origin"], "hosta", "{msg}");

    let ack = mesh.b.ack("bob", &[&id]);
    assert_eq!(ack["acked"], 1, "{ack}");
    assert_delivered_once(&mesh, &id, seq);

    // The relay committed exactly the bytes A persisted, under the seq A recorded.
    let dedup = mesh.relay.dedup_rows(&id);
    assert_eq!(
        dedup,
        vec![(seq, row.wire_hash.clone().expect("wire_hash"))]
    );
    // B's delivery receipts travel back through the relay as `receipt` items (the hosts have
    // no LAN address for each other) and settle A's relay-accepted row (spec §9).
    let after = wait_for("A's relay-accepted row settled by B's receipt", || {
        mesh.a.outbox(&id).filter(|r| r.state == "delivered")
    });
    assert_eq!(after.seq, Some(seq), "the accept's seq is kept");

    // No plaintext body anywhere in the relay's store files (nor in its log): not whole, not
    // a line of it, not its tag, not base64-encoded at any alignment.
    let b64 = base64::engine::general_purpose::STANDARD;
    let mut needles: Vec<(String, Vec<u8>)> = vec![
        ("body".into(), body.clone().into_bytes()),
        ("body tag".into(), tag.clone().into_bytes()),
        (
            "a body line".into(),
            body.lines().nth(5).unwrap_or_default().as_bytes().to_vec(),
        ),
    ];
    for shift in 0..3 {
        let encoded = b64.encode(&body.as_bytes()[shift..]);
        needles.push((
            format!("base64 body +{shift}"),
            encoded.as_bytes()[8..200].to_vec(),
        ));
    }
    let files = mesh.relay.store_files();
    assert!(
        files.iter().any(|(n, _)| n == "relay.db"),
        "relay.db exists"
    );
    assert!(files.iter().map(|(_, b)| b.len()).sum::<usize>() > 4096);
    for (name, bytes) in &files {
        for (what, needle) in &needles {
            assert!(!contains(bytes, needle), "{what} in plaintext in {name}");
        }
    }
    let relay_log = mesh.relay.proc().stderr();
    assert!(
        !relay_log.contains(&tag),
        "plaintext in the relay log:\n{relay_log}"
    );
}

#[test]
fn relay_killed_after_commit_answers_the_retry_as_a_duplicate_with_the_same_seq() {
    let mut mesh = Mesh::start(Some("push:after-commit"));
    mesh.b.stop(); // B comes back once A settled, so the relay queue can be inspected as is.
    let id = send_to_bob(&mesh, "after commit", "committed, answer lost");

    mesh.relay.proc().wait_for_failpoint("push:after-commit");
    mesh.relay.kill();
    let items = mesh.relay.items_for(&mesh.b.pubkey);
    assert_eq!(items.len(), 1, "committed before the crash: {items:?}");
    let (seq, ref item_id) = items[0];
    assert_eq!(item_id, &id);
    let row = mesh.a.outbox(&id).expect("A's row");
    assert_eq!((row.state.as_str(), row.seq), ("pending", None), "{row:?}");

    mesh.relay.launch(None);
    let row = mesh.a.wait_relay_accepted(&id);
    assert_eq!(row.seq, Some(seq), "the retry gets the original seq");
    assert_accept_status(&mesh.a, &id, "duplicate");
    assert_eq!(
        mesh.relay.items_for(&mesh.b.pubkey),
        vec![(seq, id.clone())]
    );
    assert_eq!(
        mesh.relay.dedup_rows(&id),
        vec![(seq, row.wire_hash.clone().expect("wire_hash"))]
    );

    mesh.b.start(None);
    wait_inbox(&mesh.b, "bob", &id);
    assert_delivered_once(&mesh, &id, seq);
}

#[test]
fn sender_killed_with_the_push_answer_unread_gets_a_duplicate_after_restart() {
    let mut mesh = Mesh::start(None);
    mesh.b.stop();
    mesh.a.restart(Some("push:after-response"));
    let id = send_to_bob(
        &mesh,
        "lost answer",
        "the relay answered, A never committed it",
    );

    mesh.a.daemon().wait_for_failpoint("push:after-response");
    mesh.a.kill();
    let row = mesh.a.outbox(&id).expect("A's row");
    assert_eq!((row.state.as_str(), row.seq), ("pending", None), "{row:?}");
    let wire_hash = row
        .wire_hash
        .clone()
        .expect("wire persisted before the push");
    let items = mesh.relay.items_for(&mesh.b.pubkey);
    assert_eq!(items.len(), 1, "{items:?}");
    let seq = items[0].0;
    assert_eq!(mesh.relay.dedup_rows(&id), vec![(seq, wire_hash.clone())]);

    mesh.a.start(None);
    let row = mesh.a.wait_relay_accepted(&id);
    assert_eq!(row.seq, Some(seq));
    assert_eq!(
        row.wire_hash.as_deref(),
        Some(wire_hash.as_str()),
        "same bytes re-pushed"
    );
    assert_accept_status(&mesh.a, &id, "duplicate");
    assert_eq!(
        mesh.relay.items_for(&mesh.b.pubkey),
        vec![(seq, id.clone())]
    );
    assert_eq!(mesh.relay.dedup_rows(&id), vec![(seq, wire_hash)]);

    mesh.b.start(None);
    wait_inbox(&mesh.b, "bob", &id);
    assert_delivered_once(&mesh, &id, seq);
}

#[test]
fn relay_killed_before_commit_accepts_the_retry_once() {
    let mut mesh = Mesh::start(Some("push:before-commit"));
    mesh.b.stop();
    let id = send_to_bob(&mesh, "before commit", "never committed the first time");

    mesh.relay.proc().wait_for_failpoint("push:before-commit");
    mesh.relay.kill();
    assert_eq!(
        mesh.relay.items_for(&mesh.b.pubkey),
        vec![],
        "nothing committed"
    );
    assert_eq!(mesh.relay.dedup_rows(&id), vec![]);

    mesh.relay.launch(None);
    let row = mesh.a.wait_relay_accepted(&id);
    let seq = row.seq.expect("seq");
    assert_accept_status(&mesh.a, &id, "accepted");
    assert_eq!(
        mesh.relay.items_for(&mesh.b.pubkey),
        vec![(seq, id.clone())]
    );
    assert_eq!(
        mesh.relay.dedup_rows(&id),
        vec![(seq, row.wire_hash.clone().expect("wire_hash"))]
    );

    mesh.b.start(None);
    wait_inbox(&mesh.b, "bob", &id);
    assert_delivered_once(&mesh, &id, seq);
}

#[test]
fn receiver_killed_mid_page_stores_each_message_once() {
    let mut mesh = Mesh::start(None);
    mesh.b.stop();
    let ids: Vec<String> = (1..=3)
        .map(|i| send_to_bob(&mesh, &format!("page item {i}"), &format!("body {i}")))
        .collect();
    let mut seqs: Vec<i64> = ids
        .iter()
        .map(|id| mesh.a.wait_relay_accepted(id).seq.expect("seq"))
        .collect();
    seqs.sort_unstable();
    let queued = mesh.relay.items_for(&mesh.b.pubkey);
    assert_eq!(queued.iter().map(|i| i.0).collect::<Vec<_>>(), seqs);
    let first = queued[0].1.clone();

    // The first page holds all three; B dies after storing the first, before the checkpoint.
    mesh.b.start(Some("receive:after-deliver"));
    mesh.b.daemon().wait_for_failpoint("receive:after-deliver");
    mesh.b.kill();
    assert_eq!(mesh.b.message_count(), 1);
    assert_eq!(
        mesh.b.messages_with_id(&first),
        1,
        "the lowest seq is stored first"
    );
    let url = mesh.relay.url();
    let through = mesh.b.position(&url).map_or(0, |p| p.received_through);
    assert_eq!(through, 0, "no checkpoint was written for the page");
    assert_eq!(
        mesh.relay.items_for(&mesh.b.pubkey),
        queued,
        "nothing acked"
    );

    mesh.b.start(None);
    mesh.wait_queue_drained(&mesh.b);
    let last = *seqs.last().expect("three seqs");
    let pos = wait_for("B's acked_through to reach the head", || {
        mesh.b.position(&url).filter(|p| p.acked_through >= last)
    });
    assert_eq!((pos.received_through, pos.acked_through), (last, last));
    assert_eq!(mesh.relay.acked_through(&mesh.b.pubkey), Some(last));
    assert_eq!(mesh.b.message_count(), 3);
    for id in &ids {
        assert_eq!(mesh.b.messages_with_id(id), 1, "{id}");
        assert_eq!(mesh.b.deliveries_of(id), 1, "{id}");
    }
    assert_eq!(mesh.b.quarantined(), 0);
    let mut inbox = mesh.b.inbox_ids("bob");
    inbox.sort();
    let mut expected = ids.clone();
    expected.sort();
    assert_eq!(inbox, expected);
}

#[test]
fn ack_never_sent_is_covered_by_the_next_ack() {
    let mut mesh = Mesh::start(None);
    mesh.b.restart(Some("ack:before-send"));
    let first = send_to_bob(&mesh, "ack lost", "checkpointed, never acked");
    let seq = mesh.a.wait_relay_accepted(&first).seq.expect("seq");

    mesh.b.daemon().wait_for_failpoint("ack:before-send");
    mesh.b.kill();
    let url = mesh.relay.url();
    let pos = mesh.b.position(&url).expect("B's position");
    assert_eq!((pos.received_through, pos.acked_through), (seq, 0));
    assert_eq!(mesh.b.messages_with_id(&first), 1);
    assert_eq!(
        mesh.relay.items_for(&mesh.b.pubkey),
        vec![(seq, first.clone())]
    );
    assert!(mesh.relay.acked_through(&mesh.b.pubkey).unwrap_or(0) < seq);

    mesh.b.start(None);
    assert_delivered_once(&mesh, &first, seq);

    // Delivery goes on: the next message is received once and acked through the new head.
    let second = send_to_bob(&mesh, "after the lost ack", "next");
    let seq2 = mesh.a.wait_relay_accepted(&second).seq.expect("seq");
    assert!(seq2 > seq);
    wait_inbox(&mesh.b, "bob", &second);
    mesh.wait_queue_drained(&mesh.b);
    wait_for("B's acked_through to reach the second seq", || {
        mesh.b.position(&url).filter(|p| p.acked_through == seq2)
    });
    assert_eq!(mesh.relay.acked_through(&mesh.b.pubkey), Some(seq2));
    assert_eq!(mesh.b.message_count(), 2);
    assert_eq!(mesh.b.deliveries_of(&first), 1);
    assert_eq!(mesh.b.deliveries_of(&second), 1);
}

#[test]
fn ack_answer_lost_is_covered_by_the_next_ack() {
    let mut mesh = Mesh::start(None);
    mesh.b.restart(Some("ack:after-response"));
    let id = send_to_bob(
        &mesh,
        "ack answer lost",
        "the relay acked, B never recorded it",
    );
    let seq = mesh.a.wait_relay_accepted(&id).seq.expect("seq");

    mesh.b.daemon().wait_for_failpoint("ack:after-response");
    mesh.b.kill();
    let url = mesh.relay.url();
    let pos = mesh.b.position(&url).expect("B's position");
    assert_eq!((pos.received_through, pos.acked_through), (seq, 0));
    assert_eq!(
        mesh.relay.items_for(&mesh.b.pubkey),
        vec![],
        "the relay did ack"
    );
    assert_eq!(mesh.relay.acked_through(&mesh.b.pubkey), Some(seq));

    mesh.b.start(None);
    assert_delivered_once(&mesh, &id, seq);
    assert_eq!(mesh.b.inbox_ids("bob"), vec![id]);
}

#[test]
fn relay_set_refuses_a_wrong_or_malformed_key_and_leaves_config_unchanged() {
    let relay = Relay::start(None);
    let host = Host::init("hosta");
    let config = || std::fs::read(host.home.file("config.toml")).expect("config.toml");
    let url = relay.url();

    // A fingerprint that differs from the relay's in its last hex digit.
    let fp = relay.fingerprint.clone();
    let last = fp.chars().last().expect("fingerprint");
    let wrong = format!(
        "{}{}",
        &fp[..fp.len() - 1],
        if last == '0' { '1' } else { '0' }
    );
    let other_key = host.pubkey.clone(); // a valid key, but not the relay's

    let check_refusals = |stage: &str| {
        let before = config();
        for bad in [wrong.as_str(), other_key.as_str()] {
            let out = host.home.run(&["relay", "set", &url, "--key", bad]);
            assert_eq!(out.code(), Some(1), "{stage}: {out:#?}");
            assert!(out.stderr.starts_with("agentmbx: "), "{stage}: {out:#?}");
            assert!(out.stderr.contains(&fp), "names the served key: {out:#?}");
            assert_eq!(config(), before, "{stage}: config.toml changed by {bad}");
        }
        for bad in ["not-a-key", "abcd-ef01-2345-678", "zzzz-zzzz-zzzz-zzzz", ""] {
            let out = host.home.run(&["relay", "set", &url, "--key", bad]);
            assert_eq!(out.code(), Some(2), "{stage}: --key {bad:?}: {out:#?}");
            assert_eq!(config(), before, "{stage}: config.toml changed by {bad:?}");
        }
    };
    check_refusals("before any pin");

    // The right key, spelled without dashes and in upper case, is accepted and pinned.
    let spelled = fp.replace('-', "").to_uppercase();
    let out = host
        .home
        .run(&["relay", "set", &url, "--key", &spelled, "--json"]);
    out.assert_success();
    let json = out.json();
    assert_eq!(json["fingerprint"], fp.as_str(), "{json}");
    assert_eq!(json["url"], url.as_str(), "{json}");
    let text = String::from_utf8(config()).expect("UTF-8 config");
    let pinned = json["relay_pubkey"].as_str().expect("relay_pubkey");
    assert!(text.contains(pinned) && text.contains(&url), "{text}");

    check_refusals("after pinning");
}

#[test]
fn cli_send_inbox_read_ack_round_trip_through_the_relay() {
    let mesh = Mesh::start(None);
    let tag = unique_tag();
    let subject = format!("cli subject {tag}");
    let body = format!("cli body {tag}\nsecond line");
    let out = mesh.a.home.run(&[
        "send",
        "--as",
        "alice",
        "--to",
        "bob@hostb",
        "--subject",
        &subject,
        "-m",
        &body,
        "--json",
    ]);
    out.assert_success();
    let sent = out.json();
    let id = sent["id"].as_str().expect("id").to_string();
    assert_eq!(
        sent["queued_for_hosts"],
        serde_json::json!(["hostb"]),
        "{sent}"
    );

    wait_for("the message in B's store", || {
        (mesh.b.messages_with_id(&id) == 1).then_some(())
    });
    let out = mesh.b.home.run(&["inbox", "--as", "bob", "--json"]);
    out.assert_success();
    let inbox = out.json();
    let messages = inbox["messages"].as_array().expect("messages");
    assert_eq!(messages.len(), 1, "{inbox}");
    assert_eq!(messages[0]["id"], id.as_str());
    assert_eq!(messages[0]["subject"], subject.as_str());
    assert_eq!(messages[0]["from"], "alice@hosta");

    let out = mesh.b.home.run(&["read", &id, "--as", "bob", "--json"]);
    out.assert_success();
    let msg = out.json();
    assert_eq!(msg["body"], body.as_str(), "{msg}");
    assert_eq!(msg["subject"], subject.as_str(), "{msg}");

    mesh.b
        .home
        .run(&["ack", &id, "--as", "bob"])
        .assert_success();
    let out = mesh
        .b
        .home
        .run(&["inbox", "--as", "bob", "--all", "--json"]);
    out.assert_success();
    assert_eq!(
        out.json()["messages"][0]["state"],
        "acked",
        "{}",
        out.stdout
    );
    mesh.wait_queue_drained(&mesh.b);
    assert_eq!(mesh.b.message_count(), 1);
}

#[test]
fn replayed_send_with_an_idempotency_key_is_one_relay_item() {
    let mesh = Mesh::start(None);
    let key = format!("send-{}", unique_tag());
    let body = serde_json::json!({"from": "alice", "to": ["bob@hostb"], "subject": "once", "body": "only one copy"});
    let send = |body: &serde_json::Value| {
        mesh.a.api_with(
            "POST",
            "/v1/messages",
            &[("Idempotency-Key", &key)],
            Some(body),
        )
    };
    let first = send(&body);
    assert_eq!(first.status, 201, "{first:#?}");
    let id = first.json()["id"].as_str().expect("id").to_string();
    let replay = send(&body);
    assert_eq!(replay.status, 201, "{replay:#?}");
    assert_eq!(
        replay.json(),
        first.json(),
        "a replay returns the first answer"
    );
    let mut other = body.clone();
    other["body"] = "another body".into();
    let conflict = send(&other);
    assert_eq!(conflict.status, 409, "{conflict:#?}");

    let seq = mesh.a.wait_relay_accepted(&id).seq.expect("seq");
    wait_inbox(&mesh.b, "bob", &id);
    assert_delivered_once(&mesh, &id, seq);
    assert_eq!(
        mesh.a
            .count("SELECT COUNT(*) FROM outbox WHERE host = ?1", "hostb"),
        1,
        "one outbox row"
    );
}

/// The relay dies at an ack commit boundary; once it is back, B's next ack settles the queue
/// and nothing is delivered twice.
fn relay_killed_at_an_ack_boundary(failpoint: &str, committed: bool) {
    let mut mesh = Mesh::start(Some(failpoint));
    let id = send_to_bob(&mesh, failpoint, "the ack meets a relay crash");
    let seq = mesh.a.wait_relay_accepted(&id).seq.expect("seq");
    mesh.relay.proc().wait_for_failpoint(failpoint);
    mesh.relay.kill();
    let url = mesh.relay.url();
    let pos = mesh.b.position(&url).expect("B's position");
    assert_eq!((pos.received_through, pos.acked_through), (seq, 0));
    if committed {
        assert_eq!(mesh.relay.items_for(&mesh.b.pubkey), vec![]);
        assert_eq!(mesh.relay.acked_through(&mesh.b.pubkey), Some(seq));
    } else {
        assert_eq!(
            mesh.relay.items_for(&mesh.b.pubkey),
            vec![(seq, id.clone())]
        );
        assert!(mesh.relay.acked_through(&mesh.b.pubkey).unwrap_or(0) < seq);
    }

    mesh.relay.launch(None);
    assert_delivered_once(&mesh, &id, seq);
}

#[test]
fn relay_killed_before_committing_an_ack_gets_it_again() {
    relay_killed_at_an_ack_boundary("ack:before-commit", false);
}

#[test]
fn relay_killed_after_committing_an_ack_gets_it_again() {
    relay_killed_at_an_ack_boundary("ack:after-commit", true);
}
