//! The clone checks (`checks/clone.rs`) read from a degraded daemon's health reasons.

use axum::routing::get;
use axum::Router;
use serde_json::{json, Value};

use crate::doctor::test_support::*;
use crate::doctor::*;

#[tokio::test]
async fn a_degraded_daemon_answers_and_its_clone_reasons_fail_or_warn_with_what_to_do() {
    let h = initialized();
    h.set_relay("http://127.0.0.1:9", None);
    let health = |body: Value| {
        Router::new().route(
            "/v1/health",
            get(move || {
                let body = body.clone();
                async move { axum::Json(body) }
            }),
        )
    };
    let ids = ["daemon", "host-key-clone", "peer-key-clone"];
    // Healthy: both clone checks pass.
    let ok = serve(health(
        json!({"status": "ok", "host": "doc", "version": crate::VERSION}),
    ))
    .await;
    std::fs::write(h.paths.api_addr_file(), ok.to_string()).unwrap();
    let r = h.run(&ids).await;
    for id in ids {
        assert_eq!(one(&r, id).status, Status::Ok, "{id}: {:?}", one(&r, id));
    }
    // Degraded: another daemon on this key (fail, with what to do), a peer with two (warn).
    let degraded = serve(health(json!({
        "status": "degraded", "host": "doc", "version": crate::VERSION,
        "reasons": [
            {"code": "host-key-clone", "detail": "…", "relay": "http://127.0.0.1:9"},
            {"code": "peer-key-clone", "detail": "…", "peer": "xb"},
        ],
    })))
    .await;
    std::fs::write(h.paths.api_addr_file(), degraded.to_string()).unwrap();
    let r = h.run(&ids).await;
    let d = one(&r, "daemon");
    assert_eq!(d.status, Status::Ok, "the daemon answers: {d:?}");
    assert!(d.summary.contains("degraded"), "{d:?}");
    let c = one(&r, "host-key-clone");
    assert_eq!(c.status, Status::Fail, "{c:?}");
    assert!(c.summary.contains("another daemon is using this host key"));
    assert!(c.summary.contains(&h.public().fingerprint), "{c:?}");
    let details = c.details.join("\n");
    assert!(details.contains("stop the daemon"), "{details}");
    assert!(
        details.contains("`agentmbx init` in a fresh home"),
        "{details}"
    );
    let p = one(&r, "peer-key-clone");
    assert_eq!(p.status, Status::Warn, "{p:?}");
    assert!(p.summary.contains("(xb)"), "{p:?}");
    assert!(p.details[0].starts_with("xb: "), "{p:?}");
    assert!(p.details[0].contains("xb's owner"), "{p:?}");
    assert_eq!(r.exit_code(), 1);
    // No daemon answering: nothing can be told, the checks skip.
    std::fs::write(
        h.paths.api_addr_file(),
        format!("127.0.0.1:{}", closed_port()),
    )
    .unwrap();
    let r = h.run(&ids[1..]).await;
    assert!(r.checks.iter().all(|c| c.status == Status::Skip), "{r:?}");
}
