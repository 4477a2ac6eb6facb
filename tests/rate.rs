//! Rate classes on the local API against a real daemon (issue 19 part 4): with a tight
//! `[api_rate]` in `config.toml`, a flood of one agent's sends is answered 429 `RATE_LIMIT`
//! while another agent's go through, and the CLI waits out a 429 and succeeds, sending each
//! message once.

use crate::helper;

use std::time::{Duration, Instant};

use crate::helper::{Daemon, Home};

/// One send of `from` to `to` over the API, as JSON text.
fn send_body(from: &str, to: &str, subject: &str) -> String {
    serde_json::json!({"from": from, "to": [to], "subject": subject, "body": "x"}).to_string()
}

#[test]
fn the_cli_waits_out_a_429_and_another_agent_is_not_held_up() {
    let home = Home::new();
    // One send a burst, refilled one every 2 s.
    home.write_config("[api_rate]\nsend_burst = 1\nsend_per_min = 30\n");
    let daemon = Daemon::start(&home);
    let token = home.token();
    for name in ["alice", "bob", "carol"] {
        let r = helper::request(
            daemon.addr,
            "POST",
            "/v1/agents",
            Some(&token),
            &[],
            Some(&format!(r#"{{"name":"{name}"}}"#)),
        );
        assert_eq!(r.status, 200, "{r:?}");
    }
    let send = |from: &str, subject: &str| {
        helper::request_once(
            daemon.addr,
            "POST",
            "/v1/messages",
            Some(&token),
            &[],
            Some(&send_body(from, "bob", subject)),
        )
    };
    // alice's one token, then 429 with the relay's shape.
    assert_eq!(send("alice", "a0").status, 201);
    let limited = send("alice", "a1");
    assert_eq!(limited.status, 429, "{limited:?}");
    let v = limited.json();
    assert_eq!(v["code"], "RATE_LIMIT", "{v}");
    let after = v["retry_after"].as_f64().expect("retry_after");
    assert!(after > 0.0 && after <= 2.0, "{v}");
    let header: u64 = limited
        .header("retry-after")
        .expect("Retry-After")
        .parse()
        .unwrap();
    assert_eq!(header, after.ceil() as u64, "{v}");
    // carol is not held up by alice's flood.
    assert_eq!(send("carol", "c0").status, 201);

    // Two CLI sends back to back: the second meets an empty bucket, waits its retry_after and
    // succeeds (exit 0), each message stored once.
    for subject in ["cli-1", "cli-2"] {
        let started = Instant::now();
        home.send_json(subject, "x", &[]);
        if subject == "cli-2" {
            assert!(
                started.elapsed() >= Duration::from_millis(1_500),
                "the second send did not wait for a token: {:?}",
                started.elapsed()
            );
        }
    }
    let inbox = helper::request(
        daemon.addr,
        "GET",
        "/v1/inbox?as=bob&limit=50",
        Some(&token),
        &[],
        None,
    );
    let subjects: Vec<String> = inbox.json()["messages"]
        .as_array()
        .expect("messages")
        .iter()
        .map(|m| m["subject"].as_str().unwrap_or_default().to_string())
        .collect();
    let mut sorted = subjects.clone();
    sorted.sort();
    assert_eq!(sorted, ["a0", "c0", "cli-1", "cli-2"], "{subjects:?}");
    // Health is unmetered.
    for _ in 0..50 {
        assert_eq!(daemon.get("/v1/health", None).status, 200);
    }
}
