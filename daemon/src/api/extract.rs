//! The local API's request extractors: [`ApiJson`] (a JSON body) and [`ApiQuery`] (a query
//! string). Every route reads its body and query through them, so a malformed request is always
//! answered `{error, code}` in our own words, never with a library's text:
//!
//! - a body over [`MAX_REQUEST_BODY`] bytes: 413 `BODY_TOO_LARGE`;
//! - a body without `Content-Type: application/json` (or `application/*+json`): 415
//!   `UNSUPPORTED_MEDIA_TYPE`;
//! - a body that is not JSON: 400 `INVALID_JSON` with the line and column;
//! - a missing, unknown or mistyped field or query parameter: 400 `BAD_REQUEST` naming it (request
//!   bodies and query structs are `deny_unknown_fields`; a route without a query takes
//!   [`NoQuery`], so any parameter given to it is refused).

use axum::body::Bytes;
use axum::extract::{FromRequest, FromRequestParts, Request};
use axum::http::header;
use axum::http::request::Parts;
use serde::de::DeserializeOwned;
use serde::Deserialize;

use super::ApiError;

/// Largest request body the local API reads (bytes): 2 MiB, room for a 256 KiB message body even
/// with every character `\u`-escaped. A larger one is 413 `BODY_TOO_LARGE`, unread.
pub const MAX_REQUEST_BODY: usize = 2 * 1024 * 1024;

/// A JSON request body of type `T` and its raw bytes (the idempotency hash covers the bytes as
/// sent). Rejections: see the module documentation.
#[derive(Debug)]
pub struct ApiJson<T> {
    /// The parsed body.
    pub value: T,
    /// The body as received.
    pub raw: Bytes,
}

impl<T, S> FromRequest<S> for ApiJson<T>
where
    T: DeserializeOwned,
    S: Send + Sync,
{
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &S) -> Result<Self, ApiError> {
        if !is_json(req.headers().get(header::CONTENT_TYPE)) {
            return Err(ApiError::UnsupportedMediaType(
                "the request body must be JSON, sent with Content-Type: application/json".into(),
            ));
        }
        let raw = Bytes::from_request(req, state).await.map_err(|e| {
            if e.status() == axum::http::StatusCode::PAYLOAD_TOO_LARGE {
                ApiError::BodyTooLarge(format!(
                    "the request body is over the limit of {MAX_REQUEST_BODY} bytes"
                ))
            } else {
                ApiError::Invalid("the request body could not be read in full".into())
            }
        })?;
        let value = parse_json(&raw)?;
        Ok(ApiJson { value, raw })
    }
}

/// Whether a `Content-Type` value names JSON: `application/json` or `application/<x>+json`, any
/// parameters (such as `charset=utf-8`) allowed, case-insensitive.
fn is_json(value: Option<&axum::http::HeaderValue>) -> bool {
    let Some(text) = value.and_then(|v| v.to_str().ok()) else {
        return false;
    };
    let essence = text
        .split(';')
        .next()
        .unwrap_or("")
        .trim()
        .to_ascii_lowercase();
    essence == "application/json"
        || (essence.starts_with("application/") && essence.ends_with("+json"))
}

/// Parses a JSON body as `T`, with errors in our words (module documentation).
pub fn parse_json<T: DeserializeOwned>(raw: &[u8]) -> Result<T, ApiError> {
    if raw.iter().all(u8::is_ascii_whitespace) {
        return Err(ApiError::InvalidJson(
            "the request body is empty: expected a JSON object".into(),
        ));
    }
    let mut de = serde_json::Deserializer::from_slice(raw);
    let parsed = serde_path_to_error::deserialize(&mut de)
        .map_err(|e| (e.path().to_string(), e.into_inner()))
        .and_then(|v: T| de.end().map(|()| v).map_err(|e| (".".to_string(), e)));
    parsed.map_err(|(path, inner)| {
        let at = format!("line {} column {}", inner.line(), inner.column());
        match inner.classify() {
            serde_json::error::Category::Syntax => ApiError::InvalidJson(format!(
                "the request body is not valid JSON at {at}: {}",
                without_position(&inner)
            )),
            serde_json::error::Category::Eof => ApiError::InvalidJson(format!(
                "the request body is not valid JSON: it ends at {at} before the value is complete"
            )),
            serde_json::error::Category::Io => {
                ApiError::Invalid("the request body could not be read in full".into())
            }
            serde_json::error::Category::Data => {
                ApiError::Invalid(in_our_words(Noun::Field, &path, &without_position(&inner)))
            }
        }
    })
}

