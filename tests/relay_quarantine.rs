//! Quarantined relay mail is received once what refused it is fixed, whatever reason was
//! recorded first or last (`wire.md` §3.5): real `agentmbx relay serve` and two `agentmbx
//! daemon`s (`hosta` sends, `hostb` receives, relay-only), the pins changed with the CLI while
//! the receiver runs. State is read in `mailbox.db` (read-only) and through the local API.

use crate::helper::mesh::{Host, Mesh};
use crate::helper::wait_for;

/// The reason `host` recorded for quarantined item `id`, if it is quarantined.
fn quarantine_reason(host: &Host, id: &str) -> Option<String> {
    use rusqlite::OptionalExtension;
    host.db()
        .query_row(
            "SELECT reason FROM quarantine WHERE item_id = ?1",
            [id],
            |r| r.get(0),
        )
        .optional()
        .expect("query quarantine")
}

/// Waits until `host` records `reason` for item `id`.
fn wait_reason(host: &Host, id: &str, reason: &str) {
    wait_for(&format!("{id} quarantined as {reason:?}"), || {
        (quarantine_reason(host, id).as_deref() == Some(reason)).then_some(())
    });
}

/// The case `quarantine-stuck-after-reason-change`, as its author ran it.
#[test]
fn mail_quarantined_under_a_second_reason_is_received_once_the_sender_is_pinned_right() {
    let mut mesh = Mesh::start(None);
    // hostb is away while hosta sends: the relay holds the item.
    mesh.b.stop();
    let sent = mesh.a.send("alice", "bob@hostb", "x", "x");
    let id = sent["id"].as_str().expect("id").to_string();
    mesh.a.wait_relay_accepted(&id);
    // hostb forgets hosta, then starts: `host not paired`.
    mesh.b
        .home
        .run(&["peers", "remove", "hosta"])
        .assert_success();
    mesh.b.start(None);
    wait_reason(&mesh.b, &id, "host not paired");
    // hosta's key pinned under another name: the envelope names hosta.
    let a_key = mesh.a.pubkey.clone();
    mesh.b
        .home
        .run(&["peers", "add", "othername", &a_key])
        .assert_success();
    wait_reason(&mesh.b, &id, "sender host mismatch");
    // The owner fixes the name: received, and hosta's row settles by its delivery receipt.
    mesh.b
        .home
        .run(&["peers", "remove", "othername"])
        .assert_success();
    mesh.b
        .home
        .run(&["peers", "add", "hosta", &a_key])
        .assert_success();
    wait_for(&format!("{id} in bob@hostb's inbox"), || {
        mesh.b.inbox_ids("bob").contains(&id).then_some(())
    });
    assert_eq!(quarantine_reason(&mesh.b, &id), None, "out of quarantine");
    assert_eq!(mesh.b.deliveries_of(&id), 1);
    wait_for("hosta's row settled by hostb's receipt", || {
        mesh.a.outbox(&id).filter(|r| r.state == "delivered")
    });
}
