//! `GET /v1/status` (`wire.md` §2.7, §4), unsigned: without a query, the public runtime
//! `{service:"agentmbx", v:1, host, host_pubkey, version, started_at}`; with `challenge` (1..=64
//! UTF-16 code units, else 400 `bad challenge`), the [`SignedStatus`] that proves this host's
//! key and its own addresses to a prober. Any other method is 405 `method not allowed`.
//!
//! Public diagnostic data only: this route issues no nonce, grants nothing and changes nothing.

use axum::extract::State;
use axum::http::{Method, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::json;

use agentmbx_protocol::status::{valid_challenge, PublicStatus, SignedStatus};

use super::HttpError;
use crate::transport::lan::{presence, SharedLan};

/// The handler (route it for every method: non-GET answers 405 here).
pub async fn get(State(state): State<SharedLan>, method: Method, uri: Uri) -> Response {
    if method != Method::GET && method != Method::HEAD {
        return (
            StatusCode::METHOD_NOT_ALLOWED,
            Json(json!({ "error": "method not allowed" })),
        )
            .into_response();
    }
    // URLSearchParams#get: the first `challenge`, percent-decoded.
    let challenge = axum::extract::Query::<Vec<(String, String)>>::try_from_uri(&uri)
        .map(|q| q.0)
        .unwrap_or_default()
        .into_iter()
        .find(|(k, _)| k == "challenge")
        .map(|(_, v)| v);
    let Some(challenge) = challenge else {
        let public = PublicStatus::new(
            state.ident.host.as_str(),
            &state.ident.host_key.public(),
            state.version,
            &state.started_at,
        );
        return Json(public).into_response();
    };
    if !valid_challenge(&challenge) {
        return HttpError::bad_request("bad challenge").into_response();
    }
    let signed = SignedStatus::sign(
        &state.ident.host_key,
        state.ident.host.as_str(),
        &challenge,
        presence::self_addr_texts(&state),
        state.version,
        state.clock.now_ms(),
    );
    Json(signed).into_response()
}

/// The same handler under the name the route table of `wire.md` §4 uses.
pub use self::get as status;
