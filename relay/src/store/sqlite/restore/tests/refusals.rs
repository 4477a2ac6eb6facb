//! The restore's refusals, and what a failed or interrupted restore leaves.

use super::*;

#[test]
fn a_restore_is_refused_while_the_lock_is_held_or_a_lockless_heartbeat_is_fresh() {
    let s = scene();
    let dir = s.dir.path();
    let bytes = std::fs::read(dir.join(DB_FILE)).expect("read");
    let store = s.relay.open(dir, T0);
    let e = restore(dir, &s.backup, &s.relay.opts(T0, true), None).expect_err("held");
    assert_eq!(e.code(), "RELAY_RUNNING");
    assert!(
        e.to_string()
            .starts_with("RELAY_RUNNING: a relay is running on"),
        "{e}"
    );
    store.close().expect("close");
    assert_eq!(std::fs::read(dir.join(DB_FILE)).expect("read"), bytes);
    assert_eq!(names(dir), ["relay.db", "relay.lock"]);

    // No relay.lock (a store from before the lock) and a heartbeat less than 90 s old (or
    // in the future): refused unless --force; 90 s old: fine.
    let now = T0 + 1_000_000;
    for (age, force, ok) in [
        (89_999, false, false),
        (-5_000, false, false),
        (89_999, true, true),
        (90_000, false, true),
    ] {
        std::fs::remove_file(dir.join(LOCK_FILE)).expect("rm lock");
        raw(dir)
            .execute(
                "INSERT INTO meta (k, v) VALUES ('heartbeat', ?1)
                     ON CONFLICT(k) DO UPDATE SET v = excluded.v",
                [(now - age).to_string()],
            )
            .expect("beat");
        let r = restore(dir, &s.backup, &s.relay.opts(now, force), None);
        match (ok, r) {
            (true, Ok(_)) => {}
            (false, Err(e @ RestoreError::FreshHeartbeat { .. })) => {
                assert!(e.to_string().contains("no relay.lock"), "{e}");
                assert_eq!(e.code(), "RELAY_RUNNING");
                // Nothing was created: a second try is refused the same way.
                assert!(!dir.join(LOCK_FILE).exists());
                assert!(matches!(
                    restore(dir, &s.backup, &s.relay.opts(now, false), None),
                    Err(RestoreError::FreshHeartbeat { .. })
                ));
                std::fs::write(dir.join(LOCK_FILE), b"").expect("lock file back");
            }
            (_, other) => panic!("age {age} force {force}: {other:?}"),
        }
    }
}

