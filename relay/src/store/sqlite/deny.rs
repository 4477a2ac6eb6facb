//! The deny-list and account bindings in SQLite (spec §8 "Revocation"; schema step 2 in
//! `schema.rs`): tables `deny(kind, value, until, at)` and `account_bindings(host_pubkey,
//! cloud_jkt, client_id, sub, org, at)`.
//!
//! Writes go through the store's one writer like every other write (one transaction each, the
//! answer only after COMMIT); reads use the read pool. An account binding is written in the
//! same transaction as the enrolment it belongs to, so a host is never enrolled by the account
//! authority without its binding, and a cloud key bound to another live host key is refused in
//! that transaction. The operator controls (revoke, deny, undeny) write their change and its
//! relay-log entry in one transaction. This file never decides what a token or a fingerprint
//! means: it stores and matches the text the relay computed.
//!
//! It also reads which relay key a store directory is bound to
//! ([`SqliteStore::recorded_relay_pubkey`]) for the offline operator commands.

use rusqlite::{params, Connection, OptionalExtension};

use super::enrolment_rows::{enrol_apply, enrolment_from_row, revoke_apply, ENROLMENT_COLS};
use super::oplog_rows::{append_op_apply, op_receipt_text};
use super::writer::JobKind;
use super::SqliteStore;
use crate::store::{
    is_canonical_key, key_fingerprint, AccountBinding, DenyEntry, DenyKind, DenyOutcome,
    EnrolOutcome, EnrolRequest, Enrolment, OpEntry, RevokeOutcome, StoreError, MAX_DENY_ENTRIES,
};

/// Longest deny-list value (a fingerprint is 19 bytes; a client_id is the issuer's text).
pub(crate) const MAX_DENY_VALUE: usize = 256;

fn entry_from_row(r: &rusqlite::Row<'_>) -> rusqlite::Result<DenyEntry> {
    let kind: String = r.get(0)?;
    let kind = DenyKind::parse(&kind).ok_or_else(|| {
        rusqlite::Error::FromSqlConversionFailure(
            0,
            rusqlite::types::Type::Text,
            format!("unknown deny kind {kind:?}").into(),
        )
    })?;
    Ok(DenyEntry {
        kind,
        value: r.get(1)?,
        until_ms: r.get(2)?,
        at_ms: r.get(3)?,
    })
}

fn binding_row(c: &Connection, host_pubkey: &str) -> Result<Option<AccountBinding>, StoreError> {
    Ok(c.prepare_cached(
        "SELECT host_pubkey, cloud_jkt, client_id, sub, org, at FROM account_bindings
         WHERE host_pubkey = ?1",
    )?
    .query_row([host_pubkey], |r| {
        Ok(AccountBinding {
            host_pubkey: r.get(0)?,
            cloud_jkt: r.get(1)?,
            client_id: r.get(2)?,
            sub: r.get(3)?,
            org: r.get(4)?,
            at_ms: r.get(5)?,
        })
    })
    .optional()?)
}

impl SqliteStore {
    /// The relay key a store directory is bound to (`meta.relay_pubkey`), read without opening
    /// the store or taking `relay.lock` (a read-only connection; safe while `serve` runs), so an
    /// offline operator command can open it with [`SqliteStore::open_with`] without the relay's
    /// private key. `Ok(None)` when `dir` holds no `relay.db` or it records no key.
    pub fn recorded_relay_pubkey(dir: &std::path::Path) -> Result<Option<String>, StoreError> {
        let path = dir.join(crate::store::DB_FILE);
        if !path.exists() {
            return Ok(None);
        }
        let conn = Connection::open_with_flags(
            &path,
            rusqlite::OpenFlags::SQLITE_OPEN_READ_ONLY | rusqlite::OpenFlags::SQLITE_OPEN_NO_MUTEX,
        )?;
        conn.busy_timeout(std::time::Duration::from_secs(5))?;
        let has_meta: bool = conn.query_row(
            "SELECT EXISTS (SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'meta')",
            [],
            |r| r.get(0),
        )?;
        if !has_meta {
            return Ok(None);
        }
        Ok(conn
            .query_row("SELECT v FROM meta WHERE k = 'relay_pubkey'", [], |r| {
                r.get(0)
            })
            .optional()?)
    }
}

