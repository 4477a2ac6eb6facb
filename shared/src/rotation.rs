//! Host key rotation records (`wire.md` §2.10; spec §2 "Rotation", §8).
//!
//! A rotation is `{rec, old_sig, new_sig}` where `rec` = `{v:1, type:"host-rotation", host,
//! old_pub, new_pub, new_enc_pub, iat}` and both signatures are over canonical(`rec`): the old
//! host key vouches for the new keys, the new host key proves possession. A peer accepts it only
//! when `old_pub` is the key it pinned, so a pairing survives a rotation without re-pairing.
//!
//! This module only builds, signs and checks records. It never touches key files, peers or the
//! relay store: callers decide what a valid record changes. Rotation cannot recover from a
//! compromised old key (whoever holds it can rotate too; threat model F9).

use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::canonical;
use crate::keys::{EncPublicKey, HostKey, PublicKey};

/// Most records one `POST /v1/rotate` carries (`wire.md` §2.10).
pub const MAX_RECORDS_PER_ANNOUNCE: usize = 50;

/// The signed part of a rotation: `{v:1, type:"host-rotation", host, old_pub, new_pub,
/// new_enc_pub, iat}` (field order irrelevant: signatures cover the canonical form).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RotationRecord {
    /// Always 1.
    pub v: u8,
    /// Always `"host-rotation"`.
    #[serde(rename = "type")]
    pub kind: String,
    /// The rotating host's name.
    pub host: String,
    /// The key being retired (standard base64 of the 32-byte Ed25519 key).
    pub old_pub: String,
    /// The new host key (base64).
    pub new_pub: String,
    /// The new X25519 enc key (base64).
    pub new_enc_pub: String,
    /// ISO ms issue time (`YYYY-MM-DDTHH:MM:SS.mmmZ`).
    pub iat: String,
}

/// A rotation as it travels: `{rec, old_sig, new_sig}`, both base64 Ed25519 signatures over
/// canonical(`rec`). Any other top-level field is refused when parsing.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SignedRotation {
    /// The record.
    pub rec: RotationRecord,
    /// Signature by `rec.old_pub`.
    pub old_sig: String,
    /// Signature by `rec.new_pub`.
    pub new_sig: String,
}

/// Why a rotation record is refused. The display texts are 0.5.x's (`wire.md` §2.10), so a
/// peer's `rejected:<why>` answer reads the same from either implementation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum RotationError {
    /// Missing or mistyped fields, wrong `v`/`type`, or keys that are not keys.
    #[error("not a rotation record")]
    NotARecord,
    /// `old_pub` is not the key the checker pinned.
    #[error("rotation does not start from the pinned host key")]
    NotFromPinned,
    /// `new_pub == old_pub`.
    #[error("rotation keeps the same host key")]
    SameKey,
    /// `old_sig` does not verify with `old_pub`.
    #[error("rotation is not signed by the pinned host key")]
    BadOldSignature,
    /// `new_sig` does not verify with `new_pub`.
    #[error("rotation is not signed by the new host key")]
    BadNewSignature,
    /// `iat` is not the fixed `YYYY-MM-DDTHH:MM:SS.mmmZ` form.
    #[error("rotation iat is not an ISO time with milliseconds")]
    BadIat,
    /// `iat` is more than [`FUTURE_SKEW_MS`] ahead of the checker's clock
    /// ([`SignedRotation::check_time`]).
    #[error("rotation is dated more than 5 minutes ahead")]
    FromTheFuture,
}

/// How far ahead of the checker's clock a rotation's `iat` may be (ms; 5 minutes, the skew
/// every other signed record is allowed, `wire.md` §2.8).
pub const FUTURE_SKEW_MS: i64 = crate::records::FUTURE_SKEW_MS;

