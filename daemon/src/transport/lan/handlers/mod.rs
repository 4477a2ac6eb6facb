//! Handlers of the LAN server's routes (`wire.md` §4), one file per resource. Their error
//! answer, [`HttpError`], is [`super::http`]'s.
//!
//! Signed routes run only after [`super::hop::require_hop`] verified the caller; they take the
//! verified peer from the request's [`super::hop::HopPeer`] extension and the raw body as
//! bytes. Every change a handler makes is one SQLite transaction, committed before it answers.
//! Nothing here logs bodies or keys.

pub mod agents;
pub mod enc_key;
pub mod envelopes;
pub mod pairing;
pub mod presence;
pub mod receipts;
pub mod rotate;
pub mod status;
pub mod unpair;

use serde_json::Value;

/// A refused or failed LAN request ([`super::http`], below the hop check and the server, which
/// answer with it too).
pub use super::http::HttpError;

/// The request body as JSON (read as 0.5.x's `JSON.parse` sees it), else 400 `bad JSON body`.
pub(crate) fn parse_json(body: &[u8]) -> Result<Value, HttpError> {
    agentmbx_protocol::canonical::parse(body).map_err(|_| HttpError::thrown("bad JSON body"))
}

/// The array `key` of a JSON object body with at most `max` items, else 400 `bad batch: <key>
/// must be an array of at most <max>` (0.5.x's texts).
pub(crate) fn batch(body: Value, key: &str, max: usize) -> Result<Vec<Value>, HttpError> {
    let items = match body {
        Value::Object(mut map) => map.remove(key),
        _ => None,
    };
    match items {
        Some(Value::Array(items)) if items.len() <= max => Ok(items),
        _ => Err(HttpError::bad_request(format!(
            "bad batch: {key} must be an array of at most {max}"
        ))),
    }
}
