//! `agentmbx watch --as <agent> [--json] [--after CURSOR] [--cursor-file FILE]`: prints each
//! new message for an agent as it arrives, from the daemon's event stream (`GET /v1/events`,
//! design issue 19 §1). What it prints is the hint (id, sender, kind, needs_reply, thread,
//! position), never the subject or body: read a message with `agentmbx read <id>`.
//!
//! Resuming: the stream's first event names the position it starts from, and every hint
//! carries its own (an inbox cursor). With `--cursor-file` the position is written to the file
//! (replaced atomically) at the start and after each printed hint, and read back at start, so
//! a watch stopped and started again prints what arrived in between; a watch killed between
//! printing a hint and writing its position prints that one hint again (never one missed). When the daemon stops or restarts, the watch reconnects with the last position
//! (`Last-Event-ID`), retrying every 1 s up to 10 s apart, until it is interrupted.

use std::path::PathBuf;
use std::time::Duration;

use clap::Args;
use serde_json::Value;

use super::TempFailError;
use crate::local_api::{enc, Api, DaemonDown};

/// Longest pause between two reconnects.
const MAX_BACKOFF: Duration = Duration::from_secs(10);

/// Flags of `watch`.
#[derive(Debug, Args)]
pub struct WatchArgs {
    /// The agent whose new mail to print
    #[arg(long = "as", value_name = "AGENT", env = "MBX_AGENT")]
    pub as_agent: String,
    /// Print each message as one JSON line: {cursor, id, from, thread, kind, needs_reply}
    #[arg(long)]
    pub json: bool,
    /// Start after this position (the cursor of a message printed earlier); default: the
    /// position in --cursor-file, else only mail that arrives from now on
    #[arg(long, value_name = "CURSOR")]
    pub after: Option<String>,
    /// Keep the position in this file: read at start to resume, replaced after each printed
    /// message, so a watch started again prints what arrived meanwhile and nothing twice
    #[arg(long, value_name = "FILE")]
    pub cursor_file: Option<PathBuf>,
}

/// Runs `watch` until interrupted. Errors: a bad agent name or cursor (exit 2), an agent this
/// host does not have (exit 3), an unreadable or unwritable cursor file (exit 1).
pub fn run(args: WatchArgs) -> anyhow::Result<()> {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?
        .block_on(watch(args))
}

async fn watch(args: WatchArgs) -> anyhow::Result<()> {
    let mut last = match (&args.after, &args.cursor_file) {
        (Some(c), _) => Some(c.clone()),
        (None, Some(f)) => read_position(f)?,
        (None, None) => None,
    };
    let path = format!("/v1/events?as={}", enc(&args.as_agent));
    let mut backoff = Duration::from_secs(1);
    let mut told_down = false;
    loop {
        // The token and address are read again on each try: a restarted daemon may have new ones.
        let opened = match Api::connect() {
            Ok(api) => api.open_stream(&path, last.as_deref()).await,
            Err(e) => Err(e),
        };
        let mut resp = match opened {
            Ok(resp) => resp,
            Err(e) if retryable(&e) => {
                if !told_down {
                    eprintln!("watch: {e:#}; trying again until interrupted");
                    told_down = true;
                }
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(MAX_BACKOFF);
                continue;
            }
            Err(e) => return Err(e),
        };
        if told_down {
            eprintln!("watch: connected again");
        } else {
            eprintln!(
                "watching mail for {} (Ctrl-C to stop){}",
                args.as_agent,
                last.as_deref()
                    .map(|c| format!(", after {c}"))
                    .unwrap_or_default()
            );
        }
        backoff = Duration::from_secs(1);
        let mut parser = SseParser::default();
        loop {
            let chunk = match resp.chunk().await {
                Ok(Some(chunk)) => chunk,
                // The stream ended (the daemon shuts down) or broke off: reconnect.
                Ok(None) | Err(_) => break,
            };
            for event in parser.feed(&chunk) {
                if event.kind == "open" {
                    // The position the stream starts from: a reconnect before any mail
                    // resumes there, and so does a watch started again from the file.
                    if let Some(id) = event.id {
                        save(&args, &id)?;
                        last = Some(id);
                    }
                    continue;
                }
                if event.kind != "mail" {
                    continue;
                }
                let Ok(hint) = serde_json::from_str::<Value>(&event.data) else {
                    continue;
                };
                print_hint(&hint, args.json);
                if let Some(id) = event.id {
                    save(&args, &id)?;
                    last = Some(id);
                }
            }
        }
        eprintln!("watch: the daemon closed the stream; reconnecting");
        told_down = true;
        tokio::time::sleep(backoff).await;
    }
}

/// Writes `id` to the cursor file, if there is one (replaced atomically).
fn save(args: &WatchArgs, id: &str) -> anyhow::Result<()> {
    if let Some(f) = &args.cursor_file {
        agentmbx::fsutil::replace(f, format!("{id}\n").as_bytes(), 0o600)
            .map_err(|e| anyhow::anyhow!("cannot write the cursor file {}: {e}", f.display()))?;
    }
    Ok(())
}

/// A failure worth another try: the daemon is down, restarting or busy.
fn retryable(e: &anyhow::Error) -> bool {
    e.downcast_ref::<DaemonDown>().is_some() || e.downcast_ref::<TempFailError>().is_some()
}

