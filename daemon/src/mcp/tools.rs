//! The tools' arguments: 0.5.x's names and bounds (`agent-surface.md`), their JSON Schemas
//! (schemars, as the tool list shows them) and the checks that refuse what breaks a bound
//! before anything is sent to the daemon, in our own words.
//!
//! A check returns `Err(text)`; the server turns it into a tool error (`is_error: true`) and
//! calls nothing.

use rmcp::schemars;
use serde::Deserialize;

/// Recipients per send (0.5.x; the API's bound too).
pub const MAX_TO: usize = 20;
/// Subject length in UTF-16 units (0.5.x counts JavaScript string length).
pub const MAX_SUBJECT: usize = 200;
/// Body size in UTF-8 bytes (the API's bound).
pub const MAX_BODY_BYTES: usize = 256 * 1024;
/// References per send.
pub const MAX_REFS: usize = 20;
/// Idempotency key length (0.5.x; the API header allows more).
pub const MAX_IDEMPOTENCY_KEY: usize = 100;
/// Ids per `mbx_read`.
pub const MAX_READ_IDS: usize = 20;
/// Ids per `mbx_ack`.
pub const MAX_ACK_IDS: usize = 50;
/// Ack note length in UTF-16 units (the delivery receipt's bound).
pub const MAX_NOTE: usize = 500;
/// Description length in UTF-16 units.
pub const MAX_DESCRIPTION: usize = 200;
/// Cursor length: cursors are the daemon's opaque text; anything longer is not one of ours.
pub const MAX_CURSOR: usize = 2048;
/// `mbx_inbox` page size: 1..=200, default 30.
pub const INBOX_LIMIT: (u32, u32, u32) = (1, 200, 30);
/// `mbx_sent` page size: 1..=100, default 20.
pub const SENT_LIMIT: (u32, u32, u32) = (1, 100, 20);
/// `mbx_search` page size: 1..=50, default 10 (0.5.x; the API's bound).
pub const SEARCH_LIMIT: (u32, u32, u32) = (1, 50, 10);
/// `mbx_search` query length in characters: 2..=200 (0.5.x; the API's bound).
pub const SEARCH_QUERY_CHARS: (usize, usize) = (2, 200);
/// `mbx_wait` longest wait in seconds: below the 60 s tool timeout of some clients.
pub const MAX_WAIT_S: u32 = 45;
/// `mbx_wait` default wait in seconds.
pub const DEFAULT_WAIT_S: u32 = 30;
/// `mbx_replay` / `mbx_catchup` page size: 1..=200, default 50.
pub const HISTORY_LIMIT: (u32, u32, u32) = (1, 200, 50);
/// `mbx_replay` / `mbx_catchup` `max_bytes`: 2048..=262144, default 65536 (0.5.x's bounds).
pub const HISTORY_MAX_BYTES: (u32, u32, u32) = (2048, 262_144, 65_536);
/// The `max_bytes` these tools ask the daemon for at most: a result is bounded to 64 KiB
/// ([`super::server::MAX_RESULT_BYTES`]), so a larger `max_bytes` is capped to 60 KiB (the
/// rest is room for the page's other fields).
pub const HISTORY_TOOL_MAX_BYTES: u32 = 60 * 1024;

/// `mbx_whoami`.
#[derive(Debug, Default, Deserialize, schemars::JsonSchema)]
pub struct WhoamiArgs {
    /// Agent name to act as from now on (registered if new); default: this session's agent.
    pub name: Option<String>,
    /// Role that `role:<R>` addresses reach ("" clears it).
    pub role: Option<String>,
    /// One line about this agent, at most 200 characters ("" clears it).
    #[schemars(length(max = 200))]
    pub description: Option<String>,
}

