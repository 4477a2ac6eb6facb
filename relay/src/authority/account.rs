//! The account-token authority (spec §8 "Hosted relay"; `wire.md` "Resolved details" →
//! "Account tokens"), `authorized_by = "account-token"`.
//!
//! # Tokens
//! A JWT from the account issuer, verified offline against the issuer's JWKS ([`super::jwks`]),
//! at most [`MAX_TOKEN_BYTES`] long. Header: `alg` one of the asymmetric algorithms the JWKS
//! key allows (EdDSA, ES256, ES384, RS256…; never `none` or HMAC), a `kid` the JWKS has, no
//! `crit`. Claims, each checked here against the relay's clock (the crate's own time checks are
//! off, they read the system clock):
//! - `iss` = the configured issuer; `aud` = the configured audience (the relay's public URL) as
//!   a string or a one-element array — a token for any other audience (the accounts API's) is
//!   refused;
//! - `sub`, `account`, `client_id`, `jti`: non-empty strings (≤ 256 bytes); `org` optional;
//! - `cnf.jkt`: an RFC 7638 SHA-256 thumbprint (43 base64url characters);
//! - `iat`, `exp`: integer seconds; `exp > now`, `iat ≤ now + 60 s`, `0 < exp − iat ≤
//!   max_token_ttl` (15 min by default and at most); `nbf`, when present, `≤ now + 60 s`. All
//!   arithmetic on these token-controlled integers is checked: an overflow is a refusal.
//!
//! # Enrolment
//! `proof = {token, cloud_cert, cloud_pop}` (`agentmbx_protocol::cloud_key`):
//! - the token as above;
//! - `cloud_cert`: the host key's certificate of its cloud key — `rec.host_pubkey` is the
//!   enrolling key and its signature verifies with that key;
//! - `cloud_pop`: the cloud key itself and its signature over canonical(`{v:1,
//!   type:"cloud-key-pop", host_pubkey, cloud_jkt, challenge}`) with this enrolment's
//!   challenge — proof that whoever enrols holds the private cloud key, fresh and usable once.
//!
//! The relay computes the thumbprint from `cloud_pop.cloud_pubkey` itself and requires it to
//! equal both `cnf.jkt` and `cloud_cert.rec.cloud_jkt`. So a stolen token with a certificate
//! the thief's own host key signed is refused: the thief lacks the cloud key. The store then
//! refuses a cloud key already bound to another live host key (409 CLOUD_KEY_TAKEN). The
//! answer carries the token's `account` and `org`, and the binding (`cnf.jkt`, `client_id`,
//! `sub`) the relay records with the enrolment. While the JWKS is stale (no successful fetch
//! for an hour) enrolments fail closed: the authority reports itself unavailable (503).
//!
//! # Hops
//! Every later hop carries `Authorization: Bearer <token>`, verified by the same rules
//! ([`EnrolmentAuthority::check_hop`]); `auth::authenticate` then compares it with the recorded
//! binding (cloud key and client_id) and account and with the deny-list. While the JWKS is stale a hop token is accepted
//! only if it was issued before the cache went stale: enrolled hosts keep working until the
//! token they held then expires, and no token minted later is accepted on keys the relay could
//! not re-check.
//!
//! Nothing here logs or returns a token; refusal texts name the failed check.

use jsonwebtoken::Validation;
use serde::Deserialize;
use serde_json::Value;

use agentmbx_protocol::clock::SharedClock;
use agentmbx_protocol::cloud_key::{self, CloudCert, CloudPop};
use agentmbx_protocol::keys::PublicKey;

use super::jwks::{Jwks, Lookup};
use super::{
    AuthorityError, Authorization, AuthorizeRequest, BoxFuture, EnrolmentAuthority, HopToken,
    HopTokenError, TokenBinding,
};
use crate::config::AuthorityConfig;
use crate::store::{AuthorityStrength, RelayStore};

/// The `authorized_by` text of this authority.
pub const NAME: &str = "account-token";

/// Longest token accepted (bytes).
pub const MAX_TOKEN_BYTES: usize = 8_192;

/// Longest token lifetime `exp − iat` (ms): 15 minutes (spec §8 "exp (≤ 15 min)"); the
/// configuration may lower it.
pub const MAX_TOKEN_TTL_MS: u64 = 900_000;

/// How far ahead of the relay's clock `iat` and `nbf` may be (s): issuer clock skew.
pub const CLOCK_SKEW_S: i64 = 60;

/// Longest text claim (bytes).
pub const MAX_CLAIM_BYTES: usize = 256;

/// The refusal of an enrolment without the three parts of the proof.
pub const PROOF_REQUIRED: &str =
    "this relay enrols with an account token: proof {token, cloud_cert, cloud_pop} is required";

