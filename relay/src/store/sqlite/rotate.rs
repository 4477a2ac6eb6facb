//! Host key rotation inside the store (spec §2 "Rotation"; `wire.md` §2.10, §3.2 "Rotation"): the
//! SQL of [`DirectoryStore::rotate`](crate::store::DirectoryStore::rotate), run by the writer in
//! the request's savepoint, so the whole move is one transaction.
//!
//! # What a rotation changes
//! 1. The new key's enrolment takes the old one's name, owner claim, account, `authorized_by`
//!    and authority rank — unless the new key already holds a stronger authority, whose account
//!    it keeps (a weaker authority never overwrites a stronger one, spec §2). A new key that
//!    was not enrolled becomes enrolled; the live count does not grow (the old key is revoked
//!    in the same transaction), so the live cap is not checked.
//! 2. The old key's queued items move behind the new key's in seq order, with one
//!    `INSERT … SELECT` inside SQLite (the queue is never loaded into the relay's memory; a
//!    queue may hold 10,000 items of up to 768 KiB each). They get consecutive seqs from the
//!    normal allocator's start (`max(next_seq, now)`), i.e. after every item the new key
//!    already has, and `next_seq` moves past them; bytes, hashes, acceptance and expiry times
//!    are kept. An item the new key already holds from the same sender under the same id (the
//!    sender learned the new key and pushed it again) is not moved twice.
//!
//!    **Quotas are not charged, and the move may take the new key's queue past them** (items,
//!    bytes, sender share, account): both keys signed the rotation, they are the same host,
//!    and the spec says nothing may be stranded, so refusing or dropping the excess would lose
//!    mail the relay already accepted (and signed an accept for). The excess is bounded — it
//!    is at most one full queue, which the old key was itself held to — and it only delays new
//!    mail: pushes to the new key are refused `rejected:quota:…` until the host pulled and
//!    acked enough.
//! 3. **Dedup rows stay where they are, under the old key**, although `wire.md` §3.2 says they
//!    move. This is deliberate:
//!    - a sender that has not learned the new key yet and retries a push naming the old key
//!      still settles as `duplicate` with its original accept (the handler skips its
//!      enrolment check for a target that has a dedup row), instead of being told the target
//!      is not enrolled;
//!    - a push naming the new key is a new dedup key (`wire.md` "Resolved details" →
//!      "Resealing": a new target key is a new dedup key), so a copy resealed for the new key
//!      is accepted rather than refused as a `conflict`, which the sender would take as
//!      terminal; moving the rows would put the old wire hash under the new key and turn every
//!      such resealed push into a conflict. The receiver's message-id dedup absorbs the second
//!      copy.
//!
//!    Dedup rows are never re-keyed; the retention sweep (`wire.md` §3.2 "Sweep") prunes
//!    them by age wherever they are, once their item is gone.
//! 4. The old key's enc-key ads (v1 and v2) are dropped.
//! 5. The old key's own allowlist becomes the new key's, unless the new key already published
//!    one (a list signed by the new key is the host's newer word).
//! 6. In every other target's allowlist the old key is replaced by the new one (once). The
//!    stored `record` and `sig` stay exactly as the target signed them — they prove what the
//!    target published — while `senders`, the list the relay enforces, is rebound; a list whose
//!    `senders` differ from its `record` is one the relay rebound. The target's next
//!    publication (with a newer `iat`) replaces it as usual.
//! 7. Every deny-list entry keyed by the old key's fingerprint that is active now is copied to
//!    the new key's fingerprint (same `until`; an entry the new fingerprint already has keeps
//!    the longer of the two). The rotate handler refuses a rotation of a denied key (403
//!    `DENIED`) before it gets here; the copy closes the window between that check and this
//!    transaction, so a deny written meanwhile cannot be escaped by rotating. Each copy
//!    replaces a key that is revoked in the same transaction, so it adds at most one row per
//!    deny entry already stored and is not refused at
//!    [`MAX_DENY_ENTRIES`](crate::store::MAX_DENY_ENTRIES) (a deny must never
//!    be lost).
//! 8. The old key is revoked, and `meta.rotation:<old key>` records the new key, so repeating
//!    the same rotation answers [`RotateOutcome::AlreadyRotated`] instead of an error that
//!    would make the host retry for ever; a rotation of the (now revoked) old key to any other
//!    key is [`RotateOutcome::NotEnrolled`].
//!
//! Every refusal is decided before the first write, so a refused rotation changes nothing.
//!
//! # Bounds of the rotation markers
//! A marker is kept only while the enrolment row of its old key exists: every applied
//! rotation drops the markers whose old key has no enrolment row any more. The old key's row
//! stays (revoked stays revoked, spec §2), and one rotation revokes exactly one live row, so
//! there is at most one marker per revoked enrolment row: the markers are bounded by the
//! enrolments table and shrink with it if enrolments are ever pruned.
//!
//! # Expiry notices for moved items
//! The expiry notice of an envelope that a rotation moved must name the target key the
//! *sender* used — the old key — not the key the item waits under now, or the sender could not
//! match it to its row. A moved item keeps that key in `items.origin_target` (schema version
//! 3; after several rotations still the first key), which the retention sweep
//! (`sqlite/sweep.rs`) names in the notice; it also keeps the dedup row under that key from
//! being pruned while the item is queued.
//!
//! # Replay on a restored copy
//! `relay restore` replays on the backup every rotation the replaced store applied after it
//! ([`replay_rotation`]: the same [`rotate_apply`], at the rotation's own time, on the restore's
//! connection and transaction), so a host that rotated after the backup keeps its new key's
//! enrolment and finds its old queue under it; the host never announces a rotation twice.
//!
//! # What it must never do
//! Verify signatures (the handler checked the record against the old key) or charge quotas.

