//! The crash drills of spec §5 ("each MUST be tested with a real child-process crash"): one
//! test per failpoint of `MBX_FAILPOINTS` (design README "Decisions"), each with real child
//! processes — `agentmbx relay serve` and two `agentmbx daemon`s, `hosta` sending to `hostb`
//! through the relay (the hosts have no LAN address for each other). The armed process is
//! SIGKILLed exactly at the point, its state at the kill is checked in the stores themselves
//! (`relay.db`, `mailbox.db`, opened read-only), it is restarted on the same store, and then
//! [`assert_crash_facts`] checks the same facts after every drill:
//!
//! - the item is at the relay once, with one seq (`dedup`, `items`);
//! - the sender's accept carries the original seq and time (the outbox row's signed accept
//!   against the relay's `dedup` row, also when the answer was a duplicate);
//! - the message is stored once at the receiver (`messages`, `deliveries`, no quarantine);
//! - the receive checkpoint advances (`relay_position.received_through`);
//! - the next ack covers a lost one (`acked_through` at the head, here and at the relay);
//! - seqs keep rising: a message sent after the restart gets a larger seq;
//! - the epoch is unchanged (`meta.epoch`, the accepts, both hosts' positions).
//!
//! Failpoints: relay `push:before-commit`, `push:after-commit`, `pull:before-response`,
//! `ack:before-commit`, `ack:after-commit`; sender `push:before-send`, `push:after-response`;
//! receiver `receive:after-deliver`, `ack:before-send`, `ack:after-response`.
//!
//! A failed push is retried after the sender's first outbox backoff (5 s), so the drills that
//! fail a push take that long; the tests never shift a clock mid-run.

use crate::helper::mesh::{Host, Mesh};
use crate::helper::wait_for;
use agentmbx_protocol::time::parse_iso_ms;
use rusqlite::OptionalExtension;
use serde_json::Value;

/// One `dedup` row of the relay: the item as first accepted for one target.
#[derive(Debug, Clone, PartialEq, Eq)]
struct DedupRow {
    target: String,
    seq: i64,
    wire_hash: String,
    accepted_at: i64,
}

/// What the sender's outbox row records of the relay's accept.
#[derive(Debug, Clone)]
struct SenderAccept {
    state: String,
    seq: Option<i64>,
    wire_hash: Option<String>,
    epoch: Option<String>,
    accepted_at: Option<i64>,
    accept: Option<String>,
    accept_sig: Option<String>,
}

/// What is known before the crash: the relay's epoch, the highest seq it ever gave `hostb`,
/// and how many messages `hostb` stores.
#[derive(Debug, Clone)]
struct Baseline {
    epoch: String,
    head: i64,
    b_messages: i64,
}

/// The relay's `meta.epoch`.
fn relay_epoch(mesh: &Mesh) -> String {
    mesh.relay
        .db()
        .query_row("SELECT v FROM meta WHERE k = 'epoch'", [], |r| r.get(0))
        .expect("meta.epoch")
}

/// The highest seq the relay ever allocated to `host` (0 when none).
fn relay_head(mesh: &Mesh, host: &Host) -> i64 {
    mesh.relay
        .db()
        .query_row(
            "SELECT COALESCE(MAX(seq), 0) FROM dedup WHERE target_pubkey = ?1",
            [&host.pubkey],
            |r| r.get(0),
        )
        .expect("max dedup seq")
}

/// Every `dedup` row of item `id`.
fn dedup_of(mesh: &Mesh, id: &str) -> Vec<DedupRow> {
    let db = mesh.relay.db();
    let mut st = db
        .prepare(
            "SELECT target_pubkey, seq, wire_hash, accepted_at FROM dedup WHERE item_id = ?1
             ORDER BY seq",
        )
        .expect("prepare");
    st.query_map([id], |r| {
        Ok(DedupRow {
            target: r.get(0)?,
            seq: r.get(1)?,
            wire_hash: r.get(2)?,
            accepted_at: r.get(3)?,
        })
    })
    .expect("query dedup")
    .collect::<Result<_, _>>()
    .expect("dedup rows")
}

