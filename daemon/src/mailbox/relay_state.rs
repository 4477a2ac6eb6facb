//! Receive-side relay state: the position (epoch, received_through, acked_through) per relay,
//! quarantine of rejected items (spec §4: never dropped silently), and a small kv table for
//! cached facts (enrolment, published ad).

use rusqlite::{params, Connection, OptionalExtension};
use serde::Serialize;

use super::MailboxError;

/// Where this host stands with one relay.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Position {
    /// Relay epoch the numbers belong to.
    pub epoch: String,
    /// Highest seq durably processed contiguously.
    pub received_through: i64,
    /// Highest seq the relay confirmed as acked.
    pub acked_through: i64,
}

/// The position for `relay`, if any.
pub fn position(conn: &Connection, relay: &str) -> Result<Option<Position>, MailboxError> {
    Ok(conn
        .query_row(
            "SELECT epoch, received_through, acked_through FROM relay_position WHERE relay = ?1",
            [relay],
            |r| {
                Ok(Position {
                    epoch: r.get(0)?,
                    received_through: r.get(1)?,
                    acked_through: r.get(2)?,
                })
            },
        )
        .optional()?)
}

/// Sets `received_through` (inside the transaction of the last item of the run it covers).
pub fn set_received_through(
    conn: &Connection,
    relay: &str,
    epoch: &str,
    through: i64,
    now_ms: i64,
) -> Result<(), MailboxError> {
    conn.execute(
        "INSERT INTO relay_position(relay, epoch, received_through, acked_through, updated_at) VALUES (?1,?2,?3,0,?4)
         ON CONFLICT(relay) DO UPDATE SET epoch = ?2, received_through = ?3, updated_at = ?4",
        params![relay, epoch, through, now_ms],
    )?;
    Ok(())
}

/// Resets the position to 0 in a new epoch (spec §5: a receiver re-pulls everything).
pub fn reset(conn: &Connection, relay: &str, epoch: &str, now_ms: i64) -> Result<(), MailboxError> {
    conn.execute(
        "INSERT INTO relay_position(relay, epoch, received_through, acked_through, updated_at) VALUES (?1,?2,0,0,?3)
         ON CONFLICT(relay) DO UPDATE SET epoch = ?2, received_through = 0, acked_through = 0, updated_at = ?3",
        params![relay, epoch, now_ms],
    )?;
    Ok(())
}

/// Records the relay's confirmed `acked_through`.
pub fn set_acked_through(
    conn: &Connection,
    relay: &str,
    epoch: &str,
    acked: i64,
    now_ms: i64,
) -> Result<(), MailboxError> {
    conn.execute(
        "UPDATE relay_position SET acked_through = MAX(acked_through, ?3), updated_at = ?4 WHERE relay = ?1 AND epoch = ?2",
        params![relay, epoch, acked, now_ms],
    )?;
    Ok(())
}

/// A quarantined item.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Quarantined {
    /// Relay URL.
    pub relay: String,
    /// Epoch.
    pub epoch: String,
    /// Relay seq.
    pub seq: i64,
    /// Item kind.
    pub kind: String,
    /// Item id.
    pub item_id: String,
    /// Pushing host key.
    pub sender_pubkey: String,
    /// Why it was rejected.
    pub reason: String,
    /// When (ms).
    pub at: i64,
}

/// The host an item's wire names, for matching it against pin changes (schema 5,
/// `quarantine.claimed_host`): an envelope's `sig.host` (else the host part of its `from`), a
/// receipt's recipient host (`rec.recipient`). `None` for other kinds and for wire that is not
/// a JSON object naming one.
pub fn claimed_host(kind: &str, wire: &[u8]) -> Option<String> {
    let value: serde_json::Value = serde_json::from_slice(wire).ok()?;
    let host_of = |addr: &serde_json::Value| {
        addr.as_str()
            .and_then(|a| a.rsplit_once('@'))
            .map(|(_, h)| h.to_string())
    };
    match kind {
        "envelope" => value
            .get("sig")
            .and_then(|s| s.get("host"))
            .and_then(serde_json::Value::as_str)
            .map(str::to_string)
            .or_else(|| value.get("from").and_then(host_of)),
        "receipt" => value
            .get("rec")
            .and_then(|r| r.get("recipient"))
            .and_then(host_of),
        _ => None,
    }
}

