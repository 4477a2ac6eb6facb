//! Black-box tests of the `agentmbx` binary: `init`, `whoami`, and the daemon's start-up,
//! local API and shutdown, each in its own temporary home (see `helper`).

use crate::helper;

use std::net::TcpListener;

use crate::helper::{Daemon, Home};
use agentmbx_protocol::keys::{KeyFile, PublicKey};
use sha2::{Digest, Sha256};

fn key_file(home: &Home, name: &str) -> KeyFile {
    let text = std::fs::read_to_string(home.file(name)).expect("read key file");
    KeyFile::parse(&text).expect("key file parses")
}

/// `fingerprint(pub)` computed here from its definition (`wire.md` §2.1), not by the library.
fn expected_fingerprint(public_b64: &str) -> String {
    let raw = PublicKey::from_b64(public_b64)
        .expect("public key")
        .as_bytes()
        .to_vec();
    let hex: String = Sha256::digest(&raw)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    format!(
        "{}-{}-{}-{}",
        &hex[0..4],
        &hex[4..8],
        &hex[8..12],
        &hex[12..16]
    )
}

#[test]
fn init_creates_private_key_files_and_refuses_a_second_init() {
    let home = Home::new();
    let out = home.run(&["init", "--host", "alpha", "--json"]);
    out.assert_success();
    let json = out.json();
    assert_eq!(json["host"], "alpha");

    // The store holds plaintext bodies and pairing-token keys: owner-only like the keys.
    for name in ["host.key", "enc.key", "mailbox.db"] {
        assert!(home.file(name).is_file(), "{name} missing");
        #[cfg(unix)]
        assert_eq!(helper::mode(&home.file(name)), 0o600, "{name} mode");
    }
    assert_eq!(json["host_pubkey"], key_file(&home, "host.key").public_key);
    assert_eq!(json["enc_pub"], key_file(&home, "enc.key").public_key);
    assert!(
        home.file("mailbox.db").is_file(),
        "init creates the host store"
    );

    let before = std::fs::read(home.file("host.key")).expect("read host.key");
    let again = home.run(&["init", "--host", "other"]);
    assert_eq!(again.code(), Some(1), "{again:#?}");
    assert!(again.stderr.starts_with("agentmbx: "), "{again:#?}");
    assert!(again.stderr.contains("already initialized"), "{again:#?}");
    assert_eq!(
        std::fs::read(home.file("host.key")).expect("read host.key"),
        before
    );
    let config = std::fs::read_to_string(home.file("config.toml")).expect("config.toml");
    assert!(config.contains("host = \"alpha\""), "{config}");
}

#[test]
fn whoami_json_matches_the_key_file() {
    let home = Home::new();
    home.run(&["init", "--host", "beta"]).assert_success();
    let out = home.run(&["whoami", "--json"]);
    out.assert_success();
    let json = out.json();
    let public = key_file(&home, "host.key").public_key;
    assert_eq!(json["host"], "beta");
    assert_eq!(json["host_pubkey"], public.as_str());
    assert_eq!(json["fingerprint"], expected_fingerprint(&public).as_str());
}

#[test]
fn whoami_before_init_exits_not_found() {
    let home = Home::new();
    let out = home.run(&["whoami"]);
    assert_eq!(out.code(), Some(3), "{out:#?}");
    assert!(
        out.stderr
            .starts_with("agentmbx: this host is not initialized"),
        "{out:#?}"
    );
}

#[test]
fn bad_host_name_is_a_usage_error() {
    let home = Home::new();
    let out = home.run(&["init", "--host", "Not_Valid"]);
    assert_eq!(out.code(), Some(2), "{out:#?}");
    let line = out.stderr.lines().next().unwrap_or_default();
    assert!(
        line.starts_with("agentmbx: ") && line.contains("Not_Valid"),
        "{out:#?}"
    );
    assert!(line.ends_with("(see: agentmbx init --help)"), "{out:#?}");
    assert!(!home.file("host.key").exists());
}

#[test]
fn daemon_on_an_empty_home_initializes_and_answers_health() {
    let home = Home::new();
    let daemon = Daemon::start(&home);
    assert!(daemon.addr.ip().is_loopback());
    assert_eq!(
        daemon.stderr().matches(helper::LISTENING).count(),
        1,
        "{}",
        daemon.stderr()
    );

    let health = daemon.get("/v1/health", None);
    assert_eq!(health.status, 200, "{health:#?}");
    let json = health.json();
    assert_eq!(json["status"], "ok");
    assert_eq!(json["version"], env!("CARGO_PKG_VERSION"));

    for name in ["host.key", "enc.key", "api.token"] {
        assert!(home.file(name).is_file(), "{name} missing");
        #[cfg(unix)]
        assert_eq!(helper::mode(&home.file(name)), 0o600, "{name} mode");
    }
    let who = home.run(&["whoami", "--json"]);
    who.assert_success();
    assert_eq!(json["host"], who.json()["host"]);
}

#[test]
fn api_requires_the_bearer_token() {
    let home = Home::new();
    let daemon = Daemon::start(&home);
    let token = home.token();
    assert_eq!(
        token.len(),
        43,
        "32 random bytes, base64url without padding"
    );

    for bearer in [None, Some("wrong-token"), Some(&token[..42])] {
        let r = daemon.get("/v1/inbox", bearer);
        assert_eq!(r.status, 401, "{bearer:?}: {r:#?}");
        assert_eq!(
            r.json(),
            serde_json::json!({"error": "missing or bad bearer token", "code": "UNAUTHORIZED"})
        );
        assert_eq!(r.header("www-authenticate"), Some("Bearer"));
    }
    let r = daemon.get("/v1/no-such-route", Some(&token));
    assert_eq!(r.status, 404, "{r:#?}");
    assert_eq!(
        r.json(),
        serde_json::json!({"error": "not found", "code": "NOT_FOUND"})
    );
    assert_eq!(daemon.get("/v1/health", Some(&token)).status, 200);
    assert!(
        !daemon.stderr().contains(&token),
        "the token must never be logged"
    );
}

#[test]
fn unknown_config_key_stops_the_daemon() {
    let home = Home::new();
    home.write_config("api_port = 0\nbogus_key = 1\n");
    let exited = Daemon::try_start(home.command(&["daemon", "--api-port", "0"]))
        .err()
        .expect("the daemon must refuse to start");
    assert_eq!(exited.status.code(), Some(1), "{exited:#?}");
    assert!(
        exited.stderr.contains("agentmbx: ") && exited.stderr.contains("bogus_key"),
        "{exited:#?}"
    );
    assert!(
        !home.file("host.key").exists(),
        "nothing is created from a refused config"
    );
}

#[test]
fn environment_overrides_the_config_file() {
    let home = Home::new();
    let taken = TcpListener::bind("127.0.0.1:0").expect("bind");
    let port = taken.local_addr().expect("addr").port();
    home.write_config(&format!("api_port = {port}\n"));

    // The file's port is used when nothing overrides it: here it is taken, so start-up fails.
    let exited = Daemon::try_start(home.command(&["daemon"]))
        .err()
        .expect("port in use");
    // In our words, naming the settings that choose the address (issue 17, point 3).
    assert!(
        exited.stderr.contains(&format!(
            "cannot bind the local API on 127.0.0.1:{port}: address already in use (the \
             address is set by --api-bind and --api-port, MBX_API_BIND and MBX_API_PORT, or \
             api_bind and api_port in config.toml)"
        )),
        "{exited:#?}"
    );
    assert!(!exited.stderr.contains("os error"), "{exited:#?}");

    let mut cmd = home.command(&["daemon"]);
    cmd.env("MBX_API_PORT", "0");
    let daemon = Daemon::try_start(cmd).unwrap_or_else(|e| panic!("{e:#?}"));
    assert_ne!(daemon.addr.port(), port);
    assert_eq!(daemon.get("/v1/health", None).status, 200);
}

