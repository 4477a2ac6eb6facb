//! `agentmbx send | inbox | read | ack | sent`: front-ends of the local API for agents and
//! people (`wire.md` §5 flags: `send --as <agent> --to <addr,…> --subject <s> [-m <body>|
//! --body-file <f>|stdin]`, `inbox --as <agent>`, `sent --as <agent>`). They talk to the running daemon over loopback with the
//! token from `api.token`. Every mutating call (`send`, `ack`) carries one `Idempotency-Key`
//! per invocation (or `--idempotency-key`) and is retried with it until the daemon settles it
//! (`DEFAULT_RETRY_MS`); the CLI never reports a failure for what may have been done: an
//! unsettled call exits 75 with the key and how to check (`Api::mutate`).

use std::io::Read;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context;
use clap::Args;
use serde_json::{json, Value};

use crate::local_api::{block_on, enc, mint_key, Api, Mutation, Query};

/// The body flags of `send` and `reply`; read by [`read_body`].
#[derive(Debug, Args)]
pub struct BodyArgs {
    /// Body text (else --body-file, else stdin when it is not a terminal)
    #[arg(
        short = 'm',
        long = "message",
        value_name = "BODY",
        conflicts_with = "body_file"
    )]
    pub message: Option<String>,
    /// Read the body from a file
    #[arg(long, value_name = "FILE")]
    pub body_file: Option<PathBuf>,
}

/// Flags of `send`.
#[derive(Debug, Args)]
pub struct SendArgs {
    /// The sending agent's name on this host
    #[arg(long = "as", value_name = "AGENT", env = "MBX_AGENT")]
    pub as_agent: String,
    /// Recipients, comma-separated: agent (an agent here, else on the one paired host that
    /// lists it; a name known nowhere is refused with the closest names, exit 3), agent@host,
    /// role:R (that role here and on every paired host), * (every mailbox here and every
    /// paired host), owner
    #[arg(long, value_name = "ADDR,…", value_delimiter = ',', required = true, value_parser = address)]
    pub to: Vec<String>,
    /// Create a new mailbox on this host for each bare --to name that is no agent here nor on
    /// any paired host, and deliver to it (without it such a name is refused as a likely typo)
    #[arg(long)]
    pub new_mailbox: bool,
    /// One-line subject
    #[arg(long)]
    pub subject: String,
    #[command(flatten)]
    pub body: BodyArgs,
    /// Kind: message, request, reply, status, decision, alert, task (default message, or
    /// reply with --reply-to)
    #[arg(long)]
    pub kind: Option<String>,
    /// Message id this replies to (one delivered to the agent or sent by it): the message
    /// continues that message's thread
    #[arg(long, value_name = "ID")]
    pub reply_to: Option<String>,
    /// Thread id to send in (default: the --reply-to message's thread, else a new thread)
    #[arg(long, value_name = "THREAD")]
    pub thread: Option<String>,
    /// Ask for a reply
    #[arg(long)]
    pub needs_reply: bool,
    /// A reference (repeatable)
    #[arg(long = "ref", value_name = "REF")]
    pub refs: Vec<String>,
    /// Send to agent@host even when that host's agent directory (known here once fetched)
    /// lists no such agent, e.g. an agent that will register there later: the host holds the
    /// message until it does. Without it such an address is refused (exit 3) with the agents
    /// the host has
    #[arg(long)]
    pub force: bool,
    /// The Idempotency-Key to send with (default: a fresh random key). Rerunning the same
    /// command with the key printed by a send that exited 75 cannot send it twice; the key
    /// with another message is refused
    #[arg(long, value_name = "KEY", value_parser = parse_key)]
    pub idempotency_key: Option<String>,
    /// Print the API answer as JSON
    #[arg(long)]
    pub json: bool,
}

