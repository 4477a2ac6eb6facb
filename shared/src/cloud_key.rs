//! Cloud-key certificates and proofs of possession for account tokens (spec §8; `wire.md`
//! "Resolved details" → "Account tokens").
//!
//! A host that enrols on a relay run with the account authority holds a second Ed25519 key, its
//! *cloud key*, used only for account use. The account issuer binds each access token to that
//! key (`cnf.jkt`, the RFC 7638 thumbprint of the cloud key as an OKP JWK), and the host key
//! certifies the cloud key with a signed record:
//!
//! ```text
//! cloud_cert = {rec: {v:1, type:"cloud-key", host_pubkey, cloud_jkt, iat}, sig}
//! ```
//!
//! `sig` is the host key's Ed25519 signature (standard base64) over canonical(`rec`).
//!
//! A certificate alone proves only what the host key claims: anyone can certify any thumbprint
//! with their own host key. So an enrolment also carries a **proof of possession** of the cloud
//! key, fresh and bound to that one enrolment:
//!
//! ```text
//! cloud_pop = {cloud_pubkey, sig}
//! sig over canonical({v:1, type:"cloud-key-pop", host_pubkey, cloud_jkt, challenge})
//! ```
//!
//! `cloud_pubkey` is the cloud key (standard base64 with padding, the canonical text), `sig` the
//! cloud key's signature, `challenge` the relay's single-use enrolment challenge. The relay
//! computes the thumbprint itself from `cloud_pubkey` ([`CloudPop::check`]) and admits a token
//! for a host key only when `cnf.jkt`, `cloud_cert.rec.cloud_jkt` and that thumbprint are the
//! same, `cloud_cert` is signed by the enrolling host key and `cloud_pop` verifies for that host
//! key and the enrolment's challenge. A token stolen from one host is therefore useless with
//! another host's key: enrolling it needs the private cloud key the token is bound to, and the
//! relay refuses a cloud key already bound to another live host key.
//!
//! This module only builds, signs and checks certificates and proofs and computes thumbprints.
//! It never reads key files or talks to an issuer, and never handles private key bytes other
//! than through [`HostKey`].

use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::canonical;
use crate::keys::{HostKey, PublicKey};

/// The record's `type`.
pub const CLOUD_KEY_TYPE: &str = "cloud-key";

/// The `type` of the record a proof of possession signs.
pub const CLOUD_POP_TYPE: &str = "cloud-key-pop";

/// How far in the future a certificate's `iat` may lie (ms): 5 minutes, the tolerance the relay
/// gives every signed record's clock (`wire.md` §2.12).
pub const MAX_IAT_AHEAD_MS: i64 = 300_000;

/// Length of an RFC 7638 SHA-256 thumbprint in base64url without padding (32 bytes → 43).
pub const JKT_LEN: usize = 43;

/// The RFC 7638 JWK thumbprint (SHA-256, base64url without padding) of an Ed25519 public key
/// `raw` written as an OKP JWK (RFC 8037 §2): SHA-256 over the UTF-8 bytes of
/// `{"crv":"Ed25519","kty":"OKP","x":"<base64url(raw)>"}` — the required members only, in
/// lexicographic order, no whitespace (RFC 7638 §3.1–§3.3).
pub fn okp_thumbprint(raw: &[u8; 32]) -> String {
    let jwk = format!(
        r#"{{"crv":"Ed25519","kty":"OKP","x":"{}"}}"#,
        crate::b64::encode_url(raw)
    );
    crate::b64::encode_url(&crate::hash::sha256(jwk.as_bytes()))
}

/// [`okp_thumbprint`] of a [`PublicKey`].
pub fn thumbprint(key: &PublicKey) -> String {
    okp_thumbprint(key.as_bytes())
}

/// Whether `text` has the shape of a SHA-256 thumbprint: 43 base64url characters.
pub fn is_jkt(text: &str) -> bool {
    text.len() == JKT_LEN
        && text
            .bytes()
            .all(|c| c.is_ascii_alphanumeric() || c == b'-' || c == b'_')
}

/// The signed part: `{v:1, type:"cloud-key", host_pubkey, cloud_jkt, iat}`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CloudKeyRecord {
    /// Always 1.
    pub v: u8,
    /// Always `"cloud-key"`.
    #[serde(rename = "type")]
    pub kind: String,
    /// The certifying host key (standard base64 with padding, the canonical text).
    pub host_pubkey: String,
    /// RFC 7638 thumbprint of the cloud key ([`okp_thumbprint`]).
    pub cloud_jkt: String,
    /// ISO ms issue time (`YYYY-MM-DDTHH:MM:SS.mmmZ`).
    pub iat: String,
}

