//! The outbound step: the wire bytes of what this host sends, made once per target and handed
//! to the store to keep (`wire.md` Decision 4: the same bytes serve the LAN and the relay, on
//! every retry; the relay's dedup is byte-exact).
//!
//! - Mail: [`seal_once`] seals an outbox row's stored plain envelope for its target host's enc
//!   key and signs the outer envelope with this host's key, then persists the bytes with
//!   [`outbox::set_wire`].
//! - Receipts: [`receipt_wire_once`] signs a queued receipt's record with this host's key, then
//!   persists the bytes with [`receipts::set_wire`].
//!
//! It also holds most of what a transport does with the store after an attempt, each one named
//! step in one transaction (the transaction boundaries are the ones the crash drills test):
//!
//! - LAN: [`settle_lan_batch`] (the peer's verdict per row of one batch), [`fail_lan_rows`]
//!   (a failed call: a LAN failure for each row, the 72 h rule with its alert),
//!   [`give_up_stale`] (the 72 h sweep of the rows no transport is trying),
//!   [`settle_lan_receipts`] (a peer answered a receipt flush) and [`fail_lan_receipts`] (a
//!   receipt flush failed).
//! - Relay: [`settle_relay_accept`] (a verified accept of one row), [`fail_relay_row`] (a push
//!   of one row not accepted: backoff, `rejected` or the 72 h rule with its alert, or the
//!   hand-back to the LAN), [`settle_receipt_push`] (what the relay answered for a batch of
//!   receipts) and [`fail_receipt_push`] (a receipt push failed as a whole).
//!
//! One relay step is one statement per receipt and runs without an explicit transaction, as it
//! always has: [`fail_receipt_push`] (one `UPDATE` per receipt, each its own autocommit). The LAN delivery (`transport::lan::deliver`) and the
//! relay push (`transport::relay_client::push`) open no store transaction themselves: they call
//! these steps (and, for the relay's enc-key rollback guard,
//! `crate::transport::relay_client::state::accept_enc_ad`). Transactions still opened under
//! `crate::transport` are not about outbound mail: presence and hop bookkeeping, the relay
//! session's standing, epoch, key rotation and allowlist state, and unpairing.
//!
//! Sealing and signing run in the caller's connection; the steps open their own transaction on
//! it. None touches the network. The crypto lives here; the store (`crate::mailbox`) only keeps
//! bytes, and a transport only carries them.

use rusqlite::{Connection, OptionalExtension};

use agentmbx_protocol::envelope::Envelope;
use agentmbx_protocol::keys::{EncPublicKey, HostKey};
use agentmbx_protocol::{hash, seal};

use super::alert;
use crate::identity::Identity;
use crate::mailbox::lan_memory::{self, DownReason};
use crate::mailbox::{outbox, receipts, MailboxError};

/// The wire bytes of outbox row `row`: the row's own when it already has them (nothing is
/// sealed then), else its message's stored envelope sealed for `enc_pub` (the target host's
/// enc key) and signed by `own_host` with `host_key`, persisted once ([`outbox::set_wire`]:
/// the first bytes written win). Errors: [`MailboxError::NotFound`] (no such row or message),
/// [`MailboxError::Invalid`] (the stored envelope cannot be parsed or sealed), storage faults.
pub fn seal_once(
    conn: &Connection,
    row: &outbox::Row,
    enc_pub: &EncPublicKey,
    own_host: &str,
    host_key: &HostKey,
) -> Result<Vec<u8>, MailboxError> {
    if let Some(w) = &row.wire {
        return Ok(w.clone());
    }
    let stored = outbox::plain_envelope(conn, &row.msg_id)?;
    let plain: Envelope = serde_json::from_str(&stored)
        .map_err(|e| MailboxError::Invalid(format!("stored envelope {}: {e}", row.msg_id)))?;
    let sealed = seal::seal_envelope(&plain, enc_pub, own_host, host_key)
        .map_err(|e| MailboxError::Invalid(format!("cannot seal {}: {e}", row.msg_id)))?;
    let wire = sealed.wire_json().into_bytes();
    let wire_hash = hash::sha256_hex(&wire);
    outbox::set_wire(conn, &row.msg_id, &row.host, &wire, &wire_hash)
}

