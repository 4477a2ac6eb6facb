//! Items (spec §3, §4; `wire.md` §3.2 "Push (v2)", "Dedup", "Seq", "Quotas", "Pull", "Ack"):
//! dedup, the all-or-nothing push over its targets, quotas, seq allocation, pull pages and acks.

use rusqlite::{params, Connection, OptionalExtension};

use super::meta::read_epoch;
use super::writer::JobKind;
use super::SqliteStore;
use crate::store::{
    wire_hash, AckOutcome, AckRequest, AckResult, Expiry, HostQueueInfo, ItemOutcome, ItemStatus,
    ItemStore, PullPage, PullRequest, PulledItem, PushBatch, PushItem, PushOutcome, QuotaKind,
    Rejection, StoreError, StoreLimits, TargetAccept, DAY_MS, MAX_PULL_ITEMS,
};

/// The last seq allocated for a target (`next_seq − 1`), 0 if none.
fn head_seq(c: &Connection, target: &str) -> Result<i64, StoreError> {
    let next: Option<i64> = c
        .prepare_cached("SELECT next_seq FROM seqs WHERE target_pubkey = ?1")?
        .query_row([target], |r| r.get(0))
        .optional()?;
    Ok(next.map_or(0, |n| n.saturating_sub(1).max(0)))
}

fn acked_through(c: &Connection, target: &str) -> Result<i64, StoreError> {
    let v: Option<i64> = c
        .prepare_cached("SELECT acked_through FROM acked WHERE target_pubkey = ?1")?
        .query_row([target], |r| r.get(0))
        .optional()?;
    Ok(v.unwrap_or(0))
}

// ---------------------------------------------------------------------------------------------
// Push (spec §3, `wire.md` §3.2 "Push (v2)", "Dedup", "Seq", "Quotas")

/// A validated fresh target: live enrolment facts needed for quotas and messages.
struct LiveTarget<'a> {
    pubkey: &'a str,
    wire: &'a [u8],
    host_name: &'a str,
    account: Option<&'a str>,
}

/// A dedup row: what an earlier push of the same (sender, item, target) stored.
struct DedupHit {
    wire_hash: String,
    seq: i64,
    accepted_at: i64,
}

fn dedup_hit(
    c: &Connection,
    sender: &str,
    item_id: &str,
    target: &str,
) -> Result<Option<DedupHit>, StoreError> {
    Ok(c.prepare_cached(
        "SELECT wire_hash, seq, accepted_at FROM dedup
         WHERE sender_pubkey = ?1 AND item_id = ?2 AND target_pubkey = ?3",
    )?
    .query_row(params![sender, item_id, target], |r| {
        Ok(DedupHit {
            wire_hash: r.get(0)?,
            seq: r.get(1)?,
            accepted_at: r.get(2)?,
        })
    })
    .optional()?)
}

/// The live enrolment's `(host_name, account)`, `None` when unknown or revoked.
fn live_target(
    c: &Connection,
    target: &str,
) -> Result<Option<(String, Option<String>)>, StoreError> {
    Ok(c.prepare_cached(
        "SELECT host_name, account FROM enrolments
         WHERE host_pubkey = ?1 AND revoked_at IS NULL",
    )?
    .query_row([target], |r| Ok((r.get(0)?, r.get(1)?)))
    .optional()?)
}

pub(super) fn push_apply(
    c: &Connection,
    limits: &StoreLimits,
    batch: &PushBatch,
) -> Result<PushOutcome, StoreError> {
    let epoch = read_epoch(c)?;
    let expires_at = match batch.expiry {
        Expiry::Retention => Some(
            batch
                .now_ms
                .saturating_add(i64::from(limits.retention_days).saturating_mul(DAY_MS)),
        ),
        Expiry::Never => None,
    };
    // An error part way through an item fails the whole request: the writer rolls back the
    // whole group (a push has no savepoint of its own), so nothing of the request is stored.
    let items = batch
        .items
        .iter()
        .map(|item| push_item(c, limits, batch, expires_at, item))
        .collect::<Result<Vec<_>, _>>()?;
    Ok(PushOutcome { epoch, items })
}

