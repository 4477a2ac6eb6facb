//! `agentmbx relay rotate-epoch`, `agentmbx relay log`, `agentmbx relay backup` and
//! `agentmbx relay restore`: the relay operator's store operations (spec §5 "Restore from
//! backup", "Backup"; `wire.md` §3.4). The work is [`agentmbx_relay::ops`].
//!
//! - **rotate-epoch**: offline on `--store-dir` (refused with exit code 4 while a relay serves
//!   the store), or with `--url` through the running relay's admin endpoint (admin token as for
//!   `relay revoke`). Prints the receipt `{v:1, type:"relay-epoch-rotated", at, store, from, to,
//!   by:"operator"}`, which is in the relay log.
//! - **log**: the relay log, newest first, read-only (allowed while the relay serves); a text
//!   line `<at>  <op>  <mark><summary>` per entry, or `--json` (`verified`). Every receipt is
//!   signed with the relay key: the mark is [`SIGNED_MARK`], or [`UNVERIFIED_MARK`]
//!   (`"verified": false`) for one that does not verify with the relay key (`MBX_RELAY_KEY` or
//!   `relay.key` when available, else the key the store records; a warning says when the two
//!   differ) or whose `op` column is not its signed `type`, which a warning on stderr also
//!   counts. A verified entry shows its receipt's own `type` and `at`. An entry whose receipt
//!   cannot be read is listed as unreadable (`"unreadable"`: why) and the rest still shows.
//! - **backup**: an online copy of the store to `<file>` (never overwrites: an existing file is
//!   refused with `EXISTS`, exit 1), allowed while the relay serves. The receipt is printed and
//!   appended to the relay log: offline directly; while a relay serves the store (only it may
//!   write it), through its admin endpoint — the one `--url` names, else the relay on this
//!   machine when its admin token is configured here ([`local_admin_endpoint`]: the token from
//!   `MBX_RELAY_ADMIN_TOKEN` or `relay.toml`'s `admin_token_file`, the port from `PORT` or
//!   `relay.toml`). When neither works the receipt is printed only (signed when the relay key
//!   is available) and a note on stderr says it was not logged, why, and that `--url` logs
//!   it. The backup itself is complete either way (exit 0; a failure through an explicit
//!   `--url` is exit 1).
//! - **restore**: replaces the store with a backup while no relay runs on it
//!   ([`agentmbx_relay::ops::restore`]): refused while a relay holds the store (`RELAY_RUNNING`,
//!   exit 4) and for a file that is not this relay's store; the replaced store is kept under
//!   `rollback/` and the receipt's `rollback` is the command that undoes it.
//!
//! The offline commands sign their receipts with the relay key: `MBX_RELAY_KEY` when set, else
//! `relay.key` in the store directory (never created here). Without either they still run —
//! the same rule for every offline operator command, so none of them waits for a key that
//! lives only in a platform secret — and write their receipt unsigned, with one warning on
//! stderr; `relay log` marks such a receipt NOT VERIFIED. A malformed key is an error.
//!
//! Exit codes: 0 done, 1 failure (also `EXISTS`, `NOT_A_STORE`, `OTHER_RELAY`,
//! `CURRENT_UNREADABLE`), 2 usage, 3 no store (no backup file for restore), 4 a relay runs on
//! the store (rotate-epoch without `--url`, restore). Never prints or logs the admin token.

use std::path::PathBuf;

use anyhow::Context;
use clap::Args;
use serde_json::{json, Value};

use agentmbx_relay::admin::{self, AdminError};
use agentmbx_relay::ops::{self, OpsError, RestoreError, RotatedBy};
use agentmbx_relay::store::OperationsStore as _;

use super::relay_admin::{
    local_admin_endpoint, now_ms, offline, online, place, print, refusal, warn_unsigned, Place,
    RelayRunning, Target,
};
use super::NotFoundError;

/// Starts the summary of a `relay log` line whose receipt verifies with the relay key.
pub const SIGNED_MARK: &str = "✔ ";

/// Starts the summary of a `relay log` line whose receipt does not verify (unsigned, altered,
/// or signed by another key).
pub const UNVERIFIED_MARK: &str = "✗ NOT VERIFIED: ";

