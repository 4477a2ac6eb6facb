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
//!   each one fails with [`StoreError::WriterFailed`], [`RelayStore::failed`] reports why, and
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

pub(crate) mod backup;
mod deny;
mod restore;
mod rotate;
mod status;
mod sweep;

pub(crate) use rotate::{replay_rotation, ROTATION_META_PREFIX};

use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{mpsc, Arc, Mutex, OnceLock};
use std::thread::JoinHandle;
use std::time::Duration;

use rusqlite::{params, Connection, OpenFlags, OptionalExtension, TransactionBehavior};

use super::schema::{self, MIGRATIONS, SCHEMA_VERSION};
use super::OpSigner;
use super::{
    is_canonical_key, key_fingerprint, wire_hash, AckOutcome, AckRequest, AckResult,
    AuthorityStrength, EncAd, EncAdV1, EncAdV2, EnrolOutcome, EnrolRequest, Enrolment,
    EpochRotation, Expiry, HostQueueInfo, ItemOutcome, ItemStatus, OpRecord, OpenOptions, PullPage,
    PullRequest, PulledItem, PushBatch, PushItem, PushOutcome, QuotaKind, Rejection, RelayStore,
    RevokeOutcome, SenderList, SenderListOutcome, StoreError, StoreLimits, TargetAccept, DAY_MS,
    DB_FILE, LOCK_FILE, MAX_GROUP_REQUESTS, MAX_PULL_ITEMS, OPS_KEEP,
};

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

/// Meta keys that only dedicated methods may write.
const RESERVED_META: &[&str] = &["schema_version", "epoch", "relay_pubkey", "heartbeat"];

/// Counters of the writer, for tests, benches and `doctor`-style status.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct StoreStats {
    /// Write requests the writer has applied (committed or not).
    pub write_requests: u64,
    /// Groups (transactions) the writer has run.
    pub groups: u64,
    /// Groups that committed. Under concurrency this is lower than `write_requests`: that is the
    /// group commit.
    pub commits: u64,
    /// Write requests waiting for the writer right now.
    pub queued: usize,
}

#[derive(Debug, Default)]
struct Counters {
    write_requests: AtomicU64,
    groups: AtomicU64,
    commits: AtomicU64,
    queued: AtomicUsize,
}

/// Which failpoints a request arms.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum JobKind {
    Push,
    Ack,
    Other,
}

/// A write request as the writer sees it: apply it inside the group transaction, then reply once
/// the group's fate is known.
trait WriteJob: Send {
    fn kind(&self) -> JobKind;
    /// Apply inside the group transaction (inside the request's own savepoint, except for a
    /// push); `true` keeps its effects, `false` rolls them back.
    fn apply(&mut self, conn: &Connection, limits: &StoreLimits) -> bool;
    /// Send the reply: the applied result if the group committed (`failed` is `None`), an error
    /// otherwise.
    fn reply(self: Box<Self>, failed: Option<&str>);
    /// Refuse without applying: the writer stopped after a failed commit.
    fn refuse(self: Box<Self>, reason: &str);
    /// Refuse without applying: the writer thread is gone (the store is closing).
    fn refuse_stopped(self: Box<Self>);
}

struct TypedJob<T, F> {
    kind: JobKind,
    op: Option<F>,
    result: Option<Result<T, StoreError>>,
    /// Called once with the result; must not block (the writer thread calls it).
    reply_to: Box<dyn FnOnce(Result<T, StoreError>) + Send>,
}

impl<T, F> WriteJob for TypedJob<T, F>
where
    T: Send,
    F: FnOnce(&Connection, &StoreLimits) -> Result<T, StoreError> + Send,
{
    fn kind(&self) -> JobKind {
        self.kind
    }

    fn apply(&mut self, conn: &Connection, limits: &StoreLimits) -> bool {
        let result = match self.op.take() {
            Some(op) => op(conn, limits),
            None => Err(StoreError::Corrupt(
                "write request applied twice".to_owned(),
            )),
        };
        let ok = result.is_ok();
        self.result = Some(result);
        ok
    }

    fn reply(self: Box<Self>, failed: Option<&str>) {
        let message = match (failed, self.result) {
            // The request's own error says more than "not committed".
            (_, Some(Err(e))) => Err(e),
            (None, Some(ok)) => ok,
            (Some(reason), _) => Err(StoreError::NotCommitted {
                reason: reason.to_owned(),
            }),
            (None, None) => Err(StoreError::NotCommitted {
                reason: "the request was not applied".to_owned(),
            }),
        };
        // The caller may have gone away; there is nobody else to tell.
        (self.reply_to)(message);
    }

    fn refuse_stopped(self: Box<Self>) {
        (self.reply_to)(Err(StoreError::WriterStopped));
    }

    fn refuse(self: Box<Self>, reason: &str) {
        (self.reply_to)(Err(StoreError::WriterFailed {
            reason: reason.to_owned(),
        }));
    }
}

/// The writer thread's state. Field order matters: `conn` is dropped before `_lock`, so the
/// write connection is closed before the single-writer lock is released.
struct Writer {
    conn: Connection,
    _lock: Connection,
    limits: StoreLimits,
    failpoint: fn(&str),
    counters: Arc<Counters>,
    /// Set once, when a COMMIT or ROLLBACK failed: from then on every write is refused.
    failure: Arc<OnceLock<String>>,
    /// Signs every relay-log receipt this writer appends ([`append_op_apply`]).
    signer: Option<Arc<dyn OpSigner>>,
}

thread_local! {
    /// The op-receipt signer of the writer running on this thread: set once by
    /// [`Writer::run`], read by [`append_op_apply`], so every receipt any write request
    /// appends is signed without each request carrying the signer.
    static WRITER_OP_SIGNER: std::cell::RefCell<Option<Arc<dyn OpSigner>>> =
        const { std::cell::RefCell::new(None) };
}

impl Writer {
    fn run(self, jobs: mpsc::Receiver<Box<dyn WriteJob>>) {
        WRITER_OP_SIGNER.with(|s| *s.borrow_mut() = self.signer.clone());
        self.serve(jobs);
        if self.failure.get().is_none() {
            self.checkpoint();
        }
        tracing::debug!("relay store writer stopped");
    }

    /// Moves everything from the WAL into `relay.db` and empties the WAL, so the database file
    /// alone holds the store. Only logs when it cannot: a shutdown never fails for it.
    fn checkpoint(&self) {
        match self
            .conn
            .query_row("PRAGMA wal_checkpoint(TRUNCATE)", [], |r| {
                r.get::<_, i64>(0)
            }) {
            Ok(0) => tracing::debug!("relay store checkpointed: the WAL is empty"),
            Ok(_) => tracing::warn!(
                "relay store checkpoint incomplete (a reader was still busy): part of the data \
                 stays in relay.db-wal; copy relay.db together with relay.db-wal"
            ),
            Err(e) => tracing::warn!(
                error = %e,
                "relay store checkpoint failed: part of the data stays in relay.db-wal; copy \
                 relay.db together with relay.db-wal"
            ),
        }
    }

    fn serve(&self, jobs: mpsc::Receiver<Box<dyn WriteJob>>) {
        while let Ok(first) = jobs.recv() {
            let mut group = Vec::with_capacity(8);
            group.push(first);
            while group.len() < MAX_GROUP_REQUESTS {
                match jobs.try_recv() {
                    Ok(job) => group.push(job),
                    Err(_) => break,
                }
            }
            self.counters
                .queued
                .fetch_sub(group.len(), Ordering::SeqCst);
            match self.failure.get() {
                // Requests that were already queued when the writer stopped.
                Some(reason) => group.into_iter().for_each(|job| job.refuse(reason)),
                None => self.run_group(group),
            }
        }
    }

    fn run_group(&self, mut group: Vec<Box<dyn WriteJob>>) {
        self.counters
            .write_requests
            .fetch_add(group.len() as u64, Ordering::SeqCst);
        self.counters.groups.fetch_add(1, Ordering::SeqCst);
        let has_push = group.iter().any(|j| j.kind() == JobKind::Push);
        let has_ack = group.iter().any(|j| j.kind() == JobKind::Ack);

        if let Err(e) = run_cached(&self.conn, "BEGIN IMMEDIATE") {
            return self.fail_group(group, &format!("could not begin a transaction: {e}"));
        }
        let mut broken: Option<String> = None;
        for job in group.iter_mut() {
            // A push checks every item completely before its first write, so it fails only on
            // an SQLite error: it runs without a savepoint of its own (which would copy every
            // page it touches into the sub-journal), and its failure fails the whole group.
            let own_savepoint = job.kind() != JobKind::Push;
            let changes_before = self.conn.total_changes();
            if own_savepoint {
                if let Err(e) = run_cached(&self.conn, "SAVEPOINT request") {
                    broken = Some(format!("could not open a savepoint: {e}"));
                    break;
                }
            }
            let conn = &self.conn;
            let limits = &self.limits;
            let applied =
                std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| job.apply(conn, limits)));
            let keep = match applied {
                Ok(keep) => keep,
                Err(_) => {
                    broken = Some("a write request panicked".to_owned());
                    break;
                }
            };
            if !own_savepoint {
                // A push that failed before its first write (no row changed, triggers
                // included) leaves nothing to undo: only it fails. One that wrote fails the
                // group, since without a savepoint its rows cannot be undone alone.
                if !keep && self.conn.total_changes() != changes_before {
                    broken = Some(
                        "a push failed part way through; nothing of this group is stored"
                            .to_owned(),
                    );
                    break;
                }
            } else {
                let end = if keep {
                    run_cached(&self.conn, "RELEASE request")
                } else {
                    run_cached(&self.conn, "ROLLBACK TO request")
                        .and_then(|()| run_cached(&self.conn, "RELEASE request"))
                };
                if let Err(e) = end {
                    broken = Some(format!("could not close a savepoint: {e}"));
                    break;
                }
            }
            if self.conn.is_autocommit() {
                // SQLite rolled the whole transaction back on its own (disk full, I/O error).
                broken = Some("SQLite rolled the transaction back".to_owned());
                break;
            }
        }
        if let Some(reason) = broken {
            return self.fail_group(group, &reason);
        }

        if has_push {
            (self.failpoint)("push:before-commit");
        }
        if has_ack {
            (self.failpoint)("ack:before-commit");
        }
        if let Err(e) = run_cached(&self.conn, "COMMIT") {
            let reason = format!("COMMIT failed: {e}");
            self.stop(&reason);
            return self.fail_group(group, &reason);
        }
        self.counters.commits.fetch_add(1, Ordering::SeqCst);
        if has_push {
            (self.failpoint)("push:after-commit");
        }
        if has_ack {
            (self.failpoint)("ack:after-commit");
        }
        for job in group {
            job.reply(None);
        }
    }

    /// Roll back whatever is open and tell every request of the group that nothing of it was
    /// stored.
    fn fail_group(&self, group: Vec<Box<dyn WriteJob>>, reason: &str) {
        if !self.conn.is_autocommit() {
            if let Err(e) = self.conn.execute_batch("ROLLBACK") {
                tracing::error!(error = %e, "relay store rollback failed");
                self.stop(&format!("ROLLBACK failed after \"{reason}\": {e}"));
            }
        }
        tracing::error!(
            requests = group.len(),
            reason,
            "relay store group not committed"
        );
        for job in group {
            job.reply(Some(reason));
        }
    }

    /// Take no more writes, for good (the first reason is kept).
    fn stop(&self, reason: &str) {
        if self.failure.set(reason.to_owned()).is_ok() {
            tracing::error!(
                reason,
                "relay store takes no more writes: what is durable on disk is now uncertain; \
                 the relay must be restarted so SQLite recovery decides"
            );
        }
    }
}

/// Read-only connections to `relay.db`, reused.
struct ReadPool {
    path: PathBuf,
    idle: Mutex<Vec<Connection>>,
}

impl ReadPool {
    fn with<T>(
        &self,
        f: impl FnOnce(&Connection) -> Result<T, StoreError>,
    ) -> Result<T, StoreError> {
        let reused = self
            .idle
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .pop();
        let conn = match reused {
            Some(conn) => conn,
            None => self.open()?,
        };
        let result = f(&conn);
        // Only a connection with no transaction left open goes back to the pool.
        if conn.is_autocommit() {
            let mut idle = self
                .idle
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            if idle.len() < READ_POOL_IDLE {
                idle.push(conn);
            }
        }
        result
    }

    fn open(&self) -> Result<Connection, StoreError> {
        let conn = Connection::open_with_flags(
            &self.path,
            OpenFlags::SQLITE_OPEN_READ_ONLY | OpenFlags::SQLITE_OPEN_NO_MUTEX,
        )?;
        conn.busy_timeout(BUSY_TIMEOUT)?;
        conn.set_prepared_statement_cache_capacity(STATEMENT_CACHE);
        Ok(conn)
    }
}

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

    /// Hand a write to the writer thread and wait until its group committed (or failed).
    fn submit<T, F>(&self, kind: JobKind, op: F) -> Result<T, StoreError>
    where
        T: Send + 'static,
        F: FnOnce(&Connection, &StoreLimits) -> Result<T, StoreError> + Send + 'static,
    {
        let (reply_to, reply) = mpsc::sync_channel(1);
        self.submit_then(
            kind,
            op,
            Box::new(move |r| {
                // The caller may have gone away; there is nobody else to tell.
                let _ = reply_to.send(r);
            }),
        );
        reply.recv().map_err(|_| StoreError::WriterStopped)?
    }

    /// Hand a write to the writer thread; `done` gets its result once its group committed (or
    /// failed), or at once when the writer no longer takes writes. Never blocks.
    fn submit_then<T, F>(
        &self,
        kind: JobKind,
        op: F,
        done: Box<dyn FnOnce(Result<T, StoreError>) + Send>,
    ) where
        T: Send + 'static,
        F: FnOnce(&Connection, &StoreLimits) -> Result<T, StoreError> + Send + 'static,
    {
        if let Some(reason) = self.failure.get() {
            return done(Err(StoreError::WriterFailed {
                reason: reason.clone(),
            }));
        }
        let Some(jobs) = self.jobs.as_ref() else {
            return done(Err(StoreError::WriterStopped));
        };
        let job: Box<dyn WriteJob> = Box::new(TypedJob {
            kind,
            op: Some(op),
            result: None,
            reply_to: done,
        });
        // Count before sending, so the writer never decrements below zero.
        self.counters.queued.fetch_add(1, Ordering::SeqCst);
        if let Err(mpsc::SendError(job)) = jobs.send(job) {
            self.counters.queued.fetch_sub(1, Ordering::SeqCst);
            job.refuse_stopped();
        }
    }

    fn read<T>(
        &self,
        f: impl FnOnce(&Connection) -> Result<T, StoreError>,
    ) -> Result<T, StoreError> {
        self.readers.with(f)
    }
}

impl Drop for SqliteStore {
    fn drop(&mut self) {
        if !self.shutdown() {
            tracing::error!("relay store writer thread had panicked");
        }
    }
}

impl RelayStore for SqliteStore {
    fn epoch(&self) -> Result<String, StoreError> {
        self.read(read_epoch)
    }

    fn relay_pubkey(&self) -> Result<String, StoreError> {
        self.read(|c| {
            meta_get(c, "relay_pubkey")?
                .ok_or_else(|| StoreError::Corrupt("meta.relay_pubkey is missing".to_owned()))
        })
    }

    fn heartbeat(&self) -> Result<Option<i64>, StoreError> {
        self.read(|c| match meta_get(c, "heartbeat")? {
            None => Ok(None),
            Some(v) => v.trim().parse::<i64>().map(Some).map_err(|_| {
                StoreError::Corrupt(format!("meta.heartbeat {v:?} is not a ms timestamp"))
            }),
        })
    }

    fn set_heartbeat(&self, now_ms: i64) -> Result<(), StoreError> {
        self.submit(JobKind::Other, move |c, _| {
            meta_put(c, "heartbeat", &now_ms.to_string())
        })
    }

    /// A no-op request through the writer thread: it waits its turn behind the queued writes
    /// and joins a group like any other (an empty savepoint: no row, no extra fsync).
    fn writer_answers(&self) -> Result<(), StoreError> {
        self.submit(JobKind::Other, |_, _| Ok(()))
    }

    fn rotate_epoch(&self) -> Result<EpochRotation, StoreError> {
        self.submit(JobKind::Other, |c, _| {
            let from = read_epoch(c)?;
            let to = new_epoch();
            meta_put(c, "epoch", &to)?;
            Ok(EpochRotation { from, to })
        })
    }

    fn rotate_epoch_logged(
        &self,
        log: super::OpEntry,
    ) -> Result<(EpochRotation, serde_json::Value), StoreError> {
        if !log.receipt.is_object() {
            return Err(StoreError::InvalidInput(
                "an epoch rotation receipt must be a JSON object".to_owned(),
            ));
        }
        self.submit(JobKind::Other, move |c, _| {
            let from = read_epoch(c)?;
            let to = new_epoch();
            meta_put(c, "epoch", &to)?;
            let mut receipt = log.receipt;
            receipt["from"] = serde_json::Value::String(from.clone());
            receipt["to"] = serde_json::Value::String(to.clone());
            // The signed receipt, as logged, is also what meta keeps and the caller gets.
            let signer = WRITER_OP_SIGNER.with(|s| s.borrow().clone());
            let (_, text) = append_op_signed(
                c,
                signer.as_deref(),
                log.at_ms,
                &log.op,
                &op_receipt_text(&receipt)?,
            )?;
            meta_put(c, "epoch_rotated", &text)?;
            let receipt = serde_json::from_str(&text)
                .map_err(|e| StoreError::Corrupt(format!("op receipt is not JSON: {e}")))?;
            Ok((EpochRotation { from, to }, receipt))
        })
    }

    fn meta(&self, key: &str) -> Result<Option<String>, StoreError> {
        self.read(|c| meta_get(c, key))
    }

    fn set_meta(&self, key: &str, value: &str) -> Result<(), StoreError> {
        if RESERVED_META.contains(&key) {
            return Err(StoreError::InvalidInput(format!(
                "meta key {key:?} is managed by the store"
            )));
        }
        let (key, value) = (key.to_owned(), value.to_owned());
        self.submit(JobKind::Other, move |c, _| meta_put(c, &key, &value))
    }

