//! Two hosts and a relay, each a real `agentmbx` child process: the relay serves on a port
//! chosen once (so a restarted relay comes back at the same URL and the daemons' pinned
//! configuration stays valid), the hosts pin each other and the relay, and their stores are
//! read through read-only SQLite connections (never written).

use std::net::TcpListener;
use std::path::PathBuf;

use rusqlite::{Connection, OpenFlags, OptionalExtension};
use serde_json::{json, Value};

use super::{command, poll, wait_for, Daemon, Home, HttpResponse, RELAY_LISTENING, TIMEOUT};

/// Relay pull interval of the test daemons (ms; the product's floor is 100).
pub const PULL_INTERVAL_MS: &str = "100";

/// Opens an SQLite file read-only (WAL readers never block the writer).
pub fn open_read_only(path: &std::path::Path) -> Connection {
    let conn = Connection::open_with_flags(
        path,
        OpenFlags::SQLITE_OPEN_READ_ONLY | OpenFlags::SQLITE_OPEN_NO_MUTEX,
    )
    .unwrap_or_else(|e| panic!("open {} read-only: {e}", path.display()));
    conn.busy_timeout(TIMEOUT).expect("busy timeout");
    conn
}

/// A port on 127.0.0.1 that was free a moment ago.
pub fn free_port() -> u16 {
    let l = TcpListener::bind("127.0.0.1:0").expect("bind 127.0.0.1:0");
    l.local_addr().expect("local addr").port()
}

/// Whether `needle` occurs in `haystack`.
pub fn contains(haystack: &[u8], needle: &[u8]) -> bool {
    !needle.is_empty() && haystack.windows(needle.len()).any(|w| w == needle)
}

/// A short random tag, so that plaintext searches cannot match by accident.
pub fn unique_tag() -> String {
    format!("{:016x}", rand::random::<u64>())
}

/// An `agentmbx relay serve` child on 127.0.0.1 and a fixed port, with its store directory.
pub struct Relay {
    dir: tempfile::TempDir,
    /// The TCP port, the same across restarts.
    pub port: u16,
    proc: Option<Daemon>,
    /// The relay key fingerprint, from its start-up log.
    pub fingerprint: String,
}

impl Relay {
    /// Starts a relay on a fresh store, with `failpoints` (`MBX_FAILPOINTS`) when given.
    pub fn start(failpoints: Option<&str>) -> Relay {
        let mut relay = Relay {
            dir: tempfile::tempdir().expect("temp dir"),
            port: free_port(),
            proc: None,
            fingerprint: String::new(),
        };
        relay.launch(failpoints);
        let log = relay.proc().stderr();
        relay.fingerprint = log
            .split("fingerprint=")
            .nth(1)
            .and_then(|r| r.split_whitespace().next())
            .unwrap_or_else(|| panic!("no relay fingerprint in the log:\n{log}"))
            .to_string();
        relay
    }

    /// (Re)starts the process on the same port and store. A bind that fails (the port is
    /// briefly held by something else) is retried under [`TIMEOUT`].
    pub fn launch(&mut self, failpoints: Option<&str>) {
        self.launch_with(failpoints, &[]);
    }

    /// [`Relay::launch`] with extra environment variables (e.g. `MBX_CLOCK_OFFSET_MS`).
    pub fn launch_with(&mut self, failpoints: Option<&str>, env: &[(&str, &str)]) {
        assert!(self.proc.is_none(), "the relay is already running");
        let store = self.store_dir();
        let port = self.port.to_string();
        let mut last_refusal = String::new();
        let proc = poll(|| {
            let mut cmd = command(&[
                "relay",
                "serve",
                "--bind",
                "127.0.0.1",
                "--port",
                &port,
                "--store-dir",
                store.to_str().expect("UTF-8 path"),
            ]);
            if let Some(fp) = failpoints {
                cmd.env("MBX_FAILPOINTS", fp);
            }
            for (k, v) in env {
                cmd.env(k, v);
            }
            match Daemon::spawn(cmd, RELAY_LISTENING) {
                Ok(d) => Some(d),
                Err(e) if e.stderr.contains("cannot bind") => {
                    last_refusal = e.stderr;
                    None
                }
                Err(e) => panic!("the relay exited at start-up: {e:#?}"),
            }
        })
        .unwrap_or_else(|| panic!("the relay could not bind port {port}: {last_refusal}"));
        assert_eq!(proc.addr.port(), self.port);
        self.proc = Some(proc);
    }

