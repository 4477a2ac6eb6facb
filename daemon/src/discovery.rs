//! LAN discovery over mDNS/DNS-SD (`wire.md` §4 "mDNS"): the daemon advertises this host as
//! `<host>._agentmbx._tcp.local` (SRV target `<host>-agentmbx.local`, TXT `v=1`, `host=<name>`,
//! `fp=<fingerprint>`, A records for its LAN IPv4 addresses) and browses for the other hosts;
//! `agentmbx discover` and `join <host>` browse once ([`browse`]).
//!
//! Discovery only ever *suggests where* a host may be; it never grants trust. A resolved host
//! whose name is a pinned peer and whose `fp` matches the pinned key's fingerprint is a
//! candidate address, adopted only after its signed status proves the pinned key
//! ([`crate::transport::lan::presence::consider_mdns`]); one whose `fp` differs is logged as a
//! `KEY MISMATCH` and never used. Unpaired hosts are only listed.
//!
//! What a host on the LAN can make this module keep is bounded: answers travel from the browse
//! thread to the daemon through a queue of [`EVENT_QUEUE`] (an answer that finds it full is
//! dropped; mDNS repeats itself), the table of answers holds at most [`MAX_SEEN_HOSTS`] names
//! (pinned peers' names are evicted last, and an answer with another key never replaces one
//! that matches the pinned key), and the `KEY MISMATCH` warnings remember at most as many.
//!
//! mDNS is off when `MBX_NO_MDNS=1`, `mdns = false` or a loopback `lan_bind`
//! ([`Config::mdns_enabled`]); when the LAN server is bound to one address, only that address's
//! interface is used. Multicast that cannot be opened is logged once and discovery stays off:
//! everything still works with explicit addresses. This module opens UDP 5353 only through
//! `mdns-sd` (which shares the port with avahi or mDNSResponder) and never on behalf of tests
//! outside network namespaces they created.

use std::collections::{HashMap, HashSet};
use std::net::IpAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use mdns_sd::{IfKind, ResolvedService, ServiceDaemon, ServiceEvent, ServiceInfo};
use serde::Serialize;

use agentmbx_protocol::keys::PublicKey;
use agentmbx_protocol::status::join_addr;

use crate::config::Config;
use crate::mailbox::peers::{self, Peer};
use crate::transport::lan::{presence, SharedLan};

/// The DNS-SD service type, fully qualified as mdns-sd writes it (`_agentmbx._tcp.local`).
pub const SERVICE_TYPE: &str = "_agentmbx._tcp.local.";
/// The TXT `v` this implementation advertises.
pub const TXT_VERSION: &str = "1";
/// How long `agentmbx discover` collects answers (0.5.x: 3 s).
pub const BROWSE_WINDOW: Duration = Duration::from_secs(3);
/// How long shutdown waits for the goodbye (TTL 0) to go out.
pub const GOODBYE_WAIT: Duration = Duration::from_secs(1);
/// Most host names kept from mDNS answers (the daemon's table, one `discover` run).
pub const MAX_SEEN_HOSTS: usize = 256;
/// Answers waiting for the daemon's handler; past it new ones are dropped.
pub const EVENT_QUEUE: usize = 64;

/// A host that answered on mDNS. `host`, `fp` and `v` come from its TXT record (keys
/// case-insensitive, first wins); nothing here is verified.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Seen {
    /// TXT `host`: the name it claims.
    pub host: String,
    /// TXT `fp`: the fingerprint of the key it claims ("" when absent).
    pub fp: String,
    /// TXT `v` ("" when absent).
    pub v: String,
    /// Its advertised IPv4 addresses (sorted), then IPv6.
    pub ips: Vec<IpAddr>,
    /// The SRV port (its LAN port).
    pub port: u16,
    /// `ip:port` of its first address (what `discover` prints).
    pub addr: String,
}

impl Seen {
    /// Every advertised address as `ip:port` (IPv4 first).
    pub fn candidates(&self) -> Vec<String> {
        self.ips
            .iter()
            .map(|ip| join_addr(*ip, self.port))
            .collect()
    }
}

