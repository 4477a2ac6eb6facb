//! `agentmbx setup`: registering `agentmbx mcp` with the agent clients on this machine
//! (issue 18 part 4; `agent-surface.md` "Registration").
//!
//! What it owns: the entry it adds and nothing else. Claude Code gets a user-scope server through
//! its documented CLI (`claude mcp add --scope user`, [`claude`]) or, for one project, an entry
//! in that project's `.mcp.json` ([`mcp_json`]); Codex gets `[mcp_servers.agentmbx]` in
//! `$CODEX_HOME/config.toml` (default `~/.codex/config.toml`, [`codex`]). Files are edited with
//! format-preserving parsers (toml_edit, jsonc-parser's CST): every other entry, the key order,
//! the comments and the whitespace stay byte for byte, and removing what setup added gives the
//! file back as it was. An entry is *ours* when its command's file name is `agentmbx` and its
//! first argument is `mcp` ([`is_ours`]); setup never changes or removes an entry named
//! `agentmbx` that is not ours (status [`Status::Conflict`]).
//!
//! The flow: [`plan`] reads the clients' current state and decides, per client, what would
//! change ([`Step`]: its status, a diff or the exact command); [`apply`] carries a plan out.
//! Nothing here asks the user or prints: the CLI (`src/cli/setup.rs`) does. Running setup twice
//! changes nothing the second time ([`Status::Unchanged`]).

pub mod claude;
pub mod client_hooks;
pub mod codex;
pub mod diff;
pub mod mcp_json;

use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::Serialize;

/// The name every client knows our server by.
pub const SERVER_NAME: &str = "agentmbx";

/// Codex's `startup_timeout_sec` for our server (s): the server registers its agent with the
/// daemon before it answers `initialize`; Codex's default (10 s) leaves little room on a busy
/// host.
pub const CODEX_STARTUP_TIMEOUT_SEC: i64 = 30;

/// Codex's `tool_timeout_sec` for our server (s): longer than `mbx_wait`'s 45 s maximum plus a
/// slow daemon answer, so a wait is never cut by the client.
pub const CODEX_TOOL_TIMEOUT_SEC: i64 = 90;

/// How long one `claude mcp …` call may run before setup gives up on it (`claude mcp get`
/// starts the server to report its status).
pub const CLAUDE_TIMEOUT: Duration = Duration::from_secs(60);

/// A setup failure: a file that cannot be read, parsed or written, or a `claude` call that
/// failed.
#[derive(Debug, thiserror::Error)]
pub enum SetupError {
    /// A client's config file could not be read or written.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// A client's config file is not valid TOML/JSON, or has an unexpected shape there (e.g.
    /// `mcp_servers` is not a table): setup does not touch it.
    #[error("{path}: {why}; fix the file by hand, then run setup again")]
    Parse {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        why: String,
    },
    /// `claude mcp …` could not run, timed out or failed.
    #[error("`{command}`: {why}")]
    Claude {
        /// The command line run.
        command: String,
        /// What went wrong (its exit status and stderr, or the spawn error).
        why: String,
    },
}

/// The agent clients setup knows (`--only claude,codex`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum Client {
    /// Claude Code (`claude`): user scope through its CLI, or a project `.mcp.json`.
    Claude,
    /// Codex (`~/.codex/config.toml`).
    Codex,
}

impl Client {
    /// Every client, in the order setup handles them.
    pub const ALL: [Client; 2] = [Client::Claude, Client::Codex];

    /// The client's name as users know it.
    pub fn title(self) -> &'static str {
        match self {
            Client::Claude => "Claude Code",
            Client::Codex => "Codex",
        }
    }
}

/// The MCP server entry setup registers: `command args…` with `env`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ServerSpec {
    /// Absolute path of the `agentmbx` binary.
    pub command: String,
    /// `["mcp"]` or `["mcp", "--as", AGENT]`.
    pub args: Vec<String>,
    /// `MBX_HOME` when the home is not the default one; empty otherwise. Sorted by name.
    pub env: Vec<(String, String)>,
}

