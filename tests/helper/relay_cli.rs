//! Running the relay's operator commands and `relay serve` over a store directory of a test,
//! and reading the store's meta values (read-only).

use std::path::Path;

use super::mesh::{free_port, open_read_only};
use super::{command, run, Daemon, Output, RELAY_LISTENING};

/// The admin bearer token the tests give a relay (`MBX_RELAY_ADMIN_TOKEN`).
pub const ADMIN: &str = "admin-token-0123456789abcdef";

/// `agentmbx relay <args>` with extra environment variables.
pub fn relay_cli(args: &[&str], env: &[(&str, &str)]) -> Output {
    let mut full = vec!["relay"];
    full.extend_from_slice(args);
    let mut cmd = command(&full);
    for (k, v) in env {
        cmd.env(k, v);
    }
    run(cmd)
}

/// `relay serve` on 127.0.0.1 and a free port over `store`, with `env`.
pub fn serve(store: &Path, env: &[(&str, &str)]) -> Daemon {
    let port = free_port().to_string();
    let mut cmd = command(&[
        "relay",
        "serve",
        "--bind",
        "127.0.0.1",
        "--port",
        &port,
        "--store-dir",
        store.to_str().expect("UTF-8 path"),
    ]);
    for (k, v) in env {
        cmd.env(k, v);
    }
    Daemon::spawn(cmd, RELAY_LISTENING).expect("relay started")
}

/// `meta.<key>` of the store's `relay.db`, if set.
pub fn meta(store: &Path, key: &str) -> Option<String> {
    open_read_only(&store.join("relay.db"))
        .query_row("SELECT v FROM meta WHERE k = ?1", [key], |r| r.get(0))
        .ok()
}
