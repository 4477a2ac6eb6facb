//! Envelope v3 (`wire.md` §2.3): build, shape check, signature, and the 0.5.x wire bytes.
//!
//! Two views of an envelope exist on purpose. [`Envelope`] is the typed form a sender builds;
//! its `serde` field order is 0.5.x's (v, id, ts, from, to, thread, reply_to, kind, subject,
//! body, needs_reply, refs, meta, authority, enc, sig), so [`Envelope::wire_json`] equals
//! `JSON.stringify(envelope)` byte for byte. A *received* envelope is checked and verified as a
//! `serde_json::Value` ([`check_shape`], [`verify`]), so fields this version does not know are
//! signed data that is neither lost nor reordered.
//!
//! Signed bytes = canonical(envelope without `sig`, with `body` replaced by `enc.body` when `enc`
//! is set): the stored plaintext copy and the sealed wire copy verify identically.

use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::canonical::{self, CanonicalError};
use crate::keys::{HostKey, PublicKey};
use crate::limits::{self, utf16_len};

/// The `enc.alg` value (`wire.md` §2.4; sealing is in [`crate::seal`]).
pub const ENC_ALG: &str = "x25519+xchacha20poly1305";

/// The envelope `enc` object (field order is 0.5.x's: v, alg, epk, nonce, body).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Enc {
    /// Always 1.
    pub v: u8,
    /// Always [`ENC_ALG`].
    pub alg: String,
    /// Ephemeral X25519 public key, base64 (32 bytes).
    pub epk: String,
    /// XChaCha20 nonce, base64 (24 bytes).
    pub nonce: String,
    /// Ciphertext ‖ 16-byte tag, base64.
    pub body: String,
}

/// Envelope kinds (`wire.md` §2.3).
pub const KINDS: [&str; 7] = [
    "message", "request", "reply", "status", "decision", "alert", "task",
];

/// Body metadata parsed at send time; signed data for receivers.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Meta {
    /// `@name[@host]` mentions, lowercased.
    pub mentions: Vec<String>,
    /// `/claim|done|blocked|approve|decision|checkin` directives.
    pub directives: Vec<String>,
    /// `#tag`s, lowercased.
    pub tags: Vec<String>,
    /// `T\d{2,6}` task references.
    pub task_refs: Vec<String>,
    /// `"external"` when the content came from outside (only `external` is written).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub origin: Option<String>,
    /// Agent-to-agent relay depth, 0..=1000 saturating.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hop: Option<u64>,
    /// The sender's project root (≤300).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub project: Option<String>,
    /// The project's normalised git origin (≤300).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub project_key: Option<String>,
    /// Bare names the sender already delivered locally (≤100).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub local_names: Option<Vec<String>>,
    /// `leased|unverified`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sender_verification: Option<String>,
}

/// `sig = {alg:"ed25519", host, key: fingerprint(host pub), value}`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct EnvelopeSig {
    /// Always `"ed25519"`.
    pub alg: String,
    /// The sender's host name.
    pub host: String,
    /// Fingerprint of the sender's host key.
    pub key: String,
    /// Base64 Ed25519 signature over the signed bytes.
    pub value: String,
}

/// A typed envelope v3 in 0.5.x field order (the order is the wire format: do not reorder).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Envelope {
    /// Always 3.
    pub v: u8,
    /// ULID.
    pub id: String,
    /// ISO ms timestamp.
    pub ts: String,
    /// `name@host`.
    pub from: String,
    /// Recipients as addressed.
    pub to: Vec<String>,
    /// Thread id (defaults to own id).
    pub thread: String,
    /// Message replied to, or null.
    pub reply_to: Option<String>,
    /// One of [`KINDS`].
    pub kind: String,
    /// One line, ≤200 UTF-16 units.
    pub subject: String,
    /// Plain body, or the base64 ciphertext when sealed.
    pub body: String,
    /// Whether a reply is expected.
    pub needs_reply: bool,
    /// References.
    pub refs: Vec<String>,
    /// Parsed body metadata.
    pub meta: Meta,
    /// Owner authority (null unless an issue brings it in).
    pub authority: Option<Value>,
    /// Sealing, or null for a plaintext (local) envelope.
    pub enc: Option<Enc>,
    /// The host signature; absent before signing.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sig: Option<EnvelopeSig>,
}

