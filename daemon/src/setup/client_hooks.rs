//! Client hooks (issue 19 "Hooks"): `agentmbx hook session-start|prompt|stop --cli <client>
//! [--as AGENT]` in each client's own hook configuration, so new mail shows at the agent's next
//! prompt. Claude Code keeps hooks in its user settings (`$CLAUDE_CONFIG_DIR/settings.json`,
//! else `~/.claude/settings.json`); Codex in `$CODEX_HOME/hooks.json` (else
//! `~/.codex/hooks.json`), read only when `[features] codex_hooks = true` is in its
//! `config.toml` (setup says so; it does not turn the feature on). Both files have one shape:
//! `{"hooks": {"<Event>": [{"hooks": [{"type": "command", "command": "…", "timeout": 10}]}]}}`.
//!
//! Edited through jsonc-parser's concrete syntax tree as `.mcp.json` is ([`super::mcp_json`]):
//! every other hook, key, comment and blank stays byte for byte. A hook entry is *ours* when
//! its command, after leading `NAME=value` assignments, runs a program named `agentmbx` with
//! the first argument `hook` ([`is_ours_command`]). Installing adds one matcher group per event
//! holding our entry (or brings our entry's command up to date); removing takes out our
//! entries, then the groups, event lists and `hooks` object that only they made non-empty.

use jsonc_parser::cst::{CstArray, CstInputValue, CstObject, CstRootNode};
use jsonc_parser::ParseOptions;

use super::{Edited, Status};
use crate::shell::shell_quote as sh_quote;

/// The client events and the `agentmbx hook` subcommand each runs.
pub const EVENTS: [(&str, &str); 3] = [
    ("SessionStart", "session-start"),
    ("UserPromptSubmit", "prompt"),
    ("Stop", "stop"),
];

/// The `timeout` (s) of our hook entries: 10. `agentmbx hook` reads one local file; it never
/// needs more.
pub const HOOK_TIMEOUT_S: i64 = 10;

/// What our entries run.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HookSpec {
    /// Absolute path of the `agentmbx` binary.
    pub exe: String,
    /// `claude` or `codex` (`--cli`).
    pub cli: &'static str,
    /// `--as AGENT`, when given.
    pub agent: Option<String>,
    /// `MBX_HOME` when the home is not the default one.
    pub home: Option<String>,
}

impl HookSpec {
    /// The shell command line of the hook for `subcommand` (`prompt`, …): `[MBX_HOME=… ]exe
    /// hook <subcommand> --cli <cli>[ --as AGENT]`, each word quoted for `sh` when needed.
    pub fn command(&self, subcommand: &str) -> String {
        let mut words = Vec::new();
        if let Some(h) = &self.home {
            words.push(format!("{}={}", crate::paths::HOME_ENV, sh_quote(h)));
        }
        words.push(sh_quote(&self.exe));
        words.extend(["hook", subcommand, "--cli", self.cli].map(str::to_string));
        if let Some(a) = &self.agent {
            words.push("--as".into());
            words.push(sh_quote(a));
        }
        words.join(" ")
    }
}

/// Whether a hook command is one setup wrote (module docs).
pub fn is_ours_command(command: &str) -> bool {
    let words = sh_words(command);
    // Leading `NAME=value` assignments are skipped.
    let Some(at) = words
        .iter()
        .position(|w| !w.contains('=') || w.starts_with('/'))
    else {
        return false;
    };
    let program = &words[at];
    let name = std::path::Path::new(program)
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    (name == "agentmbx" || name == "agentmbx.exe")
        && words.get(at + 1).map(String::as_str) == Some("hook")
}

/// `command` split into words as `sh` would for the quoting [`sh_quote`] writes: single
/// quotes, backslash escapes outside them, blanks between words (no expansion).
fn sh_words(command: &str) -> Vec<String> {
    let mut words = Vec::new();
    let mut word = String::new();
    let mut in_word = false;
    let mut chars = command.chars();
    while let Some(c) = chars.next() {
        match c {
            '\'' => {
                in_word = true;
                for q in chars.by_ref() {
                    if q == '\'' {
                        break;
                    }
                    word.push(q);
                }
            }
            '\\' => {
                in_word = true;
                if let Some(n) = chars.next() {
                    word.push(n);
                }
            }
            c if c.is_whitespace() => {
                if in_word {
                    words.push(std::mem::take(&mut word));
                    in_word = false;
                }
            }
            c => {
                in_word = true;
                word.push(c);
            }
        }
    }
    if in_word {
        words.push(word);
    }
    words
}

fn parse(text: &str) -> Result<CstRootNode, String> {
    let text = if text.trim().is_empty() { "{}\n" } else { text };
    CstRootNode::parse(text, &ParseOptions::default()).map_err(|e| format!("not valid JSON: {e}"))
}

