//! `agentmbx daemon install|uninstall|status`: install the daemon as a user service (systemd
//! user unit on Linux, launchd agent on macOS), remove it, or report its state.
//!
//! `--dry-run` prints the files and the exact commands and runs or writes nothing (`--json`:
//! `{platform, files:[{path, contents}], dirs:[path], removes:[path], commands:[[argv]], notes,
//! config_toml}`). A service does not get this shell's `MBX_*` settings (but `MBX_HOME`):
//! `install` warns about each (on stderr; `--dry-run` lists them as notes) and prints the exact
//! `config.toml` lines that keep them (`config_toml` in the JSON, `null` when none), so a
//! script can append them; nothing is written to `config.toml` by `install`.
//! `--platform` picks the other platform's plan for a dry run. An install whose commands fail
//! puts back the service file it replaced (or removes the one it created), so nothing is left
//! half-installed. `status` reports `unknown` with the reason when no user manager answers;
//! its exit status is 0 when the service runs and 3 otherwise (not installed, stopped,
//! disabled or unknown), as with `systemctl status`. The files themselves come from
//! [`agentmbx::service`]; this file only gathers paths and prints.

use std::path::{Path, PathBuf};

use anyhow::Context;
use clap::{Args, Subcommand, ValueEnum};
use serde_json::json;

use agentmbx::paths::Paths;
use agentmbx::service::{self, Plan, Platform, ServiceSpec, LABEL_ENV};

use super::{NotFoundError, UsageError};

/// `daemon` subcommands (without one, `agentmbx daemon` runs the daemon).
#[derive(Debug, Subcommand)]
pub enum DaemonAction {
    /// Install and start the daemon as a user service (systemd user unit, launchd agent).
    /// The service does not get this shell's MBX_* settings (only MBX_HOME): each one set is
    /// warned about, with the config.toml lines that keep it
    Install(PlanArgs),
    /// Stop the user service and remove its file
    Uninstall(PlanArgs),
    /// Say whether the user service is installed, enabled and running: exit 0 when it runs,
    /// 3 when it does not or no service manager answers (the reason is printed)
    Status(StatusArgs),
}

/// `--platform` values.
#[derive(Debug, Clone, Copy, ValueEnum)]
pub enum PlatformArg {
    /// systemd user unit
    Linux,
    /// launchd agent
    Macos,
}

/// Flags of `daemon install` and `daemon uninstall`.
#[derive(Debug, Args)]
pub struct PlanArgs {
    /// Print the files and commands; write and run nothing
    #[arg(long)]
    pub dry_run: bool,
    /// With --dry-run: print as JSON {platform, files:[{path, contents}], dirs, removes,
    /// commands:[[argv]], notes, config_toml}; config_toml holds the config.toml lines that
    /// keep this shell's MBX_* settings for the service (null when none)
    #[arg(long, requires = "dry_run")]
    pub json: bool,
    /// With --dry-run: the plan for this platform instead of this machine's
    #[arg(long, value_enum, requires = "dry_run")]
    pub platform: Option<PlatformArg>,
}

/// Flags of `daemon status`.
#[derive(Debug, Args)]
pub struct StatusArgs {
    /// Print as JSON {platform, name, file, installed, enabled, active, reason}; reason is
    /// null unless the state is unknown
    #[arg(long)]
    pub json: bool,
}

/// Runs one `daemon` subcommand.
pub fn run(action: DaemonAction) -> anyhow::Result<()> {
    match action {
        DaemonAction::Install(a) => plan_command(a, true),
        DaemonAction::Uninstall(a) => plan_command(a, false),
        DaemonAction::Status(a) => status(a),
    }
}

/// Where the service's facts come from on this machine.
struct Site {
    user_home: PathBuf,
    config_home: Option<PathBuf>,
    file: PathBuf,
    uid: u32,
    user: String,
    label: String,
}

fn platform(arg: Option<PlatformArg>) -> anyhow::Result<Platform> {
    match arg {
        Some(PlatformArg::Linux) => Ok(Platform::Linux),
        Some(PlatformArg::Macos) => Ok(Platform::Macos),
        None => Platform::current().ok_or_else(|| {
            UsageError(
                "no supported service manager on this platform (linux: systemd, macos: launchd)"
                    .into(),
            )
            .into()
        }),
    }
}

