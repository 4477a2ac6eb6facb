//! Two real daemons on one machine exchanging mail over the LAN (`wire.md` §2.5, §2.9, §2.11,
//! §4; spec §9–§10), each an `agentmbx daemon` child process with its LAN server on 127.0.0.1:
//! pairing with one command on each side, mail both ways, delivery receipts back to the sender,
//! a peer that was down, the relay fallback after two LAN failures, and the LAN server's
//! refusals (each with its exact reason, and nothing stored).

use crate::helper;

use crate::helper::mesh::{free_port, Host, Relay};
use crate::helper::{request, wait_for, HttpResponse};
use agentmbx_protocol::envelope::{self, Draft};
use agentmbx_protocol::hop::sign_lan_hop;
use agentmbx_protocol::keys::{EncPublicKey, HostKey};
use agentmbx_protocol::{seal, ulid};
use serde_json::{json, Value};

/// Waits until `host`'s agent `agent` has message `id` in its inbox.
fn wait_inbox(host: &Host, agent: &str, id: &str) {
    wait_for(&format!("{id} in {agent}@{}'s inbox", host.name), || {
        host.inbox_ids(agent).iter().any(|i| i == id).then_some(())
    });
}

/// The newest receipt state `host` holds for (`id`, `recipient`).
fn receipt_state(host: &Host, id: &str, recipient: &str) -> Option<String> {
    host.db()
        .query_row(
            "SELECT state FROM remote_receipts WHERE msg_id = ?1 AND recipient = ?2",
            [id, recipient],
            |r| r.get(0),
        )
        .ok()
}

/// `(state, via, lan_failures)` of `host`'s outbox row for `id`.
fn outbox_route(host: &Host, id: &str) -> (String, Option<String>, i64) {
    host.db()
        .query_row(
            "SELECT state, via, lan_failures FROM outbox WHERE msg_id = ?1",
            [id],
            |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)),
        )
        .expect("outbox row")
}

/// Two initialized hosts with running daemons, paired over the LAN (A holds the token).
fn paired() -> (Host, Host) {
    let mut a = Host::init("hosta");
    let mut b = Host::init("hostb");
    a.register("alice");
    b.register("bob");
    a.start(None);
    b.start(None);
    a.pair_with(&b);
    (a, b)
}

#[test]
fn paired_daemons_exchange_mail_both_ways_and_receipts_reach_the_sender() {
    let (a, b) = paired();
    // Each side pinned the other's key, with the LAN address it really serves.
    let a_peers = a.home.run(&["peers", "--json"]);
    a_peers.assert_success();
    let list = a_peers.json();
    let hostb = list
        .as_array()
        .and_then(|l| l.iter().find(|p| p["host"] == "hostb"))
        .unwrap_or_else(|| panic!("hostb pinned on A: {list}"));
    assert_eq!(hostb["pubkey"], b.pubkey.as_str());
    assert_eq!(hostb["addr"], b.lan_addr().to_string().as_str());

    let sent = a.send("alice", "bob@hostb", "over the LAN", "hello bob");
    let id = sent["id"].as_str().expect("id").to_string();
    wait_inbox(&b, "bob", &id);
    let read = b.read(&id, "bob");
    assert_eq!(read["body"], "hello bob");
    assert_eq!(read["from"], "alice@hosta");
    let back = b.send("bob", "alice@hosta", "and back", "hello alice");
    let back_id = back["id"].as_str().expect("id").to_string();
    wait_inbox(&a, "alice", &back_id);
    assert_eq!(a.read(&back_id, "alice")["body"], "hello alice");
    assert_eq!(a.messages_with_id(&id), 1);
    assert_eq!(b.messages_with_id(&id), 1);

    // The row went over the LAN and was settled by the peer's verdict.
    let (state, via, lan_failures) = outbox_route(&a, &id);
    assert_eq!(
        (state.as_str(), via.as_deref(), lan_failures),
        ("delivered", Some("lan"), 0)
    );

    // Receipts: read (B read it above), then acked, reach A in rank order.
    wait_for("A to hold bob's read receipt", || {
        (receipt_state(&a, &id, "bob@hostb").as_deref() == Some("read")).then_some(())
    });
    b.ack("bob", &[&id]);
    wait_for("A to hold bob's acked receipt", || {
        (receipt_state(&a, &id, "bob@hostb").as_deref() == Some("acked")).then_some(())
    });
    let out = a.home.run(&["sent", "--as", "alice", "--json"]);
    out.assert_success();
    let text = out.json().to_string();
    assert!(text.contains(&id) && text.contains("acked"), "{text}");
}

