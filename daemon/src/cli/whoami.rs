//! `agentmbx whoami [--json]`: print this host's public identity.
//!
//! `agentmbx whoami --as <agent> [--role R] [--description D] [--json]`: register `<agent>` as a
//! local mailbox of this host (written to `mailbox.db` directly, so no running daemon is
//! needed) and print its directory entry. From then on `*` reaches it, and `role:R` when it has
//! role R (`wire.md` §4 "Addressing"). `--role ""` or `--description ""` clears the value; an
//! omitted flag keeps what is stored. Mail this host held for the name (`inbox --unclaimed`)
//! becomes the agent's mail in the same transaction; a running daemon is then told (best
//! effort, through the local API) so its `delivered` receipts go out at once.

use anyhow::Context;
use clap::Args;

use agentmbx::config::Config;
use agentmbx::identity;
use agentmbx::mailbox::{agents, Mailbox, MailboxError};
use agentmbx::paths::Paths;
use agentmbx_protocol::clock::{Clock, SystemClock};

use super::UsageError;

/// Flags of `whoami`.
#[derive(Debug, Args)]
pub struct WhoamiArgs {
    /// Register this agent as a local mailbox of this host (and print its entry); mail held for
    /// that name (`agentmbx inbox --unclaimed`) becomes its mail
    #[arg(long = "as", value_name = "AGENT")]
    pub as_agent: Option<String>,
    /// With --as: the agent's role, reached by `role:<R>` addresses ("" clears it)
    #[arg(long, value_name = "R", requires = "as_agent")]
    pub role: Option<String>,
    /// With --as: one line about the agent, ≤200 characters ("" clears it)
    #[arg(long, value_name = "TEXT", requires = "as_agent")]
    pub description: Option<String>,
    /// Print as JSON: {host, host_pubkey, fingerprint, enc_pub, keystore, home}; with --as the agent
    /// entry {name, host, role, cli, description, last_seen}
    #[arg(long)]
    pub json: bool,
}

/// Loads the identity (exit 3 when the host is not initialized) and prints its public half,
/// or with `--as` registers the agent (exit 2 for a bad name, role or description).
pub fn run(args: WhoamiArgs) -> anyhow::Result<()> {
    let paths = Paths::from_env()?;
    let config = Config::load(&paths)?;
    let public = identity::load(&paths, &config)?.public();
    if let Some(name) = &args.as_agent {
        let mailbox = Mailbox::open(&paths.mailbox_db()).context("cannot open mailbox.db")?;
        let now = SystemClock::from_env()?.now_ms();
        let host = public.host.to_string();
        let held = mailbox
            .with(|c| {
                Ok(agentmbx::mailbox::unclaimed::counts(c)?
                    .into_iter()
                    .find(|(n, _)| n == name)
                    .map_or(0, |(_, k)| k))
            })
            .unwrap_or(0);
        let entry = mailbox
            .with(|c| {
                agents::register(
                    c,
                    &host,
                    name,
                    args.role.as_deref(),
                    args.description.as_deref(),
                    now,
                )
            })
            .map_err(|e| match e {
                MailboxError::Invalid(m) => anyhow::Error::new(UsageError(m)),
                other => anyhow::Error::new(other),
            })?;
        if args.json {
            let mut value = serde_json::to_value(&entry)?;
            value["host"] = host.into();
            println!("{}", serde_json::to_string_pretty(&value)?);
        } else {
            println!("agent: {}@{host}", entry.name);
            println!("role: {}", entry.role.as_deref().unwrap_or("-"));
            println!(
                "description: {}",
                entry.description.as_deref().unwrap_or("-")
            );
            println!("last_seen: {}", entry.last_seen.as_deref().unwrap_or("-"));
        }
        if held > 0 {
            let when = if crate::local_api::wake_daemon_for(name) {
                "now"
            } else {
                "once the daemon runs"
            };
            eprintln!(
                "{held} message(s) this host held for {name} are now in its inbox; their delivered receipts go out {when}"
            );
        }
        return Ok(());
    }
    if args.json {
        let mut value = serde_json::to_value(&public)?;
        value["home"] = paths.home().display().to_string().into();
        println!("{}", serde_json::to_string_pretty(&value)?);
    } else {
        println!("host: {}", public.host);
        println!("host_pubkey: {}", public.host_pubkey);
        println!("fingerprint: {}", public.fingerprint);
        println!("enc_pub: {}", public.enc_pub);
        println!("keystore: {}", public.keystore);
        println!("home: {}", paths.home().display());
    }
    Ok(())
}
