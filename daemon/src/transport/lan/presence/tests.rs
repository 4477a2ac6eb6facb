//! Presence, status probing and address healing against real LAN servers on 127.0.0.1 (port 0):
//! the signed status route, the beacon's seq rules, and healing that moves a peer from a dead
//! port to the live one and makes its queued mail due now.

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;

use agentmbx_protocol::clock::ManualClock;
use agentmbx_protocol::keys::PublicKey;
use agentmbx_protocol::status::{self, StatusError};
use axum::extract::Request;
use axum::middleware::{self, Next};
use axum::routing::{any, post};
use axum::Router;
use serde_json::{json, Value};

use super::*;
use crate::identity::Identity;
use crate::mailbox::outbox;
use crate::testutil::{self, Store, T0};
use crate::transport::lan::handlers;
use crate::transport::lan::hop::{self, PeerLimiter};
use crate::transport::lan::LanState;

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

#[tokio::test]
async fn presence_heals_a_peer_from_a_dead_port_to_the_live_one_and_mail_is_due_now() {
    crate::install_tls_provider();
    let clock = testutil::clock();
    let a = node("alpha", &clock, None).await;
    let b = node("beta", &clock, None).await;
    let dead = dead_addr();
    b.pin(&a, &dead);
    let id = b.queue_failing("alpha", "01KDVDNA3VG2MH8KWSQRCWJZ0S", 3);
    assert!(b.next_at(&id, "alpha") > T0 + 10_000);
    clock.advance(1_000);
    let live = a.addr.to_string();
    let healing = accept_presence(
        &b.lan,
        "alpha",
        &beacon(T0 + 1_000, a.addr.port(), std::slice::from_ref(&live)),
        LOCAL,
    )
    .await
    .unwrap()
    .expect("a probe starts: the pinned port is dead and mail fails");
    let woken = b.lan.wake.clone();
    assert_eq!(healing.await.unwrap(), Some(live.clone()));
    // The sender was woken (a stored permit completes at once).
    tokio::time::timeout(std::time::Duration::from_secs(5), woken.notified())
        .await
        .expect("sender woken");
    let p = b.peer("alpha");
    assert_eq!(
        (p.addr.as_deref(), p.addr_source.as_deref()),
        (Some(live.as_str()), Some("presence"))
    );
    assert!(
        b.next_at(&id, "alpha") <= T0 + 1_000,
        "queued mail is due now"
    );
    let heal: Value = serde_json::from_str(&b.kv(&heal_key("alpha")).unwrap()).unwrap();
    assert_eq!(
        heal,
        json!({"via": "presence", "at": "2026-01-01T00:01:01.000Z", "from": dead, "to": live})
    );

    // One healing run a minute per peer: a new beacon (mail still failing) within the minute
    // probes nothing, after it it does.
    b.store
        .mailbox
        .with(|c| peers::set_addr(c, "alpha", &dead, "pair"))
        .unwrap();
    clock.advance(30_000);
    let again = accept_presence(
        &b.lan,
        "alpha",
        &beacon(T0 + 31_000, a.addr.port(), &[]),
        LOCAL,
    )
    .await
    .unwrap();
    assert!(again.is_none(), "throttled");
    clock.advance(30_000);
    let later = accept_presence(
        &b.lan,
        "alpha",
        &beacon(T0 + 61_000, a.addr.port(), &[]),
        LOCAL,
    )
    .await
    .unwrap()
    .expect("a minute later it probes again");
    assert_eq!(later.await.unwrap(), Some(live));
}

#[tokio::test]
async fn a_candidate_that_cannot_prove_the_pinned_key_is_never_adopted() {
    crate::install_tls_provider();
    let clock = testutil::clock();
    let a = node("alpha", &clock, None).await;
    // An impostor answering as "alpha" with its own key.
    let impostor = node("alpha", &clock, None).await;
    let b = node("beta", &clock, None).await;
    let dead = dead_addr();
    b.pin(&a, &dead);
    b.queue_failing("alpha", "01KDVDNA3VG2MH8KWSQRCWJZ0S", 1);
    let fake = impostor.addr.to_string();
    let healing = accept_presence(
        &b.lan,
        "alpha",
        &beacon(T0, impostor.addr.port(), std::slice::from_ref(&fake)),
        LOCAL,
    )
    .await
    .unwrap()
    .expect("probe starts");
    assert_eq!(healing.await.unwrap(), None);
    assert_eq!(b.peer("alpha").addr.as_deref(), Some(dead.as_str()));
    assert!(b.kv(&heal_key("alpha")).is_none());
    // Nor does an answer that does not list the candidate's IP.
    let unlisted = node("alpha", &clock, Some(vec!["10.9.9.9".parse().unwrap()])).await;
    let peer = b.peer("alpha");
    let key = PublicKey::from_b64(&peer.pubkey).unwrap();
    assert_ne!(key, unlisted.ident.host_key.public());
    assert_eq!(
        heal_peer_addr(&b.lan, "alpha", &unlisted.addr.to_string(), Via::Ladder)
            .await
            .unwrap(),
        None
    );
}