    /// The running process.
    pub fn proc(&mut self) -> &mut Daemon {
        self.proc.as_mut().expect("the relay is not running")
    }

    /// SIGKILLs the relay; returns its log.
    pub fn kill(&mut self) -> String {
        self.proc.take().expect("the relay is not running").kill()
    }

    /// `http://127.0.0.1:<port>`.
    pub fn url(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    /// The `--store-dir`.
    pub fn store_dir(&self) -> PathBuf {
        self.dir.path().join("store")
    }

    /// `relay.db`, read-only.
    pub fn db(&self) -> Connection {
        open_read_only(&self.store_dir().join("relay.db"))
    }

    /// Raw bytes of `relay.db`, `relay.db-wal` and `relay.db-shm` (those that exist), by name.
    pub fn store_files(&self) -> Vec<(String, Vec<u8>)> {
        ["relay.db", "relay.db-wal", "relay.db-shm"]
            .iter()
            .filter_map(|name| {
                std::fs::read(self.store_dir().join(name))
                    .ok()
                    .map(|b| (name.to_string(), b))
            })
            .collect()
    }

    /// `(seq, item_id)` of the items queued for `target`, in seq order.
    pub fn items_for(&self, target: &str) -> Vec<(i64, String)> {
        let db = self.db();
        let mut st = db
            .prepare("SELECT seq, item_id FROM items WHERE target_pubkey = ?1 ORDER BY seq")
            .expect("prepare");
        st.query_map([target], |r| Ok((r.get(0)?, r.get(1)?)))
            .expect("query items")
            .collect::<Result<_, _>>()
            .expect("items rows")
    }

    /// `(seq, wire_hash)` of the dedup rows of `item_id` (any sender, any target).
    pub fn dedup_rows(&self, item_id: &str) -> Vec<(i64, String)> {
        let db = self.db();
        let mut st = db
            .prepare("SELECT seq, wire_hash FROM dedup WHERE item_id = ?1 ORDER BY seq")
            .expect("prepare");
        st.query_map([item_id], |r| Ok((r.get(0)?, r.get(1)?)))
            .expect("query dedup")
            .collect::<Result<_, _>>()
            .expect("dedup rows")
    }

    /// `acked_through` recorded for `target`.
    pub fn acked_through(&self, target: &str) -> Option<i64> {
        self.db()
            .query_row(
                "SELECT acked_through FROM acked WHERE target_pubkey = ?1",
                [target],
                |r| r.get(0),
            )
            .optional()
            .expect("query acked")
    }
}

/// An outbox row as the tests see it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OutboxRow {
    /// `pending`, `relay-accepted`, `rejected` or `delivered`.
    pub state: String,
    /// Relay seq once accepted.
    pub seq: Option<i64>,
    /// Failed attempts.
    pub attempts: i64,
    /// Persisted wire bytes.
    pub wire: Option<Vec<u8>>,
    /// Their SHA-256.
    pub wire_hash: Option<String>,
    /// Last failure.
    pub last_error: Option<String>,
}

/// `(epoch, received_through, acked_through)` of a host for one relay.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Position {
    /// Relay epoch.
    pub epoch: String,
    /// Highest seq processed contiguously.
    pub received_through: i64,
    /// Highest seq the relay confirmed as acked.
    pub acked_through: i64,
}

/// One host: its home, its identity and (when running) its daemon.
pub struct Host {
    /// Host name.
    pub name: String,
    /// Its `MBX_HOME`.
    pub home: Home,
    /// Host public key (base64).
    pub pubkey: String,
    daemon: Option<Daemon>,
}

impl Host {
    /// `agentmbx init --host <name>` in a fresh home.
    pub fn init(name: &str) -> Host {
        let home = Home::new();
        home.run(&["init", "--host", name]).assert_success();
        let who = home.run(&["whoami", "--json"]);
        who.assert_success();
        let pubkey = who.json()["host_pubkey"]
            .as_str()
            .expect("host_pubkey")
            .to_string();
        Host {
            name: name.to_string(),
            home,
            pubkey,
            daemon: None,
        }
    }