/// Puts a rejected item in quarantine (idempotent per relay, epoch, seq). Its claimed host
/// ([`claimed_host`]) is recorded with it, so a later pin of that name marks it for a retry
/// (schema 5 triggers on `peers`; [`retryable`]).
#[allow(clippy::too_many_arguments)]
pub fn quarantine(
    conn: &Connection,
    relay: &str,
    epoch: &str,
    seq: i64,
    kind: &str,
    item_id: &str,
    sender_pubkey: &str,
    reason: &str,
    wire: &[u8],
    now_ms: i64,
) -> Result<(), MailboxError> {
    conn.execute(
        "INSERT OR IGNORE INTO quarantine(relay, epoch, seq, kind, item_id, sender_pubkey, reason, wire, at, claimed_host, retry)
         VALUES (?1,?2,?3,?4,?5,?6,?7,?8,?9,?10,0)",
        params![
            relay,
            epoch,
            seq,
            kind,
            item_id,
            sender_pubkey,
            reason,
            wire,
            now_ms,
            claimed_host(kind, wire)
        ],
    )?;
    Ok(())
}

/// The latest `limit` quarantined items, newest first.
pub fn quarantined(conn: &Connection, limit: u32) -> Result<Vec<Quarantined>, MailboxError> {
    let mut st = conn.prepare(
        "SELECT relay, epoch, seq, kind, item_id, sender_pubkey, reason, at FROM quarantine ORDER BY id DESC LIMIT ?1",
    )?;
    let rows = st
        .query_map([limit], |r| {
            Ok(Quarantined {
                relay: r.get(0)?,
                epoch: r.get(1)?,
                seq: r.get(2)?,
                kind: r.get(3)?,
                item_id: r.get(4)?,
                sender_pubkey: r.get(5)?,
                reason: r.get(6)?,
                at: r.get(7)?,
            })
        })?
        .collect::<Result<Vec<_>, _>>()?;
    Ok(rows)
}

/// Reads a kv value.
pub fn kv_get(conn: &Connection, k: &str) -> Result<Option<String>, MailboxError> {
    Ok(conn
        .query_row("SELECT v FROM kv WHERE k = ?1", [k], |r| r.get(0))
        .optional()?)
}

/// Writes a kv value.
pub fn kv_set(conn: &Connection, k: &str, v: &str) -> Result<(), MailboxError> {
    conn.execute(
        "INSERT INTO kv(k, v) VALUES (?1, ?2) ON CONFLICT(k) DO UPDATE SET v = ?2",
        params![k, v],
    )?;
    Ok(())
}

/// Deletes kv keys starting with `prefix`.
pub fn kv_delete_prefix(conn: &Connection, prefix: &str) -> Result<(), MailboxError> {
    conn.execute(
        "DELETE FROM kv WHERE substr(k, 1, length(?1)) = ?1",
        [prefix],
    )?;
    Ok(())
}

/// A quarantined item marked for another try (`quarantine.retry` = 1): an envelope or a
/// receipt whose pushing key or claimed host a pin change touched since it was last refused
/// (`wire.md` §3.5; schema 5 triggers on `peers`), or one quarantined before schema 5.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Retryable {
    /// Quarantine row id.
    pub id: i64,
    /// Item kind: `envelope` or `receipt`.
    pub kind: String,
    /// Item id.
    pub item_id: String,
    /// Pushing host key, as the relay verified it.
    pub sender_pubkey: String,
    /// Wire bytes as received.
    pub wire: Vec<u8>,
}

