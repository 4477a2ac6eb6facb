//! What a relay operator meets around `agentmbx relay serve`, against the real binary: the
//! store's files (directory 0700, files 0600 whatever the umask; an operator's own directory
//! left alone), a clean stop that leaves the whole store in `relay.db`, a second relay on the
//! same store (waits `lock_wait_ms`, names the holder, exits 4), the start-up log (admin
//! endpoint, enrolment authority; never the admin token), the one-shot operator commands'
//! quiet default log level, and the environment and files `relay serve --help` documents.

use crate::helper;

use std::net::SocketAddr;
use std::os::unix::fs::PermissionsExt as _;
use std::path::Path;
use std::process::{Command, Stdio};

use serde_json::json;

use agentmbx_protocol::envelope::{self, Draft};
use agentmbx_protocol::keys::{EncKey, HostKey};
use agentmbx_protocol::{b64, hop, records, seal, ulid};

use crate::helper::mesh::free_port;
use crate::helper::{bin, command, request, run, Daemon, RELAY_LISTENING};

/// Milliseconds since the epoch (hop timestamps and envelope dates; the relay checks ±5 min).
fn now_ms() -> i64 {
    let since = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .expect("clock after 1970");
    i64::try_from(since.as_millis()).expect("ms fit i64")
}

/// A host known only by its keys, talking plain HTTP to the relay.
struct Bare {
    name: String,
    key: HostKey,
    enc: EncKey,
}

impl Bare {
    fn new(name: &str) -> Bare {
        Bare {
            name: name.into(),
            key: HostKey::generate(),
            enc: EncKey::generate(),
        }
    }

    fn pubkey(&self) -> String {
        self.key.public().to_b64()
    }

    /// Challenge + enrol; asserts it is admitted.
    fn enrol(&self, addr: SocketAddr) {
        let pk = self.pubkey();
        let body = json!({"host": self.name, "pubkey": pk}).to_string();
        let r = request(addr, "POST", "/v1/relay/challenge", None, &[], Some(&body));
        assert_eq!(r.status, 200, "{r:#?}");
        let challenge = r.json()["challenge"]
            .as_str()
            .expect("challenge")
            .to_owned();
        let sig = self
            .key
            .sign(records::enrol_canonical(&challenge, &self.name, &pk, "").as_bytes());
        let body = json!({"host": self.name, "pubkey": pk, "owner_fp": "", "sig": sig}).to_string();
        let r = request(addr, "POST", "/v1/relay/enrol", None, &[], Some(&body));
        assert_eq!(r.status, 200, "{r:#?}");
    }

    /// Pushes one sealed envelope for `to`; asserts the relay accepted it; returns its id.
    fn push_sealed(&self, addr: SocketAddr, to: &Bare) -> String {
        let now = now_ms();
        let draft = Draft {
            from: format!("agent@{}", self.name),
            to: vec![format!("agent@{}", to.name)],
            subject: "hello".into(),
            body: "sealed for the relay test".into(),
            ..Draft::default()
        };
        let id = ulid::Generator::new().next(now);
        let mut plain = envelope::build(&draft, id.clone(), now).expect("build envelope");
        plain.sign(&self.name, &self.key).expect("sign envelope");
        let sealed = seal::seal_envelope(&plain, &to.enc.public(), &self.name, &self.key)
            .expect("seal envelope");
        let wire = sealed.wire_json();
        let body = json!({"items": [{
            "kind": "envelope",
            "item_id": id,
            "targets": [{"host_pubkey": to.pubkey(), "wire_b64": b64::encode(wire.as_bytes())}],
        }]})
        .to_string();
        let target = "/v2/relay/items";
        let h = hop::sign_relay_hop(&self.key, &self.name, "POST", target, now, &body);
        let pairs = h.pairs();
        let headers: Vec<(&str, &str)> = pairs.iter().map(|(k, v)| (*k, v.as_str())).collect();
        let r = request(addr, "POST", target, None, &headers, Some(&body));
        assert_eq!(r.status, 200, "{r:#?}");
        assert_eq!(r.json()["results"][0]["status"], "accepted", "{r:#?}");
        id
    }
}

/// `relay serve --store-dir <store>` on 127.0.0.1 and a free port under `umask 000` (so every
/// file mode the test sees is the relay's own choice), with `env`.
fn serve_umask_000(store: &Path, env: &[(&str, &str)]) -> Daemon {
    let port = free_port().to_string();
    let mut cmd = Command::new("sh");
    for (name, _) in std::env::vars_os() {
        if name.to_string_lossy().starts_with("MBX_") || name == "PORT" {
            cmd.env_remove(name);
        }
    }
    cmd.env("MBX_LOG", "info")
        .args(["-c", "umask 000 && exec \"$0\" \"$@\"", bin()])
        .args(["relay", "serve", "--bind", "127.0.0.1", "--port", &port])
        .arg("--store-dir")
        .arg(store)
        .stdin(Stdio::null());
    for (k, v) in env {
        cmd.env(k, v);
    }
    Daemon::spawn(cmd, RELAY_LISTENING).expect("relay started")
}