use rusqlite::{params, Connection, OptionalExtension};

use super::enrolment_rows::enrolment_row;
use super::meta::{meta_get, meta_put};
use crate::store::{key_fingerprint, Enrolment, RotateOutcome, RotateRequest, StoreError};

/// Prefix of the meta key that remembers an applied rotation: `rotation:<old key>` → new key.
pub(crate) const ROTATION_META_PREFIX: &str = "rotation:";

/// Replays on `c` (any connection, in the caller's transaction) a rotation `old_key` →
/// `new_key` that another copy of this store applied at `now_ms` (its `meta.rotation:<old>`
/// marker): `relay restore` brings a backup older than the rotation up to date with it
/// (`ops/restore.rs`). It is [`rotate_apply`] itself, with the record's `host` read from the
/// old enrolment in `c`: the marker is all a store keeps of an applied rotation (old key → new
/// key), and it is the store's own word that the relay already verified both signatures of
/// the record — like a carried revocation, it needs no record to be checked again. A new key
/// without an enrolment in `c` becomes the enrolment (module docs, 1). Outcomes as
/// [`RotateOutcome`]: [`RotateOutcome::NotEnrolled`] when `c` has no live old key (unknown
/// there, or revoked other than by this rotation), [`RotateOutcome::AlreadyRotated`] when `c`
/// has this rotation already. Errors: SQLite errors ([`StoreError`]).
pub(crate) fn replay_rotation(
    c: &Connection,
    old_key: &str,
    new_key: &str,
    now_ms: i64,
) -> Result<RotateOutcome, StoreError> {
    let Some(old) = enrolment_row(c, old_key)? else {
        return Ok(RotateOutcome::NotEnrolled);
    };
    rotate_apply(
        c,
        &RotateRequest {
            old_pubkey: old_key.to_owned(),
            new_pubkey: new_key.to_owned(),
            host_name: old.host_name,
            now_ms,
        },
    )
}

