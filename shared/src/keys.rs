//! Host keys (Ed25519), enc keys (X25519), their encodings and fingerprints (`wire.md` §2.1).
//!
//! Public keys travel as standard base64 of the raw 32 bytes (44 characters); private keys as
//! base64 of the 32-byte Ed25519 seed or the raw 32-byte X25519 scalar. Key files are JSON
//! `{"publicKey", "privateKey"}` + "\n" ([`KeyFile`]).
//!
//! Secrets never leave this module except through the explicitly named `*_b64_secret` accessors
//! and [`KeyFile`]; `Debug` of a private key prints only its public half, and errors never echo
//! the text they were given.

use ed25519_dalek::Signer;
use serde::{Deserialize, Serialize};

use crate::{b64, hash};

/// A key text that could not be used. The message never contains the key material itself.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum KeyError {
    /// The text is not base64.
    #[error("key is not valid base64")]
    Encoding,
    /// The decoded key does not have the expected length (32 bytes).
    #[error("key must be 32 bytes, got {0}")]
    Length(usize),
    /// The bytes are not a valid Ed25519 public key (not a curve point).
    #[error("not a valid Ed25519 public key")]
    NotOnCurve,
    /// The bytes are a small-order ("weak") point: a key for which forged signatures verify,
    /// so no honest host can hold it.
    #[error("weak Ed25519 public key (small-order point)")]
    Weak,
    /// The key file's public key does not belong to its private key.
    #[error("the key file's publicKey does not match its privateKey")]
    Mismatch,
}

fn decode32(text: &str) -> Result<[u8; 32], KeyError> {
    let bytes = b64::decode(text).map_err(|_| KeyError::Encoding)?;
    <[u8; 32]>::try_from(bytes.as_slice()).map_err(|_| KeyError::Length(bytes.len()))
}

/// `fingerprint(pub)`: the first 16 hex characters of SHA-256 over the raw 32 public key bytes,
/// grouped `xxxx-xxxx-xxxx-xxxx` (`wire.md` §2.1). Used for `sig.key`, relay and mDNS `fp`.
pub fn fingerprint(raw_public: &[u8]) -> String {
    let h = hash::sha256_hex(raw_public);
    format!("{}-{}-{}-{}", &h[0..4], &h[4..8], &h[8..12], &h[12..16])
}

/// An Ed25519 public key: a host key, the relay key, or a cloud key.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct PublicKey(ed25519_dalek::VerifyingKey);

impl PublicKey {
    /// Parses standard base64 of the raw 32 bytes. Errors: [`KeyError`]; a small-order
    /// ("weak") point is refused with [`KeyError::Weak`], since any signature made without a
    /// private key can verify under it.
    pub fn from_b64(text: &str) -> Result<Self, KeyError> {
        let raw = decode32(text)?;
        let key =
            ed25519_dalek::VerifyingKey::from_bytes(&raw).map_err(|_| KeyError::NotOnCurve)?;
        if key.is_weak() {
            return Err(KeyError::Weak);
        }
        Ok(PublicKey(key))
    }

    /// Standard base64 with padding of the raw 32 bytes (44 characters).
    pub fn to_b64(&self) -> String {
        b64::encode(self.0.as_bytes())
    }

    /// The raw 32 bytes.
    pub fn as_bytes(&self) -> &[u8; 32] {
        self.0.as_bytes()
    }

    /// [`fingerprint`] of this key.
    pub fn fingerprint(&self) -> String {
        fingerprint(self.0.as_bytes())
    }

    /// Verifies a base64 Ed25519 signature over `message` with strict rules (canonical S, R
    /// not of small order, as `verify_strict`). Returns false on any error (bad base64, wrong
    /// length, non-canonical S, small-order R, wrong key); never panics (`wire.md` §2.1).
    pub fn verify(&self, message: &[u8], signature_b64: &str) -> bool {
        let Ok(bytes) = b64::decode(signature_b64) else {
            return false;
        };
        let Ok(sig) = ed25519_dalek::Signature::from_slice(&bytes) else {
            return false;
        };
        self.0.verify_strict(message, &sig).is_ok()
    }
}

impl std::fmt::Debug for PublicKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "PublicKey({})", self.to_b64())
    }
}

impl std::fmt::Display for PublicKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.to_b64())
    }
}

