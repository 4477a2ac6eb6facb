//! Fixtures of the doctor tests: a real home in a temp dir (initialized or not), a fake relay
//! info and a fake peer's signed status served on 127.0.0.1, a closed port, and the report of one
//! check. Fixtures only, never a test.

use std::net::SocketAddr;
use std::time::Duration;

use axum::routing::get;
use axum::Router;
use serde_json::{json, Value};

use agentmbx_protocol::keys::HostKey;
use agentmbx_protocol::status::SignedStatus;

use crate::config::{self, RelayConfig};
use crate::doctor::*;
use crate::keystore::file::FileStore;

pub(crate) const NOW: i64 = crate::testutil::T0;

/// `Date` the fake relay sends, and its value in ms.
pub(crate) const RELAY_DATE: &str = "Thu, 01 Jan 2026 00:01:00 GMT";

pub(crate) struct Home {
    pub(crate) _dir: tempfile::TempDir,
    pub(crate) paths: Paths,
}

pub(crate) fn uninitialized() -> Home {
    let dir = tempfile::tempdir().unwrap();
    let paths = Paths::at(dir.path().join("home"));
    Home { _dir: dir, paths }
}

pub(crate) fn initialized() -> Home {
    let h = uninitialized();
    h.paths.ensure_home().unwrap();
    let store = FileStore::new(h.paths.home());
    let name = crate::host_name::HostName::parse("doc").unwrap();
    crate::identity::init_with(&h.paths, Some(&name), &store).unwrap();
    h
}

impl Home {
    pub(crate) fn set_relay(&self, url: &str, key: Option<String>) {
        config::set_relay(
            &self.paths,
            Some(&RelayConfig {
                url: url.into(),
                key,
                token_command: None,
            }),
        )
        .unwrap();
    }

    pub(crate) fn mailbox(&self) -> Mailbox {
        Mailbox::open(&self.paths.mailbox_db()).unwrap()
    }

    pub(crate) fn public(&self) -> crate::identity::PublicIdentity {
        let c = Config::load(&self.paths).unwrap();
        crate::identity::load(&self.paths, &c).unwrap().public()
    }

    pub(crate) async fn run(&self, ids: &[&str]) -> Report {
        self.run_at(ids, NOW, false).await
    }

    pub(crate) async fn run_at(&self, ids: &[&str], now_ms: i64, fix: bool) -> Report {
        let ids: Vec<String> = ids.iter().map(|s| s.to_string()).collect();
        let opts = Options {
            fix,
            timeout: Duration::from_secs(2),
            now_ms,
        };
        run(self.paths.clone(), &select(&ids).unwrap(), opts).await
    }
}

pub(crate) fn one<'a>(r: &'a Report, id: &str) -> &'a CheckResult {
    r.checks.iter().find(|c| c.id == id).expect("check ran")
}

pub(crate) async fn serve(router: Router) -> SocketAddr {
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(l, router).await.unwrap() });
    addr
}

/// A 127.0.0.1 port nothing listens on.
pub(crate) fn closed_port() -> u16 {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    l.local_addr().unwrap().port()
}

pub(crate) fn limits() -> Value {
    let mut m = serde_json::Map::new();
    for k in [
        "max_item_bytes",
        "max_batch",
        "max_pull",
        "max_pull_bytes",
        "max_targets",
        "retention_days",
        "max_queue_items",
        "max_queue_bytes",
        "max_sender_items",
        "max_sender_bytes",
        "max_owner_items",
        "max_owner_bytes",
    ] {
        m.insert(k.into(), json!(1));
    }
    Value::Object(m)
}

/// A fake relay serving `key` in epoch `ep1`, with `Date: RELAY_DATE`; returns its URL.
pub(crate) async fn fake_relay(key: &HostKey) -> String {
    let info = json!({"v": 2, "relay_pubkey": key.public().to_b64(), "epoch": "ep1",
                      "version": "test", "limits": limits()});
    let router = Router::new().route(
        "/v2/relay/info",
        get(move || {
            let info = info.clone();
            async move { ([(axum::http::header::DATE, RELAY_DATE)], axum::Json(info)) }
        }),
    );
    format!("http://{}", serve(router).await)
}

/// A fake peer answering `/v1/status?challenge=` signed by `key` as `host`, and `/v1/agents`
/// with an empty directory when `accepts`, else 401.
pub(crate) async fn fake_peer(key: HostKey, host: &'static str, accepts: bool) -> SocketAddr {
    let key = std::sync::Arc::new(key);
    let agents = move |headers: axum::http::HeaderMap| async move {
        // A hop-signed request carries the signature headers.
        let signed = headers.contains_key("x-mbx-sig");
        if accepts && signed {
            (
                axum::http::StatusCode::OK,
                axum::Json(json!({"host": host, "agents": []})),
            )
        } else {
            (
                axum::http::StatusCode::UNAUTHORIZED,
                axum::Json(json!({"error": "unknown sender", "code": "UNAUTHORIZED"})),
            )
        }
    };
    serve(Router::new().route("/v1/agents", get(agents)).route(
        "/v1/status",
        get(
            move |q: axum::extract::Query<std::collections::HashMap<String, String>>| {
                let key = key.clone();
                async move {
                    let c = q.get("challenge").cloned().unwrap_or_default();
                    let st = SignedStatus::sign(&key, host, &c, vec![], "9.9.9", NOW);
                    axum::Json(serde_json::to_value(st).unwrap())
                }
            },
        ),
    ))
    .await
}
