//! `relay restore <file> [--force]` and `MBX_RELAY_RESTORE_FROM` (spec §5 "Restore from
//! backup"; `wire.md` §3.4 "relay restore"): replace a relay store with a backup, atomically,
//! while no relay runs on it, without bringing back anything the live store had taken away.
//!
//! # What it owns
//! The steps of [`restore`], in order:
//! 1. **Refusals.** `relay.lock` is taken without waiting (or the caller already holds it:
//!    `relay serve` with `MBX_RELAY_RESTORE_FROM`); held by another process → `RELAY_RUNNING`.
//!    A store without a `relay.lock` file whose heartbeat is less than [`LIVE_HEARTBEAT_MS`]
//!    (90 s) old may have a relay from before the lock (or one whose lock file was deleted) on
//!    it → `RELAY_RUNNING` unless `--force` (`relay serve` and the offline writers make the same
//!    check when they take the lock, [`StoreLock::acquire`]).
//! 2. **The backup, copied and checked** (the file given is never written, nor removed; a
//!    path that is not a regular file → `NO_BACKUP` saying so): copied with its `-wal` if any
//!    beside the live store (`relay.db.restore-<stamp>`, 0600), switched to the rollback
//!    journal (a WAL folded in), `integrity_check`; not SQLite, damaged, or no `meta.epoch` or
//!    `meta.relay_pubkey` → `NOT_A_STORE` naming the file; a newer schema → `SCHEMA`; a schema
//!    whose objects (every table, index, trigger and view of `sqlite_master`, by type, name and
//!    SQL with whitespace runs collapsed) are not exactly those this binary's migrations give
//!    its version — an extra object (a trigger or a view included), one of ours with another
//!    definition (a trigger with another body), a missing one — → `NOT_A_STORE` naming the
//!    object (a backup is untrusted input: a trigger runs inside the carry-forward and stays in
//!    the live schema, so only the schema's own usage-counter triggers pass, word for word);
//!    another relay key than the relay's (and the current store's) → `OTHER_RELAY`.
//! 3. **The current store**: a newer schema → `SCHEMA` (never downgraded, `--force` or not);
//!    `quick_check`, its authority read in one read transaction, and an online copy kept as
//!    `rollback/relay-<stamp>.db` (0600 in a 0700 directory; written as `.partial-<pid>` and
//!    linked to its name once complete). When it cannot be read → `CURRENT_UNREADABLE`, unless
//!    `--force`: then its files are copied as they are into `rollback/` (again through partial
//!    names) and nothing is carried forward but its `restored_paths` when those can be read. A
//!    failure writing the rollback copy (a full disk…) is a plain failure that changes nothing,
//!    never `CURRENT_UNREADABLE`. A `relay.db` that is not a regular file is refused.
//! 4. **On the copy, in one transaction**: an older schema migrated first (a migration keeps the
//!    epoch); the usage counters recomputed from the backup's items (derived data a backup
//!    could hold wrong; the schema's triggers keep them from there on); then carried forward
//!    from the current store: the higher seq floors; every host
//!    key rotation made after the backup (a `meta.rotation:<old>` marker the backup lacks),
//!    replayed with the store's own rotation code at its time, so the new key holds the
//!    enrolment (name, account, `authorized_by`; enrolled even if the backup never saw it —
//!    the marker is the relay's record of a rotation it verified), the old key's queue in the
//!    backup, its allowlist and its place in the other targets' allowlists, and the old key is
//!    revoked (a host never announces a rotation twice, and the relay answers 404 for its old
//!    key); every revocation; the newer sender allowlists (`iat`), enc-key ads and v2 ad
//!    records (`at`), the active deny-list entries and the account bindings of enrolled keys
//!    where the backup lacks newer ones; and the op log (the operator's history continues; the
//!    backup's own log is older). Enrolments made after the backup are never carried: those
//!    hosts re-enrol (spec §8); a rotated key is not such an enrolment.
//!    The epoch rotates, the heartbeat is now (so `serve` does not rotate again for the
//!    backup's age), `meta.restored` records `{at, file, sha256, from, to}`,
//!    `meta.restored_paths` every path this store lineage was restored from, and the signed
//!    `relay-restore` receipt is appended.
//! 5. **The swap** (failpoint `restore:before-rename` just before it): the copy is checked
//!    again and fsynced, the old store's `-wal` (kept in `rollback/` when not empty) and `-shm`
//!    are moved away so they never meet the new file, the copy is renamed over `relay.db`, and
//!    the directory is fsynced. A failure before the rename leaves the live store as it was and
//!    removes the copy and this restore's rollback copy; a crash leaves them, and the next
//!    restore removes the working copies (only names of the exact `relay.db.restore-<stamp>`
//!    form, never the backup being restored) and the `rollback/*.partial-<pid>` files whose
//!    process is gone.
//!
//! The steps that depend on how a backend keeps its files (staging and checking the backup,
//! reading and keeping the current store, the transaction on the copy, the swap) go through
//! [`StoreMaintenance`] and [`StagedStore`](crate::store::maintenance::StagedStore)
//! (`store/sqlite/restore.rs` for SQLite); what is carried forward, and in which order, is
//! written once against them (`restore/carry.rs`).
//!
//! # What it must never do
//! - Replace a store a running relay holds, or write the backup file.
//! - Carry forward anything that gives authority back (a post-backup enrolment) or bring back
//!   what the live store took away (a revocation, a deny-list entry).
//! - Print key material: it handles public keys, sealed items and routing metadata only.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use serde_json::{json, Map, Value};

