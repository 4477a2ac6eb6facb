//! `agentmbx relay status`: an operator's facts about a relay store (spec §5, §7; `wire.md`
//! §3.3, §3.4): live and revoked enrolments, queued items and bytes (total and the deepest
//! target queues, with the age of their oldest item), the epoch, the last heartbeat, the last
//! backup (from the relay log's `relay-backup` receipt), dedup rows, the schema version and the
//! relay key fingerprint.
//!
//! # What it owns
//! - [`read`]: every fact in one read transaction (one snapshot) of `relay.db`, opened
//!   read-only through the backend's [`StoreMaintenance::status`](crate::store::StoreMaintenance::status). It works while the relay
//!   serves (a WAL reader never blocks the writer) and never takes `relay.lock`.
//! - [`RelayStatus::to_json`] (the stable `--json` object, `v: 1`) and [`RelayStatus::text`]
//!   (the compact human summary).
//!
//! # What it must never do
//! - Write or create anything: no directory, no `relay.db`, no lock. A store with no
//!   `relay.db-wal` (no relay serves it, and the last one stopped cleanly) is read as an
//!   immutable file, because SQLite's ordinary read-only open of a WAL database would create
//!   `-wal` and `-shm` next to it; if a relay starts meanwhile (a `-wal` appears), the read is
//!   repeated through the relay's own WAL. Only a store left with a non-empty `-wal` but no
//!   `-shm` (not something a relay leaves behind) makes SQLite create the `-shm` it needs.
//! - Print key material: the store holds public keys, ciphertext and routing metadata only, and
//!   only counts, names, public fingerprints and times are reported.

use std::path::{Path, PathBuf};

use serde_json::{json, Value};

use agentmbx_protocol::keys::PublicKey;
use agentmbx_protocol::time::iso_ms;

use crate::ops::{absolute, backend, OP_BACKUP};
use crate::store::maintenance::{MaintenanceError, StoreStatus};
use crate::store::{StoreError, DB_FILE};

/// How many of the deepest target queues `relay status` shows by default.
pub const DEFAULT_TOP: usize = 5;

/// The most target queues one status lists (`--top` at most).
pub const MAX_TOP: usize = 1_000;

/// Why no status could be read.
#[derive(Debug, thiserror::Error)]
pub enum StatusError {
    /// The directory holds no `relay.db` (or does not exist).
    #[error("{} holds no relay store (relay.db)", .0.display())]
    NoStore(PathBuf),
    /// `relay.db` exists but is not a relay store (no schema version).
    #[error("{} is not a relay store (it has no schema version)", .0.display())]
    NotAStore(PathBuf),
    /// The store was written by a newer agentmbx.
    #[error(
        "relay store schema {found} is newer than this agentmbx ({supported}): use the agentmbx \
         that serves it"
    )]
    SchemaTooNew {
        /// The store's schema version.
        found: u32,
        /// The newest version this binary reads.
        supported: u32,
    },
    /// The store failed (a database error: a damaged file, a store that stayed locked for
    /// 5 s…; or its own checks).
    #[error(transparent)]
    Store(#[from] StoreError),
}

/// The queue of one target host key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TargetQueue {
    /// The target host key (standard base64).
    pub host_pubkey: String,
    /// Its enrolled name; `None` when the key has no enrolment row.
    pub host_name: Option<String>,
    /// [`PublicKey::fingerprint`] of the key (16 hex), "" if the stored text is not a key.
    pub fingerprint: String,
    /// Whether the key's enrolment is revoked.
    pub revoked: bool,
    /// Items queued for it.
    pub items: u64,
    /// Their wire bytes.
    pub bytes: u64,
    /// `accepted_at` of its oldest queued item (Unix ms).
    pub oldest_ms: i64,
}

/// The newest `relay-backup` receipt of the relay log.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LastBackup {
    /// When it was logged (Unix ms; the `ops.at` column).
    pub at_ms: i64,
    /// The backup file (`receipt.file`), `None` if the receipt lacks it.
    pub file: Option<String>,
    /// The backup file's size in bytes (`receipt.bytes`), `None` if the receipt lacks it.
    pub bytes: Option<u64>,
}

