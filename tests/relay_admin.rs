//! `agentmbx relay revoke` and `agentmbx relay deny` against a real `agentmbx relay serve`
//! child process (spec §8 "Revocation"; design README "One process writes a store"): offline on
//! `--store-dir` (refused with exit code 4 while the relay runs on it) and through the running
//! relay's admin endpoint with and without the right admin token (`--admin-token-file` beats
//! `MBX_RELAY_ADMIN_TOKEN`; plain `http://` only to this machine unless `--insecure-http`).
//! Hosts here are bare keys that enrol and sign hops over plain HTTP, so the test sees the
//! relay's exact answers.

use std::net::SocketAddr;

use serde_json::{json, Value};

use agentmbx_protocol::hop;
use agentmbx_protocol::keys::HostKey;
use agentmbx_protocol::records;

use crate::helper::mesh::Relay;
use crate::helper::relay_cli::{relay_cli, serve, ADMIN};
use crate::helper::{request, Output};

/// Milliseconds since the epoch (hop timestamps; the relay checks ±5 min).
fn now_ms() -> i64 {
    let since = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .expect("clock after 1970");
    i64::try_from(since.as_millis()).expect("ms fit i64")
}

/// A host known only by its key.
struct Bare {
    name: String,
    key: HostKey,
}

impl Bare {
    fn new(name: &str) -> Bare {
        Bare {
            name: name.into(),
            key: HostKey::generate(),
        }
    }

    fn fp(&self) -> String {
        self.key.public().fingerprint()
    }

    /// Challenge + enrol; returns the enrol answer's status.
    fn enrol(&self, addr: SocketAddr) -> u16 {
        let pk = self.key.public().to_b64();
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
        request(addr, "POST", "/v1/relay/enrol", None, &[], Some(&body)).status
    }

    /// A signed pull: `(status, code)`.
    fn pull(&self, addr: SocketAddr) -> (u16, String) {
        let target = "/v2/relay/items?after=0";
        let h = hop::sign_relay_hop(&self.key, &self.name, "GET", target, now_ms(), "");
        let pairs = h.pairs();
        let headers: Vec<(&str, &str)> = pairs.iter().map(|(k, v)| (*k, v.as_str())).collect();
        let r = request(addr, "GET", target, None, &headers, None);
        let code = r.json()["code"].as_str().unwrap_or("").to_owned();
        (r.status, code)
    }
}

#[track_caller]
fn assert_exit(out: &Output, code: i32, stderr_part: &str) {
    assert_eq!(out.code(), Some(code), "{out:#?}");
    assert!(out.stderr.contains(stderr_part), "{out:#?}");
}

