//! `agentmbx relay status --store-dir <dir> [--json] [--top N]`: an operator's view of a relay
//! store (spec §5, §7; `wire.md` §3.4). The facts come from [`agentmbx_relay::status`]:
//! read-only, without `relay.lock`, creating nothing, so it works while the relay serves.
//!
//! Exit codes, as the other relay store commands: 0 shown, 1 failure (a damaged store, a
//! newer schema), 2 usage, 3 no store.

use std::path::PathBuf;

use clap::Args;

use agentmbx_relay::status::{self, StatusError, DEFAULT_TOP, MAX_TOP};

use super::relay_admin::now_ms;
use super::NotFoundError;

/// Shown after `relay status --help` and in `agentmbx-relay-status(1)`.
const STATUS_HELP: &str = "\
Read-only: the store is opened read-only, relay.lock is never taken and nothing is created, so \
it works while the relay serves (and on a stopped store).

Text: one fact per line: store and schema, relay key fingerprint, epoch, enrolled and revoked \
hosts, queued items and bytes with the age of the oldest item, the deepest target queues (name, \
fingerprint, items, bytes, oldest item), the last heartbeat (written every 30 s while a relay \
serves), the last backup from the relay log, dedup rows.

--json prints one object (times ISO 8601 UTC with ms; ages in ms, negative for a moment in the \
future; sizes in bytes):
  {v:1, store, at, schema_version, relay_pubkey, relay_fingerprint, epoch,
   hosts:{enrolled, revoked},
   queue:{items, bytes, targets, oldest_at, oldest_age_ms,
          deepest:[{host, host_pubkey, fingerprint, revoked, items, bytes,
                    oldest_at, oldest_age_ms}]},
   heartbeat:{at, age_ms}|{unreadable:true}|null,
   last_backup:{at, age_ms, file, bytes}|null,
   dedup_rows}
oldest_at and oldest_age_ms are null when nothing is queued; deepest lists at most --top \
targets, most items first (then most bytes); host is null for a key without an enrolment.

Exit status: 0 shown, 1 failure, 2 usage error, 3 no store.";

/// Flags of `relay status`.
#[derive(Debug, Args)]
#[command(after_long_help = STATUS_HELP)]
pub struct StatusArgs {
    /// The relay store directory
    #[arg(long, value_name = "DIR", env = "MBX_RELAY_DIR", required = true)]
    pub store_dir: PathBuf,
    /// How many of the deepest target queues to list (0..=1000)
    #[arg(long, value_name = "N", default_value_t = DEFAULT_TOP as u32,
          value_parser = clap::value_parser!(u32).range(0..=MAX_TOP as i64))]
    pub top: u32,
    /// Print one JSON object (shape below)
    #[arg(long)]
    pub json: bool,
}

/// `relay status`.
pub fn status(args: StatusArgs) -> anyhow::Result<()> {
    let now = now_ms()?;
    let top = usize::try_from(args.top).unwrap_or(MAX_TOP);
    let st = status::read(&args.store_dir, now, top).map_err(|e| match e {
        e @ StatusError::NoStore(_) => anyhow::Error::new(NotFoundError(e.to_string())),
        e => anyhow::Error::new(e),
    })?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&st.to_json())?);
    } else {
        print!("{}", st.text());
    }
    Ok(())
}
