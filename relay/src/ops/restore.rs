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
//! # What it must never do
//! - Replace a store a running relay holds, or write the backup file.
//! - Carry forward anything that gives authority back (a post-backup enrolment) or bring back
//!   what the live store took away (a revocation, a deny-list entry).
//! - Print key material: it handles public keys, sealed items and routing metadata only.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use rusqlite::types::Value as SqlValue;
use rusqlite::{params_from_iter, Connection, OptionalExtension, TransactionBehavior};
use serde_json::{json, Map, Value};

use agentmbx_protocol::keys::PublicKey;
use agentmbx_protocol::time::iso_ms;

use super::{absolute, facts, fsync, io, online_copy, sha256_file, store_db, OpsError};
use crate::store::{
    append_op_signed, migrate, rebuild_usage, replay_rotation, stored_version, OpSigner,
    RotateOutcome, StoreError, StoreLock, DB_FILE, LOCK_FILE, MIGRATIONS, ROTATION_META_PREFIX,
    SCHEMA_VERSION,
};

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

impl From<rusqlite::Error> for RestoreError {
    fn from(e: rusqlite::Error) -> Self {
        Self::Ops(OpsError::Sqlite(e))
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

fn fingerprint(key: &str) -> String {
    PublicKey::from_b64(key)
        .map(|k| k.fingerprint())
        .unwrap_or_else(|_| "an unreadable key".to_owned())
}

/// A path with `suffix` appended to its file name.
fn with_suffix(path: &Path, suffix: &str) -> PathBuf {
    let mut p = path.to_path_buf().into_os_string();
    p.push(suffix);
    PathBuf::from(p)
}

/// Removes the restore's working copy (and its journals) unless disarmed.
struct WorkingCopy {
    path: PathBuf,
    armed: bool,
}

impl WorkingCopy {
    fn remove(path: &Path) {
        for suffix in ["", "-journal", "-wal", "-shm"] {
            let _ = std::fs::remove_file(with_suffix(path, suffix));
        }
    }
}

impl Drop for WorkingCopy {
    fn drop(&mut self) {
        if self.armed {
            Self::remove(&self.path);
        }
    }
}

/// Copies `src` to the new file `dest` (0600; an existing `dest` is an error).
fn copy_new(src: &Path, dest: &Path) -> Result<(), OpsError> {
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

/// Creates `dir` 0700 (with missing parents) when it does not exist.
fn private_dir(dir: &Path) -> Result<(), OpsError> {
    use std::os::unix::fs::DirBuilderExt as _;
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)
        .map_err(io(dir))
}

/// Whether `e` says the file is not an SQLite database or is damaged (`SQLITE_NOTADB`,
/// `SQLITE_CORRUPT`): a backup in that state is not a relay store.
fn is_not_a_database(e: &rusqlite::Error) -> bool {
    matches!(
        e.sqlite_error_code(),
        Some(rusqlite::ErrorCode::NotADatabase | rusqlite::ErrorCode::DatabaseCorrupt)
    )
}

/// One schema object of `sqlite_master`: `(type, name)` → its SQL with whitespace runs
/// collapsed (`None` for the automatic indexes).
type SchemaObjects = std::collections::BTreeMap<(String, String), Option<String>>;

fn normalized_sql(sql: &str) -> String {
    sql.split_whitespace().collect::<Vec<_>>().join(" ")
}

/// Every table, index, trigger and view of `c` (`sqlite_stat*`, the planner's statistics,
/// left out).
fn schema_objects(c: &Connection) -> rusqlite::Result<SchemaObjects> {
    let mut st = c.prepare(
        "SELECT type, name, sql FROM sqlite_master WHERE name NOT LIKE 'sqlite\\_stat%' ESCAPE '\\'",
    )?;
    let out = st
        .query_map([], |r| {
            Ok((
                (r.get::<_, String>(0)?, r.get::<_, String>(1)?),
                r.get::<_, Option<String>>(2)?
                    .as_deref()
                    .map(normalized_sql),
            ))
        })?
        .collect::<Result<SchemaObjects, _>>()?;
    Ok(out)
}

/// The schema objects this binary's migrations give a store of schema `version`, built in
/// memory. Errors: SQLite and migration errors.
fn reference_schema(version: u32) -> Result<SchemaObjects, RestoreError> {
    let mut c = Connection::open_in_memory()?;
    migrate(&mut c, 0, version, MIGRATIONS)?;
    Ok(schema_objects(&c)?)
}

/// The backup's schema must be exactly what this binary defines for its version: an extra
/// object (a trigger or a view is code that would run inside the carry-forward and stay in the
/// live schema), one of ours defined otherwise (a trigger with another body) or a missing one is
/// refused; the schema's own triggers pass. `Ok(Some)` names the first difference.
fn schema_difference(c: &Connection, version: u32) -> Result<Option<String>, RestoreError> {
    let found = schema_objects(c)?;
    let want = reference_schema(version)?;
    // A missing table before the indexes it implies.
    if let Some(((kind, name), _)) = want
        .iter()
        .filter(|(k, _)| !found.contains_key(*k))
        .min_by_key(|((kind, _), _)| kind != "table")
    {
        return Ok(Some(format!(
            "the {kind} {name:?} of schema {version} is missing"
        )));
    }
    if let Some(((kind, name), _)) = found.iter().find(|(k, _)| !want.contains_key(*k)) {
        return Ok(Some(format!(
            "it holds a {kind} {name:?} that schema {version} does not define"
        )));
    }
    if let Some(((kind, name), _)) = found.iter().find(|(k, sql)| want.get(*k) != Some(*sql)) {
        return Ok(Some(format!(
            "the {kind} {name:?} differs from its definition in schema {version}"
        )));
    }
    Ok(None)
}

fn has_table(c: &Connection, name: &str) -> rusqlite::Result<bool> {
    c.query_row(
        "SELECT EXISTS (SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = ?1)",
        [name],
        |r| r.get(0),
    )
}

fn meta_get(c: &Connection, key: &str) -> rusqlite::Result<Option<String>> {
    c.query_row("SELECT v FROM meta WHERE k = ?1", [key], |r| r.get(0))
        .optional()
}

fn meta_put(c: &Connection, key: &str, value: &str) -> rusqlite::Result<()> {
    c.execute(
        "INSERT INTO meta (k, v) VALUES (?1, ?2) ON CONFLICT(k) DO UPDATE SET v = excluded.v",
        [key, value],
    )?;
    Ok(())
}

/// Every path a store was restored from (`meta.restored_paths`, plus the file of
/// `meta.restored`), with when.
fn restored_paths(c: &Connection) -> rusqlite::Result<Map<String, Value>> {
    let mut out = meta_get(c, "restored_paths")?
        .and_then(|t| serde_json::from_str::<Map<String, Value>>(&t).ok())
        .unwrap_or_default();
    if let Some(r) = meta_get(c, "restored")?.and_then(|t| serde_json::from_str::<Value>(&t).ok()) {
        if let Some(file) = r["file"].as_str() {
            out.entry(file.to_owned())
                .or_insert_with(|| r["at"].clone());
        }
    }
    Ok(out)
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
    let c = Connection::open_with_flags(
        &path,
        rusqlite::OpenFlags::SQLITE_OPEN_READ_ONLY | rusqlite::OpenFlags::SQLITE_OPEN_NO_MUTEX,
    )?;
    c.busy_timeout(std::time::Duration::from_secs(5))?;
    if !has_table(&c, "meta")? {
        return Ok(None);
    }
    let paths = restored_paths(&c)?;
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

/// Whether process `pid` is alive (`/proc/<pid>` exists; where there is no `/proc`, every
/// process counts as alive, so nothing of it is removed).
fn pid_alive(pid: u32) -> bool {
    let proc = Path::new("/proc");
    !proc.is_dir() || proc.join(pid.to_string()).exists()
}

/// The pid of a `<base>.partial-<pid>` name (optionally followed by `-journal`, `-wal` or
/// `-shm`) whose `<base>` satisfies `base_ok`.
fn partial_pid(name: &str, base_ok: impl Fn(&str) -> bool) -> Option<u32> {
    let name = ["-journal", "-wal", "-shm"]
        .iter()
        .find_map(|s| name.strip_suffix(s))
        .unwrap_or(name);
    let (base, pid) = name.rsplit_once(".partial-")?;
    if pid.is_empty() || !pid.bytes().all(|b| b.is_ascii_digit()) || !base_ok(base) {
        return None;
    }
    pid.parse().ok()
}

/// Removes from `dir` the partial files (`<base>.partial-<pid>`, see
/// [`crate::ops::online_copy`]) whose `<base>` satisfies `base_ok` and whose process is gone:
/// leftovers of a killed backup or restore. Never anything else; errors are ignored.
pub(crate) fn remove_dead_partials(dir: &Path, base_ok: impl Fn(&str) -> bool) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for entry in entries.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        let Some(pid) = partial_pid(&name, &base_ok) else {
            continue;
        };
        if pid != std::process::id()
            && !pid_alive(pid)
            && entry.file_type().is_ok_and(|t| t.is_file())
        {
            tracing::info!(file = %entry.path().display(), "removed the partial file of an interrupted copy");
            let _ = std::fs::remove_file(entry.path());
        }
    }
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

/// The facts of the backup copy `restore` checks.
struct BackupFacts {
    epoch: String,
    relay_pubkey: String,
    schema_version: u32,
    heartbeat: Option<i64>,
}

/// Opens the copy at `path` read-write and switches it to the rollback journal (folding a WAL
/// in), so the file alone is the whole store. Errors: SQLite errors (not a database…).
fn seal(path: &Path) -> Result<Connection, rusqlite::Error> {
    let c = Connection::open(path)?;
    c.busy_timeout(std::time::Duration::from_secs(5))?;
    let _mode: String = c.query_row("PRAGMA journal_mode = DELETE", [], |r| r.get(0))?;
    Ok(c)
}

/// `PRAGMA integrity_check`. Errors: [`OpsError::Integrity`] naming the problems, SQLite errors.
fn integrity(c: &Connection) -> Result<(), OpsError> {
    let problems: Vec<String> = c
        .prepare("PRAGMA integrity_check")?
        .query_map([], |r| r.get::<_, String>(0))?
        .collect::<Result<_, _>>()?;
    if problems != ["ok"] {
        return Err(OpsError::Integrity(problems.join("; ")));
    }
    Ok(())
}

/// Step 2: checks the backup copy at `tmp` (of `file`): an SQLite database that passes its
/// integrity check, of a schema this binary knows, whose objects are exactly that schema's
/// ([`schema_difference`]), with an epoch and a relay key.
fn check_backup(tmp: &Path, file: &Path) -> Result<BackupFacts, RestoreError> {
    let not_a_store = |reason: String| RestoreError::NotAStore {
        file: file.to_path_buf(),
        reason,
    };
    let sqlite = |e: rusqlite::Error| {
        if is_not_a_database(&e) {
            not_a_store(format!("not an SQLite database, or a damaged one: {e}"))
        } else {
            e.into()
        }
    };
    let c = seal(tmp).map_err(sqlite)?;
    match integrity(&c) {
        Err(OpsError::Sqlite(e)) => return Err(sqlite(e)),
        Err(OpsError::Integrity(problems)) => {
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
        return Err(RestoreError::Schema {
            file: file.to_path_buf(),
            found: schema_version,
            supported: SCHEMA_VERSION,
        });
    }
    let bad_meta = |e: rusqlite::Error| match sqlite(e) {
        RestoreError::Ops(_) => not_a_store("its meta table is not a relay store's".into()),
        e => e,
    };
    let (Some(epoch), Some(relay_pubkey)) = (
        meta_get(&c, "epoch").map_err(bad_meta)?,
        meta_get(&c, "relay_pubkey").map_err(bad_meta)?,
    ) else {
        return Err(not_a_store("no epoch or relay key".into()));
    };
    if let Some(difference) = schema_difference(&c, schema_version)? {
        return Err(not_a_store(format!(
            "its schema is not this agentmbx's relay store schema {schema_version}: {difference}"
        )));
    }
    if PublicKey::from_b64(&relay_pubkey).is_err() {
        return Err(not_a_store(
            "its meta.relay_pubkey is not a public key".into(),
        ));
    }
    let heartbeat = meta_get(&c, "heartbeat")
        .map_err(sqlite)?
        .and_then(|v| v.trim().parse::<i64>().ok());
    Ok(BackupFacts {
        epoch,
        relay_pubkey,
        schema_version,
        heartbeat,
    })
}

type Row = Vec<SqlValue>;

fn rows(c: &Connection, sql: &str) -> rusqlite::Result<Vec<Row>> {
    let mut st = c.prepare(sql)?;
    let n = st.column_count();
    let out = st
        .query_map([], |r| (0..n).map(|i| r.get::<_, SqlValue>(i)).collect())?
        .collect::<Result<Vec<Row>, _>>()?;
    Ok(out)
}

/// What the current store holds that a restore carries forward (step 3), read in one read
/// transaction.
#[derive(Default)]
struct Current {
    relay_pubkey: Option<String>,
    /// `host_pubkey, host_name, owner_fp, account, authorized_by, authority_rank, enrolled_at,
    /// revoked_at` of revoked enrolments.
    revoked: Vec<Row>,
    /// `target_pubkey, senders, iat, record, sig`.
    sender_lists: Vec<Row>,
    /// `host_pubkey, host_name, enc_pub, sig, at`.
    enc_ads: Vec<Row>,
    /// `host_pubkey, enc_pub, record, sig, at`.
    enc_ad_records: Vec<Row>,
    /// `target_pubkey, next_seq`.
    seqs: Vec<Row>,
    /// `kind, value, until, at`.
    deny: Vec<Row>,
    /// `host_pubkey, cloud_jkt, client_id, sub, org, at`.
    bindings: Vec<Row>,
    /// `id, at, op, receipt`, oldest first.
    ops: Vec<Row>,
    /// The applied host key rotations (`meta.rotation:<old>` → new key), with the old key's
    /// revocation time (the rotation's), oldest first.
    rotations: Vec<Rotation>,
    restored_paths: Map<String, Value>,
}

/// One applied host key rotation of the current store.
struct Rotation {
    old_key: String,
    new_key: String,
    /// When the old key was revoked by it (ms); `None` when its row is gone.
    at_ms: Option<i64>,
}

fn read_current(c: &Connection) -> rusqlite::Result<Current> {
    let tx = c.unchecked_transaction()?;
    let optional = |table: &str, sql: &str| -> rusqlite::Result<Vec<Row>> {
        if has_table(&tx, table)? {
            rows(&tx, sql)
        } else {
            Ok(Vec::new())
        }
    };
    let current = Current {
        relay_pubkey: meta_get(&tx, "relay_pubkey")?,
        revoked: rows(
            &tx,
            "SELECT host_pubkey, host_name, owner_fp, account, authorized_by, authority_rank,
                    enrolled_at, revoked_at
               FROM enrolments WHERE revoked_at IS NOT NULL",
        )?,
        sender_lists: rows(
            &tx,
            "SELECT target_pubkey, senders, iat, record, sig FROM sender_lists",
        )?,
        enc_ads: rows(
            &tx,
            "SELECT host_pubkey, host_name, enc_pub, sig, at FROM enc_ads",
        )?,
        enc_ad_records: rows(
            &tx,
            "SELECT host_pubkey, enc_pub, record, sig, at FROM enc_ad_records",
        )?,
        seqs: rows(&tx, "SELECT target_pubkey, next_seq FROM seqs")?,
        deny: optional("deny", "SELECT kind, value, until, at FROM deny")?,
        bindings: optional(
            "account_bindings",
            "SELECT host_pubkey, cloud_jkt, client_id, sub, org, at FROM account_bindings",
        )?,
        ops: rows(&tx, "SELECT id, at, op, receipt FROM ops ORDER BY id")?,
        rotations: rotations(&tx)?,
        restored_paths: restored_paths(&tx)?,
    };
    tx.commit()?;
    Ok(current)
}

/// The rotation markers of `c` (`meta.rotation:<old>` → new key, `store/sqlite/rotate.rs`),
/// in the order they were applied: by the old key's revocation time.
fn rotations(c: &Connection) -> rusqlite::Result<Vec<Rotation>> {
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
            Ok(Rotation {
                old_key: r.get(0)?,
                new_key: r.get(1)?,
                at_ms: r.get(2)?,
            })
        })?
        .collect::<Result<Vec<_>, _>>()?;
    Ok(out)
}

/// What the current store turned out to be (step 3).
enum CurrentOutcome {
    /// Read, and copied to the rollback file: its facts for the receipt's `replaced`.
    Read(Box<Current>, Value),
    /// Bound to another relay key (never overridden by `--force`).
    OtherKey(String),
}

/// Why [`take_current`] took nothing.
enum TakeError {
    /// The current store cannot be read (`CURRENT_UNREADABLE`; `--force` restores without it).
    Unreadable(String),
    /// A refusal or a failure that `--force` never overrides: a newer schema, or writing the
    /// rollback copy failed (a full disk…), which says nothing about the current store.
    Refused(RestoreError),
}

/// Step 3 for a readable store: check, read, and (when it is bound to `backup_key` too) copy
/// it to `rollback`. Only a failure to read the current store is [`TakeError::Unreadable`].
fn take_current(
    live: &Path,
    rollback: &Path,
    backup_key: &str,
) -> Result<CurrentOutcome, TakeError> {
    let text = |e: rusqlite::Error| TakeError::Unreadable(e.to_string());
    let c = Connection::open_with_flags(
        live,
        rusqlite::OpenFlags::SQLITE_OPEN_READ_WRITE | rusqlite::OpenFlags::SQLITE_OPEN_NO_MUTEX,
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
        return Err(TakeError::Refused(RestoreError::CurrentSchema {
            file: absolute(live),
            found: u32::try_from(found).unwrap_or(u32::MAX),
            supported: SCHEMA_VERSION,
        }));
    }
    let ok: String = c
        .query_row("PRAGMA quick_check", [], |r| r.get(0))
        .map_err(text)?;
    if ok != "ok" {
        return Err(TakeError::Unreadable(format!("integrity: {ok}")));
    }
    let current = read_current(&c).map_err(text)?;
    if let Some(key) = current.relay_pubkey.as_deref().filter(|k| *k != backup_key) {
        return Ok(CurrentOutcome::OtherKey(key.to_owned()));
    }
    let (epoch, ..) = online_copy(&c, rollback, None).map_err(|e| match e {
        // Reading the current store's pages failed: it cannot be read after all.
        OpsError::Integrity(reason) => TakeError::Unreadable(reason),
        OpsError::Sqlite(e) if is_not_a_database(&e) => TakeError::Unreadable(e.to_string()),
        // Writing the copy failed: nothing about the current store.
        e => TakeError::Refused(e.into()),
    })?;
    drop(c);
    let facts = (|| -> Result<Value, OpsError> {
        let sha256 = sha256_file(rollback)?;
        let bytes = rollback.metadata().map_err(io(rollback))?.len();
        Ok(
            json!({"epoch": epoch, "rollback": rollback.display().to_string(), "sha256": sha256,
                   "bytes": bytes, "readable": true}),
        )
    })()
    .map_err(|e| {
        WorkingCopy::remove(rollback);
        TakeError::Refused(e.into())
    })?;
    Ok(CurrentOutcome::Read(Box::new(current), facts))
}

/// The `restored_paths` of a store that cannot be read as a whole, when that much of it can
/// be read (so a `--force` restore keeps the lineage's record of consumed paths).
fn salvage_restored_paths(live: &Path) -> Map<String, Value> {
    Connection::open_with_flags(
        live,
        rusqlite::OpenFlags::SQLITE_OPEN_READ_ONLY | rusqlite::OpenFlags::SQLITE_OPEN_NO_MUTEX,
    )
    .ok()
    .and_then(|c| restored_paths(&c).ok())
    .unwrap_or_default()
}

/// Step 3 with `--force` for a store that cannot be read: its files as they are, into
/// `rollback` (+ `-wal`, `-shm`), 0600. Each is written under a `.partial-<pid>` name and
/// renamed once all are complete, so a failure never leaves a file under a rollback name.
fn keep_unreadable(live: &Path, rollback: &Path) -> Result<Value, OpsError> {
    let partial = format!(".partial-{}", std::process::id());
    let mut made: Vec<(PathBuf, PathBuf)> = Vec::new();
    let result = (|| -> Result<(), OpsError> {
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
                return Err(OpsError::Exists(to.clone()));
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
    Ok(
        json!({"epoch": null, "rollback": rollback.display().to_string(),
              "sha256": sha256_file(rollback)?,
              "bytes": rollback.metadata().map_err(io(rollback))?.len(),
              "readable": false}),
    )
}

/// How many rows of each kind [`carry`] brought forward.
#[derive(Debug, Default)]
struct Carried {
    rotations: usize,
    revocations: usize,
    sender_lists: usize,
    enc_ads: usize,
    enc_ad_records: usize,
    seq_floors: usize,
    deny: usize,
    account_bindings: usize,
    ops: usize,
}

fn upsert_each(tx: &Connection, sql: &str, rows: &[Row]) -> rusqlite::Result<usize> {
    let mut st = tx.prepare(sql)?;
    let mut n = 0;
    for row in rows {
        n += st.execute(params_from_iter(row.iter()))?;
    }
    Ok(n)
}

/// Step 4's carry-forward, in the caller's transaction on the restored copy. The order
/// matters: the seq floors first (a replayed rotation moves a queue behind them), then the
/// rotations (before the revocations, which would otherwise revoke a rotated key without
/// moving anything), then everything else.
fn carry(tx: &Connection, cur: &Current, now_ms: i64) -> Result<Carried, RestoreError> {
    let mut c = Carried {
        // Every later seq stays above every seq a receiver may have seen (spec §2).
        seq_floors: upsert_each(
            tx,
            "INSERT INTO seqs (target_pubkey, next_seq) VALUES (?1, ?2)
             ON CONFLICT(target_pubkey) DO UPDATE SET next_seq = excluded.next_seq
               WHERE excluded.next_seq > seqs.next_seq",
            &cur.seqs,
        )?,
        ..Carried::default()
    };
    let not_replayed = replay_rotations(tx, cur, now_ms, &mut c)?;
    // Revoked stays revoked: a key revoked (or rotated away) after the backup is revoked in
    // the restored store too, enrolled there or not.
    c.revocations = upsert_each(
        tx,
        "INSERT INTO enrolments (host_pubkey, host_name, owner_fp, account, authorized_by,
                                 authority_rank, enrolled_at, revoked_at)
         VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8)
         ON CONFLICT(host_pubkey) DO UPDATE SET revoked_at = excluded.revoked_at
           WHERE enrolments.revoked_at IS NULL",
        &cur.revoked,
    )?;
    // The markers of rotations that had nothing to replay here (the old key enrolled after
    // the backup: its row is the revoked one just carried), so a host repeating its rotation
    // is answered as by the replaced store.
    for r in cur
        .rotations
        .iter()
        .filter(|r| !not_replayed.contains(&r.old_key))
    {
        tx.execute(
            "INSERT INTO meta (k, v)
             SELECT ?1, ?2 WHERE EXISTS (SELECT 1 FROM enrolments WHERE host_pubkey = ?3)
             ON CONFLICT(k) DO NOTHING",
            [
                format!("{ROTATION_META_PREFIX}{}", r.old_key),
                r.new_key.clone(),
                r.old_key.clone(),
            ],
        )?;
    }
    c.sender_lists = upsert_each(
        tx,
        "INSERT INTO sender_lists (target_pubkey, senders, iat, record, sig)
         VALUES (?1, ?2, ?3, ?4, ?5)
         ON CONFLICT(target_pubkey) DO UPDATE SET senders = excluded.senders,
           iat = excluded.iat, record = excluded.record, sig = excluded.sig
           WHERE excluded.iat > sender_lists.iat",
        &cur.sender_lists,
    )?;
    c.enc_ads = upsert_each(
        tx,
        "INSERT INTO enc_ads (host_pubkey, host_name, enc_pub, sig, at)
         VALUES (?1, ?2, ?3, ?4, ?5)
         ON CONFLICT(host_pubkey) DO UPDATE SET host_name = excluded.host_name,
           enc_pub = excluded.enc_pub, sig = excluded.sig, at = excluded.at
           WHERE excluded.at > enc_ads.at",
        &cur.enc_ads,
    )?;
    c.enc_ad_records = upsert_each(
        tx,
        "INSERT INTO enc_ad_records (host_pubkey, enc_pub, record, sig, at)
         VALUES (?1, ?2, ?3, ?4, ?5)
         ON CONFLICT(host_pubkey) DO UPDATE SET enc_pub = excluded.enc_pub,
           record = excluded.record, sig = excluded.sig, at = excluded.at
           WHERE excluded.at > enc_ad_records.at",
        &cur.enc_ad_records,
    )?;
    let active: Vec<Row> = cur
        .deny
        .iter()
        .filter(|r| match r.get(2) {
            Some(SqlValue::Integer(until)) => *until > now_ms,
            _ => true,
        })
        .cloned()
        .collect();
    if has_table(tx, "deny")? {
        c.deny = upsert_each(
            tx,
            "INSERT INTO deny (kind, value, until, at) VALUES (?1, ?2, ?3, ?4)
             ON CONFLICT(kind, value) DO UPDATE SET until = excluded.until, at = excluded.at
               WHERE excluded.at > deny.at",
            &active,
        )?;
    }
    if has_table(tx, "account_bindings")? {
        // Only for keys the restored store knows: a post-backup enrolment is not carried, nor
        // is its binding.
        c.account_bindings = upsert_each(
            tx,
            "INSERT INTO account_bindings (host_pubkey, cloud_jkt, client_id, sub, org, at)
             SELECT ?1, ?2, ?3, ?4, ?5, ?6
              WHERE EXISTS (SELECT 1 FROM enrolments WHERE host_pubkey = ?1)
             ON CONFLICT(host_pubkey) DO UPDATE SET cloud_jkt = excluded.cloud_jkt,
               client_id = excluded.client_id, sub = excluded.sub, org = excluded.org,
               at = excluded.at
               WHERE excluded.at > account_bindings.at",
            &cur.bindings,
        )?;
    }
    if !cur.ops.is_empty() {
        // The operator's history continues; the backup's own log is older. The current log is
        // already within its bounds (the restore receipt's append prunes as every append does).
        tx.execute("DELETE FROM ops", [])?;
        c.ops = upsert_each(
            tx,
            "INSERT INTO ops (id, at, op, receipt) VALUES (?1, ?2, ?3, ?4)",
            &cur.ops,
        )?;
    }
    Ok(c)
}

/// Replays on the restored copy, oldest first, every rotation of the current store the backup
/// does not have (no `meta.rotation:<old>` marker in it), at its own time, with the code that
/// applied it (`store::sqlite::rotate`): the new key takes the enrolment (name, account,
/// `authorized_by`; it becomes enrolled if the backup never saw it), the old key's queue in the
/// backup moves behind the new key's, the allowlists are rebound, the deny entries carried,
/// the old key revoked and the marker written. Counts them in `c.rotations`; returns the old
/// keys of the rotations that could not be applied (the new key revoked in the backup, or its
/// name taken there — only a store of another lineage has either), which keep the plain
/// revocation the carry gives them, with a warning.
fn replay_rotations(
    tx: &Connection,
    cur: &Current,
    now_ms: i64,
    c: &mut Carried,
) -> Result<Vec<String>, RestoreError> {
    let mut not_replayed = Vec::new();
    for r in &cur.rotations {
        let marker = format!("{ROTATION_META_PREFIX}{}", r.old_key);
        if meta_get(tx, &marker)?.is_some() {
            continue; // The backup has it.
        }
        match replay_rotation(tx, &r.old_key, &r.new_key, r.at_ms.unwrap_or(now_ms))? {
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

/// Checks the live store's lock-less heartbeat rule (step 1): `Err` when a store without
/// `relay.lock` had a heartbeat less than [`LIVE_HEARTBEAT_MS`] ago.
fn fresh_heartbeat(live: &Path, now_ms: i64) -> Result<(), RestoreError> {
    let beat = Connection::open_with_flags(
        live,
        rusqlite::OpenFlags::SQLITE_OPEN_READ_ONLY | rusqlite::OpenFlags::SQLITE_OPEN_NO_MUTEX,
    )
    .ok()
    .and_then(|c| meta_get(&c, "heartbeat").ok().flatten())
    .and_then(|v| v.trim().parse::<i64>().ok());
    match beat {
        Some(b) if now_ms.saturating_sub(b) < LIVE_HEARTBEAT_MS => {
            Err(RestoreError::FreshHeartbeat {
                age_s: now_ms.saturating_sub(b) / 1_000,
            })
        }
        _ => Ok(()),
    }
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
        fresh_heartbeat(&live, opts.now_ms)?;
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
    remove_dead_partials(&dir.join(ROLLBACK_DIR), |base| {
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
    WorkingCopy::remove(&tmp);
    let mut working = WorkingCopy {
        path: tmp.clone(),
        armed: true,
    };

    // 2. The backup, copied and checked.
    copy_new(&src, &tmp)?;
    let src_wal = with_suffix(&src, "-wal");
    if src_wal.is_file() {
        // A raw volume copy: its WAL is folded in by the switch to the rollback journal.
        copy_new(&src_wal, &with_suffix(&tmp, "-wal"))?;
    }
    let b = check_backup(&tmp, &src)?;
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
    let mut current: Option<Box<Current>> = None;
    let mut replaced = Value::Null;
    let mut salvaged = Map::new();
    // This restore's rollback copy is removed when the restore fails before the swap (the
    // current store is untouched then).
    let mut rollback_copy = WorkingCopy {
        path: rollback.clone(),
        armed: false,
    };
    if live.exists() {
        private_dir(&rollback_dir)?;
        let taken = take_current(&live, &rollback, &b.relay_pubkey);
        rollback_copy.armed = rollback.symlink_metadata().is_ok();
        match taken {
            Ok(CurrentOutcome::OtherKey(key)) => {
                return Err(RestoreError::OtherRelay {
                    backup: fingerprint(&b.relay_pubkey),
                    against: "the store",
                    other: fingerprint(&key),
                })
            }
            Ok(CurrentOutcome::Read(cur, facts)) => {
                current = Some(cur);
                replaced = facts;
            }
            Err(TakeError::Refused(e)) => return Err(e),
            Err(TakeError::Unreadable(reason)) if opts.force => {
                tracing::warn!(reason = %reason, "the current relay store cannot be read: restoring without carrying anything forward (--force)");
                salvaged = salvage_restored_paths(&live);
                replaced = keep_unreadable(&live, &rollback)?;
                rollback_copy.armed = true;
            }
            Err(TakeError::Unreadable(reason)) => {
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
    let mut c = seal(&tmp)?;
    let found = stored_version(&c)?;
    migrate(&mut c, found, SCHEMA_VERSION, MIGRATIONS)?;
    let tx = c.transaction_with_behavior(TransactionBehavior::Immediate)?;
    rebuild_usage(&tx)?;
    let carried = match &current {
        Some(cur) => carry(&tx, cur, now)?,
        None => Carried::default(),
    };
    let from = b.epoch.clone();
    let to = uuid::Uuid::new_v4().to_string();
    meta_put(&tx, "epoch", &to)?;
    meta_put(&tx, "heartbeat", &now.to_string())?;
    let mut paths = restored_paths(&tx)?;
    if let Some(cur) = &current {
        paths.extend(cur.restored_paths.clone());
    }
    paths.extend(salvaged);
    let src_text = src.display().to_string();
    for key in path_keys(&src) {
        paths.insert(key, json!(at));
    }
    meta_put(&tx, "restored_paths", &Value::Object(paths).to_string())?;
    meta_put(
        &tx,
        "restored",
        &json!({"at": at, "file": src_text, "sha256": backup_sha256, "from": from, "to": to})
            .to_string(),
    )?;
    let (.., counts) = facts(&tx)?;
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
                   "heartbeat": b.heartbeat.map(iso_ms)},
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
    let (_, signed) = append_op_signed(&tx, opts.signer.as_deref(), now, OP_RESTORE, &text)?;
    tx.commit()?;
    integrity(&c)?;
    c.close().map_err(|(_, e)| OpsError::Sqlite(e))?;
    let leftover_wal = with_suffix(&tmp, "-wal");
    if leftover_wal.metadata().is_ok_and(|m| m.len() > 0) {
        return Err(OpsError::Integrity(format!(
            "the restored copy did not close cleanly ({} remains); the live store was not touched",
            leftover_wal.display()
        ))
        .into());
    }
    agentmbx_protocol::failpoint::hit("restore:before-rename");

    // 5. The swap: the old store's WAL never meets the new file.
    fsync(&tmp)?;
    rollback_copy.armed = false;
    for suffix in ["-wal", "-shm", "-journal"] {
        let old = with_suffix(&live, suffix);
        let Ok(meta) = old.metadata() else { continue };
        if suffix == "-wal" && meta.len() > 0 {
            private_dir(&rollback_dir)?;
            let kept = with_suffix(&rollback, "-wal-leftover");
            std::fs::rename(&old, &kept).map_err(io(&kept))?;
        } else {
            std::fs::remove_file(&old).map_err(io(&old))?;
        }
    }
    std::fs::rename(&tmp, &live).map_err(io(&live))?;
    working.armed = false;
    fsync(dir)?;
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::{read_verified_log, verify_receipt, RelayOpSigner};
    use crate::store::{
        AccountBinding, AuthorityStrength, DenyEntry, DenyKind, EncAdV2, EnrolRequest, Expiry,
        OpEntry, OpenOptions, PushBatch, PushItem, PushTarget, SenderList, SqliteStore,
    };
    use crate::store::{DirectoryStore, ItemStore, OperationsStore};
    use agentmbx_protocol::keys::HostKey;

    const T0: i64 = 1_800_000_000_000;

    fn host() -> String {
        HostKey::generate().public().to_b64()
    }

    struct Relay {
        key: HostKey,
    }

    impl Relay {
        fn new() -> Self {
            Relay {
                key: HostKey::generate(),
            }
        }

        fn open(&self, dir: &Path, now: i64) -> SqliteStore {
            let lock = StoreLock::acquire(dir, 0, now).expect("lock");
            let options = OpenOptions {
                lock_wait_ms: 0,
                ..OpenOptions::default()
            };
            SqliteStore::open_signed(lock, self.signer(), now, options).expect("open")
        }

        fn signer(&self) -> Arc<dyn OpSigner> {
            RelayOpSigner::shared(self.key.clone())
        }

        fn opts(&self, now_ms: i64, force: bool) -> RestoreOptions {
            RestoreOptions {
                force,
                now_ms,
                signer: Some(self.signer()),
            }
        }
    }

    fn enrol(store: &SqliteStore, key: &str, name: &str, now: i64) {
        store
            .enrol(EnrolRequest {
                host_pubkey: key.to_owned(),
                host_name: name.to_owned(),
                owner_fp: String::new(),
                account: None,
                authorized_by: "host-key-challenge".into(),
                strength: AuthorityStrength::HostKeyChallenge,
                now_ms: now,
            })
            .expect("enrol");
    }

    fn push(store: &SqliteStore, sender: &str, target: &str, id: &str, now: i64) {
        store
            .push(PushBatch {
                sender_pubkey: sender.to_owned(),
                sender_host: "alpha".into(),
                now_ms: now,
                expiry: Expiry::Never,
                items: vec![PushItem {
                    item_id: id.to_owned(),
                    kind: "envelope".into(),
                    targets: vec![PushTarget {
                        target_pubkey: target.to_owned(),
                        wire: format!("wire of {id}").into_bytes(),
                    }],
                }],
            })
            .expect("push");
    }

    fn raw(dir: &Path) -> Connection {
        Connection::open(dir.join(DB_FILE)).expect("raw")
    }

    fn one<T: rusqlite::types::FromSql>(c: &Connection, sql: &str, p: &str) -> Option<T> {
        c.query_row(sql, [p], |r| r.get(0)).optional().expect(sql)
    }

    fn names(dir: &Path) -> Vec<String> {
        let mut v: Vec<String> = std::fs::read_dir(dir)
            .expect("ls")
            .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
            .collect();
        v.sort();
        v
    }

    fn backup_now(dir: &Path, out: &Path, name: &str) -> PathBuf {
        let file = out.join(name);
        crate::ops::backup(dir, &file, T0).expect("backup");
        file
    }

    /// The scene of most tests: a store with two enrolled hosts, a deny entry, an allowlist,
    /// an enc-key record and queued items, backed up; then, after the backup, a revocation, a
    /// new deny entry, a new enrolment, a newer allowlist and record, an account binding and
    /// more items.
    struct Scene {
        relay: Relay,
        dir: tempfile::TempDir,
        out: tempfile::TempDir,
        backup: PathBuf,
        alpha: String,
        beta: String,
        gamma: String,
        sender: String,
    }

    fn scene() -> Scene {
        let relay = Relay::new();
        let dir = tempfile::tempdir().expect("dir");
        let out = tempfile::tempdir().expect("out");
        let (alpha, beta, gamma, sender) = (host(), host(), host(), host());
        let store = relay.open(dir.path(), T0);
        enrol(&store, &alpha, "alpha", T0);
        enrol(&store, &beta, "beta", T0);
        store
            .deny_logged(
                DenyEntry {
                    kind: DenyKind::Client,
                    value: "client-before".into(),
                    until_ms: None,
                    at_ms: T0,
                },
                OpEntry {
                    at_ms: T0,
                    op: "relay-deny".into(),
                    receipt: json!({"v": 1, "type": "relay-deny", "value": "client-before"}),
                },
            )
            .expect("deny");
        let list = |iat: i64| SenderList {
            target_pubkey: beta.clone(),
            senders: vec![sender.clone()],
            iat_ms: iat,
            record: format!("{{\"iat\":{iat}}}"),
            sig: format!("sig-{iat}"),
        };
        store.put_sender_list(list(T0)).expect("list");
        let ad = |at: i64| EncAdV2 {
            host_pubkey: beta.clone(),
            enc_pub: format!("enc-{at}"),
            record: format!("{{\"at\":{at}}}"),
            sig: format!("adsig-{at}"),
            at_ms: at,
        };
        store.put_enc_ad_v2(ad(T0)).expect("ad");
        for i in 0..3 {
            push(&store, &sender, &beta, &format!("before-{i}"), T0 + i);
        }
        let backup = backup_now(dir.path(), out.path(), "backup.db");

        // After the backup.
        crate::admin::revoke(&store, &alpha, T0 + 100).expect("revoke");
        crate::admin::deny(
            &store,
            "client-after",
            Some(DenyKind::Client),
            None,
            T0 + 110,
        )
        .expect("deny");
        enrol(&store, &gamma, "gamma", T0 + 120);
        store.put_sender_list(list(T0 + 130)).expect("newer list");
        store.put_enc_ad_v2(ad(T0 + 140)).expect("newer ad");
        store
            .enrol_bound(
                EnrolRequest {
                    host_pubkey: beta.clone(),
                    host_name: "beta".into(),
                    owner_fp: String::new(),
                    account: Some("acct".into()),
                    authorized_by: "account".into(),
                    strength: AuthorityStrength::Account,
                    now_ms: T0 + 150,
                },
                Some(AccountBinding {
                    host_pubkey: beta.clone(),
                    cloud_jkt: "jkt".into(),
                    client_id: "cli".into(),
                    sub: "sub".into(),
                    org: None,
                    at_ms: T0 + 150,
                }),
            )
            .expect("bound");
        for i in 0..2 {
            push(
                &store,
                &sender,
                &beta,
                &format!("after-{i}"),
                T0 + 10_000 + i,
            );
        }
        store.close().expect("close");
        Scene {
            relay,
            dir,
            out,
            backup,
            alpha,
            beta,
            gamma,
            sender,
        }
    }

    #[test]
    fn a_restore_rotates_the_epoch_keeps_a_rollback_and_never_brings_back_what_was_taken_away() {
        let s = scene();
        let dir = s.dir.path();
        let before = raw(dir);
        let current_epoch: String =
            one(&before, "SELECT v FROM meta WHERE k = ?1", "epoch").expect("epoch");
        let current_ops: i64 = before
            .query_row("SELECT COUNT(*) FROM ops", [], |r| r.get(0))
            .expect("ops");
        let floor: i64 = one(
            &before,
            "SELECT next_seq FROM seqs WHERE target_pubkey = ?1",
            &s.beta,
        )
        .expect("floor");
        drop(before);
        let backup_epoch: String = one(
            &Connection::open(&s.backup).expect("backup"),
            "SELECT v FROM meta WHERE k = ?1",
            "epoch",
        )
        .expect("epoch");
        let backup_sha = crate::ops::sha256_file(&s.backup).expect("sha");

        let now = T0 + 60_000;
        let r = restore(dir, &s.backup, &s.relay.opts(now, false), None).expect("restore");

        // The receipt, signed, and the newest entry of the log; the log before it is the
        // replaced store's, whole.
        assert_eq!(r["type"], "relay-restore");
        assert_eq!(r["v"], 1);
        assert_eq!(r["at"], iso_ms(now).as_str());
        assert_eq!(
            r["backup"]["file"],
            absolute(&s.backup).display().to_string().as_str()
        );
        assert_eq!(r["backup"]["sha256"], backup_sha.as_str());
        assert_eq!(r["epoch"]["from"], backup_epoch.as_str());
        let new_epoch = r["epoch"]["to"].as_str().expect("to").to_owned();
        assert_ne!(new_epoch, backup_epoch);
        assert_ne!(new_epoch, current_epoch);
        assert_eq!(r["replaced"]["epoch"], current_epoch.as_str());
        assert_eq!(r["replaced"]["readable"], true);
        assert_eq!(
            r["carried"],
            json!({"rotations": 0, "revocations": 1, "sender_lists": 1, "enc_ads": 0,
                   "enc_ad_records": 1, "seq_floors": 1, "deny": 1, "account_bindings": 1,
                   "ops": current_ops})
        );
        assert_eq!(
            r["counts"]["items"], 3,
            "the backup's items, not the later ones"
        );
        let key = s.relay.key.public();
        assert!(verify_receipt(&r, &key));
        let log = read_verified_log(dir, 1_000).expect("log");
        assert_eq!(log.len() as i64, current_ops + 1);
        assert_eq!(log[0].record.op, OP_RESTORE);
        assert_eq!(log[0].record.receipt, r);
        assert!(log.iter().all(|e| e.verified), "{log:?}");

        let c = raw(dir);
        let meta = |k: &str| one::<String>(&c, "SELECT v FROM meta WHERE k = ?1", k);
        assert_eq!(meta("epoch").as_deref(), Some(new_epoch.as_str()));
        assert_eq!(meta("heartbeat"), Some(now.to_string()));
        let restored: Value =
            serde_json::from_str(&meta("restored").expect("restored")).expect("json");
        assert_eq!(restored["sha256"], backup_sha.as_str());
        assert_eq!(restored["to"], new_epoch.as_str());
        // Revoked stays revoked; the post-backup enrolment is not carried; both deny entries.
        let revoked: Option<i64> = one(
            &c,
            "SELECT revoked_at FROM enrolments WHERE host_pubkey = ?1",
            &s.alpha,
        );
        assert_eq!(revoked, Some(T0 + 100));
        let gamma: Option<String> = one(
            &c,
            "SELECT host_name FROM enrolments WHERE host_pubkey = ?1",
            &s.gamma,
        );
        assert_eq!(gamma, None, "enrolled after the backup: enrols again");
        let denied: Vec<String> = c
            .prepare("SELECT value FROM deny ORDER BY value")
            .expect("prep")
            .query_map([], |r| r.get(0))
            .expect("q")
            .collect::<Result<_, _>>()
            .expect("rows");
        assert_eq!(denied, ["client-after", "client-before"]);
        // Newer allowlist and record, the higher seq floor, the binding of a known key.
        assert_eq!(
            one::<i64>(
                &c,
                "SELECT iat FROM sender_lists WHERE target_pubkey = ?1",
                &s.beta
            ),
            Some(T0 + 130)
        );
        assert_eq!(
            one::<i64>(
                &c,
                "SELECT at FROM enc_ad_records WHERE host_pubkey = ?1",
                &s.beta
            ),
            Some(T0 + 140)
        );
        assert_eq!(
            one::<i64>(
                &c,
                "SELECT next_seq FROM seqs WHERE target_pubkey = ?1",
                &s.beta
            ),
            Some(floor)
        );
        assert_eq!(
            one::<String>(
                &c,
                "SELECT cloud_jkt FROM account_bindings WHERE host_pubkey = ?1",
                &s.beta
            ),
            Some("jkt".into())
        );
        let ids: Vec<String> = c
            .prepare("SELECT item_id FROM items ORDER BY seq")
            .expect("prep")
            .query_map([], |r| r.get(0))
            .expect("q")
            .collect::<Result<_, _>>()
            .expect("rows");
        assert_eq!(ids, ["before-0", "before-1", "before-2"]);
        drop(c);

        // Nothing left over but the store, its lock, and the rollback copy.
        assert_eq!(names(dir), ["relay.db", "relay.lock", "rollback"]);
        let rollback = r["replaced"]["rollback"].as_str().expect("rollback");
        assert_eq!(
            names(&dir.join(ROLLBACK_DIR)),
            [Path::new(rollback)
                .file_name()
                .expect("name")
                .to_string_lossy()
                .into_owned()]
        );
        assert_eq!(
            r["rollback"],
            format!(
                "agentmbx relay restore {rollback} --store-dir {}",
                absolute(dir).display()
            )
            .as_str()
        );

        // The restored store opens, and serve would not rotate again for the backup's age.
        let store = s.relay.open(dir, now + 1_000);
        assert_eq!(store.epoch().expect("epoch"), new_epoch);
        assert_eq!(
            crate::ops::rotate_if_stale(&store, "s", now + 1_000).expect("rule"),
            None
        );
        // A new push gets a seq above every seq the replaced store gave out.
        push(&store, &s.sender, &s.beta, "later", T0 + 20_000);
        let head = store.info_for(&s.beta).expect("info").head_seq;
        assert!(head >= floor, "{head} < {floor}");
        store.close().expect("close");

        // The rollback command brings the replaced store back (itself a restore).
        let r2 = restore(
            dir,
            Path::new(rollback),
            &s.relay.opts(now + 2_000, false),
            None,
        )
        .expect("roll back");
        assert_ne!(r2["epoch"]["to"], new_epoch.as_str());
        let c = raw(dir);
        assert_eq!(
            one::<String>(
                &c,
                "SELECT host_name FROM enrolments WHERE host_pubkey = ?1",
                &s.gamma
            ),
            Some("gamma".into())
        );
        let after: i64 = c
            .query_row(
                "SELECT COUNT(*) FROM items WHERE item_id LIKE 'after-%'",
                [],
                |r| r.get(0),
            )
            .expect("count");
        assert_eq!(after, 2);
        // The log kept growing across both restores.
        let log = read_verified_log(dir, 1_000).expect("log");
        assert_eq!(log.iter().filter(|e| e.record.op == OP_RESTORE).count(), 2);
        assert!(log.iter().all(|e| e.verified));
    }

    /// The queue of `target` in the store in `dir`: `(seq, item_id, origin_target)`.
    fn queue_of(dir: &Path, target: &str) -> Vec<(i64, String, Option<String>)> {
        raw(dir)
            .prepare("SELECT seq, item_id, origin_target FROM items WHERE target_pubkey = ?1 ORDER BY seq")
            .expect("prep")
            .query_map([target], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)))
            .expect("q")
            .collect::<Result<_, _>>()
            .expect("rows")
    }

    #[test]
    fn rotations_made_after_the_backup_are_replayed_on_it() {
        use crate::store::{RotateOutcome, RotateRequest};
        let relay = Relay::new();
        let dir = tempfile::tempdir().expect("dir");
        let out = tempfile::tempdir().expect("out");
        let d = dir.path();
        let (old, new, beta, sender) = (host(), host(), host(), host());
        let (d1, d2, d3) = (host(), host(), host());
        let store = relay.open(d, T0);
        store
            .enrol(EnrolRequest {
                host_pubkey: old.clone(),
                host_name: "laptop".into(),
                owner_fp: "owner".into(),
                account: Some("acct-1".into()),
                authorized_by: "account-token".into(),
                strength: AuthorityStrength::Account,
                now_ms: T0,
            })
            .expect("enrol");
        enrol(&store, &beta, "beta", T0);
        enrol(&store, &sender, "sender", T0);
        enrol(&store, &d1, "desk", T0);
        let list = |target: &str, senders: &[&str]| SenderList {
            target_pubkey: target.to_owned(),
            senders: senders.iter().map(|s| (*s).to_owned()).collect(),
            iat_ms: T0,
            record: "{}".into(),
            sig: "sig".into(),
        };
        store
            .put_sender_list(list(&old, &[&sender]))
            .expect("own list");
        store
            .put_sender_list(list(&beta, &[&old, &sender]))
            .expect("list");
        for i in 0..3 {
            push(&store, &sender, &old, &format!("queued-{i}"), T0 + 10 + i);
        }
        push(&store, &sender, &d1, "desk-queued", T0 + 20);
        let backup = backup_now(d, out.path(), "backup.db");

        // After the backup: the laptop rotates to a key the backup never saw, the desk twice.
        let rotate = |old: &str, new: &str, name: &str, at: i64| {
            store
                .rotate(RotateRequest {
                    old_pubkey: old.to_owned(),
                    new_pubkey: new.to_owned(),
                    host_name: name.to_owned(),
                    now_ms: at,
                })
                .expect("rotate")
        };
        assert!(matches!(
            rotate(&old, &new, "laptop", T0 + 1_000),
            RotateOutcome::Rotated { moved: 3 }
        ));
        assert!(matches!(
            rotate(&d1, &d2, "desk", T0 + 2_000),
            RotateOutcome::Rotated { moved: 1 }
        ));
        assert!(matches!(
            rotate(&d2, &d3, "desk", T0 + 3_000),
            RotateOutcome::Rotated { moved: 1 }
        ));
        push(&store, &sender, &new, "after", T0 + 4_000);
        store.close().expect("close");
        let floor_new: i64 = one(
            &raw(d),
            "SELECT next_seq FROM seqs WHERE target_pubkey = ?1",
            &new,
        )
        .expect("floor");

        let r = restore(d, &backup, &relay.opts(T0 + 60_000, false), None).expect("restore");
        assert_eq!(r["carried"]["rotations"], 3, "{r}");
        assert_eq!(r["carried"]["revocations"], 0, "{r}");

        // The old keys are revoked at their rotation's time; the new keys hold the enrolment.
        let c = raw(d);
        let revoked_at = |k: &str| {
            one::<Option<i64>>(
                &c,
                "SELECT revoked_at FROM enrolments WHERE host_pubkey = ?1",
                k,
            )
            .expect("row")
        };
        assert_eq!(revoked_at(&old), Some(T0 + 1_000));
        assert_eq!(revoked_at(&d1), Some(T0 + 2_000));
        assert_eq!(revoked_at(&d2), Some(T0 + 3_000));
        assert_eq!(revoked_at(&new), None);
        assert_eq!(revoked_at(&d3), None);
        let enrolment: (String, String, Option<String>, String) = c
            .query_row(
                "SELECT host_name, owner_fp, account, authorized_by FROM enrolments
                  WHERE host_pubkey = ?1",
                [&new],
                |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?)),
            )
            .expect("new enrolment");
        assert_eq!(
            enrolment,
            (
                "laptop".into(),
                "owner".into(),
                Some("acct-1".into()),
                "account-token".into()
            )
        );
        assert_eq!(
            one::<String>(
                &c,
                "SELECT host_name FROM enrolments WHERE host_pubkey = ?1",
                &d3
            )
            .as_deref(),
            Some("desk")
        );
        // The backup's queue of each old key waits for the new key, above every seq the
        // replaced store gave out, naming the key the sender pushed to.
        let q = queue_of(d, &new);
        assert_eq!(
            q.iter().map(|(_, id, _)| id.as_str()).collect::<Vec<_>>(),
            ["queued-0", "queued-1", "queued-2"]
        );
        assert!(q
            .iter()
            .all(|(seq, _, origin)| *seq >= floor_new && origin.as_deref() == Some(old.as_str())));
        assert!(queue_of(d, &old).is_empty());
        let q = queue_of(d, &d3);
        assert_eq!(q.len(), 1);
        assert_eq!(
            (q[0].1.as_str(), q[0].2.as_deref()),
            ("desk-queued", Some(d1.as_str()))
        );
        assert!(queue_of(d, &d1).is_empty() && queue_of(d, &d2).is_empty());
        // Allowlists: the old key's own list is the new key's, and the new key replaces the
        // old one in the others'.
        let senders = |target: &str| {
            one::<String>(
                &c,
                "SELECT senders FROM sender_lists WHERE target_pubkey = ?1",
                target,
            )
        };
        assert_eq!(senders(&new), Some(json!([sender]).to_string()));
        assert_eq!(senders(&old), None);
        assert_eq!(senders(&beta), Some(json!([new, sender]).to_string()));
        // The markers answer a repeated rotation as the replaced store did.
        for (o, n) in [(&old, &new), (&d1, &d2), (&d2, &d3)] {
            assert_eq!(
                one::<String>(
                    &c,
                    "SELECT v FROM meta WHERE k = ?1",
                    &format!("rotation:{o}")
                )
                .as_deref(),
                Some(n.as_str())
            );
        }
        assert!(
            crate::store::assert_usage_matches(&c) > 0,
            "the replayed moves are counted"
        );
        drop(c);
        let store = relay.open(d, T0 + 61_000);
        assert_eq!(
            store
                .rotate(RotateRequest {
                    old_pubkey: old.clone(),
                    new_pubkey: new.clone(),
                    host_name: "laptop".into(),
                    now_ms: T0 + 61_000,
                })
                .expect("again"),
            RotateOutcome::AlreadyRotated
        );
        store.close().expect("close");
    }

    #[test]
    fn a_rotation_of_a_key_enrolled_after_the_backup_is_a_revocation_with_its_marker() {
        use crate::store::{RotateOutcome, RotateRequest};
        let s = scene();
        let d = s.dir.path();
        let store = s.relay.open(d, T0 + 20_000);
        let new = host();
        assert!(matches!(
            store
                .rotate(RotateRequest {
                    old_pubkey: s.gamma.clone(),
                    new_pubkey: new.clone(),
                    host_name: "gamma".into(),
                    now_ms: T0 + 20_000,
                })
                .expect("rotate"),
            RotateOutcome::Rotated { .. }
        ));
        store.close().expect("close");
        let r = restore(d, &s.backup, &s.relay.opts(T0 + 60_000, false), None).expect("restore");
        assert_eq!(r["carried"]["rotations"], 0, "{r}");
        let c = raw(d);
        assert_eq!(
            one::<Option<i64>>(
                &c,
                "SELECT revoked_at FROM enrolments WHERE host_pubkey = ?1",
                &s.gamma
            ),
            Some(Some(T0 + 20_000))
        );
        assert_eq!(
            one::<String>(
                &c,
                "SELECT host_name FROM enrolments WHERE host_pubkey = ?1",
                &new
            ),
            None,
            "enrolled after the backup: enrols again"
        );
        assert_eq!(
            one::<String>(
                &c,
                "SELECT v FROM meta WHERE k = ?1",
                &format!("rotation:{}", s.gamma)
            )
            .as_deref(),
            Some(new.as_str())
        );
    }

    #[test]
    fn a_restore_is_refused_while_the_lock_is_held_or_a_lockless_heartbeat_is_fresh() {
        let s = scene();
        let dir = s.dir.path();
        let bytes = std::fs::read(dir.join(DB_FILE)).expect("read");
        let store = s.relay.open(dir, T0);
        let e = restore(dir, &s.backup, &s.relay.opts(T0, true), None).expect_err("held");
        assert_eq!(e.code(), "RELAY_RUNNING");
        assert!(
            e.to_string()
                .starts_with("RELAY_RUNNING: a relay is running on"),
            "{e}"
        );
        store.close().expect("close");
        assert_eq!(std::fs::read(dir.join(DB_FILE)).expect("read"), bytes);
        assert_eq!(names(dir), ["relay.db", "relay.lock"]);

        // No relay.lock (a store from before the lock) and a heartbeat less than 90 s old (or
        // in the future): refused unless --force; 90 s old: fine.
        let now = T0 + 1_000_000;
        for (age, force, ok) in [
            (89_999, false, false),
            (-5_000, false, false),
            (89_999, true, true),
            (90_000, false, true),
        ] {
            std::fs::remove_file(dir.join(LOCK_FILE)).expect("rm lock");
            raw(dir)
                .execute(
                    "INSERT INTO meta (k, v) VALUES ('heartbeat', ?1)
                     ON CONFLICT(k) DO UPDATE SET v = excluded.v",
                    [(now - age).to_string()],
                )
                .expect("beat");
            let r = restore(dir, &s.backup, &s.relay.opts(now, force), None);
            match (ok, r) {
                (true, Ok(_)) => {}
                (false, Err(e @ RestoreError::FreshHeartbeat { .. })) => {
                    assert!(e.to_string().contains("no relay.lock"), "{e}");
                    assert_eq!(e.code(), "RELAY_RUNNING");
                    // Nothing was created: a second try is refused the same way.
                    assert!(!dir.join(LOCK_FILE).exists());
                    assert!(matches!(
                        restore(dir, &s.backup, &s.relay.opts(now, false), None),
                        Err(RestoreError::FreshHeartbeat { .. })
                    ));
                    std::fs::write(dir.join(LOCK_FILE), b"").expect("lock file back");
                }
                (_, other) => panic!("age {age} force {force}: {other:?}"),
            }
        }
    }

    #[test]
    fn backups_that_are_not_this_relays_store_are_refused_and_nothing_changes() {
        let s = scene();
        let dir = s.dir.path();
        let out = s.out.path();
        let bytes = std::fs::read(dir.join(DB_FILE)).expect("read");
        let opts = s.relay.opts(T0 + 5_000, false);

        let e = restore(dir, &out.join("missing.db"), &opts, None).expect_err("missing");
        assert_eq!(e.code(), "NO_BACKUP");
        let e = restore(dir, &dir.join(DB_FILE), &opts, None).expect_err("same");
        assert_eq!(e.code(), "SAME_FILE");

        let junk = out.join("junk.db");
        std::fs::write(&junk, vec![7u8; 8192]).expect("junk");
        let e = restore(dir, &junk, &opts, None).expect_err("junk");
        assert_eq!(e.code(), "NOT_A_STORE", "{e}");
        let empty = out.join("empty.db");
        Connection::open(&empty)
            .expect("db")
            .execute_batch("CREATE TABLE t (x); CREATE TABLE meta (k TEXT, v TEXT);")
            .expect("tables");
        let e = restore(dir, &empty, &opts, None).expect_err("no epoch");
        assert!(e.to_string().contains("no epoch or relay key"), "{e}");

        let newer = out.join("newer.db");
        std::fs::copy(&s.backup, &newer).expect("copy");
        Connection::open(&newer)
            .expect("db")
            .execute_batch("PRAGMA user_version = 99")
            .expect("version");
        let e = restore(dir, &newer, &opts, None).expect_err("schema");
        assert_eq!(e.code(), "SCHEMA", "{e}");
        assert!(e.to_string().contains("schema 99"), "{e}");

        // Another relay's store: refused against the relay key; and this relay's backup over
        // a store of another key is refused against that store.
        let other = Relay::new();
        let other_dir = tempfile::tempdir().expect("other");
        other.open(other_dir.path(), T0).close().expect("close");
        let foreign = backup_now(other_dir.path(), out, "foreign.db");
        let e = restore(dir, &foreign, &opts, None).expect_err("other");
        assert_eq!(e.code(), "OTHER_RELAY");
        assert!(e.to_string().contains("the relay key is"), "{e}");
        let other_bytes = std::fs::read(other_dir.path().join(DB_FILE)).expect("read");
        let e = restore(other_dir.path(), &s.backup, &opts, None).expect_err("other store");
        assert_eq!(e.code(), "OTHER_RELAY");
        assert!(e.to_string().contains("the store is"), "{e}");
        assert_eq!(
            std::fs::read(other_dir.path().join(DB_FILE)).expect("read"),
            other_bytes
        );

        assert_eq!(std::fs::read(dir.join(DB_FILE)).expect("read"), bytes);
        assert_eq!(
            names(dir),
            ["relay.db", "relay.lock"],
            "no rollback copy, no working copy"
        );
        // Refused against the store, the rollback directory exists but holds nothing.
        assert!(names(&other_dir.path().join(ROLLBACK_DIR)).is_empty());
    }

    #[test]
    fn an_unreadable_current_store_needs_force_and_is_kept_as_it_was() {
        let s = scene();
        let dir = s.dir.path();
        let junk = vec![9u8; 16_384];
        std::fs::write(dir.join(DB_FILE), &junk).expect("junk");
        let e = restore(dir, &s.backup, &s.relay.opts(T0 + 1, false), None).expect_err("refused");
        assert_eq!(e.code(), "CURRENT_UNREADABLE", "{e}");
        assert!(e.to_string().contains("--force"), "{e}");
        assert_eq!(std::fs::read(dir.join(DB_FILE)).expect("read"), junk);

        let r = restore(dir, &s.backup, &s.relay.opts(T0 + 2, true), None).expect("forced");
        assert_eq!(r["replaced"]["readable"], false);
        assert_eq!(r["carried"]["revocations"], 0);
        let rollback = r["replaced"]["rollback"].as_str().expect("rollback");
        assert_eq!(std::fs::read(rollback).expect("rollback"), junk);
        assert!(r["rollback"].as_str().expect("undo").ends_with(" --force"));
        // The restored store is the backup's: alpha is live there (its revocation was in the
        // store that could not be read).
        let c = raw(dir);
        assert_eq!(
            one::<Option<i64>>(
                &c,
                "SELECT revoked_at FROM enrolments WHERE host_pubkey = ?1",
                &s.alpha
            ),
            Some(None)
        );
    }

    #[test]
    fn each_path_is_remembered_across_restores_and_into_an_empty_directory() {
        let s = scene();
        let out = s.out.path();
        // Into a directory with no store: nothing replaced, nothing to undo.
        let fresh = tempfile::tempdir().expect("fresh");
        let target = fresh.path().join("store");
        assert_eq!(restored_from(&target, &s.backup).expect("read"), None);
        let r = restore(&target, &s.backup, &s.relay.opts(T0 + 1, false), None).expect("restore");
        assert_eq!(r["replaced"], Value::Null);
        assert_eq!(r["rollback"], Value::Null);
        assert_eq!(
            restored_from(&target, &s.backup).expect("read"),
            Some(iso_ms(T0 + 1))
        );
        // A second backup restored over it: both paths are remembered.
        let second = backup_now(s.dir.path(), out, "second.db");
        restore(&target, &second, &s.relay.opts(T0 + 2, false), None).expect("again");
        assert!(restored_from(&target, &s.backup).expect("read").is_some());
        assert!(restored_from(&target, &second).expect("read").is_some());
        assert_eq!(
            restored_from(&target, &out.join("other.db")).expect("read"),
            None
        );
    }

    /// The live store's `relay.db` bytes, and the rollback directory's names.
    fn live_state(dir: &Path) -> (Vec<u8>, Vec<String>) {
        let rollback = dir.join(ROLLBACK_DIR);
        (
            std::fs::read(dir.join(DB_FILE)).expect("live"),
            if rollback.is_dir() {
                names(&rollback)
            } else {
                Vec::new()
            },
        )
    }

    /// A copy of `backup` named `name` in `out`, changed by `sql`.
    fn altered(backup: &Path, out: &Path, name: &str, sql: &str) -> PathBuf {
        let file = out.join(name);
        std::fs::copy(backup, &file).expect("copy");
        let c = Connection::open(&file).expect("open");
        c.execute_batch(sql).expect(sql);
        c.close().expect("close");
        file
    }

    #[test]
    fn a_backup_with_triggers_views_or_a_schema_not_this_binarys_is_refused_and_nothing_changes() {
        let s = scene();
        let dir = s.dir.path();
        let before = live_state(dir);
        let v = SCHEMA_VERSION;
        // One of the schema's own triggers, its body changed: same name, another definition.
        let own = "DROP TRIGGER items_usage_insert;
            CREATE TRIGGER items_usage_insert AFTER INSERT ON items BEGIN
              DELETE FROM deny; END;";
        for (name, sql, named) in [
            (
                "trigger-deny.db",
                "CREATE TRIGGER t1 AFTER INSERT ON deny BEGIN DELETE FROM deny \
                 WHERE kind = new.kind AND value = new.value; END;"
                    .to_owned(),
                "trigger \"t1\" that schema".to_owned(),
            ),
            (
                "trigger-revoke.db",
                "CREATE TRIGGER t2 AFTER UPDATE ON enrolments BEGIN UPDATE enrolments \
                 SET revoked_at = NULL WHERE host_pubkey = new.host_pubkey; END;"
                    .to_owned(),
                "trigger \"t2\" that schema".to_owned(),
            ),
            (
                "trigger-modified.db",
                own.to_owned(),
                format!("trigger \"items_usage_insert\" differs from its definition in schema {v}"),
            ),
            (
                "trigger-missing.db",
                "DROP TRIGGER items_usage_delete;".to_owned(),
                format!("trigger \"items_usage_delete\" of schema {v} is missing"),
            ),
            (
                "view.db",
                "CREATE VIEW v1 AS SELECT * FROM deny;".to_owned(),
                "view \"v1\" that schema".to_owned(),
            ),
            (
                "no-bindings.db",
                "DROP TABLE account_bindings;".to_owned(),
                format!("table \"account_bindings\" of schema {v} is missing"),
            ),
            (
                "extra.db",
                "CREATE TABLE extra (x); CREATE INDEX deny_extra ON deny(value);".to_owned(),
                format!("that schema {v} does not define"),
            ),
        ] {
            let file = altered(&s.backup, s.out.path(), name, &sql);
            let e = restore(dir, &file, &s.relay.opts(T0 + 60_000, true), None).expect_err(name);
            assert_eq!(e.code(), "NOT_A_STORE", "{name}: {e}");
            let text = e.to_string();
            assert!(
                text.contains(name) && text.contains(&named),
                "{name}: {text}"
            );
            assert_eq!(live_state(dir), before, "{name}");
            assert!(
                !names(dir)
                    .iter()
                    .any(|n| n.starts_with("relay.db.restore-")),
                "{name}"
            );
        }
        // The backup as it was restores, with the revocation and the deny entry carried, and
        // exactly the schema's own triggers.
        let r = restore(dir, &s.backup, &s.relay.opts(T0 + 60_000, false), None).expect("ok");
        assert_eq!(r["carried"]["revocations"], 1);
        let c = raw(dir);
        let objects = |kind: &str| -> Vec<String> {
            let mut st = c
                .prepare("SELECT name FROM sqlite_master WHERE type = ?1 ORDER BY name")
                .expect("prepare");
            let out = st
                .query_map([kind], |r| r.get(0))
                .expect("query")
                .collect::<Result<Vec<String>, _>>()
                .expect("rows");
            out
        };
        assert_eq!(
            objects("trigger"),
            [
                "items_usage_delete",
                "items_usage_insert",
                "items_usage_update"
            ]
        );
        assert!(objects("view").is_empty());
        assert!(crate::store::assert_usage_matches(&c) > 0);
    }

    #[test]
    fn a_backups_usage_counters_are_recomputed_from_its_items() {
        let s = scene();
        let dir = s.dir.path();
        let file = altered(
            &s.backup,
            s.out.path(),
            "spoiled-counters.db",
            "UPDATE target_usage SET items = 1000000, bytes = 1000000000;
             DELETE FROM sender_usage;",
        );
        restore(dir, &file, &s.relay.opts(T0 + 60_000, false), None).expect("restored");
        assert!(crate::store::assert_usage_matches(&raw(dir)) > 0);
    }

    #[test]
    fn the_backup_being_restored_is_never_removed_only_working_copies_this_code_names_are() {
        let s = scene();
        let dir = s.dir.path();
        let bytes = std::fs::read(&s.backup).expect("backup");
        let leftover = dir.join(format!("{DB_FILE}.restore-2020-01-01T00-00-00-000Z"));
        let leftover_wal = with_suffix(&leftover, "-wal");
        let notes = dir.join(format!("{DB_FILE}.restore-notes.txt"));
        for f in [&leftover, &leftover_wal, &notes] {
            std::fs::write(f, b"x").expect("write");
        }
        for (i, name) in [
            format!("{DB_FILE}.restore-mybackup.db"),
            format!("{DB_FILE}.restore-2021-01-01T00-00-00-000Z"),
        ]
        .iter()
        .enumerate()
        {
            let src = dir.join(name);
            std::fs::copy(&s.backup, &src).expect("copy");
            let now = T0 + 60_000 + i64::try_from(i).expect("i");
            restore(dir, &src, &s.relay.opts(now, false), None).expect(name);
            assert_eq!(std::fs::read(&src).expect("source kept"), bytes, "{name}");
        }
        assert!(!leftover.exists() && !leftover_wal.exists());
        assert!(notes.exists());
    }

    #[test]
    fn a_failure_writing_the_rollback_copy_is_an_io_failure_that_never_suggests_force() {
        let s = scene();
        let dir = s.dir.path();
        let now = T0 + 60_000;
        let stamp = iso_ms(now).replace([':', '.'], "-");
        let rollback = dir.join(ROLLBACK_DIR);
        // The copy's partial name is taken by a directory: creating it fails like a full disk.
        let blocker = rollback.join(format!("relay-{stamp}.db.partial-{}", std::process::id()));
        std::fs::create_dir_all(blocker.join("x")).expect("blocker");
        let before = live_state(dir);
        for force in [false, true] {
            let e = restore(dir, &s.backup, &s.relay.opts(now, force), None).expect_err("fails");
            assert_eq!(e.code(), "FAILED", "{e}");
            let text = e.to_string();
            assert!(
                !text.contains("--force") && !text.contains("CURRENT_UNREADABLE"),
                "{text}"
            );
            assert_eq!(live_state(dir), before, "force {force}");
        }
    }

    #[test]
    fn a_failed_forced_copy_leaves_no_file_under_a_rollback_name_and_a_directory_store_is_named() {
        let s = scene();
        let dir = s.dir.path();
        // relay.db is unreadable and its -wal is a directory: copying fails midway.
        std::fs::write(dir.join(DB_FILE), vec![9u8; 8_192]).expect("junk");
        std::fs::create_dir(dir.join("relay.db-wal")).expect("wal dir");
        let e = restore(dir, &s.backup, &s.relay.opts(T0 + 60_000, true), None).expect_err("io");
        assert_eq!(e.code(), "FAILED", "{e}");
        assert!(names(&dir.join(ROLLBACK_DIR)).is_empty(), "{e}");
        assert_eq!(
            std::fs::read(dir.join(DB_FILE)).expect("live"),
            vec![9u8; 8_192]
        );

        // relay.db a directory: a clear refusal, with or without --force.
        let other = tempfile::tempdir().expect("other");
        std::fs::create_dir(other.path().join(DB_FILE)).expect("dir");
        for force in [false, true] {
            let e = restore(
                other.path(),
                &s.backup,
                &s.relay.opts(T0 + 60_000, force),
                None,
            )
            .expect_err("a directory");
            assert!(
                e.to_string()
                    .contains("is not a regular file (a directory)"),
                "{e}"
            );
        }
        assert!(other.path().join(DB_FILE).is_dir());
        assert!(!other.path().join(ROLLBACK_DIR).exists());
    }

    #[test]
    fn a_current_store_of_a_newer_schema_is_never_replaced() {
        let s = scene();
        let dir = s.dir.path();
        raw(dir)
            .execute_batch(&format!("PRAGMA user_version = {}", SCHEMA_VERSION + 1))
            .expect("newer");
        let before = live_state(dir);
        for force in [false, true] {
            let e = restore(dir, &s.backup, &s.relay.opts(T0 + 60_000, force), None)
                .expect_err("newer");
            assert_eq!(e.code(), "SCHEMA", "{e}");
            assert!(
                e.to_string()
                    .contains("this store was written by a newer agentmbx; upgrade first"),
                "{e}"
            );
            assert_eq!(live_state(dir), before);
        }
    }

    #[test]
    fn a_path_is_consumed_whatever_its_spelling_through_dot_dot_or_a_symlink() {
        let s = scene();
        let dir = s.dir.path();
        let out = s.out.path();
        std::fs::create_dir(out.join("sub")).expect("sub");
        let link = out.join("link.db");
        std::os::unix::fs::symlink(&s.backup, &link).expect("symlink");
        let dotted = out.join("sub").join("..").join("backup.db");
        assert_eq!(restored_from(dir, &dotted).expect("read"), None);
        restore(dir, &link, &s.relay.opts(T0 + 60_000, false), None).expect("restore");
        for spelling in [&s.backup, &link, &dotted] {
            assert_eq!(
                restored_from(dir, spelling).expect("read"),
                Some(iso_ms(T0 + 60_000)),
                "{}",
                spelling.display()
            );
        }
        // A path recorded by its old spelling (absolute, not resolved) is still consumed.
        let c = raw(dir);
        c.execute(
            "UPDATE meta SET v = ?1 WHERE k = 'restored_paths'",
            [json!({ dotted.display().to_string(): "then" }).to_string()],
        )
        .expect("old spelling");
        c.execute("DELETE FROM meta WHERE k = 'restored'", [])
            .expect("restored");
        assert_eq!(
            restored_from(dir, &dotted).expect("read"),
            Some("then".to_owned())
        );
        assert_eq!(restored_from(dir, &s.backup).expect("read"), None);
    }

    /// A signer that fails, so a restore fails after its rollback copy was made.
    #[derive(Debug)]
    struct FailingSigner(String);

    impl OpSigner for FailingSigner {
        fn relay_pubkey(&self) -> String {
            self.0.clone()
        }
        fn sign_receipt(&self, _: &Value) -> Result<String, String> {
            Err("no signature today".to_owned())
        }
    }

    #[test]
    fn leftovers_of_killed_copies_and_the_rollback_copy_of_a_failed_restore_are_removed() {
        let s = scene();
        let dir = s.dir.path();
        let rollback = dir.join(ROLLBACK_DIR);
        std::fs::create_dir_all(&rollback).expect("rollback");
        // pid_max is at most 4194304: that pid never runs. pid 1 always does.
        let dead = rollback.join("relay-2020-01-01T00-00-00-000Z.db.partial-4194304");
        let dead_journal = with_suffix(&dead, "-journal");
        let alive = rollback.join("relay-2020-01-01T00-00-00-000Z.db.partial-1");
        let other = rollback.join("notes.db.partial-4194304");
        for f in [&dead, &dead_journal, &alive, &other] {
            std::fs::write(f, b"x").expect("write");
        }
        let failing = RestoreOptions {
            force: false,
            now_ms: T0 + 60_000,
            signer: Some(Arc::new(FailingSigner(s.relay.key.public().to_b64()))),
        };
        let before = std::fs::read(dir.join(DB_FILE)).expect("live");
        let e = restore(dir, &s.backup, &failing, None).expect_err("signing fails");
        assert_eq!(e.code(), "FAILED", "{e}");
        assert_eq!(std::fs::read(dir.join(DB_FILE)).expect("live"), before);
        assert_eq!(
            names(&rollback),
            [
                "notes.db.partial-4194304",
                "relay-2020-01-01T00-00-00-000Z.db.partial-1"
            ],
            "the dead partials and the failed restore's rollback copy are gone"
        );
    }

    #[test]
    fn a_damaged_backup_is_not_a_store_naming_it_and_a_path_that_is_no_file_says_so() {
        let s = scene();
        let dir = s.dir.path();
        let out = s.out.path();
        let bytes = std::fs::read(&s.backup).expect("backup");
        let before = live_state(dir);
        let truncated = out.join("truncated.db");
        std::fs::write(&truncated, &bytes[..bytes.len() / 2]).expect("truncated");
        let garbage_meta = altered(
            &s.backup,
            out,
            "garbage-meta.db",
            "UPDATE meta SET v = 'x' WHERE k = 'schema_version'",
        );
        for file in [&truncated, &garbage_meta] {
            let e = restore(dir, file, &s.relay.opts(T0 + 60_000, false), None).expect_err("bad");
            assert_eq!(e.code(), "NOT_A_STORE", "{e}");
            assert!(e.to_string().contains(&file.display().to_string()), "{e}");
            assert_eq!(live_state(dir), before);
        }
        let folder = out.join("folder.db");
        std::fs::create_dir(&folder).expect("dir");
        let dangling = out.join("dangling.db");
        std::os::unix::fs::symlink(out.join("gone.db"), &dangling).expect("symlink");
        for file in [&folder, &dangling] {
            let e = restore(dir, file, &s.relay.opts(T0 + 60_000, false), None).expect_err("no");
            assert_eq!(e.code(), "NO_BACKUP", "{e}");
            assert!(e.to_string().contains("is not a regular file"), "{e}");
        }
        let e = restore(
            dir,
            &out.join("none.db"),
            &s.relay.opts(T0 + 60_000, false),
            None,
        )
        .expect_err("none");
        assert!(e.to_string().contains("no backup at"), "{e}");
        assert_eq!(live_state(dir), before);
    }

    #[test]
    fn a_forced_restore_keeps_the_paths_an_unreadable_store_had_consumed() {
        let s = scene();
        let dir = s.dir.path();
        let second = backup_now(dir, s.out.path(), "second.db");
        restore(dir, &s.backup, &s.relay.opts(T0 + 60_000, false), None).expect("first");
        // The store can no longer be read as a whole; its meta still can.
        raw(dir)
            .execute_batch("DROP TABLE sender_lists")
            .expect("damage");
        let e = restore(dir, &second, &s.relay.opts(T0 + 70_000, false), None).expect_err("no");
        assert_eq!(e.code(), "CURRENT_UNREADABLE", "{e}");
        let r = restore(dir, &second, &s.relay.opts(T0 + 80_000, true), None).expect("forced");
        assert_eq!(r["replaced"]["readable"], false);
        assert_eq!(
            restored_from(dir, &s.backup).expect("read"),
            Some(iso_ms(T0 + 60_000))
        );
        assert!(restored_from(dir, &second).expect("read").is_some());
    }
}