/// The signed wire `canonical({rec, sig})` of queued receipt `row`: the row's own when it
/// already has them, else its record ([`receipts::record`], from `own_host`) signed with
/// `key`, persisted once ([`receipts::set_wire`]) and reused byte for byte after. Errors: the
/// row is gone ([`MailboxError::NotFound`]), the record cannot be serialized
/// ([`MailboxError::Invalid`]), storage faults.
pub fn receipt_wire_once(
    conn: &Connection,
    row: &receipts::Row,
    own_host: &str,
    key: &HostKey,
) -> Result<Vec<u8>, MailboxError> {
    if let Some(w) = &row.wire {
        return Ok(w.clone());
    }
    let wire = receipts::record(row, own_host)
        .wire(key)
        .map_err(|e| MailboxError::Invalid(format!("receipt {}: {e}", row.seq)))?;
    receipts::set_wire(conn, row.seq, wire.as_bytes())
}

/// What [`settle_lan_batch`] did with one batch.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct LanSettled {
    /// Rows the peer accepted (or already had): `delivered` via `lan`.
    pub delivered: usize,
    /// Rows the peer refused: `rejected` (the sender alerted when the row changed).
    pub rejected: usize,
}

/// The peer's verdicts on one LAN batch to `host`, in one transaction (`wire.md` §4): for each
/// `(msg_id, result)`, `accepted`/`duplicate` settles the row `delivered` via `lan`
/// ([`outbox::delivered_lan`]); anything else (`rejected:<why>`, or the missing-result text)
/// ends it `rejected` with `<why>` ([`outbox::rejected_lan`]) and, when that changed the row,
/// alerts its sender ([`alert::outbox_undelivered`]). Errors: storage faults (nothing is
/// committed then).
pub fn settle_lan_batch(
    conn: &mut Connection,
    ident: &Identity,
    host: &str,
    results: &[(String, String)],
    now_ms: i64,
) -> Result<LanSettled, MailboxError> {
    let tx = conn.transaction()?;
    let mut counts = LanSettled::default();
    for (msg_id, result) in results {
        if result == "accepted" || result == "duplicate" {
            outbox::delivered_lan(&tx, msg_id, host, now_ms)?;
            counts.delivered += 1;
        } else {
            let why = result.strip_prefix("rejected:").unwrap_or(result);
            if outbox::rejected_lan(&tx, msg_id, host, why, now_ms)? {
                alert::outbox_undelivered(&tx, ident, msg_id, host, why, now_ms)?;
            }
            counts.rejected += 1;
        }
    }
    if counts.delivered > 0 {
        lan_memory::lan_delivered(&tx, host)?;
    }
    tx.commit()?;
    Ok(counts)
}

/// How a failed LAN attempt bears on the per-peer LAN memory ([`lan_memory`], spec §10).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LanVerdict {
    /// The address itself did not answer (refused, no connection or no answer within the LAN
    /// race, no route): one such failure marks the peer (spec §10 "unreachable"). `None`: the
    /// peer answered but the attempt failed (e.g. a 5xx), which marks it only at the second
    /// failed attempt of a row ([`crate::mailbox::lane::LAN_FAILURES_BEFORE_RELAY`]).
    pub down: Option<DownReason>,
    /// A relay is configured: without one nothing is marked (the LAN is the only route).
    pub relay_configured: bool,
    /// The failure is this host's own (sealing failed, a newer enc key ad already pinned), not
    /// the peer's: it never marks the peer, however many rows it hit.
    pub local: bool,
    /// When the first probe of a newly marked address is due (ms, jittered by the caller).
    pub probe_at: i64,
}

/// What [`fail_lan_rows`] did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct LanFailed {
    /// Rows the 72 h rule ended (each alerted).
    pub gave_up: Vec<String>,
    /// The peer was marked LAN down by this failure, and its LAN rows and receipts switched to
    /// the relay ([`lan_memory::mark_down`]).
    pub marked: bool,
}

