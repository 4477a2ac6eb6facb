//! `[[hooks]]` in `config.toml` (issue 19 part 2, "Hooks"): which new mail runs which command.
//! Hooks are read from the config file only, never set over the API, and apply at the next
//! daemon start.
//!
//! ```toml
//! hook_concurrency = 4            # most hook commands running at once (1..=64)
//!
//! [[hooks]]
//! name = "notify-bob"             # unique; the agent/host name rule
//! agent = "bob"                   # mail delivered to this local agent
//! command = ["/usr/local/bin/notify", "--quiet"]   # argument list, no shell
//! from = ["alice@laptop"]         # optional: sender addresses
//! kind = ["request", "task"]      # optional: envelope kinds
//! needs_reply = true              # optional
//! wake_worthy = true              # optional; default: true when no filter above is given
//! timeout_ms = 30000              # optional (100..=3600000; default 30000)
//! debounce_ms = 1000              # optional (0..=600000; default 1000)
//! ```
//!
//! A message runs a hook when it is delivered to the hook's agent and passes every filter the
//! hook gives: its sender is one of `from`, its kind one of `kind`, its `needs_reply` equals
//! `needs_reply`, and, when `wake_worthy` is true, it is wake-worthy for the agent by the
//! wake brake's rule ([`crate::wake_rule::is_wake_worthy`]). With no filter at all a hook
//! runs for wake-worthy mail only.

use serde::{Deserialize, Serialize};

/// Default `timeout_ms` of a hook: 30 s.
pub const DEFAULT_TIMEOUT_MS: u64 = 30_000;
/// Accepted `timeout_ms` (ms).
pub const TIMEOUT_RANGE_MS: std::ops::RangeInclusive<u64> = 100..=3_600_000;
/// Default `debounce_ms` of a hook: 1 s (mail arriving within 1 s of the first of a burst
/// shares its run).
pub const DEFAULT_DEBOUNCE_MS: u64 = 1_000;
/// Accepted `debounce_ms` (ms); 0 runs once per message.
pub const DEBOUNCE_RANGE_MS: std::ops::RangeInclusive<u64> = 0..=600_000;
/// Default `hook_concurrency`: 4 hook commands at once.
pub const DEFAULT_CONCURRENCY: u32 = 4;
/// Accepted `hook_concurrency`.
pub const CONCURRENCY_RANGE: std::ops::RangeInclusive<u32> = 1..=64;
/// Most `[[hooks]]` tables.
pub const MAX_HOOKS: usize = 64;
/// Most arguments in a hook's `command` (program included).
pub const MAX_ARGS: usize = 64;
/// Longest argument (bytes).
pub const MAX_ARG_BYTES: usize = 4096;
/// Most entries in `from` or `kind`.
pub const MAX_FILTER_ENTRIES: usize = 64;

/// Default of `hook_concurrency` (serde).
pub fn default_concurrency() -> u32 {
    DEFAULT_CONCURRENCY
}

fn default_timeout_ms() -> u64 {
    DEFAULT_TIMEOUT_MS
}

fn default_debounce_ms() -> u64 {
    DEFAULT_DEBOUNCE_MS
}

