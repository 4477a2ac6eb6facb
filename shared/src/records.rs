//! Signed relay records (`wire.md` §2.8, §2.11, §2.12; spec §3, §6, §8): the relay's accept
//! statement, enc-key advertisements (v2 and v1), the sender allowlist, the T218 delivery
//! receipt, the enrolment statement and the expiry notice.
//!
//! Every record is signed over its canonical JSON *as received*: verification canonicalizes the
//! received object, so an added field breaks the signature (as in 0.5.x).

use serde::{Deserialize, Serialize};
use serde_json::{json, Value};

use crate::canonical::{self, CanonicalError};
use crate::keys::{HostKey, PublicKey};
use crate::limits::utf16_len;

/// One target line of an accept statement.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct AcceptTarget {
    /// Target host key (base64).
    pub host_pubkey: String,
    /// Relay seq allocated for this target (ms-scale integer).
    pub seq: i64,
    /// Lowercase hex SHA-256 of the exact wire bytes stored for this target.
    pub wire_hash: String,
}

/// `{v:1, type:"relay-accept", relay_pubkey, epoch, sender_pubkey, item_id, targets, at}`: the
/// relay's signed statement that it durably committed an item (spec §3). A transport fact, not
/// a delivery.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct AcceptStatement {
    /// Always 1.
    pub v: u8,
    /// Always `"relay-accept"`.
    #[serde(rename = "type")]
    pub kind: String,
    /// The relay key (base64).
    pub relay_pubkey: String,
    /// The store epoch the seqs belong to.
    pub epoch: String,
    /// The pushing host's key (base64).
    pub sender_pubkey: String,
    /// The item id.
    pub item_id: String,
    /// Per target seq and wire hash.
    pub targets: Vec<AcceptTarget>,
    /// ISO ms: when the relay first accepted the item (original time on duplicates).
    pub at: String,
}

impl AcceptStatement {
    /// Canonical JSON of the statement (the signed bytes): the same text as
    /// `canonical::of(self)`, written directly (keys in their UTF-16 order, numbers as
    /// ECMAScript prints them), since the relay signs one statement per accepted item.
    pub fn canonical(&self) -> String {
        let mut out = String::with_capacity(
            160 + self.relay_pubkey.len()
                + self.epoch.len()
                + self.sender_pubkey.len()
                + self.item_id.len()
                + self.at.len()
                + self.kind.len()
                + self
                    .targets
                    .iter()
                    .map(|t| 48 + t.host_pubkey.len() + t.wire_hash.len())
                    .sum::<usize>(),
        );
        out.push_str("{\"at\":");
        canonical::write_string(&mut out, &self.at);
        out.push_str(",\"epoch\":");
        canonical::write_string(&mut out, &self.epoch);
        out.push_str(",\"item_id\":");
        canonical::write_string(&mut out, &self.item_id);
        out.push_str(",\"relay_pubkey\":");
        canonical::write_string(&mut out, &self.relay_pubkey);
        out.push_str(",\"sender_pubkey\":");
        canonical::write_string(&mut out, &self.sender_pubkey);
        out.push_str(",\"targets\":[");
        for (i, t) in self.targets.iter().enumerate() {
            if i > 0 {
                out.push(',');
            }
            out.push_str("{\"host_pubkey\":");
            canonical::write_string(&mut out, &t.host_pubkey);
            out.push_str(",\"seq\":");
            canonical::write_integer(&mut out, t.seq);
            out.push_str(",\"wire_hash\":");
            canonical::write_string(&mut out, &t.wire_hash);
            out.push('}');
        }
        out.push_str("],\"type\":");
        canonical::write_string(&mut out, &self.kind);
        out.push_str(",\"v\":");
        canonical::write_integer(&mut out, i64::from(self.v));
        out.push('}');
        out
    }
    /// Signs with the relay key; returns the base64 signature.
    pub fn sign(&self, relay_key: &HostKey) -> String {
        relay_key.sign(self.canonical().as_bytes())
    }
}

