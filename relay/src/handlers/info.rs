//! `GET /v2/relay/info` (spec §1): the relay key, epoch, version and limits; with a valid hop
//! from an enrolled key also `you` (head_seq, acked_through, enc_ad). A caller whose hop does
//! not verify, or whose key is not enrolled, simply gets no `you`. On an account relay a hop
//! without the token still gets `you` (`auth::authenticate_info`): hosts send their first info
//! of a pass without it, to see the relay key before the token leaves the host.
//!
//! `you.instance_conflict` (an added field 0.5.x ignores; absent when there is none) is set
//! while the relay sees two daemon instances alternate on the caller's host key
//! ([`crate::instances`]).

use axum::extract::{Request, State};
use axum::Json;

use agentmbx_protocol::wire::{RelayInfo, You, YouEncAd};

use crate::auth::{authenticate_info, blocking, parse_key};
use crate::error::ApiError;
use crate::state::SharedRelay;

/// Handles `GET /v2/relay/info`.
pub async fn get(
    State(state): State<SharedRelay>,
    req: Request,
) -> Result<Json<RelayInfo>, ApiError> {
    let (parts, _) = req.into_parts();
    // A point read, run right here (cheaper than a blocking-thread hand-off; see `auth`).
    let epoch = state.store.epoch()?;
    let mut info = RelayInfo {
        v: 2,
        relay_pubkey: state.key.public().to_b64(),
        epoch,
        version: state.version.to_string(),
        limits: state.config.limits.published(),
        you: None,
    };
    if parts
        .headers
        .contains_key(agentmbx_protocol::hop::header::KEY)
    {
        if let Ok(enrolment) =
            authenticate_info(&state, &parts.method, &parts.uri, &parts.headers).await
        {
            let store = state.store.clone();
            let pk = enrolment.host_pubkey.clone();
            let (q, ad) =
                blocking(move || Ok((store.info_for(&pk)?, store.get_enc_ad(&pk)?))).await?;
            let enc_ad = ad.map(|a| match &a.v2 {
                Some(v2) => YouEncAd {
                    enc_pub: a.enc_pub.clone(),
                    exp: serde_json::from_str::<serde_json::Value>(&v2.record)
                        .ok()
                        .and_then(|r| r.get("exp").and_then(|e| e.as_str()).map(String::from))
                        .unwrap_or_default(),
                    v1: false,
                },
                None => YouEncAd {
                    enc_pub: a.enc_pub.clone(),
                    exp: String::new(),
                    v1: true,
                },
            });
            let instance_conflict =
                parse_key(&enrolment.host_pubkey).and_then(|k| state.instances.conflict(&k));
            let stream_nonce = Some(
                state
                    .nonces
                    .issue(&enrolment.host_pubkey, state.clock.now_ms()),
            );
            info.you = Some(You {
                host: enrolment.host_name,
                pubkey: enrolment.host_pubkey,
                head_seq: q.head_seq,
                acked_through: q.acked_through,
                enc_ad,
                instance_conflict,
                stream_nonce,
            });
        }
    }
    Ok(Json(info))
}
