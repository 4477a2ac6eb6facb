//! Claude Code's project file `.mcp.json`: `{"mcpServers": {"agentmbx": {"command", "args",
//! "env"}}}` (`agent-surface.md` "Registration"), edited through jsonc-parser's concrete syntax
//! tree so every other server, key order, whitespace and comment stays as it was.
//!
//! On an existing entry of ours setup sets `command`, `args` and `env.MBX_HOME` (other keys and
//! variables stay). Removing our entry also removes an `mcpServers` left empty.

use jsonc_parser::cst::{CstInputValue, CstObject, CstRootNode};
use jsonc_parser::ParseOptions;
use serde_json::Value;

use super::{is_ours, Edited, Entry, ServerSpec, Status, SERVER_NAME};

/// The top-level key holding the servers.
const SERVERS: &str = "mcpServers";

fn parse(text: &str) -> Result<CstRootNode, String> {
    let text = if text.trim().is_empty() { "{}\n" } else { text };
    let root = CstRootNode::parse(text, &ParseOptions::default())
        .map_err(|e| format!("not valid JSON: {e}"))?;
    Ok(root)
}

fn root_object(root: &CstRootNode) -> Result<CstObject, String> {
    root.object_value()
        .ok_or_else(|| "the file is not a JSON object".to_string())
}

/// The `mcpServers` object, if any. Errors: it is not an object.
fn servers(obj: &CstObject) -> Result<Option<CstObject>, String> {
    match obj.get(SERVERS) {
        None => Ok(None),
        Some(p) => p
            .object_value()
            .map(Some)
            .ok_or_else(|| format!("`{SERVERS}` is not an object")),
    }
}

/// Reads an entry (missing or mistyped parts empty).
fn entry_of(v: &Value) -> Entry {
    let s = |v: &Value| v.as_str().unwrap_or_default().to_string();
    let mut env: Vec<(String, String)> = v
        .get("env")
        .and_then(Value::as_object)
        .map(|m| m.iter().map(|(k, v)| (k.clone(), s(v))).collect())
        .unwrap_or_default();
    env.sort();
    Entry {
        command: v.get("command").map(s).unwrap_or_default(),
        args: v
            .get("args")
            .and_then(Value::as_array)
            .map(|a| a.iter().map(s).collect())
            .unwrap_or_default(),
        env,
    }
}

/// The `agentmbx` entry of a `.mcp.json` text, if any. Errors: not JSON, or `mcpServers` / the
/// entry is not an object.
pub fn find(text: &str) -> Result<Option<Entry>, String> {
    let root = parse(text)?;
    let Some(servers) = servers(&root_object(&root)?)? else {
        return Ok(None);
    };
    match servers.get(SERVER_NAME) {
        None => Ok(None),
        Some(p) => match p.to_serde_value() {
            Some(v @ Value::Object(_)) => Ok(Some(entry_of(&v))),
            _ => Err(format!("`{SERVERS}.{SERVER_NAME}` is not an object")),
        },
    }
}

fn strings(v: &[String]) -> CstInputValue {
    CstInputValue::Array(v.iter().map(|s| s.as_str().into()).collect())
}

fn env_value(env: &[(String, String)]) -> CstInputValue {
    CstInputValue::Object(
        env.iter()
            .map(|(k, v)| (k.clone(), v.as_str().into()))
            .collect(),
    )
}

fn new_entry(spec: &ServerSpec) -> CstInputValue {
    let mut fields = vec![
        ("command".to_string(), spec.command.as_str().into()),
        ("args".to_string(), strings(&spec.args)),
    ];
    if !spec.env.is_empty() {
        fields.push(("env".to_string(), env_value(&spec.env)));
    }
    CstInputValue::Object(fields)
}