/// A failed LAN attempt for each row `ids` to `host`, in one transaction
/// ([`outbox::fail_lan`]: backoff and a LAN failure); a row the 72 h rule ends alerts its
/// sender with [`outbox::gave_up_reason`] ([`alert::outbox_undelivered`]). In the same
/// transaction, with a relay configured, the peer is marked LAN down when the address did not
/// answer (`verdict.down`) or one of the rows `ids` reached its second LAN failure (never for a
/// local failure, `verdict.local`), and every row and receipt the
/// LAN was taking for it (the failed ones included) is switched to the relay, due now
/// ([`lan_memory::mark_down`]). Errors: storage faults (nothing is committed then).
pub fn fail_lan_rows(
    conn: &mut Connection,
    ident: &Identity,
    host: &str,
    ids: &[String],
    error: &str,
    verdict: LanVerdict,
    now_ms: i64,
) -> Result<LanFailed, MailboxError> {
    let tx = conn.transaction()?;
    let route = lan_memory::lan_route(&tx, host)?;
    let mut out = LanFailed::default();
    for id in ids {
        if outbox::fail_lan(&tx, id, host, error, now_ms)? == outbox::Failure::GaveUp {
            let why = outbox::gave_up_reason(error);
            alert::outbox_undelivered(&tx, ident, id, host, &why, now_ms)?;
            out.gave_up.push(id.clone());
        }
    }
    if verdict.relay_configured {
        let reason = match verdict.down {
            Some(r) => Some(r),
            None if verdict.local => None,
            None => {
                let mut worst = 0u32;
                for id in ids {
                    let n: Option<u32> = tx
                        .query_row(
                            "SELECT lan_failures FROM outbox
                             WHERE msg_id = ?1 AND host = ?2 AND state IN ('pending', 'repush')",
                            rusqlite::params![id, host],
                            |r| r.get(0),
                        )
                        .optional()?;
                    worst = worst.max(n.unwrap_or(0));
                }
                (worst >= crate::mailbox::lane::LAN_FAILURES_BEFORE_RELAY)
                    .then_some(DownReason::Failed)
            }
        };
        if let Some(reason) = reason {
            out.marked =
                lan_memory::mark_down(&tx, host, reason, now_ms, verdict.probe_at, &route)?;
        }
    }
    tx.commit()?;
    Ok(out)
}

/// A LAN call for rows that was still open when the LAN race gave up on it (the rows were
/// switched to the relay) came back with the peer's verdicts, in one transaction: each
/// `accepted`/`duplicate` settles its row `delivered` (the peer has it; a relay accept is
/// superseded by the peer's own word, as a delivery receipt would), a row the relay had
/// rejected too (noted in `late_lan_verdict`). A late `rejected:<why>` is never applied,
/// whatever the row's state (still `pending` on the relay route, relay-accepted or final): the
/// relay push that is under way may still deliver it. It is kept on the row as
/// `late_lan_verdict` (shown by `agentmbx sent`) and returned for a log line. Returns the rows
/// whose late verdict disagreed with the row's own settlement. Errors: storage
/// faults (nothing is committed then).
pub fn settle_late_lan_batch(
    conn: &mut Connection,
    _ident: &Identity,
    host: &str,
    results: &[(String, String)],
    now_ms: i64,
) -> Result<Vec<(String, String)>, MailboxError> {
    let tx = conn.transaction()?;
    let mut disagreed = Vec::new();
    for (msg_id, result) in results {
        if result == "accepted" || result == "duplicate" {
            if !outbox::delivered_lan(&tx, msg_id, host, now_ms)? {
                // A row the relay (not the peer) refused: the peer has it after all.
                let n = tx.execute(
                    "UPDATE outbox SET state = 'delivered', via = 'lan', settled_at = ?3,
                       last_error = NULL, wire = NULL,
                       late_lan_verdict = 'delivered over the LAN after the relay refused it'
                     WHERE msg_id = ?1 AND host = ?2 AND state = 'rejected'
                       AND COALESCE(via, '') <> 'lan'",
                    rusqlite::params![msg_id, host, now_ms],
                )?;
                if n == 1 {
                    disagreed.push((msg_id.clone(), result.clone()));
                }
            }
            continue;
        }
        let n = tx.execute(
            "UPDATE outbox SET late_lan_verdict = ?3 WHERE msg_id = ?1 AND host = ?2",
            rusqlite::params![msg_id, host, outbox::cut_error(result)],
        )?;
        if n == 1 {
            disagreed.push((msg_id.clone(), result.clone()));
        }
    }
    tx.commit()?;
    Ok(disagreed)
}

