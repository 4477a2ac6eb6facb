//! Host key rotation end to end (`wire.md` §2.10, §3.2 "Rotation"; spec §2 "Rotation"), with
//! real child processes: `agentmbx relay serve` and two `agentmbx daemon`s paired over the LAN
//! (127.0.0.1, fixed LAN ports so a restarted daemon is found where it was pinned). `hosta`
//! rotates its keys with `agentmbx host rotate` while its daemon is stopped; when it is back,
//! `hostb` takes the rotation over the LAN (`POST /v1/rotate`) and keeps the old key for
//! verification, the relay moves `hosta`'s queue to the new key, and mail sealed or signed
//! before the rotation still arrives, once.
//!
//! State is read from the stores themselves (read-only) and through the CLI and the local API.

use crate::helper::mesh::{free_port, unique_tag, Host, Relay};
use crate::helper::wait_for;
use agentmbx_protocol::keys::PublicKey;
use serde_json::Value;

/// Waits until `host`'s agent `agent` has message `id` in its inbox.
fn wait_inbox(host: &Host, agent: &str, id: &str) {
    wait_for(&format!("{id} in {agent}@{}'s inbox", host.name), || {
        host.inbox_ids(agent).iter().any(|i| i == id).then_some(())
    });
}

fn fingerprint(b64: &str) -> String {
    PublicKey::from_b64(b64).expect("a host key").fingerprint()
}

/// `(host_pubkey, enc_pub)` from `agentmbx whoami --json`.
fn keys_of(host: &Host) -> (String, String) {
    let out = host.home.run(&["whoami", "--json"]);
    out.assert_success();
    let who = out.json();
    (
        who["host_pubkey"]
            .as_str()
            .expect("host_pubkey")
            .to_string(),
        who["enc_pub"].as_str().expect("enc_pub").to_string(),
    )
}

/// The key `host` pins for peer `peer`.
fn pinned(host: &Host, peer: &str) -> Option<String> {
    host.db()
        .query_row("SELECT pubkey FROM peers WHERE host = ?1", [peer], |r| {
            r.get(0)
        })
        .ok()
}

/// The sender allowlist the relay holds for `target`: the keys in the target's own signed
/// record (only the target can have written them).
fn allowlist(relay: &Relay, target: &str) -> Option<Vec<String>> {
    let record: String = relay
        .db()
        .query_row(
            "SELECT record FROM sender_lists WHERE target_pubkey = ?1",
            [target],
            |r| r.get(0),
        )
        .ok()?;
    let record: Value = serde_json::from_str(&record).ok()?;
    Some(
        record["senders"]
            .as_array()?
            .iter()
            .filter_map(|s| s.as_str().map(str::to_string))
            .collect(),
    )
}

/// The state of `host`'s outbox row for message `id`.
fn outbox_state(host: &Host, id: &str) -> Option<String> {
    host.outbox(id).map(|r| r.state)
}

