//! The SQLite online backup (spec §5 "Backup"): one consistent snapshot of `relay.db` copied
//! with the SQLite online backup API, safe while `relay serve` writes (a read-only source
//! connection, WAL), into `<file>.partial-<pid>` (created 0600), switched to the rollback
//! journal, checked (`PRAGMA integrity_check`), fsynced, then linked to `<file>` — which never
//! overwrites — and the directory fsynced; and a store's facts for the backup receipt.
//!
//! It also owns the partial files of interrupted copies (`<base>.partial-<pid>`): the next
//! copy to the same name removes those whose process is gone.
//!
//! # What it must never do
//! - Write the source store; overwrite an existing file; leave a partial copy under the final
//!   name, or at all once it returns.

use std::path::{Path, PathBuf};

use rusqlite::{Connection, OpenFlags, OptionalExtension};

use crate::store::maintenance::{MaintenanceError, StoreCounts, StoreFacts};
use crate::store::{stored_version, StoreError};

/// An I/O error at `path`.
pub(crate) fn io(path: &Path) -> impl FnOnce(std::io::Error) -> MaintenanceError + '_ {
    move |source| MaintenanceError::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// A SQLite error as a maintenance error.
pub(crate) fn sql(e: rusqlite::Error) -> MaintenanceError {
    MaintenanceError::Store(StoreError::Sqlite(e))
}

/// A path with `suffix` appended to its file name.
pub(crate) fn with_suffix(path: &Path, suffix: &str) -> PathBuf {
    let mut p = path.to_path_buf().into_os_string();
    p.push(suffix);
    PathBuf::from(p)
}

/// Removes a copy and its journals (`""`, `-journal`, `-wal`, `-shm`) unless disarmed.
pub(crate) struct Partial {
    pub(crate) path: PathBuf,
    pub(crate) armed: bool,
}

impl Partial {
    /// Removes `path` and its journals now.
    pub(crate) fn remove(path: &Path) {
        for suffix in ["", "-journal", "-wal", "-shm"] {
            let _ = std::fs::remove_file(with_suffix(path, suffix));
        }
    }
}

impl Drop for Partial {
    fn drop(&mut self) {
        if self.armed {
            Self::remove(&self.path);
        }
    }
}