fn absolute_env(name: &str) -> Option<PathBuf> {
    std::env::var_os(name)
        .map(PathBuf::from)
        .filter(|p| p.is_absolute())
}

fn gather(platform: Platform) -> anyhow::Result<Site> {
    let user_home = absolute_env("HOME")
        .or_else(|| directories::BaseDirs::new().map(|d| d.home_dir().to_path_buf()))
        .context("cannot determine the user's home directory: set HOME")?;
    let config_home = absolute_env("XDG_CONFIG_HOME");
    let label = service::launchd_label(std::env::var(LABEL_ENV).ok().as_deref());
    let file = service::service_file(platform, &user_home, config_home.as_deref(), &label);
    let uid = uid();
    let user = std::env::var("USER")
        .or_else(|_| std::env::var("LOGNAME"))
        .ok()
        .filter(|u| !u.trim().is_empty())
        .or_else(|| user_name(uid))
        .unwrap_or_default();
    Ok(Site {
        uid,
        user_home,
        config_home,
        file,
        user,
        label,
    })
}

/// This process's real uid.
#[allow(unsafe_code)]
fn uid() -> u32 {
    // SAFETY: getuid has no preconditions and cannot fail.
    unsafe { libc::getuid() }
}

/// The login name of `uid` from the user database (`getpwuid_r`), when it has one.
#[allow(unsafe_code)]
fn user_name(uid: u32) -> Option<String> {
    let mut buf = vec![0 as libc::c_char; 16 * 1024];
    // SAFETY: an all-zero passwd is a valid value for getpwuid_r to fill.
    let mut pwd: libc::passwd = unsafe { std::mem::zeroed() };
    let mut found: *mut libc::passwd = std::ptr::null_mut();
    // SAFETY: every pointer is valid for the call, `buf.len()` is the buffer's real size, and
    // the strings it fills point into `buf`, which outlives their use below.
    let rc = unsafe { libc::getpwuid_r(uid, &mut pwd, buf.as_mut_ptr(), buf.len(), &mut found) };
    if rc != 0 || found.is_null() || pwd.pw_name.is_null() {
        return None;
    }
    // SAFETY: on success pw_name is a NUL-terminated string inside `buf`.
    let name = unsafe { std::ffi::CStr::from_ptr(pwd.pw_name) };
    name.to_str()
        .ok()
        .filter(|n| !n.is_empty())
        .map(str::to_owned)
}

/// The host home the service gets: `MBX_HOME` when set (made absolute), else the data
/// directory of the plan's platform (`~/Library/Application Support/agentmbx` on macOS,
/// `$XDG_DATA_HOME/agentmbx` or `~/.local/share/agentmbx` on Linux), as `directories` gives
/// it on that platform, also when previewing the other platform's plan.
fn data_dir(platform: Platform, ctx: &Site) -> anyhow::Result<PathBuf> {
    let cwd = std::env::current_dir().unwrap_or_default();
    let set = std::env::var_os(agentmbx::paths::HOME_ENV).is_some_and(|v| !v.is_empty());
    if set || Platform::current() == Some(platform) {
        return Ok(cwd.join(Paths::from_env()?.home()));
    }
    Ok(match platform {
        Platform::Macos => ctx.user_home.join("Library/Application Support/agentmbx"),
        Platform::Linux => absolute_env("XDG_DATA_HOME")
            .unwrap_or_else(|| ctx.user_home.join(".local/share"))
            .join("agentmbx"),
    })
}

fn spec(platform: Platform, ctx: &Site) -> anyhow::Result<ServiceSpec> {
    let exe = std::env::current_exe().context("cannot find the agentmbx binary")?;
    let binary = service::service_binary(&exe);
    let data_dir = data_dir(platform, ctx)?;
    Ok(ServiceSpec {
        binary,
        data_dir,
        log_dir: ctx.user_home.join("Library/Logs/agentmbx"),
        label: ctx.label.clone(),
    })
}

