//! `agentmbx discover [--json]`: browse the LAN over mDNS for 3 s and list the AgentMBX hosts
//! that answered, each with its address, advertised key fingerprint and what it is to this
//! host: `this host`, `not paired`, `paired`, or `KEY MISMATCH (advertised X, pinned Y)` when a
//! pinned peer's name shows another key (`wire.md` §4 "mDNS").
//!
//! Listing only: nothing here pins, moves or trusts anything. Refused (exit 1) when mDNS is off
//! for this host (`MBX_NO_MDNS=1`, `mdns = false`, a loopback `lan_bind`).

use anyhow::Context;
use clap::Args;
use serde_json::{json, Value};

use agentmbx::config::Config;
use agentmbx::discovery::{self, Standing};
use agentmbx::identity;
use agentmbx::mailbox::{peers, Mailbox};
use agentmbx::paths::Paths;

/// Flags of `discover`.
#[derive(Debug, Args)]
pub struct DiscoverArgs {
    /// Print a JSON array: [{host, addr, addrs, port, fp, v, standing, status, pinned_fp?}]
    #[arg(long)]
    pub json: bool,
}

/// Browses for [`discovery::BROWSE_WINDOW`] and prints what answered, sorted by host name.
pub fn run(args: DiscoverArgs) -> anyhow::Result<()> {
    let paths = Paths::from_env()?;
    let config = Config::load(&paths)?;
    if !config.mdns_enabled() {
        anyhow::bail!(
            "mDNS is off for this host (MBX_NO_MDNS=1, mdns = false in config.toml, or a loopback lan_bind); pair by address instead"
        );
    }
    let ident = identity::load(&paths, &config)?;
    let own_host = ident.host.to_string();
    let own_fp = ident.host_key.public().fingerprint();
    let mailbox = Mailbox::open(&paths.mailbox_db()).context("cannot open mailbox.db")?;
    let pinned = mailbox.with(|c| peers::list(c))?;
    let seen = discovery::browse(discovery::BROWSE_WINDOW)?;
    let rows: Vec<(discovery::Seen, Standing)> = seen
        .into_iter()
        .map(|s| {
            let standing = discovery::standing(&s, &own_host, &own_fp, &pinned);
            (s, standing)
        })
        .collect();
    if args.json {
        let list: Vec<Value> = rows
            .iter()
            .map(|(s, standing)| {
                let mut v = json!({
                    "host": s.host,
                    "addr": s.addr,
                    "addrs": s.candidates(),
                    "port": s.port,
                    "fp": s.fp,
                    "v": s.v,
                    "standing": match standing {
                        Standing::ThisHost => "this-host",
                        Standing::NotPaired => "not-paired",
                        Standing::Paired => "paired",
                        Standing::KeyMismatch { .. } => "key-mismatch",
                    },
                    "status": standing.label(),
                });
                if let Standing::KeyMismatch { pinned, .. } = standing {
                    v["pinned_fp"] = pinned.clone().into();
                }
                v
            })
            .collect();
        println!("{}", serde_json::to_string_pretty(&list)?);
        return Ok(());
    }
    if rows.is_empty() {
        println!(
            "no AgentMBX hosts answered within 3 s (the daemon advertises over mDNS; if multicast is blocked, use explicit addresses)"
        );
        return Ok(());
    }
    for (s, standing) in &rows {
        let fp = if s.fp.is_empty() { "?" } else { s.fp.as_str() };
        println!("{}\t{}\tkey {fp}\t{}", s.host, s.addr, standing.label());
    }
    Ok(())
}
