//! HTTP-level tests of the relay (spec §1–§4, §7; `wire.md` §2.6, §3.1, §3.2, "Resolved
//! details"): the real router and `server::serve` on 127.0.0.1 port 0, a fresh SQLite store per
//! test, a manual clock, and a client that signs v2 hops. Every assertion is on what goes over
//! the wire: status codes, exact error texts and codes, per-item statuses, and what a later pull
//! shows.
#![allow(clippy::unwrap_used)] // Tests may unwrap (clippy.toml); the helpers use `expect`.

use serde_json::{json, Value};

use agentmbx_protocol::b64;
use agentmbx_protocol::hop::header;
use agentmbx_protocol::keys::HostKey;
use agentmbx_protocol::limits::{MAX_ITEM_BYTES, RELAY_MAX_BODY, RELAY_SMALL_BODY};
use agentmbx_protocol::records::{self, AcceptError, MAX_SAFE_INT};
use agentmbx_protocol::time::iso_ms;

use agentmbx_relay::config::LimitsConfig;
use agentmbx_relay::store::SenderList;

use crate::helper::*;

/// Two enrolled hosts on a fresh relay: `alpha` (sender) and `beta` (target).
async fn two_hosts(relay: &Relay) -> (Host, Host) {
    let (a, b) = (Host::new("alpha"), Host::new("beta"));
    relay.enrol(&a).await;
    relay.enrol(&b).await;
    (a, b)
}

/// Pushes one fresh sealed envelope from `from` to `to`; asserts it is accepted and returns
/// `(item id, wire, seq)`.
async fn push_one(relay: &Relay, from: &Host, to: &Host, body: &str) -> (String, String, i64) {
    let (id, wire) = sealed_wire(from, to, body, relay.now());
    let r = relay.push(from, vec![env_item(&id, to, &wire)]).await;
    assert_eq!(r.status1(), "accepted", "{r:#?}");
    let seq = r.json["results"][0]["targets"][0]["seq"].as_i64().unwrap();
    (id, wire, seq)
}

fn limits(f: impl FnOnce(&mut LimitsConfig)) -> LimitsConfig {
    let mut l = LimitsConfig::default();
    f(&mut l);
    l
}

/// Replaces (or removes, with `None`) one header of a header list.
fn with_header(
    mut headers: Vec<(String, String)>,
    name: &str,
    value: Option<&str>,
) -> Vec<(String, String)> {
    headers.retain(|(k, _)| k != name);
    if let Some(v) = value {
        headers.push((name.to_owned(), v.to_owned()));
    }
    headers
}

