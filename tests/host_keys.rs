//! Black-box tests of the host's keys (`wire.md` §2.10; design README "Key store"): `agentmbx
//! host rotate` on a real home, its refusal while the daemon runs, crash drills that kill the
//! real process at each step of a rotation, a rotated host re-pinned by its LAN peer, and the
//! keys in a real Secret Service (Debian's gnome-keyring under `dbus-run-session`; skipped, with
//! the reason printed, where that is not installed).

use crate::helper;

use std::io::{BufRead, BufReader};
use std::process::Stdio;

use crate::helper::mesh::Host;
use crate::helper::{wait_for, Home, TIMEOUT};
use agentmbx_protocol::keys::{KeyFile, PublicKey};
use agentmbx_protocol::rotation::SignedRotation;
use serde_json::Value;

fn read_json(home: &Home, name: &str) -> Value {
    let text = std::fs::read_to_string(home.file(name)).unwrap_or_else(|e| panic!("{name}: {e}"));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{name}: {e}"))
}

fn whoami(home: &Home) -> Value {
    let out = home.run(&["whoami", "--json"]);
    out.assert_success();
    out.json()
}

fn key_file(home: &Home, name: &str) -> KeyFile {
    KeyFile::parse(&std::fs::read_to_string(home.file(name)).expect("key file")).expect("parses")
}

fn initialized(name: &str) -> Home {
    let home = Home::new();
    home.run(&["init", "--host", name]).assert_success();
    home
}

#[test]
fn host_rotate_replaces_the_keys_logs_the_signed_record_and_whoami_shows_them() {
    let home = initialized("alpha");
    let before = whoami(&home);
    assert_eq!(before["keystore"], "file");

    let out = home.run(&["host", "rotate", "--json"]);
    out.assert_success();
    let done = out.json();
    assert_eq!(done["old_pubkey"], before["host_pubkey"]);
    assert_ne!(done["host_pubkey"], before["host_pubkey"]);
    assert_eq!(done["rotations"], 1);

    let after = whoami(&home);
    assert_eq!(after["host"], "alpha");
    assert_eq!(after["host_pubkey"], done["host_pubkey"]);
    assert_ne!(after["enc_pub"], before["enc_pub"]);
    assert_eq!(after["keystore"], "file");
    assert_eq!(key_file(&home, "host.key").public_key, after["host_pubkey"]);
    assert_eq!(key_file(&home, "enc.key").public_key, after["enc_pub"]);

    // The record is logged, signed by the old key and the new one.
    let log = read_json(&home, "rotations.json");
    let records = log["records"].as_array().expect("records");
    assert_eq!(records.len(), 1);
    let record = SignedRotation::from_value(&records[0]).expect("a rotation record");
    let old = PublicKey::from_b64(before["host_pubkey"].as_str().unwrap()).unwrap();
    assert_eq!(record.check(&old), Ok(()));
    assert_eq!(record.rec.new_pub, after["host_pubkey"]);
    assert_eq!(record.rec.new_enc_pub, after["enc_pub"]);
    assert_eq!(record.rec.host, "alpha");
    assert_eq!(log["delivered"], serde_json::json!({}));

    // The old keys are retired, the private enc key in the key store, never in the JSON.
    let retired = read_json(&home, "retired-keys.json");
    assert_eq!(retired["host"][0]["publicKey"], before["host_pubkey"]);
    assert_eq!(retired["enc"][0]["publicKey"], before["enc_pub"]);
    assert!(retired["enc"][0].get("privateKey").is_none());
    for name in ["rotations.json", "retired-keys.json", "host.key", "enc.key"] {
        #[cfg(unix)]
        assert_eq!(helper::mode(&home.file(name)), 0o600, "{name}");
    }
    for staged in ["host.key.next", "enc.key.next"] {
        assert!(!home.file(staged).exists(), "{staged} left behind");
    }

    // Text output names both fingerprints; a second rotation chains from the first.
    let out = home.run(&["host", "rotate"]);
    out.assert_success();
    assert!(
        out.stdout.contains(after["fingerprint"].as_str().unwrap()),
        "{out:#?}"
    );
    let log = read_json(&home, "rotations.json");
    let second = SignedRotation::from_value(&log["records"][1]).expect("second record");
    let mid = PublicKey::from_b64(after["host_pubkey"].as_str().unwrap()).unwrap();
    assert_eq!(second.check(&mid), Ok(()));
}

#[test]
fn host_rotate_before_init_exits_not_found() {
    let home = Home::new();
    let out = home.run(&["host", "rotate"]);
    assert_eq!(out.code(), Some(3), "{out:#?}");
    assert!(out.stderr.contains("not initialized"), "{out:#?}");
}

