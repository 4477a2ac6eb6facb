//! `config.toml` against the real binary: `agentmbx config validate` (exit 0 valid, 1 invalid
//! naming the key and line, 3 no file) and a running daemon that watches the file, applies the
//! live settings (log level, relay URL), logs what changed, refuses an invalid file without
//! dropping its running config, and applies a later valid file; `relay set` with another URL
//! switches a running daemon to it; a `[relay]` table added to a daemon started without one
//! turns the relay transport on, and removing it turns it off, both without a restart.

use crate::helper::mesh::{free_port, Host, Mesh, Relay};
use crate::helper::{wait_for, Daemon, Home};

/// Writes `config.toml` the way editors do: a temporary file renamed over the old one.
fn replace_config(home: &Home, text: &str) {
    let tmp = home.file("config.toml.tmp");
    std::fs::write(&tmp, text).expect("write temp config");
    std::fs::rename(&tmp, home.file("config.toml")).expect("rename config");
}

#[test]
fn config_validate_exit_codes_and_messages() {
    let home = Home::new();
    let missing = home.run(&["config", "validate"]);
    assert_eq!(missing.code(), Some(3), "{missing:?}");
    assert!(missing.stderr.contains("defaults apply"), "{missing:?}");

    home.write_config(
        "host = \"alpha\"\nrelay_pull_interval_ms = 100\n[relay]\nurl = \"http://127.0.0.1:9\"\n\
         token_command = \"print-token --secret hunter2\"\n",
    );
    let ok = home.run(&["config", "validate"]);
    ok.assert_success();
    // The verdict comes first (notes on environment overrides may follow).
    assert_eq!(ok.stdout.lines().next(), Some("config.toml is valid"));
    let json = home.run(&["config", "validate", "--json"]);
    json.assert_success();
    let v = json.json();
    assert_eq!(v["valid"], true);
    assert_eq!(v["config"]["relay_pull_interval_ms"], 100, "{v}");
    assert_eq!(v["config"]["relay"]["token_command"], "<redacted>", "{v}");
    assert!(!json.stdout.contains("hunter2"));

    for (text, code, needle) in [
        ("relay_pull_interval_ms = 3600000\n", 0, "is valid"),
        ("relay_pull_interval_ms = 99\n", 1, "relay_pull_interval_ms"),
        (
            "relay_pull_interval_ms = 3600001\n",
            1,
            "relay_pull_interval_ms",
        ),
        ("api_port = 1\nbogus = 3\n", 1, "line 2"),
        ("api_port = 1\nbogus = 3\n", 1, "unknown key `bogus`"),
        ("api_port = \"x\"\n", 1, "line 1"),
        ("api_port = 70000\n", 1, "line 1"),
        ("log_level = \"debug\"\n", 0, "is valid"),
        ("log_level = \"not a [filter\"\n", 1, "log_level"),
        ("[relay]\nurl = \"ftp://r\"\n", 1, "relay.url"),
    ] {
        let file = home.file("other.toml");
        std::fs::write(&file, text).expect("write");
        let out = home.run(&[
            "config",
            "validate",
            "--file",
            file.to_str().expect("UTF-8"),
        ]);
        assert_eq!(out.code(), Some(code), "{text:?}: {out:?}");
        let said = format!("{}{}", out.stdout, out.stderr);
        assert!(said.contains(needle), "{text:?}: {out:?}");
        if code == 0 {
            assert_eq!(out.stdout.lines().next(), Some("other.toml is valid"));
        }
    }
}