use agentmbx_protocol::keys::PublicKey;
use agentmbx_protocol::time::iso_ms;

use super::{absolute, backend, io, sha256_file, store_db, OpsError};
use crate::store::maintenance::{
    Carried, CarryForward, MaintenanceError, StoreMaintenance, TakeFailure, TakenStore,
};
use crate::store::{OpSigner, StoreError, StoreLock, DB_FILE, LOCK_FILE, SCHEMA_VERSION};

mod carry;

/// Relay-log operation name (and receipt `type`) of a restore.
pub const OP_RESTORE: &str = "relay-restore";

/// A heartbeat younger than this (ms) on a store without `relay.lock` means a relay may still
/// be running on it: 90 s, three heartbeat periods (`wire.md` §3.4).
pub const LIVE_HEARTBEAT_MS: i64 = 90_000;

/// Environment variable naming a backup `relay serve` restores at start, under its lock, once
/// per path (`wire.md` §3.4).
pub const RESTORE_FROM_ENV: &str = "MBX_RELAY_RESTORE_FROM";

/// Directory inside the store directory that keeps the stores restores replaced.
pub const ROLLBACK_DIR: &str = "rollback";

/// The receipt's `next`: what happens once the relay serves the restored store.
const NEXT: &str = "start the relay: clients see the new epoch, senders re-push every message \
the relay accepted and the recipient has not confirmed, receivers re-pull from 0, and dedup on \
both ends absorbs the repeats";

/// How [`restore`] runs.
#[derive(Debug, Clone)]
pub struct RestoreOptions {
    /// Restore although the current store cannot be read (nothing of it is then carried
    /// forward; its files are kept in `rollback/`), and although a lock-less store has a fresh
    /// heartbeat.
    pub force: bool,
    /// Now, in Unix ms (the receipt's `at`, the new heartbeat, the rollback file's stamp).
    pub now_ms: i64,
    /// The relay key: signs the receipt, and the backup must be of this relay's store. `None`
    /// (an offline restore where neither `MBX_RELAY_KEY` nor `relay.key` is available): the
    /// receipt is logged unsigned (`relay log` marks it NOT VERIFIED) and the backup is
    /// checked against the current store's relay key only (a store without one takes the
    /// backup's; `relay serve` still refuses to open it with another key).
    pub signer: Option<Arc<dyn OpSigner>>,
}

