//! `agentmbx doctor [--json] [--fix] [--list] [CHECK…]`: checks this host's setup
//! ([`agentmbx::doctor`]; conventions.md "Platform conventions"; `wire.md` §7).
//!
//! Text output: one `✔ ! ✗ · ?` line per check (ok, warn, fail, skip, error), details indented,
//! then `    fix: …`. `--json`: `{schema: 1, checks: [{id, title, status, summary, details,
//! fix}], summary: {ok, warn, fail, skip, error}}`. Exit status: 0 no check failed, 1 a check
//! failed, 2 an unknown check id. Secrets (tokens, keys) never appear in the output.

use clap::Args;

use agentmbx::doctor::{self, Options, CHECKS};
use agentmbx::paths::Paths;
use agentmbx_protocol::clock::{Clock, SystemClock};

use super::UsageError;

/// The exit status of `doctor`, shown in its `--help`.
pub const DOCTOR_HELP: &str = "Checks: host-identity, keystore, daemon, peers, relay-reachable, \
relay-key, relay-enrolled, enc-ad, clock-skew, outbox, quarantine, service, disk-space (--list \
shows their titles). Network checks wait at most 2 s each and run concurrently. --fix applies \
only safe local fixes (create the data directory 0700, set key files to 0600) and reports them; \
for anything else it prints the command. Exit status: 0 no check failed, 1 a check failed, 2 an \
unknown check id.";

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
    /// Run only these checks (ids from --list)
    #[arg(value_name = "CHECK")]
    pub checks: Vec<String>,
}

/// The report said a check failed (exit status 1; the report is printed already).
#[derive(Debug, thiserror::Error)]
#[error("{0} check(s) failed")]
pub struct ChecksFailed(pub usize);

/// Runs `doctor` (module docs).
pub fn run(args: DoctorArgs) -> anyhow::Result<()> {
    if args.list {
        if args.json {
            let list: Vec<_> = CHECKS
                .iter()
                .map(|c| serde_json::json!({"id": c.id, "title": c.title}))
                .collect();
            println!("{}", serde_json::to_string_pretty(&list)?);
        } else {
            for c in CHECKS {
                println!("{:<16} {}", c.id, c.title);
            }
        }
        return Ok(());
    }
    let selected = doctor::select(&args.checks).map_err(|e| UsageError(e.to_string()))?;
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
    match report.summary.fail {
        0 => Ok(()),
        n => Err(ChecksFailed(n).into()),
    }
}
