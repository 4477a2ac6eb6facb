//! Ending rows a relay accepted by the sender's own rules (spec §3, §6; `wire.md` §3.5
//! "Settle", §2.12 "Expiry notice"):
//!
//! - [`apply_expiry_notice`]: a relay's `kind:"expired"` item, pushed by the pinned relay key,
//!   whose wire is canonical `{notice, sig}` with the notice `{v:1, type:"relay-expired",
//!   item_id, target_pubkey, accepted_at, expired_at}` signed by that key, ends the matching
//!   outbox row `expired` and alerts its sender `Undelivered to <host>: <subject>` (held N
//!   day(s)), in one transaction. The matching row is the one for message `item_id` aimed at
//!   `target_pubkey`, or at another key of the same peer (one it rotated away from, or the one
//!   it rotated to: the relay moves a queue to the new key, `peers.prev_keys`). Only a row that
//!   relay holds is ended: `relay-accepted` or `repush` with `relay` = the relay the notice was
//!   pulled from. A row the host already confirmed stays (or becomes) `delivered`, with no
//!   alert; a row already final (`delivered`, `expired`, `unconfirmed`, `rejected`, ...) makes
//!   the notice a repeat that changes nothing (a re-pull after an epoch change brings the same
//!   notice again; an `unconfirmed` row already gave its sender one alert). A notice naming a
//!   live row (`pending`, or held by another relay) is refused for quarantine
//!   ([`NOT_HELD_BY_RELAY`]): that relay never held this copy, so its word cannot end it, and
//!   the operator sees the claim in `agentmbx relay quarantine`. A notice from another key,
//!   with a bad shape or signature, or naming no row of this host is refused the same way.
//! - [`unconfirm_overdue`]: every `relay-accepted` or `repush` row whose `deadline_at`
//!   (accepted_at + retention + 24 h) has passed ends `unconfirmed`, with the alert
//!   `Undelivered/unconfirmed to <host>: <subject>` in the same transaction, one transaction
//!   per row. The LAN delivery pass runs it ([`settle_pass`]) at least once a minute, with or
//!   without a relay configured.
//!
//! The peer's own word still wins over these alerts: a later delivery receipt or LAN
//! `accepted` settles an `expired` or `unconfirmed` row as `delivered`
//! (`mailbox::outbox::settle_by_receipt`, `mailbox::outbox::delivered_lan`). Ending a row
//! drops its wire bytes (`wire.md` §3.5 "Settle"). This module never talks to the network and
//! never trusts a notice the pinned relay key did not sign.

use std::sync::Arc;

use rusqlite::{Connection, OptionalExtension};
use serde_json::{json, Value};

use agentmbx_protocol::canonical;
use agentmbx_protocol::keys::PublicKey;
use agentmbx_protocol::records::ExpiryNotice;
use agentmbx_protocol::time::parse_iso_ms;

use super::alert;
use crate::identity::Identity;
use crate::mailbox::{audit, outbox, peers, Mailbox, MailboxError};

/// Rows [`unconfirm_overdue`] looks at per call (each ends in its own transaction; the caller
/// repeats while a call finds this many).
pub const UNCONFIRM_BATCH: usize = 200;

/// Longest signature text a notice may carry (characters; an Ed25519 signature is 88).
pub const MAX_NOTICE_SIG: usize = 200;

/// Quarantine reason: the item was not pushed by the pinned relay key.
pub const NOT_FROM_RELAY: &str = "expiry notice not from the pinned relay key";
/// Quarantine reason: the wire is not canonical `{notice, sig}` with a well-formed notice.
pub const BAD_NOTICE: &str = "bad expiry notice";
/// Quarantine reason: the pinned relay key did not sign the notice.
pub const BAD_NOTICE_SIG: &str = "bad expiry notice signature";
/// Quarantine reason: the item id is not `expired:<item_id>:<target_pubkey>` of its notice.
pub const NOTICE_ID_MISMATCH: &str = "item id is not the notice id";
/// Quarantine reason: no outbox row of this host is for that item and target.
pub const NO_ROW: &str = "expiry notice names no outbox row of this host";
/// Quarantine reason: the row the notice names is live but that relay does not hold it (no
/// relay accepted it, or another relay did).
pub const NOT_HELD_BY_RELAY: &str = "expiry notice from a relay that does not hold the row";