/// `(target, seq)` of every queued item with id `id`.
fn items_of(mesh: &Mesh, id: &str) -> Vec<(String, i64)> {
    let db = mesh.relay.db();
    let mut st = db
        .prepare("SELECT target_pubkey, seq FROM items WHERE item_id = ?1 ORDER BY seq")
        .expect("prepare");
    st.query_map([id], |r| Ok((r.get(0)?, r.get(1)?)))
        .expect("query items")
        .collect::<Result<_, _>>()
        .expect("items rows")
}

/// The relay-facing columns of `host`'s outbox row for message `id`.
fn sender_accept(host: &Host, id: &str) -> SenderAccept {
    host.db()
        .query_row(
            "SELECT state, seq, wire_hash, epoch, accepted_at, accept, accept_sig FROM outbox
             WHERE msg_id = ?1",
            [id],
            |r| {
                Ok(SenderAccept {
                    state: r.get(0)?,
                    seq: r.get(1)?,
                    wire_hash: r.get(2)?,
                    epoch: r.get(3)?,
                    accepted_at: r.get(4)?,
                    accept: r.get(5)?,
                    accept_sig: r.get(6)?,
                })
            },
        )
        .optional()
        .expect("query outbox")
        .unwrap_or_else(|| panic!("{} has no outbox row for {id}", host.name))
}

/// Where things stand before the drill's message is sent.
fn baseline(mesh: &Mesh) -> Baseline {
    Baseline {
        epoch: relay_epoch(mesh),
        head: relay_head(mesh, &mesh.b),
        b_messages: mesh.b.message_count(),
    }
}

/// Sends one message alice@hosta → bob@hostb through A's local API; returns its id.
fn send_to_bob(mesh: &Mesh, subject: &str) -> String {
    let sent = mesh
        .a
        .send("alice", "bob@hostb", subject, &format!("{subject}: body"));
    assert_eq!(
        sent["queued_for_hosts"],
        serde_json::json!(["hostb"]),
        "{sent}"
    );
    sent["id"].as_str().expect("id").to_string()
}

/// Waits until `host`'s agent `agent` has message `id` in its inbox.
fn wait_inbox(host: &Host, agent: &str, id: &str) {
    wait_for(&format!("{id} in {agent}@{}'s inbox", host.name), || {
        host.inbox_ids(agent).iter().any(|i| i == id).then_some(())
    });
}

/// The `relay accepted` log line of message `id` carries `status=<status>`.
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

/// The item `id` is committed at the relay exactly once: one `dedup` row and one queued item
/// for `hostb`, under the same seq. Returns that row.
fn assert_committed_once(mesh: &Mesh, id: &str) -> DedupRow {
    let dedup = dedup_of(mesh, id);
    assert_eq!(dedup.len(), 1, "dedup rows of {id}: {dedup:?}");
    let row = dedup[0].clone();
    assert_eq!(row.target, mesh.b.pubkey);
    assert_eq!(
        items_of(mesh, id),
        vec![(mesh.b.pubkey.clone(), row.seq)],
        "queued items of {id}"
    );
    row
}

/// Nothing of item `id` is committed at the relay.
fn assert_not_committed(mesh: &Mesh, id: &str) {
    assert_eq!(dedup_of(mesh, id), vec![], "dedup rows of {id}");
    assert_eq!(items_of(mesh, id), vec![], "queued items of {id}");
}

/// A's outbox row of `id` holds no accept yet: `pending`, wire bytes persisted.
fn assert_sender_pending(mesh: &Mesh, id: &str) -> String {
    let row = sender_accept(&mesh.a, id);
    assert_eq!(
        (row.state.as_str(), row.seq, row.accept.as_deref()),
        ("pending", None, None),
        "{row:?}"
    );
    row.wire_hash
        .expect("the wire bytes are persisted before the push")
}

