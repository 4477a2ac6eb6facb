//! Presence and address healing (`wire.md` §2.7, §4 "Presence/healing"): how a paired host that
//! moved (DHCP, another network) is found again, and how this host tells its peers where it is.
//!
//! - Outgoing: [`run`] sends a hop-signed presence beacon (`POST /v1/presence`, body
//!   [`PresenceBody`]) to every pinned peer with an address at start, when this host's own
//!   addresses change, every [`BEACON_INTERVAL`], and — with the peer's alternates too — each
//!   minute while mail to a peer is failing. The same minute, [`heal_stuck_peers`] walks the
//!   failure ladder for peers whose mail keeps failing: the last address a verified hop came
//!   from, the addresses of the peer's last beacon, then mDNS on a matching fingerprint.
//! - Incoming: [`accept_presence`] (behind the signed route) refuses replays by `seq`, keeps the
//!   reported addresses as alternates and, when a move is warranted, probes the candidates in
//!   the background, at most once a minute per peer. Every other verified hop hands its source
//!   address to [`learn_from_hop`] (spawned by the hop check after its commit), and an mDNS
//!   answer whose fingerprint matches a pinned key to [`consider_mdns`]. Each of the three has
//!   its own once-a-minute slot per peer, so one kind of hint (say, a host on the LAN
//!   advertising a paired peer's name and public fingerprint) never throttles another.
//! - Moving: [`heal_peer_addr`] adopts a candidate only when its signed status answers with the
//!   *pinned* key, our fresh challenge, a valid signature and the candidate's IP among the
//!   signed addresses ([`probe`]). Adopting updates `peers.addr` (and `addr_source`), makes the
//!   peer's pending outbox rows due now, records kv `peer-heal:<host>` `{via, at, from, to}` in
//!   the same transaction, then wakes the sender.
//! - Typed by the owner: [`set_addr_by_owner`] (`agentmbx peers addr`) stores an address only
//!   after the same proof (a DNS name need not be among the signed addresses), or unproven
//!   when the owner insists (`--force`).
//!
//! This module never trusts an address, a name or an mDNS answer: only a signature by the
//! pinned key moves a peer, and nothing here ever changes a pinned key. A working pinned *name*
//! (`x.local`) is kept unless mail to it fails (it survives DHCP better than an IP).

use std::net::IpAddr;
use std::sync::Arc;
use std::time::Duration;

use agentmbx_protocol::keys::PublicKey;
use agentmbx_protocol::status::{self, join_addr, split_addr, unmap, PresenceBody, StatusError};
use rusqlite::Connection;
use serde_json::{json, Value};
use tokio::task::JoinHandle;

use super::client::LanClient;
use super::{LanState, SharedLan};
use crate::mailbox::peers::{self, Peer};
use crate::mailbox::{outbox, relay_state, MailboxError};

/// How long a status probe may take (`wire.md` §2.7: 3 s).
pub const PROBE_TIMEOUT: Duration = Duration::from_secs(3);
/// How long one beacon POST may take.
pub const BEACON_TIMEOUT: Duration = Duration::from_secs(3);
/// At most one healing run per peer per this many ms (`wire.md` §2.7: 1 run/min/peer).
pub const HEAL_THROTTLE_MS: i64 = 60_000;
/// First beacon after start (0.5.x: 2 s, so the LAN server is surely up).
pub const FIRST_BEACON_DELAY: Duration = Duration::from_secs(2);
/// How often this host's own addresses are compared with the last announced ones (60 s, as
/// [`LADDER_INTERVAL`]; 0.5.x: 10 s): an idle daemon wakes as rarely as it can, and a peer
/// whose mail to this host fails runs its own failure ladder meanwhile. A restarted daemon
/// announces itself after [`FIRST_BEACON_DELAY`].
pub const ADDR_CHECK_INTERVAL: Duration = Duration::from_secs(60);
/// A beacon goes out at least this often even when nothing changed (0.5.x: 5 min).
pub const BEACON_INTERVAL: Duration = Duration::from_secs(300);
/// How often the failure ladder runs for peers whose mail keeps failing (0.5.x: 1 min).
pub const LADDER_INTERVAL: Duration = Duration::from_secs(60);
/// Largest status answer read from a candidate (bytes); a real one is well under 2 KiB.
pub const MAX_STATUS_BYTES: usize = 64 * 1024;
/// Failed attempts after which a peer's mail counts as stuck (the ladder runs for it).
pub const STUCK_ATTEMPTS: i64 = 2;
/// The port assumed for an address given without one (0.5.x's default daemon port).
pub const DEFAULT_PORT: u16 = 7373;
/// Most addresses of one mDNS answer that are probed (a real host advertises a few LAN IPs).
pub const MAX_MDNS_CANDIDATES: usize = 8;

/// Where a candidate address came from; also the `addr_source` an adopted address gets and the
/// `via` of kv `peer-heal:<host>` (`wire.md` §4).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Via {
    /// The source address of a verified hop.
    VerifiedHop,
    /// A signed presence beacon.
    Presence,
    /// The failure ladder (last-seen address, stored alternates).
    Ladder,
    /// An mDNS answer whose fingerprint matches the pinned key.
    Mdns,
    /// Typed by the owner (`peers addr`): a DNS name need not be among the signed addresses.
    Cli,
}

impl Via {
    /// The wire/kv text: `verified-hop`, `presence`, `ladder`, `mdns`, `cli`.
    pub fn as_str(self) -> &'static str {
        match self {
            Via::VerifiedHop => "verified-hop",
            Via::Presence => "presence",
            Via::Ladder => "ladder",
            Via::Mdns => "mdns",
            Via::Cli => "cli",
        }
    }
}

