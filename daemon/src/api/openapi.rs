//! The local API's OpenAPI document, generated from the handlers' annotations (utoipa). The
//! committed copy `daemon/openapi.json` is the contract; a test fails when it drifts.
//!
//! The document states what the API enforces, so that a request valid by the document is one
//! the daemon accepts as well formed (checked against a running daemon by
//! `tests/openapi_contract.rs` with schemathesis):
//!
//! - shared value shapes are components defined here ([`AgentName`], [`Address`],
//!   [`MessageId`], [`Kind`], …) and referenced from the request structs with
//!   `#[schema(value_type = …)]` / `#[param(value_type = …)]`; lengths and counts sit on the
//!   fields themselves (`max_length`, `max_items`, `minimum`, …). utoipa takes only literals
//!   there, so the unit tests below compare each one with the constant the code enforces;
//! - every error answer is documented on every operation that can give it (`ErrorResponses`
//!   adds the ones that follow from how a route is built: 400 for its query, 401 behind the
//!   token, 400/413/415 for a JSON body, 409 with an `Idempotency-Key`, 500/503 for the
//!   store), each `{error, code}` ([`super::ErrorBody`]) with `code` one of [`ERROR_CODES`].
//!   Route-specific ones (404 for an id or an unknown reader, 400 `UNKNOWN_HOST` and
//!   `UNKNOWN_AGENT` for a recipient) are in the route's own
//!   `responses(...)`, which the modifier never replaces.
//!
//! Adding a body field or query parameter: give it its shape here (`value_type` of a component,
//! or `pattern`/`max_length`/`max_items`/`minimum`/`maximum` on the field) equal to what the
//! handler checks, and extend the tests below. Adding a route: list it in `paths(...)`, give it
//! its route-specific responses; the common ones follow. Adding an error code: a new
//! [`super::ApiError`] variant must be added to [`super::ApiError::examples`] (the compiler
//! insists), which puts its code in the document.

use utoipa::openapi::header::HeaderBuilder;
use utoipa::openapi::path::{Operation, ParameterIn, PathItem};
use utoipa::openapi::response::ResponseBuilder;
use utoipa::openapi::schema::{Schema, SchemaType};
use utoipa::openapi::security::{HttpAuthScheme, HttpBuilder, SecurityScheme};
use utoipa::openapi::{ContentBuilder, ObjectBuilder, Ref, RefOr, Type};
use utoipa::{Modify, OpenApi};

use super::{
    ack, agents, events, health, history, inbox, messages, search, sent, threads, unclaimed, wakes,
};

/// The OpenAPI description of the local API.
#[derive(Debug, OpenApi)]
#[openapi(
    info(title = "agentmbx local API", description = "Loopback API for agents on this host: send, reply, inbox, read, thread, search, ack, sent, agent directory, unclaimed mail, history replay and catchup, the wake brake, new-mail events (Server-Sent Events). Bearer token from api.token; errors are {error, code} with a stable code: 400 BAD_REQUEST (a missing, unknown or mistyped field or query parameter, named; unknown ones are refused), 400 INVALID_JSON, 400 UNKNOWN_HOST, 400 UNKNOWN_AGENT (a bare recipient name known nowhere, or name@host a known directory does not list), 401 UNAUTHORIZED, 404 NOT_FOUND (also unknown routes), 404 UNKNOWN_AGENT (an `as` with no mailbox on this host), 405 METHOD_NOT_ALLOWED, 409 CONFLICT, 413 BODY_TOO_LARGE (over 2 MiB), 415 UNSUPPORTED_MEDIA_TYPE (a body not sent as application/json), 429 RATE_LIMIT (the agent's bucket of the request's rate class is empty: `retry_after` seconds, fractional, and `Retry-After`), 500 INTERNAL, 503 STORE_BUSY, 503 TOO_MANY_WAITERS (a long poll while 256 wait already, or an event stream while 64 are open), 503 IDEMPOTENCY_FULL (an agent's idempotency records of one operation from the last 24 h are at their cap of 10,000). Each operation lists the answers it can give; the request schemas state every rule the daemon checks on the shape of a request (names, lengths, counts, enums), so a request valid by this document is refused only for the state it names (an id that names nothing this agent can see: 404 NOT_FOUND; a reader with no mailbox here: 404 UNKNOWN_AGENT; a host that is not paired: 400 UNKNOWN_HOST; a bare recipient name known nowhere, or name@host that a known directory does not list: 400 UNKNOWN_AGENT; an address that reaches nobody, a thread cursor from another thread, or an inbox, replay or catchup cursor of another agent: 400 BAD_REQUEST; a reused Idempotency-Key: 409)."),
    paths(health::get, messages::post, messages::reply, messages::get, threads::get, inbox::get, events::get, search::get, ack::post, agents::get, agents::post, sent::get, unclaimed::get, history::replay, history::catchup, history::commit, history::restart, wakes::claim, wakes::mute, wakes::unmute),
    components(schemas(AgentName, Address, MessageId, ThreadId, RefText, Kind, DeliveryState, SentState, RouteKind, Via, HealthStatus, HealthReasonCode)),
    modifiers(&BearerAuth, &ErrorResponses)
)]
pub struct ApiDoc;

