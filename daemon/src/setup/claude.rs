//! Claude Code's user scope, through its documented CLI (`agent-surface.md` "Registration"):
//! `claude mcp get agentmbx` to read what is there, `claude mcp add --transport stdio --scope
//! user agentmbx -- <command> <args>` to add, `claude mcp remove --scope user agentmbx` to remove.
//! Setup never edits Claude Code's own files.
//!
//! `claude mcp get` prints the entry as text (`Scope:`, `Command:`, `Args:` joined by spaces,
//! `Environment:` then `KEY=value` lines); [`parse_get`] reads it. `--env` is variadic in
//! Claude's CLI, so it goes first, before the options that end it and the server name.

use std::io::Read;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use super::{is_ours, Action, Client, Entry, ServerSpec, SetupError, Status, Step, SERVER_NAME};

/// What `claude mcp get agentmbx` reported.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Registered {
    /// The `Scope:` line (e.g. `User config (available in all your projects)`).
    pub scope: String,
    /// The entry.
    pub entry: Entry,
}

impl Registered {
    /// Whether the entry is in the user scope (the one setup manages).
    pub fn is_user_scope(&self) -> bool {
        self.scope.to_ascii_lowercase().starts_with("user")
    }
}

/// Reads the text of `claude mcp get <name>`: `None` when it names no `Command:`.
pub fn parse_get(out: &str) -> Option<Registered> {
    let mut scope = String::new();
    let mut command = None;
    let mut args = Vec::new();
    let mut env = Vec::new();
    let mut in_env = false;
    for line in out.lines() {
        let indent = line.len() - line.trim_start().len();
        let t = line.trim();
        if in_env && indent > 2 && t.contains('=') {
            let (k, v) = t.split_once('=').unwrap_or((t, ""));
            env.push((k.to_string(), v.to_string()));
            continue;
        }
        in_env = false;
        if let Some(v) = t.strip_prefix("Scope:") {
            scope = v.trim().to_string();
        } else if let Some(v) = t.strip_prefix("Command:") {
            command = Some(v.trim().to_string());
        } else if let Some(v) = t.strip_prefix("Args:") {
            args = v.split_whitespace().map(str::to_string).collect();
        } else if t == "Environment:" {
            in_env = true;
        }
    }
    env.sort();
    Some(Registered {
        scope,
        entry: Entry {
            command: command?,
            args,
            env,
        },
    })
}

/// Runs `claude mcp get agentmbx` (bounded by `timeout`): `Ok(None)` when Claude Code has no
/// such server (a non-zero exit). Errors: `claude` cannot be started or runs out of time.
pub fn get(exe: &Path, timeout: Duration) -> Result<Option<Registered>, SetupError> {
    let args = ["mcp", "get", SERVER_NAME].map(String::from);
    match output(exe, &args, timeout)? {
        (true, out, _) => Ok(parse_get(&out)),
        (false, _, _) => Ok(None),
    }
}

/// Runs `claude <args>`; errors when it cannot start, runs out of time or exits non-zero (with
/// its stderr).
pub fn run(exe: &Path, args: &[String], timeout: Duration) -> Result<(), SetupError> {
    match output(exe, args, timeout)? {
        (true, _, _) => Ok(()),
        (false, out, err) => Err(SetupError::Claude {
            command: command_line(args),
            why: format!(
                "failed: {}",
                first_chars(if err.trim().is_empty() { &out } else { &err }, 500)
            ),
        }),
    }
}

fn first_chars(s: &str, n: usize) -> String {
    s.trim().chars().take(n).collect()
}

/// `(success, stdout, stderr)` of `claude <args>`, killed after `timeout`.
fn output(
    exe: &Path,
    args: &[String],
    timeout: Duration,
) -> Result<(bool, String, String), SetupError> {
    let fail = |why: String| SetupError::Claude {
        command: command_line(args),
        why,
    };
    let mut child = Command::new(exe)
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| fail(format!("cannot start {}: {e}", exe.display())))?;
    let reader = |s: Option<Box<dyn Read + Send>>| {
        std::thread::spawn(move || {
            let mut buf = String::new();
            if let Some(mut s) = s {
                let _ = s.read_to_string(&mut buf);
            }
            buf
        })
    };
    let out = reader(child.stdout.take().map(|s| Box::new(s) as _));
    let err = reader(child.stderr.take().map(|s| Box::new(s) as _));
    let deadline = Instant::now() + timeout;
    let status = loop {
        match child.try_wait() {
            Ok(Some(status)) => break status,
            Ok(None) if Instant::now() >= deadline => {
                let _ = child.kill();
                let _ = child.wait();
                return Err(fail(format!("no answer within {} s", timeout.as_secs())));
            }
            Ok(None) => std::thread::sleep(Duration::from_millis(20)),
            Err(e) => return Err(fail(e.to_string())),
        }
    };
    let out = out.join().unwrap_or_default();
    let err = err.join().unwrap_or_default();
    Ok((status.success(), out, err))
}

/// The arguments of `claude mcp add` for `spec` in the user scope.
pub fn add_args(spec: &ServerSpec) -> Vec<String> {
    let mut a: Vec<String> = vec!["mcp".into(), "add".into()];
    for (k, v) in &spec.env {
        a.push("--env".into());
        a.push(format!("{k}={v}"));
    }
    a.extend(["--transport", "stdio", "--scope", "user", SERVER_NAME, "--"].map(String::from));
    a.push(spec.command.clone());
    a.extend(spec.args.iter().cloned());
    a
}

