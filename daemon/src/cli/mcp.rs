//! `agentmbx mcp [--as AGENT]`: the stdio MCP server for an agent's client ([`crate::mcp`]).

use clap::Args;

/// Flags of `agentmbx mcp`.
#[derive(Debug, Args)]
pub struct McpArgs {
    /// The agent this session acts as; registered with the daemon at start (or at the first
    /// tool call when the daemon is not up yet). Without it, the agent's first call is
    /// mbx_whoami {name}
    #[arg(long = "as", value_name = "AGENT", env = "MBX_AGENT")]
    pub as_agent: Option<String>,
    /// Print the tool list with its input schemas as JSON and exit (daemon/mcp-tools.json)
    #[arg(long, hide = true)]
    pub print_tools: bool,
}

/// Runs the server (or prints the tool list).
pub fn run(args: McpArgs) -> anyhow::Result<()> {
    if args.print_tools {
        print!("{}", crate::mcp::tools_json());
        return Ok(());
    }
    let agent = args.as_agent.filter(|a| !a.trim().is_empty());
    crate::mcp::run(agent)
}
