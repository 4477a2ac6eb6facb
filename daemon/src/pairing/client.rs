//! The initiating side of pairing (`wire.md` §2.9) and the local steps the CLI runs:
//!
//! - [`create_token`]: `agentmbx pair` — a live one-time token in `pair_tokens`;
//! - [`join`]: `agentmbx join <host[:port]> <TOKEN>` — hello, transcript, join, check the
//!   holder's `accept` MAC, then pin the holder;
//! - [`compare`]: `agentmbx pair --compare <host:port>` — commit, receive the responder's
//!   offer, reveal, and keep a pending comparison with the 6-digit code;
//! - [`approve`]: `agentmbx pair approve <host> <code>` — pin a pending comparison whose code
//!   the human confirmed, unless it lapsed.
//!
//! HTTP calls refuse redirects, connect within [`CONNECT_TIMEOUT`] and finish within
//! [`REQUEST_TIMEOUT`]; answers are read up to [`MAX_ANSWER_BYTES`]. A peer is pinned only after
//! its MAC verified (join) or its code was approved (compare). Nothing here logs or returns the
//! token or K.

use std::net::Ipv6Addr;
use std::sync::Arc;
use std::time::Duration;

use rusqlite::{Connection, TransactionBehavior};
use serde::Serialize;
use serde_json::{json, Value};
use subtle::ConstantTimeEq;

use agentmbx_protocol::clock::SharedClock;
use agentmbx_protocol::keys::PublicKey;
use agentmbx_protocol::pairing::{
    self, offer_commit, sas_code, JoinerParty, PairAccept, PairHello, PairJoin, PairOffer,
    PairingError,
};

use super::own_offer;
use super::{check_party, new_nonce, store, valid_addr, MAX_TOKEN_TTL_MS, PENDING_TTL_MS};
use crate::identity::Identity;
use crate::mailbox::{Mailbox, MailboxError};

/// Port used when `join` or `pair --compare` is given a host without one (`wire.md` §5).
pub const DEFAULT_PORT: u16 = 7373;
/// Time allowed to open the TCP connection to the other host.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(3);
/// Time allowed for one pairing request, answer included (0.5.x: 10 s).
pub const REQUEST_TIMEOUT: Duration = Duration::from_secs(10);
/// Largest pairing answer read, in bytes (a real one is under 1 KiB).
pub const MAX_ANSWER_BYTES: usize = 64 * 1024;
/// Longest refusal text quoted from the other host, in characters.
const MAX_QUOTED: usize = 300;

/// A pairing step that failed. Messages never contain the token or K.
#[derive(Debug, thiserror::Error)]
pub enum PairError {
    /// The address is not `host`, `host:port` or `[v6]:port` (a usage error).
    #[error("{0}")]
    BadAddress(String),
    /// The token is malformed (a usage error).
    #[error(transparent)]
    Token(#[from] PairingError),
    /// A TTL outside 1 s ..= 1 h, or unreadable (a usage error).
    #[error("{0}")]
    BadTtl(String),
    /// A code that is not 6 digits (a usage error).
    #[error("a pairing code is 6 digits, got {0:?}")]
    BadCode(String),
    /// The other host could not be reached.
    #[error("cannot reach {addr}{}: {why} (is the agentmbx daemon running there?)",
        if *default_port { DEFAULT_PORT_NOTE } else { "" })]
    Unreachable {
        /// `host:port` called.
        addr: String,
        /// The cause in our words ([`crate::net_error::describe`]).
        why: String,
        /// The user gave no port: `addr`'s is [`DEFAULT_PORT`], and the text says so.
        default_port: bool,
    },
    /// The other host refused; the text quotes its `error`.
    #[error("{0}")]
    Refused(String),
    /// The address is an agentmbx local API (it asked for the API's bearer token), not the
    /// LAN port pairing uses (a usage error).
    #[error("{addr} is agentmbx's local API port (7375 by default), not its LAN port; pair with the LAN port (7373 by default: `agentmbx doctor` on that host shows it)")]
    ApiPort {
        /// `host:port` called.
        addr: String,
    },
    /// The other host answered something that is not a valid pairing message.
    #[error("{addr} sent a malformed pairing {what}")]
    Malformed {
        /// `host:port` called.
        addr: String,
        /// `hello`, `offer` or `answer`.
        what: &'static str,
    },
    /// The holder's `accept` MAC did not verify: nothing was pinned.
    #[error("{addr} did not prove it knows the token. NOT paired: something may be intercepting the connection.")]
    NotProven {
        /// `host:port` called.
        addr: String,
    },
    /// The peer has this host's name, or is this host.
    #[error("{0}")]
    SameHost(String),
    /// The peer's name or key is already pinned differently here.
    #[error("{0}")]
    Conflict(String),
    /// `pair approve` for a host with no pending comparison (not found).
    #[error("no pending comparison with {0}; run `agentmbx pair --compare <host:port>` first")]
    NoPending(String),
    /// The comparison lapsed ([`PENDING_TTL_MS`]); its row was removed.
    #[error("the comparison with {0} expired (pending comparisons last 10 minutes); run `agentmbx pair --compare` again")]
    Expired(String),
    /// The code typed is not the one this host computed: nothing was pinned. The text never
    /// shows this host's code (the human would retype it, defeating the comparison).
    #[error("code mismatch: {given} is not the code this host computed for {host}; nothing was paired. If that is exactly the code the other host shows, the two hosts computed different codes: do not pair, something may be intercepting the connection; start over with `agentmbx pair --compare <host:port>`")]
    CodeMismatch {
        /// The other host.
        host: String,
        /// The code typed.
        given: String,
    },
    /// The host store failed.
    #[error(transparent)]
    Mailbox(#[from] MailboxError),
}

