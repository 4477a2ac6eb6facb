//! Service integration, black-box: `agentmbx daemon install|uninstall|status` (dry runs in a
//! temporary `HOME`: the files and commands are printed, nothing is written or run), and the
//! sd-notify messages of a real daemon and a real relay, received on a unix datagram socket set
//! as `NOTIFY_SOCKET` (READY after bind, STATUS, WATCHDOG pings, STOPPING on SIGTERM; no
//! ping and an `unhealthy` status once a loop hangs).

use crate::helper;

use std::os::unix::net::UnixDatagram;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::helper::relay_cli::serve;
use crate::helper::{command, http, run, wait_for, Daemon, Home, LISTENING};

/// `agentmbx <args>` for `home` with `HOME` set to `user_home` and no XDG config override.
fn in_user_home(home: &Home, user_home: &Path, args: &[&str]) -> Command {
    let mut cmd = home.command(args);
    cmd.env("HOME", user_home).env_remove("XDG_CONFIG_HOME");
    cmd
}

/// Every file under `dir`, recursively.
fn files_under(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    if let Ok(entries) = std::fs::read_dir(dir) {
        for e in entries.flatten() {
            let p = e.path();
            if p.is_dir() {
                out.extend(files_under(&p));
            }
            out.push(p);
        }
    }
    out
}

fn binary() -> String {
    std::fs::canonicalize(helper::bin())
        .expect("canonical binary path")
        .display()
        .to_string()
}

#[test]
fn install_dry_run_prints_the_unit_and_commands_and_writes_nothing() {
    let home = Home::new();
    let user = tempfile::tempdir().expect("temp dir");
    let out = run(in_user_home(
        &home,
        user.path(),
        &["daemon", "install", "--dry-run"],
    ));
    out.assert_success();
    let unit_path = user.path().join(".config/systemd/user/agentmbx.service");
    let text = &out.stdout;
    assert!(
        text.starts_with(&format!(
            "# create directory {}\n# write {}\n[Unit]\n",
            home.path().display(),
            unit_path.display()
        )),
        "{text}"
    );
    for line in [
        "Type=notify".to_string(),
        "NotifyAccess=main".to_string(),
        format!("ExecStart={} daemon", binary()),
        format!("Environment=MBX_HOME={}", home.path().display()),
        "SystemCallArchitectures=native".to_string(),
        "WatchdogSec=30".to_string(),
        "Restart=on-failure".to_string(),
        "RestartSec=5".to_string(),
        "NoNewPrivileges=yes".to_string(),
        "WantedBy=default.target".to_string(),
        "# run\nsystemctl --user daemon-reload".to_string(),
        "# run\nsystemctl --user enable --now agentmbx.service".to_string(),
        "# run\nsystemctl --user restart agentmbx.service".to_string(),
    ] {
        assert!(
            text.contains(&format!("{line}\n")),
            "missing {line:?} in:\n{text}"
        );
    }
    assert!(
        text.find("daemon-reload") < text.find("enable --now")
            && text.find("enable --now") < text.find("restart"),
        "reload, enable, restart:\n{text}"
    );
    // Mount-namespace options break the unit where user namespaces are blocked.
    for gone in [
        "PrivateTmp",
        "ProtectSystem",
        "ProtectHome",
        "ReadWritePaths",
    ] {
        assert!(!text.contains(gone), "{gone} in:\n{text}");
    }
    assert!(
        files_under(user.path()).is_empty(),
        "nothing written in HOME"
    );
    assert!(!home.path().exists(), "nothing written in MBX_HOME");
}

