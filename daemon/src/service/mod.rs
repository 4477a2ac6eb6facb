//! Running the daemon as a user service: the files and commands that install it under the
//! platform's supervisor (a systemd user unit on Linux, a launchd agent on macOS), and the
//! supervisor protocol spoken while it runs ([`notify`], sd-notify).
//!
//! This module owns *generating* the service files from given paths ([`ServiceSpec`]) and the
//! ordered [`Plan`] of steps that installs or removes them; [`Plan::apply`] carries a plan out.
//! Generation is pure (no environment, no I/O), so both platforms' files are built and tested
//! on any OS; only the choice of [`Platform::current`] depends on where it runs. It must never
//! run a command or write a file outside [`Plan::apply`], and never put secrets (keys, the API
//! token) into a service file.

pub mod launchd;
/// The loops' liveness registry sits below the loops it watches: [`crate::liveness`].
pub use crate::liveness;
pub mod notify;
pub mod systemd;

use std::path::{Path, PathBuf};

/// The systemd unit name of the host daemon (`~/.config/systemd/user/agentmbx.service`).
pub const UNIT_NAME: &str = "agentmbx.service";

/// The default launchd label of the host daemon
/// (`~/Library/LaunchAgents/com.agentmbx.daemon.plist`; wire.md §8).
pub const LAUNCHD_LABEL: &str = "com.agentmbx.daemon";

/// The variable that overrides the launchd label (wire.md §8).
pub const LABEL_ENV: &str = "MBX_SERVICE_LABEL";

/// The `PATH` the launchd agent runs with (launchd gives agents a minimal one).
pub const LAUNCHD_PATH: &str = "/opt/homebrew/bin:/usr/local/bin:/usr/bin:/bin:/usr/sbin:/sbin";

/// The launchd label: `label_env` (the value of [`LABEL_ENV`]) when set and non-empty, else
/// [`LAUNCHD_LABEL`].
pub fn launchd_label(label_env: Option<&str>) -> String {
    match label_env.map(str::trim) {
        Some(l) if !l.is_empty() => l.to_string(),
        _ => LAUNCHD_LABEL.to_string(),
    }
}

/// The binary path a service file should start: a Homebrew Cellar path
/// `<prefix>/Cellar/agentmbx/<version>/bin/agentmbx` becomes the stable
/// `<prefix>/opt/agentmbx/bin/agentmbx` (the Cellar path dies at the next upgrade); any
/// other path is kept as given (never canonicalized, so a symlink the user chose stays).
pub fn service_binary(exe: &Path) -> PathBuf {
    let parts: Vec<_> = exe.components().collect();
    let n = parts.len();
    if n >= 5
        && parts[n - 5].as_os_str() == "Cellar"
        && parts[n - 4].as_os_str() == "agentmbx"
        && parts[n - 2].as_os_str() == "bin"
    {
        let prefix: PathBuf = parts[..n - 5].iter().collect();
        return prefix
            .join("opt/agentmbx/bin")
            .join(parts[n - 1].as_os_str());
    }
    exe.to_path_buf()
}

/// Which supervisor a plan targets.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Platform {
    /// A systemd user manager (`systemctl --user`).
    Linux,
    /// launchd, as a per-user agent in the `gui/<uid>` domain.
    Macos,
}

impl Platform {
    /// The platform this binary runs on, if it has a supported supervisor.
    pub fn current() -> Option<Platform> {
        if cfg!(target_os = "linux") {
            Some(Platform::Linux)
        } else if cfg!(target_os = "macos") {
            Some(Platform::Macos)
        } else {
            None
        }
    }

    /// `linux` or `macos`.
    pub fn as_str(self) -> &'static str {
        match self {
            Platform::Linux => "linux",
            Platform::Macos => "macos",
        }
    }
}