#[test]
fn backups_that_are_not_this_relays_store_are_refused_and_nothing_changes() {
    let s = scene();
    let dir = s.dir.path();
    let out = s.out.path();
    let bytes = std::fs::read(dir.join(DB_FILE)).expect("read");
    let opts = s.relay.opts(T0 + 5_000, false);

    let e = restore(dir, &out.join("missing.db"), &opts, None).expect_err("missing");
    assert_eq!(e.code(), "NO_BACKUP");
    let e = restore(dir, &dir.join(DB_FILE), &opts, None).expect_err("same");
    assert_eq!(e.code(), "SAME_FILE");

    let junk = out.join("junk.db");
    std::fs::write(&junk, vec![7u8; 8192]).expect("junk");
    let e = restore(dir, &junk, &opts, None).expect_err("junk");
    assert_eq!(e.code(), "NOT_A_STORE", "{e}");
    let empty = out.join("empty.db");
    Connection::open(&empty)
        .expect("db")
        .execute_batch("CREATE TABLE t (x); CREATE TABLE meta (k TEXT, v TEXT);")
        .expect("tables");
    let e = restore(dir, &empty, &opts, None).expect_err("no epoch");
    assert!(e.to_string().contains("no epoch or relay key"), "{e}");

    let newer = out.join("newer.db");
    std::fs::copy(&s.backup, &newer).expect("copy");
    Connection::open(&newer)
        .expect("db")
        .execute_batch("PRAGMA user_version = 99")
        .expect("version");
    let e = restore(dir, &newer, &opts, None).expect_err("schema");
    assert_eq!(e.code(), "SCHEMA", "{e}");
    assert!(e.to_string().contains("schema 99"), "{e}");

    // Another relay's store: refused against the relay key; and this relay's backup over
    // a store of another key is refused against that store.
    let other = Relay::new();
    let other_dir = tempfile::tempdir().expect("other");
    other.open(other_dir.path(), T0).close().expect("close");
    let foreign = backup_now(other_dir.path(), out, "foreign.db");
    let e = restore(dir, &foreign, &opts, None).expect_err("other");
    assert_eq!(e.code(), "OTHER_RELAY");
    assert!(e.to_string().contains("the relay key is"), "{e}");
    let other_bytes = std::fs::read(other_dir.path().join(DB_FILE)).expect("read");
    let e = restore(other_dir.path(), &s.backup, &opts, None).expect_err("other store");
    assert_eq!(e.code(), "OTHER_RELAY");
    assert!(e.to_string().contains("the store is"), "{e}");
    assert_eq!(
        std::fs::read(other_dir.path().join(DB_FILE)).expect("read"),
        other_bytes
    );

    assert_eq!(std::fs::read(dir.join(DB_FILE)).expect("read"), bytes);
    assert_eq!(
        names(dir),
        ["relay.db", "relay.lock"],
        "no rollback copy, no working copy"
    );
    // Refused against the store, the rollback directory exists but holds nothing.
    assert!(names(&other_dir.path().join(ROLLBACK_DIR)).is_empty());
}

#[test]
fn an_unreadable_current_store_needs_force_and_is_kept_as_it_was() {
    let s = scene();
    let dir = s.dir.path();
    let junk = vec![9u8; 16_384];
    std::fs::write(dir.join(DB_FILE), &junk).expect("junk");
    let e = restore(dir, &s.backup, &s.relay.opts(T0 + 1, false), None).expect_err("refused");
    assert_eq!(e.code(), "CURRENT_UNREADABLE", "{e}");
    assert!(e.to_string().contains("--force"), "{e}");
    assert_eq!(std::fs::read(dir.join(DB_FILE)).expect("read"), junk);

    let r = restore(dir, &s.backup, &s.relay.opts(T0 + 2, true), None).expect("forced");
    assert_eq!(r["replaced"]["readable"], false);
    assert_eq!(r["carried"]["revocations"], 0);
    let rollback = r["replaced"]["rollback"].as_str().expect("rollback");
    assert_eq!(std::fs::read(rollback).expect("rollback"), junk);
    assert!(r["rollback"].as_str().expect("undo").ends_with(" --force"));
    // The restored store is the backup's: alpha is live there (its revocation was in the
    // store that could not be read).
    let c = raw(dir);
    assert_eq!(
        one::<Option<i64>>(
            &c,
            "SELECT revoked_at FROM enrolments WHERE host_pubkey = ?1",
            &s.alpha
        ),
        Some(None)
    );
}

#[test]
fn each_path_is_remembered_across_restores_and_into_an_empty_directory() {
    let s = scene();
    let out = s.out.path();
    // Into a directory with no store: nothing replaced, nothing to undo.
    let fresh = tempfile::tempdir().expect("fresh");
    let target = fresh.path().join("store");
    assert_eq!(restored_from(&target, &s.backup).expect("read"), None);
    let r = restore(&target, &s.backup, &s.relay.opts(T0 + 1, false), None).expect("restore");
    assert_eq!(r["replaced"], Value::Null);
    assert_eq!(r["rollback"], Value::Null);
    assert_eq!(
        restored_from(&target, &s.backup).expect("read"),
        Some(iso_ms(T0 + 1))
    );
    // A second backup restored over it: both paths are remembered.
    let second = backup_now(s.dir.path(), out, "second.db");
    restore(&target, &second, &s.relay.opts(T0 + 2, false), None).expect("again");
    assert!(restored_from(&target, &s.backup).expect("read").is_some());
    assert!(restored_from(&target, &second).expect("read").is_some());
    assert_eq!(
        restored_from(&target, &out.join("other.db")).expect("read"),
        None
    );
}

