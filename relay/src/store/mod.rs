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
//! keys: 44 characters with padding, the one canonical form: [`RelayStore::enrol`] refuses any
//! other text, see [`is_canonical_key`], so a key never has two rows). ISO timestamps are the caller's business.

mod sqlite;

#[cfg(test)]
pub(crate) use sqlite::schema::assert_usage_matches;
pub(crate) use sqlite::schema::stored_version;
pub use sqlite::schema::SCHEMA_VERSION;
pub(crate) use sqlite::schema::{migrate, rebuild_usage, MIGRATIONS};
pub(crate) use sqlite::{append_op_signed, replay_rotation, ROTATION_META_PREFIX};
pub use sqlite::{prepare_store_dir, SqliteStore, StoreLock, StoreStats};

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
    /// SQLite reported an error for this request.
    #[error("relay store database error: {0}")]
    Sqlite(#[from] rusqlite::Error),
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

/// Old and new epoch after [`RelayStore::rotate_epoch`] (spec §5).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EpochRotation {
    /// The epoch before the rotation.
    pub from: String,
    /// The new random epoch (UUID v4 text).
    pub to: String,
}

/// Strength of the enrolment authority that admitted a host (spec §2, §8). A weaker authority
/// never overwrites the `account`/`authorized_by` a stronger one recorded.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
#[non_exhaustive]
pub enum AuthorityStrength {
    /// The default self-hosted authority: the host proved only that it holds its key.
    HostKeyChallenge,
    /// An authority that proved an account (hosted relay: account-issued, host-bound tokens).
    Account,
}

impl AuthorityStrength {
    /// The rank stored in `enrolments.authority_rank`; higher is stronger.
    pub fn rank(self) -> i64 {
        match self {
            Self::HostKeyChallenge => 0,
            Self::Account => 10,
        }
    }

    /// The strength for a stored rank, `None` for a rank this binary does not know.
    pub fn from_rank(rank: i64) -> Option<Self> {
        match rank {
            0 => Some(Self::HostKeyChallenge),
            10 => Some(Self::Account),
            _ => None,
        }
    }
}

/// An enrolment request, already authorised by the handler's `EnrolmentAuthority` (spec §8).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EnrolRequest {
    /// The host key (standard base64 of the 32-byte Ed25519 key).
    pub host_pubkey: String,
    /// The host's name, a label (matched case-insensitively).
    pub host_name: String,
    /// The host's own unproven owner claim ("" when none); decides nothing.
    pub owner_fp: String,
    /// The account the authority proved, if any. Names are unique per account.
    pub account: Option<String>,
    /// Which authority admitted the host (e.g. `host-key-challenge`).
    pub authorized_by: String,
    /// How strong that authority is.
    pub strength: AuthorityStrength,
    /// Now, in ms.
    pub now_ms: i64,
}

/// A stored enrolment (`enrolments` row).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Enrolment {
    /// The host key.
    pub host_pubkey: String,
    /// The host's name as last enrolled.
    pub host_name: String,
    /// The host's unproven owner claim.
    pub owner_fp: String,
    /// The proven account, if any.
    pub account: Option<String>,
    /// The authority that recorded `account`.
    pub authorized_by: String,
    /// That authority's strength.
    pub strength: AuthorityStrength,
    /// When the key last (re-)enrolled, in ms.
    pub enrolled_at_ms: i64,
    /// When the key was revoked, in ms; `None` while live.
    pub revoked_at_ms: Option<i64>,
}

impl Enrolment {
    /// Whether the key is revoked (revoked keys stay revoked, spec §2).
    pub fn is_revoked(&self) -> bool {
        self.revoked_at_ms.is_some()
    }
}

/// The result of [`RelayStore::enrol`] (`wire.md` §3.1 enrol errors).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum EnrolOutcome {
    /// Enrolled or refreshed; the stored row after the write.
    Enrolled(Enrolment),
    /// The key is revoked on this relay and stays revoked (403 REVOKED).
    Revoked,
    /// Another live key carries this name (case-insensitively) in the same proven account
    /// (409 NAME_TAKEN).
    NameTaken,
    /// The live-enrolment cap is reached and the key is new (503 FULL).
    Full,
    /// The account binding names a cloud key already bound to another live host key (409
    /// CLOUD_KEY_TAKEN; [`RelayStore::enrol_bound`]).
    CloudKeyTaken,
}

/// The result of [`RelayStore::revoke`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RevokeOutcome {
    /// The key was live and is now revoked.
    Revoked,
    /// The key was already revoked; its original `revoked_at` is kept.
    AlreadyRevoked,
    /// The key was never enrolled here; nothing was written.
    Unknown,
}

/// A v1 enc-key advertisement (`wire.md` §2.8): `sig` is the host key's signature over
/// canonical(`{v:1, host, enc_pub}`), stored in `enc_ads`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EncAdV1 {
    /// The advertising host's key.
    pub host_pubkey: String,
    /// The host name the signature covers.
    pub host_name: String,
    /// The X25519 public key (base64).
    pub enc_pub: String,
    /// The v1 signature.
    pub sig: String,
    /// When the relay stored it, in ms.
    pub at_ms: i64,
}

