//! Host pairing (`wire.md` §2.9): the one-time token flow (`pair` / `join`) and the
//! commit-reveal 6-digit comparison (`pair --compare` / `pair approve`).
//!
//! - the unauthenticated LAN routes `GET /v1/pair/hello`, `POST /v1/pair/join` and
//!   `POST /v1/pair` are handlers of the LAN server (`crate::transport::lan::handlers::pairing`),
//!   built on this module;
//! - [`client`]: the initiator side (`join`, `pair --compare`) and the local operations of the
//!   CLI (creating a token, approving a comparison);
//! - [`store`]: the SQL of `pair_tokens`, `pair_pending` and pinning a paired peer;
//! - [`PairingMemory`]: the in-memory state of the LAN server (hello nonces, comparison
//!   commitments, the two pairing rate limits).
//!
//! The byte formats and MACs come from `agentmbx_protocol::pairing`; this module owns the
//! bookkeeping around them: single-use nonces, token TTLs, the failed-MAC burn counter, rate
//! limits, validation of what a peer sends, and pinning.
//!
//! It must never log or return a token or its key K, never pin a peer before a MAC or a
//! human-compared code proved it, and never answer success before the pin is committed.

pub mod client;
pub mod store;

#[cfg(test)]
pub(crate) mod test_support;

use std::collections::HashMap;
use std::sync::{Mutex, OnceLock};

use agentmbx_net::rate::{RateTable, Verdict};
use agentmbx_protocol::clock::SharedClock;
use agentmbx_protocol::keys::PublicKey;
use agentmbx_protocol::pairing::PairOffer;

use crate::host_name::{HostName, MAX_LEN as HOST_MAX_LEN};

/// How long a hello nonce (`GET /v1/pair/hello`) and a comparison commitment stay usable, in
/// ms: 2 minutes (`wire.md` §2.9, 0.5.x `HELLO_TTL_MS`).
pub const NONCE_TTL_MS: i64 = 2 * 60_000;
/// Most hello nonces (and, separately, most commitments) kept at once; the oldest is dropped
/// first (`wire.md` §2.9 "map ≤256"), so a flood cannot grow memory.
pub const MAX_NONCES: usize = 256;
/// Default token lifetime, in ms: 10 minutes (`wire.md` §2.9).
pub const TOKEN_TTL_MS: i64 = 10 * 60_000;
/// Longest token lifetime accepted, in ms: 1 hour (`wire.md` §2.9).
pub const MAX_TOKEN_TTL_MS: i64 = 60 * 60_000;
/// Failed join MACs after which a live token is burned (`wire.md` §2.9).
pub const MAX_TOKEN_FAILURES: i64 = 5;
/// How long a pending comparison can be approved, in ms: 10 minutes (`wire.md` Decision 10;
/// 0.5.x kept them forever, F10).
pub const PENDING_TTL_MS: i64 = 10 * 60_000;
/// `GET /v1/pair/hello` plus `POST /v1/pair/join` requests allowed per minute, shared
/// (`wire.md` §4).
pub const TOKEN_REQS_PER_MIN: u32 = 30;
/// `POST /v1/pair` requests allowed per minute (two per comparison; `wire.md` §4).
pub const COMPARE_REQS_PER_MIN: u32 = 10;
/// Longest host key or owner key text accepted from a peer, in characters (`wire.md` §2.9).
pub const MAX_KEY_LEN: usize = 64;
/// Longest nonce accepted from a peer, in characters (`wire.md` §2.9).
pub const MAX_NONCE_LEN: usize = 64;
/// Longest `addr` accepted from a peer, in characters (0.5.x `isStr` default).
pub const MAX_ADDR_LEN: usize = 256;
/// Longest MAC text accepted in a join, in characters (0.5.x; a real MAC has 43).
pub const MAX_MAC_LEN: usize = 128;
/// `peers.addr_source` of an address learned at pairing.
pub const ADDR_SOURCE_PAIR: &str = "pair";
/// Bytes of randomness in a nonce this host issues (base64url, 22 characters).
const NONCE_BYTES: usize = 16;

