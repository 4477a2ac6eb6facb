//! Enrolment rows in the caller's transaction: reading one, enrolling and revoking (spec §2,
//! `wire.md` §3.2 "Enrolment"). The directory's trait methods, the deny list, host rotation
//! and the sweep all build on these.
//!
//! # What it must never do
//! Open a transaction or reach the other tables' modules: it sits below every module that
//! touches enrolments.

use rusqlite::{params, Connection, OptionalExtension};

use crate::store::{
    AuthorityStrength, EnrolOutcome, EnrolRequest, Enrolment, RevokeOutcome, StoreError,
    StoreLimits,
};

/// Revokes `key` in the caller's transaction ([`DirectoryStore::revoke`]).
pub(super) fn revoke_apply(
    c: &Connection,
    key: &str,
    now_ms: i64,
) -> Result<RevokeOutcome, StoreError> {
    Ok(match enrolment_row(c, key)? {
        None => RevokeOutcome::Unknown,
        Some(e) if e.is_revoked() => RevokeOutcome::AlreadyRevoked,
        Some(_) => {
            c.execute(
                "UPDATE enrolments SET revoked_at = ?2 WHERE host_pubkey = ?1",
                params![key, now_ms],
            )?;
            RevokeOutcome::Revoked
        }
    })
}

// ---------------------------------------------------------------------------------------------
// Enrolments

pub(super) const ENROLMENT_COLS: &str =
    "host_pubkey, host_name, owner_fp, account, authorized_by, authority_rank, enrolled_at, revoked_at";

pub(super) fn enrolment_from_row(r: &rusqlite::Row<'_>) -> rusqlite::Result<Enrolment> {
    let rank: i64 = r.get(5)?;
    let strength = AuthorityStrength::from_rank(rank)
        .ok_or(rusqlite::Error::IntegralValueOutOfRange(5, rank))?;
    Ok(Enrolment {
        host_pubkey: r.get(0)?,
        host_name: r.get(1)?,
        owner_fp: r.get(2)?,
        account: r.get(3)?,
        authorized_by: r.get(4)?,
        strength,
        enrolled_at_ms: r.get(6)?,
        revoked_at_ms: r.get(7)?,
    })
}

pub(super) fn enrolment_row(
    c: &Connection,
    host_pubkey: &str,
) -> Result<Option<Enrolment>, StoreError> {
    Ok(c.prepare_cached(&format!(
        "SELECT {ENROLMENT_COLS} FROM enrolments WHERE host_pubkey = ?1"
    ))?
    .query_row([host_pubkey], enrolment_from_row)
    .optional()?)
}

pub(super) fn live_enrolment_count(c: &Connection) -> Result<u64, StoreError> {
    let n: i64 = c
        .prepare_cached("SELECT COUNT(*) FROM enrolments WHERE revoked_at IS NULL")?
        .query_row([], |r| r.get(0))?;
    Ok(u64::try_from(n).unwrap_or(0))
}

/// Spec §2 enrolments, `wire.md` §3.2 "Enrolment".
pub(super) fn enrol_apply(
    c: &Connection,
    limits: &StoreLimits,
    req: &EnrolRequest,
) -> Result<EnrolOutcome, StoreError> {
    let current = enrolment_row(c, &req.host_pubkey)?;
    if current.as_ref().is_some_and(Enrolment::is_revoked) {
        return Ok(EnrolOutcome::Revoked);
    }
    // A weaker authority keeps what a stronger one recorded.
    let (account, authorized_by, strength) = match &current {
        Some(cur) if req.strength < cur.strength => {
            (cur.account.clone(), cur.authorized_by.clone(), cur.strength)
        }
        _ => (req.account.clone(), req.authorized_by.clone(), req.strength),
    };
    if current.is_none() && live_enrolment_count(c)? >= limits.max_live_enrolments {
        return Ok(EnrolOutcome::Full);
    }
    if let Some(account) = &account {
        let taken: bool = c
            .prepare_cached(
                "SELECT EXISTS (SELECT 1 FROM enrolments
                   WHERE account = ?1 AND lower(host_name) = lower(?2)
                     AND revoked_at IS NULL AND host_pubkey <> ?3)",
            )?
            .query_row(params![account, req.host_name, req.host_pubkey], |r| {
                r.get(0)
            })?;
        if taken {
            return Ok(EnrolOutcome::NameTaken);
        }
    }
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
        req.host_pubkey,
        req.host_name,
        req.owner_fp,
        account,
        authorized_by,
        strength.rank(),
        req.now_ms,
    ])?;
    enrolment_row(c, &req.host_pubkey)?
        .map(EnrolOutcome::Enrolled)
        .ok_or_else(|| StoreError::Corrupt("an enrolment vanished while written".to_owned()))
}