/// `mbx_send`.
#[derive(Debug, Deserialize, schemars::JsonSchema)]
pub struct SendArgs {
    /// Recipients (1..=20): `name`, `name@host`, `role:<R>`, `*`.
    #[schemars(length(min = 1, max = 20))]
    pub to: Vec<String>,
    /// One line, 1..=200 characters.
    #[schemars(length(min = 1, max = 200))]
    pub subject: String,
    /// Message text, at most 256 KiB (UTF-8).
    #[serde(default)]
    pub body: String,
    /// message (default), request, reply, status, decision, alert or task.
    pub kind: Option<String>,
    /// Id of the message this answers (continues its thread).
    pub reply_to: Option<String>,
    /// Ask the recipients for a reply.
    #[serde(default)]
    pub needs_reply: bool,
    /// References (at most 20), e.g. file paths or URLs.
    #[serde(default)]
    #[schemars(length(max = 20))]
    pub refs: Vec<String>,
    /// Your own key (1..=100 visible ASCII): calling again with it never sends twice.
    #[schemars(length(min = 1, max = 100))]
    pub idempotency_key: Option<String>,
}

/// `mbx_reply`.
#[derive(Debug, Deserialize, schemars::JsonSchema)]
pub struct ReplyArgs {
    /// Id of the message to answer.
    pub id: String,
    /// Reply text, at most 256 KiB (UTF-8).
    pub body: String,
    /// Kind (default reply).
    pub kind: Option<String>,
    /// Ask for a reply in turn.
    #[serde(default)]
    pub needs_reply: bool,
    /// Your own key (1..=100 visible ASCII): calling again with it never replies twice.
    #[schemars(length(min = 1, max = 100))]
    pub idempotency_key: Option<String>,
}

/// `mbx_inbox`.
#[derive(Debug, Default, Deserialize, schemars::JsonSchema)]
pub struct InboxArgs {
    /// Include acked messages.
    #[serde(default)]
    pub all: bool,
    /// Page size, 1..=200 (default 30).
    #[schemars(range(min = 1, max = 200))]
    pub limit: Option<u32>,
    /// `next_cursor` of the previous page.
    pub cursor: Option<String>,
}

/// `mbx_read`.
#[derive(Debug, Deserialize, schemars::JsonSchema)]
pub struct ReadArgs {
    /// Message ids (1..=20); each is marked read.
    #[schemars(length(min = 1, max = 20))]
    pub ids: Vec<String>,
}

/// `mbx_ack`.
#[derive(Debug, Deserialize, schemars::JsonSchema)]
pub struct AckArgs {
    /// Message ids (1..=50).
    #[schemars(length(min = 1, max = 50))]
    pub ids: Vec<String>,
    /// Note for the senders, at most 500 characters.
    #[schemars(length(max = 500))]
    pub note: Option<String>,
    /// Your own key (1..=100 visible ASCII).
    #[schemars(length(min = 1, max = 100))]
    pub idempotency_key: Option<String>,
}

/// `mbx_thread`.
#[derive(Debug, Deserialize, schemars::JsonSchema)]
pub struct ThreadArgs {
    /// A thread id, or the id of any message in it.
    pub id: String,
    /// `next_cursor` of the previous page.
    pub cursor: Option<String>,
}

/// `mbx_search`.
#[derive(Debug, Deserialize, schemars::JsonSchema)]
pub struct SearchArgs {
    /// Words to find, 2..=200 characters: messages whose subject or body holds every word
    /// (case and accents ignored); punctuation only separates words; `word*` is a prefix.
    #[schemars(length(min = 2, max = 200))]
    pub query: String,
    /// Results, 1..=50 (default 10), best first.
    #[schemars(range(min = 1, max = 50))]
    pub limit: Option<u32>,
    /// `next_cursor` of the previous page of the same search.
    pub cursor: Option<String>,
}

/// `mbx_sent`.
#[derive(Debug, Default, Deserialize, schemars::JsonSchema)]
pub struct SentArgs {
    /// `next_cursor` of the previous page.
    pub cursor: Option<String>,
    /// Page size, 1..=100 (default 20).
    #[schemars(range(min = 1, max = 100))]
    pub limit: Option<u32>,
}

