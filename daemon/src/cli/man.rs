//! `agentmbx man <dir>` (hidden): write the man pages generated from the command definition,
//! `agentmbx.1` and one `agentmbx-<sub>[-<sub>].1` per visible subcommand (clap_mangen). The
//! pages in the repository's `man/` are this command's output; CI regenerates them and fails on
//! drift. Pages name environment variables but never their values, so they do not depend on
//! the environment of whoever generates them.

use std::path::PathBuf;

use anyhow::Context;
use clap::Args;

/// Arguments of `man`.
#[derive(Debug, Args)]
pub struct ManArgs {
    /// Directory to write the pages into (created when missing)
    #[arg(value_name = "DIR")]
    pub dir: PathBuf,
}

/// Writes every page into the directory.
pub fn run(args: ManArgs) -> anyhow::Result<()> {
    let dir = &args.dir;
    std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
    clap_mangen::generate_to(super::command(), dir)
        .with_context(|| format!("cannot write man pages into {}", dir.display()))
}