/// An operator's view of a relay store at one moment. Times are Unix ms; sizes are bytes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RelayStatus {
    /// Absolute path of `relay.db`.
    pub store: String,
    /// The moment the ages are measured from (Unix ms).
    pub now_ms: i64,
    /// The store's schema version.
    pub schema_version: u32,
    /// `meta.relay_pubkey` (the relay's public key, standard base64).
    pub relay_pubkey: Option<String>,
    /// Its fingerprint (16 hex).
    pub relay_fingerprint: Option<String>,
    /// `meta.epoch`.
    pub epoch: Option<String>,
    /// Live (not revoked) enrolments.
    pub enrolled: u64,
    /// Revoked enrolments.
    pub revoked: u64,
    /// Items queued for all targets.
    pub queued_items: u64,
    /// Their wire bytes.
    pub queued_bytes: u64,
    /// Targets with at least one queued item.
    pub queued_targets: u64,
    /// `accepted_at` of the oldest queued item, `None` when nothing is queued.
    pub oldest_ms: Option<i64>,
    /// The deepest target queues (most items, then most bytes, then key), at most the `top`
    /// asked for.
    pub deepest: Vec<TargetQueue>,
    /// `meta.heartbeat` (written every 30 s while a relay serves), `None` if never served.
    pub heartbeat_ms: Option<i64>,
    /// `meta.heartbeat` is set but is not a time in ms (a damaged or altered store);
    /// `heartbeat_ms` is then `None`.
    pub heartbeat_unreadable: bool,
    /// The newest backup in the relay log, `None` if none is logged.
    pub last_backup: Option<LastBackup>,
    /// Rows in `dedup` (queued items and tombstones within the dedup horizon).
    pub dedup_rows: u64,
}

/// Reads the status of the store in `dir` at `now_ms`, listing at most `top` (clamped to
/// [`MAX_TOP`]) of the deepest target queues. Read-only, without `relay.lock`, creating nothing
/// (module docs), so it works while the relay serves.
///
/// Errors: [`StatusError::NoStore`] when `dir/relay.db` is missing (nothing is created),
/// [`StatusError::NotAStore`], [`StatusError::SchemaTooNew`], SQLite errors.
pub fn read(dir: &Path, now_ms: i64, top: usize) -> Result<RelayStatus, StatusError> {
    let db = absolute(&dir.join(DB_FILE));
    if !db.is_file() {
        return Err(StatusError::NoStore(dir.to_path_buf()));
    }
    let facts = backend()
        .status(&db, top.min(MAX_TOP), OP_BACKUP)
        .map_err(|e| match e {
            MaintenanceError::NotAStore(_) => StatusError::NotAStore(db.clone()),
            MaintenanceError::SchemaTooNew { found, supported } => {
                StatusError::SchemaTooNew { found, supported }
            }
            MaintenanceError::Store(e) => StatusError::Store(e),
            e => StatusError::Store(StoreError::Corrupt(e.to_string())),
        })?;
    Ok(status(&db, now_ms, facts))
}

/// Saturating `i64` → `u64` for counts (never negative in a sane store).
fn count(n: i64) -> u64 {
    u64::try_from(n).unwrap_or(0)
}