impl SignedRotation {
    /// Builds and signs a rotation of `host` from `old` to `new` (with the new enc key
    /// `new_enc_pub`) issued at `iat_ms` (ms since the epoch).
    pub fn sign(
        host: &str,
        old: &HostKey,
        new: &HostKey,
        new_enc_pub: &EncPublicKey,
        iat_ms: i64,
    ) -> Self {
        let rec = RotationRecord {
            v: 1,
            kind: "host-rotation".to_owned(),
            host: host.to_owned(),
            old_pub: old.public().to_b64(),
            new_pub: new.public().to_b64(),
            new_enc_pub: new_enc_pub.to_b64(),
            iat: crate::time::iso_ms(iat_ms),
        };
        let text = canonical::of(&rec).unwrap_or_default();
        SignedRotation {
            old_sig: old.sign(text.as_bytes()),
            new_sig: new.sign(text.as_bytes()),
            rec,
        }
    }

    /// The signed bytes: canonical JSON of `rec`.
    pub fn canonical(&self) -> String {
        canonical::of(&self.rec).unwrap_or_default()
    }

    /// The new host key, parsed.
    pub fn new_key(&self) -> Result<PublicKey, RotationError> {
        PublicKey::from_b64(&self.rec.new_pub).map_err(|_| RotationError::NotARecord)
    }

    /// The new enc key, parsed.
    pub fn new_enc_key(&self) -> Result<EncPublicKey, RotationError> {
        EncPublicKey::from_b64(&self.rec.new_enc_pub).map_err(|_| RotationError::NotARecord)
    }

    /// Checks the record against the host key the checker pinned (`wire.md` §2.10 order: shape,
    /// pinned start, key change, old signature, new signature; an `iat` not in the fixed ISO ms
    /// form is [`RotationError::BadIat`], after the shape). `pinned` is compared by key bytes,
    /// so padding variants of the same key are the same key. Receivers also call
    /// [`SignedRotation::check_time`].
    pub fn check(&self, pinned: &PublicKey) -> Result<(), RotationError> {
        let r = &self.rec;
        if r.v != 1 || r.kind != "host-rotation" {
            return Err(RotationError::NotARecord);
        }
        if crate::time::parse_iso_ms(&r.iat).is_none() {
            return Err(RotationError::BadIat);
        }
        let old = PublicKey::from_b64(&r.old_pub).map_err(|_| RotationError::NotARecord)?;
        let new = self.new_key()?;
        self.new_enc_key()?;
        if old != *pinned {
            return Err(RotationError::NotFromPinned);
        }
        if new == old {
            return Err(RotationError::SameKey);
        }
        let text = self.canonical();
        if !old.verify(text.as_bytes(), &self.old_sig) {
            return Err(RotationError::BadOldSignature);
        }
        if !new.verify(text.as_bytes(), &self.new_sig) {
            return Err(RotationError::BadNewSignature);
        }
        Ok(())
    }

    /// Checks `iat` against the receiver's clock `now_ms` (ms): [`RotationError::BadIat`] when it
    /// is not the fixed ISO ms form, [`RotationError::FromTheFuture`] when it is more than
    /// [`FUTURE_SKEW_MS`] ahead (a record dated ahead would order after the rotations its host
    /// really makes next). Any age is accepted: a peer may hear of a rotation long after.
    pub fn check_time(&self, now_ms: i64) -> Result<(), RotationError> {
        let iat = crate::time::parse_iso_ms(&self.rec.iat).ok_or(RotationError::BadIat)?;
        if iat > now_ms.saturating_add(FUTURE_SKEW_MS) {
            return Err(RotationError::FromTheFuture);
        }
        Ok(())
    }

    /// Parses a received JSON value. Anything that is not `{rec:{…}, old_sig, new_sig}` with
    /// the record's fields as strings is [`RotationError::NotARecord`]. The record is checked
    /// over its canonical form *as received* re-built from the typed fields: an added field in
    /// `rec` is refused (it would not be covered by the signature check otherwise), and so is
    /// one next to `rec`, `old_sig` and `new_sig`.
    pub fn from_value(value: &Value) -> Result<Self, RotationError> {
        let rec = value.get("rec").ok_or(RotationError::NotARecord)?;
        let fields = rec.as_object().ok_or(RotationError::NotARecord)?;
        const KEYS: [&str; 7] = [
            "v",
            "type",
            "host",
            "old_pub",
            "new_pub",
            "new_enc_pub",
            "iat",
        ];
        if fields.len() != KEYS.len() || !KEYS.iter().all(|k| fields.contains_key(*k)) {
            return Err(RotationError::NotARecord);
        }
        serde_json::from_value(value.clone()).map_err(|_| RotationError::NotARecord)
    }
}

