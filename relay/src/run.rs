//! `agentmbx relay serve` and `agentmbx relay keygen`: what the CLI calls.
//!
//! `relay serve` comes in two halves: [`prepare`] (synchronous, before the async runtime
//! starts: configuration, relay key — `MBX_RELAY_KEY` is removed from the environment, which is
//! only safe while no other thread runs — store and listener) and [`serve_prepared`] (on the
//! runtime). At start, [`prepare`] takes `relay.lock`, restores the backup
//! `MBX_RELAY_RESTORE_FROM` names under it (once per path; [`restore_at_start`]), opens the
//! store signing every relay-log receipt with the relay key, and rotates the epoch when the
//! stored heartbeat is more than 10 min old or in the future ([`crate::ops::rotate_if_stale`],
//! spec §5).

use std::future::Future;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::path::PathBuf;
use std::sync::Arc;

use agentmbx_protocol::clock::{SharedClock, SystemClock};
use agentmbx_protocol::keys::HostKey;

use crate::config::{RelayConfig, DEFAULT_PORT};
use crate::key::{self, KeySource};
use crate::server::{self, RelayState};
use crate::store::SqliteStore;
use crate::store::{OpenOptions, RelayStore, StoreLock};

/// Flags of `relay serve` (each overrides `relay.toml` and the environment).
#[derive(Debug, Clone, Default)]
pub struct ServeOptions {
    /// `--bind` (default 0.0.0.0).
    pub bind: Option<IpAddr>,
    /// `--port` (default `PORT` or 7374; 0 picks a free port).
    pub port: Option<u16>,
    /// `--store-dir` (required: the flag or `MBX_RELAY_DIR`).
    pub store_dir: PathBuf,
    /// `--trust-proxy [xff|cloudflare]`: where the client address of the rate limits comes
    /// from (overrides `trust_proxy` and `MBX_RELAY_TRUST_PROXY`; [`crate::ratelimit`]).
    pub trust_proxy: Option<String>,
}

