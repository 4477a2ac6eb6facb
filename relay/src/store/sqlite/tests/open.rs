//! Opening: restart, schema versions, the relay key, the open line.

use super::*;

#[test]
fn restart_keeps_everything_including_the_epoch() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (alpha, beta) = (key(1), key(2));
    let (epoch, first_seq) = {
        let store = open(dir.path());
        assert_eq!(store.heartbeat().expect("heartbeat"), None);
        enrol(&store, &alpha, "alpha");
        enrol(&store, &beta, "beta");
        let o = push_one(
            &store,
            &alpha,
            3_000,
            item("m1", &[(&beta, b"bytes\x00\xff")]),
        );
        push_one(&store, &alpha, 3_000, item("m2", &[(&beta, b"two")]));
        let a = store
            .ack(AckRequest {
                target_pubkey: beta.clone(),
                through: o.targets[0].seq,
                epoch: None,
            })
            .expect("ack");
        assert!(matches!(a, AckResult::Acked(_)));
        store.set_heartbeat(4_000).expect("heartbeat");
        store.set_meta("restored", "{\"x\":1}").expect("meta");
        store
            .put_sender_list(SenderList {
                target_pubkey: beta.clone(),
                senders: vec![alpha.clone()],
                iat_ms: 10,
                record: "{}".to_owned(),
                sig: "s".to_owned(),
            })
            .expect("senders");
        store
            .append_op(4_000, "relay-backup", &serde_json::json!({"v": 1}))
            .expect("op");
        let epoch = store.epoch().expect("epoch");
        store.close().expect("close");
        (epoch, o.targets[0].seq)
    };
    let store = open(dir.path());
    assert_eq!(store.epoch().expect("epoch"), epoch);
    assert_eq!(store.relay_pubkey().expect("key"), relay_key());
    assert_eq!(store.heartbeat().expect("heartbeat"), Some(4_000));
    assert_eq!(
        store.meta("restored").expect("meta").as_deref(),
        Some("{\"x\":1}")
    );
    assert!(!store
        .enrolment(&beta)
        .expect("enrolment")
        .expect("row")
        .is_revoked());
    let page = pull_all(&store, &beta);
    assert_eq!(page.items.len(), 1);
    assert_eq!(page.items[0].wire, b"two");
    let info = store.info_for(&beta).expect("info");
    assert_eq!(info.acked_through, first_seq);
    assert_eq!(info.head_seq, first_seq + 1);
    let dup = push_one(
        &store,
        &alpha,
        9_000,
        item("m1", &[(&beta, b"bytes\x00\xff")]),
    );
    assert_eq!(dup.status, ItemStatus::Duplicate, "dedup survives restart");
    assert_eq!(
        store
            .sender_list(&beta)
            .expect("list")
            .expect("stored")
            .senders,
        vec![alpha.clone()]
    );
    let ops = store.ops(10).expect("ops");
    assert_eq!(ops.len(), 1);
    assert_eq!(ops[0].op, "relay-backup");
    assert_eq!(ops[0].receipt, serde_json::json!({"v": 1}));
}

/// What the store logs on this thread while the guard lives (DEBUG and up, no colours).
#[derive(Clone, Default)]
struct Logged(Arc<Mutex<Vec<u8>>>);

impl std::io::Write for Logged {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().expect("log").extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl Logged {
    fn capture() -> (Logged, tracing::subscriber::DefaultGuard) {
        let log = Logged::default();
        let writer = log.clone();
        let subscriber = tracing_subscriber::fmt()
            .with_max_level(tracing::Level::DEBUG)
            .with_ansi(false)
            .with_writer(move || writer.clone())
            .finish();
        (log, tracing::subscriber::set_default(subscriber))
    }

