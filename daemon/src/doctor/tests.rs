//! Unit tests of the doctor framework and of each check's fail path, on a real home in a temp
//! dir. Network checks run against servers on 127.0.0.1 (a fake relay info, a fake health
//! answer, a peer's signed status) or against a closed 127.0.0.1 port.

use std::net::SocketAddr;
use std::time::Duration;

use agentmbx_protocol::keys::HostKey;
use agentmbx_protocol::status::SignedStatus;
use axum::routing::get;
use axum::Router;
use serde_json::{json, Value};

use super::checks::local::{disk_verdict, DISK_FAIL_BYTES, DISK_WARN_BYTES};
use super::checks::relay::skew_verdict;
use super::*;
use crate::config::{self, RelayConfig};
use crate::keystore::file::FileStore;
use crate::mailbox::relay_state;
use crate::transport::relay_client::state::{self, Enrolment, PublishedAd, RelayState, Standing};

const NOW: i64 = crate::testutil::T0;
/// `Date` the fake relay sends, and its value in ms.
const RELAY_DATE: &str = "Thu, 01 Jan 2026 00:01:00 GMT";

struct Home {
    _dir: tempfile::TempDir,
    paths: Paths,
}

fn uninitialized() -> Home {
    let dir = tempfile::tempdir().unwrap();
    let paths = Paths::at(dir.path().join("home"));
    Home { _dir: dir, paths }
}

fn initialized() -> Home {
    let h = uninitialized();
    h.paths.ensure_home().unwrap();
    let store = FileStore::new(h.paths.home());
    let name = crate::host_name::HostName::parse("doc").unwrap();
    crate::identity::init_with(&h.paths, Some(&name), &store).unwrap();
    h
}

impl Home {
    fn set_relay(&self, url: &str, key: Option<String>) {
        config::set_relay(
            &self.paths,
            Some(&RelayConfig {
                url: url.into(),
                key,
                token_command: None,
            }),
        )
        .unwrap();
    }

    fn mailbox(&self) -> Mailbox {
        Mailbox::open(&self.paths.mailbox_db()).unwrap()
    }

    fn public(&self) -> crate::identity::PublicIdentity {
        let c = Config::load(&self.paths).unwrap();
        crate::identity::load(&self.paths, &c).unwrap().public()
    }

    async fn run(&self, ids: &[&str]) -> Report {
        self.run_at(ids, NOW, false).await
    }

    async fn run_at(&self, ids: &[&str], now_ms: i64, fix: bool) -> Report {
        let ids: Vec<String> = ids.iter().map(|s| s.to_string()).collect();
        let opts = Options {
            fix,
            timeout: Duration::from_secs(2),
            now_ms,
        };
        run(self.paths.clone(), &select(&ids).unwrap(), opts).await
    }
}

fn one<'a>(r: &'a Report, id: &str) -> &'a CheckResult {
    r.checks.iter().find(|c| c.id == id).expect("check ran")
}

async fn serve(router: Router) -> SocketAddr {
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(l, router).await.unwrap() });
    addr
}

/// A 127.0.0.1 port nothing listens on.
fn closed_port() -> u16 {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    l.local_addr().unwrap().port()
}

fn limits() -> Value {
    let mut m = serde_json::Map::new();
    for k in [
        "max_item_bytes",
        "max_batch",
        "max_pull",
        "max_pull_bytes",
        "max_targets",
        "retention_days",
        "max_queue_items",
        "max_queue_bytes",
        "max_sender_items",
        "max_sender_bytes",
        "max_owner_items",
        "max_owner_bytes",
    ] {
        m.insert(k.into(), json!(1));
    }
    Value::Object(m)
}

/// A fake relay serving `key` in epoch `ep1`, with `Date: RELAY_DATE`; returns its URL.
async fn fake_relay(key: &HostKey) -> String {
    let info = json!({"v": 2, "relay_pubkey": key.public().to_b64(), "epoch": "ep1",
                      "version": "test", "limits": limits()});
    let router = Router::new().route(
        "/v2/relay/info",
        get(move || {
            let info = info.clone();
            async move { ([(axum::http::header::DATE, RELAY_DATE)], axum::Json(info)) }
        }),
    );
    format!("http://{}", serve(router).await)
}

fn relay_date_ms() -> i64 {
    state::parse_http_date(RELAY_DATE).unwrap()
}

// ---- framework -----------------------------------------------------------------------------

fn result(id: &'static str, status: Status) -> CheckResult {
    CheckResult {
        id,
        title: "t",
        status,
        summary: "s".into(),
        details: vec!["d".into()],
        fix: (status == Status::Fail).then(|| "do this".into()),
    }
}

#[test]
fn json_has_schema_checks_and_summary() {
    let r = Report::new(vec![
        result("a", Status::Ok),
        result("b", Status::Warn),
        result("c", Status::Skip),
        result("d", Status::Error),
    ]);
    let v = serde_json::to_value(&r).unwrap();
    assert_eq!(v["schema"], 2);
    assert_eq!(
        v["summary"],
        json!({"ok": 1, "warn": 1, "fail": 0, "skip": 1, "error": 1})
    );
    let c = &v["checks"][1];
    let keys: Vec<&str> = c.as_object().unwrap().keys().map(String::as_str).collect();
    for k in ["id", "title", "status", "summary", "details", "fix"] {
        assert!(keys.contains(&k), "{k} missing in {c}");
    }
    assert_eq!(c["status"], "warn");
    assert_eq!(v["checks"][3]["status"], "error");
    assert_eq!(r.exit_code(), 1, "a check that could not run fails the run");
    let warned = Report::new(vec![
        result("a", Status::Ok),
        result("b", Status::Warn),
        result("c", Status::Skip),
    ]);
    assert_eq!(warned.exit_code(), 0, "warn and skip do not fail");
    let failed = Report::new(vec![result("a", Status::Ok), result("b", Status::Fail)]);
    assert_eq!(failed.exit_code(), 1);
}

#[test]
fn text_marks_each_status_and_prints_the_fix() {
    let r = Report::new(vec![
        result("a", Status::Ok),
        result("b", Status::Warn),
        result("c", Status::Fail),
        result("d", Status::Skip),
        result("e", Status::Error),
    ]);
    let t = r.text();
    let lines: Vec<&str> = t.lines().collect();
    assert!(lines[0].starts_with("✔ t: s"));
    assert!(lines[2].starts_with("! "));
    assert!(lines[4].starts_with("✗ "));
    assert_eq!(lines[6], "    fix: do this");
    assert!(lines[7].starts_with("· "));
    assert!(lines[9].starts_with("? "));
    assert_eq!(
        *lines.last().unwrap(),
        "1 ok, 1 warn, 1 fail, 1 skip, 1 error"
    );
}

