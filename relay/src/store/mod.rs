//! The relay's durable store (spec §2; `wire.md` §3.2, §3.3).
//!
//! # What it owns
//! Every piece of relay state that must survive a restart: the store's identity (`epoch`,
//! `relay_pubkey`, `schema_version`, `heartbeat` in `meta`), enrolments, enc-key
//! advertisements, sender allowlists, the per-target item queues with their sequence counters,
//! the dedup set, acknowledgement positions and the operations log. The relay core reaches this
//! state only through the [`RelayStore`] trait (spec §2: "The relay core MUST talk to its state
//! only through a RelayStore interface"), so a second backend can replace [`SqliteStore`]
//! without touching the protocol.
//!
//! # The traits
//! [`RelayStore`] is the umbrella the relay holds (`Arc<dyn RelayStore>`): it is exactly four
//! narrow traits, one per concern, each in its own module with its request and outcome types.
//! Every type that implements the four is a `RelayStore` (a blanket impl); a caller that needs
//! one concern may take only that trait.
//! - [`ItemStore`] (`items`): push with dedup and all-or-nothing fan-out, seq allocation,
//!   quotas, pull pages, acks and a host's queue head (spec §3, §4).
//! - [`DirectoryStore`] (`directory`): enrolments and revocation, enc-key advertisements,
//!   sender allowlists, host rotation, the deny list and account bindings (spec §2, §8).
//! - [`OperationsStore`] (`operations`): the epoch and relay key, free-form meta, the signed
//!   operations log and the retention sweep (spec §5, §6, §7).
//! - [`StoreHealth`] (`health`): the heartbeat, a probe through the writer, a writer that
//!   stopped for good, and the writer's counters.
//!
//! The operations that work on a backend's files rather than on an open store — `relay status`
//! and `relay log` read-only beside a running relay, the online backup, and the backend steps of
//! a restore — are the operations concern's second half, [`StoreMaintenance`] with the staged
//! copy [`maintenance::StagedStore`] (`maintenance`). What a restore carries forward
//! (revocations, deny entries, seq floors, rotations, the epoch) is written once against those
//! traits in `ops::restore`, so another backend gets it by implementing them.
//!
//! This module keeps what they share: [`StoreError`], [`OpenOptions`] and [`StoreLimits`], the
//! constants, and the key and hash helpers. [`SqliteStore`] and [`SqliteMaintenance`] (module
//! `sqlite`, split by the same concerns) are the one backend; no SQL lives outside it.
//!
//! # Invariants
//! - **Nothing is answered before it is committed.** Every write goes through one writer thread
//!   that applies waiting requests inside one `BEGIN IMMEDIATE … COMMIT` (group commit, design
//!   README "Decisions already taken"), each request other than a push inside its own
//!   SAVEPOINT (a push checks everything before its first write; one that fails after writing
//!   fails its group), and sends every reply only after that COMMIT succeeded. If the COMMIT
//!   fails, every request of the group gets [`StoreError::NotCommitted`].
//! - **An item is all-or-nothing over its targets** (spec §3): every target is validated before
//!   anything of the item remains, and a rejected item leaves no row, no seq and no dedup entry.
//! - **Sequence numbers never restart and are never reused** (spec §2): a new seq is
//!   `max(next_seq, now_ms)`.
//! - **Wire bytes are stored byte for byte**, and `wire_hash` is computed here (lowercase hex
//!   SHA-256 of those bytes); it is never taken from a caller.
//! - **One process writes a store**: `relay.lock` is held for the store's whole life.
//! - A newer schema is refused; an older one is migrated in one transaction that keeps the epoch.
//!
//! # What it must never do
//! - Depend on the protocol crate, parse envelopes, or verify signatures: the HTTP handlers
//!   validate items (hop signature, envelope shape, sizes, ids) before calling the store. The
//!   store only re-checks what would corrupt its own state (a repeated target, an empty target
//!   list).
//! - See or print private key material. It deals in public keys (base64 text) only, and its
//!   errors name at most a public key's fingerprint.
//! - Block the async runtime: every method here is **blocking** (SQLite I/O, and for writes the
//!   wait for the group commit's fsync). Async callers share an `Arc<dyn RelayStore>` and call it
//!   inside `tokio::task::spawn_blocking`:
//!
//! ```ignore
//! let store: Arc<dyn RelayStore> = Arc::new(SqliteStore::open(&dir, &relay_pubkey, now_ms)?);
//! let s = store.clone();
//! let outcome = tokio::task::spawn_blocking(move || s.push(batch)).await??;
//! ```
//!
//! # Units
//! Times are Unix milliseconds (`i64`, `*_ms`); sizes are bytes; sequence numbers are `i64` and
//! ms-scale (`wire.md` Decisions 5). Keys are the standard-base64 text the wire carries (host
//! keys: 44 characters with padding, the one canonical form: [`DirectoryStore::enrol`] refuses any
//! other text, see [`is_canonical_key`], so a key never has two rows). ISO timestamps are the caller's business.