    fn enrol(&self, req: EnrolRequest) -> Result<EnrolOutcome, StoreError> {
        if !is_canonical_key(&req.host_pubkey) {
            return Err(StoreError::InvalidInput(
                "a host key must be enrolled in canonical form (padded standard base64 of 32 bytes)"
                    .to_owned(),
            ));
        }
        self.submit(JobKind::Other, move |c, limits| {
            enrol_apply(c, limits, &req)
        })
    }

    fn enrolment(&self, host_pubkey: &str) -> Result<Option<Enrolment>, StoreError> {
        self.read(|c| enrolment_row(c, host_pubkey))
    }

    fn live_enrolments_by_name(&self, host_name: &str) -> Result<Vec<Enrolment>, StoreError> {
        self.read(|c| {
            let mut st = c.prepare_cached(&format!(
                "SELECT {ENROLMENT_COLS} FROM enrolments
                 WHERE lower(host_name) = lower(?1) AND revoked_at IS NULL
                 ORDER BY enrolled_at DESC, rowid DESC
                 LIMIT ?2"
            ))?;
            let limit = i64::try_from(super::MAX_LIVE_BY_NAME).unwrap_or(i64::MAX);
            let rows = st
                .query_map(params![host_name, limit], enrolment_from_row)?
                .collect::<Result<Vec<_>, _>>()?;
            Ok(rows)
        })
    }

    fn live_enrolment_count(&self) -> Result<u64, StoreError> {
        self.read(live_enrolment_count)
    }

    fn revoke(&self, host_pubkey: &str, now_ms: i64) -> Result<RevokeOutcome, StoreError> {
        let key = host_pubkey.to_owned();
        self.submit(JobKind::Other, move |c, _| revoke_apply(c, &key, now_ms))
    }

    fn put_enc_ad_v1(&self, ad: EncAdV1) -> Result<(), StoreError> {
        self.submit(JobKind::Other, move |c, _| {
            c.execute(
                "INSERT INTO enc_ads (host_pubkey, host_name, enc_pub, sig, at)
                 VALUES (?1, ?2, ?3, ?4, ?5)
                 ON CONFLICT(host_pubkey) DO UPDATE SET host_name = excluded.host_name,
                   enc_pub = excluded.enc_pub, sig = excluded.sig, at = excluded.at",
                params![ad.host_pubkey, ad.host_name, ad.enc_pub, ad.sig, ad.at_ms],
            )?;
            Ok(())
        })
    }

    fn put_enc_ad_v2(&self, ad: EncAdV2) -> Result<(), StoreError> {
        self.submit(JobKind::Other, move |c, _| {
            c.execute(
                "INSERT INTO enc_ad_records (host_pubkey, enc_pub, record, sig, at)
                 VALUES (?1, ?2, ?3, ?4, ?5)
                 ON CONFLICT(host_pubkey) DO UPDATE SET enc_pub = excluded.enc_pub,
                   record = excluded.record, sig = excluded.sig, at = excluded.at",
                params![ad.host_pubkey, ad.enc_pub, ad.record, ad.sig, ad.at_ms],
            )?;
            Ok(())
        })
    }

    fn get_enc_ad(&self, host_pubkey: &str) -> Result<Option<EncAd>, StoreError> {
        self.read(|c| get_enc_ad(c, host_pubkey))
    }

    fn push(&self, batch: PushBatch) -> Result<PushOutcome, StoreError> {
        self.submit(JobKind::Push, move |c, limits| {
            push_apply(c, limits, &batch)
        })
    }

    fn push_then(&self, batch: PushBatch, done: super::PushReply) {
        self.submit_then(
            JobKind::Push,
            move |c, limits| push_apply(c, limits, &batch),
            done,
        )
    }

    fn dedup_targets(&self, sender_pubkey: &str, item_id: &str) -> Result<Vec<String>, StoreError> {
        self.read(|c| {
            let mut st = c.prepare_cached(
                "SELECT target_pubkey FROM dedup WHERE sender_pubkey = ?1 AND item_id = ?2",
            )?;
            let rows = st
                .query_map([sender_pubkey, item_id], |r| r.get(0))?
                .collect::<Result<Vec<String>, _>>()?;
            Ok(rows)
        })
    }

    fn pull(&self, req: PullRequest) -> Result<PullPage, StoreError> {
        self.read(|c| pull_page(c, &req))
    }

    fn ack(&self, req: AckRequest) -> Result<AckResult, StoreError> {
        self.submit(JobKind::Ack, move |c, _| ack_apply(c, &req))
    }

    fn info_for(&self, host_pubkey: &str) -> Result<HostQueueInfo, StoreError> {
        self.read(|c| {
            let tx = c.unchecked_transaction()?;
            let info = HostQueueInfo {
                head_seq: head_seq(&tx, host_pubkey)?,
                acked_through: acked_through(&tx, host_pubkey)?,
            };
            tx.commit()?;
            Ok(info)
        })
    }

    fn put_sender_list(&self, list: SenderList) -> Result<SenderListOutcome, StoreError> {
        self.submit(JobKind::Other, move |c, _| put_sender_list(c, list))
    }

    fn rotate(&self, req: super::RotateRequest) -> Result<super::RotateOutcome, StoreError> {
        if !is_canonical_key(&req.old_pubkey) || !is_canonical_key(&req.new_pubkey) {
            return Err(StoreError::InvalidInput(
                "rotation keys must be in canonical form (padded standard base64 of 32 bytes)"
                    .to_owned(),
            ));
        }
        self.submit(JobKind::Other, move |c, _| rotate::rotate_apply(c, &req))
    }

    fn sender_list(&self, target_pubkey: &str) -> Result<Option<SenderList>, StoreError> {
        self.read(|c| {
            let row = c
                .prepare_cached(
                    "SELECT senders, iat, record, sig FROM sender_lists WHERE target_pubkey = ?1",
                )?
                .query_row([target_pubkey], |r| {
                    Ok((
                        r.get::<_, String>(0)?,
                        r.get::<_, i64>(1)?,
                        r.get::<_, String>(2)?,
                        r.get::<_, String>(3)?,
                    ))
                })
                .optional()?;
            let Some((senders, iat_ms, record, sig)) = row else {
                return Ok(None);
            };
            let senders: Vec<String> = serde_json::from_str(&senders).map_err(|e| {
                StoreError::Corrupt(format!("stored sender list is not a JSON array: {e}"))
            })?;
            Ok(Some(SenderList {
                target_pubkey: target_pubkey.to_owned(),
                senders,
                iat_ms,
                record,
                sig,
            }))
        })
    }

    fn append_op(
        &self,
        at_ms: i64,
        op: &str,
        receipt: &serde_json::Value,
    ) -> Result<i64, StoreError> {
        let receipt = op_receipt_text(receipt)?;
        let op = op.to_owned();
        self.submit(JobKind::Other, move |c, _| {
            append_op_apply(c, at_ms, &op, &receipt)
        })
    }

    fn enrol_bound(
        &self,
        req: EnrolRequest,
        binding: Option<super::AccountBinding>,
    ) -> Result<EnrolOutcome, StoreError> {
        deny::enrol_bound(self, req, binding)
    }

    fn account_binding(
        &self,
        host_pubkey: &str,
    ) -> Result<Option<super::AccountBinding>, StoreError> {
        deny::account_binding(self, host_pubkey)
    }

    fn deny(&self, entry: super::DenyEntry) -> Result<super::DenyOutcome, StoreError> {
        deny::deny(self, entry)
    }

    fn undeny(&self, kind: super::DenyKind, value: &str) -> Result<bool, StoreError> {
        deny::undeny(self, kind, value)
    }

    fn deny_entries(&self) -> Result<Vec<super::DenyEntry>, StoreError> {
        deny::deny_entries(self)
    }

    fn revoke_logged(
        &self,
        host_pubkey: &str,
        now_ms: i64,
        log: super::OpEntry,
    ) -> Result<RevokeOutcome, StoreError> {
        deny::revoke_logged(self, host_pubkey, now_ms, log)
    }

    fn deny_logged(
        &self,
        entry: super::DenyEntry,
        log: super::OpEntry,
    ) -> Result<super::DenyOutcome, StoreError> {
        deny::deny_logged(self, entry, log)
    }

    fn undeny_logged(
        &self,
        kind: super::DenyKind,
        value: &str,
        log: super::OpEntry,
    ) -> Result<bool, StoreError> {
        deny::undeny_logged(self, kind, value, log)
    }

    fn denied(
        &self,
        host_fp: &str,
        client_id: Option<&str>,
        now_ms: i64,
    ) -> Result<Option<super::DenyEntry>, StoreError> {
        deny::denied(self, host_fp, client_id, now_ms)
    }

    fn enrolments_by_fingerprint(&self, fp: &str) -> Result<Vec<Enrolment>, StoreError> {
        deny::enrolments_by_fingerprint(self, fp)
    }

    fn failed(&self) -> Option<String> {
        self.failure.get().cloned()
    }

    fn writer_stats(&self) -> Option<StoreStats> {
        Some(self.stats())
    }

    fn sweep(
        &self,
        now_ms: i64,
        signer: Arc<dyn super::NoticeSigner>,
    ) -> Result<super::SweepReport, StoreError> {
        sweep::sweep(self, now_ms, signer)
    }

    fn ops(&self, limit: i64) -> Result<Vec<OpRecord>, StoreError> {
        let n = limit.clamp(1, OPS_KEEP + super::SWEEP_OPS_KEEP);
        self.read(|c| {
            let mut st =
                c.prepare_cached("SELECT id, at, op, receipt FROM ops ORDER BY id DESC LIMIT ?1")?;
            let rows = st
                .query_map([n], |r| {
                    Ok((
                        r.get::<_, i64>(0)?,
                        r.get::<_, i64>(1)?,
                        r.get::<_, String>(2)?,
                        r.get::<_, String>(3)?,
                    ))
                })?
                .collect::<Result<Vec<_>, _>>()?;
            rows.into_iter()
                .map(|(id, at_ms, op, receipt)| {
                    let receipt = serde_json::from_str(&receipt).map_err(|e| {
                        StoreError::Corrupt(format!("op receipt {id} is not JSON: {e}"))
                    })?;
                    Ok(OpRecord {
                        id,
                        at_ms,
                        op,
                        receipt,
                    })
                })
                .collect()
        })
    }
}

// ---------------------------------------------------------------------------------------------
// Opening

