//! The SQLite steps of a restore (spec §5 "Restore from backup"; the rules and their order are
//! `ops::restore`'s): checking a staged backup copy (an SQLite database that passes its
//! integrity check, of a schema this binary knows whose objects are exactly that schema's, with
//! an epoch and a relay key), reading what the current store carries forward in one read
//! transaction and keeping an online copy of it, opening the copy for the restore's one
//! transaction ([`Staged`], the carry-forward primitives), and the file swap.
//!
//! # What it must never do
//! - Decide what is carried: each primitive applies one row under the condition its trait doc
//!   names (`store::maintenance::StagedStore`).
//! - Touch the live `relay.db` before [`swap_in`]; write the backup file.

use std::path::Path;

use rusqlite::{params, Connection, OpenFlags};
use serde_json::{Map, Value};

use super::backup::{counts, fsync, integrity, io, meta_get, online_copy, sql, with_suffix};
use super::status::{has_table, restored_paths};
use crate::store::maintenance::{
    AppliedRotation, BackupFacts, CarryForward, MaintenanceError, RevokedHost, StagedStore,
    StoreCounts, StoredDeny, StoredOp, StoredSenderList, TakeFailure, TakenStore,
};
use crate::store::{
    append_op_signed, migrate, rebuild_usage, replay_rotation, stored_version, AccountBinding,
    EncAdV1, EncAdV2, OpSigner, RotateOutcome, StoreError, MIGRATIONS, ROTATION_META_PREFIX,
    SCHEMA_VERSION,
};

mod schema_check;
#[cfg(test)]
mod tests;

/// Whether `e` says the file is not an SQLite database or is damaged (`SQLITE_NOTADB`,
/// `SQLITE_CORRUPT`): a backup in that state is not a relay store.
fn is_not_a_database(e: &rusqlite::Error) -> bool {
    matches!(
        e.sqlite_error_code(),
        Some(rusqlite::ErrorCode::NotADatabase | rusqlite::ErrorCode::DatabaseCorrupt)
    )
}

/// Opens a read-only connection to `db` with a 5 s busy timeout.
fn read_only(db: &Path) -> rusqlite::Result<Connection> {
    let c = Connection::open_with_flags(
        db,
        OpenFlags::SQLITE_OPEN_READ_ONLY | OpenFlags::SQLITE_OPEN_NO_MUTEX,
    )?;
    c.busy_timeout(std::time::Duration::from_secs(5))?;
    Ok(c)
}

/// Every path the store `db` was restored from; `None` when it has no `meta` table.
pub(crate) fn restored_paths_of(db: &Path) -> Result<Option<Map<String, Value>>, StoreError> {
    let c = read_only(db)?;
    if !has_table(&c, "meta")? {
        return Ok(None);
    }
    Ok(Some(restored_paths(&c)?))
}

/// The heartbeat of `db` when it can be read.
pub(crate) fn heartbeat(db: &Path) -> Option<i64> {
    Connection::open_with_flags(
        db,
        OpenFlags::SQLITE_OPEN_READ_ONLY | OpenFlags::SQLITE_OPEN_NO_MUTEX,
    )
    .ok()
    .and_then(|c| meta_get(&c, "heartbeat").ok().flatten())
    .and_then(|v| v.trim().parse::<i64>().ok())
}

/// Opens the copy at `path` read-write and switches it to the rollback journal (folding a WAL
/// in), so the file alone is the whole store. Errors: SQLite errors (not a database…).
fn seal(path: &Path) -> rusqlite::Result<Connection> {
    let c = Connection::open(path)?;
    c.busy_timeout(std::time::Duration::from_secs(5))?;
    let _mode: String = c.query_row("PRAGMA journal_mode = DELETE", [], |r| r.get(0))?;
    Ok(c)
}