/// Reads a resolved DNS-SD answer; None when its TXT has no `host` or it has no address.
pub fn seen_from(resolved: &ResolvedService) -> Option<Seen> {
    let txt = |k: &str| {
        resolved
            .get_property_val_str(k)
            .unwrap_or_default()
            .to_string()
    };
    let host = txt("host");
    if host.is_empty() {
        return None;
    }
    let mut ips: Vec<IpAddr> = resolved
        .get_addresses()
        .iter()
        .map(|a| a.to_ip_addr())
        .collect::<HashSet<_>>()
        .into_iter()
        .collect();
    ips.sort_by_key(|ip| (ip.is_ipv6(), *ip));
    let first = *ips.first()?;
    Some(Seen {
        fp: txt("fp"),
        v: txt("v"),
        addr: join_addr(first, resolved.get_port()),
        ips,
        port: resolved.get_port(),
        host,
    })
}

/// What an mDNS answer is to this host (`agentmbx discover`'s last column).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(tag = "standing", rename_all = "kebab-case")]
pub enum Standing {
    /// This host itself (same name and fingerprint).
    ThisHost,
    /// No pinned peer has that name.
    NotPaired,
    /// A pinned peer, and the advertised fingerprint is its pinned key's.
    Paired,
    /// A pinned peer's name with another fingerprint: never used.
    KeyMismatch {
        /// The fingerprint the answer advertised.
        advertised: String,
        /// The pinned key's fingerprint.
        pinned: String,
    },
}

impl Standing {
    /// One line of text: `this host`, `not paired`, `paired`, or `KEY MISMATCH (advertised X,
    /// pinned Y)`.
    pub fn label(&self) -> String {
        match self {
            Standing::ThisHost => "this host".into(),
            Standing::NotPaired => "not paired".into(),
            Standing::Paired => "paired".into(),
            Standing::KeyMismatch { advertised, pinned } => {
                let advertised = if advertised.is_empty() {
                    "?"
                } else {
                    advertised
                };
                format!("KEY MISMATCH (advertised {advertised}, pinned {pinned})")
            }
        }
    }
}

/// The fingerprint of a pinned peer's key ("" when the stored key does not parse).
fn pinned_fp(peer: &Peer) -> String {
    PublicKey::from_b64(&peer.pubkey)
        .map(|k| k.fingerprint())
        .unwrap_or_default()
}

/// Classifies an answer against this host (`own_host`, `own_fp`) and the pinned `peers`.
pub fn standing(seen: &Seen, own_host: &str, own_fp: &str, peers: &[Peer]) -> Standing {
    if seen.host == own_host && seen.fp == own_fp {
        return Standing::ThisHost;
    }
    let Some(peer) = peers.iter().find(|p| p.host == seen.host) else {
        return Standing::NotPaired;
    };
    let pinned = pinned_fp(peer);
    if !pinned.is_empty() && pinned == seen.fp {
        Standing::Paired
    } else {
        Standing::KeyMismatch {
            advertised: seen.fp.clone(),
            pinned,
        }
    }
}

/// mDNS could not be used.
#[derive(Debug, thiserror::Error)]
pub enum DiscoveryError {
    /// The mDNS daemon could not start, advertise or browse (multicast unavailable, …).
    #[error("mDNS unavailable: {0}")]
    Mdns(String),
    /// [`start`] was called outside a tokio runtime.
    #[error("mDNS discovery needs a tokio runtime")]
    NoRuntime,
}

fn mdns_err(e: mdns_sd::Error) -> DiscoveryError {
    DiscoveryError::Mdns(e.to_string())
}

