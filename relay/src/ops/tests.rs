//! Tests of the relay operations (`ops.rs`).

use super::*;
use crate::store::SqliteStore;
use crate::store::{DirectoryStore, ItemStore, OperationsStore, StoreHealth};
use crate::testing::conformance::{enrol_request_at, item, item_of};

fn relay_key() -> String {
    agentmbx_protocol::keys::HostKey::generate()
        .public()
        .to_b64()
}

#[test]
fn sweep_receipts_have_their_own_cap_and_never_evict_the_other_operations() {
    use crate::store::OP_SWEEP;
    let dir = tempfile::tempdir().expect("tempdir");
    let store = SqliteStore::open(dir.path(), &relay_key(), 1).expect("open");
    let append = |op: &str, i: i64| {
        store
            .append_op(i, op, &json!({"v": 1, "type": op, "i": i}))
            .expect("append")
    };
    let count = |op: &str| {
        let log = read_log(dir.path(), 5_000).expect("log");
        log.iter().filter(|o| o.op == op).count() as i64
    };
    for i in 0..3 {
        append(OP_RESTORE, i);
    }
    // At the sweep cap every sweep receipt is kept; past it the oldest go, and only they.
    for i in 0..SWEEP_OPS_KEEP {
        append(OP_SWEEP, 10 + i);
    }
    assert_eq!(count(OP_SWEEP), SWEEP_OPS_KEEP);
    for i in 0..250 {
        append(OP_SWEEP, 1_000 + i);
    }
    assert_eq!(count(OP_SWEEP), SWEEP_OPS_KEEP);
    assert_eq!(count(OP_RESTORE), 3, "sweeps never evict a restore");
    let log = read_log(dir.path(), 5_000).expect("log");
    let oldest_sweep = log
        .iter()
        .filter(|o| o.op == OP_SWEEP)
        .map(|o| o.at_ms)
        .min();
    assert_eq!(oldest_sweep, Some(1_000 + 250 - SWEEP_OPS_KEEP));
    // The other operations keep OPS_KEEP between them: at the cap all of them, past it the
    // oldest go; the sweep receipts stay.
    for i in 0..(OPS_KEEP - 3) {
        append(OP_BACKUP, 10_000 + i);
    }
    assert_eq!(count(OP_RESTORE), 3);
    assert_eq!(count(OP_BACKUP), OPS_KEEP - 3);
    append(OP_BACKUP, 20_000);
    assert_eq!(count(OP_RESTORE), 2, "the oldest other entry goes");
    assert_eq!(count(OP_SWEEP), SWEEP_OPS_KEEP);
    let log = read_log(dir.path(), 5_000).expect("log");
    assert_eq!(
        log.len() as i64,
        OPS_KEEP + SWEEP_OPS_KEEP,
        "the whole log is read"
    );
    assert!(log.windows(2).all(|w| w[0].id > w[1].id), "newest first");
    assert_eq!(store.ops(5_000).expect("ops").len(), log.len());
    store.close().expect("close");
}

#[test]
fn the_heartbeat_rule_holds_at_ten_minutes_and_rotates_past_it_either_way() {
    let now = 1_800_000_000_000;
    assert!(!heartbeat_stale(None, now));
    assert!(!heartbeat_stale(Some(now), now));
    assert!(!heartbeat_stale(Some(now - HEARTBEAT_STALE_MS), now));
    assert!(heartbeat_stale(Some(now - HEARTBEAT_STALE_MS - 1), now));
    assert!(!heartbeat_stale(Some(now + HEARTBEAT_STALE_MS), now));
    assert!(heartbeat_stale(Some(now + HEARTBEAT_STALE_MS + 1), now));
    assert!(heartbeat_stale(Some(i64::MIN), now));
    assert!(heartbeat_stale(Some(i64::MAX), i64::MIN));
}

