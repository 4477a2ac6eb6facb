//! Tests of `config.rs`: the file and environment layering, validation with its messages, and
//! the edits the CLI writes back.

use std::collections::HashMap;

use super::*;

fn env_of(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
    let map: HashMap<String, String> = pairs
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    move |k| map.get(k).cloned()
}

fn home_with(text: Option<&str>) -> (tempfile::TempDir, Paths) {
    let dir = tempfile::tempdir().unwrap();
    let paths = Paths::at(dir.path());
    if let Some(t) = text {
        std::fs::write(paths.config_file(), t).unwrap();
    }
    (dir, paths)
}

#[test]
fn defaults_without_file() {
    let (_d, paths) = home_with(None);
    let c = Config::load_with_env(&paths, env_of(&[])).unwrap();
    assert_eq!(c, Config::default());
    assert_eq!(c.api_addr().to_string(), "127.0.0.1:7375");
    assert_eq!((c.lan_port, c.relay_pull_interval_ms), (7373, 2000));
    assert_eq!(c.key_store, KeyStore::File);
}

#[test]
fn file_then_env_layering() {
    let (_d, paths) = home_with(Some(
        "host = \"alpha\"\napi_port = 8000\nlan_port = 9000\n[relay]\nurl = \"http://r:1\"\n\
         key = \"11qYAYKxCrfVS/7TyWQHOg7hcvPapiMlrwIaaPcHURo=\"\n",
    ));
    let file_only = Config::load_with_env(&paths, env_of(&[])).unwrap();
    assert_eq!(file_only.host.as_ref().map(HostName::as_str), Some("alpha"));
    assert_eq!((file_only.api_port, file_only.lan_port), (8000, 9000));
    let env = env_of(&[
        (API_PORT_ENV, "0"),
        (API_BIND_ENV, "::1"),
        (LAN_PORT_ENV, ""),
    ]);
    let c = Config::load_with_env(&paths, env).unwrap();
    assert_eq!(c.api_addr().to_string(), "[::1]:0");
    assert_eq!(c.lan_port, 9000, "an empty variable counts as unset");
    // Same relay URL keeps the pinned key; another URL drops it.
    let same = Config::load_with_env(&paths, env_of(&[(RELAY_URL_ENV, "http://r:1")])).unwrap();
    assert!(same.relay.unwrap().key.is_some());
    let other = Config::load_with_env(&paths, env_of(&[(RELAY_URL_ENV, "http://s:2")])).unwrap();
    assert_eq!(
        other.relay,
        Some(RelayConfig {
            url: "http://s:2".into(),
            key: None,
            token_command: None,
        })
    );
}

#[test]
fn the_token_command_is_validated_kept_by_set_relay_and_by_the_url_override() {
    let (_d, paths) = home_with(Some(
        "[relay]\nurl = \"http://r:1\"\ntoken_command = \"mbx-token --relay r\"\n",
    ));
    let c = Config::load_with_env(&paths, env_of(&[])).unwrap();
    let cmd = Some("mbx-token --relay r".to_owned());
    assert_eq!(c.relay.as_ref().unwrap().token_command, cmd);
    let other = Config::load_with_env(&paths, env_of(&[(RELAY_URL_ENV, "http://s:2")])).unwrap();
    assert_eq!(other.relay.unwrap().token_command, cmd);
    set_relay(
        &paths,
        Some(&RelayConfig {
            url: "http://t:3".into(),
            key: None,
            token_command: None,
        }),
    )
    .unwrap();
    let c = Config::load_with_env(&paths, env_of(&[])).unwrap();
    assert_eq!(c.relay.unwrap().token_command, cmd, "relay set keeps it");
    for bad in [
        "\"\"",
        "\"   \"",
        &format!("\"{}\"", "x".repeat(MAX_TOKEN_COMMAND_BYTES + 1)),
    ] {
        let (_d, paths) = home_with(Some(&format!(
            "[relay]\nurl = \"http://r:1\"\ntoken_command = {bad}\n"
        )));
        let err = Config::load_with_env(&paths, env_of(&[]))
            .map(|_| ())
            .unwrap_err()
            .to_string();
        assert!(err.contains("relay.token_command"), "{bad}: {err}");
    }
}

