//! Two real daemons in two network namespaces joined by a veth pair (10.77.0.1/24 and
//! 10.77.0.2/24): pairing by token, mail both ways over the LAN, mDNS discovery with a matching
//! fingerprint, and a host that moved to another address found again by its signed presence
//! beacon (`wire.md` §2.7, §2.9, §4 "Presence/healing" and "mDNS").
//!
//! mDNS runs only here, inside namespaces this test creates (never on the machine's real
//! interfaces). The test needs root and `ip netns`; elsewhere it prints why and passes without
//! running. Every command of the binary runs inside its host's namespace through
//! `ip netns exec`, so the local API (127.0.0.1 inside the namespace) is reached by the CLI.
//! The namespaces (and the veth pair with them) are removed on drop.

use crate::helper;

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use crate::helper::{Daemon, Home};
use serde_json::Value;

/// The LAN port inside both namespaces (each namespace has its own ports).
const LAN_PORT: &str = "7373";
/// How long mail, pairing and healing may take here (beacons start 2 s after a daemon).
const SLOW: Duration = Duration::from_secs(60);

/// Why this machine cannot run the test, if it cannot.
fn skip_reason() -> Option<String> {
    let uid = Command::new("id").arg("-u").output();
    match uid {
        Ok(out) if String::from_utf8_lossy(&out.stdout).trim() == "0" => {}
        Ok(_) => return Some("not running as root (network namespaces need it)".into()),
        Err(e) => return Some(format!("cannot run `id -u`: {e}")),
    }
    match Command::new("ip").arg("-V").output() {
        Ok(out) if out.status.success() => None,
        Ok(_) => Some("`ip -V` failed".into()),
        Err(e) => Some(format!("no `ip` command (iproute2): {e}")),
    }
}

/// Runs `ip <args>`; Err with its stderr when it fails.
fn ip(args: &[&str]) -> Result<(), String> {
    let out = Command::new("ip")
        .args(args)
        .stdin(Stdio::null())
        .output()
        .map_err(|e| format!("ip {}: {e}", args.join(" ")))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "ip {}: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        ))
    }
}

/// Two namespaces joined by a veth pair, removed on drop.
struct Netns {
    /// Namespace names (unique per test process).
    ns: [String; 2],
    /// The veth end inside each namespace.
    dev: [String; 2],
}

impl Netns {
    /// Creates `mbx<pid>a` / `mbx<pid>b` with 10.77.0.1/24 and 10.77.0.2/24 on the veth ends,
    /// and `lo` up in each. Err when the machine refuses (then the test is skipped).
    fn create() -> Result<Netns, String> {
        let pid = std::process::id();
        let net = Netns {
            ns: [format!("mbx{pid}a"), format!("mbx{pid}b")],
            dev: [format!("mbx{pid}va"), format!("mbx{pid}vb")],
        };
        ip(&["netns", "add", &net.ns[0]])?;
        let made = (|| {
            ip(&["netns", "add", &net.ns[1]])?;
            ip(&[
                "link",
                "add",
                &net.dev[0],
                "type",
                "veth",
                "peer",
                "name",
                &net.dev[1],
            ])?;
            for i in 0..2 {
                ip(&["link", "set", &net.dev[i], "netns", &net.ns[i]])?;
                let cidr = format!("10.77.0.{}/24", i + 1);
                ip(&["-n", &net.ns[i], "addr", "add", &cidr, "dev", &net.dev[i]])?;
                ip(&["-n", &net.ns[i], "link", "set", &net.dev[i], "up"])?;
                ip(&["-n", &net.ns[i], "link", "set", "lo", "up"])?;
            }
            Ok::<(), String>(())
        })();
        made.map(|()| net)
    }

    /// Moves namespace `i`'s address from 10.77.0.`from` to 10.77.0.`to` (a DHCP renumbering).
    fn renumber(&self, i: usize, from: u8, to: u8) {
        let add = format!("10.77.0.{to}/24");
        let del = format!("10.77.0.{from}/24");
        // Old one first: deleting a primary address also drops the secondaries of its subnet.
        ip(&["-n", &self.ns[i], "addr", "del", &del, "dev", &self.dev[i]]).expect("del address");
        ip(&["-n", &self.ns[i], "addr", "add", &add, "dev", &self.dev[i]]).expect("add address");
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        // Deleting a namespace deletes the veth end in it, and with it the pair.
        for ns in &self.ns {
            let _ = ip(&["netns", "del", ns]);
        }
    }
}

