//! Quotas and bounds over HTTP (spec §7; `wire.md` §3.2 "Quotas", "Push", "Pull", "Resolved
//! details: Units"): every quota at its bound (accepted) and one past it (the whole item
//! refused with `rejected:quota:<which> exceeded for <host>`, nothing stored, no seq used, no
//! dedup row), also for a fan-out item where only one target is over; quotas come from
//! `relay.toml` `[limits]` and are published in info `limits`; a target drained by ack has
//! room again; a self-asserted owner fingerprint is never charged; and the request and page
//! bounds at their default numbers: the body cap while streaming, `max_batch`, `max_pull` and
//! `max_pull_bytes`.
//!
//! Small configured quotas keep the tests fast; one test pins the defaults to the spec's
//! numbers. Complements `http.rs` (batch 200/201, pull paging, body caps of unsigned and
//! oversized uploads, fan-out over a full queue depth) and the store's unit tests.
#![allow(clippy::unwrap_used)] // Tests may unwrap (clippy.toml); the helpers use `expect`.

use std::path::Path;

use serde_json::{json, Value};

use agentmbx_protocol::limits::{MAX_ITEM_BYTES, MAX_PULL, MAX_PULL_BYTES, RELAY_MAX_BODY};
use agentmbx_protocol::records;

use agentmbx_relay::config::{LimitsConfig, RelayConfig};
use agentmbx_relay::store::{self, AuthorityStrength, EnrolOutcome, StoreLimits};

use crate::helper::*;

/// A relay configured by `relay.toml` text (parsed and validated as `relay serve` does).
async fn relay_toml(text: &str) -> Relay {
    let cfg = RelayConfig::parse(text, Path::new("relay.toml")).expect("a valid relay.toml");
    Relay::start_with_config(cfg).await
}

/// Enrolled hosts with these names (over HTTP, no owner claim).
async fn hosts(relay: &Relay, names: &[&str]) -> Vec<Host> {
    let mut out = Vec::new();
    for n in names {
        let h = Host::new(n);
        relay.enrol(&h).await;
        out.push(h);
    }
    out
}

/// Enrols `host` over HTTP with a self-asserted `owner_fp` (an unproven claim).
async fn enrol_claiming(relay: &Relay, host: &Host, owner_fp: &str) {
    let challenge = relay.challenge(host).await;
    let pk = host.pubkey();
    let sig = host
        .key
        .sign(records::enrol_canonical(&challenge, &host.name, &pk, owner_fp).as_bytes());
    let body = json!({"host": host.name, "pubkey": pk, "owner_fp": owner_fp, "sig": sig});
    let r = relay
        .plain("POST", "/v1/relay/enrol", &body.to_string())
        .await;
    assert_eq!(r.assert_ok(), &json!({"ok": true}), "{r:#?}");
}

/// Enrols `host` as an account authority does: a proven `account` (and an owner claim that
/// decides nothing).
async fn enrol_in_account(relay: &Relay, host: &Host, account: &str, owner_fp: &str) {
    let req = store::EnrolRequest {
        host_pubkey: host.pubkey(),
        host_name: host.name.clone(),
        owner_fp: owner_fp.to_owned(),
        account: Some(account.to_owned()),
        authorized_by: "account-token".into(),
        strength: AuthorityStrength::Account,
        now_ms: relay.now(),
    };
    let out = relay.with_store(move |s| s.enrol(req)).await;
    assert!(matches!(out, Ok(EnrolOutcome::Enrolled(_))), "{out:?}");
}

/// A sealed envelope from `from` for `to`, padded with JSON whitespace to exactly `len` bytes
/// (every one gets a fresh id): `(id, wire)`.
fn wire_of(relay: &Relay, from: &Host, to: &Host, len: usize) -> (String, Vec<u8>) {
    let (id, wire) = sealed_wire(from, to, "bounds", relay.now());
    assert!(wire.len() <= len, "{} > {len}", wire.len());
    let mut bytes = wire.into_bytes();
    bytes.resize(len, b' ');
    (id, bytes)
}