/// Flags of `relay rotate-epoch`.
#[derive(Debug, Args)]
#[command(
    after_long_help = "A new epoch: hosts see it on their next push or pull; senders \
re-push every message the relay accepted and the recipient has not confirmed, receivers \
re-pull from 0, and dedup on both ends absorbs the repeats. Run it after restoring a store by \
any other means than `agentmbx relay restore` (a volume snapshot, a file copy). Exit status: \
0 rotated, 1 failure, 2 usage error, 3 no store, 4 a relay runs on the store (use --url). \
With --url the admin token comes from --admin-token-file, else from MBX_RELAY_ADMIN_TOKEN. \
Offline, the relay-log receipt is signed with the relay key (MBX_RELAY_KEY, else relay.key in \
the store directory); without either the epoch still rotates and the receipt is written \
unsigned, with a warning (relay log marks it NOT VERIFIED)."
)]
pub struct RotateEpochArgs {
    #[command(flatten)]
    pub target: Target,
}

/// Flags of `relay log`.
#[derive(Debug, Args)]
#[command(
    after_long_help = "Read-only: allowed while the relay serves the store. Each receipt \
is checked against the relay key (MBX_RELAY_KEY, else relay.key in the store directory, else \
the key the store records; a warning says when the store records another key): a verified \
entry shows its signed type and time, any other is marked NOT VERIFIED, and an entry whose \
receipt cannot be read is listed as unreadable while the rest still shows. Exit status: \
0 shown, 1 failure, 2 usage error, 3 no store."
)]
pub struct LogArgs {
    /// The relay store directory
    #[arg(long, value_name = "DIR", env = "MBX_RELAY_DIR", required = true)]
    pub store_dir: PathBuf,
    /// How many of the newest entries to show (1..=1000; the log keeps 1,000 entries and,
    /// apart from them, the newest 100 relay-sweep receipts)
    #[arg(long, default_value_t = 50, value_parser = clap::value_parser!(u32).range(1..=1000))]
    pub limit: u32,
    /// Print as JSON: [{id, at, op, receipt, verified, unreadable}] (unreadable: why, or null)
    #[arg(long)]
    pub json: bool,
}

