//! `agentmbx relay serve` and `agentmbx relay keygen`: what the CLI calls.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::path::PathBuf;
use std::sync::Arc;

use agentmbx_protocol::clock::{SharedClock, SystemClock};
use agentmbx_protocol::keys::HostKey;

use crate::config::{RelayConfig, DEFAULT_PORT};
use crate::handlers::enrol::Challenges;
use crate::key::{self, KeySource};
use crate::server::{self, RelayState};
use crate::store::SqliteStore;
use crate::store::{OpenOptions, RelayStore};

/// Flags of `relay serve` (each overrides `relay.toml` and the environment).
#[derive(Debug, Clone, Default)]
pub struct ServeOptions {
    /// `--bind` (default 0.0.0.0).
    pub bind: Option<IpAddr>,
    /// `--port` (default `PORT` or 7374; 0 picks a free port).
    pub port: Option<u16>,
    /// `--store-dir` (required: the flag or `MBX_RELAY_DIR`).
    pub store_dir: PathBuf,
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
}

/// Opens the store and serves until SIGTERM or SIGINT. Logs the bound address once.
pub async fn serve(opts: ServeOptions) -> Result<(), ServeError> {
    std::fs::create_dir_all(&opts.store_dir)
        .map_err(|e| ServeError::Io(format!("cannot create {}: {e}", opts.store_dir.display())))?;
    let config = RelayConfig::load(&opts.store_dir)?;
    let clock: SharedClock = Arc::new(SystemClock::from_env()?);
    let (relay_key, source) = key::load_or_create(&opts.store_dir)?;
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
    let dir = opts.store_dir.clone();
    let pubkey = relay_key.public().to_b64();
    let open = OpenOptions {
        lock_wait_ms: config
            .lock_wait_ms
            .unwrap_or(crate::store::DEFAULT_LOCK_WAIT_MS),
        failpoint: agentmbx_protocol::failpoint::hit,
        limits: config.limits.store_limits(),
    };
    let now = clock.now_ms();
    let store =
        tokio::task::spawn_blocking(move || SqliteStore::open_with(&dir, &pubkey, now, open))
            .await
            .map_err(|e| ServeError::Io(e.to_string()))??;
    let store: Arc<dyn RelayStore> = Arc::new(store);
    tracing::info!(epoch = %store.epoch()?, store = %opts.store_dir.display(), "relay store open");
    let bind = opts
        .bind
        .or(config.bind)
        .unwrap_or(IpAddr::V4(Ipv4Addr::UNSPECIFIED));
    let port = opts.port.or(config.port).unwrap_or(DEFAULT_PORT);
    let listener = tokio::net::TcpListener::bind(SocketAddr::new(bind, port))
        .await
        .map_err(|e| ServeError::Io(format!("cannot bind {bind}:{port}: {e}")))?;
    let state = Arc::new(RelayState {
        store,
        key: relay_key,
        clock,
        config,
        challenges: Challenges::default(),
        version: crate::VERSION,
    });
    server::serve(listener, state, shutdown_signal())
        .await
        .map_err(|e| ServeError::Io(e.to_string()))
}

/// Resolves on SIGTERM or SIGINT.
pub async fn shutdown_signal() {
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    tokio::select! {
        _ = term => {}
        _ = tokio::signal::ctrl_c() => {}
    }
    tracing::info!("shutdown requested: finishing requests in flight");
}

/// `relay keygen`: a fresh relay key. Returns (the `MBX_RELAY_KEY=<seed>` line, fingerprint).
pub fn keygen() -> (String, String) {
    let key = HostKey::generate();
    (
        format!("MBX_RELAY_KEY={}", key.seed_b64_secret()),
        key.public().fingerprint(),
    )
}
