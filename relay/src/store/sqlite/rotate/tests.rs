//! Tests of the rotate module.

use super::*;
use crate::store::{
    AuthorityStrength, DenyEntry, DenyKind, DirectoryStore, EncAdV1, EncAdV2, EnrolOutcome,
    EnrolRequest, ItemStatus, ItemStore, OpenOptions, OperationsStore, PullRequest, SenderList,
    StoreLimits,
};
use crate::store::{SqliteStore, DB_FILE};
use crate::testing::conformance::{self, enrol_request_at, item, key, rotation};
use rusqlite::OpenFlags;

fn open(dir: &std::path::Path) -> SqliteStore {
    let options = OpenOptions {
        lock_wait_ms: 0,
        ..OpenOptions::default()
    };
    SqliteStore::open_with(dir, &key(200), 1_000, options).expect("open store")
}

/// A read-only look at the raw tables.
fn raw(dir: &std::path::Path) -> Connection {
    Connection::open_with_flags(dir.join(DB_FILE), OpenFlags::SQLITE_OPEN_READ_ONLY)
        .expect("open read-only")
}

fn count(c: &Connection, sql: &str, k: &str) -> i64 {
    c.query_row(sql, [k], |r| r.get(0)).expect("count")
}

/// The rows of `table` whose `target_pubkey` is `k`.
fn rows_for(c: &Connection, table: &str, k: &str) -> i64 {
    count(
        c,
        &format!("SELECT COUNT(*) FROM {table} WHERE target_pubkey = ?1"),
        k,
    )
}

fn enrol(store: &SqliteStore, k: &str, name: &str, account: Option<&str>) {
    let out = store
        .enrol(EnrolRequest {
            owner_fp: format!("fp-{name}"),
            ..enrol_request_at(k, name, account, 1_000)
        })
        .expect("enrol");
    assert!(matches!(out, EnrolOutcome::Enrolled(_)), "{out:?}");
}

/// Pushes one item `id` from `sender` to `target` with `wire`; returns its seq.
fn push(store: &SqliteStore, sender: &str, target: &str, id: &str, wire: &[u8], now: i64) -> i64 {
    let out = store
        .push(crate::testing::conformance::batch(
            sender,
            "sender",
            now,
            Default::default(),
            vec![item(id, &[(target, wire)])],
        ))
        .expect("push");
    assert_eq!(out.items[0].status, ItemStatus::Accepted, "{out:?}");
    out.items[0].targets[0].seq
}

fn queue(store: &SqliteStore, target: &str) -> Vec<(i64, String)> {
    store
        .pull(conformance::pull_request(target, 0, 500, u64::MAX))
        .expect("pull")
        .items
        .into_iter()
        .map(|i| (i.seq, i.item_id))
        .collect()
}

/// The suite's sender list, with a record that names only its signer.
fn list(target: &str, senders: &[&str], iat_ms: i64) -> SenderList {
    SenderList {
        record: format!("{{\"signed-by\":\"{target}\"}}"),
        ..conformance::list(target, senders, iat_ms)
    }
}

