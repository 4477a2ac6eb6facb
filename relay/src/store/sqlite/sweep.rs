//! The retention sweep inside the store (spec §6, §7; `wire.md` §2.12 "Expiry notice", §3.2
//! "Sweep", "Dedup"): the SQL of [`RelayStore::sweep`](crate::store::RelayStore::sweep).
//!
//! # Transactions
//! Every step is one write request to the store's single writer, so each is one transaction
//! (its COMMIT may be shared with concurrent requests: the group commit) and a crash leaves
//! each batch whole or absent:
//! 1. **Item batches**, at most [`SWEEP_MAX_BATCHES`], each deleting at most [`SWEEP_BATCH`]
//!    items with `expires_at <= now` (oldest expiry first; `expires_at IS NULL`, v1 items,
//!    never expire) and queueing the notices for them in the same transaction, so an expired
//!    envelope is never deleted without its notice or the reverse. The loop stops at the first
//!    batch that is not full.
//! 2. **The last transaction** prunes at most [`SWEEP_MAX_PRUNE`] dedup rows past the horizon,
//!    decides `more`, and — when the sweep deleted or pruned anything — appends the
//!    `relay-sweep` receipt to the relay log: the receipt is in the same transaction as the
//!    sweep's last change. A sweep that fails between its batches has no receipt; the batches
//!    it committed are whole and the next sweep goes on.
//!
//! # Notices
//! An expired **envelope** queues, for its sender (`items.sender_pubkey`, as a target), an item
//! of kind `expired`, id `expired:<item_id>:<target>`, sender the relay key, sender host
//! `relay`, wire from the [`NoticeSigner`], seq by the normal rule (`max(next_seq, now)`),
//! accepted now and expiring one retention later, charged to no quota, with a dedup row
//! (sender = relay key, target = the sender) — unless:
//! - the sender key is not enrolled, or revoked (`not_enrolled`);
//! - a notice with that id was queued before (its dedup row exists: `already_sent`);
//! - the sender's own queue is at its cap: one more item would exceed `max_queue_items`, or
//!   the notice's bytes `max_queue_bytes` (`over_cap`).
//!
//! Those senders still alert on their own deadline (spec §3). `<target>` is
//! `items.origin_target` when a host rotation moved the item (the key the sender pushed to,
//! which its outbox row and the dedup row carry), else the item's target. Receipts and notices
//! expire silently.
//!
//! # Dedup horizon
//! A dedup row goes when it was accepted more than `retention_days` + [`DEDUP_GRACE_DAYS`]
//! days before now (strictly) and its item is gone: no item at its (target, seq), and no item
//! a rotation moved from its target (`origin_target`) with its sender and id. Until then a late
//! retry of an expired or delivered item is a `duplicate`, never a second delivery.
//!
//! The horizon counts from the row's `accepted_at` (`wire.md` §3.2 "Sweep": "prune dedup rows
//! older than retention+7 d"), not from when its item left the queue (acked, expired, or moved
//! by a rotation). That is safe because no sender pushes an item that late: a sender retries
//! (and re-pushes after an epoch change or a rewind) only until its row's deadline,
//! `accepted_at + retention + 24 h` (`wire.md` §3.5 "Settle"; `accepted_at` is the time of
//! the accept the relay gave it, which a retry answered `duplicate` never moves), after which
//! the row is `unconfirmed` and never pushed again. That deadline is six days before the
//! horizon, `accepted_at + retention + 7 d`, a margin that also covers the clock skew between
//! sender and relay. A row written again for a re-push the store had lost (after a restore)
//! has a later `accepted_at` than the accept the sender's deadline counts from, so its horizon
//! is later still. An item is never queued past `accepted_at + retention` either (the sweep
//! deletes it), and a row is never pruned while its item is queued, so the horizon never
//! reaches a row that still guards anything.
//!
//! # What it must never do
//! Touch an item that has not expired; sign anything itself (the [`NoticeSigner`] does, with a
//! key the store never sees); charge a notice to a quota; prune the dedup row of an item that
//! is still queued.

use std::collections::HashMap;
use std::sync::Arc;

use rusqlite::{params, Connection, OptionalExtension};

use super::{allocate_seq, append_op_apply, enrolment_row, op_receipt_text, JobKind, SqliteStore};
use crate::store::{
    iso_utc, wire_hash, ExpiryFacts, NoticeSigner, RelayStore, StoreError, StoreLimits,
    SweepReport, DAY_MS, DEDUP_GRACE_DAYS, OP_SWEEP, SWEEP_BATCH, SWEEP_MAX_BATCHES,
    SWEEP_MAX_PRUNE,
};

