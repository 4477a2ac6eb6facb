//! Tests of the operator controls (`admin.rs`).

use super::*;
use crate::store::{DirectoryStore, OperationsStore};
use crate::testing::conformance::enrol_request_at;

#[test]
fn fingerprints_and_targets_parse() {
    assert_eq!(
        parse_fingerprint("ABCD:EF01 2345-6789").as_deref(),
        Some("abcd-ef01-2345-6789")
    );
    assert_eq!(parse_fingerprint("abcd-ef01-2345-678"), None);
    let key = agentmbx_protocol::keys::HostKey::generate().public();
    assert_eq!(
        deny_target(&key.to_b64(), None).expect("key"),
        (DenyKind::Host, key.fingerprint())
    );
    assert_eq!(
        deny_target("abcdef0123456789", None).expect("fp"),
        (DenyKind::Host, "abcd-ef01-2345-6789".to_owned())
    );
    assert_eq!(
        deny_target("cli-42", None).expect("client"),
        (DenyKind::Client, "cli-42".to_owned())
    );
    // Forced readings.
    assert_eq!(
        deny_target("abcdef0123456789", Some(DenyKind::Client)).expect("client"),
        (DenyKind::Client, "abcdef0123456789".to_owned())
    );
    assert!(deny_target("cli-42", Some(DenyKind::Host)).is_err());
    assert!(deny_target("", None).is_err());
    assert!(deny_target(&"z".repeat(257), None).is_err());
    assert!(deny_target("a\nb", None).is_err());
    deny_target(&"z".repeat(256), None).expect("at the bound");
}

#[test]
fn client_ids_are_printable_ascii_and_mistyped_fingerprints_are_refused() {
    for bad in [
        "cli\u{202e}gnp.exe",
        "cli\u{200b}42",
        "cli\u{1b}[31m",
        "cli\t42",
        "clï",
    ] {
        let err = deny_target(bad, None).unwrap_err().to_string();
        assert!(err.contains("printable ASCII"), "{bad:?}: {err}");
        assert!(
            err.is_ascii() && !err.chars().any(|c| c.is_control()),
            "{err:?}"
        );
        assert!(deny_target(bad, Some(DenyKind::Client)).is_err(), "{bad:?}");
    }
    deny_target("my client 42", Some(DenyKind::Client)).expect("spaces are VSCHARs");
    // Hex digits and separators, but not 16 hex digits: a mistyped fingerprint.
    for typo in [
        "abcd-ef01-2345-678",
        "abcd:ef01:2345:6789:0",
        "1234",
        "dead beef",
    ] {
        let err = deny_target(typo, None).unwrap_err().to_string();
        assert!(
            err.contains("not a fingerprint") && err.contains("use --client"),
            "{typo}: {err}"
        );
        // Forced as a client_id it is one.
        assert_eq!(
            deny_target(typo, Some(DenyKind::Client)).unwrap(),
            (DenyKind::Client, typo.to_owned())
        );
    }
    // Errors echo at most 64 characters, escaped.
    let long = format!("\u{1b}]0;{}", "x".repeat(500));
    let err = deny_target(&long, Some(DenyKind::Host))
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("\\u{1b}]0;xxx") && err.contains("...\""),
        "{err}"
    );
    assert!(err.len() < 200 && !err.contains('\u{1b}'), "{err}");
    let err = revoke_target(&long).unwrap_err().to_string();
    assert!(err.len() < 200 && !err.contains('\u{1b}'), "{err}");
    assert!(err.contains("neither a host key"), "{err}");
}

#[test]
fn until_takes_durations_and_utc_times() {
    let now = 1_767_225_600_000;
    for (text, want) in [
        ("90s", now + 90_000),
        ("30m", now + 1_800_000),
        ("2h", now + 7_200_000),
        ("7d", now + 604_800_000),
        ("1w", now + 604_800_000),
        ("2026-01-31T12:00:00Z", 1_769_860_800_000),
        ("2026-01-31T12:00:00.500Z", 1_769_860_800_500),
    ] {
        assert_eq!(parse_until(text, now).expect(text), want, "{text}");
    }
    for bad in [
        "",
        "2",
        "h",
        "0h",
        "2y",
        "-2h",
        "2026-01-31",
        "tomorrow",
        "99999999999999d",
    ] {
        assert!(parse_until(bad, now).is_err(), "{bad}");
    }
}

