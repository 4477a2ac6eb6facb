//! The writer thread: one write connection, group commit of the waiting requests (module docs
//! "Threads and connections"), the failpoints at the commit boundaries, and the jobs it runs.
//! It never answers a request before the COMMIT that covers it; after a failed COMMIT it takes
//! no more writes.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{mpsc, Arc, OnceLock};

use rusqlite::Connection;

use super::meta::{meta_get, meta_put};
use super::SqliteStore;
use crate::store::{
    OpSigner, StoreError, StoreHealth, StoreLimits, StoreStats, MAX_GROUP_REQUESTS,
};

#[derive(Debug, Default)]
pub(super) struct Counters {
    pub(super) write_requests: AtomicU64,
    pub(super) groups: AtomicU64,
    pub(super) commits: AtomicU64,
    pub(super) queued: AtomicUsize,
}

/// Which failpoints a request arms.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum JobKind {
    Push,
    Ack,
    Other,
}

/// Calls a request's reply callback with `message`. The callback is the caller's code (a push
/// publishes its live frames there), run on the writer thread after the COMMIT: a panic in it
/// is caught and logged, so the writer lives on and the rest of the group still gets its
/// replies (what committed stays committed).
fn answer<T>(
    reply_to: Box<dyn FnOnce(Result<T, StoreError>) + Send>,
    message: Result<T, StoreError>,
) {
    let call = std::panic::AssertUnwindSafe(move || reply_to(message));
    if std::panic::catch_unwind(call).is_err() {
        tracing::error!("a write request's reply callback panicked; the writer goes on");
    }
}

/// A write request as the writer sees it: apply it inside the group transaction, then reply once
/// the group's fate is known.
pub(super) trait WriteJob: Send {
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
        answer(self.reply_to, message);
    }

    fn refuse_stopped(self: Box<Self>) {
        answer(self.reply_to, Err(StoreError::WriterStopped));
    }

    fn refuse(self: Box<Self>, reason: &str) {
        answer(
            self.reply_to,
            Err(StoreError::WriterFailed {
                reason: reason.to_owned(),
            }),
        );
    }
}

/// The writer thread's state. Field order matters: `conn` is dropped before `_lock`, so the
/// write connection is closed before the single-writer lock is released.
pub(super) struct Writer {
    pub(super) conn: Connection,
    pub(super) _lock: Connection,
    pub(super) limits: StoreLimits,
    pub(super) failpoint: fn(&str),
    pub(super) counters: Arc<Counters>,
    /// Set once, when a COMMIT or ROLLBACK failed: from then on every write is refused.
    pub(super) failure: Arc<OnceLock<String>>,
    /// Signs every relay-log receipt this writer appends ([`append_op_apply`]).
    pub(super) signer: Option<Arc<dyn OpSigner>>,
}

thread_local! {
    /// The op-receipt signer of the writer running on this thread: set once by
    /// [`Writer::run`], read by [`append_op_apply`], so every receipt any write request
    /// appends is signed without each request carrying the signer.
    pub(super) static WRITER_OP_SIGNER: std::cell::RefCell<Option<Arc<dyn OpSigner>>> =
        const { std::cell::RefCell::new(None) };
}

impl Writer {
    pub(super) fn run(self, jobs: mpsc::Receiver<Box<dyn WriteJob>>) {
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

impl SqliteStore {
    /// Hand a write to the writer thread and wait until its group committed (or failed).
    pub(super) fn submit<T, F>(&self, kind: JobKind, op: F) -> Result<T, StoreError>
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
    pub(super) fn submit_then<T, F>(
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
}

pub(super) fn is_busy(e: &rusqlite::Error) -> bool {
    matches!(
        e.sqlite_error_code(),
        Some(rusqlite::ErrorCode::DatabaseBusy | rusqlite::ErrorCode::DatabaseLocked)
    )
}

/// Runs one parameterless statement (transaction control) through the statement cache, so the
/// writer does not parse `SAVEPOINT request` and friends again for every request.
pub(super) fn run_cached(c: &Connection, sql: &str) -> Result<(), rusqlite::Error> {
    c.prepare_cached(sql)?.execute([]).map(|_| ())
}

impl StoreHealth for SqliteStore {
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

    fn failed(&self) -> Option<String> {
        self.failure.get().cloned()
    }

    fn writer_stats(&self) -> Option<StoreStats> {
        Some(self.stats())
    }
}
