//! Peers: hosts this host knows by their pinned host key. A peer's name is this host's handle for
//! that key, unique here (`wire.md` "Resolved details": host names on the LAN).
//!
//! A peer that rotated its host key (`wire.md` §2.10) keeps the keys it rotated away from in
//! `prev_keys` (JSON array of base64 keys, oldest first, at most [`MAX_PREV_KEYS`]): they still
//! verify that peer's mail and receipts signed before the rotation ([`by_any_key`],
//! [`prev_keys`]), never a hop and never a new pin. Only [`rotate`] moves a pin.

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

/// Most retired host keys kept per peer (`peers.prev_keys`); past it the oldest is dropped. A
/// retired key only has to outlive the mail still in flight when it was retired.
pub const MAX_PREV_KEYS: usize = 64;

/// The keys `host` rotated away from (base64, oldest first); empty for an unknown peer or one
/// that never rotated. A stored value that is not a JSON array of strings reads as empty.
/// Errors: SQLite failures.
pub fn prev_keys(conn: &Connection, host: &str) -> Result<Vec<String>, MailboxError> {
    let text: Option<String> = conn
        .query_row("SELECT prev_keys FROM peers WHERE host = ?1", [host], |r| {
            r.get(0)
        })
        .optional()?;
    Ok(text
        .and_then(|t| serde_json::from_str::<Vec<String>>(&t).ok())
        .unwrap_or_default())
}

/// The peer whose pinned key is `pubkey`, else the peer that rotated away from `pubkey` (one
/// of its `prev_keys`): the sender of mail or a receipt signed before that peer rotated
/// (`wire.md` §2.10). Never use it for a hop or a new pin. Errors: SQLite failures.
pub fn by_any_key(conn: &Connection, pubkey: &str) -> Result<Option<Peer>, MailboxError> {
    if let Some(p) = by_key(conn, pubkey)? {
        return Ok(Some(p));
    }
    Ok(conn
        .query_row(
            &format!(
                "SELECT {COLS} FROM peers
                 WHERE EXISTS (SELECT 1 FROM json_each(peers.prev_keys) WHERE value = ?1)
                 ORDER BY host LIMIT 1"
            ),
            [pubkey],
            row,
        )
        .optional()?)
}

/// A pin moved by an accepted rotation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rotated {
    /// The peer.
    pub host: String,
    /// The key it rotated away from (base64), now the newest of its `prev_keys`.
    pub old_pub: String,
    /// The newly pinned key (base64).
    pub new_pub: String,
}

