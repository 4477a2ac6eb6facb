//! Peers: hosts this host knows by their pinned host key. A peer's name is this host's handle for
//! that key, unique here (`wire.md` "Resolved details": host names on the LAN).
//!
//! A peer that rotated its host key (`wire.md` §2.10) keeps the keys it rotated away from in
//! `prev_keys` (JSON array of [`RetiredKey`] objects `{key, retired_at}`, oldest first, at most
//! [`MAX_PREV_KEYS`]; the older plain-string form `"<key>"` still reads): they still verify that
//! peer's mail and receipts signed before the rotation ([`by_any_key`], [`retired_keys`],
//! [`check_retired`]), but only for records dated no later than [`RETIRED_KEY_GRACE_MS`] after
//! the rotation; never a hop and never a new pin. Only [`rotate`] moves a pin.

use rusqlite::{params, Connection, OptionalExtension};
use serde::Serialize;
use serde_json::Value;

use agentmbx_protocol::time::iso_ms;

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
    // Fires trigger `peers_quarantine_insert` (schema.rs): quarantined mail and receipts from
    // this key or host are marked for a retry.
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
    // Fires trigger `peers_quarantine_delete` (schema.rs): quarantined mail and receipts from
    // this key or host are marked for a retry.
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

/// How long after a rotation a retired key still vouches for a record dated by its signer (ms):
/// 15 days, the relay's retention (14 days, `limits::RETENTION_DAYS`) plus a day, the longest an
/// honest envelope or receipt signed by the old key can still be in flight. A signature by a
/// retired key on a record dated later is refused ([`check_retired`]).
pub const RETIRED_KEY_GRACE_MS: i64 =
    (agentmbx_protocol::limits::RETENTION_DAYS as i64 + 1) * 86_400_000;

/// One key a peer rotated away from (an element of `peers.prev_keys`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct RetiredKey {
    /// The retired Ed25519 host key (base64).
    pub key: String,
    /// When the peer rotated away from it (ms since the epoch): the rotation record's `iat`,
    /// never later than the time this host accepted the record. `None` for an entry stored in
    /// the older plain-string form, which has no time: it verifies without the grace bound.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub retired_at: Option<i64>,
}

impl RetiredKey {
    /// The latest record date (ms) this key still vouches for: `retired_at` plus
    /// [`RETIRED_KEY_GRACE_MS`]; `None` when the entry has no time.
    pub fn valid_through(&self) -> Option<i64> {
        self.retired_at
            .map(|t| t.saturating_add(RETIRED_KEY_GRACE_MS))
    }
}

/// Parses a stored `prev_keys` value: objects `{key, retired_at}` and plain strings (the older
/// form); elements of any other shape are skipped, a value that is not a JSON array reads as
/// empty.
fn parse_retired(text: &str) -> Vec<RetiredKey> {
    let Ok(Value::Array(items)) = serde_json::from_str::<Value>(text) else {
        return Vec::new();
    };
    items
        .into_iter()
        .filter_map(|v| match v {
            Value::String(key) => Some(RetiredKey {
                key,
                retired_at: None,
            }),
            Value::Object(map) => Some(RetiredKey {
                key: map.get("key")?.as_str()?.to_string(),
                retired_at: map.get("retired_at").and_then(Value::as_i64),
            }),
            _ => None,
        })
        .collect()
}

/// The keys `host` rotated away from with their rotation times, oldest first; empty for an
/// unknown peer or one that never rotated (module docs: the stored forms). Errors: SQLite
/// failures.
pub fn retired_keys(conn: &Connection, host: &str) -> Result<Vec<RetiredKey>, MailboxError> {
    let text: Option<String> = conn
        .query_row("SELECT prev_keys FROM peers WHERE host = ?1", [host], |r| {
            r.get(0)
        })
        .optional()?;
    Ok(text.as_deref().map(parse_retired).unwrap_or_default())
}

/// The keys `host` rotated away from (base64, oldest first): [`retired_keys`] without the
/// times. Errors: SQLite failures.
pub fn prev_keys(conn: &Connection, host: &str) -> Result<Vec<String>, MailboxError> {
    Ok(retired_keys(conn, host)?
        .into_iter()
        .map(|r| r.key)
        .collect())
}