/// What a valid expiry notice did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum NoticeOutcome {
    /// The row ended `expired` and its sender was alerted.
    Expired {
        /// Message id.
        msg_id: String,
        /// Target host name.
        host: String,
        /// Whole days the relay held it ([`alert::held_days`]).
        days: i64,
    },
    /// The host had confirmed delivery: the row is `delivered`, nobody alerted.
    Delivered {
        /// Message id.
        msg_id: String,
        /// Target host name.
        host: String,
    },
    /// The row was final already (e.g. `delivered`, `expired`, `unconfirmed`): nothing changed.
    Repeat {
        /// Message id.
        msg_id: String,
        /// Target host name.
        host: String,
        /// Its state, unchanged.
        state: String,
    },
}

/// Checks a notice item's wire (`wire.md` §2.12): canonical `{notice, sig}` exactly, the notice
/// exactly `{v:1, type:"relay-expired", item_id, target_pubkey, accepted_at, expired_at}` with a
/// non-empty item id, a host key as target and ISO times, signed over its canonical JSON by
/// `relay_key`. Returns the notice, or the refusal ([`BAD_NOTICE`], [`BAD_NOTICE_SIG`]).
pub fn verify_notice(wire: &[u8], relay_key: &PublicKey) -> Result<ExpiryNotice, &'static str> {
    let v = canonical::parse(wire).map_err(|_| BAD_NOTICE)?;
    if canonical::to_string(&v).map_err(|_| BAD_NOTICE)?.as_bytes() != wire {
        return Err(BAD_NOTICE);
    }
    let obj = v.as_object().ok_or(BAD_NOTICE)?;
    let (Some(notice_v), Some(sig), 2) = (
        obj.get("notice"),
        obj.get("sig").and_then(Value::as_str),
        obj.len(),
    ) else {
        return Err(BAD_NOTICE);
    };
    if sig.is_empty()
        || sig.len() > MAX_NOTICE_SIG
        || notice_v.as_object().map(|o| o.len()) != Some(6)
    {
        return Err(BAD_NOTICE);
    }
    let notice: ExpiryNotice = serde_json::from_value(notice_v.clone()).map_err(|_| BAD_NOTICE)?;
    let well_formed = notice.v == 1
        && notice.kind == "relay-expired"
        && !notice.item_id.is_empty()
        && notice.item_id.len() <= 300
        && PublicKey::from_b64(&notice.target_pubkey).is_ok()
        && parse_iso_ms(&notice.accepted_at).is_some()
        && parse_iso_ms(&notice.expired_at).is_some();
    if !well_formed {
        return Err(BAD_NOTICE);
    }
    let signed = canonical::to_string(notice_v).map_err(|_| BAD_NOTICE)?;
    if !relay_key.verify(signed.as_bytes(), sig) {
        return Err(BAD_NOTICE_SIG);
    }
    Ok(notice)
}

/// The relay item id of a notice: `expired:<item_id>:<target_pubkey>` (`wire.md` §2.12).
pub fn notice_item_id(notice: &ExpiryNotice) -> String {
    format!("expired:{}:{}", notice.item_id, notice.target_pubkey)
}

/// The outbox row a notice names: the row for message `msg_id` aimed at `target`, or at
/// another key of the peer `target` belongs to (current or retired).
fn matching_row(
    conn: &Connection,
    msg_id: &str,
    target: &str,
) -> Result<Option<outbox::Row>, MailboxError> {
    let mut rows = outbox::for_message(conn, msg_id)?;
    if let Some(i) = rows.iter().position(|r| r.target_pubkey == target) {
        return Ok(Some(rows.swap_remove(i)));
    }
    let Some(peer) = peers::by_any_key(conn, target)? else {
        return Ok(None);
    };
    let mut keys = peers::prev_keys(conn, &peer.host)?;
    keys.push(peer.pubkey.clone());
    Ok(rows
        .into_iter()
        .find(|r| r.host == peer.host && keys.contains(&r.target_pubkey)))
}

