//! The relay server: the router and `serve(listener, state, shutdown)` over the shared state
//! ([`crate::state`]).
//!
//! `serve` takes an already-bound listener (tests bind port 0) and a shutdown future; it logs
//! the address it actually bound, writes the store heartbeat every 30 s, runs the retention
//! sweep at start and every `sweep_interval_ms` ([`crate::retention`]), and on shutdown stops
//! accepting, lets requests in flight finish (their commits included) and returns.
//!
//! Connections are accepted by the shared accept loop ([`agentmbx_net::serve`]: hyper's HTTP/1
//! server with a header-read timeout), with the `wire.md` §3.1 timeouts — headers 10 s, request
//! 30 s, keep-alive idle 5 s — and a bound on open connections.
//!
//! It also watches the store: once the store stopped taking writes (a failed COMMIT,
//! [`StoreHealth::failed`](crate::store::StoreHealth::failed)) it logs why, stops accepting, gives
//! requests in flight up to [`FAILED_STORE_GRACE`] and returns an error, so `relay serve` exits
//! non-zero and its supervisor restarts it (SQLite's recovery then decides what is durable).

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use axum::extract::{Request, State};
use axum::http::StatusCode;
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;

use agentmbx_net::serve::{accept_loop, ConnSettings};

use crate::config::RelayConfig;
use crate::error::ApiError;
use crate::handlers;
/// The state moved below the handlers ([`crate::state`]); re-exported under its old path.
pub use crate::state::{RelayState, SharedRelay};
use crate::store::RelayStore;

/// Heartbeat period (spec §5: every 30 s).
pub const HEARTBEAT_EVERY: Duration = Duration::from_secs(30);

/// How often `serve` asks the store whether it failed.
pub const STORE_WATCH_EVERY: Duration = Duration::from_millis(100);

/// How long open push streams get to close (1001) once shutdown began, before `serve` returns
/// anyway (each stream's close frame has [`crate::stream::conn::CLOSE_WRITE_LIMIT`]).
pub const STREAM_CLOSE_GRACE: Duration = Duration::from_secs(5);

/// How long requests in flight may still run once the store failed (their writes fail at once;
/// reads may finish) before `serve` returns anyway.
pub const FAILED_STORE_GRACE: Duration = Duration::from_secs(5);

/// Counts a request in [`RelayState::in_flight`] for as long as it lives.
struct Counted(SharedRelay);

impl Counted {
    fn new(state: SharedRelay) -> Self {
        state
            .in_flight
            .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        Counted(state)
    }
}

impl Drop for Counted {
    fn drop(&mut self) {
        self.0
            .in_flight
            .fetch_sub(1, std::sync::atomic::Ordering::SeqCst);
    }
}

/// The relay's routes (`wire.md` §3.1); anything else is 404 `{error:"not found"}`.
pub fn router(state: SharedRelay) -> Router {
    let timeout = Duration::from_millis(
        state
            .config
            .request_timeout_ms
            .unwrap_or(crate::config::DEFAULT_REQUEST_TIMEOUT_MS),
    );
    Router::new()
        .route("/v2/relay/info", get(handlers::info::get))
        .route("/v1/relay/challenge", post(handlers::enrol::challenge))
        .route("/v1/relay/enrol", post(handlers::enrol::enrol))
        .route(
            "/v2/relay/enc-key",
            post(handlers::enc_key::post).get(handlers::enc_key::get),
        )
        .route(
            "/v2/relay/items",
            post(handlers::items_push::post).get(handlers::items_pull::get),
        )
        .route("/v2/relay/ack", post(handlers::ack::post))
        .route(
            agentmbx_protocol::stream::STREAM_PATH,
            get(handlers::stream::get),
        )
        .route("/v2/relay/admin/revoke", post(handlers::admin::revoke))
        .route(
            "/v2/relay/admin/deny",
            get(handlers::admin::deny_list).post(handlers::admin::deny),
        )
        .route("/v2/relay/admin/undeny", post(handlers::admin::undeny))
        .route(
            "/v2/relay/admin/rotate-epoch",
            post(handlers::admin::rotate_epoch),
        )
        .route(
            "/v2/relay/admin/backup-receipt",
            post(handlers::admin::backup_receipt),
        )
        .route("/v2/relay/admin/stats", get(handlers::admin::stats))
        .route("/v2/relay/senders", post(handlers::senders::post))
        .route("/v2/relay/rotate", post(handlers::rotate::post))
        // Per-address rate limits and the body budget, for the routes above only.
        .route_layer(middleware::from_fn_with_state(state.clone(), rate_guard))
        .fallback(|| async { ApiError::not_found() })
        .method_not_allowed_fallback(|| async { ApiError::not_found() })
        .layer(middleware::from_fn({
            let state = state.clone();
            move |req: Request, next: Next| request_timeout(state.clone(), timeout, req, next)
        }))
        .with_state(state)
}

