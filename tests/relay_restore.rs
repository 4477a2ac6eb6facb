//! Relay restore against the real binary (spec §5 "Restore from backup"; `wire.md` §3.4):
//! the restore drill (a relay under traffic between two hosts is backed up while serving,
//! more mail flows, the relay is stopped, restored and restarted: every message ends up
//! delivered exactly once, the epoch changed, the hosts enrolled again and republished their
//! enc-key ad), `relay restore` refused while the relay serves, `--force` over an unreadable
//! store, the rollback copy, what a restore carries forward (a revocation and a deny-list entry
//! made after the backup) and what it does not (an enrolment made after it), a restore killed
//! before its rename, `MBX_RELAY_RESTORE_FROM` once per path, and the signed op receipts of the
//! relay log. Also: a store brought back by a plain file copy without `rotate-epoch` (the
//! hosts see the rewind through `head_seq` and every message still arrives once), a host
//! enrolled after the backup enrolling again by itself, offline commands without the relay
//! key (done, with unsigned receipts), and the receipt of a backup taken while the relay
//! serves, logged through its admin endpoint without `--url`.

use crate::helper;

use std::path::Path;

use serde_json::Value;

use crate::helper::mesh::{open_read_only, Host, Mesh};
use crate::helper::relay_cli::{meta, relay_cli, serve, ADMIN};
use crate::helper::{command, run, wait_for, Output};

fn s(path: &Path) -> &str {
    path.to_str().expect("UTF-8 path")
}

/// `relay log --json` of `store`, newest first.
fn log_json(store: &Path) -> Vec<Value> {
    let out = relay_cli(
        &["log", "--json", "--limit", "1000", "--store-dir", s(store)],
        &[],
    );
    out.assert_success();
    out.json().as_array().expect("array").clone()
}

/// `relay restore <file> --store-dir <store> --json [extra]`.
fn restore(store: &Path, file: &Path, extra: &[&str]) -> Output {
    let mut args = vec!["restore", s(file), "--store-dir", s(store), "--json"];
    args.extend_from_slice(extra);
    relay_cli(&args, &[])
}

/// Rows of `sql` (one text parameter) in `store`'s relay.db.
fn count(store: &Path, sql: &str, param: &str) -> i64 {
    open_read_only(&store.join("relay.db"))
        .query_row(sql, [param], |r| r.get(0))
        .unwrap_or_else(|e| panic!("{sql}: {e}"))
}

/// Sends `n` messages from `from`'s agent to `to_addr`; returns their ids.
fn send_n(from: &Host, agent: &str, to_addr: &str, what: &str, n: usize) -> Vec<String> {
    (0..n)
        .map(|i| {
            let sent = from.send(agent, to_addr, &format!("{what} {i}"), "restore drill");
            sent["id"].as_str().expect("id").to_string()
        })
        .collect()
}

/// Waits until `host` stores every one of `ids`.
fn wait_stored(host: &Host, ids: &[String]) {
    for id in ids {
        wait_for(&format!("{id} stored at {}", host.name), || {
            (host.messages_with_id(id) == 1).then_some(())
        });
    }
}

/// Waits until every one of `ids` is queued at the relay for `mesh.b`.
fn wait_queued(mesh: &Mesh, ids: &[String]) {
    for id in ids {
        wait_for(&format!("{id} queued at the relay for B"), || {
            mesh.relay
                .items_for(&mesh.b.pubkey)
                .iter()
                .any(|(_, i)| i == id)
                .then_some(())
        });
    }
}

/// How many `relay.enrolled` audit events of `host` name `epoch`.
fn enrolled_in(host: &Host, epoch: &str) -> i64 {
    host.db()
        .query_row(
            "SELECT COUNT(*) FROM audit WHERE event = 'relay.enrolled'
               AND json_extract(detail, '$.epoch') = ?1",
            [epoch],
            |r| r.get(0),
        )
        .expect("audit")
}