/// A v2 enc-key advertisement (`wire.md` §2.8, T168), stored in `enc_ad_records`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EncAdV2 {
    /// The advertising host's key.
    pub host_pubkey: String,
    /// The `enc_pub` inside the record (the handler extracted it after verifying the record).
    pub enc_pub: String,
    /// The record as received, canonical JSON text; served back byte for byte.
    pub record: String,
    /// The host key's signature over `record`.
    pub sig: String,
    /// When the relay stored it, in ms.
    pub at_ms: i64,
}

/// What the relay serves for a host's enc key (`wire.md` §2.8, "Resolved details" enc-key
/// endpoints): the v2 record when there is one, the v1 ad when it names the same key (or there is
/// no v2 record). `enc_pub` always equals the v2 record's `enc_pub` when a record is served.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EncAd {
    /// The host key.
    pub host_pubkey: String,
    /// The host's enrolled name.
    pub host_name: String,
    /// The key served.
    pub enc_pub: String,
    /// The v1 advertisement, if served.
    pub v1: Option<EncAdV1>,
    /// The v2 record, if any.
    pub v2: Option<EncAdV2>,
}

/// When pushed items expire.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Expiry {
    /// `expires_at = accepted_at + retention_days` (spec §6). Every v2 push.
    #[default]
    Retention,
    /// Never (items pushed through the v1 endpoints, `wire.md` §3.2 "Sweep").
    Never,
}

/// One target of a pushed item: the exact wire bytes sealed for that host (spec §3).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PushTarget {
    /// The target host key.
    pub target_pubkey: String,
    /// The exact bytes to store (decoded from `wire_b64`).
    pub wire: Vec<u8>,
}

/// One pushed item, validated by the handler (id, kind, size, wire shape).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PushItem {
    /// `envelope`, `receipt` or `expired`.
    pub kind: String,
    /// The item id (the dedup key together with sender and target).
    pub item_id: String,
    /// One entry per target host, in the order the sender gave them.
    pub targets: Vec<PushTarget>,
}

/// One push request from one authenticated sender (`POST /v2/relay/items`, spec §3).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PushBatch {
    /// The hop-authenticated sender's host key.
    pub sender_pubkey: String,
    /// The sender's host name (stored as `items.sender_host`; v1 pulls show it).
    pub sender_host: String,
    /// Now, in ms: the acceptance time and the sequence floor.
    pub now_ms: i64,
    /// Whether the items expire.
    pub expiry: Expiry,
    /// The items, applied in order; later items see earlier ones.
    pub items: Vec<PushItem>,
}

/// The reply of [`RelayStore::push_then`].
pub type PushReply = Box<dyn FnOnce(Result<PushOutcome, StoreError>) + Send>;

/// Which quota refused an item (spec §7, `wire.md` §3.2 "Quotas").
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QuotaKind {
    /// Items queued for the target.
    QueueDepth,
    /// Bytes queued for the target.
    QueueBytes,
    /// This sender's items or bytes queued for the target.
    SenderShare,
    /// Items queued across the target's proven account.
    OwnerQueueDepth,
    /// Bytes queued across the target's proven account.
    OwnerQueueBytes,
}

/// Why the store rejected an item. Nothing of a rejected item is stored.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Rejection {
    /// The item has no targets (`bad targets`).
    BadTargets,
    /// A target is not enrolled or is revoked (`target not enrolled`).
    TargetNotEnrolled,
    /// A target's allowlist does not name the sender (`sender not accepted by target`).
    SenderNotAccepted,
    /// The same target appears twice (`duplicate target`).
    DuplicateTarget,
    /// The same (sender, item id, target) was stored with other bytes (`conflict`).
    Conflict,
    /// A quota would be exceeded (`quota:<which> exceeded for <host>`).
    Quota {
        /// Which quota.
        kind: QuotaKind,
        /// The target's enrolled name, for the message.
        host: String,
    },
}

impl Rejection {
    /// The code after `rejected:` on the wire (`wire.md` §3.2 rejection strings), e.g.
    /// `quota:queue depth exceeded for beta`.
    pub fn code(&self) -> String {
        match self {
            Self::BadTargets => "bad targets".to_owned(),
            Self::TargetNotEnrolled => "target not enrolled".to_owned(),
            Self::SenderNotAccepted => "sender not accepted by target".to_owned(),
            Self::DuplicateTarget => "duplicate target".to_owned(),
            Self::Conflict => "conflict".to_owned(),
            Self::Quota { kind, host } => {
                let what = match kind {
                    QuotaKind::QueueDepth => "queue depth",
                    QuotaKind::QueueBytes => "queue bytes",
                    QuotaKind::SenderShare => "sender share",
                    QuotaKind::OwnerQueueDepth => "owner queue depth",
                    QuotaKind::OwnerQueueBytes => "owner queue bytes",
                };
                format!("quota:{what} exceeded for {host}")
            }
        }
    }
}

/// The status of one pushed item (spec §3 "Response").
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ItemStatus {
    /// At least one target was stored fresh.
    Accepted,
    /// Every target was already stored with the same bytes.
    Duplicate,
    /// Refused as a whole; nothing stored.
    Rejected(Rejection),
}

