//! The LAN transport (`wire.md` §2.5, §2.7, §4): the daemon's LAN server that paired hosts call
//! with signed hops, and the client side that calls theirs.
//!
//! - [`LanState`]: what every LAN handler can reach.
//!
//! This module never trusts a name or an address: a peer is its pinned host key, and discovery
//! or a source address only ever suggests where to find that key.

use std::net::IpAddr;
use std::sync::Arc;

use agentmbx_protocol::clock::SharedClock;

use crate::identity::Identity;
use crate::mailbox::Mailbox;

/// What every LAN handler can reach (the pairing routes included).
#[derive(Debug)]
pub struct LanState {
    /// This host's identity (signs status answers, opens sealed bodies).
    pub ident: Arc<Identity>,
    /// The host store.
    pub mailbox: Mailbox,
    /// The one clock.
    pub clock: SharedClock,
    /// The daemon's version (status answers).
    pub version: &'static str,
    /// ISO ms time the daemon started (`GET /v1/status`).
    pub started_at: String,
    /// The LAN port this server listens on (presence, status).
    pub port: u16,
    /// `host:port` this host gives peers at pairing (`wire.md` §2.7 "Pairing addr").
    pub advertise: String,
    /// This host's own LAN IPs, signed in status and presence (`wire.md` §2.7).
    pub self_addrs: Vec<IpAddr>,
    /// Woken when outbox rows became due now (a peer is back, new mail), so the sender loops
    /// do not wait out their sleep.
    pub wake: Arc<tokio::sync::Notify>,
    /// In-memory pairing state: hello nonces, comparison commitments, rate limits.
    pub pairing: crate::pairing::PairingMemory,
}

/// Shared handle to [`LanState`].
pub type SharedLan = Arc<LanState>;