#[test]
fn the_restore_drill_delivers_every_message_before_and_after_the_backup_exactly_once() {
    let mut mesh = Mesh::start(None);
    let store = mesh.relay.store_dir();
    let url = mesh.relay.url();
    let out_dir = tempfile::tempdir().expect("out");
    let backup = out_dir.path().join("drill.db");

    // Delivered before the backup, both ways.
    let mut to_b = send_n(&mesh.a, "alice", "bob@hostb", "delivered before", 3);
    let mut to_a = send_n(&mesh.b, "bob", "alice@hosta", "delivered before", 1);
    wait_stored(&mesh.b, &to_b);
    wait_stored(&mesh.a, &to_a);

    // Queued at the relay when the backup is taken (B is stopped), then delivered.
    mesh.b.stop();
    let queued = send_n(&mesh.a, "alice", "bob@hostb", "queued at the backup", 3);
    wait_queued(&mesh, &queued);
    // The backup runs while A keeps sending: each of these may or may not be in it.
    let (a_addr, a_token) = (mesh.a.daemon().addr, mesh.a.home.token());
    let traffic = std::thread::spawn(move || {
        (0..4)
            .map(|i| {
                let body = serde_json::json!({"from": "alice", "to": ["bob@hostb"],
                                              "subject": format!("during the backup {i}"),
                                              "body": "restore drill"})
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
                r.json()["id"].as_str().expect("id").to_string()
            })
            .collect::<Vec<String>>()
    });
    let out = relay_cli(
        &["backup", s(&backup), "--store-dir", s(&store), "--json"],
        &[],
    );
    let during = traffic.join().expect("traffic");
    out.assert_success();
    let backup_epoch = out.json()["epoch"].as_str().expect("epoch").to_string();
    wait_queued(&mesh, &during);
    to_b.extend(queued);
    to_b.extend(during);
    mesh.b.start(None);
    wait_stored(&mesh.b, &to_b);
    // Mail after the backup: delivered before the restore (B → A) and still queued at the
    // relay when it stops (A → B, B stopped again): the restore loses both from the relay.
    let after_ba = send_n(&mesh.b, "bob", "alice@hosta", "after the backup", 2);
    wait_stored(&mesh.a, &after_ba);
    to_a.extend(after_ba);
    mesh.b.stop();
    let after_ab = send_n(&mesh.a, "alice", "bob@hostb", "after the backup", 3);
    wait_queued(&mesh, &after_ab);
    to_b.extend(after_ab.clone());
    let a_ads_before = mesh.a.log().matches("published the enc-key ad").count();

    // Stop, restore, restart.
    mesh.relay.kill();
    let out = restore(&store, &backup, &[]);
    out.assert_success();
    let r = out.json();
    assert_eq!(r["type"], "relay-restore");
    assert_eq!(r["epoch"]["from"], backup_epoch.as_str());
    let epoch = r["epoch"]["to"].as_str().expect("to").to_string();
    assert_ne!(epoch, backup_epoch);
    assert_eq!(meta(&store, "epoch").as_deref(), Some(epoch.as_str()));
    // The restored queue for B is the backup's: the mail queued after it is gone from the
    // relay, and only its sender can bring it back.
    let restored: Vec<String> = mesh
        .relay
        .items_for(&mesh.b.pubkey)
        .into_iter()
        .map(|(_, id)| id)
        .collect();
    for id in &to_b[3..6] {
        assert!(restored.contains(id), "{id} not in {restored:?}");
    }
    for id in &after_ab {
        assert!(!restored.contains(id), "{id} in {restored:?}");
    }
    mesh.relay.launch(None);
    mesh.b.start(None);

    // Every message ends up stored exactly once at its receiver (and its sender, which keeps
    // its own copy), and nothing else.
    wait_stored(&mesh.b, &to_b);
    wait_stored(&mesh.a, &to_a);
    mesh.wait_queue_drained(&mesh.b);
    mesh.wait_queue_drained(&mesh.a);
    let all: Vec<&String> = to_b.iter().chain(&to_a).collect();
    for host in [&mesh.a, &mesh.b] {
        for id in &all {
            assert_eq!(host.messages_with_id(id), 1, "{id} at {}", host.name);
        }
        assert_eq!(
            host.message_count(),
            all.len() as i64,
            "{} stores each message once",
            host.name
        );
        assert_eq!(host.quarantined(), 0);
    }
    for id in &to_b {
        assert_eq!(mesh.b.deliveries_of(id), 1, "{id} delivered once to bob");
    }
    for id in &to_a {
        assert_eq!(mesh.a.deliveries_of(id), 1, "{id} delivered once to alice");
    }

    // Both hosts moved to the new epoch, enrolled again in it and republished their ad.
    for host in [&mesh.a, &mesh.b] {
        wait_for(&format!("{} at the new epoch", host.name), || {
            host.position(&url).filter(|p| p.epoch == epoch)
        });
        wait_for(&format!("{} enrolled in the new epoch", host.name), || {
            (enrolled_in(host, &epoch) >= 1).then_some(())
        });
    }
    wait_for("A to republish its enc-key ad", || {
        (mesh.a.log().matches("published the enc-key ad").count() > a_ads_before).then_some(())
    });
    mesh.b.daemon().wait_for_stderr("published the enc-key ad");
    for host in [&mesh.a, &mesh.b] {
        assert_eq!(
            count(
                &store,
                "SELECT COUNT(*) FROM enrolments WHERE host_pubkey = ?1 AND revoked_at IS NULL",
                &host.pubkey
            ),
            1
        );
    }

    // The restore is in the relay log, signed.
    let entries = log_json(&store);
    let restored = entries
        .iter()
        .find(|e| e["op"] == "relay-restore")
        .expect("restore logged");
    assert_eq!(restored["receipt"], r);
    assert_eq!(restored["verified"], true);
}

#[test]
fn restore_is_refused_while_the_relay_serves_and_changes_nothing() {
    let tmp = tempfile::tempdir().expect("temp dir");
    let store = tmp.path().join("store");
    let backup = tmp.path().join("b.db");
    let relay = serve(&store, &[]);
    relay_cli(&["backup", s(&backup), "--store-dir", s(&store)], &[]).assert_success();
    let epoch = meta(&store, "epoch").expect("epoch");
    let ops_before = log_json(&store).len();

    let out = restore(&store, &backup, &[]);
    assert_eq!(out.code(), Some(4), "{out:#?}");
    assert!(out.stderr.contains("RELAY_RUNNING"), "{out:#?}");
    assert!(out.stderr.contains("stop it first"), "{out:#?}");
    // --force does not override a held lock.
    let out = restore(&store, &backup, &["--force"]);
    assert_eq!(out.code(), Some(4), "{out:#?}");
    assert_eq!(meta(&store, "epoch").as_deref(), Some(epoch.as_str()));
    assert_eq!(meta(&store, "restored"), None);
    assert_eq!(log_json(&store).len(), ops_before);
    let mut names: Vec<String> = std::fs::read_dir(&store)
        .expect("ls")
        .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    assert!(
        names
            .iter()
            .all(|n| !n.starts_with("rollback") && !n.contains("restore")),
        "{names:?}"
    );
    // The relay still serves.
    assert_eq!(relay.get("/v2/relay/info", None).status, 200);
    relay.kill();

    // Stopped: restored. A missing backup file: exit 3.
    let out = restore(&store, &backup, &[]);
    out.assert_success();
    assert_ne!(meta(&store, "epoch").as_deref(), Some(epoch.as_str()));
    let out = restore(&store, &tmp.path().join("none.db"), &[]);
    assert_eq!(out.code(), Some(3), "{out:#?}");
    assert!(out.stderr.contains("NO_BACKUP"), "{out:#?}");
}

