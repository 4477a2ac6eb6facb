//! `agentmbx doctor`: checks of this host's setup, each with a stable id, a status and, where
//! something is wrong, the command that fixes it (conventions.md "Platform conventions";
//! `wire.md` §7).
//!
//! The framework: [`CHECKS`] lists the ids and titles; [`run`] gathers the facts the checks
//! need (the network probes — daemon, peers, relay — concurrently, each bounded by
//! [`Options::timeout`]) and evaluates each selected check. A check returns
//! `Result<Outcome, String>`: an `Err` becomes status [`Status::Error`] with that message, so one
//! broken check never stops the others. [`Report`] is `{schema: 2, checks: [...], summary}`;
//! every text in it passes through [`redact`] first. Exit status ([`Report::exit_code`]): 1 when
//! any check is `fail` or `error` (a check that could not run has not shown the host healthy),
//! else 0.
//!
//! A result's `fix` is one runnable POSIX shell command line (paths and other arguments quoted
//! with [`shell_quote`]) or `null`; explanations go to `summary` and `details`. Schema 2 made
//! that rule (schema 1's `fix` could hold prose) and added the `config` check. When
//! `config.toml` does not load, the `config` check fails with the reason (it is reported even
//! when not named) and the checks that need the configuration skip with "config.toml is
//! invalid" instead of guessing.
//!
//! This module reads `config.toml`, `mailbox.db`, the key files' metadata and the network; it
//! writes only with `--fix` ([`Options::fix`]), and then only safe local fixes (a missing home
//! created 0700, home and key file permissions tightened to 0700 and 0600, only on what the current
//! user owns and never on a sticky directory). It never reads or prints private keys or tokens.

pub mod checks;

use std::time::Duration;

use serde::Serialize;

use crate::config::Config;
use crate::mailbox::Mailbox;
use crate::paths::Paths;

/// Version of the `--json` document: 2 (`fix` is a runnable shell command or `null`; schema 1
/// allowed prose there).
pub const SCHEMA: u32 = 2;

/// Default bound of each network probe (2 s).
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(2);

/// A check's verdict.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Status {
    /// All good.
    Ok,
    /// Works, but something needs attention.
    Warn,
    /// Broken: `doctor` exits 1.
    Fail,
    /// Not applicable here (e.g. no relay configured).
    Skip,
    /// The check itself could not run: `doctor` exits 1 (health not shown).
    Error,
}

impl Status {
    /// The text-mode mark: `✔ ! ✗ · ?`.
    pub fn mark(self) -> &'static str {
        match self {
            Status::Ok => "✔",
            Status::Warn => "!",
            Status::Fail => "✗",
            Status::Skip => "·",
            Status::Error => "?",
        }
    }
}

/// One check's id and title.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Check {
    /// Stable kebab-case id (`doctor <id>` runs only it).
    pub id: &'static str,
    /// One-line title.
    pub title: &'static str,
}

/// Every check, in the order they run and print.
pub const CHECKS: &[Check] = &[
    Check {
        id: "config",
        title: "config.toml valid",
    },
    Check {
        id: "host-identity",
        title: "host initialized and host key",
    },
    Check {
        id: "keystore",
        title: "key store backend",
    },
    Check {
        id: "daemon",
        title: "daemon answering on the local API",
    },
    Check {
        id: "host-key-clone",
        title: "no other daemon using this host key",
    },
    Check {
        id: "peers",
        title: "peers reachable and accepting our signature",
    },
    Check {
        id: "peer-key-clone",
        title: "no peer running two daemons with one host key",
    },
    Check {
        id: "relay-reachable",
        title: "relay reachable",
    },
    Check {
        id: "relay-key",
        title: "relay key pinned and matching",
    },
    Check {
        id: "relay-enrolled",
        title: "enrolled for the current relay key and epoch",
    },
    Check {
        id: "relay-stream",
        title: "relay push stream up, or why the daemon polls",
    },
    Check {
        id: "enc-ad",
        title: "enc-key ad published and not near expiry",
    },
    Check {
        id: "clock-skew",
        title: "clock skew against the relay",
    },
    Check {
        id: "outbox",
        title: "outbox: stuck, waiting, repush, expired, unconfirmed",
    },
    Check {
        id: "quarantine",
        title: "quarantined relay items",
    },
    Check {
        id: "unclaimed",
        title: "mail held for names with no agent here",
    },
    Check {
        id: "service",
        title: "service installed and running",
    },
    Check {
        id: "mcp-setup",
        title: "agent clients' agentmbx MCP entries run this binary and home",
    },
    Check {
        id: "disk-space",
        title: "disk space of the data directory",
    },
];