/// Whether `row` was last accepted by the relay at `relay_url` (trailing `/` ignored).
fn held_by(row: &outbox::Row, relay_url: &str) -> bool {
    row.relay
        .as_deref()
        .is_some_and(|r| r.trim_end_matches('/') == relay_url.trim_end_matches('/'))
}

/// Whether `host` sent a delivery receipt (any state: all are delivered or later) for `msg_id`.
fn confirmed(conn: &Connection, msg_id: &str, host: &str) -> Result<bool, MailboxError> {
    Ok(conn
        .query_row(
            "SELECT 1 FROM remote_receipts WHERE msg_id = ?1 AND host = ?2 LIMIT 1",
            [msg_id, host],
            |_| Ok(()),
        )
        .optional()?
        .is_some())
}

/// Applies a relay item of kind `expired` (spec §6; module doc), in the caller's transaction:
/// `relay_url` and `relay_key` are the relay it came from and its pinned key, `item_id` and
/// `sender_pubkey` the item's, `wire` its decoded bytes. `Ok(Ok(_))`: the notice was valid (see
/// [`NoticeOutcome`]); `Ok(Err(reason))`: refused, for quarantine ([`NOT_FROM_RELAY`],
/// [`BAD_NOTICE`], [`BAD_NOTICE_SIG`], [`NOTICE_ID_MISMATCH`], [`NO_ROW`],
/// [`NOT_HELD_BY_RELAY`]), nothing changed.
/// An expiry is audited `relay.expired`. Errors: storage faults.
#[allow(clippy::too_many_arguments)]
pub fn apply_expiry_notice(
    conn: &Connection,
    ident: &Identity,
    relay_url: &str,
    relay_key: &PublicKey,
    item_id: &str,
    sender_pubkey: &str,
    wire: &[u8],
    now_ms: i64,
) -> Result<Result<NoticeOutcome, String>, MailboxError> {
    if sender_pubkey != relay_key.to_b64() {
        return Ok(Err(NOT_FROM_RELAY.into()));
    }
    let notice = match verify_notice(wire, relay_key) {
        Ok(n) => n,
        Err(why) => return Ok(Err(why.into())),
    };
    if item_id != notice_item_id(&notice) {
        return Ok(Err(NOTICE_ID_MISMATCH.into()));
    }
    let msg_id = notice.item_id.clone();
    let Some(row) = matching_row(conn, &msg_id, &notice.target_pubkey)? else {
        return Ok(Err(NO_ROW.into()));
    };
    let live = matches!(row.state.as_str(), "repush" | "relay-accepted");
    if row.state == "pending" || (live && !held_by(&row, relay_url)) {
        return Ok(Err(NOT_HELD_BY_RELAY.into()));
    }
    let (host, state) = (row.host, row.state);
    if !live {
        return Ok(Ok(NoticeOutcome::Repeat {
            msg_id,
            host,
            state,
        }));
    }
    // The host's pull raced the sweep: it has the message, so nobody is alarmed.
    if confirmed(conn, &msg_id, &host)? {
        outbox::settle_by_receipt(conn, &msg_id, &host, now_ms)?;
        return Ok(Ok(NoticeOutcome::Delivered { msg_id, host }));
    }
    let (accepted, expired) = (
        parse_iso_ms(&notice.accepted_at).unwrap_or(now_ms),
        parse_iso_ms(&notice.expired_at).unwrap_or(now_ms),
    );
    let days = alert::held_days(accepted, expired);
    let reason = format!("expired by the relay after {days} day(s): {host} never collected it");
    if outbox::expire(conn, &msg_id, &host, relay_url, &reason, now_ms)? {
        alert::relay_expired(
            conn,
            ident,
            &msg_id,
            &host,
            days,
            &notice.accepted_at,
            &notice.expired_at,
            now_ms,
        )?;
        audit::record(
            conn,
            now_ms,
            "relay.expired",
            &json!({"relay": relay_url, "msg": msg_id, "host": host,
                    "accepted_at": notice.accepted_at, "expired_at": notice.expired_at}),
        )?;
    }
    Ok(Ok(NoticeOutcome::Expired { msg_id, host, days }))
}

