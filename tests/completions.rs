//! `agentmbx completions <shell>`: each shell's script names the subcommands (nested ones too)
//! and goes to stdout; an unknown shell is a usage error (exit 2) with nothing on stdout.

use std::process::Command;

fn completions(shell: &str) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_agentmbx"))
        .args(["completions", shell])
        .env_remove("MBX_HOME")
        .output()
        .expect("run agentmbx")
}

#[test]
fn every_shell_gets_a_script_naming_the_subcommands() {
    for (shell, marker) in [
        ("bash", "complete -F _agentmbx"),
        ("zsh", "#compdef agentmbx"),
        ("fish", "complete -c agentmbx"),
        ("elvish", "edit:completion:arg-completer[agentmbx]"),
        ("powershell", "Register-ArgumentCompleter"),
    ] {
        let out = completions(shell);
        assert!(out.status.success(), "{shell}: {out:?}");
        let script = String::from_utf8(out.stdout).expect("utf-8 script");
        assert!(script.contains(marker), "{shell} script lacks {marker:?}");
        for sub in ["relay", "serve", "backup", "whoami", "completions"] {
            assert!(script.contains(sub), "{shell} script lacks {sub}");
        }
        assert!(out.stderr.is_empty(), "{shell}: nothing on stderr");
    }
}

#[test]
fn an_unknown_shell_is_a_usage_error() {
    let out = completions("tcsh");
    assert_eq!(out.status.code(), Some(2));
    assert!(out.stdout.is_empty());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("tcsh") && err.contains("bash"), "{err}");
}
