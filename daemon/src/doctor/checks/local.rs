//! Local checks: config, host identity, key store, outbox, quarantine, service and disk space.
//! They read files and `mailbox.db` only; with `--fix` the identity and key store checks apply
//! the safe local fixes (home 0700, key files 0600) and say so. A fix changes a mode only on a
//! file or directory the current user owns, and never on a sticky directory (a shared one such
//! as `/tmp`): those are reported with their full mode and left alone.

use std::path::{Path, PathBuf};

use super::super::{shell_path, Facts, Outcome, Status};
use crate::keystore::{self, Backend};

/// Pending rows older than this are stuck (ms): 1 hour.
pub const STUCK_AFTER_MS: i64 = 3_600_000;
/// Free space below this warns (bytes): 1 GiB.
pub const DISK_WARN_BYTES: u64 = 1 << 30;
/// Free space below this fails (bytes): 100 MiB.
pub const DISK_FAIL_BYTES: u64 = 100 << 20;

/// The sticky bit of a mode.
const STICKY: u32 = 0o1000;

/// The permission bits of `path`, with setuid, setgid and sticky (`mode & 0o7777`).
#[cfg(unix)]
fn mode(path: &Path) -> Option<u32> {
    use std::os::unix::fs::PermissionsExt;
    std::fs::metadata(path)
        .ok()
        .map(|m| m.permissions().mode() & 0o7777)
}

#[cfg(not(unix))]
fn mode(_path: &Path) -> Option<u32> {
    None
}

/// Why `--fix` must leave `path` (mode `m`) alone: it is sticky (shared) or another user owns
/// it; `None` when it may change the mode.
#[cfg(unix)]
fn not_ours(path: &Path, m: u32) -> Option<String> {
    use std::os::unix::fs::MetadataExt;
    if m & STICKY != 0 {
        return Some(format!(
            "{} is a sticky, shared directory (mode {m:04o}): --fix leaves it alone; give this host a private MBX_HOME",
            path.display()
        ));
    }
    #[allow(unsafe_code)]
    // SAFETY: geteuid has no preconditions and cannot fail.
    let me = unsafe { libc::geteuid() };
    match std::fs::metadata(path) {
        Ok(md) if md.uid() == me => None,
        Ok(md) => Some(format!(
            "{} belongs to uid {}, not to this user (uid {me}): --fix leaves it alone",
            path.display(),
            md.uid()
        )),
        Err(e) => Some(format!("cannot read {}: {e}", path.display())),
    }
}

#[cfg(not(unix))]
fn not_ours(_path: &Path, _m: u32) -> Option<String> {
    None
}

#[cfg(unix)]
fn set_mode(path: &Path, mode: u32) -> std::io::Result<()> {
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode))
}

#[cfg(not(unix))]
fn set_mode(_path: &Path, _mode: u32) -> std::io::Result<()> {
    Ok(())
}

/// `config`: `config.toml` (with the environment) loads; `fail` with the reason and the
/// `agentmbx config validate` fix when it does not.
pub fn config(f: &Facts) -> Result<Outcome, String> {
    let file = f.paths.config_file();
    if let Some(why) = f.config_invalid() {
        return Ok(Outcome::new(Status::Fail, "config.toml is invalid")
            .detail(why.to_string())
            .detail(format!(
                "edit {} (or the MBX_* variable named); the fix command names the key and line",
                file.display()
            ))
            .fix("agentmbx config validate"));
    }
    Ok(match (&f.config, file.exists()) {
        (Err(_), _) => Outcome::new(Status::Skip, "this host is not initialized"),
        (Ok(_), true) => Outcome::new(Status::Ok, format!("{} loads", file.display())),
        (Ok(_), false) => Outcome::new(Status::Ok, "no config.toml: the defaults apply"),
    })
}

