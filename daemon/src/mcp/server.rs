//! The MCP server: one tool per 0.5.x tool we build, each a thin call of the local API.
//!
//! Every tool answers a result: a JSON text (the API's answer, bounded to [`MAX_RESULT_BYTES`])
//! or a tool error (`is_error: true`) in our words — a bad argument, the API's `{error}`, or,
//! when the daemon is not running, one text naming `agentmbx daemon` / `agentmbx daemon
//! install` ([`DAEMON_DOWN`]). Nothing here panics on what a client sends or on a missing
//! daemon, and no call waits longer than its budget.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use rmcp::handler::server::router::tool::ToolRouter;
use rmcp::handler::server::wrapper::Parameters;
use rmcp::model::{
    CallToolResult, ContentBlock, GetPromptRequestParams, GetPromptResponse, GetPromptResult,
    Implementation, ListPromptsResult, ListResourcesResult, PaginatedRequestParams,
    ProgressNotificationParam, Prompt, PromptMessage, ReadResourceRequestParams,
    ReadResourceResponse, ReadResourceResult, Resource, ResourceContents, Role, ServerCapabilities,
    ServerConfig,
};
use rmcp::service::RequestContext;
use rmcp::{tool, tool_handler, tool_router, ErrorData as McpError, RoleServer, ServerHandler};
use serde_json::{json, Value};

use super::tools::{
    AckArgs, CatchupArgs, InboxArgs, ReadArgs, ReplayArgs, ReplyArgs, SearchArgs, SendArgs,
    SentArgs, ThreadArgs, WaitArgs, WhoamiArgs,
};
use super::{GUIDE, GUIDE_URI, PROMPT_NAME};
use crate::local_api::{enc, mint_key, Api, DaemonDown, Mutation, Query};
use crate::local_api::{NotFoundError, TempFailError, UsageError};

/// Upper bound of one tool result's text in bytes: clients cut large outputs (Claude Code
/// at about 25,000 tokens), so lists are cut to this and carry a cursor.
pub const MAX_RESULT_BYTES: usize = 64 * 1024;
/// How long one tool call keeps retrying a daemon that is busy or does not settle a call.
const CALL_BUDGET: Duration = Duration::from_secs(20);
/// A progress notification while `mbx_wait` waits, this often (clients reset their tool
/// timeout on progress); `MBX_MCP_PROGRESS_MS` (ms, tests only) overrides it.
const PROGRESS_EVERY: Duration = Duration::from_secs(10);

/// [`PROGRESS_EVERY`], or `MBX_MCP_PROGRESS_MS` when it is a number of milliseconds ≥ 10.
fn progress_every() -> Duration {
    std::env::var("MBX_MCP_PROGRESS_MS")
        .ok()
        .and_then(|v| v.trim().parse::<u64>().ok())
        .filter(|ms| *ms >= 10)
        .map_or(PROGRESS_EVERY, Duration::from_millis)
}
/// Beyond the wait itself, how long a `mbx_wait` request may take.
const WAIT_SLACK: Duration = Duration::from_secs(15);
/// Most messages one `mbx_wait` answer lists (fewer when they do not fit
/// [`MAX_RESULT_BYTES`]; the rest come with the next call).
const WAIT_LIMIT: usize = 30;

/// The one text of every tool when the daemon is not running (or the home is not set up).
pub const DAEMON_DOWN: &str = "The agentmbx daemon is not running for this mailbox, so no mail \
    can be sent or read. Ask the person running you to start it with `agentmbx daemon` (or once \
    `agentmbx daemon install` to run it as a service), then call this tool again.";

/// The server of one session: the agent it acts as and whether the daemon knows that agent.
#[derive(Debug, Clone)]
pub struct MbxServer {
    /// The agent (`--as`, `MBX_AGENT`, or the last `mbx_whoami {name}`).
    agent: Arc<Mutex<Option<String>>>,
    /// Whether `agent` was registered with the daemon (`POST /v1/agents`) in this session.
    registered: Arc<AtomicBool>,
    tool_router: ToolRouter<MbxServer>,
}