/// What a check found (before id and title are attached).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Outcome {
    /// The verdict (default `ok`).
    pub status: Option<Status>,
    /// One line.
    pub summary: String,
    /// Further lines.
    pub details: Vec<String>,
    /// The shell command line that fixes it (arguments quoted with [`shell_quote`]), if any;
    /// never prose.
    pub fix: Option<String>,
}

impl Outcome {
    /// An outcome with `status` and `summary`.
    pub fn new(status: Status, summary: impl Into<String>) -> Self {
        Outcome {
            status: Some(status),
            summary: summary.into(),
            ..Outcome::default()
        }
    }

    /// Adds the fix.
    pub fn fix(mut self, fix: impl Into<String>) -> Self {
        self.fix = Some(fix.into());
        self
    }

    /// Adds a detail line.
    pub fn detail(mut self, line: impl Into<String>) -> Self {
        self.details.push(line.into());
        self
    }
}

/// One check's result, as `--json` prints it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct CheckResult {
    /// Stable id.
    pub id: &'static str,
    /// Title.
    pub title: &'static str,
    /// Verdict.
    pub status: Status,
    /// One line.
    pub summary: String,
    /// Further lines.
    pub details: Vec<String>,
    /// A runnable POSIX shell command line that fixes it, or `null`.
    pub fix: Option<String>,
}

/// Counts per status.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct Summary {
    /// `ok` results.
    pub ok: usize,
    /// `warn` results.
    pub warn: usize,
    /// `fail` results.
    pub fail: usize,
    /// `skip` results.
    pub skip: usize,
    /// `error` results.
    pub error: usize,
}

/// The whole report: `{schema, checks, summary}`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Report {
    /// [`SCHEMA`].
    pub schema: u32,
    /// Results, in [`CHECKS`] order.
    pub checks: Vec<CheckResult>,
    /// Counts.
    pub summary: Summary,
}

impl Report {
    /// Builds the report from results (counts them).
    pub fn new(checks: Vec<CheckResult>) -> Self {
        let mut summary = Summary::default();
        for c in &checks {
            match c.status {
                Status::Ok => summary.ok += 1,
                Status::Warn => summary.warn += 1,
                Status::Fail => summary.fail += 1,
                Status::Skip => summary.skip += 1,
                Status::Error => summary.error += 1,
            }
        }
        Report {
            schema: SCHEMA,
            checks,
            summary,
        }
    }

    /// The process exit code: 1 when any check is `fail` or `error`, else 0.
    pub fn exit_code(&self) -> u8 {
        u8::from(self.summary.fail + self.summary.error > 0)
    }

    /// Text form: one `<mark> <title>: <summary>` line per check, details indented, then
    /// `    fix: …`.
    pub fn text(&self) -> String {
        let mut out = String::new();
        for c in &self.checks {
            out.push_str(&format!("{} {}: {}\n", c.status.mark(), c.title, c.summary));
            for d in &c.details {
                out.push_str(&format!("    {d}\n"));
            }
            if let Some(f) = &c.fix {
                out.push_str(&format!("    fix: {f}\n"));
            }
        }
        let s = &self.summary;
        out.push_str(&format!(
            "{} ok, {} warn, {} fail, {} skip, {} error\n",
            s.ok, s.warn, s.fail, s.skip, s.error
        ));
        out
    }
}

/// An id that names no check.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown check `{0}`; `agentmbx doctor --list` lists the ids")]
pub struct UnknownCheck(pub String);

/// The checks named by `ids` (in [`CHECKS`] order), or all when `ids` is empty.
/// Errors: [`UnknownCheck`] for the first id that names no check.
pub fn select(ids: &[String]) -> Result<Vec<Check>, UnknownCheck> {
    if let Some(bad) = ids
        .iter()
        .find(|i| !CHECKS.iter().any(|c| c.id == i.as_str()))
    {
        return Err(UnknownCheck(bad.clone()));
    }
    Ok(CHECKS
        .iter()
        .filter(|c| ids.is_empty() || ids.iter().any(|i| i == c.id))
        .copied()
        .collect())
}

