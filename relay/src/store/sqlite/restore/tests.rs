//! The restore tests (`ops::restore`, run on SQLite stores): they alter and inspect the
//! stores with SQL, so they live beside the SQLite steps.

use crate::store::{DirectoryStore, ItemStore, OperationsStore};
use crate::testing::conformance::kept_envelope;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use rusqlite::{Connection, OptionalExtension};
use serde_json::{json, Value};

use super::super::backup::with_suffix;
use crate::ops::{
    absolute, restore, restored_from, RestoreError, RestoreOptions, OP_RESTORE, ROLLBACK_DIR,
};
use crate::ops::{read_verified_log, verify_receipt, RelayOpSigner};
use crate::store::{
    AccountBinding, AuthorityStrength, DenyEntry, DenyKind, EncAdV2, EnrolRequest, OpEntry,
    OpenOptions, SenderList, SqliteStore,
};
use crate::store::{OpSigner, StoreLock, DB_FILE, LOCK_FILE, SCHEMA_VERSION};
use agentmbx_protocol::keys::HostKey;
use agentmbx_protocol::time::iso_ms;

const T0: i64 = 1_800_000_000_000;

fn host() -> String {
    HostKey::generate().public().to_b64()
}

struct Relay {
    key: HostKey,
}

impl Relay {
    fn new() -> Self {
        Relay {
            key: HostKey::generate(),
        }
    }

    fn open(&self, dir: &Path, now: i64) -> SqliteStore {
        let lock = StoreLock::acquire(dir, 0, now).expect("lock");
        let options = OpenOptions {
            lock_wait_ms: 0,
            ..OpenOptions::default()
        };
        SqliteStore::open_signed(lock, self.signer(), now, options).expect("open")
    }

    fn signer(&self) -> Arc<dyn OpSigner> {
        RelayOpSigner::shared(self.key.clone())
    }

    fn opts(&self, now_ms: i64, force: bool) -> RestoreOptions {
        RestoreOptions {
            force,
            now_ms,
            signer: Some(self.signer()),
        }
    }
}

fn enrol(store: &SqliteStore, key: &str, name: &str, now: i64) {
    store
        .enrol(crate::testing::conformance::enrol_request_at(
            key, name, None, now,
        ))
        .expect("enrol");
}

fn push(store: &SqliteStore, sender: &str, target: &str, id: &str, now: i64) {
    store
        .push(kept_envelope(sender, "alpha", now, id, target))
        .expect("push");
}

fn raw(dir: &Path) -> Connection {
    Connection::open(dir.join(DB_FILE)).expect("raw")
}

fn one<T: rusqlite::types::FromSql>(c: &Connection, sql: &str, p: &str) -> Option<T> {
    c.query_row(sql, [p], |r| r.get(0)).optional().expect(sql)
}

fn names(dir: &Path) -> Vec<String> {
    crate::testing::file_names(dir)
}

fn backup_now(dir: &Path, out: &Path, name: &str) -> PathBuf {
    let file = out.join(name);
    crate::ops::backup(dir, &file, T0).expect("backup");
    file
}

/// The scene of most tests: a store with two enrolled hosts, a deny entry, an allowlist,
/// an enc-key record and queued items, backed up; then, after the backup, a revocation, a
/// new deny entry, a new enrolment, a newer allowlist and record, an account binding and
/// more items.
struct Scene {
    relay: Relay,
    dir: tempfile::TempDir,
    out: tempfile::TempDir,
    backup: PathBuf,
    alpha: String,
    beta: String,
    gamma: String,
    sender: String,
}

