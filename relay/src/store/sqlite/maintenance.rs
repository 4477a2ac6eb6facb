//! The SQLite backend's [`StoreMaintenance`]: each operation of the trait handed to the module
//! that does it — [`backup`](super::backup) (online copies, partial files),
//! [`status`](super::status) (read-only status and log) and [`restore`](super::restore)
//! (staging, checking and swapping in a copy).
//!
//! # What it must never do
//! Hold SQL of its own: it only dispatches, so the three modules it calls stay independent of
//! one another and of it.

use std::path::Path;

use serde_json::{Map, Value};

use super::{backup, restore, status};
use crate::store::maintenance::{
    BackupFacts, MaintenanceError, StagedStore, StoreFacts, StoreMaintenance, StoreStatus,
    StoredOp, TakeFailure, TakenStore,
};
use crate::store::StoreError;

/// The SQLite backend's [`StoreMaintenance`]: the files of a store directory (`relay.db` and
/// its `-wal`/`-shm`), each operation on its own connection.
#[derive(Debug, Clone, Copy, Default)]
pub struct SqliteMaintenance;

impl StoreMaintenance for SqliteMaintenance {
    fn status(
        &self,
        db: &Path,
        top: usize,
        last_op: &str,
    ) -> Result<StoreStatus, MaintenanceError> {
        status::status(db, top, last_op)
    }

    fn read_log(
        &self,
        db: &Path,
        limit: i64,
    ) -> Result<(Vec<StoredOp>, Option<String>), StoreError> {
        status::read_log(db, limit)
    }

    fn restored_paths(&self, db: &Path) -> Result<Option<Map<String, Value>>, StoreError> {
        restore::restored_paths_of(db)
    }

    fn heartbeat(&self, db: &Path) -> Option<i64> {
        restore::heartbeat(db)
    }

    fn backup(
        &self,
        db: &Path,
        dest: &Path,
        failpoint: Option<&str>,
    ) -> Result<StoreFacts, MaintenanceError> {
        backup::backup(db, dest, failpoint)
    }

    fn stage(&self, src: &Path, copy: &Path) -> Result<(), MaintenanceError> {
        restore::stage(src, copy)
    }

    fn discard(&self, copy: &Path) {
        backup::Partial::remove(copy);
    }

    fn remove_dead_partials(&self, dir: &Path, base_ok: &dyn Fn(&str) -> bool) {
        backup::remove_dead_partials(dir, base_ok);
    }

    fn check_staged(&self, copy: &Path) -> Result<BackupFacts, MaintenanceError> {
        restore::check_staged(copy)
    }

    fn take_current(
        &self,
        db: &Path,
        rollback: &Path,
        backup_key: &str,
    ) -> Result<TakenStore, TakeFailure> {
        if let Some(dir) = rollback.parent() {
            restore::private_dir(dir).map_err(TakeFailure::Failed)?;
        }
        restore::take_current(db, rollback, backup_key)
    }

    fn salvage_restored_paths(&self, db: &Path) -> Map<String, Value> {
        restore::salvage_restored_paths(db)
    }

    fn keep_unreadable(&self, db: &Path, rollback: &Path) -> Result<(), MaintenanceError> {
        restore::keep_unreadable(db, rollback)
    }

    fn open_staged(&self, copy: &Path) -> Result<Box<dyn StagedStore + '_>, MaintenanceError> {
        Ok(Box::new(restore::open_staged(copy)?))
    }

    fn swap_in(&self, copy: &Path, db: &Path, rollback: &Path) -> Result<(), MaintenanceError> {
        restore::swap_in(copy, db, rollback)
    }
}