/// One `--to` address: spaces around it are dropped (`--to "alice, bob@hostb"`); an empty one
/// (`--to a,,b`) is a usage error.
fn address(s: &str) -> Result<String, String> {
    let t = s.trim();
    if t.is_empty() {
        Err("an empty address (two commas in a row, or a trailing comma?)".into())
    } else {
        Ok(t.to_string())
    }
}

/// Flags of `inbox`.
#[derive(Debug, Args)]
pub struct InboxArgs {
    /// The agent whose inbox to list (a name that is no agent here is refused, exit 3)
    #[arg(
        long = "as",
        value_name = "AGENT",
        env = "MBX_AGENT",
        required_unless_present = "unclaimed"
    )]
    pub as_agent: Option<String>,
    /// List instead the mail this host holds for names it has no agent for (mail from a
    /// paired host to name@<this host>): no inbox shows it and no delivered receipt went back;
    /// `agentmbx whoami --as <name>` makes it that agent's mail and sends the receipts
    /// (--as is not needed and not used)
    #[arg(long, conflicts_with_all = ["all", "cursor", "needs_reply", "from"])]
    pub unclaimed: bool,
    /// Include acked messages
    #[arg(long)]
    pub all: bool,
    /// Page size, 1..=200
    #[arg(long, default_value_t = 50)]
    pub limit: u32,
    /// Cursor from a previous page
    #[arg(long)]
    pub cursor: Option<String>,
    /// Only messages that ask for a reply
    #[arg(long)]
    pub needs_reply: bool,
    /// Only messages from this sender: name@host, or a bare name (from any host)
    #[arg(long, value_name = "SENDER")]
    pub from: Option<String>,
    /// When there is nothing to list, wait up to this many seconds (0..=60) for mail to arrive
    /// (after --cursor when given) and list it as soon as it is committed; an empty listing on
    /// timeout. Prints the position to pass as --cursor next, so nothing is missed between runs
    #[arg(long, value_name = "SECONDS", value_parser = clap::value_parser!(u32).range(0..=60))]
    pub wait: Option<u32>,
    /// Print the page as JSON
    #[arg(long)]
    pub json: bool,
}

/// Flags of `reply`.
#[derive(Debug, Args)]
pub struct ReplyArgs {
    /// Id of the message to answer (delivered to the agent or sent by it)
    pub id: String,
    /// The replying agent's name on this host
    #[arg(long = "as", value_name = "AGENT", env = "MBX_AGENT")]
    pub as_agent: String,
    #[command(flatten)]
    pub body: BodyArgs,
    /// Kind: message, request, reply, status, decision, alert, task (default reply)
    #[arg(long)]
    pub kind: Option<String>,
    /// Ask for a reply
    #[arg(long)]
    pub needs_reply: bool,
    /// A reference (repeatable)
    #[arg(long = "ref", value_name = "REF")]
    pub refs: Vec<String>,
    /// The Idempotency-Key to send with (default: a fresh random key); as for `send`
    #[arg(long, value_name = "KEY", value_parser = parse_key)]
    pub idempotency_key: Option<String>,
    /// Print the API answer as JSON
    #[arg(long)]
    pub json: bool,
}

/// Flags of `thread`.
#[derive(Debug, Args)]
pub struct ThreadArgs {
    /// A message id (its thread is shown) or a thread id
    pub id: String,
    /// The agent whose view of the thread to show
    #[arg(long = "as", value_name = "AGENT", env = "MBX_AGENT")]
    pub as_agent: String,
    /// Page size, 1..=200 (pages are also bounded to 256 KiB)
    #[arg(long, default_value_t = 50)]
    pub limit: u32,
    /// Cursor from a previous page
    #[arg(long)]
    pub cursor: Option<String>,
    /// Print the page as JSON
    #[arg(long)]
    pub json: bool,
}

