//! Tests of `relay status` (`status.rs`).

use super::*;
use crate::store::SCHEMA_VERSION;
use crate::store::{AckRequest, Expiry, OpenOptions, SqliteStore};
use crate::store::{DirectoryStore, ItemStore, OperationsStore, StoreHealth};
use crate::testing::conformance::envelope;
use agentmbx_protocol::keys::HostKey;

const T0: i64 = 1_767_225_600_000;

fn names(dir: &Path) -> Vec<String> {
    crate::testing::file_names(dir)
}

fn open_store(dir: &Path, relay: &str) -> SqliteStore {
    SqliteStore::open_with(
        dir,
        relay,
        T0,
        OpenOptions {
            lock_wait_ms: 0,
            ..OpenOptions::default()
        },
    )
    .expect("open")
}

fn enrol(store: &SqliteStore, key: &str, name: &str) {
    store
        .enrol(crate::testing::conformance::enrol_request_at(
            key, name, None, T0,
        ))
        .expect("enrol");
}

fn push(store: &SqliteStore, sender: &str, id: &str, target: &str, len: usize, now: i64) {
    let out = store
        .push(envelope(
            sender,
            "alpha",
            now,
            Expiry::Retention,
            id,
            target,
            &vec![b'x'; len],
        ))
        .expect("push");
    assert_eq!(out.items[0].status.wire(), "accepted");
}

fn key() -> String {
    HostKey::generate().public().to_b64()
}

#[test]
fn a_missing_store_is_no_store_and_nothing_is_created() {
    let tmp = tempfile::tempdir().expect("tmp");
    let empty = tmp.path().join("empty");
    std::fs::create_dir(&empty).expect("mkdir");
    assert!(matches!(
        read(&empty, T0, 5),
        Err(StatusError::NoStore(p)) if p == empty
    ));
    assert!(names(&empty).is_empty());
    let missing = tmp.path().join("missing");
    let err = read(&missing, T0, 5).expect_err("no store");
    assert!(
        err.to_string().contains("holds no relay store (relay.db)"),
        "{err}"
    );
    assert!(!missing.exists(), "the directory was created");
    // A relay.db that is not a store.
    std::fs::write(empty.join(DB_FILE), b"").expect("write");
    assert!(matches!(
        read(&empty, T0, 5),
        Err(StatusError::NotAStore(_))
    ));
}

