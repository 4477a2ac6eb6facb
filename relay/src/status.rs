//! `agentmbx relay status`: an operator's facts about a relay store (spec §5, §7; `wire.md`
//! §3.3, §3.4): live and revoked enrolments, queued items and bytes (total and the deepest
//! target queues, with the age of their oldest item), the epoch, the last heartbeat, the last
//! backup (from the relay log's `relay-backup` receipt), dedup rows, the schema version and the
//! relay key fingerprint.
//!
//! # What it owns
//! - [`read`]: every fact in one read transaction (one snapshot) of `relay.db`, opened
//!   read-only. It works while the relay serves (a WAL reader never blocks the writer) and never
//!   takes `relay.lock`.
//! - [`RelayStatus::to_json`] (the stable `--json` object, `v: 1`) and [`RelayStatus::text`]
//!   (the compact human summary).
//!
//! # What it must never do
//! - Write or create anything: no directory, no `relay.db`, no lock. A store with no
//!   `relay.db-wal` (no relay serves it, and the last one stopped cleanly) is read as an
//!   immutable file, because SQLite's ordinary read-only open of a WAL database would create
//!   `-wal` and `-shm` next to it; if a relay starts meanwhile (a `-wal` appears), the read is
//!   repeated through the relay's own WAL. Only a store left with a non-empty `-wal` but no
//!   `-shm` (not something a relay leaves behind) makes SQLite create the `-shm` it needs.
//! - Print key material: the store holds public keys, ciphertext and routing metadata only, and
//!   only counts, names, public fingerprints and times are reported.

use std::path::{Path, PathBuf};

use rusqlite::{Connection, OpenFlags, OptionalExtension};
use serde_json::{json, Value};

use agentmbx_protocol::keys::PublicKey;
use agentmbx_protocol::time::iso_ms;

use crate::ops::{absolute, OP_BACKUP};
use crate::store::{stored_version, StoreError, DB_FILE, SCHEMA_VERSION};

/// How many of the deepest target queues `relay status` shows by default.
pub const DEFAULT_TOP: usize = 5;

/// The most target queues one status lists (`--top` at most).
pub const MAX_TOP: usize = 1_000;

/// Why no status could be read.
#[derive(Debug, thiserror::Error)]
pub enum StatusError {
    /// The directory holds no `relay.db` (or does not exist).
    #[error("{} holds no relay store (relay.db)", .0.display())]
    NoStore(PathBuf),
    /// `relay.db` exists but is not a relay store (no schema version).
    #[error("{} is not a relay store (it has no schema version)", .0.display())]
    NotAStore(PathBuf),
    /// The store was written by a newer agentmbx.
    #[error(
        "relay store schema {found} is newer than this agentmbx ({supported}): use the agentmbx \
         that serves it"
    )]
    SchemaTooNew {
        /// The store's schema version.
        found: u32,
        /// The newest version this binary reads.
        supported: u32,
    },
    /// SQLite failed (a damaged file, a store that stayed locked for 5 s…).
    #[error("relay store database error: {0}")]
    Sqlite(#[from] rusqlite::Error),
    /// The store's own checks failed.
    #[error(transparent)]
    Store(#[from] StoreError),
}

/// The queue of one target host key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TargetQueue {
    /// The target host key (standard base64).
    pub host_pubkey: String,
    /// Its enrolled name; `None` when the key has no enrolment row.
    pub host_name: Option<String>,
    /// [`PublicKey::fingerprint`] of the key (16 hex), "" if the stored text is not a key.
    pub fingerprint: String,
    /// Whether the key's enrolment is revoked.
    pub revoked: bool,
    /// Items queued for it.
    pub items: u64,
    /// Their wire bytes.
    pub bytes: u64,
    /// `accepted_at` of its oldest queued item (Unix ms).
    pub oldest_ms: i64,
}

/// The newest `relay-backup` receipt of the relay log.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LastBackup {
    /// When it was logged (Unix ms; the `ops.at` column).
    pub at_ms: i64,
    /// The backup file (`receipt.file`), `None` if the receipt lacks it.
    pub file: Option<String>,
    /// The backup file's size in bytes (`receipt.bytes`), `None` if the receipt lacks it.
    pub bytes: Option<u64>,
}