/// What an agent asks to send; [`build`] turns it into an unsigned envelope.
#[derive(Debug, Clone, Default)]
pub struct Draft {
    /// `name@host` of the sending agent.
    pub from: String,
    /// Recipients, at least one.
    pub to: Vec<String>,
    /// Subject (control characters become spaces, cut at 200 UTF-16 units).
    pub subject: String,
    /// Body, ≤ [`limits::MAX_BODY`] UTF-8 bytes.
    pub body: String,
    /// Kind; default `message`.
    pub kind: Option<String>,
    /// Thread; default the new id.
    pub thread: Option<String>,
    /// Message replied to.
    pub reply_to: Option<String>,
    /// Whether a reply is expected.
    pub needs_reply: bool,
    /// References.
    pub refs: Vec<String>,
}

/// A draft that cannot become an envelope. Messages are 0.5.x's `buildEnvelope` texts.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum BuildError {
    /// Empty subject, or one of JavaScript whitespace only.
    #[error("subject is required")]
    SubjectRequired,
    /// Body over 256 KiB.
    #[error("body is over 256 KB; put large content in refs")]
    BodyTooLarge,
    /// No recipient.
    #[error("at least one recipient is required")]
    NoRecipient,
    /// The result would fail the shape check (e.g. a bad kind).
    #[error("{0}")]
    Shape(String),
}

fn is_control(c: char) -> bool {
    matches!(
        c,
        '\u{0}'..='\u{1f}' | '\u{7f}' | '\u{85}' | '\u{2028}' | '\u{2029}'
    )
}

/// 0.5.x `oneLine`: control characters become spaces.
pub fn one_line(s: &str) -> String {
    s.chars()
        .map(|c| if is_control(c) { ' ' } else { c })
        .collect()
}

/// Cuts `s` to at most `max` UTF-16 code units without splitting a surrogate pair
/// (JavaScript `slice` would leave a lone surrogate; we drop the half character instead).
pub fn truncate_utf16(s: &str, max: usize) -> String {
    let mut units = 0;
    let mut out = String::new();
    for c in s.chars() {
        units += c.len_utf16();
        if units > max {
            break;
        }
        out.push(c);
    }
    out
}

/// Builds an unsigned, unsealed envelope (0.5.x `buildEnvelope`). `id` is a fresh ULID and
/// `now_ms` the send time. Errors: [`BuildError`].
pub fn build(d: &Draft, id: String, now_ms: i64) -> Result<Envelope, BuildError> {
    // JavaScript `trim()` whitespace (U+FEFF counts, U+0085 does not), as 0.5.x's check.
    if d.subject.chars().all(js_space) {
        return Err(BuildError::SubjectRequired);
    }
    if d.body.len() > limits::MAX_BODY {
        return Err(BuildError::BodyTooLarge);
    }
    if d.to.is_empty() {
        return Err(BuildError::NoRecipient);
    }
    let env = Envelope {
        v: 3,
        thread: d.thread.clone().unwrap_or_else(|| id.clone()),
        id,
        ts: crate::time::iso_ms(now_ms),
        from: d.from.clone(),
        to: d.to.clone(),
        reply_to: d.reply_to.clone(),
        kind: d.kind.clone().unwrap_or_else(|| "message".into()),
        subject: truncate_utf16(&one_line(&d.subject), limits::MAX_SUBJECT),
        body: d.body.clone(),
        needs_reply: d.needs_reply,
        refs: d.refs.clone(),
        meta: parse_meta(&d.body),
        authority: None,
        enc: None,
        sig: None,
    };
    check_shape(&env.to_value()).map_err(BuildError::Shape)?;
    Ok(env)
}