/// One `[[hooks]]` table. See the module docs for the meaning of each key.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HookConfig {
    /// `name`: unique among the hooks (`^[a-z0-9][a-z0-9-]{1,39}$`); names its runs.
    pub name: String,
    /// `agent`: the local agent whose new mail runs the hook.
    pub agent: String,
    /// `command`: program and arguments (1..=[`MAX_ARGS`] items of 1..=[`MAX_ARG_BYTES`]
    /// bytes, no NUL). Run directly, no shell; a relative program is looked up in `PATH`.
    pub command: Vec<String>,
    /// `from`: sender addresses (`name@host`) that run the hook; absent: any sender.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub from: Option<Vec<String>>,
    /// `kind`: envelope kinds that run the hook; absent: any kind.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kind: Option<Vec<String>>,
    /// `needs_reply`: only mail whose `needs_reply` is this; absent: either.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub needs_reply: Option<bool>,
    /// `wake_worthy`: only wake-worthy mail; absent: true when `from`, `kind` and
    /// `needs_reply` are all absent, else false.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub wake_worthy: Option<bool>,
    /// `timeout_ms`: the command is killed (its whole process group) after this long (ms,
    /// [`TIMEOUT_RANGE_MS`], default [`DEFAULT_TIMEOUT_MS`]).
    #[serde(default = "default_timeout_ms")]
    pub timeout_ms: u64,
    /// `debounce_ms`: mail for this hook arriving within this long (ms) of the first message
    /// of a run that has not started yet joins that run ([`DEBOUNCE_RANGE_MS`], default
    /// [`DEFAULT_DEBOUNCE_MS`]).
    #[serde(default = "default_debounce_ms")]
    pub debounce_ms: u64,
}

/// What a message offers the filters of [`HookConfig::matches`].
#[derive(Debug, Clone, Copy)]
pub struct MailFacts<'a> {
    /// Sender address `name@host`.
    pub from: &'a str,
    /// Envelope kind.
    pub kind: &'a str,
    /// Envelope `needs_reply`.
    pub needs_reply: bool,
    /// Subject (read for @mentions only, by the wake-worthy rule).
    pub subject: &'a str,
    /// Body (read for @mentions only, by the wake-worthy rule).
    pub body: &'a str,
}

impl HookConfig {
    /// Whether the wake-worthy rule applies ([`HookConfig::wake_worthy`] and its default).
    pub fn wants_wake_worthy(&self) -> bool {
        self.wake_worthy
            .unwrap_or(self.from.is_none() && self.kind.is_none() && self.needs_reply.is_none())
    }

    /// True when mail delivered to `agent` on host `host` runs this hook (module docs).
    pub fn matches(&self, agent: &str, host: &str, mail: &MailFacts<'_>) -> bool {
        if agent != self.agent {
            return false;
        }
        if let Some(from) = &self.from {
            if !from.iter().any(|f| f == mail.from) {
                return false;
            }
        }
        if let Some(kinds) = &self.kind {
            if !kinds.iter().any(|k| k == mail.kind) {
                return false;
            }
        }
        if let Some(nr) = self.needs_reply {
            if nr != mail.needs_reply {
                return false;
            }
        }
        !self.wants_wake_worthy()
            || crate::wake_rule::is_wake_worthy(
                agent,
                host,
                mail.kind,
                mail.needs_reply,
                mail.subject,
                mail.body,
            )
    }