#[test]
fn sigterm_stops_the_daemon_cleanly() {
    let home = Home::new();
    let daemon = Daemon::start(&home);
    let addr = daemon.addr;
    let (status, stderr) = daemon.terminate();
    assert!(status.success(), "{status:?}\n{stderr}");
    assert!(stderr.contains("SIGTERM received"), "{stderr}");
    assert!(
        std::net::TcpStream::connect(addr).is_err(),
        "the port is released"
    );
}

#[test]
fn malformed_clock_offset_is_refused() {
    let home = Home::new();
    let mut cmd = home.command(&["daemon", "--api-port", "0"]);
    cmd.env("MBX_CLOCK_OFFSET_MS", "soon");
    let exited = Daemon::try_start(cmd)
        .err()
        .expect("the daemon must refuse to start");
    assert_eq!(exited.status.code(), Some(1));
    assert!(exited.stderr.contains("MBX_CLOCK_OFFSET_MS"), "{exited:#?}");
}

#[test]
fn relay_quarantine_lists_nothing_before_mail_and_an_empty_list_after() {
    let home = Home::new();
    // No mailbox yet: nothing to list (exit 3, not found).
    let out = home.run(&["relay", "quarantine"]);
    assert_eq!(out.code(), Some(3), "{out:#?}");
    home.run(&["init", "--host", "alpha"]).assert_success();
    home.run(&["peers"]).assert_success();
    let out = home.run(&["relay", "quarantine", "--json"]);
    out.assert_success();
    assert_eq!(out.json(), serde_json::json!([]));
    let out = home.run(&["relay", "quarantine", "--limit", "0"]);
    assert_eq!(out.code(), Some(2), "{out:#?}");
}

#[test]
fn a_second_daemon_on_the_same_home_is_refused() {
    let home = Home::new();
    let first = Daemon::start(&home);
    let exited = Daemon::try_start(home.command(&["daemon", "--api-port", "0"]))
        .err()
        .expect("the second daemon must refuse to start");
    assert_eq!(exited.status.code(), Some(1), "{exited:#?}");
    assert!(
        exited
            .stderr
            .contains("another agentmbx daemon is already running"),
        "{exited:#?}"
    );
    // The first one still answers.
    let health = first.get("/v1/health", None);
    assert_eq!(health.status, 200);
}

#[test]
fn send_errors_name_what_is_wrong_and_use_the_documented_exit_codes() {
    let home = Home::new();
    // A missing flag is named (usage, exit 2).
    let out = home.run(&["send", "--as", "alice", "--to", "bob", "-m", "x"]);
    assert_eq!(out.code(), Some(2), "{out:#?}");
    assert!(out.stderr.contains("--subject"), "{out:#?}");
    let _daemon = Daemon::start(&home);
    // An unknown host is "not found" (exit 3) and says how to pin it.
    let out = home.run(&[
        "send",
        "--as",
        "alice",
        "--to",
        "bob@nohost",
        "--subject",
        "s",
        "-m",
        "x",
    ]);
    assert_eq!(out.code(), Some(3), "{out:#?}");
    assert!(out.stderr.contains("agentmbx peers add nohost"), "{out:#?}");
    // A bad kind lists the kinds; a bad agent name explains the rule (usage, exit 2).
    let out = home.run(&[
        "send",
        "--as",
        "alice",
        "--to",
        "bob",
        "--subject",
        "s",
        "--kind",
        "nope",
        "-m",
        "x",
    ]);
    assert_eq!(out.code(), Some(2), "{out:#?}");
    assert!(out.stderr.contains("message, request, reply"), "{out:#?}");
    let out = home.run(&[
        "send",
        "--as",
        "Alice",
        "--to",
        "bob",
        "--subject",
        "s",
        "-m",
        "x",
    ]);
    assert_eq!(out.code(), Some(2), "{out:#?}");
    assert!(out.stderr.contains("2 to 40 characters"), "{out:#?}");
    // Pinning this host's own key as a peer is refused.
    let me = home.run(&["whoami", "--json"]).json();
    let key = me["host_pubkey"].as_str().expect("host_pubkey").to_string();
    let out = home.run(&["peers", "add", "other", &key]);
    assert_eq!(out.code(), Some(2), "{out:#?}");
    assert!(out.stderr.contains("own key"), "{out:#?}");
}

#[test]
fn a_store_in_an_open_home_directory_is_still_owner_only() {
    let home = Home::new();
    std::fs::create_dir_all(home.path()).expect("create home");
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(home.path(), std::fs::Permissions::from_mode(0o755))
            .expect("chmod home");
        // A store left world-readable by an older version is tightened on open.
        std::fs::write(home.file("mailbox.db"), b"").expect("create store");
        std::fs::set_permissions(
            home.file("mailbox.db"),
            std::fs::Permissions::from_mode(0o644),
        )
        .expect("chmod store");
    }
    home.run(&["init", "--host", "alpha"]).assert_success();
    #[cfg(unix)]
    assert_eq!(helper::mode(&home.file("mailbox.db")), 0o600);
}

#[test]
fn peers_commands_use_the_documented_exit_codes() {
    let home = Home::new();
    home.run(&["init", "--host", "alpha"]).assert_success();
    let out = home.run(&["peers", "remove", "nosuch"]);
    assert_eq!(out.code(), Some(3), "{out:#?}");
    assert!(out.stderr.contains("no peer named nosuch"), "{out:#?}");
    let out = home.run(&["peers", "remove", ""]);
    assert_eq!(out.code(), Some(2), "{out:#?}");
    let out = home.run(&["peers", "addr", "nosuch", "127.0.0.1:7373"]);
    assert_eq!(out.code(), Some(3), "{out:#?}");
    let out = home.run(&["peers", "addr", "nosuch", "no-port"]);
    assert_eq!(out.code(), Some(2), "{out:#?}");
    let key = agentmbx_protocol::keys::HostKey::generate()
        .public()
        .to_b64();
    let out = home.run(&["peers", "add", "beta", &key, "--json"]);
    out.assert_success();
    assert_eq!(out.json()["added"], true);
    assert_eq!(out.json()["host"], "beta");
}

#[test]
fn relay_set_refuses_malformed_urls_with_exit_2_and_never_echoes_control_characters() {
    let home = Home::new();
    assert!(home.run(&["init", "--host", "alpha"]).status.success());
    let config = || std::fs::read_to_string(home.file("config.toml")).expect("config.toml");
    let before = config();
    for (url, why) in [
        ("http://user:hunter2@127.0.0.1:9", "user name or password"),
        ("http://127.0.0.1:99999", "1..=65535"),
        ("http://127.0.0.1:0", "1..=65535"),
        (
            "http://127.0.0.1:9/\u{1b}]0;owned\u{7}",
            "control character",
        ),
        ("http://127.0.0.1:9/a\u{202e}b", "non-ASCII"),
        ("http://127.0.0.1:9/a b", "whitespace"),
        ("http://127.0.0.1:9/?q=1", "query"),
        ("http://127.0.0.1:9/#top", "fragment"),
        ("http://127.0.0.1:9/mbx/../other", "plain segments"),
        ("http://127.0.0.1:9/./mbx", "plain segments"),
        ("ftp://127.0.0.1:9", "http://"),
    ] {
        let out = home.run(&["relay", "set", url]);
        assert_eq!(out.code(), Some(2), "{url:?}: {out:#?}");
        assert!(out.stderr.contains(why), "{url:?}: {out:#?}");
        assert!(!out.stderr.contains("hunter2"), "{out:#?}");
        assert!(
            !out.stderr.contains('\u{1b}') && !out.stderr.contains('\u{202e}'),
            "escaped: {out:#?}"
        );
        assert_eq!(config(), before, "{url:?}: config.toml untouched");
    }
}