mod directory;
mod health;
mod items;
pub mod maintenance;
mod operations;
mod sqlite;

pub use directory::{
    AccountBinding, AuthorityStrength, DenyEntry, DenyKind, DenyOutcome, DirectoryStore, EncAd,
    EncAdV1, EncAdV2, EnrolOutcome, EnrolRequest, Enrolment, RevokeOutcome, RotateOutcome,
    RotateRequest, SenderList, SenderListOutcome, MAX_DENY_ENTRIES, MAX_LIVE_BY_NAME, MAX_PER_NAME,
};
pub use health::{StoreHealth, StoreStats};
pub use items::{
    AckOutcome, AckRequest, AckResult, Expiry, HostQueueInfo, ItemOutcome, ItemStatus, ItemStore,
    PullPage, PullRequest, PulledItem, PushBatch, PushItem, PushOutcome, PushReply, PushTarget,
    QuotaKind, Rejection, TargetAccept,
};
pub use operations::{
    sign_op_receipt, EpochRotation, ExpiryFacts, NoticeSigner, NoticesCommitted, OpEntry, OpRecord,
    OpSigner, OperationsStore, StoredNotice, SweepReport, DEDUP_GRACE_DAYS, OP_SWEEP, SWEEP_BATCH,
    SWEEP_MAX_BATCHES, SWEEP_MAX_PRUNE,
};

#[cfg(test)]
pub(crate) use sqlite::backup::raw;
#[cfg(test)]
pub(crate) use sqlite::schema::assert_usage_matches;
pub(crate) use sqlite::schema::stored_version;
pub use sqlite::schema::SCHEMA_VERSION;
pub(crate) use sqlite::schema::{migrate, rebuild_usage, MIGRATIONS};
pub(crate) use sqlite::{append_op_signed, replay_rotation, ROTATION_META_PREFIX};
pub use sqlite::{prepare_store_dir, SqliteError, SqliteStore, StoreLock};
pub use {maintenance::StoreMaintenance, sqlite::maintenance::SqliteMaintenance};

use std::path::PathBuf;

/// File name of the store database inside the store directory (design README "Files").
pub const DB_FILE: &str = "relay.db";

/// File name of the single-writer lock inside the store directory (`wire.md` §3.4).
pub const LOCK_FILE: &str = "relay.lock";

/// How long [`SqliteStore::open`] waits for another process to release `relay.lock` by default:
/// 60 s, so a supervisor restarting the relay rides out the old process's shutdown (`wire.md`
/// §3.4).
pub const DEFAULT_LOCK_WAIT_MS: u64 = 60_000;

/// The most requests one group commit takes. Bounds the latency a request can add to the others
/// in its group and the size of one transaction; under load a group of 64 small pushes still
/// costs one fsync.
pub const MAX_GROUP_REQUESTS: usize = 64;

/// The most items one pull page returns (`wire.md` §3.2: `n = clamp(limit, 1, 500)`).
pub const MAX_PULL_ITEMS: i64 = 500;

/// The operations log keeps this many receipts (`wire.md` §3.3) other than `relay-sweep`
/// receipts, which have their own cap ([`SWEEP_OPS_KEEP`]) so that up to 144 sweeps a day
/// never push restores, revocations or backups out of the log.
pub const OPS_KEEP: i64 = 1_000;

/// The operations log keeps this many of the newest `relay-sweep` receipts ([`OP_SWEEP`]),
/// besides the [`OPS_KEEP`] others: the whole log holds at most `OPS_KEEP + SWEEP_OPS_KEEP`.
pub const SWEEP_OPS_KEEP: i64 = 100;

/// One day in milliseconds (retention arithmetic).
pub const DAY_MS: i64 = 86_400_000;

