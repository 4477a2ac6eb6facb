//! The account token on the host side of a relay run with the account authority (spec §1, §8):
//! it goes only to a relay that presented the pinned key in this pass (so the first signed info
//! of every pass carries none, and a relay serving another key never sees it), enrolment carries
//! the cloud key's proof of possession over the relay's challenge, and an enrolment authority
//! that cannot decide is recorded as `enrol-failed`, never as a denial.

use super::*;

/// The challenge the scripted relay hands out.
const CHALLENGE: &str = "Y2hhbGxlbmdl";

/// An unverified JWT with only an `exp` (the host reads no other claim).
fn jwt(exp_s: i64) -> String {
    let enc = |v: &[u8]| b64::encode_url(v);
    format!(
        "{}.{}.{}",
        enc(br#"{"alg":"EdDSA","kid":"k"}"#),
        enc(json!({ "exp": exp_s }).to_string().as_bytes()),
        enc(b"sig")
    )
}

/// `s`'s client with account tokens from a command that prints `token` and counts its runs in
/// `dir/runs`.
fn with_tokens(s: &Setup, dir: &std::path::Path, token: &str) -> RelayClient {
    let runs = dir.join("runs");
    let cmd = format!("echo run >> '{}'; echo {token}", runs.display());
    let shared: SharedClock = s.clock.clone();
    let mut client = s.client.clone();
    client.account = Some(Arc::new(super::super::account::AccountTokens::new(
        &cmd,
        dir,
        &client.url,
        shared,
    )));
    client
}

fn runs(dir: &std::path::Path) -> usize {
    std::fs::read_to_string(dir.join("runs"))
        .map(|t| t.lines().count())
        .unwrap_or(0)
}

/// Every `Authorization` header the relay saw, as `(METHOD /path, header)`.
fn authorizations(s: &Setup) -> Vec<(String, String)> {
    s.relay
        .state
        .log
        .lock()
        .unwrap()
        .iter()
        .map(|r| (format!("{} {}", r.method, r.path), r.authorization.clone()))
        .collect()
}

#[tokio::test]
async fn a_relay_presenting_another_key_never_receives_the_account_token() {
    let s = Setup::new(true).await;
    let t = s.trusty();
    *t.served.lock().unwrap() = HostKey::generate();
    let dir = tempfile::tempdir().unwrap();
    let token = jwt(T0 / 1000 + 600);
    let client = with_tokens(&s, dir.path(), &token);
    for _ in 0..3 {
        let err = client.open_session().await.unwrap_err();
        assert!(matches!(err, RelayError::KeyMismatch { .. }), "{err}");
    }
    let seen = authorizations(&s);
    assert!(!seen.is_empty());
    for (route, auth) in &seen {
        assert_eq!(auth, "", "{route} carried a token");
    }
    assert_eq!(
        s.routes()
            .iter()
            .filter(|r| *r != "GET /v2/relay/info")
            .count(),
        0,
        "nothing but info: {:?}",
        s.routes()
    );
    assert_eq!(runs(dir.path()), 0, "no token was even fetched");
}

#[tokio::test]
async fn the_first_signed_info_of_a_pass_carries_no_token_and_the_rest_of_the_pass_does() {
    use std::sync::atomic::Ordering;
    let s = Setup::new(true).await;
    let t = s.trusty();
    t.enrolled.store(false, Ordering::SeqCst);
    let dir = tempfile::tempdir().unwrap();
    let token = jwt(T0 / 1000 + 600);
    let client = with_tokens(&s, dir.path(), &token);
    let bearer = format!("Bearer {token}");

    // First pass: info (no token, no `you`) → challenge → enrol with the proof → info, enc-key
    // ad and allowlist, all with the token.
    client.open_session().await.unwrap();
    let seen = authorizations(&s);
    assert_eq!(
        seen[0],
        ("GET /v2/relay/info".to_owned(), String::new()),
        "{seen:?}"
    );
    for (route, auth) in &seen[1..] {
        if route.starts_with("POST /v1/relay/") {
            assert_eq!(auth, "", "{route}: the enrolment calls are plain");
        } else {
            assert_eq!(auth, &bearer, "{route}");
        }
    }
    assert!(
        seen.iter().any(|(r, _)| r == "POST /v2/relay/enc-key"),
        "{seen:?}"
    );
    // The enrolment proof: the token, the certificate and the cloud key's proof of possession
    // over this challenge, for this host key.
    let enrol = s.relay.seen("POST /v1/relay/enrol")[0].json();
    let proof = &enrol["proof"];
    assert_eq!(proof["token"], token.as_str());
    let cert = agentmbx_protocol::cloud_key::CloudCert::from_value(&proof["cloud_cert"]).unwrap();
    let pop = agentmbx_protocol::cloud_key::CloudPop::from_value(&proof["cloud_pop"]).unwrap();
    let me = s.me.host_key.public();
    assert_eq!(pop.check(&me, CHALLENGE).unwrap(), cert.rec.cloud_jkt);

    // The next pass starts without the token again.
    let before = seen.len();
    client.open_session().await.unwrap();
    let seen = authorizations(&s);
    assert_eq!(
        seen[before],
        ("GET /v2/relay/info".to_owned(), String::new()),
        "{seen:?}"
    );
    assert_eq!(runs(dir.path()), 1, "the token is fetched once and kept");
}

#[tokio::test]
async fn an_unavailable_enrolment_authority_is_enrol_failed_and_waits_not_revoked() {
    use std::sync::atomic::Ordering;
    let s = Setup::new(true).await;
    let t = s.trusty();
    t.enrolled.store(false, Ordering::SeqCst);
    s.relay.on("POST /v1/relay/enrol", |_| {
        (
            503,
            json!({"error": "the enrolment authority is unavailable",
                   "code": "AUTHORITY_UNAVAILABLE", "retry_after": 60}),
        )
    });
    let err = s.client.open_session().await.unwrap_err();
    assert!(
        matches!(
            err,
            RelayError::AuthorityUnavailable {
                retry_after_ms: 60_000
            }
        ),
        "{err}"
    );
    assert!(err.ends_pass());
    let st = s.relay_state().expect("a relay state");
    assert_eq!(st.state, Standing::EnrolFailed, "{st:?}");
    assert_eq!(st.status, Some(503));
    assert!(
        st.detail
            .as_deref()
            .is_some_and(|d| d.contains("enrolment authority is unavailable")),
        "{st:?}"
    );
    // Not a denial: no refusal backoff episode was started.
    let url = s.url();
    let backoff = s
        .store
        .mailbox
        .with(|c| relay_trust::backoff(c, &url))
        .unwrap();
    assert!(backoff.is_none(), "{backoff:?}");
    // Without a retry_after the wait is a minute; other 503s stay plain statuses.
    assert!(matches!(
        super::super::status_error(
            503,
            br#"{"error":"the enrolment authority is unavailable","code":"AUTHORITY_UNAVAILABLE"}"#
        ),
        RelayError::AuthorityUnavailable {
            retry_after_ms: 60_000
        }
    ));
    assert!(matches!(
        super::super::status_error(503, br#"{"error":"busy","code":"BUSY"}"#),
        RelayError::Status { status: 503, .. }
    ));
}