#[test]
fn the_daemon_applies_a_changed_config_and_keeps_its_config_on_a_bad_file() {
    let relay = Relay::start(None);
    let home = Home::new();
    let dead = format!("http://127.0.0.1:{}", free_port());
    let base = "host = \"cfgwatch\"\nkey_store = \"file\"\n";
    home.write_config(&format!("{base}[relay]\nurl = \"{dead}\"\n"));
    let mut cmd = home.command(&["daemon", "--api-port", "0"]);
    // log_level applies only when MBX_LOG is unset.
    cmd.env_remove("MBX_LOG");
    let mut daemon = Daemon::try_start(cmd).expect("daemon started");
    daemon.wait_for_stderr("watching the config file");

    // A valid change: log level, relay URL (live) and the advertised address (restart).
    let live = relay.url();
    replace_config(
        &home,
        &format!(
            "{base}log_level = \"debug\"\nadvertise = \"elsewhere.local:1\"\n[relay]\nurl = \"{live}\"\n"
        ),
    );
    daemon.wait_for_stderr("config changed: log_level (unset) -> debug");
    daemon.wait_for_stderr(&format!("config changed: relay.url {dead} -> {live}"));
    daemon
        .wait_for_stderr("config changed: advertise (unset) -> elsewhere.local:1 (needs a restart");
    daemon.wait_for_stderr("relay loop restarted with the new config");
    daemon.wait_for_stderr("relay transport on");
    daemon.wait_for_stderr("enrolled with the relay");
    let log = daemon.stderr();
    assert!(log.contains(&format!("relay={live}")), "{log}");
    assert!(
        !log.contains("config file event"),
        "no debug line before the level changed:\n{log}"
    );

    // Debug lines now appear: the next write is logged at debug.
    let good = format!("{base}log_level = \"debug\"\n[relay]\nurl = \"{live}\"\n");
    std::fs::write(home.file("config.toml"), &good).expect("write");
    daemon.wait_for_stderr("config file event");

    // An invalid file is refused with one error line; the daemon keeps running its config.
    std::fs::write(
        home.file("config.toml"),
        format!("{base}log_level = \"warn\"\nbogus = 1\n"),
    )
    .expect("write");
    daemon.wait_for_stderr("config.toml refused, the running config is kept");
    let log = daemon.stderr();
    assert!(log.contains("unknown key `bogus`"), "{log}");
    assert!(!log.contains("log_level debug -> warn"), "{log}");
    let health = daemon.get("/v1/health", None);
    assert_eq!(health.status, 200, "the daemon still answers: {health:?}");

    // A later valid file is applied (and the relay loop is not restarted: its table is the same).
    let restarts = log.matches("relay loop restarted").count();
    replace_config(
        &home,
        &format!("{base}log_level = \"info\"\n[relay]\nurl = \"{live}\"\n"),
    );
    daemon.wait_for_stderr("config changed: log_level debug -> info");
    let log = daemon.stderr();
    assert_eq!(
        log.matches("relay loop restarted").count(),
        restarts,
        "{log}"
    );
    assert_eq!(
        log.matches("config.toml refused").count(),
        1,
        "one error line: {log}"
    );
    let (status, _) = daemon.terminate();
    assert!(status.success(), "{status:?}");
}

#[test]
fn relay_set_with_another_url_switches_a_running_daemon_without_a_restart() {
    let first = Relay::start(None);
    let second = Relay::start(None);
    let mut host = Host::init("cfgrelay");
    host.home
        .run(&["relay", "set", &first.url()])
        .assert_success();
    host.start(None);
    host.daemon()
        .wait_for_stderr(&format!("enrolled with the relay relay={}", first.url()));

    let out = host.home.run(&["relay", "set", &second.url(), "--json"]);
    out.assert_success();
    assert_eq!(out.json()["restart_needed"], false, "{out:#?}");
    let daemon = host.daemon();
    daemon.wait_for_stderr(&format!(
        "config changed: relay.url {} -> {}",
        first.url(),
        second.url()
    ));
    daemon.wait_for_stderr("relay loop restarted with the new config");
    daemon.wait_for_stderr(&format!("enrolled with the relay relay={}", second.url()));
}

/// The index of the `n`th (from 1) occurrence of `needle` in `log`.
fn nth_index(log: &str, needle: &str, n: usize) -> Option<usize> {
    log.match_indices(needle).nth(n - 1).map(|(i, _)| i)
}

