//! Relay trust end to end (spec §1, §8; `wire.md` §3.5), with real child processes: `agentmbx
//! relay serve` and `agentmbx daemon`s, and the `relay set` / `relay info` commands.
//!
//! - a relay key change behind the same URL stops all relay use on both hosts (no enrolment
//!   with the new relay, nothing pushed to it), is audited once, shows in `relay info` with
//!   the exact fix, and `relay set <url> --key <new>` resumes use without a daemon restart;
//! - `relay set`: trust on first use prints the fingerprint; a changed key is refused (exit 1,
//!   nothing changed) until confirmed with `--key`; a malformed fingerprint exits 2; an
//!   unreachable relay with `--key <fp>` stores the expectation and the daemon later pins only
//!   that key;
//! - a relay that lost every enrolment (store wiped, same relay key) gets this host enrolled
//!   again in the same pass and mail flows;
//! - a host whose clock is 10 minutes ahead is refused right after its enrolment: backoff and
//!   the `clock-skew` state, audited once;
//! - the sender allowlist is published and republished when peers change, and the relay
//!   refuses pushes from keys not on it;
//! - a host whose key the operator revoked is `revoked` (for good), a deny-listed one `denied`,
//!   each with its fix and no claim that the daemon enrols on its next pass, `relay info` exits
//!   1 for them, neither is logged as a lost enrolment, and mail to the revoked host shows
//!   `queued (<last error>)` in `agentmbx sent`;
//! - `relay set` says when a running daemon uses the result: from its next pass (the same
//!   relay) or when it re-reads the watched config.toml (a first or another relay URL), never
//!   after a restart, and how to check it.
//!
//! State is read from the stores (read-only) and through `relay info --json`.

use std::path::Path;

use serde_json::Value;

use crate::helper::mesh::{free_port, open_read_only, Host, Mesh, Relay};
use crate::helper::{command, poll, wait_for, Daemon, RELAY_LISTENING};

/// A relay process on `port` with its store in `dir` (optionally with `MBX_RELAY_KEY`), and its
/// fingerprint. A bind refused because the port is still held is retried.
fn spawn_relay(port: u16, dir: &Path, seed: Option<&str>) -> (Daemon, String) {
    let port_s = port.to_string();
    let proc = poll(|| {
        let mut cmd = command(&[
            "relay",
            "serve",
            "--bind",
            "127.0.0.1",
            "--port",
            &port_s,
            "--store-dir",
            dir.to_str().expect("UTF-8 path"),
        ]);
        if let Some(s) = seed {
            cmd.env("MBX_RELAY_KEY", s);
        }
        match Daemon::spawn(cmd, RELAY_LISTENING) {
            Ok(d) => Some(d),
            Err(e) if e.stderr.contains("cannot bind") => None,
            Err(e) => panic!("the relay exited at start-up: {e:#?}"),
        }
    })
    .unwrap_or_else(|| panic!("no relay could bind port {port}"));
    let log = proc.stderr();
    let fp = log
        .split("fingerprint=")
        .nth(1)
        .and_then(|r| r.split_whitespace().next())
        .unwrap_or_else(|| panic!("no relay fingerprint in the log:\n{log}"))
        .to_string();
    (proc, fp)
}

/// `relay info --json` of `host`; its exit status must be 0 exactly when the state is `ok`.
fn relay_info(host: &Host) -> Value {
    let out = host.home.run(&["relay", "info", "--json"]);
    let info = out.json();
    let want = if info["state"]["state"] == "ok" { 0 } else { 1 };
    assert_eq!(out.code(), Some(want), "{out:#?}");
    info
}

/// Audit rows named `event` in `host`'s mailbox.
fn audits(host: &Host, event: &str) -> Vec<Value> {
    let db = host.db();
    let mut st = db
        .prepare("SELECT detail FROM audit WHERE event = ?1 ORDER BY id")
        .expect("prepare");
    st.query_map([event], |r| r.get::<_, String>(0))
        .expect("query audit")
        .map(|d| serde_json::from_str(&d.expect("row")).expect("JSON detail"))
        .collect()
}

