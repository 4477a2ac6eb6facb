//! `agentmbx mcp`: the stdio MCP server an agent's client starts (Claude Code, Codex, any MCP
//! client), on the official Rust SDK `rmcp`.
//!
//! It holds no state of its own and never opens `mailbox.db`: every tool is a call of the
//! running daemon's local API (the daemon stays the one writer), through the CLI's client
//! ([`crate::local_api::Api`]: `api.addr`, `api.token`, retries). Stdout carries only the
//! protocol; logs go to stderr and never hold a body.
//!
//! - [`server`]: the tools (0.5.x's names and arguments, `agent-surface.md`), the resource
//!   [`GUIDE_URI`], the prompt [`PROMPT_NAME`], the instructions;
//! - [`tools`]: the tools' arguments, schemas and bounds;
//! - [`channel`]: wake for Claude Code (`claude/channel` notifications for new mail, through
//!   the daemon's wake brake);
//! - `guide.md`: the one page on how to use the mailbox ([`GUIDE`]).
//!
//! The tool list with its input schemas is committed as `daemon/mcp-tools.json`
//! ([`tools_json`], `agentmbx mcp --print-tools`) and checked for drift by the tests.

pub mod channel;
pub mod server;
pub mod tools;

use rmcp::ServiceExt;

/// How to use the mailbox as an agent: the resource [`GUIDE_URI`], the prompt
/// [`PROMPT_NAME`] and the server's instructions (markdown).
pub const GUIDE: &str = include_str!("guide.md");
/// The guide's resource URI.
pub const GUIDE_URI: &str = "mbx://guide";
/// The guide's prompt name.
pub const PROMPT_NAME: &str = "mbx_guide";

/// The tool list as `tools/list` gives it (name, description, input schema, …), pretty JSON
/// with a final newline: the text of `daemon/mcp-tools.json`.
pub fn tools_json() -> String {
    let tools = serde_json::to_value(server::MbxServer::tools()).unwrap_or_default();
    let mut text = serde_json::to_string_pretty(&tools).unwrap_or_default();
    text.push('\n');
    text
}

/// Crates whose debug logs would print what flows through them (rmcp logs whole requests and
/// responses, message bodies included): capped at `info` whatever `MBX_LOG` says.
const CAPPED: [&str; 4] = ["rmcp", "hyper", "hyper_util", "reqwest"];

/// The log filter of `agentmbx mcp`: `requested` (`MBX_LOG`, else `warn`) without its
/// directives for the [`CAPPED`] crates, which get `info` when the global level is `info` or
/// more verbose, else `warn` (their `info` lines hold no body).
pub fn log_filter(requested: Option<&str>) -> String {
    let requested = requested
        .map(str::trim)
        .filter(|r| !r.is_empty())
        .unwrap_or("warn");
    let mut parts: Vec<String> = requested
        .split(',')
        .map(str::trim)
        .filter(|d| !d.is_empty())
        .filter(|d| !CAPPED.iter().any(|c| d.starts_with(c)))
        .map(str::to_string)
        .collect();
    let level = if parts
        .iter()
        .any(|d| !d.contains('=') && matches!(d.as_str(), "info" | "debug" | "trace"))
    {
        "info"
    } else {
        "warn"
    };
    parts.extend(CAPPED.iter().map(|c| format!("{c}={level}")));
    parts.join(",")
}

/// Serves MCP on stdin/stdout as `agent` until the client closes the stream. Registers the
/// agent with the daemon first when it answers (else at the first tool call). Errors: the
/// runtime cannot start, or the initialization handshake fails.
pub fn run(agent: Option<String>) -> anyhow::Result<()> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let requested = std::env::var("MBX_LOG").ok();
    if let Err(e) = agentmbx::config_watch::apply_log_filter(&log_filter(requested.as_deref())) {
        tracing::warn!("MBX_LOG is not a valid log filter ({e}); keeping the default");
    }
    rt.block_on(async move {
        let server = server::MbxServer::new(agent);
        server.register_at_start().await;
        let agent = server.agent_handle();
        let name = agent.lock().map(|a| a.clone()).unwrap_or_default();
        let start = match name {
            Some(name) => channel::end_position(&name).await.map(|c| (name, c)),
            None => None,
        };
        let running = server
            .serve(rmcp::transport::stdio())
            .await
            .map_err(|e| anyhow::anyhow!("MCP initialization failed: {e}"))?;
        channel::spawn(running.peer().clone(), agent, start);
        let reason = running.waiting().await?;
        tracing::info!("MCP session ended: {reason:?}");
        Ok(())
    })
}

#[cfg(test)]
mod tests {
    /// `daemon/mcp-tools.json` is the tool list this build serves (regenerate it with
    /// `cargo run -q -p agentmbx -- mcp --print-tools > daemon/mcp-tools.json`).
    #[test]
    fn committed_tool_list_has_not_drifted() {
        let committed = include_str!("../../mcp-tools.json");
        assert!(
            committed == super::tools_json(),
            "daemon/mcp-tools.json is stale: run \
             `cargo run -q -p agentmbx -- mcp --print-tools > daemon/mcp-tools.json`"
        );
    }

    #[test]
    fn the_log_filter_never_lets_rmcp_print_requests() {
        use super::log_filter;
        assert_eq!(
            log_filter(None),
            "warn,rmcp=warn,hyper=warn,hyper_util=warn,reqwest=warn"
        );
        assert_eq!(
            log_filter(Some("debug,rmcp=trace")),
            "debug,rmcp=info,hyper=info,hyper_util=info,reqwest=info"
        );
        assert!(log_filter(Some("agentmbx=trace")).ends_with("reqwest=warn"));
    }

    #[test]
    fn the_tools_are_0_5_s_minus_what_we_leave_out() {
        let names: Vec<String> = super::server::MbxServer::tools()
            .into_iter()
            .map(|t| t.name.to_string())
            .collect();
        let mut want = vec![
            "mbx_ack",
            "mbx_agents",
            "mbx_inbox",
            "mbx_read",
            "mbx_replay",
            "mbx_catchup",
            "mbx_reply",
            "mbx_search",
            "mbx_send",
            "mbx_sent",
            "mbx_thread",
            "mbx_wait",
            "mbx_whoami",
        ];
        want.sort();
        let mut names = names;
        names.sort();
        assert_eq!(names, want);
    }
}