#[test]
fn a_relay_added_to_or_removed_from_config_toml_applies_without_a_restart() {
    let mut mesh = Mesh::configured(None);
    let url = mesh.relay.url();
    // A's config.toml as `relay set` wrote it (`[relay] url, key`), and without that table.
    let with_relay = std::fs::read_to_string(mesh.a.home.file("config.toml")).expect("read");
    let at = with_relay
        .find("[relay]")
        .expect("relay set wrote a [relay] table");
    assert!(
        !with_relay[at + 1..].contains("\n["),
        "[relay] is the last table: {with_relay}"
    );
    let without_relay = with_relay[..at].to_string();
    assert!(with_relay[at..].contains("key = "), "{with_relay}");
    replace_config(&mesh.a.home, &without_relay);

    mesh.b.start(None);
    mesh.b.daemon().wait_for_stderr("published the enc-key ad");
    mesh.a.start(None);
    let a = mesh.a.daemon();
    a.wait_for_stderr("watching the config file");
    a.wait_for_stderr("no relay configured");

    // Added: the change is logged as applied, the loop starts, and A enrols with the relay.
    replace_config(&mesh.a.home, &with_relay);
    let a = mesh.a.daemon();
    a.wait_for_stderr(&format!("config changed: relay (unset) -> {url}"));
    a.wait_for_stderr("relay configured: relay loop started");
    a.wait_for_stderr(&format!("enrolled with the relay relay={url}"));
    let enrolled: i64 = mesh
        .relay
        .db()
        .query_row(
            "SELECT COUNT(*) FROM enrolments WHERE host_pubkey = ?1 AND revoked_at IS NULL",
            [&mesh.a.pubkey],
            |r| r.get(0),
        )
        .expect("query enrolments");
    assert_eq!(enrolled, 1, "the relay has A enrolled");
    // The relay carries mail: B has no LAN address here, so only the relay can take it.
    let first = mesh.a.send("alice", "bob@hostb", "via the relay", "one");
    let first = first["id"].as_str().expect("id").to_string();
    mesh.a.wait_relay_accepted(&first);
    wait_for("the first message in bob's inbox", || {
        mesh.b.inbox_ids("bob").contains(&first).then_some(())
    });

    // Removed: logged as applied, and the loop is stopped (the line follows its end).
    replace_config(&mesh.a.home, &without_relay);
    let a = mesh.a.daemon();
    a.wait_for_stderr(&format!("config changed: relay {url} -> (unset)"));
    a.wait_for_stderr("relay removed from the config: relay loop stopped");
    let log = a.stderr();
    assert!(!log.contains("needs a restart"), "{log}");
    // Mail now waits: no transport takes it (B has no LAN address and there is no relay)...
    let second = mesh.a.send("alice", "bob@hostb", "held", "two");
    let second = second["id"].as_str().expect("id").to_string();
    let row = mesh.a.outbox(&second).expect("outbox row");
    assert_eq!(row.state, "pending", "{row:?}");

    // ...until the relay is added again: a new loop pushes it, after it started.
    replace_config(&mesh.a.home, &with_relay);
    let added = format!("config changed: relay (unset) -> {url}");
    wait_for("the relay added again", || {
        (mesh.a.log().matches(&added).count() == 2).then_some(())
    });
    mesh.a.wait_relay_accepted(&second);
    let (log, line) = wait_for("the `relay accepted` line of the second message", || {
        let log = mesh.a.log();
        let line = log
            .lines()
            .find(|l| l.contains("relay accepted") && l.contains(&format!("id={second}")))?
            .to_string();
        Some((log, line))
    });
    let started =
        nth_index(&log, "relay configured: relay loop started", 2).expect("a second loop started");
    let stopped = nth_index(&log, "relay removed from the config", 1).expect("stopped");
    let pushed = log.find(&line).expect("the line is in the log");
    assert!(
        stopped < started && started < pushed,
        "pushed only by the new loop:\n{log}"
    );
    wait_for("the second message in bob's inbox", || {
        mesh.b.inbox_ids("bob").contains(&second).then_some(())
    });
    mesh.a.stop();
}
