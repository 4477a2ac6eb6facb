//! The relay push stream with real processes (`docs/relay-stream.md`): one `agentmbx relay
//! serve` and two daemons with no LAN route to each other (relay only), each pulling only once
//! an hour, so whatever arrives within seconds came over the stream. Mail and its delivered,
//! read and acked receipts cross within seconds; a relay killed and restarted on the same port
//! and store is reconnected to and nothing sent before, during or after is lost or stored twice;
//! a relay restored from a backup (a new epoch) gets spec §5's epoch handling and mail after it
//! still arrives once; with `MBX_RELAY_STREAM=0` the daemon polls and `doctor` says so.

use std::time::{Duration, Instant};

use serde_json::Value;

use crate::helper::mesh::{Host, Mesh};
use crate::helper::relay_cli::{relay_cli, ADMIN};
use crate::helper::{wait_for, POLL};

/// The pull interval of the daemons here: an hour, so a pull never carries the mail.
const HOUR_MS: &str = "3600000";

/// What the daemon logs once its push stream is open.
const STREAM_OPEN: &str = "relay stream open";

/// What the daemon logs (at warn) for each relay pass that failed.
const PASS_FAILED: &str = "relay pass failed";

/// How long mail may take over the stream here: far below the hour a pull would take, with room
/// for a loaded test machine.
const STREAM_BOUND: Duration = Duration::from_secs(20);

/// Polls `check` until it returns `Some`; panics naming `what` after `bound`.
fn within<T>(bound: Duration, what: &str, mut check: impl FnMut() -> Option<T>) -> T {
    let deadline = Instant::now() + bound;
    loop {
        if let Some(v) = check() {
            return v;
        }
        assert!(
            Instant::now() < deadline,
            "{what} did not happen within {bound:?}"
        );
        std::thread::sleep(POLL);
    }
}

/// Starts `host`'s daemon pulling once an hour (the stream on, as by default), plus `env`.
fn start_hourly(host: &mut Host, env: &[(&str, &str)]) {
    let mut all = vec![("MBX_RELAY_PULL_INTERVAL_MS", HOUR_MS)];
    all.extend_from_slice(env);
    host.start_with(&all);
}

/// The mesh with both daemons pulling hourly, each with its enc-key ad published and its push
/// stream open.
fn streaming_mesh() -> Mesh {
    let mut mesh = Mesh::configured(None);
    for host in [&mut mesh.a, &mut mesh.b] {
        start_hourly(host, &[]);
    }
    for host in [&mut mesh.a, &mut mesh.b] {
        host.daemon().wait_for_stderr("published the enc-key ad");
        host.daemon().wait_for_stderr(STREAM_OPEN);
    }
    mesh
}

/// Sends alice@hosta → bob@hostb; returns the id.
fn send_to_bob(mesh: &Mesh, subject: &str) -> String {
    let sent = mesh
        .a
        .send("alice", "bob@hostb", subject, "over the stream");
    sent["id"].as_str().expect("id").to_string()
}

/// The receipt state `host` holds for its message `id` to `recipient`.
fn receipt_state(host: &Host, id: &str, recipient: &str) -> Option<String> {
    host.db()
        .query_row(
            "SELECT state FROM remote_receipts WHERE msg_id = ?1 AND recipient = ?2",
            [id, recipient],
            |r| r.get(0),
        )
        .ok()
}

/// `agentmbx doctor relay-stream --json` in `host`'s home: the check's JSON.
fn doctor_stream(host: &Host) -> Value {
    let out = host.home.run(&["doctor", "relay-stream", "--json"]);
    let report = out.json();
    report["checks"]
        .as_array()
        .and_then(|c| c.iter().find(|c| c["id"] == "relay-stream"))
        .cloned()
        .unwrap_or_else(|| panic!("no relay-stream check in {report}"))
}

/// Each of `ids` is stored once at `host` with one delivery, and nothing else is stored.
fn assert_each_once(host: &Host, ids: &[String]) {
    for id in ids {
        assert_eq!(host.messages_with_id(id), 1, "{id} at {}", host.name);
        assert_eq!(host.deliveries_of(id), 1, "deliveries of {id}");
    }
    assert_eq!(host.message_count(), ids.len() as i64, "{}", host.name);
    assert_eq!(host.quarantined(), 0);
}

