//! `agentmbx peers [add <host> <host_pubkey> | addr <host> <host:port> | remove <host>] [--json]`:
//! the hosts this host knows by pinned key (`wire.md` §4, §5 "Machines"). Pairing (`agentmbx
//! pair` / `join`) pins peers over the LAN; `add` pins a key by hand (a peer reached only through
//! the relay); `addr` sets where a peer's LAN server is; `remove` tells the peer
//! (`POST /v1/unpair`) and forgets it here.

use anyhow::Context;
use clap::{Args, Subcommand};

use agentmbx::host_name::HostName;
use agentmbx::mailbox::{outbox, peers, Mailbox};
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
    /// Set where a peer's LAN server is (its `host:port`); mail waiting for it is due at once
    Addr {
        /// The peer's host name
        host: String,
        /// Its LAN address, `host:port` (a name or an IP)
        addr: String,
    },
    /// Unpair: tell the peer (POST /v1/unpair, best effort) and forget its key here. Mail not
    /// yet delivered to it ends as undelivered, with a local alert to each sender.
    Remove {
        /// The peer's host name
        host: String,
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
        Some(PeersCommand::Addr { host, addr }) => {
            let addr = parse_lan_addr(&addr)?;
            let now = SystemClock::from_env()?.now_ms();
            mailbox.with(|c| {
                let tx = c.transaction()?;
                peers::set_addr(&tx, &host, &addr, "cli")?;
                outbox::peer_is_back(&tx, &host, now)?;
                tx.commit()?;
                Ok(())
            })?;
            if args.json {
                println!("{}", serde_json::json!({"host": host, "addr": addr}));
            } else {
                println!("{host} is now reached at {addr}");
            }
        }
        Some(PeersCommand::Remove { host }) => {
            let Some(peer) = mailbox.with(|c| peers::by_name(c, &host))? else {
                return Err(agentmbx::mailbox::MailboxError::NotFound(format!(
                    "no peer named {host} (see `agentmbx peers`)"
                ))
                .into());
            };
            let told = notify_unpair(&paths, &peer);
            let config = agentmbx::config::Config::load(&paths)?;
            let ident = agentmbx::identity::load(&paths, &config)?;
            let now = SystemClock::from_env()?.now_ms();
            let ended = mailbox.with(|c| {
                let tx = c.transaction()?;
                let ended = agentmbx::node::unpair::forget_peer(&tx, &ident, &host, now)?;
                tx.commit()?;
                Ok(ended)
            })?;
            let told_text = match &told {
                Ok(()) => "told the peer".to_string(),
                Err(e) => format!("could not tell the peer ({e}); it keeps its pin until it is told or removes this host itself"),
            };
            if args.json {
                println!(
                    "{}",
                    serde_json::json!({"removed": host, "told_peer": told.is_ok(), "undelivered": ended})
                );
            } else {
                println!("removed {host}: {told_text}; {ended} undelivered message(s)");
            }
        }
        None => {
            let list = mailbox.with(|c| peers::list(c))?;
            if args.json {
                println!("{}", serde_json::to_string_pretty(&list)?);
            } else if list.is_empty() {
                println!("no peers (pair with one: `agentmbx pair` here, then `agentmbx join` on the other host)");
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
                    let addr = p.addr.as_deref().unwrap_or("no LAN address");
                    println!("{}  {}  {}  {}", p.host, fp, addr, enc);
                }
            }
        }
    }
    Ok(())
}

/// Checks a `host:port` LAN address: a non-empty host (name, IPv4 or `[IPv6]`) and a port
/// 1..=65535. Errors: a usage error naming the expected form.
fn parse_lan_addr(addr: &str) -> Result<String, UsageError> {
    let bad = || {
        UsageError(format!(
            "bad address {addr:?}: expected host:port, e.g. 192.168.1.20:7373"
        ))
    };
    let (host, port) = addr.trim().rsplit_once(':').ok_or_else(bad)?;
    let port: u16 = port.parse().map_err(|_| bad())?;
    if host.is_empty() || port == 0 || host.contains(char::is_whitespace) || host.contains('/') {
        return Err(bad());
    }
    Ok(format!("{host}:{port}"))
}

/// Tells `peer` this host unpairs (`POST /v1/unpair`), when it has a LAN address.
fn notify_unpair(paths: &Paths, peer: &peers::Peer) -> anyhow::Result<()> {
    let Some(addr) = peer.addr.clone() else {
        anyhow::bail!("no LAN address known");
    };
    let config = agentmbx::config::Config::load(paths)?;
    let ident = std::sync::Arc::new(agentmbx::identity::load(paths, &config)?);
    let clock: agentmbx_protocol::clock::SharedClock =
        std::sync::Arc::new(SystemClock::from_env()?);
    agentmbx::install_tls_provider();
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    runtime.block_on(async move {
        let client =
            agentmbx::transport::lan::client::LanClient::new(ident, clock, config.lan_port)?;
        client.unpair(&addr).await.map_err(anyhow::Error::from)
    })
}
