//! Host pairing (`wire.md` §2.9): the pairing token, its scrypt key K and token id, the token
//! join transcript and its HMACs, and the SAS commit-and-code of `pair --compare`.
//!
//! This module owns the pure computations and the JSON bodies of pairing only; it never does I/O.
//! Nonce bookkeeping, token TTLs, the failed-MAC burn counter, rate limits and the validation of
//! host names, keys and nonces (`wire.md` §2.9 "Validation") belong to the daemon.
//!
//! Byte-exact details pinned by `tests/data/pairing.json` (`wire.md` "Resolved details"):
//! - token normalisation is JavaScript's: full Unicode uppercasing (`ß` → `SS`), JavaScript's
//!   `\s` whitespace set (U+FEFF is whitespace, U+0085 is not), ASCII `-` only;
//! - the token id hashes the 64-character lowercase **hex text** of K, while the MAC HKDF takes
//!   K's 32 **raw bytes**; MACs are base64url **without padding**;
//! - the transcript carries `owner_pubkey: null` when there is none;
//! - SAS lines are sorted as whole strings by UTF-16 code unit, `"-"` stands for a null or absent
//!   `owner_pubkey` only (an empty string stays empty), and `addr` and `v` are not in the code.
//!
//! The token and K are secrets: they never appear in errors, and nothing here logs.

use hmac::{Hmac, Mac};
use serde::{Deserialize, Serialize};
use serde_json::Value;
use sha2::Sha256;
use subtle::ConstantTimeEq;

use crate::canonical::{self, CanonicalError};
use crate::{b64, hash};

/// The scrypt salt, HKDF salt and transcript `proto` of token pairing.
pub const TOKEN_PROTO: &str = "agentmbx-pair-token-v1";
/// The first line of the SAS hash input.
pub const SAS_PROTO: &str = "mbx-pair-v2";
/// Characters in a normalized token.
pub const TOKEN_LEN: usize = 12;
/// scrypt cost: N = 2^15.
pub const SCRYPT_LOG_N: u8 = 15;
/// scrypt block size r.
pub const SCRYPT_R: u32 = 8;
/// scrypt parallelism p.
pub const SCRYPT_P: u32 = 1;

/// Crockford base32, the token alphabet (no I, L, O, U).
const CROCKFORD: &[u8; 32] = b"0123456789ABCDEFGHJKMNPQRSTVWXYZ";

/// A pairing computation that could not be done. Messages never contain the token or K.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PairingError {
    /// The token does not normalize to 12 Crockford characters (0.5.x's message, verbatim).
    #[error("malformed pairing token (expected XXXX-XXXX-XXXX)")]
    MalformedToken,
    /// A SAS offer has no canonical form (a non-finite number).
    #[error("pairing offer: {0}")]
    Canonical(#[from] CanonicalError),
    /// The scrypt implementation refused the fixed parameters. Cannot happen with N = 2^15,
    /// r = 8, p = 1 and a 32-byte output; kept as an error instead of a panic.
    #[error("scrypt refused its parameters")]
    Kdf,
}

// ---- the token ---------------------------------------------------------------------------------

/// JavaScript's RegExp `\s`: ECMAScript WhiteSpace and LineTerminator. Unlike
/// [`char::is_whitespace`] it includes U+FEFF and excludes U+0085.
fn is_js_whitespace(c: char) -> bool {
    matches!(
        c,
        '\t' | '\n' | '\u{0b}' | '\u{0c}' | '\r' | ' ' | '\u{a0}' | '\u{1680}' | '\u{2000}'
            ..='\u{200a}'
                | '\u{2028}'
                | '\u{2029}'
                | '\u{202f}'
                | '\u{205f}'
                | '\u{3000}'
                | '\u{feff}'
    )
}