#[test]
fn install_dry_run_json_for_both_platforms() {
    let home = Home::new();
    let user = tempfile::tempdir().expect("temp dir");
    let linux = run(in_user_home(
        &home,
        user.path(),
        &[
            "daemon",
            "install",
            "--dry-run",
            "--json",
            "--platform",
            "linux",
        ],
    ));
    let v = linux.json();
    assert_eq!(v["platform"], "linux");
    let unit_path = user.path().join(".config/systemd/user/agentmbx.service");
    assert_eq!(v["files"][0]["path"], unit_path.display().to_string());
    assert_eq!(
        v["dirs"],
        serde_json::json!([home.path().display().to_string()])
    );
    assert!(v["files"][0]["contents"]
        .as_str()
        .expect("contents")
        .contains("\nType=notify\n"));
    assert_eq!(
        v["commands"],
        serde_json::json!([
            ["systemctl", "--user", "daemon-reload"],
            ["systemctl", "--user", "enable", "--now", "agentmbx.service"],
            ["systemctl", "--user", "restart", "agentmbx.service"]
        ])
    );

    let mac = run(in_user_home(
        &home,
        user.path(),
        &[
            "daemon",
            "install",
            "--dry-run",
            "--json",
            "--platform",
            "macos",
        ],
    ));
    let v = mac.json();
    assert_eq!(v["platform"], "macos");
    let plist_path = user
        .path()
        .join("Library/LaunchAgents/com.agentmbx.daemon.plist");
    assert_eq!(v["files"][0]["path"], plist_path.display().to_string());
    let commands = v["commands"].as_array().expect("commands");
    assert_eq!(commands.len(), 2);
    assert_eq!(commands[0][1], "bootout");
    assert!(commands[0][2]
        .as_str()
        .expect("target")
        .ends_with("/com.agentmbx.daemon"));
    assert_eq!(commands[1][0], "launchctl");
    assert_eq!(commands[1][1], "bootstrap");
    assert!(commands[1][2].as_str().expect("domain").starts_with("gui/"));
    assert_eq!(commands[1][3], plist_path.display().to_string());
    assert_eq!(
        v["dirs"],
        serde_json::json!([
            user.path()
                .join("Library/Logs/agentmbx")
                .display()
                .to_string(),
            home.path().display().to_string()
        ])
    );
    let contents = v["files"][0]["contents"].as_str().expect("contents");
    let plist = plist::Value::from_reader_xml(contents.as_bytes()).expect("plist parses");
    let dict = plist.as_dictionary().expect("dict");
    let args: Vec<&str> = dict["ProgramArguments"]
        .as_array()
        .expect("array")
        .iter()
        .filter_map(|v| v.as_string())
        .collect();
    assert_eq!(args, vec![binary().as_str(), "daemon"]);
    assert_eq!(
        dict["EnvironmentVariables"].as_dictionary().expect("env")["MBX_HOME"].as_string(),
        Some(home.path().display().to_string().as_str())
    );
    assert!(
        dict["EnvironmentVariables"].as_dictionary().expect("env")["PATH"]
            .as_string()
            .expect("PATH")
            .starts_with("/opt/homebrew/bin:")
    );
    assert!(!dict.contains_key("ProcessType"));
    assert_eq!(dict["RunAtLoad"].as_boolean(), Some(true));

    // MBX_SERVICE_LABEL names the agent (wire.md §8).
    let mut cmd = in_user_home(
        &home,
        user.path(),
        &[
            "daemon",
            "install",
            "--dry-run",
            "--json",
            "--platform",
            "macos",
        ],
    );
    cmd.env("MBX_SERVICE_LABEL", "org.example.mbx");
    let v = run(cmd).json();
    assert_eq!(
        v["files"][0]["path"],
        user.path()
            .join("Library/LaunchAgents/org.example.mbx.plist")
            .display()
            .to_string()
    );
    assert!(files_under(user.path()).is_empty(), "nothing written");
}

