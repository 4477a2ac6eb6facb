//! Appending to the operations log (`ops`, `wire.md` §3.3) in the caller's transaction: the
//! receipt signed on the writer thread of a store opened with the relay key, the log pruned to
//! [`OPS_KEEP`] plus the sweep receipts. The log's trait methods, the deny list and the sweep
//! all append through here.
//!
//! # What it must never do
//! Open a transaction or reach the modules that append: it sits below all of them.

use rusqlite::{params, Connection};

use super::writer::WRITER_OP_SIGNER;
use crate::store::{OpSigner, StoreError, OPS_KEEP};

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
