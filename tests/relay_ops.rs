//! Relay store operations against the real binary (spec §5; `wire.md` §3.4): the start-up
//! epoch rotation after a stale or future heartbeat (time moved with `MBX_CLOCK_OFFSET_MS`),
//! `relay rotate-epoch` offline (refused with exit 4 while the relay serves) and through the
//! admin endpoint, `relay log`, and `relay backup` while a relay serves under traffic.

use crate::helper;

use std::collections::HashMap;
use std::path::Path;

use serde_json::Value;

use crate::helper::mesh::{free_port, open_read_only, Mesh};
use crate::helper::relay_cli::{meta, relay_cli, serve, ADMIN};
use crate::helper::{command, run, wait_for};

fn log_json(dir: &str, limit: &str) -> Vec<Value> {
    let out = relay_cli(
        &["log", "--json", "--limit", limit, "--store-dir", dir],
        &[],
    );
    out.assert_success();
    out.json().as_array().expect("array").clone()
}

#[test]
fn a_stale_or_future_heartbeat_rotates_the_epoch_at_start_and_operators_rotate_it_too() {
    let tmp = tempfile::tempdir().expect("temp dir");
    let store = tmp.path().join("store");
    let dir = store.to_str().expect("UTF-8").to_owned();
    let env = [("MBX_RELAY_ADMIN_TOKEN", ADMIN)];

    // First start: a heartbeat is written; no rotation.
    let relay = serve(&store, &env);
    wait_for("the first heartbeat", || meta(&store, "heartbeat"));
    let epoch0 = meta(&store, "epoch").expect("epoch");
    let log = relay.kill();
    assert!(!log.contains("rotated the epoch"), "{log}");

    // 9 minutes later (fresh enough): the same epoch.
    let relay = serve(&store, &[("MBX_CLOCK_OFFSET_MS", "540000")]);
    assert_eq!(meta(&store, "epoch").as_deref(), Some(epoch0.as_str()));
    wait_for("the heartbeat of the second start", || {
        meta(&store, "heartbeat")
            .and_then(|h| h.parse::<i64>().ok())
            .filter(|h| *h > helper_now() + 500_000)
    });
    relay.kill();

    // 11 minutes past that heartbeat: rotated at start, one log line, one receipt.
    let relay = serve(&store, &[("MBX_CLOCK_OFFSET_MS", "1200000")]);
    let epoch1 = meta(&store, "epoch").expect("epoch");
    assert_ne!(epoch1, epoch0);
    let stderr = relay.stderr();
    let line = stderr
        .lines()
        .find(|l| l.contains("rotated the epoch"))
        .unwrap_or_else(|| panic!("no rotation line:\n{stderr}"));
    for part in ["heartbeat=", "age_ms=", &epoch0, &epoch1] {
        assert!(line.contains(part), "{part} missing in {line}");
    }
    // `relay log` reads while the relay serves.
    let entries = log_json(&dir, "50");
    assert_eq!(entries.len(), 1, "{entries:?}");
    let r = &entries[0]["receipt"];
    assert_eq!(entries[0]["op"], "relay-epoch-rotated");
    assert_eq!(r["type"], "relay-epoch-rotated");
    assert_eq!(r["by"], "heartbeat");
    assert_eq!(r["from"], epoch0.as_str());
    assert_eq!(r["to"], epoch1.as_str());
    assert!(r["store"]
        .as_str()
        .expect("store")
        .ends_with("/store/relay.db"));
    let rotated: Value =
        serde_json::from_str(&meta(&store, "epoch_rotated").expect("meta")).expect("json");
    assert_eq!(&rotated, r);
    relay.kill();

    // A heartbeat in the future (the clock went back 11 minutes): rotated again.
    let relay = serve(&store, &[("MBX_CLOCK_OFFSET_MS", "500000")]);
    let epoch2 = meta(&store, "epoch").expect("epoch");
    assert_ne!(epoch2, epoch1);

    // rotate-epoch offline is refused while the relay serves, and changes nothing.
    let out = relay_cli(&["rotate-epoch", "--store-dir", &dir], &[]);
    assert_eq!(out.code(), Some(4), "{out:#?}");
    assert!(out.stderr.contains("a running relay holds"), "{out:#?}");
    assert_eq!(meta(&store, "epoch").as_deref(), Some(epoch2.as_str()));
    let relay_log = relay.kill();
    assert!(relay_log.contains("rotated the epoch"), "{relay_log}");

    // Through the admin endpoint.
    let relay = serve(
        &store,
        &[
            ("MBX_RELAY_ADMIN_TOKEN", ADMIN),
            ("MBX_CLOCK_OFFSET_MS", "500000"),
        ],
    );
    let url = format!("http://{}", relay.addr);
    let out = relay_cli(
        &["rotate-epoch", "--url", &url, "--json"],
        &[("MBX_RELAY_ADMIN_TOKEN", "wrong-token-0123456789abcdef")],
    );
    assert_eq!(out.code(), Some(1), "{out:#?}");
    assert!(out.stderr.contains("refused the admin token"), "{out:#?}");
    let out = relay_cli(&["rotate-epoch", "--url", &url, "--json"], &env);
    out.assert_success();
    let r = out.json();
    assert_eq!(r["type"], "relay-epoch-rotated");
    assert_eq!(r["by"], "operator");
    assert_eq!(r["from"], epoch2.as_str());
    let epoch3 = meta(&store, "epoch").expect("epoch");
    assert_eq!(r["to"], epoch3.as_str());
    assert_ne!(epoch3, epoch2);
    let _ = relay.stderr();
    relay.kill();

    // Offline.
    let out = relay_cli(&["rotate-epoch", "--store-dir", &dir, "--json"], &[]);
    out.assert_success();
    let r = out.json();
    assert_eq!(r["by"], "operator");
    assert_eq!(r["from"], epoch3.as_str());
    assert_eq!(meta(&store, "epoch").as_deref(), r["to"].as_str());

    // The log: newest first, text lines `<at>  <op>  <summary>`, --limit bounds.
    let entries = log_json(&dir, "1000");
    let bys: Vec<&str> = entries
        .iter()
        .map(|e| e["receipt"]["by"].as_str().unwrap_or(""))
        .collect();
    assert_eq!(bys, ["operator", "operator", "heartbeat", "heartbeat"]);
    assert_eq!(log_json(&dir, "1").len(), 1);
    let out = relay_cli(&["log", "--store-dir", &dir, "--limit", "2"], &[]);
    out.assert_success();
    let lines: Vec<&str> = out.stdout.lines().collect();
    assert_eq!(lines.len(), 2, "{out:#?}");
    let fields: Vec<&str> = lines[0].split("  ").collect();
    assert_eq!(fields.len(), 3, "{}", lines[0]);
    assert!(fields[0].ends_with('Z'), "{}", lines[0]);
    assert_eq!(fields[1], "relay-epoch-rotated");
    assert!(fields[2].ends_with("(by operator)"), "{}", lines[0]);
    for bad in ["0", "1001"] {
        let out = relay_cli(&["log", "--store-dir", &dir, "--limit", bad], &[]);
        assert_eq!(out.code(), Some(2), "{out:#?}");
    }
    let empty = tempfile::tempdir().expect("temp dir");
    let out = relay_cli(
        &["log", "--store-dir", empty.path().to_str().expect("UTF-8")],
        &[],
    );
    assert_eq!(out.code(), Some(3), "{out:#?}");
}