/// `mbx_wait`.
#[derive(Debug, Default, Deserialize, schemars::JsonSchema)]
pub struct WaitArgs {
    /// `next_cursor` of the previous mbx_wait or mbx_inbox answer.
    pub cursor: Option<String>,
    /// Longest wait in seconds, 0..=45 (default 30).
    #[schemars(range(max = 45))]
    pub timeout_s: Option<u32>,
    /// Only messages that ask for a reply.
    #[serde(default)]
    pub needs_reply: bool,
    /// Only messages from this sender (`name` or `name@host`).
    pub from: Option<String>,
}

/// `mbx_replay`.
#[derive(Debug, Default, Deserialize, schemars::JsonSchema)]
pub struct ReplayArgs {
    /// `next_cursor` of the previous page (at most 2048 characters); none: from the start.
    #[schemars(length(max = 2048))]
    pub cursor: Option<String>,
    /// Page size, 1..=200 (default 50).
    #[schemars(range(min = 1, max = 200))]
    pub limit: Option<u32>,
    /// Byte budget of the page, 2048..=262144 (default 65536); above 61440 it is capped to
    /// 61440 (results are bounded to 64 KiB). A page holds at least one message.
    #[schemars(range(min = 2048, max = 262144))]
    pub max_bytes: Option<u32>,
    /// Only this thread (a thread id).
    pub thread: Option<String>,
}

/// Where `mbx_catchup` restarts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum RestartFrom {
    /// From the beginning.
    All,
    /// From now: only what arrives later.
    Now,
}

impl RestartFrom {
    /// The API's word for it.
    pub fn as_str(self) -> &'static str {
        match self {
            RestartFrom::All => "all",
            RestartFrom::Now => "now",
        }
    }
}

/// `mbx_catchup`.
#[derive(Debug, Default, Deserialize, schemars::JsonSchema)]
pub struct CatchupArgs {
    /// `next_cursor` of the previous page, to read on before committing (at most 2048
    /// characters); none: from your stored position.
    #[schemars(length(max = 2048))]
    pub cursor: Option<String>,
    /// Page size, 1..=200 (default 50).
    #[schemars(range(min = 1, max = 200))]
    pub limit: Option<u32>,
    /// Byte budget of the page, 2048..=262144 (default 65536); above 61440 it is capped to
    /// 61440 (results are bounded to 64 KiB).
    #[schemars(range(min = 2048, max = 262144))]
    pub max_bytes: Option<u32>,
    /// Move your stored position past this page (never back).
    #[serde(default)]
    pub commit: bool,
    /// Reset your position first: all (from the beginning) or now (only later mail).
    pub restart: Option<RestartFrom>,
}

/// `max_bytes` given or its default, checked against 0.5.x's bounds, then capped to
/// [`HISTORY_TOOL_MAX_BYTES`].
fn history_bytes(given: Option<u32>) -> Result<u32, String> {
    let (min, max, default) = HISTORY_MAX_BYTES;
    let b = given.unwrap_or(default);
    if !(min..=max).contains(&b) {
        return Err(format!("max_bytes must be {min} to {max}"));
    }
    Ok(b.min(HISTORY_TOOL_MAX_BYTES))
}

impl ReplayArgs {
    /// Checks cursor, page size, byte budget and thread; returns `(limit, max_bytes)` (the
    /// latter capped to [`HISTORY_TOOL_MAX_BYTES`]).
    pub fn check(&self) -> Result<(u32, u32), String> {
        check_cursor(&self.cursor)?;
        if let Some(t) = &self.thread {
            if t.is_empty() || utf16(t) > 300 {
                return Err("thread must be a thread id of 1 to 300 characters".into());
            }
        }
        Ok((
            limit(self.limit, HISTORY_LIMIT)?,
            history_bytes(self.max_bytes)?,
        ))
    }
}

impl CatchupArgs {
    /// Checks cursor, page size and byte budget; returns `(limit, max_bytes)` (the latter
    /// capped to [`HISTORY_TOOL_MAX_BYTES`]).
    pub fn check(&self) -> Result<(u32, u32), String> {
        check_cursor(&self.cursor)?;
        if self.cursor.is_some() && self.restart.is_some() {
            return Err("give either cursor or restart, not both".into());
        }
        Ok((
            limit(self.limit, HISTORY_LIMIT)?,
            history_bytes(self.max_bytes)?,
        ))
    }
}