/// [`crate::ratelimit::guard`] on the relay's rate tables and clock.
async fn rate_guard(State(state): State<SharedRelay>, req: Request, next: Next) -> Response {
    crate::ratelimit::guard(&state.rates, &state.clock, req, next).await
}

/// Bounds one request (body upload included) to `limit`; past it the answer is 408
/// `{error:"request timeout", code:"TIMEOUT"}`. A store write already handed to the writer
/// still commits: the sender's retry then gets `duplicate`, never a second copy.
async fn request_timeout(
    state: SharedRelay,
    limit: Duration,
    req: Request,
    next: Next,
) -> Response {
    let _counted = Counted::new(state);
    agentmbx_net::timeout::within(limit, req, next, || {
        ApiError::new(StatusCode::REQUEST_TIMEOUT, "request timeout", "TIMEOUT").into_response()
    })
    .await
}

/// Resolves with the reason once `store` stopped taking writes for good.
pub async fn store_failure(store: Arc<dyn RelayStore>) -> String {
    let mut every = tokio::time::interval(STORE_WATCH_EVERY);
    every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        every.tick().await;
        if let Some(reason) = store.failed() {
            return reason;
        }
    }
}

/// The relay's connection settings from its configuration (`header_read_timeout_ms`,
/// `keep_alive_timeout_ms`, `max_connections`, each with its `wire.md` §3.1 default).
fn conn_settings(config: &RelayConfig) -> ConnSettings {
    use crate::config::{
        DEFAULT_HEADER_READ_TIMEOUT_MS, DEFAULT_KEEP_ALIVE_TIMEOUT_MS, DEFAULT_MAX_CONNECTIONS,
    };
    let max = config.max_connections.unwrap_or(DEFAULT_MAX_CONNECTIONS);
    ConnSettings {
        name: "relay",
        header_read: Duration::from_millis(
            config
                .header_read_timeout_ms
                .unwrap_or(DEFAULT_HEADER_READ_TIMEOUT_MS),
        ),
        keep_alive: Duration::from_millis(
            config
                .keep_alive_timeout_ms
                .unwrap_or(DEFAULT_KEEP_ALIVE_TIMEOUT_MS),
        ),
        // Validated to 1..=1,000,000; clamped anyway (a `Semaphore` panics past its maximum).
        max_connections: usize::try_from(max)
            .unwrap_or(usize::MAX)
            .clamp(1, tokio::sync::Semaphore::MAX_PERMITS),
    }
}

