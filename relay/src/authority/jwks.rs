//! The account issuer's signing keys (spec §8; `wire.md` "Resolved details" → "Account
//! tokens"): a JWKS fetched over HTTP(S) and cached by `kid`.
//!
//! # Refresh rules (all times from the relay's clock)
//! - The set is fetched on first use, then again when a lookup finds it [`REFRESH_EVERY_MS`]
//!   (10 min) old.
//! - A token naming an unknown `kid` triggers a fetch, at most once per
//!   [`UNKNOWN_KID_MIN_INTERVAL_MS`] (1 min) — counted from the last attempt of any kind, so a
//!   flood of made-up kids costs one fetch a minute.
//! - A successful fetch **replaces** the cache: a key that left the JWKS stops verifying at
//!   once.
//! - A failed fetch keeps the cache and is retried at most once a minute. The cached keys are
//!   *fresh* for [`STALE_AFTER_MS`] (1 h) after the last successful fetch; past that the
//!   account authority refuses new enrolments (fail closed) while hops from enrolled hosts are
//!   judged by [`Lookup::Found::stale_since_ms`] (see `account.rs`).
//!
//! # Across restarts
//! The last good JWKS document and its fetch time are kept in `relay.db` (meta
//! [`CACHE_META_KEY`], `{v:1, url, fetched_at_ms, jwks}`), written after every successful
//! fetch and loaded on the first lookup after a start (before any fetch). So a relay restarted
//! while the issuer is down keeps serving enrolled hosts, and the one-hour rule counts from the
//! persisted fetch time, not from the restart. A document for another JWKS URL, or one that no
//! longer parses, is ignored. A fetch time later than the relay's clock counts as now.
//!
//! # Fetch limits
//! One fetch at a time (others wait for it and reuse its result); [`FETCH_TIMEOUT`]; no
//! redirects; a body over [`MAX_JWKS_BYTES`] is refused; at most [`MAX_KEYS`] usable keys are
//! kept. Only asymmetric signing keys are used: OKP Ed25519 (`EdDSA`), EC P-256 (`ES256`) and
//! P-384 (`ES384`), RSA (`RS256` unless the JWK names another RSA algorithm). Symmetric (`oct`)
//! keys, keys without a `kid`, keys whose `use` is not `sig` and malformed keys are skipped, so
//! one bad entry does not take the others down.
//!
//! This module never logs key material or response bodies; errors name the URL's failure only.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, RwLock};
use std::time::Duration;

use jsonwebtoken::jwk::{AlgorithmParameters, EllipticCurve, Jwk, KeyAlgorithm, PublicKeyUse};
use jsonwebtoken::{Algorithm, DecodingKey};

use agentmbx_protocol::clock::SharedClock;

use crate::store::RelayStore;

/// The meta key of the persisted JWKS document (module docs, "Across restarts").
pub const CACHE_META_KEY: &str = "jwks_cache";

/// Periodic refresh (ms): 10 minutes.
pub const REFRESH_EVERY_MS: i64 = 600_000;
/// Least time between two fetches caused by unknown kids or retries after a failure (ms).
pub const UNKNOWN_KID_MIN_INTERVAL_MS: i64 = 60_000;
/// Cached keys are fresh this long after the last successful fetch (ms): 1 hour.
pub const STALE_AFTER_MS: i64 = 3_600_000;
/// Timeout of one JWKS fetch, connection included.
pub const FETCH_TIMEOUT: Duration = Duration::from_secs(5);
/// Largest JWKS body accepted (bytes).
pub const MAX_JWKS_BYTES: usize = 256 * 1024;
/// Most keys kept from one JWKS.
pub const MAX_KEYS: usize = 100;
/// Longest `kid` kept (bytes).
pub const MAX_KID_BYTES: usize = 256;

/// One usable signing key.
#[derive(Clone)]
pub struct CachedKey {
    /// The verification key.
    pub key: DecodingKey,
    /// The one algorithm tokens signed with it may name.
    pub alg: Algorithm,
}

impl std::fmt::Debug for CachedKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CachedKey")
            .field("alg", &self.alg)
            .finish_non_exhaustive()
    }
}

/// The answer of [`Jwks::lookup`].
#[derive(Debug, Clone)]
pub enum Lookup {
    /// The key for the kid. `stale_since_ms` is `None` while the cache is fresh, else the
    /// moment it went stale (last successful fetch + [`STALE_AFTER_MS`]).
    Found {
        /// The key.
        key: CachedKey,
        /// When the cache went stale, if it is.
        stale_since_ms: Option<i64>,
    },
    /// The JWKS was fetched and has no usable key with this kid.
    Unknown,
    /// No JWKS could ever be fetched; the text says why (no key material).
    Unavailable(String),
}

