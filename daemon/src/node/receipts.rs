//! Delivery receipts (spec §9, `wire.md` §2.11): accepting the signed receipt records that
//! recipients' hosts send back, applying them by state rank then seq, and settling outbox rows.
//!
//! A receipt is checked in this order, each failure a `rejected:<why>` result with 0.5.x's
//! texts: the record's strict shape (`invalid receipt`: extra keys, lengths, states, a signature
//! over 200 characters) → over the LAN the hop's host must be the recipient's host, over the
//! relay the pushing key must be that host's pinned key or one it retired in a rotation
//! (`receipt for <r> did not come from <host>`) → the recipient's host is a pinned peer
//! (`<host> is not a paired host`) → the signature verifies with its pinned key or a retired one
//! (a receipt signed before the rotation, dated at most 15 days after it; `bad signature`,
//! `signed by a key <host> retired at <iso>: not valid for a receipt dated after <iso>`) → the
//! message is one this host sent (`not a message this host sent`) and routed to that host
//! (`message was not sent to <host>`) → at most 200 recipients per host and message (`too many
//! recipients for one message`).
//!
//! It never trusts a relay: the record is verified with the recipient host's pinned key either
//! way, so a relay cannot forge or alter one.

use rusqlite::{Connection, OptionalExtension};
use serde_json::Value;

use agentmbx_protocol::canonical;
use agentmbx_protocol::keys::{HostKey, PublicKey};
use agentmbx_protocol::records::{self, Receipt, RECEIPT_STATES};
use agentmbx_protocol::time::parse_iso_ms;

use crate::mailbox::{outbox, peers, peers::Peer, MailboxError};

/// One message cannot fan out into more remote receipt rows than this per host (a paired host
/// cannot grow our table at will; `wire.md` §2.11).
pub const MAX_RECIPIENTS_PER_HOST: i64 = 200;

fn rank(state: &str) -> usize {
    RECEIPT_STATES.iter().position(|s| *s == state).unwrap_or(0)
}

/// Accepts one receipt `{rec, sig}` (`wire.md` §2.11). `hop` is the verified LAN hop's peer, or
/// `None` for a receipt pulled from the relay (then `relay_sender` is the item's verified
/// sender key). Returns the result text: `accepted`, `duplicate`, `stale` or `rejected:<why>`.
///
/// Applying is by state rank (delivered < notified < read < acked), then seq: a higher
/// (rank, seq) than the stored one is `accepted` (stored), the same is `duplicate`, a lower
/// one `stale`. Every valid receipt (all states are delivered or later) settles that host's
/// outbox row when it is still `pending` or `relay-accepted` (`delivered`). The writes happen
/// under one savepoint, so they are atomic inside or outside a caller's transaction.
/// Errors: storage faults only.
pub fn accept(
    conn: &Connection,
    _own_host: &str,
    wire: &Value,
    hop: Option<&Peer>,
    relay_sender: Option<&str>,
    now_ms: i64,
) -> Result<String, MailboxError> {
    let Some((rec, rec_v, sig)) = parse(wire) else {
        return Ok("rejected:invalid receipt".into());
    };
    let host = rec
        .recipient
        .split_once('@')
        .map(|(_, h)| h.to_string())
        .unwrap_or_default();
    let not_from = || {
        format!(
            "rejected:receipt for {} did not come from {host}",
            rec.recipient
        )
    };
    if hop.is_some_and(|p| p.host != host) {
        return Ok(not_from());
    }
    let Some(peer) = peers::by_name(conn, &host)? else {
        return Ok(format!("rejected:{host} is not a paired host"));
    };
    // Keys the peer rotated away from still vouch for receipts signed (and pushed) before the
    // rotation (`wire.md` §2.10), dated (`at`) no later than the rotation plus the grace
    // (`peers::check_retired`); a LAN hop is always by the pinned key.
    let retired = peers::retired_keys(conn, &host)?;
    if relay_sender.is_some_and(|k| k != peer.pubkey && !retired.iter().any(|r| r.key == k))
        || hop.is_some_and(|p| p.pubkey != peer.pubkey)
    {
        return Ok(not_from());
    }
    let signed = canonical::to_string(&rec_v).unwrap_or_default();
    let signs = |k: &PublicKey| k.verify(signed.as_bytes(), &sig);
    if !PublicKey::from_b64(&peer.pubkey).is_ok_and(|k| signs(&k)) {
        let at = parse_iso_ms(&rec.at);
        let retired_signs = |k: &str| PublicKey::from_b64(k).is_ok_and(|k| signs(&k));
        if let Err(why) = peers::check_retired(&retired, &host, "a receipt", at, retired_signs) {
            return Ok(format!("rejected:{why}"));
        }
    }
    let origin: Option<String> = conn
        .query_row(
            "SELECT origin FROM messages WHERE id = ?1",
            [&rec.msg],
            |r| r.get(0),
        )
        .optional()?;
    if origin.as_deref() != Some("local") {
        return Ok("rejected:not a message this host sent".into());
    }
    if outbox::get(conn, &rec.msg, &host)?.is_none() {
        return Ok(format!("rejected:message was not sent to {host}"));
    }
    conn.execute_batch("SAVEPOINT receipt_accept")?;
    match apply(conn, &rec, &host, &signed, &sig, now_ms) {
        Ok(result) => {
            conn.execute_batch("RELEASE receipt_accept")?;
            Ok(result)
        }
        Err(e) => {
            let _ = conn.execute_batch("ROLLBACK TO receipt_accept; RELEASE receipt_accept");
            Err(e)
        }
    }
}

