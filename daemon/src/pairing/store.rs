//! The pairing tables of `mailbox.db` (`wire.md` §2.9; schema version 2): `pair_tokens` (live,
//! used or burned one-time tokens, keyed by the hex of their scrypt key K), `pair_pending`
//! (comparisons waiting for `pair approve`, expiring after [`super::PENDING_TTL_MS`]) and pinning a
//! paired host into `peers`.
//!
//! Every function takes a connection (or a transaction) and runs plain SQL: the caller owns the
//! transaction, so a check and the write it allows commit together. Times are ms since the
//! epoch. This module never derives keys or touches the network, and never returns K to
//! anything but the MAC check.

use rusqlite::{params, Connection, OptionalExtension};
use serde::Serialize;

use super::{ADDR_SOURCE_PAIR, MAX_TOKEN_FAILURES};
use crate::mailbox::{peers, MailboxError};

/// A token that can still pair: state `live`, not lapsed.
#[derive(Clone)]
pub struct LiveToken {
    /// Token id: [`agentmbx_protocol::pairing::token_id`] of K.
    pub id: String,
    /// K, the token's scrypt key (secret).
    pub key: [u8; 32],
    /// Expiry (ms).
    pub expires_at: i64,
}

impl std::fmt::Debug for LiveToken {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LiveToken")
            .field("id", &self.id)
            .field("key", &"<redacted>")
            .field("expires_at", &self.expires_at)
            .finish()
    }
}

/// Stores a new live token: `id`, `hex(key)`, created now, lapsing at `expires_at` (ms).
/// Errors: SQLite (an id already taken is a constraint error).
pub fn insert_token(
    conn: &Connection,
    id: &str,
    key: &[u8; 32],
    now_ms: i64,
    expires_at: i64,
) -> Result<(), MailboxError> {
    conn.execute(
        "INSERT INTO pair_tokens(id, key, created_at, expires_at, failures, state)
         VALUES (?1, ?2, ?3, ?4, 0, 'live')",
        params![id, hex::encode(key), now_ms, expires_at],
    )?;
    Ok(())
}

/// Tokens in state `live` that lapse after `now_ms`. A row whose key is not 64 hex digits
/// cannot verify anything and is skipped.
pub fn live_tokens(conn: &Connection, now_ms: i64) -> Result<Vec<LiveToken>, MailboxError> {
    let mut st = conn.prepare(
        "SELECT id, key, expires_at FROM pair_tokens
         WHERE state = 'live' AND expires_at > ?1 ORDER BY created_at",
    )?;
    let rows = st
        .query_map([now_ms], |r| {
            Ok((
                r.get::<_, String>(0)?,
                r.get::<_, String>(1)?,
                r.get::<_, i64>(2)?,
            ))
        })?
        .collect::<Result<Vec<_>, _>>()?;
    Ok(rows
        .into_iter()
        .filter_map(|(id, key_hex, expires_at)| {
            let mut key = [0u8; 32];
            hex::decode_to_slice(&key_hex, &mut key).ok()?;
            Some(LiveToken {
                id,
                key,
                expires_at,
            })
        })
        .collect())
}

/// A join whose MAC matched no live token: every live token counts one failure, and those
/// reaching [`MAX_TOKEN_FAILURES`] are burned (`wire.md` §2.9). Returns how many tokens counted
/// the failure.
pub fn record_failure(conn: &Connection, now_ms: i64) -> Result<usize, MailboxError> {
    Ok(conn.execute(
        "UPDATE pair_tokens SET failures = failures + 1,
           state = CASE WHEN failures + 1 >= ?2 THEN 'burned' ELSE state END
         WHERE state = 'live' AND expires_at > ?1",
        params![now_ms, MAX_TOKEN_FAILURES],
    )?)
}

/// Marks token `id` used by `host`. False when it is no longer live (used, burned or lapsed
/// meanwhile): the caller answers "pairing token was just used".
pub fn consume_token(
    conn: &Connection,
    id: &str,
    host: &str,
    now_ms: i64,
) -> Result<bool, MailboxError> {
    let n = conn.execute(
        "UPDATE pair_tokens SET state = 'used', used_by = ?2
         WHERE id = ?1 AND state = 'live' AND expires_at > ?3",
        params![id, host, now_ms],
    )?;
    Ok(n == 1)
}

/// What stands in the way of pinning a host ([`conflict`]).
enum Conflict {
    /// The name is pinned to another key.
    OtherKey,
    /// The key is pinned under another name (given).
    OtherName(String),
}

/// Whether `host` with `pubkey` can be pinned: `None` when new, or the same pair is already
/// pinned. A name is this host's handle for one key, and a key has one name (`wire.md`
/// "Resolved details": host names on the LAN).
fn conflict(conn: &Connection, host: &str, pubkey: &str) -> Result<Option<Conflict>, MailboxError> {
    if let Some(p) = peers::by_name(conn, host)? {
        return Ok((p.pubkey != pubkey).then_some(Conflict::OtherKey));
    }
    Ok(peers::by_key(conn, pubkey)?.map(|p| Conflict::OtherName(p.host)))
}

/// Why `host` with `pubkey` cannot be pinned on this host (`local_host`), worded for the *other*
/// host (the pairing server's 409 answers), or `None` when it can (new, or the same pair already
/// pinned). A second key under a known name gets 0.5.x's text: `<local_host> already has <host>
/// paired with a different key; run 'agentmbx peers remove <host>' there first`; a known key
/// under another name (a case 0.5.x does not have): `<local_host> already has this host key
/// paired as <name>; a key has one name`.
pub fn pin_conflict(
    conn: &Connection,
    local_host: &str,
    host: &str,
    pubkey: &str,
) -> Result<Option<String>, MailboxError> {
    Ok(conflict(conn, host, pubkey)?.map(|c| match c {
        Conflict::OtherKey => format!(
            "{local_host} already has {host} paired with a different key; run 'agentmbx peers remove {host}' there first"
        ),
        Conflict::OtherName(name) => format!(
            "{local_host} already has this host key paired as {name}; a key has one name"
        ),
    }))
}