impl From<rusqlite::Error> for PairError {
    fn from(e: rusqlite::Error) -> Self {
        PairError::Mailbox(MailboxError::Sqlite(e))
    }
}

impl PairError {
    /// True for errors in what the user typed (exit code 2).
    pub fn is_usage(&self) -> bool {
        matches!(
            self,
            PairError::BadAddress(_)
                | PairError::ApiPort { .. }
                | PairError::Token(PairingError::MalformedToken)
                | PairError::BadTtl(_)
                | PairError::BadCode(_)
        )
    }

    /// True when the thing asked for does not exist (exit code 3).
    pub fn is_not_found(&self) -> bool {
        matches!(self, PairError::NoPending(_))
    }
}

/// This host, as the pairing client needs it.
#[derive(Debug, Clone)]
pub struct Local {
    /// This host's identity.
    pub ident: Arc<Identity>,
    /// The host store.
    pub mailbox: Mailbox,
    /// The one clock.
    pub clock: SharedClock,
    /// `host:port` where the other host reaches this one (`advertise`, `wire.md` §2.7).
    pub advertise: String,
}

impl Local {
    fn host(&self) -> String {
        self.ident.host.to_string()
    }

    fn pubkey(&self) -> String {
        self.ident.host_key.public().to_b64()
    }
}

// ---- tokens -------------------------------------------------------------------------------------

/// Parses a token TTL: a whole number with an optional unit `s` (default), `m` or `h`
/// (`10m`, `90s`, `1h`). Returns ms. Errors: [`PairError::BadTtl`] when unreadable, ≤ 0 or
/// over 1 h.
pub fn parse_ttl(text: &str) -> Result<i64, PairError> {
    let t = text.trim();
    let (digits, unit_ms) = match t.char_indices().find(|(_, c)| !c.is_ascii_digit()) {
        None => (t, 1000),
        Some((i, _)) => {
            let unit = match &t[i..] {
                "s" | "sec" => 1000,
                "m" | "min" => 60_000,
                "h" => 3_600_000,
                _ => 0,
            };
            (&t[..i], unit)
        }
    };
    let bad = || {
        PairError::BadTtl(format!(
            "bad --ttl {text:?}: give a duration like 90s, 10m or 1h"
        ))
    };
    if digits.is_empty() || unit_ms == 0 {
        return Err(bad());
    }
    let n: i64 = digits.parse().map_err(|_| bad())?;
    let ms = n.checked_mul(unit_ms).ok_or_else(bad)?;
    if ms <= 0 || ms > MAX_TOKEN_TTL_MS {
        return Err(PairError::BadTtl(format!(
            "--ttl {text}: a pairing token lives between 1 s and 1 h"
        )));
    }
    Ok(ms)
}

