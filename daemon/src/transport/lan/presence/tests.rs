//! Presence, status probing and address healing against real LAN servers on 127.0.0.1 (port 0):
//! the signed status route, the beacon's seq rules, and healing that moves a peer from a dead
//! port to the live one and makes its queued mail due now.
//!
//! This module holds the served nodes, the status route, probing and the beacon's rules; its
//! children cover healing and the addresses an owner types.

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;

use axum::extract::Request;
use axum::middleware::{self, Next};
use axum::routing::{any, post};
use axum::Router;
use serde_json::{json, Value};

use agentmbx_protocol::clock::ManualClock;
use agentmbx_protocol::keys::PublicKey;
use agentmbx_protocol::status::{self, StatusError};

use super::*;
use crate::identity::Identity;
use crate::mailbox::outbox;
use crate::testutil::{self, Store, T0};
use crate::transport::lan::handlers;
use crate::transport::lan::hop::{self, PeerLimiter};
use crate::transport::lan::LanState;

mod healing;
mod owner_addresses;

const LOCAL: IpAddr = IpAddr::V4(std::net::Ipv4Addr::LOCALHOST);

/// One host: its store, its LAN state and (when served) its LAN server's address.
struct Node {
    ident: Arc<Identity>,
    store: Store,
    lan: SharedLan,
    addr: SocketAddr,
}

/// A port on 127.0.0.1 that nothing listens on (bound, then released).
fn dead_addr() -> String {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let a = l.local_addr().unwrap();
    drop(l);
    a.to_string()
}

/// A host named `name` whose LAN server (status + signed presence) serves on 127.0.0.1:0,
/// signing `self_addrs` (None: 127.0.0.1).
async fn node(name: &str, clock: &Arc<ManualClock>, self_addrs: Option<Vec<IpAddr>>) -> Node {
    let ident = Arc::new(testutil::identity(name));
    let store = testutil::store();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let lan: SharedLan = Arc::new(LanState {
        ident: ident.clone(),
        mailbox: store.mailbox.clone(),
        clock: clock.clone(),
        version: "0.1.0-test",
        started_at: agentmbx_protocol::time::iso_ms(T0),
        port: addr.port(),
        advertise: addr.to_string(),
        self_addrs: self_addrs.unwrap_or_else(|| vec![LOCAL]),
        wake: Arc::new(tokio::sync::Notify::new()),
        pairing: crate::pairing::PairingMemory::default(),
        instance: Default::default(),
    });
    let limiter = Arc::new(PeerLimiter::new(clock.clone(), 600));
    let signed = Router::new()
        .route("/v1/presence", post(handlers::presence::post))
        .route_layer(middleware::from_fn({
            let lan = lan.clone();
            move |req: Request, next: Next| {
                hop::require_hop(lan.clone(), limiter.clone(), req, next)
            }
        }));
    let app = Router::new()
        .route("/v1/status", any(handlers::status::get))
        .merge(signed)
        .with_state(lan.clone());
    tokio::spawn(async move {
        axum::serve(
            listener,
            app.into_make_service_with_connect_info::<SocketAddr>(),
        )
        .await
        .unwrap();
    });
    Node {
        ident,
        store,
        lan,
        addr,
    }
}

impl Node {
    /// Pins `other` at `addr`.
    fn pin(&self, other: &Node, addr: &str) {
        self.store.add_peer(&other.ident, true);
        let host = other.ident.host.to_string();
        self.store
            .mailbox
            .with(|c| peers::set_addr(c, &host, addr, "pair"))
            .unwrap();
    }

    fn peer(&self, host: &str) -> Peer {
        self.store
            .mailbox
            .with(|c| peers::by_name(c, host))
            .unwrap()
            .unwrap()
    }

    fn kv(&self, key: &str) -> Option<String> {
        self.store
            .mailbox
            .with(|c| relay_state::kv_get(c, key))
            .unwrap()
    }