impl ServerSpec {
    /// The entry for the binary `exe`, serving `agent` when given, for the home `home` when it
    /// is not the default (`None`).
    pub fn new(exe: &Path, agent: Option<&str>, home: Option<&Path>) -> Self {
        let mut args = vec!["mcp".to_string()];
        if let Some(a) = agent {
            args.push("--as".into());
            args.push(a.into());
        }
        let env = home
            .map(|h| {
                vec![(
                    crate::paths::HOME_ENV.to_string(),
                    h.to_string_lossy().into_owned(),
                )]
            })
            .unwrap_or_default();
        ServerSpec {
            command: exe.to_string_lossy().into_owned(),
            args,
            env,
        }
    }

    /// The agent named by `--as` in the arguments, if any.
    pub fn agent(&self) -> Option<&str> {
        agent_of(&self.args)
    }
}

/// The agent an entry's arguments name with `--as AGENT` (or `--as=AGENT`), if any.
pub fn agent_of(args: &[String]) -> Option<&str> {
    let mut it = args.iter();
    while let Some(a) = it.next() {
        if a == "--as" {
            return it.next().map(String::as_str);
        }
        if let Some(v) = a.strip_prefix("--as=") {
            return Some(v);
        }
    }
    None
}

/// An MCP server entry as a client holds it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Entry {
    /// The command.
    pub command: String,
    /// Its arguments.
    pub args: Vec<String>,
    /// Its environment, sorted by name.
    pub env: Vec<(String, String)>,
}

impl Entry {
    /// Whether the entry runs exactly `spec` (command, arguments and environment).
    pub fn matches(&self, spec: &ServerSpec) -> bool {
        self.command == spec.command && self.args == spec.args && self.env == spec.env
    }

    /// `command args…` for messages.
    pub fn command_line(&self) -> String {
        std::iter::once(self.command.as_str())
            .chain(self.args.iter().map(String::as_str))
            .collect::<Vec<_>>()
            .join(" ")
    }
}

/// Whether an entry named `agentmbx` is one setup wrote: its command's file name is `agentmbx`
/// (`agentmbx.exe`) and its first argument is `mcp`. Any such binary counts, so an entry left
/// by an older install at another path is updated or removed, never reported as foreign.
pub fn is_ours(command: &str, args: &[String]) -> bool {
    let name = Path::new(command)
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    (name == "agentmbx" || name == "agentmbx.exe")
        && args.first().map(String::as_str) == Some("mcp")
}

/// What one client's step did or would do (`--json`'s `status`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Status {
    /// Our entry was added.
    Added,
    /// Our entry was there with another command, arguments or environment and now matches.
    Updated,
    /// Our entry was there already exactly as wanted (or, with `--uninstall`, absent): nothing
    /// written.
    Unchanged,
    /// Our entry was removed (`--uninstall`).
    Removed,
    /// The client is not installed (or not asked for): nothing done.
    Skipped,
    /// An entry named `agentmbx` exists and is not ours: left alone.
    Conflict,
    /// `--dry-run`: would add.
    WouldAdd,
    /// `--dry-run`: would update.
    WouldUpdate,
    /// `--dry-run`: would remove.
    WouldRemove,
}

impl Status {
    /// The `--dry-run` form of a change (others unchanged).
    pub fn would(self) -> Status {
        match self {
            Status::Added => Status::WouldAdd,
            Status::Updated => Status::WouldUpdate,
            Status::Removed => Status::WouldRemove,
            other => other,
        }
    }

    /// Whether the step writes something.
    pub fn changes(self) -> bool {
        matches!(self, Status::Added | Status::Updated | Status::Removed)
    }
}

/// The outcome of editing one file's text: the new text and what it means.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Edited {
    /// Added, Updated, Unchanged, Removed or Conflict.
    pub status: Status,
    /// The text after the edit (equal to the input unless the status changes something).
    pub text: String,
    /// The foreign entry, for [`Status::Conflict`].
    pub foreign: Option<Entry>,
}

