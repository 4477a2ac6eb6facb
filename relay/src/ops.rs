//! Relay operations on a store (spec §5 "Restore from backup", "Backup"; `wire.md` §3.4):
//! the start-up epoch rotation after a stale or future heartbeat, `relay rotate-epoch`,
//! `relay backup`, `relay restore` (and `MBX_RELAY_RESTORE_FROM`, [`restore`]), `relay log`, and
//! the signatures of the relay log's receipts.
//!
//! # What it owns
//! - **Signed op receipts** (spec §5 "Each writes its signed op receipt"; ours, 0.5.x's are
//!   unsigned): [`RelayOpSigner`] is the relay key as the store's [`OpSigner`]; a store opened
//!   with it ([`SqliteStore::open_signed`]: `relay serve`, [`open_offline_signed`]) signs every
//!   receipt it appends (`sig` = base64 Ed25519 over the canonical JSON of the receipt without
//!   `sig`). [`verify_receipt`] checks one against a relay key; [`read_verified_log_with`] is
//!   `relay log`'s view (against the relay key when available, else the store's own
//!   `relay_pubkey`; an entry verifies only when its `op` column is its signed `type`). The offline commands sign with
//!   [`offline_relay_key_if_any`]: `MBX_RELAY_KEY` or `relay.key` in the store directory; with
//!   neither they still run and write their receipt unsigned ([`unsigned_receipt_reason`]),
//!   which `relay log` shows as not verified.
//! - **The heartbeat rule**: at start, a stored heartbeat more than [`HEARTBEAT_STALE_MS`]
//!   (10 min) old or in the future rotates the epoch (a volume restore or a long outage brought
//!   old data back), with one log line and a receipt `{v:1, type:"relay-epoch-rotated", at,
//!   store, from, to, by:"heartbeat"}`. `relay rotate-epoch` writes the same receipt with
//!   `by:"operator"`. The new epoch, `meta.epoch_rotated` and the relay-log entry are one
//!   transaction
//!   ([`OperationsStore::rotate_epoch_logged`](crate::store::OperationsStore::rotate_epoch_logged)).
//! - **The online backup** ([`backup`]), through the store backend's
//!   [`StoreMaintenance::backup`] (`store/sqlite/backup.rs`): the SQLite online backup API in one step (one
//!   consistent snapshot, safe while `relay serve` writes: a read-only source connection, WAL)
//!   into `<file>.partial-<pid>` (created 0600), switched to the rollback journal, checked
//!   (`PRAGMA integrity_check`), fsynced, then linked to `<file>` — which never overwrites: an
//!   existing file is refused ([`OpsError::Exists`]) and left untouched — and the directory
//!   fsynced. The partial file never remains, whatever fails; the partial files of a killed
//!   backup to the same name (their pid gone) are removed by the next one. The receipt
//!   ([`backup`]'s answer) is the caller's to log: the backup itself never writes the store.
//! - **Reading the relay log** ([`read_log`]) read-only, without the lock, so it works while the
//!   relay serves, and without leaving `-wal`/`-shm` beside a stopped store; an entry whose
//!   receipt is not JSON is listed as unreadable, never failing the whole log; [`summary`] is
//!   the text line's summary.
//!
//! # What it must never do
//! - Write the source store from [`backup`] or [`read_log`] (one process writes a store; only
//!   the open [`RelayStore`] appends receipts).
//! - Overwrite an existing file, or leave a partial backup under the final name.
//! - Print key material: a backup holds public keys, ciphertext and routing metadata only.

use std::io::Read as _;
use std::path::{Path, PathBuf};

use serde_json::{json, Value};

use agentmbx_protocol::keys::{HostKey, KeyFile, PublicKey};
use agentmbx_protocol::time::iso_ms;

use crate::store::maintenance::MaintenanceError;
use crate::store::{
    EpochRotation, OpEntry, OpRecord, OpSigner, OpenOptions, RelayStore, SqliteMaintenance,
    SqliteStore, StoreError, StoreLock, StoreMaintenance, DB_FILE, OPS_KEEP, SWEEP_OPS_KEEP,
};