impl Envelope {
    /// The envelope as a JSON value (field order kept by `to_string`, not by the map).
    pub fn to_value(&self) -> Value {
        serde_json::to_value(self).unwrap_or(Value::Null)
    }

    /// `JSON.stringify(envelope)` in 0.5.x field order: the wire bytes a sender persists and
    /// pushes (`wire.md` §2.3, Decision 4). Never canonical.
    pub fn wire_json(&self) -> String {
        serde_json::to_string(self).unwrap_or_default()
    }

    /// Signs with the host key: sets `sig = {alg, host, key: fingerprint, value}`.
    pub fn sign(&mut self, host: &str, key: &HostKey) -> Result<(), CanonicalError> {
        self.sig = None;
        let signed = signed_string(&self.to_value())?;
        self.sig = Some(EnvelopeSig {
            alg: "ed25519".into(),
            host: host.into(),
            key: key.public().fingerprint(),
            value: key.sign(signed.as_bytes()),
        });
        Ok(())
    }
}

/// The exact string the host key signs: canonical(envelope minus `sig`, `body` := `enc.body`
/// when `enc` is an object). Errors: the envelope cannot be canonicalized.
pub fn signed_string(envelope: &Value) -> Result<String, CanonicalError> {
    let mut v = envelope.clone();
    if let Value::Object(map) = &mut v {
        map.remove("sig");
        let enc_body = map.get("enc").and_then(|e| e.get("body")).cloned();
        if let (Some(Value::Object(_)), Some(b)) = (map.get("enc"), enc_body) {
            map.insert("body".into(), b);
        }
    }
    canonical::to_string(&v)
}

/// Verifies the host signature of a received envelope against `host_key`: `sig.alg` is
/// ed25519, `sig.key` is the key's fingerprint and `sig.value` verifies. Never panics.
pub fn verify(envelope: &Value, host_key: &PublicKey) -> bool {
    let Some(sig) = envelope.get("sig") else {
        return false;
    };
    let (Some("ed25519"), Some(fp), Some(value)) = (
        sig.get("alg").and_then(Value::as_str),
        sig.get("key").and_then(Value::as_str),
        sig.get("value").and_then(Value::as_str),
    ) else {
        return false;
    };
    if fp != host_key.fingerprint() {
        return false;
    }
    match signed_string(envelope) {
        Ok(s) => host_key.verify(s.as_bytes(), value),
        Err(_) => false,
    }
}

fn str_field<'a>(e: &'a Value, k: &str) -> Option<&'a str> {
    e.get(k).and_then(Value::as_str)
}

fn string_array(v: Option<&Value>) -> Option<Vec<&str>> {
    v?.as_array()?.iter().map(Value::as_str).collect()
}

fn b64_len_is(v: Option<&Value>, n: usize) -> bool {
    v.and_then(Value::as_str)
        .and_then(|s| crate::b64::decode(s).ok())
        .is_some_and(|b| b.len() == n)
}

fn check_enc(enc: &Value) -> Option<String> {
    if !enc.is_object() {
        return Some("bad enc".into());
    }
    if enc.get("v").and_then(Value::as_f64) != Some(1.0) {
        return Some("unsupported enc version".into());
    }
    if str_field(enc, "alg") != Some(ENC_ALG) {
        return Some("unsupported enc algorithm".into());
    }
    if !b64_len_is(enc.get("epk"), 32) {
        return Some("bad enc epk".into());
    }
    if !b64_len_is(enc.get("nonce"), 24) {
        return Some("bad enc nonce".into());
    }
    match str_field(enc, "body") {
        Some(b) if !b.is_empty() => None,
        _ => Some("bad enc body".into()),
    }
}

fn ts_parses(ts: &str) -> bool {
    crate::time::parse_iso_ms(ts).is_some()
        || ::time::OffsetDateTime::parse(ts, &::time::format_description::well_known::Rfc3339)
            .is_ok()
}

/// Structural validation of anything claiming to be an envelope (0.5.x `checkShape`), in 0.5.x's
/// order and with its exact refusal texts (`wire.md` §2.3). `Ok(())` or the first failure.
pub fn check_shape(e: &Value) -> Result<(), String> {
    check_shape_inner(e).map_or(Ok(()), Err)
}