/// Flags of `search`.
#[derive(Debug, Args)]
pub struct SearchArgs {
    /// Words to find (joined by spaces; 2..=200 characters): a message matches when its
    /// subject or body holds every word, case and accents ignored; punctuation only separates
    /// words (quotes, NEAR, AND/OR/NOT, subject: are plain words or nothing); `word*` matches
    /// words starting with `word`
    #[arg(required = true, value_name = "WORDS")]
    pub words: Vec<String>,
    /// The agent whose mail to search: delivered to it, or sent by it (a name that is no agent
    /// here is refused, exit 3)
    #[arg(long = "as", value_name = "AGENT", env = "MBX_AGENT")]
    pub as_agent: String,
    /// Results per page, 1..=50, best first (pages are also bounded to 64 KiB)
    #[arg(long, default_value_t = 10, value_parser = clap::value_parser!(u32).range(1..=50))]
    pub limit: u32,
    /// Cursor from a previous page of the same search
    #[arg(long)]
    pub cursor: Option<String>,
    /// Print the page as JSON
    #[arg(long)]
    pub json: bool,
}

/// Flags of `read`.
#[derive(Debug, Args)]
pub struct ReadArgs {
    /// Message id
    pub id: String,
    /// The reading agent (a name that is no agent here is refused, exit 3)
    #[arg(long = "as", value_name = "AGENT", env = "MBX_AGENT")]
    pub as_agent: String,
    /// Print the message as JSON
    #[arg(long)]
    pub json: bool,
}

/// Flags of `ack`.
#[derive(Debug, Args)]
pub struct AckArgs {
    /// Message ids
    #[arg(required = true)]
    pub ids: Vec<String>,
    /// The acking agent
    #[arg(long = "as", value_name = "AGENT", env = "MBX_AGENT")]
    pub as_agent: String,
    /// A note kept with the ack and carried in the delivery receipt: at most 500 UTF-16 code
    /// units (an emoji counts two); a longer one is refused and nothing is acked
    #[arg(long)]
    pub note: Option<String>,
    /// The Idempotency-Key to send with (default: a fresh random key); as for `send`
    #[arg(long, value_name = "KEY", value_parser = parse_key)]
    pub idempotency_key: Option<String>,
    /// Print the answer as JSON
    #[arg(long)]
    pub json: bool,
}

/// Flags of `sent`.
#[derive(Debug, Args)]
pub struct SentArgs {
    /// The agent whose sent messages to list
    #[arg(long = "as", value_name = "AGENT", env = "MBX_AGENT")]
    pub as_agent: String,
    /// Page size, 1..=100
    #[arg(long, default_value_t = 20)]
    pub limit: u32,
    /// Cursor from a previous page
    #[arg(long)]
    pub cursor: Option<String>,
    /// Print the page as JSON
    #[arg(long)]
    pub json: bool,
}

/// Parses `--idempotency-key`: 1..=200 visible ASCII characters, no spaces (the API's header).
fn parse_key(s: &str) -> Result<String, String> {
    let max = agentmbx::api::MAX_IDEMPOTENCY_KEY;
    if (1..=max).contains(&s.len()) && s.bytes().all(|b| b.is_ascii_graphic()) {
        Ok(s.to_string())
    } else {
        Err(format!(
            "an idempotency key is 1 to {max} visible ASCII characters without spaces"
        ))
    }
}

/// The body: `-m`, else `--body-file`, else stdin when it is not a terminal, else empty.
fn read_body(
    BodyArgs {
        message,
        body_file: file,
    }: &BodyArgs,
) -> anyhow::Result<String> {
    Ok(match (message, file) {
        (Some(m), _) => m.clone(),
        (None, Some(f)) => {
            std::fs::read_to_string(f).with_context(|| format!("cannot read {}", f.display()))?
        }
        (None, None) => {
            use std::io::IsTerminal;
            let mut s = String::new();
            if !std::io::stdin().is_terminal() {
                std::io::stdin()
                    .read_to_string(&mut s)
                    .context("cannot read the body from stdin")?;
            }
            s
        }
    })
}

