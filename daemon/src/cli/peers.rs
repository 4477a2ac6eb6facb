//! `agentmbx peers [add <host> <host_pubkey>] [--json]`: the hosts this host knows by pinned key.
//! Until LAN pairing exists, a peer reachable through the relay is added by hand with its host
//! key (printed by `agentmbx whoami` on that host).

use anyhow::Context;
use clap::{Args, Subcommand};

use agentmbx::host_name::HostName;
use agentmbx::mailbox::{peers, Mailbox};
use agentmbx::paths::Paths;
use agentmbx_protocol::clock::{Clock, SystemClock};
use agentmbx_protocol::keys::PublicKey;

use super::UsageError;

/// Flags of `peers`.
#[derive(Debug, Args)]
pub struct PeersArgs {
    /// What to do (default: list)
    #[command(subcommand)]
    pub command: Option<PeersCommand>,
    /// Print the list as JSON
    #[arg(long)]
    pub json: bool,
}

/// Subcommands of `peers`.
#[derive(Debug, Subcommand)]
pub enum PeersCommand {
    /// Pin a peer host's key under a name (use the name the peer's `agentmbx whoami` shows)
    Add {
        /// The peer's host name
        host: String,
        /// The peer's host public key (base64, from its `agentmbx whoami`)
        host_pubkey: String,
    },
}

/// Runs `peers`.
pub fn run(args: PeersArgs) -> anyhow::Result<()> {
    let paths = Paths::from_env()?;
    paths.ensure_home()?;
    let mailbox = Mailbox::open(&paths.mailbox_db()).context("cannot open mailbox.db")?;
    match args.command {
        Some(PeersCommand::Add { host, host_pubkey }) => {
            let name = HostName::parse(&host)?;
            let key = PublicKey::from_b64(&host_pubkey)
                .map_err(|e| UsageError(format!("bad host key: {e}")))?;
            let own = agentmbx::config::Config::load(&paths)
                .ok()
                .and_then(|c| agentmbx::identity::load(&paths, &c).ok())
                .map(|i| i.host_key.public());
            if own.as_ref() == Some(&key) {
                return Err(UsageError(
                    "that is this host's own key: pin the other host's key (its `agentmbx whoami`)"
                        .into(),
                )
                .into());
            }
            let now = SystemClock::from_env()?.now_ms();
            let added = mailbox.with(|c| peers::add(c, name.as_str(), &key.to_b64(), now))?;
            if added {
                println!(
                    "pinned {} as {} (fingerprint {})",
                    name,
                    key.to_b64(),
                    key.fingerprint()
                );
            } else {
                println!("{name} is already pinned to this key");
            }
        }
        None => {
            let list = mailbox.with(|c| peers::list(c))?;
            if args.json {
                println!("{}", serde_json::to_string_pretty(&list)?);
            } else if list.is_empty() {
                println!("no peers (add one with `agentmbx peers add <host> <host_pubkey>`)");
            } else {
                for p in list {
                    let fp = PublicKey::from_b64(&p.pubkey)
                        .map(|k| k.fingerprint())
                        .unwrap_or_default();
                    let enc = if p.enc_pub.is_some() {
                        "enc key known"
                    } else {
                        "enc key not yet known"
                    };
                    println!("{}  {}  {}", p.host, fp, enc);
                }
            }
        }
    }
    Ok(())
}