/// `relay serve` on 127.0.0.1, port 0, with the helper's environment.
fn serve(store: &Path, env: &[(&str, &str)]) -> Daemon {
    let mut cmd = command(&["relay", "serve", "--bind", "127.0.0.1", "--port", "0"]);
    cmd.arg("--store-dir").arg(store);
    for (k, v) in env {
        cmd.env(k, v);
    }
    Daemon::spawn(cmd, RELAY_LISTENING).expect("relay started")
}

fn mode(path: &Path) -> u32 {
    std::fs::metadata(path)
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
        .permissions()
        .mode()
        & 0o777
}

#[test]
fn the_store_is_private_and_a_clean_stop_leaves_it_whole_in_relay_db() {
    let tmp = tempfile::tempdir().expect("temp dir");
    let store = tmp.path().join("srv").join("store");
    let mut relay = serve_umask_000(&store, &[]);
    let addr = relay.addr;
    let (alpha, beta) = (Bare::new("alpha"), Bare::new("beta"));
    alpha.enrol(addr);
    beta.enrol(addr);
    let id = alpha.push_sealed(addr, &beta);

    // Private under umask 000: the directory the relay created and every store file.
    assert_eq!(mode(&store), 0o700);
    for name in [
        "relay.db",
        "relay.db-wal",
        "relay.db-shm",
        "relay.lock",
        "relay.key",
    ] {
        assert_eq!(mode(&store.join(name)), 0o600, "{name}");
    }
    assert!(
        std::fs::metadata(store.join("relay.db-wal"))
            .expect("WAL")
            .len()
            > 0,
        "the writes sit in the WAL while the relay runs"
    );
    relay.wait_for_stderr("admin endpoint off");

    // SIGTERM: a clean stop, and relay.db alone is the whole store.
    let (status, log) = relay.terminate();
    assert!(status.success(), "{status:?}\n{log}");
    let wal_len = std::fs::metadata(store.join("relay.db-wal")).map_or(0, |m| m.len());
    assert_eq!(wal_len, 0, "the WAL is empty or gone:\n{log}");
    let copy = tempfile::tempdir().expect("temp dir");
    std::fs::copy(store.join("relay.db"), copy.path().join("relay.db")).expect("copy relay.db");
    let conn = helper::mesh::open_read_only(&copy.path().join("relay.db"));
    let stored: Vec<String> = conn
        .prepare("SELECT item_id FROM items WHERE target_pubkey = ?1")
        .expect("prepare")
        .query_map([beta.pubkey()], |r| r.get(0))
        .expect("query")
        .collect::<Result<_, _>>()
        .expect("rows");
    assert_eq!(stored, vec![id]);
    let enrolled: i64 = conn
        .query_row("SELECT count(*) FROM enrolments", [], |r| r.get(0))
        .expect("count");
    assert_eq!(enrolled, 2);
}

#[test]
fn an_operators_own_store_directory_is_left_as_it_is_with_a_warning() {
    let tmp = tempfile::tempdir().expect("temp dir");
    let store = tmp.path().join("store");
    std::fs::create_dir(&store).expect("mkdir");
    std::fs::set_permissions(&store, std::fs::Permissions::from_mode(0o755)).expect("chmod");
    let relay = serve_umask_000(&store, &[]);
    let log = relay.stderr();
    assert!(
        log.contains("the relay store directory can be read by group or others"),
        "{log}"
    );
    assert_eq!(mode(&store), 0o755, "not changed");
    for name in ["relay.db", "relay.lock", "relay.key"] {
        assert_eq!(mode(&store.join(name)), 0o600, "{name}");
    }
}

#[test]
fn a_second_relay_on_the_store_says_who_holds_it_and_exits_4_after_lock_wait_ms() {
    let tmp = tempfile::tempdir().expect("temp dir");
    let store = tmp.path().join("store");
    std::fs::create_dir(&store).expect("mkdir");
    std::fs::write(store.join("relay.toml"), "lock_wait_ms = 400\n").expect("relay.toml");
    let first = serve(&store, &[]);

    let started = std::time::Instant::now();
    let mut cmd = command(&["relay", "serve", "--bind", "127.0.0.1", "--port", "0"]);
    cmd.arg("--store-dir").arg(&store);
    let out = run(cmd);
    assert!(started.elapsed() >= std::time::Duration::from_millis(400));
    assert_eq!(out.code(), Some(4), "{out:#?}");
    let lock = store.join("relay.lock");
    let holder = format!("another relay process (pid {}, since ", first.pid());
    // Logged once when the wait starts ...
    let waiting = format!("holds {}; waiting up to 400 ms", lock.display());
    let lines: Vec<&str> = out
        .stderr
        .lines()
        .filter(|l| l.contains(&waiting))
        .collect();
    assert_eq!(lines.len(), 1, "{out:#?}");
    assert!(
        lines[0].contains("WARN") && lines[0].contains(&holder),
        "{out:#?}"
    );
    // ... and the error line names the holder too.
    let last = out.stderr.lines().last().unwrap_or("");
    assert!(last.starts_with("agentmbx: "), "{out:#?}");
    assert!(last.contains(&holder), "{out:#?}");
    assert!(
        last.contains(&format!(
            "holds {}; gave up after waiting 400 ms",
            lock.display()
        )),
        "{out:#?}"
    );

    // The first relay still serves.
    let r = first.get("/v2/relay/info", None);
    assert_eq!(r.status, 200, "{r:#?}");
}