/// What a tool answers: always `Ok` (a failure is a result with `is_error`); `Err` (a
/// protocol error) is left to rmcp.
type ToolResult = Result<CallToolResult, McpError>;

/// A tool error (`is_error: true`) with `text`.
fn fail(text: impl Into<String>) -> CallToolResult {
    CallToolResult::error(vec![ContentBlock::text(text.into())])
}

/// A result whose text is `value` as compact JSON.
fn ok(value: &Value) -> CallToolResult {
    CallToolResult::success(vec![ContentBlock::text(value.to_string())])
}

/// Our words for an error of the API client.
fn api_error(err: &anyhow::Error) -> CallToolResult {
    for cause in err.chain() {
        if let Some(DaemonDown(detail)) = cause.downcast_ref::<DaemonDown>() {
            return fail(format!("{DAEMON_DOWN} ({detail})"));
        }
        if cause.is::<agentmbx::identity::IdentityError>() {
            return fail(format!("{DAEMON_DOWN} ({cause})"));
        }
        if let Some(TempFailError(why)) = cause.downcast_ref::<TempFailError>() {
            return fail(format!(
                "The daemon did not settle this call in time ({why}). It may have been done: \
                 call the tool again with the same idempotency_key to finish it without doing \
                 it twice, or check with mbx_sent / mbx_inbox."
            ));
        }
        if let Some(NotFoundError(msg)) = cause.downcast_ref::<NotFoundError>() {
            return fail(format!("Not found: {msg}"));
        }
        if let Some(UsageError(msg)) = cause.downcast_ref::<UsageError>() {
            return fail(format!("Refused: {msg}"));
        }
    }
    fail(format!("The daemon refused the call: {err:#}"))
}

/// Cuts a page's `list` (an array under `key`) so that the whole text fits
/// [`MAX_RESULT_BYTES`]; returns how many entries were kept (all when it fits).
fn fit(value: &mut Value, key: &str) -> usize {
    let Some(list) = value.get(key).and_then(Value::as_array).cloned() else {
        return 0;
    };
    if value.to_string().len() <= MAX_RESULT_BYTES {
        return list.len();
    }
    let mut kept = Vec::new();
    let mut size = 512; // the page's other fields and the notes added
    for entry in list {
        let n = entry.to_string().len() + 1;
        if size + n > MAX_RESULT_BYTES && !kept.is_empty() {
            break;
        }
        size += n;
        kept.push(entry);
    }
    let n = kept.len();
    value[key] = Value::Array(kept);
    n
}

/// Cuts the `body` of the messages under `key` that do not fit [`MAX_RESULT_BYTES`], marking
/// each cut one `body_truncated: {shown_bytes, total_bytes}`.
fn cut_bodies(value: &mut Value, key: &str) {
    let Some(list) = value.get_mut(key).and_then(Value::as_array_mut) else {
        return;
    };
    let others: usize = list
        .iter()
        .map(|m| {
            let mut m = m.clone();
            m["body"] = Value::Null;
            m.to_string().len() + 64
        })
        .sum::<usize>()
        + 512;
    let mut left = MAX_RESULT_BYTES.saturating_sub(others);
    for m in list.iter_mut() {
        let Some(body) = m.get("body").and_then(Value::as_str).map(str::to_string) else {
            continue;
        };
        // JSON escaping can grow text: count the escaped size.
        let escaped = Value::String(body.clone()).to_string().len();
        if escaped <= left {
            left -= escaped;
            continue;
        }
        let escaped_len = |end: usize| Value::String(body[..end].to_string()).to_string().len();
        let mut end = left.min(body.len());
        loop {
            while !body.is_char_boundary(end) {
                end -= 1;
            }
            let size = escaped_len(end);
            if size <= left || end == 0 {
                left = left.saturating_sub(size);
                break;
            }
            end = end * left / size.max(1);
            end = end.saturating_sub(1);
        }
        m["body"] = Value::String(body[..end].to_string());
        m["body_truncated"] = json!({"shown_bytes": end, "total_bytes": body.len(),
            "rest": "read it whole with `agentmbx read <id> --as <agent>`"});
    }
}