fn rejected(item: &PushItem, why: Rejection) -> ItemOutcome {
    ItemOutcome {
        item_id: item.item_id.clone(),
        status: ItemStatus::Rejected(why),
        at_ms: None,
        targets: Vec::new(),
        prev_seqs: Vec::new(),
    }
}

/// One item: every check first, then the writes. A rejection is returned as an outcome before
/// anything of the item was written, so a rejected item leaves nothing.
///
/// A target that already has a dedup row for (sender, item id, target) is settled by dedup
/// alone: the same bytes answer `duplicate` with the original seq even if the target was
/// revoked or its allowlist changed since (the item was accepted and is durably there, so a
/// retry must settle), other bytes answer `conflict`. Only fresh targets are checked for
/// enrolment, allowlist and quota, and a fresh target that fails rejects the whole item.
fn push_item(
    c: &Connection,
    limits: &StoreLimits,
    batch: &PushBatch,
    expires_at: Option<i64>,
    item: &PushItem,
) -> Result<ItemOutcome, StoreError> {
    if item.targets.is_empty() {
        return Ok(rejected(item, Rejection::BadTargets));
    }
    let sender = batch.sender_pubkey.as_str();
    let hits = item
        .targets
        .iter()
        .map(|t| dedup_hit(c, sender, &item.item_id, &t.target_pubkey))
        .collect::<Result<Vec<_>, _>>()?;

    // 1. Validate every fresh target, in `wire.md` §3.2 order, each check over every target
    //    before the next one.
    let mut facts = Vec::with_capacity(item.targets.len());
    for (t, hit) in item.targets.iter().zip(&hits) {
        facts.push(match hit {
            Some(_) => None,
            None => match live_target(c, &t.target_pubkey)? {
                Some(found) => Some(found),
                None => return Ok(rejected(item, Rejection::TargetNotEnrolled)),
            },
        });
    }
    for (t, hit) in item.targets.iter().zip(&hits) {
        if hit.is_none() && !sender_allowed(c, &t.target_pubkey, sender)? {
            return Ok(rejected(item, Rejection::SenderNotAccepted));
        }
    }
    for (i, t) in item.targets.iter().enumerate() {
        if item.targets[..i]
            .iter()
            .any(|u| u.target_pubkey == t.target_pubkey)
        {
            return Ok(rejected(item, Rejection::DuplicateTarget));
        }
    }
    let hashes: Vec<String> = item.targets.iter().map(|t| wire_hash(&t.wire)).collect();
    if hits
        .iter()
        .zip(&hashes)
        .any(|(hit, hash)| hit.as_ref().is_some_and(|h| &h.wire_hash != hash))
    {
        return Ok(rejected(item, Rejection::Conflict));
    }
    // Quotas of every fresh target, in target order, before any write. The targets are
    // distinct, so each target's own counters see only this item's one addition; an account
    // quota also counts what this item adds to the account's earlier targets.
    let mut fresh = Vec::with_capacity(item.targets.len());
    let mut account_adds: Vec<(&str, i64, i64)> = Vec::new();
    for (idx, (t, fact)) in item.targets.iter().zip(&facts).enumerate() {
        let Some((host_name, account)) = fact else {
            continue;
        };
        let live = LiveTarget {
            pubkey: &t.target_pubkey,
            wire: &t.wire,
            host_name,
            account: account.as_deref(),
        };
        let bytes = i64::try_from(live.wire.len())
            .map_err(|_| StoreError::InvalidInput("wire larger than i64::MAX bytes".to_owned()))?;
        let before = live.account.map_or((0, 0), |a| {
            account_adds
                .iter()
                .filter(|(acc, _, _)| *acc == a)
                .fold((0, 0), |(n, b), (_, dn, db)| (n + dn, b + db))
        });
        if let Some(kind) = quota_exceeded(c, limits, &live, sender, bytes, before)? {
            return Ok(rejected(
                item,
                Rejection::Quota {
                    kind,
                    host: live.host_name.to_owned(),
                },
            ));
        }
        if let Some(a) = live.account {
            account_adds.push((a, 1, bytes));
        }
        fresh.push((idx, live, bytes));
    }

    // 2. Writes: per fresh target a seq, the item row and its dedup row.
    let mut written = Vec::with_capacity(fresh.len());
    for (idx, live, bytes) in &fresh {
        let hash = &hashes[*idx];
        let (seq, prev_seq) = allocate_seq(c, live.pubkey, batch.now_ms)?;
        c.prepare_cached(
            "INSERT INTO items (target_pubkey, seq, kind, item_id, sender_pubkey, sender_host,
                                wire, wire_hash, bytes, accepted_at, expires_at)
             VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11)",
        )?
        .execute(params![
            live.pubkey,
            seq,
            item.kind,
            item.item_id,
            sender,
            batch.sender_host,
            live.wire,
            hash,
            bytes,
            batch.now_ms,
            expires_at,
        ])?;
        c.prepare_cached(
            "INSERT INTO dedup (sender_pubkey, item_id, target_pubkey, wire_hash, seq, accepted_at)
             VALUES (?1, ?2, ?3, ?4, ?5, ?6)",
        )?
        .execute(params![
            sender,
            item.item_id,
            live.pubkey,
            hash,
            seq,
            batch.now_ms
        ])?;
        written.push((*idx, seq, prev_seq));
    }

    // 3. The outcome, in the sender's target order.
    let any_fresh = !written.is_empty();
    let mut earliest: Option<i64> = None;
    let mut targets = Vec::with_capacity(item.targets.len());
    let mut prev_seqs = Vec::with_capacity(item.targets.len());
    for (i, ((t, hit), hash)) in item.targets.iter().zip(hits).zip(hashes).enumerate() {
        let (seq, prev_seq) = match hit {
            Some(hit) => {
                earliest = Some(earliest.map_or(hit.accepted_at, |e| e.min(hit.accepted_at)));
                (hit.seq, None)
            }
            None => written
                .iter()
                .find(|(idx, _, _)| *idx == i)
                .map(|(_, seq, prev)| (*seq, Some(*prev)))
                .ok_or_else(|| {
                    StoreError::Corrupt("a fresh push target was not written".to_owned())
                })?,
        };
        targets.push(TargetAccept {
            target_pubkey: t.target_pubkey.clone(),
            seq,
            wire_hash: hash,
        });
        prev_seqs.push(prev_seq);
    }
    let (status, at_ms) = if any_fresh {
        (ItemStatus::Accepted, batch.now_ms)
    } else {
        (ItemStatus::Duplicate, earliest.unwrap_or(batch.now_ms))
    };
    Ok(ItemOutcome {
        item_id: item.item_id.clone(),
        status,
        at_ms: Some(at_ms),
        targets,
        prev_seqs,
    })
}