/// What a verification is for: enrolments need a fresh JWKS, hops accept tokens issued before
/// it went stale.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Purpose {
    Enrol,
    Hop,
}

/// A token that failed: a refusal (the token is bad) or an unavailable issuer (the relay cannot
/// tell).
#[derive(Debug, Clone, PartialEq, Eq)]
enum Failure {
    Refused(String),
    Unavailable(String),
}

fn refused(why: impl Into<String>) -> Failure {
    Failure::Refused(why.into())
}

/// The claims this relay reads; any other claim is ignored.
#[derive(Debug, Clone, Deserialize)]
struct RawClaims {
    iss: String,
    aud: Audience,
    sub: String,
    account: String,
    #[serde(default)]
    org: Option<String>,
    cnf: Confirmation,
    client_id: String,
    iat: i64,
    exp: i64,
    jti: String,
    #[serde(default)]
    nbf: Option<i64>,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
enum Audience {
    One(String),
    Many(Vec<String>),
}

#[derive(Debug, Clone, Deserialize)]
struct Confirmation {
    jkt: String,
}

/// The checked claims of a token.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Claims {
    /// `sub`: the host id at the issuer.
    pub sub: String,
    /// `account`.
    pub account: String,
    /// `org`, when present.
    pub org: Option<String>,
    /// `cnf.jkt`.
    pub cnf_jkt: String,
    /// `client_id`.
    pub client_id: String,
    /// `iat`, ms.
    pub iat_ms: i64,
    /// `exp`, ms.
    pub exp_ms: i64,
}

/// The account authority: issuer, audience and the issuer's cached JWKS.
#[derive(Debug)]
pub struct AccountAuthority {
    issuer: String,
    audience: String,
    max_ttl_ms: i64,
    jwks: Jwks,
    clock: SharedClock,
}

impl AccountAuthority {
    /// From a validated `[authority]` with `kind = "account"`; the last good JWKS is kept in
    /// `store` when given ([`Jwks::new`]). Errors: a missing setting (the configuration check
    /// refuses these first) or the JWKS client cannot be built.
    pub fn new(
        config: &AuthorityConfig,
        clock: SharedClock,
        store: Option<std::sync::Arc<dyn RelayStore>>,
    ) -> Result<Self, AuthorityError> {
        let need = |v: &Option<String>, key: &str| {
            v.clone()
                .filter(|s| !s.is_empty())
                .ok_or_else(|| AuthorityError(format!("authority.{key} is required")))
        };
        let issuer = need(&config.issuer, "issuer")?;
        let audience = need(&config.audience, "audience")?;
        let jwks_url = need(&config.jwks_url, "jwks_url")?;
        let max_ttl_ms = config.max_token_ttl_ms.unwrap_or(MAX_TOKEN_TTL_MS);
        let jwks = Jwks::new(&jwks_url, clock.clone(), store).map_err(AuthorityError)?;
        Ok(AccountAuthority {
            issuer,
            audience,
            max_ttl_ms: i64::try_from(max_ttl_ms.min(MAX_TOKEN_TTL_MS)).unwrap_or(900_000),
            jwks,
            clock,
        })
    }

    /// The cached JWKS (inspection).
    pub fn jwks(&self) -> &Jwks {
        &self.jwks
    }

    /// Verifies `token` for `purpose` (module docs: every check).
    async fn verify(&self, token: &str, purpose: Purpose) -> Result<Claims, Failure> {
        if token.is_empty() || token.len() > MAX_TOKEN_BYTES {
            return Err(refused(format!(
                "not a token of 1..={MAX_TOKEN_BYTES} bytes"
            )));
        }
        let header =
            jsonwebtoken::decode_header(token).map_err(|_| refused("malformed token header"))?;
        if header.crit.is_some() {
            return Err(refused("critical header extensions are not supported"));
        }
        let kid = header
            .kid
            .clone()
            .filter(|k| !k.is_empty())
            .ok_or_else(|| refused("the token names no signing key (kid)"))?;
        let (key, stale_since) = match self.jwks.lookup(&kid).await {
            Lookup::Found {
                key,
                stale_since_ms,
            } => (key, stale_since_ms),
            Lookup::Unknown => return Err(refused("unknown signing key")),
            Lookup::Unavailable(why) => return Err(Failure::Unavailable(why)),
        };
        if purpose == Purpose::Enrol {
            if let Some(since) = stale_since {
                return Err(Failure::Unavailable(format!(
                    "the issuer's signing keys could not be refreshed since {}",
                    agentmbx_protocol::time::iso_ms(
                        since.saturating_sub(super::jwks::STALE_AFTER_MS)
                    )
                )));
            }
        }
        if header.alg != key.alg {
            return Err(refused(
                "the token's algorithm does not match its signing key",
            ));
        }
        let mut validation = Validation::new(key.alg);
        validation.validate_exp = false;
        validation.validate_nbf = false;
        validation.validate_aud = false;
        validation.required_spec_claims.clear();
        let data = jsonwebtoken::decode::<Value>(token, &key.key, &validation)
            .map_err(|_| refused("bad signature"))?;
        let claims = self.check_claims(data.claims)?;
        if let Some(since) = stale_since {
            // Purpose::Hop: only tokens issued before the keys went stale.
            if claims.iat_ms >= since {
                return Err(refused(
                    "the issuer's keys could not be refreshed; tokens issued since are not accepted",
                ));
            }
        }
        Ok(claims)
    }