#[test]
fn unknown_keys_are_named() {
    let (_d, paths) = home_with(Some("api_port = 1\nbogus_key = 3\n"));
    let err = Config::load_with_env(&paths, env_of(&[]))
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("line 2") && err.contains("unknown key `bogus_key`"),
        "{err}"
    );
    let (_d, paths) = home_with(Some("[relay]\nurl = \"http://r\"\npin = \"x\"\n"));
    let err = Config::load_with_env(&paths, env_of(&[]))
        .unwrap_err()
        .to_string();
    assert!(err.contains("`pin`"), "{err}");
}

#[test]
fn relay_urls_are_checked_and_normalised() {
    for (given, normal) in [
        ("http://127.0.0.1:8787", "http://127.0.0.1:8787"),
        ("https://relay.example/", "https://relay.example"),
        ("https://relay.example/mbx//", "https://relay.example/mbx"),
        ("http://[::1]:8080/a/b", "http://[::1]:8080/a/b"),
        (
            "http://xn--bcher-kva.example:1",
            "http://xn--bcher-kva.example:1",
        ),
        ("http://r:65535", "http://r:65535"),
    ] {
        assert_eq!(check_relay_url(given).as_deref(), Ok(normal), "{given}");
    }
    let long = format!("http://r/{}", "a".repeat(MAX_RELAY_URL_BYTES - 9));
    assert_eq!(long.len(), MAX_RELAY_URL_BYTES);
    assert!(check_relay_url(&long).is_ok(), "at the bound");
    assert!(
        check_relay_url(&format!("{long}a")).is_err(),
        "past the bound"
    );
    for (bad, why) in [
        ("", "empty"),
        ("ftp://r", "http:// or https://"),
        ("HTTP://r", "http:// or https://"),
        ("http://", "no host"),
        ("http:///path", "no host"),
        ("http://user:hunter2@r", "user name or password"),
        ("http://@r", "user name or password"),
        ("http://r:99999", "1..=65535"),
        ("http://r:0", "1..=65535"),
        ("http://r:", "1..=65535"),
        ("http://r:8x", "1..=65535"),
        ("http://r/a?b=c", "query"),
        ("http://r/#frag", "fragment"),
        ("http://r/./a", "plain segments"),
        ("http://r/a/..", "plain segments"),
        ("http://r//a", "plain segments"),
        ("http://r/%2e%2e/a", "percent"),
        ("http://r\\a", "backslash"),
        ("http://r/a b", "whitespace"),
        (" http://r", "whitespace"),
        ("http://r\n", "whitespace"),
        ("http://r/\u{1b}[31m", "control"),
        ("http://r/\u{202e}a", "non-ASCII"),
        ("http://bücher.example", "non-ASCII"),
        ("http://r<>", "not a valid URL"),
    ] {
        let err = check_relay_url(bad).expect_err(bad).to_string();
        assert!(err.contains(why), "{bad:?}: {err}");
        assert!(
            !err.chars().any(|c| c.is_control() || !c.is_ascii()),
            "nothing raw is echoed: {err:?}"
        );
        assert!(!err.contains("hunter2"), "{err}");
    }
    // The daemon refuses such a URL at start, from the file or the environment.
    let (_d, paths) = home_with(Some("[relay]\nurl = \"http://u:pw@r:1\"\n"));
    let err = Config::load_with_env(&paths, env_of(&[])).unwrap_err();
    assert!(
        matches!(
            err,
            ConfigError::Invalid {
                key: "relay.url",
                ..
            }
        ),
        "{err}"
    );
    assert!(!err.to_string().contains("pw"), "{err}");
    let (_d, paths) = home_with(None);
    let err =
        Config::load_with_env(&paths, env_of(&[(RELAY_URL_ENV, "http://r:99999")])).unwrap_err();
    assert!(err.to_string().contains("relay.url"), "{err}");
    let c = Config::load_with_env(&paths, env_of(&[(RELAY_URL_ENV, "http://r:1/\n")])).unwrap();
    assert_eq!(c.relay.unwrap().url, "http://r:1/", "trimmed, as before");
}

#[test]
fn bad_values_are_refused() {
    let (_d, paths) = home_with(None);
    let err = Config::load_with_env(&paths, env_of(&[(API_PORT_ENV, "70000")])).unwrap_err();
    assert!(err.to_string().contains(API_PORT_ENV), "{err}");
    let err = Config::load_with_env(&paths, env_of(&[(RELAY_URL_ENV, "ftp://x")])).unwrap_err();
    assert!(err.to_string().contains("relay.url"), "{err}");
    let (_d, paths) = home_with(Some("relay_pull_interval_ms = 5\n"));
    assert!(Config::load_with_env(&paths, env_of(&[])).is_err());
    let (_d, paths) = home_with(Some("host = \"Bad Name\"\n"));
    assert!(Config::load_with_env(&paths, env_of(&[])).is_err());
    let (_d, paths) = home_with(Some("[relay]\nurl = \"http://r\"\nkey = \"nope\"\n"));
    let err = Config::load_with_env(&paths, env_of(&[])).unwrap_err();
    assert!(err.to_string().contains("relay.key"), "{err}");
}

