//! The maintenance side of a store backend: what `relay backup`, `relay restore`
//! (`MBX_RELAY_RESTORE_FROM`), `relay status` and `relay log` need from the store directory
//! while no [`RelayStore`](super::RelayStore) is open on it, or beside the one a running relay
//! holds (spec §5 "Backup", "Restore from backup"; `wire.md` §3.3, §3.4).
//!
//! # What it owns
//! - [`StoreMaintenance`]: a backend's file-level operations on a store directory — read-only
//!   facts for status and the relay log, the online backup, and the backend-specific steps of a
//!   restore (checking a staged backup copy, reading and keeping the store it replaces, opening
//!   the copy for the carry-forward, swapping it in).
//! - [`StagedStore`]: the restored copy inside the one transaction of a restore. Its methods
//!   are the primitives the carry-forward is written against (`ops::restore`), once, for every
//!   backend: a backend gets the restore rules (revoked stays revoked, the higher seq floor, the
//!   newer allowlist and ads, the active deny entries, the replayed rotations, the operator's op
//!   log) by implementing them.
//! - The plain types these exchange ([`StoreFacts`], [`StoreStatus`], [`CarryForward`] …).
//!
//! # What it must never do
//! - Decide what a restore carries: the rules live in `ops::restore`; a primitive here applies
//!   one row under the condition its doc names and nothing else.
//! - Hold key material: stores hold public keys, sealed items and routing metadata only.

use std::path::{Path, PathBuf};

use serde_json::{Map, Value};

use super::{OpSigner, RotateOutcome, StoreError};

/// Why a maintenance operation did nothing. Display texts are for operators.
#[derive(Debug, thiserror::Error)]
pub enum MaintenanceError {
    /// The target file exists already: a copy never overwrites a file.
    #[error("{} already exists", .0.display())]
    Exists(PathBuf),
    /// The copy failed its integrity check (the problems, joined with `; `).
    #[error("integrity: {0}")]
    Integrity(String),
    /// The source stayed busy for the whole copy step.
    #[error("the relay store stayed busy")]
    Busy,
    /// The file is not a store of this backend, or a damaged one (why).
    #[error("not a relay store: {0}")]
    NotAStore(String),
    /// The store has a newer schema than this binary.
    #[error("relay store schema {found} is newer than this agentmbx ({supported})")]
    SchemaTooNew {
        /// The store's schema version.
        found: u32,
        /// The newest version this binary knows.
        supported: u32,
    },
    /// A file operation failed.
    #[error("{}: {source}", path.display())]
    Io {
        /// The path involved.
        path: PathBuf,
        /// The underlying error.
        #[source]
        source: std::io::Error,
    },
    /// The store failed (a database error…).
    #[error(transparent)]
    Store(#[from] StoreError),
}

/// Counts of a store for the backup and restore receipts (`counts` there).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct StoreCounts {
    /// Live enrolments.
    pub enrolments: i64,
    /// Revoked enrolments.
    pub revoked: i64,
    /// Queued items.
    pub items: i64,
    /// Their wire bytes.
    pub bytes: i64,
    /// Dedup rows.
    pub dedup: i64,
    /// Targets with at least one queued item.
    pub targets: i64,
}

impl StoreCounts {
    /// The receipts' `counts` object: `{enrolments, revoked, items, bytes, dedup, targets}`.
    pub fn to_json(&self) -> Map<String, Value> {
        let mut counts = Map::new();
        for (name, n) in [
            ("enrolments", self.enrolments),
            ("revoked", self.revoked),
            ("items", self.items),
            ("bytes", self.bytes),
            ("dedup", self.dedup),
            ("targets", self.targets),
        ] {
            counts.insert(name.to_owned(), Value::from(n));
        }
        counts
    }
}

/// A store's facts for the backup receipt.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoreFacts {
    /// `meta.epoch`.
    pub epoch: Option<String>,
    /// `meta.relay_pubkey` (standard base64).
    pub relay_pubkey: Option<String>,
    /// The schema version.
    pub schema_version: u32,
    /// `meta.heartbeat` in ms, `None` when missing or not a number.
    pub heartbeat_ms: Option<i64>,
    /// The counts.
    pub counts: StoreCounts,
}