/// The live store's `relay.db` bytes, and the rollback directory's names.
fn live_state(dir: &Path) -> (Vec<u8>, Vec<String>) {
    let rollback = dir.join(ROLLBACK_DIR);
    (
        std::fs::read(dir.join(DB_FILE)).expect("live"),
        if rollback.is_dir() {
            names(&rollback)
        } else {
            Vec::new()
        },
    )
}

/// A copy of `backup` named `name` in `out`, changed by `sql`.
fn altered(backup: &Path, out: &Path, name: &str, sql: &str) -> PathBuf {
    let file = out.join(name);
    std::fs::copy(backup, &file).expect("copy");
    let c = Connection::open(&file).expect("open");
    c.execute_batch(sql).expect(sql);
    c.close().expect("close");
    file
}

#[test]
fn a_backup_with_triggers_views_or_a_schema_not_this_binarys_is_refused_and_nothing_changes() {
    let s = scene();
    let dir = s.dir.path();
    let before = live_state(dir);
    let v = SCHEMA_VERSION;
    // One of the schema's own triggers, its body changed: same name, another definition.
    let own = "DROP TRIGGER items_usage_insert;
            CREATE TRIGGER items_usage_insert AFTER INSERT ON items BEGIN
              DELETE FROM deny; END;";
    for (name, sql, named) in [
        (
            "trigger-deny.db",
            "CREATE TRIGGER t1 AFTER INSERT ON deny BEGIN DELETE FROM deny \
                 WHERE kind = new.kind AND value = new.value; END;"
                .to_owned(),
            "trigger \"t1\" that schema".to_owned(),
        ),
        (
            "trigger-revoke.db",
            "CREATE TRIGGER t2 AFTER UPDATE ON enrolments BEGIN UPDATE enrolments \
                 SET revoked_at = NULL WHERE host_pubkey = new.host_pubkey; END;"
                .to_owned(),
            "trigger \"t2\" that schema".to_owned(),
        ),
        (
            "trigger-modified.db",
            own.to_owned(),
            format!("trigger \"items_usage_insert\" differs from its definition in schema {v}"),
        ),
        (
            "trigger-missing.db",
            "DROP TRIGGER items_usage_delete;".to_owned(),
            format!("trigger \"items_usage_delete\" of schema {v} is missing"),
        ),
        (
            "view.db",
            "CREATE VIEW v1 AS SELECT * FROM deny;".to_owned(),
            "view \"v1\" that schema".to_owned(),
        ),
        (
            "no-bindings.db",
            "DROP TABLE account_bindings;".to_owned(),
            format!("table \"account_bindings\" of schema {v} is missing"),
        ),
        (
            "extra.db",
            "CREATE TABLE extra (x); CREATE INDEX deny_extra ON deny(value);".to_owned(),
            format!("that schema {v} does not define"),
        ),
    ] {
        let file = altered(&s.backup, s.out.path(), name, &sql);
        let e = restore(dir, &file, &s.relay.opts(T0 + 60_000, true), None).expect_err(name);
        assert_eq!(e.code(), "NOT_A_STORE", "{name}: {e}");
        let text = e.to_string();
        assert!(
            text.contains(name) && text.contains(&named),
            "{name}: {text}"
        );
        assert_eq!(live_state(dir), before, "{name}");
        assert!(
            !names(dir)
                .iter()
                .any(|n| n.starts_with("relay.db.restore-")),
            "{name}"
        );
    }
    // The backup as it was restores, with the revocation and the deny entry carried, and
    // exactly the schema's own triggers.
    let r = restore(dir, &s.backup, &s.relay.opts(T0 + 60_000, false), None).expect("ok");
    assert_eq!(r["carried"]["revocations"], 1);
    let c = raw(dir);
    let objects = |kind: &str| -> Vec<String> {
        let mut st = c
            .prepare("SELECT name FROM sqlite_master WHERE type = ?1 ORDER BY name")
            .expect("prepare");
        let out = st
            .query_map([kind], |r| r.get(0))
            .expect("query")
            .collect::<Result<Vec<String>, _>>()
            .expect("rows");
        out
    };
    assert_eq!(
        objects("trigger"),
        [
            "items_usage_delete",
            "items_usage_insert",
            "items_usage_update"
        ]
    );
    assert!(objects("view").is_empty());
    assert!(crate::store::assert_usage_matches(&c) > 0);
}

