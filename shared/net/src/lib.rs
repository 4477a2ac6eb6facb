//! # agentmbx-net
//!
//! The serving plumbing every HTTP server of the workspace shares — the relay (`relay/`), the
//! daemon's LAN server and the daemon's local API (`daemon/`) — written once:
//!
//! - [`serve`]: the accept loop and its connection settings (header-read and keep-alive
//!   timeouts, a bound on open connections, graceful shutdown);
//! - [`body`]: capped body reading (the streaming cap and the drain of an oversized body);
//! - [`budget`]: the request-body budget, whole and per caller;
//! - [`timeout`]: the whole-request timeout;
//! - [`rate`]: the bounded token-bucket table every rate limit is made of, and the generic part
//!   of the 429 answer;
//! - [`log_gate`]: at most one WARN per interval per key for events anyone can cause.
//!
//! # What it must never do
//! Know the domain: no protocol types (envelopes, keys, hops), no store, no error shape of a
//! particular server (each passes its own answer in), no configuration file. It does I/O
//! (sockets, timers) but never touches the disk. The protocol crate (`shared/`) stays pure; this
//! crate does not depend on it.

pub mod body;
pub mod budget;
pub mod log_gate;
pub mod rate;
pub mod serve;
pub mod timeout;