#[derive(Debug, Default)]
struct State {
    keys: HashMap<String, CachedKey>,
    last_success_ms: Option<i64>,
    last_attempt_ms: Option<i64>,
    last_error: Option<String>,
}

/// The cached JWKS of one issuer.
#[derive(Debug)]
pub struct Jwks {
    url: String,
    http: reqwest::Client,
    clock: SharedClock,
    state: RwLock<State>,
    /// Held while a fetch (or the load of the persisted document) runs, so concurrent lookups
    /// wait for one fetch instead of each starting their own.
    fetching: tokio::sync::Mutex<()>,
    /// Where the last good document is kept (`None`: memory only).
    store: Option<Arc<dyn RelayStore>>,
    /// Whether the persisted document was looked at (once, on the first lookup).
    loaded: AtomicBool,
}

/// The persisted form: `{v:1, url, fetched_at_ms, jwks}`.
#[derive(Debug, serde::Serialize, serde::Deserialize)]
struct Persisted {
    v: u8,
    url: String,
    fetched_at_ms: i64,
    jwks: serde_json::Value,
}

/// Why a fetch failed (for logs and `Lookup::Unavailable`).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("JWKS fetch from {url} failed: {why}")]
pub struct FetchError {
    url: String,
    why: String,
}

impl Jwks {
    /// A cache for the JWKS at `url` (nothing is fetched or read yet), keeping its last good
    /// document in `store` when given (module docs, "Across restarts"). Errors: the HTTP client
    /// cannot be built.
    pub fn new(
        url: &str,
        clock: SharedClock,
        store: Option<Arc<dyn RelayStore>>,
    ) -> Result<Self, String> {
        // reqwest is built without a default TLS provider (dependencies.md); idempotent.
        let _ = rustls::crypto::ring::default_provider().install_default();
        let http = reqwest::Client::builder()
            .timeout(FETCH_TIMEOUT)
            .connect_timeout(FETCH_TIMEOUT)
            .redirect(reqwest::redirect::Policy::none())
            .build()
            .map_err(|e| format!("cannot build the JWKS client: {e}"))?;
        Ok(Jwks {
            url: url.to_owned(),
            http,
            clock,
            state: RwLock::new(State::default()),
            fetching: tokio::sync::Mutex::new(()),
            store,
            loaded: AtomicBool::new(false),
        })
    }

    /// Loads the persisted document once (first lookup after a start): its keys and fetch time
    /// become the cache unless a fetch already succeeded. A missing, foreign or unreadable
    /// document changes nothing.
    async fn load_persisted(&self) {
        if self.loaded.load(Ordering::Acquire) {
            return;
        }
        let _one = self.fetching.lock().await;
        if self.loaded.load(Ordering::Acquire) {
            return;
        }
        self.read_persisted().await;
        // Set only once the cache holds what was read: a lookup that sees `loaded` finds it.
        self.loaded.store(true, Ordering::Release);
    }

    /// [`Self::load_persisted`]'s read (the caller holds `fetching`).
    async fn read_persisted(&self) {
        let Some(store) = self.store.clone() else {
            return;
        };
        let text = match tokio::task::spawn_blocking(move || store.meta(CACHE_META_KEY)).await {
            Ok(Ok(Some(text))) => text,
            Ok(Ok(None)) => return,
            Ok(Err(e)) => {
                tracing::warn!(error = %e, "cannot read the persisted JWKS; starting without it");
                return;
            }
            Err(_) => return,
        };
        let Ok(doc) = serde_json::from_str::<Persisted>(&text) else {
            tracing::warn!("the persisted JWKS is unreadable; ignored");
            return;
        };
        if doc.v != 1 || doc.url != self.url {
            tracing::info!("the persisted JWKS is for another JWKS URL; ignored");
            return;
        }
        let keys = match parse_jwks(doc.jwks.to_string().as_bytes()) {
            Ok(keys) => keys,
            Err(e) => {
                tracing::warn!(error = %e, "the persisted JWKS does not parse; ignored");
                return;
            }
        };
        let fetched_at = doc.fetched_at_ms.min(self.clock.now_ms());
        let mut s = self.state.write().unwrap_or_else(|p| p.into_inner());
        if s.last_success_ms.is_none() {
            tracing::info!(jwks = %self.url, keys = keys.len(), fetched_at = %agentmbx_protocol::time::iso_ms(fetched_at), "JWKS loaded from relay.db");
            s.keys = keys;
            s.last_success_ms = Some(fetched_at);
        }
    }