/// The strict record check: `{rec, sig}` exactly, the record as `wire.md` §2.11 and the
/// signature text ≤200 characters (checked with [`records::parse_receipt_wire`], whose answer
/// for a well-formed record under a key that did not sign it is `bad signature`).
fn parse(wire: &Value) -> Option<(Receipt, Value, String)> {
    let bytes = canonical::to_string(wire).ok()?;
    let probe = HostKey::generate().public();
    match records::parse_receipt_wire(bytes.as_bytes(), &probe) {
        Err(why) if why != "bad signature" => return None,
        _ => {}
    }
    let rec_v = wire.get("rec")?.clone();
    let sig = wire.get("sig")?.as_str()?.to_string();
    let rec: Receipt = serde_json::from_value(rec_v.clone()).ok()?;
    Some((rec, rec_v, sig))
}

fn apply(
    conn: &Connection,
    rec: &Receipt,
    host: &str,
    record: &str,
    sig: &str,
    now_ms: i64,
) -> Result<String, MailboxError> {
    let old: Option<(String, i64)> = conn
        .query_row(
            "SELECT state, seq FROM remote_receipts WHERE msg_id = ?1 AND recipient = ?2",
            [&rec.msg, &rec.recipient],
            |r| Ok((r.get(0)?, r.get(1)?)),
        )
        .optional()?;
    let new_key = (rank(&rec.state), rec.seq as i64);
    let result = match &old {
        Some((state, seq)) => match new_key.cmp(&(rank(state), *seq)) {
            std::cmp::Ordering::Greater => "accepted",
            std::cmp::Ordering::Equal => "duplicate",
            std::cmp::Ordering::Less => "stale",
        },
        None => {
            let n: i64 = conn.query_row(
                "SELECT COUNT(*) FROM remote_receipts WHERE msg_id = ?1 AND host = ?2",
                [&rec.msg, host],
                |r| r.get(0),
            )?;
            if n >= MAX_RECIPIENTS_PER_HOST {
                return Ok("rejected:too many recipients for one message".into());
            }
            "accepted"
        }
    };
    if result == "accepted" {
        conn.execute(
            "INSERT INTO remote_receipts(msg_id, recipient, host, state, at, note, did, seq, record, sig, received_at)
             VALUES (?1,?2,?3,?4,?5,?6,?7,?8,?9,?10,?11)
             ON CONFLICT(msg_id, recipient) DO UPDATE SET host = ?3, state = ?4, at = ?5, note = ?6,
               did = ?7, seq = ?8, record = ?9, sig = ?10, received_at = ?11",
            rusqlite::params![
                rec.msg,
                rec.recipient,
                host,
                rec.state,
                rec.at,
                rec.note,
                rec.did,
                rec.seq as i64,
                record,
                sig,
                now_ms
            ],
        )?;
    }
    // Every state is delivered or later: the host has the message.
    if outbox::settle_by_receipt(conn, &rec.msg, host, now_ms)? {
        tracing::info!(id = %rec.msg, host, state = %rec.state, "delivery confirmed by receipt");
    }
    Ok(result.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::identity::Identity;
    use crate::testutil::{self, Store, T0};
    use serde_json::json;

    const ID: &str = "01KDVDNA3VG2MH8KWSQRCWJZ0S";

    struct Fx {
        s: Store,
        me: Identity,
        work: Identity,
        lab: Identity,
    }

    /// home (alice) sent ID to bob@work and carol@work; lab is pinned too but got nothing.
    fn fx() -> Fx {
        let s = testutil::store();
        let me = testutil::identity("home");
        let work = testutil::identity("work");
        let lab = testutil::identity("lab");
        s.add_peer(&work, true);
        s.add_peer(&lab, true);
        s.send(&me, "alice", &["bob@work", "carol@work"], "hi", ID, T0)
            .unwrap();
        Fx { s, me, work, lab }
    }

    fn receipt(recipient: &str, state: &str, seq: u64) -> Receipt {
        Receipt {
            v: 1,
            kind: "receipt".into(),
            msg: ID.into(),
            recipient: recipient.into(),
            state: state.into(),
            at: agentmbx_protocol::time::iso_ms(T0),
            note: None,
            did: None,
            seq,
        }
    }

    fn wire(rec: &Receipt, key: &Identity) -> Value {
        serde_json::from_str(&rec.wire(&key.host_key).unwrap()).unwrap()
    }

    fn peer(s: &Store, host: &str) -> Peer {
        s.mailbox
            .with(|c| peers::by_name(c, host))
            .unwrap()
            .unwrap()
    }

    fn lan(f: &Fx, w: &Value) -> String {
        let p = peer(&f.s, "work");
        f.s.mailbox
            .with(|c| accept(c, "home", w, Some(&p), None, T0 + 5))
            .unwrap()
    }

    fn stored(f: &Fx, recipient: &str) -> Option<(String, i64)> {
        f.s.fresh_conn()
            .query_row(
                "SELECT state, seq FROM remote_receipts WHERE recipient = ?1",
                [recipient],
                |r| Ok((r.get(0)?, r.get(1)?)),
            )
            .optional()
            .unwrap()
    }

    #[test]
    fn a_seq_past_the_safe_integer_range_is_refused() {
        let f = fx();
        let max = agentmbx_protocol::records::MAX_SAFE_INT as u64;
        for seq in [max + 1, 1 << 63, u64::MAX] {
            let got = lan(&f, &wire(&receipt("bob@work", "read", seq), &f.work));
            assert!(got.starts_with("rejected:"), "{seq}: {got}");
        }
        assert_eq!(stored(&f, "bob@work"), None);
        // The largest safe seq is accepted and stored exactly.
        assert_eq!(
            lan(&f, &wire(&receipt("bob@work", "read", max), &f.work)),
            "accepted"
        );
        assert_eq!(stored(&f, "bob@work"), Some(("read".into(), max as i64)));
    }

    #[test]
    fn results_follow_state_rank_then_seq() {
        let f = fx();
        let w = |state, seq| wire(&receipt("bob@work", state, seq), &f.work);
        assert_eq!(lan(&f, &w("read", 5)), "accepted");
        assert_eq!(stored(&f, "bob@work"), Some(("read".into(), 5)));
        assert_eq!(lan(&f, &w("read", 5)), "duplicate");
        // A lower rank is stale even with a higher seq; a lower seq at the same rank too.
        assert_eq!(lan(&f, &w("delivered", 9)), "stale");
        assert_eq!(lan(&f, &w("read", 4)), "stale");
        assert_eq!(stored(&f, "bob@work"), Some(("read".into(), 5)));
        // Same rank, higher seq; then a higher rank with a lower seq.
        assert_eq!(lan(&f, &w("read", 6)), "accepted");
        assert_eq!(lan(&f, &w("acked", 2)), "accepted");
        assert_eq!(stored(&f, "bob@work"), Some(("acked".into(), 2)));
        assert_eq!(lan(&f, &w("notified", 10)), "stale");
        // Another recipient on the same host is its own row.
        assert_eq!(
            lan(&f, &wire(&receipt("carol@work", "delivered", 1), &f.work)),
            "accepted"
        );
        let n: i64 = f.s.scalar("SELECT COUNT(*) FROM remote_receipts");
        assert_eq!(n, 2);
    }

    #[test]
    fn rejections_change_nothing() {
        let f = fx();
        let good = wire(&receipt("bob@work", "read", 1), &f.work);
        let cases: Vec<(Value, &str)> = vec![
            // Extra key in the record (the signature is made over it, so only the shape fails).
            (
                {
                    let mut rec = serde_json::to_value(receipt("bob@work", "read", 1)).unwrap();
                    rec["extra"] = json!(1);
                    let sig = f
                        .work
                        .host_key
                        .sign(canonical::to_string(&rec).unwrap().as_bytes());
                    json!({"rec": rec, "sig": sig})
                },
                "rejected:invalid receipt",
            ),
            // Extra key next to rec and sig.
            (
                {
                    let mut w = good.clone();
                    w["more"] = json!("x");
                    w
                },
                "rejected:invalid receipt",
            ),
            // A signature text over 200 characters.
            (
                {
                    let mut w = good.clone();
                    w["sig"] = json!("A".repeat(201));
                    w
                },
                "rejected:invalid receipt",
            ),
            (
                wire(&receipt("bob@work", "opened", 1), &f.work),
                "rejected:invalid receipt",
            ),
            (
                wire(&receipt("bob@work", "read", 0), &f.work),
                "rejected:invalid receipt",
            ),
            (json!("not an object"), "rejected:invalid receipt"),
            // Over the LAN from work, about a recipient on lab.
            (
                wire(&receipt("bob@lab", "read", 1), &f.lab),
                "rejected:receipt for bob@lab did not come from lab",
            ),
            // Signed by another key than work's pinned one.
            (
                wire(&receipt("bob@work", "read", 1), &f.lab),
                "rejected:bad signature",
            ),
            // A message this host never sent.
            (
                {
                    let mut r = receipt("bob@work", "read", 1);
                    r.msg = "01KDVDNA3VG2MH8KWSQRCWJZ0X".into();
                    wire(&r, &f.work)
                },
                "rejected:not a message this host sent",
            ),
        ];
        for (w, want) in cases {
            assert_eq!(lan(&f, &w), want, "{w}");
        }
        // Not a paired host (over the relay, where no hop host is compared first).
        let stranger = testutil::identity("mars");
        let w = wire(&receipt("bob@mars", "read", 1), &stranger);
        let got =
            f.s.mailbox
                .with(|c| {
                    accept(
                        c,
                        "home",
                        &w,
                        None,
                        Some(&stranger.host_key.public().to_b64()),
                        T0,
                    )
                })
                .unwrap();
        assert_eq!(got, "rejected:mars is not a paired host");
        // Lab is paired but the message did not go there.
        let w = wire(&receipt("bob@lab", "read", 1), &f.lab);
        let got =
            f.s.mailbox
                .with(|c| {
                    accept(
                        c,
                        "home",
                        &w,
                        None,
                        Some(&f.lab.host_key.public().to_b64()),
                        T0,
                    )
                })
                .unwrap();
        assert_eq!(got, "rejected:message was not sent to lab");
        // From the relay, pushed by another key than the recipient host's.
        let got =
            f.s.mailbox
                .with(|c| {
                    accept(
                        c,
                        "home",
                        &good,
                        None,
                        Some(&f.lab.host_key.public().to_b64()),
                        T0,
                    )
                })
                .unwrap();
        assert_eq!(got, "rejected:receipt for bob@work did not come from work");
        // A message received from a peer is not one this host sent.
        let their = "01KDVDND1K20BQNR5GAFG5HETT";
        let sealed = testutil::sealed_wire(
            &f.work,
            &f.me.enc_key.public(),
            their,
            "ann@work",
            &["alice@home"],
            "s",
            T0,
        );
        let pk = f.work.host_key.public().to_b64();
        f.s.mailbox
            .with(|c| {
                crate::node::receive::receive_sealed(c, &f.me, &sealed, their, &pk, T0)
                    .map(|v| assert!(v.is_ok()))
            })
            .unwrap();
        let mut r = receipt("bob@work", "read", 1);
        r.msg = their.into();
        assert_eq!(
            lan(&f, &wire(&r, &f.work)),
            "rejected:not a message this host sent"
        );
        assert_eq!(f.s.scalar::<i64>("SELECT COUNT(*) FROM remote_receipts"), 0);
        let state: String = f.s.scalar("SELECT state FROM outbox");
        assert_eq!(state, "pending", "nothing settled");
    }

    #[test]
    fn at_most_200_recipients_per_host_and_message() {
        let f = fx();
        f.s.mailbox
            .with(|c| {
                for i in 0..200 {
                    c.execute(
                        "INSERT INTO remote_receipts(msg_id, recipient, host, state, at, seq, record, sig, received_at)
                         VALUES (?1, ?2, 'work', 'delivered', 't', 1, '{}', 's', 0)",
                        rusqlite::params![ID, format!("a{i:03}@work")],
                    )?;
                }
                Ok(())
            })
            .unwrap();
        let w = wire(&receipt("bob@work", "read", 1), &f.work);
        assert_eq!(lan(&f, &w), "rejected:too many recipients for one message");
        // A known recipient still updates.
        let w = wire(&receipt("a000@work", "read", 2), &f.work);
        assert_eq!(lan(&f, &w), "accepted");
    }

    #[test]
    fn a_receipt_settles_a_pending_or_relay_accepted_row_once() {
        let f = fx();
        f.s.mailbox
            .with(|c| {
                c.execute(
                    "UPDATE outbox SET state = 'relay-accepted', accepted_at = 1, via = 'relay'",
                    [],
                )?;
                Ok(())
            })
            .unwrap();
        let w = wire(&receipt("bob@work", "delivered", 3), &f.work);
        let relay_sender = f.work.host_key.public().to_b64();
        let got =
            f.s.mailbox
                .with(|c| accept(c, "home", &w, None, Some(&relay_sender), T0 + 9))
                .unwrap();
        assert_eq!(got, "accepted");
        let (state, via, settled): (String, String, i64) =
            f.s.fresh_conn()
                .query_row("SELECT state, via, settled_at FROM outbox", [], |r| {
                    Ok((r.get(0)?, r.get(1)?, r.get(2)?))
                })
                .unwrap();
        assert_eq!(
            (state.as_str(), via.as_str(), settled),
            ("delivered", "relay", T0 + 9)
        );
        // A pending row a receipt confirms (its LAN answer was lost) is delivered too.
        let f = fx();
        let w = wire(&receipt("carol@work", "acked", 1), &f.work);
        assert_eq!(lan(&f, &w), "accepted");
        let (state, via): (String, String) =
            f.s.fresh_conn()
                .query_row("SELECT state, via FROM outbox", [], |r| {
                    Ok((r.get(0)?, r.get(1)?))
                })
                .unwrap();
        assert_eq!((state.as_str(), via.as_str()), ("delivered", "receipt"));
        // A rejected row stays rejected.
        let f = fx();
        f.s.mailbox
            .with(|c| {
                c.execute("UPDATE outbox SET state = 'rejected'", [])?;
                Ok(())
            })
            .unwrap();
        assert_eq!(
            lan(&f, &wire(&receipt("bob@work", "read", 1), &f.work)),
            "accepted"
        );
        assert_eq!(f.s.scalar::<String>("SELECT state FROM outbox"), "rejected");
    }

    #[test]
    fn a_retired_key_signs_receipts_only_up_to_15_days_after_the_rotation() {
        let f = fx();
        let new = testutil::identity("work");
        let pk = |i: &Identity| i.host_key.public().to_b64();
        f.s.mailbox
            .with(|c| {
                peers::rotate(
                    c,
                    "work",
                    &pk(&f.work),
                    &pk(&new),
                    &new.enc_key.public().to_b64(),
                    Some(T0),
                    T0,
                )
            })
            .unwrap()
            .unwrap();
        let last_ok = T0 + peers::RETIRED_KEY_GRACE_MS;
        let now = last_ok + 1_000;
        let dated = |recipient: &str, seq: u64, at: i64, key: &Identity| {
            let mut rec = receipt(recipient, "delivered", seq);
            rec.at = agentmbx_protocol::time::iso_ms(at);
            wire(&rec, key)
        };
        let relay = |w: &Value, sender: &str| {
            f.s.mailbox
                .with(|c| accept(c, "home", w, None, Some(sender), now))
                .unwrap()
        };
        let old = pk(&f.work);
        assert_eq!(
            relay(&dated("bob@work", 1, last_ok, &f.work), &old),
            "accepted"
        );
        let refused = relay(&dated("carol@work", 1, last_ok + 1, &f.work), &old);
        assert_eq!(
            refused,
            format!(
                "rejected:signed by a key work retired at {}: not valid for a receipt dated after {}",
                agentmbx_protocol::time::iso_ms(T0),
                agentmbx_protocol::time::iso_ms(last_ok)
            )
        );
        assert_eq!(stored(&f, "carol@work"), None, "nothing stored");
        // Signed by the new key, the same record is taken.
        assert_eq!(
            relay(&dated("carol@work", 1, last_ok + 1, &new), &pk(&new)),
            "accepted"
        );
    }
}