/// A serde_json error's message without its ` at line L column C` suffix.
fn without_position(e: &serde_json::Error) -> String {
    let text = e.to_string();
    let suffix = format!(" at line {} column {}", e.line(), e.column());
    text.strip_suffix(&suffix).unwrap_or(&text).to_string()
}

/// A query string of type `T` (a `deny_unknown_fields` struct). An absent query parses as
/// empty. Rejections: 400 `BAD_REQUEST` naming the missing, unknown or mistyped parameter.
#[derive(Debug)]
pub struct ApiQuery<T>(pub T);

impl<T, S> FromRequestParts<S> for ApiQuery<T>
where
    T: DeserializeOwned,
    S: Send + Sync,
{
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, _state: &S) -> Result<Self, ApiError> {
        parse_query(parts.uri.query().unwrap_or("")).map(ApiQuery)
    }
}

/// Parses a query string as `T`, with errors in our words.
pub fn parse_query<T: DeserializeOwned>(query: &str) -> Result<T, ApiError> {
    let de = serde_urlencoded::Deserializer::new(form_urlencoded::parse(query.as_bytes()));
    serde_path_to_error::deserialize(de).map_err(|e| {
        let path = e.path().to_string();
        ApiError::Invalid(in_our_words(
            Noun::Param,
            &path,
            &e.into_inner().to_string(),
        ))
    })
}

/// The query of a route that takes none: any parameter is refused (400 naming it).
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NoQuery {}

/// What a message is about: a body's field or a query parameter.
#[derive(Debug, Clone, Copy)]
enum Noun {
    Field,
    Param,
}

impl Noun {
    fn name(self) -> &'static str {
        match self {
            Noun::Field => "body field",
            Noun::Param => "query parameter",
        }
    }
}

/// Rewrites one of serde's data-error messages (`msg`, at `path`: `.` for the top level) in our
/// words, naming the field or parameter. Forms serde does not document fall back to the path
/// and the message.
fn in_our_words(noun: Noun, path: &str, msg: &str) -> String {
    let n = noun.name();
    let at = |p: &str| -> String {
        if p == "." || p.is_empty() {
            match noun {
                Noun::Field => "the request body".to_string(),
                Noun::Param => "the query string".to_string(),
            }
        } else {
            format!("{n} `{p}`")
        }
    };
    if let Some(rest) = msg.strip_prefix("missing field `") {
        let name = rest.split('`').next().unwrap_or("");
        return format!("missing {n} `{}`", joined(path, name));
    }
    if let Some(rest) = msg.strip_prefix("unknown field `") {
        let (name, known) = rest.split_once('`').unwrap_or((rest, ""));
        let accepted = names_after_expected(known);
        let base = format!("unknown {n} `{name}`");
        return match accepted {
            Some(list) if !list.is_empty() => format!("{base}; accepted: {list}"),
            _ => format!("{base}; this route takes none"),
        };
    }
    if let Some(rest) = msg.strip_prefix("duplicate field `") {
        let name = rest.split('`').next().unwrap_or("");
        return format!("{n} `{}` is given more than once", joined(path, name));
    }
    if let Some(rest) = msg.strip_prefix("unknown variant `") {
        let (value, known) = rest.split_once('`').unwrap_or((rest, ""));
        let accepted = names_after_expected(known).unwrap_or_default();
        return format!("{}: `{value}` is not one of: {accepted}", at(path));
    }
    for prefix in ["invalid type: ", "invalid value: "] {
        if let Some(rest) = msg.strip_prefix(prefix) {
            if let Some((got, want)) = rest.rsplit_once(", expected ") {
                return format!("{} must be {}, not {got}", at(path), plain_type(want));
            }
        }
    }
    if let Some(rest) = msg.strip_prefix("invalid length ") {
        if let Some((got, want)) = rest.split_once(", expected ") {
            return format!("{} must hold {want}, not {got}", at(path));
        }
    }
    // Scalar parse failures of query values ("invalid digit found in string", …).
    format!("{} has a value that does not fit: {msg}", at(path))
}