    /// Registers `agent` as a mailbox of this host (`agentmbx whoami --as <agent>`; no daemon
    /// needed). Mail to an agent is addressed to one that registered on its host: a bare name
    /// known nowhere is refused at send, and direct mail to an agent a host does not have is
    /// not delivered to it.
    pub fn register(&self, agent: &str) {
        self.home.run(&["whoami", "--as", agent]).assert_success();
    }

    /// Starts the daemon (fast relay pulls), with `failpoints` armed when given.
    pub fn start(&mut self, failpoints: Option<&str>) {
        let env: Vec<(&str, &str)> = failpoints
            .map(|fp| ("MBX_FAILPOINTS", fp))
            .into_iter()
            .collect();
        self.start_with(&env);
    }

    /// Starts the daemon (fast relay pulls) with extra environment variables.
    pub fn start_with(&mut self, env: &[(&str, &str)]) {
        assert!(self.daemon.is_none(), "{} is already running", self.name);
        let mut cmd = self.home.command(&["daemon", "--api-port", "0"]);
        cmd.env("MBX_RELAY_PULL_INTERVAL_MS", PULL_INTERVAL_MS);
        for (k, v) in env {
            cmd.env(k, v);
        }
        let daemon = Daemon::try_start(cmd)
            .unwrap_or_else(|e| panic!("{} daemon exited at start-up: {e:#?}", self.name));
        self.daemon = Some(daemon);
    }

    /// A copy of this host's whole home (a restored backup, a cloned disk or VM) as another
    /// [`Host`] labelled `label`, its daemon not running: every file is copied except
    /// `api.addr` and `lan.addr`, so the copy's daemon takes ports of its own. Same host name,
    /// same keys, same store. This host's daemon must be stopped.
    pub fn copy_home(&self, label: &str) -> Host {
        assert!(
            self.daemon.is_none(),
            "stop {} before copying its home",
            self.name
        );
        fn copy_dir(from: &std::path::Path, to: &std::path::Path) {
            std::fs::create_dir_all(to).expect("create the copy's directory");
            let mode = std::fs::metadata(from)
                .expect("home metadata")
                .permissions();
            std::fs::set_permissions(to, mode).expect("the copy's directory mode");
            for entry in std::fs::read_dir(from).expect("read the home") {
                let entry = entry.expect("home entry");
                let target = to.join(entry.file_name());
                if entry.file_type().expect("file type").is_dir() {
                    copy_dir(&entry.path(), &target);
                } else {
                    std::fs::copy(entry.path(), &target).expect("copy a home file");
                }
            }
        }
        let home = Home::new();
        copy_dir(self.home.path(), home.path());
        for name in ["api.addr", "lan.addr"] {
            let _ = std::fs::remove_file(home.file(name));
        }
        Host {
            name: label.to_string(),
            home,
            pubkey: self.pubkey.clone(),
            daemon: None,
        }
    }

    /// The running daemon's LAN server address (from its `LAN server listening on` line).
    pub fn lan_addr(&self) -> std::net::SocketAddr {
        super::lan_addr(&self.log()).expect("the daemon announced its LAN address")
    }

    /// Pairs this host (token holder, daemon running) with `joiner` over the LAN: `pair` here,
    /// `join <this LAN address> <token>` there. Both end up pinning each other.
    pub fn pair_with(&self, joiner: &Host) {
        let out = self.home.run(&["pair", "--json"]);
        out.assert_success();
        let token = out.json()["token"].as_str().expect("token").to_string();
        let addr = self.lan_addr().to_string();
        joiner.home.run(&["join", &addr, &token]).assert_success();
        wait_for(&format!("{} to pin {}", self.name, joiner.name), || {
            (self.count("SELECT COUNT(*) FROM peers WHERE host = ?1", &joiner.name) == 1)
                .then_some(())
        });
    }

    /// The running daemon.
    pub fn daemon(&mut self) -> &mut Daemon {
        self.daemon.as_mut().expect("the daemon is not running")
    }