impl MbxServer {
    /// A server acting as `agent` (none: `mbx_whoami {name}` sets it).
    pub fn new(agent: Option<String>) -> Self {
        MbxServer {
            agent: Arc::new(Mutex::new(agent)),
            registered: Arc::new(AtomicBool::new(false)),
            tool_router: Self::tool_router(),
        }
    }

    /// The session's agent, shared with the channel watcher ([`super::channel::spawn`]).
    pub fn agent_handle(&self) -> Arc<Mutex<Option<String>>> {
        self.agent.clone()
    }

    /// The tool list, as `tools/list` answers it.
    pub fn tools() -> Vec<rmcp::model::Tool> {
        Self::tool_router().list_all()
    }

    fn agent_name(&self) -> Option<String> {
        self.agent.lock().map(|a| a.clone()).unwrap_or_default()
    }

    /// The API client for one call, or the tool error that says why there is none.
    fn api() -> Result<Api, CallToolResult> {
        Api::connect()
            .map(|api| api.with_budget(CALL_BUDGET))
            .map_err(|e| api_error(&e))
    }

    /// Registers `name` with the daemon (`POST /v1/agents {name}`: creates the mailbox, or
    /// changes nothing of an existing one).
    async fn register(api: &Api, name: &str) -> anyhow::Result<Value> {
        let key = mint_key();
        let m = Mutation {
            what: "agent registration",
            key: &key,
            check: "agentmbx agents".into(),
        };
        api.mutate("/v1/agents", &json!({ "name": name }), &m).await
    }

    /// At start: registers the session's agent when the daemon answers; else the first tool
    /// call does. Never fails.
    pub async fn register_at_start(&self) {
        let Some(name) = self.agent_name() else {
            return;
        };
        let api = match Api::connect() {
            Ok(api) => api.with_budget(Duration::from_secs(2)),
            Err(e) => {
                tracing::info!("daemon not reachable at start ({e:#}); registering {name} at the first tool call");
                return;
            }
        };
        match Self::register(&api, &name).await {
            Ok(_) => {
                self.registered.store(true, Ordering::SeqCst);
                tracing::info!("registered agent {name} at {}", api.base());
            }
            Err(e) => tracing::info!(
                "could not register {name} at start ({e:#}); trying again at the first tool call"
            ),
        }
    }

    /// The client and the agent of a call, registering the agent first when it is not yet.
    async fn session(&self) -> Result<(Api, String), CallToolResult> {
        let api = Self::api()?;
        let Some(name) = self.agent_name() else {
            return Err(fail(
                "No agent name yet: call mbx_whoami {name} first (or start the server with \
                 `agentmbx mcp --as <name>` / MBX_AGENT).",
            ));
        };
        if !self.registered.load(Ordering::SeqCst) {
            Self::register(&api, &name)
                .await
                .map_err(|e| api_error(&e))?;
            self.registered.store(true, Ordering::SeqCst);
        }
        Ok((api, name))
    }

    async fn get(api: &Api, path: &str, what: &str) -> Result<Value, CallToolResult> {
        let q = Query {
            what,
            changes: None,
        };
        api.get(path, &q).await.map_err(|e| api_error(&e))
    }

    async fn post(
        api: &Api,
        path: &str,
        body: &Value,
        key: Option<&str>,
        what: &str,
    ) -> Result<Value, CallToolResult> {
        // Without the client's key, one per call still keeps this call's own retries from
        // doing it twice (a retry of the tool call by the client is not covered).
        let key = key.map(str::to_string).unwrap_or_else(mint_key);
        let m = Mutation {
            what,
            key: &key,
            check: "mbx_sent".into(),
        };
        api.mutate(path, body, &m).await.map_err(|e| api_error(&e))
    }