/// `host-identity`: the home exists (0700) and holds an identity; its name and key fingerprint.
pub fn host_identity(f: &Facts) -> Result<Outcome, String> {
    let home = f.paths.home();
    if !home.exists() {
        if f.opts.fix {
            f.paths.ensure_home().map_err(|e| e.to_string())?;
            return Ok(Outcome::new(Status::Fail, "this host is not initialized")
                .detail(format!("fixed: created {} (0700)", home.display()))
                .fix("agentmbx init"));
        }
        return Ok(Outcome::new(
            Status::Fail,
            format!(
                "this host is not initialized ({} does not exist)",
                home.display()
            ),
        )
        .fix("agentmbx init"));
    }
    if !crate::identity::is_initialized(&f.paths) {
        return Ok(Outcome::new(Status::Fail, "this host is not initialized").fix("agentmbx init"));
    }
    if f.config_invalid().is_some() {
        return Ok(super::config_skip());
    }
    let me = f
        .identity
        .as_ref()
        .map_err(|e| format!("cannot load the identity: {e}"))?;
    let mut out = Outcome::new(
        Status::Ok,
        format!("host {} with key {}", me.host, me.fingerprint),
    );
    if let Some(m) = mode(home).filter(|m| m & 0o077 != 0) {
        let refuse = not_ours(home, m);
        if f.opts.fix && refuse.is_none() {
            set_mode(home, 0o700).map_err(|e| format!("cannot chmod the home: {e}"))?;
            out = out.detail(format!("fixed: {} was {m:04o}, now 0700", home.display()));
        } else {
            out.status = Some(Status::Warn);
            out = out.detail(format!(
                "{} is mode {m:04o}, other users can read it",
                home.display()
            ));
            match refuse {
                Some(why) => out = out.detail(why),
                None => {
                    out = out
                        .detail("or: agentmbx doctor --fix")
                        .fix(format!("chmod 700 {}", shell_path(home)));
                }
            }
        }
    }
    Ok(out)
}

/// `keystore`: where the private keys are, and that key files are 0600.
pub fn keystore(f: &Facts) -> Result<Outcome, String> {
    let Some(backend) = keystore::recorded(&f.paths) else {
        return Ok(Outcome::new(Status::Skip, "this host is not initialized"));
    };
    match backend {
        Backend::Keyring => {
            let mut out = Outcome::new(Status::Ok, "private keys in the OS keyring");
            if f.config_invalid().is_some() {
                out = super::config_skip();
            } else if let Err(e) = &f.identity {
                out = Outcome::new(Status::Fail, "the OS keyring does not give the keys")
                    .detail(e.clone())
                    .detail(
                        "unlock the OS keyring (login keychain / Secret Service) and run again",
                    );
            }
            Ok(out)
        }
        Backend::File => {
            let mut out =
                Outcome::new(Status::Ok, "private keys in 0600 files (host.key, enc.key)");
            let mut loose = Vec::new();
            for path in [f.paths.host_key(), f.paths.enc_key()] {
                match mode(&path) {
                    Some(m) if m & 0o077 != 0 => loose.push((path, m)),
                    Some(_) => {}
                    None if cfg!(unix) => {
                        return Ok(Outcome::new(
                            Status::Fail,
                            format!("{} is missing", path.display()),
                        ))
                    }
                    None => {}
                }
            }
            let mut to_fix = Vec::new();
            for (path, m) in loose {
                let refuse = not_ours(&path, m);
                if f.opts.fix && refuse.is_none() {
                    set_mode(&path, 0o600)
                        .map_err(|e| format!("cannot chmod {}: {e}", path.display()))?;
                    out = out.detail(format!("fixed: {} was {m:04o}, now 0600", path.display()));
                } else {
                    out.status = Some(Status::Fail);
                    out.summary = "a private key file is readable by others".into();
                    out = out.detail(format!("{} is mode {m:04o}", path.display()));
                    match refuse {
                        Some(why) => out = out.detail(why),
                        None => to_fix.push(shell_path(&path)),
                    }
                }
            }
            if !to_fix.is_empty() {
                out = out
                    .detail("or: agentmbx doctor --fix")
                    .fix(format!("chmod 600 {}", to_fix.join(" ")));
            }
            if let (Err(e), Some(Status::Ok)) = (&f.identity, out.status) {
                out = if f.config_invalid().is_some() {
                    super::config_skip()
                } else {
                    Outcome::new(Status::Fail, "the key files cannot be loaded").detail(e.clone())
                };
            }
            Ok(out)
        }
    }
}

