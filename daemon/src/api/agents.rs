//! `GET /v1/agents` (the directory: this host's mailboxes and the agents paired hosts reported)
//! and `POST /v1/agents` (register a local mailbox with an optional role and description, as
//! `agentmbx whoami --as <agent> --role R` does). What a local mailbox is, and what `*` and
//! `role:R` reach, is defined in [`crate::mailbox::agents`].

use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::Json;
use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::mailbox::agents::{self, AgentEntry, DirectoryEntry};
use crate::mailbox::MailboxError;

use super::{idempotent, ApiError, ApiJson, ApiQuery, NoQuery, SharedState};

/// Body of `POST /v1/agents`.
#[derive(Debug, Clone, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct RegisterRequest {
    /// The agent's name on this host (NAME_RE).
    #[schema(value_type = crate::vocab::AgentName)]
    pub name: String,
    /// Role (NAME_RE) that `role:<R>` addresses reach; absent keeps the stored one, `""` clears it.
    #[serde(default)]
    #[schema(pattern = "^([a-z0-9][a-z0-9-]{1,39})?$", max_length = 40)]
    pub role: Option<String>,
    /// One line without control characters, ≤ 200 UTF-16 units; absent keeps the stored one,
    /// `""` clears it.
    #[serde(default)]
    #[schema(
        max_length = 200,
        pattern = "^[^\\x00-\\x1f\\x7f\\x85\\u2028\\u2029]*$"
    )]
    pub description: Option<String>,
}

/// Answer of `GET /v1/agents`.
#[derive(Debug, Clone, Serialize, utoipa::ToSchema)]
pub struct DirectoryAnswer {
    /// This host's name.
    pub host: String,
    /// This host's mailboxes first, then paired hosts' agents, by host then name.
    pub agents: Vec<DirectoryEntry>,
}

/// Lists the agent directory.
#[utoipa::path(get, path = "/v1/agents", operation_id = "list_agents",
    responses((status = 200, body = DirectoryAnswer)),
    security(("bearer" = [])))]
pub async fn get(
    State(state): State<SharedState>,
    _: ApiQuery<NoQuery>,
) -> Result<Json<DirectoryAnswer>, ApiError> {
    let host = state.ident.host.to_string();
    let own = host.clone();
    let list = state
        .mailbox
        .run(move |c| agents::directory(c, &own))
        .await?;
    Ok(Json(DirectoryAnswer { host, agents: list }))
}

/// Registers (or updates) a local mailbox; `*` reaches it from now on, and `role:<R>` when it
/// has role R. Mail this host held for the name (`GET /v1/unclaimed`) becomes its mail in the
/// same transaction, and its `delivered` receipts go out. With an `Idempotency-Key` (scoped to
/// the agent name, `register:<name>`), a repeat with the same body answers the first answer
/// again and another body is 409.
#[utoipa::path(post, path = "/v1/agents", operation_id = "register_agent", request_body = RegisterRequest,
    params(("Idempotency-Key" = Option<String>, Header, description = "replay protection, per agent name: 1..=200 visible ASCII characters, not starting or ending with a space (else 400); the same key and body again return the first answer, another body is 409", min_length = 1, max_length = 200, pattern = "^[!-~]([ -~]*[!-~])?$")),
    responses((status = 200, body = AgentEntry)),
    security(("bearer" = [])))]
pub async fn post(
    State(state): State<SharedState>,
    headers: HeaderMap,
    _: ApiQuery<NoQuery>,
    ApiJson {
        value: req,
        raw: body,
    }: ApiJson<RegisterRequest>,
) -> Result<(StatusCode, Json<Value>), ApiError> {
    super::check_agent(&req.name)?;
    let own = state.ident.host.to_string();
    let now = state.clock.now_ms();
    let answer = idempotent(
        &state,
        &headers,
        "/v1/agents",
        format!("register:{}", req.name),
        &body,
        StatusCode::OK,
        move |tx| {
            let entry = match agents::register(
                tx,
                &own,
                &req.name,
                req.role.as_deref(),
                req.description.as_deref(),
                now,
            ) {
                Ok(entry) => entry,
                Err(MailboxError::Invalid(m)) => return Ok(Err(ApiError::Invalid(m))),
                Err(e) => return Err(e),
            };
            Ok(Ok(serde_json::to_value(entry).unwrap_or(Value::Null)))
        },
    )
    .await?;
    // Mail held for this name became its mail: its delivered receipts are queued, send them now.
    state.wake.notify_one();
    Ok(answer)
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::api::AppState;
    use crate::testutil::{self, T0};
    use crate::token::ApiToken;

    #[tokio::test]
    async fn register_then_list_and_bad_input_is_400() {
        let store = testutil::store();
        let ident = Arc::new(testutil::identity("home"));
        store.add_peer(&testutil::identity("work"), false);
        store
            .mailbox
            .with(|c| {
                agents::replace_host(
                    c,
                    "work",
                    &[AgentEntry {
                        name: "carol".into(),
                        role: None,
                        cli: None,
                        description: None,
                        last_seen: None,
                    }],
                    T0,
                )
            })
            .unwrap();
        let state: SharedState = Arc::new(AppState {
            host: ident.host.clone(),
            token: ApiToken::generate(),
            version: crate::VERSION,
            clock: testutil::clock(),
            ident,
            mailbox: store.mailbox.clone(),
            wake: Arc::new(tokio::sync::Notify::new()),
            ids: std::sync::Mutex::new(agentmbx_protocol::ulid::Generator::new()),
            instance: Default::default(),
            lan: Default::default(),
            rates: Default::default(),
            relay_configured: Default::default(),
        });
        let body = |text: &'static str| -> Result<ApiJson<RegisterRequest>, ApiError> {
            Ok(ApiJson {
                value: crate::api::extract::parse_json(text.as_bytes())?,
                raw: text.into(),
            })
        };
        let none = || ApiQuery(NoQuery {});
        let registered = body(r#"{"name":"bob","role":"dev","description":"builds"}"#).unwrap();
        let headers = HeaderMap::new;
        let (_, Json(entry)) = post(State(state.clone()), headers(), none(), registered)
            .await
            .unwrap();
        assert_eq!(
            (&entry["name"], &entry["role"]),
            (&"bob".into(), &"dev".into())
        );
        for bad in [
            r#"{"name":"Bob"}"#,
            r#"{"name":"bob","role":"Dev Ops"}"#,
            r#"{"name":"bob","color":"red"}"#,
        ] {
            let err = match body(bad) {
                Ok(req) => post(State(state.clone()), headers(), none(), req)
                    .await
                    .unwrap_err(),
                Err(e) => e,
            };
            assert_eq!(err.status().as_u16(), 400, "{bad}");
        }
        let Json(dir) = get(State(state), none()).await.unwrap();
        assert_eq!(dir.host, "home");
        let listed: Vec<(&str, &str)> = dir
            .agents
            .iter()
            .map(|a| (a.name.as_str(), a.host.as_str()))
            .collect();
        assert_eq!(listed, vec![("bob", "home"), ("carol", "work")]);
    }
}