    /// A list page that fits [`MAX_RESULT_BYTES`]: asked with `limit`, and asked again with
    /// fewer entries when it does not fit, so that `next_cursor` is the daemon's own.
    async fn page(
        api: &Api,
        path: impl Fn(u32) -> String,
        limit: u32,
        key: &str,
        what: &str,
    ) -> Result<Value, CallToolResult> {
        let mut value = Self::get(api, &path(limit), what).await?;
        let total = value.get(key).and_then(Value::as_array).map_or(0, Vec::len);
        let kept = fit(&mut value.clone(), key);
        if kept < total {
            value = Self::get(api, &path(kept.max(1) as u32), what).await?;
        }
        cut_bodies(&mut value, key);
        Ok(value)
    }
}

fn done(r: Result<Value, CallToolResult>) -> ToolResult {
    Ok(match r {
        Ok(v) => ok(&v),
        Err(e) => e,
    })
}

#[tool_router]
impl MbxServer {
    #[tool(
        description = "Who am I: this session's agent. With name (and role, description), act as that agent and register or update it."
    )]
    async fn mbx_whoami(&self, Parameters(args): Parameters<WhoamiArgs>) -> ToolResult {
        if let Err(e) = args.check() {
            return Ok(fail(e));
        }
        let api = match Self::api() {
            Ok(api) => api,
            Err(e) => return Ok(e),
        };
        let Some(name) = args.name.clone().or_else(|| self.agent_name()) else {
            return Ok(fail(
                "No agent name yet: call mbx_whoami with name (lowercase letters, digits, '-').",
            ));
        };
        let mut body = json!({ "name": name });
        if let Some(r) = &args.role {
            body["role"] = json!(r);
        }
        if let Some(d) = &args.description {
            body["description"] = json!(d);
        }
        let r = Self::post(&api, "/v1/agents", &body, None, "agent registration").await;
        if r.is_ok() {
            if let Ok(mut a) = self.agent.lock() {
                *a = Some(name);
            }
            self.registered.store(true, Ordering::SeqCst);
        }
        done(r.map(|entry| json!({ "agent": entry })))
    }

    #[tool(
        description = "Send a message to agents (name, name@host, role:<R>, *). Give idempotency_key when you may retry."
    )]
    async fn mbx_send(&self, Parameters(args): Parameters<SendArgs>) -> ToolResult {
        if let Err(e) = args.check() {
            return Ok(fail(e));
        }
        let (api, from) = match self.session().await {
            Ok(s) => s,
            Err(e) => return Ok(e),
        };
        let body = json!({
            "from": from, "to": args.to, "subject": args.subject, "body": args.body,
            "kind": args.kind, "reply_to": args.reply_to, "needs_reply": args.needs_reply,
            "refs": args.refs,
        });
        let key = args.idempotency_key.as_deref();
        done(Self::post(&api, "/v1/messages", &body, key, "send").await)
    }

    #[tool(description = "Reply to a message: to its sender, in its thread, subject Re: ….")]
    async fn mbx_reply(&self, Parameters(args): Parameters<ReplyArgs>) -> ToolResult {
        if let Err(e) = args.check() {
            return Ok(fail(e));
        }
        let (api, from) = match self.session().await {
            Ok(s) => s,
            Err(e) => return Ok(e),
        };
        let body = json!({
            "from": from, "body": args.body, "kind": args.kind, "needs_reply": args.needs_reply,
        });
        let path = format!("/v1/messages/{}/reply", enc(&args.id));
        let key = args.idempotency_key.as_deref();
        done(Self::post(&api, &path, &body, key, "reply").await)
    }

    #[tool(
        description = "List your unacknowledged messages (no bodies; all: include acked). Use mbx_read for bodies."
    )]
    async fn mbx_inbox(&self, Parameters(args): Parameters<InboxArgs>) -> ToolResult {
        let limit = match args.check() {
            Ok(l) => l,
            Err(e) => return Ok(fail(e)),
        };
        let (api, name) = match self.session().await {
            Ok(s) => s,
            Err(e) => return Ok(e),
        };
        let path = |limit: u32| {
            let mut p = format!("/v1/inbox?as={}&limit={limit}", enc(&name));
            if args.all {
                p.push_str("&all=true");
            }
            if let Some(c) = &args.cursor {
                p.push_str(&format!("&cursor={}", enc(c)));
            }
            p
        };
        done(Self::page(&api, path, limit, "messages", "inbox").await)
    }

    #[tool(description = "Read messages in full (marks them read).")]
    async fn mbx_read(&self, Parameters(args): Parameters<ReadArgs>) -> ToolResult {
        if let Err(e) = args.check() {
            return Ok(fail(e));
        }
        let (api, name) = match self.session().await {
            Ok(s) => s,
            Err(e) => return Ok(e),
        };
        let mut messages = Vec::new();
        for id in &args.ids {
            let path = format!("/v1/messages/{}?as={}", enc(id), enc(&name));
            match Self::get(&api, &path, "read").await {
                Ok(m) => messages.push(m),
                Err(e) => return Ok(e),
            }
        }
        let mut value = json!({ "messages": messages });
        cut_bodies(&mut value, "messages");
        Ok(ok(&value))
    }

    #[tool(
        description = "Acknowledge messages you have handled (the sender sees it); they leave your inbox."
    )]
    async fn mbx_ack(&self, Parameters(args): Parameters<AckArgs>) -> ToolResult {
        if let Err(e) = args.check() {
            return Ok(fail(e));
        }
        let (api, name) = match self.session().await {
            Ok(s) => s,
            Err(e) => return Ok(e),
        };
        let mut body = json!({ "as": name, "ids": args.ids });
        if let Some(n) = &args.note {
            body["note"] = json!(n);
        }
        let key = args.idempotency_key.as_deref();
        done(Self::post(&api, "/v1/ack", &body, key, "ack").await)
    }

    #[tool(description = "Show a conversation, oldest first: a thread id or any message id in it.")]
    async fn mbx_thread(&self, Parameters(args): Parameters<ThreadArgs>) -> ToolResult {
        if let Err(e) = args.check() {
            return Ok(fail(e));
        }
        let (api, name) = match self.session().await {
            Ok(s) => s,
            Err(e) => return Ok(e),
        };
        let path = |limit: u32| {
            let mut p = format!(
                "/v1/threads/{}?as={}&limit={limit}",
                enc(&args.id),
                enc(&name)
            );
            if let Some(c) = &args.cursor {
                p.push_str(&format!("&cursor={}", enc(c)));
            }
            p
        };
        done(Self::page(&api, path, 50, "messages", "thread").await)
    }

    #[tool(
        description = "Search your mail (received and sent) for words in subjects and bodies, best first; each result has a short body snippet (mbx_read for the whole message)."
    )]
    async fn mbx_search(&self, Parameters(args): Parameters<SearchArgs>) -> ToolResult {
        let limit = match args.check() {
            Ok(l) => l,
            Err(e) => return Ok(fail(e)),
        };
        let (api, name) = match self.session().await {
            Ok(s) => s,
            Err(e) => return Ok(e),
        };
        let path = |limit: u32| {
            let mut p = format!(
                "/v1/search?as={}&q={}&limit={limit}",
                enc(&name),
                enc(&args.query)
            );
            if let Some(c) = &args.cursor {
                p.push_str(&format!("&cursor={}", enc(c)));
            }
            p
        };
        done(Self::page(&api, path, limit, "messages", "search").await)
    }

    #[tool(description = "List the agents you can write to, on this host and paired hosts.")]
    async fn mbx_agents(&self) -> ToolResult {
        // The directory needs no agent: it answers before mbx_whoami {name} too.
        let api = if self.agent_name().is_some() {
            self.session().await.map(|(api, _)| api)
        } else {
            Self::api()
        };
        let api = match api {
            Ok(api) => api,
            Err(e) => return Ok(e),
        };
        let mut value = match Self::get(&api, "/v1/agents", "agents").await {
            Ok(v) => v,
            Err(e) => return Ok(e),
        };
        let total = value["agents"].as_array().map_or(0, Vec::len);
        if fit(&mut value, "agents") < total {
            value["truncated"] = json!(true);
        }
        Ok(ok(&value))
    }

    #[tool(description = "List what you sent, with each recipient's delivery state.")]
    async fn mbx_sent(&self, Parameters(args): Parameters<SentArgs>) -> ToolResult {
        let limit = match args.check() {
            Ok(l) => l,
            Err(e) => return Ok(fail(e)),
        };
        let (api, name) = match self.session().await {
            Ok(s) => s,
            Err(e) => return Ok(e),
        };
        let path = |limit: u32| {
            let mut p = format!("/v1/sent?as={}&limit={limit}", enc(&name));
            if let Some(c) = &args.cursor {
                p.push_str(&format!("&cursor={}", enc(c)));
            }
            p
        };
        done(Self::page(&api, path, limit, "messages", "sent").await)
    }

    #[tool(
        description = "Page through your received mail with bodies, oldest first (marks nothing read); thread: one conversation. max_bytes over 61440 is capped to it."
    )]
    async fn mbx_replay(&self, Parameters(args): Parameters<ReplayArgs>) -> ToolResult {
        let (limit, max_bytes) = match args.check() {
            Ok(b) => b,
            Err(e) => return Ok(fail(e)),
        };
        let (api, name) = match self.session().await {
            Ok(s) => s,
            Err(e) => return Ok(e),
        };
        let path = |limit: u32| {
            let mut p = format!(
                "/v1/replay?as={}&limit={limit}&max_bytes={max_bytes}",
                enc(&name)
            );
            if let Some(c) = &args.cursor {
                p.push_str(&format!("&cursor={}", enc(c)));
            }
            if let Some(t) = &args.thread {
                p.push_str(&format!("&thread={}", enc(t)));
            }
            p
        };
        done(Self::page(&api, path, limit, "messages", "replay").await)
    }

    #[tool(
        description = "What arrived since you last caught up, with bodies (marks nothing read); commit: true moves your position past it. restart: all|now resets it. max_bytes over 61440 is capped to it."
    )]
    async fn mbx_catchup(&self, Parameters(args): Parameters<CatchupArgs>) -> ToolResult {
        let (limit, max_bytes) = match args.check() {
            Ok(b) => b,
            Err(e) => return Ok(fail(e)),
        };
        let (api, name) = match self.session().await {
            Ok(s) => s,
            Err(e) => return Ok(e),
        };
        if let Some(from) = args.restart {
            let body = json!({ "as": name, "from": from.as_str() });
            if let Err(e) =
                Self::post(&api, "/v1/catchup/restart", &body, None, "catchup restart").await
            {
                return Ok(e);
            }
        }
        let path = |limit: u32| {
            let mut p = format!(
                "/v1/catchup?as={}&limit={limit}&max_bytes={max_bytes}",
                enc(&name)
            );
            if let Some(c) = &args.cursor {
                p.push_str(&format!("&cursor={}", enc(c)));
            }
            p
        };
        let mut value = match Self::page(&api, path, limit, "messages", "catchup").await {
            Ok(v) => v,
            Err(e) => return Ok(e),
        };
        if args.commit {
            let body = json!({ "as": name, "cursor": value["cursor"] });
            match Self::post(&api, "/v1/catchup/commit", &body, None, "catchup commit").await {
                Ok(answer) => value["committed"] = answer["position"].clone(),
                Err(e) => return Ok(e),
            }
        }
        Ok(ok(&value))
    }

    #[tool(
        description = "Wait (at most timeout_s, ≤45 s) for new mail and return it; an empty answer means none came: call again with next_cursor."
    )]
    async fn mbx_wait(
        &self,
        Parameters(args): Parameters<WaitArgs>,
        ctx: RequestContext<RoleServer>,
    ) -> ToolResult {
        let wait = match args.check() {
            Ok(w) => w,
            Err(e) => return Ok(fail(e)),
        };
        let (api, name) = match self.session().await {
            Ok(s) => s,
            Err(e) => return Ok(e),
        };
        let path = |limit: usize, wait: u32| {
            let mut p = format!("/v1/inbox?as={}&limit={limit}&wait={wait}", enc(&name));
            if let Some(c) = &args.cursor {
                p.push_str(&format!("&cursor={}", enc(c)));
            }
            if args.needs_reply {
                p.push_str("&needs_reply=true");
            }
            if let Some(f) = &args.from {
                p.push_str(&format!("&from={}", enc(f)));
            }
            p
        };
        let token = ctx.meta.get_progress_token();
        let first = path(WAIT_LIMIT, wait);
        let call = api.get_once(&first, Duration::from_secs(u64::from(wait)) + WAIT_SLACK);
        tokio::pin!(call);
        let start = tokio::time::Instant::now();
        let every = progress_every();
        let mut ticks = tokio::time::interval_at(start + every, every);
        let answer = loop {
            tokio::select! {
                r = &mut call => break r,
                _ = ctx.ct.cancelled() => return Ok(fail("mbx_wait was cancelled")),
                _ = ticks.tick() => {
                    if let Some(t) = &token {
                        let secs = start.elapsed().as_secs_f64();
                        let p = ProgressNotificationParam::new(t.clone(), secs)
                            .with_total(f64::from(wait))
                            .with_message(format!("waiting for mail ({secs:.0} s)"));
                        if let Err(e) = ctx.peer.notify_progress(p).await {
                            tracing::debug!("progress notification not sent: {e}");
                        }
                    }
                }
            }
        };
        let mut value = match answer {
            Ok(v) => v,
            Err(e) => return Ok(api_error(&e)),
        };
        // Too many to fit the result: ask again, without waiting, for as many as fit, so the
        // cursor is the daemon's position after exactly the messages shown.
        let total = value["messages"].as_array().map_or(0, Vec::len);
        let kept = fit(&mut value.clone(), "messages");
        if kept < total {
            value = match Self::get(&api, &path(kept.max(1), 0), "wait").await {
                Ok(v) => v,
                Err(e) => return Ok(e),
            };
        }
        // The cursor to wait from next: the position after this answer (`cursor`, on every
        // answer of a daemon with the long poll), else the next page's, else the one given.
        let next = [&value["cursor"], &value["next_cursor"]]
            .into_iter()
            .find(|c| c.is_string())
            .cloned()
            .unwrap_or_else(|| json!(args.cursor));
        value["next_cursor"] = next;
        if kept < total {
            value["truncated"] = json!(
                "more messages arrived than fit: call mbx_wait again with next_cursor for the rest"
            );
        }
        fit(&mut value, "messages");
        Ok(ok(&value))
    }
}

