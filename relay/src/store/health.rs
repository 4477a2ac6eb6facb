//! Health: the [`StoreHealth`] trait — heartbeat, a probe through the writer, a writer that
//! stopped for good, and the writer's counters ([`StoreStats`]). Backend-neutral: no SQL here.

use super::StoreError;

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

/// Whether the store is alive and writing: the heartbeat (`wire.md` §3.4), a probe through the
/// writer, a writer that stopped for good, and the writer's counters. Blocking, like every
/// store trait (see [`RelayStore`](crate::store::RelayStore)).
pub trait StoreHealth: Send + Sync + std::fmt::Debug {
    /// The last heartbeat written, in ms; `None` on a store that never had one (spec §5).
    fn heartbeat(&self) -> Result<Option<i64>, StoreError>;

    /// Record that the relay is alive (every 30 s, spec §5).
    fn set_heartbeat(&self, now_ms: i64) -> Result<(), StoreError>;

    /// Proves that writes still go through: a request that changes nothing, answered once the
    /// store's writer took it (the service watchdog's check, [`crate::watchdog`]). Every backend
    /// says what proves this for it (no default: a read alone proves nothing about writes).
    /// Errors: the writer stopped or failed ([`StoreError::WriterFailed`]), storage errors.
    fn writer_answers(&self) -> Result<(), StoreError>;

    /// Why the store stopped taking writes for good, if it did: a COMMIT (or the ROLLBACK after
    /// a failure) failed, so what is durable on disk may differ from what this process saw.
    /// Every later write fails with [`StoreError::WriterFailed`]; the relay must exit (non-zero)
    /// and be restarted, so SQLite's recovery decides what is durable. `None` while healthy.
    fn failed(&self) -> Option<String> {
        None
    }

    /// The group-commit writer's counters ([`StoreStats`]: write requests, groups, commits,
    /// queued), counted since the store was opened; `None` for a store without such a writer.
    /// `GET /v2/relay/admin/stats` serves them.
    fn writer_stats(&self) -> Option<StoreStats> {
        None
    }
}
