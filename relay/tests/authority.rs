//! Enrolment authorities over HTTP (spec §8; `wire.md` "Resolved details" → "Account tokens"):
//! the account-token authority against a JWKS served on 127.0.0.1 by this test, token binding
//! through the host-certified cloud key, the deny-list, names per account, authority strength,
//! and the admin endpoints.
//!
//! Every relay here runs on a [`ManualClock`]; the JWKS cache refreshes on that clock, so the
//! 1-minute, 10-minute and 1-hour rules are crossed by moving it.
#![allow(clippy::unwrap_used)] // Tests may unwrap (clippy.toml).

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use axum::http::StatusCode;
use axum::response::IntoResponse;
use jsonwebtoken::{Algorithm, EncodingKey, Header};
use serde_json::{json, Value};

use agentmbx_protocol::cloud_key::{self, CloudCert, CloudPop};
use agentmbx_protocol::keys::HostKey;

use agentmbx_relay::config::{AdminToken, AuthorityConfig, AuthorityKind, RelayConfig};
use agentmbx_relay::ratelimit::RateConfig;
use agentmbx_relay::store::{AuthorityStrength, DenyKind};

use crate::helper::*;

const ISSUER: &str = "https://accounts.test";
const AUDIENCE: &str = "https://relay.test";
const ADMIN: &str = "admin-token-0123456789abcdef";
const MIN_MS: i64 = 60_000;

/// A fixed P-256 key (PKCS#8 DER, base64) and its public JWK coordinates: ES256 tokens.
const EC_PKCS8: &str = "MIGHAgEAMBMGByqGSM49AgEGCCqGSM49AwEHBG0wawIBAQQg6HeUuQLhCPrJt2RlDjxGvWhww/EGL/9iILsZMSAYz6qhRANCAAQFSfGz/vL418D1bRKHySZUaNQ2avwWBHOxUPYwv10ioUTCga2s3aWx/1bOdlXI/uc1vhwZOkL4DIpAt/PqASb3";
const EC_X: &str = "BUnxs_7y-NfA9W0Sh8kmVGjUNmr8FgRzsVD2ML9dIqE";
const EC_Y: &str = "RMKBrazdpbH_Vs52Vcj-5zW-HBk6QvgMikC38-oBJvc";

// ---- the issuer and its JWKS server ------------------------------------------------------------

/// An issuer signing key: Ed25519 (`EdDSA`) or the fixed P-256 key (`ES256`).
struct SigningKey {
    kid: String,
    alg: Algorithm,
    encoding: EncodingKey,
    jwk: Value,
}

impl SigningKey {
    fn ed(kid: &str) -> SigningKey {
        let key = HostKey::generate();
        let seed = agentmbx_protocol::b64::decode(&key.seed_b64_secret()).unwrap();
        // PKCS#8 v1 wrapping of an Ed25519 seed (RFC 8410).
        let mut der = hex::decode("302e020100300506032b657004220420").unwrap();
        der.extend_from_slice(&seed);
        SigningKey {
            kid: kid.to_owned(),
            alg: Algorithm::EdDSA,
            encoding: EncodingKey::from_ed_der(&der),
            jwk: json!({"kty": "OKP", "crv": "Ed25519", "use": "sig", "alg": "EdDSA", "kid": kid,
                "x": agentmbx_protocol::b64::encode_url(key.public().as_bytes())}),
        }
    }

    fn ec(kid: &str) -> SigningKey {
        let der = agentmbx_protocol::b64::decode(EC_PKCS8).unwrap();
        SigningKey {
            kid: kid.to_owned(),
            alg: Algorithm::ES256,
            encoding: EncodingKey::from_ec_der(&der),
            jwk: json!({"kty": "EC", "crv": "P-256", "kid": kid, "x": EC_X, "y": EC_Y}),
        }
    }

    fn sign(&self, claims: &Value) -> String {
        let mut header = Header::new(self.alg);
        header.kid = Some(self.kid.clone());
        jsonwebtoken::encode(&header, claims, &self.encoding).unwrap()
    }
}

/// What the JWKS server answers: a key set, or 503.
struct JwksState {
    keys: Mutex<Option<Vec<Value>>>,
    fetches: AtomicUsize,
}

struct JwksServer {
    url: String,
    state: Arc<JwksState>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for JwksServer {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl JwksServer {
    async fn start(keys: &[&SigningKey]) -> JwksServer {
        let state = Arc::new(JwksState {
            keys: Mutex::new(Some(keys.iter().map(|k| k.jwk.clone()).collect())),
            fetches: AtomicUsize::new(0),
        });
        let s = state.clone();
        let app = axum::Router::new().route(
            "/jwks",
            axum::routing::get(move || {
                let s = s.clone();
                async move {
                    s.fetches.fetch_add(1, Ordering::SeqCst);
                    match s.keys.lock().unwrap().clone() {
                        Some(keys) => axum::Json(json!({ "keys": keys })).into_response(),
                        None => StatusCode::SERVICE_UNAVAILABLE.into_response(),
                    }
                }
            }),
        );
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}/jwks", listener.local_addr().unwrap());
        let task = tokio::spawn(async move {
            let _ = axum::serve(listener, app).await;
        });
        JwksServer { url, state, task }
    }

    fn serve(&self, keys: &[&SigningKey]) {
        *self.state.keys.lock().unwrap() = Some(keys.iter().map(|k| k.jwk.clone()).collect());
    }

    fn fail(&self) {
        *self.state.keys.lock().unwrap() = None;
    }

    fn fetches(&self) -> usize {
        self.state.fetches.load(Ordering::SeqCst)
    }
}

fn account_config(jwks: &JwksServer) -> RelayConfig {
    RelayConfig {
        authority: AuthorityConfig {
            kind: AuthorityKind::Account,
            issuer: Some(ISSUER.into()),
            jwks_url: Some(jwks.url.clone()),
            audience: Some(AUDIENCE.into()),
            max_token_ttl_ms: None,
        },
        rate: RateConfig {
            enrol_per_min: 100_000,
            ..RateConfig::default()
        },
        admin_token: Some(AdminToken::new(ADMIN).unwrap()),
        ..RelayConfig::default()
    }
}

// ---- hosts with cloud keys ---------------------------------------------------------------------

/// A host, its cloud key and the host key's certificate of it.
struct CloudHost {
    host: Host,
    cloud: HostKey,
    cert: CloudCert,
}

impl CloudHost {
    fn new(name: &str) -> CloudHost {
        let host = Host::new(name);
        let cloud = HostKey::generate();
        let cert = CloudCert::sign(&host.key, &cloud.public(), T0);
        CloudHost { host, cloud, cert }
    }

    fn jkt(&self) -> String {
        cloud_key::thumbprint(&self.cloud.public())
    }