/// Prints a send's answer (`send`, `reply`).
fn print_sent(out: &Value, json: bool) -> anyhow::Result<()> {
    if json {
        println!("{}", serde_json::to_string_pretty(out)?);
        return Ok(());
    }
    println!(
        "sent {} (thread {})",
        out["id"].as_str().unwrap_or_default(),
        out["thread"].as_str().unwrap_or_default()
    );
    for r in out["recipients"].as_array().into_iter().flatten() {
        let to = r["to"].as_str().unwrap_or_default();
        match r["route"].as_str() {
            Some("local") => println!("  {to}: delivered on this host"),
            _ => println!(
                "  {to}: queued for {}",
                r["host"].as_str().unwrap_or_default()
            ),
        }
    }
    for w in out["warnings"].as_array().into_iter().flatten() {
        println!("  warning: {}", w.as_str().unwrap_or_default());
    }
    Ok(())
}

/// `send`.
pub fn send(args: SendArgs) -> anyhow::Result<()> {
    let body = read_body(&args.body)?;
    let req = json!({
        "from": args.as_agent, "to": args.to, "subject": args.subject, "body": body,
        "kind": args.kind, "thread": args.thread, "reply_to": args.reply_to,
        "needs_reply": args.needs_reply, "refs": args.refs, "new_mailbox": args.new_mailbox,
        "force": args.force,
    });
    let api = Api::connect()?;
    let key = args.idempotency_key.clone().unwrap_or_else(mint_key);
    let m = Mutation {
        what: "send",
        key: &key,
        check: format!("agentmbx sent --as {}", args.as_agent),
    };
    let out = block_on(api.mutate("/v1/messages", &req, &m))?;
    print_sent(&out, args.json)
}

/// `reply`: answers a message (to its sender, in its thread, subject `Re: …`).
pub fn reply(args: ReplyArgs) -> anyhow::Result<()> {
    let body = read_body(&args.body)?;
    let req = json!({
        "from": args.as_agent, "body": body, "kind": args.kind,
        "needs_reply": args.needs_reply, "refs": args.refs,
    });
    let api = Api::connect()?;
    let key = args.idempotency_key.clone().unwrap_or_else(mint_key);
    let m = Mutation {
        what: "reply",
        key: &key,
        check: format!("agentmbx sent --as {}", args.as_agent),
    };
    let path = format!("/v1/messages/{}/reply", enc(&args.id));
    let out = block_on(api.mutate(&path, &req, &m))?;
    print_sent(&out, args.json)
}

/// The flags part of a message line: kind (unless `message`), `needs-reply`, the thread when it
/// is not the message's own, and what it replies to.
fn tags(m: &Value) -> String {
    let id = m["id"].as_str().unwrap_or_default();
    let mut tags = vec![format!("kind:{}", m["kind"].as_str().unwrap_or("message"))];
    if m["needs_reply"].as_bool() == Some(true) {
        tags.push("needs-reply".into());
    }
    let thread = m["thread"].as_str().unwrap_or_default();
    if !thread.is_empty() && thread != id {
        tags.push(format!("thread:{thread}"));
    }
    if let Some(r) = m["reply_to"].as_str() {
        tags.push(format!("re:{r}"));
    }
    tags.join(" ")
}

