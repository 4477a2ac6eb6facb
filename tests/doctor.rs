//! `agentmbx doctor` against the real binary (conventions.md "Platform conventions"; `wire.md`
//! §7): the JSON shape and exit status on a home that is not initialized, on a fresh initialized
//! home with no daemon and no relay, with a running daemon, with an unreachable relay, and the
//! service check with and without a unit file; an invalid `config.toml`; the proxy named when
//! the relay is unreachable through one; `--list` and an unknown check id (also offered to
//! shell completions and shown repeatable in the man page); and, with a real relay and daemons,
//! that doctor reads the enrolment and enc-key ad the client wrote (spec gap G13).

use std::path::Path;

use serde_json::Value;

use crate::helper::mesh::Mesh;
use crate::helper::{run, Daemon, Home, Output};

/// A 127.0.0.1 port nothing listens on.
fn closed_port() -> u16 {
    let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    l.local_addr().expect("addr").port()
}

/// `agentmbx doctor <args>` for `home`, with `HOME` (where the service unit would be) set to
/// `user_home` and the configured API port closed (a running daemon's `api.addr` wins).
fn doctor(home: &Home, user_home: &Path, args: &[&str]) -> Output {
    let mut full = vec!["doctor"];
    full.extend_from_slice(args);
    let mut cmd = home.command(&full);
    cmd.env("HOME", user_home)
        .env_remove("XDG_CONFIG_HOME")
        .env("MBX_API_PORT", closed_port().to_string());
    run(cmd)
}

fn status_of<'a>(report: &'a Value, id: &str) -> &'a str {
    report["checks"]
        .as_array()
        .expect("checks")
        .iter()
        .find(|c| c["id"] == id)
        .unwrap_or_else(|| panic!("no check {id} in {report}"))["status"]
        .as_str()
        .expect("status")
}

/// The JSON shape every report has.
fn assert_shape(report: &Value) {
    assert_eq!(report["schema"], 2);
    let checks = report["checks"].as_array().expect("checks");
    assert_eq!(checks.len(), 19);
    let mut counted = 0;
    for c in checks {
        assert!(c["id"].is_string() && c["title"].is_string() && c["summary"].is_string());
        assert!(c["details"].is_array());
        assert!(c["fix"].is_string() || c["fix"].is_null());
        let s = c["status"].as_str().expect("status");
        assert!(["ok", "warn", "fail", "skip", "error"].contains(&s), "{s}");
        assert_eq!(c["status"], s);
        counted += 1;
    }
    let sum: u64 = ["ok", "warn", "fail", "skip", "error"]
        .iter()
        .map(|k| report["summary"][k].as_u64().expect("count"))
        .sum();
    assert_eq!(sum, counted);
}

