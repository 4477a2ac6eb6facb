//! Tests of the deny module.

use super::*;
use crate::store::{DirectoryStore, OpenOptions};

fn key(n: u8) -> String {
    use base64::Engine as _;
    base64::engine::general_purpose::STANDARD.encode([n; 32])
}

fn open(dir: &std::path::Path) -> SqliteStore {
    SqliteStore::open_with(
        dir,
        &key(250),
        1_000,
        OpenOptions {
            lock_wait_ms: 0,
            ..OpenOptions::default()
        },
    )
    .expect("open")
}

fn request(k: &str, name: &str, account: Option<&str>, now: i64) -> EnrolRequest {
    crate::testing::conformance::enrol_request_at(k, name, account, now)
}

fn binding(k: &str, jkt: &str) -> AccountBinding {
    AccountBinding {
        host_pubkey: k.to_owned(),
        cloud_jkt: jkt.to_owned(),
        client_id: "cli-1".into(),
        sub: "host-1".into(),
        org: Some("org-1".into()),
        at_ms: 5,
    }
}

fn entry(kind: DenyKind, value: &str, until: Option<i64>, at: i64) -> DenyEntry {
    DenyEntry {
        kind,
        value: value.to_owned(),
        until_ms: until,
        at_ms: at,
    }
}

/// Enrols `k` named `name` in account "acct" at `at`, bound to cloud key `jkt`.
fn enrol_in_acct(
    store: &SqliteStore,
    k: &str,
    name: &str,
    at: i64,
    jkt: &str,
) -> Result<EnrolOutcome, StoreError> {
    store.enrol_bound(request(k, name, Some("acct"), at), Some(binding(k, jkt)))
}

/// The cloud key `k` is bound to, if any.
fn bound_jkt(store: &SqliteStore, k: &str) -> Option<String> {
    store.account_binding(k).expect("read").map(|b| b.cloud_jkt)
}

#[test]
fn a_binding_is_written_with_its_enrolment_and_only_then() {
    let dir = tempfile::tempdir().expect("tempdir");
    let store = open(dir.path());
    let (a, b) = (key(1), key(2));
    let out = enrol_in_acct(&store, &a, "mac", 10, "j1").expect("enrol");
    assert!(matches!(out, EnrolOutcome::Enrolled(_)), "{out:?}");
    assert_eq!(
        store.account_binding(&a).expect("read"),
        Some(binding(&a, "j1"))
    );
    // A refused enrolment (same name in the same account) writes no binding.
    let out = enrol_in_acct(&store, &b, "MAC", 11, "j2").expect("enrol");
    assert_eq!(out, EnrolOutcome::NameTaken);
    assert_eq!(store.account_binding(&b).expect("read"), None);
    // Re-enrolment replaces the binding; a binding for another key is a caller bug.
    enrol_in_acct(&store, &a, "mac", 12, "j3").expect("re-enrol");
    assert_eq!(bound_jkt(&store, &a), Some("j3".to_owned()));
    assert!(matches!(
        store.enrol_bound(request(&a, "mac", None, 13), Some(binding(&b, "j4"))),
        Err(StoreError::InvalidInput(_))
    ));
    // A revoked key stays revoked and gets no new binding.
    store.revoke(&a, 14).expect("revoke");
    let out = enrol_in_acct(&store, &a, "mac", 15, "j5").expect("enrol");
    assert_eq!(out, EnrolOutcome::Revoked);
    assert_eq!(bound_jkt(&store, &a), Some("j3".to_owned()));
}

#[test]
fn a_cloud_key_serves_one_live_host_key() {
    let dir = tempfile::tempdir().expect("tempdir");
    let store = open(dir.path());
    let (a, b) = (key(1), key(2));
    let enrol =
        |k: &str, name: &str, at: i64| enrol_in_acct(&store, k, name, at, "j1").expect("enrol");
    assert!(matches!(enrol(&a, "one", 10), EnrolOutcome::Enrolled(_)));
    // Another key with the same cloud key: refused, nothing written.
    assert_eq!(enrol(&b, "two", 11), EnrolOutcome::CloudKeyTaken);
    assert_eq!(store.enrolment(&b).expect("read"), None);
    assert_eq!(store.account_binding(&b).expect("read"), None);
    // The same key again is a re-enrolment; another cloud key for b is fine.
    assert!(matches!(enrol(&a, "one", 12), EnrolOutcome::Enrolled(_)));
    assert!(matches!(
        enrol_in_acct(&store, &b, "two", 13, "j2").expect("enrol"),
        EnrolOutcome::Enrolled(_)
    ));
    // Once a is revoked its cloud key is free for another key.
    store.revoke(&a, 14).expect("revoke");
    let c = key(3);
    assert!(matches!(enrol(&c, "three", 15), EnrolOutcome::Enrolled(_)));
}