    /// The claim checks of the module docs, against the relay's clock.
    fn check_claims(&self, claims: Value) -> Result<Claims, Failure> {
        let c: RawClaims =
            serde_json::from_value(claims).map_err(|_| refused("missing or mistyped claims"))?;
        if c.iss != self.issuer {
            return Err(refused("wrong issuer"));
        }
        let aud_ok = match &c.aud {
            Audience::One(a) => *a == self.audience,
            Audience::Many(v) => v.len() == 1 && v[0] == self.audience,
        };
        if !aud_ok {
            return Err(refused("wrong audience"));
        }
        for (name, v) in [
            ("sub", &c.sub),
            ("account", &c.account),
            ("client_id", &c.client_id),
            ("jti", &c.jti),
        ] {
            if v.is_empty() || v.len() > MAX_CLAIM_BYTES {
                return Err(refused(format!(
                    "{name} must be 1..={MAX_CLAIM_BYTES} bytes"
                )));
            }
        }
        if c.org.as_ref().is_some_and(|o| o.len() > MAX_CLAIM_BYTES) {
            return Err(refused(format!(
                "org must be at most {MAX_CLAIM_BYTES} bytes"
            )));
        }
        if !cloud_key::is_jkt(&c.cnf.jkt) {
            return Err(refused("cnf.jkt is not a key thumbprint"));
        }
        let now_s = self.clock.now_ms().div_euclid(1000);
        if c.exp <= now_s {
            return Err(refused("expired"));
        }
        let latest = now_s.saturating_add(CLOCK_SKEW_S);
        if c.iat > latest || c.nbf.is_some_and(|n| n > latest) {
            return Err(refused("not valid yet"));
        }
        let lifetime = || {
            refused(format!(
                "lifetime must be at most {} s",
                self.max_ttl_ms / 1000
            ))
        };
        // Token-controlled integers: every step checked (an `iat` far in the past would
        // overflow `exp − iat`).
        let ttl_ms = c
            .exp
            .checked_sub(c.iat)
            .and_then(|s| s.checked_mul(1000))
            .ok_or_else(lifetime)?;
        if ttl_ms <= 0 || ttl_ms > self.max_ttl_ms {
            return Err(lifetime());
        }
        // exp > now and 0 < exp − iat ≤ 15 min bound both, so these cannot overflow; checked
        // all the same.
        let (Some(iat_ms), Some(exp_ms)) = (c.iat.checked_mul(1000), c.exp.checked_mul(1000))
        else {
            return Err(lifetime());
        };
        Ok(Claims {
            sub: c.sub,
            account: c.account,
            org: c.org,
            cnf_jkt: c.cnf.jkt,
            client_id: c.client_id,
            iat_ms,
            exp_ms,
        })
    }

