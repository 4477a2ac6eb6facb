//! The daemon's LAN server (`wire.md` §4): the router paired hosts call and
//! `serve(listener, state, shutdown)`.
//!
//! Unsigned routes come first (the pairing routes and `GET /v1/status`); every other route
//! needs a LAN signed hop ([`super::hop`]). Unknown paths are 404 `{error:"not found"}`.
//!
//! Server limits (`wire.md` §4): a request body is at most [`MAX_BODY`] bytes, checked on the
//! declared length and again while streaming; an oversized one is discarded for up to 2 s and
//! answered 413 `{error:"request body over 4194304 bytes"}`. Headers must arrive within 10 s, a
//! whole request within 30 s (else 408), and an idle kept-alive connection closes after 5 s.
//! Connections are accepted by the shared accept loop ([`agentmbx_net::serve`]: hyper HTTP/1
//! with those timeouts and graceful shutdown); the body cap, the body budget and the request
//! timeout are the shared ones too ([`agentmbx_net::body`], [`agentmbx_net::budget`],
//! [`agentmbx_net::timeout`]), each answering in the LAN server's error shape.
//!
//! This module never trusts a name or an address: the hop's pinned key is the only proof of
//! who calls.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::extract::{DefaultBodyLimit, Request};
use axum::http::StatusCode;
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{any, get, post};
use axum::Router;

use agentmbx_net::body::{read_capped, BodyError};
use agentmbx_net::budget::BodyBudget;
use agentmbx_net::serve::{accept_loop, ConnSettings};

use super::handlers::{self, HttpError};
use super::hop::{self, PeerLimiter, PEER_REQUESTS_PER_MINUTE};
use super::SharedLan;

/// Largest request body in bytes ([`super::http`], where the hop check reads it too).
pub use super::http::MAX_BODY;

/// Time allowed to send a request's headers (10 s).
pub const HEADER_READ_TIMEOUT: Duration = Duration::from_secs(10);

/// Time allowed for a whole request, body and answer included (30 s); past it 408.
pub const REQUEST_TIMEOUT: Duration = Duration::from_secs(30);

/// An idle kept-alive connection closes after this (5 s).
pub const KEEP_ALIVE_TIMEOUT: Duration = Duration::from_secs(5);

/// Most LAN connections open at once; past it new ones wait in the listen backlog.
pub const MAX_CONNECTIONS: usize = 512;

/// The LAN routes (`wire.md` §4). Layers, outermost first: the request timeout, the body cap,
/// then per signed route the hop check.
pub fn router(state: SharedLan) -> Router {
    let limiter = Arc::new(PeerLimiter::new(
        state.clock.clone(),
        PEER_REQUESTS_PER_MINUTE,
    ));
    let signed = Router::new()
        .route("/v2/envelopes", post(handlers::envelopes::post))
        .route("/v1/envelopes", post(handlers::envelopes::post))
        .route("/v1/receipts", post(handlers::receipts::post))
        .route("/v1/enc-key", get(handlers::enc_key::get))
        .route("/v1/agents", get(handlers::agents::get))
        .route("/v1/presence", post(handlers::presence::post))
        .route("/v1/unpair", post(handlers::unpair::post))
        // The cap below already bounds every body; extractors take up to the same.
        .layer(DefaultBodyLimit::max(MAX_BODY))
        .route_layer(middleware::from_fn({
            let state = state.clone();
            move |req: Request, next: Next| {
                hop::require_hop(state.clone(), limiter.clone(), req, next)
            }
        }));
    let unsigned = Router::new()
        .route("/v1/status", any(handlers::status::get))
        .merge(handlers::pairing::router());
    let budget = Arc::new(BodyBudget::new(BODY_BUDGET as u64, BODY_BUDGET as u64));
    Router::new()
        .merge(unsigned)
        .merge(signed)
        // Only routes that exist read a body (an unknown path is answered without reading it).
        .route_layer(middleware::from_fn(move |req: Request, next: Next| {
            cap_body(budget.clone(), req, next)
        }))
        // Unsigned, rate-limited before it reads its own (smaller) body cap.
        .merge(handlers::rotate::router(state.clock.clone()))
        .fallback(not_found)
        .method_not_allowed_fallback(not_found)
        .layer(middleware::from_fn(request_timeout))
        .with_state(state)
}

/// Most request-body bytes the LAN server holds at once, over all connections (64 MiB). A
/// body is read only after its share is reserved (the declared length, or the 4 MiB cap when
/// none is declared), so unauthenticated callers holding many connections open cannot make
/// the daemon buffer `MAX_CONNECTIONS × 4 MiB`; a request waits for room, within its 30 s.
pub const BODY_BUDGET: usize = 64 * 1024 * 1024;

async fn not_found() -> HttpError {
    HttpError::not_found()
}

/// Reserves the body's share of [`BODY_BUDGET`], reads the whole body under [`MAX_BODY`] (413
/// past it, after discarding the rest for up to 2 s) and hands it on buffered.
async fn cap_body(budget: Arc<BodyBudget>, req: Request, next: Next) -> Response {
    let declared = req
        .headers()
        .get(axum::http::header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<usize>().ok());
    let share = declared.unwrap_or(MAX_BODY).min(MAX_BODY + 1);
    // Held until the answer is made: the buffered body lives that long.
    let Some(_reserved) = budget.reserve(share as u64).await else {
        return HttpError::new(StatusCode::SERVICE_UNAVAILABLE, "server is shutting down")
            .into_response();
    };
    let (parts, body) = req.into_parts();
    match read_capped(body, MAX_BODY).await {
        Ok(bytes) => {
            next.run(Request::from_parts(parts, Body::from(bytes)))
                .await
        }
        Err(BodyError::TooLarge) => HttpError::too_large(MAX_BODY).into_response(),
        Err(BodyError::Broken) => {
            HttpError::bad_request("request body could not be read").into_response()
        }
    }
}

/// Bounds one request to [`REQUEST_TIMEOUT`]; past it 408 `{error:"request timeout"}`.
async fn request_timeout(req: Request, next: Next) -> Response {
    agentmbx_net::timeout::within(REQUEST_TIMEOUT, req, next, || {
        HttpError::new(StatusCode::REQUEST_TIMEOUT, "request timeout").into_response()
    })
    .await
}

/// Serves the LAN routes on `listener` until `shutdown` resolves; then stops accepting, lets
/// requests in flight finish (their commits included) and returns. Errors: the listener's
/// address cannot be read.
pub async fn serve(
    listener: tokio::net::TcpListener,
    state: SharedLan,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let addr = listener.local_addr()?;
    let settings = ConnSettings {
        name: "LAN",
        header_read: HEADER_READ_TIMEOUT,
        keep_alive: KEEP_ALIVE_TIMEOUT,
        max_connections: MAX_CONNECTIONS,
    };
    accept_loop(listener, router(state), settings, shutdown).await;
    tracing::info!("LAN server on {addr} stopped");
    Ok(())
}