#[test]
fn a_stale_or_future_heartbeat_rotates_the_epoch_with_its_receipt() {
    let dir = tempfile::tempdir().expect("tempdir");
    let store = SqliteStore::open(dir.path(), &relay_key(), 1).expect("open");
    let db = store_db(dir.path());
    let now = 1_800_000_000_000;
    // No heartbeat, a fresh one, one at the bound: nothing.
    assert_eq!(rotate_if_stale(&store, &db, now).expect("none"), None);
    for beat in [
        now - 1_000,
        now - HEARTBEAT_STALE_MS,
        now + HEARTBEAT_STALE_MS,
    ] {
        store.set_heartbeat(beat).expect("beat");
        assert_eq!(rotate_if_stale(&store, &db, now).expect("fresh"), None);
    }
    assert!(store.ops(10).expect("ops").is_empty());
    let epoch0 = store.epoch().expect("epoch");

    // Past the bound, old then in the future: rotated each time, logged, meta written.
    let mut last = epoch0;
    for beat in [now - HEARTBEAT_STALE_MS - 1, now + HEARTBEAT_STALE_MS + 1] {
        store.set_heartbeat(beat).expect("beat");
        let r = rotate_if_stale(&store, &db, now)
            .expect("rotate")
            .expect("rotated");
        let epoch = store.epoch().expect("epoch");
        assert_ne!(epoch, last);
        assert_eq!(r["v"], 1);
        assert_eq!(r["type"], "relay-epoch-rotated");
        assert_eq!(r["by"], "heartbeat");
        assert_eq!(r["from"], last.as_str());
        assert_eq!(r["to"], epoch.as_str());
        assert_eq!(r["store"], db.as_str());
        assert_eq!(r["at"], iso_ms(now).as_str());
        let logged = &store.ops(1).expect("ops")[0];
        assert_eq!(logged.op, "relay-epoch-rotated");
        assert_eq!(logged.receipt, r);
        let meta: Value =
            serde_json::from_str(&store.meta("epoch_rotated").expect("meta").expect("set"))
                .expect("json");
        assert_eq!(meta, r);
        last = epoch;
    }
    let r = rotate_epoch(&store, &db, RotatedBy::Operator, now + 5).expect("operator");
    assert_eq!(r["by"], "operator");
    assert_eq!(r["from"], last.as_str());
    assert_eq!(store.ops(10).expect("ops").len(), 3);
}

#[test]
fn an_epoch_rotation_and_its_receipt_are_one_transaction() {
    let dir = tempfile::tempdir().expect("tempdir");
    let store = SqliteStore::open(dir.path(), &relay_key(), 1).expect("open");
    let epoch = store.epoch().expect("epoch");
    store.close().expect("close");
    crate::store::raw::exec(
        &dir.path().join(DB_FILE),
        "CREATE TRIGGER no_log BEFORE INSERT ON ops BEGIN SELECT RAISE(ABORT, 'no log'); END;",
    );
    let store = SqliteStore::open(dir.path(), &relay_key_of(dir.path()), 2).expect("open");
    assert!(rotate_epoch(&store, "x", RotatedBy::Operator, 2).is_err());
    assert_eq!(store.epoch().expect("epoch"), epoch);
    assert_eq!(store.meta("epoch_rotated").expect("meta"), None);
}

fn relay_key_of(dir: &Path) -> String {
    SqliteStore::recorded_relay_pubkey(dir)
        .expect("read")
        .expect("key")
}

fn enrol_and_push(store: &SqliteStore, n: usize) -> String {
    let target = relay_key();
    store
        .enrol(enrol_request_at(&target, "beta", None, 1))
        .expect("enrol");
    for i in 0..n {
        store
            .push(crate::testing::conformance::batch(
                &relay_key(),
                "alpha",
                10 + i as i64,
                crate::store::Expiry::Never,
                vec![item(
                    &format!("item-{i}"),
                    &[(&target, &format!("wire {i}").into_bytes())],
                )],
            ))
            .expect("push");
    }
    target
}