/// One target queue as status reads it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct QueueFacts {
    /// The target key (standard base64).
    pub host_pubkey: String,
    /// Its enrolled name, `None` without an enrolment row.
    pub host_name: Option<String>,
    /// Whether its enrolment is revoked.
    pub revoked: bool,
    /// Items queued.
    pub items: i64,
    /// Their wire bytes.
    pub bytes: i64,
    /// `accepted_at` of its oldest item (ms).
    pub oldest_ms: i64,
}

/// Everything `relay status` shows, read from one snapshot, unformatted (counts as stored,
/// times in Unix ms, `meta` values as text).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoreStatus {
    /// The schema version (0: not a store).
    pub schema_version: u32,
    /// `meta.relay_pubkey`.
    pub relay_pubkey: Option<String>,
    /// `meta.epoch`.
    pub epoch: Option<String>,
    /// `meta.heartbeat` as stored.
    pub heartbeat: Option<String>,
    /// Live enrolments.
    pub enrolled: i64,
    /// Revoked enrolments.
    pub revoked: i64,
    /// Dedup rows.
    pub dedup_rows: i64,
    /// Queued items.
    pub queued_items: i64,
    /// Their wire bytes.
    pub queued_bytes: i64,
    /// Targets with a queued item.
    pub queued_targets: i64,
    /// `accepted_at` of the oldest queued item.
    pub oldest_ms: Option<i64>,
    /// The deepest queues (most items, then bytes, then key), at most the `top` asked for.
    pub deepest: Vec<QueueFacts>,
    /// `(at ms, receipt text)` of the newest op-log entry of the operation asked for.
    pub last_op: Option<(i64, String)>,
}

/// One relay-log entry as stored.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoredOp {
    /// Its id (ascending).
    pub id: i64,
    /// When, in ms.
    pub at_ms: i64,
    /// Its `op` column.
    pub op: String,
    /// The receipt text; `None` when the stored value is not text.
    pub receipt: Option<String>,
}

/// A revoked enrolment, all its columns.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RevokedHost {
    /// The host key.
    pub host_pubkey: String,
    /// Its name.
    pub host_name: String,
    /// Its owner claim.
    pub owner_fp: String,
    /// Its account.
    pub account: Option<String>,
    /// The authority that recorded it.
    pub authorized_by: String,
    /// That authority's rank.
    pub authority_rank: i64,
    /// When it enrolled (ms).
    pub enrolled_at_ms: i64,
    /// When it was revoked (ms).
    pub revoked_at_ms: i64,
}

/// A stored sender allowlist (`senders` as stored).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoredSenderList {
    /// The target key.
    pub target_pubkey: String,
    /// The senders, as stored.
    pub senders: String,
    /// The list's `iat` (ms).
    pub iat_ms: i64,
    /// The signed record.
    pub record: String,
    /// Its signature.
    pub sig: String,
}

/// A stored deny-list entry (`kind` as stored: `host` or `client`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoredDeny {
    /// `host` or `client`.
    pub kind: String,
    /// The fingerprint or client id.
    pub value: String,
    /// Until when (ms); `None`: until removed.
    pub until_ms: Option<i64>,
    /// When added (ms).
    pub at_ms: i64,
}

/// An applied host key rotation (`meta.rotation:<old>` → new key).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AppliedRotation {
    /// The old key.
    pub old_key: String,
    /// The new key.
    pub new_key: String,
    /// When the old key was revoked by it (ms); `None` when its row is gone.
    pub at_ms: Option<i64>,
}

/// What the current store holds that a restore carries forward, read in one snapshot.
#[derive(Debug, Clone, Default)]
pub struct CarryForward {
    /// `meta.relay_pubkey`.
    pub relay_pubkey: Option<String>,
    /// Revoked enrolments.
    pub revoked: Vec<RevokedHost>,
    /// Sender allowlists.
    pub sender_lists: Vec<StoredSenderList>,
    /// v1 enc-key ads.
    pub enc_ads: Vec<super::EncAdV1>,
    /// v2 enc-key records.
    pub enc_ad_records: Vec<super::EncAdV2>,
    /// `(target, next_seq)`.
    pub seq_floors: Vec<(String, i64)>,
    /// Deny-list entries (expired ones included).
    pub deny: Vec<StoredDeny>,
    /// Account bindings.
    pub bindings: Vec<super::AccountBinding>,
    /// The relay log, oldest first.
    pub ops: Vec<StoredOp>,
    /// The applied rotations, oldest first (by the old key's revocation time).
    pub rotations: Vec<AppliedRotation>,
    /// Every path this store lineage was restored from, with when.
    pub restored_paths: Map<String, Value>,
}