/// Waits until `host`'s relay state is `state`; returns `relay info --json`.
fn wait_state(host: &Host, state: &str) -> Value {
    wait_for(&format!("{}'s relay state {state}", host.name), || {
        let info = relay_info(host);
        (info["state"]["state"] == state).then_some(info)
    })
}

/// Enrolled host keys in a relay store.
fn enrolled_keys(store: &Path) -> Vec<String> {
    let db = open_read_only(&store.join("relay.db"));
    let mut st = db
        .prepare("SELECT host_pubkey FROM enrolments ORDER BY host_pubkey")
        .expect("prepare");
    st.query_map([], |r| r.get(0))
        .expect("query enrolments")
        .collect::<Result<_, _>>()
        .expect("rows")
}

/// Items queued in a relay store.
fn item_count(store: &Path) -> i64 {
    open_read_only(&store.join("relay.db"))
        .query_row("SELECT COUNT(*) FROM items", [], |r| r.get(0))
        .expect("count items")
}

/// Sends alice@hosta → bob@hostb; returns the id.
fn send_to_bob(mesh: &Mesh, subject: &str) -> String {
    mesh.a.send("alice", "bob@hostb", subject, "body")["id"]
        .as_str()
        .expect("id")
        .to_string()
}

/// Waits until `id` is in bob@hostb's inbox.
fn wait_inbox(mesh: &Mesh, id: &str) {
    wait_for(&format!("{id} in bob's inbox"), || {
        mesh.b
            .inbox_ids("bob")
            .iter()
            .any(|i| i == id)
            .then_some(())
    });
}

#[test]
fn a_relay_key_change_stops_relay_use_until_the_owner_confirms_the_new_key() {
    let mut mesh = Mesh::start(None);
    let url = mesh.relay.url();
    let first = send_to_bob(&mesh, "before the change");
    wait_inbox(&mesh, &first);
    for host in [&mesh.a, &mesh.b] {
        let info = wait_state(host, "ok");
        assert_eq!(
            info["pin"]["fingerprint"],
            mesh.relay.fingerprint.as_str(),
            "{info}"
        );
        assert_eq!(
            info["enrolment"]["relay_fp"],
            mesh.relay.fingerprint.as_str(),
            "{info}"
        );
    }

    // Another relay (another key) now answers at the same URL.
    mesh.relay.kill();
    let dir = tempfile::tempdir().expect("temp dir");
    let store = dir.path().join("store");
    let (_relay2, fp2) = spawn_relay(mesh.relay.port, &store, None);
    assert_ne!(fp2, mesh.relay.fingerprint);
    for host in [&mesh.a, &mesh.b] {
        let info = wait_state(host, "key-mismatch");
        let st = &info["state"];
        assert_eq!(st["pinned_fp"], mesh.relay.fingerprint.as_str(), "{info}");
        assert_eq!(st["relay_fp"], fp2.as_str(), "{info}");
        let fix = format!("agentmbx relay set {url} --key {fp2}");
        assert_eq!(info["fix"], fix.as_str(), "{info}");
        let text = host.home.run(&["relay", "info"]);
        assert_eq!(text.code(), Some(1), "not ok: {text:#?}");
        assert!(text.stdout.contains(&format!("fix: {fix}")), "{text:#?}");
        assert!(
            text.stdout
                .contains("enrolment: none cached (none while the relay key is not confirmed)")
                || text.stdout.contains("enrolment: relay key"),
            "{text:#?}"
        );
        assert!(
            text.stdout
                .contains(&format!("pinned {}, served {fp2}", mesh.relay.fingerprint)),
            "{text:#?}"
        );
    }
    // Mail sent now waits; B confirms first, so A keeps passing against the new relay for a
    // while: it never enrols there nor pushes.
    let during = send_to_bob(&mesh, "during the change");
    let out = mesh.b.home.run(&["relay", "set", &url, "--key", &fp2]);
    out.assert_success();
    assert!(out.stdout.contains(&fp2), "{out:#?}");
    wait_for("B enrolled with the new relay", || {
        enrolled_keys(&store).contains(&mesh.b.pubkey).then_some(())
    });
    wait_state(&mesh.b, "ok");
    assert_eq!(
        enrolled_keys(&store),
        vec![mesh.b.pubkey.clone()],
        "A never enrolled"
    );
    assert_eq!(item_count(&store), 0, "A pushed nothing");
    let row = mesh.a.outbox(&during).expect("A's outbox row");
    assert_eq!((row.state.as_str(), row.seq), ("pending", None), "{row:?}");
    assert_eq!(relay_info(&mesh.a)["state"]["state"], "key-mismatch");
    // Audited once per host, not once per pass; confirmed once.
    for host in [&mesh.a, &mesh.b] {
        let changed = audits(host, "relay.key_changed");
        assert_eq!(changed.len(), 1, "{}: {changed:?}", host.name);
        assert_eq!(changed[0]["served"], fp2.as_str());
    }
    assert_eq!(audits(&mesh.b, "relay.key_confirmed").len(), 1);

    // A confirms: the running daemon resumes, and the waiting mail arrives.
    mesh.a
        .home
        .run(&["relay", "set", &url, "--key", &fp2])
        .assert_success();
    wait_inbox(&mesh, &during);
    let info = wait_state(&mesh.a, "ok");
    assert_eq!(info["pin"]["fingerprint"], fp2.as_str(), "{info}");
    assert_eq!(info["enrolment"]["relay_fp"], fp2.as_str(), "{info}");
    assert_eq!(audits(&mesh.a, "relay.key_changed").len(), 1);
}

