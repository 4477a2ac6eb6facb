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