/// The smallest wire length the tests pad to (a sealed envelope fits in it).
const L: usize = 4_096;

/// Pushes one envelope item with `wire` for `targets` from `from`; returns its status.
async fn push(relay: &Relay, from: &Host, id: &str, targets: &[&Host], wire: &[u8]) -> String {
    let t: Vec<(&Host, &[u8])> = targets.iter().map(|h| (*h, wire)).collect();
    relay
        .push(from, vec![item("envelope", id, &t)])
        .await
        .status1()
}

/// Pushes a fresh `len`-byte envelope from `from` to `to`; returns its status.
async fn push_new(relay: &Relay, from: &Host, to: &Host, len: usize) -> String {
    let (id, wire) = wire_of(relay, from, to, len);
    push(relay, from, &id, &[to], &wire).await
}

/// `(items queued, head_seq)` of `host`'s queue, from its own pull.
async fn queue(relay: &Relay, host: &Host) -> (usize, i64) {
    let r = relay.pull(host, "after=0&limit=500").await;
    let j = r.assert_ok();
    (
        j["items"].as_array().unwrap().len(),
        j["head_seq"].as_i64().unwrap(),
    )
}

/// Acks `host`'s whole queue (through its head).
async fn drain(relay: &Relay, host: &Host) {
    let epoch = relay.epoch().await;
    let head = queue(relay, host).await.1;
    relay.ack(host, &epoch, json!(head)).await.assert_ok();
}

const QUEUE_DEPTH: &str = "rejected:quota:queue depth exceeded for beta";
const QUEUE_BYTES: &str = "rejected:quota:queue bytes exceeded for beta";
const SENDER_SHARE: &str = "rejected:quota:sender share exceeded for beta";

// ---- defaults and configuration ---------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_default_quotas_are_the_spec_numbers_in_mib_and_published() {
    // `wire.md` "Units": 50 MB and 20 MB are MiB, as 0.5.x publishes them.
    assert_eq!(52_428_800, 50 * 1024 * 1024);
    assert_eq!(20_971_520, 20 * 1024 * 1024);
    let want: [(&str, u64); 6] = [
        ("max_queue_items", 10_000),
        ("max_queue_bytes", 52_428_800),
        ("max_sender_items", 2_000),
        ("max_sender_bytes", 20_971_520),
        ("max_owner_items", 10_000),
        ("max_owner_bytes", 52_428_800),
    ];
    // The store's defaults, the configuration's, and an empty relay.toml's are the same.
    let s = StoreLimits::default();
    assert_eq!(
        [
            s.max_queue_items,
            s.max_queue_bytes,
            s.max_sender_items,
            s.max_sender_bytes,
            s.max_owner_items,
            s.max_owner_bytes
        ],
        want.map(|(_, v)| v)
    );
    assert_eq!(LimitsConfig::default().store_limits(), s);
    let empty = RelayConfig::parse("", Path::new("relay.toml")).unwrap();
    assert_eq!(empty.limits, LimitsConfig::default());
    // The request and page bounds.
    assert_eq!(
        (
            LimitsConfig::default().max_batch,
            MAX_PULL,
            MAX_PULL_BYTES,
            RELAY_MAX_BODY
        ),
        (200, 500, 8 * 1024 * 1024, 8 * 1024 * 1024)
    );

    // Published as such by a relay started on an empty relay.toml.
    let relay = relay_toml("").await;
    let r = relay.plain("GET", "/v2/relay/info", "").await;
    let limits = &r.assert_ok()["limits"];
    for (key, value) in want {
        assert_eq!(limits[key], value, "{key}");
    }
    relay.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn quotas_come_from_relay_toml_and_are_published() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(
        dir.path().join("relay.toml"),
        "[limits]\nmax_queue_items = 11\nmax_queue_bytes = 22222\nmax_sender_items = 3\n\
         max_sender_bytes = 4444\nmax_owner_items = 5\nmax_owner_bytes = 66666\n",
    )
    .unwrap();
    let cfg = RelayConfig::load(dir.path()).unwrap();
    let relay = Relay::start_with_config(cfg).await;
    let r = relay.plain("GET", "/v2/relay/info", "").await;
    let l = &r.assert_ok()["limits"];
    assert_eq!(
        [
            &l["max_queue_items"],
            &l["max_queue_bytes"],
            &l["max_sender_items"],
            &l["max_sender_bytes"],
            &l["max_owner_items"],
            &l["max_owner_bytes"]
        ],
        [
            &json!(11),
            &json!(22222),
            &json!(3),
            &json!(4444),
            &json!(5),
            &json!(66666)
        ]
    );
    // The other limits keep their defaults.
    assert_eq!(l["max_batch"], 200);
    assert_eq!(l["max_item_bytes"], MAX_ITEM_BYTES);
    // And the store enforces the configured numbers: 3 items per sender.
    let hs = hosts(&relay, &["alpha", "beta"]).await;
    let (a, b) = (&hs[0], &hs[1]);
    for _ in 0..3 {
        assert_eq!(push_new(&relay, a, b, L / 4).await, "accepted");
    }
    assert_eq!(push_new(&relay, a, b, L / 4).await, SENDER_SHARE);
    relay.stop().await;
}