/// The position stored in `file`, or `None` when it does not exist yet or is empty.
fn read_position(file: &std::path::Path) -> anyhow::Result<Option<String>> {
    match std::fs::read_to_string(file) {
        Ok(text) => Ok(Some(text.trim().to_string()).filter(|c| !c.is_empty())),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(anyhow::anyhow!(
            "cannot read the cursor file {}: {e}",
            file.display()
        )),
    }
}

fn print_hint(hint: &Value, json: bool) {
    if json {
        println!("{hint}");
        return;
    }
    // Sender-chosen text (the thread) never reaches the terminal with its control characters.
    let s = |k: &str| {
        hint[k]
            .as_str()
            .unwrap_or_default()
            .chars()
            .map(|c| if c.is_control() { ' ' } else { c })
            .collect::<String>()
    };
    let needs = if hint["needs_reply"].as_bool() == Some(true) {
        ", needs a reply"
    } else {
        ""
    };
    println!(
        "{}  from {}  ({}{needs})  thread {}",
        s("id"),
        s("from"),
        s("kind"),
        s("thread")
    );
}

/// One Server-Sent Event: its `event` type (`message` when none was given), `id` and `data`.
#[derive(Debug, Clone, PartialEq, Eq)]
struct SseEvent {
    kind: String,
    id: Option<String>,
    data: String,
}

/// An incremental parser of the `text/event-stream` format (the WHATWG HTML standard, "Server-
/// sent events", §9.2.6 "Interpreting an event stream"): lines end in LF, CR or CRLF; a blank
/// line dispatches the event; `:` starts a comment; fields `event`, `data` (joined by LF),
/// `id`; `retry` and unknown fields are ignored.
#[derive(Debug, Default)]
struct SseParser {
    /// Bytes of an unfinished line.
    line: Vec<u8>,
    /// The last byte fed was a CR (an LF right after it ends nothing more).
    after_cr: bool,
    kind: String,
    id: Option<String>,
    data: Vec<String>,
}

impl SseParser {
    /// Feeds `bytes` and returns the events they complete.
    fn feed(&mut self, bytes: &[u8]) -> Vec<SseEvent> {
        let mut out = Vec::new();
        for &b in bytes {
            if b == b'\n' && self.after_cr {
                self.after_cr = false;
                continue;
            }
            self.after_cr = b == b'\r';
            if b == b'\n' || b == b'\r' {
                let line = String::from_utf8_lossy(&std::mem::take(&mut self.line)).into_owned();
                if let Some(event) = self.line_done(&line) {
                    out.push(event);
                }
            } else {
                self.line.push(b);
            }
        }
        out
    }

    fn line_done(&mut self, line: &str) -> Option<SseEvent> {
        if line.is_empty() {
            if self.data.is_empty() {
                self.kind.clear();
                return None;
            }
            let kind = std::mem::take(&mut self.kind);
            return Some(SseEvent {
                kind: if kind.is_empty() {
                    "message".into()
                } else {
                    kind
                },
                id: self.id.clone(),
                data: std::mem::take(&mut self.data).join("\n"),
            });
        }
        if line.starts_with(':') {
            return None;
        }
        let (field, value) = match line.split_once(':') {
            Some((f, v)) => (f, v.strip_prefix(' ').unwrap_or(v)),
            None => (line, ""),
        };
        match field {
            "event" => self.kind = value.to_string(),
            "data" => self.data.push(value.to_string()),
            "id" if !value.contains('\0') => self.id = Some(value.to_string()),
            _ => {}
        }
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn events_split_anywhere_and_any_line_ending_parse_the_same() {
        let text = ": keep-alive\n\nevent: mail\nid: bob.7\ndata: {\"id\":\"A\"}\n\n\
                    event: mail\r\nid: bob.8\r\ndata: {\"id\":\"B\"}\r\n\r\n\
                    data: one\rdata: two\r\r";
        let whole = SseParser::default().feed(text.as_bytes());
        assert_eq!(
            whole,
            vec![
                SseEvent {
                    kind: "mail".into(),
                    id: Some("bob.7".into()),
                    data: "{\"id\":\"A\"}".into()
                },
                SseEvent {
                    kind: "mail".into(),
                    id: Some("bob.8".into()),
                    data: "{\"id\":\"B\"}".into()
                },
                SseEvent {
                    kind: "message".into(),
                    id: Some("bob.8".into()),
                    data: "one\ntwo".into()
                },
            ]
        );
        // Fed one byte at a time (a CRLF split across chunks included): the same events.
        let mut p = SseParser::default();
        let bytewise: Vec<SseEvent> = text.bytes().flat_map(|b| p.feed(&[b])).collect();
        assert_eq!(bytewise, whole);
    }

    #[test]
    fn comments_and_an_event_without_data_dispatch_nothing() {
        let mut p = SseParser::default();
        assert!(p
            .feed(b": keep-alive\n\nevent: mail\nid: bob.1\n\n")
            .is_empty());
        // The id is kept for the next event, as the standard says.
        let next = p.feed(b"data: x\n\n");
        assert_eq!(next[0].id.as_deref(), Some("bob.1"));
        assert_eq!(next[0].kind, "message");
    }

    #[test]
    fn a_missing_cursor_file_is_no_position_and_a_blank_one_too() {
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("pos");
        assert_eq!(read_position(&f).unwrap(), None);
        std::fs::write(&f, "\n").unwrap();
        assert_eq!(read_position(&f).unwrap(), None);
        std::fs::write(&f, "bob.12\n").unwrap();
        assert_eq!(read_position(&f).unwrap().as_deref(), Some("bob.12"));
    }
}
