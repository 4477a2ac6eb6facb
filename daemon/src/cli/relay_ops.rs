//! `agentmbx relay rotate-epoch`, `agentmbx relay log` and `agentmbx relay backup`: the relay
//! operator's store operations (spec §5 "Restore from backup", "Backup"; `wire.md` §3.4). The
//! work is [`agentmbx_relay::ops`].
//!
//! - **rotate-epoch**: offline on `--store-dir` (refused with exit code 4 while a relay serves
//!   the store), or with `--url` through the running relay's admin endpoint (admin token as for
//!   `relay revoke`). Prints the receipt `{v:1, type:"relay-epoch-rotated", at, store, from, to,
//!   by:"operator"}`, which is in the relay log.
//! - **log**: the relay log, newest first, read-only (allowed while the relay serves); a text
//!   line `<at>  <op>  <summary>` per entry, or `--json`.
//! - **backup**: an online copy of the store to `<file>` (never overwrites: an existing file is
//!   refused with `EXISTS`, exit 1), allowed while the relay serves. The receipt is printed and
//!   appended to the relay log: offline directly; while a relay serves the store, through its
//!   admin endpoint when `--url` is given, else it is printed only and a note on stderr says
//!   it was not logged (only the serving relay may write its store); the backup itself is
//!   complete either way.
//!
//! Exit codes: 0 done, 1 failure (also `EXISTS`), 2 usage, 3 no store, 4 a relay runs on the
//! store (rotate-epoch without `--url`). Never prints or logs the admin token.

use std::path::PathBuf;

use anyhow::Context;
use clap::Args;
use serde_json::{json, Value};

use agentmbx_relay::admin::{self, AdminError};
use agentmbx_relay::ops::{self, OpsError, RotatedBy};
use agentmbx_relay::store::RelayStore as _;

use super::relay_admin::{now_ms, offline, online, place, print, refusal, Place, Target};
use super::NotFoundError;

/// Flags of `relay rotate-epoch`.
#[derive(Debug, Args)]
#[command(
    after_long_help = "A new epoch: hosts see it on their next push or pull; senders \
re-push every message the relay accepted and the recipient has not confirmed, receivers \
re-pull from 0, and dedup on both ends absorbs the repeats. Run it after restoring a store by \
any other means than `agentmbx relay restore` (a volume snapshot, a file copy). Exit status: \
0 rotated, 1 failure, 2 usage error, 3 no store, 4 a relay runs on the store (use --url). \
With --url the admin token comes from --admin-token-file, else from MBX_RELAY_ADMIN_TOKEN."
)]
pub struct RotateEpochArgs {
    #[command(flatten)]
    pub target: Target,
}

/// Flags of `relay log`.
#[derive(Debug, Args)]
#[command(
    after_long_help = "Read-only: allowed while the relay serves the store. Exit status: \
0 shown, 1 failure, 2 usage error, 3 no store."
)]
pub struct LogArgs {
    /// The relay store directory
    #[arg(long, value_name = "DIR", env = "MBX_RELAY_DIR", required = true)]
    pub store_dir: PathBuf,
    /// How many of the newest entries to show (1..=1000)
    #[arg(long, default_value_t = 50, value_parser = clap::value_parser!(u32).range(1..=1000))]
    pub limit: u32,
    /// Print as JSON: [{id, at, op, receipt}]
    #[arg(long)]
    pub json: bool,
}

/// Flags of `relay backup`.
#[derive(Debug, Args)]
#[command(
    after_long_help = "The SQLite online backup in one step (one consistent snapshot, \
safe while the relay serves), written to <file>.partial-<pid>, switched to the rollback \
journal, integrity-checked, fsynced and then given its name; an existing <file> is never \
overwritten (EXISTS) and no partial file remains on failure. The receipt goes to the relay \
log: directly when no relay serves the store; while one does, through its admin endpoint with \
--url (admin token from --admin-token-file or MBX_RELAY_ADMIN_TOKEN), else it is printed only. \
The backup holds sealed bodies and routing metadata, never a private key. Exit status: 0 \
written, 1 failure (EXISTS, integrity), 2 usage error, 3 no store."
)]
pub struct BackupArgs {
    /// The backup file to create (its directory must exist)
    #[arg(value_name = "FILE")]
    pub file: PathBuf,
    /// The relay store directory
    #[arg(long, value_name = "DIR", env = "MBX_RELAY_DIR", required = true)]
    pub store_dir: PathBuf,
    /// Log the receipt through the running relay at this URL (its admin endpoint)
    #[arg(long, value_name = "URL")]
    pub url: Option<String>,
    /// File holding the relay's admin token (with --url; wins over MBX_RELAY_ADMIN_TOKEN)
    #[arg(long, value_name = "FILE", requires = "url")]
    pub admin_token_file: Option<PathBuf>,
    /// Send the admin token over plain http:// to a host that is not this machine
    #[arg(long, requires = "url")]
    pub insecure_http: bool,
    /// Print the receipt as JSON
    #[arg(long)]
    pub json: bool,
}