fn check_shape_inner(e: &Value) -> Option<String> {
    use crate::limits::*;
    let Some(_) = e.as_object() else {
        return Some("not an object".into());
    };
    if e.get("v").and_then(Value::as_f64) != Some(3.0) {
        return Some("unsupported version".into());
    }
    if !str_field(e, "id").is_some_and(crate::ulid::is_valid) {
        return Some("bad id".into());
    }
    let Some(from) = str_field(e, "from").filter(|f| f.contains('@')) else {
        return Some("bad from".into());
    };
    if utf16_len(from) > MAX_FIELD {
        return Some(format!("from over {MAX_FIELD} characters"));
    }
    let Some(to) = string_array(e.get("to")).filter(|t| !t.is_empty()) else {
        return Some("bad to".into());
    };
    if to.len() > MAX_RECIPIENTS {
        return Some(format!("more than {MAX_RECIPIENTS} recipients"));
    }
    if to.iter().any(|t| utf16_len(t) > MAX_FIELD) {
        return Some(format!("recipient over {MAX_FIELD} characters"));
    }
    if !str_field(e, "kind").is_some_and(|k| KINDS.contains(&k)) {
        return Some("bad kind".into());
    }
    let Some(enc) = e.get("enc") else {
        return Some("bad enc".into());
    };
    let Some(body) = str_field(e, "body") else {
        return Some("bad body".into());
    };
    let max_body = if enc.is_null() {
        MAX_BODY
    } else {
        MAX_SEALED_BODY
    };
    if body.len() > max_body {
        return Some(format!("body over {max_body} bytes"));
    }
    let Some(subject) = str_field(e, "subject") else {
        return Some("bad subject".into());
    };
    if utf16_len(subject) > MAX_SUBJECT {
        return Some(format!("subject over {MAX_SUBJECT} characters"));
    }
    if subject.chars().any(is_control) {
        return Some("subject contains control characters".into());
    }
    if !str_field(e, "ts").is_some_and(ts_parses) {
        return Some("bad ts".into());
    }
    if str_field(e, "thread").is_none_or(|t| utf16_len(t) > MAX_FIELD) {
        return Some("bad thread".into());
    }
    match e.get("reply_to") {
        Some(Value::Null) => {}
        Some(Value::String(r)) if utf16_len(r) <= MAX_FIELD => {}
        _ => return Some("bad reply_to".into()),
    }
    if !e.get("needs_reply").is_some_and(Value::is_boolean) {
        return Some("bad needs_reply".into());
    }
    let Some(refs) = string_array(e.get("refs")) else {
        return Some("bad refs".into());
    };
    if refs.len() > MAX_REFS || refs.iter().any(|r| utf16_len(r) > MAX_REF) {
        return Some(format!(
            "more than {MAX_REFS} refs or a ref over {MAX_REF} characters"
        ));
    }
    if !enc.is_null() {
        if let Some(bad) = check_enc(enc) {
            return Some(bad);
        }
        if str_field(enc, "body").map_or(0, str::len) > MAX_SEALED_BODY {
            return Some(format!("sealed body over {MAX_SEALED_BODY} bytes"));
        }
    }
    if let Some(bad) = check_authority(e.get("authority")) {
        return Some(bad);
    }
    check_meta(e.get("meta"))
}

fn check_authority(a: Option<&Value>) -> Option<String> {
    let a = match a {
        Some(Value::Null) => return None,
        Some(Value::Object(a)) => a,
        _ => return Some("bad authority".into()),
    };
    if a.contains_key("owner_sig") {
        let ok = a.get("owner_sig").is_some_and(Value::is_string)
            && a.get("owner_fp").is_some_and(Value::is_string)
            && !a.contains_key("grant")
            && !a.contains_key("session_sig");
        return (!ok).then(|| "bad owner authority".into());
    }
    let grant = a.get("grant").and_then(Value::as_object);
    let ok = grant.is_some_and(|g| g.get("v").and_then(Value::as_f64) == Some(2.0))
        && a.get("session_sig").is_some_and(Value::is_string)
        && !a.contains_key("owner_fp");
    let Some(g) = grant.filter(|_| ok) else {
        return Some("bad grant authority".into());
    };
    for field in [
        "id", "iss", "sub", "agent", "host", "iat", "exp", "nonce", "sig",
    ] {
        if !g.get(field).is_some_and(Value::is_string) {
            return Some(format!("bad grant.{field}"));
        }
    }
    if string_array(g.get("caps")).is_none() {
        return Some("bad grant.caps".into());
    }
    None
}

