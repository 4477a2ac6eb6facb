//! Two daemons in this test process (`agentmbx::daemon::run`), each with its own home, clock
//! offset and failpoints, on 127.0.0.1 ports: paired with the real `pair` and `join` commands
//! against their APIs, they exchange mail over the LAN and the delivery receipt comes back; a
//! failpoint armed on one daemon stops that daemon's LAN deliveries only.
//!
//! The daemons share one tokio runtime owned by the test; the test thread itself stays
//! synchronous (the helper's polling and child commands block).

use std::net::SocketAddr;
use std::sync::Arc;

use crate::helper;
use crate::helper::mesh::open_read_only;
use crate::helper::{request, wait_for, Home, HttpResponse};
use agentmbx::config::Config;
use agentmbx::daemon::{self, DaemonLock, Listeners, RunError};
use agentmbx::paths::Paths;
use agentmbx_protocol::clock::{SharedClock, SystemClock};
use agentmbx_protocol::failpoint::Failpoints;
use serde_json::{json, Value};

/// The environment an in-process daemon's config is loaded with: the helper's for child
/// processes (no mDNS, keys in files, the LAN server on 127.0.0.1 port 0), none of this
/// process's own.
fn test_env(var: &str) -> Option<String> {
    let value = match var {
        "MBX_NO_MDNS" => "1",
        "MBX_KEYSTORE" => "file",
        "MBX_LAN_BIND" => "127.0.0.1",
        "MBX_LAN_PORT" => "0",
        _ => return None,
    };
    Some(value.to_string())
}

/// The config of `paths` under [`test_env`], with the API on port 0.
fn load_config(paths: &Paths) -> Result<Config, agentmbx::config::ConfigError> {
    let mut config = Config::load_with_env(paths, test_env)?;
    config.api_port = 0;
    Ok(config)
}

/// One daemon running in this process.
struct Node {
    name: String,
    home: Home,
    api: SocketAddr,
    lan: SocketAddr,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    task: Option<tokio::task::JoinHandle<Result<(), RunError>>>,
    _lock: DaemonLock,
}

impl Node {
    /// Initializes host `name` with agent `agent` (the real `init` and `whoami --as`), then
    /// prepares and runs its daemon on `rt` with its clock `offset_ms` off and `failpoints`.
    fn start(
        rt: &tokio::runtime::Runtime,
        name: &str,
        agent: &str,
        offset_ms: i64,
        failpoints: Failpoints,
    ) -> Node {
        let home = Home::new();
        home.run(&["init", "--host", name]).assert_success();
        home.run(&["whoami", "--as", agent]).assert_success();
        let paths = Paths::at(home.path());
        let config = load_config(&paths).expect("config");
        let lock = daemon::lock_home(&paths).expect("lock the home");
        let reload: daemon::Reload = {
            let paths = paths.clone();
            Box::new(move || load_config(&paths))
        };
        let prepared = daemon::prepare(paths, config, reload, &lock).expect("prepare");
        let (lan_addr, api_addr) = (prepared.config().lan_addr(), prepared.config().api_addr());
        let listeners = rt.block_on(async {
            Listeners {
                lan: tokio::net::TcpListener::bind(lan_addr)
                    .await
                    .expect("bind LAN"),
                api: tokio::net::TcpListener::bind(api_addr)
                    .await
                    .expect("bind API"),
            }
        });
        let lan = listeners.lan.local_addr().expect("LAN address");
        let api = listeners.api.local_addr().expect("API address");
        let clock: SharedClock = Arc::new(SystemClock::with_offset(offset_ms));
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let task = rt.spawn(daemon::run(prepared, listeners, clock, failpoints, async {
            let _ = stopped.await;
        }));
        let node = Node {
            name: name.to_string(),
            home,
            api,
            lan,
            stop: Some(stop),
            task: Some(task),
            _lock: lock,
        };
        wait_for(&format!("{name}'s API"), || {
            (node.api_call("GET", "/v1/health", None).status == 200).then_some(())
        });
        node
    }