#[test]
fn mail_and_its_receipts_cross_over_the_stream_while_pulls_are_an_hour_apart() {
    let mesh = streaming_mesh();
    let id = send_to_bob(&mesh, "pushed");
    within(STREAM_BOUND, "the message in bob's inbox", || {
        mesh.b.inbox_ids("bob").contains(&id).then_some(())
    });
    within(
        STREAM_BOUND,
        "A's row settled by the delivered receipt",
        || mesh.a.outbox(&id).filter(|r| r.state == "delivered"),
    );
    within(STREAM_BOUND, "the delivered receipt at A", || {
        (receipt_state(&mesh.a, &id, "bob@hostb").is_some()).then_some(())
    });
    mesh.b.read(&id, "bob");
    within(STREAM_BOUND, "the read receipt at A", || {
        (receipt_state(&mesh.a, &id, "bob@hostb").as_deref() == Some("read")).then_some(())
    });
    let ack = mesh.b.ack("bob", &[&id]);
    assert_eq!(ack["acked"], 1, "{ack}");
    within(STREAM_BOUND, "the acked receipt at A", || {
        (receipt_state(&mesh.a, &id, "bob@hostb").as_deref() == Some("acked")).then_some(())
    });
    assert_each_once(&mesh.b, std::slice::from_ref(&id));
    // B acked what it stored: the relay's queue for it drains without a pull.
    within(STREAM_BOUND, "the relay queue for B to drain", || {
        mesh.relay
            .items_for(&mesh.b.pubkey)
            .is_empty()
            .then_some(())
    });
    let check = doctor_stream(&mesh.b);
    assert_eq!(check["status"], "ok", "{check}");
    assert!(
        check["summary"]
            .as_str()
            .unwrap_or_default()
            .starts_with("up since"),
        "{check}"
    );
    // One stream all along: no reconnect, no pull but the first ones.
    assert_eq!(
        mesh.b.log().matches(STREAM_OPEN).count(),
        1,
        "{}",
        mesh.b.log()
    );
}

#[test]
fn the_stream_reconnects_after_a_relay_restart_and_nothing_is_lost_or_stored_twice() {
    let mut mesh = streaming_mesh();
    let mut ids: Vec<String> = (0..3)
        .map(|i| send_to_bob(&mesh, &format!("before {i}")))
        .collect();
    within(STREAM_BOUND, "the first mail at B", || {
        ids.iter()
            .all(|id| mesh.b.messages_with_id(id) == 1)
            .then_some(())
    });
    let down = Instant::now();
    mesh.relay.kill();
    ids.extend((0..3).map(|i| send_to_bob(&mesh, &format!("during {i}"))));
    // While the relay is down, B's failed passes back off (1 s doubling): a handful, never a
    // spin.
    let failed = |host: &Host| host.log().matches(PASS_FAILED).count();
    let before = failed(&mesh.b);
    wait_for("B's passes failing while the relay is down", || {
        (failed(&mesh.b) >= before + 2).then_some(())
    });
    let (count, secs) = (failed(&mesh.b) - before, down.elapsed().as_secs() as usize);
    assert!(
        count <= 3 + secs,
        "{count} failed passes in {secs} s while the relay was down: {}",
        mesh.b.log()
    );
    mesh.relay.launch(None);
    ids.extend((0..3).map(|i| send_to_bob(&mesh, &format!("after {i}"))));
    // A's retries wait out its outbox backoff; B reconnects within its pass backoff (≤ 10 s).
    wait_for("every message at B", || {
        ids.iter()
            .all(|id| mesh.b.messages_with_id(id) >= 1)
            .then_some(())
    });
    wait_for("B's stream open again", || {
        (mesh.b.log().matches(STREAM_OPEN).count() >= 2).then_some(())
    });
    // The reopened stream carries mail (B pulls hourly).
    let late = send_to_bob(&mesh, "after the reopen");
    within(STREAM_BOUND, "mail over the reopened stream", || {
        (mesh.b.messages_with_id(&late) == 1).then_some(())
    });
    ids.push(late);
    mesh.wait_queue_drained(&mesh.b);
    assert_each_once(&mesh.b, &ids);
    for id in &ids {
        wait_for(&format!("{id} delivered at A"), || {
            mesh.a.outbox(id).filter(|r| r.state == "delivered")
        });
    }
}

