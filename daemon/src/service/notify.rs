//! The supervisor protocol while the daemon runs (sd-notify, `sd_notify(3)`): `READY=1` once
//! the listeners are bound and the store is open, a one-line `STATUS=`, `WATCHDOG=1` pings
//! from a real liveness check (the store answers and every registered loop progresses,
//! [`crate::liveness`]), and `STOPPING=1` when a shutdown signal arrives.
//!
//! Without `NOTIFY_SOCKET` in the environment every function here is a no-op (Homebrew's unit
//! and a daemon started by hand). A failed send is logged at debug level and never stops the
//! daemon. This module must never decide when the daemon stops or change the store: the
//! liveness check only reads.

use std::time::Duration;

use rusqlite::Connection;
use sd_notify::NotifyState;

use crate::liveness::{self, Liveness};
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

/// Where sd-notify messages go: the service manager ([`SdNotify`]) or, in tests, a recorder.
pub trait Sink {
    /// Sends one datagram carrying `states` (never called with an empty list).
    fn send(&mut self, states: &[NotifyState<'_>]);
}

/// The real [`Sink`]: `sd_notify::notify` on `NOTIFY_SOCKET` (a failed send is logged at
/// debug level).
#[derive(Debug, Default, Clone, Copy)]
pub struct SdNotify;

impl Sink for SdNotify {
    fn send(&mut self, states: &[NotifyState<'_>]) {
        send(states);
    }
}

/// The `STATUS=` line while loops are stale: `unhealthy: <loop> loop stalled <N> s` (several
/// joined with `; `, whole seconds since the loop's last stamp).
pub fn stalled_line(stale: &[(&'static str, Duration)]) -> String {
    let parts: Vec<String> = stale
        .iter()
        .map(|(name, gap)| format!("{name} loop stalled {} s", gap.as_secs()))
        .collect();
    format!("unhealthy: {}", parts.join("; "))
}

/// The `STATUS=` line while the store does not answer.
pub const STORE_DOWN_LINE: &str = "unhealthy: the mailbox store does not answer";

/// The decisions of [`supervise`] from one tick to the next: whether to ping, which status
/// line to send and when, and what to log. Pure apart from the [`Sink`] and logs.
#[derive(Debug)]
pub struct Supervisor {
    watchdog: bool,
    last_line: String,
    last_status: Option<tokio::time::Instant>,
    last_stale: Vec<&'static str>,
    store_down: bool,
}

impl Supervisor {
    /// A supervisor that pings `WATCHDOG=1` on healthy ticks when `watchdog` is true.
    pub fn new(watchdog: bool) -> Self {
        Supervisor {
            watchdog,
            last_line: String::new(),
            last_status: None,
            last_stale: Vec::new(),
            store_down: false,
        }
    }

    /// One tick. `store` is the store check (`Ok(status line)`, or `Err(why)` when it failed or
    /// did not answer in time) and `stale` the loops past their bound ([`Liveness::stale`]).
    /// Healthy (the store answered and no loop is stale): `WATCHDOG=1` when the watchdog is on.
    /// Otherwise no ping, and the line says why (`unhealthy: …`). `STATUS=` goes only when the
    /// line changed and at least [`STATUS_INTERVAL`] after the previous one. A loop becoming
    /// stale, a store failing, and either recovering are logged once per change.
    pub fn tick(
        &mut self,
        store: Result<String, String>,
        stale: &[(&'static str, Duration)],
        sink: &mut impl Sink,
    ) {
        let names: Vec<&'static str> = stale.iter().map(|(n, _)| *n).collect();
        if names != self.last_stale {
            for (name, gap) in stale.iter().filter(|(n, _)| !self.last_stale.contains(n)) {
                tracing::warn!(
                    loop_name = *name,
                    gap_ms = gap.as_millis() as u64,
                    "liveness check: the {name} loop made no progress for {} s; no watchdog ping",
                    gap.as_secs()
                );
            }
            for name in self.last_stale.iter().filter(|n| !names.contains(n)) {
                tracing::info!(
                    loop_name = *name,
                    "liveness check: the {name} loop progresses again"
                );
            }
            self.last_stale = names;
        }
        let line = match &store {
            Err(why) => {
                if !self.store_down {
                    tracing::warn!(error = %why, "liveness check: the mailbox store failed; no watchdog ping");
                }
                self.store_down = true;
                STORE_DOWN_LINE.to_string()
            }
            Ok(line) => {
                if self.store_down {
                    tracing::info!("liveness check: the mailbox store answers again");
                }
                self.store_down = false;
                if stale.is_empty() {
                    line.clone()
                } else {
                    stalled_line(stale)
                }
            }
        };
        let healthy = store.is_ok() && stale.is_empty();
        let status_due = line != self.last_line
            && self
                .last_status
                .is_none_or(|t| t.elapsed() >= STATUS_INTERVAL);
        let mut states = Vec::new();
        if healthy && self.watchdog {
            states.push(NotifyState::Watchdog);
        }
        if status_due {
            states.push(NotifyState::Status(&line));
        }
        if !states.is_empty() {
            sink.send(&states);
        }
        if status_due {
            self.last_status = Some(tokio::time::Instant::now());
            self.last_line = line;
        }
    }
}

/// The tick of [`supervise`]: half the watchdog interval, at most [`STATUS_INTERVAL`], at
/// least 10 ms.
pub fn tick_for(watchdog: Option<Duration>) -> Duration {
    watchdog
        .map(|w| (w / 2).min(STATUS_INTERVAL))
        .unwrap_or(STATUS_INTERVAL)
        .max(Duration::from_millis(10))
}

/// The loop behind [`supervise`], with its parts given: every `tick` (first at once) it runs
/// the store check `probe` (spawned, with a deadline of one tick; a check still running at the
/// next tick is waited for again rather than started twice, so a hung store never piles up
/// blocked threads), reads [`Liveness::stale`] from `liveness`, and lets [`Supervisor::tick`]
/// decide what goes to `sink`. Returns when `stop` turns true.
pub async fn supervise_with<P, F>(
    tick: Duration,
    watchdog: bool,
    liveness: &Liveness,
    mut probe: P,
    sink: &mut impl Sink,
    mut stop: tokio::sync::watch::Receiver<bool>,
) where
    P: FnMut() -> F,
    F: std::future::Future<Output = Result<String, String>> + Send + 'static,
{
    let mut supervisor = Supervisor::new(watchdog);
    let mut pending: Option<tokio::task::JoinHandle<Result<String, String>>> = None;
    let mut interval = tokio::time::interval(tick);
    interval.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = interval.tick() => {}
            _ = stop.wait_for(|s| *s) => return,
        }
        let handle = pending.get_or_insert_with(|| tokio::spawn(probe()));
        let store = match tokio::time::timeout(tick, &mut *handle).await {
            Ok(done) => {
                pending = None;
                done.unwrap_or_else(|_| Err("the store check failed".to_string()))
            }
            Err(_) => Err(format!(
                "the store did not answer within {} ms",
                tick.as_millis()
            )),
        };
        supervisor.tick(store, &liveness.stale(), sink);
    }
}

/// Runs until `stop` turns true: every tick ([`tick_for`]: half the watchdog interval, at most
/// [`STATUS_INTERVAL`]) reads the [`Snapshot`] from the store with a deadline of one tick and
/// the stale loops of [`liveness::global`]; `WATCHDOG=1` (only when the watchdog is enabled)
/// only when the store answered and every registered loop (LAN delivery, relay client) made
/// progress within its bound, so the manager restarts a daemon whose store, runtime or a loop
/// hangs; `STATUS=` when the line changed (at most every [`STATUS_INTERVAL`]), saying
/// `unhealthy: …` and why while no ping goes ([`Supervisor::tick`]). The relay URL is read from
/// the running config (`config`) at every tick, so a changed `[relay] url` shows at once.
/// This task's own ticks prove the runtime runs. Returns at once when no manager listens.
pub async fn supervise(
    mailbox: Mailbox,
    config: tokio::sync::watch::Receiver<std::sync::Arc<crate::config::Config>>,
    stop: tokio::sync::watch::Receiver<bool>,
) {
    if !enabled() {
        return;
    }
    let watchdog = watchdog();
    let tick = tick_for(watchdog);
    if let Some(w) = watchdog {
        tracing::info!(
            watchdog_ms = w.as_millis() as u64,
            "service watchdog on: pinging every {} ms while the store answers and every loop progresses",
            tick.as_millis()
        );
    }
    let probe = move || {
        let (mailbox, url) = (mailbox.clone(), relay_url(&config));
        async move {
            mailbox
                .run(move |c| Snapshot::read(c, url.as_deref()))
                .await
                .map(|s| s.line())
                .map_err(|e| e.to_string())
        }
    };
    supervise_with(
        tick,
        watchdog.is_some(),
        liveness::global(),
        probe,
        &mut SdNotify,
        stop,
    )
    .await;
}

#[cfg(test)]
mod tests {
    use super::*;

    use std::sync::{Arc, Mutex};
    use tokio::time::Instant;

    /// Records every datagram with the (paused) time it was sent.
    #[derive(Clone, Default)]
    struct Recorder(Arc<Mutex<Vec<Sent>>>);

    /// One datagram: when, and its lines.
    type Sent = (Instant, Vec<String>);

    impl Sink for Recorder {
        fn send(&mut self, states: &[NotifyState<'_>]) {
            assert!(!states.is_empty());
            let lines = states.iter().map(|s| s.to_string()).collect();
            self.0.lock().expect("lock").push((Instant::now(), lines));
        }
    }

    impl Recorder {
        fn all(&self) -> Vec<Sent> {
            self.0.lock().expect("lock").clone()
        }
        fn pings(&self) -> usize {
            self.all()
                .iter()
                .filter(|(_, l)| l.iter().any(|l| l == "WATCHDOG=1"))
                .count()
        }
        fn statuses(&self) -> Vec<(Instant, String)> {
            self.all()
                .into_iter()
                .flat_map(|(t, l)| {
                    l.into_iter()
                        .filter_map(move |l| l.strip_prefix("STATUS=").map(|s| (t, s.to_string())))
                })
                .collect()
        }
    }

    /// What the fake store check answers: a line, an error, or nothing (hangs).
    #[derive(Clone)]
    enum Answer {
        Line(String),
        Fails,
        Hangs,
    }

    struct Harness {
        sink: Recorder,
        answer: Arc<Mutex<Answer>>,
        probes: Arc<Mutex<u32>>,
        live: Liveness,
        stop: tokio::sync::watch::Sender<bool>,
        task: tokio::task::JoinHandle<()>,
    }

    /// The supervise loop with a 1 s tick, the watchdog on, a fake store and a recorder.
    fn harness() -> Harness {
        let sink = Recorder::default();
        let answer = Arc::new(Mutex::new(Answer::Line(
            "no relay, 0 queued, 0 peers".into(),
        )));
        let probes = Arc::new(Mutex::new(0u32));
        let live = Liveness::new(None);
        let (stop, stop_rx) = tokio::sync::watch::channel(false);
        let (a, p, l, mut s) = (answer.clone(), probes.clone(), live.clone(), sink.clone());
        let task = tokio::spawn(async move {
            let probe = move || {
                *p.lock().expect("lock") += 1;
                let a = a.lock().expect("lock").clone();
                async move {
                    match a {
                        Answer::Line(l) => Ok(l),
                        Answer::Fails => Err("disk I/O error".to_string()),
                        Answer::Hangs => std::future::pending().await,
                    }
                }
            };
            supervise_with(Duration::from_secs(1), true, &l, probe, &mut s, stop_rx).await;
        });
        Harness {
            sink,
            answer,
            probes,
            live,
            stop,
            task,
        }
    }

    impl Harness {
        fn set(&self, a: Answer) {
            *self.answer.lock().expect("lock") = a;
        }
        async fn finish(self) {
            self.stop.send(true).expect("stop");
            self.task.await.expect("join");
        }
    }

    /// Lets the loop run `secs` seconds of paused time. Tests start with [`offset`], so the
    /// test acts at half seconds and the loop ticks at whole ones (no two at one instant).
    async fn run_for(secs: u64) {
        tokio::time::sleep(Duration::from_secs(secs)).await;
    }

    async fn offset() {
        tokio::time::sleep(Duration::from_millis(500)).await;
    }

    #[tokio::test(start_paused = true)]
    async fn a_ping_every_tick_while_healthy_and_one_status() {
        let h = harness();
        offset().await;
        run_for(10).await; // ticks at 0..=10 s
        assert_eq!(h.sink.pings(), 11);
        let statuses = h.sink.statuses();
        assert_eq!(statuses.len(), 1, "{statuses:?}");
        assert_eq!(statuses[0].1, "no relay, 0 queued, 0 peers");
        h.finish().await;
    }

    #[tokio::test(start_paused = true)]
    async fn status_only_on_change_and_never_twice_within_the_interval() {
        let start = Instant::now();
        let h = harness();
        offset().await;
        run_for(1).await;
        // A new line every tick for 20 s: sent at most every STATUS_INTERVAL.
        for i in 0..20 {
            h.set(Answer::Line(format!("no relay, {i} queued, 0 peers")));
            run_for(1).await;
        }
        let statuses = h.sink.statuses();
        for pair in statuses.windows(2) {
            assert!(
                pair[1].0 - pair[0].0 >= STATUS_INTERVAL,
                "two STATUS= within {STATUS_INTERVAL:?}: {statuses:?}"
            );
            assert_ne!(pair[0].1, pair[1].1);
        }
        let at: Vec<u64> = statuses
            .iter()
            .map(|(t, _)| (*t - start).as_secs())
            .collect();
        assert_eq!(at, vec![0, 5, 10, 15, 20], "{statuses:?}");
        assert_eq!(statuses[1].1, "no relay, 3 queued, 0 peers");
        // The line stops changing: one last STATUS= once the interval allows, then none.
        run_for(10).await;
        let more = h.sink.statuses();
        assert!(more.len() <= statuses.len() + 1, "{more:?}");
        let n = more.len();
        run_for(10).await;
        assert_eq!(
            h.sink.statuses().len(),
            n,
            "an unchanged line is not sent again"
        );
        assert_eq!(h.sink.pings(), 42, "a ping every tick throughout");
        h.finish().await;
    }

    #[tokio::test(start_paused = true)]
    async fn no_ping_while_a_loop_is_stale_and_again_after_it_stamps() {
        let h = harness();
        let beat = h.live.register("lan delivery", Duration::from_secs(3));
        offset().await;
        run_for(4).await; // ticks 0..=3 s healthy; at 4 s the gap is past the bound
        assert_eq!(h.sink.pings(), 4);
        run_for(6).await; // ticks 5..=10 s: still stale
        assert_eq!(h.sink.pings(), 4, "no ping while the loop is stale");
        let statuses = h.sink.statuses();
        let unhealthy: Vec<_> = statuses
            .iter()
            .filter(|(_, l)| l.starts_with("unhealthy: "))
            .collect();
        // The first STATUS= was at 0 s: the next may go at 5 s.
        assert_eq!(unhealthy[0].1, "unhealthy: lan delivery loop stalled 5 s");
        assert_eq!(unhealthy.len(), 2, "{statuses:?}");
        beat.stamp();
        run_for(2).await; // ticks 11, 12 s
        assert_eq!(h.sink.pings(), 6, "pings again once the loop stamped");
        // A loop that ends (its beat dropped) is not stale, however long ago it stamped.
        drop(beat);
        run_for(5).await; // ticks 13..=17 s
        assert_eq!(h.sink.pings(), 11);
        let last = h.sink.statuses().last().cloned().expect("status");
        assert_eq!(last.1, "no relay, 0 queued, 0 peers");
        h.finish().await;
    }

    #[tokio::test(start_paused = true)]
    async fn no_ping_while_the_store_fails_or_hangs() {
        let h = harness();
        offset().await;
        run_for(2).await;
        assert_eq!(h.sink.pings(), 3);
        h.set(Answer::Fails);
        run_for(6).await;
        assert_eq!(h.sink.pings(), 3, "no ping while the store fails");
        assert!(h.sink.statuses().iter().any(|(_, l)| l == STORE_DOWN_LINE));
        h.set(Answer::Hangs);
        let probes = *h.probes.lock().expect("lock");
        run_for(5).await;
        assert_eq!(h.sink.pings(), 3, "no ping while the store hangs");
        assert_eq!(
            *h.probes.lock().expect("lock"),
            probes + 1,
            "a hung check is waited for, not started again"
        );
        h.finish().await;
    }

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