mod restore;

pub use restore::{
    check_backup_path, restore, restore_with, restored_from, RestoreError, RestoreOptions,
    LIVE_HEARTBEAT_MS, OP_RESTORE, RESTORE_FROM_ENV, ROLLBACK_DIR,
};

/// A heartbeat further than this from now (either way) rotates the epoch at start: 10 min in
/// ms (spec §5).
pub const HEARTBEAT_STALE_MS: i64 = 600_000;

/// Relay-log operation name (and receipt `type`) of an epoch rotation.
pub const OP_EPOCH_ROTATED: &str = "relay-epoch-rotated";

/// Relay-log operation name (and receipt `type`) of a backup.
pub const OP_BACKUP: &str = "relay-backup";

/// Who rotated the epoch (the receipt's `by`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RotatedBy {
    /// `relay serve` at start, after a stale or future heartbeat.
    Heartbeat,
    /// `relay rotate-epoch` (offline or through the admin endpoint).
    Operator,
}

impl RotatedBy {
    /// `heartbeat` or `operator`.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Heartbeat => "heartbeat",
            Self::Operator => "operator",
        }
    }
}

/// The relay key as the store's op-receipt signer ([`OpSigner`]): `sig` over the canonical
/// JSON (`wire.md` §2.2) of the receipt without `sig`. Its `Debug` shows the fingerprint only.
pub struct RelayOpSigner {
    key: HostKey,
}

impl RelayOpSigner {
    /// A signer over `key`, shared as the store wants it.
    pub fn shared(key: HostKey) -> std::sync::Arc<dyn OpSigner> {
        std::sync::Arc::new(Self { key })
    }
}

impl std::fmt::Debug for RelayOpSigner {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RelayOpSigner")
            .field("fingerprint", &self.key.public().fingerprint())
            .finish()
    }
}

impl OpSigner for RelayOpSigner {
    fn relay_pubkey(&self) -> String {
        self.key.public().to_b64()
    }

    fn sign_receipt(&self, receipt: &Value) -> Result<String, String> {
        let text = agentmbx_protocol::canonical::to_string(receipt).map_err(|e| e.to_string())?;
        Ok(self.key.sign(text.as_bytes()))
    }
}

/// Whether `receipt` carries a `sig` that `relay_pubkey` made over the canonical JSON of the
/// receipt without `sig` ([`RelayOpSigner`]). False for an unsigned, altered or foreign receipt.
pub fn verify_receipt(receipt: &Value, relay_pubkey: &PublicKey) -> bool {
    let Some(sig) = receipt.get("sig").and_then(Value::as_str) else {
        return false;
    };
    let mut unsigned = receipt.clone();
    if let Some(fields) = unsigned.as_object_mut() {
        fields.remove("sig");
    }
    agentmbx_protocol::canonical::to_string(&unsigned)
        .is_ok_and(|text| relay_pubkey.verify(text.as_bytes(), sig))
}

/// The relay key an offline operator command signs its receipts with, if there is one:
/// `MBX_RELAY_KEY` (the seed `relay keygen` printed; read, not removed) when set, else
/// `relay.key` in `dir` — never created here; `None` when neither exists (a relay whose key
/// lives only in a platform secret): the command still runs and its receipt is unsigned
/// ([`unsigned_receipt_reason`]). Errors: [`OpsError::RelayKey`] for a malformed key (never
/// key material), I/O errors reading `relay.key`.
pub fn offline_relay_key_if_any(dir: &Path) -> Result<Option<HostKey>, OpsError> {
    if let Some(seed) = crate::key::read_env_seed() {
        return HostKey::from_seed_b64(seed.trim()).map(Some).map_err(|_| {
            OpsError::RelayKey(format!(
                "{} is not a valid relay key (expected the base64 seed printed by `agentmbx relay keygen`)",
                crate::key::RELAY_KEY_ENV
            ))
        });
    }
    let path = dir.join("relay.key");
    match std::fs::read_to_string(&path) {
        Ok(text) => KeyFile::parse(&text)
            .ok()
            .and_then(|f| HostKey::from_key_file(&f).ok())
            .map(Some)
            .ok_or_else(|| {
                OpsError::RelayKey(format!("{} is not a valid relay key file", path.display()))
            }),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(io(&path)(e)),
    }
}