#[test]
fn force_restores_over_an_unreadable_store_and_keeps_it_for_a_rollback() {
    let tmp = tempfile::tempdir().expect("temp dir");
    let store = tmp.path().join("store");
    let backup = tmp.path().join("b.db");
    let (status, _) = serve(&store, &[]).terminate();
    assert!(status.success());
    relay_cli(&["backup", s(&backup), "--store-dir", s(&store)], &[]).assert_success();
    let junk: Vec<u8> = (0..32_768u32).map(|i| (i % 251) as u8).collect();
    std::fs::write(store.join("relay.db"), &junk).expect("damage the store");

    let out = restore(&store, &backup, &[]);
    assert_eq!(out.code(), Some(1), "{out:#?}");
    assert!(out.stderr.contains("CURRENT_UNREADABLE"), "{out:#?}");
    assert!(out.stderr.contains("--force"), "{out:#?}");
    assert_eq!(std::fs::read(store.join("relay.db")).expect("read"), junk);

    let out = restore(&store, &backup, &["--force"]);
    out.assert_success();
    let r = out.json();
    assert_eq!(r["replaced"]["readable"], false);
    let rollback = r["replaced"]["rollback"].as_str().expect("rollback");
    assert!(
        rollback.starts_with(s(&store.join("rollback").join("relay-"))),
        "{rollback}"
    );
    assert_eq!(std::fs::read(rollback).expect("rollback copy"), junk);
    assert!(
        r["rollback"].as_str().expect("undo").ends_with(" --force"),
        "{r}"
    );
    // The restored store serves, in the receipt's epoch.
    let relay = serve(&store, &[]);
    assert_eq!(meta(&store, "epoch").as_deref(), r["epoch"]["to"].as_str());
    relay.kill();
}

#[test]
fn a_revocation_and_a_deny_entry_survive_a_restore_a_later_enrolment_does_not_and_the_rollback_brings_it_back(
) {
    let mut mesh = Mesh::start(None);
    let store = mesh.relay.store_dir();
    let out_dir = tempfile::tempdir().expect("out");
    let backup = out_dir.path().join("b.db");
    relay_cli(&["backup", s(&backup), "--store-dir", s(&store)], &[]).assert_success();

    // After the backup: a third host enrols (then stops)…
    let mut c = Host::init("hostc");
    c.home
        .run(&[
            "relay",
            "set",
            &mesh.relay.url(),
            "--key",
            &mesh.relay.fingerprint,
        ])
        .assert_success();
    c.start(None);
    c.daemon().wait_for_stderr("enrolled with the relay");
    c.stop();
    assert_eq!(
        count(
            &store,
            "SELECT COUNT(*) FROM enrolments WHERE host_pubkey = ?1",
            &c.pubkey
        ),
        1
    );
    // …and, on the stopped relay, the operator revokes A and deny-lists a fingerprint.
    mesh.relay.kill();
    relay_cli(&["revoke", &mesh.a.pubkey, "--store-dir", s(&store)], &[]).assert_success();
    let fp = "0123-4567-89ab-cdef";
    relay_cli(&["deny", fp, "--store-dir", s(&store)], &[]).assert_success();

    let out = restore(&store, &backup, &[]);
    out.assert_success();
    let r = out.json();
    assert_eq!(r["carried"]["revocations"], 1, "{r}");
    assert_eq!(r["carried"]["deny"], 1, "{r}");
    let revoked =
        "SELECT COUNT(*) FROM enrolments WHERE host_pubkey = ?1 AND revoked_at IS NOT NULL";
    assert_eq!(count(&store, revoked, &mesh.a.pubkey), 1, "A stays revoked");
    assert_eq!(
        count(&store, "SELECT COUNT(*) FROM deny WHERE value = ?1", fp),
        1,
        "the deny entry survives"
    );
    assert_eq!(
        count(
            &store,
            "SELECT COUNT(*) FROM enrolments WHERE host_pubkey = ?1",
            &c.pubkey
        ),
        0,
        "an enrolment made after the backup is not carried"
    );
    assert_eq!(
        count(
            &store,
            "SELECT COUNT(*) FROM enrolments WHERE host_pubkey = ?1 AND revoked_at IS NULL",
            &mesh.b.pubkey
        ),
        1
    );
    // The text of the relay log says what the restore did.
    let text = relay_cli(&["log", "--store-dir", s(&store), "--limit", "1"], &[]);
    text.assert_success();
    assert!(text.stdout.contains("  relay-restore  "), "{text:#?}");
    assert!(text.stdout.contains(s(&backup)), "{text:#?}");
    assert!(text.stdout.contains("  relay-restore  ✔ "), "{text:#?}");

    // The receipt's rollback command brings the replaced store back (C enrolled), as a
    // restore of its own: a new epoch, and A still revoked, the entry still there.
    let undo = r["rollback"].as_str().expect("rollback command");
    let words: Vec<&str> = undo.split(' ').collect();
    assert_eq!(&words[..3], ["agentmbx", "relay", "restore"], "{undo}");
    let mut cmd = command(&words[1..]);
    cmd.arg("--json");
    let out = run(cmd);
    out.assert_success();
    let r2 = out.json();
    assert_ne!(r2["epoch"]["to"], r["epoch"]["to"]);
    assert_eq!(
        count(
            &store,
            "SELECT COUNT(*) FROM enrolments WHERE host_pubkey = ?1",
            &c.pubkey
        ),
        1
    );
    assert_eq!(count(&store, revoked, &mesh.a.pubkey), 1);
    assert_eq!(
        count(&store, "SELECT COUNT(*) FROM deny WHERE value = ?1", fp),
        1
    );
    mesh.relay.launch(None);
}