/// `outbox`: stuck pending rows, and per the configured relay the rows waiting for a receipt,
/// to push again, expired and unconfirmed (`wire.md` §7 item 10); last, the route of each peer
/// with mail queued or a LAN address marked as not answering (`peer_routes`).
pub fn outbox(f: &Facts) -> Result<Outcome, String> {
    let Some(m) = &f.mailbox else {
        return Ok(Outcome::new(Status::Skip, "no mailbox.db yet"));
    };
    let cutoff = f.opts.now_ms - STUCK_AFTER_MS;
    let url = f.relay_url.clone();
    let (stuck, pending, relay) = m
        .with(|c| {
            let stuck: i64 = c.query_row(
                "SELECT COUNT(*) FROM outbox WHERE state = 'pending' AND created_at < ?1",
                [cutoff],
                |r| r.get(0),
            )?;
            let pending: i64 = c.query_row(
                "SELECT COUNT(*) FROM outbox WHERE state = 'pending'",
                [],
                |r| r.get(0),
            )?;
            let relay = match &url {
                Some(u) => Some(crate::mailbox::outbox::relay_counts(c, u)?),
                None => None,
            };
            Ok((stuck, pending, relay))
        })
        .map_err(|e| format!("cannot read the outbox: {e}"))?;
    let routes = peer_routes(m, f.opts.now_ms, url.as_deref())
        .map_err(|e| format!("cannot read the peers' routes: {e}"))?;
    let mut out = Outcome::new(Status::Ok, format!("{pending} pending"));
    if f.config_invalid().is_some() {
        out = out.detail("relay counts not shown: config.toml is invalid (see the config check)");
    }
    if stuck > 0 {
        out.status = Some(Status::Warn);
        out = out
            .detail(format!("{stuck} pending row(s) older than 1 h (stuck)"))
            .detail("the fix command shows why the targets cannot be reached")
            .fix("agentmbx doctor peers relay-reachable");
    }
    if let Some(r) = relay {
        out.summary = format!(
            "{pending} pending, {} relay-accepted waiting, {} repush, {} expired, {} unconfirmed",
            r.relay_accepted, r.repush, r.expired, r.unconfirmed
        );
        if r.expired > 0 || r.unconfirmed > 0 {
            out.status = Some(Status::Warn);
            out = out.detail(format!(
                "{} expired and {} unconfirmed: their senders were alerted; resend what still matters",
                r.expired, r.unconfirmed
            ));
            out = out.detail("agentmbx sent --as AGENT shows each recipient's state");
        }
    }
    for line in routes {
        out = out.detail(line);
    }
    Ok(out)
}

