//! `agentmbx whoami [--json]`: print this host's public identity.

use agentmbx::config::Config;
use agentmbx::identity;
use agentmbx::paths::Paths;
use clap::Args;

/// Flags of `whoami`.
#[derive(Debug, Args)]
pub struct WhoamiArgs {
    /// Print as JSON: {host, host_pubkey, fingerprint, enc_pub, home}
    #[arg(long)]
    pub json: bool,
}

/// Loads the identity (exit 3 when the host is not initialized) and prints its public half.
pub fn run(args: WhoamiArgs) -> anyhow::Result<()> {
    let paths = Paths::from_env()?;
    let config = Config::load(&paths)?;
    let public = identity::load(&paths, &config)?.public();
    if args.json {
        let mut value = serde_json::to_value(&public)?;
        value["home"] = paths.home().display().to_string().into();
        println!("{}", serde_json::to_string_pretty(&value)?);
    } else {
        println!("host: {}", public.host);
        println!("host_pubkey: {}", public.host_pubkey);
        println!("fingerprint: {}", public.fingerprint);
        println!("enc_pub: {}", public.enc_pub);
        println!("home: {}", paths.home().display());
    }
    Ok(())
}
