//! The launchd agent of the host daemon (`~/Library/LaunchAgents/<label>.plist`).
//!
//! Owns the property list for a [`ServiceSpec`], written by hand (XML 1.0, Apple's plist DTD)
//! with every string escaped: `RunAtLoad`, `KeepAlive {SuccessfulExit=false}` (restart after a
//! crash, not after a clean stop), log paths, and `EnvironmentVariables` with `MBX_HOME` (the
//! data dir, always) and a fixed `PATH` ([`super::LAUNCHD_PATH`]; wire.md §8).
//! It must never put secrets into the file.

use super::{ServiceSpec, LAUNCHD_PATH};

/// Seconds launchd waits before restarting the agent (`ThrottleInterval`).
pub const THROTTLE_SEC: u32 = 5;

/// Escapes text for an XML element: `&`, `<`, `>` (and quotes, harmlessly). Control
/// characters other than tab and newline cannot appear in XML 1.0 and are dropped.
pub fn escape(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&apos;"),
            '\t' | '\n' => out.push(c),
            c if (c as u32) < 0x20 => {}
            c => out.push(c),
        }
    }
    out
}

fn string(text: &str) -> String {
    format!("<string>{}</string>", escape(text))
}

/// The plist text for `spec` (exact; tests snapshot it).
pub fn plist(spec: &ServiceSpec) -> String {
    let log = spec.log_dir.join("daemon.log").display().to_string();
    let env = format!(
        "\t<key>EnvironmentVariables</key>\n\t<dict>\n\t\t<key>MBX_HOME</key>\n\t\t{}\n\t\t<key>PATH</key>\n\t\t{}\n\t</dict>\n",
        string(&spec.data_dir.display().to_string()),
        string(LAUNCHD_PATH)
    );
    format!(
        "<?xml version=\"1.0\" encoding=\"UTF-8\"?>
<!DOCTYPE plist PUBLIC \"-//Apple//DTD PLIST 1.0//EN\" \"http://www.apple.com/DTDs/PropertyList-1.0.dtd\">
<plist version=\"1.0\">
<dict>
\t<key>Label</key>
\t{label}
\t<key>ProgramArguments</key>
\t<array>
\t\t{bin}
\t\t<string>daemon</string>
\t</array>
{env}\t<key>RunAtLoad</key>
\t<true/>
\t<key>KeepAlive</key>
\t<dict>
\t\t<key>SuccessfulExit</key>
\t\t<false/>
\t</dict>
\t<key>ThrottleInterval</key>
\t<integer>{THROTTLE_SEC}</integer>
\t<key>StandardOutPath</key>
\t{log}
\t<key>StandardErrorPath</key>
\t{log}
</dict>
</plist>
",
        label = string(&spec.label),
        bin = string(&spec.binary.display().to_string()),
        log = string(&log),
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::service::LAUNCHD_LABEL;

    fn spec(home: &str, bin: &str) -> ServiceSpec {
        ServiceSpec {
            binary: bin.into(),
            data_dir: home.into(),
            log_dir: "/Users/ann/Library/Logs/agentmbx".into(),
            label: LAUNCHD_LABEL.into(),
        }
    }

    #[test]
    fn plist_snapshot() {
        let text = plist(&spec("/Users/ann/mbx", "/opt/homebrew/bin/agentmbx"));
        assert_eq!(
            text,
            "<?xml version=\"1.0\" encoding=\"UTF-8\"?>
<!DOCTYPE plist PUBLIC \"-//Apple//DTD PLIST 1.0//EN\" \"http://www.apple.com/DTDs/PropertyList-1.0.dtd\">
<plist version=\"1.0\">
<dict>
\t<key>Label</key>
\t<string>com.agentmbx.daemon</string>
\t<key>ProgramArguments</key>
\t<array>
\t\t<string>/opt/homebrew/bin/agentmbx</string>
\t\t<string>daemon</string>
\t</array>
\t<key>EnvironmentVariables</key>
\t<dict>
\t\t<key>MBX_HOME</key>
\t\t<string>/Users/ann/mbx</string>
\t\t<key>PATH</key>
\t\t<string>/opt/homebrew/bin:/usr/local/bin:/usr/bin:/bin:/usr/sbin:/sbin</string>
\t</dict>
\t<key>RunAtLoad</key>
\t<true/>
\t<key>KeepAlive</key>
\t<dict>
\t\t<key>SuccessfulExit</key>
\t\t<false/>
\t</dict>
\t<key>ThrottleInterval</key>
\t<integer>5</integer>
\t<key>StandardOutPath</key>
\t<string>/Users/ann/Library/Logs/agentmbx/daemon.log</string>
\t<key>StandardErrorPath</key>
\t<string>/Users/ann/Library/Logs/agentmbx/daemon.log</string>
</dict>
</plist>
"
        );
        assert!(!text.contains("ProcessType"));
    }

    #[test]
    fn plist_parses_with_the_keys_and_escaped_values() {
        let odd = "/Users/a&b/<bin> \"x\"/agentmbx";
        let text = plist(&spec("/Users/a&b/home", odd));
        let value = plist::Value::from_reader_xml(text.as_bytes()).expect("plist parses");
        let dict = value.as_dictionary().expect("top-level dict");
        assert_eq!(
            dict.get("Label").and_then(|v| v.as_string()),
            Some(LAUNCHD_LABEL)
        );
        let args: Vec<&str> = dict
            .get("ProgramArguments")
            .and_then(|v| v.as_array())
            .expect("ProgramArguments")
            .iter()
            .filter_map(|v| v.as_string())
            .collect();
        assert_eq!(args, vec![odd, "daemon"]);
        assert_eq!(
            dict.get("RunAtLoad").and_then(|v| v.as_boolean()),
            Some(true)
        );
        let keep = dict
            .get("KeepAlive")
            .and_then(|v| v.as_dictionary())
            .expect("KeepAlive dict");
        assert_eq!(
            keep.get("SuccessfulExit").and_then(|v| v.as_boolean()),
            Some(false)
        );
        let env = dict
            .get("EnvironmentVariables")
            .and_then(|v| v.as_dictionary())
            .expect("EnvironmentVariables");
        assert_eq!(
            env.get("MBX_HOME").and_then(|v| v.as_string()),
            Some("/Users/a&b/home")
        );
        for key in ["StandardOutPath", "StandardErrorPath"] {
            assert_eq!(
                dict.get(key).and_then(|v| v.as_string()),
                Some("/Users/ann/Library/Logs/agentmbx/daemon.log")
            );
        }
    }

    #[test]
    fn escape_drops_control_characters() {
        assert_eq!(escape("a\u{1}b&<>"), "ab&amp;&lt;&gt;");
    }
}