#[tool_handler(router = self.tool_router)]
impl ServerHandler for MbxServer {
    fn get_info(&self) -> ServerConfig {
        ServerConfig::new(
            ServerCapabilities::builder()
                .enable_experimental_with(super::channel::capabilities())
                .enable_tools()
                .enable_resources()
                .enable_prompts()
                .build(),
        )
        .with_server_info(Implementation::new("agentmbx", agentmbx::VERSION))
        .with_instructions(GUIDE.to_string())
    }

    /// The router's call, with one change: arguments that do not fit the tool's schema (a
    /// missing field, a wrong type), which rmcp answers as a tool error in its words, get
    /// ours (naming the tool and the schema).
    async fn call_tool(
        &self,
        request: rmcp::model::CallToolRequestParams,
        context: RequestContext<RoleServer>,
    ) -> Result<rmcp::model::CallToolResponse, McpError> {
        const RMCP_PREFIX: &str = "failed to deserialize parameters: ";
        let name = request.name.to_string();
        let tcc = rmcp::handler::server::tool::ToolCallContext::new(self, request, context);
        let answer = self.tool_router.call(tcc).await?;
        if let rmcp::model::CallToolResponse::Complete(r) = &answer {
            let text = r
                .content
                .first()
                .and_then(|c| c.as_text())
                .map(|t| t.text.as_str());
            if let Some(why) = text.and_then(|t| t.strip_prefix(RMCP_PREFIX)) {
                return Ok(fail(format!(
                    "Bad arguments for {name}: {why}. See the tool's input schema."
                ))
                .into());
            }
        }
        Ok(answer)
    }

