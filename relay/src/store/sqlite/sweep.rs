//! The retention sweep inside the store (spec §6, §7; `wire.md` §2.12 "Expiry notice", §3.2
//! "Sweep", "Dedup"): the SQL of [`OperationsStore::sweep`](crate::store::OperationsStore::sweep).
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

use super::enrolment_rows::enrolment_row;
use super::items::allocate_seq;
use super::oplog_rows::{append_op_apply, op_receipt_text};
use super::writer::JobKind;
use super::SqliteStore;
use crate::store::{
    iso_utc, wire_hash, ExpiryFacts, NoticeSigner, OperationsStore, StoreError, StoreLimits,
    StoredNotice, SweepReport, DAY_MS, DEDUP_GRACE_DAYS, OP_SWEEP, SWEEP_BATCH, SWEEP_MAX_BATCHES,
    SWEEP_MAX_PRUNE,
};

/// Item kind of an expiry notice (`wire.md` §2.12).
pub(crate) const NOTICE_KIND: &str = "expired";

/// `items.sender_host` of an expiry notice.
const NOTICE_SENDER_HOST: &str = "relay";

/// [`OperationsStore::sweep_notify`] (module docs): `committed` gets each batch's notices once
/// that batch committed, on the writer thread (in commit order with every other write's
/// callback, e.g. a push's live frames).
pub(super) fn sweep(
    store: &SqliteStore,
    now_ms: i64,
    signer: Arc<dyn NoticeSigner>,
    committed: crate::store::NoticesCommitted,
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
        let (reply_to, reply) = std::sync::mpsc::sync_channel(1);
        let notify = committed.clone();
        store.submit_then(
            JobKind::Other,
            move |c, limits| sweep_batch(c, limits, now_ms, &relay, signer.as_ref()),
            Box::new(move |r: Result<SweepReport, StoreError>| {
                // On the writer thread, right after the commit: before any later write's
                // callback (a push committed next publishes after these notices).
                if let Ok(batch) = &r {
                    notify(&batch.stored);
                }
                let _ = reply_to.send(r);
            }),
        );
        let batch = reply.recv().map_err(|_| StoreError::WriterStopped)??;
        report.batches += 1;
        let full = batch.expired_items >= SWEEP_BATCH as u64;
        add(&mut report, batch);
        if !full {
            all_full = false;
            break;
        }
    }
    // The counts only: the notices' wire bytes stay in `report`.
    let stored = std::mem::take(&mut report.stored);
    let totals = report.clone();
    report.stored = stored;
    let last = store.submit(JobKind::Other, move |c, limits| {
        finish(c, limits, now_ms, all_full, &totals)
    })?;
    report.pruned_dedup = last.pruned;
    report.more = last.more;
    report.logged = last.logged;
    Ok(report)
}

/// Adds one batch's counts to the sweep's, and moves its notices there.
fn add(total: &mut SweepReport, batch: SweepReport) {
    total.expired_items += batch.expired_items;
    total.expired_envelopes += batch.expired_envelopes;
    total.expired_receipts += batch.expired_receipts;
    total.expired_notices += batch.expired_notices;
    total.expired_bytes += batch.expired_bytes;
    total.notices += batch.notices;
    total.notices_not_enrolled += batch.notices_not_enrolled;
    total.notices_over_cap += batch.notices_over_cap;
    total.notices_already_sent += batch.notices_already_sent;
    total.stored.extend(batch.stored);
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
    let (seq, prev_seq) = allocate_seq(c, &it.sender, now_ms)?;
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
    r.stored.push(StoredNotice {
        target_pubkey: it.sender.clone(),
        seq,
        prev_seq,
        item_id: notice_id,
        sender_pubkey: relay.to_owned(),
        wire,
    });
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
mod tests;