#[test]
fn api_rate_is_read_checked_at_its_bounds_and_named_with_its_line() {
    let load = |text: &str| {
        let (_d, paths) = home_with(Some(text));
        Config::load_with_env(&paths, env_of(&[])).map_err(|e| e.to_string())
    };
    let c = load("[api_rate]\nsend_burst = 3\nmax_keys = 7\n").unwrap();
    assert_eq!((c.api_rate.send_burst, c.api_rate.max_keys), (3, 7));
    assert_eq!(
        c.api_rate.wait_burst,
        ApiRateConfig::default().wait_burst,
        "the rest keep their defaults"
    );
    assert!(load("").unwrap().api_rate.is_default());
    for (i, (key, min, max)) in API_RATE_RANGES.iter().enumerate() {
        let name = key.trim_start_matches("api_rate.");
        for (value, ok) in [
            (*min, true),
            (*max, true),
            (min - 1, false),
            (max + 1, false),
        ] {
            let text = format!("mdns = true\n[api_rate]\n{name} = {value}\n");
            match load(&text) {
                Ok(c) => {
                    assert!(ok, "{name} = {value} was accepted");
                    assert_eq!(c.api_rate.values()[i], value);
                }
                Err(e) => {
                    assert!(!ok, "{name} = {value}: {e}");
                    assert!(e.contains(&format!("`{key}`")), "{e}");
                    assert!(e.contains("line 3"), "{e}");
                    assert!(e.contains(&format!("{min}..={max}")), "{e}");
                }
            }
        }
    }
    let e = load("[api_rate]\nburst = 3\n").unwrap_err();
    assert!(e.contains("burst") && e.contains("line 2"), "{e}");
}

#[test]
fn validate_names_each_fault_at_and_past_the_bounds() {
    let load = |text: &str| {
        let (_d, paths) = home_with(Some(text));
        Config::load_with_env(&paths, env_of(&[])).map_err(|e| e.to_string())
    };
    for ok in [
        format!("relay_pull_interval_ms = {MIN_RELAY_PULL_INTERVAL_MS}\n"),
        format!("relay_pull_interval_ms = {MAX_RELAY_PULL_INTERVAL_MS}\n"),
        "log_level = \"debug\"\n".into(),
        "log_level = \"info,agentmbx::transport=trace\"\n".into(),
        format!("log_level = \"{}\"\n", "a".repeat(MAX_LOG_LEVEL_BYTES)),
    ] {
        assert!(load(&ok).is_ok(), "{ok}: {:?}", load(&ok));
    }
    for (bad, named) in [
        (
            format!(
                "relay_pull_interval_ms = {}\n",
                MIN_RELAY_PULL_INTERVAL_MS - 1
            ),
            "`relay_pull_interval_ms`",
        ),
        (
            format!(
                "relay_pull_interval_ms = {}\n",
                MAX_RELAY_PULL_INTERVAL_MS + 1
            ),
            "`relay_pull_interval_ms`",
        ),
        (
            format!("log_level = \"{}\"\n", "a".repeat(MAX_LOG_LEVEL_BYTES + 1)),
            "`log_level`",
        ),
        ("log_level = \" \"\n".into(), "`log_level`"),
        ("log_level = \"info,[\"\n".into(), "`log_level`"),
        ("log_level = 3\n".into(), "line 1"),
        ("api_port = \"x\"\n".into(), "line 1"),
        ("api_port = -1\n".into(), "line 1"),
        ("mdns = true\nlan_port = 65536\n".into(), "line 2"),
        (
            "mdns = true\nnot_a_key = 1\n".into(),
            "unknown key `not_a_key`",
        ),
    ] {
        let err = load(&bad).expect_err(&bad);
        assert!(err.contains(named), "{bad}: {err}");
    }
}