/// Where setup looks: the process environment, gathered once so tests can point it at fake
/// homes.
#[derive(Debug, Clone)]
pub struct Context {
    /// The user's home directory (`HOME`), if known.
    pub user_home: Option<PathBuf>,
    /// `CODEX_HOME` when set and non-empty.
    pub codex_home: Option<PathBuf>,
    /// `PATH`, to find `claude`.
    pub path: Option<OsString>,
    /// The working directory (doctor looks for `.mcp.json` there).
    pub cwd: PathBuf,
    /// `CLAUDE_CONFIG_DIR` when set and non-empty (where Claude Code keeps `.claude.json`).
    pub claude_config_dir: Option<PathBuf>,
}

impl Context {
    /// From the process environment.
    pub fn from_env() -> Self {
        let nonempty = |k: &str| std::env::var_os(k).filter(|v| !v.is_empty());
        Context {
            user_home: nonempty("HOME")
                .map(PathBuf::from)
                .or_else(|| directories::BaseDirs::new().map(|b| b.home_dir().to_path_buf())),
            codex_home: nonempty("CODEX_HOME").map(PathBuf::from),
            path: std::env::var_os("PATH"),
            cwd: std::env::current_dir().unwrap_or_else(|_| PathBuf::from(".")),
            claude_config_dir: nonempty("CLAUDE_CONFIG_DIR").map(PathBuf::from),
        }
    }

    /// Codex's home: `CODEX_HOME`, else `~/.codex`.
    pub fn codex_dir(&self) -> Option<PathBuf> {
        self.codex_home
            .clone()
            .or_else(|| self.user_home.as_ref().map(|h| h.join(".codex")))
    }

    /// Claude Code's user settings file, where its hooks live: `$CLAUDE_CONFIG_DIR/settings.json`,
    /// else `~/.claude/settings.json`.
    pub fn claude_settings(&self) -> Option<PathBuf> {
        self.claude_config_dir
            .clone()
            .or_else(|| self.user_home.as_ref().map(|h| h.join(".claude")))
            .map(|d| d.join("settings.json"))
    }

    /// The `claude` executable on `PATH`, if any.
    pub fn claude(&self) -> Option<PathBuf> {
        find_on_path(self.path.as_deref()?, "claude")
    }
}

/// The platform's default home (`MBX_HOME` unset), if the platform has one.
pub fn default_home() -> Option<PathBuf> {
    directories::ProjectDirs::from("", "", "agentmbx").map(|d| d.data_dir().to_path_buf())
}

/// One agentmbx MCP entry found by [`registered`].
#[derive(Debug, Clone)]
pub struct Registration {
    /// The client.
    pub client: Client,
    /// Where: the file, and for Claude Code which scope.
    pub place: String,
    /// The entry, or why the file could not be read.
    pub entry: Result<Entry, String>,
}

/// The agentmbx entries registered with the clients, read from their files only (cheap and
/// bounded; no client is run): Codex's `config.toml`, the `.mcp.json` in [`Context::cwd`], and
/// Claude Code's user scope in `.claude.json` (`$CLAUDE_CONFIG_DIR`, else the home; the file
/// `claude mcp add --scope user` writes: top-level `mcpServers`). A file that does not exist or
/// has no entry adds nothing.
pub fn registered(ctx: &Context) -> Vec<Registration> {
    let mut out = Vec::new();
    let mut look = |client: Client, path: PathBuf, place: String, json: bool| {
        let text = match std::fs::read_to_string(&path) {
            Ok(t) => t,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return,
            Err(e) => {
                out.push(Registration {
                    client,
                    place,
                    entry: Err(format!("cannot read {}: {e}", path.display())),
                });
                return;
            }
        };
        let found = if json {
            mcp_json::find(&text)
        } else {
            codex::find(&text)
        };
        match found {
            Ok(None) => {}
            Ok(Some(e)) => out.push(Registration {
                client,
                place,
                entry: Ok(e),
            }),
            Err(why) => out.push(Registration {
                client,
                place,
                entry: Err(format!("{}: {why}", path.display())),
            }),
        }
    };
    if let Some(dir) = ctx.codex_dir() {
        let p = dir.join("config.toml");
        let place = format!("Codex ({})", p.display());
        look(Client::Codex, p, place, false);
    }
    let claude_json = ctx
        .claude_config_dir
        .as_ref()
        .or(ctx.user_home.as_ref())
        .map(|d| d.join(".claude.json"));
    if let Some(p) = claude_json {
        let place = format!("Claude Code user scope ({})", p.display());
        look(Client::Claude, p, place, true);
    }
    let p = ctx.cwd.join(".mcp.json");
    let place = format!("Claude Code project ({})", p.display());
    look(Client::Claude, p, place, true);
    out
}