/// A fresh random nonce: 16 bytes from the OS, unpadded base64url (22 characters).
pub fn new_nonce() -> String {
    let mut bytes = [0u8; NONCE_BYTES];
    rand::RngCore::fill_bytes(&mut rand::rngs::OsRng, &mut bytes);
    agentmbx_protocol::b64::encode_url(&bytes)
}

/// A text field from a peer: non-empty and at most `max` characters (UTF-16 code units, as
/// 0.5.x counts `length`).
pub(crate) fn valid_text(text: &str, max: usize) -> bool {
    !text.is_empty() && text.encode_utf16().count() <= max
}

/// An `addr` from a peer: 1–[`MAX_ADDR_LEN`] characters of printable ASCII without spaces
/// (`host:port`, `name.local:7373`, `[::1]:7373`). Stricter than 0.5.x's length check: the
/// address is logged and shown by `pair pending`, so control characters (forged log lines,
/// terminal escapes) are refused.
pub(crate) fn valid_addr(addr: &str) -> bool {
    valid_text(addr, MAX_ADDR_LEN) && addr.bytes().all(|b| b.is_ascii_graphic())
}

/// The party fields every pairing message carries (`wire.md` §2.9 "Validation"): host ≤ 40
/// characters matching `NAME_RE`, a host key that is a canonical Ed25519 key of ≤ 64
/// characters, an owner key `null` or 1–64 characters, a nonce of 1–64 characters.
/// Returns why it is refused.
pub(crate) fn check_party(
    host: &str,
    host_pubkey: &str,
    owner_pubkey: Option<&str>,
    nonce: &str,
) -> Result<(), &'static str> {
    if host.len() > HOST_MAX_LEN || HostName::parse(host).is_err() {
        return Err("bad host name");
    }
    let key_ok = valid_text(host_pubkey, MAX_KEY_LEN)
        && PublicKey::from_b64(host_pubkey).is_ok_and(|k| k.to_b64() == host_pubkey);
    if !key_ok {
        return Err("bad host key");
    }
    if owner_pubkey.is_some_and(|o| !valid_text(o, MAX_KEY_LEN)) {
        return Err("bad owner key");
    }
    if !valid_text(nonce, MAX_NONCE_LEN) {
        return Err("bad nonce");
    }
    Ok(())
}

/// A whole-host rate limit of `per_minute` requests a minute (GCRA: a burst of `per_minute`,
/// then one every `60 / per_minute` s): a one-key [`RateTable`] built on first use, run on the
/// daemon's clock.
#[derive(Debug, Default)]
struct MinuteLimit {
    table: OnceLock<RateTable>,
}

impl MinuteLimit {
    /// Takes one request from the budget: `Ok` when allowed, else how long to wait (ms, at
    /// least 1).
    fn check(&self, per_minute: u32, clock: &SharedClock) -> Result<(), i64> {
        let table = self
            .table
            .get_or_init(|| RateTable::new(u64::from(per_minute.max(1)), 1));
        match table.hit("", clock.now_ms()) {
            Verdict::Allowed => Ok(()),
            Verdict::Limited { retry_after_ms } | Verdict::TableFull { retry_after_ms } => {
                Err(retry_after_ms)
            }
        }
    }
}

/// A comparison commitment: this host's offer nonce for it and when it lapses (ms).
#[derive(Debug, Clone)]
struct Commitment {
    nonce: String,
    expires_at: i64,
}

#[derive(Debug, Default)]
struct Nonces {
    /// Hello nonce → expiry (ms).
    hellos: HashMap<String, i64>,
    /// Offer commitment (sha256 hex of the canonical offer) → this host's nonce for it.
    commits: HashMap<String, Commitment>,
}

