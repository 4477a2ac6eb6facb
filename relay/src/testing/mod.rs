//! Test aids for the relay (cargo feature `testing`; always on for the relay's own unit tests).
//!
//! # What it owns
//! - [`TestRelay`]: the real relay — [`crate::server::serve`] over [`RelayState::new`], the
//!   state `relay serve` runs on — bound on 127.0.0.1 port 0 over a fresh [`SqliteStore`] in a
//!   temporary directory, on a clock the test chooses. Daemon and relay tests start a relay in
//!   process through it instead of building [`RelayState`] by hand.
//! - [`conformance`]: the backend conformance suite, the store rules of spec §2–§7 checked
//!   through the [`RelayStore`] trait only, for any backend.
//!
//! # What it must never do
//! - Ship in a release binary: the daemon enables the feature as a dev-dependency only.
//! - Reach into a backend: a test that must break a store's files does so itself (it gets the
//!   store directory from [`TestRelay::store_dir`]).
//!
//! Every function here panics (with a message naming what failed) instead of returning errors:
//! they set up tests.

pub mod conformance;

use std::path::{Path, PathBuf};
use std::sync::{Arc, Once};

use agentmbx_protocol::clock::{ManualClock, SharedClock, SystemClock};
use agentmbx_protocol::keys::{HostKey, PublicKey};

use crate::authority::EnrolmentAuthority;
use crate::config::RelayConfig;
use crate::state::{RelayState, SharedRelay};
use crate::store::{OpenOptions, RelayStore, SqliteStore, StoreError, SweepReport};

/// Where a [`TestRelay`]'s manual clock starts unless told otherwise:
/// 2026-01-01T00:00:00.000Z (Unix ms).
pub const T0: i64 = 1_767_225_600_000;

/// The names of the entries of `dir`, sorted (what a test sees of a store directory).
pub fn file_names(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir)
        .expect("ls")
        .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
        .collect();
    v.sort();
    v
}

/// A store wrapper for [`TestRelayBuilder::wrap_store`].
type WrapStore = Box<dyn FnOnce(Arc<dyn RelayStore>) -> Arc<dyn RelayStore> + Send>;

/// How to start a [`TestRelay`]; from [`TestRelay::builder`]. Defaults: a [`ManualClock`] at
/// [`T0`], [`RelayConfig::default`], a fresh relay key, a fresh store in a temporary directory
/// (no lock wait), the enrolment authority `config.authority` names, the store as opened.
pub struct TestRelayBuilder {
    clock: SharedClock,
    manual: Option<Arc<ManualClock>>,
    config: RelayConfig,
    key: Option<HostKey>,
    store_dir: Option<PathBuf>,
    lock_wait_ms: u64,
    authority: Option<Arc<dyn EnrolmentAuthority>>,
    wrap: Option<WrapStore>,
}

impl std::fmt::Debug for TestRelayBuilder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TestRelayBuilder")
            .field("clock", &self.clock)
            .field("config", &self.config)
            .field("store_dir", &self.store_dir)
            .field("lock_wait_ms", &self.lock_wait_ms)
            .field("authority", &self.authority.as_ref().map(|a| a.name()))
            .field("wrap_store", &self.wrap.is_some())
            .finish_non_exhaustive()
    }
}

impl TestRelayBuilder {
    /// Runs the relay on `clock`, a manual clock the test moves (and may share with hosts);
    /// [`TestRelay::manual_clock`] returns it.
    pub fn clock(mut self, clock: Arc<ManualClock>) -> Self {
        self.clock = clock.clone();
        self.manual = Some(clock);
        self
    }

    /// Runs the relay on a new manual clock set to `now_ms` (Unix ms).
    pub fn now_ms(self, now_ms: i64) -> Self {
        self.clock(Arc::new(ManualClock::new(now_ms)))
    }

    /// Runs the relay on the system clock shifted by `offset_ms` (what `MBX_CLOCK_OFFSET_MS`
    /// does to `relay serve`); [`TestRelay::manual_clock`] is then `None`.
    pub fn clock_offset_ms(mut self, offset_ms: i64) -> Self {
        self.clock = Arc::new(SystemClock::with_offset(offset_ms));
        self.manual = None;
        self
    }

    /// The relay's configuration (limits, authority, timeouts…); the store's limits follow
    /// `config.limits`.
    pub fn config(mut self, config: RelayConfig) -> Self {
        self.config = config;
        self
    }

