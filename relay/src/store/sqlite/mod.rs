//! [`SqliteStore`]: the SQLite implementation of [`RelayStore`] (spec §2, `wire.md` §3.3).
//!
//! # Threads and connections
//! - **`relay.lock`** — a separate SQLite file opened with `locking_mode=EXCLUSIVE` and written
//!   once inside `BEGIN EXCLUSIVE` (table `holder(pid, at)`). Its exclusive file lock is held
//!   until the store is dropped, and the OS releases it if the process dies (even on SIGKILL),
//!   so exactly one store — one process — writes `relay.db` (`wire.md` §3.4). SQLite tracks the
//!   lock per connection, so a second store in the same process is refused too.
//! - **The writer thread** owns the only write connection to `relay.db` (WAL,
//!   `synchronous=FULL`). Requests reach it over a channel. It takes whatever is waiting (up to
//!   [`MAX_GROUP_REQUESTS`]) and applies it inside one `BEGIN IMMEDIATE … COMMIT`, in order, so
//!   later requests see earlier ones. Each request other than a push runs in a SAVEPOINT, so a
//!   failed request leaves nothing. A pushed item is checked completely (dedup, enrolment,
//!   allowlist, quotas) before its first write, so a rejected item writes nothing and a push
//!   fails only on an SQLite error: it needs no savepoint (one copied every page the push
//!   touched into the sub-journal). A push that fails before writing anything fails alone; one
//!   that fails after a write fails its whole group ([`StoreError::NotCommitted`] for every
//!   other request of it; none of them is stored).
//!   One COMMIT (one fsync) covers the group; only then are the replies sent. If the COMMIT fails, every request of the group gets
//!   [`StoreError::NotCommitted`]. This is group commit (design README "Decisions already
//!   taken"); for atomicity and visibility it is exactly one transaction per item (spec §3).
//! - **A failed COMMIT (or a failed ROLLBACK) stops the writer for good.** After an fsync or
//!   I/O error the file's state and this process's view may differ, so no later write is tried:
//!   each one fails with [`StoreError::WriterFailed`], [`StoreHealth::failed`] reports why, and
//!   the relay exits so that a restart lets SQLite's recovery decide what is durable.
//! - **Readers** use a small pool of read-only connections; WAL lets them read the last
//!   committed state while the writer works, and they never see uncommitted rows. Multi-query
//!   reads (pull, info) run in one read transaction, so they see one snapshot.
//! - **A clean close leaves everything in `relay.db`**: the idle readers are closed, the writer
//!   finishes the queued requests and then runs `PRAGMA wal_checkpoint(TRUNCATE)`, so a copy of
//!   `relay.db` alone is the whole store (a failed checkpoint is logged, never fatal; after a
//!   failed COMMIT no checkpoint is tried, recovery at the next start decides).
//!
//! # Files
//! The store directory is created 0700 (one that exists is never changed; a warning says when
//! group or others can read it), and `relay.db`, its `-wal` and `-shm` and `relay.lock` are
//! 0600 whatever the umask: `relay.db` and `relay.lock` are created 0600 before SQLite opens
//! them (SQLite gives `-wal` and `-shm` the main file's mode), and every one of them that
//! exists is set to 0600 after the open. They hold routing metadata (who talks to whom).
//!
//! # Modules
//! This file opens and closes the store. The rest is split by concern, each module holding its
//! SQL and, for the four store traits, the `impl` of its trait:
//! - `writer`: the writer thread, group commit, the jobs it runs; `impl` [`StoreHealth`].
//! - `read_pool`: the read-only connections.
//! - `files`: `relay.lock` ([`StoreLock`]), the live-heartbeat check, private directory and
//!   files, the write connection, recovery of the WAL an unclean stop left.
//! - `schema`: the DDL and its migrations ([`SCHEMA_VERSION`]).
//! - `meta`: the `meta` table (epoch, relay key, reserved keys).
//! - `items`: push (dedup, all-or-nothing fan-out, quotas, seq allocation), pull, ack;
//!   `impl` [`ItemStore`].
//! - `directory`: enrolments, revocation, enc-key ads, sender allowlists; `impl`
//!   [`DirectoryStore`] (the deny list and account bindings in `deny`, host rotation in
//!   `rotate`).
//! - `oplog`: the operations log and epoch rotation; `impl` [`OperationsStore`] (the
//!   retention sweep in `sweep`).
//!
//! [`StoreHealth`]: crate::store::StoreHealth
//! [`ItemStore`]: crate::store::ItemStore
//! [`DirectoryStore`]: crate::store::DirectoryStore
//! [`OperationsStore`]: crate::store::OperationsStore