/// An Ed25519 signing key (host key, relay key). The private half is the 32-byte seed.
#[derive(Clone)]
pub struct HostKey(ed25519_dalek::SigningKey);

impl HostKey {
    /// A fresh key from the OS random generator.
    pub fn generate() -> Self {
        HostKey(ed25519_dalek::SigningKey::generate(&mut rand::rngs::OsRng))
    }

    /// From standard base64 of the 32-byte seed. Errors: [`KeyError`] (never echoing the text).
    pub fn from_seed_b64(text: &str) -> Result<Self, KeyError> {
        Ok(HostKey(ed25519_dalek::SigningKey::from_bytes(&decode32(
            text,
        )?)))
    }

    /// The seed as standard base64: a secret, for key files and `relay keygen` only.
    pub fn seed_b64_secret(&self) -> String {
        b64::encode(self.0.as_bytes())
    }

    /// The public half.
    pub fn public(&self) -> PublicKey {
        PublicKey(self.0.verifying_key())
    }

    /// Ed25519 signature over `message`, standard base64 (88 characters). Deterministic.
    pub fn sign(&self, message: &[u8]) -> String {
        b64::encode(&self.0.sign(message).to_bytes())
    }

    /// The key file form (`{publicKey, privateKey}`).
    pub fn to_key_file(&self) -> KeyFile {
        KeyFile {
            public_key: self.public().to_b64(),
            private_key: self.seed_b64_secret(),
        }
    }

    /// Loads a key file, checking that its public key belongs to its private key.
    pub fn from_key_file(file: &KeyFile) -> Result<Self, KeyError> {
        let key = Self::from_seed_b64(&file.private_key)?;
        if key.public().to_b64() != file.public_key {
            return Err(KeyError::Mismatch);
        }
        Ok(key)
    }
}

impl std::fmt::Debug for HostKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "HostKey(public: {}, private: <redacted>)",
            self.public().to_b64()
        )
    }
}

/// An X25519 public key (a host's enc key, `wire.md` §2.4).
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct EncPublicKey(pub(crate) [u8; 32]);

impl EncPublicKey {
    /// Parses standard base64 of the raw 32 bytes.
    pub fn from_b64(text: &str) -> Result<Self, KeyError> {
        decode32(text).map(EncPublicKey)
    }
    /// Standard base64 of the raw 32 bytes.
    pub fn to_b64(&self) -> String {
        b64::encode(&self.0)
    }
    /// The raw 32 bytes.
    pub fn as_bytes(&self) -> &[u8; 32] {
        &self.0
    }
}

impl std::fmt::Debug for EncPublicKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "EncPublicKey({})", self.to_b64())
    }
}

/// An X25519 private key: raw 32 bytes, clamped at use, never pre-clamped (`wire.md` §2.4).
#[derive(Clone)]
pub struct EncKey(pub(crate) [u8; 32]);

impl EncKey {
    /// A fresh key from the OS random generator.
    pub fn generate() -> Self {
        let mut raw = [0u8; 32];
        rand::RngCore::fill_bytes(&mut rand::rngs::OsRng, &mut raw);
        EncKey(raw)
    }
    /// From standard base64 of the raw 32 bytes.
    pub fn from_private_b64(text: &str) -> Result<Self, KeyError> {
        decode32(text).map(EncKey)
    }
    /// The private key as standard base64: a secret, for key files only.
    pub fn private_b64_secret(&self) -> String {
        b64::encode(&self.0)
    }
    /// The public half, X25519(private, basepoint).
    pub fn public(&self) -> EncPublicKey {
        let secret = x25519_dalek::StaticSecret::from(self.0);
        EncPublicKey(x25519_dalek::PublicKey::from(&secret).to_bytes())
    }
    /// The key file form (`{publicKey, privateKey}`).
    pub fn to_key_file(&self) -> KeyFile {
        KeyFile {
            public_key: self.public().to_b64(),
            private_key: self.private_b64_secret(),
        }
    }
    /// Loads a key file, checking that its public key belongs to its private key.
    pub fn from_key_file(file: &KeyFile) -> Result<Self, KeyError> {
        let key = Self::from_private_b64(&file.private_key)?;
        if key.public().to_b64() != file.public_key {
            return Err(KeyError::Mismatch);
        }
        Ok(key)
    }
}

