//! `POST /v2/relay/ack {epoch, through}` (spec §4; `wire.md` §3.2 "Ack": "`through` safe int
//! in [0, head_seq] else BAD_ACK"): deletes the caller's items with `seq ≤ through` and records
//! `acked_through = max(old, through)`.
//!
//! Refusals, in this order:
//! - a body that is not `{epoch, through}`: 400 `BAD_REQUEST`;
//! - `through` that is not a JSON integer (a fraction, an exponent form such as `1e2` or
//!   `5.0`, a string, null): 400 `BAD_REQUEST` "bad ack: through must be an integer";
//! - a stale epoch: 409 `EPOCH` with the current `epoch` and `head_seq`;
//! - an integer outside `[0, head_seq]` — negative, past the head, or past what an i64 or a
//!   JS number can hold — 400 `BAD_ACK` with `epoch` and `head_seq` (the receiver treats it as
//!   an epoch change, spec §4). Nothing changes for any refusal.

use axum::extract::{Request, State};
use axum::http::StatusCode;
use axum::Json;

use agentmbx_protocol::limits::RELAY_SMALL_BODY;
use agentmbx_protocol::wire::AckResponse;
use serde::Deserialize;
use serde_json::value::RawValue;

use crate::auth::{authenticate, blocking, read_body, utf8};
use crate::error::ApiError;
use crate::state::SharedRelay;
use crate::store::{self, AckResult};

/// The ack body with `through` kept as its JSON text, so an integer too large for any number
/// type is still told from a fraction.
#[derive(Deserialize)]
struct RawAck<'a> {
    epoch: String,
    #[serde(borrow)]
    through: &'a RawValue,
}

/// The value of a JSON integer (`-?digits`: no fraction, no exponent), saturated to the i64
/// range: an integer too large for an i64 is still outside `[0, head_seq]` (seqs are safe
/// integers), so saturating keeps its answer. `None` for any other JSON value.
fn integer(text: &str) -> Option<i64> {
    let digits = text.strip_prefix('-').unwrap_or(text);
    if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    Some(text.parse::<i64>().unwrap_or(if text.starts_with('-') {
        i64::MIN
    } else {
        i64::MAX
    }))
}

/// Handles `POST /v2/relay/ack`.
pub async fn post(
    State(state): State<SharedRelay>,
    req: Request,
) -> Result<Json<AckResponse>, ApiError> {
    let (parts, body) = req.into_parts();
    let body = read_body(body, RELAY_SMALL_BODY).await?;
    let raw = utf8(&body)?;
    let caller = authenticate(&state, &parts.method, &parts.uri, &parts.headers, raw).await?;
    let ack: RawAck<'_> = serde_json::from_str(raw)
        .map_err(|_| ApiError::bad_request("bad ack: {epoch, through} required"))?;
    let through = integer(ack.through.get())
        .ok_or_else(|| ApiError::bad_request("bad ack: through must be an integer"))?;
    let store = state.store.clone();
    let req = store::AckRequest {
        target_pubkey: caller.host_pubkey,
        through,
        epoch: Some(ack.epoch),
    };
    match blocking(move || store.ack(req)).await? {
        AckResult::Acked(a) => Ok(Json(AckResponse {
            acked_through: a.acked_through,
            deleted: a.deleted,
            head_seq: a.head_seq,
        })),
        AckResult::OutOfRange { head_seq, epoch } => Err(ApiError::new(
            StatusCode::BAD_REQUEST,
            if through < 0 {
                "ack below seq 0: treat as an epoch change"
            } else {
                "ack beyond the last allocated seq: treat as an epoch change"
            },
            "BAD_ACK",
        )
        .with_epoch(epoch, head_seq)),
        AckResult::StaleEpoch { epoch, head_seq } => {
            Err(ApiError::new(StatusCode::CONFLICT, "stale epoch", "EPOCH")
                .with_epoch(epoch, head_seq))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn through_is_an_integer_only_in_integer_syntax_and_saturates_past_i64() {
        let through = |body: &str| {
            let ack: RawAck<'_> = serde_json::from_str(body).expect("ack body");
            integer(ack.through.get())
        };
        assert_eq!(through(r#"{"epoch":"e","through": 5 }"#), Some(5));
        assert_eq!(through("{\"through\":\n-7\t,\"epoch\":\"e\"}"), Some(-7));
        assert_eq!(through(r#"{"epoch":"e","through":-0}"#), Some(0));
        assert_eq!(
            through(r#"{"epoch":"e","through":99999999999999999999999}"#),
            Some(i64::MAX)
        );
        assert_eq!(
            through(r#"{"epoch":"e","through":-99999999999999999999999}"#),
            Some(i64::MIN)
        );
        for not in ["5.0", "1e2", "-1.5", "\"5\"", "null", "true", "[1]", "{}"] {
            assert_eq!(
                through(&format!(r#"{{"epoch":"e","through":{not}}}"#)),
                None,
                "{not}"
            );
        }
    }
}
