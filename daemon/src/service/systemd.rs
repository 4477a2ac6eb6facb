//! The systemd user unit of the host daemon (`~/.config/systemd/user/agentmbx.service`).
//!
//! Owns the unit text for a [`ServiceSpec`]: `Type=notify` (the daemon sends `READY=1` once its
//! listeners are bound and its store is open, [`super::notify`]), a watchdog, restart on
//! failure, and only the hardening that needs no namespaces. Mount-namespace options
//! (`PrivateTmp`, `ProtectSystem`, `ProtectHome`, `ReadWritePaths`) imply `PrivateUsers` in a
//! user unit and fail with `226/NAMESPACE` where unprivileged user namespaces are blocked
//! (Ubuntu's AppArmor restriction, containers), so the unit never uses them.
//! `Environment=MBX_HOME=<data dir>` is always written so the unit and the daemon agree on
//! the home. No ordering on
//! `network-online.target`: a user manager has no such unit, and the daemon waits for peers
//! and the relay by itself.
//! It must never put secrets or per-run values into the unit.

use std::path::Path;

use super::ServiceSpec;

/// The unit's `WatchdogSec` in seconds: the daemon pings every half of it.
pub const WATCHDOG_SEC: u32 = 30;

/// The unit's `RestartSec` in seconds.
pub const RESTART_SEC: u32 = 5;

/// Quotes one word for a unit file: `%` is doubled (specifier escape), `$` is doubled
/// (variable expansion in `ExecStart`); a word with
/// whitespace, quotes or backslashes is put in double quotes with C-style escapes.
pub fn quote(word: &str) -> String {
    let word = word.replace('%', "%%").replace('$', "$$");
    if !word.is_empty()
        && !word
            .chars()
            .any(|c| c.is_whitespace() || c == '"' || c == '\'' || c == '\\' || c == ';')
    {
        return word;
    }
    let mut out = String::from("\"");
    for c in word.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\t' => out.push_str("\\t"),
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

fn quote_path(p: &Path) -> String {
    quote(&p.display().to_string())
}

/// The unit text for `spec` (exact; tests snapshot it).
pub fn unit(spec: &ServiceSpec) -> String {
    let env = quote(&format!("MBX_HOME={}", spec.data_dir.display()));
    format!(
        "[Unit]
Description=AgentMBX host daemon (signed, sealed mailbox for AI agents)
Documentation=man:agentmbx-daemon(1)

[Service]
Type=notify
NotifyAccess=main
ExecStart={bin} daemon
Environment={env}
Restart=on-failure
RestartSec={RESTART_SEC}
WatchdogSec={WATCHDOG_SEC}
# SIGTERM: STOPPING=1, finish in-flight commits, exit 0.
KillSignal=SIGTERM
TimeoutStopSec=30

NoNewPrivileges=yes
RestrictSUIDSGID=yes
LockPersonality=yes
RestrictRealtime=yes
SystemCallArchitectures=native
UMask=0077

[Install]
WantedBy=default.target
",
        bin = quote_path(&spec.binary),
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::service::LAUNCHD_LABEL;

    #[test]
    fn unit_snapshot() {
        let spec = ServiceSpec {
            binary: "/usr/bin/agentmbx".into(),
            data_dir: "/home/ann/.local/share/agentmbx".into(),
            log_dir: "/unused".into(),
            label: LAUNCHD_LABEL.into(),
        };
        assert_eq!(
            unit(&spec),
            "[Unit]
Description=AgentMBX host daemon (signed, sealed mailbox for AI agents)
Documentation=man:agentmbx-daemon(1)

[Service]
Type=notify
NotifyAccess=main
ExecStart=/usr/bin/agentmbx daemon
Environment=MBX_HOME=/home/ann/.local/share/agentmbx
Restart=on-failure
RestartSec=5
WatchdogSec=30
# SIGTERM: STOPPING=1, finish in-flight commits, exit 0.
KillSignal=SIGTERM
TimeoutStopSec=30

NoNewPrivileges=yes
RestrictSUIDSGID=yes
LockPersonality=yes
RestrictRealtime=yes
SystemCallArchitectures=native
UMask=0077

[Install]
WantedBy=default.target
"
        );
    }

    #[test]
    fn unit_quotes_odd_paths_and_sets_mbx_home() {
        let spec = ServiceSpec {
            binary: "/opt/my apps/agentmbx".into(),
            data_dir: "/home/ann/mbx 100%".into(),
            log_dir: "/unused".into(),
            label: LAUNCHD_LABEL.into(),
        };
        let text = unit(&spec);
        assert!(
            text.contains("\nExecStart=\"/opt/my apps/agentmbx\" daemon\n"),
            "{text}"
        );
        assert!(
            text.contains("\nEnvironment=\"MBX_HOME=/home/ann/mbx 100%%\"\nRestart=on-failure\n"),
            "{text}"
        );
        for gone in [
            "PrivateTmp",
            "ProtectSystem",
            "ProtectHome",
            "ReadWritePaths",
        ] {
            assert!(!text.contains(gone), "{text}");
        }
    }

    #[test]
    fn quote_rules() {
        assert_eq!(quote("/a/b"), "/a/b");
        assert_eq!(quote("a\"b"), "\"a\\\"b\"");
        assert_eq!(quote("a\\b"), "\"a\\\\b\"");
        assert_eq!(quote(""), "\"\"");
        assert_eq!(quote("/a/$HOME/%h"), "/a/$$HOME/%%h");
    }
}
