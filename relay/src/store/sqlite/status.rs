//! Read-only views of `relay.db` for `relay status` and `relay log` (`wire.md` §3.3, §3.4):
//! every fact in one read transaction (one snapshot), without `relay.lock`, creating nothing.
//!
//! A store with no `relay.db-wal` (no relay serves it, and the last one stopped cleanly) is
//! read as an immutable file, because SQLite's ordinary read-only open of a WAL database would
//! create `-wal` and `-shm` next to it; if a relay starts meanwhile (a `-wal` appears), the
//! status read is repeated through the relay's own WAL. Only a store left with a non-empty
//! `-wal` but no `-shm` (not something a relay leaves behind) makes SQLite create the `-shm`
//! it needs.
//!
//! # What it must never do
//! - Write or create anything: no directory, no `relay.db`, no lock.

use std::path::Path;

use rusqlite::{Connection, OpenFlags, OptionalExtension};
use serde_json::{Map, Value};

use super::backup::{meta_get, with_suffix};
use crate::store::maintenance::{MaintenanceError, QueueFacts, StoreStatus, StoredOp};
use crate::store::{stored_version, StoreError, SCHEMA_VERSION};

/// How `relay.db` is opened.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mode {
    /// No WAL content: the file alone is the store; read it without locks or side files.
    Immutable,
    /// Through the WAL (a relay serves it, or one left a WAL behind).
    Shared,
}

/// Immutable unless a non-empty `-wal` exists, or a `-wal` and a `-shm` both exist (a relay
/// serves the store).
fn mode_for(db: &Path) -> Mode {
    let wal = std::fs::metadata(with_suffix(db, "-wal")).ok();
    let shm = with_suffix(db, "-shm").exists();
    match wal {
        None => Mode::Immutable,
        Some(w) if w.len() == 0 && !shm => Mode::Immutable,
        Some(_) => Mode::Shared,
    }
}

/// `file:` URI of an absolute path, percent-encoding every byte outside the unreserved set.
fn file_uri(path: &Path) -> String {
    use std::os::unix::ffi::OsStrExt as _;
    let mut uri = String::from("file:");
    for &b in path.as_os_str().as_bytes() {
        if b.is_ascii_alphanumeric() || b"-._~/".contains(&b) {
            uri.push(char::from(b));
        } else {
            uri.push_str(&format!("%{b:02X}"));
        }
    }
    uri
}

fn open(db: &Path, mode: Mode) -> rusqlite::Result<Connection> {
    let flags = OpenFlags::SQLITE_OPEN_READ_ONLY | OpenFlags::SQLITE_OPEN_NO_MUTEX;
    let conn = match mode {
        Mode::Immutable => Connection::open_with_flags(
            format!("{}?mode=ro&immutable=1", file_uri(db)),
            flags | OpenFlags::SQLITE_OPEN_URI,
        )?,
        Mode::Shared => Connection::open_with_flags(db, flags)?,
    };
    conn.busy_timeout(std::time::Duration::from_secs(5))?;
    Ok(conn)
}

/// Opens `db` (absolute) read-only the way `relay status` does: as an immutable file when no
/// WAL content exists (no lock, no `-wal`/`-shm` created beside a stopped store), else through
/// the WAL. For readers that read once (`relay log`). Errors: SQLite errors.
pub(crate) fn open_read_only(db: &Path) -> rusqlite::Result<Connection> {
    open(db, mode_for(db))
}

/// The status facts of `db` (absolute): [`MaintenanceError::NotAStore`] without a schema
/// version, [`MaintenanceError::SchemaTooNew`], SQLite errors.
pub(crate) fn status(
    db: &Path,
    top: usize,
    last_op: &str,
) -> Result<StoreStatus, MaintenanceError> {
    let mut mode = mode_for(db);
    loop {
        let conn = open(db, mode).map_err(StoreError::Sqlite)?;
        let status = facts(&conn, top, last_op)?;
        drop(conn);
        // A relay that started while the file was read as immutable may have written to it:
        // read again, through its WAL.
        if mode == Mode::Immutable && mode_for(db) == Mode::Shared {
            mode = Mode::Shared;
            continue;
        }
        return Ok(status);
    }
}

fn facts(c: &Connection, top: usize, last_op: &str) -> Result<StoreStatus, MaintenanceError> {
    let tx = c.unchecked_transaction().map_err(StoreError::Sqlite)?;
    let version = stored_version(&tx)?;
    if version == 0 {
        return Err(MaintenanceError::NotAStore("no schema version".into()));
    }
    if version > SCHEMA_VERSION {
        return Err(MaintenanceError::SchemaTooNew {
            found: version,
            supported: SCHEMA_VERSION,
        });
    }
    Ok(read_facts(&tx, version, top, last_op)?)
}

