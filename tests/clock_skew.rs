//! A clock skew fixed on a running system, with real processes (case
//! `clock-fix-does-not-release-mail`): `agentmbx relay serve` and two relay-only daemons that pin
//! each other and the relay. `hosta` starts with its clock 10 minutes ahead
//! (`MBX_CLOCK_OFFSET_MS=600000`): the relay refuses its skewed hops, and mail it queues waits.
//! Restarted without the offset (the clock fixed), the queued mail is due at once — pushed and
//! delivered within the global 30 s poll, far less than the 10 min skew it would otherwise wait
//! out — and `sent` lists the messages in the order they were sent, not by the skewed times.

use crate::helper::mesh::Mesh;
use crate::helper::wait_for;

/// The real time (ms since the epoch).
fn now_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .expect("after 1970")
        .as_millis() as i64
}

/// The skew of `hosta`'s clock (ms): 10 minutes ahead, twice the relay's ±5 min hop window.
const SKEW_MS: &str = "600000";

#[test]
fn mail_queued_while_the_clock_was_ahead_goes_at_once_after_the_fix() {
    let mut mesh = Mesh::configured(None);
    mesh.b.start(None);
    mesh.b.daemon().wait_for_stderr("published the enc-key ad");
    mesh.a.start_with(&[("MBX_CLOCK_OFFSET_MS", SKEW_MS)]);
    // The relay refuses the skewed hops, and says why.
    mesh.a.daemon().wait_for_stderr("clock-skew");

    let sent = mesh
        .a
        .send("alice", "bob@hostb", "during the skew", "the body");
    let skewed_id = sent["id"].as_str().expect("id").to_string();
    let row = mesh.a.outbox(&skewed_id).expect("queued");
    assert_eq!(row.state, "pending", "{row:?}");
    let next_at: i64 = mesh
        .a
        .db()
        .query_row(
            "SELECT next_at FROM outbox WHERE msg_id = ?1",
            [&skewed_id],
            |r| r.get(0),
        )
        .unwrap();
    let ahead = next_at - now_ms();
    assert!(
        ahead > 300_000,
        "scheduled by the skewed clock: {ahead} ms ahead"
    );

    // The clock is fixed: the row is pushed and delivered without waiting out the skew.
    mesh.a.stop();
    mesh.a.start(None);
    let row = mesh.a.wait_relay_accepted(&skewed_id);
    assert!(row.seq.is_some(), "{row:?}");
    wait_for("bob@hostb to have the message", || {
        (mesh.b.messages_with_id(&skewed_id) == 1).then_some(())
    });

    // `sent` lists by the order this host stored the messages, not by the skewed send time.
    let later = mesh
        .a
        .send("alice", "bob@hostb", "after the fix", "the body");
    let later_id = later["id"].as_str().expect("id").to_string();
    let page = mesh.a.api("GET", "/v1/sent?as=alice", None);
    assert_eq!(page.status, 200, "{page:#?}");
    let ids: Vec<String> = page.json()["messages"]
        .as_array()
        .expect("messages")
        .iter()
        .map(|m| m["id"].as_str().expect("id").to_string())
        .collect();
    assert_eq!(ids, vec![later_id, skewed_id], "newest first");
}
