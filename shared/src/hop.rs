//! Signed hops: the relay form (`wire.md` §2.6) and the LAN form (`wire.md` §2.5).
//!
//! Relay hop: headers `x-mbx-host`, `x-mbx-key` (v2: the caller's base64 host key),
//! `x-mbx-ts` (decimal ms string), `x-mbx-sig`; the signature covers
//! canonical(`{method, path, ts, body: METHOD + ":" + path + ":" + ts + ":" + raw_body}`) with
//! `ts` a JSON string and `path` = pathname + query for `/v2/*`, pathname only for `/v1/*`.
//! Window ±300,000 ms. A `ts` that is not plain decimal digits is refused.
//!
//! LAN hop: headers `x-mbx-host`, `x-mbx-ts` (ISO ms), `x-mbx-sig`, `x-mbx-port`; the signature
//! covers `METHOD\npathname\nts\nsha256hex(body)` (query excluded).

use serde_json::{json, Value};

use crate::hash::sha256_hex;
use crate::keys::{HostKey, PublicKey};
use crate::limits::{LAN_HOP_WINDOW_MS, RELAY_HOP_WINDOW_MS};

/// Header names of the signed hops.
pub mod header {
    /// Sender host name (a label on the relay).
    pub const HOST: &str = "x-mbx-host";
    /// v2 relay hops: the caller's base64 host public key.
    pub const KEY: &str = "x-mbx-key";
    /// Timestamp: decimal ms (relay) or ISO ms (LAN).
    pub const TS: &str = "x-mbx-ts";
    /// Base64 Ed25519 signature.
    pub const SIG: &str = "x-mbx-sig";
    /// LAN hops: the sender's listening port (unsigned hint).
    pub const PORT: &str = "x-mbx-port";
    /// Relay and LAN hops: the sending daemon's instance id (unsigned, advisory; see
    /// [`crate::instance`]).
    pub const INSTANCE: &str = crate::instance::INSTANCE_HEADER;
}

/// Why a hop was refused. All map to HTTP 401 except where a caller says otherwise.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum HopError {
    /// A header is missing.
    #[error("missing hop header {0}")]
    Missing(&'static str),
    /// `x-mbx-ts` is not a plain decimal ms value (relay) or an ISO ms time (LAN).
    #[error("bad hop timestamp")]
    BadTimestamp,
    /// The timestamp is outside the ±300,000 ms window.
    #[error("stale or bad hop timestamp (check clocks)")]
    Stale,
    /// The signature does not verify with the key.
    #[error("bad hop signature")]
    BadSignature,
}

/// Relay hop headers, as sent.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RelayHopHeaders {
    /// `x-mbx-host`.
    pub host: String,
    /// `x-mbx-key` (v2 only).
    pub key: Option<String>,
    /// `x-mbx-ts`, decimal ms.
    pub ts: String,
    /// `x-mbx-sig`.
    pub sig: String,
}

impl RelayHopHeaders {
    /// `(name, value)` pairs in a fixed order.
    pub fn pairs(&self) -> Vec<(&'static str, String)> {
        let mut v = vec![(header::HOST, self.host.clone())];
        if let Some(k) = &self.key {
            v.push((header::KEY, k.clone()));
        }
        v.push((header::TS, self.ts.clone()));
        v.push((header::SIG, self.sig.clone()));
        v
    }
}

/// The path a relay hop signs for a request target already in normalised form: the whole
/// target (pathname + query) for `/v2/*`, the pathname only otherwise.
pub fn relay_signed_path(target: &str) -> &str {
    if target.starts_with("/v2/") {
        target
    } else {
        target.split('?').next().unwrap_or(target)
    }
}

/// The relay hop's signed string (`wire.md` §2.6). `ts` is the header text.
///
/// `canonical({method, path, ts, body: "<method>:<path>:<ts>:<raw body>"})`, written directly
/// (keys in canonical order: body, method, path, ts) rather than through a `Value`, since the
/// raw body can be the whole push batch (up to `RELAY_MAX_BODY` bytes).
pub fn relay_signed_string(method: &str, signed_path: &str, ts: &str, raw_body: &str) -> String {
    use crate::canonical::write_string;
    let body = format!("{method}:{signed_path}:{ts}:{raw_body}");
    let mut out = String::with_capacity(body.len() + signed_path.len() + 64);
    out.push_str("{\"body\":");
    write_string(&mut out, &body);
    out.push_str(",\"method\":");
    write_string(&mut out, method);
    out.push_str(",\"path\":");
    write_string(&mut out, signed_path);
    out.push_str(",\"ts\":");
    write_string(&mut out, ts);
    out.push('}');
    out
}

