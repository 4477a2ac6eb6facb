//! `agentmbx daemon [--api-port N] [--api-bind ADDR]`: run the host daemon in the foreground.
//!
//! Start-up order: clock offset and failpoints (logged), home, config (defaults → file →
//! environment → these flags), the daemon lock, identity (created on a fresh home, as `init`
//! with the machine's host name, so `agentmbx daemon` alone works on a new machine; an
//! interrupted key rotation is completed), API token, signal handlers,
//! then bind, tell a supervisor `READY=1` (sd-notify, `agentmbx::service::notify`) and serve
//! until SIGTERM or SIGINT (`STOPPING=1`). `daemon install|uninstall|status` is
//! [`super::daemon_service`].

use std::net::IpAddr;
use std::sync::Arc;

use agentmbx::api::{self, AppState};
use agentmbx::config::Config;
use agentmbx::identity;
use agentmbx::mailbox::Mailbox;
use agentmbx::pairing::PairingMemory;
use agentmbx::paths::Paths;
use agentmbx::token::ApiToken;
use agentmbx::transport::lan::{self, LanState};
use agentmbx::transport::relay_client;
use agentmbx_protocol::clock::{SharedClock, SystemClock};
use agentmbx_protocol::{failpoint, ulid};
use anyhow::Context;
use clap::Args;

/// Flags of `daemon`; each overrides the config file and the environment.
#[derive(Debug, Args)]
#[command(args_conflicts_with_subcommands = true)]
pub struct DaemonArgs {
    /// Install, uninstall or report the user service; without one, run the daemon
    #[command(subcommand)]
    pub action: Option<super::daemon_service::DaemonAction>,
    /// Local API port (overrides api_port and MBX_API_PORT; 0 picks a free port)
    #[arg(long, value_name = "N")]
    pub api_port: Option<u16>,
    /// Local API bind address (overrides api_bind and MBX_API_BIND)
    #[arg(long, value_name = "ADDR")]
    pub api_bind: Option<IpAddr>,
}

