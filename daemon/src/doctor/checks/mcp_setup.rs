//! `mcp-setup`: each agentmbx MCP entry registered with an agent client still runs this binary
//! for this home ([`crate::setup`]; issue 18 part 4).
//!
//! It reads the clients' files only ([`crate::setup::registered`]: Codex's `config.toml`,
//! Claude Code's user scope in `.claude.json`, the `.mcp.json` of the working directory); it
//! runs no client, so it is cheap and bounded. No entry is `skip` (an info: setup was not run);
//! an entry whose command is not this binary (moved, upgraded elsewhere, deleted), whose
//! `MBX_HOME` is not this home, that setup did not write, or whose file does not parse is
//! `warn` with `agentmbx setup` as the fix.

use std::path::{Path, PathBuf};

use super::super::{shell_path, shell_quote, Facts, Outcome, Status};
use crate::setup::{self, Context, Registration};

/// Evaluates the check for the process's environment and executable.
pub fn mcp_setup(f: &Facts) -> Result<Outcome, String> {
    let exe = std::env::current_exe().map_err(|e| format!("cannot find this binary: {e}"))?;
    let ctx = Context::from_env();
    let home_set = std::env::var_os(crate::paths::HOME_ENV).is_some_and(|v| !v.is_empty());
    Ok(verdict(
        &setup::registered(&ctx),
        &exe,
        f.paths.home(),
        setup::default_home().as_deref(),
        home_set,
    ))
}

/// `path` made absolute and, where it exists, with symbolic links resolved.
fn resolved(path: &Path) -> PathBuf {
    std::fs::canonicalize(path)
        .or_else(|_| std::path::absolute(path))
        .unwrap_or_else(|_| path.to_path_buf())
}

