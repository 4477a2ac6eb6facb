//! Waiting for mail with real daemons (issue 18 part 2): `GET /v1/inbox?wait=` and `agentmbx
//! inbox --wait` started before the mail exists answer with it as soon as it is committed on
//! the receiving host — sent locally, over the LAN, or through a relay — and a daemon asked to
//! stop (SIGTERM) ends its waits at once instead of waiting for them.
//!
//! A wait that returned a message records it `notified`, and the sender's `sent` shows it
//! once the receipt is back.
//!
//! A waiter is known to wait when the daemon logs `a reader waits for mail` (debug, enabled for
//! the inbox module only); then the mail is sent.

use crate::helper;

use std::time::{Duration, Instant};

use crate::helper::mesh::{Host, Mesh};
use crate::helper::{request, wait_for};
use serde_json::Value;

/// The daemon's log filter: info, plus the inbox module's debug line for a waiter.
const LOG: (&str, &str) = ("MBX_LOG", "info,agentmbx::api::inbox=debug");
/// What the daemon logs when a request starts waiting.
const WAITING: &str = "a reader waits for mail";

/// `GET /v1/inbox?as=<agent>&wait=<wait>[&cursor=]` on `host` from another thread; joins to
/// the answer and when it came.
fn wait_in_thread(
    host: &Host,
    agent: &str,
    wait: u32,
    cursor: Option<&str>,
) -> std::thread::JoinHandle<(u16, Value, Instant)> {
    let addr = helper::listening_addr(&host.log()).expect("the daemon's API address");
    let token = host.home.token();
    let mut path = format!("/v1/inbox?as={agent}&wait={wait}");
    if let Some(c) = cursor {
        path.push_str(&format!("&cursor={c}"));
    }
    std::thread::spawn(move || {
        let r = request(addr, "GET", &path, Some(&token), &[], None);
        let status = r.status;
        (status, r.json(), Instant::now())
    })
}

/// How many times `host`'s daemon logged that a request waits.
fn waiting_lines(host: &Host) -> usize {
    host.log().matches(WAITING).count()
}

/// Waits until `host`'s daemon logged `n` waiting requests.
fn until_waiting(host: &Host, n: usize) {
    wait_for(&format!("{n} waiting request(s) on {}", host.name), || {
        (waiting_lines(host) >= n).then_some(())
    });
}

fn ids(page: &Value) -> Vec<String> {
    page["messages"]
        .as_array()
        .expect("messages")
        .iter()
        .map(|m| m["id"].as_str().expect("id").to_string())
        .collect()
}

/// Wall-clock ms now (the daemons' clock: no offset in these tests).
fn now_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .expect("clock")
        .as_millis() as i64
}

/// Waits (long polls of 20 s, from `bob`'s current position) on `host` until a message for bob
/// arrives, the first poll started before `send` runs; returns the message id and the ms from
/// its commit on `host` (`received_at`) to the answer.
fn long_poll_for_bob(host: &Host, send: impl FnOnce() -> String) -> (String, i64) {
    let cursor = host.inbox("bob")["cursor"]
        .as_str()
        .expect("every answer has a cursor")
        .to_string();
    let mut seen = waiting_lines(host);
    let mut waiter = wait_in_thread(host, "bob", 20, Some(&cursor));
    until_waiting(host, seen + 1);
    let id = send();
    // The route may take longer than one wait (the relay after LAN failures): poll again from
    // the position each answer gives.
    for _ in 0..4 {
        let (status, page, answered) = waiter.join().expect("waiter thread");
        let answered_ms = now_ms() - answered.elapsed().as_millis() as i64;
        assert_eq!(status, 200, "{page}");
        if !page["messages"].as_array().expect("messages").is_empty() {
            assert_eq!(ids(&page), vec![id.clone()]);
            let received: i64 = host
                .db()
                .query_row(
                    "SELECT received_at FROM messages WHERE id = ?1",
                    [&id],
                    |r| r.get(0),
                )
                .expect("the message is stored");
            return (id, answered_ms - received);
        }
        seen = waiting_lines(host);
        waiter = wait_in_thread(host, "bob", 20, page["cursor"].as_str());
        until_waiting(host, seen + 1);
    }
    panic!("{id} never reached a waiter:\n{}", host.log());
}

