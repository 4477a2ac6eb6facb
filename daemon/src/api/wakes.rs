//! `POST /v1/wakes/claim`, `/v1/wakes/mute`, `/v1/wakes/unmute`: the wake brake
//! ([`crate::mailbox::brake`]) behind the local API, so the decision "wake now / batched /
//! capped / muted" is made once, in one transaction of the daemon, however many MCP servers run
//! for one agent (`agentmbx mcp` claims before it sends a Claude Code channel notification;
//! `agentmbx wake mute|unmute` sets the owner's mute).

use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::Json;
use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::mailbox::brake::{self, Decision};

use super::{idempotent, ApiError, ApiJson, ApiQuery, NoQuery, SharedState};

/// Most message ids one claim takes.
pub const MAX_CLAIM_IDS: usize = 50;

/// Body of `POST /v1/wakes/claim`.
#[derive(Debug, Deserialize, Serialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ClaimRequest {
    /// The agent to wake.
    #[serde(rename = "as")]
    #[schema(value_type = crate::vocab::AgentName)]
    pub as_agent: String,
    /// Ids of new messages the session saw arrive for the agent, 0..=50 (none: claim what an
    /// earlier `batched` answer carried). Ids that name no message delivered to the agent are
    /// ignored.
    #[serde(default)]
    #[schema(value_type = Vec<crate::vocab::MessageId>, max_items = 50)]
    pub ids: Vec<String>,
}

/// Body of `POST /v1/wakes/mute`.
#[derive(Debug, Deserialize, Serialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct MuteRequest {
    /// The agent whose wakes to mute.
    #[serde(rename = "as")]
    #[schema(value_type = crate::vocab::AgentName)]
    pub as_agent: String,
    /// How long, whole minutes, 1..=10080 (default 60); `5.0` is 5 (JSON Schema counts it an
    /// integer).
    #[serde(default)]
    #[schema(value_type = Option<u32>, minimum = 1, maximum = 10080)]
    pub minutes: Option<f64>,
}

/// Answer of `POST /v1/wakes/mute`.
#[derive(Debug, Serialize, utoipa::ToSchema)]
pub struct MuteAnswer {
    /// When the mute ends (ms since the epoch).
    pub until_ms: i64,
}

/// Body of `POST /v1/wakes/unmute`.
#[derive(Debug, Deserialize, Serialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct UnmuteRequest {
    /// The agent whose mute to end.
    #[serde(rename = "as")]
    #[schema(value_type = crate::vocab::AgentName)]
    pub as_agent: String,
}

/// Answer of `POST /v1/wakes/unmute`.
#[derive(Debug, Serialize, utoipa::ToSchema)]
pub struct UnmuteAnswer {
    /// Whether a mute was set (and is now removed).
    pub was_muted: bool,
}

/// Claims a wake for new mail of an agent: the daemon decides, in one transaction, whether the
/// session wakes now (`wake`, with the ids it covers), or not (`batched`: woke less than 30 s
/// ago, claim again with no ids after `retry_after_ms`; `thread_cap`: 6 wakes of the thread in
/// the last hour; `daily_cap`: 60 wakes in 24 h; `muted`; `none`: nothing wake-worthy left —
/// e.g. another session of the agent claimed it first, or it is `status` mail).
#[utoipa::path(post, path = "/v1/wakes/claim", operation_id = "claim_wake", request_body = ClaimRequest,
    params(("Idempotency-Key" = Option<String>, Header, description = "replay protection: 1..=200 visible ASCII characters, not starting or ending with a space (else 400); the same key and body again return the first answer, another body is 409", min_length = 1, max_length = 200, pattern = "^[!-~]([ -~]*[!-~])?$")),
    responses((status = 200, description = "The decision", body = Decision),
        (status = 400, description = "BAD_REQUEST: a bad agent name, more than 50 ids, or a missing, unknown or mistyped field (named); INVALID_JSON; nothing changed", body = super::ErrorBody),
        (status = 404, description = "UNKNOWN_AGENT: `as` is no agent of this host (no mailbox, no mail delivered to it); the error names the closest agents", body = super::ErrorBody)),
    security(("bearer" = [])))]
pub async fn claim(
    State(state): State<SharedState>,
    headers: HeaderMap,
    _: ApiQuery<NoQuery>,
    ApiJson {
        value: req,
        raw: body,
    }: ApiJson<ClaimRequest>,
) -> Result<(StatusCode, Json<Value>), ApiError> {
    super::check_agent(&req.as_agent)?;
    super::check_reader(&state, &req.as_agent).await?;
    if req.ids.len() > MAX_CLAIM_IDS {
        return Err(ApiError::Invalid(format!(
            "ids must hold 0..={MAX_CLAIM_IDS} message ids"
        )));
    }
    let now = state.clock.now_ms();
    let host = state.ident.host.to_string();
    idempotent(
        &state,
        &headers,
        "/v1/wakes/claim",
        format!("wake-claim:{}", req.as_agent),
        &body,
        StatusCode::OK,
        move |tx| {
            let d = brake::claim(tx, &req.as_agent, &host, &req.ids, now)?;
            if let Decision::Wake { messages } = &d {
                tracing::debug!(agent = %req.as_agent, n = messages.len(), "wake claimed");
            }
            Ok(Ok(serde_json::to_value(d).unwrap_or(Value::Null)))
        },
    )
    .await
}