    /// Changes the configuration in place (e.g. `|c| c.limits.max_pull = 2`).
    pub fn tweak(mut self, f: impl FnOnce(&mut RelayConfig)) -> Self {
        f(&mut self.config);
        self
    }

    /// The relay key (default: a fresh one).
    pub fn key(mut self, key: HostKey) -> Self {
        self.key = Some(key);
        self
    }

    /// Opens (or creates) the store in `dir`, which the caller keeps, instead of a fresh
    /// temporary one: a relay can be stopped and started again on the same store.
    pub fn store_dir(mut self, dir: &Path) -> Self {
        self.store_dir = Some(dir.to_path_buf());
        self
    }

    /// How long opening the store waits for `relay.lock` (ms; default 0). A restart on the
    /// same store needs a few seconds: the stopped relay's last task may hold it a moment.
    pub fn lock_wait_ms(mut self, ms: u64) -> Self {
        self.lock_wait_ms = ms;
        self
    }

    /// Asks `authority` at every enrolment instead of the one `config.authority` names.
    pub fn authority(mut self, authority: Arc<dyn EnrolmentAuthority>) -> Self {
        self.authority = Some(authority);
        self
    }

    /// Serves the store as `wrap` returns it (e.g. a wrapper that injects failures).
    pub fn wrap_store(
        mut self,
        wrap: impl FnOnce(Arc<dyn RelayStore>) -> Arc<dyn RelayStore> + Send + 'static,
    ) -> Self {
        self.wrap = Some(Box::new(wrap));
        self
    }

    /// Opens the store and serves it on 127.0.0.1 (a free port).
    ///
    /// # Panics
    /// When the store cannot be opened, the authority cannot be built or the port cannot be
    /// bound.
    pub async fn start(self) -> TestRelay {
        install_tls_provider();
        let (dir, store_dir) = match self.store_dir {
            Some(d) => (None, d),
            None => {
                let tmp = tempfile::tempdir().expect("a temporary directory for the relay store");
                let path = tmp.path().join("store");
                (Some(tmp), path)
            }
        };
        let key = self.key.unwrap_or_else(HostKey::generate);
        let options = OpenOptions {
            lock_wait_ms: self.lock_wait_ms,
            limits: self.config.limits.store_limits(),
            ..OpenOptions::default()
        };
        let (path, pk, now) = (
            store_dir.clone(),
            key.public().to_b64(),
            self.clock.now_ms(),
        );
        let store = tokio::task::spawn_blocking(move || {
            SqliteStore::open_with(&path, &pk, now, options).expect("open the test relay's store")
        })
        .await
        .expect("the store open task");
        let mut store: Arc<dyn RelayStore> = Arc::new(store);
        if let Some(wrap) = self.wrap {
            store = wrap(store);
        }
        let authority = match self.authority {
            Some(a) => a,
            None => crate::authority::from_config(
                &self.config.authority,
                self.clock.clone(),
                store.clone(),
            )
            .expect("the enrolment authority of the test relay's config"),
        };
        let state = Arc::new(RelayState::new(
            store,
            key,
            self.clock,
            self.config,
            authority,
            crate::ops::store_db(&store_dir),
        ));
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind 127.0.0.1:0");
        let addr = listener.local_addr().expect("the bound address");
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        let task = tokio::spawn(crate::server::serve(listener, state.clone(), async move {
            let _ = rx.await;
        }));
        TestRelay {
            url: format!("http://{addr}"),
            addr,
            state,
            manual: self.manual,
            store_dir,
            shutdown: Some(tx),
            task: Some(task),
            _dir: dir,
        }
    }
}

/// The real relay served in this process; see the [module docs](self). Dropping it stops the
/// server (without waiting) and deletes its temporary store directory.
#[derive(Debug)]
pub struct TestRelay {
    url: String,
    addr: std::net::SocketAddr,
    state: SharedRelay,
    manual: Option<Arc<ManualClock>>,
    store_dir: PathBuf,
    shutdown: Option<tokio::sync::oneshot::Sender<()>>,
    task: Option<tokio::task::JoinHandle<std::io::Result<()>>>,
    _dir: Option<tempfile::TempDir>,
}

impl Drop for TestRelay {
    fn drop(&mut self) {
        if let Some(stop) = self.shutdown.take() {
            let _ = stop.send(());
        }
        if let Some(task) = self.task.take() {
            task.abort();
        }
    }
}