/// No allowlist = everyone; else the sender must be listed (spec §2 "Sender allowlist"). The
/// list is read through a scalar subquery: a `json_each` joined to `sender_lists` made SQLite
/// prepare the statement again on every run.
pub(super) const SENDER_ALLOWED_SQL: &str =
    "SELECT NOT EXISTS (SELECT 1 FROM sender_lists WHERE target_pubkey = ?1)
         OR EXISTS (SELECT 1 FROM json_each((SELECT senders FROM sender_lists
                                             WHERE target_pubkey = ?1))
                    WHERE value = ?2)";

fn sender_allowed(c: &Connection, target: &str, sender: &str) -> Result<bool, StoreError> {
    Ok(c.prepare_cached(SENDER_ALLOWED_SQL)?
        .query_row([target, sender], |r| r.get(0))?)
}

/// Would adding `bytes` to this target exceed a quota? Checked in the order of `wire.md` §3.2:
/// target depth, target bytes, sender share, proven account. Reads the usage counters the
/// schema's triggers keep (`schema.rs`, version 4): one row per check, whatever the queue depth.
/// `account_pending` is `(items, bytes)` the same item adds to the account's other targets and
/// has not written yet.
fn quota_exceeded(
    c: &Connection,
    limits: &StoreLimits,
    t: &LiveTarget<'_>,
    sender: &str,
    bytes: i64,
    account_pending: (i64, i64),
) -> Result<Option<QuotaKind>, StoreError> {
    let over = |used: i64, add: i64, max: u64| i128::from(used) + i128::from(add) > i128::from(max);
    let usage = |sql: &str, args: &[&dyn rusqlite::ToSql]| -> Result<(i64, i64), StoreError> {
        Ok(c.prepare_cached(sql)?
            .query_row(args, |r| Ok((r.get(0)?, r.get(1)?)))
            .optional()?
            .unwrap_or((0, 0)))
    };

    let (items, used) = usage(
        "SELECT items, bytes FROM target_usage WHERE target_pubkey = ?1",
        &[&t.pubkey],
    )?;
    if over(items, 1, limits.max_queue_items) {
        return Ok(Some(QuotaKind::QueueDepth));
    }
    if over(used, bytes, limits.max_queue_bytes) {
        return Ok(Some(QuotaKind::QueueBytes));
    }
    let (items, used) = usage(
        "SELECT items, bytes FROM sender_usage WHERE sender_pubkey = ?1 AND target_pubkey = ?2",
        &[&sender, &t.pubkey],
    )?;
    if over(items, 1, limits.max_sender_items) || over(used, bytes, limits.max_sender_bytes) {
        return Ok(Some(QuotaKind::SenderShare));
    }
    if let Some(account) = t.account {
        let (items, used) = usage(
            "SELECT COALESCE(SUM(u.items), 0), COALESCE(SUM(u.bytes), 0)
             FROM enrolments e JOIN target_usage u ON u.target_pubkey = e.host_pubkey
             WHERE e.account = ?1 AND e.revoked_at IS NULL",
            &[&account],
        )?;
        let (items, used) = (
            items.saturating_add(account_pending.0),
            used.saturating_add(account_pending.1),
        );
        if over(items, 1, limits.max_owner_items) {
            return Ok(Some(QuotaKind::OwnerQueueDepth));
        }
        if over(used, bytes, limits.max_owner_bytes) {
            return Ok(Some(QuotaKind::OwnerQueueBytes));
        }
    }
    Ok(None)
}