/// Drops lapsed entries, then the soonest-lapsing ones until there is room for one more.
fn make_room<V>(map: &mut HashMap<String, V>, now_ms: i64, expiry: impl Fn(&V) -> i64) {
    map.retain(|_, v| expiry(v) > now_ms);
    while map.len() >= MAX_NONCES {
        let Some(oldest) = map
            .iter()
            .min_by_key(|(_, v)| expiry(v))
            .map(|(k, _)| k.clone())
        else {
            break;
        };
        map.remove(&oldest);
    }
}

/// This host's comparison offer with `nonce`.
pub(crate) fn own_offer(
    ident: &crate::identity::Identity,
    advertise: &str,
    nonce: String,
) -> PairOffer {
    PairOffer {
        v: 1,
        host: ident.host.to_string(),
        host_pubkey: ident.host_key.public().to_b64(),
        owner_pubkey: None,
        nonce,
        addr: advertise.to_string(),
    }
}

/// In-memory pairing state held by the LAN server: hello nonces, comparison commitments and
/// the pairing rate limits. Lost on restart by design (every entry lives ≤ 2 minutes).
///
/// The maps sit behind one `std` mutex that is held only for a lookup or an insert (never
/// across an await or a database call).
#[derive(Debug, Default)]
pub struct PairingMemory {
    nonces: Mutex<Nonces>,
    token_limit: MinuteLimit,
    compare_limit: MinuteLimit,
}

impl PairingMemory {
    fn nonces(&self) -> std::sync::MutexGuard<'_, Nonces> {
        // A panic while holding the lock cannot leave the maps inconsistent: keep going.
        self.nonces.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Issues a fresh single-use hello nonce valid [`NONCE_TTL_MS`] from `now_ms`.
    pub fn issue_hello(&self, now_ms: i64) -> String {
        let nonce = new_nonce();
        let mut n = self.nonces();
        make_room(&mut n.hellos, now_ms, |exp| *exp);
        n.hellos.insert(nonce.clone(), now_ms + NONCE_TTL_MS);
        nonce
    }

    /// Consumes a hello nonce: true when it was issued here and has not lapsed. Either way it
    /// can never be used again.
    pub fn take_hello(&self, nonce: &str, now_ms: i64) -> bool {
        self.nonces()
            .hellos
            .remove(nonce)
            .is_some_and(|exp| exp > now_ms)
    }

    /// Binds a fresh offer nonce of this host to `commit` for [`NONCE_TTL_MS`] and returns it.
    pub fn issue_commitment(&self, commit: &str, now_ms: i64) -> String {
        let nonce = new_nonce();
        let mut n = self.nonces();
        make_room(&mut n.commits, now_ms, |c| c.expires_at);
        n.commits.insert(
            commit.to_string(),
            Commitment {
                nonce: nonce.clone(),
                expires_at: now_ms + NONCE_TTL_MS,
            },
        );
        nonce
    }

    /// Consumes the commitment `commit`: this host's nonce for it when it is live.
    pub fn take_commitment(&self, commit: &str, now_ms: i64) -> Option<String> {
        self.nonces()
            .commits
            .remove(commit)
            .filter(|c| c.expires_at > now_ms)
            .map(|c| c.nonce)
    }

    /// Counts one hello or join request: `Err(ms to wait)` past [`TOKEN_REQS_PER_MIN`].
    pub fn check_token_rate(&self, clock: &SharedClock) -> Result<(), i64> {
        self.token_limit.check(TOKEN_REQS_PER_MIN, clock)
    }

    /// Counts one `POST /v1/pair` request: `Err(ms to wait)` past [`COMPARE_REQS_PER_MIN`].
    pub fn check_compare_rate(&self, clock: &SharedClock) -> Result<(), i64> {
        self.compare_limit.check(COMPARE_REQS_PER_MIN, clock)
    }
}