#[test]
fn select_keeps_the_order_and_refuses_unknown_ids() {
    assert_eq!(select(&[]).unwrap().len(), CHECKS.len());
    let ids = vec!["outbox".to_string(), "host-identity".to_string()];
    let got: Vec<&str> = select(&ids).unwrap().iter().map(|c| c.id).collect();
    assert_eq!(got, ["host-identity", "outbox"]);
    let err = select(&["outbox".into(), "nope".into()]).unwrap_err();
    assert_eq!(err, UnknownCheck("nope".into()));
    // `config` comes first: an invalid config.toml puts it in front of any selection.
    assert_eq!(CHECKS[0].id, "config");
    // Ids are unique and kebab-case.
    for (i, c) in CHECKS.iter().enumerate() {
        assert!(c.id.chars().all(|ch| ch.is_ascii_lowercase() || ch == '-'));
        assert!(CHECKS[i + 1..].iter().all(|o| o.id != c.id));
    }
}

#[test]
fn redact_hides_secrets_and_long_keys_but_keeps_fingerprints() {
    let key = HostKey::generate().public().to_b64();
    let fp = HostKey::generate().public().fingerprint();
    let text = format!("token s3cr3t-t0ken-value key {key} fp {fp} at http://127.0.0.1:9");
    let out = redact(&text, &["s3cr3t-t0ken-value".into()]);
    assert!(!out.contains("s3cr3t"));
    assert!(!out.contains(&key));
    assert!(out.contains(&fp));
    assert!(out.contains("http://127.0.0.1:9"));
    assert_eq!(out.matches("[redacted]").count(), 2);
}

#[test]
fn redact_keeps_deep_paths_and_fix_commands() {
    let path = "/Users/someone/Library/Application Support/AgentMBX/home/mailbox.db";
    let deep = "/Users/averyveryverylongusername/Library/LaunchAgents/org.agentmbx.daemon.plist";
    let long_dir = format!("/var/lib/{}/mailbox.db", "a".repeat(60));
    let fix = "agentmbx peers addr <host> <ip:port> for a moved peer; launchctl kickstart -k gui/$(id -u)/org.agentmbx.daemon";
    for text in [path, deep, long_dir.as_str(), fix] {
        assert_eq!(redact(text, &[]), text);
    }
    // A 64-byte key, and 64 hex digits, are redacted; a 44-character run that is not base64
    // of 32 bytes is not.
    use base64::Engine;
    let b64_64 = base64::engine::general_purpose::STANDARD.encode([7u8; 64]);
    let hex64 = "ab".repeat(32);
    let out = redact(&format!("a {b64_64} b {hex64} c"), &[]);
    assert_eq!(out, "a [redacted] b [redacted] c");
    let word = "x".repeat(44);
    assert_eq!(redact(&word, &[]), word);
}

#[test]
fn redact_hides_the_token_and_a_base64_32_byte_key() {
    use base64::Engine;
    let token = "tok_4f9a2c1e8b7d6a5f";
    let key = base64::engine::general_purpose::STANDARD.encode([0xfbu8; 32]);
    assert!(key.contains('/') || key.contains('+'), "{key}");
    let text = format!("Authorization: Bearer {token}; key={key}.");
    let out = redact(&text, &[token.into()]);
    assert_eq!(out, "Authorization: Bearer [redacted]; key=[redacted].");
}

#[tokio::test]
async fn a_check_that_cannot_run_is_an_error_not_a_crash() {
    let h = initialized();
    h.set_relay("http://127.0.0.1:1", None);
    // The enc key file is garbage: the identity cannot be loaded.
    std::fs::write(h.paths.enc_key(), "not a key").unwrap();
    let r = h.run(&["keystore", "relay-enrolled", "enc-ad"]).await;
    assert_eq!(one(&r, "keystore").status, Status::Fail);
    assert_eq!(one(&r, "relay-enrolled").status, Status::Error);
    assert!(one(&r, "relay-enrolled")
        .summary
        .contains("cannot load the identity"));
    assert_eq!(one(&r, "enc-ad").status, Status::Error);
    assert_eq!(r.summary.error, 2);
}

#[tokio::test]
async fn no_key_material_in_the_report() {
    let h = initialized();
    let token = "0123456789abcdef-secret-token";
    std::fs::write(h.paths.api_token(), token).unwrap();
    let r = h.run(&[]).await;
    let text = serde_json::to_string(&r).unwrap() + &r.text();
    let me = h.public();
    assert!(text.contains(&me.fingerprint));
    assert!(!text.contains(&me.host_pubkey));
    assert!(!text.contains(&me.enc_pub));
    assert!(!text.contains(token));
    let host_key = std::fs::read_to_string(h.paths.host_key()).unwrap();
    assert!(!text.contains(host_key.trim()));
}

// ---- local checks --------------------------------------------------------------------------

#[tokio::test]
async fn host_identity_fails_when_not_initialized_and_fix_creates_the_home_0700() {
    let h = uninitialized();
    let r = h.run(&["host-identity", "keystore"]).await;
    let c = one(&r, "host-identity");
    assert_eq!(c.status, Status::Fail);
    assert_eq!(c.fix.as_deref(), Some("agentmbx init"));
    assert_eq!(one(&r, "keystore").status, Status::Skip);
    assert_eq!(r.exit_code(), 1);
    assert!(!h.paths.home().exists(), "nothing written without --fix");
    let r = h.run_at(&["host-identity"], NOW, true).await;
    assert!(one(&r, "host-identity").details[0].starts_with("fixed: created"));
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        let m = std::fs::metadata(h.paths.home())
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(m & 0o777, 0o700);
    }
}

#[tokio::test]
async fn host_identity_ok_names_host_and_fingerprint() {
    let h = initialized();
    let r = h.run(&["host-identity"]).await;
    let c = one(&r, "host-identity");
    assert_eq!(c.status, Status::Ok, "{c:?}");
    assert!(c.summary.contains("doc"));
    assert!(c.summary.contains(&h.public().fingerprint));
}

#[cfg(unix)]
#[tokio::test]
async fn loose_key_file_fails_and_fix_sets_0600() {
    use std::os::unix::fs::PermissionsExt;
    let h = initialized();
    let key = h.paths.host_key();
    std::fs::set_permissions(&key, std::fs::Permissions::from_mode(0o644)).unwrap();
    let r = h.run(&["keystore"]).await;
    let c = one(&r, "keystore");
    assert_eq!(c.status, Status::Fail);
    assert!(c.fix.as_deref().unwrap().starts_with("chmod 600 "));
    let mode = || std::fs::metadata(&key).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode(), 0o644, "nothing changed without --fix");
    let r = h.run_at(&["keystore"], NOW, true).await;
    let c = one(&r, "keystore");
    assert_eq!(c.status, Status::Ok);
    assert!(c.details[0].contains("was 0644, now 0600"), "{c:?}");
    assert_eq!(mode(), 0o600);
}

