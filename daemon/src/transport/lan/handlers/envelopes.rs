//! `POST /v2/envelopes` (and `/v1/envelopes`, the same handler): a batch of at most 200 sealed
//! envelopes from the verified peer (`wire.md` §4). Each runs through
//! [`crate::node::receive::receive`] in its own savepoint of one transaction; the answer
//! `{results:[{id, result}]}` (result `accepted`, `duplicate` or `rejected:<why>`, in request
//! order) is sent only after that transaction committed.

use axum::body::Bytes;
use axum::extract::State;
use axum::{Extension, Json};
use rusqlite::TransactionBehavior;
use serde_json::{json, Map, Value};

use agentmbx_protocol::limits::MAX_BATCH;

use super::{batch, parse_json, HttpError};
use crate::mailbox::receipts;
use crate::node::receive::{receive, Verdict};
use crate::transport::lan::hop::HopPeer;
use crate::transport::lan::SharedLan;

/// The handler. Errors: 400 for a body that is not `{envelopes:[≤200]}`, 500 for a storage
/// fault (nothing of the batch is kept then).
pub async fn post(
    State(state): State<SharedLan>,
    Extension(HopPeer(peer)): Extension<HopPeer>,
    body: Bytes,
) -> Result<Json<Value>, HttpError> {
    let envelopes = batch(parse_json(&body)?, "envelopes", MAX_BATCH)?;
    let ident = state.ident.clone();
    let now = state.clock.now_ms();
    let host = peer.host.clone();
    let results = state
        .mailbox
        .run(move |conn| {
            let mut tx = conn.transaction_with_behavior(TransactionBehavior::Immediate)?;
            let mut results = Vec::with_capacity(envelopes.len());
            let mut requeued = 0;
            for env in &envelopes {
                let sp = tx.savepoint()?;
                let result = match receive(&sp, &ident, env, &peer, now)? {
                    Ok(Verdict::Stored { .. }) => "accepted".to_string(),
                    Ok(Verdict::Duplicate) => {
                        // The sender asks again: its receipts may have been lost or expired,
                        // so the current delivery states go back to it (`wire.md` §3.5).
                        let id = env.get("id").and_then(Value::as_str).unwrap_or_default();
                        requeued += receipts::requeue(&sp, id, now)?;
                        "duplicate".to_string()
                    }
                    Err(why) => format!("rejected:{why}"),
                };
                if !result.starts_with("rejected:") {
                    // Stored, or a duplicate whose receipts were queued again.
                    sp.commit()?;
                } else {
                    // Savepoint dropped: anything a refused envelope touched is rolled back.
                    drop(sp);
                }
                // 0.5.x answers `id` as the envelope carried it, and leaves it out when absent.
                let mut item = Map::new();
                if let Some(id) = env.get("id") {
                    item.insert("id".into(), id.clone());
                }
                item.insert("result".into(), Value::String(result));
                results.push(Value::Object(item));
            }
            tx.commit()?;
            Ok((results, requeued))
        })
        .await?;
    let (results, requeued) = results;
    let accepted = results.iter().filter(|r| r["result"] == "accepted").count();
    if accepted > 0 || requeued > 0 {
        tracing::info!(peer = %host, accepted, "mail received over the LAN");
        // Deliveries queue receipts for the sender: let the sender loops look now.
        state.wake.notify_one();
    }
    Ok(Json(json!({ "results": results })))
}