    /// Keeps `body` (a document that parsed) as the last good JWKS fetched at `at_ms`. A
    /// failure is logged; the in-memory cache is what serves.
    async fn persist(&self, body: serde_json::Value, at_ms: i64) {
        let Some(store) = self.store.clone() else {
            return;
        };
        let doc = Persisted {
            v: 1,
            url: self.url.clone(),
            fetched_at_ms: at_ms,
            jwks: body,
        };
        let Ok(text) = serde_json::to_string(&doc) else {
            return;
        };
        match tokio::task::spawn_blocking(move || store.set_meta(CACHE_META_KEY, &text)).await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => {
                tracing::warn!(error = %e, "cannot keep the JWKS in relay.db; a restart during an issuer outage will not have it")
            }
            Err(_) => tracing::warn!("cannot keep the JWKS in relay.db"),
        }
    }

    /// The key for `kid`, fetching the JWKS first when the refresh rules (module docs) call for
    /// it.
    pub async fn lookup(&self, kid: &str) -> Lookup {
        self.load_persisted().await;
        let now = self.clock.now_ms();
        let (due, may_retry) = {
            let s = self.read();
            let due = s
                .last_success_ms
                .is_none_or(|t| now.saturating_sub(t) >= REFRESH_EVERY_MS);
            (due, self.may_fetch(&s, now))
        };
        if due && may_retry {
            self.refresh(now).await;
        }
        if let Some(found) = self.found(kid, now) {
            return found;
        }
        let may_retry = self.may_fetch(&self.read(), now);
        if may_retry {
            self.refresh(now).await;
            if let Some(found) = self.found(kid, now) {
                return found;
            }
        }
        let s = self.read();
        match (s.last_success_ms, &s.last_error) {
            (Some(_), _) => Lookup::Unknown,
            (None, Some(e)) => Lookup::Unavailable(e.clone()),
            (None, None) => Lookup::Unavailable("the JWKS was never fetched".to_owned()),
        }
    }

    /// When the last fetch succeeded, in ms.
    pub fn last_success_ms(&self) -> Option<i64> {
        self.read().last_success_ms
    }

    /// The kids currently cached (sorted), for logs and tests.
    pub fn kids(&self) -> Vec<String> {
        let mut k: Vec<String> = self.read().keys.keys().cloned().collect();
        k.sort();
        k
    }

    fn read(&self) -> std::sync::RwLockReadGuard<'_, State> {
        // A panic while holding the lock cannot leave `State` inconsistent (each write is one
        // assignment), so a poisoned lock is still usable.
        self.state.read().unwrap_or_else(|p| p.into_inner())
    }

    fn may_fetch(&self, s: &State, now: i64) -> bool {
        s.last_attempt_ms
            .is_none_or(|t| now.saturating_sub(t) >= UNKNOWN_KID_MIN_INTERVAL_MS)
    }

    fn found(&self, kid: &str, now: i64) -> Option<Lookup> {
        let s = self.read();
        let key = s.keys.get(kid)?.clone();
        let stale_since = s
            .last_success_ms
            .map(|t| t.saturating_add(STALE_AFTER_MS))
            .filter(|&since| now > since);
        Some(Lookup::Found {
            key,
            stale_since_ms: stale_since,
        })
    }

    /// Fetches the JWKS unless another fetch attempted it since `decided_at_ms`.
    async fn refresh(&self, decided_at_ms: i64) {
        let _one = self.fetching.lock().await;
        let now = self.clock.now_ms();
        if self
            .read()
            .last_attempt_ms
            .is_some_and(|t| t >= decided_at_ms)
        {
            return; // Another lookup fetched while this one waited: use its result.
        }
        let result = self.fetch().await;
        let body = {
            let mut s = self.state.write().unwrap_or_else(|p| p.into_inner());
            s.last_attempt_ms = Some(now);
            match result {
                Ok((keys, body)) => {
                    tracing::info!(jwks = %self.url, keys = keys.len(), "JWKS refreshed");
                    s.keys = keys;
                    s.last_success_ms = Some(now);
                    s.last_error = None;
                    Some(body)
                }
                Err(e) => {
                    tracing::warn!(error = %e, cached_keys = s.keys.len(), "JWKS refresh failed; keeping the cached keys");
                    s.last_error = Some(e.to_string());
                    None
                }
            }
        };
        if let Some(body) = body {
            self.persist(body, now).await;
        }
    }

    /// Fetches and parses the JWKS: the usable keys and the document as JSON (for
    /// [`Self::persist`]).
    async fn fetch(&self) -> Result<(HashMap<String, CachedKey>, serde_json::Value), FetchError> {
        let fail = |why: String| FetchError {
            url: self.url.clone(),
            why,
        };
        let mut resp = self
            .http
            .get(&self.url)
            .header("accept", "application/json")
            .send()
            .await
            .map_err(|e| fail(describe(&e)))?;
        if resp.status().as_u16() != 200 {
            return Err(fail(format!("HTTP {}", resp.status().as_u16())));
        }
        if resp
            .content_length()
            .is_some_and(|n| n > MAX_JWKS_BYTES as u64)
        {
            return Err(fail(format!("body over {MAX_JWKS_BYTES} bytes")));
        }
        let mut body = Vec::new();
        while let Some(chunk) = resp.chunk().await.map_err(|e| fail(describe(&e)))? {
            if body.len() + chunk.len() > MAX_JWKS_BYTES {
                return Err(fail(format!("body over {MAX_JWKS_BYTES} bytes")));
            }
            body.extend_from_slice(&chunk);
        }
        let keys = parse_jwks(&body).map_err(fail)?;
        let doc = serde_json::from_slice(&body).map_err(|_| fail("the JWKS is not JSON".into()))?;
        Ok((keys, doc))
    }
}