fn utf16(s: &str) -> usize {
    s.encode_utf16().count()
}

/// `idempotency_key`: 1..=100 printable ASCII, not starting or ending with a space (the API's
/// header rule).
fn check_key(key: &Option<String>) -> Result<(), String> {
    let Some(k) = key else { return Ok(()) };
    let ok = (1..=MAX_IDEMPOTENCY_KEY).contains(&k.len())
        && k.bytes().all(|b| (0x20..=0x7e).contains(&b))
        && !k.starts_with(' ')
        && !k.ends_with(' ');
    if ok {
        Ok(())
    } else {
        Err(format!(
            "idempotency_key must be 1 to {MAX_IDEMPOTENCY_KEY} printable ASCII characters, \
             not starting or ending with a space"
        ))
    }
}

fn check_ids(ids: &[String], max: usize) -> Result<(), String> {
    if ids.is_empty() || ids.len() > max {
        return Err(format!("ids must hold 1 to {max} message ids"));
    }
    if ids.iter().any(|i| i.trim().is_empty()) {
        return Err("ids must not hold an empty id".into());
    }
    Ok(())
}

fn check_cursor(cursor: &Option<String>) -> Result<(), String> {
    match cursor {
        Some(c) if c.len() > MAX_CURSOR => Err(format!(
            "cursor is longer than {MAX_CURSOR} bytes: pass the next_cursor of an answer as it is"
        )),
        _ => Ok(()),
    }
}

fn check_body(body: &str) -> Result<(), String> {
    if body.len() > MAX_BODY_BYTES {
        Err(format!(
            "body is {} bytes; at most {MAX_BODY_BYTES} (256 KiB) are allowed",
            body.len()
        ))
    } else {
        Ok(())
    }
}

/// The page size given or its default, checked against `(min, max, default)`.
pub fn limit(given: Option<u32>, (min, max, default): (u32, u32, u32)) -> Result<u32, String> {
    let l = given.unwrap_or(default);
    if (min..=max).contains(&l) {
        Ok(l)
    } else {
        Err(format!("limit must be {min} to {max}"))
    }
}

impl WhoamiArgs {
    /// Checks the description's length (the daemon checks name and role).
    pub fn check(&self) -> Result<(), String> {
        match &self.description {
            Some(d) if utf16(d) > MAX_DESCRIPTION => Err(format!(
                "description is longer than {MAX_DESCRIPTION} characters"
            )),
            _ => Ok(()),
        }
    }
}

impl SendArgs {
    /// Checks recipients, subject, body, refs and key.
    pub fn check(&self) -> Result<(), String> {
        if self.to.is_empty() || self.to.len() > MAX_TO {
            return Err(format!("to must hold 1 to {MAX_TO} addresses"));
        }
        if self.to.iter().any(|t| t.trim().is_empty()) {
            return Err("to must not hold an empty address".into());
        }
        if self.subject.trim().is_empty() {
            return Err("subject must not be empty".into());
        }
        if utf16(&self.subject) > MAX_SUBJECT {
            return Err(format!("subject is longer than {MAX_SUBJECT} characters"));
        }
        check_body(&self.body)?;
        if self.refs.len() > MAX_REFS {
            return Err(format!("refs must hold at most {MAX_REFS} references"));
        }
        check_key(&self.idempotency_key)
    }
}

impl ReplyArgs {
    /// Checks id, body and key.
    pub fn check(&self) -> Result<(), String> {
        if self.id.trim().is_empty() {
            return Err("id must name the message to answer".into());
        }
        check_body(&self.body)?;
        check_key(&self.idempotency_key)
    }
}

impl InboxArgs {
    /// Checks the page size and cursor; returns the page size.
    pub fn check(&self) -> Result<u32, String> {
        check_cursor(&self.cursor)?;
        limit(self.limit, INBOX_LIMIT)
    }
}