/// Item kind of an expiry notice (`wire.md` §2.12).
pub(crate) const NOTICE_KIND: &str = "expired";

/// `items.sender_host` of an expiry notice.
const NOTICE_SENDER_HOST: &str = "relay";

/// [`RelayStore::sweep`] (module docs).
pub(super) fn sweep(
    store: &SqliteStore,
    now_ms: i64,
    signer: Arc<dyn NoticeSigner>,
) -> Result<SweepReport, StoreError> {
    let relay = store.relay_pubkey()?;
    if signer.relay_pubkey() != relay {
        return Err(StoreError::InvalidInput(
            "the expiry notice signer's key is not this store's relay key".to_owned(),
        ));
    }
    let mut report = SweepReport::default();
    let mut all_full = true;
    for _ in 0..SWEEP_MAX_BATCHES {
        let (signer, relay) = (signer.clone(), relay.clone());
        let batch = store.submit(JobKind::Other, move |c, limits| {
            sweep_batch(c, limits, now_ms, &relay, signer.as_ref())
        })?;
        report.batches += 1;
        let full = batch.expired_items >= SWEEP_BATCH as u64;
        add(&mut report, &batch);
        if !full {
            all_full = false;
            break;
        }
    }
    let totals = report.clone();
    let last = store.submit(JobKind::Other, move |c, limits| {
        finish(c, limits, now_ms, all_full, &totals)
    })?;
    report.pruned_dedup = last.pruned;
    report.more = last.more;
    report.logged = last.logged;
    Ok(report)
}

/// Adds one batch's counts to the sweep's.
fn add(total: &mut SweepReport, batch: &SweepReport) {
    total.expired_items += batch.expired_items;
    total.expired_envelopes += batch.expired_envelopes;
    total.expired_receipts += batch.expired_receipts;
    total.expired_notices += batch.expired_notices;
    total.expired_bytes += batch.expired_bytes;
    total.notices += batch.notices;
    total.notices_not_enrolled += batch.notices_not_enrolled;
    total.notices_over_cap += batch.notices_over_cap;
    total.notices_already_sent += batch.notices_already_sent;
}

/// One expired item, as the batch reads it.
struct Expired {
    target: String,
    seq: i64,
    kind: String,
    item_id: String,
    sender: String,
    bytes: i64,
    accepted_at: i64,
    origin: Option<String>,
}

/// What a batch knows about a sender while it queues notices: whether it may get one, and its
/// queue's use (kept current as the batch deletes and queues).
struct SenderQueue {
    enrolled: bool,
    items: i64,
    bytes: i64,
}

/// One batch, in the caller's transaction: deletes up to [`SWEEP_BATCH`] expired items and
/// queues their notices; returns its counts (`batches` unset).
fn sweep_batch(
    c: &Connection,
    limits: &StoreLimits,
    now_ms: i64,
    relay: &str,
    signer: &dyn NoticeSigner,
) -> Result<SweepReport, StoreError> {
    let rows: Vec<Expired> = {
        let mut st = c.prepare_cached(
            "SELECT target_pubkey, seq, kind, item_id, sender_pubkey, bytes, accepted_at,
                    origin_target
             FROM items
             WHERE expires_at IS NOT NULL AND expires_at <= ?1
             ORDER BY expires_at
             LIMIT ?2",
        )?;
        let rows = st
            .query_map(params![now_ms, SWEEP_BATCH as i64], |r| {
                Ok(Expired {
                    target: r.get(0)?,
                    seq: r.get(1)?,
                    kind: r.get(2)?,
                    item_id: r.get(3)?,
                    sender: r.get(4)?,
                    bytes: r.get(5)?,
                    accepted_at: r.get(6)?,
                    origin: r.get(7)?,
                })
            })?
            .collect::<Result<Vec<_>, _>>()?;
        rows
    };
    let mut r = SweepReport::default();
    let mut senders: HashMap<String, SenderQueue> = HashMap::new();
    for it in rows {
        c.prepare_cached("DELETE FROM items WHERE target_pubkey = ?1 AND seq = ?2")?
            .execute(params![it.target, it.seq])?;
        if let Some(q) = senders.get_mut(&it.target) {
            q.items -= 1;
            q.bytes -= it.bytes;
        }
        r.expired_items += 1;
        r.expired_bytes += u64::try_from(it.bytes).unwrap_or(0);
        match it.kind.as_str() {
            "envelope" => r.expired_envelopes += 1,
            "receipt" => r.expired_receipts += 1,
            NOTICE_KIND => r.expired_notices += 1,
            _ => {}
        }
        if it.kind == "envelope" {
            queue_notice(c, limits, now_ms, relay, signer, &it, &mut senders, &mut r)?;
        }
    }
    Ok(r)
}