#[tokio::test]
async fn quarantine_warns_with_the_relay_quarantine_fix() {
    let h = initialized();
    let r = h.run(&["quarantine", "outbox"]).await;
    assert_eq!(
        one(&r, "quarantine").status,
        Status::Skip,
        "no mailbox.db yet"
    );
    assert_eq!(one(&r, "outbox").status, Status::Skip);
    drop(h.mailbox());
    let r = h.run(&["quarantine"]).await;
    assert_eq!(one(&r, "quarantine").status, Status::Ok);
    h.mailbox()
        .with(|c| {
            relay_state::quarantine(
                c, "http://r", "ep1", 3, "envelope", "item", "pk", "bad", b"w", NOW,
            )
        })
        .unwrap();
    let r = h.run(&["quarantine"]).await;
    let c = one(&r, "quarantine");
    assert_eq!(c.status, Status::Warn);
    assert_eq!(c.summary, "1 quarantined relay item(s)");
    assert_eq!(c.fix.as_deref(), Some("agentmbx relay quarantine"));
}

/// Issue 17 (3): mail held for names with no agent here is a warning naming how many wait
/// for which names, with what to do; none is ok.
#[tokio::test]
async fn unclaimed_mail_warns_with_the_names_and_what_to_do() {
    let h = initialized();
    let r = h.run(&["unclaimed"]).await;
    assert_eq!(
        one(&r, "unclaimed").status,
        Status::Skip,
        "no mailbox.db yet"
    );
    drop(h.mailbox());
    let r = h.run(&["unclaimed"]).await;
    assert_eq!(one(&r, "unclaimed").status, Status::Ok);
    h.mailbox()
        .with(|c| {
            c.execute_batch(
                "INSERT INTO messages VALUES ('m1','t','a@work','m1',NULL,'message','s','b','{}','work',1);
                 INSERT INTO messages VALUES ('m2','t','a@work','m2',NULL,'message','s','b','{}','work',1);",
            )?;
            crate::mailbox::unclaimed::hold(c, "m1", "nobody", 1)?;
            crate::mailbox::unclaimed::hold(c, "m2", "nobody", 1)?;
            crate::mailbox::unclaimed::hold(c, "m2", "zoe", 1)
        })
        .unwrap();
    let r = h.run(&["unclaimed"]).await;
    let c = one(&r, "unclaimed");
    assert_eq!(c.status, Status::Warn);
    assert_eq!(
        c.summary,
        "3 message(s) held for name(s) with no agent here: nobody (2), zoe (1)"
    );
    assert!(
        c.details
            .iter()
            .any(|d| d.contains("agentmbx whoami --as <name>")),
        "{c:?}"
    );
    assert_eq!(c.fix.as_deref(), Some("agentmbx inbox --unclaimed"));
}

#[tokio::test]
async fn outbox_warns_on_pending_rows_older_than_an_hour() {
    let h = initialized();
    let s = crate::testutil::store();
    let me = crate::testutil::identity("doc");
    s.add_peer(&crate::testutil::identity("work"), false);
    s.send(
        &me,
        "alice",
        &["bob@work"],
        "hi",
        "01KDVDNA3VG2MH8KWSQRCWJZ0S",
        NOW,
    )
    .unwrap();
    let facts = |now_ms| Facts {
        paths: h.paths.clone(),
        opts: Options {
            fix: false,
            timeout: DEFAULT_TIMEOUT,
            now_ms,
        },
        config: Ok(Config::load(&h.paths).unwrap()),
        mailbox: Some(Mailbox::open(&s.path).unwrap()),
        relay_url: None,
        identity: Err("unused".into()),
        signer: None,
        probes: Default::default(),
        secrets: Vec::new(),
    };
    let at = checks::local::STUCK_AFTER_MS;
    let fresh = checks::evaluate("outbox", &facts(NOW + at)).unwrap();
    assert_eq!(
        fresh.status,
        Some(Status::Ok),
        "exactly 1 h old is not stuck"
    );
    assert_eq!(fresh.summary, "1 pending");
    let stuck = checks::evaluate("outbox", &facts(NOW + at + 1)).unwrap();
    assert_eq!(stuck.status, Some(Status::Warn));
    assert!(stuck.details[0].starts_with("1 pending row(s) older than 1 h"));
    assert!(stuck.fix.is_some());
}

#[test]
fn disk_thresholds_at_and_past_the_limits() {
    assert_eq!(disk_verdict(DISK_FAIL_BYTES - 1), Status::Fail);
    assert_eq!(disk_verdict(DISK_FAIL_BYTES), Status::Warn);
    assert_eq!(disk_verdict(DISK_WARN_BYTES - 1), Status::Warn);
    assert_eq!(disk_verdict(DISK_WARN_BYTES), Status::Ok);
}

#[tokio::test]
async fn disk_space_measures_the_home() {
    let h = initialized();
    let r = h.run(&["disk-space"]).await;
    let c = one(&r, "disk-space");
    assert_ne!(c.status, Status::Error, "{c:?}");
    assert!(c.summary.contains("MiB free"));
}

// ---- daemon and peers ----------------------------------------------------------------------

