//! `agentmbx relay status` against the real binary (spec §5, §7; `wire.md` §3.4): a relay
//! serves two hosts, mail waits in the queue of the stopped receiver, and the operator reads the
//! store while the relay serves (JSON and text), then on the stopped store after an offline
//! backup; it creates nothing and never needs the lock. A missing store exits 3.

use std::path::Path;

use serde_json::Value;

use agentmbx_protocol::keys::PublicKey;
use agentmbx_protocol::time::iso_ms;

use crate::helper::mesh::{open_read_only, Mesh};
use crate::helper::{command, run, wait_for, Output};

fn relay_cli(args: &[&str]) -> Output {
    let mut full = vec!["relay"];
    full.extend_from_slice(args);
    run(command(&full))
}

/// The names in a directory, sorted.
fn names(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir)
        .expect("ls")
        .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
        .collect();
    v.sort();
    v
}

/// `(items, bytes, oldest accepted_at, epoch, heartbeat)` straight from `relay.db`.
fn store_facts(dir: &Path) -> (i64, i64, i64, String, i64) {
    let c = open_read_only(&dir.join("relay.db"));
    let (items, bytes, oldest) = c
        .query_row(
            "SELECT COUNT(*), SUM(bytes), MIN(accepted_at) FROM items",
            [],
            |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)),
        )
        .expect("items");
    let meta = |k: &str| -> String {
        c.query_row("SELECT v FROM meta WHERE k = ?1", [k], |r| r.get(0))
            .expect("meta")
    };
    let heartbeat = meta("heartbeat").parse().expect("heartbeat ms");
    (items, bytes, oldest, meta("epoch"), heartbeat)
}

