//! The supervisor protocol while the daemon runs (sd-notify, `sd_notify(3)`): `READY=1` once
//! the listeners are bound and the store is open, a one-line `STATUS=`, `WATCHDOG=1` pings
//! from a real liveness check, and `STOPPING=1` when a shutdown signal arrives.
//!
//! Without `NOTIFY_SOCKET` in the environment every function here is a no-op (Homebrew's unit
//! and a daemon started by hand). A failed send is logged at debug level and never stops the
//! daemon. This module must never decide when the daemon stops or change the store: the
//! liveness check only reads.

use std::time::Duration;

use rusqlite::Connection;
use sd_notify::NotifyState;

use crate::mailbox::{Mailbox, MailboxError};
use crate::transport::relay_client::state as relay_state;

/// Shortest pause between two `STATUS=` updates (and status checks when no watchdog runs).
pub const STATUS_INTERVAL: Duration = Duration::from_secs(5);

/// Whether a service manager listens (`NOTIFY_SOCKET` is set).
pub fn enabled() -> bool {
    std::env::var_os("NOTIFY_SOCKET").is_some_and(|s| !s.is_empty())
}

fn send(states: &[NotifyState<'_>]) {
    if let Err(e) = sd_notify::notify(states) {
        tracing::debug!(error = %e, "sd-notify message not delivered");
    }
}

/// `READY=1` with a first `STATUS=`: call once, after the local API and LAN listeners are
/// bound and the mailbox store is open.
pub fn ready(status: &str) {
    if enabled() {
        send(&[NotifyState::Ready, NotifyState::Status(status)]);
    }
}

/// `STOPPING=1`: call when a shutdown signal arrived, before the graceful shutdown.
pub fn stopping() {
    if enabled() {
        send(&[NotifyState::Stopping, NotifyState::Status("stopping")]);
    }
}

/// The watchdog interval the manager asked for (`WATCHDOG_USEC`, for this process per
/// `WATCHDOG_PID`), if any.
pub fn watchdog() -> Option<Duration> {
    sd_notify::watchdog_enabled().filter(|d| !d.is_zero())
}

/// The counts behind the status line.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Snapshot {
    /// The relay's standing (`ok`, `unreachable`, …; `starting` before the first pass), or
    /// `None` when no relay is configured.
    pub relay: Option<String>,
    /// Outbox rows not yet handed over (`pending`, `repush`).
    pub queued: u64,
    /// Paired peer hosts.
    pub peers: u64,
}

impl Snapshot {
    /// Reads the counts; this query is also the watchdog's proof that the store answers.
    /// Errors: SQLite failures.
    pub fn read(conn: &Connection, relay_url: Option<&str>) -> Result<Snapshot, MailboxError> {
        let queued: i64 = conn.query_row(
            "SELECT count(*) FROM outbox WHERE state IN ('pending','repush')",
            [],
            |r| r.get(0),
        )?;
        let peers: i64 = conn.query_row("SELECT count(*) FROM peers", [], |r| r.get(0))?;
        let relay = match relay_url {
            None => None,
            Some(url) => Some(
                relay_state::state(conn, url)?
                    .map(|s| s.state.as_str().to_string())
                    .unwrap_or_else(|| "starting".to_string()),
            ),
        };
        Ok(Snapshot {
            relay,
            queued: u64::try_from(queued).unwrap_or_default(),
            peers: u64::try_from(peers).unwrap_or_default(),
        })
    }

    /// The one-line status: `relay ok, 3 queued, 2 peers` (`no relay, …` without one).
    pub fn line(&self) -> String {
        let relay = match &self.relay {
            Some(s) => format!("relay {s}"),
            None => "no relay".to_string(),
        };
        let plural = |n: u64, one: &str, many: &str| {
            if n == 1 {
                format!("1 {one}")
            } else {
                format!("{n} {many}")
            }
        };
        format!(
            "{relay}, {} queued, {}",
            self.queued,
            plural(self.peers, "peer", "peers")
        )
    }
}

/// The status line now, or `starting` when the store does not answer.
pub fn status_now(mailbox: &Mailbox, relay_url: Option<&str>) -> String {
    mailbox
        .with(|c| Snapshot::read(c, relay_url))
        .map(|s| s.line())
        .unwrap_or_else(|_| "starting".to_string())
}

