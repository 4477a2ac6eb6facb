//! `agentmbx completions <shell>`: print a completion script for bash, zsh, fish, elvish or
//! PowerShell to stdout, generated from the same command definition as `--help` and the man
//! pages (clap_complete). Packagers write the scripts at build time (`packaging/deb/build`,
//! the Homebrew formula's `generate_completions_from_executable`).
//!
//! This command reads no files and no environment; it must never touch MBX_HOME.

use std::io::Write;

use anyhow::Context;
use clap::Args;
use clap_complete::Shell;

/// Arguments of `completions`.
#[derive(Debug, Args)]
pub struct CompletionsArgs {
    /// The shell to write the script for
    #[arg(value_enum, value_name = "SHELL")]
    pub shell: Shell,
}

/// Writes the script for `args.shell` to stdout. Errors: stdout cannot be written (e.g. a
/// closed pipe).
pub fn run(args: CompletionsArgs) -> anyhow::Result<()> {
    let mut out = Vec::new();
    clap_complete::generate(args.shell, &mut super::command(), "agentmbx", &mut out);
    let mut stdout = std::io::stdout().lock();
    stdout
        .write_all(&out)
        .and_then(|()| stdout.flush())
        .context("cannot write the completion script to stdout")
}