/// `thread`: the messages of a thread the agent can see, oldest first, with bodies.
pub fn thread(args: ThreadArgs) -> anyhow::Result<()> {
    let mut path = format!(
        "/v1/threads/{}?as={}&limit={}",
        enc(&args.id),
        enc(&args.as_agent),
        args.limit
    );
    if let Some(c) = &args.cursor {
        path.push_str(&format!("&cursor={}", enc(c)));
    }
    let api = Api::connect()?;
    let q = Query {
        what: "thread listing",
        changes: None,
    };
    let page = block_on(api.get(&path, &q))?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&page)?);
        return Ok(());
    }
    println!("thread {}", page["thread"].as_str().unwrap_or_default());
    for m in page["messages"].as_array().into_iter().flatten() {
        println!();
        println!(
            "{}  {}  {}  {}",
            m["id"].as_str().unwrap_or_default(),
            m["ts"].as_str().unwrap_or_default(),
            m["from"].as_str().unwrap_or_default(),
            tags(m)
        );
        println!("subject: {}", m["subject"].as_str().unwrap_or_default());
        println!("{}", m["body"].as_str().unwrap_or_default());
    }
    if let Some(c) = page["next_cursor"].as_str() {
        eprintln!(
            "more: agentmbx thread {} --as {} --cursor {c}",
            args.id, args.as_agent
        );
    }
    Ok(())
}

/// `inbox --unclaimed`: what this host holds for names it has no agent for, oldest first.
fn unclaimed(args: &InboxArgs) -> anyhow::Result<()> {
    let api = Api::connect()?;
    let q = Query {
        what: "unclaimed listing",
        changes: None,
    };
    let page = block_on(api.get(&format!("/v1/unclaimed?limit={}", args.limit), &q))?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&page)?);
        return Ok(());
    }
    let msgs = page["messages"].as_array().cloned().unwrap_or_default();
    if msgs.is_empty() {
        println!("no unclaimed messages");
        return Ok(());
    }
    for m in &msgs {
        println!(
            "{}  for {}  since {}  {}  {}",
            m["id"].as_str().unwrap_or_default(),
            m["name"].as_str().unwrap_or_default(),
            m["since"].as_str().unwrap_or_default(),
            m["from"].as_str().unwrap_or_default(),
            printable(m["subject"].as_str().unwrap_or_default())
        );
    }
    let total = page["total"].as_u64().unwrap_or(0);
    if total > msgs.len() as u64 {
        eprintln!(
            "more: {} of {total} shown; agentmbx inbox --unclaimed --limit 200",
            msgs.len()
        );
    }
    eprintln!(
        "held until an agent of that name registers here: agentmbx whoami --as <name> (its delivered receipts go out then)"
    );
    Ok(())
}

/// `inbox` (`--unclaimed`: the mail held for names this host has no agent for).
pub fn inbox(args: InboxArgs) -> anyhow::Result<()> {
    if args.unclaimed {
        return unclaimed(&args);
    }
    let as_agent = args.as_agent.clone().unwrap_or_default();
    let mut path = format!(
        "/v1/inbox?as={}&limit={}&all={}",
        enc(&as_agent),
        args.limit,
        args.all
    );
    if let Some(c) = &args.cursor {
        path.push_str(&format!("&cursor={}", enc(c)));
    }
    if args.needs_reply {
        path.push_str("&needs_reply=true");
    }
    if let Some(f) = &args.from {
        path.push_str(&format!("&from={}", enc(f)));
    }
    let mut api = Api::connect()?;
    if let Some(wait) = args.wait {
        path.push_str(&format!("&wait={wait}"));
        api.wait = Duration::from_secs(wait.into());
    }
    let q = Query {
        what: "inbox listing",
        changes: None,
    };
    let page = block_on(api.get(&path, &q))?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&page)?);
        return Ok(());
    }
    let msgs = page["messages"].as_array().cloned().unwrap_or_default();
    if msgs.is_empty() {
        println!("no messages for {as_agent}");
    }
    for m in msgs {
        println!(
            "{}  {:4}  {}  {}  {}  [{}]",
            m["id"].as_str().unwrap_or_default(),
            m["state"].as_str().unwrap_or_default(),
            m["ts"].as_str().unwrap_or_default(),
            m["from"].as_str().unwrap_or_default(),
            m["subject"].as_str().unwrap_or_default(),
            tags(&m)
        );
    }
    if let Some(c) = page["next_cursor"].as_str() {
        eprintln!("more: agentmbx inbox --as {as_agent} --cursor {c}");
    } else if let (Some(wait), Some(c)) = (args.wait, page["cursor"].as_str()) {
        eprintln!("next: agentmbx inbox --as {as_agent} --cursor {c} --wait {wait}");
    }
    Ok(())
}