/// Why an accept does not settle an outbox row (spec §3 sender side).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AcceptError {
    /// Missing or malformed accept object.
    #[error("malformed accept receipt")]
    Malformed,
    /// Not signed by the pinned relay key, or names another relay key.
    #[error("accept receipt is not signed by the pinned relay key")]
    BadSignature,
    /// Names another sender or item.
    #[error("accept receipt names another sender or item")]
    WrongItem,
    /// No target line for this row's target with this row's wire hash.
    #[error("accept receipt does not cover this target and wire hash")]
    WrongTarget,
}

/// Verifies a received accept (`accept`, `sig` as JSON) for one outbox row: signed by the
/// pinned `relay_key`, type and relay key right, sender and item id match, and a target line
/// for `target_pubkey` with `wire_hash` and a safe-integer seq. Returns the statement.
pub fn verify_accept(
    accept: &Value,
    sig: &str,
    relay_key: &PublicKey,
    sender_pubkey: &str,
    item_id: &str,
    target_pubkey: &str,
    wire_hash: &str,
) -> Result<AcceptStatement, AcceptError> {
    let st: AcceptStatement =
        serde_json::from_value(accept.clone()).map_err(|_| AcceptError::Malformed)?;
    if st.v != 1 || st.kind != "relay-accept" {
        return Err(AcceptError::Malformed);
    }
    let signed = canonical::to_string(accept).map_err(|_| AcceptError::Malformed)?;
    if st.relay_pubkey != relay_key.to_b64() || !relay_key.verify(signed.as_bytes(), sig) {
        return Err(AcceptError::BadSignature);
    }
    if st.sender_pubkey != sender_pubkey || st.item_id != item_id {
        return Err(AcceptError::WrongItem);
    }
    let ok = st.targets.iter().any(|t| {
        t.host_pubkey == target_pubkey
            && t.wire_hash == wire_hash
            && (1..=MAX_SAFE_INT).contains(&t.seq)
    });
    if !ok {
        return Err(AcceptError::WrongTarget);
    }
    Ok(st)
}

/// JavaScript `Number.MAX_SAFE_INTEGER` (2^53 − 1): every JSON integer stays at or below it.
pub const MAX_SAFE_INT: i64 = (1 << 53) - 1;

// ---- enc-key advertisements -----------------------------------------------------------------

/// TTL of an enc-key ad: 30 days (ms).
pub const ENC_AD_TTL_MS: i64 = 30 * 86_400_000;
/// Maximum lifetime `exp − iat` of an enc-key ad: 90 days (ms).
pub const ENC_AD_MAX_LIFETIME_MS: i64 = 90 * 86_400_000;
/// How far `iat` may be ahead of the verifier's clock: 5 minutes (ms).
pub const FUTURE_SKEW_MS: i64 = 300_000;

/// v2 enc-key ad `{v:2, type:"enc-ad", host, host_pubkey, enc_pub, iat, exp}`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct EncAd {
    /// Always 2.
    pub v: u8,
    /// Always `"enc-ad"`.
    #[serde(rename = "type")]
    pub kind: String,
    /// Host name.
    pub host: String,
    /// Host key (base64) that signs the ad.
    pub host_pubkey: String,
    /// X25519 enc public key (base64).
    pub enc_pub: String,
    /// ISO ms issue time.
    pub iat: String,
    /// ISO ms expiry.
    pub exp: String,
}

