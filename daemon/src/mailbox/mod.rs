//! The host store, `mailbox.db` (`wire.md` §6, spec §3–§4 host side): messages and per-agent
//! deliveries, the outbox (one row per message and target host, with its persisted wire bytes
//! and relay accept), the relay receive position, quarantine, peers, idempotency records,
//! mail held for names this host does not have (`unclaimed`), and the full-text index of
//! subjects and bodies ([`search`]).
//!
//! Invariants: every state change that matters is one transaction; the wire bytes of an outbox
//! row never change once written (a retry reuses them byte for byte); a row leaves the active
//! outbox only on a verified accept; `received_through` moves in the same transaction as the
//! last item of the run it covers; nothing received is dropped silently (rejected items go to
//! quarantine).
//!
//! This module is SQL only: it never seals, signs, verifies or parses a key (the outbound step
//! `crate::node::outbound` makes the wire bytes it keeps; a caller's closure parses and checks
//! a retired key for [`peers::check_retired`]). Outside its tests it imports nothing of
//! `agentmbx_protocol::{seal, keys, envelope::verify, hop}`, with one exception: the conflict
//! text of [`peers::add`] names the already pinned key by its fingerprint, which parses that
//! key. The protocol's text helpers (`envelope::one_line`, `truncate_utf16`) may be used. It
//! never imports a transport or the mail logic (`crate::node`) above it, never talks to the network and never blocks the async runtime: async code calls
//! [`Mailbox::run`], which moves the closure to a blocking thread. One process (the daemon, or
//! a CLI command while no daemon writes the same row) writes; SQLite's lock and busy timeout
//! make a concurrent CLI write safe.
//!
//! Waiting for mail: [`Mailbox::with`] is also the one wake point for readers that wait
//! ([`wake`]): after a closure that changed rows returns (its transaction committed), the
//! agents that got new deliveries are notified, whatever path delivered them.

pub mod agents;
pub mod audit;
pub mod brake;
pub mod events;
pub mod history;
pub mod hooks;
pub mod idempotency;
pub mod lan_memory;
pub mod lane;
pub mod messages;
pub mod outbox;
pub mod peers;
pub mod receipts;
pub mod relay_state;
pub mod schedule;
mod schema;
pub mod search;
pub mod unclaimed;
pub mod wake;

use std::path::Path;
use std::sync::{Arc, Mutex};

use rusqlite::Connection;

pub use schema::SCHEMA_VERSION;

