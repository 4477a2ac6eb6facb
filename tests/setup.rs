//! `agentmbx setup` against fake homes (issue 18 part 4): `HOME` and the Codex directory in a
//! temp dir, holding a `config.toml` full of other servers and comments, and a fake `claude` on a
//! temp `PATH` — a shell script that logs its arguments to a file and keeps one user-scope entry,
//! printing it as `claude mcp get` does. Checked: the entry written (Codex file, the exact
//! `claude mcp add` call, a project `.mcp.json`), running twice changes nothing byte for byte,
//! `--dry-run` writes nothing, `--uninstall` gives the files back byte for byte and removes only
//! our entry, a client not installed is skipped, no terminal and no `--yes` refuses (exit 2), and
//! the `mcp-setup` doctor check (skip, ok, warn with the fix).

use crate::helper;

use std::path::PathBuf;
use std::process::Command;

use serde_json::Value;

use crate::helper::{run, Output};

/// A fake `claude`: logs `$*` to `$FAKE_CLAUDE_LOG`; `$FAKE_CLAUDE_STATE` holds the one
/// user-scope entry as `claude mcp get` prints it.
const FAKE_CLAUDE: &str = r#"#!/bin/sh
printf '%s\n' "$*" >> "$FAKE_CLAUDE_LOG"
state="$FAKE_CLAUDE_STATE"
case "$1 $2" in
"mcp get")
  if [ -f "$state" ]; then cat "$state"; exit 0; fi
  echo "No MCP server found with name: $3" >&2; exit 1 ;;
"mcp remove")
  if [ -f "$state" ]; then rm "$state"; echo "Removed MCP server $5 from user config"; exit 0; fi
  echo "No user-scoped MCP server found with name: $5" >&2; exit 1 ;;
"mcp add")
  shift 2
  envs=""; name=""
  while [ "$#" -gt 0 ] && [ "$1" != "--" ]; do
    case "$1" in
      --env) envs="$envs    $2
"; shift 2 ;;
      --transport|--scope) shift 2 ;;
      *) name="$1"; shift ;;
    esac
  done
  shift
  if [ -f "$state" ]; then echo "MCP server $name already exists in user config" >&2; exit 1; fi
  cmd="$1"; shift
  { echo "$name:"
    echo "  Scope: User config (available in all your projects)"
    echo "  Status: ✓ Connected"
    echo "  Type: stdio"
    echo "  Command: $cmd"
    echo "  Args: $*"
    if [ -n "$envs" ]; then echo "  Environment:"; printf '%s' "$envs"; fi
    echo
    echo "To remove this server, run: claude mcp remove \"$name\" -s user"
  } > "$state"
  echo "Added stdio MCP server $name to user config" ;;
*) echo "unexpected: $*" >&2; exit 64 ;;
esac
"#;

/// A Codex config full of other entries and comments.
const CODEX_CONFIG: &str = r#"# Codex settings, kept by hand
model = "o4-mini"   # the fast one
approval_policy = "on-request"

[mcp_servers.docs]
# the docs server
command = "npx"
args = ["-y", "docs-mcp"]  # pinned
env = { TOKEN_FILE = "/x" }

[mcp_servers.search]
command = "/usr/local/bin/search-mcp"
tool_timeout_sec = 120

# profiles below
[profiles.fast]
model = "o4-mini"
"#;

/// A project `.mcp.json` with other servers.
const MCP_JSON: &str = r#"{
  "mcpServers": {
    "docs": {
      "command": "npx",
      "args": ["-y", "docs-mcp"],
      "env": {"TOKEN_FILE": "/x"}
    },
    "remote": {"type": "http", "url": "https://example.invalid/mcp"}
  },
  "note": "kept"
}
"#;

/// A temp world: `home/` (HOME, with `.codex/config.toml`), `bin/claude`, `mbx/` (MBX_HOME),
/// `work/` (the working directory).
struct World {
    dir: tempfile::TempDir,
}

