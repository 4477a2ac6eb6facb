//! `agentmbx doctor [--json] [--fix] [--list] [CHECK…]`: checks this host's setup
//! ([`agentmbx::doctor`]; conventions.md "Platform conventions"; `wire.md` §7).
//!
//! Text output: one `✔ ! ✗ · ?` line per check (ok, warn, fail, skip, error), details indented,
//! then `    fix: …`. `--json`: `{schema: 2, checks: [{id, title, status, summary, details,
//! fix}], summary: {ok, warn, fail, skip, error}}`; `fix` is a runnable shell command or `null`.
//! Exit status: 0 no check failed, 1 a check is `fail` or `error` (a check that could not run
//! has not shown the host healthy), 2 an unknown check id (also with `--list`). Secrets
//! (tokens, keys) never appear in the output.

use clap::Args;

use agentmbx::doctor::{self, Options, CHECKS};
use agentmbx::paths::Paths;
use agentmbx_protocol::clock::{Clock, SystemClock};

use super::UsageError;

/// The checks and exit status of `doctor`, shown in its `--help`.
pub const DOCTOR_HELP: &str = "Checks: config, host-identity, keystore, daemon, host-key-clone, \
peers, peer-key-clone, relay-reachable, relay-key, relay-enrolled, relay-stream, enc-ad, clock-skew, outbox, quarantine, unclaimed, service, \
mcp-setup, disk-space (--list shows their titles). Network checks wait at most 2 s each and run \
concurrently. A `fix:` line is a shell command to run as it stands; explanations are in the \
lines above it. --fix applies only safe local fixes (create the data directory 0700, tighten \
the data directory to 0700 and key files to 0600 when this user owns them and the directory is \
not sticky) and reports them; for anything else it prints the command. Exit status: 0 no check \
failed, 1 a check failed or could not run (status fail or error), 2 an unknown check id.";

/// The check ids as clap's possible values (completions offer them; `--help` lists them in
/// [`DOCTOR_HELP`]).
fn check_ids() -> clap::builder::PossibleValuesParser {
    clap::builder::PossibleValuesParser::new(
        CHECKS
            .iter()
            .map(|c| clap::builder::PossibleValue::new(c.id).help(c.title)),
    )
}

/// Flags of `doctor`.
#[derive(Debug, Args)]
#[command(after_long_help = DOCTOR_HELP)]
pub struct DoctorArgs {
    /// Print as JSON: {schema, checks:[{id,title,status,summary,details,fix}], summary}
    #[arg(long)]
    pub json: bool,
    /// Apply safe local fixes (data directory 0700, key files 0600) and report them
    #[arg(long)]
    pub fix: bool,
    /// List the check ids and titles, run nothing
    #[arg(long)]
    pub list: bool,
    /// Run (with --list: list) only these checks (ids from --list)
    #[arg(value_name = "CHECK", value_parser = check_ids(), hide_possible_values = true)]
    pub checks: Vec<String>,
}

/// The report said a check failed or could not run (exit status 1; the report is printed
/// already).
#[derive(Debug, thiserror::Error)]
#[error("{0} check(s) failed or could not run")]
pub struct ChecksFailed(pub usize);

/// Runs `doctor` (module docs).
pub fn run(args: DoctorArgs) -> anyhow::Result<()> {
    let selected = doctor::select(&args.checks).map_err(|e| UsageError(e.to_string()))?;
    if args.list {
        if args.json {
            let list: Vec<_> = selected
                .iter()
                .map(|c| serde_json::json!({"id": c.id, "title": c.title}))
                .collect();
            println!("{}", serde_json::to_string_pretty(&list)?);
        } else {
            for c in &selected {
                println!("{:<16} {}", c.id, c.title);
            }
        }
        return Ok(());
    }
    let paths = Paths::from_env()?;
    let now_ms = SystemClock::from_env()?.now_ms();
    let opts = Options {
        fix: args.fix,
        timeout: doctor::DEFAULT_TIMEOUT,
        now_ms,
    };
    let report = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?
        .block_on(doctor::run(paths, &selected, opts));
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        print!("{}", report.text());
    }
    match report.exit_code() {
        0 => Ok(()),
        _ => Err(ChecksFailed(report.summary.fail + report.summary.error).into()),
    }
}