// ---- per target ------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn queue_depth_holds_at_the_bound_refuses_the_whole_item_past_it_and_frees_on_ack() {
    let relay = relay_toml("[limits]\nmax_queue_items = 3\n").await;
    let hs = hosts(&relay, &["alpha", "beta", "gamma"]).await;
    let (a, b, c) = (&hs[0], &hs[1], &hs[2]);
    // Three items (two senders): the bound, accepted.
    let (id1, w1) = wire_of(&relay, a, b, L);
    assert_eq!(push(&relay, a, &id1, &[b], &w1).await, "accepted");
    assert_eq!(push_new(&relay, a, b, L).await, "accepted");
    assert_eq!(push_new(&relay, c, b, L).await, "accepted");
    let (n, head) = queue(&relay, b).await;
    assert_eq!(n, 3);
    // One past: refused, nothing stored, no seq used.
    let (id4, w4) = wire_of(&relay, c, b, L);
    relay.clock.advance(5);
    assert_eq!(push(&relay, c, &id4, &[b], &w4).await, QUEUE_DEPTH);
    assert_eq!(queue(&relay, b).await, (3, head));
    // A retry of a queued item is a duplicate, never charged, even at the bound.
    assert_eq!(push(&relay, a, &id1, &[b], &w1).await, "duplicate");
    // In one batch: every item for a full queue is refused.
    let (id5, w5) = wire_of(&relay, a, b, L);
    let (id6, w6) = wire_of(&relay, a, b, L);
    let batch = vec![
        item("envelope", &id5, &[(b, &w5)]),
        item("envelope", &id6, &[(b, &w6)]),
    ];
    let r = relay.push(a, batch.clone()).await;
    assert_eq!(r.statuses(), [QUEUE_DEPTH, QUEUE_DEPTH]);
    assert_eq!(queue(&relay, b).await, (3, head));

    // Drained by ack: room again. The refused items left no dedup rows: accepted afresh.
    drain(&relay, b).await;
    assert_eq!(queue(&relay, b).await.0, 0);
    assert_eq!(push(&relay, c, &id4, &[b], &w4).await, "accepted");
    let r = relay.push(a, batch).await;
    assert_eq!(r.statuses(), ["accepted", "accepted"]);
    assert_eq!(queue(&relay, b).await.0, 3);
    assert_eq!(push_new(&relay, a, b, L).await, QUEUE_DEPTH);
    relay.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn queue_bytes_hold_at_the_bound_and_one_byte_past_is_refused() {
    let bound = 3 * L;
    let relay = relay_toml(&format!("[limits]\nmax_queue_bytes = {bound}\n")).await;
    let hs = hosts(&relay, &["alpha", "beta", "gamma"]).await;
    let (a, b, c) = (&hs[0], &hs[1], &hs[2]);
    assert_eq!(push_new(&relay, a, b, L).await, "accepted");
    assert_eq!(push_new(&relay, c, b, L).await, "accepted");
    let head = queue(&relay, b).await.1;
    // 2L queued: L + 1 more is one byte past the bound.
    relay.clock.advance(5);
    assert_eq!(push_new(&relay, a, b, L + 1).await, QUEUE_BYTES);
    assert_eq!(queue(&relay, b).await, (2, head));
    // Exactly L more is the bound: accepted.
    assert_eq!(push_new(&relay, a, b, L).await, "accepted");
    assert_eq!(queue(&relay, b).await.0, 3);
    // At the bound nothing more fits, not even the smallest item; another target has room.
    assert_eq!(push_new(&relay, c, b, L / 2).await, QUEUE_BYTES);
    assert_eq!(push_new(&relay, a, c, bound).await, "accepted");
    // Drained by ack: the bytes are free again.
    drain(&relay, b).await;
    assert_eq!(push_new(&relay, a, b, bound).await, "accepted");
    relay.stop().await;
}