/// Up to `limit` items of `relay` marked for another try, oldest first, whatever reason was
/// recorded for them ([`Retryable`]).
pub fn retryable(
    conn: &Connection,
    relay: &str,
    limit: u32,
) -> Result<Vec<Retryable>, MailboxError> {
    let mut st = conn.prepare(
        "SELECT id, kind, item_id, sender_pubkey, wire FROM quarantine
         WHERE relay = ?1 AND retry = 1 AND kind IN ('envelope', 'receipt')
         ORDER BY id LIMIT ?2",
    )?;
    let rows = st
        .query_map(params![relay, limit], |r| {
            Ok(Retryable {
                id: r.get(0)?,
                kind: r.get(1)?,
                item_id: r.get(2)?,
                sender_pubkey: r.get(3)?,
                wire: r.get(4)?,
            })
        })?
        .collect::<Result<Vec<_>, _>>()?;
    Ok(rows)
}

/// Takes a quarantined item out (it was received after all).
pub fn release(conn: &Connection, id: i64) -> Result<(), MailboxError> {
    conn.execute("DELETE FROM quarantine WHERE id = ?1", [id])?;
    Ok(())
}

/// Records the reason a retried item was refused again and clears its mark: it is tried again
/// at the next pin change that touches it, whatever this reason is. The claimed host is
/// recomputed from its wire (items quarantined before schema 5 have none yet).
pub fn requarantine(
    conn: &Connection,
    id: i64,
    reason: &str,
    now_ms: i64,
) -> Result<(), MailboxError> {
    let found: Option<(String, Vec<u8>)> = conn
        .query_row(
            "SELECT kind, wire FROM quarantine WHERE id = ?1",
            [id],
            |r| Ok((r.get(0)?, r.get(1)?)),
        )
        .optional()?;
    let claimed = found.and_then(|(kind, wire)| claimed_host(&kind, &wire));
    conn.execute(
        "UPDATE quarantine SET reason = ?2, at = ?3, retry = 0, claimed_host = ?4 WHERE id = ?1",
        params![id, reason, now_ms, claimed],
    )?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::mailbox::peers;
    use agentmbx_protocol::keys::HostKey;

    const URL: &str = "http://relay";

    fn key() -> String {
        HostKey::generate().public().to_b64()
    }

    /// Quarantines item `seq` of `kind` pushed by `sender` with `wire`.
    fn put(c: &Connection, seq: i64, kind: &str, sender: &str, wire: &str) {
        quarantine(
            c,
            URL,
            "e1",
            seq,
            kind,
            &format!("i{seq}"),
            sender,
            "host not paired",
            wire.as_bytes(),
            1,
        )
        .unwrap();
    }

    /// The seqs marked for a retry, and clears every mark.
    fn marked(c: &Connection) -> Vec<i64> {
        let seqs: Vec<i64> = c
            .prepare("SELECT seq FROM quarantine WHERE retry = 1 ORDER BY seq")
            .unwrap()
            .query_map([], |r| r.get(0))
            .unwrap()
            .collect::<Result<_, _>>()
            .unwrap();
        c.execute("UPDATE quarantine SET retry = 0", []).unwrap();
        seqs
    }

    #[test]
    fn the_claimed_host_is_an_envelopes_signing_host_or_a_receipts_recipient_host() {
        let env = br#"{"from":"ann@work","sig":{"host":"lab"}}"#;
        assert_eq!(claimed_host("envelope", env).as_deref(), Some("lab"));
        let env = br#"{"from":"ann@work"}"#;
        assert_eq!(claimed_host("envelope", env).as_deref(), Some("work"));
        let rec = br#"{"rec":{"recipient":"bob@lab"},"sig":"x"}"#;
        assert_eq!(claimed_host("receipt", rec).as_deref(), Some("lab"));
        assert_eq!(claimed_host("expired", env), None);
        assert_eq!(claimed_host("envelope", b"\xff not json"), None);
        assert_eq!(claimed_host("receipt", b"[1]"), None);
    }

    #[test]
    fn every_pin_change_marks_the_items_of_its_keys_and_names_whatever_their_reason() {
        let store = crate::testutil::store();
        let (ka, kb, kc) = (key(), key(), key());
        store
            .mailbox
            .with(|c| {
                put(c, 1, "envelope", &ka, r#"{"sig":{"host":"lab"}}"#);
                put(c, 2, "receipt", &kb, r#"{"rec":{"recipient":"bob@mars"}}"#);
                put(c, 3, "expired", &ka, r#"{"notice":{}}"#);
                put(c, 4, "envelope", &kc, "junk");
                // Newly quarantined items wait for a change.
                assert_eq!(marked(c), Vec::<i64>::new());
                assert!(retryable(c, URL, 100)?.is_empty());
                // A pin of ka under another name: item 1 by its key (never the notice).
                peers::add(c, "other", &ka, 1)?;
                assert_eq!(marked(c), [1]);
                // Removing it marks it again (its reason changes back).
                peers::remove(c, "other")?;
                assert_eq!(marked(c), [1]);
                // A pin of the name item 1 claims, with another key: item 1 by its name.
                peers::add(c, "lab", &kb, 1)?;
                assert_eq!(marked(c), [1, 2]);
                // Contact and address updates change no pin: nothing.
                peers::seen(c, "lab", 5)?;
                peers::set_addr(c, "lab", "127.0.0.1:1", "cli")?;
                assert_eq!(marked(c), Vec::<i64>::new());
                // A rotation of lab from kb to kc: items pushed by the old and the new key.
                peers::rotate(c, "lab", &kb, &kc, "enc", Some(1), 2)?.unwrap();
                assert_eq!(marked(c), [1, 2, 4]);
                // A name change (any writer of `peers`): the old and the new name's items.
                c.execute("UPDATE peers SET host = 'mars' WHERE host = 'lab'", [])?;
                assert_eq!(marked(c), [1, 2, 4]);
                // A pin of a key lab retired (as a new peer): its items too.
                peers::remove(c, "mars")?;
                marked(c);
                c.execute(
                    "INSERT INTO peers(host, pubkey, added_at, prev_keys) VALUES ('x', ?1, 1, json_array(json_object('key', ?2, 'retired_at', 1)))",
                    params![key(), kb],
                )?;
                assert_eq!(marked(c), [2]);
                Ok(())
            })
            .unwrap();
    }

    #[test]
    fn a_retry_refused_again_records_its_reason_and_waits_for_the_next_change() {
        let store = crate::testutil::store();
        let ka = key();
        store
            .mailbox
            .with(|c| {
                put(c, 1, "envelope", &ka, r#"{"sig":{"host":"lab"}}"#);
                peers::add(c, "other", &ka, 1)?;
                let items = retryable(c, URL, 100)?;
                assert_eq!(items.len(), 1);
                assert_eq!(
                    (items[0].kind.as_str(), items[0].item_id.as_str()),
                    ("envelope", "i1")
                );
                requarantine(c, items[0].id, "sender host mismatch", 7)?;
                assert!(retryable(c, URL, 100)?.is_empty());
                let q = quarantined(c, 10)?;
                assert_eq!((q[0].reason.as_str(), q[0].at), ("sender host mismatch", 7));
                // The next change that touches it marks it again, whatever that reason was.
                peers::remove(c, "other")?;
                peers::add(c, "lab", &ka, 1)?;
                assert_eq!(retryable(c, URL, 100)?.len(), 1);
                // Other relays' items are theirs to retry.
                assert!(retryable(c, "http://other", 100)?.is_empty());
                Ok(())
            })
            .unwrap();
    }
}
