//! Full-text search over an agent's mail (issue 19 "Search"; `GET /v1/search`, `agentmbx
//! search`, `mbx_search`).
//!
//! The index is the FTS5 table `message_search` of schema version 10: a copy of each stored
//! message's plaintext subject and body, written by triggers in the transaction that stores the
//! message (a local send, LAN or relay receive, an alert), so it never lags the mail; mail stored
//! before version 10 was indexed by the migration. What an agent may find is decided at query
//! time, as `read` and `thread` decide it: the messages delivered to it (its deliveries, acked
//! ones included; mail held as unclaimed counts from the moment it is delivered) and the
//! messages it sent.
//!
//! A query is words, never FTS5 syntax ([`parse_query`]): ASCII letters and digits and every
//! other character but white space and controls make up words; ASCII punctuation, spaces and
//! controls separate them, so quotes, `NEAR(`, `AND`/`OR`/`NOT` (plain words then), column
//! filters such as `subject:`, `^`, parentheses and a lone `*` mean nothing special. A word
//! directly followed by `*` matches as a prefix (`deplo*` finds "deploy"). Each word is handed
//! to FTS5 as a quoted string, and a message must hold every word (in subject or body, any
//! order, case and diacritics ignored). A word holding no letter or digit (say `«»`) matches
//! nothing and is left out; a query of only such words finds nothing.
//!
//! Results are ranked by bm25 (subject matches weigh twice body matches; ties: newest first)
//! and paged: `limit` results (1..=[`MAX_SEARCH_LIMIT`]) and at most [`MAX_SEARCH_BYTES`] per
//! page, a page holding at least one; each result carries a snippet of the body of at most
//! [`MAX_SNIPPET_CHARS`] characters, never more of it. A page's `next_cursor` is the offset of
//! the next page in the ranked list as it stands when that page is read: mail arriving between
//! pages may shift the ranking. Results past offset [`MAX_SEARCH_OFFSET`] are not paged to
//! (narrow the query instead).

use rusqlite::{params, Connection, OptionalExtension};
use serde::Serialize;

use super::MailboxError;

/// Shortest query (characters, as given): 2 (0.5.x `mbx_search` `query 2..200`).
pub const MIN_QUERY_CHARS: usize = 2;
/// Longest query (characters, as given): 200 (0.5.x).
pub const MAX_QUERY_CHARS: usize = 200;
/// Default page size (count): 10 (0.5.x `limit 1..50=10`).
pub const DEFAULT_SEARCH_LIMIT: u32 = 10;
/// Largest page size (count): 50 (0.5.x).
pub const MAX_SEARCH_LIMIT: u32 = 50;
/// Byte budget of one page (sum of result JSON sizes, bytes): 64 KiB; a page always holds ≥1
/// result.
pub const MAX_SEARCH_BYTES: usize = 64 * 1024;
/// Longest snippet (characters): 200; a longer one is cut and ends with `…`.
pub const MAX_SNIPPET_CHARS: usize = 200;
/// Largest offset a cursor may hold: 9999 (a cursor is at most 4 digits).
pub const MAX_SEARCH_OFFSET: u32 = 9_999;

/// A parsed query: the FTS5 expression made of the query's quoted words.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SearchQuery {
    /// The words (each with whether it is a prefix), as given, in order.
    pub words: Vec<(String, bool)>,
    /// The FTS5 MATCH expression; empty when no word holds a letter or digit (finds nothing).
    pub fts: String,
}

/// True for a character that separates words: ASCII other than letters and digits (spaces,
/// punctuation, controls), and any other white space or control character.
fn separates(c: char) -> bool {
    if c.is_ascii() {
        !c.is_ascii_alphanumeric()
    } else {
        c.is_whitespace() || c.is_control()
    }
}