/// What a service file is generated from. All paths absolute.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServiceSpec {
    /// The `agentmbx` binary the supervisor starts (`<binary> daemon`).
    pub binary: PathBuf,
    /// The host home (`MBX_HOME`, resolved): the one directory the daemon writes. Always put
    /// into the service's environment as `MBX_HOME`, so the service and the daemon agree.
    pub data_dir: PathBuf,
    /// Where launchd writes the daemon's stdout and stderr (`daemon.log`); systemd uses the
    /// journal.
    pub log_dir: PathBuf,
    /// The launchd label (see [`LAUNCHD_LABEL`]).
    pub label: String,
}

/// One file a plan writes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PlannedFile {
    /// Absolute path.
    pub path: PathBuf,
    /// Full contents (UTF-8 text).
    pub contents: String,
}

/// One step of a plan, in order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Step {
    /// Create the directory and its parents if missing (mode 0700 for the ones created).
    CreateDir(PathBuf),
    /// Create the parent directories and write the file (mode 0644).
    Write(PlannedFile),
    /// Run a command (argv). `must_succeed`: a failure stops the plan; otherwise it is reported
    /// and the plan goes on (e.g. stopping a service that is not loaded).
    Run {
        /// The command and its arguments.
        argv: Vec<String>,
        /// Whether a non-zero exit fails the plan.
        must_succeed: bool,
    },
    /// Remove the file if it exists.
    Remove(PathBuf),
}

/// An ordered list of steps that installs or uninstalls the service, plus notes for the user.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Plan {
    /// The supervisor this plan is for.
    pub platform: Platform,
    /// The steps, in order.
    pub steps: Vec<Step>,
    /// Advice printed after the plan (e.g. `loginctl enable-linger`).
    pub notes: Vec<String>,
}