#[test]
fn host_rotate_is_refused_while_the_daemon_runs() {
    let home = initialized("beta");
    let before = whoami(&home);
    let daemon = helper::Daemon::start(&home);
    let out = home.run(&["host", "rotate"]);
    assert_eq!(out.code(), Some(1), "{out:#?}");
    assert!(
        out.stderr.contains("daemon is running") && out.stderr.contains("stop it"),
        "{out:#?}"
    );
    assert_eq!(whoami(&home)["host_pubkey"], before["host_pubkey"]);
    assert!(!home.file("rotations.json").exists());
    let (status, log) = daemon.terminate();
    assert!(status.success(), "{log}");
    home.run(&["host", "rotate"]).assert_success();
    assert_ne!(whoami(&home)["host_pubkey"], before["host_pubkey"]);
}

/// Runs `host rotate` with failpoint `point` paused, waits for it and SIGKILLs the process there.
fn rotate_killed_at(home: &Home, point: &str) {
    let mut child = home
        .command(&["host", "rotate"])
        .env("MBX_FAILPOINTS", point)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn host rotate");
    let stderr = child.stderr.take().expect("stderr");
    let (tx, rx) = std::sync::mpsc::channel();
    let want = format!("FAILPOINT {point} reached");
    std::thread::spawn(move || {
        let mut seen = String::new();
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            seen.push_str(&line);
            seen.push('\n');
            if line.contains(&want) {
                let _ = tx.send(Ok(()));
                return;
            }
        }
        let _ = tx.send(Err(seen));
    });
    match rx.recv_timeout(TIMEOUT) {
        Ok(Ok(())) => {}
        Ok(Err(log)) => panic!("host rotate ended before {point}: {log}"),
        Err(_) => panic!("host rotate did not reach {point} within {TIMEOUT:?}"),
    }
    child.kill().expect("SIGKILL");
    let status = child.wait().expect("wait");
    assert_eq!(
        std::os::unix::process::ExitStatusExt::signal(&status),
        Some(libc::SIGKILL),
        "{status:?}"
    );
}

#[test]
fn a_rotation_killed_at_any_step_leaves_the_old_keys_or_completes_on_the_next_load() {
    for point in [
        "rotate:after-stage",
        "rotate:after-log",
        "rotate:after-retire",
        "rotate:after-swap-host",
    ] {
        let home = initialized("gamma");
        let before = whoami(&home);
        rotate_killed_at(&home, point);
        let staged = home.file("host.key.next").exists() || home.file("enc.key.next").exists();
        assert!(
            staged,
            "{point}: the staged keys are still there before the next load"
        );

        let after = whoami(&home);
        let records = home
            .file("rotations.json")
            .exists()
            .then(|| read_json(&home, "rotations.json")["records"].clone())
            .and_then(|r| r.as_array().cloned())
            .unwrap_or_default();
        if point == "rotate:after-stage" {
            // Never logged: the rotation did not happen, the staged keys are discarded.
            assert!(records.is_empty(), "{point}: {records:?}");
            assert_eq!(after["host_pubkey"], before["host_pubkey"], "{point}");
            assert_eq!(after["enc_pub"], before["enc_pub"], "{point}");
            assert!(!home.file("retired-keys.json").exists(), "{point}");
        } else {
            // Logged: the next load completes it, to exactly the logged keys.
            assert_eq!(records.len(), 1, "{point}");
            let record = SignedRotation::from_value(&records[0]).expect("record");
            assert_eq!(after["host_pubkey"], record.rec.new_pub.as_str(), "{point}");
            assert_eq!(after["enc_pub"], record.rec.new_enc_pub.as_str(), "{point}");
            assert_eq!(
                record.rec.old_pub,
                before["host_pubkey"].as_str().unwrap(),
                "{point}"
            );
            let retired = read_json(&home, "retired-keys.json");
            assert_eq!(retired["host"].as_array().map(Vec::len), Some(1), "{point}");
            assert_eq!(
                retired["host"][0]["publicKey"], before["host_pubkey"],
                "{point}"
            );
            assert_eq!(retired["enc"][0]["publicKey"], before["enc_pub"], "{point}");
        }
        for staged in ["host.key.next", "enc.key.next"] {
            assert!(!home.file(staged).exists(), "{point}: {staged} left behind");
        }
        // Loading again changes nothing, and the next rotation starts from the keys in force.
        assert_eq!(whoami(&home), after, "{point}");
        let out = home.run(&["host", "rotate", "--json"]);
        out.assert_success();
        assert_eq!(out.json()["old_pubkey"], after["host_pubkey"], "{point}");
    }
}