/// `search`: the agent's mail matching the words, best first, with a snippet of each body.
pub fn search(args: SearchArgs) -> anyhow::Result<()> {
    let words = args.words.join(" ");
    let mut path = format!(
        "/v1/search?as={}&q={}&limit={}",
        enc(&args.as_agent),
        enc(&words),
        args.limit
    );
    if let Some(c) = &args.cursor {
        path.push_str(&format!("&cursor={}", enc(c)));
    }
    let api = Api::connect()?;
    let q = Query {
        what: "search",
        changes: None,
    };
    let page = block_on(api.get(&path, &q))?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&page)?);
        return Ok(());
    }
    let hits = page["messages"].as_array().cloned().unwrap_or_default();
    if hits.is_empty() {
        println!("no messages of {} match", args.as_agent);
    }
    for m in &hits {
        println!(
            "{}  {}  {}  {}  [{}]",
            m["id"].as_str().unwrap_or_default(),
            m["ts"].as_str().unwrap_or_default(),
            m["from"].as_str().unwrap_or_default(),
            printable(m["subject"].as_str().unwrap_or_default()),
            tags(m)
        );
        println!(
            "    {}",
            printable(m["snippet"].as_str().unwrap_or_default())
        );
    }
    if let Some(c) = page["next_cursor"].as_str() {
        eprintln!(
            "more: agentmbx search --as {} --limit {} --cursor {c} -- {}",
            args.as_agent,
            args.limit,
            // Quoted: a word such as `deplo*` is not expanded by the shell the line is pasted in.
            args.words
                .iter()
                .map(|w| agentmbx::doctor::shell_quote(w))
                .collect::<Vec<_>>()
                .join(" ")
        );
    }
    Ok(())
}

/// `read`.
pub fn read(args: ReadArgs) -> anyhow::Result<()> {
    let api = Api::connect()?;
    let q = Query {
        what: "read",
        changes: Some((
            "the message may have been marked read (and its read receipt queued)",
            format!("agentmbx inbox --as {} --all", args.as_agent),
        )),
    };
    let path = format!("/v1/messages/{}?as={}", enc(&args.id), enc(&args.as_agent));
    let m = block_on(api.get(&path, &q))?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&m)?);
    } else {
        println!("id: {}", m["id"].as_str().unwrap_or_default());
        println!("from: {}", m["from"].as_str().unwrap_or_default());
        println!(
            "to: {}",
            m["to"]
                .as_array()
                .map(|a| a
                    .iter()
                    .filter_map(Value::as_str)
                    .collect::<Vec<_>>()
                    .join(", "))
                .unwrap_or_default()
        );
        println!("date: {}", m["ts"].as_str().unwrap_or_default());
        println!("kind: {}", m["kind"].as_str().unwrap_or_default());
        println!(
            "needs-reply: {}",
            if m["needs_reply"].as_bool() == Some(true) {
                "yes"
            } else {
                "no"
            }
        );
        println!("thread: {}", m["thread"].as_str().unwrap_or_default());
        if let Some(r) = m["reply_to"].as_str() {
            println!("reply-to: {r}");
        }
        println!("subject: {}", m["subject"].as_str().unwrap_or_default());
        println!();
        println!("{}", m["body"].as_str().unwrap_or_default());
    }
    Ok(())
}

/// `ack`.
pub fn ack(args: AckArgs) -> anyhow::Result<()> {
    let api = Api::connect()?;
    let key = args.idempotency_key.clone().unwrap_or_else(mint_key);
    let m = Mutation {
        what: "ack",
        key: &key,
        check: format!("agentmbx inbox --as {} --all", args.as_agent),
    };
    let req = json!({"as": args.as_agent, "ids": args.ids, "note": args.note});
    let out = block_on(api.mutate("/v1/ack", &req, &m))?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&out)?);
    } else {
        println!("acked {}", out["acked"].as_u64().unwrap_or(0));
    }
    Ok(())
}

