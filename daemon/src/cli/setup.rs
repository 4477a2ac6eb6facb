//! `agentmbx setup [--only claude,codex] [--as AGENT] [--project DIR] [--dry-run] [--uninstall]
//! [--yes] [--json]`: registers `agentmbx mcp` with the agent clients on this machine
//! ([`agentmbx::setup`]; 0.5.x's flags, `agent-surface.md`).
//!
//! Flow: plan every asked client, then (unless `--dry-run`) confirm and apply the steps that
//! change something. Without `--yes` it asks on a terminal; off a terminal it refuses (exit 2)
//! and says to rerun with `--yes` or `--dry-run`. Exit status: 0 done (or nothing to do), 1 a
//! client failed or an entry named `agentmbx` is not ours (left alone), or the question was
//! answered no, 2 usage.

use std::io::{BufRead, IsTerminal, Write};
use std::path::PathBuf;

use clap::Args;
use serde_json::{json, Value};

use agentmbx::paths::{Paths, HOME_ENV};
use agentmbx::setup::{self, Client, Context, Request, ServerSpec, Status, Step};

use super::UsageError;

/// Shown after `setup --help` and in `agentmbx-setup(1)`.
pub const SETUP_HELP: &str = "\
What it registers: the MCP server `agentmbx mcp [--as AGENT]` as the absolute path of this \
binary, with MBX_HOME in its environment when the home is not the default one.
  Claude Code: the user scope, through `claude mcp add --transport stdio --scope user agentmbx \
-- …` (skipped when `claude` is not on PATH); with --project DIR, DIR/.mcp.json instead.
  Codex: [mcp_servers.agentmbx] in $CODEX_HOME/config.toml (default ~/.codex/config.toml; \
skipped when that directory does not exist), with tool_timeout_sec = 90 (longer than \
mbx_wait's 45 s) and startup_timeout_sec = 30.
Files are edited in place: every other entry, the key order and the comments stay. Running \
setup again changes nothing (\"already set up\"); an entry named agentmbx that setup did not \
write is left alone. --uninstall removes only our entry. Without --yes, setup asks before \
writing on a terminal and refuses elsewhere (exit 2). --json prints {dry_run, uninstall, \
server, clients: [{client, status, target, note, change}]} with status one of added, updated, \
unchanged, removed, skipped, conflict, would-add, would-update, would-remove, error.
With --hooks, setup also installs the client hooks `agentmbx hook session-start|prompt|stop \
--cli <client> [--as AGENT]` (mail shown at the agent's next prompt): Claude Code in \
$CLAUDE_CONFIG_DIR/settings.json (default ~/.claude/settings.json), Codex in \
$CODEX_HOME/hooks.json (Codex reads it only with [features] codex_hooks = true; setup says so \
and leaves config.toml alone), same rules; --uninstall --hooks removes them too.
Exit status: 0 done or nothing to do, 1 a client failed, an entry is not ours, or the answer \
was no, 2 usage error (or no terminal to confirm on and no --yes).";

/// Flags of `setup`.
#[derive(Debug, Args)]
#[command(after_long_help = SETUP_HELP)]
pub struct SetupArgs {
    /// Only these clients, comma-separated (default: all)
    #[arg(long, value_delimiter = ',', value_name = "CLIENT")]
    pub only: Vec<Client>,
    /// The agent the MCP server acts as (`agentmbx mcp --as AGENT`); without it the server
    /// takes MBX_AGENT from the client's environment
    #[arg(long = "as", value_name = "AGENT")]
    pub agent: Option<String>,
    /// Claude Code: write the entry to DIR/.mcp.json (one project) instead of the user scope
    #[arg(long, value_name = "DIR")]
    pub project: Option<PathBuf>,
    /// Print the change (a diff, or the exact `claude` commands) and write nothing
    #[arg(long)]
    pub dry_run: bool,
    /// Remove the entry setup added (only ours), instead of adding it
    #[arg(long)]
    pub uninstall: bool,
    /// Also install the client hooks that show new mail at the agent's next prompt (`agentmbx
    /// hook session-start|prompt|stop`): Claude Code's settings.json, Codex's hooks.json; with
    /// --uninstall, also remove them
    #[arg(long)]
    pub hooks: bool,
    /// Apply without asking
    #[arg(long, short = 'y')]
    pub yes: bool,
    /// Print a JSON summary per client
    #[arg(long)]
    pub json: bool,
}

/// Some client failed, or has an entry that is not ours, or the user said no (exit 1; the
/// report is printed already).
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct SetupFailed(pub String);

/// The home to name in the server's environment: `MBX_HOME` (made absolute) when it is set and
/// not the platform default, else `None`.
pub fn home_for_entry() -> anyhow::Result<Option<PathBuf>> {
    if std::env::var_os(HOME_ENV).is_none_or(|v| v.is_empty()) {
        return Ok(None);
    }
    let home = std::path::absolute(Paths::from_env()?.home())?;
    let default =
        directories::ProjectDirs::from("", "", "agentmbx").map(|d| d.data_dir().to_path_buf());
    Ok((default.as_deref() != Some(home.as_path())).then_some(home))
}

/// The entry this binary registers for `agent`.
pub fn spec_for(agent: Option<&str>) -> anyhow::Result<ServerSpec> {
    let exe = std::env::current_exe()?;
    let home = home_for_entry()?;
    Ok(ServerSpec::new(&exe, agent, home.as_deref()))
}

fn status_text(s: Status, uninstall: bool) -> &'static str {
    match s {
        Status::Added => "added",
        Status::Updated => "updated",
        Status::Unchanged if uninstall => "not registered, nothing to remove",
        Status::Unchanged => "already set up",
        Status::Removed => "removed",
        Status::Skipped => "skipped",
        Status::Conflict => "left alone",
        Status::WouldAdd => "would add",
        Status::WouldUpdate => "would update",
        Status::WouldRemove => "would remove",
    }
}

/// Runs `setup` (module docs).
pub fn run(args: SetupArgs) -> anyhow::Result<()> {
    if let Some(a) = &args.agent {
        if !agentmbx_protocol::limits::is_name(a) {
            return Err(UsageError(format!(
                "bad agent name {a:?}: {}",
                agentmbx::node::send::NAME_RULE
            ))
            .into());
        }
    }
    if let Some(dir) = &args.project {
        if !dir.is_dir() {
            return Err(UsageError(format!("--project {}: not a directory", dir.display())).into());
        }
    }
    let clients: Vec<Client> = if args.only.is_empty() {
        Client::ALL.to_vec()
    } else {
        Client::ALL
            .into_iter()
            .filter(|c| args.only.contains(c))
            .collect()
    };
    let spec = spec_for(args.agent.as_deref())?;
    let req = Request {
        clients: clients.clone(),
        spec: spec.clone(),
        uninstall: args.uninstall,
        project: args
            .project
            .as_deref()
            .map(std::path::absolute)
            .transpose()?,
    };
    let ctx = Context::from_env();
    let planned = setup::plan(&ctx, &req);
    let mut rows: Vec<Row> = clients
        .iter()
        .zip(planned)
        .map(|(c, r)| match r {
            Ok(step) => Row::Step(step),
            Err(e) => Row::Failed(*c, e.to_string()),
        })
        .collect();
    if args.hooks {
        for c in &clients {
            rows.push(match setup::plan_hooks(&ctx, *c, &spec, args.uninstall) {
                Ok(step) => Row::Step(step),
                Err(e) => Row::Failed(*c, e.to_string()),
            });
        }
    }
    let changing = rows
        .iter()
        .filter(|r| matches!(r, Row::Step(s) if s.status.changes()))
        .count();
    if args.dry_run {
        for r in &mut rows {
            if let Row::Step(s) = r {
                s.status = s.status.would();
            }
        }
        return finish(&args, &spec, &rows);
    }
    if changing > 0 && !args.yes {
        confirm(&args, &rows, changing)?;
    }
    for r in &mut rows {
        if let Row::Step(step) = r {
            if let Err(e) = setup::apply(step) {
                *r = Row::Failed(step.client, e.to_string());
            }
        }
    }
    finish(&args, &spec, &rows)
}

/// One client's line of the report.
enum Row {
    Step(Step),
    Failed(Client, String),
}

/// Asks on the terminal whether to apply the `changing` steps; refuses off a terminal.
fn confirm(args: &SetupArgs, rows: &[Row], changing: usize) -> anyhow::Result<()> {
    let stdin = std::io::stdin();
    if !stdin.is_terminal() || !std::io::stderr().is_terminal() {
        return Err(UsageError(format!(
            "setup would change {changing} client configuration(s) and there is no terminal to confirm on: rerun with --dry-run to see the change, or with --yes to apply it"
        ))
        .into());
    }
    let mut err = std::io::stderr();
    for r in rows {
        if let Row::Step(s) = r {
            if s.status.changes() {
                writeln!(
                    err,
                    "{} ({}): {}",
                    s.client.title(),
                    s.target,
                    status_text(s.status.would(), args.uninstall)
                )?;
                for l in s.change.lines() {
                    writeln!(err, "    {l}")?;
                }
            }
        }
    }
    write!(err, "Apply? [y/N] ")?;
    err.flush()?;
    let mut answer = String::new();
    stdin.lock().read_line(&mut answer)?;
    if matches!(answer.trim().to_ascii_lowercase().as_str(), "y" | "yes") {
        Ok(())
    } else {
        Err(SetupFailed("not applied: nothing changed".into()).into())
    }
}

/// Prints the report and decides the exit status.
fn finish(args: &SetupArgs, spec: &ServerSpec, rows: &[Row]) -> anyhow::Result<()> {
    let mut problems = Vec::new();
    for r in rows {
        match r {
            Row::Failed(c, e) => problems.push(format!("{}: {e}", c.title())),
            Row::Step(s) if s.status == Status::Conflict => problems.push(format!(
                "{}: an entry named agentmbx is not ours",
                s.client.title()
            )),
            _ => {}
        }
    }
    if args.json {
        let clients: Vec<Value> = rows
            .iter()
            .map(|r| match r {
                Row::Step(s) => json!({
                    "client": s.client,
                    "status": s.status,
                    "target": s.target,
                    "note": s.note,
                    "change": (!s.change.is_empty()).then_some(&s.change),
                }),
                Row::Failed(c, e) => json!({
                    "client": c, "status": "error", "target": null, "note": e, "change": null,
                }),
            })
            .collect();
        let env: serde_json::Map<String, Value> = spec
            .env
            .iter()
            .map(|(k, v)| (k.clone(), Value::String(v.clone())))
            .collect();
        let doc = json!({
            "dry_run": args.dry_run,
            "uninstall": args.uninstall,
            "server": {"name": setup::SERVER_NAME, "command": spec.command, "args": spec.args, "env": env},
            "clients": clients,
        });
        println!("{}", serde_json::to_string_pretty(&doc)?);
    } else {
        print!("{}", text(args, spec, rows));
    }
    if problems.is_empty() {
        Ok(())
    } else {
        Err(SetupFailed(problems.join("; ")).into())
    }
}

fn text(args: &SetupArgs, spec: &ServerSpec, rows: &[Row]) -> String {
    let mut out = String::new();
    if !args.uninstall {
        let cmd = std::iter::once(spec.command.as_str())
            .chain(spec.args.iter().map(String::as_str))
            .map(agentmbx::doctor::shell_quote)
            .collect::<Vec<_>>()
            .join(" ");
        let env: String = spec
            .env
            .iter()
            .map(|(k, v)| format!("{k}={} ", agentmbx::doctor::shell_quote(v)))
            .collect();
        out.push_str(&format!("MCP server {}: {env}{cmd}\n", setup::SERVER_NAME));
    }
    let mut applied = false;
    for r in rows {
        match r {
            Row::Step(s) => {
                out.push_str(&format!(
                    "{}: {} ({})\n",
                    s.client.title(),
                    status_text(s.status, args.uninstall),
                    s.target
                ));
                if let Some(n) = &s.note {
                    out.push_str(&format!("    {n}\n"));
                }
                if args.dry_run {
                    for l in s.change.lines() {
                        out.push_str(&format!("    {l}\n"));
                    }
                }
                applied |= s.status.changes();
            }
            Row::Failed(c, e) => out.push_str(&format!("{}: error: {e}\n", c.title())),
        }
    }
    if args.dry_run {
        out.push_str("dry run: nothing written\n");
    } else if applied && !args.uninstall {
        out.push_str(
            "Start a new session of the client (or reload its MCP servers) to use agentmbx.\n",
        );
    }
    out
}
