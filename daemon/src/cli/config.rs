//! `agentmbx config validate [--file PATH] [--json]`: check a `config.toml` before the daemon
//! reads it (design README "Files, configuration and keys").
//!
//! Exit codes as every command (`cli` module doc): 0 valid, 1 invalid (the message names the
//! file, the key and, when it can be found, the line), 3 no file (the defaults apply). It
//! only reads: it never writes the file, and never prints secrets (`relay.token_command` is
//! redacted).

use std::path::{Path, PathBuf};

use agentmbx::config::{Config, ENV_KEYS, LOG_ENV, NO_MDNS_ENV};
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
    /// Print the effective settings (file, then environment) as JSON, secrets redacted, with
    /// where each comes from: {valid, file, config, sources: {key: "file"|"default"|"env VAR"}}
    #[arg(long)]
    pub json: bool,
}

/// Runs a `config` subcommand.
pub fn run(cmd: ConfigCommand) -> anyhow::Result<()> {
    match cmd {
        ConfigCommand::Validate(args) => validate(args),
    }
}

/// The settings whose source `--json` reports (dotted for the `[relay]` table).
const KEYS: &[&str] = &[
    "host",
    "api_port",
    "api_bind",
    "lan_port",
    "lan_bind",
    "advertise",
    "self_addrs",
    "mdns",
    "relay_pull_interval_ms",
    "relay_stream",
    "key_store",
    "log_level",
    "hook_concurrency",
    "hooks",
    "relay.url",
    "relay.key",
    "relay.token_command",
];

/// The variables of [`ENV_KEYS`] set (non-empty) in this process, with the key each
/// overrides. `MBX_NO_MDNS=0` overrides nothing.
fn env_overrides() -> Vec<(&'static str, &'static str, String)> {
    ENV_KEYS
        .iter()
        .filter_map(|&(var, key)| {
            let value = std::env::var(var).ok().filter(|v| !v.trim().is_empty())?;
            (var != NO_MDNS_ENV || value.trim() != "0").then_some((var, key, value))
        })
        .collect()
}

/// Whether the file's text sets the dotted `key`.
fn file_sets(table: &toml::Table, key: &str) -> bool {
    match key.split_once('.') {
        Some((t, k)) => table
            .get(t)
            .and_then(toml::Value::as_table)
            .is_some_and(|t| t.contains_key(k)),
        None => table.contains_key(key),
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
    let Some(file) = Config::check_file(&path)? else {
        return Err(NotFoundError(format!(
            "no config file at {}: the defaults apply",
            path.display()
        ))
        .into());
    };
    let mut effective = file.clone();
    effective
        .apply_env(|var| std::env::var(var).ok())
        .context("the file is valid, but the environment is not")?;
    effective
        .validate()
        .context("the file is valid, but not with the environment's overrides")?;
    let overrides = env_overrides();
    if let Some((_, _, level)) = overrides.iter().find(|(var, _, _)| *var == LOG_ENV) {
        effective.log_level = Some(level.trim().to_string());
    }
    if args.json {
        let table = file_table(&path);
        let sources: serde_json::Map<String, serde_json::Value> = KEYS
            .iter()
            .map(|&key| {
                let source = match overrides.iter().find(|(_, k, _)| *k == key) {
                    Some((var, _, _)) => format!("env {var}"),
                    None if file_sets(&table, key) => "file".into(),
                    None => "default".into(),
                };
                (key.to_string(), source.into())
            })
            .collect();
        if let Some(r) = effective.relay.as_mut() {
            if r.token_command.is_some() {
                r.token_command = Some("<redacted>".into());
            }
        }
        // A hook's command line may carry a secret, as a token command may.
        for h in &mut effective.hooks {
            h.command = vec!["<redacted>".into()];
        }
        let out = serde_json::json!({
            "valid": true,
            "file": path.display().to_string(),
            "config": effective,
            "sources": sources,
        });
        println!("{}", serde_json::to_string_pretty(&out)?);
    } else {
        println!("{name} is valid");
        for (var, key, value) in &overrides {
            println!("{key}: {var}={value:?} in the environment overrides the file");
        }
    }
    Ok(())
}

/// The file as a TOML table (empty when it cannot be read again).
fn file_table(path: &Path) -> toml::Table {
    std::fs::read_to_string(path)
        .ok()
        .and_then(|t| t.parse().ok())
        .unwrap_or_default()
}