/// Milliseconds since the epoch.
fn helper_now() -> i64 {
    let since = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .expect("clock after 1970");
    i64::try_from(since.as_millis()).expect("ms fit i64")
}

/// `(target, seq) -> wire_hash` of the items in a store file.
fn items_of(db: &Path) -> HashMap<(String, i64), String> {
    let c = open_read_only(db);
    let mut st = c
        .prepare("SELECT target_pubkey, seq, wire_hash FROM items")
        .expect("prepare");
    st.query_map([], |r| Ok(((r.get(0)?, r.get(1)?), r.get(2)?)))
        .expect("query")
        .collect::<Result<_, _>>()
        .expect("rows")
}

fn sha256_hex(bytes: &[u8]) -> String {
    use sha2::{Digest, Sha256};
    hex::encode(Sha256::digest(bytes))
}

#[test]
fn a_backup_while_the_relay_serves_under_traffic_is_a_store_with_the_same_items() {
    let mut mesh = Mesh::start(None);
    // The receiver is stopped, so what the relay accepts stays queued.
    mesh.b.stop();
    let dir = mesh.relay.store_dir();
    let dir_s = dir.to_str().expect("UTF-8").to_owned();
    let out_dir = tempfile::tempdir().expect("out");
    let file = out_dir.path().join("relay-backup.db");
    let file_s = file.to_str().expect("UTF-8").to_owned();

    // Traffic: mail flows from a through the relay while the backup runs.
    for i in 0..5 {
        mesh.a
            .send("alice", "bob@hostb", &format!("before {i}"), "x");
    }
    wait_for("some items at the relay", || {
        (!mesh.relay.items_for(&mesh.b.pubkey).is_empty()).then_some(())
    });
    let (a_addr, a_token) = (mesh.a.daemon().addr, mesh.a.home.token());
    let sender = std::thread::spawn(move || {
        for i in 0..10 {
            let body = serde_json::json!({"from": "alice", "to": ["bob@hostb"],
                                          "subject": format!("during {i}"), "body": "y"})
            .to_string();
            let r = helper::request(
                a_addr,
                "POST",
                "/v1/messages",
                Some(&a_token),
                &[],
                Some(&body),
            );
            assert_eq!(r.status, 201, "{r:#?}");
        }
    });
    let out = relay_cli(&["backup", &file_s, "--store-dir", &dir_s, "--json"], &[]);
    sender.join().expect("sender");
    out.assert_success();
    let r = out.json();
    assert!(
        out.stderr.contains("not added to the relay log"),
        "{out:#?}"
    );

    // The receipt matches the file.
    let bytes = std::fs::read(&file).expect("read backup");
    assert_eq!(r["type"], "relay-backup");
    assert_eq!(r["file"], file_s.as_str());
    assert_eq!(r["bytes"], bytes.len());
    assert_eq!(r["sha256"], sha256_hex(&bytes).as_str());
    assert_eq!(r["relay_fingerprint"], mesh.relay.fingerprint.as_str());
    let backup_items = items_of(&file);
    assert!(!backup_items.is_empty());
    assert_eq!(r["counts"]["items"], backup_items.len());
    assert_eq!(r["counts"]["targets"], 1);
    assert_eq!(r["counts"]["enrolments"], 2);
    let c = open_read_only(&file);
    let dedup: i64 = c
        .query_row("SELECT COUNT(*) FROM dedup", [], |r| r.get(0))
        .expect("dedup");
    assert_eq!(r["counts"]["dedup"], dedup);
    let epoch: String = c
        .query_row("SELECT v FROM meta WHERE k = 'epoch'", [], |r| r.get(0))
        .expect("epoch");
    assert_eq!(r["epoch"], epoch.as_str());
    drop(c);

    // Every item of the backup is at the live relay with the same seq and bytes (nothing was
    // acked: the receiver is stopped).
    let live = items_of(&dir.join("relay.db"));
    for (k, hash) in &backup_items {
        assert_eq!(live.get(k), Some(hash), "{k:?}");
    }

    // It opens as a store: a relay serves it.
    let copy = tempfile::tempdir().expect("copy");
    std::fs::copy(&file, copy.path().join("relay.db")).expect("copy");
    let out = relay_cli(
        &["log", "--store-dir", copy.path().to_str().expect("UTF-8")],
        &[],
    );
    out.assert_success();

    // An existing file is refused and untouched; no partial file remains.
    let out = relay_cli(&["backup", &file_s, "--store-dir", &dir_s], &[]);
    assert_eq!(out.code(), Some(1), "{out:#?}");
    assert!(
        out.stderr.contains("already exists") && !out.stderr.contains("EXISTS"),
        "{out:#?}"
    );
    assert_eq!(std::fs::read(&file).expect("read"), bytes);
    let names: Vec<String> = std::fs::read_dir(out_dir.path())
        .expect("ls")
        .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
        .collect();
    assert_eq!(names, ["relay-backup.db"]);

    // Offline, the receipt goes to the relay log.
    mesh.relay.kill();
    let second = out_dir.path().join("second.db");
    let out = relay_cli(
        &[
            "backup",
            second.to_str().expect("UTF-8"),
            "--store-dir",
            &dir_s,
            "--json",
        ],
        &[],
    );
    out.assert_success();
    let r2 = out.json();
    let entries = log_json(&dir_s, "5");
    assert_eq!(entries[0]["op"], "relay-backup");
    assert_eq!(entries[0]["receipt"], r2);
    let out = relay_cli(&["log", "--store-dir", &dir_s, "--limit", "1"], &[]);
    assert!(out.stdout.contains("  relay-backup  "), "{out:#?}");
    assert!(out.stdout.contains("second.db"), "{out:#?}");
}

