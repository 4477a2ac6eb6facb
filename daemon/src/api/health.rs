//! `GET /v1/health`: liveness for agents, supervisors and `doctor`. No authentication; it
//! answers status, host name and version only, never anything about mail or keys.

use axum::extract::State;
use axum::Json;
use serde::Serialize;

use super::SharedState;

/// Body of `GET /v1/health`: `{"status":"ok","host":<name>,"version":<package version>}`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, utoipa::ToSchema)]
pub struct Health {
    /// Always `"ok"` while the daemon answers.
    pub status: &'static str,
    /// This host's name.
    pub host: String,
    /// The daemon's version (Cargo package version).
    pub version: &'static str,
}

/// Handler for `GET /v1/health` (no authentication).
#[utoipa::path(get, path = "/v1/health", operation_id = "health", responses((status = 200, body = Health)))]
#[tracing::instrument(skip_all)]
pub async fn get(State(state): State<SharedState>) -> Json<Health> {
    Json(Health {
        status: "ok",
        host: state.host.to_string(),
        version: state.version,
    })
}