/// Why a restore changed nothing. The Display text starts with the code `wire.md` §3.4 names.
#[derive(Debug, thiserror::Error)]
pub enum RestoreError {
    /// The backup file does not exist.
    #[error("NO_BACKUP: no backup at {}", .0.display())]
    NoBackup(PathBuf),
    /// The path given exists but is not a regular file (a directory, a fifo, a device, a
    /// dangling symlink).
    #[error("NO_BACKUP: {} is not a regular file (a directory, fifo, device or dangling symlink): give the backup file itself", .0.display())]
    NotAFile(PathBuf),
    /// The file given is the live store itself.
    #[error("SAME_FILE: {} is the live store itself; restore a backup file", .0.display())]
    SameFile(PathBuf),
    /// A relay (or another operator command) holds `relay.lock`.
    #[error("RELAY_RUNNING: a relay is running on {} (it holds relay.lock): stop it first; a restore never replaces a store under a running relay", .0.display())]
    RelayRunning(PathBuf),
    /// A store without `relay.lock` has a heartbeat less than 90 s old.
    #[error("RELAY_RUNNING: a relay wrote a heartbeat {age_s} s ago and this store has no relay.lock (a relay may still be running on it): stop it and retry after 90 s, or pass --force if it is stopped")]
    FreshHeartbeat {
        /// The heartbeat's age in seconds (negative: in the future).
        age_s: i64,
    },
    /// The file is not a relay store (not SQLite, no epoch, no relay key).
    #[error("NOT_A_STORE: {} is not a relay store ({reason})", file.display())]
    NotAStore {
        /// The backup file.
        file: PathBuf,
        /// What is missing.
        reason: String,
    },
    /// The backup has a newer schema than this binary.
    #[error("SCHEMA: {} has relay store schema {found}, newer than this agentmbx ({supported}): upgrade agentmbx first", file.display())]
    Schema {
        /// The backup file.
        file: PathBuf,
        /// Its schema version.
        found: u32,
        /// The newest this binary knows.
        supported: u32,
    },
    /// The current store was written by a newer agentmbx (a newer schema): replacing it would
    /// be a downgrade that loses what that version keeps. Never overridden by `--force`.
    #[error("SCHEMA: the current store {} has relay store schema {found}, newer than this agentmbx ({supported}): this store was written by a newer agentmbx; upgrade first", file.display())]
    CurrentSchema {
        /// The live `relay.db`.
        file: PathBuf,
        /// Its schema version.
        found: u32,
        /// The newest this binary knows.
        supported: u32,
    },
    /// The backup belongs to another relay key than the store's or the relay's.
    #[error("OTHER_RELAY: this backup belongs to another relay key ({backup}; {against} is {other}): clients pinned this relay's key")]
    OtherRelay {
        /// Fingerprint of the backup's relay key.
        backup: String,
        /// What it was compared with: `the store` or `the relay key`.
        against: &'static str,
        /// That key's fingerprint.
        other: String,
    },
    /// The current store cannot be read, so its authority cannot be carried forward.
    #[error("CURRENT_UNREADABLE: the current store cannot be read ({reason}): its revocations, deny-list and op log cannot be carried forward. Pass --force to restore without them; the current files are then kept in {}", rollback_dir.display())]
    CurrentUnreadable {
        /// Why.
        reason: String,
        /// Where `--force` keeps the current files.
        rollback_dir: PathBuf,
    },
    /// Anything else (I/O, SQLite, integrity of the backup copy…).
    #[error(transparent)]
    Ops(#[from] OpsError),
}

impl From<StoreError> for RestoreError {
    fn from(e: StoreError) -> Self {
        Self::Ops(OpsError::Store(e))
    }
}

impl RestoreError {
    /// The code: `NO_BACKUP`, `SAME_FILE`, `RELAY_RUNNING`, `NOT_A_STORE`, `SCHEMA`,
    /// `OTHER_RELAY`, `CURRENT_UNREADABLE`, or `FAILED` for anything else.
    pub fn code(&self) -> &'static str {
        match self {
            Self::NoBackup(_) | Self::NotAFile(_) => "NO_BACKUP",
            Self::SameFile(_) => "SAME_FILE",
            Self::RelayRunning(_) | Self::FreshHeartbeat { .. } => "RELAY_RUNNING",
            Self::NotAStore { .. } => "NOT_A_STORE",
            Self::Schema { .. } | Self::CurrentSchema { .. } => "SCHEMA",
            Self::OtherRelay { .. } => "OTHER_RELAY",
            Self::CurrentUnreadable { .. } => "CURRENT_UNREADABLE",
            Self::Ops(_) => "FAILED",
        }
    }
}

