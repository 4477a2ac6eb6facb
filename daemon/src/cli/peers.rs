//! `agentmbx peers [add <host> <host_pubkey> | addr <host> <host:port> | remove <host>] [--json]`:
//! the hosts this host knows by pinned key (`wire.md` §4, §5 "Machines"). Pairing (`agentmbx
//! pair` / `join`) pins peers over the LAN; `add` pins a key by hand (a peer reached only through
//! the relay); `addr` sets where a peer's LAN server is, once that address answered with a
//! status signed by the pinned key (or unproven with `--force`); `remove` tells the peer
//! (`POST /v1/unpair`) and forgets it here.

use anyhow::Context;
use clap::{Args, Subcommand};

use agentmbx::host_name::HostName;
use agentmbx::mailbox::{peers, Mailbox};
use agentmbx::paths::Paths;
use agentmbx::transport::lan::presence::{self, OwnerAddr, OwnerAddrError};
use agentmbx_protocol::clock::{Clock, SystemClock};
use agentmbx_protocol::keys::PublicKey;

use super::UsageError;

/// Flags of `peers`.
#[derive(Debug, Args)]
pub struct PeersArgs {
    /// What to do (default: list)
    #[command(subcommand)]
    pub command: Option<PeersCommand>,
    /// Print the result as JSON
    #[arg(long, global = true)]
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
    /// Set where a peer's LAN server is (its `host:port`), once the address answers with a
    /// status signed by the peer's pinned key; mail waiting for it is due at once
    Addr {
        /// The peer's host name
        host: String,
        /// Its LAN address, `host:port` (a name or an IP; an IP must be one the peer reports)
        addr: String,
        /// Store it anyway when it does not answer as the peer (the peer may be down now); mail
        /// to it is tried there
        #[arg(long)]
        force: bool,
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
            if args.json {
                println!(
                    "{}",
                    serde_json::json!({"host": name.as_str(), "pubkey": key.to_b64(),
                        "fingerprint": key.fingerprint(), "added": added})
                );
            } else if added {
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
        Some(PeersCommand::Addr { host, addr, force }) => {
            let addr = parse_lan_addr(&addr)?;
            let set = set_addr(mailbox, &host, &addr, force)?;
            if args.json {
                println!("{}", serde_json::to_string(&set)?);
            } else if set.verified {
                println!(
                    "{host} is now reached at {addr} (it answered with its pinned key); mail waiting for it is due now"
                );
            } else {
                println!(
                    "{host} is now reached at {addr}, UNVERIFIED ({}); mail to it is tried there",
                    set.why.as_deref().unwrap_or("not checked")
                );
            }
        }
        Some(PeersCommand::Remove { host }) => {
            let host = HostName::parse(&host)?.as_str().to_string();
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
                // Immediate: a read-then-write transaction racing the running daemon's writes
                // would otherwise fail at once with "database is locked" (WAL snapshot).
                let tx = c.transaction_with_behavior(rusqlite::TransactionBehavior::Immediate)?;
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
                // Each peer with the fingerprints of the keys it rotated away from, oldest
                // first (`wire.md` §2.10).
                let mut shown = Vec::with_capacity(list.len());
                for p in &list {
                    let mut v = serde_json::to_value(p)?;
                    let prev: Vec<String> = mailbox
                        .with(|c| peers::prev_keys(c, &p.host))?
                        .iter()
                        .filter_map(|k| PublicKey::from_b64(k).ok())
                        .map(|k| k.fingerprint())
                        .collect();
                    v["prev_keys"] = serde_json::json!(prev);
                    shown.push(v);
                }
                println!("{}", serde_json::to_string_pretty(&shown)?);
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

/// `peers addr`: probes `addr` for `host`'s signed status and stores it when it proves the
/// pinned key, or unproven with `force` ([`presence::set_addr_by_owner`]). Errors: no such
/// peer (exit 3), not proven without `force` (exit 1, naming why), the store.
fn set_addr(mailbox: Mailbox, host: &str, addr: &str, force: bool) -> anyhow::Result<OwnerAddr> {
    let clock: agentmbx_protocol::clock::SharedClock =
        std::sync::Arc::new(SystemClock::from_env()?);
    agentmbx::install_tls_provider();
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let set = runtime.block_on(presence::set_addr_by_owner(
        &mailbox, &clock, host, addr, force,
    ));
    match set {
        Ok(set) => Ok(set),
        Err(OwnerAddrError::NotPaired(h)) => {
            Err(super::NotFoundError(format!("no peer named {h} (see `agentmbx peers`)")).into())
        }
        Err(e) => Err(e.into()),
    }
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

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::super::{exit_code, render, EXIT_FAILURE, EXIT_NOT_FOUND};
    use super::*;

    /// A port on 127.0.0.1 that nothing listens on.
    fn dead_addr() -> String {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let a = l.local_addr().unwrap().to_string();
        drop(l);
        a
    }

    #[test]
    fn an_unproven_address_is_refused_with_exit_1_unless_forced() {
        let dir = tempfile::tempdir().unwrap();
        let mailbox = Mailbox::open(&dir.path().join("mailbox.db")).unwrap();
        let e = set_addr(mailbox.clone(), "hostb", "127.0.0.1:1", true).unwrap_err();
        assert_eq!(exit_code(&e), EXIT_NOT_FOUND, "{e}");

        let key = agentmbx_protocol::keys::HostKey::generate().public();
        mailbox
            .with(|c| peers::add(c, "hostb", &key.to_b64(), 0).map(|_| ()))
            .unwrap();
        let dead = dead_addr();
        let e = set_addr(mailbox.clone(), "hostb", &dead, false).unwrap_err();
        assert_eq!(exit_code(&e), EXIT_FAILURE);
        let text = render(&e);
        assert!(
            text.starts_with(&format!("{dead} did not prove to be hostb: no answer")),
            "{text}"
        );
        assert!(text.contains("--force"), "{text}");
        let addr = |m: &Mailbox| {
            m.with(|c| peers::by_name(c, "hostb"))
                .unwrap()
                .unwrap()
                .addr
        };
        assert_eq!(addr(&mailbox), None, "nothing stored");

        let set = set_addr(mailbox.clone(), "hostb", &dead, true).unwrap();
        assert!(!set.verified && set.why.is_some());
        assert_eq!(addr(&mailbox), Some(dead));
    }

    #[test]
    fn addresses_need_a_host_and_a_port() {
        assert_eq!(parse_lan_addr(" 10.0.0.5:7373 ").unwrap(), "10.0.0.5:7373");
        assert_eq!(parse_lan_addr("[::1]:9").unwrap(), "[::1]:9");
        for bad in ["10.0.0.5", ":7373", "x:0", "x:70000", "a b:1", "x/y:1"] {
            assert!(parse_lan_addr(bad).is_err(), "{bad}");
        }
    }
}
