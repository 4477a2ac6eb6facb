//! Peers: hosts this host knows by their pinned host key. A peer's name is this host's handle for
//! that key, unique here (`wire.md` "Resolved details": host names on the LAN).

use rusqlite::{params, Connection, OptionalExtension};
use serde::Serialize;

use super::MailboxError;

/// A pinned peer.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Peer {
    /// Local handle (NAME_RE).
    pub host: String,
    /// Pinned Ed25519 host key (base64).
    pub pubkey: String,
    /// X25519 enc key learned from a valid signed ad (base64), if any.
    pub enc_pub: Option<String>,
    /// iat (ms) of the newest accepted enc ad (rollback guard).
    pub enc_ad_iat: Option<i64>,
    /// Pinned LAN address `host:port`, if known (`wire.md` §2.7, §4 "Presence/healing").
    pub addr: Option<String>,
    /// Where `addr` came from: `pair`, `cli`, `presence`, `mdns`.
    pub addr_source: Option<String>,
    /// Last verified LAN contact (ms), if any.
    pub last_seen_at: Option<i64>,
}

const COLS: &str = "host, pubkey, enc_pub, enc_ad_iat, addr, addr_source, last_seen_at";

fn row(r: &rusqlite::Row<'_>) -> rusqlite::Result<Peer> {
    Ok(Peer {
        host: r.get(0)?,
        pubkey: r.get(1)?,
        enc_pub: r.get(2)?,
        enc_ad_iat: r.get(3)?,
        addr: r.get(4)?,
        addr_source: r.get(5)?,
        last_seen_at: r.get(6)?,
    })
}

/// Pins `pubkey` under `host`. Re-adding the same pair is a no-op; a second key for a known
/// name, or a known key under another name, is [`MailboxError::Conflict`].
pub fn add(conn: &Connection, host: &str, pubkey: &str, now_ms: i64) -> Result<bool, MailboxError> {
    if let Some(p) = by_name(conn, host)? {
        if p.pubkey == pubkey {
            return Ok(false);
        }
        return Err(MailboxError::Conflict(format!(
            "peer {host} is already pinned to another host key ({}); a pinned key cannot be replaced yet, pin the new key under another name",
            agentmbx_protocol::keys::PublicKey::from_b64(&p.pubkey)
                .map(|k| k.fingerprint())
                .unwrap_or_default()
        )));
    }
    if let Some(p) = by_key(conn, pubkey)? {
        return Err(MailboxError::Conflict(format!(
            "this host key is already pinned as peer {}",
            p.host
        )));
    }
    conn.execute(
        "INSERT INTO peers(host, pubkey, added_at) VALUES (?1, ?2, ?3)",
        params![host, pubkey, now_ms],
    )?;
    Ok(true)
}

/// The peer named `host`.
pub fn by_name(conn: &Connection, host: &str) -> Result<Option<Peer>, MailboxError> {
    Ok(conn
        .query_row(
            &format!("SELECT {COLS} FROM peers WHERE host = ?1"),
            [host],
            row,
        )
        .optional()?)
}

/// The peer pinned to `pubkey`.
pub fn by_key(conn: &Connection, pubkey: &str) -> Result<Option<Peer>, MailboxError> {
    Ok(conn
        .query_row(
            &format!("SELECT {COLS} FROM peers WHERE pubkey = ?1"),
            [pubkey],
            row,
        )
        .optional()?)
}

/// All peers by name.
pub fn list(conn: &Connection) -> Result<Vec<Peer>, MailboxError> {
    let mut st = conn.prepare(&format!("SELECT {COLS} FROM peers ORDER BY host"))?;
    let rows = st.query_map([], row)?.collect::<Result<Vec<_>, _>>()?;
    Ok(rows)
}

/// Records the enc key from a verified ad, unless an ad at least as new named another key
/// (rollback guard, `wire.md` §2.8). Returns false when refused as rolled back.
pub fn set_enc_key(
    conn: &Connection,
    host: &str,
    enc_pub: &str,
    iat_ms: i64,
) -> Result<bool, MailboxError> {
    let Some(p) = by_name(conn, host)? else {
        return Err(MailboxError::NotFound(format!("unknown peer {host}")));
    };
    if let (Some(old), Some(old_iat)) = (&p.enc_pub, p.enc_ad_iat) {
        if old != enc_pub && iat_ms <= old_iat {
            return Ok(false);
        }
        if old == enc_pub && iat_ms <= old_iat {
            return Ok(true);
        }
    }
    conn.execute(
        "UPDATE peers SET enc_pub = ?2, enc_ad_iat = ?3 WHERE host = ?1",
        params![host, enc_pub, iat_ms],
    )?;
    Ok(true)
}

/// Sets the pinned LAN address of `host` (`host:port`) and where it came from (`pair`, `cli`,
/// `presence`, `mdns`). Errors: [`MailboxError::NotFound`] for an unknown peer.
pub fn set_addr(
    conn: &Connection,
    host: &str,
    addr: &str,
    source: &str,
) -> Result<(), MailboxError> {
    let n = conn.execute(
        "UPDATE peers SET addr = ?2, addr_source = ?3 WHERE host = ?1",
        params![host, addr, source],
    )?;
    if n == 0 {
        return Err(MailboxError::NotFound(format!("unknown peer {host}")));
    }
    Ok(())
}

/// Deletes the peer row `host` alone; returns whether there was one. Unpairing goes through
/// [`crate::node::unpair::forget_peer`], which also ends the mail still waiting for it.
pub fn remove(conn: &Connection, host: &str) -> Result<bool, MailboxError> {
    Ok(conn.execute("DELETE FROM peers WHERE host = ?1", [host])? == 1)
}

/// Records a verified LAN contact from `host` at `now_ms` (`peers.last_seen_at`).
pub fn seen(conn: &Connection, host: &str, now_ms: i64) -> Result<(), MailboxError> {
    conn.execute(
        "UPDATE peers SET last_seen_at = ?2 WHERE host = ?1",
        params![host, now_ms],
    )?;
    Ok(())
}

/// Records presence beacon `seq` from `host` when it is newer than every earlier one
/// (`peers.presence_seq`, `wire.md` §2.7). Returns false, changing nothing, for a seq at or
/// below the last one seen (a replay; 0 before the first) or an unknown peer.
pub fn advance_presence_seq(conn: &Connection, host: &str, seq: i64) -> Result<bool, MailboxError> {
    Ok(conn.execute(
        "UPDATE peers SET presence_seq = ?2 WHERE host = ?1 AND COALESCE(presence_seq, 0) < ?2",
        params![host, seq],
    )? == 1)
}