/// `sent`: each message newest first, then one line per recipient with its state: `queued`,
/// `relay-accepted`, `repush`, `accepted` (the host took it; the named agent's delivered
/// receipt has not come back: the host may hold it for an agent it does not have yet),
/// `delivered` (or the receipt's `notified`, `read`, `acked`),
/// `undelivered`, `expired`, `unconfirmed`; with the reason when undelivered, expired or
/// unconfirmed (`: <reason>`), the last error when queued or re-pushed (`queued (<last
/// error>)`) and, when the relay is not working either, its standing (`(relay unreachable
/// since <time>: <detail>)`); for queued mail the route its host is on and why (`[route: relay
/// (LAN unreachable since <time> (<reason>), next LAN probe in <wait>)]`), and a late LAN
/// verdict that disagreed with a relay's settlement; all with anything but printable text
/// escaped.
pub fn sent(args: SentArgs) -> anyhow::Result<()> {
    let mut path = format!("/v1/sent?as={}&limit={}", enc(&args.as_agent), args.limit);
    if let Some(c) = &args.cursor {
        path.push_str(&format!("&cursor={}", enc(c)));
    }
    let api = Api::connect()?;
    let q = Query {
        what: "sent listing",
        changes: None,
    };
    let page = block_on(api.get(&path, &q))?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&page)?);
        return Ok(());
    }
    let msgs = page["messages"].as_array().cloned().unwrap_or_default();
    if msgs.is_empty() {
        println!("no sent messages for {}", args.as_agent);
    }
    for m in msgs {
        println!(
            "{}  {}  {}",
            m["id"].as_str().unwrap_or_default(),
            m["ts"].as_str().unwrap_or_default(),
            m["subject"].as_str().unwrap_or_default()
        );
        for r in m["recipients"].as_array().into_iter().flatten() {
            let mut line = format!(
                "  {}: {}",
                r["recipient"].as_str().unwrap_or_default(),
                r["state"].as_str().unwrap_or_default()
            );
            if let Some(err) = r["last_error"].as_str() {
                line.push_str(&format!(" ({})", printable(err)));
            }
            if let Some(via) = r["via"].as_str() {
                line.push_str(&format!(" (via {via})"));
            }
            if let Some(relay) = r["relay"].as_str() {
                line.push_str(&format!(" (relay {})", printable(relay)));
            }
            if let Some(route) = r["route"].as_str() {
                line.push_str(&format!(" [route: {}]", printable(route)));
            }
            if let Some(late) = r["late_lan_verdict"].as_str() {
                line.push_str(&format!(
                    " (late LAN verdict, not applied: {})",
                    printable(late)
                ));
            }
            if let Some(why) = r["reason"].as_str() {
                line.push_str(&format!(": {}", printable(why)));
            }
            println!("{line}");
        }
    }
    if let Some(c) = page["next_cursor"].as_str() {
        eprintln!("more: agentmbx sent --as {} --cursor {c}", args.as_agent);
    }
    Ok(())
}

/// A relay's, a peer's or a LAN error text as a line may show it: control, bidi and other
/// format characters escaped (`\u{…}`), so it never drives the terminal.
fn printable(text: &str) -> String {
    let format = |c: char| {
        matches!(c, '\u{200b}'..='\u{200f}' | '\u{202a}'..='\u{202e}' | '\u{2060}'..='\u{2069}'
            | '\u{061c}' | '\u{feff}')
    };
    let mut out = String::new();
    for c in text.chars() {
        if c.is_control() || format(c) {
            out.extend(c.escape_default());
        } else {
            out.push(c);
        }
    }
    out
}

#[cfg(test)]
mod tests;
