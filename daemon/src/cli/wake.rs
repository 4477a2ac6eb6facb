//! `agentmbx wake mute|unmute <agent> [--minutes N]`: the owner's mute of an agent's wakes
//! (Claude Code channel notifications from `agentmbx mcp`), kept by the running daemon in
//! `mailbox.db` (kv `wake-mute:<agent>`, as 0.5.x) through `POST /v1/wakes/mute|unmute`.

use clap::{Args, Subcommand};
use serde_json::json;

use crate::local_api::{mint_key, Api, Mutation};

/// `wake` subcommands.
#[derive(Debug, Subcommand)]
pub enum WakeCommand {
    /// Stop waking an agent's sessions for a while (mail still arrives; waits still answer)
    Mute(MuteArgs),
    /// Wake an agent's sessions again
    Unmute(UnmuteArgs),
}

/// Flags of `wake mute`.
#[derive(Debug, Args)]
pub struct MuteArgs {
    /// The agent on this host
    pub agent: String,
    /// How long, minutes (1..10080, a week)
    #[arg(long, default_value_t = 60, value_parser = clap::value_parser!(u32).range(1..=10080))]
    pub minutes: u32,
    /// Print the daemon's answer as JSON ({until_ms})
    #[arg(long)]
    pub json: bool,
}

/// Flags of `wake unmute`.
#[derive(Debug, Args)]
pub struct UnmuteArgs {
    /// The agent on this host
    pub agent: String,
    /// Print the daemon's answer as JSON ({was_muted})
    #[arg(long)]
    pub json: bool,
}

/// Runs a `wake` subcommand against the running daemon. Errors: the daemon is not running, an
/// agent this host does not have (exit 3), a bad name (exit 2).
pub fn run(cmd: WakeCommand) -> anyhow::Result<()> {
    let api = Api::connect()?;
    let key = mint_key();
    let (path, body, agent, json_out) = match &cmd {
        WakeCommand::Mute(a) => (
            "/v1/wakes/mute",
            json!({"as": a.agent, "minutes": a.minutes}),
            a.agent.clone(),
            a.json,
        ),
        WakeCommand::Unmute(a) => (
            "/v1/wakes/unmute",
            json!({"as": a.agent}),
            a.agent.clone(),
            a.json,
        ),
    };
    let m = Mutation {
        what: "wake mute change",
        key: &key,
        check: format!("agentmbx wake mute {agent}"),
    };
    let out = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?
        .block_on(api.mutate(path, &body, &m))?;
    if json_out {
        println!("{}", serde_json::to_string_pretty(&out)?);
        return Ok(());
    }
    match cmd {
        WakeCommand::Mute(a) => {
            let until = out["until_ms"].as_i64().unwrap_or(0);
            let when = agentmbx_protocol::time::iso_ms(until);
            println!(
                "wakes for {} muted for {} min (until {when})",
                a.agent, a.minutes
            );
        }
        WakeCommand::Unmute(a) => {
            if out["was_muted"].as_bool().unwrap_or(false) {
                println!("wakes for {} unmuted", a.agent);
            } else {
                println!("wakes for {} were not muted", a.agent);
            }
        }
    }
    Ok(())
}