#[test]
fn one_transaction_moves_queue_name_account_ads_and_allowlists() {
    let dir = tempfile::tempdir().unwrap();
    let store = open(dir.path());
    let (old, new, a, b) = (key(1), key(2), key(3), key(4));
    enrol(&store, &old, "laptop", Some("acct-1"));
    enrol(&store, &a, "alpha", None);
    enrol(&store, &b, "beta", None);
    store
        .put_enc_ad_v1(EncAdV1 {
            host_pubkey: old.clone(),
            host_name: "laptop".into(),
            enc_pub: key(9),
            sig: "s1".into(),
            at_ms: 1_000,
        })
        .unwrap();
    store
        .put_enc_ad_v2(EncAdV2 {
            host_pubkey: old.clone(),
            enc_pub: key(9),
            record: "{}".into(),
            sig: "s2".into(),
            at_ms: 1_000,
        })
        .unwrap();
    store.put_sender_list(list(&old, &[&a], 1_000)).unwrap();
    store.put_sender_list(list(&b, &[&a, &old], 1_000)).unwrap();
    let s1 = push(&store, &a, &old, "i1", b"w1", 2_000);
    let s2 = push(&store, &a, &old, "i2", b"w2", 2_000);
    assert!(s1 < s2);

    let out = store.rotate(rotation(&old, &new, "Laptop", 5_000)).unwrap();
    assert_eq!(out, RotateOutcome::Rotated { moved: 2 });

    // The new key carries the old enrolment; the old one is revoked.
    let e = store.enrolment(&new).unwrap().unwrap();
    assert_eq!(
        (
            e.host_name.as_str(),
            e.owner_fp.as_str(),
            e.account.as_deref(),
            e.authorized_by.as_str(),
            e.strength,
            e.revoked_at_ms
        ),
        (
            "laptop",
            "fp-laptop",
            Some("acct-1"),
            "account-token",
            AuthorityStrength::Account,
            None
        )
    );
    assert_eq!(
        store.enrolment(&old).unwrap().unwrap().revoked_at_ms,
        Some(5_000)
    );
    // Queue: in order, under new seqs at or after now.
    let q = queue(&store, &new);
    assert_eq!(
        q.iter().map(|(_, id)| id.as_str()).collect::<Vec<_>>(),
        ["i1", "i2"]
    );
    assert_eq!(q[0].0, 5_000);
    assert_eq!(q[1].0, 5_001);
    let c = raw(dir.path());
    crate::store::assert_usage_matches(&c);
    assert_eq!(rows_for(&c, "items", &old), 0);
    // Dedup rows stay under the old key (a retry naming it settles as a duplicate).
    assert_eq!(rows_for(&c, "dedup", &old), 2);
    assert_eq!(rows_for(&c, "dedup", &new), 0);
    // Ads of the old key dropped.
    for t in ["enc_ads", "enc_ad_records"] {
        let sql = format!("SELECT COUNT(*) FROM {t} WHERE host_pubkey = ?1");
        assert_eq!(count(&c, &sql, &old), 0, "{t}");
    }
    // Allowlists: the old key's own is the new key's, beta's names the new key, and every
    // signed record stays as it was signed.
    let own = store.sender_list(&new).unwrap().unwrap();
    assert_eq!(own.senders, vec![a.clone()]);
    assert_eq!(own.record, format!("{{\"signed-by\":\"{old}\"}}"));
    assert!(store.sender_list(&old).unwrap().is_none());
    let bl = store.sender_list(&b).unwrap().unwrap();
    assert_eq!(bl.senders, vec![a.clone(), new.clone()]);
    assert_eq!(
        (bl.record, bl.sig),
        (format!("{{\"signed-by\":\"{b}\"}}"), format!("sig-of-{b}"))
    );
    // The applied rotation is remembered.
    assert_eq!(
        c.query_row(
            "SELECT v FROM meta WHERE k = ?1",
            [format!("rotation:{old}")],
            |r| r.get::<_, String>(0)
        )
        .unwrap(),
        new
    );
    drop(c);
    // Repeating it changes nothing; another target for the retired key is refused.
    assert_eq!(
        store.rotate(rotation(&old, &new, "laptop", 6_000)).unwrap(),
        RotateOutcome::AlreadyRotated
    );
    assert_eq!(
        store
            .rotate(rotation(&old, &key(7), "laptop", 6_000))
            .unwrap(),
        RotateOutcome::NotEnrolled
    );
    assert_eq!(queue(&store, &new), q);
}