/// A certificate as it travels: `{rec, sig}`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CloudCert {
    /// The record.
    pub rec: CloudKeyRecord,
    /// The host key's signature over canonical(`rec`), standard base64.
    pub sig: String,
}

/// Why a certificate is refused (the texts appear in enrolment refusals).
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum CloudCertError {
    /// Not `{rec:{v:1, type:"cloud-key", host_pubkey, cloud_jkt, iat}, sig}` with those exact
    /// fields, a thumbprint of the right shape and an ISO ms `iat`.
    #[error("not a cloud-key certificate")]
    NotACert,
    /// `rec.host_pubkey` is not the key that enrols (or signs the hop).
    #[error("cloud-key certificate is for another host key")]
    OtherHost,
    /// `sig` does not verify with the host key.
    #[error("cloud-key certificate is not signed by the host key")]
    BadSignature,
    /// `iat` is more than [`MAX_IAT_AHEAD_MS`] ahead of the checker's clock.
    #[error("cloud-key certificate is issued in the future")]
    FromTheFuture,
    /// Not `{cloud_pubkey, sig}` with those exact fields and a canonical key text.
    #[error("not a cloud-key proof of possession")]
    NotAPop,
    /// The proof's signature does not verify with its cloud key over this host key and
    /// challenge.
    #[error("the cloud-key proof of possession does not verify")]
    BadPop,
}

impl CloudCert {
    /// Builds and signs the certificate of the cloud key `cloud` by `host`, issued at `iat_ms`.
    pub fn sign(host: &HostKey, cloud: &PublicKey, iat_ms: i64) -> Self {
        let rec = CloudKeyRecord {
            v: 1,
            kind: CLOUD_KEY_TYPE.to_owned(),
            host_pubkey: host.public().to_b64(),
            cloud_jkt: thumbprint(cloud),
            iat: crate::time::iso_ms(iat_ms),
        };
        let sig = host.sign(canonical_of(&rec).as_bytes());
        CloudCert { rec, sig }
    }

    /// The JSON form `{rec, sig}`.
    pub fn to_value(&self) -> Value {
        serde_json::to_value(self).unwrap_or(Value::Null)
    }

    /// Parses a received value: exactly `{rec, sig}` with exactly the record's five fields
    /// (an added field would not be covered by the signature check), `v == 1`, `type ==
    /// "cloud-key"`, a thumbprint-shaped `cloud_jkt` and an ISO ms `iat`; else
    /// [`CloudCertError::NotACert`].
    pub fn from_value(value: &Value) -> Result<Self, CloudCertError> {
        let cert: CloudCert =
            serde_json::from_value(value.clone()).map_err(|_| CloudCertError::NotACert)?;
        let r = &cert.rec;
        if r.v != 1
            || r.kind != CLOUD_KEY_TYPE
            || !is_jkt(&r.cloud_jkt)
            || crate::time::parse_iso_ms(&r.iat).is_none()
        {
            return Err(CloudCertError::NotACert);
        }
        Ok(cert)
    }

    /// Checks that this certificate was made by `host` (its canonical key text is
    /// `rec.host_pubkey` and its signature verifies) and is not issued more than
    /// [`MAX_IAT_AHEAD_MS`] after `now_ms`. Errors in that order.
    pub fn check(&self, host: &PublicKey, now_ms: i64) -> Result<(), CloudCertError> {
        if self.rec.host_pubkey != host.to_b64() {
            return Err(CloudCertError::OtherHost);
        }
        if !host.verify(canonical_of(&self.rec).as_bytes(), &self.sig) {
            return Err(CloudCertError::BadSignature);
        }
        match crate::time::parse_iso_ms(&self.rec.iat) {
            Some(iat) if iat <= now_ms.saturating_add(MAX_IAT_AHEAD_MS) => Ok(()),
            Some(_) => Err(CloudCertError::FromTheFuture),
            None => Err(CloudCertError::NotACert),
        }
    }

    /// `rec.iat` in ms (0 if unparseable, which [`CloudCert::from_value`] refuses).
    pub fn iat_ms(&self) -> i64 {
        crate::time::parse_iso_ms(&self.rec.iat).unwrap_or(0)
    }
}

/// What a proof of possession signs: canonical(`{v:1, type:"cloud-key-pop", host_pubkey,
/// cloud_jkt, challenge}`), `host_pubkey` the canonical text of the enrolling host key,
/// `cloud_jkt` the cloud key's thumbprint, `challenge` the relay's enrolment challenge.
pub fn pop_canonical(host_pubkey: &str, cloud_jkt: &str, challenge: &str) -> String {
    #[derive(Serialize)]
    struct PopRecord<'a> {
        v: u8,
        #[serde(rename = "type")]
        kind: &'a str,
        host_pubkey: &'a str,
        cloud_jkt: &'a str,
        challenge: &'a str,
    }
    canonical::of(&PopRecord {
        v: 1,
        kind: CLOUD_POP_TYPE,
        host_pubkey,
        cloud_jkt,
        challenge,
    })
    .unwrap_or_default()
}

