//! SHA-256 helpers (`wire.md` §2.1: hashes are lowercase hex SHA-256).

use sha2::{Digest, Sha256};

/// Lowercase hex SHA-256 of `bytes` (64 characters). Used for `wire_hash`, body hashes and ids.
pub fn sha256_hex(bytes: &[u8]) -> String {
    hex::encode(Sha256::digest(bytes))
}

/// Raw SHA-256 of `bytes` (32 bytes).
pub fn sha256(bytes: &[u8]) -> [u8; 32] {
    Sha256::digest(bytes).into()
}