/// The first executable file named `name` in the `PATH`-style list `path`.
pub fn find_on_path(path: &std::ffi::OsStr, name: &str) -> Option<PathBuf> {
    std::env::split_paths(path)
        .filter(|d| !d.as_os_str().is_empty())
        .map(|d| d.join(name))
        .find(|p| is_executable(p))
}

#[cfg(unix)]
fn is_executable(p: &Path) -> bool {
    use std::os::unix::fs::PermissionsExt;
    std::fs::metadata(p).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
}

#[cfg(not(unix))]
fn is_executable(p: &Path) -> bool {
    p.is_file()
}

/// What setup should do.
#[derive(Debug, Clone)]
pub struct Request {
    /// The clients to handle (`--only`; all by default).
    pub clients: Vec<Client>,
    /// The entry to register.
    pub spec: ServerSpec,
    /// Remove our entry instead of adding it.
    pub uninstall: bool,
    /// For Claude Code, a project directory whose `.mcp.json` gets the entry instead of the user
    /// scope.
    pub project: Option<PathBuf>,
}

/// How a step is carried out.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Action {
    /// Nothing to do.
    None,
    /// Replace (or create) `path` with `text`, mode `mode` for a new file.
    Write {
        /// The file.
        path: PathBuf,
        /// Its new content.
        text: String,
        /// Mode of a file that did not exist (an existing file keeps its mode).
        mode: u32,
    },
    /// Run `claude` with each argument list in turn.
    Claude {
        /// The `claude` executable.
        exe: PathBuf,
        /// Argument lists (update: remove, then add).
        calls: Vec<Vec<String>>,
    },
}

/// One client's planned step.
#[derive(Debug, Clone, Serialize)]
pub struct Step {
    /// The client.
    pub client: Client,
    /// What the step does (or, after [`apply`], did).
    pub status: Status,
    /// Where: a file path, or `user scope (claude mcp)`.
    pub target: String,
    /// A sentence for the user (why skipped, the conflict, …).
    pub note: Option<String>,
    /// The change as a unified diff (files) or the exact commands (`claude`), empty when none.
    pub change: String,
    /// How to carry it out.
    #[serde(skip)]
    pub action: Action,
}

/// Reads the state of each asked client and decides what setup (or `--uninstall`) would do.
/// Nothing is written; `claude mcp get` is run when `claude` is on `PATH`. Errors: a config
/// file that cannot be read or parsed, or a `claude` call that fails.
pub fn plan(ctx: &Context, req: &Request) -> Vec<Result<Step, SetupError>> {
    req.clients
        .iter()
        .map(|c| match c {
            Client::Claude => plan_claude(ctx, req),
            Client::Codex => plan_codex(ctx, req),
        })
        .collect()
}

/// Carries out `step` (a no-op for a step that changes nothing) and returns its final status.
pub fn apply(step: &Step) -> Result<Status, SetupError> {
    match &step.action {
        Action::None => {}
        Action::Write { path, text, mode } => write_file(path, text, *mode)?,
        Action::Claude { exe, calls } => {
            for args in calls {
                claude::run(exe, args, CLAUDE_TIMEOUT)?;
            }
        }
    }
    Ok(step.status)
}