#[test]
fn relay_set_pins_on_first_use_refuses_changes_and_malformed_keys() {
    let relay = Relay::start(None);
    let host = Host::init("hosta");
    let url = relay.url();
    let config = || std::fs::read(host.home.file("config.toml")).expect("config.toml");

    // Trust on first use: the fingerprint is shown and pinned.
    let out = host.home.run(&["relay", "set", &url]);
    out.assert_success();
    assert!(
        out.stdout.contains(&format!(
            "relay key fingerprint: {} (pinned on first use)",
            relay.fingerprint
        )),
        "{out:#?}"
    );
    // No relay before: a running daemon starts using it from the watched config.toml.
    assert!(
        out.stdout.contains(&format!(
            "a running daemon starts using the new relay when it re-reads config.toml, which it watches (it logs `config changed: relay (unset) -> {url}`)"
        )) && out.stdout.contains("check with: agentmbx doctor relay-enrolled")
            && !out.stdout.contains("restart")
            && !out.stdout.contains("next relay pass"),
        "{out:#?}"
    );
    let info = relay_info(&host);
    assert_eq!(
        info["pin"]["fingerprint"],
        relay.fingerprint.as_str(),
        "{info}"
    );
    assert_eq!(info["pin"]["from"], "config.toml", "{info}");
    assert_eq!(info["source"], "mailbox.db (offline)", "{info}");
    // Again: already pinned.
    let out = host.home.run(&["relay", "set", &format!("{url}/")]);
    out.assert_success();
    assert!(out.stdout.contains("already pinned"), "{out:#?}");
    // The same relay: used from the daemon's next pass, no restart.
    assert!(
        out.stdout
            .contains("a running daemon uses it from its next relay pass")
            && !out.stdout.contains("restart"),
        "{out:#?}"
    );
    let out = host.home.run(&["relay", "set", &url, "--json"]);
    out.assert_success();
    assert_eq!(out.json()["restart_needed"], false, "{out:#?}");
    // No daemon ran yet: no state recorded, so `relay info` reports it and exits 1.
    let live = host.home.run(&["relay", "info", "--json", "--live"]);
    assert_eq!(live.code(), Some(1), "{live:#?}");
    assert_eq!(live.json()["live"]["matches_pin"], true, "{live:#?}");

    // Another relay at the same URL: refused without --key and with the old key (exit 1,
    // nothing changed), malformed keys exit 2; confirmed with the new one.
    let mut relay = relay;
    let port = relay.port;
    relay.kill();
    let dir = tempfile::tempdir().expect("temp dir");
    let (_relay2, fp2) = spawn_relay(port, &dir.path().join("store"), None);
    let before = config();
    let out = host.home.run(&["relay", "set", &url]);
    assert_eq!(out.code(), Some(1), "{out:#?}");
    assert!(
        out.stderr
            .contains(&format!("agentmbx relay set {url} --key {fp2}")),
        "names the fix: {out:#?}"
    );
    assert_eq!(config(), before);
    // Recorded as the daemon records it: audited once, and `relay info` shows it with the fix.
    let info = relay_info(&host);
    assert_eq!(info["state"]["state"], "key-mismatch", "{info}");
    assert_eq!(info["state"]["relay_fp"], fp2.as_str(), "{info}");
    assert_eq!(
        info["state"]["pinned_fp"],
        relay.fingerprint.as_str(),
        "{info}"
    );
    assert_eq!(info["key_change"]["served_fp"], fp2.as_str(), "{info}");
    let fix = format!("agentmbx relay set {url} --key {fp2}");
    assert_eq!(info["fix"], fix.as_str(), "{info}");
    let changed = audits(&host, "relay.key_changed");
    assert_eq!(changed.len(), 1, "{changed:?}");
    assert_eq!(changed[0]["served"], fp2.as_str());
    assert_eq!(changed[0]["pinned"], relay.fingerprint.as_str());
    let out = host
        .home
        .run(&["relay", "set", &url, "--key", &relay.fingerprint]);
    assert_eq!(out.code(), Some(1), "{out:#?}");
    assert!(out.stderr.contains(&fp2), "{out:#?}");
    assert_eq!(config(), before);
    assert_eq!(audits(&host, "relay.key_changed").len(), 1, "not twice");
    for bad in [
        "12345",
        "g234-5678-9abc-def0",
        "1234-5678-9abc-def0-1",
        "AAAA",
    ] {
        let out = host.home.run(&["relay", "set", &url, "--key", bad]);
        assert_eq!(out.code(), Some(2), "--key {bad}: {out:#?}");
        assert_eq!(config(), before);
    }
    let live = host.home.run(&["relay", "info", "--json", "--live"]);
    assert_eq!(live.json()["live"]["matches_pin"], false, "{live:#?}");
    let spelled = fp2.replace('-', ":").to_uppercase();
    let out = host
        .home
        .run(&["relay", "set", &url, "--key", &spelled, "--json"]);
    out.assert_success();
    assert_eq!(out.json()["fingerprint"], fp2.as_str(), "{out:#?}");
    assert_eq!(
        out.json()["previous"],
        relay.fingerprint.as_str(),
        "{out:#?}"
    );
    assert_ne!(config(), before);
    let confirmed = audits(&host, "relay.key_confirmed");
    assert_eq!(confirmed.len(), 1);
    assert_eq!(confirmed[0]["to"], fp2.as_str());
    let info = relay_info(&host);
    assert_eq!(info["pin"]["fingerprint"], fp2.as_str());
    assert_eq!(
        (&info["state"], &info["key_change"], &info["fix"]),
        (&Value::Null, &Value::Null, &Value::Null),
        "the confirmation clears the mismatch: {info}"
    );
}