/// Checks the staged backup copy at `tmp`: an SQLite database that passes its integrity check,
/// of a schema this binary knows, whose objects are exactly that schema's
/// ([`schema_check::difference`]), with an epoch and a relay key.
pub(crate) fn check_staged(tmp: &Path) -> Result<BackupFacts, MaintenanceError> {
    let not_a_store = MaintenanceError::NotAStore;
    let sqlite = |e: rusqlite::Error| {
        if is_not_a_database(&e) {
            not_a_store(format!("not an SQLite database, or a damaged one: {e}"))
        } else {
            sql(e)
        }
    };
    let c = seal(tmp).map_err(sqlite)?;
    match integrity(&c) {
        Err(MaintenanceError::Store(StoreError::Sqlite(e))) => return Err(sqlite(e)),
        Err(MaintenanceError::Integrity(problems)) => {
            return Err(not_a_store(format!(
                "it fails its integrity check: {problems}"
            )))
        }
        other => other?,
    }
    if !has_table(&c, "meta").map_err(sqlite)? {
        return Err(not_a_store("no meta table".into()));
    }
    let schema_version = match stored_version(&c) {
        Ok(v) => v,
        Err(StoreError::Sqlite(e)) => return Err(sqlite(e)),
        Err(e) => return Err(not_a_store(e.to_string())),
    };
    if schema_version > SCHEMA_VERSION {
        return Err(MaintenanceError::SchemaTooNew {
            found: schema_version,
            supported: SCHEMA_VERSION,
        });
    }
    let bad_meta = |e: rusqlite::Error| match sqlite(e) {
        MaintenanceError::NotAStore(reason) => MaintenanceError::NotAStore(reason),
        _ => not_a_store("its meta table is not a relay store's".into()),
    };
    let (Some(epoch), Some(relay_pubkey)) = (
        meta_get(&c, "epoch").map_err(bad_meta)?,
        meta_get(&c, "relay_pubkey").map_err(bad_meta)?,
    ) else {
        return Err(not_a_store("no epoch or relay key".into()));
    };
    if let Some(difference) = schema_check::difference(&c, schema_version)? {
        return Err(not_a_store(format!(
            "its schema is not this agentmbx's relay store schema {schema_version}: {difference}"
        )));
    }
    if agentmbx_protocol::keys::PublicKey::from_b64(&relay_pubkey).is_err() {
        return Err(not_a_store(
            "its meta.relay_pubkey is not a public key".into(),
        ));
    }
    let heartbeat_ms = meta_get(&c, "heartbeat")
        .map_err(sqlite)?
        .and_then(|v| v.trim().parse::<i64>().ok());
    Ok(BackupFacts {
        epoch,
        relay_pubkey,
        schema_version,
        heartbeat_ms,
    })
}

