//! Enrolment authorities (spec §8; `wire.md` §3.2 "Enrolment", "Resolved details" → "Account
//! tokens"): who may enrol a host key on this relay, and — for the account authority — what
//! every later hop must carry.
//!
//! `POST /v1/relay/enrol` first checks possession of the host key (the challenge signature,
//! [`challenge`]), then asks the configured [`EnrolmentAuthority`]:
//! `authorize({host_name, host_pubkey, owner_fp, proof}) → {ok, account?, org?, reason?}`.
//! The answer is stored with the enrolment (`account`, `authorized_by`, its
//! [`AuthorityStrength`]), and quotas and name uniqueness then use the account. An authority
//! that fails (its issuer cannot be reached, …) refuses with 503 `AUTHORITY_UNAVAILABLE` and a
//! `Retry-After` ([`UNAVAILABLE`], [`UNAVAILABLE_RETRY_S`]): the host retries later and never
//! takes it for a denial.
//!
//! Two implementations:
//! - [`challenge::HostKeyChallenge`] (default, self-hosted relays): admits every key that proved
//!   possession; `authorized_by = "host-key-challenge"`, no account.
//! - [`account::AccountAuthority`] (hosted relays): a short-lived JWT from the account issuer,
//!   verified offline against the issuer's JWKS ([`jwks`], cached in `relay.db` across
//!   restarts) and bound to the host through its certified cloud key and a proof of possession
//!   of that key over the enrolment's challenge; `authorized_by = "account-token"`, the token's
//!   `account`. On such a relay every later hop also carries `Authorization: Bearer <token>`
//!   ([`EnrolmentAuthority::check_hop`], called by `auth::authenticate`).
//!
//! The deny-list (host fingerprint or client_id) is not an authority: it is checked by the
//! enrol handler and `authenticate` against the store, whichever authority is configured.
//!
//! This module decides and verifies; it never writes enrolments or bindings (the only thing it
//! keeps in the store is the last good JWKS document, `meta.jwks_cache`), and it never logs or
//! returns a token, a key or a body (refusal reasons name the failed check only).

pub mod account;
pub mod challenge;
pub mod jwks;

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;

use agentmbx_protocol::clock::SharedClock;
use agentmbx_protocol::keys::PublicKey;

use crate::config::{AuthorityConfig, AuthorityKind};
use crate::store::{AuthorityStrength, RelayStore};

/// A boxed, sendable future (the trait is used as `Arc<dyn EnrolmentAuthority>`).
pub type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// The reason given when an authority fails rather than answers (spec §8, `wire.md` §3.2: "a
/// throw = deny"): 503 `{error, code:"AUTHORITY_UNAVAILABLE", retry_after}` with `Retry-After`,
/// so a host backs off and retries instead of taking it for a denial.
pub const UNAVAILABLE: &str = "the enrolment authority is unavailable";

/// The code of an [`UNAVAILABLE`] answer (HTTP 503).
pub const UNAVAILABLE_CODE: &str = "AUTHORITY_UNAVAILABLE";

/// The `Retry-After` (s) of an [`UNAVAILABLE`] answer: the JWKS is fetched again at most once
/// a minute (`jwks::UNKNOWN_KID_MIN_INTERVAL_MS`), so an earlier retry cannot succeed sooner.
pub const UNAVAILABLE_RETRY_S: u64 = 60;

/// What an enrolment asks the authority (`authorize({host_name, host_pubkey, owner_fp,
/// proof})`, spec §8). The host key already proved possession (challenge signature).
#[derive(Debug, Clone)]
pub struct AuthorizeRequest {
    /// The host's name (a label; checked `HOST_RE`).
    pub host_name: String,
    /// The enrolling host key, canonical standard base64.
    pub host_pubkey: String,
    /// The host's unproven owner claim ("" when none).
    pub owner_fp: String,
    /// The challenge this enrolment consumed (already signed by the host key): fresh and single
    /// use, so a proof bound to it cannot be replayed into another enrolment.
    pub challenge: String,
    /// The enrolment body's `proof`, as sent (`None` when absent). The account authority expects
    /// `{token, cloud_cert, cloud_pop}`.
    pub proof: Option<serde_json::Value>,
}