#[tokio::test]
async fn daemon_not_running_fails_and_another_host_warns() {
    let h = initialized();
    let set_api_port = |port: u16| {
        let cfg = std::fs::read_to_string(h.paths.config_file()).unwrap_or_default();
        let cfg: String = cfg
            .lines()
            .filter(|l| !l.trim_start().starts_with("api_port"))
            .map(|l| format!("{l}\n"))
            .collect();
        std::fs::write(h.paths.config_file(), format!("api_port = {port}\n{cfg}")).unwrap();
    };
    let configured = closed_port();
    set_api_port(configured);
    std::fs::write(
        h.paths.api_addr_file(),
        format!("127.0.0.1:{}", closed_port()),
    )
    .unwrap();
    let r = h.run(&["daemon"]).await;
    let c = one(&r, "daemon");
    assert_eq!(
        c.status,
        Status::Fail,
        "connection refused fails (wire.md §7 item 3)"
    );
    assert!(c.summary.starts_with("daemon not answering"));
    assert_eq!(r.exit_code(), 1);
    // It names the address it tried, where that came from and the home, and suggests the
    // foreground daemon as well as the service.
    let home = h.paths.home().display().to_string();
    assert!(c.summary.contains(&home), "{c:?}");
    let all = c.details.join("\n");
    assert!(
        all.contains("api.addr") && all.contains("written by the daemon last started"),
        "{all}"
    );
    assert!(all.contains("agentmbx daemon\n"), "{all}");
    assert!(all.contains("agentmbx daemon install"), "{all}");
    assert!(
        all.contains(&format!(
            "also tried 127.0.0.1:{configured} (from config.toml)"
        )),
        "a stale api.addr does not hide the configured port: {all}"
    );

    // Without api.addr, the configured port is tried and named as such.
    std::fs::remove_file(h.paths.api_addr_file()).unwrap();
    let port = closed_port();
    set_api_port(port);
    let r = h.run(&["daemon"]).await;
    let c = one(&r, "daemon");
    assert_eq!(c.status, Status::Fail, "{c:?}");
    assert!(c.summary.contains(&format!(":{port} ")), "{c:?}");
    assert!(
        c.details.join("\n").contains("is from config.toml"),
        "{c:?}"
    );

    let health = |host: &'static str, version: &'static str| {
        Router::new().route(
            "/v1/health",
            get(move || async move {
                axum::Json(json!({"status": "ok", "host": host, "version": version}))
            }),
        )
    };
    let other = serve(health("other", crate::VERSION)).await;
    std::fs::write(h.paths.api_addr_file(), other.to_string()).unwrap();
    let r = h.run(&["daemon"]).await;
    let c = one(&r, "daemon");
    assert_eq!(c.status, Status::Fail, "this host's daemon does not answer");
    assert!(c.summary.contains("serves host `other`"), "{}", c.summary);
    assert_eq!(r.exit_code(), 1);

    let old = serve(health("doc", "0.0.1")).await;
    std::fs::write(h.paths.api_addr_file(), old.to_string()).unwrap();
    let c = h.run(&["daemon"]).await.checks.remove(0);
    assert_eq!(c.status, Status::Warn);
    assert!(c.summary.contains("version 0.0.1"));

    let me = serve(health("doc", crate::VERSION)).await;
    std::fs::write(h.paths.api_addr_file(), me.to_string()).unwrap();
    let c = h.run(&["daemon"]).await.checks.remove(0);
    assert_eq!(c.status, Status::Ok, "{c:?}");

    // A stale api.addr (the daemon now runs on the configured port): found there.
    set_api_port(me.port());
    std::fs::write(
        h.paths.api_addr_file(),
        format!("127.0.0.1:{}", closed_port()),
    )
    .unwrap();
    let c = h.run(&["daemon"]).await.checks.remove(0);
    assert_eq!(c.status, Status::Ok, "{c:?}");
    assert!(c.summary.contains(&me.to_string()), "{c:?}");

    // Something else on the port: this host's daemon is not answering.
    let other_program = serve(Router::new().route("/v1/health", get(|| async { "hello" }))).await;
    std::fs::write(h.paths.api_addr_file(), other_program.to_string()).unwrap();
    let c = h.run(&["daemon"]).await.checks.remove(0);
    assert_eq!(c.status, Status::Fail);
    assert!(
        c.summary.contains("not an AgentMBX daemon"),
        "{}",
        c.summary
    );
}

#[tokio::test]
async fn a_degraded_daemon_answers_and_its_clone_reasons_fail_or_warn_with_what_to_do() {
    let h = initialized();
    h.set_relay("http://127.0.0.1:9", None);
    let health = |body: Value| {
        Router::new().route(
            "/v1/health",
            get(move || {
                let body = body.clone();
                async move { axum::Json(body) }
            }),
        )
    };
    let ids = ["daemon", "host-key-clone", "peer-key-clone"];
    // Healthy: both clone checks pass.
    let ok = serve(health(
        json!({"status": "ok", "host": "doc", "version": crate::VERSION}),
    ))
    .await;
    std::fs::write(h.paths.api_addr_file(), ok.to_string()).unwrap();
    let r = h.run(&ids).await;
    for id in ids {
        assert_eq!(one(&r, id).status, Status::Ok, "{id}: {:?}", one(&r, id));
    }
    // Degraded: another daemon on this key (fail, with what to do), a peer with two (warn).
    let degraded = serve(health(json!({
        "status": "degraded", "host": "doc", "version": crate::VERSION,
        "reasons": [
            {"code": "host-key-clone", "detail": "…", "relay": "http://127.0.0.1:9"},
            {"code": "peer-key-clone", "detail": "…", "peer": "xb"},
        ],
    })))
    .await;
    std::fs::write(h.paths.api_addr_file(), degraded.to_string()).unwrap();
    let r = h.run(&ids).await;
    let d = one(&r, "daemon");
    assert_eq!(d.status, Status::Ok, "the daemon answers: {d:?}");
    assert!(d.summary.contains("degraded"), "{d:?}");
    let c = one(&r, "host-key-clone");
    assert_eq!(c.status, Status::Fail, "{c:?}");
    assert!(c.summary.contains("another daemon is using this host key"));
    assert!(c.summary.contains(&h.public().fingerprint), "{c:?}");
    let details = c.details.join("\n");
    assert!(details.contains("stop the daemon"), "{details}");
    assert!(
        details.contains("`agentmbx init` in a fresh home"),
        "{details}"
    );
    let p = one(&r, "peer-key-clone");
    assert_eq!(p.status, Status::Warn, "{p:?}");
    assert!(p.summary.contains("(xb)"), "{p:?}");
    assert!(p.details[0].starts_with("xb: "), "{p:?}");
    assert!(p.details[0].contains("xb's owner"), "{p:?}");
    assert_eq!(r.exit_code(), 1);
    // No daemon answering: nothing can be told, the checks skip.
    std::fs::write(
        h.paths.api_addr_file(),
        format!("127.0.0.1:{}", closed_port()),
    )
    .unwrap();
    let r = h.run(&ids[1..]).await;
    assert!(r.checks.iter().all(|c| c.status == Status::Skip), "{r:?}");
}

/// Doctor reads health with this home's API token, so the clone checks get each reason's
/// peer and relay (the daemon gives only codes without it); without a readable token a peer
/// conflict is still a warning, not `ok`.
#[tokio::test]
async fn doctor_reads_health_with_the_api_token_and_still_warns_without_it() {
    let h = initialized();
    h.set_relay("http://127.0.0.1:9", None);
    const TOKEN: &str = "doctor-test-token";
    let fake = serve(Router::new().route(
        "/v1/health",
        get(|headers: axum::http::HeaderMap| async move {
            let authed = headers
                .get("authorization")
                .is_some_and(|v| v.as_bytes() == format!("Bearer {TOKEN}").as_bytes());
            let reason = if authed {
                json!({"code": "peer-key-clone", "detail": "…", "peer": "xb"})
            } else {
                json!({"code": "peer-key-clone"})
            };
            axum::Json(json!({"status": "degraded", "host": "doc",
                              "version": crate::VERSION, "reasons": [reason]}))
        }),
    ))
    .await;
    std::fs::write(h.paths.api_addr_file(), fake.to_string()).unwrap();
    std::fs::write(h.paths.api_token(), format!("{TOKEN}\n")).unwrap();
    let r = h.run(&["peer-key-clone"]).await;
    let p = one(&r, "peer-key-clone");
    assert_eq!(p.status, Status::Warn, "{p:?}");
    assert!(p.summary.contains("(xb)"), "{p:?}");

    std::fs::remove_file(h.paths.api_token()).unwrap();
    let r = h.run(&["peer-key-clone"]).await;
    let p = one(&r, "peer-key-clone");
    assert_eq!(p.status, Status::Warn, "{p:?}");
    assert!(p.details.join("\n").contains("api.token"), "{p:?}");
}