#[test]
fn mbx_relay_restore_from_restores_once_per_path_and_a_failure_serves_the_current_store() {
    let tmp = tempfile::tempdir().expect("temp dir");
    let store = tmp.path().join("store");
    let backup = tmp.path().join("b.db");
    let relay = serve(&store, &[]);
    relay_cli(&["backup", s(&backup), "--store-dir", s(&store)], &[]).assert_success();
    relay.kill();
    let epoch0 = meta(&store, "epoch").expect("epoch");

    // First start with the variable: restored under the relay's lock, before it serves.
    let env = [("MBX_RELAY_RESTORE_FROM", s(&backup))];
    let relay = serve(&store, &env);
    let log = relay.stderr();
    assert!(log.contains("restored "), "{log}");
    assert!(log.contains("at start: epoch"), "{log}");
    assert!(log.contains("unset MBX_RELAY_RESTORE_FROM"), "{log}");
    let epoch1 = meta(&store, "epoch").expect("epoch");
    assert_ne!(epoch1, epoch0);
    let paths: Value =
        serde_json::from_str(&meta(&store, "restored_paths").expect("paths")).expect("json");
    assert!(paths.get(s(&backup)).is_some(), "{paths}");
    relay.kill();
    let restores = |store: &Path| {
        log_json(store)
            .iter()
            .filter(|e| e["op"] == "relay-restore" && e["verified"] == true)
            .count()
    };
    assert_eq!(restores(&store), 1);

    // Restarted with the same variable: ignored, the same epoch, no second restore.
    let relay = serve(&store, &env);
    let log = relay.stderr();
    assert!(log.contains("ignored: already restored from"), "{log}");
    assert_eq!(meta(&store, "epoch").as_deref(), Some(epoch1.as_str()));
    relay.kill();
    assert_eq!(restores(&store), 1);

    // A path that cannot be restored: logged, and the current store is served unchanged.
    let missing = tmp.path().join("missing.db");
    let relay = serve(&store, &[("MBX_RELAY_RESTORE_FROM", s(&missing))]);
    let log = relay.stderr();
    assert!(log.contains("was not restored"), "{log}");
    assert!(log.contains("serving the current store unchanged"), "{log}");
    assert_eq!(relay.get("/v2/relay/info", None).status, 200);
    assert_eq!(meta(&store, "epoch").as_deref(), Some(epoch1.as_str()));
    relay.kill();
    assert_eq!(restores(&store), 1);
}

#[test]
fn every_op_receipt_verifies_with_the_relay_key_and_a_tampered_one_does_not() {
    let tmp = tempfile::tempdir().expect("temp dir");
    let store = tmp.path().join("store");
    let env = [("MBX_RELAY_ADMIN_TOKEN", ADMIN)];

    // Receipts written by the serving relay: a backup receipt through the admin endpoint and
    // an operator rotation.
    let relay = serve(&store, &env);
    let url = format!("http://{}", relay.addr);
    let b1 = tmp.path().join("b1.db");
    let out = relay_cli(
        &[
            "backup",
            s(&b1),
            "--store-dir",
            s(&store),
            "--url",
            &url,
            "--json",
        ],
        &env,
    );
    out.assert_success();
    let printed = out.json();
    relay_cli(&["rotate-epoch", "--url", &url], &env).assert_success();
    relay.kill();
    // And offline: a rotation, a deny entry, a backup, a restore.
    relay_cli(&["rotate-epoch", "--store-dir", s(&store)], &[]).assert_success();
    relay_cli(
        &["deny", "client-x", "--client", "--store-dir", s(&store)],
        &[],
    )
    .assert_success();
    let b2 = tmp.path().join("b2.db");
    relay_cli(&["backup", s(&b2), "--store-dir", s(&store)], &[]).assert_success();
    restore(&store, &b1, &[]).assert_success();

    let entries = log_json(&store);
    let ops: Vec<&str> = entries
        .iter()
        .map(|e| e["op"].as_str().expect("op"))
        .collect();
    assert_eq!(
        ops,
        [
            "relay-restore",
            "relay-backup",
            "relay-deny",
            "relay-epoch-rotated",
            "relay-epoch-rotated",
            "relay-backup"
        ]
    );
    // What `relay backup` printed is what the log holds, signed.
    assert_eq!(entries[5]["receipt"], printed);
    // Each `sig` is the relay key's signature over the canonical receipt without it, checked
    // here independently of the binary.
    let relay_pubkey = meta(&store, "relay_pubkey").expect("relay key");
    let key = agentmbx_protocol::keys::PublicKey::from_b64(&relay_pubkey).expect("key");
    for e in &entries {
        assert_eq!(e["verified"], true, "{e}");
        let mut receipt = e["receipt"].clone();
        let sig = receipt["sig"].as_str().expect("sig").to_string();
        receipt.as_object_mut().expect("object").remove("sig");
        let text = agentmbx_protocol::canonical::to_string(&receipt).expect("canonical");
        assert!(key.verify(text.as_bytes(), &sig), "{e}");
    }

    // One altered receipt no longer verifies: marked in the text, false in JSON, a warning.
    let raw = rusqlite::Connection::open(store.join("relay.db")).expect("open");
    let changed = raw
        .execute(
            "UPDATE ops SET receipt = replace(receipt, 'client-x', 'client-y')
              WHERE op = 'relay-deny'",
            [],
        )
        .expect("tamper");
    assert_eq!(changed, 1);
    drop(raw);
    let entries = log_json(&store);
    let verified: Vec<bool> = entries
        .iter()
        .map(|e| e["verified"].as_bool().expect("verified"))
        .collect();
    assert_eq!(verified, [true, true, false, true, true, true]);
    let text = relay_cli(&["log", "--store-dir", s(&store)], &[]);
    text.assert_success();
    let line = text
        .stdout
        .lines()
        .find(|l| l.contains("  relay-deny  "))
        .expect("deny line");
    assert!(line.contains("  relay-deny  ✗ NOT VERIFIED: "), "{line}");
    assert_eq!(text.stdout.matches("  ✔ ").count(), 5, "{text:#?}");
    assert!(text.stderr.contains("1 receipt(s)"), "{text:#?}");
}