    async fn list_resources(
        &self,
        _request: Option<PaginatedRequestParams>,
        _: RequestContext<RoleServer>,
    ) -> Result<ListResourcesResult, McpError> {
        let guide = Resource::new(GUIDE_URI, "guide")
            .with_description("How to use the mailbox as an agent")
            .with_mime_type("text/markdown");
        Ok(ListResourcesResult {
            resources: vec![guide],
            ..Default::default()
        })
    }

    async fn read_resource(
        &self,
        request: ReadResourceRequestParams,
        _: RequestContext<RoleServer>,
    ) -> Result<ReadResourceResponse, McpError> {
        if request.uri != GUIDE_URI {
            return Err(McpError::resource_not_found(
                format!("no resource {}: the only one is {GUIDE_URI}", request.uri),
                None,
            ));
        }
        let text = ResourceContents::text(GUIDE, GUIDE_URI).with_mime_type("text/markdown");
        Ok(ReadResourceResult::new(vec![text]).into())
    }

    async fn list_prompts(
        &self,
        _request: Option<PaginatedRequestParams>,
        _: RequestContext<RoleServer>,
    ) -> Result<ListPromptsResult, McpError> {
        let p = Prompt::new(
            PROMPT_NAME,
            Some("How to use the mailbox as an agent"),
            None,
        );
        Ok(ListPromptsResult {
            prompts: vec![p],
            ..Default::default()
        })
    }

