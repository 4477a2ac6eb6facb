//! Watching `config.toml` while the daemon runs (design README "Files, configuration and
//! keys": the config is layered and watched).
//!
//! This module owns: the file watcher (the `notify` crate on the home directory, filtered to
//! the file name so an editor that replaces the file by rename is seen), the debounce
//! ([`DEBOUNCE_MS`]), the comparison of the running configuration with the re-read one
//! ([`diff`]: which keys changed and whether each applies live), the `config changed: <key>
//! <old> -> <new>` log lines, the log-filter hook ([`set_log_filter_hook`]) and the relay loop
//! supervisor ([`supervise_relay`]) that starts the relay client when a `[relay]` table
//! appears, stops it when the table goes and restarts it when its settings change.
//!
//! The running configuration is published on a `tokio::sync::watch` channel of
//! `Arc<Config>`; readers take the current value each pass. Settings that are safe to change
//! live (`log_level`, `relay_pull_interval_ms`, the `[relay]` table: added, removed, or its
//! `url`, `key`, `token_command`) are applied; the others (listen addresses and ports, host
//! name, advertised address, mDNS, key store) are logged as needing a restart and keep their
//! running values.
//!
//! It must never write the file, never stop the daemon because of a bad file (an invalid file
//! is refused with one error line and the running configuration is kept), and never log
//! secrets (`relay.token_command` is shown as `<redacted>`).

use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use tokio::sync::{mpsc, watch};

use crate::config::{Config, ConfigError, RelayConfig};

/// Quiet time after the last file event before the file is re-read (ms): an editor's save is
/// often several events (truncate, write, rename).
pub const DEBOUNCE_MS: u64 = 500;

/// The environment variable that sets the log filter; when set it wins over `log_level`.
pub const LOG_ENV: &str = "MBX_LOG";

/// Replaces the process's log filter with the given `EnvFilter` text; `Err` carries why the
/// filter was refused.
pub type LogFilterHook = Box<dyn Fn(&str) -> Result<(), String> + Send + Sync>;

static LOG_FILTER: OnceLock<LogFilterHook> = OnceLock::new();

/// Installs the hook that changes the log filter at run time (the binary's logger, built with
/// a `tracing_subscriber::reload` layer). Only the first call has an effect.
pub fn set_log_filter_hook(hook: LogFilterHook) {
    let _ = LOG_FILTER.set(hook);
}

/// Whether `MBX_LOG` is set (non-empty): then `log_level` from the file is not applied.
pub fn log_env_set() -> bool {
    std::env::var(LOG_ENV).is_ok_and(|v| !v.trim().is_empty())
}

/// Applies `filter` (a `log_level` value) to the running logger. `Ok(false)` when no hook is
/// installed (a library user without the binary's logger). Errors: the filter's parse error.
pub fn apply_log_filter(filter: &str) -> Result<bool, String> {
    match LOG_FILTER.get() {
        Some(hook) => hook(filter).map(|()| true),
        None => Ok(false),
    }
}

/// The filter the daemon logs at for `config`: `MBX_LOG` when set (then `None`: nothing to
/// apply), else `log_level`, else `info`.
pub fn effective_log_filter(config: &Config) -> Option<String> {
    if log_env_set() {
        return None;
    }
    Some(config.log_level.clone().unwrap_or_else(|| "info".into()))
}

/// One setting that differs between the running and the re-read configuration.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Change {
    /// The TOML key (dotted for tables, e.g. `relay.url`; `relay` when the table itself is
    /// added or removed).
    pub key: &'static str,
    /// The running value, as logged (secrets redacted; `(unset)` when absent).
    pub old: String,
    /// The new value, as logged.
    pub new: String,
    /// Whether the daemon applies it without a restart.
    pub live: bool,
}

const UNSET: &str = "(unset)";
const REDACTED: &str = "<redacted>";

fn opt<T: ToString>(v: &Option<T>) -> String {
    v.as_ref().map_or(UNSET.into(), T::to_string)
}