impl ItemStatus {
    /// The wire text: `accepted`, `duplicate` or `rejected:<code>`.
    pub fn wire(&self) -> String {
        match self {
            Self::Accepted => "accepted".to_owned(),
            Self::Duplicate => "duplicate".to_owned(),
            Self::Rejected(r) => format!("rejected:{}", r.code()),
        }
    }
}

/// One target of an accepted or duplicate item: what the accept receipt signs (spec §3).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TargetAccept {
    /// The target host key.
    pub target_pubkey: String,
    /// The item's seq in that target's queue (the original one for a duplicate).
    pub seq: i64,
    /// Lowercase hex SHA-256 of the stored wire bytes.
    pub wire_hash: String,
}

/// The store's verdict on one pushed item.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ItemOutcome {
    /// The item id, as pushed.
    pub item_id: String,
    /// Accepted, duplicate or rejected.
    pub status: ItemStatus,
    /// The accept time for the receipt's `at`, in ms: now if any target was fresh, else the
    /// earliest original `accepted_at` (so retries never move the sender's deadline). `None`
    /// when rejected.
    pub at_ms: Option<i64>,
    /// Per target, in push order; empty when rejected.
    pub targets: Vec<TargetAccept>,
}

/// The result of [`RelayStore::push`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PushOutcome {
    /// The epoch the items were committed under (read in the same transaction), for the accept
    /// receipts.
    pub epoch: String,
    /// One outcome per pushed item, in order.
    pub items: Vec<ItemOutcome>,
}

/// A pull request (`GET /v2/relay/items`, spec §4).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PullRequest {
    /// The authenticated caller's host key (its own queue).
    pub target_pubkey: String,
    /// Return items with `seq > after` (negative is read as 0).
    pub after: i64,
    /// Page size, clamped to `1..=`[`MAX_PULL_ITEMS`].
    pub limit: i64,
    /// Byte budget over the page's wire bytes; the page stops before exceeding it but always
    /// holds at least one item when one exists (`wire.md` "Pull byte budget").
    pub max_bytes: u64,
}

/// One pulled item.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PulledItem {
    /// Its seq in the caller's queue.
    pub seq: i64,
    /// `envelope`, `receipt` or `expired`.
    pub kind: String,
    /// The item id.
    pub item_id: String,
    /// The sender's host key.
    pub sender_pubkey: String,
    /// The sender's host name (v1 pulls show it).
    pub sender_host: String,
    /// The exact stored bytes.
    pub wire: Vec<u8>,
}

/// One pull page (spec §4), read from one snapshot.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PullPage {
    /// The current epoch.
    pub epoch: String,
    /// The last seq allocated for the caller (`next_seq − 1`, 0 if none).
    pub head_seq: i64,
    /// The page, in seq order.
    pub items: Vec<PulledItem>,
    /// The seq of the last item returned, or `after` when the page is empty.
    pub last_seq: i64,
    /// Whether more items follow this page.
    pub more: bool,
}

/// An acknowledgement (`POST /v2/relay/ack`, spec §4).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AckRequest {
    /// The authenticated caller's host key.
    pub target_pubkey: String,
    /// Delete items with `seq <= through`; outside `[0, head_seq]` the answer is
    /// [`AckResult::OutOfRange`] (any i64 is a valid request).
    pub through: i64,
    /// When set, the ack applies only if this is still the current epoch (checked in the same
    /// transaction), else [`AckResult::StaleEpoch`].
    pub epoch: Option<String>,
}

/// A successful acknowledgement.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AckOutcome {
    /// `max(previous acked_through, through)`: it never decreases.
    pub acked_through: i64,
    /// How many items were deleted.
    pub deleted: u64,
    /// The last seq allocated for the caller.
    pub head_seq: i64,
    /// The epoch the ack was committed under.
    pub epoch: String,
}

/// The result of [`RelayStore::ack`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AckResult {
    /// Done.
    Acked(AckOutcome),
    /// `through` is outside `[0, head_seq]` (negative, or past the last allocated seq):
    /// nothing changed (400 BAD_ACK; the receiver treats it as an epoch change, spec §4,
    /// `wire.md` §3.2 "Ack").
    OutOfRange {
        /// The last allocated seq.
        head_seq: i64,
        /// The current epoch.
        epoch: String,
    },
    /// The request named an epoch that is not current: nothing changed (409 EPOCH).
    StaleEpoch {
        /// The current epoch.
        epoch: String,
        /// The last allocated seq.
        head_seq: i64,
    },
}

/// A host's queue position (`info` `you`, spec §1).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HostQueueInfo {
    /// The last seq allocated for the host (0 if none).
    pub head_seq: i64,
    /// The highest seq the host acknowledged (0 if none).
    pub acked_through: i64,
}

/// A target's signed sender allowlist (spec §2 "Sender allowlist", `wire.md` §2.12), verified by
/// the handler.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SenderList {
    /// The target host key that signed it.
    pub target_pubkey: String,
    /// The sender keys it accepts (duplicates are dropped on store, order kept).
    pub senders: Vec<String>,
    /// The list's `iat`, in ms (the handler parses the ISO text).
    pub iat_ms: i64,
    /// The signed record, canonical JSON text.
    pub record: String,
    /// The target's signature over `record`.
    pub sig: String,
}