/// A reqwest error in a few words, without the URL's query (a JWKS URL carries no secret, but
/// the error text stays short).
fn describe(e: &reqwest::Error) -> String {
    if e.is_timeout() {
        "timed out".to_owned()
    } else if e.is_connect() {
        "cannot connect".to_owned()
    } else if e.is_redirect() {
        "redirects are not followed".to_owned()
    } else {
        "request failed".to_owned()
    }
}

/// Parses a JWKS body `{keys:[…]}` into the usable keys by kid (module docs: which keys are
/// used). Errors: the body is not JSON or has no `keys` array.
pub fn parse_jwks(body: &[u8]) -> Result<HashMap<String, CachedKey>, String> {
    let value: serde_json::Value =
        serde_json::from_slice(body).map_err(|_| "the JWKS is not JSON".to_owned())?;
    let keys = value
        .get("keys")
        .and_then(serde_json::Value::as_array)
        .ok_or_else(|| "the JWKS has no keys array".to_owned())?;
    let mut out = HashMap::new();
    for raw in keys {
        if out.len() >= MAX_KEYS {
            tracing::warn!(
                max = MAX_KEYS,
                "JWKS has more keys than kept; the rest are ignored"
            );
            break;
        }
        let Ok(jwk) = serde_json::from_value::<Jwk>(raw.clone()) else {
            continue;
        };
        let Some(kid) = jwk.common.key_id.clone() else {
            continue;
        };
        if kid.is_empty() || kid.len() > MAX_KID_BYTES {
            continue;
        }
        if let Some(key) = usable(&jwk) {
            out.insert(kid, key);
        }
    }
    Ok(out)
}

