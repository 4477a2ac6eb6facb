//! `POST /v1/unpair`: the verified peer removed its pairing with this host, so this host
//! removes that peer too (`wire.md` §4) and mail stops queueing for a host that refuses it.
//! Mail still waiting for it ends as undelivered with an alert to each sender, exactly as
//! `peers remove` here does ([`crate::node::unpair`]); `{ok:true}` after the commit.

use axum::extract::State;
use axum::{Extension, Json};
use rusqlite::TransactionBehavior;
use serde_json::{json, Value};

use super::HttpError;
use crate::node::unpair;
use crate::transport::lan::hop::HopPeer;
use crate::transport::lan::SharedLan;

/// The handler. Errors: 500 for a storage fault.
pub async fn post(
    State(state): State<SharedLan>,
    Extension(HopPeer(peer)): Extension<HopPeer>,
) -> Result<Json<Value>, HttpError> {
    let host = peer.host.clone();
    let ident = state.ident.clone();
    let now = state.clock.now_ms();
    let ended = state
        .mailbox
        .run(move |conn| {
            let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate)?;
            let ended = unpair::forget_peer(&tx, &ident, &host, now)?;
            tx.commit()?;
            Ok(ended)
        })
        .await?;
    tracing::warn!(peer = %peer.host, undelivered = ended, "the peer removed its pairing with this host; removed it here too");
    Ok(Json(json!({ "ok": true })))
}