#[test]
fn doctor_on_fresh_and_running_homes() {
    let home = Home::new();
    let user = tempfile::tempdir().expect("temp dir");

    // Not initialized: host-identity fails, exit 1, nothing created.
    let out = doctor(&home, user.path(), &["--json"]);
    assert_eq!(out.code(), Some(1), "{out:#?}");
    let report = out.json();
    assert_shape(&report);
    assert_eq!(status_of(&report, "host-identity"), "fail");
    assert_eq!(status_of(&report, "config"), "skip");
    assert!(!home.path().exists());

    // Initialized, no daemon, no relay: only the daemon check fails (connection refused).
    home.run(&["init", "--host", "doc"]).assert_success();
    let out = doctor(&home, user.path(), &["--json"]);
    assert_eq!(out.code(), Some(1), "{out:#?}");
    let report = out.json();
    assert_shape(&report);
    assert_eq!(status_of(&report, "config"), "ok");
    assert_eq!(status_of(&report, "host-identity"), "ok");
    assert_eq!(status_of(&report, "keystore"), "ok");
    assert_eq!(status_of(&report, "daemon"), "fail");
    assert_eq!(status_of(&report, "peers"), "skip");
    // Only a running daemon hears of another daemon on this key or a peer's.
    assert_eq!(status_of(&report, "host-key-clone"), "skip");
    assert_eq!(status_of(&report, "peer-key-clone"), "skip");
    for id in [
        "relay-reachable",
        "relay-key",
        "relay-enrolled",
        "relay-stream",
        "enc-ad",
        "clock-skew",
    ] {
        assert_eq!(status_of(&report, id), "skip", "{id}");
    }
    // No user service installed: not a failure (skip without a service manager).
    assert!(
        ["skip", "warn"].contains(&status_of(&report, "service")),
        "{report}"
    );
    assert_ne!(status_of(&report, "disk-space"), "error");
    assert_eq!(report["summary"]["fail"], 1);

    // A running daemon answers as this host and version.
    let daemon = Daemon::start(&home);
    let token = home.token();
    let out = doctor(&home, user.path(), &["--json"]);
    assert_eq!(out.code(), Some(0), "{out:#?}");
    let report = out.json();
    assert_eq!(status_of(&report, "daemon"), "ok", "{report}");
    assert_eq!(
        status_of(&report, "host-key-clone"),
        "skip",
        "no relay: {report}"
    );
    assert_eq!(status_of(&report, "peer-key-clone"), "ok", "{report}");
    assert_eq!(status_of(&report, "outbox"), "ok");
    assert_eq!(status_of(&report, "quarantine"), "ok");
    assert!(!out.stdout.contains(&token), "the API token never appears");
    // No user service while the daemon runs (in the foreground): information, not a warning.
    assert_ne!(status_of(&report, "service"), "warn", "{report}");

    // A unit file with the daemon running: installed and running.
    let unit = user.path().join(".config/systemd/user/agentmbx.service");
    std::fs::create_dir_all(unit.parent().expect("dir")).expect("mkdir");
    std::fs::write(&unit, "[Unit]\n").expect("unit");
    let out = doctor(&home, user.path(), &["service", "daemon", "--json"]);
    let report = out.json();
    assert_eq!(report["checks"].as_array().expect("checks").len(), 2);
    if cfg!(target_os = "linux") {
        assert_eq!(status_of(&report, "service"), "ok", "{report}");
    }
    drop(daemon.kill());

    // Text form: a mark per line and the fix lines; the stopped daemon fails.
    let out = doctor(&home, user.path(), &["daemon"]);
    assert_eq!(out.code(), Some(1));
    // It names the address it tried, where it came from and the home, and suggests the
    // foreground daemon as well as the service.
    let home_text = home.path().display().to_string();
    assert!(
        out.stdout.contains(&format!("for the home {home_text}"))
            && out.stdout.contains("api.addr")
            && out.stdout.contains("agentmbx daemon\n")
            && out.stdout.contains("agentmbx daemon install"),
        "{}",
        out.stdout
    );
    assert!(
        out.stdout
            .starts_with("✗ daemon answering on the local API: "),
        "{}",
        out.stdout
    );
    assert!(out.stdout.contains("\n    fix: "));
}

#[test]
fn unreachable_relay_fails_and_names_the_check() {
    let home = Home::new();
    let user = tempfile::tempdir().expect("temp dir");
    home.run(&["init", "--host", "doc"]).assert_success();
    let url = format!("http://127.0.0.1:{}", closed_port());
    let mut cmd = home.command(&["doctor", "--json", "relay-reachable", "clock-skew"]);
    cmd.env("HOME", user.path()).env("MBX_RELAY_URL", &url);
    let started = std::time::Instant::now();
    let out = run(cmd);
    assert!(started.elapsed() < std::time::Duration::from_secs(10));
    assert_eq!(out.code(), Some(1), "{out:#?}");
    let report = out.json();
    assert_eq!(status_of(&report, "relay-reachable"), "fail");
    assert_eq!(status_of(&report, "clock-skew"), "skip");
    assert_eq!(report["summary"]["fail"], 1);
    assert_eq!(
        report["checks"][0]["fix"], "agentmbx relay info --live",
        "{report}"
    );

    // Through a proxy: the check names it, without its credentials.
    let proxy = format!("http://agent:s3cret-pw@127.0.0.1:{}", closed_port());
    let mut cmd = home.command(&["doctor", "relay-reachable"]);
    cmd.env("HOME", user.path())
        .env("MBX_RELAY_URL", "http://relay.invalid")
        .env("HTTP_PROXY", &proxy)
        .env_remove("http_proxy")
        .env_remove("NO_PROXY")
        .env_remove("no_proxy");
    let out = run(cmd);
    assert_eq!(out.code(), Some(1), "{out:#?}");
    assert!(
        out.stdout
            .contains("tried through the proxy http://***@127.0.0.1:")
            && out.stdout.contains("(HTTP_PROXY)"),
        "{}",
        out.stdout
    );
    assert!(!out.stdout.contains("s3cret"), "{}", out.stdout);
}

