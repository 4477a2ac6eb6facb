//! Announcing this host's key rotations to its paired peers over the LAN (`wire.md` §2.10;
//! 0.5.x `announceRotations`).
//!
//! Every logged rotation (`rotations.json`, [`crate::identity::rotation`]) goes to every paired
//! peer with a known address as `POST /v1/rotate {records:[…]}`, from the first record that peer
//! has not taken, at most [`MAX_RECORDS_PER_ANNOUNCE`] per request. A peer's count
//! (`delivered[host]` in the log) moves past the last record it answered `rotated` or `current`;
//! a peer that is offline, too old (404) or refuses is tried again once a minute
//! ([`RETRY_INTERVAL`]) until it has taken every record, and never again after.
//!
//! Rotations happen only while the daemon is stopped (`agentmbx host rotate` refuses while the
//! daemon lock is held), so the records a daemon announces are fixed for its lifetime; only the
//! counts change, and they are written under the rotation lock. This module never changes a
//! key or a pin; it only tells peers.

use std::time::Duration;

use agentmbx_protocol::rotation::{RotateResult, MAX_RECORDS_PER_ANNOUNCE};

use super::client::{LanClient, LanError};
use crate::identity::{rotation, IdentityError};
use crate::mailbox::{peers, Mailbox, MailboxError};
use crate::paths::Paths;

/// Pause between two announcement passes: each peer that still lacks a record is retried once
/// a minute (`wire.md` §2.10).
pub const RETRY_INTERVAL: Duration = Duration::from_secs(60);

