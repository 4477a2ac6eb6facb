//! Rules of backup and restore (spec §5 "Backup", "Restore from backup"): the export/import
//! round trip and the carry-forward, run through [`ops::backup_with`] and
//! [`ops::restore_with`] over the backend's [`Backend::maintenance`], and read back through
//! the store traits only.

use std::path::Path;

use serde_json::json;

use crate::ops::{self, RestoreOptions, OP_RESTORE};
use crate::store::{
    DenyEntry, DenyKind, EncAdV1, EncAdV2, Enrolment, HostQueueInfo, OpRecord, PulledItem,
    RevokeOutcome, RotateOutcome, RotateRequest, SenderList, StoreLimits, OPS_KEEP, SWEEP_OPS_KEEP,
};

use super::{acked, item, key, relay_key, Backend, Setup, Store, DAY, T0};

/// When the rules restore (Unix ms): a minute after [`T0`].
const RESTORED_AT: i64 = T0 + 60_000;

/// The store of `backend` in `dir`, opened at `now_ms` with the default limits.
fn open_in(backend: &Backend, dir: &Path, now_ms: i64) -> Store {
    let setup = Setup {
        relay_pubkey: relay_key(),
        now_ms,
        limits: StoreLimits::default(),
    };
    Store {
        s: (backend.open)(dir, &setup),
        _keep: Box::new(()),
    }
}

/// Backs the store in `dir` up to `out/backup.db` with `backend` at `now_ms` (while it may be
/// open: the backup is online) and returns the file.
fn backup(backend: &Backend, dir: &Path, out: &Path, now_ms: i64) -> std::path::PathBuf {
    let file = out.join("backup.db");
    ops::backup_with(backend.maintenance, dir, &file, now_ms).expect("backup");
    file
}

/// Restores `file` into `dir` with `backend` at [`RESTORED_AT`] (no relay key at hand: the
/// backup is checked against the store's own, the receipt is unsigned).
fn restore(backend: &Backend, dir: &Path, file: &Path) {
    let opts = RestoreOptions {
        force: false,
        now_ms: RESTORED_AT,
        signer: None,
    };
    ops::restore_with(backend.maintenance, dir, file, &opts, None).expect("restore");
}

/// Enrols each `(key, name)` of `hosts` with the host-key challenge.
fn enrol_all(st: &Store, hosts: &[(&str, &str)]) {
    for (k, name) in hosts {
        st.enrol(k, name);
    }
}

/// A temporary directory.
fn tempdir() -> tempfile::TempDir {
    tempfile::tempdir().expect("a temporary directory")
}

/// Everything the traits show of a store for `keys`, the epoch aside.
#[derive(Debug, PartialEq)]
struct Seen {
    enrolments: Vec<Option<Enrolment>>,
    live: u64,
    ads: Vec<Option<crate::store::EncAd>>,
    lists: Vec<Option<SenderList>>,
    queues: Vec<(Vec<PulledItem>, i64, HostQueueInfo)>,
    deny: Vec<DenyEntry>,
}

impl Seen {
    fn of(st: &Store, keys: &[&str]) -> Seen {
        Seen {
            enrolments: each(keys, |k| st.s.enrolment(k).expect("enrolment")),
            live: st.s.live_enrolment_count().expect("count"),
            ads: each(keys, |k| st.s.get_enc_ad(k).expect("ad")),
            lists: each(keys, |k| st.s.sender_list(k).expect("list")),
            queues: each(keys, |k| {
                let page = st.pull_all(k);
                (page.items, page.head_seq, st.info(k))
            }),
            deny: st.s.deny_entries().expect("deny entries"),
        }
    }
}

/// `f` of each of `keys`, in order.
fn each<T>(keys: &[&str], f: impl Fn(&str) -> T) -> Vec<T> {
    keys.iter().map(|k| f(k)).collect()
}

/// The whole relay log, newest first.
fn log(st: &Store) -> Vec<OpRecord> {
    st.s.ops(OPS_KEEP + SWEEP_OPS_KEEP).expect("ops")
}