/// The result of [`RelayStore::put_sender_list`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SenderListOutcome {
    /// Stored; it replaces any older list.
    Stored,
    /// A list with the same or a newer `iat` is stored; nothing changed (409 STALE).
    Stale,
}

/// A host rotation whose record the handler verified (spec §2 "Rotation"; `wire.md` §2.10,
/// §3.2): both keys signed it and it starts from `old_pubkey`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RotateRequest {
    /// The retired host key (canonical text).
    pub old_pubkey: String,
    /// The new host key (canonical text).
    pub new_pubkey: String,
    /// The record's `host`; must be the old enrolment's name (case-insensitively).
    pub host_name: String,
    /// Now, in ms: the revocation time and the seq floor of the moved items.
    pub now_ms: i64,
}

/// The result of [`RelayStore::rotate`] (`wire.md` §3.1 rotate errors).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RotateOutcome {
    /// Applied: `moved` queued items now wait for the new key.
    Rotated {
        /// Items moved to the new key's queue.
        moved: u64,
    },
    /// This very rotation (old → new) was applied before: nothing changed (answered like a
    /// success, so a host repeating it stops).
    AlreadyRotated,
    /// The old key is unknown here, or revoked other than by a rotation to this new key
    /// (404 NOT_ENROLLED).
    NotEnrolled,
    /// The record names another host than the old enrolment (400 BAD_ROTATION).
    OtherHost,
    /// The new key is revoked on this relay (409 ROTATION_TARGET).
    TargetRevoked,
    /// The account the new key would carry already has another live host of this name
    /// (409 ROTATION_TARGET).
    TargetNameTaken,
}

// ---- Deny-list and account bindings (spec §8 "Revocation"; authority/) ----------------------

/// Most deny-list entries a store keeps (expired ones are pruned first): an operator list, but
/// every table is bounded.
pub const MAX_DENY_ENTRIES: u64 = 100_000;

/// What a deny-list entry is keyed by (spec §8: "keyed by host_fp and client_id").
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum DenyKind {
    /// A host key's fingerprint `xxxx-xxxx-xxxx-xxxx` (`wire.md` §2.1).
    Host,
    /// An account token's `client_id` claim.
    Client,
}

impl DenyKind {
    /// The text stored in `deny.kind` and shown to operators: `host` or `client`.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Host => "host",
            Self::Client => "client",
        }
    }

    /// The kind for its text, `None` for anything else.
    pub fn parse(text: &str) -> Option<Self> {
        match text {
            "host" => Some(Self::Host),
            "client" => Some(Self::Client),
            _ => None,
        }
    }
}

/// One deny-list entry (`deny` row). A denied host's next request is refused (403 DENIED) at
/// enrolment and on every hop while the entry is active.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DenyEntry {
    /// What `value` names.
    pub kind: DenyKind,
    /// The host fingerprint or the client_id (at most 256 bytes).
    pub value: String,
    /// End of the entry in ms; `None` denies until removed.
    pub until_ms: Option<i64>,
    /// When it was (last) written, in ms.
    pub at_ms: i64,
}

impl DenyEntry {
    /// Whether the entry still denies at `now_ms` (no `until`, or `until` later than now).
    pub fn is_active(&self, now_ms: i64) -> bool {
        self.until_ms.is_none_or(|u| u > now_ms)
    }
}

/// The result of [`RelayStore::deny`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DenyOutcome {
    /// Written (a new entry, or a replaced one: the stored row after the write).
    Stored(DenyEntry),
    /// [`MAX_DENY_ENTRIES`] active entries exist and this one is new; nothing was written.
    Full,
}

/// What the account authority proved about an enrolled host (spec §8), recorded in
/// `account_bindings` in the enrolment's own transaction: every later hop's token must be bound
/// to the same cloud key (`cnf.jkt == cloud_jkt`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AccountBinding {
    /// The enrolled host key.
    pub host_pubkey: String,
    /// RFC 7638 thumbprint of the host's certified cloud key.
    pub cloud_jkt: String,
    /// The token's `client_id` (deny-list key).
    pub client_id: String,
    /// The token's `sub` (the host id at the issuer).
    pub sub: String,
    /// The token's `org`, if any.
    pub org: Option<String>,
    /// When it was recorded, in ms.
    pub at_ms: i64,
}

/// A relay log entry to append in the same transaction as the change it records (the operator
/// controls: [`RelayStore::revoke_logged`], [`RelayStore::deny_logged`],
/// [`RelayStore::undeny_logged`]), so a change is never committed without its entry or the
/// reverse.
#[derive(Debug, Clone, PartialEq)]
pub struct OpEntry {
    /// When, in ms.
    pub at_ms: i64,
    /// The operation name (e.g. `relay-revoke`).
    pub op: String,
    /// The receipt.
    pub receipt: serde_json::Value,
}

/// Signs relay-log receipts (spec §5 "Each writes its signed op receipt"): every receipt the
/// store appends to the relay log gets `sig`, the relay key's base64 Ed25519 signature over the
/// canonical JSON of the receipt without `sig`. The store never holds the relay's private key
/// nor depends on the protocol crate: the relay hands it an implementation over its key
/// ([`crate::ops::RelayOpSigner`]) when it opens the store ([`SqliteStore::open_signed`]).
/// Called on the store's writer thread, inside the transaction that appends the receipt.
pub trait OpSigner: Send + Sync + std::fmt::Debug {
    /// The relay public key the receipts are signed with (canonical standard base64); it must be
    /// the store's own (`meta.relay_pubkey`).
    fn relay_pubkey(&self) -> String;