#[test]
fn a_backup_receipt_is_logged_through_the_admin_endpoint_while_the_relay_serves() {
    let tmp = tempfile::tempdir().expect("temp dir");
    let store = tmp.path().join("store");
    let dir = store.to_str().expect("UTF-8").to_owned();
    let env = [("MBX_RELAY_ADMIN_TOKEN", ADMIN)];
    let relay = serve(&store, &env);
    let url = format!("http://{}", relay.addr);
    let file = tmp.path().join("b.db");
    let out = relay_cli(
        &[
            "backup",
            file.to_str().expect("UTF-8"),
            "--store-dir",
            &dir,
            "--url",
            &url,
            "--json",
        ],
        &env,
    );
    out.assert_success();
    let r = out.json();
    assert!(!out.stderr.contains("not added"), "{out:#?}");
    let entries = log_json(&dir, "5");
    assert_eq!(entries.len(), 1, "{entries:?}");
    assert_eq!(entries[0]["op"], "relay-backup");
    assert_eq!(entries[0]["receipt"], r);
    // A wrong token: the backup is written, the receipt not logged, exit 1.
    let out = relay_cli(
        &[
            "backup",
            tmp.path().join("c.db").to_str().expect("UTF-8"),
            "--store-dir",
            &dir,
            "--url",
            &url,
        ],
        &[("MBX_RELAY_ADMIN_TOKEN", "wrong-token-0123456789abcdef")],
    );
    assert_eq!(out.code(), Some(1), "{out:#?}");
    assert!(out.stderr.contains("not logged"), "{out:#?}");
    assert!(tmp.path().join("c.db").exists());
    assert_eq!(log_json(&dir, "5").len(), 1);
    relay.kill();
}