impl std::fmt::Debug for EncKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "EncKey(public: {}, private: <redacted>)",
            self.public().to_b64()
        )
    }
}

/// The 0.5.x key file: JSON `{"publicKey": b64, "privateKey": b64}` followed by "\n".
#[derive(Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct KeyFile {
    /// Standard base64 of the public key.
    #[serde(rename = "publicKey")]
    pub public_key: String,
    /// Standard base64 of the private key (secret).
    #[serde(rename = "privateKey")]
    pub private_key: String,
}

impl KeyFile {
    /// The file text: compact JSON in 0.5.x order plus a trailing newline.
    pub fn to_text(&self) -> String {
        format!(
            "{{\"publicKey\":{},\"privateKey\":{}}}\n",
            serde_json::Value::String(self.public_key.clone()),
            serde_json::Value::String(self.private_key.clone())
        )
    }
    /// Parses a key file. The error never contains the file's text.
    pub fn parse(text: &str) -> Result<Self, KeyError> {
        serde_json::from_str(text).map_err(|_| KeyError::Encoding)
    }
}

impl std::fmt::Debug for KeyFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "KeyFile(public: {}, private: <redacted>)",
            self.public_key
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn debug_and_errors_never_show_secrets() {
        let k = HostKey::generate();
        let seed = k.seed_b64_secret();
        assert!(!format!("{k:?}").contains(&seed));
        assert!(!format!("{:?}", k.to_key_file()).contains(&seed));
        let e = EncKey::generate();
        assert!(!format!("{e:?}").contains(&e.private_b64_secret()));
        let err = HostKey::from_seed_b64("c2VjcmV0LXNlY3JldA==").unwrap_err();
        assert!(!err.to_string().contains("c2VjcmV0"));
    }

    #[test]
    fn key_file_round_trip_and_mismatch() {
        let k = HostKey::generate();
        let f = KeyFile::parse(&k.to_key_file().to_text()).unwrap();
        assert_eq!(HostKey::from_key_file(&f).unwrap().public(), k.public());
        let other = HostKey::generate();
        let bad = KeyFile {
            public_key: other.public().to_b64(),
            private_key: f.private_key,
        };
        assert_eq!(
            HostKey::from_key_file(&bad).unwrap_err(),
            KeyError::Mismatch
        );
    }

    #[test]
    fn bad_public_keys_are_refused() {
        assert_eq!(
            PublicKey::from_b64("YWI=").unwrap_err(),
            KeyError::Length(2)
        );
        assert_eq!(PublicKey::from_b64("!!").unwrap_err(), KeyError::Encoding);
    }

    /// The identity point (y = 1) is of small order: with it, the signature (R = identity,
    /// S = 0) "verifies" for every message under the lenient rules. It must never parse.
    #[test]
    fn weak_public_keys_are_refused_and_forgeries_do_not_verify() {
        let mut identity = [0u8; 32];
        identity[0] = 1;
        let text = b64::encode(&identity);
        assert_eq!(PublicKey::from_b64(&text).unwrap_err(), KeyError::Weak);
        // Another small-order point: the point of order 2 (y = -1).
        let mut minus_one = [0xffu8; 32];
        minus_one[0] = 0xec;
        minus_one[31] = 0x7f;
        assert_eq!(
            PublicKey::from_b64(&b64::encode(&minus_one)).unwrap_err(),
            KeyError::Weak
        );

        // Strict verification also refuses a small-order R under a weak key that slipped in
        // some other way (the lenient check accepts this forgery).
        use ed25519_dalek::Verifier;
        let weak = PublicKey(ed25519_dalek::VerifyingKey::from_bytes(&identity).unwrap());
        let mut forged = [0u8; 64];
        forged[..32].copy_from_slice(&identity);
        let forged = b64::encode(&forged);
        let sig = ed25519_dalek::Signature::from_slice(&b64::decode(&forged).unwrap()).unwrap();
        assert!(
            weak.0.verify(b"any message", &sig).is_ok(),
            "the lenient check accepts the forgery"
        );
        assert!(!weak.verify(b"any message", &forged));

        // An honest key still parses and verifies.
        let k = HostKey::generate();
        let again = PublicKey::from_b64(&k.public().to_b64()).unwrap();
        assert!(again.verify(b"m", &k.sign(b"m")));
    }
}