/// Shell quoting is shared with `setup` (the commands it writes): [`crate::shell`].
pub use crate::shell::{shell_path, shell_quote};

/// How to run.
#[derive(Debug, Clone)]
pub struct Options {
    /// Apply safe local fixes.
    pub fix: bool,
    /// Bound of each network probe.
    pub timeout: Duration,
    /// Now (ms, from the clock).
    pub now_ms: i64,
}

/// Replaces secrets in `text` with `[redacted]`: each of `secrets` (8 characters or more: the
/// API token, the loaded private keys) and each standalone key-shaped run — base64 (standard
/// or URL alphabet) of 43/44 or 86/88 characters that decodes to 32 or 64 bytes, or exactly 64
/// hex digits. A run is a maximal stretch of `[A-Za-z0-9+/=_-]` (split after an inner `=`, as
/// in `key=value`); one that contains `/` and is not itself key-shaped is a path and is kept
/// whole, so paths and fix commands survive.
/// Fingerprints (19 characters with dashes) never match.
pub fn redact(text: &str, secrets: &[String]) -> String {
    let mut t = text.to_string();
    for s in secrets.iter().filter(|s| s.len() >= 8) {
        t = t.replace(s.as_str(), "[redacted]");
    }
    let mut out = String::with_capacity(t.len());
    let mut run = String::new();
    let flush = |run: &mut String, out: &mut String| {
        if key_shaped(run) {
            out.push_str("[redacted]");
        } else {
            // `name=value`: each `=`-ended piece on its own (padding stays with its run).
            let mut start = 0;
            let bytes = run.as_bytes();
            for i in 0..bytes.len() {
                let ends = bytes[i] == b'=' && bytes.get(i + 1).is_some_and(|b| *b != b'=');
                if ends || i + 1 == bytes.len() {
                    let piece = &run[start..=i];
                    out.push_str(if key_shaped(piece) {
                        "[redacted]"
                    } else {
                        piece
                    });
                    start = i + 1;
                }
            }
        }
        run.clear();
    };
    for ch in t.chars() {
        if ch.is_ascii_alphanumeric() || matches!(ch, '+' | '/' | '=' | '_' | '-') {
            run.push(ch);
        } else {
            flush(&mut run, &mut out);
            out.push(ch);
        }
    }
    flush(&mut run, &mut out);
    out
}

/// Whether `run` looks like key material: 64 hex digits, or base64 of 43/44/86/88 characters
/// decoding to 32 or 64 bytes.
fn key_shaped(run: &str) -> bool {
    use base64::engine::general_purpose::{STANDARD, STANDARD_NO_PAD, URL_SAFE, URL_SAFE_NO_PAD};
    use base64::Engine;
    if run.len() == 64 && run.chars().all(|c| c.is_ascii_hexdigit()) {
        return true;
    }
    if ![43, 44, 86, 88].contains(&run.len()) {
        return false;
    }
    [STANDARD, STANDARD_NO_PAD, URL_SAFE, URL_SAFE_NO_PAD]
        .iter()
        .filter_map(|e| e.decode(run).ok())
        .any(|b| b.len() == 32 || b.len() == 64)
}

/// The private key material this home holds in files, and what the loaded identity holds, for
/// [`redact`].
fn key_secrets(paths: &Paths, ident: Option<&crate::identity::Identity>) -> Vec<String> {
    let mut out = Vec::new();
    for file in [paths.host_key(), paths.enc_key()] {
        if let Ok(text) = std::fs::read_to_string(file) {
            out.extend(
                text.lines()
                    .map(str::trim)
                    .filter(|l| l.len() >= 32 && !l.contains(char::is_whitespace))
                    .map(str::to_string),
            );
        }
    }
    if let Some(i) = ident {
        out.push(i.host_key.seed_b64_secret());
        out.push(i.enc_key.private_b64_secret());
    }
    out
}

