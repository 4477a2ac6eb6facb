//! Signed status and presence (`wire.md` §2.7): how a host proves where it is.
//!
//! - [`SignedStatus`]: the answer to `GET /v1/status?challenge=<c>`, signed by the host key over
//!   canonical(`{v:1, kind:"status", host, host_pubkey, challenge, addrs, version, at}`). A
//!   prober accepts a candidate address only when the answer names the expected host and its
//!   *pinned* key, echoes the prober's fresh challenge, carries a valid signature, and lists the
//!   candidate's IP among the signed `addrs` ([`verify_status_for`]). A relaying proxy cannot
//!   pass: it cannot sign, and a relayed answer lists the real host's IPs, not the proxy's.
//! - [`PresenceBody`]: the body of the hop-signed `POST /v1/presence` beacon
//!   `{v:1, seq, port, addrs[≤16, each ≤64], version}`.
//! - Address text helpers ([`split_addr`], [`join_addr`], [`unmap`]) for the `host:port`,
//!   `[v6]:port` and bare-host forms that 0.5.x peers put in `addrs`.
//!
//! Verification rebuilds the signed object from the received fields (as 0.5.x does), so the
//! outer `v`, `service` and `sig` fields are not part of the signed bytes.

use std::net::IpAddr;

use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::canonical;
use crate::keys::{HostKey, PublicKey};
use crate::limits::utf16_len;
use crate::records::MAX_SAFE_INT;

/// Longest challenge a status answer accepts, in UTF-16 code units (0.5.x `isStr(c, 64)`).
pub const MAX_CHALLENGE: usize = 64;
/// Most addresses a presence beacon may carry (0.5.x: a bigger list is "bad presence").
pub const MAX_PRESENCE_ADDRS: usize = 16;
/// Longest address text in a presence beacon, in UTF-16 code units.
pub const MAX_PRESENCE_ADDR: usize = 64;
/// The `service` field of every status answer.
pub const SERVICE: &str = "agentmbx";

/// The unsigned public status, `GET /v1/status` without a challenge:
/// `{service:"agentmbx", v:1, host, host_pubkey, version, started_at}` (field order as 0.5.x).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PublicStatus {
    /// Always [`SERVICE`].
    pub service: String,
    /// Always 1.
    pub v: u8,
    /// The host's name.
    pub host: String,
    /// The host key (standard base64).
    pub host_pubkey: String,
    /// The daemon's version.
    pub version: String,
    /// ISO ms time the daemon started.
    pub started_at: String,
}

impl PublicStatus {
    /// The public status of `host`.
    pub fn new(host: &str, host_pubkey: &PublicKey, version: &str, started_at: &str) -> Self {
        PublicStatus {
            service: SERVICE.into(),
            v: 1,
            host: host.into(),
            host_pubkey: host_pubkey.to_b64(),
            version: version.into(),
            started_at: started_at.into(),
        }
    }
}

/// The signed status answer `{v:1, service:"agentmbx", host, host_pubkey, challenge, addrs[],
/// version, at, sig}` (`wire.md` §2.7; field order as 0.5.x sends it).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SignedStatus {
    /// Always 1.
    pub v: u8,
    /// Always [`SERVICE`].
    pub service: String,
    /// The answering host's name.
    pub host: String,
    /// The answering host's key (standard base64).
    pub host_pubkey: String,
    /// The prober's challenge, echoed.
    pub challenge: String,
    /// The host's own addresses (`ip:port` as this implementation sends them; a 0.5.x peer
    /// configured with `MBX_SELF_ADDRS` may send any text).
    pub addrs: Vec<String>,
    /// The daemon's version.
    pub version: String,
    /// ISO ms time of the answer.
    pub at: String,
    /// Base64 Ed25519 signature by the host key over [`status_signed_text`].
    pub sig: String,
}

/// Whether `challenge` is acceptable: non-empty and at most [`MAX_CHALLENGE`] UTF-16 code units.
pub fn valid_challenge(challenge: &str) -> bool {
    !challenge.is_empty() && utf16_len(challenge) <= MAX_CHALLENGE
}

/// The signed bytes of a status answer: canonical(`{v:1, kind:"status", host, host_pubkey,
/// challenge, addrs, version, at}`).
pub fn status_signed_text(
    host: &str,
    host_pubkey: &str,
    challenge: &str,
    addrs: &[String],
    version: &str,
    at: &str,
) -> String {
    let value = serde_json::json!({
        "v": 1, "kind": "status", "host": host, "host_pubkey": host_pubkey,
        "challenge": challenge, "addrs": addrs, "version": version, "at": at,
    });
    // Strings and a small integer only: canonicalization cannot fail.
    canonical::to_string(&value).unwrap_or_default()
}