fn read_facts(
    tx: &Connection,
    version: u32,
    top: usize,
    last_op: &str,
) -> Result<StoreStatus, StoreError> {
    let n = |sql: &str| -> Result<i64, StoreError> {
        Ok(tx.query_row(sql, [], |r| r.get::<_, i64>(0))?)
    };
    let relay_pubkey = meta_get(tx, "relay_pubkey")?;
    let epoch = meta_get(tx, "epoch")?;
    let heartbeat = meta_get(tx, "heartbeat")?;
    let enrolled = n("SELECT COUNT(*) FROM enrolments WHERE revoked_at IS NULL")?;
    let revoked = n("SELECT COUNT(*) FROM enrolments WHERE revoked_at IS NOT NULL")?;
    let dedup_rows = n("SELECT COUNT(*) FROM dedup")?;
    let (queued_items, queued_bytes, queued_targets, oldest_ms) = tx.query_row(
        "SELECT COUNT(*), COALESCE(SUM(bytes), 0), COUNT(DISTINCT target_pubkey),
                MIN(accepted_at)
         FROM items",
        [],
        |r| {
            Ok((
                r.get::<_, i64>(0)?,
                r.get::<_, i64>(1)?,
                r.get::<_, i64>(2)?,
                r.get::<_, Option<i64>>(3)?,
            ))
        },
    )?;
    let deepest = {
        let mut st = tx.prepare(
            "SELECT q.target_pubkey, q.n, q.b, q.oldest, e.host_name,
                    COALESCE(e.revoked_at IS NOT NULL, 0)
             FROM (SELECT target_pubkey, COUNT(*) AS n, SUM(bytes) AS b,
                          MIN(accepted_at) AS oldest
                   FROM items GROUP BY target_pubkey
                   ORDER BY n DESC, b DESC, target_pubkey LIMIT ?1) AS q
             LEFT JOIN enrolments e ON e.host_pubkey = q.target_pubkey
             ORDER BY q.n DESC, q.b DESC, q.target_pubkey",
        )?;
        let limit = i64::try_from(top).unwrap_or(i64::MAX);
        let rows = st.query_map([limit], |r| {
            Ok(QueueFacts {
                host_pubkey: r.get(0)?,
                items: r.get(1)?,
                bytes: r.get(2)?,
                oldest_ms: r.get(3)?,
                host_name: r.get(4)?,
                revoked: r.get(5)?,
            })
        })?;
        rows.collect::<Result<Vec<_>, _>>()?
    };
    let last_op = tx
        .query_row(
            "SELECT at, receipt FROM ops WHERE op = ?1 ORDER BY id DESC LIMIT 1",
            [last_op],
            |r| Ok((r.get::<_, i64>(0)?, r.get::<_, String>(1)?)),
        )
        .optional()?;
    Ok(StoreStatus {
        schema_version: version,
        relay_pubkey,
        epoch,
        heartbeat,
        enrolled,
        revoked,
        dedup_rows,
        queued_items,
        queued_bytes,
        queued_targets,
        oldest_ms,
        deepest,
        last_op,
    })
}

/// The newest `limit` relay-log entries of `db` (absolute), newest first, and the relay key it
/// records; read-only ([`open_read_only`]).
pub(crate) fn read_log(
    db: &Path,
    limit: i64,
) -> Result<(Vec<StoredOp>, Option<String>), StoreError> {
    let c = open_read_only(db)?;
    let recorded = meta_get(&c, "relay_pubkey")?;
    let mut st = c.prepare("SELECT id, at, op, receipt FROM ops ORDER BY id DESC LIMIT ?1")?;
    let rows = st
        .query_map([limit], |r| {
            Ok(StoredOp {
                id: r.get(0)?,
                at_ms: r.get(1)?,
                op: r.get(2)?,
                receipt: match r.get::<_, rusqlite::types::Value>(3)? {
                    rusqlite::types::Value::Text(t) => Some(t),
                    _ => None,
                },
            })
        })?
        .collect::<Result<Vec<_>, _>>()?;
    Ok((rows, recorded))
}

/// Whether `c` has the table `name`.
pub(crate) fn has_table(c: &Connection, name: &str) -> rusqlite::Result<bool> {
    c.query_row(
        "SELECT EXISTS (SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = ?1)",
        [name],
        |r| r.get(0),
    )
}

/// Every path a store was restored from (`meta.restored_paths`, plus the file of
/// `meta.restored`), with when.
pub(crate) fn restored_paths(c: &Connection) -> rusqlite::Result<Map<String, Value>> {
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths_become_percent_encoded_file_uris() {
        assert_eq!(
            file_uri(Path::new("/a b/c?d#e%f/relay.db")),
            "file:/a%20b/c%3Fd%23e%25f/relay.db"
        );
    }
}