/// Browses for `_agentmbx._tcp.local` hosts for `window` (blocking; call it from a CLI command
/// or `spawn_blocking`). Returns what resolved, sorted by host name (the last answer per host
/// wins). Errors: [`DiscoveryError::Mdns`] when mDNS cannot start at all.
pub fn browse(window: Duration) -> Result<Vec<Seen>, DiscoveryError> {
    let daemon = ServiceDaemon::new().map_err(mdns_err)?;
    let events = daemon.browse(SERVICE_TYPE).map_err(mdns_err)?;
    let deadline = Instant::now() + window;
    let mut found = SeenHosts::default();
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            break;
        }
        match events.recv_timeout(left) {
            Ok(ServiceEvent::ServiceResolved(r)) => {
                if let Some(seen) = seen_from(&r) {
                    found.insert(seen);
                }
            }
            Ok(_) => {}
            Err(_) => break,
        }
    }
    let _ = daemon.stop_browse(SERVICE_TYPE);
    if let Ok(done) = daemon.shutdown() {
        let _ = done.recv_timeout(GOODBYE_WAIT);
    }
    Ok(found.into_sorted())
}

/// The latest answer per host name, at most a fixed number of names (default
/// [`MAX_SEEN_HOSTS`]). When full, a new name evicts the least recently answered name that is
/// not a pinned peer's ([`SeenHosts::set_pinned`]); when every kept name is pinned, only a
/// pinned name gets in. For a pinned name, an answer whose fingerprint is not the pinned one
/// never replaces one whose fingerprint is.
#[derive(Debug)]
pub struct SeenHosts {
    cap: usize,
    tick: u64,
    entries: HashMap<String, (Seen, u64)>,
    /// Pinned peer name → the pinned key's fingerprint.
    pinned: HashMap<String, String>,
}

impl Default for SeenHosts {
    fn default() -> Self {
        Self::with_capacity(MAX_SEEN_HOSTS)
    }
}

impl SeenHosts {
    /// An empty table keeping at most `cap` names (at least 1).
    pub fn with_capacity(cap: usize) -> Self {
        SeenHosts {
            cap: cap.max(1),
            tick: 0,
            entries: HashMap::new(),
            pinned: HashMap::new(),
        }
    }

    /// Sets which names are pinned peers, with their pinned fingerprints (the daemon refreshes
    /// it from the peer list).
    pub fn set_pinned(&mut self, pinned: HashMap<String, String>) {
        self.pinned = pinned;
    }

    /// Keeps `seen` as the latest answer for its host (rules in the type docs). Returns false
    /// when it was not kept.
    pub fn insert(&mut self, seen: Seen) -> bool {
        let pinned_fp = self.pinned.get(&seen.host).cloned();
        if let (Some(fp), Some((old, _))) = (&pinned_fp, self.entries.get(&seen.host)) {
            if old.fp == *fp && seen.fp != *fp {
                return false;
            }
        }
        if !self.entries.contains_key(&seen.host) && self.entries.len() >= self.cap {
            let oldest = |pinned: bool| {
                self.entries
                    .iter()
                    .filter(|(h, _)| self.pinned.contains_key(*h) == pinned)
                    .min_by_key(|(_, (_, t))| *t)
                    .map(|(h, _)| h.clone())
            };
            let victim = match oldest(false) {
                Some(h) => h,
                None if pinned_fp.is_some() => match oldest(true) {
                    Some(h) => h,
                    None => return false,
                },
                None => return false,
            };
            self.entries.remove(&victim);
        }
        self.tick += 1;
        self.entries.insert(seen.host.clone(), (seen, self.tick));
        true
    }

    /// The latest answer kept for `host`.
    pub fn get(&self, host: &str) -> Option<&Seen> {
        self.entries.get(host).map(|(s, _)| s)
    }

    /// Forgets `host` (its goodbye).
    pub fn remove(&mut self, host: &str) {
        self.entries.remove(host);
    }

    /// How many names are kept.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether nothing is kept.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// The kept answers, sorted by host name.
    pub fn into_sorted(self) -> Vec<Seen> {
        let mut list: Vec<Seen> = self.entries.into_values().map(|(s, _)| s).collect();
        list.sort_by(|a, b| a.host.cmp(&b.host));
        list
    }
}