/// An operator's view of a relay store at one moment. Times are Unix ms; sizes are bytes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RelayStatus {
    /// Absolute path of `relay.db`.
    pub store: String,
    /// The moment the ages are measured from (Unix ms).
    pub now_ms: i64,
    /// The store's schema version.
    pub schema_version: u32,
    /// `meta.relay_pubkey` (the relay's public key, standard base64).
    pub relay_pubkey: Option<String>,
    /// Its fingerprint (16 hex).
    pub relay_fingerprint: Option<String>,
    /// `meta.epoch`.
    pub epoch: Option<String>,
    /// Live (not revoked) enrolments.
    pub enrolled: u64,
    /// Revoked enrolments.
    pub revoked: u64,
    /// Items queued for all targets.
    pub queued_items: u64,
    /// Their wire bytes.
    pub queued_bytes: u64,
    /// Targets with at least one queued item.
    pub queued_targets: u64,
    /// `accepted_at` of the oldest queued item, `None` when nothing is queued.
    pub oldest_ms: Option<i64>,
    /// The deepest target queues (most items, then most bytes, then key), at most the `top`
    /// asked for.
    pub deepest: Vec<TargetQueue>,
    /// `meta.heartbeat` (written every 30 s while a relay serves), `None` if never served.
    pub heartbeat_ms: Option<i64>,
    /// `meta.heartbeat` is set but is not a time in ms (a damaged or altered store);
    /// `heartbeat_ms` is then `None`.
    pub heartbeat_unreadable: bool,
    /// The newest backup in the relay log, `None` if none is logged.
    pub last_backup: Option<LastBackup>,
    /// Rows in `dedup` (queued items and tombstones within the dedup horizon).
    pub dedup_rows: u64,
}

/// How `relay.db` is opened.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mode {
    /// No WAL content: the file alone is the store; read it without locks or side files.
    Immutable,
    /// Through the WAL (a relay serves it, or one left a WAL behind).
    Shared,
}

/// The path with `suffix` appended (`relay.db` → `relay.db-wal`).
fn side_file(db: &Path, suffix: &str) -> PathBuf {
    let mut p = db.as_os_str().to_owned();
    p.push(suffix);
    PathBuf::from(p)
}