fn hooks_object(root: &CstRootNode) -> Result<(CstObject, Option<CstObject>), String> {
    let obj = root
        .object_value()
        .ok_or_else(|| "the file is not a JSON object".to_string())?;
    let hooks = match obj.get("hooks") {
        None => None,
        Some(p) => Some(
            p.object_value()
                .ok_or_else(|| "`hooks` is not an object".to_string())?,
        ),
    };
    Ok((obj, hooks))
}

fn event_array(hooks: &CstObject, event: &str) -> Result<Option<CstArray>, String> {
    match hooks.get(event) {
        None => Ok(None),
        Some(p) => p
            .array_value()
            .map(Some)
            .ok_or_else(|| format!("`hooks.{event}` is not a list")),
    }
}

/// Our entries in one event list: (group index, entry index within the group, command).
fn ours_in(list: &CstArray) -> Vec<(usize, usize, String)> {
    let mut out = Vec::new();
    for (gi, group) in list.elements().iter().enumerate() {
        let Some(entries) = group.as_object().and_then(|g| g.array_value("hooks")) else {
            continue;
        };
        for (ei, entry) in entries.elements().iter().enumerate() {
            let cmd = entry
                .as_object()
                .and_then(|e| e.get("command"))
                .and_then(|p| p.to_serde_value())
                .and_then(|v| v.as_str().map(str::to_string));
            if let Some(cmd) = cmd.filter(|c| is_ours_command(c)) {
                out.push((gi, ei, cmd));
            }
        }
    }
    out
}

/// Removes our entries from `list`, and each group they leave without entries. Returns
/// whether anything was removed.
fn remove_ours(list: &CstArray) -> bool {
    let found = ours_in(list);
    // Back to front, so indexes stay valid.
    for (gi, ei, _) in found.iter().rev() {
        let groups = list.elements();
        let Some(group) = groups.get(*gi).and_then(|g| g.as_object()) else {
            continue;
        };
        let Some(entries) = group.array_value("hooks") else {
            continue;
        };
        if let Some(e) = entries.elements().into_iter().nth(*ei) {
            e.remove();
        }
        if entries.elements().is_empty() {
            if let Some(g) = list.elements().into_iter().nth(*gi) {
                g.remove();
            }
        }
    }
    !found.is_empty()
}

fn group(command: &str) -> CstInputValue {
    CstInputValue::Object(vec![(
        "hooks".to_string(),
        CstInputValue::Array(vec![CstInputValue::Object(vec![
            ("type".to_string(), "command".into()),
            ("command".to_string(), command.into()),
            (
                "timeout".to_string(),
                CstInputValue::Number(HOOK_TIMEOUT_S.to_string()),
            ),
        ])]),
    )])
}

fn finish(root: &CstRootNode, before: &str, had_ours: bool) -> Edited {
    let mut text = root.to_string();
    if text != before && !text.ends_with('\n') {
        text.push('\n');
    }
    let status = if text == before {
        Status::Unchanged
    } else if had_ours {
        Status::Updated
    } else {
        Status::Added
    };
    Edited {
        status,
        text,
        foreign: None,
    }
}

/// `text` with our hook for each of [`EVENTS`] running exactly `spec`'s command (an empty text
/// starts a new file). Errors: not JSON, or `hooks` / an event list in another shape.
pub fn upsert(text: &str, spec: &HookSpec) -> Result<Edited, String> {
    let root = parse(text)?;
    let (obj, hooks) = hooks_object(&root)?;
    let hooks = match hooks {
        Some(h) => h,
        None => obj
            .append("hooks", CstInputValue::Object(Vec::new()))
            .object_value()
            .ok_or_else(|| "cannot add `hooks`".to_string())?,
    };
    let mut had_ours = false;
    for (event, sub) in EVENTS {
        let want = spec.command(sub);
        let list = match event_array(&hooks, event)? {
            Some(l) => l,
            None => hooks
                .append(event, CstInputValue::Array(Vec::new()))
                .array_value()
                .ok_or_else(|| format!("cannot add `hooks.{event}`"))?,
        };
        let ours = ours_in(&list);
        had_ours |= !ours.is_empty();
        if ours.len() == 1 && ours[0].2 == want {
            continue;
        }
        remove_ours(&list);
        list.append(group(&want));
    }
    Ok(finish(&root, text, had_ours))
}

