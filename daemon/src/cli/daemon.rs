//! `agentmbx daemon [--api-port N] [--api-bind ADDR]`: run the host daemon in the foreground.
//!
//! Start-up order: clock offset and failpoints (logged), home, config (defaults → file →
//! environment → these flags), the daemon lock, identity (created on a fresh home, as `init`
//! with the machine's host name, so `agentmbx daemon` alone works on a new machine; an
//! interrupted key rotation is completed), API token and store ([`daemon::lock_home`],
//! [`daemon::prepare`]), signal handlers, then bind the LAN server and the local API here (so
//! bind errors name the settings to change) and hand them to [`daemon::run`], which tells a
//! supervisor `READY=1` (sd-notify, `agentmbx::service::notify`) and serves until SIGTERM or
//! SIGINT (`STOPPING=1`). This module only parses, loads, binds and maps errors; it must not
//! start loops of its own. `daemon install|uninstall|status` is [`super::daemon_service`].

use std::net::IpAddr;
use std::sync::Arc;

use agentmbx::config::Config;
use agentmbx::daemon;
use agentmbx::paths::Paths;
use agentmbx_protocol::clock::{SharedClock, SystemClock};
use agentmbx_protocol::failpoint::Failpoints;
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

/// Prepares the host and serves the local API until a shutdown signal: the flags and config
/// here, the rest in [`agentmbx::daemon`] ([`daemon::prepare`], then [`daemon::run`] on the
/// sockets bound here).
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
    let failpoints = Failpoints::from_env();
    for (name, action, nth) in failpoints.armed() {
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
    // Held (not dropped) until the daemon returns and its runtime is gone.
    let _lock = daemon::lock_home(&paths).map_err(prepare_error)?;
    let reload: daemon::Reload = {
        let paths = paths.clone();
        Box::new(move || {
            let mut c = Config::load(&paths)?;
            c.api_port = args.api_port.unwrap_or(c.api_port);
            c.api_bind = args.api_bind.unwrap_or(c.api_bind);
            Ok(c)
        })
    };
    let prepared = daemon::prepare(paths, config, reload, &_lock).map_err(prepare_error)?;
    let addr = prepared.config().api_addr();
    let lan_addr = prepared.config().lan_addr();
    let clock: SharedClock = Arc::new(clock);
    // The daemon is I/O bound and idle most of the time: two workers are enough on any
    // machine (tokio's default is one per core), and each worker costs a stack, a malloc arena
    // and wakeups. Store work runs on blocking threads, kept 60 s unused: with tokio's 10 s the
    // idle loops' 10 s checks started and ended a thread each time.
    let workers = std::thread::available_parallelism()
        .map_or(1, |n| n.get())
        .min(2);
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(workers)
        .thread_keep_alive(std::time::Duration::from_secs(60))
        .enable_all()
        .build()
        .context("cannot start the async runtime")?;
    runtime.block_on(async move {
        // Handlers are installed before the API announces itself, so a signal sent as soon as
        // the "listening" line appears already shuts down gracefully.
        let shutdown = shutdown_signal().context("cannot install signal handlers")?;
        let lan = tokio::net::TcpListener::bind(lan_addr)
            .await
            .map_err(|e| anyhow::anyhow!(bind_error(BindWhat::Lan, lan_addr, &e)))?;
        let lan_bound = lan
            .local_addr()
            .context("cannot read the LAN server address")?;
        tracing::info!("LAN server listening on {lan_bound}");
        let api = tokio::net::TcpListener::bind(addr)
            .await
            .map_err(|e| anyhow::anyhow!(bind_error(BindWhat::Api, addr, &e)))?;
        daemon::run(
            prepared,
            daemon::Listeners { lan, api },
            clock,
            failpoints,
            shutdown,
        )
        .await?;
        anyhow::Ok(())
    })?;
    tracing::info!("daemon stopped");
    Ok(())
}

/// A failed start as the CLI reports it: the library's own error for those [`daemon`] passes
/// through, so the exit code ([`super::exit_code`]) finds it in the chain (an uninitialized
/// host, a bad host name…) and the line reads as before.
fn prepare_error(e: daemon::PrepareError) -> anyhow::Error {
    use daemon::PrepareError;
    match e {
        PrepareError::Home(e) => e.into(),
        PrepareError::Identity(e) => e.into(),
        PrepareError::Token(e) => e.into(),
        other => other.into(),
    }
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