/// Reads a query as words (module docs). Errors ([`MailboxError::Invalid`], our words): a
/// query shorter than [`MIN_QUERY_CHARS`] or longer than [`MAX_QUERY_CHARS`] characters, or
/// one that holds no word (only punctuation, spaces, `*` and the like).
pub fn parse_query(q: &str) -> Result<SearchQuery, MailboxError> {
    let n = q.chars().count();
    if !(MIN_QUERY_CHARS..=MAX_QUERY_CHARS).contains(&n) {
        return Err(MailboxError::Invalid(format!(
            "the query has {n} characters; it must have {MIN_QUERY_CHARS} to {MAX_QUERY_CHARS}"
        )));
    }
    let mut words: Vec<(String, bool)> = Vec::new();
    let mut word = String::new();
    for c in q.chars() {
        if !separates(c) {
            word.push(c);
            continue;
        }
        if !word.is_empty() {
            words.push((std::mem::take(&mut word), c == '*'));
        }
    }
    if !word.is_empty() {
        words.push((word, false));
    }
    if words.is_empty() {
        return Err(MailboxError::Invalid(
            "the query holds no words (only punctuation or spaces): search for words".into(),
        ));
    }
    let fts = words
        .iter()
        .filter(|(w, _)| w.chars().any(char::is_alphanumeric))
        .map(|(w, prefix)| {
            let quoted = format!("\"{}\"", w.replace('"', "\"\""));
            if *prefix {
                quoted + "*"
            } else {
                quoted
            }
        })
        .collect::<Vec<_>>()
        .join(" ");
    Ok(SearchQuery { words, fts })
}

/// Reads a search cursor: `None` or `""` is offset 0, else 1 to 4 ASCII digits (an offset of
/// at most [`MAX_SEARCH_OFFSET`]). Anything else is [`MailboxError::Invalid`].
pub fn parse_cursor(cursor: Option<&str>) -> Result<u32, MailboxError> {
    let Some(c) = cursor.filter(|c| !c.is_empty()) else {
        return Ok(0);
    };
    if c.len() <= 4 && c.bytes().all(|b| b.is_ascii_digit()) {
        if let Ok(n) = c.parse() {
            return Ok(n);
        }
    }
    Err(MailboxError::Invalid(format!(
        "bad cursor {c:?}: pass back the next_cursor a search answer gave"
    )))
}

/// One search result: where the message is and why it matched, never its whole body.
#[derive(Debug, Clone, PartialEq, Serialize, utoipa::ToSchema)]
pub struct SearchHit {
    /// Envelope id.
    pub id: String,
    /// `name@host` of the sender.
    pub from: String,
    /// Subject.
    pub subject: String,
    /// Thread id.
    pub thread: String,
    /// Kind.
    #[schema(value_type = crate::vocab::Kind)]
    pub kind: String,
    /// ISO ms send time.
    pub ts: String,
    /// A few words of the body around the best match, at most 200 characters (`…` marks a
    /// cut); not the whole body (`read` gives it).
    pub snippet: String,
    /// Relevance: the message's bm25 score negated, so higher is better (only comparable
    /// within one answer).
    pub rank: f64,
}

/// A page of search results.
#[derive(Debug, Clone, PartialEq, Serialize, utoipa::ToSchema)]
pub struct SearchPage {
    /// Results, best first.
    pub messages: Vec<SearchHit>,
    /// Opaque cursor for the next page (an offset in the ranking as it stands then); absent
    /// when this page reached the end.
    #[schema(pattern = "^[0-9]{1,4}$")]
    pub next_cursor: Option<String>,
}

/// Cuts `s` to [`MAX_SNIPPET_CHARS`] characters, ending a cut one with `…`.
fn bound_snippet(s: String) -> String {
    if s.chars().count() <= MAX_SNIPPET_CHARS {
        return s;
    }
    let mut out: String = s.chars().take(MAX_SNIPPET_CHARS - 1).collect();
    out.push('…');
    out
}

