//! The carry-forward of a restore (step 4, `ops::restore` module docs), written once against
//! [`StagedStore`]: a backend gets these rules by implementing its primitives.
//!
//! # What it must never do
//! - Carry an enrolment made after the backup (it gives authority back), or drop what the
//!   current store took away (a revocation, an active deny entry).

use crate::store::maintenance::{Carried, CarryForward, StagedStore};
use crate::store::{RotateOutcome, StoreError};

use super::fingerprint;

/// Carries `cur` (the replaced store's state) forward onto the restored copy, in its
/// transaction. The order matters: the seq floors first (a replayed rotation moves a queue
/// behind them), then the rotations (before the revocations, which would otherwise revoke a
/// rotated key without moving anything), then everything else.
pub(super) fn carry(
    staged: &dyn StagedStore,
    cur: &CarryForward,
    now_ms: i64,
) -> Result<Carried, StoreError> {
    let count = |n: &mut usize, changed: bool| *n += usize::from(changed);
    let mut c = Carried::default();
    // Every later seq stays above every seq a receiver may have seen (spec §2).
    for (target, next_seq) in &cur.seq_floors {
        count(
            &mut c.seq_floors,
            staged.carry_seq_floor(target, *next_seq)?,
        );
    }
    let not_replayed = replay_rotations(staged, cur, now_ms, &mut c)?;
    // Revoked stays revoked: a key revoked (or rotated away) after the backup is revoked in
    // the restored store too, enrolled there or not.
    for host in &cur.revoked {
        count(&mut c.revocations, staged.carry_revocation(host)?);
    }
    // The markers of rotations that had nothing to replay here (the old key enrolled after
    // the backup: its row is the revoked one just carried), so a host repeating its rotation
    // is answered as by the replaced store.
    for r in cur
        .rotations
        .iter()
        .filter(|r| !not_replayed.contains(&r.old_key))
    {
        staged.carry_rotation_marker(&r.old_key, &r.new_key)?;
    }
    for list in &cur.sender_lists {
        count(&mut c.sender_lists, staged.carry_sender_list(list)?);
    }
    for ad in &cur.enc_ads {
        count(&mut c.enc_ads, staged.carry_enc_ad(ad)?);
    }
    for ad in &cur.enc_ad_records {
        count(&mut c.enc_ad_records, staged.carry_enc_ad_record(ad)?);
    }
    // Only the active deny entries.
    for entry in cur
        .deny
        .iter()
        .filter(|d| d.until_ms.is_none_or(|u| u > now_ms))
    {
        count(&mut c.deny, staged.carry_deny(entry)?);
    }
    // Only for keys the restored store knows: a post-backup enrolment is not carried, nor is
    // its binding.
    for binding in &cur.bindings {
        count(&mut c.account_bindings, staged.carry_binding(binding)?);
    }
    if !cur.ops.is_empty() {
        // The operator's history continues; the backup's own log is older. The current log is
        // already within its bounds (the restore receipt's append prunes as every append does).
        c.ops = staged.replace_op_log(&cur.ops)?;
    }
    Ok(c)
}

/// Replays on the restored copy, oldest first, every rotation of the current store the backup
/// does not have (no `meta.rotation:<old>` marker in it), at its own time, with the code that
/// applied it ([`StagedStore::replay_rotation`]): the new key takes the enrolment (name,
/// account, `authorized_by`; it becomes enrolled if the backup never saw it), the old key's
/// queue in the backup moves behind the new key's, the allowlists are rebound, the deny
/// entries carried, the old key revoked and the marker written. Counts them in `c.rotations`;
/// returns the old keys of the rotations that could not be applied (the new key revoked in the
/// backup, or its name taken there — only a store of another lineage has either), which keep
/// the plain revocation the carry gives them, with a warning.
fn replay_rotations(
    staged: &dyn StagedStore,
    cur: &CarryForward,
    now_ms: i64,
    c: &mut Carried,
) -> Result<Vec<String>, StoreError> {
    let mut not_replayed = Vec::new();
    for r in &cur.rotations {
        let marker = format!("{}{}", crate::store::ROTATION_META_PREFIX, r.old_key);
        if staged.meta(&marker)?.is_some() {
            continue; // The backup has it.
        }
        match staged.replay_rotation(&r.old_key, &r.new_key, r.at_ms.unwrap_or(now_ms))? {
            RotateOutcome::Rotated { moved } => {
                c.rotations += 1;
                tracing::info!(
                    old = %fingerprint(&r.old_key),
                    new = %fingerprint(&r.new_key),
                    moved,
                    "restore: replayed a host key rotation made after the backup"
                );
            }
            // Nothing of the old key to move here: it enrolled after the backup (its
            // revocation is carried), or the backup has it revoked already.
            RotateOutcome::NotEnrolled | RotateOutcome::AlreadyRotated => {}
            other => {
                tracing::warn!(
                    old = %fingerprint(&r.old_key),
                    new = %fingerprint(&r.new_key),
                    outcome = ?other,
                    "restore: a host key rotation made after the backup cannot be replayed on it; the old key is revoked and its queue in the backup stays under it"
                );
                not_replayed.push(r.old_key.clone());
            }
        }
    }
    Ok(not_replayed)
}