/// The daemon's [`SeenHosts`], shared by the browse thread and the failure ladder.
pub type SeenTable = Arc<Mutex<SeenHosts>>;

/// Hands an answer to the daemon's handler without ever blocking the browse thread: when
/// [`EVENT_QUEUE`] answers are already waiting, this one is dropped (logged at debug; mDNS
/// answers repeat). Returns false when the handler is gone.
pub fn forward(tx: &tokio::sync::mpsc::Sender<Seen>, seen: Seen) -> bool {
    use tokio::sync::mpsc::error::TrySendError;
    match tx.try_send(seen) {
        Ok(()) => true,
        Err(TrySendError::Full(s)) => {
            tracing::debug!(host = %s.host, addr = %s.addr, "mDNS: too many answers waiting; this one is dropped");
            true
        }
        Err(TrySendError::Closed(_)) => false,
    }
}

/// The mDNS candidates for the pinned peer `host` in `table`: its advertised addresses, only
/// when the advertised fingerprint is `key`'s (the failure ladder's last rung, `wire.md` §4).
pub fn candidates(table: &SeenTable, host: &str, key: &PublicKey) -> Vec<String> {
    let table = table.lock().unwrap_or_else(|e| e.into_inner());
    match table.get(host) {
        Some(seen) if seen.fp == key.fingerprint() => seen.candidates(),
        _ => Vec::new(),
    }
}

/// The daemon's running mDNS advertisement and browse; [`Discovery::shutdown`] (or drop) sends
/// the goodbye (TTL 0) and stops it. Inert when mDNS is disabled.
#[derive(Debug)]
pub struct Discovery {
    running: Option<Running>,
    seen: SeenTable,
}

struct Running {
    daemon: ServiceDaemon,
    fullname: String,
}

impl std::fmt::Debug for Running {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Running")
            .field("fullname", &self.fullname)
            .finish_non_exhaustive()
    }
}

/// Starts advertising this host (`lan`: name, key fingerprint, LAN port, own addresses) and
/// browsing for the others, unless `config` disables mDNS ([`Config::mdns_enabled`]): then an
/// inert [`Discovery`] is returned. Resolved answers for pinned peers with a matching
/// fingerprint are handed to address healing; a mismatching one is warned about as `KEY
/// MISMATCH`. Must run inside a tokio runtime. Errors: [`DiscoveryError`] (the daemon goes on
/// without mDNS).
pub fn start(config: &Config, lan: SharedLan) -> Result<Discovery, DiscoveryError> {
    let seen: SeenTable = Arc::default();
    if !config.mdns_enabled() {
        tracing::info!("mDNS off (MBX_NO_MDNS, mdns = false or a loopback lan_bind)");
        return Ok(Discovery {
            running: None,
            seen,
        });
    }
    let runtime = tokio::runtime::Handle::try_current().map_err(|_| DiscoveryError::NoRuntime)?;
    let daemon = ServiceDaemon::new().map_err(mdns_err)?;
    let bind = config.lan_bind;
    if !bind.is_unspecified() {
        // Bound to one address: announce and listen on that interface only.
        daemon.disable_interface(IfKind::All).map_err(mdns_err)?;
        daemon
            .enable_interface(IfKind::Addr(bind))
            .map_err(mdns_err)?;
    }
    let host = lan.ident.host.to_string();
    let fp = lan.ident.host_key.public().fingerprint();
    let ips: Vec<IpAddr> = presence::self_ips(&lan)
        .into_iter()
        .filter(IpAddr::is_ipv4)
        .collect();
    let txt = [
        ("v", TXT_VERSION.to_string()),
        ("host", host.clone()),
        ("fp", fp.clone()),
    ];
    let mut info = ServiceInfo::new(
        SERVICE_TYPE,
        &host,
        &format!("{host}-agentmbx.local."),
        ips.as_slice(),
        lan.port,
        &txt[..],
    )
    .map_err(mdns_err)?;
    if ips.is_empty() {
        info = info.enable_addr_auto();
    }
    // 0.5.x announces at once (no conflict probing): the name is a local handle, the key is
    // what peers check.
    info.set_requires_probe(false);
    let fullname = info.get_fullname().to_string();
    daemon.register(info).map_err(mdns_err)?;
    let events = daemon.browse(SERVICE_TYPE).map_err(mdns_err)?;
    tracing::info!(instance = %fullname, port = lan.port, addrs = ?ips, "mDNS: advertising this host and browsing for peers");

    let (tx, mut rx) = tokio::sync::mpsc::channel::<Seen>(EVENT_QUEUE);
    let table = seen.clone();
    std::thread::Builder::new()
        .name("mdns-browse".into())
        .spawn(move || {
            // Ends when the mDNS daemon shuts down and drops the channel.
            while let Ok(event) = events.recv() {
                match event {
                    ServiceEvent::ServiceResolved(r) => {
                        if let Some(s) = seen_from(&r) {
                            table
                                .lock()
                                .unwrap_or_else(|e| e.into_inner())
                                .insert(s.clone());
                            if !forward(&tx, s) {
                                break;
                            }
                        }
                    }
                    ServiceEvent::ServiceRemoved(_, fullname) => {
                        let instance = fullname
                            .strip_suffix(&format!(".{SERVICE_TYPE}"))
                            .unwrap_or(&fullname)
                            .to_string();
                        table
                            .lock()
                            .unwrap_or_else(|e| e.into_inner())
                            .remove(&instance);
                    }
                    ServiceEvent::SearchStopped(_) => break,
                    _ => {}
                }
            }
        })
        .map_err(|e| DiscoveryError::Mdns(e.to_string()))?;
    let table = seen.clone();
    runtime.spawn(async move {
        let mut warned: HashSet<(String, String)> = HashSet::new();
        while let Some(s) = rx.recv().await {
            on_seen(&lan, &table, &s, &host, &fp, &mut warned).await;
        }
    });
    Ok(Discovery {
        running: Some(Running { daemon, fullname }),
        seen,
    })
}