#[test]
fn uninstall_dry_run_and_usage_errors() {
    let home = Home::new();
    let user = tempfile::tempdir().expect("temp dir");
    let out = run(in_user_home(
        &home,
        user.path(),
        &[
            "daemon",
            "uninstall",
            "--dry-run",
            "--json",
            "--platform",
            "linux",
        ],
    ));
    let v = out.json();
    let unit_path = user.path().join(".config/systemd/user/agentmbx.service");
    assert_eq!(
        v["removes"],
        serde_json::json!([unit_path.display().to_string()])
    );
    assert_eq!(v["files"], serde_json::json!([]));
    assert_eq!(
        v["commands"][0],
        serde_json::json!([
            "systemctl",
            "--user",
            "disable",
            "--now",
            "agentmbx.service"
        ])
    );

    let mac = run(in_user_home(
        &home,
        user.path(),
        &["daemon", "uninstall", "--dry-run", "--platform", "macos"],
    ));
    mac.assert_success();
    assert!(
        mac.stdout.contains("launchctl bootout gui/"),
        "{}",
        mac.stdout
    );

    // --platform and --json only make sense for a dry run.
    let bad = run(in_user_home(
        &home,
        user.path(),
        &["daemon", "install", "--platform", "macos"],
    ));
    assert_eq!(bad.code(), Some(2), "{bad:?}");
    // The daemon's own flags do not mix with its subcommands.
    let mixed = run(in_user_home(
        &home,
        user.path(),
        &["daemon", "--api-port", "1", "install", "--dry-run"],
    ));
    assert_eq!(mixed.code(), Some(2), "{mixed:?}");
    assert!(files_under(user.path()).is_empty(), "nothing written");
}

#[test]
fn status_reports_not_installed_with_exit_3() {
    let home = Home::new();
    let user = tempfile::tempdir().expect("temp dir");
    let out = run(in_user_home(
        &home,
        user.path(),
        &["daemon", "status", "--json"],
    ));
    assert_eq!(out.code(), Some(3), "not running: {out:#?}");
    let v = out.json();
    assert!(v["enabled"].is_string() && v["active"].is_string(), "{v}");
    assert!(v.get("reason").is_some(), "{v}");
    // A unit from the package on this machine counts as installed; skip the check then.
    let packaged = ["/usr/lib/systemd/user", "/etc/systemd/user"]
        .iter()
        .any(|d| Path::new(d).join("agentmbx.service").exists());
    if !packaged {
        assert_eq!(v["installed"], false, "{v}");
        assert_eq!(
            v["file"],
            user.path()
                .join(".config/systemd/user/agentmbx.service")
                .display()
                .to_string()
        );
    }
}

/// A directory with a `systemctl` that answers like one without a user manager (nothing on
/// stdout, the bus error on stderr, exit 1), for PATH.
fn systemctl_without_bus() -> tempfile::TempDir {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().expect("temp dir");
    let fake = dir.path().join("systemctl");
    std::fs::write(
        &fake,
        "#!/bin/sh\necho 'Failed to connect to bus: No medium found' >&2\nexit 1\n",
    )
    .expect("write fake systemctl");
    std::fs::set_permissions(&fake, std::fs::Permissions::from_mode(0o755)).expect("chmod");
    dir
}

/// `in_user_home` with the fake `systemctl` first on PATH.
fn without_bus(home: &Home, user_home: &Path, bin: &Path, args: &[&str]) -> Command {
    let mut cmd = in_user_home(home, user_home, args);
    let path = std::env::var("PATH").unwrap_or_default();
    cmd.env("PATH", format!("{}:{path}", bin.display()));
    cmd
}

#[test]
fn install_without_a_user_manager_leaves_nothing_and_says_what_to_do() {
    let home = Home::new();
    let user = tempfile::tempdir().expect("temp dir");
    let bin = systemctl_without_bus();
    let unit = user.path().join(".config/systemd/user/agentmbx.service");
    let out = run(without_bus(
        &home,
        user.path(),
        bin.path(),
        &["daemon", "install"],
    ));
    assert_eq!(out.code(), Some(1), "{out:#?}");
    for said in [
        "Failed to connect to bus",
        "loginctl enable-linger",
        "agentmbx daemon` in the foreground",
        "was removed again",
    ] {
        assert!(out.stderr.contains(said), "{said:?}: {out:#?}");
    }
    assert!(!unit.exists(), "no unit left behind");

    // A unit that was there before is put back as it was.
    std::fs::create_dir_all(unit.parent().expect("dir")).expect("mkdir");
    std::fs::write(&unit, "[Unit]\nDescription=mine\n").expect("write");
    let out = run(without_bus(
        &home,
        user.path(),
        bin.path(),
        &["daemon", "install"],
    ));
    assert_eq!(out.code(), Some(1), "{out:#?}");
    assert!(out.stderr.contains("back as it was"), "{out:#?}");
    assert_eq!(
        std::fs::read_to_string(&unit).expect("read"),
        "[Unit]\nDescription=mine\n"
    );

    // status gives the reason and exit 3; --json keeps its shape plus the reason.
    let out = run(without_bus(
        &home,
        user.path(),
        bin.path(),
        &["daemon", "status"],
    ));
    assert_eq!(out.code(), Some(3), "{out:#?}");
    assert!(out.stdout.contains("active: unknown"), "{out:#?}");
    assert!(
        out.stdout.contains("reason: no service manager answered")
            && out.stdout.contains("Failed to connect to bus")
            && out.stdout.contains("loginctl enable-linger"),
        "{out:#?}"
    );
    let out = run(without_bus(
        &home,
        user.path(),
        bin.path(),
        &["daemon", "status", "--json"],
    ));
    assert_eq!(out.code(), Some(3), "{out:#?}");
    let v = out.json();
    assert_eq!(v["installed"], true, "{v}");
    assert_eq!(v["active"], "unknown", "{v}");
    assert!(
        v["reason"]
            .as_str()
            .is_some_and(|r| r.contains("no service manager answered")),
        "{v}"
    );
}

