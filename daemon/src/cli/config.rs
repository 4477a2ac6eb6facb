//! `agentmbx config validate [--file PATH] [--json]`: check a `config.toml` before the daemon
//! reads it (design README "Files, configuration and keys").
//!
//! Exit codes as every command (`cli` module doc): 0 valid, 1 invalid (the message names the
//! key and, for a parse error, the line), 3 no file (the defaults apply). It only reads: it
//! never writes the file, and never prints secrets (`relay.token_command` is redacted).

use std::path::PathBuf;

use agentmbx::config::Config;
use agentmbx::paths::Paths;
use anyhow::Context;
use clap::{Args, Subcommand};

use super::NotFoundError;

/// `config` subcommands.
#[derive(Debug, Subcommand)]
pub enum ConfigCommand {
    /// Check config.toml (default: the one in MBX_HOME): exit 0 valid, 1 invalid, 3 no file
    Validate(ValidateArgs),
}

/// Flags of `config validate`.
#[derive(Debug, Args)]
pub struct ValidateArgs {
    /// The file to check (default: config.toml in MBX_HOME)
    #[arg(long, value_name = "PATH")]
    pub file: Option<PathBuf>,
    /// Print the effective settings (file, then environment) as JSON, secrets redacted
    #[arg(long)]
    pub json: bool,
}

/// Runs a `config` subcommand.
pub fn run(cmd: ConfigCommand) -> anyhow::Result<()> {
    match cmd {
        ConfigCommand::Validate(args) => validate(args),
    }
}

fn validate(args: ValidateArgs) -> anyhow::Result<()> {
    let path = match args.file {
        Some(p) => p,
        None => Paths::from_env()?.config_file(),
    };
    let name = path.file_name().map_or_else(
        || path.display().to_string(),
        |n| n.to_string_lossy().into(),
    );
    let Some(file) = Config::read_file(&path)? else {
        return Err(NotFoundError(format!(
            "no config file at {}: the defaults apply",
            path.display()
        ))
        .into());
    };
    file.validate()?;
    let mut effective = file;
    effective
        .apply_env(|var| std::env::var(var).ok())
        .context("the file is valid, but the environment is not")?;
    effective
        .validate()
        .context("the file is valid, but not with the environment's overrides")?;
    if args.json {
        if let Some(r) = effective.relay.as_mut() {
            if r.token_command.is_some() {
                r.token_command = Some("<redacted>".into());
            }
        }
        let out = serde_json::json!({
            "valid": true,
            "file": path.display().to_string(),
            "config": effective,
        });
        println!("{}", serde_json::to_string_pretty(&out)?);
    } else {
        println!("{name} is valid");
    }
    Ok(())
}