/// [`offline_relay_key_if_any`] for a caller that needs the key. Errors: as it, and
/// [`OpsError::RelayKey`] when there is none.
pub fn offline_relay_key(dir: &Path) -> Result<HostKey, OpsError> {
    offline_relay_key_if_any(dir)?.ok_or_else(|| {
        OpsError::RelayKey(format!(
            "the relay key signs this command's receipt in the relay log, and there is none: \
             set {} (the seed from `agentmbx relay keygen` the relay runs with) or keep \
             relay.key in {}",
            crate::key::RELAY_KEY_ENV,
            dir.display()
        ))
    })
}

/// Why the relay-log receipt of an offline command on the store in `dir` is unsigned when
/// [`offline_relay_key_if_any`] found no key: the operator's warning (the change itself is
/// made — an emergency revocation must never wait for a key that lives elsewhere).
pub fn unsigned_receipt_reason(dir: &Path) -> String {
    format!(
        "the relay-log receipt of this command is UNSIGNED: neither {} nor relay.key in {} \
         holds the relay key, so it cannot be signed (`agentmbx relay log` marks it NOT \
         VERIFIED). The change itself is made. Set {} to the relay's key seed to sign the \
         receipts of offline commands",
        crate::key::RELAY_KEY_ENV,
        dir.display(),
        crate::key::RELAY_KEY_ENV
    )
}

/// Opens the store in `dir` for an offline operator command: `relay.lock` taken without
/// waiting, bound to and signing with `key` ([`SqliteStore::open_signed`]). Errors: the
/// store's ([`StoreError::Locked`] while a relay serves the store,
/// [`StoreError::OtherRelayKey`] for another relay's key…).
pub fn open_offline_signed(
    dir: &Path,
    key: HostKey,
    now_ms: i64,
) -> Result<SqliteStore, StoreError> {
    let lock = StoreLock::acquire(dir, 0, now_ms)?;
    let options = OpenOptions {
        lock_wait_ms: 0,
        ..OpenOptions::default()
    };
    SqliteStore::open_signed(lock, RelayOpSigner::shared(key), now_ms, options)
}

/// Why a relay operation did nothing.
#[derive(Debug, thiserror::Error)]
pub enum OpsError {
    /// The directory holds no relay store.
    #[error("{} holds no relay store (relay.db)", .0.display())]
    NoStore(PathBuf),
    /// The backup file exists already: a backup never overwrites a file.
    #[error("{} already exists, and a backup never overwrites a file: give another path", .0.display())]
    Exists(PathBuf),
    /// The copy failed its integrity check (the source store is damaged).
    #[error("the backup copy fails its integrity check: {0}")]
    Integrity(String),
    /// The source store stayed busy for the whole backup step.
    #[error("the relay store stayed busy during the backup; try again")]
    Busy,
    /// A file operation failed.
    #[error("{}: {source}", path.display())]
    Io {
        /// The path involved.
        path: PathBuf,
        /// The underlying error.
        #[source]
        source: std::io::Error,
    },
    /// The store failed.
    #[error(transparent)]
    Store(#[from] StoreError),
    /// The relay key that signs the receipt is missing or malformed ([`offline_relay_key`]).
    #[error("RELAY_KEY: {0}")]
    RelayKey(String),
}

impl From<MaintenanceError> for OpsError {
    fn from(e: MaintenanceError) -> Self {
        match e {
            MaintenanceError::Exists(path) => Self::Exists(path),
            MaintenanceError::Integrity(problems) => Self::Integrity(problems),
            MaintenanceError::Busy => Self::Busy,
            MaintenanceError::Io { path, source } => Self::Io { path, source },
            MaintenanceError::Store(e) => Self::Store(e),
            e @ (MaintenanceError::NotAStore(_) | MaintenanceError::SchemaTooNew { .. }) => {
                Self::Store(StoreError::Corrupt(e.to_string()))
            }
        }
    }
}

/// The backend the operator commands maintain a store directory with.
pub(crate) fn backend() -> &'static dyn StoreMaintenance {
    &SqliteMaintenance
}