/// Signs a relay hop. `target` is the normalised request target (path + query); `v2` adds
/// `x-mbx-key` and signs the query.
pub fn sign_relay_hop(
    key: &HostKey,
    host: &str,
    method: &str,
    target: &str,
    ts_ms: i64,
    raw_body: &str,
) -> RelayHopHeaders {
    let ts = ts_ms.to_string();
    let v2 = target.starts_with("/v2/");
    let s = relay_signed_string(method, relay_signed_path(target), &ts, raw_body);
    RelayHopHeaders {
        host: host.into(),
        key: v2.then(|| key.public().to_b64()),
        ts,
        sig: key.sign(s.as_bytes()),
    }
}

/// Parses a relay hop `ts`: plain decimal digits only (stricter than 0.5.x's `Number()`).
pub fn parse_relay_ts(ts: &str) -> Result<i64, HopError> {
    if ts.is_empty() || ts.len() > 16 || !ts.bytes().all(|b| b.is_ascii_digit()) {
        return Err(HopError::BadTimestamp);
    }
    ts.parse().map_err(|_| HopError::BadTimestamp)
}

/// Verifies a relay hop for the normalised `target` at time `now_ms`. Order: timestamp form,
/// window, signature. Errors: [`HopError`] (all HTTP 401).
pub fn verify_relay_hop(
    key: &PublicKey,
    method: &str,
    target: &str,
    ts: &str,
    raw_body: &str,
    sig: &str,
    now_ms: i64,
) -> Result<(), HopError> {
    let t = parse_relay_ts(ts)?;
    if (now_ms - t).abs() > RELAY_HOP_WINDOW_MS {
        return Err(HopError::Stale);
    }
    let s = relay_signed_string(method, relay_signed_path(target), ts, raw_body);
    if key.verify(s.as_bytes(), sig) {
        Ok(())
    } else {
        Err(HopError::BadSignature)
    }
}

/// LAN hop headers, as sent.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LanHopHeaders {
    /// `x-mbx-host`.
    pub host: String,
    /// `x-mbx-ts`, ISO ms.
    pub ts: String,
    /// `x-mbx-sig`.
    pub sig: String,
    /// `x-mbx-port`.
    pub port: u16,
}

/// The LAN hop's signed string: `METHOD\npathname\nts\nsha256hex(body)` (query excluded).
pub fn lan_signed_string(method: &str, target: &str, ts: &str, body: &[u8]) -> String {
    let pathname = target.split('?').next().unwrap_or(target);
    format!("{method}\n{pathname}\n{ts}\n{}", sha256_hex(body))
}

/// Signs a LAN hop at `now_ms`.
pub fn sign_lan_hop(
    key: &HostKey,
    host: &str,
    port: u16,
    method: &str,
    target: &str,
    now_ms: i64,
    body: &[u8],
) -> LanHopHeaders {
    let ts = crate::time::iso_ms(now_ms);
    let sig = key.sign(lan_signed_string(method, target, &ts, body).as_bytes());
    LanHopHeaders {
        host: host.into(),
        ts,
        sig,
        port,
    }
}

/// Verifies a LAN hop against the peer's pinned key. Errors: [`HopError`].
pub fn verify_lan_hop(
    key: &PublicKey,
    method: &str,
    target: &str,
    ts: &str,
    body: &[u8],
    sig: &str,
    now_ms: i64,
) -> Result<(), HopError> {
    let t = crate::time::parse_iso_ms(ts).ok_or(HopError::Stale)?;
    if (now_ms - t).abs() > LAN_HOP_WINDOW_MS {
        return Err(HopError::Stale);
    }
    if key.verify(lan_signed_string(method, target, ts, body).as_bytes(), sig) {
        Ok(())
    } else {
        Err(HopError::BadSignature)
    }
}

