//! `relay.lock`, the live-heartbeat check, a clean close and private files.

use super::*;

#[test]
fn a_deleted_lock_file_and_a_fresh_heartbeat_refuse_every_opener_until_it_is_90_s_old() {
    let dir = tempfile::tempdir().expect("tempdir");
    let store = open(dir.path());
    store.set_heartbeat(100_000).expect("beat");
    store.close().expect("close");
    let lock = dir.path().join(LOCK_FILE);
    std::fs::remove_file(&lock).expect("rm lock");
    for now in [100_000 + 89_999, 100_000 - 89_999] {
        let err = StoreLock::acquire(dir.path(), 0, now).expect_err("lock");
        assert!(matches!(err, StoreError::LiveHeartbeat { .. }), "{err}");
        assert!(err.to_string().starts_with("RELAY_RUNNING: "), "{err}");
        assert!(err.to_string().contains("no relay.lock"), "{err}");
        let err =
            SqliteStore::open_with(dir.path(), &relay_key(), now, options()).expect_err("open");
        assert!(matches!(err, StoreError::LiveHeartbeat { .. }), "{err}");
        // Nothing was left behind, so the next attempt checks again.
        assert!(!lock.exists());
    }
    let held = StoreLock::acquire_ignoring_heartbeat(dir.path(), 0, 100_001).expect("forced");
    drop(held);
    std::fs::remove_file(&lock).expect("rm lock");
    // 90 s old: no relay runs on it.
    StoreLock::acquire(dir.path(), 0, 190_000).expect("stale");
}

#[test]
fn a_held_lock_refuses_a_second_open_until_released() {
    let dir = tempfile::tempdir().expect("tempdir");
    let first = open(dir.path());
    let err =
        SqliteStore::open_with(dir.path(), &relay_key(), 1_000, options()).expect_err("locked");
    // It names the holder its lock file records: this process, since it opened (1 s).
    let holder = crate::store::LockHolder {
        pid: std::process::id(),
        since_ms: 1_000,
    };
    assert!(
        matches!(err, StoreError::Locked { holder: Some(h), waited_ms: 0, .. } if h == holder),
        "{err:?}"
    );
    assert_eq!(
        err.to_string(),
        format!(
            "another relay process (pid {}, since 1970-01-01T00:00:01.000Z) holds {}",
            std::process::id(),
            dir.path().join(LOCK_FILE).display()
        )
    );
    // Waiting: it gives up after the wait, saying how long it waited.
    let started = Instant::now();
    let err = SqliteStore::open_with(
        dir.path(),
        &relay_key(),
        2_000,
        OpenOptions {
            lock_wait_ms: 300,
            ..OpenOptions::default()
        },
    )
    .expect_err("still locked");
    assert!(started.elapsed() >= Duration::from_millis(300), "it waited");
    assert!(
        matches!(err, StoreError::Locked { holder: Some(h), waited_ms: 300, .. } if h == holder),
        "{err:?}"
    );
    assert!(
        err.to_string()
            .contains("; gave up after waiting 300 ms: stop that process first"),
        "{err}"
    );
    drop(first);
    let store = open(dir.path());
    drop(store);

    // A waiting open gets the lock once the holder goes away.
    let holder = open(dir.path());
    let path = dir.path().to_path_buf();
    let waiter = std::thread::spawn(move || {
        SqliteStore::open_with(
            &path,
            &relay_key(),
            1_000,
            OpenOptions {
                lock_wait_ms: 30_000,
                ..OpenOptions::default()
            },
        )
        .map(|s| s.epoch())
    });
    drop(holder);
    let epoch = waiter.join().expect("join").expect("opened after wait");
    assert!(epoch.is_ok());
}

#[test]
fn the_lock_file_records_the_holder() {
    let dir = tempfile::tempdir().expect("tempdir");
    drop(open(dir.path()));
    let conn = Connection::open(dir.path().join(LOCK_FILE)).expect("raw");
    let (pid, at): (i64, i64) = conn
        .query_row("SELECT pid, at FROM holder", [], |r| {
            Ok((r.get(0)?, r.get(1)?))
        })
        .expect("holder");
    assert_eq!(pid, i64::from(std::process::id()));
    assert_eq!(at, 1_000);
}