/// Everything the checks read, gathered once by [`run`].
#[allow(missing_debug_implementations)]
pub struct Facts {
    /// The home.
    pub paths: Paths,
    /// Options.
    pub opts: Options,
    /// `config.toml` plus environment, or why it could not be read.
    pub config: Result<Config, String>,
    /// `mailbox.db` when it exists and opens.
    pub mailbox: Option<Mailbox>,
    /// The relay URL (no trailing `/`), when configured.
    pub relay_url: Option<String>,
    /// This host's public identity, or why it cannot be loaded (e.g. not initialized).
    pub identity: Result<crate::identity::PublicIdentity, String>,
    /// This host's identity for signing the peers' LAN probe (`None` when it cannot be loaded).
    pub signer: Option<std::sync::Arc<crate::identity::Identity>>,
    /// Network probes (`None` when not run).
    pub probes: checks::net::Probes,
    /// Secrets to redact (the API token, the private keys).
    pub secrets: Vec<String>,
}

impl Facts {
    /// Why `config.toml` (with the environment) does not load, when this home has one or is
    /// initialized; `None` when it loads, or when there is no home to configure yet.
    pub fn config_invalid(&self) -> Option<&str> {
        let present =
            self.paths.config_file().exists() || crate::identity::is_initialized(&self.paths);
        match &self.config {
            Err(e) if present => Some(e.as_str()),
            _ => None,
        }
    }
}

/// Runs `selected` against the home `paths` and returns the report. Never panics on a broken
/// home: what cannot be read becomes `error` or `fail` results.
pub async fn run(paths: Paths, selected: &[Check], opts: Options) -> Report {
    let config = if paths.config_file().exists() || crate::identity::is_initialized(&paths) {
        Config::load(&paths).map_err(|e| e.to_string())
    } else {
        Err("config.toml not found".to_string())
    };
    let db = paths.mailbox_db();
    let mailbox = if db.exists() {
        Mailbox::open(&db).ok()
    } else {
        None
    };
    let relay_url = config
        .as_ref()
        .ok()
        .and_then(|c| c.relay.as_ref())
        .map(|r| r.url.trim_end_matches('/').to_string());
    let loaded = if !crate::identity::is_initialized(&paths) {
        Err("this host is not initialized".to_string())
    } else {
        match &config {
            Ok(c) => crate::identity::load(&paths, c).map_err(|e| e.to_string()),
            Err(e) => Err(e.clone()),
        }
    };
    let identity = loaded.as_ref().map(|i| i.public()).map_err(Clone::clone);
    let signer = loaded.ok().map(std::sync::Arc::new);
    let mut secrets = std::fs::read_to_string(paths.api_token())
        .map(|t| vec![t.trim().to_string()])
        .unwrap_or_default();
    secrets.extend(key_secrets(&paths, signer.as_deref()));
    let wants = |ids: &[&str]| selected.iter().any(|c| ids.contains(&c.id));
    let mut facts = Facts {
        paths,
        opts,
        config,
        mailbox,
        relay_url,
        identity,
        signer,
        probes: checks::net::Probes::default(),
        secrets,
    };
    facts.probes = checks::net::probe(
        &facts,
        wants(&["daemon", "host-key-clone", "peer-key-clone", "relay-stream"]),
        // `relay-reachable` reads the peers' probe too: a relay that is down while every
        // peer answers over the LAN only warns.
        wants(&["peers", "relay-reachable"]),
        wants(&[
            "peers",
            "relay-reachable",
            "relay-key",
            "relay-enrolled",
            "clock-skew",
        ]),
    )
    .await;
    // An invalid config.toml fails `config` even when it was not named: the named checks that
    // need the configuration skip, and the run must not look healthy.
    let mut run_list: Vec<Check> = selected.to_vec();
    if facts.config_invalid().is_some() && !run_list.iter().any(|c| c.id == "config") {
        run_list.insert(0, CHECKS[0]);
    }
    let results = run_list
        .iter()
        .map(|c| {
            let outcome =
                checks::evaluate(c.id, &facts).unwrap_or_else(|e| Outcome::new(Status::Error, e));
            CheckResult {
                id: c.id,
                title: c.title,
                status: outcome.status.unwrap_or(Status::Ok),
                summary: redact(&outcome.summary, &facts.secrets),
                details: outcome
                    .details
                    .iter()
                    .map(|d| redact(d, &facts.secrets))
                    .collect(),
                fix: outcome.fix.map(|f| redact(&f, &facts.secrets)),
            }
        })
        .collect();
    Report::new(results)
}

#[cfg(test)]
mod test_support;
#[cfg(test)]
mod tests;