impl EncAd {
    /// A fresh ad valid for [`ENC_AD_TTL_MS`] from `now_ms`.
    pub fn new(host: &str, host_pubkey: &PublicKey, enc_pub: &str, now_ms: i64) -> Self {
        EncAd {
            v: 2,
            kind: "enc-ad".into(),
            host: host.into(),
            host_pubkey: host_pubkey.to_b64(),
            enc_pub: enc_pub.into(),
            iat: crate::time::iso_ms(now_ms),
            exp: crate::time::iso_ms(now_ms + ENC_AD_TTL_MS),
        }
    }
    /// The ad as a JSON value (what is posted as `ad`).
    pub fn to_value(&self) -> Value {
        serde_json::to_value(self).unwrap_or(Value::Null)
    }
    /// Signs canonical(ad) with the host key.
    pub fn sign(&self, key: &HostKey) -> String {
        key.sign(canonical::of(self).unwrap_or_default().as_bytes())
    }
}

/// Longest `host` (UTF-16 units) and `iat`/`exp` texts an enc-key ad may carry (0.5.x `checkEncAd`).
const ENC_AD_MAX_HOST: usize = 255;
const ENC_AD_MAX_TIME: usize = 40;

/// Verifies a received v2 ad against the expected host key at `now_ms`. Refusal reasons are
/// 0.5.x's exact strings, checked in 0.5.x's order (`wire.md` §2.8): `unsigned`; `malformed`
/// (shape: v, type, string fields, `enc_pub` a padded 44-character base64 key of 32 bytes, host
/// ≤255, iat/exp ≤40 characters); `wrong peer`; `bad signature` (over canonical(ad) as received,
/// so an added field breaks it); `malformed` again for an `iat`/`exp` that is not an ISO ms time;
/// `not yet valid` (iat more than 5 min ahead); `expired` (exp ≤ now); `lifetime over the
/// maximum` (exp − iat > 90 d). Stricter than 0.5.x only in the time form (`Date#toISOString`
/// exactly, which is what every 0.5.x publisher writes).
pub fn verify_enc_ad(
    ad: &Value,
    sig: Option<&str>,
    expected_host_pubkey: &str,
    now_ms: i64,
) -> Result<EncAd, &'static str> {
    let Some(sig) = sig.filter(|s| !s.is_empty()) else {
        return Err("unsigned");
    };
    let parsed: EncAd = serde_json::from_value(ad.clone()).map_err(|_| "malformed")?;
    let enc_pub_ok =
        parsed.enc_pub.len() == 44 && crate::keys::EncPublicKey::from_b64(&parsed.enc_pub).is_ok();
    if parsed.v != 2
        || parsed.kind != "enc-ad"
        || !enc_pub_ok
        || utf16_len(&parsed.host) > ENC_AD_MAX_HOST
        || utf16_len(&parsed.iat) > ENC_AD_MAX_TIME
        || utf16_len(&parsed.exp) > ENC_AD_MAX_TIME
    {
        return Err("malformed");
    }
    if parsed.host_pubkey != expected_host_pubkey {
        return Err("wrong peer");
    }
    let signed = canonical::to_string(ad).map_err(|_| "malformed")?;
    // A key that does not parse verifies nothing (0.5.x's verify returns false).
    if !PublicKey::from_b64(&parsed.host_pubkey).is_ok_and(|key| key.verify(signed.as_bytes(), sig))
    {
        return Err("bad signature");
    }
    let (Some(iat), Some(exp)) = (
        crate::time::parse_iso_ms(&parsed.iat),
        crate::time::parse_iso_ms(&parsed.exp),
    ) else {
        return Err("malformed");
    };
    if iat > now_ms + FUTURE_SKEW_MS {
        return Err("not yet valid");
    }
    if exp <= now_ms {
        return Err("expired");
    }
    if exp - iat > ENC_AD_MAX_LIFETIME_MS {
        return Err("lifetime over the maximum");
    }
    Ok(parsed)
}

/// The v1 enc-key ad's signed string: canonical(`{v:1, host, enc_pub}`).
pub fn enc_ad_v1_canonical(host: &str, enc_pub: &str) -> String {
    canonical::to_string(&json!({"v": 1, "host": host, "enc_pub": enc_pub})).unwrap_or_default()
}