#[test]
fn an_unreachable_relay_named_by_fingerprint_is_pinned_only_with_that_key() {
    let host = Host::init("hosta");
    let port = free_port();
    let url = format!("http://127.0.0.1:{port}");
    // Unreachable without --key: nothing to pin, exit 1.
    let out = host.home.run(&["relay", "set", &url]);
    assert_eq!(out.code(), Some(1), "{out:#?}");
    // A relay key made ahead of time (as an operator publishes its fingerprint).
    let keygen = host.home.run(&["relay", "keygen"]);
    keygen.assert_success();
    let seed = keygen
        .stdout
        .trim()
        .strip_prefix("MBX_RELAY_KEY=")
        .expect("seed line")
        .to_string();
    let fp = keygen
        .stderr
        .split("fingerprint: ")
        .nth(1)
        .and_then(|r| r.split_whitespace().next())
        .expect("fingerprint")
        .to_string();
    let out = host.home.run(&["relay", "set", &url, "--key", &fp]);
    out.assert_success();
    assert!(
        out.stdout
            .contains(&format!("only a key with fingerprint {fp}")),
        "{out:#?}"
    );
    assert!(
        out.stdout
            .contains("a running daemon starts using the new relay when it re-reads config.toml")
            && !out.stdout.contains("restart"),
        "{out:#?}"
    );
    // Another URL than the configured one: a running daemon re-reads it from config.toml.
    let other = format!("http://127.0.0.1:{}", free_port());
    let out = host
        .home
        .run(&["relay", "set", &other, "--key", &fp, "--json"]);
    out.assert_success();
    assert_eq!(out.json()["restart_needed"], false, "{out:#?}");
    let out = host.home.run(&["relay", "set", &url, "--key", &fp]);
    out.assert_success();
    assert!(
        out.stdout.contains(&format!(
            "a running daemon switches from {other} to the new relay when it re-reads config.toml"
        )),
        "{out:#?}"
    );
    let info = relay_info(&host);
    assert_eq!(info["pin"]["expected"], fp.as_str(), "{info}");
    assert_eq!(info["pin"]["fingerprint"], Value::Null, "{info}");
    // The relay comes up with that key: the daemon pins it on first contact and uses it.
    let dir = tempfile::tempdir().expect("temp dir");
    let (_relay, served) = spawn_relay(port, &dir.path().join("store"), Some(&seed));
    assert_eq!(served, fp);
    let mut host = host;
    host.start(None);
    host.daemon()
        .wait_for_stderr("pinned the relay key the owner named");
    let info = wait_state(&host, "ok");
    assert_eq!(info["pin"]["fingerprint"], fp.as_str(), "{info}");
    assert_eq!(info["pin"]["expected"], Value::Null, "{info}");
}