    /// Everything the running daemon logged.
    pub fn log(&self) -> String {
        self.daemon.as_ref().map(Daemon::stderr).unwrap_or_default()
    }

    /// SIGKILLs the daemon; returns its log.
    pub fn kill(&mut self) -> String {
        self.daemon
            .take()
            .expect("the daemon is not running")
            .kill()
    }

    /// SIGTERM, and checks the daemon stopped cleanly.
    pub fn stop(&mut self) {
        let (status, log) = self
            .daemon
            .take()
            .expect("the daemon is not running")
            .terminate();
        assert!(
            status.success(),
            "{} did not stop cleanly:\n{log}",
            self.name
        );
    }

    /// Stops the daemon (SIGTERM) and starts it again with `failpoints`.
    pub fn restart(&mut self, failpoints: Option<&str>) {
        self.stop();
        self.start(failpoints);
    }

    /// One local API call with the bearer token.
    pub fn api(&self, method: &str, path: &str, body: Option<&Value>) -> HttpResponse {
        self.api_with(method, path, &[], body)
    }

    /// One local API call with the bearer token and extra `headers`.
    pub fn api_with(
        &self,
        method: &str,
        path: &str,
        headers: &[(&str, &str)],
        body: Option<&Value>,
    ) -> HttpResponse {
        let daemon = self.daemon.as_ref().expect("the daemon is not running");
        let body = body.map(Value::to_string);
        super::request(
            daemon.addr,
            method,
            path,
            Some(&self.home.token()),
            headers,
            body.as_deref(),
        )
    }

    /// `POST /v1/messages`; asserts 201 and returns the answer.
    pub fn send(&self, from: &str, to: &str, subject: &str, body: &str) -> Value {
        let r = self.api(
            "POST",
            "/v1/messages",
            Some(&json!({"from": from, "to": [to], "subject": subject, "body": body})),
        );
        assert_eq!(r.status, 201, "{r:#?}");
        r.json()
    }

    /// `GET /v1/inbox?as=<agent>`; asserts 200.
    pub fn inbox(&self, agent: &str) -> Value {
        let r = self.api("GET", &format!("/v1/inbox?as={agent}"), None);
        assert_eq!(r.status, 200, "{r:#?}");
        r.json()
    }

    /// `GET /v1/messages/<id>?as=<agent>`; asserts 200.
    pub fn read(&self, id: &str, agent: &str) -> Value {
        let r = self.api("GET", &format!("/v1/messages/{id}?as={agent}"), None);
        assert_eq!(r.status, 200, "{r:#?}");
        r.json()
    }

    /// `POST /v1/ack`; asserts 200.
    pub fn ack(&self, agent: &str, ids: &[&str]) -> Value {
        let r = self.api("POST", "/v1/ack", Some(&json!({"as": agent, "ids": ids})));
        assert_eq!(r.status, 200, "{r:#?}");
        r.json()
    }

    /// `mailbox.db`, read-only.
    pub fn db(&self) -> Connection {
        open_read_only(&self.home.file("mailbox.db"))
    }

    /// `SELECT COUNT(*) …` with one text parameter.
    pub fn count(&self, sql: &str, param: &str) -> i64 {
        self.db()
            .query_row(sql, [param], |r| r.get(0))
            .unwrap_or_else(|e| panic!("{sql}: {e}"))
    }

    /// Stored copies of message `id` (rows of `messages`).
    pub fn messages_with_id(&self, id: &str) -> i64 {
        self.count("SELECT COUNT(*) FROM messages WHERE id = ?1", id)
    }

    /// All stored messages.
    pub fn message_count(&self) -> i64 {
        self.db()
            .query_row("SELECT COUNT(*) FROM messages", [], |r| r.get(0))
            .expect("count messages")
    }

    /// Delivery rows of message `id` (one per local recipient).
    pub fn deliveries_of(&self, id: &str) -> i64 {
        self.count("SELECT COUNT(*) FROM deliveries WHERE msg_id = ?1", id)
    }

    /// Quarantined relay items.
    pub fn quarantined(&self) -> i64 {
        self.db()
            .query_row("SELECT COUNT(*) FROM quarantine", [], |r| r.get(0))
            .expect("count quarantine")
    }