fn plan_command(args: PlanArgs, install: bool) -> anyhow::Result<()> {
    let platform = platform(args.platform)?;
    if !args.dry_run && Some(platform) != Platform::current() {
        return Err(UsageError("--platform needs --dry-run".into()).into());
    }
    let ctx = gather(platform)?;
    let plan = if install {
        let spec = spec(platform, &ctx)?;
        let lingering = platform != Platform::Linux || service::lingering(&ctx.user);
        let user = if ctx.user.is_empty() {
            "$USER"
        } else {
            &ctx.user
        };
        let mut plan = service::install_plan(platform, &spec, &ctx.file, ctx.uid, user, lingering);
        plan.notes
            .extend(install_notes(&spec.binary, shell_settings()));
        plan
    } else {
        service::uninstall_plan(platform, &ctx.file, ctx.uid, &ctx.label)
    };
    let keep = if install {
        config_lines(shell_settings())
    } else {
        String::new()
    };
    let config_file = Paths::from_env()
        .map(|p| p.config_file().display().to_string())
        .unwrap_or_else(|_| "config.toml".into());
    if args.dry_run {
        if args.json {
            let mut v = plan_json(&plan);
            v["config_toml"] = if keep.is_empty() {
                serde_json::Value::Null
            } else {
                json!(keep)
            };
            println!("{}", serde_json::to_string_pretty(&v)?);
        } else {
            print!("{}", plan_text(&plan));
            if !keep.is_empty() {
                print!("{}", keep_text(&config_file, &keep, "# "));
            }
        }
        return Ok(());
    }
    if !install && !ctx.file.exists() {
        println!("nothing installed at {}", ctx.file.display());
        let others = service::candidate_files(
            platform,
            &ctx.user_home,
            ctx.config_home.as_deref(),
            &ctx.label,
        );
        for other in others.iter().skip(1).filter(|p| p.exists()) {
            println!(
                "note: {} is installed by a package (or Homebrew), not by `daemon install`; \
                 remove it with the package manager",
                other.display()
            );
        }
        return Ok(());
    }
    let before = if install {
        match std::fs::read(&ctx.file) {
            Ok(bytes) => Some(bytes),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
            Err(e) => return Err(e).with_context(|| format!("cannot read {}", ctx.file.display())),
        }
    } else {
        None
    };
    let tolerated = match plan.apply() {
        Ok(t) => t,
        Err(e) if install => return Err(install_failed(platform, &ctx, before, e)),
        Err(e) => return Err(e.into()),
    };
    for t in &tolerated {
        eprintln!(
            "agentmbx: warning: {} did not succeed ({})",
            t.command, t.reason
        );
    }
    if install {
        println!("installed {} and started the service", ctx.file.display());
    } else if ctx.file.exists() {
        println!("{} is still there", ctx.file.display());
    } else {
        println!("removed {}", ctx.file.display());
    }
    for note in &plan.notes {
        if note.contains("the service does not get it") {
            eprintln!("agentmbx: warning: {note}");
        } else {
            println!("note: {note}");
        }
    }
    if !keep.is_empty() {
        eprint!("{}", keep_text(&config_file, &keep, ""));
    }
    Ok(())
}

/// This shell's `MBX_*` variables (name, value) that a service would not get: every one with
/// a non-empty value but `MBX_HOME` (the service file carries it), `MBX_SERVICE_LABEL` (it
/// names the service) and `MBX_KEYSTORE` (it matters at `init` only; `config.toml` records
/// the choice). Sorted by name.
fn shell_settings() -> Vec<(String, String)> {
    let mut out: Vec<(String, String)> = std::env::vars_os()
        .filter_map(|(k, v)| Some((k.into_string().ok()?, v.into_string().ok()?)))
        .filter(|(k, v)| k.starts_with("MBX_") && !v.is_empty())
        .filter(|(k, _)| {
            ![agentmbx::paths::HOME_ENV, LABEL_ENV, "MBX_KEYSTORE"].contains(&k.as_str())
        })
        .collect();
    out.sort();
    out
}