/// Rows of `sql` mapped with `f`.
fn rows<T>(
    c: &Connection,
    sql: &str,
    f: impl FnMut(&rusqlite::Row<'_>) -> rusqlite::Result<T>,
) -> rusqlite::Result<Vec<T>> {
    let mut st = c.prepare(sql)?;
    let out = st.query_map([], f)?.collect::<Result<Vec<_>, _>>()?;
    Ok(out)
}

/// What the current store carries forward, read in one read transaction.
fn read_current(c: &Connection) -> rusqlite::Result<CarryForward> {
    let tx = c.unchecked_transaction()?;
    let deny = if has_table(&tx, "deny")? {
        rows(&tx, "SELECT kind, value, until, at FROM deny", |r| {
            Ok(StoredDeny {
                kind: r.get(0)?,
                value: r.get(1)?,
                until_ms: r.get(2)?,
                at_ms: r.get(3)?,
            })
        })?
    } else {
        Vec::new()
    };
    let bindings = if has_table(&tx, "account_bindings")? {
        rows(
            &tx,
            "SELECT host_pubkey, cloud_jkt, client_id, sub, org, at FROM account_bindings",
            |r| {
                Ok(AccountBinding {
                    host_pubkey: r.get(0)?,
                    cloud_jkt: r.get(1)?,
                    client_id: r.get(2)?,
                    sub: r.get(3)?,
                    org: r.get(4)?,
                    at_ms: r.get(5)?,
                })
            },
        )?
    } else {
        Vec::new()
    };
    let current = CarryForward {
        relay_pubkey: meta_get(&tx, "relay_pubkey")?,
        revoked: rows(
            &tx,
            "SELECT host_pubkey, host_name, owner_fp, account, authorized_by, authority_rank,
                    enrolled_at, revoked_at
               FROM enrolments WHERE revoked_at IS NOT NULL",
            |r| {
                Ok(RevokedHost {
                    host_pubkey: r.get(0)?,
                    host_name: r.get(1)?,
                    owner_fp: r.get(2)?,
                    account: r.get(3)?,
                    authorized_by: r.get(4)?,
                    authority_rank: r.get(5)?,
                    enrolled_at_ms: r.get(6)?,
                    revoked_at_ms: r.get(7)?,
                })
            },
        )?,
        sender_lists: rows(
            &tx,
            "SELECT target_pubkey, senders, iat, record, sig FROM sender_lists",
            |r| {
                Ok(StoredSenderList {
                    target_pubkey: r.get(0)?,
                    senders: r.get(1)?,
                    iat_ms: r.get(2)?,
                    record: r.get(3)?,
                    sig: r.get(4)?,
                })
            },
        )?,
        enc_ads: rows(
            &tx,
            "SELECT host_pubkey, host_name, enc_pub, sig, at FROM enc_ads",
            |r| {
                Ok(EncAdV1 {
                    host_pubkey: r.get(0)?,
                    host_name: r.get(1)?,
                    enc_pub: r.get(2)?,
                    sig: r.get(3)?,
                    at_ms: r.get(4)?,
                })
            },
        )?,
        enc_ad_records: rows(
            &tx,
            "SELECT host_pubkey, enc_pub, record, sig, at FROM enc_ad_records",
            |r| {
                Ok(EncAdV2 {
                    host_pubkey: r.get(0)?,
                    enc_pub: r.get(1)?,
                    record: r.get(2)?,
                    sig: r.get(3)?,
                    at_ms: r.get(4)?,
                })
            },
        )?,
        seq_floors: rows(&tx, "SELECT target_pubkey, next_seq FROM seqs", |r| {
            Ok((r.get(0)?, r.get(1)?))
        })?,
        deny,
        bindings,
        ops: rows(
            &tx,
            "SELECT id, at, op, receipt FROM ops ORDER BY id",
            |r| {
                Ok(StoredOp {
                    id: r.get(0)?,
                    at_ms: r.get(1)?,
                    op: r.get(2)?,
                    receipt: Some(r.get(3)?),
                })
            },
        )?,
        rotations: rotations(&tx)?,
        restored_paths: restored_paths(&tx)?,
    };
    tx.commit()?;
    Ok(current)
}

/// The rotation markers of `c` (`meta.rotation:<old>` → new key, `store/sqlite/rotate.rs`),
/// in the order they were applied: by the old key's revocation time.
fn rotations(c: &Connection) -> rusqlite::Result<Vec<AppliedRotation>> {
    let from = ROTATION_META_PREFIX.len() + 1;
    let mut st = c.prepare(&format!(
        "SELECT substr(m.k, {from}), m.v, e.revoked_at FROM meta m
           LEFT JOIN enrolments e ON e.host_pubkey = substr(m.k, {from})
          WHERE substr(m.k, 1, {len}) = ?1
          ORDER BY e.revoked_at IS NULL, e.revoked_at, m.k",
        len = ROTATION_META_PREFIX.len()
    ))?;
    let out = st
        .query_map([ROTATION_META_PREFIX], |r| {
            Ok(AppliedRotation {
                old_key: r.get(0)?,
                new_key: r.get(1)?,
                at_ms: r.get(2)?,
            })
        })?
        .collect::<Result<Vec<_>, _>>()?;
    Ok(out)
}

/// Checks and reads the current store `live`, and (when it is bound to `backup_key` too)
/// copies it online to `rollback`. Only a failure to read it is [`TakeFailure::Unreadable`].
pub(crate) fn take_current(
    live: &Path,
    rollback: &Path,
    backup_key: &str,
) -> Result<TakenStore, TakeFailure> {
    let text = |e: rusqlite::Error| TakeFailure::Unreadable(e.to_string());
    let c = Connection::open_with_flags(
        live,
        OpenFlags::SQLITE_OPEN_READ_WRITE | OpenFlags::SQLITE_OPEN_NO_MUTEX,
    )
    .map_err(text)?;
    c.busy_timeout(std::time::Duration::from_secs(5))
        .map_err(text)?;
    // A newer agentmbx's store is never downgraded, readable or not by this binary.
    let version: Option<i64> = c.query_row("PRAGMA user_version", [], |r| r.get(0)).ok();
    let meta_version = if has_table(&c, "meta").unwrap_or(false) {
        meta_get(&c, "schema_version")
            .ok()
            .flatten()
            .and_then(|v| v.trim().parse::<i64>().ok())
    } else {
        None
    };
    let found = version.max(meta_version).unwrap_or(0);
    if found > i64::from(SCHEMA_VERSION) {
        return Err(TakeFailure::SchemaTooNew(
            u32::try_from(found).unwrap_or(u32::MAX),
        ));
    }
    let ok: String = c
        .query_row("PRAGMA quick_check", [], |r| r.get(0))
        .map_err(text)?;
    if ok != "ok" {
        return Err(TakeFailure::Unreadable(format!("integrity: {ok}")));
    }
    let current = read_current(&c).map_err(text)?;
    if let Some(key) = current.relay_pubkey.as_deref().filter(|k| *k != backup_key) {
        return Ok(TakenStore::OtherKey(key.to_owned()));
    }
    let facts = online_copy(&c, rollback, None).map_err(|e| match e {
        // Reading the current store's pages failed: it cannot be read after all.
        MaintenanceError::Integrity(reason) => TakeFailure::Unreadable(reason),
        MaintenanceError::Store(StoreError::Sqlite(e)) if is_not_a_database(&e) => {
            TakeFailure::Unreadable(e.to_string())
        }
        // Writing the copy failed: nothing about the current store.
        e => TakeFailure::Failed(e),
    })?;
    Ok(TakenStore::Read(Box::new(current), facts.epoch))
}

/// The `restored_paths` of a store that cannot be read as a whole, when that much of it can
/// be read (so a `--force` restore keeps the lineage's record of consumed paths).
pub(crate) fn salvage_restored_paths(live: &Path) -> Map<String, Value> {
    Connection::open_with_flags(
        live,
        OpenFlags::SQLITE_OPEN_READ_ONLY | OpenFlags::SQLITE_OPEN_NO_MUTEX,
    )
    .ok()
    .and_then(|c| restored_paths(&c).ok())
    .unwrap_or_default()
}

/// Copies `src` to the new file `dest` (0600; an existing `dest` is an error).
pub(crate) fn copy_new(src: &Path, dest: &Path) -> Result<(), MaintenanceError> {
    use std::os::unix::fs::OpenOptionsExt as _;
    let mut from = std::fs::File::open(src).map_err(io(src))?;
    let mut to = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(dest)
        .map_err(io(dest))?;
    std::io::copy(&mut from, &mut to).map_err(io(dest))?;
    to.sync_all().map_err(io(dest))?;
    Ok(())
}

/// Copies a backup file `src` to the new working copy `tmp` (0600), with its `-wal` if any (a
/// raw volume copy: its WAL is folded in when the copy is checked).
pub(crate) fn stage(src: &Path, tmp: &Path) -> Result<(), MaintenanceError> {
    copy_new(src, tmp)?;
    let src_wal = with_suffix(src, "-wal");
    if src_wal.is_file() {
        copy_new(&src_wal, &with_suffix(tmp, "-wal"))?;
    }
    Ok(())
}

/// `--force` for a store that cannot be read: its files as they are, into `rollback` (+
/// `-wal`, `-shm`), 0600. Each is written under a `.partial-<pid>` name and renamed once all
/// are complete, so a failure never leaves a file under a rollback name.
pub(crate) fn keep_unreadable(live: &Path, rollback: &Path) -> Result<(), MaintenanceError> {
    let partial = format!(".partial-{}", std::process::id());
    let mut made: Vec<(std::path::PathBuf, std::path::PathBuf)> = Vec::new();
    let result = (|| -> Result<(), MaintenanceError> {
        for suffix in ["", "-wal", "-shm"] {
            let from = with_suffix(live, suffix);
            if from.symlink_metadata().is_ok() {
                let to = with_suffix(rollback, suffix);
                let tmp = with_suffix(&to, &partial);
                let _ = std::fs::remove_file(&tmp);
                made.push((tmp.clone(), to));
                copy_new(&from, &tmp)?;
            }
        }
        for (tmp, to) in &made {
            if to.symlink_metadata().is_ok() {
                return Err(MaintenanceError::Exists(to.clone()));
            }
            std::fs::rename(tmp, to).map_err(io(to))?;
        }
        if let Some(parent) = rollback.parent() {
            fsync(parent)?;
        }
        Ok(())
    })();
    if let Err(e) = result {
        for (tmp, to) in &made {
            let _ = std::fs::remove_file(tmp);
            let _ = std::fs::remove_file(to);
        }
        return Err(e);
    }
    Ok(())
}

/// The staged copy inside the restore's one transaction (`BEGIN IMMEDIATE` … `COMMIT`).
pub(crate) struct Staged {
    c: Connection,
    path: std::path::PathBuf,
}

/// Opens the staged copy at `tmp`: sealed, migrated from an older schema (a migration keeps
/// the epoch), the transaction begun, the usage counters recomputed from its items.
pub(crate) fn open_staged(tmp: &Path) -> Result<Staged, MaintenanceError> {
    let mut c = seal(tmp).map_err(sql)?;
    let found = stored_version(&c)?;
    migrate(&mut c, found, SCHEMA_VERSION, MIGRATIONS)?;
    c.execute_batch("BEGIN IMMEDIATE").map_err(sql)?;
    rebuild_usage(&c)?;
    Ok(Staged {
        c,
        path: tmp.to_path_buf(),
    })
}

impl StagedStore for Staged {
    fn meta(&self, key: &str) -> Result<Option<String>, StoreError> {
        Ok(meta_get(&self.c, key)?)
    }

    fn set_meta(&self, key: &str, value: &str) -> Result<(), StoreError> {
        self.c.execute(
            "INSERT INTO meta (k, v) VALUES (?1, ?2) ON CONFLICT(k) DO UPDATE SET v = excluded.v",
            [key, value],
        )?;
        Ok(())
    }

    fn restored_paths(&self) -> Result<Map<String, Value>, StoreError> {
        Ok(restored_paths(&self.c)?)
    }

    fn carry_seq_floor(&self, target: &str, next_seq: i64) -> Result<bool, StoreError> {
        Ok(self.c.execute(
            "INSERT INTO seqs (target_pubkey, next_seq) VALUES (?1, ?2)
             ON CONFLICT(target_pubkey) DO UPDATE SET next_seq = excluded.next_seq
               WHERE excluded.next_seq > seqs.next_seq",
            params![target, next_seq],
        )? > 0)
    }

    fn replay_rotation(
        &self,
        old_key: &str,
        new_key: &str,
        at_ms: i64,
    ) -> Result<RotateOutcome, StoreError> {
        replay_rotation(&self.c, old_key, new_key, at_ms)
    }

    fn carry_rotation_marker(&self, old_key: &str, new_key: &str) -> Result<(), StoreError> {
        self.c.execute(
            "INSERT INTO meta (k, v)
             SELECT ?1, ?2 WHERE EXISTS (SELECT 1 FROM enrolments WHERE host_pubkey = ?3)
             ON CONFLICT(k) DO NOTHING",
            [
                format!("{ROTATION_META_PREFIX}{old_key}"),
                new_key.to_owned(),
                old_key.to_owned(),
            ],
        )?;
        Ok(())
    }

    fn carry_revocation(&self, h: &RevokedHost) -> Result<bool, StoreError> {
        Ok(self.c.execute(
            "INSERT INTO enrolments (host_pubkey, host_name, owner_fp, account, authorized_by,
                                     authority_rank, enrolled_at, revoked_at)
             VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8)
             ON CONFLICT(host_pubkey) DO UPDATE SET revoked_at = excluded.revoked_at
               WHERE enrolments.revoked_at IS NULL",
            params![
                h.host_pubkey,
                h.host_name,
                h.owner_fp,
                h.account,
                h.authorized_by,
                h.authority_rank,
                h.enrolled_at_ms,
                h.revoked_at_ms
            ],
        )? > 0)
    }

    fn carry_sender_list(&self, l: &StoredSenderList) -> Result<bool, StoreError> {
        Ok(self.c.execute(
            "INSERT INTO sender_lists (target_pubkey, senders, iat, record, sig)
             VALUES (?1, ?2, ?3, ?4, ?5)
             ON CONFLICT(target_pubkey) DO UPDATE SET senders = excluded.senders,
               iat = excluded.iat, record = excluded.record, sig = excluded.sig
               WHERE excluded.iat > sender_lists.iat",
            params![l.target_pubkey, l.senders, l.iat_ms, l.record, l.sig],
        )? > 0)
    }

    fn carry_enc_ad(&self, a: &EncAdV1) -> Result<bool, StoreError> {
        Ok(self.c.execute(
            "INSERT INTO enc_ads (host_pubkey, host_name, enc_pub, sig, at)
             VALUES (?1, ?2, ?3, ?4, ?5)
             ON CONFLICT(host_pubkey) DO UPDATE SET host_name = excluded.host_name,
               enc_pub = excluded.enc_pub, sig = excluded.sig, at = excluded.at
               WHERE excluded.at > enc_ads.at",
            params![a.host_pubkey, a.host_name, a.enc_pub, a.sig, a.at_ms],
        )? > 0)
    }

    fn carry_enc_ad_record(&self, a: &EncAdV2) -> Result<bool, StoreError> {
        Ok(self.c.execute(
            "INSERT INTO enc_ad_records (host_pubkey, enc_pub, record, sig, at)
             VALUES (?1, ?2, ?3, ?4, ?5)
             ON CONFLICT(host_pubkey) DO UPDATE SET enc_pub = excluded.enc_pub,
               record = excluded.record, sig = excluded.sig, at = excluded.at
               WHERE excluded.at > enc_ad_records.at",
            params![a.host_pubkey, a.enc_pub, a.record, a.sig, a.at_ms],
        )? > 0)
    }

    fn carry_deny(&self, d: &StoredDeny) -> Result<bool, StoreError> {
        if !has_table(&self.c, "deny")? {
            return Ok(false);
        }
        Ok(self.c.execute(
            "INSERT INTO deny (kind, value, until, at) VALUES (?1, ?2, ?3, ?4)
             ON CONFLICT(kind, value) DO UPDATE SET until = excluded.until, at = excluded.at
               WHERE excluded.at > deny.at",
            params![d.kind, d.value, d.until_ms, d.at_ms],
        )? > 0)
    }

    fn carry_binding(&self, b: &AccountBinding) -> Result<bool, StoreError> {
        if !has_table(&self.c, "account_bindings")? {
            return Ok(false);
        }
        Ok(self.c.execute(
            "INSERT INTO account_bindings (host_pubkey, cloud_jkt, client_id, sub, org, at)
             SELECT ?1, ?2, ?3, ?4, ?5, ?6
              WHERE EXISTS (SELECT 1 FROM enrolments WHERE host_pubkey = ?1)
             ON CONFLICT(host_pubkey) DO UPDATE SET cloud_jkt = excluded.cloud_jkt,
               client_id = excluded.client_id, sub = excluded.sub, org = excluded.org,
               at = excluded.at
               WHERE excluded.at > account_bindings.at",
            params![
                b.host_pubkey,
                b.cloud_jkt,
                b.client_id,
                b.sub,
                b.org,
                b.at_ms
            ],
        )? > 0)
    }

    fn replace_op_log(&self, ops: &[StoredOp]) -> Result<usize, StoreError> {
        self.c.execute("DELETE FROM ops", [])?;
        let mut st = self
            .c
            .prepare("INSERT INTO ops (id, at, op, receipt) VALUES (?1, ?2, ?3, ?4)")?;
        let mut n = 0;
        for o in ops {
            n += st.execute(params![o.id, o.at_ms, o.op, o.receipt])?;
        }
        Ok(n)
    }

    fn counts(&self) -> Result<StoreCounts, StoreError> {
        counts(&self.c)
    }

    fn append_op(
        &self,
        signer: Option<&dyn OpSigner>,
        at_ms: i64,
        op: &str,
        receipt: &str,
    ) -> Result<String, StoreError> {
        Ok(append_op_signed(&self.c, signer, at_ms, op, receipt)?.1)
    }

    fn commit(self: Box<Self>) -> Result<(), MaintenanceError> {
        let Staged { c, path } = *self;
        c.execute_batch("COMMIT").map_err(sql)?;
        integrity(&c)?;
        c.close().map_err(|(_, e)| sql(e))?;
        let leftover_wal = with_suffix(&path, "-wal");
        if leftover_wal.metadata().is_ok_and(|m| m.len() > 0) {
            return Err(MaintenanceError::Integrity(format!(
                "the restored copy did not close cleanly ({} remains); the live store was not touched",
                leftover_wal.display()
            )));
        }
        fsync(&path)
    }
}