#[test]
fn a_backup_is_a_checked_store_with_the_same_items_and_a_matching_receipt() {
    let dir = tempfile::tempdir().expect("tempdir");
    let out = tempfile::tempdir().expect("out");
    let store = SqliteStore::open(dir.path(), &relay_key(), 1).expect("open");
    let target = enrol_and_push(&store, 5);
    store.set_heartbeat(1_234).expect("beat");
    let file = out.path().join("b.db");
    // While the store is open (as while serving).
    let r = backup(dir.path(), &file, 99).expect("backup");
    assert_eq!(r["type"], "relay-backup");
    assert_eq!(r["file"], file.display().to_string().as_str());
    assert_eq!(r["epoch"], store.epoch().expect("epoch").as_str());
    assert_eq!(r["heartbeat"], iso_ms(1_234).as_str());
    assert_eq!(r["schema_version"], crate::store::SCHEMA_VERSION);
    let bytes = std::fs::read(&file).expect("read");
    assert_eq!(r["bytes"], bytes.len());
    assert_eq!(r["sha256"], crate::store::wire_hash(&bytes).as_str());
    assert_eq!(
        r["counts"],
        json!({"enrolments": 1, "revoked": 0, "items": 5, "bytes": 30, "dedup": 5, "targets": 1})
    );
    assert!(r["restore"]
        .as_str()
        .expect("restore")
        .starts_with("agentmbx relay restore "));
    // The copy is self-contained (rollback journal) and holds the same items.
    let mode: Option<String> = crate::store::raw::one(&file, "PRAGMA journal_mode", &[]);
    assert_eq!(mode.as_deref(), Some("delete"));
    let wires: Vec<Vec<u8>> = crate::store::raw::column(
        &file,
        "SELECT wire FROM items WHERE target_pubkey = ?1 ORDER BY seq",
        &[target.as_str()],
    );
    let want: Vec<Vec<u8>> = (0..5).map(|i| format!("wire {i}").into_bytes()).collect();
    assert_eq!(wires, want);
    // It opens as a store of this relay.
    let copy_dir = tempfile::tempdir().expect("copy dir");
    std::fs::copy(&file, copy_dir.path().join(DB_FILE)).expect("copy");
    // (More than 90 s after its heartbeat: a copy without relay.lock and a fresher
    // heartbeat may have a relay on it.)
    let opened =
        SqliteStore::open(copy_dir.path(), &relay_key_of(dir.path()), 100_000).expect("opens");
    assert_eq!(
        opened.epoch().expect("epoch"),
        store.epoch().expect("epoch")
    );
    assert_eq!(opened.info_for(&target).expect("info").head_seq, {
        store.info_for(&target).expect("info").head_seq
    });
    // Nothing else left behind.
    let names = ls(out.path());
    assert_eq!(names, ["b.db"]);
}

