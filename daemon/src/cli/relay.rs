//! `agentmbx relay …`: the relay server and its operator commands (the work is done by the
//! `agentmbx-relay` crate), and the host's `relay set` and `relay info` ([`super::relay_info`]:
//! point this host at a relay, pin its key, show where it stands; `wire.md` §5 "Relay", spec §1).

use std::net::IpAddr;
use std::path::PathBuf;

use anyhow::Context;
use clap::{Args, Subcommand};

use agentmbx::paths::Paths;

/// Subcommands of `relay`.
#[derive(Debug, Subcommand)]
pub enum RelayCommand {
    /// Run a relay: stores sealed items until their target host pulls and acknowledges them
    #[command(after_long_help = SERVE_HELP)]
    Serve(ServeArgs),
    /// Create a relay signing key and print it as MBX_RELAY_KEY=<seed> (a deploy secret)
    Keygen,
    /// Use the relay at URL for this host and pin its key (trust on first use, or --key);
    /// also confirms a changed relay key (from the daemon's next pass; a running daemon
    /// applies a first or another URL when it sees config.toml change, without a restart)
    Set(super::relay_info::SetArgs),
    /// Show this host's standing with its relay: pinned key, state (a key mismatch, a deny or
    /// a revocation and its fix), epoch, enrolment, enc-key ad, allowlist, position and outbox
    /// (offline; --live); exits 1 unless the state is ok
    Info(super::relay_info::InfoArgs),
    /// List relay items this host refused (bad signature, undecryptable, unknown sender…)
    ///
    /// Refused mail and delivery receipts are tried again on the daemon's next relay pass
    /// whenever a change to the pins touches their sender's key or the host they name (a peer
    /// pinned, renamed, unpaired and paired again, a key rotation learned), whatever reason
    /// is shown; one refused again keeps its new reason until the next such change.
    Quarantine(QuarantineArgs),
    /// Revoke a host key on a relay for good (offline on --store-dir, or --url with the
    /// admin token); its next request is refused
    Revoke(super::relay_admin::RevokeArgs),
    /// Deny a host fingerprint or token client_id on a relay (optionally --until), list or
    /// remove entries (offline on --store-dir, or --url with the admin token)
    Deny(super::relay_admin::DenyArgs),
    /// Switch the relay store to a new epoch (offline on --store-dir, or --url with the admin
    /// token): hosts re-push and re-pull; run it after restoring a store by other means
    RotateEpoch(super::relay_ops::RotateEpochArgs),
    /// Show the relay log (operator receipts), newest first; read-only, also while serving
    Log(super::relay_ops::LogArgs),
    /// Show a relay store for its operator: hosts, queued items and bytes (deepest targets,
    /// oldest item), epoch, last heartbeat, last backup; read-only, also while serving
    Status(super::relay_status::StatusArgs),
    /// Copy the relay store to a new file with SQLite's online backup (also while serving);
    /// never overwrites; the receipt goes to the relay log
    Backup(super::relay_ops::BackupArgs),
    /// Replace a stopped relay's store with a backup: keeps the replaced store as a rollback
    /// copy, carries revocations, deny-list and newer allowlists and ads forward, and rotates
    /// the epoch (refused while a relay runs on the store)
    Restore(super::relay_ops::RestoreArgs),
}

/// Flags of `relay quarantine`.
#[derive(Debug, Args)]
pub struct QuarantineArgs {
    /// How many of the newest entries to show (1..=1000)
    #[arg(long, default_value_t = 200, value_parser = clap::value_parser!(u32).range(1..=1000))]
    pub limit: u32,
    /// Print as JSON: [{relay, epoch, seq, kind, item_id, sender_pubkey, reason, at}]
    #[arg(long)]
    pub json: bool,
}