/// [`crate::store::DirectoryStore::enrol_bound`].
pub(super) fn enrol_bound(
    store: &SqliteStore,
    req: EnrolRequest,
    binding: Option<AccountBinding>,
) -> Result<EnrolOutcome, StoreError> {
    if !is_canonical_key(&req.host_pubkey) {
        return Err(StoreError::InvalidInput(
            "a host key must be enrolled in canonical form (padded standard base64 of 32 bytes)"
                .to_owned(),
        ));
    }
    if binding
        .as_ref()
        .is_some_and(|b| b.host_pubkey != req.host_pubkey)
    {
        return Err(StoreError::InvalidInput(
            "an account binding must name the enrolling key".to_owned(),
        ));
    }
    store.submit(JobKind::Other, move |c, limits| {
        if let Some(b) = &binding {
            let taken: bool = c
                .prepare_cached(
                    "SELECT EXISTS (SELECT 1 FROM account_bindings b
                       JOIN enrolments e ON e.host_pubkey = b.host_pubkey
                     WHERE b.cloud_jkt = ?1 AND b.host_pubkey <> ?2 AND e.revoked_at IS NULL)",
                )?
                .query_row(params![b.cloud_jkt, b.host_pubkey], |r| r.get(0))?;
            if taken {
                return Ok(EnrolOutcome::CloudKeyTaken);
            }
        }
        let outcome = enrol_apply(c, limits, &req)?;
        if let (EnrolOutcome::Enrolled(_), Some(b)) = (&outcome, &binding) {
            c.prepare_cached(
                "INSERT INTO account_bindings (host_pubkey, cloud_jkt, client_id, sub, org, at)
                 VALUES (?1, ?2, ?3, ?4, ?5, ?6)
                 ON CONFLICT(host_pubkey) DO UPDATE SET cloud_jkt = excluded.cloud_jkt,
                   client_id = excluded.client_id, sub = excluded.sub, org = excluded.org,
                   at = excluded.at",
            )?
            .execute(params![
                b.host_pubkey,
                b.cloud_jkt,
                b.client_id,
                b.sub,
                b.org,
                b.at_ms
            ])?;
        }
        Ok(outcome)
    })
}

/// [`crate::store::DirectoryStore::account_binding`].
pub(super) fn account_binding(
    store: &SqliteStore,
    host_pubkey: &str,
) -> Result<Option<AccountBinding>, StoreError> {
    store.read(|c| binding_row(c, host_pubkey))
}

fn check_deny_value(value: &str) -> Result<(), StoreError> {
    if value.is_empty() || value.len() > MAX_DENY_VALUE {
        return Err(StoreError::InvalidInput(format!(
            "a deny-list value must be 1..={MAX_DENY_VALUE} bytes"
        )));
    }
    Ok(())
}

/// Adds or replaces `entry` in the caller's transaction ([`crate::store::DirectoryStore::deny`]).
fn deny_apply(c: &Connection, entry: DenyEntry) -> Result<DenyOutcome, StoreError> {
    c.prepare_cached("DELETE FROM deny WHERE until IS NOT NULL AND until <= ?1")?
        .execute([entry.at_ms])?;
    let exists: bool = c
        .prepare_cached("SELECT EXISTS (SELECT 1 FROM deny WHERE kind = ?1 AND value = ?2)")?
        .query_row(params![entry.kind.as_str(), entry.value], |r| r.get(0))?;
    if !exists {
        let n: i64 = c
            .prepare_cached("SELECT COUNT(*) FROM deny")?
            .query_row([], |r| r.get(0))?;
        if u64::try_from(n).unwrap_or(0) >= MAX_DENY_ENTRIES {
            return Ok(DenyOutcome::Full);
        }
    }
    c.prepare_cached(
        "INSERT INTO deny (kind, value, until, at) VALUES (?1, ?2, ?3, ?4)
         ON CONFLICT(kind, value) DO UPDATE SET until = excluded.until, at = excluded.at",
    )?
    .execute(params![
        entry.kind.as_str(),
        entry.value,
        entry.until_ms,
        entry.at_ms
    ])?;
    Ok(DenyOutcome::Stored(entry))
}

/// Removes an entry in the caller's transaction ([`crate::store::DirectoryStore::undeny`]).
fn undeny_apply(c: &Connection, kind: DenyKind, value: &str) -> Result<bool, StoreError> {
    let n = c
        .prepare_cached("DELETE FROM deny WHERE kind = ?1 AND value = ?2")?
        .execute(params![kind.as_str(), value])?;
    Ok(n > 0)
}