impl World {
    fn new(codex: bool, claude: bool) -> World {
        let w = World {
            dir: tempfile::tempdir().expect("tempdir"),
        };
        for d in ["home", "bin", "work", "mbx"] {
            std::fs::create_dir_all(w.path(d)).expect("mkdir");
        }
        if codex {
            std::fs::create_dir_all(w.path("home/.codex")).expect("mkdir");
            std::fs::write(w.codex_file(), CODEX_CONFIG).expect("write");
        }
        if claude {
            let exe = w.path("bin/claude");
            std::fs::write(&exe, FAKE_CLAUDE).expect("write");
            #[cfg(unix)]
            {
                use std::os::unix::fs::PermissionsExt;
                std::fs::set_permissions(&exe, std::fs::Permissions::from_mode(0o755))
                    .expect("chmod");
            }
        }
        w
    }

    fn path(&self, rel: &str) -> PathBuf {
        self.dir.path().join(rel)
    }

    fn codex_file(&self) -> PathBuf {
        self.path("home/.codex/config.toml")
    }

    fn codex(&self) -> String {
        std::fs::read_to_string(self.codex_file()).expect("codex config")
    }

    /// The fake claude's call log (empty when never called).
    fn claude_log(&self) -> String {
        std::fs::read_to_string(self.path("claude.log")).unwrap_or_default()
    }

    /// The fake claude's user-scope entry, if any.
    fn claude_state(&self) -> Option<String> {
        std::fs::read_to_string(self.path("claude.state")).ok()
    }

    fn command(&self, args: &[&str]) -> Command {
        let mut cmd = helper::command(args);
        let path = format!("{}:/usr/bin:/bin", self.path("bin").display());
        cmd.env("HOME", self.path("home"))
            .env_remove("CODEX_HOME")
            .env_remove("CLAUDE_CONFIG_DIR")
            .env("PATH", path)
            .env("FAKE_CLAUDE_LOG", self.path("claude.log"))
            .env("FAKE_CLAUDE_STATE", self.path("claude.state"))
            .env("MBX_HOME", self.path("mbx"))
            .current_dir(self.path("work"));
        cmd
    }

    fn run(&self, args: &[&str]) -> Output {
        run(self.command(args))
    }

    /// `setup <args> --json`, parsed, with the exit code.
    fn json(&self, args: &[&str]) -> (Option<i32>, Value) {
        let mut full = vec!["setup"];
        full.extend_from_slice(args);
        full.push("--json");
        let out = self.run(&full);
        let v = serde_json::from_str(&out.stdout).unwrap_or_else(|e| panic!("{e}: {out:#?}"));
        (out.code(), v)
    }
}

fn statuses(v: &Value) -> Vec<(String, String)> {
    v["clients"]
        .as_array()
        .expect("clients")
        .iter()
        .map(|c| {
            (
                c["client"].as_str().expect("client").to_string(),
                c["status"].as_str().expect("status").to_string(),
            )
        })
        .collect()
}

fn pairs(list: &[(&str, &str)]) -> Vec<(String, String)> {
    list.iter()
        .map(|(a, b)| (a.to_string(), b.to_string()))
        .collect()
}

fn bin() -> String {
    std::fs::canonicalize(helper::bin())
        .expect("bin")
        .display()
        .to_string()
}

/// The lines of `after` that are not in `before`, when `after` keeps every line of `before` in
/// order (panics otherwise).
fn added_lines(before: &str, after: &str) -> Vec<String> {
    let mut b = before.lines().peekable();
    let mut added = Vec::new();
    for line in after.lines() {
        if b.peek() == Some(&line) {
            b.next();
        } else {
            added.push(line.to_string());
        }
    }
    assert!(
        b.peek().is_none(),
        "a line of the original is missing: {:?}\n{after}",
        b.peek()
    );
    added
}

