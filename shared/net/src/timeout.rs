//! The whole-request timeout (`wire.md` §3.1 and §4: 30 s, body upload included), as one
//! middleware step every server wraps with its own answer.
//!
//! # What it owns
//! Bounding the rest of the middleware stack and the handler to a time limit. A write the
//! handler already handed on (a store commit) still finishes: only the answer is replaced.
//!
//! # What it must never do
//! Choose the answer's shape or code (each server passes its own), or log the request.

use std::time::Duration;

use axum::extract::Request;
use axum::middleware::Next;
use axum::response::Response;

/// Runs `next` for `req` within `limit`; past it the answer is `timed_out()` (the relay's 408
/// `{error:"request timeout", code:"TIMEOUT"}`, the LAN server's 408 `{error:"request
/// timeout"}`).
pub async fn within(
    limit: Duration,
    req: Request,
    next: Next,
    timed_out: impl FnOnce() -> Response,
) -> Response {
    match tokio::time::timeout(limit, next.run(req)).await {
        Ok(response) => response,
        Err(_) => timed_out(),
    }
}