/// Why a plan could not be carried out.
#[derive(Debug, thiserror::Error)]
pub enum ServiceError {
    /// Writing or removing a file failed.
    #[error("cannot write {path}: {source}")]
    File {
        /// The file.
        path: PathBuf,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// A command could not be started.
    #[error("cannot run {command}: {source}")]
    Spawn {
        /// The command line.
        command: String,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// A command that must succeed exited non-zero.
    #[error("{command} failed ({status}): {stderr}")]
    Command {
        /// The command line.
        command: String,
        /// Its exit status.
        status: String,
        /// The first line of its stderr.
        stderr: String,
    },
}

/// Where the user's service file lives for `platform`, under the user's home `user_home`
/// (`config_home`: `$XDG_CONFIG_HOME` when set, Linux only).
pub fn service_file(
    platform: Platform,
    user_home: &Path,
    config_home: Option<&Path>,
    label: &str,
) -> PathBuf {
    match platform {
        Platform::Linux => config_home
            .map(Path::to_path_buf)
            .unwrap_or_else(|| user_home.join(".config"))
            .join("systemd/user")
            .join(UNIT_NAME),
        Platform::Macos => user_home
            .join("Library/LaunchAgents")
            .join(format!("{label}.plist")),
    }
}

fn argv(parts: &[&str]) -> Vec<String> {
    parts.iter().map(|s| s.to_string()).collect()
}

/// The plan for `daemon install`: write the file, then load and start it. Linux: `systemctl
/// --user daemon-reload`, `enable --now` and `restart` (so a changed unit takes effect), with
/// a note about `loginctl enable-linger` when `lingering` is false (the service would stop at
/// logout). macOS: create the log and data directories, `launchctl bootout gui/<uid>/<label>`
/// (failure tolerated: not loaded yet), then `launchctl bootstrap gui/<uid> <plist>`.
pub fn install_plan(
    platform: Platform,
    spec: &ServiceSpec,
    file: &Path,
    uid: u32,
    user: &str,
    lingering: bool,
) -> Plan {
    let mut notes = Vec::new();
    let steps = match platform {
        Platform::Linux => {
            if !lingering {
                notes.push(format!(
                    "user {user} has no lingering: the service stops at logout and starts at login; \
                     to keep it running, run `loginctl enable-linger {user}`"
                ));
            }
            vec![
                Step::CreateDir(spec.data_dir.clone()),
                Step::Write(PlannedFile {
                    path: file.to_path_buf(),
                    contents: systemd::unit(spec),
                }),
                Step::Run {
                    argv: argv(&["systemctl", "--user", "daemon-reload"]),
                    must_succeed: true,
                },
                Step::Run {
                    argv: argv(&["systemctl", "--user", "enable", "--now", UNIT_NAME]),
                    must_succeed: true,
                },
                Step::Run {
                    argv: argv(&["systemctl", "--user", "restart", UNIT_NAME]),
                    must_succeed: true,
                },
            ]
        }
        Platform::Macos => vec![
            Step::CreateDir(spec.log_dir.clone()),
            Step::CreateDir(spec.data_dir.clone()),
            Step::Run {
                argv: vec![
                    "launchctl".into(),
                    "bootout".into(),
                    format!("gui/{uid}/{}", spec.label),
                ],
                must_succeed: false,
            },
            Step::Write(PlannedFile {
                path: file.to_path_buf(),
                contents: launchd::plist(spec),
            }),
            Step::Run {
                argv: vec![
                    "launchctl".into(),
                    "bootstrap".into(),
                    format!("gui/{uid}"),
                    file.display().to_string(),
                ],
                must_succeed: true,
            },
        ],
    };
    Plan {
        platform,
        steps,
        notes,
    }
}

/// The plan for `daemon uninstall`: stop and unload (tolerating a service that is not
/// loaded), remove the file, and (Linux) reload the user manager.
pub fn uninstall_plan(platform: Platform, file: &Path, uid: u32, label: &str) -> Plan {
    let steps = match platform {
        Platform::Linux => vec![
            Step::Run {
                argv: argv(&["systemctl", "--user", "disable", "--now", UNIT_NAME]),
                must_succeed: false,
            },
            Step::Remove(file.to_path_buf()),
            Step::Run {
                argv: argv(&["systemctl", "--user", "daemon-reload"]),
                must_succeed: false,
            },
        ],
        Platform::Macos => vec![
            Step::Run {
                argv: vec![
                    "launchctl".into(),
                    "bootout".into(),
                    format!("gui/{uid}/{label}"),
                ],
                must_succeed: false,
            },
            Step::Remove(file.to_path_buf()),
        ],
    };
    Plan {
        platform,
        steps,
        notes: Vec::new(),
    }
}

/// What happened to a step that was allowed to fail.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Tolerated {
    /// The command line.
    pub command: String,
    /// Why it did not succeed (exit status or spawn error).
    pub reason: String,
}

impl Plan {
    /// The files the plan writes.
    pub fn files(&self) -> Vec<&PlannedFile> {
        self.steps
            .iter()
            .filter_map(|s| match s {
                Step::Write(f) => Some(f),
                _ => None,
            })
            .collect()
    }

    /// The directories the plan creates.
    pub fn dirs(&self) -> Vec<&Path> {
        self.steps
            .iter()
            .filter_map(|s| match s {
                Step::CreateDir(p) => Some(p.as_path()),
                _ => None,
            })
            .collect()
    }

    /// The files the plan removes.
    pub fn removes(&self) -> Vec<&Path> {
        self.steps
            .iter()
            .filter_map(|s| match s {
                Step::Remove(p) => Some(p.as_path()),
                _ => None,
            })
            .collect()
    }

    /// The commands the plan runs, in order.
    pub fn commands(&self) -> Vec<&[String]> {
        self.steps
            .iter()
            .filter_map(|s| match s {
                Step::Run { argv, .. } => Some(argv.as_slice()),
                _ => None,
            })
            .collect()
    }

