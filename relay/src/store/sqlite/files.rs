//! The files of a store directory: `relay.lock` ([`StoreLock`], `wire.md` §3.4), the lock-less
//! live-heartbeat check, the private (0700/0600) directory and files, the write connection
//! and the WAL left by an unclean stop. Never touches rows beyond `meta.heartbeat` (read).

use std::path::{Path, PathBuf};
use std::time::Duration;

use rusqlite::{params, Connection, OpenFlags, OptionalExtension};

use super::writer::is_busy;
use super::{BUSY_TIMEOUT, STATEMENT_CACHE, WRITER_CACHE_KIB};
use crate::store::{StoreError, DB_FILE, LOCK_FILE};

// ---------------------------------------------------------------------------------------------
// Opening

/// `relay.lock` of a store directory, held (`wire.md` §3.4 "One writer"): while a `StoreLock`
/// lives no other process (and no other store in this one) can open the store, run a restore or
/// another offline operator command on it. Dropping it releases the lock; so does the OS when the
/// process dies. [`SqliteStore::open_signed`](crate::store::SqliteStore::open_signed) keeps holding
/// it for the store's life, so `relay serve` can restore a backup under the same lock before it
/// opens the store.
pub struct StoreLock {
    pub(super) conn: Connection,
    pub(super) dir: PathBuf,
    /// The holder row `relay.lock` held when this lock was taken (the last process that took
    /// it, running or not): named in the unclean-stop line of [`SqliteStore::open_signed`].
    pub(super) previous: Option<crate::store::LockHolder>,
}

impl std::fmt::Debug for StoreLock {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StoreLock").field("dir", &self.dir).finish()
    }
}

impl StoreLock {
    /// Creates `dir` (0700) when missing and takes its `relay.lock`, waiting up to `wait_ms`
    /// for another holder (logging it once); `now_ms` goes into the holder row. Errors:
    /// [`StoreError::Locked`] naming the holder, [`StoreError::Io`], [`StoreError::Sqlite`].
    ///
    /// When `relay.lock` did not exist before this call and `relay.db` holds a heartbeat less
    /// than 90 s (`LIVE_HEARTBEAT_MS`) from `now_ms` (either way), a relay from before the lock (or
    /// one whose lock file was deleted) may still be running on the store: the lock just made
    /// is given up and its file removed, and the error is [`StoreError::LiveHeartbeat`].
    pub fn acquire(dir: &Path, wait_ms: u64, now_ms: i64) -> Result<Self, StoreError> {
        create_private_dir(dir)?;
        let (conn, previous) = acquire_lock_checked(dir, wait_ms, now_ms)?;
        Ok(Self {
            conn,
            dir: dir.to_path_buf(),
            previous,
        })
    }

    /// [`StoreLock::acquire`] without the lock-less heartbeat check: for `relay restore
    /// --force`, whose operator says the relay is stopped (and which made its own check
    /// otherwise). Errors: as [`StoreLock::acquire`] but never [`StoreError::LiveHeartbeat`].
    pub fn acquire_ignoring_heartbeat(
        dir: &Path,
        wait_ms: u64,
        now_ms: i64,
    ) -> Result<Self, StoreError> {
        create_private_dir(dir)?;
        let (conn, previous) = acquire_lock(&dir.join(LOCK_FILE), wait_ms, now_ms)?;
        Ok(Self {
            conn,
            dir: dir.to_path_buf(),
            previous,
        })
    }

    /// The store directory this lock guards.
    pub fn dir(&self) -> &Path {
        &self.dir
    }
}

/// A heartbeat this close to now (ms, either way) on a store whose `relay.lock` is missing
/// means a relay may be running on it: 90 s, three heartbeat periods (`wire.md` §3.4).
pub(crate) const LIVE_HEARTBEAT_MS: i64 = 90_000;

/// The age (ms, negative: in the future) of `relay.db`'s heartbeat in `dir` when it is within
/// [`LIVE_HEARTBEAT_MS`] of `now_ms`; `None` otherwise (no store, no heartbeat, unreadable).
/// Read-only.
pub(crate) fn live_heartbeat_age(dir: &Path, now_ms: i64) -> Option<i64> {
    let db = dir.join(DB_FILE);
    if !db.is_file() {
        return None;
    }
    let c = Connection::open_with_flags(
        &db,
        OpenFlags::SQLITE_OPEN_READ_ONLY | OpenFlags::SQLITE_OPEN_NO_MUTEX,
    )
    .ok()?;
    let _ = c.busy_timeout(Duration::from_secs(5));
    let beat: i64 = c
        .query_row("SELECT v FROM meta WHERE k = 'heartbeat'", [], |r| {
            r.get::<_, String>(0)
        })
        .ok()?
        .trim()
        .parse()
        .ok()?;
    let age = now_ms.saturating_sub(beat);
    (age.unsigned_abs() < LIVE_HEARTBEAT_MS.unsigned_abs()).then_some(age)
}

