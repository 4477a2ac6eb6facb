//! Tests of the sweep module: expiry and notices here, dedup pruning and batch bounds in
//! `bounds`.

mod bounds;

use super::*;
use crate::retention::RelayNoticeSigner;
use crate::store::{
    AckRequest, AckResult, EnrolOutcome, Expiry, ItemOutcome, ItemStatus, OpenOptions, PullPage,
    Rejection, RotateOutcome, RotateRequest, DB_FILE,
};
use crate::store::{DirectoryStore, ItemStore, OperationsStore};
use agentmbx_protocol::canonical;
use agentmbx_protocol::keys::{HostKey, PublicKey};
use agentmbx_protocol::time::iso_ms;
use base64::Engine as _;
use rusqlite::OpenFlags;
use serde_json::{json, Value};
use std::path::Path;

/// 2026-01-01T00:00:00.000Z.
const T0: i64 = 1_767_225_600_000;
/// The default retention: 14 days.
const RET: i64 = 14 * DAY_MS;
/// The default dedup horizon: retention + 7 days.
const HORIZON: i64 = 21 * DAY_MS;

fn key(n: u8) -> String {
    base64::engine::general_purpose::STANDARD.encode([n; 32])
}

struct Fixture {
    dir: tempfile::TempDir,
    relay: HostKey,
    store: SqliteStore,
}

impl Fixture {
    fn new() -> Self {
        Self::with(StoreLimits::default())
    }

    fn with(limits: StoreLimits) -> Self {
        let dir = tempfile::tempdir().expect("tempdir");
        let relay = HostKey::generate();
        let store = open(dir.path(), &relay, limits);
        Fixture { dir, relay, store }
    }

    fn relay_pub(&self) -> String {
        self.relay.public().to_b64()
    }

    fn signer(&self) -> Arc<dyn NoticeSigner> {
        Arc::new(RelayNoticeSigner::new(self.relay.clone()))
    }

    fn sweep(&self, now_ms: i64) -> SweepReport {
        self.store.sweep(now_ms, self.signer()).expect("sweep")
    }

    fn enrol(&self, k: &str, name: &str) {
        let out = self
            .store
            .enrol(crate::testing::conformance::enrol_request_at(
                k, name, None, T0,
            ))
            .expect("enrol");
        assert!(matches!(out, EnrolOutcome::Enrolled(_)), "{out:?}");
    }

    /// Enrols `key(1)` as "alpha" and `key(2)` as "beta"; returns their keys.
    fn alpha_and_beta(&self) -> (String, String) {
        let (alpha, beta) = (key(1), key(2));
        self.enrol(&alpha, "alpha");
        self.enrol(&beta, "beta");
        (alpha, beta)
    }

    #[allow(clippy::too_many_arguments)]
    fn push_as(
        &self,
        expiry: Expiry,
        sender: &str,
        now_ms: i64,
        kind: &str,
        id: &str,
        target: &str,
        wire: &[u8],
    ) -> ItemOutcome {
        let mut out = self
            .store
            .push(crate::testing::conformance::batch(
                sender,
                "alpha",
                now_ms,
                expiry,
                vec![crate::testing::conformance::item_of(
                    kind,
                    id,
                    &[(target, wire)],
                )],
            ))
            .expect("push");
        assert_eq!(out.items.len(), 1);
        out.items.remove(0)
    }

    /// A v2 envelope push; asserts it was accepted and returns its seq.
    fn push(&self, sender: &str, now_ms: i64, id: &str, target: &str, wire: &[u8]) -> i64 {
        let out = self.push_as(
            Expiry::Retention,
            sender,
            now_ms,
            "envelope",
            id,
            target,
            wire,
        );
        assert_eq!(out.status, ItemStatus::Accepted, "{out:?}");
        out.targets[0].seq
    }

    fn pull(&self, target: &str) -> PullPage {
        self.store
            .pull(crate::testing::conformance::pull_everything(target))
            .expect("pull")
    }

    fn ack_all(&self, target: &str) {
        let head = self.store.info_for(target).expect("info").head_seq;
        let out = self
            .store
            .ack(AckRequest {
                target_pubkey: target.to_owned(),
                through: head,
                epoch: None,
            })
            .expect("ack");
        assert!(matches!(out, AckResult::Acked(_)), "{out:?}");
    }