    /// Carries the plan out, step by step, stopping at the first step that must succeed and
    /// fails. Returns the tolerated failures. Errors: [`ServiceError`].
    pub fn apply(&self) -> Result<Vec<Tolerated>, ServiceError> {
        let mut tolerated = Vec::new();
        for step in &self.steps {
            match step {
                Step::Write(f) => write_file(f)?,
                Step::CreateDir(dir) => {
                    use std::os::unix::fs::DirBuilderExt;
                    std::fs::DirBuilder::new()
                        .recursive(true)
                        .mode(0o700)
                        .create(dir)
                        .map_err(|source| ServiceError::File {
                            path: dir.clone(),
                            source,
                        })?
                }
                Step::Remove(path) => match std::fs::remove_file(path) {
                    Ok(()) => {}
                    Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                    Err(source) => {
                        return Err(ServiceError::File {
                            path: path.clone(),
                            source,
                        })
                    }
                },
                Step::Run { argv, must_succeed } => {
                    let command = argv.join(" ");
                    let Some((prog, args)) = argv.split_first() else {
                        continue;
                    };
                    match std::process::Command::new(prog)
                        .args(args)
                        .stdin(std::process::Stdio::null())
                        .output()
                    {
                        Ok(out) if out.status.success() => {}
                        Ok(out) => {
                            let stderr = String::from_utf8_lossy(&out.stderr)
                                .lines()
                                .next()
                                .unwrap_or_default()
                                .to_string();
                            if *must_succeed {
                                return Err(ServiceError::Command {
                                    command,
                                    status: out.status.to_string(),
                                    stderr,
                                });
                            }
                            tolerated.push(Tolerated {
                                command,
                                reason: format!("{}: {stderr}", out.status),
                            });
                        }
                        Err(source) => {
                            if *must_succeed {
                                return Err(ServiceError::Spawn { command, source });
                            }
                            tolerated.push(Tolerated {
                                command,
                                reason: source.to_string(),
                            });
                        }
                    }
                }
            }
        }
        Ok(tolerated)
    }
}

fn write_file(f: &PlannedFile) -> Result<(), ServiceError> {
    let err = |source| ServiceError::File {
        path: f.path.clone(),
        source,
    };
    if let Some(dir) = f.path.parent() {
        std::fs::create_dir_all(dir).map_err(err)?;
    }
    crate::fsutil::replace(&f.path, f.contents.as_bytes(), 0o644).map_err(err)
}

/// Whether `user` has lingering enabled (`/var/lib/systemd/linger/<user>` exists).
pub fn lingering(user: &str) -> bool {
    !user.is_empty() && Path::new("/var/lib/systemd/linger").join(user).exists()
}

/// The systemd unit name Homebrew's `brew services` writes for the daemon.
pub const HOMEBREW_UNIT_NAME: &str = "homebrew.agentmbx.service";

/// The launchd label Homebrew's `brew services` uses for the daemon.
pub const HOMEBREW_LABEL: &str = "homebrew.mxcl.agentmbx";

/// What a query command answered: `None` from the runner when it could not be started.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Answer {
    /// Whether it exited 0.
    pub success: bool,
    /// Its stdout (UTF-8, lossy).
    pub stdout: String,
}

/// Runs a query command (stdin closed) and returns its exit and stdout; `None` when it cannot
/// be started.
pub fn run_query(argv: &[&str]) -> Option<Answer> {
    let (prog, args) = argv.split_first()?;
    let out = std::process::Command::new(prog)
        .args(args)
        .stdin(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .output()
        .ok()?;
    Some(Answer {
        success: out.status.success(),
        stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
    })
}

/// The service's state as the supervisor (or, failing that, the file system) reports it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServiceState {
    /// The unit name or launchd label the state is about (ours, or Homebrew's when that is
    /// the one installed).
    pub name: String,
    /// The service file found, if any (the user's, the package's or Homebrew's).
    pub file: Option<PathBuf>,
    /// Whether the service is installed: the supervisor knows it, or a file exists.
    pub installed: bool,
    /// systemd's `is-enabled` word (`enabled`, `disabled`, `not-found`, ...), launchd's
    /// `loaded`/`not-loaded`, or `unknown` when no supervisor answered.
    pub enabled: String,
    /// systemd's `is-active` word (`active`, `inactive`, `failed`, ...), launchd's
    /// `active`/`inactive`, or `unknown`.
    pub active: String,
}