// ---- push ------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn push_accepted_carries_a_verifiable_accept_statement() {
    let relay = Relay::start().await;
    let (a, b) = two_hosts(&relay).await;
    let (id, wire) = sealed_wire(&a, &b, "hello beta", relay.now());
    let r = relay.push(&a, vec![env_item(&id, &b, &wire)]).await;
    let res = &r.assert_ok()["results"][0];
    assert_eq!(res["status"], "accepted");
    assert_eq!(res["item_id"], id.as_str());
    assert_eq!(
        res["targets"],
        json!([{"host_pubkey": b.pubkey(), "seq": T0}])
    );
    let sig = res["sig"].as_str().unwrap();
    let hash = wire_hash(wire.as_bytes());
    let st = records::verify_accept(
        &res["accept"],
        sig,
        &relay.relay_pub,
        &a.pubkey(),
        &id,
        &b.pubkey(),
        &hash,
    )
    .expect("the accept statement verifies against the relay key");
    assert_eq!(st.kind, "relay-accept");
    assert_eq!(st.epoch, relay.epoch().await);
    assert_eq!(st.at, iso_ms(T0));
    assert_eq!(st.targets.len(), 1);
    assert_eq!(st.targets[0].seq, T0);
    // Another key, or another wire hash, does not settle the row.
    let other = HostKey::generate().public();
    let not_relay = records::verify_accept(
        &res["accept"],
        sig,
        &other,
        &a.pubkey(),
        &id,
        &b.pubkey(),
        &hash,
    );
    assert_eq!(not_relay, Err(AcceptError::BadSignature));
    let wrong_hash = records::verify_accept(
        &res["accept"],
        sig,
        &relay.relay_pub,
        &a.pubkey(),
        &id,
        &b.pubkey(),
        &wire_hash(b"other"),
    );
    assert_eq!(wrong_hash, Err(AcceptError::WrongTarget));

    // The target pulls the exact bytes.
    let p = relay.pull(&b, "after=0").await;
    let page = p.assert_ok();
    assert_eq!(page["head_seq"], T0);
    assert_eq!(page["last_seq"], T0);
    assert_eq!(page["more"], false);
    assert_eq!(
        page["items"],
        json!([{
            "seq": T0,
            "kind": "envelope",
            "item_id": id,
            "sender_pubkey": a.pubkey(),
            "wire_b64": b64::encode(wire.as_bytes()),
        }])
    );
    relay.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn push_same_bytes_again_is_a_duplicate_with_the_original_seq_and_at() {
    let relay = Relay::start().await;
    let (a, b) = two_hosts(&relay).await;
    let (id, wire, seq) = push_one(&relay, &a, &b, "once").await;
    relay.clock.advance(90_000);
    let r = relay.push(&a, vec![env_item(&id, &b, &wire)]).await;
    let res = &r.assert_ok()["results"][0];
    assert_eq!(res["status"], "duplicate");
    assert_eq!(
        res["targets"],
        json!([{"host_pubkey": b.pubkey(), "seq": seq}])
    );
    let st = records::verify_accept(
        &res["accept"],
        res["sig"].as_str().unwrap(),
        &relay.relay_pub,
        &a.pubkey(),
        &id,
        &b.pubkey(),
        &wire_hash(wire.as_bytes()),
    )
    .expect("a duplicate carries a valid accept");
    assert_eq!(st.at, iso_ms(T0), "a retry never moves the accept time");
    assert_eq!(st.targets[0].seq, seq);
    // Still one item in the queue.
    assert_eq!(relay.queue_ids(&b).await, vec![id]);
    relay.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn push_other_bytes_under_the_same_id_is_a_conflict_and_changes_nothing() {
    let relay = Relay::start().await;
    let (a, b) = two_hosts(&relay).await;
    let plain = plain_envelope(&a, &b, "sealed twice", relay.now());
    let seal = |p: &agentmbx_protocol::envelope::Envelope| {
        agentmbx_protocol::seal::seal_envelope(p, &b.enc.public(), &a.name, &a.key)
            .unwrap()
            .wire_json()
    };
    let (first, second) = (seal(&plain), seal(&plain));
    assert_ne!(
        first, second,
        "two seals differ (fresh ephemeral key and nonce)"
    );
    let r = relay.push(&a, vec![env_item(&plain.id, &b, &first)]).await;
    assert_eq!(r.status1(), "accepted");
    relay.clock.advance(1_000);
    let r = relay.push(&a, vec![env_item(&plain.id, &b, &second)]).await;
    let res = &r.assert_ok()["results"][0];
    assert_eq!(res["status"], "rejected:conflict");
    assert_eq!(res["targets"], json!([]));
    assert!(
        res.get("accept").is_none() && res.get("sig").is_none(),
        "{res}"
    );
    let p = relay.pull(&b, "after=0").await;
    let page = p.assert_ok();
    assert_eq!(
        page["head_seq"], T0,
        "no seq was allocated for the conflict"
    );
    assert_eq!(page["items"].as_array().unwrap().len(), 1);
    assert_eq!(page["items"][0]["wire_b64"], b64::encode(first.as_bytes()));
    relay.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn push_fan_out_is_all_or_nothing() {
    let relay = Relay::start_with(limits(|l| l.max_queue_items = 1)).await;
    let (a, b) = two_hosts(&relay).await;
    let c = Host::new("gamma");
    let (id, wire) = sealed_wire(&a, &b, "to two hosts", relay.now());
    // The second target is not enrolled: nothing is stored for the first.
    let two = item(
        "envelope",
        &id,
        &[(&b, wire.as_bytes()), (&c, wire.as_bytes())],
    );
    let r = relay.push(&a, vec![two.clone()]).await;
    assert_eq!(r.status1(), "rejected:target not enrolled");
    let p = relay.pull(&b, "after=0").await;
    assert_eq!(p.assert_ok()["items"], json!([]));
    assert_eq!(p.json["head_seq"], 0);

    // The second target is enrolled but its queue is full (quota, decided in the store's
    // transaction): still nothing for the first target, and no seq burnt.
    relay.enrol(&c).await;
    let (cid, cwire) = sealed_wire(&a, &c, "fills gamma", relay.now());
    let r = relay.push(&a, vec![env_item(&cid, &c, &cwire)]).await;
    assert_eq!(r.status1(), "accepted");
    let r = relay.push(&a, vec![two.clone()]).await;
    assert_eq!(r.status1(), "rejected:quota:queue depth exceeded for gamma");
    let p = relay.pull(&b, "after=0").await;
    assert_eq!(p.assert_ok()["items"], json!([]));
    assert_eq!(p.json["head_seq"], 0);

    // Once gamma acked, the item goes to both, each with its own seq.
    let epoch = relay.epoch().await;
    relay.ack(&c, &epoch, json!(T0)).await.assert_ok();
    relay.clock.advance(10);
    let r = relay.push(&a, vec![two]).await;
    let res = &r.assert_ok()["results"][0];
    assert_eq!(res["status"], "accepted");
    assert_eq!(
        res["targets"],
        json!([
            {"host_pubkey": b.pubkey(), "seq": T0 + 10},
            {"host_pubkey": c.pubkey(), "seq": T0 + 10},
        ])
    );
    relay.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn push_repeated_target_is_refused() {
    let relay = Relay::start().await;
    let (a, b) = two_hosts(&relay).await;
    let (id, wire) = sealed_wire(&a, &b, "twice to beta", relay.now());
    let r = relay
        .push(
            &a,
            vec![item(
                "envelope",
                &id,
                &[(&b, wire.as_bytes()), (&b, wire.as_bytes())],
            )],
        )
        .await;
    assert_eq!(r.status1(), "rejected:duplicate target");
    assert_eq!(relay.queue_ids(&b).await, Vec::<String>::new());
    relay.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn push_rejection_strings() {
    let relay = Relay::start().await;
    let (a, b) = two_hosts(&relay).await;
    let now = relay.now();
    let (id, wire) = sealed_wire(&a, &b, "valid", now);
    let w = wire.as_bytes();
    let env_value: Value = serde_json::from_str(&wire).unwrap();
    let mutated = |f: &dyn Fn(&mut Value)| {
        let mut v = env_value.clone();
        f(&mut v);
        v.to_string()
    };
    let plain = plain_envelope(&a, &b, "not sealed", now);
    let plain_wire = plain.wire_json();
    let (rid, rwire) = receipt_wire(&a, "01KDVDNA3VG2MH8KWSQRCWJZ0S", 7, now);
    let (rid_b, rwire_b) = receipt_wire(&b, "01KDVDNA3VG2MH8KWSQRCWJZ0S", 7, now);
    // A well-signed record that is not a T218 receipt (unknown state).
    let bad_state = {
        let mut rec = receipt(&a, "01KDVDNA3VG2MH8KWSQRCWJZ0S", 8, now);
        rec.state = "opened".into();
        rec.wire(&a.key).unwrap()
    };
    let extra_field = {
        let mut v: Value = serde_json::from_str(&rwire).unwrap();
        v["rec"]["extra"] = json!(1);
        v.to_string()
    };
    let x300 = "x".repeat(300);
    let x301 = "x".repeat(301);
    let e300 = "é".repeat(300); // 300 UTF-16 units, 600 bytes
    let astral150 = "😀".repeat(150); // 300 UTF-16 units
    let astral151 = "😀".repeat(151); // 302 UTF-16 units
    let other_id = new_id(now + 1);
    let raw = |kind: &str, item_id: &str, wire_b64: &str| {
        json!({"kind": kind, "item_id": item_id,
               "targets": [{"host_pubkey": b.pubkey(), "wire_b64": wire_b64}]})
    };
    let cases: Vec<(Value, String)> = vec![
        (env_item("", &b, &wire), "rejected:bad item id".into()),
        (env_item(&x301, &b, &wire), "rejected:bad item id".into()),
        (
            env_item(&astral151, &b, &wire),
            "rejected:bad item id".into(),
        ),
        // 300 units pass the id check and fail on the next one.
        (
            env_item(&x300, &b, &wire),
            "rejected:item id is not the envelope id".into(),
        ),
        (
            env_item(&e300, &b, &wire),
            "rejected:item id is not the envelope id".into(),
        ),
        (
            env_item(&astral150, &b, &wire),
            "rejected:item id is not the envelope id".into(),
        ),
        (item("message", &id, &[(&b, w)]), "rejected:bad kind".into()),
        (item("expired", &id, &[(&b, w)]), "rejected:bad kind".into()),
        (item("", &id, &[(&b, w)]), "rejected:bad kind".into()),
        (item("envelope", &id, &[]), "rejected:bad targets".into()),
        (raw("envelope", &id, "a-b_"), "rejected:bad wire".into()),
        (raw("envelope", &id, ""), "rejected:bad wire".into()),
        (raw("envelope", &id, "YQ==="), "rejected:bad wire".into()),
        (raw("envelope", &id, " YQ=="), "rejected:bad wire".into()),
        (raw("envelope", &id, "Y"), "rejected:bad wire".into()),
        // Base64 of bytes that are not JSON.
        (
            item("envelope", &id, &[(&b, b"{not json")]),
            "rejected:bad wire".into(),
        ),
        (
            item("receipt", &rid, &[(&b, b"\xff\xfe")]),
            "rejected:bad wire".into(),
        ),
        (
            env_item(&id, &b, &mutated(&|v| v["v"] = json!(2))),
            "rejected:bad envelope: unsupported version".into(),
        ),
        (
            env_item(&id, &b, &mutated(&|v| v["subject"] = json!("a\u{7}b"))),
            "rejected:bad envelope: subject contains control characters".into(),
        ),
        (
            env_item(
                &id,
                &b,
                &mutated(&|v| {
                    v.as_object_mut().unwrap().remove("enc");
                }),
            ),
            "rejected:bad envelope: bad enc".into(),
        ),
        (
            item("envelope", &id, &[(&b, b"[]")]),
            "rejected:bad envelope: not an object".into(),
        ),
        (
            env_item(&other_id, &b, &wire),
            "rejected:item id is not the envelope id".into(),
        ),
        (
            env_item(&plain.id, &b, &plain_wire),
            "rejected:envelope body is not sealed".into(),
        ),
        (
            item("receipt", &id, &[(&b, w)]),
            "rejected:bad receipt".into(),
        ),
        (
            item(
                "receipt",
                "receipt:01KDVDNA3VG2MH8KWSQRCWJZ0S:agent@alpha:8",
                &[(&b, bad_state.as_bytes())],
            ),
            "rejected:bad receipt".into(),
        ),
        (
            item("receipt", &rid, &[(&b, extra_field.as_bytes())]),
            "rejected:bad receipt".into(),
        ),
        (
            item("receipt", "receipt:x:y:1", &[(&b, rwire.as_bytes())]),
            "rejected:item id is not the receipt id".into(),
        ),
        (
            item("receipt", &rid_b, &[(&b, rwire_b.as_bytes())]),
            "rejected:receipt is not signed by the sending host".into(),
        ),
        // The valid ones, in the same batch.
        (env_item(&id, &b, &wire), "accepted".into()),
        (
            item("receipt", &rid, &[(&b, rwire.as_bytes())]),
            "accepted".into(),
        ),
    ];
    let (items, want): (Vec<Value>, Vec<String>) = cases.into_iter().unzip();
    let r = relay.push(&a, items.clone()).await;
    assert_eq!(r.statuses(), want, "{r:#?}");
    // Every result names the item id as pushed, in order; only accepted items carry an accept.
    for (res, it) in r.json["results"].as_array().unwrap().iter().zip(&items) {
        assert_eq!(res["item_id"], it["item_id"]);
        let accepted = res["status"] == "accepted";
        assert_eq!(res.get("accept").is_some(), accepted, "{res}");
        assert_eq!(res.get("sig").is_some(), accepted, "{res}");
    }
    assert_eq!(relay.queue_ids(&b).await, vec![id, rid]);
    relay.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn push_sender_not_accepted_by_target() {
    let relay = Relay::start().await;
    let (a, b) = two_hosts(&relay).await;
    let c = Host::new("gamma");
    relay.enrol(&c).await;
    // beta accepts only gamma (a sender list stored through the store; the route that
    // publishes one is not part of this relay yet).
    let list = SenderList {
        target_pubkey: b.pubkey(),
        senders: vec![c.pubkey()],
        iat_ms: relay.now(),
        record: "{}".into(),
        sig: "x".into(),
    };
    relay
        .with_store(move |s| s.put_sender_list(list).unwrap())
        .await;
    let (id, wire) = sealed_wire(&a, &b, "from alpha", relay.now());
    let r = relay.push(&a, vec![env_item(&id, &b, &wire)]).await;
    assert_eq!(r.status1(), "rejected:sender not accepted by target");
    let (id, wire) = sealed_wire(&c, &b, "from gamma", relay.now());
    let r = relay.push(&c, vec![env_item(&id, &b, &wire)]).await;
    assert_eq!(r.status1(), "accepted");
    assert_eq!(relay.queue_ids(&b).await, vec![id]);
    relay.stop().await;
}

/// beta accepts only `senders` from now on (a sender list stored through the store).
async fn only_accept(relay: &Relay, target: &Host, senders: &[&Host]) {
    let list = SenderList {
        target_pubkey: target.pubkey(),
        senders: senders.iter().map(|h| h.pubkey()).collect(),
        iat_ms: relay.now(),
        record: "{}".into(),
        sig: "x".into(),
    };
    relay
        .with_store(move |s| s.put_sender_list(list).unwrap())
        .await;
}

/// Asserts a single-item push answer is `status` for `(target, seq)` with a valid accept.
#[track_caller]
fn assert_settled(r: &Resp, relay: &Relay, from: &Host, id: &str, to: &Host, wire: &str) {
    let res = &r.assert_ok()["results"][0];
    records::verify_accept(
        &res["accept"],
        res["sig"].as_str().unwrap(),
        &relay.relay_pub,
        &from.pubkey(),
        id,
        &to.pubkey(),
        &wire_hash(wire.as_bytes()),
    )
    .expect("the answer carries a valid accept");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn push_retry_after_the_target_changed_its_allowlist_or_was_revoked_is_a_duplicate() {
    let relay = Relay::start().await;
    let (a, b) = two_hosts(&relay).await;
    let c = Host::new("gamma");
    relay.enrol(&c).await;
    let (id, wire, seq) = push_one(&relay, &a, &b, "accepted before the change").await;
    let dup = json!([{"host_pubkey": b.pubkey(), "seq": seq}]);

    // beta now accepts only gamma: the retry of the accepted item still settles.
    only_accept(&relay, &b, &[&c]).await;
    relay.clock.advance(1_000);
    let r = relay.push(&a, vec![env_item(&id, &b, &wire)]).await;
    assert_eq!(r.status1(), "duplicate", "{r:#?}");
    assert_eq!(r.json["results"][0]["targets"], dup);
    assert_settled(&r, &relay, &a, &id, &b, &wire);
    // Other bytes under that id: a conflict, not an allowlist refusal.
    let (_, other) = sealed_wire(&a, &b, "other bytes", relay.now());
    let other: Value = {
        let mut v: Value = serde_json::from_str(&other).unwrap();
        v["id"] = json!(id);
        v
    };
    let r = relay
        .push(&a, vec![env_item(&id, &b, &other.to_string())])
        .await;
    assert_eq!(r.status1(), "rejected:conflict");
    // A fresh item is refused.
    let (fresh, fresh_wire) = sealed_wire(&a, &b, "after the change", relay.now());
    let r = relay
        .push(&a, vec![env_item(&fresh, &b, &fresh_wire)])
        .await;
    assert_eq!(r.status1(), "rejected:sender not accepted by target");

    // beta is revoked: the retry still settles, with the original seq.
    relay.revoke(&b).await;
    let r = relay.push(&a, vec![env_item(&id, &b, &wire)]).await;
    assert_eq!(r.status1(), "duplicate", "{r:#?}");
    assert_eq!(r.json["results"][0]["targets"], dup);
    assert_settled(&r, &relay, &a, &id, &b, &wire);
    let r = relay
        .push(&a, vec![env_item(&fresh, &b, &fresh_wire)])
        .await;
    assert_eq!(r.status1(), "rejected:target not enrolled");

    // The same item widened to a fresh live target: stored for gamma, beta keeps its seq.
    let two = item(
        "envelope",
        &id,
        &[(&b, wire.as_bytes()), (&c, wire.as_bytes())],
    );
    let r = relay.push(&a, vec![two]).await;
    let res = &r.assert_ok()["results"][0];
    assert_eq!(res["status"], "accepted", "{r:#?}");
    assert_eq!(res["targets"][0], dup[0]);
    assert_eq!(res["targets"][1]["host_pubkey"], c.pubkey());
    assert_eq!(relay.queue_ids(&c).await, vec![id.clone()]);
    // …but a fresh target that is not enrolled still refuses the whole item.
    let d = Host::new("delta");
    let r = relay
        .push(
            &a,
            vec![item(
                "envelope",
                &id,
                &[(&b, wire.as_bytes()), (&d, wire.as_bytes())],
            )],
        )
        .await;
    assert_eq!(r.status1(), "rejected:target not enrolled");
    relay.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn push_two_faults_report_the_first_in_wire_md_order() {
    let relay = Relay::start_with(limits(|l| l.max_item_bytes = 4096)).await;
    let (a, b) = two_hosts(&relay).await;
    let c = Host::new("gamma");
    relay.enrol(&c).await;
    let d = Host::new("delta"); // never enrolled
    let now = relay.now();
    let (id, wire) = sealed_wire(&a, &b, "x", now);
    let w = wire.as_bytes();
    let big = vec![b' '; 5000];
    let v2: Value = {
        let mut v: Value = serde_json::from_str(&wire).unwrap();
        v["v"] = json!(2);
        v
    };
    let v2 = v2.to_string();
    let other_id = new_id(now + 5);
    let plain = plain_envelope(&a, &b, "plain", now);
    let (rid_b, rwire_b) = receipt_wire(&b, "01KDVDNA3VG2MH8KWSQRCWJZ0S", 3, now);
    // gamma accepts only beta: alpha is "not accepted" there.
    let list = SenderList {
        target_pubkey: c.pubkey(),
        senders: vec![b.pubkey()],
        iat_ms: now,
        record: "{}".into(),
        sig: "x".into(),
    };
    relay
        .with_store(move |s| s.put_sender_list(list).unwrap())
        .await;
    let t = |h: &Host, wire_b64: &str| json!({"host_pubkey": h.pubkey(), "wire_b64": wire_b64});
    let e = b64::encode(w);
    let cases: Vec<(Value, &str)> = vec![
        // bad item id before bad kind
        (
            json!({"kind": "mail", "item_id": "", "targets": [t(&b, &e)]}),
            "bad item id",
        ),
        // bad kind before bad targets
        (
            json!({"kind": "mail", "item_id": id, "targets": []}),
            "bad kind",
        ),
        // target not enrolled (2nd target) before sender not accepted (1st target)
        (
            json!({"kind": "envelope", "item_id": id, "targets": [t(&c, &e), t(&d, &e)]}),
            "target not enrolled",
        ),
        // target not enrolled before duplicate target
        (
            json!({"kind": "envelope", "item_id": id, "targets": [t(&b, &e), t(&b, &e), t(&d, &e)]}),
            "target not enrolled",
        ),
        // sender not accepted before duplicate target and bad wire
        (
            json!({"kind": "envelope", "item_id": id, "targets": [t(&b, "!!"), t(&b, "!!"), t(&c, "!!")]}),
            "sender not accepted by target",
        ),
        // duplicate target before bad wire
        (
            json!({"kind": "envelope", "item_id": id, "targets": [t(&b, "!!"), t(&b, "!!")]}),
            "duplicate target",
        ),
        // bad wire (2nd target) before item over size limit (1st target)
        (item("envelope", &id, &[(&b, &big), (&a, b"")]), "bad wire"),
        // item over size limit (2nd target) before bad envelope (1st target)
        (
            item("envelope", &id, &[(&b, v2.as_bytes()), (&a, &big)]),
            "item over size limit",
        ),
        // bad envelope (2nd target) before item id mismatch (1st target)
        (
            item("envelope", &other_id, &[(&b, w), (&a, v2.as_bytes())]),
            "bad envelope: unsupported version",
        ),
        // item id is not the envelope id before envelope body is not sealed
        (
            item("envelope", &other_id, &[(&b, plain.wire_json().as_bytes())]),
            "item id is not the envelope id",
        ),
        // envelope body is not sealed (2nd target) before nothing else
        (
            item(
                "envelope",
                &plain.id,
                &[
                    (&b, plain.wire_json().as_bytes()),
                    (&a, plain.wire_json().as_bytes()),
                ],
            ),
            "envelope body is not sealed",
        ),
        // bad receipt before item id is not the receipt id
        (item("receipt", "receipt:x:y:1", &[(&b, w)]), "bad receipt"),
        // item id is not the receipt id before receipt is not signed by the sending host
        (
            item("receipt", "receipt:x:y:1", &[(&b, rwire_b.as_bytes())]),
            "item id is not the receipt id",
        ),
        (
            item("receipt", &rid_b, &[(&b, rwire_b.as_bytes())]),
            "receipt is not signed by the sending host",
        ),
    ];
    let (items, want): (Vec<Value>, Vec<String>) = cases
        .into_iter()
        .map(|(i, s)| (i, format!("rejected:{s}")))
        .unzip();
    let r = relay.push(&a, items).await;
    assert_eq!(r.statuses(), want, "{r:#?}");
    assert_eq!(relay.queue_ids(&b).await, Vec::<String>::new());
    relay.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn push_targets_must_be_canonical_host_keys() {
    let relay = Relay::start().await;
    let (a, b) = two_hosts(&relay).await;
    let (id, wire) = sealed_wire(&a, &b, "to an alias", relay.now());
    let e = b64::encode(wire.as_bytes());
    let unpadded = b.pubkey().trim_end_matches('=').to_owned();
    assert_ne!(unpadded, b.pubkey());
    // 32 bytes that are not an Ed25519 point.
    let off_curve = (0u8..=255)
        .map(|n| b64::encode(&[n; 32]))
        .find(|k| agentmbx_protocol::keys::PublicKey::from_b64(k).is_err())
        .expect("some 32-byte value is not a point");
    for key in [
        unpadded.as_str(),
        off_curve.as_str(),
        "not a key",
        "",
        &b64::encode(&[7u8; 31]),
    ] {
        let it = json!({"kind": "envelope", "item_id": id,
                        "targets": [{"host_pubkey": key, "wire_b64": e}]});
        let r = relay.push(&a, vec![it]).await;
        assert_eq!(r.status1(), "rejected:bad targets", "{key:?}");
        // One alias among good targets spoils the item.
        let it = json!({"kind": "envelope", "item_id": id, "targets": [
            {"host_pubkey": b.pubkey(), "wire_b64": e},
            {"host_pubkey": key, "wire_b64": e}]});
        let r = relay.push(&a, vec![it]).await;
        assert_eq!(r.status1(), "rejected:bad targets", "{key:?}");
    }
    assert_eq!(relay.queue_ids(&b).await, Vec::<String>::new());
    // The canonical text is accepted and is what the answer names.
    let r = relay.push(&a, vec![env_item(&id, &b, &wire)]).await;
    assert_eq!(r.status1(), "accepted");
    assert_eq!(
        r.json["results"][0]["targets"][0]["host_pubkey"],
        b.pubkey()
    );
    relay.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn push_target_count_bounds() {
    let relay = Relay::start().await;
    let a = Host::new("alpha");
    relay.enrol(&a).await;
    let targets: Vec<Host> = (0..65).map(|i| Host::new(&format!("t{i}"))).collect();
    for t in &targets[..64] {
        relay.enrol_direct(t).await;
    }
    let (id, wire) = sealed_wire(&a, &targets[0], "to many", relay.now());
    let w = wire.as_bytes();
    let all: Vec<(&Host, &[u8])> = targets.iter().map(|t| (t, w)).collect();
    // 65 targets (the 65th not even enrolled): bad targets, checked first.
    let r = relay.push(&a, vec![item("envelope", &id, &all)]).await;
    assert_eq!(r.status1(), "rejected:bad targets");
    // 64 targets: accepted, one seq per target, all covered by the accept statement.
    let r = relay
        .push(&a, vec![item("envelope", &id, &all[..64])])
        .await;
    let res = &r.assert_ok()["results"][0];
    assert_eq!(res["status"], "accepted");
    assert_eq!(res["targets"].as_array().unwrap().len(), 64);
    for t in &targets[..64] {
        records::verify_accept(
            &res["accept"],
            res["sig"].as_str().unwrap(),
            &relay.relay_pub,
            &a.pubkey(),
            &id,
            &t.pubkey(),
            &wire_hash(w),
        )
        .expect("accept covers every target");
    }
    assert_eq!(relay.queue_ids(&targets[63]).await, vec![id]);
    relay.stop().await;
}

/// A sealed envelope wire padded with JSON whitespace to exactly `len` bytes.
fn padded_wire(from: &Host, to: &Host, now: i64, len: usize) -> (String, Vec<u8>) {
    let (id, wire) = sealed_wire(from, to, "padded", now);
    assert!(wire.len() <= len);
    let mut bytes = wire.into_bytes();
    bytes.resize(len, b' ');
    (id, bytes)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn push_item_size_limit_default() {
    let relay = Relay::start().await;
    let (a, b) = two_hosts(&relay).await;
    assert_eq!(MAX_ITEM_BYTES, 786_432);
    let now = relay.now();
    let (id_ok, ok) = padded_wire(&a, &b, now, MAX_ITEM_BYTES);
    let (id_over, over) = padded_wire(&a, &b, now, MAX_ITEM_BYTES + 1);
    let r = relay
        .push(
            &a,
            vec![
                item("envelope", &id_ok, &[(&b, &ok)]),
                item("envelope", &id_over, &[(&b, &over)]),
            ],
        )
        .await;
    assert_eq!(
        r.statuses(),
        vec!["accepted", "rejected:item over size limit"]
    );
    // Three items at the limit in one request (a body over 3 MiB, far below the 8 MiB cap).
    let items: Vec<Value> = (0..3)
        .map(|i| {
            let (id, w) = padded_wire(&a, &b, now + i, MAX_ITEM_BYTES);
            item("envelope", &id, &[(&b, &w)])
        })
        .collect();
    let body_len = json!({ "items": items }).to_string().len();
    assert!(body_len > 3 * 1024 * 1024, "{body_len}");
    let r = relay.push(&a, items).await;
    assert_eq!(r.statuses(), vec!["accepted"; 3]);
    let p = relay.pull(&b, "after=0&limit=1").await;
    assert_eq!(
        b64::decode(p.assert_ok()["items"][0]["wire_b64"].as_str().unwrap()).unwrap(),
        ok,
        "stored byte for byte"
    );
    relay.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn push_item_size_limit_follows_the_configured_limit() {
    let relay = Relay::start_with(limits(|l| l.max_item_bytes = 2_000)).await;
    let (a, b) = two_hosts(&relay).await;
    let now = relay.now();
    let (id_ok, ok) = padded_wire(&a, &b, now, 2_000);
    let (id_over, over) = padded_wire(&a, &b, now, 2_001);
    let r = relay
        .push(
            &a,
            vec![
                item("envelope", &id_ok, &[(&b, &ok)]),
                item("envelope", &id_over, &[(&b, &over)]),
            ],
        )
        .await;
    assert_eq!(
        r.statuses(),
        vec!["accepted", "rejected:item over size limit"]
    );
    relay.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn push_batch_bounds_and_bad_batches() {
    let relay = Relay::start().await;
    let (a, b) = two_hosts(&relay).await;
    let now = relay.now();
    let batch: Vec<Value> = (0..201)
        .map(|i| {
            let (id, wire) = sealed_wire(&a, &b, &format!("item {i}"), now + i);
            env_item(&id, &b, &wire)
        })
        .collect();
    let r = relay.push(&a, batch.clone()).await;
    r.assert_error(400, "more than 200 items in one push", "BAD_BATCH");
    assert_eq!(
        relay.queue_ids(&b).await.len(),
        0,
        "nothing of a refused batch"
    );
    let r = relay.push(&a, batch[..200].to_vec()).await;
    assert_eq!(r.statuses(), vec!["accepted"; 200]);
    assert_eq!(relay.queue_ids(&b).await.len(), 200);
    // An empty batch is fine.
    let r = relay.push(&a, vec![]).await;
    assert_eq!(r.assert_ok(), &json!({"results": []}));

    // Not a push request: 400 BAD_BATCH, and the answer never echoes the body.
    for body in [
        "{}".to_owned(),
        r#"{"items":5}"#.to_owned(),
        r#"{"items":[{"kind":"envelope"}]}"#.to_owned(),
        r#"{"items":"SECRETSECRETSECRET"}"#.to_owned(),
        format!(
            r#"{{"items":[{{"kind":"envelope","item_id":"x","targets":[{{"host_pubkey":"{}","wire_b64":7}}]}}]}}"#,
            b.pubkey()
        ),
        "not json".to_owned(),
        String::new(),
    ] {
        let r = relay.hop(&a, "POST", "/v2/relay/items", &body).await;
        assert_eq!(r.status, 400, "{body}: {r:#?}");
        assert_eq!(r.str("code"), "BAD_BATCH", "{r:#?}");
        assert!(r.str("error").starts_with("bad batch"), "{r:#?}");
        assert!(!r.text.contains("SECRET"), "{r:#?}");
        assert!(!r.text.contains(&b.pubkey()), "{r:#?}");
    }
    relay.stop().await;
}

// ---- pull ------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pull_pages_by_count() {
    let relay = Relay::start().await;
    let (a, b) = two_hosts(&relay).await;
    let mut ids = Vec::new();
    for i in 0..5 {
        ids.push(push_one(&relay, &a, &b, &format!("n{i}")).await.0);
    }
    let seqs: Vec<i64> = (0..5).map(|i| T0 + i).collect();
    let page = |r: &Resp| -> (Vec<i64>, i64, bool, i64) {
        let j = r.assert_ok();
        (
            j["items"]
                .as_array()
                .unwrap()
                .iter()
                .map(|i| i["seq"].as_i64().unwrap())
                .collect(),
            j["last_seq"].as_i64().unwrap(),
            j["more"].as_bool().unwrap(),
            j["head_seq"].as_i64().unwrap(),
        )
    };
    let r = relay.pull(&b, "after=0&limit=2").await;
    assert_eq!(page(&r), (seqs[..2].to_vec(), seqs[1], true, seqs[4]));
    let r = relay.pull(&b, &format!("after={}&limit=2", seqs[1])).await;
    assert_eq!(page(&r), (seqs[2..4].to_vec(), seqs[3], true, seqs[4]));
    let r = relay.pull(&b, &format!("after={}&limit=2", seqs[3])).await;
    assert_eq!(page(&r), (vec![seqs[4]], seqs[4], false, seqs[4]));
    // After the head: an empty page whose last_seq is `after`.
    let beyond = seqs[4] + 1_000;
    let r = relay.pull(&b, &format!("after={beyond}")).await;
    assert_eq!(page(&r), (vec![], beyond, false, seqs[4]));
    // limit is clamped to 1..=max_pull; no limit means max_pull.
    let r = relay.pull(&b, "after=0&limit=0").await;
    assert_eq!(page(&r), (vec![seqs[0]], seqs[0], true, seqs[4]));
    let r = relay.pull(&b, "after=0&limit=100000").await;
    assert_eq!(page(&r), (seqs.clone(), seqs[4], false, seqs[4]));
    let r = relay.pull(&b, "").await;
    assert_eq!(page(&r), (seqs.clone(), seqs[4], false, seqs[4]));
    // The current epoch is accepted.
    let epoch = relay.epoch().await;
    let r = relay
        .pull(&b, &format!("after=0&limit=1&epoch={epoch}"))
        .await;
    assert_eq!(page(&r).0, vec![seqs[0]]);
    // An empty epoch is no epoch.
    let r = relay.pull(&b, "after=0&limit=1&epoch=").await;
    assert_eq!(page(&r).0, vec![seqs[0]]);
    // Bad numbers are 400.
    for q in [
        "after=abc",
        "after=-1",
        "after=1.5",
        "limit=x",
        "after=",
        "limit=1e3",
    ] {
        let r = relay.pull(&b, q).await;
        assert_eq!(r.status, 400, "{q}: {r:#?}");
        assert_eq!(r.str("code"), "BAD_REQUEST", "{q}: {r:#?}");
    }
    relay.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pull_pages_by_bytes() {
    // Every small wire has the same length: the envelopes differ only in random bytes.
    let (a, b) = (Host::new("alpha"), Host::new("beta"));
    let len = sealed_wire(&a, &b, "same size", T0).1.len();
    let relay = Relay::start_with(limits(|l| l.max_pull_bytes = 2 * len as u64)).await;
    relay.enrol(&a).await;
    relay.enrol(&b).await;
    let mut wires = Vec::new();
    for i in 0..5 {
        let now = relay.now() + i;
        let (id, w) = if i == 3 {
            padded_wire(&a, &b, now, 3 * len)
        } else {
            let (id, w) = sealed_wire(&a, &b, "same size", now);
            (id, w.into_bytes())
        };
        let r = relay
            .push(&a, vec![item("envelope", &id, &[(&b, &w)])])
            .await;
        assert_eq!(r.status1(), "accepted");
        wires.push(w);
    }
    assert!(wires
        .iter()
        .enumerate()
        .all(|(i, w)| i == 3 || w.len() == len));
    let info = relay.plain("GET", "/v2/relay/info", "").await;
    assert_eq!(info.assert_ok()["limits"]["max_pull_bytes"], 2 * len as u64);
    let expect = [
        // two items fill the budget exactly
        (0, vec![0, 1], true),
        // the third alone: with the big one it would exceed the budget
        (1, vec![2], true),
        // an item larger than the budget comes alone
        (2, vec![3], true),
        (3, vec![4], false),
    ];
    for (after_idx, want, more) in expect {
        let after = T0 + after_idx as i64;
        let after = if after_idx == 0 { 0 } else { after };
        let r = relay.pull(&b, &format!("after={after}")).await;
        let j = r.assert_ok();
        let got: Vec<i64> = j["items"]
            .as_array()
            .unwrap()
            .iter()
            .map(|i| i["seq"].as_i64().unwrap())
            .collect();
        let want_seqs: Vec<i64> = want.iter().map(|i| T0 + *i as i64).collect();
        assert_eq!(got, want_seqs, "after={after}");
        assert_eq!(j["last_seq"], *want_seqs.last().unwrap());
        assert_eq!(j["more"], more);
        for (it, i) in j["items"].as_array().unwrap().iter().zip(&want) {
            assert_eq!(
                b64::decode(it["wire_b64"].as_str().unwrap()).unwrap(),
                wires[*i]
            );
        }
    }
    relay.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pull_survives_a_max_pull_that_was_never_validated() {
    // `relay.toml` refuses these; a configuration built in code must not panic a pull either.
    for (max_pull, page) in [(0, 1), (u64::MAX, 2)] {
        let relay = Relay::start_with(limits(|l| l.max_pull = max_pull)).await;
        let (a, b) = two_hosts(&relay).await;
        push_one(&relay, &a, &b, "one").await;
        relay.clock.advance(1);
        push_one(&relay, &a, &b, "two").await;
        for (query, want) in [
            ("after=0", page),
            ("after=0&limit=0", 1),
            ("after=0&limit=9999", page),
        ] {
            let r = relay.pull(&b, query).await;
            let items = r.assert_ok()["items"].as_array().unwrap().len();
            assert_eq!(items, want, "max_pull={max_pull} {query}");
        }
        relay.stop().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pull_stale_epoch_is_409_with_the_current_epoch() {
    let relay = Relay::start().await;
    let (a, b) = two_hosts(&relay).await;
    push_one(&relay, &a, &b, "x").await;
    let epoch = relay.epoch().await;
    let r = relay.pull(&b, "after=0&epoch=not-the-epoch").await;
    r.assert_error(409, "stale epoch", "EPOCH");
    assert_eq!(r.json["epoch"], epoch);
    assert_eq!(r.json["head_seq"], T0);
    relay.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pull_shows_only_the_callers_own_queue() {
    let relay = Relay::start().await;
    let (a, b) = two_hosts(&relay).await;
    let c = Host::new("gamma");
    relay.enrol(&c).await;
    let (id, _, _) = push_one(&relay, &a, &b, "for beta only").await;
    for h in [&a, &c] {
        let r = relay.pull(h, "after=0").await;
        let j = r.assert_ok();
        assert_eq!(j["items"], json!([]), "{}", h.name);
        assert_eq!(j["head_seq"], 0);
        assert_eq!(j["last_seq"], 0);
    }
    assert_eq!(relay.queue_ids(&b).await, vec![id]);
    // The query names no target: a caller cannot ask for someone else's queue.
    let r = relay
        .pull(
            &c,
            &format!("after=0&host_pubkey={}", b64_query(&b.pubkey())),
        )
        .await;
    assert_eq!(r.assert_ok()["items"], json!([]));
    relay.stop().await;
}

/// Percent-encodes a base64 key for a query string.
fn b64_query(s: &str) -> String {
    s.replace('+', "%2B")
        .replace('/', "%2F")
        .replace('=', "%3D")
}

// ---- ack -------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ack_deletes_through_and_never_goes_back() {
    let relay = Relay::start().await;
    let (a, b) = two_hosts(&relay).await;
    let mut ids = Vec::new();
    for i in 0..3 {
        ids.push(push_one(&relay, &a, &b, &format!("a{i}")).await.0);
    }
    let epoch = relay.epoch().await;
    let r = relay.ack(&b, &epoch, json!(T0 + 1)).await;
    assert_eq!(
        r.assert_ok(),
        &json!({"acked_through": T0 + 1, "deleted": 2, "head_seq": T0 + 2})
    );
    assert_eq!(relay.queue_ids(&b).await, vec![ids[2].clone()]);
    // A lower ack changes nothing and acked_through never decreases.
    let r = relay.ack(&b, &epoch, json!(T0)).await;
    assert_eq!(
        r.assert_ok(),
        &json!({"acked_through": T0 + 1, "deleted": 0, "head_seq": T0 + 2})
    );
    let r = relay.ack(&b, &epoch, json!(0)).await;
    assert_eq!(r.assert_ok()["acked_through"], T0 + 1);
    // Through the head: the queue is empty.
    let r = relay.ack(&b, &epoch, json!(T0 + 2)).await;
    assert_eq!(
        r.assert_ok(),
        &json!({"acked_through": T0 + 2, "deleted": 1, "head_seq": T0 + 2})
    );
    let p = relay.pull(&b, "after=0").await;
    assert_eq!(p.assert_ok()["items"], json!([]));
    // Signed info reports the position.
    let info = relay.hop(&b, "GET", "/v2/relay/info", "").await;
    assert_eq!(info.assert_ok()["you"]["acked_through"], T0 + 2);
    assert_eq!(info.json["you"]["head_seq"], T0 + 2);
    // An ack covers only the caller's own queue.
    let (other, _, _) = push_one(&relay, &b, &a, "for alpha").await;
    let r = relay.ack(&b, &epoch, json!(T0 + 2)).await;
    assert_eq!(r.assert_ok()["deleted"], 0);
    assert_eq!(relay.queue_ids(&a).await, vec![other]);
    relay.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ack_refusals() {
    let relay = Relay::start().await;
    let (a, b) = two_hosts(&relay).await;
    push_one(&relay, &a, &b, "one").await;
    let epoch = relay.epoch().await;
    // Beyond the head: 400 BAD_ACK with epoch and head, nothing deleted.
    let r = relay.ack(&b, &epoch, json!(T0 + 1)).await;
    r.assert_error(
        400,
        "ack beyond the last allocated seq: treat as an epoch change",
        "BAD_ACK",
    );
    assert_eq!(r.json["epoch"], epoch);
    assert_eq!(r.json["head_seq"], T0);
    // Stale epoch: 409 EPOCH with the current one.
    let r = relay.ack(&b, "old-epoch", json!(T0)).await;
    r.assert_error(409, "stale epoch", "EPOCH");
    assert_eq!(r.json["epoch"], epoch);
    assert_eq!(r.json["head_seq"], T0);
    // `through` must be an integer: anything else is a plain 400 (an integer outside
    // [0, head_seq] is BAD_ACK: `ack_through_outside_zero_to_head_is_bad_ack`).
    for through in [
        json!(1.5),
        json!(-1.5),
        json!(T0 as f64 + 0.5),
        json!("5"),
        json!(null),
        json!(true),
        json!([1]),
        json!(1e300),
    ] {
        let r = relay.ack(&b, &epoch, through.clone()).await;
        r.assert_error(400, "bad ack: through must be an integer", "BAD_REQUEST");
        assert_eq!(r.json.get("epoch"), None, "{through}");
    }
    for raw in ["5.0", "1e2", "-0.0"] {
        let body = format!(r#"{{"epoch":"{epoch}","through":{raw}}}"#);
        let r = relay.hop(&b, "POST", "/v2/relay/ack", &body).await;
        r.assert_error(400, "bad ack: through must be an integer", "BAD_REQUEST");
    }
    for body in ["{}", r#"{"epoch":"e"}"#, r#"{"through":1}"#, "[]", "nope"] {
        let r = relay.hop(&b, "POST", "/v2/relay/ack", body).await;
        r.assert_error(400, "bad ack: {epoch, through} required", "BAD_REQUEST");
    }
    // Nothing was deleted by any of these.
    assert_eq!(relay.queue_ids(&b).await.len(), 1);
    relay.stop().await;
}

/// wire.md §3.2: "`through` safe int in [0, head_seq] else BAD_ACK". Every integer outside that
/// range, below zero as well as past the head (and past what i64 or a JS number can hold),
/// answers 400 BAD_ACK with the epoch and head seq, so a receiver treats it as a rewind;
/// nothing is deleted and `acked_through` does not move.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ack_through_outside_zero_to_head_is_bad_ack() {
    let relay = Relay::start().await;
    let (a, b) = two_hosts(&relay).await;
    push_one(&relay, &a, &b, "one").await;
    let epoch = relay.epoch().await;
    let beyond = "ack beyond the last allocated seq: treat as an epoch change";
    let below = "ack below seq 0: treat as an epoch change";
    let cases: Vec<(String, &str)> = vec![
        ("-1".into(), below),
        ("-0".into(), ""),
        (format!("-{T0}"), below),
        (format!("-{}", MAX_SAFE_INT + 1), below),
        ("-9223372036854775808".into(), below),
        ("-9223372036854775809".into(), below),
        ("-100000000000000000000000000000".into(), below),
        ((T0 + 1).to_string(), beyond),
        ((MAX_SAFE_INT + 1).to_string(), beyond),
        ("9223372036854775807".into(), beyond),
        ("9223372036854775808".into(), beyond),
        ("18446744073709551616".into(), beyond),
        ("100000000000000000000000000000".into(), beyond),
    ];
    for (through, error) in cases {
        let body = format!(r#"{{"epoch":"{epoch}","through":{through}}}"#);
        let r = relay.hop(&b, "POST", "/v2/relay/ack", &body).await;
        if error.is_empty() {
            // -0 is zero: in range, acked, nothing deleted.
            assert_eq!(
                r.assert_ok(),
                &json!({"acked_through": 0, "deleted": 0, "head_seq": T0})
            );
            continue;
        }
        r.assert_error(400, error, "BAD_ACK");
        assert_eq!(r.json["epoch"], epoch, "through {through}");
        assert_eq!(r.json["head_seq"], T0, "through {through}");
    }
    // A stale epoch is still told first, whatever `through` is.
    let r = relay.ack(&b, "old-epoch", json!(-1)).await;
    r.assert_error(409, "stale epoch", "EPOCH");
    assert_eq!(r.json["head_seq"], T0);
    // Nothing was deleted, and the position did not move.
    assert_eq!(relay.queue_ids(&b).await.len(), 1);
    let info = relay.hop(&b, "GET", "/v2/relay/info", "").await;
    assert_eq!(info.assert_ok()["you"]["acked_through"], 0);
    relay.stop().await;
}

// ---- hop authentication ----------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hop_tampering_is_401() {
    let relay = Relay::start().await;
    let (a, b) = two_hosts(&relay).await;
    let now = relay.now();
    // Signed after=1, sent after=2.
    let h = b.hop_headers("GET", "/v2/relay/items?after=1", "", now);
    let r = relay
        .send("GET", "/v2/relay/items?after=2", &h, vec![])
        .await;
    r.assert_error(401, "bad relay hop", "BAD_HOP");
    // Query dropped.
    let r = relay.send("GET", "/v2/relay/items", &h, vec![]).await;
    r.assert_error(401, "bad relay hop", "BAD_HOP");
    // As signed: fine.
    let r = relay
        .send("GET", "/v2/relay/items?after=1", &h, vec![])
        .await;
    r.assert_ok();
    // Tampered body.
    let epoch = relay.epoch().await;
    let signed = json!({"epoch": epoch, "through": 0}).to_string();
    let sent = json!({"epoch": epoch, "through": 1}).to_string();
    let h = b.hop_headers("POST", "/v2/relay/ack", &signed, now);
    let r = relay
        .send("POST", "/v2/relay/ack", &h, sent.into_bytes())
        .await;
    r.assert_error(401, "bad relay hop", "BAD_HOP");
    // Signed for another path or method.
    let h = b.hop_headers("POST", "/v2/relay/items", &signed, now);
    let r = relay
        .send("POST", "/v2/relay/ack", &h, signed.clone().into_bytes())
        .await;
    r.assert_error(401, "bad relay hop", "BAD_HOP");
    let h = b.hop_headers("GET", "/v2/relay/items", "", now);
    let r = relay.send("POST", "/v2/relay/items", &h, vec![]).await;
    r.assert_error(401, "bad relay hop", "BAD_HOP");
    // Signed by alpha, claiming beta's key.
    let h = with_header(
        a.hop_headers("GET", "/v2/relay/items", "", now),
        header::KEY,
        Some(&b.pubkey()),
    );
    let r = relay.send("GET", "/v2/relay/items", &h, vec![]).await;
    r.assert_error(401, "bad relay hop", "BAD_HOP");
    // A key header that is not a key.
    let h = with_header(
        b.hop_headers("GET", "/v2/relay/items", "", now),
        header::KEY,
        Some("not-a-key"),
    );
    let r = relay.send("GET", "/v2/relay/items", &h, vec![]).await;
    r.assert_error(401, "bad relay hop", "BAD_HOP");
    // A signature that is not base64.
    let h = with_header(
        b.hop_headers("GET", "/v2/relay/items", "", now),
        header::SIG,
        Some("%%%"),
    );
    let r = relay.send("GET", "/v2/relay/items", &h, vec![]).await;
    r.assert_error(401, "bad relay hop", "BAD_HOP");
    relay.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hop_timestamp_form_and_window() {
    let relay = Relay::start().await;
    let (_a, b) = two_hosts(&relay).await;
    let now = relay.now();
    let target = "/v2/relay/items?after=0";
    for ts in [
        "1e12",
        "abc",
        "",
        "-1",
        "1767225600000.0",
        "+1767225600000",
        "0x10",
    ] {
        let h = with_header(b.hop_headers("GET", target, "", now), header::TS, Some(ts));
        let r = relay.send("GET", target, &h, vec![]).await;
        r.assert_error(401, "bad relay hop", "BAD_HOP");
    }
    // Exactly on the ±300,000 ms bound: accepted.
    for ts in [now - 300_000, now + 300_000] {
        let r = relay.hop_at(&b, "GET", target, "", ts).await;
        r.assert_ok();
    }
    // One ms outside: refused.
    for ts in [now - 300_001, now + 300_001] {
        let r = relay.hop_at(&b, "GET", target, "", ts).await;
        r.assert_error(401, "stale or bad hop timestamp (check clocks)", "BAD_HOP");
    }
    relay.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hop_headers_and_keys() {
    let relay = Relay::start().await;
    let (_a, b) = two_hosts(&relay).await;
    let now = relay.now();
    let target = "/v2/relay/items";
    // Each required header missing → 401.
    for name in [header::KEY, header::TS, header::SIG] {
        let h = with_header(b.hop_headers("GET", target, "", now), name, None);
        let r = relay.send("GET", target, &h, vec![]).await;
        r.assert_error(401, "bad relay hop", "BAD_HOP");
    }
    let r = relay.plain("GET", target, "").await;
    r.assert_error(401, "bad relay hop", "BAD_HOP");
    let r = relay.plain("POST", "/v2/relay/ack", "{}").await;
    r.assert_error(401, "bad relay hop", "BAD_HOP");
    // x-mbx-host is a label: without it (or with another name) the key alone authenticates.
    let h = with_header(b.hop_headers("GET", target, "", now), header::HOST, None);
    relay.send("GET", target, &h, vec![]).await.assert_ok();
    let h = with_header(
        b.hop_headers("GET", target, "", now),
        header::HOST,
        Some("someone-else"),
    );
    relay.send("GET", target, &h, vec![]).await.assert_ok();
    // A valid hop by a key that is not enrolled.
    let stranger = Host::new("stranger");
    let r = relay.hop(&stranger, "GET", target, "").await;
    r.assert_error(401, "not enrolled", "NOT_ENROLLED");
    let r = relay.push(&stranger, vec![]).await;
    r.assert_error(401, "not enrolled", "NOT_ENROLLED");
    relay.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hop_signature_is_checked_before_enrolment_is_revealed() {
    let relay = Relay::start().await;
    let (a, b) = two_hosts(&relay).await;
    relay.revoke(&b).await;
    let stranger = Host::new("stranger");
    let now = relay.now();
    let target = "/v2/relay/items?after=0";
    for h in [&b, &stranger] {
        // Signed by someone else (alpha) under h's key: nothing about h is told.
        let forged = with_header(
            a.hop_headers("GET", target, "", now),
            header::KEY,
            Some(&h.pubkey()),
        );
        let r = relay.send("GET", target, &forged, vec![]).await;
        r.assert_error(401, "bad relay hop", "BAD_HOP");
        // A signature that is not even base64.
        let junk = with_header(
            h.hop_headers("GET", target, "", now),
            header::SIG,
            Some("%%%"),
        );
        let r = relay.send("GET", target, &junk, vec![]).await;
        r.assert_error(401, "bad relay hop", "BAD_HOP");
        // Signed by h but outside the window.
        let r = relay.hop_at(h, "GET", target, "", now - 300_001).await;
        r.assert_error(401, "stale or bad hop timestamp (check clocks)", "BAD_HOP");
        // A tampered body.
        let h2 = h.hop_headers("POST", "/v2/relay/items", "{\"items\":[]}", now);
        let r = relay
            .send("POST", "/v2/relay/items", &h2, b"{\"items\":[ ]}".to_vec())
            .await;
        r.assert_error(401, "bad relay hop", "BAD_HOP");
    }
    // Correctly signed requests learn the answer.
    let r = relay.hop(&b, "GET", target, "").await;
    r.assert_error(403, "this host key is revoked on this relay", "REVOKED");
    let r = relay.hop(&stranger, "GET", target, "").await;
    r.assert_error(401, "not enrolled", "NOT_ENROLLED");
    // An unpadded x-mbx-key is the same key: it finds the enrolment.
    let h = with_header(
        a.hop_headers("GET", target, "", now),
        header::KEY,
        Some(a.pubkey().trim_end_matches('=')),
    );
    relay.send("GET", target, &h, vec![]).await.assert_ok();
    relay.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn body_that_is_not_utf8_is_400_before_any_signature_check() {
    let relay = Relay::start().await;
    let (_a, b) = two_hosts(&relay).await;
    let bad = vec![b'{', 0xff, 0xfe, b'}'];
    for target in [
        "/v2/relay/items",
        "/v2/relay/ack",
        "/v2/relay/enc-key",
        "/v1/relay/challenge",
        "/v1/relay/enrol",
    ] {
        // No hop headers at all.
        let r = relay.send("POST", target, &[], bad.clone()).await;
        r.assert_error(400, "request body is not valid UTF-8", "BAD_REQUEST");
        // A hop signed over the lossy text: still 400, not 401.
        let lossy = String::from_utf8_lossy(&bad).into_owned();
        let h = b.hop_headers("POST", target, &lossy, relay.now());
        let r = relay.send("POST", target, &h, bad.clone()).await;
        r.assert_error(400, "request body is not valid UTF-8", "BAD_REQUEST");
    }
    relay.stop().await;
}

// ---- body caps -------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn body_caps_are_413() {
    let relay = Relay::start().await;
    let (_a, b) = two_hosts(&relay).await;
    assert_eq!(RELAY_MAX_BODY, 8 * 1024 * 1024);
    assert_eq!(RELAY_SMALL_BODY, 8192);
    // Exactly the cap is read (then refused for the missing hop); one byte more is 413.
    let r = relay
        .send("POST", "/v2/relay/items", &[], vec![b'a'; RELAY_MAX_BODY])
        .await;
    r.assert_error(401, "bad relay hop", "BAD_HOP");
    let over = vec![b'a'; RELAY_MAX_BODY + 1];
    let r = relay
        .send("POST", "/v2/relay/items", &[], over.clone())
        .await;
    r.assert_error(413, "request body too large", "TOO_LARGE");
    assert_eq!(
        serde_json::from_str::<Value>(&r.text).unwrap()["error"],
        "request body too large"
    );
    // A signed one too: the cap comes first.
    let text = String::from_utf8(over).unwrap();
    let h = b.hop_headers("POST", "/v2/relay/items", &text, relay.now());
    let r = relay
        .send("POST", "/v2/relay/items", &h, text.into_bytes())
        .await;
    r.assert_error(413, "request body too large", "TOO_LARGE");
    // Much larger: still a clean 413, never a reset.
    let r = relay
        .send(
            "POST",
            "/v2/relay/items",
            &[],
            vec![b'a'; 3 * RELAY_MAX_BODY],
        )
        .await;
    r.assert_error(413, "request body too large", "TOO_LARGE");

    // Challenge and enrol: 8192 bytes at most.
    let host = Host::new("padded");
    let fit = |mut s: String, len: usize| {
        assert!(s.len() <= len);
        s.extend(std::iter::repeat_n(' ', len - s.len()));
        s
    };
    let body = json!({"host": host.name, "pubkey": host.pubkey()}).to_string();
    let r = relay
        .plain(
            "POST",
            "/v1/relay/challenge",
            &fit(body.clone(), RELAY_SMALL_BODY),
        )
        .await;
    r.assert_ok();
    let r = relay
        .plain(
            "POST",
            "/v1/relay/challenge",
            &fit(body, RELAY_SMALL_BODY + 1),
        )
        .await;
    r.assert_error(413, "request body too large", "TOO_LARGE");
    let challenge = relay.challenge(&host).await;
    let enrol = host.enrol_body(&challenge);
    let r = relay
        .plain(
            "POST",
            "/v1/relay/enrol",
            &fit(enrol.clone(), RELAY_SMALL_BODY + 1),
        )
        .await;
    r.assert_error(413, "request body too large", "TOO_LARGE");
    let challenge = relay.challenge(&host).await;
    let enrol = host.enrol_body(&challenge);
    let r = relay
        .plain("POST", "/v1/relay/enrol", &fit(enrol, RELAY_SMALL_BODY))
        .await;
    assert_eq!(r.assert_ok(), &json!({"ok": true}));
    // The connection pool still works afterwards.
    relay.plain("GET", "/v2/relay/info", "").await.assert_ok();
    relay.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn oversized_uploads_get_413_even_when_they_never_end() {
    let relay = Relay::start().await;
    let addr = relay.addr();
    // A declared length far over the cap, and the upload stalls after 1 MiB: the relay
    // drains for its 2 s window, then answers 413 (it neither hangs nor resets).
    let (status, body, waited) = tokio::task::spawn_blocking({
        let addr = addr.clone();
        move || {
            raw_exchange(
                &addr,
                "POST /v2/relay/items HTTP/1.1\r\nhost: relay\r\ncontent-length: 104857600\r\n\r\n",
                &[vec![b'a'; 1024 * 1024]],
            )
        }
    })
    .await
    .unwrap();
    assert_eq!(status, 413, "{body}");
    assert_eq!(
        serde_json::from_str::<Value>(&body).unwrap(),
        json!({"error": "request body too large", "code": "TOO_LARGE"})
    );
    assert!(waited > 1.5 && waited < 15.0, "waited {waited} s");
    // Chunked, no declared length, growing past the cap while streaming.
    let chunk = {
        let data = vec![b'b'; 1024 * 1024];
        let mut c = format!("{:x}\r\n", data.len()).into_bytes();
        c.extend_from_slice(&data);
        c.extend_from_slice(b"\r\n");
        c
    };
    let mut chunks = vec![chunk; 9];
    chunks.push(b"0\r\n\r\n".to_vec());
    let (status, body, _) = tokio::task::spawn_blocking(move || {
        raw_exchange(
            &addr,
            "POST /v1/relay/enrol HTTP/1.1\r\nhost: relay\r\ntransfer-encoding: chunked\r\n\r\n",
            &chunks,
        )
    })
    .await
    .unwrap();
    assert_eq!(status, 413, "{body}");
    assert_eq!(
        serde_json::from_str::<Value>(&body).unwrap()["error"],
        "request body too large"
    );
    relay.plain("GET", "/v2/relay/info", "").await.assert_ok();
    relay.stop().await;
}

// ---- enrolment -------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn enrol_challenge_is_single_use_and_expires() {
    let relay = Relay::start().await;
    let h = Host::new("laptop");
    let challenge = relay.challenge(&h).await;
    let body = h.enrol_body(&challenge);
    let r = relay.plain("POST", "/v1/relay/enrol", &body).await;
    assert_eq!(r.assert_ok(), &json!({"ok": true}));
    let r = relay.plain("POST", "/v1/relay/enrol", &body).await;
    r.assert_error(401, "no pending challenge", "NO_CHALLENGE");

    // A challenge is valid for 5 minutes.
    let challenge = relay.challenge(&h).await;
    relay.clock.advance(299_999);
    let r = relay
        .plain("POST", "/v1/relay/enrol", &h.enrol_body(&challenge))
        .await;
    r.assert_ok();
    let challenge = relay.challenge(&h).await;
    relay.clock.advance(300_001);
    let r = relay
        .plain("POST", "/v1/relay/enrol", &h.enrol_body(&challenge))
        .await;
    r.assert_error(401, "no pending challenge", "NO_CHALLENGE");

    // A new challenge replaces the pending one.
    let old = relay.challenge(&h).await;
    let new = relay.challenge(&h).await;
    assert_ne!(old, new);
    let r = relay
        .plain("POST", "/v1/relay/enrol", &h.enrol_body(&old))
        .await;
    r.assert_error(401, "bad enrolment signature", "BAD_SIGNATURE");

    // Another key cannot use someone's challenge.
    let other = Host::new("other");
    let challenge = relay.challenge(&h).await;
    let r = relay
        .plain("POST", "/v1/relay/enrol", &other.enrol_body(&challenge))
        .await;
    r.assert_error(401, "no pending challenge", "NO_CHALLENGE");
    relay.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn enrol_refusals() {
    let relay = Relay::start().await;
    let h = Host::new("laptop");
    let pk = h.pubkey();
    // Challenge field checks.
    for (body, err) in [
        (json!({}), "missing host or pubkey"),
        (json!({"host": "laptop"}), "missing host or pubkey"),
        (json!({"host": 5, "pubkey": pk}), "missing host or pubkey"),
        (json!({"host": "bad name", "pubkey": pk}), "bad host name"),
        (json!({"host": "-lead", "pubkey": pk}), "bad host name"),
        (
            json!({"host": "x".repeat(64), "pubkey": pk}),
            "bad host name",
        ),
        (json!({"host": "laptop", "pubkey": "abc"}), "bad host key"),
        (
            json!({"host": "laptop", "pubkey": b64::encode(&[1u8; 31])}),
            "bad host key",
        ),
    ] {
        let r = relay
            .plain("POST", "/v1/relay/challenge", &body.to_string())
            .await;
        r.assert_error(400, err, "BAD_REQUEST");
    }
    let r = relay.plain("POST", "/v1/relay/challenge", "nope").await;
    r.assert_error(400, "missing host or pubkey", "BAD_REQUEST");
    // 63-character names are fine.
    let long = Host::new(&"x".repeat(63));
    relay.enrol(&long).await;

    // Enrol field checks.
    let challenge = relay.challenge(&h).await;
    let good: Value = serde_json::from_str(&h.enrol_body(&challenge)).unwrap();
    let with = |k: &str, v: Value| {
        let mut b = good.clone();
        b[k] = v;
        b.to_string()
    };
    let without = |k: &str| {
        let mut b = good.clone();
        b.as_object_mut().unwrap().remove(k);
        b.to_string()
    };
    for (body, status, err, code) in [
        (without("sig"), 400, "incomplete enrolment", "BAD_REQUEST"),
        (without("host"), 400, "incomplete enrolment", "BAD_REQUEST"),
        (
            with("sig", json!(5)),
            400,
            "incomplete enrolment",
            "BAD_REQUEST",
        ),
        ("[]".to_owned(), 400, "incomplete enrolment", "BAD_REQUEST"),
        (
            with("host", json!("bad name")),
            400,
            "bad host name or owner_fp",
            "BAD_REQUEST",
        ),
        (
            with("owner_fp", json!("x".repeat(65))),
            400,
            "bad host name or owner_fp",
            "BAD_REQUEST",
        ),
        (
            with("owner_fp", json!("a b")),
            400,
            "bad host name or owner_fp",
            "BAD_REQUEST",
        ),
        (
            with("pubkey", json!("abc")),
            400,
            "bad host key",
            "BAD_REQUEST",
        ),
    ] {
        let r = relay.plain("POST", "/v1/relay/enrol", &body).await;
        r.assert_error(status, err, code);
    }
    // A bad signature (signed over another host name).
    let r = relay
        .plain(
            "POST",
            "/v1/relay/enrol",
            &with("sig", json!(h.key.sign(b"other"))),
        )
        .await;
    r.assert_error(401, "bad enrolment signature", "BAD_SIGNATURE");
    // That attempt did not use up the challenge (only a valid signature does): the good body
    // enrols, once.
    let r = relay
        .plain("POST", "/v1/relay/enrol", &good.to_string())
        .await;
    assert_eq!(r.assert_ok(), &json!({"ok": true}));
    let r = relay
        .plain("POST", "/v1/relay/enrol", &good.to_string())
        .await;
    r.assert_error(401, "no pending challenge", "NO_CHALLENGE");
    // A host signing another name than the one it sends.
    let challenge = relay.challenge(&h).await;
    let mut forged: Value = serde_json::from_str(&h.enrol_body(&challenge)).unwrap();
    forged["host"] = json!("desktop");
    let r = relay
        .plain("POST", "/v1/relay/enrol", &forged.to_string())
        .await;
    r.assert_error(401, "bad enrolment signature", "BAD_SIGNATURE");
    relay.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn enrol_is_idempotent_and_revocation_sticks() {
    let relay = Relay::start().await;
    let (a, b) = two_hosts(&relay).await;
    let (id, _, _) = push_one(&relay, &a, &b, "kept across re-enrolment").await;
    // Re-enrolling is idempotent: same queue, same answer.
    relay.enrol(&b).await;
    relay.enrol(&b).await;
    assert_eq!(relay.queue_ids(&b).await, vec![id]);
    let info = relay.hop(&b, "GET", "/v2/relay/info", "").await;
    assert_eq!(info.assert_ok()["you"]["host"], "beta");
    assert_eq!(info.json["you"]["head_seq"], T0);

    let (ad, sig) = b.enc_ad(relay.now());
    let body = json!({"ad": ad, "sig": sig}).to_string();
    let r = relay.hop(&b, "POST", "/v2/relay/enc-key", &body).await;
    r.assert_ok();
    let enc_target = format!("/v2/relay/enc-key?pubkey={}", b64_query(&b.pubkey()));
    relay.hop(&a, "GET", &enc_target, "").await.assert_ok();

    relay.revoke(&b).await;
    // A revoked key's ad is no longer served.
    let r = relay.hop(&a, "GET", &enc_target, "").await;
    r.assert_error(404, "unknown host", "NOT_FOUND");
    // Hops by a revoked key: 403 REVOKED.
    let r = relay.pull(&b, "after=0").await;
    r.assert_error(403, "this host key is revoked on this relay", "REVOKED");
    let r = relay.push(&b, vec![]).await;
    r.assert_error(403, "this host key is revoked on this relay", "REVOKED");
    let epoch = relay.epoch().await;
    let r = relay.ack(&b, &epoch, json!(0)).await;
    r.assert_error(403, "this host key is revoked on this relay", "REVOKED");
    // Re-enrolment does not clear it.
    let r = relay.enrol_try(&b).await;
    r.assert_error(403, "this host key is revoked on this relay", "REVOKED");
    // Signed info from a revoked key: no `you`.
    let info = relay.hop(&b, "GET", "/v2/relay/info", "").await;
    assert!(info.assert_ok().get("you").is_none(), "{info:#?}");
    // Nobody can push to it.
    let (id, wire) = sealed_wire(&a, &b, "too late", relay.now());
    let r = relay.push(&a, vec![env_item(&id, &b, &wire)]).await;
    assert_eq!(r.status1(), "rejected:target not enrolled");
    relay.stop().await;
}

/// An enrol body for `host` naming its key as `pubkey` (signed over that text).
fn enrol_body_as(host: &Host, pubkey: &str, challenge: &str) -> String {
    let sig = host
        .key
        .sign(records::enrol_canonical(challenge, &host.name, pubkey, "").as_bytes());
    json!({"host": host.name, "pubkey": pubkey, "owner_fp": "", "sig": sig}).to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn enrol_refuses_key_aliases_so_a_revoked_key_stays_out() {
    let relay = Relay::start().await;
    let (a, b) = two_hosts(&relay).await;
    relay.revoke(&b).await;
    let fresh = Host::new("fresh");
    for h in [&b, &fresh] {
        let alias = h.pubkey().trim_end_matches('=').to_owned();
        assert_ne!(alias, h.pubkey());
        // No challenge for an alias…
        let body = json!({"host": h.name, "pubkey": alias}).to_string();
        let r = relay.plain("POST", "/v1/relay/challenge", &body).await;
        r.assert_error(400, "bad host key", "BAD_REQUEST");
        // …and no enrolment, even over a challenge issued for the canonical text.
        let challenge = relay.challenge(h).await;
        let r = relay
            .plain(
                "POST",
                "/v1/relay/enrol",
                &enrol_body_as(h, &alias, &challenge),
            )
            .await;
        r.assert_error(400, "bad host key", "BAD_REQUEST");
    }
    // The revoked key is still revoked, and still refused under its real text.
    let r = relay.hop(&b, "GET", "/v2/relay/items", "").await;
    r.assert_error(403, "this host key is revoked on this relay", "REVOKED");
    let r = relay.enrol_try(&b).await;
    r.assert_error(403, "this host key is revoked on this relay", "REVOKED");
    let (id, wire) = sealed_wire(&a, &b, "to the revoked key", relay.now());
    let r = relay.push(&a, vec![env_item(&id, &b, &wire)]).await;
    assert_eq!(r.status1(), "rejected:target not enrolled");
    // One row per key: the fresh host was never enrolled under any text.
    let pk = fresh.pubkey();
    let row = relay.with_store(move |s| s.enrolment(&pk).unwrap()).await;
    assert_eq!(row, None);
    assert_eq!(
        relay
            .with_store(|s| s.live_enrolment_count().unwrap())
            .await,
        1
    );
    // Enrolled canonically, it authenticates with either padding in x-mbx-key.
    relay.enrol(&fresh).await;
    relay
        .hop(&fresh, "GET", "/v2/relay/items", "")
        .await
        .assert_ok();
    relay.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn enrol_capacity_is_503_full_but_known_keys_re_enrol() {
    let relay = Relay::start_with(limits(|l| l.max_live_enrolments = 2)).await;
    let (a, _b) = two_hosts(&relay).await;
    let c = Host::new("gamma");
    let r = relay.enrol_try(&c).await;
    r.assert_error(503, "relay enrolment capacity reached", "FULL");
    relay.enrol(&a).await;
    relay.stop().await;
}

// ---- enc-key ---------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn enc_key_publish_and_fetch() {
    let relay = Relay::start().await;
    let (a, b) = two_hosts(&relay).await;
    let now = relay.now();
    let (ad, sig) = b.enc_ad(now);
    let body = json!({"ad": ad, "sig": sig}).to_string();
    let r = relay.hop(&b, "POST", "/v2/relay/enc-key", &body).await;
    assert_eq!(r.assert_ok(), &json!({"ok": true}));

    // Fetched by key: the record as posted, its signature, and the same enc_pub.
    let target = format!("/v2/relay/enc-key?pubkey={}", b64_query(&b.pubkey()));
    let r = relay.hop(&a, "GET", &target, "").await;
    let j = r.assert_ok();
    assert_eq!(j["host"], "beta");
    assert_eq!(j["host_pubkey"], b.pubkey());
    assert_eq!(j["ad"], ad);
    assert_eq!(j["ad_sig"], sig.as_str());
    assert_eq!(j["enc_pub"], j["ad"]["enc_pub"]);
    assert_eq!(j["enc_pub"], b.enc.public().to_b64());
    let verified = records::verify_enc_ad(&j["ad"], j["ad_sig"].as_str(), &b.pubkey(), relay.now())
        .expect("the served ad verifies against the pinned key");
    assert_eq!(verified.enc_pub, b.enc.public().to_b64());
    // And by the same key without padding (looked up in canonical form).
    let unpadded = format!(
        "/v2/relay/enc-key?pubkey={}",
        b64_query(b.pubkey().trim_end_matches('='))
    );
    let r = relay.hop(&a, "GET", &unpadded, "").await;
    assert_eq!(r.assert_ok()["host_pubkey"], b.pubkey());
    assert_eq!(r.json["ad"], ad);
    // And by host name (one live enrolment carries it).
    let r = relay
        .hop(&a, "GET", "/v2/relay/enc-key?host=beta", "")
        .await;
    assert_eq!(r.assert_ok()["ad"], ad);
    // Unknown key or name, or no selector: 404.
    let unknown = format!(
        "/v2/relay/enc-key?pubkey={}",
        b64_query(&HostKey::generate().public().to_b64())
    );
    for t in [
        unknown.as_str(),
        "/v2/relay/enc-key?host=nobody",
        "/v2/relay/enc-key",
    ] {
        let r = relay.hop(&a, "GET", t, "").await;
        r.assert_error(404, "unknown host", "NOT_FOUND");
    }
    // Reading needs a hop.
    let r = relay.plain("GET", &target, "").await;
    r.assert_error(401, "bad relay hop", "BAD_HOP");
    // Signed info shows the caller's own ad.
    let info = relay.hop(&b, "GET", "/v2/relay/info", "").await;
    assert_eq!(
        info.assert_ok()["you"]["enc_ad"],
        json!({"enc_pub": b.enc.public().to_b64(), "exp": ad["exp"], "v1": false})
    );
    relay.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn enc_key_refusals() {
    let relay = Relay::start().await;
    let (a, b) = two_hosts(&relay).await;
    let now = relay.now();
    let (ad, sig) = b.enc_ad(now);
    let forged_sig = a.key.sign(
        agentmbx_protocol::canonical::to_string(&ad)
            .unwrap()
            .as_bytes(),
    );
    let (old_ad, old_sig) = b.enc_ad(now - 31 * 86_400_000);
    let (future_ad, future_sig) = b.enc_ad(now + 300_001);
    let (alpha_ad, alpha_sig) = a.enc_ad(now); // a valid ad, but alpha's
    let mut added = ad.clone();
    added["extra"] = json!(1);
    let mut bad_key = ad.clone();
    bad_key["enc_pub"] = json!("short");
    let cases: Vec<(String, &str)> = vec![
        (
            json!({"ad": ad, "sig": forged_sig}).to_string(),
            "bad signature",
        ),
        (
            json!({"ad": added, "sig": sig}).to_string(),
            "bad signature",
        ),
        (json!({"ad": old_ad, "sig": old_sig}).to_string(), "expired"),
        (
            json!({"ad": future_ad, "sig": future_sig}).to_string(),
            "not yet valid",
        ),
        (
            json!({"ad": alpha_ad, "sig": alpha_sig}).to_string(),
            "wrong peer",
        ),
        (json!({"ad": bad_key, "sig": sig}).to_string(), "malformed"),
        (json!({"ad": ad}).to_string(), "unsigned"),
        (json!({"ad": ad, "sig": ""}).to_string(), "unsigned"),
        (json!({"sig": sig}).to_string(), "malformed"),
        ("not json".to_owned(), "malformed"),
    ];
    for (body, why) in cases {
        let r = relay.hop(&b, "POST", "/v2/relay/enc-key", &body).await;
        r.assert_error(400, &format!("enc-key ad refused: {why}"), "BAD_REQUEST");
    }
    // Nothing was stored.
    let target = format!("/v2/relay/enc-key?pubkey={}", b64_query(&b.pubkey()));
    let r = relay.hop(&a, "GET", &target, "").await;
    r.assert_error(404, "unknown host", "NOT_FOUND");
    relay.stop().await;
}

// ---- info ------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn info_public_and_signed() {
    let relay = Relay::start().await;
    let (a, b) = two_hosts(&relay).await;
    let epoch = relay.epoch().await;
    let r = relay.plain("GET", "/v2/relay/info", "").await;
    assert_eq!(
        r.assert_ok(),
        &json!({
            "v": 2,
            "relay_pubkey": relay.relay_pub.to_b64(),
            "epoch": epoch,
            "version": agentmbx_relay::VERSION,
            "limits": {
                "max_item_bytes": 786_432,
                "max_batch": 200,
                "max_pull": 500,
                "max_pull_bytes": 8_388_608,
                "max_targets": 64,
                "retention_days": 14,
                "max_queue_items": 10_000,
                "max_queue_bytes": 52_428_800,
                "max_sender_items": 2_000,
                "max_sender_bytes": 20_971_520,
                "max_owner_items": 10_000,
                "max_owner_bytes": 52_428_800,
            },
        })
    );
    // Signed by an enrolled key: `you`.
    let r = relay.hop(&b, "GET", "/v2/relay/info", "").await;
    let mut you = r.assert_ok()["you"].clone();
    // A fresh single-use push stream nonce (16 random bytes, base64url) on every signed info.
    let nonce = you
        .as_object_mut()
        .and_then(|o| o.remove("stream_nonce"))
        .expect("a stream nonce");
    assert_eq!(nonce.as_str().map(str::len), Some(22), "{nonce}");
    assert_eq!(
        you,
        json!({"host": "beta", "pubkey": b.pubkey(), "head_seq": 0, "acked_through": 0, "enc_ad": null})
    );
    push_one(&relay, &a, &b, "x").await;
    let r = relay.hop(&b, "GET", "/v2/relay/info", "").await;
    assert_eq!(r.assert_ok()["you"]["head_seq"], T0);
    // An unknown key, a bad signature or a stale hop: the public answer, no `you`.
    let stranger = Host::new("stranger");
    let r = relay.hop(&stranger, "GET", "/v2/relay/info", "").await;
    assert!(r.assert_ok().get("you").is_none(), "{r:#?}");
    assert_eq!(r.json["epoch"], epoch);
    let h = with_header(
        b.hop_headers("GET", "/v2/relay/info", "", relay.now()),
        header::SIG,
        Some(&a.key.sign(b"x")),
    );
    let r = relay.send("GET", "/v2/relay/info", &h, vec![]).await;
    assert!(r.assert_ok().get("you").is_none(), "{r:#?}");
    let r = relay
        .hop_at(&b, "GET", "/v2/relay/info", "", relay.now() - 300_001)
        .await;
    assert!(r.assert_ok().get("you").is_none(), "{r:#?}");
    relay.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn info_publishes_configured_limits() {
    let relay = Relay::start_with(limits(|l| {
        l.max_item_bytes = 1234;
        l.max_batch = 7;
        l.max_pull = 9;
        l.max_pull_bytes = 4321;
        l.max_targets = 3;
        l.retention_days = 2;
    }))
    .await;
    let r = relay.plain("GET", "/v2/relay/info", "").await;
    let l = &r.assert_ok()["limits"];
    assert_eq!(
        (
            &l["max_item_bytes"],
            &l["max_batch"],
            &l["max_pull"],
            &l["max_pull_bytes"],
            &l["max_targets"],
            &l["retention_days"]
        ),
        (
            &json!(1234),
            &json!(7),
            &json!(9),
            &json!(4321),
            &json!(3),
            &json!(2)
        )
    );
    // And they are enforced.
    let (a, b) = two_hosts(&relay).await;
    let r = relay
        .push(
            &a,
            vec![json!({"kind": "envelope", "item_id": "x", "targets": []}); 8],
        )
        .await;
    r.assert_error(400, "more than 7 items in one push", "BAD_BATCH");
    let (id, wire) = sealed_wire(&a, &b, "x", relay.now());
    let four: Vec<(&Host, &[u8])> = vec![(&b, wire.as_bytes()); 4];
    let r = relay.push(&a, vec![item("envelope", &id, &four)]).await;
    assert_eq!(r.status1(), "rejected:bad targets");
    relay.stop().await;
}

// ---- store failure ---------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_store_stops_the_server_with_an_error() {
    let (relay, store) = Relay::start_failing().await;
    let (a, b) = two_hosts(&relay).await;
    push_one(&relay, &a, &b, "before the failure").await;
    store.fail("COMMIT failed: disk I/O error");
    let addr = relay.addr();
    let started = std::time::Instant::now();
    let err = relay
        .stopped()
        .await
        .expect_err("serve reports the failure");
    assert!(
        err.to_string().contains("COMMIT failed: disk I/O error"),
        "{err}"
    );
    assert!(started.elapsed() < std::time::Duration::from_secs(10));
    // Nothing listens any more.
    assert!(std::net::TcpStream::connect(addr).is_err());
}

// ---- routing ---------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unknown_routes_and_methods_are_json_404() {
    let relay = Relay::start().await;
    let (_a, b) = two_hosts(&relay).await;
    for (method, target) in [
        ("GET", "/"),
        ("GET", "/nope"),
        ("GET", "/v2/relay"),
        ("GET", "/v2/relay/items/"),
        ("GET", "/v2/relay/itemsx"),
        ("POST", "/v3/relay/items"),
        ("GET", "/v1/relay/challenge"),
        ("GET", "/v1/relay/enrol"),
        ("POST", "/v2/relay/info"),
        ("DELETE", "/v2/relay/items"),
        ("PUT", "/v2/relay/ack"),
        ("GET", "/v2/relay/ack"),
        ("PATCH", "/v2/relay/enc-key"),
        ("OPTIONS", "/v2/relay/info"),
    ] {
        let r = relay.plain(method, target, "").await;
        r.assert_error(404, "not found", "NOT_FOUND");
        // With a valid hop, too.
        let r = relay.hop(&b, method, target, "").await;
        r.assert_error(404, "not found", "NOT_FOUND");
    }
    relay.stop().await;
}

// ---- robustness ------------------------------------------------------------------------------

/// Junk JSON values, depth-limited.
fn junk_value(rng: &mut XorShift, depth: usize, pool: &[String]) -> Value {
    let pick = if depth >= 3 {
        rng.below(6)
    } else {
        rng.below(8)
    };
    match pick {
        0 => Value::Null,
        1 => json!(rng.one_in(2)),
        2 => junk_number(rng),
        3 | 4 => json!(rng.pick(pool)),
        5 => {
            let n = rng.below(40);
            json!(String::from_utf8_lossy(&rng.bytes(n)).into_owned())
        }
        6 => Value::Array(
            (0..rng.below(4))
                .map(|_| junk_value(rng, depth + 1, pool))
                .collect(),
        ),
        _ => {
            let keys = [
                "items",
                "kind",
                "item_id",
                "targets",
                "host_pubkey",
                "wire_b64",
                "epoch",
                "through",
                "ad",
                "sig",
                "host",
                "pubkey",
                "owner_fp",
                "v",
                "type",
                "enc_pub",
                "iat",
                "exp",
                "rec",
                "id",
                "enc",
                "body",
            ];
            let mut m = serde_json::Map::new();
            for _ in 0..rng.below(5) {
                let k = (*rng.pick(&keys)).to_owned();
                m.insert(k, junk_value(rng, depth + 1, pool));
            }
            Value::Object(m)
        }
    }
}

/// Replaces one random leaf (or subtree) of `v` with junk.
fn mutate(rng: &mut XorShift, v: &mut Value, pool: &[String]) {
    match v {
        Value::Object(m) if !m.is_empty() && !rng.one_in(4) => {
            let keys: Vec<String> = m.keys().cloned().collect();
            let k = rng.pick(&keys).clone();
            if rng.one_in(5) {
                m.remove(&k);
            } else if let Some(child) = m.get_mut(&k) {
                mutate(rng, child, pool);
            }
        }
        Value::Array(a) if !a.is_empty() && !rng.one_in(4) => {
            let i = rng.below(a.len());
            if rng.one_in(5) {
                let dup = a[i].clone();
                a.push(dup);
            } else {
                mutate(rng, &mut a[i], pool);
            }
        }
        // Mostly keep the type (so the body still parses and reaches deeper checks).
        Value::String(_) if !rng.one_in(4) => *v = json!(rng.pick(pool)),
        Value::Number(_) if !rng.one_in(4) => *v = junk_number(rng),
        _ => *v = junk_value(rng, 2, pool),
    }
}

/// A junk JSON number.
fn junk_number(rng: &mut XorShift) -> Value {
    rng.pick(&[
        json!(0),
        json!(-1),
        json!(1.5),
        json!(1e300),
        json!(-1e300),
        json!(MAX_SAFE_INT),
        json!(MAX_SAFE_INT + 1),
        json!(i64::MIN),
        json!(u64::MAX),
        json!(T0),
    ])
    .clone()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn junk_never_breaks_the_server() {
    let relay = Relay::start().await;
    let (a, b) = two_hosts(&relay).await;
    let now = relay.now();
    let (id, wire) = sealed_wire(&a, &b, "valid", now);
    let (rid, rwire) = receipt_wire(&a, "01KDVDNA3VG2MH8KWSQRCWJZ0S", 1, now);
    let (ad, ad_sig) = a.enc_ad(now);
    let epoch = relay.epoch().await;
    let challenge_body = json!({"host": "junkhost", "pubkey": a.pubkey()});
    let enrol_body: Value = serde_json::from_str(&a.enrol_body("c")).unwrap();
    let valid: Vec<(&str, Value)> = vec![
        (
            "/v2/relay/items",
            json!({"items": [env_item(&id, &b, &wire), item("receipt", &rid, &[(&b, rwire.as_bytes())])]}),
        ),
        ("/v2/relay/ack", json!({"epoch": epoch, "through": 0})),
        ("/v2/relay/enc-key", json!({"ad": ad, "sig": ad_sig})),
        ("/v1/relay/challenge", challenge_body),
        ("/v1/relay/enrol", enrol_body),
    ];
    let pool: Vec<String> = vec![
        String::new(),
        a.pubkey(),
        b.pubkey(),
        id.clone(),
        rid.clone(),
        epoch.clone(),
        "envelope".into(),
        "receipt".into(),
        "expired".into(),
        b64::encode(wire.as_bytes()),
        b64::encode(rwire.as_bytes()),
        b64::encode(b"{}"),
        b64::encode(b"[]"),
        b64::encode(&[0xff; 10]),
        "!!".into(),
        "=".into(),
        "x".repeat(301),
        "😀".repeat(200),
        "\u{0}\u{1}\u{2028}".into(),
        "a".repeat(5000),
        "laptop".into(),
        iso_ms(now),
    ];
    let gets = ["/v2/relay/items", "/v2/relay/enc-key", "/v2/relay/info"];
    let query_chars = b"abcz0129-._~%=&+/";
    let mut rng = XorShift::new(0x5EED_1234_ABCD_0001);
    let mut seen: std::collections::BTreeMap<(String, u16), usize> = Default::default();
    for iter in 0..300 {
        let get = rng.one_in(6);
        let (method, target, body): (&str, String, Vec<u8>) = if get {
            let path = *rng.pick(&gets);
            let q: String = (0..rng.below(30))
                .map(|_| *rng.pick(&query_chars[..]) as char)
                .collect();
            let q = match rng.below(3) {
                0 => q,
                1 => format!("after={q}&limit={}", rng.below(1000)),
                _ => format!("epoch={q}&pubkey={}", b64_query(&b.pubkey())),
            };
            ("GET", format!("{path}?{q}"), vec![])
        } else {
            let (path, good) = rng.pick(&valid).clone();
            let body = match rng.below(7) {
                6 => good.to_string().into_bytes(),
                0 => {
                    let n = rng.below(300);
                    rng.bytes(n)
                }
                1 => junk_value(&mut rng, 0, &pool).to_string().into_bytes(),
                2 => {
                    let n = *rng.pick(&[1usize, 127, 128, 129, 1000, 100_000]);
                    let open = *rng.pick(&["[", "{\"a\":", "[{\"items\":"]);
                    format!("{}{}", open.repeat(n), "]".repeat(rng.below(n + 1))).into_bytes()
                }
                3 | 4 => {
                    let mut v = good.clone();
                    for _ in 0..=rng.below(3) {
                        mutate(&mut rng, &mut v, &pool);
                    }
                    v.to_string().into_bytes()
                }
                _ => {
                    let s = good.to_string();
                    let cut = rng.below(s.len());
                    s.as_bytes()[..cut].to_vec()
                }
            };
            ("POST", path.to_owned(), body)
        };
        let text = String::from_utf8_lossy(&body).into_owned();
        let signer = if rng.one_in(2) { &a } else { &b };
        let headers = match rng.below(10) {
            0 => vec![],
            1 => signer.hop_headers(method, &target, &text, now - 400_000),
            _ => signer.hop_headers(method, &target, &text, relay.now()),
        };
        let r = relay.send(method, &target, &headers, body.clone()).await;
        let what = format!(
            "iteration {iter}: {method} {target} body {:?} → {r:#?}",
            text.chars().take(300).collect::<String>()
        );
        let path = target.split('?').next().unwrap_or("").to_owned();
        *seen
            .entry((format!("{method} {path}"), r.status))
            .or_default() += 1;
        assert!(r.status < 500, "{what}");
        assert!(r.content_type.starts_with("application/json"), "{what}");
        assert!(r.json.is_object(), "{what}");
        if r.status == 200 {
            if method == "POST" && target == "/v2/relay/items" {
                // `{items:[…]}`, or the same struct as a JSON array (serde's struct-from-seq).
                let sent: Value = serde_json::from_slice(&body).unwrap();
                let items = if sent.is_array() {
                    &sent[0]
                } else {
                    &sent["items"]
                };
                let n = items.as_array().expect(&what).len();
                let results = r.json["results"].as_array().expect(&what);
                assert_eq!(results.len(), n, "{what}");
                for res in results {
                    let s = res["status"].as_str().expect(&what);
                    assert!(
                        s == "accepted" || s == "duplicate" || s.starts_with("rejected:"),
                        "{what}"
                    );
                }
            }
        } else {
            assert!(!r.str("error").is_empty(), "{what}");
            assert!(!r.str("code").is_empty(), "{what}");
        }
    }
    // The loop reached past the hop check into every handler's own validation.
    eprintln!("junk answers (request, status) → count: {seen:?}");
    for (request, status) in [
        ("POST /v2/relay/items", 200),
        ("POST /v2/relay/items", 400),
        ("POST /v2/relay/ack", 400),
        ("POST /v2/relay/enc-key", 400),
        ("POST /v1/relay/challenge", 400),
        ("POST /v1/relay/enrol", 400),
    ] {
        assert!(
            seen.contains_key(&(request.to_owned(), status)),
            "no {status} for {request}: {seen:?}"
        );
    }
    // Still up and still correct.
    relay.plain("GET", "/v2/relay/info", "").await.assert_ok();
    let (id2, wire2) = sealed_wire(&a, &b, "after the storm", relay.now() + 1);
    let r = relay.push(&a, vec![env_item(&id2, &b, &wire2)]).await;
    assert_eq!(r.status1(), "accepted");
    assert!(relay.queue_ids(&b).await.contains(&id2));
    relay.stop().await;
}

#[tokio::test]
async fn a_request_that_stalls_past_the_timeout_is_408() {
    let relay = Relay::start_with_config(agentmbx_relay::config::RelayConfig {
        request_timeout_ms: Some(300),
        ..Default::default()
    })
    .await;
    let addr = relay.addr();
    // The body is declared but never finished: the relay gives up after its request timeout.
    let (status, body, waited) = tokio::task::spawn_blocking(move || {
        raw_exchange(
            &addr,
            "POST /v1/relay/challenge HTTP/1.1\r\nhost: relay\r\ncontent-length: 1000\r\n\r\n",
            &[b"{\"host\":".to_vec()],
        )
    })
    .await
    .unwrap();
    assert_eq!(status, 408, "{body}");
    assert_eq!(
        serde_json::from_str::<Value>(&body).unwrap(),
        json!({"error": "request timeout", "code": "TIMEOUT"})
    );
    assert!((0.25..10.0).contains(&waited), "waited {waited} s");
    // A normal request on the same relay is unaffected.
    relay.plain("GET", "/v2/relay/info", "").await.assert_ok();
}

// ---- connections: header-read and keep-alive timeouts, graceful shutdown, connection bound ----

/// Asserts the server closed the connection `at` seconds into the wait, within `lo..hi`, with
/// nothing sent or with a 408.
#[track_caller]
fn assert_closed_within(closed: Closed, lo: f64, hi: f64) {
    match closed {
        Closed::After(at, sent) => {
            assert!(
                (lo..hi).contains(&at),
                "closed after {at} s, not in {lo}..{hi}"
            );
            assert!(
                sent.is_empty() || sent.starts_with("HTTP/1.1 408"),
                "unexpected answer {sent:?}"
            );
        }
        Closed::StillOpen => {
            panic!("the connection is still open (expected a close in {lo}..{hi} s)")
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_stalls_or_trickles_its_headers_is_cut_off_at_the_header_timeout() {
    let relay = Relay::start_with_config(agentmbx_relay::config::RelayConfig {
        header_read_timeout_ms: Some(1000),
        ..Default::default()
    })
    .await;
    let addr = relay.addr();
    let stalled = tokio::task::spawn_blocking({
        let addr = addr.clone();
        move || {
            let mut c = RawConn::connect(&addr);
            c.send(b"GET /v2/relay/info HTTP/1.1\r\nhost: re").unwrap();
            c.wait_closed(std::time::Duration::from_secs(15))
        }
    });
    // A slow-loris client: one more header byte every 100 ms never completes the head.
    let trickled = tokio::task::spawn_blocking({
        let addr = addr.clone();
        move || {
            let mut c = RawConn::connect(&addr);
            c.send(b"POST /v2/relay/items HTTP/1.1\r\nhost: relay\r\nx-slow: ")
                .unwrap();
            let mut w = c.writer();
            let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
            let trickle = std::thread::spawn({
                let stop = stop.clone();
                move || {
                    use std::io::Write;
                    while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                        if w.write_all(b"a").is_err() {
                            return;
                        }
                        std::thread::sleep(std::time::Duration::from_millis(100));
                    }
                }
            });
            let closed = c.wait_closed(std::time::Duration::from_secs(15));
            stop.store(true, std::sync::atomic::Ordering::Relaxed);
            trickle.join().unwrap();
            closed
        }
    });
    assert_closed_within(stalled.await.unwrap(), 0.8, 6.0);
    assert_closed_within(trickled.await.unwrap(), 0.8, 6.0);
    // Other clients are unaffected.
    relay.plain("GET", "/v2/relay/info", "").await.assert_ok();
    relay.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_header_timeout_also_closes_a_silent_kept_alive_connection() {
    // hyper's header-read timer starts again as soon as a kept-alive connection waits for its
    // next request: with headers 1 s and keep-alive 5 s, a silent connection closes at 1 s.
    let relay = Relay::start_with_config(agentmbx_relay::config::RelayConfig {
        header_read_timeout_ms: Some(1000),
        ..Default::default()
    })
    .await;
    let addr = relay.addr();
    let closed = tokio::task::spawn_blocking(move || {
        let mut c = RawConn::connect(&addr);
        let (status, _, body) = c.get("/v2/relay/info");
        assert_eq!(status, 200, "{body}");
        c.wait_closed(std::time::Duration::from_secs(15))
    })
    .await
    .unwrap();
    assert_closed_within(closed, 0.8, 4.0);
    relay.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_kept_alive_connection_is_closed_after_the_keep_alive_timeout() {
    // Keep-alive 1 s, headers at their 10 s default: the idle close is the keep-alive timer's.
    let relay = Relay::start_with_config(agentmbx_relay::config::RelayConfig {
        keep_alive_timeout_ms: Some(1000),
        ..Default::default()
    })
    .await;
    let addr = relay.addr();
    let (kept, fresh) = tokio::task::spawn_blocking(move || {
        let mut c = RawConn::connect(&addr);
        // Each request restarts the idle timer: 3 requests 600 ms apart span more than 1 s.
        for i in 0..3 {
            if i > 0 {
                std::thread::sleep(std::time::Duration::from_millis(600));
            }
            let (status, head, body) = c.get("/v2/relay/info");
            assert_eq!(status, 200, "request {i}: {body}");
            assert!(!head.contains("connection: close"), "{head}");
        }
        let kept = c.wait_closed(std::time::Duration::from_secs(15));
        // A connection that never sends anything is idle from the start.
        let mut silent = RawConn::connect(&addr);
        (kept, silent.wait_closed(std::time::Duration::from_secs(15)))
    })
    .await
    .unwrap();
    assert_closed_within(kept, 0.8, 5.0);
    assert_closed_within(fresh, 0.8, 5.0);
    relay.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_keep_alive_client_makes_several_requests_on_one_connection() {
    let relay = Relay::start().await;
    let addr = relay.addr();
    let host = Host::new("alpha");
    let challenge = json!({"host": "alpha", "pubkey": host.pubkey()}).to_string();
    tokio::task::spawn_blocking(move || {
        let mut c = RawConn::connect(&addr);
        let (status, _, body) = c.get("/v2/relay/info");
        assert_eq!(status, 200, "{body}");
        c.send(
            format!(
                "POST /v1/relay/challenge HTTP/1.1\r\nhost: relay\r\ncontent-type: \
                 application/json\r\ncontent-length: {}\r\n\r\n{challenge}",
                challenge.len()
            )
            .as_bytes(),
        )
        .unwrap();
        let (status, _, body) = c.response();
        assert_eq!(status, 200, "{body}");
        assert!(serde_json::from_str::<Value>(&body).unwrap()["challenge"].is_string());
        let (status, _, body) = c.get("/nope");
        assert_eq!(status, 404, "{body}");
        // Two requests in one write (pipelined) are answered in order.
        c.send(b"GET /v2/relay/info HTTP/1.1\r\nhost: relay\r\n\r\nGET /x HTTP/1.1\r\nhost: relay\r\n\r\n")
            .unwrap();
        assert_eq!(c.response().0, 200);
        assert_eq!(c.response().0, 404);
        let (status, _, body) = c.get("/v2/relay/info");
        assert_eq!(status, 200, "{body}");
    })
    .await
    .unwrap();
    relay.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn graceful_shutdown_lets_a_request_in_flight_finish() {
    let relay = Relay::start().await;
    let addr = relay.addr();
    let host = Host::new("alpha");
    let body = json!({"host": "alpha", "pubkey": host.pubkey()}).to_string();
    let (first, rest) = body.split_at(body.len() / 2);
    let (first, rest) = (first.to_owned(), rest.to_owned());
    // A request whose head and half its body arrived: in flight, waiting for the rest.
    let mut c = tokio::task::spawn_blocking({
        let addr = addr.clone();
        move || {
            let mut c = RawConn::connect(&addr);
            c.send(
                format!(
                    "POST /v1/relay/challenge HTTP/1.1\r\nhost: relay\r\ncontent-length: {}\r\n\r\n{first}",
                    body.len()
                )
                .as_bytes(),
            )
            .unwrap();
            c
        }
    })
    .await
    .unwrap();
    // Wait until the server has read the head and the handler runs (the request is in flight).
    let began = std::time::Instant::now();
    while relay
        .state
        .in_flight
        .load(std::sync::atomic::Ordering::SeqCst)
        == 0
    {
        assert!(
            began.elapsed() < std::time::Duration::from_secs(10),
            "request never started"
        );
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
    let stopping = tokio::spawn(relay.stop());
    // Shutdown began: the listener is closed…
    let began = std::time::Instant::now();
    while std::net::TcpStream::connect(&addr).is_ok() {
        assert!(
            began.elapsed() < std::time::Duration::from_secs(10),
            "still listening"
        );
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    // …but `serve` waits for the request in flight.
    tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    assert!(
        !stopping.is_finished(),
        "serve returned with a request in flight"
    );
    let (status, head, answer, closed) = tokio::task::spawn_blocking(move || {
        c.send(rest.as_bytes()).unwrap();
        let (status, head, answer) = c.response();
        (
            status,
            head,
            answer,
            c.wait_closed(std::time::Duration::from_secs(10)),
        )
    })
    .await
    .unwrap();
    assert_eq!(status, 200, "{answer}");
    assert!(serde_json::from_str::<Value>(&answer).unwrap()["challenge"].is_string());
    // No more requests on that connection: it says so and closes.
    assert!(head.contains("connection: close"), "{head}");
    assert_closed_within(closed, 0.0, 10.0);
    tokio::time::timeout(std::time::Duration::from_secs(10), stopping)
        .await
        .expect("serve returned once the request finished")
        .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_past_max_connections_wait_for_a_free_slot() {
    let relay = Relay::start_with_config(agentmbx_relay::config::RelayConfig {
        max_connections: Some(2),
        ..Default::default()
    })
    .await;
    let addr = relay.addr();
    tokio::task::spawn_blocking(move || {
        let mut one = RawConn::connect(&addr);
        let mut two = RawConn::connect(&addr);
        assert_eq!(one.get("/v2/relay/info").0, 200);
        assert_eq!(two.get("/v2/relay/info").0, 200);
        // A third connection waits in the backlog: no answer while both slots are taken…
        let mut three = RawConn::connect(&addr);
        three
            .send(b"GET /v2/relay/info HTTP/1.1\r\nhost: relay\r\n\r\n")
            .unwrap();
        assert_eq!(
            three.try_response(std::time::Duration::from_millis(300)),
            None
        );
        // …and is served once one closes.
        drop(one);
        let (status, _, body) = three.response();
        assert_eq!(status, 200, "{body}");
        assert_eq!(two.get("/v2/relay/info").0, 200);
    })
    .await
    .unwrap();
    relay.stop().await;
}

/// `GET /v2/relay/admin/stats` with the admin token, parsed.
async fn writer_stats(relay: &Relay, token: &str) -> Resp {
    let auth = vec![("authorization".to_owned(), format!("Bearer {token}"))];
    relay
        .send("GET", "/v2/relay/admin/stats", &auth, Vec::new())
        .await
}

#[tokio::test]
async fn admin_stats_counts_the_writers_requests_and_commits_behind_the_admin_token() {
    use agentmbx_relay::config::{AdminToken, RelayConfig};
    const ADMIN: &str = "admin-token-0123456789abcdef";
    // No admin token configured: the route does not exist.
    let relay = Relay::start().await;
    writer_stats(&relay, ADMIN)
        .await
        .assert_error(404, "not found", "NOT_FOUND");
    relay.stop().await;

    let relay = Relay::start_with_config(RelayConfig {
        admin_token: Some(AdminToken::new(ADMIN).unwrap()),
        ..RelayConfig::default()
    })
    .await;
    writer_stats(&relay, "wrong-token-0123456789abcdef")
        .await
        .assert_error(401, "admin token required", "ADMIN_TOKEN");
    let (a, b) = two_hosts(&relay).await;
    let before = writer_stats(&relay, ADMIN).await.assert_ok().clone();
    let now = relay.now();
    let items: Vec<Value> = (0..3)
        .map(|i| {
            let (id, wire) = sealed_wire(&a, &b, &format!("hello {i}"), now);
            env_item(&id, &b, &wire)
        })
        .collect();
    assert_eq!(
        relay.push(&a, items).await.statuses(),
        ["accepted", "accepted", "accepted"]
    );
    let after = writer_stats(&relay, ADMIN).await.assert_ok().clone();
    let delta = |k: &str| after[k].as_u64().unwrap() - before[k].as_u64().unwrap();
    // The push is one write request committed in a group (the heartbeat and the retention
    // sweep write too, so other requests may have joined in the meantime).
    assert!(delta("write_requests") >= 1, "{before} → {after}");
    assert!(delta("commits") >= 1, "{before} → {after}");
    for s in [&before, &after] {
        let n = |k: &str| s[k].as_u64().unwrap();
        assert!(n("commits") <= n("groups"), "{s}");
        assert!(n("groups") <= n("write_requests"), "{s}");
    }
    // The two enrolments were writes too, counted since the store opened.
    assert!(before["commits"].as_u64().unwrap() >= 2, "{before}");
    relay.stop().await;
}