/// A row [`unconfirm_overdue`] ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Unconfirmed {
    /// Message id.
    pub msg_id: String,
    /// Target host name.
    pub host: String,
    /// Whether any delivery receipt ever came from that host (else the alert says it may run
    /// AgentMBX older than 0.5.3).
    pub ever_confirmed: bool,
}

/// The deadline rule (`wire.md` §3.5 "Settle"): at most `limit` `relay-accepted` or `repush`
/// rows whose `deadline_at` is at or before `now_ms` end `unconfirmed` (`last_error` the
/// alert's reason), each with its alert `Undelivered/unconfirmed to <host>: <subject>`, one
/// transaction per row. Returns the rows it ended. Errors: storage faults.
pub fn unconfirm_overdue(
    conn: &mut Connection,
    ident: &Identity,
    now_ms: i64,
    limit: usize,
) -> Result<Vec<Unconfirmed>, MailboxError> {
    let mut out = Vec::new();
    for row in outbox::overdue(conn, now_ms, limit)? {
        let tx = conn.transaction()?;
        let ever_confirmed = tx
            .query_row(
                "SELECT 1 FROM remote_receipts WHERE host = ?1 LIMIT 1",
                [&row.host],
                |_| Ok(()),
            )
            .optional()?
            .is_some();
        let reason = alert::unconfirmed_reason(ever_confirmed);
        if outbox::unconfirm(&tx, &row.msg_id, &row.host, reason, now_ms)? {
            alert::unconfirmed(&tx, ident, &row.msg_id, &row.host, ever_confirmed, now_ms)?;
            out.push(Unconfirmed {
                msg_id: row.msg_id,
                host: row.host,
                ever_confirmed,
            });
        }
        tx.commit()?;
    }
    Ok(out)
}