/// [`acquire_lock`] on `dir/relay.lock` with the lock-less heartbeat check of
/// [`StoreLock::acquire`].
pub(super) fn acquire_lock_checked(
    dir: &Path,
    wait_ms: u64,
    now_ms: i64,
) -> Result<Taken, StoreError> {
    let path = dir.join(LOCK_FILE);
    let had_lock_file = path.symlink_metadata().is_ok();
    let (conn, previous) = acquire_lock(&path, wait_ms, now_ms)?;
    if !had_lock_file {
        if let Some(age_ms) = live_heartbeat_age(dir, now_ms) {
            drop(conn);
            // The file this call created: the next attempt must make the same check.
            let _ = std::fs::remove_file(&path);
            return Err(StoreError::LiveHeartbeat {
                path: dir.join(DB_FILE),
                age_s: age_ms / 1_000,
            });
        }
    }
    Ok((conn, previous))
}

/// A taken `relay.lock`: its connection (the lock lives as long as it) and the holder row it
/// held before (the previous holder's, `None` for a new lock file).
pub(super) type Taken = (Connection, Option<crate::store::LockHolder>);

/// Take `relay.lock`: an exclusive SQLite lock held by the returned connection until it is
/// dropped (`wire.md` §3.4). When another process holds it, logs once who (the holder row) and
/// how long this waits, then waits up to `wait_ms`; [`StoreError::Locked`] names the holder.
/// Also returns the holder row found once the lock is taken (the last process that held it).
fn acquire_lock(path: &Path, wait_ms: u64, now_ms: i64) -> Result<Taken, StoreError> {
    create_private_file(path)?;
    let conn = Connection::open(path)?;
    let _mode: String = conn.query_row("PRAGMA locking_mode = EXCLUSIVE", [], |r| r.get(0))?;
    conn.busy_timeout(Duration::ZERO)?;
    if let Err(e) = begin_exclusive(&conn) {
        if !is_busy(&e) {
            return Err(StoreError::Sqlite(e));
        }
        let holder = read_lock_holder(path);
        let locked = |holder, waited_ms| StoreError::Locked {
            path: path.to_path_buf(),
            holder,
            waited_ms,
        };
        if wait_ms == 0 {
            return Err(locked(holder, 0));
        }
        let who = holder.map_or_else(
            || "another relay process".to_owned(),
            |h| format!("another relay process ({h})"),
        );
        tracing::warn!(
            "{who} holds {}; waiting up to {}",
            path.display(),
            crate::store::duration_text(wait_ms)
        );
        conn.busy_timeout(Duration::from_millis(wait_ms))?;
        if let Err(e) = begin_exclusive(&conn) {
            return Err(if is_busy(&e) {
                locked(read_lock_holder(path).or(holder), wait_ms)
            } else {
                StoreError::Sqlite(e)
            });
        }
        tracing::info!("{} released; taking it", path.display());
    }
    conn.execute_batch(
        "CREATE TABLE IF NOT EXISTS holder (pid INTEGER NOT NULL, at INTEGER NOT NULL);",
    )?;
    let previous = conn
        .query_row("SELECT pid, at FROM holder LIMIT 1", [], |r| {
            Ok((r.get::<_, i64>(0)?, r.get::<_, i64>(1)?))
        })
        .optional()?
        .and_then(|(pid, since_ms)| {
            Some(crate::store::LockHolder {
                pid: u32::try_from(pid).ok()?,
                since_ms,
            })
        });
    conn.execute_batch("DELETE FROM holder;")?;
    conn.execute(
        "INSERT INTO holder (pid, at) VALUES (?1, ?2)",
        params![i64::from(std::process::id()), now_ms],
    )?;
    // In EXCLUSIVE locking mode the lock outlives the commit: it is released only when the
    // connection closes (or the process dies).
    conn.execute_batch("COMMIT")?;
    Ok((conn, previous))
}

/// `BEGIN EXCLUSIVE`; a refused one leaves no transaction open, so it can be tried again.
fn begin_exclusive(conn: &Connection) -> Result<(), rusqlite::Error> {
    let begun = conn.execute_batch("BEGIN EXCLUSIVE");
    if begun.is_err() && !conn.is_autocommit() {
        let _ = conn.execute_batch("ROLLBACK");
    }
    begun
}