#[test]
fn a_relay_restored_from_a_backup_gets_the_new_epoch_handling_and_mail_after_it_arrives_once() {
    let mut mesh = streaming_mesh();
    let store = mesh.relay.store_dir();
    let url = mesh.relay.url();
    let dir = tempfile::tempdir().expect("temp dir");
    let backup = dir.path().join("stream.db");
    let s = |p: &std::path::Path| p.to_str().expect("UTF-8 path").to_string();

    let mut ids: Vec<String> = (0..2)
        .map(|i| send_to_bob(&mesh, &format!("before the backup {i}")))
        .collect();
    within(STREAM_BOUND, "the first mail at B", || {
        ids.iter()
            .all(|id| mesh.b.messages_with_id(id) == 1)
            .then_some(())
    });
    let out = relay_cli(
        &["backup", &s(&backup), "--store-dir", &s(&store), "--json"],
        &[],
    );
    out.assert_success();
    let backup_epoch = out.json()["epoch"].as_str().expect("epoch").to_string();
    // Delivered after the backup: the restored relay no longer knows it was.
    ids.push(send_to_bob(&mesh, "after the backup"));
    within(STREAM_BOUND, "the mail after the backup at B", || {
        (mesh.b.messages_with_id(ids.last().expect("id")) == 1).then_some(())
    });

    mesh.relay.kill();
    let out = relay_cli(
        &["restore", &s(&backup), "--store-dir", &s(&store), "--json"],
        &[],
    );
    out.assert_success();
    let epoch = out.json()["epoch"]["to"]
        .as_str()
        .expect("new epoch")
        .to_string();
    assert_ne!(epoch, backup_epoch);
    mesh.relay.launch(None);

    for host in [&mesh.a, &mesh.b] {
        wait_for(&format!("{} at the new epoch", host.name), || {
            host.position(&url).filter(|p| p.epoch == epoch)
        });
    }
    wait_for("B's stream open in the new epoch", || {
        (mesh.b.log().matches(STREAM_OPEN).count() >= 2).then_some(())
    });
    ids.extend((0..2).map(|i| send_to_bob(&mesh, &format!("after the restore {i}"))));
    within(STREAM_BOUND, "the mail after the restore at B", || {
        ids.iter()
            .all(|id| mesh.b.messages_with_id(id) >= 1)
            .then_some(())
    });
    mesh.wait_queue_drained(&mesh.b);
    assert_each_once(&mesh.b, &ids);
    assert!(
        mesh.b.log().contains("the relay's epoch changed"),
        "{}",
        mesh.b.log()
    );
}

#[test]
fn with_the_stream_off_the_daemon_polls_and_doctor_says_it_is_disabled() {
    let mut mesh = Mesh::configured(None);
    mesh.a.start(None);
    // Fast pulls (the mesh's default interval), the stream off.
    mesh.b.start_with(&[("MBX_RELAY_STREAM", "0")]);
    for host in [&mut mesh.a, &mut mesh.b] {
        host.daemon().wait_for_stderr("published the enc-key ad");
    }
    let id = send_to_bob(&mesh, "polled");
    wait_for("the message in bob's inbox", || {
        mesh.b.inbox_ids("bob").contains(&id).then_some(())
    });
    assert_each_once(&mesh.b, std::slice::from_ref(&id));
    assert!(!mesh.b.log().contains(STREAM_OPEN), "{}", mesh.b.log());
    let check = doctor_stream(&mesh.b);
    assert_eq!(check["status"], "ok", "{check}");
    assert!(
        check["summary"]
            .as_str()
            .unwrap_or_default()
            .starts_with("disabled by config"),
        "{check}"
    );
}

#[test]
fn doctor_does_not_say_up_from_the_last_run_while_the_relay_is_down() {
    let mut mesh = streaming_mesh();
    mesh.b.stop();
    mesh.relay.kill();
    start_hourly(&mut mesh.b, &[]);
    let summary = wait_for("doctor to stop reporting the last run's stream", || {
        let check = doctor_stream(&mesh.b);
        let summary = check["summary"].as_str().unwrap_or_default().to_string();
        (!summary.starts_with("up since")).then_some(summary)
    });
    assert!(summary.starts_with("reconnecting"), "{summary}");
}

#[test]
fn an_online_epoch_rotation_reaches_the_open_stream_and_mail_after_it_arrives_once() {
    let mut mesh = streaming_mesh();
    // The relay again with its admin endpoint on; both daemons reopen their streams.
    let admin = [("MBX_RELAY_ADMIN_TOKEN", ADMIN)];
    mesh.relay.kill();
    mesh.relay.launch_with(None, &admin);
    for host in [&mesh.a, &mesh.b] {
        wait_for("the stream open again", || {
            (host.log().matches(STREAM_OPEN).count() >= 2).then_some(())
        });
    }
    let mut ids = vec![send_to_bob(&mesh, "before the rotation")];
    within(STREAM_BOUND, "the mail before the rotation at B", || {
        (mesh.b.messages_with_id(&ids[0]) == 1).then_some(())
    });

    relay_cli(&["rotate-epoch", "--url", &mesh.relay.url()], &admin).assert_success();
    // The open stream carries the new epoch (B pulls hourly; nothing else would tell it).
    within(STREAM_BOUND, "B's stream announcing the new epoch", || {
        mesh.b
            .log()
            .contains("the stream announced the relay's epoch")
            .then_some(())
    });
    ids.extend((0..2).map(|i| send_to_bob(&mesh, &format!("after the rotation {i}"))));
    within(STREAM_BOUND, "the mail after the rotation at B", || {
        ids.iter()
            .all(|id| mesh.b.messages_with_id(id) >= 1)
            .then_some(())
    });
    mesh.wait_queue_drained(&mesh.b);
    assert_each_once(&mesh.b, &ids);
}
