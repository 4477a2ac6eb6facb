//! The `meta` table: the store's identity (epoch, relay key) and the reserved keys only
//! dedicated methods write.

use rusqlite::{Connection, OptionalExtension};

use crate::store::StoreError;

/// Meta keys that only dedicated methods may write.
pub(super) const RESERVED_META: &[&str] = &["schema_version", "epoch", "relay_pubkey", "heartbeat"];

pub(super) fn new_epoch() -> String {
    uuid::Uuid::new_v4().to_string()
}

// ---------------------------------------------------------------------------------------------
// Meta and positions

pub(super) fn meta_get(c: &Connection, key: &str) -> Result<Option<String>, StoreError> {
    Ok(c.prepare_cached("SELECT v FROM meta WHERE k = ?1")?
        .query_row([key], |r| r.get(0))
        .optional()?)
}

pub(super) fn meta_put(c: &Connection, key: &str, value: &str) -> Result<(), StoreError> {
    c.prepare_cached(
        "INSERT INTO meta (k, v) VALUES (?1, ?2) ON CONFLICT(k) DO UPDATE SET v = excluded.v",
    )?
    .execute([key, value])?;
    Ok(())
}

pub(super) fn read_epoch(c: &Connection) -> Result<String, StoreError> {
    meta_get(c, "epoch")?.ok_or_else(|| StoreError::Corrupt("meta.epoch is missing".to_owned()))
}