#[test]
fn the_facts_of_a_store() {
    let tmp = tempfile::tempdir().expect("tmp");
    let dir = tmp.path().join("store");
    let relay_key = HostKey::generate().public();
    let store = open_store(&dir, &relay_key.to_b64());
    let (alpha, beta, gamma, gone) = (key(), key(), key(), key());
    for (k, n) in [
        (&alpha, "alpha"),
        (&beta, "beta"),
        (&gamma, "gamma"),
        (&gone, "gone"),
    ] {
        enrol(&store, k, n);
    }
    // beta: 3 items (the deepest), gamma: 1 big one, gone: 2 small ones, then revoked.
    push(&store, &alpha, "b1", &beta, 100, T0 + 1_000);
    push(&store, &alpha, "b2", &beta, 100, T0 + 2_000);
    push(&store, &gamma, "b3", &beta, 50, T0 + 3_000);
    push(&store, &alpha, "g1", &gamma, 5_000, T0 + 500);
    push(&store, &alpha, "x1", &gone, 10, T0 + 4_000);
    push(&store, &alpha, "x2", &gone, 10, T0 + 4_000);
    store.revoke(&gone, T0 + 5_000).expect("revoke");
    // An acked item leaves its dedup row (a tombstone) but not its bytes.
    push(&store, &alpha, "a1", &alpha, 7, T0 + 6_000);
    let head = store.info_for(&alpha).expect("info").head_seq;
    store
        .ack(AckRequest {
            target_pubkey: alpha.clone(),
            through: head,
            epoch: None,
        })
        .expect("ack");
    store.set_heartbeat(T0 + 30_000).expect("heartbeat");
    store
        .append_op(
            T0 + 40_000,
            OP_BACKUP,
            &json!({"v": 1, "type": OP_BACKUP, "file": "/b/relay-1.db", "bytes": 40_960}),
        )
        .expect("op");
    store
        .append_op(T0 + 50_000, "relay-epoch-rotated", &json!({"v": 1}))
        .expect("op");
    let epoch = store.epoch().expect("epoch");
    drop(store);

    let now = T0 + 100_000;
    let st = read(&dir, now, 2).expect("status");
    assert_eq!(st.store, absolute(&dir.join(DB_FILE)).display().to_string());
    assert_eq!(st.schema_version, SCHEMA_VERSION);
    assert_eq!(
        st.relay_pubkey.as_deref(),
        Some(relay_key.to_b64().as_str())
    );
    assert_eq!(
        st.relay_fingerprint.as_deref(),
        Some(relay_key.fingerprint().as_str())
    );
    assert_eq!(st.epoch.as_deref(), Some(epoch.as_str()));
    assert_eq!((st.enrolled, st.revoked), (3, 1));
    assert_eq!(
        (st.queued_items, st.queued_bytes, st.queued_targets),
        (6, 250 + 5_000 + 20, 3)
    );
    assert_eq!(st.oldest_ms, Some(T0 + 500));
    assert_eq!(st.dedup_rows, 7);
    assert_eq!(st.heartbeat_ms, Some(T0 + 30_000));
    assert_eq!(
        st.last_backup,
        Some(LastBackup {
            at_ms: T0 + 40_000,
            file: Some("/b/relay-1.db".to_owned()),
            bytes: Some(40_960),
        })
    );
    // The deepest two: beta (3 items), then gone (2 items) ahead of gamma (1 big item).
    let fp = |k: &str| PublicKey::from_b64(k).expect("key").fingerprint();
    assert_eq!(
        st.deepest,
        vec![
            TargetQueue {
                host_pubkey: beta.clone(),
                host_name: Some("beta".to_owned()),
                fingerprint: fp(&beta),
                revoked: false,
                items: 3,
                bytes: 250,
                oldest_ms: T0 + 1_000,
            },
            TargetQueue {
                host_pubkey: gone.clone(),
                host_name: Some("gone".to_owned()),
                fingerprint: fp(&gone),
                revoked: true,
                items: 2,
                bytes: 20,
                oldest_ms: T0 + 4_000,
            },
        ]
    );
    assert_eq!(read(&dir, now, 0).expect("status").deepest, vec![]);
    assert_eq!(read(&dir, now, 10).expect("status").deepest.len(), 3);

    // JSON: the documented shape.
    let j = st.to_json();
    assert_eq!(j["v"], 1);
    assert_eq!(j["at"], iso_ms(now));
    assert_eq!(j["hosts"], json!({"enrolled": 3, "revoked": 1}));
    assert_eq!(j["queue"]["items"], 6);
    assert_eq!(j["queue"]["bytes"], 5_270);
    assert_eq!(j["queue"]["targets"], 3);
    assert_eq!(j["queue"]["oldest_at"], iso_ms(T0 + 500));
    assert_eq!(j["queue"]["oldest_age_ms"], 99_500);
    assert_eq!(
        j["queue"]["deepest"][0],
        json!({"host": "beta", "host_pubkey": beta, "fingerprint": fp(&beta),
                   "revoked": false, "items": 3, "bytes": 250,
                   "oldest_at": iso_ms(T0 + 1_000), "oldest_age_ms": 99_000})
    );
    assert_eq!(
        j["heartbeat"],
        json!({"at": iso_ms(T0 + 30_000), "age_ms": 70_000})
    );
    assert_eq!(
        j["last_backup"],
        json!({"at": iso_ms(T0 + 40_000), "age_ms": 60_000,
                   "file": "/b/relay-1.db", "bytes": 40_960})
    );
    assert_eq!(j["dedup_rows"], 7);
    assert_eq!(j["schema_version"], SCHEMA_VERSION);
    assert_eq!(j["epoch"], epoch.as_str());

    // Text: one fact per line.
    let text = st.text();
    for want in [
            "hosts        3 enrolled, 1 revoked\n",
            "queued       6 items, 5270 bytes (5.1 KiB) for 3 targets; oldest 1m39s ago\n",
            &format!("beta  {}  3 items  250 bytes  oldest 1m39s ago\n", fp(&beta)),
            "gone (revoked)  ",
            &format!("epoch        {epoch}\n"),
            &format!("relay key    fingerprint {}\n", relay_key.fingerprint()),
            "heartbeat    2026-01-01T00:00:30.000Z (1m10s ago)\n",
            "last backup  2026-01-01T00:00:40.000Z (1m00s ago): /b/relay-1.db (40960 bytes (40.0 KiB))\n",
            "dedup        7 rows\n",
        ] {
            assert!(text.contains(want), "{want:?} missing in:\n{text}");
        }
}