    async fn get_prompt(
        &self,
        request: GetPromptRequestParams,
        _: RequestContext<RoleServer>,
    ) -> Result<GetPromptResponse, McpError> {
        if request.name != PROMPT_NAME {
            return Err(McpError::invalid_params(
                format!("no prompt {}: the only one is {PROMPT_NAME}", request.name),
                None,
            ));
        }
        let msg = PromptMessage::new_text(Role::User, GUIDE);
        Ok(GetPromptResult::new(vec![msg])
            .with_description("How to use the mailbox as an agent")
            .into())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fit_cuts_a_long_list_and_keeps_a_short_one() {
        let entry = json!({"id": "x", "subject": "s".repeat(1000)});
        let mut v = json!({"messages": vec![entry.clone(); 200], "next_cursor": null});
        let kept = fit(&mut v, "messages");
        assert!(kept > 10 && kept < 200, "{kept}");
        assert!(v.to_string().len() <= MAX_RESULT_BYTES);
        let mut short = json!({"messages": vec![entry; 3]});
        assert_eq!(fit(&mut short, "messages"), 3);
    }

    #[test]
    fn cut_bodies_bounds_the_result_and_says_so() {
        let big = "a\"".repeat(100_000); // escapes grow it
        let mut v = json!({"messages": [{"id": "1", "body": "short"}, {"id": "2", "body": big}]});
        cut_bodies(&mut v, "messages");
        assert!(
            v.to_string().len() <= MAX_RESULT_BYTES,
            "{}",
            v.to_string().len()
        );
        assert_eq!(v["messages"][0]["body"], "short");
        assert!(v["messages"][0].get("body_truncated").is_none());
        assert_eq!(v["messages"][1]["body_truncated"]["total_bytes"], 200_000);
    }

    #[test]
    fn a_missing_daemon_is_one_clear_error() {
        let r = api_error(&DaemonDown("nothing answers".into()).into());
        assert_eq!(r.is_error, Some(true));
        let text = format!("{:?}", r.content);
        assert!(text.contains("agentmbx daemon install"), "{text}");
    }
}