    fn rotate(&self, old: &str, new: &str, name: &str, now_ms: i64) {
        let out = self
            .store
            .rotate(RotateRequest {
                old_pubkey: old.to_owned(),
                new_pubkey: new.to_owned(),
                host_name: name.to_owned(),
                now_ms,
            })
            .expect("rotate");
        assert!(matches!(out, RotateOutcome::Rotated { .. }), "{out:?}");
    }

    /// A read-only connection to `relay.db` for inspection.
    fn raw(&self) -> Connection {
        Connection::open_with_flags(
            self.dir.path().join(DB_FILE),
            OpenFlags::SQLITE_OPEN_READ_ONLY,
        )
        .expect("read-only connection")
    }

    fn dedup_exists(&self, sender: &str, id: &str, target: &str) -> bool {
        self.raw()
            .query_row(
                "SELECT EXISTS (SELECT 1 FROM dedup
                   WHERE sender_pubkey = ?1 AND item_id = ?2 AND target_pubkey = ?3)",
                [sender, id, target],
                |r| r.get(0),
            )
            .expect("dedup query")
    }

    fn sweep_receipts(&self) -> Vec<Value> {
        self.store
            .ops(1_000)
            .expect("ops")
            .into_iter()
            .filter(|o| o.op == OP_SWEEP)
            .map(|o| o.receipt)
            .collect()
    }
}

fn open(dir: &Path, relay: &HostKey, limits: StoreLimits) -> SqliteStore {
    SqliteStore::open_with(
        dir,
        &relay.public().to_b64(),
        T0,
        OpenOptions {
            lock_wait_ms: 0,
            limits,
            ..OpenOptions::default()
        },
    )
    .expect("open store")
}

/// The notice wire of an expired item, parsed: `(notice, sig)`; asserts the bytes are
/// canonical and the signature verifies with the relay key over canonical(notice).
fn verified_notice(relay: &str, wire: &[u8]) -> Value {
    let v: Value = serde_json::from_slice(wire).expect("notice wire is JSON");
    assert_eq!(
        canonical::to_string(&v).expect("canonical").as_bytes(),
        wire,
        "the wire is canonical JSON"
    );
    let obj = v.as_object().expect("object");
    assert_eq!(obj.len(), 2, "exactly {{notice, sig}}: {v}");
    let signed = canonical::to_string(&v["notice"]).expect("canonical notice");
    let sig = v["sig"].as_str().expect("sig");
    let relay = PublicKey::from_b64(relay).expect("relay key");
    assert!(relay.verify(signed.as_bytes(), sig), "signature verifies");
    v["notice"].clone()
}

#[test]
fn an_item_expires_exactly_at_its_expiry_and_not_a_millisecond_before() {
    let f = Fixture::new();
    let (alpha, beta) = f.alpha_and_beta();
    f.push(&alpha, T0, "m1", &beta, b"sealed-1");

    let early = f.sweep(T0 + RET - 1);
    assert_eq!(
        early,
        SweepReport {
            batches: 1,
            ..SweepReport::default()
        }
    );
    assert!(!early.changed());
    assert_eq!(f.pull(&beta).items.len(), 1, "kept 1 ms before expiry");
    assert!(
        f.sweep_receipts().is_empty(),
        "no receipt when nothing changed"
    );

    let at = f.sweep(T0 + RET);
    // The notice stored for alpha (the sender), its first item: prev_seq 0.
    assert_eq!(at.stored.len(), 1);
    assert_eq!(at.stored[0].target_pubkey, alpha);
    assert_eq!(at.stored[0].prev_seq, 0);
    assert_eq!(at.stored[0].seq, f.pull(&alpha).items[0].seq);
    assert_eq!(
        at,
        SweepReport {
            expired_items: 1,
            expired_envelopes: 1,
            expired_bytes: 8,
            notices: 1,
            batches: 1,
            logged: true,
            stored: at.stored.clone(),
            ..SweepReport::default()
        }
    );
    assert!(f.pull(&beta).items.is_empty(), "deleted exactly at expiry");
    let receipts = f.sweep_receipts();
    assert_eq!(receipts.len(), 1);
    let expected = json!({
        "v": 1, "type": "relay-sweep", "at": iso_ms(T0 + RET), "retention_days": 14,
        "expired": {"envelope": 1, "receipt": 0, "expired": 0}, "notices": 1,
        "notices_skipped": {"not_enrolled": 0, "over_cap": 0, "already_sent": 0},
        "dedup_pruned": 0, "freed_bytes": 8, "batches": 1, "more": false,
    });
    // The relay log may add fields (its signature); every field above must be there.
    for (k, v) in expected.as_object().expect("object") {
        assert_eq!(&receipts[0][k], v, "{k} in {}", receipts[0]);
    }
    let again = f.sweep(T0 + RET + 1);
    assert!(!again.changed(), "{again:?}");
    assert_eq!(f.pull(&alpha).items.len(), 1, "one notice, not two");
}