impl RestoreError {
    /// A maintenance failure about the backup file `file`: `NOT_A_STORE`, `SCHEMA`, or a plain
    /// failure.
    fn of_backup(e: MaintenanceError, file: &Path) -> Self {
        match e {
            MaintenanceError::NotAStore(reason) => Self::NotAStore {
                file: file.to_path_buf(),
                reason,
            },
            MaintenanceError::SchemaTooNew { found, supported } => Self::Schema {
                file: file.to_path_buf(),
                found,
                supported,
            },
            e => Self::Ops(e.into()),
        }
    }
}

impl From<MaintenanceError> for RestoreError {
    fn from(e: MaintenanceError) -> Self {
        Self::Ops(e.into())
    }
}

fn fingerprint(key: &str) -> String {
    PublicKey::from_b64(key)
        .map(|k| k.fingerprint())
        .unwrap_or_else(|_| "an unreadable key".to_owned())
}

/// Discards the restore's working copy (with what the backend keeps beside it) unless
/// disarmed.
struct WorkingCopy<'a> {
    backend: &'a dyn StoreMaintenance,
    path: PathBuf,
    armed: bool,
}

impl Drop for WorkingCopy<'_> {
    fn drop(&mut self) {
        if self.armed {
            self.backend.discard(&self.path);
        }
    }
}

/// When the store in `dir` (or one it was restored over) was restored from `file` (its
/// canonical path when it exists — links and `..` resolved — or its absolute spelling, as
/// earlier versions recorded it), as recorded in `meta.restored_paths`; `None` when never, or when `dir` holds no
/// store. Read-only. `MBX_RELAY_RESTORE_FROM` is consumed by its path: a path restored once is
/// never restored again, whatever the file there holds now. Errors: SQLite errors.
pub fn restored_from(dir: &Path, file: &Path) -> Result<Option<String>, OpsError> {
    let path = dir.join(DB_FILE);
    if !path.is_file() {
        return Ok(None);
    }
    let Some(paths) = backend().restored_paths(&path)? else {
        return Ok(None);
    };
    Ok(path_keys(file).iter().find_map(|k| paths.get(k)).map(|at| {
        at.as_str()
            .map_or_else(|| "an unknown time".to_owned(), str::to_owned)
    }))
}

/// The spellings under which `meta.restored_paths` records a backup path: its canonical path
/// (links and `..` resolved) when the file exists, and its absolute spelling (how earlier
/// versions recorded it).
fn path_keys(file: &Path) -> Vec<String> {
    let mut keys = Vec::with_capacity(2);
    if let Ok(canonical) = std::fs::canonicalize(file) {
        keys.push(canonical.display().to_string());
    }
    let spelled = absolute(file).display().to_string();
    if !keys.contains(&spelled) {
        keys.push(spelled);
    }
    keys
}

/// Whether `stamp` is the restore's stamp: `iso_ms` with `:` and `.` replaced by `-`
/// (`2026-01-01T00-00-00-000Z`).
fn is_stamp(stamp: &str) -> bool {
    let b = stamp.as_bytes();
    b.len() == 24
        && b.iter().enumerate().all(|(i, c)| match i {
            4 | 7 | 13 | 16 | 19 => *c == b'-',
            10 => *c == b'T',
            23 => *c == b'Z',
            _ => c.is_ascii_digit(),
        })
}

/// Whether `name` is a working copy this code names: `relay.db.restore-<stamp>`, optionally
/// with `-journal`, `-wal` or `-shm`.
fn is_working_copy_name(name: &str) -> bool {
    let Some(rest) = name.strip_prefix(&format!("{DB_FILE}.restore-")) else {
        return false;
    };
    let rest = ["-journal", "-wal", "-shm"]
        .iter()
        .find_map(|s| rest.strip_suffix(s))
        .unwrap_or(rest);
    is_stamp(rest)
}

