//! `POST /v1/presence` (`wire.md` §2.7, §4), behind the signed hop: a paired host tells this one
//! where it is now. Body `{v:1, seq, port, addrs[≤16, each ≤64], version}`; a `seq` at or
//! below the last one seen from that peer is a replay, refused 400 `{ok:false, error:"stale
//! presence (seq)"}` and changing nothing; a body that is not a beacon is 400 `{ok:false,
//! error:"bad presence"}`. Otherwise the seq is stored and the answer is 202 `{ok:true}` after
//! the commit; the candidates are challenge-probed in the background
//! ([`presence::accept_presence`]), so a dead candidate never holds the caller's request open.
//!
//! The beacon never moves a peer by itself: only a status signed by the pinned key does.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};

use axum::extract::{ConnectInfo, Request, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::json;

use super::{parse_json, HttpError};
use crate::transport::lan::hop::HopPeer;
use crate::transport::lan::http::MAX_BODY;
use crate::transport::lan::presence::{self, PresenceError};
use crate::transport::lan::SharedLan;

/// The handler. Errors: 400 `{ok:false, error}` as above; 401 when no verified peer came with
/// the request (the route must sit behind the hop check); 500 for a storage fault.
pub async fn post(State(state): State<SharedLan>, req: Request) -> Response {
    let (parts, body) = req.into_parts();
    let Some(HopPeer(peer)) = parts.extensions.get::<HopPeer>().cloned() else {
        return HttpError::unauthorized("host not paired").into_response();
    };
    let remote = parts
        .extensions
        .get::<ConnectInfo<SocketAddr>>()
        .map_or(IpAddr::V4(Ipv4Addr::UNSPECIFIED), |c| c.0.ip());
    let Ok(bytes) = axum::body::to_bytes(body, MAX_BODY).await else {
        return HttpError::bad_request("request body could not be read").into_response();
    };
    let value = match parse_json(&bytes) {
        Ok(v) => v,
        Err(e) => return e.into_response(),
    };
    match presence::accept_presence(&state, &peer.host, &value, remote).await {
        Ok(_healing) => (StatusCode::ACCEPTED, Json(json!({ "ok": true }))).into_response(),
        Err(PresenceError::Store(e)) => HttpError::from(e).into_response(),
        Err(e) => (
            StatusCode::BAD_REQUEST,
            Json(json!({ "ok": false, "error": e.to_string() })),
        )
            .into_response(),
    }
}

/// The same handler under the name the route table of `wire.md` §4 uses.
pub use self::post as presence;