/// A pass could not read the log or the peers.
#[derive(Debug, thiserror::Error)]
pub enum AnnounceError {
    /// `rotations.json` could not be read or updated.
    #[error(transparent)]
    Log(#[from] IdentityError),
    /// The host store failed.
    #[error(transparent)]
    Store(#[from] MailboxError),
    /// A blocking task failed.
    #[error("rotation announcement task failed")]
    Task,
}

/// What one pass did for one peer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PeerOutcome {
    /// The peer.
    pub host: String,
    /// How many records (from the first) it has taken now.
    pub delivered: usize,
    /// Why it has not taken them all, if it has not.
    pub error: Option<String>,
}

/// The outcome error of a peer with no LAN address: it cannot be told yet.
pub const NO_LAN_ADDRESS: &str = "no LAN address known for this peer";

/// One pass: each paired peer with an address that has not taken every record is sent the
/// records from its count on (several requests when more than [`MAX_RECORDS_PER_ANNOUNCE`] are
/// owed), and its count is written after each answer. Peers that owe nothing are not
/// contacted. Errors: the log or the store could not be read (a failed peer is an outcome, not
/// an error).
pub async fn announce_once(
    paths: &Paths,
    mailbox: &Mailbox,
    client: &LanClient,
) -> Result<Vec<PeerOutcome>, AnnounceError> {
    let p = paths.clone();
    let log = tokio::task::spawn_blocking(move || rotation::read_log(&p))
        .await
        .map_err(|_| AnnounceError::Task)??;
    if log.records.is_empty() {
        return Ok(Vec::new());
    }
    let total = log.records.len();
    let peers = mailbox.run(|c| peers::list(c)).await?;
    let mut out = Vec::new();
    for peer in peers {
        let mut delivered = log
            .delivered
            .get(&peer.host)
            .copied()
            .unwrap_or(0)
            .min(total);
        if delivered >= total {
            continue;
        }
        let Some(addr) = peer.addr.clone() else {
            // The relay carries no rotation notice to peers (spec §2 "Rotation": a peer learns
            // the new key only from the LAN record), so say so instead of skipping silently.
            out.push(PeerOutcome {
                host: peer.host.clone(),
                delivered,
                error: Some(NO_LAN_ADDRESS.to_owned()),
            });
            continue;
        };
        let mut error = None;
        while delivered < total {
            let batch = &log.records[delivered..total.min(delivered + MAX_RECORDS_PER_ANNOUNCE)];
            let results = match client.post_rotate(&addr, batch).await {
                Ok(r) => r,
                Err(e) => {
                    error = Some(describe(&e));
                    break;
                }
            };
            let Some(last_taken) = results.iter().rposition(RotateResult::is_taken) else {
                error = results
                    .iter()
                    .find(|r| !r.is_taken())
                    .map(RotateResult::as_text);
                break;
            };
            delivered += last_taken + 1;
            let (p, host, count) = (paths.clone(), peer.host.clone(), delivered);
            tokio::task::spawn_blocking(move || rotation::record_delivered(&p, &host, count))
                .await
                .map_err(|_| AnnounceError::Task)??;
            if last_taken + 1 < batch.len() {
                error = results[last_taken + 1..]
                    .iter()
                    .find(|r| !r.is_taken())
                    .map(RotateResult::as_text);
                break;
            }
        }
        match &error {
            None => {
                tracing::info!(peer = %peer.host, records = delivered, "peer took this host's key rotation")
            }
            Some(why) if why.starts_with("rejected") => {
                tracing::warn!(peer = %peer.host, reason = %why, "peer refused this host's key rotation; retrying in a minute")
            }
            Some(why) => {
                tracing::debug!(peer = %peer.host, error = %why, "key rotation not announced yet; retrying in a minute")
            }
        }
        out.push(PeerOutcome {
            host: peer.host,
            delivered,
            error,
        });
    }
    Ok(out)
}

fn describe(e: &LanError) -> String {
    match e {
        LanError::Status { status: 404, .. } => {
            "peer does not support key rotation; upgrade AgentMBX there".into()
        }
        other => other.to_string(),
    }
}

/// The daemon loop: a pass at start, then one every [`RETRY_INTERVAL`], until `stop` turns
/// true. Returns at once when this host never rotated (rotations happen only while the daemon
/// is stopped, so none can appear later).
pub async fn run(
    paths: Paths,
    mailbox: Mailbox,
    client: LanClient,
    mut stop: tokio::sync::watch::Receiver<bool>,
) {
    if client.ident.history.rotations.is_empty() {
        return;
    }
    let mut warned = std::collections::HashSet::new();
    loop {
        match announce_once(&paths, &mailbox, &client).await {
            Ok(outcomes) => {
                for o in outcomes {
                    if o.error.as_deref() == Some(NO_LAN_ADDRESS) && warned.insert(o.host.clone()) {
                        tracing::warn!(
                            peer = %o.host,
                            "this peer has no LAN address, so it cannot be told of this host's new key (the relay does not carry rotations to peers); until it is, mail between the two waits. Give its address with `agentmbx peers addr {} <host:port>`",
                            o.host
                        );
                    }
                }
            }
            Err(e) => tracing::warn!(error = %e, "cannot announce key rotations"),
        }
        tokio::select! {
            _ = tokio::time::sleep(RETRY_INTERVAL) => {}
            _ = stop.wait_for(|s| *s) => return,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::{Arc, Mutex};

    use axum::extract::State;
    use axum::http::StatusCode;
    use axum::routing::post;
    use axum::{Json, Router};
    use serde_json::{json, Value};

    use crate::host_name::HostName;
    use crate::identity::{self, Identity};
    use crate::keystore::file::FileStore;
    use crate::testutil::{self, T0};

    type Script = Arc<Mutex<Vec<(u16, Value)>>>;

    /// A peer's `/v1/rotate` that answers from `script` (front first; the last answer repeats)
    /// and records each body.
    async fn fake_peer(script: Script, seen: Arc<Mutex<Vec<Value>>>) -> String {
        async fn handle(
            State((script, seen)): State<(Script, Arc<Mutex<Vec<Value>>>)>,
            Json(body): Json<Value>,
        ) -> (StatusCode, Json<Value>) {
            seen.lock().unwrap().push(body);
            let mut s = script.lock().unwrap();
            let (code, answer) = if s.len() > 1 {
                s.remove(0)
            } else {
                s[0].clone()
            };
            (StatusCode::from_u16(code).unwrap(), Json(answer))
        }
        let app = Router::new()
            .route("/v1/rotate", post(handle))
            .with_state((script, seen));
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        tokio::spawn(async move {
            let _ = axum::serve(listener, app).await;
        });
        addr
    }

    struct Fx {
        _dir: tempfile::TempDir,
        paths: Paths,
        store: testutil::Store,
        client: LanClient,
    }

    /// A home that rotated `n` times, with peers `names` pinned (no address yet).
    fn rotated_home(n: usize, names: &[&str]) -> Fx {
        crate::install_tls_provider();
        let dir = tempfile::tempdir().unwrap();
        let paths = Paths::at(dir.path());
        let keys = FileStore::new(dir.path());
        identity::init_with(&paths, Some(&HostName::parse("alpha").unwrap()), &keys).unwrap();
        let config = crate::config::Config::read_file(&paths.config_file())
            .unwrap()
            .unwrap();
        for i in 0..n {
            rotation::rotate_with(&paths, &config, &keys, T0 + i as i64).unwrap();
        }
        let ident: Identity = identity::load_with(&paths, &config, &keys).unwrap();
        let store = testutil::store();
        for name in names {
            let peer = testutil::identity(name);
            store
                .mailbox
                .with(|c| peers::add(c, name, &peer.host_key.public().to_b64(), T0))
                .unwrap();
        }
        let client = LanClient::new(Arc::new(ident), testutil::clock(), 7373).unwrap();
        Fx {
            _dir: dir,
            paths,
            store,
            client,
        }
    }

    fn set_addr(fx: &Fx, host: &str, addr: &str) {
        fx.store
            .mailbox
            .with(|c| peers::set_addr(c, host, addr, "cli"))
            .unwrap();
    }

    #[tokio::test]
    async fn a_peer_is_retried_until_it_has_the_record_and_never_after() {
        let fx = rotated_home(1, &["beta"]);
        let script: Script = Arc::new(Mutex::new(vec![
            (503, json!({"error": "busy"})),
            (200, json!({"results": ["rotated"]})),
        ]));
        let seen = Arc::new(Mutex::new(Vec::new()));
        // Offline: no address answers.
        let dead = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let dead_addr = dead.local_addr().unwrap().to_string();
        drop(dead);
        set_addr(&fx, "beta", &dead_addr);
        let out = announce_once(&fx.paths, &fx.store.mailbox, &fx.client)
            .await
            .unwrap();
        assert_eq!(out.len(), 1);
        assert_eq!(out[0].delivered, 0);
        assert!(
            out[0].error.as_deref().unwrap().contains("unreachable"),
            "{out:?}"
        );

        let addr = fake_peer(script, seen.clone()).await;
        set_addr(&fx, "beta", &addr);
        let out = announce_once(&fx.paths, &fx.store.mailbox, &fx.client)
            .await
            .unwrap();
        assert_eq!(out[0].delivered, 0, "a 503 is not taken");
        assert!(out[0].error.as_deref().unwrap().contains("503"), "{out:?}");
        let out = announce_once(&fx.paths, &fx.store.mailbox, &fx.client)
            .await
            .unwrap();
        assert_eq!(
            out,
            vec![PeerOutcome {
                host: "beta".into(),
                delivered: 1,
                error: None
            }]
        );
        assert_eq!(rotation::read_log(&fx.paths).unwrap().delivered["beta"], 1);
        let bodies = seen.lock().unwrap().clone();
        assert_eq!(bodies.len(), 2);
        let sent = &bodies[1]["records"];
        assert_eq!(sent.as_array().unwrap().len(), 1);
        assert_eq!(
            sent[0],
            serde_json::to_value(&fx.client.ident.history.rotations[0]).unwrap()
        );
        // Done: the next pass sends nothing.
        let out = announce_once(&fx.paths, &fx.store.mailbox, &fx.client)
            .await
            .unwrap();
        assert!(out.is_empty(), "{out:?}");
        assert_eq!(seen.lock().unwrap().len(), 2);
    }

    #[tokio::test]
    async fn refusals_keep_the_count_and_a_later_current_covers_what_came_before() {
        let fx = rotated_home(3, &["gamma"]);
        let script: Script = Arc::new(Mutex::new(vec![
            (
                200,
                json!({"results": ["rotated", "rejected:rotation is not signed by the new host key", "rejected:rotation does not start from the pinned host key"]}),
            ),
            (
                200,
                json!({"results": ["rejected:rotation does not start from the pinned host key", "current"]}),
            ),
        ]));
        let seen = Arc::new(Mutex::new(Vec::new()));
        let addr = fake_peer(script, seen.clone()).await;
        set_addr(&fx, "gamma", &addr);
        let out = announce_once(&fx.paths, &fx.store.mailbox, &fx.client)
            .await
            .unwrap();
        assert_eq!(out[0].delivered, 1);
        assert_eq!(
            out[0].error.as_deref(),
            Some("rejected:rotation is not signed by the new host key")
        );
        // The next pass starts at the second record; `current` for the last covers both.
        let out = announce_once(&fx.paths, &fx.store.mailbox, &fx.client)
            .await
            .unwrap();
        assert_eq!(out[0].delivered, 3);
        assert_eq!(out[0].error, None);
        let bodies = seen.lock().unwrap().clone();
        assert_eq!(bodies[0]["records"].as_array().unwrap().len(), 3);
        assert_eq!(bodies[1]["records"].as_array().unwrap().len(), 2);
        assert_eq!(
            bodies[1]["records"][0]["rec"]["new_pub"],
            fx.client.ident.history.rotations[1].rec.new_pub.as_str()
        );
    }

    #[tokio::test]
    async fn more_than_fifty_records_go_in_batches_and_a_peer_without_address_is_skipped() {
        let fx = rotated_home(MAX_RECORDS_PER_ANNOUNCE + 1, &["delta", "omega"]);
        let seen = Arc::new(Mutex::new(Vec::new()));
        // Answers "rotated" for however many records it was sent.
        async fn all_rotated(
            State(seen): State<Arc<Mutex<Vec<Value>>>>,
            Json(body): Json<Value>,
        ) -> Json<Value> {
            let n = body["records"].as_array().map_or(0, Vec::len);
            seen.lock().unwrap().push(body);
            Json(json!({"results": vec!["rotated"; n]}))
        }
        let app = Router::new()
            .route("/v1/rotate", post(all_rotated))
            .with_state(seen.clone());
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        tokio::spawn(async move {
            let _ = axum::serve(listener, app).await;
        });
        set_addr(&fx, "delta", &addr);
        let out = announce_once(&fx.paths, &fx.store.mailbox, &fx.client)
            .await
            .unwrap();
        let delta = out.iter().find(|o| o.host == "delta").unwrap();
        assert_eq!(
            delta,
            &PeerOutcome {
                host: "delta".into(),
                delivered: MAX_RECORDS_PER_ANNOUNCE + 1,
                error: None
            }
        );
        // The peer without an address is reported, not silently skipped.
        let omega = out.iter().find(|o| o.host == "omega").unwrap();
        assert_eq!(omega.delivered, 0);
        assert_eq!(omega.error.as_deref(), Some(NO_LAN_ADDRESS));
        assert_eq!(out.len(), 2);
        let sizes: Vec<usize> = seen
            .lock()
            .unwrap()
            .iter()
            .map(|b| b["records"].as_array().unwrap().len())
            .collect();
        assert_eq!(sizes, vec![MAX_RECORDS_PER_ANNOUNCE, 1]);
        assert!(!rotation::read_log(&fx.paths)
            .unwrap()
            .delivered
            .contains_key("omega"));
    }
}