fn scene() -> Scene {
    let relay = Relay::new();
    let dir = tempfile::tempdir().expect("dir");
    let out = tempfile::tempdir().expect("out");
    let (alpha, beta, gamma, sender) = (host(), host(), host(), host());
    let store = relay.open(dir.path(), T0);
    enrol(&store, &alpha, "alpha", T0);
    enrol(&store, &beta, "beta", T0);
    store
        .deny_logged(
            DenyEntry {
                kind: DenyKind::Client,
                value: "client-before".into(),
                until_ms: None,
                at_ms: T0,
            },
            OpEntry {
                at_ms: T0,
                op: "relay-deny".into(),
                receipt: json!({"v": 1, "type": "relay-deny", "value": "client-before"}),
            },
        )
        .expect("deny");
    let list = |iat: i64| SenderList {
        target_pubkey: beta.clone(),
        senders: vec![sender.clone()],
        iat_ms: iat,
        record: format!("{{\"iat\":{iat}}}"),
        sig: format!("sig-{iat}"),
    };
    store.put_sender_list(list(T0)).expect("list");
    let ad = |at: i64| EncAdV2 {
        host_pubkey: beta.clone(),
        enc_pub: format!("enc-{at}"),
        record: format!("{{\"at\":{at}}}"),
        sig: format!("adsig-{at}"),
        at_ms: at,
    };
    store.put_enc_ad_v2(ad(T0)).expect("ad");
    for i in 0..3 {
        push(&store, &sender, &beta, &format!("before-{i}"), T0 + i);
    }
    let backup = backup_now(dir.path(), out.path(), "backup.db");

    // After the backup.
    crate::admin::revoke(&store, &alpha, T0 + 100).expect("revoke");
    crate::admin::deny(
        &store,
        "client-after",
        Some(DenyKind::Client),
        None,
        T0 + 110,
    )
    .expect("deny");
    enrol(&store, &gamma, "gamma", T0 + 120);
    store.put_sender_list(list(T0 + 130)).expect("newer list");
    store.put_enc_ad_v2(ad(T0 + 140)).expect("newer ad");
    store
        .enrol_bound(
            EnrolRequest {
                host_pubkey: beta.clone(),
                host_name: "beta".into(),
                owner_fp: String::new(),
                account: Some("acct".into()),
                authorized_by: "account".into(),
                strength: AuthorityStrength::Account,
                now_ms: T0 + 150,
            },
            Some(AccountBinding {
                host_pubkey: beta.clone(),
                cloud_jkt: "jkt".into(),
                client_id: "cli".into(),
                sub: "sub".into(),
                org: None,
                at_ms: T0 + 150,
            }),
        )
        .expect("bound");
    for i in 0..2 {
        push(
            &store,
            &sender,
            &beta,
            &format!("after-{i}"),
            T0 + 10_000 + i,
        );
    }
    store.close().expect("close");
    Scene {
        relay,
        dir,
        out,
        backup,
        alpha,
        beta,
        gamma,
        sender,
    }
}

