//! `GET /v1/enc-key`: this host's body-encryption key as a v1 ad `{v:1, host, enc_pub, sig}`,
//! `sig` by the host key over canonical(`{v:1, host, enc_pub}`) (`wire.md` §2.8, §4). The caller
//! verifies it against the host key it pinned.

use axum::extract::State;
use axum::Json;
use serde_json::{json, Value};

use agentmbx_protocol::records::enc_ad_v1_canonical;

use crate::transport::lan::SharedLan;

/// The handler (never fails).
pub async fn get(State(state): State<SharedLan>) -> Json<Value> {
    let host = state.ident.host.to_string();
    let enc_pub = state.ident.enc_key.public().to_b64();
    let sig = state
        .ident
        .host_key
        .sign(enc_ad_v1_canonical(&host, &enc_pub).as_bytes());
    Json(json!({ "v": 1, "host": host, "enc_pub": enc_pub, "sig": sig }))
}