/// A token just created. `token` is the secret shown once to the human; it is not stored.
#[derive(Clone, Serialize)]
pub struct NewToken {
    /// The token, `XXXX-XXXX-XXXX`.
    pub token: String,
    /// Its id (stored; safe to show).
    pub id: String,
    /// Expiry (ms).
    pub expires_at: i64,
}

impl std::fmt::Debug for NewToken {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NewToken")
            .field("token", &"<redacted>")
            .field("id", &self.id)
            .field("expires_at", &self.expires_at)
            .finish()
    }
}

/// Creates a live token valid `ttl_ms` from `now_ms` (1 ms ..= 1 h): a fresh random token, its
/// scrypt key K stored as hex under [`pairing::token_id`]. Runs scrypt (N = 2^15) once: call
/// it off the async runtime. Errors: [`PairError::BadTtl`], SQLite.
pub fn create_token(conn: &Connection, ttl_ms: i64, now_ms: i64) -> Result<NewToken, PairError> {
    if ttl_ms <= 0 || ttl_ms > MAX_TOKEN_TTL_MS {
        return Err(PairError::BadTtl(
            "a pairing token lives between 1 s and 1 h".into(),
        ));
    }
    let token = pairing::generate_token();
    let key = pairing::derive_token_key(&token)?;
    let id = pairing::token_id(&key);
    let expires_at = now_ms + ttl_ms;
    store::insert_token(conn, &id, &key, now_ms, expires_at)?;
    Ok(NewToken {
        token,
        id,
        expires_at,
    })
}

// ---- addresses and HTTP ----------------------------------------------------------------------------

/// Normalizes what the user typed as the other host: `host`, `host:port`, `[v6]`, `[v6]:port`
/// or a bare IPv6 address; [`DEFAULT_PORT`] when no port is given. Returns `host:port` (IPv6
/// in brackets). Errors: [`PairError::BadAddress`].
pub fn normalize_addr(input: &str) -> Result<String, PairError> {
    normalize(input).map(|(addr, _)| addr)
}

/// What [`unreachable`] adds after `host:7373` when the user gave no port.
const DEFAULT_PORT_NOTE: &str =
    " (the default LAN port; give host:port if the daemon there uses another)";

/// [`normalize_addr`], and whether the port is [`DEFAULT_PORT`] because none was given.
fn normalize(input: &str) -> Result<(String, bool), PairError> {
    let text = input.trim();
    let bad = |why: &str| PairError::BadAddress(format!("bad address {input:?}: {why}"));
    if text.contains("://") || text.contains('/') {
        return Err(bad("give host or host:port, not a URL"));
    }
    if text.is_empty() || text.chars().any(|c| c.is_whitespace() || c.is_control()) {
        return Err(bad("give host or host:port"));
    }
    let port_of = |p: &str| -> Result<u16, PairError> {
        match p.parse::<u16>() {
            Ok(n) if n > 0 && p.bytes().all(|b| b.is_ascii_digit()) => Ok(n),
            _ => Err(bad("the port must be 1-65535")),
        }
    };
    if let Some(rest) = text.strip_prefix('[') {
        let Some((ip, after)) = rest.split_once(']') else {
            return Err(bad("unclosed '['"));
        };
        ip.parse::<Ipv6Addr>()
            .map_err(|_| bad("not an IPv6 address in brackets"))?;
        let (port, assumed) = match after {
            "" => (DEFAULT_PORT, true),
            p => (
                port_of(
                    p.strip_prefix(':')
                        .ok_or_else(|| bad("expected :port after ']'"))?,
                )?,
                false,
            ),
        };
        return Ok((format!("[{ip}]:{port}"), assumed));
    }
    if let Ok(ip) = text.parse::<Ipv6Addr>() {
        return Ok((format!("[{ip}]:{DEFAULT_PORT}"), true));
    }
    match text.split_once(':') {
        None => Ok((format!("{text}:{DEFAULT_PORT}"), true)),
        Some((host, port)) if !host.is_empty() && !port.contains(':') => {
            Ok((format!("{host}:{}", port_of(port)?), false))
        }
        _ => Err(bad("give host or host:port")),
    }
}