/// `seq = max(next_seq (default 1), now_ms)`, `next_seq = seq + 1` (spec §2 "seqs").
/// Returns `(seq, prev_seq)`: `prev_seq` is the head before this allocation (`next_seq − 1`,
/// 0 if none), read in the caller's transaction (the push stream's `deliver.prev_seq`).
pub(super) fn allocate_seq(
    c: &Connection,
    target: &str,
    now_ms: i64,
) -> Result<(i64, i64), StoreError> {
    let next: Option<i64> = c
        .prepare_cached("SELECT next_seq FROM seqs WHERE target_pubkey = ?1")?
        .query_row([target], |r| r.get(0))
        .optional()?;
    let seq = next.unwrap_or(1).max(now_ms).max(1);
    let following = seq.checked_add(1).ok_or_else(|| {
        StoreError::Corrupt("the sequence space of a target is exhausted".to_owned())
    })?;
    c.prepare_cached(
        "INSERT INTO seqs (target_pubkey, next_seq) VALUES (?1, ?2)
         ON CONFLICT(target_pubkey) DO UPDATE SET next_seq = excluded.next_seq",
    )?
    .execute(params![target, following])?;
    let prev = next.map_or(0, |n| n.saturating_sub(1).max(0));
    Ok((seq, prev))
}

// ---------------------------------------------------------------------------------------------
// Pull and ack (spec §4, `wire.md` §3.2 "Pull", "Ack")