#[test]
fn uninstall_reports_only_what_it_removed() {
    let home = Home::new();
    let user = tempfile::tempdir().expect("temp dir");
    let bin = systemctl_without_bus();
    let unit = user.path().join(".config/systemd/user/agentmbx.service");
    let out = run(without_bus(
        &home,
        user.path(),
        bin.path(),
        &["daemon", "uninstall"],
    ));
    out.assert_success();
    assert!(
        out.stdout
            .starts_with(&format!("nothing installed at {}\n", unit.display())),
        "{out:#?}"
    );
    assert!(!out.stdout.contains("removed"), "{out:#?}");

    std::fs::create_dir_all(unit.parent().expect("dir")).expect("mkdir");
    std::fs::write(&unit, "[Unit]\n").expect("write");
    let out = run(without_bus(
        &home,
        user.path(),
        bin.path(),
        &["daemon", "uninstall"],
    ));
    out.assert_success();
    assert!(
        out.stdout
            .contains(&format!("removed {}\n", unit.display())),
        "{out:#?}"
    );
    assert!(!unit.exists());
}

#[test]
fn install_plan_names_what_the_service_will_not_get() {
    let home = Home::new();
    let user = tempfile::tempdir().expect("temp dir");
    let mut cmd = in_user_home(
        &home,
        user.path(),
        &["daemon", "install", "--dry-run", "--json"],
    );
    cmd.env("MBX_API_PORT", "7999").env("MBX_NO_MDNS", "1");
    let v = run(cmd).json();
    let notes: Vec<&str> = v["notes"]
        .as_array()
        .expect("notes")
        .iter()
        .filter_map(|n| n.as_str())
        .collect();
    let has = |what: &str| notes.iter().any(|n| n.contains(what));
    assert!(
        has("MBX_API_PORT is set in this shell, but the service does not get it: set `api_port` in config.toml"),
        "{notes:#?}"
    );
    assert!(has("MBX_NO_MDNS") && has("`mdns = false`"), "{notes:#?}");
    assert!(!has("MBX_HOME"), "MBX_HOME is carried: {notes:#?}");
    // The exact config.toml lines that keep them, for a script to append.
    assert!(has("(`api_port = 7999`)"), "{notes:#?}");
    let lines = v["config_toml"].as_str().expect("config_toml");
    assert!(
        lines.starts_with("api_port = 7999\n") && lines.contains("\nmdns = false\n"),
        "{v}"
    );
    assert!(
        !lines.contains("MBX_HOME") && !lines.contains("home"),
        "{v}"
    );
    // The text plan shows them too.
    let mut cmd = in_user_home(&home, user.path(), &["daemon", "install", "--dry-run"]);
    cmd.env("MBX_API_PORT", "7999").env("MBX_NO_MDNS", "1");
    let out = run(cmd);
    assert!(
        out.stdout.contains("put these lines in") && out.stdout.contains("#     api_port = 7999\n"),
        "{}",
        out.stdout
    );
    // The tests run the binary from cargo's target directory.
    assert!(has("a cargo build output"), "{notes:#?}");

    // The macOS preview uses the macOS data directory when MBX_HOME is not set.
    let mut cmd = in_user_home(
        &home,
        user.path(),
        &[
            "daemon",
            "install",
            "--dry-run",
            "--json",
            "--platform",
            "macos",
        ],
    );
    cmd.env_remove("MBX_HOME");
    let v = run(cmd).json();
    let data = user.path().join("Library/Application Support/agentmbx");
    assert_eq!(v["dirs"][1], data.display().to_string(), "{v}");
    assert!(
        v["files"][0]["contents"]
            .as_str()
            .expect("contents")
            .contains(&format!("<string>{}</string>", data.display())),
        "{v}"
    );
    assert!(files_under(user.path()).is_empty(), "nothing written");
}