/// Applies one verified rotation (module docs).
pub(super) fn rotate_apply(
    c: &Connection,
    req: &RotateRequest,
) -> Result<RotateOutcome, StoreError> {
    let (old_key, new_key) = (req.old_pubkey.as_str(), req.new_pubkey.as_str());
    let marker = format!("{ROTATION_META_PREFIX}{old_key}");
    let Some(old) = enrolment_row(c, old_key)? else {
        return Ok(RotateOutcome::NotEnrolled);
    };
    if old.is_revoked() {
        return Ok(match meta_get(c, &marker)? {
            Some(to) if to == new_key => RotateOutcome::AlreadyRotated,
            _ => RotateOutcome::NotEnrolled,
        });
    }
    if !old.host_name.eq_ignore_ascii_case(&req.host_name) {
        return Ok(RotateOutcome::OtherHost);
    }
    let current = enrolment_row(c, new_key)?;
    if current.as_ref().is_some_and(Enrolment::is_revoked) {
        return Ok(RotateOutcome::TargetRevoked);
    }
    let (account, authorized_by, strength) = match &current {
        Some(cur) if cur.strength > old.strength => {
            (cur.account.clone(), cur.authorized_by.clone(), cur.strength)
        }
        _ => (old.account.clone(), old.authorized_by.clone(), old.strength),
    };
    if let Some(account) = &account {
        let taken: bool = c
            .prepare_cached(
                "SELECT EXISTS (SELECT 1 FROM enrolments
                   WHERE account = ?1 AND lower(host_name) = lower(?2) AND revoked_at IS NULL
                     AND host_pubkey <> ?3 AND host_pubkey <> ?4)",
            )?
            .query_row(params![account, old.host_name, old_key, new_key], |r| {
                r.get(0)
            })?;
        if taken {
            return Ok(RotateOutcome::TargetNameTaken);
        }
    }

    // From here on nothing refuses: every write below belongs to the rotation.
    // Revoked first, so the new key can carry the old one's (account, name).
    c.prepare_cached("UPDATE enrolments SET revoked_at = ?2 WHERE host_pubkey = ?1")?
        .execute(params![old_key, req.now_ms])?;
    c.prepare_cached(
        "INSERT INTO enrolments
           (host_pubkey, host_name, owner_fp, account, authorized_by, authority_rank, enrolled_at, revoked_at)
         VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, NULL)
         ON CONFLICT(host_pubkey) DO UPDATE SET
           host_name = excluded.host_name, owner_fp = excluded.owner_fp,
           account = excluded.account, authorized_by = excluded.authorized_by,
           authority_rank = excluded.authority_rank, enrolled_at = excluded.enrolled_at",
    )?
    .execute(params![
        new_key,
        old.host_name,
        old.owner_fp,
        account,
        authorized_by,
        strength.rank(),
        req.now_ms,
    ])?;

    let moved = move_queue(c, old_key, new_key, req.now_ms)?;

    c.prepare_cached("DELETE FROM enc_ads WHERE host_pubkey = ?1")?
        .execute([old_key])?;
    c.prepare_cached("DELETE FROM enc_ad_records WHERE host_pubkey = ?1")?
        .execute([old_key])?;

    rebind_allowlists(c, old_key, new_key)?;
    carry_deny_entries(c, old_key, new_key, req.now_ms)?;
    // The account moved with the enrolment, and so does what proved it (the cloud key and
    // client bound at enrolment): both keys signed the record, so the new key's hops carry the
    // same account token. A binding the new key already had (it enrolled with a token itself)
    // is kept.
    if account == old.account {
        c.prepare_cached(
            "UPDATE OR IGNORE account_bindings SET host_pubkey = ?2 WHERE host_pubkey = ?1",
        )?
        .execute(params![old_key, new_key])?;
    }

    meta_put(c, &marker, new_key)?;
    prune_markers(c)?;
    Ok(RotateOutcome::Rotated { moved })
}

/// Moves the old key's queue behind the new key's (module docs, 2) without loading it; returns
/// how many items moved.
fn move_queue(
    c: &Connection,
    old_key: &str,
    new_key: &str,
    now_ms: i64,
) -> Result<u64, StoreError> {
    // The normal allocator's start (`allocate_seq`): max(next_seq, now), at least 1.
    let next: Option<i64> = c
        .prepare_cached("SELECT next_seq FROM seqs WHERE target_pubkey = ?1")?
        .query_row([new_key], |r| r.get(0))
        .optional()?;
    let first = next.unwrap_or(1).max(now_ms).max(1);
    let moved = c
        .prepare_cached(
            "INSERT INTO items (target_pubkey, seq, kind, item_id, sender_pubkey, sender_host,
                                wire, wire_hash, bytes, accepted_at, expires_at, origin_target)
             SELECT ?2, ?3 + ROW_NUMBER() OVER (ORDER BY i.seq) - 1, i.kind, i.item_id,
                    i.sender_pubkey, i.sender_host, i.wire, i.wire_hash, i.bytes,
                    i.accepted_at, i.expires_at, COALESCE(i.origin_target, ?1)
             FROM items i
             WHERE i.target_pubkey = ?1
               AND NOT EXISTS (SELECT 1 FROM dedup d
                                WHERE d.sender_pubkey = i.sender_pubkey
                                  AND d.item_id = i.item_id AND d.target_pubkey = ?2)
             ORDER BY i.seq",
        )?
        .execute(params![old_key, new_key, first])?;
    let moved = u64::try_from(moved).unwrap_or(u64::MAX);
    if moved > 0 {
        let following = i64::try_from(moved)
            .ok()
            .and_then(|n| first.checked_add(n))
            .ok_or_else(|| {
                StoreError::Corrupt("the sequence space of a target is exhausted".to_owned())
            })?;
        c.prepare_cached(
            "INSERT INTO seqs (target_pubkey, next_seq) VALUES (?1, ?2)
             ON CONFLICT(target_pubkey) DO UPDATE SET next_seq = excluded.next_seq",
        )?
        .execute(params![new_key, following])?;
    }
    c.prepare_cached("DELETE FROM items WHERE target_pubkey = ?1")?
        .execute([old_key])?;
    Ok(moved)
}