pub(crate) fn io(path: &Path) -> impl FnOnce(std::io::Error) -> OpsError + '_ {
    move |source| OpsError::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// `path` made absolute against the current directory (not resolving links); `path` itself
/// when the current directory is unknown.
pub fn absolute(path: &Path) -> PathBuf {
    std::path::absolute(path).unwrap_or_else(|_| path.to_path_buf())
}

/// The receipts' `store`: the absolute path of `relay.db` in `dir`.
pub fn store_db(dir: &Path) -> String {
    absolute(&dir.join(DB_FILE)).display().to_string()
}

/// Whether a stored heartbeat rotates the epoch at `now_ms`: more than
/// [`HEARTBEAT_STALE_MS`] old or in the future. A store without a heartbeat (never served)
/// does not.
pub fn heartbeat_stale(heartbeat_ms: Option<i64>, now_ms: i64) -> bool {
    heartbeat_ms.is_some_and(|h| now_ms.abs_diff(h) > HEARTBEAT_STALE_MS.unsigned_abs())
}

/// Rotates the epoch with its receipt `{v:1, type:"relay-epoch-rotated", at, store, from, to,
/// by}` in one store transaction (relay log and `meta.epoch_rotated`); returns the receipt.
/// `store_db` is the receipt's `store` ([`store_db`]). Errors: the store's.
pub fn rotate_epoch(
    store: &dyn RelayStore,
    store_db: &str,
    by: RotatedBy,
    now_ms: i64,
) -> Result<Value, StoreError> {
    rotate_epoch_then(store, store_db, by, now_ms, |_| {})
}

/// [`rotate_epoch`], then `committed` with the rotation (`from`, `to`) once its transaction
/// committed (not called when it failed): a running relay announces `to` on its push streams
/// from there, on the same thread, without reading the epoch again. Errors: the store's.
pub fn rotate_epoch_then(
    store: &dyn RelayStore,
    store_db: &str,
    by: RotatedBy,
    now_ms: i64,
    committed: impl FnOnce(&EpochRotation),
) -> Result<Value, StoreError> {
    let log = OpEntry {
        at_ms: now_ms,
        op: OP_EPOCH_ROTATED.to_owned(),
        receipt: json!({"v": 1, "type": OP_EPOCH_ROTATED, "at": iso_ms(now_ms),
                        "store": store_db, "by": by.as_str()}),
    };
    let (rotation, receipt) = store.rotate_epoch_logged(log)?;
    tracing::info!(from = %rotation.from, to = %rotation.to, by = by.as_str(), "relay epoch rotated");
    committed(&rotation);
    Ok(receipt)
}

/// The start-up rule (spec §5): when the stored heartbeat is more than 10 min old or in the
/// future ([`heartbeat_stale`]), rotates the epoch (`by:"heartbeat"`), logs one WARN line with
/// the heartbeat, its age and both epochs, and returns the receipt; otherwise `None`.
pub fn rotate_if_stale(
    store: &dyn RelayStore,
    store_db: &str,
    now_ms: i64,
) -> Result<Option<Value>, StoreError> {
    let heartbeat = store.heartbeat()?;
    let Some(beat) = heartbeat.filter(|_| heartbeat_stale(heartbeat, now_ms)) else {
        return Ok(None);
    };
    let log = OpEntry {
        at_ms: now_ms,
        op: OP_EPOCH_ROTATED.to_owned(),
        receipt: json!({"v": 1, "type": OP_EPOCH_ROTATED, "at": iso_ms(now_ms),
                        "store": store_db, "by": RotatedBy::Heartbeat.as_str()}),
    };
    let (rotation, receipt) = store.rotate_epoch_logged(log)?;
    let age_ms = now_ms.saturating_sub(beat);
    tracing::warn!(
        heartbeat = %iso_ms(beat),
        age_ms,
        from = %rotation.from,
        to = %rotation.to,
        "the stored heartbeat is {} (more than 10 min from now): rotated the epoch, so senders \
         re-push and receivers re-pull (dedup absorbs the repeats)",
        if age_ms < 0 { "in the future".to_owned() } else { format!("{} s old", age_ms / 1_000) },
    );
    Ok(Some(receipt))
}