/// The settings that differ between `old` (running) and `new` (re-read), in file order, each
/// marked live or needing a restart (module doc). `relay.token_command` values are redacted.
pub fn diff(old: &Config, new: &Config) -> Vec<Change> {
    let mut out = Vec::new();
    let mut push = |key: &'static str, o: String, n: String, live: bool| {
        if o != n {
            out.push(Change {
                key,
                old: o,
                new: n,
                live,
            });
        }
    };
    push("host", opt(&old.host), opt(&new.host), false);
    push(
        "api_port",
        old.api_port.to_string(),
        new.api_port.to_string(),
        false,
    );
    push(
        "api_bind",
        old.api_bind.to_string(),
        new.api_bind.to_string(),
        false,
    );
    push(
        "lan_port",
        old.lan_port.to_string(),
        new.lan_port.to_string(),
        false,
    );
    push(
        "lan_bind",
        old.lan_bind.to_string(),
        new.lan_bind.to_string(),
        false,
    );
    push("advertise", opt(&old.advertise), opt(&new.advertise), false);
    let addrs = |c: &Config| format!("{:?}", c.self_addrs);
    push("self_addrs", addrs(old), addrs(new), false);
    push("mdns", old.mdns.to_string(), new.mdns.to_string(), false);
    push(
        "key_store",
        old.key_store.to_string(),
        new.key_store.to_string(),
        false,
    );
    push("log_level", opt(&old.log_level), opt(&new.log_level), true);
    push(
        "hook_concurrency",
        old.hook_concurrency.to_string(),
        new.hook_concurrency.to_string(),
        false,
    );
    // Hooks are shown by name (a command may hold what the owner would not log).
    let names = |c: &Config| {
        let n: Vec<&str> = c.hooks.iter().map(|h| h.name.as_str()).collect();
        format!("[{}]", n.join(", "))
    };
    let (o, mut n) = (names(old), names(new));
    if old.hooks != new.hooks && o == n {
        n.push_str(" (edited)");
    }
    push("hooks", o, n, false);
    push(
        "relay_pull_interval_ms",
        old.relay_pull_interval_ms.to_string(),
        new.relay_pull_interval_ms.to_string(),
        true,
    );
    push(
        "relay_stream",
        old.relay_stream.to_string(),
        new.relay_stream.to_string(),
        true,
    );
    let rate = |c: &Config| format!("{:?}", c.api_rate.values_by_key());
    push("api_rate", rate(old), rate(new), false);
    match (&old.relay, &new.relay) {
        (Some(o), Some(n)) => {
            push("relay.url", o.url.clone(), n.url.clone(), true);
            push("relay.key", opt(&o.key), opt(&n.key), true);
            let cmd = |r: &RelayConfig| {
                r.token_command
                    .as_ref()
                    .map_or(UNSET.into(), |_| REDACTED.to_string())
            };
            // Both redacted: a changed command still shows as a change.
            if o.token_command != n.token_command {
                out.push(Change {
                    key: "relay.token_command",
                    old: cmd(o),
                    new: cmd(n),
                    live: true,
                });
            }
        }
        // The table added or removed: shown by its URL (the token command is never shown).
        (o, n) => {
            let url = |r: &Option<RelayConfig>| r.as_ref().map_or(UNSET.into(), |r| r.url.clone());
            push("relay", url(o), url(n), true);
        }
    }
    out
}

/// The configuration to run after a change: `new`'s live settings (log level, pull interval,
/// the whole `[relay]` table, present or not) on `old`'s restart-only ones.
pub fn merge_live(old: &Config, new: &Config) -> Config {
    let mut merged = old.clone();
    merged.log_level = new.log_level.clone();
    merged.relay_pull_interval_ms = new.relay_pull_interval_ms;
    merged.relay_stream = new.relay_stream;
    merged.relay = new.relay.clone();
    merged
}

/// Logs each change (`config changed: <key> <old> -> <new>`, with `(needs a restart)` for
/// those not applied), applies a changed log filter, and returns the configuration to run.
/// The `log_level` line is logged under the more verbose of the old and new filter
/// ([`announce_log_level`]), so it shows whichever way the level moves.
pub fn apply(running: &Config, new: &Config) -> Config {
    let merged = merge_live(running, new);
    for c in diff(running, new) {
        let line = format!("config changed: {} {} -> {}", c.key, c.old, c.new);
        if c.key == "log_level" {
            if log_env_set() {
                tracing::info!("{line}");
                tracing::info!("{LOG_ENV} is set and wins over log_level");
            } else if let Some(filter) = effective_log_filter(&merged) {
                announce_log_level(&line, || {
                    if let Err(e) = apply_log_filter(&filter) {
                        tracing::error!("log_level not applied: {e}");
                    }
                });
            }
        } else if c.live {
            tracing::info!("{line}");
        } else {
            tracing::warn!("{line} (needs a restart; the running value is kept)");
        }
    }
    merged
}