/// The relay URL of the running config, if one is configured.
fn relay_url(
    config: &tokio::sync::watch::Receiver<std::sync::Arc<crate::config::Config>>,
) -> Option<String> {
    config.borrow().relay.as_ref().map(|r| r.url.clone())
}

/// Runs until `stop` turns true: every tick (half the watchdog interval, at most
/// [`STATUS_INTERVAL`]) reads the [`Snapshot`] from the store with a deadline of one tick;
/// when it answers, sends `WATCHDOG=1` (only when the watchdog is enabled) and `STATUS=` when
/// the line changed (at most every [`STATUS_INTERVAL`]). A store that does not answer gets no
/// ping, so the manager restarts a daemon whose store or runtime hangs. The relay URL is read
/// from the running config (`config`) at every tick, so a changed `[relay] url` shows at once.
/// Returns at once when no manager listens.
pub async fn supervise(
    mailbox: Mailbox,
    config: tokio::sync::watch::Receiver<std::sync::Arc<crate::config::Config>>,
    mut stop: tokio::sync::watch::Receiver<bool>,
) {
    if !enabled() {
        return;
    }
    let watchdog = watchdog();
    let tick = watchdog
        .map(|w| (w / 2).min(STATUS_INTERVAL))
        .unwrap_or(STATUS_INTERVAL)
        .max(Duration::from_millis(10));
    if let Some(w) = watchdog {
        tracing::info!(
            watchdog_ms = w.as_millis() as u64,
            "service watchdog on: pinging every {} ms",
            tick.as_millis()
        );
    }
    let mut last_line = String::new();
    let mut last_status: Option<tokio::time::Instant> = None;
    let mut interval = tokio::time::interval(tick);
    interval.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = interval.tick() => {}
            _ = stop.wait_for(|s| *s) => return,
        }
        let url = relay_url(&config);
        let read = tokio::time::timeout(
            tick,
            mailbox.run(move |c| Snapshot::read(c, url.as_deref())),
        )
        .await;
        let snapshot = match read {
            Ok(Ok(s)) => s,
            Ok(Err(e)) => {
                tracing::warn!(error = %e, "liveness check: the mailbox store failed; no watchdog ping");
                continue;
            }
            Err(_) => {
                tracing::warn!("liveness check: the mailbox store did not answer within {} ms; no watchdog ping", tick.as_millis());
                continue;
            }
        };
        let line = snapshot.line();
        let status_due =
            line != last_line && last_status.is_none_or(|t| t.elapsed() >= STATUS_INTERVAL);
        let mut states = Vec::new();
        if watchdog.is_some() {
            states.push(NotifyState::Watchdog);
        }
        if status_due {
            states.push(NotifyState::Status(&line));
        }
        if !states.is_empty() {
            send(&states);
        }
        if status_due {
            last_status = Some(tokio::time::Instant::now());
            last_line = line;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn relay_url_follows_the_running_config() {
        let (tx, rx) =
            tokio::sync::watch::channel(std::sync::Arc::new(crate::config::Config::default()));
        assert_eq!(relay_url(&rx), None);
        let c = crate::config::Config {
            relay: Some(crate::config::RelayConfig {
                url: "https://relay.example".into(),
                key: None,
                token_command: None,
            }),
            ..Default::default()
        };
        tx.send(std::sync::Arc::new(c)).expect("send");
        assert_eq!(relay_url(&rx).as_deref(), Some("https://relay.example"));
    }

    #[test]
    fn status_line_shapes() {
        let s = Snapshot {
            relay: Some("ok".into()),
            queued: 3,
            peers: 2,
        };
        assert_eq!(s.line(), "relay ok, 3 queued, 2 peers");
        let s = Snapshot {
            relay: None,
            queued: 0,
            peers: 1,
        };
        assert_eq!(s.line(), "no relay, 0 queued, 1 peer");
    }

    #[test]
    fn snapshot_counts_from_a_fresh_store() {
        let dir = tempfile::tempdir().expect("tempdir");
        let mailbox = Mailbox::open(&dir.path().join("mailbox.db")).expect("open");
        let snap = mailbox
            .with(|c| Snapshot::read(c, Some("https://relay.example")))
            .expect("read");
        assert_eq!(
            snap,
            Snapshot {
                relay: Some("starting".into()),
                queued: 0,
                peers: 0
            }
        );
    }
}