/// `text` without our hook entries ([`Status::Removed`]; [`Status::Unchanged`] when there are
/// none). Errors: as [`upsert`].
pub fn remove(text: &str) -> Result<Edited, String> {
    let root = parse(text)?;
    let (_, hooks) = hooks_object(&root)?;
    let unchanged = || Edited {
        status: Status::Unchanged,
        text: text.to_string(),
        foreign: None,
    };
    let Some(hooks) = hooks else {
        return Ok(unchanged());
    };
    let mut removed = false;
    for (event, _) in EVENTS {
        let Some(list) = event_array(&hooks, event)? else {
            continue;
        };
        if remove_ours(&list) {
            removed = true;
            if list.elements().is_empty() {
                if let Some(p) = hooks.get(event) {
                    p.remove();
                }
            }
        }
    }
    if !removed {
        return Ok(unchanged());
    }
    if hooks.properties().is_empty() {
        if let Some(p) = root.object_value().and_then(|o| o.get("hooks")) {
            p.remove();
        }
    }
    let mut out = root.to_string();
    if text.trim().is_empty() {
        out.clear();
    }
    Ok(Edited {
        status: Status::Removed,
        text: out,
        foreign: None,
    })
}

/// Whether the Codex `config.toml` text turns hooks on (`[features] codex_hooks = true`).
pub fn codex_hooks_enabled(config_toml: &str) -> bool {
    config_toml
        .parse::<toml_edit::DocumentMut>()
        .ok()
        .and_then(|d| {
            d.get("features")
                .and_then(|f| f.get("codex_hooks"))
                .and_then(|v| v.as_bool())
        })
        .unwrap_or(false)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(agent: Option<&str>) -> HookSpec {
        HookSpec {
            exe: "/opt/my tools/agentmbx".into(),
            cli: "claude",
            agent: agent.map(str::to_string),
            home: Some("/h".into()),
        }
    }

    const THEIRS: &str = r#"{
  // my settings
  "model": "opus",
  "hooks": {
    "Stop": [
      { "hooks": [ { "type": "command", "command": "notify-send done" } ] }
    ]
  }
}
"#;

    #[test]
    fn the_command_is_quoted_and_recognized_as_ours() {
        let c = spec(Some("ana")).command("prompt");
        assert_eq!(
            c,
            "MBX_HOME=/h '/opt/my tools/agentmbx' hook prompt --cli claude --as ana"
        );
        assert!(is_ours_command(&c));
        assert!(is_ours_command("/usr/bin/agentmbx hook stop --cli codex"));
        assert!(!is_ours_command("notify-send done"));
        assert!(!is_ours_command("/usr/bin/agentmbx mcp"));
        assert!(!is_ours_command("echo agentmbx hook"));
    }

    #[test]
    fn install_is_idempotent_keeps_other_hooks_and_uninstall_gives_the_file_back() {
        let s = spec(Some("ana"));
        let added = upsert(THEIRS, &s).unwrap();
        assert_eq!(added.status, Status::Added);
        assert!(added
            .text
            .starts_with("{\n  // my settings\n  \"model\": \"opus\","));
        assert!(added.text.contains("notify-send done"));
        let v: serde_json::Value = CstRootNode::parse(&added.text, &ParseOptions::default())
            .unwrap()
            .to_serde_value()
            .unwrap();
        for (event, sub) in EVENTS {
            let cmds: Vec<String> = v["hooks"][event]
                .as_array()
                .unwrap()
                .iter()
                .flat_map(|g| g["hooks"].as_array().unwrap().clone())
                .map(|e| e["command"].as_str().unwrap().to_string())
                .collect();
            assert_eq!(
                cmds.iter().filter(|c| **c == s.command(sub)).count(),
                1,
                "{event}: {cmds:?}"
            );
        }
        assert_eq!(upsert(&added.text, &s).unwrap().status, Status::Unchanged);
        // Another agent: our entries are replaced, not added beside.
        let other = upsert(&added.text, &spec(Some("bo"))).unwrap();
        assert_eq!(other.status, Status::Updated);
        assert_eq!(other.text.matches("hook prompt").count(), 1);
        assert!(other.text.contains("--as bo") && !other.text.contains("--as ana"));
        let removed = remove(&other.text).unwrap();
        assert_eq!(removed.status, Status::Removed);
        assert_eq!(removed.text, THEIRS);
        assert_eq!(remove(THEIRS).unwrap().status, Status::Unchanged);
        // From nothing and back.
        let fresh = upsert("", &s).unwrap();
        assert_eq!(fresh.status, Status::Added);
        assert_eq!(remove(&fresh.text).unwrap().text.trim(), "{}");
        assert!(upsert("[1]", &s).is_err());
        assert!(upsert(r#"{"hooks": []}"#, &s).is_err());
    }

    #[test]
    fn codex_feature_flag_is_read() {
        assert!(codex_hooks_enabled("[features]\ncodex_hooks = true\n"));
        assert!(!codex_hooks_enabled("[features]\n"));
        assert!(!codex_hooks_enabled("not toml ["));
    }
}