/// One line per peer that has mail queued or whose LAN address is marked as not answering
/// (spec §10, `crate::mailbox::lan_memory`): `<peer>: <route>` (e.g. `work: relay (LAN
/// unreachable since <time> (refused), next LAN probe in 4 s)`), and when the relay `url` is
/// not working either, its standing (`; relay <state> since <time>: <detail>`). "relay" is said
/// only when a relay is configured (`url`).
fn peer_routes(
    m: &crate::mailbox::Mailbox,
    now_ms: i64,
    url: Option<&str>,
) -> Result<Vec<String>, crate::mailbox::MailboxError> {
    use crate::mailbox::lan_memory;
    m.with(|c| {
        let relay_trouble = match url {
            Some(u) => crate::mailbox::relay_state::kv_get(
                c,
                &crate::transport::relay_client::state::state_kv(u),
            )?
            .and_then(|v| serde_json::from_str::<serde_json::Value>(&v).ok())
            .filter(|v| v.get("state").and_then(|s| s.as_str()) != Some("ok"))
            .map(|v| {
                let f = |k: &str| v.get(k).and_then(|s| s.as_str()).unwrap_or("").to_string();
                let detail = f("detail");
                if detail.is_empty() {
                    format!("relay {} since {}", f("state"), f("at"))
                } else {
                    format!("relay {} since {}: {detail}", f("state"), f("at"))
                }
            }),
            None => None,
        };
        let mut lines = Vec::new();
        for st in lan_memory::all(c)? {
            let queued: i64 = c.query_row(
                "SELECT COUNT(*) FROM outbox WHERE host = ?1 AND state IN ('pending', 'repush')",
                [&st.host],
                |r| r.get(0),
            )?;
            if queued == 0 && st.down_since.is_none() {
                continue;
            }
            let Some(route) = lan_memory::route_text(c, &st.host, now_ms, url.is_some())? else {
                lines.push(format!("{}: no route (no LAN address, no relay)", st.host));
                continue;
            };
            let mut line = format!("{}: {route}", st.host);
            if let (Some(t), true) = (&relay_trouble, st.down_since.is_some()) {
                line.push_str(&format!("; {t}"));
            }
            lines.push(line);
        }
        Ok(lines)
    })
}

/// `quarantine`: relay items this host refused to process (warn when any).
pub fn quarantine(f: &Facts) -> Result<Outcome, String> {
    let Some(m) = &f.mailbox else {
        return Ok(Outcome::new(Status::Skip, "no mailbox.db yet"));
    };
    let n: i64 = m
        .with(|c| Ok(c.query_row("SELECT COUNT(*) FROM quarantine", [], |r| r.get(0))?))
        .map_err(|e| format!("cannot read the quarantine: {e}"))?;
    Ok(if n == 0 {
        Outcome::new(Status::Ok, "no quarantined relay items")
    } else {
        Outcome::new(Status::Warn, format!("{n} quarantined relay item(s)"))
            .fix("agentmbx relay quarantine")
    })
}

/// Most names the `unclaimed` finding lists (then `and N more`).
const MAX_UNCLAIMED_NAMES: usize = 10;

/// `unclaimed`: direct mail from paired hosts for names with no agent on this host
/// ([`crate::mailbox::unclaimed`]), held without a delivered receipt: warn with how many
/// messages wait for which names, and what to do.
pub fn unclaimed(f: &Facts) -> Result<Outcome, String> {
    let Some(m) = &f.mailbox else {
        return Ok(Outcome::new(Status::Skip, "no mailbox.db yet"));
    };
    let counts = m
        .with(|c| crate::mailbox::unclaimed::counts(c))
        .map_err(|e| format!("cannot read the unclaimed mail: {e}"))?;
    if counts.is_empty() {
        return Ok(Outcome::new(
            Status::Ok,
            "no mail waiting for names with no agent here",
        ));
    }
    let total: u64 = counts.iter().map(|(_, n)| n).sum();
    let mut names: Vec<String> = counts
        .iter()
        .take(MAX_UNCLAIMED_NAMES)
        .map(|(name, n)| format!("{name} ({n})"))
        .collect();
    if counts.len() > MAX_UNCLAIMED_NAMES {
        names.push(format!("and {} more", counts.len() - MAX_UNCLAIMED_NAMES));
    }
    Ok(Outcome::new(
        Status::Warn,
        format!(
            "{total} message(s) held for name(s) with no agent here: {}",
            names.join(", ")
        ),
    )
    .detail("no inbox shows them and their senders got no delivered receipt")
    .detail("an agent of that name gets them, and the receipts go out, once it registers: agentmbx whoami --as <name>")
    .detail("a misspelt name: tell the sender to resend to the right agent")
    .fix("agentmbx inbox --unclaimed"))
}