#[test]
fn iso_utc_formats_unix_ms() {
    use crate::store::iso_utc;
    assert_eq!(iso_utc(0), "1970-01-01T00:00:00.000Z");
    assert_eq!(iso_utc(1_767_225_600_000), "2026-01-01T00:00:00.000Z");
    assert_eq!(iso_utc(951_782_400_000), "2000-02-29T00:00:00.000Z");
    assert_eq!(iso_utc(1_709_251_199_999), "2024-02-29T23:59:59.999Z");
    assert_eq!(iso_utc(-1), "1969-12-31T23:59:59.999Z");
    assert_eq!(crate::store::duration_text(60_000), "60 s");
    assert_eq!(crate::store::duration_text(1_500), "1500 ms");
}

/// The item `m1` from `alpha` for `beta`, as a copy of `relay.db` alone holds it.
fn assert_db_alone_holds_the_item(dir: &Path, beta: &str) {
    let wal = dir.join(format!("{DB_FILE}-wal"));
    let wal_len = std::fs::metadata(&wal).map(|m| m.len()).unwrap_or(0);
    assert_eq!(wal_len, 0, "the WAL is empty or gone after a clean close");
    let copy = tempfile::tempdir().expect("tempdir");
    std::fs::copy(dir.join(DB_FILE), copy.path().join(DB_FILE)).expect("copy relay.db");
    let conn = Connection::open(copy.path().join(DB_FILE)).expect("open the copy");
    let (id, wire): (String, Vec<u8>) = conn
        .query_row(
            "SELECT item_id, wire FROM items WHERE target_pubkey = ?1",
            [beta],
            |r| Ok((r.get(0)?, r.get(1)?)),
        )
        .expect("the item is in the copy");
    assert_eq!((id.as_str(), wire.as_slice()), ("m1", &b"sealed-1"[..]));
}

#[test]
fn a_clean_close_checkpoints_the_wal_into_relay_db() {
    let (alpha, beta) = (key(1), key(2));
    for by_drop in [false, true] {
        let dir = tempfile::tempdir().expect("tempdir");
        let store = open(dir.path());
        enrol(&store, &alpha, "alpha");
        enrol(&store, &beta, "beta");
        let out = push_one(&store, &alpha, 5_000, item("m1", &[(&beta, b"sealed-1")]));
        assert_eq!(out.status, ItemStatus::Accepted);
        // Readers are open (pooled) while the writer stops.
        assert_eq!(pull_all(&store, &beta).items.len(), 1);
        let wal = dir.path().join(format!("{DB_FILE}-wal"));
        assert!(
            std::fs::metadata(&wal).expect("a WAL while open").len() > 0,
            "the data is in the WAL while the store is open"
        );
        if by_drop {
            drop(store);
        } else {
            store.close().expect("close");
        }
        assert_db_alone_holds_the_item(dir.path(), &beta);
    }
}

fn mode(path: &Path) -> u32 {
    use std::os::unix::fs::PermissionsExt as _;
    std::fs::metadata(path)
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
        .permissions()
        .mode()
        & 0o777
}

#[test]
fn store_files_are_private_and_an_operators_directory_is_left_alone() {
    use std::os::unix::fs::PermissionsExt as _;
    let tmp = tempfile::tempdir().expect("tempdir");
    // Created by the store (with a missing parent): 0700; the files 0600.
    let dir = tmp.path().join("new").join("store");
    prepare_store_dir(&dir).expect("prepare");
    let store = open(&dir);
    enrol(&store, &key(1), "alpha");
    assert_eq!(mode(&dir), 0o700);
    for name in [DB_FILE, "relay.db-wal", "relay.db-shm", LOCK_FILE] {
        assert_eq!(mode(&dir.join(name)), 0o600, "{name}");
    }
    drop(store);

    // A store made before (files 0644) is made private at the next open; a directory the
    // operator made is never changed.
    let chmod = |p: &Path, m: u32| {
        std::fs::set_permissions(p, std::fs::Permissions::from_mode(m)).expect("chmod")
    };
    let own = tmp.path().join("operator");
    std::fs::create_dir(&own).expect("mkdir");
    chmod(&own, 0o755);
    drop(open(&own));
    for name in [DB_FILE, LOCK_FILE] {
        chmod(&own.join(name), 0o644);
    }
    prepare_store_dir(&own).expect("prepare");
    let store = open(&own);
    enrol(&store, &key(1), "alpha");
    assert_eq!(
        mode(&own),
        0o755,
        "the operator's directory is left as it was"
    );
    for name in [DB_FILE, "relay.db-wal", "relay.db-shm", LOCK_FILE] {
        assert_eq!(mode(&own.join(name)), 0o600, "{name}");
    }
}
