//! `agentmbx daemon install|uninstall|status`: install the daemon as a user service (systemd
//! user unit on Linux, launchd agent on macOS), remove it, or report its state.
//!
//! `--dry-run` prints the files and the exact commands and runs or writes nothing (`--json`:
//! `{platform, files:[{path, contents}], dirs:[path], removes:[path], commands:[[argv]], notes}`);
//! `--platform` picks the other platform's plan for a dry run. `status` never fails because
//! no user manager answers: it reports `unknown`. The files themselves come from
//! [`agentmbx::service`]; this file only gathers paths and prints.

use std::path::{Path, PathBuf};

use anyhow::Context;
use clap::{Args, Subcommand, ValueEnum};
use serde_json::json;

use agentmbx::paths::Paths;
use agentmbx::service::{self, Plan, Platform, ServiceSpec, LABEL_ENV};

use super::UsageError;

/// `daemon` subcommands (without one, `agentmbx daemon` runs the daemon).
#[derive(Debug, Subcommand)]
pub enum DaemonAction {
    /// Install and start the daemon as a user service (systemd user unit, launchd agent)
    Install(PlanArgs),
    /// Stop the user service and remove its file
    Uninstall(PlanArgs),
    /// Say whether the user service is installed, enabled and running
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
    /// With --dry-run: print as JSON {platform, files:[{path, contents}], dirs, removes, commands:[[argv]], notes}
    #[arg(long, requires = "dry_run")]
    pub json: bool,
    /// With --dry-run: the plan for this platform instead of this machine's
    #[arg(long, value_enum, requires = "dry_run")]
    pub platform: Option<PlatformArg>,
}

/// Flags of `daemon status`.
#[derive(Debug, Args)]
pub struct StatusArgs {
    /// Print as JSON {platform, name, file, installed, enabled, active}
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
    let user = std::env::var("USER")
        .or_else(|_| std::env::var("LOGNAME"))
        .unwrap_or_default();
    Ok(Site {
        uid: uid(),
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

fn spec(ctx: &Site) -> anyhow::Result<ServiceSpec> {
    let exe = std::env::current_exe().context("cannot find the agentmbx binary")?;
    let binary = service::service_binary(&exe);
    let paths = Paths::from_env()?;
    let cwd = std::env::current_dir().unwrap_or_default();
    let data_dir = cwd.join(paths.home());
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
        let spec = spec(&ctx)?;
        let lingering = platform != Platform::Linux || service::lingering(&ctx.user);
        let user = if ctx.user.is_empty() {
            "$USER"
        } else {
            &ctx.user
        };
        service::install_plan(platform, &spec, &ctx.file, ctx.uid, user, lingering)
    } else {
        service::uninstall_plan(platform, &ctx.file, ctx.uid, &ctx.label)
    };
    if args.dry_run {
        if args.json {
            println!("{}", serde_json::to_string_pretty(&plan_json(&plan))?);
        } else {
            print!("{}", plan_text(&plan));
        }
        return Ok(());
    }
    let tolerated = plan.apply()?;
    for t in &tolerated {
        eprintln!(
            "agentmbx: warning: {} did not succeed ({})",
            t.command, t.reason
        );
    }
    if install {
        println!("installed {} and started the service", ctx.file.display());
    } else {
        println!("removed {}", ctx.file.display());
    }
    for note in &plan.notes {
        println!("note: {note}");
    }
    Ok(())
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
    if args.json {
        let v = json!({
            "platform": platform.as_str(),
            "name": state.name,
            "file": file.display().to_string(),
            "installed": state.installed,
            "enabled": state.enabled,
            "active": state.active,
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
    }
    Ok(())
}