/// The service's state on this machine: the user's unit or agent, the package's or
/// Homebrew's, as the supervisor reports it ([`crate::service::service_state`]).
fn service_state() -> Option<crate::service::ServiceState> {
    use crate::service::{self as svc, Platform};
    let platform = Platform::current()?;
    let home = std::env::var_os("HOME")
        .map(PathBuf::from)
        .filter(|p| p.is_absolute())?;
    let config = std::env::var_os("XDG_CONFIG_HOME")
        .map(PathBuf::from)
        .filter(|p| p.is_absolute());
    let label = svc::launchd_label(std::env::var(svc::LABEL_ENV).ok().as_deref());
    let files = svc::candidate_files(platform, &home, config.as_deref(), &label);
    #[allow(unsafe_code)]
    // SAFETY: getuid has no preconditions and cannot fail.
    let uid = unsafe { libc::getuid() };
    Some(svc::service_state(
        platform,
        &files,
        uid,
        &label,
        &svc::run_query,
        &|p: &Path| p.exists(),
    ))
}

/// The doctor's verdict on a service state: fail when enabled but not running, warn when not
/// installed (while the daemon does not answer) or not enabled, ok when running; not
/// installed while the daemon answers (run in the foreground on purpose) is `skip` with an
/// information summary, so such a host gets no warning on every run; with no supervisor answering, the file alone
/// decides (ok when the daemon answers, else warn) and the state is `unknown`.
pub fn service_outcome(
    state: &crate::service::ServiceState,
    daemon_answers: bool,
    macos: bool,
) -> Outcome {
    use crate::service::Health;
    let where_ = state
        .file
        .as_ref()
        .map(|f| format!("{}, {}", state.name, f.display()))
        .unwrap_or_else(|| state.name.clone());
    let name = super::super::shell_quote(&state.name);
    let restart = if macos {
        format!("launchctl kickstart -k gui/$(id -u)/{name}")
    } else {
        format!("systemctl --user restart {name}")
    };
    let logs = if macos {
        "agentmbx daemon status shows where the logs are".to_string()
    } else {
        format!("logs: journalctl --user -u {name}")
    };
    match state.health() {
        // A daemon run in the foreground (or by other means) on purpose: said as information,
        // not a warning on every run.
        Health::NotInstalled if daemon_answers => Outcome::new(
            Status::Skip,
            "no user service installed; the daemon runs without one (info, not a problem)",
        )
        .detail("to start it at login instead: agentmbx daemon install"),
        Health::NotInstalled => Outcome::new(Status::Warn, "no user service installed")
            .detail("the fix installs a user service that starts the daemon at login")
            .fix("agentmbx daemon install"),
        Health::Running => Outcome::new(Status::Ok, format!("enabled and active ({where_})")),
        Health::Down => Outcome::new(
            Status::Fail,
            format!("enabled but {} ({where_})", state.active),
        )
        .detail(logs)
        .fix(restart),
        Health::Disabled => Outcome::new(
            Status::Warn,
            format!("installed but {} ({where_})", state.enabled),
        )
        .fix(if macos {
            "agentmbx daemon install".to_string()
        } else {
            format!("systemctl --user enable --now {name}")
        }),
        Health::Unknown if daemon_answers => Outcome::new(
            Status::Ok,
            format!("installed ({where_}), state unknown, the daemon answers"),
        ),
        Health::Unknown => Outcome::new(
            Status::Warn,
            format!("installed ({where_}), state unknown (no service manager answered)"),
        )
        .fix(restart),
    }
}

/// `service`: the user service is installed, enabled and active (see [`service_outcome`]).
pub fn service(f: &Facts) -> Result<Outcome, String> {
    let Some(state) = service_state() else {
        return Ok(Outcome::new(
            Status::Skip,
            "no supported service manager on this platform",
        ));
    };
    let answering = matches!(
        &f.probes.daemon,
        Some(super::net::DaemonProbe::Answered { status: 200, .. })
    );
    Ok(service_outcome(
        &state,
        answering,
        cfg!(target_os = "macos"),
    ))
}

