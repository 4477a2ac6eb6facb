//! A relay store and a backup written by an earlier agentmbx (`tests/fixtures/`, see its
//! README.md) still open and restore: the store directory opens unchanged with this binary and
//! reads back what was written, and the backup restores into a fresh directory and over the
//! store, carrying what a restore carries.
//!
//! `regenerate_fixture` (ignored) rebuilt the store; it is kept to show exactly how the fixture
//! was made, not to be run again (the fixture's point is bytes an older binary wrote).

use agentmbx_relay::testing::conformance::kept_envelope;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use serde_json::json;

use agentmbx_protocol::keys::HostKey;
use agentmbx_relay::ops::{self, RelayOpSigner, RestoreOptions, RotatedBy};
use agentmbx_relay::status;
use agentmbx_relay::store::{
    AckRequest, DenyKind, EncAdV2, OpSigner, OpenOptions, PullRequest, SenderList, SqliteStore,
    StoreLock, DB_FILE, SCHEMA_VERSION,
};
use agentmbx_relay::store::{DirectoryStore, ItemStore, OperationsStore};

/// When the fixture was written: 2026-01-01T00:00:00.000Z.
const T0: i64 = 1_767_225_600_000;
/// Later reads happen well after (the heartbeat rule does not matter offline).
const LATER: i64 = T0 + 86_400_000;

/// The schema version the fixture was written with.
const FIXTURE_SCHEMA: u32 = 4;
/// The store's epoch (after its operator rotation).
const STORE_EPOCH: &str = "599507a0-2b7f-497e-bb22-f34b7dc4616d";
/// The backup's epoch (the store's at the time of the backup).
const BACKUP_EPOCH: &str = "599507a0-2b7f-497e-bb22-f34b7dc4616d";

fn fixture_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures")
}

fn key(n: u8) -> HostKey {
    HostKey::from_seed_b64(&agentmbx_protocol::b64::encode(&[n; 32])).expect("seed")
}

fn relay_key() -> HostKey {
    key(1)
}

fn host(n: u8) -> String {
    key(n).public().to_b64()
}

fn signer() -> Arc<dyn OpSigner> {
    RelayOpSigner::shared(relay_key())
}

fn open(dir: &Path, now: i64) -> SqliteStore {
    let lock = StoreLock::acquire(dir, 0, now).expect("lock");
    let options = OpenOptions {
        lock_wait_ms: 0,
        ..OpenOptions::default()
    };
    SqliteStore::open_signed(lock, signer(), now, options).expect("open")
}

fn enrol(store: &SqliteStore, key: &str, name: &str) {
    store
        .enrol(agentmbx_relay::testing::conformance::enrol_request_at(
            key, name, None, T0,
        ))
        .expect("enrol");
}

fn push(store: &SqliteStore, sender: &str, target: &str, id: &str, now: i64) {
    let out = store
        .push(kept_envelope(sender, "fixture", now, id, target))
        .expect("push");
    assert_eq!(out.items[0].status.wire(), "accepted", "{out:?}");
}

/// Copies the fixture store directory (`relay.db`, `relay.key`) into a fresh temp directory.
fn copy_store() -> tempfile::TempDir {
    let tmp = tempfile::tempdir().expect("tmp");
    for name in [DB_FILE, "relay.key"] {
        std::fs::copy(
            fixture_dir().join("store").join(name),
            tmp.path().join(name),
        )
        .expect("copy fixture");
    }
    tmp
}