/// What the daemon does with one resolved answer (module docs); it also refreshes which names
/// of `table` are pinned peers.
async fn on_seen(
    lan: &SharedLan,
    table: &SeenTable,
    s: &Seen,
    own_host: &str,
    own_fp: &str,
    warned: &mut HashSet<(String, String)>,
) {
    let list = match lan.mailbox.run(|c| peers::list(c)).await {
        Ok(l) => l,
        Err(e) => {
            tracing::warn!(error = %e, "mDNS: cannot read peers");
            return;
        }
    };
    let pinned = list
        .iter()
        .map(|p| (p.host.clone(), pinned_fp(p)))
        .collect();
    table
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .set_pinned(pinned);
    match standing(s, own_host, own_fp, &list) {
        Standing::Paired => match presence::consider_mdns(lan, &s.host, s.candidates()).await {
            Ok(Some(to)) => tracing::debug!(peer = %s.host, to = %to, "mDNS answer moved the peer"),
            Ok(None) => {}
            Err(e) => tracing::warn!(peer = %s.host, error = %e, "mDNS: address healing failed"),
        },
        Standing::KeyMismatch { advertised, pinned } => {
            if warned.len() >= MAX_SEEN_HOSTS {
                warned.clear();
            }
            if warned.insert((s.host.clone(), advertised.clone())) {
                tracing::warn!(
                    peer = %s.host,
                    advertised = %advertised,
                    pinned = %pinned,
                    addr = %s.addr,
                    "mDNS: KEY MISMATCH: a host advertises a pinned peer's name with another key; ignored"
                );
            }
        }
        Standing::ThisHost | Standing::NotPaired => {
            tracing::debug!(host = %s.host, addr = %s.addr, "mDNS: host seen");
        }
    }
}

impl Discovery {
    /// An inert discovery (mDNS off).
    pub fn disabled() -> Self {
        Discovery {
            running: None,
            seen: Arc::default(),
        }
    }

