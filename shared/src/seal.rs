//! Body sealing (`wire.md` §2.4): X25519 + HKDF-SHA256 + XChaCha20-Poly1305.
//!
//! `enc = {v:1, alg:"x25519+xchacha20poly1305", epk, nonce, body}`. A fresh ephemeral X25519 key
//! per envelope; shared = X25519(eph, recipient enc pub); key = HKDF-SHA256(IKM = shared,
//! salt = raw ephemeral public key, info = `"agentmbx-enc-1:" + envelope_id`, L = 32); a random
//! 24-byte nonce; XChaCha20-Poly1305 over the UTF-8 body with no AAD (the host signature covers
//! `enc`). An all-zero shared secret (low-order point) is refused as undecryptable.

use chacha20poly1305::aead::{Aead, KeyInit};
use chacha20poly1305::{XChaCha20Poly1305, XNonce};
use rand::RngCore;

use crate::b64;
use crate::envelope::Envelope;
/// The sealed `enc` object and its algorithm name are part of the envelope's wire shape; they
/// live in [`crate::envelope`] and are re-exported here, beside the code that fills them.
pub use crate::envelope::{Enc, ENC_ALG};
use crate::keys::{EncKey, EncPublicKey, HostKey};

/// A sealed body that could not be opened. Deliberately uninformative beyond its kind.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum OpenError {
    /// The `enc` object is malformed (bad base64, lengths).
    #[error("malformed enc")]
    Malformed,
    /// The shared secret is all zero (low-order ephemeral key).
    #[error("undecryptable: low-order key")]
    LowOrder,
    /// Authentication failed (wrong key, tampered ciphertext).
    #[error("undecryptable")]
    Undecryptable,
    /// The plaintext is not UTF-8.
    #[error("decrypted body is not UTF-8")]
    NotUtf8,
}

fn derive_key(shared: &[u8; 32], epk: &[u8; 32], envelope_id: &str) -> [u8; 32] {
    let hk = hkdf::Hkdf::<sha2::Sha256>::new(Some(epk), shared);
    let mut key = [0u8; 32];
    // 32 bytes is always a valid HKDF-SHA256 output length.
    let _ = hk.expand(format!("agentmbx-enc-1:{envelope_id}").as_bytes(), &mut key);
    key
}

/// Seals with explicit ephemeral key and nonce (deterministic; used by the golden vectors).
pub fn seal_with(
    body: &str,
    recipient: &EncPublicKey,
    envelope_id: &str,
    ephemeral: &EncKey,
    nonce: &[u8; 24],
) -> Enc {
    let eph = x25519_dalek::StaticSecret::from(ephemeral.0);
    let epk = x25519_dalek::PublicKey::from(&eph).to_bytes();
    let shared = eph
        .diffie_hellman(&x25519_dalek::PublicKey::from(recipient.0))
        .to_bytes();
    let key = derive_key(&shared, &epk, envelope_id);
    let cipher = XChaCha20Poly1305::new((&key).into());
    // Encryption of an in-memory buffer with a valid key and nonce cannot fail.
    let ct = cipher
        .encrypt(XNonce::from_slice(nonce), body.as_bytes())
        .unwrap_or_default();
    Enc {
        v: 1,
        alg: ENC_ALG.into(),
        epk: b64::encode(&epk),
        nonce: b64::encode(nonce),
        body: b64::encode(&ct),
    }
}

/// Seals `body` for one recipient host with a fresh ephemeral key and nonce.
pub fn seal(body: &str, recipient: &EncPublicKey, envelope_id: &str) -> Enc {
    let mut nonce = [0u8; 24];
    rand::rngs::OsRng.fill_bytes(&mut nonce);
    seal_with(body, recipient, envelope_id, &EncKey::generate(), &nonce)
}

/// Opens a sealed body with the recipient's enc key. Errors: [`OpenError`].
pub fn open(enc: &Enc, key: &EncKey, envelope_id: &str) -> Result<String, OpenError> {
    let epk: [u8; 32] = b64::decode(&enc.epk)
        .ok()
        .and_then(|b| b.try_into().ok())
        .ok_or(OpenError::Malformed)?;
    let nonce: [u8; 24] = b64::decode(&enc.nonce)
        .ok()
        .and_then(|b| b.try_into().ok())
        .ok_or(OpenError::Malformed)?;
    let ct = b64::decode(&enc.body).map_err(|_| OpenError::Malformed)?;
    let secret = x25519_dalek::StaticSecret::from(key.0);
    let shared = secret.diffie_hellman(&x25519_dalek::PublicKey::from(epk));
    if !shared.was_contributory() {
        return Err(OpenError::LowOrder);
    }
    let k = derive_key(shared.as_bytes(), &epk, envelope_id);
    let plain = XChaCha20Poly1305::new((&k).into())
        .decrypt(XNonce::from_slice(&nonce), ct.as_slice())
        .map_err(|_| OpenError::Undecryptable)?;
    String::from_utf8(plain).map_err(|_| OpenError::NotUtf8)
}

/// 0.5.x `sealEnvelope`: seals the plain body for one recipient host, sets both `enc.body` and
/// the top-level `body` to the ciphertext, then host-signs. The input stays untouched.
pub fn seal_envelope(
    plain: &Envelope,
    recipient: &EncPublicKey,
    host: &str,
    key: &HostKey,
) -> Result<Envelope, crate::canonical::CanonicalError> {
    let enc = seal(&plain.body, recipient, &plain.id);
    let mut sealed = plain.clone();
    sealed.body = enc.body.clone();
    sealed.enc = Some(enc);
    sealed.sign(host, key)?;
    Ok(sealed)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_and_wrong_key() {
        let k = EncKey::generate();
        let enc = seal("héllo 🔒", &k.public(), "01KDVDNA3VG2MH8KWSQRCWJZ0S");
        assert_eq!(
            open(&enc, &k, "01KDVDNA3VG2MH8KWSQRCWJZ0S").unwrap(),
            "héllo 🔒"
        );
        assert_eq!(
            open(&enc, &k, "01KDVDNA3VG2MH8KWSQRCWJZ0T"),
            Err(OpenError::Undecryptable)
        );
        assert_eq!(
            open(&enc, &EncKey::generate(), "01KDVDNA3VG2MH8KWSQRCWJZ0S"),
            Err(OpenError::Undecryptable)
        );
        let low = Enc {
            epk: b64::encode(&[0u8; 32]),
            ..enc
        };
        assert_eq!(
            open(&low, &k, "01KDVDNA3VG2MH8KWSQRCWJZ0S"),
            Err(OpenError::LowOrder)
        );
    }
}