/// A client deny entry for `client` written at `at_ms`, until `until_ms`.
fn deny_client(client: &str, until_ms: Option<i64>, at_ms: i64) -> DenyEntry {
    DenyEntry {
        kind: DenyKind::Client,
        value: client.to_owned(),
        until_ms,
        at_ms,
    }
}

/// Spec §5 "Backup", "Restore from backup": a backup taken while the store is open, restored
/// into a fresh location, reads back the same through the traits — enrolments (a revoked one
/// included), enc-key ads, sender lists, deny entries, every queued item with its seq and wire
/// bytes, ack positions, the relay log (with the restore's receipt on top) — under a new
/// epoch, and a later push gets a seq above every seq the backup holds.
pub fn backup_then_restore_round_trips_the_store(backend: &Backend) {
    let (live, out, fresh) = (tempdir(), tempdir(), tempdir());
    let st = open_in(backend, live.path(), T0);
    let (alpha, beta, gamma, gone) = (key(1), key(2), key(3), key(4));
    enrol_all(
        &st,
        &[
            (&alpha, "alpha"),
            (&beta, "beta"),
            (&gamma, "gamma"),
            (&gone, "gone"),
        ],
    );
    assert_eq!(
        st.s.revoke(&gone, T0 + 1).expect("revoke"),
        RevokeOutcome::Revoked
    );
    st.s.put_enc_ad_v1(EncAdV1 {
        host_pubkey: gamma.clone(),
        host_name: "gamma".to_owned(),
        enc_pub: key(30),
        sig: "s30".to_owned(),
        at_ms: T0 + 2,
    })
    .expect("v1 ad");
    st.s.put_enc_ad_v2(EncAdV2 {
        host_pubkey: beta.clone(),
        enc_pub: key(31),
        record: "{\"enc_pub\":\"b\"}".to_owned(),
        sig: "s31".to_owned(),
        at_ms: T0 + 3,
    })
    .expect("v2 ad");
    st.s.put_sender_list(SenderList {
        target_pubkey: beta.clone(),
        senders: vec![alpha.clone(), gamma.clone()],
        iat_ms: T0 + 4,
        record: "{\"iat\":4}".to_owned(),
        sig: "sig-list".to_owned(),
    })
    .expect("list");
    st.s.deny(deny_client("cli-forever", None, T0 + 5))
        .expect("deny");
    st.s.deny(deny_client("cli-month", Some(T0 + 30 * DAY), T0 + 5))
        .expect("deny");
    let binary: &[u8] = &[0, 255, 10, 13, 0x80];
    st.push_one(
        &alpha,
        T0 + 10,
        item("m1", &[(&beta, b"to-beta-1"), (&gamma, b"to-gamma-1")]),
    );
    st.push_one(&alpha, T0 + 20, item("m2", &[(&beta, binary)]));
    st.push_one(&gamma, T0 + 30, item("m3", &[(&beta, b"from-gamma")]));
    let first = st.queued_seqs(&gamma)[0];
    st.push_one(&alpha, T0 + 31, item("m4", &[(&gamma, b"to-gamma-2")]));
    acked(st.ack(&gamma, first, None));
    for (i, op) in ["relay-deny", "relay-revoke"].into_iter().enumerate() {
        st.s.append_op(T0 + 40 + i as i64, op, &json!({"v": 1, "type": op}))
            .expect("append");
    }
    let keys = [&*alpha, &*beta, &*gamma, &*gone];
    let before = Seen::of(&st, &keys);
    assert_eq!(before.queues[1].0.len(), 3, "beta's queue: {before:?}");
    assert_eq!(before.queues[2].0.len(), 1, "gamma's queue after its ack");
    let (epoch, before_log) = (st.epoch(), log(&st));
    let file = backup(backend, live.path(), out.path(), T0 + 50);
    drop(st);

    restore(backend, fresh.path(), &file);
    let st = open_in(backend, fresh.path(), RESTORED_AT);
    assert_eq!(
        Seen::of(&st, &keys),
        before,
        "the store reads back the same"
    );
    let restored = st.epoch();
    assert_ne!(restored, epoch, "a restore rotates the epoch (spec §5)");
    assert_eq!(st.pull_all(&beta).epoch, restored);
    let after_log = log(&st);
    assert_eq!(
        after_log[0].op, OP_RESTORE,
        "the restore is in the relay log"
    );
    assert_eq!(
        after_log[1..],
        before_log[..],
        "the log before it as it was"
    );
    let head = before.queues[1].1;
    let seq = st
        .push_one(&alpha, T0, item("m5", &[(&beta, b"later")]))
        .targets[0]
        .seq;
    assert!(seq > head, "seqs never go back: {seq} after {head}");
}

