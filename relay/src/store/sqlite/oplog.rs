//! The operations log (`ops`, `wire.md` §3.3): appending receipts, signed on the writer thread
//! of a store opened with the relay key, and pruning to [`OPS_KEEP`] plus the sweep receipts.

use std::sync::Arc;

use rusqlite::{params, Connection};

use super::meta::{meta_get, meta_put, new_epoch, read_epoch, RESERVED_META};
use super::writer::{JobKind, WRITER_OP_SIGNER};
use super::{sweep, SqliteStore};
use crate::store::{EpochRotation, OpRecord, OpSigner, OperationsStore, StoreError, OPS_KEEP};

/// A log receipt as stored text. Errors: [`StoreError::InvalidInput`].
pub(super) fn op_receipt_text(receipt: &serde_json::Value) -> Result<String, StoreError> {
    serde_json::to_string(receipt)
        .map_err(|e| StoreError::InvalidInput(format!("op receipt is not JSON: {e}")))
}

/// Appends a log entry in the caller's transaction ([`append_op_signed`] prunes); its id.
/// On the writer thread of a store opened with a signer ([`SqliteStore::open_signed`]) the
/// receipt is signed first ([`append_op_signed`]): every append goes through here.
pub(super) fn append_op_apply(
    c: &Connection,
    at_ms: i64,
    op: &str,
    receipt: &str,
) -> Result<i64, StoreError> {
    let signer = WRITER_OP_SIGNER.with(|s| s.borrow().clone());
    append_op_signed(c, signer.as_deref(), at_ms, op, receipt).map(|(id, _)| id)
}

/// Appends a log entry in the caller's transaction, keeping the last [`OPS_KEEP`] (and the last
/// [`crate::store::SWEEP_OPS_KEEP`] `relay-sweep` receipts, counted apart): `receipt`
/// (JSON object text) signed by `signer` when given ([`crate::store::sign_op_receipt`]), stored as is
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
            op_receipt_text(&crate::store::sign_op_receipt(signer, &value)?)?
        }
        None => receipt.to_owned(),
    };
    c.execute(
        "INSERT INTO ops (at, op, receipt) VALUES (?1, ?2, ?3)",
        params![at_ms, op, text],
    )?;
    let id = c.last_insert_rowid();
    // Sweep receipts have their own cap, so they never evict the operator's history
    // (`crate::store::SWEEP_OPS_KEEP`): each kind keeps its newest, pruned as it grows.
    let (same_kind, keep) = if op == crate::store::OP_SWEEP {
        ("op = ?1", crate::store::SWEEP_OPS_KEEP)
    } else {
        ("op <> ?1", OPS_KEEP)
    };
    c.prepare_cached(&format!(
        "DELETE FROM ops WHERE {same_kind} AND id <= (SELECT id FROM ops WHERE {same_kind}
                                                      ORDER BY id DESC LIMIT 1 OFFSET ?2)"
    ))?
    .execute(params![crate::store::OP_SWEEP, keep])?;
    Ok((id, text))
}

impl OperationsStore for SqliteStore {
    fn epoch(&self) -> Result<String, StoreError> {
        self.read(read_epoch)
    }

    fn relay_pubkey(&self) -> Result<String, StoreError> {
        self.read(|c| {
            meta_get(c, "relay_pubkey")?
                .ok_or_else(|| StoreError::Corrupt("meta.relay_pubkey is missing".to_owned()))
        })
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
        log: crate::store::OpEntry,
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

    fn sweep(
        &self,
        now_ms: i64,
        signer: Arc<dyn crate::store::NoticeSigner>,
    ) -> Result<crate::store::SweepReport, StoreError> {
        sweep::sweep(self, now_ms, signer)
    }

    fn ops(&self, limit: i64) -> Result<Vec<OpRecord>, StoreError> {
        let n = limit.clamp(1, OPS_KEEP + crate::store::SWEEP_OPS_KEEP);
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