#[test]
fn setup_registers_once_and_a_second_run_changes_nothing() {
    let w = World::new(true, true);
    let mbx = w.path("mbx").display().to_string();
    let out = w.run(&["setup", "--as", "ana", "--yes"]);
    out.assert_success();
    assert!(out.stdout.contains("Claude Code: added"), "{}", out.stdout);
    assert!(out.stdout.contains("Codex: added"), "{}", out.stdout);

    // Codex: only our table added; every other entry and comment kept.
    let codex = w.codex();
    let added = added_lines(CODEX_CONFIG, &codex);
    let want = [
        "[mcp_servers.agentmbx]".to_string(),
        format!("command = \"{}\"", bin()),
        "args = [\"mcp\", \"--as\", \"ana\"]".to_string(),
        format!("env = {{ MBX_HOME = \"{mbx}\" }}"),
        "startup_timeout_sec = 30".to_string(),
        "tool_timeout_sec = 90".to_string(),
        "".to_string(),
    ];
    assert_eq!(added, want, "{codex}");
    let parsed: toml::Table = toml::from_str(&codex).expect("valid TOML");
    assert_eq!(
        parsed["mcp_servers"]["search"]["tool_timeout_sec"].as_integer(),
        Some(120)
    );

    // Claude Code: the documented CLI call, user scope, env before the name.
    let log = w.claude_log();
    let add = format!(
        "mcp add --env MBX_HOME={mbx} --transport stdio --scope user agentmbx -- {} mcp --as ana",
        bin()
    );
    assert_eq!(
        log.lines().collect::<Vec<_>>(),
        ["mcp get agentmbx", add.as_str()],
        "{log}"
    );

    // A second run: nothing written, nothing called but `get`.
    let state = w.claude_state().expect("claude entry");
    let (code, v) = w.json(&["--as", "ana", "--yes"]);
    assert_eq!(code, Some(0), "{v}");
    assert_eq!(
        statuses(&v),
        pairs(&[("claude", "unchanged"), ("codex", "unchanged")])
    );
    assert_eq!(w.codex(), codex);
    assert_eq!(w.claude_state().as_deref(), Some(state.as_str()));
    let out = w.run(&["setup", "--as", "ana"]);
    out.assert_success();
    assert_eq!(
        out.stdout.matches("already set up").count(),
        2,
        "{}",
        out.stdout
    );
    assert_eq!(w.codex(), codex);
    let calls: Vec<String> = w.claude_log().lines().map(str::to_string).collect();
    assert_eq!(calls.len(), 4, "{calls:?}");
    assert!(
        calls[2..].iter().all(|c| c == "mcp get agentmbx"),
        "{calls:?}"
    );

    // Another agent: an update, in place.
    let (code, v) = w.json(&["--as", "bob", "--yes", "--only", "codex"]);
    assert_eq!(code, Some(0), "{v}");
    assert_eq!(statuses(&v), pairs(&[("codex", "updated")]));
    let now = w.codex();
    assert!(now.contains("args = [\"mcp\", \"--as\", \"bob\"]"), "{now}");
    assert_eq!(added_lines(CODEX_CONFIG, &now).len(), want.len());
    assert_eq!(
        w.claude_log().lines().count(),
        4,
        "--only codex left claude alone"
    );
}

#[test]
fn dry_run_prints_the_change_and_writes_nothing() {
    let w = World::new(true, true);
    let out = w.run(&["setup", "--dry-run"]);
    out.assert_success();
    assert!(
        out.stdout.contains("Claude Code: would add"),
        "{}",
        out.stdout
    );
    assert!(
        out.stdout.contains("claude mcp add --env MBX_HOME=") && out.stdout.contains(" mcp\n"),
        "{}",
        out.stdout
    );
    assert!(
        out.stdout.contains("+[mcp_servers.agentmbx]"),
        "{}",
        out.stdout
    );
    assert!(
        out.stdout.contains("dry run: nothing written"),
        "{}",
        out.stdout
    );
    assert_eq!(w.codex(), CODEX_CONFIG);
    assert_eq!(w.claude_state(), None);
    assert_eq!(w.claude_log(), "mcp get agentmbx\n");

    let (code, v) = w.json(&["--dry-run"]);
    assert_eq!(code, Some(0));
    assert_eq!(
        statuses(&v),
        pairs(&[("claude", "would-add"), ("codex", "would-add")])
    );
    assert!(v["clients"][1]["change"]
        .as_str()
        .expect("diff")
        .contains("+tool_timeout_sec = 90"));
    assert_eq!(w.codex(), CODEX_CONFIG);

    // Dry-run of an uninstall after a real setup: would remove, still writes nothing.
    w.run(&["setup", "--yes"]).assert_success();
    let codex = w.codex();
    let (_, v) = w.json(&["--uninstall", "--dry-run"]);
    assert_eq!(
        statuses(&v),
        pairs(&[("claude", "would-remove"), ("codex", "would-remove")])
    );
    assert_eq!(w.codex(), codex);
    assert!(w.claude_state().is_some());
}

