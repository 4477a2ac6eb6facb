//! Black-box tests of the real `agentmbx` binary: the daemon package's one integration-test
//! binary, `integration`. This file owns only the module list; each module is one area (before,
//! a test binary of its own) and keeps its tests' names, so a test's path is `<area>::<test>`
//! (`cli::init_creates_private_key_files_and_refuses_a_second_init`). `helper` holds the
//! fixtures: temporary homes, daemons and relays as child processes, polling under one timeout,
//! HTTP to the local API. Most areas run the real binary as child processes (crashes, signals,
//! service readiness and network namespaces need one); `in_process` runs daemons inside the test
//! process through `agentmbx::daemon::run`, each with its own clock and failpoints.
//!
//! One area, or the crash drill with a long run (see `drill`):
//!
//! ```text
//! cargo nextest run -p agentmbx --test integration -E 'test(/^relay_e2e::/)'
//! MBX_DRILL_KILLS=1000 cargo nextest run -p agentmbx --test integration -E 'test(/^drill::/)' --no-capture
//! ```
//!
//! The suite runs under nextest, which gives every test its own process. No test may rely on
//! sharing state with another through this process; `proxy_env` sets process-wide environment
//! variables and relies on having the process to itself (under `cargo test`, run it alone:
//! `cargo test -p agentmbx --test integration proxy_env::`).

mod helper;

mod channel;
mod cli;
mod clock_skew;
mod cloned_host;
mod completions;
mod config_watch;
mod crash_drills;
mod doctor;
mod drill;
mod events;
mod hooks;
mod host_keys;
mod in_process;
mod lan_e2e;
mod lan_failover;
mod lan_netns;
mod mcp;
mod openapi_contract;
mod proxy_env;
mod rate;
mod relay_account;
mod relay_admin;
mod relay_e2e;
mod relay_expiry;
mod relay_operator;
mod relay_ops;
mod relay_quarantine;
mod relay_restore;
mod relay_status;
mod relay_stream;
mod relay_trust;
mod rotation_e2e;
mod service;
mod setup;
mod unclaimed;
mod wait;