    /// Queues one message to `bob@<to>` and records `fails` failed attempts at T0 (so it is
    /// due only after the backoff). Returns its id.
    fn queue_failing(&self, to: &str, id: &str, fails: u32) -> String {
        self.store
            .send(&self.ident, "alice", &[&format!("bob@{to}")], "s", id, T0)
            .unwrap();
        self.store
            .mailbox
            .with(|c| {
                for _ in 0..fails {
                    outbox::fail(c, id, to, "peer unreachable", false, T0)?;
                }
                Ok(())
            })
            .unwrap();
        id.to_string()
    }

    fn next_at(&self, id: &str, host: &str) -> i64 {
        self.store
            .mailbox
            .with(|c| outbox::get(c, id, host))
            .unwrap()
            .unwrap()
            .next_at
    }
}

/// Raw HTTP GET to a node, answer status and JSON body.
async fn get(addr: SocketAddr, target: &str) -> (u16, Value) {
    let resp = reqwest::Client::new()
        .get(format!("http://{addr}{target}"))
        .send()
        .await
        .unwrap();
    let status = resp.status().as_u16();
    (status, resp.json().await.unwrap_or(Value::Null))
}

fn beacon(seq: i64, port: u16, addrs: &[String]) -> Value {
    json!({"v": 1, "seq": seq, "port": port, "addrs": addrs, "version": "0.1.0"})
}

#[tokio::test]
async fn status_answers_public_and_signed_and_refuses_bad_challenges() {
    crate::install_tls_provider();
    let clock = testutil::clock();
    let b = node("beta", &clock, None).await;
    let (code, public) = get(b.addr, "/v1/status").await;
    assert_eq!(code, 200);
    assert_eq!(
        public,
        json!({"service": "agentmbx", "v": 1, "host": "beta",
               "host_pubkey": b.ident.host_key.public().to_b64(), "version": "0.1.0-test",
               "started_at": "2026-01-01T00:01:00.000Z"})
    );
    let (code, signed) = get(b.addr, "/v1/status?challenge=abc%2Bdef").await;
    assert_eq!(code, 200);
    assert_eq!(signed["addrs"], json!([b.addr.to_string()]));
    assert_eq!(signed["at"], "2026-01-01T00:01:00.000Z");
    let ok = status::verify_status_for(
        &signed,
        "beta",
        &b.ident.host_key.public(),
        "abc+def",
        &[LOCAL],
    );
    assert!(ok.is_ok(), "{ok:?}");
    for bad in [format!("challenge={}", "x".repeat(65)), "challenge=".into()] {
        let (code, body) = get(b.addr, &format!("/v1/status?{bad}")).await;
        assert_eq!((code, body), (400, json!({"error": "bad challenge"})));
    }
    let resp = reqwest::Client::new()
        .post(format!("http://{}/v1/status", b.addr))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status().as_u16(), 405);
}

#[tokio::test]
async fn probing_refuses_another_key_another_host_and_unlisted_addresses() {
    crate::install_tls_provider();
    let clock = testutil::clock();
    let b = node("beta", &clock, None).await;
    let key = b.ident.host_key.public();
    let live = b.addr.to_string();
    assert!(probe("beta", &key, &live, false).await.is_ok());
    let other = agentmbx_protocol::keys::HostKey::generate().public();
    assert!(matches!(
        probe("beta", &other, &live, false).await,
        Err(ProbeError::Refused(StatusError::WrongKey))
    ));
    assert!(matches!(
        probe("gamma", &key, &live, false).await,
        Err(ProbeError::Refused(StatusError::WrongHost(ref named))) if named == "beta"
    ));
    // No answer: said in our words, never with the URL and its challenge.
    let e = probe("beta", &key, &dead_addr(), false).await.unwrap_err();
    assert!(matches!(e, ProbeError::Unreachable(_)), "{e:?}");
    assert_eq!(e.reason(), "no answer (connection refused)");
    // A host that signs only another address does not prove this one.
    let c = node("gamma", &clock, Some(vec!["10.9.9.9".parse().unwrap()])).await;
    assert!(matches!(
        probe(
            "gamma",
            &c.ident.host_key.public(),
            &c.addr.to_string(),
            false
        )
        .await,
        Err(ProbeError::Refused(StatusError::NotListed))
    ));
    // A name resolves to its IPs, which must be listed; typed by the owner it need not be.
    let named = format!("localhost:{}", b.addr.port());
    assert!(probe("beta", &key, &named, true).await.is_ok());
    assert!(matches!(
        probe(
            "gamma",
            &c.ident.host_key.public(),
            &format!("localhost:{}", c.addr.port()),
            false
        )
        .await,
        Err(ProbeError::Refused(StatusError::NotListed))
    ));
}