#[test]
fn a_restore_killed_before_the_rename_leaves_the_store_as_it_was() {
    let tmp = tempfile::tempdir().expect("temp dir");
    let store = tmp.path().join("store");
    let backup = tmp.path().join("b.db");
    let relay = serve(&store, &[]);
    relay_cli(&["backup", s(&backup), "--store-dir", s(&store)], &[]).assert_success();
    relay.kill();
    let epoch = meta(&store, "epoch").expect("epoch");
    let ops = log_json(&store).len();

    let out = relay_cli(
        &["restore", s(&backup), "--store-dir", s(&store)],
        &[("MBX_FAILPOINTS", "restore:before-rename=abort")],
    );
    assert!(!out.status.success(), "{out:#?}");
    assert!(
        out.stderr
            .contains("FAILPOINT restore:before-rename reached"),
        "{out:#?}"
    );
    // The live store is the old one, whole; the working copy is left behind.
    assert_eq!(meta(&store, "epoch").as_deref(), Some(epoch.as_str()));
    assert_eq!(meta(&store, "restored"), None);
    assert_eq!(log_json(&store).len(), ops);
    let leftovers = |store: &Path| {
        std::fs::read_dir(store)
            .expect("ls")
            .filter(|e| {
                e.as_ref()
                    .expect("entry")
                    .file_name()
                    .to_string_lossy()
                    .starts_with("relay.db.restore-")
            })
            .count()
    };
    assert_eq!(leftovers(&store), 1);

    // The next restore completes and removes it.
    let out = restore(&store, &backup, &[]);
    out.assert_success();
    assert_eq!(leftovers(&store), 0);
    assert_eq!(
        meta(&store, "epoch").as_deref(),
        out.json()["epoch"]["to"].as_str()
    );
}

/// How many `relay.epoch_changed` audit events of `host` say `why` (`epoch` or `rewind`).
fn epoch_changes(host: &Host, why: &str) -> i64 {
    host.db()
        .query_row(
            "SELECT COUNT(*) FROM audit WHERE event = 'relay.epoch_changed'
               AND json_extract(detail, '$.why') = ?1",
            [why],
            |r| r.get(0),
        )
        .expect("audit")
}

/// Waits until `host`'s outbox row of each of `ids` is `delivered` (its receipt came back).
fn wait_delivered(host: &Host, ids: &[String]) {
    for id in ids {
        wait_for(&format!("{id} delivered from {}", host.name), || {
            host.outbox(id)
                .filter(|r| r.state == "delivered")
                .map(|_| ())
        });
    }
}

/// `head_seq` of `target` in the relay store file `db` (`next_seq − 1`, 0 if none).
fn head_in(db: &Path, target: &str) -> i64 {
    open_read_only(db)
        .query_row(
            "SELECT COALESCE((SELECT next_seq - 1 FROM seqs WHERE target_pubkey = ?1), 0)",
            [target],
            |r| r.get(0),
        )
        .expect("head")
}