/// Normalises a request target as a WHATWG URL parser would give `pathname + search`: dot
/// segments resolved, a lone trailing `?` dropped, bytes outside printable ASCII
/// percent-encoded. Clients send targets already in this form; servers verify against it.
pub fn normalize_target(target: &str) -> String {
    let (path, query) = match target.split_once('?') {
        Some((p, q)) => (p, Some(q)),
        None => (target, None),
    };
    let mut segs: Vec<&str> = Vec::new();
    let parts: Vec<&str> = path.split('/').skip(1).collect();
    let n = parts.len();
    for (i, seg) in parts.iter().enumerate() {
        let last = i + 1 == n;
        match *seg {
            "." | "%2e" | "%2E" => {
                if last {
                    segs.push("");
                }
            }
            ".." | ".%2e" | ".%2E" | "%2e." | "%2E." | "%2e%2e" | "%2E%2E" => {
                segs.pop();
                if last {
                    segs.push("");
                }
            }
            s => segs.push(s),
        }
    }
    let mut out = String::from("/");
    out.push_str(&segs.join("/"));
    let mut out = encode_non_ascii(&out);
    if let Some(q) = query.filter(|q| !q.is_empty()) {
        out.push('?');
        out.push_str(&encode_non_ascii(q));
    }
    out
}

fn encode_non_ascii(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for b in s.bytes() {
        if b <= 0x20 || b >= 0x7f || b == b'"' || b == b'<' || b == b'>' || b == b'`' {
            out.push_str(&format!("%{b:02X}"));
        } else {
            out.push(b as char);
        }
    }
    out
}

/// Helper for tests and clients: the JSON value of the relay hop's signed object.
pub fn relay_signed_value(method: &str, signed_path: &str, ts: &str, raw_body: &str) -> Value {
    json!({"method": method, "path": signed_path, "ts": ts, "body": format!("{method}:{signed_path}:{ts}:{raw_body}")})
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn relay_signed_string_is_the_canonical_object() {
        for (method, path, ts, body) in [
            (
                "POST",
                "/v2/relay/items",
                "1700000000000",
                r#"{"items":[{"a":"\"\\\n\u0001é😀"}]}"#,
            ),
            ("GET", "/v2/relay/items?after=5", "1", ""),
            ("POST", "/v1/x", "0", "tab\there\u{1f}\u{7f}\u{2028}"),
        ] {
            let want = crate::canonical::to_string(&relay_signed_value(method, path, ts, body))
                .expect("canonical");
            assert_eq!(relay_signed_string(method, path, ts, body), want);
        }
    }

    #[test]
    fn normalizes_targets() {
        assert_eq!(normalize_target("/v2/relay/items?"), "/v2/relay/items");
        assert_eq!(
            normalize_target("/v2/a/../relay/./items?after=1"),
            "/v2/relay/items?after=1"
        );
        assert_eq!(normalize_target("/v2/é"), "/v2/%C3%A9");
    }

    #[test]
    fn relay_hop_checks() {
        let k = HostKey::generate();
        let h = sign_relay_hop(
            &k,
            "laptop",
            "GET",
            "/v2/relay/items?after=1",
            1_000_000,
            "",
        );
        let p = k.public();
        assert_eq!(
            verify_relay_hop(
                &p,
                "GET",
                "/v2/relay/items?after=1",
                &h.ts,
                "",
                &h.sig,
                1_000_000
            ),
            Ok(())
        );
        assert_eq!(
            verify_relay_hop(
                &p,
                "GET",
                "/v2/relay/items?after=2",
                &h.ts,
                "",
                &h.sig,
                1_000_000
            ),
            Err(HopError::BadSignature)
        );
        assert_eq!(
            verify_relay_hop(
                &p,
                "GET",
                "/v2/relay/items?after=1",
                &h.ts,
                "x",
                &h.sig,
                1_000_000
            ),
            Err(HopError::BadSignature)
        );
        assert_eq!(
            verify_relay_hop(
                &p,
                "GET",
                "/v2/relay/items?after=1",
                "1e6",
                "",
                &h.sig,
                1_000_000
            ),
            Err(HopError::BadTimestamp)
        );
        assert_eq!(
            verify_relay_hop(
                &p,
                "GET",
                "/v2/relay/items?after=1",
                &h.ts,
                "",
                &h.sig,
                1_300_001
            ),
            Err(HopError::Stale)
        );
        assert_eq!(
            verify_relay_hop(
                &p,
                "GET",
                "/v2/relay/items?after=1",
                &h.ts,
                "",
                &h.sig,
                1_300_000
            ),
            Ok(())
        );
    }
}