    /// `sig` for `receipt` (a JSON object without `sig`): the signature over its canonical
    /// JSON. An error (never key material) fails the append, which then changes nothing.
    fn sign_receipt(&self, receipt: &serde_json::Value) -> Result<String, String>;
}

/// `receipt` with `sig` set by `signer` (an existing `sig` is replaced: it is never the
/// caller's to give). Errors: [`StoreError::InvalidInput`] when the receipt is not a JSON object
/// or cannot be signed.
pub fn sign_op_receipt(
    signer: &dyn OpSigner,
    receipt: &serde_json::Value,
) -> Result<serde_json::Value, StoreError> {
    let mut unsigned = receipt.clone();
    let Some(fields) = unsigned.as_object_mut() else {
        return Err(StoreError::InvalidInput(
            "an op receipt must be a JSON object".to_owned(),
        ));
    };
    fields.remove("sig");
    let sig = signer
        .sign_receipt(&unsigned)
        .map_err(|e| StoreError::InvalidInput(format!("the op receipt cannot be signed: {e}")))?;
    if let Some(fields) = unsigned.as_object_mut() {
        fields.insert("sig".to_owned(), serde_json::Value::String(sig));
    }
    Ok(unsigned)
}

/// One relay log entry (`wire.md` §3.4 "relay log").
#[derive(Debug, Clone, PartialEq)]
pub struct OpRecord {
    /// Increasing id.
    pub id: i64,
    /// When, in ms.
    pub at_ms: i64,
    /// The operation name (e.g. `relay-backup`).
    pub op: String,
    /// The receipt.
    pub receipt: serde_json::Value,
}

// ---- Retention sweep (spec §6, §7; `wire.md` §2.12 "Expiry notice", §3.2 "Sweep") ----------

/// Most expired items one sweep batch deletes; each batch is one transaction (`wire.md` §3.2
/// "Sweep": batches of 500).
pub const SWEEP_BATCH: usize = 500;

/// Most batches one sweep runs (`wire.md` §3.2: ≤ 20); what is left waits for the next sweep
/// ([`SweepReport::more`]).
pub const SWEEP_MAX_BATCHES: usize = 20;

/// Most dedup rows one sweep prunes (in its last transaction): as many as its batches may
/// delete items, so pruning keeps pace with expiry.
pub const SWEEP_MAX_PRUNE: usize = SWEEP_BATCH * SWEEP_MAX_BATCHES;

/// Days a dedup row outlives retention: the dedup horizon is retention + 7 days (spec §7).
pub const DEDUP_GRACE_DAYS: i64 = 7;

/// Relay-log operation name (and receipt `type`) of a sweep that changed something.
pub const OP_SWEEP: &str = "relay-sweep";

/// The facts of one expiry notice (spec §6; `wire.md` §2.12): what the relay signs as
/// `{v:1, type:"relay-expired", item_id, target_pubkey, accepted_at, expired_at}`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExpiryFacts {
    /// The expired item's id, as the sender pushed it.
    pub item_id: String,
    /// The target key the *sender* pushed to (its dedup key), even when a host rotation moved
    /// the item to a newer key since: the sender matches the notice to its outbox row by it.
    pub target_pubkey: String,
    /// When the relay accepted the item (Unix ms).
    pub accepted_at_ms: i64,
    /// When the sweep deleted it (Unix ms).
    pub expired_at_ms: i64,
}

/// Signs expiry notices for [`RelayStore::sweep`]. The store never holds the relay's private
/// key nor depends on the protocol crate: the relay hands it an implementation over its key
/// ([`crate::retention::RelayNoticeSigner`]). Called on the store's writer thread, inside the
/// batch's transaction.
pub trait NoticeSigner: Send + Sync + std::fmt::Debug {
    /// The relay public key the notices are signed with (canonical standard base64); it must be
    /// the store's own (`meta.relay_pubkey`).
    fn relay_pubkey(&self) -> String;

    /// The notice item's wire bytes, canonical JSON of `{notice, sig}` with `sig` the relay
    /// key's signature over canonical(notice) (`wire.md` §2.12). An error (never key material)
    /// fails the batch, which then changes nothing.
    fn notice_wire(&self, facts: &ExpiryFacts) -> Result<Vec<u8>, String>;
}

