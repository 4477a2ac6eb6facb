//! Base64 as AgentMBX uses it (`wire.md` §2.1): standard alphabet with padding for keys,
//! signatures and ciphertext; base64url without padding for nonces, challenges and pairing MACs.
//!
//! Decoding is lenient only where 0.5.x peers are known to be lenient (missing padding); any other
//! malformed text is refused with [`B64Error`]. Nothing here panics on any input.

use base64::engine::general_purpose::{
    GeneralPurpose, GeneralPurposeConfig, STANDARD, URL_SAFE_NO_PAD,
};
use base64::engine::DecodePaddingMode;
use base64::{alphabet, Engine};

/// Standard alphabet, padding optional on decode (0.5.x's `Buffer.from(s, "base64")` accepts both).
const STANDARD_LENIENT: GeneralPurpose = GeneralPurpose::new(
    &alphabet::STANDARD,
    GeneralPurposeConfig::new().with_decode_padding_mode(DecodePaddingMode::Indifferent),
);

/// A base64 text that could not be decoded.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("not valid base64")]
pub struct B64Error;

/// Encodes bytes as standard base64 with padding.
pub fn encode(bytes: &[u8]) -> String {
    STANDARD.encode(bytes)
}

/// Decodes standard base64; padding may be missing. Whitespace and the url alphabet are refused.
pub fn decode(text: &str) -> Result<Vec<u8>, B64Error> {
    STANDARD_LENIENT.decode(text).map_err(|_| B64Error)
}

/// Encodes bytes as base64url without padding (nonces, challenges, pairing MACs).
pub fn encode_url(bytes: &[u8]) -> String {
    URL_SAFE_NO_PAD.encode(bytes)
}

/// True when `text` matches the relay's wire pattern `^[A-Za-z0-9+/]+={0,2}$` (`wire.md` §3.2).
pub fn is_wire_b64(text: &str) -> bool {
    let body = text.trim_end_matches('=');
    text.len() - body.len() <= 2
        && !body.is_empty()
        && body
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'+' || b == b'/')
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_and_lenient_padding() {
        assert_eq!(encode(b"ab"), "YWI=");
        assert_eq!(decode("YWI=").unwrap(), b"ab");
        assert_eq!(decode("YWI").unwrap(), b"ab");
        assert!(decode("Y W I=").is_err());
        assert!(decode("YW_=").is_err());
    }

    #[test]
    fn wire_pattern() {
        assert!(is_wire_b64("YWI="));
        assert!(is_wire_b64("YQ=="));
        assert!(!is_wire_b64("YQ==="));
        assert!(!is_wire_b64(""));
        assert!(!is_wire_b64("===="));
        assert!(!is_wire_b64("a-b_"));
    }
}
