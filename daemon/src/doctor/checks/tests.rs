//! The daemon and peers checks of `checks/mod.rs`: a daemon that is down, another host's or
//! one without its token, and peers whose signed status must match the pinned key.

use std::time::Duration;

use axum::routing::get;
use axum::Router;
use serde_json::json;

use agentmbx_protocol::keys::HostKey;

use crate::doctor::test_support::*;
use crate::doctor::*;

// ---- daemon and peers ----------------------------------------------------------------------

#[tokio::test]
async fn daemon_not_running_fails_and_another_host_warns() {
    let h = initialized();
    let set_api_port = |port: u16| {
        let cfg = std::fs::read_to_string(h.paths.config_file()).unwrap_or_default();
        let cfg: String = cfg
            .lines()
            .filter(|l| !l.trim_start().starts_with("api_port"))
            .map(|l| format!("{l}\n"))
            .collect();
        std::fs::write(h.paths.config_file(), format!("api_port = {port}\n{cfg}")).unwrap();
    };
    let configured = closed_port();
    set_api_port(configured);
    std::fs::write(
        h.paths.api_addr_file(),
        format!("127.0.0.1:{}", closed_port()),
    )
    .unwrap();
    let r = h.run(&["daemon"]).await;
    let c = one(&r, "daemon");
    assert_eq!(
        c.status,
        Status::Fail,
        "connection refused fails (wire.md §7 item 3)"
    );
    assert!(c.summary.starts_with("daemon not answering"));
    assert_eq!(r.exit_code(), 1);
    // It names the address it tried, where that came from and the home, and suggests the
    // foreground daemon as well as the service.
    let home = h.paths.home().display().to_string();
    assert!(c.summary.contains(&home), "{c:?}");
    let all = c.details.join("\n");
    assert!(
        all.contains("api.addr") && all.contains("written by the daemon last started"),
        "{all}"
    );
    assert!(all.contains("agentmbx daemon\n"), "{all}");
    assert!(all.contains("agentmbx daemon install"), "{all}");
    assert!(
        all.contains(&format!(
            "also tried 127.0.0.1:{configured} (from config.toml)"
        )),
        "a stale api.addr does not hide the configured port: {all}"
    );

    // Without api.addr, the configured port is tried and named as such.
    std::fs::remove_file(h.paths.api_addr_file()).unwrap();
    let port = closed_port();
    set_api_port(port);
    let r = h.run(&["daemon"]).await;
    let c = one(&r, "daemon");
    assert_eq!(c.status, Status::Fail, "{c:?}");
    assert!(c.summary.contains(&format!(":{port} ")), "{c:?}");
    assert!(
        c.details.join("\n").contains("is from config.toml"),
        "{c:?}"
    );

    let health = |host: &'static str, version: &'static str| {
        Router::new().route(
            "/v1/health",
            get(move || async move {
                axum::Json(json!({"status": "ok", "host": host, "version": version}))
            }),
        )
    };
    let other = serve(health("other", crate::VERSION)).await;
    std::fs::write(h.paths.api_addr_file(), other.to_string()).unwrap();
    let r = h.run(&["daemon"]).await;
    let c = one(&r, "daemon");
    assert_eq!(c.status, Status::Fail, "this host's daemon does not answer");
    assert!(c.summary.contains("serves host `other`"), "{}", c.summary);
    assert_eq!(r.exit_code(), 1);

    let old = serve(health("doc", "0.0.1")).await;
    std::fs::write(h.paths.api_addr_file(), old.to_string()).unwrap();
    let c = h.run(&["daemon"]).await.checks.remove(0);
    assert_eq!(c.status, Status::Warn);
    assert!(c.summary.contains("version 0.0.1"));

    let me = serve(health("doc", crate::VERSION)).await;
    std::fs::write(h.paths.api_addr_file(), me.to_string()).unwrap();
    let c = h.run(&["daemon"]).await.checks.remove(0);
    assert_eq!(c.status, Status::Ok, "{c:?}");

    // A stale api.addr (the daemon now runs on the configured port): found there.
    set_api_port(me.port());
    std::fs::write(
        h.paths.api_addr_file(),
        format!("127.0.0.1:{}", closed_port()),
    )
    .unwrap();
    let c = h.run(&["daemon"]).await.checks.remove(0);
    assert_eq!(c.status, Status::Ok, "{c:?}");
    assert!(c.summary.contains(&me.to_string()), "{c:?}");

    // Something else on the port: this host's daemon is not answering.
    let other_program = serve(Router::new().route("/v1/health", get(|| async { "hello" }))).await;
    std::fs::write(h.paths.api_addr_file(), other_program.to_string()).unwrap();
    let c = h.run(&["daemon"]).await.checks.remove(0);
    assert_eq!(c.status, Status::Fail);
    assert!(
        c.summary.contains("not an AgentMBX daemon"),
        "{}",
        c.summary
    );
}