/// How many rows of each kind a restore brought forward (the receipt's `carried`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Carried {
    /// Rotations replayed.
    pub rotations: usize,
    /// Revocations.
    pub revocations: usize,
    /// Sender allowlists.
    pub sender_lists: usize,
    /// v1 enc-key ads.
    pub enc_ads: usize,
    /// v2 enc-key records.
    pub enc_ad_records: usize,
    /// Seq floors raised.
    pub seq_floors: usize,
    /// Deny entries.
    pub deny: usize,
    /// Account bindings.
    pub account_bindings: usize,
    /// Relay-log entries.
    pub ops: usize,
}

/// The facts of a staged backup copy a restore checked.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BackupFacts {
    /// Its epoch.
    pub epoch: String,
    /// Its relay key.
    pub relay_pubkey: String,
    /// Its schema version.
    pub schema_version: u32,
    /// Its heartbeat (ms), if readable.
    pub heartbeat_ms: Option<i64>,
}

/// What the current store turned out to be when a restore took it.
#[derive(Debug)]
pub enum TakenStore {
    /// Read and copied to the rollback file: what it carries forward, and its epoch.
    Read(Box<CarryForward>, Option<String>),
    /// Bound to another relay key (never overridden).
    OtherKey(String),
}

/// Why taking the current store took nothing.
#[derive(Debug)]
pub enum TakeFailure {
    /// It cannot be read (why); `--force` restores without it.
    Unreadable(String),
    /// It has a newer schema: never replaced.
    SchemaTooNew(u32),
    /// Writing the rollback copy failed (a full disk…): says nothing about the current store.
    Failed(MaintenanceError),
}

/// The restored copy inside the restore's one transaction (opened with
/// [`StoreMaintenance::open_staged`]: migrated to this binary's schema, usage counters
/// recomputed). Each `carry_*` applies one row under the condition it names and answers
/// whether it changed the copy.
pub trait StagedStore {
    /// `meta[key]`.
    fn meta(&self, key: &str) -> Result<Option<String>, StoreError>;
    /// Sets `meta[key]`.
    fn set_meta(&self, key: &str, value: &str) -> Result<(), StoreError>;
    /// Every path this copy's lineage was restored from, with when.
    fn restored_paths(&self) -> Result<Map<String, Value>, StoreError>;
    /// Raises `target`'s next seq to `next_seq` when that is higher.
    fn carry_seq_floor(&self, target: &str, next_seq: i64) -> Result<bool, StoreError>;
    /// Replays a host key rotation at `at_ms` with the store's own rotation code.
    fn replay_rotation(
        &self,
        old_key: &str,
        new_key: &str,
        at_ms: i64,
    ) -> Result<RotateOutcome, StoreError>;
    /// Records the rotation marker `old → new` when `old` has an enrolment and no marker.
    fn carry_rotation_marker(&self, old_key: &str, new_key: &str) -> Result<(), StoreError>;
    /// Inserts the revoked enrolment, or revokes a live one at its time; a revoked one stays.
    fn carry_revocation(&self, host: &RevokedHost) -> Result<bool, StoreError>;
    /// Stores the allowlist when its `iat` is newer than the held one's (or none is held).
    fn carry_sender_list(&self, list: &StoredSenderList) -> Result<bool, StoreError>;
    /// Stores the v1 ad when newer (`at`).
    fn carry_enc_ad(&self, ad: &super::EncAdV1) -> Result<bool, StoreError>;
    /// Stores the v2 record when newer (`at`).
    fn carry_enc_ad_record(&self, ad: &super::EncAdV2) -> Result<bool, StoreError>;
    /// Stores the deny entry when newer (`at`).
    fn carry_deny(&self, entry: &StoredDeny) -> Result<bool, StoreError>;
    /// Stores the binding when its key has an enrolment here and it is newer (`at`).
    fn carry_binding(&self, binding: &super::AccountBinding) -> Result<bool, StoreError>;
    /// Replaces the relay log with `ops` (ids kept); answers how many were written.
    fn replace_op_log(&self, ops: &[StoredOp]) -> Result<usize, StoreError>;
    /// The copy's counts.
    fn counts(&self) -> Result<StoreCounts, StoreError>;
    /// Appends an op receipt (signed with `signer` when given); returns the stored text.
    fn append_op(
        &self,
        signer: Option<&dyn OpSigner>,
        at_ms: i64,
        op: &str,
        receipt: &str,
    ) -> Result<String, StoreError>;
    /// Commits the transaction and closes the copy, checked again, as one whole file.
    fn commit(self: Box<Self>) -> Result<(), MaintenanceError>;
}