#[test]
fn a_relay_that_lost_every_enrolment_gets_the_hosts_again_in_the_same_pass() {
    let mut mesh = Mesh::start(None);
    let first = send_to_bob(&mesh, "before the wipe");
    wait_inbox(&mesh, &first);
    // The relay restarts on a wiped store with the same relay key (a new epoch).
    mesh.relay.kill();
    for f in ["relay.db", "relay.db-wal", "relay.db-shm"] {
        let _ = std::fs::remove_file(mesh.relay.store_dir().join(f));
    }
    mesh.relay.launch(None);
    let after = send_to_bob(&mesh, "after the wipe");
    wait_inbox(&mesh, &after);
    for host in [&mesh.a, &mesh.b] {
        assert_eq!(
            audits(host, "relay.enrolment_lost").len(),
            1,
            "{}",
            host.name
        );
        assert_eq!(audits(host, "relay.enrolled").len(), 2, "{}", host.name);
        // Said when the relay answered 401, or once the host was enrolled again.
        assert!(
            host.log()
                .contains("the relay had lost this host's enrolment: enrolled again")
                || host
                    .log()
                    .contains("the relay lost this host's enrolment: enrolling again"),
            "{}: {}",
            host.name,
            host.log()
        );
        let info = wait_state(host, "ok");
        let epoch = mesh
            .relay
            .db()
            .query_row("SELECT v FROM meta WHERE k = 'epoch'", [], |r| {
                r.get::<_, String>(0)
            })
            .expect("epoch");
        assert_eq!(info["enrolment"]["epoch"], epoch.as_str(), "{info}");
        assert_eq!(info["enc_ad"]["epoch"], epoch.as_str(), "{info}");
    }
}