#[test]
fn offline_revoke_and_deny_are_refused_while_the_relay_runs_and_work_on_its_store() {
    let mut relay = Relay::start(None);
    let store = relay.store_dir();
    let dir = store.to_str().expect("UTF-8 path").to_owned();
    let addr = relay.proc().addr;
    let (a, b) = (Bare::new("alpha"), Bare::new("beta"));
    assert_eq!(a.enrol(addr), 200);
    assert_eq!(b.enrol(addr), 200);
    assert_eq!(a.pull(addr).0, 200);

    // The relay holds relay.lock: every offline command refuses with exit code 4.
    let out = relay_cli(&["revoke", &a.fp(), "--store-dir", &dir], &[]);
    assert_exit(&out, 4, "a running relay holds");
    assert!(out.stderr.contains("--url"), "{out:#?}");
    assert_exit(
        &relay_cli(&["deny", "client-x", "--store-dir", &dir], &[]),
        4,
        "a running relay holds",
    );
    assert_exit(
        &relay_cli(&["deny", "--list", "--store-dir", &dir], &[]),
        4,
        "a running relay holds",
    );
    // ... and changed nothing.
    assert_eq!(a.pull(addr).0, 200);

    relay.kill();
    let out = relay_cli(&["revoke", &a.fp(), "--store-dir", &dir, "--json"], &[]);
    out.assert_success();
    let j = out.json();
    assert_eq!(j["newly_revoked"], true, "{j}");
    assert_eq!(j["host"]["fingerprint"], a.fp().as_str());
    assert_eq!(j["host"]["host_name"], "alpha");
    // Again (by key this time): already revoked, still success.
    let out = relay_cli(
        &["revoke", &a.key.public().to_b64(), "--store-dir", &dir],
        &[],
    );
    out.assert_success();
    assert!(out.stdout.starts_with("already revoked:"), "{out:#?}");
    assert_exit(
        &relay_cli(&["revoke", "0000-0000-0000-0000", "--store-dir", &dir], &[]),
        3,
        "no enrolment matches 0000-0000-0000-0000",
    );
    assert_exit(
        &relay_cli(&["revoke", "not-a-host", "--store-dir", &dir], &[]),
        2,
        "neither a host key",
    );
    assert_exit(&relay_cli(&["revoke", &a.fp()], &[]), 2, "give --store-dir");
    let empty = tempfile::tempdir().expect("temp dir");
    assert_exit(
        &relay_cli(
            &[
                "revoke",
                &a.fp(),
                "--store-dir",
                empty.path().to_str().expect("UTF-8"),
            ],
            &[],
        ),
        3,
        "holds no relay store",
    );

    // Deny: at least 15 minutes, listed, removable.
    assert_exit(
        &relay_cli(
            &["deny", &b.fp(), "--until", "5m", "--store-dir", &dir],
            &[],
        ),
        2,
        "at least 15 min",
    );
    assert_exit(
        &relay_cli(
            &["deny", &b.fp(), "--until", "soon", "--store-dir", &dir],
            &[],
        ),
        2,
        "--until \"soon\"",
    );
    let out = relay_cli(
        &[
            "deny",
            &b.fp(),
            "--until",
            "2h",
            "--store-dir",
            &dir,
            "--json",
        ],
        &[],
    );
    out.assert_success();
    assert_eq!(out.json()["entry"]["kind"], "host");
    let out = relay_cli(&["deny", "client-x", "--client", "--store-dir", &dir], &[]);
    out.assert_success();
    assert!(
        out.stdout.contains("denied client client-x until removed"),
        "{out:#?}"
    );
    let out = relay_cli(&["deny", "--list", "--store-dir", &dir, "--json"], &[]);
    out.assert_success();
    let entries: Vec<Value> = out.json()["entries"].as_array().expect("entries").clone();
    let values: Vec<&str> = entries
        .iter()
        .map(|e| e["value"].as_str().expect("value"))
        .collect();
    assert_eq!(values, vec!["client-x", b.fp().as_str()], "{entries:?}");
    assert!(entries.iter().all(|e| e["active"] == true));
    out.assert_success();
    let out = relay_cli(&["deny", "client-x", "--remove", "--store-dir", &dir], &[]);
    out.assert_success();
    assert_exit(
        &relay_cli(&["deny", "client-x", "--remove", "--store-dir", &dir], &[]),
        3,
        "no deny-list entry",
    );

    // Back up: the revoked host stays revoked (also if it enrols again), the denied one is denied.
    relay.launch(None);
    let addr = relay.proc().addr;
    assert_eq!(a.pull(addr), (403, "REVOKED".to_owned()));
    assert_eq!(a.enrol(addr), 403);
    assert_eq!(b.pull(addr), (403, "DENIED".to_owned()));
    assert_eq!(b.enrol(addr), 403);
}

#[test]
fn through_the_admin_endpoint_with_and_without_the_right_token() {
    let dir = tempfile::tempdir().expect("temp dir");
    let store = dir.path().join("store");
    let relay = serve(&store, &[("MBX_RELAY_ADMIN_TOKEN", ADMIN)]);
    let url = format!("http://{}", relay.addr);
    let (a, b) = (Bare::new("alpha"), Bare::new("beta"));
    assert_eq!(a.enrol(relay.addr), 200);
    assert_eq!(b.enrol(relay.addr), 200);

    // No token given: usage error; a wrong one: refused by the relay; nothing changed.
    assert_exit(
        &relay_cli(&["revoke", &a.fp(), "--url", &url], &[]),
        2,
        "MBX_RELAY_ADMIN_TOKEN",
    );
    let wrong = [("MBX_RELAY_ADMIN_TOKEN", "wrong-token-0123456789abcdef")];
    assert_exit(
        &relay_cli(&["revoke", &a.fp(), "--url", &url], &wrong),
        1,
        "refused the admin token",
    );
    assert_eq!(a.pull(relay.addr).0, 200);
    // The right one, from a file: the host's next request is refused at once.
    let token_file = dir.path().join("admin.token");
    std::fs::write(&token_file, format!("{ADMIN}\n")).expect("write token");
    let tf = token_file.to_str().expect("UTF-8");
    let out = relay_cli(
        &[
            "revoke",
            &a.fp(),
            "--url",
            &url,
            "--admin-token-file",
            tf,
            "--json",
        ],
        &[],
    );
    out.assert_success();
    assert_eq!(out.json()["newly_revoked"], true);
    assert_eq!(a.pull(relay.addr), (403, "REVOKED".to_owned()));
    assert!(!out.stdout.contains(ADMIN) && !out.stderr.contains(ADMIN));

    // Deny through the endpoint (token from the environment), list, remove.
    let right = [("MBX_RELAY_ADMIN_TOKEN", ADMIN)];
    let out = relay_cli(
        &["deny", &b.fp(), "--until", "1h", "--url", &url, "--json"],
        &right,
    );
    out.assert_success();
    assert_eq!(out.json()["entry"]["value"], b.fp().as_str());
    assert_eq!(b.pull(relay.addr), (403, "DENIED".to_owned()));
    let out = relay_cli(&["deny", "--list", "--url", &url, "--json"], &right);
    out.assert_success();
    assert_eq!(out.json()["entries"][0]["value"], b.fp().as_str());
    assert_exit(
        &relay_cli(&["deny", &b.fp(), "--until", "1m", "--url", &url], &right),
        2,
        "at least 15 min",
    );
    relay_cli(&["deny", &b.fp(), "--remove", "--url", &url], &right).assert_success();
    assert_eq!(b.pull(relay.addr).0, 200);
    assert_exit(
        &relay_cli(&["revoke", "0000-0000-0000-0000", "--url", &url], &right),
        3,
        "no enrolment matches",
    );
    // While it runs, the offline form is refused.
    assert_exit(
        &relay_cli(
            &[
                "revoke",
                &b.fp(),
                "--store-dir",
                store.to_str().expect("UTF-8"),
            ],
            &[],
        ),
        4,
        "a running relay holds",
    );

    // A relay without an admin token has no admin endpoint.
    let mut plain = Relay::start(None);
    let plain_url = plain.url();
    let c = Bare::new("gamma");
    assert_eq!(c.enrol(plain.proc().addr), 200);
    assert_exit(
        &relay_cli(&["revoke", &c.fp(), "--url", &plain_url], &right),
        1,
        "has no admin endpoint",
    );
    assert_eq!(c.pull(plain.proc().addr).0, 200);
}