fn pull_page(c: &Connection, req: &PullRequest) -> Result<PullPage, StoreError> {
    let n = req.limit.clamp(1, MAX_PULL_ITEMS);
    let after = req.after.max(0);
    let tx = c.unchecked_transaction()?;
    let epoch = read_epoch(&tx)?;
    let head = head_seq(&tx, &req.target_pubkey)?;
    let mut items: Vec<PulledItem> = Vec::new();
    let mut more = false;
    {
        let mut st = tx.prepare_cached(
            "SELECT seq, kind, item_id, sender_pubkey, sender_host, bytes, wire FROM items
             WHERE target_pubkey = ?1 AND seq > ?2 ORDER BY seq LIMIT ?3",
        )?;
        let mut rows = st.query(params![req.target_pubkey, after, n + 1])?;
        let mut total: u64 = 0;
        while let Some(row) = rows.next()? {
            if items.len() as i64 >= n {
                more = true;
                break;
            }
            let bytes = u64::try_from(row.get::<_, i64>(5)?).unwrap_or(0);
            if !items.is_empty() && total.saturating_add(bytes) > req.max_bytes {
                more = true;
                break;
            }
            total = total.saturating_add(bytes);
            items.push(PulledItem {
                seq: row.get(0)?,
                kind: row.get(1)?,
                item_id: row.get(2)?,
                sender_pubkey: row.get(3)?,
                sender_host: row.get(4)?,
                wire: row.get(6)?,
            });
        }
    }
    tx.commit()?;
    let last_seq = items.last().map_or(after, |i| i.seq);
    Ok(PullPage {
        epoch,
        head_seq: head,
        items,
        last_seq,
        more,
    })
}

fn ack_apply(c: &Connection, req: &AckRequest) -> Result<AckResult, StoreError> {
    let epoch = read_epoch(c)?;
    let head = head_seq(c, &req.target_pubkey)?;
    if req.epoch.as_deref().is_some_and(|e| e != epoch) {
        return Ok(AckResult::StaleEpoch {
            epoch,
            head_seq: head,
        });
    }
    if !(0..=head).contains(&req.through) {
        return Ok(AckResult::OutOfRange {
            head_seq: head,
            epoch,
        });
    }
    let deleted = c
        .prepare_cached("DELETE FROM items WHERE target_pubkey = ?1 AND seq <= ?2")?
        .execute(params![req.target_pubkey, req.through])?;
    c.prepare_cached(
        "INSERT INTO acked (target_pubkey, acked_through) VALUES (?1, ?2)
         ON CONFLICT(target_pubkey) DO UPDATE
           SET acked_through = MAX(acked_through, excluded.acked_through)",
    )?
    .execute(params![req.target_pubkey, req.through])?;
    Ok(AckResult::Acked(AckOutcome {
        acked_through: acked_through(c, &req.target_pubkey)?,
        deleted: deleted as u64,
        head_seq: head,
        epoch,
    }))
}

impl ItemStore for SqliteStore {
    fn push(&self, batch: PushBatch) -> Result<PushOutcome, StoreError> {
        self.submit(JobKind::Push, move |c, limits| {
            push_apply(c, limits, &batch)
        })
    }

    fn push_then(&self, batch: PushBatch, done: crate::store::PushReply) {
        self.submit_then(
            JobKind::Push,
            move |c, limits| push_apply(c, limits, &batch),
            done,
        )
    }

    fn dedup_targets(&self, sender_pubkey: &str, item_id: &str) -> Result<Vec<String>, StoreError> {
        self.read(|c| {
            let mut st = c.prepare_cached(
                "SELECT target_pubkey FROM dedup WHERE sender_pubkey = ?1 AND item_id = ?2",
            )?;
            let rows = st
                .query_map([sender_pubkey, item_id], |r| r.get(0))?
                .collect::<Result<Vec<String>, _>>()?;
            Ok(rows)
        })
    }

    fn pull(&self, req: PullRequest) -> Result<PullPage, StoreError> {
        self.read(|c| pull_page(c, &req))
    }

    fn ack(&self, req: AckRequest) -> Result<AckResult, StoreError> {
        self.submit(JobKind::Ack, move |c, _| ack_apply(c, &req))
    }

    fn info_for(&self, host_pubkey: &str) -> Result<HostQueueInfo, StoreError> {
        self.read(|c| {
            let tx = c.unchecked_transaction()?;
            let info = HostQueueInfo {
                head_seq: head_seq(&tx, host_pubkey)?,
                acked_through: acked_through(&tx, host_pubkey)?,
            };
            tx.commit()?;
            Ok(info)
        })
    }
}
