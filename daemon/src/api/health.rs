//! `GET /v1/health`: liveness for agents, supervisors and `doctor`. No authentication needed;
//! it answers status, host name and version, and while something is wrong that the daemon can
//! see by itself, the codes of why (never anything about mail or keys). Only a caller that
//! presents the API token (optional `Authorization: Bearer <token>`) also gets each reason's
//! detail, peer host name and relay URL: any local process may ask for health, and those name
//! this host's peers and relay.

use axum::extract::State;
use axum::http::{header, HeaderMap};
use axum::Json;
use serde::Serialize;

use super::SharedState;
use crate::instance::Reason;

/// Body of `GET /v1/health` (always HTTP 200 while the daemon answers):
/// `{"status":"ok","host":<name>,"version":<package version>}`, or
/// `{"status":"degraded",…,"reasons":[{code, detail?, peer?, relay?}]}` while the daemon knows
/// of a problem ([`crate::instance::Instance::reasons`]: `host-key-clone`, another daemon uses
/// this host key; `peer-key-clone`, a peer's key is used by two daemons). Without a valid
/// bearer token each reason is `{code}` alone. `reasons` is absent when the status is `ok`, so
/// that answer is unchanged from earlier versions.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, utoipa::ToSchema)]
pub struct Health {
    /// `"ok"`, or `"degraded"` when `reasons` lists something wrong. Either way the daemon is
    /// up and serving.
    #[schema(value_type = crate::vocab::HealthStatus)]
    pub status: &'static str,
    /// This host's name.
    pub host: String,
    /// The daemon's version (Cargo package version).
    pub version: &'static str,
    /// Why the status is `degraded` (absent when `ok`).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub reasons: Vec<HealthReason>,
}

/// One reason of a `degraded` health: its code for every caller; the rest only for a caller
/// with the API token.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, utoipa::ToSchema)]
pub struct HealthReason {
    /// `host-key-clone` or `peer-key-clone` ([`crate::instance`]).
    #[schema(value_type = crate::vocab::HealthReasonCode)]
    pub code: &'static str,
    /// What is wrong and what to do, one line (with the token only).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub detail: Option<String>,
    /// The peer's host name (`peer-key-clone`, with the token only).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub peer: Option<String>,
    /// The relay URL that reported it (`host-key-clone`, with the token only).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub relay: Option<String>,
}

impl HealthReason {
    /// The whole reason (`full`), or its code alone.
    fn of(r: Reason, full: bool) -> Self {
        if full {
            HealthReason {
                code: r.code,
                detail: Some(r.detail),
                peer: r.peer,
                relay: r.relay,
            }
        } else {
            HealthReason {
                code: r.code,
                detail: None,
                peer: None,
                relay: None,
            }
        }
    }
}

/// Handler for `GET /v1/health` (no token needed; with it, the reasons in full).
#[utoipa::path(get, path = "/v1/health", operation_id = "health",
    description = "Liveness. Needs no token; with `Authorization: Bearer <token>` (the API token) a `degraded` answer's reasons also carry detail, peer and relay, else only their code.",
    responses((status = 200, body = Health)))]
#[tracing::instrument(skip_all)]
pub async fn get(
    State(state): State<SharedState>,
    headers: HeaderMap,
    _: super::ApiQuery<super::NoQuery>,
) -> Result<Json<Health>, super::ApiError> {
    // A missing, malformed or wrong token is not refused: it gets the short answer.
    let full = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| super::bearer_credentials(v.as_bytes()))
        .is_some_and(|t| state.token.matches(t));
    let reasons: Vec<HealthReason> = state
        .instance
        .reasons()
        .into_iter()
        .map(|r| HealthReason::of(r, full))
        .collect();
    Ok(Json(Health {
        status: if reasons.is_empty() { "ok" } else { "degraded" },
        host: state.host.to_string(),
        version: state.version,
        reasons,
    }))
}

#[cfg(test)]
mod tests;