/// Normalizes a token as 0.5.x does: `toUpperCase()` (full Unicode mapping, `ß` → `SS`), drop
/// JavaScript whitespace and `-`, `I`/`L` → `1`, `O` → `0`, then require
/// `^[0-9A-HJKMNP-TV-Z]{12}$`. Idempotent on its own output.
/// Errors: [`PairingError::MalformedToken`].
pub fn normalize_token(token: &str) -> Result<String, PairingError> {
    let normalized: String = token
        .to_uppercase()
        .chars()
        .filter(|&c| c != '-' && !is_js_whitespace(c))
        .map(|c| match c {
            'I' | 'L' => '1',
            'O' => '0',
            c => c,
        })
        .collect();
    // All bytes in the alphabet means all ASCII, so 12 bytes are 12 characters.
    if normalized.len() == TOKEN_LEN && normalized.bytes().all(|b| CROCKFORD.contains(&b)) {
        Ok(normalized)
    } else {
        Err(PairingError::MalformedToken)
    }
}

/// The display form `XXXX-XXXX-XXXX` of a token (normalized first, so any accepted spelling
/// works). Errors: [`PairingError::MalformedToken`].
pub fn display_token(token: &str) -> Result<String, PairingError> {
    let n = normalize_token(token)?;
    Ok(format!("{}-{}-{}", &n[0..4], &n[4..8], &n[8..12]))
}

/// The token for 8 random bytes: their top 60 bits as 12 Crockford characters, most
/// significant first, in display form `XXXX-XXXX-XXXX`.
pub fn token_from_random(bytes: [u8; 8]) -> String {
    let bits = u64::from_be_bytes(bytes) >> 4;
    let mut out = String::with_capacity(TOKEN_LEN + 2);
    for i in 0..TOKEN_LEN {
        if i == 4 || i == 8 {
            out.push('-');
        }
        let shift = 5 * (TOKEN_LEN - 1 - i);
        out.push(char::from(CROCKFORD[((bits >> shift) & 0x1f) as usize]));
    }
    out
}

/// A fresh token from the OS random source, in display form.
pub fn generate_token() -> String {
    let mut bytes = [0u8; 8];
    rand::RngCore::fill_bytes(&mut rand::rngs::OsRng, &mut bytes);
    token_from_random(bytes)
}

/// K = scrypt(normalized token as UTF-8, salt [`TOKEN_PROTO`], N = 2^15, r = 8, p = 1, 32 bytes).
/// The token is normalized first (a normalized token is unchanged). 0.5.x stores `hex(K)`.
/// Errors: [`PairingError::MalformedToken`].
pub fn derive_token_key(token: &str) -> Result<[u8; 32], PairingError> {
    let normalized = normalize_token(token)?;
    let params =
        scrypt::Params::new(SCRYPT_LOG_N, SCRYPT_R, SCRYPT_P, 32).map_err(|_| PairingError::Kdf)?;
    let mut key = [0u8; 32];
    scrypt::scrypt(
        normalized.as_bytes(),
        TOKEN_PROTO.as_bytes(),
        &params,
        &mut key,
    )
    .map_err(|_| PairingError::Kdf)?;
    Ok(key)
}

/// The token id: the first 12 hex characters of SHA-256 over the 64-character lowercase **hex
/// text** of K (not over K's raw bytes).
pub fn token_id(key: &[u8; 32]) -> String {
    let mut id = hash::sha256_hex(hex::encode(key).as_bytes());
    id.truncate(12);
    id
}

// ---- the join transcript and its MACs ---------------------------------------------------------

/// A MAC label of the token join.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MacLabel {
    /// `join`: sent by the joiner in `POST /v1/pair/join`.
    Join,
    /// `accept`: answered by the token holder.
    Accept,
}

impl MacLabel {
    /// The label text (`join` / `accept`).
    pub fn as_str(self) -> &'static str {
        match self {
            MacLabel::Join => "join",
            MacLabel::Accept => "accept",
        }
    }
}

/// Party A of the transcript: the token holder, as its `GET /v1/pair/hello` describes it
/// (`nonce` = the hello nonce, which the joiner echoes as `nonce_a`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct HolderParty {
    /// Host name.
    pub host: String,
    /// Host public key, base64.
    pub host_pubkey: String,
    /// Owner public key, base64; `null` on the wire and in the transcript when there is none.
    #[serde(default)]
    pub owner_pubkey: Option<String>,
    /// The hello nonce (`nonce_a`).
    pub nonce: String,
}