/// The verdict over what was found: `exe` is this binary, `home` this home, `default_home` the
/// home an entry without `MBX_HOME` serves, `home_set` whether `MBX_HOME` is set here (the fix
/// then names it).
pub fn verdict(
    found: &[Registration],
    exe: &Path,
    home: &Path,
    default_home: Option<&Path>,
    home_set: bool,
) -> Outcome {
    if found.is_empty() {
        return Outcome::new(
            Status::Skip,
            "no agentmbx MCP server registered with Codex or Claude Code (user scope, ./.mcp.json)",
        )
        .detail("to let agents use the mailbox through MCP: agentmbx setup");
    }
    let (exe, home) = (resolved(exe), resolved(home));
    let mut out = Outcome::new(Status::Ok, "");
    let mut bad = 0usize;
    let mut agent = None;
    let mut project = false;
    for r in found {
        let problem = match &r.entry {
            Err(why) => Some(format!("cannot be read: {why}")),
            Ok(e) if !setup::is_ours(&e.command, &e.args) => Some(format!(
                "an entry named agentmbx that does not run `agentmbx mcp` (it runs `{}`)",
                e.command_line()
            )),
            Ok(e) => {
                agent = agent.or(setup::agent_of(&e.args).map(str::to_string));
                let entry_home = e
                    .env
                    .iter()
                    .find(|(k, _)| k == crate::paths::HOME_ENV)
                    .map(|(_, v)| PathBuf::from(v))
                    .or_else(|| default_home.map(Path::to_path_buf));
                if resolved(Path::new(&e.command)) != exe {
                    let gone = if Path::new(&e.command).exists() {
                        ""
                    } else {
                        " (no such file)"
                    };
                    Some(format!(
                        "runs {}{gone}, not this binary {}",
                        e.command,
                        exe.display()
                    ))
                } else if entry_home.as_deref().map(resolved).as_ref() != Some(&home) {
                    Some(format!(
                        "serves the home {}, not this home {}",
                        entry_home
                            .map(|h| h.display().to_string())
                            .unwrap_or_else(|| "(default)".into()),
                        home.display()
                    ))
                } else {
                    None
                }
            }
        };
        match problem {
            None => out = out.detail(format!("{}: runs this binary for this home", r.place)),
            Some(p) => {
                bad += 1;
                project |= r.place.starts_with("Claude Code project");
                out = out.detail(format!("{}: {p}", r.place));
            }
        }
    }
    if bad == 0 {
        out.summary = format!(
            "{} agentmbx MCP entr{} run this binary for this home",
            found.len(),
            if found.len() == 1 { "y" } else { "ies" }
        );
        return out;
    }
    out.status = Some(Status::Warn);
    out.summary = format!(
        "{bad} of {} agentmbx MCP entr{} not pointing at this binary and home",
        found.len(),
        if found.len() == 1 { "y is" } else { "ies are" }
    );
    let env = if home_set {
        format!("MBX_HOME={} ", shell_path(&home))
    } else {
        String::new()
    };
    let as_agent = agent
        .map(|a| format!(" --as {}", shell_quote(&a)))
        .unwrap_or_default();
    if project {
        out = out.detail(format!(
            "for ./.mcp.json: {env}agentmbx setup --only claude --project .{as_agent}"
        ));
    }
    out.fix(format!("{env}agentmbx setup{as_agent}"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::setup::{Client, Entry};

    fn reg(command: &str, args: &[&str], env: &[(&str, &str)]) -> Registration {
        Registration {
            client: Client::Codex,
            place: "Codex (/u/.codex/config.toml)".into(),
            entry: Ok(Entry {
                command: command.into(),
                args: args.iter().map(|s| s.to_string()).collect(),
                env: env
                    .iter()
                    .map(|(k, v)| (k.to_string(), v.to_string()))
                    .collect(),
            }),
        }
    }

    #[test]
    fn none_is_an_info() {
        let o = verdict(&[], Path::new("/b/agentmbx"), Path::new("/h"), None, false);
        assert_eq!(o.status, Some(Status::Skip));
        assert!(o.details[0].contains("agentmbx setup"));
    }

    #[test]
    fn this_binary_and_home_is_ok() {
        let found = [reg(
            "/b/agentmbx",
            &["mcp", "--as", "ana"],
            &[("MBX_HOME", "/h")],
        )];
        let o = verdict(
            &found,
            Path::new("/b/agentmbx"),
            Path::new("/h"),
            None,
            true,
        );
        assert_eq!(o.status, Some(Status::Ok), "{o:?}");
        let found = [reg("/b/agentmbx", &["mcp"], &[])];
        let o = verdict(
            &found,
            Path::new("/b/agentmbx"),
            Path::new("/d"),
            Some(Path::new("/d")),
            false,
        );
        assert_eq!(o.status, Some(Status::Ok), "{o:?}");
    }

    #[test]
    fn another_binary_or_home_warns_with_the_fix() {
        let found = [reg("/old/agentmbx", &["mcp", "--as", "ana"], &[])];
        let o = verdict(
            &found,
            Path::new("/b/agentmbx"),
            Path::new("/d"),
            Some(Path::new("/d")),
            false,
        );
        assert_eq!(o.status, Some(Status::Warn));
        assert!(
            o.details[0].contains("runs /old/agentmbx (no such file), not this binary"),
            "{o:?}"
        );
        assert_eq!(o.fix.as_deref(), Some("agentmbx setup --as ana"));
        let found = [reg("/b/agentmbx", &["mcp"], &[("MBX_HOME", "/other")])];
        let o = verdict(
            &found,
            Path::new("/b/agentmbx"),
            Path::new("/h"),
            None,
            true,
        );
        assert_eq!(o.status, Some(Status::Warn));
        assert!(
            o.details[0].contains("serves the home /other, not this home /h"),
            "{o:?}"
        );
        assert_eq!(o.fix.as_deref(), Some("MBX_HOME=/h agentmbx setup"));
        let found = [reg("npx", &["other"], &[])];
        let o = verdict(
            &found,
            Path::new("/b/agentmbx"),
            Path::new("/h"),
            None,
            false,
        );
        assert_eq!(o.status, Some(Status::Warn));
    }
}