/// `text` with our entry added or brought up to `spec`, or left alone when the entry named
/// `agentmbx` is not ours ([`Status::Conflict`]); an empty text starts a new file. Errors: not
/// JSON, or `mcpServers` in another shape.
pub fn upsert(text: &str, spec: &ServerSpec) -> Result<Edited, String> {
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
    let root = parse(text)?;
    let obj = root_object(&root)?;
    let Some(servers) = servers(&obj)? else {
        obj.append(
            SERVERS,
            CstInputValue::Object(vec![(SERVER_NAME.to_string(), new_entry(spec))]),
        );
        return Ok(added(&root));
    };
    let Some(prop) = servers.get(SERVER_NAME) else {
        servers.append(SERVER_NAME, new_entry(spec));
        return Ok(added(&root));
    };
    let e = existing.unwrap_or(Entry {
        command: String::new(),
        args: Vec::new(),
        env: Vec::new(),
    });
    let entry = prop
        .object_value()
        .ok_or_else(|| format!("`{SERVERS}.{SERVER_NAME}` is not an object"))?;
    let set = |key: &str, v: CstInputValue| match entry.get(key) {
        Some(p) => p.set_value(v),
        None => {
            entry.append(key, v);
        }
    };
    if e.command != spec.command {
        set("command", spec.command.as_str().into());
    }
    if e.args != spec.args {
        set("args", strings(&spec.args));
    }
    let key = crate::paths::HOME_ENV;
    let want = spec.env.iter().find(|(k, _)| k == key);
    let have = e.env.iter().find(|(k, _)| k == key);
    if want != have {
        match (entry.object_value("env"), want) {
            (Some(env), Some((_, v))) => match env.get(key) {
                Some(p) => p.set_value(v.as_str().into()),
                None => {
                    env.append(key, v.as_str().into());
                }
            },
            (None, Some(_)) => set("env", env_value(&spec.env)),
            (Some(env), None) => {
                if let Some(p) = env.get(key) {
                    p.remove();
                }
                if env.properties().is_empty() {
                    if let Some(p) = entry.get("env") {
                        p.remove();
                    }
                }
            }
            (None, None) => {}
        }
    }
    let new = root.to_string();
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

fn added(root: &CstRootNode) -> Edited {
    let mut text = root.to_string();
    if !text.ends_with('\n') {
        text.push('\n');
    }
    Edited {
        status: Status::Added,
        text,
        foreign: None,
    }
}

/// `text` without our entry ([`Status::Removed`]; [`Status::Unchanged`] when there is none), or
/// left alone when the entry named `agentmbx` is not ours ([`Status::Conflict`]). Errors: as
/// [`upsert`].
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
    let root = parse(text)?;
    let obj = root_object(&root)?;
    if let Some(servers) = servers(&obj)? {
        if let Some(p) = servers.get(SERVER_NAME) {
            p.remove();
        }
        if servers.properties().is_empty() {
            if let Some(p) = obj.get(SERVERS) {
                p.remove();
            }
        }
    }
    Ok(Edited {
        status: Status::Removed,
        text: root.to_string(),
        foreign: None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::Path;

    const OTHERS: &str = r#"{
  "mcpServers": {
    "docs": {
      "command": "npx",
      "args": ["-y", "docs-mcp"],
      "env": {"TOKEN_FILE": "/x"}
    },
    "zeta": {"type": "http", "url": "https://example.invalid/mcp"}
  },
  "otherKey": [1, 2, 3]
}
"#;

    fn spec() -> ServerSpec {
        ServerSpec::new(
            Path::new("/opt/bin/agentmbx"),
            Some("ana"),
            Some(Path::new("/h")),
        )
    }

    #[test]
    fn add_keeps_others_in_order_and_remove_gives_the_file_back() {
        let added = upsert(OTHERS, &spec()).unwrap();
        assert_eq!(added.status, Status::Added);
        let v: Value = serde_json::from_str(&added.text).unwrap();
        assert_eq!(
            v["mcpServers"]["agentmbx"]["args"],
            serde_json::json!(["mcp", "--as", "ana"])
        );
        assert_eq!(v["mcpServers"]["agentmbx"]["env"]["MBX_HOME"], "/h");
        let docs = added.text.find("\"docs\"").unwrap();
        let zeta = added.text.find("\"zeta\"").unwrap();
        let ours = added.text.find("\"agentmbx\"").unwrap();
        let other = added.text.find("\"otherKey\"").unwrap();
        assert!(docs < zeta && zeta < ours && ours < other, "{}", added.text);
        assert!(find(&added.text).unwrap().unwrap().matches(&spec()));
        let again = upsert(&added.text, &spec()).unwrap();
        assert_eq!(again.status, Status::Unchanged);
        assert_eq!(again.text, added.text);
        let removed = remove(&added.text).unwrap();
        assert_eq!(removed.status, Status::Removed);
        assert_eq!(removed.text, OTHERS);
    }

    #[test]
    fn new_file_and_file_without_servers() {
        let added = upsert("", &spec()).unwrap();
        assert_eq!(added.status, Status::Added);
        let v: Value = serde_json::from_str(&added.text).unwrap();
        assert_eq!(v["mcpServers"]["agentmbx"]["command"], "/opt/bin/agentmbx");
        let plain = "{\n  \"a\": 1\n}\n";
        let added = upsert(plain, &spec()).unwrap();
        assert_eq!(remove(&added.text).unwrap().text, plain);
    }

    #[test]
    fn update_and_foreign() {
        let old = r#"{"mcpServers": {"agentmbx": {"type": "stdio", "command": "/old/agentmbx", "args": ["mcp"], "env": {"MBX_HOME": "/h", "X": "1"}}}}"#;
        let up = upsert(old, &spec()).unwrap();
        assert_eq!(up.status, Status::Updated);
        let e = find(&up.text).unwrap().unwrap();
        assert_eq!(e.command, "/opt/bin/agentmbx");
        assert_eq!(e.args, ["mcp", "--as", "ana"]);
        assert!(up.text.contains("\"type\": \"stdio\""), "{}", up.text);
        assert!(up.text.contains("\"X\": \"1\""), "{}", up.text);
        assert_eq!(upsert(&up.text, &spec()).unwrap().status, Status::Unchanged);
        let foreign = r#"{"mcpServers": {"agentmbx": {"command": "npx", "args": ["agentmbx"]}}}"#;
        assert_eq!(upsert(foreign, &spec()).unwrap().status, Status::Conflict);
        assert_eq!(remove(foreign).unwrap().text, foreign);
    }

    #[test]
    fn bad_files_are_refused() {
        assert!(upsert("{", &spec()).is_err());
        assert!(upsert("[1]", &spec())
            .unwrap_err()
            .contains("not a JSON object"));
        assert!(upsert(r#"{"mcpServers": 1}"#, &spec())
            .unwrap_err()
            .contains("not an object"));
    }
}
