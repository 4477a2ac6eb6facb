//! Codex: `[mcp_servers.agentmbx]` in `$CODEX_HOME/config.toml` (default `~/.codex`), edited with
//! toml_edit so every other table, key, comment and blank line stays as it was.
//!
//! The entry setup writes (`agent-surface.md` "Registration"):
//!
//! ```toml
//! [mcp_servers.agentmbx]
//! command = "/usr/bin/agentmbx"
//! args = ["mcp", "--as", "ana"]
//! env = { MBX_HOME = "/srv/mbx" }   # only for a home that is not the default
//! startup_timeout_sec = 30
//! tool_timeout_sec = 90
//! ```
//!
//! On an existing entry of ours, setup sets `command`, `args` and `env.MBX_HOME` and adds the
//! timeouts only when they are missing (or, for `tool_timeout_sec`, not longer than
//! `mbx_wait`'s 45 s): a timeout or another variable the user set stays.

use toml_edit::{value, Array, DocumentMut, InlineTable, Item, Table, TableLike};

use super::{is_ours, Edited, Entry, ServerSpec, Status, SERVER_NAME};
use super::{CODEX_STARTUP_TIMEOUT_SEC, CODEX_TOOL_TIMEOUT_SEC};

/// `mbx_wait`'s longest wait (s): a `tool_timeout_sec` at or below it cuts waits short.
const WAIT_MAX_SEC: i64 = 45;

fn parse(text: &str) -> Result<DocumentMut, String> {
    text.parse::<DocumentMut>()
        .map_err(|e| format!("not valid TOML: {}", e.message()))
}

/// The `mcp_servers` table, if any. Errors: it is not a table.
fn servers(doc: &DocumentMut) -> Result<Option<&dyn TableLike>, String> {
    match doc.get("mcp_servers") {
        None => Ok(None),
        Some(item) => item
            .as_table_like()
            .map(Some)
            .ok_or_else(|| "`mcp_servers` is not a table".to_string()),
    }
}

/// Reads an entry's command, arguments and environment (missing parts empty).
fn entry_of(t: &dyn TableLike) -> Entry {
    let command = t
        .get("command")
        .and_then(Item::as_str)
        .unwrap_or_default()
        .to_string();
    let args = t
        .get("args")
        .and_then(Item::as_array)
        .map(|a| {
            a.iter()
                .map(|v| v.as_str().unwrap_or_default().to_string())
                .collect()
        })
        .unwrap_or_default();
    let mut env: Vec<(String, String)> = t
        .get("env")
        .and_then(Item::as_table_like)
        .map(|e| {
            e.iter()
                .map(|(k, v)| (k.to_string(), v.as_str().unwrap_or_default().to_string()))
                .collect()
        })
        .unwrap_or_default();
    env.sort();
    Entry { command, args, env }
}

/// The `agentmbx` entry of a Codex config text, if any. Errors: the text is not TOML, or
/// `mcp_servers` / the entry is not a table.
pub fn find(text: &str) -> Result<Option<Entry>, String> {
    let doc = parse(text)?;
    let Some(servers) = servers(&doc)? else {
        return Ok(None);
    };
    match servers.get(SERVER_NAME) {
        None => Ok(None),
        Some(item) => item
            .as_table_like()
            .map(|t| Some(entry_of(t)))
            .ok_or_else(|| format!("`mcp_servers.{SERVER_NAME}` is not a table")),
    }
}

/// `text` with our entry added or brought up to `spec` ([`Status::Added`], [`Status::Updated`],
/// [`Status::Unchanged`]), or left alone when an entry named `agentmbx` is not ours
/// ([`Status::Conflict`]). Errors: the text is not TOML, or has `mcp_servers` in another shape.
pub fn upsert(text: &str, spec: &ServerSpec) -> Result<Edited, String> {
    let mut doc = parse(text)?;
    let existing = find(text)?;
    if let Some(e) = &existing {
        if !is_ours(&e.command, &e.args) {
            return Ok(Edited {
                status: Status::Conflict,
                text: text.to_string(),
                foreign: Some(e.clone()),
            });
        }
    }
    if doc.get("mcp_servers").is_none() {
        let mut t = Table::new();
        t.set_implicit(true);
        doc.insert("mcp_servers", Item::Table(t));
    }
    let servers = doc["mcp_servers"]
        .as_table_like_mut()
        .ok_or("`mcp_servers` is not a table")?;
    if existing.is_none() {
        let mut t = Table::new();
        t.insert("command", value(spec.command.as_str()));
        t.insert("args", value(args_array(spec)));
        if !spec.env.is_empty() {
            let mut env = InlineTable::new();
            for (k, v) in &spec.env {
                env.insert(k, v.as_str().into());
            }
            t.insert("env", value(env));
        }
        t.insert("startup_timeout_sec", value(CODEX_STARTUP_TIMEOUT_SEC));
        t.insert("tool_timeout_sec", value(CODEX_TOOL_TIMEOUT_SEC));
        servers.insert(SERVER_NAME, Item::Table(t));
        return Ok(Edited {
            status: Status::Added,
            text: doc.to_string(),
            foreign: None,
        });
    }
    let t = servers
        .get_mut(SERVER_NAME)
        .and_then(Item::as_table_like_mut)
        .ok_or_else(|| format!("`mcp_servers.{SERVER_NAME}` is not a table"))?;
    if t.get("command").and_then(Item::as_str) != Some(spec.command.as_str()) {
        set_keep_decor(t, "command", value(spec.command.as_str()));
    }
    let args_now = entry_of(t).args;
    if args_now != spec.args {
        set_keep_decor(t, "args", value(args_array(spec)));
    }
    set_home_env(t, spec)?;
    if t.get("startup_timeout_sec").is_none() {
        t.insert("startup_timeout_sec", value(CODEX_STARTUP_TIMEOUT_SEC));
    }
    let tool = t.get("tool_timeout_sec").and_then(Item::as_integer);
    if tool.is_none_or(|s| s <= WAIT_MAX_SEC) {
        set_keep_decor(t, "tool_timeout_sec", value(CODEX_TOOL_TIMEOUT_SEC));
    }
    let new = doc.to_string();
    let status = if new == text {
        Status::Unchanged
    } else {
        Status::Updated
    };
    Ok(Edited {
        status,
        text: new,
        foreign: None,
    })
}

