//! The sender's side of retention and expiry with real processes (spec §6; `wire.md` §3.5
//! "Settle", §2.12 "Expiry notice"): `agentmbx relay serve` and two `agentmbx daemon`s that pin
//! each other and the relay; the receiver (`hostb`) is stopped, so mail from `hosta` waits at the
//! relay, `relay-accepted`. Time moves with `MBX_CLOCK_OFFSET_MS` on restart, never by sleeping:
//!
//! - past the sender's own deadline (accepted_at + retention + 24 h) the row ends `unconfirmed`
//!   with the alert `Undelivered/unconfirmed to hostb: <subject>` in the sending agent's inbox;
//! - a relay restarted 14 days and 6 hours later sweeps the item (its heartbeat is stale, so its epoch
//!   rotates too), queues the signed expiry notice, and the sender (same offset, still before
//!   its deadline) re-pushes, pulls the notice, ends the row `expired` and alerts
//!   `Undelivered to hostb: <subject>` once.
//!
//! Either way the ended row drops its wire bytes and keeps their hash (`wire.md` §3.5
//! "Settle"), and `agentmbx sent` still shows it. Last, the receiver's side of a refusal: mail
//! from a host that was unpaired while it waited at the relay is quarantined, and
//! `agentmbx relay quarantine [--json]` lists it with its reason.

use crate::helper::mesh::{unique_tag, Host, Mesh};
use crate::helper::wait_for;
use serde_json::Value;

/// One day (ms).
const DAY: i64 = 86_400_000;

/// Sends alice@hosta → bob@hostb with B stopped; returns the id once the row is relay-accepted.
fn send_while_b_is_down(mesh: &mut Mesh, subject: &str) -> String {
    mesh.b.stop();
    let sent = mesh.a.send("alice", "bob@hostb", subject, "the body");
    let id = sent["id"].as_str().expect("id").to_string();
    let row = mesh.a.wait_relay_accepted(&id);
    assert_eq!(row.state, "relay-accepted", "{row:?}");
    assert_eq!(
        mesh.relay.items_for(&mesh.b.pubkey).len(),
        1,
        "queued for B"
    );
    id
}

/// `(accepted_at, deadline_at)` of A's row for `id`.
fn times(host: &Host, id: &str) -> (i64, i64) {
    host.db()
        .query_row(
            "SELECT accepted_at, deadline_at FROM outbox WHERE msg_id = ?1",
            [id],
            |r| Ok((r.get(0)?, r.get(1)?)),
        )
        .expect("outbox times")
}

/// The alerts in `agent`'s inbox whose subject starts with `prefix`: `(id, subject)`.
fn alerts(host: &Host, agent: &str, prefix: &str) -> Vec<(String, String)> {
    host.inbox(agent)["messages"]
        .as_array()
        .expect("messages")
        .iter()
        .filter(|m| m["kind"] == "alert")
        .filter_map(|m| {
            let subject = m["subject"].as_str()?;
            let id = m["id"].as_str()?;
            subject
                .starts_with(prefix)
                .then(|| (id.to_string(), subject.to_string()))
        })
        .collect()
}

/// The one recipient line of message `id` in `agentmbx sent --as alice --json`.
fn sent_line(host: &Host, id: &str) -> Value {
    let out = host.home.run(&["sent", "--as", "alice", "--json"]);
    out.assert_success();
    let page = out.json();
    let msg = page["messages"]
        .as_array()
        .expect("messages")
        .iter()
        .find(|m| m["id"] == id)
        .unwrap_or_else(|| panic!("{id} in the sent page: {page}"))
        .clone();
    assert_eq!(msg["recipients"].as_array().map(Vec::len), Some(1), "{msg}");
    msg["recipients"][0].clone()
}