// ---- per sender per target -------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_senders_share_of_items_holds_at_the_bound_and_leaves_room_for_others() {
    let relay = relay_toml("[limits]\nmax_sender_items = 2\nmax_queue_items = 10\n").await;
    let hs = hosts(&relay, &["alpha", "beta", "gamma", "delta"]).await;
    let (a, b, c, d) = (&hs[0], &hs[1], &hs[2], &hs[3]);
    assert_eq!(push_new(&relay, a, b, L).await, "accepted");
    assert_eq!(push_new(&relay, a, b, L).await, "accepted");
    let head = queue(&relay, b).await.1;
    relay.clock.advance(5);
    assert_eq!(push_new(&relay, a, b, L).await, SENDER_SHARE);
    assert_eq!(queue(&relay, b).await, (2, head));
    // The share is per (sender, target): another sender fills its own share of beta, and
    // alpha still reaches another target.
    assert_eq!(push_new(&relay, c, b, L).await, "accepted");
    assert_eq!(push_new(&relay, c, b, L).await, "accepted");
    assert_eq!(push_new(&relay, c, b, L).await, SENDER_SHARE);
    assert_eq!(push_new(&relay, a, d, L).await, "accepted");
    assert_eq!(queue(&relay, b).await.0, 4);
    // Drained by ack: alpha has its share again.
    drain(&relay, b).await;
    assert_eq!(push_new(&relay, a, b, L).await, "accepted");
    relay.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_senders_share_of_bytes_holds_at_the_bound_and_one_byte_past_is_refused() {
    let relay = relay_toml(&format!("[limits]\nmax_sender_bytes = {}\n", 2 * L)).await;
    let hs = hosts(&relay, &["alpha", "beta", "gamma"]).await;
    let (a, b, c) = (&hs[0], &hs[1], &hs[2]);
    assert_eq!(push_new(&relay, a, b, L).await, "accepted");
    assert_eq!(push_new(&relay, a, b, L + 1).await, SENDER_SHARE);
    assert_eq!(push_new(&relay, a, b, L).await, "accepted");
    assert_eq!(push_new(&relay, a, b, L / 2).await, SENDER_SHARE);
    // Another sender's share of the same target is untouched.
    assert_eq!(push_new(&relay, c, b, 2 * L).await, "accepted");
    assert_eq!(queue(&relay, b).await.0, 3);
    relay.stop().await;
}

