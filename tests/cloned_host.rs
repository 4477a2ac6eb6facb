//! Two daemons running with one host key (a copied home, a restored backup, a cloned disk),
//! with real processes: one relay, host `xa` and host `xb` plus a copy of xb's home (`xb2`),
//! relay only. Each daemon start sends its own instance id on every relay hop; the relay sees
//! the two ids alternate on xb's key and says so in xb's signed info, and each xb daemon
//! reports it: `/v1/health` `degraded` with the reason, `agentmbx doctor` failing
//! `host-key-clone` with what to do, and one log line per detection. Mail flows as before:
//! each message goes to whichever xb daemon pulls it, none is lost, none is stored twice in one
//! store, and xa sees every message delivered.

use serde_json::Value;

use crate::helper::mesh::{Host, Relay};
use crate::helper::wait_for;

/// The daemon's log line for a detection its relay reported.
const HOST_LINE: &str = "another daemon is using this host key";
/// The relay's log line for a detection.
const RELAY_LINE: &str = "two daemons are using one host key";

/// `GET /v1/health` of `host`'s daemon.
fn health(host: &Host) -> Value {
    let r = host.api("GET", "/v1/health", None);
    assert_eq!(r.status, 200, "{r:#?}");
    r.json()
}

/// Lines of `log` containing `needle`.
fn lines_with(log: &str, needle: &str) -> usize {
    log.lines().filter(|l| l.contains(needle)).count()
}

#[test]
fn a_copied_home_is_reported_by_relay_health_doctor_and_log_while_no_mail_is_lost() {
    let mut relay = Relay::start(None);
    let mut xa = Host::init("xa");
    let mut xb = Host::init("xb");
    xb.register("bob");
    xa.home
        .run(&["peers", "add", "xb", &xb.pubkey])
        .assert_success();
    xb.home
        .run(&["peers", "add", "xa", &xa.pubkey])
        .assert_success();
    for host in [&xa, &xb] {
        host.home
            .run(&["relay", "set", &relay.url(), "--key", &relay.fingerprint])
            .assert_success();
    }
    xa.start(None);
    xb.start(None);
    for host in [&mut xa, &mut xb] {
        host.daemon().wait_for_stderr("published the enc-key ad");
    }
    // xb's home is copied while xb is stopped; both then run, each on its own ports.
    xb.stop();
    let mut xb2 = xb.copy_home("xb2");
    xb.start(None);
    xb2.start(None);

    // 20 messages, each sent once the relay took the one before.
    let ids: Vec<String> = (0..20)
        .map(|i| {
            let sent = xa.send("alice", "bob@xb", &format!("m{i}"), &format!("body {i}"));
            let id = sent["id"].as_str().expect("id").to_string();
            xa.wait_relay_accepted(&id);
            id
        })
        .collect();

    // Both xb daemons are told by the relay and say so.
    for host in [&xb, &xb2] {
        let h = wait_for(&format!("{}'s health to be degraded", host.name), || {
            let h = health(host);
            (h["status"] == "degraded").then_some(h)
        });
        assert_eq!(h["host"], "xb", "{h}");
        let reasons = h["reasons"].as_array().expect("reasons");
        assert_eq!(reasons.len(), 1, "{h}");
        assert_eq!(reasons[0]["code"], "host-key-clone", "{h}");
        assert_eq!(reasons[0]["relay"], relay.url().as_str(), "{h}");
        assert!(
            reasons[0]["detail"]
                .as_str()
                .unwrap()
                .contains("another daemon is using this host key"),
            "{h}"
        );
    }
    // The sender has no problem of its own.
    assert_eq!(health(&xa)["status"], "ok");

    // No message lost: each is stored by one xb daemon or the other (both, when both pulled it
    // before either acked), never twice in one store; the relay queue drains and xa sees every
    // message delivered.
    wait_for("every message stored by xb or xb2", || {
        ids.iter()
            .all(|id| xb.messages_with_id(id) + xb2.messages_with_id(id) >= 1)
            .then_some(())
    });
    wait_for("the relay queue for xb to drain", || {
        relay.items_for(&xb.pubkey).is_empty().then_some(())
    });
    for id in &ids {
        for host in [&xb, &xb2] {
            assert!(
                host.messages_with_id(id) <= 1,
                "{id} stored twice by {}",
                host.name
            );
            assert!(
                host.deliveries_of(id) <= 1,
                "{id} delivered twice by {}",
                host.name
            );
        }
    }
    wait_for("every row of xa delivered", || {
        ids.iter()
            .all(|id| xa.outbox(id).is_some_and(|r| r.state == "delivered"))
            .then_some(())
    });
    let (on_b, on_b2) = (xb.message_count(), xb2.message_count());
    eprintln!("stored: xb {on_b}, xb2 {on_b2} of {}", ids.len());
    assert!(on_b + on_b2 >= ids.len() as i64);

    // doctor on xb: the daemon answers (degraded), host-key-clone fails with what to do.
    let out = xb
        .home
        .run(&["doctor", "--json", "daemon", "host-key-clone"]);
    assert_eq!(out.code(), Some(1), "{out:#?}");
    let report = out.json();
    let check = |id: &str| -> Value {
        report["checks"]
            .as_array()
            .expect("checks")
            .iter()
            .find(|c| c["id"] == id)
            .cloned()
            .unwrap_or_else(|| panic!("no {id} check: {report}"))
    };
    assert_eq!(check("daemon")["status"], "ok", "{report}");
    let clone = check("host-key-clone");
    assert_eq!(clone["status"], "fail", "{report}");
    assert!(
        clone["summary"].as_str().unwrap().contains(HOST_LINE),
        "{clone}"
    );
    let details = clone["details"].to_string();
    assert!(details.contains("stop the daemon"), "{clone}");
    assert!(details.contains("agentmbx init"), "{clone}");
    // xa's doctor sees nothing wrong with its own key.
    let out = xa.home.run(&["doctor", "--json", "host-key-clone"]);
    out.assert_success();
    assert_eq!(out.json()["checks"][0]["status"], "ok", "{out:#?}");

    // One log line per detection: one detection, so exactly one line in each xb log (and in
    // the relay's), however many relay passes reported it since.
    for host in [&xb, &xb2] {
        let log = host.log();
        assert_eq!(lines_with(&log, HOST_LINE), 1, "{}:\n{log}", host.name);
    }
    assert_eq!(lines_with(&xa.log(), HOST_LINE), 0);
    let relay_log = relay.proc().stderr();
    assert_eq!(lines_with(&relay_log, RELAY_LINE), 1, "{relay_log}");
    assert!(relay_log.contains("host=xb"), "{relay_log}");
    assert!(
        !relay_log.contains(&xb.pubkey),
        "no key material in the relay log"
    );
}
