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
        .with_context(|| format!("cannot write man pages into {}", dir.display()))?;
    mark_repeatable(super::command(), dir)
}

/// clap_mangen writes a repeatable positional as `[NAME]` in the synopsis; this rewrites it to
/// `[NAME]...` (as `--help` says) in each generated page.
fn mark_repeatable(cmd: clap::Command, dir: &std::path::Path) -> anyhow::Result<()> {
    fn walk(cmd: &clap::Command, dir: &std::path::Path) -> anyhow::Result<()> {
        for sub in cmd.get_subcommands().filter(|s| !s.is_hide_set()) {
            walk(sub, dir)?;
        }
        let repeated: Vec<String> = cmd
            .get_positionals()
            .filter(|a| !a.is_hide_set() && matches!(a.get_action(), clap::ArgAction::Append))
            .filter_map(|a| a.get_value_names().map(|v| v.join(" ")))
            .collect();
        if repeated.is_empty() {
            return Ok(());
        }
        let page = dir.join(format!(
            "{}.1",
            cmd.get_display_name().unwrap_or(cmd.get_name())
        ));
        let text = std::fs::read_to_string(&page)
            .with_context(|| format!("cannot read {}", page.display()))?;
        let mut out = Vec::new();
        let mut in_synopsis = false;
        for line in text.split_inclusive('\n') {
            if line.starts_with(".SH") {
                in_synopsis = line.starts_with(".SH SYNOPSIS");
                out.push(line.to_string());
                continue;
            }
            let mut l = line.to_string();
            if in_synopsis {
                for name in &repeated {
                    for (lhs, rhs) in [("[", "]"), ("<", ">")] {
                        let from = format!("{lhs}\\fI{name}\\fR{rhs} ");
                        let to = format!("{lhs}\\fI{name}\\fR{rhs}... ");
                        l = l.replace(&from, &to);
                    }
                }
            }
            out.push(l);
        }
        std::fs::write(&page, out.concat())
            .with_context(|| format!("cannot write {}", page.display()))
    }
    let mut cmd = cmd.disable_help_subcommand(true);
    cmd.build();
    walk(&cmd, dir)
}