/// Whether a retired key of peer `host` vouches for a record (`what`: `mail`, `receipt`) dated
/// `dated_ms` (its `ts` or `at`; `None` when it does not parse) that `verifies` says it signed
/// (`wire.md` §2.10: retired keys stay valid for verification, of records from before the
/// rotation). `verifies` gets each retired key as stored (base64): the caller parses it and
/// checks the signature, and answers false for a key that does not parse. `Ok(())` when a key that signed it was retired at most [`RETIRED_KEY_GRACE_MS`]
/// before that date (or has no recorded time); otherwise the refusal reason: `bad signature`
/// when no retired key signed it, else `signed by a key <host> retired at <iso>: not valid for
/// <what> dated after <iso>`.
pub fn check_retired(
    retired: &[RetiredKey],
    host: &str,
    what: &str,
    dated_ms: Option<i64>,
    verifies: impl Fn(&str) -> bool,
) -> Result<(), String> {
    let mut late: Option<&RetiredKey> = None;
    for r in retired {
        if !verifies(&r.key) {
            continue;
        }
        match (r.valid_through(), dated_ms) {
            (None, _) => return Ok(()),
            (Some(through), Some(dated)) if dated <= through => return Ok(()),
            _ => late = Some(r),
        }
    }
    match late.and_then(|r| Some((r.retired_at?, r.valid_through()?))) {
        Some((at, through)) => Err(format!(
            "signed by a key {host} retired at {}: not valid for {what} dated after {}",
            iso_ms(at),
            iso_ms(through)
        )),
        None => Err("bad signature".into()),
    }
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
                 WHERE EXISTS (SELECT 1 FROM json_each(peers.prev_keys) AS r
                               WHERE CASE r.type
                                   WHEN 'text' THEN r.value
                                   WHEN 'object' THEN json_extract(r.value, '$.key')
                               END = ?1)
                 ORDER BY host LIMIT 1"
            ),
            [pubkey],
            row,
        )
        .optional()?)
}