/// The key and its one algorithm, or `None` for a key this relay does not use.
fn usable(jwk: &Jwk) -> Option<CachedKey> {
    if jwk
        .common
        .public_key_use
        .as_ref()
        .is_some_and(|u| *u != PublicKeyUse::Signature)
    {
        return None;
    }
    let named = jwk.common.key_algorithm;
    let alg = match &jwk.algorithm {
        AlgorithmParameters::OctetKeyPair(p) if p.curve == EllipticCurve::Ed25519 => {
            Algorithm::EdDSA
        }
        AlgorithmParameters::EllipticCurve(p) => match p.curve {
            EllipticCurve::P256 => Algorithm::ES256,
            EllipticCurve::P384 => Algorithm::ES384,
            _ => return None,
        },
        AlgorithmParameters::RSA(_) => match named {
            None | Some(KeyAlgorithm::RS256) => Algorithm::RS256,
            Some(KeyAlgorithm::RS384) => Algorithm::RS384,
            Some(KeyAlgorithm::RS512) => Algorithm::RS512,
            Some(KeyAlgorithm::PS256) => Algorithm::PS256,
            Some(KeyAlgorithm::PS384) => Algorithm::PS384,
            Some(KeyAlgorithm::PS512) => Algorithm::PS512,
            Some(_) => return None,
        },
        // Symmetric keys never verify account tokens; unknown key types are skipped.
        _ => return None,
    };
    // A JWK that names an algorithm must name this one.
    if let Some(named) = named {
        if Algorithm::try_from(named).ok() != Some(alg) {
            return None;
        }
    }
    let key = DecodingKey::from_jwk(jwk).ok()?;
    Some(CachedKey { key, alg })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn only_usable_signing_keys_with_a_kid_are_kept() {
        let ed = json!({"kty":"OKP","crv":"Ed25519","x":"11qYAYKxCrfVS_7TyWQHOg7hcvPapiMlrwIaaPcHURo","kid":"ed","use":"sig","alg":"EdDSA"});
        let body = json!({"keys": [
            ed,
            {"kty":"OKP","crv":"Ed25519","x":"11qYAYKxCrfVS_7TyWQHOg7hcvPapiMlrwIaaPcHURo"},
            {"kty":"OKP","crv":"Ed25519","x":"11qYAYKxCrfVS_7TyWQHOg7hcvPapiMlrwIaaPcHURo","kid":"enc","use":"enc"},
            {"kty":"OKP","crv":"Ed25519","x":"11qYAYKxCrfVS_7TyWQHOg7hcvPapiMlrwIaaPcHURo","kid":"mislabelled","alg":"ES256"},
            {"kty":"oct","k":"c2VjcmV0","kid":"hmac"},
            {"kty":"EC","crv":"P-256","kid":"no-y","x":"AAAA"},
            {"kty":"XYZ","kid":"future"},
            "not a key",
        ]});
        let keys = parse_jwks(body.to_string().as_bytes()).expect("parse");
        let mut kids: Vec<&String> = keys.keys().collect();
        kids.sort();
        assert_eq!(kids, vec!["ed"]);
        assert_eq!(keys["ed"].alg, Algorithm::EdDSA);
        assert!(parse_jwks(b"[]").is_err());
        assert!(parse_jwks(b"nope").is_err());
        assert!(parse_jwks(br#"{"keys":[]}"#).expect("empty").is_empty());
    }

    #[test]
    fn at_most_max_keys_are_kept() {
        let keys: Vec<serde_json::Value> = (0..MAX_KEYS + 5)
            .map(|i| json!({"kty":"OKP","crv":"Ed25519","x":"11qYAYKxCrfVS_7TyWQHOg7hcvPapiMlrwIaaPcHURo","kid":format!("k{i}")}))
            .collect();
        let parsed = parse_jwks(json!({ "keys": keys }).to_string().as_bytes()).expect("parse");
        assert_eq!(parsed.len(), MAX_KEYS);
    }

    /// A JWKS endpoint that redirects, or answers a body over the cap, is refused; the cache
    /// stays empty and the lookup says why.
    #[tokio::test]
    async fn redirects_and_oversized_bodies_are_refused() {
        use axum::response::IntoResponse;
        let good = json!({"keys": [{"kty":"OKP","crv":"Ed25519","kid":"k","x":"11qYAYKxCrfVS_7TyWQHOg7hcvPapiMlrwIaaPcHURo"}]}).to_string();
        let big = format!("{{\"keys\":[],\"pad\":\"{}\"}}", "x".repeat(MAX_JWKS_BYTES));
        let app = axum::Router::new()
            .route("/good", axum::routing::get(move || async move { good }))
            .route("/big", axum::routing::get(move || async move { big }))
            .route(
                "/redirect",
                axum::routing::get(|| async {
                    (axum::http::StatusCode::FOUND, [("location", "/good")]).into_response()
                }),
            );
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let base = format!("http://{}", listener.local_addr().expect("addr"));
        let server = tokio::spawn(async move {
            let _ = axum::serve(listener, app).await;
        });
        let clock: SharedClock = std::sync::Arc::new(agentmbx_protocol::clock::ManualClock::new(0));
        for (path, why) in [
            ("/redirect", "HTTP 302"),
            ("/big", "body over 262144 bytes"),
        ] {
            let jwks = Jwks::new(&format!("{base}{path}"), clock.clone(), None).expect("client");
            match jwks.lookup("k").await {
                Lookup::Unavailable(e) => assert!(e.contains(why), "{path}: {e}"),
                other => panic!("{path}: {other:?}"),
            }
            assert!(jwks.kids().is_empty());
        }
        let jwks = Jwks::new(&format!("{base}/good"), clock, None).expect("client");
        assert!(matches!(
            jwks.lookup("k").await,
            Lookup::Found {
                stale_since_ms: None,
                ..
            }
        ));
        assert_eq!(jwks.kids(), vec!["k".to_owned()]);
        server.abort();
    }
}
