//! `POST /v1/receipts`: delivery receipts `{receipts:[≤200]}`, each `{rec, sig}`, for mail this
//! host sent, from the verified peer (`wire.md` §2.11, §4). Each goes through the inbound path
//! ([`crate::node::inbound`], hence [`crate::node::receipts::accept`]) in one transaction; the
//! answer `{results:[…]}` (in request order: `accepted`, `duplicate`, `stale` or
//! `rejected:<why>`) is sent after its commit.

use axum::body::Bytes;
use axum::extract::State;
use axum::{Extension, Json};
use serde_json::{json, Value};

use agentmbx_protocol::limits::MAX_BATCH;

use super::{batch, parse_json, HttpError};
use crate::node::inbound::{nothing_after, Granularity, Item, Outcome};
use crate::transport::lan::hop::HopPeer;
use crate::transport::lan::SharedLan;

/// The handler. Errors: 400 for a body that is not `{receipts:[≤200]}`, 500 for a storage
/// fault (nothing of the batch is kept then).
pub async fn post(
    State(state): State<SharedLan>,
    Extension(HopPeer(peer)): Extension<HopPeer>,
    body: Bytes,
) -> Result<Json<Value>, HttpError> {
    let receipts = batch(parse_json(&body)?, "receipts", MAX_BATCH)?;
    let now = state.clock.now_ms();
    let items = receipts
        .into_iter()
        .map(|receipt| Item::Receipt {
            receipt,
            hop: peer.clone(),
        })
        .collect();
    let outcomes = super::envelopes::inbound(&state)
        .receive(Granularity::Batch, items, now, nothing_after)
        .await?;
    let results: Vec<String> = outcomes.iter().map(Outcome::answer).collect();
    Ok(Json(json!({ "results": results })))
}