/// Checks the live store's lock-less heartbeat rule (step 1): `Err` when a store without
/// `relay.lock` had a heartbeat less than [`LIVE_HEARTBEAT_MS`] ago.
fn fresh_heartbeat(
    backend: &dyn StoreMaintenance,
    live: &Path,
    now_ms: i64,
) -> Result<(), RestoreError> {
    match backend.heartbeat(live) {
        Some(b) if now_ms.saturating_sub(b) < LIVE_HEARTBEAT_MS => {
            Err(RestoreError::FreshHeartbeat {
                age_s: now_ms.saturating_sub(b) / 1_000,
            })
        }
        _ => Ok(()),
    }
}

/// The receipt's `replaced`: `{epoch, rollback, sha256, bytes, readable}` of the rollback
/// copy.
fn rollback_facts(rollback: &Path, epoch: Value, readable: bool) -> Result<Value, OpsError> {
    let sha256 = sha256_file(rollback)?;
    let bytes = rollback.metadata().map_err(io(rollback))?.len();
    Ok(
        json!({"epoch": epoch, "rollback": rollback.display().to_string(), "sha256": sha256,
               "bytes": bytes, "readable": readable}),
    )
}

/// Checks that `src` names a regular file (links followed): [`RestoreError::NoBackup`] when
/// nothing is there, [`RestoreError::NotAFile`] for a directory, a fifo, a device or a dangling
/// symlink. Reads nothing.
pub fn check_backup_path(src: &Path) -> Result<(), RestoreError> {
    match src.symlink_metadata() {
        Err(_) => Err(RestoreError::NoBackup(src.to_path_buf())),
        Ok(_) if !src.is_file() => Err(RestoreError::NotAFile(src.to_path_buf())),
        Ok(_) => Ok(()),
    }
}

/// `relay restore <file> [--force]` (`wire.md` §3.4; module docs for the steps): replaces the
/// store in `dir` with the backup `file` and returns the signed receipt `{v:1,
/// type:"relay-restore", at, store, backup:{file, sha256, bytes, epoch, schema_version,
/// heartbeat}, replaced:{epoch, rollback, sha256, bytes, readable}|null, epoch:{from, to},
/// carried:{rotations, revocations, sender_lists, enc_ads, enc_ad_records, seq_floors, deny,
/// account_bindings, ops}, counts, rollback, next, sig}` (`rollback`: the command that undoes
/// it, null when no store was replaced), which is also the newest entry of the restored
/// store's relay log.
///
/// `held` is the caller's own `relay.lock` of `dir` (`relay serve` restoring at start); without
/// it the lock is taken here without waiting. Errors: [`RestoreError`]; on every error the
/// live store is unchanged and no working copy remains (a rollback copy may).
pub fn restore(
    dir: &Path,
    file: &Path,
    opts: &RestoreOptions,
    held: Option<&StoreLock>,
) -> Result<Value, RestoreError> {
    restore_with(backend(), dir, file, opts, held)
}

