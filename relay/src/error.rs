//! The one mapping from relay failures to HTTP answers: a status and the JSON body
//! `{error, code[, epoch, head_seq]}` (`wire.md` §3.1). Store faults are logged and answered
//! 500 without detail; nothing here ever echoes key material or bodies.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;

use agentmbx_protocol::wire::ErrorBody;

use crate::authority::{UNAVAILABLE, UNAVAILABLE_CODE, UNAVAILABLE_RETRY_S};
use crate::store::StoreError;

/// 403 `{error, code:"DENIED"}`.
pub fn denied(reason: impl Into<String>) -> ApiError {
    ApiError::new(StatusCode::FORBIDDEN, reason, "DENIED")
}

/// The text of a deny-list refusal (enrolment and hops).
pub const DENY_LISTED: &str = "this host is denied on this relay";

/// 503 `{error:"the enrolment authority is unavailable", code:"AUTHORITY_UNAVAILABLE",
/// retry_after}` with `Retry-After` ([`UNAVAILABLE`]): the authority could
/// not decide (its issuer's keys cannot be had); not a denial.
pub fn authority_unavailable() -> ApiError {
    ApiError::new(
        StatusCode::SERVICE_UNAVAILABLE,
        UNAVAILABLE,
        UNAVAILABLE_CODE,
    )
    .with_retry_after(UNAVAILABLE_RETRY_S)
}

/// A failed relay request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ApiError {
    /// HTTP status.
    pub status: StatusCode,
    /// The JSON body.
    pub body: ErrorBody,
}

impl ApiError {
    /// An error with `status`, human text and a stable code.
    pub fn new(status: StatusCode, error: impl Into<String>, code: &str) -> Self {
        ApiError {
            status,
            body: ErrorBody {
                error: error.into(),
                code: code.into(),
                epoch: None,
                head_seq: None,
                retry_after: None,
            },
        }
    }
    /// 400 `BAD_REQUEST`.
    pub fn bad_request(error: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, error, "BAD_REQUEST")
    }
    /// 401 `{error:"bad relay hop"}` (`wire.md` §3.1).
    pub fn bad_hop() -> Self {
        Self::new(StatusCode::UNAUTHORIZED, "bad relay hop", "BAD_HOP")
    }
    /// 413 `{error:"request body too large"}`.
    pub fn too_large() -> Self {
        Self::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            "request body too large",
            "TOO_LARGE",
        )
    }
    /// 404 `{error:"not found"}`.
    pub fn not_found() -> Self {
        Self::new(StatusCode::NOT_FOUND, "not found", "NOT_FOUND")
    }
    /// Adds `retry_after` (whole seconds) to the body; the answer then also carries a
    /// `Retry-After` header with the same value (e.g. 503 `AUTHORITY_UNAVAILABLE`).
    pub fn with_retry_after(mut self, secs: u64) -> Self {
        self.body.retry_after = Some(secs);
        self
    }
    /// Adds the current epoch and head seq (EPOCH, BAD_ACK).
    pub fn with_epoch(mut self, epoch: String, head_seq: i64) -> Self {
        self.body.epoch = Some(epoch);
        self.body.head_seq = Some(head_seq);
        self
    }
}

impl From<StoreError> for ApiError {
    fn from(e: StoreError) -> Self {
        tracing::error!(error = %e, "relay store failed");
        ApiError::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            "relay store unavailable",
            "STORE",
        )
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        match self.body.retry_after {
            Some(secs) => (
                self.status,
                [(axum::http::header::RETRY_AFTER, secs.to_string())],
                Json(self.body),
            )
                .into_response(),
            None => (self.status, Json(self.body)).into_response(),
        }
    }
}