/// Doctor reads health with this home's API token, so the clone checks get each reason's
/// peer and relay (the daemon gives only codes without it); without a readable token a peer
/// conflict is still a warning, not `ok`.
#[tokio::test]
async fn doctor_reads_health_with_the_api_token_and_still_warns_without_it() {
    let h = initialized();
    h.set_relay("http://127.0.0.1:9", None);
    const TOKEN: &str = "doctor-test-token";
    let fake = serve(Router::new().route(
        "/v1/health",
        get(|headers: axum::http::HeaderMap| async move {
            let authed = headers
                .get("authorization")
                .is_some_and(|v| v.as_bytes() == format!("Bearer {TOKEN}").as_bytes());
            let reason = if authed {
                json!({"code": "peer-key-clone", "detail": "…", "peer": "xb"})
            } else {
                json!({"code": "peer-key-clone"})
            };
            axum::Json(json!({"status": "degraded", "host": "doc",
                              "version": crate::VERSION, "reasons": [reason]}))
        }),
    ))
    .await;
    std::fs::write(h.paths.api_addr_file(), fake.to_string()).unwrap();
    std::fs::write(h.paths.api_token(), format!("{TOKEN}\n")).unwrap();
    let r = h.run(&["peer-key-clone"]).await;
    let p = one(&r, "peer-key-clone");
    assert_eq!(p.status, Status::Warn, "{p:?}");
    assert!(p.summary.contains("(xb)"), "{p:?}");

    std::fs::remove_file(h.paths.api_token()).unwrap();
    let r = h.run(&["peer-key-clone"]).await;
    let p = one(&r, "peer-key-clone");
    assert_eq!(p.status, Status::Warn, "{p:?}");
    assert!(p.details.join("\n").contains("api.token"), "{p:?}");
}

