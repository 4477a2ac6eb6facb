//! New-mail events with a real daemon (issue 19 part 1): `agentmbx watch` reads the daemon's
//! event stream (`GET /v1/events`), prints each new message once, follows the daemon across a
//! restart by `Last-Event-ID` (mail that arrived while it was down included, nothing printed
//! twice), and resumes from its `--cursor-file` when the watch itself is started again. A
//! daemon asked to stop ends its open streams at once.
//!
//! A stream is known to be open when the daemon logs `an event stream is open` (debug, enabled
//! for the events module only).

use std::io::{BufRead, BufReader};
use std::process::{Child, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use crate::helper::mesh::Host;
use crate::helper::wait_for;
use serde_json::Value;

/// The daemon's log filter: info, plus the events module's debug line for an open stream.
const LOG: (&str, &str) = ("MBX_LOG", "info,agentmbx::api::events=debug");
/// What the daemon logs when a stream opens.
const OPEN: &str = "an event stream is open";

/// A running `agentmbx watch`, its stdout lines on a channel; killed when dropped.
struct Watch {
    child: Child,
    lines: mpsc::Receiver<String>,
}

impl Watch {
    fn start(host: &Host, args: &[&str]) -> Watch {
        let mut all = vec!["watch", "--as", "bob", "--json"];
        all.extend_from_slice(args);
        let mut child = host
            .home
            .command(&all)
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .expect("spawn agentmbx watch");
        let out = child.stdout.take().expect("stdout");
        let (tx, lines) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(out).lines() {
                let Ok(line) = line else { break };
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        Watch { child, lines }
    }

    /// The ids of the next `n` messages printed (30 s at most).
    fn next_ids(&self, n: usize) -> Vec<String> {
        let deadline = Instant::now() + Duration::from_secs(30);
        (0..n)
            .map(|i| {
                let left = deadline.saturating_duration_since(Instant::now());
                let line = self
                    .lines
                    .recv_timeout(left)
                    .unwrap_or_else(|_| panic!("watch printed {i} of {n} messages"));
                let hint: Value = serde_json::from_str(&line).expect("a JSON line");
                assert!(
                    hint["cursor"]
                        .as_str()
                        .is_some_and(|c| c.starts_with("bob.")),
                    "{hint}"
                );
                hint["id"].as_str().expect("id").to_string()
            })
            .collect()
    }
}

impl Drop for Watch {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Waits until `host`'s daemon logged `n` open streams.
fn until_open(host: &Host, n: usize) {
    wait_for(&format!("{n} open stream(s) on {}", host.name), || {
        (host.log().matches(OPEN).count() >= n).then_some(())
    });
}

fn send(host: &Host, subject: &str) -> String {
    host.send("alice", "bob", subject, "body")["id"]
        .as_str()
        .expect("id")
        .to_string()
}

#[test]
fn watch_follows_the_daemon_across_a_restart_and_resumes_from_its_cursor_file() {
    let mut h = Host::init("hoste");
    h.register("alice");
    h.register("bob");
    h.start_with(&[LOG]);
    let file = h.home.file("bob.cursor");
    let file_arg = file.to_str().expect("utf-8 path");
    // `kept` stays up through the daemon's restart; `filed` keeps its position in a file.
    let kept = Watch::start(&h, &[]);
    let filed = Watch::start(&h, &["--cursor-file", file_arg]);
    until_open(&h, 2);
    // The stream's start position is kept before any mail: a restart now would lose nothing.
    wait_for("the cursor file holds the start position", || {
        std::fs::read_to_string(&file)
            .ok()
            .filter(|c| c.trim().starts_with("bob."))
    });
    let m1 = send(&h, "one");
    assert_eq!(kept.next_ids(1), vec![m1.clone()]);
    assert_eq!(filed.next_ids(1), vec![m1.clone()]);
    let m1_position = h.inbox("bob")["cursor"]
        .as_str()
        .expect("cursor")
        .to_string();
    wait_for("the cursor file names m1's position", || {
        std::fs::read_to_string(&file)
            .ok()
            .filter(|c| c.trim() == m1_position)
    });
    drop(filed);

    // A stop with a stream open ends it at once.
    let asked = Instant::now();
    h.stop();
    let stopped = asked.elapsed();
    assert!(stopped < Duration::from_secs(5), "exit took {stopped:?}");

    // Mail arrives after the restart, before either watch is back on the stream.
    h.start_with(&[LOG]);
    let (m2, m3) = (send(&h, "two"), send(&h, "three"));
    // `kept` reconnects by itself with Last-Event-ID: m2 and m3, never m1 again.
    assert_eq!(kept.next_ids(2), vec![m2.clone(), m3.clone()]);
    // A new watch from the cursor file: what came after m1.
    let filed = Watch::start(&h, &["--cursor-file", file_arg]);
    assert_eq!(filed.next_ids(2), vec![m2, m3]);
    until_open(&h, 2);
    // Live mail reaches both, and nothing else came before it.
    let m4 = send(&h, "four");
    assert_eq!(kept.next_ids(1), vec![m4.clone()]);
    assert_eq!(filed.next_ids(1), vec![m4]);
}

#[test]
fn watch_for_an_agent_that_is_not_here_exits_3_with_suggestions() {
    let mut h = Host::init("hostf");
    h.register("bob");
    h.start(None);
    let out = h.home.run(&["watch", "--as", "bbo"]);
    assert_eq!(out.status.code(), Some(3), "{out:?}");
    assert!(out.stderr.contains("bob"), "{}", out.stderr);
    let out = h.home.run(&["watch", "--as", "bob", "--after", "alice.3"]);
    assert_eq!(out.status.code(), Some(2), "{out:?}");
}
