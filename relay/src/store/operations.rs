//! Operations: the [`OperationsStore`] trait and its types — epoch and relay key, meta, the
//! signed operations log and the retention sweep (spec §5, §6, §7). Backend-neutral: no SQL here.

use super::StoreError;

/// What [`OperationsStore::sweep_notify`] calls with each committed batch's expiry notices
/// (the relay publishes them on the targets' push streams). Must not block.
pub type NoticesCommitted = std::sync::Arc<dyn Fn(&[StoredNotice]) + Send + Sync>;

/// Old and new epoch after [`OperationsStore::rotate_epoch`] (spec §5).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EpochRotation {
    /// The epoch before the rotation.
    pub from: String,
    /// The new random epoch (UUID v4 text).
    pub to: String,
}

/// A relay log entry to append in the same transaction as the change it records (the operator
/// controls: [`DirectoryStore::revoke_logged`](crate::store::DirectoryStore::revoke_logged), [`DirectoryStore::deny_logged`](crate::store::DirectoryStore::deny_logged),
/// [`DirectoryStore::undeny_logged`](crate::store::DirectoryStore::undeny_logged)), so a change is never committed without its entry or the
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
/// ([`crate::ops::RelayOpSigner`]) when it opens the store ([`SqliteStore::open_signed`](crate::store::SqliteStore::open_signed)).
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

/// Signs expiry notices for [`OperationsStore::sweep`]. The store never holds the relay's private
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

/// What one [`OperationsStore::sweep`] did. Counts are items (or rows) and bytes.
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
    /// The expiry notices this sweep stored, each in a transaction that committed, for the
    /// targets' push streams (`docs/relay-stream.md`).
    pub stored: Vec<StoredNotice>,
}

/// An expiry notice a sweep stored for a target (the expired envelope's sender).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoredNotice {
    /// The notice's target: the sender of the expired envelope.
    pub target_pubkey: String,
    /// Its seq in the target's queue.
    pub seq: i64,
    /// The target's head just before `seq` was allocated (same transaction).
    pub prev_seq: i64,
    /// The notice's item id.
    pub item_id: String,
    /// The relay key (the notice's sender).
    pub sender_pubkey: String,
    /// The notice's wire bytes.
    pub wire: Vec<u8>,
}

impl SweepReport {
    /// Whether the sweep changed anything (deleted an item or pruned a dedup row).
    pub fn changed(&self) -> bool {
        self.expired_items > 0 || self.pruned_dedup > 0
    }
}

/// The store's identity and upkeep (spec §5, §6): epoch and relay key, free-form meta, the
/// operations log and the retention sweep. Blocking, like every store trait (see
/// [`RelayStore`](crate::store::RelayStore)).
pub trait OperationsStore: Send + Sync + std::fmt::Debug {
    /// The current epoch (read from the store on each call).
    fn epoch(&self) -> Result<String, StoreError>;

    /// The relay public key this store is bound to.
    fn relay_pubkey(&self) -> Result<String, StoreError>;

    /// Switch to a new random epoch (spec §5: `relay rotate-epoch`, startup after a stale
    /// heartbeat, restore).
    fn rotate_epoch(&self) -> Result<EpochRotation, StoreError>;

    /// [`OperationsStore::rotate_epoch`] with its relay-log receipt in the same transaction (spec
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

    /// Append a receipt to the relay log, keeping the last [`OPS_KEEP`](crate::store::OPS_KEEP) entries other than
    /// sweep receipts and the last [`SWEEP_OPS_KEEP`](crate::store::SWEEP_OPS_KEEP) sweep receipts; returns its id.
    fn append_op(
        &self,
        at_ms: i64,
        op: &str,
        receipt: &serde_json::Value,
    ) -> Result<i64, StoreError>;

    /// The newest log entries first, at most `limit` (clamped to `1..=`[`OPS_KEEP`](crate::store::OPS_KEEP) `+`
    /// [`SWEEP_OPS_KEEP`](crate::store::SWEEP_OPS_KEEP), the whole log).
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

    /// [`OperationsStore::sweep`], calling `committed` with the notices of each batch right
    /// after that batch's transaction committed, in commit order (the relay publishes them on
    /// the targets' push streams), so a later batch's error loses none. The SQLite store calls
    /// it on its writer thread, before any later write's answer, so the notices are published
    /// in commit order with the pushes. `committed` must not block. The default runs [`OperationsStore::sweep`] and calls `committed` once with all
    /// its notices when it succeeds.
    ///
    /// Errors: as [`OperationsStore::sweep`].
    fn sweep_notify(
        &self,
        now_ms: i64,
        signer: std::sync::Arc<dyn NoticeSigner>,
        committed: NoticesCommitted,
    ) -> Result<SweepReport, StoreError> {
        let report = self.sweep(now_ms, signer)?;
        committed(&report.stored);
        Ok(report)
    }
}
