//! `agentmbx init [--host NAME] [--json]`: create this host's identity.

use agentmbx::host_name::HostName;
use agentmbx::identity;
use agentmbx::mailbox::Mailbox;
use agentmbx::paths::Paths;
use anyhow::Context;
use clap::Args;

/// Flags of `init`.
#[derive(Debug, Args)]
pub struct InitArgs {
    /// Host name: 2-40 of a-z, 0-9 and '-', not starting with '-'. Default: the name already in
    /// config.toml, else the machine's host name fitted to that rule
    #[arg(long, value_name = "NAME")]
    pub host: Option<HostName>,
    /// Print the new identity as JSON
    #[arg(long)]
    pub json: bool,
}

/// Creates the identity (refusing when one exists) and the host store `mailbox.db`, and prints
/// the identity's public half.
pub fn run(args: InitArgs) -> anyhow::Result<()> {
    let paths = Paths::from_env()?;
    let identity = identity::init(&paths, args.host.as_ref())?;
    Mailbox::open(&paths.mailbox_db()).context("cannot create mailbox.db")?;
    let public = identity.public();
    if args.json {
        let mut value = serde_json::to_value(&public)?;
        value["home"] = paths.home().display().to_string().into();
        println!("{}", serde_json::to_string_pretty(&value)?);
    } else {
        println!(
            "initialized host {} in {}",
            public.host,
            paths.home().display()
        );
        println!("host_pubkey: {}", public.host_pubkey);
        println!("fingerprint: {}", public.fingerprint);
    }
    Ok(())
}