/// [`pin_conflict`] worded for the owner of this host (the pairing client's own checks): a
/// second key under a known name gets 0.5.x's text `host <host> is already paired with a
/// different key; remove it first (agentmbx peers remove <host>)`; a known key under another
/// name `this host key is already paired here as <name>; a key has one name (agentmbx peers
/// remove <name> first)`.
pub fn own_pin_conflict(
    conn: &Connection,
    host: &str,
    pubkey: &str,
) -> Result<Option<String>, MailboxError> {
    Ok(conflict(conn, host, pubkey)?.map(|c| match c {
        Conflict::OtherKey => format!(
            "host {host} is already paired with a different key; remove it first (agentmbx peers remove {host})"
        ),
        Conflict::OtherName(name) => format!(
            "this host key is already paired here as {name}; a key has one name (agentmbx peers remove {name} first)"
        ),
    }))
}

/// Pins `host` to `pubkey` (or keeps the same pin), with its owner key and, when given, its
/// LAN address `addr` (source `pair`). True when the peer is new. Errors: [`MailboxError::Conflict`] for
/// a second key under a known name or a known key under another name.
pub fn pin(
    conn: &Connection,
    host: &str,
    pubkey: &str,
    owner_pubkey: Option<&str>,
    addr: Option<&str>,
    now_ms: i64,
) -> Result<bool, MailboxError> {
    let added = peers::add(conn, host, pubkey, now_ms)?;
    if let Some(addr) = addr {
        peers::set_addr(conn, host, addr, ADDR_SOURCE_PAIR)?;
    }
    conn.execute(
        "UPDATE peers SET owner_pubkey = ?2 WHERE host = ?1",
        params![host, owner_pubkey],
    )?;
    Ok(added)
}

/// A comparison waiting for `pair approve` (`pair_pending` row).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Pending {
    /// The other host's name.
    pub host: String,
    /// Its host key (base64), pinned on approval.
    pub pubkey: String,
    /// Its owner key, if it sent one.
    pub owner_pubkey: Option<String>,
    /// Where this host reaches it (`host:port`).
    pub addr: Option<String>,
    /// This host's offer nonce.
    pub nonce_local: String,
    /// The other host's offer nonce.
    pub nonce_remote: String,
    /// The 6-digit code both humans compare.
    pub code: String,
    /// When the comparison was made (ms).
    pub created_at: i64,
    /// When it lapses (ms): `created_at` + [`super::PENDING_TTL_MS`].
    pub expires_at: i64,
}

/// Stores (or replaces) the comparison with `p.host`.
pub fn put_pending(conn: &Connection, p: &Pending) -> Result<(), MailboxError> {
    conn.execute(
        "INSERT OR REPLACE INTO pair_pending(host, pubkey, owner_pubkey, addr, nonce_local,
           nonce_remote, code, created_at, expires_at)
         VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9)",
        params![
            p.host,
            p.pubkey,
            p.owner_pubkey,
            p.addr,
            p.nonce_local,
            p.nonce_remote,
            p.code,
            p.created_at,
            p.expires_at
        ],
    )?;
    Ok(())
}

fn pending_row(r: &rusqlite::Row<'_>) -> rusqlite::Result<Pending> {
    Ok(Pending {
        host: r.get(0)?,
        pubkey: r.get(1)?,
        owner_pubkey: r.get(2)?,
        addr: r.get(3)?,
        nonce_local: r.get(4)?,
        nonce_remote: r.get(5)?,
        code: r.get(6)?,
        created_at: r.get(7)?,
        expires_at: r.get(8)?,
    })
}

const PENDING_COLS: &str =
    "host, pubkey, owner_pubkey, addr, nonce_local, nonce_remote, code, created_at, expires_at";

/// The comparison with `host`, lapsed or not.
pub fn pending(conn: &Connection, host: &str) -> Result<Option<Pending>, MailboxError> {
    Ok(conn
        .query_row(
            &format!("SELECT {PENDING_COLS} FROM pair_pending WHERE host = ?1"),
            [host],
            pending_row,
        )
        .optional()?)
}

/// Comparisons that have not lapsed at `now_ms`, by host.
pub fn list_pending(conn: &Connection, now_ms: i64) -> Result<Vec<Pending>, MailboxError> {
    let mut st = conn.prepare(&format!(
        "SELECT {PENDING_COLS} FROM pair_pending WHERE expires_at > ?1 ORDER BY host"
    ))?;
    let rows = st
        .query_map([now_ms], pending_row)?
        .collect::<Result<Vec<_>, _>>()?;
    Ok(rows)
}

/// Removes the comparison with `host`.
pub fn delete_pending(conn: &Connection, host: &str) -> Result<(), MailboxError> {
    conn.execute("DELETE FROM pair_pending WHERE host = ?1", [host])?;
    Ok(())
}

/// Removes every comparison lapsed at `now_ms`; returns how many.
pub fn purge_pending(conn: &Connection, now_ms: i64) -> Result<usize, MailboxError> {
    Ok(conn.execute("DELETE FROM pair_pending WHERE expires_at <= ?1", [now_ms])?)
}

#[cfg(test)]
mod tests;