    /// One local API call with the bearer token.
    fn api_call(&self, method: &str, path: &str, body: Option<&Value>) -> HttpResponse {
        let body = body.map(Value::to_string);
        request(
            self.api,
            method,
            path,
            Some(&self.home.token()),
            &[],
            body.as_deref(),
        )
    }

    /// `POST /v1/messages`; asserts 201 and returns the id.
    fn send(&self, from: &str, to: &str, body: &str) -> String {
        let r = self.api_call(
            "POST",
            "/v1/messages",
            Some(&json!({"from": from, "to": [to], "subject": "in process", "body": body})),
        );
        assert_eq!(r.status, 201, "{r:#?}");
        r.json()["id"].as_str().expect("id").to_string()
    }

    /// Ids in `agent`'s inbox.
    fn inbox_ids(&self, agent: &str) -> Vec<String> {
        let r = self.api_call("GET", &format!("/v1/inbox?as={agent}"), None);
        assert_eq!(r.status, 200, "{r:#?}");
        r.json()["messages"]
            .as_array()
            .expect("messages")
            .iter()
            .map(|m| m["id"].as_str().expect("id").to_string())
            .collect()
    }

    /// Waits until `agent`'s inbox holds `id`.
    fn wait_inbox(&self, agent: &str, id: &str) {
        wait_for(&format!("{id} in {agent}@{}'s inbox", self.name), || {
            self.inbox_ids(agent).iter().any(|i| i == id).then_some(())
        });
    }

    /// `SELECT COUNT(*)` with one text parameter, on `mailbox.db` read-only.
    fn count(&self, sql: &str, param: &str) -> i64 {
        open_read_only(&self.home.file("mailbox.db"))
            .query_row(sql, [param], |r| r.get(0))
            .unwrap_or_else(|e| panic!("{sql}: {e}"))
    }

    /// One text column of one row, if any.
    fn text(&self, sql: &str, params: &[&str]) -> Option<String> {
        open_read_only(&self.home.file("mailbox.db"))
            .query_row(sql, rusqlite::params_from_iter(params), |r| r.get(0))
            .ok()
    }

    /// Pairs this daemon (token holder) with `joiner`: `pair` here, `join <LAN address>
    /// <token>` there, as a user does; waits until both pin each other.
    fn pair_with(&self, joiner: &Node) {
        let out = self.home.run(&["pair", "--json"]);
        out.assert_success();
        let token = out.json()["token"].as_str().expect("token").to_string();
        joiner
            .home
            .run(&["join", &self.lan.to_string(), &token])
            .assert_success();
        for (a, b) in [(self, joiner), (joiner, self)] {
            wait_for(&format!("{} to pin {}", a.name, b.name), || {
                (a.count("SELECT COUNT(*) FROM peers WHERE host = ?1", &b.name) == 1).then_some(())
            });
        }
    }

    /// Ends the daemon: completes its shutdown future and waits for `run` to return `Ok`.
    fn shut_down(&mut self, rt: &tokio::runtime::Runtime) {
        let _ = self.stop.take().expect("running").send(());
        let task = self.task.take().expect("running");
        let ran = rt
            .block_on(async { tokio::time::timeout(helper::TIMEOUT, task).await })
            .unwrap_or_else(|_| panic!("{}'s run did not return after shutdown", self.name))
            .expect("the run task");
        assert!(ran.is_ok(), "{}: {ran:?}", self.name);
        assert!(
            !self.home.file("api.addr").exists() && !self.home.file("lan.addr").exists(),
            "{} removes its address files on the way out",
            self.name
        );
    }
}

/// The runtime both daemons run on.
fn runtime() -> tokio::runtime::Runtime {
    agentmbx::install_tls_provider();
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime")
}

/// The real time (ms since the epoch).
fn now_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .expect("after 1970")
        .as_millis() as i64
}