/// Queues the notice of one expired envelope for its sender, unless a rule says no (module
/// docs, "Notices"); counts the outcome in `r`.
#[allow(clippy::too_many_arguments)]
fn queue_notice(
    c: &Connection,
    limits: &StoreLimits,
    now_ms: i64,
    relay: &str,
    signer: &dyn NoticeSigner,
    it: &Expired,
    senders: &mut HashMap<String, SenderQueue>,
    r: &mut SweepReport,
) -> Result<(), StoreError> {
    if !senders.contains_key(&it.sender) {
        let enrolled = enrolment_row(c, &it.sender)?.is_some_and(|e| !e.is_revoked());
        let (items, bytes): (i64, i64) = c
            .prepare_cached("SELECT items, bytes FROM target_usage WHERE target_pubkey = ?1")?
            .query_row([&it.sender], |row| Ok((row.get(0)?, row.get(1)?)))
            .optional()?
            .unwrap_or((0, 0));
        senders.insert(
            it.sender.clone(),
            SenderQueue {
                enrolled,
                items,
                bytes,
            },
        );
    }
    let Some(queue) = senders.get_mut(&it.sender) else {
        return Err(StoreError::Corrupt("sender queue state missing".to_owned()));
    };
    if !queue.enrolled {
        r.notices_not_enrolled += 1;
        return Ok(());
    }
    let target = it.origin.as_deref().unwrap_or(&it.target);
    let notice_id = format!("expired:{}:{target}", it.item_id);
    let sent: bool = c
        .prepare_cached(
            "SELECT EXISTS (SELECT 1 FROM dedup
               WHERE sender_pubkey = ?1 AND item_id = ?2 AND target_pubkey = ?3)",
        )?
        .query_row(params![relay, notice_id, it.sender], |row| row.get(0))?;
    if sent {
        r.notices_already_sent += 1;
        return Ok(());
    }
    let facts = ExpiryFacts {
        item_id: it.item_id.clone(),
        target_pubkey: target.to_owned(),
        accepted_at_ms: it.accepted_at,
        expired_at_ms: now_ms,
    };
    let wire = signer.notice_wire(&facts).map_err(|e| {
        StoreError::InvalidInput(format!("the expiry notice could not be signed: {e}"))
    })?;
    let bytes = i64::try_from(wire.len())
        .map_err(|_| StoreError::InvalidInput("expiry notice larger than i64::MAX".to_owned()))?;
    let over = |used: i64, add: i64, max: u64| i128::from(used) + i128::from(add) > i128::from(max);
    if over(queue.items, 1, limits.max_queue_items)
        || over(queue.bytes, bytes, limits.max_queue_bytes)
    {
        r.notices_over_cap += 1;
        return Ok(());
    }
    let seq = allocate_seq(c, &it.sender, now_ms)?;
    let hash = wire_hash(&wire);
    let expires_at = now_ms.saturating_add(i64::from(limits.retention_days).saturating_mul(DAY_MS));
    c.prepare_cached(
        "INSERT INTO items (target_pubkey, seq, kind, item_id, sender_pubkey, sender_host,
                            wire, wire_hash, bytes, accepted_at, expires_at)
         VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11)",
    )?
    .execute(params![
        it.sender,
        seq,
        NOTICE_KIND,
        notice_id,
        relay,
        NOTICE_SENDER_HOST,
        wire,
        hash,
        bytes,
        now_ms,
        expires_at,
    ])?;
    c.prepare_cached(
        "INSERT INTO dedup (sender_pubkey, item_id, target_pubkey, wire_hash, seq, accepted_at)
         VALUES (?1, ?2, ?3, ?4, ?5, ?6)",
    )?
    .execute(params![relay, notice_id, it.sender, hash, seq, now_ms])?;
    queue.items += 1;
    queue.bytes += bytes;
    r.notices += 1;
    Ok(())
}

/// What the last transaction did.
struct Finish {
    pruned: u64,
    more: bool,
    logged: bool,
}