/// What one [`RelayStore::sweep`] did. Counts are items (or rows) and bytes.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SweepReport {
    /// Expired items deleted, every kind.
    pub expired_items: u64,
    /// Of those, envelopes.
    pub expired_envelopes: u64,
    /// Of those, delivery receipts (dropped silently: receipts are advisory).
    pub expired_receipts: u64,
    /// Of those, expiry notices (dropped silently).
    pub expired_notices: u64,
    /// Wire bytes of the deleted items.
    pub expired_bytes: u64,
    /// Expiry notices queued for senders.
    pub notices: u64,
    /// Expired envelopes whose sender key is not enrolled (unknown or revoked): no notice.
    pub notices_not_enrolled: u64,
    /// Expired envelopes whose sender's own queue is at its item or byte cap: no notice.
    pub notices_over_cap: u64,
    /// Expired envelopes whose notice was queued before (its dedup row exists): not again.
    pub notices_already_sent: u64,
    /// Dedup rows pruned past the dedup horizon.
    pub pruned_dedup: u64,
    /// Item batches run (transactions that deleted or looked for expired items).
    pub batches: u64,
    /// The sweep stopped at its bounds ([`SWEEP_MAX_BATCHES`] full batches, or
    /// [`SWEEP_MAX_PRUNE`] pruned rows) with work left: the next sweep continues.
    pub more: bool,
    /// Whether a `relay-sweep` receipt was appended to the relay log.
    pub logged: bool,
}