/// Logs `line` (the `log_level` change) around `apply_filter` (which replaces the log filter)
/// so that it shows under the more verbose of the two filters: at info before the change when
/// the old filter shows info (the new one may be quieter), else at warn before it when the old
/// filter shows warnings (so a move from `warn` to `error` is still seen), else after it, at
/// info when the new filter shows info and at warn otherwise. Never logs it twice.
pub fn announce_log_level(line: &str, apply_filter: impl FnOnce()) {
    if tracing::enabled!(tracing::Level::INFO) {
        tracing::info!("{line}");
        apply_filter();
    } else if tracing::enabled!(tracing::Level::WARN) {
        tracing::warn!("{line}");
        apply_filter();
    } else {
        apply_filter();
        if tracing::enabled!(tracing::Level::INFO) {
            tracing::info!("{line}");
        } else {
            tracing::warn!("{line}");
        }
    }
}

/// Whether a file event may have changed `file` (compared by file name within the watched
/// directory). Access events (open, read, close without writing) are not changes: the daemon's
/// own re-read causes them, and counting them would re-read the file forever.
fn concerns(event: &notify::Event, file: &Path) -> bool {
    let name = file.file_name();
    !matches!(event.kind, notify::EventKind::Access(_))
        && event.paths.iter().any(|p| p.file_name() == name)
}

/// Watches `file` (through its directory) until `stop` turns true. After each burst of events
/// and [`DEBOUNCE_MS`] of quiet, calls `reload` (re-read the file, the environment and the
/// command-line overrides, validated): an error is logged as one line and the running value is
/// kept; a valid configuration goes through [`apply`] and, when it differs, is published on
/// `running`. Errors: the watcher could not be started (the daemon then runs without it).
pub fn watch_file(
    file: PathBuf,
    reload: impl Fn() -> Result<Config, ConfigError> + Send + 'static,
    running: watch::Sender<Arc<Config>>,
    mut stop: watch::Receiver<bool>,
) -> Result<tokio::task::JoinHandle<()>, notify::Error> {
    use notify::Watcher;
    let dir = file
        .parent()
        .map(Path::to_path_buf)
        .unwrap_or_else(|| PathBuf::from("."));
    let (tx, mut rx) = mpsc::unbounded_channel::<()>();
    let target = file.clone();
    let mut watcher =
        notify::recommended_watcher(move |res: notify::Result<notify::Event>| match res {
            Ok(event) if concerns(&event, &target) => {
                tracing::debug!(kind = ?event.kind, "config file event");
                let _ = tx.send(());
            }
            Ok(_) => {}
            Err(e) => tracing::warn!(error = %e, "config watcher error"),
        })?;
    watcher.watch(&dir, notify::RecursiveMode::NonRecursive)?;
    tracing::info!(file = %file.display(), "watching the config file");
    Ok(tokio::spawn(async move {
        // Owned by the task: dropping it ends the watch.
        let _watcher = watcher;
        loop {
            tokio::select! {
                got = rx.recv() => if got.is_none() { return },
                _ = stop.wait_for(|s| *s) => return,
            }
            // Debounce: wait until the events stop for DEBOUNCE_MS.
            loop {
                tokio::select! {
                    got = rx.recv() => if got.is_none() { return },
                    _ = tokio::time::sleep(Duration::from_millis(DEBOUNCE_MS)) => break,
                    _ = stop.wait_for(|s| *s) => return,
                }
            }
            // A small local file: read in place.
            match reload() {
                Err(e) => {
                    tracing::error!("config.toml refused, the running config is kept: {e}")
                }
                Ok(new) => {
                    let current = running.borrow().clone();
                    let merged = apply(&current, &new);
                    if merged != *current {
                        running.send_replace(Arc::new(merged));
                    }
                }
            }
        }
    }))
}