/// A page of `agent`'s mail matching `q`, best first: the messages delivered to `agent` and
/// those it sent (`agent@own_host`), from offset `cursor` ([`parse_cursor`]), at most `limit`
/// (1..=[`MAX_SEARCH_LIMIT`]) results and [`MAX_SEARCH_BYTES`]. Reads only. Errors: a bad
/// cursor ([`MailboxError::Invalid`]), SQLite.
pub fn search(
    conn: &Connection,
    agent: &str,
    own_host: &str,
    q: &SearchQuery,
    cursor: Option<&str>,
    limit: u32,
) -> Result<SearchPage, MailboxError> {
    let offset = parse_cursor(cursor)?;
    let limit = limit.clamp(1, MAX_SEARCH_LIMIT);
    if q.fts.is_empty() {
        return Ok(SearchPage {
            messages: Vec::new(),
            next_cursor: None,
        });
    }
    let me = format!("{agent}@{own_host}");
    // Rank first, without snippets: a snippet costs a pass over the body, so it is made only
    // for the results a page shows (below), not for every match the ranking sorts.
    let mut st = conn.prepare_cached(&format!(
        "SELECT m.id, m.from_addr, m.subject, m.thread, m.kind, m.ts, message_search.rowid,
                bm25(message_search, 0.0, 2.0, 1.0) AS score
         FROM message_search JOIN messages m ON m.id = message_search.msg_id
         WHERE message_search MATCH ?3 AND {}
         ORDER BY score, m.ts DESC, m.id DESC LIMIT ?4 OFFSET ?5",
        super::messages::VISIBLE
    ))?;
    let rows = st
        .query_map(params![agent, me, q.fts, limit + 1, offset], |r| {
            Ok((
                r.get::<_, i64>(6)?,
                SearchHit {
                    id: r.get(0)?,
                    from: r.get(1)?,
                    subject: r.get(2)?,
                    thread: r.get(3)?,
                    kind: r.get(4)?,
                    ts: r.get(5)?,
                    snippet: String::new(),
                    rank: -r.get::<_, f64>(7)?,
                },
            ))
        })?
        .collect::<Result<Vec<_>, _>>()?;
    let mut snippet = conn.prepare_cached(
        "SELECT snippet(message_search, 2, '', '', '…', 16) FROM message_search
         WHERE message_search MATCH ?1 AND rowid = ?2",
    )?;
    let mut messages = Vec::new();
    let mut bytes = 0usize;
    let mut cut = false;
    for (i, (rowid, mut hit)) in rows.into_iter().enumerate() {
        if i as u32 >= limit {
            cut = true;
            break;
        }
        let text: Option<String> = snippet
            .query_row(params![q.fts, rowid], |r| r.get(0))
            .optional()?
            .flatten();
        hit.snippet = bound_snippet(text.unwrap_or_default());
        let size = serde_json::to_string(&hit).map_or(0, |s| s.len());
        if !messages.is_empty() && bytes + size > MAX_SEARCH_BYTES {
            cut = true;
            break;
        }
        bytes += size;
        messages.push(hit);
    }
    let next = offset + messages.len() as u32;
    Ok(SearchPage {
        next_cursor: (cut && next <= MAX_SEARCH_OFFSET).then(|| next.to_string()),
        messages,
    })
}

#[cfg(test)]
mod tests {
    use rusqlite::params;

    use super::*;
    use crate::mailbox::messages;
    use crate::testutil::{self, T0};

    /// The bundled SQLite has FTS5 compiled in (rusqlite's `bundled` feature).
    #[test]
    fn the_bundled_sqlite_has_fts5() {
        let c = Connection::open_in_memory().unwrap();
        let used: i64 = c
            .query_row("SELECT sqlite_compileoption_used('ENABLE_FTS5')", [], |r| {
                r.get(0)
            })
            .unwrap();
        assert_eq!(used, 1);
        c.execute_batch("CREATE VIRTUAL TABLE t USING fts5(x)")
            .unwrap();
    }

    fn words(q: &str) -> Vec<(String, bool)> {
        parse_query(q).unwrap().words
    }