/// Immutable unless a non-empty `-wal` exists, or a `-wal` and a `-shm` both exist (a relay
/// serves the store).
fn mode_for(db: &Path) -> Mode {
    let wal = std::fs::metadata(side_file(db, "-wal")).ok();
    let shm = side_file(db, "-shm").exists();
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

/// Opens `db` (absolute) read-only the way `relay status` does: as an immutable file when no
/// WAL content exists (no lock, no `-wal`/`-shm` created beside a stopped store), else through
/// the WAL. For readers that read once (`relay log`). Errors: SQLite errors.
pub(crate) fn open_read_only(db: &Path) -> Result<Connection, rusqlite::Error> {
    match open(db, mode_for(db)) {
        Ok(c) => Ok(c),
        Err(StatusError::Sqlite(e)) => Err(e),
        Err(e) => Err(rusqlite::Error::InvalidPath(PathBuf::from(e.to_string()))),
    }
}

fn open(db: &Path, mode: Mode) -> Result<Connection, StatusError> {
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

/// Reads the status of the store in `dir` at `now_ms`, listing at most `top` (clamped to
/// [`MAX_TOP`]) of the deepest target queues. Read-only, without `relay.lock`, creating nothing
/// (module docs), so it works while the relay serves.
///
/// Errors: [`StatusError::NoStore`] when `dir/relay.db` is missing (nothing is created),
/// [`StatusError::NotAStore`], [`StatusError::SchemaTooNew`], SQLite errors.
pub fn read(dir: &Path, now_ms: i64, top: usize) -> Result<RelayStatus, StatusError> {
    let db = absolute(&dir.join(DB_FILE));
    if !db.is_file() {
        return Err(StatusError::NoStore(dir.to_path_buf()));
    }
    let top = top.min(MAX_TOP);
    let mut mode = mode_for(&db);
    loop {
        let conn = open(&db, mode)?;
        let status = facts(&conn, &db, now_ms, top)?;
        drop(conn);
        // A relay that started while the file was read as immutable may have written to it:
        // read again, through its WAL.
        if mode == Mode::Immutable && mode_for(&db) == Mode::Shared {
            mode = Mode::Shared;
            continue;
        }
        return Ok(status);
    }
}

/// Saturating `i64` → `u64` for counts (never negative in a sane store).
fn count(n: i64) -> u64 {
    u64::try_from(n).unwrap_or(0)
}

fn facts(c: &Connection, db: &Path, now_ms: i64, top: usize) -> Result<RelayStatus, StatusError> {
    let tx = c.unchecked_transaction()?;
    let version = stored_version(&tx)?;
    if version == 0 {
        return Err(StatusError::NotAStore(db.to_path_buf()));
    }
    if version > SCHEMA_VERSION {
        return Err(StatusError::SchemaTooNew {
            found: version,
            supported: SCHEMA_VERSION,
        });
    }
    let meta = |k: &str| -> Result<Option<String>, StatusError> {
        Ok(tx
            .query_row("SELECT v FROM meta WHERE k = ?1", [k], |r| r.get(0))
            .optional()?)
    };
    let n = |sql: &str| -> Result<u64, StatusError> {
        Ok(count(tx.query_row(sql, [], |r| r.get::<_, i64>(0))?))
    };
    let relay_pubkey = meta("relay_pubkey")?;
    let relay_fingerprint = relay_pubkey
        .as_deref()
        .and_then(|k| PublicKey::from_b64(k).ok())
        .map(|k| k.fingerprint());
    let epoch = meta("epoch")?;
    let heartbeat_text = meta("heartbeat")?;
    let heartbeat_ms = heartbeat_text
        .as_deref()
        .and_then(|v| v.trim().parse::<i64>().ok());
    let heartbeat_unreadable = heartbeat_text.is_some() && heartbeat_ms.is_none();
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
                count(r.get(0)?),
                count(r.get(1)?),
                count(r.get(2)?),
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
            let host_pubkey: String = r.get(0)?;
            Ok(TargetQueue {
                fingerprint: PublicKey::from_b64(&host_pubkey)
                    .map(|k| k.fingerprint())
                    .unwrap_or_default(),
                host_pubkey,
                items: count(r.get(1)?),
                bytes: count(r.get(2)?),
                oldest_ms: r.get(3)?,
                host_name: r.get(4)?,
                revoked: r.get(5)?,
            })
        })?;
        rows.collect::<Result<Vec<_>, _>>()?
    };
    let last_backup = tx
        .query_row(
            "SELECT at, receipt FROM ops WHERE op = ?1 ORDER BY id DESC LIMIT 1",
            [OP_BACKUP],
            |r| Ok((r.get::<_, i64>(0)?, r.get::<_, String>(1)?)),
        )
        .optional()?
        .map(|(at_ms, receipt)| {
            let receipt: Value = serde_json::from_str(&receipt).unwrap_or(Value::Null);
            LastBackup {
                at_ms,
                file: receipt["file"].as_str().map(str::to_owned),
                bytes: receipt["bytes"].as_u64(),
            }
        });
    tx.finish()?;
    Ok(RelayStatus {
        store: db.display().to_string(),
        now_ms,
        schema_version: version,
        relay_pubkey,
        relay_fingerprint,
        epoch,
        enrolled,
        revoked,
        queued_items,
        queued_bytes,
        queued_targets,
        oldest_ms,
        deepest,
        heartbeat_ms,
        heartbeat_unreadable,
        last_backup,
        dedup_rows,
    })
}

impl RelayStatus {
    /// Age of a moment in ms (negative: in the future).
    fn age(&self, at_ms: i64) -> i64 {
        self.now_ms.saturating_sub(at_ms)
    }

