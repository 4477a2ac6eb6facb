//! The push stream (`GET /v2/relay/stream`, `docs/relay-stream.md`; frames and close codes in
//! [`agentmbx_protocol::stream`]; AgentPeer relay v1): a host's stored items sent to it the
//! moment their push committed, over a WebSocket (RFC 6455).
//!
//! - [`nonce`]: the single-use stream nonces signed info hands out and the upgrade consumes;
//! - [`hub`]: the open streams by host key, their bounded send queues, the relay-wide budget,
//!   the publish path and the close requests (revocation, deny, rotation, shutdown);
//! - [`conn`]: one connection's loop (resume and replay, ping, deadlines, writing frames).
//!
//! The upgrade itself (authentication, the nonce, the WebSocket settings) is
//! `handlers::stream`'s; the relay state holds one [`hub::Hub`] and one [`nonce::Nonces`].
//!
//! # What it must never do
//! Be a second source of truth: every frame carries an item already committed in the store,
//! exactly as a pull would return it, and nothing here writes to the store.

pub mod conn;
pub mod hub;
pub mod nonce;

use crate::store::{RelayStore, StoreError};

/// Whether the host key a stream was opened for may still stream at `now_ms` (relay clock):
/// enrolled and not revoked, and no active deny entry for its `fingerprint` or its account
/// token's `client_id` (the pull's refusals: 401 `NOT_ENROLLED`, 403 `REVOKED`, 403 `DENIED`).
/// One blocking read of the store: call it off the async runtime. Read after the stream's
/// registration and on every `resume` (and every [`conn::RECHECK_EVERY_PINGS`] pings), so a
/// revocation or deny whose close request never reached the stream still ends it (4403).
///
/// # Errors
/// [`StoreError`] when the store cannot be read (the caller closes with 1013, not 4403).
pub fn key_may_stream(
    store: &dyn RelayStore,
    key: &str,
    fingerprint: &str,
    client_id: Option<&str>,
    now_ms: i64,
) -> Result<bool, StoreError> {
    let live = store.enrolment(key)?.is_some_and(|e| !e.is_revoked());
    Ok(live && store.denied(fingerprint, client_id, now_ms)?.is_none())
}
