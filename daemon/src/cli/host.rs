//! `agentmbx host rotate [--json]`: replace this host's host key and enc key (`wire.md` §2.10).
//!
//! The old key signs the new keys and the new key countersigns; the record is logged in
//! `rotations.json` before the keys are swapped, so a crash at any point leaves the old keys or
//! a rotation the next start completes ([`agentmbx::identity::rotation`]). The daemon announces
//! each logged record to every paired peer (`POST /v1/rotate`, once a minute until each has
//! taken it) and to the relay (`POST /v2/relay/rotate`).
//!
//! Rotation runs offline: the running daemon holds the keys in memory and signs with them, so
//! this command refuses while the daemon lock is held (stop the daemon, rotate, start it). It
//! holds the daemon lock itself while rotating, so a daemon cannot start half-way.

use anyhow::Context;
use clap::{Args, Subcommand};

use agentmbx::config::Config;
use agentmbx::identity::rotation;
use agentmbx::mailbox::{audit, Mailbox};
use agentmbx::paths::Paths;
use agentmbx_protocol::clock::{Clock, SystemClock};

/// `host` subcommands.
#[derive(Debug, Subcommand)]
pub enum HostCommand {
    /// Replace this host's host key and enc key; paired peers and the relay are told by the
    /// daemon (stop the daemon first, start it after)
    Rotate(RotateArgs),
}

/// Flags of `host rotate`.
#[derive(Debug, Args)]
pub struct RotateArgs {
    /// Print as JSON: {host, host_pubkey, fingerprint, enc_pub, keystore, old_pubkey,
    /// old_fingerprint, iat, rotations, peers, peers_without_lan_address}
    #[arg(long)]
    pub json: bool,
}

/// Runs a `host` subcommand.
pub fn run(cmd: HostCommand) -> anyhow::Result<()> {
    match cmd {
        HostCommand::Rotate(args) => rotate(args),
    }
}

fn rotate(args: RotateArgs) -> anyhow::Result<()> {
    let paths = Paths::from_env()?;
    let config = Config::load(&paths)?;
    if !agentmbx::identity::is_initialized(&paths) {
        // The same error (and exit code 3) as every command that needs the identity.
        agentmbx::identity::load(&paths, &config)?;
    }
    let lock = paths
        .try_lock_daemon()
        .with_context(|| format!("cannot open {}", paths.daemon_lock().display()))?;
    let Some(lock) = lock else {
        anyhow::bail!(
                "the agentmbx daemon is running for {} and signs with the current keys: stop it, run `agentmbx host rotate`, then start it again (it announces the rotation to peers and the relay)",
                paths.home().display()
            );
    };
    let now = SystemClock::from_env()?.now_ms();
    let done = rotation::rotate(&paths, &config, now)?;
    let old_fp = done.old_key.fingerprint();
    let public = done.identity.public();
    let mailbox = Mailbox::open(&paths.mailbox_db()).context("cannot open mailbox.db")?;
    let peers = mailbox.with(|c| {
        let tx = c.transaction()?;
        audit::record(
            &tx,
            now,
            "host.key_rotated",
            &serde_json::json!({"from": old_fp, "to": public.fingerprint}),
        )?;
        let peers = agentmbx::mailbox::peers::list(&tx)?;
        tx.commit()?;
        Ok(peers
            .into_iter()
            .map(|p| (p.host, p.addr.is_some()))
            .collect::<Vec<_>>())
    })?;
    let (lan, relay_only): (Vec<_>, Vec<_>) = peers.iter().partition(|(_, has_addr)| *has_addr);
    let lan: Vec<String> = lan.into_iter().map(|(h, _)| h.clone()).collect();
    let relay_only: Vec<String> = relay_only.into_iter().map(|(h, _)| h.clone()).collect();
    let peers: Vec<String> = peers.into_iter().map(|(h, _)| h).collect();
    drop(lock);
    if args.json {
        let mut value = serde_json::to_value(&public)?;
        value["old_pubkey"] = done.old_key.to_b64().into();
        value["old_fingerprint"] = old_fp.into();
        value["iat"] = done.record.rec.iat.clone().into();
        value["rotations"] = done.identity.history.rotations.len().into();
        value["peers"] = peers.into();
        value["peers_without_lan_address"] = relay_only.clone().into();
        println!("{}", serde_json::to_string_pretty(&value)?);
    } else {
        println!(
            "rotated the keys of host {}: {old_fp} -> {}",
            public.host, public.fingerprint
        );
        println!("host_pubkey: {}", public.host_pubkey);
        println!("enc_pub: {}", public.enc_pub);
        if peers.is_empty() {
            println!("no paired peers to tell; a configured relay is told when the daemon starts");
        } else if !lan.is_empty() {
            println!(
                "the daemon tells {} paired peer(s) over the LAN ({}) and a configured relay when it starts",
                lan.len(),
                lan.join(", ")
            );
        }
        for host in &relay_only {
            println!(
                "{host} has no LAN address: peers learn a new key only over the LAN (the relay does not carry it), so mail between {host} and this host waits until `agentmbx peers addr {host} <host:port>` gives one"
            );
        }
    }
    Ok(())
}