/// Party B of the transcript: the joiner.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct JoinerParty {
    /// Host name.
    pub host: String,
    /// Host public key, base64.
    pub host_pubkey: String,
    /// Owner public key, base64; `null` when there is none.
    #[serde(default)]
    pub owner_pubkey: Option<String>,
    /// The joiner's nonce.
    pub nonce: String,
    /// Where the holder reaches the joiner (`host:port`).
    pub addr: String,
}

/// `GET /v1/pair/hello` response: `{v:1, host, host_pubkey, owner_pubkey|null, nonce}`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PairHello {
    /// Always 1.
    pub v: u8,
    /// The holder.
    #[serde(flatten)]
    pub holder: HolderParty,
}

/// `POST /v1/pair/join` body: `{v:1, host, host_pubkey, owner_pubkey, nonce, addr, nonce_a, mac}`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PairJoin {
    /// Always 1.
    pub v: u8,
    /// The joiner.
    #[serde(flatten)]
    pub joiner: JoinerParty,
    /// The holder's hello nonce.
    pub nonce_a: String,
    /// `MAC("join")` over the transcript.
    pub mac: String,
}

impl PairJoin {
    /// The joiner's request for `holder`'s hello, with its `join` MAC under K.
    pub fn new(holder: &HolderParty, joiner: JoinerParty, key: &[u8; 32]) -> Self {
        let mac = mac(key, MacLabel::Join, &join_transcript(holder, &joiner));
        PairJoin {
            v: 1,
            nonce_a: holder.nonce.clone(),
            joiner,
            mac,
        }
    }

    /// The holder's check: `nonce_a` names `holder`'s hello and the `join` MAC verifies under K
    /// (constant-time).
    pub fn verify(&self, holder: &HolderParty, key: &[u8; 32]) -> bool {
        let transcript = join_transcript(holder, &self.joiner);
        let mac_ok = verify_mac(key, MacLabel::Join, &transcript, &self.mac);
        mac_ok && self.nonce_a == holder.nonce
    }
}

/// The holder's 200 answer to a verified join: `{v:1, host, mac: MAC("accept")}`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PairAccept {
    /// Always 1.
    pub v: u8,
    /// The holder's host name.
    pub host: String,
    /// `MAC("accept")` over the transcript.
    pub mac: String,
}

impl PairAccept {
    /// The holder's answer, with its `accept` MAC under K.
    pub fn new(holder: &HolderParty, joiner: &JoinerParty, key: &[u8; 32]) -> Self {
        PairAccept {
            v: 1,
            host: holder.host.clone(),
            mac: mac(key, MacLabel::Accept, &join_transcript(holder, joiner)),
        }
    }

    /// The joiner's check of the `accept` MAC (constant-time). The host name is not covered by
    /// the MAC; the caller compares it with the hello's.
    pub fn verify(&self, holder: &HolderParty, joiner: &JoinerParty, key: &[u8; 32]) -> bool {
        verify_mac(
            key,
            MacLabel::Accept,
            &join_transcript(holder, joiner),
            &self.mac,
        )
    }
}

fn push_field(out: &mut String, key: &str, value: Option<&str>) {
    canonical::write_string(out, key);
    out.push(':');
    match value {
        Some(v) => canonical::write_string(out, v),
        None => out.push_str("null"),
    }
}

/// The transcript `canonical({proto, a:{host, host_pubkey, owner_pubkey, nonce}, b:{addr, host,
/// host_pubkey, owner_pubkey, nonce}})`, A = the token holder. Written directly in canonical key
/// order (all keys ASCII), so it cannot fail; equal to [`canonical::to_string`] of that object.
pub fn join_transcript(a: &HolderParty, b: &JoinerParty) -> String {
    let mut out = String::from("{\"a\":{");
    push_field(&mut out, "host", Some(&a.host));
    out.push(',');
    push_field(&mut out, "host_pubkey", Some(&a.host_pubkey));
    out.push(',');
    push_field(&mut out, "nonce", Some(&a.nonce));
    out.push(',');
    push_field(&mut out, "owner_pubkey", a.owner_pubkey.as_deref());
    out.push_str("},\"b\":{");
    push_field(&mut out, "addr", Some(&b.addr));
    out.push(',');
    push_field(&mut out, "host", Some(&b.host));
    out.push(',');
    push_field(&mut out, "host_pubkey", Some(&b.host_pubkey));
    out.push(',');
    push_field(&mut out, "nonce", Some(&b.nonce));
    out.push(',');
    push_field(&mut out, "owner_pubkey", b.owner_pubkey.as_deref());
    out.push_str("},");
    push_field(&mut out, "proto", Some(TOKEN_PROTO));
    out.push('}');
    out
}