#[test]
fn a_backups_usage_counters_are_recomputed_from_its_items() {
    let s = scene();
    let dir = s.dir.path();
    let file = altered(
        &s.backup,
        s.out.path(),
        "spoiled-counters.db",
        "UPDATE target_usage SET items = 1000000, bytes = 1000000000;
             DELETE FROM sender_usage;",
    );
    restore(dir, &file, &s.relay.opts(T0 + 60_000, false), None).expect("restored");
    assert!(crate::store::assert_usage_matches(&raw(dir)) > 0);
}

#[test]
fn the_backup_being_restored_is_never_removed_only_working_copies_this_code_names_are() {
    let s = scene();
    let dir = s.dir.path();
    let bytes = std::fs::read(&s.backup).expect("backup");
    let leftover = dir.join(format!("{DB_FILE}.restore-2020-01-01T00-00-00-000Z"));
    let leftover_wal = with_suffix(&leftover, "-wal");
    let notes = dir.join(format!("{DB_FILE}.restore-notes.txt"));
    for f in [&leftover, &leftover_wal, &notes] {
        std::fs::write(f, b"x").expect("write");
    }
    for (i, name) in [
        format!("{DB_FILE}.restore-mybackup.db"),
        format!("{DB_FILE}.restore-2021-01-01T00-00-00-000Z"),
    ]
    .iter()
    .enumerate()
    {
        let src = dir.join(name);
        std::fs::copy(&s.backup, &src).expect("copy");
        let now = T0 + 60_000 + i64::try_from(i).expect("i");
        restore(dir, &src, &s.relay.opts(now, false), None).expect(name);
        assert_eq!(std::fs::read(&src).expect("source kept"), bytes, "{name}");
    }
    assert!(!leftover.exists() && !leftover_wal.exists());
    assert!(notes.exists());
}

#[test]
fn a_failure_writing_the_rollback_copy_is_an_io_failure_that_never_suggests_force() {
    let s = scene();
    let dir = s.dir.path();
    let now = T0 + 60_000;
    let stamp = iso_ms(now).replace([':', '.'], "-");
    let rollback = dir.join(ROLLBACK_DIR);
    // The copy's partial name is taken by a directory: creating it fails like a full disk.
    let blocker = rollback.join(format!("relay-{stamp}.db.partial-{}", std::process::id()));
    std::fs::create_dir_all(blocker.join("x")).expect("blocker");
    let before = live_state(dir);
    for force in [false, true] {
        let e = restore(dir, &s.backup, &s.relay.opts(now, force), None).expect_err("fails");
        assert_eq!(e.code(), "FAILED", "{e}");
        let text = e.to_string();
        assert!(
            !text.contains("--force") && !text.contains("CURRENT_UNREADABLE"),
            "{text}"
        );
        assert_eq!(live_state(dir), before, "force {force}");
    }
}

