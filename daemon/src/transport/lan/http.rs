//! The LAN server's HTTP vocabulary (`wire.md` §4): the one mapping from LAN failures to HTTP
//! answers ([`HttpError`]: a status and the JSON body `{error}`) and the request body cap
//! ([`MAX_BODY`]).
//!
//! # What it must never do
//! Depend on the server, the hop check or the handlers: all three answer with these, so this
//! module sits below them.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::json;

use crate::mailbox::MailboxError;

/// Largest request body in bytes (4 MiB, `wire.md` §4).
pub const MAX_BODY: usize = 4 * 1024 * 1024;

/// A refused or failed LAN request: answered as `status` with `{error}`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{status}: {error}")]
pub struct HttpError {
    /// HTTP status.
    pub status: StatusCode,
    /// The `error` text of the body.
    pub error: String,
}

impl HttpError {
    /// An error with `status` and `error` text.
    pub fn new(status: StatusCode, error: impl Into<String>) -> Self {
        HttpError {
            status,
            error: error.into(),
        }
    }
    /// 400.
    pub fn bad_request(error: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, error)
    }
    /// 401 (hop refusals, `wire.md` §2.5).
    pub fn unauthorized(error: impl Into<String>) -> Self {
        Self::new(StatusCode::UNAUTHORIZED, error)
    }
    /// 404 `{error:"not found"}`.
    pub fn not_found() -> Self {
        Self::new(StatusCode::NOT_FOUND, "not found")
    }
    /// 413 `{error:"request body over <cap> bytes"}` (`wire.md` §4 server limits).
    pub fn too_large(cap: usize) -> Self {
        Self::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            format!("request body over {cap} bytes"),
        )
    }
    /// An error thrown while handling a request, statused as 0.5.x does (`wire.md` §4): 401
    /// when the text mentions `paired`, `signature` or `timestamp`, else 400.
    pub fn thrown(error: impl Into<String>) -> Self {
        let error = error.into();
        let auth = ["paired", "signature", "timestamp"]
            .iter()
            .any(|w| error.contains(w));
        let status = if auth {
            StatusCode::UNAUTHORIZED
        } else {
            StatusCode::BAD_REQUEST
        };
        Self::new(status, error)
    }
}

impl From<MailboxError> for HttpError {
    /// A storage fault: logged, answered 500 without detail (the caller retries).
    fn from(e: MailboxError) -> Self {
        tracing::error!(error = %e, "LAN request failed in the mailbox");
        HttpError::new(StatusCode::INTERNAL_SERVER_ERROR, "mailbox unavailable")
    }
}

impl IntoResponse for HttpError {
    fn into_response(self) -> Response {
        (self.status, Json(json!({ "error": self.error }))).into_response()
    }
}