#[test]
fn a_deleted_relay_lock_never_lets_a_second_writer_onto_a_serving_store() {
    let tmp = tempfile::tempdir().expect("temp dir");
    let store = tmp.path().join("store");
    let dir = store.to_str().expect("UTF-8").to_owned();
    let relay = serve(&store, &[]);
    wait_for("the first heartbeat", || meta(&store, "heartbeat"));
    let epoch = meta(&store, "epoch").expect("epoch");
    std::fs::remove_file(store.join("relay.lock")).expect("rm relay.lock");

    let host = agentmbx_protocol::keys::HostKey::generate()
        .public()
        .to_b64();
    for args in [
        vec!["rotate-epoch", "--store-dir", &dir],
        vec!["deny", "client-x", "--store-dir", &dir],
        vec!["revoke", &host, "--store-dir", &dir],
    ] {
        let out = relay_cli(&args, &[]);
        assert_eq!(out.code(), Some(4), "{args:?}: {out:#?}");
        assert!(out.stderr.contains("no relay.lock"), "{args:?}: {out:#?}");
        // Nothing was left behind: the next writer checks again.
        assert!(!store.join("relay.lock").exists(), "{args:?}");
    }
    let port = free_port().to_string();
    let second = run(command(&[
        "relay",
        "serve",
        "--bind",
        "127.0.0.1",
        "--port",
        &port,
        "--store-dir",
        &dir,
    ]));
    assert_eq!(second.code(), Some(4), "{second:#?}");
    assert!(second.stderr.contains("no relay.lock"), "{second:#?}");
    assert_eq!(meta(&store, "epoch").as_deref(), Some(epoch.as_str()));
    relay.kill();
}