/// A new relay key in `dir/relay.key` (what the offline commands sign with); its public
/// key.
fn relay_key_file(dir: &std::path::Path) -> String {
    let key = agentmbx_protocol::keys::HostKey::generate();
    std::fs::write(dir.join("relay.key"), key.to_key_file().to_text()).expect("relay.key");
    key.public().to_b64()
}

/// A signed store in `dir` (a fresh `relay.key`, opened at 1) with one host, "one", enrolled
/// at 1; returns the host's key and the store.
fn store_with_one_host(dir: &std::path::Path) -> (agentmbx_protocol::keys::PublicKey, SqliteStore) {
    let relay = relay_key_file(dir);
    let key = agentmbx_protocol::keys::HostKey::generate().public();
    let store = SqliteStore::open(dir, &relay, 1).expect("open");
    store
        .enrol(enrol_request_at(&key.to_b64(), "one", None, 1))
        .expect("enrol");
    (key, store)
}

/// Without the relay key (neither `MBX_RELAY_KEY` nor `relay.key`), an offline revocation
/// and deny-list change are still made, with unsigned receipts the log does not verify;
/// with `relay.key` back, the receipts are signed again.
#[test]
fn without_the_relay_key_offline_changes_are_made_with_unsigned_receipts() {
    if crate::key::read_env_seed().is_some() {
        return; // The environment names a key: the unsigned path cannot be reached here.
    }
    let dir = tempfile::tempdir().expect("tempdir");
    let relay = agentmbx_protocol::keys::HostKey::generate();
    let host = agentmbx_protocol::keys::HostKey::generate()
        .public()
        .to_b64();
    let store = SqliteStore::open(dir.path(), &relay.public().to_b64(), 1).expect("open");
    store
        .enrol(enrol_request_at(&host, "one", None, 1))
        .expect("enrol");
    store.close().expect("close");
    assert!(!dir.path().join("relay.key").exists());

    let off = open_offline(dir.path(), 2).expect("opened without the key");
    let why = off
        .unsigned
        .clone()
        .expect("says the receipts are unsigned");
    assert!(
        why.contains("UNSIGNED") && why.contains("relay.key"),
        "{why}"
    );
    assert!(revoke(&off.store, &host, 2).expect("revoked").newly_revoked);
    deny(&off.store, "cli-x", Some(DenyKind::Client), None, 2).expect("denied");
    assert!(off
        .store
        .enrolment(&host)
        .expect("read")
        .expect("row")
        .is_revoked());
    off.store.close().expect("close");
    let log = crate::ops::read_verified_log(dir.path(), 10).expect("log");
    let seen: Vec<(&str, bool, bool)> = log
        .iter()
        .map(|e| {
            (
                e.record.op.as_str(),
                e.verified,
                e.record.receipt.get("sig").is_some(),
            )
        })
        .collect();
    assert_eq!(
        seen,
        [("relay-deny", false, false), ("relay-revoke", false, false)]
    );

    // The key back in relay.key: signed again, and no warning.
    std::fs::write(dir.path().join("relay.key"), relay.to_key_file().to_text()).expect("relay.key");
    let off = open_offline(dir.path(), 3).expect("signed");
    assert_eq!(off.unsigned, None);
    undeny(&off.store, "cli-x", Some(DenyKind::Client), 3).expect("undeny");
    off.store.close().expect("close");
    let log = crate::ops::read_verified_log(dir.path(), 1).expect("log");
    assert_eq!(log[0].record.op, "relay-undeny");
    assert!(log[0].verified);
}