fn http() -> Result<reqwest::Client, PairError> {
    crate::install_tls_provider();
    reqwest::Client::builder()
        .no_proxy() // pairing is LAN-only: never through HTTP(S)_PROXY
        .connect_timeout(CONNECT_TIMEOUT)
        .timeout(REQUEST_TIMEOUT)
        .redirect(reqwest::redirect::Policy::none())
        .build()
        .map_err(|e| PairError::Unreachable {
            addr: String::new(),
            why: crate::net_error::describe(&e, None),
            default_port: false,
        })
}

/// A reqwest error in our words ([`crate::net_error::describe`]), naming the limit that fired
/// when it timed out.
fn describe(e: &reqwest::Error) -> String {
    let limit = if e.is_connect() {
        CONNECT_TIMEOUT
    } else {
        REQUEST_TIMEOUT
    };
    crate::net_error::describe(e, Some(limit))
}

/// Sends `req` and reads the answer (≤ [`MAX_ANSWER_BYTES`]). A 401 asking for a bearer token
/// is [`PairError::ApiPort`]: `addr` is the local API, not a LAN port.
async fn send(
    req: reqwest::RequestBuilder,
    addr: &str,
) -> Result<(reqwest::StatusCode, Vec<u8>), PairError> {
    let unreachable = |e: reqwest::Error| PairError::Unreachable {
        addr: addr.to_string(),
        why: describe(&e),
        default_port: false,
    };
    let mut res = req.send().await.map_err(unreachable)?;
    let status = res.status();
    // Only agentmbx's local API asks for a bearer token; the LAN server never does.
    let bearer = res
        .headers()
        .get(reqwest::header::WWW_AUTHENTICATE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.trim_start().starts_with("Bearer"));
    if status == reqwest::StatusCode::UNAUTHORIZED && bearer {
        return Err(PairError::ApiPort {
            addr: addr.to_string(),
        });
    }
    let mut body = Vec::new();
    while let Some(chunk) = res.chunk().await.map_err(unreachable)? {
        if body.len() + chunk.len() > MAX_ANSWER_BYTES {
            return Err(PairError::Malformed {
                addr: addr.to_string(),
                what: "answer",
            });
        }
        body.extend_from_slice(&chunk);
    }
    Ok((status, body))
}

/// The other host's reason for a refusal: its `{error}` text, else its body text, else the
/// status; cut to [`MAX_QUOTED`] characters.
fn refusal_text(status: reqwest::StatusCode, body: &[u8]) -> String {
    let from_json = serde_json::from_slice::<Value>(body)
        .ok()
        .and_then(|v| v.get("error").and_then(Value::as_str).map(str::to_string));
    let text = from_json.unwrap_or_else(|| String::from_utf8_lossy(body).trim().to_string());
    let text: String = text
        .chars()
        .filter(|c| !c.is_control())
        .take(MAX_QUOTED)
        .collect();
    if text.is_empty() {
        format!("HTTP {status}")
    } else {
        text
    }
}

fn same_name(addr: &str, host: &str) -> PairError {
    PairError::SameHost(format!(
        "{addr} has the same host name as this host ({host}); rename one (host in config.toml)"
    ))
}

/// Refuses a peer that is this host itself, or whose name or key is pinned differently here.
async fn check_peer(local: &Local, addr: &str, host: &str, pubkey: &str) -> Result<(), PairError> {
    let own = local.host();
    if host == own {
        return Err(same_name(addr, host));
    }
    if pubkey == local.pubkey() {
        return Err(PairError::SameHost(format!(
            "{addr} presents this host's own key: that is this host"
        )));
    }
    let (host, pubkey) = (host.to_string(), pubkey.to_string());
    let conflict = local
        .mailbox
        .run(move |c| store::own_pin_conflict(c, &host, &pubkey))
        .await?;
    match conflict {
        Some(why) => Err(PairError::Conflict(why)),
        None => Ok(()),
    }
}

// ---- token join ------------------------------------------------------------------------------------

/// A successful pairing, as the CLI reports it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Paired {
    /// The other host's name.
    pub host: String,
    /// Its pinned host key (base64).
    pub host_pubkey: String,
    /// Its fingerprint `xxxx-xxxx-xxxx-xxxx`.
    pub fingerprint: String,
    /// Where this host reaches it.
    pub addr: String,
    /// False when the same key was already pinned under that name (address refreshed).
    pub new: bool,
}

