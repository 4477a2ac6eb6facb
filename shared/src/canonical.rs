//! Canonical JSON, exactly as 0.5.x computes it for every signed payload (`wire.md` §2.2,
//! Decision 1).
//!
//! Rules: object keys sorted by UTF-16 code units (JavaScript's default sort, not Rust's
//! code-point order: an astral key sorts before U+E000…U+FFFF keys), no whitespace, `null` kept
//! (absent keys simply are not in the map), strings escaped as `JSON.stringify` does (`\"`,
//! `\\`, `\b \f \n \r \t`, other U+0000–U+001F as lowercase `\u00xx`, everything else literal,
//! `/` unescaped), numbers as IEEE doubles printed by ECMAScript `Number#toString`.
//!
//! Received JSON is parsed with [`parse`]: a number that overflows to Infinity is refused, a
//! repeated key keeps its last value, a lone-surrogate escape is refused (`wire.md` "Resolved
//! details").

use serde_json::Value;

/// A value that has no canonical form, or text that is not JSON we accept.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CanonicalError {
    /// A number is not finite (JavaScript's `JSON.stringify` would print `null`; 0.5.x throws).
    #[error("number is not finite")]
    NonFinite,
    /// The text is not valid JSON (or holds a lone surrogate, or a number out of range).
    #[error("invalid JSON: {0}")]
    Parse(String),
}

/// Parses JSON text as 0.5.x's `JSON.parse` would see it, within what a Rust `String` can hold.
/// Errors: [`CanonicalError::Parse`] (including numbers that overflow to Infinity).
pub fn parse(bytes: &[u8]) -> Result<Value, CanonicalError> {
    serde_json::from_slice(bytes).map_err(|e| CanonicalError::Parse(e.to_string()))
}

/// `canonical(value)`: the exact UTF-8 text 0.5.x signs. Errors: [`CanonicalError::NonFinite`].
pub fn to_string(value: &Value) -> Result<String, CanonicalError> {
    let mut out = String::new();
    write_value(&mut out, value)?;
    Ok(out)
}

/// Serializes any serde value, then canonicalizes it.
pub fn of<T: serde::Serialize>(value: &T) -> Result<String, CanonicalError> {
    let v = serde_json::to_value(value).map_err(|e| CanonicalError::Parse(e.to_string()))?;
    to_string(&v)
}

fn write_value(out: &mut String, value: &Value) -> Result<(), CanonicalError> {
    match value {
        Value::Null => out.push_str("null"),
        Value::Bool(b) => out.push_str(if *b { "true" } else { "false" }),
        Value::Number(n) => write_number(out, n)?,
        Value::String(s) => write_string(out, s),
        Value::Array(items) => {
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                write_value(out, item)?;
            }
            out.push(']');
        }
        Value::Object(map) => {
            let mut keys: Vec<&String> = map.keys().collect();
            keys.sort_by(|a, b| a.encode_utf16().cmp(b.encode_utf16()));
            out.push('{');
            for (i, key) in keys.into_iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                write_string(out, key);
                out.push(':');
                write_value(out, &map[key])?;
            }
            out.push('}');
        }
    }
    Ok(())
}

/// ECMAScript `Number#toString` of the IEEE double the number denotes.
fn write_number(out: &mut String, n: &serde_json::Number) -> Result<(), CanonicalError> {
    let f = match (n.as_i64(), n.as_u64(), n.as_f64()) {
        (Some(i), _, _) => i as f64,
        (None, Some(u), _) => u as f64,
        (_, _, Some(f)) => f,
        _ => return Err(CanonicalError::NonFinite),
    };
    if !f.is_finite() {
        return Err(CanonicalError::NonFinite);
    }
    let mut buf = ryu_js::Buffer::new();
    out.push_str(buf.format_finite(f));
    Ok(())
}

/// An integer as `JSON.stringify` writes the IEEE double it becomes (exact up to 2^53; beyond,
/// the nearest double in ECMAScript's `Number#toString` form), as [`to_string`] writes a JSON
/// integer.
pub fn write_integer(out: &mut String, n: i64) {
    let mut buf = ryu_js::Buffer::new();
    out.push_str(buf.format_finite(n as f64));
}

/// A JSON string literal as `JSON.stringify` writes it. Runs of characters that need no escape
/// are copied whole: only `"`, `\\` and U+0000–U+001F (all ASCII, so byte positions are
/// character boundaries) are escaped.
pub fn write_string(out: &mut String, s: &str) {
    out.reserve(s.len() + 2);
    out.push('"');
    let bytes = s.as_bytes();
    let mut start = 0;
    let mut i = 0;
    while i < bytes.len() {
        // Skip the run of bytes that need no escape (the common case: a whole base64 wire).
        while i < bytes.len() && !NEEDS_ESCAPE[usize::from(bytes[i])] {
            i += 1;
        }
        let Some(&b) = bytes.get(i) else { break };
        out.push_str(&s[start..i]);
        match b {
            b'"' => out.push_str("\\\""),
            b'\\' => out.push_str("\\\\"),
            0x08 => out.push_str("\\b"),
            0x0c => out.push_str("\\f"),
            b'\n' => out.push_str("\\n"),
            b'\r' => out.push_str("\\r"),
            b'\t' => out.push_str("\\t"),
            _ => out.push_str(&format!("\\u{b:04x}")),
        }
        i += 1;
        start = i;
    }
    out.push_str(&s[start..]);
    out.push('"');
}

/// The bytes [`write_string`] escapes: `"`, `\\` and U+0000–U+001F.
const NEEDS_ESCAPE: [bool; 256] = {
    let mut t = [false; 256];
    let mut b = 0;
    while b < 0x20 {
        t[b] = true;
        b += 1;
    }
    t[b'"' as usize] = true;
    t[b'\\' as usize] = true;
    t
};

#[cfg(test)]
mod tests {
    use super::*;

    fn canon(text: &str) -> String {
        to_string(&parse(text.as_bytes()).unwrap()).unwrap()
    }

    #[test]
    fn strings_escape_as_json_stringify() {
        // serde_json escapes exactly as `JSON.stringify` for any Rust string: `\"`, `\\`,
        // the five short forms, other C0 controls as lowercase `\u00xx`, all else literal.
        let mut all: String = (0u32..0x80).filter_map(char::from_u32).collect();
        all.push_str("é€😀\u{2028}\u{7f}/\\\"end");
        for s in [
            all.as_str(),
            "",
            "plain",
            "\u{1}",
            "a\"b\\c\nd",
            "😀\u{1f}😀",
        ] {
            let mut out = String::new();
            write_string(&mut out, s);
            assert_eq!(out, serde_json::to_string(s).unwrap(), "{s:?}");
        }
    }

    #[test]
    fn js_numbers_and_escapes() {
        assert_eq!(
            canon("[1.0,1e21,1e-7,-0,9007199254740993,0.000001]"),
            "[1,1e+21,1e-7,0,9007199254740992,0.000001]"
        );
        assert_eq!(
            canon(r#""\u0001\u007f/\u2028""#),
            "\"\\u0001\u{7f}/\u{2028}\""
        );
        assert_eq!(canon(r#"{"a":1,"a":2}"#), r#"{"a":2}"#);
        assert!(parse(b"1e400").is_err());
        assert!(parse(br#""\ud800""#).is_err());
    }

    #[test]
    fn utf16_key_order() {
        let v = parse("{\"\u{e000}\":1,\"\u{1f600}\":2}".as_bytes()).unwrap();
        assert_eq!(to_string(&v).unwrap(), "{\"\u{1f600}\":2,\"\u{e000}\":1}");
    }
}