/// `relay rotate-epoch`.
pub fn rotate_epoch(args: RotateEpochArgs) -> anyhow::Result<()> {
    let receipt: Value = match place(&args.target)? {
        Place::Offline(dir) => {
            let store_db = ops::store_db(&dir);
            offline(&dir, |store, now| {
                ops::rotate_epoch(store, &store_db, RotatedBy::Operator, now)
                    .map_err(AdminError::from)
            })?
        }
        Place::Online(target) => online(
            &target,
            "POST",
            "/v2/relay/admin/rotate-epoch",
            Some(json!({})),
        )?,
    };
    let text = format!(
        "epoch rotated: {} -> {}: senders re-push what the relay accepted and the recipient has \
         not confirmed, receivers re-pull from 0",
        receipt["from"].as_str().unwrap_or(""),
        receipt["to"].as_str().unwrap_or("")
    );
    print(args.target.json, &receipt, &text)
}

/// Maps an operation's refusal to the CLI's error kinds.
fn ops_refusal(e: OpsError) -> anyhow::Error {
    match e {
        e @ OpsError::NoStore(_) => NotFoundError(e.to_string()).into(),
        e => anyhow::Error::new(e),
    }
}

/// `relay log`.
pub fn log(args: LogArgs) -> anyhow::Result<()> {
    let entries = ops::read_log(&args.store_dir, i64::from(args.limit)).map_err(ops_refusal)?;
    if args.json {
        let list: Vec<Value> = entries
            .iter()
            .map(|e| {
                json!({"id": e.id, "at": agentmbx_protocol::time::iso_ms(e.at_ms),
                       "op": e.op, "receipt": e.receipt})
            })
            .collect();
        println!("{}", serde_json::to_string_pretty(&list)?);
        return Ok(());
    }
    if entries.is_empty() {
        println!("the relay log is empty");
    }
    for e in &entries {
        println!(
            "{}  {}  {}",
            agentmbx_protocol::time::iso_ms(e.at_ms),
            e.op,
            ops::summary(e)
        );
    }
    Ok(())
}

/// `relay backup <file>`.
pub fn backup(args: BackupArgs) -> anyhow::Result<()> {
    // The URL and token are checked before anything is written.
    let online_target = match &args.url {
        Some(url) => {
            let t = Target {
                store_dir: None,
                url: Some(url.clone()),
                admin_token_file: args.admin_token_file.clone(),
                insecure_http: args.insecure_http,
                json: args.json,
            };
            match place(&t)? {
                Place::Online(o) => Some(o),
                Place::Offline(_) => None,
            }
        }
        None => None,
    };
    let now = now_ms()?;
    let receipt = ops::backup(&args.store_dir, &args.file, now).map_err(ops_refusal)?;
    let text = format!(
        "backup written to {} ({} bytes, sha256 {}): {} items for {} targets, {} enrolments, \
         epoch {}\nrestore it with: {}",
        receipt["file"].as_str().unwrap_or(""),
        receipt["bytes"],
        receipt["sha256"].as_str().unwrap_or(""),
        receipt["counts"]["items"],
        receipt["counts"]["targets"],
        receipt["counts"]["enrolments"],
        receipt["epoch"].as_str().unwrap_or(""),
        receipt["restore"].as_str().unwrap_or("")
    );
    print(args.json, &receipt, &text)?;
    // The backup is complete; now its receipt goes to the relay log.
    if let Some(target) = online_target {
        online(
            &target,
            "POST",
            "/v2/relay/admin/backup-receipt",
            Some(json!({ "receipt": receipt })),
        )
        .context("the backup is complete, but its receipt was not logged")?;
        return Ok(());
    }
    match admin::open_offline(&args.store_dir, now) {
        Ok(store) => {
            let logged = store.append_op(now, ops::OP_BACKUP, &receipt);
            store.close().context("closing the relay store")?;
            logged.context("the backup is complete, but its receipt was not logged")?;
        }
        Err(AdminError::Running(_)) => eprintln!(
            "note: the receipt was not added to the relay log, because a running relay holds the \
             store; give --url <relay url> with the admin token to log it through the relay"
        ),
        Err(e) => {
            return Err(refusal(e))
                .context("the backup is complete, but its receipt was not logged")
        }
    }
    Ok(())
}