#[test]
fn relay_log_lists_an_unreadable_receipt_and_still_shows_the_rest() {
    let tmp = tempfile::tempdir().expect("temp dir");
    let store = tmp.path().join("store");
    let dir = store.to_str().expect("UTF-8").to_owned();
    serve(&store, &[]).kill();
    for _ in 0..2 {
        relay_cli(&["rotate-epoch", "--store-dir", &dir], &[]).assert_success();
    }
    let c = rusqlite::Connection::open(store.join("relay.db")).expect("open");
    c.execute(
        "UPDATE ops SET receipt = 'garbage' WHERE id = (SELECT MIN(id) FROM ops)",
        [],
    )
    .expect("garble");
    drop(c);
    let out = relay_cli(&["log", "--store-dir", &dir], &[]);
    out.assert_success();
    let lines: Vec<&str> = out.stdout.lines().collect();
    assert_eq!(lines.len(), 2, "{out:#?}");
    assert!(lines[0].contains("relay-epoch-rotated"), "{out:#?}");
    assert!(lines[1].contains("is unreadable"), "{out:#?}");
    assert!(out.stderr.contains("cannot be read"), "{out:#?}");
    let list = log_json(&dir, "10");
    assert_eq!(list.len(), 2);
    assert_eq!(list[0]["verified"], true);
    assert_eq!(list[1]["verified"], false);
    assert!(list[1]["unreadable"].is_string(), "{list:?}");

    // With another relay key at hand (the store was not written by this relay): nothing
    // verifies and a warning names both keys.
    let other = agentmbx_protocol::keys::HostKey::generate();
    let out = relay_cli(
        &["log", "--json", "--store-dir", &dir],
        &[("MBX_RELAY_KEY", &other.seed_b64_secret())],
    );
    out.assert_success();
    assert_eq!(out.json()[0]["verified"], false, "{out:#?}");
    assert!(
        out.stderr.contains("this store records relay key")
            && out.stderr.contains(&other.public().fingerprint()),
        "{out:#?}"
    );
}

/// A start after a killed relay (SIGKILL: no final checkpoint, relay.db-wal left behind) logs
/// one WARN line saying the previous run did not stop cleanly, naming the killed process and
/// what recovery did; what the killed relay committed is there. A clean restart logs no such
/// line, and neither start logs `migrated_from` (the schema was already current).
#[test]
fn a_start_after_a_killed_relay_says_what_recovery_did_and_a_clean_restart_says_nothing() {
    const UNCLEAN: &str = "previous run did not stop cleanly";
    let tmp = tempfile::tempdir().expect("temp dir");
    let store = tmp.path().join("store");
    let env = [("MBX_RELAY_ADMIN_TOKEN", ADMIN)];

    let relay = serve(&store, &env);
    let url = format!("http://{}", relay.addr);
    relay_cli(&["deny", "client-x", "--client", "--url", &url], &env).assert_success();
    let pid = relay.pid();
    let first = relay.kill();
    assert!(!first.contains(UNCLEAN), "{first}");
    let wal = std::fs::metadata(store.join("relay.db-wal")).map_or(0, |m| m.len());
    assert!(wal > 0, "a killed relay leaves its WAL");

    let relay = serve(&store, &env);
    let log = relay.stderr();
    let lines: Vec<&str> = log.lines().filter(|l| l.contains(UNCLEAN)).collect();
    assert_eq!(lines.len(), 1, "{log}");
    let line = lines[0];
    for part in [
        "WARN",
        &format!("{wal} bytes left in relay.db-wal"),
        &format!("relay.lock last taken by pid {pid}"),
        "recovered: ",
        "committed WAL frames replayed into relay.db",
    ] {
        assert!(line.contains(part), "{part:?} missing in {line}");
    }
    let frames: u64 = line
        .split("recovered: ")
        .nth(1)
        .and_then(|r| r.split(' ').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no frame count in {line}"));
    assert!(frames > 0, "{line}");
    assert!(!log.contains("migrated_from"), "{log}");
    // The killed relay's last committed write is there.
    let url = format!("http://{}", relay.addr);
    let out = relay_cli(&["deny", "--list", "--url", &url, "--json"], &env);
    out.assert_success();
    assert!(out.stdout.contains("client-x"), "{out:#?}");
    let (status, _) = relay.terminate();
    assert!(status.success(), "{status:?}");

    // A clean stop, then a start: nothing to say.
    let relay = serve(&store, &env);
    let log = relay.stderr();
    assert!(log.contains("relay store opened"), "{log}");
    assert!(!log.contains(UNCLEAN), "{log}");
    assert!(!log.contains("migrated_from"), "{log}");
    let (status, _) = relay.terminate();
    assert!(status.success(), "{status:?}");
}
