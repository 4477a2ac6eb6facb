//! `GET /v1/health`: liveness for agents, supervisors and `doctor`. No authentication; it
//! answers status, host name and version, and while something is wrong that the daemon can
//! see by itself, why (never anything about mail or keys).

use axum::extract::State;
use axum::Json;
use serde::Serialize;

use super::SharedState;
use crate::instance::Reason;

/// Body of `GET /v1/health` (always HTTP 200 while the daemon answers):
/// `{"status":"ok","host":<name>,"version":<package version>}`, or
/// `{"status":"degraded",…,"reasons":[{code, detail, peer?, relay?}]}` while the daemon knows
/// of a problem ([`crate::instance::Instance::reasons`]: `host-key-clone`, another daemon uses
/// this host key; `peer-key-clone`, a peer's key is used by two daemons). `reasons` is absent
/// when the status is `ok`, so that answer is unchanged from earlier versions.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, utoipa::ToSchema)]
pub struct Health {
    /// `"ok"`, or `"degraded"` when `reasons` lists something wrong. Either way the daemon is
    /// up and serving.
    pub status: &'static str,
    /// This host's name.
    pub host: String,
    /// The daemon's version (Cargo package version).
    pub version: &'static str,
    /// Why the status is `degraded` (absent when `ok`).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub reasons: Vec<Reason>,
}

/// Handler for `GET /v1/health` (no authentication).
#[utoipa::path(get, path = "/v1/health", operation_id = "health", responses((status = 200, body = Health)))]
#[tracing::instrument(skip_all)]
pub async fn get(State(state): State<SharedState>) -> Json<Health> {
    let reasons = state.instance.reasons();
    Json(Health {
        status: if reasons.is_empty() { "ok" } else { "degraded" },
        host: state.host.to_string(),
        version: state.version,
        reasons,
    })
}