/// Copies the deny-list entries of the old key's fingerprint that are active at `now_ms` to the
/// new key's fingerprint (module docs, 7); returns how many were copied.
fn carry_deny_entries(
    c: &Connection,
    old_key: &str,
    new_key: &str,
    now_ms: i64,
) -> Result<usize, StoreError> {
    let (old_fp, new_fp) = (key_fingerprint(old_key), key_fingerprint(new_key));
    Ok(c.prepare_cached(
        "INSERT INTO deny (kind, value, until, at)
         SELECT 'host', ?2, until, ?3 FROM deny
          WHERE kind = 'host' AND value = ?1 AND (until IS NULL OR until > ?3)
         ON CONFLICT(kind, value) DO UPDATE SET
           until = CASE WHEN deny.until IS NULL OR excluded.until IS NULL THEN NULL
                        ELSE max(deny.until, excluded.until) END,
           at = excluded.at",
    )?
    .execute(params![old_fp, new_fp, now_ms])?)
}

/// Drops the rotation markers whose old key has no enrolment row (module docs, "Bounds").
fn prune_markers(c: &Connection) -> Result<usize, StoreError> {
    // `rotation:` sorts right before `rotation;`: a range scan of the meta primary key.
    Ok(c.prepare_cached(
        "DELETE FROM meta
          WHERE k >= 'rotation:' AND k < 'rotation;'
            AND NOT EXISTS (SELECT 1 FROM enrolments e
                             WHERE e.host_pubkey = substr(meta.k, 10))",
    )?
    .execute([])?)
}

/// Moves the old key's allowlist to the new key and swaps the old key for the new one in every
/// other list (module docs, 5 and 6).
fn rebind_allowlists(c: &Connection, old_key: &str, new_key: &str) -> Result<(), StoreError> {
    let new_has_own: bool = c
        .prepare_cached("SELECT EXISTS (SELECT 1 FROM sender_lists WHERE target_pubkey = ?1)")?
        .query_row([new_key], |r| r.get(0))?;
    if new_has_own {
        c.prepare_cached("DELETE FROM sender_lists WHERE target_pubkey = ?1")?
            .execute([old_key])?;
    } else {
        c.prepare_cached("UPDATE sender_lists SET target_pubkey = ?2 WHERE target_pubkey = ?1")?
            .execute([old_key, new_key])?;
    }
    let naming: Vec<(String, String)> = {
        let mut st = c.prepare_cached(
            "SELECT s.target_pubkey, s.senders FROM sender_lists s
             WHERE EXISTS (SELECT 1 FROM json_each(s.senders) j WHERE j.value = ?1)",
        )?;
        let rows = st
            .query_map([old_key], |r| Ok((r.get(0)?, r.get(1)?)))?
            .collect::<Result<Vec<_>, _>>()?;
        rows
    };
    for (target, senders) in naming {
        let senders: Vec<String> = serde_json::from_str(&senders).map_err(|e| {
            StoreError::Corrupt(format!("stored sender list is not a JSON array: {e}"))
        })?;
        let mut rebound: Vec<String> = Vec::with_capacity(senders.len());
        for s in senders {
            let s = if s == old_key { new_key.to_owned() } else { s };
            if !rebound.contains(&s) {
                rebound.push(s);
            }
        }
        let text = serde_json::to_string(&rebound)
            .map_err(|e| StoreError::InvalidInput(format!("sender list cannot be encoded: {e}")))?;
        c.prepare_cached("UPDATE sender_lists SET senders = ?2 WHERE target_pubkey = ?1")?
            .execute(params![target, text])?;
    }
    Ok(())
}

#[cfg(test)]
mod tests;