/// [`crate::store::DirectoryStore::deny`].
pub(super) fn deny(store: &SqliteStore, entry: DenyEntry) -> Result<DenyOutcome, StoreError> {
    check_deny_value(&entry.value)?;
    store.submit(JobKind::Other, move |c, _| deny_apply(c, entry))
}

/// [`crate::store::DirectoryStore::undeny`].
pub(super) fn undeny(store: &SqliteStore, kind: DenyKind, value: &str) -> Result<bool, StoreError> {
    let value = value.to_owned();
    store.submit(JobKind::Other, move |c, _| undeny_apply(c, kind, &value))
}

/// [`crate::store::DirectoryStore::revoke_logged`].
pub(super) fn revoke_logged(
    store: &SqliteStore,
    host_pubkey: &str,
    now_ms: i64,
    log: OpEntry,
) -> Result<RevokeOutcome, StoreError> {
    let receipt = op_receipt_text(&log.receipt)?;
    let key = host_pubkey.to_owned();
    store.submit(JobKind::Other, move |c, _| {
        let outcome = revoke_apply(c, &key, now_ms)?;
        if outcome == RevokeOutcome::Revoked {
            append_op_apply(c, log.at_ms, &log.op, &receipt)?;
        }
        Ok(outcome)
    })
}

/// [`crate::store::DirectoryStore::deny_logged`].
pub(super) fn deny_logged(
    store: &SqliteStore,
    entry: DenyEntry,
    log: OpEntry,
) -> Result<DenyOutcome, StoreError> {
    check_deny_value(&entry.value)?;
    let receipt = op_receipt_text(&log.receipt)?;
    store.submit(JobKind::Other, move |c, _| {
        let outcome = deny_apply(c, entry)?;
        if matches!(outcome, DenyOutcome::Stored(_)) {
            append_op_apply(c, log.at_ms, &log.op, &receipt)?;
        }
        Ok(outcome)
    })
}

/// [`crate::store::DirectoryStore::undeny_logged`].
pub(super) fn undeny_logged(
    store: &SqliteStore,
    kind: DenyKind,
    value: &str,
    log: OpEntry,
) -> Result<bool, StoreError> {
    let receipt = op_receipt_text(&log.receipt)?;
    let value = value.to_owned();
    store.submit(JobKind::Other, move |c, _| {
        let removed = undeny_apply(c, kind, &value)?;
        if removed {
            append_op_apply(c, log.at_ms, &log.op, &receipt)?;
        }
        Ok(removed)
    })
}

/// [`crate::store::DirectoryStore::deny_entries`].
pub(super) fn deny_entries(store: &SqliteStore) -> Result<Vec<DenyEntry>, StoreError> {
    store.read(|c| {
        let mut st =
            c.prepare_cached("SELECT kind, value, until, at FROM deny ORDER BY kind, value")?;
        let rows = st
            .query_map([], entry_from_row)?
            .collect::<Result<Vec<_>, _>>()?;
        Ok(rows)
    })
}

/// [`crate::store::DirectoryStore::denied`].
pub(super) fn denied(
    store: &SqliteStore,
    host_fp: &str,
    client_id: Option<&str>,
    now_ms: i64,
) -> Result<Option<DenyEntry>, StoreError> {
    store.read(|c| {
        let mut st = c.prepare_cached(
            "SELECT kind, value, until, at FROM deny
             WHERE kind = ?1 AND value = ?2 AND (until IS NULL OR until > ?3)",
        )?;
        if let Some(e) = st
            .query_row(params!["host", host_fp, now_ms], entry_from_row)
            .optional()?
        {
            return Ok(Some(e));
        }
        match client_id {
            Some(id) => Ok(st
                .query_row(params!["client", id, now_ms], entry_from_row)
                .optional()?),
            None => Ok(None),
        }
    })
}

/// [`crate::store::DirectoryStore::enrolments_by_fingerprint`].
pub(super) fn enrolments_by_fingerprint(
    store: &SqliteStore,
    fp: &str,
) -> Result<Vec<Enrolment>, StoreError> {
    store.read(|c| {
        let mut st = c.prepare_cached(&format!(
            "SELECT {ENROLMENT_COLS} FROM enrolments ORDER BY enrolled_at, host_pubkey"
        ))?;
        let mut out = Vec::new();
        for row in st.query_map([], enrolment_from_row)? {
            let e = row?;
            if key_fingerprint(&e.host_pubkey) == fp {
                out.push(e);
            }
        }
        Ok(out)
    })
}

#[cfg(test)]
mod tests;