#[tokio::test]
async fn a_signed_beacon_over_the_wire_moves_the_peer_on_the_other_side() {
    crate::install_tls_provider();
    let clock = testutil::clock();
    let a = node("alpha", &clock, None).await;
    let b = node("beta", &clock, None).await;
    // alpha knows where beta is; beta has alpha at a dead port and nothing to send.
    a.pin(&b, &b.addr.to_string());
    let dead = dead_addr();
    b.pin(&a, &dead);
    assert_eq!(send_presence(&a.lan, None).await, vec!["beta".to_string()]);
    let live = a.addr.to_string();
    let moved = testutil_poll(|| {
        let p = b.peer("alpha");
        (p.addr.as_deref() == Some(live.as_str())).then_some(p)
    })
    .await;
    assert_eq!(moved.addr_source.as_deref(), Some("presence"));
    let heal: Value = serde_json::from_str(&b.kv(&heal_key("alpha")).unwrap()).unwrap();
    assert_eq!(
        (heal["via"].as_str(), heal["from"].as_str()),
        (Some("presence"), Some(dead.as_str()))
    );
    // The same beacon again (same ms) is a replay on the wire too.
    let (code, body) = {
        let client = LanClient::new(a.ident.clone(), clock.clone(), a.addr.port()).unwrap();
        let text = status::PresenceBody::new(T0, a.addr.port(), vec![], "x").to_json();
        let (code, bytes) = client
            .call(
                reqwest::Method::POST,
                &b.addr.to_string(),
                "/v1/presence",
                text.into_bytes(),
            )
            .await
            .unwrap();
        (code, serde_json::from_slice::<Value>(&bytes).unwrap())
    };
    assert_eq!(
        (code, body),
        (400, json!({"ok": false, "error": "stale presence (seq)"}))
    );
    // Peers without an address get no beacon; an unknown sender is refused by the hop check.
    let c = node("gamma", &clock, None).await;
    c.store.add_peer(&b.ident, true);
    assert!(send_presence(&c.lan, None).await.is_empty());
    c.store
        .mailbox
        .with(|conn| peers::set_addr(conn, "beta", &b.addr.to_string(), "pair"))
        .unwrap();
    assert!(
        send_presence(&c.lan, None).await.is_empty(),
        "beta has not paired gamma"
    );
}