impl SignedStatus {
    /// Signs a status answer for `challenge` at `now_ms` with `key`.
    pub fn sign(
        key: &HostKey,
        host: &str,
        challenge: &str,
        addrs: Vec<String>,
        version: &str,
        now_ms: i64,
    ) -> Self {
        let host_pubkey = key.public().to_b64();
        let at = crate::time::iso_ms(now_ms);
        let sig = key.sign(
            status_signed_text(host, &host_pubkey, challenge, &addrs, version, &at).as_bytes(),
        );
        SignedStatus {
            v: 1,
            service: SERVICE.into(),
            host: host.into(),
            host_pubkey,
            challenge: challenge.into(),
            addrs,
            version: version.into(),
            at,
            sig,
        }
    }

    /// Whether `ip` (IPv4-mapped IPv6 unmapped) is among the signed `addrs` (each read with
    /// [`split_addr`]; texts that are not IPs never match).
    pub fn lists(&self, ip: IpAddr) -> bool {
        let want = unmap(ip);
        self.addrs.iter().any(|a| {
            split_addr(a)
                .0
                .parse::<IpAddr>()
                .is_ok_and(|listed| unmap(listed) == want)
        })
    }
}

/// Why a status answer does not prove a candidate address (`wire.md` §2.7).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum StatusError {
    /// Not a status answer: a field is missing or of the wrong type.
    #[error("malformed status answer")]
    Malformed,
    /// It names another host: the name it gave, as sent (unverified: checked before the
    /// signature; quote it escaped and cut).
    #[error("status answer names another host ({0:?})")]
    WrongHost(String),
    /// It names another key than the pinned one.
    #[error("status answer names another host key than the pinned one")]
    WrongKey,
    /// It does not echo our challenge.
    #[error("status answer does not echo our challenge")]
    WrongChallenge,
    /// The signature does not verify with the pinned key.
    #[error("bad status signature")]
    BadSignature,
    /// The candidate's IP is not among the signed addresses.
    #[error("the candidate address is not among the host's signed addresses")]
    NotListed,
}

/// Verifies a received status answer (`answer` as parsed JSON) against the expected `host`, its
/// pinned key and our fresh `challenge`. Returns the answer. Errors: [`StatusError`] (checks in
/// the order: shape, host, key, challenge, signature).
pub fn verify_status(
    answer: &Value,
    host: &str,
    pinned: &PublicKey,
    challenge: &str,
) -> Result<SignedStatus, StatusError> {
    let field = |name: &str| answer.get(name).and_then(Value::as_str);
    let (Some(got_host), Some(got_key), Some(got_challenge), Some(version), Some(at), Some(sig)) = (
        field("host"),
        field("host_pubkey"),
        field("challenge"),
        field("version"),
        field("at"),
        field("sig"),
    ) else {
        return Err(StatusError::Malformed);
    };
    let addrs: Vec<String> = match answer.get("addrs").and_then(Value::as_array) {
        Some(list) => list
            .iter()
            .map(|a| a.as_str().map(str::to_string))
            .collect::<Option<_>>()
            .ok_or(StatusError::Malformed)?,
        None => return Err(StatusError::Malformed),
    };
    if got_host != host {
        return Err(StatusError::WrongHost(got_host.to_string()));
    }
    let pinned_b64 = pinned.to_b64();
    if got_key != pinned_b64 {
        return Err(StatusError::WrongKey);
    }
    if got_challenge != challenge {
        return Err(StatusError::WrongChallenge);
    }
    let signed = status_signed_text(host, &pinned_b64, challenge, &addrs, version, at);
    if !pinned.verify(signed.as_bytes(), sig) {
        return Err(StatusError::BadSignature);
    }
    Ok(SignedStatus {
        v: 1,
        service: SERVICE.into(),
        host: host.into(),
        host_pubkey: pinned_b64,
        challenge: challenge.into(),
        addrs,
        version: version.into(),
        at: at.into(),
        sig: sig.into(),
    })
}