/// A fake peer answering `/v1/status?challenge=` signed by `key` as `host`, and `/v1/agents`
/// with an empty directory when `accepts`, else 401.
async fn fake_peer(key: HostKey, host: &'static str, accepts: bool) -> SocketAddr {
    let key = std::sync::Arc::new(key);
    let agents = move |headers: axum::http::HeaderMap| async move {
        // A hop-signed request carries the signature headers.
        let signed = headers.contains_key("x-mbx-sig");
        if accepts && signed {
            (
                axum::http::StatusCode::OK,
                axum::Json(json!({"host": host, "agents": []})),
            )
        } else {
            (
                axum::http::StatusCode::UNAUTHORIZED,
                axum::Json(json!({"error": "unknown sender", "code": "UNAUTHORIZED"})),
            )
        }
    };
    serve(Router::new().route("/v1/agents", get(agents)).route(
        "/v1/status",
        get(
            move |q: axum::extract::Query<std::collections::HashMap<String, String>>| {
                let key = key.clone();
                async move {
                    let c = q.get("challenge").cloned().unwrap_or_default();
                    let st = SignedStatus::sign(&key, host, &c, vec![], "9.9.9", NOW);
                    axum::Json(serde_json::to_value(st).unwrap())
                }
            },
        ),
    ))
    .await
}

#[tokio::test]
async fn peers_need_a_status_signed_by_the_pinned_key() {
    let h = initialized();
    let r = h.run(&["peers"]).await;
    assert_eq!(one(&r, "peers").status, Status::Skip);
    let good = HostKey::generate();
    let good_pub = good.public().to_b64();
    let good_addr = fake_peer(good, "work", true).await;
    let impostor = fake_peer(HostKey::generate(), "lab", true).await;
    let refuses = HostKey::generate();
    let refuses_pub = refuses.public().to_b64();
    let refuses_addr = fake_peer(refuses, "den", false).await;
    let lab_pinned = HostKey::generate().public().to_b64();
    h.mailbox()
        .with(|c| {
            crate::mailbox::peers::add(c, "work", &good_pub, NOW)?;
            crate::mailbox::peers::set_addr(c, "work", &good_addr.to_string(), "cli")?;
            Ok(())
        })
        .unwrap();
    let r = h.run(&["peers"]).await;
    let c = one(&r, "peers");
    assert_eq!(c.status, Status::Ok, "{c:?}");
    assert!(c.details[0].contains("version 9.9.9"));

    h.mailbox()
        .with(|c| {
            crate::mailbox::peers::add(c, "den", &refuses_pub, NOW)?;
            crate::mailbox::peers::set_addr(c, "den", &refuses_addr.to_string(), "cli")?;
            crate::mailbox::peers::add(c, "gone", &HostKey::generate().public().to_b64(), NOW)?;
            crate::mailbox::peers::set_addr(
                c,
                "gone",
                &format!("127.0.0.1:{}", closed_port()),
                "cli",
            )?;
            Ok(())
        })
        .unwrap();
    // Unreachable, or not accepting our signature: warn.
    let started = std::time::Instant::now();
    let r = h.run(&["peers"]).await;
    assert!(started.elapsed() < Duration::from_secs(5));
    let c = one(&r, "peers");
    assert_eq!(c.status, Status::Warn, "{c:?}");
    assert_eq!(
        c.summary,
        "2 of 3 peer(s) not reachable or not accepting our signature"
    );
    let all = c.details.join("\n");
    assert!(all.contains("gone at "), "{all}");
    assert!(
        all.contains("den at ") && all.contains("does not accept our signed request"),
        "{all}"
    );
    assert!(
        all.contains("gone may be down; if it moved: agentmbx peers addr gone IP:PORT"),
        "{all}"
    );
    assert_eq!(c.fix, None, "no command fixes a peer that is down");

    // A status not signed by the pinned key: fail.
    h.mailbox()
        .with(|c| {
            crate::mailbox::peers::add(c, "lab", &lab_pinned, NOW)?;
            crate::mailbox::peers::set_addr(c, "lab", &impostor.to_string(), "cli")
        })
        .unwrap();
    let r = h.run(&["peers"]).await;
    let c = one(&r, "peers");
    assert_eq!(c.status, Status::Fail, "{c:?}");
    assert_eq!(r.exit_code(), 1);
    assert!(
        c.summary
            .starts_with("1 of 4 peer(s) answered a status not signed by the pinned key"),
        "{}",
        c.summary
    );
    let all = c.details.join("\n");
    assert!(
        all.contains("lab at ") && all.contains("not signed by the pinned key"),
        "{all}"
    );
    assert!(all.contains("gone at "), "{all}");
    assert!(
        all.contains("den at ") && all.contains("does not accept our signed request"),
        "{all}"
    );
    assert_eq!(c.fix.as_deref(), Some("agentmbx peers remove lab"));
}

// ---- relay ---------------------------------------------------------------------------------

#[tokio::test]
async fn relay_checks_skip_without_a_relay() {
    let h = initialized();
    let r = h
        .run(&[
            "relay-reachable",
            "relay-key",
            "relay-enrolled",
            "enc-ad",
            "clock-skew",
        ])
        .await;
    assert!(r.checks.iter().all(|c| c.status == Status::Skip), "{r:?}");
}

#[tokio::test]
async fn unreachable_relay_fails_quickly() {
    let h = initialized();
    h.set_relay(&format!("http://127.0.0.1:{}", closed_port()), None);
    let started = std::time::Instant::now();
    let r = h.run(&["relay-reachable", "clock-skew"]).await;
    assert!(started.elapsed() < Duration::from_secs(5));
    let c = one(&r, "relay-reachable");
    assert_eq!(c.status, Status::Fail);
    // The cause in our words, precisely (not "refused or unreachable").
    assert!(c.summary.contains("connection refused"), "{c:?}");
    assert!(!c.summary.contains("or unreachable"), "{c:?}");
    assert_eq!(one(&r, "clock-skew").status, Status::Skip);
    assert_eq!(r.exit_code(), 1);
}