/// Prepares the host and serves the local API until a shutdown signal.
pub fn run(args: DaemonArgs) -> anyhow::Result<()> {
    if let Some(action) = args.action {
        return super::daemon_service::run(action);
    }
    let clock = SystemClock::from_env()?;
    if clock.offset_ms() != 0 {
        tracing::warn!(
            offset_ms = clock.offset_ms(),
            "clock shifted by MBX_CLOCK_OFFSET_MS (tests and drills only)"
        );
    }
    for (name, action, nth) in failpoint::armed() {
        tracing::warn!(failpoint = %name, action = ?action, nth, "failpoint armed");
    }

    let paths = Paths::from_env()?;
    let mut config = Config::load(&paths)?;
    if let Some(port) = args.api_port {
        config.api_port = port;
    }
    if let Some(bind) = args.api_bind {
        config.api_bind = bind;
    }
    if let Some(filter) = config
        .log_level
        .as_ref()
        .and_then(|_| agentmbx::config_watch::effective_log_filter(&config))
    {
        agentmbx::config_watch::apply_log_filter(&filter).map_err(anyhow::Error::msg)?;
    }
    paths.ensure_home()?;
    // One daemon per home: the OS releases the lock when the process ends, even on SIGKILL.
    // Taken before the keys are loaded, so `host rotate` (which holds it too) never swaps them
    // under a starting daemon.
    let lock = paths
        .try_lock_daemon()
        .with_context(|| format!("cannot open {}", paths.daemon_lock().display()))?;
    // Held (not dropped) until the daemon returns.
    let Some(_lock) = lock else {
        anyhow::bail!(
            "another agentmbx daemon is already running for {}",
            paths.home().display()
        );
    };
    if !identity::is_initialized(&paths) {
        tracing::info!(home = %paths.home().display(), "no host identity yet: initializing this host");
        let created = identity::init(&paths, config.host.as_ref())?;
        config.host = Some(created.host);
    }
    let identity = identity::load(&paths, &config)?;
    let token = ApiToken::load_or_create(&paths.api_token())?;
    if !config.api_bind.is_loopback() {
        tracing::warn!(bind = %config.api_bind, "the local API is bound to a non-loopback address; it is meant for agents on this machine");
    }
    // One instance id per daemon start, sent on every relay and LAN hop (agentmbx::instance).
    let instance = Arc::new(agentmbx::instance::Instance::new());
    tracing::info!(
        host = %identity.host,
        fingerprint = %identity.host_key.public().fingerprint(),
        home = %paths.home().display(),
        version = agentmbx::VERSION,
        instance = %instance.id(),
        "starting agentmbx daemon"
    );

    let mailbox = Mailbox::open(&paths.mailbox_db()).context("cannot open mailbox.db")?;
    let clock: SharedClock = Arc::new(clock);
    let ident = Arc::new(identity);
    let wake = Arc::new(tokio::sync::Notify::new());
    let state = Arc::new(AppState {
        host: ident.host.clone(),
        token,
        version: agentmbx::VERSION,
        clock: clock.clone(),
        ident: ident.clone(),
        mailbox: mailbox.clone(),
        wake: wake.clone(),
        ids: std::sync::Mutex::new(ulid::Generator::new()),
        instance: instance.clone(),
        lan: Default::default(),
        rates: agentmbx::api::rate::ApiRates::new(&config.api_rate),
    });
    let addr = config.api_addr();
    let lan_addr = config.lan_addr();
    let relay = config.relay.clone();
    // The running config, re-read when config.toml changes (agentmbx::config_watch).
    let (config_tx, config_rx) = tokio::sync::watch::channel(Arc::new(config.clone()));
    let reload = {
        let paths = paths.clone();
        move || {
            let mut c = Config::load(&paths)?;
            c.api_port = args.api_port.unwrap_or(c.api_port);
            c.api_bind = args.api_bind.unwrap_or(c.api_bind);
            Ok(c)
        }
    };
    let addr_file = paths.api_addr_file();
    let started_at = agentmbx_protocol::time::iso_ms(clock.now_ms());
    // The daemon is I/O bound and idle most of the time: two workers are enough on any
    // machine (tokio's default is one per core), and each worker costs a stack, a malloc arena
    // and wakeups. Store work runs on blocking threads, which exit after 10 s unused.
    let workers = std::thread::available_parallelism()
        .map_or(1, |n| n.get())
        .min(2);
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(workers)
        .enable_all()
        .build()
        .context("cannot start the async runtime")?;
    runtime.block_on(async move {
        // Handlers are installed before the API announces itself, so a signal sent as soon as
        // the "listening" line appears already shuts down gracefully.
        let shutdown = shutdown_signal().context("cannot install signal handlers")?;
        let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
        let stopped = |mut rx: tokio::sync::watch::Receiver<bool>| async move {
            let _ = rx.wait_for(|s| *s).await;
        };
        let lan_listener = tokio::net::TcpListener::bind(lan_addr)
            .await
            .map_err(|e| anyhow::anyhow!(bind_error(BindWhat::Lan, lan_addr, &e)))?;
        let lan_bound = lan_listener
            .local_addr()
            .context("cannot read the LAN server address")?;
        tracing::info!("LAN server listening on {lan_bound}");
        let listener = tokio::net::TcpListener::bind(addr)
            .await
            .map_err(|e| anyhow::anyhow!(bind_error(BindWhat::Api, addr, &e)))?;
        let bound = listener
            .local_addr()
            .context("cannot read the local API address")?;
        agentmbx::fsutil::replace(
            &addr_file,
            format!("{bound}\n").as_bytes(),
            agentmbx::fsutil::PRIVATE_MODE,
        )
        .with_context(|| format!("cannot write {}", addr_file.display()))?;
        let lan_state = Arc::new(LanState {
            ident: ident.clone(),
            mailbox: mailbox.clone(),
            clock: clock.clone(),
            version: agentmbx::VERSION,
            started_at,
            port: lan_bound.port(),
            advertise: advertise_addr(&config, lan_bound),
            self_addrs: self_addrs(&config, lan_bound),
            wake: wake.clone(),
            pairing: PairingMemory::default(),
            instance: instance.clone(),
        });
        tracing::info!(advertise = %lan_state.advertise, "pairing address");
        let lan_addr_file = paths.lan_addr_file();
        agentmbx::fsutil::replace(
            &lan_addr_file,
            format!("{}\n", lan_state.advertise).as_bytes(),
            agentmbx::fsutil::PRIVATE_MODE,
        )
        .with_context(|| format!("cannot write {}", lan_addr_file.display()))?;
        let lan_task = tokio::spawn(lan::server::serve(
            lan_listener,
            lan_state.clone(),
            stopped(stop_rx.clone()),
        ));
        // Whether a relay loop runs: set by the relay supervisor below as `[relay]` comes and
        // goes in config.toml, read by the LAN delivery loop at each pass.
        let relay_configured = relay.is_some();
        // One wake source (a send, a peer back, new receipts) fans out to each sender loop.
        let lan_wake = Arc::new(tokio::sync::Notify::new());
        let relay_wake = Arc::new(tokio::sync::Notify::new());
        let fan = lan::deliver::fan_out(
            wake.clone(),
            vec![lan_wake.clone(), relay_wake.clone()],
            stop_rx.clone(),
        );
        let client = lan::client::LanClient::new(ident.clone(), clock.clone(), lan_bound.port())
            .context("cannot build the LAN client")?
            .with_instance(instance.clone());
        // The local API fetches a stale peer directory again before refusing a send for it.
        let _ = state.lan.set(client.clone());
        let delivery = lan::deliver::LanDelivery::new(client.clone(), mailbox.clone(), relay_configured);
        let relay_flag = delivery.relay_configured.clone();
        let deliver_task = tokio::spawn(lan::deliver::run(delivery, lan_wake, stop_rx.clone()));
        let rotate_task = tokio::spawn(lan::rotate_announce::run(
            paths.clone(),
            mailbox.clone(),
            client.clone(),
            stop_rx.clone(),
        ));
        let directory_task = tokio::spawn(lan::directory::run(
            mailbox.clone(),
            client,
            stopped(stop_rx.clone()),
        ));
        let mut discovery = match agentmbx::discovery::start(&config, lan_state.clone()) {
            Ok(d) => d,
            Err(e) => {
                tracing::warn!(error = %e, "mDNS unavailable; peers are found by their pinned address and presence only");
                agentmbx::discovery::Discovery::disabled()
            }
        };
        let presence_task = tokio::spawn(lan::presence::run(
            lan_state.clone(),
            discovery.ladder_source(),
            stop_rx.clone(),
        ));
        let config_task = match agentmbx::config_watch::watch_file(
            paths.config_file(),
            reload,
            config_tx,
            stop_rx.clone(),
        ) {
            Ok(task) => Some(task),
            Err(e) => {
                tracing::warn!(error = %e, "cannot watch config.toml; changes apply at the next start");
                None
            }
        };
        if relay.is_none() {
            tracing::info!("no relay configured (agentmbx relay set <url>): relay transport off until a [relay] table is added");
        }
        let notify_config = config_rx.clone();
        // Always runs: starts, stops and restarts the relay loop as config.toml changes.
        let relay_task = Some({
            let (ident, mailbox, clock, wake, home, instance) = (
                ident.clone(),
                mailbox.clone(),
                clock.clone(),
                wake.clone(),
                paths.home().to_path_buf(),
                instance.clone(),
            );
            let relay_on = {
                let wake = wake.clone();
                move |on: bool| {
                    relay_flag.store(on, std::sync::atomic::Ordering::Release);
                    // Rows held for one transport may now be the other's: look again.
                    wake.notify_one();
                }
            };
            tokio::spawn(agentmbx::config_watch::supervise_relay(
                config_rx,
                move |r, pull_interval, stop| {
                    let account = r.token_command.as_deref().map(|cmd| {
                        Arc::new(relay_client::account::AccountTokens::new(
                            cmd,
                            &home,
                            &r.url,
                            clock.clone(),
                        ))
                    });
                    tokio::spawn(relay_client::start(
                        r.url.clone(),
                        r.key,
                        ident.clone(),
                        mailbox.clone(),
                        clock.clone(),
                        pull_interval,
                        relay_wake.clone(),
                        Some(wake.clone()),
                        account,
                        Some(instance.clone()),
                        stop,
                    ))
                },
                relay_on,
                stop_rx.clone(),
            ))
        });
        // Hooks (agentmbx::hooks): read from config.toml at start.
        let hooks_task = tokio::spawn(agentmbx::hooks::run(
            agentmbx::hooks::Runner {
                mailbox: mailbox.clone(),
                hooks: Arc::new(config.hooks.clone()),
                concurrency: config.hook_concurrency,
                host: ident.host.to_string(),
                home: paths.home().to_path_buf(),
                clock: clock.clone(),
            },
            stop_rx.clone(),
        ));
        // Listeners bound and the store open: tell a supervisor (no-op without NOTIFY_SOCKET).
        let relay_url = relay.as_ref().map(|r| r.url.clone());
        use agentmbx::service::notify;
        notify::ready(&notify::status_now(&mailbox, relay_url.as_deref()));
        let notify_task = tokio::spawn(notify::supervise(
            mailbox.clone(),
            notify_config,
            stop_rx.clone(),
        ));
        let shutdown = async move {
            shutdown.await;
            notify::stopping();
        };
        let served = api::serve(listener, state, shutdown)
            .await
            .context("local API failed");
        let _ = stop_tx.send(true);
        for task in [relay_task, config_task].into_iter().flatten() {
            let _ = task.await;
        }
        for task in [
            deliver_task,
            directory_task,
            presence_task,
            rotate_task,
            fan,
            notify_task,
            hooks_task,
        ] {
            let _ = task.await;
        }
        tokio::task::spawn_blocking(move || discovery.shutdown())
            .await
            .ok();
        match lan_task.await {
            Ok(Err(e)) => tracing::warn!(error = %e, "LAN server stopped with an error"),
            Err(e) => tracing::warn!(error = %e, "LAN server task failed"),
            Ok(Ok(())) => {}
        }
        let _ = std::fs::remove_file(&addr_file);
        let _ = std::fs::remove_file(&lan_addr_file);
        served
    })?;
    tracing::info!("daemon stopped");
    Ok(())
}