pub(crate) mod backup;
mod deny;
mod directory;
mod enrolment_rows;
mod files;
mod items;
pub(crate) mod maintenance;
mod meta;
mod oplog;
mod oplog_rows;
mod read_pool;
mod restore;
mod rotate;
pub(super) mod schema;
mod status;
mod sweep;
mod writer;

#[cfg(test)]
mod tests;

pub use files::{prepare_store_dir, StoreLock};
pub(crate) use oplog_rows::append_op_signed;
pub(crate) use rotate::{replay_rotation, ROTATION_META_PREFIX};
/// The error SQLite reports (`rusqlite::Error`), carried by [`StoreError::Sqlite`].
pub use rusqlite::Error as SqliteError;

use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;
use std::sync::{mpsc, Arc, Mutex, OnceLock};
use std::thread::JoinHandle;
use std::time::Duration;

use rusqlite::{Connection, TransactionBehavior};

use files::{
    acquire_lock_checked, create_private_dir, create_private_file, open_write_connection,
    recover_unclean_stop, restrict_store_files, wal_bytes, Taken,
};
use meta::{meta_get, meta_put, new_epoch, read_epoch};
use read_pool::ReadPool;
use writer::{Counters, WriteJob, Writer};

use crate::store::{key_fingerprint, OpenOptions, StoreError, StoreLimits, DB_FILE};
use crate::store::{OpSigner, StoreStats};

use schema::{MIGRATIONS, SCHEMA_VERSION};

/// `busy_timeout` of every `relay.db` connection (`wire.md` §3.3).
const BUSY_TIMEOUT: Duration = Duration::from_millis(5_000);

/// Idle read connections kept for reuse; more are opened on demand and closed after use. Every
/// concurrent request may hold one (authentication reads the caller's enrolment), so this is
/// sized for a busy relay: opening a connection costs far more than the read it serves.
const READ_POOL_IDLE: usize = 16;

/// Prepared statements each connection keeps (rusqlite's default is 16): the writer's push path
/// alone uses a dozen, and a statement pushed out of the cache is parsed again on its next use.
const STATEMENT_CACHE: usize = 64;

/// Page cache of the write connection, as SQLite's `cache_size` takes it: negative = KiB
/// (here 16 MiB, against SQLite's default of 2 MiB).
const WRITER_CACHE_KIB: i64 = -16_384;

/// The SQLite relay store: one `relay.db` (WAL, `synchronous=FULL`) in a store directory, a
/// single writer thread with group commit, read-only connections for reads, and `relay.lock`
/// held for its whole life. See the module docs for the threading model.
///
/// Dropping it stops the writer (after the requests already queued) and releases the lock.
pub struct SqliteStore {
    dir: PathBuf,
    limits: StoreLimits,
    jobs: Option<mpsc::Sender<Box<dyn WriteJob>>>,
    writer: Option<JoinHandle<()>>,
    readers: ReadPool,
    counters: Arc<Counters>,
    failure: Arc<OnceLock<String>>,
}

impl std::fmt::Debug for SqliteStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SqliteStore")
            .field("dir", &self.dir)
            .field("limits", &self.limits)
            .field("stats", &self.stats())
            .field("failed", &self.failure.get())
            .finish_non_exhaustive()
    }
}

impl SqliteStore {
    /// Open (or create) the store in `dir` with [`OpenOptions::default`]: waits up to 60 s for
    /// `relay.lock`. See [`SqliteStore::open_with`].
    pub fn open(dir: &Path, relay_pubkey: &str, now_ms: i64) -> Result<Self, StoreError> {
        Self::open_with(dir, relay_pubkey, now_ms, OpenOptions::default())
    }