/// `relay.lock` of a store directory, held (`wire.md` §3.4 "One writer"): while a `StoreLock`
/// lives no other process (and no other store in this one) can open the store, run a restore
/// or another offline operator command on it. Dropping it releases the lock; so does the OS
/// when the process dies. [`SqliteStore::open_signed`] keeps holding it for the store's life,
/// so `relay serve` can restore a backup under the same lock before it opens the store.
pub struct StoreLock {
    conn: Connection,
    dir: PathBuf,
    /// The holder row `relay.lock` held when this lock was taken (the last process that took
    /// it, running or not): named in the unclean-stop line of [`SqliteStore::open_signed`].
    previous: Option<super::LockHolder>,
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
fn acquire_lock_checked(dir: &Path, wait_ms: u64, now_ms: i64) -> Result<Taken, StoreError> {
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
type Taken = (Connection, Option<super::LockHolder>);

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
            super::duration_text(wait_ms)
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
            Some(super::LockHolder {
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
fn read_lock_holder(path: &Path) -> Option<super::LockHolder> {
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
    Some(super::LockHolder {
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
fn create_private_dir(dir: &Path) -> Result<(), StoreError> {
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
fn create_private_file(path: &Path) -> Result<(), StoreError> {
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
fn restrict_store_files(dir: &Path) {
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

fn is_busy(e: &rusqlite::Error) -> bool {
    matches!(
        e.sqlite_error_code(),
        Some(rusqlite::ErrorCode::DatabaseBusy | rusqlite::ErrorCode::DatabaseLocked)
    )
}

/// Runs one parameterless statement (transaction control) through the statement cache, so the
/// writer does not parse `SAVEPOINT request` and friends again for every request.
fn run_cached(c: &Connection, sql: &str) -> Result<(), rusqlite::Error> {
    c.prepare_cached(sql)?.execute([]).map(|_| ())
}

fn open_write_connection(path: &Path) -> Result<Connection, StoreError> {
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

/// The size (bytes) of `relay.db-wal` in `dir`; 0 when it is missing or empty.
///
/// A clean stop leaves none: the writer's last act is `wal_checkpoint(TRUNCATE)` (module
/// docs), and SQLite deletes the file when its last connection closes (a read-only connection
/// that closes last leaves it empty). Read under `relay.lock`, before this process opens the
/// database, bytes in it mean the previous writer stopped without that: killed, crashed, the
/// machine lost power, or (logged at its stop) its final checkpoint could not finish.
fn wal_bytes(dir: &Path) -> u64 {
    std::fs::metadata(dir.join(format!("{DB_FILE}-wal"))).map_or(0, |m| m.len())
}

/// The start after an unclean stop ([`wal_bytes`] > 0): SQLite's recovery already ran when
/// `conn` opened the database (it keeps the committed transactions of the WAL, drops a torn
/// tail); this copies them into `relay.db` (`wal_checkpoint(FULL)`, then `TRUNCATE` to empty
/// the file) and logs one WARN line
/// saying so: what was left (bytes of WAL, the last holder of `relay.lock` when known) and what
/// recovery did (committed WAL frames replayed into `relay.db`). Never fails: a checkpoint that
/// cannot finish now is said in the line and done by the next one.
fn recover_unclean_stop(
    conn: &Connection,
    dir: &Path,
    left_wal: u64,
    previous: Option<&super::LockHolder>,
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

/// Revokes `key` in the caller's transaction ([`RelayStore::revoke`]).
fn revoke_apply(c: &Connection, key: &str, now_ms: i64) -> Result<RevokeOutcome, StoreError> {
    Ok(match enrolment_row(c, key)? {
        None => RevokeOutcome::Unknown,
        Some(e) if e.is_revoked() => RevokeOutcome::AlreadyRevoked,
        Some(_) => {
            c.execute(
                "UPDATE enrolments SET revoked_at = ?2 WHERE host_pubkey = ?1",
                params![key, now_ms],
            )?;
            RevokeOutcome::Revoked
        }
    })
}

/// A log receipt as stored text. Errors: [`StoreError::InvalidInput`].
fn op_receipt_text(receipt: &serde_json::Value) -> Result<String, StoreError> {
    serde_json::to_string(receipt)
        .map_err(|e| StoreError::InvalidInput(format!("op receipt is not JSON: {e}")))
}

/// Appends a log entry in the caller's transaction ([`append_op_signed`] prunes); its id.
/// On the writer thread of a store opened with a signer ([`SqliteStore::open_signed`]) the
/// receipt is signed first ([`append_op_signed`]): every append goes through here.
fn append_op_apply(c: &Connection, at_ms: i64, op: &str, receipt: &str) -> Result<i64, StoreError> {
    let signer = WRITER_OP_SIGNER.with(|s| s.borrow().clone());
    append_op_signed(c, signer.as_deref(), at_ms, op, receipt).map(|(id, _)| id)
}

/// Appends a log entry in the caller's transaction, keeping the last [`OPS_KEEP`] (and the last
/// [`super::SWEEP_OPS_KEEP`] `relay-sweep` receipts, counted apart): `receipt`
/// (JSON object text) signed by `signer` when given ([`super::sign_op_receipt`]), stored as is
/// otherwise (a store opened without the relay key: tests). Returns its id and the stored text.
/// Errors: [`StoreError::InvalidInput`] (not a JSON object, cannot be signed), SQLite errors.
pub(crate) fn append_op_signed(
    c: &Connection,
    signer: Option<&dyn OpSigner>,
    at_ms: i64,
    op: &str,
    receipt: &str,
) -> Result<(i64, String), StoreError> {
    let text = match signer {
        Some(signer) => {
            let value: serde_json::Value = serde_json::from_str(receipt)
                .map_err(|e| StoreError::InvalidInput(format!("op receipt is not JSON: {e}")))?;
            op_receipt_text(&super::sign_op_receipt(signer, &value)?)?
        }
        None => receipt.to_owned(),
    };
    c.execute(
        "INSERT INTO ops (at, op, receipt) VALUES (?1, ?2, ?3)",
        params![at_ms, op, text],
    )?;
    let id = c.last_insert_rowid();
    // Sweep receipts have their own cap, so they never evict the operator's history
    // (`super::SWEEP_OPS_KEEP`): each kind keeps its newest, pruned as it grows.
    let (same_kind, keep) = if op == super::OP_SWEEP {
        ("op = ?1", super::SWEEP_OPS_KEEP)
    } else {
        ("op <> ?1", OPS_KEEP)
    };
    c.prepare_cached(&format!(
        "DELETE FROM ops WHERE {same_kind} AND id <= (SELECT id FROM ops WHERE {same_kind}
                                                      ORDER BY id DESC LIMIT 1 OFFSET ?2)"
    ))?
    .execute(params![super::OP_SWEEP, keep])?;
    Ok((id, text))
}

fn new_epoch() -> String {
    uuid::Uuid::new_v4().to_string()
}

// ---------------------------------------------------------------------------------------------
// Meta and positions

fn meta_get(c: &Connection, key: &str) -> Result<Option<String>, StoreError> {
    Ok(c.prepare_cached("SELECT v FROM meta WHERE k = ?1")?
        .query_row([key], |r| r.get(0))
        .optional()?)
}

fn meta_put(c: &Connection, key: &str, value: &str) -> Result<(), StoreError> {
    c.prepare_cached(
        "INSERT INTO meta (k, v) VALUES (?1, ?2) ON CONFLICT(k) DO UPDATE SET v = excluded.v",
    )?
    .execute([key, value])?;
    Ok(())
}

fn read_epoch(c: &Connection) -> Result<String, StoreError> {
    meta_get(c, "epoch")?.ok_or_else(|| StoreError::Corrupt("meta.epoch is missing".to_owned()))
}

/// The last seq allocated for a target (`next_seq − 1`), 0 if none.
fn head_seq(c: &Connection, target: &str) -> Result<i64, StoreError> {
    let next: Option<i64> = c
        .prepare_cached("SELECT next_seq FROM seqs WHERE target_pubkey = ?1")?
        .query_row([target], |r| r.get(0))
        .optional()?;
    Ok(next.map_or(0, |n| n.saturating_sub(1).max(0)))
}

fn acked_through(c: &Connection, target: &str) -> Result<i64, StoreError> {
    let v: Option<i64> = c
        .prepare_cached("SELECT acked_through FROM acked WHERE target_pubkey = ?1")?
        .query_row([target], |r| r.get(0))
        .optional()?;
    Ok(v.unwrap_or(0))
}

// ---------------------------------------------------------------------------------------------
// Enrolments

const ENROLMENT_COLS: &str =
    "host_pubkey, host_name, owner_fp, account, authorized_by, authority_rank, enrolled_at, revoked_at";

fn enrolment_from_row(r: &rusqlite::Row<'_>) -> rusqlite::Result<Enrolment> {
    let rank: i64 = r.get(5)?;
    let strength = AuthorityStrength::from_rank(rank)
        .ok_or(rusqlite::Error::IntegralValueOutOfRange(5, rank))?;
    Ok(Enrolment {
        host_pubkey: r.get(0)?,
        host_name: r.get(1)?,
        owner_fp: r.get(2)?,
        account: r.get(3)?,
        authorized_by: r.get(4)?,
        strength,
        enrolled_at_ms: r.get(6)?,
        revoked_at_ms: r.get(7)?,
    })
}

fn enrolment_row(c: &Connection, host_pubkey: &str) -> Result<Option<Enrolment>, StoreError> {
    Ok(c.prepare_cached(&format!(
        "SELECT {ENROLMENT_COLS} FROM enrolments WHERE host_pubkey = ?1"
    ))?
    .query_row([host_pubkey], enrolment_from_row)
    .optional()?)
}

fn live_enrolment_count(c: &Connection) -> Result<u64, StoreError> {
    let n: i64 = c
        .prepare_cached("SELECT COUNT(*) FROM enrolments WHERE revoked_at IS NULL")?
        .query_row([], |r| r.get(0))?;
    Ok(u64::try_from(n).unwrap_or(0))
}

/// Spec §2 enrolments, `wire.md` §3.2 "Enrolment".
fn enrol_apply(
    c: &Connection,
    limits: &StoreLimits,
    req: &EnrolRequest,
) -> Result<EnrolOutcome, StoreError> {
    let current = enrolment_row(c, &req.host_pubkey)?;
    if current.as_ref().is_some_and(Enrolment::is_revoked) {
        return Ok(EnrolOutcome::Revoked);
    }
    // A weaker authority keeps what a stronger one recorded.
    let (account, authorized_by, strength) = match &current {
        Some(cur) if req.strength < cur.strength => {
            (cur.account.clone(), cur.authorized_by.clone(), cur.strength)
        }
        _ => (req.account.clone(), req.authorized_by.clone(), req.strength),
    };
    if current.is_none() && live_enrolment_count(c)? >= limits.max_live_enrolments {
        return Ok(EnrolOutcome::Full);
    }
    if let Some(account) = &account {
        let taken: bool = c
            .prepare_cached(
                "SELECT EXISTS (SELECT 1 FROM enrolments
                   WHERE account = ?1 AND lower(host_name) = lower(?2)
                     AND revoked_at IS NULL AND host_pubkey <> ?3)",
            )?
            .query_row(params![account, req.host_name, req.host_pubkey], |r| {
                r.get(0)
            })?;
        if taken {
            return Ok(EnrolOutcome::NameTaken);
        }
    }
    c.prepare_cached(
        "INSERT INTO enrolments
           (host_pubkey, host_name, owner_fp, account, authorized_by, authority_rank, enrolled_at, revoked_at)
         VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, NULL)
         ON CONFLICT(host_pubkey) DO UPDATE SET
           host_name = excluded.host_name, owner_fp = excluded.owner_fp,
           account = excluded.account, authorized_by = excluded.authorized_by,
           authority_rank = excluded.authority_rank, enrolled_at = excluded.enrolled_at",
    )?
    .execute(params![
        req.host_pubkey,
        req.host_name,
        req.owner_fp,
        account,
        authorized_by,
        strength.rank(),
        req.now_ms,
    ])?;
    enrolment_row(c, &req.host_pubkey)?
        .map(EnrolOutcome::Enrolled)
        .ok_or_else(|| StoreError::Corrupt("an enrolment vanished while written".to_owned()))
}

// ---------------------------------------------------------------------------------------------
// Enc-key advertisements

fn get_enc_ad(c: &Connection, host_pubkey: &str) -> Result<Option<EncAd>, StoreError> {
    type Row = (
        String,
        Option<String>,
        Option<String>,
        Option<String>,
        Option<i64>,
        Option<String>,
        Option<String>,
        Option<String>,
        Option<i64>,
    );
    let row: Option<Row> = c
        .prepare_cached(
            "SELECT e.host_name,
                    a.host_name, a.enc_pub, a.sig, a.at,
                    r.enc_pub, r.record, r.sig, r.at
             FROM enrolments e
             LEFT JOIN enc_ads a ON a.host_pubkey = e.host_pubkey
             LEFT JOIN enc_ad_records r ON r.host_pubkey = e.host_pubkey
             WHERE e.host_pubkey = ?1 AND e.revoked_at IS NULL",
        )?
        .query_row([host_pubkey], |r| {
            Ok((
                r.get(0)?,
                r.get(1)?,
                r.get(2)?,
                r.get(3)?,
                r.get(4)?,
                r.get(5)?,
                r.get(6)?,
                r.get(7)?,
                r.get(8)?,
            ))
        })
        .optional()?;
    let Some((host_name, v1_name, v1_pub, v1_sig, v1_at, v2_pub, v2_record, v2_sig, v2_at)) = row
    else {
        return Ok(None);
    };
    let v2 = match (v2_pub, v2_record, v2_sig, v2_at) {
        (Some(enc_pub), Some(record), Some(sig), Some(at_ms)) => Some(EncAdV2 {
            host_pubkey: host_pubkey.to_owned(),
            enc_pub,
            record,
            sig,
            at_ms,
        }),
        _ => None,
    };
    let v1 = match (v1_name, v1_pub, v1_sig, v1_at) {
        (Some(host_name), Some(enc_pub), Some(sig), Some(at_ms)) => Some(EncAdV1 {
            host_pubkey: host_pubkey.to_owned(),
            host_name,
            enc_pub,
            sig,
            at_ms,
        }),
        _ => None,
    };
    // A served enc_pub always equals the v2 record's: a v1 ad naming another key is not served.
    let v1 = v1.filter(|a| v2.as_ref().is_none_or(|r| r.enc_pub == a.enc_pub));
    let enc_pub = match (&v2, &v1) {
        (Some(r), _) => r.enc_pub.clone(),
        (None, Some(a)) => a.enc_pub.clone(),
        (None, None) => return Ok(None),
    };
    Ok(Some(EncAd {
        host_pubkey: host_pubkey.to_owned(),
        host_name,
        enc_pub,
        v1,
        v2,
    }))
}

// ---------------------------------------------------------------------------------------------
// Push (spec §3, `wire.md` §3.2 "Push (v2)", "Dedup", "Seq", "Quotas")

/// A validated fresh target: live enrolment facts needed for quotas and messages.
struct LiveTarget<'a> {
    pubkey: &'a str,
    wire: &'a [u8],
    host_name: &'a str,
    account: Option<&'a str>,
}

/// A dedup row: what an earlier push of the same (sender, item, target) stored.
struct DedupHit {
    wire_hash: String,
    seq: i64,
    accepted_at: i64,
}

fn dedup_hit(
    c: &Connection,
    sender: &str,
    item_id: &str,
    target: &str,
) -> Result<Option<DedupHit>, StoreError> {
    Ok(c.prepare_cached(
        "SELECT wire_hash, seq, accepted_at FROM dedup
         WHERE sender_pubkey = ?1 AND item_id = ?2 AND target_pubkey = ?3",
    )?
    .query_row(params![sender, item_id, target], |r| {
        Ok(DedupHit {
            wire_hash: r.get(0)?,
            seq: r.get(1)?,
            accepted_at: r.get(2)?,
        })
    })
    .optional()?)
}

/// The live enrolment's `(host_name, account)`, `None` when unknown or revoked.
fn live_target(
    c: &Connection,
    target: &str,
) -> Result<Option<(String, Option<String>)>, StoreError> {
    Ok(c.prepare_cached(
        "SELECT host_name, account FROM enrolments
         WHERE host_pubkey = ?1 AND revoked_at IS NULL",
    )?
    .query_row([target], |r| Ok((r.get(0)?, r.get(1)?)))
    .optional()?)
}

fn push_apply(
    c: &Connection,
    limits: &StoreLimits,
    batch: &PushBatch,
) -> Result<PushOutcome, StoreError> {
    let epoch = read_epoch(c)?;
    let expires_at = match batch.expiry {
        Expiry::Retention => Some(
            batch
                .now_ms
                .saturating_add(i64::from(limits.retention_days).saturating_mul(DAY_MS)),
        ),
        Expiry::Never => None,
    };
    // An error part way through an item fails the whole request: the writer rolls back the
    // whole group (a push has no savepoint of its own), so nothing of the request is stored.
    let items = batch
        .items
        .iter()
        .map(|item| push_item(c, limits, batch, expires_at, item))
        .collect::<Result<Vec<_>, _>>()?;
    Ok(PushOutcome { epoch, items })
}

fn rejected(item: &PushItem, why: Rejection) -> ItemOutcome {
    ItemOutcome {
        item_id: item.item_id.clone(),
        status: ItemStatus::Rejected(why),
        at_ms: None,
        targets: Vec::new(),
    }
}

/// One item: every check first, then the writes. A rejection is returned as an outcome before
/// anything of the item was written, so a rejected item leaves nothing.
///
/// A target that already has a dedup row for (sender, item id, target) is settled by dedup
/// alone: the same bytes answer `duplicate` with the original seq even if the target was
/// revoked or its allowlist changed since (the item was accepted and is durably there, so a
/// retry must settle), other bytes answer `conflict`. Only fresh targets are checked for
/// enrolment, allowlist and quota, and a fresh target that fails rejects the whole item.
fn push_item(
    c: &Connection,
    limits: &StoreLimits,
    batch: &PushBatch,
    expires_at: Option<i64>,
    item: &PushItem,
) -> Result<ItemOutcome, StoreError> {
    if item.targets.is_empty() {
        return Ok(rejected(item, Rejection::BadTargets));
    }
    let sender = batch.sender_pubkey.as_str();
    let hits = item
        .targets
        .iter()
        .map(|t| dedup_hit(c, sender, &item.item_id, &t.target_pubkey))
        .collect::<Result<Vec<_>, _>>()?;

    // 1. Validate every fresh target, in `wire.md` §3.2 order, each check over every target
    //    before the next one.
    let mut facts = Vec::with_capacity(item.targets.len());
    for (t, hit) in item.targets.iter().zip(&hits) {
        facts.push(match hit {
            Some(_) => None,
            None => match live_target(c, &t.target_pubkey)? {
                Some(found) => Some(found),
                None => return Ok(rejected(item, Rejection::TargetNotEnrolled)),
            },
        });
    }
    for (t, hit) in item.targets.iter().zip(&hits) {
        if hit.is_none() && !sender_allowed(c, &t.target_pubkey, sender)? {
            return Ok(rejected(item, Rejection::SenderNotAccepted));
        }
    }
    for (i, t) in item.targets.iter().enumerate() {
        if item.targets[..i]
            .iter()
            .any(|u| u.target_pubkey == t.target_pubkey)
        {
            return Ok(rejected(item, Rejection::DuplicateTarget));
        }
    }
    let hashes: Vec<String> = item.targets.iter().map(|t| wire_hash(&t.wire)).collect();
    if hits
        .iter()
        .zip(&hashes)
        .any(|(hit, hash)| hit.as_ref().is_some_and(|h| &h.wire_hash != hash))
    {
        return Ok(rejected(item, Rejection::Conflict));
    }
    // Quotas of every fresh target, in target order, before any write. The targets are
    // distinct, so each target's own counters see only this item's one addition; an account
    // quota also counts what this item adds to the account's earlier targets.
    let mut fresh = Vec::with_capacity(item.targets.len());
    let mut account_adds: Vec<(&str, i64, i64)> = Vec::new();
    for (idx, (t, fact)) in item.targets.iter().zip(&facts).enumerate() {
        let Some((host_name, account)) = fact else {
            continue;
        };
        let live = LiveTarget {
            pubkey: &t.target_pubkey,
            wire: &t.wire,
            host_name,
            account: account.as_deref(),
        };
        let bytes = i64::try_from(live.wire.len())
            .map_err(|_| StoreError::InvalidInput("wire larger than i64::MAX bytes".to_owned()))?;
        let before = live.account.map_or((0, 0), |a| {
            account_adds
                .iter()
                .filter(|(acc, _, _)| *acc == a)
                .fold((0, 0), |(n, b), (_, dn, db)| (n + dn, b + db))
        });
        if let Some(kind) = quota_exceeded(c, limits, &live, sender, bytes, before)? {
            return Ok(rejected(
                item,
                Rejection::Quota {
                    kind,
                    host: live.host_name.to_owned(),
                },
            ));
        }
        if let Some(a) = live.account {
            account_adds.push((a, 1, bytes));
        }
        fresh.push((idx, live, bytes));
    }

    // 2. Writes: per fresh target a seq, the item row and its dedup row.
    let mut written = Vec::with_capacity(fresh.len());
    for (idx, live, bytes) in &fresh {
        let hash = &hashes[*idx];
        let seq = allocate_seq(c, live.pubkey, batch.now_ms)?;
        c.prepare_cached(
            "INSERT INTO items (target_pubkey, seq, kind, item_id, sender_pubkey, sender_host,
                                wire, wire_hash, bytes, accepted_at, expires_at)
             VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11)",
        )?
        .execute(params![
            live.pubkey,
            seq,
            item.kind,
            item.item_id,
            sender,
            batch.sender_host,
            live.wire,
            hash,
            bytes,
            batch.now_ms,
            expires_at,
        ])?;
        c.prepare_cached(
            "INSERT INTO dedup (sender_pubkey, item_id, target_pubkey, wire_hash, seq, accepted_at)
             VALUES (?1, ?2, ?3, ?4, ?5, ?6)",
        )?
        .execute(params![
            sender,
            item.item_id,
            live.pubkey,
            hash,
            seq,
            batch.now_ms
        ])?;
        written.push((*idx, seq));
    }

    // 3. The outcome, in the sender's target order.
    let any_fresh = !written.is_empty();
    let mut earliest: Option<i64> = None;
    let mut targets = Vec::with_capacity(item.targets.len());
    for (i, ((t, hit), hash)) in item.targets.iter().zip(hits).zip(hashes).enumerate() {
        let seq = match hit {
            Some(hit) => {
                earliest = Some(earliest.map_or(hit.accepted_at, |e| e.min(hit.accepted_at)));
                hit.seq
            }
            None => written
                .iter()
                .find(|(idx, _)| *idx == i)
                .map(|(_, seq)| *seq)
                .ok_or_else(|| {
                    StoreError::Corrupt("a fresh push target was not written".to_owned())
                })?,
        };
        targets.push(TargetAccept {
            target_pubkey: t.target_pubkey.clone(),
            seq,
            wire_hash: hash,
        });
    }
    let (status, at_ms) = if any_fresh {
        (ItemStatus::Accepted, batch.now_ms)
    } else {
        (ItemStatus::Duplicate, earliest.unwrap_or(batch.now_ms))
    };
    Ok(ItemOutcome {
        item_id: item.item_id.clone(),
        status,
        at_ms: Some(at_ms),
        targets,
    })
}

/// No allowlist = everyone; else the sender must be listed (spec §2 "Sender allowlist"). The
/// list is read through a scalar subquery: a `json_each` joined to `sender_lists` made SQLite
/// prepare the statement again on every run.
const SENDER_ALLOWED_SQL: &str =
    "SELECT NOT EXISTS (SELECT 1 FROM sender_lists WHERE target_pubkey = ?1)
         OR EXISTS (SELECT 1 FROM json_each((SELECT senders FROM sender_lists
                                             WHERE target_pubkey = ?1))
                    WHERE value = ?2)";

fn sender_allowed(c: &Connection, target: &str, sender: &str) -> Result<bool, StoreError> {
    Ok(c.prepare_cached(SENDER_ALLOWED_SQL)?
        .query_row([target, sender], |r| r.get(0))?)
}

/// Would adding `bytes` to this target exceed a quota? Checked in the order of `wire.md` §3.2:
/// target depth, target bytes, sender share, proven account. Reads the usage counters the
/// schema's triggers keep (`schema.rs`, version 4): one row per check, whatever the queue depth.
/// `account_pending` is `(items, bytes)` the same item adds to the account's other targets and
/// has not written yet.
fn quota_exceeded(
    c: &Connection,
    limits: &StoreLimits,
    t: &LiveTarget<'_>,
    sender: &str,
    bytes: i64,
    account_pending: (i64, i64),
) -> Result<Option<QuotaKind>, StoreError> {
    let over = |used: i64, add: i64, max: u64| i128::from(used) + i128::from(add) > i128::from(max);
    let usage = |sql: &str, args: &[&dyn rusqlite::ToSql]| -> Result<(i64, i64), StoreError> {
        Ok(c.prepare_cached(sql)?
            .query_row(args, |r| Ok((r.get(0)?, r.get(1)?)))
            .optional()?
            .unwrap_or((0, 0)))
    };

    let (items, used) = usage(
        "SELECT items, bytes FROM target_usage WHERE target_pubkey = ?1",
        &[&t.pubkey],
    )?;
    if over(items, 1, limits.max_queue_items) {
        return Ok(Some(QuotaKind::QueueDepth));
    }
    if over(used, bytes, limits.max_queue_bytes) {
        return Ok(Some(QuotaKind::QueueBytes));
    }
    let (items, used) = usage(
        "SELECT items, bytes FROM sender_usage WHERE sender_pubkey = ?1 AND target_pubkey = ?2",
        &[&sender, &t.pubkey],
    )?;
    if over(items, 1, limits.max_sender_items) || over(used, bytes, limits.max_sender_bytes) {
        return Ok(Some(QuotaKind::SenderShare));
    }
    if let Some(account) = t.account {
        let (items, used) = usage(
            "SELECT COALESCE(SUM(u.items), 0), COALESCE(SUM(u.bytes), 0)
             FROM enrolments e JOIN target_usage u ON u.target_pubkey = e.host_pubkey
             WHERE e.account = ?1 AND e.revoked_at IS NULL",
            &[&account],
        )?;
        let (items, used) = (
            items.saturating_add(account_pending.0),
            used.saturating_add(account_pending.1),
        );
        if over(items, 1, limits.max_owner_items) {
            return Ok(Some(QuotaKind::OwnerQueueDepth));
        }
        if over(used, bytes, limits.max_owner_bytes) {
            return Ok(Some(QuotaKind::OwnerQueueBytes));
        }
    }
    Ok(None)
}

/// `seq = max(next_seq (default 1), now_ms)`, `next_seq = seq + 1` (spec §2 "seqs").
fn allocate_seq(c: &Connection, target: &str, now_ms: i64) -> Result<i64, StoreError> {
    let next: Option<i64> = c
        .prepare_cached("SELECT next_seq FROM seqs WHERE target_pubkey = ?1")?
        .query_row([target], |r| r.get(0))
        .optional()?;
    let seq = next.unwrap_or(1).max(now_ms).max(1);
    let following = seq.checked_add(1).ok_or_else(|| {
        StoreError::Corrupt("the sequence space of a target is exhausted".to_owned())
    })?;
    c.prepare_cached(
        "INSERT INTO seqs (target_pubkey, next_seq) VALUES (?1, ?2)
         ON CONFLICT(target_pubkey) DO UPDATE SET next_seq = excluded.next_seq",
    )?
    .execute(params![target, following])?;
    Ok(seq)
}

// ---------------------------------------------------------------------------------------------
// Pull and ack (spec §4, `wire.md` §3.2 "Pull", "Ack")

fn pull_page(c: &Connection, req: &PullRequest) -> Result<PullPage, StoreError> {
    let n = req.limit.clamp(1, MAX_PULL_ITEMS);
    let after = req.after.max(0);
    let tx = c.unchecked_transaction()?;
    let epoch = read_epoch(&tx)?;
    let head = head_seq(&tx, &req.target_pubkey)?;
    let mut items: Vec<PulledItem> = Vec::new();
    let mut more = false;
    {
        let mut st = tx.prepare_cached(
            "SELECT seq, kind, item_id, sender_pubkey, sender_host, bytes, wire FROM items
             WHERE target_pubkey = ?1 AND seq > ?2 ORDER BY seq LIMIT ?3",
        )?;
        let mut rows = st.query(params![req.target_pubkey, after, n + 1])?;
        let mut total: u64 = 0;
        while let Some(row) = rows.next()? {
            if items.len() as i64 >= n {
                more = true;
                break;
            }
            let bytes = u64::try_from(row.get::<_, i64>(5)?).unwrap_or(0);
            if !items.is_empty() && total.saturating_add(bytes) > req.max_bytes {
                more = true;
                break;
            }
            total = total.saturating_add(bytes);
            items.push(PulledItem {
                seq: row.get(0)?,
                kind: row.get(1)?,
                item_id: row.get(2)?,
                sender_pubkey: row.get(3)?,
                sender_host: row.get(4)?,
                wire: row.get(6)?,
            });
        }
    }
    tx.commit()?;
    let last_seq = items.last().map_or(after, |i| i.seq);
    Ok(PullPage {
        epoch,
        head_seq: head,
        items,
        last_seq,
        more,
    })
}

fn ack_apply(c: &Connection, req: &AckRequest) -> Result<AckResult, StoreError> {
    let epoch = read_epoch(c)?;
    let head = head_seq(c, &req.target_pubkey)?;
    if req.epoch.as_deref().is_some_and(|e| e != epoch) {
        return Ok(AckResult::StaleEpoch {
            epoch,
            head_seq: head,
        });
    }
    if !(0..=head).contains(&req.through) {
        return Ok(AckResult::OutOfRange {
            head_seq: head,
            epoch,
        });
    }
    let deleted = c
        .prepare_cached("DELETE FROM items WHERE target_pubkey = ?1 AND seq <= ?2")?
        .execute(params![req.target_pubkey, req.through])?;
    c.prepare_cached(
        "INSERT INTO acked (target_pubkey, acked_through) VALUES (?1, ?2)
         ON CONFLICT(target_pubkey) DO UPDATE
           SET acked_through = MAX(acked_through, excluded.acked_through)",
    )?
    .execute(params![req.target_pubkey, req.through])?;
    Ok(AckResult::Acked(AckOutcome {
        acked_through: acked_through(c, &req.target_pubkey)?,
        deleted: deleted as u64,
        head_seq: head,
        epoch,
    }))
}

// ---------------------------------------------------------------------------------------------
// Sender lists

fn put_sender_list(c: &Connection, list: SenderList) -> Result<SenderListOutcome, StoreError> {
    let stored_iat: Option<i64> = c
        .prepare_cached("SELECT iat FROM sender_lists WHERE target_pubkey = ?1")?
        .query_row([&list.target_pubkey], |r| r.get(0))
        .optional()?;
    if stored_iat.is_some_and(|s| s >= list.iat_ms) {
        return Ok(SenderListOutcome::Stale);
    }
    let mut seen = HashSet::with_capacity(list.senders.len());
    let senders: Vec<&String> = list
        .senders
        .iter()
        .filter(|s| seen.insert(s.as_str()))
        .collect();
    let senders = serde_json::to_string(&senders)
        .map_err(|e| StoreError::InvalidInput(format!("sender list cannot be encoded: {e}")))?;
    c.prepare_cached(
        "INSERT INTO sender_lists (target_pubkey, senders, iat, record, sig)
         VALUES (?1, ?2, ?3, ?4, ?5)
         ON CONFLICT(target_pubkey) DO UPDATE SET senders = excluded.senders,
           iat = excluded.iat, record = excluded.record, sig = excluded.sig",
    )?
    .execute(params![
        list.target_pubkey,
        senders,
        list.iat_ms,
        list.record,
        list.sig
    ])?;
    Ok(SenderListOutcome::Stored)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::PushTarget;
    use base64::Engine as _;
    use std::sync::atomic::AtomicBool;
    use std::sync::Condvar;
    use std::time::Instant;

    fn key(n: u8) -> String {
        base64::engine::general_purpose::STANDARD.encode([n; 32])
    }

    fn relay_key() -> String {
        key(200)
    }

    fn options() -> OpenOptions {
        OpenOptions {
            lock_wait_ms: 0,
            ..OpenOptions::default()
        }
    }

    fn open(dir: &Path) -> SqliteStore {
        SqliteStore::open_with(dir, &relay_key(), 1_000, options()).expect("open store")
    }

    fn open_limited(dir: &Path, limits: StoreLimits) -> SqliteStore {
        SqliteStore::open_with(
            dir,
            &relay_key(),
            1_000,
            OpenOptions {
                limits,
                ..options()
            },
        )
        .expect("open store")
    }

    fn enrol_as(
        store: &SqliteStore,
        k: &str,
        name: &str,
        account: Option<&str>,
        strength: AuthorityStrength,
    ) -> EnrolOutcome {
        store
            .enrol(EnrolRequest {
                host_pubkey: k.to_owned(),
                host_name: name.to_owned(),
                owner_fp: String::new(),
                account: account.map(str::to_owned),
                authorized_by: match strength {
                    AuthorityStrength::Account => "account-token".to_owned(),
                    _ => "host-key-challenge".to_owned(),
                },
                strength,
                now_ms: 1_000,
            })
            .expect("enrol")
    }

    fn enrol(store: &SqliteStore, k: &str, name: &str) {
        let out = enrol_as(store, k, name, None, AuthorityStrength::HostKeyChallenge);
        assert!(matches!(out, EnrolOutcome::Enrolled(_)), "{out:?}");
    }

    fn item(id: &str, targets: &[(&str, &[u8])]) -> PushItem {
        PushItem {
            kind: "envelope".to_owned(),
            item_id: id.to_owned(),
            targets: targets
                .iter()
                .map(|(t, w)| PushTarget {
                    target_pubkey: (*t).to_owned(),
                    wire: w.to_vec(),
                })
                .collect(),
        }
    }

    fn push(store: &SqliteStore, sender: &str, now_ms: i64, items: Vec<PushItem>) -> PushOutcome {
        store
            .push(PushBatch {
                sender_pubkey: sender.to_owned(),
                sender_host: "alpha".to_owned(),
                now_ms,
                expiry: Expiry::Retention,
                items,
            })
            .expect("push")
    }

    fn push_one(store: &SqliteStore, sender: &str, now_ms: i64, it: PushItem) -> ItemOutcome {
        let mut out = push(store, sender, now_ms, vec![it]);
        assert_eq!(out.items.len(), 1);
        out.items.remove(0)
    }

    fn pull_all(store: &SqliteStore, target: &str) -> PullPage {
        store
            .pull(PullRequest {
                target_pubkey: target.to_owned(),
                after: 0,
                limit: MAX_PULL_ITEMS,
                max_bytes: u64::MAX,
            })
            .expect("pull")
    }

    /// The usage counters of the store in `dir` equal a fresh count of its items (read through
    /// a read-only connection while the store runs); returns the items counted.
    fn usage_matches(dir: &Path) -> i64 {
        let c = Connection::open_with_flags(dir.join(DB_FILE), OpenFlags::SQLITE_OPEN_READ_ONLY)
            .expect("read-only");
        crate::store::assert_usage_matches(&c)
    }

    fn wait_until(what: &str, cond: impl Fn() -> bool) {
        let deadline = Instant::now() + Duration::from_secs(30);
        while !cond() {
            assert!(Instant::now() < deadline, "timed out waiting for {what}");
            std::thread::yield_now();
        }
    }

    // --- dedup ---------------------------------------------------------------------------

    #[test]
    fn dedup_absent_duplicate_and_conflict() {
        let dir = tempfile::tempdir().expect("tempdir");
        let store = open(dir.path());
        let (alpha, beta) = (key(1), key(2));
        enrol(&store, &alpha, "alpha");
        enrol(&store, &beta, "beta");

        let first = push_one(&store, &alpha, 5_000, item("m1", &[(&beta, b"sealed-1")]));
        assert_eq!(first.status, ItemStatus::Accepted);
        assert_eq!(first.at_ms, Some(5_000));
        assert_eq!(first.targets.len(), 1);
        assert_eq!(first.targets[0].seq, 5_000);
        assert_eq!(first.targets[0].wire_hash, wire_hash(b"sealed-1"));

        // A retry later: the same seq and the ORIGINAL acceptance time.
        let again = push_one(&store, &alpha, 9_000, item("m1", &[(&beta, b"sealed-1")]));
        assert_eq!(again.status, ItemStatus::Duplicate);
        assert_eq!(again.at_ms, Some(5_000));
        assert_eq!(again.targets, first.targets);

        // Same id, other bytes: conflict, nothing changes.
        let head_before = store.info_for(&beta).expect("info").head_seq;
        let conflict = push_one(&store, &alpha, 9_500, item("m1", &[(&beta, b"sealed-X")]));
        assert_eq!(conflict.status, ItemStatus::Rejected(Rejection::Conflict));
        assert_eq!(conflict.status.wire(), "rejected:conflict");
        assert!(conflict.targets.is_empty());
        let page = pull_all(&store, &beta);
        assert_eq!(page.items.len(), 1, "one stored item, never two");
        assert_eq!(page.items[0].wire, b"sealed-1");
        assert_eq!(page.head_seq, head_before);

        // The dedup key includes the sender: another sender may use the same id.
        let gamma = key(3);
        enrol(&store, &gamma, "gamma");
        let other = push_one(&store, &gamma, 9_600, item("m1", &[(&beta, b"sealed-X")]));
        assert_eq!(other.status, ItemStatus::Accepted);

        // A duplicate stays a duplicate after its item was acked (the dedup row is a tombstone).
        let acked = store
            .ack(AckRequest {
                target_pubkey: beta.clone(),
                through: page.items[0].seq,
                epoch: None,
            })
            .expect("ack");
        assert!(matches!(acked, AckResult::Acked(_)));
        let late = push_one(&store, &alpha, 20_000, item("m1", &[(&beta, b"sealed-1")]));
        assert_eq!(late.status, ItemStatus::Duplicate);
        assert_eq!(late.at_ms, Some(5_000));
    }

    #[test]
    fn mixed_fresh_and_duplicate_targets_are_accepted_at_now() {
        let dir = tempfile::tempdir().expect("tempdir");
        let store = open(dir.path());
        let (alpha, beta, gamma) = (key(1), key(2), key(3));
        enrol(&store, &alpha, "alpha");
        enrol(&store, &beta, "beta");
        enrol(&store, &gamma, "gamma");
        let one = push_one(&store, &alpha, 5_000, item("m", &[(&beta, b"b")]));
        assert_eq!(one.status, ItemStatus::Accepted);
        let both = push_one(
            &store,
            &alpha,
            7_000,
            item("m", &[(&beta, b"b"), (&gamma, b"g")]),
        );
        assert_eq!(both.status, ItemStatus::Accepted);
        assert_eq!(both.at_ms, Some(7_000));
        assert_eq!(
            both.targets[0].seq, one.targets[0].seq,
            "beta keeps its seq"
        );
        assert_eq!(both.targets[1].target_pubkey, gamma);
        assert_eq!(both.targets[1].seq, 7_000);
    }

    #[test]
    fn later_items_in_one_batch_see_earlier_ones() {
        let dir = tempfile::tempdir().expect("tempdir");
        let store = open(dir.path());
        let (alpha, beta) = (key(1), key(2));
        enrol(&store, &alpha, "alpha");
        enrol(&store, &beta, "beta");
        let out = push(
            &store,
            &alpha,
            5_000,
            vec![
                item("a", &[(&beta, b"1")]),
                item("a", &[(&beta, b"1")]),
                item("a", &[(&beta, b"2")]),
                item("b", &[(&beta, b"3")]),
            ],
        );
        let statuses: Vec<String> = out.items.iter().map(|o| o.status.wire()).collect();
        assert_eq!(
            statuses,
            ["accepted", "duplicate", "rejected:conflict", "accepted"]
        );
        assert_eq!(out.items[1].targets[0].seq, out.items[0].targets[0].seq);
        assert_eq!(out.items[3].targets[0].seq, out.items[0].targets[0].seq + 1);
        assert_eq!(out.epoch, store.epoch().expect("epoch"));
        assert_eq!(pull_all(&store, &beta).items.len(), 2);
    }

    // --- fan-out ---------------------------------------------------------------------------

    #[test]
    fn fan_out_is_all_or_nothing() {
        let dir = tempfile::tempdir().expect("tempdir");
        let store = open_limited(
            dir.path(),
            StoreLimits {
                max_queue_items: 1,
                ..StoreLimits::default()
            },
        );
        let (alpha, beta, gamma, stranger) = (key(1), key(2), key(3), key(9));
        enrol(&store, &alpha, "alpha");
        enrol(&store, &beta, "beta");
        enrol(&store, &gamma, "gamma");

        // The second target is not enrolled: the first gets nothing.
        let out = push_one(
            &store,
            &alpha,
            5_000,
            item("m1", &[(&beta, b"for beta"), (&stranger, b"for ?")]),
        );
        assert_eq!(out.status.wire(), "rejected:target not enrolled");
        assert!(pull_all(&store, &beta).items.is_empty());
        assert_eq!(store.info_for(&beta).expect("info").head_seq, 0);

        // The second target's quota fails after the first target was written: rolled back,
        // including the first target's seq allocation and dedup row.
        let fill = push_one(&store, &alpha, 5_000, item("fill", &[(&gamma, b"x")]));
        assert_eq!(fill.status, ItemStatus::Accepted);
        let out = push_one(
            &store,
            &alpha,
            6_000,
            item("m2", &[(&beta, b"for beta"), (&gamma, b"for gamma")]),
        );
        assert_eq!(
            out.status.wire(),
            "rejected:quota:queue depth exceeded for gamma"
        );
        assert!(pull_all(&store, &beta).items.is_empty());
        assert_eq!(
            store.info_for(&beta).expect("info").head_seq,
            0,
            "no seq used"
        );
        // Not a dedup entry either: the same id with other bytes for beta alone is fresh.
        let retry = push_one(&store, &alpha, 7_000, item("m2", &[(&beta, b"other")]));
        assert_eq!(retry.status, ItemStatus::Accepted);
    }

    #[test]
    fn repeated_and_missing_targets_are_refused_defensively() {
        let dir = tempfile::tempdir().expect("tempdir");
        let store = open(dir.path());
        let (alpha, beta) = (key(1), key(2));
        enrol(&store, &alpha, "alpha");
        enrol(&store, &beta, "beta");
        let out = push_one(
            &store,
            &alpha,
            5_000,
            item("m", &[(&beta, b"1"), (&beta, b"1")]),
        );
        assert_eq!(out.status.wire(), "rejected:duplicate target");
        let out = push_one(&store, &alpha, 5_000, item("m", &[]));
        assert_eq!(out.status.wire(), "rejected:bad targets");
        assert!(pull_all(&store, &beta).items.is_empty());
    }

    // --- seqs ------------------------------------------------------------------------------

    #[test]
    fn seq_is_max_of_next_and_now_keeps_rising_and_survives_reopen() {
        let dir = tempfile::tempdir().expect("tempdir");
        let (alpha, beta) = (key(1), key(2));
        let mut seqs = Vec::new();
        {
            let store = open(dir.path());
            enrol(&store, &alpha, "alpha");
            enrol(&store, &beta, "beta");
            for (i, now) in [(0, 1_000), (1, 1_000), (2, 500), (3, 50_000)] {
                let o = push_one(
                    &store,
                    &alpha,
                    now,
                    item(&format!("m{i}"), &[(&beta, b"w")]),
                );
                seqs.push(o.targets[0].seq);
            }
            // now, now+1 (clock did not move), next_seq (clock went back), the clock's floor
            assert_eq!(seqs, [1_000, 1_001, 1_002, 50_000]);
            assert_eq!(store.info_for(&beta).expect("info").head_seq, 50_000);
        }
        let store = open(dir.path());
        assert_eq!(store.info_for(&beta).expect("info").head_seq, 50_000);
        // A clock far behind (restored machine): still above everything handed out.
        let o = push_one(&store, &alpha, 10, item("m4", &[(&beta, b"w")]));
        assert_eq!(o.targets[0].seq, 50_001);
        // An empty queue of a new target starts at the clock.
        let gamma = key(3);
        enrol(&store, &gamma, "gamma");
        assert_eq!(store.info_for(&gamma).expect("info").head_seq, 0);
        let o = push_one(&store, &alpha, 0, item("g", &[(&gamma, b"w")]));
        assert_eq!(o.targets[0].seq, 1, "default next_seq is 1");
    }

    // --- pull ------------------------------------------------------------------------------

    #[test]
    fn paging_by_count_and_by_bytes() {
        let dir = tempfile::tempdir().expect("tempdir");
        let store = open(dir.path());
        let (alpha, beta) = (key(1), key(2));
        enrol(&store, &alpha, "alpha");
        enrol(&store, &beta, "beta");
        let sizes = [10usize, 10, 50, 10, 10];
        let mut seqs = Vec::new();
        for (i, n) in sizes.iter().enumerate() {
            let wire = vec![b'a' + i as u8; *n];
            let o = push_one(
                &store,
                &alpha,
                1_000,
                item(&format!("m{i}"), &[(&beta, &wire)]),
            );
            seqs.push(o.targets[0].seq);
        }
        let pull = |after: i64, limit: i64, max_bytes: u64| {
            store
                .pull(PullRequest {
                    target_pubkey: beta.clone(),
                    after,
                    limit,
                    max_bytes,
                })
                .expect("pull")
        };

        // By count.
        let p = pull(0, 2, u64::MAX);
        assert_eq!(p.items.iter().map(|i| i.seq).collect::<Vec<_>>(), seqs[..2]);
        assert_eq!(p.last_seq, seqs[1]);
        assert!(p.more);
        assert_eq!(p.head_seq, seqs[4]);
        assert_eq!(p.items[0].item_id, "m0");
        assert_eq!(p.items[0].sender_pubkey, alpha);
        assert_eq!(p.items[0].sender_host, "alpha");
        assert_eq!(p.items[0].kind, "envelope");
        assert_eq!(p.items[0].wire, vec![b'a'; 10]);

        // A limit of 0 or less still returns one item; a huge one is clamped.
        assert_eq!(pull(0, 0, u64::MAX).items.len(), 1);
        assert_eq!(pull(0, 10_000, u64::MAX).items.len(), 5);

        // By bytes: 10 + 10 fit in 25, the next (50) would exceed.
        let p = pull(0, 500, 25);
        assert_eq!(p.items.len(), 2);
        assert!(p.more);
        assert_eq!(p.last_seq, seqs[1]);
        // An item larger than the budget comes alone.
        let p = pull(seqs[1], 500, 25);
        assert_eq!(p.items.len(), 1);
        assert_eq!(p.items[0].wire.len(), 50);
        assert_eq!(p.last_seq, seqs[2]);
        assert!(p.more);
        // Exactly at the budget fits.
        let p = pull(seqs[2], 500, 20);
        assert_eq!(p.items.len(), 2);
        assert!(!p.more, "nothing after the last item");
        assert_eq!(p.last_seq, seqs[4]);
        // Past the end: empty, last_seq = after.
        let p = pull(seqs[4], 500, 25);
        assert!(p.items.is_empty());
        assert_eq!(p.last_seq, seqs[4]);
        assert!(!p.more);
        // A host with no queue at all.
        let p = pull_all(&store, &key(77));
        assert_eq!((p.head_seq, p.last_seq, p.more), (0, 0, false));
        assert_eq!(p.epoch, store.epoch().expect("epoch"));
    }

    // --- ack -------------------------------------------------------------------------------

    #[test]
    fn ack_deletes_through_refuses_beyond_head_and_never_goes_back() {
        let dir = tempfile::tempdir().expect("tempdir");
        let store = open(dir.path());
        let (alpha, beta) = (key(1), key(2));
        enrol(&store, &alpha, "alpha");
        enrol(&store, &beta, "beta");
        for i in 0..5 {
            push_one(
                &store,
                &alpha,
                100,
                item(&format!("m{i}"), &[(&beta, b"w")]),
            );
        }
        // seqs 100..=104
        let ack = |through: i64, epoch: Option<String>| {
            store
                .ack(AckRequest {
                    target_pubkey: beta.clone(),
                    through,
                    epoch,
                })
                .expect("ack")
        };
        let epoch = store.epoch().expect("epoch");
        match ack(102, Some(epoch.clone())) {
            AckResult::Acked(a) => {
                assert_eq!(a.acked_through, 102);
                assert_eq!(a.deleted, 3);
                assert_eq!(a.head_seq, 104);
                assert_eq!(a.epoch, epoch);
            }
            other => panic!("unexpected {other:?}"),
        }
        let left: Vec<i64> = pull_all(&store, &beta)
            .items
            .iter()
            .map(|i| i.seq)
            .collect();
        assert_eq!(left, [103, 104]);
        assert_eq!(
            usage_matches(dir.path()),
            2,
            "the ack's deletes are counted"
        );

        assert_eq!(
            ack(105, None),
            AckResult::OutOfRange {
                head_seq: 104,
                epoch: epoch.clone()
            }
        );
        assert_eq!(pull_all(&store, &beta).items.len(), 2, "nothing deleted");

        // An older ack is harmless and does not move acked_through back.
        match ack(101, None) {
            AckResult::Acked(a) => {
                assert_eq!((a.acked_through, a.deleted), (102, 0));
            }
            other => panic!("unexpected {other:?}"),
        }
        assert_eq!(store.info_for(&beta).expect("info").acked_through, 102);

        assert_eq!(
            ack(104, Some("another-epoch".to_owned())),
            AckResult::StaleEpoch {
                epoch: epoch.clone(),
                head_seq: 104
            }
        );
        assert_eq!(
            pull_all(&store, &beta).items.len(),
            2,
            "stale epoch changes nothing"
        );

        // Through 0 on an empty queue is fine; below 0 is out of range like past the head
        // (wire.md §3.2), whatever the i64, and changes nothing.
        assert!(matches!(
            store.ack(AckRequest {
                target_pubkey: key(50),
                through: 0,
                epoch: None
            }),
            Ok(AckResult::Acked(_))
        ));
        for through in [-1, i64::MIN, i64::MAX] {
            assert_eq!(
                ack(through, None),
                AckResult::OutOfRange {
                    head_seq: 104,
                    epoch: epoch.clone()
                }
            );
        }
        assert_eq!(pull_all(&store, &beta).items.len(), 2, "nothing deleted");
        match ack(104, None) {
            AckResult::Acked(a) => assert_eq!((a.acked_through, a.deleted), (104, 2)),
            other => panic!("unexpected {other:?}"),
        }
        let info = store.info_for(&beta).expect("info");
        assert_eq!((info.head_seq, info.acked_through), (104, 104));
        assert_eq!(usage_matches(dir.path()), 0);
    }

    // --- restart, schema, key, lock ----------------------------------------------------------

    #[test]
    fn restart_keeps_everything_including_the_epoch() {
        let dir = tempfile::tempdir().expect("tempdir");
        let (alpha, beta) = (key(1), key(2));
        let (epoch, first_seq) = {
            let store = open(dir.path());
            assert_eq!(store.heartbeat().expect("heartbeat"), None);
            enrol(&store, &alpha, "alpha");
            enrol(&store, &beta, "beta");
            let o = push_one(
                &store,
                &alpha,
                3_000,
                item("m1", &[(&beta, b"bytes\x00\xff")]),
            );
            push_one(&store, &alpha, 3_000, item("m2", &[(&beta, b"two")]));
            let a = store
                .ack(AckRequest {
                    target_pubkey: beta.clone(),
                    through: o.targets[0].seq,
                    epoch: None,
                })
                .expect("ack");
            assert!(matches!(a, AckResult::Acked(_)));
            store.set_heartbeat(4_000).expect("heartbeat");
            store.set_meta("restored", "{\"x\":1}").expect("meta");
            store
                .put_sender_list(SenderList {
                    target_pubkey: beta.clone(),
                    senders: vec![alpha.clone()],
                    iat_ms: 10,
                    record: "{}".to_owned(),
                    sig: "s".to_owned(),
                })
                .expect("senders");
            store
                .append_op(4_000, "relay-backup", &serde_json::json!({"v": 1}))
                .expect("op");
            let epoch = store.epoch().expect("epoch");
            store.close().expect("close");
            (epoch, o.targets[0].seq)
        };
        let store = open(dir.path());
        assert_eq!(store.epoch().expect("epoch"), epoch);
        assert_eq!(store.relay_pubkey().expect("key"), relay_key());
        assert_eq!(store.heartbeat().expect("heartbeat"), Some(4_000));
        assert_eq!(
            store.meta("restored").expect("meta").as_deref(),
            Some("{\"x\":1}")
        );
        assert!(!store
            .enrolment(&beta)
            .expect("enrolment")
            .expect("row")
            .is_revoked());
        let page = pull_all(&store, &beta);
        assert_eq!(page.items.len(), 1);
        assert_eq!(page.items[0].wire, b"two");
        let info = store.info_for(&beta).expect("info");
        assert_eq!(info.acked_through, first_seq);
        assert_eq!(info.head_seq, first_seq + 1);
        let dup = push_one(
            &store,
            &alpha,
            9_000,
            item("m1", &[(&beta, b"bytes\x00\xff")]),
        );
        assert_eq!(dup.status, ItemStatus::Duplicate, "dedup survives restart");
        assert_eq!(
            store
                .sender_list(&beta)
                .expect("list")
                .expect("stored")
                .senders,
            vec![alpha.clone()]
        );
        let ops = store.ops(10).expect("ops");
        assert_eq!(ops.len(), 1);
        assert_eq!(ops[0].op, "relay-backup");
        assert_eq!(ops[0].receipt, serde_json::json!({"v": 1}));
    }

    /// What the store logs on this thread while the guard lives (DEBUG and up, no colours).
    #[derive(Clone, Default)]
    struct Logged(Arc<Mutex<Vec<u8>>>);

    impl std::io::Write for Logged {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            self.0.lock().expect("log").extend_from_slice(buf);
            Ok(buf.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    impl Logged {
        fn capture() -> (Logged, tracing::subscriber::DefaultGuard) {
            let log = Logged::default();
            let writer = log.clone();
            let subscriber = tracing_subscriber::fmt()
                .with_max_level(tracing::Level::DEBUG)
                .with_ansi(false)
                .with_writer(move || writer.clone())
                .finish();
            (log, tracing::subscriber::set_default(subscriber))
        }

        /// The lines logged since the last call.
        fn take(&self) -> Vec<String> {
            let bytes = std::mem::take(&mut *self.0.lock().expect("log"));
            String::from_utf8_lossy(&bytes)
                .lines()
                .map(str::to_owned)
                .collect()
        }
    }

    #[test]
    fn the_open_line_names_migrated_from_only_when_the_open_migrated() {
        let (log, _guard) = Logged::capture();
        let opened = |lines: &[String]| -> String {
            let found: Vec<&String> = lines
                .iter()
                .filter(|l| l.contains("relay store opened"))
                .collect();
            assert_eq!(found.len(), 1, "{lines:#?}");
            assert!(
                !lines.iter().any(|l| l.contains("did not stop cleanly")),
                "{lines:#?}"
            );
            found[0].clone()
        };
        // A new store: created, nothing migrated.
        let dir = tempfile::tempdir().expect("tempdir");
        open(dir.path()).close().expect("close");
        let line = opened(&log.take());
        assert!(line.contains("created=true"), "{line}");
        assert!(!line.contains("migrated_from"), "{line}");
        // Opened again at the current version: neither.
        open(dir.path()).close().expect("close");
        let line = opened(&log.take());
        assert!(!line.contains("migrated_from"), "{line}");
        assert!(!line.contains("created"), "{line}");
        assert!(
            line.contains(&format!("schema_version={SCHEMA_VERSION}")),
            "{line}"
        );
        // A store one version behind: the open migrates it and says from which version.
        let old = tempfile::tempdir().expect("tempdir");
        {
            let mut conn = Connection::open(old.path().join(DB_FILE)).expect("raw");
            schema::migrate(&mut conn, 0, SCHEMA_VERSION - 1, MIGRATIONS).expect("old schema");
        }
        open(old.path()).close().expect("close");
        let line = opened(&log.take());
        assert!(
            line.contains(&format!("migrated_from={}", SCHEMA_VERSION - 1)),
            "{line}"
        );
        open(old.path()).close().expect("close");
        let line = opened(&log.take());
        assert!(!line.contains("migrated_from"), "{line}");
    }

    #[test]
    fn a_newer_schema_is_refused_with_a_clear_message() {
        let dir = tempfile::tempdir().expect("tempdir");
        open(dir.path()).close().expect("close");
        {
            let conn = Connection::open(dir.path().join(DB_FILE)).expect("raw");
            conn.execute_batch("PRAGMA user_version = 7").expect("bump");
        }
        let err = SqliteStore::open_with(dir.path(), &relay_key(), 1_000, options())
            .expect_err("refused");
        assert!(matches!(
            err,
            StoreError::SchemaTooNew {
                found: 7,
                supported: SCHEMA_VERSION
            }
        ));
        assert_eq!(
            err.to_string(),
            format!(
                "relay.db has schema version 7, this agentmbx supports up to {SCHEMA_VERSION}: upgrade agentmbx"
            )
        );
        // The refusal released the lock: a later open (after a downgrade fix) is possible.
        {
            let conn = Connection::open(dir.path().join(DB_FILE)).expect("raw");
            conn.execute_batch("PRAGMA user_version = 1")
                .expect("restore");
        }
        open(dir.path());
    }

    #[test]
    fn opening_creates_the_current_schema_and_a_later_migration_step_is_refused_as_newer() {
        let dir = tempfile::tempdir().expect("tempdir");
        let epoch = {
            let store = open(dir.path());
            store.epoch().expect("epoch")
        };
        let mut conn = Connection::open(dir.path().join(DB_FILE)).expect("raw");
        assert_eq!(
            schema::stored_version(&conn).expect("version"),
            SCHEMA_VERSION
        );
        let uv: i64 = conn
            .query_row("PRAGMA user_version", [], |r| r.get(0))
            .expect("uv");
        assert_eq!(uv, i64::from(SCHEMA_VERSION));
        let journal: String = conn
            .query_row("PRAGMA journal_mode", [], |r| r.get(0))
            .expect("journal");
        assert_eq!(journal, "wal");
        // A future binary's next step runs over our store and keeps the epoch ...
        let future: Vec<(u32, &str)> = MIGRATIONS
            .iter()
            .copied()
            .chain([(
                SCHEMA_VERSION + 1,
                "ALTER TABLE items ADD COLUMN future TEXT;",
            )])
            .collect();
        schema::migrate(&mut conn, SCHEMA_VERSION, SCHEMA_VERSION + 1, &future)
            .expect("migrate to the next version");
        let kept: String = conn
            .query_row("SELECT v FROM meta WHERE k = 'epoch'", [], |r| r.get(0))
            .expect("epoch");
        assert_eq!(kept, epoch);
        drop(conn);
        // ... and this binary then refuses it.
        let err = SqliteStore::open_with(dir.path(), &relay_key(), 1_000, options())
            .expect_err("refused");
        assert!(
            matches!(err, StoreError::SchemaTooNew { found, .. } if found == SCHEMA_VERSION + 1)
        );
    }

    #[test]
    fn a_store_of_another_relay_key_is_refused_naming_only_fingerprints() {
        let dir = tempfile::tempdir().expect("tempdir");
        open(dir.path()).close().expect("close");
        let other = key(201);
        let err =
            SqliteStore::open_with(dir.path(), &other, 1_000, options()).expect_err("refused");
        let text = err.to_string();
        assert!(
            text.starts_with("this relay store belongs to another relay key (fingerprint "),
            "{text}"
        );
        assert!(text.contains(&key_fingerprint(&relay_key())), "{text}");
        assert!(
            !text.contains(&relay_key()) && !text.contains(&other),
            "{text}"
        );
        assert!(matches!(err, StoreError::OtherRelayKey { .. }));
        // The right key still opens it.
        open(dir.path());
    }

    #[test]
    fn a_deleted_lock_file_and_a_fresh_heartbeat_refuse_every_opener_until_it_is_90_s_old() {
        let dir = tempfile::tempdir().expect("tempdir");
        let store = open(dir.path());
        store.set_heartbeat(100_000).expect("beat");
        store.close().expect("close");
        let lock = dir.path().join(LOCK_FILE);
        std::fs::remove_file(&lock).expect("rm lock");
        for now in [100_000 + 89_999, 100_000 - 89_999] {
            let err = StoreLock::acquire(dir.path(), 0, now).expect_err("lock");
            assert!(matches!(err, StoreError::LiveHeartbeat { .. }), "{err}");
            assert!(err.to_string().starts_with("RELAY_RUNNING: "), "{err}");
            assert!(err.to_string().contains("no relay.lock"), "{err}");
            let err =
                SqliteStore::open_with(dir.path(), &relay_key(), now, options()).expect_err("open");
            assert!(matches!(err, StoreError::LiveHeartbeat { .. }), "{err}");
            // Nothing was left behind, so the next attempt checks again.
            assert!(!lock.exists());
        }
        let held = StoreLock::acquire_ignoring_heartbeat(dir.path(), 0, 100_001).expect("forced");
        drop(held);
        std::fs::remove_file(&lock).expect("rm lock");
        // 90 s old: no relay runs on it.
        StoreLock::acquire(dir.path(), 0, 190_000).expect("stale");
    }

    #[test]
    fn a_held_lock_refuses_a_second_open_until_released() {
        let dir = tempfile::tempdir().expect("tempdir");
        let first = open(dir.path());
        let err =
            SqliteStore::open_with(dir.path(), &relay_key(), 1_000, options()).expect_err("locked");
        // It names the holder its lock file records: this process, since it opened (1 s).
        let holder = crate::store::LockHolder {
            pid: std::process::id(),
            since_ms: 1_000,
        };
        assert!(
            matches!(err, StoreError::Locked { holder: Some(h), waited_ms: 0, .. } if h == holder),
            "{err:?}"
        );
        assert_eq!(
            err.to_string(),
            format!(
                "another relay process (pid {}, since 1970-01-01T00:00:01.000Z) holds {}",
                std::process::id(),
                dir.path().join(LOCK_FILE).display()
            )
        );
        // Waiting: it gives up after the wait, saying how long it waited.
        let started = Instant::now();
        let err = SqliteStore::open_with(
            dir.path(),
            &relay_key(),
            2_000,
            OpenOptions {
                lock_wait_ms: 300,
                ..OpenOptions::default()
            },
        )
        .expect_err("still locked");
        assert!(started.elapsed() >= Duration::from_millis(300), "it waited");
        assert!(
            matches!(err, StoreError::Locked { holder: Some(h), waited_ms: 300, .. } if h == holder),
            "{err:?}"
        );
        assert!(
            err.to_string()
                .contains("; gave up after waiting 300 ms: stop that process first"),
            "{err}"
        );
        drop(first);
        let store = open(dir.path());
        drop(store);

        // A waiting open gets the lock once the holder goes away.
        let holder = open(dir.path());
        let path = dir.path().to_path_buf();
        let waiter = std::thread::spawn(move || {
            SqliteStore::open_with(
                &path,
                &relay_key(),
                1_000,
                OpenOptions {
                    lock_wait_ms: 30_000,
                    ..OpenOptions::default()
                },
            )
            .map(|s| s.epoch())
        });
        drop(holder);
        let epoch = waiter.join().expect("join").expect("opened after wait");
        assert!(epoch.is_ok());
    }

    #[test]
    fn the_lock_file_records_the_holder() {
        let dir = tempfile::tempdir().expect("tempdir");
        drop(open(dir.path()));
        let conn = Connection::open(dir.path().join(LOCK_FILE)).expect("raw");
        let (pid, at): (i64, i64) = conn
            .query_row("SELECT pid, at FROM holder", [], |r| {
                Ok((r.get(0)?, r.get(1)?))
            })
            .expect("holder");
        assert_eq!(pid, i64::from(std::process::id()));
        assert_eq!(at, 1_000);
    }

    #[test]
    fn iso_utc_formats_unix_ms() {
        use crate::store::iso_utc;
        assert_eq!(iso_utc(0), "1970-01-01T00:00:00.000Z");
        assert_eq!(iso_utc(1_767_225_600_000), "2026-01-01T00:00:00.000Z");
        assert_eq!(iso_utc(951_782_400_000), "2000-02-29T00:00:00.000Z");
        assert_eq!(iso_utc(1_709_251_199_999), "2024-02-29T23:59:59.999Z");
        assert_eq!(iso_utc(-1), "1969-12-31T23:59:59.999Z");
        assert_eq!(crate::store::duration_text(60_000), "60 s");
        assert_eq!(crate::store::duration_text(1_500), "1500 ms");
    }

    // --- shutdown and files ---------------------------------------------------------------

    /// The item `m1` from `alpha` for `beta`, as a copy of `relay.db` alone holds it.
    fn assert_db_alone_holds_the_item(dir: &Path, beta: &str) {
        let wal = dir.join(format!("{DB_FILE}-wal"));
        let wal_len = std::fs::metadata(&wal).map(|m| m.len()).unwrap_or(0);
        assert_eq!(wal_len, 0, "the WAL is empty or gone after a clean close");
        let copy = tempfile::tempdir().expect("tempdir");
        std::fs::copy(dir.join(DB_FILE), copy.path().join(DB_FILE)).expect("copy relay.db");
        let conn = Connection::open(copy.path().join(DB_FILE)).expect("open the copy");
        let (id, wire): (String, Vec<u8>) = conn
            .query_row(
                "SELECT item_id, wire FROM items WHERE target_pubkey = ?1",
                [beta],
                |r| Ok((r.get(0)?, r.get(1)?)),
            )
            .expect("the item is in the copy");
        assert_eq!((id.as_str(), wire.as_slice()), ("m1", &b"sealed-1"[..]));
    }

    #[test]
    fn a_clean_close_checkpoints_the_wal_into_relay_db() {
        let (alpha, beta) = (key(1), key(2));
        for by_drop in [false, true] {
            let dir = tempfile::tempdir().expect("tempdir");
            let store = open(dir.path());
            enrol(&store, &alpha, "alpha");
            enrol(&store, &beta, "beta");
            let out = push_one(&store, &alpha, 5_000, item("m1", &[(&beta, b"sealed-1")]));
            assert_eq!(out.status, ItemStatus::Accepted);
            // Readers are open (pooled) while the writer stops.
            assert_eq!(pull_all(&store, &beta).items.len(), 1);
            let wal = dir.path().join(format!("{DB_FILE}-wal"));
            assert!(
                std::fs::metadata(&wal).expect("a WAL while open").len() > 0,
                "the data is in the WAL while the store is open"
            );
            if by_drop {
                drop(store);
            } else {
                store.close().expect("close");
            }
            assert_db_alone_holds_the_item(dir.path(), &beta);
        }
    }

    fn mode(path: &Path) -> u32 {
        use std::os::unix::fs::PermissionsExt as _;
        std::fs::metadata(path)
            .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
            .permissions()
            .mode()
            & 0o777
    }

    #[test]
    fn store_files_are_private_and_an_operators_directory_is_left_alone() {
        use std::os::unix::fs::PermissionsExt as _;
        let tmp = tempfile::tempdir().expect("tempdir");
        // Created by the store (with a missing parent): 0700; the files 0600.
        let dir = tmp.path().join("new").join("store");
        prepare_store_dir(&dir).expect("prepare");
        let store = open(&dir);
        enrol(&store, &key(1), "alpha");
        assert_eq!(mode(&dir), 0o700);
        for name in [DB_FILE, "relay.db-wal", "relay.db-shm", LOCK_FILE] {
            assert_eq!(mode(&dir.join(name)), 0o600, "{name}");
        }
        drop(store);

        // A store made before (files 0644) is made private at the next open; a directory the
        // operator made is never changed.
        let chmod = |p: &Path, m: u32| {
            std::fs::set_permissions(p, std::fs::Permissions::from_mode(m)).expect("chmod")
        };
        let own = tmp.path().join("operator");
        std::fs::create_dir(&own).expect("mkdir");
        chmod(&own, 0o755);
        drop(open(&own));
        for name in [DB_FILE, LOCK_FILE] {
            chmod(&own.join(name), 0o644);
        }
        prepare_store_dir(&own).expect("prepare");
        let store = open(&own);
        enrol(&store, &key(1), "alpha");
        assert_eq!(
            mode(&own),
            0o755,
            "the operator's directory is left as it was"
        );
        for name in [DB_FILE, "relay.db-wal", "relay.db-shm", LOCK_FILE] {
            assert_eq!(mode(&own.join(name)), 0o600, "{name}");
        }
    }

    // --- quotas and allowlists -----------------------------------------------------------

    #[test]
    fn quotas_hold_at_the_bound_and_refuse_past_it() {
        let dir = tempfile::tempdir().expect("tempdir");
        let store = open_limited(
            dir.path(),
            StoreLimits {
                max_queue_items: 3,
                max_queue_bytes: 30,
                max_sender_items: 2,
                max_sender_bytes: 1_000,
                ..StoreLimits::default()
            },
        );
        let (alpha, beta, gamma) = (key(1), key(2), key(3));
        enrol(&store, &alpha, "alpha");
        enrol(&store, &beta, "Beta");
        enrol(&store, &gamma, "gamma");

        // Sender share: 2 items from alpha fit, the 3rd does not.
        assert_eq!(
            push_one(&store, &alpha, 1, item("a1", &[(&beta, &[1; 10])])).status,
            ItemStatus::Accepted
        );
        assert_eq!(
            push_one(&store, &alpha, 1, item("a2", &[(&beta, &[2; 10])])).status,
            ItemStatus::Accepted
        );
        assert_eq!(
            push_one(&store, &alpha, 1, item("a3", &[(&beta, &[3; 1])]))
                .status
                .wire(),
            "rejected:quota:sender share exceeded for Beta"
        );
        // A duplicate is never charged, even at the bound.
        assert_eq!(
            push_one(&store, &alpha, 1, item("a2", &[(&beta, &[2; 10])])).status,
            ItemStatus::Duplicate
        );
        // Queue bytes: 20 used, 10 more is exactly 30 (fits), then 1 more does not.
        assert_eq!(
            push_one(&store, &gamma, 1, item("g1", &[(&beta, &[4; 10])])).status,
            ItemStatus::Accepted
        );
        assert_eq!(pull_all(&store, &beta).items.len(), 3);
        // Queue depth: 3 items queued = the bound; one more is refused (depth is checked first).
        assert_eq!(
            push_one(&store, &gamma, 1, item("g2", &[(&beta, &[5; 1])]))
                .status
                .wire(),
            "rejected:quota:queue depth exceeded for Beta"
        );
        // Free one slot: now bytes are the binding limit (20 + 11 > 30).
        let acked = store
            .ack(AckRequest {
                target_pubkey: beta.clone(),
                through: pull_all(&store, &beta).items[0].seq,
                epoch: None,
            })
            .expect("ack");
        assert!(matches!(acked, AckResult::Acked(_)));
        assert_eq!(
            push_one(&store, &gamma, 1, item("g3", &[(&beta, &[6; 11])]))
                .status
                .wire(),
            "rejected:quota:queue bytes exceeded for Beta"
        );
        assert_eq!(
            push_one(&store, &gamma, 1, item("g4", &[(&beta, &[7; 10])])).status,
            ItemStatus::Accepted
        );
        assert_eq!(pull_all(&store, &beta).items.len(), 3);
        assert_eq!(
            usage_matches(dir.path()),
            3,
            "refused items are never counted"
        );
    }

    #[test]
    fn account_quota_charges_only_proven_accounts() {
        let dir = tempfile::tempdir().expect("tempdir");
        let store = open_limited(
            dir.path(),
            StoreLimits {
                max_owner_items: 2,
                ..StoreLimits::default()
            },
        );
        let (alpha, b1, b2, loose) = (key(1), key(2), key(3), key(4));
        enrol(&store, &alpha, "alpha");
        for (k, name) in [(&b1, "one"), (&b2, "two")] {
            let out = enrol_as(&store, k, name, Some("acct"), AuthorityStrength::Account);
            assert!(matches!(out, EnrolOutcome::Enrolled(_)));
        }
        enrol(&store, &loose, "loose");
        assert_eq!(
            push_one(&store, &alpha, 1, item("1", &[(&b1, b"x")])).status,
            ItemStatus::Accepted
        );
        assert_eq!(
            push_one(&store, &alpha, 1, item("2", &[(&b2, b"x")])).status,
            ItemStatus::Accepted
        );
        assert_eq!(
            push_one(&store, &alpha, 1, item("3", &[(&b2, b"x")]))
                .status
                .wire(),
            "rejected:quota:owner queue depth exceeded for two"
        );
        for i in 0..3 {
            let o = push_one(&store, &alpha, 1, item(&format!("l{i}"), &[(&loose, b"x")]));
            assert_eq!(
                o.status,
                ItemStatus::Accepted,
                "no account, no account quota"
            );
        }
        // A revoked key's queue no longer counts for its account (its items stay queued).
        assert_eq!(
            store.revoke(&b2, 2).expect("revoke"),
            RevokeOutcome::Revoked
        );
        assert_eq!(
            push_one(&store, &alpha, 3, item("4", &[(&b1, b"x")])).status,
            ItemStatus::Accepted
        );
        assert_eq!(
            push_one(&store, &alpha, 3, item("5", &[(&b1, b"x")]))
                .status
                .wire(),
            "rejected:quota:owner queue depth exceeded for one"
        );
        assert_eq!(usage_matches(dir.path()), 6);
    }

    #[test]
    fn account_quota_counts_the_items_own_earlier_targets() {
        // One item to two targets of the same account, with room for one more item in the
        // account: the second target sees the first target's addition and the whole item is
        // refused, with nothing stored for either target.
        let dir = tempfile::tempdir().expect("tempdir");
        let store = open_limited(
            dir.path(),
            StoreLimits {
                max_owner_items: 2,
                ..StoreLimits::default()
            },
        );
        let (alpha, b1, b2) = (key(1), key(2), key(3));
        enrol(&store, &alpha, "alpha");
        for (k, name) in [(&b1, "one"), (&b2, "two")] {
            let out = enrol_as(&store, k, name, Some("acct"), AuthorityStrength::Account);
            assert!(matches!(out, EnrolOutcome::Enrolled(_)));
        }
        assert_eq!(
            push_one(&store, &alpha, 1, item("1", &[(&b1, b"x")])).status,
            ItemStatus::Accepted
        );
        assert_eq!(
            push_one(&store, &alpha, 1, item("2", &[(&b1, b"y"), (&b2, b"y")]))
                .status
                .wire(),
            "rejected:quota:owner queue depth exceeded for two"
        );
        assert_eq!(pull_all(&store, &b1).items.len(), 1);
        assert!(pull_all(&store, &b2).items.is_empty());
        assert_eq!(
            usage_matches(dir.path()),
            1,
            "a refused item counts nowhere"
        );
        // The refused item took no room: one more item fits the account.
        assert_eq!(
            push_one(&store, &alpha, 1, item("3", &[(&b2, b"z")])).status,
            ItemStatus::Accepted
        );
        assert_eq!(usage_matches(dir.path()), 2);
    }

    #[test]
    fn the_push_path_reuses_its_prepared_statements() {
        // Every statement of a push is prepared once per connection: a statement SQLite
        // re-prepares on each run (as a `json_each` joined to a table was) costs a full parse.
        let dir = tempfile::tempdir().expect("tempdir");
        let (alpha, beta, listed) = (key(1), key(2), key(3));
        {
            let store = open(dir.path());
            for (k, name) in [(&alpha, "alpha"), (&beta, "beta"), (&listed, "listed")] {
                enrol(&store, k, name);
            }
            let out = store
                .put_sender_list(SenderList {
                    target_pubkey: listed.clone(),
                    senders: vec![alpha.clone()],
                    iat_ms: 1,
                    record: "{}".to_owned(),
                    sig: "sig".to_owned(),
                })
                .expect("list");
            assert_eq!(out, SenderListOutcome::Stored);
            store.close().expect("close");
        }
        let c = open_write_connection(&dir.path().join(DB_FILE)).expect("open");
        for i in 0..10 {
            let batch = PushBatch {
                sender_pubkey: alpha.clone(),
                sender_host: "alpha".to_owned(),
                now_ms: 10 + i,
                expiry: Expiry::Retention,
                items: vec![
                    item(&format!("a{i}"), &[(&beta, b"one")]),
                    item(&format!("b{i}"), &[(&listed, b"two")]),
                ],
            };
            run_cached(&c, "BEGIN IMMEDIATE").expect("begin");
            let out = push_apply(&c, &StoreLimits::default(), &batch).expect("push");
            run_cached(&c, "COMMIT").expect("commit");
            assert!(out.items.iter().all(|o| o.status == ItemStatus::Accepted));
        }
        let st = c.prepare_cached(SENDER_ALLOWED_SQL).expect("cached");
        assert_eq!(
            st.get_status(rusqlite::StatementStatus::RePrepare),
            0,
            "the allowlist check was prepared again"
        );
        assert!(
            st.get_status(rusqlite::StatementStatus::VmStep) > 0,
            "it ran"
        );
    }

    #[test]
    fn a_sender_allowlist_refuses_other_senders() {
        let dir = tempfile::tempdir().expect("tempdir");
        let store = open(dir.path());
        let (alpha, beta, mallory) = (key(1), key(2), key(6));
        enrol(&store, &alpha, "alpha");
        enrol(&store, &beta, "beta");
        enrol(&store, &mallory, "mallory");
        let list = |iat_ms: i64, senders: Vec<String>| SenderList {
            target_pubkey: beta.clone(),
            senders,
            iat_ms,
            record: format!("{{\"iat\":{iat_ms}}}"),
            sig: "sig".to_owned(),
        };
        // No list: everybody may push.
        assert_eq!(
            push_one(&store, &mallory, 1, item("m0", &[(&beta, b"x")])).status,
            ItemStatus::Accepted
        );
        assert_eq!(
            store
                .put_sender_list(list(100, vec![alpha.clone(), alpha.clone()]))
                .expect("put"),
            SenderListOutcome::Stored
        );
        assert_eq!(
            store
                .sender_list(&beta)
                .expect("get")
                .expect("stored")
                .senders,
            vec![alpha.clone()],
            "duplicates dropped"
        );
        assert_eq!(
            push_one(&store, &mallory, 1, item("m1", &[(&beta, b"x")]))
                .status
                .wire(),
            "rejected:sender not accepted by target"
        );
        assert_eq!(
            push_one(&store, &alpha, 1, item("a1", &[(&beta, b"x")])).status,
            ItemStatus::Accepted
        );
        // Same or older iat: stale, nothing changes.
        assert_eq!(
            store
                .put_sender_list(list(100, vec![mallory.clone()]))
                .expect("put"),
            SenderListOutcome::Stale
        );
        assert_eq!(
            store
                .put_sender_list(list(99, vec![mallory.clone()]))
                .expect("put"),
            SenderListOutcome::Stale
        );
        assert_eq!(
            push_one(&store, &mallory, 1, item("m2", &[(&beta, b"x")]))
                .status
                .wire(),
            "rejected:sender not accepted by target"
        );
        // Newer: replaces.
        assert_eq!(
            store
                .put_sender_list(list(101, vec![mallory.clone()]))
                .expect("put"),
            SenderListOutcome::Stored
        );
        assert_eq!(
            push_one(&store, &mallory, 1, item("m3", &[(&beta, b"x")])).status,
            ItemStatus::Accepted
        );
        let stored = store.sender_list(&beta).expect("get").expect("stored");
        assert_eq!(
            (stored.iat_ms, stored.record.as_str()),
            (101, "{\"iat\":101}")
        );
    }

    // --- enrolments and enc ads --------------------------------------------------------------

    #[test]
    fn a_revoked_key_stays_revoked_and_serves_nothing() {
        let dir = tempfile::tempdir().expect("tempdir");
        let store = open(dir.path());
        let (alpha, beta) = (key(1), key(2));
        enrol(&store, &alpha, "alpha");
        enrol(&store, &beta, "beta");
        store
            .put_enc_ad_v1(EncAdV1 {
                host_pubkey: beta.clone(),
                host_name: "beta".to_owned(),
                enc_pub: "E1".to_owned(),
                sig: "s1".to_owned(),
                at_ms: 1,
            })
            .expect("ad");
        assert!(store.get_enc_ad(&beta).expect("ad").is_some());
        assert_eq!(
            store.revoke(&beta, 2_000).expect("revoke"),
            RevokeOutcome::Revoked
        );
        assert_eq!(
            store.revoke(&beta, 3_000).expect("revoke"),
            RevokeOutcome::AlreadyRevoked
        );
        assert_eq!(
            store.revoke(&key(99), 3_000).expect("revoke"),
            RevokeOutcome::Unknown
        );
        assert_eq!(
            enrol_as(
                &store,
                &beta,
                "beta",
                Some("acct"),
                AuthorityStrength::Account
            ),
            EnrolOutcome::Revoked
        );
        let row = store.enrolment(&beta).expect("row").expect("known");
        assert_eq!(
            row.revoked_at_ms,
            Some(2_000),
            "the first revocation time is kept"
        );
        assert_eq!(store.get_enc_ad(&beta).expect("ad"), None);
        assert_eq!(
            push_one(&store, &alpha, 1, item("m", &[(&beta, b"x")]))
                .status
                .wire(),
            "rejected:target not enrolled"
        );
        assert!(store
            .live_enrolments_by_name("BETA")
            .expect("by name")
            .is_empty());
        assert_eq!(store.live_enrolment_count().expect("count"), 1);
    }

    #[test]
    fn names_are_unique_per_account_case_insensitively_and_weaker_authority_keeps_the_account() {
        let dir = tempfile::tempdir().expect("tempdir");
        let store = open_limited(
            dir.path(),
            StoreLimits {
                max_live_enrolments: 4,
                ..StoreLimits::default()
            },
        );
        let (k1, k2, k3, k4, k5) = (key(1), key(2), key(3), key(4), key(5));
        assert!(matches!(
            enrol_as(
                &store,
                &k1,
                "MacBook",
                Some("acct-1"),
                AuthorityStrength::Account
            ),
            EnrolOutcome::Enrolled(_)
        ));
        assert_eq!(
            enrol_as(
                &store,
                &k2,
                "macbook",
                Some("acct-1"),
                AuthorityStrength::Account
            ),
            EnrolOutcome::NameTaken
        );
        // Another account, or no account at all, may use the name.
        assert!(matches!(
            enrol_as(
                &store,
                &k2,
                "macbook",
                Some("acct-2"),
                AuthorityStrength::Account
            ),
            EnrolOutcome::Enrolled(_)
        ));
        assert!(matches!(
            enrol_as(
                &store,
                &k3,
                "MACBOOK",
                None,
                AuthorityStrength::HostKeyChallenge
            ),
            EnrolOutcome::Enrolled(_)
        ));
        assert_eq!(
            store
                .live_enrolments_by_name("macBook")
                .expect("by name")
                .len(),
            3
        );

        // The host-key challenge re-enrols k1: name and owner_fp refresh, account stays.
        let weaker = store
            .enrol(EnrolRequest {
                host_pubkey: k1.clone(),
                host_name: "macbook".to_owned(),
                owner_fp: "claimed".to_owned(),
                account: None,
                authorized_by: "host-key-challenge".to_owned(),
                strength: AuthorityStrength::HostKeyChallenge,
                now_ms: 5_000,
            })
            .expect("enrol");
        match weaker {
            EnrolOutcome::Enrolled(e) => {
                assert_eq!(e.account.as_deref(), Some("acct-1"));
                assert_eq!(e.authorized_by, "account-token");
                assert_eq!(e.strength, AuthorityStrength::Account);
                assert_eq!(
                    (e.host_name.as_str(), e.owner_fp.as_str()),
                    ("macbook", "claimed")
                );
                assert_eq!(e.enrolled_at_ms, 5_000);
            }
            other => panic!("unexpected {other:?}"),
        }
        // A stronger authority upgrades a challenge-only enrolment.
        match enrol_as(
            &store,
            &k3,
            "macbook-3",
            Some("acct-1"),
            AuthorityStrength::Account,
        ) {
            EnrolOutcome::Enrolled(e) => assert_eq!(e.account.as_deref(), Some("acct-1")),
            other => panic!("unexpected {other:?}"),
        }
        // Capacity: 4 live at most; a new key is refused, a known one re-enrols.
        assert!(matches!(
            enrol_as(
                &store,
                &k4,
                "four",
                None,
                AuthorityStrength::HostKeyChallenge
            ),
            EnrolOutcome::Enrolled(_)
        ));
        assert_eq!(
            enrol_as(
                &store,
                &k5,
                "five",
                None,
                AuthorityStrength::HostKeyChallenge
            ),
            EnrolOutcome::Full
        );
        assert!(matches!(
            enrol_as(
                &store,
                &k4,
                "four",
                None,
                AuthorityStrength::HostKeyChallenge
            ),
            EnrolOutcome::Enrolled(_)
        ));
        assert_eq!(
            store.revoke(&k4, 9).expect("revoke"),
            RevokeOutcome::Revoked
        );
        assert!(matches!(
            enrol_as(
                &store,
                &k5,
                "five",
                None,
                AuthorityStrength::HostKeyChallenge
            ),
            EnrolOutcome::Enrolled(_)
        ));
        // A name freed by revocation can be taken in the account.
        assert_eq!(
            store.revoke(&k1, 10).expect("revoke"),
            RevokeOutcome::Revoked
        );
        match enrol_as(
            &store,
            &k2,
            "MacBook",
            Some("acct-1"),
            AuthorityStrength::Account,
        ) {
            EnrolOutcome::Enrolled(e) => {
                assert_eq!(
                    (e.host_name.as_str(), e.account.as_deref()),
                    ("MacBook", Some("acct-1"))
                );
            }
            other => panic!("unexpected {other:?}"),
        }
    }

    #[test]
    fn enc_ads_serve_the_v2_key_and_a_matching_v1_signature() {
        let dir = tempfile::tempdir().expect("tempdir");
        let store = open(dir.path());
        let beta = key(2);
        assert_eq!(store.get_enc_ad(&beta).expect("ad"), None, "unknown host");
        enrol(&store, &beta, "beta");
        assert_eq!(store.get_enc_ad(&beta).expect("ad"), None, "no ad yet");
        let v1 = EncAdV1 {
            host_pubkey: beta.clone(),
            host_name: "beta".to_owned(),
            enc_pub: "E1".to_owned(),
            sig: "s1".to_owned(),
            at_ms: 1,
        };
        store.put_enc_ad_v1(v1.clone()).expect("v1");
        let ad = store.get_enc_ad(&beta).expect("ad").expect("served");
        assert_eq!(
            (ad.enc_pub.as_str(), ad.v1.as_ref(), ad.v2.as_ref()),
            ("E1", Some(&v1), None)
        );
        // A v2 record naming the same key: both served.
        let v2 = EncAdV2 {
            host_pubkey: beta.clone(),
            enc_pub: "E1".to_owned(),
            record: "{\"enc_pub\":\"E1\"}".to_owned(),
            sig: "s2".to_owned(),
            at_ms: 2,
        };
        store.put_enc_ad_v2(v2.clone()).expect("v2");
        let ad = store.get_enc_ad(&beta).expect("ad").expect("served");
        assert_eq!((ad.v1.as_ref(), ad.v2.as_ref()), (Some(&v1), Some(&v2)));
        // A newer v2 record with another key: the stale v1 ad is no longer served.
        let v2b = EncAdV2 {
            enc_pub: "E2".to_owned(),
            record: "{\"enc_pub\":\"E2\"}".to_owned(),
            at_ms: 3,
            ..v2
        };
        store.put_enc_ad_v2(v2b.clone()).expect("v2b");
        let ad = store.get_enc_ad(&beta).expect("ad").expect("served");
        assert_eq!(ad.enc_pub, "E2");
        assert_eq!(ad.v1, None);
        assert_eq!(ad.v2, Some(v2b));
        assert_eq!(ad.host_name, "beta");
    }

    // --- meta and ops ----------------------------------------------------------------------

    #[test]
    fn meta_epoch_rotation_and_reserved_keys() {
        let dir = tempfile::tempdir().expect("tempdir");
        let store = open(dir.path());
        let before = store.epoch().expect("epoch");
        assert!(uuid::Uuid::parse_str(&before).is_ok());
        let rot = store.rotate_epoch().expect("rotate");
        assert_eq!(rot.from, before);
        assert_ne!(rot.to, before);
        assert_eq!(store.epoch().expect("epoch"), rot.to, "read on each use");
        for k in ["epoch", "relay_pubkey", "schema_version", "heartbeat"] {
            assert!(matches!(
                store.set_meta(k, "x"),
                Err(StoreError::InvalidInput(_))
            ));
        }
        assert_eq!(store.meta("nothing").expect("meta"), None);
    }

    #[test]
    fn the_ops_log_keeps_the_last_thousand_newest_first() {
        let dir = tempfile::tempdir().expect("tempdir");
        let store = Arc::new(open(dir.path()));
        // Append from a few threads so the writer groups them (fewer fsyncs).
        let threads: Vec<_> = (0..4)
            .map(|t| {
                let store = Arc::clone(&store);
                std::thread::spawn(move || {
                    for i in 0..252 {
                        store
                            .append_op(i, "relay-backup", &serde_json::json!({"t": t, "i": i}))
                            .expect("append");
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().expect("join");
        }
        let all = store.ops(5_000).expect("ops");
        assert_eq!(all.len(), 1_000);
        assert!(all.windows(2).all(|w| w[0].id > w[1].id), "newest first");
        assert_eq!(all[0].id, 1_008);
        assert_eq!(store.ops(0).expect("ops").len(), 1);
    }

    // --- group commit and failpoints ---------------------------------------------------------

    #[test]
    fn concurrent_pushes_all_get_correct_replies_with_fewer_commits() {
        let dir = tempfile::tempdir().expect("tempdir");
        let store = Arc::new(open(dir.path()));
        let beta = key(2);
        enrol(&store, &beta, "beta");
        let senders: Vec<String> = (10..18).map(key).collect();
        for (i, s) in senders.iter().enumerate() {
            enrol(&store, s, &format!("s{i}"));
        }
        let before = store.stats();
        const PER: usize = 25;
        let threads: Vec<_> = senders
            .iter()
            .cloned()
            .map(|sender| {
                let store = Arc::clone(&store);
                let beta = beta.clone();
                std::thread::spawn(move || {
                    (0..PER)
                        .map(|i| {
                            let wire = format!("{sender}/{i}").into_bytes();
                            let o = push_one(
                                &store,
                                &sender,
                                1_000,
                                item(&format!("i{i}"), &[(&beta, &wire)]),
                            );
                            assert_eq!(o.status, ItemStatus::Accepted);
                            assert_eq!(o.targets[0].wire_hash, wire_hash(&wire));
                            (o.targets[0].seq, sender.clone(), i)
                        })
                        .collect::<Vec<_>>()
                })
            })
            .collect();
        let mut replies: Vec<(i64, String, usize)> = Vec::new();
        for t in threads {
            replies.extend(t.join().expect("join"));
        }
        let requests = (senders.len() * PER) as u64;
        let after = store.stats();
        assert_eq!(after.write_requests - before.write_requests, requests);
        let commits = after.commits - before.commits;
        assert!(
            commits >= 1 && commits <= requests,
            "{commits} commits for {requests} requests"
        );
        assert_eq!(after.queued, 0);

        // Every reply names a distinct seq, and each seq holds exactly that sender's item.
        let page = pull_all(&store, &beta);
        assert_eq!(page.items.len() as u64, requests, "all stored once");
        let mut seqs: Vec<i64> = replies.iter().map(|r| r.0).collect();
        seqs.sort_unstable();
        seqs.dedup();
        assert_eq!(seqs.len() as u64, requests);
        for (seq, sender, i) in &replies {
            let it = page.items.iter().find(|p| p.seq == *seq).expect("stored");
            assert_eq!(&it.sender_pubkey, sender);
            assert_eq!(it.item_id, format!("i{i}"));
            assert_eq!(it.wire, format!("{sender}/{i}").into_bytes());
        }
    }

    static GATE_OPEN: Mutex<bool> = Mutex::new(false);
    static GATE: Condvar = Condvar::new();
    static GATE_HITS: AtomicUsize = AtomicUsize::new(0);

    /// Holds the writer at its first `push:before-commit` until the test opens the gate.
    fn gate_failpoint(name: &str) {
        if name == "push:before-commit" && GATE_HITS.fetch_add(1, Ordering::SeqCst) == 0 {
            let mut open = GATE_OPEN
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            while !*open {
                open = GATE
                    .wait(open)
                    .unwrap_or_else(std::sync::PoisonError::into_inner);
            }
        }
    }

    fn open_gate() {
        *GATE_OPEN
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = true;
        GATE.notify_all();
    }

    /// Opens the gate when dropped, so a failing assertion cannot leave the writer blocked (and
    /// the store's drop waiting for it forever).
    struct GateGuard;

    impl Drop for GateGuard {
        fn drop(&mut self) {
            open_gate();
        }
    }

    #[test]
    fn writer_answers_goes_through_the_writer_and_changes_nothing() {
        let dir = tempfile::tempdir().expect("tempdir");
        let store =
            SqliteStore::open_with(dir.path(), &relay_key(), 1_000, options()).expect("open");
        let (epoch, base) = (store.epoch().expect("epoch"), store.stats());
        store.writer_answers().expect("the writer answers");
        let after = store.stats();
        assert_eq!(after.write_requests, base.write_requests + 1);
        assert_eq!(after.groups, base.groups + 1);
        assert_eq!(store.epoch().expect("epoch"), epoch);
        assert_eq!(store.heartbeat().expect("heartbeat"), None);
        store.close().expect("close");
    }

    #[test]
    fn waiting_requests_share_one_commit_and_nothing_is_visible_or_answered_before_it() {
        let dir = tempfile::tempdir().expect("tempdir");
        let store = Arc::new(
            SqliteStore::open_with(
                dir.path(),
                &relay_key(),
                1_000,
                OpenOptions {
                    failpoint: gate_failpoint,
                    ..options()
                },
            )
            .expect("open"),
        );
        let (alpha, beta) = (key(1), key(2));
        enrol(&store, &alpha, "alpha");
        enrol(&store, &beta, "beta");
        let base = store.stats();
        let _guard = GateGuard;

        let spawn_push = |i: usize| {
            let store = Arc::clone(&store);
            let (alpha, beta) = (alpha.clone(), beta.clone());
            std::thread::spawn(move || {
                push_one(
                    &store,
                    &alpha,
                    1_000,
                    item(&format!("m{i}"), &[(&beta, format!("w{i}").as_bytes())]),
                )
            })
        };
        // Group 1: one push, held between apply and COMMIT.
        let first = spawn_push(0);
        wait_until("the writer to reach push:before-commit", || {
            GATE_HITS.load(Ordering::SeqCst) == 1
        });
        assert!(
            pull_all(&store, &beta).items.is_empty(),
            "uncommitted rows are invisible"
        );
        assert_eq!(store.info_for(&beta).expect("info").head_seq, 0);
        assert!(!first.is_finished(), "no reply before COMMIT");

        // Meanwhile 31 more pushes queue up.
        const MORE: usize = 31;
        let rest: Vec<_> = (1..=MORE).map(spawn_push).collect();
        wait_until("all pushes to queue", || store.stats().queued == MORE);
        open_gate();

        let mut outcomes = vec![first.join().expect("join")];
        outcomes.extend(rest.into_iter().map(|t| t.join().expect("join")));
        assert!(outcomes.iter().all(|o| o.status == ItemStatus::Accepted));
        let stats = store.stats();
        assert_eq!(stats.write_requests - base.write_requests, 1 + MORE as u64);
        assert_eq!(
            stats.commits - base.commits,
            2,
            "the 31 waiting pushes shared one commit"
        );
        assert_eq!(
            GATE_HITS.load(Ordering::SeqCst),
            2,
            "one failpoint hit per group"
        );
        let page = pull_all(&store, &beta);
        assert_eq!(page.items.len(), 1 + MORE);
        for o in &outcomes {
            let it = page
                .items
                .iter()
                .find(|p| p.seq == o.targets[0].seq)
                .expect("stored");
            assert_eq!(it.item_id, o.item_id);
        }
    }

    static FAILPOINT_LOG: Mutex<Vec<String>> = Mutex::new(Vec::new());
    static FAILPOINT_ARMED: AtomicBool = AtomicBool::new(false);

    fn recording_failpoint(name: &str) {
        if FAILPOINT_ARMED.load(Ordering::SeqCst) {
            FAILPOINT_LOG
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .push(name.to_owned());
        }
    }

    #[test]
    fn failpoints_are_hit_at_the_commit_boundaries() {
        let dir = tempfile::tempdir().expect("tempdir");
        let store = SqliteStore::open_with(
            dir.path(),
            &relay_key(),
            1_000,
            OpenOptions {
                failpoint: recording_failpoint,
                ..options()
            },
        )
        .expect("open");
        let (alpha, beta) = (key(1), key(2));
        enrol(&store, &alpha, "alpha");
        enrol(&store, &beta, "beta");
        FAILPOINT_ARMED.store(true, Ordering::SeqCst);
        let o = push_one(&store, &alpha, 1_000, item("m", &[(&beta, b"x")]));
        store
            .ack(AckRequest {
                target_pubkey: beta.clone(),
                through: o.targets[0].seq,
                epoch: None,
            })
            .expect("ack");
        store.set_heartbeat(5).expect("heartbeat");
        FAILPOINT_ARMED.store(false, Ordering::SeqCst);
        let log = FAILPOINT_LOG
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone();
        assert_eq!(
            log,
            [
                "push:before-commit",
                "push:after-commit",
                "ack:before-commit",
                "ack:after-commit"
            ]
        );
    }

    #[test]
    fn a_failed_request_leaves_nothing_and_does_not_disturb_its_group() {
        let dir = tempfile::tempdir().expect("tempdir");
        let store = open(dir.path());
        let (alpha, beta) = (key(1), key(2));
        enrol(&store, &alpha, "alpha");
        enrol(&store, &beta, "beta");
        // A request that writes, then fails: its savepoint is rolled back.
        let err = store
            .submit(JobKind::Other, |c, _| -> Result<(), StoreError> {
                meta_put(c, "half", "written")?;
                Err(StoreError::InvalidInput("boom".to_owned()))
            })
            .expect_err("fails");
        assert!(matches!(err, StoreError::InvalidInput(_)));
        assert_eq!(store.meta("half").expect("meta"), None);
        // The store keeps working.
        let o = push_one(&store, &alpha, 1_000, item("m", &[(&beta, b"x")]));
        assert_eq!(o.status, ItemStatus::Accepted);
    }

    /// Runs, in one group, a request that writes meta `other` and then a push running `push`;
    /// returns `(other's result, push's result)`.
    fn group_of_other_and_push(
        store: &SqliteStore,
        push: fn(&Connection) -> Result<(), StoreError>,
    ) -> (Result<(), StoreError>, Result<(), StoreError>) {
        // Hold the writer in a first group until the next two requests are queued, so both
        // land in one group.
        let (release, held) = mpsc::channel::<()>();
        let (started_tx, started) = mpsc::channel::<()>();
        let (first_done, first) = mpsc::channel();
        store.submit_then(
            JobKind::Other,
            move |_, _| -> Result<(), StoreError> {
                let _ = started_tx.send(());
                held.recv().map_err(|_| StoreError::WriterStopped)
            },
            Box::new(move |r| {
                let _ = first_done.send(r);
            }),
        );
        started.recv().expect("the writer runs the first request");
        let (other_done, other) = mpsc::channel();
        store.submit_then(
            JobKind::Other,
            |c, _| meta_put(c, "other", "written"),
            Box::new(move |r| {
                let _ = other_done.send(r);
            }),
        );
        let (push_done, push_result) = mpsc::channel();
        store.submit_then(
            JobKind::Push,
            move |c, _| push(c),
            Box::new(move |r| {
                let _ = push_done.send(r);
            }),
        );
        release.send(()).expect("release the writer");
        first
            .recv()
            .expect("first answered")
            .expect("first group commits");
        (
            other.recv().expect("other answered"),
            push_result.recv().expect("push answered"),
        )
    }

    #[test]
    fn a_push_that_fails_part_way_fails_its_whole_group_and_leaves_nothing() {
        let dir = tempfile::tempdir().expect("tempdir");
        let store = open(dir.path());
        let (alpha, beta) = (key(1), key(2));
        enrol(&store, &alpha, "alpha");
        enrol(&store, &beta, "beta");
        let committed_before = store.stats().commits;
        let (other, push) = group_of_other_and_push(&store, |c| {
            meta_put(c, "half", "written")?;
            Err(StoreError::InvalidInput("boom".to_owned()))
        });
        let push_err = push.expect_err("push fails");
        assert!(
            matches!(push_err, StoreError::InvalidInput(_)),
            "{push_err}"
        );
        let other_err = other.expect_err("group fails");
        assert!(
            matches!(other_err, StoreError::NotCommitted { .. }),
            "{other_err}"
        );
        assert_eq!(store.meta("half").expect("meta"), None);
        assert_eq!(store.meta("other").expect("meta"), None);
        assert_eq!(store.stats().commits, committed_before + 1);
        // The writer keeps working: a push after it is stored.
        let o = push_one(&store, &alpha, 1_000, item("m", &[(&beta, b"x")]));
        assert_eq!(o.status, ItemStatus::Accepted);
        assert_eq!(store.failed(), None);
    }

    #[test]
    fn a_push_that_fails_before_writing_fails_alone() {
        let dir = tempfile::tempdir().expect("tempdir");
        let store = open(dir.path());
        let committed_before = store.stats().commits;
        let (other, push) = group_of_other_and_push(&store, |c| {
            read_epoch(c)?;
            Err(StoreError::InvalidInput("boom".to_owned()))
        });
        let push_err = push.expect_err("push fails");
        assert!(
            matches!(push_err, StoreError::InvalidInput(_)),
            "{push_err}"
        );
        other.expect("the rest of the group commits");
        assert_eq!(
            store.meta("other").expect("meta").as_deref(),
            Some("written")
        );
        assert_eq!(store.stats().commits, committed_before + 2);
        assert_eq!(store.failed(), None);
    }

    // --- retries after the target changed ---------------------------------------------------

    #[test]
    fn a_retry_settles_by_dedup_after_the_target_was_revoked_or_changed_its_allowlist() {
        let dir = tempfile::tempdir().expect("tempdir");
        let store = open(dir.path());
        let (alpha, beta, gamma, stranger) = (key(1), key(2), key(3), key(9));
        enrol(&store, &alpha, "alpha");
        enrol(&store, &beta, "beta");
        enrol(&store, &gamma, "gamma");
        let first = push_one(&store, &alpha, 5_000, item("m", &[(&beta, b"w")]));
        assert_eq!(first.status, ItemStatus::Accepted);
        assert_eq!(
            store.dedup_targets(&alpha, "m").expect("dedup"),
            vec![beta.clone()]
        );
        assert!(store.dedup_targets(&gamma, "m").expect("dedup").is_empty());

        // beta's allowlist no longer names alpha.
        let list = SenderList {
            target_pubkey: beta.clone(),
            senders: vec![gamma.clone()],
            iat_ms: 6_000,
            record: "{}".to_owned(),
            sig: "sig".to_owned(),
        };
        assert_eq!(
            store.put_sender_list(list).expect("list"),
            SenderListOutcome::Stored
        );
        let again = push_one(&store, &alpha, 7_000, item("m", &[(&beta, b"w")]));
        assert_eq!(again.status, ItemStatus::Duplicate);
        assert_eq!((again.at_ms, &again.targets), (Some(5_000), &first.targets));
        let other = push_one(&store, &alpha, 7_000, item("m", &[(&beta, b"X")]));
        assert_eq!(other.status, ItemStatus::Rejected(Rejection::Conflict));
        let fresh = push_one(&store, &alpha, 7_000, item("n", &[(&beta, b"w")]));
        assert_eq!(
            fresh.status.wire(),
            "rejected:sender not accepted by target"
        );

        // beta is revoked (after acking the item: the dedup row is a tombstone).
        store
            .ack(AckRequest {
                target_pubkey: beta.clone(),
                through: first.targets[0].seq,
                epoch: None,
            })
            .expect("ack");
        assert_eq!(
            store.revoke(&beta, 8_000).expect("revoke"),
            RevokeOutcome::Revoked
        );
        let again = push_one(&store, &alpha, 9_000, item("m", &[(&beta, b"w")]));
        assert_eq!(again.status, ItemStatus::Duplicate);
        assert_eq!((again.at_ms, &again.targets), (Some(5_000), &first.targets));
        let fresh = push_one(&store, &alpha, 9_000, item("n", &[(&beta, b"w")]));
        assert_eq!(fresh.status.wire(), "rejected:target not enrolled");

        // Widened to a live fresh target: gamma gets it, beta keeps its original seq.
        let wide = push_one(
            &store,
            &alpha,
            9_500,
            item("m", &[(&beta, b"w"), (&gamma, b"g")]),
        );
        assert_eq!(wide.status, ItemStatus::Accepted);
        assert_eq!(wide.at_ms, Some(9_500));
        assert_eq!(wide.targets[0], first.targets[0]);
        assert_eq!(wide.targets[1].seq, 9_500);
        // A fresh target that is not enrolled still refuses the whole item, before conflict
        // (`wire.md` §3.2 order) and before anything is written.
        let head = store.info_for(&gamma).expect("info").head_seq;
        let out = push_one(
            &store,
            &alpha,
            9_600,
            item("p", &[(&gamma, b"p"), (&stranger, b"p")]),
        );
        assert_eq!(out.status.wire(), "rejected:target not enrolled");
        let out = push_one(
            &store,
            &alpha,
            9_600,
            item("m", &[(&beta, b"CONFLICT"), (&stranger, b"p")]),
        );
        assert_eq!(out.status.wire(), "rejected:target not enrolled");
        let out = push_one(
            &store,
            &alpha,
            9_600,
            item("m", &[(&beta, b"CONFLICT"), (&gamma, b"g")]),
        );
        assert_eq!(out.status.wire(), "rejected:conflict");
        assert_eq!(store.info_for(&gamma).expect("info").head_seq, head);
        assert_eq!(pull_all(&store, &gamma).items.len(), 1);
    }

    #[test]
    fn only_canonical_host_keys_are_enrolled() {
        let dir = tempfile::tempdir().expect("tempdir");
        let store = open(dir.path());
        let canonical = key(1);
        let alias = canonical.trim_end_matches('=').to_owned();
        assert_ne!(alias, canonical);
        let err = store
            .enrol(EnrolRequest {
                host_pubkey: alias,
                host_name: "alpha".to_owned(),
                owner_fp: String::new(),
                account: None,
                authorized_by: "host-key-challenge".to_owned(),
                strength: AuthorityStrength::HostKeyChallenge,
                now_ms: 1_000,
            })
            .expect_err("an alias is refused");
        assert!(matches!(err, StoreError::InvalidInput(_)), "{err}");
        assert_eq!(store.live_enrolment_count().expect("count"), 0);
        enrol(&store, &canonical, "alpha");
        assert_eq!(store.live_enrolment_count().expect("count"), 1);
    }

    // --- a failed COMMIT -------------------------------------------------------------------

    /// A write whose COMMIT fails for real: a deferred foreign key violated inside the
    /// transaction is only checked by COMMIT (the statements and the savepoint succeed).
    fn fail_the_commit(store: &SqliteStore) -> StoreError {
        store
            .submit(JobKind::Other, |c, _| -> Result<(), StoreError> {
                c.execute_batch(
                    "CREATE TEMP TABLE IF NOT EXISTS fk_parent (id INTEGER PRIMARY KEY);
                     CREATE TEMP TABLE IF NOT EXISTS fk_child (
                       parent INTEGER REFERENCES fk_parent(id) DEFERRABLE INITIALLY DEFERRED);
                     INSERT INTO fk_child (parent) VALUES (1);",
                )?;
                meta_put(c, "doomed", "written")?;
                Ok(())
            })
            .expect_err("the COMMIT fails")
    }

    #[test]
    fn a_failed_commit_stops_the_writer_for_good() {
        let dir = tempfile::tempdir().expect("tempdir");
        let store = open(dir.path());
        let (alpha, beta) = (key(1), key(2));
        enrol(&store, &alpha, "alpha");
        enrol(&store, &beta, "beta");
        let kept = push_one(&store, &alpha, 1_000, item("kept", &[(&beta, b"k")]));
        assert_eq!(store.failed(), None);
        let commits = store.commits();

        let err = fail_the_commit(&store);
        assert!(
            matches!(&err, StoreError::NotCommitted { reason } if reason.starts_with("COMMIT failed")),
            "{err}"
        );
        let reason = store.failed().expect("the store reports the failure");
        assert!(reason.starts_with("COMMIT failed"), "{reason}");
        assert_eq!(store.commits(), commits, "nothing committed");

        // Every later write fails at once with a clear error, whatever it is.
        let push = store.push(PushBatch {
            sender_pubkey: alpha.clone(),
            sender_host: "alpha".to_owned(),
            now_ms: 2_000,
            expiry: Expiry::Retention,
            items: vec![item("late", &[(&beta, b"l")])],
        });
        let writes = [
            push.map(drop),
            store.set_heartbeat(2_000),
            store.set_meta("k", "v"),
            store.revoke(&beta, 2_000).map(drop),
            store
                .ack(AckRequest {
                    target_pubkey: beta.clone(),
                    through: 0,
                    epoch: None,
                })
                .map(drop),
        ];
        for w in writes {
            match w {
                Err(e @ StoreError::WriterFailed { .. }) => {
                    let text = e.to_string();
                    assert!(text.contains("COMMIT failed"), "{text}");
                    assert!(text.contains("restart the relay"), "{text}");
                }
                other => panic!("a write after the failure: {other:?}"),
            }
        }
        assert_eq!(store.commits(), commits, "the writer tried nothing more");
        // Reads still see the last committed state, and nothing of the failed group.
        assert_eq!(store.meta("doomed").expect("meta"), None);
        let page = pull_all(&store, &beta);
        assert_eq!(page.items.len(), 1);
        assert_eq!(page.items[0].seq, kept.targets[0].seq);
        assert!(format!("{store:?}").contains("COMMIT failed"));

        // A restart (a new open after recovery) writes again.
        drop(store);
        let store = open(dir.path());
        assert_eq!(store.failed(), None);
        let o = push_one(&store, &alpha, 3_000, item("after", &[(&beta, b"a")]));
        assert_eq!(o.status, ItemStatus::Accepted);
        assert_eq!(store.meta("doomed").expect("meta"), None);
    }

    #[test]
    fn requests_queued_behind_a_failed_commit_are_refused_not_applied() {
        let dir = tempfile::tempdir().expect("tempdir");
        let store = Arc::new(open(dir.path()));
        let (alpha, beta) = (key(1), key(2));
        enrol(&store, &alpha, "alpha");
        enrol(&store, &beta, "beta");
        // Many writers race the failing one: each gets either its committed result (before the
        // failure) or an error (in the failing group, or after it); none is applied afterwards.
        let racers: Vec<_> = (0..16)
            .map(|i| {
                let store = Arc::clone(&store);
                let (alpha, beta) = (alpha.clone(), beta.clone());
                std::thread::spawn(move || {
                    store.push(PushBatch {
                        sender_pubkey: alpha,
                        sender_host: "alpha".to_owned(),
                        now_ms: 1_000,
                        expiry: Expiry::Retention,
                        items: vec![item(&format!("r{i}"), &[(&beta, b"r")])],
                    })
                })
            })
            .collect();
        let err = fail_the_commit(&store);
        assert!(matches!(err, StoreError::NotCommitted { .. }), "{err}");
        let mut ok = 0;
        for r in racers {
            match r.join().expect("join") {
                Ok(out) => {
                    assert_eq!(out.items[0].status, ItemStatus::Accepted);
                    ok += 1;
                }
                Err(StoreError::NotCommitted { .. } | StoreError::WriterFailed { .. }) => {}
                Err(e) => panic!("unexpected error {e}"),
            }
        }
        assert_eq!(
            pull_all(&store, &beta).items.len(),
            ok,
            "exactly the answered ones"
        );
        assert!(matches!(
            store.set_heartbeat(5),
            Err(StoreError::WriterFailed { .. })
        ));
    }

    #[test]
    fn v1_items_never_expire_and_v2_items_expire_after_retention() {
        let dir = tempfile::tempdir().expect("tempdir");
        let store = open(dir.path());
        let (alpha, beta) = (key(1), key(2));
        enrol(&store, &alpha, "alpha");
        enrol(&store, &beta, "beta");
        push_one(&store, &alpha, 1_000, item("v2", &[(&beta, b"x")]));
        store
            .push(PushBatch {
                sender_pubkey: alpha.clone(),
                sender_host: "alpha".to_owned(),
                now_ms: 1_000,
                expiry: Expiry::Never,
                items: vec![item("v1", &[(&beta, b"y")])],
            })
            .expect("push");
        let expiries: Vec<(String, Option<i64>)> = store
            .read(|c| {
                let mut st = c.prepare("SELECT item_id, expires_at FROM items ORDER BY seq")?;
                let rows = st
                    .query_map([], |r| Ok((r.get(0)?, r.get(1)?)))?
                    .collect::<Result<Vec<_>, _>>()?;
                Ok(rows)
            })
            .expect("read");
        assert_eq!(
            expiries,
            [
                ("v2".to_owned(), Some(1_000 + 14 * DAY_MS)),
                ("v1".to_owned(), None)
            ]
        );
    }

    #[test]
    fn a_name_lookup_loads_at_most_the_crowded_threshold_plus_one() {
        let dir = tempfile::tempdir().expect("tempdir");
        let store = open(dir.path());
        for n in 1..=20u8 {
            enrol(&store, &key(n), "MacBook");
        }
        let found = store.live_enrolments_by_name("macbook").expect("by name");
        assert_eq!(found.len(), super::super::MAX_LIVE_BY_NAME);
        // Newest first: the last 17 enrolled.
        let keys: Vec<String> = found.into_iter().map(|e| e.host_pubkey).collect();
        let want: Vec<String> = (4..=20u8).rev().map(key).collect();
        assert_eq!(keys, want);
        // At the bound exactly all are returned.
        let dir = tempfile::tempdir().expect("tempdir");
        let store = open(dir.path());
        for n in 1..=17u8 {
            enrol(&store, &key(n), "pi");
        }
        assert_eq!(
            store.live_enrolments_by_name("PI").expect("by name").len(),
            17
        );
    }
}
