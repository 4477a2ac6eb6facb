//! Accepting a paired host's key rotation (`wire.md` §2.10; spec §2 "Rotation"): the checks of
//! one signed rotation record and the pin update, inside the caller's transaction. Transports
//! only carry the records here (the LAN's `POST /v1/rotate`,
//! `crate::transport::lan::handlers::rotate`) and answer with the result.
//!
//! A record authenticates itself: it is signed by the pinned old key and by the new key
//! ([`SignedRotation::check`]). It is matched by key: the peer pinned to `old_pub` (its name
//! must be `rec.host`, else [`WRONG_HOST`]), or the peer already pinned to `new_pub`
//! (`current`), or a peer named `rec.host` whose retired keys hold both keys (a step of a chain
//! it already took: `current`); anything else is refused with 0.5.x's texts ([`NOT_PAIRED`],
//! `rotation does not start from the pinned host key`, …). A record dated more than 5 minutes
//! ahead of this host's clock, or whose `iat` is not an ISO ms time, is refused
//! ([`SignedRotation::check_time`]), and so is a rotation back to one of the peer's retired
//! keys ([`peers::ROTATION_TO_RETIRED`]: the earlier records are public, and replaying them
//! would flip the pin back and forth), and one to a key pinned as another peer
//! ([`NEW_KEY_TAKEN`]). An accepted record moves the pin, the enc key and the retired keys
//! ([`peers::rotate`]), retargets the mail still waiting for the old key ([`outbox::retarget`])
//! and is audited `peer.rotated` (fingerprints only), all in one transaction.
//!
//! This module never pins a key that did not sign the record, never moves a pin from a key
//! other than the pinned one, and never logs or audits a key, a signature or a record:
//! fingerprints and fixed reasons only. A record refused changes nothing. It never touches the
//! network and never wakes anyone (the caller does, after its commit).

use rusqlite::{Connection, TransactionBehavior};
use serde_json::{json, Value};

use agentmbx_protocol::keys::PublicKey;
use agentmbx_protocol::rotation::{RotateResult, RotationError, SignedRotation};

use crate::mailbox::peers::{self, Rotated};
use crate::mailbox::{audit, outbox, MailboxError};

/// Refusal of a record whose host is not a peer here (0.5.x).
pub const NOT_PAIRED: &str = "host not paired";
/// Refusal of a record whose old key is pinned under another name than `rec.host`.
pub const WRONG_HOST: &str = "rotation names another host than the one its key is pinned for";
/// Refusal of a record whose new key is already pinned as another peer.
pub const NEW_KEY_TAKEN: &str = "the new host key is already pinned as another peer";

/// What one rotation record came to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Outcome {
    /// The answer for the record.
    pub result: RotateResult,
    /// The pin that moved, when the record was `rotated`.
    pub rotated: Option<Rotated>,
    /// Outbox rows moved to the new key.
    pub retargeted: usize,
}

impl Outcome {
    fn refused(why: impl Into<String>) -> Self {
        Outcome {
            result: RotateResult::Rejected(why.into()),
            rotated: None,
            retargeted: 0,
        }
    }

    fn current() -> Self {
        Outcome {
            result: RotateResult::Current,
            rotated: None,
            retargeted: 0,
        }
    }
}

/// Checks and applies one announced record inside the caller's transaction (module docs: the
/// matching rules). `rotated` moved the pin of `rec.host` to `new_pub`, set its enc key to
/// `new_enc_pub`, appended `old_pub` to its retired keys, retargeted its waiting outbox rows
/// and audited `peer.rotated`; `current` and `rejected:<why>` changed nothing. Errors: storage
/// faults only.
pub fn accept_record(
    conn: &Connection,
    record: &Value,
    now_ms: i64,
) -> Result<Outcome, MailboxError> {
    let not_a_record = || Outcome::refused(RotationError::NotARecord.to_string());
    let Ok(signed) = SignedRotation::from_value(record) else {
        return Ok(not_a_record());
    };
    let rec = &signed.rec;
    // Keys are looked up in their canonical text, as pinned.
    let (Ok(old), Ok(new)) = (
        PublicKey::from_b64(&rec.old_pub),
        PublicKey::from_b64(&rec.new_pub),
    ) else {
        return Ok(not_a_record());
    };
    let Ok(new_enc) = signed.new_enc_key() else {
        return Ok(not_a_record());
    };
    let (old_b64, new_b64) = (old.to_b64(), new.to_b64());

    if let Some(peer) = peers::by_key(conn, &old_b64)? {
        if peer.host != rec.host {
            return Ok(Outcome::refused(WRONG_HOST));
        }
        if let Err(why) = signed.check(&old).and_then(|()| signed.check_time(now_ms)) {
            return Ok(Outcome::refused(why.to_string()));
        }
        if peers::prev_keys(conn, &peer.host)?.contains(&new_b64) {
            // Its earlier records are public: anyone could replay them to flip the pin back.
            return Ok(Outcome::refused(peers::ROTATION_TO_RETIRED));
        }
        let iat = agentmbx_protocol::time::parse_iso_ms(&rec.iat);
        let moved = match peers::rotate(
            conn,
            &peer.host,
            &old_b64,
            &new_b64,
            &new_enc.to_b64(),
            iat,
            now_ms,
        ) {
            Ok(Some(moved)) => moved,
            // The pin changed between the lookup and the update: not from the pinned key.
            Ok(None) => return Ok(Outcome::refused(RotationError::NotFromPinned.to_string())),
            Err(MailboxError::Conflict(_)) => return Ok(Outcome::refused(NEW_KEY_TAKEN)),
            Err(e) => return Err(e),
        };
        let retargeted = outbox::retarget(conn, &peer.host, &old_b64, &new_b64, now_ms)?;
        audit::record(
            conn,
            now_ms,
            "peer.rotated",
            &json!({
                "host": peer.host,
                "from": old.fingerprint(),
                "to": new.fingerprint(),
                "outbox_retargeted": retargeted,
            }),
        )?;
        return Ok(Outcome {
            result: RotateResult::Rotated,
            rotated: Some(moved),
            retargeted,
        });
    }
    if peers::by_key(conn, &new_b64)?.is_some_and(|p| p.host == rec.host) {
        return Ok(Outcome::current());
    }
    let Some(peer) = peers::by_name(conn, &rec.host)? else {
        return Ok(Outcome::refused(NOT_PAIRED));
    };
    let retired = peers::prev_keys(conn, &peer.host)?;
    if retired.contains(&old_b64) && retired.contains(&new_b64) {
        // An earlier step of a chain of rotations this host already followed.
        return Ok(Outcome::current());
    }
    let why = match PublicKey::from_b64(&peer.pubkey) {
        Ok(pinned) => match signed.check(&pinned) {
            Err(why) => why,
            Ok(()) => RotationError::NotFromPinned,
        },
        Err(_) => RotationError::NotFromPinned,
    };
    Ok(Outcome::refused(why.to_string()))
}

/// Accepts `records` in order at `now_ms`, each in its own `IMMEDIATE` transaction, committed
/// only when the record moved a pin (`rotated`; [`accept_record`]). Returns one outcome per
/// record, in order. Errors: storage faults (records before it stay accepted).
pub fn accept_records(
    conn: &mut Connection,
    records: &[Value],
    now_ms: i64,
) -> Result<Vec<Outcome>, MailboxError> {
    let mut out = Vec::with_capacity(records.len());
    for record in records {
        let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate)?;
        let outcome = accept_record(&tx, record, now_ms)?;
        if outcome.rotated.is_some() {
            tx.commit()?;
        }
        out.push(outcome);
    }
    Ok(out)
}