#[test]
fn a_rotated_host_is_re_pinned_by_its_lan_peer_and_mail_flows_both_ways() {
    let mut a = Host::init("hosta");
    let mut b = Host::init("hostb");
    a.register("alice");
    b.register("bob");
    a.start(None);
    b.start(None);
    a.pair_with(&b);
    let old_enc = whoami(&a.home)["enc_pub"].clone();

    a.stop();
    let out = a.home.run(&["host", "rotate", "--json"]);
    out.assert_success();
    let rotated = out.json();
    assert_eq!(rotated["peers"], serde_json::json!(["hostb"]));
    let new_key = rotated["host_pubkey"].as_str().unwrap().to_string();
    let new_enc = rotated["enc_pub"].as_str().unwrap().to_string();
    assert_ne!(new_enc.as_str(), old_enc.as_str().unwrap());
    a.start(None);

    // The daemon announces at start; B moves its pin and learns the new enc key.
    wait_for("B to pin A's new key", || {
        (b.count(
            "SELECT COUNT(*) FROM peers WHERE host = 'hosta' AND pubkey = ?1",
            &new_key,
        ) == 1)
            .then_some(())
    });
    wait_for("A to record that B took the rotation", || {
        (read_json(&a.home, "rotations.json")["delivered"]["hostb"] == 1).then_some(())
    });
    assert_eq!(
        b.count(
            "SELECT COUNT(*) FROM peers WHERE host = 'hosta' AND enc_pub = ?1",
            &new_enc
        ),
        1
    );

    let sent = a.send(
        "alice",
        "bob@hostb",
        "after the rotation",
        "signed by the new key",
    );
    let id = sent["id"].as_str().expect("id").to_string();
    wait_for("the mail in bob's inbox", || {
        b.inbox_ids("bob").iter().any(|i| i == &id).then_some(())
    });
    assert_eq!(b.read(&id, "bob")["body"], "signed by the new key");
    let back = b.send("bob", "alice@hosta", "sealed to the new key", "hello alice");
    let back_id = back["id"].as_str().expect("id").to_string();
    wait_for("the reply in alice's inbox", || {
        a.inbox_ids("alice")
            .iter()
            .any(|i| i == &back_id)
            .then_some(())
    });
    assert_eq!(a.read(&back_id, "alice")["body"], "hello alice");
}

/// `dbus-run-session` and `gnome-keyring-daemon`, or why the real Secret Service test is skipped.
fn secret_service_tools() -> Result<(), String> {
    for tool in ["dbus-run-session", "dbus-send", "gnome-keyring-daemon"] {
        let found = std::process::Command::new("sh")
            .args(["-c", &format!("command -v {tool}")])
            .stdout(Stdio::null())
            .status()
            .is_ok_and(|s| s.success());
        if !found {
            return Err(format!(
                "{tool} is not installed (Debian: dbus-daemon, gnome-keyring)"
            ));
        }
    }
    Ok(())
}