/// The holder row of `relay.lock` while another process holds it. That process keeps an
/// exclusive lock, so the file is read as immutable (no locking at all); its row was committed
/// to the file when the lock was taken and never changes after. `None` when it cannot be read
/// (the holder is still writing it, an old lock file).
fn read_lock_holder(path: &Path) -> Option<crate::store::LockHolder> {
    let uri = format!("file:{}?immutable=1", uri_path(path));
    let conn = Connection::open_with_flags(
        uri,
        OpenFlags::SQLITE_OPEN_READ_ONLY
            | OpenFlags::SQLITE_OPEN_URI
            | OpenFlags::SQLITE_OPEN_NO_MUTEX,
    )
    .ok()?;
    let (pid, since_ms): (i64, i64) = conn
        .query_row("SELECT pid, at FROM holder LIMIT 1", [], |r| {
            Ok((r.get(0)?, r.get(1)?))
        })
        .ok()?;
    Some(crate::store::LockHolder {
        pid: u32::try_from(pid).ok()?,
        since_ms,
    })
}

/// A path as the path part of an SQLite `file:` URI: every byte outside `[A-Za-z0-9/._~-]`
/// percent-encoded.
fn uri_path(path: &Path) -> String {
    use std::os::unix::ffi::OsStrExt as _;
    let mut out = String::new();
    for &b in path.as_os_str().as_bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'/' | b'.' | b'_' | b'~' | b'-') {
            out.push(char::from(b));
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

/// Creates the store directory for `relay serve`: 0700 with its missing parents when it does
/// not exist. One that exists is left as the operator made it, with a warning when group or
/// others can read it (the store holds routing metadata). Errors: [`StoreError::Io`].
pub fn prepare_store_dir(dir: &Path) -> Result<(), StoreError> {
    use std::os::unix::fs::PermissionsExt as _;
    if let Ok(meta) = std::fs::metadata(dir) {
        let mode = meta.permissions().mode() & 0o777;
        if meta.is_dir() && mode & 0o044 != 0 {
            tracing::warn!(
                store = %dir.display(),
                mode = %format!("{mode:04o}"),
                "the relay store directory can be read by group or others; its files are 0600, \
                 but `chmod 700` it to keep even their names private"
            );
        }
    }
    create_private_dir(dir)
}

/// Creates `dir` (and missing parents) 0700 if it does not exist; an existing one is not
/// changed.
pub(super) fn create_private_dir(dir: &Path) -> Result<(), StoreError> {
    use std::os::unix::fs::DirBuilderExt as _;
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)
        .map_err(|source| StoreError::Io {
            path: dir.to_path_buf(),
            source,
        })
}

/// Creates `path` empty with mode 0600 (umask-independent: the mode is set after creation too)
/// unless it exists, so SQLite opens a file it did not create with its default 0644.
pub(super) fn create_private_file(path: &Path) -> Result<(), StoreError> {
    use std::os::unix::fs::OpenOptionsExt as _;
    use std::os::unix::fs::PermissionsExt as _;
    let io = |source| StoreError::Io {
        path: path.to_path_buf(),
        source,
    };
    match std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(path)
    {
        Ok(file) => file
            .set_permissions(std::fs::Permissions::from_mode(0o600))
            .map_err(io),
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => Ok(()),
        Err(e) => Err(io(e)),
    }
}

/// Sets `relay.db`, `-wal`, `-shm` and `relay.lock` in `dir` to 0600 where they exist with a
/// wider mode (stores made before the files were created private). Logs what it cannot change.
pub(super) fn restrict_store_files(dir: &Path) {
    use std::os::unix::fs::PermissionsExt as _;
    let wal = format!("{DB_FILE}-wal");
    let shm = format!("{DB_FILE}-shm");
    for name in [DB_FILE, wal.as_str(), shm.as_str(), LOCK_FILE] {
        let path = dir.join(name);
        let Ok(meta) = std::fs::metadata(&path) else {
            continue;
        };
        if meta.permissions().mode() & 0o077 == 0 {
            continue;
        }
        if let Err(e) = std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)) {
            tracing::warn!(file = %path.display(), error = %e, "cannot make a relay store file private (0600)");
        }
    }
}