impl ReadArgs {
    /// Checks the ids.
    pub fn check(&self) -> Result<(), String> {
        check_ids(&self.ids, MAX_READ_IDS)
    }
}

impl AckArgs {
    /// Checks ids, note and key.
    pub fn check(&self) -> Result<(), String> {
        check_ids(&self.ids, MAX_ACK_IDS)?;
        if self.note.as_deref().is_some_and(|n| utf16(n) > MAX_NOTE) {
            return Err(format!("note is longer than {MAX_NOTE} characters"));
        }
        check_key(&self.idempotency_key)
    }
}

impl ThreadArgs {
    /// Checks id and cursor.
    pub fn check(&self) -> Result<(), String> {
        if self.id.trim().is_empty() {
            return Err("id must name a thread or a message".into());
        }
        check_cursor(&self.cursor)
    }
}

impl SearchArgs {
    /// Checks the query's length, the page size and the cursor; returns the page size (the
    /// daemon reads the words and answers a query with none as refused).
    pub fn check(&self) -> Result<u32, String> {
        let (min, max) = SEARCH_QUERY_CHARS;
        let n = self.query.chars().count();
        if !(min..=max).contains(&n) {
            return Err(format!("query must be {min} to {max} characters"));
        }
        check_cursor(&self.cursor)?;
        limit(self.limit, SEARCH_LIMIT)
    }
}

impl SentArgs {
    /// Checks the page size and cursor; returns the page size.
    pub fn check(&self) -> Result<u32, String> {
        check_cursor(&self.cursor)?;
        limit(self.limit, SENT_LIMIT)
    }
}