/// Shown after `relay serve --help` and in `agentmbx-relay-serve(1)`: the relay's environment
/// and files.
const SERVE_HELP: &str = "\
Environment:
  MBX_RELAY_KEY: the relay signing key (a seed from `agentmbx relay keygen`); read once at
    start and removed from the environment. Without it the key is relay.key in the store
    directory (created on first start)
  MBX_RELAY_ADMIN_TOKEN: bearer token of the admin endpoints (/v2/relay/admin/*: revoke, deny,
    rotate-epoch, backup receipts);
    wins over admin_token_file. Neither set: the admin endpoints are off (404)
  MBX_RELAY_DIR: the store directory (--store-dir)
  MBX_RELAY_RESTORE_FROM: a backup file to restore at start, under the relay's lock, like
    `agentmbx relay restore` (for hosted relays that cannot run it beside themselves); once
    per path: a path restored from before is ignored with a log line. A failed restore is
    logged and the current store is served unchanged
  PORT: the port (--port); platforms such as Railway or Heroku set it
  MBX_RELAY_TRUST_PROXY: xff|cloudflare, like --trust-proxy
  MBX_LOG: log filter (default info)

Files in the store directory (created 0700 when missing; the files are 0600):
  relay.db (+ -wal, -shm while running): the store. A clean stop leaves everything in relay.db
  relay.key: the relay key, unless MBX_RELAY_KEY is set
  relay.lock: one relay process per store; a second one waits lock_wait_ms (default 60000)
    for it, then exits with status 4
  relay.toml (optional; unknown keys are refused):
    bind, port: the address and port to listen on (defaults 0.0.0.0 and 7374); --bind and
      --port (or PORT) win over them, and the relay logs which value it used
    lock_wait_ms, request_timeout_ms, header_read_timeout_ms, keep_alive_timeout_ms,
    max_connections
    sweep_interval_ms: how often the retention sweep runs after the one at start (default
      600000 = 10 min, 1000..=86400000): it deletes items older than retention_days and
      queues a signed expiry notice for the sender of each expired envelope
    trust_proxy = \"xff\" | \"cloudflare\"
    admin_token_file = \"admin.token\" (relative to the store directory)
    [limits] max_item_bytes, max_batch, max_pull, max_pull_bytes, max_targets, retention_days,
      max_queue_items, max_queue_bytes, max_sender_items, max_sender_bytes, max_owner_items,
      max_owner_bytes, max_live_enrolments
    [rate] enrol_per_min, info_per_min, push_per_min, max_keys, body_budget_bytes,
      body_per_address_bytes
    [authority] kind = \"host-key-challenge\" (default: every host that proves its key
      enrols) or \"account\" with issuer, jwks_url, audience (this relay's public URL) and
      optionally max_token_ttl_ms

At start the relay logs its key fingerprint, the bound address, whether the admin endpoint is
on (never the token) and which enrolment authority admits hosts. It rotates the epoch when the
heartbeat it writes every 30 s is more than 10 min old or in the future (old data came back, or
a long outage), with a log line and a receipt in the relay log (`agentmbx relay log`). SIGTERM
or SIGINT stops it cleanly (exit 0).";

/// Flags of `relay serve`.
#[derive(Debug, Args)]
pub struct ServeArgs {
    /// IP address to listen on; wins over `bind` in relay.toml [default: `bind` in
    /// relay.toml, else 0.0.0.0]
    #[arg(long, value_name = "ADDR")]
    pub bind: Option<IpAddr>,
    /// TCP port to listen on (0 picks a free port; the bound address is logged). Read from
    /// PORT when the flag is not given, as platforms such as Railway set it; either wins over
    /// `port` in relay.toml [default: `port` in relay.toml, else 7374]
    #[arg(long, value_name = "N", env = "PORT")]
    pub port: Option<u16>,
    /// Directory of the relay's state (relay.db, relay.key, relay.lock, optional relay.toml)
    #[arg(long, value_name = "DIR", env = "MBX_RELAY_DIR", required = true)]
    pub store_dir: PathBuf,
    /// Rate-limit by the address a trusted proxy reports: xff (the default when no value is
    /// given: the rightmost X-Forwarded-For entry) or cloudflare (CF-Connecting-IP). Without
    /// it: the socket address, unless MBX_RELAY_TRUST_PROXY or relay.toml says otherwise
    #[arg(long, value_name = "MODE", num_args = 0..=1, default_missing_value = "xff",
          value_parser = ["xff", "cloudflare"])]
    pub trust_proxy: Option<String>,
}

/// Runs a relay subcommand.
pub fn run(cmd: RelayCommand) -> anyhow::Result<()> {
    match cmd {
        RelayCommand::Serve(args) => serve(args),
        RelayCommand::Keygen => {
            let (line, fingerprint) = agentmbx_relay::run::keygen();
            println!("{line}");
            eprintln!("relay key fingerprint: {fingerprint} (hosts pin it with `agentmbx relay set <url> --key {fingerprint}`)");
            Ok(())
        }
        RelayCommand::Set(args) => super::relay_info::set(args),
        RelayCommand::Info(args) => super::relay_info::info(args),
        RelayCommand::Quarantine(args) => quarantine(args),
        RelayCommand::Revoke(args) => super::relay_admin::revoke(args),
        RelayCommand::Deny(args) => super::relay_admin::deny(args),
        RelayCommand::RotateEpoch(args) => super::relay_ops::rotate_epoch(args),
        RelayCommand::Log(args) => super::relay_ops::log(args),
        RelayCommand::Status(args) => super::relay_status::status(args),
        RelayCommand::Backup(args) => super::relay_ops::backup(args),
        RelayCommand::Restore(args) => super::relay_ops::restore(args),
    }
}

fn runtime() -> anyhow::Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("cannot start the async runtime")
}

/// Logs, for `bind` and `port`, where the value the relay listens on comes from when
/// relay.toml sets it too: the flag (or `PORT`) wins over the file.
fn log_listen_sources(args: &ServeArgs) {
    let path = args.store_dir.join("relay.toml");
    let Ok(text) = std::fs::read_to_string(&path) else {
        return;
    };
    // A file that does not parse is reported by the relay itself.
    let Ok(file) = agentmbx_relay::config::RelayConfig::parse(&text, &path) else {
        return;
    };
    match (args.port, file.port) {
        (Some(flag), Some(toml)) if flag != toml => tracing::info!(
            "listening port {flag} from --port or PORT; it wins over port = {toml} in {}",
            path.display()
        ),
        (None, Some(toml)) => tracing::info!("listening port {toml} from {}", path.display()),
        _ => {}
    }
    match (args.bind, file.bind) {
        (Some(flag), Some(toml)) if flag != toml => tracing::info!(
            "listening address {flag} from --bind; it wins over bind = \"{toml}\" in {}",
            path.display()
        ),
        (None, Some(toml)) => tracing::info!("listening address {toml} from {}", path.display()),
        _ => {}
    }
}

fn serve(args: ServeArgs) -> anyhow::Result<()> {
    log_listen_sources(&args);
    let store_dir = args.store_dir;
    let opts = agentmbx_relay::run::ServeOptions {
        bind: args.bind,
        port: args.port,
        store_dir,
        trust_proxy: args.trust_proxy,
    };
    // Key, config, store and listener are prepared before any thread exists (the relay key
    // is removed from the environment there).
    let prepared = agentmbx_relay::run::prepare(opts)?;
    runtime()?.block_on(agentmbx_relay::run::serve_prepared(prepared))?;
    Ok(())
}

fn quarantine(args: QuarantineArgs) -> anyhow::Result<()> {
    let paths = Paths::from_env()?;
    let db = paths.mailbox_db();
    if !db.exists() {
        return Err(super::NotFoundError(format!(
            "no mailbox.db in {}: nothing received yet",
            paths.home().display()
        ))
        .into());
    }
    let mailbox = agentmbx::mailbox::Mailbox::open(&db).context("cannot open mailbox.db")?;
    let rows = mailbox.with(|c| agentmbx::mailbox::relay_state::quarantined(c, args.limit))?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&rows)?);
        return Ok(());
    }
    if rows.is_empty() {
        println!("quarantine is empty");
    }
    for q in rows {
        let sender = agentmbx_protocol::keys::PublicKey::from_b64(&q.sender_pubkey)
            .map(|k| k.fingerprint())
            .unwrap_or_else(|_| q.sender_pubkey.clone());
        println!(
            "{}  seq {}  {} {}  from {}  {}",
            agentmbx_protocol::time::iso_ms(q.at),
            q.seq,
            q.kind,
            q.item_id,
            sender,
            q.reason
        );
    }
    Ok(())
}
