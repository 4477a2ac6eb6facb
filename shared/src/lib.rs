//! # agentmbx-protocol
//!
//! The AgentMBX wire protocol, shared by the per-host daemon and the relay: keys and
//! fingerprints, canonical JSON, envelopes and their shape check, body sealing, signed hops,
//! relay records, host pairing, signed status and presence, and the wire types of the relay
//! API. Every byte format here reproduces AgentMBX 0.5.x exactly (`wire.md` §2) and is pinned
//! by golden vectors (`tests/vectors.rs`).
//!
//! This crate owns formats and pure computations only. It must never open a socket or a file,
//! spawn a task, or keep global mutable state (the [`failpoint`] registry, read once from the
//! environment, is the one documented exception). Secrets never appear in `Debug` output or in
//! error messages.
#![deny(missing_docs)]

pub mod b64;
pub mod canonical;
pub mod clock;
pub mod cloud_key;
pub mod envelope;
pub mod failpoint;
pub mod hash;
pub mod hop;
pub mod instance;
pub mod keys;
pub mod limits;
pub mod pairing;
pub mod records;
pub mod rotation;
pub mod seal;
pub mod status;
pub mod stream;
pub mod time;
pub mod ulid;
pub mod wire;