    /// The lines logged since the last call.
    fn take(&self) -> Vec<String> {
        let bytes = std::mem::take(&mut *self.0.lock().expect("log"));
        String::from_utf8_lossy(&bytes)
            .lines()
            .map(str::to_owned)
            .collect()
    }
}

#[test]
fn the_open_line_names_migrated_from_only_when_the_open_migrated() {
    let (log, _guard) = Logged::capture();
    let opened = |lines: &[String]| -> String {
        let found: Vec<&String> = lines
            .iter()
            .filter(|l| l.contains("relay store opened"))
            .collect();
        assert_eq!(found.len(), 1, "{lines:#?}");
        assert!(
            !lines.iter().any(|l| l.contains("did not stop cleanly")),
            "{lines:#?}"
        );
        found[0].clone()
    };
    // A new store: created, nothing migrated.
    let dir = tempfile::tempdir().expect("tempdir");
    open(dir.path()).close().expect("close");
    let line = opened(&log.take());
    assert!(line.contains("created=true"), "{line}");
    assert!(!line.contains("migrated_from"), "{line}");
    // Opened again at the current version: neither.
    open(dir.path()).close().expect("close");
    let line = opened(&log.take());
    assert!(!line.contains("migrated_from"), "{line}");
    assert!(!line.contains("created"), "{line}");
    assert!(
        line.contains(&format!("schema_version={SCHEMA_VERSION}")),
        "{line}"
    );
    // A store one version behind: the open migrates it and says from which version.
    let old = tempfile::tempdir().expect("tempdir");
    {
        let mut conn = Connection::open(old.path().join(DB_FILE)).expect("raw");
        schema::migrate(&mut conn, 0, SCHEMA_VERSION - 1, MIGRATIONS).expect("old schema");
    }
    open(old.path()).close().expect("close");
    let line = opened(&log.take());
    assert!(
        line.contains(&format!("migrated_from={}", SCHEMA_VERSION - 1)),
        "{line}"
    );
    open(old.path()).close().expect("close");
    let line = opened(&log.take());
    assert!(!line.contains("migrated_from"), "{line}");
}

#[test]
fn a_newer_schema_is_refused_with_a_clear_message() {
    let dir = tempfile::tempdir().expect("tempdir");
    open(dir.path()).close().expect("close");
    {
        let conn = Connection::open(dir.path().join(DB_FILE)).expect("raw");
        conn.execute_batch("PRAGMA user_version = 7").expect("bump");
    }
    let err =
        SqliteStore::open_with(dir.path(), &relay_key(), 1_000, options()).expect_err("refused");
    assert!(matches!(
        err,
        StoreError::SchemaTooNew {
            found: 7,
            supported: SCHEMA_VERSION
        }
    ));
    assert_eq!(
        err.to_string(),
        format!(
            "relay.db has schema version 7, this agentmbx supports up to {SCHEMA_VERSION}: upgrade agentmbx"
        )
    );
    // The refusal released the lock: a later open (after a downgrade fix) is possible.
    {
        let conn = Connection::open(dir.path().join(DB_FILE)).expect("raw");
        conn.execute_batch("PRAGMA user_version = 1")
            .expect("restore");
    }
    open(dir.path());
}

#[test]
fn opening_creates_the_current_schema_and_a_later_migration_step_is_refused_as_newer() {
    let dir = tempfile::tempdir().expect("tempdir");
    let epoch = {
        let store = open(dir.path());
        store.epoch().expect("epoch")
    };
    let mut conn = Connection::open(dir.path().join(DB_FILE)).expect("raw");
    assert_eq!(
        schema::stored_version(&conn).expect("version"),
        SCHEMA_VERSION
    );
    let uv: i64 = conn
        .query_row("PRAGMA user_version", [], |r| r.get(0))
        .expect("uv");
    assert_eq!(uv, i64::from(SCHEMA_VERSION));
    let journal: String = conn
        .query_row("PRAGMA journal_mode", [], |r| r.get(0))
        .expect("journal");
    assert_eq!(journal, "wal");
    // A future binary's next step runs over our store and keeps the epoch ...
    let future: Vec<(u32, &str)> = MIGRATIONS
        .iter()
        .copied()
        .chain([(
            SCHEMA_VERSION + 1,
            "ALTER TABLE items ADD COLUMN future TEXT;",
        )])
        .collect();
    schema::migrate(&mut conn, SCHEMA_VERSION, SCHEMA_VERSION + 1, &future)
        .expect("migrate to the next version");
    let kept: String = conn
        .query_row("SELECT v FROM meta WHERE k = 'epoch'", [], |r| r.get(0))
        .expect("epoch");
    assert_eq!(kept, epoch);
    drop(conn);
    // ... and this binary then refuses it.
    let err =
        SqliteStore::open_with(dir.path(), &relay_key(), 1_000, options()).expect_err("refused");
    assert!(matches!(err, StoreError::SchemaTooNew { found, .. } if found == SCHEMA_VERSION + 1));
}

#[test]
fn a_store_of_another_relay_key_is_refused_naming_only_fingerprints() {
    let dir = tempfile::tempdir().expect("tempdir");
    open(dir.path()).close().expect("close");
    let other = key(201);
    let err = SqliteStore::open_with(dir.path(), &other, 1_000, options()).expect_err("refused");
    let text = err.to_string();
    assert!(
        text.starts_with("this relay store belongs to another relay key (fingerprint "),
        "{text}"
    );
    assert!(text.contains(&key_fingerprint(&relay_key())), "{text}");
    assert!(
        !text.contains(&relay_key()) && !text.contains(&other),
        "{text}"
    );
    assert!(matches!(err, StoreError::OtherRelayKey { .. }));
    // The right key still opens it.
    open(dir.path());
}