#[test]
fn a_failed_forced_copy_leaves_no_file_under_a_rollback_name_and_a_directory_store_is_named() {
    let s = scene();
    let dir = s.dir.path();
    // relay.db is unreadable and its -wal is a directory: copying fails midway.
    std::fs::write(dir.join(DB_FILE), vec![9u8; 8_192]).expect("junk");
    std::fs::create_dir(dir.join("relay.db-wal")).expect("wal dir");
    let e = restore(dir, &s.backup, &s.relay.opts(T0 + 60_000, true), None).expect_err("io");
    assert_eq!(e.code(), "FAILED", "{e}");
    assert!(names(&dir.join(ROLLBACK_DIR)).is_empty(), "{e}");
    assert_eq!(
        std::fs::read(dir.join(DB_FILE)).expect("live"),
        vec![9u8; 8_192]
    );

    // relay.db a directory: a clear refusal, with or without --force.
    let other = tempfile::tempdir().expect("other");
    std::fs::create_dir(other.path().join(DB_FILE)).expect("dir");
    for force in [false, true] {
        let e = restore(
            other.path(),
            &s.backup,
            &s.relay.opts(T0 + 60_000, force),
            None,
        )
        .expect_err("a directory");
        assert!(
            e.to_string()
                .contains("is not a regular file (a directory)"),
            "{e}"
        );
    }
    assert!(other.path().join(DB_FILE).is_dir());
    assert!(!other.path().join(ROLLBACK_DIR).exists());
}

#[test]
fn a_current_store_of_a_newer_schema_is_never_replaced() {
    let s = scene();
    let dir = s.dir.path();
    raw(dir)
        .execute_batch(&format!("PRAGMA user_version = {}", SCHEMA_VERSION + 1))
        .expect("newer");
    let before = live_state(dir);
    for force in [false, true] {
        let e =
            restore(dir, &s.backup, &s.relay.opts(T0 + 60_000, force), None).expect_err("newer");
        assert_eq!(e.code(), "SCHEMA", "{e}");
        assert!(
            e.to_string()
                .contains("this store was written by a newer agentmbx; upgrade first"),
            "{e}"
        );
        assert_eq!(live_state(dir), before);
    }
}

#[test]
fn a_path_is_consumed_whatever_its_spelling_through_dot_dot_or_a_symlink() {
    let s = scene();
    let dir = s.dir.path();
    let out = s.out.path();
    std::fs::create_dir(out.join("sub")).expect("sub");
    let link = out.join("link.db");
    std::os::unix::fs::symlink(&s.backup, &link).expect("symlink");
    let dotted = out.join("sub").join("..").join("backup.db");
    assert_eq!(restored_from(dir, &dotted).expect("read"), None);
    restore(dir, &link, &s.relay.opts(T0 + 60_000, false), None).expect("restore");
    for spelling in [&s.backup, &link, &dotted] {
        assert_eq!(
            restored_from(dir, spelling).expect("read"),
            Some(iso_ms(T0 + 60_000)),
            "{}",
            spelling.display()
        );
    }
    // A path recorded by its old spelling (absolute, not resolved) is still consumed.
    let c = raw(dir);
    c.execute(
        "UPDATE meta SET v = ?1 WHERE k = 'restored_paths'",
        [json!({ dotted.display().to_string(): "then" }).to_string()],
    )
    .expect("old spelling");
    c.execute("DELETE FROM meta WHERE k = 'restored'", [])
        .expect("restored");
    assert_eq!(
        restored_from(dir, &dotted).expect("read"),
        Some("then".to_owned())
    );
    assert_eq!(restored_from(dir, &s.backup).expect("read"), None);
}

/// A signer that fails, so a restore fails after its rollback copy was made.
#[derive(Debug)]
struct FailingSigner(String);

impl OpSigner for FailingSigner {
    fn relay_pubkey(&self) -> String {
        self.0.clone()
    }
    fn sign_receipt(&self, _: &Value) -> Result<String, String> {
        Err("no signature today".to_owned())
    }
}