/// Lowercase hex SHA-256 of a file's bytes.
pub(crate) fn sha256_file(path: &Path) -> Result<String, OpsError> {
    use sha2::{Digest, Sha256};
    let mut f = std::fs::File::open(path).map_err(io(path))?;
    let mut hash = Sha256::new();
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        let n = f.read(&mut buf).map_err(io(path))?;
        if n == 0 {
            break;
        }
        hash.update(&buf[..n]);
    }
    Ok(hex::encode(hash.finalize()))
}

/// `relay backup <file>` (spec §5 "Backup", `wire.md` §3.4): copies the store in `dir` to
/// `file` (module docs for the steps) and returns the receipt `{v:1, type:"relay-backup", at,
/// store, file, bytes, sha256, epoch, relay_fingerprint, schema_version, heartbeat,
/// counts:{enrolments, revoked, items, bytes, dedup, targets}, restore}` (`bytes`: the file's
/// size; `counts.bytes`: the queued wire bytes; `heartbeat`: ISO ms or null). Works while the
/// relay serves; never writes the source store (the caller logs the receipt). `file` is made
/// absolute; its directory must exist.
///
/// Errors: [`OpsError::NoStore`], [`OpsError::Exists`] (nothing touched),
/// [`OpsError::Integrity`], [`OpsError::Busy`], I/O and SQLite errors. On every error no
/// partial file remains.
pub fn backup(dir: &Path, file: &Path, now_ms: i64) -> Result<Value, OpsError> {
    backup_with(backend(), dir, file, now_ms)
}

/// [`backup`] through the store backend `backend` instead of the one the relay runs on (the
/// conformance suite holds each backend to the backup and restore rules this way).
pub fn backup_with(
    backend: &dyn StoreMaintenance,
    dir: &Path,
    file: &Path,
    now_ms: i64,
) -> Result<Value, OpsError> {
    let src_path = dir.join(DB_FILE);
    if !src_path.is_file() {
        return Err(OpsError::NoStore(dir.to_path_buf()));
    }
    let dest = absolute(file);
    let facts = backend.backup(&src_path, &dest, Some("backup:before-rename"))?;
    let bytes = dest.metadata().map_err(io(&dest))?.len();
    let sha256 = sha256_file(&dest)?;
    let relay_fingerprint = facts.relay_pubkey.as_deref().map(|k| {
        agentmbx_protocol::keys::PublicKey::from_b64(k)
            .map(|p| p.fingerprint())
            .unwrap_or_default()
    });
    let dir_abs = absolute(dir);
    Ok(json!({
        "v": 1,
        "type": OP_BACKUP,
        "at": iso_ms(now_ms),
        "store": store_db(dir),
        "file": dest.display().to_string(),
        "bytes": bytes,
        "sha256": sha256,
        "epoch": facts.epoch,
        "relay_fingerprint": relay_fingerprint,
        "schema_version": facts.schema_version,
        "heartbeat": facts.heartbeat_ms.map(iso_ms),
        "counts": facts.counts.to_json(),
        "restore": format!("agentmbx relay restore {} --store-dir {}", dest.display(), dir_abs.display()),
    }))
}