/// Mutes an agent's wakes for `minutes` (1..=10080, default 60): mail still arrives and waits
/// work; no channel notification wakes its sessions until the mute ends.
#[utoipa::path(post, path = "/v1/wakes/mute", operation_id = "mute_wakes", request_body = MuteRequest,
    params(("Idempotency-Key" = Option<String>, Header, description = "replay protection: 1..=200 visible ASCII characters, not starting or ending with a space (else 400); the same key and body again return the first answer, another body is 409", min_length = 1, max_length = 200, pattern = "^[!-~]([ -~]*[!-~])?$")),
    responses((status = 200, body = MuteAnswer),
        (status = 400, description = "BAD_REQUEST: a bad agent name, minutes outside 1..=10080, or a missing, unknown or mistyped field (named); INVALID_JSON; nothing changed", body = super::ErrorBody),
        (status = 404, description = "UNKNOWN_AGENT: `as` is no agent of this host (no mailbox, no mail delivered to it); the error names the closest agents", body = super::ErrorBody)),
    security(("bearer" = [])))]
pub async fn mute(
    State(state): State<SharedState>,
    headers: HeaderMap,
    _: ApiQuery<NoQuery>,
    ApiJson {
        value: req,
        raw: body,
    }: ApiJson<MuteRequest>,
) -> Result<(StatusCode, Json<Value>), ApiError> {
    super::check_agent(&req.as_agent)?;
    let minutes = req
        .minutes
        .unwrap_or(f64::from(brake::DEFAULT_MUTE_MINUTES));
    if minutes.fract() != 0.0 || !(1.0..=f64::from(brake::MAX_MUTE_MINUTES)).contains(&minutes) {
        return Err(ApiError::Invalid(format!(
            "minutes must be a whole number 1..={}",
            brake::MAX_MUTE_MINUTES
        )));
    }
    let minutes = minutes as u32;
    super::check_reader(&state, &req.as_agent).await?;
    let now = state.clock.now_ms();
    idempotent(
        &state,
        &headers,
        "/v1/wakes/mute",
        format!("wake-mute:{}", req.as_agent),
        &body,
        StatusCode::OK,
        move |tx| {
            let until_ms = brake::mute(tx, &req.as_agent, minutes, now)?;
            Ok(Ok(
                serde_json::to_value(MuteAnswer { until_ms }).unwrap_or(Value::Null)
            ))
        },
    )
    .await
}

/// Ends an agent's mute (nothing to end is not an error: `was_muted: false`).
#[utoipa::path(post, path = "/v1/wakes/unmute", operation_id = "unmute_wakes", request_body = UnmuteRequest,
    params(("Idempotency-Key" = Option<String>, Header, description = "replay protection: 1..=200 visible ASCII characters, not starting or ending with a space (else 400); the same key and body again return the first answer, another body is 409", min_length = 1, max_length = 200, pattern = "^[!-~]([ -~]*[!-~])?$")),
    responses((status = 200, body = UnmuteAnswer),
        (status = 400, description = "BAD_REQUEST: a bad agent name, or a missing, unknown or mistyped field (named); INVALID_JSON; nothing changed", body = super::ErrorBody),
        (status = 404, description = "UNKNOWN_AGENT: `as` is no agent of this host (no mailbox, no mail delivered to it); the error names the closest agents", body = super::ErrorBody)),
    security(("bearer" = [])))]
pub async fn unmute(
    State(state): State<SharedState>,
    headers: HeaderMap,
    _: ApiQuery<NoQuery>,
    ApiJson {
        value: req,
        raw: body,
    }: ApiJson<UnmuteRequest>,
) -> Result<(StatusCode, Json<Value>), ApiError> {
    super::check_agent(&req.as_agent)?;
    super::check_reader(&state, &req.as_agent).await?;
    idempotent(
        &state,
        &headers,
        "/v1/wakes/unmute",
        format!("wake-unmute:{}", req.as_agent),
        &body,
        StatusCode::OK,
        move |tx| {
            let was_muted = brake::unmute(tx, &req.as_agent)?;
            Ok(Ok(
                serde_json::to_value(UnmuteAnswer { was_muted }).unwrap_or(Value::Null)
            ))
        },
    )
    .await
}

#[cfg(test)]
mod tests;