/// The MAC key of `label`: HKDF-SHA256(IKM = K's 32 raw bytes, salt [`TOKEN_PROTO`],
/// info `"mac:" + label`, L = 32).
pub fn mac_key(key: &[u8; 32], label: MacLabel) -> [u8; 32] {
    let hk = hkdf::Hkdf::<Sha256>::new(Some(TOKEN_PROTO.as_bytes()), key);
    let mut out = [0u8; 32];
    // 32 bytes is always a valid HKDF-SHA256 output length.
    let _ = hk.expand(format!("mac:{}", label.as_str()).as_bytes(), &mut out);
    out
}

fn mac_bytes(key: &[u8; 32], label: MacLabel, transcript: &str) -> [u8; 32] {
    // HMAC takes keys of any length: this cannot fail.
    let mut m = <Hmac<Sha256> as Mac>::new_from_slice(&mac_key(key, label))
        .unwrap_or_else(|_| unreachable!("HMAC accepts any key length"));
    m.update(label.as_str().as_bytes());
    m.update(b"\n");
    m.update(transcript.as_bytes());
    m.finalize().into_bytes().into()
}

/// `MAC(label)` = base64url-no-padding(HMAC-SHA256(key = [`mac_key`], msg = label + "\n" +
/// transcript)).
pub fn mac(key: &[u8; 32], label: MacLabel, transcript: &str) -> String {
    b64::encode_url(&mac_bytes(key, label, transcript))
}

/// True when `mac_text` is exactly [`mac`] (unpadded base64url); compared in constant time.
pub fn verify_mac(key: &[u8; 32], label: MacLabel, transcript: &str, mac_text: &str) -> bool {
    let expected = mac(key, label, transcript);
    // The length of a MAC is public (43 characters); only the content is compared in constant time.
    expected.len() == mac_text.len() && bool::from(expected.as_bytes().ct_eq(mac_text.as_bytes()))
}

// ---- SAS (pair --compare) ----------------------------------------------------------------------

/// A SAS offer `{v:1, host, host_pubkey, owner_pubkey, nonce, addr}`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PairOffer {
    /// Always 1 (the offer's own version; the POST around it is v2).
    pub v: u8,
    /// Host name.
    pub host: String,
    /// Host public key, base64.
    pub host_pubkey: String,
    /// Owner public key, base64; `null` when there is none.
    #[serde(default)]
    pub owner_pubkey: Option<String>,
    /// The offer's nonce.
    pub nonce: String,
    /// Where the peer reaches this host.
    pub addr: String,
}

/// The commit of an offer: `sha256hex(canonical(offer))`, over the offer as received (a JSON
/// value, so fields this crate does not know are committed too).
/// Errors: [`PairingError::Canonical`] (a non-finite number).
pub fn offer_commit(offer: &Value) -> Result<String, PairingError> {
    Ok(hash::sha256_hex(canonical::to_string(offer)?.as_bytes()))
}

/// One SAS line: `host|host_pubkey|owner_pubkey|nonce`, `-` for a null or absent owner key only.
pub fn sas_line(offer: &PairOffer) -> String {
    format!(
        "{}|{}|{}|{}",
        offer.host,
        offer.host_pubkey,
        offer.owner_pubkey.as_deref().unwrap_or("-"),
        offer.nonce
    )
}

/// The SAS lines of `offers`, sorted as whole strings by UTF-16 code unit (JavaScript's default
/// sort: `box-2|…` sorts before `box|…`).
pub fn sas_sorted_lines(offers: &[PairOffer]) -> Vec<String> {
    let mut lines: Vec<String> = offers.iter().map(sas_line).collect();
    lines.sort_by(|a, b| a.encode_utf16().cmp(b.encode_utf16()));
    lines
}