/// Why a presence beacon was refused: 400 `{ok:false, error}` (`wire.md` §2.7).
#[derive(Debug, thiserror::Error)]
pub enum PresenceError {
    /// Not a presence body.
    #[error("bad presence")]
    Bad,
    /// `seq` at or below the last one seen from this peer (a replay).
    #[error("stale presence (seq)")]
    Stale,
    /// The store failed.
    #[error(transparent)]
    Store(#[from] MailboxError),
}

/// Why a candidate did not prove to be the peer ([`probe`]).
#[derive(Debug, thiserror::Error)]
pub enum ProbeError {
    /// The candidate is not `host:port`.
    #[error("candidate {0:?} is not host:port")]
    BadCandidate(String),
    /// No HTTP answer (refused, timed out, redirect, DNS).
    #[error("no answer: {0}")]
    Unreachable(String),
    /// An answer that is not 2xx.
    #[error("answered HTTP {0}")]
    Status(u16),
    /// The body is too large or not JSON.
    #[error("the answer is not a status")]
    Body,
    /// The signed status does not prove the candidate.
    #[error(transparent)]
    Refused(#[from] StatusError),
}

impl ProbeError {
    /// The reason in words for the owner (`peers addr`): `no answer (…)`, `it answered with
    /// another key than the one pinned`, ….
    pub fn reason(&self) -> String {
        match self {
            ProbeError::BadCandidate(c) => format!("{c:?} is not host:port"),
            ProbeError::Unreachable(why) => format!("no answer ({why})"),
            ProbeError::Status(code) => {
                format!("it answered HTTP {code} instead of a status (is an agentmbx daemon there?)")
            }
            ProbeError::Body => "it answered something that is not a status".into(),
            ProbeError::Refused(e) => match e {
                StatusError::Malformed => {
                    "it answered without a signed status (not agentmbx, or a version without challenge support)".into()
                }
                StatusError::WrongHost(named) => {
                    // Unverified text from the network: quoted, escaped and cut.
                    let named: String = named.chars().take(64).collect();
                    format!("it answered as another host, {named:?}")
                }
                StatusError::WrongKey => "it answered with another key than the one pinned".into(),
                StatusError::WrongChallenge => {
                    "it did not sign our challenge (a replayed answer?)".into()
                }
                StatusError::BadSignature => {
                    "it answered with a signature the pinned key does not verify".into()
                }
                StatusError::NotListed => "it answered with the pinned key, but does not list that IP among its own addresses (a proxy or NAT in between?)".into(),
            },
        }
    }
}

// ---- kv keys ---------------------------------------------------------------------------------

/// kv key: `{via, at, from, to}` of the last move of `host`.
pub fn heal_key(host: &str) -> String {
    format!("peer-heal:{host}")
}

/// kv key: JSON array of the addresses `host` reported in its last beacon.
pub fn alts_key(host: &str) -> String {
    format!("peer-alts:{host}")
}

/// kv key: ISO ms time of the last accepted beacon from `host`.
pub fn presence_at_key(host: &str) -> String {
    format!("peer-presence-at:{host}")
}

/// kv key: the address a verified hop from `host` last came from (written by the hop check).
pub fn last_seen_key(host: &str) -> String {
    format!("peer-lastseen:{host}")
}

/// Which once-a-minute healing slot of a peer a run takes: each source of hints has its own.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Slot {
    /// Presence beacons (`peer-heal-tried:<host>`).
    Presence,
    /// Source addresses of verified hops (`peer-heal-tried-hop:<host>`).
    Hop,
    /// mDNS answers (`peer-heal-tried-mdns:<host>`).
    Mdns,
}

/// kv key: ms time of the last healing run from `slot` for `host` (the once-a-minute throttle).
fn tried_key(host: &str, slot: Slot) -> String {
    match slot {
        Slot::Presence => format!("peer-heal-tried:{host}"),
        Slot::Hop => format!("peer-heal-tried-hop:{host}"),
        Slot::Mdns => format!("peer-heal-tried-mdns:{host}"),
    }
}

// ---- self addresses --------------------------------------------------------------------------

/// Interface name prefixes of container bridges, VMs and VPN tunnels: not where a LAN peer
/// reaches us (0.5.x list). Matched case-insensitively.
pub const VIRTUAL_IFACE_PREFIXES: [&str; 14] = [
    "docker", "br-", "bridge", "vmnet", "veth", "virbr", "podman", "cni", "flannel", "utun", "tun",
    "tap", "awdl", "llw",
];

fn is_virtual(name: &str) -> bool {
    let name = name.to_ascii_lowercase();
    VIRTUAL_IFACE_PREFIXES.iter().any(|p| name.starts_with(p)) || name.starts_with("anpi")
}

/// Picks the addresses worth announcing from `(interface name, ip)` pairs: non-loopback IPv4,
/// physical interfaces first; virtual ones only when nothing else is left (`wire.md` §2.7).
pub fn announced_ipv4(ifaces: &[(String, IpAddr)]) -> Vec<IpAddr> {
    let all: Vec<&(String, IpAddr)> = ifaces
        .iter()
        .filter(|(_, ip)| ip.is_ipv4() && !ip.is_loopback() && !ip.is_unspecified())
        .collect();
    let real: Vec<IpAddr> = all
        .iter()
        .filter(|(name, _)| !is_virtual(name))
        .map(|(_, ip)| *ip)
        .collect();
    let mut out = if real.is_empty() {
        all.iter().map(|(_, ip)| *ip).collect()
    } else {
        real
    };
    out.dedup();
    out
}

/// The machine's LAN IPv4 addresses now ([`announced_ipv4`] over the interface list; empty when
/// the list cannot be read).
pub fn interface_addrs() -> Vec<IpAddr> {
    match if_addrs::get_if_addrs() {
        Ok(list) => announced_ipv4(
            &list
                .into_iter()
                .map(|i| (i.name.clone(), i.ip()))
                .collect::<Vec<_>>(),
        ),
        Err(e) => {
            tracing::debug!(error = %e, "cannot list network interfaces");
            Vec::new()
        }
    }
}

/// This host's own IPs as signed in status and presence: the configured/bound ones in
/// [`LanState::self_addrs`], else the interfaces' LAN IPv4 addresses read now (so a DHCP change
/// shows in the next beacon).
pub fn self_ips(state: &LanState) -> Vec<IpAddr> {
    if state.self_addrs.is_empty() {
        interface_addrs()
    } else {
        state.self_addrs.clone()
    }
}

/// [`self_ips`] as `ip:port` texts with this host's LAN port (the `addrs` of status and
/// presence).
pub fn self_addr_texts(state: &LanState) -> Vec<String> {
    self_ips(state)
        .into_iter()
        .map(|ip| join_addr(ip, state.port))
        .collect()
}

// ---- probing and moving ----------------------------------------------------------------------

fn http_client(timeout: Duration) -> Result<reqwest::Client, ProbeError> {
    crate::install_tls_provider();
    reqwest::Client::builder()
        .no_proxy() // LAN probes never go through HTTP(S)_PROXY
        .timeout(timeout)
        .redirect(reqwest::redirect::Policy::none())
        .build()
        .map_err(|e| ProbeError::Unreachable(describe(&e)))
}

/// The IP of an address text, IPv4-mapped unwrapped; None for a name.
fn ip_of(host_text: &str) -> Option<IpAddr> {
    host_text.parse::<IpAddr>().ok().map(unmap)
}

/// Challenge-probes `candidate` (`host:port`): `GET /v1/status?challenge=<fresh nonce>` (3 s,
/// no redirects) must answer as `host`, signed by `pinned` over our challenge, and list the
/// candidate's IP among its signed addresses. For a DNS name the resolved IPs must be listed,
/// unless `owner_typed` (`peers addr`: a name for a NAT or tunnel the peer cannot know); an IP
/// must be listed even then (`wire.md` §2.7). Returns the verified status (its `addrs` are
/// what the peer reports now). Errors: [`ProbeError`].
pub async fn probe(
    host: &str,
    pinned: &PublicKey,
    candidate: &str,
    owner_typed: bool,
) -> Result<status::SignedStatus, ProbeError> {
    let (name, port) = split_addr(candidate);
    let port = port
        .filter(|p| *p != 0)
        .ok_or_else(|| ProbeError::BadCandidate(candidate.to_string()))?;
    let challenge = crate::pairing::new_nonce();
    let http = http_client(PROBE_TIMEOUT)?;
    let url = format!("http://{candidate}/v1/status?challenge={challenge}");
    let mut resp = http
        .get(&url)
        .send()
        .await
        .map_err(|e| ProbeError::Unreachable(describe(&e)))?;
    if !resp.status().is_success() {
        return Err(ProbeError::Status(resp.status().as_u16()));
    }
    let mut body = Vec::new();
    while let Some(chunk) = resp
        .chunk()
        .await
        .map_err(|e| ProbeError::Unreachable(describe(&e)))?
    {
        if body.len() + chunk.len() > MAX_STATUS_BYTES {
            return Err(ProbeError::Body);
        }
        body.extend_from_slice(&chunk);
    }
    let answer: Value = agentmbx_protocol::canonical::parse(&body).map_err(|_| ProbeError::Body)?;
    let ips: Vec<IpAddr> = match ip_of(name) {
        Some(ip) => vec![ip],
        None if owner_typed => {
            return Ok(status::verify_status(&answer, host, pinned, &challenge)?);
        }
        None => tokio::net::lookup_host((name, port))
            .await
            .map(|it| it.map(|sa| unmap(sa.ip())).collect())
            .unwrap_or_default(),
    };
    Ok(status::verify_status_for(
        &answer, host, pinned, &challenge, &ips,
    )?)
}

/// A probe's network error in our words ([`crate::net_error::describe`]): never the URL,
/// whose query holds the challenge.
fn describe(e: &reqwest::Error) -> String {
    crate::net_error::describe(e, Some(PROBE_TIMEOUT))
}

/// Points `host` at `candidate` if a challenge probe there proves it is that host (see
/// [`probe`]). In one transaction: `peers.addr` = candidate with `addr_source` = `via`, the
/// peer's pending outbox rows due now, kv `peer-heal:<host>` `{via, at, from, to}`; then the
/// sender is woken. Returns the new address, or None when nothing moved (unknown peer, same
/// address, or the probe failed: logged at debug, never an error). Errors: the store only.
pub async fn heal_peer_addr(
    state: &LanState,
    host: &str,
    candidate: &str,
    via: Via,
) -> Result<Option<String>, MailboxError> {
    heal(state, host, candidate, via, false).await
}

/// [`heal_peer_addr`]; with `keep_if_reported`, a proven candidate is still not adopted when
/// mail to the peer flows and the pinned address is among the addresses the peer's signed
/// status reports (a host with two interfaces is not moved by a hop from its other one).
async fn heal(
    state: &LanState,
    host: &str,
    candidate: &str,
    via: Via,
    keep_if_reported: bool,
) -> Result<Option<String>, MailboxError> {
    let peer = {
        let host = host.to_string();
        state
            .mailbox
            .run(move |conn| peers::by_name(conn, &host))
            .await?
    };
    let Some(peer) = peer else { return Ok(None) };
    if peer.addr.as_deref() == Some(candidate) {
        return Ok(None);
    }
    let Ok(pinned) = PublicKey::from_b64(&peer.pubkey) else {
        return Ok(None);
    };
    let proven = match probe(host, &pinned, candidate, via == Via::Cli).await {
        Ok(s) => s,
        Err(e) => {
            tracing::debug!(peer = %host, candidate, via = via.as_str(), error = %e, "address candidate not adopted");
            return Ok(None);
        }
    };
    let reported = keep_if_reported.then_some(proven.addrs);
    let now = state.clock.now_ms();
    let (host_s, cand, pubkey) = (host.to_string(), candidate.to_string(), peer.pubkey.clone());
    let moved = state
        .mailbox
        .run(move |conn| {
            let tx = conn.transaction()?;
            let moved = adopt(&tx, &host_s, &pubkey, &cand, via, now, reported.as_deref())?;
            tx.commit()?;
            Ok(moved)
        })
        .await?;
    let Some(from) = moved else { return Ok(None) };
    tracing::info!(
        peer = %host,
        from = from.as_deref().unwrap_or("-"),
        to = candidate,
        via = via.as_str(),
        "peer moved (challenge verified)"
    );
    state.wake.notify_one();
    Ok(Some(candidate.to_string()))
}

/// Points `host` at the proven `cand` inside the caller's transaction: `peers.addr` (source
/// `via`), the peer's pending outbox rows due now, kv `peer-heal:<host>` `{via, at, from, to}`.
/// Nothing moves when the peer is gone, was re-pinned to another key than `pubkey` (the key is
/// what was proven), is already at `cand`, or — with `reported` — when [`should_move`] says the
/// pinned address is still fine. Returns `Some(previous address)` when it moved.
fn adopt(
    conn: &Connection,
    host: &str,
    pubkey: &str,
    cand: &str,
    via: Via,
    now_ms: i64,
    reported: Option<&[String]>,
) -> Result<Option<Option<String>>, MailboxError> {
    let Some(cur) = peers::by_name(conn, host)? else {
        return Ok(None);
    };
    if cur.pubkey != pubkey || cur.addr.as_deref() == Some(cand) {
        return Ok(None);
    }
    if let Some(list) = reported {
        if !should_move(conn, host, cur.addr.as_deref(), Some(list))? {
            tracing::debug!(peer = %host, candidate = cand, "proven, but the pinned address is still reported and mail flows: kept");
            return Ok(None);
        }
    }
    peers::set_addr(conn, host, cand, via.as_str())?;
    outbox::peer_is_back(conn, host, now_ms)?;
    // Its signed status answered at `cand`: the address answers, the LAN mark clears.
    crate::mailbox::lan_memory::clear(conn, host, now_ms)?;
    let record = json!({
        "via": via.as_str(),
        "at": agentmbx_protocol::time::iso_ms(now_ms),
        "from": cur.addr,
        "to": cand,
    });
    relay_state::kv_set(conn, &heal_key(host), &record.to_string())?;
    Ok(Some(cur.addr))
}

/// Whether `host` has mail that is failing: a pending outbox row with a failed attempt.
fn failing(conn: &Connection, host: &str) -> Result<bool, MailboxError> {
    Ok(conn.query_row(
        "SELECT EXISTS(SELECT 1 FROM outbox WHERE host = ?1 AND state = 'pending'
           AND (attempts > 0 OR lan_failures > 0))",
        [host],
        |r| r.get(0),
    )?)
}