/// The status of the store `db` from its facts.
fn status(db: &Path, now_ms: i64, facts: StoreStatus) -> RelayStatus {
    let fingerprint = |key: &str| PublicKey::from_b64(key).ok().map(|k| k.fingerprint());
    let heartbeat_ms = facts
        .heartbeat
        .as_deref()
        .and_then(|v| v.trim().parse::<i64>().ok());
    let deepest = facts
        .deepest
        .into_iter()
        .map(|q| TargetQueue {
            fingerprint: fingerprint(&q.host_pubkey).unwrap_or_default(),
            host_pubkey: q.host_pubkey,
            host_name: q.host_name,
            revoked: q.revoked,
            items: count(q.items),
            bytes: count(q.bytes),
            oldest_ms: q.oldest_ms,
        })
        .collect();
    let last_backup = facts.last_op.map(|(at_ms, receipt)| {
        let receipt: Value = serde_json::from_str(&receipt).unwrap_or(Value::Null);
        LastBackup {
            at_ms,
            file: receipt["file"].as_str().map(str::to_owned),
            bytes: receipt["bytes"].as_u64(),
        }
    });
    RelayStatus {
        store: db.display().to_string(),
        now_ms,
        schema_version: facts.schema_version,
        relay_fingerprint: facts.relay_pubkey.as_deref().and_then(fingerprint),
        relay_pubkey: facts.relay_pubkey,
        epoch: facts.epoch,
        enrolled: count(facts.enrolled),
        revoked: count(facts.revoked),
        queued_items: count(facts.queued_items),
        queued_bytes: count(facts.queued_bytes),
        queued_targets: count(facts.queued_targets),
        oldest_ms: facts.oldest_ms,
        deepest,
        heartbeat_unreadable: facts.heartbeat.is_some() && heartbeat_ms.is_none(),
        heartbeat_ms,
        last_backup,
        dedup_rows: count(facts.dedup_rows),
    }
}

impl RelayStatus {
    /// Age of a moment in ms (negative: in the future).
    fn age(&self, at_ms: i64) -> i64 {
        self.now_ms.saturating_sub(at_ms)
    }

    /// The stable `--json` object (times ISO 8601 UTC with ms, ages in ms, negative for a
    /// moment in the future, sizes in bytes):
    ///
    /// ```text
    /// {v:1, store, at, schema_version, relay_pubkey, relay_fingerprint, epoch,
    ///  hosts:{enrolled, revoked},
    ///  queue:{items, bytes, targets, oldest_at, oldest_age_ms,
    ///         deepest:[{host, host_pubkey, fingerprint, revoked, items, bytes,
    ///                   oldest_at, oldest_age_ms}]},
    ///  heartbeat:{at, age_ms}|{unreadable:true}|null,
    ///  last_backup:{at, age_ms, file, bytes}|null,
    ///  dedup_rows}
    /// ```
    ///
    /// `oldest_at`/`oldest_age_ms` are null when nothing is queued; `host` is null for a key
    /// without an enrolment row; `relay_pubkey`, `relay_fingerprint`, `epoch`, `file` and
    /// `bytes` are null when the store lacks them.
    pub fn to_json(&self) -> Value {
        let deepest: Vec<Value> = self
            .deepest
            .iter()
            .map(|t| {
                json!({
                    "host": t.host_name,
                    "host_pubkey": t.host_pubkey,
                    "fingerprint": t.fingerprint,
                    "revoked": t.revoked,
                    "items": t.items,
                    "bytes": t.bytes,
                    "oldest_at": iso_ms(t.oldest_ms),
                    "oldest_age_ms": self.age(t.oldest_ms),
                })
            })
            .collect();
        json!({
            "v": 1,
            "store": self.store,
            "at": iso_ms(self.now_ms),
            "schema_version": self.schema_version,
            "relay_pubkey": self.relay_pubkey,
            "relay_fingerprint": self.relay_fingerprint,
            "epoch": self.epoch,
            "hosts": {"enrolled": self.enrolled, "revoked": self.revoked},
            "queue": {
                "items": self.queued_items,
                "bytes": self.queued_bytes,
                "targets": self.queued_targets,
                "oldest_at": self.oldest_ms.map(iso_ms),
                "oldest_age_ms": self.oldest_ms.map(|t| self.age(t)),
                "deepest": deepest,
            },
            "heartbeat": match self.heartbeat_ms {
                Some(h) => json!({"at": iso_ms(h), "age_ms": self.age(h)}),
                None if self.heartbeat_unreadable => json!({"unreadable": true}),
                None => Value::Null,
            },
            "last_backup": self.last_backup.as_ref().map(|b| json!({
                "at": iso_ms(b.at_ms),
                "age_ms": self.age(b.at_ms),
                "file": b.file,
                "bytes": b.bytes,
            })),
            "dedup_rows": self.dedup_rows,
        })
    }