/// Writes `tests/fixtures/store` and `tests/fixtures/relay-backup.db` (run once, with
/// `MBX_WRITE_RELAY_FIXTURE=1`, see the README).
#[test]
#[ignore = "writes the committed fixture; see tests/fixtures/README.md"]
fn regenerate_fixture() {
    assert!(
        std::env::var_os("MBX_WRITE_RELAY_FIXTURE").is_some(),
        "set MBX_WRITE_RELAY_FIXTURE=1 to rewrite the fixture"
    );
    let dir = fixture_dir().join("store");
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("mkdir");
    std::fs::write(dir.join("relay.key"), relay_key().to_key_file().to_text()).expect("key");
    let (alpha, beta, gamma) = (host(2), host(3), host(4));
    let store = open(&dir, T0);
    enrol(&store, &alpha, "alpha");
    enrol(&store, &beta, "beta");
    enrol(&store, &gamma, "gamma");
    for (k, n) in [(&alpha, "alpha"), (&beta, "beta")] {
        store
            .put_enc_ad_v2(EncAdV2 {
                host_pubkey: k.clone(),
                enc_pub: format!("enc-of-{n}"),
                record: format!("{{\"host\":\"{n}\"}}"),
                sig: format!("adsig-{n}"),
                at_ms: T0,
            })
            .expect("ad");
    }
    store
        .put_sender_list(SenderList {
            target_pubkey: beta.clone(),
            senders: vec![alpha.clone()],
            iat_ms: T0 + 1,
            record: format!("{{\"iat\":{}}}", T0 + 1),
            sig: "listsig".into(),
        })
        .expect("list");
    agentmbx_relay::admin::deny(
        &store,
        "fixture-client",
        Some(DenyKind::Client),
        None,
        T0 + 2,
    )
    .expect("deny");
    agentmbx_relay::admin::revoke(&store, &gamma, T0 + 3).expect("revoke");
    for i in 0..3 {
        push(&store, &alpha, &beta, &format!("to-beta-{i}"), T0 + 10 + i);
    }
    for i in 0..2 {
        push(&store, &beta, &alpha, &format!("to-alpha-{i}"), T0 + 20 + i);
    }
    let seq = store
        .pull(PullRequest {
            target_pubkey: beta.clone(),
            after: 0,
            limit: 1,
            max_bytes: 1 << 20,
        })
        .expect("pull")
        .items[0]
        .seq;
    store
        .ack(AckRequest {
            target_pubkey: beta.clone(),
            through: seq,
            epoch: None,
        })
        .expect("ack");
    ops::rotate_epoch(&store, &ops::store_db(&dir), RotatedBy::Operator, T0 + 30).expect("rotate");
    store.close().expect("close");

    // `agentmbx relay backup` of the stopped store: `ops::backup`, then its receipt appended
    // to the store's relay log through the offline open (`daemon/src/cli/relay_ops.rs`).
    let file = fixture_dir().join("relay-backup.db");
    let _ = std::fs::remove_file(&file);
    let receipt = ops::backup(&dir, &file, T0 + 40).expect("backup");
    let opened = agentmbx_relay::admin::open_offline(&dir, T0 + 40).expect("offline");
    opened
        .store
        .append_op(T0 + 40, ops::OP_BACKUP, &receipt)
        .expect("log the backup");
    opened.store.close().expect("close");
    let _ = std::fs::remove_file(dir.join(agentmbx_relay::store::LOCK_FILE));
}

/// The wire bytes queued for `target`, in seq order.
fn queue(store: &SqliteStore, target: &str) -> Vec<String> {
    store
        .pull(PullRequest {
            target_pubkey: target.to_owned(),
            after: 0,
            limit: 100,
            max_bytes: 1 << 20,
        })
        .expect("pull")
        .items
        .into_iter()
        .map(|i| String::from_utf8(i.wire).expect("utf8"))
        .collect()
}

/// What both the store and the backup hold: enrolments (one revoked), enc-key ads, the
/// allowlist, the deny entry, the queues after the ack.
fn assert_content(store: &SqliteStore) {
    let (alpha, beta, gamma) = (host(2), host(3), host(4));
    assert_eq!(
        store
            .enrolment(&alpha)
            .expect("e")
            .expect("alpha")
            .host_name,
        "alpha"
    );
    assert!(store
        .enrolment(&beta)
        .expect("e")
        .expect("beta")
        .revoked_at_ms
        .is_none());
    assert!(store
        .enrolment(&gamma)
        .expect("e")
        .expect("gamma")
        .revoked_at_ms
        .is_some());
    assert!(store.get_enc_ad(&alpha).expect("ad").is_some());
    assert!(store.get_enc_ad(&gamma).expect("ad").is_none());
    assert_eq!(
        store
            .sender_list(&beta)
            .expect("list")
            .expect("beta's")
            .senders,
        vec![alpha.clone()]
    );
    let deny = store.deny_entries().expect("deny");
    assert_eq!(deny.len(), 1, "{deny:?}");
    assert_eq!(deny[0].value, "fixture-client");
    assert_eq!(
        queue(store, &beta),
        ["wire of to-beta-1", "wire of to-beta-2"]
    );
    assert_eq!(
        queue(store, &alpha),
        ["wire of to-alpha-0", "wire of to-alpha-1"]
    );
}