fn check_meta(m: Option<&Value>) -> Option<String> {
    let Some(m) = m.and_then(Value::as_object) else {
        return Some("bad meta".into());
    };
    for field in ["mentions", "directives", "tags", "task_refs"] {
        if string_array(m.get(field)).is_none() {
            return Some(format!("bad meta.{field}"));
        }
    }
    if let Some(v) = m.get("sender_verification") {
        if !matches!(v.as_str(), Some("unverified" | "leased")) {
            return Some("bad sender verification".into());
        }
    }
    if let Some(h) = m.get("hop") {
        let ok = h.as_f64().is_some_and(|f| {
            f.fract() == 0.0 && (0.0..=limits::MAX_RELAY_DEPTH as f64).contains(&f)
        });
        if !ok {
            return Some("bad hop".into());
        }
    }
    if let Some(o) = m.get("origin") {
        if !matches!(o.as_str(), Some("agent" | "external")) {
            return Some("bad origin".into());
        }
    }
    if let Some(p) = m.get("project") {
        if p.as_str()
            .is_none_or(|p| utf16_len(p) > limits::MAX_PROJECT)
        {
            return Some("bad project".into());
        }
    }
    if let Some(p) = m.get("project_key") {
        if p.as_str()
            .is_none_or(|p| utf16_len(p) > limits::MAX_PROJECT)
        {
            return Some("bad project key".into());
        }
    }
    if let Some(l) = m.get("local_names") {
        let ok = string_array(Some(l)).is_some_and(|names| {
            names.len() <= limits::MAX_LOCAL_NAMES && names.iter().all(|n| limits::is_name(n))
        });
        if !ok {
            return Some("bad local names".into());
        }
    }
    None
}

// ---- body metadata (0.5.x parseMeta) -------------------------------------------------------

/// JavaScript RegExp `\s`.
fn js_space(c: char) -> bool {
    matches!(
        c,
        '\t' | '\n' | '\u{b}' | '\u{c}' | '\r' | ' ' | '\u{a0}' | '\u{1680}' | '\u{2000}'
            ..='\u{200a}'
                | '\u{2028}'
                | '\u{2029}'
                | '\u{202f}'
                | '\u{205f}'
                | '\u{3000}'
                | '\u{feff}'
    )
}

fn js_word(c: char) -> bool {
    c.is_ascii_alphanumeric() || c == '_'
}

fn uniq(items: Vec<String>) -> Vec<String> {
    let mut seen = std::collections::HashSet::new();
    items
        .into_iter()
        .filter(|s| seen.insert(s.clone()))
        .collect()
}

/// Scans `body` left to right like a global RegExp: `at` tries a match at char index `i` (with
/// the previous char known) and returns (captured text, end index).
fn scan(chars: &[char], at: impl Fn(&[char], usize) -> Option<(String, usize)>) -> Vec<String> {
    let mut out = Vec::new();
    let mut i = 0;
    while i <= chars.len() {
        match at(chars, i) {
            Some((cap, end)) => {
                out.push(cap);
                i = if end > i { end } else { i + 1 };
            }
            None => i += 1,
        }
    }
    out
}

fn take_while(chars: &[char], from: usize, max: usize, ok: impl Fn(char) -> bool) -> usize {
    chars[from.min(chars.len())..]
        .iter()
        .take(max)
        .take_while(|c| ok(**c))
        .count()
}