/// Errors of the store. A caller branches on the variant; the Display text is for operators and
/// never contains key material.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum StoreError {
    /// `relay.db` was written by a newer agentmbx (spec §2: "A store MUST refuse to open when
    /// schema_version is newer than the binary").
    #[error("relay.db has schema version {found}, this agentmbx supports up to {supported}: upgrade agentmbx")]
    SchemaTooNew {
        /// The version recorded in the store.
        found: u32,
        /// The newest version this binary knows ([`SCHEMA_VERSION`]).
        supported: u32,
    },
    /// The store is bound to another relay key (spec §1: "a store MUST refuse a key that is not
    /// its own"). Only public-key fingerprints are named.
    #[error("this relay store belongs to another relay key (fingerprint {stored_fingerprint}), not to the key given (fingerprint {given_fingerprint}): keep relay.key with its store")]
    OtherRelayKey {
        /// Fingerprint of the relay public key recorded in the store.
        stored_fingerprint: String,
        /// Fingerprint of the relay public key the caller opened it with.
        given_fingerprint: String,
    },
    /// `relay.lock` was missing and the store's heartbeat is less than 90 s from now: a relay
    /// may be running on it without the lock (`wire.md` §3.4); nothing was opened.
    #[error("RELAY_RUNNING: a relay wrote a heartbeat {age_s} s ago to {} and the store had no relay.lock (a relay may still be running on it): stop it and retry after 90 s", path.display())]
    LiveHeartbeat {
        /// The store's `relay.db`.
        path: PathBuf,
        /// The heartbeat's age in seconds (negative: in the future).
        age_s: i64,
    },
    /// Another process (or another open store in this process) holds `relay.lock`; the text
    /// names the holder its lock file records (pid, since when) and how long this open waited.
    #[error("{}", locked_text(path, holder.as_ref(), *waited_ms))]
    Locked {
        /// Path of the lock file.
        path: PathBuf,
        /// The holder `relay.lock` records, when it could be read.
        holder: Option<LockHolder>,
        /// How long this open waited for the lock before giving up (ms; 0: it did not wait).
        waited_ms: u64,
    },
    /// A file-system operation on the store directory failed.
    #[error("relay store I/O error at {}: {source}", path.display())]
    Io {
        /// The path involved.
        path: PathBuf,
        /// The underlying error.
        #[source]
        source: std::io::Error,
    },
    /// SQLite reported an error for this request ([`SqliteError`], the SQLite backend's error
    /// type; only that backend produces this variant).
    #[error("relay store database error: {0}")]
    Sqlite(#[from] SqliteError),
    /// The group transaction this request was part of did not commit (an earlier failure left
    /// the transaction unusable and it was rolled back, or the COMMIT itself failed — then the
    /// store stops taking writes, see [`StoreError::WriterFailed`], and recovery at the next
    /// start decides whether it is durable). Retrying is safe: pushes are deduplicated.
    #[error("relay store transaction did not commit: {reason}")]
    NotCommitted {
        /// What went wrong, for the log.
        reason: String,
    },
    /// The stored data violates an invariant (a missing epoch, an unparseable meta value, an
    /// exhausted sequence space).
    #[error("relay store is inconsistent: {0}")]
    Corrupt(String),
    /// The request itself is invalid for the store (a negative ack position, a reserved meta
    /// key, an empty relay key). Handlers validate input first, so this signals a caller bug.
    #[error("invalid relay store request: {0}")]
    InvalidInput(String),
    /// The writer thread is gone (the store is closing, or it panicked).
    #[error("the relay store writer has stopped")]
    WriterStopped,
    /// An earlier COMMIT or ROLLBACK failed, so the store takes no more writes: what is on
    /// disk may differ from what this process saw. Restart the relay (SQLite recovery then
    /// decides what is durable).
    #[error(
        "the relay store takes no more writes after a failed commit ({reason}): restart the relay"
    )]
    WriterFailed {
        /// The failure that stopped the writer.
        reason: String,
    },
}

/// The process holding `relay.lock`, as the lock file's holder row records it (`wire.md` §3.4).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LockHolder {
    /// Its process id.
    pub pid: u32,
    /// When it took the lock (Unix ms, its clock).
    pub since_ms: i64,
}

impl std::fmt::Display for LockHolder {
    /// `pid 1234, since 2026-01-01T00:00:00.000Z`.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "pid {}, since {}", self.pid, iso_utc(self.since_ms))
    }
}