#[test]
fn cli_inbox_wait_returns_a_local_send_at_once() {
    let mut a = Host::init("hosta");
    a.register("alice");
    a.register("bob");
    a.start_with(&[LOG]);
    let started = Instant::now();
    let child = a
        .home
        .command(&["inbox", "--as", "bob", "--wait", "20", "--json"])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("spawn agentmbx inbox --wait");
    until_waiting(&a, 1);
    let sent = a.send("alice", "bob", "wake", "up");
    let id = sent["id"].as_str().expect("id").to_string();
    let out = child.wait_with_output().expect("inbox --wait");
    let elapsed = started.elapsed();
    assert!(out.status.success(), "{out:?}");
    let page: Value = serde_json::from_slice(&out.stdout).expect("JSON page");
    assert_eq!(ids(&page), vec![id]);
    assert!(page["cursor"].as_str().is_some(), "{page}");
    assert!(
        elapsed < Duration::from_secs(10),
        "{elapsed:?} of a 20 s wait"
    );
}

#[test]
fn a_long_poll_is_woken_by_mail_arriving_over_the_lan() {
    let mut a = Host::init("hosta");
    let mut b = Host::init("hostb");
    a.register("alice");
    b.register("bob");
    a.start(None);
    b.start_with(&[LOG]);
    a.pair_with(&b);
    let (id, latency_ms) = long_poll_for_bob(&b, || {
        a.send("alice", "bob@hostb", "over the lan", "hi")["id"]
            .as_str()
            .expect("id")
            .to_string()
    });
    let origin: String = b
        .db()
        .query_row("SELECT origin FROM messages WHERE id = ?1", [&id], |r| {
            r.get(0)
        })
        .expect("origin");
    assert_eq!(origin, "hosta");
    let via = wait_for("the row delivered over the LAN", || {
        a.db()
            .query_row(
                "SELECT via FROM outbox WHERE msg_id = ?1 AND state = 'delivered'",
                [&id],
                |r| r.get::<_, Option<String>>(0),
            )
            .ok()
    });
    assert_eq!(via.as_deref(), Some("lan"));
    // The wait returned it: the sender learns `notified` (spec §9) from the receipt.
    wait_for("alice's sent to show notified", || {
        let r = a.api("GET", "/v1/sent?as=alice", None);
        let sent = r.json();
        let m = sent["messages"]
            .as_array()?
            .iter()
            .find(|m| m["id"] == id.as_str())?
            .clone();
        (m["recipients"][0]["state"] == "notified").then_some(())
    });
    eprintln!("LAN: commit on the receiver -> waiter's answer: {latency_ms} ms");
    assert!(latency_ms < 5_000, "{latency_ms} ms");
}

#[test]
fn a_long_poll_is_woken_by_mail_pulled_from_the_relay() {
    let mut mesh = Mesh::configured(None);
    mesh.a.start(None);
    mesh.b.start_with(&[LOG]);
    for host in [&mut mesh.a, &mut mesh.b] {
        host.daemon().wait_for_stderr("published the enc-key ad");
    }
    let (id, latency_ms) = long_poll_for_bob(&mesh.b, || {
        mesh.a.send("alice", "bob@hostb", "via the relay", "hi")["id"]
            .as_str()
            .expect("id")
            .to_string()
    });
    let via: Option<String> = mesh
        .a
        .db()
        .query_row("SELECT via FROM outbox WHERE msg_id = ?1", [&id], |r| {
            r.get(0)
        })
        .expect("outbox row");
    assert_eq!(via.as_deref(), Some("relay"));
    eprintln!("relay: commit on the receiver -> waiter's answer: {latency_ms} ms");
    assert!(latency_ms < 5_000, "{latency_ms} ms");
}

#[test]
fn sigterm_ends_an_open_wait_and_the_daemon_exits_promptly() {
    let mut a = Host::init("hosta");
    a.register("bob");
    a.start_with(&[LOG]);
    let waiter = wait_in_thread(&a, "bob", 25, None);
    until_waiting(&a, 1);
    let asked = Instant::now();
    a.stop();
    let stopped = asked.elapsed();
    let (status, page, answered) = waiter.join().expect("waiter thread");
    assert!(stopped < Duration::from_secs(5), "exit took {stopped:?}");
    assert_eq!(status, 200, "{page}");
    assert!(ids(&page).is_empty());
    assert!(answered.duration_since(asked) < Duration::from_secs(5));
}