/// Errors of the host store.
#[derive(Debug, thiserror::Error)]
pub enum MailboxError {
    /// SQLite failed.
    #[error("mailbox database error: {0}")]
    Sqlite(#[from] rusqlite::Error),
    /// `mailbox.db` was written by a newer agentmbx.
    #[error("mailbox.db has schema version {found}; this agentmbx supports up to {supported}: upgrade agentmbx")]
    SchemaTooNew {
        /// Version in the file.
        found: u32,
        /// Newest version this binary knows.
        supported: u32,
    },
    /// Something the caller asked for does not exist.
    #[error("{0}")]
    NotFound(String),
    /// The request conflicts with stored state (e.g. a second key for a known peer name).
    #[error("{0}")]
    Conflict(String),
    /// The request is invalid.
    #[error("{0}")]
    Invalid(String),
    /// `mailbox.db` could not be created or made owner-only.
    #[error("{path}: {source}")]
    File {
        /// The file.
        path: std::path::PathBuf,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// The blocking task failed (panicked or was cancelled).
    #[error("mailbox task failed")]
    Task,
}

impl MailboxError {
    /// True when SQLite gave up waiting for a lock another connection or process holds
    /// (`SQLITE_BUSY` after [`BUSY_TIMEOUT_MS`], or `SQLITE_LOCKED`): nothing was changed and a
    /// retry may succeed. The local API answers it 503 `STORE_BUSY`.
    pub fn is_busy(&self) -> bool {
        matches!(
            self,
            MailboxError::Sqlite(rusqlite::Error::SqliteFailure(e, _))
                if matches!(e.code, rusqlite::ErrorCode::DatabaseBusy | rusqlite::ErrorCode::DatabaseLocked)
        )
    }
}

/// How long a statement waits for a write lock another connection or process holds before it
/// fails with `SQLITE_BUSY` (ms): 5000. Long enough for any transaction of the daemon's own, short
/// enough that a lock held by another program (a backup, a `sqlite3` shell) becomes a clear
/// answer instead of a hang: the local API answers 503 `STORE_BUSY`.
pub const BUSY_TIMEOUT_MS: u64 = 5000;

/// Shared handle to `mailbox.db`.
#[derive(Clone, Debug)]
pub struct Mailbox {
    conn: Arc<Mutex<Connection>>,
    waits: Arc<wake::WaitHub>,
}

impl Mailbox {
    /// Opens (creating or migrating) `mailbox.db` at `path`. The file (and its `-wal`/`-shm`
    /// companions, which SQLite creates with the file's mode) is owner-only, 0600: it holds
    /// plaintext bodies and pairing-token keys. Pragmas: WAL, synchronous=FULL, foreign_keys,
    /// busy_timeout [`BUSY_TIMEOUT_MS`]. Errors: [`MailboxError::SchemaTooNew`], [`MailboxError::File`],
    /// SQLite.
    pub fn open(path: &Path) -> Result<Self, MailboxError> {
        restrict(path)?;
        let mut conn = Connection::open(path)?;
        conn.pragma_update(None, "journal_mode", "WAL")?;
        conn.pragma_update(None, "synchronous", "FULL")?;
        conn.pragma_update(None, "foreign_keys", "ON")?;
        conn.busy_timeout(std::time::Duration::from_millis(BUSY_TIMEOUT_MS))?;
        schema::migrate(&mut conn)?;
        let seen: i64 =
            conn.query_row("SELECT COALESCE(MAX(seq), 0) FROM deliveries", [], |r| {
                r.get(0)
            })?;
        Ok(Mailbox {
            conn: Arc::new(Mutex::new(conn)),
            waits: Arc::new(wake::WaitHub::new(seen)),
        })
    }

    /// Runs `f` with the connection on the current thread (CLI and tests). When `f` changed
    /// rows and left no transaction open, the agents that got new deliveries are woken
    /// ([`wake`]) before this returns: after the commit, never before.
    pub fn with<T>(
        &self,
        f: impl FnOnce(&mut Connection) -> Result<T, MailboxError>,
    ) -> Result<T, MailboxError> {
        let mut guard = self.conn.lock().map_err(|_| MailboxError::Task)?;
        let changes = guard.total_changes();
        let out = f(&mut guard);
        if guard.total_changes() != changes && guard.is_autocommit() {
            self.waits.announce(&guard);
        }
        out
    }

    /// The hub waiting readers subscribe to ([`wake`]).
    pub fn waits(&self) -> &wake::WaitHub {
        &self.waits
    }

    /// Runs `f` with the connection on a blocking thread (async callers).
    pub async fn run<T: Send + 'static>(
        &self,
        f: impl FnOnce(&mut Connection) -> Result<T, MailboxError> + Send + 'static,
    ) -> Result<T, MailboxError> {
        let this = self.clone();
        tokio::task::spawn_blocking(move || this.with(f))
            .await
            .map_err(|_| MailboxError::Task)?
    }
}

/// Runs one of the due-row selections of the LAN-or-relay rule ([`lane`]):
/// `sql` uses `:now`, `:limit`, `:t` (LAN failures before the relay) and `:r` (a relay is
/// configured); each row is read with `map`. The one place the outbox and the receipt queue
/// bind the rule's parameters.
pub(crate) fn select_due<T>(
    conn: &Connection,
    sql: &str,
    now_ms: i64,
    limit: usize,
    relay_configured: bool,
    map: fn(&rusqlite::Row<'_>) -> rusqlite::Result<T>,
) -> Result<Vec<T>, MailboxError> {
    select_due_except(conn, sql, now_ms, limit, relay_configured, None, map)
}

/// [`select_due`] for an `sql` that also uses `:ex` (a JSON array of peer handles to leave
/// out, e.g. `host NOT IN (SELECT value FROM json_each(:ex))`) when `exclude` is given.
pub(crate) fn select_due_except<T>(
    conn: &Connection,
    sql: &str,
    now_ms: i64,
    limit: usize,
    relay_configured: bool,
    exclude: Option<&[String]>,
    map: fn(&rusqlite::Row<'_>) -> rusqlite::Result<T>,
) -> Result<Vec<T>, MailboxError> {
    let mut st = conn.prepare(sql)?;
    let limit = limit as i64;
    let t = lane::LAN_FAILURES_BEFORE_RELAY;
    let ex = exclude.map(|e| serde_json::to_string(e).unwrap_or_else(|_| "[]".into()));
    let mut params: Vec<(&str, &dyn rusqlite::ToSql)> = vec![
        (":now", &now_ms),
        (":limit", &limit),
        (":t", &t),
        (":r", &relay_configured),
    ];
    if let Some(ex) = &ex {
        params.push((":ex", ex));
    }
    let rows = st
        .query_map(params.as_slice(), map)?
        .collect::<Result<Vec<_>, _>>()?;
    Ok(rows)
}

/// Makes `path` owner-only (0600), creating it empty when missing, and tightens existing
/// `-wal`/`-shm` files, whatever the umask or the home directory's mode.
fn restrict(path: &Path) -> Result<(), MailboxError> {
    #[cfg(unix)]
    {
        use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
        let io = |source: std::io::Error| MailboxError::File {
            path: path.to_path_buf(),
            source,
        };
        std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .mode(crate::fsutil::PRIVATE_MODE)
            .open(path)
            .map_err(io)?;
        for suffix in ["", "-wal", "-shm"] {
            let p = std::path::PathBuf::from(format!("{}{suffix}", path.display()));
            match std::fs::set_permissions(
                &p,
                std::fs::Permissions::from_mode(crate::fsutil::PRIVATE_MODE),
            ) {
                Ok(()) => {}
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => return Err(io(e)),
            }
        }
    }
    #[cfg(not(unix))]
    let _ = path;
    Ok(())
}