#[test]
fn a_restore_rotates_the_epoch_keeps_a_rollback_and_never_brings_back_what_was_taken_away() {
    let s = scene();
    let dir = s.dir.path();
    let before = raw(dir);
    let current_epoch: String =
        one(&before, "SELECT v FROM meta WHERE k = ?1", "epoch").expect("epoch");
    let current_ops: i64 = before
        .query_row("SELECT COUNT(*) FROM ops", [], |r| r.get(0))
        .expect("ops");
    let floor: i64 = one(
        &before,
        "SELECT next_seq FROM seqs WHERE target_pubkey = ?1",
        &s.beta,
    )
    .expect("floor");
    drop(before);
    let backup_epoch: String = one(
        &Connection::open(&s.backup).expect("backup"),
        "SELECT v FROM meta WHERE k = ?1",
        "epoch",
    )
    .expect("epoch");
    let backup_sha = crate::ops::sha256_file(&s.backup).expect("sha");

    let now = T0 + 60_000;
    let r = restore(dir, &s.backup, &s.relay.opts(now, false), None).expect("restore");

    // The receipt, signed, and the newest entry of the log; the log before it is the
    // replaced store's, whole.
    assert_eq!(r["type"], "relay-restore");
    assert_eq!(r["v"], 1);
    assert_eq!(r["at"], iso_ms(now).as_str());
    assert_eq!(
        r["backup"]["file"],
        absolute(&s.backup).display().to_string().as_str()
    );
    assert_eq!(r["backup"]["sha256"], backup_sha.as_str());
    assert_eq!(r["epoch"]["from"], backup_epoch.as_str());
    let new_epoch = r["epoch"]["to"].as_str().expect("to").to_owned();
    assert_ne!(new_epoch, backup_epoch);
    assert_ne!(new_epoch, current_epoch);
    assert_eq!(r["replaced"]["epoch"], current_epoch.as_str());
    assert_eq!(r["replaced"]["readable"], true);
    assert_eq!(
        r["carried"],
        json!({"rotations": 0, "revocations": 1, "sender_lists": 1, "enc_ads": 0,
                   "enc_ad_records": 1, "seq_floors": 1, "deny": 1, "account_bindings": 1,
                   "ops": current_ops})
    );
    assert_eq!(
        r["counts"]["items"], 3,
        "the backup's items, not the later ones"
    );
    let key = s.relay.key.public();
    assert!(verify_receipt(&r, &key));
    let log = read_verified_log(dir, 1_000).expect("log");
    assert_eq!(log.len() as i64, current_ops + 1);
    assert_eq!(log[0].record.op, OP_RESTORE);
    assert_eq!(log[0].record.receipt, r);
    assert!(log.iter().all(|e| e.verified), "{log:?}");

    let c = raw(dir);
    let meta = |k: &str| one::<String>(&c, "SELECT v FROM meta WHERE k = ?1", k);
    assert_eq!(meta("epoch").as_deref(), Some(new_epoch.as_str()));
    assert_eq!(meta("heartbeat"), Some(now.to_string()));
    let restored: Value = serde_json::from_str(&meta("restored").expect("restored")).expect("json");
    assert_eq!(restored["sha256"], backup_sha.as_str());
    assert_eq!(restored["to"], new_epoch.as_str());
    // Revoked stays revoked; the post-backup enrolment is not carried; both deny entries.
    let revoked: Option<i64> = one(
        &c,
        "SELECT revoked_at FROM enrolments WHERE host_pubkey = ?1",
        &s.alpha,
    );
    assert_eq!(revoked, Some(T0 + 100));
    let gamma: Option<String> = one(
        &c,
        "SELECT host_name FROM enrolments WHERE host_pubkey = ?1",
        &s.gamma,
    );
    assert_eq!(gamma, None, "enrolled after the backup: enrols again");
    let denied: Vec<String> = c
        .prepare("SELECT value FROM deny ORDER BY value")
        .expect("prep")
        .query_map([], |r| r.get(0))
        .expect("q")
        .collect::<Result<_, _>>()
        .expect("rows");
    assert_eq!(denied, ["client-after", "client-before"]);
    // Newer allowlist and record, the higher seq floor, the binding of a known key.
    assert_eq!(
        one::<i64>(
            &c,
            "SELECT iat FROM sender_lists WHERE target_pubkey = ?1",
            &s.beta
        ),
        Some(T0 + 130)
    );
    assert_eq!(
        one::<i64>(
            &c,
            "SELECT at FROM enc_ad_records WHERE host_pubkey = ?1",
            &s.beta
        ),
        Some(T0 + 140)
    );
    assert_eq!(
        one::<i64>(
            &c,
            "SELECT next_seq FROM seqs WHERE target_pubkey = ?1",
            &s.beta
        ),
        Some(floor)
    );
    assert_eq!(
        one::<String>(
            &c,
            "SELECT cloud_jkt FROM account_bindings WHERE host_pubkey = ?1",
            &s.beta
        ),
        Some("jkt".into())
    );
    let ids: Vec<String> = c
        .prepare("SELECT item_id FROM items ORDER BY seq")
        .expect("prep")
        .query_map([], |r| r.get(0))
        .expect("q")
        .collect::<Result<_, _>>()
        .expect("rows");
    assert_eq!(ids, ["before-0", "before-1", "before-2"]);
    drop(c);

    // Nothing left over but the store, its lock, and the rollback copy.
    assert_eq!(names(dir), ["relay.db", "relay.lock", "rollback"]);
    let rollback = r["replaced"]["rollback"].as_str().expect("rollback");
    assert_eq!(
        names(&dir.join(ROLLBACK_DIR)),
        [Path::new(rollback)
            .file_name()
            .expect("name")
            .to_string_lossy()
            .into_owned()]
    );
    assert_eq!(
        r["rollback"],
        format!(
            "agentmbx relay restore {rollback} --store-dir {}",
            absolute(dir).display()
        )
        .as_str()
    );

    // The restored store opens, and serve would not rotate again for the backup's age.
    let store = s.relay.open(dir, now + 1_000);
    assert_eq!(store.epoch().expect("epoch"), new_epoch);
    assert_eq!(
        crate::ops::rotate_if_stale(&store, "s", now + 1_000).expect("rule"),
        None
    );
    // A new push gets a seq above every seq the replaced store gave out.
    push(&store, &s.sender, &s.beta, "later", T0 + 20_000);
    let head = store.info_for(&s.beta).expect("info").head_seq;
    assert!(head >= floor, "{head} < {floor}");
    store.close().expect("close");

    // The rollback command brings the replaced store back (itself a restore).
    let r2 = restore(
        dir,
        Path::new(rollback),
        &s.relay.opts(now + 2_000, false),
        None,
    )
    .expect("roll back");
    assert_ne!(r2["epoch"]["to"], new_epoch.as_str());
    let c = raw(dir);
    assert_eq!(
        one::<String>(
            &c,
            "SELECT host_name FROM enrolments WHERE host_pubkey = ?1",
            &s.gamma
        ),
        Some("gamma".into())
    );
    let after: i64 = c
        .query_row(
            "SELECT COUNT(*) FROM items WHERE item_id LIKE 'after-%'",
            [],
            |r| r.get(0),
        )
        .expect("count");
    assert_eq!(after, 2);
    // The log kept growing across both restores.
    let log = read_verified_log(dir, 1_000).expect("log");
    assert_eq!(log.iter().filter(|e| e.record.op == OP_RESTORE).count(), 2);
    assert!(log.iter().all(|e| e.verified));
}