/// Should a candidate replace the pinned address (`wire.md` §4)? Yes when mail to the peer is
/// failing, when there is no pinned address, or when the pinned address is an IP the peer no
/// longer reports (`reported` None: nothing reported, counts as "not reported"). A reported
/// `ip:port` must match the pinned port too (a bare reported IP matches any port), so a host
/// that moved to another port on the same IP is found again. A pinned name is kept while mail
/// flows.
fn should_move(
    conn: &Connection,
    host: &str,
    pinned: Option<&str>,
    reported: Option<&[String]>,
) -> Result<bool, MailboxError> {
    if failing(conn, host)? {
        return Ok(true);
    }
    let Some(pinned) = pinned else {
        return Ok(true);
    };
    let (pinned_host, pinned_port) = split_addr(pinned);
    let Some(pinned_ip) = ip_of(pinned_host) else {
        return Ok(false);
    };
    Ok(match reported {
        Some(list) => !list.iter().any(|a| {
            let (h, port) = split_addr(a);
            ip_of(h) == Some(pinned_ip) && (port.is_none() || port == pinned_port)
        }),
        None => true,
    })
}

/// Takes the once-a-minute healing `slot` of `host` at `now_ms`: false when a run from that
/// slot started less than [`HEAL_THROTTLE_MS`] ago. Persisted in kv so the clock drives it. A
/// run recorded after `now_ms` was recorded by a clock ahead of the current one (a skew fixed
/// since; the next run would be more than [`HEAL_THROTTLE_MS`] ahead): the slot is free.
fn take_heal_slot(
    conn: &Connection,
    host: &str,
    slot: Slot,
    now_ms: i64,
) -> Result<bool, MailboxError> {
    let key = tried_key(host, slot);
    let last = relay_state::kv_get(conn, &key)?
        .and_then(|v| v.parse::<i64>().ok())
        .unwrap_or(i64::MIN / 2);
    if last <= now_ms && now_ms - last < HEAL_THROTTLE_MS {
        return Ok(false);
    }
    relay_state::kv_set(conn, &key, &now_ms.to_string())?;
    Ok(true)
}