/// One batch of the 72 h sweep (`wire.md` §4 "Outbox client"), in one transaction: at most
/// [`outbox::GIVE_UP_BATCH`] `pending` rows no relay ever accepted and older than 72 h end
/// `undelivered` ([`outbox::give_up_stale`]), each alerting its sender with the stored reason
/// ([`alert::outbox_undelivered`]). Returns the rows ended (a full batch: call again). Errors:
/// storage faults (nothing is committed then).
pub fn give_up_stale(
    conn: &mut Connection,
    ident: &Identity,
    now_ms: i64,
) -> Result<Vec<outbox::GaveUp>, MailboxError> {
    let tx = conn.transaction()?;
    let ended = outbox::give_up_stale(&tx, now_ms, outbox::GIVE_UP_BATCH)?;
    for g in &ended {
        alert::outbox_undelivered(&tx, ident, &g.msg_id, &g.host, &g.reason, now_ms)?;
    }
    tx.commit()?;
    Ok(ended)
}

/// The receipts `seqs` a LAN peer answered (`POST /v1/receipts` returned, whatever each
/// result said: receipts are advisory) leave the queue ([`receipts::sent`]), in one
/// transaction. Errors: storage faults (nothing is committed then).
pub fn settle_lan_receipts(conn: &mut Connection, seqs: &[i64]) -> Result<(), MailboxError> {
    let tx = conn.transaction()?;
    receipts::sent(&tx, seqs)?;
    tx.commit()?;
    Ok(())
}

/// A failed LAN receipt flush: each of `seqs` is backed off with `error` as a LAN failure
/// ([`receipts::fail`]; `unsupported`: the peer answered 404/405/501, so it has no receipt
/// route and the next attempt waits 1 h), in one transaction. Receipts follow the rule of mail
/// ([`fail_lan_rows`]): with a relay configured, an address that did not answer
/// (`verdict.down`) marks the peer LAN down in the same transaction and switches what the LAN
/// was taking for it to the relay, due now. Returns whether the peer was marked. Errors:
/// storage faults (nothing is committed then).
pub fn fail_lan_receipts(
    conn: &mut Connection,
    host: &str,
    seqs: &[i64],
    error: &str,
    unsupported: bool,
    verdict: LanVerdict,
    now_ms: i64,
) -> Result<bool, MailboxError> {
    let tx = conn.transaction()?;
    let route = lan_memory::lan_route(&tx, host)?;
    receipts::fail(&tx, seqs, error, true, unsupported, now_ms)?;
    let mut marked = false;
    if verdict.relay_configured {
        if let Some(reason) = verdict.down {
            marked = lan_memory::mark_down(&tx, host, reason, now_ms, verdict.probe_at, &route)?;
        }
    }
    tx.commit()?;
    Ok(marked)
}

/// A verified relay accept of row `msg_id` → `host` ([`outbox::settle_accepted`]: the row is
/// `relay-accepted` with the relay, epoch, seq, accept record and signature of `a`, keeping a
/// first accept time and deadline), and a recorded `target not enrolled` refusal for the
/// peer no longer holds ([`lan_memory::relay_reaches`]), in one transaction. Returns whether
/// the row changed (false: it was no longer `pending` or `repush`). Errors: storage faults
/// (nothing is committed then).
pub fn settle_relay_accept(
    conn: &mut Connection,
    msg_id: &str,
    host: &str,
    a: &outbox::Accepted<'_>,
    now_ms: i64,
) -> Result<bool, MailboxError> {
    let tx = conn.transaction()?;
    let changed = outbox::settle_accepted(&tx, msg_id, host, a, now_ms)?;
    if changed {
        lan_memory::relay_reaches(&tx, host)?;
    }
    tx.commit()?;
    Ok(changed)
}

/// A receipt push the relay did not answer (a network or server error): each of `seqs` is
/// backed off with `error` ([`receipts::fail`], not a LAN failure). No explicit transaction:
/// each receipt's update commits on its own. Errors: storage faults.
pub fn fail_receipt_push(
    conn: &Connection,
    seqs: &[i64],
    error: &str,
    now_ms: i64,
) -> Result<(), MailboxError> {
    receipts::fail(conn, seqs, error, false, false, now_ms)
}