fn fingerprint(pubkey: &str) -> String {
    PublicKey::from_b64(pubkey)
        .map(|k| k.fingerprint())
        .unwrap_or_default()
}

/// `agentmbx join`: proves `token` to the holder at `addr` (`host[:port]`), checks its proof
/// back, then pins it. Derives K (scrypt) on a blocking thread first.
/// Errors: every [`PairError`] but the comparison ones.
pub async fn join(local: &Local, addr: &str, token: &str) -> Result<Paired, PairError> {
    let (addr, assumed) = normalize(addr)?;
    let token = pairing::normalize_token(token)?;
    let key = tokio::task::spawn_blocking(move || pairing::derive_token_key(&token))
        .await
        .map_err(|_| PairError::Mailbox(MailboxError::Task))??;
    join_with_key(local, &addr, &key)
        .await
        .map_err(|e| unreachable(e, assumed))
}

/// `e`, saying the port was assumed when it is [`PairError::Unreachable`] and `assumed`.
fn unreachable(e: PairError, assumed: bool) -> PairError {
    match e {
        PairError::Unreachable { addr, why, .. } => PairError::Unreachable {
            addr,
            why,
            default_port: assumed,
        },
        other => other,
    }
}

/// [`join`] with K already derived and `addr` already normalized.
pub(crate) async fn join_with_key(
    local: &Local,
    addr: &str,
    key: &[u8; 32],
) -> Result<Paired, PairError> {
    let http = http()?;
    let (status, body) = send(http.get(format!("http://{addr}/v1/pair/hello")), addr).await?;
    if status != reqwest::StatusCode::OK {
        return Err(PairError::Refused(format!(
            "{addr} refused pairing: {}",
            refusal_text(status, &body)
        )));
    }
    let malformed = |what| PairError::Malformed {
        addr: addr.to_string(),
        what,
    };
    let hello: PairHello = serde_json::from_slice(&body).map_err(|_| malformed("hello"))?;
    let holder = hello.holder;
    if hello.v != 1
        || check_party(
            &holder.host,
            &holder.host_pubkey,
            holder.owner_pubkey.as_deref(),
            &holder.nonce,
        )
        .is_err()
    {
        return Err(malformed("hello"));
    }
    check_peer(local, addr, &holder.host, &holder.host_pubkey).await?;
    let me = JoinerParty {
        host: local.host(),
        host_pubkey: local.pubkey(),
        owner_pubkey: None,
        nonce: new_nonce(),
        addr: local.advertise.clone(),
    };
    let request = PairJoin::new(&holder, me.clone(), key);
    let (status, body) = send(
        http.post(format!("http://{addr}/v1/pair/join"))
            .json(&request),
        addr,
    )
    .await?;
    if status != reqwest::StatusCode::OK {
        return Err(PairError::Refused(format!(
            "{} ({addr}) refused the join: {}",
            holder.host,
            refusal_text(status, &body)
        )));
    }
    let proven = serde_json::from_slice::<PairAccept>(&body)
        .is_ok_and(|a| a.host == holder.host && a.verify(&holder, &me, key));
    if !proven {
        tracing::warn!(peer = %holder.host, %addr, "pairing: the holder's accept MAC does not verify");
        return Err(PairError::NotProven {
            addr: addr.to_string(),
        });
    }
    let now = local.clock.now_ms();
    let (host, pubkey, owner, at) = (
        holder.host.clone(),
        holder.host_pubkey.clone(),
        holder.owner_pubkey.clone(),
        addr.to_string(),
    );
    let new = local
        .mailbox
        .run(move |c| {
            let tx = c.transaction_with_behavior(TransactionBehavior::Immediate)?;
            if let Some(why) = store::own_pin_conflict(&tx, &host, &pubkey)? {
                return Err(MailboxError::Conflict(why));
            }
            let new = store::pin(&tx, &host, &pubkey, owner.as_deref(), Some(&at), now)?;
            tx.commit()?;
            Ok(new)
        })
        .await
        .map_err(|e| match e {
            MailboxError::Conflict(why) => PairError::Conflict(why),
            e => PairError::Mailbox(e),
        })?;
    Ok(Paired {
        fingerprint: fingerprint(&holder.host_pubkey),
        host: holder.host,
        host_pubkey: holder.host_pubkey,
        addr: addr.to_string(),
        new,
    })
}

