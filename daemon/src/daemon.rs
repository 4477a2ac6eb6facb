//! The host daemon as a library call: [`prepare`] makes a home ready (lock, identity, API token,
//! store), then [`run`] starts every background loop on already-bound sockets and stops them
//! in a fixed order when its `shutdown` future completes. `agentmbx daemon` (`src/cli/daemon.rs`)
//! only parses flags, loads the config, calls [`prepare`], binds, and calls [`run`]; a test can
//! call both for several daemons in one process, each with its own clock and failpoints.
//!
//! What runs ([`run`]), in start order: the LAN server, the wake fan-out, LAN delivery, key
//! rotation announcements, the peer directory, mDNS discovery, presence, the config.toml
//! watcher, the relay supervisor (which starts and stops the relay client as `[relay]` comes
//! and goes), hooks, the service status/watchdog task and, last, the local API in the
//! foreground. On shutdown the API stops first, then the relay supervisor and config watcher,
//! then the other loops, then discovery, then the LAN server.
//!
//! This module must never read the process environment for the clock, failpoints or paths (they
//! are passed in), bind a socket (binding stays in the CLI so its errors keep their wording),
//! parse a command line, install a logger, or exit the process. (The constructors of the relay
//! client and of LAN delivery default to the process's set, `Failpoints::from_env`, for callers
//! outside a daemon; [`run`] gives them the set passed in. The `rotate:*` points, which
//! [`prepare`] can reach while it completes an interrupted key rotation, follow the process's
//! set.) Process-wide state it still uses: the loop liveness registry ([`crate::service::liveness::global`]) and sd-notify
//! ([`crate::service::notify`]), both one per process as the service manager sees one process,
//! and the log filter hook the config watcher reloads ([`crate::config_watch`]), one per
//! process as the logger is.

use std::future::Future;
use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;
use std::sync::Arc;

use agentmbx_protocol::clock::SharedClock;
use agentmbx_protocol::failpoint::Failpoints;
use agentmbx_protocol::ulid;

use crate::api::{self, AppState};
use crate::config::{Config, ConfigError};
use crate::identity::{self, Identity, IdentityError};
use crate::instance::Instance;
use crate::mailbox::{Mailbox, MailboxError};
use crate::pairing::PairingMemory;
use crate::paths::{Paths, PathsError};
use crate::token::{ApiToken, TokenError};
use crate::transport::lan::{self, LanState};
use crate::transport::relay_client;

/// How the config watcher reads config.toml again when it changes: the same layering the daemon
/// started with (defaults → file → environment → command-line flags).
pub type Reload = Box<dyn Fn() -> Result<Config, ConfigError> + Send + 'static>;