#[test]
fn record_host_creates_adds_and_refuses_conflicts() {
    let alpha = HostName::parse("alpha").unwrap();
    let (_d, paths) = home_with(None);
    record_host(&paths, &alpha).unwrap();
    let c = Config::load_with_env(&paths, env_of(&[])).unwrap();
    assert_eq!(c.host, Some(alpha.clone()));
    record_host(&paths, &alpha).unwrap();
    let beta = HostName::parse("beta").unwrap();
    assert!(matches!(
        record_host(&paths, &beta),
        Err(ConfigError::HostConflict { .. })
    ));

    let (_d, paths) = home_with(Some("# mine\napi_port = 1\n[relay]\nurl = \"http://r\"\n"));
    record_host(&paths, &beta).unwrap();
    let c = Config::load_with_env(&paths, env_of(&[])).unwrap();
    assert_eq!((c.host, c.api_port), (Some(beta), 1));
    let text = std::fs::read_to_string(paths.config_file()).unwrap();
    assert!(text.ends_with("# mine\napi_port = 1\n[relay]\nurl = \"http://r\"\n"));
}

#[test]
fn record_key_store_adds_replaces_and_keeps_the_rest() {
    let (_d, paths) = home_with(Some(
        "# mine\nhost = \"alpha\"\n[relay]\nurl = \"http://r\"\n",
    ));
    record_key_store(&paths, KeyStore::Keyring).unwrap();
    let c = Config::load_with_env(&paths, env_of(&[])).unwrap();
    assert_eq!(c.key_store, KeyStore::Keyring);
    record_key_store(&paths, KeyStore::File).unwrap();
    let text = std::fs::read_to_string(paths.config_file()).unwrap();
    assert_eq!(
        text, "# mine\nkey_store = \"file\"\nhost = \"alpha\"\n[relay]\nurl = \"http://r\"\n",
        "after the opening comment"
    );
    record_key_store(&paths, KeyStore::File).unwrap();
    assert_eq!(std::fs::read_to_string(paths.config_file()).unwrap(), text);
}

fn set(paths: &Paths, url: &str, key: Option<&str>) {
    set_relay(
        paths,
        Some(&RelayConfig {
            url: url.into(),
            key: key.map(str::to_owned),
            token_command: None,
        }),
    )
    .unwrap();
}

const KEY: &str = "11qYAYKxCrfVS/7TyWQHOg7hcvPapiMlrwIaaPcHURo=";

#[test]
fn set_relay_keeps_every_other_byte() {
    // No [relay] table: one is appended; comments, order and inline comments stay.
    let head = "# agentmbx host configuration.\nkey_store = \"file\"\nhost = \"alpha\" # mine\n\n# ports\nlan_port = 9000\n";
    let (_d, paths) = home_with(Some(head));
    set(&paths, "http://r:1", Some(KEY));
    let text = std::fs::read_to_string(paths.config_file()).unwrap();
    assert_eq!(
        text,
        format!("{head}\n[relay]\nurl = \"http://r:1\"\nkey = \"{KEY}\"\n")
    );
    // An existing table, last in the file: its lines are replaced in place.
    set(&paths, "https://s.example", None);
    let text = std::fs::read_to_string(paths.config_file()).unwrap();
    assert_eq!(
        text,
        format!("{head}\n[relay]\nurl = \"https://s.example\"\n")
    );
    // Removing the table keeps the rest.
    set_relay(&paths, None).unwrap();
    let text = std::fs::read_to_string(paths.config_file()).unwrap();
    assert_eq!(text, head);

    // A table that is not last, with comments and an inline comment on the url.
    let file = "# top\nhost = \"alpha\"\n[relay] # the relay\n# where\nurl = \"http://old:1\"   # old one\ntoken_command = 'tok --x' # t\n\n# next table\n[other]\n";
    let edited = edit_relay_table(
        file,
        Some(&RelayConfig {
            url: "http://new:2".into(),
            key: Some(KEY.into()),
            token_command: Some("tok --x".into()),
        }),
    );
    assert_eq!(
        edited,
        format!("# top\nhost = \"alpha\"\n[relay] # the relay\n# where\nurl = \"http://new:2\"   # old one\ntoken_command = \"tok --x\" # t\nkey = \"{KEY}\"\n\n# next table\n[other]\n")
    );
    assert_eq!(
        edit_relay_table(file, None),
        "# top\nhost = \"alpha\"\n\n# next table\n[other]\n"
    );
    // Through set_relay: a trailing comment after the table stays after it.
    let (_d, paths) = home_with(Some(
        "host = \"alpha\"\n[relay]\nurl = \"http://old:1\" # was\nkey = \"11qYAYKxCrfVS/7TyWQHOg7hcvPapiMlrwIaaPcHURo=\"\n# trailing note\n",
    ));
    set(&paths, "http://new:2", None);
    assert_eq!(
        std::fs::read_to_string(paths.config_file()).unwrap(),
        "host = \"alpha\"\n[relay]\nurl = \"http://new:2\" # was\n# trailing note\n"
    );
    // A relay given as an inline table cannot be edited by line: re-serialised, correct.
    let (_d, paths) = home_with(Some("relay = { url = \"http://old:1\" }\n"));
    set(&paths, "http://new:2", None);
    let c = Config::load_with_env(&paths, env_of(&[])).unwrap();
    assert_eq!(c.relay.unwrap().url, "http://new:2");
    // A missing file gets just the table.
    let (_d, paths) = home_with(None);
    set(&paths, "http://r:1", None);
    assert_eq!(
        std::fs::read_to_string(paths.config_file()).unwrap(),
        "[relay]\nurl = \"http://r:1\"\n"
    );
}