    /// The outbox row of message `id` (this host sends to one other host).
    pub fn outbox(&self, id: &str) -> Option<OutboxRow> {
        self.db()
            .query_row(
                "SELECT state, seq, attempts, wire, wire_hash, last_error FROM outbox WHERE msg_id = ?1",
                [id],
                |r| {
                    Ok(OutboxRow {
                        state: r.get(0)?,
                        seq: r.get(1)?,
                        attempts: r.get(2)?,
                        wire: r.get(3)?,
                        wire_hash: r.get(4)?,
                        last_error: r.get(5)?,
                    })
                },
            )
            .optional()
            .expect("query outbox")
    }

    /// Waits until the outbox row of `id` holds a relay accept: `relay-accepted`, or already
    /// `delivered` by the receipt that followed it (the seq stays); returns it.
    pub fn wait_relay_accepted(&self, id: &str) -> OutboxRow {
        wait_for(
            &format!("{}'s outbox row {id} to be relay-accepted", self.name),
            || {
                self.outbox(id).filter(|r| {
                    r.state == "relay-accepted" || (r.state == "delivered" && r.seq.is_some())
                })
            },
        )
    }

    /// Where this host stands with `relay`.
    pub fn position(&self, relay: &str) -> Option<Position> {
        self.db()
            .query_row(
                "SELECT epoch, received_through, acked_through FROM relay_position WHERE relay = ?1",
                [relay],
                |r| {
                    Ok(Position {
                        epoch: r.get(0)?,
                        received_through: r.get(1)?,
                        acked_through: r.get(2)?,
                    })
                },
            )
            .optional()
            .expect("query relay_position")
    }

    /// Ids in the `GET /v1/inbox?as=<agent>` page.
    pub fn inbox_ids(&self, agent: &str) -> Vec<String> {
        self.inbox(agent)["messages"]
            .as_array()
            .expect("messages array")
            .iter()
            .map(|m| m["id"].as_str().expect("id").to_string())
            .collect()
    }
}

/// A relay and two hosts, `hosta` and `hostb`, that pin each other and the relay.
pub struct Mesh {
    /// The relay.
    pub relay: Relay,
    /// The sender in most tests.
    pub a: Host,
    /// The receiver in most tests.
    pub b: Host,
}

impl Mesh {
    /// Starts the relay (with `relay_failpoints`), sets up both hosts, starts both daemons
    /// and waits until each published its enc-key ad (so a sender can seal for it).
    pub fn start(relay_failpoints: Option<&str>) -> Mesh {
        let mut mesh = Mesh::configured(relay_failpoints);
        mesh.a.start(None);
        mesh.b.start(None);
        for host in [&mut mesh.a, &mut mesh.b] {
            host.daemon().wait_for_stderr("published the enc-key ad");
        }
        mesh
    }

    /// Relay running, hosts initialized, paired and pinned to the relay, with the agents the
    /// tests mail registered (`alice` on hosta, `bob` on hostb); daemons not started.
    pub fn configured(relay_failpoints: Option<&str>) -> Mesh {
        let relay = Relay::start(relay_failpoints);
        let a = Host::init("hosta");
        let b = Host::init("hostb");
        a.register("alice");
        b.register("bob");
        a.home
            .run(&["peers", "add", "hostb", &b.pubkey])
            .assert_success();
        b.home
            .run(&["peers", "add", "hosta", &a.pubkey])
            .assert_success();
        for host in [&a, &b] {
            let out = host.home.run(&[
                "relay",
                "set",
                &relay.url(),
                "--key",
                &relay.fingerprint,
                "--json",
            ]);
            out.assert_success();
            assert_eq!(
                out.json()["fingerprint"],
                relay.fingerprint.as_str(),
                "{out:#?}"
            );
        }
        Mesh { relay, a, b }
    }

    /// Waits until the relay queue for `host` is empty.
    pub fn wait_queue_drained(&self, host: &Host) {
        wait_for(
            &format!("the relay queue for {} to drain", host.name),
            || self.relay.items_for(&host.pubkey).is_empty().then_some(()),
        );
    }
}