/// Why [`prepare`] could not make the home ready. The messages are those `agentmbx daemon`
/// prints.
#[derive(Debug, thiserror::Error)]
pub enum PrepareError {
    /// The home directory could not be created or has the wrong mode.
    #[error(transparent)]
    Home(#[from] PathsError),
    /// The daemon lock file could not be opened.
    #[error("cannot open {}", path.display())]
    Lock {
        /// `daemon.lock` in the home.
        path: PathBuf,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// Another daemon holds the lock of this home.
    #[error("another agentmbx daemon is already running for {}", home.display())]
    AlreadyRunning {
        /// The home directory.
        home: PathBuf,
    },
    /// The host identity could not be created or loaded.
    #[error(transparent)]
    Identity(#[from] IdentityError),
    /// The API token could not be read or created.
    #[error(transparent)]
    Token(#[from] TokenError),
    /// The host store could not be opened.
    #[error("cannot open mailbox.db")]
    Mailbox(#[source] MailboxError),
}

/// Why [`run`] stopped with an error. The messages are those `agentmbx daemon` prints.
#[derive(Debug, thiserror::Error)]
pub enum RunError {
    /// A bound listener's address could not be read.
    #[error("cannot read the {what} address")]
    LocalAddr {
        /// `LAN server` or `local API`.
        what: &'static str,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// `api.addr` or `lan.addr` could not be written.
    #[error("cannot write {}", path.display())]
    AddrFile {
        /// The file.
        path: PathBuf,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// The LAN client (calls to peers) could not be built.
    #[error("cannot build the LAN client")]
    LanClient(#[source] lan::client::LanError),
    /// The local API server failed.
    #[error("local API failed")]
    Api(#[source] std::io::Error),
}

/// The daemon lock of one home ([`lock_home`]): while it is held, no other daemon (and no
/// `host rotate`) runs for that home. The OS releases it when the process ends, even on
/// SIGKILL. Keep it until [`run`] returned and the runtime it ran on is dropped, so no store
/// work of this daemon outlives it.
#[derive(Debug)]
pub struct DaemonLock {
    _file: std::fs::File,
}

/// A home made ready by [`prepare`]: the identity loaded, the API token and the store open.
pub struct Prepared {
    paths: Paths,
    config: Config,
    reload: Reload,
    ident: Arc<Identity>,
    token: ApiToken,
    instance: Arc<Instance>,
    mailbox: Mailbox,
}

impl std::fmt::Debug for Prepared {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Prepared")
            .field("home", &self.paths.home())
            .field("host", &self.ident.host)
            .field("instance", &self.instance.id())
            .finish_non_exhaustive()
    }
}

impl Prepared {
    /// The running configuration (with the host name an initialization chose).
    pub fn config(&self) -> &Config {
        &self.config
    }

    /// The home.
    pub fn paths(&self) -> &Paths {
        &self.paths
    }

    /// The host store.
    pub fn mailbox(&self) -> &Mailbox {
        &self.mailbox
    }

    /// This host's identity.
    pub fn identity(&self) -> &Arc<Identity> {
        &self.ident
    }
}

/// The already-bound sockets [`run`] serves. Bind them as `agentmbx daemon` does:
/// [`Config::lan_addr`] and [`Config::api_addr`] (port 0 picks a free port).
#[derive(Debug)]
pub struct Listeners {
    /// The LAN server's socket (peers).
    pub lan: tokio::net::TcpListener,
    /// The local API's socket (agents on this machine).
    pub api: tokio::net::TcpListener,
}

/// Creates `paths`' home and takes its daemon lock: one daemon per home. Taken before the keys
/// are loaded ([`prepare`] asks for it), so `host rotate`, which holds it too, never swaps them
/// under a starting daemon. Errors: [`PrepareError::Home`], [`PrepareError::Lock`],
/// [`PrepareError::AlreadyRunning`].
pub fn lock_home(paths: &Paths) -> Result<DaemonLock, PrepareError> {
    paths.ensure_home()?;
    let lock = paths
        .try_lock_daemon()
        .map_err(|source| PrepareError::Lock {
            path: paths.daemon_lock(),
            source,
        })?;
    match lock {
        Some(file) => Ok(DaemonLock { _file: file }),
        None => Err(PrepareError::AlreadyRunning {
            home: paths.home().to_path_buf(),
        }),
    }
}

/// Makes `paths`' home, locked by `_lock` ([`lock_home`]), ready for [`run`]: creates the
/// identity on a fresh home (as `init` with the machine's host name; an interrupted key
/// rotation is completed when it is loaded), loads or creates the API token, and opens
/// `mailbox.db`. Logs `starting agentmbx daemon` with a new instance id. `reload` is what the
/// config watcher calls when config.toml changes. Synchronous (file I/O and key store calls).
/// Errors: [`PrepareError::Identity`], [`PrepareError::Token`], [`PrepareError::Mailbox`].
pub fn prepare(
    paths: Paths,
    mut config: Config,
    reload: Reload,
    _lock: &DaemonLock,
) -> Result<Prepared, PrepareError> {
    if !identity::is_initialized(&paths) {
        tracing::info!(home = %paths.home().display(), "no host identity yet: initializing this host");
        let created = identity::init(&paths, config.host.as_ref())?;
        config.host = Some(created.host);
    }
    let ident = identity::load(&paths, &config)?;
    let token = ApiToken::load_or_create(&paths.api_token())?;
    if !config.api_bind.is_loopback() {
        tracing::warn!(bind = %config.api_bind, "the local API is bound to a non-loopback address; it is meant for agents on this machine");
    }
    // One instance id per daemon start, sent on every relay and LAN hop (crate::instance).
    let instance = Arc::new(Instance::new());
    tracing::info!(
        host = %ident.host,
        fingerprint = %ident.host_key.public().fingerprint(),
        home = %paths.home().display(),
        version = crate::VERSION,
        instance = %instance.id(),
        "starting agentmbx daemon"
    );
    let mailbox = Mailbox::open(&paths.mailbox_db()).map_err(PrepareError::Mailbox)?;
    Ok(Prepared {
        paths,
        config,
        reload,
        ident: Arc::new(ident),
        token,
        instance,
        mailbox,
    })
}

/// Runs the daemon of `prepared` on `listeners` until `shutdown` completes, then stops every
/// loop and returns. `clock` is the one clock of every loop; `failpoints` are the points armed
/// for this daemon (the relay client's `push:*`, `receive:*`, `ack:*` and LAN delivery's
/// `lan:deliver-pass`). Must run inside a tokio runtime with I/O and time enabled (`agentmbx
/// daemon` gives it two worker threads; in-process tests share one between daemons).
///
/// Writes `api.addr` and `lan.addr` in the home and removes them on the way out; tells a
/// service manager `READY=1` once everything runs and `STOPPING=1` when `shutdown` completes
/// (both no-ops without `NOTIFY_SOCKET`). Errors: [`RunError`] (a failure before the API
/// serves, or the API server's own); the loops log their failures and never end the daemon.
pub async fn run(
    prepared: Prepared,
    listeners: Listeners,
    clock: SharedClock,
    failpoints: Failpoints,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), RunError> {
    let Prepared {
        paths,
        config,
        reload,
        ident,
        token,
        instance,
        mailbox,
    } = prepared;
    let wake = Arc::new(tokio::sync::Notify::new());
    let state = Arc::new(AppState {
        host: ident.host.clone(),
        token,
        version: crate::VERSION,
        clock: clock.clone(),
        ident: ident.clone(),
        mailbox: mailbox.clone(),
        wake: wake.clone(),
        ids: std::sync::Mutex::new(ulid::Generator::new()),
        instance: instance.clone(),
        lan: Default::default(),
        rates: crate::api::rate::ApiRates::new(&config.api_rate),
    });
    let relay = config.relay.clone();
    // The running config, re-read when config.toml changes (crate::config_watch).
    let (config_tx, config_rx) = tokio::sync::watch::channel(Arc::new(config.clone()));
    let addr_file = paths.api_addr_file();
    let started_at = agentmbx_protocol::time::iso_ms(clock.now_ms());
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let stopped = |mut rx: tokio::sync::watch::Receiver<bool>| async move {
        let _ = rx.wait_for(|s| *s).await;
    };
    let Listeners {
        lan: lan_listener,
        api: listener,
    } = listeners;
    let lan_bound = lan_listener
        .local_addr()
        .map_err(|source| RunError::LocalAddr {
            what: "LAN server",
            source,
        })?;
    let bound = listener
        .local_addr()
        .map_err(|source| RunError::LocalAddr {
            what: "local API",
            source,
        })?;
    crate::fsutil::replace(
        &addr_file,
        format!("{bound}\n").as_bytes(),
        crate::fsutil::PRIVATE_MODE,
    )
    .map_err(|source| RunError::AddrFile {
        path: addr_file.clone(),
        source,
    })?;
    let lan_state = Arc::new(LanState {
        ident: ident.clone(),
        mailbox: mailbox.clone(),
        clock: clock.clone(),
        version: crate::VERSION,
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
    crate::fsutil::replace(
        &lan_addr_file,
        format!("{}\n", lan_state.advertise).as_bytes(),
        crate::fsutil::PRIVATE_MODE,
    )
    .map_err(|source| RunError::AddrFile {
        path: lan_addr_file.clone(),
        source,
    })?;
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
        .map_err(RunError::LanClient)?
        .with_instance(instance.clone());
    // The local API fetches a stale peer directory again before refusing a send for it.
    let _ = state.lan.set(client.clone());
    let mut delivery =
        lan::deliver::LanDelivery::new(client.clone(), mailbox.clone(), relay_configured);
    delivery.failpoints = failpoints.clone();
    delivery.relay_wake = Some(relay_wake.clone());
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
    let mut discovery = match crate::discovery::start(&config, lan_state.clone()) {
        Ok(d) => d,
        Err(e) => {
            tracing::warn!(error = %e, "mDNS unavailable; peers are found by their pinned address and presence only");
            crate::discovery::Discovery::disabled()
        }
    };
    let presence_task = tokio::spawn(lan::presence::run(
        lan_state.clone(),
        discovery.ladder_source(),
        stop_rx.clone(),
    ));
    let config_task = match crate::config_watch::watch_file(
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
        let (ident, mailbox, clock, wake, home, instance, failpoints) = (
            ident.clone(),
            mailbox.clone(),
            clock.clone(),
            wake.clone(),
            paths.home().to_path_buf(),
            instance.clone(),
            failpoints.clone(),
        );
        let relay_on = {
            let wake = wake.clone();
            move |on: bool| {
                relay_flag.store(on, std::sync::atomic::Ordering::Release);
                // Rows held for one transport may now be the other's: look again.
                wake.notify_one();
            }
        };
        tokio::spawn(crate::config_watch::supervise_relay(
            config_rx,
            move |r, (pull_interval, stream), stop| {
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
                    failpoints.clone(),
                    stream,
                    stop,
                ))
            },
            relay_on,
            stop_rx.clone(),
        ))
    });
    // Hooks (crate::hooks): read from config.toml at start.
    let hooks_task = tokio::spawn(crate::hooks::run(
        crate::hooks::Runner {
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
    use crate::service::notify;
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
        .map_err(RunError::Api);
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
}

/// The `host:port` this host gives peers at pairing: `advertise` when set; else the bound
/// address when the LAN server is bound to one IP (loopback included); else
/// `<hostname>.local:<port>` (`wire.md` §2.7 "Pairing addr").
fn advertise_addr(config: &Config, bound: SocketAddr) -> String {
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
fn self_addrs(config: &Config, bound: SocketAddr) -> Vec<IpAddr> {
    if !config.self_addrs.is_empty() {
        return config.self_addrs.clone();
    }
    if !bound.ip().is_unspecified() {
        return vec![bound.ip()];
    }
    Vec::new()
}