#[test]
fn uninstall_removes_only_ours_and_gives_the_files_back() {
    let w = World::new(true, true);
    w.run(&["setup", "--as", "ana", "--yes"]).assert_success();
    let out = w.run(&["setup", "--uninstall", "--yes"]);
    out.assert_success();
    assert!(out.stdout.contains("Codex: removed"), "{}", out.stdout);
    assert_eq!(w.codex(), CODEX_CONFIG, "byte for byte");
    assert_eq!(w.claude_state(), None);
    assert!(w
        .claude_log()
        .lines()
        .any(|l| l == "mcp remove --scope user agentmbx"));

    // Again: nothing to remove, nothing written.
    let (code, v) = w.json(&["--uninstall", "--yes"]);
    assert_eq!(code, Some(0), "{v}");
    assert_eq!(
        statuses(&v),
        pairs(&[("claude", "unchanged"), ("codex", "unchanged")])
    );

    // Entries named agentmbx that setup did not write are left alone (exit 1, say why).
    let foreign = format!(
        "{CODEX_CONFIG}\n[mcp_servers.agentmbx]\ncommand = \"npx\"\nargs = [\"agentmbx-ts\"]\n"
    );
    std::fs::write(w.codex_file(), &foreign).expect("write");
    std::fs::write(
        w.path("claude.state"),
        "agentmbx:\n  Scope: User config (available in all your projects)\n  Type: stdio\n  Command: npx\n  Args: agentmbx-ts mcp\n",
    )
    .expect("write");
    let calls = w.claude_log().lines().count();
    for args in [&["--uninstall", "--yes"][..], &["--yes"]] {
        let (code, v) = w.json(args);
        assert_eq!(code, Some(1), "{v}");
        assert_eq!(
            statuses(&v),
            pairs(&[("claude", "conflict"), ("codex", "conflict")])
        );
        assert!(v["clients"][1]["note"]
            .as_str()
            .expect("note")
            .contains("npx"));
    }
    assert_eq!(w.codex(), foreign);
    assert!(w.claude_state().is_some());
    assert!(
        w.claude_log()
            .lines()
            .skip(calls)
            .all(|l| l == "mcp get agentmbx"),
        "{}",
        w.claude_log()
    );
}

#[test]
fn project_mcp_json_keeps_other_servers() {
    let w = World::new(false, true);
    let proj = w.path("proj");
    std::fs::create_dir_all(&proj).expect("mkdir");
    let file = proj.join(".mcp.json");
    std::fs::write(&file, MCP_JSON).expect("write");
    let p = proj.display().to_string();
    let (code, v) = w.json(&["--only", "claude", "--project", &p, "--as", "ana", "--yes"]);
    assert_eq!(code, Some(0), "{v}");
    assert_eq!(statuses(&v), pairs(&[("claude", "added")]));
    let after = std::fs::read_to_string(&file).expect("read");
    let j: Value = serde_json::from_str(&after).expect("valid JSON");
    assert_eq!(j["mcpServers"]["agentmbx"]["command"], bin().as_str());
    assert_eq!(
        j["mcpServers"]["agentmbx"]["args"],
        serde_json::json!(["mcp", "--as", "ana"])
    );
    assert_eq!(j["mcpServers"]["remote"]["type"], "http");
    let keys: Vec<&str> = j["mcpServers"]
        .as_object()
        .expect("servers")
        .keys()
        .map(String::as_str)
        .collect();
    assert_eq!(keys.len(), 3);
    // The other servers' text kept as written (only a comma after the last one is added).
    let docs_block = &MCP_JSON[MCP_JSON.find("    \"docs\"").expect("docs")
        ..MCP_JSON.find("    \"remote\"").expect("remote")];
    assert!(after.contains(docs_block), "{after}");
    assert!(after.contains("  \"note\": \"kept\"\n}\n"), "{after}");
    assert_eq!(w.claude_log(), "", "a project file needs no claude call");

    let (_, v) = w.json(&["--only", "claude", "--project", &p, "--as", "ana", "--yes"]);
    assert_eq!(statuses(&v), pairs(&[("claude", "unchanged")]));
    assert_eq!(std::fs::read_to_string(&file).expect("read"), after);
    let (_, v) = w.json(&["--only", "claude", "--project", &p, "--uninstall", "--yes"]);
    assert_eq!(statuses(&v), pairs(&[("claude", "removed")]));
    assert_eq!(std::fs::read_to_string(&file).expect("read"), MCP_JSON);
}

