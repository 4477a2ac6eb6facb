//! The operations log (`ops`, `wire.md` §3.3): the [`OperationsStore`] methods. Appending a
//! receipt (signed on the writer thread of a store opened with the relay key, pruned to
//! [`OPS_KEEP`] plus the sweep receipts) is [`super::oplog_rows`]'s.

use std::sync::Arc;

use super::meta::{meta_get, meta_put, new_epoch, read_epoch, RESERVED_META};
use super::oplog_rows::{append_op_apply, append_op_signed, op_receipt_text};
use super::writer::{JobKind, WRITER_OP_SIGNER};
use super::{sweep, SqliteStore};
use crate::store::{EpochRotation, OpRecord, OperationsStore, StoreError, OPS_KEEP};

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
        sweep::sweep(self, now_ms, signer, Arc::new(|_| {}))
    }

    fn sweep_notify(
        &self,
        now_ms: i64,
        signer: Arc<dyn crate::store::NoticeSigner>,
        committed: crate::store::NoticesCommitted,
    ) -> Result<crate::store::SweepReport, StoreError> {
        sweep::sweep(self, now_ms, signer, committed)
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