#[test]
fn a_host_clock_ten_minutes_ahead_is_reported_as_clock_skew_and_backs_off() {
    let mut mesh = Mesh::configured(None);
    mesh.a.start_with(&[("MBX_CLOCK_OFFSET_MS", "600000")]);
    let info = wait_state(&mesh.a, "clock-skew");
    let st = &info["state"];
    assert_eq!(st["status"], 401, "{info}");
    assert!(st["next_at"].is_string(), "{info}");
    assert!(
        st["detail"]
            .as_str()
            .unwrap_or("")
            .contains("ahead of the relay's"),
        "{info}"
    );
    assert_eq!(info["backoff"]["n"], 1, "{info}");
    let failed = audits(&mesh.a, "relay.enrol_failed");
    assert_eq!(failed.len(), 1, "{failed:?}");
    assert_eq!(failed[0]["reason"], "clock-skew");
    let text = mesh.a.home.run(&["relay", "info"]);
    assert!(text.stdout.contains("state: clock-skew"), "{text:#?}");
    assert!(text.stdout.contains("next attempt: "), "{text:#?}");
}

#[test]
fn the_allowlist_follows_the_peers_and_the_relay_refuses_other_senders() {
    let mesh = Mesh::start(None);
    let url = mesh.relay.url();
    // A third host that pins B, but B does not know it.
    let mut c = Host::init("hostc");
    c.home
        .run(&["peers", "add", "hostb", &mesh.b.pubkey])
        .assert_success();
    c.home
        .run(&["relay", "set", &url, "--key", &mesh.relay.fingerprint])
        .assert_success();
    c.start(None);
    c.daemon().wait_for_stderr("published the enc-key ad");
    let senders = |target: &str| -> Option<Vec<String>> {
        mesh.relay
            .db()
            .query_row(
                "SELECT senders FROM sender_lists WHERE target_pubkey = ?1",
                [target],
                |r| r.get::<_, String>(0),
            )
            .ok()
            .map(|s| serde_json::from_str(&s).expect("JSON senders"))
    };
    wait_for("B's allowlist at the relay", || {
        (senders(&mesh.b.pubkey)? == vec![mesh.a.pubkey.clone()]).then_some(())
    });
    let info = relay_info(&mesh.b);
    assert_eq!(info["allowlist"]["count"], 1, "{info}");
    // C's mail to B is refused by the relay: C is not on B's list.
    let sent = c.send("carol", "bob@hostb", "from a stranger", "body");
    let id = sent["id"].as_str().expect("id").to_string();
    let row = wait_for("C's refused push", || {
        c.outbox(&id).filter(|r| {
            r.last_error
                .as_deref()
                .is_some_and(|e| e.contains("sender not accepted by target"))
        })
    });
    assert_eq!(row.seq, None, "{row:?}");
    // B pins C: the list is republished and C's retry goes through.
    mesh.b
        .home
        .run(&["peers", "add", "hostc", &c.pubkey])
        .assert_success();
    wait_for("B's allowlist with C", || {
        let mut want = vec![mesh.a.pubkey.clone(), c.pubkey.clone()];
        want.sort();
        (senders(&mesh.b.pubkey)? == want).then_some(())
    });
    c.wait_relay_accepted(&id);
    // B unpairs A: republished without it.
    mesh.b
        .home
        .run(&["peers", "remove", "hosta"])
        .assert_success();
    wait_for("B's allowlist without A", || {
        (senders(&mesh.b.pubkey)? == vec![c.pubkey.clone()]).then_some(())
    });
}