/// Flags of `relay restore`.
#[derive(Debug, Args)]
#[command(
    after_long_help = "Stop the relay first: a restore never replaces a store a relay \
holds (RELAY_RUNNING, exit 4). The backup is copied and checked (a relay store of this relay's \
key, with exactly the tables, indexes and triggers of its schema version in this agentmbx: no other trigger, no view), the current store is kept as rollback/relay-<time>.db in \
the store directory, and what the current store took away or learned since the backup is \
carried forward: host key rotations (the new key takes over the enrolment, the old key's \
queue and allowlists), revocations, deny-list entries, newer sender allowlists and enc-key \
ads, sequence floors, the relay log. Enrolments made after the backup are not: those hosts \
enrol again by themselves. The epoch rotates, so senders re-push what the relay accepted and \
the recipient has not confirmed and receivers re-pull from 0; dedup absorbs the repeats. The \
receipt goes to the relay log and names the command that undoes the restore; it is signed \
with the relay key (MBX_RELAY_KEY, else relay.key in the store directory), which must be the \
backup's. Without either the restore still runs (the backup is checked against the current \
store's key) and the receipt is written unsigned, with a warning (relay log marks it NOT \
VERIFIED). A current store written by a newer agentmbx is never replaced (SCHEMA). Exit \
status: 0 restored, 1 failure (NOT_A_STORE, SCHEMA, OTHER_RELAY, CURRENT_UNREADABLE, a failure \
writing the rollback copy…), 2 usage error, 3 no such backup file (or not a regular file), 4 a \
relay runs on the store."
)]
pub struct RestoreArgs {
    /// The backup file (`agentmbx relay backup` wrote it; never changed)
    #[arg(value_name = "FILE")]
    pub file: PathBuf,
    /// The relay store directory
    #[arg(long, value_name = "DIR", env = "MBX_RELAY_DIR", required = true)]
    pub store_dir: PathBuf,
    /// Restore although the current store cannot be read: its revocations, deny-list and log
    /// are then not carried forward (its files are kept in rollback/); also skips the check
    /// for a relay without relay.lock that wrote a heartbeat less than 90 s ago
    #[arg(long)]
    pub force: bool,
    /// Print the receipt as JSON
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
log: directly when no relay serves the store (signed with MBX_RELAY_KEY or relay.key; \
without either, unsigned with a warning). While a relay serves the store only it may write \
it, so the receipt goes through its admin endpoint: the one --url names (admin token from \
--admin-token-file or MBX_RELAY_ADMIN_TOKEN), else the relay on this machine when its admin \
token is configured here (MBX_RELAY_ADMIN_TOKEN, or admin_token_file in the store's \
relay.toml) at http://127.0.0.1:<port> (PORT, else relay.toml's port, else 7374). When that \
is not possible the receipt is printed only (signed when the relay key is available) and a \
note on stderr says it was not logged and why; run the backup with --url to log it. The \
backup holds sealed bodies and routing metadata, never a private key. Exit status: 0 \
written, 1 failure (EXISTS, integrity, or logging through an explicit --url), 2 usage error, \
3 no store."
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
    // The relay's own key, when this machine has it: a store re-signed with another key (and
    // carrying that key) must not show as verified.
    let relay_key = match ops::offline_relay_key_if_any(&args.store_dir) {
        Ok(key) => key.map(|k| k.public()),
        Err(e) => {
            eprintln!("warning: the relay key cannot be read ({e}); receipts are checked against the key the store records");
            None
        }
    };
    let (entries, key_warning) =
        ops::read_verified_log_with(&args.store_dir, i64::from(args.limit), relay_key.as_ref())
            .map_err(ops_refusal)?;
    let unverified = entries.iter().filter(|e| !e.verified).count();
    let unreadable = entries.iter().filter(|e| e.problem.is_some()).count();
    if args.json {
        let list: Vec<Value> = entries
            .iter()
            .map(|v| {
                let e = &v.record;
                json!({"id": e.id, "at": agentmbx_protocol::time::iso_ms(v.at_ms()),
                       "op": v.op(), "receipt": e.receipt, "verified": v.verified,
                       "unreadable": v.problem})
            })
            .collect();
        println!("{}", serde_json::to_string_pretty(&list)?);
    } else {
        if entries.is_empty() {
            println!("the relay log is empty");
        }
        for v in &entries {
            let shown = match &v.problem {
                Some(problem) => format!("entry {} is unreadable: {problem}", v.record.id),
                None => ops::summary(&v.record),
            };
            println!(
                "{}  {}  {}{}",
                agentmbx_protocol::time::iso_ms(v.at_ms()),
                v.op(),
                if v.verified {
                    SIGNED_MARK
                } else {
                    UNVERIFIED_MARK
                },
                shown
            );
        }
    }
    if let Some(w) = key_warning {
        eprintln!("warning: {w}");
    }
    if unreadable > 0 {
        eprintln!(
            "warning: {unreadable} relay-log entr(y/ies) cannot be read (listed as unreadable)"
        );
    }
    if unverified > 0 {
        eprintln!(
            "warning: {unverified} receipt(s) shown do not verify with the relay key \
             (unsigned, altered, unreadable, or written by another key)"
        );
    }
    Ok(())
}

/// Maps a restore refusal to the CLI's error kinds (exit codes, module docs).
fn restore_refusal(e: RestoreError) -> anyhow::Error {
    match e {
        e @ (RestoreError::RelayRunning(_) | RestoreError::FreshHeartbeat { .. }) => {
            RelayRunning(e.to_string()).into()
        }
        e @ (RestoreError::NoBackup(_) | RestoreError::NotAFile(_)) => {
            NotFoundError(e.to_string()).into()
        }
        e => anyhow::Error::new(e),
    }
}