#[test]
fn the_tombstone_answers_a_late_retry_as_a_duplicate_with_the_original_seq() {
    let f = Fixture::new();
    let (alpha, beta) = f.alpha_and_beta();
    let seq = f.push(&alpha, T0, "m1", &beta, b"sealed-1");
    let head = f.store.info_for(&beta).expect("info").head_seq;
    assert_eq!(f.sweep(T0 + RET).expired_items, 1);
    assert!(f.dedup_exists(&alpha, "m1", &beta), "the dedup row stays");

    let late = T0 + RET + 60_000;
    // "m1" from alpha to beta again, late, with `wire`.
    let m1_late = |wire: &[u8]| {
        f.push_as(
            Expiry::Retention,
            &alpha,
            late,
            "envelope",
            "m1",
            &beta,
            wire,
        )
    };
    let retry = m1_late(b"sealed-1");
    assert_eq!(retry.status, ItemStatus::Duplicate, "{retry:?}");
    assert_eq!(retry.targets[0].seq, seq, "the original seq");
    assert_eq!(retry.at_ms, Some(T0), "the original acceptance time");
    assert!(f.pull(&beta).items.is_empty(), "never delivered again");
    assert_eq!(f.store.info_for(&beta).expect("info").head_seq, head);

    let other = m1_late(b"sealed-2");
    assert_eq!(other.status, ItemStatus::Rejected(Rejection::Conflict));
}

#[test]
fn the_notice_is_relay_signed_canonical_and_queued_with_a_normal_seq() {
    let f = Fixture::new();
    let (alpha, beta, gamma) = (key(1), key(2), key(3));
    f.enrol(&alpha, "alpha");
    f.enrol(&beta, "beta");
    f.enrol(&gamma, "gamma");
    let accepted = T0 + 3_173;
    f.push(
        &alpha,
        accepted,
        "01KDVDND1K20BQNR5GAFG5HETT",
        &beta,
        b"sealed-1",
    );
    f.push(&alpha, accepted, "m2", &gamma, b"sealed-2");
    let now = accepted + RET + 61_000;
    // gamma's push makes alpha's next_seq run ahead of the clock.
    let ahead = now + 10_000;
    let s = f.push(&gamma, ahead, "back", &alpha, b"reply");
    assert_eq!(s, ahead);

    let r = f.sweep(now);
    assert_eq!((r.expired_envelopes, r.notices), (2, 2), "{r:?}");
    let page = f.pull(&alpha);
    let notices: Vec<_> = page.items.iter().filter(|i| i.kind == "expired").collect();
    assert_eq!(notices.len(), 2, "{page:?}");
    let relay = f.relay_pub();
    for (n, (target, id)) in notices
        .iter()
        .zip([(&beta, "01KDVDND1K20BQNR5GAFG5HETT"), (&gamma, "m2")])
    {
        assert_eq!(n.item_id, format!("expired:{id}:{target}"));
        assert_eq!(n.sender_pubkey, relay);
        assert_eq!(n.sender_host, "relay");
        let notice = verified_notice(&relay, &n.wire);
        assert_eq!(
            notice,
            json!({
                "v": 1, "type": "relay-expired", "item_id": id, "target_pubkey": target,
                "accepted_at": iso_ms(accepted), "expired_at": iso_ms(now),
            })
        );
        assert!(
            f.dedup_exists(&relay, &n.item_id, &alpha),
            "the notice has its dedup row"
        );
    }
    // seq = max(next_seq, now): after gamma's item, one by one.
    assert_eq!(notices[0].seq, ahead + 1);
    assert_eq!(notices[1].seq, ahead + 2);
    assert_eq!(f.store.info_for(&alpha).expect("info").head_seq, ahead + 2);
    // Its own expiry: one retention after the sweep.
    let expires: Vec<Option<i64>> = {
        let raw = f.raw();
        let mut st = raw
            .prepare("SELECT expires_at FROM items WHERE kind = 'expired' ORDER BY seq")
            .expect("prepare");
        let rows = st
            .query_map([], |r| r.get(0))
            .expect("query")
            .collect::<Result<_, _>>()
            .expect("rows");
        rows
    };
    assert_eq!(expires, vec![Some(now + RET), Some(now + RET)]);
    // On a fresh sender queue the seq is the sweep's time.
    let g = Fixture::new();
    g.enrol(&alpha, "alpha");
    g.enrol(&beta, "beta");
    g.push(&alpha, T0, "m1", &beta, b"sealed-1");
    g.sweep(T0 + RET + 5);
    assert_eq!(g.pull(&alpha).items[0].seq, T0 + RET + 5);
}

