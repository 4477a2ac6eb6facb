//! `GET /v1/agents`: this host's agent directory `{host, agents:[{name, role, cli, description,
//! last_seen}]}` for the verified peer (`wire.md` §4).

use axum::extract::State;
use axum::Json;
use serde_json::{json, Value};

use super::HttpError;
use crate::mailbox::agents;
use crate::transport::lan::SharedLan;

/// The handler. Errors: 500 for a storage fault.
pub async fn get(State(state): State<SharedLan>) -> Result<Json<Value>, HttpError> {
    let host = state.ident.host.to_string();
    let own = host.clone();
    let list = state
        .mailbox
        .run(move |conn| agents::local(conn, &own))
        .await?;
    Ok(Json(json!({ "host": host, "agents": list })))
}