// ---- per proven account ----------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_proven_account_is_charged_across_its_hosts_and_an_owner_claim_never_is() {
    let relay = relay_toml("[limits]\nmax_owner_items = 3\n").await;
    let a = hosts(&relay, &["alpha"]).await.remove(0);
    let (one, two) = (Host::new("one"), Host::new("two"));
    enrol_in_account(&relay, &one, "acct-1", "victim-fp").await;
    enrol_in_account(&relay, &two, "acct-1", "victim-fp").await;
    // Three items across the account's two hosts: the bound.
    assert_eq!(push_new(&relay, &a, &one, L).await, "accepted");
    assert_eq!(push_new(&relay, &a, &one, L).await, "accepted");
    assert_eq!(push_new(&relay, &a, &two, L).await, "accepted");
    let head = queue(&relay, &two).await.1;
    relay.clock.advance(5);
    assert_eq!(
        push_new(&relay, &a, &two, L).await,
        "rejected:quota:owner queue depth exceeded for two"
    );
    assert_eq!(queue(&relay, &two).await, (1, head));

    // Hosts that merely claim the same owner fingerprint (no proven account) are charged
    // nothing: more items than the account quota go to them, and the account gains nothing.
    let (x, y) = (Host::new("claim-x"), Host::new("claim-y"));
    enrol_claiming(&relay, &x, "victim-fp").await;
    enrol_claiming(&relay, &y, "victim-fp").await;
    for t in [&x, &y, &x, &y, &x] {
        assert_eq!(push_new(&relay, &a, t, L).await, "accepted", "{}", t.name);
    }
    assert_eq!(
        push_new(&relay, &a, &one, L).await,
        "rejected:quota:owner queue depth exceeded for one"
    );

    // One host of the account drains: the account has room again.
    drain(&relay, &one).await;
    assert_eq!(push_new(&relay, &a, &two, L).await, "accepted");
    assert_eq!(push_new(&relay, &a, &one, L).await, "accepted");
    assert_eq!(
        push_new(&relay, &a, &one, L).await,
        "rejected:quota:owner queue depth exceeded for one"
    );
    relay.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_proven_accounts_bytes_hold_at_the_bound_and_one_byte_past_is_refused() {
    let relay = relay_toml(&format!("[limits]\nmax_owner_bytes = {}\n", 3 * L)).await;
    let hs = hosts(&relay, &["alpha", "gamma"]).await;
    let (a, c) = (&hs[0], &hs[1]);
    let (one, two) = (Host::new("one"), Host::new("two"));
    enrol_in_account(&relay, &one, "acct-1", "").await;
    enrol_in_account(&relay, &two, "acct-1", "").await;
    assert_eq!(push_new(&relay, a, &one, L).await, "accepted");
    assert_eq!(push_new(&relay, c, &two, L).await, "accepted");
    assert_eq!(
        push_new(&relay, a, &two, L + 1).await,
        "rejected:quota:owner queue bytes exceeded for two"
    );
    assert_eq!(push_new(&relay, a, &two, L).await, "accepted");
    assert_eq!(
        push_new(&relay, c, &one, L / 2).await,
        "rejected:quota:owner queue bytes exceeded for one"
    );
    // A host outside the account is not charged for it.
    assert_eq!(push_new(&relay, a, c, 3 * L).await, "accepted");
    relay.stop().await;
}

// ---- fan-out: one target over, nothing stored for any --------------------------------------