#[test]
fn the_new_keys_own_queue_list_and_stronger_account_are_kept() {
    let dir = tempfile::tempdir().unwrap();
    let store = open(dir.path());
    let (old, new, a, b) = (key(1), key(2), key(3), key(4));
    enrol(&store, &old, "laptop", None);
    enrol(&store, &new, "laptop-new", Some("acct-9"));
    enrol(&store, &a, "alpha", None);
    enrol(&store, &b, "beta", None);
    store.put_sender_list(list(&old, &[&a], 1_000)).unwrap();
    store.put_sender_list(list(&new, &[&b, &a], 1_500)).unwrap();
    // A list naming both keys ends up naming the new one once.
    store
        .put_sender_list(list(&b, &[&old, &new], 1_000))
        .unwrap();
    let own = push(&store, &b, &new, "own", b"own", 3_000);
    push(&store, &a, &old, "moved", b"m", 2_000);
    // The sender already pushed the same id to the new key: not moved twice.
    push(&store, &a, &old, "dup", b"d-old", 2_000);
    push(&store, &a, &new, "dup", b"d-new", 3_000);
    let out = store.rotate(rotation(&old, &new, "laptop", 4_000)).unwrap();
    assert_eq!(out, RotateOutcome::Rotated { moved: 1 });
    let q = queue(&store, &new);
    assert_eq!(
        q.iter().map(|(_, id)| id.as_str()).collect::<Vec<_>>(),
        ["own", "dup", "moved"]
    );
    assert_eq!(q[0].0, own);
    let e = store.enrolment(&new).unwrap().unwrap();
    assert_eq!(
        (e.host_name.as_str(), e.account.as_deref(), e.strength),
        ("laptop", Some("acct-9"), AuthorityStrength::Account)
    );
    assert_eq!(
        store.sender_list(&new).unwrap().unwrap().senders,
        vec![b.clone(), a.clone()]
    );
    assert_eq!(
        store.sender_list(&b).unwrap().unwrap().senders,
        vec![new.clone()]
    );
    assert!(store.sender_list(&old).unwrap().is_none());
}

#[test]
fn refusals_write_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let store = open(dir.path());
    let (old, new, other, a) = (key(1), key(2), key(3), key(4));
    enrol(&store, &old, "laptop", None);
    enrol(&store, &a, "alpha", None);
    push(&store, &a, &old, "i1", b"w1", 2_000);
    let before = queue(&store, &old);
    assert_eq!(
        store
            .rotate(rotation(&key(8), &new, "laptop", 3_000))
            .unwrap(),
        RotateOutcome::NotEnrolled
    );
    assert_eq!(
        store
            .rotate(rotation(&old, &new, "desktop", 3_000))
            .unwrap(),
        RotateOutcome::OtherHost
    );
    // The new key's stronger account already has a live "laptop".
    enrol(&store, &new, "n", Some("acct-2"));
    enrol(&store, &other, "LAPTOP", Some("acct-2"));
    assert_eq!(
        store.rotate(rotation(&old, &new, "laptop", 3_000)).unwrap(),
        RotateOutcome::TargetNameTaken
    );
    store.revoke(&new, 3_000).unwrap();
    assert_eq!(
        store.rotate(rotation(&old, &new, "laptop", 3_000)).unwrap(),
        RotateOutcome::TargetRevoked
    );
    assert!(store
        .rotate(rotation("not canonical", &new, "laptop", 3_000))
        .is_err());
    assert_eq!(queue(&store, &old), before);
    assert_eq!(store.enrolment(&old).unwrap().unwrap().revoked_at_ms, None);
    let c = raw(dir.path());
    assert_eq!(
        count(
            &c,
            "SELECT COUNT(*) FROM meta WHERE k = ?1",
            &format!("rotation:{old}")
        ),
        0
    );
}

fn open_limited(dir: &std::path::Path, limits: StoreLimits) -> SqliteStore {
    let options = OpenOptions {
        lock_wait_ms: 0,
        limits,
        ..OpenOptions::default()
    };
    SqliteStore::open_with(dir, &key(200), 1_000, options).expect("open store")
}

/// Pushes `n` items `<prefix><i>` from `sender` to `target` in batches of 200.
fn push_many(store: &SqliteStore, sender: &str, target: &str, prefix: &str, n: usize) {
    let ids: Vec<String> = (0..n).map(|i| format!("{prefix}{i:05}")).collect();
    for chunk in ids.chunks(200) {
        let out = store
            .push(crate::testing::conformance::batch(
                sender,
                "sender",
                2_000,
                Default::default(),
                chunk
                    .iter()
                    .map(|id| item(id, &[(target, id.as_bytes())]))
                    .collect(),
            ))
            .expect("push");
        assert!(
            out.items.iter().all(|i| i.status == ItemStatus::Accepted),
            "{out:?}"
        );
    }
}

fn deny_host(store: &SqliteStore, k: &str, until: Option<i64>, at: i64) {
    store
        .deny(DenyEntry {
            kind: DenyKind::Host,
            value: key_fingerprint(k),
            until_ms: until,
            at_ms: at,
        })
        .expect("deny");
}