/// Checks that `receipt` is a backup receipt of this relay before the admin endpoint logs it:
/// `v:1`, `type:"relay-backup"`, `relay_fingerprint` equal to `relay_fingerprint`, a 64-hex
/// `sha256`, a string `file`, at most 8 KiB of JSON. Errors name the first problem.
pub fn check_backup_receipt(receipt: &Value, relay_fingerprint: &str) -> Result<(), String> {
    if receipt.to_string().len() > 8 * 1024 {
        return Err("the backup receipt is larger than 8 KiB".to_owned());
    }
    if receipt["v"] != 1 || receipt["type"] != OP_BACKUP {
        return Err("not a relay-backup receipt (v:1, type:\"relay-backup\")".to_owned());
    }
    if receipt["relay_fingerprint"] != relay_fingerprint {
        return Err("the backup receipt is of another relay's store".to_owned());
    }
    let sha_ok = receipt["sha256"]
        .as_str()
        .is_some_and(|s| s.len() == 64 && s.bytes().all(|b| b.is_ascii_hexdigit()));
    if !sha_ok || !receipt["file"].is_string() || !receipt["at"].is_string() {
        return Err("the backup receipt needs at, file and a 64-hex sha256".to_owned());
    }
    Ok(())
}

/// The relay log of the store in `dir`, newest first, at most `limit` entries (clamped to
/// `1..=`[`OPS_KEEP`] `+` [`SWEEP_OPS_KEEP`], the whole log); read-only and without
/// `relay.lock`, so it works while the relay serves, and creating no `-wal`/`-shm` beside a
/// stopped store (the read-only open of `relay status`). A receipt that is not JSON is
/// returned as `null` (see [`read_verified_log`] for why). Errors: [`OpsError::NoStore`],
/// SQLite errors.
pub fn read_log(dir: &Path, limit: i64) -> Result<Vec<OpRecord>, OpsError> {
    Ok(read_raw_log(dir, limit)?
        .0
        .into_iter()
        .map(|(record, _)| record)
        .collect())
}

/// [`read_log`] with, for each entry whose receipt is not JSON, why.
/// (And the relay key the store records.)
type RawLog = (Vec<(OpRecord, Option<String>)>, Option<String>);

fn read_raw_log(dir: &Path, limit: i64) -> Result<RawLog, OpsError> {
    let path = absolute(&dir.join(DB_FILE));
    if !path.is_file() {
        return Err(OpsError::NoStore(dir.to_path_buf()));
    }
    let (rows, recorded) = backend().read_log(&path, limit.clamp(1, OPS_KEEP + SWEEP_OPS_KEEP))?;
    let entries = rows
        .into_iter()
        .map(|row| {
            let parsed = match row.receipt {
                Some(t) => serde_json::from_str::<Value>(&t)
                    .map_err(|e| format!("its receipt is not JSON: {e}")),
                None => Err("its receipt is not text".to_owned()),
            };
            let (receipt, problem) = match parsed {
                Ok(v) => (v, None),
                Err(why) => (Value::Null, Some(why)),
            };
            (
                OpRecord {
                    id: row.id,
                    at_ms: row.at_ms,
                    op: row.op,
                    receipt,
                },
                problem,
            )
        })
        .collect();
    Ok((entries, recorded))
}

/// A relay-log entry and whether its receipt verifies with the relay key.
#[derive(Debug, Clone, PartialEq)]
pub struct VerifiedOp {
    /// The entry.
    pub record: OpRecord,
    /// Its `sig` verifies with the key checked against ([`verify_receipt`]) and the signed
    /// receipt's `type` is the entry's `op`; false when unsigned, altered, unreadable, or no
    /// usable key is known.
    pub verified: bool,
    /// Why the entry cannot be shown as its receipt (the receipt is not JSON); `None` for a
    /// readable one. Such an entry is listed, never verified, and the rest of the log is
    /// still read.
    pub problem: Option<String>,
}

impl VerifiedOp {
    /// The operation to display: the signed receipt's own `type` when verified, else the
    /// entry's `op` column (which the signature does not cover).
    pub fn op(&self) -> &str {
        match self.record.receipt["type"].as_str() {
            Some(t) if self.verified => t,
            _ => &self.record.op,
        }
    }

    /// When, in ms, to display: the signed receipt's own `at` when verified and readable, else
    /// the entry's `at` column.
    pub fn at_ms(&self) -> i64 {
        self.record.receipt["at"]
            .as_str()
            .filter(|_| self.verified)
            .and_then(agentmbx_protocol::time::parse_iso_ms)
            .unwrap_or(self.record.at_ms)
    }
}