#[test]
fn no_notice_for_a_revoked_or_unenrolled_sender() {
    let f = Fixture::new();
    let (beta, gamma, delta) = (key(2), key(3), key(4));
    f.enrol(&beta, "beta");
    f.enrol(&gamma, "gamma");
    // delta never enrolled (the store takes the handler's word for the sender).
    f.push(&gamma, T0, "g1", &beta, b"from-gamma");
    f.push(&delta, T0, "d1", &beta, b"from-delta");
    f.store.revoke(&gamma, T0 + 1).expect("revoke");
    let r = f.sweep(T0 + RET);
    assert_eq!(
        (r.expired_envelopes, r.notices, r.notices_not_enrolled),
        (2, 0, 2),
        "{r:?}"
    );
    assert!(f.pull(&gamma).items.is_empty());
    assert!(f.pull(&delta).items.is_empty());
    assert_eq!(f.sweep_receipts()[0]["notices_skipped"]["not_enrolled"], 2);
}

#[test]
fn the_item_cap_of_the_senders_queue_is_checked_at_and_past_it() {
    let f = Fixture::with(StoreLimits {
        max_queue_items: 3,
        ..StoreLimits::default()
    });
    let (alpha, beta, gamma) = (key(1), key(2), key(3));
    f.enrol(&alpha, "alpha");
    f.enrol(&beta, "beta");
    f.enrol(&gamma, "gamma");
    f.push(&alpha, T0, "m1", &beta, b"sealed-1");
    f.push(&alpha, T0 + 1, "m2", &beta, b"sealed-2");
    // Two items for alpha that do not expire in this sweep.
    f.push(&gamma, T0 + RET, "g1", &alpha, b"reply-1");
    f.push(&gamma, T0 + RET, "g2", &alpha, b"reply-2");
    let r = f.sweep(T0 + RET + 1);
    // m1's notice takes alpha's queue to its cap (3); m2's would pass it.
    assert_eq!(
        (r.expired_envelopes, r.notices, r.notices_over_cap),
        (2, 1, 1),
        "{r:?}"
    );
    let ids: Vec<String> = f
        .pull(&alpha)
        .items
        .into_iter()
        .map(|i| i.item_id)
        .collect();
    assert_eq!(ids, vec!["g1", "g2", &format!("expired:m1:{beta}")]);
    assert!(!f.dedup_exists(&f.relay_pub(), &format!("expired:m2:{beta}"), &alpha));
    assert_eq!(crate::store::assert_usage_matches(&f.raw()), 3);
}

#[test]
fn the_byte_cap_of_the_senders_queue_counts_the_notice_at_and_past_it() {
    let (alpha, beta, gamma) = (key(1), key(2), key(3));
    let now = T0 + RET + 1;
    // Every notice here has the same length (same id length, fixed-width times and sig).
    let probe = HostKey::generate();
    let notice_len = crate::retention::notice_wire(
        &probe,
        &ExpiryFacts {
            item_id: "m1".to_owned(),
            target_pubkey: beta.clone(),
            accepted_at_ms: T0,
            expired_at_ms: now,
        },
    )
    .expect("wire")
    .len() as u64;
    let filler = 100u64;
    let f = Fixture::with(StoreLimits {
        max_queue_bytes: filler + notice_len,
        ..StoreLimits::default()
    });
    f.enrol(&alpha, "alpha");
    f.enrol(&beta, "beta");
    f.enrol(&gamma, "gamma");
    f.push(&alpha, T0, "m1", &beta, b"sealed-1");
    f.push(&alpha, T0, "m2", &beta, b"sealed-2");
    f.push(&gamma, T0 + RET, "g1", &alpha, &[b'x'; 100]);
    let r = f.sweep(now);
    assert_eq!((r.notices, r.notices_over_cap), (1, 1), "{r:?}");
    let page = f.pull(&alpha);
    let used: usize = page.items.iter().map(|i| i.wire.len()).sum();
    assert_eq!(used as u64, filler + notice_len, "exactly at the byte cap");
    assert_eq!(crate::store::assert_usage_matches(&f.raw()), 2);
}