/// A proof of possession of the cloud key for one enrolment, as it travels: `{cloud_pubkey,
/// sig}` (module docs).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CloudPop {
    /// The cloud public key, standard base64 with padding (44 characters).
    pub cloud_pubkey: String,
    /// The cloud key's signature over [`pop_canonical`], standard base64.
    pub sig: String,
}

impl CloudPop {
    /// Signs the proof that the holder of `cloud` lets `host` enrol with it against `challenge`.
    pub fn sign(cloud: &HostKey, host: &PublicKey, challenge: &str) -> Self {
        let cloud_pub = cloud.public();
        let signed = pop_canonical(&host.to_b64(), &thumbprint(&cloud_pub), challenge);
        CloudPop {
            cloud_pubkey: cloud_pub.to_b64(),
            sig: cloud.sign(signed.as_bytes()),
        }
    }

    /// The JSON form `{cloud_pubkey, sig}`.
    pub fn to_value(&self) -> Value {
        serde_json::to_value(self).unwrap_or(Value::Null)
    }

    /// Parses a received value: exactly `{cloud_pubkey, sig}`, both strings; else
    /// [`CloudCertError::NotAPop`].
    pub fn from_value(value: &Value) -> Result<Self, CloudCertError> {
        serde_json::from_value(value.clone()).map_err(|_| CloudCertError::NotAPop)
    }

    /// Checks the proof for the enrolling `host` and the enrolment's `challenge` and returns
    /// the thumbprint of the cloud key it proves, computed here from `cloud_pubkey` (never
    /// taken from the sender). Errors: [`CloudCertError::NotAPop`] (the key is not an Ed25519
    /// key in its canonical text), [`CloudCertError::BadPop`] (the signature does not verify).
    pub fn check(&self, host: &PublicKey, challenge: &str) -> Result<String, CloudCertError> {
        let cloud = PublicKey::from_b64(&self.cloud_pubkey)
            .ok()
            .filter(|k| k.to_b64() == self.cloud_pubkey)
            .ok_or(CloudCertError::NotAPop)?;
        let jkt = thumbprint(&cloud);
        let signed = pop_canonical(&host.to_b64(), &jkt, challenge);
        if signed.is_empty() || !cloud.verify(signed.as_bytes(), &self.sig) {
            return Err(CloudCertError::BadPop);
        }
        Ok(jkt)
    }
}