/// Spec §5: a restore by any other means than `relay restore` (here a plain file copy) that
/// is not followed by `rotate-epoch` keeps its epoch. Hosts whose checkpoint is above the
/// restored head and that pull before anything is pushed to them see `head_seq <
/// received_through`, handle it as a new epoch (re-pull from 0, re-push what the relay
/// accepted and the recipient has not confirmed), and every message is delivered exactly once;
/// the seq floor keeps every later item above the old checkpoints.
#[test]
fn a_file_copy_restore_without_rotate_epoch_is_seen_as_a_rewind_and_every_message_arrives_once() {
    let mut mesh = Mesh::start(None);
    let store = mesh.relay.store_dir();
    let url = mesh.relay.url();
    let out_dir = tempfile::tempdir().expect("out");
    let backup = out_dir.path().join("copy.db");

    // Before the backup: both ways, confirmed, both queues empty.
    let mut to_b = send_n(&mesh.a, "alice", "bob@hostb", "before the copy", 2);
    let mut to_a = send_n(&mesh.b, "bob", "alice@hosta", "before the copy", 1);
    wait_stored(&mesh.b, &to_b);
    wait_stored(&mesh.a, &to_a);
    wait_delivered(&mesh.a, &to_b);
    wait_delivered(&mesh.b, &to_a);
    mesh.wait_queue_drained(&mesh.a);
    mesh.wait_queue_drained(&mesh.b);
    let out = relay_cli(
        &["backup", s(&backup), "--store-dir", s(&store), "--json"],
        &[],
    );
    out.assert_success();
    let epoch = out.json()["epoch"].as_str().expect("epoch").to_string();

    // After it: both hosts receive more, so both checkpoints pass the heads the copy holds.
    let after_ab = send_n(&mesh.a, "alice", "bob@hostb", "after the copy", 2);
    let after_ba = send_n(&mesh.b, "bob", "alice@hosta", "after the copy", 1);
    wait_stored(&mesh.b, &after_ab);
    wait_stored(&mesh.a, &after_ba);
    wait_delivered(&mesh.a, &after_ab);
    wait_delivered(&mesh.b, &after_ba);
    mesh.wait_queue_drained(&mesh.a);
    mesh.wait_queue_drained(&mesh.b);
    to_b.extend(after_ab);
    to_a.extend(after_ba);
    // Mail queued at the relay when it stops: the copy loses it, only its sender brings it
    // back.
    mesh.b.stop();
    let lost = send_n(&mesh.a, "alice", "bob@hostb", "lost by the copy", 2);
    wait_queued(&mesh, &lost);
    to_b.extend(lost);
    mesh.a.stop();
    let (pa, pb) = (
        mesh.a.position(&url).expect("A's position"),
        mesh.b.position(&url).expect("B's position"),
    );
    assert_eq!(
        (pa.epoch.as_str(), pb.epoch.as_str()),
        (epoch.as_str(), epoch.as_str())
    );
    assert!(
        pa.received_through > head_in(&backup, &mesh.a.pubkey),
        "{pa:?}"
    );
    assert!(
        pb.received_through > head_in(&backup, &mesh.b.pubkey),
        "{pb:?}"
    );

    // The restore: the relay stopped, the file copied over relay.db, no rotate-epoch.
    mesh.relay.kill();
    for name in ["relay.db-wal", "relay.db-shm"] {
        let _ = std::fs::remove_file(store.join(name));
    }
    std::fs::copy(&backup, store.join("relay.db")).expect("copy the backup over the store");
    mesh.relay.launch(None);
    assert_eq!(
        meta(&store, "epoch").as_deref(),
        Some(epoch.as_str()),
        "a fresh heartbeat: the epoch is kept"
    );

    // Each host pulls before anything is pushed to it (B first: it has nothing to re-push),
    // sees head_seq below its checkpoint in the same epoch, and starts over.
    let (rewinds_a, rewinds_b) = (
        epoch_changes(&mesh.a, "rewind"),
        epoch_changes(&mesh.b, "rewind"),
    );
    mesh.b.start(None);
    wait_for("B to see the rewind", || {
        (epoch_changes(&mesh.b, "rewind") > rewinds_b).then_some(())
    });
    mesh.a.start(None);
    wait_for("A to see the rewind", || {
        (epoch_changes(&mesh.a, "rewind") > rewinds_a).then_some(())
    });

    // Every message stored exactly once at both ends; nothing else, nothing quarantined.
    wait_stored(&mesh.b, &to_b);
    wait_stored(&mesh.a, &to_a);
    mesh.wait_queue_drained(&mesh.b);
    mesh.wait_queue_drained(&mesh.a);
    let all: Vec<&String> = to_b.iter().chain(&to_a).collect();
    for host in [&mesh.a, &mesh.b] {
        for id in &all {
            assert_eq!(host.messages_with_id(id), 1, "{id} at {}", host.name);
        }
        assert_eq!(host.message_count(), all.len() as i64, "{}", host.name);
        assert_eq!(host.quarantined(), 0);
        assert_eq!(
            epoch_changes(host, "epoch"),
            0,
            "{}: the epoch never changed",
            host.name
        );
    }
    for id in &to_b {
        assert_eq!(mesh.b.deliveries_of(id), 1, "{id} delivered once to bob");
    }
    for id in &to_a {
        assert_eq!(mesh.a.deliveries_of(id), 1, "{id} delivered once to alice");
    }
    // The mail the copy lost came again with seqs above B's old checkpoint (the seq floor),
    // in the same epoch.
    let now_b = wait_for("B's checkpoint past the old one", || {
        mesh.b
            .position(&url)
            .filter(|p| p.received_through > pb.received_through)
    });
    assert_eq!(now_b.epoch, epoch);
    assert_eq!(meta(&store, "epoch").as_deref(), Some(epoch.as_str()));
}