/// [`verify_status`], then requires one of `candidate_ips` (the candidate address's IP, or the
/// IPs its name resolved to) among the signed `addrs`. Errors: [`StatusError`], finally
/// [`StatusError::NotListed`] (also when `candidate_ips` is empty).
pub fn verify_status_for(
    answer: &Value,
    host: &str,
    pinned: &PublicKey,
    challenge: &str,
    candidate_ips: &[IpAddr],
) -> Result<SignedStatus, StatusError> {
    let status = verify_status(answer, host, pinned, challenge)?;
    if candidate_ips.iter().any(|ip| status.lists(*ip)) {
        Ok(status)
    } else {
        Err(StatusError::NotListed)
    }
}

/// The body of `POST /v1/presence` (`wire.md` §2.7): `{v:1, seq, port, addrs, version}`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PresenceBody {
    /// Always 1.
    pub v: u8,
    /// Sender's ms clock at sending; strictly increasing per sender (replays are refused).
    pub seq: i64,
    /// The sender's LAN port; `None` when absent or not a valid port (it is only a hint).
    pub port: Option<u16>,
    /// The sender's own addresses (≤ [`MAX_PRESENCE_ADDRS`], each ≤ [`MAX_PRESENCE_ADDR`]).
    pub addrs: Vec<String>,
    /// The sender's version, when given.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub version: Option<String>,
}

/// A presence body that is not one (0.5.x answers 400 `bad presence`).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("bad presence")]
pub struct BadPresence;

impl PresenceBody {
    /// A beacon as this implementation sends it.
    pub fn new(seq: i64, port: u16, addrs: Vec<String>, version: &str) -> Self {
        PresenceBody {
            v: 1,
            seq,
            port: Some(port),
            addrs,
            version: Some(version.into()),
        }
    }

    /// The JSON text sent on the wire (`port` as a number, `version` a string).
    pub fn to_json(&self) -> String {
        serde_json::json!({
            "v": 1, "seq": self.seq, "port": self.port, "addrs": self.addrs,
            "version": self.version.as_deref().unwrap_or_default(),
        })
        .to_string()
    }

    /// Reads a received body as 0.5.x does: `v` must be 1, `seq` a safe integer (an integral
    /// number, also written with a fraction part of zero), `addrs` an array of at most 16
    /// strings of at most 64 UTF-16 code units; `port` is kept only when it is an integer in
    /// 1..=65535. Errors: [`BadPresence`].
    pub fn parse(body: &Value) -> Result<Self, BadPresence> {
        if body.get("v").and_then(Value::as_f64) != Some(1.0) {
            return Err(BadPresence);
        }
        let seq = body.get("seq").and_then(safe_integer).ok_or(BadPresence)?;
        let list = body
            .get("addrs")
            .and_then(Value::as_array)
            .ok_or(BadPresence)?;
        if list.len() > MAX_PRESENCE_ADDRS {
            return Err(BadPresence);
        }
        let addrs = list
            .iter()
            .map(|a| {
                a.as_str()
                    .filter(|s| utf16_len(s) <= MAX_PRESENCE_ADDR)
                    .map(str::to_string)
            })
            .collect::<Option<Vec<_>>>()
            .ok_or(BadPresence)?;
        let port = body
            .get("port")
            .and_then(|p| match p {
                // 0.5.x `Number(p)`: a numeric string counts too.
                Value::String(s) => s.trim().parse::<i64>().ok(),
                other => safe_integer(other),
            })
            .and_then(|p| u16::try_from(p).ok())
            .filter(|p| *p != 0);
        let version = body
            .get("version")
            .and_then(Value::as_str)
            .map(str::to_string);
        Ok(PresenceBody {
            v: 1,
            seq,
            port,
            addrs,
            version,
        })
    }
}

/// A JSON number that is a JavaScript safe integer (`Number.isSafeInteger`).
fn safe_integer(v: &Value) -> Option<i64> {
    if let Some(i) = v.as_i64() {
        return (i.abs() <= MAX_SAFE_INT).then_some(i);
    }
    let f = v.as_f64()?;
    (f.fract() == 0.0 && f.abs() <= MAX_SAFE_INT as f64).then_some(f as i64)
}