#[test]
fn the_daemon_refuses_a_malformed_relay_url_from_the_file_or_the_environment() {
    let home = Home::new();
    home.write_config("[relay]\nurl = \"http://owner:s3cret@127.0.0.1:9\"\n");
    let exited = Daemon::try_start(home.command(&["daemon", "--api-port", "0"]))
        .err()
        .expect("the daemon must refuse to start");
    assert_eq!(exited.status.code(), Some(1), "{exited:#?}");
    assert!(
        exited.stderr.contains("relay.url") && exited.stderr.contains("user name or password"),
        "{exited:#?}"
    );
    assert!(!exited.stderr.contains("s3cret"), "{exited:#?}");

    let home = Home::new();
    let mut cmd = home.command(&["daemon", "--api-port", "0"]);
    cmd.env("MBX_RELAY_URL", "http://127.0.0.1:99999");
    let exited = Daemon::try_start(cmd)
        .err()
        .expect("the daemon must refuse to start");
    assert!(
        exited.stderr.contains("relay.url") && exited.stderr.contains("1..=65535"),
        "{exited:#?}"
    );
}

#[test]
fn relay_info_before_init_says_to_run_init() {
    let home = Home::new();
    let out = home.run(&["relay", "info"]);
    assert_eq!(out.code(), Some(3), "{out:#?}");
    assert!(
        out.stderr
            .contains("this host is not initialized; run `agentmbx init`"),
        "{out:#?}"
    );
    // Also with a relay in config.toml but no identity.
    home.write_config("[relay]\nurl = \"http://127.0.0.1:9\"\n");
    let out = home.run(&["relay", "info", "--json"]);
    assert_eq!(out.code(), Some(3), "{out:#?}");
    assert!(out.stderr.contains("not initialized"), "{out:#?}");
}

#[test]
fn relay_set_before_init_says_to_run_init_and_creates_nothing() {
    let home = Home::new();
    for args in [
        &["relay", "set", "http://127.0.0.1:9"][..],
        &[
            "relay",
            "set",
            "http://127.0.0.1:9",
            "--key",
            "1a2b-3c4d-5e6f-7a8b",
        ][..],
    ] {
        let out = home.run(args);
        assert_eq!(out.code(), Some(3), "{args:?}: {out:#?}");
        assert!(
            out.stderr
                .contains("this host is not initialized; run `agentmbx init`"),
            "{out:#?}"
        );
        for f in ["config.toml", "mailbox.db"] {
            assert!(!home.file(f).exists(), "{args:?}: {f} was created");
        }
    }
    // A malformed argument is still a usage error first (exit 2), before anything is read.
    let out = home.run(&["relay", "set", "ftp://127.0.0.1:9"]);
    assert_eq!(out.code(), Some(2), "{out:#?}");
}

#[test]
fn relay_set_and_info_help_say_when_the_daemon_uses_a_change_and_what_the_exit_status_means() {
    let home = Home::new();
    let set = home.run(&["relay", "set", "--help"]);
    set.assert_success();
    let text = set.stdout.split_whitespace().collect::<Vec<_>>().join(" ");
    assert!(
        text.contains("from its next pass")
            && text.contains("a first relay starts its relay loop")
            && text.contains("agentmbx doctor relay-enrolled")
            && text.contains("restart_needed in --json is always false")
            && !text.contains("restart the daemon"),
        "{text}"
    );
    let info = home.run(&["relay", "info", "--help"]);
    info.assert_success();
    let text = info.stdout.split_whitespace().collect::<Vec<_>>().join(" ");
    assert!(
        text.contains("Exit status: 0 the relay state is ok; 1 any other state"),
        "{text}"
    );
    let deny = home.run(&["relay", "deny", "--help"]);
    let text = deny.stdout.split_whitespace().collect::<Vec<_>>().join(" ");
    assert!(
        text.contains("--admin-token-file, else from MBX_RELAY_ADMIN_TOKEN (the flag wins)")
            && text.contains("--insecure-http"),
        "{text}"
    );
}

#[test]
fn relay_info_exits_1_unless_the_state_is_ok_and_explains_a_deny_and_a_revocation() {
    use agentmbx::mailbox::Mailbox;
    use agentmbx::transport::relay_client::state::{self, RelayState, Standing};

    let home = Home::new();
    assert!(home.run(&["init", "--host", "alpha"]).status.success());
    let url = "http://127.0.0.1:9";
    let mut config = std::fs::read_to_string(home.file("config.toml")).expect("config.toml");
    config.push_str(&format!("\n[relay]\nurl = \"{url}\"\n"));
    std::fs::write(home.file("config.toml"), config).expect("write config.toml");
    // No pass recorded yet: not ok.
    let out = home.run(&["relay", "info", "--json"]);
    assert_eq!(out.code(), Some(1), "{out:#?}");
    assert_eq!(out.json()["state"], serde_json::Value::Null);
    assert!(
        out.stderr.contains("no relay pass recorded yet"),
        "{out:#?}"
    );
    let text = home.run(&["relay", "info"]);
    assert!(
        text.stdout
            .contains("enrolment: none cached (the daemon enrols on its next pass)"),
        "{text:#?}"
    );

    let record = |st: RelayState| {
        let mailbox = Mailbox::open(&home.file("mailbox.db")).expect("mailbox.db");
        mailbox
            .with(|c| {
                state::kv_delete(c, &state::state_kv(url))?;
                state::set_state(c, url, st, 1_767_225_600_000)?;
                Ok(())
            })
            .expect("record");
    };
    let mut ok = RelayState::new(Standing::Ok);
    ok.relay_fp = Some("1a2b-3c4d-5e6f-7a8b".into());
    record(ok);
    let out = home.run(&["relay", "info", "--json"]);
    out.assert_success();
    assert_eq!(out.json()["state"]["state"], "ok");
    home.run(&["relay", "info"]).assert_success();

    for (standing, name, fix, enrolment) in [
        (
            Standing::Denied,
            "denied",
            state::DENIED_FIX,
            "enrolment: none cached (the relay refuses this host; the daemon tries again at 2026-01-01T00:01:00.000Z)",
        ),
        (
            Standing::Revoked,
            "revoked",
            state::REVOKED_FIX,
            "enrolment: none cached (this host key is revoked on this relay for good)",
        ),
    ] {
        let mut st = RelayState::new(standing);
        st.status = Some(403);
        st.detail = Some(format!("{name} detail"));
        st.next_at = Some("2026-01-01T00:01:00.000Z".into());
        record(st);
        let out = home.run(&["relay", "info", "--json"]);
        assert_eq!(out.code(), Some(1), "{name}: {out:#?}");
        let info = out.json();
        assert_eq!(info["state"]["state"], name, "{info}");
        assert_eq!(info["fix"], fix, "{info}");
        assert!(out.stderr.contains(&format!("the relay state is {name}, not ok")), "{out:#?}");
        let text = home.run(&["relay", "info"]);
        assert_eq!(text.code(), Some(1), "{name}: {text:#?}");
        assert!(
            text.stdout.contains(&format!("state: {name} since ")),
            "{text:#?}"
        );
        assert!(text.stdout.contains(&format!("  fix: {fix}")), "{text:#?}");
        assert!(text.stdout.contains(enrolment), "{text:#?}");
        assert!(!text.stdout.contains("enrols on its next pass"), "{text:#?}");
    }
    assert!(state::REVOKED_FIX
        .contains("this host key can never use this relay again; ask its operator"));
}

