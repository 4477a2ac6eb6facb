//! `agentmbx send | inbox | read | ack | sent`: front-ends of the local API for agents and
//! people (`wire.md` §5 flags: `send --as <agent> --to <addr,…> --subject <s> [-m <body>|
//! --body-file <f>|stdin]`, `inbox --as <agent>`, `sent --as <agent>`). They talk to the running daemon over loopback with the
//! token from `api.token`; every mutating call carries a fresh `Idempotency-Key`.

use std::io::Read;
use std::path::PathBuf;

use anyhow::Context;
use clap::Args;
use serde_json::{json, Value};

use agentmbx::config::Config;
use agentmbx::paths::Paths;
use agentmbx::token::ApiToken;

use super::{NotFoundError, UsageError};

/// Flags of `send`.
#[derive(Debug, Args)]
pub struct SendArgs {
    /// The sending agent's name on this host
    #[arg(long = "as", value_name = "AGENT", env = "MBX_AGENT")]
    pub as_agent: String,
    /// Recipients, comma-separated: agent, agent@host, role:R (that role here and on every
    /// paired host), * (every mailbox here and every paired host), owner
    #[arg(long, value_name = "ADDR,…", value_delimiter = ',', required = true)]
    pub to: Vec<String>,
    /// One-line subject
    #[arg(long)]
    pub subject: String,
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
    /// Kind: message, request, reply, status, decision, alert, task
    #[arg(long)]
    pub kind: Option<String>,
    /// Message id this replies to
    #[arg(long, value_name = "ID")]
    pub reply_to: Option<String>,
    /// Ask for a reply
    #[arg(long)]
    pub needs_reply: bool,
    /// A reference (repeatable)
    #[arg(long = "ref", value_name = "REF")]
    pub refs: Vec<String>,
    /// Print the API answer as JSON
    #[arg(long)]
    pub json: bool,
}

/// Flags of `inbox`.
#[derive(Debug, Args)]
pub struct InboxArgs {
    /// The agent whose inbox to list
    #[arg(long = "as", value_name = "AGENT", env = "MBX_AGENT")]
    pub as_agent: String,
    /// Include acked messages
    #[arg(long)]
    pub all: bool,
    /// Page size, 1..=200
    #[arg(long, default_value_t = 50)]
    pub limit: u32,
    /// Cursor from a previous page
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
    /// The reading agent
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
    /// A note kept with the ack
    #[arg(long)]
    pub note: Option<String>,
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

struct Api {
    base: String,
    token: ApiToken,
    http: reqwest::Client,
}

impl Api {
    fn connect() -> anyhow::Result<Self> {
        let paths = Paths::from_env()?;
        let token = ApiToken::load(&paths.api_token())?.ok_or_else(|| {
            anyhow::anyhow!(
                "no api.token in {}: start the daemon first (agentmbx daemon)",
                paths.home().display()
            )
        })?;
        let addr = match std::fs::read_to_string(paths.api_addr_file()) {
            Ok(text) => text.trim().to_string(),
            Err(_) => Config::load(&paths)?.api_addr().to_string(),
        };
        // The local API is on this machine: never through HTTP(S)_PROXY.
        let http = reqwest::Client::builder()
            .no_proxy()
            .timeout(std::time::Duration::from_secs(30))
            .build()?;
        Ok(Api {
            base: format!("http://{addr}"),
            token,
            http,
        })
    }