/// A host living in one namespace: its home, its address there, and its daemon.
struct NsHost {
    name: String,
    home: Home,
    ns: String,
    ip: String,
    daemon: Option<Daemon>,
}

impl NsHost {
    fn new(name: &str, ns: &str, ip: &str) -> NsHost {
        let host = NsHost {
            name: name.to_string(),
            home: Home::new(),
            ns: ns.to_string(),
            ip: ip.to_string(),
            daemon: None,
        };
        host.run(&["init", "--host", name]).assert_success();
        // Each host's `bob` receives the other's mail: registered, as an agent is before mail
        // is addressed to it.
        host.run(&["whoami", "--as", "bob"]).assert_success();
        host
    }

    /// `agentmbx <args>` inside the namespace, with a clean environment: this home, the LAN
    /// server on this host's address, the local API on the namespace's loopback, mDNS on.
    fn command(&self, args: &[&str]) -> Command {
        let mut cmd = Command::new("ip");
        cmd.args(["netns", "exec", &self.ns, helper::bin()])
            .args(args);
        for (name, _) in std::env::vars_os() {
            if name.to_string_lossy().starts_with("MBX_") || name == "PORT" {
                cmd.env_remove(name);
            }
        }
        cmd.env("MBX_HOME", self.home.path())
            .env("MBX_LOG", "info")
            .env("MBX_LAN_BIND", &self.ip)
            .env("MBX_LAN_PORT", LAN_PORT)
            .env("MBX_API_BIND", "127.0.0.1")
            .env("MBX_API_PORT", "0")
            .env("MBX_ADVERTISE", self.lan_addr())
            .stdin(Stdio::null());
        cmd
    }

    fn lan_addr(&self) -> String {
        format!("{}:{LAN_PORT}", self.ip)
    }

    fn run(&self, args: &[&str]) -> helper::Output {
        helper::run(self.command(args))
    }

    fn start(&mut self) {
        let daemon = Daemon::try_start(self.command(&["daemon"]))
            .unwrap_or_else(|e| panic!("{} daemon exited at start-up: {e:#?}", self.name));
        self.daemon = Some(daemon);
    }

    fn stop(&mut self) {
        if let Some(d) = self.daemon.take() {
            let (status, log) = d.terminate();
            assert!(status.success(), "{} stopped badly: {log}", self.name);
        }
    }

    fn log(&self) -> String {
        self.daemon.as_ref().map(Daemon::stderr).unwrap_or_default()
    }

    fn fingerprint(&self) -> String {
        let who = self.run(&["whoami", "--json"]);
        who.assert_success();
        who.json()["fingerprint"]
            .as_str()
            .expect("fingerprint")
            .to_string()
    }

    /// The pinned address of peer `host`, read with `peers --json`.
    fn peer_addr(&self, host: &str) -> Option<String> {
        let out = self.run(&["peers", "--json"]);
        if !out.status.success() {
            return None;
        }
        let list = out.json();
        list.as_array()?
            .iter()
            .find(|p| p["host"] == host)
            .and_then(|p| p["addr"].as_str().map(str::to_string))
    }

    /// Sends `alice@<self>` → `bob@<to>` through the CLI; returns the message id.
    fn send(&self, to: &str, subject: &str) -> String {
        let out = self.run(&[
            "send",
            "--as",
            "alice",
            "--to",
            &format!("bob@{to}"),
            "--subject",
            subject,
            "-m",
            &format!("body of {subject}"),
            "--json",
        ]);
        out.assert_success();
        out.json()["id"].as_str().expect("id").to_string()
    }

