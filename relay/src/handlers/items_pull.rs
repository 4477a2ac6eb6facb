//! `GET /v2/relay/items?after=&limit=&epoch=` (spec §4): a page of the caller's own queue after
//! `after`, bounded by `max_pull` items and about `max_pull_bytes` (always ≥1 item when any
//! exist). `last_seq` is the last seq returned; a stale `epoch` answers 409 with the current one.

use std::collections::HashMap;

use axum::extract::{Query, Request, State};
use axum::http::StatusCode;
use axum::Json;

use agentmbx_protocol::wire::{PullItem, PullResponse};
use agentmbx_protocol::{b64, failpoint};

use crate::auth::{authenticate, blocking};
use crate::error::ApiError;
use crate::state::SharedRelay;
use crate::store::{PullRequest, MAX_PULL_ITEMS};

fn int_param(q: &HashMap<String, String>, name: &str) -> Result<Option<i64>, ApiError> {
    match q.get(name) {
        None => Ok(None),
        Some(v) if !v.is_empty() && v.len() <= 16 && v.bytes().all(|b| b.is_ascii_digit()) => v
            .parse()
            .map(Some)
            .map_err(|_| ApiError::bad_request(format!("bad {name}"))),
        Some(_) => Err(ApiError::bad_request(format!(
            "bad {name}: a non-negative integer is required"
        ))),
    }
}

/// Handles `GET /v2/relay/items`.
pub async fn get(
    State(state): State<SharedRelay>,
    req: Request,
) -> Result<Json<PullResponse>, ApiError> {
    let (parts, _) = req.into_parts();
    let caller = authenticate(&state, &parts.method, &parts.uri, &parts.headers, "").await?;
    let Query(q) = Query::<HashMap<String, String>>::try_from_uri(&parts.uri)
        .map_err(|_| ApiError::bad_request("bad query"))?;
    let after = int_param(&q, "after")?.unwrap_or(0);
    // `relay.toml` bounds max_pull to 1..=500; a configuration built in code is clamped too,
    // so the range below is never empty.
    let max_pull = i64::try_from(state.config.limits.max_pull)
        .unwrap_or(MAX_PULL_ITEMS)
        .clamp(1, MAX_PULL_ITEMS);
    let limit = int_param(&q, "limit")?
        .unwrap_or(max_pull)
        .clamp(1, max_pull);
    let want_epoch = q.get("epoch").cloned();
    let store = state.store.clone();
    let req = PullRequest {
        target_pubkey: caller.host_pubkey,
        after,
        limit,
        max_bytes: state.config.limits.max_pull_bytes,
    };
    let page = blocking(move || store.pull(req)).await?;
    if let Some(e) = want_epoch.filter(|e| !e.is_empty()) {
        if e != page.epoch {
            return Err(ApiError::new(StatusCode::CONFLICT, "stale epoch", "EPOCH")
                .with_epoch(page.epoch, page.head_seq));
        }
    }
    failpoint::hit("pull:before-response");
    Ok(Json(PullResponse {
        epoch: page.epoch,
        head_seq: page.head_seq,
        items: page
            .items
            .into_iter()
            .map(|i| PullItem {
                seq: i.seq,
                kind: i.kind,
                item_id: i.item_id,
                sender_pubkey: i.sender_pubkey,
                wire_b64: b64::encode(&i.wire),
            })
            .collect(),
        last_seq: page.last_seq,
        more: page.more,
    }))
}
