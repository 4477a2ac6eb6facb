//! The LAN transport (`wire.md` §2.5, §2.7, §4): the daemon's LAN server that paired hosts call
//! with signed hops, and the client side that calls theirs.
//!
//! - [`LanState`]: what every LAN handler can reach;
//! - [`server`]: the router and `serve`; [`hop`]: the signed-hop check on the server side;
//!   [`handlers`]: one file per route;
//! - [`client`]: the signed calls this host makes to its peers' LAN servers;
//! - [`deliver`]: the loop that delivers the outbox and the receipts owed over the LAN.
//!
//! This module never trusts a name or an address: a peer is its pinned host key, and discovery
//! or a source address only ever suggests where to find that key.

use std::net::IpAddr;
use std::sync::Arc;

use agentmbx_protocol::clock::SharedClock;

use crate::identity::Identity;
use crate::mailbox::Mailbox;

pub mod client;
pub mod deliver;
pub mod directory;
pub mod handlers;
pub mod hop;
pub mod http;
pub mod presence;
pub mod rotate_announce;
pub mod server;

#[cfg(test)]
mod tests;

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
    /// This daemon process's instance: its id goes on this host's LAN hops, and verified hops
    /// of peers feed its tracker ([`crate::instance`]).
    pub instance: Arc<crate::instance::Instance>,
}

/// Shared handle to [`LanState`].
pub type SharedLan = Arc<LanState>;

/// The `host:port` this host gives peers at pairing: the running daemon's advertise address
/// (`lan.addr`, written at start) when there is one, else `advertise` from the config, else
/// `<hostname>.local:<lan_port>` (`wire.md` §2.7 "Pairing addr").
pub fn pairing_addr(paths: &crate::paths::Paths, config: &crate::config::Config) -> String {
    if let Some(a) = &config.advertise {
        return a.clone();
    }
    if let Ok(text) = std::fs::read_to_string(paths.lan_addr_file()) {
        let text = text.trim();
        if !text.is_empty() {
            return text.to_string();
        }
    }
    let name = gethostname::gethostname().to_string_lossy().to_string();
    let name = name.split('.').next().unwrap_or_default().to_string();
    format!("{name}.local:{}", config.lan_port)
}
