//! # agentmbx-relay
//!
//! The durable relay (spec, all sections; `wire.md` §3): it stores sealed items for target host
//! keys until they are pulled and acknowledged, and signs an accept receipt for every item it
//! committed. It is untrusted for content: it sees ciphertext and routing metadata only, and it
//! grants no authority (hosts trust their pinned keys, never the relay's word).
//!
//! - [`store`]: the `RelayStore` trait and its SQLite implementation (one writer, group commit);
//! - [`handlers`]: one file per HTTP resource; [`auth`]: body cap, UTF-8 and hop checks;
//! - [`authority`]: enrolment authorities (host-key challenge, account tokens); [`admin`]:
//!   `relay revoke` / `relay deny`, offline or through the admin endpoints; [`ops`]: the
//!   heartbeat epoch rotation, `relay rotate-epoch`, `relay backup`, `relay restore`,
//!   `relay log` and the relay-key signatures of its receipts;
//! - [`retention`]: the retention sweep (expired items, signed expiry notices, dedup horizon);
//! - [`state`]: what every handler can reach; [`server`]: router and
//!   `serve(listener, state, shutdown)`; [`run`]: `relay serve`;
//! - [`stream`]: the push stream's nonces, registry of open streams and connection loop
//!   (`GET /v2/relay/stream`, `docs/relay-stream.md`; the upgrade is `handlers::stream`);
//! - [`status`]: `relay status`, an operator's read-only facts about a store;
//! - [`config`]: `relay.toml` and environment (its `[rate]` table in [`config::rate`]); [`key`]:
//!   the relay key;
//! - [`ratelimit`]: per-address and per-sender rate limits, the request-body budget (built
//!   from the shared serving plumbing, `agentmbx_net`: rate tables, the body budget, the log
//!   gate); [`refusals`]: the running relay's counters of refused items and requests by reason;
//! - `testing` (cargo feature `testing`): an in-process test relay and the store backend
//!   conformance suite.
//!
//! Every successful answer is sent only after the transaction that made it true committed.
//!
//! No two sibling modules import each other, directly or in a circle (`.ci/module-cycles`): the
//! shared state, errors and settings sit below the handlers and loops that use them.

pub mod admin;
pub mod auth;
pub mod authority;
pub mod config;
pub mod error;
pub mod handlers;
pub mod instances;
pub mod key;
pub mod ops;
pub mod ratelimit;
pub mod refusals;
pub mod retention;
pub mod run;
pub mod server;
pub mod state;
pub mod status;
pub mod store;
pub mod stream;
#[cfg(any(test, feature = "testing"))]
pub mod testing;
pub mod watchdog;

/// Relay software version (reported by `GET /v2/relay/info`).
pub const VERSION: &str = env!("CARGO_PKG_VERSION");
