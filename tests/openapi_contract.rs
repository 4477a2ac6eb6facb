//! The local API's OpenAPI document (daemon/openapi.json) against a real daemon: schemathesis
//! generates requests from the document (valid ones and malformed ones) and checks every answer
//! (`not_a_server_error`: no 5xx; `status_code_conformance`: every status is documented for
//! its operation; `positive_data_acceptance`: a request valid by the document is not refused,
//! 404/409 for state aside; `response_schema_conformance`: every answer matches its schema).
//! Settings that must not vary (deterministic generation, examples per operation, the values
//! that depend on the daemon's state) are in tests/schemathesis.toml.
//!
//! schemathesis is a Python tool: the test runs the `st` named by `MBX_SCHEMATHESIS`, which
//! `.ci/run` installs (pinned, tests/schemathesis-requirements.txt) and sets. Without it the
//! test skips, saying why, except under CI (`CI` set), where it fails. All traffic goes to the
//! daemon on 127.0.0.1 (proxies are disabled for the child).

use crate::helper;

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use crate::helper::{Daemon, Home};

/// Longest the schemathesis run may take (it takes about 15 s on 2 cores; the bound is for a
/// loaded CI machine).
const RUN_TIMEOUT: Duration = Duration::from_secs(600);

/// The repository's root (the daemon package's parent).
fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("the daemon package has a parent")
        .to_path_buf()
}

/// The `st` to run, or why there is none.
fn schemathesis() -> Result<PathBuf, String> {
    let Some(st) = std::env::var_os("MBX_SCHEMATHESIS").filter(|v| !v.is_empty()) else {
        return Err(
            "MBX_SCHEMATHESIS is not set (.ci/run installs schemathesis and sets it to its `st`)"
                .into(),
        );
    };
    let st = PathBuf::from(st);
    if st.is_file() {
        Ok(st)
    } else {
        Err(format!("MBX_SCHEMATHESIS={} is not a file", st.display()))
    }
}

#[test]
fn the_openapi_document_holds_against_a_running_daemon() {
    let st = match schemathesis() {
        Ok(st) => st,
        Err(why) if std::env::var_os("CI").is_none() => {
            eprintln!("skipped: {why}");
            return;
        }
        Err(why) => panic!("CI is set, so the OpenAPI contract check must run: {why}"),
    };
    let home = Home::new();
    // The run sends a few thousand requests as a handful of agents in a minute or two: rate
    // classes (429 RATE_LIMIT, documented; tests/rate.rs and the API's unit tests check them)
    // are set out of its way, so a valid request is never refused for its rate.
    let unlimited = ["wait", "send", "register", "other"]
        .iter()
        .map(|c| format!("{c}_burst = 1000000\n{c}_per_min = 6000000\n"))
        .collect::<String>();
    home.write_config(&format!("[api_rate]\n{unlimited}"));
    let daemon = Daemon::start(&home);
    let token = home.token();
    // `alice` exists before the run: schemathesis.toml addresses generated sends to her.
    let registered = helper::request(
        daemon.addr,
        "POST",
        "/v1/agents",
        Some(&token),
        &[],
        Some(r#"{"name":"alice"}"#),
    );
    assert_eq!(registered.status, 200, "{registered:?}");

    let work = tempfile::tempdir().expect("temp dir");
    let mut cmd = Command::new(&st);
    cmd.arg("--config-file")
        .arg(repo().join("tests/schemathesis.toml"))
        .arg("run")
        .arg(repo().join("daemon/openapi.json"))
        .args(["--url", &format!("http://{}", daemon.addr)])
        .arg("--no-color")
        .env("MBX_CONTRACT_TOKEN", &token)
        .env("NO_PROXY", "*")
        .env("no_proxy", "*")
        .current_dir(work.path())
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    for proxy in [
        "HTTP_PROXY",
        "HTTPS_PROXY",
        "ALL_PROXY",
        "http_proxy",
        "https_proxy",
        "all_proxy",
    ] {
        cmd.env_remove(proxy);
    }
    let started = Instant::now();
    let mut child = cmd
        .spawn()
        .unwrap_or_else(|e| panic!("run {}: {e}", st.display()));
    // Read both pipes on threads so a long report cannot block the child.
    let out = child.stdout.take().expect("stdout");
    let err = child.stderr.take().expect("stderr");
    let read = |mut r: Box<dyn std::io::Read + Send>| {
        std::thread::spawn(move || {
            let mut text = String::new();
            let _ = r.read_to_string(&mut text);
            text
        })
    };
    let (out, err) = (read(Box::new(out)), read(Box::new(err)));
    let status = loop {
        if let Some(status) = child.try_wait().expect("try_wait") {
            break status;
        }
        if started.elapsed() > RUN_TIMEOUT {
            let _ = child.kill();
            let _ = child.wait();
            panic!("schemathesis did not finish within {RUN_TIMEOUT:?}");
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    let seconds = started.elapsed().as_secs_f64();
    let (out, err) = (
        out.join().unwrap_or_default(),
        err.join().unwrap_or_default(),
    );
    let cases = out
        .lines()
        .find(|l| l.contains(" generated"))
        .unwrap_or("")
        .trim();
    eprintln!("schemathesis ran in {seconds:.1} s: {cases}");
    assert!(
        status.success(),
        "the daemon does not hold to daemon/openapi.json ({status}):\n{out}\n{err}\n--- daemon log ---\n{}",
        daemon.stderr()
    );
    assert!(out.contains("passed"), "{out}");
    // The generated sends were accepted and delivered, not only answered.
    let inbox = daemon.get("/v1/inbox?as=alice&limit=200", Some(&token));
    assert_eq!(inbox.status, 200, "{inbox:?}");
    let delivered = inbox.json()["messages"].as_array().map_or(0, Vec::len);
    assert!(delivered > 0, "no generated send reached alice: {out}");
    let log = daemon.stderr();
    assert!(
        !log.contains("panicked") && !log.contains("local API request failed"),
        "the daemon logged a fault:\n{log}"
    );
}