#[test]
fn value_errors_name_the_file_the_key_and_the_line() {
    let load = |text: &str| {
        let (_d, paths) = home_with(Some(text));
        let err = Config::load_with_env(&paths, env_of(&[]))
            .map(|_| ())
            .unwrap_err()
            .to_string();
        (err, paths.config_file().display().to_string())
    };
    for (text, wanted) in [
        (
            "host = \"alpha\"\n[relay]\nurl = \"not a url\"\n",
            &["line 3", "`relay.url`", "(a space)"][..],
        ),
        (
            "host = \"alpha\"\nlan_bind = \"1.2.3\"\n",
            &["line 2", "`lan_bind`", "not an IP address"][..],
        ),
        (
            "api_port = 70000\n",
            &["line 1", "`api_port`", "a port number 0-65535"][..],
        ),
        (
            "\nrelay_pull_interval_ms = \"x\"\n",
            &["line 2", "`relay_pull_interval_ms`", "whole number"][..],
        ),
        (
            "\n\nrelay_pull_interval_ms = 5\n",
            &["line 3", "`relay_pull_interval_ms`", "5 ms"][..],
        ),
        (
            "[relay]\nurl = \"http://r\"\nkey = \"0123-4567-89ab-cdef\"\n",
            &[
                "line 3",
                "`relay.key`",
                "base64",
                "agentmbx relay set <url> --key <fingerprint or key>",
            ][..],
        ),
    ] {
        let (err, file) = load(text);
        assert!(err.starts_with(&file), "{text}: {err}");
        for w in wanted {
            assert!(err.contains(w), "{text}: {w:?} not in {err}");
        }
        for rust in ["u16", "u64", "IpAddr", "struct"] {
            assert!(!err.contains(rust), "{text}: {err}");
        }
    }
}

#[test]
fn the_push_stream_switch_is_read_from_the_file_and_the_env_and_checked() {
    let (_d, paths) = home_with(None);
    assert!(
        Config::load_with_env(&paths, env_of(&[]))
            .unwrap()
            .relay_stream,
        "on by default"
    );
    let (_d, off) = home_with(Some("relay_stream = false\n"));
    assert!(
        !Config::load_with_env(&off, env_of(&[]))
            .unwrap()
            .relay_stream
    );
    for (v, on) in [
        ("0", false),
        ("off", false),
        (" No ", false),
        ("1", true),
        ("TRUE", true),
    ] {
        let c = Config::load_with_env(&paths, env_of(&[(RELAY_STREAM_ENV, v)])).unwrap();
        assert_eq!(c.relay_stream, on, "{v:?}");
    }
    // The env beats the file.
    let c = Config::load_with_env(&off, env_of(&[(RELAY_STREAM_ENV, "1")])).unwrap();
    assert!(c.relay_stream);
    // Empty is unset, as for every variable.
    let c = Config::load_with_env(&off, env_of(&[(RELAY_STREAM_ENV, " ")])).unwrap();
    assert!(!c.relay_stream);
    for v in ["2", "disabled", "0x", "-1"] {
        let err = Config::load_with_env(&paths, env_of(&[(RELAY_STREAM_ENV, v)])).unwrap_err();
        assert!(err.to_string().contains(RELAY_STREAM_ENV), "{v:?}: {err}");
    }
    let (_d, bad) = home_with(Some("relay_stream = \"yes\"\n"));
    let err = Config::load_with_env(&bad, env_of(&[])).unwrap_err();
    assert!(err.to_string().contains("relay_stream"), "{err}");
}