    async fn call(
        &self,
        method: reqwest::Method,
        path: &str,
        body: Option<Value>,
    ) -> anyhow::Result<Value> {
        let mut req = self
            .http
            .request(method.clone(), format!("{}{path}", self.base))
            .bearer_auth(self.token.expose_secret());
        if let Some(b) = body {
            let key = agentmbx_protocol::b64::encode_url(&rand::random::<[u8; 16]>());
            req = req.header("idempotency-key", key).json(&b);
        }
        let resp = req.send().await.map_err(|e| {
            anyhow::anyhow!(
                "the daemon does not answer at {} (is `agentmbx daemon` running?): {}",
                self.base,
                agentmbx::transport::relay_client::describe(&e)
            )
        })?;
        let status = resp.status();
        let value: Value = resp.json().await.unwrap_or(Value::Null);
        if status.is_success() {
            return Ok(value);
        }
        let msg = value
            .get("error")
            .and_then(Value::as_str)
            .unwrap_or("request failed")
            .to_string();
        let code = value
            .get("code")
            .and_then(Value::as_str)
            .unwrap_or_default();
        match status.as_u16() {
            404 => Err(NotFoundError(msg).into()),
            400 if code == "UNKNOWN_HOST" => Err(NotFoundError(msg).into()),
            400 => Err(UsageError(msg).into()),
            _ => Err(anyhow::anyhow!("{msg} (HTTP {status})")),
        }
    }
}

fn block_on<T>(f: impl std::future::Future<Output = anyhow::Result<T>>) -> anyhow::Result<T> {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?
        .block_on(f)
}

fn enc(s: &str) -> String {
    agentmbx::transport::relay_client::push::urlencode(s)
}

/// `send`.
pub fn send(args: SendArgs) -> anyhow::Result<()> {
    let body = match (&args.message, &args.body_file) {
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
    };
    let req = json!({
        "from": args.as_agent, "to": args.to, "subject": args.subject, "body": body,
        "kind": args.kind, "reply_to": args.reply_to, "needs_reply": args.needs_reply, "refs": args.refs,
    });
    let api = Api::connect()?;
    let out = block_on(api.call(reqwest::Method::POST, "/v1/messages", Some(req)))?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&out)?);
    } else {
        println!("sent {}", out["id"].as_str().unwrap_or_default());
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
    }
    Ok(())
}

/// `inbox`.
pub fn inbox(args: InboxArgs) -> anyhow::Result<()> {
    let mut path = format!(
        "/v1/inbox?as={}&limit={}&all={}",
        enc(&args.as_agent),
        args.limit,
        args.all
    );
    if let Some(c) = &args.cursor {
        path.push_str(&format!("&cursor={}", enc(c)));
    }
    let api = Api::connect()?;
    let page = block_on(api.call(reqwest::Method::GET, &path, None))?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&page)?);
        return Ok(());
    }
    let msgs = page["messages"].as_array().cloned().unwrap_or_default();
    if msgs.is_empty() {
        println!("no messages for {}", args.as_agent);
    }
    for m in msgs {
        println!(
            "{}  {:4}  {}  {}  {}",
            m["id"].as_str().unwrap_or_default(),
            m["state"].as_str().unwrap_or_default(),
            m["ts"].as_str().unwrap_or_default(),
            m["from"].as_str().unwrap_or_default(),
            m["subject"].as_str().unwrap_or_default()
        );
    }
    if let Some(c) = page["next_cursor"].as_str() {
        println!("more: agentmbx inbox --as {} --cursor {c}", args.as_agent);
    }
    Ok(())
}

/// `read`.
pub fn read(args: ReadArgs) -> anyhow::Result<()> {
    let api = Api::connect()?;
    let m = block_on(api.call(
        reqwest::Method::GET,
        &format!("/v1/messages/{}?as={}", enc(&args.id), enc(&args.as_agent)),
        None,
    ))?;
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
        println!("subject: {}", m["subject"].as_str().unwrap_or_default());
        println!();
        println!("{}", m["body"].as_str().unwrap_or_default());
    }
    Ok(())
}

/// `ack`.
pub fn ack(args: AckArgs) -> anyhow::Result<()> {
    let api = Api::connect()?;
    let out = block_on(api.call(
        reqwest::Method::POST,
        "/v1/ack",
        Some(json!({"as": args.as_agent, "ids": args.ids, "note": args.note})),
    ))?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&out)?);
    } else {
        println!("acked {}", out["acked"].as_u64().unwrap_or(0));
    }
    Ok(())
}

/// `sent`: each message newest first, then one line per recipient with its state: `queued`,
/// `relay-accepted`, `repush`, `delivered` (or the receipt's `notified`, `read`, `acked`),
/// `undelivered`, `expired`, `unconfirmed`; with the reason when undelivered, expired or
/// unconfirmed (`: <reason>`), the last error when queued or re-pushed (`queued (<last
/// error>)`); both with anything but printable text escaped.
pub fn sent(args: SentArgs) -> anyhow::Result<()> {
    let mut path = format!("/v1/sent?as={}&limit={}", enc(&args.as_agent), args.limit);
    if let Some(c) = &args.cursor {
        path.push_str(&format!("&cursor={}", enc(c)));
    }
    let api = Api::connect()?;
    let page = block_on(api.call(reqwest::Method::GET, &path, None))?;
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
            if let Some(why) = r["reason"].as_str() {
                line.push_str(&format!(": {}", printable(why)));
            }
            println!("{line}");
        }
    }
    if let Some(c) = page["next_cursor"].as_str() {
        println!("more: agentmbx sent --as {} --cursor {c}", args.as_agent);
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