/// The shared value shapes live in [`crate::vocab`], below the store and the API that both
/// name them; they are components of this document.
pub use crate::vocab::{
    Address, AgentName, DeliveryState, HealthReasonCode, HealthStatus, Kind, MessageId, RefText,
    RouteKind, SentState, ThreadId, Via,
};

/// Every `code` an error answer can carry (the `code` enum of [`super::ErrorBody`]), in the
/// order of [`super::ApiError::examples`].
pub fn error_codes() -> Vec<&'static str> {
    let mut codes: Vec<&'static str> = Vec::new();
    for e in super::ApiError::examples() {
        if !codes.contains(&e.code()) {
            codes.push(e.code());
        }
    }
    codes
}

/// The codes of [`error_codes`] as a constant list, for readers of this module; a test checks
/// it equals [`error_codes`].
pub const ERROR_CODES: [&str; 15] = [
    "UNAUTHORIZED",
    "NOT_FOUND",
    "METHOD_NOT_ALLOWED",
    "BAD_REQUEST",
    "INVALID_JSON",
    "BODY_TOO_LARGE",
    "UNSUPPORTED_MEDIA_TYPE",
    "UNKNOWN_HOST",
    "UNKNOWN_AGENT",
    "CONFLICT",
    "STORE_BUSY",
    "TOO_MANY_WAITERS",
    "RATE_LIMIT",
    "IDEMPOTENCY_FULL",
    "INTERNAL",
];

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

/// Adds to every operation the error answers that follow from how its route is built, as
/// references to shared responses (`#/components/responses/<name>`), unless the route lists
/// that status itself; and gives [`super::ErrorBody`]'s `code` its enum.
#[derive(Debug)]
struct ErrorResponses;

/// The shared error responses: component name, status, and what it means.
const SHARED: [(&str, &str, &str); 11] = [
    ("BadQuery", "400", "BAD_REQUEST: a missing, unknown or mistyped query parameter (named), or one that breaks its rule (pattern, length, range); nothing was done"),
    ("BadBody", "400", "BAD_REQUEST: a missing, unknown or mistyped field or query parameter (named), or one that breaks its rule (pattern, length, count, enum); INVALID_JSON: the body is not JSON (line and column given); nothing was done"),
    ("Unauthorized", "401", "UNAUTHORIZED: no `Authorization: Bearer <token>` header, or not the token in api.token (answered with `WWW-Authenticate: Bearer`)"),
    ("NotFound", "404", "NOT_FOUND: no such message (or thread) for this agent; nothing was done"),
    ("Conflict", "409", "CONFLICT: this Idempotency-Key was used with another request body (or another message id) by this agent; nothing was done"),
    ("BodyTooLarge", "413", "BODY_TOO_LARGE: the request body is over 2 MiB (2,097,152 bytes); it was not read"),
    ("UnsupportedMediaType", "415", "UNSUPPORTED_MEDIA_TYPE: the body was not sent with `Content-Type: application/json` (or application/<x>+json)"),
    ("Internal", "500", "INTERNAL: a fault on the daemon's side (logged there, never detailed here)"),
    ("StoreBusy", "503", "STORE_BUSY: the mailbox store is locked by another process or too busy to start the request in time; nothing was changed: retry after `Retry-After` seconds (with the same Idempotency-Key)"),
    ("StoreBusyOrFull", "503", "STORE_BUSY: the mailbox store is locked by another process or too busy to start the request in time; IDEMPOTENCY_FULL: with an Idempotency-Key, this agent already holds 10,000 idempotency records of this operation from the last 24 h (none is dropped while a client could replay it); nothing was changed: retry after `Retry-After` seconds (with the same Idempotency-Key)"),
    ("RateLimited", "429", "RATE_LIMIT: this agent's bucket of the request's rate class (wait, send, register, other; `[api_rate]` in config.toml) is empty; `retry_after` gives the seconds to the next token (fractional) and `Retry-After` the same rounded up; nothing was done"),
];