#[test]
fn no_receipt_by_the_deadline_makes_the_row_unconfirmed_with_an_alert() {
    let mut mesh = Mesh::start(None);
    let subject = format!("budget {}", unique_tag());
    let id = send_while_b_is_down(&mut mesh, &subject);
    let (accepted_at, deadline_at) = times(&mesh.a, &id);
    assert_eq!(
        deadline_at - accepted_at,
        15 * DAY,
        "retention (14 d) + 24 h"
    );
    // Nothing yet: before the deadline the row waits for B's receipt.
    assert!(alerts(&mesh.a, "alice", "Undelivered").is_empty());
    assert_eq!(sent_line(&mesh.a, &id)["state"], "relay-accepted");

    // A comes back 15 days and 10 minutes later: past the deadline, no receipt from B ever.
    let offset = (15 * DAY + 600_000).to_string();
    mesh.a.stop();
    mesh.a.start_with(&[("MBX_CLOCK_OFFSET_MS", &offset)]);
    let want = format!("Undelivered/unconfirmed to hostb: {subject}");
    let found = wait_for("the unconfirmed alert in alice's inbox", || {
        let found = alerts(&mesh.a, "alice", "Undelivered");
        (!found.is_empty()).then_some(found)
    });
    assert_eq!(found.len(), 1, "{found:?}");
    assert_eq!(found[0].1, want);
    let alert = mesh.a.read(&found[0].0, "alice");
    assert_eq!(alert["from"], "agentmbx@hosta", "{alert}");
    assert_eq!(
        alert["body"],
        format!(
            "Message {id} to host hostb: the relay accepted it, but there is no delivery confirmation (the recipient's host may run AgentMBX older than 0.5.3, which sends none)."
        )
        .as_str(),
        "{alert}"
    );
    let row = mesh.a.outbox(&id).expect("the row is kept");
    assert_eq!(row.state, "unconfirmed", "{row:?}");
    assert_eq!(row.wire, None, "a final row drops its wire bytes");
    assert!(row.wire_hash.is_some(), "and keeps their hash");
    let line = sent_line(&mesh.a, &id);
    assert_eq!(line["state"], "unconfirmed", "{line}");
    assert!(
        line["reason"]
            .as_str()
            .is_some_and(|r| r.contains("older than 0.5.3")),
        "{line}"
    );
    // The item still waits at the relay: the sender's alert is its own, not a relay fact.
    assert_eq!(mesh.relay.items_for(&mesh.b.pubkey).len(), 1);
}

#[test]
fn a_relay_sweep_expires_the_item_and_the_sender_alerts_once() {
    let mut mesh = Mesh::start(None);
    let subject = format!("minutes {}", unique_tag());
    let id = send_while_b_is_down(&mut mesh, &subject);
    let (accepted_at, _) = times(&mesh.a, &id);
    // 14 days and 6 hours later (past retention, before the sender's deadline) the relay
    // restarts: its start-up sweep deletes the item, keeps a dedup tombstone and queues a
    // notice for A.
    let offset = (14 * DAY + DAY / 4).to_string();
    mesh.a.stop();
    mesh.relay.kill();
    mesh.relay
        .launch_with(None, &[("MBX_CLOCK_OFFSET_MS", &offset)]);
    wait_for("the relay's sweep", || {
        mesh.relay
            .items_for(&mesh.b.pubkey)
            .is_empty()
            .then_some(())
    });
    assert_eq!(
        mesh.relay.items_for(&mesh.a.pubkey).len(),
        1,
        "one notice queued for the sender"
    );
    assert_eq!(mesh.relay.dedup_rows(&id).len(), 1, "the tombstone stays");
    mesh.a.start_with(&[("MBX_CLOCK_OFFSET_MS", &offset)]);
    let row = wait_for("the row to expire", || {
        mesh.a.outbox(&id).filter(|r| r.state == "expired")
    });
    assert_eq!(
        row.last_error.as_deref(),
        Some("expired by the relay after 14 day(s): hostb never collected it")
    );
    assert_eq!(row.wire, None, "a final row drops its wire bytes");
    assert!(row.wire_hash.is_some(), "and keeps their hash");
    // The notice was processed and acked: the relay deletes it.
    wait_for("the notice to be acked", || {
        mesh.relay
            .items_for(&mesh.a.pubkey)
            .is_empty()
            .then_some(())
    });
    let found = alerts(&mesh.a, "alice", "Undelivered");
    assert_eq!(
        found.iter().map(|a| a.1.as_str()).collect::<Vec<_>>(),
        vec![format!("Undelivered to hostb: {subject}").as_str()],
        "exactly one alert"
    );
    let alert = mesh.a.read(&found[0].0, "alice");
    let body = alert["body"].as_str().expect("body");
    let accepted_iso = agentmbx_protocol::time::iso_ms(accepted_at);
    assert!(
        body.starts_with(&format!(
            "Message {id} could not be delivered to host hostb: the relay held it for 14 day(s) (accepted {accepted_iso}) and hostb never collected it, so the relay expired it at "
        )),
        "{body}"
    );
    assert_eq!(mesh.a.quarantined(), 0, "the notice verified");
    let line = sent_line(&mesh.a, &id);
    assert_eq!(line["state"], "expired", "{line}");
    // The relay's new epoch made A re-push first: the tombstone answered, so nothing was
    // queued again for B.
    assert!(mesh.relay.items_for(&mesh.b.pubkey).is_empty());
    assert!(
        mesh.a.log().contains("pushing relay-accepted mail again"),
        "the new epoch was seen"
    );
}