#[test]
fn deny_entries_match_expire_replace_and_survive_a_restart() {
    let dir = tempfile::tempdir().expect("tempdir");
    {
        let store = open(dir.path());
        let fp = key_fingerprint(&key(1));
        assert_eq!(store.denied(&fp, Some("cli"), 100).expect("read"), None);
        store
            .deny(entry(DenyKind::Host, &fp, None, 100))
            .expect("deny host");
        store
            .deny(entry(DenyKind::Client, "cli", Some(200), 100))
            .expect("deny client");
        // The host entry is reported first; the client entry only for its client_id.
        assert_eq!(
            store.denied(&fp, Some("cli"), 150).expect("read"),
            Some(entry(DenyKind::Host, &fp, None, 100))
        );
        let other = key_fingerprint(&key(2));
        assert_eq!(
            store
                .denied(&other, Some("cli"), 150)
                .expect("read")
                .map(|e| e.kind),
            Some(DenyKind::Client)
        );
        assert_eq!(store.denied(&other, None, 150).expect("read"), None);
        // `until` is exclusive: at 200 the client entry no longer denies.
        assert_eq!(
            store
                .denied(&other, Some("cli"), 199)
                .expect("read")
                .map(|e| e.kind),
            Some(DenyKind::Client)
        );
        assert_eq!(store.denied(&other, Some("cli"), 200).expect("read"), None);
        // Replacing keeps one row per (kind, value).
        store
            .deny(entry(DenyKind::Client, "cli", Some(900), 150))
            .expect("extend");
        assert_eq!(store.deny_entries().expect("list").len(), 2);
    }
    let store = open(dir.path());
    let list = store.deny_entries().expect("list");
    assert_eq!(list.len(), 2, "{list:?}");
    assert_eq!(list[0].kind, DenyKind::Client);
    assert_eq!(list[0].until_ms, Some(900));
    // A write prunes the entries that expired by then.
    store
        .deny(entry(DenyKind::Client, "other", None, 1_000))
        .expect("deny");
    let values = crate::testing::conformance::deny_values(&store);
    assert_eq!(values.len(), 2, "{values:?}");
    assert!(!values.contains(&"cli".to_owned()), "{values:?}");
    assert!(store.undeny(DenyKind::Client, "other").expect("undeny"));
    assert!(!store.undeny(DenyKind::Client, "other").expect("undeny"));
    assert!(matches!(
        store.deny(entry(DenyKind::Client, "", None, 1)),
        Err(StoreError::InvalidInput(_))
    ));
    assert!(matches!(
        store.deny(entry(
            DenyKind::Client,
            &"x".repeat(MAX_DENY_VALUE + 1),
            None,
            1
        )),
        Err(StoreError::InvalidInput(_))
    ));
    store
        .deny(entry(
            DenyKind::Client,
            &"x".repeat(MAX_DENY_VALUE),
            None,
            1,
        ))
        .expect("at the bound");
}

#[test]
fn enrolments_are_found_by_fingerprint() {
    let dir = tempfile::tempdir().expect("tempdir");
    let store = open(dir.path());
    let (a, b) = (key(1), key(2));
    for (k, n) in [(&a, "one"), (&b, "two")] {
        store.enrol(request(k, n, None, 10)).expect("enrol");
    }
    store.revoke(&b, 11).expect("revoke");
    let found = store
        .enrolments_by_fingerprint(&key_fingerprint(&b))
        .expect("scan");
    assert_eq!(found.len(), 1);
    assert_eq!(found[0].host_pubkey, b);
    assert!(found[0].is_revoked());
    assert!(store
        .enrolments_by_fingerprint("0000-0000-0000-0000")
        .expect("scan")
        .is_empty());
}

#[test]
fn the_deny_list_holds_at_most_max_entries() {
    let dir = tempfile::tempdir().expect("tempdir");
    open(dir.path()).close().expect("close");
    {
        let mut conn = Connection::open(dir.path().join(crate::store::DB_FILE)).expect("raw");
        let tx = conn.transaction().expect("tx");
        {
            let mut st = tx
                .prepare("INSERT INTO deny (kind, value, until, at) VALUES ('client', ?1, NULL, 1)")
                .expect("prepare");
            for i in 0..MAX_DENY_ENTRIES - 1 {
                st.execute([format!("c{i}")]).expect("insert");
            }
        }
        tx.commit().expect("commit");
    }
    let store = open(dir.path());
    let last = entry(DenyKind::Host, "ffff-ffff-ffff-ffff", None, 2);
    assert_eq!(
        store.deny(last.clone()).expect("at the bound"),
        DenyOutcome::Stored(last)
    );
    assert_eq!(
        store
            .deny(entry(DenyKind::Client, "one-more", None, 3))
            .expect("past the bound"),
        DenyOutcome::Full
    );
    // Replacing an entry that exists is still possible at the bound.
    assert!(matches!(
        store.deny(entry(DenyKind::Client, "c7", Some(9_999), 4)),
        Ok(DenyOutcome::Stored(_))
    ));
}
