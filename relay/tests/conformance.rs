//! The store backend conformance suite (`agentmbx_relay::testing::conformance`, spec §2–§7)
//! run against [`SqliteStore`]: one test per rule, named after it.

use std::sync::Arc;

use agentmbx_relay::store::{OpenOptions, SqliteStore};
use agentmbx_relay::testing::conformance::{Opened, Setup};

/// A fresh SQLite store in a temporary directory (kept as long as the store).
fn sqlite(setup: &Setup) -> Opened {
    let dir = tempfile::tempdir().expect("a temporary directory");
    let options = OpenOptions {
        lock_wait_ms: 0,
        limits: setup.limits.clone(),
        ..OpenOptions::default()
    };
    let store = SqliteStore::open_with(
        &dir.path().join("store"),
        &setup.relay_pubkey,
        setup.now_ms,
        options,
    )
    .expect("open the SQLite store");
    Opened {
        store: Arc::new(store),
        keep: Box::new(dir),
    }
}

agentmbx_relay::conformance_tests!(sqlite);

/// The rule table `run_all` walks names every rule once.
#[test]
fn the_rule_table_names_every_rule_once() {
    let rules = agentmbx_relay::testing::conformance::RULES;
    let mut names: Vec<&str> = rules.iter().map(|(name, _)| *name).collect();
    names.sort_unstable();
    names.dedup();
    assert_eq!(names.len(), rules.len());
    assert!(names.len() >= 40, "{names:?}");
}