// ---- enrolment, sender lists, expiry notices -------------------------------------------------

/// The enrolment statement a host signs: canonical(`{v:1, challenge, host, pubkey, owner_fp}`),
/// `owner_fp` "" when unproven (`wire.md` §2.12).
pub fn enrol_canonical(challenge: &str, host: &str, pubkey: &str, owner_fp: &str) -> String {
    canonical::to_string(&json!({"v": 1, "challenge": challenge, "host": host, "pubkey": pubkey, "owner_fp": owner_fp}))
        .unwrap_or_default()
}

/// Sender allowlist `{v:1, type:"relay-senders", host_pubkey, senders, iat}` (signed by the
/// target host key over canonical(list)).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SenderList {
    /// Always 1.
    pub v: u8,
    /// Always `"relay-senders"`.
    #[serde(rename = "type")]
    pub kind: String,
    /// The target that accepts these senders.
    pub host_pubkey: String,
    /// Sender host keys (base64), sorted, unique, at most 1,024.
    pub senders: Vec<String>,
    /// ISO ms issue time; a newer iat replaces an older list.
    pub iat: String,
}

/// Expiry notice `{v:1, type:"relay-expired", item_id, target_pubkey, accepted_at, expired_at}`
/// signed by the relay key (spec §6).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ExpiryNotice {
    /// Always 1.
    pub v: u8,
    /// Always `"relay-expired"`.
    #[serde(rename = "type")]
    pub kind: String,
    /// The expired item's id.
    pub item_id: String,
    /// The target whose queue held it.
    pub target_pubkey: String,
    /// ISO ms of the original accept.
    pub accepted_at: String,
    /// ISO ms of the expiry.
    pub expired_at: String,
}

// ---- T218 delivery receipts ------------------------------------------------------------------

/// Delivery receipt states in rank order (`wire.md` §2.11).
pub const RECEIPT_STATES: [&str; 4] = ["delivered", "notified", "read", "acked"];

/// T218 receipt `{v:1, type:"receipt", msg, recipient, state, at, note?, did?, seq}`; `note` and
/// `did` are absent, never null or "" (`wire.md` §2.11).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Receipt {
    /// Always 1.
    pub v: u8,
    /// Always `"receipt"`.
    #[serde(rename = "type")]
    pub kind: String,
    /// Message id (10..40 UTF-16 units).
    pub msg: String,
    /// `name@host` of the recipient.
    pub recipient: String,
    /// One of [`RECEIPT_STATES`].
    pub state: String,
    /// ISO ms, `Z` form.
    pub at: String,
    /// Optional note (≤500 UTF-16 units).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub note: Option<String>,
    /// Optional "did" (acked only, ≤200 UTF-16 units).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub did: Option<String>,
    /// Positive integer below 2^53 (`wire.md` Decision 5): the recipient host's
    /// receipt_outbox seq.
    pub seq: u64,
}

impl Receipt {
    /// The relay item id `receipt:<msg>:<recipient>:<seq>` (spec §9).
    pub fn item_id(&self) -> String {
        format!("receipt:{}:{}:{}", self.msg, self.recipient, self.seq)
    }
    /// Wire bytes `canonical({rec, sig})`, signing with the recipient host key.
    pub fn wire(&self, key: &HostKey) -> Result<String, CanonicalError> {
        let rec = serde_json::to_value(self).map_err(|e| CanonicalError::Parse(e.to_string()))?;
        let sig = key.sign(canonical::to_string(&rec)?.as_bytes());
        canonical::to_string(&json!({"rec": rec, "sig": sig}))
    }
}

fn receipt_host_ok(host: &str) -> bool {
    let b = host.as_bytes();
    !b.is_empty()
        && b.len() <= 63
        && b[0].is_ascii_alphanumeric()
        && b.iter()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, b'.' | b'_' | b'-'))
}