    /// Whether `bob`'s inbox here holds message `id`.
    fn has_mail(&self, id: &str) -> bool {
        let out = self.run(&["inbox", "--as", "bob", "--json"]);
        if !out.status.success() {
            return false;
        }
        let v = out.json();
        let list = v
            .get("messages")
            .and_then(Value::as_array)
            .or_else(|| v.as_array())
            .cloned()
            .unwrap_or_default();
        list.iter().any(|m| m["id"] == id)
    }
}

/// Polls `check` every 250 ms until it holds; panics naming `what` (with both logs) after
/// [`SLOW`].
fn wait_until(what: &str, hosts: [&NsHost; 2], mut check: impl FnMut() -> bool) {
    let deadline = Instant::now() + SLOW;
    while !check() {
        if Instant::now() >= deadline {
            panic!(
                "timed out after {SLOW:?} waiting for {what}\n--- {} log:\n{}\n--- {} log:\n{}",
                hosts[0].name,
                hosts[0].log(),
                hosts[1].name,
                hosts[1].log()
            );
        }
        std::thread::sleep(Duration::from_millis(250));
    }
}

#[test]
fn hosts_in_two_namespaces_pair_exchange_mail_discover_each_other_and_heal_a_move() {
    if let Some(reason) = skip_reason() {
        eprintln!("skipped: {reason}");
        return;
    }
    let net = match Netns::create() {
        Ok(n) => n,
        Err(e) => {
            eprintln!("skipped: cannot create network namespaces here ({e})");
            return;
        }
    };
    let mut a = NsHost::new("hosta", &net.ns[0], "10.77.0.1");
    let mut b = NsHost::new("hostb", &net.ns[1], "10.77.0.2");
    a.start();
    b.start();

    // Pairing: a token on A, `join` on B across the veth.
    let token = a.run(&["pair", "--json"]);
    token.assert_success();
    let token = token.json()["token"].as_str().expect("token").to_string();
    b.run(&["join", &a.lan_addr(), &token, "--json"])
        .assert_success();
    wait_until("A to pin hostb", [&a, &b], || {
        a.peer_addr("hostb").as_deref() == Some(b.lan_addr().as_str())
    });
    assert_eq!(b.peer_addr("hosta").as_deref(), Some(a.lan_addr().as_str()));

    // Mail both ways over the LAN.
    let to_b = a.send("hostb", "netns a to b");
    wait_until("A's mail in bob@hostb's inbox", [&a, &b], || {
        b.has_mail(&to_b)
    });
    let to_a = b.send("hosta", "netns b to a");
    wait_until("B's mail in bob@hosta's inbox", [&a, &b], || {
        a.has_mail(&to_a)
    });

    // mDNS inside the namespace: A sees B with B's pinned fingerprint.
    let b_fp = b.fingerprint();
    let mut last = Value::Null;
    wait_until("`discover` on A to list hostb as paired", [&a, &b], || {
        let out = a.run(&["discover", "--json"]);
        if !out.status.success() {
            last = Value::String(out.stderr.clone());
            return false;
        }
        last = out.json();
        last.as_array().is_some_and(|l| {
            l.iter().any(|h| {
                h["host"] == "hostb"
                    && h["fp"] == b_fp.as_str()
                    && h["standing"] == "paired"
                    && h["addr"] == b.lan_addr().as_str()
            })
        })
    });
    let entry = last
        .as_array()
        .and_then(|l| l.iter().find(|h| h["host"] == "hostb"))
        .cloned()
        .expect("hostb listed");
    assert_eq!(entry["status"], "paired", "{last}");

    // B moves (DHCP gives it 10.77.0.3) and restarts there. Mail A queues meanwhile fails at
    // the old address; B's signed beacon makes A probe the new one, adopt it, and deliver.
    b.stop();
    net.renumber(1, 2, 3);
    b.ip = "10.77.0.3".into();
    let queued = a.send("hostb", "sent while hostb moved");
    b.start();
    wait_until("A to adopt hostb's new address", [&a, &b], || {
        a.peer_addr("hostb").as_deref() == Some(b.lan_addr().as_str())
    });
    wait_until("the queued mail in bob@hostb's inbox", [&a, &b], || {
        b.has_mail(&queued)
    });
    let log = a.log();
    assert!(log.contains("peer moved"), "A logged the move: {log}");
}