/// `text` without our entry ([`Status::Removed`]; [`Status::Unchanged`] when there is none), or
/// left alone when the entry named `agentmbx` is not ours ([`Status::Conflict`]). An implicit
/// `mcp_servers` left empty goes too (it renders nothing either way). Errors: as [`upsert`].
pub fn remove(text: &str) -> Result<Edited, String> {
    let unchanged = |status, foreign| Edited {
        status,
        text: text.to_string(),
        foreign,
    };
    let Some(e) = find(text)? else {
        return Ok(unchanged(Status::Unchanged, None));
    };
    if !is_ours(&e.command, &e.args) {
        return Ok(unchanged(Status::Conflict, Some(e)));
    }
    let mut doc = parse(text)?;
    let servers = doc["mcp_servers"]
        .as_table_like_mut()
        .ok_or("`mcp_servers` is not a table")?;
    servers.remove(SERVER_NAME);
    let empty_implicit = doc["mcp_servers"]
        .as_table()
        .is_some_and(|t| t.is_empty() && t.is_implicit());
    if empty_implicit {
        doc.remove("mcp_servers");
    }
    Ok(Edited {
        status: Status::Removed,
        text: doc.to_string(),
        foreign: None,
    })
}

fn args_array(spec: &ServerSpec) -> Array {
    spec.args.iter().map(String::as_str).collect()
}

/// Sets `key` to `item`, keeping the old value's surrounding whitespace and comments.
fn set_keep_decor(t: &mut dyn TableLike, key: &str, mut item: Item) {
    if let (Some(old), Some(new)) = (t.get(key).and_then(Item::as_value), item.as_value_mut()) {
        *new.decor_mut() = old.decor().clone();
    }
    t.insert(key, item);
}