/// A dedup row past the horizon (`?1`) whose item is gone (module docs, "Dedup horizon").
const PRUNABLE: &str = "SELECT d.rowid FROM dedup d
     WHERE d.accepted_at < ?1
       AND NOT EXISTS (SELECT 1 FROM items i
                        WHERE i.target_pubkey = d.target_pubkey AND i.seq = d.seq)
       AND NOT EXISTS (SELECT 1 FROM items i
                        WHERE i.origin_target = d.target_pubkey
                          AND i.sender_pubkey = d.sender_pubkey AND i.item_id = d.item_id)
     ORDER BY d.accepted_at
     LIMIT ?2";

/// The sweep's last transaction: prunes the dedup horizon, decides `more`, and appends the
/// receipt when the sweep changed anything (`totals` are the batches' counts).
fn finish(
    c: &Connection,
    limits: &StoreLimits,
    now_ms: i64,
    batches_all_full: bool,
    totals: &SweepReport,
) -> Result<Finish, StoreError> {
    let horizon_days = i64::from(limits.retention_days).saturating_add(DEDUP_GRACE_DAYS);
    let cutoff = now_ms.saturating_sub(horizon_days.saturating_mul(DAY_MS));
    let pruned = c
        .prepare_cached(&format!("DELETE FROM dedup WHERE rowid IN ({PRUNABLE})"))?
        .execute(params![cutoff, SWEEP_MAX_PRUNE as i64])?;
    let pruned = u64::try_from(pruned).unwrap_or(u64::MAX);
    let more_items = batches_all_full && {
        c.prepare_cached(
            "SELECT EXISTS (SELECT 1 FROM items
               WHERE expires_at IS NOT NULL AND expires_at <= ?1)",
        )?
        .query_row([now_ms], |r| r.get::<_, bool>(0))?
    };
    let more_dedup = pruned >= SWEEP_MAX_PRUNE as u64 && {
        c.prepare_cached(&format!("SELECT EXISTS ({PRUNABLE})"))?
            .query_row(params![cutoff, 1], |r| r.get::<_, bool>(0))?
    };
    let more = more_items || more_dedup;
    let changed = totals.expired_items > 0 || pruned > 0;
    if changed {
        let receipt = serde_json::json!({
            "v": 1,
            "type": OP_SWEEP,
            "at": iso_utc(now_ms),
            "retention_days": limits.retention_days,
            "expired": {
                "envelope": totals.expired_envelopes,
                "receipt": totals.expired_receipts,
                "expired": totals.expired_notices,
            },
            "notices": totals.notices,
            "notices_skipped": {
                "not_enrolled": totals.notices_not_enrolled,
                "over_cap": totals.notices_over_cap,
                "already_sent": totals.notices_already_sent,
            },
            "dedup_pruned": pruned,
            "freed_bytes": totals.expired_bytes,
            "batches": totals.batches,
            "more": more,
        });
        append_op_apply(c, now_ms, OP_SWEEP, &op_receipt_text(&receipt)?)?;
    }
    Ok(Finish {
        pruned,
        more,
        logged: changed,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::retention::RelayNoticeSigner;
    use crate::store::{
        AckRequest, AckResult, AuthorityStrength, EnrolOutcome, EnrolRequest, Expiry, ItemOutcome,
        ItemStatus, OpenOptions, PullPage, PullRequest, PushBatch, PushItem, PushTarget, Rejection,
        RotateOutcome, RotateRequest, DB_FILE, MAX_PULL_ITEMS,
    };
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
                .enrol(EnrolRequest {
                    host_pubkey: k.to_owned(),
                    host_name: name.to_owned(),
                    owner_fp: String::new(),
                    account: None,
                    authorized_by: "host-key-challenge".to_owned(),
                    strength: AuthorityStrength::HostKeyChallenge,
                    now_ms: T0,
                })
                .expect("enrol");
            assert!(matches!(out, EnrolOutcome::Enrolled(_)), "{out:?}");
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
                .push(PushBatch {
                    sender_pubkey: sender.to_owned(),
                    sender_host: "alpha".to_owned(),
                    now_ms,
                    expiry,
                    items: vec![PushItem {
                        kind: kind.to_owned(),
                        item_id: id.to_owned(),
                        targets: vec![PushTarget {
                            target_pubkey: target.to_owned(),
                            wire: wire.to_vec(),
                        }],
                    }],
                })
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
                .pull(PullRequest {
                    target_pubkey: target.to_owned(),
                    after: 0,
                    limit: MAX_PULL_ITEMS,
                    max_bytes: u64::MAX,
                })
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
        let (alpha, beta) = (key(1), key(2));
        f.enrol(&alpha, "alpha");
        f.enrol(&beta, "beta");
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
        assert_eq!(
            at,
            SweepReport {
                expired_items: 1,
                expired_envelopes: 1,
                expired_bytes: 8,
                notices: 1,
                batches: 1,
                logged: true,
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
        let (alpha, beta) = (key(1), key(2));
        f.enrol(&alpha, "alpha");
        f.enrol(&beta, "beta");
        let seq = f.push(&alpha, T0, "m1", &beta, b"sealed-1");
        let head = f.store.info_for(&beta).expect("info").head_seq;
        assert_eq!(f.sweep(T0 + RET).expired_items, 1);
        assert!(f.dedup_exists(&alpha, "m1", &beta), "the dedup row stays");

        let late = T0 + RET + 60_000;
        let retry = f.push_as(
            Expiry::Retention,
            &alpha,
            late,
            "envelope",
            "m1",
            &beta,
            b"sealed-1",
        );
        assert_eq!(retry.status, ItemStatus::Duplicate, "{retry:?}");
        assert_eq!(retry.targets[0].seq, seq, "the original seq");
        assert_eq!(retry.at_ms, Some(T0), "the original acceptance time");
        assert!(f.pull(&beta).items.is_empty(), "never delivered again");
        assert_eq!(f.store.info_for(&beta).expect("info").head_seq, head);

        let other = f.push_as(
            Expiry::Retention,
            &alpha,
            late,
            "envelope",
            "m1",
            &beta,
            b"sealed-2",
        );
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
        let (alpha, beta) = (key(1), key(2));
        f.enrol(&alpha, "alpha");
        f.enrol(&beta, "beta");
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
        let (alpha, beta) = (key(1), key(2));
        f.enrol(&alpha, "alpha");
        f.enrol(&beta, "beta");
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
    fn dedup_rows_are_pruned_past_retention_plus_seven_days_and_not_before() {
        let f = Fixture::new();
        let (alpha, beta) = (key(1), key(2));
        f.enrol(&alpha, "alpha");
        f.enrol(&beta, "beta");
        f.push(&alpha, T0, "m1", &beta, b"sealed-1");
        f.ack_all(&beta);
        let at = f.sweep(T0 + HORIZON);
        assert_eq!(at.pruned_dedup, 0, "{at:?}");
        assert!(!at.logged);
        assert!(f.dedup_exists(&alpha, "m1", &beta), "kept at the horizon");
        let past = f.sweep(T0 + HORIZON + 1);
        assert_eq!(past.pruned_dedup, 1, "{past:?}");
        assert!(past.logged);
        assert!(!f.dedup_exists(&alpha, "m1", &beta));
        assert_eq!(f.sweep_receipts()[0]["dedup_pruned"], 1);
        // Past the horizon the id is forgotten: a push is new again.
        let again = f.push_as(
            Expiry::Retention,
            &alpha,
            T0 + HORIZON + 2,
            "envelope",
            "m1",
            &beta,
            b"sealed-1",
        );
        assert_eq!(again.status, ItemStatus::Accepted);
    }

    #[test]
    fn the_horizon_follows_the_configured_retention() {
        let f = Fixture::with(StoreLimits {
            retention_days: 2,
            ..StoreLimits::default()
        });
        let (alpha, beta) = (key(1), key(2));
        f.enrol(&alpha, "alpha");
        f.enrol(&beta, "beta");
        f.push(&alpha, T0, "m1", &beta, b"sealed-1");
        assert_eq!(f.sweep(T0 + 2 * DAY_MS - 1).expired_items, 0);
        assert_eq!(f.sweep(T0 + 2 * DAY_MS).expired_items, 1);
        assert_eq!(f.sweep(T0 + 9 * DAY_MS).pruned_dedup, 0);
        assert_eq!(f.sweep(T0 + 9 * DAY_MS + 1).pruned_dedup, 1);
    }

    #[test]
    fn a_dedup_row_is_never_pruned_while_its_item_is_queued() {
        let f = Fixture::new();
        let (alpha, beta, gamma, gamma2) = (key(1), key(2), key(3), key(4));
        f.enrol(&alpha, "alpha");
        f.enrol(&beta, "beta");
        f.enrol(&gamma, "gamma");
        // v1 items never expire.
        for (id, target) in [("v1-a", &beta), ("v1-b", &gamma)] {
            let out = f.push_as(Expiry::Never, &alpha, T0, "envelope", id, target, b"w");
            assert_eq!(out.status, ItemStatus::Accepted);
        }
        // gamma's item moves to gamma2; its dedup row stays under gamma.
        f.rotate(&gamma, &gamma2, "gamma", T0 + 1);
        let r = f.sweep(T0 + HORIZON + 1);
        assert_eq!((r.expired_items, r.pruned_dedup), (0, 0), "{r:?}");
        assert!(f.dedup_exists(&alpha, "v1-a", &beta));
        assert!(f.dedup_exists(&alpha, "v1-b", &gamma));
        assert_eq!(f.pull(&beta).items.len(), 1);
        assert_eq!(f.pull(&gamma2).items.len(), 1);
        // Once delivered, both go.
        f.ack_all(&beta);
        f.ack_all(&gamma2);
        let r = f.sweep(T0 + HORIZON + 2);
        assert_eq!(r.pruned_dedup, 2, "{r:?}");
    }

    #[test]
    fn the_notice_of_a_rotated_item_names_the_key_the_sender_pushed_to() {
        let f = Fixture::new();
        let (alpha, beta, beta2, beta3) = (key(1), key(2), key(5), key(6));
        f.enrol(&alpha, "alpha");
        f.enrol(&beta, "beta");
        let seq = f.push(&alpha, T0, "m1", &beta, b"sealed-1");
        f.rotate(&beta, &beta2, "beta", T0 + 1_000);
        f.rotate(&beta2, &beta3, "beta", T0 + 2_000);
        assert_eq!(f.pull(&beta3).items.len(), 1, "the item moved twice");
        let r = f.sweep(T0 + RET);
        assert_eq!((r.expired_envelopes, r.notices), (1, 1), "{r:?}");
        assert!(f.pull(&beta3).items.is_empty());
        let page = f.pull(&alpha);
        assert_eq!(page.items.len(), 1);
        assert_eq!(page.items[0].item_id, format!("expired:m1:{beta}"));
        let notice = verified_notice(&f.relay_pub(), &page.items[0].wire);
        assert_eq!(notice["target_pubkey"], json!(beta));
        assert_eq!(notice["item_id"], json!("m1"));
        assert_eq!(notice["accepted_at"], json!(iso_ms(T0)));
        // The sender's late retry naming the old key settles with the original seq.
        let retry = f.push_as(
            Expiry::Retention,
            &alpha,
            T0 + RET + 1,
            "envelope",
            "m1",
            &beta,
            b"sealed-1",
        );
        assert_eq!(retry.status, ItemStatus::Duplicate);
        assert_eq!(retry.targets[0].seq, seq);
        assert_eq!(crate::store::assert_usage_matches(&f.raw()), 1);
    }

    /// Pushes `total` receipts (no notices) from one sender, oldest first (`r0` expires
    /// first), spread over targets of at most 500 items each so that the push's quota sums stay
    /// small; returns the targets in order. The sweep's batches cut across targets.
    fn fill(f: &Fixture, total: usize) -> Vec<String> {
        let alpha = key(1);
        f.enrol(&alpha, "alpha");
        let count = total.div_ceil(SWEEP_BATCH);
        let targets: Vec<String> = (0..count)
            .map(|t| key(100 + u8::try_from(t).expect("few targets")))
            .collect();
        for (t, target) in targets.iter().enumerate() {
            f.enrol(target, &format!("target-{t}"));
        }
        let mut pushed = 0;
        for target in &targets {
            let n = (total - pushed).min(SWEEP_BATCH);
            let items = (pushed..pushed + n)
                .map(|i| PushItem {
                    kind: "receipt".to_owned(),
                    item_id: format!("r{i}"),
                    targets: vec![PushTarget {
                        target_pubkey: target.clone(),
                        wire: b"r".to_vec(),
                    }],
                })
                .collect();
            let out = f
                .store
                .push(PushBatch {
                    sender_pubkey: alpha.clone(),
                    sender_host: "alpha".to_owned(),
                    now_ms: T0 + i64::try_from(pushed).expect("small"),
                    expiry: Expiry::Retention,
                    items,
                })
                .expect("push");
            assert!(out.items.iter().all(|i| i.status == ItemStatus::Accepted));
            pushed += n;
        }
        assert_eq!(pushed, total);
        targets
    }

    #[test]
    fn batches_are_bounded_to_500_items_each_one_transaction_then_more() {
        let f = Fixture::new();
        let total = SWEEP_BATCH * SWEEP_MAX_BATCHES + 1;
        let targets = fill(&f, total);
        let beta = &targets[20];
        let now = T0 + RET + DAY_MS;
        let before = f.store.commits();
        let r = f.sweep(now);
        assert_eq!(r.expired_items, 10_000, "{r:?}");
        assert_eq!(r.batches, 20);
        assert!(r.more, "one item is left for the next sweep");
        assert!(r.logged);
        assert_eq!(
            f.store.commits() - before,
            21,
            "one transaction per batch of 500, and the last one"
        );
        assert_eq!(f.sweep_receipts()[0]["more"], true);
        for target in &targets[..20] {
            assert!(f.pull(target).items.is_empty());
        }
        let left = f.pull(beta);
        assert_eq!(left.items.len(), 1);
        assert_eq!(left.items[0].item_id, format!("r{}", total - 1));

        let before = f.store.commits();
        let r = f.sweep(now);
        assert_eq!((r.expired_items, r.batches, r.more), (1, 1, false), "{r:?}");
        assert_eq!(f.store.commits() - before, 2);
        assert!(f.pull(beta).items.is_empty());
        assert_eq!(crate::store::assert_usage_matches(&f.raw()), 0);
    }

    #[test]
    fn twenty_full_batches_with_nothing_left_is_not_more() {
        let f = Fixture::new();
        let targets = fill(&f, SWEEP_BATCH * SWEEP_MAX_BATCHES + 1);
        // The last item was accepted at T0 + 10,000, every other one by T0 + 9,500.
        let r = f.sweep(T0 + RET + 9_500);
        assert_eq!(
            (r.expired_items, r.batches, r.more),
            (10_000, 20, false),
            "exactly at the bound: {r:?}"
        );
        assert_eq!(f.pull(&targets[20]).items.len(), 1);
        let r = f.sweep(T0 + RET + 10_000);
        assert_eq!((r.expired_items, r.batches, r.more), (1, 1, false), "{r:?}");
    }

    #[test]
    fn pruning_exactly_its_bound_is_not_more() {
        let f = Fixture::new();
        let targets = fill(&f, SWEEP_MAX_PRUNE + 1);
        for target in &targets {
            f.ack_all(target);
        }
        // r10000 (accepted at T0 + 10,000) is not past the horizon yet.
        let r = f.sweep(T0 + HORIZON + 10_000);
        assert_eq!((r.pruned_dedup, r.more), (10_000, false), "{r:?}");
        let r = f.sweep(T0 + HORIZON + 10_001);
        assert_eq!((r.pruned_dedup, r.more), (1, false), "{r:?}");
    }

    #[test]
    fn pruning_is_bounded_per_sweep_then_more() {
        let f = Fixture::new();
        let total = SWEEP_MAX_PRUNE + 1;
        let targets = fill(&f, total);
        for target in &targets {
            f.ack_all(target);
        }
        // Every row is past the horizon; r0 oldest.
        let now = T0 + HORIZON + DAY_MS;
        let r = f.sweep(now);
        assert_eq!(
            (r.expired_items, r.pruned_dedup, r.batches, r.more),
            (0, 10_000, 1, true),
            "{r:?}"
        );
        let left: i64 = f
            .raw()
            .query_row("SELECT COUNT(*) FROM dedup", [], |row| row.get(0))
            .expect("count");
        assert_eq!(left, 1);
        assert!(f.dedup_exists(&key(1), &format!("r{}", total - 1), &targets[20]));
        let r = f.sweep(now);
        assert_eq!((r.pruned_dedup, r.more), (1, false), "{r:?}");
    }

    #[test]
    fn a_signer_of_another_key_is_refused_and_changes_nothing() {
        let f = Fixture::new();
        let (alpha, beta) = (key(1), key(2));
        f.enrol(&alpha, "alpha");
        f.enrol(&beta, "beta");
        f.push(&alpha, T0, "m1", &beta, b"sealed-1");
        let other: Arc<dyn NoticeSigner> = Arc::new(RelayNoticeSigner::new(HostKey::generate()));
        let e = f.store.sweep(T0 + RET, other).expect_err("refused");
        assert!(matches!(e, StoreError::InvalidInput(_)), "{e:?}");
        assert_eq!(f.pull(&beta).items.len(), 1);
    }

    #[test]
    fn a_version_2_store_with_a_moved_item_migrates_and_its_notice_names_the_old_key() {
        let dir = tempfile::tempdir().expect("tempdir");
        let relay = HostKey::generate();
        let (alpha, beta, beta2) = (key(1), key(2), key(5));
        {
            let mut c = Connection::open(dir.path().join(DB_FILE)).expect("open v2");
            crate::store::schema::migrate(&mut c, 0, 2, crate::store::schema::MIGRATIONS)
                .expect("to v2");
            c.execute_batch("INSERT INTO meta (k, v) VALUES ('epoch', 'epoch-v2')")
                .expect("epoch");
            c.execute(
                "INSERT INTO meta (k, v) VALUES ('relay_pubkey', ?1)",
                [relay.public().to_b64()],
            )
            .expect("relay key");
            for (k, name, revoked) in [(&alpha, "alpha", None), (&beta, "beta", Some(T0 + 5))]
                .into_iter()
                .chain([(&beta2, "beta", None)])
            {
                c.execute(
                    "INSERT INTO enrolments (host_pubkey, host_name, owner_fp, account,
                       authorized_by, authority_rank, enrolled_at, revoked_at)
                     VALUES (?1, ?2, '', NULL, 'host-key-challenge', 0, ?3, ?4)",
                    params![k, name, T0, revoked],
                )
                .expect("enrolment");
            }
            // m1 was pushed to beta (seq 3) and a rotation moved it to beta2 (seq 9); m2 was
            // pushed to beta2 itself.
            let item = |target: &str, seq: i64, id: &str, wire: &[u8]| {
                c.execute(
                    "INSERT INTO items (target_pubkey, seq, kind, item_id, sender_pubkey,
                       sender_host, wire, wire_hash, bytes, accepted_at, expires_at)
                     VALUES (?1, ?2, 'envelope', ?3, ?4, 'alpha', ?5, ?6, ?7, ?8, ?9)",
                    params![
                        target,
                        seq,
                        id,
                        alpha,
                        wire,
                        wire_hash(wire),
                        wire.len() as i64,
                        T0,
                        T0 + RET
                    ],
                )
                .expect("item");
            };
            item(&beta2, 9, "m1", b"sealed-1");
            item(&beta2, 10, "m2", b"sealed-2");
            let dedup = |target: &str, seq: i64, id: &str, wire: &[u8]| {
                c.execute(
                    "INSERT INTO dedup (sender_pubkey, item_id, target_pubkey, wire_hash, seq,
                       accepted_at) VALUES (?1, ?2, ?3, ?4, ?5, ?6)",
                    params![alpha, id, target, wire_hash(wire), seq, T0],
                )
                .expect("dedup");
            };
            dedup(&beta, 3, "m1", b"sealed-1");
            dedup(&beta2, 10, "m2", b"sealed-2");
            c.execute(
                "INSERT INTO seqs (target_pubkey, next_seq) VALUES (?1, 11)",
                [&beta2],
            )
            .expect("seqs");
        }
        let store = open(dir.path(), &relay, StoreLimits::default());
        assert_eq!(
            store.epoch().expect("epoch"),
            "epoch-v2",
            "the epoch is kept"
        );
        {
            let raw = Connection::open_with_flags(
                dir.path().join(DB_FILE),
                OpenFlags::SQLITE_OPEN_READ_ONLY,
            )
            .expect("raw");
            assert_eq!(
                crate::store::stored_version(&raw).expect("version"),
                crate::store::SCHEMA_VERSION
            );
            let origin = |id: &str| -> Option<String> {
                raw.query_row(
                    "SELECT origin_target FROM items WHERE item_id = ?1",
                    [id],
                    |r| r.get(0),
                )
                .optional()
                .expect("query")
                .flatten()
            };
            assert_eq!(origin("m1"), Some(beta.clone()), "backfilled from dedup");
            assert_eq!(origin("m2"), None);
            let n: i64 = raw
                .query_row("SELECT COUNT(*) FROM dedup", [], |r| r.get(0))
                .expect("count");
            assert_eq!(n, 2, "every dedup row kept");
        }
        let signer: Arc<dyn NoticeSigner> = Arc::new(RelayNoticeSigner::new(relay.clone()));
        let r = store.sweep(T0 + RET, signer).expect("sweep");
        assert_eq!((r.expired_envelopes, r.notices), (2, 2), "{r:?}");
        let ids: Vec<String> = store
            .pull(PullRequest {
                target_pubkey: alpha.clone(),
                after: 0,
                limit: MAX_PULL_ITEMS,
                max_bytes: u64::MAX,
            })
            .expect("pull")
            .items
            .into_iter()
            .map(|i| i.item_id)
            .collect();
        assert_eq!(
            ids,
            vec![format!("expired:m1:{beta}"), format!("expired:m2:{beta2}")]
        );
    }
}