/// The swap: the copy fsynced, the old store's `-wal` (kept beside `rollback` as
/// `-wal-leftover` when not empty) and `-shm` moved away so they never meet the new file, the
/// copy renamed over `live`, the directory fsynced.
pub(crate) fn swap_in(tmp: &Path, live: &Path, rollback: &Path) -> Result<(), MaintenanceError> {
    for suffix in ["-wal", "-shm", "-journal"] {
        let old = with_suffix(live, suffix);
        let Ok(meta) = old.metadata() else { continue };
        if suffix == "-wal" && meta.len() > 0 {
            if let Some(dir) = rollback.parent() {
                private_dir(dir)?;
            }
            let kept = with_suffix(rollback, "-wal-leftover");
            std::fs::rename(&old, &kept).map_err(io(&kept))?;
        } else {
            std::fs::remove_file(&old).map_err(io(&old))?;
        }
    }
    std::fs::rename(tmp, live).map_err(io(live))?;
    fsync(live.parent().unwrap_or(Path::new("/")))?;
    Ok(())
}

/// Creates `dir` 0700 (with missing parents) when it does not exist.
pub(crate) fn private_dir(dir: &Path) -> Result<(), MaintenanceError> {
    use std::os::unix::fs::DirBuilderExt as _;
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)
        .map_err(io(dir))
}