/// `addr` with a port: as given when it has one, else with `port`.
fn with_port(addr: &str, port: u16) -> Option<String> {
    match split_addr(addr) {
        (_, Some(p)) if p != 0 => Some(addr.to_string()),
        ("", _) => None,
        (name, _) => Some(match ip_of(name) {
            Some(ip) => join_addr(ip, port),
            None => format!("{name}:{port}"),
        }),
    }
}

/// The pinned address's port, else [`DEFAULT_PORT`].
fn pinned_port(peer: &Peer) -> u16 {
    peer.addr
        .as_deref()
        .and_then(|a| split_addr(a).1)
        .filter(|p| *p != 0)
        .unwrap_or(DEFAULT_PORT)
}

/// Tries `candidates` in order until one is adopted; returns it.
async fn heal_first(
    state: &LanState,
    host: &str,
    candidates: &[String],
    via: Via,
) -> Option<String> {
    for c in candidates {
        match heal_peer_addr(state, host, c, via).await {
            Ok(Some(moved)) => return Some(moved),
            Ok(None) => {}
            Err(e) => {
                tracing::warn!(peer = %host, error = %e, "address healing failed in the mailbox");
                return None;
            }
        }
    }
    None
}

/// Receives a verified presence beacon from `host` (`POST /v1/presence`, hop already checked;
/// `remote` is the TCP source address). In one transaction: the `seq` replay check and its
/// update (`peers.presence_seq`), kv `peer-alts:<host>` and `peer-presence-at:<host>`, and the
/// decision to probe. When a move is warranted and the peer's healing slot is free, the
/// candidates (`remote:port`, then the reported addresses; the pinned one excluded) are probed
/// in a background task, whose handle is returned (it yields the adopted address, if any).
/// Errors: [`PresenceError::Bad`], [`PresenceError::Stale`] (nothing changed), store faults.
pub async fn accept_presence(
    state: &SharedLan,
    host: &str,
    body: &Value,
    remote: IpAddr,
) -> Result<Option<JoinHandle<Option<String>>>, PresenceError> {
    let beacon = PresenceBody::parse(body).map_err(|_| PresenceError::Bad)?;
    let now = state.clock.now_ms();
    let host_s = host.to_string();
    let addrs = beacon.addrs.clone();
    let decided = state
        .mailbox
        .run(move |conn| {
            let tx = conn.transaction()?;
            if !peers::advance_presence_seq(&tx, &host_s, beacon.seq)? {
                return Ok(Err(PresenceError::Stale));
            }
            let alts = serde_json::to_string(&addrs).unwrap_or_else(|_| "[]".into());
            relay_state::kv_set(&tx, &alts_key(&host_s), &alts)?;
            relay_state::kv_set(
                &tx,
                &presence_at_key(&host_s),
                &agentmbx_protocol::time::iso_ms(now),
            )?;
            let peer = peers::by_name(&tx, &host_s)?;
            // A presence announcement: probe a marked address now (mailbox::lan_memory).
            let probe = crate::mailbox::lan_memory::alive(&tx, &host_s, now)? == Some(true);
            let go = match &peer {
                Some(p) => {
                    should_move(&tx, &host_s, p.addr.as_deref(), Some(&addrs))?
                        && take_heal_slot(&tx, &host_s, Slot::Presence, now)?
                }
                None => false,
            };
            tx.commit()?;
            Ok(Ok((peer.filter(|_| go), probe)))
        })
        .await??;
    let (decided, probe) = decided;
    if probe {
        state.wake.notify_one();
    }
    let Some(peer) = decided else { return Ok(None) };
    let fallback_port = beacon.port.unwrap_or_else(|| pinned_port(&peer));
    let mut candidates: Vec<String> = Vec::new();
    if let Some(port) = beacon.port.filter(|_| !remote.is_unspecified()) {
        candidates.push(join_addr(remote, port));
    }
    candidates.extend(
        beacon
            .addrs
            .iter()
            .filter_map(|a| with_port(a, fallback_port)),
    );
    let mut seen = std::collections::HashSet::new();
    candidates.retain(|c| peer.addr.as_deref() != Some(c.as_str()) && seen.insert(c.clone()));
    if candidates.is_empty() {
        return Ok(None);
    }
    let state = Arc::clone(state);
    let host = host.to_string();
    Ok(Some(tokio::spawn(async move {
        heal_first(&state, &host, &candidates, Via::Presence).await
    })))
}