#[tokio::test]
async fn a_down_relay_says_what_to_check_and_only_warns_while_every_peer_answers_on_the_lan() {
    let h = initialized();
    let url = format!("https://127.0.0.1:{}", closed_port());
    h.set_relay(&url, None);
    let r = h.run(&["relay-reachable"]).await;
    let c = one(&r, "relay-reachable");
    assert_eq!(
        c.status,
        Status::Fail,
        "no peers: the relay is the only route"
    );
    let all = c.details.join("\n");
    for what in [
        "is the URL right?",
        "is the relay running?",
        "proxy:",
        "TLS: the URL starts with https://",
        "firewall:",
    ] {
        assert!(all.contains(what), "{what}: {all}");
    }

    // Every paired peer answers over the LAN: a warning with the reason, not a failure.
    let key = HostKey::generate();
    let public = key.public().to_b64();
    let addr = fake_peer(key, "work", true).await;
    h.mailbox()
        .with(|c| {
            crate::mailbox::peers::add(c, "work", &public, NOW)?;
            crate::mailbox::peers::set_addr(c, "work", &addr.to_string(), "cli")?;
            Ok(())
        })
        .unwrap();
    let r = h.run(&["relay-reachable"]).await;
    let c = one(&r, "relay-reachable");
    assert_eq!(c.status, Status::Warn, "{c:?}");
    assert!(c.summary.contains("answer over the LAN"), "{c:?}");
    assert_eq!(r.exit_code(), 0);

    // One peer that does not answer: the relay is needed again, so it fails.
    h.mailbox()
        .with(|c| {
            crate::mailbox::peers::add(c, "gone", &HostKey::generate().public().to_b64(), NOW)?;
            crate::mailbox::peers::set_addr(
                c,
                "gone",
                &format!("127.0.0.1:{}", closed_port()),
                "cli",
            )?;
            Ok(())
        })
        .unwrap();
    let r = h.run(&["relay-reachable"]).await;
    assert_eq!(one(&r, "relay-reachable").status, Status::Fail);
}

#[tokio::test]
async fn relay_key_mismatch_fails_with_the_exact_fix() {
    let h = initialized();
    let served = HostKey::generate();
    let served_fp = served.public().fingerprint();
    let url = fake_relay(&served).await;
    h.set_relay(&url, None);
    let r = h.run(&["relay-reachable", "relay-key"]).await;
    assert_eq!(one(&r, "relay-reachable").status, Status::Ok);
    let c = one(&r, "relay-key");
    assert_eq!(c.status, Status::Warn, "nothing pinned yet: {c:?}");
    assert_eq!(
        c.fix,
        Some(format!("agentmbx relay set {url} --key {served_fp}"))
    );

    h.set_relay(&url, Some(served.public().to_b64()));
    let r = h.run(&["relay-key"]).await;
    assert_eq!(one(&r, "relay-key").status, Status::Ok);

    let pinned = HostKey::generate().public();
    h.set_relay(&url, Some(pinned.to_b64()));
    let r = h.run(&["relay-key"]).await;
    let c = one(&r, "relay-key");
    assert_eq!(c.status, Status::Fail);
    assert!(c.summary.contains(&pinned.fingerprint()));
    assert_eq!(
        c.fix,
        Some(format!("agentmbx relay set {url} --key {served_fp}"))
    );
}

#[tokio::test]
async fn recorded_key_mismatch_fails_while_the_relay_is_down() {
    let h = initialized();
    let url = format!("http://127.0.0.1:{}", closed_port());
    h.set_relay(&url, None);
    let m = h.mailbox();
    m.with(|c| {
        relay_state::kv_set(
            c,
            &state::key_kv(&url),
            &HostKey::generate().public().to_b64(),
        )?;
        state::record_key_mismatch(
            c,
            &url,
            "pinned",
            "aaaa-bbbb-cccc-dddd",
            "1111-2222-3333-4444",
            NOW,
        )
    })
    .unwrap();
    let r = h.run(&["relay-key"]).await;
    let c = one(&r, "relay-key");
    assert_eq!(c.status, Status::Fail, "{c:?}");
    assert_eq!(
        c.fix,
        Some(format!(
            "agentmbx relay set {url} --key 1111-2222-3333-4444"
        ))
    );
}

#[tokio::test]
async fn enrolment_must_match_the_key_epoch_and_host_key_the_client_writes() {
    let h = initialized();
    let relay = HostKey::generate();
    let url = fake_relay(&relay).await;
    h.set_relay(&url, Some(relay.public().to_b64()));
    let me = h.public();
    let r = h.run(&["relay-enrolled"]).await;
    assert_eq!(one(&r, "relay-enrolled").status, Status::Warn);
    let write = |epoch: &str| {
        let e = Enrolment {
            relay_pubkey: relay.public().to_b64(),
            epoch: epoch.into(),
            host_pubkey: me.host_pubkey.clone(),
            at: "2026-01-01T00:00:00.000Z".into(),
        };
        h.mailbox()
            .with(|c| state::set_enrolment(c, &url, &e))
            .unwrap();
    };
    write("ep0");
    let c = h.run(&["relay-enrolled"]).await.checks.remove(0);
    assert_eq!(c.status, Status::Warn);
    assert!(
        c.summary.contains("epoch ep0, the relay is in ep1"),
        "{}",
        c.summary
    );
    write("ep1");
    let c = h.run(&["relay-enrolled"]).await.checks.remove(0);
    assert_eq!(c.status, Status::Ok, "{c:?}");

    h.mailbox()
        .with(|c| state::set_state(c, &url, RelayState::new(Standing::Revoked), NOW).map(|_| ()))
        .unwrap();
    let c = h.run(&["relay-enrolled"]).await.checks.remove(0);
    assert_eq!(c.status, Status::Fail);
    assert_eq!(c.fix, None, "no command undoes a revocation");
    assert!(c.details.iter().any(|d| d == state::REVOKED_FIX), "{c:?}");
}

#[tokio::test]
async fn enc_ad_expired_fails_and_near_expiry_warns() {
    let h = initialized();
    let url = format!("http://127.0.0.1:{}", closed_port());
    h.set_relay(&url, None);
    let me = h.public();
    let r = h.run(&["enc-ad"]).await;
    assert_eq!(one(&r, "enc-ad").status, Status::Warn, "no ad yet");
    let exp = NOW + super::checks::relay::AD_EXPIRY_WARN_MS;
    let ad = PublishedAd {
        host_pubkey: me.host_pubkey.clone(),
        enc_pub: me.enc_pub.clone(),
        iat: NOW - 1000,
        exp,
        epoch: "ep1".into(),
    };
    h.mailbox()
        .with(|c| state::set_published_ad(c, &url, &ad))
        .unwrap();
    let h = &h;
    let at = |now| async move { h.run_at(&["enc-ad"], now, false).await.checks.remove(0) };
    assert_eq!(at(NOW).await.status, Status::Ok, "exactly 7 days left");
    assert_eq!(at(NOW + 1).await.status, Status::Warn);
    assert_eq!(at(exp - 1).await.status, Status::Warn);
    let c = at(exp).await;
    assert_eq!(c.status, Status::Fail);
    assert!(c.summary.contains("expired"));
}

#[test]
fn skew_thresholds_at_and_past_the_limits() {
    use super::checks::relay::{SKEW_FAIL_MS, SKEW_WARN_MS};
    assert_eq!(skew_verdict(SKEW_WARN_MS), Status::Ok);
    assert_eq!(skew_verdict(-SKEW_WARN_MS - 1), Status::Warn);
    assert_eq!(skew_verdict(SKEW_FAIL_MS), Status::Warn);
    assert_eq!(skew_verdict(SKEW_FAIL_MS + 1), Status::Fail);
    assert_eq!(skew_verdict(i64::MIN), Status::Fail);
}