/// Pushes `(id, wire)` to `targets` and checks the refusal `want`; then checks that no target
/// got anything (no item, no seq used) and that no dedup row was written (the same id and
/// bytes to the targets that had room are accepted afresh, not `duplicate`).
async fn refused_for_all(
    relay: &Relay,
    from: &Host,
    targets: &[&Host],
    room: &[&Host],
    want: &str,
) {
    let (id, wire) = wire_of(relay, from, targets[0], L);
    let before: Vec<(usize, i64)> = {
        let mut v = Vec::new();
        for t in targets {
            v.push(queue(relay, t).await);
        }
        v
    };
    relay.clock.advance(7);
    assert_eq!(push(relay, from, &id, targets, &wire).await, want);
    for (t, b) in targets.iter().zip(&before) {
        assert_eq!(&queue(relay, t).await, b, "{} changed", t.name);
    }
    assert_eq!(push(relay, from, &id, room, &wire).await, "accepted");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fan_out_item_over_one_targets_quota_is_refused_for_every_target() {
    let relay = relay_toml(&format!(
        "[limits]\nmax_queue_bytes = {}\nmax_sender_items = 2\nmax_owner_items = 3\n",
        2 * L
    ))
    .await;
    let hs = hosts(&relay, &["alpha", "beta", "gamma", "delta", "eps"]).await;
    let (a, b, c, d, e) = (&hs[0], &hs[1], &hs[2], &hs[3], &hs[4]);

    // Queue bytes: beta holds 2L (its bound) from gamma; an item for [delta, beta] and one for
    // [beta, delta] are refused whole.
    assert_eq!(push_new(&relay, c, b, L).await, "accepted");
    assert_eq!(push_new(&relay, c, b, L).await, "accepted");
    refused_for_all(&relay, a, &[d, b], &[d], QUEUE_BYTES).await;
    refused_for_all(&relay, a, &[b, e], &[e], QUEUE_BYTES).await;
    drain(&relay, b).await;

    // Sender share: alpha has 2 items (its share) at beta; [eps, beta] is refused whole.
    assert_eq!(push_new(&relay, a, b, L / 2).await, "accepted");
    assert_eq!(push_new(&relay, a, b, L / 2).await, "accepted");
    refused_for_all(&relay, a, &[e, b], &[e], SENDER_SHARE).await;
    drain(&relay, b).await;

    // Proven account: two of its hosts in one item need two items of its quota; with room for
    // one only, the second target refuses the item and the first keeps nothing.
    let (one, two) = (Host::new("one"), Host::new("two"));
    enrol_in_account(&relay, &one, "acct-1", "").await;
    enrol_in_account(&relay, &two, "acct-1", "").await;
    assert_eq!(push_new(&relay, c, &one, L / 2).await, "accepted");
    assert_eq!(push_new(&relay, d, &two, L / 2).await, "accepted");
    refused_for_all(
        &relay,
        e,
        &[&one, &two],
        &[&one],
        "rejected:quota:owner queue depth exceeded for two",
    )
    .await;
    relay.stop().await;
}

// ---- request bounds: max_batch and the body cap while streaming --------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_configured_max_batch_holds_at_the_bound_and_refuses_the_batch_past_it() {
    let relay = relay_toml("[limits]\nmax_batch = 3\n").await;
    let hs = hosts(&relay, &["alpha", "beta"]).await;
    let (a, b) = (&hs[0], &hs[1]);
    let items: Vec<Value> = (0..4)
        .map(|_| {
            let (id, w) = wire_of(&relay, a, b, L);
            item("envelope", &id, &[(b, &w)])
        })
        .collect();
    let r = relay.push(a, items.clone()).await;
    r.assert_error(400, "more than 3 items in one push", "BAD_BATCH");
    assert_eq!(queue(&relay, b).await, (0, 0), "nothing of a refused batch");
    let r = relay.push(a, items[..3].to_vec()).await;
    assert_eq!(r.statuses(), ["accepted"; 3]);
    assert_eq!(queue(&relay, b).await.0, 3);
    relay.stop().await;
}

/// A signed push whose body is the JSON of `items` followed by whitespace up to exactly `len`
/// bytes (JSON allows trailing whitespace).
fn padded_push_body(items: Vec<Value>, len: usize) -> String {
    let mut body = json!({ "items": items }).to_string();
    assert!(body.len() <= len);
    body.extend(std::iter::repeat_n(' ', len - body.len()));
    body
}