/// One settle pass (run by the LAN delivery pass): [`unconfirm_overdue`] in batches of
/// [`UNCONFIRM_BATCH`] until a batch is not full. Returns how many rows ended. Errors: storage
/// faults.
pub async fn settle_pass(
    mailbox: &Mailbox,
    ident: Arc<Identity>,
    now_ms: i64,
) -> Result<usize, MailboxError> {
    let mut total = 0;
    loop {
        let id = ident.clone();
        let ended = mailbox
            .run(move |c| unconfirm_overdue(c, &id, now_ms, UNCONFIRM_BATCH))
            .await?;
        for u in &ended {
            tracing::warn!(id = %u.msg_id, peer = %u.host, ever_confirmed = u.ever_confirmed,
                "Undelivered/unconfirmed to {}: no delivery receipt by the deadline", u.host);
        }
        total += ended.len();
        if ended.len() < UNCONFIRM_BATCH {
            return Ok(total);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use agentmbx_protocol::keys::HostKey;
    use agentmbx_protocol::time::iso_ms;

    use crate::mailbox::outbox::Accepted;
    use crate::testutil::{self, Store, T0};

    const DAY: i64 = 86_400_000;
    const R: &str = "http://127.0.0.1:9";

    struct Fix {
        s: Store,
        me: Identity,
        work: Identity,
        relay: HostKey,
    }

    /// alice@home sent one message to bob@work, accepted by relay `R` at T0 (deadline T0 + 15 d).
    fn fix() -> (Fix, String) {
        let s = testutil::store();
        let me = testutil::identity("home");
        let work = testutil::identity("work");
        s.add_peer(&work, false);
        let id = testutil::ids().next(T0);
        s.send(&me, "alice", &["bob@work"], "report", &id, T0)
            .unwrap();
        s.mailbox
            .with(|c| {
                let a = Accepted {
                    relay: R,
                    epoch: "e1",
                    seq: 5,
                    accept: "{}",
                    sig: "s",
                    accepted_at: T0,
                    deadline_at: T0 + 15 * DAY,
                };
                assert!(outbox::settle_accepted(c, &id, "work", &a, T0)?);
                Ok(())
            })
            .unwrap();
        let relay = HostKey::generate();
        (Fix { s, me, work, relay }, id)
    }

    fn notice_value(item_id: &str, target: &str) -> Value {
        json!({"v": 1, "type": "relay-expired", "item_id": item_id, "target_pubkey": target,
               "accepted_at": iso_ms(T0), "expired_at": iso_ms(T0 + 14 * DAY)})
    }

    /// Canonical `{notice, sig}` with `notice` signed by `signer`.
    fn wire_of(notice: &Value, signer: &HostKey) -> Vec<u8> {
        let sig = signer.sign(canonical::to_string(notice).unwrap().as_bytes());
        canonical::to_string(&json!({"notice": notice, "sig": sig}))
            .unwrap()
            .into_bytes()
    }

    impl Fix {
        fn target(&self) -> String {
            self.work.host_key.public().to_b64()
        }

        /// Applies a notice item in one transaction, as the pull from relay `R` does.
        fn apply(&self, item_id: &str, sender: &str, wire: &[u8]) -> Result<NoticeOutcome, String> {
            self.apply_from(R, item_id, sender, wire)
        }

        /// As [`Fix::apply`], pulled from the relay at `url` (whose key is `self.relay`).
        fn apply_from(
            &self,
            url: &str,
            item_id: &str,
            sender: &str,
            wire: &[u8],
        ) -> Result<NoticeOutcome, String> {
            let relay = self.relay.public();
            self.s
                .mailbox
                .with(|c| {
                    let tx = c.transaction()?;
                    let out = apply_expiry_notice(
                        &tx,
                        &self.me,
                        url,
                        &relay,
                        item_id,
                        sender,
                        wire,
                        T0 + 14 * DAY,
                    )?;
                    tx.commit()?;
                    Ok(out)
                })
                .unwrap()
        }

        fn valid(&self, id: &str) -> (String, Vec<u8>) {
            let n = notice_value(id, &self.target());
            (
                format!("expired:{id}:{}", self.target()),
                wire_of(&n, &self.relay),
            )
        }

        fn state(&self, id: &str) -> String {
            self.s
                .mailbox
                .with(|c| outbox::get(c, id, "work"))
                .unwrap()
                .unwrap()
                .state
        }

        fn alerts(&self) -> Vec<(String, String)> {
            let c = self.s.fresh_conn();
            let mut st = c
                .prepare(
                    "SELECT m.subject, m.body FROM messages m JOIN deliveries d ON d.msg_id = m.id
                     WHERE m.kind = 'alert' AND d.agent = 'alice' ORDER BY m.rowid",
                )
                .unwrap();
            st.query_map([], |r| Ok((r.get(0)?, r.get(1)?)))
                .unwrap()
                .collect::<Result<_, _>>()
                .unwrap()
        }
    }

    #[test]
    fn a_valid_notice_expires_the_row_with_one_alert_and_a_repeat_changes_nothing() {
        let (f, id) = fix();
        let (item_id, wire) = f.valid(&id);
        let relay_pub = f.relay.public().to_b64();
        assert_eq!(
            f.apply(&item_id, &relay_pub, &wire),
            Ok(NoticeOutcome::Expired {
                msg_id: id.clone(),
                host: "work".into(),
                days: 14
            })
        );
        assert_eq!(f.state(&id), "expired");
        let want = (
            "Undelivered to work: report".to_string(),
            format!(
                "Message {id} could not be delivered to host work: the relay held it for 14 day(s) (accepted {}) and work never collected it, so the relay expired it at {}.",
                iso_ms(T0),
                iso_ms(T0 + 14 * DAY)
            ),
        );
        assert_eq!(f.alerts(), vec![want.clone()]);
        let audits =
            f.s.mailbox
                .with(|c| audit::recent(c, Some("relay.expired"), 10))
                .unwrap();
        assert_eq!(audits.len(), 1);
        assert_eq!(audits[0].detail["msg"], id.as_str());
        // The same notice again (a re-pull after an epoch change): nothing changes.
        assert_eq!(
            f.apply(&item_id, &relay_pub, &wire),
            Ok(NoticeOutcome::Repeat {
                msg_id: id.clone(),
                host: "work".into(),
                state: "expired".into()
            })
        );
        assert_eq!(f.alerts(), vec![want]);
    }

    #[test]
    fn a_notice_for_a_delivered_row_alerts_nobody_and_a_confirmed_one_settles() {
        let (f, id) = fix();
        let (item_id, wire) = f.valid(&id);
        let relay_pub = f.relay.public().to_b64();
        // The host's receipt is recorded but the row was not settled yet (its pull raced the
        // sweep): the notice settles it as delivered.
        f.s.mailbox
            .with(|c| {
                c.execute(
                    "INSERT INTO remote_receipts VALUES (?1,'bob@work','work','delivered','t',NULL,NULL,1,'{}','s',1)",
                    [&id],
                )?;
                Ok(())
            })
            .unwrap();
        assert_eq!(
            f.apply(&item_id, &relay_pub, &wire),
            Ok(NoticeOutcome::Delivered {
                msg_id: id.clone(),
                host: "work".into()
            })
        );
        assert_eq!(f.state(&id), "delivered");
        assert_eq!(
            f.apply(&item_id, &relay_pub, &wire),
            Ok(NoticeOutcome::Repeat {
                msg_id: id.clone(),
                host: "work".into(),
                state: "delivered".into()
            })
        );
        assert!(f.alerts().is_empty());
    }

    #[test]
    fn bad_notices_are_refused_with_a_reason_and_change_nothing() {
        let (f, id) = fix();
        let relay_pub = f.relay.public().to_b64();
        let (item_id, good) = f.valid(&id);
        let n = notice_value(&id, &f.target());
        let other = HostKey::generate();
        let sig = f.relay.sign(canonical::to_string(&n).unwrap().as_bytes());
        let mut extra = n.clone();
        extra["note"] = json!("x");
        let mut v2 = n.clone();
        v2["v"] = json!(2);
        let mut bad_time = n.clone();
        bad_time["expired_at"] = json!("yesterday");
        let pretty = serde_json::to_vec_pretty(&json!({"notice": n, "sig": sig})).unwrap();
        let cases: Vec<(&str, String, Vec<u8>, &str)> = vec![
            // Another signer, claiming to be the relay.
            (
                "other signer",
                relay_pub.clone(),
                wire_of(&n, &other),
                BAD_NOTICE_SIG,
            ),
            // Pushed by another key than the pinned relay key (even if well signed).
            (
                "other pusher",
                other.public().to_b64(),
                good.clone(),
                NOT_FROM_RELAY,
            ),
            // A tampered notice: the signature no longer covers it.
            (
                "tampered",
                relay_pub.clone(),
                canonical::to_string(&json!({"notice": notice_value(&id, &relay_pub), "sig": sig}))
                    .unwrap()
                    .into_bytes(),
                BAD_NOTICE_SIG,
            ),
            (
                "extra field",
                relay_pub.clone(),
                wire_of(&extra, &f.relay),
                BAD_NOTICE,
            ),
            ("v2", relay_pub.clone(), wire_of(&v2, &f.relay), BAD_NOTICE),
            (
                "bad time",
                relay_pub.clone(),
                wire_of(&bad_time, &f.relay),
                BAD_NOTICE,
            ),
            ("not canonical", relay_pub.clone(), pretty, BAD_NOTICE),
            ("not json", relay_pub.clone(), b"{".to_vec(), BAD_NOTICE),
            (
                "extra key",
                relay_pub.clone(),
                canonical::to_string(&json!({"notice": n, "sig": sig, "x": 1}))
                    .unwrap()
                    .into_bytes(),
                BAD_NOTICE,
            ),
        ];
        for (what, sender, wire, why) in cases {
            assert_eq!(
                f.apply(&item_id, &sender, &wire),
                Err(why.to_string()),
                "{what}"
            );
        }
        // The item id must be the notice's.
        assert_eq!(
            f.apply(&format!("expired:{id}:x"), &relay_pub, &good),
            Err(NOTICE_ID_MISMATCH.to_string())
        );
        // A valid notice for a message or target this host never sent to.
        let stranger = HostKey::generate().public().to_b64();
        for (msg, target) in [
            ("01KDVDNA3VG2MH8KWSQRCWJZ0Z", f.target()),
            (id.as_str(), stranger),
        ] {
            let w = wire_of(&notice_value(msg, &target), &f.relay);
            assert_eq!(
                f.apply(&format!("expired:{msg}:{target}"), &relay_pub, &w),
                Err(NO_ROW.to_string()),
                "{msg} {target}"
            );
        }
        assert_eq!(f.state(&id), "relay-accepted");
        assert!(f.alerts().is_empty());
    }

    #[test]
    fn only_the_relay_that_holds_a_live_row_can_expire_it() {
        let (f, id) = fix();
        let relay_pub = f.relay.public().to_b64();
        let (item_id, wire) = f.valid(&id);
        // A validly signed notice pulled from another relay than the one that accepted the row.
        for other in ["http://127.0.0.1:10", "http://other.example"] {
            assert_eq!(
                f.apply_from(other, &item_id, &relay_pub, &wire),
                Err(NOT_HELD_BY_RELAY.to_string()),
                "{other}"
            );
        }
        assert_eq!(f.state(&id), "relay-accepted");
        // A row no relay accepted (still pending): no relay's notice ends it.
        let fresh = testutil::ids().next(T0 + 5);
        f.s.send(&f.me, "alice", &["bob@work"], "draft", &fresh, T0)
            .unwrap();
        let (fresh_item, fresh_wire) = f.valid(&fresh);
        assert_eq!(
            f.apply(&fresh_item, &relay_pub, &fresh_wire),
            Err(NOT_HELD_BY_RELAY.to_string())
        );
        assert_eq!(f.state(&fresh), "pending");
        assert!(f.alerts().is_empty());
        // The relay that holds it (the same URL with a trailing `/`) ends a re-push too.
        f.s.mailbox
            .with(|c| outbox::repush_for_epoch(c, R, "e2", outbox::Repush::Epoch, T0))
            .unwrap();
        let out = f.apply_from(&format!("{R}/"), &item_id, &relay_pub, &wire);
        assert!(matches!(out, Ok(NoticeOutcome::Expired { .. })), "{out:?}");
        assert_eq!(f.state(&id), "expired");
        assert_eq!(f.alerts().len(), 1);
        // Final now: another relay's notice is a repeat that changes nothing.
        assert_eq!(
            f.apply_from("http://other.example", &item_id, &relay_pub, &wire),
            Ok(NoticeOutcome::Repeat {
                msg_id: id.clone(),
                host: "work".into(),
                state: "expired".into()
            })
        );
    }

    #[test]
    fn a_notice_for_an_unconfirmed_row_is_a_repeat_with_no_second_alert() {
        let (f, id) = fix();
        let relay_pub = f.relay.public().to_b64();
        let (item_id, wire) = f.valid(&id);
        f.s.mailbox
            .with(|c| {
                assert!(outbox::unconfirm(c, &id, "work", "late", T0 + 15 * DAY)?);
                Ok(())
            })
            .unwrap();
        assert_eq!(
            f.apply(&item_id, &relay_pub, &wire),
            Ok(NoticeOutcome::Repeat {
                msg_id: id.clone(),
                host: "work".into(),
                state: "unconfirmed".into()
            })
        );
        assert_eq!(f.state(&id), "unconfirmed");
        assert!(
            f.alerts().is_empty(),
            "the deadline's alert is the caller's"
        );
    }

    #[test]
    fn a_notice_naming_the_key_the_peer_rotated_to_matches_the_row_for_its_old_key() {
        let (f, id) = fix();
        let old = f.target();
        let new = HostKey::generate().public().to_b64();
        f.s.mailbox
            .with(|c| {
                c.execute(
                    "UPDATE peers SET pubkey = ?1, prev_keys = json_array(?2) WHERE host = 'work'",
                    [&new, &old],
                )?;
                Ok(())
            })
            .unwrap();
        // The relay moved the queue to the new key, so its notice names the new one.
        let w = wire_of(&notice_value(&id, &new), &f.relay);
        let out = f.apply(
            &format!("expired:{id}:{new}"),
            &f.relay.public().to_b64(),
            &w,
        );
        assert!(matches!(out, Ok(NoticeOutcome::Expired { .. })), "{out:?}");
        assert_eq!(f.state(&id), "expired");
        assert_eq!(f.alerts().len(), 1);
    }

    #[tokio::test]
    async fn past_the_deadline_a_row_is_unconfirmed_once_with_the_alert_for_its_peer() {
        let (f, id) = fix();
        // A second host that did send a receipt once (for other mail).
        let lab = testutil::identity("lab");
        f.s.add_peer(&lab, false);
        let id2 = testutil::ids().next(T0 + 1);
        f.s.send(&f.me, "alice", &["bob@lab"], "plan", &id2, T0)
            .unwrap();
        f.s.mailbox
            .with(|c| {
                let a = Accepted {
                    relay: R,
                    epoch: "e1",
                    seq: 6,
                    accept: "{}",
                    sig: "s",
                    accepted_at: T0 + 10,
                    deadline_at: T0 + 15 * DAY + 10,
                };
                assert!(outbox::settle_accepted(c, &id2, "lab", &a, T0)?);
                outbox::repush_for_epoch(c, R, "e2", outbox::Repush::Epoch, T0)?;
                c.execute(
                    "INSERT INTO remote_receipts VALUES ('01KDVDNA3VG2MH8KWSQRCWJZ0Z','bob@lab','lab','read','t',NULL,NULL,1,'{}','s',1)",
                    [],
                )?;
                Ok(())
            })
            .unwrap();
        let ident = Arc::new(f.me.clone());
        let deadline = T0 + 15 * DAY;
        assert_eq!(
            settle_pass(&f.s.mailbox, ident.clone(), deadline - 1)
                .await
                .unwrap(),
            0
        );
        assert!(f.alerts().is_empty());
        assert_eq!(
            settle_pass(&f.s.mailbox, ident.clone(), deadline)
                .await
                .unwrap(),
            1
        );
        assert_eq!(f.state(&id), "unconfirmed");
        assert_eq!(
            settle_pass(&f.s.mailbox, ident.clone(), deadline + 10)
                .await
                .unwrap(),
            1
        );
        assert_eq!(
            settle_pass(&f.s.mailbox, ident, deadline + DAY)
                .await
                .unwrap(),
            0
        );
        let row2 =
            f.s.mailbox
                .with(|c| outbox::get(c, &id2, "lab"))
                .unwrap()
                .unwrap();
        assert_eq!(
            row2.state, "unconfirmed",
            "a re-push ends by its deadline too"
        );
        assert_eq!(
            f.alerts(),
            vec![
                (
                    "Undelivered/unconfirmed to work: report".to_string(),
                    format!("Message {id} to host work: the relay accepted it, but there is no delivery confirmation (the recipient's host may run AgentMBX older than 0.5.3, which sends none).")
                ),
                (
                    "Undelivered/unconfirmed to lab: plan".to_string(),
                    format!("Message {id2} to host lab: the relay accepted it, but the recipient's host never confirmed delivery.")
                ),
            ]
        );
    }
}