/// Refusal of a rotation whose new key is one the peer already retired ([`rotate`]); the
/// relay refuses the same with 409 `ROTATION_TARGET`.
pub const ROTATION_TO_RETIRED: &str = "rotation returns to a retired host key";

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
/// key is taken), `old_pub` appended to `prev_keys` as retired at `iat_ms` (at most `now_ms`,
/// the acceptance time; `now_ms` when the record's time does not parse); at most
/// [`MAX_PREV_KEYS`], oldest dropped. Returns `None`, changing nothing, when `host` is not pinned
/// to `old_pub` (any more). A rotation back to one of the peer's retired keys is refused: the
/// records of the earlier rotations are public, and anyone could replay them to move the pin
/// back and forth. Errors: [`MailboxError::Conflict`] when `new_pub` is pinned as another peer
/// or is a retired key of this one ([`ROTATION_TO_RETIRED`]); SQLite.
pub fn rotate(
    conn: &Connection,
    host: &str,
    old_pub: &str,
    new_pub: &str,
    new_enc_pub: &str,
    iat_ms: Option<i64>,
    now_ms: i64,
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
    let retired = retired_keys(conn, host)?;
    if retired.iter().any(|r| r.key == new_pub) {
        return Err(MailboxError::Conflict(ROTATION_TO_RETIRED.to_string()));
    }
    let mut prev: Vec<RetiredKey> = retired
        .into_iter()
        .filter(|r| r.key != new_pub && r.key != old_pub)
        .collect();
    prev.push(RetiredKey {
        key: old_pub.to_string(),
        retired_at: Some(iat_ms.map_or(now_ms, |t| t.min(now_ms))),
    });
    let excess = prev.len().saturating_sub(MAX_PREV_KEYS);
    prev.drain(..excess);
    let prev = serde_json::to_string(&prev)
        .map_err(|e| MailboxError::Invalid(format!("prev_keys: {e}")))?;
    // Fires trigger `peers_quarantine_update` (schema.rs): quarantined mail and receipts from
    // the old or new key or host are marked for a retry.
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
    use agentmbx_protocol::keys::{HostKey, PublicKey};

    /// The acceptance time of the rotations in these tests (ms).
    const T: i64 = 1_000_000;

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
                    let moved = rotate(c, "work", &keys[i], &next, "enc", Some(i as i64), T)?;
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
                rotate(c, "work", &keys[MAX_PREV_KEYS], &last, "enc2", None, T)?;
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
                assert_eq!(rotate(c, "work", &b, &key(), "e", None, T)?, None);
                assert_eq!(rotate(c, "nowhere", &a, &b, "e", None, T)?, None);
                assert!(matches!(
                    rotate(c, "work", &a, &other, "e", None, T),
                    Err(MailboxError::Conflict(_))
                ));
                assert_eq!(by_name(c, "work")?.unwrap().pubkey, a);
                // Rotating back to a retired key is refused: its old records could be replayed.
                rotate(c, "work", &a, &b, "e", None, T)?;
                match rotate(c, "work", &b, &a, "e", None, T) {
                    Err(MailboxError::Conflict(why)) => assert_eq!(why, ROTATION_TO_RETIRED),
                    other => panic!("{other:?}"),
                }
                assert_eq!(prev_keys(c, "work")?, vec![a.clone()]);
                assert_eq!(by_name(c, "work")?.unwrap().pubkey, b);
                Ok(())
            })
            .unwrap();
    }

    #[test]
    fn a_retired_key_records_the_rotation_time_and_the_plain_string_form_still_reads() {
        let store = crate::testutil::store();
        store
            .mailbox
            .with(|c| {
                let (a, b, c2, legacy) = (key(), key(), key(), key());
                add(c, "work", &a, 1)?;
                // The record's iat is the rotation time.
                rotate(c, "work", &a, &b, "e", Some(T - 5), T)?;
                // A record dated ahead of this host's clock counts from its acceptance.
                rotate(c, "work", &b, &c2, "e", Some(T + 99), T + 10)?;
                assert_eq!(
                    retired_keys(c, "work")?,
                    vec![
                        RetiredKey {
                            key: a.clone(),
                            retired_at: Some(T - 5)
                        },
                        RetiredKey {
                            key: b.clone(),
                            retired_at: Some(T + 10)
                        },
                    ]
                );
                let stored: String =
                    c.query_row("SELECT prev_keys FROM peers WHERE host = 'work'", [], |r| {
                        r.get(0)
                    })?;
                assert_eq!(
                    serde_json::from_str::<Value>(&stored).unwrap(),
                    serde_json::json!([{"key": a, "retired_at": T - 5},
                                       {"key": b, "retired_at": T + 10}])
                );
                // An unparseable record time: retired when accepted.
                let d = key();
                rotate(c, "work", &c2, &d, "e", None, T + 20)?;
                assert_eq!(retired_keys(c, "work")?[2].retired_at, Some(T + 20));

                // The older plain-string form (and junk elements) read; the key still names the
                // peer, without a time; the next rotation keeps it as it was.
                add(c, "lab", &legacy, 1)?;
                let old_form = serde_json::json!([legacy, 7, {"nokey": 1}]).to_string();
                c.execute(
                    "UPDATE peers SET pubkey = ?1, prev_keys = ?2 WHERE host = 'lab'",
                    params![key(), old_form],
                )?;
                assert_eq!(
                    retired_keys(c, "lab")?,
                    vec![RetiredKey {
                        key: legacy.clone(),
                        retired_at: None
                    }]
                );
                assert_eq!(prev_keys(c, "lab")?, vec![legacy.clone()]);
                assert_eq!(by_any_key(c, &legacy)?.unwrap().host, "lab");
                assert_eq!(by_any_key(c, &a)?.unwrap().host, "work");
                let pinned = by_name(c, "lab")?.unwrap().pubkey;
                rotate(c, "lab", &pinned, &key(), "e", Some(T), T)?;
                let lab = retired_keys(c, "lab")?;
                assert_eq!(lab[0].retired_at, None);
                assert_eq!(lab[1].retired_at, Some(T));
                Ok(())
            })
            .unwrap();
    }

    #[test]
    fn a_retired_key_vouches_only_for_records_dated_within_the_grace() {
        let signer = HostKey::generate();
        let msg = b"record";
        let sig = signer.sign(msg);
        let verifies = |k: &str| PublicKey::from_b64(k).is_ok_and(|k| k.verify(msg, &sig));
        let at = 1_767_225_600_000;
        let retired = vec![
            RetiredKey {
                key: key(),
                retired_at: Some(at),
            },
            RetiredKey {
                key: signer.public().to_b64(),
                retired_at: Some(at),
            },
        ];
        let check = |dated| check_retired(&retired, "work", "mail", dated, verifies);
        assert_eq!(RETIRED_KEY_GRACE_MS, 15 * 86_400_000);
        // Before the rotation, and up to the end of the grace: accepted.
        assert_eq!(check(Some(at - 1)), Ok(()));
        assert_eq!(check(Some(at + RETIRED_KEY_GRACE_MS)), Ok(()));
        // Past it (or undated): refused, saying why.
        let why = check(Some(at + RETIRED_KEY_GRACE_MS + 1)).unwrap_err();
        assert_eq!(
            why,
            "signed by a key work retired at 2026-01-01T00:00:00.000Z: not valid for mail dated after 2026-01-16T00:00:00.000Z"
        );
        assert_eq!(check(None).unwrap_err(), why);
        // A key that did not sign it is no voucher at all.
        let other = HostKey::generate().sign(msg);
        assert_eq!(
            check_retired(&retired, "work", "mail", Some(at), |k| {
                PublicKey::from_b64(k).is_ok_and(|k| k.verify(msg, &other))
            }),
            Err("bad signature".into())
        );
        assert_eq!(
            check_retired(&[], "work", "mail", Some(at), verifies),
            Err("bad signature".into())
        );
        // An entry without a time (the older stored form) is not bounded.
        let untimed = [RetiredKey {
            key: signer.public().to_b64(),
            retired_at: None,
        }];
        assert_eq!(
            check_retired(&untimed, "work", "mail", Some(i64::MAX), verifies),
            Ok(())
        );
    }
}
