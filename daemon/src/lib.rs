//! # agentmbx
//!
//! The per-host side of AgentMBX: the daemon that agents on this machine talk to, and the
//! pieces the `agentmbx` binary and the black-box tests share. Mail flows agent → local API →
//! sign and seal → LAN or relay → peer host (design README "Data flow"); this crate holds the
//! host end of every step. Byte formats come from `agentmbx-protocol`; nothing here invents one.
//!
//! Modules and what they own:
//! - [`paths`]: the home directory (`MBX_HOME`) and the names of the files in it;
//! - [`config`]: `config.toml`, layered defaults → file → environment, unknown keys refused
//!   (its `[[hooks]]` table in [`config::hooks`]);
//! - [`discovery`]: mDNS advertisement and browsing (suggests addresses, never grants trust);
//! - [`host_name`]: the host name rule and fitting a machine name to it;
//! - [`identity`]: the host key and enc key files, created once, loaded at start;
//! - [`instance`]: this daemon process's instance id and the detection of two daemons on one
//!   host key (its own, or a peer's);
//! - [`token`]: the local API bearer token file;
//! - [`setup`]: registering `agentmbx mcp` with the agent clients (Claude Code, Codex);
//! - [`service`]: the systemd user unit and launchd agent files, and sd-notify while running;
//!   [`liveness`]: the registry of the long-running loops' progress the watchdog reads;
//! - [`daemon`]: the daemon as a library call — prepare a home, then run every background loop
//!   on bound sockets with a given clock and failpoints until a shutdown future completes;
//! - [`api`]: the local HTTP API for agents (router, auth, error mapping, one file per resource);
//!   [`vocab`]: the API's wire vocabulary (the shared value shapes of its OpenAPI document);
//! - [`wake_rule`]: which mail is wake-worthy (the wake brake and the hooks' filter);
//! - [`shell`]: POSIX shell quoting for the commands `doctor` and `setup` print and write;
//! - [`fsutil`]: crash-safe creation and replacement of small files;
//! - [`mailbox`]: the host store `mailbox.db` (messages, deliveries, outbox, relay position,
//!   quarantine, peers) — where mail is *stored*;
//! - [`node`]: composing and signing what agents send, verifying and opening what peers sent;
//! - [`transport`]: moving wire bytes — [`transport::relay_client`] is where mail is *sealed*
//!   per target and *sent* (push), *pulled* and *acknowledged*.
//!
//! The library never parses command lines, installs a logger or exits the process: that is the
//! binary's job (`src/main.rs`, `src/cli/`). Errors are `thiserror` enums a caller can branch on.
//! No two sibling modules import each other, directly or in a circle (`.ci/module-cycles`).

pub mod api;
pub mod config;
pub mod config_watch;
pub mod daemon;
pub mod discovery;
pub mod doctor;
pub mod fsutil;
pub mod hooks;
pub mod host_name;
pub mod identity;
pub mod instance;
pub mod keystore;
pub mod liveness;
pub mod mailbox;
pub mod net_error;
pub mod node;
pub mod pairing;
pub mod paths;
pub mod service;
pub mod setup;
pub mod shell;
pub mod token;
pub mod transport;
pub mod vocab;
pub mod wake_rule;

#[cfg(test)]
pub(crate) mod testutil;

/// This crate's version (the Cargo package version), as `/v1/health` and `--version` report it.
pub const VERSION: &str = env!("CARGO_PKG_VERSION");

/// Installs rustls' `ring` crypto provider for the process (reqwest is built without a default
/// provider to keep the C-built aws-lc out of the build, `dependencies.md`). Idempotent; call it
/// before the first HTTP client is built.
pub fn install_tls_provider() {
    let _ = rustls::crypto::ring::default_provider().install_default();
}