/// Issue 19 (3): mail that arrives over the LAN is searchable by its recipient as soon as it
/// is in the inbox (the index is written in the receive transaction, from the opened body),
/// and the sender finds its own copy.
#[test]
fn mail_arriving_over_the_lan_is_found_by_search_at_once() {
    let (a, b) = paired();
    let sent = a.send(
        "alice",
        "bob@hostb",
        "field report",
        "the okapi was sighted at dawn",
    );
    let id = sent["id"].as_str().expect("id").to_string();
    wait_inbox(&b, "bob", &id);
    let search = |host: &Host, agent: &str, words: &str| -> Vec<String> {
        let out = host.home.run(&["search", words, "--as", agent, "--json"]);
        out.assert_success();
        out.json()["messages"]
            .as_array()
            .expect("messages")
            .iter()
            .map(|m| m["id"].as_str().expect("id").to_string())
            .collect()
    };
    assert_eq!(search(&b, "bob", "okapi dawn"), vec![id.clone()]);
    assert_eq!(search(&b, "bob", "field"), vec![id.clone()]);
    assert_eq!(search(&a, "alice", "okapi"), vec![id]);
}

#[test]
fn mail_to_a_stopped_peer_waits_and_arrives_once_it_is_back() {
    let mut a = Host::init("hosta");
    let mut b = Host::init("hostb");
    b.register("bob");
    let b_port = free_port().to_string();
    a.start(None);
    b.start_with(&[("MBX_LAN_PORT", b_port.as_str())]);
    a.pair_with(&b);
    b.stop();

    let sent = a.send("alice", "bob@hostb", "while you were out", "still here");
    let id = sent["id"].as_str().expect("id").to_string();
    wait_for("A's first failed LAN attempt", || {
        let (state, _, lan_failures) = outbox_route(&a, &id);
        (state == "pending" && lan_failures >= 1).then_some(())
    });
    b.start_with(&[("MBX_LAN_PORT", b_port.as_str())]);
    wait_inbox(&b, "bob", &id);
    assert_eq!(b.messages_with_id(&id), 1);
    assert_eq!(b.deliveries_of(&id), 1);
    wait_for("A's row delivered over the LAN", || {
        let (state, via, _) = outbox_route(&a, &id);
        (state == "delivered" && via.as_deref() == Some("lan")).then_some(())
    });
}

#[test]
fn a_peer_unreachable_on_the_lan_gets_its_mail_through_the_relay_once() {
    let relay = Relay::start(None);
    let mut a = Host::init("hosta");
    let mut b = Host::init("hostb");
    b.register("bob");
    for host in [&a, &b] {
        host.home
            .run(&["relay", "set", &relay.url(), "--key", &relay.fingerprint])
            .assert_success();
    }
    a.start(None);
    // B signs an address where nothing listens, so A cannot heal its way back to B's LAN port.
    b.start_with(&[("MBX_SELF_ADDRS", "127.0.0.9")]);
    for host in [&mut a, &mut b] {
        host.daemon().wait_for_stderr("published the enc-key ad");
    }
    a.pair_with(&b);
    let dead = format!("127.0.0.1:{}", free_port());
    a.home
        .run(&["peers", "addr", "hostb", &dead, "--force"])
        .assert_success();

    let sent = a.send("alice", "bob@hostb", "via the relay", "the LAN is down");
    let id = sent["id"].as_str().expect("id").to_string();
    // B's daemon learns of the pairing its CLI committed from its store check (every 30 s
    // while its push stream is up), then publishes the allowlist; A's push is retried after.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(90);
    while !b.inbox_ids("bob").iter().any(|i| i == &id) {
        if std::time::Instant::now() >= deadline {
            panic!("not at B within 90 s\nA:\n{}\nB:\n{}", a.log(), b.log());
        }
        std::thread::sleep(helper::POLL);
    }
    assert_eq!(b.messages_with_id(&id), 1);
    assert_eq!(b.deliveries_of(&id), 1);
    let (_, via, lan_failures) = outbox_route(&a, &id);
    // A refused connection is an unreachable address (spec §10): one failure marks the peer
    // and its mail moves to the relay at once.
    assert_eq!(
        lan_failures, 1,
        "moved to the relay after one refused attempt"
    );
    let reason: Option<String> = a
        .db()
        .query_row(
            "SELECT lan_down_reason FROM peers WHERE host = 'hostb'",
            [],
            |r| r.get(0),
        )
        .expect("peer row");
    assert_eq!(reason.as_deref(), Some("refused"));
    assert_eq!(via.as_deref(), Some("relay"));
    // The delivered receipt (over the LAN: A is reachable) settles the relay-accepted row.
    wait_for("A's relay-accepted row settled by the receipt", || {
        (outbox_route(&a, &id).0 == "delivered").then_some(())
    });
    wait_for("the relay queue for B to drain", || {
        relay.items_for(&b.pubkey).is_empty().then_some(())
    });
    assert_eq!(b.messages_with_id(&id), 1, "stored once, not again");
}

/// A host key the test controls, pinned on `b` as peer `rogue`.
struct Rogue {
    key: HostKey,
    ids: ulid::Generator,
}