/// Parses mentions, directives, tags and task refs from a body (0.5.x `parseMeta`).
pub fn parse_meta(body: &str) -> Meta {
    let chars: Vec<char> = body.chars().collect();
    let alnum = |c: char| c.is_ascii_alphanumeric();
    let name_char = |c: char| c.is_ascii_alphanumeric() || c == '-';
    // (?:^|[\s(])@([a-z0-9][a-z0-9-]{1,39}(?:@[a-z0-9-]+)?)  /gi
    let mentions = scan(&chars, |c, i| {
        let start = if i == 0 && c.first() == Some(&'@') {
            0
        } else if i < c.len() && (js_space(c[i]) || c[i] == '(') && c.get(i + 1) == Some(&'@') {
            i + 1
        } else {
            return None;
        };
        let n0 = start + 1;
        if !c.get(n0).is_some_and(|ch| alnum(*ch)) {
            return None;
        }
        let rest = take_while(c, n0 + 1, 39, name_char);
        if rest == 0 {
            return None;
        }
        let mut end = n0 + 1 + rest;
        if c.get(end) == Some(&'@') {
            let host = take_while(c, end + 1, usize::MAX, name_char);
            if host > 0 {
                end += 1 + host;
            }
        }
        Some((c[n0..end].iter().collect(), end))
    });
    // (?:^|\s)\/(claim|done|blocked|approve|decision|checkin)\b  /g
    let directives = scan(&chars, |c, i| {
        let slash = if i == 0 && c.first() == Some(&'/') {
            0
        } else if i < c.len() && js_space(c[i]) && c.get(i + 1) == Some(&'/') {
            i + 1
        } else {
            return None;
        };
        for word in ["claim", "done", "blocked", "approve", "decision", "checkin"] {
            let w: Vec<char> = word.chars().collect();
            let end = slash + 1 + w.len();
            if c.get(slash + 1..end) == Some(&w[..]) && !c.get(end).is_some_and(|ch| js_word(*ch)) {
                return Some((word.to_string(), end));
            }
        }
        None
    });
    // (?:^|\s)#([a-z][\w-]{1,40})  /gi
    let tags = scan(&chars, |c, i| {
        let hash = if i == 0 && c.first() == Some(&'#') {
            0
        } else if i < c.len() && js_space(c[i]) && c.get(i + 1) == Some(&'#') {
            i + 1
        } else {
            return None;
        };
        if !c.get(hash + 1).is_some_and(|ch| ch.is_ascii_alphabetic()) {
            return None;
        }
        let rest = take_while(c, hash + 2, 40, |ch| js_word(ch) || ch == '-');
        if rest == 0 {
            return None;
        }
        let end = hash + 2 + rest;
        Some((c[hash + 1..end].iter().collect(), end))
    });
    // \b(T\d{2,6})\b  /g
    let task_refs = scan(&chars, |c, i| {
        if c.get(i) != Some(&'T') || (i > 0 && js_word(c[i - 1])) {
            return None;
        }
        let digits = take_while(c, i + 1, 6, |ch| ch.is_ascii_digit());
        let end = i + 1 + digits;
        if digits < 2 || c.get(end).is_some_and(|ch| js_word(*ch)) {
            return None;
        }
        Some((c[i..end].iter().collect(), end))
    });
    Meta {
        mentions: uniq(mentions)
            .into_iter()
            .map(|s| s.to_lowercase())
            .collect(),
        directives: uniq(directives),
        tags: uniq(tags).into_iter().map(|s| s.to_lowercase()).collect(),
        task_refs: uniq(task_refs),
        ..Meta::default()
    }
}

#[cfg(test)]
mod limits_tests;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn meta_parsing_matches_js_regexes() {
        let m =
            parse_meta("Hi @Bob, cc (@ann@work) /approve /decisions #Launch T789 T1234567 xT12 @a");
        assert_eq!(m.mentions, vec!["bob", "ann@work"]);
        assert_eq!(m.directives, vec!["approve"]);
        assert_eq!(m.tags, vec!["launch"]);
        assert_eq!(m.task_refs, vec!["T789"]);
    }
}