/// Which listener [`bind_error`] is about.
#[derive(Debug, Clone, Copy)]
enum BindWhat {
    /// The LAN server (`lan_bind`, `lan_port`).
    Lan,
    /// The local API (`api_bind`, `api_port`, `--api-bind`, `--api-port`).
    Api,
}

/// The message of a listener that could not bind `addr`: the cause in our words
/// ([`agentmbx::net_error::describe`], e.g. `address already in use`) and the settings that
/// choose the address, so the user knows what to change.
fn bind_error(what: BindWhat, addr: std::net::SocketAddr, e: &std::io::Error) -> String {
    let (name, settings) = match what {
        BindWhat::Lan => (
            "the LAN server",
            "lan_bind and lan_port in config.toml, or MBX_LAN_BIND and MBX_LAN_PORT",
        ),
        BindWhat::Api => (
            "the local API",
            "--api-bind and --api-port, MBX_API_BIND and MBX_API_PORT, or api_bind and \
             api_port in config.toml",
        ),
    };
    format!(
        "cannot bind {name} on {addr}: {} (the address is set by {settings})",
        agentmbx::net_error::describe(e, None)
    )
}

/// The `host:port` this host gives peers at pairing: `advertise` when set; else the bound
/// address when the LAN server is bound to one IP (loopback included); else
/// `<hostname>.local:<port>` (`wire.md` §2.7 "Pairing addr").
fn advertise_addr(config: &Config, bound: std::net::SocketAddr) -> String {
    if let Some(a) = &config.advertise {
        return a.clone();
    }
    if !bound.ip().is_unspecified() {
        return bound.to_string();
    }
    let name = gethostname::gethostname().to_string_lossy().to_string();
    let name = name.split('.').next().unwrap_or_default().to_string();
    format!("{name}.local:{}", bound.port())
}