#[test]
fn the_start_up_log_says_whether_the_admin_endpoint_is_on_never_the_token() {
    let token = "admin-token-0123456789abcdef";
    let tmp = tempfile::tempdir().expect("temp dir");
    let relay = serve(
        &tmp.path().join("store"),
        &[("MBX_RELAY_ADMIN_TOKEN", token)],
    );
    let log = relay.stderr();
    assert!(log.contains("admin endpoint on"), "{log}");
    assert!(log.contains("MBX_RELAY_ADMIN_TOKEN"), "{log}");
    assert!(!log.contains(token), "{log}");
    assert!(log.contains("authority=\"host-key-challenge\""), "{log}");
}

/// `agentmbx <args>` without `MBX_LOG`, so the command's own default level applies.
fn run_default_log(args: &[&str]) -> helper::Output {
    let mut cmd = command(args);
    cmd.env_remove("MBX_LOG");
    run(cmd)
}

#[test]
fn offline_operator_commands_log_warnings_only_by_default() {
    let out = run_default_log(&["relay", "keygen"]);
    out.assert_success();
    assert!(out.stdout.starts_with("MBX_RELAY_KEY="), "{out:#?}");
    assert!(!out.stderr.contains("INFO"), "{out:#?}");

    let tmp = tempfile::tempdir().expect("temp dir");
    let store = tmp.path().join("store");
    let (status, _) = serve(&store, &[]).terminate();
    assert!(status.success());
    let dir = store.to_str().expect("UTF-8 path");
    for args in [
        &["relay", "deny", "--list", "--store-dir", dir][..],
        &["relay", "deny", "client-x", "--client", "--store-dir", dir][..],
    ] {
        let out = run_default_log(args);
        out.assert_success();
        assert!(!out.stderr.contains("INFO"), "{out:#?}");
        assert!(!out.stderr.contains("relay store opened"), "{out:#?}");
    }
    // MBX_LOG still raises it.
    let out = run(command(&["relay", "deny", "--list", "--store-dir", dir]));
    out.assert_success();
    assert!(out.stderr.contains("relay store opened"), "{out:#?}");
}

#[test]
fn serve_help_and_its_man_page_name_the_relays_environment_and_files() {
    let out = run(command(&["relay", "serve", "--help"]));
    out.assert_success();
    let page = std::fs::read_to_string(
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../man/agentmbx-relay-serve.1"),
    )
    .expect("man page");
    for needle in [
        "MBX_RELAY_KEY",
        "MBX_RELAY_ADMIN_TOKEN",
        "PORT",
        "relay.toml",
        "[limits]",
        "[rate]",
        "[authority]",
        "admin_token_file",
        "trust_proxy",
        "lock_wait_ms",
    ] {
        assert!(
            out.stdout.contains(needle),
            "--help lacks {needle}:\n{}",
            out.stdout
        );
        assert!(page.contains(needle), "the man page lacks {needle}");
    }
}

#[test]
fn bind_and_port_in_relay_toml_apply_when_no_flag_is_given_and_a_flag_wins() {
    let tmp = tempfile::tempdir().expect("temp dir");
    let store = tmp.path().join("store");
    std::fs::create_dir(&store).expect("store dir");
    std::fs::set_permissions(&store, std::fs::Permissions::from_mode(0o700)).expect("chmod");
    let port = free_port();
    std::fs::write(
        store.join("relay.toml"),
        format!("bind = \"127.0.0.1\"\nport = {port}\n"),
    )
    .expect("relay.toml");
    let mut cmd = command(&["relay", "serve"]);
    cmd.arg("--store-dir").arg(&store);
    let relay = Daemon::spawn(cmd, RELAY_LISTENING).expect("relay started");
    assert_eq!(
        relay.addr,
        SocketAddr::from(([127, 0, 0, 1], port)),
        "relay.toml's bind and port"
    );
    let (status, _) = relay.terminate();
    assert!(status.success(), "{status:?}");
    let mut cmd = command(&["relay", "serve", "--port", "0"]);
    cmd.arg("--store-dir").arg(&store);
    let relay = Daemon::spawn(cmd, RELAY_LISTENING).expect("relay started");
    assert_ne!(relay.addr.port(), port, "--port wins over relay.toml");
    assert!(relay.addr.ip().is_loopback(), "bind still from relay.toml");
}