/// Runs `agentmbx <args>` in `home` with stdout a pipe whose reading end is already closed.
fn with_closed_stdout(home: &Home, args: &[&str]) -> (std::process::ExitStatus, String) {
    let (reader, writer) = std::io::pipe().expect("pipe");
    drop(reader);
    let out = home
        .command(args)
        .stdout(writer)
        .stderr(std::process::Stdio::piped())
        .output()
        .expect("run agentmbx");
    (
        out.status,
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn a_closed_stdout_ends_a_command_quietly() {
    use std::os::unix::process::ExitStatusExt;
    let home = Home::new();
    assert!(home.run(&["init", "--host", "alpha"]).status.success());
    let mut config = std::fs::read_to_string(home.file("config.toml")).expect("config.toml");
    config.push_str("\n[relay]\nurl = \"http://127.0.0.1:9\"\n");
    std::fs::write(home.file("config.toml"), config).expect("write config.toml");
    for args in [
        &["relay", "info"][..],
        &["openapi"][..],
        &["whoami", "--json"][..],
    ] {
        let (status, stderr) = with_closed_stdout(&home, args);
        assert!(!stderr.contains("panicked"), "{args:?}: {stderr}");
        assert!(
            status.signal() == Some(libc::SIGPIPE) || status.success(),
            "{args:?}: ended by SIGPIPE like other tools: {status:?} {stderr}"
        );
        assert_ne!(status.code(), Some(101), "{args:?}: no panic exit");
    }
}

#[test]
fn relay_deny_and_revoke_refuse_unprintable_and_mistyped_arguments_before_anything_else() {
    let home = Home::new();
    let nowhere = home.path().join("no-store");
    let dir = nowhere.to_str().expect("UTF-8 path");
    for subject in ["cli\u{202e}gnp", "cli\u{1b}[2J", "cli\u{200b}42"] {
        let out = home.run(&["relay", "deny", subject, "--store-dir", dir]);
        assert_eq!(out.code(), Some(2), "{subject:?}: {out:#?}");
        assert!(out.stderr.contains("printable ASCII"), "{out:#?}");
        assert!(
            !out.stderr.contains('\u{202e}') && !out.stderr.contains('\u{1b}'),
            "{out:#?}"
        );
    }
    let out = home.run(&["relay", "deny", "abcd-ef01-2345-678", "--store-dir", dir]);
    assert_eq!(out.code(), Some(2), "{out:#?}");
    assert!(
        out.stderr.contains(
            "not a fingerprint (16 hex digits, such as 1a2b-3c4d-5e6f-7a8b); use --client"
        ),
        "{out:#?}"
    );
    // With --client it is a client_id: the store is looked for (none here: exit 3).
    let out = home.run(&[
        "relay",
        "deny",
        "abcd-ef01-2345-678",
        "--client",
        "--store-dir",
        dir,
    ]);
    assert_eq!(out.code(), Some(3), "{out:#?}");
    let long = format!("\u{1b}]0;{}", "k".repeat(1000));
    let out = home.run(&["relay", "revoke", &long, "--store-dir", dir]);
    assert_eq!(out.code(), Some(2), "{out:#?}");
    assert!(!out.stderr.contains('\u{1b}'), "{out:#?}");
    assert!(out.stderr.contains("\\u{1b}]0;kkk"), "{out:#?}");
    assert!(
        out.stderr.len() < 300,
        "at most 64 characters echoed: {out:#?}"
    );
}

#[test]
fn relay_info_keeps_showing_a_key_change_after_the_pinned_key_is_back_until_the_owner_confirms() {
    use agentmbx::mailbox::{relay_state, Mailbox};
    use agentmbx::transport::relay_client::state::{self, RelayState, Standing};
    use agentmbx_protocol::keys::HostKey;

    let home = Home::new();
    assert!(home.run(&["init", "--host", "alpha"]).status.success());
    let (pinned, served) = (HostKey::generate().public(), HostKey::generate().public());
    // Nothing listens on this port: `relay set --key` then pins from the argument alone.
    let port = TcpListener::bind("127.0.0.1:0")
        .expect("bind")
        .local_addr()
        .expect("addr")
        .port();
    let url = format!("http://127.0.0.1:{port}");
    let mut config = std::fs::read_to_string(home.file("config.toml")).expect("config.toml");
    config.push_str(&format!(
        "\n[relay]\nurl = \"{url}\"\nkey = \"{}\"\n",
        pinned.to_b64()
    ));
    std::fs::write(home.file("config.toml"), config).expect("write config.toml");
    // What the daemon records: the relay served another key, then the pinned one again.
    let mailbox = Mailbox::open(&home.file("mailbox.db")).expect("mailbox.db");
    mailbox
        .with(|c| {
            relay_state::kv_set(c, &state::key_kv(&url), &pinned.to_b64())?;
            state::record_key_mismatch(
                c,
                &url,
                "pinned",
                &pinned.fingerprint(),
                &served.fingerprint(),
                1_767_225_600_000,
            )?;
            let mut ok = RelayState::new(Standing::Ok);
            ok.relay_fp = Some(pinned.fingerprint());
            state::set_state(c, &url, ok, 1_767_225_660_000)?;
            Ok(())
        })
        .expect("record");
    drop(mailbox);

    let out = home.run(&["relay", "info", "--json"]);
    out.assert_success();
    let info = out.json();
    assert_eq!(info["state"]["state"], "ok", "{info}");
    let change = &info["key_change"];
    assert_eq!(change["served_fp"], served.fingerprint().as_str(), "{info}");
    assert_eq!(change["pinned_fp"], pinned.fingerprint().as_str(), "{info}");
    assert_eq!(change["at"], "2026-01-01T00:00:00.000Z", "{info}");
    assert_eq!(change["resumed"], true, "{info}");
    let keep = format!("agentmbx relay set {url} --key {}", pinned.fingerprint());
    assert_eq!(info["fix"], keep.as_str(), "{info}");
    let text = home.run(&["relay", "info"]);
    text.assert_success();
    assert!(
        text.stdout.contains(&format!(
            "key change: the relay served {} instead of the pinned key {}",
            served.fingerprint(),
            pinned.fingerprint()
        )) && text.stdout.contains(&format!("fix: {keep}")),
        "{text:#?}"
    );

    // The owner keeps the pinned key: the change is cleared (and audited).
    let out = home.run(&["relay", "set", &url, "--key", &pinned.fingerprint()]);
    out.assert_success();
    let info = home.run(&["relay", "info", "--json"]).json();
    assert_eq!(info["key_change"], serde_json::Value::Null, "{info}");
    assert_eq!(info["fix"], serde_json::Value::Null, "{info}");
    assert_eq!(
        info["pin"]["fingerprint"],
        pinned.fingerprint().as_str(),
        "{info}"
    );
}

#[test]
fn init_keeps_its_header_first_and_validate_json_names_each_source() {
    let home = Home::new();
    home.run(&["init", "--host", "srcs"]).assert_success();
    let text = std::fs::read_to_string(home.file("config.toml")).expect("config.toml");
    assert!(text.starts_with("# agentmbx host configuration."), "{text}");
    assert!(text.contains("\nkey_store = \"file\"\n"), "{text}");

    let mut cmd = home.command(&["config", "validate", "--json"]);
    cmd.env("MBX_LOG", "debug").env("MBX_API_PORT", "7999");
    let out = helper::run(cmd);
    out.assert_success();
    let v = out.json();
    assert_eq!(v["config"]["log_level"], "debug", "{v}");
    assert_eq!(v["config"]["api_port"], 7999, "{v}");
    assert_eq!(v["sources"]["log_level"], "env MBX_LOG", "{v}");
    assert_eq!(v["sources"]["api_port"], "env MBX_API_PORT", "{v}");
    assert_eq!(v["sources"]["host"], "file", "{v}");
    assert_eq!(v["sources"]["advertise"], "default", "{v}");

    // Plain output: the verdict, then each override.
    let mut cmd = home.command(&["config", "validate"]);
    cmd.env("MBX_LOG", "debug");
    let out = helper::run(cmd);
    out.assert_success();
    assert_eq!(out.stdout.lines().next(), Some("config.toml is valid"));
    assert!(
        out.stdout
            .contains("log_level: MBX_LOG=\"debug\" in the environment overrides the file"),
        "{out:#?}"
    );
}

/// Runs every command at once and waits for all of them (polling, under `limit`); kills the
/// rest and panics when one is still running then.
fn run_all(cmds: Vec<std::process::Command>, limit: std::time::Duration) -> Vec<helper::Output> {
    use std::io::Read;
    use std::process::Stdio;
    let reader = |mut stream: Box<dyn Read + Send>| {
        std::thread::spawn(move || {
            let mut text = String::new();
            let _ = stream.read_to_string(&mut text);
            text
        })
    };
    let mut running: Vec<_> = cmds
        .into_iter()
        .map(|mut cmd| {
            let mut child = cmd
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .expect("spawn agentmbx");
            let out = reader(Box::new(child.stdout.take().expect("stdout")));
            let err = reader(Box::new(child.stderr.take().expect("stderr")));
            (child, out, err)
        })
        .collect();
    let deadline = std::time::Instant::now() + limit;
    let mut statuses = vec![None; running.len()];
    while statuses.iter().any(Option::is_none) {
        for (i, (child, _, _)) in running.iter_mut().enumerate() {
            if statuses[i].is_none() {
                statuses[i] = child.try_wait().expect("try_wait");
            }
        }
        if std::time::Instant::now() >= deadline {
            for (child, _, _) in &mut running {
                let _ = child.kill();
            }
            panic!("commands still running after {limit:?}: {statuses:?}");
        }
        std::thread::sleep(helper::POLL);
    }
    running
        .into_iter()
        .zip(statuses)
        .map(|((_, out, err), status)| helper::Output {
            status: status.expect("finished"),
            stdout: out.join().expect("stdout reader"),
            stderr: err.join().expect("stderr reader"),
        })
        .collect()
}

/// How many messages in bob's inbox (acked ones too) have `subject`.
fn stored_with_subject(home: &Home, subject: &str) -> usize {
    let page = home
        .run(&["inbox", "--as", "bob", "--all", "--limit", "200", "--json"])
        .assert_success()
        .json();
    page["messages"]
        .as_array()
        .expect("messages")
        .iter()
        .filter(|m| m["subject"] == subject)
        .count()
}

/// The key a send that exited 75 printed after `--idempotency-key `.
fn printed_key(out: &helper::Output) -> String {
    let (_, rest) = out
        .stderr
        .split_once("--idempotency-key ")
        .unwrap_or_else(|| panic!("no key printed: {out:#?}"));
    rest.chars()
        .take_while(|c| c.is_ascii_alphanumeric() || *c == '-' || *c == '_')
        .collect()
}

/// Holds the mailbox write lock (`BEGIN IMMEDIATE`) from this process until dropped, as
/// another program (a backup, a `sqlite3` shell) may.
struct StoreLock(rusqlite::Connection);

impl StoreLock {
    fn take(home: &Home) -> StoreLock {
        let db = rusqlite::Connection::open(home.file("mailbox.db")).expect("open mailbox.db");
        db.execute_batch("BEGIN IMMEDIATE")
            .expect("take the write lock");
        StoreLock(db)
    }

    fn release(self) {
        self.0
            .execute_batch("ROLLBACK")
            .expect("release the write lock");
    }
}

fn send_args<'a>(subject: &'a str, extra: &[&'a str]) -> Vec<&'a str> {
    let mut args = vec![
        "send",
        "--as",
        "alice",
        "--to",
        "bob",
        "--subject",
        subject,
        "-m",
        "x",
    ];
    args.extend_from_slice(extra);
    args
}

/// Case `cli-reports-failure-after-commit`: while another process holds the store's write lock
/// for 33 s, ten concurrent sends neither report a failure for a message the daemon stored nor
/// store one twice: each exits 0 with its message stored once, or 75 with a key whose rerun
/// stores it once.
#[test]
fn concurrent_sends_while_another_process_holds_the_store_lock_store_each_message_once() {
    let home = Home::new();
    let _daemon = Daemon::start(&home);
    register(&home, &_daemon, "bob");
    home.run(&send_args("warm-up", &[])).assert_success();

    let lock = StoreLock::take(&home);
    let subjects: Vec<String> = (0..10).map(|n| format!("s{n}")).collect();
    let cmds = subjects
        .iter()
        .map(|s| home.command(&send_args(s, &[])))
        .collect();
    let holder = std::thread::spawn(move || {
        // The case's 33 s: longer than one HTTP attempt of the CLI (30 s).
        std::thread::sleep(std::time::Duration::from_secs(33));
        lock.release();
    });
    let outs = run_all(cmds, std::time::Duration::from_secs(150));
    holder.join().expect("lock holder");

    for (subject, out) in subjects.iter().zip(&outs) {
        match out.code() {
            Some(0) => {}
            Some(75) => {
                let key = printed_key(out);
                home.run(&send_args(subject, &["--idempotency-key", &key]))
                    .assert_success();
            }
            _ => panic!(
                "send {subject} failed ({} stored): {out:#?}",
                stored_with_subject(&home, subject)
            ),
        }
    }
    for subject in &subjects {
        assert_eq!(stored_with_subject(&home, subject), 1, "{subject}");
    }
}

/// When the daemon cannot confirm a send within the CLI's retry budget (shortened for the test
/// with `MBX_CLI_RETRY_MS`), the CLI exits 75, says the outcome is unknown, how to check it and
/// the key; the daemon logs that the request outlived its client; a rerun with the key stores
/// the message once, however often it runs, and the key with another message is refused.
#[test]
fn a_send_not_confirmed_in_time_exits_75_with_its_key_and_reruns_with_the_key_store_it_once() {
    let home = Home::new();
    let daemon = Daemon::start(&home);
    register(&home, &daemon, "bob");
    home.run(&send_args("warm-up", &[])).assert_success();

    let lock = StoreLock::take(&home);
    let mut cmd = home.command(&send_args("once", &[]));
    cmd.env("MBX_CLI_RETRY_MS", "2000");
    let out = helper::run(cmd);
    lock.release();
    assert_eq!(out.code(), Some(75), "{out:#?}");
    assert!(out.stderr.contains("outcome is unknown"), "{out:#?}");
    assert!(out.stderr.contains("agentmbx sent --as alice"), "{out:#?}");
    let key = printed_key(&out);
    assert!(key.len() >= 16, "{key:?}: {out:#?}");
    // The request the CLI gave up on is visible in the daemon's log, done or dropped.
    helper::wait_for("the log line about the abandoned request", || {
        let log = daemon.stderr();
        log.lines()
            .find(|l| {
                l.contains("WARN")
                    && l.contains("/v1/messages")
                    && (l.contains("after its client disconnected")
                        || l.contains("before it started"))
            })
            .map(str::to_string)
    });

    for _ in 0..2 {
        let again = home.run(&send_args("once", &["--idempotency-key", &key]));
        again.assert_success();
        assert_eq!(stored_with_subject(&home, "once"), 1, "{again:#?}");
    }
    // The key with another message is refused (exit 1) and stores nothing.
    let other = home.run(&send_args("other", &["--idempotency-key", &key]));
    assert_eq!(other.code(), Some(1), "{other:#?}");
    assert!(other.stderr.contains("Idempotency-Key"), "{other:#?}");
    assert_eq!(stored_with_subject(&home, "other"), 0);
}

/// A stand-in for the daemon's local API on 127.0.0.1: it answers each request with what
/// `answer` gives for the request's number (0, 1, …); `None` breaks the answer off after its
/// head (a 200 promising a body that never comes), as a daemon that may have committed the
/// request and then died would. Returns the address and a counter of requests.
fn fake_api(
    answer: impl Fn(usize) -> Option<String> + Send + 'static,
) -> (
    std::net::SocketAddr,
    std::sync::Arc<std::sync::atomic::AtomicUsize>,
) {
    use std::io::{Read, Write};
    use std::sync::atomic::{AtomicUsize, Ordering};
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = listener.local_addr().expect("addr");
    let count = std::sync::Arc::new(AtomicUsize::new(0));
    let seen = count.clone();
    std::thread::spawn(move || {
        for conn in listener.incoming() {
            let Ok(mut conn) = conn else { return };
            let mut head = Vec::new();
            let mut byte = [0u8; 1];
            while !head.ends_with(b"\r\n\r\n") && conn.read(&mut byte).is_ok_and(|n| n == 1) {
                head.push(byte[0]);
            }
            let n = seen.fetch_add(1, Ordering::SeqCst);
            let reply = match answer(n) {
                Some(body) => format!(
                    "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
                    body.len()
                ),
                None => "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 500\r\nconnection: close\r\n\r\n{\"id\"".to_string(),
            };
            let _ = conn.write_all(reply.as_bytes());
        }
    });
    (addr, count)
}

/// A home whose CLI talks to `addr` with a made-up token.
fn home_for_api(addr: std::net::SocketAddr) -> Home {
    let home = Home::new();
    std::fs::create_dir_all(home.path()).expect("create home");
    std::fs::write(home.file("api.token"), "test-token\n").expect("write api.token");
    std::fs::write(home.file("api.addr"), addr.to_string()).expect("write api.addr");
    home
}

/// `read` is a GET that marks the message read and queues a read receipt: an answer that
/// breaks off may follow that commit. The CLI retries it (a repeated read is safe) within
/// `MBX_CLI_RETRY_MS`: a later good answer is a success; none is exit 75 saying the outcome is
/// unknown and how to check, never exit 1.
#[test]
fn a_read_whose_answer_breaks_off_is_retried_then_exits_75_with_the_outcome_unknown() {
    use std::sync::atomic::Ordering;
    let read = ["read", "m-1", "--as", "bob"];

    let (addr, count) = fake_api(|_| None);
    let home = home_for_api(addr);
    let mut cmd = home.command(&read);
    cmd.env("MBX_CLI_RETRY_MS", "1500");
    let out = helper::run(cmd);
    assert_eq!(out.code(), Some(75), "{out:#?}");
    assert!(out.stderr.contains("outcome is unknown"), "{out:#?}");
    assert!(out.stderr.contains("marked read"), "{out:#?}");
    assert!(
        out.stderr.contains("agentmbx inbox --as bob --all"),
        "{out:#?}"
    );
    assert!(count.load(Ordering::SeqCst) >= 2, "{out:#?}");

    let message = serde_json::json!({"id": "m-1", "from": "alice", "to": ["bob"],
        "ts": "2026-01-01T00:00:00.000Z", "subject": "second try", "body": "hello"})
    .to_string();
    let (addr, _) = fake_api(move |n| (n > 0).then(|| message.clone()));
    let home = home_for_api(addr);
    let mut cmd = home.command(&read);
    cmd.env("MBX_CLI_RETRY_MS", "5000");
    let out = helper::run(cmd);
    out.assert_success();
    assert!(out.stdout.contains("subject: second try"), "{out:#?}");

    // A daemon that cannot be reached at all did nothing: exit 1 at once.
    let closed = TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = closed.local_addr().expect("addr");
    drop(closed);
    let out = home_for_api(addr).run(&read);
    assert_eq!(out.code(), Some(1), "{out:#?}");
    assert!(out.stderr.contains("does not answer"), "{out:#?}");
}

/// A rerun of a committed send with its `--idempotency-key` answers the first answer (the
/// same id) and stores nothing more; so does an ack.
#[test]
fn a_rerun_with_the_idempotency_key_of_a_committed_send_does_not_duplicate() {
    let home = Home::new();
    let _daemon = Daemon::start(&home);
    register(&home, &_daemon, "bob");
    let first = home
        .run(&send_args(
            "keyed",
            &["--idempotency-key", "script-run-42", "--json"],
        ))
        .assert_success()
        .json();
    let again = home
        .run(&send_args(
            "keyed",
            &["--idempotency-key", "script-run-42", "--json"],
        ))
        .assert_success()
        .json();
    assert_eq!(first["id"], again["id"]);
    assert_eq!(stored_with_subject(&home, "keyed"), 1);

    let id = first["id"].as_str().expect("id");
    for _ in 0..2 {
        let out = home.run(&["ack", id, "--as", "bob", "--idempotency-key", "ack-42"]);
        out.assert_success();
        assert_eq!(out.stdout.trim(), "acked 1", "{out:#?}");
    }
}

/// Case `ack-note-truncated-silently`: `ack --note` over the receipt's 500 UTF-16 units is
/// refused with the unit named and acks nothing; a note at the limit is taken.
#[test]
fn ack_refuses_a_note_over_500_utf16_units_and_takes_one_at_the_limit() {
    let home = Home::new();
    let _daemon = Daemon::start(&home);
    register(&home, &_daemon, "bob");
    let sent = home
        .run(&send_args("to ack", &["--json"]))
        .assert_success()
        .json();
    let id = sent["id"].as_str().expect("id");
    let over = "😀".repeat(251);
    let out = home.run(&["ack", id, "--as", "bob", "--note", &over]);
    assert_eq!(out.code(), Some(2), "{out:#?}");
    assert!(
        out.stderr
            .contains("note is 502 UTF-16 code units; the limit is 500"),
        "{out:#?}"
    );
    let page = home
        .run(&["inbox", "--as", "bob", "--json"])
        .assert_success()
        .json();
    assert_eq!(page["messages"][0]["id"], id, "{page}");
    assert_ne!(page["messages"][0]["state"], "acked", "{page}");

    let at = "😀".repeat(250);
    let out = home.run(&["ack", id, "--as", "bob", "--note", &at]);
    out.assert_success();
    assert_eq!(out.stdout.trim(), "acked 1", "{out:#?}");
}

/// Registers `name` as an agent of the daemon's host (`POST /v1/agents`).
fn register(home: &Home, daemon: &Daemon, name: &str) {
    let token = home.token();
    let resp = helper::request(
        daemon.addr,
        "POST",
        "/v1/agents",
        Some(&token),
        &[],
        Some(&format!(r#"{{"name":"{name}"}}"#)),
    );
    assert!(resp.status < 300, "{resp:?}");
}

#[test]
fn reply_and_send_reply_to_stay_in_the_thread_and_inbox_read_and_thread_show_it() {
    let home = Home::new();
    let daemon = Daemon::start(&home);
    for name in ["alice", "bob", "carol"] {
        register(&home, &daemon, name);
    }
    let first = home
        .run(&[
            "send",
            "--as",
            "alice",
            "--to",
            "bob",
            "--subject",
            "plan",
            "-m",
            "step one",
            "--needs-reply",
            "--json",
        ])
        .assert_success()
        .json();
    let first = first["id"].as_str().expect("id").to_string();

    // The inbox line and `read` show kind, needs-reply and thread; filters as 0.5.x.
    let inbox = home.run(&["inbox", "--as", "bob"]);
    inbox.assert_success();
    assert!(
        inbox.stdout.contains("kind:message needs-reply"),
        "{inbox:#?}"
    );
    let none = home.run(&["inbox", "--as", "bob", "--from", "carol", "--json"]);
    assert_eq!(
        none.assert_success().json()["messages"],
        serde_json::json!([])
    );
    let asks = home.run(&[
        "inbox",
        "--as",
        "bob",
        "--needs-reply",
        "--from",
        "alice",
        "--json",
    ]);
    assert_eq!(
        asks.assert_success().json()["messages"][0]["id"],
        first.as_str()
    );

    // `reply`: to the sender, same thread, `Re:`, kind reply.
    let out = home.run(&["reply", &first, "--as", "bob", "-m", "done", "--json"]);
    let reply = out.assert_success().json();
    assert_eq!(reply["thread"], first.as_str(), "{out:#?}");
    let reply_id = reply["id"].as_str().expect("id").to_string();
    let read = home.run(&["read", &reply_id, "--as", "alice"]);
    read.assert_success();
    for line in [
        "subject: Re: plan".to_string(),
        "kind: reply".into(),
        "needs-reply: no".into(),
        format!("thread: {first}"),
        format!("reply-to: {first}"),
    ] {
        assert!(read.stdout.lines().any(|l| l == line), "{line}: {read:#?}");
    }
    let inbox = home.run(&["inbox", "--as", "alice"]);
    assert!(
        inbox
            .stdout
            .contains(&format!("kind:reply thread:{first} re:{first}")),
        "{inbox:#?}"
    );

    // `send --reply-to` continues the thread too; `send --thread` sends into one.
    let out = home.run(&[
        "send",
        "--as",
        "alice",
        "--to",
        "bob",
        "--subject",
        "more",
        "-m",
        "x",
        "--reply-to",
        &reply_id,
        "--json",
    ]);
    assert_eq!(
        out.assert_success().json()["thread"],
        first.as_str(),
        "{out:#?}"
    );
    let out = home.run(&[
        "send",
        "--as",
        "alice",
        "--to",
        "bob",
        "--subject",
        "aside",
        "-m",
        "y",
        "--thread",
        &first,
        "--json",
    ]);
    assert_eq!(
        out.assert_success().json()["thread"],
        first.as_str(),
        "{out:#?}"
    );

    // `thread`: every message of it, oldest first, with bodies; paged with a cursor on stderr.
    let out = home.run(&["thread", &reply_id, "--as", "bob"]);
    out.assert_success();
    let order: Vec<usize> = ["step one", "done", "x", "y"]
        .iter()
        .map(|b| out.stdout.lines().position(|l| l == *b).expect(b))
        .collect();
    assert!(order.windows(2).all(|w| w[0] < w[1]), "{out:#?}");
    let out = home.run(&["thread", &first, "--as", "bob", "--limit", "1"]);
    assert!(out.stderr.contains("more: agentmbx thread"), "{out:#?}");

    // A parent the agent cannot see: not found (exit 3), nothing sent.
    for args in [
        vec![
            "reply",
            "01KDVDNA3VG2MH8KWSQRCWJZ0S",
            "--as",
            "bob",
            "-m",
            "x",
        ],
        vec!["reply", &first, "--as", "carol", "-m", "x"],
        vec![
            "send",
            "--as",
            "bob",
            "--to",
            "alice",
            "--subject",
            "s",
            "-m",
            "x",
            "--reply-to",
            "01KDVDNA3VG2MH8KWSQRCWJZ0S",
        ],
        vec!["thread", "01KDVDNA3VG2MH8KWSQRCWJZ0S", "--as", "bob"],
    ] {
        let out = home.run(&args);
        assert_eq!(out.code(), Some(3), "{args:?}: {out:#?}");
        assert!(out.stderr.contains("no message"), "{out:#?}");
    }
}

/// Issue 17 (8e): every mail command on a home that was never initialized is "not
/// initialized" (exit 3, saying to run `agentmbx init`), as `whoami` is, not a plain failure.
#[test]
fn mail_commands_on_an_uninitialized_home_exit_3_saying_to_run_init() {
    let home = Home::new();
    for args in [
        &[
            "send",
            "--as",
            "alice",
            "--to",
            "bob",
            "--subject",
            "s",
            "-m",
            "x",
        ][..],
        &["inbox", "--as", "alice"],
        &["sent", "--as", "alice"],
    ] {
        let out = home.run(args);
        assert_eq!(out.code(), Some(3), "{args:?}: {out:#?}");
        assert!(
            out.stderr
                .starts_with("agentmbx: this host is not initialized"),
            "{args:?}: {out:#?}"
        );
        assert!(out.stderr.contains("agentmbx init"), "{args:?}: {out:#?}");
    }
    assert!(!home.file("api.token").exists(), "nothing is created");
}

/// Issue 17 (8d): a token the daemon refuses (401) is named with the file it was read from and
/// the MBX_HOME the CLI used, so a user can see which home they are talking from.
#[test]
fn a_refused_api_token_names_the_token_file_and_the_home() {
    let home = Home::new();
    let _daemon = Daemon::start(&home);
    // The daemon keeps the token it started with; the file now says another one.
    std::fs::write(home.file("api.token"), format!("{}\n", "A".repeat(43))).expect("write");
    let out = home.run(&["inbox", "--as", "alice"]);
    assert_eq!(out.code(), Some(1), "{out:#?}");
    let token_file = home.file("api.token").display().to_string();
    let home_dir = home.path().display().to_string();
    assert!(out.stderr.contains(&token_file), "{out:#?}");
    assert!(
        out.stderr.contains(&format!("MBX_HOME {home_dir}")),
        "{out:#?}"
    );
    assert!(out.stderr.contains("401"), "{out:#?}");
}

/// Issue 17 (8f): in text mode the `more: …` continuation line of `inbox` and `sent` goes to
/// stderr, so stdout holds only the listing.
#[test]
fn the_more_line_of_inbox_and_sent_goes_to_stderr() {
    let page = r#"{"messages":[{"id":"m-1","state":"new","ts":"2026-01-01T00:00:00Z","from":"alice@h","subject":"s","recipients":[]}],"next_cursor":"c-2"}"#;
    let (addr, _) = fake_api(move |_| Some(page.to_string()));
    let home = home_for_api(addr);
    for what in ["inbox", "sent"] {
        let out = home.run(&[what, "--as", "bob", "--limit", "1"]);
        out.assert_success();
        assert!(out.stdout.contains("m-1"), "{what}: {out:#?}");
        assert!(!out.stdout.contains("more:"), "{what}: {out:#?}");
        assert!(
            out.stderr
                .contains(&format!("more: agentmbx {what} --as bob --cursor c-2")),
            "{what}: {out:#?}"
        );
    }
}

/// Issue 17 (8g): when the OS keyring does not answer and `init` falls back to 0600 files, it
/// says so on stderr (whatever MBX_LOG) and prints where the keys went.
#[test]
fn init_says_where_the_keys_went_when_it_falls_back_to_files() {
    let home = Home::new();
    let mut cmd = home.command(&["init", "--host", "fallback"]);
    cmd.env_remove("MBX_KEYSTORE")
        .env_remove("MBX_LOG")
        .env_remove("DBUS_SESSION_BUS_ADDRESS");
    let out = helper::run(cmd);
    out.assert_success();
    let home_dir = home.path().display().to_string();
    assert!(
        out.stdout
            .contains(&format!("keys: 0600 files in {home_dir}")),
        "{out:#?}"
    );
    assert!(out.stderr.contains("warning:"), "{out:#?}");
    assert!(out.stderr.contains("keyring is not available"), "{out:#?}");
    assert!(out.stderr.contains(&home_dir), "{out:#?}");
    assert!(out.stderr.contains("MBX_KEYSTORE=file"), "{out:#?}");
}

/// Issue 17 (8b): `send --to x@hots` where `hostb` is paired names `hostb` as what was meant
/// (exit 3), and does not advise pinning the typo.
#[test]
fn send_to_a_mistyped_host_suggests_the_paired_name() {
    let other = Home::new();
    other.run(&["init", "--host", "hostb"]).assert_success();
    let key = other.run(&["whoami", "--json"]).json()["host_pubkey"]
        .as_str()
        .expect("host_pubkey")
        .to_string();
    let home = Home::new();
    home.run(&["init", "--host", "hosta"]).assert_success();
    home.run(&["peers", "add", "hostb", &key]).assert_success();
    let _daemon = Daemon::start(&home);
    let out = home.run(&[
        "send",
        "--as",
        "alice",
        "--to",
        "bob@hots",
        "--subject",
        "s",
        "-m",
        "x",
    ]);
    assert_eq!(out.code(), Some(3), "{out:#?}");
    assert!(
        out.stderr
            .contains("unknown host hots; did you mean hostb?"),
        "{out:#?}"
    );
    assert!(!out.stderr.contains("peers add hots"), "{out:#?}");
}

/// Issue 17 (4): a bare `--to` name that is no agent here nor on a paired host (a typo) is
/// refused, not delivered (exit 3, naming the closest agent); `--new-mailbox` creates the
/// mailbox on purpose. `inbox`/`read --as` a name that is no agent here is "no agent named …"
/// (exit 3), not an empty list.
#[test]
fn a_mistyped_recipient_or_reader_is_refused_with_the_closest_agent() {
    let home = Home::new();
    let daemon = Daemon::start(&home);
    register(&home, &daemon, "bob");
    let typo = [
        "send",
        "--as",
        "alice",
        "--to",
        "bbo",
        "--subject",
        "s",
        "-m",
        "x",
    ];
    let out = home.run(&typo);
    assert_eq!(out.code(), Some(3), "{out:#?}");
    assert!(
        out.stderr.contains(
            "no agent named bbo here or on a paired host; did you mean bob? (--new-mailbox"
        ),
        "{out:#?}"
    );
    let db = rusqlite::Connection::open(home.file("mailbox.db")).expect("open mailbox.db");
    let stored = |table: &str| -> i64 {
        db.query_row(&format!("SELECT COUNT(*) FROM {table}"), [], |r| r.get(0))
            .expect("count")
    };
    assert_eq!(
        (stored("messages"), stored("deliveries")),
        (0, 0),
        "nothing stored"
    );
    for args in [&["inbox", "--as", "nobody"][..], &["inbox", "--as", "bbo"]] {
        let out = home.run(args);
        assert_eq!(out.code(), Some(3), "{args:?}: {out:#?}");
        assert!(out.stdout.is_empty(), "{args:?}: {out:#?}");
    }
    let out = home.run(&["inbox", "--as", "nobody"]);
    assert!(
        out.stderr.contains(
            "no agent named nobody on this host (`agentmbx whoami --as nobody` registers it)"
        ),
        "{out:#?}"
    );
    let out = home.run(&["inbox", "--as", "bbo"]);
    assert!(
        out.stderr
            .contains("no agent named bbo on this host; did you mean bob?"),
        "{out:#?}"
    );

    let mut on_purpose = typo.to_vec();
    on_purpose.extend(["--new-mailbox", "--json"]);
    let sent = home.run(&on_purpose).assert_success().json();
    let id = sent["id"].as_str().expect("id").to_string();
    assert_eq!(sent["recipients"][0]["route"], "local", "{sent}");
    let out = home.run(&["read", &id, "--as", "bbo"]);
    out.assert_success();
    assert!(out.stdout.lines().any(|l| l == "x"), "{out:#?}");
    let out = home.run(&["read", &id, "--as", "nobody"]);
    assert_eq!(out.code(), Some(3), "{out:#?}");
    assert!(out.stderr.contains("no agent named nobody"), "{out:#?}");
}

/// Issue 17 (8a): `join` aimed at the other host's local API port (not its LAN port) says so
/// and which port to use (usage, exit 2), instead of quoting the API's token refusal.
#[test]
fn join_aimed_at_the_local_api_port_says_to_use_the_lan_port() {
    let holder = Home::new();
    let daemon = Daemon::start(&holder);
    let home = Home::new();
    home.run(&["init", "--host", "joiner"]).assert_success();
    let api = daemon.addr.to_string();
    let out = home.run(&["join", &api, "ABCD-EFGH-JKMN"]);
    assert_eq!(out.code(), Some(2), "{out:#?}");
    assert!(
        out.stderr
            .contains(&format!("{api} is agentmbx's local API port")),
        "{out:#?}"
    );
    assert!(
        out.stderr
            .contains("pair with the LAN port (7373 by default"),
        "{out:#?}"
    );
    assert!(!out.stderr.contains("bearer token"), "{out:#?}");
}

/// Issue 17 (9): `sent` shows the relay's standing after the LAN error when both fail.
#[test]
fn sent_shows_the_relay_state_after_the_lan_error() {
    let page = r#"{"messages":[{"id":"m-1","ts":"2026-01-01T00:00:00Z","subject":"s","recipients":[{"recipient":"dan@work","host":"work","state":"queued","last_error":"cannot connect: refused","relay":"unreachable since 2026-01-01T00:00:00.000Z: cannot connect: timed out"}]}]}"#;
    let (addr, _) = fake_api(move |_| Some(page.to_string()));
    let home = home_for_api(addr);
    let out = home.run(&["sent", "--as", "alice"]);
    out.assert_success();
    assert!(
        out.stdout.contains(
            "  dan@work: queued (cannot connect: refused) (relay unreachable since \
             2026-01-01T00:00:00.000Z: cannot connect: timed out)"
        ),
        "{out:#?}"
    );
}

/// Issue 19 (3): `agentmbx search <words>... --as A` against a running daemon: ranked results
/// with a snippet, `--json`, pages by `--limit`/`--cursor`, FTS syntax read as plain words, and
/// the documented exit codes (a query with no word or a bound broken: 2; an unknown agent: 3).
#[test]
fn search_finds_an_agents_mail_and_uses_the_documented_exit_codes() {
    let home = Home::new();
    let _daemon = Daemon::start(&home);
    home.run(&["whoami", "--as", "bob"]).assert_success();
    let send = |subject: &str, body: &str| home.send_json(subject, body, &[]);
    let once = send("standup", "the zebra escaped once, see the zoo log");
    let twice = send("standup", "zebra zebra: the zoo log again");
    let _other = send("lunch", "nothing about animals");

    let out = home.run(&["search", "zebra", "--as", "bob", "--json"]);
    out.assert_success();
    let page = out.json();
    let ids: Vec<&str> = page["messages"]
        .as_array()
        .expect("messages")
        .iter()
        .map(|m| m["id"].as_str().expect("id"))
        .collect();
    assert_eq!(ids, vec![twice.as_str(), once.as_str()], "{page}");
    assert!(page["messages"][0].get("body").is_none(), "{page}");

    // Plain text: one line per result and its snippet; several words must all match.
    let out = home.run(&["search", "zoo", "ONCE", "--as", "bob"]);
    out.assert_success();
    assert!(out.stdout.contains(&once), "{out:#?}");
    assert!(!out.stdout.contains(&twice), "{out:#?}");
    assert!(out.stdout.contains("zebra escaped once"), "{out:#?}");
    // FTS syntax is plain words.
    let out = home.run(&["search", "\"zebra", "NEAR(zoo", "--as", "bob", "--json"]);
    out.assert_success();
    assert!(out.json()["messages"].as_array().expect("list").is_empty());
    let out = home.run(&["search", "zeb*", "--as", "bob", "--json"]);
    out.assert_success();
    assert_eq!(out.json()["messages"].as_array().expect("list").len(), 2);

    // Pages: --limit 1, then --cursor.
    let out = home.run(&["search", "zebra", "--as", "bob", "--limit", "1"]);
    out.assert_success();
    assert!(out.stdout.contains(&twice), "{out:#?}");
    assert!(out.stderr.contains("--cursor 1"), "{out:#?}");
    let out = home.run(&[
        "search", "zebra", "--as", "bob", "--limit", "1", "--cursor", "1", "--json",
    ]);
    out.assert_success();
    assert_eq!(out.json()["messages"][0]["id"], once.as_str());

    // Exit codes.
    let out = home.run(&["search", "()", "--as", "bob"]);
    assert_eq!(out.code(), Some(2), "{out:#?}");
    assert!(out.stderr.contains("no words"), "{out:#?}");
    let out = home.run(&["search", "z", "--as", "bob"]);
    assert_eq!(out.code(), Some(2), "{out:#?}");
    assert!(out.stderr.contains("2 to 200"), "{out:#?}");
    let out = home.run(&["search", "zebra", "--as", "bob", "--limit", "51"]);
    assert_eq!(out.code(), Some(2), "{out:#?}");
    let out = home.run(&["search", "zebra", "--as", "bbo"]);
    assert_eq!(out.code(), Some(3), "{out:#?}");
    assert!(out.stderr.contains("did you mean bob"), "{out:#?}");
    let out = home.run(&["search", "--as", "bob"]);
    assert_eq!(out.code(), Some(2), "{out:#?}");
}