/// `POST /v1/rotate` body (`wire.md` §2.10, §4): `{records:[…]}`, at most
/// [`MAX_RECORDS_PER_ANNOUNCE`] signed rotations, oldest first. Records stay raw JSON so a
/// receiver answers each one on its own ([`SignedRotation::from_value`]).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RotateRequest {
    /// The signed rotations, as `{rec, old_sig, new_sig}` values.
    pub records: Vec<Value>,
}

/// One record's outcome in a `POST /v1/rotate` answer, a JSON string as 0.5.x sends it:
/// `"rotated"` (the pin moved), `"current"` (already pinned to the new key) or
/// `"rejected:<why>"`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RotateResult {
    /// The peer moved its pin to the new key.
    Rotated,
    /// The peer already pins the new key (or a later one of the same chain).
    Current,
    /// Refused; the text after `rejected:`.
    Rejected(String),
}

impl RotateResult {
    /// The wire text: `rotated`, `current` or `rejected:<why>`.
    pub fn as_text(&self) -> String {
        match self {
            RotateResult::Rotated => "rotated".to_owned(),
            RotateResult::Current => "current".to_owned(),
            RotateResult::Rejected(why) => format!("rejected:{why}"),
        }
    }

    /// Parses a wire text; anything that is not `rotated`, `current` or `rejected:…` is a
    /// rejection carrying the whole text.
    pub fn from_text(text: &str) -> Self {
        match text {
            "rotated" => RotateResult::Rotated,
            "current" => RotateResult::Current,
            other => {
                RotateResult::Rejected(other.strip_prefix("rejected:").unwrap_or(other).to_owned())
            }
        }
    }

    /// Whether the peer holds the new key now (`rotated` or `current`).
    pub fn is_taken(&self) -> bool {
        !matches!(self, RotateResult::Rejected(_))
    }
}

impl Serialize for RotateResult {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&self.as_text())
    }
}

impl<'de> Deserialize<'de> for RotateResult {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let text = String::deserialize(d)?;
        Ok(RotateResult::from_text(&text))
    }
}