/// A host that enrolled only after the backup is not in the restored store; restarted after
/// the restore, it enrols again and republishes its enc-key ad by itself.
#[test]
fn a_host_enrolled_after_the_backup_enrols_again_and_republishes_its_ad_by_itself() {
    let mut relay = helper::mesh::Relay::start(None);
    let store = relay.store_dir();
    let out_dir = tempfile::tempdir().expect("out");
    let backup = out_dir.path().join("b.db");
    relay_cli(&["backup", s(&backup), "--store-dir", s(&store)], &[]).assert_success();

    let mut c = Host::init("hostc");
    c.home
        .run(&["relay", "set", &relay.url(), "--key", &relay.fingerprint])
        .assert_success();
    c.start(None);
    c.daemon().wait_for_stderr("enrolled with the relay");
    c.daemon().wait_for_stderr("published the enc-key ad");
    c.stop();
    let c_key = c.pubkey.clone();
    let ad_at = |store: &Path| -> Option<i64> {
        open_read_only(&store.join("relay.db"))
            .query_row(
                "SELECT at FROM enc_ad_records WHERE host_pubkey = ?1",
                [&c_key],
                |r| r.get(0),
            )
            .ok()
    };
    let first_ad = ad_at(&store).expect("C's ad at the relay");

    relay.kill();
    let out = restore(&store, &backup, &[]);
    out.assert_success();
    let epoch = out.json()["epoch"]["to"].as_str().expect("to").to_string();
    let enrolled = "SELECT COUNT(*) FROM enrolments WHERE host_pubkey = ?1 AND revoked_at IS NULL";
    assert_eq!(count(&store, enrolled, &c.pubkey), 0, "not carried");
    relay.launch(None);

    c.start(None);
    c.daemon().wait_for_stderr("enrolled with the relay");
    c.daemon().wait_for_stderr("published the enc-key ad");
    wait_for("C enrolled in the restored store", || {
        (count(&store, enrolled, &c.pubkey) == 1).then_some(())
    });
    wait_for("C enrolled in the new epoch", || {
        (enrolled_in(&c, &epoch) >= 1).then_some(())
    });
    wait_for("C's republished ad", || {
        ad_at(&store).filter(|at| *at > first_ad)
    });
}

/// An emergency on a relay whose key lives only in a platform secret: offline `revoke`,
/// `deny`, `rotate-epoch` and `restore` without `MBX_RELAY_KEY` or `relay.key` still do their
/// work, each with one warning that its receipt is unsigned; `relay log` marks those receipts
/// NOT VERIFIED. A missing backup is exit 3 even when the key is malformed.
#[test]
fn offline_commands_without_the_relay_key_still_act_with_unsigned_receipts() {
    let tmp = tempfile::tempdir().expect("temp dir");
    let store = tmp.path().join("store");
    let backup = tmp.path().join("b.db");
    let relay = serve(&store, &[]);
    relay_cli(&["backup", s(&backup), "--store-dir", s(&store)], &[]).assert_success();
    relay.kill();
    // The key goes where only the platform has it.
    let key_file = store.join("relay.key");
    let kept = tmp.path().join("relay.key.kept");
    std::fs::rename(&key_file, &kept).expect("move relay.key away");
    let host = agentmbx_protocol::keys::HostKey::generate()
        .public()
        .to_b64();
    rusqlite::Connection::open(store.join("relay.db"))
        .expect("open")
        .execute(
            "INSERT INTO enrolments (host_pubkey, host_name, owner_fp, account, authorized_by,
               authority_rank, enrolled_at, revoked_at)
             VALUES (?1, 'lost-laptop', '', NULL, 'host-key-challenge', 0, 1, NULL)",
            [&host],
        )
        .expect("an enrolment");
    let ops_before = log_json(&store).len();

    let unsigned = |out: &Output| {
        out.assert_success();
        assert_eq!(out.stderr.matches("warning: ").count(), 1, "{out:#?}");
        assert!(out.stderr.contains("UNSIGNED"), "{out:#?}");
        assert!(out.stderr.contains("MBX_RELAY_KEY"), "{out:#?}");
    };
    unsigned(&relay_cli(
        &["revoke", &host, "--store-dir", s(&store)],
        &[],
    ));
    let revoked =
        "SELECT COUNT(*) FROM enrolments WHERE host_pubkey = ?1 AND revoked_at IS NOT NULL";
    assert_eq!(count(&store, revoked, &host), 1, "revoked");
    unsigned(&relay_cli(
        &["deny", "client-x", "--client", "--store-dir", s(&store)],
        &[],
    ));
    unsigned(&relay_cli(&["rotate-epoch", "--store-dir", s(&store)], &[]));
    let out = restore(&store, &backup, &[]);
    unsigned(&out);
    assert_eq!(out.json()["carried"]["revocations"], 1);
    assert_eq!(
        count(&store, revoked, &host),
        1,
        "still revoked after the restore"
    );

    let entries = log_json(&store);
    let fresh: Vec<(&str, bool)> = entries[..entries.len() - ops_before]
        .iter()
        .map(|e| (e["op"].as_str().expect("op"), e["verified"] == true))
        .collect();
    assert_eq!(
        fresh,
        [
            ("relay-restore", false),
            ("relay-epoch-rotated", false),
            ("relay-deny", false),
            ("relay-revoke", false)
        ]
    );
    assert!(entries[..4]
        .iter()
        .all(|e| e["receipt"].get("sig").is_none()));
    let text = relay_cli(&["log", "--store-dir", s(&store), "--limit", "4"], &[]);
    text.assert_success();
    assert_eq!(
        text.stdout.matches("✗ NOT VERIFIED: ").count(),
        4,
        "{text:#?}"
    );

    // A malformed key is an error, but a missing backup is reported as such first (exit 3).
    let out = relay_cli(
        &[
            "restore",
            s(&tmp.path().join("none.db")),
            "--store-dir",
            s(&store),
        ],
        &[("MBX_RELAY_KEY", "not-a-key")],
    );
    assert_eq!(out.code(), Some(3), "{out:#?}");
    assert!(out.stderr.contains("NO_BACKUP"), "{out:#?}");
    let out = relay_cli(
        &["deny", "client-y", "--client", "--store-dir", s(&store)],
        &[("MBX_RELAY_KEY", "not-a-key")],
    );
    assert_eq!(out.code(), Some(1), "{out:#?}");
    assert!(
        out.stderr
            .contains("MBX_RELAY_KEY is not a valid relay key"),
        "{out:#?}"
    );

    // The key back: signed again, no warning; the relay serves the store as before.
    std::fs::rename(&kept, &key_file).expect("relay.key back");
    let out = relay_cli(&["rotate-epoch", "--store-dir", s(&store)], &[]);
    out.assert_success();
    assert!(!out.stderr.contains("warning: "), "{out:#?}");
    assert_eq!(log_json(&store)[0]["verified"], true);
    let relay = serve(&store, &[]);
    assert_eq!(relay.get("/v2/relay/info", None).status, 200);
    relay.kill();
}