    /// The stable `--json` object (times ISO 8601 UTC with ms, ages in ms, negative for a
    /// moment in the future, sizes in bytes):
    ///
    /// ```text
    /// {v:1, store, at, schema_version, relay_pubkey, relay_fingerprint, epoch,
    ///  hosts:{enrolled, revoked},
    ///  queue:{items, bytes, targets, oldest_at, oldest_age_ms,
    ///         deepest:[{host, host_pubkey, fingerprint, revoked, items, bytes,
    ///                   oldest_at, oldest_age_ms}]},
    ///  heartbeat:{at, age_ms}|{unreadable:true}|null,
    ///  last_backup:{at, age_ms, file, bytes}|null,
    ///  dedup_rows}
    /// ```
    ///
    /// `oldest_at`/`oldest_age_ms` are null when nothing is queued; `host` is null for a key
    /// without an enrolment row; `relay_pubkey`, `relay_fingerprint`, `epoch`, `file` and
    /// `bytes` are null when the store lacks them.
    pub fn to_json(&self) -> Value {
        let deepest: Vec<Value> = self
            .deepest
            .iter()
            .map(|t| {
                json!({
                    "host": t.host_name,
                    "host_pubkey": t.host_pubkey,
                    "fingerprint": t.fingerprint,
                    "revoked": t.revoked,
                    "items": t.items,
                    "bytes": t.bytes,
                    "oldest_at": iso_ms(t.oldest_ms),
                    "oldest_age_ms": self.age(t.oldest_ms),
                })
            })
            .collect();
        json!({
            "v": 1,
            "store": self.store,
            "at": iso_ms(self.now_ms),
            "schema_version": self.schema_version,
            "relay_pubkey": self.relay_pubkey,
            "relay_fingerprint": self.relay_fingerprint,
            "epoch": self.epoch,
            "hosts": {"enrolled": self.enrolled, "revoked": self.revoked},
            "queue": {
                "items": self.queued_items,
                "bytes": self.queued_bytes,
                "targets": self.queued_targets,
                "oldest_at": self.oldest_ms.map(iso_ms),
                "oldest_age_ms": self.oldest_ms.map(|t| self.age(t)),
                "deepest": deepest,
            },
            "heartbeat": match self.heartbeat_ms {
                Some(h) => json!({"at": iso_ms(h), "age_ms": self.age(h)}),
                None if self.heartbeat_unreadable => json!({"unreadable": true}),
                None => Value::Null,
            },
            "last_backup": self.last_backup.as_ref().map(|b| json!({
                "at": iso_ms(b.at_ms),
                "age_ms": self.age(b.at_ms),
                "file": b.file,
                "bytes": b.bytes,
            })),
            "dedup_rows": self.dedup_rows,
        })
    }

    /// The compact human summary, one fact per line (ends with a newline).
    pub fn text(&self) -> String {
        let mut out = String::new();
        let mut line = |label: &str, value: String| {
            out.push_str(&format!("{label:<13}{value}\n"));
        };
        line(
            "store",
            format!("{} (schema {})", self.store, self.schema_version),
        );
        line(
            "relay key",
            self.relay_fingerprint
                .as_deref()
                .map_or("unknown".to_owned(), |f| format!("fingerprint {f}")),
        );
        line(
            "epoch",
            self.epoch.clone().unwrap_or_else(|| "unknown".to_owned()),
        );
        line(
            "hosts",
            format!("{} enrolled, {} revoked", self.enrolled, self.revoked),
        );
        line(
            "queued",
            match self.oldest_ms {
                None => "nothing".to_owned(),
                Some(oldest) => format!(
                    "{}, {} for {}; oldest {}",
                    plural(self.queued_items, "item"),
                    bytes(self.queued_bytes),
                    plural(self.queued_targets, "target"),
                    age(self.age(oldest)),
                ),
            },
        );
        for t in &self.deepest {
            let mut name = t.host_name.clone().unwrap_or_else(|| "?".to_owned());
            if t.revoked {
                name.push_str(" (revoked)");
            }
            line(
                "",
                format!(
                    "{name}  {}  {}  {}  oldest {}",
                    t.fingerprint,
                    plural(t.items, "item"),
                    bytes(t.bytes),
                    age(self.age(t.oldest_ms)),
                ),
            );
        }
        line(
            "heartbeat",
            match self.heartbeat_ms {
                Some(h) => format!("{} ({})", iso_ms(h), age(self.age(h))),
                None if self.heartbeat_unreadable => {
                    "unreadable (meta.heartbeat is not a time: the store is damaged or was \
                     altered)"
                        .to_owned()
                }
                None => "none (no relay has served this store yet)".to_owned(),
            },
        );
        line(
            "last backup",
            self.last_backup
                .as_ref()
                .map_or("none in the relay log".to_owned(), |b| {
                    let mut s = format!("{} ({})", iso_ms(b.at_ms), age(self.age(b.at_ms)));
                    if let Some(f) = &b.file {
                        s.push_str(&format!(": {f}"));
                    }
                    if let Some(n) = b.bytes {
                        s.push_str(&format!(" ({})", bytes(n)));
                    }
                    s
                }),
        );
        line("dedup", plural(self.dedup_rows, "row"));
        out
    }
}