/// What [`fail_relay_row`] did to its row.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RelayFailed {
    /// What [`outbox::fail`] did.
    pub failure: outbox::Failure,
    /// The LAN takes the next attempt ([`outbox::back_to_lan`] changed the row).
    pub handed_back: bool,
    /// Rows retargeted to the peer's pinned key ([`outbox::follow_rotations`]).
    pub retargeted: usize,
}

/// A push of row `msg_id` → `host` the relay did not accept, in one transaction
/// ([`outbox::fail`]): `terminal` ends a `pending` row `rejected` with an alert
/// ([`alert::undelivered`]); the 72 h rule ends it `undelivered` with an alert
/// ([`alert::outbox_undelivered`], [`outbox::gave_up_reason`]); a retried row with `to_lan`
/// (the relay cannot reach its target, `crate::transport::select::relay_cannot_reach`) is
/// retargeted if its peer rotated away from its key ([`outbox::follow_rotations`]) and handed
/// back to the LAN ([`outbox::back_to_lan`]); the refusal is recorded for the peer's key and a
/// LAN mark of the peer is lifted ([`lan_memory::relay_cannot_reach`]: no relay route, so the
/// LAN keeps the peer's mail). Errors: storage faults (nothing is committed then).
#[allow(clippy::too_many_arguments)]
pub fn fail_relay_row(
    conn: &mut Connection,
    ident: &Identity,
    msg_id: &str,
    host: &str,
    error: &str,
    terminal: bool,
    to_lan: bool,
    now_ms: i64,
) -> Result<RelayFailed, MailboxError> {
    let tx = conn.transaction()?;
    let failure = outbox::fail(&tx, msg_id, host, error, terminal, now_ms)?;
    let (mut handed_back, mut retargeted) = (false, 0);
    match failure {
        outbox::Failure::Rejected => {
            alert::undelivered(&tx, ident, msg_id, host, error, now_ms)?;
        }
        outbox::Failure::GaveUp => {
            let why = outbox::gave_up_reason(error);
            alert::outbox_undelivered(&tx, ident, msg_id, host, &why, now_ms)?;
        }
        outbox::Failure::Retry if to_lan => {
            let target: Option<String> = tx
                .query_row(
                    "SELECT target_pubkey FROM outbox WHERE msg_id = ?1 AND host = ?2",
                    rusqlite::params![msg_id, host],
                    |r| r.get(0),
                )
                .optional()?;
            if let Some(target) = target {
                lan_memory::relay_cannot_reach(&tx, host, &target)?;
            }
            retargeted = outbox::follow_rotations(&tx, Some(msg_id), now_ms)?;
            handed_back = outbox::back_to_lan(&tx, msg_id, host)?;
        }
        outbox::Failure::Retry | outbox::Failure::Gone => {}
    }
    tx.commit()?;
    Ok(RelayFailed {
        failure,
        handed_back,
        retargeted,
    })
}