/// `parent.name`, or `name` at the top level.
fn joined(path: &str, name: &str) -> String {
    if path == "." || path.is_empty() {
        name.to_string()
    } else {
        format!("{path}.{name}")
    }
}

/// The names in serde's `, expected one of `a`, `b`` / `, expected `a`` tail, comma-separated;
/// `None` when there is no list (`, there are no fields`).
fn names_after_expected(tail: &str) -> Option<String> {
    let list = tail
        .strip_prefix(", expected one of ")
        .or_else(|| tail.strip_prefix(", expected "))?;
    // serde writes `a`, `a` or `b`, or `a`, `b`, `c`: the names are the backquoted parts.
    Some(
        list.split('`')
            .skip(1)
            .step_by(2)
            .collect::<Vec<_>>()
            .join(", "),
    )
}

/// serde's expectation in plain words: `struct X` and `a map` are a JSON object.
fn plain_type(want: &str) -> String {
    if want.starts_with("struct ") || want == "a map" {
        "a JSON object".into()
    } else if want == "a sequence" {
        "a JSON array".into()
    } else {
        want.to_string()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, Deserialize)]
    #[serde(deny_unknown_fields)]
    #[allow(dead_code)]
    struct Q {
        #[serde(rename = "as")]
        as_agent: String,
        limit: Option<u32>,
    }

    fn text(e: ApiError) -> (u16, &'static str, String) {
        (e.status().as_u16(), e.code(), e.to_string())
    }

    #[test]
    fn query_errors_name_the_parameter() {
        assert_eq!(
            text(parse_query::<Q>("").unwrap_err()),
            (
                400,
                "BAD_REQUEST",
                "missing query parameter `as`".to_string()
            )
        );
        let (_, _, t) = text(parse_query::<Q>("as=a&colour=red").unwrap_err());
        assert_eq!(t, "unknown query parameter `colour`; accepted: as, limit");
        let (_, _, t) = text(parse_query::<Q>("as=a&limit=x").unwrap_err());
        assert!(t.starts_with("query parameter `limit`"), "{t}");
        let (_, _, t) = text(parse_query::<NoQuery>("x=1").unwrap_err());
        assert_eq!(t, "unknown query parameter `x`; this route takes none");
        assert!(parse_query::<NoQuery>("").is_ok());
    }

    #[test]
    fn body_errors_are_in_our_words() {
        let cases: [(&str, u16, &str, &str); 6] = [
            ("", 400, "INVALID_JSON", "empty"),
            ("{\"as\": ", 400, "INVALID_JSON", "line 1 column 7"),
            ("{\"as\" 1}", 400, "INVALID_JSON", "line 1 column 7"),
            ("{}", 400, "BAD_REQUEST", "missing body field `as`"),
            (
                "{\"as\":\"a\",\"x\":1}",
                400,
                "BAD_REQUEST",
                "unknown body field `x`; accepted: as, limit",
            ),
            (
                "{\"as\":\"a\",\"limit\":\"x\"}",
                400,
                "BAD_REQUEST",
                "body field `limit` must be u32, not string \"x\"",
            ),
        ];
        for (body, status, code, needle) in cases {
            let (s, c, t) = text(parse_json::<Q>(body.as_bytes()).unwrap_err());
            assert_eq!((s, c), (status, code), "{body}: {t}");
            assert!(t.contains(needle), "{body}: {t}");
        }
        let (_, _, t) = text(parse_json::<Q>(b"\"x\"").unwrap_err());
        assert_eq!(
            t,
            "the request body must be a JSON object, not string \"x\""
        );
        let (_, c, _) = text(parse_json::<Q>(b"{\"as\":\"a\"} x").unwrap_err());
        assert_eq!(c, "INVALID_JSON");
    }

    #[test]
    fn json_content_types() {
        let v = |s: &'static str| Some(axum::http::HeaderValue::from_static(s));
        assert!(is_json(v("application/json").as_ref()));
        assert!(is_json(v("Application/JSON; charset=utf-8").as_ref()));
        assert!(is_json(v("application/merge-patch+json").as_ref()));
        assert!(!is_json(v("text/plain").as_ref()));
        assert!(!is_json(None));
    }
}