/// The accept A recorded for `id` is the relay's first one: the seq, wire hash and time of
/// the `dedup` row, in `epoch`, signed, naming this item and sender.
fn assert_original_accept(mesh: &Mesh, id: &str, d: &DedupRow, epoch: &str) {
    let row = sender_accept(&mesh.a, id);
    assert!(
        row.state == "relay-accepted" || row.state == "delivered",
        "{row:?}"
    );
    assert_eq!(
        row.seq,
        Some(d.seq),
        "the row keeps the original seq: {row:?}"
    );
    assert_eq!(row.wire_hash.as_deref(), Some(d.wire_hash.as_str()));
    assert_eq!(row.epoch.as_deref(), Some(epoch), "{row:?}");
    assert_eq!(
        row.accepted_at,
        Some(d.accepted_at),
        "the row keeps the original time"
    );
    assert!(row.accept_sig.as_deref().is_some_and(|s| !s.is_empty()));
    let accept: Value =
        serde_json::from_str(row.accept.as_deref().expect("accept")).expect("accept is JSON");
    assert_eq!(accept["type"], "relay-accept", "{accept}");
    assert_eq!(accept["epoch"], epoch, "{accept}");
    assert_eq!(accept["item_id"], id, "{accept}");
    assert_eq!(accept["sender_pubkey"], mesh.a.pubkey.as_str(), "{accept}");
    assert_eq!(
        accept["targets"],
        serde_json::json!([{"host_pubkey": d.target, "seq": d.seq, "wire_hash": d.wire_hash}]),
        "the accept names the original seq"
    );
    let at = accept["at"].as_str().and_then(parse_iso_ms);
    assert_eq!(
        at,
        Some(d.accepted_at),
        "the accept carries the original time: {accept}"
    );
}

