//! `GET /v1/unclaimed`: mail this host holds for names it does not have (direct mail
//! `name@<this host>` from a peer for an agent with no mailbox here), oldest first.

use axum::extract::State;
use axum::Json;
use serde::Deserialize;

use crate::mailbox::unclaimed::{self, UnclaimedPage};

use super::{ApiError, ApiQuery, SharedState};

/// Query of `GET /v1/unclaimed`.
#[derive(Debug, Deserialize, utoipa::IntoParams)]
#[serde(deny_unknown_fields)]
#[into_params(parameter_in = Query)]
pub struct UnclaimedQuery {
    /// Most entries listed, 1..=200 (default 50); `total` counts them all.
    #[param(minimum = 1, maximum = 200)]
    pub limit: Option<u32>,
}

/// Lists the held messages: each is delivered (and its `delivered` receipt sent) when an agent
/// of its name registers on this host (`agentmbx whoami --as <name>`, `POST /v1/agents`) or
/// sends from it. Reads only.
#[utoipa::path(get, path = "/v1/unclaimed", operation_id = "list_unclaimed", params(UnclaimedQuery),
    responses((status = 200, body = UnclaimedPage)),
    security(("bearer" = [])))]
pub async fn get(
    State(state): State<SharedState>,
    ApiQuery(q): ApiQuery<UnclaimedQuery>,
) -> Result<Json<UnclaimedPage>, ApiError> {
    let limit = q.limit.unwrap_or(unclaimed::DEFAULT_UNCLAIMED_LIMIT);
    if !(1..=unclaimed::MAX_UNCLAIMED_LIMIT).contains(&limit) {
        return Err(ApiError::Invalid(format!(
            "limit must be 1..={}",
            unclaimed::MAX_UNCLAIMED_LIMIT
        )));
    }
    let page = state
        .mailbox
        .run(move |c| unclaimed::list(c, limit))
        .await?;
    Ok(Json(page))
}

#[cfg(test)]
mod tests;