/// [`read_log`] with each receipt checked against the store's own `relay_pubkey`
/// ([`verify_receipt`]). Read-only, works while the relay serves. Errors: as [`read_log`].
pub fn read_verified_log(dir: &Path, limit: i64) -> Result<Vec<VerifiedOp>, OpsError> {
    Ok(read_verified_log_with(dir, limit, None)?.0)
}

/// `relay log`'s view: [`read_log`] with each receipt checked against `relay_key` when given
/// (the relay key from `MBX_RELAY_KEY` or `relay.key`), else against the store's own
/// `meta.relay_pubkey` — a store re-signed with another key and carrying that key never
/// verifies against the relay's own key. Returns the entries and, when `relay_key` differs
/// from the key the store records, a warning that says so (both fingerprints). An entry whose
/// receipt is not JSON is listed with its [`VerifiedOp::problem`]. Errors: as [`read_log`].
pub fn read_verified_log_with(
    dir: &Path,
    limit: i64,
    relay_key: Option<&PublicKey>,
) -> Result<(Vec<VerifiedOp>, Option<String>), OpsError> {
    let (records, recorded) = read_raw_log(dir, limit)?;
    let recorded_key = recorded
        .as_deref()
        .and_then(|k| PublicKey::from_b64(k).ok());
    let warning = relay_key.and_then(|k| {
        (recorded_key.as_ref() != Some(k)).then(|| {
            format!(
                "this store records relay key {} but the relay key is {}: the store was not \
                 written by this relay (or was altered); its receipts are checked against the \
                 relay key",
                recorded_key
                    .as_ref()
                    .map_or_else(|| "none".to_owned(), PublicKey::fingerprint),
                k.fingerprint()
            )
        })
    });
    let key = relay_key.cloned().or(recorded_key);
    let entries = records
        .into_iter()
        .map(|(record, problem)| VerifiedOp {
            verified: problem.is_none()
                && record.receipt["type"].as_str() == Some(record.op.as_str())
                && key
                    .as_ref()
                    .is_some_and(|k| verify_receipt(&record.receipt, k)),
            record,
            problem,
        })
        .collect();
    Ok((entries, warning))
}

/// The summary of a relay-log entry for `relay log`'s text line `<at>  <op>  <summary>`.
pub fn summary(op: &OpRecord) -> String {
    let r = &op.receipt;
    let s = |k: &str| r[k].as_str().unwrap_or("").to_owned();
    match op.op.as_str() {
        _ if r.is_null() => "(unreadable receipt)".to_owned(),
        OP_EPOCH_ROTATED => format!("{} -> {} (by {})", s("from"), s("to"), s("by")),
        OP_BACKUP => format!(
            "{} ({} bytes, {} items, sha256 {})",
            s("file"),
            r["bytes"],
            r["counts"]["items"],
            s("sha256").get(..16).unwrap_or("")
        ),
        OP_RESTORE => {
            let undo = r["rollback"]
                .as_str()
                .map_or_else(String::new, |u| format!("; undo: {u}"));
            format!(
                "{} epoch {} -> {}{undo}",
                r["backup"]["file"].as_str().unwrap_or(""),
                r["epoch"]["from"].as_str().unwrap_or(""),
                r["epoch"]["to"].as_str().unwrap_or("")
            )
        }
        "relay-revoke" => format!("{} ({})", s("fingerprint"), s("host_name")),
        "relay-deny" => format!(
            "{} {} until {}",
            s("kind"),
            s("value"),
            r["until"].as_str().unwrap_or("removed")
        ),
        "relay-undeny" => format!("{} {}", s("kind"), s("value")),
        _ => {
            let mut shown = r.clone();
            if let Some(fields) = shown.as_object_mut() {
                fields.remove("sig");
            }
            let mut text = shown.to_string();
            if text.len() > 200 {
                let cut = (0..=200)
                    .rev()
                    .find(|&i| text.is_char_boundary(i))
                    .unwrap_or(0);
                text.truncate(cut);
                text.push('…');
            }
            text
        }
    }
}

#[cfg(test)]
mod tests;