/// The `config.toml` lines that give a service what `settings` (`MBX_*` name, value) give
/// this shell: top-level keys first, then a `[relay]` table for `MBX_RELAY_URL`; numbers as
/// integers when they parse, `MBX_SELF_ADDRS` as an array, `MBX_NO_MDNS` (not `0`) as
/// `mdns = false`. Variables with no `config.toml` key are left out. Empty when none.
fn config_lines(settings: Vec<(String, String)>) -> String {
    use agentmbx::config::ENV_KEYS;
    let quote = |v: &str| toml::Value::String(v.to_string()).to_string();
    let mut top = String::new();
    let mut relay = String::new();
    for (name, value) in settings {
        let Some(key) = ENV_KEYS.iter().find(|(v, _)| *v == name).map(|(_, k)| *k) else {
            continue;
        };
        let v = value.trim();
        match key {
            "mdns" if v == "0" => {}
            "mdns" => top.push_str("mdns = false\n"),
            "relay_stream" => match v.to_ascii_lowercase().as_str() {
                "0" | "false" | "off" | "no" => top.push_str("relay_stream = false\n"),
                "1" | "true" | "on" | "yes" => top.push_str("relay_stream = true\n"),
                _ => {}
            },
            "api_port" | "lan_port" | "relay_pull_interval_ms" if v.parse::<u64>().is_ok() => {
                top.push_str(&format!("{key} = {v}\n"))
            }
            "self_addrs" => {
                let items: Vec<String> = v
                    .split(',')
                    .map(str::trim)
                    .filter(|a| !a.is_empty())
                    .map(quote)
                    .collect();
                top.push_str(&format!("{key} = [{}]\n", items.join(", ")));
            }
            "relay.url" => relay.push_str(&format!("[relay]\nurl = {}\n", quote(v))),
            _ => top.push_str(&format!("{key} = {}\n", quote(v))),
        }
    }
    top + &relay
}

/// The text that offers `lines` for `config_file`, each line prefixed with `prefix`.
fn keep_text(config_file: &str, lines: &str, prefix: &str) -> String {
    let mut out = format!(
        "{prefix}to give the service these settings, put these lines in {config_file} \
         (replacing the same keys there; `agentmbx config validate` checks it), then restart \
         the service:\n"
    );
    for l in lines.lines() {
        out.push_str(&format!("{prefix}    {l}\n"));
    }
    out
}

/// What to tell the user about the environment of an install: `MBX_*` variables of this
/// shell (`vars`: name and value, as [`shell_settings`] gives them) that the service will not
/// see, with the `config.toml` line that does the same, and a binary inside a cargo `target/`
/// directory (a rebuild or `cargo clean` replaces or removes it under the running service).
fn install_notes(binary: &Path, vars: Vec<(String, String)>) -> Vec<String> {
    let mut notes = Vec::new();
    for (name, value) in vars {
        let key = agentmbx::config::ENV_KEYS
            .iter()
            .find(|(var, _)| *var == name)
            .map(|(_, key)| *key);
        let line = config_lines(vec![(name.clone(), value)]).replace('\n', " ");
        let line = line.trim();
        notes.push(match key {
            Some("mdns") => format!(
                "{name} is set in this shell, but the service does not get it: put \
                 `mdns = false` in config.toml instead"
            ),
            Some(key) => format!(
                "{name} is set in this shell, but the service does not get it: set `{key}` \
                 in config.toml instead (`{line}`)"
            ),
            None => format!("{name} is set in this shell, but the service does not get it"),
        });
    }
    let parts: Vec<String> = binary
        .components()
        .map(|c| c.as_os_str().to_string_lossy().into_owned())
        .collect();
    let in_target = parts.windows(2).any(|w| w[0] == "target")
        && parts.iter().any(|p| p == "debug" || p == "release");
    if in_target {
        notes.push(format!(
            "the service runs {}, a cargo build output: a rebuild replaces it and `cargo clean` \
             removes it; install the binary (e.g. `cargo install --path daemon`) and run \
             `daemon install` with that one",
            binary.display()
        ));
    }
    notes
}