    /// The compact human summary, one fact per line (ends with a newline).
    pub fn text(&self) -> String {
        let mut out = String::new();
        let mut line = |label: &str, value: String| {
            out.push_str(&format!("{label:<13}{value}\n"));
        };
        line(
            "store",
            format!("{} (schema {})", self.store, self.schema_version),
        );
        line(
            "relay key",
            self.relay_fingerprint
                .as_deref()
                .map_or("unknown".to_owned(), |f| format!("fingerprint {f}")),
        );
        line(
            "epoch",
            self.epoch.clone().unwrap_or_else(|| "unknown".to_owned()),
        );
        line(
            "hosts",
            format!("{} enrolled, {} revoked", self.enrolled, self.revoked),
        );
        line(
            "queued",
            match self.oldest_ms {
                None => "nothing".to_owned(),
                Some(oldest) => format!(
                    "{}, {} for {}; oldest {}",
                    plural(self.queued_items, "item"),
                    bytes(self.queued_bytes),
                    plural(self.queued_targets, "target"),
                    age(self.age(oldest)),
                ),
            },
        );
        for t in &self.deepest {
            let mut name = t.host_name.clone().unwrap_or_else(|| "?".to_owned());
            if t.revoked {
                name.push_str(" (revoked)");
            }
            line(
                "",
                format!(
                    "{name}  {}  {}  {}  oldest {}",
                    t.fingerprint,
                    plural(t.items, "item"),
                    bytes(t.bytes),
                    age(self.age(t.oldest_ms)),
                ),
            );
        }
        line(
            "heartbeat",
            match self.heartbeat_ms {
                Some(h) => format!("{} ({})", iso_ms(h), age(self.age(h))),
                None if self.heartbeat_unreadable => {
                    "unreadable (meta.heartbeat is not a time: the store is damaged or was \
                     altered)"
                        .to_owned()
                }
                None => "none (no relay has served this store yet)".to_owned(),
            },
        );
        line(
            "last backup",
            self.last_backup
                .as_ref()
                .map_or("none in the relay log".to_owned(), |b| {
                    let mut s = format!("{} ({})", iso_ms(b.at_ms), age(self.age(b.at_ms)));
                    if let Some(f) = &b.file {
                        s.push_str(&format!(": {f}"));
                    }
                    if let Some(n) = b.bytes {
                        s.push_str(&format!(" ({})", bytes(n)));
                    }
                    s
                }),
        );
        line("dedup", plural(self.dedup_rows, "row"));
        out
    }
}

/// `1 item`, `2 items`.
fn plural(n: u64, what: &str) -> String {
    if n == 1 {
        format!("1 {what}")
    } else {
        format!("{n} {what}s")
    }
}

/// `512 bytes`, `6234 bytes (6.1 KiB)`, `52428800 bytes (50.0 MiB)`.
fn bytes(n: u64) -> String {
    const UNITS: [&str; 4] = ["KiB", "MiB", "GiB", "TiB"];
    if n < 1024 {
        return plural(n, "byte");
    }
    // Display only: the f64 rounding of a huge count does not matter here.
    #[allow(clippy::cast_precision_loss)]
    let mut v = n as f64 / 1024.0;
    let mut unit = UNITS[0];
    for u in &UNITS[1..] {
        if v < 1024.0 {
            break;
        }
        v /= 1024.0;
        unit = u;
    }
    format!("{n} bytes ({v:.1} {unit})")
}

/// `12s ago`, `3m05s ago`, `2h07m ago`, `3d04h ago`, or `… in the future`.
pub fn age(age_ms: i64) -> String {
    let s = age_ms.unsigned_abs() / 1_000;
    let span = if s < 60 {
        format!("{s}s")
    } else if s < 3_600 {
        format!("{}m{:02}s", s / 60, s % 60)
    } else if s < 48 * 3_600 {
        format!("{}h{:02}m", s / 3_600, s % 3_600 / 60)
    } else {
        format!("{}d{:02}h", s / 86_400, s % 86_400 / 3_600)
    };
    if age_ms < 0 {
        format!("{span} in the future")
    } else {
        format!("{span} ago")
    }
}

#[cfg(test)]
mod tests;