fn host_entry(store: &SqliteStore, k: &str) -> Option<(Option<i64>, i64)> {
    let fp = key_fingerprint(k);
    store
        .deny_entries()
        .expect("deny entries")
        .into_iter()
        .find(|e| e.kind == DenyKind::Host && e.value == fp)
        .map(|e| (e.until_ms, e.at_ms))
}

#[test]
fn the_old_keys_active_deny_entries_are_carried_to_the_new_fingerprint() {
    let dir = tempfile::tempdir().unwrap();
    let store = open(dir.path());
    let (old, new) = (key(1), key(2));
    enrol(&store, &old, "laptop", None);
    // Written after the handler's check, before the rotation's transaction.
    deny_host(&store, &old, None, 3_000);
    assert_eq!(
        store.rotate(rotation(&old, &new, "laptop", 4_000)).unwrap(),
        RotateOutcome::Rotated { moved: 0 }
    );
    assert_eq!(host_entry(&store, &new), Some((None, 4_000)));
    assert!(store
        .denied(&key_fingerprint(&new), None, 10_000_000)
        .unwrap()
        .is_some());
    // The old key's entry stays as the operator wrote it.
    assert_eq!(host_entry(&store, &old), Some((None, 3_000)));

    // A timed entry keeps its end; an entry the new fingerprint has keeps the longer one.
    let (old2, new2) = (key(3), key(4));
    enrol(&store, &old2, "desk", None);
    deny_host(&store, &old2, Some(9_000), 3_000);
    deny_host(&store, &new2, Some(7_000), 3_000);
    store.rotate(rotation(&old2, &new2, "desk", 5_000)).unwrap();
    assert_eq!(host_entry(&store, &new2), Some((Some(9_000), 5_000)));
    let (old3, new3) = (key(5), key(6));
    enrol(&store, &old3, "box", None);
    deny_host(&store, &old3, Some(6_000), 3_000);
    deny_host(&store, &new3, None, 3_000);
    store.rotate(rotation(&old3, &new3, "box", 5_000)).unwrap();
    assert_eq!(host_entry(&store, &new3), Some((None, 5_000)));

    // An entry that ended before the rotation is not carried.
    let (old4, new4) = (key(7), key(8));
    enrol(&store, &old4, "pi", None);
    deny_host(&store, &old4, Some(5_000), 3_000);
    store.rotate(rotation(&old4, &new4, "pi", 5_000)).unwrap();
    assert_eq!(host_entry(&store, &new4), None);
    // Nor is anything when the old key was never denied.
    let (old5, new5) = (key(9), key(10));
    enrol(&store, &old5, "nas", None);
    store.rotate(rotation(&old5, &new5, "nas", 5_000)).unwrap();
    assert_eq!(host_entry(&store, &new5), None);
}

#[test]
fn a_long_queue_moves_in_order_with_consecutive_seqs_after_the_new_keys_own() {
    let dir = tempfile::tempdir().unwrap();
    let store = open(dir.path());
    let (old, new, a) = (key(1), key(2), key(3));
    enrol(&store, &old, "laptop", None);
    enrol(&store, &new, "laptop-2", None);
    enrol(&store, &a, "alpha", None);
    push_many(&store, &a, &old, "o", 450);
    let own = push(&store, &a, &new, "own", b"own", 9_000);
    let out = store.rotate(rotation(&old, &new, "laptop", 5_000)).unwrap();
    assert_eq!(out, RotateOutcome::Rotated { moved: 450 });
    let mut q = Vec::new();
    let mut after = 0;
    loop {
        let page = store
            .pull(PullRequest {
                target_pubkey: new.clone(),
                after,
                limit: 500,
                max_bytes: u64::MAX,
            })
            .unwrap();
        let Some(last) = page.items.last() else { break };
        after = last.seq;
        q.extend(page.items.into_iter().map(|i| (i.seq, i.item_id)));
    }
    assert_eq!(q.len(), 451);
    assert_eq!(q[0], (own, "own".to_owned()));
    for (n, (seq, id)) in q[1..].iter().enumerate() {
        assert_eq!(id, &format!("o{n:05}"));
        assert_eq!(
            *seq,
            own + 1 + n as i64,
            "consecutive after the new key's own"
        );
    }
    // The allocator continues after the moved items.
    let next = push(&store, &a, &new, "next", b"next", 5_000);
    assert_eq!(next, q[450].0 + 1);
    let c = raw(dir.path());
    crate::store::assert_usage_matches(&c);
    assert_eq!(rows_for(&c, "items", &old), 0);
}

