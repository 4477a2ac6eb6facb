//! The local API's OpenAPI document, generated from the handlers' annotations (utoipa). The
//! committed copy `daemon/openapi.json` is the contract; a test fails when it drifts.

use utoipa::openapi::security::{HttpAuthScheme, HttpBuilder, SecurityScheme};
use utoipa::{Modify, OpenApi};

use super::{ack, agents, health, inbox, messages, sent, threads, unclaimed};

/// The OpenAPI description of the local API.
#[derive(Debug, OpenApi)]
#[openapi(
    info(title = "agentmbx local API", description = "Loopback API for agents on this host: send, reply, inbox, read, thread, ack, sent, agent directory, unclaimed mail. Bearer token from api.token; errors are {error, code} with a stable code: 400 BAD_REQUEST (a missing, unknown or mistyped field or query parameter, named; unknown ones are refused), 400 INVALID_JSON, 400 UNKNOWN_HOST, 400 UNKNOWN_AGENT, 401 UNAUTHORIZED, 404 NOT_FOUND (also unknown routes), 405 METHOD_NOT_ALLOWED, 409 CONFLICT, 413 BODY_TOO_LARGE (over 2 MiB), 415 UNSUPPORTED_MEDIA_TYPE (a body not sent as application/json), 500 INTERNAL, 503 STORE_BUSY."),
    paths(health::get, messages::post, messages::reply, messages::get, threads::get, inbox::get, ack::post, agents::get, agents::post, sent::get, unclaimed::get),
    modifiers(&BearerAuth)
)]
pub struct ApiDoc;

#[derive(Debug)]
struct BearerAuth;

impl Modify for BearerAuth {
    fn modify(&self, openapi: &mut utoipa::openapi::OpenApi) {
        let components = openapi.components.get_or_insert_with(Default::default);
        components.add_security_scheme(
            "bearer",
            SecurityScheme::Http(HttpBuilder::new().scheme(HttpAuthScheme::Bearer).build()),
        );
    }
}

/// The document as pretty JSON (what `agentmbx openapi` prints and `daemon/openapi.json` holds).
pub fn document() -> String {
    let mut doc = ApiDoc::openapi();
    doc.info.version = crate::VERSION.to_string();
    doc.to_pretty_json().unwrap_or_default() + "\n"
}

#[cfg(test)]
mod tests {
    /// The committed contract must equal what the code generates (regenerate with
    /// `cargo run -p agentmbx -- openapi > daemon/openapi.json`).
    #[test]
    fn committed_openapi_document_is_current() {
        let committed = include_str!("../../openapi.json");
        assert!(
            committed == super::document(),
            "daemon/openapi.json is out of date: run `cargo run -p agentmbx -- openapi > daemon/openapi.json`"
        );
    }
}