/// One received sd-notify datagram and when it arrived.
#[derive(Debug, Clone)]
struct Message {
    at: Instant,
    text: String,
    /// For `READY=1`: whether the daemon's local API answered `/v1/health` right then.
    api_answered: Option<bool>,
}

/// A unix datagram socket in a temp dir, read by a thread into a shared list. When a READY=1
/// arrives and `api_addr_file` is set, the thread asks the local API at once.
struct NotifySocket {
    _dir: tempfile::TempDir,
    path: PathBuf,
    messages: Arc<Mutex<Vec<Message>>>,
}

impl NotifySocket {
    fn new(api_addr_file: Option<PathBuf>) -> NotifySocket {
        let dir = tempfile::tempdir().expect("temp dir");
        let path = dir.path().join("notify.sock");
        let socket = UnixDatagram::bind(&path).expect("bind notify socket");
        let messages = Arc::new(Mutex::new(Vec::new()));
        let sink = messages.clone();
        std::thread::spawn(move || {
            let mut buf = vec![0u8; 4096];
            while let Ok(n) = socket.recv(&mut buf) {
                let text = String::from_utf8_lossy(&buf[..n]).to_string();
                let at = Instant::now();
                let api_answered = match (&api_addr_file, text.contains("READY=1")) {
                    (Some(file), true) => Some(
                        std::fs::read_to_string(file)
                            .ok()
                            .and_then(|a| a.trim().parse().ok())
                            .is_some_and(|addr| {
                                http(addr, "GET", "/v1/health", None).status == 200
                            }),
                    ),
                    _ => None,
                };
                sink.lock().expect("lock").push(Message {
                    at,
                    text,
                    api_answered,
                });
            }
        });
        NotifySocket {
            _dir: dir,
            path,
            messages,
        }
    }

    fn all(&self) -> Vec<Message> {
        self.messages.lock().expect("lock").clone()
    }

    /// The messages that have a line `line`.
    fn with_line(&self, line: &str) -> Vec<Message> {
        self.all()
            .into_iter()
            .filter(|m| m.text.lines().any(|l| l == line))
            .collect()
    }

    fn wait_line(&self, line: &str, count: usize) -> Vec<Message> {
        wait_for(&format!("{count} sd-notify {line:?}"), || {
            let found = self.with_line(line);
            (found.len() >= count).then_some(found)
        })
    }
}

/// `sh -c 'WATCHDOG_PID=$$ exec agentmbx daemon …'`: the daemon gets its own pid as
/// WATCHDOG_PID, as systemd sets it, with the environment of `home.command`.
fn daemon_under_watchdog(home: &Home, socket: &Path, watchdog_usec: &str) -> Command {
    let base = home.command(&[]);
    let mut cmd = Command::new("sh");
    for (k, v) in base.get_envs() {
        match v {
            Some(v) => cmd.env(k, v),
            None => cmd.env_remove(k),
        };
    }
    cmd.args([
        "-c",
        "WATCHDOG_PID=$$; export WATCHDOG_PID; exec \"$0\" daemon --api-port 0",
        helper::bin(),
    ])
    .env("NOTIFY_SOCKET", socket)
    .env("WATCHDOG_USEC", watchdog_usec)
    .stdin(std::process::Stdio::null());
    cmd
}

