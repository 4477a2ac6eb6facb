//! The directory refresh (`wire.md` §4 "Other client calls" `refreshDirectory`): ask every pinned
//! peer that has a LAN address for `GET /v1/agents` and keep what it answered in the `agents`
//! table under the peer's name, so bare names can be routed to the one paired host that has
//! them (`wire.md` §4 "Addressing").
//!
//! Per host at most 500 entries with NAME_RE names are kept, and a host's previous entries are
//! replaced in one transaction ([`agents::replace_host`]). A peer that cannot be reached keeps
//! its previous entries; an answer naming another host than the peer is ignored (the LAN answer
//! is not signed, so it is only the word of whatever answered at that address).
//!
//! A peer whose directory this host has never stored (just paired, or its address just
//! learned) is asked within [`NEW_PEER_CHECK`], not at the next full refresh: until then a send
//! to `name@peer` cannot be checked against it and only warns (`node::route`). An unreachable
//! one is asked again at most every [`NEW_PEER_RETRY`].
//!
//! This module never sends mail and never changes a peer's pinning or address.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use crate::mailbox::agents::{self, AgentEntry};
use crate::mailbox::{peers, Mailbox, MailboxError};
use crate::transport::lan::client::LanClient;

/// How often the daemon refreshes the directory (5 minutes).
pub const REFRESH_INTERVAL: Duration = Duration::from_secs(300);

/// How often the daemon looks for pinned peers with an address whose directory it never stored
/// (60 s, as [`NEW_PEER_RETRY`]; an idle daemon wakes as rarely as it can): one read of the
/// `peers` table, no network unless there is one. Until then a send to such a peer only warns.
pub const NEW_PEER_CHECK: Duration = Duration::from_secs(60);

/// How long an unreachable never-fetched peer waits before it is asked again (60 s).
pub const NEW_PEER_RETRY: Duration = Duration::from_secs(60);

/// Which pinned peers a refresh asks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Which {
    /// Every pinned peer with an address.
    All,
    /// Only those whose directory this host never stored (`peers.directory_at` is NULL).
    NeverFetched,
}

/// What one refresh did, per peer.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RefreshReport {
    /// Peers whose entries were replaced, with how many were stored.
    pub refreshed: Vec<(String, usize)>,
    /// Peers that could not be refreshed, with why (they keep their previous entries).
    pub failed: Vec<(String, String)>,
}

/// Refreshes the directory entries of every pinned peer with an address, one peer after the
/// other (each call bounded by the client's 3 s connect / 15 s request timeouts). Network and
/// answer failures are reported per peer in [`RefreshReport::failed`]; errors: storage faults.
pub async fn refresh_directory(
    mailbox: &Mailbox,
    client: &LanClient,
) -> Result<RefreshReport, MailboxError> {
    refresh(mailbox, client, Which::All, |_| true).await
}

/// Refreshes the directory entries of the pinned peers with an address that `which` selects
/// and `ask` (given the peer's name) allows, as [`refresh_directory`] does.
pub async fn refresh(
    mailbox: &Mailbox,
    client: &LanClient,
    which: Which,
    mut ask: impl FnMut(&str) -> bool,
) -> Result<RefreshReport, MailboxError> {
    let own = client.ident.host.to_string();
    let list = mailbox
        .run(move |c| {
            let mut out = Vec::new();
            for p in peers::list(c)? {
                if which == Which::All || agents::directory_known(c, &p.host)?.is_none() {
                    out.push(p);
                }
            }
            Ok(out)
        })
        .await?;
    let mut report = RefreshReport::default();
    for peer in list.into_iter().filter(|p| p.host != own) {
        let Some(addr) = peer.addr.clone() else {
            continue;
        };
        if !ask(&peer.host) {
            continue;
        }
        let answer = match client.get_agents(&addr).await {
            Ok(a) => a,
            Err(e) => {
                tracing::debug!(peer = %peer.host, error = %e, "directory refresh failed");
                report.failed.push((peer.host, e.to_string()));
                continue;
            }
        };
        if answer.host != peer.host {
            tracing::warn!(peer = %peer.host, answered = %answer.host, %addr,
                "directory answer names another host; kept the previous entries");
            report.failed.push((
                peer.host,
                format!("the answer at {addr} is from host {}", answer.host),
            ));
            continue;
        }
        let entries: Vec<AgentEntry> = answer
            .agents
            .into_iter()
            .map(|a| AgentEntry {
                name: a.name,
                role: a.role,
                cli: a.cli,
                description: a.description,
                last_seen: a.last_seen,
            })
            .collect();
        let now = client.clock.now_ms();
        let host = peer.host.clone();
        let stored = mailbox
            .run(move |c| agents::replace_host(c, &host, &entries, now))
            .await?;
        tracing::debug!(peer = %peer.host, stored, "directory refreshed");
        report.refreshed.push((peer.host, stored));
    }
    Ok(report)
}