    /// Token claims for this host in `account`, issued at the relay's time, valid 10 min.
    fn claims(&self, relay: &Relay, account: &str) -> Value {
        let now = relay.now() / 1000;
        json!({
            "iss": ISSUER, "aud": AUDIENCE, "sub": format!("host-{}", self.host.name),
            "account": account, "org": "org-1", "cnf": {"jkt": self.jkt()},
            "client_id": format!("client-{}", self.host.name),
            "iat": now, "exp": now + 600, "jti": new_id(relay.now()),
        })
    }

    /// The enrolment proof for `challenge`: the token, the certificate and the cloud key's
    /// proof of possession over the challenge.
    fn proof(&self, token: &str, challenge: &str) -> Value {
        json!({"token": token, "cloud_cert": self.cert.to_value(),
               "cloud_pop": CloudPop::sign(&self.cloud, &self.host.key.public(), challenge).to_value()})
    }
}

/// Challenge, then enrol `h` with `token` and its full proof.
async fn enrol_try(relay: &Relay, h: &CloudHost, token: &str) -> Resp {
    relay
        .enrol_with_challenge_proof(&h.host, |c| Some(h.proof(token, c)))
        .await
}

trait Unavailable {
    /// 503 AUTHORITY_UNAVAILABLE with `retry_after` 60 (and the same `Retry-After` header).
    fn assert_unavailable(&self);
}

impl Unavailable for Resp {
    fn assert_unavailable(&self) {
        self.assert_error(
            503,
            "the enrolment authority is unavailable",
            "AUTHORITY_UNAVAILABLE",
        );
        assert_eq!(self.json["retry_after"], 60, "{self:#?}");
    }
}

fn bearer(token: &str) -> Vec<(String, String)> {
    vec![("authorization".into(), format!("Bearer {token}"))]
}

/// Enrols `h` with `token` and asserts success.
async fn enrol_ok(relay: &Relay, h: &CloudHost, token: &str) {
    let r = enrol_try(relay, h, token).await;
    assert_eq!(r.json, json!({"ok": true}), "{r:#?}");
}

async fn pull(relay: &Relay, h: &CloudHost, token: Option<&str>) -> Resp {
    let extra = token.map(bearer).unwrap_or_default();
    relay
        .hop_with(&h.host, "GET", "/v2/relay/items?after=0", "", &extra)
        .await
}

async fn enrolment(relay: &Relay, h: &CloudHost) -> agentmbx_relay::store::Enrolment {
    let pk = h.host.pubkey();
    relay
        .with_store(move |s| s.enrolment(&pk).unwrap())
        .await
        .expect("enrolled")
}

async fn admin(relay: &Relay, method: &str, path: &str, body: Value, token: Option<&str>) -> Resp {
    let mut headers = vec![("content-type".to_owned(), "application/json".to_owned())];
    if let Some(t) = token {
        headers.push(("authorization".into(), format!("Bearer {t}")));
    }
    let bytes = if method == "GET" {
        Vec::new()
    } else {
        body.to_string().into_bytes()
    };
    relay.send(method, path, &headers, bytes).await
}

// ---- tests ---------------------------------------------------------------------------------------

#[tokio::test]
async fn an_account_token_enrols_with_its_account_and_every_hop_carries_it() {
    let (ed, ec) = (SigningKey::ed("ed-1"), SigningKey::ec("ec-1"));
    let jwks = JwksServer::start(&[&ed, &ec]).await;
    let relay = Relay::start_with_config(account_config(&jwks)).await;
    let (a, b) = (CloudHost::new("alpha"), CloudHost::new("beta"));
    let ta = ed.sign(&a.claims(&relay, "acct-1"));
    let tb = ec.sign(&b.claims(&relay, "acct-2"));
    enrol_ok(&relay, &a, &ta).await;
    enrol_ok(&relay, &b, &tb).await;

    // The answer is stored with the enrolment: account, authorized_by, strength, binding.
    let e = enrolment(&relay, &a).await;
    assert_eq!(e.account.as_deref(), Some("acct-1"));
    assert_eq!(e.authorized_by, "account-token");
    assert_eq!(e.strength, AuthorityStrength::Account);
    let pk = a.host.pubkey();
    let binding = relay
        .with_store(move |s| s.account_binding(&pk).unwrap())
        .await
        .expect("binding");
    assert_eq!(binding.cloud_jkt, a.jkt());
    assert_eq!(binding.client_id, "client-alpha");
    assert_eq!(binding.org.as_deref(), Some("org-1"));
    assert_eq!(
        enrolment(&relay, &b).await.account.as_deref(),
        Some("acct-2")
    );

    // Mail moves between the two with tokens on every hop.
    let (id, wire) = sealed_wire(&a.host, &b.host, "hello", relay.now());
    let body = json!({"items": [env_item(&id, &b.host, &wire)]}).to_string();
    let r = relay
        .hop_with(&a.host, "POST", "/v2/relay/items", &body, &bearer(&ta))
        .await;
    assert_eq!(r.statuses(), vec!["accepted"], "{r:#?}");
    let r = pull(&relay, &b, Some(&tb)).await;
    assert_eq!(r.assert_ok()["items"][0]["item_id"], id.as_str(), "{r:#?}");

    // Without a token, with another scheme or with junk: 401.
    pull(&relay, &b, None).await.assert_error(
        401,
        "an account token is required on this relay (Authorization: Bearer)",
        "TOKEN_REQUIRED",
    );
    let r = relay
        .hop_with(
            &b.host,
            "GET",
            "/v2/relay/items?after=0",
            "",
            &[("authorization".into(), format!("Basic {tb}"))],
        )
        .await;
    r.assert_error(
        401,
        "the Authorization header must be Bearer <token>",
        "BAD_TOKEN",
    );
    pull(&relay, &b, Some("a.b.c")).await.assert_error(
        401,
        "account token refused: malformed token header",
        "BAD_TOKEN",
    );
    pull(&relay, &b, Some(&"x".repeat(8193)))
        .await
        .assert_error(
            401,
            "account token refused: not a token of 1..=8192 bytes",
            "BAD_TOKEN",
        );
    // Signed info without a token (a host's first info of a pass, sent before it has seen the
    // relay key): `you` all the same, for a key enrolled with an account token; with a token
    // that fails: no `you` (the host enrols again).
    let r = relay
        .hop_with(&a.host, "GET", "/v2/relay/info", "", &[])
        .await;
    assert_eq!(r.assert_ok()["you"]["pubkey"], a.host.pubkey().as_str());
    let r = relay
        .hop_with(&a.host, "GET", "/v2/relay/info", "", &bearer("a.b.c"))
        .await;
    assert!(r.assert_ok().get("you").is_none(), "{r:#?}");
    let r = relay
        .hop_with(&a.host, "GET", "/v2/relay/info", "", &bearer(&ta))
        .await;
    assert_eq!(r.assert_ok()["you"]["pubkey"], a.host.pubkey().as_str());

    // A hop with another host's valid token (bound to its cloud key): refused.
    pull(&relay, &a, Some(&tb)).await.assert_error(
        401,
        "account token refused: it is bound to another key",
        "BAD_TOKEN",
    );
    // A token of another account, bound to this host's cloud key: refused on hops until the
    // host enrols with it, which moves it to that account (same strength).
    let other_account = ed.sign(&a.claims(&relay, "acct-9"));
    pull(&relay, &a, Some(&other_account)).await.assert_error(
        401,
        "account token refused: it is for another account",
        "BAD_TOKEN",
    );
    enrol_ok(&relay, &a, &other_account).await;
    assert_eq!(
        enrolment(&relay, &a).await.account.as_deref(),
        Some("acct-9")
    );
    pull(&relay, &a, Some(&other_account)).await.assert_ok();

    // A host enrolled before without an account token (host-key challenge) must enrol again.
    let c = CloudHost::new("gamma");
    relay.enrol_direct(&c.host).await;
    let r = relay
        .hop_with(&c.host, "GET", "/v2/relay/info", "", &[])
        .await;
    assert!(r.assert_ok().get("you").is_none(), "no binding: {r:#?}");
    let tc = ed.sign(&c.claims(&relay, "acct-1"));
    pull(&relay, &c, Some(&tc)).await.assert_error(
        401,
        "not enrolled with an account token on this relay",
        "NOT_ENROLLED",
    );
    enrol_ok(&relay, &c, &tc).await;
    pull(&relay, &c, Some(&tc)).await.assert_ok();
}

#[tokio::test]
async fn bad_tokens_and_bad_bindings_are_denied_at_enrolment() {
    let ed = SigningKey::ed("ed-1");
    let jwks = JwksServer::start(&[&ed]).await;
    let relay = Relay::start_with_config(account_config(&jwks)).await;
    let h = CloudHost::new("alpha");
    let now = relay.now() / 1000;
    let with = |f: &dyn Fn(&mut Value)| {
        let mut c = h.claims(&relay, "acct-1");
        f(&mut c);
        ed.sign(&c)
    };
    let cases: Vec<(&str, String)> = vec![
        (
            "account token refused: wrong audience",
            with(&|c| c["aud"] = json!("https://api.accounts.test")),
        ),
        (
            "account token refused: wrong audience",
            with(&|c| c["aud"] = json!([AUDIENCE, "https://api.accounts.test"])),
        ),
        (
            "account token refused: wrong issuer",
            with(&|c| c["iss"] = json!("https://evil.test")),
        ),
        (
            "account token refused: expired",
            with(&|c| {
                c["iat"] = json!(now - 600);
                c["exp"] = json!(now);
            }),
        ),
        (
            "account token refused: lifetime must be at most 900 s",
            with(&|c| c["exp"] = json!(now + 901)),
        ),
        (
            "account token refused: not valid yet",
            with(&|c| {
                c["iat"] = json!(now + 61);
                c["exp"] = json!(now + 600);
            }),
        ),
        (
            "account token refused: missing or mistyped claims",
            with(&|c| {
                c.as_object_mut().unwrap().remove("jti");
            }),
        ),
        (
            "account token refused: missing or mistyped claims",
            with(&|c| c["exp"] = json!(1.5)),
        ),
        (
            "account token refused: account must be 1..=256 bytes",
            with(&|c| c["account"] = json!("")),
        ),
        (
            "account token refused: cnf.jkt is not a key thumbprint",
            with(&|c| c["cnf"]["jkt"] = json!("short")),
        ),
        // A token bound to another cloud key than the certified one.
        (
            "account token refused: it is bound to another key",
            with(&|c| {
                c["cnf"]["jkt"] = json!(cloud_key::thumbprint(&HostKey::generate().public()))
            }),
        ),
        ("account token refused: bad signature", {
            let t = ed.sign(&h.claims(&relay, "acct-1"));
            let (head, sig) = t.rsplit_once('.').unwrap();
            let forged_claims = agentmbx_protocol::b64::encode_url(
                h.claims(&relay, "acct-evil").to_string().as_bytes(),
            );
            let head = head.split('.').next().unwrap();
            format!("{head}.{forged_claims}.{sig}")
        }),
        ("account token refused: unknown signing key", {
            let mut header = Header::new(Algorithm::EdDSA);
            header.kid = Some("nope".into());
            jsonwebtoken::encode(&header, &h.claims(&relay, "acct-1"), &ed.encoding).unwrap()
        }),
        (
            "account token refused: the token's algorithm does not match its signing key",
            {
                let mut header = Header::new(Algorithm::HS256);
                header.kid = Some("ed-1".into());
                jsonwebtoken::encode(
                    &header,
                    &h.claims(&relay, "acct-1"),
                    &EncodingKey::from_secret(b"0123456789abcdef0123456789abcdef"),
                )
                .unwrap()
            },
        ),
        (
            "account token refused: critical header extensions are not supported",
            {
                let mut header = Header::new(Algorithm::EdDSA);
                header.kid = Some("ed-1".into());
                header.crit = Some(vec!["exp".into()]);
                jsonwebtoken::encode(&header, &h.claims(&relay, "acct-1"), &ed.encoding).unwrap()
            },
        ),
        (
            "account token refused: the token names no signing key (kid)",
            {
                jsonwebtoken::encode(
                    &Header::new(Algorithm::EdDSA),
                    &h.claims(&relay, "acct-1"),
                    &ed.encoding,
                )
                .unwrap()
            },
        ),
        ("account token refused: malformed token header", {
            // alg "none" is not an algorithm this relay (or the crate) knows.
            let head = agentmbx_protocol::b64::encode_url(br#"{"alg":"none","kid":"ed-1"}"#);
            let body = agentmbx_protocol::b64::encode_url(
                h.claims(&relay, "acct-1").to_string().as_bytes(),
            );
            format!("{head}.{body}.")
        }),
        (
            "account token refused: not a token of 1..=8192 bytes",
            "x".repeat(8193),
        ),
    ];
    for (want, token) in cases {
        let r = enrol_try(&relay, &h, &token).await;
        if token.len() > 8000 {
            // The enrol body cap (8 KiB) stops an oversized token before the authority.
            assert_eq!(r.status, 413, "{r:#?}");
            continue;
        }
        r.assert_error(403, want, "DENIED");
    }
    // The bounds: a lifetime of exactly 15 min and an iat 60 s ahead are accepted.
    let at_bounds = with(&|c| {
        c["iat"] = json!(now + 60);
        c["exp"] = json!(now + 60 + 900);
    });
    enrol_ok(&relay, &h, &at_bounds).await;

    // The proof itself: missing, or a certificate that is not this host's.
    let h2 = CloudHost::new("beta");
    let t2 = ed.sign(&h2.claims(&relay, "acct-1"));
    let required =
        "this relay enrols with an account token: proof {token, cloud_cert, cloud_pop} is required";
    relay
        .enrol_with_proof(&h2.host, None)
        .await
        .assert_error(403, required, "DENIED");
    relay
        .enrol_with_proof(&h2.host, Some(json!({"token": t2})))
        .await
        .assert_error(403, required, "DENIED");
    // Token and certificate without the proof of possession.
    relay
        .enrol_with_proof(
            &h2.host,
            Some(json!({"token": t2, "cloud_cert": h2.cert.to_value()})),
        )
        .await
        .assert_error(403, required, "DENIED");
    // The certificate of another host (h's), presented by h2 with a token bound to h's cloud key.
    let stolen = ed.sign(&h.claims(&relay, "acct-1"));
    relay
        .enrol_with_challenge_proof(&h2.host, |c| Some(h.proof(&stolen, c)))
        .await
        .assert_error(
            403,
            "cloud-key certificate is for another host key",
            "DENIED",
        );
    // A certificate naming h2 but signed by another host key.
    let mut forged = CloudCert::sign(&HostKey::generate(), &h2.cloud.public(), T0);
    forged.rec.host_pubkey = h2.host.pubkey();
    let pop2 = |c: &str| CloudPop::sign(&h2.cloud, &h2.host.key.public(), c).to_value();
    relay
        .enrol_with_challenge_proof(&h2.host, |c| {
            Some(json!({"token": t2, "cloud_cert": forged.to_value(), "cloud_pop": pop2(c)}))
        })
        .await
        .assert_error(
            403,
            "cloud-key certificate is not signed by the host key",
            "DENIED",
        );
    relay
        .enrol_with_challenge_proof(&h2.host, |c| {
            Some(json!({"token": t2, "cloud_cert": {"rec": 1}, "cloud_pop": pop2(c)}))
        })
        .await
        .assert_error(403, "not a cloud-key certificate", "DENIED");
    // A proof of possession over another challenge (a replay), or that is not one.
    relay
        .enrol_with_challenge_proof(&h2.host, |_| {
            Some(json!({"token": t2, "cloud_cert": h2.cert.to_value(),
                        "cloud_pop": pop2("an earlier challenge")}))
        })
        .await
        .assert_error(
            403,
            "the cloud-key proof of possession does not verify",
            "DENIED",
        );
    relay
        .enrol_with_challenge_proof(&h2.host, |_| {
            Some(json!({"token": t2, "cloud_cert": h2.cert.to_value(), "cloud_pop": {"sig": "x"}}))
        })
        .await
        .assert_error(403, "not a cloud-key proof of possession", "DENIED");
    let pk = h2.host.pubkey();
    assert!(relay
        .with_store(move |s| s.enrolment(&pk).unwrap())
        .await
        .is_none());
    enrol_ok(&relay, &h2, &t2).await;
}

#[tokio::test]
async fn a_denied_client_id_or_host_fingerprint_is_refused_at_once_and_after_a_restart() {
    let ed = SigningKey::ed("ed-1");
    let jwks = JwksServer::start(&[&ed]).await;
    let dir = tempfile::tempdir().unwrap();
    let store_dir = dir.path().join("store");
    let relay_key = HostKey::generate();
    let seed = relay_key.seed_b64_secret();
    let relay = Relay::start_at(&store_dir, relay_key, account_config(&jwks), T0).await;
    let (a, b) = (CloudHost::new("alpha"), CloudHost::new("beta"));
    let ta = ed.sign(&a.claims(&relay, "acct-1"));
    let tb = ed.sign(&b.claims(&relay, "acct-1"));
    enrol_ok(&relay, &a, &ta).await;
    enrol_ok(&relay, &b, &tb).await;
    pull(&relay, &a, Some(&ta)).await.assert_ok();

    // client_id: the next hop and any enrolment are refused at once.
    let r = admin(&relay, "POST", "/v2/relay/admin/deny",
        json!({"target": "client-alpha", "kind": "client", "until_ms": relay.now() + 2 * 3_600_000}), Some(ADMIN)).await;
    assert_eq!(r.assert_ok()["entry"]["kind"], "client", "{r:#?}");
    pull(&relay, &a, Some(&ta)).await.assert_error(
        403,
        "this host is denied on this relay",
        "DENIED",
    );
    enrol_try(&relay, &a, &ta).await.assert_error(
        403,
        "this host is denied on this relay",
        "DENIED",
    );
    pull(&relay, &b, Some(&tb)).await.assert_ok();

    // Host fingerprint: the same.
    let fp = b.host.key.public().fingerprint();
    let r = admin(
        &relay,
        "POST",
        "/v2/relay/admin/deny",
        json!({"target": fp}),
        Some(ADMIN),
    )
    .await;
    assert_eq!(r.assert_ok()["entry"]["value"], fp.as_str());
    assert_eq!(r.json["entry"]["kind"], "host");
    pull(&relay, &b, Some(&tb)).await.assert_error(
        403,
        "this host is denied on this relay",
        "DENIED",
    );
    enrol_try(&relay, &b, &tb).await.assert_error(
        403,
        "this host is denied on this relay",
        "DENIED",
    );

    // Both survive a restart (they live in relay.db).
    relay.stop().await;
    let relay = Relay::start_at(
        &store_dir,
        HostKey::from_seed_b64(&seed).unwrap(),
        account_config(&jwks),
        T0 + MIN_MS,
    )
    .await;
    let ta = ed.sign(&a.claims(&relay, "acct-1"));
    let tb = ed.sign(&b.claims(&relay, "acct-1"));
    pull(&relay, &a, Some(&ta)).await.assert_error(
        403,
        "this host is denied on this relay",
        "DENIED",
    );
    pull(&relay, &b, Some(&tb)).await.assert_error(
        403,
        "this host is denied on this relay",
        "DENIED",
    );

    // A temporary entry ends at its `until`; a removed one at once.
    relay.clock.advance(2 * 3_600_000);
    let ta = ed.sign(&a.claims(&relay, "acct-1"));
    pull(&relay, &a, Some(&ta)).await.assert_ok();
    let r = admin(
        &relay,
        "POST",
        "/v2/relay/admin/undeny",
        json!({"target": fp}),
        Some(ADMIN),
    )
    .await;
    assert_eq!(r.assert_ok()["removed"], true);
    let tb = ed.sign(&b.claims(&relay, "acct-1"));
    pull(&relay, &b, Some(&tb)).await.assert_ok();
}

#[tokio::test]
async fn a_key_removed_from_the_jwks_stops_verifying_after_the_refresh_and_unknown_kids_refresh_once_a_minute(
) {
    let (k1, k2, k3) = (
        SigningKey::ed("k1"),
        SigningKey::ed("k2"),
        SigningKey::ed("k3"),
    );
    let jwks = JwksServer::start(&[&k1, &k2]).await;
    let relay = Relay::start_with_config(account_config(&jwks)).await;
    let h = CloudHost::new("alpha");
    enrol_ok(&relay, &h, &k1.sign(&h.claims(&relay, "acct-1"))).await;
    assert_eq!(jwks.fetches(), 1);

    // k1 leaves the JWKS. Until the next refresh (10 min) the cache still has it.
    jwks.serve(&[&k2]);
    relay.clock.advance(9 * MIN_MS);
    pull(&relay, &h, Some(&k1.sign(&h.claims(&relay, "acct-1"))))
        .await
        .assert_ok();
    assert_eq!(jwks.fetches(), 1);
    relay.clock.advance(MIN_MS);
    pull(&relay, &h, Some(&k1.sign(&h.claims(&relay, "acct-1"))))
        .await
        .assert_error(
            401,
            "account token refused: unknown signing key",
            "BAD_TOKEN",
        );
    assert_eq!(jwks.fetches(), 2, "the periodic refresh removed k1");
    pull(&relay, &h, Some(&k2.sign(&h.claims(&relay, "acct-1"))))
        .await
        .assert_ok();

    // An unknown kid refreshes at most once a minute: k3 appears, but the last fetch was just
    // now, so it is unknown until a minute has passed; a flood of made-up kids fetches nothing.
    jwks.serve(&[&k2, &k3]);
    let t3 = k3.sign(&h.claims(&relay, "acct-1"));
    pull(&relay, &h, Some(&t3)).await.assert_error(
        401,
        "account token refused: unknown signing key",
        "BAD_TOKEN",
    );
    for i in 0..20 {
        let mut header = Header::new(Algorithm::EdDSA);
        header.kid = Some(format!("made-up-{i}"));
        let t = jsonwebtoken::encode(&header, &h.claims(&relay, "acct-1"), &k3.encoding).unwrap();
        pull(&relay, &h, Some(&t)).await.assert_error(
            401,
            "account token refused: unknown signing key",
            "BAD_TOKEN",
        );
    }
    assert_eq!(jwks.fetches(), 2);
    relay.clock.advance(MIN_MS - 1);
    pull(&relay, &h, Some(&t3)).await.assert_error(
        401,
        "account token refused: unknown signing key",
        "BAD_TOKEN",
    );
    assert_eq!(jwks.fetches(), 2);
    relay.clock.advance(1);
    pull(&relay, &h, Some(&t3)).await.assert_ok();
    assert_eq!(jwks.fetches(), 3);
}

#[tokio::test]
async fn an_unreachable_jwks_serves_cached_keys_for_an_hour_then_new_enrolments_fail_closed() {
    let k1 = SigningKey::ed("k1");
    let jwks = JwksServer::start(&[&k1]).await;
    let relay = Relay::start_with_config(account_config(&jwks)).await;
    let (a, b, c) = (
        CloudHost::new("alpha"),
        CloudHost::new("beta"),
        CloudHost::new("gamma"),
    );
    let t0 = relay.now();
    enrol_ok(&relay, &a, &k1.sign(&a.claims(&relay, "acct-1"))).await;
    jwks.fail();

    // 59 minutes later the cached key still serves enrolments (refreshes fail meanwhile).
    relay.clock.set(t0 + 59 * MIN_MS);
    enrol_ok(&relay, &b, &k1.sign(&b.claims(&relay, "acct-1"))).await;
    assert!(jwks.fetches() >= 2, "refreshes were attempted");
    // A token a host got at 59 min, valid until 69 min.
    let held = k1.sign(&a.claims(&relay, "acct-1"));

    // Past the hour: new enrolments fail closed ...
    relay.clock.set(t0 + 60 * MIN_MS + 1);
    enrol_try(&relay, &c, &k1.sign(&c.claims(&relay, "acct-1")))
        .await
        .assert_unavailable();
    // ... while an enrolled host keeps pulling and pushing with the token it holds ...
    pull(&relay, &a, Some(&held)).await.assert_ok();
    let (id, wire) = sealed_wire(&a.host, &b.host, "still here", relay.now());
    let body = json!({"items": [env_item(&id, &b.host, &wire)]}).to_string();
    let r = relay
        .hop_with(&a.host, "POST", "/v2/relay/items", &body, &bearer(&held))
        .await;
    assert_eq!(r.statuses(), vec!["accepted"]);
    // ... but not with a token minted after the keys went stale ...
    pull(&relay, &a, Some(&k1.sign(&a.claims(&relay, "acct-1")))).await.assert_error(
        401,
        "account token refused: the issuer's keys could not be refreshed; tokens issued since are not accepted",
        "BAD_TOKEN",
    );
    // ... and only until that token expires.
    relay.clock.set(t0 + 69 * MIN_MS);
    pull(&relay, &a, Some(&held)).await.assert_error(
        401,
        "account token refused: expired",
        "BAD_TOKEN",
    );

    // The issuer is back: the next refresh (at most a minute after the last attempt) reopens.
    jwks.serve(&[&k1]);
    relay.clock.advance(MIN_MS);
    enrol_ok(&relay, &c, &k1.sign(&c.claims(&relay, "acct-1"))).await;
    pull(&relay, &a, Some(&k1.sign(&a.claims(&relay, "acct-1"))))
        .await
        .assert_ok();
}

#[tokio::test]
async fn a_jwks_that_was_never_fetched_denies_enrolment_as_unavailable() {
    let k1 = SigningKey::ed("k1");
    let jwks = JwksServer::start(&[&k1]).await;
    jwks.fail();
    let relay = Relay::start_with_config(account_config(&jwks)).await;
    let h = CloudHost::new("alpha");
    enrol_try(&relay, &h, &k1.sign(&h.claims(&relay, "acct-1")))
        .await
        .assert_unavailable();
}

#[tokio::test]
async fn names_are_unique_per_account_and_a_weaker_authority_keeps_the_account() {
    let ed = SigningKey::ed("ed-1");
    let jwks = JwksServer::start(&[&ed]).await;
    let dir = tempfile::tempdir().unwrap();
    let store_dir = dir.path().join("store");
    let relay_key = HostKey::generate();
    let seed = relay_key.seed_b64_secret();
    let relay = Relay::start_at(&store_dir, relay_key, account_config(&jwks), T0).await;

    // Two accounts each have a `macbook`; a second key named MacBook in the same account: 409.
    let (m1, m2, m3) = (
        CloudHost::new("macbook"),
        CloudHost::new("macbook"),
        CloudHost::new("MacBook"),
    );
    enrol_ok(&relay, &m1, &ed.sign(&m1.claims(&relay, "acct-1"))).await;
    enrol_ok(&relay, &m2, &ed.sign(&m2.claims(&relay, "acct-2"))).await;
    enrol_try(&relay, &m3, &ed.sign(&m3.claims(&relay, "acct-1")))
        .await
        .assert_error(409, "host name taken in this account", "NAME_TAKEN");
    // Revoked through the admin endpoint: the name is free again, the key stays out.
    let r = admin(
        &relay,
        "POST",
        "/v2/relay/admin/revoke",
        json!({"host": m1.host.pubkey()}),
        Some(ADMIN),
    )
    .await;
    assert_eq!(r.assert_ok()["newly_revoked"], true, "{r:#?}");
    enrol_ok(&relay, &m3, &ed.sign(&m3.claims(&relay, "acct-1"))).await;
    relay.stop().await;

    // The same store under the host-key challenge (a weaker authority): m2 re-enrols, and its
    // account and authorized_by stay those the account authority recorded.
    let relay = Relay::start_at(
        &store_dir,
        HostKey::from_seed_b64(&seed).unwrap(),
        RelayConfig {
            rate: RateConfig {
                enrol_per_min: 100_000,
                ..RateConfig::default()
            },
            ..RelayConfig::default()
        },
        T0 + MIN_MS,
    )
    .await;
    relay.enrol(&m2.host).await;
    let e = enrolment(&relay, &m2).await;
    assert_eq!(e.account.as_deref(), Some("acct-2"));
    assert_eq!(e.authorized_by, "account-token");
    assert_eq!(e.strength, AuthorityStrength::Account);
    // The revoked key stays revoked across the restart and the other authority.
    relay.enrol_try(&m1.host).await.assert_error(
        403,
        "this host key is revoked on this relay",
        "REVOKED",
    );
    // On this relay no token is needed on hops, and an Authorization header is not looked at.
    relay.pull(&m2.host, "after=0").await.assert_ok();
    relay
        .hop_with(
            &m2.host,
            "GET",
            "/v2/relay/items?after=0",
            "",
            &[("authorization".into(), "Basic bm90OnVzZWQ=".into())],
        )
        .await
        .assert_ok();
    // The deny-list applies under the host-key challenge too.
    let fp = m2.host.key.public().fingerprint();
    let now = relay.now();
    let out = relay
        .with_store(move |s| agentmbx_relay::admin::deny(s, &fp, None, None, now))
        .await
        .unwrap();
    assert_eq!(out.kind, DenyKind::Host);
    relay.pull(&m2.host, "after=0").await.assert_error(
        403,
        "this host is denied on this relay",
        "DENIED",
    );
    relay.enrol_try(&m2.host).await.assert_error(
        403,
        "this host is denied on this relay",
        "DENIED",
    );
}

#[tokio::test]
async fn the_admin_endpoints_need_the_admin_token_and_do_not_exist_without_one() {
    let relay = Relay::start().await;
    let h = Host::new("alpha");
    relay.enrol(&h).await;
    // No admin token configured: 404, as if the routes did not exist.
    admin(
        &relay,
        "POST",
        "/v2/relay/admin/revoke",
        json!({"host": h.pubkey()}),
        Some(ADMIN),
    )
    .await
    .assert_error(404, "not found", "NOT_FOUND");
    admin(&relay, "GET", "/v2/relay/admin/deny", json!(null), None)
        .await
        .assert_error(404, "not found", "NOT_FOUND");
    relay.stop().await;

    let relay = Relay::start_with_config(RelayConfig {
        admin_token: Some(AdminToken::new(ADMIN).unwrap()),
        ..RelayConfig::default()
    })
    .await;
    let (h, g) = (Host::new("alpha"), Host::new("beta"));
    relay.enrol(&h).await;
    relay.enrol(&g).await;
    for token in [
        None,
        Some("wrong-token-0123456789abcdef"),
        Some(&ADMIN[..ADMIN.len() - 1]),
    ] {
        admin(
            &relay,
            "POST",
            "/v2/relay/admin/revoke",
            json!({"host": h.pubkey()}),
            token,
        )
        .await
        .assert_error(401, "admin token required", "ADMIN_TOKEN");
    }
    relay.pull(&h, "after=0").await.assert_ok();
    // By fingerprint; the next request of the host is refused at once.
    let fp = h.key.public().fingerprint();
    let r = admin(
        &relay,
        "POST",
        "/v2/relay/admin/revoke",
        json!({"host": fp}),
        Some(ADMIN),
    )
    .await;
    assert_eq!(r.assert_ok()["host"]["fingerprint"], fp.as_str());
    assert_eq!(r.json["host"]["host_name"], "alpha");
    relay.pull(&h, "after=0").await.assert_error(
        403,
        "this host key is revoked on this relay",
        "REVOKED",
    );
    // Again: already revoked; unknown and malformed hosts.
    let r = admin(
        &relay,
        "POST",
        "/v2/relay/admin/revoke",
        json!({"host": h.pubkey()}),
        Some(ADMIN),
    )
    .await;
    assert_eq!(r.assert_ok()["newly_revoked"], false);
    admin(
        &relay,
        "POST",
        "/v2/relay/admin/revoke",
        json!({"host": "0000-0000-0000-0000"}),
        Some(ADMIN),
    )
    .await
    .assert_error(404, "no enrolment matches 0000-0000-0000-0000", "NOT_FOUND");
    let r = admin(
        &relay,
        "POST",
        "/v2/relay/admin/revoke",
        json!({"host": "nope"}),
        Some(ADMIN),
    )
    .await;
    assert_eq!((r.status, r.str("code")), (400, "BAD_REQUEST"), "{r:#?}");
    // Deny: too short an `until` is refused; list and remove.
    let r = admin(
        &relay,
        "POST",
        "/v2/relay/admin/deny",
        json!({"target": "client-x", "until_ms": relay.now() + 899_999}),
        Some(ADMIN),
    )
    .await;
    assert_eq!((r.status, r.str("code")), (400, "BAD_REQUEST"), "{r:#?}");
    assert!(r.str("error").contains("at least 15 min"), "{r:#?}");
    let r = admin(
        &relay,
        "POST",
        "/v2/relay/admin/deny",
        json!({"target": "client-x", "until_ms": relay.now() + 900_000}),
        Some(ADMIN),
    )
    .await;
    r.assert_ok();
    let r = admin(
        &relay,
        "GET",
        "/v2/relay/admin/deny",
        json!(null),
        Some(ADMIN),
    )
    .await;
    assert_eq!(r.assert_ok()["entries"].as_array().unwrap().len(), 1);
    assert_eq!(r.json["entries"][0]["value"], "client-x");
    assert_eq!(r.json["entries"][0]["active"], true);
    let r = admin(
        &relay,
        "POST",
        "/v2/relay/admin/undeny",
        json!({"target": "client-x"}),
        Some(ADMIN),
    )
    .await;
    assert_eq!(r.assert_ok()["removed"], true);
    let r = admin(
        &relay,
        "POST",
        "/v2/relay/admin/deny",
        json!({"target": "x", "kind": "user"}),
        Some(ADMIN),
    )
    .await;
    assert_eq!(r.status, 400, "{r:#?}");
    relay.pull(&g, "after=0").await.assert_ok();
}

// ---- proof of possession, bindings, restarts, challenges ---------------------------------------

/// A thief holding a victim's token (bound to the victim's cloud key) cannot enrol its own host
/// key with it: a certificate its own host key made for the victim's thumbprint is not enough,
/// and neither is a proof of possession by another cloud key or a forged one.
#[tokio::test]
async fn a_stolen_token_does_not_enrol_another_host_key() {
    let ed = SigningKey::ed("ed-1");
    let jwks = JwksServer::start(&[&ed]).await;
    let relay = Relay::start_with_config(account_config(&jwks)).await;
    let victim = CloudHost::new("victim");
    let stolen = ed.sign(&victim.claims(&relay, "acct-1"));
    enrol_ok(&relay, &victim, &stolen).await;

    let thief = Host::new("thief");
    // The thief's host key certifies the victim's cloud key (its public half is no secret).
    let cert = CloudCert::sign(&thief.key, &victim.cloud.public(), T0).to_value();
    assert_eq!(cert["rec"]["cloud_jkt"], victim.jkt().as_str());
    // 1. No proof of possession at all.
    relay
        .enrol_with_proof(&thief, Some(json!({"token": stolen, "cloud_cert": cert})))
        .await
        .assert_error(
            403,
            "this relay enrols with an account token: proof {token, cloud_cert, cloud_pop} is required",
            "DENIED",
        );
    // 2. A valid proof by the thief's own cloud key: its thumbprint is not the certified one.
    let own = HostKey::generate();
    relay
        .enrol_with_challenge_proof(&thief, |c| {
            Some(json!({"token": stolen, "cloud_cert": cert,
                        "cloud_pop": CloudPop::sign(&own, &thief.key.public(), c).to_value()}))
        })
        .await
        .assert_error(
            403,
            "the cloud-key proof of possession is for another cloud key than the certificate",
            "DENIED",
        );
    // 3. Naming the victim's cloud key, signed by another key.
    relay
        .enrol_with_challenge_proof(&thief, |c| {
            let mut pop = CloudPop::sign(&own, &thief.key.public(), c);
            pop.cloud_pubkey = victim.cloud.public().to_b64();
            Some(json!({"token": stolen, "cloud_cert": cert, "cloud_pop": pop.to_value()}))
        })
        .await
        .assert_error(
            403,
            "the cloud-key proof of possession does not verify",
            "DENIED",
        );
    // 4. A proof the victim made for its own enrolment, replayed.
    relay
        .enrol_with_challenge_proof(&thief, |_| {
            let pop = CloudPop::sign(&victim.cloud, &victim.host.key.public(), "ch");
            Some(json!({"token": stolen, "cloud_cert": cert, "cloud_pop": pop.to_value()}))
        })
        .await
        .assert_error(
            403,
            "the cloud-key proof of possession does not verify",
            "DENIED",
        );
    let pk = thief.pubkey();
    assert!(relay
        .with_store(move |s| s.enrolment(&pk).unwrap())
        .await
        .is_none());
    // The victim is untouched.
    pull(&relay, &victim, Some(&stolen)).await.assert_ok();
}

/// One cloud key serves one live host key: a second host key proving the same cloud key is
/// refused 409 CLOUD_KEY_TAKEN until the first is revoked (a rotation revokes the old key).
#[tokio::test]
async fn a_cloud_key_bound_to_another_live_host_key_is_refused() {
    let ed = SigningKey::ed("ed-1");
    let jwks = JwksServer::start(&[&ed]).await;
    let relay = Relay::start_with_config(account_config(&jwks)).await;
    let first = CloudHost::new("alpha");
    enrol_ok(&relay, &first, &ed.sign(&first.claims(&relay, "acct-1"))).await;
    // Another host key with the same cloud key (it holds the private half).
    let host = Host::new("alpha-2");
    let second = CloudHost {
        cert: CloudCert::sign(&host.key, &first.cloud.public(), T0),
        cloud: HostKey::from_seed_b64(&first.cloud.seed_b64_secret()).unwrap(),
        host,
    };
    let token = ed.sign(&second.claims(&relay, "acct-1"));
    enrol_try(&relay, &second, &token).await.assert_error(
        409,
        "this cloud key is bound to another live host key on this relay",
        "CLOUD_KEY_TAKEN",
    );
    let pk = second.host.pubkey();
    assert!(relay
        .with_store(move |s| s.enrolment(&pk).unwrap())
        .await
        .is_none());
    // The first host re-enrolling with its own cloud key is fine.
    enrol_ok(&relay, &first, &ed.sign(&first.claims(&relay, "acct-1"))).await;
    // Once the first key is revoked, the cloud key is free.
    relay.revoke(&first.host).await;
    enrol_ok(&relay, &second, &token).await;
    pull(&relay, &second, Some(&token)).await.assert_ok();
}

/// A hop token must carry the client_id recorded at enrolment.
#[tokio::test]
async fn a_hop_token_for_another_client_id_is_refused() {
    let ed = SigningKey::ed("ed-1");
    let jwks = JwksServer::start(&[&ed]).await;
    let relay = Relay::start_with_config(account_config(&jwks)).await;
    let h = CloudHost::new("alpha");
    enrol_ok(&relay, &h, &ed.sign(&h.claims(&relay, "acct-1"))).await;
    let mut other = h.claims(&relay, "acct-1");
    other["client_id"] = json!("client-elsewhere");
    let other = ed.sign(&other);
    pull(&relay, &h, Some(&other)).await.assert_error(
        401,
        "account token refused: it is for another client",
        "BAD_TOKEN",
    );
    pull(&relay, &h, Some(&ed.sign(&h.claims(&relay, "acct-1"))))
        .await
        .assert_ok();
    // Enrolling again with the new client's token moves the binding to it.
    enrol_ok(&relay, &h, &other).await;
    pull(&relay, &h, Some(&other)).await.assert_ok();
}

/// The last good JWKS survives a restart: with the issuer down, an enrolled host keeps working
/// with a token issued before the keys went stale, new enrolments work until an hour after the
/// persisted fetch time, then fail closed.
#[tokio::test]
async fn a_restart_during_an_issuer_outage_keeps_the_persisted_jwks_for_an_hour() {
    let k1 = SigningKey::ed("k1");
    let jwks = JwksServer::start(&[&k1]).await;
    let dir = tempfile::tempdir().unwrap();
    let store_dir = dir.path().join("store");
    let relay_key = HostKey::generate();
    let seed = relay_key.seed_b64_secret();
    let relay = Relay::start_at(&store_dir, relay_key, account_config(&jwks), T0).await;
    let (a, b, c) = (
        CloudHost::new("alpha"),
        CloudHost::new("beta"),
        CloudHost::new("gamma"),
    );
    enrol_ok(&relay, &a, &k1.sign(&a.claims(&relay, "acct-1"))).await;
    assert_eq!(jwks.fetches(), 1);
    let kept = relay
        .with_store(|s| s.meta("jwks_cache").unwrap())
        .await
        .expect("the JWKS is kept in relay.db");
    let kept: Value = serde_json::from_str(&kept).unwrap();
    assert_eq!(kept["fetched_at_ms"], T0);
    assert_eq!(kept["url"], jwks.url.as_str());
    relay.stop().await;

    // The issuer goes down; the relay restarts 30 minutes later.
    jwks.fail();
    let relay = Relay::start_at(
        &store_dir,
        HostKey::from_seed_b64(&seed).unwrap(),
        account_config(&jwks),
        T0 + 30 * MIN_MS,
    )
    .await;
    pull(&relay, &a, Some(&k1.sign(&a.claims(&relay, "acct-1"))))
        .await
        .assert_ok();
    assert_eq!(jwks.fetches(), 2, "a refresh was tried and failed");
    enrol_ok(&relay, &b, &k1.sign(&b.claims(&relay, "acct-1"))).await;
    // A token the host gets at 55 minutes, valid until 65.
    relay.clock.set(T0 + 55 * MIN_MS);
    let held = k1.sign(&a.claims(&relay, "acct-1"));
    pull(&relay, &a, Some(&held)).await.assert_ok();

    // An hour after the persisted fetch (not after the restart): new enrolments fail closed,
    // while the token held from before keeps working until it expires.
    relay.clock.set(T0 + 60 * MIN_MS + 1);
    enrol_try(&relay, &c, &k1.sign(&c.claims(&relay, "acct-1")))
        .await
        .assert_unavailable();
    pull(&relay, &a, Some(&held)).await.assert_ok();
    pull(&relay, &a, Some(&k1.sign(&a.claims(&relay, "acct-1")))).await.assert_error(
        401,
        "account token refused: the issuer's keys could not be refreshed; tokens issued since are not accepted",
        "BAD_TOKEN",
    );
}

/// A hop of a host enrolled with an account token is answered 503 AUTHORITY_UNAVAILABLE (not a
/// token refusal) when the relay has no JWKS at all, so the host keeps its token and retries.
#[tokio::test]
async fn a_hop_without_any_jwks_is_unavailable_not_refused() {
    let k1 = SigningKey::ed("k1");
    let jwks = JwksServer::start(&[&k1]).await;
    let dir = tempfile::tempdir().unwrap();
    let store_dir = dir.path().join("store");
    let relay_key = HostKey::generate();
    let seed = relay_key.seed_b64_secret();
    let relay = Relay::start_at(&store_dir, relay_key, account_config(&jwks), T0).await;
    let a = CloudHost::new("alpha");
    enrol_ok(&relay, &a, &k1.sign(&a.claims(&relay, "acct-1"))).await;
    relay.stop().await;
    // A store without the kept document (as after an upgrade), the issuer down.
    {
        let conn = rusqlite::Connection::open(store_dir.join("relay.db")).unwrap();
        conn.execute("DELETE FROM meta WHERE k = 'jwks_cache'", [])
            .unwrap();
    }
    jwks.fail();
    let relay = Relay::start_at(
        &store_dir,
        HostKey::from_seed_b64(&seed).unwrap(),
        account_config(&jwks),
        T0 + MIN_MS,
    )
    .await;
    pull(&relay, &a, Some(&k1.sign(&a.claims(&relay, "acct-1"))))
        .await
        .assert_unavailable();
}

/// A junk signature cannot burn a host's pending challenge: the challenge is used up only by an
/// enrolment whose signature verified, and then only once.
#[tokio::test]
async fn a_junk_signature_does_not_burn_the_pending_challenge() {
    let relay = Relay::start().await;
    let h = Host::new("alpha");
    let challenge = relay.challenge(&h).await;
    let mut junk: Value = serde_json::from_str(&h.enrol_body(&challenge)).unwrap();
    junk["sig"] = json!(HostKey::generate().sign(b"not the challenge"));
    for _ in 0..3 {
        relay
            .plain("POST", "/v1/relay/enrol", &junk.to_string())
            .await
            .assert_error(401, "bad enrolment signature", "BAD_SIGNATURE");
    }
    let good = h.enrol_body(&challenge);
    let r = relay.plain("POST", "/v1/relay/enrol", &good).await;
    assert_eq!(r.assert_ok(), &json!({"ok": true}));
    // Single use: the same signed body again finds no challenge.
    relay
        .plain("POST", "/v1/relay/enrol", &good)
        .await
        .assert_error(401, "no pending challenge", "NO_CHALLENGE");
}

#[tokio::test]
async fn a_push_stream_closes_when_its_account_token_expires_and_on_a_client_id_deny() {
    use crate::stream::{nonce, upgrade_with};
    use agentmbx_protocol::stream::close;
    let ed = SigningKey::ed("ed-1");
    let jwks = JwksServer::start(&[&ed]).await;
    let relay = Relay::start_with_config(account_config(&jwks)).await;
    let (a, b) = (CloudHost::new("alpha"), CloudHost::new("beta"));
    let ta = ed.sign(&a.claims(&relay, "acct-1"));
    let tb = ed.sign(&b.claims(&relay, "acct-1"));
    enrol_ok(&relay, &a, &ta).await;
    enrol_ok(&relay, &b, &tb).await;
    // Without the token: the pull's refusal.
    let n = nonce(&relay, &a.host).await;
    let refused = upgrade_with(&relay, &a.host, &n, &[]).await.err().unwrap();
    assert_eq!(refused.status, 401);
    assert_eq!(refused.body, pull(&relay, &a, None).await.json);
    // With it: open until the token's exp (600 s after its iat).
    let n = nonce(&relay, &a.host).await;
    let mut sa = upgrade_with(&relay, &a.host, &n, &bearer(&ta))
        .await
        .unwrap();
    let n = nonce(&relay, &b.host).await;
    let mut sb = upgrade_with(&relay, &b.host, &n, &bearer(&tb))
        .await
        .unwrap();
    sa.resume("", 0).await;
    sa.replay().await;
    sb.resume("", 0).await;
    sb.replay().await;
    // A deny entry for beta's client_id closes beta's stream only.
    admin(
        &relay,
        "POST",
        "/v2/relay/admin/deny",
        json!({"target": "client-beta", "kind": "client"}),
        Some(ADMIN),
    )
    .await
    .assert_ok();
    assert_eq!(sb.closed().await, close::AUTH);
    // The relay clock passes alpha's exp. The manual clock wakes no timer: the next turn of
    // the connection loop (here, a client frame) sees the deadline.
    relay.clock.advance(600 * 1_000);
    sa.send(json!({"type": "pong", "id": 0})).await;
    assert_eq!(sa.closed().await, close::TOKEN_EXPIRED);
}

#[tokio::test]
async fn a_push_stream_closes_at_its_token_deadline_with_no_client_frame() {
    use crate::stream::{nonce, upgrade_with};
    use agentmbx_protocol::stream::close;
    let ed = SigningKey::ed("ed-1");
    let jwks = JwksServer::start(&[&ed]).await;
    let relay = Relay::start_with_config(account_config(&jwks)).await;
    let a = CloudHost::new("alpha");
    let ta = ed.sign(&a.claims(&relay, "acct-1"));
    enrol_ok(&relay, &a, &ta).await;
    // A token that expires within 2 s of the relay clock.
    let mut claims = a.claims(&relay, "acct-1");
    claims["exp"] = json!(relay.now() / 1000 + 2);
    let short = ed.sign(&claims);
    let n = nonce(&relay, &a.host).await;
    let mut sa = upgrade_with(&relay, &a.host, &n, &bearer(&short))
        .await
        .unwrap();
    sa.resume("", 0).await;
    sa.replay().await;
    // The relay clock passes exp; the client sends nothing: the loop's own deadline (at most
    // 2 s of real time) finds the token expired.
    relay.clock.advance(3 * 1_000);
    assert_eq!(sa.closed().await, close::TOKEN_EXPIRED);
}