impl TestRelay {
    /// The defaults ([`TestRelayBuilder`]), to change before [`TestRelayBuilder::start`].
    pub fn builder() -> TestRelayBuilder {
        let manual = Arc::new(ManualClock::new(T0));
        TestRelayBuilder {
            clock: manual.clone(),
            manual: Some(manual),
            config: RelayConfig::default(),
            key: None,
            store_dir: None,
            lock_wait_ms: 0,
            authority: None,
            wrap: None,
        }
    }

    /// A relay with the defaults on `clock`.
    pub async fn start(clock: Arc<ManualClock>) -> TestRelay {
        TestRelay::builder().clock(clock).start().await
    }

    /// `http://127.0.0.1:<port>`.
    pub fn url(&self) -> &str {
        &self.url
    }

    /// The bound address.
    pub fn addr(&self) -> std::net::SocketAddr {
        self.addr
    }

    /// The state the server runs on (store, key, clock, config, counters).
    pub fn state(&self) -> &SharedRelay {
        &self.state
    }

    /// The store (every call blocks: from async code use [`TestRelay::with_store`]).
    pub fn store(&self) -> Arc<dyn RelayStore> {
        self.state.store.clone()
    }

    /// The relay key (it signs accept receipts and expiry notices).
    pub fn key(&self) -> &HostKey {
        &self.state.key
    }

    /// The relay's public key, the one hosts pin.
    pub fn pubkey(&self) -> PublicKey {
        self.state.key.public()
    }

    /// The relay's clock.
    pub fn clock(&self) -> SharedClock {
        self.state.clock.clone()
    }

    /// The manual clock, unless the relay runs on the system clock.
    pub fn manual_clock(&self) -> Option<&Arc<ManualClock>> {
        self.manual.as_ref()
    }

    /// The relay clock's time (Unix ms).
    pub fn now_ms(&self) -> i64 {
        self.state.clock.now_ms()
    }

    /// The store directory (`relay.db`, `relay.lock`).
    pub fn store_dir(&self) -> &Path {
        &self.store_dir
    }

    /// The absolute path of the store's `relay.db`.
    pub fn store_db(&self) -> &str {
        &self.state.store_db
    }

    /// Runs a blocking store call off the runtime.
    ///
    /// # Panics
    /// When the call panics.
    pub async fn with_store<T: Send + 'static>(
        &self,
        f: impl FnOnce(&dyn RelayStore) -> T + Send + 'static,
    ) -> T {
        let store = self.store();
        tokio::task::spawn_blocking(move || f(store.as_ref()))
            .await
            .expect("the store task")
    }

    /// The current epoch.
    ///
    /// # Panics
    /// When the store fails.
    pub async fn epoch(&self) -> String {
        self.with_store(|s| s.epoch().expect("the relay epoch"))
            .await
    }

    /// A new epoch, as `agentmbx relay rotate-epoch` or a restore makes it; returns it.
    ///
    /// # Panics
    /// When the store fails.
    pub async fn rotate_epoch(&self) -> String {
        self.with_store(|s| s.rotate_epoch().expect("rotate the epoch").to)
            .await
    }

    /// One retention sweep at the relay clock's time, as the running relay makes them
    /// ([`crate::retention::sweep_once`]).
    pub async fn sweep(&self) -> Result<SweepReport, StoreError> {
        crate::retention::sweep_once(&self.state).await
    }

    /// Stops the server gracefully (requests in flight finish) and returns what `serve`
    /// returned.
    ///
    /// # Panics
    /// When the server task panicked.
    pub async fn stop(mut self) -> std::io::Result<()> {
        if let Some(tx) = self.shutdown.take() {
            let _ = tx.send(());
        }
        match self.task.take() {
            Some(task) => task.await.expect("the relay's serve task"),
            None => Ok(()),
        }
    }

    /// Waits up to `limit` for the server to stop on its own (e.g. after its store failed),
    /// without asking it to, and returns what `serve` returned.
    ///
    /// # Panics
    /// When it does not stop in time or its task panicked.
    pub async fn stopped(mut self, limit: std::time::Duration) -> std::io::Result<()> {
        let task = self.task.take().expect("the relay's serve task");
        tokio::time::timeout(limit, task)
            .await
            .expect("the relay did not stop in time")
            .expect("the relay's serve task")
    }
}

/// Installs the ring TLS provider for this process once (reqwest needs one even for plain
/// http; the account authority's JWKS client is one). Another provider already installed is
/// kept.
pub fn install_tls_provider() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        let _ = rustls::crypto::ring::default_provider().install_default();
    });
}