/// Runs the relay loop for the running configuration until `stop` turns true: starts it when
/// the configuration has a `[relay]` table (at once, or when one is added), stops it when the
/// table is removed, and restarts it when its settings (`relay` table,
/// `relay_pull_interval_ms`, `relay_stream`) change.
///
/// `spawn(relay, (pull_interval, stream), stop)` starts one relay loop that ends when its `stop` turns
/// true; a loop is always stopped through that channel and awaited (an in-flight pass finishes
/// its commits) before another starts. `relay_on(bool)` is told whether a relay loop runs:
/// once at the start, `true` just before a loop is started after none ran, `false` once a
/// stopped loop has ended and no other follows (callers route mail by it: without a relay the
/// LAN keeps every row).
pub async fn supervise_relay(
    mut config: watch::Receiver<Arc<Config>>,
    spawn: impl Fn(RelayConfig, (Duration, bool), watch::Receiver<bool>) -> tokio::task::JoinHandle<()>,
    relay_on: impl Fn(bool),
    mut stop: watch::Receiver<bool>,
) {
    let settings = |c: &Config| {
        c.relay.clone().map(|r| {
            (
                r,
                (
                    Duration::from_millis(c.relay_pull_interval_ms),
                    c.relay_stream,
                ),
            )
        })
    };
    let mut current = settings(&config.borrow_and_update());
    relay_on(current.is_some());
    // When the watcher is gone, keep what runs until the daemon stops.
    let mut watched = true;
    loop {
        let running = current.clone().map(|(relay, loop_settings)| {
            let (loop_stop, loop_rx) = watch::channel(false);
            (loop_stop, spawn(relay, loop_settings, loop_rx))
        });
        let next = loop {
            tokio::select! {
                _ = stop.wait_for(|s| *s) => break None,
                changed = config.changed(), if watched => {
                    if changed.is_err() {
                        watched = false;
                        continue;
                    }
                    let s = settings(&config.borrow_and_update());
                    if s != current {
                        break Some(s);
                    }
                }
            }
        };
        if let Some((loop_stop, task)) = running {
            let _ = loop_stop.send(true);
            let _ = task.await;
        }
        let Some(next) = next else { return };
        match (&current, &next) {
            (None, Some((r, _))) => {
                relay_on(true);
                tracing::info!(relay = %r.url, "relay configured: relay loop started");
            }
            (Some(_), None) => {
                relay_on(false);
                tracing::info!(
                    "relay removed from the config: relay loop stopped, relay transport off"
                );
            }
            (Some(_), Some((r, _))) => {
                tracing::info!(relay = %r.url, "relay loop restarted with the new config");
            }
            (None, None) => {}
        }
        current = next;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn with_relay(url: &str) -> Config {
        Config {
            relay: Some(RelayConfig {
                url: url.into(),
                key: None,
                token_command: Some("secret-cmd --token hunter2".into()),
            }),
            ..Config::default()
        }
    }

    #[test]
    fn diff_marks_live_and_restart_keys_and_redacts_the_token_command() {
        let old = with_relay("http://127.0.0.1:1");
        let mut new = with_relay("http://127.0.0.1:2");
        new.api_port = 9000;
        new.log_level = Some("debug".into());
        new.relay_pull_interval_ms = 100;
        new.relay.as_mut().unwrap().token_command = Some("other hunter3".into());
        let changes = diff(&old, &new);
        let keys: Vec<_> = changes.iter().map(|c| (c.key, c.live)).collect();
        assert_eq!(
            keys,
            [
                ("api_port", false),
                ("log_level", true),
                ("relay_pull_interval_ms", true),
                ("relay.url", true),
                ("relay.token_command", true),
            ]
        );
        for c in &changes {
            assert!(
                !c.old.contains("hunter") && !c.new.contains("hunter"),
                "{c:?}"
            );
        }
        let merged = merge_live(&old, &new);
        assert_eq!(merged.api_port, old.api_port, "restart-only kept");
        assert_eq!(merged.relay, new.relay);
        assert_eq!(merged.log_level.as_deref(), Some("debug"));
        assert!(diff(&old, &old).is_empty());
    }

    #[test]
    fn a_hook_change_needs_a_restart_and_is_shown_by_name_only() {
        let old = Config::default();
        let mut new = Config::default();
        new.hooks.push(crate::hooks::config::HookConfig {
            name: "notify".into(),
            agent: "bob".into(),
            command: vec!["/bin/notify".into(), "--token=hunter3".into()],
            from: None,
            kind: None,
            needs_reply: None,
            wake_worthy: None,
            timeout_ms: 30_000,
            debounce_ms: 1_000,
        });
        let changes = diff(&old, &new);
        assert_eq!(changes.len(), 1, "{changes:?}");
        assert_eq!((changes[0].key, changes[0].live), ("hooks", false));
        assert_eq!(changes[0].new, "[notify]");
        let mut edited = new.clone();
        edited.hooks[0].timeout_ms = 5_000;
        let changes = diff(&new, &edited);
        assert_eq!(changes[0].new, "[notify] (edited)");
        assert!(changes.iter().all(|c| !c.new.contains("hunter")));
        assert!(
            merge_live(&old, &new).hooks.is_empty(),
            "read at start only"
        );
    }

    #[test]
    fn adding_or_removing_the_relay_applies_live() {
        let none = Config::default();
        let some = with_relay("http://127.0.0.1:1");
        let add = diff(&none, &some);
        assert_eq!(
            add,
            [Change {
                key: "relay",
                old: UNSET.into(),
                new: "http://127.0.0.1:1".into(),
                live: true,
            }]
        );
        let remove = diff(&some, &none);
        assert_eq!(remove.len(), 1);
        assert_eq!(
            (
                remove[0].key,
                remove[0].old.as_str(),
                remove[0].new.as_str()
            ),
            ("relay", "http://127.0.0.1:1", UNSET)
        );
        for c in add.iter().chain(&remove) {
            assert!(c.live);
            assert!(
                !c.old.contains("hunter") && !c.new.contains("hunter"),
                "{c:?}"
            );
        }
        assert_eq!(merge_live(&none, &some).relay, some.relay);
        assert_eq!(merge_live(&some, &none).relay, None);
    }

    #[test]
    fn only_changes_to_the_file_count() {
        use notify::event::{AccessKind, CreateKind, ModifyKind, RenameMode};
        use notify::{Event, EventKind};
        let file = Path::new("/home/x/config.toml");
        let event = |kind, path: &str| Event::new(kind).add_path(PathBuf::from(path));
        let rename = EventKind::Modify(ModifyKind::Name(RenameMode::Both));
        assert!(concerns(
            &event(rename, "/home/x/config.toml.tmp").add_path(file.into()),
            file
        ));
        assert!(concerns(
            &event(EventKind::Create(CreateKind::File), "/home/x/config.toml"),
            file
        ));
        assert!(!concerns(
            &event(EventKind::Access(AccessKind::Any), "/home/x/config.toml"),
            file
        ));
        assert!(!concerns(
            &event(EventKind::Modify(ModifyKind::Any), "/home/x/mailbox.db"),
            file
        ));
    }

    #[tokio::test]
    async fn the_relay_loop_restarts_on_a_relay_change_only() {
        let (tx, rx) = watch::channel(Arc::new(with_relay("http://127.0.0.1:1")));
        let (stop_tx, stop_rx) = watch::channel(false);
        let (seen_tx, mut seen) = mpsc::unbounded_channel::<String>();
        let sup = tokio::spawn(supervise_relay(
            rx,
            move |r, _, mut stop| {
                let _ = seen_tx.send(r.url);
                tokio::spawn(async move {
                    let _ = stop.wait_for(|s| *s).await;
                })
            },
            |_| {},
            stop_rx,
        ));
        assert_eq!(seen.recv().await.as_deref(), Some("http://127.0.0.1:1"));
        let mut other = with_relay("http://127.0.0.1:1");
        other.api_port = 1;
        tx.send_replace(Arc::new(other));
        tx.send_replace(Arc::new(with_relay("http://127.0.0.1:2")));
        assert_eq!(seen.recv().await.as_deref(), Some("http://127.0.0.1:2"));
        stop_tx.send_replace(true);
        sup.await.unwrap();
        assert!(
            seen.try_recv().is_err(),
            "no restart for a non-relay change"
        );
    }

    /// What a supervised relay loop and the `relay_on` hook report, in order.
    #[derive(Debug, PartialEq, Eq)]
    enum Seen {
        Started(String),
        Ended(String),
        On(bool),
    }

    #[tokio::test]
    async fn a_relay_added_starts_the_loop_and_a_relay_removed_stops_it() {
        let (tx, rx) = watch::channel(Arc::new(Config::default()));
        let (stop_tx, stop_rx) = watch::channel(false);
        let (seen_tx, mut seen) = mpsc::unbounded_channel::<Seen>();
        let on_tx = seen_tx.clone();
        let sup = tokio::spawn(supervise_relay(
            rx,
            move |r, _, mut stop| {
                let _ = seen_tx.send(Seen::Started(r.url.clone()));
                let seen_tx = seen_tx.clone();
                tokio::spawn(async move {
                    let _ = stop.wait_for(|s| *s).await;
                    // A pass in flight finishes its commit before the loop ends.
                    tokio::task::yield_now().await;
                    let _ = seen_tx.send(Seen::Ended(r.url));
                })
            },
            move |on| {
                let _ = on_tx.send(Seen::On(on));
            },
            stop_rx,
        ));
        assert_eq!(
            seen.recv().await,
            Some(Seen::On(false)),
            "no relay at start"
        );

        tx.send_replace(Arc::new(with_relay("http://127.0.0.1:1")));
        assert_eq!(seen.recv().await, Some(Seen::On(true)));
        assert_eq!(
            seen.recv().await,
            Some(Seen::Started("http://127.0.0.1:1".into()))
        );

        // Removed: the loop is told to stop and has ended before the relay counts as off.
        tx.send_replace(Arc::new(Config::default()));
        assert_eq!(
            seen.recv().await,
            Some(Seen::Ended("http://127.0.0.1:1".into()))
        );
        assert_eq!(seen.recv().await, Some(Seen::On(false)));

        // Added again: a new loop.
        tx.send_replace(Arc::new(with_relay("http://127.0.0.1:2")));
        assert_eq!(seen.recv().await, Some(Seen::On(true)));
        assert_eq!(
            seen.recv().await,
            Some(Seen::Started("http://127.0.0.1:2".into()))
        );

        // The daemon stops: the loop ends; the relay is not reported off (nothing routes then).
        stop_tx.send_replace(true);
        sup.await.unwrap();
        assert_eq!(
            seen.recv().await,
            Some(Seen::Ended("http://127.0.0.1:2".into()))
        );
        assert!(seen.try_recv().is_err());
    }

    /// A log buffer for a thread-local subscriber.
    #[derive(Clone, Default)]
    struct Buf(Arc<std::sync::Mutex<Vec<u8>>>);

    impl std::io::Write for Buf {
        fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(b);
            Ok(b.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    #[test]
    fn the_log_level_line_shows_whichever_way_the_level_moves() {
        use tracing_subscriber::layer::SubscriberExt;
        use tracing_subscriber::{reload, EnvFilter};
        for (old, new) in [
            ("warn", "info"),
            ("info", "warn"),
            ("debug", "info"),
            ("info", "debug"),
            ("warn", "error"),
            ("error", "warn"),
            ("error", "info"),
            ("off", "debug"),
        ] {
            let buf = Buf::default();
            let (filter, handle) = reload::Layer::new(EnvFilter::new(old));
            let writer = buf.clone();
            let subscriber = tracing_subscriber::registry().with(filter).with(
                tracing_subscriber::fmt::layer()
                    .with_ansi(false)
                    .with_writer(move || writer.clone()),
            );
            let line = format!("config changed: log_level {old} -> {new}");
            let mut applied = 0;
            tracing::subscriber::with_default(subscriber, || {
                announce_log_level(&line, || {
                    applied += 1;
                    handle.reload(EnvFilter::new(new)).unwrap();
                });
                // The new filter is in force afterwards.
                tracing::info!("after the change");
            });
            assert_eq!(applied, 1, "{old} -> {new}");
            let log = String::from_utf8(buf.0.lock().unwrap().clone()).unwrap();
            assert_eq!(log.matches(&line).count(), 1, "{old} -> {new}: {log}");
            assert_eq!(
                log.contains("after the change"),
                matches!(new, "info" | "debug"),
                "{old} -> {new}: {log}"
            );
        }
    }
}