    /// Checks this hook's values; the message names the fault (the caller names the hook).
    fn check(&self) -> Result<(), String> {
        use agentmbx_protocol::limits::is_name;
        if !is_name(&self.agent) {
            return Err(format!(
                "agent {:?} is not an agent name (^[a-z0-9][a-z0-9-]{{1,39}}$)",
                self.agent
            ));
        }
        if self.command.is_empty() || self.command.len() > MAX_ARGS {
            return Err(format!(
                "command must be a list of 1..={MAX_ARGS} strings: the program, then its arguments"
            ));
        }
        if self.command[0].trim().is_empty() {
            return Err("command's first item (the program) is empty".into());
        }
        if let Some(i) = self
            .command
            .iter()
            .position(|a| a.len() > MAX_ARG_BYTES || a.contains('\0'))
        {
            return Err(format!(
                "command item {} must be at most {MAX_ARG_BYTES} bytes without NUL",
                i + 1
            ));
        }
        if let Some(from) = &self.from {
            if from.is_empty() || from.len() > MAX_FILTER_ENTRIES {
                return Err(format!(
                    "from must list 1..={MAX_FILTER_ENTRIES} sender addresses (leave it out for any sender)"
                ));
            }
            for f in from {
                let ok = f
                    .split_once('@')
                    .is_some_and(|(n, h)| is_name(n) && is_name(h));
                if !ok {
                    return Err(format!("from entry {f:?} is not an address name@host"));
                }
            }
        }
        if let Some(kinds) = &self.kind {
            if kinds.is_empty() || kinds.len() > MAX_FILTER_ENTRIES {
                return Err(format!(
                    "kind must list 1..={MAX_FILTER_ENTRIES} kinds (leave it out for any kind)"
                ));
            }
            let known = agentmbx_protocol::envelope::KINDS;
            if let Some(k) = kinds.iter().find(|k| !known.contains(&k.as_str())) {
                return Err(format!(
                    "kind {k:?} is not a message kind (one of {})",
                    known.join(", ")
                ));
            }
        }
        if !TIMEOUT_RANGE_MS.contains(&self.timeout_ms) {
            return Err(format!(
                "timeout_ms {} is outside {}..={} ms",
                self.timeout_ms,
                TIMEOUT_RANGE_MS.start(),
                TIMEOUT_RANGE_MS.end()
            ));
        }
        if !DEBOUNCE_RANGE_MS.contains(&self.debounce_ms) {
            return Err(format!(
                "debounce_ms {} is outside {}..={} ms",
                self.debounce_ms,
                DEBOUNCE_RANGE_MS.start(),
                DEBOUNCE_RANGE_MS.end()
            ));
        }
        Ok(())
    }
}