/// Sets `env.MBX_HOME` as `spec` wants it (removed when `spec` has no env), keeping every other
/// variable; an `env` left empty goes.
fn set_home_env(t: &mut dyn TableLike, spec: &ServerSpec) -> Result<(), String> {
    let key = crate::paths::HOME_ENV;
    let want = spec.env.iter().find(|(k, _)| k == key).map(|(_, v)| v);
    match t.get_mut("env") {
        None => {
            if let Some(v) = want {
                let mut env = InlineTable::new();
                env.insert(key, v.as_str().into());
                t.insert("env", value(env));
            }
        }
        Some(item) => {
            let env = item
                .as_table_like_mut()
                .ok_or_else(|| format!("`mcp_servers.{SERVER_NAME}.env` is not a table"))?;
            match want {
                Some(v) if env.get(key).and_then(Item::as_str) != Some(v.as_str()) => {
                    set_keep_decor(env, key, value(v.as_str()));
                }
                Some(_) => {}
                None => {
                    env.remove(key);
                    if env.is_empty() {
                        t.remove("env");
                    }
                }
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::Path;

    const OTHERS: &str = r#"# Codex settings, kept by hand
model = "o4-mini"   # the fast one

[mcp_servers.docs]
# the docs server
command = "npx"
args = ["-y", "docs-mcp"]  # pinned
env = { TOKEN_FILE = "/x" }

# profiles below
[profiles.fast]
model = "o4-mini"
"#;

    fn spec() -> ServerSpec {
        ServerSpec::new(Path::new("/opt/bin/agentmbx"), Some("ana"), None)
    }

    #[test]
    fn add_keeps_everything_and_remove_gives_the_file_back() {
        let added = upsert(OTHERS, &spec()).unwrap();
        assert_eq!(added.status, Status::Added);
        // Only lines added (next to the other servers), none changed or removed.
        let diff = super::super::diff::unified("c", OTHERS, &added.text);
        assert!(diff.lines().skip(2).all(|l| !l.starts_with('-')), "{diff}");
        assert!(added.text.contains("[mcp_servers.agentmbx]\ncommand = \"/opt/bin/agentmbx\"\nargs = [\"mcp\", \"--as\", \"ana\"]\nstartup_timeout_sec = 30\ntool_timeout_sec = 90\n"), "{}", added.text);
        let e = find(&added.text).unwrap().unwrap();
        assert!(e.matches(&spec()));
        let doc: toml::Table = toml::from_str(&added.text).unwrap();
        let ours = &doc["mcp_servers"]["agentmbx"];
        assert_eq!(ours["tool_timeout_sec"].as_integer(), Some(90));
        assert_eq!(ours["startup_timeout_sec"].as_integer(), Some(30));
        let again = upsert(&added.text, &spec()).unwrap();
        assert_eq!(again.status, Status::Unchanged);
        assert_eq!(again.text, added.text);
        let removed = remove(&added.text).unwrap();
        assert_eq!(removed.status, Status::Removed);
        assert_eq!(removed.text, OTHERS);
        assert_eq!(remove(OTHERS).unwrap().status, Status::Unchanged);
    }

    #[test]
    fn empty_and_missing_file_round_trip() {
        let added = upsert("", &spec()).unwrap();
        assert_eq!(added.status, Status::Added);
        assert!(
            added.text.starts_with("[mcp_servers.agentmbx]\n"),
            "{}",
            added.text
        );
        assert_eq!(remove(&added.text).unwrap().text, "");
    }

    #[test]
    fn update_keeps_the_users_timeouts_and_variables() {
        let old = "[mcp_servers.agentmbx]\ncommand = \"/old/agentmbx\" # moved\nargs = [\"mcp\"]\nenv = { MBX_HOME = \"/h\", RUST_LOG = \"debug\" }\ntool_timeout_sec = 300\n";
        let up = upsert(old, &spec()).unwrap();
        assert_eq!(up.status, Status::Updated);
        assert!(
            up.text.contains("command = \"/opt/bin/agentmbx\" # moved"),
            "{}",
            up.text
        );
        assert!(up.text.contains("tool_timeout_sec = 300"), "{}", up.text);
        assert!(up.text.contains("RUST_LOG = \"debug\""), "{}", up.text);
        let e = find(&up.text).unwrap().unwrap();
        assert_eq!(e.args, ["mcp", "--as", "ana"]);
        assert_eq!(e.env, [("RUST_LOG".to_string(), "debug".to_string())]);
        assert_eq!(upsert(&up.text, &spec()).unwrap().status, Status::Unchanged);
        let short = "[mcp_servers.agentmbx]\ncommand = \"/opt/bin/agentmbx\"\nargs = [\"mcp\", \"--as\", \"ana\"]\nstartup_timeout_sec = 5\ntool_timeout_sec = 30\n";
        let up = upsert(short, &spec()).unwrap();
        assert!(up.text.contains("tool_timeout_sec = 90"), "{}", up.text);
        assert!(up.text.contains("startup_timeout_sec = 5"), "{}", up.text);
    }

    #[test]
    fn foreign_entry_is_left_alone() {
        let foreign =
            "[mcp_servers.agentmbx]\ncommand = \"npx\"\nargs = [\"agentmbx-ts\", \"mcp\"]\n";
        for edited in [upsert(foreign, &spec()).unwrap(), remove(foreign).unwrap()] {
            assert_eq!(edited.status, Status::Conflict);
            assert_eq!(edited.text, foreign);
            assert_eq!(edited.foreign.unwrap().command, "npx");
        }
    }

    #[test]
    fn bad_files_are_refused() {
        assert!(upsert("model = ", &spec())
            .unwrap_err()
            .contains("not valid TOML"));
        assert!(upsert("mcp_servers = 3\n", &spec())
            .unwrap_err()
            .contains("not a table"));
        assert!(remove("[mcp_servers]\nagentmbx = 1\n").is_err());
    }

    #[test]
    fn home_env_added_and_dropped() {
        let with = ServerSpec::new(
            Path::new("/opt/bin/agentmbx"),
            None,
            Some(Path::new("/srv/h")),
        );
        let added = upsert("", &with).unwrap();
        assert!(
            added.text.contains("env = { MBX_HOME = \"/srv/h\" }"),
            "{}",
            added.text
        );
        let plain = ServerSpec::new(Path::new("/opt/bin/agentmbx"), None, None);
        let up = upsert(&added.text, &plain).unwrap();
        assert_eq!(up.status, Status::Updated);
        assert!(!up.text.contains("env"), "{}", up.text);
    }
}
