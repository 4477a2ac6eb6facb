//! The relay server: shared state, the router and `serve(listener, state, shutdown)`.
//!
//! `serve` takes an already-bound listener (tests bind port 0) and a shutdown future; it logs
//! the address it actually bound, writes the store heartbeat every 30 s, and on shutdown stops
//! accepting, lets requests in flight finish (their commits included) and returns.
//!
//! It also watches the store: once the store stopped taking writes (a failed COMMIT,
//! [`RelayStore::failed`]) it logs why, stops accepting, gives requests in flight up to
//! [`FAILED_STORE_GRACE`] and returns an error, so `relay serve` exits non-zero and its
//! supervisor restarts it (SQLite's recovery then decides what is durable).

use std::future::{Future, IntoFuture};
use std::sync::Arc;
use std::time::Duration;

use axum::extract::Request;
use axum::http::StatusCode;
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;

use agentmbx_protocol::clock::SharedClock;
use agentmbx_protocol::keys::HostKey;

use crate::config::RelayConfig;
use crate::error::ApiError;
use crate::handlers::{self, enrol::Challenges};
use crate::store::RelayStore;

/// Heartbeat period (spec §5: every 30 s).
pub const HEARTBEAT_EVERY: Duration = Duration::from_secs(30);

/// How often `serve` asks the store whether it failed.
pub const STORE_WATCH_EVERY: Duration = Duration::from_millis(100);

/// How long requests in flight may still run once the store failed (their writes fail at once;
/// reads may finish) before `serve` returns anyway.
pub const FAILED_STORE_GRACE: Duration = Duration::from_secs(5);

/// Everything a handler can reach.
#[derive(Debug)]
pub struct RelayState {
    /// The store (every call blocks: use `auth::blocking`).
    pub store: Arc<dyn RelayStore>,
    /// The relay key (signs accept statements).
    pub key: HostKey,
    /// The one clock.
    pub clock: SharedClock,
    /// Limits and settings.
    pub config: RelayConfig,
    /// Outstanding enrolment challenges (memory only, bounded).
    pub challenges: Challenges,
    /// Software version reported by info.
    pub version: &'static str,
}

/// Shared handle to [`RelayState`].
pub type SharedRelay = Arc<RelayState>;

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
        .fallback(|| async { ApiError::not_found() })
        .method_not_allowed_fallback(|| async { ApiError::not_found() })
        .layer(middleware::from_fn(move |req: Request, next: Next| {
            request_timeout(timeout, req, next)
        }))
        .with_state(state)
}

/// Bounds one request (body upload included) to `limit`; past it the answer is 408
/// `{error:"request timeout", code:"TIMEOUT"}`. A store write already handed to the writer
/// still commits: the sender's retry then gets `duplicate`, never a second copy.
async fn request_timeout(limit: Duration, req: Request, next: Next) -> Response {
    match tokio::time::timeout(limit, next.run(req)).await {
        Ok(response) => response,
        Err(_) => {
            ApiError::new(StatusCode::REQUEST_TIMEOUT, "request timeout", "TIMEOUT").into_response()
        }
    }
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

/// Serves until `shutdown` resolves, or until the store fails. Errors: the listener's address
/// cannot be read, the server fails, or the store stopped taking writes (the error names the
/// store's reason; [`RelayStore::failed`] has it too).
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
    tracing::info!("relay listening on {addr}");
    let stop = {
        let store_failed = failed(failed_rx.clone());
        async move {
            tokio::select! {
                () = shutdown => {}
                () = store_failed => {}
            }
        }
    };
    let server = axum::serve(listener, router(state))
        .with_graceful_shutdown(stop)
        .into_future();
    let deadline = {
        let store_failed = failed(failed_rx.clone());
        async move {
            store_failed.await;
            tokio::time::sleep(FAILED_STORE_GRACE).await;
        }
    };
    let result = tokio::select! {
        result = server => result,
        () = deadline => Ok(()),
    };
    heartbeat.abort();
    watcher.abort();
    let reason = failed_rx.borrow().clone();
    if let Some(reason) = reason {
        tracing::error!(reason = %reason, "relay stopped because its store failed");
        return Err(std::io::Error::other(format!(
            "the relay store failed: {reason}"
        )));
    }
    tracing::info!("relay stopped");
    result
}