impl SweepReport {
    /// Whether the sweep changed anything (deleted an item or pruned a dedup row).
    pub fn changed(&self) -> bool {
        self.expired_items > 0 || self.pruned_dedup > 0
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
pub trait RelayStore: Send + Sync + std::fmt::Debug {
    /// The current epoch (read from the store on each call).
    fn epoch(&self) -> Result<String, StoreError>;

    /// The relay public key this store is bound to.
    fn relay_pubkey(&self) -> Result<String, StoreError>;

    /// The last heartbeat written, in ms; `None` on a store that never had one (spec §5).
    fn heartbeat(&self) -> Result<Option<i64>, StoreError>;

    /// Record that the relay is alive (every 30 s, spec §5).
    fn set_heartbeat(&self, now_ms: i64) -> Result<(), StoreError>;

    /// Proves that writes still go through: a request that changes nothing, answered once the
    /// store's writer took it (the service watchdog's check, [`crate::watchdog`]). The default
    /// reads the epoch (a store without a separate writer). Errors: the writer stopped or
    /// failed ([`StoreError::WriterFailed`]), storage errors.
    fn writer_answers(&self) -> Result<(), StoreError> {
        self.epoch().map(|_| ())
    }

    /// Switch to a new random epoch (spec §5: `relay rotate-epoch`, startup after a stale
    /// heartbeat, restore).
    fn rotate_epoch(&self) -> Result<EpochRotation, StoreError>;

    /// [`RelayStore::rotate_epoch`] with its relay-log receipt in the same transaction (spec
    /// §5, `wire.md` §3.4): `log.receipt` (a JSON object) gets the fields `from` and `to`, is
    /// appended to the relay log under `log.op`, and is written to `meta.epoch_rotated` — never
    /// a new epoch without its receipt or the reverse. Returns the rotation and the receipt as
    /// stored. Errors: [`StoreError::InvalidInput`] when the receipt is not an object.
    fn rotate_epoch_logged(
        &self,
        log: OpEntry,
    ) -> Result<(EpochRotation, serde_json::Value), StoreError>;

    /// Read a free-form meta value (e.g. `epoch_rotated`, `restored`).
    fn meta(&self, key: &str) -> Result<Option<String>, StoreError>;

    /// Write a free-form meta value. The store's own keys (`schema_version`, `epoch`,
    /// `relay_pubkey`, `heartbeat`) are refused with [`StoreError::InvalidInput`]: they have
    /// dedicated methods.
    fn set_meta(&self, key: &str, value: &str) -> Result<(), StoreError>;

    /// Enrol or re-enrol a host key (spec §2 enrolments, §8). A revoked key stays revoked; a
    /// weaker authority never overwrites the account or `authorized_by` a stronger one recorded;
    /// a name is unique only inside a proven account (case-insensitive); a new key is refused at
    /// the live cap.
    fn enrol(&self, req: EnrolRequest) -> Result<EnrolOutcome, StoreError>;

    /// The enrolment of a key, live or revoked.
    fn enrolment(&self, host_pubkey: &str) -> Result<Option<Enrolment>, StoreError>;

    /// Live enrolments carrying a name (case-insensitive), newest first, at most
    /// [`MAX_LIVE_BY_NAME`] of them (v1 name lookups, spec §2): a lookup only needs to know
    /// whether the name is crowded, so a crowded name never loads all its carriers.
    fn live_enrolments_by_name(&self, host_name: &str) -> Result<Vec<Enrolment>, StoreError>;

    /// How many enrolments are live.
    fn live_enrolment_count(&self) -> Result<u64, StoreError>;

    /// Revoke a key for good (it serves nothing and receives nothing afterwards).
    fn revoke(&self, host_pubkey: &str, now_ms: i64) -> Result<RevokeOutcome, StoreError>;

    /// Store a verified v1 enc-key advertisement (replaces the previous one).
    fn put_enc_ad_v1(&self, ad: EncAdV1) -> Result<(), StoreError>;

    /// Store a verified v2 enc-key record (replaces the previous one).
    fn put_enc_ad_v2(&self, ad: EncAdV2) -> Result<(), StoreError>;

    /// The enc key to serve for a host; `None` when the host is unknown, revoked or has no ad.
    fn get_enc_ad(&self, host_pubkey: &str) -> Result<Option<EncAd>, StoreError>;

    /// Store validated items (spec §3): per item, dedup by (sender, item id, target) first —
    /// a target already stored under this item answers `duplicate` (same bytes) or `conflict`
    /// whatever its enrolment or allowlist says now — then every fresh target validated
    /// (enrolled, sender allowed, not repeated) before seq allocation and quotas; one outcome
    /// per item.
    fn push(&self, batch: PushBatch) -> Result<PushOutcome, StoreError>;

    /// [`RelayStore::push`] without holding the caller: `done` gets the same result once the
    /// group commit that covers the batch has committed (or failed), on whatever thread
    /// finished it (the writer's, for [`SqliteStore`]), so an async handler awaits a channel
    /// instead of parking a blocking thread per request. `done` must not block. The default
    /// runs [`RelayStore::push`] on the calling thread.
    fn push_then(&self, batch: PushBatch, done: PushReply) {
        done(self.push(batch))
    }

    /// The target keys that already have a dedup row for (sender, item id), i.e. for which a
    /// push of this item was accepted earlier (its bytes may since have been acked or expired).
    /// The push handler skips its enrolment and allowlist pre-checks for these targets, so a
    /// retry after the target changed still settles as `duplicate`.
    fn dedup_targets(&self, sender_pubkey: &str, item_id: &str) -> Result<Vec<String>, StoreError>;

    /// One page of a host's queue (spec §4).
    fn pull(&self, req: PullRequest) -> Result<PullPage, StoreError>;

    /// Acknowledge through a seq: deletes those items, records `acked_through` (spec §4).
    fn ack(&self, req: AckRequest) -> Result<AckResult, StoreError>;

    /// A host's queue head and ack position.
    fn info_for(&self, host_pubkey: &str) -> Result<HostQueueInfo, StoreError>;

    /// Store a verified sender allowlist unless one with the same or a newer `iat` is stored.
    fn put_sender_list(&self, list: SenderList) -> Result<SenderListOutcome, StoreError>;

    /// A target's stored sender allowlist.
    fn sender_list(&self, target_pubkey: &str) -> Result<Option<SenderList>, StoreError>;

    /// Apply a verified host rotation in one transaction (spec §2 "Rotation"): the new key
    /// takes the old enrolment's name, account, `authorized_by` and owner claim (a stronger
    /// authority the new key already has keeps its account); the old key's queued items move
    /// to the new key in order, re-sequenced after the new key's own; the old key's enc-key ads
    /// are dropped; its allowlist becomes the new key's (unless the new key published its own)
    /// and it is replaced by the new key in every other target's allowlist; the old key is
    /// revoked; the old key's active host deny-list entries are copied to the new key's
    /// fingerprint. Moved items are not charged to quotas (they may take the new key past
    /// them). Refusals change nothing. Dedup rows stay under the old key, so a retry naming
    /// the old key still settles as `duplicate`.
    fn rotate(&self, req: RotateRequest) -> Result<RotateOutcome, StoreError>;

    /// Append a receipt to the relay log, keeping the last [`OPS_KEEP`] entries other than
    /// sweep receipts and the last [`SWEEP_OPS_KEEP`] sweep receipts; returns its id.
    fn append_op(
        &self,
        at_ms: i64,
        op: &str,
        receipt: &serde_json::Value,
    ) -> Result<i64, StoreError>;

    /// The newest log entries first, at most `limit` (clamped to `1..=`[`OPS_KEEP`] `+`
    /// [`SWEEP_OPS_KEEP`], the whole log).
    fn ops(&self, limit: i64) -> Result<Vec<OpRecord>, StoreError>;

    /// The retention sweep at `now_ms` (spec §6, §7; `wire.md` §3.2 "Sweep"):
    /// 1. up to [`SWEEP_MAX_BATCHES`] batches, each ONE transaction deleting at most
    ///    [`SWEEP_BATCH`] items with `expires_at <= now_ms` (items without `expires_at`, pushed
    ///    through v1, never expire). Their dedup rows stay as tombstones, so a late retry answers
    ///    `duplicate` with the original seq and is never delivered again. Each expired
    ///    envelope queues, in the same transaction, a notice item for its sender: kind
    ///    `expired`, id `expired:<item_id>:<target>`, sender the relay key, sender host
    ///    `relay`, wire from `signer`, a normal seq, charged to no quota, expiring one retention
    ///    later — unless the sender key is not enrolled or revoked, its queue is at its item or
    ///    byte cap, or that notice was queued before (its dedup row, sender = relay key). The
    ///    target named is the one the sender pushed to, also after a host rotation moved the
    ///    item. Receipts and notices expire silently.
    /// 2. one last transaction: prunes at most [`SWEEP_MAX_PRUNE`] dedup rows accepted more
    ///    than retention + [`DEDUP_GRACE_DAYS`] days ago whose item is gone (never one whose
    ///    item is still queued, under its own or a rotated key), and — when anything changed —
    ///    appends the `relay-sweep` receipt to the relay log in that same transaction.
    ///
    /// Errors: [`StoreError::InvalidInput`] when `signer`'s key is not the store's relay key
    /// (nothing changed); store errors. Batches committed before an error stay committed (each
    /// is whole on its own); the next sweep continues.
    fn sweep(
        &self,
        now_ms: i64,
        signer: std::sync::Arc<dyn NoticeSigner>,
    ) -> Result<SweepReport, StoreError>;

    // ---- Deny-list and account bindings (spec §8; authority/) ----

    /// [`RelayStore::enrol`], and when it enrols (outcome `Enrolled`) and `binding` is given,
    /// records the account binding for the key in the same transaction (replacing an older
    /// one). A binding whose `cloud_jkt` is already bound to another live (not revoked) host key
    /// is refused with [`EnrolOutcome::CloudKeyTaken`]. A refused enrolment writes nothing.
    fn enrol_bound(
        &self,
        req: EnrolRequest,
        binding: Option<AccountBinding>,
    ) -> Result<EnrolOutcome, StoreError>;

    /// The account binding recorded for a key, if any.
    fn account_binding(&self, host_pubkey: &str) -> Result<Option<AccountBinding>, StoreError>;

    /// Adds or replaces a deny-list entry (expired entries are pruned in the same transaction).
    /// [`DenyOutcome::Full`] when [`MAX_DENY_ENTRIES`] are stored and the entry is new.
    fn deny(&self, entry: DenyEntry) -> Result<DenyOutcome, StoreError>;

    /// Removes a deny-list entry; `false` when there was none.
    fn undeny(&self, kind: DenyKind, value: &str) -> Result<bool, StoreError>;

    /// [`RelayStore::revoke`], and when it revokes ([`RevokeOutcome::Revoked`]) appends `log`
    /// to the relay log in the same transaction.
    fn revoke_logged(
        &self,
        host_pubkey: &str,
        now_ms: i64,
        log: OpEntry,
    ) -> Result<RevokeOutcome, StoreError>;

    /// [`RelayStore::deny`], and when it stores the entry appends `log` to the relay log in the
    /// same transaction.
    fn deny_logged(&self, entry: DenyEntry, log: OpEntry) -> Result<DenyOutcome, StoreError>;

    /// [`RelayStore::undeny`], and when it removed an entry appends `log` to the relay log in
    /// the same transaction.
    fn undeny_logged(&self, kind: DenyKind, value: &str, log: OpEntry) -> Result<bool, StoreError>;

    /// Every stored deny-list entry (active or expired but not yet pruned), ordered by kind
    /// then value.
    fn deny_entries(&self) -> Result<Vec<DenyEntry>, StoreError>;

    /// The active entry that denies a host with fingerprint `host_fp` (and, when known, token
    /// `client_id`) at `now_ms`, if any; a host entry is reported before a client entry.
    fn denied(
        &self,
        host_fp: &str,
        client_id: Option<&str>,
        now_ms: i64,
    ) -> Result<Option<DenyEntry>, StoreError>;

    /// Every enrolment (live or revoked) whose key has the fingerprint `fp`
    /// (`xxxx-xxxx-xxxx-xxxx`), for `relay revoke <fingerprint>`. Scans all enrolments: an
    /// operator command, not a request path.
    fn enrolments_by_fingerprint(&self, fp: &str) -> Result<Vec<Enrolment>, StoreError>;

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

/// Most rows [`RelayStore::live_enrolments_by_name`] returns: the crowded threshold (a name
/// carried by more than 16 live enrolments, spec §2,
/// [`crate::handlers::enc_key::MAX_PER_NAME`]) plus one, enough to tell a crowded name.
pub const MAX_LIVE_BY_NAME: usize = 17;

const _: () = assert!(MAX_LIVE_BY_NAME == crate::handlers::enc_key::MAX_PER_NAME + 1);

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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rejection_codes_match_the_wire_strings() {
        let host = "beta".to_owned();
        let q = |kind| {
            ItemStatus::Rejected(Rejection::Quota {
                kind,
                host: host.clone(),
            })
        };
        assert_eq!(
            q(QuotaKind::QueueDepth).wire(),
            "rejected:quota:queue depth exceeded for beta"
        );
        assert_eq!(
            q(QuotaKind::QueueBytes).wire(),
            "rejected:quota:queue bytes exceeded for beta"
        );
        assert_eq!(
            q(QuotaKind::SenderShare).wire(),
            "rejected:quota:sender share exceeded for beta"
        );
        assert_eq!(
            q(QuotaKind::OwnerQueueDepth).wire(),
            "rejected:quota:owner queue depth exceeded for beta"
        );
        assert_eq!(
            ItemStatus::Rejected(Rejection::SenderNotAccepted).wire(),
            "rejected:sender not accepted by target"
        );
        assert_eq!(
            ItemStatus::Rejected(Rejection::Conflict).wire(),
            "rejected:conflict"
        );
        assert_eq!(ItemStatus::Accepted.wire(), "accepted");
        assert_eq!(ItemStatus::Duplicate.wire(), "duplicate");
    }

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

    #[test]
    fn authority_ranks_round_trip_and_order() {
        for s in [
            AuthorityStrength::HostKeyChallenge,
            AuthorityStrength::Account,
        ] {
            assert_eq!(AuthorityStrength::from_rank(s.rank()), Some(s));
        }
        assert!(AuthorityStrength::HostKeyChallenge < AuthorityStrength::Account);
        assert_eq!(AuthorityStrength::from_rank(7), None);
    }
}