/// The facts every drill checks once all three processes run again, for the messages `ids`
/// A sent to B around the crash (`base` taken before the first of them): each is at the relay
/// once with one seq above every earlier one, A's accept carries that original seq and time,
/// B stores it once, B's checkpoint advanced to the head and the ack covers it (here and at
/// the relay), nothing is queued or quarantined; then a message sent after the restart gets a
/// larger seq and is delivered and acked the same way; the epoch never changed.
fn assert_crash_facts(mesh: &Mesh, base: &Baseline, ids: &[String]) {
    let url = mesh.relay.url();
    let mut seqs = Vec::new();
    for id in ids {
        mesh.a.wait_relay_accepted(id);
        wait_inbox(&mesh.b, "bob", id);
    }
    mesh.wait_queue_drained(&mesh.b);
    for id in ids {
        let dedup = dedup_of(mesh, id);
        assert_eq!(
            dedup.len(),
            1,
            "one dedup row (one seq) for {id}: {dedup:?}"
        );
        let d = &dedup[0];
        assert_eq!(d.target, mesh.b.pubkey, "{d:?}");
        assert!(
            d.seq > base.head,
            "seq {} of {id} above the earlier head {}",
            d.seq,
            base.head
        );
        assert_eq!(items_of(mesh, id), vec![], "{id} acked away at the relay");
        assert_original_accept(mesh, id, d, &base.epoch);
        assert_eq!(mesh.b.messages_with_id(id), 1, "stored copies of {id}");
        assert_eq!(mesh.b.deliveries_of(id), 1, "deliveries of {id}");
        seqs.push(d.seq);
    }
    let mut distinct = seqs.clone();
    distinct.sort_unstable();
    distinct.dedup();
    assert_eq!(distinct.len(), seqs.len(), "one seq per item: {seqs:?}");
    let head = *distinct.last().expect("at least one message");
    assert_eq!(
        head,
        relay_head(mesh, &mesh.b),
        "no other seq was allocated"
    );
    let pos = wait_for("B's ack to cover the head", || {
        mesh.b.position(&url).filter(|p| p.acked_through >= head)
    });
    assert_eq!(pos.epoch, base.epoch, "B's position keeps the epoch");
    assert_eq!(
        (pos.received_through, pos.acked_through),
        (head, head),
        "the checkpoint advanced and the ack covers it"
    );
    assert_eq!(mesh.relay.acked_through(&mesh.b.pubkey), Some(head));
    assert_eq!(mesh.b.quarantined(), 0, "nothing quarantined");
    assert_eq!(
        mesh.b.message_count(),
        base.b_messages + ids.len() as i64,
        "B stores nothing else"
    );

    // Seqs keep rising across the restart, and delivery goes on exactly once.
    let next = send_to_bob(mesh, "after the restart");
    let row = mesh.a.wait_relay_accepted(&next);
    let next_seq = row.seq.expect("seq");
    assert!(
        next_seq > head,
        "a seq after the restart ({next_seq}) is above {head}"
    );
    wait_inbox(&mesh.b, "bob", &next);
    mesh.wait_queue_drained(&mesh.b);
    let d = assert_single(dedup_of(mesh, &next));
    assert_eq!(d.seq, next_seq);
    assert_original_accept(mesh, &next, &d, &base.epoch);
    let pos = wait_for("B's ack to cover the next message", || {
        mesh.b
            .position(&url)
            .filter(|p| p.acked_through >= next_seq)
    });
    assert_eq!(
        (pos.received_through, pos.acked_through),
        (next_seq, next_seq)
    );
    assert_eq!(mesh.relay.acked_through(&mesh.b.pubkey), Some(next_seq));
    assert_eq!(mesh.b.messages_with_id(&next), 1);
    assert_eq!(mesh.b.deliveries_of(&next), 1);
    assert_eq!(
        mesh.b.message_count(),
        base.b_messages + ids.len() as i64 + 1
    );

    // The epoch is unchanged everywhere.
    assert_eq!(relay_epoch(mesh), base.epoch, "the relay kept its epoch");
    if let Some(pos) = mesh.a.position(&url) {
        assert_eq!(pos.epoch, base.epoch, "A's position keeps the epoch");
    }
}

/// The one element of `rows`.
fn assert_single(rows: Vec<DedupRow>) -> DedupRow {
    assert_eq!(rows.len(), 1, "{rows:?}");
    rows.into_iter().next().expect("one row")
}

/// B's `received_through` (0 before its first checkpoint).
fn b_through(mesh: &Mesh) -> i64 {
    mesh.b
        .position(&mesh.relay.url())
        .map_or(0, |p| p.received_through)
}

// ---- relay ----

#[test]
fn relay_push_before_commit() {
    let mut mesh = Mesh::start(Some("push:before-commit"));
    mesh.b.stop(); // B comes back once A settled, so the relay queue is inspected as is.
    let base = baseline(&mesh);
    let id = send_to_bob(&mesh, "relay push:before-commit");

    mesh.relay.proc().wait_for_failpoint("push:before-commit");
    mesh.relay.kill();
    assert_not_committed(&mesh, &id);
    assert_sender_pending(&mesh, &id);

    mesh.relay.launch(None);
    let row = mesh.a.wait_relay_accepted(&id);
    assert_accept_status(&mesh.a, &id, "accepted");
    let d = assert_committed_once(&mesh, &id);
    assert_eq!(row.seq, Some(d.seq));
    mesh.b.start(None);
    assert_crash_facts(&mesh, &base, &[id]);
}