/// Checks `hook_concurrency` and every hook. Errors: `(key, message)` for
/// [`crate::config::ConfigError::Invalid`]; a hook's message starts with its name (or its
/// position, `hooks[3]`, when the name itself is bad).
pub fn validate(concurrency: u32, hooks: &[HookConfig]) -> Result<(), (&'static str, String)> {
    if !CONCURRENCY_RANGE.contains(&concurrency) {
        return Err((
            "hook_concurrency",
            format!(
                "{concurrency} is outside {}..={}",
                CONCURRENCY_RANGE.start(),
                CONCURRENCY_RANGE.end()
            ),
        ));
    }
    if hooks.len() > MAX_HOOKS {
        return Err(("hooks", format!("at most {MAX_HOOKS} [[hooks]] tables")));
    }
    let mut seen = std::collections::HashSet::new();
    for (i, hook) in hooks.iter().enumerate() {
        if !agentmbx_protocol::limits::is_name(&hook.name) {
            return Err((
                "hooks",
                format!(
                    "hooks[{}]: name {:?} is not a hook name (^[a-z0-9][a-z0-9-]{{1,39}}$)",
                    i + 1,
                    hook.name
                ),
            ));
        }
        if !seen.insert(hook.name.as_str()) {
            return Err((
                "hooks",
                format!("hook {:?}: another hook has the same name", hook.name),
            ));
        }
        hook.check()
            .map_err(|m| ("hooks", format!("hook {:?}: {m}", hook.name)))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hook(toml_text: &str) -> Result<Vec<HookConfig>, String> {
        #[derive(Deserialize)]
        struct F {
            hooks: Vec<HookConfig>,
        }
        let f: F = toml::from_str(toml_text).map_err(|e| e.to_string())?;
        validate(DEFAULT_CONCURRENCY, &f.hooks).map_err(|e| e.1)?;
        Ok(f.hooks)
    }

    #[test]
    fn a_minimal_hook_takes_the_defaults_and_wants_wake_worthy_mail() {
        let h =
            hook("[[hooks]]\nname = \"n1\"\nagent = \"bob\"\ncommand = [\"/bin/true\"]\n").unwrap();
        assert_eq!(h[0].timeout_ms, DEFAULT_TIMEOUT_MS);
        assert_eq!(h[0].debounce_ms, DEFAULT_DEBOUNCE_MS);
        assert!(h[0].wants_wake_worthy());
        let note = MailFacts {
            from: "alice@home",
            kind: "message",
            needs_reply: false,
            subject: "s",
            body: "b",
        };
        assert!(!h[0].matches("bob", "host", &note));
        let req = MailFacts {
            kind: "request",
            ..note
        };
        assert!(h[0].matches("bob", "host", &req));
        assert!(!h[0].matches("carol", "host", &req));
        let mention = MailFacts {
            body: "hi @bob",
            ..note
        };
        assert!(h[0].matches("bob", "host", &mention));
    }

    #[test]
    fn filters_decide_alone_unless_wake_worthy_is_asked_for() {
        let h = hook(
            "[[hooks]]\nname = \"n1\"\nagent = \"bob\"\ncommand = [\"x\"]\nfrom = [\"alice@home\"]\n\
             [[hooks]]\nname = \"n2\"\nagent = \"bob\"\ncommand = [\"x\"]\nkind = [\"status\"]\nwake_worthy = true\n",
        )
        .unwrap();
        let m = MailFacts {
            from: "alice@home",
            kind: "message",
            needs_reply: false,
            subject: "",
            body: "",
        };
        assert!(h[0].matches("bob", "h", &m));
        assert!(!h[0].matches(
            "bob",
            "h",
            &MailFacts {
                from: "eve@home",
                ..m
            }
        ));
        // status is never wake-worthy: n2 can never run, which is what it asked for.
        assert!(!h[1].matches(
            "bob",
            "h",
            &MailFacts {
                kind: "status",
                ..m
            }
        ));
    }

    #[test]
    fn each_bad_value_is_refused_naming_the_hook() {
        let base = "[[hooks]]\nname = \"n1\"\nagent = \"bob\"\n";
        for (extra, needle) in [
            ("command = []\n", "command must be a list"),
            ("command = [\"\"]\n", "program) is empty"),
            ("command = [\"a\\u0000\"]\n", "without NUL"),
            (
                "command = [\"x\"]\ntimeout_ms = 5\n",
                "timeout_ms 5 is outside",
            ),
            (
                "command = [\"x\"]\ndebounce_ms = 900000\n",
                "debounce_ms 900000",
            ),
            (
                "command = [\"x\"]\nkind = [\"gossip\"]\n",
                "kind \"gossip\" is not",
            ),
            ("command = [\"x\"]\nkind = []\n", "kind must list"),
            ("command = [\"x\"]\nfrom = [\"alice\"]\n", "not an address"),
        ] {
            let err = hook(&format!("{base}{extra}")).unwrap_err();
            assert!(err.contains("hook \"n1\""), "{err}");
            assert!(err.contains(needle), "{extra}: {err}");
        }
        let err =
            hook("[[hooks]]\nname = \"n1\"\nagent = \"Bob\"\ncommand = [\"x\"]\n").unwrap_err();
        assert!(err.contains("hook \"n1\": agent \"Bob\""), "{err}");
        let err =
            hook("[[hooks]]\nname = \"N 1\"\nagent = \"bob\"\ncommand = [\"x\"]\n").unwrap_err();
        assert!(err.contains("hooks[1]: name"), "{err}");
        let two = "[[hooks]]\nname = \"n1\"\nagent = \"bob\"\ncommand = [\"x\"]\n";
        let err = hook(&format!("{two}{two}")).unwrap_err();
        assert!(err.contains("same name"), "{err}");
        let err =
            hook("[[hooks]]\nname = \"n1\"\nagent = \"bob\"\ncommand = \"x y\"\n").unwrap_err();
        assert!(err.contains("command"), "{err}");
        let err =
            hook("[[hooks]]\nname = \"n1\"\nagent = \"bob\"\ncommand = [\"x\"]\nshell = true\n")
                .unwrap_err();
        assert!(err.contains("shell"), "{err}");
        assert!(validate(0, &[]).unwrap_err().0 == "hook_concurrency");
        assert!(validate(65, &[]).is_err());
    }
}