#[test]
fn a_notice_is_never_queued_twice() {
    let f = Fixture::new();
    let (alpha, beta) = f.alpha_and_beta();
    let seq = f.push(&alpha, T0, "m1", &beta, b"sealed-1");
    assert_eq!(f.sweep(T0 + RET).notices, 1);
    // The item comes back (as an older copy of the store would bring it) and expires again.
    {
        let rw = Connection::open(f.dir.path().join(DB_FILE)).expect("rw connection");
        rw.busy_timeout(std::time::Duration::from_secs(5))
            .expect("busy timeout");
        rw.execute(
            "INSERT INTO items (target_pubkey, seq, kind, item_id, sender_pubkey, sender_host,
                                wire, wire_hash, bytes, accepted_at, expires_at)
             VALUES (?1, ?2, 'envelope', 'm1', ?3, 'alpha', ?4, ?5, 8, ?6, ?7)",
            params![
                beta,
                seq,
                alpha,
                b"sealed-1".to_vec(),
                wire_hash(b"sealed-1"),
                T0,
                T0 + RET
            ],
        )
        .expect("insert");
    }
    let r = f.sweep(T0 + RET + 10);
    assert_eq!(
        (r.expired_envelopes, r.notices, r.notices_already_sent),
        (1, 0, 1),
        "{r:?}"
    );
    let notices = f.pull(&alpha).items;
    assert_eq!(notices.len(), 1, "still one notice: {notices:?}");
}

#[test]
fn receipts_and_notices_expire_silently() {
    let f = Fixture::new();
    let (alpha, beta) = f.alpha_and_beta();
    let out = f.push_as(
        Expiry::Retention,
        &alpha,
        T0,
        "receipt",
        "receipt:m0:agent@alpha:1",
        &beta,
        b"{\"rec\":{},\"sig\":\"x\"}",
    );
    assert_eq!(out.status, ItemStatus::Accepted);
    f.push(&alpha, T0, "m1", &beta, b"sealed-1");
    let r = f.sweep(T0 + RET);
    assert_eq!(
        (r.expired_receipts, r.expired_envelopes, r.notices),
        (1, 1, 1),
        "{r:?}"
    );
    assert_eq!(
        f.pull(&alpha).items.len(),
        1,
        "a notice for the envelope only"
    );
    // The notice itself expires one retention later, without a notice about it.
    let r = f.sweep(T0 + 2 * RET);
    assert_eq!(
        r,
        SweepReport {
            expired_items: 1,
            expired_notices: 1,
            expired_bytes: r.expired_bytes,
            // The receipt's and m1's dedup rows (accepted at T0) are past the horizon.
            pruned_dedup: 2,
            batches: 1,
            logged: true,
            ..SweepReport::default()
        }
    );
    assert!(r.expired_bytes > 0);
    assert!(f.pull(&alpha).items.is_empty());
    assert!(f.pull(&f.relay_pub()).items.is_empty());
}

#[test]
fn each_batch_hands_over_its_notices_once_it_committed_on_the_writer_thread() {
    let f = Fixture::new();
    let (alpha, beta) = f.alpha_and_beta();
    let n = SWEEP_BATCH + 1;
    for i in 0..n {
        f.push(&alpha, T0, &format!("m{i}"), &beta, b"sealed");
    }
    let handed = Arc::new(std::sync::Mutex::new(Vec::<Vec<i64>>::new()));
    let into = handed.clone();
    let report = f
        .store
        .sweep_notify(
            T0 + RET,
            f.signer(),
            Arc::new(move |notices| {
                // On the writer thread, in commit order with every other write's callback
                // (a push's live frames), not on the sweep's caller thread.
                assert_eq!(
                    std::thread::current().name(),
                    Some("relay-store-writer"),
                    "the notices are handed over on the writer thread"
                );
                into.lock()
                    .expect("lock")
                    .push(notices.iter().map(|x| x.seq).collect());
            }),
        )
        .expect("sweep");
    let handed = handed.lock().expect("lock").clone();
    assert_eq!(report.batches, 2);
    assert_eq!(
        handed.iter().map(Vec::len).collect::<Vec<_>>(),
        vec![SWEEP_BATCH, 1],
        "one call per committed batch"
    );
    let all: Vec<i64> = handed.concat();
    let stored: Vec<i64> = report.stored.iter().map(|x| x.seq).collect();
    assert_eq!(all, stored);
    assert_eq!(report.notices, n as u64, "every notice is queued");
}