/// This host's own LAN IPs for status and presence: `self_addrs` when set; else the bound IP
/// when the LAN server is bound to one.
fn self_addrs(config: &Config, bound: std::net::SocketAddr) -> Vec<IpAddr> {
    if !config.self_addrs.is_empty() {
        return config.self_addrs.clone();
    }
    if !bound.ip().is_unspecified() {
        return vec![bound.ip()];
    }
    Vec::new()
}

/// A future that completes on SIGTERM or SIGINT (Ctrl-C elsewhere). The handlers are
/// registered when this function returns, not when the future is first polled.
fn shutdown_signal() -> std::io::Result<impl std::future::Future<Output = ()> + Send + 'static> {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{signal, SignalKind};
        let mut term = signal(SignalKind::terminate())?;
        let mut int = signal(SignalKind::interrupt())?;
        Ok(async move {
            let name = tokio::select! {
                _ = term.recv() => "SIGTERM",
                _ = int.recv() => "SIGINT",
            };
            tracing::info!("{name} received: shutting down");
        })
    }
    #[cfg(not(unix))]
    {
        Ok(async move {
            let _ = tokio::signal::ctrl_c().await;
            tracing::info!("Ctrl-C received: shutting down");
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_bind_error_is_in_our_words_and_names_the_settings() {
        let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = taken.local_addr().unwrap();
        let e = std::net::TcpListener::bind(addr).unwrap_err();
        assert_eq!(
            bind_error(BindWhat::Lan, addr, &e),
            format!(
                "cannot bind the LAN server on {addr}: address already in use (the address is \
                 set by lan_bind and lan_port in config.toml, or MBX_LAN_BIND and MBX_LAN_PORT)"
            )
        );
        let text = bind_error(BindWhat::Api, addr, &e);
        assert!(
            text.contains("--api-port") && text.contains("api_port"),
            "{text}"
        );
        assert!(!text.contains("os error"), "{text}");
    }
}