/// A backend's file-level operations on a store directory (module docs).
pub trait StoreMaintenance {
    /// The status facts of the store file `db` (read-only, without the lock, creating
    /// nothing), with at most `top` deepest queues and the newest op-log entry of `last_op`.
    fn status(&self, db: &Path, top: usize, last_op: &str)
        -> Result<StoreStatus, MaintenanceError>;
    /// The newest `limit` relay-log entries of `db`, newest first, and the relay key it
    /// records (read-only, without the lock, creating nothing).
    fn read_log(
        &self,
        db: &Path,
        limit: i64,
    ) -> Result<(Vec<StoredOp>, Option<String>), StoreError>;
    /// Every path the store `db` was restored from (`None`: it holds no such record table).
    fn restored_paths(&self, db: &Path) -> Result<Option<Map<String, Value>>, StoreError>;
    /// The heartbeat (ms) of `db` when it can be read (read-only).
    fn heartbeat(&self, db: &Path) -> Option<i64>;
    /// Copies the store `db` into the new file `dest` (absolute; never replacing a name, no
    /// partial file left on error), checked; `failpoint` is hit just before it gets its name.
    fn backup(
        &self,
        db: &Path,
        dest: &Path,
        failpoint: Option<&str>,
    ) -> Result<StoreFacts, MaintenanceError>;
    /// Copies the backup file `src` to the new working copy `copy` (0600), with what the
    /// backend keeps beside it (an SQLite `-wal`).
    fn stage(&self, src: &Path, copy: &Path) -> Result<(), MaintenanceError>;
    /// Removes a working copy and what the backend keeps beside it; errors are ignored.
    fn discard(&self, copy: &Path);
    /// Removes from `dir` the partial copies of interrupted runs whose process is gone (and
    /// whose final name's base satisfies `base_ok`); never anything else; errors are ignored.
    fn remove_dead_partials(&self, dir: &Path, base_ok: &dyn Fn(&str) -> bool);
    /// Checks the staged copy `copy` of a backup: a store of this backend, intact, of a
    /// schema this binary knows with exactly its objects, with an epoch and a relay key.
    fn check_staged(&self, copy: &Path) -> Result<BackupFacts, MaintenanceError>;
    /// Reads what the current store `db` carries forward and copies it to `rollback` (its
    /// directory created 0700 when missing) when it is bound to `backup_key` too.
    fn take_current(
        &self,
        db: &Path,
        rollback: &Path,
        backup_key: &str,
    ) -> Result<TakenStore, TakeFailure>;
    /// The restored paths of a store that cannot be read as a whole, when those can be.
    fn salvage_restored_paths(&self, db: &Path) -> Map<String, Value>;
    /// Keeps the files of an unreadable store `db` as they are under `rollback`.
    fn keep_unreadable(&self, db: &Path, rollback: &Path) -> Result<(), MaintenanceError>;
    /// Opens the staged copy for the restore's transaction ([`StagedStore`]).
    fn open_staged(&self, copy: &Path) -> Result<Box<dyn StagedStore + '_>, MaintenanceError>;
    /// Puts the committed copy in place of `db` (what the old store leaves beside it goes to
    /// `rollback`'s name or away), durably.
    fn swap_in(&self, copy: &Path, db: &Path, rollback: &Path) -> Result<(), MaintenanceError>;
}