#[test]
fn two_in_process_daemons_pair_exchange_mail_and_the_receipt_comes_back() {
    let rt = runtime();
    // B's clock runs 90 s ahead of A's, well inside the ±5 min hop window.
    let mut a = Node::start(&rt, "hosta", "alice", 0, Failpoints::none());
    let mut b = Node::start(&rt, "hostb", "bob", 90_000, Failpoints::none());
    a.pair_with(&b);

    let before = now_ms();
    let id = a.send("alice", "bob@hostb", "hello bob, in one process");
    b.wait_inbox("bob", &id);
    let read = b.api_call("GET", &format!("/v1/messages/{id}?as=bob"), None);
    assert_eq!(read.status, 200, "{read:#?}");
    assert_eq!(read.json()["body"], "hello bob, in one process");
    assert_eq!(read.json()["from"], "alice@hosta");
    // Each daemon stamps with its own clock: B's receive time is ahead of the real one.
    let received_ms: i64 = open_read_only(&b.home.file("mailbox.db"))
        .query_row(
            "SELECT received_at FROM messages WHERE id = ?1",
            [&id],
            |r| r.get(0),
        )
        .expect("B's copy of the message");
    assert!(
        received_ms >= before + 80_000,
        "B stamps with its own clock: received_at {received_ms}, real time before send {before}"
    );

    // The row went over the LAN and the read receipt came back to A.
    wait_for("A's row to be settled over the LAN", || {
        (a.text(
            "SELECT state || ' ' || via FROM outbox WHERE msg_id = ?1",
            &[&id],
        )
        .as_deref()
            == Some("delivered lan"))
        .then_some(())
    });
    wait_for("A to hold bob's read receipt", || {
        (a.text(
            "SELECT state FROM remote_receipts WHERE msg_id = ?1 AND recipient = ?2",
            &[&id, "bob@hostb"],
        )
        .as_deref()
            == Some("read"))
        .then_some(())
    });

    b.shut_down(&rt);
    a.shut_down(&rt);
}

#[test]
fn a_failpoint_armed_on_one_in_process_daemon_does_not_fire_on_the_other() {
    let rt = runtime();
    // B starts first with nothing armed, then A with its LAN delivery loop hanging at its first
    // pass. Were the two sets one, B's first pass would have met the armed hit and hung B
    // instead, and nothing B sends would arrive.
    let mut b = Node::start(&rt, "hostb", "bob", 0, Failpoints::none());
    let mut a = Node::start(
        &rt,
        "hosta",
        "alice",
        0,
        Failpoints::parse("lan:deliver-pass=hang"),
    );
    a.pair_with(&b);

    let stuck = a.send("alice", "bob@hostb", "held by A's hung loop");
    // Two of B's messages, one after the other: B's loop passes again and again while A's row,
    // sent first, would have gone long before them had A's loop not hung.
    for subject in ["B's loop still runs", "and runs again"] {
        let goes = b.send("bob", "alice@hosta", subject);
        a.wait_inbox("alice", &goes);
        wait_for("B's row to be delivered", || {
            (b.text("SELECT state FROM outbox WHERE msg_id = ?1", &[&goes])
                .as_deref()
                == Some("delivered"))
            .then_some(())
        });
    }
    // A's row never left: its delivery loop is the one that hangs.
    assert!(!b.inbox_ids("bob").contains(&stuck));
    assert_eq!(
        b.count("SELECT COUNT(*) FROM messages WHERE id = ?1", &stuck),
        0
    );
    assert_ne!(
        a.text("SELECT state FROM outbox WHERE msg_id = ?1", &[&stuck])
            .as_deref(),
        Some("delivered")
    );

    b.shut_down(&rt);
    // A's delivery task awaits forever (that is what `hang` does), so A's run cannot finish
    // its shutdown: its API stops, and dropping the runtime ends the rest.
    let _ = a.stop.take().expect("running").send(());
    wait_for("A's API to stop", || {
        std::net::TcpStream::connect(a.api).is_err().then_some(())
    });
    drop(rt);
}