/// Sends `body` to `POST /v2/relay/items` signed by `host`, chunked (no declared length, so the
/// cap is enforced while streaming), in 1 MiB chunks; returns `(status, body)`.
async fn push_chunked(relay: &Relay, host: &Host, body: String) -> (u16, String) {
    let mut head = "POST /v2/relay/items HTTP/1.1\r\nhost: relay\r\n".to_owned();
    for (k, v) in host.hop_headers("POST", "/v2/relay/items", &body, relay.now()) {
        head.push_str(&format!("{k}: {v}\r\n"));
    }
    head.push_str("transfer-encoding: chunked\r\nconnection: close\r\n\r\n");
    let mut chunks: Vec<Vec<u8>> = body
        .as_bytes()
        .chunks(1024 * 1024)
        .map(|data| {
            let mut c = format!("{:x}\r\n", data.len()).into_bytes();
            c.extend_from_slice(data);
            c.extend_from_slice(b"\r\n");
            c
        })
        .collect();
    chunks.push(b"0\r\n\r\n".to_vec());
    let addr = relay.addr();
    let (status, text, _) =
        tokio::task::spawn_blocking(move || raw_exchange(&addr, &head, &chunks))
            .await
            .unwrap();
    (status, text)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_valid_push_of_exactly_the_body_cap_is_accepted_and_one_byte_more_is_413() {
    let relay = Relay::start().await;
    let hs = hosts(&relay, &["alpha", "beta"]).await;
    let (a, b) = (&hs[0], &hs[1]);
    let one = |relay: &Relay| {
        let (id, w) = wire_of(relay, a, b, L);
        (id.clone(), item("envelope", &id, &[(b, &w)]))
    };

    // Declared length: exactly the cap is read and accepted; one byte more is 413, nothing
    // stored.
    let (id, it) = one(&relay);
    let over = padded_push_body(vec![it.clone()], RELAY_MAX_BODY + 1);
    let r = relay.hop(a, "POST", "/v2/relay/items", &over).await;
    r.assert_error(413, "request body too large", "TOO_LARGE");
    assert_eq!(queue(&relay, b).await.0, 0);
    let at = padded_push_body(vec![it], RELAY_MAX_BODY);
    assert_eq!(at.len(), RELAY_MAX_BODY);
    let r = relay.hop(a, "POST", "/v2/relay/items", &at).await;
    assert_eq!(r.status1(), "accepted");
    assert_eq!(relay.queue_ids(b).await, [id]);

    // Chunked (no declared length): the cap is counted while the body streams in.
    let (id2, it2) = one(&relay);
    let (status, text) = push_chunked(
        &relay,
        a,
        padded_push_body(vec![it2.clone()], RELAY_MAX_BODY + 1),
    )
    .await;
    assert_eq!(status, 413, "{text}");
    assert_eq!(
        serde_json::from_str::<Value>(&text).unwrap(),
        json!({"error": "request body too large", "code": "TOO_LARGE"})
    );
    assert_eq!(queue(&relay, b).await.0, 1, "nothing of the refused body");
    let (status, text) = push_chunked(&relay, a, padded_push_body(vec![it2], RELAY_MAX_BODY)).await;
    assert_eq!(status, 200, "{text}");
    let answer: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(answer["results"][0]["status"], "accepted", "{answer}");
    assert_eq!(relay.queue_ids(b).await.last(), Some(&id2));
    relay.stop().await;
}

// ---- page bounds: max_pull and max_pull_bytes at their defaults and configured -----------------

/// The seqs and `more` of one page.
fn page(r: &Resp) -> (Vec<i64>, bool) {
    let j = r.assert_ok();
    (
        j["items"]
            .as_array()
            .unwrap()
            .iter()
            .map(|i| i["seq"].as_i64().unwrap())
            .collect(),
        j["more"].as_bool().unwrap(),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn max_pull_default_500_holds_at_the_bound_and_pages_past_it() {
    let relay = Relay::start().await;
    let hs = hosts(&relay, &["alpha", "beta"]).await;
    let (a, b) = (&hs[0], &hs[1]);
    // 501 items in three batches (200, 200, 101).
    for n in [200, 200, 101] {
        let items: Vec<Value> = (0..n)
            .map(|_| {
                let (id, w) = sealed_wire(a, b, "p", relay.now());
                env_item(&id, b, &w)
            })
            .collect();
        let r = relay.push(a, items).await;
        assert!(r.statuses().iter().all(|s| s == "accepted"), "{r:#?}");
    }
    // Asking for more than 500 gets 500 (no limit: 500 too), and `more`.
    for q in ["after=0&limit=501", "after=0&limit=500", "after=0"] {
        let (seqs, more) = page(&relay.pull(b, q).await);
        assert_eq!((seqs.len(), more), (MAX_PULL, true), "{q}");
    }
    let (seqs, _) = page(&relay.pull(b, "after=0").await);
    let (rest, more) = page(&relay.pull(b, &format!("after={}", seqs[499])).await);
    assert_eq!((rest.len(), more), (1, false));
    // After one is acked, the remaining 500 fit one page exactly, with nothing more.
    let epoch = relay.epoch().await;
    relay.ack(b, &epoch, json!(seqs[0])).await.assert_ok();
    let (seqs, more) = page(&relay.pull(b, "after=0").await);
    assert_eq!((seqs.len(), more), (500, false));
    relay.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_configured_max_pull_holds_at_the_bound() {
    let relay = relay_toml("[limits]\nmax_pull = 3\n").await;
    let hs = hosts(&relay, &["alpha", "beta"]).await;
    let (a, b) = (&hs[0], &hs[1]);
    for _ in 0..4 {
        assert_eq!(push_new(&relay, a, b, L).await, "accepted");
        relay.clock.advance(1);
    }
    let info = relay.plain("GET", "/v2/relay/info", "").await;
    assert_eq!(info.assert_ok()["limits"]["max_pull"], 3);
    for q in [
        "after=0",
        "after=0&limit=3",
        "after=0&limit=4",
        "after=0&limit=500",
    ] {
        let (seqs, more) = page(&relay.pull(b, q).await);
        assert_eq!((seqs.len(), more), (3, true), "{q}");
    }
    let (seqs, more) = page(&relay.pull(b, "after=0&limit=2").await);
    assert_eq!((seqs.len(), more), (2, true));
    relay.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn max_pull_bytes_default_8_mib_holds_at_the_bound_and_pages_past_it() {
    let relay = Relay::start().await;
    let hs = hosts(&relay, &["alpha", "beta"]).await;
    let (a, b) = (&hs[0], &hs[1]);
    // 17 items of 512 KiB: 16 of them are exactly 8 MiB of wire bytes.
    let size = 512 * 1024;
    assert_eq!(16 * size, MAX_PULL_BYTES);
    let mut left = 17;
    while left > 0 {
        let n = left.min(6); // 6 × 512 KiB in base64 stays under the 8 MiB body cap
        let items: Vec<Value> = (0..n)
            .map(|_| {
                let (id, w) = wire_of(&relay, a, b, size);
                item("envelope", &id, &[(b, &w)])
            })
            .collect();
        let r = relay.push(a, items).await;
        assert!(r.statuses().iter().all(|s| s == "accepted"), "{r:#?}");
        left -= n;
    }
    let r = relay.pull(b, "after=0").await;
    let (seqs, more) = page(&r);
    assert_eq!((seqs.len(), more), (16, true));
    let bytes: usize = r.json["items"]
        .as_array()
        .unwrap()
        .iter()
        .map(|i| {
            agentmbx_protocol::b64::decode(i["wire_b64"].as_str().unwrap())
                .unwrap()
                .len()
        })
        .sum();
    assert_eq!(bytes, MAX_PULL_BYTES, "the page is exactly the budget");
    let (rest, more) = page(&relay.pull(b, &format!("after={}", seqs[15])).await);
    assert_eq!((rest.len(), more), (1, false));
    relay.stop().await;
}