/// `fsync` of a file or directory.
pub(crate) fn fsync(path: &Path) -> Result<(), MaintenanceError> {
    std::fs::File::open(path)
        .and_then(|f| f.sync_all())
        .map_err(io(path))
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

/// Removes from `dir` the partial files (`<base>.partial-<pid>`, see [`online_copy`]) whose
/// `<base>` satisfies `base_ok` and whose process is gone: leftovers of a killed backup or
/// restore. Never anything else; errors are ignored.
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

/// `meta[key]` of `c`.
pub(crate) fn meta_get(c: &Connection, key: &str) -> rusqlite::Result<Option<String>> {
    c.query_row("SELECT v FROM meta WHERE k = ?1", [key], |r| r.get(0))
        .optional()
}

/// The counts of the store `c` is connected to.
pub(crate) fn counts(c: &Connection) -> Result<StoreCounts, StoreError> {
    let n = |sql: &str| -> Result<i64, StoreError> { Ok(c.query_row(sql, [], |r| r.get(0))?) };
    Ok(StoreCounts {
        enrolments: n("SELECT COUNT(*) FROM enrolments WHERE revoked_at IS NULL")?,
        revoked: n("SELECT COUNT(*) FROM enrolments WHERE revoked_at IS NOT NULL")?,
        items: n("SELECT COUNT(*) FROM items")?,
        bytes: n("SELECT COALESCE(SUM(bytes), 0) FROM items")?,
        dedup: n("SELECT COUNT(*) FROM dedup")?,
        targets: n("SELECT COUNT(DISTINCT target_pubkey) FROM items")?,
    })
}

/// A store's facts for the backup receipt.
pub(crate) fn facts(c: &Connection) -> Result<StoreFacts, StoreError> {
    let counts = counts(c)?;
    let heartbeat_ms = meta_get(c, "heartbeat")?.and_then(|v| v.trim().parse::<i64>().ok());
    Ok(StoreFacts {
        epoch: meta_get(c, "epoch")?,
        relay_pubkey: meta_get(c, "relay_pubkey")?,
        schema_version: stored_version(c)?,
        heartbeat_ms,
        counts,
    })
}

/// `PRAGMA integrity_check`. Errors: [`MaintenanceError::Integrity`] naming the problems,
/// SQLite errors.
pub(crate) fn integrity(c: &Connection) -> Result<(), MaintenanceError> {
    let problems: Vec<String> = c
        .prepare("PRAGMA integrity_check")
        .map_err(sql)?
        .query_map([], |r| r.get::<_, String>(0))
        .map_err(sql)?
        .collect::<Result<_, _>>()
        .map_err(sql)?;
    if problems != ["ok"] {
        return Err(MaintenanceError::Integrity(problems.join("; ")));
    }
    Ok(())
}

/// Opens `db` read-only for a backup (busy timeout 5 s) and copies it with [`online_copy`].
pub(crate) fn backup(
    db: &Path,
    dest: &Path,
    failpoint: Option<&str>,
) -> Result<StoreFacts, MaintenanceError> {
    let src = Connection::open_with_flags(
        db,
        OpenFlags::SQLITE_OPEN_READ_ONLY | OpenFlags::SQLITE_OPEN_NO_MUTEX,
    )
    .map_err(sql)?;
    src.busy_timeout(std::time::Duration::from_secs(5))
        .map_err(sql)?;
    online_copy(&src, dest, failpoint)
}

/// Copies the database `src` is connected to into the new file `dest` (absolute; its directory
/// must exist) with the SQLite online backup API in one step: `<dest>.partial-<pid>` (0600),
/// switched to the rollback journal, integrity-checked, fsynced, hard-linked to `dest` (never
/// replacing a name), directory fsynced; returns the copy's facts. `failpoint` is hit just
/// before the copy gets its name. Errors: [`MaintenanceError::Exists`] (nothing touched),
/// [`MaintenanceError::Integrity`], [`MaintenanceError::Busy`], I/O and SQLite errors; no
/// partial file remains on any error.
pub(crate) fn online_copy(
    src: &Connection,
    dest: &Path,
    failpoint: Option<&str>,
) -> Result<StoreFacts, MaintenanceError> {
    if dest.symlink_metadata().is_ok() {
        return Err(MaintenanceError::Exists(dest.to_path_buf()));
    }
    // Partial copies to this name that a killed run left behind (their process is gone).
    if let (Some(parent), Some(name)) = (dest.parent(), dest.file_name()) {
        let name = name.to_string_lossy();
        remove_dead_partials(parent, |base| base == name);
    }
    let partial = Partial {
        path: with_suffix(dest, &format!(".partial-{}", std::process::id())),
        armed: true,
    };
    // A leftover of an earlier run with this pid is ours to replace.
    Partial::remove(&partial.path);
    {
        use std::os::unix::fs::OpenOptionsExt as _;
        std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&partial.path)
            .map_err(io(&partial.path))?;
    }
    let mut copy = Connection::open(&partial.path).map_err(sql)?;
    {
        use rusqlite::backup::{Backup, StepResult};
        let b = Backup::new_with_names(src, rusqlite::MAIN_DB, &mut copy, rusqlite::MAIN_DB)
            .map_err(sql)?;
        // One step of every page: one consistent snapshot even while the relay writes.
        match b.step(-1).map_err(sql)? {
            StepResult::Done => {}
            _ => return Err(MaintenanceError::Busy),
        }
    }
    let _mode: String = copy
        .query_row("PRAGMA journal_mode = DELETE", [], |r| r.get(0))
        .map_err(sql)?;
    integrity(&copy)?;
    let facts = facts(&copy)?;
    copy.close().map_err(|(_, e)| sql(e))?;
    if let Some(name) = failpoint {
        agentmbx_protocol::failpoint::hit(name);
    }
    fsync(&partial.path)?;
    // A hard link never replaces an existing name (EEXIST), unlike rename.
    match std::fs::hard_link(&partial.path, dest) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
            return Err(MaintenanceError::Exists(dest.to_path_buf()))
        }
        Err(e) => return Err(io(dest)(e)),
    }
    drop(partial);
    let parent = dest.parent().unwrap_or(Path::new("/"));
    fsync(parent)?;
    Ok(facts)
}

/// Direct SQL on a store file, for tests that alter or inspect a store the way only a damaged
/// or hand-edited one could be: the one way tests outside `store/sqlite/` reach the database.
#[cfg(test)]
pub(crate) mod raw {
    use std::path::Path;

    use rusqlite::types::FromSql;
    use rusqlite::{params_from_iter, Connection, OptionalExtension};

    fn open(db: &Path) -> Connection {
        Connection::open(db).expect("raw open")
    }

    /// Runs the statements `sql` (no parameters) on the store file `db`.
    pub(crate) fn exec(db: &Path, sql: &str) {
        open(db).execute_batch(sql).expect(sql);
    }

    /// Runs one statement with text parameters on `db`; returns how many rows it changed.
    pub(crate) fn exec_with(db: &Path, sql: &str, params: &[&str]) -> usize {
        open(db).execute(sql, params_from_iter(params)).expect(sql)
    }

    /// The first column of the first row of `sql` on `db`, if any.
    pub(crate) fn one<T: FromSql>(db: &Path, sql: &str, params: &[&str]) -> Option<T> {
        open(db)
            .query_row(sql, params_from_iter(params), |r| r.get(0))
            .optional()
            .expect(sql)
    }

    /// The first column of every row of `sql` on `db`.
    pub(crate) fn column<T: FromSql>(db: &Path, sql: &str, params: &[&str]) -> Vec<T> {
        let c = open(db);
        let mut st = c.prepare(sql).expect(sql);
        let rows = st
            .query_map(params_from_iter(params), |r| r.get(0))
            .expect(sql)
            .collect::<Result<Vec<T>, _>>()
            .expect(sql);
        rows
    }
}