/// After a verified hop from `host` that came from `remote` (with the peer's `x-mbx-port` hint,
/// else the pinned port; `wire.md` §4 "Presence/healing"): when `remote:port` differs from the
/// pinned address and a move may be warranted (mail failing, or a pinned IP), probes it in the
/// background, at most once a minute per peer (its own slot). The proven candidate is adopted
/// only if mail is failing or the peer's signed status no longer reports the pinned address.
/// kv `peer-lastseen:<host>` is the hop check's to write. Called by the hop check for every
/// signed route but `/v1/presence`, after its commit. Returns the task's handle when a probe
/// started. Errors: the store only.
pub async fn learn_from_hop(
    state: &SharedLan,
    host: &str,
    remote: IpAddr,
    port_hint: Option<u16>,
) -> Result<Option<JoinHandle<Option<String>>>, MailboxError> {
    let now = state.clock.now_ms();
    let remote = unmap(remote);
    let host_s = host.to_string();
    let candidate = state
        .mailbox
        .run(move |conn| {
            let Some(peer) = peers::by_name(conn, &host_s)? else {
                return Ok(None);
            };
            let port = port_hint
                .filter(|p| *p != 0)
                .unwrap_or_else(|| pinned_port(&peer));
            let cand = join_addr(remote, port);
            if peer.addr.as_deref() == Some(cand.as_str()) {
                return Ok(None);
            }
            let tx = conn.transaction()?;
            let go = should_move(&tx, &host_s, peer.addr.as_deref(), None)?
                && take_heal_slot(&tx, &host_s, Slot::Hop, now)?;
            tx.commit()?;
            Ok(go.then_some(cand))
        })
        .await?;
    let Some(candidate) = candidate else {
        return Ok(None);
    };
    let state = Arc::clone(state);
    let host = host.to_string();
    Ok(Some(tokio::spawn(async move {
        match heal(&state, &host, &candidate, Via::VerifiedHop, true).await {
            Ok(moved) => moved,
            Err(e) => {
                tracing::warn!(peer = %host, error = %e, "address healing failed in the mailbox");
                None
            }
        }
    })))
}