impl WaitArgs {
    /// Checks the wait and cursor; returns the wait in seconds.
    pub fn check(&self) -> Result<u32, String> {
        check_cursor(&self.cursor)?;
        let t = self.timeout_s.unwrap_or(DEFAULT_WAIT_S);
        if t > MAX_WAIT_S {
            return Err(format!("timeout_s must be 0 to {MAX_WAIT_S} seconds"));
        }
        Ok(t)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn send(to: usize, subject: &str, body: usize) -> SendArgs {
        SendArgs {
            to: (0..to).map(|i| format!("agent{i}")).collect(),
            subject: subject.into(),
            body: "x".repeat(body),
            kind: None,
            reply_to: None,
            needs_reply: false,
            refs: vec![],
            idempotency_key: None,
        }
    }

    #[test]
    fn send_bounds() {
        assert!(send(1, "s", 0).check().is_ok());
        assert!(send(20, &"é".repeat(200), MAX_BODY_BYTES).check().is_ok());
        assert!(send(0, "s", 0).check().unwrap_err().contains("1 to 20"));
        assert!(send(21, "s", 0).check().is_err());
        assert!(send(1, " ", 0).check().unwrap_err().contains("empty"));
        // An emoji is two UTF-16 units, as 0.5.x counts.
        assert!(send(1, &"😀".repeat(101), 0).check().is_err());
        assert!(send(1, "s", MAX_BODY_BYTES + 1)
            .check()
            .unwrap_err()
            .contains("256 KiB"));
        let mut s = send(1, "s", 0);
        s.refs = vec!["r".into(); 21];
        assert!(s.check().is_err());
        s.refs.clear();
        s.idempotency_key = Some("k".repeat(100));
        assert!(s.check().is_ok());
        for bad in [
            "k".repeat(101),
            String::new(),
            " k".into(),
            "k\n".into(),
            "é".into(),
        ] {
            s.idempotency_key = Some(bad.clone());
            assert!(s.check().is_err(), "{bad:?}");
        }
    }

    #[test]
    fn search_bounds_are_0_5_s_and_the_apis() {
        let search = |query: &str, limit| SearchArgs {
            query: query.into(),
            limit,
            cursor: None,
        };
        assert_eq!(search("ab", None).check(), Ok(10));
        assert_eq!(search(&"é".repeat(200), Some(50)).check(), Ok(50));
        assert!(search("a", None).check().unwrap_err().contains("2 to 200"));
        assert!(search(&"é".repeat(201), None).check().is_err());
        assert!(search("ab", Some(0)).check().is_err());
        assert!(search("ab", Some(51))
            .check()
            .unwrap_err()
            .contains("1 to 50"));
        assert_eq!(
            (SEARCH_QUERY_CHARS, SEARCH_LIMIT.1),
            (
                (
                    agentmbx::mailbox::search::MIN_QUERY_CHARS,
                    agentmbx::mailbox::search::MAX_QUERY_CHARS
                ),
                agentmbx::mailbox::search::MAX_SEARCH_LIMIT
            )
        );
    }

    #[test]
    fn ids_note_and_limits() {
        let ids = |n: usize| (0..n).map(|i| format!("id{i}")).collect::<Vec<_>>();
        assert!(ReadArgs { ids: ids(20) }.check().is_ok());
        assert!(ReadArgs { ids: ids(21) }.check().is_err());
        assert!(ReadArgs { ids: ids(0) }.check().is_err());
        let ack = |n, note: usize| AckArgs {
            ids: ids(n),
            note: Some("n".repeat(note)),
            idempotency_key: None,
        };
        assert!(ack(50, 500).check().is_ok());
        assert!(ack(51, 0).check().is_err());
        assert!(ack(1, 501).check().unwrap_err().contains("500"));
        let inbox = |limit| InboxArgs {
            limit,
            ..Default::default()
        };
        assert_eq!(inbox(None).check(), Ok(30));
        assert_eq!(inbox(Some(200)).check(), Ok(200));
        assert!(inbox(Some(0)).check().is_err());
        assert!(inbox(Some(201)).check().is_err());
        let sent = |limit| SentArgs {
            limit,
            cursor: None,
        };
        assert_eq!(sent(None).check(), Ok(20));
        assert!(sent(Some(101)).check().is_err());
        let wait = |t| WaitArgs {
            timeout_s: t,
            ..Default::default()
        };
        assert_eq!(wait(None).check(), Ok(30));
        assert_eq!(wait(Some(0)).check(), Ok(0));
        assert_eq!(wait(Some(45)).check(), Ok(45));
        assert!(wait(Some(46)).check().is_err());
        let long = WaitArgs {
            cursor: Some("9".repeat(MAX_CURSOR + 1)),
            ..Default::default()
        };
        assert!(long.check().is_err());
        let who = |d: usize| WhoamiArgs {
            description: Some("d".repeat(d)),
            ..Default::default()
        };
        assert!(who(200).check().is_ok());
        assert!(who(201).check().is_err());
    }

    #[test]
    fn replay_and_catchup_bounds_and_the_byte_cap() {
        let replay = |limit, max_bytes| ReplayArgs {
            limit,
            max_bytes,
            ..Default::default()
        };
        assert_eq!(replay(None, None).check(), Ok((50, HISTORY_TOOL_MAX_BYTES)));
        assert_eq!(replay(Some(200), Some(2048)).check(), Ok((200, 2048)));
        assert_eq!(
            replay(None, Some(262_144)).check(),
            Ok((50, HISTORY_TOOL_MAX_BYTES))
        );
        assert!(replay(Some(0), None).check().is_err());
        assert!(replay(Some(201), None).check().is_err());
        assert!(replay(None, Some(2047)).check().is_err());
        assert!(replay(None, Some(262_145)).check().is_err());
        let long = ReplayArgs {
            cursor: Some("1".repeat(MAX_CURSOR + 1)),
            ..Default::default()
        };
        assert!(long.check().is_err());
        let thread = ReplayArgs {
            thread: Some(String::new()),
            ..Default::default()
        };
        assert!(thread.check().is_err());
        let both = CatchupArgs {
            cursor: Some("bob.1".into()),
            restart: Some(RestartFrom::All),
            ..Default::default()
        };
        assert!(both.check().is_err());
        assert_eq!(
            CatchupArgs::default().check(),
            Ok((50, HISTORY_TOOL_MAX_BYTES))
        );
    }
}
