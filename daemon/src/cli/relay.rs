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
    Serve(ServeArgs),
    /// Create a relay signing key and print it as MBX_RELAY_KEY=<seed> (a deploy secret)
    Keygen,
    /// Use the relay at URL for this host and pin its key (trust on first use, or --key);
    /// also confirms a changed relay key
    Set(SetArgs),
    /// Show this host's standing with its relay: pinned key, state (a key mismatch and its
    /// fix), epoch, enrolment, enc-key ad, allowlist, position and outbox (offline; --live)
    Info(super::relay_info::InfoArgs),
    /// List relay items this host refused (bad signature, undecryptable, unknown sender…)
    Quarantine(QuarantineArgs),
    /// Revoke a host key on a relay for good (offline on --store-dir, or --url with the
    /// admin token); its next request is refused
    Revoke(super::relay_admin::RevokeArgs),
    /// Deny a host fingerprint or token client_id on a relay (optionally --until), list or
    /// remove entries (offline on --store-dir, or --url with the admin token)
    Deny(super::relay_admin::DenyArgs),
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

/// Flags of `relay serve`.
#[derive(Debug, Args)]
pub struct ServeArgs {
    /// IP address to listen on
    #[arg(long, value_name = "ADDR", default_value = "0.0.0.0")]
    pub bind: IpAddr,
    /// TCP port to listen on (0 picks a free port; the bound address is logged)
    #[arg(long, value_name = "N", env = "PORT", default_value_t = 7374)]
    pub port: u16,
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

/// Flags of `relay set`.
#[derive(Debug, Args)]
pub struct SetArgs {
    /// Relay base URL, e.g. https://relay.example.org or http://127.0.0.1:7374
    pub url: String,
    /// Expected relay key: its fingerprint (16 hex digits, dashes optional) or the base64 key.
    /// Without it the key the relay presents now is pinned (trust on first use).
    #[arg(long, value_name = "FINGERPRINT")]
    pub key: Option<String>,
    /// Print the result as JSON: {url, relay_pubkey, fingerprint, epoch}
    #[arg(long)]
    pub json: bool,
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
    }
}

fn runtime() -> anyhow::Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("cannot start the async runtime")
}

fn serve(args: ServeArgs) -> anyhow::Result<()> {
    let store_dir = args.store_dir;
    let opts = agentmbx_relay::run::ServeOptions {
        bind: Some(args.bind),
        port: Some(args.port),
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
