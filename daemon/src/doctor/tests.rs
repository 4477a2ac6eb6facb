//! Unit tests of the doctor framework: the report as JSON and text, check selection, redaction,
//! shell quoting of fixes, and checks that cannot run. The tests of each check's fail path live
//! beside it (`checks/local/tests.rs`, `checks/relay/tests.rs`, …) over `test_support.rs`.

use serde_json::json;

use agentmbx_protocol::keys::HostKey;

use crate::doctor::test_support::*;
use crate::doctor::*;
use crate::keystore::file::FileStore;

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