/// The text of [`StoreError::Locked`].
fn locked_text(path: &std::path::Path, holder: Option<&LockHolder>, waited_ms: u64) -> String {
    let who = match holder {
        Some(h) => format!("another relay process ({h})"),
        None => "another relay process".to_owned(),
    };
    let mut text = format!("{who} holds {}", path.display());
    if waited_ms > 0 {
        text.push_str(&format!(
            "; gave up after waiting {}: stop that process first, or give each relay its own \
             store directory",
            duration_text(waited_ms)
        ));
    }
    text
}

/// `60 s` for whole seconds, `250 ms` otherwise.
pub(crate) fn duration_text(ms: u64) -> String {
    if ms.is_multiple_of(1_000) {
        format!("{} s", ms / 1_000)
    } else {
        format!("{ms} ms")
    }
}

/// Unix ms as `YYYY-MM-DDTHH:MM:SS.mmmZ` (UTC, proleptic Gregorian), for operator messages.
/// The store does not depend on the protocol crate, whose `time` module does the same.
pub(crate) fn iso_utc(ms: i64) -> String {
    let (days, ms_of_day) = (ms.div_euclid(DAY_MS), ms.rem_euclid(DAY_MS));
    // Days since 1970-01-01 to a civil date (Howard Hinnant's algorithm).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1_460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    let (h, m, s, milli) = (
        ms_of_day / 3_600_000,
        ms_of_day / 60_000 % 60,
        ms_of_day / 1_000 % 60,
        ms_of_day % 1_000,
    );
    format!("{year:04}-{month:02}-{day:02}T{h:02}:{m:02}:{s:02}.{milli:03}Z")
}

/// Options for [`SqliteStore::open_with`].
#[derive(Debug, Clone)]
pub struct OpenOptions {
    /// How long to wait for `relay.lock` held by another process, in ms. 0 fails at once (tests,
    /// offline operations that must not wait). Default [`DEFAULT_LOCK_WAIT_MS`].
    pub lock_wait_ms: u64,
    /// Called by the writer at the named crash boundaries of a group commit: `push:before-commit`
    /// and `ack:before-commit` (requests applied, COMMIT not yet run), `push:after-commit` and
    /// `ack:after-commit` (committed, replies not yet sent). Each name is hit once per group that
    /// contains at least one request of that kind. The relay passes
    /// `agentmbx_protocol::failpoint::hit`; the default does nothing. Design README
    /// "Failpoints".
    pub failpoint: fn(&str),
    /// Quotas and retention. Default [`StoreLimits::default`].
    pub limits: StoreLimits,
}

impl Default for OpenOptions {
    fn default() -> Self {
        Self {
            lock_wait_ms: DEFAULT_LOCK_WAIT_MS,
            failpoint: no_failpoint,
            limits: StoreLimits::default(),
        }
    }
}

/// The default failpoint hook: does nothing.
pub fn no_failpoint(_name: &str) {}

/// Quotas, retention and capacity the store enforces (spec §7, `wire.md` §3.2 "Quotas"). The
/// defaults are the owner's decisions; a bench or a test may raise or lower them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoreLimits {
    /// Items queued per target host key. Default 10,000 (spec §7, decision 3).
    pub max_queue_items: u64,
    /// Bytes queued per target host key. Default 52,428,800 (50 MiB, `wire.md` "Units").
    pub max_queue_bytes: u64,
    /// Items one sender may have queued for one target. Default 2,000 (spec §7).
    pub max_sender_items: u64,
    /// Bytes one sender may have queued for one target. Default 20,971,520 (20 MiB).
    pub max_sender_bytes: u64,
    /// Items queued across the hosts of one proven account. Default 10,000 (spec §7). Hosts
    /// without a proven account are never charged here.
    pub max_owner_items: u64,
    /// Bytes queued across the hosts of one proven account. Default 52,428,800.
    pub max_owner_bytes: u64,
    /// Days an item stays queued: `expires_at = accepted_at + retention_days · 86,400,000`.
    /// Default 14 (decision 3).
    pub retention_days: u32,
    /// Live (not revoked) enrolments at most; a known key may still re-enrol at capacity.
    /// Default 100,000 (`wire.md` §3.2 "Enrolment").
    pub max_live_enrolments: u64,
}