/// Writes `text` to `path` crash-safely ([`crate::fsutil::replace`]), through a symbolic link
/// to its target (a dotfiles manager's link stays a link), keeping an existing file's mode.
fn write_file(path: &Path, text: &str, new_mode: u32) -> Result<(), SetupError> {
    let io = |source| SetupError::Io {
        path: path.to_path_buf(),
        source,
    };
    let target = match std::fs::canonicalize(path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => path.to_path_buf(),
        Err(e) => return Err(io(e)),
    };
    let mode = file_mode(&target).unwrap_or(new_mode);
    if let Some(dir) = target.parent() {
        std::fs::create_dir_all(dir).map_err(io)?;
    }
    crate::fsutil::replace(&target, text.as_bytes(), mode).map_err(io)
}

#[cfg(unix)]
fn file_mode(p: &Path) -> Option<u32> {
    use std::os::unix::fs::PermissionsExt;
    std::fs::metadata(p)
        .ok()
        .map(|m| m.permissions().mode() & 0o7777)
}

#[cfg(not(unix))]
fn file_mode(_p: &Path) -> Option<u32> {
    None
}

/// Reads `path`: `Ok(None)` when it does not exist.
fn read_optional(path: &Path) -> Result<Option<String>, SetupError> {
    match std::fs::read_to_string(path) {
        Ok(t) => Ok(Some(t)),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(source) => Err(SetupError::Io {
            path: path.to_path_buf(),
            source,
        }),
    }
}

/// A step for a file edit: `before` (absent: empty) → `edited`.
fn file_step(
    client: Client,
    path: &Path,
    before: &str,
    edited: Edited,
    mode: u32,
) -> Result<Step, SetupError> {
    let note = edited.foreign.as_ref().map(|e| {
        format!(
            "an entry named {SERVER_NAME} that setup did not write is there (it runs `{}`): left alone; rename or remove it, then run setup again",
            e.command_line()
        )
    });
    let changes = edited.status.changes();
    Ok(Step {
        client,
        status: edited.status,
        target: path.display().to_string(),
        note,
        change: if changes {
            diff::unified(&path.display().to_string(), before, &edited.text)
        } else {
            String::new()
        },
        action: if changes {
            Action::Write {
                path: path.to_path_buf(),
                text: edited.text,
                mode,
            }
        } else {
            Action::None
        },
    })
}

/// The client-hooks step for `client` ([`client_hooks`]): `agentmbx hook …` for the agent and
/// home of `spec`, added, brought up to date, or (with `uninstall`) removed. Skipped when the
/// client is not installed (Claude Code: neither `claude` on `PATH` nor its settings
/// directory; Codex: no Codex home). Errors: a file that cannot be read or parsed.
pub fn plan_hooks(
    ctx: &Context,
    client: Client,
    spec: &ServerSpec,
    uninstall: bool,
) -> Result<Step, SetupError> {
    let skipped = |target: String, note: String| Step {
        client,
        status: Status::Skipped,
        target,
        note: Some(note),
        change: String::new(),
        action: Action::None,
    };
    let (path, note) = match client {
        Client::Claude => {
            let Some(path) = ctx.claude_settings() else {
                return Ok(skipped(
                    "~/.claude/settings.json".into(),
                    "no home directory known (HOME unset) and no CLAUDE_CONFIG_DIR".into(),
                ));
            };
            let dir_exists = path.parent().is_some_and(Path::is_dir);
            if !dir_exists && ctx.claude().is_none() {
                return Ok(skipped(
                    path.display().to_string(),
                    "Claude Code is not installed here (no `claude` on PATH, no settings directory)"
                        .into(),
                ));
            }
            (path, None)
        }
        Client::Codex => {
            let Some(dir) = ctx.codex_dir().filter(|d| d.is_dir()) else {
                return Ok(skipped(
                    "~/.codex/hooks.json".into(),
                    "Codex is not installed here (no Codex home directory)".into(),
                ));
            };
            let config = read_optional(&dir.join("config.toml"))?.unwrap_or_default();
            let note = (!uninstall && !client_hooks::codex_hooks_enabled(&config)).then(|| {
                format!(
                    "Codex reads hooks.json only with `[features] codex_hooks = true` in {}; add it to turn hooks on",
                    dir.join("config.toml").display()
                )
            });
            (dir.join("hooks.json"), note)
        }
    };
    let before = read_optional(&path)?;
    if before.is_none() && uninstall {
        return Ok(Step {
            client,
            status: Status::Unchanged,
            target: path.display().to_string(),
            note: None,
            change: String::new(),
            action: Action::None,
        });
    }
    let before = before.unwrap_or_default();
    let hook_spec = client_hooks::HookSpec {
        exe: spec.command.clone(),
        cli: match client {
            Client::Claude => "claude",
            Client::Codex => "codex",
        },
        agent: spec.agent().map(str::to_string),
        home: spec
            .env
            .iter()
            .find(|(k, _)| k == crate::paths::HOME_ENV)
            .map(|(_, v)| v.clone()),
    };
    let edited = if uninstall {
        client_hooks::remove(&before)
    } else {
        client_hooks::upsert(&before, &hook_spec)
    }
    .map_err(|why| SetupError::Parse {
        path: path.clone(),
        why,
    })?;
    let mut step = file_step(client, &path, &before, edited, 0o644)?;
    step.note = note;
    Ok(step)
}