#[test]
fn a_rotated_host_keeps_its_pairing_its_queued_mail_and_its_place_at_the_relay() {
    let mut relay = Relay::start(None);
    let mut a = Host::init("hosta");
    let mut b = Host::init("hostb");
    a.register("alice");
    b.register("bob");
    for host in [&a, &b] {
        host.home
            .run(&["relay", "set", &relay.url(), "--key", &relay.fingerprint])
            .assert_success();
    }
    let (a_port, b_port) = (free_port().to_string(), free_port().to_string());
    let a_env = [("MBX_LAN_PORT", a_port.as_str())];
    let b_env = [("MBX_LAN_PORT", b_port.as_str())];
    a.start_with(&a_env);
    b.start_with(&b_env);
    a.pair_with(&b);
    let (old_pub, old_enc) = keys_of(&a);
    assert_eq!(old_pub, a.pubkey);
    // Each host's allowlist at the relay names the other (they were paired): relay pushes
    // between them are accepted.
    wait_for("both allowlists at the relay to name the peer", || {
        let a_ok = allowlist(&relay, &a.pubkey).is_some_and(|l| l.contains(&b.pubkey));
        let b_ok = allowlist(&relay, &b.pubkey).is_some_and(|l| l.contains(&old_pub));
        (a_ok && b_ok).then_some(())
    });

    // Before the rotation: A → B over the LAN.
    let before = a.send("alice", "bob@hostb", "before", "from the old key");
    let before = before["id"].as_str().expect("id").to_string();
    wait_inbox(&b, "bob", &before);

    // A is away: B's mail for A goes to the relay, sealed for A's old enc key and queued for
    // A's old host key.
    a.stop();
    let tag = unique_tag();
    let queued_body = format!("sealed for the old enc key {tag}");
    let queued = b.send("bob", "alice@hosta", "while you rotate", &queued_body);
    let queued = queued["id"].as_str().expect("id").to_string();
    b.wait_relay_accepted(&queued);
    assert_eq!(
        relay
            .items_for(&old_pub)
            .iter()
            .filter(|(_, id)| id == &queued)
            .count(),
        1,
        "queued for A's old key"
    );

    // B is away too, and the relay is down: A (still on its old key) signs and seals mail for
    // B that can go nowhere; its wire bytes are persisted, signed by the old key.
    b.stop();
    relay.kill();
    a.start_with(&a_env);
    let signed_before = a.send("alice", "bob@hostb", "signed before", "by the old key");
    let signed_before = signed_before["id"].as_str().expect("id").to_string();
    wait_for("A to persist the wire bytes signed by its old key", || {
        a.outbox(&signed_before).and_then(|r| r.wire)
    });
    a.stop();

    // The rotation, on the stopped daemon's home.
    let out = a.home.run(&["host", "rotate", "--json"]);
    out.assert_success();
    let (new_pub, new_enc) = keys_of(&a);
    assert_ne!(new_pub, old_pub, "a new host key");
    assert_ne!(new_enc, old_enc, "a new enc key");
    a.pubkey = new_pub.clone();

    // Everything comes back; A announces its rotation to B over the LAN and to the relay.
    relay.launch(None);
    b.start_with(&b_env);
    a.start_with(&a_env);

    // B takes the rotation: the pin moves, the old key is kept for verification.
    wait_for("B to pin A's new key", || {
        (pinned(&b, "hosta").as_deref() == Some(new_pub.as_str())).then_some(())
    });
    let out = b.home.run(&["peers", "--json"]);
    out.assert_success();
    let list = out.json();
    let hosta = list
        .as_array()
        .and_then(|l| l.iter().find(|p| p["host"] == "hosta"))
        .unwrap_or_else(|| panic!("hosta pinned on B: {list}"))
        .clone();
    assert_eq!(hosta["pubkey"], new_pub.as_str(), "{hosta}");
    assert_eq!(hosta["enc_pub"], new_enc.as_str(), "{hosta}");
    assert_eq!(
        hosta["prev_keys"],
        serde_json::json!([fingerprint(&old_pub)]),
        "{hosta}"
    );
    let audited: i64 = b
        .db()
        .query_row(
            "SELECT COUNT(*) FROM audit WHERE event = 'peer.rotated'",
            [],
            |r| r.get(0),
        )
        .expect("audit");
    assert_eq!(audited, 1);

    // Through the relay: the item queued for A's old key moved to the new key, and A, which
    // now holds the new keys, opened it with its retired enc key, once.
    wait_inbox(&a, "alice", &queued);
    assert_eq!(a.read(&queued, "alice")["body"], queued_body.as_str());
    assert_eq!(a.messages_with_id(&queued), 1);
    wait_for("the relay queues for A to drain", || {
        (relay.items_for(&old_pub).is_empty() && relay.items_for(&new_pub).is_empty()).then_some(())
    });
    assert_eq!(a.messages_with_id(&queued), 1, "received once");
    assert_eq!(a.quarantined(), 0);
    let old_revoked: Option<i64> = relay
        .db()
        .query_row(
            "SELECT revoked_at FROM enrolments WHERE host_pubkey = ?1",
            [&old_pub],
            |r| r.get(0),
        )
        .expect("the old key's enrolment");
    assert!(old_revoked.is_some(), "the relay revoked the old key");
    // B's relay-accepted row is settled by A's receipt.
    wait_for("B's row for the queued mail to be delivered", || {
        (outbox_state(&b, &queued).as_deref() == Some("delivered")).then_some(())
    });

    // Mail A signed with its old key before the rotation reaches B once, verified with the key
    // B keeps for A (whichever transport carried it).
    wait_inbox(&b, "bob", &signed_before);
    assert_eq!(b.messages_with_id(&signed_before), 1);
    assert_eq!(b.read(&signed_before, "bob")["from"], "alice@hosta");

    // Mail flows both ways with the new keys.
    let ab = a.send("alice", "bob@hostb", "after", "from the new key");
    let ab = ab["id"].as_str().expect("id").to_string();
    wait_inbox(&b, "bob", &ab);
    assert_eq!(b.read(&ab, "bob")["body"], "from the new key");
    let ba = b.send("bob", "alice@hosta", "after, back", "to the new key");
    let ba = ba["id"].as_str().expect("id").to_string();
    wait_inbox(&a, "alice", &ba);
    assert_eq!(a.read(&ba, "alice")["body"], "to the new key");
    for id in [&before, &signed_before, &ab] {
        assert_eq!(b.messages_with_id(id), 1, "{id} on B");
    }
    for id in [&queued, &ba] {
        assert_eq!(a.messages_with_id(id), 1, "{id} on A");
    }

    // A's enc-key ad at the relay names the new enc key under the new host key.
    wait_for("A's enc-key ad at the relay to be the new one", || {
        let enc: Option<String> = relay
            .db()
            .query_row(
                "SELECT enc_pub FROM enc_ad_records WHERE host_pubkey = ?1",
                [&new_pub],
                |r| r.get(0),
            )
            .ok();
        (enc.as_deref() == Some(new_enc.as_str())).then_some(())
    });
    // B's allowlist at the relay, signed by B, names A's new key (republished after the pin
    // moved) and no longer the old one.
    wait_for("B's allowlist to name A's new key", || {
        allowlist(&relay, &b.pubkey)
            .filter(|l| l.contains(&new_pub) && !l.contains(&old_pub))
            .map(|_| ())
    });
}