/// Splits `host:port`, `[v6]:port` or a bare host into the host text and the port, as 0.5.x
/// `splitAddr` does (a bare IPv6 address has no port).
pub fn split_addr(addr: &str) -> (&str, Option<u16>) {
    if let Some(rest) = addr.strip_prefix('[') {
        if let Some((host, after)) = rest.split_once(']') {
            let port = after.strip_prefix(':').and_then(|p| p.parse().ok());
            return (host, port);
        }
    }
    match addr.rsplit_once(':') {
        Some((host, port))
            if !host.is_empty()
                && !host.contains(':')
                && !port.is_empty()
                && port.bytes().all(|b| b.is_ascii_digit()) =>
        {
            (host, port.parse().ok())
        }
        _ => (addr, None),
    }
}

/// `ip:port`, or `[ip]:port` for IPv6 (0.5.x `joinAddr`).
pub fn join_addr(ip: IpAddr, port: u16) -> String {
    match unmap(ip) {
        IpAddr::V4(v4) => format!("{v4}:{port}"),
        IpAddr::V6(v6) => format!("[{v6}]:{port}"),
    }
}

/// An IPv4-mapped IPv6 address (`::ffff:a.b.c.d`) as the IPv4 address; anything else unchanged.
pub fn unmap(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V6(v6) => v6
            .to_ipv4_mapped()
            .map(IpAddr::V4)
            .unwrap_or(IpAddr::V6(v6)),
        v4 => v4,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    const NOW: i64 = 1_767_225_600_000;

    fn answer(key: &HostKey, challenge: &str, addrs: &[&str]) -> Value {
        let s = SignedStatus::sign(
            key,
            "alpha",
            challenge,
            addrs.iter().map(|a| a.to_string()).collect(),
            "0.1.0",
            NOW,
        );
        serde_json::to_value(&s).unwrap()
    }

    #[test]
    fn signed_status_round_trips_and_is_signed_over_the_status_object() {
        let key = HostKey::generate();
        let a = answer(&key, "c-1", &["10.0.0.5:7373"]);
        // Field order on the wire, as 0.5.x sends it.
        let s = SignedStatus::sign(&key, "alpha", "c-1", vec![], "0.1.0", NOW);
        let text = serde_json::to_string(&s).unwrap();
        assert!(
            text.starts_with(
                "{\"v\":1,\"service\":\"agentmbx\",\"host\":\"alpha\",\"host_pubkey\":"
            ),
            "{text}"
        );
        assert!(text.contains("\"challenge\":\"c-1\",\"addrs\":[],\"version\":\"0.1.0\",\"at\":\"2026-01-01T00:00:00.000Z\",\"sig\":"));
        let signed = canonical::to_string(&json!({
            "v": 1, "kind": "status", "host": "alpha", "host_pubkey": key.public().to_b64(),
            "challenge": "c-1", "addrs": ["10.0.0.5:7373"], "version": "0.1.0",
            "at": "2026-01-01T00:00:00.000Z",
        }))
        .unwrap();
        assert!(key
            .public()
            .verify(signed.as_bytes(), a["sig"].as_str().unwrap()));
        let ok = verify_status_for(
            &a,
            "alpha",
            &key.public(),
            "c-1",
            &["::ffff:10.0.0.5".parse().unwrap()],
        )
        .unwrap();
        assert_eq!(ok.addrs, vec!["10.0.0.5:7373"]);
    }

    #[test]
    fn every_fault_refuses_adoption() {
        let key = HostKey::generate();
        let pinned = key.public();
        let ip: IpAddr = "10.0.0.5".parse().unwrap();
        let a = answer(&key, "c-1", &["10.0.0.5:7373", "[fe80::1]:7373"]);
        let check = |a: &Value, host: &str, k: &PublicKey, c: &str, ips: &[IpAddr]| {
            verify_status_for(a, host, k, c, ips).map(|_| ())
        };
        assert_eq!(check(&a, "alpha", &pinned, "c-1", &[ip]), Ok(()));
        assert_eq!(
            check(&a, "alpha", &pinned, "c-2", &[ip]),
            Err(StatusError::WrongChallenge)
        );
        assert_eq!(
            check(&a, "beta", &pinned, "c-1", &[ip]),
            Err(StatusError::WrongHost("alpha".into()))
        );
        let other = HostKey::generate();
        assert_eq!(
            check(&a, "alpha", &other.public(), "c-1", &[ip]),
            Err(StatusError::WrongKey)
        );
        // Signed by another key while naming the pinned one.
        let mut forged = answer(&other, "c-1", &["10.0.0.5:7373"]);
        forged["host_pubkey"] = pinned.to_b64().into();
        assert_eq!(
            check(&forged, "alpha", &pinned, "c-1", &[ip]),
            Err(StatusError::BadSignature)
        );
        // A tampered address list breaks the signature.
        let mut tampered = a.clone();
        tampered["addrs"] = json!(["10.0.0.9:7373"]);
        assert_eq!(
            check(
                &tampered,
                "alpha",
                &pinned,
                "c-1",
                &["10.0.0.9".parse().unwrap()]
            ),
            Err(StatusError::BadSignature)
        );
        assert_eq!(
            check(&a, "alpha", &pinned, "c-1", &["10.0.0.6".parse().unwrap()]),
            Err(StatusError::NotListed)
        );
        assert_eq!(
            check(&a, "alpha", &pinned, "c-1", &[]),
            Err(StatusError::NotListed)
        );
        assert_eq!(
            check(&a, "alpha", &pinned, "c-1", &["fe80::1".parse().unwrap()]),
            Ok(())
        );
        let mut malformed = a.clone();
        malformed["addrs"] = json!([1]);
        assert_eq!(
            check(&malformed, "alpha", &pinned, "c-1", &[ip]),
            Err(StatusError::Malformed)
        );
        assert_eq!(
            check(
                &json!({"service": "agentmbx"}),
                "alpha",
                &pinned,
                "c-1",
                &[ip]
            ),
            Err(StatusError::Malformed)
        );
    }

    #[test]
    fn challenges_are_bounded_in_utf16_units() {
        assert!(valid_challenge("x") && valid_challenge(&"x".repeat(64)));
        assert!(!valid_challenge("") && !valid_challenge(&"x".repeat(65)));
        assert!(valid_challenge(&"é".repeat(64)), "64 units, 128 bytes");
        assert!(!valid_challenge(&"😀".repeat(33)), "66 units");
    }

    #[test]
    fn presence_bodies_are_read_as_0_5_x_reads_them() {
        let b = PresenceBody::new(NOW, 7373, vec!["10.0.0.5:7373".into()], "0.1.0");
        let v: Value = serde_json::from_str(&b.to_json()).unwrap();
        assert_eq!(PresenceBody::parse(&v), Ok(b));
        let ok = |v: Value| PresenceBody::parse(&v);
        assert_eq!(
            ok(json!({"v": 1, "seq": 5.0, "addrs": []})).map(|b| (b.seq, b.port)),
            Ok((5, None))
        );
        assert_eq!(
            ok(json!({"v": 1, "seq": 5, "port": "8080", "addrs": []})).map(|b| b.port),
            Ok(Some(8080))
        );
        assert_eq!(
            ok(json!({"v": 1, "seq": 5, "port": 70000, "addrs": []})).map(|b| b.port),
            Ok(None)
        );
        for bad in [
            json!({"v": 2, "seq": 5, "addrs": []}),
            json!({"v": 1, "seq": "x", "addrs": []}),
            json!({"v": 1, "seq": 5.5, "addrs": []}),
            json!({"v": 1, "seq": 9_007_199_254_740_992_i64, "addrs": []}),
            json!({"v": 1, "seq": 5}),
            json!({"v": 1, "seq": 5, "addrs": [1]}),
            json!({"v": 1, "seq": 5, "addrs": ["a".repeat(65)]}),
            json!({"v": 1, "seq": 5, "addrs": vec!["a"; 17]}),
            json!([]),
        ] {
            assert_eq!(PresenceBody::parse(&bad), Err(BadPresence), "{bad}");
        }
    }

    #[test]
    fn addresses_split_and_join_as_0_5_x() {
        assert_eq!(split_addr("10.0.0.5:7373"), ("10.0.0.5", Some(7373)));
        assert_eq!(split_addr("beta.local:7373"), ("beta.local", Some(7373)));
        assert_eq!(split_addr("beta.local"), ("beta.local", None));
        assert_eq!(split_addr("[fe80::1]:7373"), ("fe80::1", Some(7373)));
        assert_eq!(split_addr("fe80::1"), ("fe80::1", None));
        assert_eq!(split_addr("10.0.0.5:"), ("10.0.0.5:", None));
        let v6: IpAddr = "fe80::1".parse().unwrap();
        assert_eq!(join_addr(v6, 1), "[fe80::1]:1");
        let mapped: IpAddr = "::ffff:10.0.0.5".parse().unwrap();
        assert_eq!(join_addr(mapped, 1), "10.0.0.5:1");
        assert_eq!(unmap(mapped), "10.0.0.5".parse::<IpAddr>().unwrap());
    }
}
