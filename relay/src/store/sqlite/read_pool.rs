//! Read-only connections to `relay.db`, reused (module docs "Threads and connections"). A
//! reader never writes and never sees uncommitted rows.

use std::path::PathBuf;
use std::sync::Mutex;

use rusqlite::{Connection, OpenFlags};

use super::{SqliteStore, BUSY_TIMEOUT, READ_POOL_IDLE, STATEMENT_CACHE};
use crate::store::StoreError;

/// Read-only connections to `relay.db`, reused.
pub(super) struct ReadPool {
    pub(super) path: PathBuf,
    pub(super) idle: Mutex<Vec<Connection>>,
}

impl ReadPool {
    fn with<T>(
        &self,
        f: impl FnOnce(&Connection) -> Result<T, StoreError>,
    ) -> Result<T, StoreError> {
        let reused = self
            .idle
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .pop();
        let conn = match reused {
            Some(conn) => conn,
            None => self.open()?,
        };
        let result = f(&conn);
        // Only a connection with no transaction left open goes back to the pool.
        if conn.is_autocommit() {
            let mut idle = self
                .idle
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            if idle.len() < READ_POOL_IDLE {
                idle.push(conn);
            }
        }
        result
    }

    fn open(&self) -> Result<Connection, StoreError> {
        let conn = Connection::open_with_flags(
            &self.path,
            OpenFlags::SQLITE_OPEN_READ_ONLY | OpenFlags::SQLITE_OPEN_NO_MUTEX,
        )?;
        conn.busy_timeout(BUSY_TIMEOUT)?;
        conn.set_prepared_statement_cache_capacity(STATEMENT_CACHE);
        Ok(conn)
    }
}

impl SqliteStore {
    pub(super) fn read<T>(
        &self,
        f: impl FnOnce(&Connection) -> Result<T, StoreError>,
    ) -> Result<T, StoreError> {
        self.readers.with(f)
    }
}