#[test]
fn a_fingerprint_of_several_enrolments_is_refused_with_the_list() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (key, store) = store_with_one_host(dir.path());
    store.close().expect("close");
    // A second row whose text differs but names the same key bytes (only a corrupted or
    // hand-edited store can hold one): the fingerprint matches both.
    crate::store::raw::exec_with(
        &dir.path().join(crate::store::DB_FILE),
        "INSERT INTO enrolments (host_pubkey, host_name, owner_fp, account, authorized_by,
               authority_rank, enrolled_at, revoked_at)
             VALUES (?1, 'two', '', NULL, 'host-key-challenge', 0, 2, NULL)",
        &[format!("{}\n", key.to_b64()).as_str()],
    );
    let store = open_offline(dir.path(), 3).expect("offline").store;
    match revoke(&store, &key.fingerprint(), 3) {
        Err(e @ AdminError::Ambiguous { .. }) => {
            let text = e.to_string();
            assert!(text.contains("matches 2 enrolments"), "{text}");
            assert!(text.contains("(one)") && text.contains("(two)"), "{text}");
        }
        other => panic!("{other:?}"),
    }
    // Nothing was revoked; by key it works.
    assert!(!store
        .enrolment(&key.to_b64())
        .expect("read")
        .expect("row")
        .is_revoked());
    let r = revoke(&store, &key.to_b64(), 4).expect("by key");
    assert!(r.newly_revoked);
    assert_eq!(r.host.host_name, "one");
    // A second offline open is refused while this one holds the lock.
    assert!(matches!(
        open_offline(dir.path(), 5),
        Err(AdminError::Running(_))
    ));
    assert!(matches!(
        open_offline(&dir.path().join("none"), 5),
        Err(AdminError::NoStore(_))
    ));
}

/// A change and its relay-log receipt commit together: when the receipt cannot be written
/// (a trigger refuses every insert into `ops`), the change is not committed either; when it
/// can, both are there.
#[test]
fn a_change_and_its_log_receipt_are_one_transaction() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (key, store) = store_with_one_host(dir.path());
    deny(&store, "cli-old", Some(DenyKind::Client), None, 1).expect("deny");
    let ops_before = store.ops(100).expect("ops").len();
    store.close().expect("close");
    crate::store::raw::exec(
        &dir.path().join(crate::store::DB_FILE),
        "CREATE TRIGGER no_log BEFORE INSERT ON ops BEGIN SELECT RAISE(ABORT, 'no log'); END;",
    );

    let store = open_offline(dir.path(), 2).expect("offline").store;
    assert!(revoke(&store, &key.to_b64(), 2).is_err());
    assert!(deny(&store, "cli-new", Some(DenyKind::Client), None, 2).is_err());
    assert!(undeny(&store, "cli-old", Some(DenyKind::Client), 2).is_err());
    // Nothing changed: not revoked, no new entry, the old entry still there.
    assert!(!store
        .enrolment(&key.to_b64())
        .expect("read")
        .expect("row")
        .is_revoked());
    let values = crate::testing::conformance::deny_values(&store);
    assert_eq!(values, vec!["cli-old".to_owned()]);
    store.close().expect("close");

    crate::store::raw::exec(
        &dir.path().join(crate::store::DB_FILE),
        "DROP TRIGGER no_log;",
    );
    let store = open_offline(dir.path(), 3).expect("offline").store;
    assert!(
        revoke(&store, &key.to_b64(), 3)
            .expect("revoke")
            .newly_revoked
    );
    deny(&store, "cli-new", Some(DenyKind::Client), None, 3).expect("deny");
    assert!(
        undeny(&store, "cli-old", Some(DenyKind::Client), 3)
            .expect("undeny")
            .2
    );
    // Already revoked / nothing to remove: no change, no receipt.
    assert!(
        !revoke(&store, &key.to_b64(), 4)
            .expect("again")
            .newly_revoked
    );
    assert!(
        !undeny(&store, "cli-old", Some(DenyKind::Client), 4)
            .expect("again")
            .2
    );
    let ops: Vec<String> = store
        .ops(100)
        .expect("ops")
        .into_iter()
        .map(|o| o.op)
        .collect();
    assert_eq!(ops.len(), ops_before + 3, "{ops:?}");
    assert_eq!(ops[..3], ["relay-undeny", "relay-deny", "relay-revoke"]);
    assert!(store
        .enrolment(&key.to_b64())
        .expect("read")
        .expect("row")
        .is_revoked());
}