pub(super) fn open_write_connection(path: &Path) -> Result<Connection, StoreError> {
    let conn = Connection::open_with_flags(
        path,
        OpenFlags::SQLITE_OPEN_READ_WRITE
            | OpenFlags::SQLITE_OPEN_CREATE
            | OpenFlags::SQLITE_OPEN_NO_MUTEX,
    )?;
    conn.busy_timeout(BUSY_TIMEOUT)?;
    let mode: String = conn.query_row("PRAGMA journal_mode = WAL", [], |r| r.get(0))?;
    if !mode.eq_ignore_ascii_case("wal") {
        return Err(StoreError::Corrupt(format!(
            "relay.db cannot use WAL (journal mode stays {mode:?}); put the store on a local file system"
        )));
    }
    // temp_store = MEMORY keeps the statement and savepoint sub-journals in memory rather than
    // in temporary files (they only matter until the transaction ends).
    conn.execute_batch(
        "PRAGMA synchronous = FULL; PRAGMA foreign_keys = ON; PRAGMA temp_store = MEMORY;",
    )?;
    // A group of pushes dirties a few MiB (each item writes about three pages of rows and
    // index entries); SQLite's default 2 MiB page cache spilled part of every such group to
    // the WAL before its COMMIT and read index pages back from the file.
    conn.pragma_update(None, "cache_size", WRITER_CACHE_KIB)?;
    conn.set_prepared_statement_cache_capacity(STATEMENT_CACHE);
    Ok(conn)
}

/// The size (bytes) of `relay.db-wal` in `dir`; 0 when it is missing or empty.
///
/// A clean stop leaves none: the writer's last act is `wal_checkpoint(TRUNCATE)` (module
/// docs), and SQLite deletes the file when its last connection closes (a read-only connection
/// that closes last leaves it empty). Read under `relay.lock`, before this process opens the
/// database, bytes in it mean the previous writer stopped without that: killed, crashed, the
/// machine lost power, or (logged at its stop) its final checkpoint could not finish.
pub(super) fn wal_bytes(dir: &Path) -> u64 {
    std::fs::metadata(dir.join(format!("{DB_FILE}-wal"))).map_or(0, |m| m.len())
}

/// The start after an unclean stop ([`wal_bytes`] > 0): SQLite's recovery already ran when
/// `conn` opened the database (it keeps the committed transactions of the WAL, drops a torn
/// tail); this copies them into `relay.db` (`wal_checkpoint(FULL)`, then `TRUNCATE` to empty
/// the file) and logs one WARN line
/// saying so: what was left (bytes of WAL, the last holder of `relay.lock` when known) and what
/// recovery did (committed WAL frames replayed into `relay.db`). Never fails: a checkpoint that
/// cannot finish now is said in the line and done by the next one.
pub(super) fn recover_unclean_stop(
    conn: &Connection,
    dir: &Path,
    left_wal: u64,
    previous: Option<&crate::store::LockHolder>,
) {
    let holder = previous.map_or_else(
        || "relay.lock had no holder row".to_owned(),
        |h| format!("relay.lock last taken by {h}, released when that process ended"),
    );
    let run = |mode: &str| {
        conn.query_row(&format!("PRAGMA wal_checkpoint({mode})"), [], |r| {
            Ok((
                r.get::<_, i64>(0)?,
                r.get::<_, i64>(1)?,
                r.get::<_, i64>(2)?,
            ))
        })
    };
    // FULL counts the frames (TRUNCATE answers 0 for a WAL it emptied), then TRUNCATE empties
    // the file.
    let checkpoint = run("FULL").and_then(|(busy, frames, copied)| {
        if busy == 0 && frames == copied {
            run("TRUNCATE").map(|(busy, _, _)| (busy, frames, copied))
        } else {
            Ok((busy.max(1), frames, copied))
        }
    });
    let recovered = match checkpoint {
        Ok((0, frames, _)) => format!(
            "{frames} committed WAL frames replayed into relay.db and the WAL emptied (a torn \
             tail, if any, was dropped)"
        ),
        Ok((_, frames, copied)) => format!(
            "{copied} of {frames} committed WAL frames replayed into relay.db (a reader was \
             busy; the rest stays in relay.db-wal until the next checkpoint)"
        ),
        Err(e) => format!(
            "SQLite recovered the WAL on open, but copying it into relay.db failed ({e}); it \
             stays in relay.db-wal"
        ),
    };
    tracing::warn!(
        store = %dir.display(),
        wal_bytes = left_wal,
        "previous run did not stop cleanly ({left_wal} bytes left in relay.db-wal; {holder}); \
         recovered: {recovered}"
    );
}