fn plan_codex(ctx: &Context, req: &Request) -> Result<Step, SetupError> {
    let skipped = |target: String, note: String| Step {
        client: Client::Codex,
        status: Status::Skipped,
        target,
        note: Some(note),
        change: String::new(),
        action: Action::None,
    };
    let Some(dir) = ctx.codex_dir() else {
        return Ok(skipped(
            "~/.codex".into(),
            "no home directory known (HOME unset) and no CODEX_HOME".into(),
        ));
    };
    if !dir.is_dir() {
        return Ok(skipped(
            dir.display().to_string(),
            format!(
                "Codex is not installed here ({} does not exist); run setup again after installing it",
                dir.display()
            ),
        ));
    }
    let path = dir.join("config.toml");
    let before = read_optional(&path)?.unwrap_or_default();
    let edited = if req.uninstall {
        codex::remove(&before)
    } else {
        codex::upsert(&before, &req.spec)
    }
    .map_err(|why| SetupError::Parse {
        path: path.clone(),
        why,
    })?;
    file_step(
        Client::Codex,
        &path,
        &before,
        edited,
        crate::fsutil::PRIVATE_MODE,
    )
}

fn plan_claude(ctx: &Context, req: &Request) -> Result<Step, SetupError> {
    if let Some(project) = &req.project {
        let path = project.join(".mcp.json");
        let before = read_optional(&path)?;
        if before.is_none() && req.uninstall {
            return Ok(Step {
                client: Client::Claude,
                status: Status::Unchanged,
                target: path.display().to_string(),
                note: Some(format!("{} does not exist", path.display())),
                change: String::new(),
                action: Action::None,
            });
        }
        let before = before.unwrap_or_default();
        let edited = if req.uninstall {
            mcp_json::remove(&before)
        } else {
            mcp_json::upsert(&before, &req.spec)
        }
        .map_err(|why| SetupError::Parse {
            path: path.clone(),
            why,
        })?;
        return file_step(Client::Claude, &path, &before, edited, 0o644);
    }
    let Some(exe) = ctx.claude() else {
        return Ok(Step {
            client: Client::Claude,
            status: Status::Skipped,
            target: "user scope (claude mcp)".into(),
            note: Some(
                "Claude Code is not installed here (no `claude` on PATH); for one project's .mcp.json instead: agentmbx setup --only claude --project DIR"
                    .into(),
            ),
            change: String::new(),
            action: Action::None,
        });
    };
    let current = claude::get(&exe, CLAUDE_TIMEOUT)?;
    claude::plan(&exe, current, &req.spec, req.uninstall)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ours_is_agentmbx_mcp_at_any_path() {
        let a = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        assert!(is_ours("/usr/bin/agentmbx", &a(&["mcp"])));
        assert!(is_ours("/old/place/agentmbx", &a(&["mcp", "--as", "x"])));
        assert!(is_ours("agentmbx", &a(&["mcp"])));
        assert!(!is_ours("/usr/bin/agentmbx", &a(&["daemon"])));
        assert!(!is_ours("/usr/bin/agentmbx", &[]));
        assert!(!is_ours("npx", &a(&["agentmbx", "mcp"])));
        assert!(!is_ours("/usr/bin/agentmbx-other", &a(&["mcp"])));
    }

    #[test]
    fn spec_args_and_env() {
        let s = ServerSpec::new(Path::new("/b/agentmbx"), Some("ana"), Some(Path::new("/h")));
        assert_eq!(s.args, ["mcp", "--as", "ana"]);
        assert_eq!(s.env, [("MBX_HOME".to_string(), "/h".to_string())]);
        assert_eq!(s.agent(), Some("ana"));
        let s = ServerSpec::new(Path::new("/b/agentmbx"), None, None);
        assert_eq!(s.args, ["mcp"]);
        assert!(s.env.is_empty());
        assert_eq!(agent_of(&["mcp".into(), "--as=bo".into()]), Some("bo"));
    }

    #[cfg(unix)]
    #[test]
    fn writes_through_a_symlink_keeping_the_mode() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let real = dir.path().join("dotfiles-config.toml");
        std::fs::write(&real, "a = 1\n").unwrap();
        std::fs::set_permissions(&real, std::fs::Permissions::from_mode(0o640)).unwrap();
        let link = dir.path().join("config.toml");
        std::os::unix::fs::symlink(&real, &link).unwrap();
        write_file(&link, "a = 2\n", 0o600).unwrap();
        assert!(link.symlink_metadata().unwrap().file_type().is_symlink());
        assert_eq!(std::fs::read_to_string(&real).unwrap(), "a = 2\n");
        let mode = std::fs::metadata(&real).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o640);
        let new = dir.path().join("sub/new.toml");
        write_file(&new, "b = 1\n", 0o600).unwrap();
        let mode = std::fs::metadata(&new).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o600);
    }

    #[test]
    fn registered_reads_codex_claude_and_project_files() {
        let dir = tempfile::tempdir().unwrap();
        let home = dir.path().join("home");
        let work = dir.path().join("work");
        std::fs::create_dir_all(home.join(".codex")).unwrap();
        std::fs::create_dir_all(&work).unwrap();
        let ctx = Context {
            user_home: Some(home.clone()),
            codex_home: None,
            path: None,
            cwd: work.clone(),
            claude_config_dir: None,
        };
        assert!(registered(&ctx).is_empty());
        let spec = ServerSpec::new(Path::new("/b/agentmbx"), Some("ana"), None);
        let codex = codex::upsert("# c\n", &spec).unwrap().text;
        std::fs::write(home.join(".codex/config.toml"), codex).unwrap();
        let user = mcp_json::upsert(r#"{"numStartups": 3}"#, &spec)
            .unwrap()
            .text;
        std::fs::write(home.join(".claude.json"), user).unwrap();
        std::fs::write(work.join(".mcp.json"), "{ not json").unwrap();
        let found = registered(&ctx);
        assert_eq!(found.len(), 3, "{found:?}");
        assert_eq!(found[0].client, Client::Codex);
        assert!(found[0].entry.as_ref().unwrap().matches(&spec));
        assert!(found[1].place.starts_with("Claude Code user scope"));
        assert!(found[1].entry.as_ref().unwrap().matches(&spec));
        assert!(found[2]
            .entry
            .as_ref()
            .unwrap_err()
            .contains("not valid JSON"));
    }

    #[test]
    fn find_on_path_needs_an_executable_file() {
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("claude");
        std::fs::write(&f, "#!/bin/sh\n").unwrap();
        let path = std::env::join_paths([dir.path()]).unwrap();
        #[cfg(unix)]
        {
            assert_eq!(find_on_path(&path, "claude"), None);
            use std::os::unix::fs::PermissionsExt;
            std::fs::set_permissions(&f, std::fs::Permissions::from_mode(0o755)).unwrap();
        }
        assert_eq!(find_on_path(&path, "claude"), Some(f));
    }
}