    /// Open (or create) the store in `dir` for the relay whose public key (standard base64) is
    /// `relay_pubkey`; `now_ms` is recorded in `relay.lock`'s holder row.
    ///
    /// Steps: create `dir` (0700) if missing; take `relay.lock` (waiting up to
    /// `options.lock_wait_ms`, logging the holder once when it has to wait); open `relay.db`
    /// (files 0600, module docs "Files") with WAL, `synchronous=FULL`, `foreign_keys=ON`, `busy_timeout=5000`; refuse a
    /// newer schema; refuse a store bound to another relay key; migrate an older schema in one
    /// transaction; on a fresh store record `relay_pubkey` and a new random epoch; start the
    /// writer thread. A fresh store has no heartbeat yet.
    ///
    /// Errors: [`StoreError::Locked`], [`StoreError::SchemaTooNew`],
    /// [`StoreError::OtherRelayKey`], [`StoreError::Io`], [`StoreError::Sqlite`],
    /// [`StoreError::InvalidInput`] for an empty key.
    pub fn open_with(
        dir: &Path,
        relay_pubkey: &str,
        now_ms: i64,
        options: OpenOptions,
    ) -> Result<Self, StoreError> {
        Self::open_inner(dir, relay_pubkey, now_ms, options, None, None)
    }

    /// [`SqliteStore::open_with`] for the store whose `relay.lock` `lock` holds (taken with
    /// [`StoreLock::acquire`]; `options.lock_wait_ms` is not used), bound to
    /// `signer.relay_pubkey()`, and signing every receipt it appends to the relay log with
    /// `signer` (spec §5; [`OpSigner`]). This is how the relay and the offline operator commands
    /// open a store. Errors: as [`SqliteStore::open_with`].
    pub fn open_signed(
        lock: StoreLock,
        signer: Arc<dyn OpSigner>,
        now_ms: i64,
        options: OpenOptions,
    ) -> Result<Self, StoreError> {
        let relay_pubkey = signer.relay_pubkey();
        let dir = lock.dir.clone();
        Self::open_inner(
            &dir,
            &relay_pubkey,
            now_ms,
            options,
            Some((lock.conn, lock.previous)),
            Some(signer),
        )
    }

    fn open_inner(
        dir: &Path,
        relay_pubkey: &str,
        now_ms: i64,
        options: OpenOptions,
        lock: Option<Taken>,
        signer: Option<Arc<dyn OpSigner>>,
    ) -> Result<Self, StoreError> {
        if relay_pubkey.trim().is_empty() {
            return Err(StoreError::InvalidInput(
                "the relay public key is empty".to_owned(),
            ));
        }
        let (lock, previous) = match lock {
            Some(taken) => taken,
            None => {
                create_private_dir(dir)?;
                acquire_lock_checked(dir, options.lock_wait_ms, now_ms)?
            }
        };
        let db_path = dir.join(DB_FILE);
        // Read before SQLite opens the database (its recovery starts at the first read).
        let left_wal = wal_bytes(dir);
        create_private_file(&db_path)?;
        let mut conn = open_write_connection(&db_path)?;
        if left_wal > 0 {
            recover_unclean_stop(&conn, dir, left_wal, previous.as_ref());
        }

        let found = schema::stored_version(&conn)?;
        if found > SCHEMA_VERSION {
            return Err(StoreError::SchemaTooNew {
                found,
                supported: SCHEMA_VERSION,
            });
        }
        if found > 0 {
            // Never migrate another relay's store.
            if let Some(stored) = meta_get(&conn, "relay_pubkey")? {
                if stored != relay_pubkey {
                    return Err(other_relay_key(&stored, relay_pubkey));
                }
            }
        }
        schema::migrate(&mut conn, found, SCHEMA_VERSION, MIGRATIONS)?;
        bind_identity(&mut conn, relay_pubkey)?;
        restrict_store_files(dir);
        let epoch = read_epoch(&conn)?;
        log_opened(dir, found, &epoch, relay_pubkey);

        let counters = Arc::new(Counters::default());
        let failure = Arc::new(OnceLock::new());
        let writer = Writer {
            conn,
            _lock: lock,
            limits: options.limits.clone(),
            failpoint: options.failpoint,
            counters: Arc::clone(&counters),
            failure: Arc::clone(&failure),
            signer,
        };
        let (jobs, inbox) = mpsc::channel::<Box<dyn WriteJob>>();
        let handle = std::thread::Builder::new()
            .name("relay-store-writer".to_owned())
            .spawn(move || writer.run(inbox))
            .map_err(|source| StoreError::Io {
                path: db_path.clone(),
                source,
            })?;
        Ok(Self {
            dir: dir.to_path_buf(),
            limits: options.limits,
            jobs: Some(jobs),
            writer: Some(handle),
            readers: ReadPool {
                path: db_path,
                idle: Mutex::new(Vec::new()),
            },
            counters,
            failure,
        })
    }