/// How the doctor judges a [`ServiceState`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Health {
    /// Not installed.
    NotInstalled,
    /// Enabled (or loaded) and active.
    Running,
    /// Enabled (or loaded) but inactive or failed.
    Down,
    /// Installed but not enabled.
    Disabled,
    /// No supervisor answered: only the file is known.
    Unknown,
}

impl ServiceState {
    /// Whether the supervisor says the service starts by itself.
    pub fn is_enabled(&self) -> bool {
        matches!(
            self.enabled.as_str(),
            "enabled" | "enabled-runtime" | "linked" | "linked-runtime" | "alias" | "loaded"
        )
    }

    /// The verdict: see [`Health`].
    pub fn health(&self) -> Health {
        if !self.installed {
            Health::NotInstalled
        } else if self.enabled == "unknown" || self.active == "unknown" {
            Health::Unknown
        } else if !self.is_enabled() {
            Health::Disabled
        } else if self.active == "active" {
            Health::Running
        } else {
            Health::Down
        }
    }
}

fn first_word(text: &str) -> Option<String> {
    let line = text.lines().next()?.trim();
    (!line.is_empty() && !line.contains(' ')).then(|| line.to_string())
}

/// The files a service of `platform` can be installed as: the user's file for `label`, the
/// Debian package's user unit (`/usr/lib/systemd/user`, `/etc/systemd/user`) and Homebrew's.
pub fn candidate_files(
    platform: Platform,
    user_home: &Path,
    config_home: Option<&Path>,
    label: &str,
) -> Vec<PathBuf> {
    let user = service_file(platform, user_home, config_home, label);
    match platform {
        Platform::Linux => {
            let dir = user.parent().map(Path::to_path_buf).unwrap_or_default();
            vec![
                user,
                PathBuf::from("/etc/systemd/user").join(UNIT_NAME),
                PathBuf::from("/usr/lib/systemd/user").join(UNIT_NAME),
                dir.join(HOMEBREW_UNIT_NAME),
            ]
        }
        Platform::Macos => vec![
            user,
            user_home
                .join("Library/LaunchAgents")
                .join(format!("{HOMEBREW_LABEL}.plist")),
        ],
    }
}