#[tokio::test]
async fn clock_skew_against_the_relay_date() {
    let h = initialized();
    let url = fake_relay(&HostKey::generate()).await;
    h.set_relay(&url, None);
    let date = relay_date_ms();
    let h = &h;
    let at = |now| async move { h.run_at(&["clock-skew"], now, false).await.checks.remove(0) };
    assert_eq!(at(date).await.status, Status::Ok);
    let c = at(date + 31_000).await;
    assert_eq!(c.status, Status::Warn);
    assert_eq!(c.summary, "this clock is 31 s ahead of the relay's");
    let c = at(date - 301_000).await;
    assert_eq!(c.status, Status::Fail);
    assert!(c.fix.is_some());
}

// ---- config, fix commands, --fix limits, relay-only peers ---------------------------------

fn append_to_config(h: &Home, line: &str) {
    let mut text = std::fs::read_to_string(h.paths.config_file()).unwrap_or_default();
    text.push_str(line);
    std::fs::write(h.paths.config_file(), text).unwrap();
}

#[tokio::test]
async fn an_invalid_config_fails_the_config_check_and_the_checks_needing_it_skip() {
    let h = initialized();
    let r = h.run(&["config"]).await;
    assert_eq!(one(&r, "config").status, Status::Ok, "{r:?}");
    h.set_relay("http://127.0.0.1:1", None);
    append_to_config(&h, "bogus = 1\n");
    let r = h.run(&[]).await;
    let c = one(&r, "config");
    assert_eq!(c.status, Status::Fail, "{c:?}");
    assert_eq!(c.fix.as_deref(), Some("agentmbx config validate"));
    assert!(c.details[0].contains("bogus"), "{c:?}");
    for id in [
        "host-identity",
        "keystore",
        "daemon",
        "peers",
        "relay-reachable",
        "relay-key",
        "relay-enrolled",
        "enc-ad",
        "clock-skew",
    ] {
        let c = one(&r, id);
        assert_eq!(
            (c.status, c.summary.as_str()),
            (Status::Skip, "config.toml is invalid"),
            "{id}"
        );
    }
    assert_eq!((r.summary.fail, r.summary.error), (1, 0), "{r:?}");
    assert_eq!(r.exit_code(), 1);
    // Named checks alone: the config failure is reported with them, and the run fails.
    let r = h.run(&["host-identity", "relay-key"]).await;
    let ids: Vec<&str> = r.checks.iter().map(|c| c.id).collect();
    assert_eq!(ids, ["config", "host-identity", "relay-key"]);
    assert_eq!(r.exit_code(), 1);
}

#[tokio::test]
async fn an_unreachable_relay_says_nothing_of_an_empty_outbox_or_of_72_hours() {
    let h = initialized();
    h.set_relay(&format!("http://127.0.0.1:{}", closed_port()), None);
    drop(h.mailbox());
    let r = h.run(&["relay-reachable"]).await;
    let c = one(&r, "relay-reachable");
    assert_eq!(c.status, Status::Fail);
    let all = c.details.join("\n");
    assert!(!all.contains("72 h") && !all.contains("pending"), "{all}");
    assert_eq!(c.fix.as_deref(), Some("agentmbx relay info --live"));
}

#[test]
fn proxy_in_use_names_the_variable_and_hides_credentials() {
    use super::checks::net::proxy_in_use;
    fn env(pairs: &'static [(&'static str, &'static str)]) -> impl Fn(&str) -> Option<String> {
        move |k| {
            pairs
                .iter()
                .find(|(n, _)| *n == k)
                .map(|(_, v)| v.to_string())
        }
    }
    let https = "https://relay.example.com:8443/base";
    assert_eq!(
        proxy_in_use(https, &env(&[("HTTPS_PROXY", "http://me:pw@proxy:3128")])),
        Some("http://***@proxy:3128 (HTTPS_PROXY)".into())
    );
    assert_eq!(
        proxy_in_use(
            "http://relay.example.com",
            &env(&[("HTTPS_PROXY", "http://proxy:3128")])
        ),
        None,
        "HTTPS_PROXY is for https URLs"
    );
    assert_eq!(
        proxy_in_use(
            "http://relay.example.com",
            &env(&[("http_proxy", "proxy:8080"), ("ALL_PROXY", "socks5://s:1")])
        ),
        Some("proxy:8080 (http_proxy)".into())
    );
    assert_eq!(
        proxy_in_use(https, &env(&[("ALL_PROXY", "socks5h://a:b@s:1")])),
        Some("socks5h://***@s:1 (ALL_PROXY)".into())
    );
    for no in [
        "localhost,.example.com",
        "example.com",
        "*",
        "relay.example.com",
    ] {
        let vars: &'static [(&str, &str)] = Box::leak(Box::new([
            ("HTTPS_PROXY", "http://p:1"),
            (
                "NO_PROXY",
                Box::leak(no.to_string().into_boxed_str()) as &str,
            ),
        ]));
        assert_eq!(proxy_in_use(https, &env(vars)), None, "{no}");
    }
    assert_eq!(
        proxy_in_use(
            https,
            &env(&[("HTTPS_PROXY", "http://p:1"), ("NO_PROXY", "ample.com")])
        ),
        Some("http://p:1 (HTTPS_PROXY)".into())
    );
    assert_eq!(proxy_in_use(https, &env(&[])), None);
}

#[test]
fn shell_quote_leaves_plain_words_and_quotes_the_rest() {
    assert_eq!(
        shell_quote("/var/lib/agentmbx-1.0/x_y@z"),
        "/var/lib/agentmbx-1.0/x_y@z"
    );
    assert_eq!(shell_quote("http://127.0.0.1:9"), "http://127.0.0.1:9");
    assert_eq!(shell_quote("/tmp/nu sp/home"), "'/tmp/nu sp/home'");
    assert_eq!(shell_quote("it's"), "'it'\\''s'");
    assert_eq!(shell_quote(""), "''");
    assert_eq!(shell_quote("$(rm -rf ~)"), "'$(rm -rf ~)'");
}