/// The queue of `target` in the store in `dir`: `(seq, item_id, origin_target)`.
fn queue_of(dir: &Path, target: &str) -> Vec<(i64, String, Option<String>)> {
    raw(dir)
        .prepare(
            "SELECT seq, item_id, origin_target FROM items WHERE target_pubkey = ?1 ORDER BY seq",
        )
        .expect("prep")
        .query_map([target], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)))
        .expect("q")
        .collect::<Result<_, _>>()
        .expect("rows")
}

#[test]
fn rotations_made_after_the_backup_are_replayed_on_it() {
    use crate::store::{RotateOutcome, RotateRequest};
    let relay = Relay::new();
    let dir = tempfile::tempdir().expect("dir");
    let out = tempfile::tempdir().expect("out");
    let d = dir.path();
    let (old, new, beta, sender) = (host(), host(), host(), host());
    let (d1, d2, d3) = (host(), host(), host());
    let store = relay.open(d, T0);
    store
        .enrol(EnrolRequest {
            host_pubkey: old.clone(),
            host_name: "laptop".into(),
            owner_fp: "owner".into(),
            account: Some("acct-1".into()),
            authorized_by: "account-token".into(),
            strength: AuthorityStrength::Account,
            now_ms: T0,
        })
        .expect("enrol");
    enrol(&store, &beta, "beta", T0);
    enrol(&store, &sender, "sender", T0);
    enrol(&store, &d1, "desk", T0);
    let list = |target: &str, senders: &[&str]| SenderList {
        target_pubkey: target.to_owned(),
        senders: senders.iter().map(|s| (*s).to_owned()).collect(),
        iat_ms: T0,
        record: "{}".into(),
        sig: "sig".into(),
    };
    store
        .put_sender_list(list(&old, &[&sender]))
        .expect("own list");
    store
        .put_sender_list(list(&beta, &[&old, &sender]))
        .expect("list");
    for i in 0..3 {
        push(&store, &sender, &old, &format!("queued-{i}"), T0 + 10 + i);
    }
    push(&store, &sender, &d1, "desk-queued", T0 + 20);
    let backup = backup_now(d, out.path(), "backup.db");

    // After the backup: the laptop rotates to a key the backup never saw, the desk twice.
    let rotate = |old: &str, new: &str, name: &str, at: i64| {
        store
            .rotate(RotateRequest {
                old_pubkey: old.to_owned(),
                new_pubkey: new.to_owned(),
                host_name: name.to_owned(),
                now_ms: at,
            })
            .expect("rotate")
    };
    assert!(matches!(
        rotate(&old, &new, "laptop", T0 + 1_000),
        RotateOutcome::Rotated { moved: 3 }
    ));
    assert!(matches!(
        rotate(&d1, &d2, "desk", T0 + 2_000),
        RotateOutcome::Rotated { moved: 1 }
    ));
    assert!(matches!(
        rotate(&d2, &d3, "desk", T0 + 3_000),
        RotateOutcome::Rotated { moved: 1 }
    ));
    push(&store, &sender, &new, "after", T0 + 4_000);
    store.close().expect("close");
    let floor_new: i64 = one(
        &raw(d),
        "SELECT next_seq FROM seqs WHERE target_pubkey = ?1",
        &new,
    )
    .expect("floor");

    let r = restore(d, &backup, &relay.opts(T0 + 60_000, false), None).expect("restore");
    assert_eq!(r["carried"]["rotations"], 3, "{r}");
    assert_eq!(r["carried"]["revocations"], 0, "{r}");

    // The old keys are revoked at their rotation's time; the new keys hold the enrolment.
    let c = raw(d);
    let revoked_at = |k: &str| {
        one::<Option<i64>>(
            &c,
            "SELECT revoked_at FROM enrolments WHERE host_pubkey = ?1",
            k,
        )
        .expect("row")
    };
    assert_eq!(revoked_at(&old), Some(T0 + 1_000));
    assert_eq!(revoked_at(&d1), Some(T0 + 2_000));
    assert_eq!(revoked_at(&d2), Some(T0 + 3_000));
    assert_eq!(revoked_at(&new), None);
    assert_eq!(revoked_at(&d3), None);
    let enrolment: (String, String, Option<String>, String) = c
        .query_row(
            "SELECT host_name, owner_fp, account, authorized_by FROM enrolments
                  WHERE host_pubkey = ?1",
            [&new],
            |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?)),
        )
        .expect("new enrolment");
    assert_eq!(
        enrolment,
        (
            "laptop".into(),
            "owner".into(),
            Some("acct-1".into()),
            "account-token".into()
        )
    );
    assert_eq!(
        one::<String>(
            &c,
            "SELECT host_name FROM enrolments WHERE host_pubkey = ?1",
            &d3
        )
        .as_deref(),
        Some("desk")
    );
    // The backup's queue of each old key waits for the new key, above every seq the
    // replaced store gave out, naming the key the sender pushed to.
    let q = queue_of(d, &new);
    assert_eq!(
        q.iter().map(|(_, id, _)| id.as_str()).collect::<Vec<_>>(),
        ["queued-0", "queued-1", "queued-2"]
    );
    assert!(q
        .iter()
        .all(|(seq, _, origin)| *seq >= floor_new && origin.as_deref() == Some(old.as_str())));
    assert!(queue_of(d, &old).is_empty());
    let q = queue_of(d, &d3);
    assert_eq!(q.len(), 1);
    assert_eq!(
        (q[0].1.as_str(), q[0].2.as_deref()),
        ("desk-queued", Some(d1.as_str()))
    );
    assert!(queue_of(d, &d1).is_empty() && queue_of(d, &d2).is_empty());
    // Allowlists: the old key's own list is the new key's, and the new key replaces the
    // old one in the others'.
    let senders = |target: &str| {
        one::<String>(
            &c,
            "SELECT senders FROM sender_lists WHERE target_pubkey = ?1",
            target,
        )
    };
    assert_eq!(senders(&new), Some(json!([sender]).to_string()));
    assert_eq!(senders(&old), None);
    assert_eq!(senders(&beta), Some(json!([new, sender]).to_string()));
    // The markers answer a repeated rotation as the replaced store did.
    for (o, n) in [(&old, &new), (&d1, &d2), (&d2, &d3)] {
        assert_eq!(
            one::<String>(
                &c,
                "SELECT v FROM meta WHERE k = ?1",
                &format!("rotation:{o}")
            )
            .as_deref(),
            Some(n.as_str())
        );
    }
    assert!(
        crate::store::assert_usage_matches(&c) > 0,
        "the replayed moves are counted"
    );
    drop(c);
    let store = relay.open(d, T0 + 61_000);
    assert_eq!(
        store
            .rotate(RotateRequest {
                old_pubkey: old.clone(),
                new_pubkey: new.clone(),
                host_name: "laptop".into(),
                now_ms: T0 + 61_000,
            })
            .expect("again"),
        RotateOutcome::AlreadyRotated
    );
    store.close().expect("close");
}