/// Why `relay serve` could not start.
#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    /// Configuration.
    #[error(transparent)]
    Config(#[from] crate::config::ConfigError),
    /// The relay key.
    #[error(transparent)]
    Key(#[from] key::KeyError),
    /// The store (locked, other key, newer schema…).
    #[error(transparent)]
    Store(#[from] crate::store::StoreError),
    /// The clock offset variable is malformed.
    #[error(transparent)]
    Clock(#[from] agentmbx_protocol::clock::ClockEnvError),
    /// Binding or serving failed.
    #[error("{0}")]
    Io(String),
    /// The store stopped taking writes (a failed COMMIT): the relay stopped and must be
    /// restarted, so SQLite's recovery decides what is durable.
    #[error("the relay stopped because its store failed ({0}); restart it: SQLite recovery decides what is durable")]
    StoreFailed(String),
}

/// Everything `relay serve` needs, made ready by [`prepare`] before the async runtime starts:
/// the configuration, the clock, the relay key (`MBX_RELAY_KEY` already read and removed from
/// the environment), the open store (`relay.lock` held) and the bound listener.
#[derive(Debug)]
pub struct Prepared {
    config: RelayConfig,
    clock: SharedClock,
    key: HostKey,
    store: Arc<dyn RelayStore>,
    listener: std::net::TcpListener,
    authority: Arc<dyn crate::authority::EnrolmentAuthority>,
    store_dir: PathBuf,
}

impl Prepared {
    /// The address the listener is bound to (the real port when `--port 0`).
    pub fn local_addr(&self) -> std::io::Result<SocketAddr> {
        self.listener.local_addr()
    }

    /// The relay key's fingerprint.
    pub fn relay_fingerprint(&self) -> String {
        self.key.public().fingerprint()
    }

    /// The open store.
    pub fn store(&self) -> Arc<dyn RelayStore> {
        self.store.clone()
    }
}

/// The synchronous first half of `relay serve`; **call it before the async runtime (or any
/// other thread) starts**, because it removes `MBX_RELAY_KEY` from the environment (see
/// [`key`]). Reads the configuration (`relay.toml`, validated, and the environment), the clock
/// offset and the relay key; opens the store (waiting for `relay.lock` up to `lock_wait_ms`);
/// binds the listener. Then run [`serve_prepared`] on the runtime:
///
/// ```ignore
/// let prepared = agentmbx_relay::run::prepare(opts)?;
/// runtime()?.block_on(agentmbx_relay::run::serve_prepared(prepared))?;
/// ```
pub fn prepare(opts: ServeOptions) -> Result<Prepared, ServeError> {
    prepare_with(opts, key::take_env_seed())
}

fn prepare_with(opts: ServeOptions, env_seed: Option<String>) -> Result<Prepared, ServeError> {
    crate::store::prepare_store_dir(&opts.store_dir)?;
    let mut config = RelayConfig::load(&opts.store_dir)?;
    if let Some(tp) = opts.trust_proxy {
        crate::ratelimit::TrustProxy::parse(&tp).map_err(crate::config::ConfigError::Env)?;
        config.trust_proxy = Some(tp);
    }
    tracing::info!(client_address = %crate::ratelimit::TrustProxy::of(&config), "rate limits keyed by client address");
    let clock: SharedClock = Arc::new(SystemClock::from_env()?);
    let (relay_key, source) = key::load_or_create(&opts.store_dir, env_seed.as_deref())?;
    drop(env_seed);
    match source {
        KeySource::Created => {
            tracing::info!(fingerprint = %relay_key.public().fingerprint(), "created a new relay key in relay.key")
        }
        KeySource::Env => {
            tracing::info!(fingerprint = %relay_key.public().fingerprint(), "relay key from MBX_RELAY_KEY")
        }
        KeySource::File => {
            tracing::info!(fingerprint = %relay_key.public().fingerprint(), "relay key from relay.key")
        }
    }
    let open = OpenOptions {
        lock_wait_ms: config
            .lock_wait_ms
            .unwrap_or(crate::store::DEFAULT_LOCK_WAIT_MS),
        failpoint: agentmbx_protocol::failpoint::hit,
        limits: config.limits.store_limits(),
    };
    let lock = StoreLock::acquire(&opts.store_dir, open.lock_wait_ms, clock.now_ms())?;
    restore_at_start(
        &lock,
        std::env::var_os(crate::ops::RESTORE_FROM_ENV),
        &relay_key,
        clock.now_ms(),
    );
    let store = SqliteStore::open_signed(
        lock,
        crate::ops::RelayOpSigner::shared(relay_key.clone()),
        clock.now_ms(),
        open,
    )?;
    let store: Arc<dyn RelayStore> = Arc::new(store);
    // Spec §5: a heartbeat more than 10 min old or in the future means old data came back (a
    // volume restore) or a long outage: a new epoch before anything is served.
    crate::ops::rotate_if_stale(
        store.as_ref(),
        &crate::ops::store_db(&opts.store_dir),
        clock.now_ms(),
    )?;
    tracing::info!(epoch = %store.epoch()?, store = %opts.store_dir.display(), "relay store open");
    let bind = opts
        .bind
        .or(config.bind)
        .unwrap_or(IpAddr::V4(Ipv4Addr::UNSPECIFIED));
    let port = opts.port.or(config.port).unwrap_or(DEFAULT_PORT);
    let listener = std::net::TcpListener::bind(SocketAddr::new(bind, port))
        .and_then(|l| l.set_nonblocking(true).map(|()| l))
        .map_err(|e| ServeError::Io(bind_error(SocketAddr::new(bind, port), &e)))?;
    let authority = crate::authority::from_config(&config.authority, clock.clone(), store.clone())
        .map_err(|e| ServeError::Io(format!("cannot set up the enrolment authority: {e}")))?;
    match (config.authority.kind, config.authority.issuer.as_deref()) {
        (crate::config::AuthorityKind::Account, Some(issuer)) => tracing::info!(
            authority = authority.name(),
            issuer,
            audience = config.authority.audience.as_deref().unwrap_or(""),
            "enrolment authority: account tokens"
        ),
        _ => tracing::info!(
            authority = authority.name(),
            "enrolment authority: every host that proves its key enrols"
        ),
    }
    log_admin_endpoint(&config);
    Ok(Prepared {
        config,
        clock,
        key: relay_key,
        store,
        listener,
        authority,
        store_dir: opts.store_dir,
    })
}

/// `MBX_RELAY_RESTORE_FROM=<backup>` (`wire.md` §3.4): a hosted relay cannot run `relay
/// restore` beside itself, so `relay serve` restores the backup at start, under its own
/// `lock`, before it opens the store. The path is consumed: once this store (or one it was
/// restored over) was restored from it ([`crate::ops::restored_from`]), it is ignored with one
/// log line, whatever the file there holds now. A failed restore is logged and the relay serves
/// the current store unchanged (a restore is all or nothing). Never fails.
pub fn restore_at_start(
    lock: &StoreLock,
    from: Option<std::ffi::OsString>,
    relay_key: &HostKey,
    now_ms: i64,
) {
    let Some(from) = from.filter(|v| !v.to_string_lossy().trim().is_empty()) else {
        return;
    };
    let path = crate::ops::absolute(std::path::Path::new(from.to_string_lossy().trim()));
    let env = crate::ops::RESTORE_FROM_ENV;
    if let Ok(Some(at)) = crate::ops::restored_from(lock.dir(), &path) {
        tracing::info!(
            "{env} ignored: already restored from {} at {at}; unset {env}",
            path.display()
        );
        return;
    }
    let opts = crate::ops::RestoreOptions {
        force: false,
        now_ms,
        signer: Some(crate::ops::RelayOpSigner::shared(relay_key.clone())),
    };
    match crate::ops::restore(lock.dir(), &path, &opts, Some(lock)) {
        Ok(receipt) => {
            let kept = receipt["replaced"]["rollback"]
                .as_str()
                .map_or_else(String::new, |r| format!("; replaced store kept at {r}"));
            tracing::warn!(
                "restored {} at start: epoch {} -> {}{kept}; unset {env}",
                path.display(),
                receipt["epoch"]["from"].as_str().unwrap_or(""),
                receipt["epoch"]["to"].as_str().unwrap_or("")
            );
        }
        Err(e) => tracing::error!(
            "{env}={} was not restored ({e}); serving the current store unchanged",
            path.display()
        ),
    }
}

/// Says at start whether the admin endpoints (`/v2/relay/admin/*`) are on and where their token
/// comes from; never the token.
fn log_admin_endpoint(config: &RelayConfig) {
    if config.admin_token.is_none() {
        tracing::info!(
            "admin endpoint off (no {} and no admin_token_file in relay.toml): revoke and deny \
             run offline on the store only",
            crate::config::ADMIN_TOKEN_ENV
        );
        return;
    }
    let source = if std::env::var_os(crate::config::ADMIN_TOKEN_ENV).is_some() {
        crate::config::ADMIN_TOKEN_ENV.to_owned()
    } else {
        config
            .admin_token_file
            .as_deref()
            .map_or_else(String::new, |f| format!("admin_token_file {}", f.display()))
    };
    tracing::info!(token_from = %source, "admin endpoint on at /v2/relay/admin/*");
}

/// The async second half of `relay serve`: serves a [`Prepared`] relay until SIGTERM or SIGINT
/// (then `Ok`), or until the store fails ([`ServeError::StoreFailed`]: the caller must exit
/// non-zero so the supervisor restarts the relay). Logs the bound address once.
pub async fn serve_prepared(prepared: Prepared) -> Result<(), ServeError> {
    serve_prepared_until(prepared, shutdown_signal()).await
}

/// [`serve_prepared`] with another shutdown trigger (tests, embedding).
pub async fn serve_prepared_until(
    prepared: Prepared,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), ServeError> {
    let listener = tokio::net::TcpListener::from_std(prepared.listener)
        .map_err(|e| ServeError::Io(format!("cannot use the bound listener: {e}")))?;
    let store = prepared.store.clone();
    let state = Arc::new(RelayState::new(
        prepared.store,
        prepared.key,
        prepared.clock,
        prepared.config,
        prepared.authority,
        crate::ops::store_db(&prepared.store_dir),
    ));
    let served = server::serve(listener, state, shutdown).await;
    if let Some(reason) = store.failed() {
        return Err(ServeError::StoreFailed(reason));
    }
    served.map_err(|e| ServeError::Io(e.to_string()))
}

/// Resolves on SIGTERM or SIGINT, after telling a supervisor `STOPPING=1`. The handlers are
/// installed when this is called, not when the future is first polled, so a signal that
/// arrives once the relay logged its address (and before the server polls this) still stops
/// it cleanly instead of killing it. Call it inside the runtime.
pub fn shutdown_signal() -> impl Future<Output = ()> + Send + 'static {
    use tokio::signal::unix::{signal, SignalKind};
    let term = signal(SignalKind::terminate());
    let int = signal(SignalKind::interrupt());
    async move {
        let wait = |s: std::io::Result<tokio::signal::unix::Signal>| async move {
            match s {
                Ok(mut s) => {
                    s.recv().await;
                }
                Err(_) => std::future::pending::<()>().await,
            }
        };
        tokio::select! {
            () = wait(term) => {}
            () = wait(int) => {}
        }
        // STOPPING=1 for a Type=notify unit (no-op without NOTIFY_SOCKET).
        let _ = sd_notify::notify(&[sd_notify::NotifyState::Stopping]);
        tracing::info!("shutdown requested: finishing requests in flight");
    }
}

/// `relay keygen`: a fresh relay key. Returns (the `MBX_RELAY_KEY=<seed>` line, fingerprint).
pub fn keygen() -> (String, String) {
    let key = HostKey::generate();
    (
        format!("MBX_RELAY_KEY={}", key.seed_b64_secret()),
        key.public().fingerprint(),
    )
}

/// The message of a listener that could not bind `addr`: the cause in plain words (no
/// `(os error N)`) and the settings that choose the address.
fn bind_error(addr: SocketAddr, e: &std::io::Error) -> String {
    use std::io::ErrorKind;
    let why = match e.kind() {
        ErrorKind::AddrInUse => "address already in use".to_string(),
        ErrorKind::AddrNotAvailable => "address not available on this host".to_string(),
        ErrorKind::PermissionDenied => "permission denied".to_string(),
        _ => {
            let text = e.to_string();
            match text.find(" (os error ") {
                Some(at) => text[..at].to_string(),
                None => text,
            }
        }
    };
    format!(
        "cannot bind {addr}: {why} (the address is set by --bind and --port or PORT, or bind \
         and port in relay.toml)"
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_bind_error_is_in_plain_words_and_names_the_settings() {
        let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = taken.local_addr().unwrap();
        let e = std::net::TcpListener::bind(addr).unwrap_err();
        assert_eq!(
            bind_error(addr, &e),
            format!(
                "cannot bind {addr}: address already in use (the address is set by --bind and \
                 --port or PORT, or bind and port in relay.toml)"
            )
        );
    }
}
