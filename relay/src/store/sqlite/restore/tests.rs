//! The restore tests (`ops::restore`, run on SQLite stores): they alter and inspect the
//! stores with SQL, so they live beside the SQLite steps.

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
    AccountBinding, AuthorityStrength, DenyEntry, DenyKind, EncAdV2, EnrolRequest, Expiry, OpEntry,
    OpenOptions, PushBatch, PushItem, PushTarget, RelayStore, SenderList, SqliteStore,
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
        .enrol(EnrolRequest {
            host_pubkey: key.to_owned(),
            host_name: name.to_owned(),
            owner_fp: String::new(),
            account: None,
            authorized_by: "host-key-challenge".into(),
            strength: AuthorityStrength::HostKeyChallenge,
            now_ms: now,
        })
        .expect("enrol");
}

fn push(store: &SqliteStore, sender: &str, target: &str, id: &str, now: i64) {
    store
        .push(PushBatch {
            sender_pubkey: sender.to_owned(),
            sender_host: "alpha".into(),
            now_ms: now,
            expiry: Expiry::Never,
            items: vec![PushItem {
                item_id: id.to_owned(),
                kind: "envelope".into(),
                targets: vec![PushTarget {
                    target_pubkey: target.to_owned(),
                    wire: format!("wire of {id}").into_bytes(),
                }],
            }],
        })
        .expect("push");
}

fn raw(dir: &Path) -> Connection {
    Connection::open(dir.join(DB_FILE)).expect("raw")
}

fn one<T: rusqlite::types::FromSql>(c: &Connection, sql: &str, p: &str) -> Option<T> {
    c.query_row(sql, [p], |r| r.get(0)).optional().expect(sql)
}

fn names(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir)
        .expect("ls")
        .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
        .collect();
    v.sort();
    v
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
