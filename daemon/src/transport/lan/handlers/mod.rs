//! Handlers of the LAN server's routes (`wire.md` §4), one file per resource, and the one
//! mapping from LAN failures to HTTP answers: a status and the JSON body `{error}`.
//!
//! Signed routes run only after [`super::hop::require_hop`] verified the caller; they take the
//! verified peer from the request's [`super::hop::HopPeer`] extension and the raw body as
//! bytes. Every change a handler makes is one SQLite transaction, committed before it answers.
//! Nothing here logs bodies or keys.

pub mod agents;
pub mod enc_key;
pub mod envelopes;
pub mod presence;
pub mod receipts;
pub mod rotate;
pub mod status;
pub mod unpair;

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::{json, Value};

use crate::mailbox::MailboxError;

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

/// The request body as JSON (read as 0.5.x's `JSON.parse` sees it), else 400 `bad JSON body`.
pub(crate) fn parse_json(body: &[u8]) -> Result<Value, HttpError> {
    agentmbx_protocol::canonical::parse(body).map_err(|_| HttpError::thrown("bad JSON body"))
}

/// The array `key` of a JSON object body with at most `max` items, else 400 `bad batch: <key>
/// must be an array of at most <max>` (0.5.x's texts).
pub(crate) fn batch(body: Value, key: &str, max: usize) -> Result<Vec<Value>, HttpError> {
    let items = match body {
        Value::Object(mut map) => map.remove(key),
        _ => None,
    };
    match items {
        Some(Value::Array(items)) if items.len() <= max => Ok(items),
        _ => Err(HttpError::bad_request(format!(
            "bad batch: {key} must be an array of at most {max}"
        ))),
    }
}