/// `POST /v1/rotate` answer (0.5.x `{results:[…]}`): one [`RotateResult`] per record, in
/// request order.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RotateAnswer {
    /// Outcomes in request order.
    pub results: Vec<RotateResult>,
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::keys::EncKey;

    #[test]
    fn announce_answers_are_plain_strings_as_in_0_5_x() {
        let text = r#"{"results":["rotated","current","rejected:host not paired"]}"#;
        let a: RotateAnswer = serde_json::from_str(text).expect("parses");
        assert_eq!(
            a.results,
            vec![
                RotateResult::Rotated,
                RotateResult::Current,
                RotateResult::Rejected("host not paired".into())
            ]
        );
        assert_eq!(serde_json::to_string(&a).expect("json"), text);
        assert!(a.results[1].is_taken() && !a.results[2].is_taken());
    }

    fn rotation() -> (HostKey, HostKey, SignedRotation) {
        let old = HostKey::generate();
        let new = HostKey::generate();
        let enc = EncKey::generate();
        let r = SignedRotation::sign("laptop", &old, &new, &enc.public(), 1_767_225_650_123);
        (old, new, r)
    }

    #[test]
    fn a_signed_rotation_checks_against_the_old_key_only() {
        let (old, new, r) = rotation();
        assert_eq!(r.check(&old.public()), Ok(()));
        assert_eq!(r.check(&new.public()), Err(RotationError::NotFromPinned));
        assert_eq!(r.rec.iat, "2026-01-01T00:00:50.123Z");
    }

    #[test]
    fn each_refusal_has_its_text() {
        let (old, new, r) = rotation();
        let mut bad = r.clone();
        bad.old_sig = new.sign(bad.canonical().as_bytes());
        assert_eq!(
            bad.check(&old.public()).map_err(|e| e.to_string()),
            Err("rotation is not signed by the pinned host key".into())
        );
        let mut bad = r.clone();
        bad.new_sig = old.sign(bad.canonical().as_bytes());
        assert_eq!(
            bad.check(&old.public()).map_err(|e| e.to_string()),
            Err("rotation is not signed by the new host key".into())
        );
        let mut bad = r.clone();
        bad.rec.new_pub = bad.rec.old_pub.clone();
        assert_eq!(bad.check(&old.public()), Err(RotationError::SameKey));
        let mut bad = r.clone();
        bad.rec.kind = "rotation".into();
        assert_eq!(bad.check(&old.public()), Err(RotationError::NotARecord));
        let mut bad = r;
        bad.rec.host = "other".into();
        assert_eq!(
            bad.check(&old.public()),
            Err(RotationError::BadOldSignature)
        );
    }

    #[test]
    fn parsing_refuses_extra_missing_and_mistyped_fields() {
        let (old, _, r) = rotation();
        let v = serde_json::to_value(&r).expect("json");
        let parsed = SignedRotation::from_value(&v).expect("parses");
        assert_eq!(parsed.check(&old.public()), Ok(()));
        let mut extra = v.clone();
        extra["rec"]["note"] = "x".into();
        assert_eq!(
            SignedRotation::from_value(&extra),
            Err(RotationError::NotARecord)
        );
        let mut missing = v.clone();
        missing["rec"].as_object_mut().expect("obj").remove("iat");
        assert_eq!(
            SignedRotation::from_value(&missing),
            Err(RotationError::NotARecord)
        );
        let mut typed = v;
        typed["rec"]["v"] = "1".into();
        assert_eq!(
            SignedRotation::from_value(&typed),
            Err(RotationError::NotARecord)
        );
        assert_eq!(
            SignedRotation::from_value(&serde_json::json!([1])),
            Err(RotationError::NotARecord)
        );
    }

    #[test]
    fn a_field_next_to_rec_and_the_signatures_is_refused() {
        let (old, _, r) = rotation();
        let mut v = serde_json::to_value(&r).expect("json");
        assert_eq!(
            SignedRotation::from_value(&v).map(|p| p.check(&old.public())),
            Ok(Ok(()))
        );
        v["note"] = "x".into();
        assert_eq!(
            SignedRotation::from_value(&v),
            Err(RotationError::NotARecord)
        );
    }

    #[test]
    fn iat_must_be_iso_ms_and_at_most_5_minutes_ahead() {
        let (old, new, r) = rotation();
        let iat = 1_767_225_650_123;
        // At the bound and in the past: fine; 1 ms past the bound: refused.
        assert_eq!(r.check_time(iat - FUTURE_SKEW_MS), Ok(()));
        assert_eq!(r.check_time(iat + 86_400_000 * 365), Ok(()));
        assert_eq!(
            r.check_time(iat - FUTURE_SKEW_MS - 1),
            Err(RotationError::FromTheFuture)
        );
        assert_eq!(
            RotationError::FromTheFuture.to_string(),
            "rotation is dated more than 5 minutes ahead"
        );
        // Other spellings of a time, signed by both keys all the same, are refused.
        for bad in [
            "2026-01-01T00:00:50Z",
            "2026-01-01T00:00:50.123+00:00",
            "2026-01-01 00:00:50.123Z",
            "1767225650123",
            "9999-99-99T00:00:00.000Z",
            "",
        ] {
            let enc = EncKey::generate();
            let mut s = SignedRotation::sign("laptop", &old, &new, &enc.public(), iat);
            s.rec.iat = bad.into();
            let text = s.canonical();
            s.old_sig = old.sign(text.as_bytes());
            s.new_sig = new.sign(text.as_bytes());
            assert_eq!(s.check(&old.public()), Err(RotationError::BadIat), "{bad}");
            assert_eq!(s.check_time(iat), Err(RotationError::BadIat), "{bad}");
        }
    }
}