impl Modify for ErrorResponses {
    fn modify(&self, openapi: &mut utoipa::openapi::OpenApi) {
        let components = openapi.components.get_or_insert_with(Default::default);
        for (name, status, description) in SHARED {
            let mut response = ResponseBuilder::new().description(description).content(
                "application/json",
                ContentBuilder::new()
                    .schema(Some(Ref::from_schema_name("ErrorBody")))
                    .build(),
            );
            if status == "503" || status == "429" {
                let least = if status == "429" { 1 } else { 0 };
                response = response.header(
                    "Retry-After",
                    HeaderBuilder::new()
                        .schema(Some(
                            ObjectBuilder::new()
                                .schema_type(Type::Integer)
                                .minimum(Some(least)),
                        ))
                        .description(Some("seconds to wait before a retry"))
                        .build(),
                );
            }
            if status == "401" {
                response = response.header(
                    "WWW-Authenticate",
                    HeaderBuilder::new()
                        .schema(Some(ObjectBuilder::new().schema_type(Type::String)))
                        .description(Some("`Bearer`"))
                        .build(),
                );
            }
            components
                .responses
                .insert(name.to_string(), RefOr::T(response.build()));
        }
        if let Some(RefOr::T(Schema::Object(body))) = components.schemas.get_mut("ErrorBody") {
            if let Some(RefOr::T(Schema::Object(code))) = body.properties.get_mut("code") {
                code.enum_values = Some(error_codes().into_iter().map(Into::into).collect());
            }
        }
        for item in openapi.paths.paths.values_mut() {
            for op in operations(item) {
                add_common_errors(op);
            }
        }
    }
}

/// The operations of a path item.
fn operations(item: &mut PathItem) -> impl Iterator<Item = &mut Operation> {
    [
        &mut item.get,
        &mut item.put,
        &mut item.post,
        &mut item.delete,
        &mut item.options,
        &mut item.head,
        &mut item.patch,
        &mut item.trace,
    ]
    .into_iter()
    .filter_map(Option::as_mut)
}