/// An mDNS answer for the pinned peer `host` whose fingerprint matched its pinned key
/// (`crate::discovery` checked it): the advertised `candidates` (`ip:port`, the first
/// [`MAX_MDNS_CANDIDATES`]) are probed when a move is warranted (the pinned IP is not among
/// them, or mail is failing) and the peer's *mDNS* slot is free. A name and a fingerprint are
/// public, so anyone on the LAN can send such an answer: it takes only the mDNS slot, never the
/// one presence beacons or hops heal with. Returns the adopted address. Errors: the store only.
pub async fn consider_mdns(
    state: &SharedLan,
    host: &str,
    mut candidates: Vec<String>,
) -> Result<Option<String>, MailboxError> {
    candidates.truncate(MAX_MDNS_CANDIDATES);
    let now = state.clock.now_ms();
    let host_s = host.to_string();
    let reported = candidates.clone();
    let go = state
        .mailbox
        .run(move |conn| {
            let Some(peer) = peers::by_name(conn, &host_s)? else {
                return Ok(None);
            };
            if peer
                .addr
                .as_deref()
                .is_some_and(|a| reported.iter().any(|c| c == a))
            {
                // Sighted at its pinned address: probe it now if it is marked LAN down
                // (mailbox::lan_memory); the probe's answer clears the mark.
                if crate::mailbox::lan_memory::alive(conn, &host_s, now)? == Some(true) {
                    return Ok(Some(None));
                }
                return Ok(None);
            }
            let tx = conn.transaction()?;
            let go = should_move(&tx, &host_s, peer.addr.as_deref(), Some(&reported))?
                && take_heal_slot(&tx, &host_s, Slot::Mdns, now)?;
            tx.commit()?;
            Ok(go.then_some(Some(peer)))
        })
        .await?;
    match go {
        None => return Ok(None),
        Some(None) => {
            state.wake.notify_one();
            return Ok(None);
        }
        Some(Some(_)) => {}
    }
    Ok(heal_first(state, host, &candidates, Via::Mdns).await)
}

// ---- typed by the owner ------------------------------------------------------------------------

/// What `agentmbx peers addr` stored ([`set_addr_by_owner`]).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct OwnerAddr {
    /// The peer.
    pub host: String,
    /// The address now pinned (`host:port`).
    pub addr: String,
    /// True when the address answered with a status signed by the pinned key over our
    /// challenge; false when it was stored unproven (`--force`).
    pub verified: bool,
    /// Why it did not verify (only when stored unproven).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub why: Option<String>,
}

