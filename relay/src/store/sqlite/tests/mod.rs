//! Tests of [`SqliteStore`], by concern; the helpers they share are here.

mod directory;
mod files;
mod open;
mod oplog;
mod pull_ack;
mod push;
mod quotas;
mod writer;

use super::*;
use super::{files::*, items::*, meta::*, writer::*};
use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::time::Duration;

use rusqlite::{Connection, OpenFlags};

use crate::store::{
    key_fingerprint, wire_hash, AckRequest, AckResult, AuthorityStrength, DirectoryStore, EncAdV1,
    EncAdV2, EnrolOutcome, EnrolRequest, Expiry, ItemOutcome, ItemStatus, ItemStore, OpenOptions,
    OperationsStore, PullPage, PullRequest, PushItem, PushOutcome, Rejection, RevokeOutcome,
    SenderList, SenderListOutcome, StoreError, StoreHealth, StoreLimits, DAY_MS, DB_FILE,
    LOCK_FILE,
};
use crate::testing::conformance::{
    assert_in_order_outcome, enrol_request_at, in_order_batch, item, key, quota_limits, relay_key,
};
use std::sync::atomic::AtomicBool;
use std::sync::Condvar;
use std::time::Instant;

fn options() -> OpenOptions {
    OpenOptions {
        lock_wait_ms: 0,
        ..OpenOptions::default()
    }
}

fn open(dir: &Path) -> SqliteStore {
    SqliteStore::open_with(dir, &relay_key(), 1_000, options()).expect("open store")
}

fn open_limited(dir: &Path, limits: StoreLimits) -> SqliteStore {
    SqliteStore::open_with(
        dir,
        &relay_key(),
        1_000,
        OpenOptions {
            limits,
            ..options()
        },
    )
    .expect("open store")
}

/// Enrols `k` named `name` at 1 000 ms: in `account` by the account authority when given,
/// else by the host-key challenge.
fn enrol_as(store: &SqliteStore, k: &str, name: &str, account: Option<&str>) -> EnrolOutcome {
    store
        .enrol(enrol_request_at(k, name, account, 1_000))
        .expect("enrol")
}

fn enrol(store: &SqliteStore, k: &str, name: &str) {
    let out = enrol_as(store, k, name, None);
    assert!(matches!(out, EnrolOutcome::Enrolled(_)), "{out:?}");
}

fn push(store: &SqliteStore, sender: &str, now_ms: i64, items: Vec<PushItem>) -> PushOutcome {
    store
        .push(crate::testing::conformance::batch(
            sender,
            "alpha",
            now_ms,
            Expiry::Retention,
            items,
        ))
        .expect("push")
}

fn push_one(store: &SqliteStore, sender: &str, now_ms: i64, it: PushItem) -> ItemOutcome {
    let mut out = push(store, sender, now_ms, vec![it]);
    assert_eq!(out.items.len(), 1);
    out.items.remove(0)
}

/// Enrols `key(1)` as "alpha" and `key(2)` as "beta" in `store`; returns their keys.
fn alpha_and_beta(store: &SqliteStore) -> (String, String) {
    let (alpha, beta) = (key(1), key(2));
    enrol(store, &alpha, "alpha");
    enrol(store, &beta, "beta");
    (alpha, beta)
}

/// Pushes envelope `id` from `sender` to `target` with `wire` at `now_ms`; returns its status.
fn pushed(
    store: &SqliteStore,
    sender: &str,
    now_ms: i64,
    id: &str,
    target: &str,
    wire: &[u8],
) -> ItemStatus {
    push_one(store, sender, now_ms, item(id, &[(target, wire)])).status
}

fn pull_all(store: &SqliteStore, target: &str) -> PullPage {
    store
        .pull(crate::testing::conformance::pull_everything(target))
        .expect("pull")
}

/// The usage counters of the store in `dir` equal a fresh count of its items (read through
/// a read-only connection while the store runs); returns the items counted.
fn usage_matches(dir: &Path) -> i64 {
    let c = Connection::open_with_flags(dir.join(DB_FILE), OpenFlags::SQLITE_OPEN_READ_ONLY)
        .expect("read-only");
    crate::store::assert_usage_matches(&c)
}

fn wait_until(what: &str, cond: impl Fn() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(30);
    while !cond() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::yield_now();
    }
}