#[test]
fn the_admin_token_file_beats_the_environment_and_plain_http_goes_only_to_this_machine() {
    let dir = tempfile::tempdir().expect("temp dir");
    let store = dir.path().join("store");
    let relay = serve(&store, &[("MBX_RELAY_ADMIN_TOKEN", ADMIN)]);
    let url = format!("http://{}", relay.addr);
    let a = Bare::new("alpha");
    assert_eq!(a.enrol(relay.addr), 200);
    let right_file = dir.path().join("right.token");
    std::fs::write(&right_file, format!("{ADMIN}\n")).expect("write token");
    let wrong_file = dir.path().join("wrong.token");
    std::fs::write(&wrong_file, "wrong-token-0123456789abcdef\n").expect("write token");
    let (right, wrong) = (
        right_file.to_str().expect("UTF-8"),
        wrong_file.to_str().expect("UTF-8"),
    );
    let env_right = [("MBX_RELAY_ADMIN_TOKEN", ADMIN)];
    let env_wrong = [("MBX_RELAY_ADMIN_TOKEN", "wrong-token-0123456789abcdef")];
    let list = |extra: &[&str], env: &[(&str, &str)]| {
        let mut args = vec!["deny", "--list", "--url", url.as_str()];
        args.extend_from_slice(extra);
        relay_cli(&args, env)
    };

    // A wrong file with the right variable: the file is used, and the error says so.
    let out = list(&["--admin-token-file", wrong], &env_right);
    assert_exit(
        &out,
        1,
        &format!("refused the admin token from --admin-token-file {wrong}"),
    );
    // The right file with a wrong variable: the file wins.
    list(&["--admin-token-file", right], &env_wrong).assert_success();
    // Only a wrong variable: refused, naming it.
    let out = list(&[], &env_wrong);
    assert_exit(
        &out,
        1,
        "refused the admin token from MBX_RELAY_ADMIN_TOKEN",
    );
    // A malformed token names its source, never the text.
    let short = dir.path().join("short.token");
    std::fs::write(&short, "short-secret\n").expect("write token");
    let out = list(
        &["--admin-token-file", short.to_str().expect("UTF-8")],
        &env_right,
    );
    assert_exit(&out, 2, "--admin-token-file");
    assert!(!out.stderr.contains("short-secret"), "{out:#?}");
    let out = list(&[], &[("MBX_RELAY_ADMIN_TOKEN", "short-secret")]);
    assert_exit(&out, 2, "MBX_RELAY_ADMIN_TOKEN: the admin token must be");
    assert!(!out.stderr.contains("short-secret"), "{out:#?}");

    // Plain http:// to an address that is not loopback: refused before anything is sent (the
    // deny is not made). 192.0.2.1 (TEST-NET-1) is never contacted: the refusal comes first.
    // That `--insecure-http` lifts it is a unit test of `plain_http_allowed` (no traffic).
    let far = format!("http://192.0.2.1:{}", relay.addr.port());
    let out = relay_cli(
        &["deny", &a.fp(), "--until", "1h", "--url", &far],
        &env_right,
    );
    assert_exit(&out, 2, "--insecure-http");
    assert!(out.stderr.contains("unencrypted"), "{out:#?}");
    assert_eq!(a.pull(relay.addr).0, 200, "nothing was sent");
    // Loopback by name is fine without the flag (refused here only by the token).
    let local = format!("http://localhost:{}", relay.addr.port());
    let out = relay_cli(&["deny", "--list", "--url", &local], &env_wrong);
    assert!(
        !out.stderr.contains("--insecure-http"),
        "loopback needs no flag: {out:#?}"
    );
}