#[test]
fn relay_push_after_commit() {
    let mut mesh = Mesh::start(Some("push:after-commit"));
    mesh.b.stop();
    let base = baseline(&mesh);
    let id = send_to_bob(&mesh, "relay push:after-commit");

    mesh.relay.proc().wait_for_failpoint("push:after-commit");
    mesh.relay.kill();
    let first = assert_committed_once(&mesh, &id);
    let hash = assert_sender_pending(&mesh, &id);
    assert_eq!(first.wire_hash, hash, "the relay holds A's bytes");

    mesh.relay.launch(None);
    mesh.a.wait_relay_accepted(&id);
    // The retry (at least one outbox backoff later) is answered from the dedup row.
    assert_accept_status(&mesh.a, &id, "duplicate");
    assert_eq!(
        assert_committed_once(&mesh, &id),
        first,
        "still the first accept"
    );
    assert_original_accept(&mesh, &id, &first, &base.epoch);
    mesh.b.start(None);
    assert_crash_facts(&mesh, &base, &[id]);
}

#[test]
fn relay_pull_before_response() {
    let mut mesh = Mesh::start(None);
    mesh.b.stop();
    let base = baseline(&mesh);
    let id = send_to_bob(&mesh, "relay pull:before-response");
    mesh.a.wait_relay_accepted(&id);
    // Only B pulls while the point is armed.
    mesh.a.stop();
    let d = assert_committed_once(&mesh, &id);
    mesh.relay.kill();
    mesh.relay.launch(Some("pull:before-response"));

    mesh.b.start(None);
    mesh.relay.proc().wait_for_failpoint("pull:before-response");
    mesh.relay.kill();
    assert_eq!(mesh.b.messages_with_id(&id), 0, "the page never reached B");
    assert_eq!(b_through(&mesh), 0, "no checkpoint");
    assert_eq!(
        assert_committed_once(&mesh, &id),
        d,
        "still queued, same seq"
    );
    assert!(mesh.relay.acked_through(&mesh.b.pubkey).unwrap_or(0) < d.seq);

    mesh.relay.launch(None);
    mesh.a.start(None);
    assert_crash_facts(&mesh, &base, &[id]);
}

/// The relay dies at an ack commit boundary (`committed`: after the COMMIT); B's next ack
/// settles the queue once the relay is back.
fn relay_ack_drill(failpoint: &str, committed: bool) {
    let mut mesh = Mesh::start(Some(failpoint));
    let base = baseline(&mesh);
    let id = send_to_bob(&mesh, failpoint);
    let seq = mesh.a.wait_relay_accepted(&id).seq.expect("seq");

    mesh.relay.proc().wait_for_failpoint(failpoint);
    mesh.relay.kill();
    let pos = mesh.b.position(&mesh.relay.url()).expect("B's position");
    assert_eq!(
        (pos.received_through, pos.acked_through),
        (seq, 0),
        "B checkpointed, the ack's answer never came"
    );
    assert_eq!(mesh.b.messages_with_id(&id), 1);
    assert_eq!(dedup_of(&mesh, &id).len(), 1);
    if committed {
        assert_eq!(items_of(&mesh, &id), vec![]);
        assert_eq!(mesh.relay.acked_through(&mesh.b.pubkey), Some(seq));
    } else {
        assert_committed_once(&mesh, &id);
        assert!(mesh.relay.acked_through(&mesh.b.pubkey).unwrap_or(0) < seq);
    }

    mesh.relay.launch(None);
    assert_crash_facts(&mesh, &base, &[id]);
}

#[test]
fn relay_ack_before_commit() {
    relay_ack_drill("ack:before-commit", false);
}

#[test]
fn relay_ack_after_commit() {
    relay_ack_drill("ack:after-commit", true);
}

// ---- sender ----

#[test]
fn sender_push_before_send() {
    let mut mesh = Mesh::start(None);
    mesh.b.stop();
    mesh.a.restart(Some("push:before-send"));
    let base = baseline(&mesh);
    let id = send_to_bob(&mesh, "sender push:before-send");

    mesh.a.daemon().wait_for_failpoint("push:before-send");
    mesh.a.kill();
    assert_sender_pending(&mesh, &id);
    assert_not_committed(&mesh, &id);

    mesh.a.start(None);
    let row = mesh.a.wait_relay_accepted(&id);
    assert_accept_status(&mesh.a, &id, "accepted");
    let d = assert_committed_once(&mesh, &id);
    assert_eq!(row.seq, Some(d.seq));
    mesh.b.start(None);
    assert_crash_facts(&mesh, &base, &[id]);
}

