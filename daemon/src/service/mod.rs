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
pub mod notify;
pub mod systemd;

use std::path::{Path, PathBuf};

/// The systemd unit name of the host daemon (`~/.config/systemd/user/agentmbx.service`).
pub const UNIT_NAME: &str = "agentmbx.service";

/// The launchd label of the host daemon (`~/Library/LaunchAgents/org.agentmbx.daemon.plist`).
pub const LAUNCHD_LABEL: &str = "org.agentmbx.daemon";

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
    /// The host home (`MBX_HOME`, resolved): the one directory the daemon writes.
    pub data_dir: PathBuf,
    /// `MBX_HOME` to put into the service's environment: `Some` only when the user set it
    /// explicitly (otherwise the daemon finds the same default by itself).
    pub mbx_home: Option<PathBuf>,
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
/// --user daemon-reload` and `enable --now`, with a note about `loginctl enable-linger` when
/// `lingering` is false (the service would stop at logout). macOS: `launchctl bootstrap
/// gui/<uid> <plist>`.
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
                // ReadWritePaths= must exist before the unit starts.
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
            ]
        }
        Platform::Macos => vec![
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

#[cfg(test)]
mod tests {
    use super::*;

    fn spec() -> ServiceSpec {
        ServiceSpec {
            binary: "/usr/bin/agentmbx".into(),
            data_dir: "/home/ann/.local/share/agentmbx".into(),
            mbx_home: None,
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
            ]
        );
        assert_eq!(plan.notes.len(), 1);
        assert!(plan.notes[0].contains("loginctl enable-linger ann"));
        let lingering = install_plan(Platform::Linux, &spec(), &file, 1000, "ann", true);
        assert!(lingering.notes.is_empty());
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
            Path::new("/Users/ann/Library/LaunchAgents/org.agentmbx.daemon.plist")
        );
        let plan = install_plan(Platform::Macos, &spec(), &file, 501, "ann", false);
        assert!(plan.notes.is_empty());
        assert_eq!(
            plan.commands(),
            vec![
                &argv(&[
                    "launchctl",
                    "bootstrap",
                    "gui/501",
                    "/Users/ann/Library/LaunchAgents/org.agentmbx.daemon.plist"
                ])[..]
            ]
        );
        let un = uninstall_plan(Platform::Macos, &file, 501, LAUNCHD_LABEL);
        assert_eq!(
            un.commands(),
            vec![&argv(&["launchctl", "bootout", "gui/501/org.agentmbx.daemon"])[..]]
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