#[test]
fn keys_live_in_a_real_secret_service_when_one_answers() {
    if !cfg!(target_os = "linux") {
        eprintln!("SKIPPED keys_live_in_a_real_secret_service_when_one_answers: the Secret Service drill runs on Linux");
        return;
    }
    if let Err(why) = secret_service_tools() {
        eprintln!("SKIPPED keys_live_in_a_real_secret_service_when_one_answers: {why}");
        return;
    }
    let home = Home::new();
    let keyrings = tempfile::tempdir().expect("temp dir");
    // One D-Bus session with gnome-keyring unlocked; no MBX_KEYSTORE: the automatic choice
    // finds the Secret Service. gnome-keyring keeps its files under the temporary HOME.
    let out_dir = tempfile::tempdir().expect("temp dir");
    // gnome-keyring unlocks (creating its login keyring), then the script waits until it owns
    // org.freedesktop.secrets on the bus, so no second instance is activated beside it.
    let script = r#"printf pw | gnome-keyring-daemon --unlock --components=secrets >/dev/null 2>&1 || exit 90
n=0
until dbus-send --session --print-reply --dest=org.freedesktop.DBus /org/freedesktop/DBus \
    org.freedesktop.DBus.NameHasOwner string:org.freedesktop.secrets 2>/dev/null | grep -q true; do
  n=$((n + 1)); [ "$n" -gt 300 ] && exit 90; sleep 0.1
done
"$BIN" init --host keyed --json >"$OUT/init.json" || exit 91
"$BIN" host rotate --json >"$OUT/rotate.json" || exit 92
"$BIN" whoami --json >"$OUT/whoami.json" || exit 93"#;
    let mut env = home.command(&[]);
    env.env_remove("MBX_KEYSTORE")
        .env_remove("DBUS_SESSION_BUS_ADDRESS")
        .env("HOME", keyrings.path())
        .env("XDG_DATA_HOME", keyrings.path().join("data"))
        .env("BIN", helper::bin())
        .env("OUT", out_dir.path());
    let mut cmd = std::process::Command::new("dbus-run-session");
    cmd.args(["--", "sh", "-c", script]).stdin(Stdio::null());
    for (k, v) in env.get_envs() {
        match v {
            Some(v) => cmd.env(k, v),
            None => cmd.env_remove(k),
        };
    }
    let out = helper::run(cmd);
    if out.code() == Some(90) {
        eprintln!(
            "SKIPPED keys_live_in_a_real_secret_service_when_one_answers: gnome-keyring did not start a Secret Service: {}",
            out.stderr
        );
        return;
    }
    assert_eq!(out.code(), Some(0), "{out:#?}");
    let doc = |name: &str| -> Value {
        let text = std::fs::read_to_string(out_dir.path().join(name)).expect(name);
        serde_json::from_str(&text).unwrap_or_else(|e| panic!("{name}: {e}: {text}"))
    };
    let (init, rotated, who) = (&doc("init.json"), &doc("rotate.json"), &doc("whoami.json"));
    assert_eq!(init["keystore"], "keyring");
    assert_eq!(who["keystore"], "keyring");
    assert_eq!(rotated["old_pubkey"], init["host_pubkey"]);
    assert_eq!(who["host_pubkey"], rotated["host_pubkey"]);
    assert_ne!(who["enc_pub"], init["enc_pub"]);
    // No private key touched the disk: only the marker and public files.
    for name in ["host.key", "enc.key", "host.key.next", "enc.key.next"] {
        assert!(!home.file(name).exists(), "{name} written to disk");
    }
    assert!(home.file("host.key.keyring").is_file());
    let config = std::fs::read_to_string(home.file("config.toml")).expect("config.toml");
    assert!(config.contains("key_store = \"keyring\""), "{config}");
    let names: Vec<String> = std::fs::read_dir(home.path())
        .expect("home")
        .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
        .collect();
    assert!(
        !names.iter().any(|n| n.starts_with("enc.key.retired-")),
        "{names:?}"
    );
    assert!(!std::fs::read_to_string(home.file("retired-keys.json"))
        .expect("retired-keys.json")
        .contains("privateKey"));

    // Outside that session the keyring does not answer: a clear error, never a new identity.
    let out = home.run(&["whoami"]);
    assert_eq!(out.code(), Some(1), "{out:#?}");
    assert!(out.stderr.contains("OS keyring"), "{out:#?}");
    assert!(!home.file("host.key").exists());
    // And the recorded store is never switched by the environment.
    let mut cmd = home.command(&["whoami"]);
    cmd.env("MBX_KEYSTORE", "file");
    let out = helper::run(cmd);
    assert_eq!(out.code(), Some(1), "{out:#?}");
    assert!(out.stderr.contains("cannot switch it"), "{out:#?}");
}

#[test]
fn init_without_a_keyring_falls_back_to_files_with_one_warning() {
    let home = Home::new();
    let mut cmd = home.command(&["init", "--host", "plain", "--json"]);
    cmd.env_remove("MBX_KEYSTORE")
        .env_remove("DBUS_SESSION_BUS_ADDRESS")
        .env_remove("XDG_RUNTIME_DIR");
    let out = helper::run(cmd);
    out.assert_success();
    if out.json()["keystore"] == "keyring" {
        eprintln!("SKIPPED init_without_a_keyring_falls_back_to_files_with_one_warning: this machine's OS keyring answers without a D-Bus session");
        return;
    }
    assert_eq!(out.json()["keystore"], "file");
    assert_eq!(
        out.stderr
            .matches("the OS keyring is not available")
            .count(),
        1,
        "{out:#?}"
    );
    assert!(out.stderr.contains("MBX_KEYSTORE=file"), "{out:#?}");
    assert!(home.file("host.key").is_file());
    let config = std::fs::read_to_string(home.file("config.toml")).expect("config.toml");
    assert!(config.contains("key_store = \"file\""), "{config}");
    // Recorded: later commands neither probe nor warn.
    let out = home.run(&["whoami", "--json"]);
    out.assert_success();
    assert!(!out.stderr.contains("keyring"), "{out:#?}");
}