/// [`restore`] through the store backend `backend` instead of the one the relay runs on (the
/// conformance suite holds each backend to the backup and restore rules this way).
pub fn restore_with(
    backend: &dyn StoreMaintenance,
    dir: &Path,
    file: &Path,
    opts: &RestoreOptions,
    held: Option<&StoreLock>,
) -> Result<Value, RestoreError> {
    let src = absolute(file);
    check_backup_path(&src)?;
    let live = dir.join(DB_FILE);
    if let Ok(meta) = live.symlink_metadata() {
        if !live.is_file() {
            return Err(OpsError::Io {
                path: absolute(&live),
                source: std::io::Error::other(format!(
                    "is not a regular file ({}): move it out of the store directory first; a \
                     restore never replaces it",
                    if meta.is_dir() {
                        "a directory"
                    } else {
                        "not a database file"
                    }
                )),
            }
            .into());
        }
    }
    let same = match (src.canonicalize(), live.canonicalize()) {
        (Ok(a), Ok(b)) => a == b,
        _ => false,
    };
    if same {
        return Err(RestoreError::SameFile(src));
    }
    // Before the lock is taken (taking it creates relay.lock): a store without one may have a
    // relay from before the lock on it.
    let had_lock_file = dir.join(LOCK_FILE).exists();
    if held.is_none() && !had_lock_file && live.exists() && !opts.force {
        fresh_heartbeat(backend, &live, opts.now_ms)?;
    }
    let _own_lock = match held {
        Some(_) => None,
        None => Some(
            if opts.force {
                StoreLock::acquire_ignoring_heartbeat(dir, 0, opts.now_ms)
            } else {
                StoreLock::acquire(dir, 0, opts.now_ms)
            }
            .map_err(|e| match e {
                StoreError::Locked { .. } => RestoreError::RelayRunning(absolute(dir)),
                StoreError::LiveHeartbeat { age_s, .. } => RestoreError::FreshHeartbeat { age_s },
                e => e.into(),
            })?,
        ),
    };

    // Working copies of restores that died midway: this one holds the lock, so they are
    // nobody's. Only the exact names this code gives them, and never the backup being
    // restored.
    let src_canonical = src.canonicalize().ok();
    for entry in std::fs::read_dir(dir).map_err(io(dir))?.flatten() {
        let path = entry.path();
        let ours = is_working_copy_name(&entry.file_name().to_string_lossy())
            && entry.file_type().is_ok_and(|t| t.is_file())
            && path != src
            && path.canonicalize().ok() != src_canonical;
        if ours {
            let _ = std::fs::remove_file(path);
        }
    }
    // Partial rollback copies of restores that were killed.
    backend.remove_dead_partials(&dir.join(ROLLBACK_DIR), &|base| {
        base.starts_with("relay-") && base.ends_with(".db")
    });

    let now = opts.now_ms;
    let at = iso_ms(now);
    let stamp = at.replace([':', '.'], "-");
    let tmp = dir.join(format!("{DB_FILE}.restore-{stamp}"));
    let rollback_dir = dir.join(ROLLBACK_DIR);
    // Two restores in one millisecond must not share a rollback name.
    let rollback = (1..)
        .map(|n| match n {
            1 => rollback_dir.join(format!("relay-{stamp}.db")),
            n => rollback_dir.join(format!("relay-{stamp}-{n}.db")),
        })
        .find(|p| p.symlink_metadata().is_err())
        .map(|p| absolute(&p))
        .unwrap_or_default();
    if tmp == src || src_canonical.is_some() && tmp.canonicalize().ok() == src_canonical {
        return Err(RestoreError::SameFile(src));
    }
    backend.discard(&tmp);
    let mut working = WorkingCopy {
        backend,
        path: tmp.clone(),
        armed: true,
    };

    // 2. The backup, copied and checked.
    backend.stage(&src, &tmp)?;
    let b = backend
        .check_staged(&tmp)
        .map_err(|e| RestoreError::of_backup(e, &src))?;
    if let Some(signer) = &opts.signer {
        let relay_key = signer.relay_pubkey();
        if b.relay_pubkey != relay_key {
            return Err(RestoreError::OtherRelay {
                backup: fingerprint(&b.relay_pubkey),
                against: "the relay key",
                other: fingerprint(&relay_key),
            });
        }
    }

    // 3. The store it replaces: its authority and a rollback copy.
    let mut current: Option<Box<CarryForward>> = None;
    let mut replaced = Value::Null;
    let mut salvaged = Map::new();
    // This restore's rollback copy is removed when the restore fails before the swap (the
    // current store is untouched then).
    let mut rollback_copy = WorkingCopy {
        backend,
        path: rollback.clone(),
        armed: false,
    };
    if live.exists() {
        let taken = backend.take_current(&live, &rollback, &b.relay_pubkey);
        rollback_copy.armed = rollback.symlink_metadata().is_ok();
        match taken {
            Ok(TakenStore::OtherKey(key)) => {
                return Err(RestoreError::OtherRelay {
                    backup: fingerprint(&b.relay_pubkey),
                    against: "the store",
                    other: fingerprint(&key),
                })
            }
            Ok(TakenStore::Read(cur, epoch)) => {
                current = Some(cur);
                replaced = rollback_facts(&rollback, epoch.map_or(Value::Null, Value::from), true)
                    .inspect_err(|_| backend.discard(&rollback))?;
            }
            Err(TakeFailure::SchemaTooNew(found)) => {
                return Err(RestoreError::CurrentSchema {
                    file: absolute(&live),
                    found,
                    supported: SCHEMA_VERSION,
                })
            }
            Err(TakeFailure::Failed(e)) => return Err(e.into()),
            Err(TakeFailure::Unreadable(reason)) if opts.force => {
                tracing::warn!(reason = %reason, "the current relay store cannot be read: restoring without carrying anything forward (--force)");
                salvaged = backend.salvage_restored_paths(&live);
                backend.keep_unreadable(&live, &rollback)?;
                replaced = rollback_facts(&rollback, Value::Null, false)?;
                rollback_copy.armed = true;
            }
            Err(TakeFailure::Unreadable(reason)) => {
                return Err(RestoreError::CurrentUnreadable {
                    reason,
                    rollback_dir: absolute(&rollback_dir),
                })
            }
        }
    }

    // 4. Carry forward, rotate the epoch, log the receipt: one transaction on the copy.
    let backup_sha256 = sha256_file(&src)?;
    let backup_bytes = src.metadata().map_err(io(&src))?.len();
    let staged = backend.open_staged(&tmp)?;
    let carried = match &current {
        Some(cur) => carry::carry(staged.as_ref(), cur, now)?,
        None => Carried::default(),
    };
    let from = b.epoch.clone();
    let to = uuid::Uuid::new_v4().to_string();
    staged.set_meta("epoch", &to)?;
    staged.set_meta("heartbeat", &now.to_string())?;
    let mut paths = staged.restored_paths()?;
    if let Some(cur) = &current {
        paths.extend(cur.restored_paths.clone());
    }
    paths.extend(salvaged);
    let src_text = src.display().to_string();
    for key in path_keys(&src) {
        paths.insert(key, json!(at));
    }
    staged.set_meta("restored_paths", &Value::Object(paths).to_string())?;
    staged.set_meta(
        "restored",
        &json!({"at": at, "file": src_text, "sha256": backup_sha256, "from": from, "to": to})
            .to_string(),
    )?;
    let counts = staged.counts()?.to_json();
    let dir_abs = absolute(dir);
    let undo = (!replaced.is_null()).then(|| {
        format!(
            "agentmbx relay restore {} --store-dir {}{}",
            rollback.display(),
            dir_abs.display(),
            if replaced["readable"] == true {
                ""
            } else {
                " --force"
            }
        )
    });
    let receipt = json!({
        "v": 1,
        "type": OP_RESTORE,
        "at": at,
        "store": store_db(dir),
        "backup": {"file": src_text, "sha256": backup_sha256, "bytes": backup_bytes,
                   "epoch": b.epoch, "schema_version": b.schema_version,
                   "heartbeat": b.heartbeat_ms.map(iso_ms)},
        "replaced": replaced,
        "epoch": {"from": from, "to": to},
        "carried": {"rotations": carried.rotations,
                    "revocations": carried.revocations, "sender_lists": carried.sender_lists,
                    "enc_ads": carried.enc_ads, "enc_ad_records": carried.enc_ad_records,
                    "seq_floors": carried.seq_floors, "deny": carried.deny,
                    "account_bindings": carried.account_bindings, "ops": carried.ops},
        "counts": counts,
        "rollback": undo,
        "next": NEXT,
    });
    let text = serde_json::to_string(&receipt)
        .map_err(|e| StoreError::InvalidInput(format!("op receipt is not JSON: {e}")))?;
    let signed = staged.append_op(opts.signer.as_deref(), now, OP_RESTORE, &text)?;
    staged.commit()?;
    agentmbx_protocol::failpoint::hit("restore:before-rename");

    // 5. The swap: the old store's WAL never meets the new file.
    rollback_copy.armed = false;
    backend.swap_in(&tmp, &live, &rollback)?;
    working.armed = false;
    let receipt: Value = serde_json::from_str(&signed)
        .map_err(|e| StoreError::Corrupt(format!("op receipt is not JSON: {e}")))?;
    tracing::info!(
        backup = %src.display(),
        from = %from,
        to = %to,
        "relay store restored from a backup"
    );
    Ok(receipt)
}