impl Rogue {
    fn pinned_on(b: &Host) -> Rogue {
        let key = HostKey::generate();
        b.home
            .run(&["peers", "add", "rogue", &key.public().to_b64()])
            .assert_success();
        Rogue {
            key,
            ids: ulid::Generator::new(),
        }
    }

    /// A sealed, signed envelope from `from` to bob@hostb, as JSON.
    fn envelope(&mut self, b_enc: &EncPublicKey, from: &str) -> Value {
        let now = now_ms();
        let draft = Draft {
            from: from.into(),
            to: vec!["bob@hostb".into()],
            subject: "probe".into(),
            body: "secret".into(),
            kind: None,
            thread: None,
            reply_to: None,
            needs_reply: false,
            refs: vec![],
        };
        let id = self.ids.next(now);
        let plain = envelope::build(&draft, id, now).expect("build");
        let sealed = seal::seal_envelope(&plain, b_enc, "rogue", &self.key).expect("seal");
        serde_json::from_str(&sealed.wire_json()).expect("wire JSON")
    }
}

fn now_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .expect("clock")
        .as_millis() as i64
}

/// POSTs `body` to `path` on `b`'s LAN server with a hop signed by `key` as `host`.
fn lan_post(b: &Host, key: &HostKey, host: &str, path: &str, body: &str) -> HttpResponse {
    let hop = sign_lan_hop(key, host, 7373, "POST", path, now_ms(), body.as_bytes());
    let port = hop.port.to_string();
    request(
        b.lan_addr(),
        "POST",
        path,
        None,
        &[
            ("x-mbx-host", hop.host.as_str()),
            ("x-mbx-ts", hop.ts.as_str()),
            ("x-mbx-sig", hop.sig.as_str()),
            ("x-mbx-port", port.as_str()),
        ],
        Some(body),
    )
}

fn results(r: &HttpResponse) -> Vec<String> {
    assert_eq!(r.status, 200, "{r:#?}");
    r.json()["results"]
        .as_array()
        .expect("results")
        .iter()
        .map(|x| x["result"].as_str().expect("result").to_string())
        .collect()
}

#[test]
fn the_lan_server_refuses_forged_mail_with_the_exact_reason_and_stores_nothing() {
    let mut b = Host::init("hostb");
    b.register("bob");
    b.start(None);
    let who = b.home.run(&["whoami", "--json"]);
    who.assert_success();
    let b_enc =
        EncPublicKey::from_b64(who.json()["enc_pub"].as_str().expect("enc_pub")).expect("enc");
    let mut rogue = Rogue::pinned_on(&b);
    let post = |key: &HostKey, host: &str, envs: &[Value]| {
        let body = json!({ "envelopes": envs }).to_string();
        lan_post(&b, key, host, "/v2/envelopes", &body)
    };

    // A tampered body: the ciphertext no longer matches the host signature.
    let mut tampered = rogue.envelope(&b_enc, "eve@rogue");
    let ct = tampered["body"].as_str().expect("body").to_string();
    let flipped = format!(
        "{}{}",
        if ct.starts_with('A') { "B" } else { "A" },
        &ct[1..]
    );
    tampered["body"] = json!(flipped);
    tampered["enc"]["body"] = json!(flipped);
    // `from` with a newline, and with a second `@`, each correctly signed by the rogue host.
    let newline = rogue.envelope(&b_enc, "eve\n@rogue");
    let two_ats = rogue.envelope(&b_enc, "eve@x@rogue");
    // Signed by the rogue host, but claiming to be from another host's agent.
    let foreign = rogue.envelope(&b_enc, "ann@hosta");
    let r = post(&rogue.key, "rogue", &[tampered, newline, two_ats, foreign]);
    assert_eq!(
        results(&r),
        vec![
            "rejected:bad signature",
            "rejected:bad sender address",
            "rejected:bad sender address",
            "rejected:sender host mismatch",
        ]
    );

    // The hop itself: signed by a key that is not the pinned one, or from an unpaired host.
    let good = rogue.envelope(&b_enc, "eve@rogue");
    let r = post(&HostKey::generate(), "rogue", std::slice::from_ref(&good));
    assert_eq!(
        (r.status, r.json()["error"].clone()),
        (401, json!("bad hop signature"))
    );
    let r = post(
        &HostKey::generate(),
        "stranger",
        std::slice::from_ref(&good),
    );
    assert_eq!(
        (r.status, r.json()["error"].clone()),
        (401, json!("host not paired"))
    );
    assert_eq!(b.message_count(), 0, "nothing was stored");

    // The control: the same envelope with a good hop is accepted, once.
    let r = post(&rogue.key, "rogue", std::slice::from_ref(&good));
    assert_eq!(results(&r), vec!["accepted"]);
    let r = post(&rogue.key, "rogue", std::slice::from_ref(&good));
    assert_eq!(results(&r), vec!["duplicate"]);
    assert_eq!(b.message_count(), 1);
}