#[tokio::test]
async fn the_failure_ladder_tries_last_seen_alternates_then_mdns_and_hops_heal_too() {
    crate::install_tls_provider();
    let clock = testutil::clock();
    let a = node("alpha", &clock, None).await;
    let b = node("beta", &clock, None).await;
    let live = a.addr.to_string();
    let dead = dead_addr();
    b.pin(&a, &dead);
    // Not stuck yet (one failure): the ladder leaves it alone.
    b.queue_failing("alpha", "01KDVDNA3VG2MH8KWSQRCWJZ0S", 1);
    b.store
        .mailbox
        .with(|c| relay_state::kv_set(c, &alts_key("alpha"), &json!([live]).to_string()))
        .unwrap();
    assert!(heal_stuck_peers(&b.lan, |_, _| Vec::new()).await.is_empty());
    // Stuck: the stored alternate is proven and adopted.
    b.store
        .mailbox
        .with(|c| outbox::fail(c, "01KDVDNA3VG2MH8KWSQRCWJZ0S", "alpha", "x", false, T0))
        .unwrap();
    assert_eq!(
        heal_stuck_peers(&b.lan, |_, _| Vec::new()).await,
        vec!["alpha".to_string()]
    );
    assert_eq!(b.peer("alpha").addr_source.as_deref(), Some("ladder"));
    // No alternates left: the mDNS rung (given only for the pinned key) moves it.
    b.store
        .mailbox
        .with(|c| {
            peers::set_addr(c, "alpha", &dead, "pair")?;
            relay_state::kv_set(c, &alts_key("alpha"), "[]")
        })
        .unwrap();
    let pinned = a.ident.host_key.public();
    let l = live.clone();
    let moved = heal_stuck_peers(&b.lan, move |host, key| {
        if host == "alpha" && *key == pinned {
            vec![l.clone()]
        } else {
            Vec::new()
        }
    })
    .await;
    assert_eq!(moved, vec!["alpha".to_string()]);
    assert_eq!(b.peer("alpha").addr_source.as_deref(), Some("mdns"));
    // A verified hop from a new place: the source IP with the port hint is probed.
    b.store
        .mailbox
        .with(|c| peers::set_addr(c, "alpha", "127.0.0.9:1", "pair"))
        .unwrap();
    clock.advance(HEAL_THROTTLE_MS);
    let learned = learn_from_hop(&b.lan, "alpha", LOCAL, Some(a.addr.port()))
        .await
        .unwrap()
        .expect("a probe starts");
    assert_eq!(learned.await.unwrap(), Some(live.clone()));
    assert_eq!(b.peer("alpha").addr_source.as_deref(), Some("verified-hop"));
    // From the pinned IP itself nothing is probed.
    assert!(learn_from_hop(&b.lan, "alpha", LOCAL, Some(a.addr.port()))
        .await
        .unwrap()
        .is_none());
    // mDNS answers for a peer whose pinned address still works change nothing.
    assert_eq!(
        consider_mdns(&b.lan, "alpha", vec![live]).await.unwrap(),
        None
    );
}