#[test]
fn relay_status_reads_a_serving_store_and_a_stopped_one_and_creates_nothing() {
    let mut mesh = Mesh::start(None);
    // The receiver is stopped: what the relay accepts for it stays queued.
    mesh.b.stop();
    let dir = mesh.relay.store_dir();
    let dir_s = dir.to_str().expect("UTF-8").to_owned();
    for i in 0..3 {
        mesh.a
            .send("alice", "bob@hostb", &format!("queued {i}"), "x");
    }
    wait_for("three items queued for hostb", || {
        (mesh.relay.items_for(&mesh.b.pubkey).len() == 3).then_some(())
    });
    wait_for("the relay's heartbeat", || {
        open_read_only(&dir.join("relay.db"))
            .query_row("SELECT v FROM meta WHERE k = 'heartbeat'", [], |r| {
                r.get::<_, String>(0)
            })
            .ok()
    });
    let b_fp = PublicKey::from_b64(&mesh.b.pubkey)
        .expect("key")
        .fingerprint();

    // While the relay serves (it holds relay.lock): JSON.
    let before = names(&dir);
    let out = relay_cli(&["status", "--store-dir", &dir_s, "--json"]);
    out.assert_success();
    let j = out.json();
    let (items, bytes, oldest, epoch, heartbeat) = store_facts(&dir);
    assert_eq!(items, 3);
    assert_eq!(j["v"], 1);
    assert!(
        j["store"]
            .as_str()
            .expect("store")
            .ends_with("/store/relay.db"),
        "{j}"
    );
    assert_eq!(j["schema_version"], agentmbx_relay::store::SCHEMA_VERSION);
    assert_eq!(j["relay_fingerprint"], mesh.relay.fingerprint.as_str());
    assert_eq!(j["epoch"], epoch.as_str());
    assert_eq!(j["hosts"], serde_json::json!({"enrolled": 2, "revoked": 0}));
    let q = &j["queue"];
    assert_eq!(q["items"], 3);
    assert_eq!(q["bytes"], bytes);
    assert_eq!(q["targets"], 1);
    assert_eq!(q["oldest_at"], iso_ms(oldest).as_str());
    assert!(q["oldest_age_ms"].as_i64().expect("age") >= 0, "{j}");
    let deepest = q["deepest"].as_array().expect("deepest");
    assert_eq!(deepest.len(), 1, "{j}");
    assert_eq!(deepest[0]["host"], "hostb");
    assert_eq!(deepest[0]["host_pubkey"], mesh.b.pubkey.as_str());
    assert_eq!(deepest[0]["fingerprint"], b_fp.as_str());
    assert_eq!(deepest[0]["revoked"], false);
    assert_eq!(deepest[0]["items"], 3);
    assert_eq!(deepest[0]["bytes"], bytes);
    assert_eq!(deepest[0]["oldest_at"], iso_ms(oldest).as_str());
    // The heartbeat may have moved on between the two reads; it is never older than ours.
    let hb = j["heartbeat"]["at"].as_str().expect("heartbeat at");
    assert!(hb <= iso_ms(heartbeat).as_str(), "{hb} after {heartbeat}");
    assert!(j["heartbeat"]["age_ms"].is_i64(), "{j}");
    assert_eq!(j["last_backup"], Value::Null);
    let dedup: i64 = open_read_only(&dir.join("relay.db"))
        .query_row("SELECT COUNT(*) FROM dedup", [], |r| r.get(0))
        .expect("dedup");
    assert!(j["dedup_rows"].as_i64().expect("dedup rows") <= dedup);
    assert!(j["dedup_rows"].as_i64().expect("dedup rows") >= 3);

    // Text.
    let out = relay_cli(&["status", "--store-dir", &dir_s]);
    out.assert_success();
    for want in [
        "hosts        2 enrolled, 0 revoked\n".to_owned(),
        format!("epoch        {epoch}\n"),
        format!("relay key    fingerprint {}\n", mesh.relay.fingerprint),
        "queued       3 items, ".to_owned(),
        format!("hostb  {b_fp}  3 items  "),
        "last backup  none in the relay log\n".to_owned(),
    ] {
        assert!(
            out.stdout.contains(&want),
            "{want:?} missing:\n{}",
            out.stdout
        );
    }
    assert!(out.stdout.contains("heartbeat    20"), "{}", out.stdout);
    // --top bounds.
    let out = relay_cli(&["status", "--store-dir", &dir_s, "--json", "--top", "0"]);
    out.assert_success();
    assert_eq!(out.json()["queue"]["deepest"], serde_json::json!([]));
    let out = relay_cli(&["status", "--store-dir", &dir_s, "--top", "1001"]);
    assert_eq!(out.code(), Some(2), "{out:#?}");
    assert_eq!(names(&dir), before, "status created nothing");

    // The relay stops; an offline backup logs its receipt; status shows it, creating nothing
    // on the stopped store either.
    mesh.relay.kill();
    let out_dir = tempfile::tempdir().expect("out");
    let file = out_dir.path().join("relay-1.db");
    let file_s = file.to_str().expect("UTF-8").to_owned();
    let out = relay_cli(&["backup", &file_s, "--store-dir", &dir_s, "--json"]);
    out.assert_success();
    let receipt = out.json();
    let before = names(&dir);
    let db_bytes = std::fs::read(dir.join("relay.db")).expect("read relay.db");
    let out = relay_cli(&["status", "--store-dir", &dir_s, "--json"]);
    out.assert_success();
    let j = out.json();
    assert_eq!(j["last_backup"]["file"], file_s.as_str());
    assert_eq!(j["last_backup"]["bytes"], receipt["bytes"]);
    assert!(j["last_backup"]["age_ms"].as_i64().expect("age") >= 0);
    assert_eq!(j["queue"]["items"], 3);
    assert_eq!(j["epoch"], epoch.as_str());
    assert_eq!(names(&dir), before, "status created nothing");
    assert_eq!(
        std::fs::read(dir.join("relay.db")).expect("read relay.db"),
        db_bytes,
        "status wrote nothing"
    );
    let out = relay_cli(&["status", "--store-dir", &dir_s]);
    out.assert_success();
    assert!(
        out.stdout.contains(&format!("): {file_s} (")),
        "{}",
        out.stdout
    );
}

#[test]
fn relay_status_of_a_missing_store_exits_3_and_creates_nothing() {
    let tmp = tempfile::tempdir().expect("temp dir");
    let missing = tmp.path().join("nowhere");
    let out = relay_cli(&["status", "--store-dir", missing.to_str().expect("UTF-8")]);
    assert_eq!(out.code(), Some(3), "{out:#?}");
    assert!(out.stderr.contains("holds no relay store"), "{out:#?}");
    assert!(out.stdout.is_empty(), "{out:#?}");
    assert!(!missing.exists(), "the store directory was created");
    let out = relay_cli(&[
        "status",
        "--store-dir",
        tmp.path().to_str().expect("UTF-8"),
        "--json",
    ]);
    assert_eq!(out.code(), Some(3), "{out:#?}");
    assert!(names(tmp.path()).is_empty(), "nothing created");
}