/// Parses receipt wire bytes `{rec, sig}` strictly (extra keys refused) and checks the record's
/// shape and its signature by `signer`. Lengths count UTF-16 code units, as 0.5.x's schema does.
/// Errors: a short reason (`bad receipt`, `bad signature`).
pub fn parse_receipt_wire(wire: &[u8], signer: &PublicKey) -> Result<Receipt, &'static str> {
    let v = canonical::parse(wire).map_err(|_| "bad receipt")?;
    let obj = v.as_object().ok_or("bad receipt")?;
    if obj.len() != 2 {
        return Err("bad receipt");
    }
    let rec_v = obj.get("rec").ok_or("bad receipt")?;
    let sig = obj
        .get("sig")
        .and_then(Value::as_str)
        .filter(|s| s.len() <= 200)
        .ok_or("bad receipt")?;
    let rec: Receipt = serde_json::from_value(rec_v.clone()).map_err(|_| "bad receipt")?;
    let (name, host) = rec.recipient.split_once('@').ok_or("bad receipt")?;
    let ok = rec.v == 1
        && rec.kind == "receipt"
        && (10..=40).contains(&utf16_len(&rec.msg))
        && utf16_len(&rec.recipient) <= 104
        && (name == "owner" || crate::limits::is_name(name))
        && receipt_host_ok(host)
        && RECEIPT_STATES.contains(&rec.state.as_str())
        && crate::time::parse_iso_ms(&rec.at).is_some()
        && rec
            .note
            .as_ref()
            .is_none_or(|n| !n.is_empty() && utf16_len(n) <= 500)
        && rec
            .did
            .as_ref()
            .is_none_or(|d| rec.state == "acked" && utf16_len(d) <= 200)
        && (1..=MAX_SAFE_INT as u64).contains(&rec.seq);
    if !ok {
        return Err("bad receipt");
    }
    let signed = canonical::to_string(rec_v).map_err(|_| "bad receipt")?;
    if !signer.verify(signed.as_bytes(), sig) {
        return Err("bad signature");
    }
    Ok(rec)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn statement(targets: Vec<AcceptTarget>, odd: &str) -> AcceptStatement {
        AcceptStatement {
            v: 1,
            kind: "relay-accept".to_owned(),
            relay_pubkey: format!("relay{odd}"),
            epoch: format!("e-{odd}"),
            sender_pubkey: "c2VuZGVy+/=".to_owned(),
            item_id: format!("01J{odd}"),
            targets,
            at: "2026-11-30T12:00:00.123Z".to_owned(),
        }
    }

    #[test]
    fn the_direct_canonical_form_equals_the_generic_one() {
        let target = |seq: i64, odd: &str| AcceptTarget {
            host_pubkey: format!("dGFyZ2V0{odd}"),
            seq,
            wire_hash: format!("ab{odd}"),
        };
        let odd_strings = [
            "",
            "\"quoted\\\\",
            "\u{0}\u{1f}\n\t\r\u{8}\u{c}",
            "é漢字😀\u{2028}",
        ];
        let seqs = [
            0,
            1,
            -1,
            MAX_SAFE_INT,
            MAX_SAFE_INT + 2,
            i64::MAX,
            i64::MIN,
            1_000_000_000_000_000_000,
        ];
        for odd in odd_strings {
            for &seq in &seqs {
                for targets in [
                    vec![],
                    vec![target(seq, odd)],
                    vec![target(seq, odd), target(7, "x")],
                ] {
                    let st = statement(targets, odd);
                    let generic = canonical::of(&st).expect("canonical");
                    assert_eq!(st.canonical(), generic, "{st:?}");
                    let parsed: Value = serde_json::from_str(&st.canonical()).expect("JSON");
                    if seq.unsigned_abs() <= MAX_SAFE_INT.unsigned_abs() {
                        assert_eq!(parsed, serde_json::to_value(&st).expect("value"));
                    }
                }
            }
        }
    }
}