/// `relay restore <file>`.
pub fn restore(args: RestoreArgs) -> anyhow::Result<()> {
    // A missing backup is exit 3 whatever else is wrong (checked again by the restore).
    let file = ops::absolute(&args.file);
    ops::check_backup_path(&file).map_err(restore_refusal)?;
    let now = now_ms()?;
    let key = ops::offline_relay_key_if_any(&args.store_dir)?;
    let unsigned = key
        .is_none()
        .then(|| ops::unsigned_receipt_reason(&args.store_dir));
    let opts = ops::RestoreOptions {
        force: args.force,
        now_ms: now,
        signer: key.map(ops::RelayOpSigner::shared),
    };
    let receipt =
        ops::restore(&args.store_dir, &args.file, &opts, None).map_err(restore_refusal)?;
    warn_unsigned(unsigned.as_deref());
    let c = &receipt["carried"];
    let mut text = format!(
        "restored {} into {}: epoch {} -> {}\ncarried forward from the replaced store: \
         host key rotations {}, revocations {}, deny-list entries {}, sender allowlists {}, \
         enc-key ads {}, v2 ad records {}, seq floors {}, account bindings {}, relay-log \
         entries {}\n\
         now: {} items for {} targets, {} enrolments ({} revoked)",
        receipt["backup"]["file"].as_str().unwrap_or(""),
        receipt["store"].as_str().unwrap_or(""),
        receipt["epoch"]["from"].as_str().unwrap_or(""),
        receipt["epoch"]["to"].as_str().unwrap_or(""),
        c["rotations"],
        c["revocations"],
        c["deny"],
        c["sender_lists"],
        c["enc_ads"],
        c["enc_ad_records"],
        c["seq_floors"],
        c["account_bindings"],
        c["ops"],
        receipt["counts"]["items"],
        receipt["counts"]["targets"],
        receipt["counts"]["enrolments"],
        receipt["counts"]["revoked"],
    );
    match receipt["rollback"].as_str() {
        Some(undo) => text.push_str(&format!(
            "\nthe replaced store is kept at {}{}; undo with: {undo}",
            receipt["replaced"]["rollback"].as_str().unwrap_or(""),
            if receipt["replaced"]["readable"] == true {
                ""
            } else {
                " (it could not be read: nothing was carried forward)"
            }
        )),
        None => text.push_str("\nthere was no store to replace"),
    }
    text.push_str(&format!(
        "\nnext: {}",
        receipt["next"].as_str().unwrap_or("")
    ));
    print(args.json, &receipt, &text)
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
    // The backup is complete; now its receipt goes to the relay log, which signs it. What is
    // printed is the receipt as logged (signed), or as made when it could not be logged.
    let (shown, logged) = log_backup_receipt(&args, online_target, &receipt, now);
    let text = format!(
        "backup written to {} ({} bytes, sha256 {}): {} items for {} targets, {} enrolments, \
         epoch {}\nrestore it with: {}",
        shown["file"].as_str().unwrap_or(""),
        shown["bytes"],
        shown["sha256"].as_str().unwrap_or(""),
        shown["counts"]["items"],
        shown["counts"]["targets"],
        shown["counts"]["enrolments"],
        shown["epoch"].as_str().unwrap_or(""),
        shown["restore"].as_str().unwrap_or("")
    );
    print(args.json, &shown, &text)?;
    logged.context("the backup is complete, but its receipt was not logged")
}

/// Appends a backup receipt to the relay log: through the running relay's admin endpoint when
/// `online` is given, else directly on the store, else (a running relay holds it) through the
/// admin endpoint of the relay on this machine ([`log_through_serving_relay`]). Returns the
/// receipt to show (as logged when it was) and whether logging worked.
fn log_backup_receipt(
    args: &BackupArgs,
    online_target: Option<super::relay_admin::Online>,
    receipt: &Value,
    now: i64,
) -> (Value, anyhow::Result<()>) {
    if let Some(target) = online_target {
        return match online(
            &target,
            "POST",
            "/v2/relay/admin/backup-receipt",
            Some(json!({ "receipt": receipt })),
        ) {
            Ok(answer) if answer["receipt"].is_object() => (answer["receipt"].clone(), Ok(())),
            Ok(_) => (receipt.clone(), Ok(())),
            Err(e) => (receipt.clone(), Err(e)),
        };
    }
    match admin::open_offline(&args.store_dir, now) {
        Ok(opened) => {
            let store = &opened.store;
            let logged = store
                .append_op(now, ops::OP_BACKUP, receipt)
                .and_then(|id| {
                    Ok(store
                        .ops(1)?
                        .into_iter()
                        .find(|o| o.id == id)
                        .map_or_else(|| receipt.clone(), |o| o.receipt))
                });
            let closed = opened.store.close().context("closing the relay store");
            match (logged, closed) {
                (Ok(shown), Ok(())) => {
                    warn_unsigned(opened.unsigned.as_deref());
                    (shown, Ok(()))
                }
                (Ok(_), Err(e)) => (receipt.clone(), Err(e)),
                (Err(e), _) => (receipt.clone(), Err(e.into())),
            }
        }
        Err(AdminError::Running(_)) => {
            log_through_serving_relay(&args.store_dir, receipt, args.json)
        }
        Err(e) => (receipt.clone(), Err(refusal(e))),
    }
}