#[test]
fn mail_from_a_host_unpaired_while_it_waited_is_quarantined_and_listed() {
    let mut mesh = Mesh::start(None);
    // A is away; B's mail for it waits at the relay.
    mesh.a.stop();
    let subject = format!("while you were out {}", unique_tag());
    let sent = mesh.b.send("bob", "alice@hosta", &subject, "the body");
    let id = sent["id"].as_str().expect("id").to_string();
    mesh.b.wait_relay_accepted(&id);
    // Meanwhile A's owner forgets B (B has no LAN address to be told at).
    let out = mesh.a.home.run(&["peers", "remove", "hostb", "--json"]);
    out.assert_success();
    assert_eq!(out.json()["removed"], "hostb", "{out:#?}");
    assert_eq!(mesh.a.quarantined(), 0);
    // A comes back and pulls it: the sender is no pinned peer, so the item is quarantined,
    // counts as processed and is acked; nothing is stored.
    mesh.a.start(None);
    wait_for("the item in A's quarantine", || {
        (mesh.a.quarantined() == 1).then_some(())
    });
    mesh.wait_queue_drained(&mesh.a);
    assert_eq!(mesh.a.messages_with_id(&id), 0, "not stored");

    let out = mesh.a.home.run(&["relay", "quarantine", "--json"]);
    out.assert_success();
    let list = out.json();
    let items = list.as_array().expect("a JSON array");
    assert_eq!(items.len(), 1, "{list}");
    let q = &items[0];
    assert_eq!(q["kind"], "envelope", "{q}");
    assert_eq!(q["item_id"], id.as_str(), "{q}");
    assert_eq!(q["sender_pubkey"], mesh.b.pubkey.as_str(), "{q}");
    assert_eq!(q["reason"], "host not paired", "{q}");
    assert_eq!(q["relay"], mesh.relay.url().trim_end_matches('/'), "{q}");
    assert!(q["seq"].as_i64().is_some_and(|s| s > 0), "{q}");
    assert!(q["epoch"].as_str().is_some_and(|e| !e.is_empty()), "{q}");
    assert!(q["at"].as_i64().is_some_and(|t| t > 0), "{q}");

    let out = mesh.a.home.run(&["relay", "quarantine"]);
    out.assert_success();
    let fingerprint = agentmbx_protocol::keys::PublicKey::from_b64(&mesh.b.pubkey)
        .expect("B's key")
        .fingerprint();
    let lines: Vec<&str> = out.stdout.lines().collect();
    assert_eq!(lines.len(), 1, "{out:#?}");
    for part in [
        format!("seq {}", q["seq"]),
        format!("envelope {id}"),
        format!("from {fingerprint}"),
        "host not paired".to_string(),
    ] {
        assert!(lines[0].contains(&part), "{part:?} in {:?}", lines[0]);
    }
    assert!(!out.stdout.contains("quarantine is empty"));
}