#[tokio::test]
async fn presence_seq_must_grow_and_bad_beacons_change_nothing() {
    crate::install_tls_provider();
    let clock = testutil::clock();
    let a = node("alpha", &clock, None).await;
    let b = node("beta", &clock, None).await;
    b.pin(&a, &a.addr.to_string());
    let addrs = vec![a.addr.to_string()];
    // The pinned address is among the reported ones and nothing fails: no probe.
    let healing = accept_presence(&b.lan, "alpha", &beacon(T0, a.addr.port(), &addrs), LOCAL)
        .await
        .unwrap();
    assert!(healing.is_none());
    assert_eq!(b.kv(&alts_key("alpha")), Some(json!(addrs).to_string()));
    assert_eq!(
        b.kv(&presence_at_key("alpha")).as_deref(),
        Some("2026-01-01T00:01:00.000Z")
    );
    for seq in [T0, T0 - 1] {
        let err = accept_presence(&b.lan, "alpha", &beacon(seq, 1, &[]), LOCAL)
            .await
            .unwrap_err();
        assert_eq!(err.to_string(), "stale presence (seq)");
    }
    assert_eq!(
        b.kv(&alts_key("alpha")),
        Some(json!(addrs).to_string()),
        "a replay changes nothing"
    );
    let bad = json!({"v": 1, "seq": "x", "addrs": []});
    let err = accept_presence(&b.lan, "alpha", &bad, LOCAL)
        .await
        .unwrap_err();
    assert_eq!(err.to_string(), "bad presence");
    assert!(
        accept_presence(&b.lan, "alpha", &beacon(T0 + 1, 1, &[]), LOCAL)
            .await
            .is_ok()
    );
    let seq: i64 = b
        .store
        .scalar("SELECT presence_seq FROM peers WHERE host = 'alpha'");
    assert_eq!(seq, T0 + 1);
    // Unknown peers never get a seq.
    assert!(matches!(
        accept_presence(&b.lan, "nobody", &beacon(T0 + 5, 1, &[]), LOCAL).await,
        Err(PresenceError::Stale)
    ));
}

#[test]
fn announced_addresses_prefer_physical_interfaces() {
    let ip = |s: &str| s.parse::<IpAddr>().unwrap();
    let list = vec![
        ("lo".to_string(), ip("127.0.0.1")),
        ("docker0".to_string(), ip("172.17.0.1")),
        ("eth0".to_string(), ip("192.168.1.20")),
        ("eth0".to_string(), ip("fe80::1")),
        ("tun0".to_string(), ip("10.8.0.2")),
    ];
    assert_eq!(announced_ipv4(&list), vec![ip("192.168.1.20")]);
    let only_virtual = vec![
        ("lo".to_string(), ip("127.0.0.1")),
        ("utun3".to_string(), ip("10.8.0.2")),
        ("veth12".to_string(), ip("10.77.0.1")),
    ];
    assert_eq!(
        announced_ipv4(&only_virtual),
        vec![ip("10.8.0.2"), ip("10.77.0.1")]
    );
    assert!(announced_ipv4(&[("lo".to_string(), ip("127.0.0.1"))]).is_empty());
}