/// What the relay answered for one batch of receipts, in one transaction: the accepted
/// (`done`) and the refused-for-good (`dropped`) leave the queue ([`receipts::sent`]); each of
/// `failed` (`(seq, why)`) is backed off ([`receipts::fail`], not a LAN failure). Errors:
/// storage faults (nothing is committed then).
pub fn settle_receipt_push(
    conn: &mut Connection,
    done: &[i64],
    dropped: &[i64],
    failed: &[(i64, String)],
    now_ms: i64,
) -> Result<(), MailboxError> {
    let tx = conn.transaction()?;
    receipts::sent(&tx, done)?;
    receipts::sent(&tx, dropped)?;
    for (seq, why) in failed {
        receipts::fail(&tx, &[*seq], why, false, false, now_ms)?;
    }
    tx.commit()?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use agentmbx_protocol::envelope::Envelope;
    use agentmbx_protocol::seal;

    use super::receipt_wire_once as wire_once;
    use super::seal_once;
    use crate::mailbox::receipts::{due_for_relay, expire, fail, sent, RECEIPT_TTL_MS};
    use crate::mailbox::{messages, outbox};
    use crate::testutil::{self, T0};

    const ID: &str = "01KDVDNA3VG2MH8KWSQRCWJZ0S";

    #[test]
    fn an_outbox_row_is_sealed_once_for_its_targets_enc_key() {
        let s = testutil::store();
        let me = testutil::identity("home");
        let work = testutil::identity("work");
        s.add_peer(&work, true);
        s.send(&me, "alice", &["bob@work"], "hi", ID, T0).unwrap();
        let enc_pub = work.enc_key.public();
        s.mailbox
            .with(|c| {
                let row = outbox::get(c, ID, "work")?.expect("the outbox row");
                assert!(row.wire.is_none());
                let first = seal_once(c, &row, &enc_pub, "home", &me.host_key)?;
                // Sealed once: a second call, with the row as it was or as stored now, returns
                // the same bytes.
                assert_eq!(seal_once(c, &row, &enc_pub, "home", &me.host_key)?, first);
                let stored = outbox::get(c, ID, "work")?.expect("the outbox row");
                assert_eq!(stored.wire.as_deref(), Some(first.as_slice()));
                assert_eq!(
                    seal_once(c, &stored, &enc_pub, "home", &me.host_key)?,
                    first
                );
                // The bytes open with the target's enc key.
                let env: Envelope = serde_json::from_slice(&first).expect("an envelope");
                let enc = env.enc.as_ref().expect("a sealed body");
                assert_eq!(
                    seal::open(enc, &work.enc_key, ID).expect("opens"),
                    "body of hi"
                );
                Ok(())
            })
            .unwrap();
    }

    #[test]
    fn deliveries_of_mail_from_peers_queue_receipts_and_the_wire_is_made_once() {
        let s = testutil::store();
        let me = testutil::identity("home");
        s.register("home", &["bob"]);
        let work = testutil::identity("work");
        s.add_peer(&work, true);
        s.register("home", &["bob"]);
        let wire = testutil::sealed_wire(
            &work,
            &me.enc_key.public(),
            ID,
            "ann@work",
            &["bob@home"],
            "s",
            T0,
        );
        let pk = work.host_key.public().to_b64();
        s.mailbox
            .with(|c| {
                let v = crate::node::receive::receive_sealed(c, &me, &wire, ID, &pk, T0)?;
                assert!(v.is_ok());
                messages::read(c, "bob", "home", ID, T0 + 1)?;
                messages::ack(c, "bob", &[ID.to_string()], Some("done"), T0 + 2)?;
                Ok(())
            })
            .unwrap();
        // Local mail queues nothing.
        s.send(
            &me,
            "carol",
            &["bob"],
            "local",
            "01KDVDNA3VG2MH8KWSQRCWJZ0T",
            T0,
        )
        .unwrap();
        let rows = s.mailbox.with(|c| due_for_relay(c, T0 + 2, 10)).unwrap();
        let states: Vec<(&str, Option<&str>, i64)> = rows
            .iter()
            .map(|r| (r.state.as_str(), r.note.as_deref(), r.at))
            .collect();
        assert_eq!(
            states,
            vec![
                ("delivered", None, T0),
                ("read", None, T0 + 1),
                ("acked", Some("done"), T0 + 2)
            ]
        );
        assert!(rows
            .iter()
            .all(|r| r.target_pubkey.as_deref() == Some(pk.as_str())));
        let key = me.host_key.clone();
        s.mailbox
            .with(|c| {
                let first = wire_once(c, &rows[2], "home", &key)?;
                // Made once: the stored bytes come back, whatever the row says now.
                c.execute("UPDATE receipt_outbox SET note = 'changed'", [])?;
                let again = due_for_relay(c, T0 + 2, 10)?;
                assert_eq!(again[2].wire.as_deref(), Some(first.as_slice()));
                assert_eq!(wire_once(c, &again[2], "home", &key)?, first);
                // Failures back off; sent rows leave; expiry drops the rest after 72 h.
                fail(c, &[again[0].seq], "e", true, false, T0 + 2)?;
                let r = &due_for_relay(c, T0 + 2 + outbox::backoff_ms(0), 10)?[0];
                assert_eq!((r.attempts, r.lan_failures), (1, 1));
                assert_eq!(sent(c, &[again[1].seq])?, 1);
                assert_eq!(expire(c, T0 + RECEIPT_TTL_MS)?, 0);
                assert_eq!(expire(c, T0 + RECEIPT_TTL_MS + 3)?, 2);
                assert!(due_for_relay(c, i64::MAX, 10)?.is_empty());
                Ok(())
            })
            .unwrap();
    }
}