#[test]
fn the_store_fixture_opens_unchanged_and_reads_back_what_was_written() {
    let dir = copy_store();
    let st = status::read(dir.path(), LATER, 5).expect("status");
    assert_eq!(st.schema_version, FIXTURE_SCHEMA);
    assert_eq!(st.epoch.as_deref(), Some(STORE_EPOCH));
    assert_eq!((st.enrolled, st.revoked), (2, 1));
    assert_eq!((st.queued_items, st.queued_targets), (4, 2));
    assert_eq!(
        st.relay_fingerprint.as_deref(),
        Some(relay_key().public().fingerprint().as_str())
    );
    assert!(st.last_backup.is_some(), "the backup's receipt is logged");
    let log = ops::read_verified_log(dir.path(), 100).expect("log");
    let kinds: Vec<&str> = log.iter().map(|o| o.op()).collect();
    assert_eq!(
        kinds,
        [
            "relay-backup",
            "relay-epoch-rotated",
            "relay-revoke",
            "relay-deny"
        ]
    );
    assert!(log.iter().all(|o| o.verified), "{log:?}");

    let store = open(dir.path(), LATER);
    assert_eq!(store.epoch().expect("epoch"), STORE_EPOCH);
    assert_content(&store);
    store.close().expect("close");
    let st = status::read(dir.path(), LATER, 5).expect("status");
    assert_eq!(st.schema_version, SCHEMA_VERSION);
}

#[test]
fn the_backup_fixture_restores_into_a_fresh_directory_and_over_the_store() {
    let backup = fixture_dir().join("relay-backup.db");
    let opts = RestoreOptions {
        force: false,
        now_ms: LATER,
        signer: Some(signer()),
    };

    let fresh = tempfile::tempdir().expect("fresh");
    let receipt = ops::restore(fresh.path(), &backup, &opts, None).expect("restore");
    assert_eq!(receipt["backup"]["epoch"], BACKUP_EPOCH);
    assert_eq!(receipt["backup"]["schema_version"], FIXTURE_SCHEMA);
    assert_eq!(receipt["epoch"]["from"], BACKUP_EPOCH);
    assert_eq!(receipt["replaced"], serde_json::Value::Null);
    assert_eq!(receipt["carried"]["revocations"], 0);
    assert_eq!(receipt["counts"]["items"], 4);
    assert_eq!(receipt["counts"]["revoked"], 1);
    assert!(ops::verify_receipt(&receipt, &relay_key().public()));
    let store = open(fresh.path(), LATER);
    let epoch = store.epoch().expect("epoch");
    assert_ne!(epoch, BACKUP_EPOCH);
    assert_eq!(json!(epoch), receipt["epoch"]["to"]);
    assert_content(&store);
    store.close().expect("close");

    // Over the store it was made of, changed after the backup with this binary: a
    // revocation, a deny entry and a newer queue are carried forward.
    let dir = copy_store();
    let (alpha, beta) = (host(2), host(3));
    let store = open(dir.path(), LATER);
    push(&store, &alpha, &beta, "after-backup", LATER);
    agentmbx_relay::admin::deny(&store, "later-client", Some(DenyKind::Client), None, LATER)
        .expect("deny");
    agentmbx_relay::admin::revoke(&store, &alpha, LATER + 1).expect("revoke");
    store.close().expect("close");
    let opts = RestoreOptions {
        now_ms: LATER + 2,
        ..opts
    };
    let receipt = ops::restore(dir.path(), &backup, &opts, None).expect("restore over");
    assert_eq!(receipt["replaced"]["epoch"], STORE_EPOCH);
    assert_eq!(receipt["replaced"]["readable"], true);
    assert_eq!(receipt["carried"]["revocations"], 1);
    assert_eq!(receipt["carried"]["deny"], 1);
    assert_eq!(receipt["carried"]["seq_floors"], 1);
    assert_eq!(receipt["carried"]["rotations"], 0);
    let store = open(dir.path(), LATER + 2);
    assert!(store
        .enrolment(&alpha)
        .expect("e")
        .expect("alpha")
        .is_revoked());
    assert_eq!(store.deny_entries().expect("deny").len(), 2);
    assert_eq!(
        queue(&store, &beta),
        ["wire of to-beta-1", "wire of to-beta-2"]
    );
    let log = store.ops(100).expect("ops");
    assert_eq!(log[0].op, "relay-restore");
    assert!(log.iter().any(|o| o.op == "relay-backup"));
    store.close().expect("close");
}