impl Default for StoreLimits {
    fn default() -> Self {
        Self {
            max_queue_items: 10_000,
            max_queue_bytes: 52_428_800,
            max_sender_items: 2_000,
            max_sender_bytes: 20_971_520,
            max_owner_items: 10_000,
            max_owner_bytes: 52_428_800,
            retention_days: 14,
            max_live_enrolments: 100_000,
        }
    }
}

/// Whether `text` is a host key in its one canonical form: standard base64 **with padding** of
/// exactly 32 bytes (what `PublicKey::to_b64` produces). The store keys every row by this text,
/// so an alias (unpadded, or with non-zero trailing bits) would be a second identity for the
/// same key; the handlers canonicalise first, and the store refuses anything else.
pub fn is_canonical_key(text: &str) -> bool {
    use base64::Engine as _;
    let engine = &base64::engine::general_purpose::STANDARD;
    matches!(engine.decode(text), Ok(raw) if raw.len() == 32 && engine.encode(&raw) == text)
}

/// Lowercase hex SHA-256 of wire bytes (spec §2: "never of a decoded or re-encoded string").
pub fn wire_hash(wire: &[u8]) -> String {
    use sha2::{Digest, Sha256};
    hex::encode(Sha256::digest(wire))
}

/// The display fingerprint of a public key: the first 16 hex digits of SHA-256 over the raw key
/// bytes, grouped `xxxx-xxxx-xxxx-xxxx`. Text that is not standard base64 gets a placeholder
/// instead (never the text itself).
fn key_fingerprint(pubkey_b64: &str) -> String {
    use base64::Engine as _;
    use sha2::{Digest, Sha256};
    match base64::engine::general_purpose::STANDARD.decode(pubkey_b64.trim()) {
        Ok(raw) => {
            let h = hex::encode(Sha256::digest(&raw));
            let h = h.get(..16).unwrap_or("");
            let groups: Vec<&str> = (0..4).filter_map(|i| h.get(i * 4..i * 4 + 4)).collect();
            groups.join("-")
        }
        Err(_) => "unreadable key".to_owned(),
    }
}

/// The relay's state, as the relay core sees it (spec §2). Implementations are shared across
/// threads (`Arc<dyn RelayStore>`).
///
/// **Every method blocks** (disk I/O; writes also wait for their group commit). Async callers
/// must call it inside `tokio::task::spawn_blocking`. Writes return only after their
/// transaction committed, so a handler may answer as soon as a write returns `Ok`.
///
/// Methods that return an outcome enum report domain refusals (revoked, stale, beyond head,
/// rejected items) as `Ok(outcome)`; `Err(StoreError)` always means the store failed and the
/// request may be retried.
///
/// It is the four narrow traits together: [`ItemStore`], [`DirectoryStore`],
/// [`OperationsStore`] and [`StoreHealth`]. Every type that implements them is a `RelayStore`
/// (a blanket impl), so a backend implements the four and nothing else, and a caller that needs
/// one concern may take only that trait.
pub trait RelayStore: ItemStore + DirectoryStore + OperationsStore + StoreHealth {}

impl<T: ItemStore + DirectoryStore + OperationsStore + StoreHealth + ?Sized> RelayStore for T {}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fingerprint_is_grouped_and_never_echoes_bad_input() {
        // 32 zero bytes
        let fp = key_fingerprint("AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA=");
        // sha256 of 32 zero bytes starts 66687aadf862bd77
        assert_eq!(fp, "6668-7aad-f862-bd77");
        assert_eq!(key_fingerprint("not base64 !!"), "unreadable key");
    }

    #[test]
    fn only_the_padded_32_byte_form_is_a_canonical_key() {
        let padded = "AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA=";
        assert!(is_canonical_key(padded));
        assert!(!is_canonical_key(padded.trim_end_matches('=')), "unpadded");
        // Non-zero trailing bits decode to the same bytes in a lenient decoder.
        assert!(!is_canonical_key(
            "AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAB="
        ));
        assert!(!is_canonical_key(
            " AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA="
        ));
        assert!(
            !is_canonical_key("AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA=="),
            "31 bytes"
        );
        assert!(!is_canonical_key(""));
    }

    #[test]
    fn wire_hash_is_lowercase_hex_sha256() {
        assert_eq!(
            wire_hash(b"abc"),
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
        );
    }
}