/// Free bytes for unprivileged users on the file system holding `path` (or its nearest existing
/// ancestor). Errors: `statvfs` failed.
#[cfg(unix)]
#[allow(unsafe_code)]
pub fn free_bytes(path: &Path) -> Result<u64, String> {
    let mut p = path.to_path_buf();
    while !p.exists() {
        if !p.pop() {
            return Err("no existing directory".into());
        }
    }
    use std::os::unix::ffi::OsStrExt;
    let c = std::ffi::CString::new(p.as_os_str().as_bytes()).map_err(|e| e.to_string())?;
    // SAFETY: `statvfs` is a plain C struct of integers, for which all-zero bytes are valid.
    let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
    // SAFETY: `c` is a valid NUL-terminated path and `st` a valid, writable statvfs.
    let rc = unsafe { libc::statvfs(c.as_ptr(), &mut st) };
    if rc != 0 {
        return Err(format!(
            "statvfs failed: {}",
            std::io::Error::last_os_error()
        ));
    }
    #[allow(clippy::unnecessary_cast)]
    Ok((st.f_bavail as u64).saturating_mul(st.f_frsize as u64))
}

/// Not available off Unix.
#[cfg(not(unix))]
pub fn free_bytes(_path: &Path) -> Result<u64, String> {
    Err("disk space is not measured on this platform".into())
}

/// The verdict for `free` bytes: fail below [`DISK_FAIL_BYTES`], warn below
/// [`DISK_WARN_BYTES`].
pub fn disk_verdict(free: u64) -> Status {
    if free < DISK_FAIL_BYTES {
        Status::Fail
    } else if free < DISK_WARN_BYTES {
        Status::Warn
    } else {
        Status::Ok
    }
}

/// `disk-space`: free space of the data directory's file system.
pub fn disk_space(f: &Facts) -> Result<Outcome, String> {
    let free = free_bytes(f.paths.home())?;
    let mib = free >> 20;
    let status = disk_verdict(free);
    let out = Outcome::new(
        status,
        format!("{mib} MiB free for {}", f.paths.home().display()),
    );
    Ok(match status {
        Status::Ok => out,
        _ => out.detail("free disk space: mail cannot be stored when the disk is full"),
    })
}

#[cfg(test)]
mod service_tests {
    use super::*;
    use crate::service::ServiceState;

    fn state(installed: bool, enabled: &str, active: &str) -> ServiceState {
        ServiceState {
            name: "agentmbx.service".into(),
            file: installed.then(|| PathBuf::from("/usr/lib/systemd/user/agentmbx.service")),
            installed,
            enabled: enabled.into(),
            active: active.into(),
        }
    }

    #[test]
    fn service_verdicts() {
        let s = |o: Outcome| o.status.expect("status");
        assert_eq!(
            s(service_outcome(
                &state(true, "enabled", "active"),
                false,
                false
            )),
            Status::Ok
        );
        assert_eq!(
            s(service_outcome(
                &state(true, "enabled", "failed"),
                true,
                false
            )),
            Status::Fail
        );
        assert_eq!(
            s(service_outcome(
                &state(true, "enabled", "inactive"),
                false,
                false
            )),
            Status::Fail
        );
        assert_eq!(
            s(service_outcome(
                &state(false, "not-found", "inactive"),
                false,
                false
            )),
            Status::Warn
        );
        assert_eq!(
            s(service_outcome(
                &state(true, "disabled", "inactive"),
                false,
                false
            )),
            Status::Warn
        );
        // Not installed while the daemon answers (run in the foreground): information, not a
        // warning on every run; with the daemon down it still warns.
        let foreground = service_outcome(&state(false, "not-found", "inactive"), true, false);
        assert_eq!(foreground.status, Some(Status::Skip), "{foreground:?}");
        assert!(
            foreground.summary.contains("info"),
            "{}",
            foreground.summary
        );
        assert_eq!(foreground.fix, None);
        let unknown = service_outcome(&state(true, "unknown", "unknown"), false, false);
        assert!(unknown.summary.contains("unknown"), "{}", unknown.summary);
        assert_eq!(s(unknown), Status::Warn);
        assert_eq!(
            s(service_outcome(
                &state(true, "unknown", "unknown"),
                true,
                false
            )),
            Status::Ok
        );
    }
}

#[cfg(test)]
mod tests;