#[test]
fn moved_items_may_take_the_new_key_past_its_quota_and_new_pushes_wait() {
    let dir = tempfile::tempdir().unwrap();
    let store = open_limited(
        dir.path(),
        StoreLimits {
            max_queue_items: 3,
            ..StoreLimits::default()
        },
    );
    let (old, new, a) = (key(1), key(2), key(3));
    enrol(&store, &old, "laptop", None);
    enrol(&store, &new, "laptop-2", None);
    enrol(&store, &a, "alpha", None);
    push_many(&store, &a, &old, "o", 3);
    push_many(&store, &a, &new, "n", 3);
    // Both queues are at the cap: nothing is stranded, the new key holds all six.
    assert_eq!(
        store.rotate(rotation(&old, &new, "laptop", 5_000)).unwrap(),
        RotateOutcome::Rotated { moved: 3 }
    );
    assert_eq!(queue(&store, &new).len(), 6);
    // A new push waits until the host drained its queue.
    let out = store
        .push(crate::testing::conformance::batch(
            &a,
            "alpha",
            6_000,
            Default::default(),
            vec![item("late", &[(&new, b"late")])],
        ))
        .unwrap();
    assert!(
        out.items[0].status.wire().starts_with("rejected:quota:"),
        "{out:?}"
    );
    assert_eq!(crate::store::assert_usage_matches(&raw(dir.path())), 6);
}

#[test]
fn markers_live_only_while_their_old_keys_enrolment_row_exists() {
    let dir = tempfile::tempdir().unwrap();
    let store = open(dir.path());
    let (k1, k2, k3, k4, gone) = (key(1), key(2), key(3), key(4), key(50));
    enrol(&store, &k1, "one", None);
    enrol(&store, &k3, "three", None);
    store.rotate(rotation(&k1, &k2, "one", 2_000)).unwrap();
    // A marker whose old key has no enrolment row (e.g. pruned) is dropped by the next
    // rotation; the markers of kept rows stay.
    store
        .set_meta(&format!("{ROTATION_META_PREFIX}{gone}"), &key(51))
        .unwrap();
    store.rotate(rotation(&k3, &k4, "three", 3_000)).unwrap();
    let c = raw(dir.path());
    let markers: Vec<String> = c
        .prepare("SELECT k FROM meta WHERE k LIKE 'rotation:%' ORDER BY k")
        .unwrap()
        .query_map([], |r| r.get(0))
        .unwrap()
        .collect::<Result<_, _>>()
        .unwrap();
    let mut want = vec![
        format!("{ROTATION_META_PREFIX}{k1}"),
        format!("{ROTATION_META_PREFIX}{k3}"),
    ];
    want.sort();
    assert_eq!(markers, want);
    drop(c);
    // The kept markers still answer a repeated rotation.
    assert_eq!(
        store.rotate(rotation(&k1, &k2, "one", 4_000)).unwrap(),
        RotateOutcome::AlreadyRotated
    );
}

#[test]
fn the_account_binding_moves_with_the_account() {
    let dir = tempfile::tempdir().expect("temp dir");
    let store = open(dir.path());
    let (old, new) = (key(1), key(2));
    let binding = crate::store::AccountBinding {
        host_pubkey: old.clone(),
        cloud_jkt: "jkt-of-the-cloud-key".into(),
        client_id: "client-1".into(),
        sub: "host-1".into(),
        org: None,
        at_ms: 1,
    };
    let out = store
        .enrol_bound(
            enrol_request_at(&old, "laptop", Some("acct"), 1),
            Some(binding),
        )
        .expect("enrol");
    assert!(matches!(out, crate::store::EnrolOutcome::Enrolled(_)));
    let out = store
        .rotate(rotation(&old, &new, "laptop", 10))
        .expect("rotate");
    assert!(matches!(out, RotateOutcome::Rotated { .. }), "{out:?}");
    assert!(store.account_binding(&old).expect("read").is_none());
    let moved = store.account_binding(&new).expect("read").expect("moved");
    assert_eq!(moved.cloud_jkt, "jkt-of-the-cloud-key");
    assert_eq!(moved.client_id, "client-1");
}