#[test]
fn an_empty_store_that_never_served() {
    let tmp = tempfile::tempdir().expect("tmp");
    let dir = tmp.path().join("store");
    let store = open_store(&dir, &key());
    drop(store);
    let st = read(&dir, T0, 5).expect("status");
    assert_eq!((st.enrolled, st.revoked, st.queued_items), (0, 0, 0));
    assert_eq!((st.oldest_ms, st.heartbeat_ms), (None, None));
    assert!(st.last_backup.is_none());
    let j = st.to_json();
    assert_eq!(j["heartbeat"], Value::Null);
    assert_eq!(j["last_backup"], Value::Null);
    assert_eq!(j["queue"]["oldest_at"], Value::Null);
    assert_eq!(j["queue"]["deepest"], json!([]));
    let text = st.text();
    assert!(text.contains("queued       nothing\n"), "{text}");
    assert!(text.contains("heartbeat    none"), "{text}");
    assert!(
        text.contains("last backup  none in the relay log\n"),
        "{text}"
    );
}

#[test]
fn a_heartbeat_that_is_not_a_time_shows_as_unreadable_not_none() {
    let dir = tempfile::tempdir().expect("tempdir");
    open_store(dir.path(), &key()).close().expect("close");
    crate::store::raw::exec(
        &dir.path().join(DB_FILE),
        "INSERT INTO meta (k, v) VALUES ('heartbeat', 'soon')",
    );
    let st = read(dir.path(), T0, 5).expect("status");
    assert_eq!(st.heartbeat_ms, None);
    assert!(st.heartbeat_unreadable);
    assert_eq!(st.to_json()["heartbeat"], json!({"unreadable": true}));
    let text = st.text();
    assert!(text.contains("heartbeat    unreadable"), "{text}");
    assert!(!text.contains("none (no relay"), "{text}");
}

#[test]
fn it_reads_without_the_lock_and_creates_nothing() {
    let tmp = tempfile::tempdir().expect("tmp");
    let dir = tmp.path().join("store");
    // A store closed cleanly: relay.db alone (plus the lock file) and no WAL files.
    let store = open_store(&dir, &key());
    let k = key();
    enrol(&store, &k, "beta");
    push(&store, &k, "m1", &k, 10, T0);
    store.close().expect("close");
    let before = names(&dir);
    assert!(
        !before
            .iter()
            .any(|n| n.ends_with("-wal") || n.ends_with("-shm")),
        "{before:?}"
    );
    let db = dir.join(DB_FILE);
    let bytes = std::fs::read(&db).expect("read");
    let st = read(&dir, T0 + 1, 5).expect("status");
    assert_eq!(st.queued_items, 1);
    assert_eq!(names(&dir), before, "nothing created");
    assert_eq!(std::fs::read(&db).expect("read"), bytes, "nothing written");

    // While a store is open (as `relay serve` holds it, lock included), the status reads
    // through its WAL and sees its latest commit.
    let store = open_store(&dir, &st.relay_pubkey.clone().expect("relay key"));
    push(&store, &k, "m2", &k, 10, T0 + 2);
    let open_names = names(&dir);
    let st = read(&dir, T0 + 3, 5).expect("status while open");
    assert_eq!(st.queued_items, 2);
    assert_eq!(names(&dir), open_names);
    drop(store);
}

#[test]
fn paths_become_percent_encoded_file_uris() {
    // A store under a name that needs percent-encoding in a `file:` URI reads like any
    // other (the encoding itself: `store/sqlite/status.rs`).
    let tmp = tempfile::tempdir().expect("tmp");
    let dir = tmp.path().join("odd ?#% name");
    let store = open_store(&dir, &key());
    store.close().expect("close");
    assert_eq!(read(&dir, T0, 5).expect("status").enrolled, 0);
}

#[test]
fn ages_read_as_spans() {
    assert_eq!(age(0), "0s ago");
    assert_eq!(age(59_999), "59s ago");
    assert_eq!(age(185_000), "3m05s ago");
    assert_eq!(age(2 * 3_600_000 + 7 * 60_000), "2h07m ago");
    assert_eq!(age(3 * 86_400_000 + 4 * 3_600_000), "3d04h ago");
    assert_eq!(age(-90_000), "1m30s in the future");
    assert_eq!(bytes(1), "1 byte");
    assert_eq!(bytes(1023), "1023 bytes");
    assert_eq!(bytes(52_428_800), "52428800 bytes (50.0 MiB)");
}