/// The SAS hash input: `"mbx-pair-v2\n"` + the sorted lines joined by `"\n"`.
pub fn sas_input(offers: &[PairOffer]) -> String {
    format!("{SAS_PROTO}\n{}", sas_sorted_lines(offers).join("\n"))
}

/// The 6-digit code both humans compare: uint32BE(SHA-256([`sas_input`])[0..4]) mod 10^6,
/// zero-padded. The order of `offers` does not matter.
pub fn sas_code(offers: &[PairOffer]) -> String {
    let digest = hash::sha256(sas_input(offers).as_bytes());
    let n = u32::from_be_bytes([digest[0], digest[1], digest[2], digest[3]]);
    format!("{:06}", n % 1_000_000)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use serde_json::json;

    #[test]
    fn normalisation_edges() {
        assert_eq!(normalize_token("ıl0o-ABCD-EFGH").unwrap(), "1100ABCDEFGH");
        assert_eq!(
            normalize_token("\u{2028}7k3m\u{205f}9qxz\u{1680}4hpt\u{b}").unwrap(),
            "7K3M9QXZ4HPT"
        );
        assert!(normalize_token("7K3M\u{85}9QXZ4HPT").is_err());
        assert!(normalize_token("7K3M\u{180e}9QXZ4HPT").is_err());
        assert!(normalize_token("７K3M9QXZ4HPT").is_err());
        assert!(normalize_token("7K3M9QXZ4HPU").is_err());
        for t in ["7K3M9QXZ4HPT", "0110-1110-ABCD"] {
            let n = normalize_token(t).unwrap();
            assert_eq!(normalize_token(&n).unwrap(), n);
        }
        assert_eq!(
            PairingError::MalformedToken.to_string(),
            "malformed pairing token (expected XXXX-XXXX-XXXX)"
        );
    }

    #[test]
    fn generated_tokens_are_valid() {
        for _ in 0..32 {
            let t = generate_token();
            assert_eq!(t.len(), 14);
            assert_eq!(display_token(&t).unwrap(), t);
        }
    }

    #[test]
    fn transcript_is_canonical() {
        let a = HolderParty {
            host: "a\"\\\u{1}\u{2028}é".into(),
            host_pubkey: "k/+=".into(),
            owner_pubkey: Some(String::new()),
            nonce: "n\n".into(),
        };
        let b = JoinerParty {
            host: "\u{1f600}".into(),
            host_pubkey: "p".into(),
            owner_pubkey: None,
            nonce: "x".into(),
            addr: "h:1".into(),
        };
        let want = json!({"proto": TOKEN_PROTO, "a": a, "b": b});
        assert_eq!(
            join_transcript(&a, &b),
            canonical::to_string(&want).unwrap()
        );
    }

    #[test]
    fn macs_verify_and_bind() {
        let key = [7u8; 32];
        let t = "transcript";
        let m = mac(&key, MacLabel::Join, t);
        assert!(verify_mac(&key, MacLabel::Join, t, &m));
        assert!(!verify_mac(&key, MacLabel::Accept, t, &m));
        assert!(!verify_mac(&key, MacLabel::Join, "other", &m));
        assert!(!verify_mac(&[8u8; 32], MacLabel::Join, t, &m));
        assert!(!verify_mac(&key, MacLabel::Join, t, &format!("{m}=")));
        assert!(!verify_mac(&key, MacLabel::Join, t, ""));
    }

    #[test]
    fn empty_owner_is_not_dash() {
        let mut o = PairOffer {
            v: 1,
            host: "h".into(),
            host_pubkey: "k".into(),
            owner_pubkey: Some(String::new()),
            nonce: "n".into(),
            addr: "a".into(),
        };
        assert_eq!(sas_line(&o), "h|k||n");
        o.owner_pubkey = None;
        assert_eq!(sas_line(&o), "h|k|-|n");
        let absent: PairOffer = serde_json::from_value(
            json!({"v":1,"host":"h","host_pubkey":"k","nonce":"n","addr":"a"}),
        )
        .unwrap();
        assert_eq!(sas_line(&absent), "h|k|-|n");
        assert!(offer_commit(&json!({"v": 1})).is_ok());
    }
}
