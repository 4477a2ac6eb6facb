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
//! This module never sends mail and never changes a peer's pinning or address.

use std::time::Duration;

use crate::mailbox::agents::{self, AgentEntry};
use crate::mailbox::{peers, Mailbox, MailboxError};
use crate::transport::lan::client::LanClient;

/// How often the daemon refreshes the directory (5 minutes).
pub const REFRESH_INTERVAL: Duration = Duration::from_secs(300);

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
    let own = client.ident.host.to_string();
    let list = mailbox.run(|c| peers::list(c)).await?;
    let mut report = RefreshReport::default();
    for peer in list.into_iter().filter(|p| p.host != own) {
        let Some(addr) = peer.addr.clone() else {
            continue;
        };
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

/// Refreshes the directory now and then every [`REFRESH_INTERVAL`] until `shutdown` completes.
/// Storage faults are logged and retried at the next interval.
pub async fn run(
    mailbox: Mailbox,
    client: LanClient,
    shutdown: impl std::future::Future<Output = ()>,
) {
    tokio::pin!(shutdown);
    loop {
        if let Err(e) = refresh_directory(&mailbox, &client).await {
            tracing::warn!(error = %e, "directory refresh failed");
        }
        tokio::select! {
            _ = &mut shutdown => return,
            _ = tokio::time::sleep(REFRESH_INTERVAL) => {}
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
}