    /// Whether mDNS is advertising and browsing.
    pub fn is_running(&self) -> bool {
        self.running.is_some()
    }

    /// The latest answer per host (empty when mDNS is off).
    pub fn seen(&self) -> SeenTable {
        self.seen.clone()
    }

    /// A source of mDNS candidates for the failure ladder
    /// ([`crate::transport::lan::presence::run`]): see [`candidates`].
    pub fn ladder_source(
        &self,
    ) -> impl Fn(&str, &PublicKey) -> Vec<String> + Send + Sync + 'static {
        let table = self.seen.clone();
        move |host, key| candidates(&table, host, key)
    }

    /// Sends the goodbye (the records again with TTL 0), waits up to [`GOODBYE_WAIT`] for it,
    /// and stops the mDNS daemon. Idempotent.
    pub fn shutdown(&mut self) {
        let Some(running) = self.running.take() else {
            return;
        };
        if let Ok(done) = running.daemon.unregister(&running.fullname) {
            let _ = done.recv_timeout(GOODBYE_WAIT);
        }
        if let Ok(done) = running.daemon.shutdown() {
            let _ = done.recv_timeout(GOODBYE_WAIT);
        }
        tracing::info!("mDNS: goodbye sent, discovery stopped");
    }
}

impl Drop for Discovery {
    fn drop(&mut self) {
        self.shutdown();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn peer(host: &str, key: &PublicKey) -> Peer {
        Peer {
            host: host.into(),
            pubkey: key.to_b64(),
            enc_pub: None,
            enc_ad_iat: None,
            addr: None,
            addr_source: None,
            last_seen_at: None,
        }
    }

    fn seen(host: &str, fp: &str) -> Seen {
        Seen {
            host: host.into(),
            fp: fp.into(),
            v: "1".into(),
            ips: vec!["10.0.0.5".parse().unwrap(), "fe80::1".parse().unwrap()],
            port: 7373,
            addr: "10.0.0.5:7373".into(),
        }
    }

    #[test]
    fn answers_are_classified_by_the_pinned_key_only() {
        let me = agentmbx_protocol::keys::HostKey::generate().public();
        let beta = agentmbx_protocol::keys::HostKey::generate().public();
        let peers = vec![peer("beta", &beta)];
        let own = me.fingerprint();
        assert_eq!(
            standing(&seen("alpha", &own), "alpha", &own, &peers),
            Standing::ThisHost
        );
        assert_eq!(
            standing(&seen("alpha", "0000-0000-0000-0000"), "alpha", &own, &peers),
            Standing::NotPaired,
            "our own name with another key is just another host"
        );
        assert_eq!(
            standing(&seen("beta", &beta.fingerprint()), "alpha", &own, &peers),
            Standing::Paired
        );
        let mismatch = standing(&seen("beta", "0000-0000-0000-0000"), "alpha", &own, &peers);
        assert_eq!(
            mismatch.label(),
            format!(
                "KEY MISMATCH (advertised 0000-0000-0000-0000, pinned {})",
                beta.fingerprint()
            )
        );
        assert!(matches!(
            standing(&seen("beta", ""), "alpha", &own, &peers),
            Standing::KeyMismatch { .. }
        ));
        assert_eq!(
            standing(&seen("gamma", "x"), "alpha", &own, &peers),
            Standing::NotPaired
        );
    }

    #[test]
    fn ladder_candidates_need_the_pinned_fingerprint() {
        let beta = agentmbx_protocol::keys::HostKey::generate().public();
        let table: SeenTable = Arc::default();
        table
            .lock()
            .unwrap()
            .insert(seen("beta", &beta.fingerprint()));
        assert_eq!(
            candidates(&table, "beta", &beta),
            vec!["10.0.0.5:7373", "[fe80::1]:7373"]
        );
        let other = agentmbx_protocol::keys::HostKey::generate().public();
        assert!(candidates(&table, "beta", &other).is_empty());
        assert!(candidates(&table, "gamma", &beta).is_empty());
    }

    #[test]
    fn the_table_keeps_at_most_its_capacity_and_pinned_names_last() {
        let mut t = SeenHosts::default();
        for i in 0..MAX_SEEN_HOSTS + 100 {
            assert!(t.insert(seen(&format!("h{i}"), "x")));
        }
        assert_eq!(t.len(), MAX_SEEN_HOSTS);
        // The least recently answered went first; the newest are kept.
        assert!(t.get("h0").is_none() && t.get("h99").is_none());
        assert!(t.get(&format!("h{}", MAX_SEEN_HOSTS + 99)).is_some());

        let beta = agentmbx_protocol::keys::HostKey::generate().public();
        let mut t = SeenHosts::with_capacity(3);
        t.set_pinned(HashMap::from([("beta".to_string(), beta.fingerprint())]));
        assert!(t.insert(seen("beta", &beta.fingerprint())));
        // A flood of other names never evicts the pinned peer's answer.
        for i in 0..50 {
            assert!(t.insert(seen(&format!("flood{i}"), "x")));
        }
        assert_eq!(t.len(), 3);
        assert_eq!(t.get("beta").unwrap().fp, beta.fingerprint());
        assert!(t.get("flood49").is_some() && t.get("flood48").is_some());
        // Its name with another key does not replace the answer with the pinned key ...
        assert!(!t.insert(seen("beta", "0000-0000-0000-0000")));
        assert_eq!(t.get("beta").unwrap().fp, beta.fingerprint());
        // ... a fresh answer with the pinned key does.
        let mut moved = seen("beta", &beta.fingerprint());
        moved.port = 7400;
        assert!(t.insert(moved));
        assert_eq!(t.get("beta").unwrap().port, 7400);
        // Goodbyes free room.
        t.remove("beta");
        assert_eq!(t.len(), 2);

        // Only pinned names kept: an unpinned name does not get in, a pinned one does.
        let mut t = SeenHosts::with_capacity(1);
        t.set_pinned(HashMap::from([
            ("beta".to_string(), "fb".to_string()),
            ("gamma".to_string(), "fg".to_string()),
        ]));
        assert!(t.insert(seen("beta", "fb")));
        assert!(!t.insert(seen("stranger", "x")));
        assert!(t.insert(seen("gamma", "fg")));
        assert_eq!(
            t.into_sorted()
                .iter()
                .map(|s| s.host.as_str())
                .collect::<Vec<_>>(),
            ["gamma"]
        );
    }

    #[test]
    fn answers_past_the_queue_are_dropped_without_blocking() {
        let (tx, mut rx) = tokio::sync::mpsc::channel::<Seen>(EVENT_QUEUE);
        for i in 0..EVENT_QUEUE + 40 {
            assert!(
                forward(&tx, seen(&format!("h{i}"), "x")),
                "the handler is still there"
            );
        }
        let mut got = Vec::new();
        while let Ok(s) = rx.try_recv() {
            got.push(s.host);
        }
        assert_eq!(
            got.len(),
            EVENT_QUEUE,
            "the queue holds at most EVENT_QUEUE answers"
        );
        assert_eq!(got[0], "h0");
        assert_eq!(got[EVENT_QUEUE - 1], format!("h{}", EVENT_QUEUE - 1));
        // Room again once the handler caught up.
        assert!(forward(&tx, seen("late", "x")));
        assert_eq!(rx.try_recv().unwrap().host, "late");
        drop(rx);
        assert!(!forward(&tx, seen("gone", "x")), "the handler is gone");
    }

    #[test]
    fn disabled_config_starts_nothing() {
        let config = Config {
            mdns: false,
            ..Config::default()
        };
        assert!(!config.mdns_enabled());
        let loopback = Config {
            lan_bind: "127.0.0.1".parse().unwrap(),
            ..Config::default()
        };
        assert!(!loopback.mdns_enabled());
        let d = Discovery::disabled();
        assert!(!d.is_running() && d.seen().lock().unwrap().is_empty());
    }
}