/// The error answers of `op` that follow from its route's construction (module docs).
fn add_common_errors(op: &mut Operation) {
    let has_body = op.request_body.is_some();
    let authed = op.security.as_ref().is_some_and(|s| !s.is_empty());
    let idempotent = op.parameters.iter().flatten().any(|p| match p {
        RefOr::T(p) => p.name == "Idempotency-Key",
        RefOr::Ref(_) => false,
    });
    // An optional header is absent, never `null`: utoipa types an `Option` header as
    // string-or-null.
    for p in op.parameters.iter_mut().flatten() {
        if let RefOr::T(p) = p {
            if p.parameter_in == ParameterIn::Header {
                if let Some(RefOr::T(Schema::Object(o))) = p.schema.as_mut() {
                    o.schema_type = SchemaType::Type(Type::String);
                }
            }
        }
    }
    let mut add = |status: &str, name: &str| {
        op.responses
            .responses
            .entry(status.to_string())
            .or_insert_with(|| RefOr::Ref(Ref::new(format!("#/components/responses/{name}"))));
    };
    // Every route reads its query through ApiQuery (unknown parameters are refused).
    add("400", if has_body { "BadBody" } else { "BadQuery" });
    if has_body {
        add("413", "BodyTooLarge");
        add("415", "UnsupportedMediaType");
    }
    if authed {
        add("401", "Unauthorized");
        // Every authenticated route uses the store; health does not.
        add("500", "Internal");
        add(
            "503",
            if idempotent {
                "StoreBusyOrFull"
            } else {
                "StoreBusy"
            },
        );
        // Every authenticated request draws from a rate class (api::rate).
        add("429", "RateLimited");
    }
    if idempotent {
        add("409", "Conflict");
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
    use serde_json::Value;

    use agentmbx_protocol::limits;

    use crate::api::{ack, inbox, MAX_IDEMPOTENCY_KEY};
    use crate::mailbox::{agents, messages, receipts, search, MailboxError};
    use crate::node::{route, send};
    use crate::testutil::{self, T0};

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

    fn doc() -> Value {
        serde_json::from_str(&super::document()).expect("the document is JSON")
    }

    /// The value at JSON pointer `ptr` (paths written plainly: `/v1/inbox` is escaped here).
    fn at<'a>(doc: &'a Value, ptr: &str) -> &'a Value {
        doc.pointer(ptr)
            .unwrap_or_else(|| panic!("the document has nothing at {ptr}"))
    }

    fn schema<'a>(doc: &'a Value, name: &str) -> &'a Value {
        at(doc, &format!("/components/schemas/{name}"))
    }

    fn operation<'a>(doc: &'a Value, path: &str, method: &str) -> &'a Value {
        let escaped = path.replace('~', "~0").replace('/', "~1");
        at(doc, &format!("/paths/{escaped}/{method}"))
    }

    /// The schema of parameter `name` of an operation.
    fn param<'a>(op: &'a Value, name: &str) -> &'a Value {
        let p = op["parameters"]
            .as_array()
            .and_then(|ps| ps.iter().find(|p| p["name"] == name))
            .unwrap_or_else(|| panic!("no parameter {name} in {op}"));
        &p["schema"]
    }

    fn num(v: &Value) -> usize {
        v.as_u64().unwrap_or_else(|| panic!("not a number: {v}")) as usize
    }

    /// An ECMA-262 pattern of the document as a Rust regex (`\uXXXX` → `\x{XXXX}`), searched
    /// as JSON Schema does (unanchored unless the pattern anchors itself).
    fn regex(pattern: &Value) -> regex_automata::meta::Regex {
        let p = pattern.as_str().expect("a pattern");
        let mut out = String::new();
        let mut rest = p;
        while let Some(i) = rest.find("\\u") {
            out.push_str(&rest[..i]);
            out.push_str(&format!("\\x{{{}}}", &rest[i + 2..i + 6]));
            rest = &rest[i + 6..];
        }
        out.push_str(rest);
        regex_automata::meta::Regex::new(&out).expect("the pattern compiles")
    }

    #[test]
    fn names_follow_name_re_and_its_bounds() {
        let d = doc();
        let name = schema(&d, "AgentName");
        assert_eq!(name["pattern"], limits::NAME_RE);
        assert_eq!(num(&name["maxLength"]), limits::MAX_NAME);
        assert_eq!(num(&name["minLength"]), 2);
        let re = regex(&name["pattern"]);
        let long = "a".repeat(limits::MAX_NAME);
        let too_long = "a".repeat(limits::MAX_NAME + 1);
        for n in [
            "ab", "a", "-ab", "a-", "Ab", "a_b", "a b", "", "0-9", &long, &too_long, "ab\n", "é1",
        ] {
            assert_eq!(re.is_match(n), limits::is_name(n), "{n:?}");
        }
        // Every place that takes an agent name refers to it.
        let agent = "#/components/schemas/AgentName";
        assert_eq!(
            schema(&d, "SendRequest")["properties"]["from"]["$ref"],
            agent
        );
        assert_eq!(
            schema(&d, "ReplyRequest")["properties"]["from"]["$ref"],
            agent
        );
        assert_eq!(schema(&d, "AckRequest")["properties"]["as"]["$ref"], agent);
        assert_eq!(
            schema(&d, "RegisterRequest")["properties"]["name"]["$ref"],
            agent
        );
        for (path, method) in [
            ("/v1/inbox", "get"),
            ("/v1/sent", "get"),
            ("/v1/messages/{id}", "get"),
            ("/v1/threads/{id}", "get"),
            ("/v1/search", "get"),
            ("/v1/replay", "get"),
            ("/v1/catchup", "get"),
        ] {
            let op = operation(&d, path, method);
            assert_eq!(param(op, "as")["$ref"], agent, "{path}");
            let p = op["parameters"].as_array().unwrap();
            let as_param = p.iter().find(|p| p["name"] == "as").unwrap();
            assert_eq!(
                (as_param["in"].as_str(), as_param["required"].as_bool()),
                (Some("query"), Some(true)),
                "{path}"
            );
        }
    }

    #[test]
    fn lengths_counts_and_ranges_are_the_ones_the_code_enforces() {
        let d = doc();
        let send_req = &schema(&d, "SendRequest")["properties"];
        assert_eq!(num(&send_req["body"]["maxLength"]), limits::MAX_BODY);
        assert_eq!(num(&send_req["to"]["maxItems"]), send::MAX_LOCAL_RECIPIENTS);
        assert_eq!(num(&send_req["to"]["minItems"]), 1);
        assert_eq!(num(&send_req["refs"]["maxItems"]), send::MAX_LOCAL_REFS);
        let reply_req = &schema(&d, "ReplyRequest")["properties"];
        assert_eq!(num(&reply_req["body"]["maxLength"]), limits::MAX_BODY);
        assert_eq!(num(&reply_req["refs"]["maxItems"]), send::MAX_LOCAL_REFS);
        assert_eq!(num(&schema(&d, "RefText")["maxLength"]), limits::MAX_REF);
        assert_eq!(num(&schema(&d, "ThreadId")["maxLength"]), limits::MAX_FIELD);
        let ack_req = &schema(&d, "AckRequest")["properties"];
        assert_eq!(num(&ack_req["ids"]["maxItems"]), ack::MAX_ACK_IDS);
        assert_eq!(num(&ack_req["ids"]["minItems"]), 1);
        assert_eq!(num(&ack_req["note"]["maxLength"]), receipts::MAX_NOTE);
        let register = &schema(&d, "RegisterRequest")["properties"];
        assert_eq!(
            num(&register["description"]["maxLength"]),
            agents::MAX_DESCRIPTION
        );
        assert_eq!(num(&register["role"]["maxLength"]), limits::MAX_NAME);
        for (path, max) in [
            ("/v1/inbox", messages::MAX_INBOX_LIMIT),
            ("/v1/threads/{id}", messages::MAX_THREAD_LIMIT),
            ("/v1/search", search::MAX_SEARCH_LIMIT),
            ("/v1/sent", receipts::MAX_SENT_LIMIT),
            ("/v1/replay", crate::mailbox::history::MAX_LIMIT),
            ("/v1/catchup", crate::mailbox::history::MAX_LIMIT),
        ] {
            let limit = param(operation(&d, path, "get"), "limit");
            assert_eq!(
                (num(&limit["minimum"]), num(&limit["maximum"])),
                (1, max as usize),
                "{path}"
            );
        }
        for path in ["/v1/replay", "/v1/catchup"] {
            let op = operation(&d, path, "get");
            let bytes = param(op, "max_bytes");
            assert_eq!(
                (num(&bytes["minimum"]), num(&bytes["maximum"])),
                (
                    crate::mailbox::history::MIN_MAX_BYTES,
                    crate::mailbox::history::MAX_MAX_BYTES
                ),
                "{path}"
            );
            assert_eq!(
                num(&param(op, "cursor")["maxLength"]),
                super::super::history::MAX_CURSOR,
                "{path}"
            );
        }
        let commit = &schema(&d, "CommitRequest")["properties"];
        assert_eq!(
            num(&commit["cursor"]["maxLength"]),
            super::super::history::MAX_CURSOR
        );
        for path in [
            "/v1/messages",
            "/v1/messages/{id}/reply",
            "/v1/ack",
            "/v1/agents",
            "/v1/catchup/commit",
            "/v1/catchup/restart",
        ] {
            let key = param(operation(&d, path, "post"), "Idempotency-Key");
            assert_eq!(num(&key["maxLength"]), MAX_IDEMPOTENCY_KEY, "{path}");
            assert_eq!(key["type"], "string", "{path}: a header is never null");
        }
        let kinds: Vec<&str> = schema(&d, "Kind")["enum"]
            .as_array()
            .unwrap()
            .iter()
            .map(|k| k.as_str().unwrap())
            .collect();
        assert_eq!(kinds, agentmbx_protocol::envelope::KINDS);
        let names = |schema_name: &str| -> Vec<String> {
            serde_json::from_value(schema(&d, schema_name)["enum"].clone()).unwrap()
        };
        assert_eq!(names("DeliveryState"), ["new", "read", "acked"]);
        let sent = names("SentState");
        for state in agentmbx_protocol::records::RECEIPT_STATES {
            assert!(sent.iter().any(|s| s == state), "{state} is a sent state");
        }
        assert_eq!(
            names("HealthReasonCode"),
            [
                crate::instance::HOST_KEY_CLONE,
                crate::instance::PEER_KEY_CLONE
            ]
        );
        // Answers carry the same kinds and states the requests take.
        let kind = "#/components/schemas/Kind";
        for name in ["Message", "InboxEntry", "SentMessage"] {
            assert_eq!(
                schema(&d, name)["properties"]["kind"]["$ref"],
                kind,
                "{name}"
            );
        }
        let required = |name: &str| -> Vec<String> {
            serde_json::from_value(schema(&d, name)["required"].clone()).unwrap()
        };
        assert_eq!(required("SendRequest"), ["from", "to", "subject"]);
        assert_eq!(required("ReplyRequest"), ["from"]);
        assert_eq!(required("AckRequest"), ["as", "ids"]);
        assert_eq!(required("RegisterRequest"), ["name"]);
    }

    #[test]
    fn patterns_accept_only_what_the_daemon_accepts() {
        let d = doc();
        let s = testutil::store();
        // Addresses: a well-formed one is never refused for its form (state may still refuse
        // it: an unknown host is UNKNOWN_HOST); a malformed one never matches.
        let address = regex(&schema(&d, "Address")["pattern"]);
        for a in [
            "bob",
            "bob@home",
            "bob@work",
            "role:dev",
            "*",
            "owner",
            "Bob",
            "bob@",
            "@home",
            "role:",
            "role:D",
            "b@c@d",
            "**",
            "bob@Home",
            "a",
            "role:dev@x",
            " bob",
        ] {
            let refused_for_form = s
                .mailbox
                .with(|c| {
                    let any = route::Choices {
                        new_mailbox: true,
                        force: true,
                    };
                    Ok(matches!(
                        route::expand(c, "home", "alice", &[a.to_string(), "owner".into()], any),
                        Err(route::AddressError::Invalid(m)) if m.starts_with("bad ")
                    ))
                })
                .unwrap();
            assert_eq!(address.is_match(a), !refused_for_form, "{a:?}");
        }
        let ulid = regex(&schema(&d, "MessageId")["pattern"]);
        for id in [
            "01KDVDNA3VG2MH8KWSQRCWJZ0S",
            "01kdvdna3vg2mh8kwsqrcwjz0s",
            "01KDVDNA3VG2MH8KWSQRCWJZ0",
            "01KDVDNA3VG2MH8KWSQRCWJZ0SS",
            "01KDVDNA3VG2MH8KWSQRCWJZ0U",
        ] {
            assert_eq!(
                ulid.is_match(id),
                agentmbx_protocol::ulid::is_valid(id),
                "{id}"
            );
        }
        // Cursors: what the pattern allows is a cursor the store reads (stricter is fine).
        let inbox_op = operation(&d, "/v1/inbox", "get");
        let inbox_cursor = regex(&param(inbox_op, "cursor")["pattern"]);
        let sent_cursor = regex(&param(operation(&d, "/v1/sent", "get"), "cursor")["pattern"]);
        // Replay and catchup take the inbox's cursors.
        for path in ["/v1/replay", "/v1/catchup"] {
            assert_eq!(
                param(operation(&d, path, "get"), "cursor")["pattern"],
                param(inbox_op, "cursor")["pattern"],
                "{path}"
            );
        }
        for c in [
            "",
            "0",
            "1",
            "42",
            "999999999999999999",
            "9999999999999999999",
            "-1",
            "x",
            "1 ",
            "+1",
            "alice.0",
            "alice.42",
            "alice.999999999999999999",
            "alice.9999999999999999999",
            "alice.-1",
            "alice.",
            "alice.x",
            ".1",
        ] {
            let inbox_ok = s
                .mailbox
                .with(|conn| {
                    Ok(messages::inbox(conn, "alice", Some(c), 10, &Default::default()).is_ok())
                })
                .unwrap();
            let sent_ok = s
                .mailbox
                .with(|conn| Ok(receipts::sent_page(conn, "alice", "home", Some(c), 10).is_ok()))
                .unwrap();
            assert!(!inbox_cursor.is_match(c) || inbox_ok, "inbox cursor {c:?}");
            assert!(!sent_cursor.is_match(c) || sent_ok, "sent cursor {c:?}");
        }
        // Search: a query the document allows (length and pattern) is one the daemon reads,
        // and the other way round (characters of the Basic Multilingual Plane; outside it the
        // daemon accepts more than the pattern says); a cursor likewise.
        let search_op = operation(&d, "/v1/search", "get");
        let q = param(search_op, "q");
        assert_eq!(
            (num(&q["minLength"]), num(&q["maxLength"])),
            (search::MIN_QUERY_CHARS, search::MAX_QUERY_CHARS)
        );
        let q_re = regex(&q["pattern"]);
        let long = "é".repeat(search::MAX_QUERY_CHARS);
        let too_long = "é".repeat(search::MAX_QUERY_CHARS + 1);
        for t in [
            "ab",
            "a",
            "",
            "**",
            "a*",
            " *",
            "\"\"",
            "NEAR(",
            "()",
            "«»",
            "\u{a0}\u{a0}",
            "\u{3000}\u{3000}",
            "\u{2028}x",
            "\u{85}\u{85}",
            "\u{a1}\u{a1}",
            "\u{1680}\u{1680}",
            "\u{2000}\u{200a}",
            "\u{200b}\u{200b}",
            "\u{202f}\u{205f}",
            "\u{205e}-",
            "\u{ffff}.",
            "\u{3001}.",
            "\u{7f}\u{7f}",
            "\t\n",
            "subject:",
            "^x",
            &long,
            &too_long,
        ] {
            let n = t.chars().count();
            let documented = (search::MIN_QUERY_CHARS..=search::MAX_QUERY_CHARS).contains(&n)
                && q_re.is_match(t);
            assert_eq!(documented, search::parse_query(t).is_ok(), "q {t:?}");
        }
        let search_cursor = regex(&param(search_op, "cursor")["pattern"]);
        for c in ["", "0", "42", "9999", "10000", "-1", "x", "alice.1", "1 "] {
            assert_eq!(
                search_cursor.is_match(c),
                search::parse_cursor(Some(c)).is_ok(),
                "search cursor {c:?}"
            );
        }
        let from = regex(&param(inbox_op, "from")["pattern"]);
        for f in [
            "bob",
            "bob@home",
            "bob@x.y",
            "bob@",
            "@home",
            "Bob",
            "b@c@d",
            "bob@ho me",
            "",
        ] {
            assert_eq!(from.is_match(f), inbox::check_from(f).is_ok(), "{f:?}");
        }
        // Register: role (NAME_RE or "" to clear) and description (one line).
        let register = &schema(&d, "RegisterRequest")["properties"];
        let role = regex(&register["role"]["pattern"]);
        let description = regex(&register["description"]["pattern"]);
        let registers = |role: Option<&str>, description: Option<&str>| -> bool {
            s.mailbox
                .with(
                    |c| match agents::register(c, "home", "bob", role, description, T0) {
                        Ok(_) => Ok(true),
                        Err(MailboxError::Invalid(_)) => Ok(false),
                        Err(e) => Err(e),
                    },
                )
                .unwrap()
        };
        for r in ["", "dev", "Dev", "d", "dev ops", "-dev"] {
            assert_eq!(role.is_match(r), registers(Some(r), None), "role {r:?}");
        }
        for t in [
            "",
            "builds things",
            "two\nlines",
            "tab\there",
            "nel\u{85}",
            "ls\u{2028}",
            "del\u{7f}",
            "é ✓",
        ] {
            assert_eq!(
                description.is_match(t),
                registers(None, Some(t)),
                "description {t:?}"
            );
        }
        // Subject: not only whitespace (JavaScript's `trim()` set, U+FEFF included).
        let subject = regex(&schema(&d, "SendRequest")["properties"]["subject"]["pattern"]);
        for t in ["hi", " a ", "\u{3000}x"] {
            assert!(subject.is_match(t), "{t:?}");
        }
        for t in [" ", "\t\n", "\u{feff}", "\u{3000}\u{a0}"] {
            assert!(!subject.is_match(t), "{t:?}");
            let req: send::SendRequest = serde_json::from_value(
                serde_json::json!({"from": "alice", "to": ["owner"], "subject": t}),
            )
            .unwrap();
            let me = testutil::identity("home");
            let refused = s
                .mailbox
                .with(|c| {
                    Ok(send::send(c, &me, &req, "01KDVDNA3VG2MH8KWSQRCWJZ0S".into(), T0).is_err())
                })
                .unwrap();
            assert!(refused, "{t:?}");
        }
    }

    #[test]
    fn every_operation_documents_every_error_it_can_answer() {
        let d = doc();
        let codes: Vec<&str> = schema(&d, "ErrorBody")["properties"]["code"]["enum"]
            .as_array()
            .unwrap()
            .iter()
            .map(|c| c.as_str().unwrap())
            .collect();
        assert_eq!(codes, super::ERROR_CODES);
        assert_eq!(super::error_codes(), super::ERROR_CODES);
        let mut seen = 0;
        for (path, item) in at(&d, "/paths").as_object().unwrap() {
            for (method, op) in item.as_object().unwrap() {
                seen += 1;
                let statuses: Vec<&str> = op["responses"]
                    .as_object()
                    .unwrap()
                    .keys()
                    .map(String::as_str)
                    .collect();
                let mut want = vec!["400"];
                if path != "/v1/health" {
                    want.extend(["401", "429", "500", "503"]);
                }
                if op.get("requestBody").is_some() {
                    want.extend(["413", "415"]);
                }
                if path.contains("{id}")
                    || [
                        "/v1/ack",
                        "/v1/messages",
                        "/v1/inbox",
                        "/v1/events",
                        "/v1/search",
                        "/v1/sent",
                        "/v1/replay",
                        "/v1/catchup",
                        "/v1/catchup/commit",
                        "/v1/catchup/restart",
                    ]
                    .contains(&path.as_str())
                {
                    want.push("404");
                }
                if method == "post" {
                    want.push("409");
                }
                for status in want {
                    assert!(
                        statuses.contains(&status),
                        "{method} {path} does not document {status}: {statuses:?}"
                    );
                }
                for (status, response) in op["responses"].as_object().unwrap() {
                    if status.starts_with('2') {
                        continue;
                    }
                    let body = match response.get("$ref").and_then(Value::as_str) {
                        Some(r) => at(&d, r.trim_start_matches('#')),
                        None => response,
                    };
                    assert_eq!(
                        body["content"]["application/json"]["schema"]["$ref"],
                        "#/components/schemas/ErrorBody",
                        "{method} {path} {status}"
                    );
                    assert!(
                        body["description"].as_str().is_some_and(|t| !t.is_empty()),
                        "{method} {path} {status} has no description"
                    );
                }
            }
        }
        // Every route of api::router (a new one is listed in `paths(...)` and counted here).
        assert_eq!(seen, 20, "every route is in the document");
        assert_eq!(
            at(
                &d,
                "/components/responses/StoreBusy/headers/Retry-After/schema/type"
            ),
            "integer"
        );
        assert_eq!(
            at(
                &d,
                "/components/responses/RateLimited/headers/Retry-After/schema/minimum"
            ),
            1
        );
        // An idempotent route's 503 names IDEMPOTENCY_FULL.
        assert_eq!(
            at(&d, "/paths/~1v1~1messages/post/responses/503/$ref"),
            "#/components/responses/StoreBusyOrFull"
        );
    }
}