#[test]
fn daemon_notifies_ready_after_bind_status_watchdog_and_stopping() {
    let home = Home::new();
    let socket = NotifySocket::new(Some(home.file("api.addr")));
    let daemon = Daemon::spawn(
        daemon_under_watchdog(&home, &socket.path, "2000000"),
        LISTENING,
    )
    .expect("daemon started");

    let ready = socket.wait_line("READY=1", 1);
    assert_eq!(ready.len(), 1, "READY=1 is sent once");
    assert_eq!(
        ready[0].api_answered,
        Some(true),
        "the local API answers when READY=1 arrives"
    );
    assert!(
        ready[0]
            .text
            .lines()
            .any(|l| l == "STATUS=no relay, 0 queued, 0 peers"),
        "{:?}",
        ready[0].text
    );

    // WATCHDOG_USEC=2 s: a ping every second from the liveness check.
    let pings = socket.wait_line("WATCHDOG=1", 3);
    let gap = pings[2].at.duration_since(pings[1].at);
    assert!(
        gap >= Duration::from_millis(500) && gap <= Duration::from_millis(1900),
        "pings about every second, got {gap:?}"
    );
    assert!(pings[0].at >= ready[0].at, "no ping before READY=1");
    assert!(socket.with_line("STOPPING=1").is_empty());

    let (status, log) = daemon.terminate();
    assert_eq!(status.code(), Some(0), "{log}");
    let stopping = socket.wait_line("STOPPING=1", 1);
    assert!(stopping[0].at >= pings[2].at);
    assert!(log.contains("SIGTERM received"), "{log}");
}

/// The `STATUS=` lines of `messages` that start with `prefix`, with their messages.
fn status_lines(messages: &[Message], prefix: &str) -> Vec<(Message, String)> {
    messages
        .iter()
        .flat_map(|m| {
            m.text
                .lines()
                .filter_map(|l| l.strip_prefix("STATUS="))
                .filter(|l| l.starts_with(prefix))
                .map(|l| (m.clone(), l.to_string()))
                .collect::<Vec<_>>()
        })
        .collect()
}

#[test]
fn a_hung_lan_delivery_loop_stops_the_watchdog_pings_and_says_why() {
    let home = Home::new();
    let socket = NotifySocket::new(None);
    let mut cmd = daemon_under_watchdog(&home, &socket.path, "2000000");
    // The LAN delivery loop hangs at its first pass (its task awaits forever, the rest of the
    // daemon runs); every loop's liveness bound is 8 s instead of a minute, far longer than
    // the start-up between the loop's start and the status loop's first tick.
    cmd.env("MBX_FAILPOINTS", "lan:deliver-pass=hang")
        .env("MBX_LIVENESS_MAX_GAP_MS", "8000");
    let mut daemon = Daemon::spawn(cmd, LISTENING).expect("daemon started");
    daemon.wait_for_failpoint("lan:deliver-pass");

    // Pings while the loop is within its bound, then `unhealthy` and why, and no more pings.
    let first_ping = socket.wait_line("WATCHDOG=1", 1)[0].clone();
    let prefix = "unhealthy: lan delivery loop stalled ";
    let unhealthy = wait_for("STATUS=unhealthy", || {
        status_lines(&socket.all(), prefix).first().cloned()
    });
    assert!(first_ping.at < unhealthy.0.at, "{:?}", socket.all());
    let secs: u64 = unhealthy.1[prefix.len()..]
        .strip_suffix(" s")
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("{:?}", unhealthy.1));
    assert!(secs >= 8, "{:?}", unhealthy.1);
    // The next `unhealthy` update comes at least one status interval (5 s, five ticks) later:
    // no ping in between, nor with it.
    let next = wait_for("a second STATUS=unhealthy", || {
        status_lines(&socket.all(), prefix).get(1).cloned()
    });
    let pings_after: Vec<_> = socket
        .with_line("WATCHDOG=1")
        .into_iter()
        .filter(|m| m.at >= unhealthy.0.at)
        .collect();
    assert!(pings_after.is_empty(), "{pings_after:?}");
    assert!(next.0.at > unhealthy.0.at);

    // The hung task would never finish a graceful stop: the manager kills such a daemon.
    let log = daemon.kill();
    assert!(
        log.contains("the lan delivery loop made no progress"),
        "{log}"
    );
}