/// `relay backup` of a store the relay serves, without `--url`: its receipt goes to the relay
/// log through the admin endpoint of the relay on this machine when the admin token is
/// configured here; without it, the receipt is printed signed, and a note says it was not
/// logged and how to log it.
#[test]
fn a_backup_while_the_relay_serves_logs_its_receipt_through_the_local_admin_endpoint() {
    let tmp = tempfile::tempdir().expect("temp dir");
    let store = tmp.path().join("store");
    let env = [("MBX_RELAY_ADMIN_TOKEN", ADMIN)];
    let relay = serve(&store, &env);
    let port = relay.addr.port().to_string();
    let backups = |store: &Path| {
        log_json(store)
            .into_iter()
            .filter(|e| e["op"] == "relay-backup")
            .collect::<Vec<Value>>()
    };

    // The admin token and the relay's port as the relay itself reads them.
    let b1 = tmp.path().join("b1.db");
    let out = relay_cli(
        &["backup", s(&b1), "--store-dir", s(&store), "--json"],
        &[("MBX_RELAY_ADMIN_TOKEN", ADMIN), ("PORT", &port)],
    );
    out.assert_success();
    assert!(!out.stderr.contains("not added"), "{out:#?}");
    let printed = out.json();
    let logged = backups(&store);
    assert_eq!(logged.len(), 1, "{logged:?}");
    assert_eq!(logged[0]["receipt"], printed);
    assert_eq!(logged[0]["verified"], true);

    // No admin token here: printed (signed with relay.key), not logged, and the note says so.
    let b2 = tmp.path().join("b2.db");
    let out = relay_cli(
        &["backup", s(&b2), "--store-dir", s(&store), "--json"],
        &[("PORT", &port)],
    );
    out.assert_success();
    assert!(b2.is_file());
    assert!(
        out.stderr.contains("was not added to the relay log"),
        "{out:#?}"
    );
    assert!(
        out.stderr.contains("no admin token is configured"),
        "{out:#?}"
    );
    assert!(out.stderr.contains("--url"), "{out:#?}");
    let printed = out.json();
    let relay_pubkey = meta(&store, "relay_pubkey").expect("relay key");
    let key = agentmbx_protocol::keys::PublicKey::from_b64(&relay_pubkey).expect("key");
    let mut unsigned = printed.clone();
    let sig = unsigned
        .as_object_mut()
        .expect("object")
        .remove("sig")
        .expect("signed");
    let text = agentmbx_protocol::canonical::to_string(&unsigned).expect("canonical");
    assert!(key.verify(text.as_bytes(), sig.as_str().expect("sig")));
    assert_eq!(backups(&store).len(), 1, "not logged");

    // A token that the relay refuses: not logged either, and the note names the relay.
    let b3 = tmp.path().join("b3.db");
    let out = relay_cli(
        &["backup", s(&b3), "--store-dir", s(&store)],
        &[
            ("MBX_RELAY_ADMIN_TOKEN", "another-token-0123456789"),
            ("PORT", &port),
        ],
    );
    out.assert_success();
    assert!(
        out.stderr.contains("was not added to the relay log"),
        "{out:#?}"
    );
    assert!(
        out.stderr.contains(&format!("127.0.0.1:{port}")),
        "{out:#?}"
    );
    // Text mode prints the summary, not the receipt: the note says where the receipt is.
    assert!(
        out.stderr.contains("The receipt (printed with --json;")
            && !out.stderr.contains("The receipt shown"),
        "{out:#?}"
    );
    assert!(
        !out.stderr.contains("another-token"),
        "the token is never printed"
    );
    assert_eq!(backups(&store).len(), 1);
    relay.kill();
}

#[test]
fn a_backup_path_that_is_no_regular_file_is_named_as_such_with_exit_3() {
    let tmp = tempfile::tempdir().expect("temp dir");
    let store = tmp.path().join("store");
    serve(&store, &[]).kill();
    let before = std::fs::read(store.join("relay.db")).expect("live");
    let folder = tmp.path().join("folder.db");
    std::fs::create_dir(&folder).expect("dir");
    let dangling = tmp.path().join("dangling.db");
    std::os::unix::fs::symlink(tmp.path().join("gone.db"), &dangling).expect("symlink");
    for file in [&folder, &dangling] {
        let out = restore(&store, file, &[]);
        assert_eq!(out.code(), Some(3), "{out:#?}");
        assert!(
            out.stderr.contains("NO_BACKUP") && out.stderr.contains("is not a regular file"),
            "{out:#?}"
        );
    }
    assert_eq!(std::fs::read(store.join("relay.db")).expect("live"), before);
}