    #[test]
    fn a_query_is_words_never_fts_syntax() {
        let w = |s: &str| (s.to_string(), false);
        assert_eq!(words("deploy plan"), vec![w("deploy"), w("plan")]);
        assert_eq!(
            words("\"deploy\" NEAR(plan, 2)"),
            vec![w("deploy"), w("NEAR"), w("plan"), w("2")]
        );
        assert_eq!(words("subject:deploy"), vec![w("subject"), w("deploy")]);
        assert_eq!(words("^a OR (b)"), vec![w("a"), w("OR"), w("b")]);
        assert_eq!(words("deplo* x"), vec![("deplo".to_string(), true), w("x")]);
        assert_eq!(words("café «ok»"), vec![w("café"), w("«ok»")]);
        assert_eq!(
            parse_query("deplo* AND x").unwrap().fts,
            r#""deplo"* "AND" "x""#
        );
        // A word with no letter or digit is left out of the expression.
        assert_eq!(parse_query("«» go").unwrap().fts, r#""go""#);
        assert_eq!(parse_query("«»").unwrap().fts, "");
        for bad in [
            "",
            "a",
            "**",
            " *",
            "\"\"",
            "()",
            "  \t ",
            "\u{3000}\u{3000}",
            "-:",
        ] {
            assert!(
                matches!(parse_query(bad), Err(MailboxError::Invalid(_))),
                "{bad:?}"
            );
        }
        // Bounds, in characters.
        assert!(parse_query(&"é".repeat(MAX_QUERY_CHARS)).is_ok());
        assert!(parse_query(&"é".repeat(MAX_QUERY_CHARS + 1)).is_err());
        assert!(parse_query("ab").is_ok());
    }

    #[test]
    fn cursors_are_small_offsets() {
        assert_eq!(parse_cursor(None).unwrap(), 0);
        assert_eq!(parse_cursor(Some("")).unwrap(), 0);
        assert_eq!(parse_cursor(Some("9999")).unwrap(), 9999);
        for bad in ["10000", "-1", "+1", "x", "1 ", "alice.1"] {
            assert!(parse_cursor(Some(bad)).is_err(), "{bad:?}");
        }
    }

    /// Stores a message `id` from `from` with `subject` and `body`, delivered to `to`.
    fn put(c: &Connection, id: &str, from: &str, to: &str, subject: &str, body: &str, ts: &str) {
        let env = serde_json::json!({"id": id, "ts": ts, "from": from, "to": [to], "thread": id,
            "kind": "message", "subject": subject, "body": body});
        assert!(messages::insert(c, &env, "local", T0).unwrap());
        messages::deliver(c, id, to, T0).unwrap();
    }

    fn ids(page: &SearchPage) -> Vec<&str> {
        page.messages.iter().map(|m| m.id.as_str()).collect()
    }

    #[test]
    fn ranked_visible_to_the_agent_and_bounded() {
        let s = testutil::store();
        s.mailbox
            .with(|c| {
                let t = "2026-01-01T00:00:00.000Z";
                put(
                    c,
                    "once",
                    "alice@home",
                    "bob",
                    "plan",
                    "deploy the api later today",
                    t,
                );
                put(
                    c,
                    "twice",
                    "alice@home",
                    "bob",
                    "plan",
                    "deploy and deploy again today",
                    t,
                );
                put(
                    c,
                    "none",
                    "alice@home",
                    "bob",
                    "plan",
                    "nothing to see here at all",
                    t,
                );
                put(
                    c,
                    "carol",
                    "alice@home",
                    "carol",
                    "plan",
                    "deploy deploy deploy",
                    t,
                );
                let q = parse_query("deploy")?;
                let page = search(c, "bob", "home", &q, None, 10)?;
                // Twice ranks above once; carol's mail is not bob's.
                assert_eq!(ids(&page), vec!["twice", "once"]);
                assert!(page.messages[0].rank > page.messages[1].rank);
                assert!(page.next_cursor.is_none());
                assert_eq!(page.messages[0].snippet, "deploy and deploy again today");
                assert_eq!(page.messages[0].from, "alice@home");
                // Bob's own sent mail is his to find too.
                put(
                    c,
                    "sent",
                    "bob@home",
                    "carol",
                    "notes",
                    "deploy once more, by bob",
                    t,
                );
                let page = search(c, "bob", "home", &q, None, 10)?;
                assert_eq!(page.messages.len(), 3);
                assert!(ids(&page).contains(&"sent"));
                // Pages by count, with a cursor: each match once.
                let p1 = search(c, "bob", "home", &q, None, 2)?;
                assert_eq!(p1.messages.len(), 2);
                assert_eq!(p1.next_cursor.as_deref(), Some("2"));
                let p2 = search(c, "bob", "home", &q, p1.next_cursor.as_deref(), 2)?;
                assert_eq!(p2.messages.len(), 1);
                assert!(p2.next_cursor.is_none());
                let mut all: Vec<&str> = ids(&p1).into_iter().chain(ids(&p2)).collect();
                all.sort();
                assert_eq!(all, vec!["once", "sent", "twice"]);
                // Prefix, every word, case and diacritics ignored.
                let page = search(c, "bob", "home", &parse_query("DEPL* TODAY")?, None, 10)?;
                assert_eq!(ids(&page), vec!["twice", "once"]);
                let page = search(c, "bob", "home", &parse_query("dep today")?, None, 10)?;
                assert!(page.messages.is_empty());
                let page = search(c, "carol", "home", &parse_query("«»")?, None, 10)?;
                assert!(page.messages.is_empty());
                Ok(())
            })
            .unwrap();
    }

    #[test]
    fn pages_and_snippets_are_bounded_in_bytes() {
        let s = testutil::store();
        s.mailbox
            .with(|c| {
                let t = "2026-01-01T00:00:00.000Z";
                let subject = "needle ".repeat(200);
                let long_word = "x".repeat(5000);
                for i in 0..60 {
                    put(
                        c,
                        &format!("m{i:02}"),
                        "alice@home",
                        "bob",
                        &subject,
                        &format!("needle {long_word} {}", "word ".repeat(500)),
                        t,
                    );
                }
                let q = parse_query("needle")?;
                let mut cursor: Option<String> = None;
                let mut seen = Vec::new();
                let mut pages = 0;
                let mut first = 0;
                loop {
                    let page = search(c, "bob", "home", &q, cursor.as_deref(), MAX_SEARCH_LIMIT)?;
                    let size: usize = page
                        .messages
                        .iter()
                        .map(|m| serde_json::to_string(m).unwrap().len())
                        .sum();
                    assert!(size <= MAX_SEARCH_BYTES, "{size}");
                    assert!(!page.messages.is_empty());
                    if pages == 0 {
                        first = page.messages.len();
                    }
                    pages += 1;
                    for m in &page.messages {
                        assert!(m.snippet.chars().count() <= MAX_SNIPPET_CHARS);
                        seen.push(m.id.clone());
                    }
                    match page.next_cursor {
                        Some(next) => cursor = Some(next),
                        None => break,
                    }
                }
                seen.sort();
                seen.dedup();
                assert_eq!(seen.len(), 60, "every match once across the pages");
                assert!(
                    first < MAX_SEARCH_LIMIT as usize && pages >= 2,
                    "the byte budget cut the pages below 50: {first} on the first of {pages}"
                );
                Ok(())
            })
            .unwrap();
    }

    /// A measurement, not a check (run with `--ignored --nocapture`): search time over a
    /// mailbox of 10,000 messages of ~100 words for a word in every message and a rare one.
    #[test]
    #[ignore]
    fn search_latency_on_ten_thousand_messages() {
        let s = testutil::store();
        s.mailbox
            .with(|c| {
                let tx = c.transaction()?;
                let words = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta"];
                for i in 0..10_000 {
                    let body: Vec<&str> = (0..100).map(|j| words[(i * 7 + j) % 7]).collect();
                    let mut body = body.join(" ");
                    if i % 1000 == 0 {
                        body.push_str(" okapi");
                    }
                    let t = "2026-01-01T00:00:00.000Z";
                    put(
                        &tx,
                        &format!("m{i:05}"),
                        "alice@home",
                        "bob",
                        "status",
                        &body,
                        t,
                    );
                }
                tx.commit()?;
                for q in ["alpha", "okapi", "alp*", "alpha beta gamma"] {
                    let parsed = parse_query(q)?;
                    let started = std::time::Instant::now();
                    let runs = 20;
                    let mut n = 0;
                    for _ in 0..runs {
                        n = search(c, "bob", "home", &parsed, None, MAX_SEARCH_LIMIT)?
                            .messages
                            .len();
                    }
                    let ms = started.elapsed().as_secs_f64() * 1000.0 / runs as f64;
                    println!("search {q:?}: {n} results on the first page, {ms:.1} ms a page");
                }
                Ok(())
            })
            .unwrap();
    }

    /// The index follows the messages table in the writer's transaction: a rolled-back insert
    /// leaves nothing to find, a committed one is found.
    #[test]
    fn the_index_is_written_with_the_message() {
        let s = testutil::store();
        s.mailbox
            .with(|c| {
                let t = "2026-01-01T00:00:00.000Z";
                let tx = c.transaction()?;
                put(
                    &tx,
                    "gone",
                    "alice@home",
                    "bob",
                    "plan",
                    "rollback words",
                    t,
                );
                drop(tx);
                let tx = c.transaction()?;
                put(&tx, "kept", "alice@home", "bob", "plan", "commit words", t);
                tx.commit()?;
                let n: i64 = c.query_row(
                    "SELECT COUNT(*) FROM message_search WHERE msg_id = ?1",
                    params!["gone"],
                    |r| r.get(0),
                )?;
                assert_eq!(n, 0);
                let page = search(c, "bob", "home", &parse_query("words")?, None, 10)?;
                assert_eq!(ids(&page), vec!["kept"]);
                Ok(())
            })
            .unwrap();
    }
}