/// The service's state: asks the supervisor through `run` (systemd: `systemctl --user
/// is-enabled` and `is-active` for [`UNIT_NAME`], then [`HOMEBREW_UNIT_NAME`]; launchd:
/// `launchctl print gui/<uid>/<label>`, then [`HOMEBREW_LABEL`]) and, when none answers,
/// falls back to whether one of `files` exists (`exists`), with `unknown` state. Used by
/// `daemon status` and the doctor's `service` check.
pub fn service_state(
    platform: Platform,
    files: &[PathBuf],
    uid: u32,
    label: &str,
    run: &dyn Fn(&[&str]) -> Option<Answer>,
    exists: &dyn Fn(&Path) -> bool,
) -> ServiceState {
    let file = files.iter().find(|f| exists(f)).cloned();
    let names: Vec<String> = match platform {
        Platform::Linux => vec![UNIT_NAME.into(), HOMEBREW_UNIT_NAME.into()],
        Platform::Macos => vec![label.into(), HOMEBREW_LABEL.into()],
    };
    let mut answered: Vec<(String, String, String)> = Vec::new();
    for name in &names {
        let (enabled, active) = match platform {
            Platform::Linux => {
                let ask = |verb: &str| {
                    run(&["systemctl", "--user", verb, name]).and_then(|a| first_word(&a.stdout))
                };
                // `is-active` prints a word whenever the manager answers (`inactive` for an
                // unknown unit); `is-enabled` prints nothing or `not-found` for one.
                let Some(active) = ask("is-active") else {
                    continue;
                };
                let enabled = ask("is-enabled").unwrap_or_else(|| "not-found".into());
                (enabled, active)
            }
            Platform::Macos => {
                let target = format!("gui/{uid}/{name}");
                match run(&["launchctl", "print", &target]) {
                    Some(a) if a.success => {
                        let running = a.stdout.lines().any(|l| l.trim() == "state = running");
                        let active = if running { "active" } else { "inactive" };
                        ("loaded".to_string(), active.to_string())
                    }
                    Some(_) => ("not-loaded".into(), "inactive".into()),
                    None => continue,
                }
            }
        };
        answered.push((name.clone(), enabled, active));
    }
    let known = |e: &str| e != "not-found" && e != "not-loaded";
    if let Some((name, enabled, active)) = answered
        .iter()
        .find(|(_, e, _)| known(e))
        .or_else(|| answered.first())
        .cloned()
    {
        return ServiceState {
            installed: known(&enabled) || file.is_some(),
            name,
            file,
            enabled,
            active,
        };
    }
    ServiceState {
        name: names[0].clone(),
        installed: file.is_some(),
        file,
        enabled: "unknown".into(),
        active: "unknown".into(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec() -> ServiceSpec {
        ServiceSpec {
            binary: "/usr/bin/agentmbx".into(),
            data_dir: "/home/ann/.local/share/agentmbx".into(),
            log_dir: "/home/ann/Library/Logs/agentmbx".into(),
            label: LAUNCHD_LABEL.into(),
        }
    }

    #[test]
    fn linux_install_writes_then_reloads_and_enables_and_notes_linger() {
        let file = service_file(Platform::Linux, Path::new("/home/ann"), None, LAUNCHD_LABEL);
        assert_eq!(
            file,
            Path::new("/home/ann/.config/systemd/user/agentmbx.service")
        );
        let plan = install_plan(Platform::Linux, &spec(), &file, 1000, "ann", false);
        assert!(matches!(&plan.steps[0], Step::CreateDir(d) if d == &spec().data_dir));
        assert_eq!(plan.files().len(), 1);
        assert_eq!(plan.files()[0].path, file);
        assert_eq!(
            plan.commands(),
            vec![
                &argv(&["systemctl", "--user", "daemon-reload"])[..],
                &argv(&["systemctl", "--user", "enable", "--now", "agentmbx.service"])[..],
                &argv(&["systemctl", "--user", "restart", "agentmbx.service"])[..],
            ]
        );
        assert_eq!(plan.notes.len(), 1);
        assert!(plan.notes[0].contains("loginctl enable-linger ann"));
        let lingering = install_plan(Platform::Linux, &spec(), &file, 1000, "ann", true);
        assert!(lingering.notes.is_empty());
    }

    #[test]
    fn label_env_overrides_the_default_label() {
        assert_eq!(launchd_label(None), "com.agentmbx.daemon");
        assert_eq!(launchd_label(Some("")), "com.agentmbx.daemon");
        assert_eq!(launchd_label(Some("org.example.mbx")), "org.example.mbx");
    }

    #[test]
    fn homebrew_cellar_binary_maps_to_opt() {
        assert_eq!(
            service_binary(Path::new(
                "/opt/homebrew/Cellar/agentmbx/0.6.0/bin/agentmbx"
            )),
            Path::new("/opt/homebrew/opt/agentmbx/bin/agentmbx")
        );
        assert_eq!(
            service_binary(Path::new(
                "/home/linuxbrew/.linuxbrew/Cellar/agentmbx/HEAD-abc1234/bin/agentmbx"
            )),
            Path::new("/home/linuxbrew/.linuxbrew/opt/agentmbx/bin/agentmbx")
        );
        for kept in [
            "/usr/bin/agentmbx",
            "/home/ann/.local/bin/agentmbx",
            "/opt/Cellar/other/1/bin/agentmbx",
        ] {
            assert_eq!(service_binary(Path::new(kept)), Path::new(kept));
        }
    }

    fn canned<'a>(
        answers: &'a [(&'a str, bool, &'a str)],
    ) -> impl Fn(&[&str]) -> Option<Answer> + 'a {
        move |argv: &[&str]| {
            let line = argv.join(" ");
            answers
                .iter()
                .find(|(cmd, _, _)| *cmd == line)
                .map(|(_, success, stdout)| Answer {
                    success: *success,
                    stdout: stdout.to_string(),
                })
        }
    }

    fn files() -> Vec<PathBuf> {
        candidate_files(Platform::Linux, Path::new("/home/ann"), None, LAUNCHD_LABEL)
    }

    #[test]
    fn state_of_a_packaged_unit_comes_from_systemctl() {
        let run = canned(&[
            (
                "systemctl --user is-active agentmbx.service",
                true,
                "active\n",
            ),
            (
                "systemctl --user is-enabled agentmbx.service",
                true,
                "enabled\n",
            ),
            (
                "systemctl --user is-active homebrew.agentmbx.service",
                false,
                "inactive\n",
            ),
        ]);
        let exists = |p: &Path| p == Path::new("/usr/lib/systemd/user/agentmbx.service");
        let s = service_state(
            Platform::Linux,
            &files(),
            1000,
            LAUNCHD_LABEL,
            &run,
            &exists,
        );
        assert_eq!(s.name, "agentmbx.service");
        assert!(s.installed);
        assert_eq!(
            s.file.as_deref(),
            Some(Path::new("/usr/lib/systemd/user/agentmbx.service"))
        );
        assert_eq!(
            (s.enabled.as_str(), s.active.as_str()),
            ("enabled", "active")
        );
        assert_eq!(s.health(), Health::Running);
    }

    #[test]
    fn enabled_but_failed_is_down_and_homebrew_unit_is_seen() {
        let run = canned(&[
            (
                "systemctl --user is-active agentmbx.service",
                false,
                "inactive\n",
            ),
            (
                "systemctl --user is-enabled agentmbx.service",
                false,
                "not-found\n",
            ),
            (
                "systemctl --user is-active homebrew.agentmbx.service",
                false,
                "failed\n",
            ),
            (
                "systemctl --user is-enabled homebrew.agentmbx.service",
                true,
                "enabled\n",
            ),
        ]);
        let s = service_state(
            Platform::Linux,
            &files(),
            1000,
            LAUNCHD_LABEL,
            &run,
            &|_| false,
        );
        assert_eq!(s.name, "homebrew.agentmbx.service");
        assert!(s.installed);
        assert_eq!(s.health(), Health::Down);
    }

    #[test]
    fn nothing_installed_and_no_manager() {
        let run = canned(&[
            (
                "systemctl --user is-active agentmbx.service",
                false,
                "inactive\n",
            ),
            (
                "systemctl --user is-active homebrew.agentmbx.service",
                false,
                "inactive\n",
            ),
        ]);
        let s = service_state(
            Platform::Linux,
            &files(),
            1000,
            LAUNCHD_LABEL,
            &run,
            &|_| false,
        );
        assert!(!s.installed);
        assert_eq!(s.enabled, "not-found");
        assert_eq!(s.health(), Health::NotInstalled);

        // No user manager: systemctl prints nothing on stdout; the file decides.
        let silent = canned(&[
            ("systemctl --user is-active agentmbx.service", false, ""),
            ("systemctl --user is-enabled agentmbx.service", false, ""),
        ]);
        let user_file = Path::new("/home/ann/.config/systemd/user/agentmbx.service");
        let s = service_state(
            Platform::Linux,
            &files(),
            1000,
            LAUNCHD_LABEL,
            &silent,
            &|p| p == user_file,
        );
        assert!(s.installed);
        assert_eq!(
            (s.enabled.as_str(), s.active.as_str()),
            ("unknown", "unknown")
        );
        assert_eq!(s.health(), Health::Unknown);
        let s = service_state(
            Platform::Linux,
            &files(),
            1000,
            LAUNCHD_LABEL,
            &silent,
            &|_| false,
        );
        assert_eq!(s.health(), Health::NotInstalled);
    }

    #[test]
    fn launchd_state_from_launchctl_print() {
        let files = candidate_files(
            Platform::Macos,
            Path::new("/Users/ann"),
            None,
            LAUNCHD_LABEL,
        );
        let run = canned(&[
            ("launchctl print gui/501/com.agentmbx.daemon", false, ""),
            (
                "launchctl print gui/501/homebrew.mxcl.agentmbx",
                true,
                "gui/501/homebrew.mxcl.agentmbx = {\n\tstate = running\n}\n",
            ),
        ]);
        let s = service_state(Platform::Macos, &files, 501, LAUNCHD_LABEL, &run, &|_| {
            false
        });
        assert_eq!(s.name, "homebrew.mxcl.agentmbx");
        assert_eq!(s.health(), Health::Running);
        let none = canned(&[]);
        let s = service_state(Platform::Macos, &files, 501, LAUNCHD_LABEL, &none, &|p| {
            p == Path::new("/Users/ann/Library/LaunchAgents/com.agentmbx.daemon.plist")
        });
        assert_eq!(s.health(), Health::Unknown);
    }

    #[test]
    fn xdg_config_home_is_honoured() {
        let file = service_file(
            Platform::Linux,
            Path::new("/home/ann"),
            Some(Path::new("/cfg")),
            LAUNCHD_LABEL,
        );
        assert_eq!(file, Path::new("/cfg/systemd/user/agentmbx.service"));
    }

    #[test]
    fn macos_install_and_uninstall_use_the_gui_domain() {
        let file = service_file(
            Platform::Macos,
            Path::new("/Users/ann"),
            None,
            LAUNCHD_LABEL,
        );
        assert_eq!(
            file,
            Path::new("/Users/ann/Library/LaunchAgents/com.agentmbx.daemon.plist")
        );
        let plan = install_plan(Platform::Macos, &spec(), &file, 501, "ann", false);
        assert!(plan.notes.is_empty());
        assert_eq!(
            plan.dirs(),
            vec![
                Path::new("/home/ann/Library/Logs/agentmbx"),
                Path::new("/home/ann/.local/share/agentmbx")
            ]
        );
        assert_eq!(
            plan.commands(),
            vec![
                &argv(&["launchctl", "bootout", "gui/501/com.agentmbx.daemon"])[..],
                &argv(&[
                    "launchctl",
                    "bootstrap",
                    "gui/501",
                    "/Users/ann/Library/LaunchAgents/com.agentmbx.daemon.plist"
                ])[..]
            ]
        );
        assert!(matches!(
            &plan.steps[2],
            Step::Run {
                must_succeed: false,
                ..
            }
        ));
        let un = uninstall_plan(Platform::Macos, &file, 501, LAUNCHD_LABEL);
        assert_eq!(
            un.commands(),
            vec![&argv(&["launchctl", "bootout", "gui/501/com.agentmbx.daemon"])[..]]
        );
        assert_eq!(un.removes(), vec![file.as_path()]);
    }

    #[test]
    fn apply_writes_and_removes_and_tolerates_optional_failures() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("a/b/x.service");
        let plan = Plan {
            platform: Platform::Linux,
            steps: vec![
                Step::Write(PlannedFile {
                    path: path.clone(),
                    contents: "hello\n".into(),
                }),
                Step::Run {
                    argv: argv(&["false"]),
                    must_succeed: false,
                },
            ],
            notes: vec![],
        };
        let tolerated = plan.apply().expect("apply");
        assert_eq!(tolerated.len(), 1);
        assert_eq!(tolerated[0].command, "false");
        assert_eq!(std::fs::read_to_string(&path).expect("read"), "hello\n");
        let un = Plan {
            platform: Platform::Linux,
            steps: vec![
                Step::Remove(path.clone()),
                Step::Run {
                    argv: argv(&["false"]),
                    must_succeed: true,
                },
            ],
            notes: vec![],
        };
        assert!(matches!(un.apply(), Err(ServiceError::Command { .. })));
        assert!(!path.exists());
    }
}