/// `1 item`, `2 items`.
fn plural(n: u64, what: &str) -> String {
    if n == 1 {
        format!("1 {what}")
    } else {
        format!("{n} {what}s")
    }
}

/// `512 bytes`, `6234 bytes (6.1 KiB)`, `52428800 bytes (50.0 MiB)`.
fn bytes(n: u64) -> String {
    const UNITS: [&str; 4] = ["KiB", "MiB", "GiB", "TiB"];
    if n < 1024 {
        return plural(n, "byte");
    }
    // Display only: the f64 rounding of a huge count does not matter here.
    #[allow(clippy::cast_precision_loss)]
    let mut v = n as f64 / 1024.0;
    let mut unit = UNITS[0];
    for u in &UNITS[1..] {
        if v < 1024.0 {
            break;
        }
        v /= 1024.0;
        unit = u;
    }
    format!("{n} bytes ({v:.1} {unit})")
}

/// `12s ago`, `3m05s ago`, `2h07m ago`, `3d04h ago`, or `… in the future`.
pub fn age(age_ms: i64) -> String {
    let s = age_ms.unsigned_abs() / 1_000;
    let span = if s < 60 {
        format!("{s}s")
    } else if s < 3_600 {
        format!("{}m{:02}s", s / 60, s % 60)
    } else if s < 48 * 3_600 {
        format!("{}h{:02}m", s / 3_600, s % 3_600 / 60)
    } else {
        format!("{}d{:02}h", s / 86_400, s % 86_400 / 3_600)
    };
    if age_ms < 0 {
        format!("{span} in the future")
    } else {
        format!("{span} ago")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::{
        AckRequest, EnrolRequest, Expiry, OpenOptions, PushBatch, PushItem, PushTarget, SqliteStore,
    };
    use crate::store::{DirectoryStore, ItemStore, OperationsStore, StoreHealth};
    use agentmbx_protocol::keys::HostKey;

    const T0: i64 = 1_767_225_600_000;

    fn names(dir: &Path) -> Vec<String> {
        let mut v: Vec<String> = std::fs::read_dir(dir)
            .expect("ls")
            .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
            .collect();
        v.sort();
        v
    }

    fn open_store(dir: &Path, relay: &str) -> SqliteStore {
        SqliteStore::open_with(
            dir,
            relay,
            T0,
            OpenOptions {
                lock_wait_ms: 0,
                ..OpenOptions::default()
            },
        )
        .expect("open")
    }

    fn enrol(store: &SqliteStore, key: &str, name: &str) {
        store
            .enrol(EnrolRequest {
                host_pubkey: key.to_owned(),
                host_name: name.to_owned(),
                owner_fp: String::new(),
                account: None,
                authorized_by: "host-key-challenge".to_owned(),
                strength: crate::store::AuthorityStrength::HostKeyChallenge,
                now_ms: T0,
            })
            .expect("enrol");
    }

    fn push(store: &SqliteStore, sender: &str, id: &str, target: &str, len: usize, now: i64) {
        let out = store
            .push(PushBatch {
                sender_pubkey: sender.to_owned(),
                sender_host: "alpha".to_owned(),
                now_ms: now,
                expiry: Expiry::Retention,
                items: vec![PushItem {
                    kind: "envelope".to_owned(),
                    item_id: id.to_owned(),
                    targets: vec![PushTarget {
                        target_pubkey: target.to_owned(),
                        wire: vec![b'x'; len],
                    }],
                }],
            })
            .expect("push");
        assert_eq!(out.items[0].status.wire(), "accepted");
    }

    fn key() -> String {
        HostKey::generate().public().to_b64()
    }

    #[test]
    fn a_missing_store_is_no_store_and_nothing_is_created() {
        let tmp = tempfile::tempdir().expect("tmp");
        let empty = tmp.path().join("empty");
        std::fs::create_dir(&empty).expect("mkdir");
        assert!(matches!(
            read(&empty, T0, 5),
            Err(StatusError::NoStore(p)) if p == empty
        ));
        assert!(names(&empty).is_empty());
        let missing = tmp.path().join("missing");
        let err = read(&missing, T0, 5).expect_err("no store");
        assert!(
            err.to_string().contains("holds no relay store (relay.db)"),
            "{err}"
        );
        assert!(!missing.exists(), "the directory was created");
        // A relay.db that is not a store.
        std::fs::write(empty.join(DB_FILE), b"").expect("write");
        assert!(matches!(
            read(&empty, T0, 5),
            Err(StatusError::NotAStore(_))
        ));
    }

    #[test]
    fn the_facts_of_a_store() {
        let tmp = tempfile::tempdir().expect("tmp");
        let dir = tmp.path().join("store");
        let relay_key = HostKey::generate().public();
        let store = open_store(&dir, &relay_key.to_b64());
        let (alpha, beta, gamma, gone) = (key(), key(), key(), key());
        for (k, n) in [
            (&alpha, "alpha"),
            (&beta, "beta"),
            (&gamma, "gamma"),
            (&gone, "gone"),
        ] {
            enrol(&store, k, n);
        }
        // beta: 3 items (the deepest), gamma: 1 big one, gone: 2 small ones, then revoked.
        push(&store, &alpha, "b1", &beta, 100, T0 + 1_000);
        push(&store, &alpha, "b2", &beta, 100, T0 + 2_000);
        push(&store, &gamma, "b3", &beta, 50, T0 + 3_000);
        push(&store, &alpha, "g1", &gamma, 5_000, T0 + 500);
        push(&store, &alpha, "x1", &gone, 10, T0 + 4_000);
        push(&store, &alpha, "x2", &gone, 10, T0 + 4_000);
        store.revoke(&gone, T0 + 5_000).expect("revoke");
        // An acked item leaves its dedup row (a tombstone) but not its bytes.
        push(&store, &alpha, "a1", &alpha, 7, T0 + 6_000);
        let head = store.info_for(&alpha).expect("info").head_seq;
        store
            .ack(AckRequest {
                target_pubkey: alpha.clone(),
                through: head,
                epoch: None,
            })
            .expect("ack");
        store.set_heartbeat(T0 + 30_000).expect("heartbeat");
        store
            .append_op(
                T0 + 40_000,
                OP_BACKUP,
                &json!({"v": 1, "type": OP_BACKUP, "file": "/b/relay-1.db", "bytes": 40_960}),
            )
            .expect("op");
        store
            .append_op(T0 + 50_000, "relay-epoch-rotated", &json!({"v": 1}))
            .expect("op");
        let epoch = store.epoch().expect("epoch");
        drop(store);

        let now = T0 + 100_000;
        let st = read(&dir, now, 2).expect("status");
        assert_eq!(st.store, absolute(&dir.join(DB_FILE)).display().to_string());
        assert_eq!(st.schema_version, SCHEMA_VERSION);
        assert_eq!(
            st.relay_pubkey.as_deref(),
            Some(relay_key.to_b64().as_str())
        );
        assert_eq!(
            st.relay_fingerprint.as_deref(),
            Some(relay_key.fingerprint().as_str())
        );
        assert_eq!(st.epoch.as_deref(), Some(epoch.as_str()));
        assert_eq!((st.enrolled, st.revoked), (3, 1));
        assert_eq!(
            (st.queued_items, st.queued_bytes, st.queued_targets),
            (6, 250 + 5_000 + 20, 3)
        );
        assert_eq!(st.oldest_ms, Some(T0 + 500));
        assert_eq!(st.dedup_rows, 7);
        assert_eq!(st.heartbeat_ms, Some(T0 + 30_000));
        assert_eq!(
            st.last_backup,
            Some(LastBackup {
                at_ms: T0 + 40_000,
                file: Some("/b/relay-1.db".to_owned()),
                bytes: Some(40_960),
            })
        );
        // The deepest two: beta (3 items), then gone (2 items) ahead of gamma (1 big item).
        let fp = |k: &str| PublicKey::from_b64(k).expect("key").fingerprint();
        assert_eq!(
            st.deepest,
            vec![
                TargetQueue {
                    host_pubkey: beta.clone(),
                    host_name: Some("beta".to_owned()),
                    fingerprint: fp(&beta),
                    revoked: false,
                    items: 3,
                    bytes: 250,
                    oldest_ms: T0 + 1_000,
                },
                TargetQueue {
                    host_pubkey: gone.clone(),
                    host_name: Some("gone".to_owned()),
                    fingerprint: fp(&gone),
                    revoked: true,
                    items: 2,
                    bytes: 20,
                    oldest_ms: T0 + 4_000,
                },
            ]
        );
        assert_eq!(read(&dir, now, 0).expect("status").deepest, vec![]);
        assert_eq!(read(&dir, now, 10).expect("status").deepest.len(), 3);

        // JSON: the documented shape.
        let j = st.to_json();
        assert_eq!(j["v"], 1);
        assert_eq!(j["at"], iso_ms(now));
        assert_eq!(j["hosts"], json!({"enrolled": 3, "revoked": 1}));
        assert_eq!(j["queue"]["items"], 6);
        assert_eq!(j["queue"]["bytes"], 5_270);
        assert_eq!(j["queue"]["targets"], 3);
        assert_eq!(j["queue"]["oldest_at"], iso_ms(T0 + 500));
        assert_eq!(j["queue"]["oldest_age_ms"], 99_500);
        assert_eq!(
            j["queue"]["deepest"][0],
            json!({"host": "beta", "host_pubkey": beta, "fingerprint": fp(&beta),
                   "revoked": false, "items": 3, "bytes": 250,
                   "oldest_at": iso_ms(T0 + 1_000), "oldest_age_ms": 99_000})
        );
        assert_eq!(
            j["heartbeat"],
            json!({"at": iso_ms(T0 + 30_000), "age_ms": 70_000})
        );
        assert_eq!(
            j["last_backup"],
            json!({"at": iso_ms(T0 + 40_000), "age_ms": 60_000,
                   "file": "/b/relay-1.db", "bytes": 40_960})
        );
        assert_eq!(j["dedup_rows"], 7);
        assert_eq!(j["schema_version"], SCHEMA_VERSION);
        assert_eq!(j["epoch"], epoch.as_str());

        // Text: one fact per line.
        let text = st.text();
        for want in [
            "hosts        3 enrolled, 1 revoked\n",
            "queued       6 items, 5270 bytes (5.1 KiB) for 3 targets; oldest 1m39s ago\n",
            &format!("beta  {}  3 items  250 bytes  oldest 1m39s ago\n", fp(&beta)),
            "gone (revoked)  ",
            &format!("epoch        {epoch}\n"),
            &format!("relay key    fingerprint {}\n", relay_key.fingerprint()),
            "heartbeat    2026-01-01T00:00:30.000Z (1m10s ago)\n",
            "last backup  2026-01-01T00:00:40.000Z (1m00s ago): /b/relay-1.db (40960 bytes (40.0 KiB))\n",
            "dedup        7 rows\n",
        ] {
            assert!(text.contains(want), "{want:?} missing in:\n{text}");
        }
    }

    #[test]
    fn an_empty_store_that_never_served() {
        let tmp = tempfile::tempdir().expect("tmp");
        let dir = tmp.path().join("store");
        let store = open_store(&dir, &key());
        drop(store);
        let st = read(&dir, T0, 5).expect("status");
        assert_eq!((st.enrolled, st.revoked, st.queued_items), (0, 0, 0));
        assert_eq!((st.oldest_ms, st.heartbeat_ms), (None, None));
        assert!(st.last_backup.is_none());
        let j = st.to_json();
        assert_eq!(j["heartbeat"], Value::Null);
        assert_eq!(j["last_backup"], Value::Null);
        assert_eq!(j["queue"]["oldest_at"], Value::Null);
        assert_eq!(j["queue"]["deepest"], json!([]));
        let text = st.text();
        assert!(text.contains("queued       nothing\n"), "{text}");
        assert!(text.contains("heartbeat    none"), "{text}");
        assert!(
            text.contains("last backup  none in the relay log\n"),
            "{text}"
        );
    }

    #[test]
    fn a_heartbeat_that_is_not_a_time_shows_as_unreadable_not_none() {
        let dir = tempfile::tempdir().expect("tempdir");
        open_store(dir.path(), &key()).close().expect("close");
        Connection::open(dir.path().join(DB_FILE))
            .expect("raw")
            .execute("INSERT INTO meta (k, v) VALUES ('heartbeat', 'soon')", [])
            .expect("beat");
        let st = read(dir.path(), T0, 5).expect("status");
        assert_eq!(st.heartbeat_ms, None);
        assert!(st.heartbeat_unreadable);
        assert_eq!(st.to_json()["heartbeat"], json!({"unreadable": true}));
        let text = st.text();
        assert!(text.contains("heartbeat    unreadable"), "{text}");
        assert!(!text.contains("none (no relay"), "{text}");
    }

    #[test]
    fn it_reads_without_the_lock_and_creates_nothing() {
        let tmp = tempfile::tempdir().expect("tmp");
        let dir = tmp.path().join("store");
        // A store closed cleanly: relay.db alone (plus the lock file) and no WAL files.
        let store = open_store(&dir, &key());
        let k = key();
        enrol(&store, &k, "beta");
        push(&store, &k, "m1", &k, 10, T0);
        store.close().expect("close");
        let before = names(&dir);
        assert!(
            !before
                .iter()
                .any(|n| n.ends_with("-wal") || n.ends_with("-shm")),
            "{before:?}"
        );
        let db = dir.join(DB_FILE);
        let bytes = std::fs::read(&db).expect("read");
        let st = read(&dir, T0 + 1, 5).expect("status");
        assert_eq!(st.queued_items, 1);
        assert_eq!(names(&dir), before, "nothing created");
        assert_eq!(std::fs::read(&db).expect("read"), bytes, "nothing written");

        // While a store is open (as `relay serve` holds it, lock included), the status reads
        // through its WAL and sees its latest commit.
        let store = open_store(&dir, &st.relay_pubkey.clone().expect("relay key"));
        push(&store, &k, "m2", &k, 10, T0 + 2);
        let open_names = names(&dir);
        let st = read(&dir, T0 + 3, 5).expect("status while open");
        assert_eq!(st.queued_items, 2);
        assert_eq!(names(&dir), open_names);
        drop(store);
    }

    #[test]
    fn paths_become_percent_encoded_file_uris() {
        assert_eq!(
            file_uri(Path::new("/a b/c?d#e%f/relay.db")),
            "file:/a%20b/c%3Fd%23e%25f/relay.db"
        );
        // A store under such a name reads like any other.
        let tmp = tempfile::tempdir().expect("tmp");
        let dir = tmp.path().join("odd ?#% name");
        let store = open_store(&dir, &key());
        store.close().expect("close");
        assert_eq!(read(&dir, T0, 5).expect("status").enrolled, 0);
    }

    #[test]
    fn ages_read_as_spans() {
        assert_eq!(age(0), "0s ago");
        assert_eq!(age(59_999), "59s ago");
        assert_eq!(age(185_000), "3m05s ago");
        assert_eq!(age(2 * 3_600_000 + 7 * 60_000), "2h07m ago");
        assert_eq!(age(3 * 86_400_000 + 4 * 3_600_000), "3d04h ago");
        assert_eq!(age(-90_000), "1m30s in the future");
        assert_eq!(bytes(1), "1 byte");
        assert_eq!(bytes(1023), "1023 bytes");
        assert_eq!(bytes(52_428_800), "52428800 bytes (50.0 MiB)");
    }
}