    /// The store directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The limits this store enforces.
    pub fn limits(&self) -> &StoreLimits {
        &self.limits
    }

    /// The writer's counters.
    pub fn stats(&self) -> StoreStats {
        StoreStats {
            write_requests: self.counters.write_requests.load(Ordering::SeqCst),
            groups: self.counters.groups.load(Ordering::SeqCst),
            commits: self.counters.commits.load(Ordering::SeqCst),
            queued: self.counters.queued.load(Ordering::SeqCst),
        }
    }

    /// How many group transactions committed so far.
    pub fn commits(&self) -> u64 {
        self.counters.commits.load(Ordering::SeqCst)
    }

    /// Stop the writer after the requests already queued, checkpoint the WAL into `relay.db`
    /// (module docs), close the database and release `relay.lock`. Dropping the store does the
    /// same; this one reports a writer that panicked ([`StoreError::WriterStopped`]).
    pub fn close(mut self) -> Result<(), StoreError> {
        if self.shutdown() {
            Ok(())
        } else {
            Err(StoreError::WriterStopped)
        }
    }

    /// Returns false if the writer thread had panicked.
    fn shutdown(&mut self) -> bool {
        // Idle readers closed first, so the writer's checkpoint can empty the WAL.
        self.readers
            .idle
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clear();
        drop(self.jobs.take());
        match self.writer.take() {
            Some(handle) => handle.join().is_ok(),
            None => true,
        }
    }
}

impl Drop for SqliteStore {
    fn drop(&mut self) {
        if !self.shutdown() {
            tracing::error!("relay store writer thread had panicked");
        }
    }
}

/// The one "relay store opened" line: `created=true` for a new store, `migrated_from=<v>` only
/// when this open migrated the schema from version `v` (never for a store already at
/// [`SCHEMA_VERSION`]).
fn log_opened(dir: &Path, found: u32, epoch: &str, relay_pubkey: &str) {
    let (store, fingerprint) = (dir.display(), key_fingerprint(relay_pubkey));
    match found {
        0 => tracing::info!(
            store = %store,
            schema_version = SCHEMA_VERSION,
            created = true,
            epoch = %epoch,
            relay_fingerprint = %fingerprint,
            "relay store opened"
        ),
        v if v < SCHEMA_VERSION => tracing::info!(
            store = %store,
            schema_version = SCHEMA_VERSION,
            migrated_from = v,
            epoch = %epoch,
            relay_fingerprint = %fingerprint,
            "relay store opened"
        ),
        _ => tracing::info!(
            store = %store,
            schema_version = SCHEMA_VERSION,
            epoch = %epoch,
            relay_fingerprint = %fingerprint,
            "relay store opened"
        ),
    }
}

/// Record the relay key and an epoch on a fresh store; refuse another relay's store.
fn bind_identity(conn: &mut Connection, relay_pubkey: &str) -> Result<(), StoreError> {
    let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate)?;
    match meta_get(&tx, "relay_pubkey")? {
        Some(stored) if stored != relay_pubkey => {
            return Err(other_relay_key(&stored, relay_pubkey));
        }
        Some(_) => {}
        None => meta_put(&tx, "relay_pubkey", relay_pubkey)?,
    }
    if meta_get(&tx, "epoch")?.is_none() {
        meta_put(&tx, "epoch", &new_epoch())?;
    }
    tx.commit()?;
    Ok(())
}

fn other_relay_key(stored: &str, given: &str) -> StoreError {
    StoreError::OtherRelayKey {
        stored_fingerprint: key_fingerprint(stored),
        given_fingerprint: key_fingerprint(given),
    }
}
