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
/// the identity's public half and where the keys went (`keys:`; JSON `keys`); when the OS
/// keyring did not answer and the keys fell back to 0600 files, a warning on stderr says so,
/// why, and how to choose (JSON also `warning`).
pub fn run(args: InitArgs) -> anyhow::Result<()> {
    let paths = Paths::from_env()?;
    let (identity, keys) = identity::init_reporting(&paths, args.host.as_ref())?;
    Mailbox::open(&paths.mailbox_db()).context("cannot create mailbox.db")?;
    let public = identity.public();
    if args.json {
        let mut value = serde_json::to_value(&public)?;
        value["home"] = paths.home().display().to_string().into();
        value["keys"] = keys.location.clone().into();
        if let Some(warning) = &keys.warning {
            value["warning"] = warning.clone().into();
        }
        println!("{}", serde_json::to_string_pretty(&value)?);
    } else {
        println!(
            "initialized host {} in {}",
            public.host,
            paths.home().display()
        );
        println!("host_pubkey: {}", public.host_pubkey);
        println!("fingerprint: {}", public.fingerprint);
        println!("keys: {}", keys.location);
    }
    // The fall-back to files is worth a word whatever the output: the log level hides it.
    if let Some(warning) = &keys.warning {
        eprintln!("agentmbx: warning: {warning}");
    }
    Ok(())
}