/// The error of an install whose plan failed: the service file it wrote is put back as it
/// was (`before`) or removed, and the message says so and how to go on.
fn install_failed(
    platform: Platform,
    ctx: &Site,
    before: Option<Vec<u8>>,
    err: service::ServiceError,
) -> anyhow::Error {
    let file = ctx.file.display();
    let undone = match &before {
        Some(bytes) => std::fs::write(&ctx.file, bytes)
            .map(|()| format!("{file} is back as it was"))
            .unwrap_or_else(|e| format!("{file} could not be put back ({e}): check it by hand")),
        None => match std::fs::remove_file(&ctx.file) {
            Ok(()) => format!("{file} was removed again"),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => "nothing was written".into(),
            Err(e) => format!(
                "{file} was left behind ({e}); remove it with `rm {}`",
                shell_word(&ctx.file.display().to_string())
            ),
        },
    };
    let no_manager = match &err {
        service::ServiceError::Spawn { .. } => true,
        service::ServiceError::Command { stderr, .. } => {
            let s = stderr.to_ascii_lowercase();
            s.contains("bus") || s.contains("xdg_runtime_dir") || s.contains("connect")
        }
        service::ServiceError::File { .. } => false,
    };
    let hint = match platform {
        Platform::Linux if no_manager => {
            let user = if ctx.user.is_empty() {
                "$USER"
            } else {
                &ctx.user
            };
            format!(
                "; no systemd user manager answered: is a user session bus running (log in \
                 through a normal session, or run `loginctl enable-linger {user}` and log in \
                 again)? Without a service manager, run `agentmbx daemon` in the foreground"
            )
        }
        Platform::Macos if no_manager => {
            "; launchd did not answer (the gui domain needs a logged-in user); without it, run \
             `agentmbx daemon` in the foreground"
                .into()
        }
        _ => String::new(),
    };
    anyhow::anyhow!("cannot install the service: {err}{hint}; {undone}")
}

/// The dry-run JSON of a plan.
fn plan_json(plan: &Plan) -> serde_json::Value {
    json!({
        "platform": plan.platform.as_str(),
        "files": plan.files().iter().map(|f| json!({
            "path": f.path.display().to_string(),
            "contents": f.contents,
        })).collect::<Vec<_>>(),
        "dirs": plan.dirs().iter().map(|p| p.display().to_string()).collect::<Vec<_>>(),
        "removes": plan.removes().iter().map(|p| p.display().to_string()).collect::<Vec<_>>(),
        "commands": plan.commands(),
        "notes": plan.notes,
    })
}

/// A word for a shell command line: quoted with '…' unless it is plain.
fn shell_word(w: &str) -> String {
    let plain = !w.is_empty()
        && w.chars()
            .all(|c| c.is_ascii_alphanumeric() || "-_./:@=+%,".contains(c));
    if plain {
        w.to_string()
    } else {
        format!("'{}'", w.replace('\'', "'\\''"))
    }
}

/// The dry-run text of a plan, steps in order.
fn plan_text(plan: &Plan) -> String {
    let mut out = String::new();
    for step in &plan.steps {
        match step {
            service::Step::Write(f) => {
                out.push_str(&format!("# write {}\n{}", f.path.display(), f.contents));
                if !f.contents.ends_with('\n') {
                    out.push('\n');
                }
            }
            service::Step::Remove(p) => out.push_str(&format!("# remove {}\n", p.display())),
            service::Step::CreateDir(p) => {
                out.push_str(&format!("# create directory {}\n", p.display()))
            }
            service::Step::Run { argv, .. } => {
                let line: Vec<String> = argv.iter().map(|w| shell_word(w)).collect();
                out.push_str(&format!("# run\n{}\n", line.join(" ")));
            }
        }
    }
    for note in &plan.notes {
        out.push_str(&format!("# note: {note}\n"));
    }
    out
}

fn status(args: StatusArgs) -> anyhow::Result<()> {
    let platform = platform(None)?;
    let ctx = gather(platform)?;
    let files = service::candidate_files(
        platform,
        &ctx.user_home,
        ctx.config_home.as_deref(),
        &ctx.label,
    );
    let state = service::service_state(
        platform,
        &files,
        ctx.uid,
        &ctx.label,
        &service::run_query,
        &|p: &Path| p.exists(),
    );
    let file = state.file.as_deref().unwrap_or(&ctx.file);
    let health = state.health();
    let unknown = state.enabled == "unknown" || state.active == "unknown";
    let reason = unknown.then(|| no_manager_reason(platform, &ctx.user));
    if args.json {
        let v = json!({
            "platform": platform.as_str(),
            "name": state.name,
            "file": file.display().to_string(),
            "installed": state.installed,
            "enabled": state.enabled,
            "active": state.active,
            "reason": reason,
        });
        println!("{}", serde_json::to_string_pretty(&v)?);
    } else {
        let installed = if state.installed {
            "installed"
        } else {
            "not installed"
        };
        println!("service: {installed} ({}, {})", state.name, file.display());
        println!("enabled: {}", state.enabled);
        println!("active: {}", state.active);
        if let Some(reason) = &reason {
            println!("reason: {reason}");
        }
    }
    let why = match health {
        service::Health::Running => return Ok(()),
        service::Health::NotInstalled => "the service is not installed (agentmbx daemon install)",
        service::Health::Down => "the service is installed but not running",
        service::Health::Disabled => "the service is installed but not enabled",
        service::Health::Unknown => "the service's state is unknown",
    };
    Err(NotFoundError(why.into()).into())
}