#[test]
fn an_invalid_config_fails_doctor_and_names_the_fix() {
    let home = Home::new();
    let user = tempfile::tempdir().expect("temp dir");
    home.run(&["init", "--host", "doc"]).assert_success();
    let config = home.path().join("config.toml");
    let mut text = std::fs::read_to_string(&config).expect("config");
    text.push_str("bogus = 1\n");
    std::fs::write(&config, text).expect("write");
    let out = doctor(&home, user.path(), &["host-identity"]);
    assert_eq!(out.code(), Some(1), "{out:#?}");
    assert!(
        out.stdout
            .starts_with("✗ config.toml valid: config.toml is invalid\n"),
        "{}",
        out.stdout
    );
    assert!(out.stdout.contains("    fix: agentmbx config validate\n"));
    assert!(out
        .stdout
        .contains("· host initialized and host key: config.toml is invalid\n"));
    let out = doctor(&home, user.path(), &["--json", "daemon", "relay-key"]);
    assert_eq!(out.code(), Some(1), "{out:#?}");
    let report = out.json();
    assert_eq!(status_of(&report, "config"), "fail");
    assert_eq!(status_of(&report, "daemon"), "skip");
    assert_eq!(status_of(&report, "relay-key"), "skip");
}

#[test]
fn list_and_unknown_ids() {
    let home = Home::new();
    let out = home.run(&["doctor", "--list"]);
    out.assert_success();
    let ids: Vec<&str> = out
        .stdout
        .lines()
        .map(|l| l.split_whitespace().next().expect("id"))
        .collect();
    assert_eq!(
        ids,
        [
            "config",
            "host-identity",
            "keystore",
            "daemon",
            "host-key-clone",
            "peers",
            "peer-key-clone",
            "relay-reachable",
            "relay-key",
            "relay-enrolled",
            "relay-stream",
            "enc-ad",
            "clock-skew",
            "outbox",
            "quarantine",
            "unclaimed",
            "service",
            "mcp-setup",
            "disk-space"
        ]
    );
    let out = home.run(&["doctor", "--list", "relay-key", "config"]);
    out.assert_success();
    assert_eq!(out.stdout.lines().count(), 2, "{}", out.stdout);
    for args in [
        &["doctor", "no-such-check"][..],
        &["doctor", "--list", "nope"],
    ] {
        let out = home.run(args);
        assert_eq!(out.code(), Some(2), "{args:?}: {out:#?}");
        let bad = args.last().expect("id");
        assert!(
            out.stderr.contains(&format!("invalid value '{bad}'"))
                && out.stderr.contains("relay-enrolled"),
            "{}",
            out.stderr
        );
        assert!(out.stdout.is_empty());
    }

    // Completions offer the ids; the man page shows the id repeatable.
    let out = home.run(&["completions", "bash"]);
    out.assert_success();
    assert!(out.stdout.contains("relay-enrolled"), "{}", out.stdout);
    let dir = tempfile::tempdir().expect("temp dir");
    home.run(&["man", &dir.path().to_string_lossy()])
        .assert_success();
    let page = std::fs::read_to_string(dir.path().join("agentmbx-doctor.1")).expect("page");
    assert!(page.contains("[\\fICHECK\\fR]... \n"), "{page}");
}

#[test]
fn doctor_reads_what_the_relay_client_wrote() {
    let mut mesh = Mesh::start(None);
    let user = tempfile::tempdir().expect("temp dir");
    let ids = [
        "daemon",
        "relay-reachable",
        "relay-key",
        "relay-enrolled",
        "enc-ad",
        "clock-skew",
        "outbox",
        "quarantine",
    ];
    let mut args = vec!["--json"];
    args.extend_from_slice(&ids);
    let out = doctor(&mesh.a.home, user.path(), &args);
    assert_eq!(out.code(), Some(0), "{out:#?}");
    let report = out.json();
    for id in ids {
        assert_eq!(status_of(&report, id), "ok", "{id}: {report}");
    }

    // The relay stops: reachable fails, the recorded pin and enrolment still read.
    mesh.relay.kill();
    let out = doctor(&mesh.a.home, user.path(), &args);
    assert_eq!(out.code(), Some(1), "{out:#?}");
    let report = out.json();
    assert_eq!(status_of(&report, "relay-reachable"), "fail");
    assert_eq!(status_of(&report, "relay-key"), "ok");
    assert_eq!(status_of(&report, "relay-enrolled"), "ok");
    assert_eq!(status_of(&report, "clock-skew"), "skip");
}