/// Spec §5 "Restore from backup" with §2 and §8: restoring an older backup over the store
/// carries forward what the replaced store did after it — a revocation sticks, a deny entry
/// stays active, a host key rotation stays applied (the new key holds the name and the old
/// key's queue, the old key is revoked), and a new push gets a seq above every seq the
/// replaced store handed out, even with the clock behind them.
pub fn restore_carries_forward_what_came_after_the_backup(backend: &Backend) {
    let (live, out) = (tempdir(), tempdir());
    let st = open_in(backend, live.path(), T0);
    let (alpha, beta, carol, old, new) = (key(1), key(2), key(3), key(4), key(5));
    enrol_all(
        &st,
        &[
            (&alpha, "alpha"),
            (&beta, "beta"),
            (&carol, "carol"),
            (&old, "laptop"),
        ],
    );
    st.push_one(&alpha, T0, item("b1", &[(&beta, b"before")]));
    st.push_one(&alpha, T0, item("l1", &[(&old, b"for-the-laptop")]));
    let file = backup(backend, live.path(), out.path(), T0 + 100);
    let backup_epoch = st.epoch();

    // After the backup.
    assert_eq!(
        st.s.revoke(&carol, T0 + 200).expect("revoke"),
        RevokeOutcome::Revoked
    );
    st.s.deny(deny_client("late-client", None, T0 + 210))
        .expect("deny");
    let rotate = |st: &Store, at| {
        st.s.rotate(RotateRequest {
            old_pubkey: old.clone(),
            new_pubkey: new.clone(),
            host_name: "laptop".to_owned(),
            now_ms: at,
        })
        .expect("rotate")
    };
    assert_eq!(rotate(&st, T0 + 220), RotateOutcome::Rotated { moved: 1 });
    // Seqs far ahead of the restore's clock.
    for (i, target) in [&beta, &new].into_iter().enumerate() {
        let id = format!("a{i}");
        st.push_one(&alpha, T0 + 1_000_000, item(&id, &[(target, b"after")]));
    }
    let handed_out = [&beta, &new]
        .iter()
        .map(|k| st.info(k).head_seq)
        .max()
        .expect("heads");
    assert!(handed_out >= T0 + 1_000_000);
    let replaced_epoch = st.epoch();
    drop(st);

    restore(backend, live.path(), &file);
    let st = open_in(backend, live.path(), RESTORED_AT);
    let epoch = st.epoch();
    assert!(
        epoch != backup_epoch && epoch != replaced_epoch,
        "a restore rotates the epoch"
    );
    let carol_row = st.s.enrolment(&carol).expect("read").expect("a row");
    assert!(carol_row.is_revoked(), "revocation sticks: {carol_row:?}");
    assert!(
        st.s.denied("", Some("late-client"), RESTORED_AT)
            .expect("read")
            .is_some(),
        "the deny entry made after the backup is active"
    );
    let old_row = st.s.enrolment(&old).expect("read").expect("a row");
    assert!(old_row.is_revoked(), "the rotated-away key: {old_row:?}");
    let new_row = st.s.enrolment(&new).expect("read").expect("the new key");
    assert!(!new_row.is_revoked(), "{new_row:?}");
    assert_eq!(new_row.host_name, "laptop");
    assert_eq!(st.queued_ids(&new), ["l1"], "the old key's queue moved");
    assert_eq!(rotate(&st, RESTORED_AT), RotateOutcome::AlreadyRotated);
    for target in [&beta, &new] {
        let seq = st
            .push_one(&alpha, RESTORED_AT, item("n", &[(target, b"new")]))
            .targets[0]
            .seq;
        assert!(
            seq > handed_out,
            "a seq above every seq the replaced store handed out: {seq} <= {handed_out}"
        );
    }
}