#[test]
fn a_watchdog_for_another_pid_gets_no_pings() {
    let home = Home::new();
    let socket = NotifySocket::new(None);
    let mut cmd = home.command(&["daemon", "--api-port", "0"]);
    cmd.env("NOTIFY_SOCKET", &socket.path)
        .env("WATCHDOG_USEC", "200000")
        .env("WATCHDOG_PID", "1");
    let daemon = Daemon::spawn(cmd, LISTENING).expect("daemon started");
    socket.wait_line("READY=1", 1);
    // The status loop's first tick (its own STATUS= datagram) is where a ping would go.
    wait_for("the status loop's first tick", || {
        let n = socket
            .all()
            .iter()
            .filter(|m| m.text.lines().any(|l| l.starts_with("STATUS=")))
            .count();
        (n >= 2).then_some(())
    });
    let (status, log) = daemon.terminate();
    assert_eq!(status.code(), Some(0), "{log}");
    socket.wait_line("STOPPING=1", 1);
    assert!(!log.contains("service watchdog on"), "{log}");
    assert!(
        socket.with_line("WATCHDOG=1").is_empty(),
        "{:?}",
        socket.all()
    );
}

#[test]
fn relay_serve_notifies_ready_after_bind_and_stopping_on_sigterm() {
    let tmp = tempfile::tempdir().expect("temp dir");
    let store = tmp.path().join("store");
    std::fs::create_dir(&store).expect("mkdir");
    let socket = NotifySocket::new(None);
    let relay = serve(
        &store,
        &[("NOTIFY_SOCKET", socket.path.to_str().expect("UTF-8 path"))],
    );
    let ready = socket.wait_line("READY=1", 1);
    assert_eq!(
        http(relay.addr, "GET", "/v2/relay/info", None).status,
        200,
        "the relay answers once READY=1 was sent"
    );
    assert!(socket.with_line("STOPPING=1").is_empty());
    let (status, log) = relay.terminate();
    assert_eq!(status.code(), Some(0), "{log}");
    let stopping = socket.wait_line("STOPPING=1", 1);
    assert!(stopping[0].at >= ready[0].at);
    assert!(
        socket.with_line("WATCHDOG=1").is_empty(),
        "no watchdog asked for, no ping: {:?}",
        socket.all()
    );
}

#[test]
fn relay_serve_pings_the_watchdog_while_its_store_writer_answers() {
    let tmp = tempfile::tempdir().expect("temp dir");
    let store = tmp.path().join("store");
    std::fs::create_dir(&store).expect("mkdir");
    let socket = NotifySocket::new(None);
    let relay = serve(
        &store,
        &[
            ("NOTIFY_SOCKET", socket.path.to_str().expect("UTF-8 path")),
            ("WATCHDOG_USEC", "2000000"),
        ],
    );
    let ready = socket.wait_line("READY=1", 1);
    // WATCHDOG_USEC=2 s: a writer check and a ping every second.
    let pings = socket.wait_line("WATCHDOG=1", 3);
    assert!(pings[0].at >= ready[0].at, "no ping before READY=1");
    let (status, log) = relay.terminate();
    assert_eq!(status.code(), Some(0), "{log}");
    assert!(log.contains("service watchdog on"), "{log}");
    assert!(!log.contains("does not answer"), "{log}");
}

#[test]
fn without_notify_socket_the_daemon_runs_as_before() {
    let home = Home::new();
    let mut cmd = command(&["daemon", "--api-port", "0"]);
    cmd.env("MBX_HOME", home.path())
        .env_remove("NOTIFY_SOCKET")
        .env("WATCHDOG_USEC", "200000");
    let daemon = Daemon::spawn(cmd, LISTENING).expect("daemon started");
    assert_eq!(daemon.get("/v1/health", None).status, 200);
    let (status, log) = daemon.terminate();
    assert_eq!(status.code(), Some(0), "{log}");
    assert!(!log.contains("service watchdog on"), "{log}");
}