    async fn authorize_inner(
        &self,
        req: &AuthorizeRequest,
    ) -> Result<Authorization, AuthorityError> {
        let proof = req.proof.as_ref().and_then(Value::as_object);
        let (Some(Value::String(token)), Some(cert), Some(pop)) = (
            proof.and_then(|p| p.get("token")),
            proof.and_then(|p| p.get("cloud_cert")),
            proof.and_then(|p| p.get("cloud_pop")),
        ) else {
            return Ok(Authorization::deny(PROOF_REQUIRED));
        };
        let claims = match self.verify(token, Purpose::Enrol).await {
            Ok(c) => c,
            Err(Failure::Refused(why)) => {
                return Ok(Authorization::deny(format!("account token refused: {why}")))
            }
            Err(Failure::Unavailable(why)) => return Err(AuthorityError(why)),
        };
        let host = PublicKey::from_b64(&req.host_pubkey)
            .map_err(|_| AuthorityError("the enrolling key does not parse".to_owned()))?;
        let cert = match CloudCert::from_value(cert) {
            Ok(c) => c,
            Err(e) => return Ok(Authorization::deny(e.to_string())),
        };
        if let Err(e) = cert.check(&host, self.clock.now_ms()) {
            return Ok(Authorization::deny(e.to_string()));
        }
        // Possession of the cloud key, over this enrolment's challenge; the thumbprint is the
        // relay's own computation from the key presented.
        let proven_jkt =
            match CloudPop::from_value(pop).and_then(|p| p.check(&host, &req.challenge)) {
                Ok(jkt) => jkt,
                Err(e) => return Ok(Authorization::deny(e.to_string())),
            };
        if proven_jkt != cert.rec.cloud_jkt {
            return Ok(Authorization::deny(
                "the cloud-key proof of possession is for another cloud key than the certificate",
            ));
        }
        if proven_jkt != claims.cnf_jkt {
            return Ok(Authorization::deny(
                "account token refused: it is bound to another key",
            ));
        }
        Ok(Authorization {
            ok: true,
            account: Some(claims.account),
            org: claims.org,
            reason: None,
            binding: Some(TokenBinding {
                cloud_jkt: claims.cnf_jkt,
                client_id: claims.client_id,
                sub: claims.sub,
            }),
        })
    }
}

impl EnrolmentAuthority for AccountAuthority {
    fn name(&self) -> &'static str {
        NAME
    }

    fn strength(&self) -> AuthorityStrength {
        AuthorityStrength::Account
    }

    fn authorize<'a>(
        &'a self,
        req: &'a AuthorizeRequest,
    ) -> BoxFuture<'a, Result<Authorization, AuthorityError>> {
        Box::pin(self.authorize_inner(req))
    }

    fn wants_hop_token(&self) -> bool {
        true
    }

    fn check_hop<'a>(
        &'a self,
        bearer: Option<&'a str>,
        _host: &'a PublicKey,
    ) -> BoxFuture<'a, Result<Option<HopToken>, HopTokenError>> {
        Box::pin(async move {
            let token = bearer.ok_or(HopTokenError::Missing)?;
            match self.verify(token, Purpose::Hop).await {
                Ok(c) => Ok(Some(HopToken {
                    account: c.account,
                    client_id: c.client_id,
                    cnf_jkt: c.cnf_jkt,
                    exp_ms: c.exp_ms,
                })),
                Err(Failure::Refused(why)) => Err(HopTokenError::Refused(why)),
                Err(Failure::Unavailable(why)) => {
                    tracing::warn!(error = %why, "hop token not verifiable: the issuer's keys are unavailable");
                    Err(HopTokenError::Unavailable)
                }
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::AuthorityKind;
    use serde_json::json;

    const NOW_MS: i64 = 1_767_225_600_000;

    fn authority() -> AccountAuthority {
        let config = AuthorityConfig {
            kind: AuthorityKind::Account,
            issuer: Some("https://accounts.test".into()),
            jwks_url: Some("http://127.0.0.1:9/jwks".into()),
            audience: Some("https://relay.test".into()),
            max_token_ttl_ms: None,
        };
        let clock: SharedClock =
            std::sync::Arc::new(agentmbx_protocol::clock::ManualClock::new(NOW_MS));
        AccountAuthority::new(&config, clock, None).expect("authority")
    }

    fn claims(iat: Value, exp: Value) -> Value {
        json!({"iss": "https://accounts.test", "aud": "https://relay.test", "sub": "s",
               "account": "a", "cnf": {"jkt": "kPrK_qmxVWaYVA9wwBF6Iuo3vVzz7TxHCTwXBygrS4k"},
               "client_id": "c", "iat": iat, "exp": exp, "jti": "j"})
    }

    /// Token-controlled integers at the edges of i64 are refused, never overflowed.
    #[test]
    fn extreme_iat_and_exp_are_refused_without_overflow() {
        let a = authority();
        let now_s = NOW_MS / 1000;
        let lifetime = Failure::Refused("lifetime must be at most 900 s".into());
        for (iat, exp) in [
            (i64::MIN, now_s + 600),
            (i64::MIN, i64::MAX),
            (-1, i64::MAX),
            (now_s, i64::MAX),
        ] {
            assert_eq!(
                a.check_claims(claims(json!(iat), json!(exp))),
                Err(lifetime.clone()),
                "iat {iat}, exp {exp}"
            );
        }
        // The bound itself is fine.
        let ok = a
            .check_claims(claims(json!(now_s), json!(now_s + 900)))
            .expect("at the bound");
        assert_eq!((ok.iat_ms, ok.exp_ms), (now_s * 1000, (now_s + 900) * 1000));
        assert_eq!(
            a.check_claims(claims(json!(now_s), json!(now_s + 901))),
            Err(lifetime)
        );
    }
}