// ---- comparison (SAS) ----------------------------------------------------------------------------

/// A comparison waiting for both humans, as the CLI reports it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Compared {
    /// The other host's name.
    pub host: String,
    /// Its host key (base64), pinned on approval.
    pub host_pubkey: String,
    /// Its fingerprint.
    pub fingerprint: String,
    /// Where this host reaches it (the address dialed).
    pub addr: String,
    /// The 6-digit code to compare.
    pub code: String,
    /// When the comparison lapses (ms).
    pub expires_at: i64,
}

fn valid_offer(offer: &PairOffer) -> bool {
    offer.v == 1
        && check_party(
            &offer.host,
            &offer.host_pubkey,
            offer.owner_pubkey.as_deref(),
            &offer.nonce,
        )
        .is_ok()
        && valid_addr(&offer.addr)
}

/// `agentmbx pair --compare <addr>`: commits to this host's offer, receives the responder's,
/// reveals, and stores the pending comparison (expiring after [`PENDING_TTL_MS`]).
/// Errors: address, network, refusal, malformed offer, same host, conflict, store.
pub async fn compare(local: &Local, addr: &str) -> Result<Compared, PairError> {
    let (addr, assumed) = normalize(addr)?;
    let addr = addr.as_str();
    let http = http()?;
    let mine = own_offer(&local.ident, &local.advertise, new_nonce());
    let mine_value = serde_json::to_value(&mine).map_err(|_| PairError::Malformed {
        addr: addr.to_string(),
        what: "offer",
    })?;
    let commit = offer_commit(&mine_value)?;
    let url = format!("http://{addr}/v1/pair");
    let refused = |status, body: &[u8]| {
        PairError::Refused(format!(
            "pairing refused by {addr}: {} (code-compare pairing needs commit-reveal support on both hosts)",
            refusal_text(status, body)
        ))
    };
    let (status, body) = send(
        http.post(&url).json(&json!({ "v": 2, "commit": commit })),
        addr,
    )
    .await
    .map_err(|e| unreachable(e, assumed))?;
    if status != reqwest::StatusCode::OK {
        return Err(refused(status, &body));
    }
    let remote: PairOffer = serde_json::from_slice(&body)
        .ok()
        .filter(valid_offer)
        .ok_or_else(|| PairError::Malformed {
            addr: addr.to_string(),
            what: "offer",
        })?;
    check_peer(local, addr, &remote.host, &remote.host_pubkey).await?;
    let (status, body) = send(
        http.post(&url)
            .json(&json!({ "v": 2, "offer": mine_value })),
        addr,
    )
    .await?;
    if status != reqwest::StatusCode::OK {
        return Err(refused(status, &body));
    }
    let code = sas_code(&[mine.clone(), remote.clone()]);
    let now = local.clock.now_ms();
    let pending = store::Pending {
        host: remote.host.clone(),
        pubkey: remote.host_pubkey.clone(),
        owner_pubkey: remote.owner_pubkey.clone(),
        addr: Some(addr.to_string()),
        nonce_local: mine.nonce,
        nonce_remote: remote.nonce.clone(),
        code: code.clone(),
        created_at: now,
        expires_at: now + PENDING_TTL_MS,
    };
    let expires_at = pending.expires_at;
    local
        .mailbox
        .run(move |c| {
            let tx = c.transaction_with_behavior(TransactionBehavior::Immediate)?;
            store::purge_pending(&tx, now)?;
            if let Some(why) = store::own_pin_conflict(&tx, &pending.host, &pending.pubkey)? {
                return Err(MailboxError::Conflict(why));
            }
            store::put_pending(&tx, &pending)?;
            tx.commit()?;
            Ok(())
        })
        .await
        .map_err(|e| match e {
            MailboxError::Conflict(why) => PairError::Conflict(why),
            e => PairError::Mailbox(e),
        })?;
    Ok(Compared {
        fingerprint: fingerprint(&remote.host_pubkey),
        host: remote.host,
        host_pubkey: remote.host_pubkey,
        addr: addr.to_string(),
        code,
        expires_at,
    })
}