#[test]
fn sender_push_after_response() {
    let mut mesh = Mesh::start(None);
    mesh.b.stop();
    mesh.a.restart(Some("push:after-response"));
    let base = baseline(&mesh);
    let id = send_to_bob(&mesh, "sender push:after-response");

    mesh.a.daemon().wait_for_failpoint("push:after-response");
    mesh.a.kill();
    let hash = assert_sender_pending(&mesh, &id);
    let first = assert_committed_once(&mesh, &id);
    assert_eq!(first.wire_hash, hash);

    mesh.a.start(None);
    mesh.a.wait_relay_accepted(&id);
    assert_accept_status(&mesh.a, &id, "duplicate");
    assert_eq!(
        assert_committed_once(&mesh, &id),
        first,
        "still the first accept"
    );
    mesh.b.start(None);
    assert_crash_facts(&mesh, &base, &[id]);
}

// ---- receiver ----

#[test]
fn receiver_receive_after_deliver() {
    let mut mesh = Mesh::start(None);
    mesh.b.stop();
    let base = baseline(&mesh);
    let ids: Vec<String> = (1..=3)
        .map(|i| send_to_bob(&mesh, &format!("receiver receive:after-deliver {i}")))
        .collect();
    let mut queued: Vec<(i64, String)> = ids
        .iter()
        .map(|id| {
            mesh.a.wait_relay_accepted(id);
            (assert_committed_once(&mesh, id).seq, id.clone())
        })
        .collect();
    queued.sort();

    // One page holds all three; B dies after storing the first, before the checkpoint.
    mesh.b.start(Some("receive:after-deliver"));
    mesh.b.daemon().wait_for_failpoint("receive:after-deliver");
    mesh.b.kill();
    assert_eq!(mesh.b.message_count(), base.b_messages + 1);
    assert_eq!(mesh.b.messages_with_id(&queued[0].1), 1, "lowest seq first");
    assert_eq!(b_through(&mesh), 0, "no checkpoint covers the page");
    assert_eq!(
        mesh.relay.items_for(&mesh.b.pubkey),
        queued,
        "nothing acked"
    );

    mesh.b.start(None);
    assert_crash_facts(&mesh, &base, &ids);
}

/// B dies at an ack boundary (`relay_acked`: the relay answered the ack); its next ack covers
/// the one it lost.
fn receiver_ack_drill(failpoint: &str, relay_acked: bool) {
    let mut mesh = Mesh::start(None);
    mesh.b.restart(Some(failpoint));
    let base = baseline(&mesh);
    let id = send_to_bob(&mesh, failpoint);
    let seq = mesh.a.wait_relay_accepted(&id).seq.expect("seq");

    mesh.b.daemon().wait_for_failpoint(failpoint);
    mesh.b.kill();
    let pos = mesh.b.position(&mesh.relay.url()).expect("B's position");
    assert_eq!(
        (pos.received_through, pos.acked_through),
        (seq, 0),
        "checkpointed, ack not recorded"
    );
    assert_eq!(mesh.b.messages_with_id(&id), 1);
    if relay_acked {
        assert_eq!(items_of(&mesh, &id), vec![], "the relay did ack");
        assert_eq!(mesh.relay.acked_through(&mesh.b.pubkey), Some(seq));
    } else {
        assert_committed_once(&mesh, &id);
        assert!(mesh.relay.acked_through(&mesh.b.pubkey).unwrap_or(0) < seq);
    }

    mesh.b.start(None);
    assert_crash_facts(&mesh, &base, &[id]);
}

#[test]
fn receiver_ack_before_send() {
    receiver_ack_drill("ack:before-send", false);
}

#[test]
fn receiver_ack_after_response() {
    receiver_ack_drill("ack:after-response", true);
}