#[test]
fn clients_not_installed_are_skipped_with_a_note() {
    let w = World::new(false, false);
    let out = w.run(&["setup", "--yes"]);
    out.assert_success();
    assert!(out.stdout.contains("no `claude` on PATH"), "{}", out.stdout);
    assert!(
        out.stdout.contains(".codex does not exist"),
        "{}",
        out.stdout
    );
    let (code, v) = w.json(&["--yes"]);
    assert_eq!(code, Some(0));
    assert_eq!(
        statuses(&v),
        pairs(&[("claude", "skipped"), ("codex", "skipped")])
    );
    assert!(!w.path("home/.codex").exists());
}

#[test]
fn without_yes_and_no_terminal_it_refuses_and_writes_nothing() {
    let w = World::new(true, true);
    let out = w.run(&["setup"]);
    assert_eq!(out.code(), Some(2), "{out:#?}");
    assert!(
        out.stderr.contains("--yes") && out.stderr.contains("--dry-run"),
        "{}",
        out.stderr
    );
    assert_eq!(w.codex(), CODEX_CONFIG);
    assert_eq!(w.claude_state(), None);
    let out = w.run(&["setup", "--as", "Bad_Name", "--yes"]);
    assert_eq!(out.code(), Some(2), "{out:#?}");
    assert!(out.stderr.contains("bad agent name"), "{}", out.stderr);
    assert_eq!(w.codex(), CODEX_CONFIG);
}

fn mcp_check(w: &World) -> Value {
    let out = w.run(&["doctor", "mcp-setup", "--json"]);
    out.assert_success();
    let v: Value = serde_json::from_str(&out.stdout).expect("json");
    v["checks"][0].clone()
}

#[test]
fn doctor_checks_the_registered_entries() {
    let w = World::new(true, false);
    let c = mcp_check(&w);
    assert_eq!(c["id"], "mcp-setup");
    assert_eq!(c["status"], "skip", "{c}");

    w.run(&["setup", "--as", "ana", "--yes"]).assert_success();
    let c = mcp_check(&w);
    assert_eq!(c["status"], "ok", "{c}");

    // The binary moved: warn, with the command that fixes it.
    let moved = w.codex().replace(&bin(), "/nowhere/agentmbx");
    std::fs::write(w.codex_file(), moved).expect("write");
    let c = mcp_check(&w);
    assert_eq!(c["status"], "warn", "{c}");
    assert!(
        c["details"][0]
            .as_str()
            .expect("detail")
            .contains("/nowhere/agentmbx (no such file)"),
        "{c}"
    );
    let fix = format!(
        "MBX_HOME={} agentmbx setup --as ana",
        w.path("mbx").display()
    );
    assert_eq!(c["fix"], fix.as_str());
    let out = w.run(&["setup", "--as", "ana", "--yes"]);
    assert!(out.stdout.contains("Codex: updated"), "{}", out.stdout);
    assert_eq!(mcp_check(&w)["status"], "ok");

    // Another home: warn too. A project .mcp.json in the working directory is checked as well.
    let mut cmd = w.command(&["doctor", "mcp-setup", "--json"]);
    cmd.env("MBX_HOME", w.path("other"));
    let out = run(cmd);
    let v: Value = serde_json::from_str(&out.stdout).expect("json");
    assert_eq!(v["checks"][0]["status"], "warn", "{v}");
    assert!(
        v["checks"][0]["details"][0]
            .as_str()
            .expect("d")
            .contains("not this home"),
        "{v}"
    );
    std::fs::write(
        w.path("work/.mcp.json"),
        r#"{"mcpServers": {"agentmbx": {"command": "/gone/agentmbx", "args": ["mcp"]}}}"#,
    )
    .expect("write");
    let c = mcp_check(&w);
    assert_eq!(c["status"], "warn", "{c}");
    assert!(
        c["summary"].as_str().expect("s").starts_with("1 of 2"),
        "{c}"
    );
}