/// The authority's answer `{ok, account?, org?, reason?}` (spec §8), plus what the relay must
/// record with the enrolment.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Authorization {
    /// Whether the host may enrol.
    pub ok: bool,
    /// The proven account (unique names and quotas are per account).
    pub account: Option<String>,
    /// The proven organisation, if any.
    pub org: Option<String>,
    /// Why not (when `ok` is false), for the 403 DENIED answer.
    pub reason: Option<String>,
    /// What an account authority proved about the host's token binding; stored in
    /// `account_bindings` with the enrolment.
    pub binding: Option<TokenBinding>,
}

impl Authorization {
    /// A denial with `reason`.
    pub fn deny(reason: impl Into<String>) -> Self {
        Authorization {
            ok: false,
            account: None,
            org: None,
            reason: Some(reason.into()),
            binding: None,
        }
    }
}

/// The token facts recorded at enrolment and checked on every hop of an account relay.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TokenBinding {
    /// `cnf.jkt`, equal to the certified cloud key's thumbprint.
    pub cloud_jkt: String,
    /// The token's `client_id` (deny-list key; every later hop token must carry the same).
    pub client_id: String,
    /// The token's `sub` (the host id at the issuer).
    pub sub: String,
}

/// A verified hop token (account relays): the claims `authenticate` compares with what the
/// enrolment recorded and with the deny-list.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HopToken {
    /// The token's `account`.
    pub account: String,
    /// The token's `client_id`.
    pub client_id: String,
    /// The token's `cnf.jkt`.
    pub cnf_jkt: String,
    /// The token's `exp`, in ms.
    pub exp_ms: i64,
}

/// Why a hop's token was refused (401 on the hop; the texts are the answer's `error`).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum HopTokenError {
    /// No `Authorization: Bearer` header on a relay that requires one.
    #[error("an account token is required on this relay (Authorization: Bearer)")]
    Missing,
    /// The token failed a check; the text names the check, never the token.
    #[error("account token refused: {0}")]
    Refused(String),
    /// The token cannot be checked now: the issuer's signing keys were never fetched (503
    /// `AUTHORITY_UNAVAILABLE`; the host retries, its token stays valid).
    #[error("{}", UNAVAILABLE)]
    Unavailable,
}

/// An authority that failed instead of answering; the relay denies with [`UNAVAILABLE`] and
/// logs the detail (which never holds a token).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct AuthorityError(pub String);

/// An enrolment authority (spec §8). Implementations are shared across requests
/// (`Arc<dyn EnrolmentAuthority>` in `RelayState`).
pub trait EnrolmentAuthority: Send + Sync + std::fmt::Debug {
    /// The name stored as the enrolment's `authorized_by` (e.g. `host-key-challenge`).
    fn name(&self) -> &'static str;

    /// How strong an admission by this authority is (a weaker one never overwrites a stronger
    /// one's account).
    fn strength(&self) -> AuthorityStrength;

    /// Decides whether the host may enrol. `Err` means the authority could not decide; the
    /// relay denies with [`UNAVAILABLE`].
    fn authorize<'a>(
        &'a self,
        req: &'a AuthorizeRequest,
    ) -> BoxFuture<'a, Result<Authorization, AuthorityError>>;

    /// Whether every hop must carry `Authorization: Bearer <token>` ([`Self::check_hop`]).
    /// The default: no (the `Authorization` header of a hop is then not looked at).
    fn wants_hop_token(&self) -> bool {
        false
    }

    /// Checks the bearer token of a hop signed by `host` (already verified). `Ok(None)`: this
    /// authority needs no token on hops (the host-key challenge). The default needs none.
    fn check_hop<'a>(
        &'a self,
        bearer: Option<&'a str>,
        host: &'a PublicKey,
    ) -> BoxFuture<'a, Result<Option<HopToken>, HopTokenError>> {
        let _ = (bearer, host);
        Box::pin(async { Ok(None) })
    }
}

/// Builds the authority `relay.toml`'s `[authority]` asks for (validated by
/// `RelayConfig::validate`). The account authority keeps its last good JWKS in `store`
/// (`meta.jwks_cache`, [`jwks`]), so a restart while the issuer is down keeps enrolled hosts
/// working. Errors: the HTTP client for the JWKS cannot be built.
pub fn from_config(
    config: &AuthorityConfig,
    clock: SharedClock,
    store: Arc<dyn RelayStore>,
) -> Result<Arc<dyn EnrolmentAuthority>, AuthorityError> {
    Ok(match config.kind {
        AuthorityKind::HostKeyChallenge => Arc::new(challenge::HostKeyChallenge),
        AuthorityKind::Account => {
            Arc::new(account::AccountAuthority::new(config, clock, Some(store))?)
        }
    })
}