/// Serves until `shutdown` resolves, or until the store fails. Errors: the listener's address
/// cannot be read, or the store stopped taking writes (the error names the store's reason;
/// [`StoreHealth::failed`](crate::store::StoreHealth::failed) has it too).
///
/// Connections are HTTP/1.1 served by hyper with the `wire.md` §3.1 server timeouts: headers
/// (`header_read_timeout_ms`, 10 s), request (`request_timeout_ms`, 30 s, the router's
/// middleware) and keep-alive (`keep_alive_timeout_ms`, 5 s idle). At most `max_connections`
/// are open at once; past that, new ones wait in the listen backlog. An accept error (EMFILE…)
/// is logged and retried after [`agentmbx_net::serve::ACCEPT_BACKOFF`].
pub async fn serve(
    listener: tokio::net::TcpListener,
    state: SharedRelay,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let addr = listener.local_addr()?;
    let (failed_tx, failed_rx) = tokio::sync::watch::channel::<Option<String>>(None);
    let watcher = {
        let store = state.store.clone();
        tokio::spawn(async move {
            let reason = store_failure(store).await;
            tracing::error!(
                reason = %reason,
                "relay store failed: no more writes are possible; stopping the relay so it can \
                 be restarted (SQLite recovery decides what is durable)"
            );
            let _ = failed_tx.send(Some(reason));
            // Keep the sender: a closed channel must not read as "failed" below.
            std::future::pending::<()>().await;
        })
    };
    let failed = |mut rx: tokio::sync::watch::Receiver<Option<String>>| async move {
        if rx.wait_for(Option::is_some).await.is_err() {
            std::future::pending::<()>().await;
        }
    };
    let heartbeat = {
        let state = state.clone();
        tokio::spawn(async move {
            loop {
                let store = state.store.clone();
                let now = state.clock.now_ms();
                match tokio::task::spawn_blocking(move || store.set_heartbeat(now)).await {
                    Ok(Ok(())) => {}
                    Ok(Err(e)) => tracing::warn!(error = %e, "relay heartbeat not written"),
                    Err(_) => tracing::warn!("relay heartbeat task failed"),
                }
                tokio::time::sleep(HEARTBEAT_EVERY).await;
            }
        })
    };
    // The retention sweep: once now, then every `sweep_interval_ms` (crate::retention).
    let sweeper = tokio::spawn(crate::retention::run(state.clone()));
    tracing::info!("relay listening on {addr}");
    // Bound and the store open: READY=1 for a Type=notify unit (no-op without NOTIFY_SOCKET).
    let _ = sd_notify::notify(&[sd_notify::NotifyState::Ready]);
    // Then WATCHDOG=1 while the store's writer answers (only under a manager's watchdog).
    let watchdog = crate::watchdog::interval()
        .map(|w| tokio::spawn(crate::watchdog::run(state.store.clone(), w)));
    let streams = state.streams.clone();
    let stop = {
        let store_failed = failed(failed_rx.clone());
        let streams = streams.clone();
        async move {
            tokio::select! {
                () = shutdown => {}
                () = store_failed => {}
            }
            // Upgraded connections are no longer the accept loop's: close them here.
            let n = streams.shut_down();
            if n > 0 {
                tracing::info!(streams = n, "closing push streams (going away)");
            }
        }
    };
    let settings = conn_settings(&state.config);
    let server = accept_loop(listener, router(state), settings, stop);
    let deadline = {
        let store_failed = failed(failed_rx.clone());
        async move {
            store_failed.await;
            tokio::time::sleep(FAILED_STORE_GRACE).await;
        }
    };
    // Past the deadline the accept loop is dropped, which aborts the connections still open.
    tokio::select! {
        () = server => {}
        () = deadline => {}
    }
    if tokio::time::timeout(STREAM_CLOSE_GRACE, streams.all_ended())
        .await
        .is_err()
    {
        tracing::warn!(
            running = streams.running(),
            "push streams still open after the shutdown grace"
        );
    }
    heartbeat.abort();
    sweeper.abort();
    watcher.abort();
    if let Some(w) = watchdog {
        w.abort();
    }
    let reason = failed_rx.borrow().clone();
    if let Some(reason) = reason {
        tracing::error!(reason = %reason, "relay stopped because its store failed");
        return Err(std::io::Error::other(format!(
            "the relay store failed: {reason}"
        )));
    }
    tracing::info!("relay stopped");
    Ok(())
}