/// A code as typed: spaces and dashes dropped, then exactly 6 ASCII digits.
fn normalize_code(code: &str) -> Result<String, PairError> {
    let digits: String = code
        .chars()
        .filter(|c| !c.is_whitespace() && *c != '-')
        .collect();
    if digits.len() == 6 && digits.bytes().all(|b| b.is_ascii_digit()) {
        Ok(digits)
    } else {
        Err(PairError::BadCode(code.to_string()))
    }
}

/// `agentmbx pair approve <host> <code>`: pins the pending comparison with `host` when `code`
/// is the code this host computed and the comparison has not lapsed, in one transaction
/// (the pending row is removed with the pin). A lapsed comparison is removed and refused.
/// Errors: [`PairError::BadCode`], [`PairError::SameHost`] (`host` is `local_host`),
/// [`PairError::NoPending`], [`PairError::Expired`], [`PairError::CodeMismatch`] (its text
/// never shows this host's code), [`PairError::Conflict`], store.
pub fn approve(
    conn: &mut Connection,
    local_host: &str,
    host: &str,
    code: &str,
    now_ms: i64,
) -> Result<Paired, PairError> {
    let given = normalize_code(code)?;
    if host == local_host {
        return Err(PairError::SameHost(format!(
            "{host} is this host's own name: approve the other host's name (see `agentmbx pair pending`)"
        )));
    }
    let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate)?;
    let Some(p) = store::pending(&tx, host)? else {
        return Err(PairError::NoPending(host.to_string()));
    };
    if p.expires_at <= now_ms {
        store::purge_pending(&tx, now_ms)?;
        tx.commit()?;
        return Err(PairError::Expired(host.to_string()));
    }
    if !bool::from(p.code.as_bytes().ct_eq(given.as_bytes())) {
        return Err(PairError::CodeMismatch {
            host: host.to_string(),
            given,
        });
    }
    if let Some(why) = store::own_pin_conflict(&tx, host, &p.pubkey)? {
        return Err(PairError::Conflict(why));
    }
    let new = store::pin(
        &tx,
        host,
        &p.pubkey,
        p.owner_pubkey.as_deref(),
        p.addr.as_deref(),
        now_ms,
    )?;
    store::delete_pending(&tx, host)?;
    tx.commit()?;
    Ok(Paired {
        fingerprint: fingerprint(&p.pubkey),
        host: p.host,
        host_pubkey: p.pubkey,
        addr: p.addr.unwrap_or_default(),
        new,
    })
}

#[cfg(test)]
mod unit {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn ttl_forms() {
        assert_eq!(parse_ttl("10m").unwrap(), 600_000);
        assert_eq!(parse_ttl("90s").unwrap(), 90_000);
        assert_eq!(parse_ttl("1h").unwrap(), 3_600_000);
        assert_eq!(parse_ttl("45").unwrap(), 45_000);
        for bad in [
            "0",
            "0s",
            "61m",
            "2h",
            "-5m",
            "",
            "m",
            "10x",
            "1.5h",
            "99999999999999999h",
        ] {
            assert!(matches!(parse_ttl(bad), Err(PairError::BadTtl(_))), "{bad}");
        }
    }

    #[test]
    fn address_forms() {
        assert_eq!(normalize_addr("bob.local").unwrap(), "bob.local:7373");
        assert_eq!(normalize_addr("10.0.0.2:8000").unwrap(), "10.0.0.2:8000");
        assert_eq!(normalize_addr("[::1]:9").unwrap(), "[::1]:9");
        assert_eq!(normalize_addr("[::1]").unwrap(), "[::1]:7373");
        assert_eq!(normalize_addr("fe80::1").unwrap(), "[fe80::1]:7373");
        for bad in [
            "http://x:1",
            "x:0",
            "x:70000",
            "x:+1",
            ":1",
            "x/y",
            "",
            "a b",
            "[::1",
            "[zz]:1",
        ] {
            assert!(
                matches!(normalize_addr(bad), Err(PairError::BadAddress(_))),
                "{bad}"
            );
        }
    }

    #[test]
    fn codes() {
        assert_eq!(normalize_code(" 012-345 ").unwrap(), "012345");
        assert!(normalize_code("12345").is_err());
        assert!(normalize_code("12345a").is_err());
    }
}

#[cfg(test)]
mod tests;