#[test]
fn an_existing_file_is_refused_and_untouched_and_no_partial_file_remains_on_failure() {
    let dir = tempfile::tempdir().expect("tempdir");
    let out = tempfile::tempdir().expect("out");
    let store = SqliteStore::open(dir.path(), &relay_key(), 1).expect("open");
    enrol_and_push(&store, 1);
    let file = out.path().join("taken.db");
    std::fs::write(&file, b"mine").expect("write");
    match backup(dir.path(), &file, 1) {
        Err(e @ OpsError::Exists(_)) => {
            assert!(e.to_string().contains("already exists"), "{e}")
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(std::fs::read(&file).expect("read"), b"mine");
    // A dangling symlink is a name that exists too.
    let link = out.path().join("link.db");
    std::os::unix::fs::symlink(out.path().join("nowhere"), &link).expect("symlink");
    assert!(matches!(
        backup(dir.path(), &link, 1),
        Err(OpsError::Exists(_))
    ));
    // No store.
    assert!(matches!(
        backup(&dir.path().join("none"), &out.path().join("x.db"), 1),
        Err(OpsError::NoStore(_))
    ));
    // A source that is not a database fails after the partial file was created: it is gone.
    let bad = tempfile::tempdir().expect("bad");
    std::fs::write(bad.path().join(DB_FILE), vec![7u8; 8192]).expect("junk");
    assert!(backup(bad.path(), &out.path().join("y.db"), 1).is_err());
    let names = ls(out.path());
    assert_eq!(names, ["link.db", "taken.db"]);
    // A missing directory: an I/O error, nothing created.
    assert!(matches!(
        backup(dir.path(), &out.path().join("no/such/dir.db"), 1),
        Err(OpsError::Io { .. })
    ));
}

#[test]
fn the_log_reads_newest_first_without_the_lock_and_summarises_each_op() {
    let dir = tempfile::tempdir().expect("tempdir");
    let store = SqliteStore::open(dir.path(), &relay_key(), 1).expect("open");
    for i in 0..3 {
        rotate_epoch(&store, "s", RotatedBy::Operator, 10 + i).expect("rotate");
    }
    // The store (holding relay.lock) is open: the log still reads.
    let log = read_log(dir.path(), 2).expect("log");
    assert_eq!(log.len(), 2);
    assert!(log[0].id > log[1].id);
    assert_eq!(log[0].at_ms, 12);
    let text = summary(&log[0]);
    assert!(
        text.contains(" -> ") && text.ends_with("(by operator)"),
        "{text}"
    );
    assert_eq!(read_log(dir.path(), 0).expect("clamped").len(), 1);
    assert_eq!(read_log(dir.path(), 5_000).expect("clamped").len(), 3);
    assert!(matches!(
        read_log(&dir.path().join("none"), 5),
        Err(OpsError::NoStore(_))
    ));
}

#[test]
fn every_receipt_a_signed_store_appends_verifies_and_an_altered_one_does_not() {
    use crate::store::{DenyEntry, DenyKind};
    let dir = tempfile::tempdir().expect("tempdir");
    let key = HostKey::generate();
    std::fs::write(dir.path().join("relay.key"), key.to_key_file().to_text()).expect("key");
    // A store that never saw the key: created unsigned, then opened offline with it.
    let first = SqliteStore::open(dir.path(), &key.public().to_b64(), 1).expect("open");
    first
        .append_op(1, "relay-backup", &json!({"v": 1}))
        .expect("unsigned");
    first.close().expect("close");
    let loaded = offline_relay_key(dir.path()).expect("relay.key");
    assert_eq!(loaded.public(), key.public());
    let store = open_offline_signed(dir.path(), loaded, 2).expect("signed");
    let rotated = rotate_epoch(&store, "s", RotatedBy::Operator, 3).expect("rotate");
    assert!(verify_receipt(&rotated, &key.public()), "{rotated}");
    // A caller's `sig` is never kept: the store signs.
    store
        .append_op(
            4,
            OP_BACKUP,
            &json!({"v": 1, "type": OP_BACKUP, "sig": "forged"}),
        )
        .expect("append");
    store
        .deny_logged(
            DenyEntry {
                kind: DenyKind::Client,
                value: "c".into(),
                until_ms: None,
                at_ms: 5,
            },
            OpEntry {
                at_ms: 5,
                op: "relay-deny".into(),
                receipt: json!({"v": 1, "type": "relay-deny"}),
            },
        )
        .expect("deny");
    let meta: Value =
        serde_json::from_str(&store.meta("epoch_rotated").expect("meta").expect("set"))
            .expect("json");
    assert_eq!(meta, rotated, "meta keeps the signed receipt");
    store.close().expect("close");

    let log = read_verified_log(dir.path(), 10).expect("log");
    let seen: Vec<(&str, bool)> = log
        .iter()
        .map(|e| (e.record.op.as_str(), e.verified))
        .collect();
    assert_eq!(
        seen,
        [
            ("relay-deny", true),
            (OP_BACKUP, true),
            (OP_EPOCH_ROTATED, true),
            (OP_BACKUP, false)
        ]
    );
    assert_ne!(log[1].record.receipt["sig"], "forged");
    assert!(!summary(&log[1].record).contains("sig"));

    // One changed byte of a receipt, or another key: no longer verified.
    crate::store::raw::exec(
        &dir.path().join(DB_FILE),
        "UPDATE ops SET receipt = replace(receipt, '\"v\":1', '\"v\":2') WHERE op = 'relay-deny'",
    );
    let log = read_verified_log(dir.path(), 10).expect("log");
    assert!(!log[0].verified);
    assert!(log[1].verified);
    assert!(!verify_receipt(
        &log[1].record.receipt,
        &HostKey::generate().public()
    ));
}

/// The retention sweep appends its `relay-sweep` receipt through the store like every
/// other operation: signed too, without knowing about signatures.
#[test]
fn the_sweep_receipt_is_signed_like_every_other() {
    use crate::store::{Expiry, DAY_MS};
    let dir = tempfile::tempdir().expect("tempdir");
    let key = HostKey::generate();
    let store = open_offline_signed(dir.path(), key.clone(), 1).expect("signed");
    let (target, sender) = (relay_key(), relay_key());
    store
        .enrol(enrol_request_at(&target, "beta", None, 1))
        .expect("enrol");
    store
        .push(crate::testing::conformance::batch(
            &sender,
            "alpha",
            10,
            Expiry::Retention,
            vec![item_of("receipt", "old", &[(&target, b"wire")])],
        ))
        .expect("push");
    let notices: std::sync::Arc<dyn crate::store::NoticeSigner> =
        std::sync::Arc::new(crate::retention::RelayNoticeSigner::new(key.clone()));
    let report = store.sweep(10 + 15 * DAY_MS, notices).expect("sweep");
    assert!(report.logged, "{report:?}");
    store.close().expect("close");
    let log = read_verified_log(dir.path(), 5).expect("log");
    assert_eq!(log[0].record.op, crate::store::OP_SWEEP);
    assert!(log[0].verified, "{:?}", log[0]);
    assert!(verify_receipt(&log[0].record.receipt, &key.public()));
}

#[test]
fn the_offline_relay_key_is_never_created() {
    let dir = tempfile::tempdir().expect("tempdir");
    if crate::key::read_env_seed().is_some() {
        return; // The environment names a key: that one wins, nothing to check here.
    }
    match offline_relay_key(dir.path()) {
        Err(e @ OpsError::RelayKey(_)) => {
            assert!(e.to_string().contains("MBX_RELAY_KEY"), "{e}")
        }
        other => panic!("{other:?}"),
    }
    // None at all is no error for a command that may run unsigned.
    assert!(offline_relay_key_if_any(dir.path())
        .expect("no key")
        .is_none());
    let why = unsigned_receipt_reason(dir.path());
    assert!(
        why.contains("UNSIGNED") && why.contains("MBX_RELAY_KEY"),
        "{why}"
    );
    assert!(!dir.path().join("relay.key").exists());
    // A malformed key is an error either way: it must be fixed, not ignored.
    std::fs::write(dir.path().join("relay.key"), "{\"publicKey\":\"x\"}").expect("bad");
    let e = offline_relay_key(dir.path()).expect_err("malformed");
    assert!(e.to_string().contains("not a valid relay key file"), "{e}");
    assert!(offline_relay_key_if_any(dir.path()).is_err());
}

#[test]
fn only_this_relays_backup_receipts_pass_the_admin_check() {
    let good = json!({"v": 1, "type": "relay-backup", "relay_fingerprint": "abcd-ef01-2345-6789",
                          "sha256": "a".repeat(64), "file": "/b.db", "at": "2026-01-01T00:00:00.000Z"});
    check_backup_receipt(&good, "abcd-ef01-2345-6789").expect("good");
    assert!(check_backup_receipt(&good, "0000-0000-0000-0000").is_err());
    let mut bad = good.clone();
    bad["type"] = json!("relay-restore");
    assert!(check_backup_receipt(&bad, "abcd-ef01-2345-6789").is_err());
    let mut bad = good.clone();
    bad["sha256"] = json!("zz");
    assert!(check_backup_receipt(&bad, "abcd-ef01-2345-6789").is_err());
    let mut big = good;
    big["pad"] = json!("x".repeat(9_000));
    assert!(check_backup_receipt(&big, "abcd-ef01-2345-6789").is_err());
}

fn ls(dir: &Path) -> Vec<String> {
    crate::testing::file_names(dir)
}

#[test]
fn a_killed_backups_partial_file_is_removed_by_the_next_backup_to_that_name() {
    let dir = tempfile::tempdir().expect("tempdir");
    let out = tempfile::tempdir().expect("out");
    let store = SqliteStore::open(dir.path(), &relay_key(), 1).expect("open");
    enrol_and_push(&store, 1);
    // pid_max is at most 4194304: that pid never runs; pid 1 always does.
    for name in [
        "b.db.partial-4194304",
        "b.db.partial-4194304-journal",
        "b.db.partial-1",
        "c.db.partial-4194304",
    ] {
        std::fs::write(out.path().join(name), b"x").expect("write");
    }
    backup(dir.path(), &out.path().join("b.db"), 1).expect("backup");
    assert_eq!(
        ls(out.path()),
        ["b.db", "b.db.partial-1", "c.db.partial-4194304"]
    );
}

#[test]
fn an_unreadable_receipt_is_listed_and_the_rest_of_the_log_still_reads_and_verifies() {
    let dir = tempfile::tempdir().expect("tempdir");
    let key = HostKey::generate();
    let store = open_offline_signed(dir.path(), key.clone(), 1).expect("signed");
    for i in 0..3 {
        rotate_epoch(&store, "s", RotatedBy::Operator, 10 + i).expect("rotate");
    }
    store.close().expect("close");
    crate::store::raw::exec(
        &dir.path().join(DB_FILE),
        "UPDATE ops SET receipt = 'not json {' WHERE id = (SELECT MIN(id) FROM ops)",
    );
    let log = read_verified_log(dir.path(), 10).expect("log");
    assert_eq!(log.len(), 3);
    assert_eq!(
        log.iter().map(|e| e.verified).collect::<Vec<_>>(),
        [true, true, false]
    );
    assert!(log[2]
        .problem
        .as_deref()
        .is_some_and(|p| p.contains("not JSON")));
    assert_eq!(summary(&log[2].record), "(unreadable receipt)");
    assert!(log[0].problem.is_none());
    assert_eq!(read_log(dir.path(), 10).expect("plain").len(), 3);
}

#[test]
fn the_op_and_at_shown_are_the_signed_ones_and_the_relay_key_decides_what_verifies() {
    let dir = tempfile::tempdir().expect("tempdir");
    let key = HostKey::generate();
    let store = open_offline_signed(dir.path(), key.clone(), 1).expect("signed");
    rotate_epoch(&store, "s", RotatedBy::Operator, 10).expect("rotate");
    rotate_epoch(&store, "s", RotatedBy::Operator, 20).expect("rotate");
    store.close().expect("close");
    // The columns the signature does not cover, changed on the newest entry.
    crate::store::raw::exec(
        &dir.path().join(DB_FILE),
        "UPDATE ops SET op = 'relay-undeny', at = 99 WHERE id = (SELECT MAX(id) FROM ops);
             UPDATE ops SET at = 77 WHERE id = (SELECT MIN(id) FROM ops);",
    );
    let (log, warning) = read_verified_log_with(dir.path(), 10, Some(&key.public())).expect("log");
    assert_eq!(warning, None);
    assert!(!log[0].verified, "another op than the signed type");
    assert!(log[1].verified);
    assert_eq!(log[1].op(), OP_EPOCH_ROTATED);
    assert_eq!(log[1].at_ms(), 10, "the signed at, not the column's 77");

    // A store re-signed with another key carries that key: it verifies against itself but
    // never against the relay key, and the mismatch is said.
    let forger = HostKey::generate();
    let forged = tempfile::tempdir().expect("forged");
    let store = open_offline_signed(forged.path(), forger.clone(), 1).expect("forged");
    rotate_epoch(&store, "s", RotatedBy::Operator, 10).expect("rotate");
    store.close().expect("close");
    assert!(read_verified_log(forged.path(), 10).expect("log")[0].verified);
    let (log, warning) =
        read_verified_log_with(forged.path(), 10, Some(&key.public())).expect("log");
    assert!(!log[0].verified);
    let warning = warning.expect("warned");
    assert!(
        warning.contains(&forger.public().fingerprint())
            && warning.contains(&key.public().fingerprint()),
        "{warning}"
    );
}

#[test]
fn reading_the_log_of_a_stopped_store_leaves_no_side_files() {
    let dir = tempfile::tempdir().expect("tempdir");
    let store = SqliteStore::open(dir.path(), &relay_key(), 1).expect("open");
    rotate_epoch(&store, "s", RotatedBy::Operator, 10).expect("rotate");
    store.close().expect("close");
    let before = ls(dir.path());
    assert!(!before
        .iter()
        .any(|n| n.ends_with("-wal") || n.ends_with("-shm")));
    assert_eq!(read_verified_log(dir.path(), 10).expect("log").len(), 1);
    assert_eq!(ls(dir.path()), before);
}
