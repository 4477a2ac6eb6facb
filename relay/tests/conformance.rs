//! The store backend conformance suite (`agentmbx_relay::testing::conformance`, spec §2–§7)
//! run against [`SqliteStore`]: one test per rule, named after it.

use std::path::Path;
use std::sync::Arc;

use agentmbx_relay::store::{OpenOptions, RelayStore, SqliteMaintenance, SqliteStore};
use agentmbx_relay::testing::conformance::{Backend, Opened, Setup};

/// The SQLite store in `dir` for `setup` (created when missing; no lock wait).
fn sqlite_in(dir: &Path, setup: &Setup) -> Arc<dyn RelayStore> {
    let options = OpenOptions {
        lock_wait_ms: 0,
        limits: setup.limits.clone(),
        ..OpenOptions::default()
    };
    let store = SqliteStore::open_with(dir, &setup.relay_pubkey, setup.now_ms, options)
        .expect("open the SQLite store");
    Arc::new(store)
}

/// A fresh SQLite store in a temporary directory (kept as long as the store).
fn sqlite(setup: &Setup) -> Opened {
    let dir = tempfile::tempdir().expect("a temporary directory");
    Opened {
        store: sqlite_in(&dir.path().join("store"), setup),
        keep: Box::new(dir),
    }
}

/// The SQLite backend for the backup and restore rules.
const SQLITE: Backend = Backend {
    open: sqlite_in,
    maintenance: &SqliteMaintenance,
};

agentmbx_relay::conformance_tests!(sqlite, SQLITE);

/// The rule tables `run_all` walks name every rule once.
#[test]
fn the_rule_table_names_every_rule_once() {
    use agentmbx_relay::testing::conformance::{BACKEND_RULES, RULES};
    let mut names: Vec<&str> = RULES
        .iter()
        .map(|(name, _)| *name)
        .chain(BACKEND_RULES.iter().map(|(name, _)| *name))
        .collect();
    names.sort_unstable();
    names.dedup();
    assert_eq!(names.len(), RULES.len() + BACKEND_RULES.len());
    assert!(names.len() >= 40, "{names:?}");
    assert!(BACKEND_RULES.len() >= 2, "{BACKEND_RULES:?}");
}