/// Why `peers addr` stored nothing.
#[derive(Debug, thiserror::Error)]
pub enum OwnerAddrError {
    /// No peer has that name.
    #[error("no peer named {0} (see `agentmbx peers`)")]
    NotPaired(String),
    /// The address did not prove to be the peer, and the owner did not insist.
    #[error("{addr} did not prove to be {host}: {why}; nothing changed. Check the address (the peer's LAN server, host:port), or store it anyway with --force (the peer may be down now; mail to it is tried there)")]
    Unverified {
        /// The peer.
        host: String,
        /// The address typed.
        addr: String,
        /// [`ProbeError::reason`].
        why: String,
    },
    /// The store failed.
    #[error(transparent)]
    Store(#[from] MailboxError),
}

/// `agentmbx peers addr <host> <addr>` (0.5.x `healPeerAddr(…, "cli")`): challenge-probes
/// `addr` ([`probe`], owner-typed: a DNS name need not be among the signed addresses, an IP
/// must) and, when it proves the pinned key, stores it like any heal — in one transaction
/// `peers.addr` (source `cli`), the peer's pending outbox rows due now and kv
/// `peer-heal:<host>` `{via:"cli", at, from, to}` (not rewritten when `addr` is already the
/// pinned one). When the probe fails, nothing changes unless `force`: then the address is stored
/// unproven (source `cli`, rows due now, no heal record). Errors: [`OwnerAddrError`].
pub async fn set_addr_by_owner(
    mailbox: &crate::mailbox::Mailbox,
    clock: &agentmbx_protocol::clock::SharedClock,
    host: &str,
    addr: &str,
    force: bool,
) -> Result<OwnerAddr, OwnerAddrError> {
    let peer = {
        let host = host.to_string();
        mailbox.run(move |conn| peers::by_name(conn, &host)).await?
    };
    let Some(peer) = peer else {
        return Err(OwnerAddrError::NotPaired(host.to_string()));
    };
    let proven = match PublicKey::from_b64(&peer.pubkey) {
        Ok(key) => probe(host, &key, addr, true).await.map_err(|e| e.reason()),
        Err(_) => Err("it cannot be checked: the pinned key does not parse".to_string()),
    };
    let why = match proven {
        Ok(_) => None,
        Err(why) if force => Some(why),
        Err(why) => {
            return Err(OwnerAddrError::Unverified {
                host: host.to_string(),
                addr: addr.to_string(),
                why,
            })
        }
    };
    let now = clock.now_ms();
    let (host_s, addr_s, pubkey, verified) = (
        host.to_string(),
        addr.to_string(),
        peer.pubkey.clone(),
        why.is_none(),
    );
    let stored = mailbox
        .run(move |conn| {
            let tx = conn.transaction()?;
            let Some(cur) = peers::by_name(&tx, &host_s)? else {
                return Ok(Err(OwnerAddrError::NotPaired(host_s)));
            };
            if verified && cur.pubkey != pubkey {
                return Ok(Err(OwnerAddrError::Unverified {
                    host: host_s,
                    addr: addr_s,
                    why: "it proved a key that is no longer the pinned one (re-pinned meanwhile)"
                        .into(),
                }));
            }
            let moved = if verified {
                adopt(&tx, &host_s, &pubkey, &addr_s, Via::Cli, now, None)?.is_some()
            } else {
                false
            };
            if !moved {
                // Unproven (forced), or already the pinned address: no heal to record.
                peers::set_addr(&tx, &host_s, &addr_s, Via::Cli.as_str())?;
                outbox::peer_is_back(&tx, &host_s, now)?;
                if verified {
                    // Its signed status answered there: the address answers, the mark clears.
                    crate::mailbox::lan_memory::clear(&tx, &host_s, now)?;
                } else {
                    // Set without proof: probe it now.
                    crate::mailbox::lan_memory::probe_soon(&tx, &host_s, now)?;
                }
            }
            tx.commit()?;
            Ok(Ok(()))
        })
        .await?;
    stored?;
    if verified {
        tracing::info!(peer = %host, to = addr, "peer address set by the owner (challenge verified)");
    } else {
        tracing::warn!(peer = %host, to = addr, "peer address set by the owner without proof (--force)");
    }
    Ok(OwnerAddr {
        host: host.to_string(),
        addr: addr.to_string(),
        verified,
        why,
    })
}

// ---- the failure ladder ------------------------------------------------------------------------

/// Hosts with a pending outbox row that failed at least [`STUCK_ATTEMPTS`] times.
fn stuck_hosts(conn: &Connection) -> Result<Vec<String>, MailboxError> {
    let mut st = conn.prepare(
        "SELECT DISTINCT host FROM outbox WHERE state = 'pending'
           AND (attempts >= ?1 OR lan_failures >= ?1) ORDER BY host",
    )?;
    let rows = st
        .query_map([STUCK_ATTEMPTS], |r| r.get(0))?
        .collect::<Result<Vec<String>, _>>()?;
    Ok(rows)
}

/// A JSON array of strings from kv, empty when absent or malformed.
fn kv_list(conn: &Connection, key: &str) -> Result<Vec<String>, MailboxError> {
    Ok(relay_state::kv_get(conn, key)?
        .and_then(|v| serde_json::from_str::<Vec<String>>(&v).ok())
        .unwrap_or_default())
}

/// One step of the failure ladder for every peer whose mail keeps failing (run each minute):
/// the address its last verified hop came from, the addresses of its last beacon, then the
/// mDNS candidates `mdns(host, pinned key)` gives (already filtered to the pinned key's
/// fingerprint). Each rung is a challenge probe. Returns the hosts that moved.
pub async fn heal_stuck_peers<F>(state: &SharedLan, mdns: F) -> Vec<String>
where
    F: Fn(&str, &PublicKey) -> Vec<String>,
{
    let ladders = state
        .mailbox
        .run(|conn| {
            let mut out = Vec::new();
            for host in stuck_hosts(conn)? {
                let Some(peer) = peers::by_name(conn, &host)? else {
                    continue;
                };
                let port = pinned_port(&peer);
                let mut rungs: Vec<String> = Vec::new();
                if let Some(seen) = relay_state::kv_get(conn, &last_seen_key(&host))? {
                    rungs.push(seen);
                }
                rungs.extend(
                    kv_list(conn, &alts_key(&host))?
                        .iter()
                        .filter_map(|a| with_port(a, port)),
                );
                out.push((peer, rungs));
            }
            Ok(out)
        })
        .await;
    let ladders = match ladders {
        Ok(l) => l,
        Err(e) => {
            tracing::warn!(error = %e, "cannot read stuck peers");
            return Vec::new();
        }
    };
    let mut moved = Vec::new();
    for (peer, rungs) in ladders {
        let mut seen = std::collections::HashSet::new();
        let rungs: Vec<String> = rungs
            .into_iter()
            .filter(|c| peer.addr.as_deref() != Some(c.as_str()) && seen.insert(c.clone()))
            .collect();
        if heal_first(state, &peer.host, &rungs, Via::Ladder)
            .await
            .is_some()
        {
            moved.push(peer.host);
            continue;
        }
        let Ok(key) = PublicKey::from_b64(&peer.pubkey) else {
            continue;
        };
        let found: Vec<String> = mdns(&peer.host, &key)
            .into_iter()
            .filter(|c| peer.addr.as_deref() != Some(c.as_str()))
            .collect();
        if heal_first(state, &peer.host, &found, Via::Mdns)
            .await
            .is_some()
        {
            moved.push(peer.host);
        }
    }
    moved
}

// ---- beacons -----------------------------------------------------------------------------------

/// Sends one signed beacon to every pinned peer with an address (only the hosts in `only`, when
/// given): to the pinned address, and for a peer whose mail is failing to its alternates and
/// last-seen address too, until one answers 2xx. Returns the hosts that accepted it. Failures
/// are logged at debug (a peer that is away is the normal case).
pub async fn send_presence(state: &SharedLan, only: Option<&[String]>) -> Vec<String> {
    let targets = state
        .mailbox
        .run(|conn| {
            let mut out = Vec::new();
            for peer in peers::list(conn)? {
                let Some(addr) = peer.addr.clone() else {
                    continue;
                };
                let mut list = vec![addr];
                if failing(conn, &peer.host)? {
                    let port = pinned_port(&peer);
                    list.extend(
                        kv_list(conn, &alts_key(&peer.host))?
                            .iter()
                            .filter_map(|a| with_port(a, port)),
                    );
                    if let Some(seen) = relay_state::kv_get(conn, &last_seen_key(&peer.host))? {
                        list.push(seen);
                    }
                }
                let mut seen = std::collections::HashSet::new();
                list.retain(|a| seen.insert(a.clone()));
                out.push((peer.host, list));
            }
            Ok(out)
        })
        .await;
    let targets = match targets {
        Ok(t) => t,
        Err(e) => {
            tracing::warn!(error = %e, "cannot read peers for presence");
            return Vec::new();
        }
    };
    let targets: Vec<(String, Vec<String>)> = targets
        .into_iter()
        .filter(|(h, _)| only.is_none_or(|o| o.contains(h)))
        .collect();
    if targets.is_empty() {
        return Vec::new();
    }
    crate::install_tls_provider();
    let client = match LanClient::new(state.ident.clone(), state.clock.clone(), state.port) {
        Ok(c) => c.with_instance(state.instance.clone()),
        Err(e) => {
            tracing::warn!(error = %e, "cannot build the LAN client for presence");
            return Vec::new();
        }
    };
    let body = PresenceBody::new(
        state.clock.now_ms(),
        state.port,
        self_addr_texts(state),
        state.version,
    )
    .to_json();
    let mut tasks = tokio::task::JoinSet::new();
    for (host, addrs) in targets {
        let (client, body) = (client.clone(), body.clone());
        tasks.spawn(async move {
            for addr in &addrs {
                match post_presence(&client, addr, &body).await {
                    Ok(()) => return Some(host),
                    Err(e) => {
                        tracing::debug!(peer = %host, addr = %addr, error = %e, "presence beacon not accepted")
                    }
                }
            }
            None
        });
    }
    let mut accepted = Vec::new();
    while let Some(done) = tasks.join_next().await {
        if let Ok(Some(host)) = done {
            accepted.push(host);
        }
    }
    accepted.sort();
    accepted
}

/// One hop-signed `POST /v1/presence` to `addr`; Ok on a 2xx answer.
async fn post_presence(client: &LanClient, addr: &str, body: &str) -> Result<(), String> {
    let call = client.call(
        reqwest::Method::POST,
        addr,
        "/v1/presence",
        body.as_bytes().to_vec(),
    );
    match tokio::time::timeout(BEACON_TIMEOUT, call).await {
        Ok(Ok((status, _))) if (200..300).contains(&status) => Ok(()),
        Ok(Ok((status, _))) => Err(format!("answered HTTP {status}")),
        Ok(Err(e)) => Err(e.to_string()),
        Err(_) => Err("timed out".into()),
    }
}

/// The presence loop of the daemon until `stop` turns true: the first beacon after
/// [`FIRST_BEACON_DELAY`], then one whenever this host's addresses changed (checked every
/// [`ADDR_CHECK_INTERVAL`]) or [`BEACON_INTERVAL`] passed; every [`LADDER_INTERVAL`] the failure
/// ladder ([`heal_stuck_peers`], with `mdns` giving a stuck peer's mDNS candidates) and a beacon
/// to the peers still stuck, alternates included.
pub async fn run<F>(state: SharedLan, mdns: F, mut stop: tokio::sync::watch::Receiver<bool>)
where
    F: Fn(&str, &PublicKey) -> Vec<String> + Send + Sync + 'static,
{
    let mut last_addrs: Option<Vec<String>> = None;
    let mut last_beacon = tokio::time::Instant::now();
    let mut last_ladder = tokio::time::Instant::now();
    let mut wait = FIRST_BEACON_DELAY;
    loop {
        tokio::select! {
            _ = stop.wait_for(|s| *s) => return,
            _ = tokio::time::sleep(wait) => {}
        }
        wait = ADDR_CHECK_INTERVAL;
        let mut addrs = self_addr_texts(&state);
        addrs.sort();
        if last_addrs.as_ref() != Some(&addrs) || last_beacon.elapsed() >= BEACON_INTERVAL {
            if last_addrs.is_some() && last_addrs.as_ref() != Some(&addrs) {
                tracing::info!(addrs = ?addrs, "this host's addresses changed: announcing them to peers");
            }
            last_addrs = Some(addrs);
            last_beacon = tokio::time::Instant::now();
            let accepted = send_presence(&state, None).await;
            tracing::debug!(accepted = ?accepted, "presence beacon sent");
        }
        if last_ladder.elapsed() >= LADDER_INTERVAL {
            last_ladder = tokio::time::Instant::now();
            let moved = heal_stuck_peers(&state, &mdns).await;
            if !moved.is_empty() {
                tracing::debug!(moved = ?moved, "failure ladder moved peers");
            }
            let stuck: Vec<String> = state
                .mailbox
                .run(|c| stuck_hosts(c))
                .await
                .unwrap_or_default();
            if !stuck.is_empty() {
                send_presence(&state, Some(&stuck)).await;
            }
        }
    }
}

#[cfg(test)]
mod tests;