/// How long a send waits for stale peer directories to be fetched again before it is checked
/// against them (2 s in all; `api::messages::refresh_stale_directories`).
pub const STALE_FETCH_BUDGET: Duration = Duration::from_secs(2);

/// Refreshes the directory now and then every [`REFRESH_INTERVAL`], and every
/// [`NEW_PEER_CHECK`] the peers whose directory was never stored, until `shutdown` completes.
/// Storage faults are logged and retried at the next interval.
pub async fn run(
    mailbox: Mailbox,
    client: LanClient,
    shutdown: impl std::future::Future<Output = ()>,
) {
    run_every(
        mailbox,
        client,
        shutdown,
        REFRESH_INTERVAL,
        NEW_PEER_CHECK,
        NEW_PEER_RETRY,
    )
    .await
}

/// [`run`] with its intervals given (`full`: every peer; `check`: never-fetched peers, each
/// asked again at most every `retry`).
pub async fn run_every(
    mailbox: Mailbox,
    client: LanClient,
    shutdown: impl std::future::Future<Output = ()>,
    full: Duration,
    check: Duration,
    retry: Duration,
) {
    tokio::pin!(shutdown);
    let mut tried: HashMap<String, Instant> = HashMap::new();
    let mut last_full: Option<Instant> = None;
    loop {
        let due_full = last_full.is_none_or(|t| t.elapsed() >= full);
        let outcome = if due_full {
            last_full = Some(Instant::now());
            tried.clear();
            let r = refresh_directory(&mailbox, &client).await;
            if let Ok(r) = &r {
                for (host, _) in &r.failed {
                    tried.insert(host.clone(), Instant::now());
                }
            }
            r
        } else {
            let ask = |host: &str| {
                let now = Instant::now();
                match tried.get(host) {
                    Some(t) if now.duration_since(*t) < retry => false,
                    _ => {
                        tried.insert(host.to_string(), now);
                        true
                    }
                }
            };
            refresh(&mailbox, &client, Which::NeverFetched, ask).await
        };
        match outcome {
            Ok(r) if !due_full && !r.refreshed.is_empty() => {
                tracing::info!(peers = ?r.refreshed, "fetched the agent directory of a new peer");
            }
            Ok(_) => {}
            Err(e) => tracing::warn!(error = %e, "directory refresh failed"),
        }
        tokio::select! {
            _ = &mut shutdown => return,
            _ = tokio::time::sleep(check.min(full)) => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use axum::routing::get;
    use axum::{Json, Router};
    use serde_json::{json, Value};

    use super::*;
    use crate::testutil::{self, T0};

    /// A stand-in peer LAN server answering `GET /v1/agents` with `answer`; its `host:port`.
    async fn fake_peer(answer: Value) -> String {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let app = Router::new().route("/v1/agents", get(move || async move { Json(answer) }));
        tokio::spawn(async move { axum::serve(listener, app).await });
        addr
    }

    fn names(s: &testutil::Store, host: &str) -> Vec<String> {
        let host = host.to_string();
        s.mailbox
            .with(move |c| {
                let mut st = c.prepare("SELECT name FROM agents WHERE host = ?1 ORDER BY name")?;
                let rows = st
                    .query_map([host], |r| r.get::<_, String>(0))?
                    .collect::<Result<Vec<_>, _>>()?;
                Ok(rows)
            })
            .unwrap()
    }

    #[tokio::test]
    async fn peers_with_an_address_are_asked_and_their_entries_replaced() {
        let s = testutil::store();
        let me = Arc::new(testutil::identity("home"));
        for host in ["work", "lab", "far", "liar"] {
            s.add_peer(&testutil::identity(host), false);
        }
        let mut many: Vec<Value> = (0..520)
            .map(|i| json!({"name": format!("w{i:03}")}))
            .collect();
        many.push(json!({"name": "Bad Name"}));
        many.push(json!({"name": "ann", "role": "dev", "last_seen": "2026-01-01T00:00:00.000Z"}));
        let work = fake_peer(json!({"host": "work", "agents": many})).await;
        let liar = fake_peer(json!({"host": "someone", "agents": [{"name": "eve"}]})).await;
        // A port nothing listens on: bind, note it, close.
        let dead = {
            let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
            l.local_addr().unwrap().to_string()
        };
        s.mailbox
            .with(|c| {
                peers::set_addr(c, "work", &work, "cli")?;
                peers::set_addr(c, "liar", &liar, "cli")?;
                peers::set_addr(c, "far", &dead, "cli")?;
                // Entries from before: the unreachable and the lying peer keep theirs.
                for host in ["far", "liar", "work"] {
                    agents::replace_host(
                        c,
                        host,
                        &[AgentEntry {
                            name: "old".into(),
                            role: None,
                            cli: None,
                            description: None,
                            last_seen: None,
                        }],
                        T0,
                    )?;
                }
                Ok(())
            })
            .unwrap();
        crate::install_tls_provider();
        let client = LanClient::new(me, testutil::clock(), 7373).unwrap();
        let report = refresh_directory(&s.mailbox, &client).await.unwrap();
        assert_eq!(
            report.refreshed,
            vec![("work".to_string(), agents::MAX_PEER_AGENTS)]
        );
        let failed: Vec<&str> = report.failed.iter().map(|f| f.0.as_str()).collect();
        assert_eq!(
            failed,
            vec!["far", "liar"],
            "lab has no address and is not asked"
        );
        let work_names = names(&s, "work");
        assert_eq!(work_names.len(), agents::MAX_PEER_AGENTS);
        assert!(!work_names.contains(&"old".to_string()));
        assert_eq!(names(&s, "far"), vec!["old"]);
        assert_eq!(names(&s, "liar"), vec!["old"]);
        assert!(names(&s, "lab").is_empty());
    }

    /// A peer pinned while the daemon runs has its directory fetched at the next check, not at
    /// the next full refresh; an unreachable never-fetched peer is not asked again before its
    /// retry time.
    #[tokio::test]
    async fn a_peer_pinned_while_running_is_asked_at_the_next_check_and_a_failing_one_waits() {
        use std::sync::atomic::{AtomicUsize, Ordering};
        let s = testutil::store();
        let me = Arc::new(testutil::identity("home"));
        crate::install_tls_provider();
        let client = LanClient::new(me, testutil::clock(), 7373).unwrap();
        let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
        let task = tokio::spawn(run_every(
            s.mailbox.clone(),
            client,
            async {
                let _ = stop_rx.await;
            },
            Duration::from_secs(3600),
            Duration::from_millis(50),
            Duration::from_secs(3600),
        ));
        let asked = Arc::new(AtomicUsize::new(0));
        let failing = {
            let asked = asked.clone();
            let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
            let addr = listener.local_addr().unwrap().to_string();
            let app = Router::new().route(
                "/v1/agents",
                get(move || async move {
                    asked.fetch_add(1, Ordering::SeqCst);
                    axum::http::StatusCode::SERVICE_UNAVAILABLE
                }),
            );
            tokio::spawn(async move { axum::serve(listener, app).await });
            addr
        };
        let work = fake_peer(json!({"host": "work", "agents": [{"name": "bob"}]})).await;
        let lab = fake_peer(json!({"host": "lab", "agents": [{"name": "erin"}]})).await;
        let known = |host: &'static str| {
            s.mailbox
                .with(move |c| agents::directory_known(c, host))
                .unwrap()
                .is_some()
        };
        let wait_known = |host: &'static str| async move {
            let deadline = Instant::now() + Duration::from_secs(10);
            while !known(host) {
                assert!(
                    Instant::now() < deadline,
                    "{host}'s directory never fetched"
                );
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        };
        // Pinned after the loop's first (full) pass.
        tokio::time::sleep(Duration::from_millis(100)).await;
        for (host, addr) in [("work", &work), ("down", &failing)] {
            s.add_peer(&testutil::identity(host), false);
            s.mailbox
                .with(|c| peers::set_addr(c, host, addr, "cli").map(|_| ()))
                .unwrap();
        }
        wait_known("work").await;
        assert_eq!(names(&s, "work"), vec!["bob"]);
        assert_eq!(asked.load(Ordering::SeqCst), 1, "down was asked once");
        // Later checks run (lab, pinned now, is fetched) without asking down again.
        s.add_peer(&testutil::identity("lab"), false);
        s.mailbox
            .with(|c| peers::set_addr(c, "lab", &lab, "cli").map(|_| ()))
            .unwrap();
        wait_known("lab").await;
        assert!(!known("down"));
        assert_eq!(asked.load(Ordering::SeqCst), 1, "down waits for its retry");
        stop_tx.send(()).unwrap();
        task.await.unwrap();
    }
}