/// A running relay holds the store and no `--url` was given: the receipt goes through the
/// admin endpoint of the relay on this machine when its admin token is configured here
/// ([`local_admin_endpoint`]). Otherwise, or when that relay does not take it, the receipt is
/// shown signed with the relay key when it is available here (as the relay would have logged
/// it), and a note on stderr says it was not logged, why, and how to log it. Never fails: the
/// backup is complete.
fn log_through_serving_relay(
    dir: &std::path::Path,
    receipt: &Value,
    json: bool,
) -> (Value, anyhow::Result<()>) {
    let why = match local_admin_endpoint(dir) {
        Ok(target) => match online(
            &target,
            "POST",
            "/v2/relay/admin/backup-receipt",
            Some(json!({ "receipt": receipt })),
        ) {
            Ok(answer) if answer["receipt"].is_object() => {
                return (answer["receipt"].clone(), Ok(()))
            }
            Ok(_) => format!("the relay at {} gave no receipt back", target.url()),
            Err(e) => format!(
                "the admin endpoint of the relay at {} did not take it ({e:#})",
                target.url()
            ),
        },
        Err(why) => why,
    };
    let (shown, signed) = match ops::offline_relay_key_if_any(dir) {
        Ok(Some(key)) => {
            match agentmbx_relay::store::sign_op_receipt(
                ops::RelayOpSigner::shared(key).as_ref(),
                receipt,
            ) {
                Ok(signed) => (signed, true),
                Err(_) => (receipt.clone(), false),
            }
        }
        _ => (receipt.clone(), false),
    };
    eprintln!("{}", unlogged_note(&why, signed, json));
    (shown, Ok(()))
}

/// The note of [`log_through_serving_relay`] when the receipt was not logged: `why`, whether
/// the receipt is signed, and where it is: printed on stdout with `--json` (`json`), else only
/// the summary is printed and `--json` prints the receipt.
fn unlogged_note(why: &str, signed: bool, json: bool) -> String {
    let what = if json {
        "The receipt printed"
    } else {
        "The receipt (printed with --json; this text shows its summary)"
    };
    let how = if signed {
        "signed with the relay key"
    } else {
        "unsigned (no relay key here: MBX_RELAY_KEY or relay.key)"
    };
    format!(
        "note: the backup is complete, but its receipt was not added to the relay log: a running \
         relay holds the store (only it may write it), and {why}. {what} is {how}. To log the \
         receipt of a backup, run it with --url <relay url> and the relay's admin token \
         (--admin-token-file or MBX_RELAY_ADMIN_TOKEN)"
    )
}

#[cfg(test)]
mod unlogged_note_tests {
    use super::unlogged_note;

    #[test]
    fn the_note_says_where_the_receipt_is() {
        let text = unlogged_note("no admin token is configured here", true, false);
        assert!(!text.contains("The receipt shown"), "{text}");
        assert!(
            text.contains(
                "The receipt (printed with --json; this text shows its summary) is signed with \
                 the relay key"
            ),
            "{text}"
        );
        let json = unlogged_note("no admin token is configured here", false, true);
        assert!(
            json.contains("The receipt printed is unsigned (no relay key here"),
            "{json}"
        );
    }
}