#[tokio::test]
async fn peers_need_a_status_signed_by_the_pinned_key() {
    let h = initialized();
    let r = h.run(&["peers"]).await;
    assert_eq!(one(&r, "peers").status, Status::Skip);
    let good = HostKey::generate();
    let good_pub = good.public().to_b64();
    let good_addr = fake_peer(good, "work", true).await;
    let impostor = fake_peer(HostKey::generate(), "lab", true).await;
    let refuses = HostKey::generate();
    let refuses_pub = refuses.public().to_b64();
    let refuses_addr = fake_peer(refuses, "den", false).await;
    let lab_pinned = HostKey::generate().public().to_b64();
    h.mailbox()
        .with(|c| {
            crate::mailbox::peers::add(c, "work", &good_pub, NOW)?;
            crate::mailbox::peers::set_addr(c, "work", &good_addr.to_string(), "cli")?;
            Ok(())
        })
        .unwrap();
    let r = h.run(&["peers"]).await;
    let c = one(&r, "peers");
    assert_eq!(c.status, Status::Ok, "{c:?}");
    assert!(c.details[0].contains("version 9.9.9"));

    h.mailbox()
        .with(|c| {
            crate::mailbox::peers::add(c, "den", &refuses_pub, NOW)?;
            crate::mailbox::peers::set_addr(c, "den", &refuses_addr.to_string(), "cli")?;
            crate::mailbox::peers::add(c, "gone", &HostKey::generate().public().to_b64(), NOW)?;
            crate::mailbox::peers::set_addr(
                c,
                "gone",
                &format!("127.0.0.1:{}", closed_port()),
                "cli",
            )?;
            Ok(())
        })
        .unwrap();
    // Unreachable, or not accepting our signature: warn.
    let started = std::time::Instant::now();
    let r = h.run(&["peers"]).await;
    assert!(started.elapsed() < Duration::from_secs(5));
    let c = one(&r, "peers");
    assert_eq!(c.status, Status::Warn, "{c:?}");
    assert_eq!(
        c.summary,
        "2 of 3 peer(s) not reachable or not accepting our signature"
    );
    let all = c.details.join("\n");
    assert!(all.contains("gone at "), "{all}");
    assert!(
        all.contains("den at ") && all.contains("does not accept our signed request"),
        "{all}"
    );
    assert!(
        all.contains("gone may be down; if it moved: agentmbx peers addr gone IP:PORT"),
        "{all}"
    );
    assert_eq!(c.fix, None, "no command fixes a peer that is down");

    // A status not signed by the pinned key: fail.
    h.mailbox()
        .with(|c| {
            crate::mailbox::peers::add(c, "lab", &lab_pinned, NOW)?;
            crate::mailbox::peers::set_addr(c, "lab", &impostor.to_string(), "cli")
        })
        .unwrap();
    let r = h.run(&["peers"]).await;
    let c = one(&r, "peers");
    assert_eq!(c.status, Status::Fail, "{c:?}");
    assert_eq!(r.exit_code(), 1);
    assert!(
        c.summary
            .starts_with("1 of 4 peer(s) answered a status not signed by the pinned key"),
        "{}",
        c.summary
    );
    let all = c.details.join("\n");
    assert!(
        all.contains("lab at ") && all.contains("not signed by the pinned key"),
        "{all}"
    );
    assert!(all.contains("gone at "), "{all}");
    assert!(
        all.contains("den at ") && all.contains("does not accept our signed request"),
        "{all}"
    );
    assert_eq!(c.fix.as_deref(), Some("agentmbx peers remove lab"));
}

#[tokio::test]
async fn a_peer_without_a_lan_address_is_fine_through_a_working_relay() {
    let h = initialized();
    h.mailbox()
        .with(|c| {
            crate::mailbox::peers::add(c, "hostb", &HostKey::generate().public().to_b64(), NOW)
        })
        .unwrap();
    let r = h.run(&["peers"]).await;
    let c = one(&r, "peers");
    assert_eq!(c.status, Status::Warn, "{c:?}");
    let all = c.details.join("\n");
    assert!(
        all.contains("hostb: no LAN address known, and no relay is configured"),
        "{all}"
    );
    assert!(all.contains("agentmbx peers addr hostb IP:PORT"), "{all}");
    assert_eq!(c.fix, None, "no placeholder command");

    let relay = HostKey::generate();
    let url = fake_relay(&relay).await;
    h.set_relay(&url, Some(relay.public().to_b64()));
    let r = h.run(&["peers"]).await;
    let c = one(&r, "peers");
    assert_eq!(c.status, Status::Ok, "{c:?}");
    assert_eq!(
        c.summary,
        "1 peer(s) reachable, 1 of them via the relay only"
    );
    assert!(c.details[0].contains("hostb: via the relay only"), "{c:?}");

    // The relay presents another key: relay use is stopped, so the peer has no route.
    h.set_relay(&url, Some(HostKey::generate().public().to_b64()));
    let c = h.run(&["peers"]).await.checks.remove(0);
    assert_eq!(c.status, Status::Warn, "{c:?}");
    assert!(
        c.details[0].contains("the relay does not answer with its pinned key"),
        "{c:?}"
    );
}
