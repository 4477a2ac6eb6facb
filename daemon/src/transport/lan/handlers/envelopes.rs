//! `POST /v2/envelopes` (and `/v1/envelopes`, the same handler): a batch of at most 200 sealed
//! envelopes from the verified peer (`wire.md` §4). Each runs through
//! the inbound path ([`crate::node::inbound`]) in its own savepoint of one transaction; the answer
//! `{results:[{id, result}]}` (result `accepted`, `duplicate` or `rejected:<why>`, in request
//! order) is sent only after that transaction committed.

use axum::body::Bytes;
use axum::extract::State;
use axum::{Extension, Json};
use serde_json::{json, Map, Value};

use agentmbx_protocol::limits::MAX_BATCH;

use super::{batch, parse_json, HttpError};
use crate::node::inbound::{nothing_after, Granularity, Inbound, Item, Outcome};
use crate::transport::lan::hop::HopPeer;
use crate::transport::lan::{LanState, SharedLan};

/// The LAN server's inbound path: its store and identity, waking the sender loops.
pub(super) fn inbound(state: &LanState) -> Inbound {
    Inbound::new(
        state.mailbox.clone(),
        state.ident.clone(),
        Some(state.wake.clone()),
    )
}

/// The handler. Errors: 400 for a body that is not `{envelopes:[≤200]}`, 500 for a storage
/// fault (nothing of the batch is kept then).
pub async fn post(
    State(state): State<SharedLan>,
    Extension(HopPeer(peer)): Extension<HopPeer>,
    body: Bytes,
) -> Result<Json<Value>, HttpError> {
    let envelopes = batch(parse_json(&body)?, "envelopes", MAX_BATCH)?;
    let now = state.clock.now_ms();
    let host = peer.host.clone();
    // 0.5.x answers `id` as the envelope carried it, and leaves it out when absent.
    let ids: Vec<Option<Value>> = envelopes.iter().map(|e| e.get("id").cloned()).collect();
    let items = envelopes
        .into_iter()
        .map(|env| Item::Envelope {
            env,
            hop: peer.clone(),
        })
        .collect();
    // Deliveries queue receipts for the sender: the inbound path wakes the sender loops.
    let outcomes = inbound(&state)
        .receive(Granularity::BatchWithSavepoints, items, now, nothing_after)
        .await?;
    let mut accepted = 0;
    let mut requeued = 0;
    let mut results = Vec::with_capacity(outcomes.len());
    for (id, outcome) in ids.into_iter().zip(outcomes) {
        match &outcome {
            Outcome::Stored { .. } => accepted += 1,
            Outcome::Duplicate { requeued: n } => requeued += n,
            _ => {}
        }
        let mut item = Map::new();
        if let Some(id) = id {
            item.insert("id".into(), id);
        }
        item.insert("result".into(), Value::String(outcome.answer()));
        results.push(Value::Object(item));
    }
    if accepted > 0 || requeued > 0 {
        tracing::info!(peer = %host, accepted, "mail received over the LAN");
    }
    Ok(Json(json!({ "results": results })))
}