/// canonical(`rec`): the signed bytes. The record holds only strings and a small integer, so
/// canonicalisation cannot fail; an empty string would fail every signature check.
fn canonical_of(rec: &CloudKeyRecord) -> String {
    canonical::of(rec).unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    const T: i64 = 1_767_225_600_000;

    #[test]
    fn thumbprint_matches_rfc_8037_appendix_a3() {
        // RFC 8037 A.1/A.3: x = 11qYAYKxCrfVS_7TyWQHOg7hcvPapiMlrwIaaPcHURo,
        // thumbprint kPrK_qmxVWaYVA9wwBF6Iuo3vVzz7TxHCTwXBygrS4k.
        let raw = hex::decode("d75a980182b10ab7d54bfed3c964073a0ee172f3daa62325af021a68f707511a")
            .expect("hex");
        let raw: [u8; 32] = raw.try_into().expect("32 bytes");
        assert_eq!(
            crate::b64::encode_url(&raw),
            "11qYAYKxCrfVS_7TyWQHOg7hcvPapiMlrwIaaPcHURo"
        );
        let tp = okp_thumbprint(&raw);
        assert_eq!(tp, "kPrK_qmxVWaYVA9wwBF6Iuo3vVzz7TxHCTwXBygrS4k");
        assert!(is_jkt(&tp));
        assert!(!is_jkt(&tp[1..]));
        assert!(!is_jkt(&format!("{}=", &tp[1..])));
    }

    #[test]
    fn a_certificate_signed_by_the_host_checks_and_round_trips() {
        let host = HostKey::generate();
        let cloud = HostKey::generate().public();
        let cert = CloudCert::sign(&host, &cloud, T);
        assert_eq!(cert.rec.cloud_jkt, thumbprint(&cloud));
        assert_eq!(cert.iat_ms(), T);
        let back = CloudCert::from_value(&cert.to_value()).expect("parse");
        assert_eq!(back, cert);
        back.check(&host.public(), T).expect("valid");
        // Issued up to 5 minutes ahead of the checker's clock: fine; past that: refused.
        back.check(&host.public(), T - MAX_IAT_AHEAD_MS)
            .expect("at the bound");
        assert_eq!(
            back.check(&host.public(), T - MAX_IAT_AHEAD_MS - 1),
            Err(CloudCertError::FromTheFuture)
        );
    }

    #[test]
    fn another_host_or_a_forged_signature_is_refused() {
        let host = HostKey::generate();
        let other = HostKey::generate();
        let cloud = HostKey::generate().public();
        let cert = CloudCert::sign(&host, &cloud, T);
        assert_eq!(
            cert.check(&other.public(), T),
            Err(CloudCertError::OtherHost)
        );
        // The other host claims the record but cannot sign it as the host.
        let mut forged = CloudCert::sign(&other, &cloud, T);
        forged.rec.host_pubkey = host.public().to_b64();
        assert_eq!(
            forged.check(&host.public(), T),
            Err(CloudCertError::BadSignature)
        );
        // A changed thumbprint breaks the signature.
        let mut moved = cert.clone();
        moved.rec.cloud_jkt = thumbprint(&other.public());
        assert_eq!(
            moved.check(&host.public(), T),
            Err(CloudCertError::BadSignature)
        );
    }

    #[test]
    fn a_proof_of_possession_names_its_own_thumbprint_and_binds_host_and_challenge() {
        let host = HostKey::generate();
        let cloud = HostKey::generate();
        let pop = CloudPop::sign(&cloud, &host.public(), "ch-1");
        assert_eq!(pop.cloud_pubkey, cloud.public().to_b64());
        let back = CloudPop::from_value(&pop.to_value()).expect("parse");
        assert_eq!(
            back.check(&host.public(), "ch-1"),
            Ok(thumbprint(&cloud.public()))
        );
        // Another challenge or another host key: the signature covers both.
        assert_eq!(
            back.check(&host.public(), "ch-2"),
            Err(CloudCertError::BadPop)
        );
        assert_eq!(
            back.check(&HostKey::generate().public(), "ch-1"),
            Err(CloudCertError::BadPop)
        );
        // A victim's cloud public key with a signature by another key does not verify.
        let thief = HostKey::generate();
        let mut stolen = CloudPop::sign(&thief, &host.public(), "ch-1");
        stolen.cloud_pubkey = cloud.public().to_b64();
        assert_eq!(
            stolen.check(&host.public(), "ch-1"),
            Err(CloudCertError::BadPop)
        );
        // Not canonical, not a key, extra or missing fields: not a proof.
        let mut alias = pop.clone();
        alias.cloud_pubkey = alias.cloud_pubkey.trim_end_matches('=').to_owned();
        assert_eq!(
            alias.check(&host.public(), "ch-1"),
            Err(CloudCertError::NotAPop)
        );
        for bad in [
            json!({"cloud_pubkey": pop.cloud_pubkey, "sig": pop.sig, "jkt": "x"}),
            json!({"cloud_pubkey": pop.cloud_pubkey}),
            json!({"cloud_pubkey": 1, "sig": pop.sig}),
            json!("pop"),
        ] {
            assert_eq!(
                CloudPop::from_value(&bad),
                Err(CloudCertError::NotAPop),
                "{bad}"
            );
        }
        assert_eq!(
            pop_canonical("h", "j", "c"),
            r#"{"challenge":"c","cloud_jkt":"j","host_pubkey":"h","type":"cloud-key-pop","v":1}"#
        );
    }

    #[test]
    fn malformed_certificates_are_not_certificates() {
        let host = HostKey::generate();
        let cloud = HostKey::generate().public();
        let good = CloudCert::sign(&host, &cloud, T).to_value();
        let mut cases = Vec::new();
        let mut extra = good.clone();
        extra["rec"]["note"] = json!("x");
        cases.push(extra);
        let mut outer = good.clone();
        outer["more"] = json!(1);
        cases.push(outer);
        for (k, v) in [
            ("v", json!(2)),
            ("type", json!("host-rotation")),
            ("cloud_jkt", json!("short")),
            ("iat", json!("yesterday")),
            ("host_pubkey", json!(7)),
        ] {
            let mut c = good.clone();
            c["rec"][k] = v;
            cases.push(c);
        }
        let mut missing = good.clone();
        missing["rec"]
            .as_object_mut()
            .expect("object")
            .remove("iat");
        cases.push(missing);
        cases.push(json!("cert"));
        cases.push(json!({"rec": null, "sig": "x"}));
        for c in cases {
            assert_eq!(
                CloudCert::from_value(&c),
                Err(CloudCertError::NotACert),
                "{c}"
            );
        }
    }
}