#[test]
fn a_revoked_host_and_a_denied_one_each_say_so_and_mail_to_them_shows_why_it_waits() {
    let mut mesh = Mesh::start(None);
    let first = send_to_bob(&mesh, "before the operator acts");
    wait_inbox(&mesh, &first);
    wait_state(&mesh.a, "ok");
    wait_state(&mesh.b, "ok");
    let store = mesh.relay.store_dir();
    let dir = store.to_str().expect("UTF-8 path").to_owned();

    // The operator revokes B's key (relay stopped, on its store) and starts the relay again.
    mesh.relay.kill();
    mesh.b
        .home
        .run(&["relay", "revoke", &mesh.b.pubkey, "--store-dir", &dir])
        .assert_success();
    mesh.relay.launch(None);
    let info = wait_state(&mesh.b, "revoked");
    let st = &info["state"];
    assert_eq!(st["status"], 403, "{info}");
    let detail = st["detail"].as_str().unwrap_or("");
    assert!(
        detail.contains("revoked this host key for good (REVOKED")
            && detail.contains("this host key can never use this relay again")
            && !detail.contains("until it accepts"),
        "{info}"
    );
    assert_eq!(
        info["fix"],
        "none on this relay: this host key can never use this relay again; ask its operator",
        "{info}"
    );
    let text = mesh.b.home.run(&["relay", "info"]);
    assert_eq!(text.code(), Some(1), "{text:#?}");
    assert!(text.stdout.contains("state: revoked since "), "{text:#?}");
    assert!(
        text.stdout
            .contains("enrolment: none cached (this host key is revoked on this relay for good)"),
        "{text:#?}"
    );
    assert!(
        !text.stdout.contains("enrols on its next pass"),
        "{text:#?}"
    );
    assert_eq!(
        audits(&mesh.b, "relay.enrol_failed")[0]["reason"],
        "revoked"
    );

    // Mail to B now waits at A, and `sent` says why.
    let id = send_to_bob(&mesh, "to a revoked host");
    let row = wait_for("A's row to B with a last error", || {
        mesh.a
            .outbox(&id)
            .filter(|r| r.state == "pending" && r.last_error.is_some())
    });
    let last_error = row.last_error.expect("last_error");
    let shown: String = if last_error.chars().count() > 120 {
        last_error.chars().take(119).chain(['…']).collect()
    } else {
        last_error.clone()
    };
    let out = mesh.a.home.run(&["sent", "--as", "alice", "--json"]);
    out.assert_success();
    let page = out.json();
    let bob = &page["messages"][0]["recipients"][0];
    assert_eq!(bob["recipient"], "bob@hostb", "{page}");
    assert_eq!(bob["state"], "queued", "{page}");
    // (the row may have been tried again in between: then its error is the same text)
    assert_eq!(bob["last_error"], shown.as_str(), "{page}");
    let text = mesh.a.home.run(&["sent", "--as", "alice"]);
    text.assert_success();
    assert!(
        text.stdout
            .contains(&format!("  bob@hostb: queued ({shown})")),
        "{text:#?}"
    );
    // The delivered one shows no error.
    assert!(
        page["messages"][1]["recipients"][0]
            .get("last_error")
            .is_none(),
        "{page}"
    );

    // The operator deny-lists A for two hours: A is denied, not revoked.
    mesh.relay.kill();
    mesh.a
        .home
        .run(&[
            "relay",
            "deny",
            &mesh.a.pubkey,
            "--until",
            "2h",
            "--store-dir",
            &dir,
        ])
        .assert_success();
    mesh.relay.launch(None);
    let info = wait_state(&mesh.a, "denied");
    let st = &info["state"];
    assert_eq!(st["status"], 403, "{info}");
    let detail = st["detail"].as_str().unwrap_or("");
    assert!(
        detail.contains("refuses this host for now (DENIED") && !detail.contains("for good"),
        "{info}"
    );
    assert!(
        info["fix"]
            .as_str()
            .unwrap_or("")
            .starts_with("ask the relay's operator to lift the deny"),
        "{info}"
    );
    let text = mesh.a.home.run(&["relay", "info"]);
    assert_eq!(text.code(), Some(1), "{text:#?}");
    assert!(text.stdout.contains("state: denied since "), "{text:#?}");
    assert!(
        text.stdout.contains(
            "enrolment: none cached (the relay refuses this host; the daemon tries again at "
        ),
        "{text:#?}"
    );
    assert_eq!(audits(&mesh.a, "relay.enrol_failed")[0]["reason"], "denied");

    // Neither refusal was announced as a lost enrolment.
    for host in [&mesh.a, &mesh.b] {
        let log = host.log();
        assert!(
            !log.contains("lost this host's enrolment"),
            "{}: {log}",
            host.name
        );
        assert!(
            log.contains("the relay refuses this host") || log.contains("revoked this host key"),
            "{}: {log}",
            host.name
        );
    }
}