/// Moves the pin of `host` from `old_pub` to `new_pub` after the rotation record was checked
/// (`wire.md` §2.10, in the caller's transaction): `pubkey := new_pub`, `enc_pub :=
/// new_enc_pub` with the enc-ad rollback guard restarted at the record's issue time
/// (`enc_ad_iat := iat_ms`, `None` when it does not parse: the next valid ad signed by the new
/// key is taken), `old_pub` appended to `prev_keys` (and `new_pub` taken out of it, when a
/// peer rotates back to a key it used before; at most [`MAX_PREV_KEYS`], oldest dropped).
/// Returns `None`, changing nothing, when `host` is not pinned to `old_pub` (any more).
/// Errors: [`MailboxError::Conflict`] when `new_pub` is pinned as another peer; SQLite.
pub fn rotate(
    conn: &Connection,
    host: &str,
    old_pub: &str,
    new_pub: &str,
    new_enc_pub: &str,
    iat_ms: Option<i64>,
) -> Result<Option<Rotated>, MailboxError> {
    match by_name(conn, host)? {
        Some(p) if p.pubkey == old_pub => {}
        _ => return Ok(None),
    }
    if let Some(other) = by_key(conn, new_pub)? {
        return Err(MailboxError::Conflict(format!(
            "the new host key is already pinned as peer {}",
            other.host
        )));
    }
    let mut prev: Vec<String> = prev_keys(conn, host)?
        .into_iter()
        .filter(|k| k != new_pub && k != old_pub)
        .collect();
    prev.push(old_pub.to_string());
    let excess = prev.len().saturating_sub(MAX_PREV_KEYS);
    prev.drain(..excess);
    let prev = serde_json::to_string(&prev)
        .map_err(|e| MailboxError::Invalid(format!("prev_keys: {e}")))?;
    let n = conn.execute(
        "UPDATE peers SET pubkey = ?3, enc_pub = ?4, enc_ad_iat = ?5, prev_keys = ?6
         WHERE host = ?1 AND pubkey = ?2",
        params![host, old_pub, new_pub, new_enc_pub, iat_ms, prev],
    )?;
    Ok((n == 1).then(|| Rotated {
        host: host.to_string(),
        old_pub: old_pub.to_string(),
        new_pub: new_pub.to_string(),
    }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use agentmbx_protocol::keys::HostKey;

    fn key() -> String {
        HostKey::generate().public().to_b64()
    }

    #[test]
    fn rotations_keep_at_most_64_retired_keys_and_they_still_name_the_peer() {
        let store = crate::testutil::store();
        store
            .mailbox
            .with(|c| {
                let first = key();
                add(c, "work", &first, 1)?;
                let mut keys = vec![first];
                for i in 0..MAX_PREV_KEYS {
                    let next = key();
                    let moved = rotate(c, "work", &keys[i], &next, "enc", Some(i as i64))?;
                    assert!(moved.is_some());
                    keys.push(next);
                }
                // At the cap: every retired key kept, oldest first.
                assert_eq!(prev_keys(c, "work")?, keys[..MAX_PREV_KEYS].to_vec());
                let p = by_name(c, "work")?.unwrap();
                assert_eq!(p.pubkey, keys[MAX_PREV_KEYS]);
                assert_eq!(
                    (p.enc_pub.as_deref(), p.enc_ad_iat),
                    (Some("enc"), Some(63))
                );
                assert_eq!(by_any_key(c, &keys[0])?.unwrap().host, "work");
                assert_eq!(by_key(c, &keys[0])?, None, "a retired key is no pin");
                // Past it: the oldest is dropped.
                let last = key();
                rotate(c, "work", &keys[MAX_PREV_KEYS], &last, "enc2", None)?;
                let prev = prev_keys(c, "work")?;
                assert_eq!(prev.len(), MAX_PREV_KEYS);
                assert_eq!(prev, keys[1..].to_vec());
                assert_eq!(by_any_key(c, &keys[0])?, None);
                assert_eq!(by_name(c, "work")?.unwrap().enc_ad_iat, None);
                Ok(())
            })
            .unwrap();
    }

    #[test]
    fn a_pin_moves_only_from_the_pinned_key_and_never_onto_another_peers_key() {
        let store = crate::testutil::store();
        store
            .mailbox
            .with(|c| {
                let (a, b, other) = (key(), key(), key());
                add(c, "work", &a, 1)?;
                add(c, "lab", &other, 1)?;
                assert_eq!(rotate(c, "work", &b, &key(), "e", None)?, None);
                assert_eq!(rotate(c, "nowhere", &a, &b, "e", None)?, None);
                assert!(matches!(
                    rotate(c, "work", &a, &other, "e", None),
                    Err(MailboxError::Conflict(_))
                ));
                assert_eq!(by_name(c, "work")?.unwrap().pubkey, a);
                // Rotating back to a key used before takes it out of the retired ones.
                rotate(c, "work", &a, &b, "e", None)?;
                rotate(c, "work", &b, &a, "e", None)?;
                assert_eq!(prev_keys(c, "work")?, vec![b.clone()]);
                assert_eq!(by_name(c, "work")?.unwrap().pubkey, a);
                Ok(())
            })
            .unwrap();
    }
}
