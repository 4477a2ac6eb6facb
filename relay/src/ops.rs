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
//! - **The online backup** ([`backup`]): the SQLite online backup API in one step (one
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

use rusqlite::{Connection, OpenFlags, OptionalExtension};
use serde_json::{json, Value};

use agentmbx_protocol::keys::{HostKey, KeyFile, PublicKey};
use agentmbx_protocol::time::iso_ms;

use crate::store::{
    OpEntry, OpRecord, OpSigner, OpenOptions, RelayStore, SqliteStore, StoreError, StoreLock,
    DB_FILE, OPS_KEEP, SWEEP_OPS_KEEP,
};

mod restore;

pub use restore::{
    check_backup_path, restore, restored_from, RestoreError, RestoreOptions, LIVE_HEARTBEAT_MS,
    OP_RESTORE, RESTORE_FROM_ENV, ROLLBACK_DIR,
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
    /// SQLite failed.
    #[error("relay store database error: {0}")]
    Sqlite(#[from] rusqlite::Error),
    /// The store failed.
    #[error(transparent)]
    Store(#[from] StoreError),
    /// The relay key that signs the receipt is missing or malformed ([`offline_relay_key`]).
    #[error("RELAY_KEY: {0}")]
    RelayKey(String),
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
    let log = OpEntry {
        at_ms: now_ms,
        op: OP_EPOCH_ROTATED.to_owned(),
        receipt: json!({"v": 1, "type": OP_EPOCH_ROTATED, "at": iso_ms(now_ms),
                        "store": store_db, "by": by.as_str()}),
    };
    let (rotation, receipt) = store.rotate_epoch_logged(log)?;
    tracing::info!(from = %rotation.from, to = %rotation.to, by = by.as_str(), "relay epoch rotated");
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

/// Removes the partial backup file (and any journal next to it) unless disarmed.
struct Partial {
    path: PathBuf,
    armed: bool,
}

impl Drop for Partial {
    fn drop(&mut self) {
        if !self.armed {
            return;
        }
        for suffix in ["", "-journal", "-wal", "-shm"] {
            let mut p = self.path.clone().into_os_string();
            p.push(suffix);
            let _ = std::fs::remove_file(PathBuf::from(p));
        }
    }
}

/// `fsync` of a file or directory.
pub(crate) fn fsync(path: &Path) -> Result<(), OpsError> {
    std::fs::File::open(path)
        .and_then(|f| f.sync_all())
        .map_err(io(path))
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

/// A store's facts for the backup receipt: `(epoch, relay_pubkey, schema_version, heartbeat ms,
/// counts)`.
pub(crate) type Facts = (
    Option<String>,
    Option<String>,
    u32,
    Option<i64>,
    serde_json::Map<String, Value>,
);

pub(crate) fn facts(c: &Connection) -> Result<Facts, OpsError> {
    let meta = |k: &str| -> Result<Option<String>, OpsError> {
        Ok(
            c.query_row("SELECT v FROM meta WHERE k = ?1", [k], |r| r.get(0))
                .optional()?,
        )
    };
    let n = |sql: &str| -> Result<i64, OpsError> { Ok(c.query_row(sql, [], |r| r.get(0))?) };
    let mut counts = serde_json::Map::new();
    for (name, sql) in [
        (
            "enrolments",
            "SELECT COUNT(*) FROM enrolments WHERE revoked_at IS NULL",
        ),
        (
            "revoked",
            "SELECT COUNT(*) FROM enrolments WHERE revoked_at IS NOT NULL",
        ),
        ("items", "SELECT COUNT(*) FROM items"),
        ("bytes", "SELECT COALESCE(SUM(bytes), 0) FROM items"),
        ("dedup", "SELECT COUNT(*) FROM dedup"),
        ("targets", "SELECT COUNT(DISTINCT target_pubkey) FROM items"),
    ] {
        counts.insert(name.to_owned(), json!(n(sql)?));
    }
    let heartbeat = meta("heartbeat")?.and_then(|v| v.trim().parse::<i64>().ok());
    Ok((
        meta("epoch")?,
        meta("relay_pubkey")?,
        crate::store::stored_version(c)?,
        heartbeat,
        counts,
    ))
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
    let src_path = dir.join(DB_FILE);
    if !src_path.is_file() {
        return Err(OpsError::NoStore(dir.to_path_buf()));
    }
    let dest = absolute(file);
    let src = Connection::open_with_flags(
        &src_path,
        OpenFlags::SQLITE_OPEN_READ_ONLY | OpenFlags::SQLITE_OPEN_NO_MUTEX,
    )?;
    src.busy_timeout(std::time::Duration::from_secs(5))?;
    let (epoch, relay_pubkey, schema_version, heartbeat, counts) =
        online_copy(&src, &dest, Some("backup:before-rename"))?;
    drop(src);
    let bytes = dest.metadata().map_err(io(&dest))?.len();
    let sha256 = sha256_file(&dest)?;
    let relay_fingerprint = relay_pubkey.as_deref().map(|k| {
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
        "epoch": epoch,
        "relay_fingerprint": relay_fingerprint,
        "schema_version": schema_version,
        "heartbeat": heartbeat.map(iso_ms),
        "counts": counts,
        "restore": format!("agentmbx relay restore {} --store-dir {}", dest.display(), dir_abs.display()),
    }))
}

/// Copies the database `src` is connected to into the new file `dest` (absolute; its directory
/// must exist) with the SQLite online backup API in one step: `<dest>.partial-<pid>` (0600),
/// switched to the rollback journal, integrity-checked, fsynced, hard-linked to `dest` (never
/// replacing a name), directory fsynced; returns the copy's facts. `failpoint` is hit just
/// before the copy gets its name. Errors: [`OpsError::Exists`] (nothing touched),
/// [`OpsError::Integrity`], [`OpsError::Busy`], I/O and SQLite errors; no partial file remains
/// on any error.
pub(crate) fn online_copy(
    src: &Connection,
    dest: &Path,
    failpoint: Option<&str>,
) -> Result<Facts, OpsError> {
    if dest.symlink_metadata().is_ok() {
        return Err(OpsError::Exists(dest.to_path_buf()));
    }
    // Partial copies to this name that a killed run left behind (their process is gone).
    if let (Some(parent), Some(name)) = (dest.parent(), dest.file_name()) {
        let name = name.to_string_lossy();
        restore::remove_dead_partials(parent, |base| base == name);
    }
    let mut partial_name = dest.to_path_buf().into_os_string();
    partial_name.push(format!(".partial-{}", std::process::id()));
    let partial = Partial {
        path: PathBuf::from(partial_name),
        armed: true,
    };
    // A leftover of an earlier run with this pid is ours to replace.
    drop(Partial {
        path: partial.path.clone(),
        armed: true,
    });
    {
        use std::os::unix::fs::OpenOptionsExt as _;
        std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&partial.path)
            .map_err(io(&partial.path))?;
    }
    let mut copy = Connection::open(&partial.path)?;
    {
        use rusqlite::backup::{Backup, StepResult};
        let b = Backup::new_with_names(src, rusqlite::MAIN_DB, &mut copy, rusqlite::MAIN_DB)?;
        // One step of every page: one consistent snapshot even while the relay writes.
        match b.step(-1)? {
            StepResult::Done => {}
            _ => return Err(OpsError::Busy),
        }
    }
    let _mode: String = copy.query_row("PRAGMA journal_mode = DELETE", [], |r| r.get(0))?;
    let problems: Vec<String> = copy
        .prepare("PRAGMA integrity_check")?
        .query_map([], |r| r.get::<_, String>(0))?
        .collect::<Result<_, _>>()?;
    if problems != ["ok"] {
        return Err(OpsError::Integrity(problems.join("; ")));
    }
    let facts = facts(&copy)?;
    copy.close().map_err(|(_, e)| OpsError::Sqlite(e))?;
    if let Some(name) = failpoint {
        agentmbx_protocol::failpoint::hit(name);
    }
    fsync(&partial.path)?;
    // A hard link never replaces an existing name (EEXIST), unlike rename.
    match std::fs::hard_link(&partial.path, dest) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
            return Err(OpsError::Exists(dest.to_path_buf()))
        }
        Err(e) => return Err(io(dest)(e)),
    }
    drop(partial);
    let parent = dest.parent().unwrap_or(Path::new("/"));
    fsync(parent)?;
    Ok(facts)
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
    let c = crate::status::open_read_only(&path)?;
    let recorded: Option<String> = c
        .query_row("SELECT v FROM meta WHERE k = 'relay_pubkey'", [], |r| {
            r.get(0)
        })
        .optional()?;
    let mut st = c.prepare("SELECT id, at, op, receipt FROM ops ORDER BY id DESC LIMIT ?1")?;
    let rows = st
        .query_map([limit.clamp(1, OPS_KEEP + SWEEP_OPS_KEEP)], |r| {
            Ok((
                r.get::<_, i64>(0)?,
                r.get::<_, i64>(1)?,
                r.get::<_, String>(2)?,
                r.get::<_, rusqlite::types::Value>(3)?,
            ))
        })?
        .collect::<Result<Vec<_>, _>>()?;
    let entries = rows
        .into_iter()
        .map(|(id, at_ms, op, receipt)| {
            let parsed = match receipt {
                rusqlite::types::Value::Text(t) => serde_json::from_str::<Value>(&t)
                    .map_err(|e| format!("its receipt is not JSON: {e}")),
                _ => Err("its receipt is not text".to_owned()),
            };
            let (receipt, problem) = match parsed {
                Ok(v) => (v, None),
                Err(why) => (Value::Null, Some(why)),
            };
            (
                OpRecord {
                    id,
                    at_ms,
                    op,
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
mod tests {
    use super::*;
    use crate::store::{DirectoryStore, ItemStore, OperationsStore, SqliteStore, StoreHealth};

    fn relay_key() -> String {
        agentmbx_protocol::keys::HostKey::generate()
            .public()
            .to_b64()
    }

    #[test]
    fn sweep_receipts_have_their_own_cap_and_never_evict_the_other_operations() {
        use crate::store::OP_SWEEP;
        let dir = tempfile::tempdir().expect("tempdir");
        let store = SqliteStore::open(dir.path(), &relay_key(), 1).expect("open");
        let append = |op: &str, i: i64| {
            store
                .append_op(i, op, &json!({"v": 1, "type": op, "i": i}))
                .expect("append")
        };
        let count = |op: &str| {
            let log = read_log(dir.path(), 5_000).expect("log");
            log.iter().filter(|o| o.op == op).count() as i64
        };
        for i in 0..3 {
            append(OP_RESTORE, i);
        }
        // At the sweep cap every sweep receipt is kept; past it the oldest go, and only they.
        for i in 0..SWEEP_OPS_KEEP {
            append(OP_SWEEP, 10 + i);
        }
        assert_eq!(count(OP_SWEEP), SWEEP_OPS_KEEP);
        for i in 0..250 {
            append(OP_SWEEP, 1_000 + i);
        }
        assert_eq!(count(OP_SWEEP), SWEEP_OPS_KEEP);
        assert_eq!(count(OP_RESTORE), 3, "sweeps never evict a restore");
        let log = read_log(dir.path(), 5_000).expect("log");
        let oldest_sweep = log
            .iter()
            .filter(|o| o.op == OP_SWEEP)
            .map(|o| o.at_ms)
            .min();
        assert_eq!(oldest_sweep, Some(1_000 + 250 - SWEEP_OPS_KEEP));
        // The other operations keep OPS_KEEP between them: at the cap all of them, past it the
        // oldest go; the sweep receipts stay.
        for i in 0..(OPS_KEEP - 3) {
            append(OP_BACKUP, 10_000 + i);
        }
        assert_eq!(count(OP_RESTORE), 3);
        assert_eq!(count(OP_BACKUP), OPS_KEEP - 3);
        append(OP_BACKUP, 20_000);
        assert_eq!(count(OP_RESTORE), 2, "the oldest other entry goes");
        assert_eq!(count(OP_SWEEP), SWEEP_OPS_KEEP);
        let log = read_log(dir.path(), 5_000).expect("log");
        assert_eq!(
            log.len() as i64,
            OPS_KEEP + SWEEP_OPS_KEEP,
            "the whole log is read"
        );
        assert!(log.windows(2).all(|w| w[0].id > w[1].id), "newest first");
        assert_eq!(store.ops(5_000).expect("ops").len(), log.len());
        store.close().expect("close");
    }

    #[test]
    fn the_heartbeat_rule_holds_at_ten_minutes_and_rotates_past_it_either_way() {
        let now = 1_800_000_000_000;
        assert!(!heartbeat_stale(None, now));
        assert!(!heartbeat_stale(Some(now), now));
        assert!(!heartbeat_stale(Some(now - HEARTBEAT_STALE_MS), now));
        assert!(heartbeat_stale(Some(now - HEARTBEAT_STALE_MS - 1), now));
        assert!(!heartbeat_stale(Some(now + HEARTBEAT_STALE_MS), now));
        assert!(heartbeat_stale(Some(now + HEARTBEAT_STALE_MS + 1), now));
        assert!(heartbeat_stale(Some(i64::MIN), now));
        assert!(heartbeat_stale(Some(i64::MAX), i64::MIN));
    }

    #[test]
    fn a_stale_or_future_heartbeat_rotates_the_epoch_with_its_receipt() {
        let dir = tempfile::tempdir().expect("tempdir");
        let store = SqliteStore::open(dir.path(), &relay_key(), 1).expect("open");
        let db = store_db(dir.path());
        let now = 1_800_000_000_000;
        // No heartbeat, a fresh one, one at the bound: nothing.
        assert_eq!(rotate_if_stale(&store, &db, now).expect("none"), None);
        for beat in [
            now - 1_000,
            now - HEARTBEAT_STALE_MS,
            now + HEARTBEAT_STALE_MS,
        ] {
            store.set_heartbeat(beat).expect("beat");
            assert_eq!(rotate_if_stale(&store, &db, now).expect("fresh"), None);
        }
        assert!(store.ops(10).expect("ops").is_empty());
        let epoch0 = store.epoch().expect("epoch");

        // Past the bound, old then in the future: rotated each time, logged, meta written.
        let mut last = epoch0;
        for beat in [now - HEARTBEAT_STALE_MS - 1, now + HEARTBEAT_STALE_MS + 1] {
            store.set_heartbeat(beat).expect("beat");
            let r = rotate_if_stale(&store, &db, now)
                .expect("rotate")
                .expect("rotated");
            let epoch = store.epoch().expect("epoch");
            assert_ne!(epoch, last);
            assert_eq!(r["v"], 1);
            assert_eq!(r["type"], "relay-epoch-rotated");
            assert_eq!(r["by"], "heartbeat");
            assert_eq!(r["from"], last.as_str());
            assert_eq!(r["to"], epoch.as_str());
            assert_eq!(r["store"], db.as_str());
            assert_eq!(r["at"], iso_ms(now).as_str());
            let logged = &store.ops(1).expect("ops")[0];
            assert_eq!(logged.op, "relay-epoch-rotated");
            assert_eq!(logged.receipt, r);
            let meta: Value =
                serde_json::from_str(&store.meta("epoch_rotated").expect("meta").expect("set"))
                    .expect("json");
            assert_eq!(meta, r);
            last = epoch;
        }
        let r = rotate_epoch(&store, &db, RotatedBy::Operator, now + 5).expect("operator");
        assert_eq!(r["by"], "operator");
        assert_eq!(r["from"], last.as_str());
        assert_eq!(store.ops(10).expect("ops").len(), 3);
    }

    #[test]
    fn an_epoch_rotation_and_its_receipt_are_one_transaction() {
        let dir = tempfile::tempdir().expect("tempdir");
        let store = SqliteStore::open(dir.path(), &relay_key(), 1).expect("open");
        let epoch = store.epoch().expect("epoch");
        store.close().expect("close");
        let raw = Connection::open(dir.path().join(DB_FILE)).expect("raw");
        raw.execute_batch(
            "CREATE TRIGGER no_log BEFORE INSERT ON ops BEGIN SELECT RAISE(ABORT, 'no log'); END;",
        )
        .expect("trigger");
        let store = SqliteStore::open(dir.path(), &relay_key_of(dir.path()), 2).expect("open");
        assert!(rotate_epoch(&store, "x", RotatedBy::Operator, 2).is_err());
        assert_eq!(store.epoch().expect("epoch"), epoch);
        assert_eq!(store.meta("epoch_rotated").expect("meta"), None);
    }

    fn relay_key_of(dir: &Path) -> String {
        SqliteStore::recorded_relay_pubkey(dir)
            .expect("read")
            .expect("key")
    }

    fn enrol_and_push(store: &SqliteStore, n: usize) -> String {
        use crate::store::{AuthorityStrength, EnrolRequest, PushBatch, PushItem, PushTarget};
        let target = relay_key();
        store
            .enrol(EnrolRequest {
                host_pubkey: target.clone(),
                host_name: "beta".into(),
                owner_fp: String::new(),
                account: None,
                authorized_by: "host-key-challenge".into(),
                strength: AuthorityStrength::HostKeyChallenge,
                now_ms: 1,
            })
            .expect("enrol");
        for i in 0..n {
            store
                .push(PushBatch {
                    sender_pubkey: relay_key(),
                    sender_host: "alpha".into(),
                    now_ms: 10 + i as i64,
                    expiry: crate::store::Expiry::Never,
                    items: vec![PushItem {
                        item_id: format!("item-{i}"),
                        kind: "envelope".into(),
                        targets: vec![PushTarget {
                            target_pubkey: target.clone(),
                            wire: format!("wire {i}").into_bytes(),
                        }],
                    }],
                })
                .expect("push");
        }
        target
    }

    #[test]
    fn a_backup_is_a_checked_store_with_the_same_items_and_a_matching_receipt() {
        let dir = tempfile::tempdir().expect("tempdir");
        let out = tempfile::tempdir().expect("out");
        let store = SqliteStore::open(dir.path(), &relay_key(), 1).expect("open");
        let target = enrol_and_push(&store, 5);
        store.set_heartbeat(1_234).expect("beat");
        let file = out.path().join("b.db");
        // While the store is open (as while serving).
        let r = backup(dir.path(), &file, 99).expect("backup");
        assert_eq!(r["type"], "relay-backup");
        assert_eq!(r["file"], file.display().to_string().as_str());
        assert_eq!(r["epoch"], store.epoch().expect("epoch").as_str());
        assert_eq!(r["heartbeat"], iso_ms(1_234).as_str());
        assert_eq!(r["schema_version"], crate::store::SCHEMA_VERSION);
        let bytes = std::fs::read(&file).expect("read");
        assert_eq!(r["bytes"], bytes.len());
        assert_eq!(r["sha256"], crate::store::wire_hash(&bytes).as_str());
        assert_eq!(
            r["counts"],
            json!({"enrolments": 1, "revoked": 0, "items": 5, "bytes": 30, "dedup": 5, "targets": 1})
        );
        assert!(r["restore"]
            .as_str()
            .expect("restore")
            .starts_with("agentmbx relay restore "));
        // The copy is self-contained (rollback journal) and holds the same items.
        let c = Connection::open(&file).expect("open copy");
        let mode: String = c
            .query_row("PRAGMA journal_mode", [], |r| r.get(0))
            .expect("mode");
        assert_eq!(mode, "delete");
        let wires: Vec<Vec<u8>> = c
            .prepare("SELECT wire FROM items WHERE target_pubkey = ?1 ORDER BY seq")
            .expect("prep")
            .query_map([&target], |r| r.get(0))
            .expect("q")
            .collect::<Result<_, _>>()
            .expect("rows");
        let want: Vec<Vec<u8>> = (0..5).map(|i| format!("wire {i}").into_bytes()).collect();
        assert_eq!(wires, want);
        drop(c);
        // It opens as a store of this relay.
        let copy_dir = tempfile::tempdir().expect("copy dir");
        std::fs::copy(&file, copy_dir.path().join(DB_FILE)).expect("copy");
        // (More than 90 s after its heartbeat: a copy without relay.lock and a fresher
        // heartbeat may have a relay on it.)
        let opened =
            SqliteStore::open(copy_dir.path(), &relay_key_of(dir.path()), 100_000).expect("opens");
        assert_eq!(
            opened.epoch().expect("epoch"),
            store.epoch().expect("epoch")
        );
        assert_eq!(opened.info_for(&target).expect("info").head_seq, {
            store.info_for(&target).expect("info").head_seq
        });
        // Nothing else left behind.
        let names: Vec<String> = std::fs::read_dir(out.path())
            .expect("ls")
            .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
            .collect();
        assert_eq!(names, ["b.db"]);
    }

    #[test]
    fn an_existing_file_is_refused_and_untouched_and_no_partial_file_remains_on_failure() {
        let dir = tempfile::tempdir().expect("tempdir");
        let out = tempfile::tempdir().expect("out");
        let store = SqliteStore::open(dir.path(), &relay_key(), 1).expect("open");
        enrol_and_push(&store, 1);
        let file = out.path().join("taken.db");
        std::fs::write(&file, b"mine").expect("write");
        match backup(dir.path(), &file, 1) {
            Err(e @ OpsError::Exists(_)) => {
                assert!(e.to_string().contains("already exists"), "{e}")
            }
            other => panic!("{other:?}"),
        }
        assert_eq!(std::fs::read(&file).expect("read"), b"mine");
        // A dangling symlink is a name that exists too.
        let link = out.path().join("link.db");
        std::os::unix::fs::symlink(out.path().join("nowhere"), &link).expect("symlink");
        assert!(matches!(
            backup(dir.path(), &link, 1),
            Err(OpsError::Exists(_))
        ));
        // No store.
        assert!(matches!(
            backup(&dir.path().join("none"), &out.path().join("x.db"), 1),
            Err(OpsError::NoStore(_))
        ));
        // A source that is not a database fails after the partial file was created: it is gone.
        let bad = tempfile::tempdir().expect("bad");
        std::fs::write(bad.path().join(DB_FILE), vec![7u8; 8192]).expect("junk");
        assert!(backup(bad.path(), &out.path().join("y.db"), 1).is_err());
        let mut names: Vec<String> = std::fs::read_dir(out.path())
            .expect("ls")
            .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
            .collect();
        names.sort();
        assert_eq!(names, ["link.db", "taken.db"]);
        // A missing directory: an I/O error, nothing created.
        assert!(matches!(
            backup(dir.path(), &out.path().join("no/such/dir.db"), 1),
            Err(OpsError::Io { .. })
        ));
    }

    #[test]
    fn the_log_reads_newest_first_without_the_lock_and_summarises_each_op() {
        let dir = tempfile::tempdir().expect("tempdir");
        let store = SqliteStore::open(dir.path(), &relay_key(), 1).expect("open");
        for i in 0..3 {
            rotate_epoch(&store, "s", RotatedBy::Operator, 10 + i).expect("rotate");
        }
        // The store (holding relay.lock) is open: the log still reads.
        let log = read_log(dir.path(), 2).expect("log");
        assert_eq!(log.len(), 2);
        assert!(log[0].id > log[1].id);
        assert_eq!(log[0].at_ms, 12);
        let text = summary(&log[0]);
        assert!(
            text.contains(" -> ") && text.ends_with("(by operator)"),
            "{text}"
        );
        assert_eq!(read_log(dir.path(), 0).expect("clamped").len(), 1);
        assert_eq!(read_log(dir.path(), 5_000).expect("clamped").len(), 3);
        assert!(matches!(
            read_log(&dir.path().join("none"), 5),
            Err(OpsError::NoStore(_))
        ));
    }

    #[test]
    fn every_receipt_a_signed_store_appends_verifies_and_an_altered_one_does_not() {
        use crate::store::{DenyEntry, DenyKind};
        let dir = tempfile::tempdir().expect("tempdir");
        let key = HostKey::generate();
        std::fs::write(dir.path().join("relay.key"), key.to_key_file().to_text()).expect("key");
        // A store that never saw the key: created unsigned, then opened offline with it.
        let first = SqliteStore::open(dir.path(), &key.public().to_b64(), 1).expect("open");
        first
            .append_op(1, "relay-backup", &json!({"v": 1}))
            .expect("unsigned");
        first.close().expect("close");
        let loaded = offline_relay_key(dir.path()).expect("relay.key");
        assert_eq!(loaded.public(), key.public());
        let store = open_offline_signed(dir.path(), loaded, 2).expect("signed");
        let rotated = rotate_epoch(&store, "s", RotatedBy::Operator, 3).expect("rotate");
        assert!(verify_receipt(&rotated, &key.public()), "{rotated}");
        // A caller's `sig` is never kept: the store signs.
        store
            .append_op(
                4,
                OP_BACKUP,
                &json!({"v": 1, "type": OP_BACKUP, "sig": "forged"}),
            )
            .expect("append");
        store
            .deny_logged(
                DenyEntry {
                    kind: DenyKind::Client,
                    value: "c".into(),
                    until_ms: None,
                    at_ms: 5,
                },
                OpEntry {
                    at_ms: 5,
                    op: "relay-deny".into(),
                    receipt: json!({"v": 1, "type": "relay-deny"}),
                },
            )
            .expect("deny");
        let meta: Value =
            serde_json::from_str(&store.meta("epoch_rotated").expect("meta").expect("set"))
                .expect("json");
        assert_eq!(meta, rotated, "meta keeps the signed receipt");
        store.close().expect("close");

        let log = read_verified_log(dir.path(), 10).expect("log");
        let seen: Vec<(&str, bool)> = log
            .iter()
            .map(|e| (e.record.op.as_str(), e.verified))
            .collect();
        assert_eq!(
            seen,
            [
                ("relay-deny", true),
                (OP_BACKUP, true),
                (OP_EPOCH_ROTATED, true),
                (OP_BACKUP, false)
            ]
        );
        assert_ne!(log[1].record.receipt["sig"], "forged");
        assert!(!summary(&log[1].record).contains("sig"));

        // One changed byte of a receipt, or another key: no longer verified.
        let raw = Connection::open(dir.path().join(DB_FILE)).expect("raw");
        raw.execute(
            "UPDATE ops SET receipt = replace(receipt, '\"v\":1', '\"v\":2') WHERE op = 'relay-deny'",
            [],
        )
        .expect("tamper");
        let log = read_verified_log(dir.path(), 10).expect("log");
        assert!(!log[0].verified);
        assert!(log[1].verified);
        assert!(!verify_receipt(
            &log[1].record.receipt,
            &HostKey::generate().public()
        ));
    }

    /// The retention sweep appends its `relay-sweep` receipt through the store like every
    /// other operation: signed too, without knowing about signatures.
    #[test]
    fn the_sweep_receipt_is_signed_like_every_other() {
        use crate::store::{
            AuthorityStrength, EnrolRequest, Expiry, PushBatch, PushItem, PushTarget, DAY_MS,
        };
        let dir = tempfile::tempdir().expect("tempdir");
        let key = HostKey::generate();
        let store = open_offline_signed(dir.path(), key.clone(), 1).expect("signed");
        let (target, sender) = (relay_key(), relay_key());
        store
            .enrol(EnrolRequest {
                host_pubkey: target.clone(),
                host_name: "beta".into(),
                owner_fp: String::new(),
                account: None,
                authorized_by: "host-key-challenge".into(),
                strength: AuthorityStrength::HostKeyChallenge,
                now_ms: 1,
            })
            .expect("enrol");
        store
            .push(PushBatch {
                sender_pubkey: sender,
                sender_host: "alpha".into(),
                now_ms: 10,
                expiry: Expiry::Retention,
                items: vec![PushItem {
                    item_id: "old".into(),
                    kind: "receipt".into(),
                    targets: vec![PushTarget {
                        target_pubkey: target,
                        wire: b"wire".to_vec(),
                    }],
                }],
            })
            .expect("push");
        let notices: std::sync::Arc<dyn crate::store::NoticeSigner> =
            std::sync::Arc::new(crate::retention::RelayNoticeSigner::new(key.clone()));
        let report = store.sweep(10 + 15 * DAY_MS, notices).expect("sweep");
        assert!(report.logged, "{report:?}");
        store.close().expect("close");
        let log = read_verified_log(dir.path(), 5).expect("log");
        assert_eq!(log[0].record.op, crate::store::OP_SWEEP);
        assert!(log[0].verified, "{:?}", log[0]);
        assert!(verify_receipt(&log[0].record.receipt, &key.public()));
    }

    #[test]
    fn the_offline_relay_key_is_never_created() {
        let dir = tempfile::tempdir().expect("tempdir");
        if crate::key::read_env_seed().is_some() {
            return; // The environment names a key: that one wins, nothing to check here.
        }
        match offline_relay_key(dir.path()) {
            Err(e @ OpsError::RelayKey(_)) => {
                assert!(e.to_string().contains("MBX_RELAY_KEY"), "{e}")
            }
            other => panic!("{other:?}"),
        }
        // None at all is no error for a command that may run unsigned.
        assert!(offline_relay_key_if_any(dir.path())
            .expect("no key")
            .is_none());
        let why = unsigned_receipt_reason(dir.path());
        assert!(
            why.contains("UNSIGNED") && why.contains("MBX_RELAY_KEY"),
            "{why}"
        );
        assert!(!dir.path().join("relay.key").exists());
        // A malformed key is an error either way: it must be fixed, not ignored.
        std::fs::write(dir.path().join("relay.key"), "{\"publicKey\":\"x\"}").expect("bad");
        let e = offline_relay_key(dir.path()).expect_err("malformed");
        assert!(e.to_string().contains("not a valid relay key file"), "{e}");
        assert!(offline_relay_key_if_any(dir.path()).is_err());
    }

    #[test]
    fn only_this_relays_backup_receipts_pass_the_admin_check() {
        let good = json!({"v": 1, "type": "relay-backup", "relay_fingerprint": "abcd-ef01-2345-6789",
                          "sha256": "a".repeat(64), "file": "/b.db", "at": "2026-01-01T00:00:00.000Z"});
        check_backup_receipt(&good, "abcd-ef01-2345-6789").expect("good");
        assert!(check_backup_receipt(&good, "0000-0000-0000-0000").is_err());
        let mut bad = good.clone();
        bad["type"] = json!("relay-restore");
        assert!(check_backup_receipt(&bad, "abcd-ef01-2345-6789").is_err());
        let mut bad = good.clone();
        bad["sha256"] = json!("zz");
        assert!(check_backup_receipt(&bad, "abcd-ef01-2345-6789").is_err());
        let mut big = good;
        big["pad"] = json!("x".repeat(9_000));
        assert!(check_backup_receipt(&big, "abcd-ef01-2345-6789").is_err());
    }

    fn ls(dir: &Path) -> Vec<String> {
        let mut names: Vec<String> = std::fs::read_dir(dir)
            .expect("ls")
            .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
            .collect();
        names.sort();
        names
    }

    #[test]
    fn a_killed_backups_partial_file_is_removed_by_the_next_backup_to_that_name() {
        let dir = tempfile::tempdir().expect("tempdir");
        let out = tempfile::tempdir().expect("out");
        let store = SqliteStore::open(dir.path(), &relay_key(), 1).expect("open");
        enrol_and_push(&store, 1);
        // pid_max is at most 4194304: that pid never runs; pid 1 always does.
        for name in [
            "b.db.partial-4194304",
            "b.db.partial-4194304-journal",
            "b.db.partial-1",
            "c.db.partial-4194304",
        ] {
            std::fs::write(out.path().join(name), b"x").expect("write");
        }
        backup(dir.path(), &out.path().join("b.db"), 1).expect("backup");
        assert_eq!(
            ls(out.path()),
            ["b.db", "b.db.partial-1", "c.db.partial-4194304"]
        );
    }

    #[test]
    fn an_unreadable_receipt_is_listed_and_the_rest_of_the_log_still_reads_and_verifies() {
        let dir = tempfile::tempdir().expect("tempdir");
        let key = HostKey::generate();
        let store = open_offline_signed(dir.path(), key.clone(), 1).expect("signed");
        for i in 0..3 {
            rotate_epoch(&store, "s", RotatedBy::Operator, 10 + i).expect("rotate");
        }
        store.close().expect("close");
        let raw = Connection::open(dir.path().join(DB_FILE)).expect("raw");
        raw.execute(
            "UPDATE ops SET receipt = 'not json {' WHERE id = (SELECT MIN(id) FROM ops)",
            [],
        )
        .expect("garble");
        drop(raw);
        let log = read_verified_log(dir.path(), 10).expect("log");
        assert_eq!(log.len(), 3);
        assert_eq!(
            log.iter().map(|e| e.verified).collect::<Vec<_>>(),
            [true, true, false]
        );
        assert!(log[2]
            .problem
            .as_deref()
            .is_some_and(|p| p.contains("not JSON")));
        assert_eq!(summary(&log[2].record), "(unreadable receipt)");
        assert!(log[0].problem.is_none());
        assert_eq!(read_log(dir.path(), 10).expect("plain").len(), 3);
    }

    #[test]
    fn the_op_and_at_shown_are_the_signed_ones_and_the_relay_key_decides_what_verifies() {
        let dir = tempfile::tempdir().expect("tempdir");
        let key = HostKey::generate();
        let store = open_offline_signed(dir.path(), key.clone(), 1).expect("signed");
        rotate_epoch(&store, "s", RotatedBy::Operator, 10).expect("rotate");
        rotate_epoch(&store, "s", RotatedBy::Operator, 20).expect("rotate");
        store.close().expect("close");
        // The columns the signature does not cover, changed on the newest entry.
        let raw = Connection::open(dir.path().join(DB_FILE)).expect("raw");
        raw.execute(
            "UPDATE ops SET op = 'relay-undeny', at = 99 WHERE id = (SELECT MAX(id) FROM ops)",
            [],
        )
        .expect("op column");
        raw.execute(
            "UPDATE ops SET at = 77 WHERE id = (SELECT MIN(id) FROM ops)",
            [],
        )
        .expect("at column");
        drop(raw);
        let (log, warning) =
            read_verified_log_with(dir.path(), 10, Some(&key.public())).expect("log");
        assert_eq!(warning, None);
        assert!(!log[0].verified, "another op than the signed type");
        assert!(log[1].verified);
        assert_eq!(log[1].op(), OP_EPOCH_ROTATED);
        assert_eq!(log[1].at_ms(), 10, "the signed at, not the column's 77");

        // A store re-signed with another key carries that key: it verifies against itself but
        // never against the relay key, and the mismatch is said.
        let forger = HostKey::generate();
        let forged = tempfile::tempdir().expect("forged");
        let store = open_offline_signed(forged.path(), forger.clone(), 1).expect("forged");
        rotate_epoch(&store, "s", RotatedBy::Operator, 10).expect("rotate");
        store.close().expect("close");
        assert!(read_verified_log(forged.path(), 10).expect("log")[0].verified);
        let (log, warning) =
            read_verified_log_with(forged.path(), 10, Some(&key.public())).expect("log");
        assert!(!log[0].verified);
        let warning = warning.expect("warned");
        assert!(
            warning.contains(&forger.public().fingerprint())
                && warning.contains(&key.public().fingerprint()),
            "{warning}"
        );
    }

    #[test]
    fn reading_the_log_of_a_stopped_store_leaves_no_side_files() {
        let dir = tempfile::tempdir().expect("tempdir");
        let store = SqliteStore::open(dir.path(), &relay_key(), 1).expect("open");
        rotate_epoch(&store, "s", RotatedBy::Operator, 10).expect("rotate");
        store.close().expect("close");
        let before = ls(dir.path());
        assert!(!before
            .iter()
            .any(|n| n.ends_with("-wal") || n.ends_with("-shm")));
        assert_eq!(read_verified_log(dir.path(), 10).expect("log").len(), 1);
        assert_eq!(ls(dir.path()), before);
    }
}