/// The arguments of `claude mcp remove` for our user-scope entry.
pub fn remove_args() -> Vec<String> {
    ["mcp", "remove", "--scope", "user", SERVER_NAME]
        .map(String::from)
        .to_vec()
}

/// `claude args…` quoted for a POSIX shell.
pub fn command_line(args: &[String]) -> String {
    std::iter::once("claude".to_string())
        .chain(args.iter().map(|a| crate::shell::shell_quote(a)))
        .collect::<Vec<_>>()
        .join(" ")
}

/// The step for Claude Code's user scope, given what `claude mcp get` reported.
pub fn plan(
    exe: &Path,
    current: Option<Registered>,
    spec: &ServerSpec,
    uninstall: bool,
) -> Result<Step, SetupError> {
    let mut note = None;
    let user = match current {
        Some(r) if r.is_user_scope() => Some(r.entry),
        Some(r) => {
            note = Some(format!(
                "Claude Code also has an entry named {SERVER_NAME} in another scope ({}); it takes precedence over the user scope",
                r.scope
            ));
            None
        }
        None => None,
    };
    let (status, calls) = match (&user, uninstall) {
        (None, _) => (
            if uninstall {
                Status::Unchanged
            } else {
                Status::Added
            },
            if uninstall {
                vec![]
            } else {
                vec![add_args(spec)]
            },
        ),
        (Some(e), _) if !is_ours(&e.command, &e.args) => {
            note = Some(format!(
                "an entry named {SERVER_NAME} that setup did not write is there (it runs `{}`): left alone; remove it with `claude mcp remove --scope user {SERVER_NAME}`, then run setup again",
                e.command_line()
            ));
            (Status::Conflict, vec![])
        }
        (Some(_), true) => (Status::Removed, vec![remove_args()]),
        (Some(e), false) if e.matches(spec) => (Status::Unchanged, vec![]),
        (Some(_), false) => (Status::Updated, vec![remove_args(), add_args(spec)]),
    };
    Ok(Step {
        client: Client::Claude,
        status,
        target: "user scope (claude mcp)".into(),
        note,
        change: calls
            .iter()
            .map(|c| command_line(c) + "\n")
            .collect::<String>(),
        action: if calls.is_empty() {
            Action::None
        } else {
            Action::Claude {
                exe: exe.to_path_buf(),
                calls,
            }
        },
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const GET: &str = "agentmbx:
  Scope: User config (available in all your projects)
  Status: ✓ Connected
  Type: stdio
  Command: /opt/bin/agentmbx
  Args: mcp --as ana
  Environment:
    MBX_HOME=/h

To remove this server, run: claude mcp remove \"agentmbx\" -s user
";

    fn spec() -> ServerSpec {
        ServerSpec::new(
            Path::new("/opt/bin/agentmbx"),
            Some("ana"),
            Some(Path::new("/h")),
        )
    }

    #[test]
    fn parses_get() {
        let r = parse_get(GET).unwrap();
        assert!(r.is_user_scope());
        assert!(r.entry.matches(&spec()));
        assert_eq!(parse_get("No MCP server found with name: agentmbx"), None);
    }

    #[test]
    fn add_puts_env_first() {
        assert_eq!(
            add_args(&spec()),
            [
                "mcp",
                "add",
                "--env",
                "MBX_HOME=/h",
                "--transport",
                "stdio",
                "--scope",
                "user",
                "agentmbx",
                "--",
                "/opt/bin/agentmbx",
                "mcp",
                "--as",
                "ana"
            ]
        );
    }

    #[test]
    fn plans() {
        let exe = Path::new("/bin/claude");
        let cur = parse_get(GET);
        let st = |c: Option<Registered>, s: &ServerSpec, u| plan(exe, c, s, u).unwrap().status;
        assert_eq!(st(None, &spec(), false), Status::Added);
        assert_eq!(st(cur.clone(), &spec(), false), Status::Unchanged);
        assert_eq!(st(cur.clone(), &spec(), true), Status::Removed);
        assert_eq!(st(None, &spec(), true), Status::Unchanged);
        let other = ServerSpec::new(Path::new("/new/agentmbx"), None, None);
        let up = plan(exe, cur.clone(), &other, false).unwrap();
        assert_eq!(up.status, Status::Updated);
        assert_eq!(
            up.change,
            "claude mcp remove --scope user agentmbx\nclaude mcp add --transport stdio --scope user agentmbx -- /new/agentmbx mcp\n"
        );
        let foreign = parse_get(&GET.replace("/opt/bin/agentmbx", "npx")).unwrap();
        assert_eq!(st(Some(foreign.clone()), &spec(), false), Status::Conflict);
        assert_eq!(st(Some(foreign), &spec(), true), Status::Conflict);
        let local = parse_get(&GET.replace("User config", "Local config")).unwrap();
        let p = plan(exe, Some(local), &spec(), false).unwrap();
        assert_eq!(p.status, Status::Added);
        assert!(p.note.unwrap().contains("another scope"));
    }
}