#[cfg(unix)]
#[tokio::test]
async fn a_fix_command_runs_as_it_stands_on_a_path_with_spaces_and_quotes() {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().unwrap();
    let paths = Paths::at(dir.path().join("nu sp").join("it's $HOME"));
    paths.ensure_home().unwrap();
    let store = FileStore::new(paths.home());
    let name = crate::host_name::HostName::parse("doc").unwrap();
    crate::identity::init_with(&paths, Some(&name), &store).unwrap();
    let h = Home { _dir: dir, paths };
    let keys = [h.paths.host_key(), h.paths.enc_key()];
    for k in &keys {
        std::fs::set_permissions(k, std::fs::Permissions::from_mode(0o644)).unwrap();
    }
    std::fs::set_permissions(h.paths.home(), std::fs::Permissions::from_mode(0o755)).unwrap();
    let r = h.run(&["host-identity", "keystore"]).await;
    for id in ["host-identity", "keystore"] {
        let fix = one(&r, id).fix.clone().expect("a fix");
        let status = std::process::Command::new("sh")
            .arg("-c")
            .arg(&fix)
            .status()
            .unwrap();
        assert!(status.success(), "{fix}");
    }
    let mode = |p: &std::path::Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o7777;
    assert_eq!(mode(h.paths.home()), 0o700);
    for k in &keys {
        assert_eq!(mode(k), 0o600, "{}", k.display());
    }
    let r = h.run(&["host-identity", "keystore"]).await;
    assert!(r.checks.iter().all(|c| c.status == Status::Ok), "{r:?}");
}

#[cfg(unix)]
#[tokio::test]
async fn fix_tightens_a_home_this_user_owns_but_never_a_sticky_or_foreign_one() {
    use std::os::unix::fs::PermissionsExt;
    let h = initialized();
    let home = h.paths.home().to_path_buf();
    let set = |m| std::fs::set_permissions(&home, std::fs::Permissions::from_mode(m)).unwrap();
    let mode = || std::fs::metadata(&home).unwrap().permissions().mode() & 0o7777;

    set(0o1777);
    let c = h.run(&["host-identity"]).await.checks.remove(0);
    assert_eq!(c.status, Status::Warn);
    assert!(c.details[0].contains("mode 1777"), "{c:?}");
    assert_eq!(c.fix, None, "no chmod for a shared directory");
    let c = h
        .run_at(&["host-identity"], NOW, true)
        .await
        .checks
        .remove(0);
    assert_eq!(c.status, Status::Warn, "{c:?}");
    assert!(
        c.details
            .iter()
            .any(|d| d.contains("sticky") && d.contains("1777")),
        "{c:?}"
    );
    assert_eq!(mode(), 0o1777, "--fix left the sticky directory alone");

    set(0o755);
    let c = h.run(&["host-identity"]).await.checks.remove(0);
    assert_eq!(c.fix, Some(format!("chmod 700 {}", shell_path(&home))));
    let c = h
        .run_at(&["host-identity"], NOW, true)
        .await
        .checks
        .remove(0);
    assert_eq!(c.status, Status::Ok, "{c:?}");
    assert_eq!(
        c.details[0],
        format!("fixed: {} was 0755, now 0700", home.display())
    );
    assert_eq!(mode(), 0o700);

    // Another user's directory (only root can hand one over): reported, not changed.
    #[allow(unsafe_code)]
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } == 0 {
        use std::os::unix::ffi::OsStrExt;
        set(0o755);
        let c_path = std::ffi::CString::new(home.as_os_str().as_bytes()).unwrap();
        // SAFETY: a valid NUL-terminated path; uid/gid 65534 (nobody).
        #[allow(unsafe_code)]
        let rc = unsafe { libc::chown(c_path.as_ptr(), 65534, 65534) };
        assert_eq!(rc, 0);
        let c = h
            .run_at(&["host-identity"], NOW, true)
            .await
            .checks
            .remove(0);
        assert_eq!(c.status, Status::Warn, "{c:?}");
        assert!(
            c.details.iter().any(|d| d.contains("belongs to uid 65534")),
            "{c:?}"
        );
        assert_eq!(c.fix, None);
        assert_eq!(mode(), 0o755);
    }
}

#[tokio::test]
async fn a_relay_key_mismatch_stops_enrolment_and_enc_ad_with_the_relay_set_fix() {
    let h = initialized();
    let served = HostKey::generate();
    let url = fake_relay(&served).await;
    let pinned = HostKey::generate().public();
    h.set_relay(&url, Some(pinned.to_b64()));
    let me = h.public();
    // What the client wrote while the pinned key answered: an enrolment and a valid ad.
    h.mailbox()
        .with(|c| {
            state::set_enrolment(
                c,
                &url,
                &Enrolment {
                    relay_pubkey: pinned.to_b64(),
                    epoch: "ep1".into(),
                    host_pubkey: me.host_pubkey.clone(),
                    at: "2026-01-01T00:00:00.000Z".into(),
                },
            )?;
            state::set_published_ad(
                c,
                &url,
                &PublishedAd {
                    host_pubkey: me.host_pubkey.clone(),
                    enc_pub: me.enc_pub.clone(),
                    iat: NOW,
                    exp: NOW + 30 * 86_400_000,
                    epoch: "ep1".into(),
                },
            )
        })
        .unwrap();
    let r = h.run(&["relay-key", "relay-enrolled", "enc-ad"]).await;
    let want = Some(format!(
        "agentmbx relay set {url} --key {}",
        served.public().fingerprint()
    ));
    let key = one(&r, "relay-key");
    assert_eq!((key.status, &key.fix), (Status::Fail, &want));
    for id in ["relay-enrolled", "enc-ad"] {
        let c = one(&r, id);
        assert_eq!(c.status, Status::Skip, "{id}: {c:?}");
        assert!(c.summary.contains("relay use is stopped"), "{id}: {c:?}");
        assert_eq!(c.fix, want, "{id}");
    }
}

#[tokio::test]
async fn a_peer_without_a_lan_address_is_fine_through_a_working_relay() {
    let h = initialized();
    h.mailbox()
        .with(|c| {
            crate::mailbox::peers::add(c, "hostb", &HostKey::generate().public().to_b64(), NOW)
        })
        .unwrap();
    let r = h.run(&["peers"]).await;
    let c = one(&r, "peers");
    assert_eq!(c.status, Status::Warn, "{c:?}");
    let all = c.details.join("\n");
    assert!(
        all.contains("hostb: no LAN address known, and no relay is configured"),
        "{all}"
    );
    assert!(all.contains("agentmbx peers addr hostb IP:PORT"), "{all}");
    assert_eq!(c.fix, None, "no placeholder command");

    let relay = HostKey::generate();
    let url = fake_relay(&relay).await;
    h.set_relay(&url, Some(relay.public().to_b64()));
    let r = h.run(&["peers"]).await;
    let c = one(&r, "peers");
    assert_eq!(c.status, Status::Ok, "{c:?}");
    assert_eq!(
        c.summary,
        "1 peer(s) reachable, 1 of them via the relay only"
    );
    assert!(c.details[0].contains("hostb: via the relay only"), "{c:?}");

    // The relay presents another key: relay use is stopped, so the peer has no route.
    h.set_relay(&url, Some(HostKey::generate().public().to_b64()));
    let c = h.run(&["peers"]).await.checks.remove(0);
    assert_eq!(c.status, Status::Warn, "{c:?}");
    assert!(
        c.details[0].contains("the relay does not answer with its pinned key"),
        "{c:?}"
    );
}