#[test]
fn leftovers_of_killed_copies_and_the_rollback_copy_of_a_failed_restore_are_removed() {
    let s = scene();
    let dir = s.dir.path();
    let rollback = dir.join(ROLLBACK_DIR);
    std::fs::create_dir_all(&rollback).expect("rollback");
    // pid_max is at most 4194304: that pid never runs. pid 1 always does.
    let dead = rollback.join("relay-2020-01-01T00-00-00-000Z.db.partial-4194304");
    let dead_journal = with_suffix(&dead, "-journal");
    let alive = rollback.join("relay-2020-01-01T00-00-00-000Z.db.partial-1");
    let other = rollback.join("notes.db.partial-4194304");
    for f in [&dead, &dead_journal, &alive, &other] {
        std::fs::write(f, b"x").expect("write");
    }
    let failing = RestoreOptions {
        force: false,
        now_ms: T0 + 60_000,
        signer: Some(Arc::new(FailingSigner(s.relay.key.public().to_b64()))),
    };
    let before = std::fs::read(dir.join(DB_FILE)).expect("live");
    let e = restore(dir, &s.backup, &failing, None).expect_err("signing fails");
    assert_eq!(e.code(), "FAILED", "{e}");
    assert_eq!(std::fs::read(dir.join(DB_FILE)).expect("live"), before);
    assert_eq!(
        names(&rollback),
        [
            "notes.db.partial-4194304",
            "relay-2020-01-01T00-00-00-000Z.db.partial-1"
        ],
        "the dead partials and the failed restore's rollback copy are gone"
    );
}

#[test]
fn a_damaged_backup_is_not_a_store_naming_it_and_a_path_that_is_no_file_says_so() {
    let s = scene();
    let dir = s.dir.path();
    let out = s.out.path();
    let bytes = std::fs::read(&s.backup).expect("backup");
    let before = live_state(dir);
    let truncated = out.join("truncated.db");
    std::fs::write(&truncated, &bytes[..bytes.len() / 2]).expect("truncated");
    let garbage_meta = altered(
        &s.backup,
        out,
        "garbage-meta.db",
        "UPDATE meta SET v = 'x' WHERE k = 'schema_version'",
    );
    for file in [&truncated, &garbage_meta] {
        let e = restore(dir, file, &s.relay.opts(T0 + 60_000, false), None).expect_err("bad");
        assert_eq!(e.code(), "NOT_A_STORE", "{e}");
        assert!(e.to_string().contains(&file.display().to_string()), "{e}");
        assert_eq!(live_state(dir), before);
    }
    let folder = out.join("folder.db");
    std::fs::create_dir(&folder).expect("dir");
    let dangling = out.join("dangling.db");
    std::os::unix::fs::symlink(out.join("gone.db"), &dangling).expect("symlink");
    for file in [&folder, &dangling] {
        let e = restore(dir, file, &s.relay.opts(T0 + 60_000, false), None).expect_err("no");
        assert_eq!(e.code(), "NO_BACKUP", "{e}");
        assert!(e.to_string().contains("is not a regular file"), "{e}");
    }
    let e = restore(
        dir,
        &out.join("none.db"),
        &s.relay.opts(T0 + 60_000, false),
        None,
    )
    .expect_err("none");
    assert!(e.to_string().contains("no backup at"), "{e}");
    assert_eq!(live_state(dir), before);
}

#[test]
fn a_forced_restore_keeps_the_paths_an_unreadable_store_had_consumed() {
    let s = scene();
    let dir = s.dir.path();
    let second = backup_now(dir, s.out.path(), "second.db");
    restore(dir, &s.backup, &s.relay.opts(T0 + 60_000, false), None).expect("first");
    // The store can no longer be read as a whole; its meta still can.
    raw(dir)
        .execute_batch("DROP TABLE sender_lists")
        .expect("damage");
    let e = restore(dir, &second, &s.relay.opts(T0 + 70_000, false), None).expect_err("no");
    assert_eq!(e.code(), "CURRENT_UNREADABLE", "{e}");
    let r = restore(dir, &second, &s.relay.opts(T0 + 80_000, true), None).expect("forced");
    assert_eq!(r["replaced"]["readable"], false);
    assert_eq!(
        restored_from(dir, &s.backup).expect("read"),
        Some(iso_ms(T0 + 60_000))
    );
    assert!(restored_from(dir, &second).expect("read").is_some());
}