/// Why no service manager answered `daemon status`, with what to do.
fn no_manager_reason(platform: Platform, user: &str) -> String {
    let user = if user.is_empty() { "$USER" } else { user };
    match platform {
        Platform::Linux => {
            let said = std::process::Command::new("systemctl")
                .args(["--user", "is-system-running"])
                .stdin(std::process::Stdio::null())
                .output()
                .map(|o| {
                    String::from_utf8_lossy(&o.stderr)
                        .lines()
                        .next()
                        .unwrap_or_default()
                        .trim()
                        .to_string()
                })
                .unwrap_or_else(|e| format!("cannot run systemctl: {e}"));
            let said = if said.is_empty() {
                String::new()
            } else {
                format!(" ({said})")
            };
            format!(
                "no service manager answered{said}: is a user session bus running? Log in \
                 through a normal session or run `loginctl enable-linger {user}`; or run \
                 `agentmbx daemon` in the foreground"
            )
        }
        Platform::Macos => "no service manager answered: launchctl gave no answer for the \
                            gui domain (is this user logged in?)"
            .into(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_user_name_comes_from_the_user_database() {
        assert_eq!(user_name(0).as_deref(), Some("root"));
    }

    #[test]
    fn shell_settings_become_the_config_toml_lines_that_keep_them() {
        let set = |pairs: &[(&str, &str)]| {
            pairs
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect::<Vec<_>>()
        };
        let lines = config_lines(set(&[
            ("MBX_API_PORT", "7999"),
            ("MBX_LAN_BIND", "0.0.0.0"),
            ("MBX_NO_MDNS", "1"),
            ("MBX_RELAY_PULL_INTERVAL_MS", "2000"),
            ("MBX_RELAY_URL", "https://relay.example.com"),
            ("MBX_SELF_ADDRS", "10.0.0.2, 10.0.0.3"),
            ("MBX_FAILPOINTS", "x"),
        ]));
        assert_eq!(
            lines,
            "api_port = 7999\nlan_bind = \"0.0.0.0\"\nmdns = false\n\
             relay_pull_interval_ms = 2000\nself_addrs = [\"10.0.0.2\", \"10.0.0.3\"]\n\
             [relay]\nurl = \"https://relay.example.com\"\n"
        );
        // The lines are valid TOML that config.toml accepts.
        let v: toml::Table = toml::from_str(&lines).expect("valid TOML");
        assert_eq!(v["api_port"].as_integer(), Some(7999));
        assert_eq!(config_lines(set(&[("MBX_NO_MDNS", "0")])), "");
        let notes = install_notes(
            Path::new("/usr/bin/agentmbx"),
            set(&[("MBX_LAN_PORT", "7400")]),
        );
        assert!(
            notes.iter().any(|n| n.contains("(`lan_port = 7400`)")),
            "{notes:?}"
        );
    }

    #[test]
    fn a_binary_in_a_cargo_target_directory_is_noted() {
        let noted = |p: &str| {
            install_notes(Path::new(p), Vec::new())
                .iter()
                .any(|n| n.contains("a cargo build output"))
        };
        assert!(noted("/src/agentmbx/target/debug/agentmbx"));
        assert!(noted(
            "/src/agentmbx/target/x86_64-unknown-linux-gnu/release/agentmbx"
        ));
        assert!(!noted("/usr/bin/agentmbx"));
        assert!(!noted("/home/ann/.cargo/bin/agentmbx"));
    }
}
