//! The relay server: shared state, the router and `serve(listener, state, shutdown)`.
//!
//! `serve` takes an already-bound listener (tests bind port 0) and a shutdown future; it logs
//! the address it actually bound, writes the store heartbeat every 30 s, and on shutdown stops
//! accepting, lets requests in flight finish (their commits included) and returns.

use std::future::Future;
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

/// Serves until `shutdown` resolves. Errors: the listener's address cannot be read or the
/// server fails.
pub async fn serve(
    listener: tokio::net::TcpListener,
    state: SharedRelay,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let addr = listener.local_addr()?;
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
    let result = axum::serve(listener, router(state))
        .with_graceful_shutdown(shutdown)
        .await;
    heartbeat.abort();
    tracing::info!("relay stopped");
    result
}