/// Case `clock-fix-does-not-release-mail`: a healing run recorded while the clock was 10 min
/// ahead does not hold the peer's slot for the length of the skew once the clock is right.
#[test]
fn a_heal_slot_taken_under_a_clock_ahead_is_free_once_the_clock_is_right() {
    let s = testutil::store();
    s.mailbox
        .with(|c| {
            assert!(take_heal_slot(c, "work", Slot::Presence, T0 + 600_000)?);
            assert!(take_heal_slot(c, "work", Slot::Presence, T0)?);
            assert!(
                !take_heal_slot(c, "work", Slot::Presence, T0 + 1)?,
                "throttled"
            );
            assert!(take_heal_slot(
                c,
                "work",
                Slot::Presence,
                T0 + HEAL_THROTTLE_MS
            )?);
            Ok(())
        })
        .unwrap();
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

/// Polls `check` every 20 ms for up to 10 s.
async fn testutil_poll<T>(mut check: impl FnMut() -> Option<T>) -> T {
    let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(10);
    loop {
        if let Some(v) = check() {
            return v;
        }
        assert!(tokio::time::Instant::now() < deadline, "timed out");
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
}

/// [`set_addr_by_owner`] on `on` for `host`.
async fn owner_sets(
    on: &Node,
    host: &str,
    addr: &str,
    force: bool,
) -> Result<OwnerAddr, OwnerAddrError> {
    let clock = on.lan.clock.clone();
    set_addr_by_owner(&on.store.mailbox, &clock, host, addr, force).await
}

#[tokio::test]
async fn an_address_the_owner_types_is_stored_only_once_it_answers_with_the_pinned_key() {
    crate::install_tls_provider();
    let clock = testutil::clock();
    let a = node("alpha", &clock, None).await;
    let b = node("beta", &clock, None).await;
    let dead = dead_addr();
    b.pin(&a, &dead);
    let id = b.queue_failing("alpha", "01KDVDNA3VG2MH8KWSQRCWJZ0S", 3);
    clock.advance(1_000);

    // Verified: stored with source cli, a heal record, and the queued mail due now.
    let live = a.addr.to_string();
    let set = owner_sets(&b, "alpha", &live, false).await.unwrap();
    assert_eq!(
        set,
        OwnerAddr {
            host: "alpha".into(),
            addr: live.clone(),
            verified: true,
            why: None
        }
    );
    let p = b.peer("alpha");
    assert_eq!(
        (p.addr.as_deref(), p.addr_source.as_deref()),
        (Some(live.as_str()), Some("cli"))
    );
    assert!(
        b.next_at(&id, "alpha") <= T0 + 1_000,
        "queued mail is due now"
    );
    let heal: Value = serde_json::from_str(&b.kv(&heal_key("alpha")).unwrap()).unwrap();
    assert_eq!(
        heal,
        json!({"via": "cli", "at": "2026-01-01T00:01:01.000Z", "from": dead, "to": live})
    );
    // A name the peer does not list is fine when the owner typed it.
    let named = format!("localhost:{}", a.addr.port());
    assert!(
        owner_sets(&b, "alpha", &named, false)
            .await
            .unwrap()
            .verified
    );
    assert_eq!(b.peer("alpha").addr.as_deref(), Some(named.as_str()));

    // Refused, naming why, and nothing changes: no answer ...
    let before = (b.peer("alpha"), b.kv(&heal_key("alpha")));
    let e = owner_sets(&b, "alpha", &dead, false).await.unwrap_err();
    let text = e.to_string();
    assert!(
        matches!(&e, OwnerAddrError::Unverified { why, .. } if why.starts_with("no answer")),
        "{text}"
    );
    assert!(
        text.starts_with(&format!("{dead} did not prove to be alpha: no answer")),
        "{text}"
    );
    assert!(text.contains("--force"), "{text}");
    // ... another key under the same name ...
    let impostor = node("alpha", &clock, None).await;
    let e = owner_sets(&b, "alpha", &impostor.addr.to_string(), false)
        .await
        .unwrap_err();
    assert!(
        e.to_string()
            .contains("it answered with another key than the one pinned"),
        "{e}"
    );
    // ... another host ...
    let e = owner_sets(&b, "alpha", &b.addr.to_string(), false)
        .await
        .unwrap_err();
    assert!(
        e.to_string()
            .contains("it answered as another host, \"beta\""),
        "names the host it answered as: {e}"
    );
    // ... not an agentmbx status at all.
    let (other, _) = plain_server().await;
    let e = owner_sets(&b, "alpha", &other, false).await.unwrap_err();
    assert!(e.to_string().contains("it answered HTTP 404"), "{e}");
    assert_eq!((b.peer("alpha"), b.kv(&heal_key("alpha"))), before);

    // An IP the peer does not sign is refused even when typed (a proxy or NAT in between).
    let c = node("gamma", &clock, Some(vec!["10.9.9.9".parse().unwrap()])).await;
    b.pin(&c, &dead);
    let e = owner_sets(&b, "gamma", &c.addr.to_string(), false)
        .await
        .unwrap_err();
    assert!(e.to_string().contains("does not list that IP"), "{e}");
    assert_eq!(b.peer("gamma").addr.as_deref(), Some(dead.as_str()));

    // Unknown peers are not found.
    assert!(matches!(
        owner_sets(&b, "nobody", &live, true).await,
        Err(OwnerAddrError::NotPaired(h)) if h == "nobody"
    ));
}

#[tokio::test]
async fn forced_owner_addresses_are_stored_unproven_without_a_heal_record() {
    crate::install_tls_provider();
    let clock = testutil::clock();
    let a = node("alpha", &clock, None).await;
    let b = node("beta", &clock, None).await;
    b.pin(&a, &a.addr.to_string());
    let id = b.queue_failing("alpha", "01KDVDNA3VG2MH8KWSQRCWJZ0S", 3);
    let dead = dead_addr();
    let set = owner_sets(&b, "alpha", &dead, true).await.unwrap();
    assert!(!set.verified);
    assert!(
        set.why.as_deref().unwrap().starts_with("no answer"),
        "{set:?}"
    );
    assert_eq!(
        serde_json::to_value(&set).unwrap()["verified"],
        json!(false)
    );
    let p = b.peer("alpha");
    assert_eq!(
        (p.addr.as_deref(), p.addr_source.as_deref()),
        (Some(dead.as_str()), Some("cli"))
    );
    assert!(
        b.next_at(&id, "alpha") <= T0,
        "mail to it is tried there now"
    );
    assert!(b.kv(&heal_key("alpha")).is_none(), "nothing was proven");
    // Forcing an address that does verify is just a verified store.
    let live = a.addr.to_string();
    let set = owner_sets(&b, "alpha", &live, true).await.unwrap();
    assert!(set.verified && set.why.is_none());
    assert!(serde_json::to_value(&set).unwrap().get("why").is_none());
    let heal: Value = serde_json::from_str(&b.kv(&heal_key("alpha")).unwrap()).unwrap();
    assert_eq!(
        (heal["via"].as_str(), heal["from"].as_str()),
        (Some("cli"), Some(dead.as_str()))
    );
}

/// A plain HTTP server on 127.0.0.1:0 that is not agentmbx (404 for everything).
async fn plain_server() -> (String, tokio::task::JoinHandle<()>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let task = tokio::spawn(async move {
        axum::serve(listener, Router::new()).await.unwrap();
    });
    (addr, task)
}

#[tokio::test]
async fn mdns_answers_never_take_the_slot_presence_and_hops_heal_with() {
    crate::install_tls_provider();
    let clock = testutil::clock();
    let a = node("alpha", &clock, None).await;
    let impostor = node("alpha", &clock, None).await;
    let b = node("beta", &clock, None).await;
    let dead = dead_addr();
    b.pin(&a, &dead);
    b.queue_failing("alpha", "01KDVDNA3VG2MH8KWSQRCWJZ0S", 1);
    // Someone advertises alpha's name (and its public fingerprint) at its own address.
    let fake = impostor.addr.to_string();
    assert_eq!(
        consider_mdns(&b.lan, "alpha", vec![fake.clone()])
            .await
            .unwrap(),
        None
    );
    assert_eq!(b.peer("alpha").addr.as_deref(), Some(dead.as_str()));
    // Its own slot is taken: a second answer within the minute probes nothing.
    assert_eq!(
        consider_mdns(&b.lan, "alpha", vec![a.addr.to_string()])
            .await
            .unwrap(),
        None
    );
    assert_eq!(b.peer("alpha").addr.as_deref(), Some(dead.as_str()));
    // The genuine beacon and hop still heal at once.
    let live = a.addr.to_string();
    let healing = accept_presence(
        &b.lan,
        "alpha",
        &beacon(T0, a.addr.port(), std::slice::from_ref(&live)),
        LOCAL,
    )
    .await
    .unwrap()
    .expect("presence probes: its slot is free");
    assert_eq!(healing.await.unwrap(), Some(live.clone()));
    b.store
        .mailbox
        .with(|c| peers::set_addr(c, "alpha", &dead, "pair"))
        .unwrap();
    let learned = learn_from_hop(&b.lan, "alpha", LOCAL, Some(a.addr.port()))
        .await
        .unwrap()
        .expect("the hop probes: its slot is free");
    assert_eq!(learned.await.unwrap(), Some(live.clone()));
    // A minute later mDNS may try again, and the genuine answer moves it.
    b.store
        .mailbox
        .with(|c| peers::set_addr(c, "alpha", &dead, "pair"))
        .unwrap();
    clock.advance(HEAL_THROTTLE_MS);
    assert_eq!(
        consider_mdns(&b.lan, "alpha", vec![fake, live.clone()])
            .await
            .unwrap(),
        Some(live)
    );
    assert_eq!(b.peer("alpha").addr_source.as_deref(), Some("mdns"));
}

#[tokio::test]
async fn a_hop_from_another_reported_address_keeps_a_working_pin_until_mail_fails() {
    crate::install_tls_provider();
    let clock = testutil::clock();
    // alpha serves on 127.0.0.1 and also reports 127.0.0.2 (two interfaces).
    let two = vec![LOCAL, "127.0.0.2".parse().unwrap()];
    let a = node("alpha", &clock, Some(two)).await;
    let b = node("beta", &clock, None).await;
    let pinned = format!("127.0.0.2:{}", a.addr.port());
    b.pin(&a, &pinned);
    // A hop from 127.0.0.1: the candidate proves alpha's key, but alpha still reports the
    // pinned address and no mail fails, so the pin stays.
    let kept = learn_from_hop(&b.lan, "alpha", LOCAL, Some(a.addr.port()))
        .await
        .unwrap()
        .expect("a probe starts: the hop came from another IP");
    assert_eq!(kept.await.unwrap(), None);
    assert_eq!(b.peer("alpha").addr.as_deref(), Some(pinned.as_str()));
    assert!(b.kv(&heal_key("alpha")).is_none());
    // Once mail to it fails, the proven address is taken.
    b.queue_failing("alpha", "01KDVDNA3VG2MH8KWSQRCWJZ0S", 1);
    clock.advance(HEAL_THROTTLE_MS);
    let moved = learn_from_hop(&b.lan, "alpha", LOCAL, Some(a.addr.port()))
        .await
        .unwrap()
        .expect("a probe starts");
    assert_eq!(moved.await.unwrap(), Some(a.addr.to_string()));
    assert_eq!(b.peer("alpha").addr_source.as_deref(), Some("verified-hop"));
}