#[test]
fn a_rotation_of_a_key_enrolled_after_the_backup_is_a_revocation_with_its_marker() {
    use crate::store::{RotateOutcome, RotateRequest};
    let s = scene();
    let d = s.dir.path();
    let store = s.relay.open(d, T0 + 20_000);
    let new = host();
    assert!(matches!(
        store
            .rotate(RotateRequest {
                old_pubkey: s.gamma.clone(),
                new_pubkey: new.clone(),
                host_name: "gamma".into(),
                now_ms: T0 + 20_000,
            })
            .expect("rotate"),
        RotateOutcome::Rotated { .. }
    ));
    store.close().expect("close");
    let r = restore(d, &s.backup, &s.relay.opts(T0 + 60_000, false), None).expect("restore");
    assert_eq!(r["carried"]["rotations"], 0, "{r}");
    let c = raw(d);
    assert_eq!(
        one::<Option<i64>>(
            &c,
            "SELECT revoked_at FROM enrolments WHERE host_pubkey = ?1",
            &s.gamma
        ),
        Some(Some(T0 + 20_000))
    );
    assert_eq!(
        one::<String>(
            &c,
            "SELECT host_name FROM enrolments WHERE host_pubkey = ?1",
            &new
        ),
        None,
        "enrolled after the backup: enrols again"
    );
    assert_eq!(
        one::<String>(
            &c,
            "SELECT v FROM meta WHERE k = ?1",
            &format!("rotation:{}", s.gamma)
        )
        .as_deref(),
        Some(new.as_str())
    );
}

mod refusals;
